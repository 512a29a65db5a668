/* weft's side of the parameter-server benchmark (bench/run_ps.py): SERVERS + WORKERS ranks over
 * loopback, forked here (ranks 0..S-1 serve, S..S+W-1 work).
 *
 * The parent forks rank 0 before any weft call; rank 0 creates its agent on a free master port
 * and hands the port back through a pipe; the parent then forks the other ranks. Every rank
 * creates the PS (servers named explicitly), joins and creates the mode's table; the servers then
 * sit in weft_ps_finish (2 handler threads each) until every worker has called it. The workers
 * measure and leave their figures in a shared mapping that the parent reads once every rank has
 * exited 0; the parent prints the result lines. It kills every rank when one fails or at
 * --timeout.
 *
 *   bench_ps p1 [--bytes N] [--iters K] [--chunk N] [--split T]
 *       1 server + 1 worker; a dense f32 table of N bytes (1-D), optimizer SUM, ASYNC, chunk_bytes
 *       N (default 4 MiB: every chunk of a call goes in one request to the one server); K timed
 * weft_ps_push, weft_ps_pull and weft_ps_push_pull, one at a time, after 2 untimed ones each. In
 * the same run the same bytes through weft_rpc_sync to the server rank: "sink" (N bytes there, an
 * empty reply: the shape of a push), "source" (an empty call, N bytes back from a tensor the server
 * keeps: a pull) and "echo" (N bytes both ways: a push_pull). Prints push_<SIZE>, pull_<SIZE>,
 * push_pull_<SIZE> in GB/s (1e9 B/s) for "weft" (the PS) and "weft_rpc" (the bare calls); push_pull
 * counts the bytes of both ways (2N per call), as echo does. --split T (for investigation; not in
 * run_ps.py): the N bytes as T tables of N/T bytes, one operation on each in flight at once (so
 * that the server applies one part while the next arrives); printed as system "weft_split<T>".
 *   bench_ps p2 [--servers S] [--workers W] [--batches K] [--ids B] [--rows R] [--dim D]
 *               [--zipf A] [--warmup K0]
 *       default 2 servers, 2 workers, a sparse R x D f32 table (1M x 64, id_bound R), server
 *       Adagrad (lr 0.01), ASYNC. Each worker draws its K0 + K batches of B (4096) ids beforehand
 *       from Zipf(A = 1.05) over [0, R) (rank k -> id k-1; seed = worker index), then per batch:
 *       weft_ps_pull_rows (repeats fetched once), the gradient 0.01 * row of every pulled row,
 *       weft_ps_push_rows (repeats summed first), each waited for. Prints sparse_rows (rows/s:
 *       2B rows per batch, pulled + pushed, summed over the workers' rates), sparse_batch_p50
 *       and sparse_batch_p99 (us per batch, over every worker's batches), sparse_pull_p50 (us, the
 *       pull part of a batch) and unique_ids (the mean distinct ids per batch, for context).
 *   bench_ps p3 [--servers S] [--workers W] [--bytes N] [--iters K] [--chunk N] [--fused 0|1]
 *       default 1 server, 2 workers; a dense f32 table of N (4 MiB) bytes, SGD lr 0.01, SYNC,
 *       chunk_bytes N (default 4 MiB: a 4 MiB table is one chunk, on one server); a step is
 *       weft_ps_push (waited), weft_ps_clock, weft_ps_pull (waits for the step to be applied).
 *       3 untimed steps, then K; prints sync_step_<SIZE>_w<W> (us per step, the slowest
 *       worker's mean). --fused 1: a step is weft_ps_push_pull_async, weft_ps_clock, then the
 *       wait (one round trip per server less); prints sync_step_fused_<SIZE>_w<W>. With
 *       S > 1 servers (and --chunk N/S, so that the table is spread over them) the metric
 *       names end in _s<S>.
 *
 * The results are checked, so that a wrong answer never passes for a fast one: p1's pulls must
 * read the sum of every push so far, p3's the SGD value after every step (-1e-5 per step).
 *
 * Common: --timeout S (default 300). Prints {"system":...,"metric":...,"value":...,"unit":...}
 * lines on stdout. */
#include "bench_common.h"

#include <math.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <weft/weft.h>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#define SHUTDOWN_TIMEOUT_MS   30000
#define RENDEZVOUS_TIMEOUT_MS 30000
#define CREATE_TIMEOUT_MS     60000
#define FINISH_TIMEOUT_MS     0 /* servers: until every worker is done (the parent's timeout) */
#define MAX_RANKS             64
#define MAX_BATCHES           100000
#define P1_WARMUP             2
#define P3_WARMUP             3
#define MAX_SPLIT             64

