/*
 * The autograd engine on its own: graphs built from small ops defined here through the internal
 * recording API (autograd/graph.h), so that these tests depend on nothing but the engine.
 */
#include <string.h>

#include <criterion/criterion.h>

#include "graph.h"

#include <weft/weft.h>

static double *D(weft_tensor_t *t)
{
    return weft_tensor_data(t);
}

static weft_tensor_t *vec(int64_t n, const double *v, int rg)
{
    weft_tensor_t *t = NULL;

    cr_assert_eq(weft_tensor_empty(WEFT_F64, 1, &n, &t), WEFT_OK);
    memcpy(D(t), v, (size_t)n * sizeof(double));
    if (rg) {
        cr_assert_eq(weft_tensor_set_requires_grad(t, 1), WEFT_OK);
    }
    return t;
}

static int ctx_frees;

static void count_free(void *ctx)
{
    (void)ctx;
    ctx_frees++;
}

/* y = c * x */
static weft_status_t scale_bw(weft__ag_node_t *n, weft_tensor_t *const *go, weft_tensor_t **gi)
{
    weft_tensor_t *g = NULL;

    WEFT_CHECK(weft_tensor_clone(go[0], &g));
    for (int64_t i = 0; i < weft_tensor_numel(g); i++) {
        D(g)[i] *= n->dargs[0];
    }
    gi[0] = g;
    return WEFT_OK;
}

static weft_tensor_t *scale(weft_tensor_t *x, double c)
{
    weft_tensor_t *y = NULL;
    weft__ag_node_t *n;

    cr_assert_eq(weft_tensor_clone(x, &y), WEFT_OK);
    for (int64_t i = 0; i < weft_tensor_numel(y); i++) {
        D(y)[i] *= c;
    }
    if (weft__ag_should_record(1, &x)) {
        cr_assert_eq(weft__ag_node_new("ScaleBackward", scale_bw, 1, &x, &n), WEFT_OK);
        n->dargs[0] = c;
        n->ctx = &ctx_frees;
        n->ctx_free = count_free;
        cr_assert_eq(weft__ag_attach(n, 1, &y), WEFT_OK);
        weft__ag_node_unref(n);
    }
    return y;
}

/* z = x * y elementwise (same shapes); saves both. */
static weft_status_t mul_bw(weft__ag_node_t *n, weft_tensor_t *const *go, weft_tensor_t **gi)
{
    for (int k = 0; k < 2; k++) {
        if (!weft__ag_needs_grad(n, k)) {
            continue;
        }
        WEFT_CHECK(weft_tensor_clone(go[0], &gi[k]));
        for (int64_t i = 0; i < weft_tensor_numel(gi[k]); i++) {
            D(gi[k])[i] *= D(n->saved[1 - k])[i];
        }
    }
    return WEFT_OK;
}

static weft_tensor_t *mul(weft_tensor_t *x, weft_tensor_t *y)
{
    weft_tensor_t *in[2] = {x, y};
    weft_tensor_t *z = NULL;
    weft__ag_node_t *n;

    cr_assert_eq(weft_tensor_clone(x, &z), WEFT_OK);
    for (int64_t i = 0; i < weft_tensor_numel(z); i++) {
        D(z)[i] *= D(y)[i];
    }
    if (weft__ag_should_record(2, in)) {
        cr_assert_eq(weft__ag_node_new("MulBackward", mul_bw, 2, in, &n), WEFT_OK);
        cr_assert_eq(weft__ag_save(n, x), WEFT_OK);
        cr_assert_eq(weft__ag_save(n, y), WEFT_OK);
        cr_assert_eq(weft__ag_attach(n, 1, &z), WEFT_OK);
        weft__ag_node_unref(n);
    }
    return z;
}

/* sum of all elements, a scalar [1]. */
static weft_status_t sum_bw(weft__ag_node_t *n, weft_tensor_t *const *go, weft_tensor_t **gi)
{
    WEFT_CHECK(weft_tensor_empty(WEFT_F64, n->in_ndim[0], n->in_shape[0], &gi[0]));
    for (int64_t i = 0; i < weft_tensor_numel(gi[0]); i++) {
        D(gi[0])[i] = D(go[0])[0];
    }
    return WEFT_OK;
}

