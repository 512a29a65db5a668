/* weft's side of the distributed-autograd benchmark (bench/run_dist_autograd.py), the twin of
 * bench/torch_dist_autograd.py: ranks over loopback, forked here as bench/rref.c does (rank 0
 * first, on a free master port it hands back through a pipe, then the others). Rank 0 measures;
 * the others wait for it (EOF on a pipe) before the collective shutdown. f32 tensors, filled
 * from a fixed random stream.
 *
 *   bench_dist_autograd a1 ITERS        2 ranks. The design doc's example, per iteration: a
 *                                       context; t3 = rpc(worker1, add, t1, t2) of 3x3
 *                                       requires-grad tensors; loss = (t3 * t4).sum(); the
 *                                       distributed backward; get_gradients; the release. The
 *                                       first checks that t1's and t2's gradients equal t4. 50
 *                                       warm-up iterations; each timed one from the context's
 *                                       creation to its release. Prints a1_p50, a1_p99 (us).
 *   bench_dist_autograd a2 HOPS ITERS   HOPS+1 ranks. hop(t, k) on rank r answers t * 2 when
 *                                       k == 0, else rpc_sync(rank r+1, hop, t * 2, k - 1).
 *                                       y = rpc(worker1, hop, x, HOPS-1); loss = y.sum();
 *                                       backward; get_gradients (checked: 2^HOPS everywhere). 20
 *                                       warm-up iterations. Prints a2_p50_h<HOPS>, a2_p99_h<HOPS>.
 *   bench_dist_autograd a3 N            2 ranks. N contexts, each: two rpc(worker1, add, t1, t2);
 *                                       loss = r1.sum() + r2.sum(); backward; release. 100
 *                                       warm-up contexts (the first checks the gradients), RSS of
 *                                       both ranks before and after the N, live contexts on both
 *                                       at once and 1 s after. Prints a3_seconds,
 *                                       a3_rss_growth_mb_rank0, a3_rss_growth_mb_rank1 (MiB),
 *                                       a3_live_contexts_after_1s (the max over the ranks).
 *   bench_dist_autograd a4              3 ranks: the root, worker1 (killed), worker2 (survivor).
 *                                       In a context, r1 = rpc(worker1, slow_add, t1, t2) whose
 *                                       result passes a node whose backward sleeps 0.2 s;
 *                                       r2 = rpc(worker2, add, t1, t2); loss = r1.sum() +
 *                                       r2.sum(). A whole warm-up context first. Then backward
 *                                       runs on a thread of rank 0; 50 ms in, rank 0 SIGKILLs
 *                                       worker1. Prints a4_error_after_ms (from the kill until
 *                                       backward returned its error), and
 *                                       a4_survivor_contexts_after_1s (worker2's contexts 1 s
 *                                       later, the root's context still held) with
 *                                       after_release (worker2's contexts once the root released
 *                                       it) and release_ms.
 *
 * Prints {"system":"weft","metric":...,"value":...,"unit":...} lines on stdout. */
#include "bench_common.h"
#include "bench_ranks.h"

#include <pthread.h>
#include <unistd.h>

#include <weft/weft.h>

#define SHUTDOWN_TIMEOUT_MS   60000
#define RENDEZVOUS_TIMEOUT_MS 30000
#define CALL_TIMEOUT_MS       30000
#define MAX_WORLD             8

typedef enum { MODE_A1, MODE_A2, MODE_A3, MODE_A4 } dag_mode_t;

typedef struct {
    dag_mode_t mode;
    int world;
    int hops;
    size_t count;
} args_t;

static int my_rank = -1;
static uint64_t g_parts[3]; /* a1: forward, backward, release (ns, summed) */
static weft_rng_t g_rng;

static void fail(const char *what, weft_status_t s, const char *detail)
{
    fprintf(stderr, "bench_dist_autograd[rank %d]: %s: %s (%s)\n", my_rank, what,
            weft_strerror(s), detail != NULL ? detail : "");
    exit(1);
}

static void check(weft_status_t s, const char *what)
{
    if (s != WEFT_OK) {
        fail(what, s, weft_last_error());
    }
}

static void emit(const char *metric, double value, const char *unit, const char *extra)
{
    printf("{\"system\":\"weft\",\"metric\":\"%s\",\"value\":%.6g,\"unit\":\"%s\"%s%s}\n", metric,
           value, unit, extra != NULL ? "," : "", extra != NULL ? extra : "");
    fflush(stdout);
}