typedef enum { MODE_P1 = 1, MODE_P2 = 2, MODE_P3 = 3 } ps_mode_t;

typedef struct {
    ps_mode_t mode;
    int servers;
    int workers;
    size_t bytes;
    size_t iters;   /* p1: calls per operation; p2: timed batches; p3: timed steps */
    size_t warmup;  /* p2: untimed batches */
    size_t ids;     /* p2: ids per batch */
    uint64_t rows;  /* p2: table rows (id bound) */
    int64_t dim;    /* p2: row length */
    double zipf;    /* p2: exponent */
    size_t chunk;   /* p1, p3: the table's chunk_bytes (0: the default) */
    int fused;      /* p3: push_pull_async, clock, wait instead of push, clock, pull */
    int split;      /* p1: tables the N bytes are cut into, one operation each in flight */
    double timeout; /* seconds */
} args_t;

/* What a worker leaves for the parent (one per worker, in a shared anonymous mapping). */
typedef struct {
    int done;
    uint64_t elapsed_ns[3]; /* p1: push, pull, push_pull; p2, p3: [0] the timed batches/steps */
    uint64_t rpc_ns[3];     /* p1: sink, source, echo */
    uint64_t unique_ids;    /* p2: distinct ids summed over the timed batches */
    uint64_t batch_ns[];    /* p2: each timed batch, then the pull of each */
} result_t;

static int my_rank = -1;
static weft_tensor_t *source_tensor; /* p1 server: what "source" replies with */

static void fail(const char *what, weft_status_t s, const char *detail)
{
    fprintf(stderr, "bench_ps[rank %d]: %s: %s (%s)\n", my_rank, what, weft_strerror(s),
            detail != NULL ? detail : "");
    exit(1);
}

static void check(weft_status_t s, const char *what)
{
    if (s != WEFT_OK) {
        fail(what, s, weft_last_error());
    }
}

static void usage(const char *prog)
{
    fprintf(stderr,
            "usage: %s p1 [--bytes N] [--iters K] [--chunk N] [--split T]\n"
            "       %s p2 [--servers S] [--workers W] [--batches K] [--warmup K0] [--ids B]\n"
            "             [--rows R] [--dim D] [--zipf A]\n"
            "       %s p3 [--servers S] [--workers W] [--bytes N] [--iters K] [--chunk N]\n"
            "             [--fused 0|1]\n"
            "common: [--timeout S]; sizes take K/M/G (binary) suffixes\n",
            prog, prog, prog);
}

static int parse_args(int argc, char **argv, args_t *a)
{
    memset(a, 0, sizeof(*a));
    if (argc < 2) {
        goto err_usage;
    }
    if (strcmp(argv[1], "p1") == 0) {
        *a = (args_t){.mode = MODE_P1, .servers = 1, .workers = 1, .bytes = 16u << 20, .iters = 10};
    } else if (strcmp(argv[1], "p2") == 0) {
        *a = (args_t){.mode = MODE_P2,
                      .servers = 2,
                      .workers = 2,
                      .iters = 200,
                      .warmup = 20,
                      .ids = 4096,
                      .rows = 1u << 20,
                      .dim = 64,
                      .zipf = 1.05};
    } else if (strcmp(argv[1], "p3") == 0) {
        *a = (args_t){.mode = MODE_P3, .servers = 1, .workers = 2, .bytes = 4u << 20, .iters = 50};
    } else {
        goto err_usage;
    }
    a->timeout = 300.0;
    a->split = 1;
    for (int i = 2; i < argc; i++) {
        const char *k = argv[i];
        if (i + 1 >= argc) {
            goto err_usage;
        }
        const char *v = argv[++i];
        if (strcmp(k, "--bytes") == 0) {
            a->bytes = bench_parse_size(v);
        } else if (strcmp(k, "--iters") == 0 || strcmp(k, "--batches") == 0) {
            a->iters = bench_parse_size(v);
        } else if (strcmp(k, "--warmup") == 0) {
            a->warmup = (size_t)strtoull(v, NULL, 10);
        } else if (strcmp(k, "--servers") == 0) {
            a->servers = atoi(v);
        } else if (strcmp(k, "--workers") == 0) {
            a->workers = atoi(v);
        } else if (strcmp(k, "--ids") == 0) {
            a->ids = bench_parse_size(v);
        } else if (strcmp(k, "--rows") == 0) {
            a->rows = bench_parse_size(v);
        } else if (strcmp(k, "--dim") == 0) {
            a->dim = (int64_t)bench_parse_size(v);
        } else if (strcmp(k, "--zipf") == 0) {
            a->zipf = strtod(v, NULL);
        } else if (strcmp(k, "--chunk") == 0) {
            a->chunk = bench_parse_size(v);
        } else if (strcmp(k, "--split") == 0) {
            a->split = atoi(v);
        } else if (strcmp(k, "--fused") == 0) {
            a->fused = atoi(v);
        } else if (strcmp(k, "--timeout") == 0) {
            a->timeout = strtod(v, NULL);
        } else {
            goto err_usage;
        }
    }
    if (a->servers < 1 || a->workers < 1 || a->servers + a->workers > MAX_RANKS || a->iters == 0 ||
        a->iters > MAX_BATCHES || a->timeout <= 0) {
        goto err_usage;
    }
    if (a->split < 1 || a->split > MAX_SPLIT || (a->split > 1 && a->mode != MODE_P1)) {
        goto err_usage;
    }
    if (a->mode != MODE_P2 && (a->bytes < 4 || a->bytes % (4 * (size_t)a->split) != 0)) {
        goto err_usage;
    }
    if (a->mode == MODE_P2 &&
        (a->ids == 0 || a->rows == 0 || a->dim <= 0 || a->zipf <= 0 || a->warmup > MAX_BATCHES)) {
        goto err_usage;
    }
    if (a->mode == MODE_P1 && (a->servers != 1 || a->workers != 1)) {
        fprintf(stderr, "bench_ps: p1 is 1 server + 1 worker\n");
        return -1;
    }
    return 0;

err_usage:
    usage(argv[0]);
    return -1;
}

