/*
 * Shapes and indexing: reshape (a view), transpose and permute (copies), concat, split, chunk and
 * index_select. The copies work on any dtype (by element size); gradients flow for f32 and f64.
 *
 * permute copies with its dims simplified first (size-1 dims dropped, dims that stay adjacent in
 * the input merged): when the input's innermost dim stays innermost it copies runs with memcpy,
 * otherwise it moves 32x32 tiles between the output's innermost dim and the input's, so that
 * both sides are read and written a cache line at a time.
 */
#include <string.h>

#include "graph.h"

#include <weft/ops.h>

/* ---- helpers --------------------------------------------------------------------------------- */

/* A dim in [-ndim, ndim) as an index in [0, ndim). */
static weft_status_t norm_dim(const char *op, int dim, int ndim, int *dim_p)
{
    if (dim < -ndim || dim >= ndim) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "%s: dim %d is out of range for a tensor of %d dims", op, dim, ndim);
    }
    *dim_p = dim < 0 ? dim + ndim : dim;
    return WEFT_OK;
}

static int64_t prod(int from, int to, const int64_t *shape)
{
    int64_t p = 1;

    for (int i = from; i < to; i++) {
        p *= shape[i];
    }
    return p;
}

/*
 * Records node @p name over @p ins, saving @p save, with @p ctx (owned by the node from here on;
 * freed here if no node could be made) and the op arguments @p iargs, and attaches it to @p outs.
 */
static weft_status_t record(const char *name, weft__ag_backward_cb_t bw, int n_in,
                            weft_tensor_t *const *ins, int n_save, weft_tensor_t *const *save,
                            int n_iargs, const int64_t *iargs, void *ctx, int n_out,
                            weft_tensor_t *const *outs)
{
    weft__ag_node_t *n = NULL;
    weft_status_t status;

    status = weft__ag_node_new(name, bw, n_in, ins, &n);
    if (status != WEFT_OK) {
        weft_free(ctx);
        return status;
    }
    if (ctx != NULL) {
        n->ctx = ctx;
        n->ctx_free = weft_free;
    }
    for (int i = 0; i < n_iargs; i++) {
        n->iargs[i] = iargs[i];
    }
    for (int i = 0; i < n_save && status == WEFT_OK; i++) {
        status = weft__ag_save(n, save[i]);
    }
    if (status == WEFT_OK) {
        status = weft__ag_attach(n, n_out, outs);
    }
    weft__ag_node_unref(n);
    return status;
}

/* For each of @p outer rows, copies @p len bytes from @p src (row pitch @p sp) to @p dst
 * (row pitch @p dp). */
static void copy_rows(char *dst, size_t dp, const char *src, size_t sp, int64_t outer, size_t len)
{
    if (len == 0) {
        return;
    }
    if (dp == len && sp == len) {
        memcpy(dst, src, (size_t)outer * len);
        return;
    }
    for (int64_t o = 0; o < outer; o++) {
        memcpy(dst + (size_t)o * dp, src + (size_t)o * sp, len);
    }
}

/* ---- reshape --------------------------------------------------------------------------------- */

static weft_status_t reshape_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                      weft_tensor_t **grad_in)
{
    return weft_tensor_view(grad_out[0], n->in_ndim[0], n->in_shape[0], &grad_in[0]);
}

