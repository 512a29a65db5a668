/* Shared by the collectives benchmark programs (bench_collectives, mpi_collectives; the rules are
 * mirrored in bench/torch_gloo.py): arguments, sizes, the iteration plan, bus bandwidth factors
 * and the JSON result line. Definitions follow nccl-tests:
 *
 *   bytes  all_reduce, broadcast: the tensor; all_gather: the OUTPUT (world * input);
 *          reduce_scatter: the INPUT (world * output); all_to_all: the input (= the output).
 *   algbw  bytes / time, GB/s (1e9 B/s).
 *   busbw  algbw * factor: all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n;
 *          broadcast 1.
 *
 * Plan of one (op, size) point, the same for every system: a fixed number of untimed warm-up
 * iterations (coll_warmup_iters); the per-iteration time of the warm-up after its first iteration,
 * maximised over the ranks, gives the number of timed iterations (coll_timed_iters: about
 * --budget seconds, at least 3 unless one iteration takes longer than the budget (then 1), at most
 * --max-iters); then all ranks synchronise, run them, and the maximum over the ranks of each
 * rank's elapsed time divided by the count is the time of the op. Tensors are f32, filled with
 * zeros (so that repeated in-place sums stay finite); reductions are sums; broadcast's root is 0.
 */
#ifndef WEFT_BENCH_COLL_COMMON_H
#define WEFT_BENCH_COLL_COMMON_H

#include "bench_common.h"

#define COLL_MAX_SIZES        32
#define COLL_DEFAULT_BUDGET_S 0.4
#define COLL_QUICK_BUDGET_S   0.1
#define COLL_DEFAULT_MAX_ITER 10000
#define COLL_QUICK_MAX_ITER   1000
#define COLL_DEFAULT_TIMEOUT  600.0

typedef enum {
    COLL_ALL_REDUCE = 0,
    COLL_BROADCAST = 1,
    COLL_ALL_GATHER = 2,
    COLL_REDUCE_SCATTER = 3,
    COLL_ALL_TO_ALL = 4,
    COLL_OP_COUNT = 5,
} coll_op_t;

static const char *const coll_op_names[COLL_OP_COUNT] = {
    "all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all",
};

typedef struct {
    int world;                    /**< ranks; 0 when not given (MPI takes its own) */
    int quick;                    /**< --quick: sizes 4K 1M 16M, shorter budget */
    unsigned ops;                 /**< bit (1u << op) for each op to run */
    size_t sizes[COLL_MAX_SIZES]; /**< bytes, as defined above */
    int nsizes;
    double budget_s;    /**< timed seconds aimed at per point */
    size_t max_iters;   /**< timed iterations at most per point */
    double timeout_s;   /**< the whole run's deadline (ranks are killed after it) */
    const char *system; /**< --system: the name printed (NULL: the program's own) */
} coll_args_t;

/* f32 elements of the op's input and output on each rank for a point of @p bytes. */
static inline void coll_counts(coll_op_t op, size_t bytes, int world, size_t *in_p, size_t *out_p)
{
    size_t n = bytes / sizeof(float);
    switch (op) {
    case COLL_ALL_GATHER:
        *in_p = n / (size_t)world;
        *out_p = n;
        break;
    case COLL_REDUCE_SCATTER:
        *in_p = n;
        *out_p = n / (size_t)world;
        break;
    case COLL_ALL_TO_ALL:
        *in_p = n;
        *out_p = n;
        break;
    default: /* all_reduce, broadcast: in place */
        *in_p = n;
        *out_p = 0;
        break;
    }
}

static inline double coll_busbw_factor(coll_op_t op, int world)
{
    double n = (double)world;
    switch (op) {
    case COLL_ALL_REDUCE:
        return 2.0 * (n - 1.0) / n;
    case COLL_BROADCAST:
        return 1.0;
    default:
        return (n - 1.0) / n;
    }
}

/* Untimed iterations before a point: more for small sizes, where the first ones cost most. */
static inline size_t coll_warmup_iters(const coll_args_t *a, size_t bytes)
{
    if (bytes <= (256u << 10)) {
        return a->quick ? 5 : 10;
    }
    if (bytes <= (4u << 20)) {
        return 3;
    }
    return bytes <= (16u << 20) ? 2 : 1;
}

/* Timed iterations for a per-iteration estimate of @p est_s seconds (the max over the ranks). */
static inline size_t coll_timed_iters(const coll_args_t *a, double est_s)
{
    if (est_s <= 0.0) {
        return a->max_iters;
    }
    double want = a->budget_s / est_s;
    size_t n;
    if (est_s <= a->budget_s) {
        n = want < 3.0 ? 3 : (size_t)(want + 0.5);
    } else {
        n = 1;
    }
    return n > a->max_iters ? a->max_iters : n;
}

