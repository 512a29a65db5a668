/*
 * autograd: reductions (sum, mean, max, argmax), softmax, log_softmax and the losses:
 * gradients against central differences, forward values against torch (data/, made by
 * data/gen_ops_reduce.py), f32 against f64, and the errors.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "data/ops_reduce_table.h"
#include "gradcheck.h"

#include <weft/weft.h>

/* ---- helpers --------------------------------------------------------------------------------- */

static weft_tensor_t *make(weft_dtype_t dt, int ndim, const int64_t *shape, const double *v)
{
    weft_tensor_t *t = NULL;

    cr_assert_eq(weft_tensor_empty(dt, ndim, shape, &t), WEFT_OK, "%s", weft_last_error());
    for (int64_t i = 0; i < weft_tensor_numel(t); i++) {
        if (dt == WEFT_F32) {
            ((float *)weft_tensor_data(t))[i] = (float)v[i];
        } else {
            ((double *)weft_tensor_data(t))[i] = v[i];
        }
    }
    return t;
}

static weft_tensor_t *make_i64(int ndim, const int64_t *shape, const int64_t *v)
{
    weft_tensor_t *t = NULL;

    cr_assert_eq(weft_tensor_empty(WEFT_I64, ndim, shape, &t), WEFT_OK);
    memcpy(weft_tensor_data(t), v, weft_tensor_nbytes(t));
    return t;
}

static double at(const weft_tensor_t *t, int64_t i)
{
    if (weft_tensor_dtype(t) == WEFT_F32) {
        return ((const float *)weft_tensor_data(t))[i];
    }
    return ((const double *)weft_tensor_data(t))[i];
}

static void round_to_f32(weft_tensor_t *t)
{
    double *d = weft_tensor_data(t);

    for (int64_t i = 0; i < weft_tensor_numel(t); i++) {
        d[i] = (float)d[i];
    }
}

static void expect_shape(const char *what, const weft_tensor_t *t, int ndim, const int64_t *shape)
{
    cr_assert_eq(weft_tensor_ndim(t), ndim, "%s: %d dims, want %d", what, weft_tensor_ndim(t),
                 ndim);
    for (int d = 0; d < ndim; d++) {
        cr_assert_eq(weft_tensor_shape(t)[d], shape[d], "%s: dim %d is %lld, want %lld", what, d,
                     (long long)weft_tensor_shape(t)[d], (long long)shape[d]);
    }
}

/* |got - want| <= tol * max(1, |want|); f32 results against torch's f32 ones. */
static void expect_values(const char *what, const weft_tensor_t *t, int64_t n, const double *want64,
                          const float *want32)
{
    const int f32 = weft_tensor_dtype(t) == WEFT_F32;
    const double tol = f32 ? 1e-6 : 1e-13;

    cr_assert_eq(weft_tensor_numel(t), n, "%s: %lld elements, want %lld", what,
                 (long long)weft_tensor_numel(t), (long long)n);
    for (int64_t i = 0; i < n; i++) {
        double want = f32 ? (double)want32[i] : want64[i];
        double got = at(t, i);

        cr_assert(fabs(got - want) <= tol * fmax(1.0, fabs(want)),
                  "%s (%s) element %lld: got %.17g want %.17g", what,
                  weft_dtype_name(weft_tensor_dtype(t)), (long long)i, got, want);
    }
}

static void expect_indices(const char *what, const weft_tensor_t *t, int64_t n, const int64_t *want)
{
    cr_assert_eq(weft_tensor_dtype(t), WEFT_I64, "%s: dtype %s", what,
                 weft_dtype_name(weft_tensor_dtype(t)));
    cr_assert_eq(weft_tensor_numel(t), n);
    for (int64_t i = 0; i < n; i++) {
        cr_assert_eq(((const int64_t *)weft_tensor_data(t))[i], want[i], "%s index %lld", what,
                     (long long)i);
    }
}

static void expect_f32_matches_f64(const char *what, const weft_tensor_t *t32,
                                   const weft_tensor_t *t64)
{
    cr_assert_eq(weft_tensor_dtype(t32), WEFT_F32);
    cr_assert_eq(weft_tensor_dtype(t64), WEFT_F64);
    cr_assert_eq(weft_tensor_numel(t32), weft_tensor_numel(t64));
    for (int64_t i = 0; i < weft_tensor_numel(t64); i++) {
        double a = at(t32, i);
        double b = at(t64, i);

        cr_assert(fabs(a - b) <= 1e-5 * fabs(b) + 1e-30, "%s element %lld: f32 %.9g f64 %.17g",
                  what, (long long)i, a, b);
    }
}

