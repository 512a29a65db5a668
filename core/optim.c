/*
 * Optimizer update rules (torch 1.13's SGD, Adagrad, Adam, AdamW) as in-place tensor kernels.
 *
 * Each rule runs over the tensor in chunks of BLOCK elements. A chunk goes through the rule in
 * passes, one per torch operation (in torch's order, each result rounded to the element type as
 * torch rounds it), with the intermediate values in small arrays on the stack: every pass is a
 * simple loop that vectorises, and the branches on the options sit outside the loops.
 */
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "internal.h"

#include <weft/optim.h>

/* ---- loops ----------------------------------------------------------------------------------- */

#define BLOCK ((size_t)64)

/*
 * One pass over a chunk of len <= BLOCK elements. A full chunk runs a loop of constant trip
 * count, which GCC's -O2 vectoriser (the "very cheap" cost model) takes; the last, shorter chunk
 * of a tensor runs the same body in a plain loop.
 */
#define PASS(len, body)                                                                            \
    do {                                                                                           \
        if ((len) == BLOCK) {                                                                      \
            for (size_t i = 0; i < BLOCK; i++) {                                                   \
                body;                                                                              \
            }                                                                                      \
        } else {                                                                                   \
            for (size_t i = 0; i < (len); i++) {                                                   \
                body;                                                                              \
            }                                                                                      \
        }                                                                                          \
    } while (0)

static size_t chunk_len(size_t n, size_t off)
{
    return n - off < BLOCK ? n - off : BLOCK;
}

/*
 * Square roots in place. The vectoriser leaves sqrtf alone under -fmath-errno (the default), so
 * x86-64 takes the SSE instructions, which round the same (correctly) and give NaN for x < 0 too.
 */
static void sqrt_f32(float *x, size_t n)
{
    size_t i = 0;

#if defined(__SSE2__)
    for (; i + 4 <= n; i += 4) {
        _mm_storeu_ps(x + i, _mm_sqrt_ps(_mm_loadu_ps(x + i)));
    }
#endif
    for (; i < n; i++) {
        x[i] = sqrtf(x[i]);
    }
}

static void sqrt_f64(double *x, size_t n)
{
    size_t i = 0;

#if defined(__SSE2__)
    for (; i + 2 <= n; i += 2) {
        _mm_storeu_pd(x + i, _mm_sqrt_pd(_mm_loadu_pd(x + i)));
    }
#endif
    for (; i < n; i++) {
        x[i] = sqrt(x[i]);
    }
}

/* ---- SGD ------------------------------------------------------------------------------------- */

typedef struct {
    double neg_lr;
    double weight_decay;
    double momentum;
    double damp1; /* 1 - dampening */
    int first;    /* step 1: the buffer starts as the gradient */
    int nesterov;
} sgd_coef_t;

/* d = grad (+ wd * param); buf = d or buf * m + (1 - damp) * d; d = buf or d + m * buf;
 * param += -lr * d. */
#define SGD_KERNEL(T, SUF)                                                                         \
    static void sgd_chunk_##SUF(const sgd_coef_t *c, T *restrict p, const T *restrict g,           \
                                T *restrict buf, size_t len)                                       \
    {                                                                                              \
        const T wd = (T)c->weight_decay;                                                           \
        const T mom = (T)c->momentum;                                                              \
        const T damp1 = (T)c->damp1;                                                               \
        const T neg_lr = (T)c->neg_lr;                                                             \
        T d[BLOCK];                                                                                \
                                                                                                   \
        if (c->weight_decay != 0) {                                                                \
            PASS(len, d[i] = g[i] + wd * p[i]);                                                    \
        } else {                                                                                   \
            PASS(len, d[i] = g[i]);                                                                \
        }                                                                                          \
        if (c->momentum != 0) {                                                                    \
            if (c->first) {                                                                        \
                PASS(len, buf[i] = d[i]);                                                          \
            } else {                                                                               \
                PASS(len, buf[i] = buf[i] * mom + damp1 * d[i]);                                   \
            }                                                                                      \
            if (c->nesterov) {                                                                     \
                PASS(len, d[i] = d[i] + mom * buf[i]);                                             \
            } else {                                                                               \
                PASS(len, d[i] = buf[i]);                                                          \
            }                                                                                      \
        }                                                                                          \
        PASS(len, p[i] = p[i] + neg_lr * d[i]);                                                    \
    }                                                                                              \
    static void sgd_##SUF(const sgd_coef_t *c, T *p, const T *g, T *buf, size_t n)                 \
    {                                                                                              \
        for (size_t off = 0; off < n; off += BLOCK) {                                              \
            sgd_chunk_##SUF(c, p + off, g + off, buf == NULL ? NULL : buf + off,                   \
                            chunk_len(n, off));                                                    \
        }                                                                                          \
    }                                                                                              \
    /* A summed sparse row: param += -lr * g. */                                                   \
    static void sgd_row_##SUF(const void *coef, T *restrict p, const T *restrict g,                \
                              T *restrict state, size_t n)                                         \
    {                                                                                              \
        const T neg_lr = (T)((const sgd_coef_t *)coef)->neg_lr;                                    \
                                                                                                   \
        (void)state;                                                                               \
        for (size_t off = 0; off < n; off += BLOCK) {                                              \
            size_t len = chunk_len(n, off);                                                        \
            T *restrict pc = p + off;                                                              \
            const T *restrict gc = g + off;                                                        \
            PASS(len, pc[i] = pc[i] + neg_lr * gc[i]);                                             \
        }                                                                                          \
    }

