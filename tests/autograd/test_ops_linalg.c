/*
 * Matrix products: matmul (every rank combination, batch broadcasting), bmm and linear. Gradients
 * by gradcheck in f64, f32 gradients against f64 ones, forward values against torch
 * (data/ops_linalg_table.h, made by data/gen_ops_linalg.py) and the error statuses and texts.
 */
#include <math.h>
#include <string.h>

#include <criterion/criterion.h>

#include "../core/counting_alloc.h"
#include "gradcheck.h"

#include "data/ops_linalg_table.h"

#include <weft/weft.h>

/* ---- helpers --------------------------------------------------------------------------------- */

static weft_tensor_t *from_tt(const tt_t *t, weft_dtype_t dt)
{
    weft_tensor_t *x = NULL;
    int64_t n;

    cr_assert_eq(weft_tensor_empty(dt, t->ndim, t->shape, &x), WEFT_OK);
    n = weft_tensor_numel(x);
    for (int64_t i = 0; i < n; i++) {
        if (dt == WEFT_F32) {
            ((float *)weft_tensor_data(x))[i] = (float)t->data[i];
        } else {
            ((double *)weft_tensor_data(x))[i] = t->data[i];
        }
    }
    return x;
}

static double elem(const weft_tensor_t *t, int64_t i)
{
    if (weft_tensor_dtype(t) == WEFT_F32) {
        return ((const float *)weft_tensor_data(t))[i];
    }
    return ((const double *)weft_tensor_data(t))[i];
}

/* @p got has @p want's shape and values within @p tol (relative to max(1, |want|)). */
static void expect_tt(const weft_tensor_t *got, const tt_t *want, double tol, const char *what)
{
    cr_assert_eq(weft_tensor_ndim(got), want->ndim, "%s: ndim %d, want %d", what,
                 weft_tensor_ndim(got), want->ndim);
    for (int i = 0; i < want->ndim; i++) {
        cr_assert_eq(weft_tensor_shape(got)[i], want->shape[i], "%s: dim %d is %lld, want %lld",
                     what, i, (long long)weft_tensor_shape(got)[i], (long long)want->shape[i]);
    }
    for (int64_t i = 0; i < weft_tensor_numel(got); i++) {
        double w = want->data[i];

        cr_assert(fabs(elem(got, i) - w) <= tol * fmax(1.0, fabs(w)),
                  "%s: element %lld is %.10g, torch %.10g", what, (long long)i, elem(got, i), w);
    }
}

static void expect_error(weft_status_t st, weft_status_t want, const char *needle)
{
    cr_assert_eq(st, want, "status %s, want %s (%s)", weft_status_name(st), weft_status_name(want),
                 weft_last_error());
    cr_assert(strstr(weft_last_error(), needle) != NULL, "error text \"%s\" lacks \"%s\"",
              weft_last_error(), needle);
}

static weft_tensor_t *zeros(weft_dtype_t dt, int ndim, const int64_t *shape)
{
    weft_tensor_t *t = NULL;

    cr_assert_eq(weft_tensor_create(dt, ndim, shape, &t), WEFT_OK);
    return t;
}

static weft_tensor_t *to_f32(const weft_tensor_t *t, int rg)
{
    weft_tensor_t *x = zeros(WEFT_F32, weft_tensor_ndim(t), weft_tensor_shape(t));

    for (int64_t i = 0; i < weft_tensor_numel(t); i++) {
        ((float *)weft_tensor_data(x))[i] = (float)elem(t, i);
    }
    if (rg) {
        cr_assert_eq(weft_tensor_set_requires_grad(x, 1), WEFT_OK);
    }
    return x;
}

/* a and b have the same shape and values within @p tol. */
static void expect_close(const weft_tensor_t *a, const weft_tensor_t *b, double tol,
                         const char *what)
{
    cr_assert_eq(weft_tensor_ndim(a), weft_tensor_ndim(b), "%s: ndim", what);
    cr_assert_eq(memcmp(weft_tensor_shape(a), weft_tensor_shape(b),
                        (size_t)weft_tensor_ndim(a) * sizeof(int64_t)),
                 0, "%s: shape", what);
    for (int64_t i = 0; i < weft_tensor_numel(a); i++) {
        cr_assert(fabs(elem(a, i) - elem(b, i)) <= tol * fmax(1.0, fabs(elem(b, i))),
                  "%s: element %lld: %.10g vs %.10g", what, (long long)i, elem(a, i), elem(b, i));
    }
}

/* ---- gradients ------------------------------------------------------------------------------- */

