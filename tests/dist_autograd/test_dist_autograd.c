/* Distributed autograd: gradients of a distributed backward equal the local engine's on the same
 * model split across workers (exact in f64), through plain calls, nested calls and RRefs;
 * retain_graph; an unused output is an error naming the call; a lost worker fails the backward;
 * contexts: nesting refused, release acknowledged everywhere, nothing left; the distributed
 * optimizer. */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ranks.h"

#define WAIT_MS 15000

/* ------------------------------------------------------------ tensors */

static weft_tensor_t *t64(int64_t r, int64_t c, double seed)
{
    int64_t shape[2] = {r, c};
    weft_tensor_t *t = NULL;

    weft_tensor_empty(WEFT_F64, 2, shape, &t);
    double *d = weft_tensor_data(t);
    for (int64_t i = 0; i < r * c; i++) {
        d[i] = sin(seed + 0.7 * (double)i) * 0.9;
    }
    return t;
}

static weft_tensor_t *leaf64(int64_t r, int64_t c, double seed)
{
    weft_tensor_t *t = t64(r, c, seed);
    weft_tensor_set_requires_grad(t, 1);
    return t;
}

static int same(const weft_tensor_t *a, const weft_tensor_t *b)
{
    if (a == NULL || b == NULL || weft_tensor_numel(a) != weft_tensor_numel(b)) {
        return 0;
    }
    const double *x = weft_tensor_data(a);
    const double *y = weft_tensor_data(b);
    for (int64_t i = 0; i < weft_tensor_numel(a); i++) {
        if (x[i] != y[i]) {
            fprintf(stderr, "element %lld: %.17g != %.17g\n", (long long)i, x[i], y[i]);
            return 0;
        }
    }
    return 1;
}

static weft_tensor_t *sum_all(weft_tensor_t *t)
{
    weft_tensor_t *s = NULL;
    weft_op_sum(t, 0, NULL, 0, &s);
    return s;
}

/* ------------------------------------------------------------ helpers */

/* Answers @p call with a value holding @p t (taken). */
static void reply_tensor(weft_call_t *call, weft_tensor_t *t)
{
    weft_value_t *v = NULL;

    weft_value_create(&v);
    weft_value_push_tensor(v, t);
    weft_call_reply(call, v);
}

/* Calls @p fn on @p rank with tensors @p x and @p y (NULL: none); *out_p gets the first tensor of
 * the answer (retained). */
static weft_status_t call_tensors(weft_agent_t *a, int rank, const char *fn, weft_tensor_t *x,
                                 weft_tensor_t *y, weft_tensor_t **out_p)
{
    weft_value_t *v = NULL, *res = NULL;

    weft_value_create(&v);
    weft_value_add_tensor(v, x);
    if (y != NULL) {
        weft_value_add_tensor(v, y);
    }
    weft_status_t st = weft_rpc_sync(a, rank, fn, v, WAIT_MS, &res);
    weft_value_free(v);
    if (st == WEFT_OK) {
        *out_p = weft_tensor_retain(weft_value_tensor(res, 0));
        weft_value_free(res);
    }
    return st;
}

/* Has @p rank end its process (its "exit" function) and waits for the call to fail or end. */
static void tell_exit(weft_agent_t *a, int rank)
{
    weft_future_t *f = NULL;

    if (weft_rpc_async(a, rank, "exit", NULL, WAIT_MS, &f) == WEFT_OK) {
        weft_future_wait(f, WAIT_MS);
        weft_future_release(f);
    }
}

/* ------------------------------------------------------------ per-rank state and functions */

static weft_tensor_t *g_w1; /* rank 1's parameter */
static weft_tensor_t *g_w2; /* rank 2's parameter */
static uint64_t g_last_ctx; /* the context the last call came in */

static void fn_add(weft_call_t *call, void *arg)
{
    (void)arg;
    const weft_value_t *in = weft_call_args(call);
    weft_tensor_t *y = NULL;

    g_last_ctx = weft_dist_context_current();
    if (weft_op_add(weft_value_tensor(in, 0), weft_value_tensor(in, 1), &y) != WEFT_OK) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "add: %s", weft_last_error());
        return;
    }
    reply_tensor(call, y);
}

/* stage2 (rank 2): y = h @ W2 */
static void fn_stage2(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_tensor_t *y = NULL;

    if (weft_op_matmul(weft_value_tensor(weft_call_args(call), 0), g_w2, &y) != WEFT_OK) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "stage2: %s", weft_last_error());
        return;
    }
    reply_tensor(call, y);
}

/* stage1 (rank 1): h = relu(x @ W1), then stage2 on rank 2 (a nested call), its answer back. */
static void fn_stage1(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_tensor_t *z = NULL, *h = NULL;
    weft_value_t *v = NULL, *res = NULL;

    weft_op_matmul(weft_value_tensor(weft_call_args(call), 0), g_w1, &z);
    weft_op_relu(z, &h);
    weft_tensor_release(z);
    weft_value_create(&v);
    weft_value_push_tensor(v, h);
    weft_status_t st = weft_rpc_sync(weft_call_agent(call), 2, "stage2", v, WAIT_MS, &res);
    weft_value_free(v);
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "stage1: %s", weft_last_error());
        return;
    }
    weft_call_reply(call, res);
}

/* The gradient this rank's context holds for its parameter (payload: the context id). */
static void fn_get_grad(weft_call_t *call, void *arg)
{
    (void)arg;
    size_t len = 0;
    const uint64_t *ctx = weft_value_payload(weft_call_args(call), &len);
    weft_dist_grads_t *g = NULL;
    weft_tensor_t *p = g_w1 != NULL ? g_w1 : g_w2;

    if (len != 8 || weft_dist_get_gradients(weft_call_agent(call), *ctx, &g) != WEFT_OK) {
        weft_call_fail(call, WEFT_ERR_NOT_FOUND, "no gradients: %s", weft_last_error());
        return;
    }
    weft_tensor_t *gr = weft_dist_grads_find(g, p);
    if (gr == NULL) {
        weft_dist_grads_free(g);
        weft_call_fail(call, WEFT_ERR_NOT_FOUND, "no gradient for the parameter");
        return;
    }
    weft_value_t *v = NULL;
    weft_value_create(&v);
    weft_value_add_tensor(v, gr);
    weft_dist_grads_free(g);
    weft_call_reply(call, v);
}