SGD_KERNEL(float, f32)
SGD_KERNEL(double, f64)

/* ---- Adagrad --------------------------------------------------------------------------------- */

typedef struct {
    double neg_clr; /* -lr / (1 + (step - 1) * lr_decay) */
    double weight_decay;
    double eps;
} adagrad_coef_t;

/* Dense: g (+ wd * param); sum += g * g; param += (-clr * g) / (sqrt(sum) + eps).
 * Sparse rows (torch's sparse branch): sum += g * g; param += -clr * (g / (sqrt(sum) + eps)). */
#define ADAGRAD_KERNEL(T, SUF)                                                                     \
    static void adagrad_chunk_##SUF(const adagrad_coef_t *c, T *restrict p, const T *restrict g,   \
                                    T *restrict s, size_t len)                                     \
    {                                                                                              \
        const T wd = (T)c->weight_decay;                                                           \
        const T eps = (T)c->eps;                                                                   \
        const T neg_clr = (T)c->neg_clr;                                                           \
        T gg[BLOCK];                                                                               \
        T den[BLOCK];                                                                              \
                                                                                                   \
        if (c->weight_decay != 0) {                                                                \
            PASS(len, gg[i] = g[i] + wd * p[i]);                                                   \
        } else {                                                                                   \
            PASS(len, gg[i] = g[i]);                                                               \
        }                                                                                          \
        PASS(len, s[i] = s[i] + gg[i] * gg[i]; den[i] = s[i]);                                     \
        sqrt_##SUF(den, len);                                                                      \
        PASS(len, p[i] = p[i] + neg_clr * gg[i] / (den[i] + eps));                                 \
    }                                                                                              \
    static void adagrad_##SUF(const adagrad_coef_t *c, T *p, const T *g, T *s, size_t n)           \
    {                                                                                              \
        for (size_t off = 0; off < n; off += BLOCK) {                                              \
            adagrad_chunk_##SUF(c, p + off, g + off, s + off, chunk_len(n, off));                  \
        }                                                                                          \
    }                                                                                              \
    static void adagrad_row_chunk_##SUF(const adagrad_coef_t *c, T *restrict p,                    \
                                        const T *restrict g, T *restrict s, size_t len)            \
    {                                                                                              \
        const T eps = (T)c->eps;                                                                   \
        const T neg_clr = (T)c->neg_clr;                                                           \
        T den[BLOCK];                                                                              \
                                                                                                   \
        PASS(len, s[i] = s[i] + g[i] * g[i]; den[i] = s[i]);                                       \
        sqrt_##SUF(den, len);                                                                      \
        PASS(len, p[i] = p[i] + neg_clr * (g[i] / (den[i] + eps)));                                \
    }                                                                                              \
    static void adagrad_row_##SUF(const void *coef, T *p, const T *g, T *s, size_t n)              \
    {                                                                                              \
        for (size_t off = 0; off < n; off += BLOCK) {                                              \
            adagrad_row_chunk_##SUF(coef, p + off, g + off, s + off, chunk_len(n, off));           \
        }                                                                                          \
    }

ADAGRAD_KERNEL(float, f32)
ADAGRAD_KERNEL(double, f64)

/* ---- Adam and AdamW -------------------------------------------------------------------------- */

typedef struct {
    int decoupled; /* AdamW */
    int amsgrad;
    double weight_decay; /* Adam: added to the gradient */
    double param_decay;  /* AdamW: 1 - lr * weight_decay */
    double beta1;
    double one_minus_beta1;
    double beta2;
    double one_minus_beta2;
    double bc2_sqrt; /* sqrt(1 - beta2^step) */
    double eps;
    double neg_step; /* -lr / (1 - beta1^step) */
} adam_coef_t;

/* AdamW: param *= 1 - lr * wd. g (+ wd * param for Adam); m = m * b1 + (1 - b1) * g;
 * v = v * b2 + (1 - b2) * g * g; vmax = max(vmax, v) with amsgrad;
 * param += (-step_size * m) / (sqrt(v or vmax) / sqrt(bc2) + eps). */
