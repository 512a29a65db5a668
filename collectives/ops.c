/* The operation runner and the algorithm table: runs an operation of a group with the
 * algorithm the group forced or the one its size calls for, tells the other members when it
 * failed here, and completes its future. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* all_reduce: the direct exchange up to 64 KiB (latency: one round), the ring above; with
 * two ranks the direct exchange moves the same bytes as the ring in one round, and the ring
 * wins from 1 MiB: each rank reduces half the tensor, as it arrives, and its pieces (>= 256
 * KiB each, on the direct connections) land in place. */
#define DIRECT_MAX_BYTES (64u << 10)
#define RING2_MIN_BYTES  (1u << 20)
/* From these sizes ranks on one host read each other's buffers (cma.c): three short
 * rounds of messages, then one kernel copy per byte moved. Two ranks: the ring's single
 * exchange is faster below 2 MiB (measured: 2.9 against 2.1 GB/s at 1 MiB). */
#define CMA_MIN_BYTES  (256u << 10)
#define CMA2_MIN_BYTES (2u << 20)

static size_t ring_min_bytes(const coll_group_t *g)
{
    return g->size > 2 ? DIRECT_MAX_BYTES + 1 : RING2_MIN_BYTES;
}

static size_t cma_min_bytes(const coll_group_t *g)
{
    return g->size == 2 ? CMA2_MIN_BYTES : CMA_MIN_BYTES;
}

/* The other operations read each other's memory from these sizes (bytes per member: the
 * tensor of broadcast, the input of all_gather and all_to_all, the output of reduce_scatter). */
#define CMA_MOVE_MIN_BYTES (64u << 10)

static size_t cma_move_min_bytes(const coll_group_t *g)
{
    (void)g;
    return CMA_MOVE_MIN_BYTES;
}

/* all_reduce up to this size between ranks of one host: one round of reads (cma.c), no
 * message at all once the group settled. */
static size_t oneshot_max_bytes(const coll_group_t *g)
{
    (void)g;
    return COLL_ONESHOT_MAX_BYTES;
}

#define CMA_DECLINES                                                                               \
    "unless a member cannot read the others' memory or does not let them (WEFT_COLL_CMA=0)"

/* ------------------------------------------------------------ the algorithm table */

/* Every algorithm of every operation. An operation chosen by size runs the entry of its kind
 * with the highest score among those whose range (min_bytes .. max_bytes) holds its size. */
static const coll_algo_t algos[] = {
    {"direct", OP_ALL_REDUCE, 1, NULL, NULL, coll__all_reduce_direct, NULL},
    {"ring", OP_ALL_REDUCE, 2, ring_min_bytes, NULL, coll__all_reduce_ring, NULL},
    {"cma", OP_ALL_REDUCE, 3, cma_min_bytes, CMA_DECLINES, coll__all_reduce_cma, NULL},
    {"oneshot", OP_ALL_REDUCE, 4, NULL, CMA_DECLINES, coll__all_reduce_oneshot, oneshot_max_bytes},
    {"direct", OP_BARRIER, 1, NULL, NULL, coll__barrier, NULL},
    {"tree", OP_BROADCAST, 1, NULL, NULL, coll__broadcast, NULL},
    {"cma", OP_BROADCAST, 2, cma_move_min_bytes, CMA_DECLINES, coll__broadcast_cma, NULL},
    {"direct", OP_REDUCE, 1, NULL, NULL, coll__reduce, NULL},
    {"direct", OP_GATHER, 1, NULL, NULL, coll__gather, NULL},
    {"direct", OP_SCATTER, 1, NULL, NULL, coll__scatter, NULL},
    {"direct", OP_ALL_GATHER, 1, NULL, NULL, coll__all_gather, NULL},
    {"cma", OP_ALL_GATHER, 2, cma_move_min_bytes, CMA_DECLINES, coll__all_gather_cma, NULL},
    {"direct", OP_REDUCE_SCATTER, 1, NULL, NULL, coll__reduce_scatter, NULL},
    {"cma", OP_REDUCE_SCATTER, 2, cma_move_min_bytes, CMA_DECLINES, coll__reduce_scatter_cma, NULL},
    {"direct", OP_ALL_TO_ALL, 1, NULL, NULL, coll__all_to_all, NULL},
    {"cma", OP_ALL_TO_ALL, 2, cma_move_min_bytes, CMA_DECLINES, coll__all_to_all_cma, NULL},
};
#define NALGOS (sizeof(algos) / sizeof(algos[0]))