static void fn_count(weft_call_t *call, void *arg)
{
    (void)arg;
    int64_t n = (int64_t)weft_dist_context_count(weft_call_agent(call));
    weft_value_t *v = NULL;
    weft_value_create(&v);
    weft_value_set_payload(v, &n, sizeof(n));
    weft_call_reply(call, v);
}

/* The parameter itself (an RRef's value on its owner). */
static void fn_param(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_value_t *v = NULL;
    weft_value_create(&v);
    weft_value_add_tensor(v, g_w1);
    weft_call_reply(call, v);
}

static volatile int g_done;

static void fn_done(weft_call_t *call, void *arg)
{
    (void)arg;
    g_done = 1;
    weft_call_reply(call, NULL);
}

static void fn_exit(weft_call_t *call, void *arg)
{
    (void)call;
    (void)arg;
    _exit(0);
}

/* A node that passes its gradient through after 3 s. */
static volatile int g_slow_done;

static weft_status_t slow_backward(weft_ag_node_t *n, weft_tensor_t *const *grad_out,
                                   weft_tensor_t **grad_in)
{
    struct timespec ts = {3, 0};

    nanosleep(&ts, NULL);
    g_slow_done = 1;
    if (weft_ag_node_needs_grad(n, 0)) {
        grad_in[0] = weft_tensor_retain(grad_out[0]);
    }
    return WEFT_OK;
}

/* add, with a slow backward. */
static void fn_slow_add(weft_call_t *call, void *arg)
{
    (void)arg;
    const weft_value_t *in = weft_call_args(call);
    weft_tensor_t *y = NULL, *z = NULL;
    weft_ag_node_t *n = NULL;

    weft_op_add(weft_value_tensor(in, 0), weft_value_tensor(in, 1), &y);
    weft_tensor_clone(y, &z);
    weft_ag_node_create("SlowBackward", slow_backward, 1, &y, NULL, NULL, &n);
    weft_ag_node_attach(n, 1, &z);
    weft_ag_node_release(n);
    weft_tensor_release(y);
    reply_tensor(call, z);
}

/* The parameter's .grad (accumulate_grad mirrors the context's gradients there). */
static void fn_dot_grad(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_tensor_t *g = weft_tensor_grad(g_w1 != NULL ? g_w1 : g_w2);
    if (g == NULL) {
        weft_call_fail(call, WEFT_ERR_NOT_FOUND, "no .grad");
        return;
    }
    weft_value_t *v = NULL;
    weft_value_create(&v);
    weft_value_add_tensor(v, g);
    weft_call_reply(call, v);
}

static void fn_slow_done(weft_call_t *call, void *arg)
{
    (void)arg;
    int64_t d = g_slow_done;
    weft_value_t *v = NULL;
    weft_value_create(&v);
    weft_value_set_payload(v, &d, sizeof(d));
    weft_call_reply(call, v);
}

static void setup(weft_agent_t *a, int rank, void *arg)
{
    (void)arg;
    weft_dist_init(a);
    weft_rref_init(a);
    weft_rpc_register(a, "add", fn_add, NULL);
    weft_rpc_register(a, "stage1", fn_stage1, NULL);
    weft_rpc_register(a, "stage2", fn_stage2, NULL);
    weft_rpc_register(a, "get_grad", fn_get_grad, NULL);
    weft_rpc_register(a, "count", fn_count, NULL);
    weft_rpc_register(a, "param", fn_param, NULL);
    weft_rpc_register(a, "exit", fn_exit, NULL);
    weft_rpc_register(a, "done", fn_done, NULL);
    weft_rpc_register(a, "slow_add", fn_slow_add, NULL);
    weft_rpc_register(a, "dot_grad", fn_dot_grad, NULL);
    weft_rpc_register(a, "slow_done", fn_slow_done, NULL);
    if (rank == 1) {
        g_w1 = leaf64(3, 4, 1.0);
    }
    if (rank == 2) {
        g_w2 = leaf64(4, 2, 2.0);
    }
}

/* Runs @p body on a world of @p n ranks set up by setup(); 0 when every rank passed. */
static int run_world(int n, rank_main_cb_t body, void *arg)
{
    ranks_opts_t o;
    int codes[3];

    ranks_opts_init(&o, n, body);
    o.setup = setup;
    o.arg = arg;
    return ranks_run(&o, codes);
}

/* The same for 3 ranks of which some end on purpose: no collective shutdown, and each rank's exit
 * code in @p codes for the caller to judge. */
static void run_world_with_loss(rank_main_cb_t body, int codes[3])
{
    ranks_opts_t o;

    ranks_opts_init(&o, 3, body);
    o.setup = setup;
    o.no_shutdown = 1;
    o.peer_timeout_ms = 1000;
    ranks_run(&o, codes);
}

/* Tells rank 1 that rank 0 is done (tests without the collective shutdown). */
static weft_value_t *res_done_dummy(weft_agent_t *a)
{
    weft_value_t *res = NULL;
    (void)weft_rpc_sync(a, 1, "done", NULL, WAIT_MS, &res);
    return res;
}

static int64_t remote_count(weft_agent_t *a, int rank)
{
    weft_value_t *res = NULL;
    if (weft_rpc_sync(a, rank, "count", NULL, WAIT_MS, &res) != WEFT_OK) {
        return -1;
    }
    size_t len;
    int64_t n = *(const int64_t *)weft_value_payload(res, &len);
    weft_value_free(res);
    return n;
}