#define ADAM_KERNEL(T, SUF)                                                                        \
    static void adam_chunk_##SUF(const adam_coef_t *c, T *restrict p, const T *restrict g,         \
                                 T *restrict m, T *restrict v, T *restrict vmax, size_t len)       \
    {                                                                                              \
        const T wd = (T)c->weight_decay;                                                           \
        const T decay = (T)c->param_decay;                                                         \
        const T b1 = (T)c->beta1;                                                                  \
        const T c1 = (T)c->one_minus_beta1;                                                        \
        const T b2 = (T)c->beta2;                                                                  \
        const T c2 = (T)c->one_minus_beta2;                                                        \
        const T bc2s = (T)c->bc2_sqrt;                                                             \
        const T eps = (T)c->eps;                                                                   \
        const T neg_step = (T)c->neg_step;                                                         \
        T gg[BLOCK];                                                                               \
        T den[BLOCK];                                                                              \
                                                                                                   \
        if (c->decoupled) {                                                                        \
            PASS(len, p[i] = p[i] * decay);                                                        \
        }                                                                                          \
        if (!c->decoupled && c->weight_decay != 0) {                                               \
            PASS(len, gg[i] = g[i] + wd * p[i]);                                                   \
        } else {                                                                                   \
            PASS(len, gg[i] = g[i]);                                                               \
        }                                                                                          \
        PASS(len, m[i] = m[i] * b1 + c1 * gg[i]; v[i] = v[i] * b2 + c2 * gg[i] * gg[i]);           \
        if (c->amsgrad) {                                                                          \
            PASS(len, vmax[i] = (vmax[i] > v[i] || vmax[i] != vmax[i]) ? vmax[i] : v[i];           \
                 den[i] = vmax[i]);                                                                \
        } else {                                                                                   \
            PASS(len, den[i] = v[i]);                                                              \
        }                                                                                          \
        sqrt_##SUF(den, len);                                                                      \
        PASS(len, p[i] = p[i] + neg_step * m[i] / (den[i] / bc2s + eps));                          \
    }                                                                                              \
    static void adam_##SUF(const adam_coef_t *c, T *p, const T *g, T *m, T *v, T *vmax, size_t n)  \
    {                                                                                              \
        for (size_t off = 0; off < n; off += BLOCK) {                                              \
            adam_chunk_##SUF(c, p + off, g + off, m + off, v + off,                                \
                             vmax == NULL ? NULL : vmax + off, chunk_len(n, off));                 \
        }                                                                                          \
    }

ADAM_KERNEL(float, f32)
ADAM_KERNEL(double, f64)

/* ---- sparse rows ----------------------------------------------------------------------------- */

typedef struct {
    int64_t index;
    int64_t pos;
} entry_t;

static int entry_cmp(const void *a, const void *b)
{
    const entry_t *x = a;
    const entry_t *y = b;

    if (x->index != y->index) {
        return x->index < y->index ? -1 : 1;
    }
    return x->pos < y->pos ? -1 : (x->pos > y->pos);
}

/*
 * Applies @p row_fn to each distinct row index with the sum of its gradient rows (torch's
 * coalesce: entries sorted by index, repeated ones summed in order). Allocates everything before
 * it writes, so a failure changes nothing.
 */
#define SPARSE_APPLY(T, SUF)                                                                       \
    static void add_row_##SUF(T *restrict acc, const T *restrict src, size_t n)                    \
    {                                                                                              \
        for (size_t off = 0; off < n; off += BLOCK) {                                              \
            size_t len = chunk_len(n, off);                                                        \
            T *restrict a = acc + off;                                                             \
            const T *restrict s = src + off;                                                       \
            PASS(len, a[i] = a[i] + s[i]);                                                         \
        }                                                                                          \
    }                                                                                              \
    static weft_status_t sparse_apply_##SUF(                                                       \
        const char *fn, void (*row_fn)(const void *, T *, const T *, T *, size_t),                 \
        const void *coef, T *param, const int64_t *idx, const T *rows, T *state, size_t nnz,       \
        size_t d)                                                                                  \
    {                                                                                              \
        entry_t *e;                                                                                \
        T *acc = NULL;                                                                             \
        int dups = 0;                                                                              \
                                                                                                   \
        if (nnz == 0) {                                                                            \
            return WEFT_OK;                                                                        \
        }                                                                                          \
        e = weft_alloc(nnz * sizeof *e);                                                           \
        if (e == NULL) {                                                                           \
            return weft__set_error(WEFT_ERR_NO_MEMORY, "%s: no memory for %zu indices", fn, nnz);  \
        }                                                                                          \
        for (size_t k = 0; k < nnz; k++) {                                                         \
            e[k].index = idx[k];                                                                   \
            e[k].pos = (int64_t)k;                                                                 \
        }                                                                                          \
        qsort(e, nnz, sizeof *e, entry_cmp);                                                       \
        for (size_t k = 1; k < nnz; k++) {                                                         \
            dups |= e[k].index == e[k - 1].index;                                                  \
        }                                                                                          \
        if (dups && d > 0) {                                                                       \
            acc = weft_alloc(d * sizeof *acc);                                                     \
            if (acc == NULL) {                                                                     \
                weft_free(e);                                                                      \
                return weft__set_error(WEFT_ERR_NO_MEMORY, "%s: no memory for a row", fn);         \
            }                                                                                      \
        }                                                                                          \
        for (size_t k = 0, j; k < nnz; k = j) {                                                    \
            const T *g = rows + (size_t)e[k].pos * d;                                              \
            size_t r = (size_t)e[k].index;                                                         \
                                                                                                   \
            for (j = k + 1; j < nnz && e[j].index == e[k].index; j++) {                            \
            }                                                                                      \
            if (j - k > 1 && d > 0) {                                                              \
                memcpy(acc, g, d * sizeof *acc);                                                   \
                for (size_t q = k + 1; q < j; q++) {                                               \
                    add_row_##SUF(acc, rows + (size_t)e[q].pos * d, d);                            \
                }                                                                                  \
                g = acc;                                                                           \
            }                                                                                      \
            row_fn(coef, param + r * d, g, state == NULL ? NULL : state + r * d, d);               \
        }                                                                                          \
        weft_free(acc);                                                                            \
        weft_free(e);                                                                              \
        return WEFT_OK;                                                                            \
    }