weft_status_t weft_op_reshape(weft_tensor_t *a, int ndim, const int64_t *shape,
                              weft_tensor_t **out_p)
{
    int64_t s[WEFT_MAX_DIMS];
    int64_t known = 1;
    int64_t numel;
    int infer = -1;
    weft_tensor_t *out = NULL;
    weft_status_t status;

    if (a == NULL || out_p == NULL || (ndim > 0 && shape == NULL)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "reshape: NULL argument");
    }
    if (ndim < 0 || ndim > WEFT_MAX_DIMS) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "reshape: %d dims (at most %d)", ndim,
                               WEFT_MAX_DIMS);
    }
    numel = weft_tensor_numel(a);
    for (int i = 0; i < ndim; i++) {
        s[i] = shape[i];
        if (shape[i] == -1) {
            if (infer >= 0) {
                return weft__set_error(WEFT_ERR_INVALID_ARG,
                                       "reshape: more than one -1 in shape %s (dims %d and %d)",
                                       weft__shape_str(ndim, shape).s, infer, i);
            }
            infer = i;
        } else if (shape[i] < 0) {
            return weft__set_error(WEFT_ERR_INVALID_ARG, "reshape: negative size %lld in shape %s",
                                   (long long)shape[i], weft__shape_str(ndim, shape).s);
        } else if (__builtin_mul_overflow(known, shape[i], &known)) {
            return weft__set_error(WEFT_ERR_SHAPE, "reshape: shape %s overflows 64 bits",
                                   weft__shape_str(ndim, shape).s);
        }
    }
    if (infer >= 0) {
        if (known == 0 || numel % known != 0) {
            return weft__set_error(WEFT_ERR_SHAPE,
                                   "reshape: shape %s does not fit a tensor of shape %s (%lld "
                                   "elements)",
                                   weft__shape_str(ndim, shape).s, weft__tensor_shape_str(a).s,
                                   (long long)numel);
        }
        s[infer] = numel / known;
    } else if (weft_shape_numel(ndim, s) != numel) {
        return weft__set_error(WEFT_ERR_SHAPE,
                               "reshape: shape %s (%lld elements) does not fit a tensor of shape "
                               "%s (%lld elements)",
                               weft__shape_str(ndim, shape).s, (long long)weft_shape_numel(ndim, s),
                               weft__tensor_shape_str(a).s, (long long)numel);
    }
    WEFT_CHECK(weft_tensor_view(a, ndim, s, &out));
    if (weft__ag_should_record(1, &a)) {
        WEFT_CHECK_GOTO(
            record("ReshapeBackward", reshape_backward, 1, &a, 0, NULL, 0, NULL, NULL, 1, &out),
            status, err_release_out);
    }
    *out_p = out;
    return WEFT_OK;

err_release_out:
    weft_tensor_release(out);
    return status;
}

/* ---- transpose and permute ------------------------------------------------------------------- */

typedef struct {
    int nd;
    int64_t size[WEFT_MAX_DIMS];
    int64_t istride[WEFT_MAX_DIMS]; /* the input stride of each output dim, in elements */
    int64_t ostride[WEFT_MAX_DIMS];
} perm_plan_t;

static void perm_plan(int ndim, const int64_t *shape, const int64_t *perm, perm_plan_t *pp)
{
    int64_t st[WEFT_MAX_DIMS];
    int64_t s = 1;

    for (int i = ndim - 1; i >= 0; i--) {
        st[i] = s;
        s *= shape[i];
    }
    pp->nd = 0;
    for (int i = 0; i < ndim; i++) {
        int64_t sz = shape[perm[i]];
        int64_t is = st[perm[i]];

        if (sz == 1) {
            continue;
        }
        if (pp->nd > 0 && pp->istride[pp->nd - 1] == is * sz) {
            pp->size[pp->nd - 1] *= sz;
            pp->istride[pp->nd - 1] = is;
        } else {
            pp->size[pp->nd] = sz;
            pp->istride[pp->nd] = is;
            pp->nd++;
        }
    }
    s = 1;
    for (int i = pp->nd - 1; i >= 0; i--) {
        pp->ostride[i] = s;
        s *= pp->size[i];
    }
}

/* An odometer over the dims @p dims of a plan, tracking input and output offsets. */
typedef struct {
    int n;
    int dims[WEFT_MAX_DIMS];
    int64_t idx[WEFT_MAX_DIMS];
    int64_t in;
    int64_t out;
} odo_t;

static void odo_next(odo_t *o, const perm_plan_t *pp)
{
    for (int q = o->n - 1; q >= 0; q--) {
        int d = o->dims[q];

        o->in += pp->istride[d];
        o->out += pp->ostride[d];
        if (++o->idx[q] < pp->size[d]) {
            return;
        }
        o->in -= pp->istride[d] * pp->size[d];
        o->out -= pp->ostride[d] * pp->size[d];
        o->idx[q] = 0;
    }
}

#define PERM_TILE 32