static weft_tensor_t *sum(weft_tensor_t *x)
{
    int64_t one = 1;
    weft_tensor_t *s = NULL;
    weft__ag_node_t *n;

    cr_assert_eq(weft_tensor_create(WEFT_F64, 1, &one, &s), WEFT_OK);
    for (int64_t i = 0; i < weft_tensor_numel(x); i++) {
        D(s)[0] += D(x)[i];
    }
    if (weft__ag_should_record(1, &x)) {
        cr_assert_eq(weft__ag_node_new("SumBackward", sum_bw, 1, &x, &n), WEFT_OK);
        cr_assert_eq(weft__ag_attach(n, 1, &s), WEFT_OK);
        weft__ag_node_unref(n);
    }
    return s;
}

/* Splits [2k] into two halves; two outputs of one node. */
static weft_status_t halves_bw(weft__ag_node_t *n, weft_tensor_t *const *go, weft_tensor_t **gi)
{
    int64_t h = n->in_shape[0][0] / 2;

    WEFT_CHECK(weft_tensor_empty(WEFT_F64, 1, n->in_shape[0], &gi[0]));
    memcpy(D(gi[0]), D(go[0]), (size_t)h * sizeof(double));
    memcpy(D(gi[0]) + h, D(go[1]), (size_t)h * sizeof(double));
    return WEFT_OK;
}

static void halves(weft_tensor_t *x, weft_tensor_t **a, weft_tensor_t **b)
{
    int64_t h = weft_tensor_numel(x) / 2;
    weft__ag_node_t *n;

    *a = vec(h, D(x), 0);
    *b = vec(h, D(x) + h, 0);
    cr_assert_eq(weft__ag_node_new("HalvesBackward", halves_bw, 1, &x, &n), WEFT_OK);
    cr_assert_eq(weft__ag_attach(n, 2, (weft_tensor_t *[]){*a, *b}), WEFT_OK);
    weft__ag_node_unref(n);
}

/* Rows of a [V, 2] table at indices (like an embedding), sparse gradient. */
static weft_status_t rows_bw(weft__ag_node_t *n, weft_tensor_t *const *go, weft_tensor_t **gi)
{
    (void)gi;
    return weft__ag_grad_sparse(n, 0, n->saved[0], go[0]);
}

static weft_tensor_t *rows(weft_tensor_t *table, int64_t k, const int64_t *ix)
{
    int64_t shape[2] = {k, 2};
    weft_tensor_t *idx = NULL;
    weft_tensor_t *out = NULL;
    weft__ag_node_t *n;

    cr_assert_eq(weft_tensor_empty(WEFT_I64, 1, &k, &idx), WEFT_OK);
    memcpy(weft_tensor_data(idx), ix, (size_t)k * sizeof(int64_t));
    cr_assert_eq(weft_tensor_empty(WEFT_F64, 2, shape, &out), WEFT_OK);
    for (int64_t r = 0; r < k; r++) {
        D(out)[2 * r] = D(table)[2 * ix[r]];
        D(out)[2 * r + 1] = D(table)[2 * ix[r] + 1];
    }
    cr_assert_eq(weft__ag_node_new("RowsBackward", rows_bw, 1, &table, &n), WEFT_OK);
    cr_assert_eq(weft__ag_save(n, idx), WEFT_OK);
    cr_assert_eq(weft__ag_attach(n, 1, &out), WEFT_OK);
    weft__ag_node_unref(n);
    weft_tensor_release(idx);
    return out;
}