/* The operations each entry ran, in this process (tests). */
static _Atomic long algo_runs[NALGOS];

int coll__algo_find(coll_kind_t kind, const char *name)
{
    for (size_t i = 0; i < NALGOS; i++) {
        if (algos[i].kind == kind && strcmp(algos[i].name, name) == 0) {
            return (int)i;
        }
    }
    return -1;
}

long coll__algo_runs(coll_kind_t kind, const char *name)
{
    int i = coll__algo_find(kind, name);
    return i < 0 ? 0 : atomic_load(&algo_runs[i]);
}

static size_t min_bytes(const coll_group_t *g, int i)
{
    return algos[i].min_bytes != NULL ? algos[i].min_bytes(g) : 0;
}

static size_t max_bytes(const coll_group_t *g, int i)
{
    return algos[i].max_bytes != NULL ? algos[i].max_bytes(g) : SIZE_MAX;
}

/* The choice by size: the best entry of @p kind for @p bytes other than @p except. Every
 * kind has an entry that applies from 0 bytes. */
static int choose(const coll_group_t *g, coll_kind_t kind, size_t bytes, int except)
{
    int best = -1;
    for (size_t i = 0; i < NALGOS; i++) {
        /* A group whose members settled against reading each other's memory (another host,
         * WEFT_COLL_CMA=0 on one of them: every member settled alike, from the same HELLOs) no
         * longer asks: it would cost a round of messages per operation. */
        bool settled_off = algos[i].declines != NULL && g->cma_state < 0;
        if (algos[i].kind == kind && (int)i != except && !settled_off &&
            bytes >= min_bytes(g, (int)i) && bytes <= max_bytes(g, (int)i) &&
            (best < 0 || algos[i].score > algos[best].score)) {
            best = (int)i;
        }
    }
    return best;
}

/* Runs the operation's algorithm: the one the group had when it was issued, or the choice
 * by size; when that one declines, the choice by size among the others. */
static weft_status_t run_algo(coll_group_t *g, const coll_args_t *a, size_t bytes, int64_t deadline)
{
    coll_kind_t kind = a->op->kind;
    if (kind == OP_ALL_TO_ALL) {
        /* Members of an uneven all_to_all hold tensors of other sizes, and no member knows the
         * others': a choice by size could differ between them, each then waiting for the
         * other's algorithm until the deadline. So every member takes the best algorithm
         * of all, whatever its size (the same one, as long as they share the table). */
        bytes = SIZE_MAX / 2;
    }
    int i = a->op->algo >= 0 ? a->op->algo : choose(g, kind, bytes, -1);
    bool declined = false;

    if (i < 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: no algorithm", coll__kind_name(kind));
    }
    weft_status_t st = algos[i].run(g, a, deadline, &declined);
    if (declined) {
        i = choose(g, kind, bytes, i);
        if (i < 0) {
            return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: no algorithm", coll__kind_name(kind));
        }
        st = algos[i].run(g, a, deadline, &declined);
    }
    atomic_fetch_add(&algo_runs[i], 1);
    return st;
}

/* ------------------------------------------------------------ describing a group's choice */

void coll__appendf(char *buf, size_t n, size_t *len_p, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(*len_p < n ? buf + *len_p : NULL, *len_p < n ? n - *len_p : 0, fmt, ap);
    va_end(ap);
    if (k > 0) {
        *len_p += (size_t)k;
    }
}

/* "from 2 MiB", "from 256 KiB", "above 64 KiB" (from 64 KiB + 1), "from 1000 bytes"; with
 * @p upto, "up to 64 KiB". */
static void append_size(char *buf, size_t n, size_t *len_p, size_t b, bool upto)
{
    const char *verb = upto ? "up to " : "from ";
    if (!upto && b > 1024 && (b - 1) % 1024 == 0) {
        verb = "above ";
        b--;
    }
    if (b >= (1u << 20) && b % (1u << 20) == 0) {
        coll__appendf(buf, n, len_p, "%s%zu MiB", verb, b >> 20);
    } else if (b >= 1024 && b % 1024 == 0) {
        coll__appendf(buf, n, len_p, "%s%zu KiB", verb, b >> 10);
    } else {
        coll__appendf(buf, n, len_p, "%s%zu bytes", verb, b);
    }
}

