/* One rank of the chaos world (docs/chaos.md), driven by tests/chaos/driver.py.
 *
 *     chaos_rank run|restart|savelost RANK WORLD MASTER_PORT SEED ITERS CKPT_DIR PEER_TIMEOUT_MS
 *
 * "run": every iteration runs five phases in an order drawn from the seed and the iteration (the
 * same on every rank): RPCs (sync, async, nested), collectives (all_reduce on the world, a
 * broadcast on the sub-group of ranks 1..W-1), RRefs (remote, a fork to a third rank, to_here),
 * the parameter server (exact pulls, pushes, a clock, a checkpoint every SAVE_EVERY steps) and
 * distributed autograd (a forward through a call and an RRef, backward, the distributed
 * optimizer). Every value read is checked exactly. The first failed operation is reported with
 * the monotonic time it returned; the rank then keeps running its iterations (so that no live
 * rank waits on it) until the driver writes STOP on its stdin, then tears down.
 * "restart": a fresh world that loads the last checkpoint, checks every value against the pushes
 * of the steps before its clock, runs the parameter server to the last step and checks the end.
 * "savelost": the regression of a checkpoint that waited for a lost worker (save_lost below).
 *
 * Lines on stdout, for the driver: "PORT p" (rank 0, before join), "P iter phase" (a phase
 * starts, until the first error), "E t_ns STATUS iter phase op: text" (the first error), "SAVED
 * clock" (a checkpoint this rank saw acknowledged), "BAD what" (a wrong value), "LOADED clock",
 * "FINAL clock", "SHUTDOWN status", "DONE code". Exit code 0: nothing wrong seen by this rank. */
#include <inttypes.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <weft/weft.h>

#include "certs.h"

#define MAX_WORLD     16
#define N_SERVERS     2
#define DENSE_N       64    /* dense table elements, two chunks: one per server */
#define BIG_N         65536 /* the large all_reduce (256 KiB: ring, direct connections) */
#define SPARSE_IDS    32    /* sparse table rows */
#define SPARSE_DIM    4     /* sparse row length */
#define ROWS_PER_PUSH 3     /* rows one worker pushes per step */
#define SAVE_EVERY    4     /* a checkpoint every this many steps */
#define OP_TIMEOUT_MS 20000
#define STOP_WAIT_MS  120000
#define SHUTDOWN_MS   10000
#define N_PHASES      5

enum { PH_RPC, PH_COLL, PH_RREF, PH_PS, PH_DIST };
static const char *const PHASE_NAMES[N_PHASES] = {"rpc", "coll", "rref", "ps", "dist"};

typedef struct {
    weft_agent_t *a;
    int rank, world;
    uint64_t seed;
    int iters;
    const char *ckpt;
    weft_pg_t *wpg, *sub;
    weft_ps_t *ps;
    weft_ps_table_t *dense, *sparse;
    weft_rref_t *param; /* a parameter owned by rank + 2 */
    weft_dist_optim_t *opt;
    weft_tensor_t *big;
    int iter;
    const char *phase;
    bool failed;
    int bad; /* wrong values seen */
} chaos_t;

/* ------------------------------------------------------------ reporting */

static int64_t mono_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Reports the first failed operation: status, where, and its text on one line. */
static void op_failed(chaos_t *c, const char *op, weft_status_t st, const char *text)
{
    if (c->failed) {
        return;
    }
    int64_t t = mono_ns();
    char line[1024];

    c->failed = true;
    snprintf(line, sizeof(line), "%s", text != NULL ? text : "");
    for (char *p = line; *p != '\0'; p++) {
        if (*p == '\n' || *p == '\r') {
            *p = ' ';
        }
    }
    printf("E %" PRId64 " %s %d %s %s: %s\n", t, weft_status_name(st), c->iter, c->phase, op, line);
}

/* True when @p st is WEFT_OK; otherwise reports it (with weft_last_error()). */
static bool ok(chaos_t *c, const char *op, weft_status_t st)
{
    if (st == WEFT_OK) {
        return true;
    }
    op_failed(c, op, st, weft_last_error());
    return false;
}

/* Waits for @p f (released here); true when it succeeded. *value_p (may be NULL) gets its value. */
static bool wait_ok(chaos_t *c, const char *op, weft_future_t *f, weft_value_t **value_p)
{
    weft_status_t st = weft_future_wait(f, 0);
    bool good = st == WEFT_OK;

    if (!good) {
        op_failed(c, op, st, weft_future_error(f));
    } else if (value_p != NULL) {
        weft_future_take_value(f, value_p);
    }
    weft_future_release(f);
    return good;
}