static weft_tensor_t *remote_grad(weft_agent_t *a, int rank, uint64_t ctx)
{
    weft_value_t *v = NULL, *res = NULL;
    weft_value_create(&v);
    weft_value_set_payload(v, &ctx, sizeof(ctx));
    weft_status_t st = weft_rpc_sync(a, rank, "get_grad", v, WAIT_MS, &res);
    weft_value_free(v);
    if (st != WEFT_OK) {
        fprintf(stderr, "get_grad on %d: %s\n", rank, weft_last_error());
        return NULL;
    }
    weft_tensor_t *g = weft_tensor_retain(weft_value_tensor(res, 0));
    weft_value_free(res);
    return g;
}

static weft_tensor_t *grad_of(weft_agent_t *a, uint64_t ctx, weft_tensor_t *leaf)
{
    weft_dist_grads_t *g = NULL;
    if (weft_dist_get_gradients(a, ctx, &g) != WEFT_OK) {
        return NULL;
    }
    weft_tensor_t *r = weft_tensor_retain(weft_dist_grads_find(g, leaf));
    weft_dist_grads_free(g);
    return r;
}

/* ------------------------------------------------------------ the design doc's example */

static int body_a1(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        return 0;
    }
    for (int iter = 0; iter < 3; iter++) {
        uint64_t ctx = 0;
        weft_tensor_t *t1 = leaf64(3, 3, 0.1 + iter), *t2 = leaf64(3, 3, 0.2), *t4 = leaf64(3, 3, 0.3);

        RANK_CHECK(weft_dist_context_create(a, &ctx) == WEFT_OK, "%s", weft_last_error());
        RANK_CHECK((int)(ctx >> 48) == 0 && weft_dist_context_current() == ctx, "id %llx",
                   (unsigned long long)ctx);
        weft_tensor_t *t3 = NULL;
        RANK_CHECK(call_tensors(a, 1, "add", t1, t2, &t3) == WEFT_OK, "%s", weft_last_error());
        RANK_CHECK(weft_tensor_requires_grad(t3), "t3 has no gradient function");
        RANK_CHECK(strcmp(weft_tensor_grad_fn_name(t3), "RecvRpcBackward") == 0, "%s",
                   weft_tensor_grad_fn_name(t3));
        weft_tensor_t *m = NULL;
        weft_op_mul(t3, t4, &m);
        weft_tensor_t *loss = sum_all(m);
        RANK_CHECK(weft_dist_backward(a, ctx, 1, &loss, NULL) == WEFT_OK, "%s", weft_last_error());
        /* d loss / d t1 = d loss / d t2 = t4; d loss / d t4 = t3 = t1 + t2 */
        weft_tensor_t *g1 = grad_of(a, ctx, t1), *g2 = grad_of(a, ctx, t2), *g4 = grad_of(a, ctx, t4);
        RANK_CHECK(same(g1, t4) && same(g2, t4) && same(g4, t3), "gradients differ");
        RANK_CHECK(weft_tensor_grad(t1) == NULL, "the leaf's own .grad was written");
        weft_dist_grads_t *all = NULL;
        RANK_CHECK(weft_dist_get_gradients(a, ctx, &all) == WEFT_OK, "%s", weft_last_error());
        RANK_CHECK(weft_dist_grads_count(all) == 3, "%zu gradients", weft_dist_grads_count(all));
        weft_dist_grads_free(all);
        RANK_CHECK(remote_count(a, 1) == 1, "rank 1 does not hold the context");
        RANK_CHECK(weft_dist_context_release(a, ctx, WAIT_MS) == WEFT_OK, "%s", weft_last_error());
        RANK_CHECK(weft_dist_context_current() == 0, "still current after release");
        RANK_CHECK(weft_dist_context_count(a) == 0 && remote_count(a, 1) == 0,
                   "contexts left: %zu here, %lld on rank 1", weft_dist_context_count(a),
                   (long long)remote_count(a, 1));
        weft_tensor_release(g1);
        weft_tensor_release(g2);
        weft_tensor_release(g4);
        weft_tensor_release(loss);
        weft_tensor_release(m);
        weft_tensor_release(t3);
        weft_tensor_release(t1);
        weft_tensor_release(t2);
        weft_tensor_release(t4);
    }
    return 0;
}

Test(dist_autograd, design_doc_example_gradients_exact)
{
    cr_assert_eq(run_world(2, body_a1, NULL), 0);
}

/* ------------------------------------------------------------ a model over 3 workers */

/* The same model on one worker: loss = sum((relu(x W1) W2)^2). */
static void local_model(weft_tensor_t *x, weft_tensor_t **gx, weft_tensor_t **gw1,
                        weft_tensor_t **gw2)
{
    weft_tensor_t *w1 = leaf64(3, 4, 1.0), *w2 = leaf64(4, 2, 2.0);
    weft_tensor_t *z, *h, *y, *y2, *loss;
    weft_tensor_t *xl = NULL;

    weft_tensor_clone(x, &xl);
    weft_tensor_set_requires_grad(xl, 1);
    weft_op_matmul(xl, w1, &z);
    weft_op_relu(z, &h);
    weft_op_matmul(h, w2, &y);
    weft_op_mul(y, y, &y2);
    loss = sum_all(y2);
    weft_backward(loss, NULL, 0);
    *gx = weft_tensor_retain(weft_tensor_grad(xl));
    *gw1 = weft_tensor_retain(weft_tensor_grad(w1));
    *gw2 = weft_tensor_retain(weft_tensor_grad(w2));
    weft_tensor_release(loss);
    weft_tensor_release(y2);
    weft_tensor_release(y);
    weft_tensor_release(h);
    weft_tensor_release(z);
    weft_tensor_release(xl);
    weft_tensor_release(w1);
    weft_tensor_release(w2);
}