/* ------------------------------------------------------------------ helpers */

static size_t result_stride(const args_t *a)
{
    return sizeof(result_t) + 2 * a->iters * sizeof(uint64_t);
}

/* Worker @p w's result in the shared mapping @p res. */
static result_t *result_of(result_t *res, const args_t *a, int w)
{
    return (result_t *)((char *)res + (size_t)w * result_stride(a));
}

static weft_tensor_t *f32_tensor(int ndim, const int64_t *shape, float fill)
{
    weft_tensor_t *t = NULL;
    check(weft_tensor_empty(WEFT_F32, ndim, shape, &t), "weft_tensor_empty");
    float *p = weft_tensor_data(t);
    int64_t n = weft_tensor_numel(t);
    for (int64_t i = 0; i < n; i++) {
        p[i] = fill;
    }
    return t;
}

/* Fails unless every element of @p t is @p want (relative 1e-3): the benchmark's sanity check. */
static void expect_all(const weft_tensor_t *t, double want, const char *what)
{
    const float *p = weft_tensor_data(t);
    int64_t n = weft_tensor_numel(t);
    for (int64_t i = 0; i < n; i++) {
        if (fabs((double)p[i] - want) > 1e-3 * fabs(want)) {
            char why[160];
            snprintf(why, sizeof(why), "element %lld is %.9g, not %.9g", (long long)i, (double)p[i],
                     want);
            fail(what, WEFT_ERR_PROTOCOL, why);
        }
    }
}

static void sink_cb(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, NULL);
}

static void echo_cb(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, weft_call_take_args(call));
}

static void source_cb(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_value_t *v = NULL;
    if (weft_value_create(&v) != WEFT_OK || weft_value_add_tensor(v, source_tensor) != WEFT_OK) {
        weft_value_free(v);
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "bench_ps: source: no memory");
        return;
    }
    weft_call_reply(call, v);
}

static void opts_for(weft_agent_opts_t *o, const args_t *a, int rank, int port)
{
    weft_agent_opts_init(o);
    o->rank = rank;
    o->world_size = a->servers + a->workers;
    o->master_addr = "127.0.0.1";
    o->master_port = port;
    o->rendezvous_timeout_ms = RENDEZVOUS_TIMEOUT_MS;
    if (rank < a->servers) {
        o->handler_threads = 2;
    }
}

/* ------------------------------------------------------------------ p1: dense bandwidth */