SPARSE_APPLY(float, f32)
SPARSE_APPLY(double, f64)

/* ---- checks ---------------------------------------------------------------------------------- */

/* "[3, 4]" */
static void shape_text(const weft_tensor_t *t, char *buf, size_t size)
{
    const int64_t *shape = weft_tensor_shape(t);
    int ndim = weft_tensor_ndim(t);
    size_t o = 0;

    o += (size_t)snprintf(buf, size, "[");
    for (int d = 0; d < ndim && o < size; d++) {
        o += (size_t)snprintf(buf + o, size - o, "%s%" PRId64, d > 0 ? ", " : "", shape[d]);
    }
    if (o < size) {
        snprintf(buf + o, size - o, "]");
    }
}

#define SHAPE_TEXT_MAX (WEFT_MAX_DIMS * 22 + 3)

static int same_shape(const weft_tensor_t *a, const weft_tensor_t *b)
{
    int ndim = weft_tensor_ndim(a);

    if (ndim != weft_tensor_ndim(b)) {
        return 0;
    }
    return ndim == 0 ||
           memcmp(weft_tensor_shape(a), weft_tensor_shape(b), (size_t)ndim * sizeof(int64_t)) == 0;
}

static weft_status_t check_cpu(const char *fn, const weft_tensor_t *t, const char *name)
{
    if (t == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: %s is NULL", fn, name);
    }
    if (weft_tensor_device(t).type != WEFT_DEVICE_CPU) {
        return weft__set_error(WEFT_ERR_UNSUPPORTED, "%s: %s is not a CPU tensor", fn, name);
    }
    return WEFT_OK;
}

static weft_status_t check_param(const char *fn, const weft_tensor_t *param)
{
    weft_dtype_t dt;

    WEFT_CHECK(check_cpu(fn, param, "param"));
    dt = weft_tensor_dtype(param);
    if (dt != WEFT_F32 && dt != WEFT_F64) {
        return weft__set_error(WEFT_ERR_DTYPE, "%s: param is %s; needs f32 or f64", fn,
                               weft_dtype_name(dt));
    }
    return WEFT_OK;
}

/* @p t must be a CPU tensor of param's dtype and shape. */
static weft_status_t check_like(const char *fn, const weft_tensor_t *param, const weft_tensor_t *t,
                                const char *name)
{
    char a[SHAPE_TEXT_MAX];
    char b[SHAPE_TEXT_MAX];

    WEFT_CHECK(check_cpu(fn, t, name));
    if (weft_tensor_dtype(t) != weft_tensor_dtype(param)) {
        return weft__set_error(WEFT_ERR_DTYPE, "%s: %s is %s, param is %s", fn, name,
                               weft_dtype_name(weft_tensor_dtype(t)),
                               weft_dtype_name(weft_tensor_dtype(param)));
    }
    if (!same_shape(t, param)) {
        shape_text(t, a, sizeof a);
        shape_text(param, b, sizeof b);
        return weft__set_error(WEFT_ERR_SHAPE, "%s: %s has shape %s, param %s", fn, name, a, b);
    }
    return WEFT_OK;
}

/* The restrict-qualified loops need distinct buffers. NULL entries are skipped. */
static weft_status_t check_distinct(const char *fn, int n, const weft_tensor_t *const *ts,
                                    const char *const *names)
{
    for (int i = 0; i < n; i++) {
        for (int j = i + 1; j < n; j++) {
            if (ts[i] != NULL && ts[j] != NULL && weft_tensor_nbytes(ts[i]) > 0 &&
                weft_tensor_data(ts[i]) == weft_tensor_data(ts[j])) {
                return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: %s and %s share storage", fn,
                                       names[i], names[j]);
            }
        }
    }
    return WEFT_OK;
}