static void expect_error(weft_status_t got, weft_status_t want, const char *needle)
{
    cr_assert_eq(got, want, "status %s, want %s (%s)", weft_strerror(got), weft_strerror(want),
                 weft_last_error());
    cr_assert(strstr(weft_last_error(), needle) != NULL, "error text \"%s\" lacks \"%s\"",
              weft_last_error(), needle);
}

/* ---- the ops as gradcheck functions ---------------------------------------------------------- */

typedef struct {
    int mean;
    int n_dims;
    int dims[WEFT_MAX_DIMS];
    int keepdim;
} sumarg_t;

static weft_status_t gc_sum(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    const sumarg_t *s = arg;

    return (s->mean ? weft_op_mean : weft_op_sum)(in[0], s->n_dims, s->dims, s->keepdim, out_p);
}

typedef struct {
    int op; /* 0 max, 1 softmax, 2 log_softmax */
    int dim;
    int keepdim;
} dimarg_t;

static weft_status_t gc_dim(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    const dimarg_t *d = arg;
    weft_tensor_t *idx = NULL;
    weft_status_t st;

    switch (d->op) {
    case 0:
        st = weft_op_max(in[0], d->dim, d->keepdim, out_p, &idx);
        weft_tensor_release(idx);
        return st;
    case 1:
        return weft_op_softmax(in[0], d->dim, out_p);
    default:
        return weft_op_log_softmax(in[0], d->dim, out_p);
    }
}

typedef struct {
    weft_reduction_t reduction;
    weft_tensor_t *labels;
} lossarg_t;

static weft_status_t gc_ce(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    const lossarg_t *l = arg;

    return weft_op_cross_entropy(in[0], l->labels, l->reduction, out_p);
}

static weft_status_t gc_mse(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    return weft_op_mse_loss(in[0], in[1], ((const lossarg_t *)arg)->reduction, out_p);
}

/* ---- gradient checks ------------------------------------------------------------------------- */

TestSuite(ops_reduce, .timeout = 60);

Test(ops_reduce, grad_sum_mean)
{
    const int64_t s[] = {2, 3, 4};
    const sumarg_t cases[] = {
        {0, 0, {0}, 0},       {0, 1, {1}, 0},  {0, 1, {1}, 1},      {0, 2, {0, 2}, 0},
        {0, 2, {2, 0}, 1},    {0, 1, {-1}, 0}, {0, 2, {-3, -1}, 1}, {0, 3, {0, 1, 2}, 1},
        {1, 0, {0}, 0},       {1, 1, {0}, 1},  {1, 2, {-1, 1}, 0},  {1, 1, {-2}, 1},
        {1, 3, {2, 1, 0}, 0},
    };
    weft_rng_t rng;

    weft_rng_init(&rng, 41, 0);
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        weft_tensor_t *a = gc_rand(&rng, 3, s, -2, 2, 1);

        gradcheck(cases[k].mean ? "mean" : "sum", gc_sum, (void *)&cases[k], 1, &a, &rng);
        weft_tensor_release(a);
    }
}

Test(ops_reduce, grad_sum_scalar_and_size_one_dims)
{
    const int64_t s[] = {3, 1, 2};
    const sumarg_t all = {0, 0, {0}, 0};
    const sumarg_t mid = {1, 1, {1}, 0};
    const sumarg_t last = {0, 1, {-1}, 1};
    weft_rng_t rng;

    weft_rng_init(&rng, 43, 0);
    weft_tensor_t *sc = gc_rand(&rng, 0, NULL, -1, 1, 1);
    weft_tensor_t *a = gc_rand(&rng, 3, s, -1, 1, 1);
    gradcheck("sum of a scalar", gc_sum, (void *)&all, 1, &sc, &rng);
    gradcheck("mean over a size-1 dim", gc_sum, (void *)&mid, 1, &a, &rng);
    gradcheck("sum over the last dim", gc_sum, (void *)&last, 1, &a, &rng);
    weft_tensor_release(sc);
    weft_tensor_release(a);
}