/* Times @p iters rounds of operation @p op (push, pull, push_pull) on the @p n tables at once. */
static uint64_t time_ps(weft_ps_table_t **t, int n, int op, weft_tensor_t **grad,
                        weft_tensor_t **dst, size_t iters)
{
    static const char *names[] = {"weft_ps_push", "weft_ps_pull", "weft_ps_push_pull"};
    weft_future_t *f[MAX_SPLIT];
    uint64_t t0 = 0;
    for (size_t i = 0; i < P1_WARMUP + iters; i++) {
        if (i == P1_WARMUP) {
            t0 = bench_now_ns();
        }
        for (int k = 0; k < n; k++) {
            weft_status_t s = op == 0   ? weft_ps_push_async(t[k], grad[k], 0, &f[k])
                              : op == 1 ? weft_ps_pull_async(t[k], dst[k], 0, &f[k])
                                        : weft_ps_push_pull_async(t[k], grad[k], dst[k], 0, &f[k]);
            check(s, names[op]);
        }
        weft_status_t s = weft_future_wait_all(f, (size_t)n, 0);
        for (int k = 0; k < n; k++) {
            if (s != WEFT_OK && weft_future_status(f[k]) != WEFT_OK) {
                fail(names[op], s, weft_future_error(f[k]));
            }
            weft_future_release(f[k]);
        }
        if (s != WEFT_OK) {
            fail(names[op], s, "weft_future_wait_all");
        }
    }
    return bench_now_ns() - t0;
}

/* @p n views of equal parts of @p t (borrowed: they hold no reference to it). */
static void cut(weft_tensor_t *t, int n, weft_tensor_t **parts)
{
    int64_t len = weft_tensor_numel(t) / n;
    for (int k = 0; k < n; k++) {
        float *p = (float *)weft_tensor_data(t) + (int64_t)k * len;
        check(weft_tensor_wrap(WEFT_F32, 1, &len, p, (size_t)len * sizeof(float), WEFT_CPU, NULL,
                               NULL, &parts[k]),
              "weft_tensor_wrap");
    }
}

static uint64_t time_rpc(weft_agent_t *ag, const char *fn, const weft_value_t *args, size_t bytes,
                         size_t iters)
{
    uint64_t t0 = 0;
    for (size_t i = 0; i < P1_WARMUP + iters; i++) {
        if (i == P1_WARMUP) {
            t0 = bench_now_ns();
        }
        weft_value_t *res = NULL;
        check(weft_rpc_sync(ag, 0, fn, args, 0, &res), fn);
        weft_tensor_t *r = weft_value_tensor(res, 0);
        if (bytes > 0 && (r == NULL || weft_tensor_nbytes(r) != bytes)) {
            fail(fn, WEFT_ERR_PROTOCOL, "the reply does not hold the tensor expected");
        }
        weft_value_free(res);
    }
    return bench_now_ns() - t0;
}

static void p1_worker(weft_agent_t *ag, weft_ps_table_t **t, const args_t *a, result_t *r)
{
    int64_t n = (int64_t)(a->bytes / 4);
    weft_tensor_t *grad = f32_tensor(1, &n, 0.001f);
    weft_tensor_t *dst = f32_tensor(1, &n, 0.0f);
    weft_tensor_t *grads[MAX_SPLIT];
    weft_tensor_t *dsts[MAX_SPLIT];
    cut(grad, a->split, grads);
    cut(dst, a->split, dsts);
    for (int op = 0; op < 3; op++) {
        r->elapsed_ns[op] = time_ps(t, a->split, op, grads, dsts, a->iters);
        if (op >= 1) {
            /* SUM, ASYNC: the value is the sum of every push so far (push_pull's included). */
            expect_all(dst, 0.001 * (double)(P1_WARMUP + a->iters) * (double)op,
                       op == 1 ? "pull" : "push_pull");
        }
    }

    weft_value_t *args = NULL;
    weft_value_t *empty = NULL;
    check(weft_value_create(&args), "weft_value_create");
    check(weft_value_create(&empty), "weft_value_create");
    check(weft_value_add_tensor(args, grad), "weft_value_add_tensor");
    r->rpc_ns[0] = time_rpc(ag, "sink", args, 0, a->iters);
    r->rpc_ns[1] = time_rpc(ag, "source", empty, a->bytes, a->iters);
    r->rpc_ns[2] = time_rpc(ag, "echo", args, a->bytes, a->iters);
    weft_value_free(empty);
    weft_value_free(args);
    for (int k = 0; k < a->split; k++) {
        weft_tensor_release(dsts[k]);
        weft_tensor_release(grads[k]);
    }
    weft_tensor_release(dst);
    weft_tensor_release(grad);
}

/* ------------------------------------------------------------------ p2: sparse rows */