static weft_status_t check_step(const char *fn, int64_t step)
{
    if (step < 1) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "%s: invalid step %" PRId64 " (the first update is step 1)", fn,
                               step);
    }
    return WEFT_OK;
}

static weft_status_t check_nonneg(const char *fn, const char *name, double v)
{
    if (!(v >= 0)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: invalid %s %g (needs %s >= 0)", fn, name,
                               v, name);
    }
    return WEFT_OK;
}

static weft_status_t check_beta(const char *fn, const char *name, double v)
{
    if (!(v >= 0 && v < 1)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: invalid %s %g (needs 0 <= %s < 1)", fn,
                               name, v, name);
    }
    return WEFT_OK;
}

/*
 * A sparse-row gradient for @p param: i64 indices [nnz] in [0, rows of param) and rows
 * [nnz, param dims 1...] of param's dtype. Sets the count and the elements per row.
 */
static weft_status_t check_sparse(const char *fn, const weft_tensor_t *param,
                                  const weft_tensor_t *indices, const weft_tensor_t *rows,
                                  size_t *nnz_p, size_t *d_p)
{
    int ndim = weft_tensor_ndim(param);
    const int64_t *pshape = weft_tensor_shape(param);
    const int64_t *idx;
    int64_t nnz;
    int64_t d = 1;
    char a[SHAPE_TEXT_MAX];
    char b[SHAPE_TEXT_MAX];

    if (ndim < 1) {
        return weft__set_error(WEFT_ERR_SHAPE, "%s: a sparse gradient needs a param with rows", fn);
    }
    WEFT_CHECK(check_cpu(fn, indices, "indices"));
    WEFT_CHECK(check_cpu(fn, rows, "rows"));
    if (weft_tensor_dtype(indices) != WEFT_I64) {
        return weft__set_error(WEFT_ERR_DTYPE, "%s: indices are %s; need i64", fn,
                               weft_dtype_name(weft_tensor_dtype(indices)));
    }
    if (weft_tensor_ndim(indices) != 1) {
        shape_text(indices, a, sizeof a);
        return weft__set_error(WEFT_ERR_SHAPE, "%s: indices have shape %s; need one dim", fn, a);
    }
    if (weft_tensor_dtype(rows) != weft_tensor_dtype(param)) {
        return weft__set_error(WEFT_ERR_DTYPE, "%s: rows are %s, param is %s", fn,
                               weft_dtype_name(weft_tensor_dtype(rows)),
                               weft_dtype_name(weft_tensor_dtype(param)));
    }
    nnz = weft_tensor_shape(indices)[0];
    if (weft_tensor_ndim(rows) != ndim || weft_tensor_shape(rows)[0] != nnz ||
        (ndim > 1 && memcmp(weft_tensor_shape(rows) + 1, pshape + 1,
                            (size_t)(ndim - 1) * sizeof(int64_t)) != 0)) {
        shape_text(rows, a, sizeof a);
        shape_text(param, b, sizeof b);
        return weft__set_error(WEFT_ERR_SHAPE,
                               "%s: rows have shape %s; need [%" PRId64
                               ", param dims 1...] for %" PRId64 " indices and param %s",
                               fn, a, nnz, nnz, b);
    }
    idx = weft_tensor_data(indices);
    for (int64_t k = 0; k < nnz; k++) {
        if (idx[k] < 0 || idx[k] >= pshape[0]) {
            return weft__set_error(WEFT_ERR_INVALID_ARG,
                                   "%s: index %" PRId64 " at position %" PRId64
                                   " is out of range for %" PRId64 " rows",
                                   fn, idx[k], k, pshape[0]);
        }
    }
    for (int i = 1; i < ndim; i++) {
        d *= pshape[i];
    }
    *nnz_p = (size_t)nnz;
    *d_p = (size_t)d;
    return WEFT_OK;
}

/* ---- SGD ------------------------------------------------------------------------------------- */

weft_optim_sgd_config_t weft_optim_sgd_defaults(void)
{
    weft_optim_sgd_config_t cfg = WEFT_OPTIM_SGD_DEFAULTS;
    return cfg;
}

weft_status_t weft_optim_sgd_config_check(const weft_optim_sgd_config_t *cfg)
{
    static const char fn[] = "sgd";

    if (cfg == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "sgd: config is NULL");
    }
    WEFT_CHECK(check_nonneg(fn, "lr", cfg->lr));
    WEFT_CHECK(check_nonneg(fn, "momentum", cfg->momentum));
    WEFT_CHECK(check_nonneg(fn, "weight_decay", cfg->weight_decay));
    if (cfg->dampening != cfg->dampening) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "sgd: invalid dampening %g", cfg->dampening);
    }
    if (cfg->nesterov && (cfg->momentum <= 0 || cfg->dampening != 0)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "sgd: nesterov needs momentum > 0 and dampening 0 (momentum %g, "
                               "dampening %g)",
                               cfg->momentum, cfg->dampening);
    }
    return WEFT_OK;
}