static weft_status_t f_matmul(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    (void)arg;
    return weft_op_matmul(in[0], in[1], out_p);
}

static weft_status_t f_bmm(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    (void)arg;
    return weft_op_bmm(in[0], in[1], out_p);
}

static weft_status_t f_linear(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    (void)arg;
    return weft_op_linear(in[0], in[1], in[2], out_p);
}

typedef struct {
    const char *name;
    int nda;
    int64_t sa[WEFT_MAX_DIMS];
    int ndb;
    int64_t sb[WEFT_MAX_DIMS];
} mm_shapes_t;

static const mm_shapes_t mm_grad_shapes[] = {
    {"1x1", 1, {4}, 1, {4}},
    {"1x2", 1, {3}, 2, {3, 5}},
    {"2x1", 2, {4, 3}, 1, {3}},
    {"2x2", 2, {4, 3}, 2, {3, 5}},
    {"3x2 folded", 3, {2, 4, 3}, 2, {3, 5}},
    {"2x3", 2, {4, 3}, 3, {2, 3, 5}},
    {"1x3", 1, {3}, 3, {2, 3, 5}},
    {"3x1", 3, {2, 4, 3}, 1, {3}},
    {"3x3", 3, {2, 4, 3}, 3, {2, 3, 5}},
    {"3x3 broadcast a", 3, {1, 4, 3}, 3, {3, 3, 2}},
    {"3x2 broadcast batch", 3, {3, 2, 4}, 2, {4, 3}},
    {"4x3 broadcast", 4, {2, 1, 2, 3}, 3, {3, 3, 2}},
    {"4x4", 4, {2, 3, 2, 3}, 4, {2, 3, 3, 2}},
    {"4x4 broadcast both", 4, {2, 1, 2, 3}, 4, {1, 3, 3, 2}},
};

TestSuite(linalg, .init = use_counting);

Test(linalg, matmul_grad)
{
    weft_rng_t rng;

    weft_rng_init(&rng, 11, 0);
    for (size_t c = 0; c < sizeof(mm_grad_shapes) / sizeof(mm_grad_shapes[0]); c++) {
        const mm_shapes_t *s = &mm_grad_shapes[c];
        weft_tensor_t *in[2];

        in[0] = gc_rand(&rng, s->nda, s->sa, -1, 1, 1);
        in[1] = gc_rand(&rng, s->ndb, s->sb, -1, 1, 1);
        gradcheck(s->name, f_matmul, NULL, 2, in, &rng);
        /* Only one side requiring grad. */
        cr_assert_eq(weft_tensor_set_requires_grad(in[0], 0), WEFT_OK);
        gradcheck(s->name, f_matmul, NULL, 2, in, &rng);
        weft_tensor_release(in[0]);
        weft_tensor_release(in[1]);
    }
    check_balanced();
}

Test(linalg, bmm_grad)
{
    const int64_t sa[] = {3, 2, 4};
    const int64_t sb[] = {3, 4, 5};
    weft_tensor_t *in[2];
    weft_tensor_t *out = NULL;
    weft_rng_t rng;

    weft_rng_init(&rng, 12, 0);
    in[0] = gc_rand(&rng, 3, sa, -1, 1, 1);
    in[1] = gc_rand(&rng, 3, sb, -1, 1, 1);
    gradcheck("bmm", f_bmm, NULL, 2, in, &rng);
    cr_assert_eq(weft_op_bmm(in[0], in[1], &out), WEFT_OK);
    cr_assert_str_eq(weft_tensor_grad_fn_name(out), "BmmBackward");
    weft_tensor_release(out);
    weft_tensor_release(in[0]);
    weft_tensor_release(in[1]);
    check_balanced();
}