static uint64_t rng_next(uint64_t *s) /* splitmix64 */
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Batches of Zipf(s) ids over [0, n): P(id = k-1) ~ 1/k^s, by inversion of the exact CDF. */
static uint64_t *zipf_batches(uint64_t n, double s, size_t count, uint64_t seed)
{
    double *cdf = malloc(n * sizeof(*cdf));
    uint64_t *ids = malloc(count * sizeof(*ids));
    if (cdf == NULL || ids == NULL) {
        fail("malloc", WEFT_ERR_NO_MEMORY, "zipf");
    }
    double sum = 0;
    for (uint64_t k = 0; k < n; k++) {
        sum += pow((double)(k + 1), -s);
        cdf[k] = sum;
    }
    uint64_t st = seed * 0x2545F4914F6CDD1Dull + 1;
    for (size_t i = 0; i < count; i++) {
        double u = (double)(rng_next(&st) >> 11) * 0x1.0p-53 * sum;
        uint64_t lo = 0;
        uint64_t hi = n - 1;
        while (lo < hi) {
            uint64_t mid = lo + (hi - lo) / 2;
            if (cdf[mid] < u) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        ids[i] = lo;
    }
    free(cdf);
    return ids;
}

static uint64_t count_unique(const uint64_t *ids, size_t n, uint64_t *scratch)
{
    memcpy(scratch, ids, n * sizeof(*ids));
    qsort(scratch, n, sizeof(*scratch), bench_cmp_u64);
    uint64_t u = 0;
    for (size_t i = 0; i < n; i++) {
        u += i == 0 || scratch[i] != scratch[i - 1];
    }
    return u;
}

static void wait_one(weft_future_t *f, const char *what)
{
    weft_status_t s = weft_future_wait(f, -1);
    if (s != WEFT_OK) {
        fail(what, s, weft_future_error(f));
    }
    weft_future_release(f);
}

/* d = s * x, the model's part of a batch: restrict and fixed blocks, so that -O2 vectorises it
 * as torch's `rows * 0.01` is. */
static void scale_rows(float *restrict d, const float *restrict x, float s, size_t n)
{
    size_t nb = n / 64;
    for (size_t b = 0; b < nb; b++) {
        for (size_t i = b * 64; i < b * 64 + 64; i++) {
            d[i] = s * x[i];
        }
    }
    for (size_t i = nb * 64; i < n; i++) {
        d[i] = s * x[i];
    }
}

static void p2_worker(weft_ps_table_t *t, const args_t *a, int widx, result_t *r)
{
    size_t batches = a->warmup + a->iters;
    uint64_t *ids = zipf_batches(a->rows, a->zipf, batches * a->ids, (uint64_t)widx + 1);
    uint64_t *scratch = malloc(a->ids * sizeof(*scratch));
    if (scratch == NULL) {
        fail("malloc", WEFT_ERR_NO_MEMORY, NULL);
    }
    int64_t shape[2] = {(int64_t)a->ids, a->dim};
    weft_tensor_t *rows = f32_tensor(2, shape, 0.0f);
    weft_tensor_t *grads = f32_tensor(2, shape, 0.0f);
    float *rp = weft_tensor_data(rows);
    float *gp = weft_tensor_data(grads);
    size_t elems = a->ids * (size_t)a->dim;

    uint64_t t0 = 0;
    for (size_t b = 0; b < batches; b++) {
        const uint64_t *bid = ids + b * a->ids;
        if (b == a->warmup) {
            t0 = bench_now_ns();
        }
        uint64_t tb = bench_now_ns();
        weft_future_t *f = NULL;
        check(weft_ps_pull_rows_async(t, bid, a->ids, rows, 0, &f), "weft_ps_pull_rows_async");
        wait_one(f, "pull_rows");
        uint64_t tp = bench_now_ns() - tb;
        scale_rows(gp, rp, 0.01f, elems);
        check(weft_ps_push_rows_async(t, bid, a->ids, grads, 0, &f), "weft_ps_push_rows_async");
        wait_one(f, "push_rows");
        if (b >= a->warmup) {
            r->batch_ns[b - a->warmup] = bench_now_ns() - tb;
            r->batch_ns[a->iters + b - a->warmup] = tp;
        }
    }
    r->elapsed_ns[0] = bench_now_ns() - t0;
    for (size_t b = a->warmup; b < batches; b++) {
        r->unique_ids += count_unique(ids + b * a->ids, a->ids, scratch);
    }
    weft_tensor_release(grads);
    weft_tensor_release(rows);
    free(scratch);
    free(ids);
}

/* ------------------------------------------------------------------ p3: sync steps */

static void p3_worker(weft_ps_t *ps, weft_ps_table_t *t, const args_t *a, result_t *r)
{
    int64_t n = (int64_t)(a->bytes / 4);
    weft_tensor_t *grad = f32_tensor(1, &n, 0.001f);
    weft_tensor_t *params = f32_tensor(1, &n, 0.0f);
    uint64_t t0 = 0;
    for (size_t i = 0; i < P3_WARMUP + a->iters; i++) {
        if (i == P3_WARMUP) {
            t0 = bench_now_ns();
        }
        weft_future_t *f = NULL;
        if (a->fused) {
            check(weft_ps_push_pull_async(t, grad, params, 0, &f), "weft_ps_push_pull_async");
            check(weft_ps_clock(ps, 0), "weft_ps_clock");
            wait_one(f, "push_pull");
            continue;
        }
        check(weft_ps_push_async(t, grad, 0, &f), "weft_ps_push_async");
        wait_one(f, "push");
        check(weft_ps_clock(ps, 0), "weft_ps_clock");
        check(weft_ps_pull_async(t, params, 0, &f), "weft_ps_pull_async");
        wait_one(f, "pull");
    }
    r->elapsed_ns[0] = bench_now_ns() - t0;
    /* SGD lr 0.01 on the mean gradient 0.001, every step applied before its pull returns. */
    expect_all(params, -0.01 * 0.001 * (double)(P3_WARMUP + a->iters), "sync step");
    weft_tensor_release(params);
    weft_tensor_release(grad);
}

/* ------------------------------------------------------------------ ranks */

/* The mode's tables (p1: a->split of them), created collectively. */
static void make_tables(weft_ps_t *ps, const args_t *a, weft_ps_table_t **t)
{
    weft_ps_table_spec_t s;
    char name[32];
    if (a->mode == MODE_P2) {
        weft_ps_table_spec_init(&s, "emb", WEFT_PS_SPARSE);
        s.dim = a->dim;
        s.id_bound = a->rows;
        s.init = WEFT_PS_UNIFORM;
        s.init_a = -0.01;
        s.init_b = 0.01;
        s.seed = 1;
        s.optimizer = WEFT_PS_ADAGRAD;
        s.adagrad.lr = 0.01;
        s.consistency = WEFT_PS_ASYNC;
    } else {
        weft_ps_table_spec_init(&s, "dense", WEFT_PS_DENSE);
        s.ndim = 1;
        s.shape[0] = (int64_t)(a->bytes / 4 / (size_t)a->split);
        if (a->chunk > 0) {
            s.chunk_bytes = a->chunk;
        }
        if (a->mode == MODE_P1) {
            s.optimizer = WEFT_PS_SUM;
            s.consistency = WEFT_PS_ASYNC;
        } else {
            s.optimizer = WEFT_PS_SGD;
            s.sgd.lr = 0.01;
            s.consistency = WEFT_PS_SYNC;
        }
    }
    for (int k = 0; k < a->split; k++) {
        if (a->split > 1) {
            snprintf(name, sizeof(name), "dense%d", k);
            s.name = name;
        }
        check(weft_ps_table_create(ps, &s, CREATE_TIMEOUT_MS, &t[k]), "weft_ps_table_create");
    }
}

static int rank_main(const args_t *a, int rank, int port, int port_fd, result_t *res)
{
    weft_agent_opts_t o;
    weft_agent_t *ag = NULL;
    weft_ps_t *ps = NULL;
    weft_ps_table_t *t[MAX_SPLIT];
    int servers[MAX_RANKS];
    int workers[MAX_RANKS];
    my_rank = rank;
    opts_for(&o, a, rank, port);
    check(weft_agent_create(&o, &ag), "weft_agent_create");
    if (rank == 0) {
        int p = weft_agent_port(ag);
        if (write(port_fd, &p, sizeof(p)) != (ssize_t)sizeof(p)) {
            fail("write port", WEFT_ERR_IO, NULL);
        }
        close(port_fd);
    }
    for (int i = 0; i < a->servers; i++) {
        servers[i] = i;
    }
    for (int i = 0; i < a->workers; i++) {
        workers[i] = a->servers + i;
    }
    weft_ps_opts_t po;
    weft_ps_opts_init(&po);
    po.servers = servers;
    po.n_servers = (size_t)a->servers;
    po.workers = workers;
    po.n_workers = (size_t)a->workers;
    check(weft_ps_create(ag, &po, &ps), "weft_ps_create");
    if (a->mode == MODE_P1 && rank == 0) {
        int64_t n = (int64_t)a->bytes;
        check(weft_tensor_empty(WEFT_U8, 1, &n, &source_tensor), "weft_tensor_empty");
        memset(weft_tensor_data(source_tensor), 1, a->bytes);
        check(weft_rpc_register(ag, "sink", sink_cb, NULL), "register sink");
        check(weft_rpc_register(ag, "source", source_cb, NULL), "register source");
        check(weft_rpc_register(ag, "echo", echo_cb, NULL), "register echo");
    }
    check(weft_agent_join(ag), "weft_agent_join");
    make_tables(ps, a, t);

    int widx = weft_ps_worker_index(ps);
    if (widx >= 0) {
        result_t *r = result_of(res, a, widx);
        if (a->mode == MODE_P1) {
            p1_worker(ag, t, a, r);
        } else if (a->mode == MODE_P2) {
            p2_worker(t[0], a, widx, r);
        } else {
            p3_worker(ps, t[0], a, r);
        }
        r->done = 1;
    }
    check(weft_ps_finish(ps, FINISH_TIMEOUT_MS), "weft_ps_finish");
    weft_status_t s = weft_agent_shutdown(ag, SHUTDOWN_TIMEOUT_MS);
    weft_agent_free(ag);
    check(s, "weft_agent_shutdown");
    if (source_tensor != NULL) {
        weft_tensor_release(source_tensor);
    }
    return 0;
}

/* ------------------------------------------------------------------ results */

static void emit(const char *system, const char *metric, double value, const char *unit,
                 const args_t *a)
{
    printf("{\"system\":\"%s\",\"metric\":\"%s\",\"value\":%.6g,\"unit\":\"%s\",\"servers\":%d,"
           "\"workers\":%d,\"bytes\":%zu,\"iters\":%zu,\"chunk\":%zu}\n",
           system, metric, value, unit, a->servers, a->workers, a->bytes, a->iters, a->chunk);
}

static void report(const args_t *a, result_t *res)
{
    char label[32];
    char metric[64];
    for (int w = 0; w < a->workers; w++) {
        if (!result_of(res, a, w)->done) {
            fprintf(stderr, "bench_ps: worker %d left no result\n", w);
            exit(1);
        }
    }
    if (a->mode == MODE_P1) {
        static const char *ops[] = {"push", "pull", "push_pull"};
        bench_size_label(a->bytes, label, sizeof(label));
        for (int op = 0; op < 3; op++) {
            double bytes = (double)a->bytes * (double)a->iters * (op == 2 ? 2.0 : 1.0);
            snprintf(metric, sizeof(metric), "%s_%s", ops[op], label);
            char sys[32] = "weft";
            if (a->split > 1) {
                snprintf(sys, sizeof(sys), "weft_split%d", a->split);
            }
            emit(sys, metric, bytes / (double)res->elapsed_ns[op], "GB/s", a);
            emit("weft_rpc", metric, bytes / (double)res->rpc_ns[op], "GB/s", a);
        }
    } else if (a->mode == MODE_P2) {
        size_t n = a->iters * (size_t)a->workers;
        uint64_t *all = malloc(n * sizeof(*all));
        uint64_t *pulls = malloc(n * sizeof(*pulls));
        if (all == NULL || pulls == NULL) {
            fail("malloc", WEFT_ERR_NO_MEMORY, NULL);
        }
        double rate = 0;
        double unique = 0;
        for (int w = 0; w < a->workers; w++) {
            result_t *r = result_of(res, a, w);
            rate += 2.0 * (double)a->ids * (double)a->iters * 1e9 / (double)r->elapsed_ns[0];
            unique += (double)r->unique_ids;
            memcpy(all + (size_t)w * a->iters, r->batch_ns, a->iters * sizeof(*all));
            memcpy(pulls + (size_t)w * a->iters, r->batch_ns + a->iters, a->iters * sizeof(*all));
        }
        emit("weft", "sparse_rows", rate, "rows/s", a);
        emit("weft", "sparse_batch_p50", (double)bench_percentile(all, n, 50) / 1e3, "us", a);
        emit("weft", "sparse_batch_p99", (double)bench_percentile(all, n, 99) / 1e3, "us", a);
        emit("weft", "sparse_pull_p50", (double)bench_percentile(pulls, n, 50) / 1e3, "us", a);
        emit("weft", "unique_ids", unique / (double)n, "ids", a);
        free(pulls);
        free(all);
    } else {
        uint64_t worst = 0;
        for (int w = 0; w < a->workers; w++) {
            result_t *r = result_of(res, a, w);
            worst = r->elapsed_ns[0] > worst ? r->elapsed_ns[0] : worst;
        }
        bench_size_label(a->bytes, label, sizeof(label));
        char servers[24] = "";
        if (a->servers > 1) {
            snprintf(servers, sizeof(servers), "_s%d", a->servers);
        }
        snprintf(metric, sizeof(metric), "sync_step%s_%s_w%d%s", a->fused ? "_fused" : "", label,
                 a->workers, servers);
        emit("weft", metric, (double)worst / (double)a->iters / 1e3, "us", a);
    }
    fflush(stdout);
}

/* ------------------------------------------------------------------ the parent */

/* Forks a rank that dies with the parent. Returns the child's pid in the parent, -1 on failure. */
static pid_t fork_rank(void)
{
    pid_t parent = getpid();
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) {
            _exit(1);
        }
    }
    return pid;
}