static weft_tensor_t *rand33(int requires_grad)
{
    int64_t shape[2] = {3, 3};
    weft_tensor_t *t = NULL;

    check(weft_tensor_empty(WEFT_F32, 2, shape, &t), "tensor");
    float *d = weft_tensor_data(t);
    for (int i = 0; i < 9; i++) {
        d[i] = (float)weft_rng_uniform(&g_rng);
    }
    if (requires_grad) {
        weft_tensor_set_requires_grad(t, 1);
    }
    return t;
}

static weft_tensor_t *sum_all(weft_tensor_t *t)
{
    weft_tensor_t *s = NULL;
    check(weft_op_sum(t, 0, NULL, 0, &s), "sum");
    return s;
}

static double rss_mb(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    long pages = 0, rss = 0;

    if (f == NULL) {
        return 0;
    }
    if (fscanf(f, "%ld %ld", &pages, &rss) != 2) {
        rss = 0;
    }
    fclose(f);
    return (double)rss * (double)sysconf(_SC_PAGESIZE) / (1024.0 * 1024.0);
}

/* ------------------------------------------------------------ functions */

static void reply_tensor(weft_call_t *call, weft_tensor_t *t)
{
    weft_value_t *v = NULL;
    weft_value_create(&v);
    weft_value_push_tensor(v, t);
    weft_call_reply(call, v);
}

static void add_cb(weft_call_t *call, void *arg)
{
    const weft_value_t *in = weft_call_args(call);
    weft_tensor_t *y = NULL;

    (void)arg;
    if (weft_op_add(weft_value_tensor(in, 0), weft_value_tensor(in, 1), &y) != WEFT_OK) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "add: %s", weft_last_error());
        return;
    }
    reply_tensor(call, y);
}

/* A node that passes its gradient through after sleeping 0.2 s (the backward a4 kills). */
static weft_status_t slow_backward(weft_ag_node_t *n, weft_tensor_t *const *grad_out,
                                   weft_tensor_t **grad_in)
{
    struct timespec ts = {0, 200000000};

    nanosleep(&ts, NULL);
    if (weft_ag_node_needs_grad(n, 0)) {
        grad_in[0] = weft_tensor_retain(grad_out[0]);
    }
    return WEFT_OK;
}

static void slow_add_cb(weft_call_t *call, void *arg)
{
    const weft_value_t *in = weft_call_args(call);
    weft_tensor_t *y = NULL, *z = NULL;
    weft_ag_node_t *n = NULL;

    (void)arg;
    check(weft_op_add(weft_value_tensor(in, 0), weft_value_tensor(in, 1), &y), "add");
    check(weft_tensor_clone(y, &z), "clone");
    check(weft_ag_node_create("SlowBackward", slow_backward, 1, &y, NULL, NULL, &n), "node");
    check(weft_ag_node_attach(n, 1, &z), "attach");
    weft_ag_node_release(n);
    weft_tensor_release(y);
    reply_tensor(call, z);
}

/* hop(t, k): t * 2 when k == 0, else hop on the next rank. */
static void hop_cb(weft_call_t *call, void *arg)
{
    const weft_value_t *in = weft_call_args(call);
    size_t len = 0;
    const int32_t *k = weft_value_payload(in, &len);
    weft_tensor_t *two = NULL, *y = NULL;
    int64_t one = 1;

    (void)arg;
    check(weft_tensor_empty(WEFT_F32, 1, &one, &two), "tensor");
    *(float *)weft_tensor_data(two) = 2.0f;
    check(weft_op_mul(weft_value_tensor(in, 0), two, &y), "mul");
    weft_tensor_release(two);
    if (len != sizeof(int32_t) || *k == 0) {
        reply_tensor(call, y);
        return;
    }
    weft_value_t *v = NULL, *res = NULL;
    int32_t next = *k - 1;
    weft_value_create(&v);
    weft_value_push_tensor(v, y);
    weft_value_set_payload(v, &next, sizeof(next));
    weft_status_t st = weft_rpc_sync(weft_call_agent(call), my_rank + 1, "hop", v,
                                     CALL_TIMEOUT_MS, &res);
    weft_value_free(v);
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "hop: %s", weft_last_error());
        return;
    }
    weft_call_reply(call, res);
}

static void stats_cb(weft_call_t *call, void *arg)
{
    double s[3] = {rss_mb(), (double)weft_dist_context_count(weft_call_agent(call)),
                   (double)getpid()};
    weft_value_t *v = NULL;

    (void)arg;
    weft_value_create(&v);
    weft_value_set_payload(v, s, sizeof(s));
    weft_call_reply(call, v);
}

