/*
 * Matrix products on OpenBLAS: matmul (torch.matmul's rules), bmm and linear.
 *
 * matmul and bmm share one kernel: both operands are seen as batches of row-major matrices
 * ([..., n, k] and [..., k, p], a 1-D operand promoted to [1, k] or [k, 1]) whose batch dims
 * broadcast; each output matrix is one gemm. When the right operand has no batch dims the left
 * one's batches fold into its rows (one gemm in all, forward and backward). Backward recomputes
 * the batch mapping from the shapes the node kept and accumulates into the operands' gradients
 * (beta = 1 where a batch was broadcast), so broadcast dims are summed without a temporary.
 *
 * linear is x W^T + b as one gemm (CblasTrans on W) over the rows of x, the bias copied into the
 * output first (beta = 1); backward is dX = dY W, dW = dY^T X (two gemms) and db the column sums
 * of dY.
 */
#include <limits.h>
#include <string.h>

#include <cblas.h>

#include "graph.h"

#include <weft/ops.h>

/* ---- helpers --------------------------------------------------------------------------------- */

/* Both f32 or both f64. */
static weft_status_t check_float_pair(const char *op, const weft_tensor_t *a,
                                      const weft_tensor_t *b)
{
    weft_dtype_t da = weft_tensor_dtype(a);
    weft_dtype_t db = weft_tensor_dtype(b);

    if (da != WEFT_F32 && da != WEFT_F64) {
        return weft__set_error(WEFT_ERR_DTYPE, "%s: takes f32 or f64 tensors, got %s", op,
                               weft_dtype_name(da));
    }
    if (db != da) {
        return weft__set_error(WEFT_ERR_DTYPE, "%s: dtypes differ (%s and %s)", op,
                               weft_dtype_name(da), weft_dtype_name(db));
    }
    return WEFT_OK;
}



/* ---- the batched-matrix plan shared by matmul and bmm ---------------------------------------- */

typedef struct {
    int64_t n, k, p; /* a is [..., n, k] and b [..., k, p] after promotion */
    int nbd;         /* broadcast batch dims */
    int64_t batch[WEFT_MAX_DIMS];
    int64_t sa[WEFT_MAX_DIMS]; /* a's matrix stride per batch dim (0 where broadcast) */
    int64_t sb[WEFT_MAX_DIMS];
    int64_t nbatch;   /* output matrices */
    int64_t nbatch_a; /* a's matrices */
    int64_t nbatch_b;
    int fold; /* b has no batch dims: a's batches are rows of one gemm */
    int out_ndim;
    int64_t out_shape[WEFT_MAX_DIMS];
} mm_plan_t;