static sgd_coef_t sgd_coef(const weft_optim_sgd_config_t *cfg, int64_t step)
{
    sgd_coef_t c;
    c.neg_lr = -cfg->lr;
    c.weight_decay = cfg->weight_decay;
    c.momentum = cfg->momentum;
    c.damp1 = 1 - cfg->dampening;
    c.first = step == 1;
    c.nesterov = cfg->nesterov;
    return c;
}

weft_status_t weft_optim_sgd_step(const weft_optim_sgd_config_t *cfg, weft_tensor_t *param,
                                  const weft_tensor_t *grad, weft_tensor_t *momentum_buf,
                                  int64_t step)
{
    static const char fn[] = "sgd";
    static const char *const names[] = {"param", "grad", "momentum_buf"};
    sgd_coef_t c;
    size_t n;
    int has_buf;
    void *buf;

    WEFT_CHECK(weft_optim_sgd_config_check(cfg));
    has_buf = cfg->momentum != 0;
    WEFT_CHECK(check_param(fn, param));
    WEFT_CHECK(check_like(fn, param, grad, "grad"));
    if (has_buf) {
        WEFT_CHECK(check_like(fn, param, momentum_buf, "momentum_buf"));
    }
    WEFT_CHECK(check_step(fn, step));
    WEFT_CHECK(check_distinct(
        fn, 3, (const weft_tensor_t *[]){param, grad, has_buf ? momentum_buf : NULL}, names));

    c = sgd_coef(cfg, step);
    n = (size_t)weft_tensor_numel(param);
    buf = has_buf ? weft_tensor_data(momentum_buf) : NULL;
    if (weft_tensor_dtype(param) == WEFT_F32) {
        sgd_f32(&c, weft_tensor_data(param), weft_tensor_data(grad), buf, n);
    } else {
        sgd_f64(&c, weft_tensor_data(param), weft_tensor_data(grad), buf, n);
    }
    return WEFT_OK;
}

weft_status_t weft_optim_sgd_sparse_step(const weft_optim_sgd_config_t *cfg, weft_tensor_t *param,
                                         const weft_tensor_t *indices, const weft_tensor_t *rows)
{
    static const char fn[] = "sgd (sparse)";
    static const char *const names[] = {"param", "rows"};
    sgd_coef_t c = {0};
    size_t nnz;
    size_t d;

    WEFT_CHECK(weft_optim_sgd_config_check(cfg));
    if (cfg->momentum != 0 || cfg->weight_decay != 0) {
        return weft__set_error(WEFT_ERR_UNSUPPORTED,
                               "%s: sparse gradients take no momentum and no weight decay "
                               "(momentum %g, weight_decay %g)",
                               fn, cfg->momentum, cfg->weight_decay);
    }
    WEFT_CHECK(check_param(fn, param));
    WEFT_CHECK(check_sparse(fn, param, indices, rows, &nnz, &d));
    WEFT_CHECK(check_distinct(fn, 2, (const weft_tensor_t *[]){param, rows}, names));

    c.neg_lr = -cfg->lr;
    if (weft_tensor_dtype(param) == WEFT_F32) {
        return sparse_apply_f32(fn, sgd_row_f32, &c, weft_tensor_data(param),
                                weft_tensor_data(indices), weft_tensor_data(rows), NULL, nnz, d);
    }
    return sparse_apply_f64(fn, sgd_row_f64, &c, weft_tensor_data(param), weft_tensor_data(indices),
                            weft_tensor_data(rows), NULL, nnz, d);
}

/* ---- Adagrad --------------------------------------------------------------------------------- */

weft_optim_adagrad_config_t weft_optim_adagrad_defaults(void)
{
    weft_optim_adagrad_config_t cfg = WEFT_OPTIM_ADAGRAD_DEFAULTS;
    return cfg;
}

weft_status_t weft_optim_adagrad_config_check(const weft_optim_adagrad_config_t *cfg)
{
    static const char fn[] = "adagrad";

    if (cfg == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "adagrad: config is NULL");
    }
    WEFT_CHECK(check_nonneg(fn, "lr", cfg->lr));
    WEFT_CHECK(check_nonneg(fn, "lr_decay", cfg->lr_decay));
    WEFT_CHECK(check_nonneg(fn, "weight_decay", cfg->weight_decay));
    WEFT_CHECK(check_nonneg(fn, "initial_accumulator_value", cfg->initial_accumulator_value));
    WEFT_CHECK(check_nonneg(fn, "eps", cfg->eps));
    return WEFT_OK;
}