static void bad(chaos_t *c, const char *what, long long a, long long b)
{
    printf("BAD iter %d phase %s: %s (%lld, expected %lld)\n", c->iter, c->phase, what, a, b);
    c->bad++;
}

/* ------------------------------------------------------------ handlers */

static void fn_echo(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, weft_call_take_args(call));
}

/* Calls echo on the next rank with its arguments and answers with that call's answer. */
static void fn_nested(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_agent_t *a = weft_call_agent(call);
    int to = (weft_agent_rank(a) + 1) % weft_agent_world_size(a);
    weft_future_t *f = NULL;
    weft_status_t st = weft_rpc_async(a, to, "echo", weft_call_args(call), OP_TIMEOUT_MS, &f);

    if (st != WEFT_OK) {
        weft_call_fail(call, st, "nested: %s", weft_last_error());
        return;
    }
    weft_call_reply_future(call, f);
}

/* An RRef's value: 8 floats, the caller's payload (rank, iter) folded in. */
static void fn_make(weft_call_t *call, void *arg)
{
    (void)arg;
    size_t len = 0;
    const int32_t *p = weft_value_payload(weft_call_args(call), &len);
    int64_t n = 8;
    weft_tensor_t *t = NULL;
    weft_value_t *v = NULL;

    if (len != 2 * sizeof(int32_t) || weft_tensor_empty(WEFT_F32, 1, &n, &t) != WEFT_OK) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "make: bad arguments");
        return;
    }
    float *d = weft_tensor_data(t);
    for (int i = 0; i < 8; i++) {
        d[i] = (float)(p[0] * 100000 + p[1] * 10 + i);
    }
    weft_value_create(&v);
    weft_value_push_tensor(v, t);
    weft_call_reply(call, v);
}

/* Fetches the RRef it was given (a fork) and answers with its value. */
static void fn_use_rref(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_rref_t *r = weft_value_rref(weft_call_args(call), 0);
    weft_future_t *f = NULL;

    if (r == NULL) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "use_rref: no rref in the arguments");
        return;
    }
    weft_status_t st = weft_rref_to_here_async(r, OP_TIMEOUT_MS, &f);
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "use_rref: %s", weft_last_error());
        return;
    }
    weft_call_reply_future(call, f);
}

static void fn_dadd(weft_call_t *call, void *arg)
{
    (void)arg;
    const weft_value_t *in = weft_call_args(call);
    weft_tensor_t *y = NULL;
    weft_value_t *v = NULL;

    if (weft_op_add(weft_value_tensor(in, 0), weft_value_tensor(in, 1), &y) != WEFT_OK) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "dadd: %s", weft_last_error());
        return;
    }
    weft_value_create(&v);
    weft_value_push_tensor(v, y);
    weft_call_reply(call, v);
}

static weft_tensor_t *g_param; /* this rank's parameter (owned here, stepped by rank - 2) */

static void fn_param(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_value_t *v = NULL;

    weft_value_create(&v);
    weft_value_add_tensor(v, g_param);
    weft_call_reply(call, v);
}

/* ------------------------------------------------------------ the parameter server's values */

/* Worker w's dense gradient at step s, element i: 4 * g, g in [-3, 3], so that the mean over 4
 * workers, SGD with lr 1 and every sum stay exact in f32. */
static int dense_g(const chaos_t *c, int64_t s, int w, int i)
{
    return (int)(((uint64_t)(s * 7 + w * 13 + i * 3) + c->seed) % 7) - 3;
}

static int sparse_id(const chaos_t *c, int64_t s, int w, int j)
{
    return (int)(((uint64_t)(s * 5 + w * 11 + j * 7) + c->seed) % SPARSE_IDS);
}

static int sparse_g(const chaos_t *c, int64_t s, int w, int j, int k)
{
    return (int)(((uint64_t)(s + w + j * 3 + k * 5) + c->seed) % 5) - 2;
}

/* The values after the steps before @p clock, computed as the servers do (SGD, lr 1, on the mean
 * of the workers' gradients, which are 4 times these integers): exact in f32. */
