/*
 * Embeddings: lookups of weight rows by i64 index (embedding) and sums or means of such rows per
 * bag (embedding_bag). Backward either scatter-adds into a dense [V, D] gradient or hands the
 * weight a sparse one: a copy of the indices and one gradient row per index
 * (weft__ag_grad_sparse), so that a step touches only the rows that were looked up.
 */
#include <string.h>

#include "graph.h"

#include <weft/ops.h>

/* ---- helpers --------------------------------------------------------------------------------- */

/* weight: f32/f64 [V, D]; indices: i64, each in [0, V). */
static weft_status_t check_lookup(const char *op, const weft_tensor_t *weight,
                                  const weft_tensor_t *indices)
{
    weft_dtype_t dt = weft_tensor_dtype(weight);
    const int64_t *idx;
    int64_t v;
    int64_t k;

    if (dt != WEFT_F32 && dt != WEFT_F64) {
        return weft__set_error(WEFT_ERR_DTYPE, "%s: weight must be f32 or f64, got %s", op,
                               weft_dtype_name(dt));
    }
    if (weft_tensor_ndim(weight) != 2) {
        return weft__set_error(WEFT_ERR_SHAPE, "%s: weight must be 2-D [V, D], got %s", op,
                               weft__tensor_shape_str(weight).s);
    }
    if (weft_tensor_dtype(indices) != WEFT_I64) {
        return weft__set_error(WEFT_ERR_DTYPE, "%s: indices must be i64, got %s", op,
                               weft_dtype_name(weft_tensor_dtype(indices)));
    }
    v = weft_tensor_shape(weight)[0];
    idx = weft_tensor_data(indices);
    k = weft_tensor_numel(indices);
    for (int64_t i = 0; i < k; i++) {
        if (idx[i] < 0 || idx[i] >= v) {
            return weft__set_error(WEFT_ERR_INVALID_ARG,
                                   "%s: index %lld at position %lld is out of range for a weight "
                                   "of %lld rows",
                                   op, (long long)idx[i], (long long)i, (long long)v);
        }
    }
    return WEFT_OK;
}

/*
 * Records node @p name over (weight, indices[, offsets]) saving the index tensors, with iargs
 * (sparse, mode), and attaches it to @p out.
 */
static weft_status_t record(const char *name, weft__ag_backward_cb_t bw, int n_in,
                            weft_tensor_t *const *ins, int64_t sparse, int64_t mode,
                            weft_tensor_t *out)
{
    weft__ag_node_t *n = NULL;
    weft_status_t status;

    WEFT_CHECK(weft__ag_node_new(name, bw, n_in, ins, &n));
    n->iargs[0] = sparse;
    n->iargs[1] = mode;
    status = WEFT_OK;
    for (int i = 1; i < n_in && status == WEFT_OK; i++) {
        status = weft__ag_save(n, ins[i]);
    }
    if (status == WEFT_OK) {
        status = weft__ag_attach(n, 1, &out);
    }
    weft__ag_node_unref(n);
    return status;
}

/* The indices as a fresh i64 [nnz] (the sparse gradient must not follow later writes to them). */
static weft_status_t flat_indices(weft_tensor_t *indices, weft_tensor_t **out_p)
{
    int64_t nnz = weft_tensor_numel(indices);
    weft_tensor_t *out = NULL;

    WEFT_CHECK(weft_tensor_empty(WEFT_I64, 1, &nnz, &out));
    if (nnz > 0) {
        memcpy(weft_tensor_data(out), weft_tensor_data(indices), (size_t)nnz * sizeof(int64_t));
    }
    *out_p = out;
    return WEFT_OK;
}

/* ---- embedding ------------------------------------------------------------------------------- */

/* Inputs: weight, indices. Saved: indices. iargs: sparse. */
static weft_status_t embedding_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                        weft_tensor_t **grad_in)
{
    weft_tensor_t *indices = n->saved[0];
    int64_t k = weft_tensor_numel(indices);
    int64_t d = n->in_shape[0][1];
    weft_tensor_t *g = NULL;
    weft_tensor_t *flat = NULL;
    weft_status_t status;

    if (!weft__ag_needs_grad(n, 0)) {
        return WEFT_OK;
    }
    if (n->iargs[0]) {
        int64_t rs[2] = {k, d};

        WEFT_CHECK(flat_indices(indices, &flat));
        WEFT_CHECK_GOTO(weft_tensor_view(grad_out[0], 2, rs, &g), status, out);
        status = weft__ag_grad_sparse(n, 0, flat, g);
        goto out;
    }
    WEFT_CHECK(weft_tensor_create(n->in_dtype[0], 2, n->in_shape[0], &g));
    weft__op_scatter_add_rows(n->in_dtype[0], weft_tensor_data(g), weft_tensor_data(grad_out[0]),
                              weft_tensor_data(indices), k, d);
    grad_in[0] = g;
    return WEFT_OK;

out:
    weft_tensor_release(g);
    weft_tensor_release(flat);
    return status;
}

