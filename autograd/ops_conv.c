/*
 * The image operations of torch's CNNs, NCHW, f32 and f64, each with its backward: conv2d,
 * max/avg/adaptive-avg pooling, batch_norm2d, dropout2d, flatten and nll_loss.
 *
 * conv2d is im2col and one gemm per sample and group: the C / groups channels of a group are
 * unfolded into a [C / groups * kH * kW, OH * OW] matrix (zeros where a window reaches into the
 * padding), which the group's [O / groups, C / groups * kH * kW] weights multiply. A 1x1 kernel
 * with stride 1 and no padding multiplies the input plane directly. Backward recomputes the
 * columns of each sample: dW += dY col^T, and dX is col2im (the adjoint: sums back into the
 * input) of W^T dY; db is the sum of dY over samples and positions.
 *
 * Pooling keeps torch's windows (floor mode): max pooling records the index of the first maximal
 * element of each window (torch's CPU kernel: a later element wins only when it is larger, or
 * NaN), which backward scatters the gradient to; the averages recompute their windows.
 * batch_norm2d accumulates its statistics in double, normalises as torch (y = x a + b with
 * a = invstd w, b = bias - mean a per channel) and keeps the per-channel mean and invstd for
 * backward.
 */
#include <limits.h>
#include <math.h>
#include <string.h>

#include <cblas.h>

#include "graph.h"

#include <weft/ops.h>

/* ---- helpers --------------------------------------------------------------------------------- */

typedef struct {
    int64_t n, c, h, w;
} img_t;

/* x: a CPU f32/f64 [N, C, H, W]; out_p not NULL. */
static weft_status_t check_image(const char *op, const weft_tensor_t *x, weft_tensor_t **out_p,
                                 img_t *im)
{
    const int64_t *s;

    WEFT_CHECK(weft__op_check_one(op, x, out_p));
    if (weft_tensor_ndim(x) != 4) {
        return weft__set_error(WEFT_ERR_SHAPE, "%s: input must be 4-D [N, C, H, W], got %s", op,
                               weft__tensor_shape_str(x).s);
    }
    s = weft_tensor_shape(x);
    im->n = s[0];
    im->c = s[1];
    im->h = s[2];
    im->w = s[3];
    return WEFT_OK;
}

/* @p t (named @p what) is a float tensor of x's dtype. */
static weft_status_t check_like(const char *op, const char *what, const weft_tensor_t *t,
                                const weft_tensor_t *x)
{
    WEFT_CHECK(weft__op_check_float(op, t));
    if (weft_tensor_dtype(t) != weft_tensor_dtype(x)) {
        return weft__set_error(WEFT_ERR_DTYPE, "%s: %s is %s, input %s", op, what,
                               weft_dtype_name(weft_tensor_dtype(t)),
                               weft_dtype_name(weft_tensor_dtype(x)));
    }
    return WEFT_OK;
}

/* @p t is 1-D [c]. */
static weft_status_t check_vec(const char *op, const char *what, const weft_tensor_t *t, int64_t c)
{
    if (weft_tensor_ndim(t) != 1 || weft_tensor_shape(t)[0] != c) {
        return weft__set_error(WEFT_ERR_SHAPE, "%s: %s of shape %s, expected [%lld]", op, what,
                               weft__tensor_shape_str(t).s, (long long)c);
    }
    return WEFT_OK;
}

/* A {height, width} argument: @p def when NULL, else each at least @p lo. */
static weft_status_t pair_arg(const char *op, const char *name, const int64_t *v, int64_t def,
                              int64_t lo, int64_t out[2])
{
    if (v == NULL) {
        out[0] = def;
        out[1] = def;
        return WEFT_OK;
    }
    if (v[0] < lo || v[1] < lo) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: %s {%lld, %lld} must be >= %lld", op,
                               name, (long long)v[0], (long long)v[1], (long long)lo);
    }
    out[0] = v[0];
    out[1] = v[1];
    return WEFT_OK;
}

/* floor((in + 2 pad - dil (k - 1) - 1) / stride) + 1, or 0 when the window does not fit. */
static int64_t out_size(int64_t in, int64_t k, int64_t stride, int64_t pad, int64_t dil)
{
    int64_t span = in + 2 * pad - dil * (k - 1) - 1;

    return span < 0 ? 0 : span / stride + 1;
}

/* ---- conv2d ---------------------------------------------------------------------------------- */

typedef struct {
    int64_t n, c, h, w; /* input */
    int64_t o, kh, kw;  /* weight [o, cg, kh, kw] */
    int64_t sh, sw, ph, pw, dh, dw, groups;
    int64_t cg, og; /* channels per group, in and out */
    int64_t oh, ow; /* output plane */
    int64_t ckk;    /* cg * kh * kw: rows of the columns */
    int64_t l;      /* oh * ow: columns */
    int direct;     /* 1x1, stride 1, no padding: the columns are the input plane */
} conv_geom_t;

/* The range [*lo, *hi) of output positions j whose input position j * s + off lies in [0, n). */
static void valid_range(int64_t n, int64_t s, int64_t off, int64_t outn, int64_t *lo, int64_t *hi)
{
    int64_t a = off >= 0 ? 0 : (-off + s - 1) / s;
    int64_t b = n - off <= 0 ? 0 : (n - off - 1) / s + 1;

    if (b > outn) {
        b = outn;
    }
    if (a > b) {
        a = b;
    }
    *lo = a;
    *hi = b;
}