static weft_status_t mm_plan(const char *op, int nda, const int64_t *sa, int ndb, const int64_t *sb,
                             mm_plan_t *pl)
{
    int bda = nda > 2 ? nda - 2 : 0;
    int bdb = ndb > 2 ? ndb - 2 : 0;
    int64_t ka;
    int64_t kb;
    int64_t stra = 1;
    int64_t strb = 1;

    if (nda < 1 || ndb < 1) {
        return weft__set_error(WEFT_ERR_SHAPE,
                               "%s: both operands need at least 1 dim, got shapes %s and %s", op,
                               weft__shape_str(nda, sa).s, weft__shape_str(ndb, sb).s);
    }
    memset(pl, 0, sizeof(*pl));
    pl->n = nda >= 2 ? sa[nda - 2] : 1;
    ka = sa[nda - 1];
    kb = ndb >= 2 ? sb[ndb - 2] : sb[0];
    pl->p = ndb >= 2 ? sb[ndb - 1] : 1;
    if (ka != kb) {
        return weft__set_error(
            WEFT_ERR_SHAPE, "%s: shapes %s and %s cannot be multiplied (%lld != %lld)", op,
            weft__shape_str(nda, sa).s, weft__shape_str(ndb, sb).s, (long long)ka, (long long)kb);
    }
    pl->k = ka;
    pl->nbd = bda > bdb ? bda : bdb;
    pl->nbatch = 1;
    pl->nbatch_a = 1;
    pl->nbatch_b = 1;
    for (int i = pl->nbd - 1; i >= 0; i--) {
        int ia = i - (pl->nbd - bda); /* a's batch dim, or negative */
        int ib = i - (pl->nbd - bdb);
        int64_t da = ia >= 0 ? sa[ia] : 1;
        int64_t db = ib >= 0 ? sb[ib] : 1;

        if (da != db && da != 1 && db != 1) {
            return weft__set_error(WEFT_ERR_SHAPE,
                                   "%s: batch dims of shapes %s and %s do not broadcast", op,
                                   weft__shape_str(nda, sa).s, weft__shape_str(ndb, sb).s);
        }
        pl->batch[i] = da == 1 ? db : da;
        pl->sa[i] = da == 1 ? 0 : stra;
        pl->sb[i] = db == 1 ? 0 : strb;
        stra *= da;
        strb *= db;
        pl->nbatch *= pl->batch[i];
    }
    pl->nbatch_a = stra;
    pl->nbatch_b = strb;
    pl->fold = bdb == 0;
    if (!weft__op_fits_blas(pl->n * (pl->fold ? pl->nbatch_a : 1)) || !weft__op_fits_blas(pl->k) ||
        !weft__op_fits_blas(pl->p)) {
        return weft__set_error(WEFT_ERR_UNSUPPORTED, "%s: matrices of %s and %s are too large", op,
                               weft__shape_str(nda, sa).s, weft__shape_str(ndb, sb).s);
    }
    for (int i = 0; i < pl->nbd; i++) {
        pl->out_shape[pl->out_ndim++] = pl->batch[i];
    }
    if (nda >= 2) {
        pl->out_shape[pl->out_ndim++] = pl->n;
    }
    if (ndb >= 2) {
        pl->out_shape[pl->out_ndim++] = pl->p;
    }
    return WEFT_OK;
}

/* The matrices of a and b that output matrix @p i multiplies. */
static void mm_batch(const mm_plan_t *pl, int64_t i, int64_t *ia_p, int64_t *ib_p)
{
    int64_t ia = 0;
    int64_t ib = 0;

    for (int d = pl->nbd - 1; d >= 0; d--) {
        int64_t x = i % pl->batch[d];

        i /= pl->batch[d];
        ia += x * pl->sa[d];
        ib += x * pl->sb[d];
    }
    *ia_p = ia;
    *ib_p = ib;
}

static void mm_forward(weft_dtype_t dt, const mm_plan_t *pl, const char *a, const char *b, char *c)
{
    size_t es = weft_dtype_size(dt);
    size_t ma = (size_t)(pl->n * pl->k) * es;
    size_t mb = (size_t)(pl->k * pl->p) * es;
    size_t mc = (size_t)(pl->n * pl->p) * es;

    if (pl->fold) {
        weft__op_gemm(dt, 0, 0, pl->n * pl->nbatch_a, pl->p, pl->k, a, b, 0, c);
        return;
    }
    for (int64_t i = 0; i < pl->nbatch; i++) {
        int64_t ia;
        int64_t ib;

        mm_batch(pl, i, &ia, &ib);
        weft__op_gemm(dt, 0, 0, pl->n, pl->p, pl->k, a + (size_t)ia * ma, b + (size_t)ib * mb, 0,
             c + (size_t)i * mc);
    }
}