static int body_chain(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    int retain = arg != NULL;
    if (rank != 0) {
        return 0;
    }
    weft_tensor_t *x = leaf64(5, 3, 3.0);
    weft_tensor_t *gx, *gw1, *gw2;
    uint64_t ctx = 0;

    local_model(x, &gx, &gw1, &gw2);
    RANK_CHECK(weft_dist_context_create(a, &ctx) == WEFT_OK, "%s", weft_last_error());
    uint64_t other = 0;
    RANK_CHECK(weft_dist_context_create(a, &other) == WEFT_ERR_INVALID_STATE,
               "a nested context was made");
    RANK_CHECK(strstr(weft_last_error(), "do not nest") != NULL, "%s", weft_last_error());
    weft_tensor_t *y = NULL;
    RANK_CHECK(call_tensors(a, 1, "stage1", x, NULL, &y) == WEFT_OK, "%s", weft_last_error());
    weft_tensor_t *y2 = NULL;
    weft_op_mul(y, y, &y2);
    weft_tensor_t *loss = sum_all(y2);
    weft_dist_backward_opts_t bo;
    weft_dist_backward_opts_init(&bo);
    bo.retain_graph = retain;
    RANK_CHECK(weft_dist_backward(a, ctx, 1, &loss, &bo) == WEFT_OK, "%s", weft_last_error());
    int passes = 1;
    if (retain) {
        /* A second backward in the context: every gradient doubles, on every worker. */
        bo.retain_graph = false;
        RANK_CHECK(weft_dist_backward(a, ctx, 1, &loss, &bo) == WEFT_OK, "%s", weft_last_error());
        passes = 2;
        /* Without retain_graph the graph is gone now. */
        RANK_CHECK(weft_dist_backward(a, ctx, 1, &loss, &bo) == WEFT_ERR_INVALID_STATE,
                   "a third backward through a freed graph ran");
        weft_tensor_t *xs[3] = {gx, gw1, gw2};
        for (int k = 0; k < 3; k++) {
            double *d = weft_tensor_data(xs[k]);
            for (int64_t i = 0; i < weft_tensor_numel(xs[k]); i++) {
                d[i] *= 2;
            }
        }
    }
    weft_tensor_t *dx = grad_of(a, ctx, x);
    weft_tensor_t *dw1 = remote_grad(a, 1, ctx);
    weft_tensor_t *dw2 = remote_grad(a, 2, ctx);
    RANK_CHECK(same(dx, gx), "x's gradient differs from the local engine's (%d passes)", passes);
    RANK_CHECK(same(dw1, gw1), "W1's gradient (rank 1) differs from the local engine's");
    RANK_CHECK(same(dw2, gw2), "W2's gradient (rank 2) differs from the local engine's");
    RANK_CHECK(remote_count(a, 2) == 1, "rank 2 (reached by a nested call) has no context");
    RANK_CHECK(weft_dist_context_release(a, ctx, WAIT_MS) == WEFT_OK, "%s", weft_last_error());
    RANK_CHECK(remote_count(a, 1) == 0 && remote_count(a, 2) == 0,
               "the release did not reach every worker");
    RANK_CHECK(weft_dist_context_release(a, ctx, WAIT_MS) == WEFT_ERR_NOT_FOUND,
               "a second release");
    weft_tensor_release(dx);
    weft_tensor_release(dw1);
    weft_tensor_release(dw2);
    weft_tensor_release(gx);
    weft_tensor_release(gw1);
    weft_tensor_release(gw2);
    weft_tensor_release(loss);
    weft_tensor_release(y2);
    weft_tensor_release(y);
    weft_tensor_release(x);
    return 0;
}

Test(dist_autograd, nested_calls_over_three_workers_match_local_engine)
{
    cr_assert_eq(run_world(3, body_chain, NULL), 0);
}

Test(dist_autograd, retain_graph_accumulates_on_every_worker)
{
    cr_assert_eq(run_world(3, body_chain, (void *)1), 0);
}

/* ------------------------------------------------------------ an unused output */

static int body_unused(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        return 0;
    }
    weft_tensor_t *t1 = leaf64(2, 2, 0.5), *t2 = leaf64(2, 2, 0.6), *w = leaf64(2, 2, 0.7);
    uint64_t ctx = 0;
    weft_value_t *v = NULL, *res = NULL;

    RANK_CHECK(weft_dist_context_create(a, &ctx) == WEFT_OK, "%s", weft_last_error());
    weft_value_create(&v);
    weft_value_add_tensor(v, t1);
    weft_value_add_tensor(v, t2);
    RANK_CHECK(weft_rpc_sync(a, 1, "add", v, WAIT_MS, &res) == WEFT_OK, "%s", weft_last_error());
    weft_value_free(v);
    /* The loss does not use the call's result. */
    weft_tensor_t *loss = sum_all(w);
    weft_status_t st = weft_dist_backward(a, ctx, 1, &loss, NULL);
    RANK_CHECK(st == WEFT_ERR_INVALID_STATE, "status %s", weft_status_name(st));
    RANK_CHECK(strstr(weft_last_error(), "'add'") != NULL &&
                   strstr(weft_last_error(), "never received a gradient") != NULL &&
                   strstr(weft_last_error(), "worker1") != NULL,
               "%s", weft_last_error());
    /* The rest of the graph still got its gradient. */
    weft_tensor_t *gw = grad_of(a, ctx, w);
    RANK_CHECK(gw != NULL && ((double *)weft_tensor_data(gw))[0] == 1.0, "w has no gradient");
    weft_tensor_release(gw);
    RANK_CHECK(weft_dist_context_release(a, ctx, WAIT_MS) == WEFT_OK, "%s", weft_last_error());
    RANK_CHECK(remote_count(a, 1) == 0, "rank 1 kept the context");
    weft_value_free(res);
    weft_tensor_release(loss);
    weft_tensor_release(t1);
    weft_tensor_release(t2);
    weft_tensor_release(w);
    return 0;
}

/* A call that failed (an unknown function: its request's send function never gets a gradient,
 * and nothing waits for it) does not fail a later backward. */
