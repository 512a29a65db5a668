/*
 * The CNN operations: conv2d, max/avg/adaptive pooling, batch_norm2d, dropout2d, flatten and
 * nll_loss, and the Conv2d and BatchNorm2d modules. Gradients by gradcheck in f64; forward values,
 * gradients and running statistics against torch in f64 and f32 (data/ops_conv_table.h, made by
 * data/gen_ops_conv.py); the error statuses and texts; and a printed timing of conv2d.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <criterion/criterion.h>

#include "../core/counting_alloc.h"
#include "gradcheck.h"

#include "data/ops_conv_table.h"

#include <weft/weft.h>

#define N_OF(a) (sizeof(a) / sizeof((a)[0]))

/* ---- helpers --------------------------------------------------------------------------------- */

static weft_tensor_t *from_tt(const tt_t *t, weft_dtype_t dt, int rg)
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
    if (rg) {
        cr_assert_eq(weft_tensor_set_requires_grad(x, 1), WEFT_OK);
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
static void expect_tt(const weft_tensor_t *got, const tt_t *want, double tol, const char *what,
                      const char *name)
{
    cr_assert_not_null(got, "%s: %s missing", name, what);
    cr_assert_eq(weft_tensor_ndim(got), want->ndim, "%s: %s: ndim %d, want %d", name, what,
                 weft_tensor_ndim(got), want->ndim);
    for (int i = 0; i < want->ndim; i++) {
        cr_assert_eq(weft_tensor_shape(got)[i], want->shape[i], "%s: %s: dim %d is %lld, want %lld",
                     name, what, i, (long long)weft_tensor_shape(got)[i],
                     (long long)want->shape[i]);
    }
    for (int64_t i = 0; i < weft_tensor_numel(got); i++) {
        double w = want->data[i];

        cr_assert(fabs(elem(got, i) - w) <= tol * fmax(1.0, fabs(w)),
                  "%s: %s: element %lld is %.10g, torch %.10g", name, what, (long long)i,
                  elem(got, i), w);
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

static double tol_of(weft_dtype_t dt)
{
    return dt == WEFT_F64 ? 1e-10 : 1e-4;
}

/* ---- conv2d ---------------------------------------------------------------------------------- */

typedef struct {
    int64_t stride[2];
    int64_t padding[2];
    int64_t dilation[2];
    int64_t groups;
} conv_arg_t;

static weft_status_t f_conv(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    const conv_arg_t *a = arg;

    return weft_op_conv2d(in[0], in[1], in[2], a->stride, a->padding, a->dilation, a->groups,
                          out_p);
}

TestSuite(conv, .init = use_counting);

Test(conv, conv2d_grad)
{
    static const struct {
        const char *name;
        int64_t xs[4];
        int64_t o, kh, kw;
        conv_arg_t a;
        int bias;
    } cases[] = {
        {"3x3", {2, 2, 5, 4}, 3, 3, 3, {{1, 1}, {0, 0}, {1, 1}, 1}, 1},
        {"stride 2x1 padding 1x2 no bias", {1, 2, 5, 6}, 2, 3, 2, {{2, 1}, {1, 2}, {1, 1}, 1}, 0},
        {"dilation 2", {1, 1, 7, 6}, 2, 2, 3, {{1, 1}, {1, 1}, {2, 2}, 1}, 1},
        {"groups 2", {2, 4, 4, 5}, 4, 3, 3, {{1, 2}, {1, 1}, {1, 1}, 2}, 1},
        {"depthwise", {1, 3, 5, 5}, 6, 2, 2, {{2, 2}, {1, 0}, {1, 1}, 3}, 1},
        {"1x1 direct", {2, 3, 3, 3}, 2, 1, 1, {{1, 1}, {0, 0}, {1, 1}, 1}, 1},
        {"1x1 strided", {1, 2, 5, 4}, 2, 1, 1, {{2, 3}, {1, 1}, {1, 1}, 1}, 1},
    };
    weft_rng_t rng;

    weft_rng_init(&rng, 21, 0);
    for (size_t c = 0; c < N_OF(cases); c++) {
        const int64_t ws[4] = {cases[c].o, cases[c].xs[1] / cases[c].a.groups, cases[c].kh,
                               cases[c].kw};
        weft_tensor_t *x = gc_rand(&rng, 4, cases[c].xs, -1, 1, 1);
        weft_tensor_t *w = gc_rand(&rng, 4, ws, -1, 1, 1);
        weft_tensor_t *b = cases[c].bias ? gc_rand(&rng, 1, &cases[c].o, -1, 1, 1) : NULL;
        conv_arg_t a = cases[c].a;

        gradcheck(cases[c].name, f_conv, &a, 3, (weft_tensor_t *[]){x, w, b}, &rng);
        /* Only the weights (x a constant), then only x. */
        cr_assert_eq(weft_tensor_set_requires_grad(x, 0), WEFT_OK);
        gradcheck(cases[c].name, f_conv, &a, 3, (weft_tensor_t *[]){x, w, b}, &rng);
        cr_assert_eq(weft_tensor_set_requires_grad(x, 1), WEFT_OK);
        cr_assert_eq(weft_tensor_set_requires_grad(w, 0), WEFT_OK);
        if (b != NULL) {
            cr_assert_eq(weft_tensor_set_requires_grad(b, 0), WEFT_OK);
        }
        gradcheck(cases[c].name, f_conv, &a, 3, (weft_tensor_t *[]){x, w, b}, &rng);
        weft_tensor_release(x);
        weft_tensor_release(w);
        weft_tensor_release(b);
    }
    check_balanced();
}

Test(conv, conv2d_matches_torch)
{
    for (size_t c = 0; c < N_OF(conv_cases); c++) {
        const conv_case_t *cc = &conv_cases[c];

        for (int d = 0; d < 2; d++) {
            weft_dtype_t dt = d == 0 ? WEFT_F64 : WEFT_F32;
            weft_tensor_t *x = from_tt(&cc->x, dt, 1);
            weft_tensor_t *w = from_tt(&cc->w, dt, 1);
            weft_tensor_t *b = cc->has_b ? from_tt(&cc->b, dt, 1) : NULL;
            weft_tensor_t *gy = from_tt(&cc->gy, dt, 0);
            weft_tensor_t *out = NULL;

            cr_assert_eq(
                weft_op_conv2d(x, w, b, cc->stride, cc->padding, cc->dilation, cc->groups, &out),
                WEFT_OK, "%s: %s", cc->name, weft_last_error());
            cr_assert_eq(weft_tensor_dtype(out), dt);
            cr_assert_str_eq(weft_tensor_grad_fn_name(out), "Conv2dBackward");
            expect_tt(out, &cc->out, tol_of(dt), "out", cc->name);
            cr_assert_eq(weft_backward(out, gy, 0), WEFT_OK, "%s", weft_last_error());
            expect_tt(weft_tensor_grad(x), &cc->gx, tol_of(dt), "grad x", cc->name);
            expect_tt(weft_tensor_grad(w), &cc->gw, tol_of(dt), "grad weight", cc->name);
            if (b != NULL) {
                expect_tt(weft_tensor_grad(b), &cc->gb, tol_of(dt), "grad bias", cc->name);
            }
            weft_tensor_release(out);
            weft_tensor_release(gy);
            weft_tensor_release(x);
            weft_tensor_release(w);
            weft_tensor_release(b);
        }
    }
    check_balanced();
}

/* conv2d without autograd against a direct 7-loop convolution, on sizes where every edge case
 * of the column ranges shows up. */
Test(conv, conv2d_against_naive)
{
    const int64_t xs[4] = {2, 4, 13, 11};
    const int64_t ws[4] = {6, 2, 4, 3};
    const int64_t st[2] = {3, 2};
    const int64_t pd[2] = {2, 3};
    const int64_t dl[2] = {2, 1};
    const int64_t g = 2;
    const int64_t oh = (13 + 4 - 2 * 3 - 1) / 3 + 1;
    const int64_t ow = (11 + 6 - 2 - 1) / 2 + 1;
    weft_tensor_t *x;
    weft_tensor_t *w;
    weft_tensor_t *out = NULL;
    weft_rng_t rng;

    weft_rng_init(&rng, 22, 0);
    x = gc_rand(&rng, 4, xs, -1, 1, 0);
    w = gc_rand(&rng, 4, ws, -1, 1, 0);
    cr_assert_eq(weft_op_conv2d(x, w, NULL, st, pd, dl, g, &out), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(weft_tensor_shape(out)[2], oh);
    cr_assert_eq(weft_tensor_shape(out)[3], ow);
    for (int64_t n = 0; n < 2; n++) {
        for (int64_t o = 0; o < 6; o++) {
            for (int64_t i = 0; i < oh; i++) {
                for (int64_t j = 0; j < ow; j++) {
                    double acc = 0;
                    int64_t grp = o / 3;

                    for (int64_t c = 0; c < 2; c++) {
                        for (int64_t ki = 0; ki < 4; ki++) {
                            for (int64_t kj = 0; kj < 3; kj++) {
                                int64_t ih = i * 3 - 2 + ki * 2;
                                int64_t iw = j * 2 - 3 + kj;

                                if (ih < 0 || ih >= 13 || iw < 0 || iw >= 11) {
                                    continue;
                                }
                                acc += elem(x, ((n * 4 + grp * 2 + c) * 13 + ih) * 11 + iw) *
                                       elem(w, ((o * 2 + c) * 4 + ki) * 3 + kj);
                            }
                        }
                    }
                    cr_assert(fabs(elem(out, ((n * 6 + o) * oh + i) * ow + j) - acc) < 1e-12,
                              "[%lld, %lld, %lld, %lld]", (long long)n, (long long)o, (long long)i,
                              (long long)j);
                }
            }
        }
    }
    weft_tensor_release(out);
    weft_tensor_release(x);
    weft_tensor_release(w);
    check_balanced();
}

/* ---- pooling --------------------------------------------------------------------------------- */

typedef struct {
    int64_t kernel[2];
    int64_t stride[2];
    int64_t padding[2];
    int include_pad;
} pool_arg_t;

static weft_status_t f_max_pool(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    const pool_arg_t *a = arg;

    return weft_op_max_pool2d(in[0], a->kernel, a->stride, a->padding, out_p);
}

static weft_status_t f_avg_pool(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    const pool_arg_t *a = arg;

    return weft_op_avg_pool2d(in[0], a->kernel, a->stride, a->padding, a->include_pad, out_p);
}

static weft_status_t f_adaptive(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    return weft_op_adaptive_avg_pool2d(in[0], arg, out_p);
}

Test(conv, pool_grads)
{
    static const pool_arg_t args[] = {
        {{3, 3}, {2, 2}, {1, 1}, 1},
        {{2, 3}, {1, 2}, {1, 1}, 0},
        {{2, 2}, {2, 2}, {0, 0}, 1},
        {{3, 2}, {1, 1}, {1, 0}, 0},
    };
    static const int64_t outs[][2] = {{2, 3}, {3, 3}, {1, 1}, {7, 4}};
    const int64_t xs[4] = {2, 2, 5, 6};
    weft_rng_t rng;

    weft_rng_init(&rng, 23, 0);
    for (size_t c = 0; c < N_OF(args); c++) {
        weft_tensor_t *x = gc_rand(&rng, 4, xs, -1, 1, 1);
        pool_arg_t a = args[c];
        int64_t o[2] = {outs[c][0], outs[c][1]};

        gradcheck("max_pool2d", f_max_pool, &a, 1, &x, &rng);
        gradcheck("avg_pool2d", f_avg_pool, &a, 1, &x, &rng);
        gradcheck("adaptive_avg_pool2d", f_adaptive, o, 1, &x, &rng);
        weft_tensor_release(x);
    }
    check_balanced();
}

/* Forward values and the gradient of (out * gy).sum() against torch. */
static void check_pool_case(const pool_case_t *pc, int avg)
{
    for (int d = 0; d < 2; d++) {
        weft_dtype_t dt = d == 0 ? WEFT_F64 : WEFT_F32;
        weft_tensor_t *x = from_tt(&pc->x, dt, 1);
        weft_tensor_t *gy = from_tt(&pc->gy, dt, 0);
        weft_tensor_t *out = NULL;
        weft_status_t st;

        st = avg ? weft_op_avg_pool2d(x, pc->kernel, pc->stride, pc->padding, pc->include_pad, &out)
                 : weft_op_max_pool2d(x, pc->kernel, pc->stride, pc->padding, &out);
        cr_assert_eq(st, WEFT_OK, "%s: %s", pc->name, weft_last_error());
        cr_assert_str_eq(weft_tensor_grad_fn_name(out),
                         avg ? "AvgPool2dBackward" : "MaxPool2dBackward");
        expect_tt(out, &pc->out, tol_of(dt), "out", pc->name);
        cr_assert_eq(weft_backward(out, gy, 0), WEFT_OK, "%s", weft_last_error());
        expect_tt(weft_tensor_grad(x), &pc->gx, tol_of(dt), "grad x", pc->name);
        weft_tensor_release(out);
        weft_tensor_release(gy);
        weft_tensor_release(x);
    }
}

Test(conv, max_pool2d_matches_torch)
{
    /* The "ties" cases check that the gradient goes to the first maximal element, as torch. */
    for (size_t c = 0; c < N_OF(max_pool_cases); c++) {
        check_pool_case(&max_pool_cases[c], 0);
    }
    check_balanced();
}

Test(conv, avg_pool2d_matches_torch)
{
    for (size_t c = 0; c < N_OF(avg_pool_cases); c++) {
        check_pool_case(&avg_pool_cases[c], 1);
    }
    check_balanced();
}

Test(conv, adaptive_avg_pool2d_matches_torch)
{
    for (size_t c = 0; c < N_OF(adaptive_cases); c++) {
        const adaptive_case_t *ac = &adaptive_cases[c];

        for (int d = 0; d < 2; d++) {
            weft_dtype_t dt = d == 0 ? WEFT_F64 : WEFT_F32;
            weft_tensor_t *x = from_tt(&ac->x, dt, 1);
            weft_tensor_t *gy = from_tt(&ac->gy, dt, 0);
            weft_tensor_t *out = NULL;

            cr_assert_eq(weft_op_adaptive_avg_pool2d(x, ac->out_hw, &out), WEFT_OK, "%s: %s",
                         ac->name, weft_last_error());
            expect_tt(out, &ac->out, tol_of(dt), "out", ac->name);
            cr_assert_eq(weft_backward(out, gy, 0), WEFT_OK, "%s", weft_last_error());
            expect_tt(weft_tensor_grad(x), &ac->gx, tol_of(dt), "grad x", ac->name);
            weft_tensor_release(out);
            weft_tensor_release(gy);
            weft_tensor_release(x);
        }
    }
    check_balanced();
}

Test(conv, max_pool2d_nan_and_defaults)
{
    const int64_t xs[4] = {1, 1, 2, 2};
    const int64_t k[2] = {2, 2};
    weft_tensor_t *x = zeros(WEFT_F64, 4, xs);
    weft_tensor_t *out = NULL;
    double *xd = weft_tensor_data(x);

    /* A NaN is the maximum of its window (torch); stride NULL is the kernel. */
    xd[0] = 1;
    xd[1] = NAN;
    xd[2] = 5;
    xd[3] = 2;
    cr_assert_eq(weft_op_max_pool2d(x, k, NULL, NULL, &out), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(weft_tensor_numel(out), 1);
    cr_assert(isnan(elem(out, 0)));
    weft_tensor_release(out);
    weft_tensor_release(x);
    check_balanced();
}

/* ---- batch_norm2d ---------------------------------------------------------------------------- */

typedef struct {
    int training;
    weft_tensor_t *rm;
    weft_tensor_t *rv;
} bn_arg_t;

static weft_status_t f_bn(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    const bn_arg_t *a = arg;

    return weft_op_batch_norm2d(in[0], in[1], in[2], a->rm, a->rv, a->training, 0.1, 1e-5, out_p);
}

Test(conv, batch_norm2d_grad)
{
    const int64_t xs[4] = {3, 2, 2, 3};
    const int64_t cs = 2;
    weft_rng_t rng;
    weft_tensor_t *x;
    weft_tensor_t *w;
    weft_tensor_t *b;
    weft_tensor_t *rm;
    weft_tensor_t *rv;
    bn_arg_t train = {1, NULL, NULL};
    bn_arg_t eval;

    weft_rng_init(&rng, 24, 0);
    x = gc_rand(&rng, 4, xs, -2, 2, 1);
    w = gc_rand(&rng, 1, &cs, 0.5, 1.5, 1);
    b = gc_rand(&rng, 1, &cs, -1, 1, 1);
    rm = gc_rand(&rng, 1, &cs, -0.5, 0.5, 0);
    rv = gc_rand(&rng, 1, &cs, 0.5, 2, 0);
    eval = (bn_arg_t){0, rm, rv};
    gradcheck("batch_norm2d training", f_bn, &train, 3, (weft_tensor_t *[]){x, w, b}, &rng);
    gradcheck("batch_norm2d training, no affine", f_bn, &train, 3,
              (weft_tensor_t *[]){x, NULL, NULL}, &rng);
    gradcheck("batch_norm2d training, weight only", f_bn, &train, 3,
              (weft_tensor_t *[]){x, w, NULL}, &rng);
    /* With running statistics given: updated on every call, and the gradient is unchanged. */
    train.rm = rm;
    train.rv = rv;
    gradcheck("batch_norm2d training, running stats", f_bn, &train, 3, (weft_tensor_t *[]){x, w, b},
              &rng);
    gradcheck("batch_norm2d eval", f_bn, &eval, 3, (weft_tensor_t *[]){x, w, b}, &rng);
    cr_assert_eq(weft_tensor_set_requires_grad(x, 0), WEFT_OK);
    gradcheck("batch_norm2d training, x constant", f_bn, &train, 3, (weft_tensor_t *[]){x, w, b},
              &rng);
    weft_tensor_release(x);
    weft_tensor_release(w);
    weft_tensor_release(b);
    weft_tensor_release(rm);
    weft_tensor_release(rv);
    check_balanced();
}

Test(conv, batch_norm2d_matches_torch)
{
    for (size_t c = 0; c < N_OF(bn_cases); c++) {
        const bn_case_t *bc = &bn_cases[c];

        for (int d = 0; d < 2; d++) {
            weft_dtype_t dt = d == 0 ? WEFT_F64 : WEFT_F32;
            double tol = tol_of(dt);
            weft_tensor_t *x = from_tt(&bc->x, dt, 1);
            weft_tensor_t *w = bc->affine ? from_tt(&bc->w, dt, 1) : NULL;
            weft_tensor_t *b = bc->affine ? from_tt(&bc->b, dt, 1) : NULL;
            weft_tensor_t *rm = from_tt(&bc->rm, dt, 0);
            weft_tensor_t *rv = from_tt(&bc->rv, dt, 0);
            weft_tensor_t *gy = from_tt(&bc->gy, dt, 0);
            weft_tensor_t *out = NULL;

            cr_assert_eq(
                weft_op_batch_norm2d(x, w, b, rm, rv, bc->training, bc->momentum, bc->eps, &out),
                WEFT_OK, "%s: %s", bc->name, weft_last_error());
            cr_assert_str_eq(weft_tensor_grad_fn_name(out), "BatchNorm2dBackward");
            expect_tt(out, &bc->out, tol, "out", bc->name);
            expect_tt(rm, &bc->rm_after, tol, "running_mean", bc->name);
            expect_tt(rv, &bc->rv_after, tol, "running_var", bc->name);
            cr_assert_eq(weft_backward(out, gy, 0), WEFT_OK, "%s", weft_last_error());
            /* gx in training is a difference of sums: looser in f32. */
            expect_tt(weft_tensor_grad(x), &bc->gx, dt == WEFT_F64 ? 1e-10 : 1e-3, "grad x",
                      bc->name);
            if (bc->affine) {
                expect_tt(weft_tensor_grad(w), &bc->gw, tol, "grad weight", bc->name);
                expect_tt(weft_tensor_grad(b), &bc->gb, tol, "grad bias", bc->name);
            }
            weft_tensor_release(out);
            weft_tensor_release(gy);
            weft_tensor_release(x);
            weft_tensor_release(w);
            weft_tensor_release(b);
            weft_tensor_release(rm);
            weft_tensor_release(rv);
        }
    }
    check_balanced();
}

/* ---- dropout2d ------------------------------------------------------------------------------- */

static weft_status_t f_dropout2d(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    weft_rng_t rng;

    (void)arg;
    weft_rng_init(&rng, 77, 3); /* the same channels every call */
    return weft_op_dropout2d(in[0], 0.4, 1, &rng, out_p);
}

Test(conv, dropout2d)
{
    const int64_t xs[4] = {8, 16, 3, 5};
    const int64_t plane = 15;
    const double p = 0.25;
    weft_tensor_t *x;
    weft_tensor_t *out = NULL;
    weft_tensor_t *out2 = NULL;
    weft_tensor_t *gy = NULL;
    weft_rng_t rng;
    weft_rng_t replay;
    int dropped = 0;

    weft_rng_init(&rng, 25, 0);
    x = gc_rand(&rng, 4, xs, 0.5, 1.5, 1); /* no zeros of its own */
    weft_rng_init(&rng, 5, 1);
    replay = rng;
    cr_assert_eq(weft_op_dropout2d(x, p, 1, &rng, &out), WEFT_OK, "%s", weft_last_error());
    cr_assert_str_eq(weft_tensor_grad_fn_name(out), "Dropout2dBackward");
    for (int64_t c = 0; c < 8 * 16; c++) {
        /* One uniform per channel in (n, c) order, dropped below p. */
        int drop = weft_rng_uniform(&replay) < p;

        dropped += drop;
        for (int64_t i = 0; i < plane; i++) {
            double got = elem(out, c * plane + i);
            double want = drop ? 0.0 : elem(x, c * plane + i) / (1 - p);

            cr_assert(fabs(got - want) < 1e-15, "channel %lld element %lld: %g, want %g",
                      (long long)c, (long long)i, got, want);
        }
    }
    cr_assert(dropped > 10 && dropped < 60, "%d of 128 channels dropped at p = 0.25", dropped);
    /* The gradient is the same mask and scale. */
    cr_assert_eq(weft_tensor_empty(WEFT_F64, 4, xs, &gy), WEFT_OK);
    cr_assert_eq(weft_tensor_fill(gy, 1.0), WEFT_OK);
    cr_assert_eq(weft_backward(out, gy, 0), WEFT_OK, "%s", weft_last_error());
    for (int64_t i = 0; i < weft_tensor_numel(x); i++) {
        double want = elem(out, i) == 0 ? 0.0 : 1 / (1 - p);

        cr_assert(fabs(elem(weft_tensor_grad(x), i) - want) < 1e-15, "grad element %lld",
                  (long long)i);
    }
    weft_tensor_grad_clear(x);
    weft_tensor_release(out);

    /* Eval mode and p == 0: a copy, nothing drawn; p == 1: zeros. */
    replay = rng;
    cr_assert_eq(weft_op_dropout2d(x, p, 0, NULL, &out), WEFT_OK);
    cr_assert_eq(weft_op_dropout2d(x, 0, 1, &rng, &out2), WEFT_OK);
    cr_assert(weft_tensor_equal(out, x));
    cr_assert(weft_tensor_equal(out2, x));
    cr_assert_eq(memcmp(&rng, &replay, sizeof(rng)), 0);
    weft_tensor_release(out);
    weft_tensor_release(out2);
    cr_assert_eq(weft_op_dropout2d(x, 1, 1, &rng, &out), WEFT_OK);
    for (int64_t i = 0; i < weft_tensor_numel(out); i++) {
        cr_assert_eq(elem(out, i), 0.0);
    }
    weft_tensor_release(out);

    gradcheck("dropout2d", f_dropout2d, NULL, 1, &x, &rng);
    weft_tensor_release(gy);
    weft_tensor_release(x);
    check_balanced();
}

/* ---- flatten --------------------------------------------------------------------------------- */

typedef struct {
    int start;
    int end;
} flat_arg_t;

static weft_status_t f_flatten(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    const flat_arg_t *a = arg;

    return weft_op_flatten(in[0], a->start, a->end, out_p);
}

Test(conv, flatten)
{
    static const struct {
        int start;
        int end;
        int ndim;
        int64_t shape[4];
    } cases[] = {
        {1, -1, 2, {2, 60}},     {0, -1, 1, {120}},       {1, 2, 3, {2, 12, 5}},
        {-2, -1, 3, {2, 3, 20}}, {2, 2, 4, {2, 3, 4, 5}}, {0, 1, 3, {6, 4, 5}},
        {-4, -3, 3, {6, 4, 5}},
    };
    const int64_t xs[4] = {2, 3, 4, 5};
    weft_rng_t rng;
    weft_tensor_t *x;
    weft_tensor_t *s;
    weft_tensor_t *out = NULL;

    weft_rng_init(&rng, 26, 0);
    x = gc_rand(&rng, 4, xs, -1, 1, 1);
    for (size_t c = 0; c < N_OF(cases); c++) {
        flat_arg_t a = {cases[c].start, cases[c].end};

        cr_assert_eq(weft_op_flatten(x, a.start, a.end, &out), WEFT_OK, "%s", weft_last_error());
        cr_assert_eq(weft_tensor_ndim(out), cases[c].ndim, "case %zu", c);
        cr_assert_eq(
            memcmp(weft_tensor_shape(out), cases[c].shape, (size_t)cases[c].ndim * sizeof(int64_t)),
            0, "case %zu", c);
        cr_assert_eq(weft_tensor_data(out), weft_tensor_data(x), "flatten shares storage");
        weft_tensor_release(out);
        gradcheck("flatten", f_flatten, &a, 1, &x, &rng);
    }
    /* A 0-D tensor becomes [1]. */
    s = zeros(WEFT_F32, 0, NULL);
    cr_assert_eq(weft_op_flatten(s, 0, -1, &out), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(weft_tensor_ndim(out), 1);
    cr_assert_eq(weft_tensor_shape(out)[0], 1);
    weft_tensor_release(out);
    out = NULL;
    expect_error(weft_op_flatten(s, 1, -1, &out), WEFT_ERR_INVALID_ARG, "out of range");
    expect_error(weft_op_flatten(x, 2, 1, &out), WEFT_ERR_INVALID_ARG,
                 "start_dim 2 comes after end_dim 1");
    expect_error(weft_op_flatten(x, 0, 4, &out), WEFT_ERR_INVALID_ARG, "out of range");
    expect_error(weft_op_flatten(x, -5, 3, &out), WEFT_ERR_INVALID_ARG, "[2, 3, 4, 5]");
    cr_assert_null(out);
    weft_tensor_release(s);
    weft_tensor_release(x);
    check_balanced();
}

/* ---- nll_loss -------------------------------------------------------------------------------- */

typedef struct {
    weft_tensor_t *target;
    weft_reduction_t reduction;
} nll_arg_t;

static weft_status_t f_nll(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    const nll_arg_t *a = arg;

    return weft_op_nll_loss(in[0], a->target, a->reduction, out_p);
}

static weft_tensor_t *targets(int n, const int64_t *t)
{
    const int64_t s = n;
    weft_tensor_t *x = zeros(WEFT_I64, 1, &s);

    memcpy(weft_tensor_data(x), t, (size_t)n * sizeof(int64_t));
    return x;
}

Test(conv, nll_loss)
{
    const int64_t xs[2] = {5, 4};
    const int64_t t[5] = {3, 0, 1, 3, 2};
    weft_tensor_t *target = targets(5, t);
    weft_rng_t rng;
    weft_tensor_t *x;

    weft_rng_init(&rng, 27, 0);
    x = gc_rand(&rng, 2, xs, -3, 0, 1);
    for (int r = 0; r < 3; r++) {
        nll_arg_t a = {target, (weft_reduction_t)r};

        gradcheck("nll_loss", f_nll, &a, 1, &x, &rng);
    }
    /* nll_loss(log_softmax(z)) is cross_entropy(z). */
    for (int r = 0; r < 3; r++) {
        weft_tensor_t *lsm = NULL;
        weft_tensor_t *nll = NULL;
        weft_tensor_t *ce = NULL;

        cr_assert_eq(weft_op_log_softmax(x, 1, &lsm), WEFT_OK);
        cr_assert_eq(weft_op_nll_loss(lsm, target, (weft_reduction_t)r, &nll), WEFT_OK);
        cr_assert_str_eq(weft_tensor_grad_fn_name(nll), "NllLossBackward");
        cr_assert_eq(weft_op_cross_entropy(x, target, (weft_reduction_t)r, &ce), WEFT_OK);
        cr_assert_eq(weft_tensor_numel(nll), weft_tensor_numel(ce));
        for (int64_t i = 0; i < weft_tensor_numel(ce); i++) {
            cr_assert(fabs(elem(nll, i) - elem(ce, i)) < 1e-12);
        }
        weft_tensor_release(lsm);
        weft_tensor_release(nll);
        weft_tensor_release(ce);
    }
    weft_tensor_release(x);
    weft_tensor_release(target);
    check_balanced();
}

Test(conv, nll_loss_matches_torch)
{
    for (size_t c = 0; c < N_OF(nll_cases); c++) {
        const nll_case_t *nc = &nll_cases[c];
        weft_tensor_t *target = targets(nc->n, nc->target);

        for (int d = 0; d < 2; d++) {
            weft_dtype_t dt = d == 0 ? WEFT_F64 : WEFT_F32;
            weft_tensor_t *lp = from_tt(&nc->log_probs, dt, 0);
            weft_tensor_t *out = NULL;

            cr_assert_eq(weft_op_nll_loss(lp, target, (weft_reduction_t)nc->reduction, &out),
                         WEFT_OK, "%s: %s", nc->name, weft_last_error());
            expect_tt(out, &nc->out, dt == WEFT_F64 ? 1e-12 : 1e-6, "out", nc->name);
            weft_tensor_release(out);
            weft_tensor_release(lp);
        }
        weft_tensor_release(target);
    }
    check_balanced();
}

/* ---- errors ---------------------------------------------------------------------------------- */

Test(conv, conv2d_errors)
{
    const int64_t xs[4] = {2, 4, 5, 5};
    const int64_t ws[4] = {6, 2, 3, 3};
    const int64_t w4s[4] = {6, 4, 3, 3};
    const int64_t big[4] = {6, 4, 8, 3};
    const int64_t w3[3] = {6, 4, 3};
    const int64_t x3[3] = {4, 5, 5};
    const int64_t bs[1] = {5};
    const int64_t d3[2] = {3, 3};
    const int64_t s0[2] = {0, 1};
    const int64_t pneg[2] = {-1, 0};
    const int64_t p1[2] = {1, 1};
    weft_tensor_t *x = zeros(WEFT_F64, 4, xs);
    weft_tensor_t *xf = zeros(WEFT_F32, 4, xs);
    weft_tensor_t *x3d = zeros(WEFT_F64, 3, x3);
    weft_tensor_t *w = zeros(WEFT_F64, 4, ws);
    weft_tensor_t *w4 = zeros(WEFT_F64, 4, w4s);
    weft_tensor_t *wbig = zeros(WEFT_F64, 4, big);
    weft_tensor_t *w3d = zeros(WEFT_F64, 3, w3);
    weft_tensor_t *b5 = zeros(WEFT_F64, 1, bs);
    weft_tensor_t *out = NULL;

    expect_error(weft_op_conv2d(x3d, w4, NULL, NULL, NULL, NULL, 1, &out), WEFT_ERR_SHAPE,
                 "4-D [N, C, H, W], got [4, 5, 5]");
    expect_error(weft_op_conv2d(x, w3d, NULL, NULL, NULL, NULL, 1, &out), WEFT_ERR_SHAPE,
                 "weight must be 4-D");
    expect_error(weft_op_conv2d(x, w, NULL, NULL, NULL, NULL, 1, &out), WEFT_ERR_SHAPE,
                 "weight [6, 2, 3, 3] does not fit input [2, 4, 5, 5] with groups = 1");
    expect_error(weft_op_conv2d(x, w4, NULL, NULL, NULL, NULL, 3, &out), WEFT_ERR_INVALID_ARG,
                 "groups = 3 does not divide the 4 input channels");
    expect_error(weft_op_conv2d(x, w, NULL, NULL, NULL, NULL, 4, &out), WEFT_ERR_INVALID_ARG,
                 "groups = 4 does not divide the 6 output channels");
    expect_error(weft_op_conv2d(x, w4, NULL, NULL, NULL, NULL, 0, &out), WEFT_ERR_INVALID_ARG,
                 "groups = 0");
    expect_error(weft_op_conv2d(x, w4, b5, NULL, NULL, NULL, 1, &out), WEFT_ERR_SHAPE,
                 "bias of shape [5], expected [6]");
    expect_error(weft_op_conv2d(x, wbig, NULL, NULL, NULL, NULL, 1, &out), WEFT_ERR_SHAPE,
                 "kernel {8, 3} with dilation {1, 1} is larger than the padded input {5, 5}");
    expect_error(weft_op_conv2d(x, wbig, NULL, NULL, p1, NULL, 1, &out), WEFT_ERR_SHAPE,
                 "larger than the padded input {7, 7}");
    expect_error(weft_op_conv2d(x, w4, NULL, NULL, NULL, d3, 1, &out), WEFT_ERR_SHAPE,
                 "dilation {3, 3} is larger than the padded input");
    expect_error(weft_op_conv2d(x, w4, NULL, s0, NULL, NULL, 1, &out), WEFT_ERR_INVALID_ARG,
                 "stride {0, 1} must be >= 1");
    expect_error(weft_op_conv2d(x, w4, NULL, NULL, pneg, NULL, 1, &out), WEFT_ERR_INVALID_ARG,
                 "padding {-1, 0} must be >= 0");
    expect_error(weft_op_conv2d(x, w4, NULL, NULL, NULL, s0, 1, &out), WEFT_ERR_INVALID_ARG,
                 "dilation {0, 1}");
    expect_error(weft_op_conv2d(xf, w4, NULL, NULL, NULL, NULL, 1, &out), WEFT_ERR_DTYPE,
                 "weight is f64, input f32");
    expect_error(weft_op_conv2d(NULL, w4, NULL, NULL, NULL, NULL, 1, &out), WEFT_ERR_INVALID_ARG,
                 "NULL");
    cr_assert_null(out);
    weft_tensor_release(x);
    weft_tensor_release(xf);
    weft_tensor_release(x3d);
    weft_tensor_release(w);
    weft_tensor_release(w4);
    weft_tensor_release(wbig);
    weft_tensor_release(w3d);
    weft_tensor_release(b5);
    check_balanced();
}

Test(conv, other_errors)
{
    const int64_t xs[4] = {2, 3, 4, 4};
    const int64_t x2s[2] = {4, 4};
    const int64_t c3[1] = {3};
    const int64_t c2[1] = {2};
    const int64_t one[4] = {1, 3, 1, 1};
    const int64_t k2[2] = {2, 2};
    const int64_t k5[2] = {5, 2};
    const int64_t k0[2] = {0, 2};
    const int64_t p2[2] = {2, 0};
    const int64_t o0[2] = {0, 3};
    const int64_t t_bad[4] = {0, 1, 4, 2};
    weft_tensor_t *x = zeros(WEFT_F64, 4, xs);
    weft_tensor_t *x2 = zeros(WEFT_F64, 2, x2s);
    weft_tensor_t *x1 = zeros(WEFT_F64, 4, one);
    weft_tensor_t *v3 = zeros(WEFT_F64, 1, c3);
    weft_tensor_t *v2 = zeros(WEFT_F64, 1, c2);
    weft_tensor_t *f3 = zeros(WEFT_F32, 1, c3);
    weft_tensor_t *tb = targets(4, t_bad);
    weft_tensor_t *t3 = targets(3, t_bad);
    weft_tensor_t *out = NULL;
    weft_rng_t rng;

    weft_rng_init(&rng, 1, 0);
    expect_error(weft_op_max_pool2d(x, k5, NULL, NULL, &out), WEFT_ERR_SHAPE,
                 "kernel {5, 2} is larger than the padded input {4, 4} of input [2, 3, 4, 4]");
    expect_error(weft_op_max_pool2d(x, k2, NULL, p2, &out), WEFT_ERR_INVALID_ARG,
                 "padding {2, 0} must be at most half the kernel {2, 2}");
    expect_error(weft_op_max_pool2d(x, k0, NULL, NULL, &out), WEFT_ERR_INVALID_ARG,
                 "kernel {0, 2} must be >= 1");
    expect_error(weft_op_max_pool2d(x, NULL, NULL, NULL, &out), WEFT_ERR_INVALID_ARG,
                 "NULL kernel");
    expect_error(weft_op_max_pool2d(x2, k2, NULL, NULL, &out), WEFT_ERR_SHAPE, "4-D");
    expect_error(weft_op_avg_pool2d(x, k5, NULL, NULL, 1, &out), WEFT_ERR_SHAPE,
                 "avg_pool2d: kernel {5, 2} is larger");
    expect_error(weft_op_adaptive_avg_pool2d(x, o0, &out), WEFT_ERR_INVALID_ARG,
                 "output size {0, 3} must be >= 1");

    expect_error(weft_op_batch_norm2d(x, v2, NULL, NULL, NULL, 1, 0.1, 1e-5, &out), WEFT_ERR_SHAPE,
                 "weight of shape [2], expected [3]");
    expect_error(weft_op_batch_norm2d(x, NULL, NULL, NULL, NULL, 0, 0.1, 1e-5, &out),
                 WEFT_ERR_INVALID_ARG, "required in eval mode");
    expect_error(weft_op_batch_norm2d(x, NULL, NULL, v3, NULL, 1, 0.1, 1e-5, &out),
                 WEFT_ERR_INVALID_ARG, "come together");
    expect_error(weft_op_batch_norm2d(x, f3, NULL, NULL, NULL, 1, 0.1, 1e-5, &out), WEFT_ERR_DTYPE,
                 "weight is f32, input f64");
    expect_error(weft_op_batch_norm2d(x, NULL, NULL, NULL, NULL, 1, 1.5, 1e-5, &out),
                 WEFT_ERR_INVALID_ARG, "momentum = 1.5");
    expect_error(weft_op_batch_norm2d(x1, NULL, NULL, NULL, NULL, 1, 0.1, 1e-5, &out),
                 WEFT_ERR_SHAPE, "more than 1 value per channel");

    expect_error(weft_op_dropout2d(x, 1.5, 1, &rng, &out), WEFT_ERR_INVALID_ARG,
                 "p = 1.5 is outside [0, 1]");
    expect_error(weft_op_dropout2d(x, 0.5, 1, NULL, &out), WEFT_ERR_INVALID_ARG, "NULL rng");
    expect_error(weft_op_dropout2d(x2, 0.5, 1, &rng, &out), WEFT_ERR_SHAPE, "4-D");

    expect_error(weft_op_nll_loss(x2, tb, WEFT_REDUCTION_MEAN, &out), WEFT_ERR_INVALID_ARG,
                 "target 4 at position 2 is out of range [0, 4)");
    expect_error(weft_op_nll_loss(x2, t3, WEFT_REDUCTION_MEAN, &out), WEFT_ERR_SHAPE,
                 "target [3] does not match log_probs [4, 4]");
    expect_error(weft_op_nll_loss(x2, x2, WEFT_REDUCTION_MEAN, &out), WEFT_ERR_DTYPE,
                 "target must be i64");
    expect_error(weft_op_nll_loss(x, tb, WEFT_REDUCTION_MEAN, &out), WEFT_ERR_SHAPE, "[N, C]");
    expect_error(weft_op_nll_loss(x2, tb, (weft_reduction_t)7, &out), WEFT_ERR_INVALID_ARG,
                 "unknown reduction 7");
    cr_assert_null(out);
    weft_tensor_release(x);
    weft_tensor_release(x2);
    weft_tensor_release(x1);
    weft_tensor_release(v3);
    weft_tensor_release(v2);
    weft_tensor_release(f3);
    weft_tensor_release(tb);
    weft_tensor_release(t3);
    check_balanced();
}

/* ---- modules --------------------------------------------------------------------------------- */

Test(conv, nn_conv2d)
{
    const int64_t k[2] = {3, 2};
    const int64_t xs[4] = {2, 4, 6, 5};
    weft_nn_conv2d_config_t cfg = WEFT_NN_CONV2D_DEFAULTS;
    weft_nn_conv2d_t *conv = NULL;
    const weft_param_list_t *params;
    weft_tensor_t *x;
    weft_tensor_t *y = NULL;
    weft_tensor_t *y2 = NULL;
    weft_rng_t rng;
    double bound = 1 / sqrt(2.0 * 3 * 2); /* fan_in = in / groups * kH * kW */
    double wmax = 0;

    weft_rng_init(&rng, 28, 0);
    cfg.padding[0] = 1;
    cfg.groups = 2;
    cfg.dtype = WEFT_F64;
    cr_assert_eq(weft_nn_conv2d_create(4, 6, k, &cfg, &rng, &conv), WEFT_OK, "%s",
                 weft_last_error());
    params = weft_nn_conv2d_params(conv);
    cr_assert_eq(weft_param_list_size(params), 2);
    cr_assert_str_eq(weft_param_list_name(params, 0), "weight");
    cr_assert_str_eq(weft_param_list_name(params, 1), "bias");
    cr_assert_eq(weft_tensor_shape(weft_nn_conv2d_weight(conv))[1], 2);
    for (int64_t i = 0; i < weft_tensor_numel(weft_nn_conv2d_weight(conv)); i++) {
        wmax = fmax(wmax, fabs(elem(weft_nn_conv2d_weight(conv), i)));
    }
    cr_assert(wmax <= bound && wmax > 0.8 * bound, "weights within +-%g (max %g)", bound, wmax);
    for (int64_t i = 0; i < 6; i++) {
        cr_assert(fabs(elem(weft_nn_conv2d_bias(conv), i)) <= bound);
    }
    x = gc_rand(&rng, 4, xs, -1, 1, 0);
    cr_assert_eq(weft_nn_conv2d_forward(conv, x, &y), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(weft_op_conv2d(x, weft_nn_conv2d_weight(conv), weft_nn_conv2d_bias(conv), NULL,
                                cfg.padding, NULL, 2, &y2),
                 WEFT_OK);
    cr_assert(weft_tensor_equal(y, y2));
    cr_assert(weft_tensor_requires_grad(y));
    weft_tensor_release(y);
    weft_tensor_release(y2);
    weft_nn_conv2d_free(conv);

    /* Defaults (NULL config): f32 with bias; no bias when asked. */
    cr_assert_eq(weft_nn_conv2d_create(4, 3, k, NULL, &rng, &conv), WEFT_OK);
    cr_assert_eq(weft_tensor_dtype(weft_nn_conv2d_weight(conv)), WEFT_F32);
    cr_assert_not_null(weft_nn_conv2d_bias(conv));
    weft_nn_conv2d_free(conv);
    cfg.bias = 0;
    cr_assert_eq(weft_nn_conv2d_create(4, 6, k, &cfg, &rng, &conv), WEFT_OK);
    cr_assert_null(weft_nn_conv2d_bias(conv));
    cr_assert_eq(weft_param_list_size(weft_nn_conv2d_params(conv)), 1);
    weft_nn_conv2d_free(conv);
    conv = NULL;
    cfg.groups = 3;
    expect_error(weft_nn_conv2d_create(4, 6, k, &cfg, &rng, &conv), WEFT_ERR_INVALID_ARG,
                 "groups = 3 must be >= 1 and divide the channels");
    cr_assert_null(conv);
    weft_tensor_release(x);
    check_balanced();
}

Test(conv, nn_batch_norm2d)
{
    const bn_case_t *bc = &bn_cases[0]; /* training, affine, momentum 0.1, eps 1e-5 */
    weft_nn_batch_norm2d_t *bn = NULL;
    weft_tensor_t *x;
    weft_tensor_t *y = NULL;
    weft_tensor_t *y2 = NULL;
    int64_t c = bc->x.shape[1];

    cr_assert_eq(weft_nn_batch_norm2d_create(c, bc->eps, bc->momentum, WEFT_F64, &bn), WEFT_OK,
                 "%s", weft_last_error());
    cr_assert(weft_nn_batch_norm2d_training(bn));
    cr_assert_str_eq(weft_param_list_name(weft_nn_batch_norm2d_params(bn), 0), "weight");
    cr_assert_str_eq(weft_param_list_name(weft_nn_batch_norm2d_params(bn), 1), "bias");
    cr_assert_str_eq(weft_param_list_name(weft_nn_batch_norm2d_buffers(bn), 0), "running_mean");
    cr_assert_str_eq(weft_param_list_name(weft_nn_batch_norm2d_buffers(bn), 1), "running_var");
    for (int64_t i = 0; i < c; i++) {
        cr_assert_eq(elem(weft_nn_batch_norm2d_weight(bn), i), 1.0);
        cr_assert_eq(elem(weft_nn_batch_norm2d_bias(bn), i), 0.0);
        cr_assert_eq(elem(weft_nn_batch_norm2d_running_mean(bn), i), 0.0);
        cr_assert_eq(elem(weft_nn_batch_norm2d_running_var(bn), i), 1.0);
    }
    /* Set the table's parameters and running statistics, then train, then eval. */
    for (int64_t i = 0; i < c; i++) {
        ((double *)weft_tensor_data(weft_nn_batch_norm2d_weight(bn)))[i] = bc->w.data[i];
        ((double *)weft_tensor_data(weft_nn_batch_norm2d_bias(bn)))[i] = bc->b.data[i];
        ((double *)weft_tensor_data(weft_nn_batch_norm2d_running_mean(bn)))[i] = bc->rm.data[i];
        ((double *)weft_tensor_data(weft_nn_batch_norm2d_running_var(bn)))[i] = bc->rv.data[i];
    }
    x = from_tt(&bc->x, WEFT_F64, 0);
    cr_assert_eq(weft_nn_batch_norm2d_forward(bn, x, &y), WEFT_OK, "%s", weft_last_error());
    expect_tt(y, &bc->out, 1e-10, "out", "module");
    expect_tt(weft_nn_batch_norm2d_running_mean(bn), &bc->rm_after, 1e-10, "running_mean",
              "module");
    expect_tt(weft_nn_batch_norm2d_running_var(bn), &bc->rv_after, 1e-10, "running_var", "module");
    weft_tensor_release(y);
    weft_nn_batch_norm2d_set_training(bn, 0);
    cr_assert_not(weft_nn_batch_norm2d_training(bn));
    cr_assert_eq(weft_nn_batch_norm2d_forward(bn, x, &y), WEFT_OK);
    cr_assert_eq(weft_op_batch_norm2d(x, weft_nn_batch_norm2d_weight(bn),
                                      weft_nn_batch_norm2d_bias(bn),
                                      weft_nn_batch_norm2d_running_mean(bn),
                                      weft_nn_batch_norm2d_running_var(bn), 0, 0.1, bc->eps, &y2),
                 WEFT_OK);
    cr_assert(weft_tensor_equal(y, y2));
    /* Eval mode leaves the running statistics alone. */
    expect_tt(weft_nn_batch_norm2d_running_mean(bn), &bc->rm_after, 1e-10, "running_mean", "eval");
    weft_tensor_release(y);
    weft_tensor_release(y2);
    weft_tensor_release(x);
    weft_nn_batch_norm2d_free(bn);
    bn = NULL;
    expect_error(weft_nn_batch_norm2d_create(0, 1e-5, 0.1, WEFT_F32, &bn), WEFT_ERR_INVALID_ARG,
                 "num_features = 0");
    expect_error(weft_nn_batch_norm2d_create(3, 1e-5, 0.1, WEFT_I64, &bn), WEFT_ERR_DTYPE, "i64");
    cr_assert_null(bn);
    check_balanced();
}

/* A small CNN as in torch's RPC tutorials, end to end: conv, batch norm, relu, max pool,
 * dropout2d, flatten, linear, log_softmax, nll_loss; every parameter gets a gradient. */
Test(conv, small_cnn_step)
{
    const int64_t xs[4] = {4, 1, 12, 12};
    const int64_t k3[2] = {3, 3};
    const int64_t k2[2] = {2, 2};
    const int64_t t[4] = {1, 0, 9, 4};
    weft_nn_conv2d_t *conv = NULL;
    weft_nn_batch_norm2d_t *bn = NULL;
    weft_nn_linear_t *fc = NULL;
    weft_tensor_t *target = targets(4, t);
    weft_tensor_t *x;
    weft_tensor_t *h[8] = {NULL};
    weft_rng_t rng;

    weft_rng_init(&rng, 29, 0);
    cr_assert_eq(weft_nn_conv2d_create(1, 8, k3, NULL, &rng, &conv), WEFT_OK);
    cr_assert_eq(weft_nn_batch_norm2d_create(8, 1e-5, 0.1, WEFT_F32, &bn), WEFT_OK);
    cr_assert_eq(weft_nn_linear_create(8 * 5 * 5, 10, 1, WEFT_F32, &rng, &fc), WEFT_OK);
    cr_assert_eq(weft_tensor_empty(WEFT_F32, 4, xs, &x), WEFT_OK);
    cr_assert_eq(weft_tensor_fill_uniform(x, 0, 1, &rng), WEFT_OK);
    cr_assert_eq(weft_nn_conv2d_forward(conv, x, &h[0]), WEFT_OK);
    cr_assert_eq(weft_nn_batch_norm2d_forward(bn, h[0], &h[1]), WEFT_OK);
    cr_assert_eq(weft_op_relu(h[1], &h[2]), WEFT_OK);
    cr_assert_eq(weft_op_max_pool2d(h[2], k2, NULL, NULL, &h[3]), WEFT_OK);
    cr_assert_eq(weft_op_dropout2d(h[3], 0.25, 1, &rng, &h[4]), WEFT_OK);
    cr_assert_eq(weft_op_flatten(h[4], 1, -1, &h[5]), WEFT_OK);
    cr_assert_eq(weft_nn_linear_forward(fc, h[5], &h[6]), WEFT_OK);
    cr_assert_eq(weft_op_log_softmax(h[6], 1, &h[7]), WEFT_OK);
    {
        weft_tensor_t *loss = NULL;

        cr_assert_eq(weft_op_nll_loss(h[7], target, WEFT_REDUCTION_MEAN, &loss), WEFT_OK);
        cr_assert_eq(weft_backward(loss, NULL, 0), WEFT_OK, "%s", weft_last_error());
        weft_tensor_release(loss);
    }
    cr_assert_not_null(weft_tensor_grad(weft_nn_conv2d_weight(conv)));
    cr_assert_not_null(weft_tensor_grad(weft_nn_conv2d_bias(conv)));
    cr_assert_not_null(weft_tensor_grad(weft_nn_batch_norm2d_weight(bn)));
    cr_assert_not_null(weft_tensor_grad(weft_nn_batch_norm2d_bias(bn)));
    cr_assert_not_null(weft_tensor_grad(weft_nn_linear_weight(fc)));
    for (int i = 0; i < 8; i++) {
        weft_tensor_release(h[i]);
    }
    weft_tensor_release(x);
    weft_tensor_release(target);
    weft_nn_conv2d_free(conv);
    weft_nn_batch_norm2d_free(bn);
    weft_nn_linear_free(fc);
    check_balanced();
}

/* ---- timing (printed, not asserted) ---------------------------------------------------------- */

static double now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a;
    double y = *(const double *)b;

    return (x > y) - (x < y);
}

Test(conv, timing_conv2d_mnist_layer)
{
    const int64_t xs[4] = {64, 1, 28, 28};
    const int64_t ws[4] = {32, 1, 3, 3};
    const int64_t bs[1] = {32};
    enum { REPS = 30 };
    double t[REPS];
    weft_tensor_t *x;
    weft_tensor_t *w;
    weft_tensor_t *b;
    weft_tensor_t *gy = NULL;
    weft_rng_t rng;

    weft_rng_init(&rng, 30, 0);
    cr_assert_eq(weft_tensor_empty(WEFT_F32, 4, xs, &x), WEFT_OK);
    cr_assert_eq(weft_tensor_empty(WEFT_F32, 4, ws, &w), WEFT_OK);
    cr_assert_eq(weft_tensor_empty(WEFT_F32, 1, bs, &b), WEFT_OK);
    cr_assert_eq(weft_tensor_fill_uniform(x, 0, 1, &rng), WEFT_OK);
    cr_assert_eq(weft_tensor_fill_uniform(w, -0.3, 0.3, &rng), WEFT_OK);
    cr_assert_eq(weft_tensor_fill_uniform(b, -0.3, 0.3, &rng), WEFT_OK);
    cr_assert_eq(weft_tensor_set_requires_grad(x, 1), WEFT_OK);
    cr_assert_eq(weft_tensor_set_requires_grad(w, 1), WEFT_OK);
    cr_assert_eq(weft_tensor_set_requires_grad(b, 1), WEFT_OK);
    for (int r = 0; r < REPS + 5; r++) {
        weft_tensor_t *y = NULL;
        double t0 = now_s();

        cr_assert_eq(weft_op_conv2d(x, w, b, NULL, NULL, NULL, 1, &y), WEFT_OK);
        if (gy == NULL) {
            cr_assert_eq(weft_tensor_empty(WEFT_F32, 4, weft_tensor_shape(y), &gy), WEFT_OK);
            cr_assert_eq(weft_tensor_fill(gy, 1.0), WEFT_OK);
        }
        cr_assert_eq(weft_backward(y, gy, 0), WEFT_OK);
        weft_tensor_release(y);
        if (r >= 5) {
            t[r - 5] = now_s() - t0;
        }
        weft_tensor_grad_clear(x);
        weft_tensor_grad_clear(w);
        weft_tensor_grad_clear(b);
    }
    qsort(t, REPS, sizeof(t[0]), cmp_double);
    printf("conv2d f32 [64, 1, 28, 28] x 32 3x3 (bias) forward + backward: median %.3f ms, "
           "min %.3f ms (%d BLAS threads)\n",
           1e3 * t[REPS / 2], 1e3 * t[0], weft_op_threads());
    fflush(stdout);
    weft_tensor_release(gy);
    weft_tensor_release(x);
    weft_tensor_release(w);
    weft_tensor_release(b);
    weft_tensor_cache_clear();
    check_balanced();
}