static void expected(const chaos_t *c, int64_t clock, float *dense, float *rows)
{
    float acc_d[DENSE_N], acc_r[SPARSE_IDS * SPARSE_DIM];
    float scale = 1.0f / (float)c->world;

    memset(dense, 0, DENSE_N * sizeof(float));
    memset(rows, 0, SPARSE_IDS * SPARSE_DIM * sizeof(float));
    for (int64_t s = 0; s < clock; s++) {
        memset(acc_d, 0, sizeof(acc_d));
        memset(acc_r, 0, sizeof(acc_r));
        for (int w = 0; w < c->world; w++) {
            for (int i = 0; i < DENSE_N; i++) {
                acc_d[i] += (float)(4 * dense_g(c, s, w, i));
            }
            for (int j = 0; j < ROWS_PER_PUSH; j++) {
                for (int k = 0; k < SPARSE_DIM; k++) {
                    acc_r[sparse_id(c, s, w, j) * SPARSE_DIM + k] +=
                        (float)(4 * sparse_g(c, s, w, j, k));
                }
            }
        }
        for (int i = 0; i < DENSE_N; i++) {
            dense[i] -= acc_d[i] * scale;
        }
        for (int i = 0; i < SPARSE_IDS * SPARSE_DIM; i++) {
            rows[i] -= acc_r[i] * scale;
        }
    }
}

static weft_status_t ps_setup(chaos_t *c)
{
    int servers[N_SERVERS] = {0, 1};
    int workers[MAX_WORLD];
    weft_ps_opts_t po;

    for (int r = 0; r < c->world; r++) {
        workers[r] = r;
    }
    weft_ps_opts_init(&po);
    po.servers = servers;
    po.n_servers = N_SERVERS;
    po.workers = workers;
    po.n_workers = (size_t)c->world;
    return weft_ps_create(c->a, &po, &c->ps);
}

static weft_status_t tables_create(chaos_t *c)
{
    weft_ps_table_spec_t s;

    weft_ps_table_spec_init(&s, "dense", WEFT_PS_DENSE);
    s.ndim = 1;
    s.shape[0] = DENSE_N;
    s.chunk_bytes = DENSE_N * sizeof(float) / 2;
    s.optimizer = WEFT_PS_SGD;
    s.sgd.lr = 1.0;
    s.consistency = WEFT_PS_SYNC;
    weft_status_t st = weft_ps_table_create(c->ps, &s, OP_TIMEOUT_MS, &c->dense);
    if (st != WEFT_OK) {
        return st;
    }
    weft_ps_table_spec_init(&s, "sparse", WEFT_PS_SPARSE);
    s.dim = SPARSE_DIM;
    s.id_bound = SPARSE_IDS;
    s.optimizer = WEFT_PS_SGD;
    s.sgd.lr = 1.0;
    s.consistency = WEFT_PS_SYNC;
    return weft_ps_table_create(c->ps, &s, OP_TIMEOUT_MS, &c->sparse);
}

/* Pulls the dense table and every row at this worker's clock and checks them against the pushes
 * of the steps before it (a SYNC pull at clock k sees exactly those). */
static bool ps_check_all(chaos_t *c)
{
    int64_t clock = weft_ps_worker_clock(c->ps);
    int64_t dn = DENSE_N, rshape[2] = {SPARSE_IDS, SPARSE_DIM};
    uint64_t ids[SPARSE_IDS];
    float want_d[DENSE_N], want_r[SPARSE_IDS * SPARSE_DIM];
    weft_tensor_t *d = NULL, *r = NULL;
    weft_future_t *f1 = NULL, *f2 = NULL;
    bool good = false;

    for (int i = 0; i < SPARSE_IDS; i++) {
        ids[i] = (uint64_t)i;
    }
    weft_tensor_empty(WEFT_F32, 1, &dn, &d);
    weft_tensor_empty(WEFT_F32, 2, rshape, &r);
    if (!ok(c, "ps pull", weft_ps_pull_async(c->dense, d, OP_TIMEOUT_MS, &f1))) {
        goto out;
    }
    if (!ok(c, "ps pull_rows",
            weft_ps_pull_rows_async(c->sparse, ids, SPARSE_IDS, r, OP_TIMEOUT_MS, &f2))) {
        weft_future_wait(f1, 0);
        weft_future_release(f1);
        goto out;
    }
    bool g1 = wait_ok(c, "ps pull", f1, NULL);
    bool g2 = wait_ok(c, "ps pull_rows", f2, NULL);
    if (!g1 || !g2) {
        goto out;
    }
    expected(c, clock, want_d, want_r);
    const float *pd = weft_tensor_data(d), *pr = weft_tensor_data(r);
    good = true;
    for (int i = 0; i < DENSE_N && good; i++) {
        if (pd[i] != want_d[i]) {
            bad(c, "dense element", (long long)pd[i], (long long)want_d[i]);
            printf("BAD clock %lld element %d\n", (long long)clock, i);
            good = false;
        }
    }
    for (int i = 0; i < SPARSE_IDS * SPARSE_DIM && good; i++) {
        if (pr[i] != want_r[i]) {
            bad(c, "sparse element", (long long)pr[i], (long long)want_r[i]);
            printf("BAD clock %lld row %d col %d\n", (long long)clock, i / SPARSE_DIM,
                   i % SPARSE_DIM);
            good = false;
        }
    }
out:
    weft_tensor_release(d);
    weft_tensor_release(r);
    return good;
}