weft_status_t weft_op_embedding(weft_tensor_t *weight, weft_tensor_t *indices, int sparse,
                                weft_tensor_t **out_p)
{
    int64_t os[WEFT_MAX_DIMS];
    int nd;
    int64_t k;
    size_t row;
    weft_tensor_t *out = NULL;
    weft_status_t status;

    if (weight == NULL || indices == NULL || out_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "embedding: NULL argument");
    }
    WEFT_CHECK(check_lookup("embedding", weight, indices));
    nd = weft_tensor_ndim(indices);
    if (nd + 1 > WEFT_MAX_DIMS) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "embedding: indices of %d dims give more than %d output dims", nd,
                               WEFT_MAX_DIMS);
    }
    memcpy(os, weft_tensor_shape(indices), (size_t)nd * sizeof(*os));
    os[nd] = weft_tensor_shape(weight)[1];
    WEFT_CHECK(weft_tensor_empty(weft_tensor_dtype(weight), nd + 1, os, &out));
    k = weft_tensor_numel(indices);
    row = (size_t)os[nd] * weft_dtype_size(weft_tensor_dtype(weight));
    if (row > 0) {
        const int64_t *idx = weft_tensor_data(indices);
        const char *w = weft_tensor_data(weight);
        char *o = weft_tensor_data(out);

        for (int64_t i = 0; i < k; i++) {
            memcpy(o + (size_t)i * row, w + (size_t)idx[i] * row, row);
        }
    }
    if (weft__ag_should_record(1, &weight)) {
        WEFT_CHECK_GOTO(record("EmbeddingBackward", embedding_backward, 2,
                               (weft_tensor_t *[]){weight, indices}, sparse != 0, 0, out),
                        status, err_release_out);
    }
    *out_p = out;
    return WEFT_OK;

err_release_out:
    weft_tensor_release(out);
    return status;
}

/* ---- embedding_bag --------------------------------------------------------------------------- */