Test(linalg, linear_grad)
{
    const int64_t xs2[] = {5, 4};
    const int64_t xs3[] = {2, 3, 4};
    const int64_t xs1[] = {4};
    const int64_t ws[] = {3, 4};
    const int64_t bs[] = {3};
    weft_rng_t rng;
    weft_tensor_t *x2;
    weft_tensor_t *x3;
    weft_tensor_t *x1;
    weft_tensor_t *w;
    weft_tensor_t *b;

    weft_rng_init(&rng, 13, 0);
    x2 = gc_rand(&rng, 2, xs2, -1, 1, 1);
    x3 = gc_rand(&rng, 3, xs3, -1, 1, 1);
    x1 = gc_rand(&rng, 1, xs1, -1, 1, 1);
    w = gc_rand(&rng, 2, ws, -1, 1, 1);
    b = gc_rand(&rng, 1, bs, -1, 1, 1);
    gradcheck("linear with bias", f_linear, NULL, 3, (weft_tensor_t *[]){x2, w, b}, &rng);
    gradcheck("linear without bias", f_linear, NULL, 3, (weft_tensor_t *[]){x2, w, NULL}, &rng);
    gradcheck("linear 3-D x", f_linear, NULL, 3, (weft_tensor_t *[]){x3, w, b}, &rng);
    gradcheck("linear 1-D x", f_linear, NULL, 3, (weft_tensor_t *[]){x1, w, b}, &rng);
    /* Weights only (x a constant), bias only. */
    cr_assert_eq(weft_tensor_set_requires_grad(x2, 0), WEFT_OK);
    gradcheck("linear, x constant", f_linear, NULL, 3, (weft_tensor_t *[]){x2, w, b}, &rng);
    cr_assert_eq(weft_tensor_set_requires_grad(w, 0), WEFT_OK);
    gradcheck("linear, bias only", f_linear, NULL, 3, (weft_tensor_t *[]){x2, w, b}, &rng);
    weft_tensor_release(x1);
    weft_tensor_release(x2);
    weft_tensor_release(x3);
    weft_tensor_release(w);
    weft_tensor_release(b);
    check_balanced();
}