static int body_failed_call(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        return 0;
    }
    weft_tensor_t *t1 = leaf64(2, 2, 0.5), *w = leaf64(2, 2, 0.7);
    uint64_t ctx = 0;
    weft_value_t *v = NULL, *res = NULL;

    RANK_CHECK(weft_dist_context_create(a, &ctx) == WEFT_OK, "%s", weft_last_error());
    weft_value_create(&v);
    weft_value_add_tensor(v, t1);
    RANK_CHECK(weft_rpc_sync(a, 1, "no_such_fn", v, WAIT_MS, &res) == WEFT_ERR_NO_SUCH_FUNCTION,
               "the call did not fail");
    weft_value_free(v);
    weft_tensor_t *loss = sum_all(w);
    RANK_CHECK(weft_dist_backward(a, ctx, 1, &loss, NULL) == WEFT_OK, "%s", weft_last_error());
    RANK_CHECK(weft_dist_context_release(a, ctx, WAIT_MS) == WEFT_OK, "%s", weft_last_error());
    weft_tensor_release(loss);
    weft_tensor_release(t1);
    weft_tensor_release(w);
    return 0;
}

Test(dist_autograd, failed_calls_are_not_waited_for)
{
    cr_assert_eq(run_world(2, body_failed_call, NULL), 0);
}

Test(dist_autograd, unused_output_is_an_error_naming_the_call)
{
    cr_assert_eq(run_world(2, body_unused, NULL), 0);
}

/* ------------------------------------------------------------ a lost worker */

static int body_lost(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        RANK_WAIT(g_done, 2 * WAIT_MS, "rank 0 never said it was done");
        return 0;
    }
    weft_tensor_t *t1 = leaf64(2, 2, 0.5), *t2 = leaf64(2, 2, 0.6);
    uint64_t ctx = 0;
    weft_value_t *v = NULL, *r1 = NULL, *r2 = NULL;

    RANK_CHECK(weft_dist_context_create(a, &ctx) == WEFT_OK, "%s", weft_last_error());
    weft_value_create(&v);
    weft_value_add_tensor(v, t1);
    weft_value_add_tensor(v, t2);
    RANK_CHECK(weft_rpc_sync(a, 1, "add", v, WAIT_MS, &r1) == WEFT_OK, "%s", weft_last_error());
    RANK_CHECK(weft_rpc_sync(a, 2, "add", v, WAIT_MS, &r2) == WEFT_OK, "%s", weft_last_error());
    weft_value_free(v);
    weft_tensor_t *s = NULL;
    weft_op_add(weft_value_tensor(r1, 0), weft_value_tensor(r2, 0), &s);
    weft_tensor_t *loss = sum_all(s);
    /* Rank 2 dies before the backward. */
    tell_exit(a, 2);
    weft_status_t st = weft_dist_backward(a, ctx, 1, &loss, NULL);
    RANK_CHECK(st == WEFT_ERR_PEER_LOST || st == WEFT_ERR_TRANSPORT, "status %s: %s",
               weft_status_name(st), weft_last_error());
    RANK_CHECK(weft_dist_context_release(a, ctx, WAIT_MS) == WEFT_OK, "%s", weft_last_error());
    RANK_CHECK(remote_count(a, 1) == 0, "rank 1 kept the context");
    weft_value_free(res_done_dummy(a));
    weft_value_free(r1);
    weft_value_free(r2);
    weft_tensor_release(loss);
    weft_tensor_release(s);
    weft_tensor_release(t1);
    weft_tensor_release(t2);
    return 0;
}

Test(dist_autograd, lost_worker_fails_the_backward)
{
    int codes[3];
    run_world_with_loss(body_lost, codes);
    cr_assert_eq(codes[0], 0);
    cr_assert_eq(codes[1], 0);
}

/* The creator dies: its contexts on the others are dropped (torch leaves them forever). */
static int body_orphan(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank == 2) {
        weft_tensor_t *t1 = leaf64(2, 2, 0.5);
        uint64_t ctx = 0;
        weft_value_t *v = NULL, *res = NULL;

        RANK_CHECK(weft_dist_context_create(a, &ctx) == WEFT_OK, "%s", weft_last_error());
        weft_value_create(&v);
        weft_value_add_tensor(v, t1);
        weft_value_add_tensor(v, t1);
        RANK_CHECK(weft_rpc_sync(a, 1, "add", v, WAIT_MS, &res) == WEFT_OK, "%s",
                   weft_last_error());
        /* Rank 0 ends this process ("exit") once it saw the context on rank 1. */
        RANK_WAIT(0, 4 * WAIT_MS, "never told to exit");
        return 1;
    }
    if (rank == 0) {
        /* Rank 1 holds rank 2's context until rank 2 is lost. */
        int64_t deadline = now_ms() + WAIT_MS;
        while (remote_count(a, 1) != 1 && now_ms() < deadline) {
            wait_step();
        }
        RANK_CHECK(remote_count(a, 1) == 1, "rank 1 never got the context");
        tell_exit(a, 2);
        while (remote_count(a, 1) != 0 && now_ms() < deadline) {
            wait_step();
        }
        RANK_CHECK(remote_count(a, 1) == 0, "rank 1 kept the dead creator's context");
        weft_value_free(res_done_dummy(a));
        return 0;
    }
    RANK_WAIT(g_done, 2 * WAIT_MS, "rank 0 never said it was done");
    return 0;
}

Test(dist_autograd, contexts_of_a_lost_creator_are_dropped)
{
    int codes[3];
    run_world_with_loss(body_orphan, codes);
    cr_assert_eq(codes[0], 0);
    cr_assert_eq(codes[1], 0);
}

/* ------------------------------------------------------------ RRefs and the optimizer */