static void remote_stats(weft_agent_t *a, int rank, double s[3])
{
    weft_value_t *res = NULL;
    size_t len = 0;

    check(weft_rpc_sync(a, rank, "stats", NULL, CALL_TIMEOUT_MS, &res), "stats");
    memcpy(s, weft_value_payload(res, &len), 3 * sizeof(double));
    weft_value_free(res);
}

/* ------------------------------------------------------------ rank 0 */

static weft_tensor_t *call1(weft_agent_t *a, int to, const char *fn, weft_tensor_t *x,
                            weft_tensor_t *y, const void *payload, size_t plen)
{
    weft_value_t *v = NULL, *res = NULL;

    weft_value_create(&v);
    weft_value_add_tensor(v, x);
    if (y != NULL) {
        weft_value_add_tensor(v, y);
    }
    if (payload != NULL) {
        weft_value_set_payload(v, payload, plen);
    }
    check(weft_rpc_sync(a, to, fn, v, CALL_TIMEOUT_MS, &res), fn);
    weft_value_free(v);
    weft_tensor_t *t = weft_tensor_retain(weft_value_tensor(res, 0));
    weft_value_free(res);
    return t;
}

static int all_equal(const weft_tensor_t *g, const weft_tensor_t *want, float value)
{
    if (g == NULL) {
        return 0;
    }
    const float *x = weft_tensor_data(g);
    for (int64_t i = 0; i < weft_tensor_numel(g); i++) {
        float w = want != NULL ? ((const float *)weft_tensor_data(want))[i] : value;
        if (x[i] != w) {
            return 0;
        }
    }
    return 1;
}

/* One iteration of a1; returns its duration (ns). */
static uint64_t a1_once(weft_agent_t *a, int check_grads)
{
    weft_tensor_t *t1 = rand33(1), *t2 = rand33(1), *t4 = rand33(1);
    uint64_t ctx = 0;
    uint64_t t0 = bench_now_ns();

    check(weft_dist_context_create(a, &ctx), "context");
    weft_tensor_t *t3 = call1(a, 1, "add", t1, t2, NULL, 0);
    weft_tensor_t *m = NULL;
    check(weft_op_mul(t3, t4, &m), "mul");
    weft_tensor_t *loss = sum_all(m);
    uint64_t tb = bench_now_ns();
    g_parts[0] += tb - t0;
    check(weft_dist_backward(a, ctx, 1, &loss, NULL), "backward");
    g_parts[1] += bench_now_ns() - tb;
    weft_dist_grads_t *g = NULL;
    check(weft_dist_get_gradients(a, ctx, &g), "get_gradients");
    if (check_grads && (!all_equal(weft_dist_grads_find(g, t1), t4, 0) ||
                        !all_equal(weft_dist_grads_find(g, t2), t4, 0))) {
        fail("a1: gradients of t1 and t2 are not t4", WEFT_ERR_MISMATCH, NULL);
    }
    weft_dist_grads_free(g);
    uint64_t tr = bench_now_ns();
    check(weft_dist_context_release(a, ctx, CALL_TIMEOUT_MS), "release");
    g_parts[2] += bench_now_ns() - tr;
    uint64_t dt = bench_now_ns() - t0;
    weft_tensor_release(loss);
    weft_tensor_release(m);
    weft_tensor_release(t3);
    weft_tensor_release(t1);
    weft_tensor_release(t2);
    weft_tensor_release(t4);
    return dt;
}

static uint64_t a2_once(weft_agent_t *a, int hops, int check_grads)
{
    weft_tensor_t *x = rand33(1);
    uint64_t ctx = 0;
    int32_t k = hops - 1;
    uint64_t t0 = bench_now_ns();

    check(weft_dist_context_create(a, &ctx), "context");
    weft_tensor_t *y = call1(a, 1, "hop", x, NULL, &k, sizeof(k));
    weft_tensor_t *loss = sum_all(y);
    check(weft_dist_backward(a, ctx, 1, &loss, NULL), "backward");
    weft_dist_grads_t *g = NULL;
    check(weft_dist_get_gradients(a, ctx, &g), "get_gradients");
    if (check_grads && !all_equal(weft_dist_grads_find(g, x), NULL, (float)(1 << hops))) {
        fail("a2: the gradient of x is not 2^HOPS", WEFT_ERR_MISMATCH, NULL);
    }
    weft_dist_grads_free(g);
    check(weft_dist_context_release(a, ctx, CALL_TIMEOUT_MS), "release");
    uint64_t dt = bench_now_ns() - t0;
    weft_tensor_release(loss);
    weft_tensor_release(y);
    weft_tensor_release(x);
    return dt;
}