/* The choice by size among the entries of @p kind but @p except: "cma from 2 MiB (unless
 * ...), else ring from 1 MiB, else direct". */
static void append_by_size(const coll_group_t *g, coll_kind_t kind, int except, char *buf, size_t n,
                           size_t *len_p)
{
    int last = INT32_MAX; /* entries by falling score */
    bool first = true;
    for (;;) {
        int next = -1;
        /* After one that declined (the members settled against reading each other), none
         * that would decline too; one with a size limit also declines above it, leaving the
         * others in the running. */
        bool no_declining =
            except >= 0 && algos[except].declines != NULL && algos[except].max_bytes == NULL;
        for (size_t i = 0; i < NALGOS; i++) {
            if (algos[i].kind == kind && (int)i != except && algos[i].score < last &&
                !(no_declining && algos[i].declines != NULL) &&
                (next < 0 || algos[i].score > algos[next].score)) {
                next = (int)i;
            }
        }
        if (next < 0) {
            return;
        }
        last = algos[next].score;
        coll__appendf(buf, n, len_p, "%s%s", first ? "" : ", else ", algos[next].name);
        first = false;
        if (min_bytes(g, next) > 0) {
            coll__appendf(buf, n, len_p, " ");
            append_size(buf, n, len_p, min_bytes(g, next), false);
        }
        if (max_bytes(g, next) < SIZE_MAX) {
            coll__appendf(buf, n, len_p, " ");
            append_size(buf, n, len_p, max_bytes(g, next), true);
        }
        if (algos[next].declines != NULL) {
            coll__appendf(buf, n, len_p, " (%s)", algos[next].declines);
        }
        if (min_bytes(g, next) == 0 && max_bytes(g, next) == SIZE_MAX) {
            return; /* it takes every size: the entries below never run */
        }
    }
}

void coll__algo_names(coll_kind_t kind, char *buf, size_t n, size_t *len_p)
{
    bool first = true;
    for (size_t i = 0; i < NALGOS; i++) {
        if (algos[i].kind == kind) {
            coll__appendf(buf, n, len_p, "%s%s", first ? "" : ", ", algos[i].name);
            first = false;
        }
    }
}

void coll__algo_describe(const coll_group_t *g, char *buf, size_t n, size_t *len_p)
{
    for (int k = OP_BARRIER; k < COLL_KINDS; k++) {
        int i = g->algo[k];
        coll__appendf(buf, n, len_p, "%s: ", coll__kind_name((coll_kind_t)k));
        int entries = 0;
        for (size_t j = 0; j < NALGOS; j++) {
            entries += algos[j].kind == (coll_kind_t)k;
        }
        if (i < 0 && entries == 1) {
            append_by_size(g, (coll_kind_t)k, -1, buf, n, len_p); /* its one algorithm */
        } else if (i < 0) {
            coll__appendf(buf, n, len_p, "by size: ");
            append_by_size(g, (coll_kind_t)k, -1, buf, n, len_p);
        } else {
            coll__appendf(buf, n, len_p, "%s (%s)", algos[i].name,
                          g->algo_from[k] == COLL_FROM_ENV    ? "WEFT_COLL_ALGO"
                          : g->algo_from[k] == COLL_FROM_CALL ? "weft_pg_set_algorithm"
                                                              : "default");
            if (max_bytes(g, i) < SIZE_MAX) {
                coll__appendf(buf, n, len_p, " ");
                append_size(buf, n, len_p, max_bytes(g, i), true);
                coll__appendf(buf, n, len_p, algos[i].declines != NULL ? "," : "; else by size: ");
            }
            if (algos[i].declines != NULL) {
                coll__appendf(buf, n, len_p, " %s; else by size: ", algos[i].declines);
                append_by_size(g, (coll_kind_t)k, i, buf, n, len_p);
            }
        }
        coll__appendf(buf, n, len_p, "\n");
    }
}