static int body_rref(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank == 1) {
        return 0;
    }
    weft_rref_t *p = NULL;
    RANK_CHECK(weft_rref_remote(a, 1, "param", NULL, WAIT_MS, &p) == WEFT_OK, "%s",
               weft_last_error());
    weft_dist_optim_config_t cfg;
    weft_dist_optim_config_init(&cfg, WEFT_DIST_OPTIM_SGD, 0.5);
    weft_dist_optim_t *opt = NULL;
    RANK_CHECK(weft_dist_optim_create(a, &cfg, 1, &p, &opt) == WEFT_OK, "%s", weft_last_error());
    weft_tensor_t *x = t64(3, 4, 5.0);
    weft_tensor_t *w_before = NULL;
    for (int step = 0; step < 2; step++) {
        uint64_t ctx = 0;
        weft_value_t *wv = NULL;

        RANK_CHECK(weft_dist_context_create(a, &ctx) == WEFT_OK, "%s", weft_last_error());
        RANK_CHECK(weft_rref_to_here(p, WAIT_MS, &wv) == WEFT_OK, "%s", weft_last_error());
        weft_tensor_t *w = weft_value_tensor(wv, 0);
        RANK_CHECK(weft_tensor_requires_grad(w), "to_here recorded no receive function");
        weft_tensor_clone(w, &w_before);
        weft_tensor_t *m = NULL;
        weft_op_mul(w, x, &m);
        weft_tensor_t *loss = sum_all(m);
        RANK_CHECK(weft_dist_backward(a, ctx, 1, &loss, NULL) == WEFT_OK, "%s", weft_last_error());
        /* d loss / d W = x on the owner; SGD: W -= 0.5 x */
        weft_tensor_t *g = remote_grad(a, 1, ctx);
        RANK_CHECK(same(g, x), "the owner's gradient is not x");
        RANK_CHECK(weft_dist_optim_step(opt, ctx, WAIT_MS) == WEFT_OK, "%s", weft_last_error());
        weft_value_t *after = NULL;
        RANK_CHECK(weft_rref_to_here(p, WAIT_MS, &after) == WEFT_OK, "%s", weft_last_error());
        const double *wa = weft_tensor_data(weft_value_tensor(after, 0));
        const double *wb = weft_tensor_data(w_before);
        const double *xd = weft_tensor_data(x);
        for (int i = 0; i < 12; i++) {
            RANK_CHECK(wa[i] == wb[i] - 0.5 * xd[i], "step %d element %d: %.17g", step, i, wa[i]);
        }
        weft_value_free(after);
        RANK_CHECK(weft_dist_context_release(a, ctx, WAIT_MS) == WEFT_OK, "%s", weft_last_error());
        weft_tensor_release(g);
        weft_tensor_release(loss);
        weft_tensor_release(m);
        weft_tensor_release(w_before);
        w_before = NULL;
        weft_value_free(wv);
    }
    RANK_CHECK(remote_count(a, 1) == 0, "contexts left on the owner");
    weft_dist_optim_free(opt);
    weft_rref_release(p);
    weft_tensor_release(x);
    return 0;
}

Test(dist_autograd, rref_to_here_and_distributed_optimizer)
{
    cr_assert_eq(run_world(2, body_rref, NULL), 0);
}

/* ------------------------------------------------------------ no leaks */

static int body_many(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        return 0;
    }
    for (int i = 0; i < 300; i++) {
        uint64_t ctx = 0;
        weft_tensor_t *t1 = leaf64(2, 2, 0.1 * i);
        weft_value_t *v = NULL, *r1 = NULL, *r2 = NULL;

        RANK_CHECK(weft_dist_context_create(a, &ctx) == WEFT_OK, "%s", weft_last_error());
        weft_value_create(&v);
        weft_value_add_tensor(v, t1);
        weft_value_add_tensor(v, t1);
        RANK_CHECK(weft_rpc_sync(a, 1, "add", v, WAIT_MS, &r1) == WEFT_OK, "%s",
                   weft_last_error());
        RANK_CHECK(weft_rpc_sync(a, 2, "add", v, WAIT_MS, &r2) == WEFT_OK, "%s",
                   weft_last_error());
        weft_tensor_t *s = NULL;
        weft_op_add(weft_value_tensor(r1, 0), weft_value_tensor(r2, 0), &s);
        weft_tensor_t *loss = sum_all(s);
        if (i % 2 == 0) {
            RANK_CHECK(weft_dist_backward(a, ctx, 1, &loss, NULL) == WEFT_OK, "%s",
                       weft_last_error());
            weft_tensor_t *g = grad_of(a, ctx, t1);
            RANK_CHECK(g != NULL && ((double *)weft_tensor_data(g))[0] == 4.0, "gradient");
            weft_tensor_release(g);
        }
        RANK_CHECK(weft_dist_context_release(a, ctx, WAIT_MS) == WEFT_OK, "%s", weft_last_error());
        weft_tensor_release(loss);
        weft_tensor_release(s);
        weft_value_free(v);
        weft_value_free(r1);
        weft_value_free(r2);
        weft_tensor_release(t1);
    }
    RANK_CHECK(weft_dist_context_count(a) == 0 && remote_count(a, 1) == 0 &&
                   remote_count(a, 2) == 0,
               "contexts left");
    return 0;
}

Test(dist_autograd, released_contexts_leave_nothing_on_any_worker)
{
    cr_assert_eq(run_world(3, body_many, NULL), 0);
}

/* ------------------------------------------------------------ bad input */