#define DEFINE_PERMUTE_TILES(T)                                                                    \
    static void permute_tiles_##T(const T *restrict src, T *restrict dst, const perm_plan_t *pp,   \
                                  int j)                                                           \
    {                                                                                              \
        int l = pp->nd - 1;                                                                        \
        int64_t sj = pp->size[j];                                                                  \
        int64_t sl = pp->size[l];                                                                  \
        int64_t oj = pp->ostride[j];                                                               \
        int64_t il = pp->istride[l];                                                               \
        int64_t outer = 1;                                                                         \
        odo_t o = {0};                                                                             \
                                                                                                   \
        for (int d = 0; d < pp->nd; d++) {                                                         \
            if (d != j && d != l) {                                                                \
                o.dims[o.n++] = d;                                                                 \
                outer *= pp->size[d];                                                              \
            }                                                                                      \
        }                                                                                          \
        for (int64_t r = 0; r < outer; r++, odo_next(&o, pp)) {                                    \
            const T *s = src + o.in;                                                               \
            T *t = dst + o.out;                                                                    \
            for (int64_t x0 = 0; x0 < sj; x0 += PERM_TILE) {                                       \
                int64_t x1 = x0 + PERM_TILE < sj ? x0 + PERM_TILE : sj;                            \
                for (int64_t y0 = 0; y0 < sl; y0 += PERM_TILE) {                                   \
                    int64_t y1 = y0 + PERM_TILE < sl ? y0 + PERM_TILE : sl;                        \
                    for (int64_t x = x0; x < x1; x++) {                                            \
                        for (int64_t y = y0; y < y1; y++) {                                        \
                            t[x * oj + y] = s[x + y * il];                                         \
                        }                                                                          \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }
DEFINE_PERMUTE_TILES(uint8_t)
DEFINE_PERMUTE_TILES(uint16_t)
DEFINE_PERMUTE_TILES(uint32_t)
DEFINE_PERMUTE_TILES(uint64_t)

/* dst = src with its dims reordered (output dim i is input dim perm[i]); both contiguous. */
static void permute_copy(const void *src, void *dst, size_t es, int ndim, const int64_t *shape,
                         const int64_t *perm)
{
    perm_plan_t pp = {0};
    int j = -1;

    if (weft_shape_numel(ndim, shape) == 0) {
        return;
    }
    perm_plan(ndim, shape, perm, &pp);
    if (pp.nd == 0 || pp.istride[pp.nd - 1] == 1) {
        /* The innermost dim stays innermost: runs of it are contiguous on both sides. */
        size_t run = (pp.nd == 0 ? 1 : (size_t)pp.size[pp.nd - 1]) * es;
        int64_t outer = 1;
        odo_t o = {0};

        for (int d = 0; d + 1 < pp.nd; d++) {
            o.dims[o.n++] = d;
            outer *= pp.size[d];
        }
        for (int64_t r = 0; r < outer; r++, odo_next(&o, &pp)) {
            memcpy((char *)dst + (size_t)o.out * es, (const char *)src + (size_t)o.in * es, run);
        }
        return;
    }
    for (int d = 0; d < pp.nd; d++) {
        if (pp.istride[d] == 1) {
            j = d;
        }
    }
    switch (es) {
    case 1:
        permute_tiles_uint8_t(src, dst, &pp, j);
        break;
    case 2:
        permute_tiles_uint16_t(src, dst, &pp, j);
        break;
    case 4:
        permute_tiles_uint32_t(src, dst, &pp, j);
        break;
    default:
        permute_tiles_uint64_t(src, dst, &pp, j);
        break;
    }
}

/* The input's dims in output order: output dim i is input dim perm[i]. iargs: perm. */
static weft_status_t permute_make(weft_tensor_t *a, const int64_t *perm, weft_tensor_t **out_p)
{
    int nd = weft_tensor_ndim(a);
    const int64_t *s = weft_tensor_shape(a);
    int64_t os[WEFT_MAX_DIMS];

    for (int i = 0; i < nd; i++) {
        os[i] = s[perm[i]];
    }
    WEFT_CHECK(weft_tensor_empty(weft_tensor_dtype(a), nd, os, out_p));
    permute_copy(weft_tensor_data(a), weft_tensor_data(*out_p),
                 weft_dtype_size(weft_tensor_dtype(a)), nd, s, perm);
    return WEFT_OK;
}

/* iargs: perm; backward permutes by its inverse. */
static weft_status_t permute_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                      weft_tensor_t **grad_in)
{
    int64_t inv[WEFT_MAX_DIMS];

    for (int i = 0; i < n->in_ndim[0]; i++) {
        inv[n->iargs[i]] = i;
    }
    return permute_make(grad_out[0], inv, &grad_in[0]);
}

static weft_status_t permute_impl(const char *name, weft_tensor_t *a, const int64_t *perm,
                                  weft_tensor_t **out_p)
{
    weft_tensor_t *out = NULL;
    weft_status_t status;

    WEFT_CHECK(permute_make(a, perm, &out));
    if (weft__ag_should_record(1, &a)) {
        WEFT_CHECK_GOTO(record(name, permute_backward, 1, &a, 0, NULL, weft_tensor_ndim(a), perm,
                               NULL, 1, &out),
                        status, err_release_out);
    }
    *out_p = out;
    return WEFT_OK;

err_release_out:
    weft_tensor_release(out);
    return status;
}

weft_status_t weft_op_transpose(weft_tensor_t *a, int dim0, int dim1, weft_tensor_t **out_p)
{
    int64_t perm[WEFT_MAX_DIMS];
    int d0 = 0;
    int d1 = 0;
    int nd;

    if (a == NULL || out_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "transpose: NULL argument");
    }
    nd = weft_tensor_ndim(a);
    WEFT_CHECK(norm_dim("transpose", dim0, nd, &d0));
    WEFT_CHECK(norm_dim("transpose", dim1, nd, &d1));
    for (int i = 0; i < nd; i++) {
        perm[i] = i;
    }
    perm[d0] = d1;
    perm[d1] = d0;
    return permute_impl("TransposeBackward", a, perm, out_p);
}

weft_status_t weft_op_permute(weft_tensor_t *a, const int *perm, weft_tensor_t **out_p)
{
    int64_t p[WEFT_MAX_DIMS];
    int seen[WEFT_MAX_DIMS] = {0};
    int nd;

    if (a == NULL || out_p == NULL || (weft_tensor_ndim(a) > 0 && perm == NULL)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "permute: NULL argument");
    }
    nd = weft_tensor_ndim(a);
    for (int i = 0; i < nd; i++) {
        int d = 0;

        WEFT_CHECK(norm_dim("permute", perm[i], nd, &d));
        if (seen[d]) {
            return weft__set_error(WEFT_ERR_INVALID_ARG,
                                   "permute: dim %d appears twice in the permutation", d);
        }
        seen[d] = 1;
        p[i] = d;
    }
    return permute_impl("PermuteBackward", a, p, out_p);
}

/* ---- concat, split, chunk -------------------------------------------------------------------- */

/*
 * Shared by concat's backward and split's forward: piece i of @p a along @p dim (offset off,
 * size sz) as a new tensor.
 */
static weft_status_t slice_dim(weft_tensor_t *a, int dim, int64_t off, int64_t sz,
                               weft_tensor_t **out_p)
{
    int nd = weft_tensor_ndim(a);
    const int64_t *s = weft_tensor_shape(a);
    size_t es = weft_dtype_size(weft_tensor_dtype(a));
    int64_t ps[WEFT_MAX_DIMS];
    size_t inner = (size_t)prod(dim + 1, nd, s) * es;
    weft_tensor_t *out = NULL;

    memcpy(ps, s, (size_t)nd * sizeof(*s));
    ps[dim] = sz;
    WEFT_CHECK(weft_tensor_empty(weft_tensor_dtype(a), nd, ps, &out));
    copy_rows(weft_tensor_data(out), (size_t)sz * inner,
              (const char *)weft_tensor_data(a) + (size_t)off * inner, (size_t)s[dim] * inner,
              prod(0, dim, s), (size_t)sz * inner);
    *out_p = out;
    return WEFT_OK;
}

/* Concatenates @p n tensors (checked) along @p dim into a new one. */
static weft_status_t concat_make(int n, weft_tensor_t *const *ts, int dim, weft_tensor_t **out_p)
{
    int nd = weft_tensor_ndim(ts[0]);
    size_t es = weft_dtype_size(weft_tensor_dtype(ts[0]));
    int64_t os[WEFT_MAX_DIMS];
    int64_t off = 0;
    size_t inner;
    weft_tensor_t *out = NULL;

    memcpy(os, weft_tensor_shape(ts[0]), (size_t)nd * sizeof(*os));
    os[dim] = 0;
    for (int i = 0; i < n; i++) {
        os[dim] += weft_tensor_shape(ts[i])[dim];
    }
    inner = (size_t)prod(dim + 1, nd, os) * es;
    WEFT_CHECK(weft_tensor_empty(weft_tensor_dtype(ts[0]), nd, os, &out));
    for (int i = 0; i < n; i++) {
        int64_t sz = weft_tensor_shape(ts[i])[dim];

        copy_rows((char *)weft_tensor_data(out) + (size_t)off * inner, (size_t)os[dim] * inner,
                  weft_tensor_data(ts[i]), (size_t)sz * inner, prod(0, dim, os),
                  (size_t)sz * inner);
        off += sz;
    }
    *out_p = out;
    return WEFT_OK;
}

/* iargs: dim. ctx: the n sizes along dim. */
static weft_status_t concat_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                     weft_tensor_t **grad_in)
{
    const int64_t *sizes = n->ctx;
    int64_t off = 0;
    weft_status_t status;

    for (int i = 0; i < n->n_in; i++) {
        if (weft__ag_needs_grad(n, i)) {
            WEFT_CHECK_GOTO(slice_dim(grad_out[0], (int)n->iargs[0], off, sizes[i], &grad_in[i]),
                            status, err);
        }
        off += sizes[i];
    }
    return WEFT_OK;

err:
    for (int i = 0; i < n->n_in; i++) {
        weft_tensor_release(grad_in[i]);
        grad_in[i] = NULL;
    }
    return status;
}

