/*
 * Reductions (sum, mean, max, argmax), softmax and log_softmax, and the losses (cross entropy,
 * mean squared error), for f32 and f64, each with its backward.
 *
 * sum and mean walk the input once in memory order. Its dims are folded into runs of reduced and
 * of kept dims, so that the innermost loop either sums one contiguous run into one output element
 * or adds it elementwise into a contiguous run of outputs: a whole-tensor sum, row sums and
 * column sums are all plain loops. f32 sums accumulate in double. Operations over one dim view
 * the input as [outer, size, inner] and have a fast path for inner == 1 (the last dim).
 */
#include <math.h>
#include <string.h>

#include "graph.h"
#include "ops_math.h"

#include <weft/ops.h>

/* ---- checks ---------------------------------------------------------------------------------- */


/* Wraps a dim in [-ndim, ndim) (a 0-dim tensor counts as having one dim of size 1). */
static weft_status_t wrap_dim(const char *op, int ndim, int dim, int *dim_p)
{
    const int lim = ndim == 0 ? 1 : ndim;

    if (dim < -lim || dim >= lim) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "%s: dim %d is out of range for a tensor of %d dims", op, dim, ndim);
    }
    *dim_p = dim < 0 ? dim + lim : dim;
    return WEFT_OK;
}

/* ---- graph recording ------------------------------------------------------------------------- */

/*
 * Row helpers over n contiguous elements, for f32 and f64. Sums run in blocks of 64 over 8 lanes
 * of T (which vectorise), each block's total added in double; f32 sums keep close to double
 * accuracy that way at the speed of a float loop.
 */
static double exp_f64(double x)
{
    return exp(x);
}

#define ROW_HELPERS(sfx, T, EXP)                                                                   \
    static double row_sum_##sfx(int64_t n, const T *restrict x)                                    \
    {                                                                                              \
        double total = 0;                                                                          \
        int64_t i = 0;                                                                             \
        for (; i + 64 <= n; i += 64) {                                                             \
            T s[8] = {0};                                                                          \
            for (int j = 0; j < 64; j += 8) {                                                      \
                for (int k = 0; k < 8; k++) {                                                      \
                    s[k] += x[i + j + k];                                                          \
                }                                                                                  \
            }                                                                                      \
            total += (double)(((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])));  \
        }                                                                                          \
        for (; i < n; i++) {                                                                       \
            total += (double)x[i];                                                                 \
        }                                                                                          \
        return total;                                                                              \
    }                                                                                              \
    /* The largest of n >= 1 elements. */                                                          \
    static T row_max_##sfx(int64_t n, const T *restrict x)                                         \
    {                                                                                              \
        T m[8];                                                                                    \
        int64_t i = 0;                                                                             \
        for (int k = 0; k < 8; k++) {                                                              \
            m[k] = x[0];                                                                           \
        }                                                                                          \
        for (; i + 8 <= n; i += 8) {                                                               \
            for (int k = 0; k < 8; k++) {                                                          \
                m[k] = x[i + k] > m[k] ? x[i + k] : m[k];                                          \
            }                                                                                      \
        }                                                                                          \
        for (; i < n; i++) {                                                                       \
            m[0] = x[i] > m[0] ? x[i] : m[0];                                                      \
        }                                                                                          \
        for (int k = 1; k < 8; k++) {                                                              \
            m[0] = m[k] > m[0] ? m[k] : m[0];                                                      \
        }                                                                                          \
        return m[0];                                                                               \
    }                                                                                              \
    /* y[i] = exp(x[i] - m); returns the sum of the y. */                                          \
    static double row_exp_##sfx(int64_t n, const T *restrict x, T m, T *restrict y)                \
    {                                                                                              \
        double total = 0;                                                                          \
        int64_t i = 0;                                                                             \
        for (; i + 64 <= n; i += 64) {                                                             \
            T s[8] = {0};                                                                          \
            for (int j = 0; j < 64; j += 8) {                                                      \
                for (int k = 0; k < 8; k++) {                                                      \
                    const T e = EXP(x[i + j + k] - m);                                             \
                    y[i + j + k] = e;                                                              \
                    s[k] += e;                                                                     \
                }                                                                                  \
            }                                                                                      \
            total += (double)(((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])));  \
        }                                                                                          \
        for (; i < n; i++) {                                                                       \
            y[i] = EXP(x[i] - m);                                                                  \
            total += (double)y[i];                                                                 \
        }                                                                                          \
        return total;                                                                              \
    }                                                                                              \
    /* Columns of [size, inner] (softmax over a middle dim): m[i] = max(m[i], x[i]). */            \
    static void row_max_into_##sfx(int64_t n, const T *restrict x, T *restrict m)                  \
    {                                                                                              \
        WEFT__FOR_EACH(i, n, { m[i] = x[i] > m[i] ? x[i] : m[i]; });                               \
    }                                                                                              \
    /* y[i] = exp(x[i] - m[i]), s[i] += y[i]. */                                                   \
    static void row_exp_acc_##sfx(int64_t n, const T *restrict x, const T *restrict m,             \
                                  T *restrict y, double *restrict s)                               \
    {                                                                                              \
        WEFT__FOR_EACH(i, n, {                                                                     \
            const T e = EXP(x[i] - m[i]);                                                          \
            y[i] = e;                                                                              \
            s[i] += (double)e;                                                                     \
        });                                                                                        \
    }                                                                                              \
    static void row_sub_each_##sfx(int64_t n, const T *restrict x, const double *restrict c,       \
                                   T *restrict y)                                                  \
    {                                                                                              \
        WEFT__FOR_EACH(i, n, { y[i] = (T)((double)x[i] - c[i]); });                                \
    }                                                                                              \
    static void row_scale_each_##sfx(int64_t n, T *restrict y, const double *restrict c)           \
    {                                                                                              \
        WEFT__FOR_EACH(i, n, { y[i] = (T)((double)y[i] * c[i]); });                                \
    }                                                                                              \
    /* y[i] = c exp(y[i]). */                                                                      \
    static void row_exp_scale_##sfx(int64_t n, T *restrict y, T c)                                 \
    {                                                                                              \
        WEFT__FOR_EACH(i, n, { y[i] = c * EXP(y[i]); });                                           \
    }                                                                                              \
    static void row_scale_##sfx(int64_t n, T *restrict y, T c)                                     \
    {                                                                                              \
        WEFT__FOR_EACH(i, n, { y[i] *= c; });                                                      \
    }                                                                                              \
    /* y[i] = x[i] - c, the subtraction in double so that outputs near 0 keep their precision. */  \
    static void row_sub_##sfx(int64_t n, const T *restrict x, double c, T *restrict y)             \
    {                                                                                              \
        WEFT__FOR_EACH(i, n, { y[i] = (T)((double)x[i] - c); });                                   \
    }