Test(dist_autograd, refusals)
{
    weft_agent_opts_t ao;
    weft_agent_t *a = NULL;

    weft_agent_opts_init(&ao);
    ao.rank = 0;
    ao.world_size = 1;
    ao.master_addr = "127.0.0.1";
    ao.master_port = 0;
    cr_assert_eq(weft_agent_create(&ao, &a), WEFT_OK);
    cr_assert_eq(weft_dist_init(a), WEFT_OK);
    cr_assert_eq(weft_dist_init(a), WEFT_OK);
    cr_assert_eq(weft_agent_join(a), WEFT_OK);
    uint64_t ctx = 0;
    cr_assert_eq(weft_dist_context_release(a, 12345, 1000), WEFT_ERR_NOT_FOUND);
    cr_assert_eq(weft_dist_backward(a, 12345, 0, NULL, NULL), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(weft_dist_context_create(a, &ctx), WEFT_OK);
    weft_tensor_t *nog = t64(1, 1, 0.0);
    cr_assert_eq(weft_dist_backward(a, ctx, 1, &nog, NULL), WEFT_ERR_INVALID_ARG);
    weft_tensor_t *big = leaf64(2, 2, 0.0);
    cr_assert_eq(weft_dist_backward(a, ctx, 1, &big, NULL), WEFT_ERR_INVALID_ARG);
    /* A receive function run by the plain engine. */
    cr_assert_eq(weft_dist_context_release(a, ctx, 1000), WEFT_OK);
    cr_assert_eq(weft_dist_context_enter(a, ctx, NULL), WEFT_ERR_NOT_FOUND);
    weft_tensor_release(nog);
    weft_tensor_release(big);
    weft_agent_free(a);
}

/* ------------------------------------------------------------ options: .grad, the deadline */

static int body_options(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        return 0;
    }
    weft_tensor_t *x = leaf64(5, 3, 3.0);
    weft_tensor_t *gx, *gw1, *gw2;
    uint64_t ctx = 0;
    weft_value_t *v = NULL, *res = NULL;

    local_model(x, &gx, &gw1, &gw2);
    RANK_CHECK(weft_dist_context_create(a, &ctx) == WEFT_OK, "%s", weft_last_error());
    weft_tensor_t *y = NULL;
    RANK_CHECK(call_tensors(a, 1, "stage1", x, NULL, &y) == WEFT_OK, "%s", weft_last_error());
    weft_tensor_t *y2 = NULL;
    weft_op_mul(y, y, &y2);
    weft_tensor_t *loss = sum_all(y2);
    weft_dist_backward_opts_t bo;
    weft_dist_backward_opts_init(&bo);
    bo.accumulate_grad = true;
    RANK_CHECK(weft_dist_backward(a, ctx, 1, &loss, &bo) == WEFT_OK, "%s", weft_last_error());
    /* .grad too, for the root's own leaves; the other workers' only in the context */
    RANK_CHECK(same(weft_tensor_grad(x), gx), "x's .grad");
    weft_value_t *g1 = NULL;
    RANK_CHECK(weft_rpc_sync(a, 1, "dot_grad", NULL, WAIT_MS, &g1) == WEFT_ERR_NOT_FOUND,
               "rank 1's parameter got a .grad");
    weft_value_free(g1);
    weft_tensor_t *dw1 = remote_grad(a, 1, ctx);
    RANK_CHECK(same(dw1, gw1), "W1's gradient in the context");
    weft_tensor_release(dw1);
    RANK_CHECK(weft_dist_context_release(a, ctx, WAIT_MS) == WEFT_OK, "%s", weft_last_error());

    /* A bound on the whole backward: rank 1's node sleeps past it. */
    weft_tensor_t *t1 = leaf64(2, 2, 0.5);
    RANK_CHECK(weft_dist_context_create(a, &ctx) == WEFT_OK, "%s", weft_last_error());
    weft_value_create(&v);
    weft_value_add_tensor(v, t1);
    weft_value_add_tensor(v, t1);
    RANK_CHECK(weft_rpc_sync(a, 1, "slow_add", v, WAIT_MS, &res) == WEFT_OK, "%s",
               weft_last_error());
    weft_value_free(v);
    weft_tensor_t *l2 = sum_all(weft_value_tensor(res, 0));
    bo.accumulate_grad = false;
    bo.timeout_ms = 300;
    weft_status_t st = weft_dist_backward(a, ctx, 1, &l2, &bo);
    RANK_CHECK(st == WEFT_ERR_TIMEOUT, "status %s: %s", weft_status_name(st), weft_last_error());
    /* It returned at its bound, not when rank 1's node was done. */
    weft_value_t *sd = NULL;
    RANK_CHECK(weft_rpc_sync(a, 1, "slow_done", NULL, WAIT_MS, &sd) == WEFT_OK, "%s",
               weft_last_error());
    size_t sdl = 0;
    RANK_CHECK(*(const int64_t *)weft_value_payload(sd, &sdl) == 0,
               "the backward waited for the node past its bound");
    weft_value_free(sd);
    /* The release waits for rank 1's part to stop. */
    RANK_CHECK(weft_dist_context_release(a, ctx, WAIT_MS) == WEFT_OK, "%s", weft_last_error());
    RANK_CHECK(remote_count(a, 1) == 0, "rank 1 kept the context");
    weft_value_free(res);
    weft_tensor_release(l2);
    weft_tensor_release(t1);
    weft_tensor_release(gx);
    weft_tensor_release(gw1);
    weft_tensor_release(gw2);
    weft_tensor_release(loss);
    weft_tensor_release(y2);
    weft_tensor_release(y);
    weft_tensor_release(x);
    return 0;
}

Test(dist_autograd, accumulate_grad_on_the_root_and_the_deadline)
{
    cr_assert_eq(run_world(3, body_options, NULL), 0);
}

/* ------------------------------------------------------------ a worker lost mid-backward */

typedef struct {
    weft_agent_t *a;
    uint64_t ctx;
    weft_tensor_t *loss;
    weft_status_t st;
    char error[512];
} bw_thread_t;

static void *bw_thread(void *arg)
{
    bw_thread_t *b = arg;
    b->st = weft_dist_backward(b->a, b->ctx, 1, &b->loss, NULL);
    snprintf(b->error, sizeof(b->error), "%s", b->st == WEFT_OK ? "" : weft_last_error());
    return NULL;
}