/* One step of this worker: pushes (waited for: acknowledged), then the clock; a checkpoint every
 * SAVE_EVERY steps. With @p check, first the exact pull of every value. */
static void ps_step(chaos_t *c, bool check)
{
    int w = weft_ps_worker_index(c->ps);
    int64_t s = weft_ps_worker_clock(c->ps);
    int64_t dn = DENSE_N, rshape[2] = {ROWS_PER_PUSH, SPARSE_DIM};
    uint64_t ids[ROWS_PER_PUSH];
    weft_tensor_t *g = NULL, *rows = NULL;
    weft_future_t *f1 = NULL, *f2 = NULL;

    if (check && !ps_check_all(c)) {
        return;
    }
    weft_tensor_empty(WEFT_F32, 1, &dn, &g);
    weft_tensor_empty(WEFT_F32, 2, rshape, &rows);
    float *pg = weft_tensor_data(g), *pr = weft_tensor_data(rows);
    for (int i = 0; i < DENSE_N; i++) {
        pg[i] = (float)(4 * dense_g(c, s, w, i));
    }
    for (int j = 0; j < ROWS_PER_PUSH; j++) {
        ids[j] = (uint64_t)sparse_id(c, s, w, j);
        for (int k = 0; k < SPARSE_DIM; k++) {
            pr[j * SPARSE_DIM + k] = (float)(4 * sparse_g(c, s, w, j, k));
        }
    }
    bool pushed = false;
    if (ok(c, "ps push", weft_ps_push_async(c->dense, g, OP_TIMEOUT_MS, &f1))) {
        if (ok(c, "ps push_rows",
               weft_ps_push_rows_async(c->sparse, ids, ROWS_PER_PUSH, rows, OP_TIMEOUT_MS, &f2))) {
            bool g2 = wait_ok(c, "ps push_rows", f2, NULL);
            pushed = wait_ok(c, "ps push", f1, NULL) && g2;
        } else {
            wait_ok(c, "ps push", f1, NULL);
        }
    }
    if (pushed && ok(c, "ps clock", weft_ps_clock(c->ps, OP_TIMEOUT_MS))) {
        int64_t clock = weft_ps_worker_clock(c->ps);
        if (clock % SAVE_EVERY == 0 &&
            ok(c, "ps save", weft_ps_save(c->ps, c->ckpt, OP_TIMEOUT_MS))) {
            printf("SAVED %lld\n", (long long)clock);
        }
    }
    weft_tensor_release(g);
    weft_tensor_release(rows);
}

/* ------------------------------------------------------------ phases */

static weft_value_t *value_pair(int32_t x, int32_t y)
{
    int32_t p[2] = {x, y};
    weft_value_t *v = NULL;

    weft_value_create(&v);
    weft_value_set_payload(v, p, sizeof(p));
    return v;
}

/* Checks that @p v's payload is (x, y). */
static void check_pair(chaos_t *c, const char *what, const weft_value_t *v, int32_t x, int32_t y)
{
    size_t len = 0;
    const int32_t *p = weft_value_payload(v, &len);

    if (len != 2 * sizeof(int32_t)) {
        bad(c, what, (long long)len, 8);
    } else if (p[0] != x || p[1] != y) {
        bad(c, what, (long long)p[0] * 1000000 + p[1], (long long)x * 1000000 + y);
    }
}

static void phase_rpc(chaos_t *c)
{
    int r = c->rank, w = c->world;
    weft_value_t *args = value_pair(r, c->iter), *res = NULL;
    weft_future_t *f2 = NULL, *f3 = NULL;

    if (ok(c, "rpc sync", weft_rpc_sync(c->a, (r + 1) % w, "echo", args, OP_TIMEOUT_MS, &res))) {
        check_pair(c, "echo", res, r, c->iter);
    }
    weft_value_free(res);
    res = NULL;
    bool a2 =
        ok(c, "rpc async", weft_rpc_async(c->a, (r + 2) % w, "echo", args, OP_TIMEOUT_MS, &f2));
    bool a3 =
        ok(c, "rpc async", weft_rpc_async(c->a, (r + 3) % w, "echo", args, OP_TIMEOUT_MS, &f3));
    if (a2 && wait_ok(c, "rpc async", f2, &res)) {
        check_pair(c, "async echo", res, r, c->iter);
    }
    weft_value_free(res);
    res = NULL;
    if (a3 && wait_ok(c, "rpc async", f3, &res)) {
        check_pair(c, "async echo", res, r, c->iter);
    }
    weft_value_free(res);
    res = NULL;
    if (ok(c, "rpc nested",
           weft_rpc_sync(c->a, (r + 1) % w, "nested", args, OP_TIMEOUT_MS, &res))) {
        check_pair(c, "nested echo", res, r, c->iter);
    }
    weft_value_free(res);
    weft_value_free(args);
}