weft_status_t weft_op_concat(int n, weft_tensor_t *const *ts, int dim, weft_tensor_t **out_p)
{
    weft_tensor_t *out = NULL;
    int64_t *sizes;
    weft_status_t status;
    int nd;
    int d = 0;

    if (n < 1 || ts == NULL || out_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "concat: needs at least one tensor");
    }
    for (int i = 0; i < n; i++) {
        if (ts[i] == NULL) {
            return weft__set_error(WEFT_ERR_INVALID_ARG, "concat: tensor %d is NULL", i);
        }
    }
    nd = weft_tensor_ndim(ts[0]);
    if (nd == 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "concat: cannot concatenate 0-D tensors");
    }
    WEFT_CHECK(norm_dim("concat", dim, nd, &d));
    for (int i = 1; i < n; i++) {
        const int64_t *s0 = weft_tensor_shape(ts[0]);
        const int64_t *si = weft_tensor_shape(ts[i]);

        if (weft_tensor_dtype(ts[i]) != weft_tensor_dtype(ts[0])) {
            return weft__set_error(WEFT_ERR_DTYPE, "concat: tensor %d is %s, tensor 0 is %s", i,
                                   weft_dtype_name(weft_tensor_dtype(ts[i])),
                                   weft_dtype_name(weft_tensor_dtype(ts[0])));
        }
        if (weft_tensor_ndim(ts[i]) != nd) {
            return weft__set_error(
                WEFT_ERR_SHAPE, "concat: tensor %d has shape %s, tensor 0 has shape %s", i,
                weft__tensor_shape_str(ts[i]).s, weft__tensor_shape_str(ts[0]).s);
        }
        for (int k = 0; k < nd; k++) {
            if (k != d && si[k] != s0[k]) {
                return weft__set_error(WEFT_ERR_SHAPE,
                                       "concat: tensor %d has shape %s, tensor 0 has shape %s "
                                       "(dim %d differs; only dim %d may)",
                                       i, weft__tensor_shape_str(ts[i]).s,
                                       weft__tensor_shape_str(ts[0]).s, k, d);
            }
        }
    }
    WEFT_CHECK(concat_make(n, ts, d, &out));
    if (weft__ag_should_record(n, ts)) {
        int64_t iargs[1] = {d};

        sizes = weft_alloc((size_t)n * sizeof(*sizes));
        if (sizes == NULL) {
            status = weft__set_error(WEFT_ERR_NO_MEMORY, "concat: out of memory");
            goto err_release_out;
        }
        for (int i = 0; i < n; i++) {
            sizes[i] = weft_tensor_shape(ts[i])[d];
        }
        WEFT_CHECK_GOTO(
            record("ConcatBackward", concat_backward, n, ts, 0, NULL, 1, iargs, sizes, 1, &out),
            status, err_release_out);
    }
    *out_p = out;
    return WEFT_OK;