static inline void coll_print(const char *system, coll_op_t op, int world, size_t bytes,
                              double time_s, size_t iters)
{
    double algbw = (double)bytes / time_s / 1e9;
    printf("{\"system\":\"%s\",\"op\":\"%s\",\"world\":%d,\"bytes\":%zu,\"time_us\":%.3f,"
           "\"algbw\":%.6g,\"busbw\":%.6g,\"iters\":%zu}\n",
           system, coll_op_names[op], world, bytes, time_s * 1e6, algbw,
           algbw * coll_busbw_factor(op, world), iters);
    fflush(stdout);
}

static inline void coll_usage(const char *prog)
{
    fprintf(stderr,
            "usage: %s [WORLD] [--quick] [--ops OP,...] [--sizes SIZE,...] [--budget S]\n"
            "          [--max-iters N] [--timeout S] [--system NAME]\n"
            "OP: all_reduce broadcast all_gather reduce_scatter all_to_all (default: all).\n"
            "SIZE takes K/M/G (binary) suffixes; default 4K..256M in powers of 4 (--quick: 4K 1M "
            "16M).\n",
            prog);
}

/* Parses a comma list of op names into a bit mask; 0 on an unknown name. */
static inline unsigned coll_parse_ops(const char *s)
{
    unsigned mask = 0;
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", s);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok != NULL;
         tok = strtok_r(NULL, ",", &save)) {
        int found = -1;
        for (int i = 0; i < COLL_OP_COUNT; i++) {
            if (strcmp(tok, coll_op_names[i]) == 0) {
                found = i;
            }
        }
        if (found < 0) {
            return 0;
        }
        mask |= 1u << found;
    }
    return mask;
}

/* Parses argv[1..]; returns 0 on success, prints usage and returns -1 otherwise. */
static inline int coll_parse_args(int argc, char **argv, coll_args_t *a)
{
    const char *sizes = NULL;
    memset(a, 0, sizeof(*a));
    a->ops = (1u << COLL_OP_COUNT) - 1;
    a->budget_s = -1.0;
    a->timeout_s = COLL_DEFAULT_TIMEOUT;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(argv[i], "--quick") == 0) {
            a->quick = 1;
        } else if (strcmp(argv[i], "--ops") == 0 && v != NULL) {
            a->ops = coll_parse_ops(v);
            i++;
        } else if (strcmp(argv[i], "--sizes") == 0 && v != NULL) {
            sizes = v;
            i++;
        } else if (strcmp(argv[i], "--budget") == 0 && v != NULL) {
            a->budget_s = atof(v);
            i++;
        } else if (strcmp(argv[i], "--max-iters") == 0 && v != NULL) {
            a->max_iters = bench_parse_size(v);
            i++;
        } else if (strcmp(argv[i], "--system") == 0 && v != NULL) {
            a->system = v;
            i++;
        } else if (strcmp(argv[i], "--timeout") == 0 && v != NULL) {
            a->timeout_s = atof(v);
            i++;
        } else if (argv[i][0] != '-' && a->world == 0) {
            a->world = atoi(argv[i]);
            if (a->world < 2) {
                goto err_usage;
            }
        } else {
            goto err_usage;
        }
    }
    if (a->budget_s < 0.0) {
        a->budget_s = a->quick ? COLL_QUICK_BUDGET_S : COLL_DEFAULT_BUDGET_S;
    }
    if (a->max_iters == 0) {
        a->max_iters = a->quick ? COLL_QUICK_MAX_ITER : COLL_DEFAULT_MAX_ITER;
    }
    if (sizes == NULL) {
        sizes = a->quick ? "4K,1M,16M" : "4K,16K,64K,256K,1M,4M,16M,64M,256M";
    }
    char buf[512];
    snprintf(buf, sizeof(buf), "%s", sizes);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok != NULL;
         tok = strtok_r(NULL, ",", &save)) {
        size_t b = bench_parse_size(tok);
        if (b == 0 || b % sizeof(float) != 0 || a->nsizes == COLL_MAX_SIZES) {
            goto err_usage;
        }
        a->sizes[a->nsizes++] = b;
    }
    if (a->ops == 0 || a->nsizes == 0 || a->budget_s <= 0.0 || a->timeout_s <= 0.0) {
        goto err_usage;
    }
    return 0;

err_usage:
    coll_usage(argv[0]);
    return -1;
}

/* Whether every size splits into @p world equal f32 parts; prints the first that does not. */
static inline int coll_check_world(const coll_args_t *a, int world)
{
    for (int i = 0; i < a->nsizes; i++) {
        if (world < 2 || (a->sizes[i] / sizeof(float)) % (size_t)world != 0) {
            fprintf(stderr, "%zu bytes do not split into %d f32 parts\n", a->sizes[i], world);
            return -1;
        }
    }
    return 0;
}

#endif
