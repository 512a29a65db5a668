/* Helpers shared by the operations and the engine: broadcast reduction, zeros, sums, texts. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cblas.h>

#include "graph.h"

#include <weft/ops.h>

void weft_op_set_threads(int n)
{
    if (n <= 0) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        const char *env = getenv("OPENBLAS_NUM_THREADS");

        n = env != NULL && atoi(env) > 0 ? atoi(env) : (int)(cores > 0 ? cores : 1);
    }
    openblas_set_num_threads(n);
}

int weft_op_threads(void)
{
    return openblas_get_num_threads();
}

int weft__op_is_float(weft_dtype_t dt)
{
    return dt == WEFT_F32 || dt == WEFT_F64;
}

weft_status_t weft__op_zeros(weft_dtype_t dt, int ndim, const int64_t *shape, weft_tensor_t **out_p)
{
    return weft_tensor_create(dt, ndim, shape, out_p);
}

weft_status_t weft__op_check_float(const char *op, const weft_tensor_t *t)
{
    if (t == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: NULL tensor", op);
    }
    if (weft_tensor_device(t).type != WEFT_DEVICE_CPU) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: not a CPU tensor", op);
    }
    if (!weft__op_is_float(weft_tensor_dtype(t))) {
        return weft__set_error(WEFT_ERR_DTYPE, "%s: dtype %s is not supported (f32 or f64)", op,
                               weft_dtype_name(weft_tensor_dtype(t)));
    }
    return WEFT_OK;
}

weft_status_t weft__op_check_one(const char *op, const weft_tensor_t *a, weft_tensor_t **out_p)
{
    if (out_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: NULL output", op);
    }
    return weft__op_check_float(op, a);
}

weft_status_t weft__op_empty_like(const weft_tensor_t *t, weft_tensor_t **out_p)
{
    return weft_tensor_empty(weft_tensor_dtype(t), weft_tensor_ndim(t), weft_tensor_shape(t),
                             out_p);
}

weft_status_t weft__op_node_begin(const char *name, weft__ag_backward_cb_t backward, int n_in,
                                  weft_tensor_t *const *inputs, weft__ag_node_t **n_p)
{
    if (!weft__ag_should_record(n_in, inputs)) {
        *n_p = NULL;
        return WEFT_OK;
    }
    return weft__ag_node_new(name, backward, n_in, inputs, n_p);
}

weft_status_t weft__op_node_end(weft__ag_node_t *n, weft_status_t st, weft_tensor_t *out)
{
    if (st == WEFT_OK) {
        st = weft__ag_attach(n, 1, &out);
    }
    weft__ag_node_unref(n);
    return st;
}

static weft_status_t same_check(const char *what, const weft_tensor_t *a, const weft_tensor_t *b)
{
    if (weft_tensor_dtype(a) != weft_tensor_dtype(b) || !weft__op_is_float(weft_tensor_dtype(a))) {
        return weft__set_error(WEFT_ERR_DTYPE, "%s: dtypes %s and %s", what,
                               weft_dtype_name(weft_tensor_dtype(a)),
                               weft_dtype_name(weft_tensor_dtype(b)));
    }
    if (weft_tensor_numel(a) != weft_tensor_numel(b) ||
        weft_tensor_ndim(a) != weft_tensor_ndim(b) ||
        memcmp(weft_tensor_shape(a), weft_tensor_shape(b),
               (size_t)weft_tensor_ndim(a) * sizeof(int64_t)) != 0) {
        return weft__set_error(WEFT_ERR_SHAPE, "%s: tensors of different shapes", what);
    }
    return WEFT_OK;
}

weft_status_t weft__op_add_inplace(weft_tensor_t *a, const weft_tensor_t *b)
{
    int64_t n = weft_tensor_numel(a);

    WEFT_CHECK(same_check("gradient sum", a, b));
    if (weft_tensor_dtype(a) == WEFT_F32) {
        float *restrict x = weft_tensor_data(a);
        const float *restrict y = weft_tensor_data(b);
        for (int64_t i = 0; i < n; i++) {
            x[i] += y[i];
        }
    } else {
        double *restrict x = weft_tensor_data(a);
        const double *restrict y = weft_tensor_data(b);
        for (int64_t i = 0; i < n; i++) {
            x[i] += y[i];
        }
    }
    return WEFT_OK;
}

weft_status_t weft__op_add_same(weft_tensor_t *a, weft_tensor_t *b, weft_tensor_t **out_p)
{
    weft_tensor_t *out = NULL;
    int64_t n = weft_tensor_numel(a);

    WEFT_CHECK(same_check("gradient sum", a, b));
    WEFT_CHECK(
        weft_tensor_empty(weft_tensor_dtype(a), weft_tensor_ndim(a), weft_tensor_shape(a), &out));
    if (weft_tensor_dtype(a) == WEFT_F32) {
        float *restrict o = weft_tensor_data(out);
        const float *restrict x = weft_tensor_data(a);
        const float *restrict y = weft_tensor_data(b);
        for (int64_t i = 0; i < n; i++) {
            o[i] = x[i] + y[i];
        }
    } else {
        double *restrict o = weft_tensor_data(out);
        const double *restrict x = weft_tensor_data(a);
        const double *restrict y = weft_tensor_data(b);
        for (int64_t i = 0; i < n; i++) {
            o[i] = x[i] + y[i];
        }
    }
    *out_p = out;
    return WEFT_OK;
}

/*
 * out[map(i)] += g[i] over every element of g, where map sends g's index to the target's with
 * broadcast dims dropped. The innermost dim runs as a plain loop (summed into one element when
 * it is reduced, added elementwise when it is kept).
 */