err_release_out:
    weft_tensor_release(out);
    return status;
}

/* iargs: dim. ctx: the n sizes. Backward concatenates the pieces' gradients. */
static weft_status_t split_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                    weft_tensor_t **grad_in)
{
    if (!weft__ag_needs_grad(n, 0)) {
        return WEFT_OK;
    }
    return concat_make(n->n_out, grad_out, (int)n->iargs[0], &grad_in[0]);
}

static weft_status_t split_impl(const char *op, const char *name, weft_tensor_t *a, int n,
                                const int64_t *sizes, int d, weft_tensor_t **outs)
{
    weft_tensor_t **pieces;
    int64_t *ctx = NULL;
    int64_t off = 0;
    weft_status_t status = WEFT_OK;
    int made = 0;

    pieces = weft_calloc((size_t)n, sizeof(*pieces));
    if (pieces == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "%s: out of memory", op);
    }
    for (; made < n; made++) {
        WEFT_CHECK_GOTO(slice_dim(a, d, off, sizes[made], &pieces[made]), status, err_release);
        off += sizes[made];
    }
    if (weft__ag_should_record(1, &a)) {
        int64_t iargs[1] = {d};

        ctx = weft_alloc((size_t)n * sizeof(*ctx));
        if (ctx == NULL) {
            status = weft__set_error(WEFT_ERR_NO_MEMORY, "%s: out of memory", op);
            goto err_release;
        }
        memcpy(ctx, sizes, (size_t)n * sizeof(*ctx));
        WEFT_CHECK_GOTO(record(name, split_backward, 1, &a, 0, NULL, 1, iargs, ctx, n, pieces),
                        status, err_release);
    }
    memcpy(outs, pieces, (size_t)n * sizeof(*pieces));
    weft_free(pieces);
    return WEFT_OK;