/* The f32 kernels (sgemm, f32 column sums) give the f64 gradients to f32 precision. */
static void grads_f32_vs_f64(const char *name, gc_fn_t f, int n, weft_tensor_t *const *in64,
                             weft_rng_t *rng)
{
    weft_tensor_t *in32[3] = {NULL, NULL, NULL};
    weft_tensor_t *o64 = NULL;
    weft_tensor_t *o32 = NULL;
    weft_tensor_t *v64 = NULL;
    weft_tensor_t *v32;

    for (int i = 0; i < n; i++) {
        in32[i] = in64[i] != NULL ? to_f32(in64[i], 1) : NULL;
    }
    cr_assert_eq(f(in64, NULL, &o64), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(f(in32, NULL, &o32), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(weft_tensor_dtype(o32), WEFT_F32);
    expect_close(o32, o64, 1e-5, name);
    cr_assert_eq(weft_tensor_empty(WEFT_F64, weft_tensor_ndim(o64), weft_tensor_shape(o64), &v64),
                 WEFT_OK);
    cr_assert_eq(weft_tensor_fill_uniform(v64, -1, 1, rng), WEFT_OK);
    v32 = to_f32(v64, 0);
    cr_assert_eq(weft_backward(o64, v64, 0), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(weft_backward(o32, v32, 0), WEFT_OK, "%s", weft_last_error());
    for (int i = 0; i < n; i++) {
        if (in64[i] != NULL) {
            cr_assert_not_null(weft_tensor_grad(in32[i]), "%s: input %d has no grad", name, i);
            cr_assert_eq(weft_tensor_dtype(weft_tensor_grad(in32[i])), WEFT_F32);
            expect_close(weft_tensor_grad(in32[i]), weft_tensor_grad(in64[i]), 1e-5, name);
            weft_tensor_grad_clear(in64[i]);
        }
        weft_tensor_release(in32[i]);
    }
    weft_tensor_release(o64);
    weft_tensor_release(o32);
    weft_tensor_release(v64);
    weft_tensor_release(v32);
}

Test(linalg, f32_grads)
{
    const int64_t xs[] = {64, 30};
    const int64_t ws[] = {17, 30};
    const int64_t bs[] = {17};
    const int64_t as[] = {3, 1, 5, 6};
    const int64_t bbs[] = {4, 6, 7};
    weft_tensor_t *x;
    weft_tensor_t *w;
    weft_tensor_t *b;
    weft_tensor_t *ma;
    weft_tensor_t *mb;
    weft_rng_t rng;

    weft_rng_init(&rng, 14, 0);
    x = gc_rand(&rng, 2, xs, -1, 1, 1);
    w = gc_rand(&rng, 2, ws, -1, 1, 1);
    b = gc_rand(&rng, 1, bs, -1, 1, 1);
    ma = gc_rand(&rng, 4, as, -1, 1, 1);
    mb = gc_rand(&rng, 3, bbs, -1, 1, 1);
    grads_f32_vs_f64("linear f32", f_linear, 3, (weft_tensor_t *[]){x, w, b}, &rng);
    grads_f32_vs_f64("matmul f32", f_matmul, 2, (weft_tensor_t *[]){ma, mb}, &rng);
    weft_tensor_release(x);
    weft_tensor_release(w);
    weft_tensor_release(b);
    weft_tensor_release(ma);
    weft_tensor_release(mb);
    check_balanced();
}

Test(linalg, grad_fn_and_no_grad)
{
    const int64_t s[] = {2, 2};
    weft_tensor_t *a = zeros(WEFT_F64, 2, s);
    weft_tensor_t *out = NULL;
    int prev;

    cr_assert_eq(weft_tensor_set_requires_grad(a, 1), WEFT_OK);
    cr_assert_eq(weft_op_matmul(a, a, &out), WEFT_OK);
    cr_assert_str_eq(weft_tensor_grad_fn_name(out), "MatmulBackward");
    weft_tensor_release(out);
    cr_assert_eq(weft_op_linear(a, a, NULL, &out), WEFT_OK);
    cr_assert_str_eq(weft_tensor_grad_fn_name(out), "LinearBackward");
    weft_tensor_release(out);
    prev = weft_grad_set_enabled(0);
    cr_assert_eq(weft_op_matmul(a, a, &out), WEFT_OK);
    cr_assert_not(weft_tensor_requires_grad(out));
    cr_assert(weft_tensor_is_leaf(out));
    weft_tensor_release(out);
    weft_grad_set_enabled(prev);
    weft_tensor_release(a);
    check_balanced();
}

/* ---- forward values against torch ------------------------------------------------------------ */

static void check_mm_cases(const mm_case_t *cases, size_t n,
                           weft_status_t (*op)(weft_tensor_t *, weft_tensor_t *, weft_tensor_t **))
{
    for (size_t c = 0; c < n; c++) {
        for (int d = 0; d < 2; d++) {
            weft_dtype_t dt = d == 0 ? WEFT_F64 : WEFT_F32;
            weft_tensor_t *a = from_tt(&cases[c].a, dt);
            weft_tensor_t *b = from_tt(&cases[c].b, dt);
            weft_tensor_t *out = NULL;

            cr_assert_eq(op(a, b, &out), WEFT_OK, "%s: %s", cases[c].name, weft_last_error());
            cr_assert_eq(weft_tensor_dtype(out), dt);
            expect_tt(out, &cases[c].out, dt == WEFT_F64 ? 1e-12 : 1e-5, cases[c].name);
            weft_tensor_release(out);
            weft_tensor_release(a);
            weft_tensor_release(b);
        }
    }
}

Test(linalg, matmul_matches_torch)
{
    check_mm_cases(matmul_cases, sizeof(matmul_cases) / sizeof(matmul_cases[0]), weft_op_matmul);
    check_balanced();
}

Test(linalg, bmm_matches_torch)
{
    check_mm_cases(bmm_cases, sizeof(bmm_cases) / sizeof(bmm_cases[0]), weft_op_bmm);
    check_balanced();
}

Test(linalg, linear_matches_torch)
{
    for (size_t c = 0; c < sizeof(linear_cases) / sizeof(linear_cases[0]); c++) {
        const linear_case_t *lc = &linear_cases[c];

        for (int d = 0; d < 2; d++) {
            weft_dtype_t dt = d == 0 ? WEFT_F64 : WEFT_F32;
            weft_tensor_t *x = from_tt(&lc->x, dt);
            weft_tensor_t *w = from_tt(&lc->w, dt);
            weft_tensor_t *b = lc->has_b ? from_tt(&lc->b, dt) : NULL;
            weft_tensor_t *out = NULL;

            cr_assert_eq(weft_op_linear(x, w, b, &out), WEFT_OK, "%s: %s", lc->name,
                         weft_last_error());
            expect_tt(out, &lc->out, dt == WEFT_F64 ? 1e-12 : 1e-5, lc->name);
            weft_tensor_release(out);
            weft_tensor_release(x);
            weft_tensor_release(w);
            weft_tensor_release(b);
        }
    }
    check_balanced();
}

/* ---- errors ---------------------------------------------------------------------------------- */

Test(linalg, errors)
{
    const int64_t s23[] = {2, 3};
    const int64_t s45[] = {4, 5};
    const int64_t s234[] = {2, 3, 4};
    const int64_t s345[] = {3, 4, 5};
    const int64_t s35[] = {3, 5};
    const int64_t s3[] = {3};
    const int64_t s4[] = {4};
    weft_tensor_t *a23 = zeros(WEFT_F64, 2, s23);
    weft_tensor_t *a45 = zeros(WEFT_F64, 2, s45);
    weft_tensor_t *f23 = zeros(WEFT_F32, 2, s23);
    weft_tensor_t *i23 = zeros(WEFT_I64, 2, s23);
    weft_tensor_t *a234 = zeros(WEFT_F64, 3, s234);
    weft_tensor_t *a345 = zeros(WEFT_F64, 3, s345);
    weft_tensor_t *w35 = zeros(WEFT_F64, 2, s35);
    weft_tensor_t *b3 = zeros(WEFT_F64, 1, s3);
    weft_tensor_t *b4 = zeros(WEFT_F64, 1, s4);
    weft_tensor_t *scalar = zeros(WEFT_F64, 0, NULL);
    weft_tensor_t *out = NULL;

    expect_error(weft_op_matmul(a23, a45, &out), WEFT_ERR_SHAPE, "[2, 3] and [4, 5]");
    expect_error(weft_op_matmul(b3, b4, &out), WEFT_ERR_SHAPE, "[3] and [4]");
    expect_error(weft_op_matmul(a234, a23, &out), WEFT_ERR_SHAPE, "[2, 3, 4] and [2, 3]");
    expect_error(weft_op_matmul(scalar, b3, &out), WEFT_ERR_SHAPE, "at least 1 dim");
    expect_error(weft_op_matmul(a23, f23, &out), WEFT_ERR_DTYPE, "f64 and f32");
    expect_error(weft_op_matmul(i23, i23, &out), WEFT_ERR_DTYPE, "i64");
    expect_error(weft_op_matmul(NULL, a23, &out), WEFT_ERR_INVALID_ARG, "NULL");
    {
        /* Batch dims that do not broadcast. */
        const int64_t sa[] = {2, 3, 4};
        const int64_t sb[] = {3, 4, 2};
        weft_tensor_t *x = zeros(WEFT_F64, 3, sa);
        weft_tensor_t *y = zeros(WEFT_F64, 3, sb);

        expect_error(weft_op_matmul(x, y, &out), WEFT_ERR_SHAPE, "do not broadcast");
        weft_tensor_release(x);
        weft_tensor_release(y);
    }

    expect_error(weft_op_bmm(a234, a345, &out), WEFT_ERR_SHAPE, "[2, 3, 4] and [3, 4, 5]");
    expect_error(weft_op_bmm(a234, a45, &out), WEFT_ERR_SHAPE, "3-D");

    expect_error(weft_op_linear(a23, w35, NULL, &out), WEFT_ERR_SHAPE, "[3, 5]");
    expect_error(weft_op_linear(a23, b3, NULL, &out), WEFT_ERR_SHAPE, "weight of shape [3]");
    expect_error(weft_op_linear(a45, w35, b4, &out), WEFT_ERR_SHAPE, "bias of shape [4]");
    expect_error(weft_op_linear(f23, a23, NULL, &out), WEFT_ERR_DTYPE, "f32 and f64");
    cr_assert_null(out);

    weft_tensor_release(a23);
    weft_tensor_release(a45);
    weft_tensor_release(f23);
    weft_tensor_release(i23);
    weft_tensor_release(a234);
    weft_tensor_release(a345);
    weft_tensor_release(w35);
    weft_tensor_release(b3);
    weft_tensor_release(b4);
    weft_tensor_release(scalar);
    check_balanced();
}

/* A batch that is not tiny, through every path, against a naive triple loop. */
Test(linalg, larger_batched_against_naive)
{
    const int64_t sa[] = {3, 1, 17, 33};
    const int64_t sb[] = {4, 33, 9};
    weft_tensor_t *a;
    weft_tensor_t *b;
    weft_tensor_t *out = NULL;
    weft_rng_t rng;

    weft_rng_init(&rng, 15, 0);
    a = gc_rand(&rng, 4, sa, -1, 1, 0);
    b = gc_rand(&rng, 3, sb, -1, 1, 0);
    cr_assert_eq(weft_op_matmul(a, b, &out), WEFT_OK);
    cr_assert_eq(weft_tensor_ndim(out), 4);
    for (int i = 0; i < 3; i++) {
        for (int j = 0; j < 4; j++) {
            for (int r = 0; r < 17; r++) {
                for (int c = 0; c < 9; c++) {
                    double acc = 0;
                    double got = ((double *)weft_tensor_data(out))[((i * 4 + j) * 17 + r) * 9 + c];

                    for (int k = 0; k < 33; k++) {
                        acc += ((double *)weft_tensor_data(a))[(i * 17 + r) * 33 + k] *
                               ((double *)weft_tensor_data(b))[(j * 33 + k) * 9 + c];
                    }
                    cr_assert(fabs(got - acc) < 1e-12, "[%d, %d, %d, %d]: %g vs %g", i, j, r, c,
                              got, acc);
                }
            }
        }
    }
    weft_tensor_release(out);
    weft_tensor_release(a);
    weft_tensor_release(b);
    check_balanced();
}