ROW_HELPERS(f32, float, weft__exp_f32)
ROW_HELPERS(f64, double, exp_f64)

#define ROW_F32(name) row_##name##_f32
#define ROW_F64(name) row_##name##_f64

/* ---- sum and mean ---------------------------------------------------------------------------- */

/* The input's dims folded into loops, each all reduced or all kept; outermost first. */
typedef struct {
    int ndim; /* at least 1 */
    int64_t size[WEFT_MAX_DIMS];
    int reduced[WEFT_MAX_DIMS];
    int64_t ostride[WEFT_MAX_DIMS]; /* output element stride; 0 for reduced loops */
} rplan_t;

static void rplan_make(int ndim, const int64_t *shape, unsigned mask, rplan_t *p)
{
    int64_t os = 1;

    p->ndim = 0;
    for (int d = 0; d < ndim; d++) {
        const int red = (mask >> d) & 1u;

        if (shape[d] == 1) {
            continue;
        }
        if (p->ndim > 0 && p->reduced[p->ndim - 1] == red) {
            p->size[p->ndim - 1] *= shape[d];
            continue;
        }
        p->size[p->ndim] = shape[d];
        p->reduced[p->ndim] = red;
        p->ndim++;
    }
    if (p->ndim == 0) {
        p->ndim = 1;
        p->size[0] = 1;
        p->reduced[0] = 1;
    }
    for (int k = p->ndim - 1; k >= 0; k--) {
        p->ostride[k] = p->reduced[k] ? 0 : os;
        os *= p->reduced[k] ? 1 : p->size[k];
    }
}

/* Called for each innermost run: n input elements from in_off, output from out_off. */
typedef void (*rrow_cb_t)(void *ctx, int64_t in_off, int64_t out_off, int64_t n, int reduced);

static void rplan_run(const rplan_t *p, rrow_cb_t cb, void *ctx)
{
    const int last = p->ndim - 1;
    const int64_t n = p->size[last];
    int64_t idx[WEFT_MAX_DIMS] = {0};
    int64_t rows = 1;
    int64_t oo = 0;

    for (int d = 0; d < last; d++) {
        rows *= p->size[d];
    }
    if (n == 0) {
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        cb(ctx, r * n, oo, n, p->reduced[last]);
        for (int d = last - 1; d >= 0; d--) {
            if (++idx[d] < p->size[d]) {
                oo += p->ostride[d];
                break;
            }
            oo -= p->ostride[d] * (p->size[d] - 1);
            idx[d] = 0;
        }
    }
}

typedef struct {
    const void *in; /* f32 or f64 */
    int f64;
    double *acc; /* one per output element, zeroed */
} sum_ctx_t;

/* Typed kernels: restrict parameters (not locals) are what let GCC vectorise the loops. */
static void accumulate_f32(int64_t n, const float *restrict x, double *restrict acc)
{
    WEFT__FOR_EACH(i, n, { acc[i] += x[i]; });
}

static void accumulate_f64(int64_t n, const double *restrict x, double *restrict acc)
{
    WEFT__FOR_EACH(i, n, { acc[i] += x[i]; });
}

static void scale_f32(int64_t n, const float *restrict g, float s, float *restrict o)
{
    WEFT__FOR_EACH(i, n, { o[i] = g[i] * s; });
}

static void scale_f64(int64_t n, const double *restrict g, double s, double *restrict o)
{
    WEFT__FOR_EACH(i, n, { o[i] = g[i] * s; });
}

static void sum_row(void *vctx, int64_t in_off, int64_t out_off, int64_t n, int reduced)
{
    sum_ctx_t *c = vctx;
    double *acc = c->acc + out_off;

    if (c->f64) {
        const double *x = (const double *)c->in + in_off;
        if (reduced) {
            acc[0] += row_sum_f64(n, x);
        } else {
            accumulate_f64(n, x, acc);
        }
    } else {
        const float *x = (const float *)c->in + in_off;
        if (reduced) {
            acc[0] += row_sum_f32(n, x);
        } else {
            accumulate_f32(n, x, acc);
        }
    }
}

typedef struct {
    const void *g; /* the output's gradient */
    void *gin;
    int f64;
    double scale;
} expand_ctx_t;