#define DEFINE_IM2COL(T)                                                                           \
    /* col[(c kh + i) kw + j, oi ow + oj] = x[c, oi sh - ph + i dh, oj sw - pw + j dw] or 0. */    \
    static void im2col_##T(const conv_geom_t *g, const T *restrict x, T *restrict col)             \
    {                                                                                              \
        for (int64_t c = 0; c < g->cg; c++) {                                                      \
            const T *plane = x + c * g->h * g->w;                                                  \
            for (int64_t i = 0; i < g->kh; i++) {                                                  \
                for (int64_t j = 0; j < g->kw; j++) {                                              \
                    T *restrict row = col + ((c * g->kh + i) * g->kw + j) * g->l;                  \
                    const int64_t offw = j * g->dw - g->pw;                                        \
                    int64_t lo;                                                                    \
                    int64_t hi;                                                                    \
                    valid_range(g->w, g->sw, offw, g->ow, &lo, &hi);                               \
                    for (int64_t oi = 0; oi < g->oh; oi++) {                                       \
                        const int64_t ih = oi * g->sh - g->ph + i * g->dh;                         \
                        T *restrict r = row + oi * g->ow;                                          \
                        if (ih < 0 || ih >= g->h) {                                                \
                            memset(r, 0, (size_t)g->ow * sizeof(T));                               \
                            continue;                                                              \
                        }                                                                          \
                        const T *restrict src = plane + ih * g->w;                                 \
                        for (int64_t oj = 0; oj < lo; oj++) {                                      \
                            r[oj] = 0;                                                             \
                        }                                                                          \
                        if (g->sw == 1) {                                                          \
                            for (int64_t oj = lo; oj < hi; oj++) {                                 \
                                r[oj] = src[oj + offw];                                            \
                            }                                                                      \
                        } else {                                                                   \
                            for (int64_t oj = lo; oj < hi; oj++) {                                 \
                                r[oj] = src[oj * g->sw + offw];                                    \
                            }                                                                      \
                        }                                                                          \
                        for (int64_t oj = hi; oj < g->ow; oj++) {                                  \
                            r[oj] = 0;                                                             \
                        }                                                                          \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    /* The adjoint of im2col: dx[c, ih, iw] += col[row, position] for every position inside. */    \
    static void col2im_##T(const conv_geom_t *g, const T *restrict col, T *restrict dx)            \
    {                                                                                              \
        for (int64_t c = 0; c < g->cg; c++) {                                                      \
            T *plane = dx + c * g->h * g->w;                                                       \
            for (int64_t i = 0; i < g->kh; i++) {                                                  \
                for (int64_t j = 0; j < g->kw; j++) {                                              \
                    const T *restrict row = col + ((c * g->kh + i) * g->kw + j) * g->l;            \
                    const int64_t offw = j * g->dw - g->pw;                                        \
                    int64_t lo;                                                                    \
                    int64_t hi;                                                                    \
                    valid_range(g->w, g->sw, offw, g->ow, &lo, &hi);                               \
                    for (int64_t oi = 0; oi < g->oh; oi++) {                                       \
                        const int64_t ih = oi * g->sh - g->ph + i * g->dh;                         \
                        const T *restrict r = row + oi * g->ow;                                    \
                        if (ih < 0 || ih >= g->h) {                                                \
                            continue;                                                              \
                        }                                                                          \
                        T *restrict dst = plane + ih * g->w;                                       \
                        for (int64_t oj = lo; oj < hi; oj++) {                                     \
                            dst[oj * g->sw + offw] += r[oj];                                       \
                        }                                                                          \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    /* Row o of out (l values) = bias[o]. */                                                       \
    static void fill_rows_##T(const T *restrict bias, int64_t rows, int64_t l, T *restrict out)    \
    {                                                                                              \
        for (int64_t o = 0; o < rows; o++) {                                                       \
            for (int64_t k = 0; k < l; k++) {                                                      \
                out[o * l + k] = bias[o];                                                          \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    /* db[o] += sum of row o of g (l values). */                                                   \
    static void sum_rows_##T(const T *restrict g, int64_t rows, int64_t l, T *restrict db)         \
    {                                                                                              \
        for (int64_t o = 0; o < rows; o++) {                                                       \
            T acc = 0;                                                                             \
            for (int64_t k = 0; k < l; k++) {                                                      \
                acc += g[o * l + k];                                                               \
            }                                                                                      \
            db[o] += acc;                                                                          \
        }                                                                                          \
    }
DEFINE_IM2COL(float)
DEFINE_IM2COL(double)

static void im2col(weft_dtype_t dt, const conv_geom_t *g, const void *x, void *col)
{
    if (dt == WEFT_F32) {
        im2col_float(g, x, col);
    } else {
        im2col_double(g, x, col);
    }
}

static void col2im(weft_dtype_t dt, const conv_geom_t *g, const void *col, void *dx)
{
    if (dt == WEFT_F32) {
        col2im_float(g, col, dx);
    } else {
        col2im_double(g, col, dx);
    }
}

/* The geometry from the input and weight shapes and iargs (sh, sw, ph, pw, dh, dw, groups). */
static void conv_geom(const int64_t *xs, const int64_t *ws, const int64_t *a, conv_geom_t *g)
{
    g->n = xs[0];
    g->c = xs[1];
    g->h = xs[2];
    g->w = xs[3];
    g->o = ws[0];
    g->kh = ws[2];
    g->kw = ws[3];
    g->sh = a[0];
    g->sw = a[1];
    g->ph = a[2];
    g->pw = a[3];
    g->dh = a[4];
    g->dw = a[5];
    g->groups = a[6];
    g->cg = g->c / g->groups;
    g->og = g->o / g->groups;
    g->oh = out_size(g->h, g->kh, g->sh, g->ph, g->dh);
    g->ow = out_size(g->w, g->kw, g->sw, g->pw, g->dw);
    g->ckk = g->cg * g->kh * g->kw;
    g->l = g->oh * g->ow;
    g->direct = g->kh == 1 && g->kw == 1 && g->sh == 1 && g->sw == 1 && g->ph == 0 && g->pw == 0;
}

/* A scratch buffer for one group's columns (NULL and no error when the geometry needs none). */
static weft_status_t col_alloc(const char *op, const conv_geom_t *g, weft_dtype_t dt, void **col_p)
{
    *col_p = NULL;
    if (g->direct) {
        return WEFT_OK;
    }
    *col_p = weft_alloc((size_t)(g->ckk * g->l + 1) * weft_dtype_size(dt));
    if (*col_p == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "%s: no memory for %lld x %lld columns", op,
                               (long long)g->ckk, (long long)g->l);
    }
    return WEFT_OK;
}

/* Inputs: x, weight, bias (or NULL). Saved: x, weight. iargs: sh, sw, ph, pw, dh, dw, groups. */
static weft_status_t conv2d_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                     weft_tensor_t **grad_in)
{
    weft_dtype_t dt = n->in_dtype[0];
    size_t es = weft_dtype_size(dt);
    const char *x = weft_tensor_data(n->saved[0]);
    const char *w = weft_tensor_data(n->saved[1]);
    const char *gy = weft_tensor_data(grad_out[0]);
    int need_x = weft__ag_needs_grad(n, 0);
    int need_w = weft__ag_needs_grad(n, 1);
    int need_b = n->n_in == 3 && weft__ag_needs_grad(n, 2);
    weft_tensor_t *gx = NULL;
    weft_tensor_t *gw = NULL;
    weft_tensor_t *gb = NULL;
    void *col = NULL;
    weft_status_t status;
    conv_geom_t g;

    conv_geom(n->in_shape[0], n->in_shape[1], n->iargs, &g);
    if (need_x) {
        WEFT_CHECK_GOTO(weft_tensor_create(dt, 4, n->in_shape[0], &gx), status, err);
    }
    if (need_w) {
        WEFT_CHECK_GOTO(weft_tensor_create(dt, 4, n->in_shape[1], &gw), status, err);
    }
    if (need_b) {
        WEFT_CHECK_GOTO(weft_tensor_create(dt, 1, n->in_shape[2], &gb), status, err);
    }
    if (need_x || need_w) {
        WEFT_CHECK_GOTO(col_alloc("conv2d backward", &g, dt, &col), status, err);
    }
    for (int64_t s = 0; s < g.n; s++) {
        for (int64_t k = 0; k < g.groups; k++) {
            size_t xoff = (size_t)((s * g.c + k * g.cg) * g.h * g.w) * es;
            const char *dy = gy + (size_t)((s * g.o + k * g.og) * g.l) * es;
            const char *wk = w + (size_t)(k * g.og * g.ckk) * es;

            if (need_w) {
                /* dW_k += dY col^T */
                const void *cols = x + xoff;

                if (!g.direct) {
                    im2col(dt, &g, x + xoff, col);
                    cols = col;
                }
                weft__op_gemm(dt, 0, 1, g.og, g.ckk, g.l, dy, cols, 1,
                              (char *)weft_tensor_data(gw) + (size_t)(k * g.og * g.ckk) * es);
            }
            if (need_x) {
                /* dX = col2im(W_k^T dY); each (sample, group) slice of dX is its own. */
                char *dx = (char *)weft_tensor_data(gx) + xoff;

                if (g.direct) {
                    weft__op_gemm(dt, 1, 0, g.ckk, g.l, g.og, wk, dy, 0, dx);
                } else {
                    weft__op_gemm(dt, 1, 0, g.ckk, g.l, g.og, wk, dy, 0, col);
                    col2im(dt, &g, col, dx);
                }
            }
            if (need_b) {
                char *db = (char *)weft_tensor_data(gb) + (size_t)(k * g.og) * es;

                if (dt == WEFT_F32) {
                    sum_rows_float((const float *)dy, g.og, g.l, (float *)db);
                } else {
                    sum_rows_double((const double *)dy, g.og, g.l, (double *)db);
                }
            }
        }
    }
    weft_free(col);
    grad_in[0] = gx;
    grad_in[1] = gw;
    if (n->n_in == 3) {
        grad_in[2] = gb;
    }
    return WEFT_OK;

err:
    weft_free(col);
    weft_tensor_release(gb);
    weft_tensor_release(gw);
    weft_tensor_release(gx);
    return status;
}

weft_status_t weft_op_conv2d(weft_tensor_t *x, weft_tensor_t *weight, weft_tensor_t *bias,
                             const int64_t *stride, const int64_t *padding, const int64_t *dilation,
                             int64_t groups, weft_tensor_t **out_p)
{
    static const char op[] = "conv2d";
    weft_tensor_t *ins[3] = {x, weight, bias};
    int n_in = bias != NULL ? 3 : 2;
    weft_dtype_t dt;
    const int64_t *ws;
    int64_t st[2] = {0, 0};
    int64_t pd[2] = {0, 0};
    int64_t dl[2] = {0, 0};
    int64_t os[4];
    size_t es;
    img_t im;
    conv_geom_t g;
    weft_tensor_t *out = NULL;
    weft__ag_node_t *n = NULL;
    void *col = NULL;
    weft_status_t status;

    WEFT_CHECK(check_image(op, x, out_p, &im));
    WEFT_CHECK(check_like(op, "weight", weight, x));
    if (bias != NULL) {
        WEFT_CHECK(check_like(op, "bias", bias, x));
    }
    WEFT_CHECK(pair_arg(op, "stride", stride, 1, 1, st));
    WEFT_CHECK(pair_arg(op, "padding", padding, 0, 0, pd));
    WEFT_CHECK(pair_arg(op, "dilation", dilation, 1, 1, dl));
    if (groups < 1) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "conv2d: groups = %lld must be >= 1",
                               (long long)groups);
    }
    if (weft_tensor_ndim(weight) != 4) {
        return weft__set_error(WEFT_ERR_SHAPE,
                               "conv2d: weight must be 4-D [out, in / groups, kH, kW], got %s",
                               weft__tensor_shape_str(weight).s);
    }
    ws = weft_tensor_shape(weight);
    if (im.c % groups != 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "conv2d: groups = %lld does not divide the %lld input channels of "
                               "input %s",
                               (long long)groups, (long long)im.c, weft__tensor_shape_str(x).s);
    }
    if (ws[0] % groups != 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "conv2d: groups = %lld does not divide the %lld output channels of "
                               "weight %s",
                               (long long)groups, (long long)ws[0],
                               weft__tensor_shape_str(weight).s);
    }
    if (ws[1] != im.c / groups) {
        return weft__set_error(WEFT_ERR_SHAPE,
                               "conv2d: weight %s does not fit input %s with groups = %lld "
                               "(expected dim 1 = %lld input channels per group)",
                               weft__tensor_shape_str(weight).s, weft__tensor_shape_str(x).s,
                               (long long)groups, (long long)(im.c / groups));
    }
    if (ws[2] < 1 || ws[3] < 1) {
        return weft__set_error(WEFT_ERR_SHAPE, "conv2d: weight %s has an empty kernel",
                               weft__tensor_shape_str(weight).s);
    }
    if (bias != NULL) {
        WEFT_CHECK(check_vec(op, "bias", bias, ws[0]));
    }
    conv_geom(weft_tensor_shape(x), ws,
              (const int64_t[]){st[0], st[1], pd[0], pd[1], dl[0], dl[1], groups}, &g);
    if (g.oh < 1 || g.ow < 1) {
        return weft__set_error(WEFT_ERR_SHAPE,
                               "conv2d: kernel {%lld, %lld} with dilation {%lld, %lld} is larger "
                               "than the padded input {%lld, %lld} of input %s",
                               (long long)g.kh, (long long)g.kw, (long long)g.dh, (long long)g.dw,
                               (long long)(g.h + 2 * g.ph), (long long)(g.w + 2 * g.pw),
                               weft__tensor_shape_str(x).s);
    }
    if (!weft__op_fits_blas(g.ckk) || !weft__op_fits_blas(g.l) || !weft__op_fits_blas(g.og)) {
        return weft__set_error(WEFT_ERR_UNSUPPORTED,
                               "conv2d: input %s and weight %s make matrices too large for BLAS",
                               weft__tensor_shape_str(x).s, weft__tensor_shape_str(weight).s);
    }

    dt = weft_tensor_dtype(x);
    es = weft_dtype_size(dt);
    os[0] = g.n;
    os[1] = g.o;
    os[2] = g.oh;
    os[3] = g.ow;
    WEFT_CHECK(weft_tensor_empty(dt, 4, os, &out));
    WEFT_CHECK_GOTO(col_alloc(op, &g, dt, &col), status, err_release_out);
    for (int64_t s = 0; s < g.n; s++) {
        for (int64_t k = 0; k < g.groups; k++) {
            const char *xk =
                (const char *)weft_tensor_data(x) + (size_t)((s * g.c + k * g.cg) * g.h * g.w) * es;
            const char *wk =
                (const char *)weft_tensor_data(weight) + (size_t)(k * g.og * g.ckk) * es;
            char *yk = (char *)weft_tensor_data(out) + (size_t)((s * g.o + k * g.og) * g.l) * es;

            if (bias != NULL) {
                const char *bk = (const char *)weft_tensor_data(bias) + (size_t)(k * g.og) * es;

                if (dt == WEFT_F32) {
                    fill_rows_float((const float *)bk, g.og, g.l, (float *)yk);
                } else {
                    fill_rows_double((const double *)bk, g.og, g.l, (double *)yk);
                }
            }
            if (!g.direct) {
                im2col(dt, &g, xk, col);
            }
            weft__op_gemm(dt, 0, 0, g.og, g.l, g.ckk, wk, g.direct ? xk : col, bias != NULL ? 1 : 0,
                          yk);
        }
    }
    weft_free(col);
    col = NULL;

    if (weft__ag_should_record(n_in, ins)) {
        WEFT_CHECK_GOTO(weft__ag_node_new("Conv2dBackward", conv2d_backward, n_in, ins, &n), status,
                        err_release_out);
        n->iargs[0] = g.sh;
        n->iargs[1] = g.sw;
        n->iargs[2] = g.ph;
        n->iargs[3] = g.pw;
        n->iargs[4] = g.dh;
        n->iargs[5] = g.dw;
        n->iargs[6] = g.groups;
        status = weft__ag_save(n, x);
        if (status == WEFT_OK) {
            status = weft__ag_save(n, weight);
        }
        WEFT_CHECK_GOTO(weft__op_node_end(n, status, out), status, err_release_out);
    }
    *out_p = out;
    return WEFT_OK;

err_release_out:
    weft_free(col);
    weft_tensor_release(out);
    return status;
}

/* ---- pooling --------------------------------------------------------------------------------- */

typedef struct {
    int64_t kh, kw, sh, sw, ph, pw;
    int64_t oh, ow;
} pool_t;

/* Kernel, stride (NULL: the kernel) and padding (NULL: 0, at most half the kernel), and the
 * output size, which must be at least 1x1. */
static weft_status_t pool_args(const char *op, const weft_tensor_t *x, const img_t *im,
                               const int64_t *kernel, const int64_t *stride, const int64_t *padding,
                               pool_t *p)
{
    int64_t k[2] = {0, 0};
    int64_t s[2] = {0, 0};
    int64_t pd[2] = {0, 0};

    if (kernel == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: NULL kernel", op);
    }
    WEFT_CHECK(pair_arg(op, "kernel", kernel, 0, 1, k));
    if (stride != NULL) {
        WEFT_CHECK(pair_arg(op, "stride", stride, 0, 1, s));
    } else {
        s[0] = k[0];
        s[1] = k[1];
    }
    WEFT_CHECK(pair_arg(op, "padding", padding, 0, 0, pd));
    if (pd[0] > k[0] / 2 || pd[1] > k[1] / 2) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "%s: padding {%lld, %lld} must be at most half the kernel "
                               "{%lld, %lld}",
                               op, (long long)pd[0], (long long)pd[1], (long long)k[0],
                               (long long)k[1]);
    }
    p->kh = k[0];
    p->kw = k[1];
    p->sh = s[0];
    p->sw = s[1];
    p->ph = pd[0];
    p->pw = pd[1];
    p->oh = out_size(im->h, p->kh, p->sh, p->ph, 1);
    p->ow = out_size(im->w, p->kw, p->sw, p->pw, 1);
    if (p->oh < 1 || p->ow < 1) {
        return weft__set_error(WEFT_ERR_SHAPE,
                               "%s: kernel {%lld, %lld} is larger than the padded input "
                               "{%lld, %lld} of input %s",
                               op, (long long)p->kh, (long long)p->kw,
                               (long long)(im->h + 2 * p->ph), (long long)(im->w + 2 * p->pw),
                               weft__tensor_shape_str(x).s);
    }
    return WEFT_OK;
}

/* What a pooling op begins with: @p x checked (an image, into @p im; @p result_p, the op's output
 * argument, not NULL), the pooling arguments into @p p, and an empty output of x's dtype, shape @p
 * os
 * ([N, C, OH, OW]), into @p out_p (the caller releases it). */
static weft_status_t pool_begin(const char *op, weft_tensor_t *x, const int64_t *kernel,
                                const int64_t *stride, const int64_t *padding,
                                weft_tensor_t **result_p, img_t *im, pool_t *p, int64_t *os,
                                weft_tensor_t **out_p)
{
    WEFT_CHECK(check_image(op, x, result_p, im));
    WEFT_CHECK(pool_args(op, x, im, kernel, stride, padding, p));
    os[0] = im->n;
    os[1] = im->c;
    os[2] = p->oh;
    os[3] = p->ow;
    return weft_tensor_empty(weft_tensor_dtype(x), 4, os, out_p);
}

static void pool_to_iargs(const pool_t *p, int64_t *a)
{
    a[0] = p->kh;
    a[1] = p->kw;
    a[2] = p->sh;
    a[3] = p->sw;
    a[4] = p->ph;
    a[5] = p->pw;
    a[6] = p->oh;
    a[7] = p->ow;
}

static void pool_from_iargs(const int64_t *a, pool_t *p)
{
    p->kh = a[0];
    p->kw = a[1];
    p->sh = a[2];
    p->sw = a[3];
    p->ph = a[4];
    p->pw = a[5];
    p->oh = a[6];
    p->ow = a[7];
}

static void release_tensor_ctx(void *ctx)
{
    weft_tensor_release(ctx);
}

#define DEFINE_MAX_POOL(T)                                                                         \
    /* Per plane: out = the window maxima, idx = their flat positions in the plane. */             \
    static void max_pool_##T(const T *restrict x, int64_t planes, int64_t h, int64_t w,            \
                             const pool_t *p, T *restrict out, int64_t *restrict idx)              \
    {                                                                                              \
        for (int64_t c = 0; c < planes; c++) {                                                     \
            const T *restrict in = x + c * h * w;                                                  \
            for (int64_t oi = 0; oi < p->oh; oi++) {                                               \
                int64_t h0 = oi * p->sh - p->ph;                                                   \
                int64_t h1 = h0 + p->kh < h ? h0 + p->kh : h;                                      \
                h0 = h0 < 0 ? 0 : h0;                                                              \
                for (int64_t oj = 0; oj < p->ow; oj++) {                                           \
                    int64_t w0 = oj * p->sw - p->pw;                                               \
                    int64_t w1 = w0 + p->kw < w ? w0 + p->kw : w;                                  \
                    w0 = w0 < 0 ? 0 : w0;                                                          \
                    T best = (T)-INFINITY;                                                         \
                    int64_t at = h0 * w + w0;                                                      \
                    for (int64_t ih = h0; ih < h1; ih++) {                                         \
                        for (int64_t iw = w0; iw < w1; iw++) {                                     \
                            /* branch-free (data-dependent branches mispredict half the time) */   \
                            T v = in[ih * w + iw];                                                 \
                            int take = (v > best) | (v != v);                                      \
                            best = take ? v : best;                                                \
                            at = take ? ih * w + iw : at;                                          \
                        }                                                                          \
                    }                                                                              \
                    *out++ = best;                                                                 \
                    if (idx != NULL) {                                                             \
                        *idx++ = at;                                                               \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    static void max_pool_grad_##T(const T *restrict g, const int64_t *restrict idx,                \
                                  int64_t planes, int64_t plane_in, int64_t plane_out,             \
                                  T *restrict dx)                                                  \
    {                                                                                              \
        for (int64_t c = 0; c < planes; c++) {                                                     \
            for (int64_t k = 0; k < plane_out; k++) {                                              \
                dx[c * plane_in + idx[c * plane_out + k]] += g[c * plane_out + k];                 \
            }                                                                                      \
        }                                                                                          \
    }
DEFINE_MAX_POOL(float)
DEFINE_MAX_POOL(double)

/* Inputs: x. ctx: the i64 indices [N, C, OH, OW]. iargs: pool_to_iargs. */
static weft_status_t max_pool2d_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                         weft_tensor_t **grad_in)
{
    const int64_t *xs = n->in_shape[0];
    int64_t planes = xs[0] * xs[1];
    weft_tensor_t *gx = NULL;
    pool_t p;

    if (!weft__ag_needs_grad(n, 0)) {
        return WEFT_OK;
    }
    pool_from_iargs(n->iargs, &p);
    WEFT_CHECK(weft_tensor_create(n->in_dtype[0], 4, xs, &gx));
    if (n->in_dtype[0] == WEFT_F32) {
        max_pool_grad_float(weft_tensor_data(grad_out[0]), weft_tensor_data(n->ctx), planes,
                            xs[2] * xs[3], p.oh * p.ow, weft_tensor_data(gx));
    } else {
        max_pool_grad_double(weft_tensor_data(grad_out[0]), weft_tensor_data(n->ctx), planes,
                             xs[2] * xs[3], p.oh * p.ow, weft_tensor_data(gx));
    }
    grad_in[0] = gx;
    return WEFT_OK;
}

weft_status_t weft_op_max_pool2d(weft_tensor_t *x, const int64_t *kernel, const int64_t *stride,
                                 const int64_t *padding, weft_tensor_t **out_p)
{
    static const char op[] = "max_pool2d";
    weft_tensor_t *out = NULL;
    weft_tensor_t *idx = NULL;
    weft__ag_node_t *n = NULL;
    int64_t os[4];
    weft_status_t status;
    img_t im;
    pool_t p;

    WEFT_CHECK(pool_begin(op, x, kernel, stride, padding, out_p, &im, &p, os, &out));
    if (weft__ag_should_record(1, &x)) {
        WEFT_CHECK_GOTO(weft_tensor_empty(WEFT_I64, 4, os, &idx), status, err_release);
    }
    if (weft_tensor_dtype(x) == WEFT_F32) {
        max_pool_float(weft_tensor_data(x), im.n * im.c, im.h, im.w, &p, weft_tensor_data(out),
                       idx != NULL ? weft_tensor_data(idx) : NULL);
    } else {
        max_pool_double(weft_tensor_data(x), im.n * im.c, im.h, im.w, &p, weft_tensor_data(out),
                        idx != NULL ? weft_tensor_data(idx) : NULL);
    }
    if (idx != NULL) {
        WEFT_CHECK_GOTO(weft__ag_node_new("MaxPool2dBackward", max_pool2d_backward, 1, &x, &n),
                        status, err_release);
        pool_to_iargs(&p, n->iargs);
        n->ctx = idx; /* the node owns the indices now */
        n->ctx_free = release_tensor_ctx;
        idx = NULL;
        WEFT_CHECK_GOTO(weft__op_node_end(n, WEFT_OK, out), status, err_release);
    }
    *out_p = out;
    return WEFT_OK;

err_release:
    weft_tensor_release(idx);
    weft_tensor_release(out);
    return status;
}

/* One window of average pooling, plane c of [h, w]: grad == 0, out[k] = the window's sum / div;
 * grad == 1, dx gets g[k] / div spread over the window. */
#define DEFINE_POOL_WINDOW(T)                                                                      \
    static inline void pool_window_##T(int grad, const T *restrict x, T *restrict dx, int64_t c,   \
                                       int64_t h, int64_t w, int64_t h0, int64_t h1, int64_t w0,   \
                                       int64_t w1, T div, const T *restrict g, T *restrict out,    \
                                       int64_t k)                                                  \
    {                                                                                              \
        if (grad) {                                                                                \
            const T v = g[k] / div;                                                                \
            T *restrict d = dx + c * h * w;                                                        \
            for (int64_t ih = h0; ih < h1; ih++) {                                                 \
                for (int64_t iw = w0; iw < w1; iw++) {                                             \
                    d[ih * w + iw] += v;                                                           \
                }                                                                                  \
            }                                                                                      \
            return;                                                                                \
        }                                                                                          \
        const T *restrict in = x + c * h * w;                                                      \
        T acc = 0;                                                                                 \
        for (int64_t ih = h0; ih < h1; ih++) {                                                     \
            for (int64_t iw = w0; iw < w1; iw++) {                                                 \
                acc += in[ih * w + iw];                                                            \
            }                                                                                      \
        }                                                                                          \
        out[k] = acc / div;                                                                        \
    }
DEFINE_POOL_WINDOW(float)
DEFINE_POOL_WINDOW(double)

#define DEFINE_AVG_POOL(T)                                                                         \
    /* grad == 0: out = window means of x. grad == 1: dx += g / divisor over each window. */       \
    static void avg_pool_##T(int grad, const T *restrict x, T *restrict dx, int64_t planes,        \
                             int64_t h, int64_t w, const pool_t *p, int include_pad,               \
                             T *restrict out, const T *restrict g)                                 \
    {                                                                                              \
        for (int64_t c = 0; c < planes; c++) {                                                     \
            for (int64_t oi = 0; oi < p->oh; oi++) {                                               \
                int64_t h0 = oi * p->sh - p->ph;                                                   \
                int64_t h1 = h0 + p->kh < h + p->ph ? h0 + p->kh : h + p->ph;                      \
                int64_t ph = h1 - h0;                                                              \
                h0 = h0 < 0 ? 0 : h0;                                                              \
                h1 = h1 < h ? h1 : h;                                                              \
                for (int64_t oj = 0; oj < p->ow; oj++) {                                           \
                    int64_t w0 = oj * p->sw - p->pw;                                               \
                    int64_t w1 = w0 + p->kw < w + p->pw ? w0 + p->kw : w + p->pw;                  \
                    int64_t div = ph * (w1 - w0);                                                  \
                    int64_t k = (c * p->oh + oi) * p->ow + oj;                                     \
                    w0 = w0 < 0 ? 0 : w0;                                                          \
                    w1 = w1 < w ? w1 : w;                                                          \
                    if (h0 >= h1 || w0 >= w1) {                                                    \
                        if (!grad) {                                                               \
                            out[k] = 0;                                                            \
                        }                                                                          \
                        continue;                                                                  \
                    }                                                                              \
                    if (!include_pad) {                                                            \
                        div = (h1 - h0) * (w1 - w0);                                               \
                    }                                                                              \
                    pool_window_##T(grad, x, dx, c, h, w, h0, h1, w0, w1, (T)div, g, out, k);      \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }
DEFINE_AVG_POOL(float)
DEFINE_AVG_POOL(double)

static void avg_pool(int grad, weft_dtype_t dt, const void *x, void *dx, const int64_t *xs,
                     const pool_t *p, int include_pad, void *out, const void *g)
{
    if (dt == WEFT_F32) {
        avg_pool_float(grad, x, dx, xs[0] * xs[1], xs[2], xs[3], p, include_pad, out, g);
    } else {
        avg_pool_double(grad, x, dx, xs[0] * xs[1], xs[2], xs[3], p, include_pad, out, g);
    }
}

/* Inputs: x. iargs: pool_to_iargs, then count_include_pad. */
static weft_status_t avg_pool2d_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                         weft_tensor_t **grad_in)
{
    weft_tensor_t *gx = NULL;
    pool_t p;

    if (!weft__ag_needs_grad(n, 0)) {
        return WEFT_OK;
    }
    pool_from_iargs(n->iargs, &p);
    WEFT_CHECK(weft_tensor_create(n->in_dtype[0], 4, n->in_shape[0], &gx));
    avg_pool(1, n->in_dtype[0], NULL, weft_tensor_data(gx), n->in_shape[0], &p, (int)n->iargs[8],
             NULL, weft_tensor_data(grad_out[0]));
    grad_in[0] = gx;
    return WEFT_OK;
}

weft_status_t weft_op_avg_pool2d(weft_tensor_t *x, const int64_t *kernel, const int64_t *stride,
                                 const int64_t *padding, int count_include_pad,
                                 weft_tensor_t **out_p)
{
    static const char op[] = "avg_pool2d";
    weft_tensor_t *out = NULL;
    weft__ag_node_t *n = NULL;
    int64_t os[4];
    weft_status_t status;
    img_t im;
    pool_t p;

    WEFT_CHECK(pool_begin(op, x, kernel, stride, padding, out_p, &im, &p, os, &out));
    avg_pool(0, weft_tensor_dtype(x), weft_tensor_data(x), NULL, weft_tensor_shape(x), &p,
             count_include_pad != 0, weft_tensor_data(out), NULL);
    WEFT_CHECK_GOTO(weft__op_node_begin("AvgPool2dBackward", avg_pool2d_backward, 1, &x, &n),
                    status, err_release_out);
    if (n != NULL) {
        pool_to_iargs(&p, n->iargs);
        n->iargs[8] = count_include_pad != 0;
        WEFT_CHECK_GOTO(weft__op_node_end(n, WEFT_OK, out), status, err_release_out);
    }
    *out_p = out;
    return WEFT_OK;

err_release_out:
    weft_tensor_release(out);
    return status;
}

#define DEFINE_ADAPTIVE(T)                                                                         \
    /* grad == 0: out = the means of torch's adaptive windows; grad == 1: their adjoint. */        \
    static void adaptive_##T(int grad, const T *restrict x, T *restrict dx, int64_t planes,        \
                             int64_t h, int64_t w, int64_t oh, int64_t ow, T *restrict out,        \
                             const T *restrict g)                                                  \
    {                                                                                              \
        for (int64_t c = 0; c < planes; c++) {                                                     \
            for (int64_t oi = 0; oi < oh; oi++) {                                                  \
                const int64_t h0 = oi * h / oh;                                                    \
                const int64_t h1 = ((oi + 1) * h + oh - 1) / oh;                                   \
                for (int64_t oj = 0; oj < ow; oj++) {                                              \
                    const int64_t w0 = oj * w / ow;                                                \
                    const int64_t w1 = ((oj + 1) * w + ow - 1) / ow;                               \
                    const int64_t k = (c * oh + oi) * ow + oj;                                     \
                    const T div = (T)((h1 - h0) * (w1 - w0));                                      \
                    pool_window_##T(grad, x, dx, c, h, w, h0, h1, w0, w1, div, g, out, k);         \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }
DEFINE_ADAPTIVE(float)
DEFINE_ADAPTIVE(double)

static void adaptive(int grad, weft_dtype_t dt, const void *x, void *dx, const int64_t *xs,
                     int64_t oh, int64_t ow, void *out, const void *g)
{
    if (dt == WEFT_F32) {
        adaptive_float(grad, x, dx, xs[0] * xs[1], xs[2], xs[3], oh, ow, out, g);
    } else {
        adaptive_double(grad, x, dx, xs[0] * xs[1], xs[2], xs[3], oh, ow, out, g);
    }
}

/* Inputs: x. iargs: oh, ow. */
static weft_status_t adaptive_avg_pool2d_backward(weft__ag_node_t *n,
                                                  weft_tensor_t *const *grad_out,
                                                  weft_tensor_t **grad_in)
{
    weft_tensor_t *gx = NULL;

    if (!weft__ag_needs_grad(n, 0)) {
        return WEFT_OK;
    }
    WEFT_CHECK(weft_tensor_create(n->in_dtype[0], 4, n->in_shape[0], &gx));
    adaptive(1, n->in_dtype[0], NULL, weft_tensor_data(gx), n->in_shape[0], n->iargs[0],
             n->iargs[1], NULL, weft_tensor_data(grad_out[0]));
    grad_in[0] = gx;
    return WEFT_OK;
}

weft_status_t weft_op_adaptive_avg_pool2d(weft_tensor_t *x, const int64_t *out_hw,
                                          weft_tensor_t **out_p)
{
    static const char op[] = "adaptive_avg_pool2d";
    weft_tensor_t *out = NULL;
    weft__ag_node_t *n = NULL;
    int64_t hw[2] = {0, 0};
    int64_t os[4];
    weft_status_t status;
    img_t im;

    WEFT_CHECK(check_image(op, x, out_p, &im));
    if (out_hw == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: NULL output size", op);
    }
    WEFT_CHECK(pair_arg(op, "output size", out_hw, 0, 1, hw));
    if (im.h < 1 || im.w < 1) {
        return weft__set_error(WEFT_ERR_SHAPE, "%s: input %s has an empty plane", op,
                               weft__tensor_shape_str(x).s);
    }
    os[0] = im.n;
    os[1] = im.c;
    os[2] = hw[0];
    os[3] = hw[1];
    WEFT_CHECK(weft_tensor_empty(weft_tensor_dtype(x), 4, os, &out));
    adaptive(0, weft_tensor_dtype(x), weft_tensor_data(x), NULL, weft_tensor_shape(x), hw[0], hw[1],
             weft_tensor_data(out), NULL);
    WEFT_CHECK_GOTO(
        weft__op_node_begin("AdaptiveAvgPool2dBackward", adaptive_avg_pool2d_backward, 1, &x, &n),
        status, err_release_out);
    if (n != NULL) {
        n->iargs[0] = hw[0];
        n->iargs[1] = hw[1];
        WEFT_CHECK_GOTO(weft__op_node_end(n, WEFT_OK, out), status, err_release_out);
    }
    *out_p = out;
    return WEFT_OK;

err_release_out:
    weft_tensor_release(out);
    return status;
}

/* ---- batch_norm2d ---------------------------------------------------------------------------- */

#define BN_LANES 8

/* The partial sums of a channel, added in a fixed order. */
static double bn_total(const double *l)
{
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

#define DEFINE_BN(T)                                                                               \
    /* stats[c] = mean and stats[C + c] = biased variance of channel c (two passes, double). */    \
    static void bn_stats_##T(const T *restrict x, int64_t n, int64_t c, int64_t hw,                \
                             double *restrict stats)                                               \
    {                                                                                              \
        const double m = (double)(n * hw);                                                         \
        for (int64_t k = 0; k < c; k++) {                                                          \
            /* BN_LANES partial sums: independent additions the CPU overlaps */                    \
            double sum[BN_LANES] = {0};                                                            \
            double sq[BN_LANES] = {0};                                                             \
            for (int64_t s = 0; s < n; s++) {                                                      \
                const T *restrict p = x + (s * c + k) * hw;                                        \
                int64_t i = 0;                                                                     \
                for (; i + BN_LANES <= hw; i += BN_LANES) {                                        \
                    for (int l = 0; l < BN_LANES; l++) {                                           \
                        sum[l] += (double)p[i + l];                                                \
                    }                                                                              \
                }                                                                                  \
                for (; i < hw; i++) {                                                              \
                    sum[0] += (double)p[i];                                                        \
                }                                                                                  \
            }                                                                                      \
            const double mean = bn_total(sum) / m;                                                 \
            for (int64_t s = 0; s < n; s++) {                                                      \
                const T *restrict p = x + (s * c + k) * hw;                                        \
                int64_t i = 0;                                                                     \
                for (; i + BN_LANES <= hw; i += BN_LANES) {                                        \
                    for (int l = 0; l < BN_LANES; l++) {                                           \
                        const double d = (double)p[i + l] - mean;                                  \
                        sq[l] += d * d;                                                            \
                    }                                                                              \
                }                                                                                  \
                for (; i < hw; i++) {                                                              \
                    const double d = (double)p[i] - mean;                                          \
                    sq[0] += d * d;                                                                \
                }                                                                                  \
            }                                                                                      \
            stats[k] = mean;                                                                       \
            stats[c + k] = bn_total(sq) / m;                                                       \
        }                                                                                          \
    }                                                                                              \
    /* y = x a + b per channel, a = invstd w, b = bias - mean a (torch's transform). */            \
    static void bn_apply_##T(const T *restrict x, int64_t n, int64_t c, int64_t hw,                \
                             const double *restrict mi, const T *w, const T *b, T *restrict y)     \
    {                                                                                              \
        for (int64_t k = 0; k < c; k++) {                                                          \
            const T a = (T)(mi[c + k] * (w != NULL ? (double)w[k] : 1.0));                         \
            const T sh = (T)((b != NULL ? (double)b[k] : 0.0) - mi[k] * (double)a);                \
            for (int64_t s = 0; s < n; s++) {                                                      \
                const T *restrict p = x + (s * c + k) * hw;                                        \
                T *restrict q = y + (s * c + k) * hw;                                              \
                for (int64_t i = 0; i < hw; i++) {                                                 \
                    q[i] = p[i] * a + sh;                                                          \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    /* r = (1 - m) r + m s, the variance made unbiased. */                                         \
    static void bn_running_##T(T *restrict rm, T *restrict rv, const double *restrict stats,       \
                               int64_t c, double momentum, double count)                           \
    {                                                                                              \
        for (int64_t k = 0; k < c; k++) {                                                          \
            rm[k] = (T)((1 - momentum) * (double)rm[k] + momentum * stats[k]);                     \
            rv[k] = (T)((1 - momentum) * (double)rv[k] +                                           \
                        momentum * stats[c + k] * count / (count - 1));                            \
        }                                                                                          \
    }                                                                                              \
    /* dx, dw, db from dy; mi: mean and invstd per channel; batch: through the batch stats. */     \
    static void bn_grad_##T(const T *restrict x, const T *restrict dy, int64_t n, int64_t c,       \
                            int64_t hw, const double *restrict mi, const T *w, int batch,          \
                            T *restrict dx, T *restrict dw, T *restrict db)                        \
    {                                                                                              \
        const double m = (double)(n * hw);                                                         \
        for (int64_t k = 0; k < c; k++) {                                                          \
            const double mean = mi[k];                                                             \
            const double invstd = mi[c + k];                                                       \
            const double g = w != NULL ? (double)w[k] : 1.0;                                       \
            double sdy_l[BN_LANES] = {0};                                                          \
            double sdyx_l[BN_LANES] = {0};                                                         \
            for (int64_t s = 0; s < n; s++) {                                                      \
                const T *restrict p = x + (s * c + k) * hw;                                        \
                const T *restrict q = dy + (s * c + k) * hw;                                       \
                int64_t i = 0;                                                                     \
                for (; i + BN_LANES <= hw; i += BN_LANES) {                                        \
                    for (int l = 0; l < BN_LANES; l++) {                                           \
                        sdy_l[l] += (double)q[i + l];                                              \
                        sdyx_l[l] += (double)q[i + l] * ((double)p[i + l] - mean);                 \
                    }                                                                              \
                }                                                                                  \
                for (; i < hw; i++) {                                                              \
                    sdy_l[0] += (double)q[i];                                                      \
                    sdyx_l[0] += (double)q[i] * ((double)p[i] - mean);                             \
                }                                                                                  \
            }                                                                                      \
            const double sdy = bn_total(sdy_l);                                                    \
            const double sdyx = bn_total(sdyx_l);                                                  \
            if (dw != NULL) {                                                                      \
                dw[k] = (T)(sdyx * invstd);                                                        \
            }                                                                                      \
            if (db != NULL) {                                                                      \
                db[k] = (T)sdy;                                                                    \
            }                                                                                      \
            if (dx == NULL) {                                                                      \
                continue;                                                                          \
            }                                                                                      \
            const double a = g * invstd;                                                           \
            const double mdy = batch ? sdy / m : 0.0;                                              \
            const double kx = batch ? sdyx * invstd * invstd / m : 0.0;                            \
            for (int64_t s = 0; s < n; s++) {                                                      \
                const T *restrict p = x + (s * c + k) * hw;                                        \
                const T *restrict q = dy + (s * c + k) * hw;                                       \
                T *restrict o = dx + (s * c + k) * hw;                                             \
                for (int64_t i = 0; i < hw; i++) {                                                 \
                    o[i] = (T)(a * ((double)q[i] - mdy - ((double)p[i] - mean) * kx));             \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }
DEFINE_BN(float)
DEFINE_BN(double)

/* Inputs: x, weight, bias (either may be NULL). Saved: x, weight, the f64 [2, C] mean and
 * invstd. iargs[0]: training (backward through the batch statistics). */
static weft_status_t batch_norm2d_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                           weft_tensor_t **grad_in)
{
    weft_dtype_t dt = n->in_dtype[0];
    const int64_t *xs = n->in_shape[0];
    const void *w = n->saved[1] != NULL ? weft_tensor_data(n->saved[1]) : NULL;
    int need_w = weft__ag_needs_grad(n, 1);
    int need_b = weft__ag_needs_grad(n, 2);
    weft_tensor_t *gx = NULL;
    weft_tensor_t *gw = NULL;
    weft_tensor_t *gb = NULL;
    weft_status_t status;

    if (weft__ag_needs_grad(n, 0)) {
        WEFT_CHECK_GOTO(weft_tensor_empty(dt, 4, xs, &gx), status, err);
    }
    if (need_w) {
        WEFT_CHECK_GOTO(weft_tensor_empty(dt, 1, n->in_shape[1], &gw), status, err);
    }
    if (need_b) {
        WEFT_CHECK_GOTO(weft_tensor_empty(dt, 1, n->in_shape[2], &gb), status, err);
    }
#define BN_GRAD_CALL(T)                                                                            \
    bn_grad_##T(weft_tensor_data(n->saved[0]), weft_tensor_data(grad_out[0]), xs[0], xs[1],        \
                xs[2] * xs[3], weft_tensor_data(n->saved[2]), w, (int)n->iargs[0],                 \
                gx != NULL ? weft_tensor_data(gx) : NULL,                                          \
                gw != NULL ? weft_tensor_data(gw) : NULL,                                          \
                gb != NULL ? weft_tensor_data(gb) : NULL)
    if (dt == WEFT_F32) {
        BN_GRAD_CALL(float);
    } else {
        BN_GRAD_CALL(double);
    }
#undef BN_GRAD_CALL
    grad_in[0] = gx;
    grad_in[1] = gw;
    grad_in[2] = gb;
    return WEFT_OK;

err:
    weft_tensor_release(gb);
    weft_tensor_release(gw);
    weft_tensor_release(gx);
    return status;
}

weft_status_t weft_op_batch_norm2d(weft_tensor_t *x, weft_tensor_t *weight, weft_tensor_t *bias,
                                   weft_tensor_t *running_mean, weft_tensor_t *running_var,
                                   int training, double momentum, double eps, weft_tensor_t **out_p)
{
    static const char op[] = "batch_norm2d";
    weft_tensor_t *named[4] = {weight, bias, running_mean, running_var};
    static const char *const names[4] = {"weight", "bias", "running_mean", "running_var"};
    weft_tensor_t *ins[3] = {x, weight, bias};
    weft_dtype_t dt;
    int64_t hw;
    int64_t count;
    weft_tensor_t *stats = NULL;
    weft_tensor_t *out = NULL;
    weft__ag_node_t *n = NULL;
    double *mi;
    weft_status_t status;
    img_t im;

    WEFT_CHECK(check_image(op, x, out_p, &im));
    for (int i = 0; i < 4; i++) {
        if (named[i] != NULL) {
            WEFT_CHECK(check_like(op, names[i], named[i], x));
            WEFT_CHECK(check_vec(op, names[i], named[i], im.c));
        }
    }
    if ((running_mean == NULL) != (running_var == NULL)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "%s: running_mean and running_var come together (one is NULL)", op);
    }
    if (!training && running_mean == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "%s: running_mean and running_var are required in eval mode", op);
    }
    if (!(momentum >= 0 && momentum <= 1)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: momentum = %g is outside [0, 1]", op,
                               momentum);
    }
    if (!(eps > 0)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: eps = %g must be > 0", op, eps);
    }
    hw = im.h * im.w;
    count = im.n * hw;
    if (training && count <= 1) {
        return weft__set_error(WEFT_ERR_SHAPE,
                               "%s: expected more than 1 value per channel when training, got "
                               "input %s",
                               op, weft__tensor_shape_str(x).s);
    }
    dt = weft_tensor_dtype(x);

    /* stats: mean, then invstd, per channel. */
    WEFT_CHECK(weft_tensor_empty(WEFT_F64, 2, (const int64_t[]){2, im.c}, &stats));
    mi = weft_tensor_data(stats);
    if (training) {
        if (dt == WEFT_F32) {
            bn_stats_float(weft_tensor_data(x), im.n, im.c, hw, mi);
        } else {
            bn_stats_double(weft_tensor_data(x), im.n, im.c, hw, mi);
        }
        if (running_mean != NULL) {
            if (dt == WEFT_F32) {
                bn_running_float(weft_tensor_data(running_mean), weft_tensor_data(running_var), mi,
                                 im.c, momentum, (double)count);
            } else {
                bn_running_double(weft_tensor_data(running_mean), weft_tensor_data(running_var), mi,
                                  im.c, momentum, (double)count);
            }
        }
    } else {
        for (int64_t k = 0; k < im.c; k++) {
            mi[k] = dt == WEFT_F32 ? (double)((const float *)weft_tensor_data(running_mean))[k]
                                   : ((const double *)weft_tensor_data(running_mean))[k];
            mi[im.c + k] = dt == WEFT_F32
                               ? (double)((const float *)weft_tensor_data(running_var))[k]
                               : ((const double *)weft_tensor_data(running_var))[k];
        }
    }
    for (int64_t k = 0; k < im.c; k++) {
        mi[im.c + k] = 1.0 / sqrt(mi[im.c + k] + eps);
    }
    WEFT_CHECK_GOTO(weft__op_empty_like(x, &out), status, err_release);
    if (dt == WEFT_F32) {
        bn_apply_float(weft_tensor_data(x), im.n, im.c, hw, mi,
                       weight != NULL ? weft_tensor_data(weight) : NULL,
                       bias != NULL ? weft_tensor_data(bias) : NULL, weft_tensor_data(out));
    } else {
        bn_apply_double(weft_tensor_data(x), im.n, im.c, hw, mi,
                        weight != NULL ? weft_tensor_data(weight) : NULL,
                        bias != NULL ? weft_tensor_data(bias) : NULL, weft_tensor_data(out));
    }
    WEFT_CHECK_GOTO(weft__op_node_begin("BatchNorm2dBackward", batch_norm2d_backward, 3, ins, &n),
                    status, err_release);
    if (n != NULL) {
        n->iargs[0] = training != 0;
        status = weft__ag_save(n, x);
        if (status == WEFT_OK) {
            status = weft__ag_save(n, weight);
        }
        if (status == WEFT_OK) {
            status = weft__ag_save(n, stats);
        }
        WEFT_CHECK_GOTO(weft__op_node_end(n, status, out), status, err_release);
    }
    weft_tensor_release(stats);
    *out_p = out;
    return WEFT_OK;

err_release:
    weft_tensor_release(out);
    weft_tensor_release(stats);
    return status;
}

/* ---- dropout2d ------------------------------------------------------------------------------- */

#define DEFINE_CHANNEL_SCALE(T)                                                                    \
    /* o = x * (keep[c] ? s : 0) for each channel c of @p plane elements. */                       \
    static void channel_scale_##T(const T *restrict x, const uint8_t *restrict keep,               \
                                  int64_t channels, int64_t plane, T s, T *restrict o)             \
    {                                                                                              \
        for (int64_t c = 0; c < channels; c++) {                                                   \
            const T f = keep[c] ? s : (T)0;                                                        \
            for (int64_t i = 0; i < plane; i++) {                                                  \
                o[c * plane + i] = x[c * plane + i] * f;                                           \
            }                                                                                      \
        }                                                                                          \
    }
DEFINE_CHANNEL_SCALE(float)
DEFINE_CHANNEL_SCALE(double)

static void channel_scale(weft_dtype_t dt, const void *x, const uint8_t *keep, int64_t channels,
                          int64_t plane, double s, void *o)
{
    if (dt == WEFT_F32) {
        channel_scale_float(x, keep, channels, plane, (float)s, o);
    } else {
        channel_scale_double(x, keep, channels, plane, s, o);
    }
}

/* Inputs: x. Saved: the u8 keep mask [N * C] when iargs[0]; dargs[0]: the scale (1 for the
 * identity, 0 for p == 1). */
static weft_status_t dropout2d_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                        weft_tensor_t **grad_in)
{
    weft_tensor_t *g = grad_out[0];
    const int64_t *xs = n->in_shape[0];
    weft_tensor_t *gx = NULL;

    if (!weft__ag_needs_grad(n, 0)) {
        return WEFT_OK;
    }
    if (n->iargs[0] == 0 && n->dargs[0] == 1) {
        grad_in[0] = weft_tensor_retain(g);
        return WEFT_OK;
    }
    if (n->iargs[0] == 0) {
        WEFT_CHECK(weft__op_zeros(n->in_dtype[0], 4, xs, &gx));
    } else {
        WEFT_CHECK(weft__op_empty_like(g, &gx));
        channel_scale(n->in_dtype[0], weft_tensor_data(g), weft_tensor_data(n->saved[0]),
                      xs[0] * xs[1], xs[2] * xs[3], n->dargs[0], weft_tensor_data(gx));
    }
    grad_in[0] = gx;
    return WEFT_OK;
}

weft_status_t weft_op_dropout2d(weft_tensor_t *x, double p, int training, weft_rng_t *rng,
                                weft_tensor_t **out_p)
{
    static const char op[] = "dropout2d";
    const int drop = training && p > 0 && p < 1;
    weft_tensor_t *out = NULL;
    weft_tensor_t *keep = NULL;
    weft__ag_node_t *n = NULL;
    double scale = 1;
    weft_status_t status;
    img_t im;

    WEFT_CHECK(check_image(op, x, out_p, &im));
    if (!(p >= 0 && p <= 1)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: p = %g is outside [0, 1]", op, p);
    }
    if (training && rng == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: NULL rng while training", op);
    }
    if (!training || p == 0) {
        WEFT_CHECK(weft_tensor_clone(x, &out));
    } else if (p == 1) {
        scale = 0;
        WEFT_CHECK(weft__op_zeros(weft_tensor_dtype(x), 4, weft_tensor_shape(x), &out));
    } else {
        const int64_t channels = im.n * im.c;
        uint8_t *k;

        scale = 1 / (1 - p);
        WEFT_CHECK(weft_tensor_empty(WEFT_U8, 1, &channels, &keep));
        k = weft_tensor_data(keep);
        for (int64_t c = 0; c < channels; c++) {
            k[c] = (uint8_t)(weft_rng_uniform(rng) >= p);
        }
        WEFT_CHECK_GOTO(weft__op_empty_like(x, &out), status, err_release);
        channel_scale(weft_tensor_dtype(x), weft_tensor_data(x), k, channels, im.h * im.w, scale,
                      weft_tensor_data(out));
    }
    WEFT_CHECK_GOTO(weft__op_node_begin("Dropout2dBackward", dropout2d_backward, 1, &x, &n), status,
                    err_release);
    if (n != NULL) {
        n->iargs[0] = drop;
        n->dargs[0] = scale;
        status = drop ? weft__ag_save(n, keep) : WEFT_OK;
        WEFT_CHECK_GOTO(weft__op_node_end(n, status, out), status, err_release);
    }
    weft_tensor_release(keep);
    *out_p = out;
    return WEFT_OK;

err_release:
    weft_tensor_release(out);
    weft_tensor_release(keep);
    return status;
}

/* ---- flatten --------------------------------------------------------------------------------- */

weft_status_t weft_op_flatten(weft_tensor_t *x, int start_dim, int end_dim, weft_tensor_t **out_p)
{
    int nd;
    int s = start_dim;
    int e = end_dim;
    int on = 0;
    int64_t os[WEFT_MAX_DIMS];
    int64_t merged = 1;

    if (x == NULL || out_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "flatten: NULL argument");
    }
    nd = weft_tensor_ndim(x);
    /* A 0-D tensor counts as one dim of size 1, as in torch. */
    const int span = nd > 0 ? nd : 1;
    s = s < 0 ? s + span : s;
    e = e < 0 ? e + span : e;
    if (s < 0 || s >= span || e < 0 || e >= span) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "flatten: dims %d..%d out of range for a tensor of shape %s",
                               start_dim, end_dim, weft__tensor_shape_str(x).s);
    }
    if (s > e) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "flatten: start_dim %d comes after end_dim %d for shape %s",
                               start_dim, end_dim, weft__tensor_shape_str(x).s);
    }
    if (nd == 0) {
        return weft_op_reshape(x, 1, (const int64_t[]){1}, out_p);
    }
    for (int d = 0; d < s; d++) {
        os[on++] = weft_tensor_shape(x)[d];
    }
    for (int d = s; d <= e; d++) {
        merged *= weft_tensor_shape(x)[d];
    }
    os[on++] = merged;
    for (int d = e + 1; d < nd; d++) {
        os[on++] = weft_tensor_shape(x)[d];
    }
    return weft_op_reshape(x, on, os, out_p);
}

/* ---- nll_loss -------------------------------------------------------------------------------- */

#define DEFINE_NLL(T)                                                                              \
    static void nll_##T(const T *restrict x, const int64_t *restrict t, int64_t rows, int64_t cls, \
                        weft_reduction_t reduction, T *restrict out)                               \
    {                                                                                              \
        double total = 0;                                                                          \
        for (int64_t i = 0; i < rows; i++) {                                                       \
            const T v = -x[i * cls + t[i]];                                                        \
            if (reduction == WEFT_REDUCTION_NONE) {                                                \
                out[i] = v;                                                                        \
            }                                                                                      \
            total += (double)v;                                                                    \
        }                                                                                          \
        if (reduction != WEFT_REDUCTION_NONE) {                                                    \
            out[0] = (T)(reduction == WEFT_REDUCTION_MEAN ? total / (double)rows : total);         \
        }                                                                                          \
    }                                                                                              \
    /* dx[i, t[i]] = -c_i (dx zeroed), c_i the weight of row i's loss. */                          \
    static void nll_grad_##T(const T *restrict g, const int64_t *restrict t, int64_t rows,         \
                             int64_t cls, weft_reduction_t reduction, T *restrict dx)              \
    {                                                                                              \
        for (int64_t i = 0; i < rows; i++) {                                                       \
            dx[i * cls + t[i]] = reduction == WEFT_REDUCTION_NONE ? -g[i]                          \
                                 : reduction == WEFT_REDUCTION_MEAN                                \
                                     ? (T)(-(double)g[0] / (double)rows)                           \
                                     : -g[0];                                                      \
        }                                                                                          \
    }
DEFINE_NLL(float)
DEFINE_NLL(double)

/* Inputs: log_probs. Saved: target (a private copy). iargs: reduction. */
static weft_status_t nll_loss_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                       weft_tensor_t **grad_in)
{
    const int64_t rows = n->in_shape[0][0];
    const int64_t cls = n->in_shape[0][1];
    const weft_reduction_t reduction = (weft_reduction_t)n->iargs[0];
    weft_tensor_t *gx = NULL;

    if (!weft__ag_needs_grad(n, 0)) {
        return WEFT_OK;
    }
    WEFT_CHECK(weft_tensor_create(n->in_dtype[0], 2, n->in_shape[0], &gx));
    if (n->in_dtype[0] == WEFT_F32) {
        nll_grad_float(weft_tensor_data(grad_out[0]), weft_tensor_data(n->saved[0]), rows, cls,
                       reduction, weft_tensor_data(gx));
    } else {
        nll_grad_double(weft_tensor_data(grad_out[0]), weft_tensor_data(n->saved[0]), rows, cls,
                        reduction, weft_tensor_data(gx));
    }
    grad_in[0] = gx;
    return WEFT_OK;
}