err_release:
    for (int i = 0; i < made; i++) {
        weft_tensor_release(pieces[i]);
    }
    weft_free(pieces);
    return status;
}

weft_status_t weft_op_split(weft_tensor_t *a, int n, const int64_t *sizes, int dim,
                            weft_tensor_t **outs)
{
    int64_t total = 0;
    int d = 0;

    if (a == NULL || n < 1 || sizes == NULL || outs == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "split: NULL argument or no pieces");
    }
    if (weft_tensor_ndim(a) == 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "split: cannot split a 0-D tensor");
    }
    WEFT_CHECK(norm_dim("split", dim, weft_tensor_ndim(a), &d));
    for (int i = 0; i < n; i++) {
        if (sizes[i] < 0) {
            return weft__set_error(WEFT_ERR_INVALID_ARG, "split: size %d is negative (%lld)", i,
                                   (long long)sizes[i]);
        }
        total += sizes[i];
    }
    if (total != weft_tensor_shape(a)[d]) {
        return weft__set_error(
            WEFT_ERR_INVALID_ARG, "split: sizes sum to %lld, but dim %d of shape %s has size %lld",
            (long long)total, d, weft__tensor_shape_str(a).s, (long long)weft_tensor_shape(a)[d]);
    }
    return split_impl("split", "SplitBackward", a, n, sizes, d, outs);
}

weft_status_t weft_op_chunk(weft_tensor_t *a, int chunks, int dim, weft_tensor_t **outs, int *n_p)
{
    int64_t sizes_small[WEFT__AG_MAX_IN];
    int64_t *sizes = sizes_small;
    int64_t size;
    int64_t csize;
    int n;
    int d = 0;
    weft_status_t status;

    if (a == NULL || outs == NULL || n_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "chunk: NULL argument");
    }
    if (chunks < 1) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "chunk: %d chunks (needs at least 1)", chunks);
    }
    if (weft_tensor_ndim(a) == 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "chunk: cannot chunk a 0-D tensor");
    }
    WEFT_CHECK(norm_dim("chunk", dim, weft_tensor_ndim(a), &d));
    size = weft_tensor_shape(a)[d];
    if (size == 0) {
        /* torch gives @p chunks empty pieces. */
        csize = 0;
        n = chunks;
    } else {
        csize = (size + chunks - 1) / chunks;
        n = (int)((size + csize - 1) / csize);
    }
    if (n > WEFT__AG_MAX_IN) {
        sizes = weft_alloc((size_t)n * sizeof(*sizes));
        if (sizes == NULL) {
            return weft__set_error(WEFT_ERR_NO_MEMORY, "chunk: out of memory");
        }
    }
    for (int i = 0; i < n; i++) {
        sizes[i] = csize * (i + 1) <= size ? csize : size - csize * i;
    }
    status = split_impl("chunk", "ChunkBackward", a, n, sizes, d, outs);
    if (sizes != sizes_small) {
        weft_free(sizes);
    }
    if (status == WEFT_OK) {
        *n_p = n;
    }
    return status;
}