static void phase_coll(chaos_t *c)
{
    int64_t n = 16;
    weft_tensor_t *t = NULL;
    int w = c->world;

    /* all_reduce of a small tensor (direct exchange) and of a large one (ring) on the world */
    weft_tensor_empty(WEFT_F32, 1, &n, &t);
    float *d = weft_tensor_data(t);
    for (int i = 0; i < n; i++) {
        d[i] = (float)((c->rank + 1) * (c->iter + 1) + i);
    }
    if (ok(c, "all_reduce", weft_coll_all_reduce(c->wpg, t, WEFT_SUM, NULL))) {
        for (int i = 0; i < n; i++) {
            float want = (float)(w * (w + 1) / 2 * (c->iter + 1) + w * i);
            if (d[i] != want) {
                bad(c, "all_reduce", (long long)d[i], (long long)want);
                break;
            }
        }
    }
    float *b = weft_tensor_data(c->big);
    for (int i = 0; i < BIG_N; i++) {
        b[i] = (float)((c->rank + 1) * (i % 13));
    }
    if (ok(c, "all_reduce big", weft_coll_all_reduce(c->wpg, c->big, WEFT_SUM, NULL))) {
        for (int i = 0; i < BIG_N; i++) {
            float want = (float)(w * (w + 1) / 2 * (i % 13));
            if (b[i] != want) {
                bad(c, "all_reduce big", (long long)b[i], (long long)want);
                break;
            }
        }
    }
    /* broadcast on the sub-group (ranks 1..W-1), from a root that turns */
    if (weft_pg_rank(c->sub) >= 0) {
        int root = c->iter % weft_pg_size(c->sub);
        for (int i = 0; i < n; i++) {
            d[i] = weft_pg_rank(c->sub) == root ? (float)(c->iter * 100 + i) : -1.0f;
        }
        if (ok(c, "broadcast", weft_coll_broadcast(c->sub, t, root, NULL))) {
            for (int i = 0; i < n; i++) {
                if (d[i] != (float)(c->iter * 100 + i)) {
                    bad(c, "broadcast", (long long)d[i], (long long)(c->iter * 100 + i));
                    break;
                }
            }
        }
    }
    weft_tensor_release(t);
}

static void phase_rref(chaos_t *c)
{
    int r = c->rank, w = c->world;
    weft_value_t *args = value_pair(r, c->iter), *v = NULL, *res = NULL;
    weft_rref_t *rr = NULL;

    if (!ok(c, "rref remote",
            weft_rref_remote(c->a, (r + 1) % w, "make", args, OP_TIMEOUT_MS, &rr))) {
        weft_value_free(args);
        return;
    }
    weft_value_free(args);
    float want0 = (float)(r * 100000 + c->iter * 10);
    /* a fork: the third rank fetches the value */
    weft_value_create(&v);
    weft_value_add_rref(v, rr);
    if (ok(c, "rref fork", weft_rpc_sync(c->a, (r + 2) % w, "use_rref", v, OP_TIMEOUT_MS, &res))) {
        const weft_tensor_t *t = weft_value_tensor(res, 0);
        if (t == NULL || ((const float *)weft_tensor_data(t))[0] != want0) {
            bad(c, "forked rref value",
                t == NULL ? -1 : (long long)((const float *)weft_tensor_data(t))[0],
                (long long)want0);
        }
    }
    weft_value_free(v);
    weft_value_free(res);
    res = NULL;
    if (ok(c, "rref to_here", weft_rref_to_here(rr, OP_TIMEOUT_MS, &res))) {
        const weft_tensor_t *t = weft_value_tensor(res, 0);
        if (t == NULL || ((const float *)weft_tensor_data(t))[7] != want0 + 7) {
            bad(c, "rref value",
                t == NULL ? -1 : (long long)((const float *)weft_tensor_data(t))[7],
                (long long)want0 + 7);
        }
    }
    weft_value_free(res);
    weft_rref_release(rr);
}

static weft_tensor_t *leaf64(int64_t n, double base)
{
    weft_tensor_t *t = NULL;

    weft_tensor_empty(WEFT_F64, 1, &n, &t);
    double *d = weft_tensor_data(t);
    for (int64_t i = 0; i < n; i++) {
        d[i] = base + 0.25 * (double)i;
    }
    weft_tensor_set_requires_grad(t, 1);
    return t;
}