Test(ops_reduce, grad_max_softmax)
{
    const int64_t s[] = {3, 4, 5};
    weft_rng_t rng;

    weft_rng_init(&rng, 47, 0);
    for (int op = 0; op < 3; op++) {
        for (int dim = -3; dim < 3; dim++) {
            const dimarg_t arg = {op, dim, dim % 2 != 0};
            /* Continuous random values: max ties have probability 0. */
            weft_tensor_t *a = gc_rand(&rng, 3, s, -3, 3, 1);

            gradcheck(op == 0   ? "max"
                      : op == 1 ? "softmax"
                                : "log_softmax",
                      gc_dim, (void *)&arg, 1, &a, &rng);
            weft_tensor_release(a);
        }
    }
}

Test(ops_reduce, grad_losses)
{
    const int64_t sl[] = {6, 5};
    const int64_t sn[] = {6};
    const int64_t labels[] = {4, 0, 2, 2, 1, 3};
    const int64_t sm[] = {3, 2, 4};
    weft_rng_t rng;
    weft_tensor_t *lab = make_i64(1, sn, labels);

    weft_rng_init(&rng, 53, 0);
    for (int r = 0; r < 3; r++) {
        lossarg_t arg = {(weft_reduction_t)r, lab};
        weft_tensor_t *x = gc_rand(&rng, 2, sl, -4, 4, 1);
        weft_tensor_t *a = gc_rand(&rng, 3, sm, -2, 2, 1);
        weft_tensor_t *b = gc_rand(&rng, 3, sm, -2, 2, 1);

        gradcheck("cross_entropy", gc_ce, &arg, 1, &x, &rng);
        gradcheck("mse_loss", gc_mse, &arg, 2, (weft_tensor_t *[]){a, b}, &rng);
        cr_assert_eq(weft_tensor_set_requires_grad(a, 0), WEFT_OK);
        gradcheck("mse_loss (b only)", gc_mse, &arg, 2, (weft_tensor_t *[]){a, b}, &rng);
        weft_tensor_release(x);
        weft_tensor_release(a);
        weft_tensor_release(b);
    }
    weft_tensor_release(lab);
}

/* Large logits: the fused backward stays finite and matches softmax - onehot. */
Test(ops_reduce, cross_entropy_stable)
{
    const int64_t s[] = {2, 3};
    const int64_t sn[] = {2};
    const double big[] = {1000, -1000, 0, -800, 800, 799};
    const int64_t labels[] = {0, 2};
    weft_tensor_t *x = make(WEFT_F32, 2, s, big);
    weft_tensor_t *lab = make_i64(1, sn, labels);
    weft_tensor_t *loss = NULL;

    cr_assert_eq(weft_tensor_set_requires_grad(x, 1), WEFT_OK);
    cr_assert_eq(weft_op_cross_entropy(x, lab, WEFT_REDUCTION_SUM, &loss), WEFT_OK);
    /* Row 0: 0 (its label is far ahead); row 1: 800 + log(1 + exp(-1)) - 799. */
    cr_assert_float_eq(at(loss, 0), 1 + log1p(exp(-1.0)), 1e-5, "loss %.9g", at(loss, 0));
    cr_assert_eq(weft_backward(loss, NULL, 0), WEFT_OK, "%s", weft_last_error());
    weft_tensor_t *g = weft_tensor_grad(x);
    cr_assert_not_null(g);
    const double p = 1 / (1 + exp(-1.0));
    const double want[] = {0, 0, 0, 0, p, -p};
    for (int i = 0; i < 6; i++) {
        cr_assert(isfinite(at(g, i)));
        cr_assert_float_eq(at(g, i), want[i], 1e-6, "grad %d: %.9g want %.9g", i, at(g, i),
                           want[i]);
    }
    weft_tensor_release(loss);
    weft_tensor_release(x);
    weft_tensor_release(lab);
}