weft_status_t weft_op_nll_loss(weft_tensor_t *log_probs, weft_tensor_t *target,
                               weft_reduction_t reduction, weft_tensor_t **out_p)
{
    static const char op[] = "nll_loss";
    weft_tensor_t *out = NULL;
    weft__ag_node_t *n = NULL;
    const int64_t *t;
    int64_t rows;
    int64_t cls;
    weft_status_t status;

    WEFT_CHECK(weft__op_check_one(op, log_probs, out_p));
    WEFT_CHECK(weft__op_check_reduction(op, reduction));
    if (target == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: NULL target", op);
    }
    if (weft_tensor_dtype(target) != WEFT_I64) {
        return weft__set_error(WEFT_ERR_DTYPE, "%s: target must be i64, not %s", op,
                               weft_dtype_name(weft_tensor_dtype(target)));
    }
    if (weft_tensor_ndim(log_probs) != 2) {
        return weft__set_error(WEFT_ERR_SHAPE, "%s: log_probs must be [N, C], not %s", op,
                               weft__tensor_shape_str(log_probs).s);
    }
    rows = weft_tensor_shape(log_probs)[0];
    cls = weft_tensor_shape(log_probs)[1];
    if (weft_tensor_ndim(target) != 1 || weft_tensor_shape(target)[0] != rows) {
        return weft__set_error(
            WEFT_ERR_SHAPE, "%s: target %s does not match log_probs %s (want [%lld])", op,
            weft__tensor_shape_str(target).s, weft__tensor_shape_str(log_probs).s, (long long)rows);
    }
    t = weft_tensor_data(target);
    for (int64_t i = 0; i < rows; i++) {
        if (t[i] < 0 || t[i] >= cls) {
            return weft__set_error(WEFT_ERR_INVALID_ARG,
                                   "%s: target %lld at position %lld is out of range [0, %lld)", op,
                                   (long long)t[i], (long long)i, (long long)cls);
        }
    }
    WEFT_CHECK(weft_tensor_empty(weft_tensor_dtype(log_probs),
                                 reduction == WEFT_REDUCTION_NONE ? 1 : 0, &rows, &out));
    if (weft_tensor_dtype(log_probs) == WEFT_F32) {
        nll_float(weft_tensor_data(log_probs), t, rows, cls, reduction, weft_tensor_data(out));
    } else {
        nll_double(weft_tensor_data(log_probs), t, rows, cls, reduction, weft_tensor_data(out));
    }
    WEFT_CHECK_GOTO(weft__op_node_begin("NllLossBackward", nll_loss_backward, 1, &log_probs, &n),
                    status, err_release_out);
    if (n != NULL) {
        n->iargs[0] = reduction;
        status = weft__ag_save(n, target);
        WEFT_CHECK_GOTO(weft__op_node_end(n, status, out), status, err_release_out);
    }
    *out_p = out;
    return WEFT_OK;

err_release_out:
    weft_tensor_release(out);
    return status;
}