Test(engine, chain_rule_and_accumulation)
{
    weft_tensor_t *x = vec(3, (double[]){1, 2, 3}, 1);
    weft_tensor_t *y = scale(x, 3);
    weft_tensor_t *z = mul(y, x); /* z = 3 x^2, dz/dx = 6x */
    weft_tensor_t *s = sum(z);

    cr_assert(weft_tensor_requires_grad(s));
    cr_assert(!weft_tensor_is_leaf(s));
    cr_assert_str_eq(weft_tensor_grad_fn_name(s), "SumBackward");
    cr_assert_eq(weft_backward(s, NULL, 1), WEFT_OK, "%s", weft_last_error());
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(D(weft_tensor_grad(x))[i], 6.0 * (i + 1));
    }
    /* A second backward through the retained graph accumulates. */
    cr_assert_eq(weft_backward(s, NULL, 0), WEFT_OK, "%s", weft_last_error());
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(D(weft_tensor_grad(x))[i], 12.0 * (i + 1));
    }
    /* The graph is freed now: a third backward is an error that says so. */
    cr_assert_eq(weft_backward(s, NULL, 0), WEFT_ERR_INVALID_STATE);
    cr_assert(strstr(weft_last_error(), "retain_graph") != NULL, "%s", weft_last_error());
    cr_assert_eq(D(weft_tensor_grad(x))[0], 12.0, "a failed backward must not touch gradients");
    weft_tensor_grad_clear(x);
    cr_assert_null(weft_tensor_grad(x));
    weft_tensor_release(s);
    weft_tensor_release(z);
    weft_tensor_release(y);
    weft_tensor_release(x);
}