/* Inputs: a, b. Saved: a, b. */
static weft_status_t matmul_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                     weft_tensor_t **grad_in)
{
    weft_dtype_t dt = n->in_dtype[0];
    size_t es = weft_dtype_size(dt);
    const char *a = weft_tensor_data(n->saved[0]);
    const char *b = weft_tensor_data(n->saved[1]);
    const char *g = weft_tensor_data(grad_out[0]);
    weft_tensor_t *ga = NULL;
    weft_tensor_t *gb = NULL;
    weft_status_t status;
    mm_plan_t pl;
    size_t ma;
    size_t mb;
    size_t mc;

    WEFT_CHECK(mm_plan("matmul backward", n->in_ndim[0], n->in_shape[0], n->in_ndim[1],
                       n->in_shape[1], &pl));
    ma = (size_t)(pl.n * pl.k) * es;
    mb = (size_t)(pl.k * pl.p) * es;
    mc = (size_t)(pl.n * pl.p) * es;
    if (weft__ag_needs_grad(n, 0)) {
        /* dA[ia] += G[i] B[ib]^T; a's matrices are each written once unless broadcast. */
        int acc = pl.nbatch_a != pl.nbatch && !pl.fold;

        WEFT_CHECK_GOTO(
            (acc ? weft_tensor_create : weft_tensor_empty)(dt, n->in_ndim[0], n->in_shape[0], &ga),
            status, err);
        if (pl.fold) {
            weft__op_gemm(dt, 0, 1, pl.n * pl.nbatch_a, pl.k, pl.p, g, b, 0, weft_tensor_data(ga));
        } else {
            for (int64_t i = 0; i < pl.nbatch; i++) {
                int64_t ia;
                int64_t ib;

                mm_batch(&pl, i, &ia, &ib);
                weft__op_gemm(dt, 0, 1, pl.n, pl.k, pl.p, g + (size_t)i * mc, b + (size_t)ib * mb,
                     acc ? 1 : 0, (char *)weft_tensor_data(ga) + (size_t)ia * ma);
            }
        }
    }
    if (weft__ag_needs_grad(n, 1)) {
        /* dB[ib] += A[ia]^T G[i]. */
        int acc = pl.nbatch_b != pl.nbatch && !pl.fold;

        WEFT_CHECK_GOTO(
            (acc ? weft_tensor_create : weft_tensor_empty)(dt, n->in_ndim[1], n->in_shape[1], &gb),
            status, err);
        if (pl.fold) {
            weft__op_gemm(dt, 1, 0, pl.k, pl.p, pl.n * pl.nbatch_a, a, g, 0, weft_tensor_data(gb));
        } else {
            for (int64_t i = 0; i < pl.nbatch; i++) {
                int64_t ia;
                int64_t ib;

                mm_batch(&pl, i, &ia, &ib);
                weft__op_gemm(dt, 1, 0, pl.k, pl.p, pl.n, a + (size_t)ia * ma, g + (size_t)i * mc,
                     acc ? 1 : 0, (char *)weft_tensor_data(gb) + (size_t)ib * mb);
            }
        }
    }
    grad_in[0] = ga;
    grad_in[1] = gb;
    return WEFT_OK;

err:
    weft_tensor_release(ga);
    return status;
}

static weft_status_t matmul_impl(const char *node_name, weft_tensor_t *a, weft_tensor_t *b,
                                 const mm_plan_t *pl, weft_tensor_t **out_p)
{
    weft_dtype_t dt = weft_tensor_dtype(a);
    weft_tensor_t *out = NULL;
    weft__ag_node_t *n = NULL;
    weft_status_t status;

    WEFT_CHECK(weft_tensor_empty(dt, pl->out_ndim, pl->out_shape, &out));
    mm_forward(dt, pl, weft_tensor_data(a), weft_tensor_data(b), weft_tensor_data(out));
    if (weft__ag_should_record(2, (weft_tensor_t *[]){a, b})) {
        WEFT_CHECK_GOTO(
            weft__ag_node_new(node_name, matmul_backward, 2, (weft_tensor_t *[]){a, b}, &n), status,
            err_release_out);
        status = weft__ag_save(n, a);
        if (status == WEFT_OK) {
            status = weft__ag_save(n, b);
        }
        if (status == WEFT_OK) {
            status = weft__ag_attach(n, 1, &out);
        }
        weft__ag_node_unref(n);
        if (status != WEFT_OK) {
            goto err_release_out;
        }
    }
    *out_p = out;
    return WEFT_OK;

err_release_out:
    weft_tensor_release(out);
    return status;
}

weft_status_t weft_op_matmul(weft_tensor_t *a, weft_tensor_t *b, weft_tensor_t **out_p)
{
    mm_plan_t pl;

    if (a == NULL || b == NULL || out_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "matmul: NULL argument");
    }
    WEFT_CHECK(check_float_pair("matmul", a, b));
    WEFT_CHECK(mm_plan("matmul", weft_tensor_ndim(a), weft_tensor_shape(a), weft_tensor_ndim(b),
                       weft_tensor_shape(b), &pl));
    return matmul_impl("MatmulBackward", a, b, &pl, out_p);
}