#define DEFINE_BAG(T)                                                                              \
    /* out[b] = sum (or mean) of w[idx[i]] over bag b's positions; out starts zeroed. */           \
    static void bag_forward_##T(const T *restrict w, const int64_t *idx, const int64_t *off,       \
                                int64_t nb, int64_t k, int64_t d, int mean, T *restrict out)       \
    {                                                                                              \
        for (int64_t b = 0; b < nb; b++) {                                                         \
            int64_t end = b + 1 < nb ? off[b + 1] : k;                                             \
            T *restrict o = out + b * d;                                                           \
            for (int64_t i = off[b]; i < end; i++) {                                               \
                const T *restrict r = w + idx[i] * d;                                              \
                for (int64_t e = 0; e < d; e++) {                                                  \
                    o[e] += r[e];                                                                  \
                }                                                                                  \
            }                                                                                      \
            if (mean && end > off[b]) {                                                            \
                T s = (T)1 / (T)(end - off[b]);                                                    \
                for (int64_t e = 0; e < d; e++) {                                                  \
                    o[e] *= s;                                                                     \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    /* rows[i] = g[bag of i] (scaled by 1 / bag size for the mean). */                             \
    static void bag_rows_##T(const T *restrict g, const int64_t *off, int64_t nb, int64_t k,       \
                             int64_t d, int mean, T *restrict rows)                                \
    {                                                                                              \
        for (int64_t b = 0; b < nb; b++) {                                                         \
            int64_t end = b + 1 < nb ? off[b + 1] : k;                                             \
            T s = mean && end > off[b] ? (T)1 / (T)(end - off[b]) : (T)1;                          \
            const T *restrict gb = g + b * d;                                                      \
            for (int64_t i = off[b]; i < end; i++) {                                               \
                T *restrict r = rows + i * d;                                                      \
                for (int64_t e = 0; e < d; e++) {                                                  \
                    r[e] = s * gb[e];                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    /* dw[idx[i]] += g[bag of i] (scaled for the mean); dw starts zeroed. */                       \
    static void bag_scatter_##T(const T *restrict g, const int64_t *idx, const int64_t *off,       \
                                int64_t nb, int64_t k, int64_t d, int mean, T *restrict dw)        \
    {                                                                                              \
        for (int64_t b = 0; b < nb; b++) {                                                         \
            int64_t end = b + 1 < nb ? off[b + 1] : k;                                             \
            T s = mean && end > off[b] ? (T)1 / (T)(end - off[b]) : (T)1;                          \
            const T *restrict gb = g + b * d;                                                      \
            for (int64_t i = off[b]; i < end; i++) {                                               \
                T *restrict r = dw + idx[i] * d;                                                   \
                for (int64_t e = 0; e < d; e++) {                                                  \
                    r[e] += s * gb[e];                                                             \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }
DEFINE_BAG(float)
DEFINE_BAG(double)

/* Inputs: weight, indices, offsets. Saved: indices, offsets. iargs: sparse, mode. */
static weft_status_t embedding_bag_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                            weft_tensor_t **grad_in)
{
    weft_dtype_t dt = n->in_dtype[0];
    const int64_t *idx = weft_tensor_data(n->saved[0]);
    const int64_t *off = weft_tensor_data(n->saved[1]);
    int64_t k = weft_tensor_numel(n->saved[0]);
    int64_t nb = weft_tensor_numel(n->saved[1]);
    int64_t d = n->in_shape[0][1];
    int mean = n->iargs[1] == WEFT_BAG_MEAN;
    const void *g = weft_tensor_data(grad_out[0]);
    weft_tensor_t *rows = NULL;
    weft_tensor_t *flat = NULL;
    weft_status_t status;

    if (!weft__ag_needs_grad(n, 0)) {
        return WEFT_OK;
    }
    if (n->iargs[0]) {
        int64_t rs[2] = {k, d};

        WEFT_CHECK(flat_indices(n->saved[0], &flat));
        WEFT_CHECK_GOTO(weft_tensor_empty(dt, 2, rs, &rows), status, out);
        if (dt == WEFT_F32) {
            bag_rows_float(g, off, nb, k, d, mean, weft_tensor_data(rows));
        } else {
            bag_rows_double(g, off, nb, k, d, mean, weft_tensor_data(rows));
        }
        status = weft__ag_grad_sparse(n, 0, flat, rows);
        goto out;
    }
    WEFT_CHECK(weft_tensor_create(dt, 2, n->in_shape[0], &rows));
    if (dt == WEFT_F32) {
        bag_scatter_float(g, idx, off, nb, k, d, mean, weft_tensor_data(rows));
    } else {
        bag_scatter_double(g, idx, off, nb, k, d, mean, weft_tensor_data(rows));
    }
    grad_in[0] = rows;
    return WEFT_OK;

out:
    weft_tensor_release(rows);
    weft_tensor_release(flat);
    return status;
}

weft_status_t weft_op_embedding_bag(weft_tensor_t *weight, weft_tensor_t *indices,
                                    weft_tensor_t *offsets, weft_bag_mode_t mode, int sparse,
                                    weft_tensor_t **out_p)
{
    const int64_t *off;
    int64_t nb;
    int64_t k;
    int64_t os[2];
    weft_tensor_t *out = NULL;
    weft_status_t status;

    if (weight == NULL || indices == NULL || offsets == NULL || out_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "embedding_bag: NULL argument");
    }
    if (mode != WEFT_BAG_SUM && mode != WEFT_BAG_MEAN) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "embedding_bag: unknown mode %d", (int)mode);
    }
    WEFT_CHECK(check_lookup("embedding_bag", weight, indices));
    if (weft_tensor_ndim(indices) != 1) {
        return weft__set_error(WEFT_ERR_SHAPE, "embedding_bag: indices must be 1-D, got %s",
                               weft__tensor_shape_str(indices).s);
    }
    if (weft_tensor_dtype(offsets) != WEFT_I64) {
        return weft__set_error(WEFT_ERR_DTYPE, "embedding_bag: offsets must be i64, got %s",
                               weft_dtype_name(weft_tensor_dtype(offsets)));
    }
    if (weft_tensor_ndim(offsets) != 1) {
        return weft__set_error(WEFT_ERR_SHAPE, "embedding_bag: offsets must be 1-D, got %s",
                               weft__tensor_shape_str(offsets).s);
    }
    off = weft_tensor_data(offsets);
    nb = weft_tensor_numel(offsets);
    k = weft_tensor_numel(indices);
    if (nb > 0 && off[0] != 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "embedding_bag: offsets must start at 0, got %lld first",
                               (long long)off[0]);
    }
    for (int64_t b = 1; b < nb; b++) {
        if (off[b] < off[b - 1]) {
            return weft__set_error(WEFT_ERR_INVALID_ARG,
                                   "embedding_bag: offsets decrease at position %lld (%lld after "
                                   "%lld)",
                                   (long long)b, (long long)off[b], (long long)off[b - 1]);
        }
    }
    if (nb > 0 && off[nb - 1] > k) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "embedding_bag: offset %lld at position %lld is past the end of "
                               "the %lld indices",
                               (long long)off[nb - 1], (long long)(nb - 1), (long long)k);
    }
    os[0] = nb;
    os[1] = weft_tensor_shape(weight)[1];
    WEFT_CHECK(weft_tensor_create(weft_tensor_dtype(weight), 2, os, &out));
    if (weft_tensor_dtype(weight) == WEFT_F32) {
        bag_forward_float(weft_tensor_data(weight), weft_tensor_data(indices), off, nb, k, os[1],
                          mode == WEFT_BAG_MEAN, weft_tensor_data(out));
    } else {
        bag_forward_double(weft_tensor_data(weight), weft_tensor_data(indices), off, nb, k, os[1],
                           mode == WEFT_BAG_MEAN, weft_tensor_data(out));
    }
    if (weft__ag_should_record(1, &weight)) {
        WEFT_CHECK_GOTO(record("EmbeddingBagBackward", embedding_bag_backward, 3,
                               (weft_tensor_t *[]){weight, indices, offsets}, sparse != 0, mode,
                               out),
                        status, err_release_out);
    }
    *out_p = out;
    return WEFT_OK;

err_release_out:
    weft_tensor_release(out);
    return status;
}