static void a3_once(weft_agent_t *a, int check_grads)
{
    weft_tensor_t *t1 = rand33(1), *t2 = rand33(1);
    uint64_t ctx = 0;

    check(weft_dist_context_create(a, &ctx), "context");
    weft_tensor_t *r1 = call1(a, 1, "add", t1, t2, NULL, 0);
    weft_tensor_t *r2 = call1(a, 1, "add", t1, t2, NULL, 0);
    weft_tensor_t *s1 = sum_all(r1), *s2 = sum_all(r2), *loss = NULL;
    check(weft_op_add(s1, s2, &loss), "add");
    check(weft_dist_backward(a, ctx, 1, &loss, NULL), "backward");
    if (check_grads) {
        weft_dist_grads_t *g = NULL;
        check(weft_dist_get_gradients(a, ctx, &g), "get_gradients");
        if (!all_equal(weft_dist_grads_find(g, t1), NULL, 2.0f) ||
            !all_equal(weft_dist_grads_find(g, t2), NULL, 2.0f)) {
            fail("a3: gradients are not 2", WEFT_ERR_MISMATCH, NULL);
        }
        weft_dist_grads_free(g);
    }
    check(weft_dist_context_release(a, ctx, CALL_TIMEOUT_MS), "release");
    weft_tensor_release(loss);
    weft_tensor_release(s1);
    weft_tensor_release(s2);
    weft_tensor_release(r1);
    weft_tensor_release(r2);
    weft_tensor_release(t1);
    weft_tensor_release(t2);
}

typedef struct {
    weft_agent_t *a;
    uint64_t ctx;
    weft_tensor_t *loss;
    weft_status_t st;
    char error[512];
    uint64_t t_end;
} a4_bw_t;

static void *a4_backward(void *arg)
{
    a4_bw_t *b = arg;
    b->st = weft_dist_backward(b->a, b->ctx, 1, &b->loss, NULL);
    b->t_end = bench_now_ns();
    snprintf(b->error, sizeof(b->error), "%s", b->st == WEFT_OK ? "" : weft_last_error());
    return NULL;
}

static void measure_a4(weft_agent_t *a)
{
    double s1[3], s2[3];

    remote_stats(a, 1, s1);
    for (int round = 0; round < 2; round++) {
        weft_tensor_t *t1 = rand33(1), *t2 = rand33(1);
        uint64_t ctx = 0;

        check(weft_dist_context_create(a, &ctx), "context");
        weft_tensor_t *r1 = call1(a, 1, "slow_add", t1, t2, NULL, 0);
        weft_tensor_t *r2 = call1(a, 2, "add", t1, t2, NULL, 0);
        weft_tensor_t *x1 = sum_all(r1), *x2 = sum_all(r2), *loss = NULL;
        check(weft_op_add(x1, x2, &loss), "add");
        if (round == 0) {
            check(weft_dist_backward(a, ctx, 1, &loss, NULL), "warm-up backward");
            check(weft_dist_context_release(a, ctx, CALL_TIMEOUT_MS), "release");
        } else {
            a4_bw_t b = {.a = a, .ctx = ctx, .loss = loss};
            pthread_t th;
            struct timespec ts = {0, 50000000};
            uint64_t t_bw = bench_now_ns();

            pthread_create(&th, NULL, a4_backward, &b);
            nanosleep(&ts, NULL);
            kill((pid_t)s1[2], SIGKILL);
            uint64_t t_kill = bench_now_ns();
            pthread_join(th, NULL);
            double after_ms = (double)(b.t_end - t_kill) / 1e6;
            struct timespec sec = {1, 0};
            nanosleep(&sec, NULL);
            remote_stats(a, 2, s2);
            uint64_t r0 = bench_now_ns();
            weft_status_t rst = weft_dist_context_release(a, ctx, CALL_TIMEOUT_MS);
            double release_ms = (double)(bench_now_ns() - r0) / 1e6;
            double s2b[3];
            remote_stats(a, 2, s2b);
            char extra[1024];
            char err[400];
            size_t k = 0;
            for (const char *p = b.error; *p != '\0' && k < sizeof(err) - 2; p++) {
                err[k++] = (*p == '"' || *p == '\\') ? '\'' : *p;
            }
            err[k] = '\0';
            snprintf(extra, sizeof(extra),
                     "\"status\":\"%s\",\"error\":\"%s\",\"kill_after_ms\":%.3f,"
                     "\"release_status\":\"%s\"",
                     weft_status_name(b.st), err, (double)(t_kill - t_bw) / 1e6,
                     weft_status_name(rst));
            emit("a4_error_after_ms", after_ms, "ms", extra);
            snprintf(extra, sizeof(extra), "\"after_release\":%d,\"release_ms\":%.3f,"
                                           "\"root_contexts\":%zu",
                     (int)s2b[1], release_ms, weft_dist_context_count(a));
            emit("a4_survivor_contexts_after_1s", s2[1], "contexts", extra);
            if (b.st == WEFT_OK) {
                fail("a4: the backward succeeded with its callee killed", WEFT_ERR_MISMATCH, NULL);
            }
        }
        weft_tensor_release(loss);
        weft_tensor_release(x1);
        weft_tensor_release(x2);
        weft_tensor_release(r1);
        weft_tensor_release(r2);
        weft_tensor_release(t1);
        weft_tensor_release(t2);
    }
}