static void phase_dist(chaos_t *c)
{
    uint64_t ctx = 0;
    weft_tensor_t *x = leaf64(4, c->rank), *y = leaf64(4, c->iter % 5);
    weft_tensor_t *m = NULL, *loss = NULL;
    weft_value_t *v = NULL, *z = NULL, *p = NULL;

    if (!ok(c, "dist context", weft_dist_context_create(c->a, &ctx))) {
        goto out;
    }
    weft_value_create(&v);
    weft_value_add_tensor(v, x);
    weft_value_add_tensor(v, y);
    if (!ok(c, "dist forward call",
            weft_rpc_sync(c->a, (c->rank + 1) % c->world, "dadd", v, OP_TIMEOUT_MS, &z))) {
        goto release;
    }
    if (!ok(c, "dist forward to_here", weft_rref_to_here(c->param, OP_TIMEOUT_MS, &p))) {
        goto release;
    }
    if (!ok(c, "dist forward", weft_op_mul(weft_value_tensor(z, 0), weft_value_tensor(p, 0), &m)) ||
        !ok(c, "dist forward", weft_op_sum(m, 0, NULL, 0, &loss))) {
        goto release;
    }
    weft_dist_backward_opts_t bo;
    weft_dist_backward_opts_init(&bo);
    bo.timeout_ms = OP_TIMEOUT_MS;
    if (!ok(c, "dist backward", weft_dist_backward(c->a, ctx, 1, &loss, &bo))) {
        goto release;
    }
    ok(c, "dist optim step", weft_dist_optim_step(c->opt, ctx, OP_TIMEOUT_MS));
release:
    ok(c, "dist context release", weft_dist_context_release(c->a, ctx, OP_TIMEOUT_MS));
out:
    weft_value_free(v);
    weft_value_free(z);
    weft_value_free(p);
    weft_tensor_release(m);
    weft_tensor_release(loss);
    weft_tensor_release(x);
    weft_tensor_release(y);
}

/* ------------------------------------------------------------ the driver's commands */

/* Waits up to @p ms for "STOP" on stdin; true once it came (or stdin closed). */
static bool stop_requested(int ms)
{
    static char buf[256];
    static size_t have;
    static bool stopped;
    struct pollfd pfd = {0, POLLIN, 0};

    if (stopped) {
        return true;
    }
    if (poll(&pfd, 1, ms) <= 0) {
        return false;
    }
    ssize_t n = read(0, buf + have, sizeof(buf) - 1 - have);
    if (n <= 0) {
        stopped = true;
        return true;
    }
    have += (size_t)n;
    buf[have] = '\0';
    if (strstr(buf, "STOP") != NULL) {
        stopped = true;
        return true;
    }
    if (have > sizeof(buf) / 2) {
        have = 0;
    }
    return false;
}

/* ------------------------------------------------------------ the ranks */

static weft_status_t agent_start(chaos_t *c, int port, int64_t peer_timeout_ms, bool full)
{
    weft_agent_opts_t ao;
    weft_status_t st;

    weft_agent_opts_init(&ao);
    ao.rank = c->rank;
    ao.world_size = c->world;
    ao.master_addr = "127.0.0.1";
    ao.master_port = port;
    ao.peer_timeout_ms = peer_timeout_ms;
    ao.default_timeout_ms = OP_TIMEOUT_MS;
    ao.rendezvous_timeout_ms = 60000;
    ao.handler_threads = 2;
    st = weft_agent_create(&ao, &c->a);
    if (st != WEFT_OK) {
        return st;
    }
    if (c->rank == 0) {
        printf("PORT %d\n", weft_agent_port(c->a));
    }
    if (full) {
        if ((st = weft_rref_init(c->a)) != WEFT_OK || (st = weft_dist_init(c->a)) != WEFT_OK ||
            (st = weft_rpc_register(c->a, "echo", fn_echo, NULL)) != WEFT_OK ||
            (st = weft_rpc_register(c->a, "nested", fn_nested, NULL)) != WEFT_OK ||
            (st = weft_rpc_register(c->a, "make", fn_make, NULL)) != WEFT_OK ||
            (st = weft_rpc_register(c->a, "use_rref", fn_use_rref, NULL)) != WEFT_OK ||
            (st = weft_rpc_register(c->a, "dadd", fn_dadd, NULL)) != WEFT_OK ||
            (st = weft_rpc_register(c->a, "param", fn_param, NULL)) != WEFT_OK) {
            return st;
        }
    }
    if ((st = ps_setup(c)) != WEFT_OK) {
        return st;
    }
    return weft_agent_join(c->a);
}