weft_status_t weft_op_bmm(weft_tensor_t *a, weft_tensor_t *b, weft_tensor_t **out_p)
{
    const int64_t *sa;
    const int64_t *sb;
    mm_plan_t pl;

    if (a == NULL || b == NULL || out_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "bmm: NULL argument");
    }
    WEFT_CHECK(check_float_pair("bmm", a, b));
    sa = weft_tensor_shape(a);
    sb = weft_tensor_shape(b);
    if (weft_tensor_ndim(a) != 3 || weft_tensor_ndim(b) != 3) {
        return weft__set_error(WEFT_ERR_SHAPE, "bmm: needs two 3-D tensors, got %s and %s",
                               weft__tensor_shape_str(a).s, weft__tensor_shape_str(b).s);
    }
    if (sa[0] != sb[0]) {
        return weft__set_error(WEFT_ERR_SHAPE, "bmm: batch sizes differ: %s and %s",
                               weft__tensor_shape_str(a).s, weft__tensor_shape_str(b).s);
    }
    WEFT_CHECK(mm_plan("bmm", 3, sa, 3, sb, &pl));
    return matmul_impl("BmmBackward", a, b, &pl, out_p);
}

/* ---- linear ---------------------------------------------------------------------------------- */

#define LINEAR_COLSUM(T)                                                                           \
    static void colsum_##T(const T *restrict g, int64_t rows, int64_t cols, T *restrict out)       \
    {                                                                                              \
        memset(out, 0, (size_t)cols * sizeof(T));                                                  \
        for (int64_t i = 0; i < rows; i++) {                                                       \
            const T *restrict r = g + i * cols;                                                    \
            for (int64_t j = 0; j < cols; j++) {                                                   \
                out[j] += r[j];                                                                    \
            }                                                                                      \
        }                                                                                          \
    }
LINEAR_COLSUM(float)
LINEAR_COLSUM(double)

/* Inputs: x, w[, b]. Saved: x, w. iargs: rows, in, out. */
static weft_status_t linear_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                     weft_tensor_t **grad_in)
{
    weft_dtype_t dt = n->in_dtype[0];
    int64_t rows = n->iargs[0];
    int64_t in = n->iargs[1];
    int64_t outf = n->iargs[2];
    const void *g = weft_tensor_data(grad_out[0]);
    weft_tensor_t *gx = NULL;
    weft_tensor_t *gw = NULL;
    weft_tensor_t *gb = NULL;
    weft_status_t status;

    if (weft__ag_needs_grad(n, 0)) {
        WEFT_CHECK_GOTO(weft_tensor_empty(dt, n->in_ndim[0], n->in_shape[0], &gx), status, err);
        weft__op_gemm(dt, 0, 0, rows, in, outf, g, weft_tensor_data(n->saved[1]), 0, weft_tensor_data(gx));
    }
    if (weft__ag_needs_grad(n, 1)) {
        WEFT_CHECK_GOTO(weft_tensor_empty(dt, 2, n->in_shape[1], &gw), status, err);
        weft__op_gemm(dt, 1, 0, outf, in, rows, g, weft_tensor_data(n->saved[0]), 0, weft_tensor_data(gw));
    }
    if (n->n_in == 3 && weft__ag_needs_grad(n, 2)) {
        WEFT_CHECK_GOTO(weft_tensor_empty(dt, 1, n->in_shape[2], &gb), status, err);
        if (dt == WEFT_F32) {
            colsum_float(g, rows, outf, weft_tensor_data(gb));
        } else {
            colsum_double(g, rows, outf, weft_tensor_data(gb));
        }
    }
    grad_in[0] = gx;
    grad_in[1] = gw;
    if (n->n_in == 3) {
        grad_in[2] = gb;
    }
    return WEFT_OK;

err:
    weft_tensor_release(gw);
    weft_tensor_release(gx);
    return status;
}