static void expand_row(void *vctx, int64_t in_off, int64_t out_off, int64_t n, int reduced)
{
    expand_ctx_t *c = vctx;

    if (c->f64) {
        const double *g = (const double *)c->g + out_off;
        double *o = (double *)c->gin + in_off;
        if (reduced) {
            const double v = g[0] * c->scale;
            WEFT__FOR_EACH(i, n, { o[i] = v; });
        } else {
            scale_f64(n, g, c->scale, o);
        }
    } else {
        const float *g = (const float *)c->g + out_off;
        float *o = (float *)c->gin + in_off;
        if (reduced) {
            const float v = g[0] * (float)c->scale;
            WEFT__FOR_EACH(i, n, { o[i] = v; });
        } else {
            scale_f32(n, g, (float)c->scale, o);
        }
    }
}

/* iargs[0]: the mask of reduced dims; dargs[0]: 1 for sum, 1 / count for mean. */
static weft_status_t sum_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                  weft_tensor_t **grad_in)
{
    weft_tensor_t *g = grad_out[0];
    weft_tensor_t *gin = NULL;
    rplan_t p;

    if (!weft__ag_needs_grad(n, 0)) {
        return WEFT_OK;
    }
    WEFT_CHECK(weft_tensor_empty(weft_tensor_dtype(g), n->in_ndim[0], n->in_shape[0], &gin));
    rplan_make(n->in_ndim[0], n->in_shape[0], (unsigned)n->iargs[0], &p);
    rplan_run(&p, expand_row,
              &(expand_ctx_t){weft_tensor_data(g), weft_tensor_data(gin),
                              weft_tensor_dtype(g) == WEFT_F64, n->dargs[0]});
    grad_in[0] = gin;
    return WEFT_OK;
}

static weft_status_t sum_mean(const char *op, int mean, weft_tensor_t *a, int n_dims,
                              const int *dims, int keepdim, weft_tensor_t **out_p)
{
    unsigned mask = 0;
    int ndim;
    const int64_t *shape;
    int64_t oshape[WEFT_MAX_DIMS];
    int ond = 0;
    int64_t count = 1;
    weft_tensor_t *out = NULL;
    double *acc = NULL;
    weft__ag_node_t *n = NULL;
    weft_status_t st;
    rplan_t p;

    WEFT_CHECK(weft__op_check_one(op, a, out_p));
    ndim = weft_tensor_ndim(a);
    shape = weft_tensor_shape(a);
    if (n_dims < 0 || n_dims > WEFT_MAX_DIMS || (n_dims > 0 && dims == NULL)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: bad dims (%d given)", op, n_dims);
    }
    for (int k = 0; k < n_dims; k++) {
        int d = 0;

        WEFT_CHECK(wrap_dim(op, ndim, dims[k], &d));
        if ((mask >> d) & 1u) {
            return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: dim %d is repeated", op, dims[k]);
        }
        mask |= 1u << d;
    }
    if (n_dims == 0) {
        mask = (1u << ndim) - 1;
    }
    if (ndim == 0) {
        mask = 0;
    }
    for (int d = 0; d < ndim; d++) {
        if ((mask >> d) & 1u) {
            count *= shape[d];
            if (keepdim) {
                oshape[ond++] = 1;
            }
        } else {
            oshape[ond++] = shape[d];
        }
    }

    const int f64 = weft_tensor_dtype(a) == WEFT_F64;
    const int64_t on = weft_shape_numel(ond, oshape);
    WEFT_CHECK(weft_tensor_create(weft_tensor_dtype(a), ond, oshape, &out));
    if (f64) {
        acc = weft_tensor_data(out);
    } else if (on > 0) {
        acc = weft_calloc((size_t)on, sizeof(double));
        if (acc == NULL) {
            st = weft__set_error(WEFT_ERR_NO_MEMORY, "%s: out of memory", op);
            goto err_release_out;
        }
    }
    if (weft_tensor_numel(a) > 0) {
        rplan_make(ndim, shape, mask, &p);
        rplan_run(&p, sum_row, &(sum_ctx_t){weft_tensor_data(a), f64, acc});
    }
    if (mean) {
        for (int64_t i = 0; i < on; i++) {
            acc[i] /= (double)count;
        }
    }
    if (!f64) {
        float *o = weft_tensor_data(out);
        for (int64_t i = 0; i < on; i++) {
            o[i] = (float)acc[i];
        }
        weft_free(acc);
    }

    WEFT_CHECK_GOTO(
        weft__op_node_begin(mean ? "MeanBackward" : "SumBackward", sum_backward, 1, &a, &n), st,
        err_release_out);
    if (n != NULL) {
        n->iargs[0] = mask;
        n->dargs[0] = mean ? 1.0 / (double)count : 1.0;
        WEFT_CHECK_GOTO(weft__op_node_end(n, WEFT_OK, out), st, err_release_out);
    }
    *out_p = out;
    return WEFT_OK;

err_release_out:
    weft_tensor_release(out);
    return st;
}

weft_status_t weft_op_sum(weft_tensor_t *a, int n_dims, const int *dims, int keepdim,
                          weft_tensor_t **out_p)
{
    return sum_mean("sum", 0, a, n_dims, dims, keepdim, out_p);
}

weft_status_t weft_op_mean(weft_tensor_t *a, int n_dims, const int *dims, int keepdim,
                           weft_tensor_t **out_p)
{
    return sum_mean("mean", 1, a, n_dims, dims, keepdim, out_p);
}

/* ---- ops over one dim ------------------------------------------------------------------------ */

/* @p a viewed as [outer, size, inner] around dim @p dim (wrapped into *dim_p). */
typedef struct {
    int dim;
    int64_t outer;
    int64_t size;
    int64_t inner;
} dimview_t;