/* The gradient of max goes to the first maximal element only. */
Test(ops_reduce, max_ties_first_index)
{
    const int64_t s[] = {2, 3};
    const double v[] = {1, 5, 5, 7, 7, 7};
    weft_tensor_t *x = make(WEFT_F64, 2, s, v);
    weft_tensor_t *m = NULL;
    weft_tensor_t *idx = NULL;
    weft_tensor_t *loss = NULL;

    cr_assert_eq(weft_tensor_set_requires_grad(x, 1), WEFT_OK);
    cr_assert_eq(weft_op_max(x, 1, 0, &m, &idx), WEFT_OK);
    cr_assert_eq(((const int64_t *)weft_tensor_data(idx))[0], 1);
    cr_assert_eq(((const int64_t *)weft_tensor_data(idx))[1], 0);
    cr_assert_eq(weft_op_sum(m, 0, NULL, 0, &loss), WEFT_OK);
    cr_assert_eq(weft_backward(loss, NULL, 0), WEFT_OK, "%s", weft_last_error());
    const double want[] = {0, 1, 0, 1, 0, 0};
    for (int i = 0; i < 6; i++) {
        cr_assert_eq(at(weft_tensor_grad(x), i), want[i], "grad %d", i);
    }
    weft_tensor_release(loss);
    weft_tensor_release(m);
    weft_tensor_release(idx);
    weft_tensor_release(x);
}

/* ---- forward values against torch ------------------------------------------------------------ */

