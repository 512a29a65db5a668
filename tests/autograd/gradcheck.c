/* Gradient checks: analytic J^T v from backward against central differences. */
#include <math.h>
#include <string.h>

#include <criterion/criterion.h>

#include "gradcheck.h"

#define GC_EPS 1e-6
#define GC_TOL 1e-6

weft_tensor_t *gc_rand(weft_rng_t *rng, int ndim, const int64_t *shape, double lo, double hi,
                       int rg)
{
    weft_tensor_t *t = NULL;

    cr_assert_eq(weft_tensor_empty(WEFT_F64, ndim, shape, &t), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(weft_tensor_fill_uniform(t, lo, hi, rng), WEFT_OK);
    if (rg) {
        cr_assert_eq(weft_tensor_set_requires_grad(t, 1), WEFT_OK);
    }
    return t;
}

/* f(inputs) . v with recording off. */
static double eval_dot(gc_fn_t f, void *arg, weft_tensor_t *const *inputs, const weft_tensor_t *v)
{
    weft_tensor_t *out = NULL;
    int prev = weft_grad_set_enabled(0);
    double acc = 0;

    cr_assert_eq(f(inputs, arg, &out), WEFT_OK, "%s", weft_last_error());
    weft_grad_set_enabled(prev);
    cr_assert_eq(weft_tensor_numel(out), weft_tensor_numel(v));
    for (int64_t i = 0; i < weft_tensor_numel(out); i++) {
        acc +=
            ((const double *)weft_tensor_data(out))[i] * ((const double *)weft_tensor_data(v))[i];
    }
    weft_tensor_release(out);
    return acc;
}

void gradcheck(const char *name, gc_fn_t f, void *arg, int n, weft_tensor_t *const *inputs,
               weft_rng_t *rng)
{
    weft_tensor_t *out = NULL;
    weft_tensor_t *v = NULL;

    for (int k = 0; k < n; k++) {
        if (inputs[k] != NULL) {
            weft_tensor_grad_clear(inputs[k]);
        }
    }
    cr_assert_eq(f(inputs, arg, &out), WEFT_OK, "%s: forward: %s", name, weft_last_error());
    cr_assert(weft_tensor_requires_grad(out), "%s: output does not require grad", name);
    cr_assert_eq(weft_tensor_dtype(out), WEFT_F64, "%s: output is not f64", name);
    cr_assert_eq(weft_tensor_empty(WEFT_F64, weft_tensor_ndim(out), weft_tensor_shape(out), &v),
                 WEFT_OK);
    cr_assert_eq(weft_tensor_fill_uniform(v, -1.0, 1.0, rng), WEFT_OK);
    cr_assert_eq(weft_backward(out, v, 0), WEFT_OK, "%s: backward: %s", name, weft_last_error());
    weft_tensor_release(out);

    for (int k = 0; k < n; k++) {
        weft_tensor_t *x = inputs[k];
        weft_tensor_t *g;
        double *xd;

        if (x == NULL || !weft_tensor_requires_grad(x)) {
            continue;
        }
        g = weft_tensor_grad(x);
        cr_assert_not_null(g, "%s: input %d got no gradient", name, k);
        cr_assert_eq(weft_tensor_numel(g), weft_tensor_numel(x));
        xd = weft_tensor_data(x);
        for (int64_t j = 0; j < weft_tensor_numel(x); j++) {
            double keep = xd[j];
            double plus;
            double minus;
            double num;
            double ana = ((const double *)weft_tensor_data(g))[j];

            xd[j] = keep + GC_EPS;
            plus = eval_dot(f, arg, inputs, v);
            xd[j] = keep - GC_EPS;
            minus = eval_dot(f, arg, inputs, v);
            xd[j] = keep;
            num = (plus - minus) / (2 * GC_EPS);
            cr_assert(fabs(ana - num) <= GC_TOL * fmax(1.0, fabs(num)),
                      "%s: input %d element %lld: analytic %.12g numeric %.12g", name, k,
                      (long long)j, ana, num);
        }
        weft_tensor_grad_clear(x);
    }
    weft_tensor_release(v);
}