static int body_lost_mid(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank == 2) {
        RANK_WAIT(g_done, 4 * WAIT_MS, "rank 0 never said it was done");
        return 0;
    }
    if (rank == 1) {
        RANK_WAIT(0, 4 * WAIT_MS, "never told to exit");
        return 1;
    }
    weft_tensor_t *t1 = leaf64(2, 2, 0.5);
    uint64_t ctx = 0;
    weft_value_t *v = NULL, *r1 = NULL, *r2 = NULL;

    RANK_CHECK(weft_dist_context_create(a, &ctx) == WEFT_OK, "%s", weft_last_error());
    weft_value_create(&v);
    weft_value_add_tensor(v, t1);
    weft_value_add_tensor(v, t1);
    RANK_CHECK(weft_rpc_sync(a, 1, "slow_add", v, WAIT_MS, &r1) == WEFT_OK, "%s",
               weft_last_error());
    RANK_CHECK(weft_rpc_sync(a, 2, "add", v, WAIT_MS, &r2) == WEFT_OK, "%s", weft_last_error());
    weft_value_free(v);
    weft_tensor_t *s = NULL;
    weft_op_add(weft_value_tensor(r1, 0), weft_value_tensor(r2, 0), &s);
    bw_thread_t b = {.a = a, .ctx = ctx, .loss = sum_all(s)};
    pthread_t th;
    pthread_create(&th, NULL, bw_thread, &b);
    /* Rank 1's part sleeps in its node for 3 s: it dies in the middle of it. */
    RANK_WAIT(remote_count(a, 2) == 1, WAIT_MS, "rank 2 has no context");
    tell_exit(a, 1);
    pthread_join(th, NULL);
    RANK_CHECK(b.st == WEFT_ERR_PEER_LOST, "status %s: %s", weft_status_name(b.st), b.error);
    RANK_CHECK(weft_dist_context_release(a, ctx, WAIT_MS) == WEFT_OK, "%s", weft_last_error());
    RANK_CHECK(remote_count(a, 2) == 0, "rank 2 kept the context");
    weft_value_t *res = NULL;
    (void)weft_rpc_sync(a, 2, "done", NULL, WAIT_MS, &res);
    weft_value_free(res);
    weft_value_free(r1);
    weft_value_free(r2);
    weft_tensor_release(b.loss);
    weft_tensor_release(s);
    weft_tensor_release(t1);
    return 0;
}

Test(dist_autograd, worker_lost_mid_backward_fails_it)
{
    int codes[3];
    run_world_with_loss(body_lost_mid, codes);
    cr_assert_eq(codes[0], 0);
    cr_assert_eq(codes[2], 0);
}

/* ------------------------------------------------------------ expiry */

/* A context another worker's call brought, never released (its creator lives on and forgets
 * it), goes after WEFT_DIST_CONTEXT_TTL_MS. */
static int body_ttl(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        return 0;
    }
    uint64_t ctx = 0;
    weft_value_t *v = NULL, *res = NULL;
    weft_tensor_t *t1 = leaf64(2, 2, 0.5);

    RANK_CHECK(weft_dist_context_create(a, &ctx) == WEFT_OK, "%s", weft_last_error());
    weft_value_create(&v);
    weft_value_add_tensor(v, t1);
    weft_value_add_tensor(v, t1);
    RANK_CHECK(weft_rpc_sync(a, 1, "add", v, WAIT_MS, &res) == WEFT_OK, "%s", weft_last_error());
    weft_value_free(v);
    weft_value_free(res);
    weft_rpc_set_thread_context(0); /* forgotten, not released */
    RANK_CHECK(remote_count(a, 1) == 1, "rank 1 has no context");
    RANK_WAIT(remote_count(a, 1) == 0, WAIT_MS, "rank 1 kept an unused context past its TTL");
    /* The creator's own is not expired: its user holds it. */
    RANK_CHECK(weft_dist_context_count(a) == 1, "the creator's context expired");
    RANK_CHECK(weft_dist_context_release(a, ctx, WAIT_MS) == WEFT_OK, "%s", weft_last_error());
    weft_tensor_release(t1);
    return 0;
}

Test(dist_autograd, unused_contexts_expire)
{
    setenv("WEFT_DIST_CONTEXT_TTL_MS", "300", 1);
    cr_assert_eq(run_world(2, body_ttl, NULL), 0);
}

/* ------------------------------------------------------------ remote() with tensors */

/* t3 = remote(worker1, add, t1, t2).to_here(): the arguments travel with remote()'s call, the
 * value with to_here's answer; both record, and the gradients reach t1 and t2. */
static int body_remote_args(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        return 0;
    }
    weft_tensor_t *t1 = leaf64(3, 3, 0.1), *t2 = leaf64(3, 3, 0.2), *t4 = leaf64(3, 3, 0.3);
    uint64_t ctx = 0;
    weft_value_t *v = NULL, *res = NULL;
    weft_rref_t *r = NULL;

    RANK_CHECK(weft_dist_context_create(a, &ctx) == WEFT_OK, "%s", weft_last_error());
    weft_value_create(&v);
    weft_value_add_tensor(v, t1);
    weft_value_add_tensor(v, t2);
    RANK_CHECK(weft_rref_remote(a, 1, "add", v, WAIT_MS, &r) == WEFT_OK, "%s", weft_last_error());
    weft_value_free(v);
    RANK_CHECK(weft_rref_to_here(r, WAIT_MS, &res) == WEFT_OK, "%s", weft_last_error());
    weft_tensor_t *t3 = weft_tensor_retain(weft_value_tensor(res, 0));
    weft_value_free(res);
    weft_tensor_t *m = NULL;
    weft_op_mul(t3, t4, &m);
    weft_tensor_t *loss = sum_all(m);
    RANK_CHECK(weft_dist_backward(a, ctx, 1, &loss, NULL) == WEFT_OK, "%s", weft_last_error());
    weft_tensor_t *g1 = grad_of(a, ctx, t1), *g2 = grad_of(a, ctx, t2);
    RANK_CHECK(same(g1, t4) && same(g2, t4), "remote()'s arguments did not get t4");
    weft_rref_release(r);
    RANK_CHECK(weft_dist_context_release(a, ctx, WAIT_MS) == WEFT_OK, "%s", weft_last_error());
    RANK_CHECK(remote_count(a, 1) == 0, "rank 1 kept the context");
    weft_tensor_release(g1);
    weft_tensor_release(g2);
    weft_tensor_release(loss);
    weft_tensor_release(m);
    weft_tensor_release(t3);
    weft_tensor_release(t1);
    weft_tensor_release(t2);
    weft_tensor_release(t4);
    return 0;
}

Test(dist_autograd, rref_remote_with_tensor_arguments)
{
    cr_assert_eq(run_world(2, body_remote_args, NULL), 0);
}