weft_status_t weft_op_linear(weft_tensor_t *x, weft_tensor_t *w, weft_tensor_t *b,
                             weft_tensor_t **out_p)
{
    weft_tensor_t *ins[3] = {x, w, b};
    int n_in = b != NULL ? 3 : 2;
    weft_dtype_t dt;
    const int64_t *xs;
    const int64_t *ws;
    int xnd;
    int64_t rows = 1;
    int64_t in;
    int64_t outf;
    int64_t oshape[WEFT_MAX_DIMS];
    weft_tensor_t *out = NULL;
    weft__ag_node_t *n = NULL;
    weft_status_t status;

    if (x == NULL || w == NULL || out_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "linear: NULL argument");
    }
    WEFT_CHECK(check_float_pair("linear", x, w));
    if (b != NULL && weft_tensor_dtype(b) != weft_tensor_dtype(x)) {
        return weft__set_error(WEFT_ERR_DTYPE, "linear: bias is %s, input %s",
                               weft_dtype_name(weft_tensor_dtype(b)),
                               weft_dtype_name(weft_tensor_dtype(x)));
    }
    dt = weft_tensor_dtype(x);
    xnd = weft_tensor_ndim(x);
    xs = weft_tensor_shape(x);
    ws = weft_tensor_shape(w);
    if (xnd < 1 || weft_tensor_ndim(w) != 2 || ws[1] != xs[xnd - 1]) {
        return weft__set_error(WEFT_ERR_SHAPE,
                               "linear: weight of shape %s does not fit input of shape %s "
                               "(expected [out, %lld])",
                               weft__tensor_shape_str(w).s, weft__tensor_shape_str(x).s,
                               (long long)(xnd >= 1 ? xs[xnd - 1] : 0));
    }
    in = ws[1];
    outf = ws[0];
    if (b != NULL && (weft_tensor_ndim(b) != 1 || weft_tensor_shape(b)[0] != outf)) {
        return weft__set_error(WEFT_ERR_SHAPE,
                               "linear: bias of shape %s does not fit weight of shape %s "
                               "(expected [%lld])",
                               weft__tensor_shape_str(b).s, weft__tensor_shape_str(w).s,
                               (long long)outf);
    }
    for (int i = 0; i < xnd - 1; i++) {
        rows *= xs[i];
        oshape[i] = xs[i];
    }
    oshape[xnd - 1] = outf;
    if (!weft__op_fits_blas(rows) || !weft__op_fits_blas(in) || !weft__op_fits_blas(outf)) {
        return weft__set_error(WEFT_ERR_UNSUPPORTED, "linear: input %s and weight %s are too large",
                               weft__tensor_shape_str(x).s, weft__tensor_shape_str(w).s);
    }

    WEFT_CHECK(weft_tensor_empty(dt, xnd, oshape, &out));
    if (b != NULL && rows > 0 && outf > 0) {
        size_t row_bytes = (size_t)outf * weft_dtype_size(dt);
        char *o = weft_tensor_data(out);

        for (int64_t i = 0; i < rows; i++) {
            memcpy(o + (size_t)i * row_bytes, weft_tensor_data(b), row_bytes);
        }
    }
    weft__op_gemm(dt, 0, 1, rows, outf, in, weft_tensor_data(x), weft_tensor_data(w), b != NULL ? 1 : 0,
         weft_tensor_data(out));

    if (weft__ag_should_record(n_in, ins)) {
        WEFT_CHECK_GOTO(weft__ag_node_new("LinearBackward", linear_backward, n_in, ins, &n), status,
                        err_release_out);
        n->iargs[0] = rows;
        n->iargs[1] = in;
        n->iargs[2] = outf;
        status = weft__ag_save(n, x);
        if (status == WEFT_OK) {
            status = weft__ag_save(n, w);
        }
        if (status == WEFT_OK) {
            status = weft__ag_attach(n, 1, &out);
        }
        weft__ag_node_unref(n);
        if (status != WEFT_OK) {
            goto err_release_out;
        }
    }
    *out_p = out;
    return WEFT_OK;

err_release_out:
    weft_tensor_release(out);
    return status;
}