static void kill_all(pid_t *pids, int n)
{
    for (int i = 0; i < n; i++) {
        if (pids[i] > 0) {
            kill(pids[i], SIGKILL);
        }
    }
}

/* Waits for the @p n ranks until @p deadline_ns; kills all of them when one fails or at the
 * deadline. Returns 0 when every rank exited with status 0. */
static int reap_all(pid_t *pids, int n, uint64_t deadline_ns)
{
    int left = 0;
    int bad = 0;
    for (int i = 0; i < n; i++) {
        left += pids[i] > 0;
    }
    while (left > 0) {
        int st = 0;
        pid_t p = waitpid(-1, &st, WNOHANG);
        if (p > 0) {
            for (int i = 0; i < n; i++) {
                if (pids[i] != p) {
                    continue;
                }
                pids[i] = -1;
                left--;
                if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
                    fprintf(stderr, "bench_ps: rank %d exited abnormally (status %d)\n", i, st);
                    if (!bad) {
                        kill_all(pids, n);
                    }
                    bad = 1;
                }
            }
            continue;
        }
        if (p < 0 && errno != EINTR) {
            perror("waitpid");
            kill_all(pids, n);
            return 1;
        }
        if (bench_now_ns() > deadline_ns) {
            fprintf(stderr, "bench_ps: timed out; killing the ranks\n");
            kill_all(pids, n);
            deadline_ns = UINT64_MAX;
            bad = 1;
        }
        usleep(10000);
    }
    return bad;
}