/* ---- index_select ---------------------------------------------------------------------------- */

/* iargs: dim. Saved: index. Backward adds each gradient slice into the row it was taken from. */
static weft_status_t index_select_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                           weft_tensor_t **grad_in)
{
    int d = (int)n->iargs[0];
    int nd = n->in_ndim[0];
    const int64_t *s = n->in_shape[0];
    int64_t outer = prod(0, d, s);
    int64_t inner = prod(d + 1, nd, s);
    int64_t k = weft_tensor_numel(n->saved[0]);
    size_t es = weft_dtype_size(n->in_dtype[0]);
    weft_tensor_t *g = NULL;

    if (!weft__ag_needs_grad(n, 0)) {
        return WEFT_OK;
    }
    WEFT_CHECK(weft_tensor_create(n->in_dtype[0], nd, s, &g));
    /* Each outer slice is a scatter of k rows of inner elements into s[d] rows. */
    for (int64_t o = 0; o < outer; o++) {
        weft__op_scatter_add_rows(
            n->in_dtype[0], (char *)weft_tensor_data(g) + (size_t)(o * s[d] * inner) * es,
            (const char *)weft_tensor_data(grad_out[0]) + (size_t)(o * k * inner) * es,
            weft_tensor_data(n->saved[0]), k, inner);
    }
    grad_in[0] = g;
    return WEFT_OK;
}

weft_status_t weft_op_index_select(weft_tensor_t *a, int dim, weft_tensor_t *index,
                                   weft_tensor_t **out_p)
{
    const int64_t *s;
    const int64_t *idx;
    int64_t os[WEFT_MAX_DIMS];
    int64_t k;
    int64_t outer;
    size_t inner;
    size_t es;
    int nd;
    int d = 0;
    weft_tensor_t *out = NULL;
    weft_status_t status;

    if (a == NULL || index == NULL || out_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "index_select: NULL argument");
    }
    if (weft_tensor_dtype(index) != WEFT_I64) {
        return weft__set_error(WEFT_ERR_DTYPE, "index_select: index must be i64, got %s",
                               weft_dtype_name(weft_tensor_dtype(index)));
    }
    if (weft_tensor_ndim(index) > 1) {
        return weft__set_error(WEFT_ERR_SHAPE, "index_select: index must be 0-D or 1-D, got %s",
                               weft__tensor_shape_str(index).s);
    }
    nd = weft_tensor_ndim(a);
    if (nd == 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "index_select: cannot index a 0-D tensor");
    }
    WEFT_CHECK(norm_dim("index_select", dim, nd, &d));
    s = weft_tensor_shape(a);
    idx = weft_tensor_data(index);
    k = weft_tensor_numel(index);
    for (int64_t j = 0; j < k; j++) {
        if (idx[j] < 0 || idx[j] >= s[d]) {
            return weft__set_error(WEFT_ERR_INVALID_ARG,
                                   "index_select: index %lld at position %lld is out of range "
                                   "for dim %d of size %lld",
                                   (long long)idx[j], (long long)j, d, (long long)s[d]);
        }
    }
    memcpy(os, s, (size_t)nd * sizeof(*os));
    os[d] = k;
    es = weft_dtype_size(weft_tensor_dtype(a));
    outer = prod(0, d, s);
    inner = (size_t)prod(d + 1, nd, s) * es;
    WEFT_CHECK(weft_tensor_empty(weft_tensor_dtype(a), nd, os, &out));
    if (inner > 0) {
        const char *src = weft_tensor_data(a);
        char *dst = weft_tensor_data(out);

        for (int64_t o = 0; o < outer; o++) {
            for (int64_t j = 0; j < k; j++) {
                memcpy(dst + (size_t)(o * k + j) * inner, src + (size_t)(o * s[d] + idx[j]) * inner,
                       inner);
            }
        }
    }
    if (weft__ag_should_record(1, &a)) {
        int64_t iargs[1] = {d};

        WEFT_CHECK_GOTO(record("IndexSelectBackward", index_select_backward, 1, &a, 1, &index, 1,
                               iargs, NULL, 1, &out),
                        status, err_release_out);
    }
    *out_p = out;
    return WEFT_OK;

err_release_out:
    weft_tensor_release(out);
    return status;
}