static weft_status_t dimview(const char *op, const weft_tensor_t *a, int dim, dimview_t *v)
{
    const int ndim = weft_tensor_ndim(a);
    const int64_t *shape = weft_tensor_shape(a);

    WEFT_CHECK(wrap_dim(op, ndim, dim, &v->dim));
    v->outer = 1;
    v->inner = 1;
    v->size = ndim == 0 ? 1 : shape[v->dim];
    for (int d = 0; d < ndim; d++) {
        if (d < v->dim) {
            v->outer *= shape[d];
        } else if (d > v->dim) {
            v->inner *= shape[d];
        }
    }
    return WEFT_OK;
}

/* The shape of @p a with dim @p dim dropped, or kept as 1. */
static int reduced_shape(const weft_tensor_t *a, int dim, int keepdim, int64_t *shape)
{
    int nd = 0;

    for (int d = 0; d < weft_tensor_ndim(a); d++) {
        if (d != dim) {
            shape[nd++] = weft_tensor_shape(a)[d];
        } else if (keepdim) {
            shape[nd++] = 1;
        }
    }
    return nd;
}

/* ---- max and argmax -------------------------------------------------------------------------- */

/* Maximum over the middle of [outer, size, inner] and the index of its first occurrence; NaN
 * counts as the largest value (as torch). */