static int run(chaos_t *c)
{
    int sub_ranks[MAX_WORLD];
    int64_t big_n = BIG_N;

    for (int r = 1; r < c->world; r++) {
        sub_ranks[r - 1] = r;
    }
    c->phase = "setup";
    if (!ok(c, "pg world", weft_pg_world(c->a, &c->wpg)) ||
        !ok(c, "pg new", weft_pg_new(c->a, sub_ranks, c->world - 1, &c->sub)) ||
        !ok(c, "tables", tables_create(c)) ||
        !ok(c, "param",
            weft_rref_remote(c->a, (c->rank + 2) % c->world, "param", NULL, OP_TIMEOUT_MS,
                             &c->param))) {
        return 1;
    }
    /* The parameter's creation must have reached its owner before the reference goes home in
     * the optimizer's call: a reference that overtakes its creation there is refused ("no longer
     * known to its owner", docs/chaos.md). The fetch waits for the creation. */
    weft_value_t *pv = NULL;
    if (!ok(c, "param to_here", weft_rref_to_here(c->param, OP_TIMEOUT_MS, &pv))) {
        return 1;
    }
    weft_value_free(pv);
    weft_dist_optim_config_t cfg;
    weft_dist_optim_config_init(&cfg, WEFT_DIST_OPTIM_SGD, 0.01);
    if (!ok(c, "optim", weft_dist_optim_create(c->a, &cfg, 1, &c->param, &c->opt)) ||
        !ok(c, "save", weft_ps_save(c->ps, c->ckpt, OP_TIMEOUT_MS))) {
        return 1;
    }
    printf("SAVED 0\n");
    weft_tensor_empty(WEFT_F32, 1, &big_n, &c->big);
    for (c->iter = 0; c->iter < c->iters; c->iter++) {
        weft_rng_t rng;
        int order[N_PHASES];

        /* the phases' order: the same on every rank (collectives are matched in order) */
        weft_rng_init(&rng, c->seed, (uint64_t)c->iter);
        for (int i = 0; i < N_PHASES; i++) {
            order[i] = i;
        }
        for (int i = N_PHASES - 1; i > 0; i--) {
            int j = (int)weft_rng_below(&rng, (uint64_t)i + 1);
            int t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
        for (int i = 0; i < N_PHASES; i++) {
            c->phase = PHASE_NAMES[order[i]];
            if (!c->failed) {
                printf("P %d %s\n", c->iter, c->phase);
            }
            switch (order[i]) {
            case PH_RPC:
                phase_rpc(c);
                break;
            case PH_COLL:
                phase_coll(c);
                break;
            case PH_RREF:
                phase_rref(c);
                break;
            case PH_PS:
                ps_step(c, true);
                break;
            default:
                phase_dist(c);
                break;
            }
        }
        if (c->failed && stop_requested(50)) {
            break;
        }
    }
    c->phase = "end";
    if (!c->failed) {
        /* no fault (it came too late): the end values, then the orderly end */
        ps_check_all(c);
        if (c->rank == 0 && !c->failed) {
            printf("FINAL %lld\n", (long long)weft_ps_worker_clock(c->ps));
        }
        ok(c, "ps finish", weft_ps_finish(c->ps, OP_TIMEOUT_MS));
    }
    return 0;
}

static int restart(chaos_t *c)
{
    c->phase = "restart";
    if (!ok(c, "tables", tables_create(c)) ||
        !ok(c, "load", weft_ps_load(c->ps, c->ckpt, OP_TIMEOUT_MS))) {
        return 1;
    }
    printf("LOADED %lld\n", (long long)weft_ps_worker_clock(c->ps));
    while (weft_ps_worker_clock(c->ps) < c->iters && !c->failed) {
        c->iter = (int)weft_ps_worker_clock(c->ps);
        ps_step(c, true);
    }
    if (!c->failed && ps_check_all(c)) {
        printf("FINAL %lld\n", (long long)weft_ps_worker_clock(c->ps));
    }
    ok(c, "ps finish", weft_ps_finish(c->ps, OP_TIMEOUT_MS));
    return c->failed ? 1 : 0;
}

/* The regression of a lost worker during a checkpoint (docs/chaos.md): one step, then the last
 * rank waits to be killed while the others save; their save must fail with WEFT_ERR_PEER_LOST
 * naming it, not wait for its request until the deadline. */
static int save_lost(chaos_t *c)
{
    c->phase = "save";
    if (!ok(c, "tables", tables_create(c))) {
        return 1;
    }
    ps_step(c, false);
    if (c->failed) {
        return 1;
    }
    if (c->rank == c->world - 1) {
        printf("READY\n");
        while (!stop_requested(100)) {
        }
        return 0;
    }
    printf("SAVING\n");
    weft_status_t st = weft_ps_save(c->ps, c->ckpt, 60000);
    if (st == WEFT_OK) {
        printf("BAD the save succeeded without worker %d\n", c->world - 1);
        c->bad++;
    } else {
        op_failed(c, "ps save", st, weft_last_error());
    }
    return 0;
}

/* `chaos_rank certs DIR WORLD`: a job CA (DIR/ca.pem) and a certificate and key per rank
 * (DIR/rank<r>.pem, .key), as weftrun --tls makes them, for the driver's --tls runs. */
static int make_certs(const char *dir, int world)
{
    char why[512] = "";
    weft_certs_pem_t ca = {NULL, NULL};
    weft_certs_spec_t spec = {"weft chaos CA", -1, -300, 24L * 3600};
    int rc = weft_certs_make_ca(&spec, &ca, why, sizeof(why));
    if (rc == 0) {
        rc = weft_certs_write(dir, "ca", &ca, false, why, sizeof(why));
    }
    for (int r = 0; rc == 0 && r < world; r++) {
        char cn[32], stem[32];
        snprintf(cn, sizeof(cn), "weft-rank-%d", r);
        snprintf(stem, sizeof(stem), "rank%d", r);
        weft_certs_spec_t leaf_spec = {cn, r, -300, 24L * 3600};
        weft_certs_pem_t leaf;
        rc = weft_certs_make_leaf(&ca, &leaf_spec, &leaf, why, sizeof(why));
        if (rc == 0) {
            rc = weft_certs_write(dir, stem, &leaf, true, why, sizeof(why));
            weft_certs_pem_free(&leaf);
        }
    }
    weft_certs_pem_free(&ca);
    if (rc != 0) {
        fprintf(stderr, "chaos_rank certs: %s\n", why);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    chaos_t c;
    int code = 0;

    if (argc == 4 && strcmp(argv[1], "certs") == 0) {
        return make_certs(argv[2], atoi(argv[3]));
    }
    if (argc != 9) {
        fprintf(stderr,
                "usage: %s run|restart|savelost RANK WORLD MASTER_PORT SEED ITERS CKPT_DIR "
                "PEER_TIMEOUT_MS\n",
                argv[0]);
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    memset(&c, 0, sizeof(c));
    bool full = strcmp(argv[1], "run") == 0;
    bool savelost = strcmp(argv[1], "savelost") == 0;
    c.rank = atoi(argv[2]);
    c.world = atoi(argv[3]);
    int port = atoi(argv[4]);
    c.seed = strtoull(argv[5], NULL, 10);
    c.iters = atoi(argv[6]);
    c.ckpt = argv[7];
    int64_t peer_timeout_ms = atoll(argv[8]);
    c.phase = "start";
    if (c.world < 4 || c.world > MAX_WORLD || c.rank < 0 || c.rank >= c.world) {
        fprintf(stderr, "chaos_rank: a world of 4 to %d ranks\n", MAX_WORLD);
        return 2;
    }
    int64_t n = 4;
    weft_tensor_empty(WEFT_F64, 1, &n, &g_param);
    weft_tensor_fill(g_param, 0.5);
    weft_tensor_set_requires_grad(g_param, 1);

    weft_status_t st = agent_start(&c, port, peer_timeout_ms, full);
    if (st != WEFT_OK) {
        op_failed(&c, "start", st, weft_last_error());
        code = 1;
    } else {
        code = full ? run(&c) : savelost ? save_lost(&c) : restart(&c);
    }
    if (c.failed && full) {
        /* after a fault: run on no further; wait for the driver's word, then tear down */
        int64_t until = mono_ns() + (int64_t)STOP_WAIT_MS * 1000000;
        while (!stop_requested(100) && mono_ns() < until) {
        }
    }
    weft_dist_optim_free(c.opt);
    weft_rref_release(c.param);
    weft_pg_free(c.sub);
    weft_pg_free(c.wpg);
    weft_tensor_release(c.big);
    if (c.a != NULL) {
        st = weft_agent_shutdown(c.a, c.failed ? SHUTDOWN_MS : 30000);
        printf("SHUTDOWN %s\n", weft_status_name(st));
        if (st != WEFT_OK && !c.failed) {
            fprintf(stderr, "rank %d: shutdown: %s\n", c.rank, weft_last_error());
            code = 1;
        }
        weft_agent_free(c.a);
    }
    weft_tensor_release(g_param);
    if (c.bad > 0) {
        code = 3;
    }
    if (!full && !savelost && c.failed) {
        code = code != 0 ? code : 1;
    }
    printf("DONE %d\n", code);
    return code;
}