int main(int argc, char **argv)
{
    args_t a;
    if (parse_args(argc, argv, &a) != 0) {
        return 2;
    }
#if defined(__SSE__)
    /* Subnormals flushed to zero in every rank (forked from here) and thread, as the torch
     * twin does (torch.set_flush_denormal) and weft's servers do while they apply updates: P2's
     * rows decay towards zero under Adagrad, and the workers' gradient 0.01 * row then makes
     * subnormals, each a microcode assist on many x86 processors (P2 ran 3x slower). */
    _mm_setcsr(_mm_getcsr() | 0x8040u);
#endif
    int world = a.servers + a.workers;
    uint64_t deadline = bench_now_ns() + (uint64_t)(a.timeout * 1e9);
    size_t res_len = (size_t)a.workers * result_stride(&a);
    result_t *res = mmap(NULL, res_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (res == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    pid_t pids[MAX_RANKS];
    for (int i = 0; i < world; i++) {
        pids[i] = -1;
    }
    int port_pipe[2];
    if (pipe(port_pipe) != 0) {
        perror("pipe");
        return 1;
    }
    pids[0] = fork_rank();
    if (pids[0] < 0) {
        perror("fork");
        return 1;
    }
    if (pids[0] == 0) {
        close(port_pipe[0]);
        exit(rank_main(&a, 0, 0, port_pipe[1], res));
    }
    close(port_pipe[1]);
    int port = 0;
    ssize_t got = -1;
    struct pollfd pfd = {.fd = port_pipe[0], .events = POLLIN};
    if (poll(&pfd, 1, RENDEZVOUS_TIMEOUT_MS) == 1) {
        got = read(port_pipe[0], &port, sizeof(port));
    }
    close(port_pipe[0]);
    if (got != (ssize_t)sizeof(port)) {
        fprintf(stderr, "bench_ps: rank 0 did not start\n");
        kill_all(pids, 1);
        reap_all(pids, 1, deadline);
        return 1;
    }
    for (int r = 1; r < world; r++) {
        pids[r] = fork_rank();
        if (pids[r] < 0) {
            perror("fork");
            kill_all(pids, r);
            reap_all(pids, r, deadline);
            return 1;
        }
        if (pids[r] == 0) {
            exit(rank_main(&a, r, port, -1, res));
        }
    }
    if (reap_all(pids, world, deadline) != 0) {
        return 1;
    }
    report(&a, res);
    munmap(res, res_len);
    return 0;
}