#define EXPECT_TORCH(t, R)                                                                         \
    do {                                                                                           \
        expect_shape(#R, (t), R##_NDIM, R##_SHAPE);                                                \
        expect_values(#R, (t), R##_NUMEL, R##_F64, R##_F32);                                       \
    } while (0)

Test(ops_reduce, torch_values)
{
    for (int k = 0; k < 2; k++) {
        const weft_dtype_t dt = k == 0 ? WEFT_F64 : WEFT_F32;
        weft_tensor_t *a = make(dt, RD_A_NDIM, RD_A_SHAPE, RD_A);
        weft_tensor_t *l = make(dt, RD_L_NDIM, RD_L_SHAPE, RD_L);
        weft_tensor_t *lab = make_i64(RD_LAB_NDIM, RD_LAB_SHAPE, RD_LAB);
        weft_tensor_t *m1 = make(dt, RD_M1_NDIM, RD_M1_SHAPE, RD_M1);
        weft_tensor_t *m2 = make(dt, RD_M2_NDIM, RD_M2_SHAPE, RD_M2);
        weft_tensor_t *o = NULL;
        weft_tensor_t *idx = NULL;
        const int d1[] = {1};
        const int d02[] = {0, 2};
        const int dm1[] = {-1};
        const int d0[] = {0};
        const int dm1m3[] = {-1, -3};

        cr_assert_eq(weft_op_sum(a, 0, NULL, 0, &o), WEFT_OK);
        EXPECT_TORCH(o, RD_SUM_ALL);
        weft_tensor_release(o);
        cr_assert_eq(weft_op_sum(a, 1, d1, 0, &o), WEFT_OK);
        EXPECT_TORCH(o, RD_SUM_1);
        weft_tensor_release(o);
        cr_assert_eq(weft_op_sum(a, 2, d02, 1, &o), WEFT_OK);
        EXPECT_TORCH(o, RD_SUM_0_2_KEEP);
        weft_tensor_release(o);
        cr_assert_eq(weft_op_sum(a, 1, dm1, 0, &o), WEFT_OK);
        EXPECT_TORCH(o, RD_SUM_M1);
        weft_tensor_release(o);
        cr_assert_eq(weft_op_mean(a, 0, NULL, 0, &o), WEFT_OK);
        EXPECT_TORCH(o, RD_MEAN_ALL);
        weft_tensor_release(o);
        cr_assert_eq(weft_op_mean(a, 1, d0, 0, &o), WEFT_OK);
        EXPECT_TORCH(o, RD_MEAN_0);
        weft_tensor_release(o);
        cr_assert_eq(weft_op_mean(a, 2, dm1m3, 1, &o), WEFT_OK);
        EXPECT_TORCH(o, RD_MEAN_M1_M3_KEEP);
        weft_tensor_release(o);

        cr_assert_eq(weft_op_max(a, 1, 0, &o, &idx), WEFT_OK);
        EXPECT_TORCH(o, RD_MAX_1);
        expect_indices("max 1", idx, RD_MAX_1_IDX_NUMEL, RD_MAX_1_IDX);
        expect_shape("max 1 indices", idx, RD_MAX_1_NDIM, RD_MAX_1_SHAPE);
        weft_tensor_release(o);
        weft_tensor_release(idx);
        cr_assert_eq(weft_op_max(a, -1, 1, &o, &idx), WEFT_OK);
        EXPECT_TORCH(o, RD_MAX_M1_KEEP);
        expect_indices("max -1", idx, RD_MAX_M1_KEEP_IDX_NUMEL, RD_MAX_M1_KEEP_IDX);
        weft_tensor_release(o);
        weft_tensor_release(idx);
        cr_assert_eq(weft_op_max(a, 0, 0, &o, NULL), WEFT_OK);
        weft_tensor_release(o);
        cr_assert_eq(weft_op_argmax(a, 0, 0, &idx), WEFT_OK);
        expect_indices("argmax 0", idx, RD_ARGMAX_0_NUMEL, RD_ARGMAX_0);
        weft_tensor_release(idx);
        cr_assert_eq(weft_op_argmax(a, 2, 0, &idx), WEFT_OK);
        expect_indices("argmax 2", idx, RD_ARGMAX_2_NUMEL, RD_ARGMAX_2);
        weft_tensor_release(idx);

        cr_assert_eq(weft_op_softmax(a, -1, &o), WEFT_OK);
        EXPECT_TORCH(o, RD_SOFTMAX_M1);
        weft_tensor_release(o);
        cr_assert_eq(weft_op_softmax(a, 1, &o), WEFT_OK);
        EXPECT_TORCH(o, RD_SOFTMAX_1);
        weft_tensor_release(o);
        cr_assert_eq(weft_op_log_softmax(a, -1, &o), WEFT_OK);
        EXPECT_TORCH(o, RD_LOG_SOFTMAX_M1);
        weft_tensor_release(o);
        cr_assert_eq(weft_op_log_softmax(a, 0, &o), WEFT_OK);
        EXPECT_TORCH(o, RD_LOG_SOFTMAX_0);
        weft_tensor_release(o);

        cr_assert_eq(weft_op_cross_entropy(l, lab, WEFT_REDUCTION_MEAN, &o), WEFT_OK);
        EXPECT_TORCH(o, RD_CE_MEAN);
        weft_tensor_release(o);
        cr_assert_eq(weft_op_cross_entropy(l, lab, WEFT_REDUCTION_SUM, &o), WEFT_OK);
        EXPECT_TORCH(o, RD_CE_SUM);
        weft_tensor_release(o);
        cr_assert_eq(weft_op_cross_entropy(l, lab, WEFT_REDUCTION_NONE, &o), WEFT_OK);
        EXPECT_TORCH(o, RD_CE_NONE);
        weft_tensor_release(o);
        cr_assert_eq(weft_op_mse_loss(m1, m2, WEFT_REDUCTION_MEAN, &o), WEFT_OK);
        EXPECT_TORCH(o, RD_MSE_MEAN);
        weft_tensor_release(o);
        cr_assert_eq(weft_op_mse_loss(m1, m2, WEFT_REDUCTION_SUM, &o), WEFT_OK);
        EXPECT_TORCH(o, RD_MSE_SUM);
        weft_tensor_release(o);
        cr_assert_eq(weft_op_mse_loss(m1, m2, WEFT_REDUCTION_NONE, &o), WEFT_OK);
        EXPECT_TORCH(o, RD_MSE_NONE);
        weft_tensor_release(o);

        weft_tensor_release(a);
        weft_tensor_release(l);
        weft_tensor_release(lab);
        weft_tensor_release(m1);
        weft_tensor_release(m2);
    }
}

/* ---- f32 against f64 ------------------------------------------------------------------------- */

/* Runs op @p k on @p x (and @p y, @p lab) into *o_p. */
static weft_status_t run_op(int k, weft_tensor_t *x, weft_tensor_t *y, weft_tensor_t *lab,
                            weft_tensor_t **o_p)
{
    const int d1[] = {1};
    const int d02[] = {0, 2};

    switch (k) {
    case 0:
        return weft_op_sum(x, 0, NULL, 0, o_p);
    case 1:
        return weft_op_sum(x, 1, d1, 1, o_p);
    case 2:
        return weft_op_mean(x, 2, d02, 0, o_p);
    case 3:
        return weft_op_max(x, 2, 0, o_p, NULL);
    case 4:
        return weft_op_softmax(x, -1, o_p);
    case 5:
        return weft_op_softmax(x, 1, o_p);
    case 6:
        return weft_op_log_softmax(x, -1, o_p);
    case 7:
        return weft_op_log_softmax(x, 0, o_p);
    case 8:
    case 9:
    case 10: {
        weft_tensor_t *v = NULL;
        const int64_t s[] = {weft_tensor_shape(x)[0] * weft_tensor_shape(x)[1],
                             weft_tensor_shape(x)[2]};
        weft_status_t st = weft_tensor_view(x, 2, s, &v);

        if (st == WEFT_OK) {
            st = weft_op_cross_entropy(v, lab, (weft_reduction_t)(k - 8), o_p);
        }
        weft_tensor_release(v);
        return st;
    }
    default:
        return weft_op_mse_loss(x, y, (weft_reduction_t)(k - 11), o_p);
    }
}

Test(ops_reduce, f32_matches_f64)
{
    const int64_t s[] = {6, 9, 40};
    const int64_t sn[] = {54};
    int64_t labels[54];
    weft_rng_t rng;

    weft_rng_init(&rng, 59, 0);
    for (int i = 0; i < 54; i++) {
        labels[i] = (int64_t)weft_rng_below(&rng, 40);
    }
    weft_tensor_t *lab = make_i64(1, sn, labels);
    weft_tensor_t *x = gc_rand(&rng, 3, s, -5, 5, 0);
    weft_tensor_t *y = gc_rand(&rng, 3, s, -5, 5, 0);
    round_to_f32(x);
    round_to_f32(y);
    weft_tensor_t *x32 = make(WEFT_F32, 3, s, weft_tensor_data(x));
    weft_tensor_t *y32 = make(WEFT_F32, 3, s, weft_tensor_data(y));

    for (int k = 0; k < 14; k++) {
        weft_tensor_t *o64 = NULL;
        weft_tensor_t *o32 = NULL;
        char what[32];

        snprintf(what, sizeof(what), "op %d", k);
        cr_assert_eq(run_op(k, x, y, lab, &o64), WEFT_OK, "%s: %s", what, weft_last_error());
        cr_assert_eq(run_op(k, x32, y32, lab, &o32), WEFT_OK, "%s: %s", what, weft_last_error());
        expect_f32_matches_f64(what, o32, o64);
        weft_tensor_release(o64);
        weft_tensor_release(o32);
    }
    weft_tensor_release(x);
    weft_tensor_release(y);
    weft_tensor_release(x32);
    weft_tensor_release(y32);
    weft_tensor_release(lab);
}

/* Rows long enough for the blocked (vectorised) loops, with large logits. */
Test(ops_reduce, f32_matches_f64_long_rows)
{
    const int64_t s[] = {4, 300};
    const int64_t sn[] = {4};
    const int64_t labels[] = {0, 299, 150, 7};
    weft_rng_t rng;

    weft_rng_init(&rng, 61, 0);
    weft_tensor_t *lab = make_i64(1, sn, labels);
    weft_tensor_t *x = gc_rand(&rng, 2, s, -30, 30, 0);
    round_to_f32(x);
    weft_tensor_t *x32 = make(WEFT_F32, 2, s, weft_tensor_data(x));

    for (int k = 0; k < 7; k++) {
        weft_tensor_t *o[2] = {NULL, NULL};

        for (int d = 0; d < 2; d++) {
            weft_tensor_t *in = d == 0 ? x : x32;
            weft_status_t st;

            switch (k) {
            case 0:
                st = weft_op_softmax(in, -1, &o[d]);
                break;
            case 1:
                st = weft_op_log_softmax(in, 1, &o[d]);
                break;
            case 2:
                st = weft_op_softmax(in, 0, &o[d]);
                break;
            case 3:
                st = weft_op_log_softmax(in, 0, &o[d]);
                break;
            case 4:
                st = weft_op_cross_entropy(in, lab, WEFT_REDUCTION_NONE, &o[d]);
                break;
            case 5:
                st = weft_op_sum(in, 0, NULL, 0, &o[d]);
                break;
            default:
                st = weft_op_mean(in, 1, (const int[]){-1}, 1, &o[d]);
                break;
            }
            cr_assert_eq(st, WEFT_OK, "op %d: %s", k, weft_last_error());
        }
        /* Probabilities far below 1 carry the f32 rounding of x - max: compare them loosely. */
        for (int64_t i = 0; i < weft_tensor_numel(o[0]); i++) {
            double a = at(o[1], i);
            double b = at(o[0], i);

            cr_assert(fabs(a - b) <= 1e-5 * fabs(b) + 1e-7,
                      "op %d element %lld: f32 %.9g f64 %.17g", k, (long long)i, a, b);
        }
        weft_tensor_release(o[0]);
        weft_tensor_release(o[1]);
    }
    weft_tensor_release(x);
    weft_tensor_release(x32);
    weft_tensor_release(lab);
}

/* ---- edges ----------------------------------------------------------------------------------- */

Test(ops_reduce, empty_and_scalar)
{
    const int64_t s30[] = {3, 0};
    weft_tensor_t *e = NULL;
    weft_tensor_t *sc = NULL;
    weft_tensor_t *o = NULL;
    const int d1[] = {1};
    const int d0[] = {0};

    cr_assert_eq(weft_tensor_create(WEFT_F32, 2, s30, &e), WEFT_OK);
    cr_assert_eq(weft_op_sum(e, 1, d1, 0, &o), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(weft_tensor_numel(o), 3);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(at(o, i), 0.0);
    }
    weft_tensor_release(o);
    cr_assert_eq(weft_op_mean(e, 0, NULL, 0, &o), WEFT_OK);
    cr_assert(isnan(at(o, 0)), "mean of nothing is NaN (as torch)");
    weft_tensor_release(o);
    cr_assert_eq(weft_op_softmax(e, 1, &o), WEFT_OK);
    cr_assert_eq(weft_tensor_numel(o), 0);
    weft_tensor_release(o);

    cr_assert_eq(weft_tensor_create(WEFT_F64, 0, NULL, &sc), WEFT_OK);
    cr_assert_eq(weft_tensor_fill(sc, 2.5), WEFT_OK);
    cr_assert_eq(weft_op_sum(sc, 1, d0, 0, &o), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(weft_tensor_ndim(o), 0);
    cr_assert_eq(at(o, 0), 2.5);
    weft_tensor_release(o);
    cr_assert_eq(weft_op_softmax(sc, -1, &o), WEFT_OK);
    cr_assert_eq(at(o, 0), 1.0);
    weft_tensor_release(o);
    weft_tensor_release(sc);
    weft_tensor_release(e);
}

/* ---- errors ---------------------------------------------------------------------------------- */

Test(ops_reduce, errors)
{
    const int64_t s234[] = {2, 3, 4};
    const int64_t s20[] = {2, 0};
    const int64_t s3[] = {3};
    const int64_t s2[] = {2};
    const int64_t s35[] = {3, 5};
    const int64_t good[] = {0, 4, 1};
    const int64_t bad_hi[] = {0, 5, 1};
    const int64_t bad_neg[] = {-1, 0, 0};
    const int d3[] = {3};
    const int dm4[] = {-4};
    const int drep[] = {1, -2};
    weft_tensor_t *a = NULL;
    weft_tensor_t *a64 = NULL;
    weft_tensor_t *e = NULL;
    weft_tensor_t *ints = NULL;
    weft_tensor_t *logits = NULL;
    weft_tensor_t *out = NULL;
    weft_tensor_t *idx = NULL;

    cr_assert_eq(weft_tensor_create(WEFT_F32, 3, s234, &a), WEFT_OK);
    cr_assert_eq(weft_tensor_create(WEFT_F64, 3, s234, &a64), WEFT_OK);
    cr_assert_eq(weft_tensor_create(WEFT_F32, 2, s20, &e), WEFT_OK);
    cr_assert_eq(weft_tensor_create(WEFT_I64, 1, s3, &ints), WEFT_OK);
    cr_assert_eq(weft_tensor_create(WEFT_F32, 2, s35, &logits), WEFT_OK);
    weft_tensor_t *lab_good = make_i64(1, s3, good);
    weft_tensor_t *lab_hi = make_i64(1, s3, bad_hi);
    weft_tensor_t *lab_neg = make_i64(1, s3, bad_neg);
    weft_tensor_t *lab_short = make_i64(1, s2, good);

    expect_error(weft_op_sum(a, 1, d3, 0, &out), WEFT_ERR_INVALID_ARG,
                 "sum: dim 3 is out of range for a tensor of 3 dims");
    expect_error(weft_op_mean(a, 1, dm4, 0, &out), WEFT_ERR_INVALID_ARG, "dim -4 is out of range");
    expect_error(weft_op_sum(a, 2, drep, 0, &out), WEFT_ERR_INVALID_ARG, "sum: dim -2 is repeated");
    expect_error(weft_op_sum(a, 1, NULL, 0, &out), WEFT_ERR_INVALID_ARG, "sum: bad dims");
    expect_error(weft_op_sum(ints, 0, NULL, 0, &out), WEFT_ERR_DTYPE, "sum: dtype i64");
    expect_error(weft_op_softmax(a, 3, &out), WEFT_ERR_INVALID_ARG, "softmax: dim 3");
    expect_error(weft_op_log_softmax(a, -4, &out), WEFT_ERR_INVALID_ARG, "log_softmax: dim -4");
    expect_error(weft_op_max(a, 5, 0, &out, &idx), WEFT_ERR_INVALID_ARG, "max: dim 5");
    expect_error(weft_op_max(e, 1, 0, &out, &idx), WEFT_ERR_SHAPE, "max: dim 1 has size 0");
    expect_error(weft_op_argmax(e, -1, 0, &out), WEFT_ERR_SHAPE, "argmax: dim -1 has size 0");
    expect_error(weft_op_argmax(ints, 0, 0, &out), WEFT_ERR_DTYPE, "argmax: dtype i64");
    expect_error(weft_op_max(a, 0, 0, NULL, &idx), WEFT_ERR_INVALID_ARG, "max: NULL output");
    expect_error(weft_op_sum(NULL, 0, NULL, 0, &out), WEFT_ERR_INVALID_ARG, "sum: NULL tensor");

    expect_error(weft_op_cross_entropy(logits, lab_hi, WEFT_REDUCTION_MEAN, &out),
                 WEFT_ERR_INVALID_ARG, "label 5 at position 1 is out of range [0, 5)");
    expect_error(weft_op_cross_entropy(logits, lab_neg, WEFT_REDUCTION_SUM, &out),
                 WEFT_ERR_INVALID_ARG, "label -1 at position 0");
    expect_error(weft_op_cross_entropy(logits, lab_short, WEFT_REDUCTION_SUM, &out), WEFT_ERR_SHAPE,
                 "labels [2] do not match logits [3, 5]");
    expect_error(weft_op_cross_entropy(a, lab_good, WEFT_REDUCTION_SUM, &out), WEFT_ERR_SHAPE,
                 "logits must be [N, C], not [2, 3, 4]");
    expect_error(weft_op_cross_entropy(logits, logits, WEFT_REDUCTION_SUM, &out), WEFT_ERR_DTYPE,
                 "labels must be i64, not f32");
    expect_error(weft_op_cross_entropy(logits, NULL, WEFT_REDUCTION_SUM, &out),
                 WEFT_ERR_INVALID_ARG, "NULL labels");
    expect_error(weft_op_cross_entropy(logits, lab_good, (weft_reduction_t)7, &out),
                 WEFT_ERR_INVALID_ARG, "unknown reduction 7");
    expect_error(weft_op_mse_loss(a, a64, WEFT_REDUCTION_MEAN, &out), WEFT_ERR_DTYPE,
                 "mse_loss: dtypes f32 and f64 differ");
    expect_error(weft_op_mse_loss(a, logits, WEFT_REDUCTION_MEAN, &out), WEFT_ERR_SHAPE,
                 "mse_loss: shapes [2, 3, 4] and [3, 5] differ");
    cr_assert_null(out, "an output was set on failure");
    cr_assert_null(idx, "an output was set on failure");

    /* A valid call after all that still works. */
    cr_assert_eq(weft_op_cross_entropy(logits, lab_good, WEFT_REDUCTION_MEAN, &out), WEFT_OK);
    cr_assert_float_eq(at(out, 0), log(5.0), 1e-6);
    weft_tensor_release(out);

    weft_tensor_release(a);
    weft_tensor_release(a64);
    weft_tensor_release(e);
    weft_tensor_release(ints);
    weft_tensor_release(logits);
    weft_tensor_release(lab_good);
    weft_tensor_release(lab_hi);
    weft_tensor_release(lab_neg);
    weft_tensor_release(lab_short);
}