Test(engine, diamond_sums_both_paths)
{
    weft_tensor_t *x = vec(2, (double[]){1.5, -2}, 1);
    weft_tensor_t *a = scale(x, 2);
    weft_tensor_t *b = scale(x, 5);
    weft_tensor_t *c = mul(a, b); /* 10 x^2 -> 20 x */
    weft_tensor_t *g = vec(2, (double[]){1, 0.5}, 0);

    cr_assert_eq(weft_backward(c, g, 0), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(D(weft_tensor_grad(x))[0], 30.0);
    cr_assert_eq(D(weft_tensor_grad(x))[1], -20.0);
    weft_tensor_release(g);
    weft_tensor_release(c);
    weft_tensor_release(b);
    weft_tensor_release(a);
    weft_tensor_release(x);
}

Test(engine, root_checks)
{
    weft_tensor_t *x = vec(2, (double[]){1, 2}, 1);
    weft_tensor_t *plain = vec(2, (double[]){1, 2}, 0);
    weft_tensor_t *y = scale(x, 2);
    weft_tensor_t *g3 = vec(3, (double[]){1, 1, 1}, 0);
    int64_t n = 2;
    weft_tensor_t *gi = NULL;

    cr_assert_eq(weft_backward(plain, NULL, 0), WEFT_ERR_INVALID_ARG);
    cr_assert(strstr(weft_last_error(), "does not require") != NULL, "%s", weft_last_error());
    cr_assert_eq(weft_backward(y, NULL, 0), WEFT_ERR_INVALID_ARG);
    cr_assert(strstr(weft_last_error(), "2 elements") != NULL, "%s", weft_last_error());
    cr_assert_eq(weft_backward(y, g3, 0), WEFT_ERR_SHAPE);
    cr_assert(strstr(weft_last_error(), "[3]") != NULL, "%s", weft_last_error());
    cr_assert_eq(weft_tensor_create(WEFT_I64, 1, &n, &gi), WEFT_OK);
    cr_assert_eq(weft_backward(y, gi, 0), WEFT_ERR_DTYPE);
    cr_assert_eq(weft_tensor_set_requires_grad(gi, 1), WEFT_ERR_DTYPE);
    cr_assert_eq(weft_tensor_set_requires_grad(y, 0), WEFT_ERR_INVALID_STATE);
    cr_assert(strstr(weft_last_error(), "ScaleBackward") != NULL, "%s", weft_last_error());
    cr_assert_null(weft_tensor_grad(x));
    /* A leaf can be a root: its gradient is the root gradient. */
    cr_assert_eq(weft_backward(x, plain, 0), WEFT_OK);
    cr_assert_eq(D(weft_tensor_grad(x))[1], 2.0);
    cr_assert(weft_tensor_grad(x) != plain, "the leaf must not alias the caller's tensor");
    weft_tensor_release(gi);
    weft_tensor_release(g3);
    weft_tensor_release(y);
    weft_tensor_release(plain);
    weft_tensor_release(x);
}

Test(engine, no_grad_and_detach)
{
    weft_tensor_t *x = vec(2, (double[]){1, 2}, 1);
    weft_tensor_t *y;
    weft_tensor_t *d = NULL;
    int prev;

    cr_assert(weft_grad_enabled());
    prev = weft_grad_set_enabled(0);
    cr_assert_eq(prev, 1);
    y = scale(x, 2);
    cr_assert(!weft_tensor_requires_grad(y));
    cr_assert(weft_tensor_is_leaf(y));
    weft_grad_set_enabled(prev);
    weft_tensor_release(y);

    y = scale(x, 2);
    cr_assert_eq(weft_tensor_detach(y, &d), WEFT_OK);
    cr_assert(!weft_tensor_requires_grad(d));
    cr_assert(weft_tensor_is_leaf(d));
    cr_assert_eq(weft_tensor_data(d), weft_tensor_data(y), "detach shares storage");
    weft_tensor_release(d);
    weft_tensor_release(y);
    weft_tensor_release(x);
}

Test(engine, graph_state_freed_by_backward_or_release)
{
    weft_tensor_t *x = vec(2, (double[]){1, 2}, 1);
    weft_tensor_t *y;

    ctx_frees = 0;
    y = scale(x, 2);
    cr_assert_eq(weft_backward(y, x, 0), WEFT_OK);
    cr_assert_eq(ctx_frees, 1, "backward without retain_graph frees the node's state");
    weft_tensor_release(y);
    cr_assert_eq(ctx_frees, 1);

    y = scale(x, 2);
    cr_assert_eq(weft_backward(y, x, 1), WEFT_OK);
    cr_assert_eq(ctx_frees, 1, "retain_graph keeps it");
    weft_tensor_release(y);
    cr_assert_eq(ctx_frees, 2, "releasing the output frees the graph");
    weft_tensor_release(x);
}

static int hook_log[8];
static int hook_n;

static weft_status_t log_hook(weft_tensor_t *param, weft_tensor_t *grad, void *arg)
{
    (void)param;
    cr_assert_not_null(grad);
    hook_log[hook_n++] = (int)(intptr_t)arg;
    return WEFT_OK;
}

static weft_status_t failing_hook(weft_tensor_t *param, weft_tensor_t *grad, void *arg)
{
    (void)param;
    (void)grad;
    (void)arg;
    return WEFT_ERR_CANCELLED;
}

Test(engine, hooks_fire_once_after_accumulation_in_reverse_order)
{
    weft_tensor_t *a = vec(2, (double[]){1, 2}, 1);
    weft_tensor_t *b = vec(2, (double[]){3, 4}, 1);
    /* a is used first (and twice), b later: b's gradient completes first. */
    weft_tensor_t *a1 = scale(a, 2);
    weft_tensor_t *a2 = mul(a1, a);
    weft_tensor_t *c = mul(a2, b);
    weft_tensor_t *s = sum(c);
    int id = 0;

    hook_n = 0;
    cr_assert_eq(weft_tensor_add_grad_hook(a, log_hook, (void *)1, &id), WEFT_OK);
    cr_assert_eq(weft_tensor_add_grad_hook(b, log_hook, (void *)2, NULL), WEFT_OK);
    cr_assert_eq(weft_tensor_add_grad_hook(a1, log_hook, (void *)3, NULL), WEFT_ERR_INVALID_STATE);
    cr_assert_eq(weft_backward(s, NULL, 1), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(hook_n, 2);
    cr_assert_eq(hook_log[0], 2);
    cr_assert_eq(hook_log[1], 1);
    /* d/da of 2 a^2 b = 4 a b */
    cr_assert_eq(D(weft_tensor_grad(a))[0], 12.0);
    cr_assert_eq(D(weft_tensor_grad(a))[1], 32.0);

    cr_assert_eq(weft_tensor_remove_grad_hook(a, id), WEFT_OK);
    cr_assert_eq(weft_tensor_remove_grad_hook(a, id), WEFT_ERR_NOT_FOUND);
    cr_assert_eq(weft_tensor_add_grad_hook(b, failing_hook, NULL, NULL), WEFT_OK);
    hook_n = 0;
    cr_assert_eq(weft_backward(s, NULL, 0), WEFT_ERR_CANCELLED);
    cr_assert_eq(hook_n, 1, "b's first hook ran, then the failing one stopped backward");
    weft_tensor_release(s);
    weft_tensor_release(c);
    weft_tensor_release(a2);
    weft_tensor_release(a1);
    weft_tensor_release(b);
    weft_tensor_release(a);
}

Test(engine, unused_output_gets_zeros_and_shared_node_roots_run_once)
{
    weft_tensor_t *x = vec(4, (double[]){1, 2, 3, 4}, 1);
    weft_tensor_t *lo;
    weft_tensor_t *hi;
    weft_tensor_t *s;

    halves(x, &lo, &hi);
    s = sum(hi);
    cr_assert_eq(weft_backward(s, NULL, 0), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(D(weft_tensor_grad(x))[0], 0.0);
    cr_assert_eq(D(weft_tensor_grad(x))[3], 1.0);
    weft_tensor_release(s);
    weft_tensor_grad_clear(x);

    {
        weft_tensor_t *g1 = vec(2, (double[]){1, 2}, 0);
        weft_tensor_t *g2 = vec(2, (double[]){3, 4}, 0);
        cr_assert_eq(
            weft_backward_many(2, (weft_tensor_t *[]){lo, hi}, (weft_tensor_t *[]){g1, g2}, 0),
            WEFT_OK, "%s", weft_last_error());
        for (int i = 0; i < 4; i++) {
            cr_assert_eq(D(weft_tensor_grad(x))[i], i + 1.0);
        }
        weft_tensor_release(g1);
        weft_tensor_release(g2);
    }
    weft_tensor_release(lo);
    weft_tensor_release(hi);
    weft_tensor_release(x);
}

Test(engine, sparse_gradients_stay_sparse_on_leaves)
{
    double init[8] = {0, 1, 10, 11, 20, 21, 30, 31};
    int64_t shape[2] = {4, 2};
    weft_tensor_t *table = NULL;
    weft_tensor_t *r;
    weft_tensor_t *s;
    weft_tensor_t *idx;
    weft_tensor_t *val;

    cr_assert_eq(weft_tensor_empty(WEFT_F64, 2, shape, &table), WEFT_OK);
    memcpy(D(table), init, sizeof(init));
    cr_assert_eq(weft_tensor_set_requires_grad(table, 1), WEFT_OK);
    cr_assert_eq(weft_tensor_sparse_grad(table, &idx, &val), WEFT_ERR_NOT_FOUND);
    r = rows(table, 3, (int64_t[]){2, 0, 2});
    cr_assert_eq(D(r)[0], 20.0);
    s = sum(r);
    cr_assert_eq(weft_backward(s, NULL, 1), WEFT_OK, "%s", weft_last_error());
    cr_assert_null(weft_tensor_grad(table), "no dense gradient");
    cr_assert_eq(weft_tensor_sparse_grad(table, &idx, &val), WEFT_OK);
    cr_assert_eq(weft_tensor_shape(idx)[0], 3);
    cr_assert_eq(((int64_t *)weft_tensor_data(idx))[2], 2);
    cr_assert_eq(weft_tensor_shape(val)[1], 2);
    cr_assert_eq(D(val)[5], 1.0);
    /* Accumulation appends. */
    cr_assert_eq(weft_backward(s, NULL, 0), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(weft_tensor_sparse_grad(table, &idx, &val), WEFT_OK);
    cr_assert_eq(weft_tensor_shape(idx)[0], 6);
    weft_tensor_grad_clear(table);
    cr_assert_eq(weft_tensor_sparse_grad(table, &idx, &val), WEFT_ERR_NOT_FOUND);

    /* Through a non-leaf, the sparse gradient is densified. */
    {
        weft_tensor_t *t2 = scale(table, 1.0);
        weft_tensor_t *r2 = rows(t2, 2, (int64_t[]){1, 1});
        weft_tensor_t *s2 = sum(r2);
        cr_assert_eq(weft_backward(s2, NULL, 0), WEFT_OK, "%s", weft_last_error());
        cr_assert_not_null(weft_tensor_grad(table));
        cr_assert_eq(D(weft_tensor_grad(table))[2], 2.0);
        cr_assert_eq(D(weft_tensor_grad(table))[0], 0.0);
        weft_tensor_release(s2);
        weft_tensor_release(r2);
        weft_tensor_release(t2);
    }
    weft_tensor_release(s);
    weft_tensor_release(r);
    weft_tensor_release(table);
}

Test(engine, long_chain_backward_and_free)
{
    weft_tensor_t *x = vec(1, (double[]){1}, 1);
    weft_tensor_t *y = weft_tensor_retain(x);

    for (int i = 0; i < 100000; i++) {
        weft_tensor_t *z = scale(y, 1.0);
        weft_tensor_release(y);
        y = z;
    }
    cr_assert_eq(weft_backward(y, NULL, 0), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(D(weft_tensor_grad(x))[0], 1.0);
    weft_tensor_release(y); /* frees 100000 nodes without deep recursion */
    weft_tensor_release(x);
}

Test(engine, set_grad_checks_shape)
{
    weft_tensor_t *x = vec(2, (double[]){1, 2}, 1);
    weft_tensor_t *g = vec(2, (double[]){5, 6}, 0);
    weft_tensor_t *bad = vec(3, (double[]){5, 6, 7}, 0);

    cr_assert_eq(weft_tensor_set_grad(x, bad), WEFT_ERR_SHAPE);
    cr_assert_eq(weft_tensor_set_grad(x, g), WEFT_OK);
    cr_assert_eq(weft_tensor_grad(x), g);
    cr_assert_eq(weft_tensor_set_grad(x, NULL), WEFT_OK);
    cr_assert_null(weft_tensor_grad(x));
    weft_tensor_release(bad);
    weft_tensor_release(g);
    weft_tensor_release(x);
}

/* ---- fixes from review -------------------------------------------------------------------------
 */

#include <pthread.h>

typedef struct {
    weft_tensor_t *w;
    int rounds;
    int failures;
} shared_leaf_job_t;

static void *shared_leaf_worker(void *arg)
{
    shared_leaf_job_t *job = arg;

    for (int i = 0; i < job->rounds; i++) {
        weft_tensor_t *y = scale(job->w, 1.0); /* a graph of its own over the shared leaf */
        weft_tensor_t *s = sum(y);
        if (weft_backward(s, NULL, 0) != WEFT_OK) {
            job->failures++;
        }
        weft_tensor_release(s);
        weft_tensor_release(y);
    }
    return NULL;
}

Test(engine, graphs_sharing_a_leaf_run_backward_concurrently)
{
    double init[256];
    shared_leaf_job_t jobs[2];
    pthread_t th[2];
    weft_tensor_t *w;

    for (int i = 0; i < 256; i++) {
        init[i] = i;
    }
    w = vec(256, init, 1);
    for (int t = 0; t < 2; t++) {
        jobs[t] = (shared_leaf_job_t){.w = w, .rounds = 300};
        cr_assert_eq(pthread_create(&th[t], NULL, shared_leaf_worker, &jobs[t]), 0);
    }
    for (int t = 0; t < 2; t++) {
        pthread_join(th[t], NULL);
        cr_assert_eq(jobs[t].failures, 0);
    }
    for (int i = 0; i < 256; i++) {
        cr_assert_eq(D(weft_tensor_grad(w))[i], 600.0, "element %d: %g", i,
                     D(weft_tensor_grad(w))[i]);
    }
    weft_tensor_release(w);
}

static int once_calls;
static int after_calls;

static weft_status_t once_hook(weft_tensor_t *param, weft_tensor_t *grad, void *arg)
{
    (void)grad;
    once_calls++;
    return weft_tensor_remove_grad_hook(param, *(int *)arg);
}

static weft_status_t after_hook(weft_tensor_t *param, weft_tensor_t *grad, void *arg)
{
    (void)param;
    (void)grad;
    (void)arg;
    after_calls++;
    return WEFT_OK;
}

Test(engine, a_hook_that_removes_itself_does_not_skip_the_next)
{
    weft_tensor_t *x = vec(2, (double[]){1, 2}, 1);
    int id = 0;

    cr_assert_eq(weft_tensor_add_grad_hook(x, once_hook, &id, &id), WEFT_OK);
    cr_assert_eq(weft_tensor_add_grad_hook(x, after_hook, NULL, NULL), WEFT_OK);
    for (int round = 0; round < 2; round++) {
        weft_tensor_t *y = scale(x, 2);
        cr_assert_eq(weft_backward(y, x, 0), WEFT_OK, "%s", weft_last_error());
        weft_tensor_release(y);
    }
    cr_assert_eq(once_calls, 1);
    cr_assert_eq(after_calls, 2);
    weft_tensor_release(x);
}

Test(engine, leaves_turned_off_after_recording_and_non_leaf_set_grad)
{
    weft_tensor_t *x = vec(2, (double[]){1, 2}, 1);
    weft_tensor_t *y = scale(x, 2);
    weft_tensor_t *g = vec(2, (double[]){1, 1}, 0);

    cr_assert_eq(weft_tensor_set_grad(y, g), WEFT_ERR_INVALID_STATE);
    cr_assert_eq(weft_tensor_set_requires_grad(x, 0), WEFT_OK);
    cr_assert_eq(weft_backward(y, g, 0), WEFT_OK, "%s", weft_last_error());
    cr_assert_null(weft_tensor_grad(x), "a leaf that no longer requires grad gets none");
    weft_tensor_release(g);
    weft_tensor_release(y);
    weft_tensor_release(x);
}

Test(engine, sparse_rows_do_not_alias_the_callers_gradient)
{
    int64_t shape[2] = {3, 2};
    weft_tensor_t *table = NULL;
    weft_tensor_t *r;
    weft_tensor_t *g;
    weft_tensor_t *idx;
    weft_tensor_t *val;

    cr_assert_eq(weft_tensor_create(WEFT_F64, 2, shape, &table), WEFT_OK);
    cr_assert_eq(weft_tensor_set_requires_grad(table, 1), WEFT_OK);
    r = rows(table, 1, (int64_t[]){2});
    cr_assert_eq(weft_tensor_create(WEFT_F64, 2, (int64_t[]){1, 2}, &g), WEFT_OK);
    D(g)[0] = 5;
    D(g)[1] = 6;
    cr_assert_eq(weft_backward(r, g, 0), WEFT_OK, "%s", weft_last_error());
    D(g)[0] = 42; /* the caller reuses its buffer */
    cr_assert_eq(weft_tensor_sparse_grad(table, &idx, &val), WEFT_OK);
    cr_assert_eq(D(val)[0], 5.0);
    cr_assert_eq(D(val)[1], 6.0);
    weft_tensor_release(g);
    weft_tensor_release(r);
    weft_tensor_release(table);
}

Test(engine, saved_labels_are_private)
{
    int64_t ls[2] = {2, 3};
    int64_t n = 2;
    weft_tensor_t *logits = NULL;
    weft_tensor_t *labels = NULL;
    weft_tensor_t *loss = NULL;
    weft_rng_t rng;

    weft_rng_init(&rng, 3, 0);
    cr_assert_eq(weft_tensor_empty(WEFT_F64, 2, ls, &logits), WEFT_OK);
    cr_assert_eq(weft_tensor_fill_uniform(logits, -1, 1, &rng), WEFT_OK);
    cr_assert_eq(weft_tensor_set_requires_grad(logits, 1), WEFT_OK);
    cr_assert_eq(weft_tensor_create(WEFT_I64, 1, &n, &labels), WEFT_OK);
    ((int64_t *)weft_tensor_data(labels))[1] = 2;
    cr_assert_eq(weft_op_cross_entropy(logits, labels, WEFT_REDUCTION_SUM, &loss), WEFT_OK);
    /* The caller refills its label buffer (out of range for this batch) before backward. */
    ((int64_t *)weft_tensor_data(labels))[1] = 1000000;
    cr_assert_eq(weft_backward(loss, NULL, 0), WEFT_OK, "%s", weft_last_error());
    {
        /* Row 1's gradient is softmax - onehot(2): its entry 2 is negative. */
        double g12 = D(weft_tensor_grad(logits))[5];
        cr_assert(g12 < 0, "label 2 was used: %g", g12);
    }
    weft_tensor_release(loss);
    weft_tensor_release(labels);
    weft_tensor_release(logits);
}