#define SUM_TO_LOOP(T)                                                                             \
    do {                                                                                           \
        const T *src = weft_tensor_data(g);                                                        \
        T *dst = weft_tensor_data(out);                                                            \
        int64_t idx[WEFT_MAX_DIMS] = {0};                                                          \
        int64_t inner = gnd == 0 ? 1 : gshape[gnd - 1];                                            \
        int64_t istride = gnd == 0 ? 0 : ostride[gnd - 1];                                         \
        int64_t outer = inner == 0 ? 0 : gnumel / inner;                                           \
        for (int64_t o = 0; o < outer; o++) {                                                      \
            int64_t off = 0;                                                                       \
            for (int d = 0; d < gnd - 1; d++) {                                                    \
                off += idx[d] * ostride[d];                                                        \
            }                                                                                      \
            const T *s = src + o * inner;                                                          \
            if (istride == 0) {                                                                    \
                T acc = 0;                                                                         \
                for (int64_t j = 0; j < inner; j++) {                                              \
                    acc += s[j];                                                                   \
                }                                                                                  \
                dst[off] += acc;                                                                   \
            } else {                                                                               \
                T *dd = dst + off;                                                                 \
                for (int64_t j = 0; j < inner; j++) {                                              \
                    dd[j] += s[j];                                                                 \
                }                                                                                  \
            }                                                                                      \
            for (int d = gnd - 2; d >= 0; d--) {                                                   \
                if (++idx[d] < gshape[d]) {                                                        \
                    break;                                                                         \
                }                                                                                  \
                idx[d] = 0;                                                                        \
            }                                                                                      \
        }                                                                                          \
    } while (0)

weft_status_t weft__op_sum_to(weft_tensor_t *g, int ndim, const int64_t *shape,
                              weft_tensor_t **out_p)
{
    const int gnd = weft_tensor_ndim(g);
    const int64_t *gshape = weft_tensor_shape(g);
    const int64_t gnumel = weft_tensor_numel(g);
    int64_t ostride[WEFT_MAX_DIMS];
    int64_t tstride = 1;
    weft_tensor_t *out = NULL;
    int same = gnd == ndim;

    if (ndim > gnd) {
        return weft__set_error(WEFT_ERR_SHAPE, "sum_to: %d dims cannot sum to %d", gnd, ndim);
    }
    for (int d = gnd - 1; d >= 0; d--) {
        int td = d - (gnd - ndim);

        if (td < 0) {
            ostride[d] = 0;
            same = 0;
            continue;
        }
        if (shape[td] == gshape[d]) {
            ostride[d] = shape[td] == 1 ? 0 : tstride;
        } else if (shape[td] == 1) {
            ostride[d] = 0;
            same = 0;
        } else {
            return weft__set_error(WEFT_ERR_SHAPE, "sum_to: dim %d of size %lld cannot sum to %lld",
                                   d, (long long)gshape[d], (long long)shape[td]);
        }
        tstride *= shape[td];
    }
    if (same) {
        *out_p = weft_tensor_retain(g);
        return WEFT_OK;
    }
    WEFT_CHECK(weft_tensor_create(weft_tensor_dtype(g), ndim, shape, &out));
    if (weft_tensor_dtype(g) == WEFT_F32) {
        SUM_TO_LOOP(float);
    } else if (weft_tensor_dtype(g) == WEFT_F64) {
        SUM_TO_LOOP(double);
    } else {
        weft_tensor_release(out);
        return weft__set_error(WEFT_ERR_DTYPE, "sum_to: %s", weft_dtype_name(weft_tensor_dtype(g)));
    }
    *out_p = out;
    return WEFT_OK;
}