static adagrad_coef_t adagrad_coef(const weft_optim_adagrad_config_t *cfg, int64_t step)
{
    adagrad_coef_t c;

    /* torch: clr = lr / (1 + (step - 1) * lr_decay), in double */
    c.neg_clr = -(cfg->lr / (1 + (double)(step - 1) * cfg->lr_decay));
    c.weight_decay = cfg->weight_decay;
    c.eps = cfg->eps;
    return c;
}

weft_status_t weft_optim_adagrad_step(const weft_optim_adagrad_config_t *cfg, weft_tensor_t *param,
                                      const weft_tensor_t *grad, weft_tensor_t *sum, int64_t step)
{
    static const char fn[] = "adagrad";
    static const char *const names[] = {"param", "grad", "sum"};
    adagrad_coef_t c;
    size_t n;

    WEFT_CHECK(weft_optim_adagrad_config_check(cfg));
    WEFT_CHECK(check_param(fn, param));
    WEFT_CHECK(check_like(fn, param, grad, "grad"));
    WEFT_CHECK(check_like(fn, param, sum, "sum"));
    WEFT_CHECK(check_step(fn, step));
    WEFT_CHECK(check_distinct(fn, 3, (const weft_tensor_t *[]){param, grad, sum}, names));

    c = adagrad_coef(cfg, step);
    n = (size_t)weft_tensor_numel(param);
    if (weft_tensor_dtype(param) == WEFT_F32) {
        adagrad_f32(&c, weft_tensor_data(param), weft_tensor_data(grad), weft_tensor_data(sum), n);
    } else {
        adagrad_f64(&c, weft_tensor_data(param), weft_tensor_data(grad), weft_tensor_data(sum), n);
    }
    return WEFT_OK;
}

weft_status_t weft_optim_adagrad_sparse_step(const weft_optim_adagrad_config_t *cfg,
                                             weft_tensor_t *param, const weft_tensor_t *indices,
                                             const weft_tensor_t *rows, weft_tensor_t *sum,
                                             int64_t step)
{
    static const char fn[] = "adagrad (sparse)";
    static const char *const names[] = {"param", "rows", "sum"};
    adagrad_coef_t c;
    size_t nnz;
    size_t d;

    WEFT_CHECK(weft_optim_adagrad_config_check(cfg));
    if (cfg->weight_decay != 0) {
        return weft__set_error(WEFT_ERR_UNSUPPORTED,
                               "%s: weight_decay %g is not compatible with sparse gradients", fn,
                               cfg->weight_decay);
    }
    WEFT_CHECK(check_param(fn, param));
    WEFT_CHECK(check_sparse(fn, param, indices, rows, &nnz, &d));
    WEFT_CHECK(check_like(fn, param, sum, "sum"));
    WEFT_CHECK(check_step(fn, step));
    WEFT_CHECK(check_distinct(fn, 3, (const weft_tensor_t *[]){param, rows, sum}, names));

    c = adagrad_coef(cfg, step);
    if (weft_tensor_dtype(param) == WEFT_F32) {
        return sparse_apply_f32(fn, adagrad_row_f32, &c, weft_tensor_data(param),
                                weft_tensor_data(indices), weft_tensor_data(rows),
                                weft_tensor_data(sum), nnz, d);
    }
    return sparse_apply_f64(fn, adagrad_row_f64, &c, weft_tensor_data(param),
                            weft_tensor_data(indices), weft_tensor_data(rows),
                            weft_tensor_data(sum), nnz, d);
}

/* ---- Adam and AdamW -------------------------------------------------------------------------- */

weft_optim_adam_config_t weft_optim_adam_defaults(void)
{
    weft_optim_adam_config_t cfg = WEFT_OPTIM_ADAM_DEFAULTS;
    return cfg;
}

weft_optim_adam_config_t weft_optim_adamw_defaults(void)
{
    weft_optim_adam_config_t cfg = WEFT_OPTIM_ADAMW_DEFAULTS;
    return cfg;
}

static weft_status_t adam_config_check(const char *fn, const weft_optim_adam_config_t *cfg)
{
    if (cfg == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: config is NULL", fn);
    }
    WEFT_CHECK(check_nonneg(fn, "lr", cfg->lr));
    WEFT_CHECK(check_nonneg(fn, "eps", cfg->eps));
    WEFT_CHECK(check_beta(fn, "beta1", cfg->beta1));
    WEFT_CHECK(check_beta(fn, "beta2", cfg->beta2));
    WEFT_CHECK(check_nonneg(fn, "weight_decay", cfg->weight_decay));
    return WEFT_OK;
}

weft_status_t weft_optim_adam_config_check(const weft_optim_adam_config_t *cfg)
{
    return adam_config_check("adam", cfg);
}