static void latency_lines(const char *p50, const char *p99, uint64_t *ns, size_t n, size_t iters,
                          size_t warm)
{
    char extra[128];
    qsort(ns, n, sizeof(*ns), bench_cmp_u64);
    snprintf(extra, sizeof(extra), "\"count\":%zu,\"warmup\":%zu", iters, warm);
    emit(p50, (double)bench_percentile(ns, n, 50) / 1e3, "us", extra);
    emit(p99, (double)bench_percentile(ns, n, 99) / 1e3, "us", extra);
}

static void measure(weft_agent_t *a, const args_t *g)
{
    switch (g->mode) {
    case MODE_A1: {
        uint64_t *ns = calloc(g->count, sizeof(*ns));
        for (int i = 0; i < 50; i++) {
            (void)a1_once(a, i == 0);
        }
        for (size_t i = 0; i < g->count; i++) {
            ns[i] = a1_once(a, 0);
        }
        latency_lines("a1_p50", "a1_p99", ns, g->count, g->count, 50);
        if (getenv("BENCH_PARTS") != NULL) {
            fprintf(stderr, "a1 parts (mean us): forward %.1f, backward %.1f, release %.1f\n",
                    (double)g_parts[0] / 1e3 / (double)(g->count + 50),
                    (double)g_parts[1] / 1e3 / (double)(g->count + 50),
                    (double)g_parts[2] / 1e3 / (double)(g->count + 50));
        }
        free(ns);
        break;
    }
    case MODE_A2: {
        uint64_t *ns = calloc(g->count, sizeof(*ns));
        char p50[32], p99[32];
        for (int i = 0; i < 20; i++) {
            (void)a2_once(a, g->hops, i == 0);
        }
        for (size_t i = 0; i < g->count; i++) {
            ns[i] = a2_once(a, g->hops, 0);
        }
        snprintf(p50, sizeof(p50), "a2_p50_h%d", g->hops);
        snprintf(p99, sizeof(p99), "a2_p99_h%d", g->hops);
        latency_lines(p50, p99, ns, g->count, g->count, 20);
        free(ns);
        break;
    }
    case MODE_A3: {
        double r1a[3], r1b[3], r1c[3];
        char extra[256];
        for (int i = 0; i < 100; i++) {
            a3_once(a, i == 0);
        }
        double r0a = rss_mb();
        remote_stats(a, 1, r1a);
        uint64_t t0 = bench_now_ns();
        for (size_t i = 0; i < g->count; i++) {
            a3_once(a, 0);
        }
        double secs = (double)(bench_now_ns() - t0) / 1e9;
        size_t live0 = weft_dist_context_count(a);
        remote_stats(a, 1, r1b);
        double r0b = rss_mb();
        struct timespec sec = {1, 0};
        nanosleep(&sec, NULL);
        remote_stats(a, 1, r1c);
        size_t live1 = weft_dist_context_count(a);
        double at0 = (double)live0 > r1b[1] ? (double)live0 : r1b[1];
        double at1 = (double)live1 > r1c[1] ? (double)live1 : r1c[1];
        snprintf(extra, sizeof(extra), "\"count\":%zu", g->count);
        emit("a3_seconds", secs, "s", extra);
        emit("a3_rss_growth_mb_rank0", r0b - r0a, "MiB", extra);
        emit("a3_rss_growth_mb_rank1", r1b[0] - r1a[0], "MiB", extra);
        snprintf(extra, sizeof(extra), "\"count\":%zu,\"at_0ms\":%g,\"rank0\":%zu,\"rank1\":%g",
                 g->count, at0, live1, r1c[1]);
        emit("a3_live_contexts_after_1s", at1, "contexts", extra);
        break;
    }
    case MODE_A4:
        measure_a4(a);
        break;
    }
}