#define DEFINE_SCATTER_ADD(T)                                                                      \
    static void scatter_add_##T(T *restrict dst, const T *restrict src, const int64_t *idx,        \
                                int64_t k, int64_t width)                                          \
    {                                                                                              \
        for (int64_t i = 0; i < k; i++) {                                                          \
            T *restrict d = dst + idx[i] * width;                                                  \
            const T *restrict s = src + i * width;                                                 \
            for (int64_t j = 0; j < width; j++) {                                                  \
                d[j] += s[j];                                                                      \
            }                                                                                      \
        }                                                                                          \
    }
DEFINE_SCATTER_ADD(float)
DEFINE_SCATTER_ADD(double)

void weft__op_scatter_add_rows(weft_dtype_t dt, void *dst, const void *src, const int64_t *idx,
                               int64_t k, int64_t width)
{
    if (dt == WEFT_F32) {
        scatter_add_float(dst, src, idx, k, width);
    } else {
        scatter_add_double(dst, src, idx, k, width);
    }
}

weft__shape_str_t weft__shape_str(int ndim, const int64_t *shape)
{
    weft__shape_str_t r;
    const int shown = ndim < WEFT_MAX_DIMS ? ndim : WEFT_MAX_DIMS;
    size_t off = 0;

    r.s[off++] = '[';
    for (int i = 0; i < shown; i++) {
        off += (size_t)snprintf(r.s + off, sizeof(r.s) - off, i == 0 ? "%lld" : ", %lld",
                                (long long)shape[i]);
    }
    snprintf(r.s + off, sizeof(r.s) - off, "%s]", ndim > shown ? ", ..." : "");
    return r;
}

weft__shape_str_t weft__tensor_shape_str(const weft_tensor_t *t)
{
    return weft__shape_str(weft_tensor_ndim(t), weft_tensor_shape(t));
}

weft_status_t weft__op_check_reduction(const char *op, int reduction)
{
    if (reduction != WEFT_REDUCTION_MEAN && reduction != WEFT_REDUCTION_SUM &&
        reduction != WEFT_REDUCTION_NONE) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: unknown reduction %d", op,
                               (int)reduction);
    }
    return WEFT_OK;
}

int weft__op_fits_blas(int64_t v)
{
    return v <= INT_MAX;
}

void weft__op_gemm(weft_dtype_t dt, int ta, int tb, int64_t m, int64_t nn, int64_t k, const void *a,
                   const void *b, double beta, void *c)
{
    if (m == 0 || nn == 0) {
        return;
    }
    if (k == 0) {
        if (beta == 0) {
            memset(c, 0, (size_t)(m * nn) * weft_dtype_size(dt));
        }
        return;
    }
    if (dt == WEFT_F32) {
        cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                    (blasint)m, (blasint)nn, (blasint)k, 1.0f, a, (blasint)(ta ? m : k), b,
                    (blasint)(tb ? k : nn), (float)beta, c, (blasint)nn);
    } else {
        cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                    (blasint)m, (blasint)nn, (blasint)k, 1.0, a, (blasint)(ta ? m : k), b,
                    (blasint)(tb ? k : nn), beta, c, (blasint)nn);
    }
}