static adam_coef_t adam_coef(const weft_optim_adam_config_t *cfg, int decoupled, int64_t step)
{
    adam_coef_t c;
    /* torch computes these in double from the step count (a float there; exact up to 2^24). */
    c.decoupled = decoupled;
    c.amsgrad = cfg->amsgrad;
    c.weight_decay = cfg->weight_decay;
    c.param_decay = 1 - cfg->lr * cfg->weight_decay;
    c.beta1 = cfg->beta1;
    c.one_minus_beta1 = 1 - cfg->beta1;
    c.beta2 = cfg->beta2;
    c.one_minus_beta2 = 1 - cfg->beta2;
    c.bc2_sqrt = sqrt(1 - pow(cfg->beta2, (double)step));
    c.eps = cfg->eps;
    c.neg_step = -(cfg->lr / (1 - pow(cfg->beta1, (double)step)));
    return c;
}

static weft_status_t adam_step(const char *fn, int decoupled, const weft_optim_adam_config_t *cfg,
                               weft_tensor_t *param, const weft_tensor_t *grad,
                               weft_tensor_t *exp_avg, weft_tensor_t *exp_avg_sq,
                               weft_tensor_t *max_exp_avg_sq, int64_t step)
{
    static const char *const names[] = {"param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
    adam_coef_t c;
    size_t n;
    weft_tensor_t *vmax;

    WEFT_CHECK(adam_config_check(fn, cfg));
    vmax = cfg->amsgrad ? max_exp_avg_sq : NULL;
    WEFT_CHECK(check_param(fn, param));
    WEFT_CHECK(check_like(fn, param, grad, "grad"));
    WEFT_CHECK(check_like(fn, param, exp_avg, "exp_avg"));
    WEFT_CHECK(check_like(fn, param, exp_avg_sq, "exp_avg_sq"));
    if (cfg->amsgrad) {
        WEFT_CHECK(check_like(fn, param, max_exp_avg_sq, "max_exp_avg_sq"));
    }
    WEFT_CHECK(check_step(fn, step));
    WEFT_CHECK(check_distinct(
        fn, 5, (const weft_tensor_t *[]){param, grad, exp_avg, exp_avg_sq, vmax}, names));

    c = adam_coef(cfg, decoupled, step);
    n = (size_t)weft_tensor_numel(param);
    if (weft_tensor_dtype(param) == WEFT_F32) {
        adam_f32(&c, weft_tensor_data(param), weft_tensor_data(grad), weft_tensor_data(exp_avg),
                 weft_tensor_data(exp_avg_sq), vmax == NULL ? NULL : weft_tensor_data(vmax), n);
    } else {
        adam_f64(&c, weft_tensor_data(param), weft_tensor_data(grad), weft_tensor_data(exp_avg),
                 weft_tensor_data(exp_avg_sq), vmax == NULL ? NULL : weft_tensor_data(vmax), n);
    }
    return WEFT_OK;
}

weft_status_t weft_optim_adam_step(const weft_optim_adam_config_t *cfg, weft_tensor_t *param,
                                   const weft_tensor_t *grad, weft_tensor_t *exp_avg,
                                   weft_tensor_t *exp_avg_sq, weft_tensor_t *max_exp_avg_sq,
                                   int64_t step)
{
    return adam_step("adam", 0, cfg, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step);
}

weft_status_t weft_optim_adamw_step(const weft_optim_adam_config_t *cfg, weft_tensor_t *param,
                                    const weft_tensor_t *grad, weft_tensor_t *exp_avg,
                                    weft_tensor_t *exp_avg_sq, weft_tensor_t *max_exp_avg_sq,
                                    int64_t step)
{
    return adam_step("adamw", 1, cfg, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step);
}

/* ---- raw f32 kernels (core/internal.h) ------------------------------------------------------- */

void weft__optim_sgd_f32(const weft_optim_sgd_config_t *cfg, float *param, const float *grad,
                         float *momentum_buf, size_t n, int64_t step)
{
    sgd_coef_t c = sgd_coef(cfg, step);
    sgd_f32(&c, param, grad, cfg->momentum != 0 ? momentum_buf : NULL, n);
}

void weft__optim_adagrad_f32(const weft_optim_adagrad_config_t *cfg, float *param,
                             const float *grad, float *sum, size_t n, int64_t step)
{
    adagrad_coef_t c = adagrad_coef(cfg, step);
    adagrad_f32(&c, param, grad, sum, n);
}

void weft__optim_adam_f32(const weft_optim_adam_config_t *cfg, int decoupled, float *param,
                          const float *grad, float *exp_avg, float *exp_avg_sq,
                          float *max_exp_avg_sq, size_t n, int64_t step)
{
    adam_coef_t c = adam_coef(cfg, decoupled, step);
    adam_f32(&c, param, grad, exp_avg, exp_avg_sq, cfg->amsgrad ? max_exp_avg_sq : NULL, n);
}