/* ---------------------------------------------------------------- ranks */

static weft_agent_t *start(int rank, int world, int port, int64_t peer_timeout_ms)
{
    weft_agent_opts_t o;
    weft_agent_t *a = NULL;

    my_rank = rank;
    weft_rng_init(&g_rng, 7, (uint64_t)rank);
    weft_agent_opts_init(&o);
    o.rank = rank;
    o.world_size = world;
    o.master_addr = "127.0.0.1";
    o.master_port = port;
    o.rendezvous_timeout_ms = RENDEZVOUS_TIMEOUT_MS;
    if (peer_timeout_ms > 0) {
        o.peer_timeout_ms = peer_timeout_ms;
    }
    check(weft_agent_create(&o, &a), "weft_agent_create");
    check(weft_dist_init(a), "weft_dist_init");
    check(weft_rpc_register(a, "add", add_cb, NULL), "register");
    check(weft_rpc_register(a, "slow_add", slow_add_cb, NULL), "register");
    check(weft_rpc_register(a, "hop", hop_cb, NULL), "register");
    check(weft_rpc_register(a, "stats", stats_cb, NULL), "register");
    weft_op_set_threads(1);
    return a;
}

static void stop(weft_agent_t *a)
{
    weft_status_t s = weft_agent_shutdown(a, SHUTDOWN_TIMEOUT_MS);
    weft_agent_free(a);
    check(s, "weft_agent_shutdown");
}

static int rank0_main(const args_t *g, int port_fd, int done_fd);
static int rank_main(const args_t *g, int rank, int port, int done_fd);

static int rank0_cb(void *arg, int port_fd, int done_fd)
{
    return rank0_main(arg, port_fd, done_fd);
}

static int rank_cb(void *arg, int rank, int port, int done_fd)
{
    return rank_main(arg, rank, port, done_fd);
}

static int rank0_main(const args_t *g, int port_fd, int done_fd)
{
    weft_agent_t *a = start(0, g->world, 0, 0);
    if (bench_ranks_port(port_fd, weft_agent_port(a)) != 0) {
        fail("write port", WEFT_ERR_IO, NULL);
    }
    check(weft_agent_join(a), "weft_agent_join");
    measure(a, g);
    close(done_fd); /* EOF: the others may shut down */
    stop(a);
    return 0;
}

static int rank_main(const args_t *g, int rank, int port, int done_fd)
{
    weft_agent_t *a = start(rank, g->world, port, 0);
    check(weft_agent_join(a), "weft_agent_join");
    bench_ranks_wait_done(done_fd);
    stop(a);
    return 0;
}

static int parse(int argc, char **argv, args_t *g)
{
    memset(g, 0, sizeof(*g));
    if (argc == 3 && strcmp(argv[1], "a1") == 0) {
        g->mode = MODE_A1;
        g->world = 2;
        g->count = bench_parse_size(argv[2]);
    } else if (argc == 4 && strcmp(argv[1], "a2") == 0) {
        g->mode = MODE_A2;
        g->hops = atoi(argv[2]);
        g->world = g->hops + 1;
        g->count = bench_parse_size(argv[3]);
    } else if (argc == 3 && strcmp(argv[1], "a3") == 0) {
        g->mode = MODE_A3;
        g->world = 2;
        g->count = bench_parse_size(argv[2]);
    } else if (argc == 2 && strcmp(argv[1], "a4") == 0) {
        g->mode = MODE_A4;
        g->world = 3;
        g->count = 1;
    } else {
        goto usage;
    }
    if (g->count == 0 || g->world < 2 || g->world > MAX_WORLD) {
        goto usage;
    }
    return 0;
usage:
    fprintf(stderr,
            "usage: %s a1 ITERS | a2 HOPS(1..%d) ITERS | a3 N | a4\n", argv[0], MAX_WORLD - 1);
    return -1;
}

int main(int argc, char **argv)
{
    args_t g;
    if (parse(argc, argv, &g) != 0) {
        return 2;
    }
    return bench_ranks_run("bench_dist_autograd", g.world, rank0_cb, rank_cb, &g, g.mode == MODE_A4 ? 1 : -1);
}