#define MAX_LOOP(T)                                                                                \
    do {                                                                                           \
        const T *xs = weft_tensor_data(a);                                                         \
        T *vals = weft_tensor_data(values);                                                        \
        int64_t *idx = weft_tensor_data(indices);                                                  \
        for (int64_t o = 0; o < v.outer; o++) {                                                    \
            const T *x = xs + o * v.size * v.inner;                                                \
            T *vo = vals + o * v.inner;                                                            \
            int64_t *io = idx + o * v.inner;                                                       \
            if (v.inner == 1) {                                                                    \
                T best = x[0];                                                                     \
                int64_t bi = 0;                                                                    \
                for (int64_t r = 1; r < v.size; r++) {                                             \
                    if (x[r] > best || (x[r] != x[r] && best == best)) {                           \
                        best = x[r];                                                               \
                        bi = r;                                                                    \
                    }                                                                              \
                }                                                                                  \
                vo[0] = best;                                                                      \
                io[0] = bi;                                                                        \
                continue;                                                                          \
            }                                                                                      \
            for (int64_t i = 0; i < v.inner; i++) {                                                \
                vo[i] = x[i];                                                                      \
                io[i] = 0;                                                                         \
            }                                                                                      \
            for (int64_t r = 1; r < v.size; r++) {                                                 \
                const T *xr = x + r * v.inner;                                                     \
                for (int64_t i = 0; i < v.inner; i++) {                                            \
                    if (xr[i] > vo[i] || (xr[i] != xr[i] && vo[i] == vo[i])) {                     \
                        vo[i] = xr[i];                                                             \
                        io[i] = r;                                                                 \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    } while (0)

/* Values and indices of the maximum over dim; no graph. */
static weft_status_t max_eval(const char *op, weft_tensor_t *a, int dim, int keepdim,
                              dimview_t *v_p, weft_tensor_t **values_p, weft_tensor_t **indices_p)
{
    int64_t oshape[WEFT_MAX_DIMS];
    int ond;
    weft_tensor_t *values = NULL;
    weft_tensor_t *indices = NULL;
    weft_status_t st;
    dimview_t v;

    WEFT_CHECK(dimview(op, a, dim, &v));
    if (v.size == 0) {
        return weft__set_error(WEFT_ERR_SHAPE, "%s: dim %d has size 0", op, dim);
    }
    ond = reduced_shape(a, v.dim, keepdim, oshape);
    WEFT_CHECK(weft_tensor_empty(weft_tensor_dtype(a), ond, oshape, &values));
    WEFT_CHECK_GOTO(weft_tensor_empty(WEFT_I64, ond, oshape, &indices), st, err_release_values);
    if (weft_tensor_dtype(a) == WEFT_F32) {
        MAX_LOOP(float);
    } else {
        MAX_LOOP(double);
    }
    *v_p = v;
    *values_p = values;
    *indices_p = indices;
    return WEFT_OK;

err_release_values:
    weft_tensor_release(values);
    return st;
}

/* gin[o, idx[o, i], i] = g[o, i]; the rest of gin stays 0. */
#define MAX_GRAD_LOOP(T)                                                                           \
    do {                                                                                           \
        const T *gp = weft_tensor_data(g);                                                         \
        T *gi = weft_tensor_data(gin);                                                             \
        for (int64_t o = 0; o < outer; o++) {                                                      \
            for (int64_t i = 0; i < inner; i++) {                                                  \
                gi[(o * size + idx[o * inner + i]) * inner + i] = gp[o * inner + i];               \
            }                                                                                      \
        }                                                                                          \
    } while (0)

/* iargs[0..2]: outer, size, inner; saved[0]: the i64 indices. */
static weft_status_t max_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                  weft_tensor_t **grad_in)
{
    weft_tensor_t *g = grad_out[0];
    weft_tensor_t *gin = NULL;
    const int64_t outer = n->iargs[0];
    const int64_t size = n->iargs[1];
    const int64_t inner = n->iargs[2];
    const int64_t *idx = weft_tensor_data(n->saved[0]);

    if (!weft__ag_needs_grad(n, 0)) {
        return WEFT_OK;
    }
    WEFT_CHECK(weft__op_zeros(weft_tensor_dtype(g), n->in_ndim[0], n->in_shape[0], &gin));
    if (weft_tensor_dtype(g) == WEFT_F32) {
        MAX_GRAD_LOOP(float);
    } else {
        MAX_GRAD_LOOP(double);
    }
    grad_in[0] = gin;
    return WEFT_OK;
}

weft_status_t weft_op_max(weft_tensor_t *a, int dim, int keepdim, weft_tensor_t **values_p,
                          weft_tensor_t **indices_p)
{
    weft_tensor_t *values = NULL;
    weft_tensor_t *indices = NULL;
    weft__ag_node_t *n = NULL;
    weft_status_t st;
    dimview_t v;

    WEFT_CHECK(weft__op_check_one("max", a, values_p));
    WEFT_CHECK(max_eval("max", a, dim, keepdim, &v, &values, &indices));
    WEFT_CHECK_GOTO(weft__op_node_begin("MaxBackward", max_backward, 1, &a, &n), st, err_release);
    if (n != NULL) {
        n->iargs[0] = v.outer;
        n->iargs[1] = v.size;
        n->iargs[2] = v.inner;
        st = weft__ag_save(n, indices);
        WEFT_CHECK_GOTO(weft__op_node_end(n, st, values), st, err_release);
    }
    *values_p = values;
    if (indices_p != NULL) {
        *indices_p = indices;
    } else {
        weft_tensor_release(indices);
    }
    return WEFT_OK;

err_release:
    weft_tensor_release(indices);
    weft_tensor_release(values);
    return st;
}

weft_status_t weft_op_argmax(weft_tensor_t *a, int dim, int keepdim, weft_tensor_t **out_p)
{
    weft_tensor_t *values = NULL;
    weft_tensor_t *indices = NULL;
    dimview_t v;

    WEFT_CHECK(weft__op_check_one("argmax", a, out_p));
    WEFT_CHECK(max_eval("argmax", a, dim, keepdim, &v, &values, &indices));
    weft_tensor_release(values);
    *out_p = indices;
    return WEFT_OK;
}

/* ---- softmax and log_softmax ----------------------------------------------------------------- */

/*
 * Over the middle of [outer, size, inner]: m = max, s = sum exp(x - m) (in double);
 * softmax y = exp(x - m) / s, log_softmax y = x - (m + log s), the subtraction in double so that
 * f32 outputs near 0 keep their precision. @p tmp holds 2 * inner doubles.
 */
#define SOFTMAX_LOOP(T, ROW)                                                                       \
    do {                                                                                           \
        const T *xs = weft_tensor_data(a);                                                         \
        T *ys = weft_tensor_data(out);                                                             \
        for (int64_t o = 0; o < v.outer && v.size > 0; o++) {                                      \
            const T *restrict x = xs + o * v.size * v.inner;                                       \
            T *restrict y = ys + o * v.size * v.inner;                                             \
            if (v.inner == 1) {                                                                    \
                const T m = ROW(max)(v.size, x);                                                   \
                const double s = ROW(exp)(v.size, x, m, y);                                        \
                if (log_) {                                                                        \
                    ROW(sub)(v.size, x, (double)m + log(s), y);                                    \
                } else {                                                                           \
                    ROW(scale)(v.size, y, (T)(1.0 / s));                                           \
                }                                                                                  \
                continue;                                                                          \
            }                                                                                      \
            T *mx = (T *)(tmp + v.inner);                                                          \
            double *sm = tmp;                                                                      \
            memcpy(mx, x, (size_t)v.inner * sizeof(T));                                            \
            memset(sm, 0, (size_t)v.inner * sizeof(double));                                       \
            for (int64_t r = 1; r < v.size; r++) {                                                 \
                ROW(max_into)(v.inner, x + r * v.inner, mx);                                       \
            }                                                                                      \
            for (int64_t r = 0; r < v.size; r++) {                                                 \
                ROW(exp_acc)(v.inner, x + r * v.inner, mx, y + r * v.inner, sm);                   \
            }                                                                                      \
            for (int64_t i = 0; i < v.inner; i++) {                                                \
                sm[i] = log_ ? (double)mx[i] + log(sm[i]) : 1.0 / sm[i];                           \
            }                                                                                      \
            for (int64_t r = 0; r < v.size; r++) {                                                 \
                if (log_) {                                                                        \
                    ROW(sub_each)(v.inner, x + r * v.inner, sm, y + r * v.inner);                  \
                } else {                                                                           \
                    ROW(scale_each)(v.inner, y + r * v.inner, sm);                                 \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    } while (0)

/*
 * softmax: gin = y (g - sum(g y)); log_softmax: gin = g - exp(y) sum(g), the sums over the dim.
 * @p tmp holds inner doubles.
 */
#define SOFTMAX_GRAD_LOOP(T, EXP)                                                                  \
    do {                                                                                           \
        const T *gs = weft_tensor_data(g);                                                         \
        const T *ys = weft_tensor_data(y_t);                                                       \
        T *os = weft_tensor_data(gin);                                                             \
        for (int64_t o = 0; o < outer; o++) {                                                      \
            const T *restrict gp = gs + o * size * inner;                                          \
            const T *restrict y = ys + o * size * inner;                                           \
            T *restrict gi = os + o * size * inner;                                                \
            for (int64_t i = 0; i < inner; i++) {                                                  \
                tmp[i] = 0;                                                                        \
            }                                                                                      \
            for (int64_t r = 0; r < size; r++) {                                                   \
                for (int64_t i = 0; i < inner; i++) {                                              \
                    tmp[i] += log_ ? gp[r * inner + i] : gp[r * inner + i] * y[r * inner + i];     \
                }                                                                                  \
            }                                                                                      \
            for (int64_t r = 0; r < size; r++) {                                                   \
                for (int64_t i = 0; i < inner; i++) {                                              \
                    const int64_t k = r * inner + i;                                               \
                    const T t = (T)tmp[i];                                                         \
                    gi[k] = log_ ? gp[k] - EXP(y[k]) * t : y[k] * (gp[k] - t);                     \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    } while (0)

/* iargs[0..3]: outer, size, inner, log; saved[0]: the output. */
static weft_status_t softmax_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                      weft_tensor_t **grad_in)
{
    weft_tensor_t *g = grad_out[0];
    const weft_tensor_t *y_t = n->saved[0];
    const int64_t outer = n->iargs[0];
    const int64_t size = n->iargs[1];
    const int64_t inner = n->iargs[2];
    const int log_ = (int)n->iargs[3];
    weft_tensor_t *gin = NULL;
    double *tmp;

    if (!weft__ag_needs_grad(n, 0)) {
        return WEFT_OK;
    }
    tmp = weft_alloc(((size_t)inner + 1) * sizeof(double));
    if (tmp == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "softmax backward: out of memory");
    }
    weft_status_t st = weft__op_empty_like(g, &gin);
    if (st != WEFT_OK) {
        weft_free(tmp);
        return st;
    }
    if (weft_tensor_dtype(g) == WEFT_F32) {
        SOFTMAX_GRAD_LOOP(float, weft__exp_f32);
    } else {
        SOFTMAX_GRAD_LOOP(double, exp);
    }
    weft_free(tmp);
    grad_in[0] = gin;
    return WEFT_OK;
}

static weft_status_t softmax_common(const char *op, int log_, weft_tensor_t *a, int dim,
                                    weft_tensor_t **out_p)
{
    weft_tensor_t *out = NULL;
    weft__ag_node_t *n = NULL;
    double *tmp = NULL;
    weft_status_t st;
    dimview_t v;

    WEFT_CHECK(weft__op_check_one(op, a, out_p));
    WEFT_CHECK(dimview(op, a, dim, &v));
    WEFT_CHECK(weft__op_empty_like(a, &out));
    if (v.inner > 1) {
        tmp = weft_alloc(2 * (size_t)v.inner * sizeof(double));
        if (tmp == NULL) {
            st = weft__set_error(WEFT_ERR_NO_MEMORY, "%s: out of memory", op);
            goto err_release_out;
        }
    }
    if (weft_tensor_dtype(a) == WEFT_F32) {
        SOFTMAX_LOOP(float, ROW_F32);
    } else {
        SOFTMAX_LOOP(double, ROW_F64);
    }
    weft_free(tmp);
    WEFT_CHECK_GOTO(weft__op_node_begin(log_ ? "LogSoftmaxBackward" : "SoftmaxBackward",
                                        softmax_backward, 1, &a, &n),
                    st, err_release_out);
    if (n != NULL) {
        n->iargs[0] = v.outer;
        n->iargs[1] = v.size;
        n->iargs[2] = v.inner;
        n->iargs[3] = log_;
        st = weft__ag_save(n, out);
        WEFT_CHECK_GOTO(weft__op_node_end(n, st, out), st, err_release_out);
    }
    *out_p = out;
    return WEFT_OK;

err_release_out:
    weft_tensor_release(out);
    return st;
}

weft_status_t weft_op_softmax(weft_tensor_t *a, int dim, weft_tensor_t **out_p)
{
    return softmax_common("softmax", 0, a, dim, out_p);
}

weft_status_t weft_op_log_softmax(weft_tensor_t *a, int dim, weft_tensor_t **out_p)
{
    return softmax_common("log_softmax", 1, a, dim, out_p);
}

/* ---- cross entropy --------------------------------------------------------------------------- */

/*
 * Row i: lse[i] = m + log sum exp(x - m), loss[i] = lse[i] - x[label], in double; lse is kept in
 * double for f32 too, so that x - lse keeps its precision in the backward when the logits are
 * large.
 */
#define CE_LOOP(T, ROW)                                                                            \
    do {                                                                                           \
        const T *xs = weft_tensor_data(logits);                                                    \
        double *lse = weft_tensor_data(lse_t);                                                     \
        T *loss = reduction == WEFT_REDUCTION_NONE ? weft_tensor_data(out) : NULL;                 \
        for (int64_t i = 0; i < rows; i++) {                                                       \
            const T *x = xs + i * cls;                                                             \
            const T m = ROW(max)(cls, x);                                                          \
            const double l = (double)m + log(ROW(exp)(cls, x, m, (T *)scratch));                   \
            const double li = l - (double)x[lab[i]];                                               \
            lse[i] = l;                                                                            \
            if (loss != NULL) {                                                                    \
                loss[i] = (T)li;                                                                   \
            }                                                                                      \
            total += li;                                                                           \
        }                                                                                          \
        if (loss == NULL) {                                                                        \
            *(T *)weft_tensor_data(out) =                                                          \
                (T)(reduction == WEFT_REDUCTION_MEAN ? total / (double)rows : total);              \
        }                                                                                          \
    } while (0)

/* gin[i, j] = c_i (exp(x[i, j] - lse[i]) - [j == label[i]]), c_i the weight of row i's loss. */
#define CE_GRAD_LOOP(T, ROW)                                                                       \
    do {                                                                                           \
        const T *xs = weft_tensor_data(n->saved[0]);                                               \
        const double *lse = weft_tensor_data(n->saved[2]);                                         \
        const T *gp = weft_tensor_data(g);                                                         \
        T *os = weft_tensor_data(gin);                                                             \
        for (int64_t i = 0; i < rows; i++) {                                                       \
            T *o = os + i * cls;                                                                   \
            const T c = reduction == WEFT_REDUCTION_NONE   ? gp[i]                                 \
                        : reduction == WEFT_REDUCTION_MEAN ? (T)((double)gp[0] / (double)rows)     \
                                                           : gp[0];                                \
            ROW(sub)(cls, xs + i * cls, lse[i], o);                                                \
            ROW(exp_scale)(cls, o, c);                                                             \
            o[lab[i]] -= c;                                                                        \
        }                                                                                          \
    } while (0)

/* iargs[0..2]: reduction, rows, classes; saved: logits, labels, lse per row (f64). */
static weft_status_t ce_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                 weft_tensor_t **grad_in)
{
    weft_tensor_t *g = grad_out[0];
    const weft_reduction_t reduction = (weft_reduction_t)n->iargs[0];
    const int64_t rows = n->iargs[1];
    const int64_t cls = n->iargs[2];
    const int64_t *lab = weft_tensor_data(n->saved[1]);
    weft_tensor_t *gin = NULL;

    if (!weft__ag_needs_grad(n, 0)) {
        return WEFT_OK;
    }
    WEFT_CHECK(weft__op_empty_like(n->saved[0], &gin));
    if (weft_tensor_dtype(g) == WEFT_F32) {
        CE_GRAD_LOOP(float, ROW_F32);
    } else {
        CE_GRAD_LOOP(double, ROW_F64);
    }
    grad_in[0] = gin;
    return WEFT_OK;
}

weft_status_t weft_op_cross_entropy(weft_tensor_t *logits, weft_tensor_t *labels,
                                    weft_reduction_t reduction, weft_tensor_t **out_p)
{
    weft_tensor_t *out = NULL;
    weft_tensor_t *lse_t = NULL;
    weft__ag_node_t *n = NULL;
    void *scratch = NULL;
    double total = 0;
    weft_status_t st;

    WEFT_CHECK(weft__op_check_one("cross_entropy", logits, out_p));
    WEFT_CHECK(weft__op_check_reduction("cross_entropy", reduction));
    if (labels == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "cross_entropy: NULL labels");
    }
    if (weft_tensor_dtype(labels) != WEFT_I64) {
        return weft__set_error(WEFT_ERR_DTYPE, "cross_entropy: labels must be i64, not %s",
                               weft_dtype_name(weft_tensor_dtype(labels)));
    }
    if (weft_tensor_ndim(logits) != 2) {

        return weft__set_error(WEFT_ERR_SHAPE, "cross_entropy: logits must be [N, C], not %s",
                               weft__tensor_shape_str(logits).s);
    }
    const int64_t rows = weft_tensor_shape(logits)[0];
    const int64_t cls = weft_tensor_shape(logits)[1];
    if (weft_tensor_ndim(labels) != 1 || weft_tensor_shape(labels)[0] != rows) {

        return weft__set_error(WEFT_ERR_SHAPE,
                               "cross_entropy: labels %s do not match logits %s (want [%lld])",
                               weft__tensor_shape_str(labels).s,
                               weft__shape_str(2, weft_tensor_shape(logits)).s, (long long)rows);
    }
    const int64_t *lab = weft_tensor_data(labels);
    for (int64_t i = 0; i < rows; i++) {
        if (lab[i] < 0 || lab[i] >= cls) {
            return weft__set_error(WEFT_ERR_INVALID_ARG,
                                   "cross_entropy: label %lld at position %lld is out of range "
                                   "[0, %lld)",
                                   (long long)lab[i], (long long)i, (long long)cls);
        }
    }

    WEFT_CHECK(weft_tensor_empty(WEFT_F64, 1, &rows, &lse_t));
    WEFT_CHECK_GOTO(weft_tensor_empty(weft_tensor_dtype(logits),
                                      reduction == WEFT_REDUCTION_NONE ? 1 : 0, &rows, &out),
                    st, err_release);
    /* One row of exponentials, written and dropped. */
    scratch = weft_alloc(((size_t)cls + 1) * weft_dtype_size(weft_tensor_dtype(logits)));
    if (scratch == NULL) {
        st = weft__set_error(WEFT_ERR_NO_MEMORY, "cross_entropy: out of memory");
        goto err_release;
    }
    if (weft_tensor_dtype(logits) == WEFT_F32) {
        CE_LOOP(float, ROW_F32);
    } else {
        CE_LOOP(double, ROW_F64);
    }
    weft_free(scratch);
    WEFT_CHECK_GOTO(weft__op_node_begin("CrossEntropyBackward", ce_backward, 1, &logits, &n), st,
                    err_release);
    if (n != NULL) {
        n->iargs[0] = reduction;
        n->iargs[1] = rows;
        n->iargs[2] = cls;
        st = weft__ag_save(n, logits);
        if (st == WEFT_OK) {
            st = weft__ag_save(n, labels);
        }
        if (st == WEFT_OK) {
            st = weft__ag_save(n, lse_t);
        }
        WEFT_CHECK_GOTO(weft__op_node_end(n, st, out), st, err_release);
    }
    weft_tensor_release(lse_t);
    *out_p = out;
    return WEFT_OK;

err_release:
    weft_tensor_release(out);
    weft_tensor_release(lse_t);
    return st;
}

/* ---- mean squared error ---------------------------------------------------------------------- */

#define MSE_LOOP(T)                                                                                \
    do {                                                                                           \
        const T *restrict x = weft_tensor_data(a);                                                 \
        const T *restrict y = weft_tensor_data(b);                                                 \
        if (reduction == WEFT_REDUCTION_NONE) {                                                    \
            T *restrict o = weft_tensor_data(out);                                                 \
            WEFT__FOR_EACH(i, cnt, {                                                               \
                const T d = x[i] - y[i];                                                           \
                o[i] = d * d;                                                                      \
            });                                                                                    \
        } else {                                                                                   \
            double s[4] = {0};                                                                     \
            int64_t i = 0;                                                                         \
            for (; i + 4 <= cnt; i += 4) {                                                         \
                for (int k = 0; k < 4; k++) {                                                      \
                    const double d = (double)x[i + k] - (double)y[i + k];                          \
                    s[k] += d * d;                                                                 \
                }                                                                                  \
            }                                                                                      \
            for (; i < cnt; i++) {                                                                 \
                const double d = (double)x[i] - (double)y[i];                                      \
                s[0] += d * d;                                                                     \
            }                                                                                      \
            const double total = (s[0] + s[1]) + (s[2] + s[3]);                                    \
            *(T *)weft_tensor_data(out) =                                                          \
                (T)(reduction == WEFT_REDUCTION_MEAN ? total / (double)cnt : total);               \
        }                                                                                          \
    } while (0)

/* d(loss)/da = c_i 2 (a - b), d(loss)/db = -that, c_i the weight of element i's loss. */
#define MSE_GRAD_LOOP(T)                                                                           \
    do {                                                                                           \
        const T *restrict x = weft_tensor_data(n->saved[0]);                                       \
        const T *restrict y = weft_tensor_data(n->saved[1]);                                       \
        const T *restrict gp = weft_tensor_data(g);                                                \
        T *restrict ga = gin_a != NULL ? weft_tensor_data(gin_a) : NULL;                           \
        T *restrict gb = gin_b != NULL ? weft_tensor_data(gin_b) : NULL;                           \
        const int none = reduction == WEFT_REDUCTION_NONE;                                         \
        const T c = none ? 0                                                                       \
                         : (T)(2.0 * (double)gp[0] /                                               \
                               (reduction == WEFT_REDUCTION_MEAN ? (double)cnt : 1.0));            \
        WEFT__FOR_EACH(i, cnt, {                                                                   \
            const T v = (none ? 2 * gp[i] : c) * (x[i] - y[i]);                                    \
            if (ga != NULL) {                                                                      \
                ga[i] = v;                                                                         \
            }                                                                                      \
            if (gb != NULL) {                                                                      \
                gb[i] = -v;                                                                        \
            }                                                                                      \
        });                                                                                        \
    } while (0)

/* iargs[0]: reduction; saved: a, b. */
static weft_status_t mse_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                  weft_tensor_t **grad_in)
{
    weft_tensor_t *g = grad_out[0];
    const weft_reduction_t reduction = (weft_reduction_t)n->iargs[0];
    const int64_t cnt = weft_tensor_numel(n->saved[0]);
    weft_tensor_t *gin_a = NULL;
    weft_tensor_t *gin_b = NULL;

    if (weft__ag_needs_grad(n, 0)) {
        WEFT_CHECK(weft__op_empty_like(n->saved[0], &gin_a));
    }
    if (weft__ag_needs_grad(n, 1)) {
        weft_status_t st = weft__op_empty_like(n->saved[1], &gin_b);
        if (st != WEFT_OK) {
            weft_tensor_release(gin_a);
            return st;
        }
    }
    if (weft_tensor_dtype(g) == WEFT_F32) {
        MSE_GRAD_LOOP(float);
    } else {
        MSE_GRAD_LOOP(double);
    }
    grad_in[0] = gin_a;
    grad_in[1] = gin_b;
    return WEFT_OK;
}

weft_status_t weft_op_mse_loss(weft_tensor_t *a, weft_tensor_t *b, weft_reduction_t reduction,
                               weft_tensor_t **out_p)
{
    weft_tensor_t *out = NULL;
    weft__ag_node_t *n = NULL;
    weft_status_t st;

    WEFT_CHECK(weft__op_check_one("mse_loss", a, out_p));
    WEFT_CHECK(weft__op_check_float("mse_loss", b));
    WEFT_CHECK(weft__op_check_reduction("mse_loss", reduction));
    if (weft_tensor_dtype(a) != weft_tensor_dtype(b)) {
        return weft__set_error(WEFT_ERR_DTYPE, "mse_loss: dtypes %s and %s differ",
                               weft_dtype_name(weft_tensor_dtype(a)),
                               weft_dtype_name(weft_tensor_dtype(b)));
    }
    if (weft_tensor_ndim(a) != weft_tensor_ndim(b) ||
        memcmp(weft_tensor_shape(a), weft_tensor_shape(b),
               (size_t)weft_tensor_ndim(a) * sizeof(int64_t)) != 0) {

        return weft__set_error(WEFT_ERR_SHAPE, "mse_loss: shapes %s and %s differ",
                               weft__tensor_shape_str(a).s, weft__tensor_shape_str(b).s);
    }
    const int64_t cnt = weft_tensor_numel(a);
    if (reduction == WEFT_REDUCTION_NONE) {
        WEFT_CHECK(weft__op_empty_like(a, &out));
    } else {
        WEFT_CHECK(weft_tensor_empty(weft_tensor_dtype(a), 0, NULL, &out));
    }
    if (weft_tensor_dtype(a) == WEFT_F32) {
        MSE_LOOP(float);
    } else {
        MSE_LOOP(double);
    }
    WEFT_CHECK_GOTO(
        weft__op_node_begin("MseLossBackward", mse_backward, 2, (weft_tensor_t *[]){a, b}, &n), st,
        err_release_out);
    if (n != NULL) {
        n->iargs[0] = reduction;
        st = weft__ag_save(n, a);
        if (st == WEFT_OK) {
            st = weft__ag_save(n, b);
        }
        WEFT_CHECK_GOTO(weft__op_node_end(n, st, out), st, err_release_out);
    }
    *out_p = out;
    return WEFT_OK;

err_release_out:
    weft_tensor_release(out);
    return st;
}