/* ------------------------------------------------------------ running an operation */

/* all_reduce: works in the accumulation dtype, runs the algorithm (none with one member),
 * then writes the result into the tensor, rounded once. */
static weft_status_t run_all_reduce(coll_group_t *g, coll_args_t *a, int64_t deadline)
{
    weft_tensor_t *t = a->op->t;
    size_t count = (size_t)weft_tensor_numel(t);
    float *wide = NULL;
    weft_status_t st = WEFT_OK;

    WEFT_CHECK(coll__widen(&a->op->kern, t, count, &a->wt, &a->work, &wide));
    a->count = count;
    if (g->size > 1) {
        st = run_algo(g, a, count * weft_dtype_size(a->wt), deadline);
    }
    if (st == WEFT_OK && count > 0) {
        coll__finish(&a->op->kern, t, a->work, count, a->wt, a->d->rop, g->size);
    }
    weft_free(wide);
    return st;
}

void coll__run(coll_group_t *g, coll_op_t *op)
{
    int64_t deadline = op->deadline_ns;
    coll_desc_t d = {op->kind, op->seq, WEFT_U8, op->rop, op->root, 0};
    weft_status_t st;
    bool expired = false;

    if (op->t != NULL) {
        d.dtype = weft_tensor_dtype(op->t);
        d.count = (uint64_t)weft_tensor_numel(op->t);
    }
    if (op->kind == OP_SCATTER || op->kind == OP_REDUCE_SCATTER) {
        d.dtype = weft_tensor_dtype(op->out);
        d.count = (uint64_t)weft_tensor_numel(op->out); /* per part */
    }
    if (weft__now_ns() >= deadline) {
        /* Queued behind earlier operations past its deadline: it fails without starting. */
        expired = true;
        st = weft__set_error(WEFT_ERR_TIMEOUT,
                             "%s: operation %llu of group %u waited in the queue past its "
                             "deadline",
                             coll__kind_name(op->kind), (unsigned long long)op->seq, g->id);
    } else {
        coll_args_t a = {op, &d, NULL, 0, WEFT_U8};
        st = op->ready != NULL ? op->ready(op->ready_arg) : WEFT_OK;
        if (st != WEFT_OK) {
            st = weft__set_error(st, "%s: operation %llu: its tensor was not made ready: %s",
                                 coll__kind_name(op->kind), (unsigned long long)op->seq,
                                 weft_last_error());
        } else if (op->kind == OP_ALL_REDUCE) {
            st = run_all_reduce(g, &a, deadline);
        } else {
            st = run_algo(g, &a, d.count * weft_dtype_size(d.dtype), deadline);
        }
    }
    char why[800] = "";
    if (st != WEFT_OK) {
        snprintf(why, sizeof(why), "%s", weft_last_error());
        /* A failure of this rank's own (not a mismatch or a loss, which every member
         * sees for itself): tell the others, so that they fail now instead of waiting for
         * pieces that will not come. A deadline too: a member that started later may have
         * all it needs and would succeed where this one failed (a DDP step applied on one
         * member and not on another); an abort that finds the operation over is dropped. */
        if (((st != WEFT_ERR_MISMATCH && st != WEFT_ERR_PEER_LOST) || expired) && g->size > 1) {
            char text[900];
            snprintf(text, sizeof(text), "rank %d: %s", g->rank, why);
            coll__abort(g, op->seq, st, text);
        }
    }
    coll__oneshot_finished(g, op->seq);
    /* Over here: its pieces nobody took, and those still to come, are dropped. Before
     * the future completes, whose callbacks may issue the next operations. */
    coll__seq_done(g, op->seq);
    weft_future_complete(op->f, st, st == WEFT_OK ? NULL : why, NULL);
    weft_future_release(op->f);
    coll__op_free(op, g->size);
}

void coll__op_free(coll_op_t *op, int size)
{
    weft_tensor_release(op->t);
    weft_tensor_release(op->out);
    if (op->outs != NULL) {
        for (int i = 0; i < size; i++) {
            weft_tensor_release(op->outs[i]);
        }
        weft_free(op->outs);
    }
    weft_free(op->in_splits);
    weft_free(op->out_splits);
    weft_free(op);
}
