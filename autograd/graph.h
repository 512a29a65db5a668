/*
 * autograd internals: how an operation records itself in the graph. Not installed.
 *
 * An operation computes its outputs without autograd, then, when weft__ag_should_record() says
 * so, makes a node, saves what its backward needs and attaches the node to its outputs:
 *
 *     weft__ag_node_t *n;
 *     if (weft__ag_should_record(2, (weft_tensor_t *[]){a, b})) {
 *         WEFT_CHECK_GOTO(weft__ag_node_new("MulBackward", mul_backward, 2,
 *                                            (weft_tensor_t *[]){a, b}, &n), st, err);
 *         st = weft__ag_save(n, a);            // saved tensors keep only the data
 *         if (st == WEFT_OK) st = weft__ag_save(n, b);
 *         if (st == WEFT_OK) st = weft__ag_attach(n, 1, &out);
 *         weft__ag_node_unref(n);              // the outputs hold it now
 *     }
 *
 * backward(n, grad_out, grad_in) gets one gradient per output (never NULL: the engine passes
 * zeros for outputs that received none) and sets grad_in[i] to a new reference for each input i
 * with weft__ag_needs_grad(n, i), leaving the others NULL. A gradient must have the input's shape
 * and dtype (reduce broadcast dimensions with weft__op_sum_to). An input may instead receive a
 * sparse gradient through weft__ag_grad_sparse (embedding). The engine releases grad_in.
 *
 * A backward that cannot finish at once (distributed autograd: it sends gradients to another
 * worker, or waits for gradients from one) waits on a future instead of blocking:
 *
 *     static weft_status_t recv_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
 *                                        weft_tensor_t **grad_in)
 *     {
 *         weft_future_t *f = ...;                  // completed later, on any thread
 *         weft_status_t st = weft__ag_wait(n, f, recv_resume, NULL);
 *         weft_future_release(f);                  // the engine holds its own reference
 *         return st;                               // WEFT__AG_WAITING
 *     }
 *
 * The engine goes on with the other ready nodes. Once f has completed successfully it calls
 * recv_resume(n, f, arg, grad_out, grad_in) on its own thread (the one that called backward, never
 * the thread that completed f), with the grad_out the backward got; resume fills grad_in exactly
 * as a backward would (weft__ag_grad_sparse included), or waits again the same way. Only the step
 * that finishes gives gradients. A failed future fails the whole backward with the future's
 * status and a text naming the node (resume is not called); a failing resume fails it with its
 * status, its text prefixed with the node's name. Each wait is bounded by the backward's
 * wait_timeout_ms (weft_backward_opts_t), counted from when the node began to wait; past it the
 * backward fails with WEFT_ERR_TIMEOUT. When a backward fails, the waits still pending are
 * abandoned: the engine drops its references to their futures (it registers no callback on
 * them), so a future may complete later without touching the engine.
 */
#ifndef WEFT_AUTOGRAD_GRAPH_H
#define WEFT_AUTOGRAD_GRAPH_H

#if defined(WEFT_BUILDING) && !defined(WEFT_IN_AUTOGRAD)
#error "autograd/graph.h is internal to autograd: other modules use its public or module API"
#endif

#include <stdint.h>

#include "../core/internal.h"

#include <weft/autograd.h>

#define WEFT__AG_MAX_SAVED 6
#define WEFT__AG_MAX_IN    8 /* more inputs (concat of many tensors) use the heap */

typedef struct weft__ag_node weft__ag_node_t;

typedef weft_status_t (*weft__ag_backward_cb_t)(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                                weft_tensor_t **grad_in);
/**
 * Resumes node @p n once the future @p f it waited on has completed successfully. @p f is
 * borrowed (the engine releases it after the call; the callback may take its value); @p arg is
 * what was given to weft__ag_wait; @p grad_out and @p grad_in are as for the backward. Returns
 * WEFT_OK with the gradients in grad_in, what weft__ag_wait returned to wait again, or an error.
 */
typedef weft_status_t (*weft__ag_resume_cb_t)(weft__ag_node_t *n, weft_future_t *f, void *arg,
                                              weft_tensor_t *const *grad_out,
                                              weft_tensor_t **grad_in);

/** What a step that waits returns (weft__ag_wait's status): "not completed yet". */
#define WEFT__AG_WAITING WEFT_ERR_PENDING

/* Where the gradient of one input goes: the node that made it, or a leaf, or nowhere. */
typedef struct {
    weft__ag_node_t *node; /* strong reference, or NULL */
    int out_index;         /* which output of node */
    weft_tensor_t *leaf;   /* strong reference to a leaf that requires grad, or NULL */
} weft__ag_edge_t;

struct weft__ag_node {
    long refs; /* atomic */
    const char *name;
    weft__ag_backward_cb_t backward;
    int n_in;
    weft__ag_edge_t *next; /* n_in edges */
    int n_out;
    /* The shape and dtype of each output, for the zeros of outputs that get no gradient
     * (all outputs share the first output's dtype). */
    int out_ndim[WEFT__AG_MAX_IN];
    int64_t out_shape[WEFT__AG_MAX_IN][WEFT_MAX_DIMS];
    weft_dtype_t out_dtype[WEFT__AG_MAX_IN];
    /* The shape and dtype of each input (first WEFT__AG_MAX_IN; in_shape_ext for more). */
    int in_ndim[WEFT__AG_MAX_IN];
    int64_t in_shape[WEFT__AG_MAX_IN][WEFT_MAX_DIMS];
    weft_dtype_t in_dtype[WEFT__AG_MAX_IN];
    weft_tensor_t *saved[WEFT__AG_MAX_SAVED]; /* data-only aliases; NULL once freed */
    int n_saved;
    int freed; /* backward without retain_graph released the saved state */
    /* Small op arguments (dims, scalars) for backward. */
    int64_t iargs[WEFT_MAX_DIMS + 4];
    double dargs[4];
    /* Larger op state (split sizes, ...): freed with ctx_free when the node goes or is freed. */
    void *ctx;
    void (*ctx_free)(void *ctx);
    /* Engine bookkeeping. */
    int deps;
    int64_t seq;         /* creation order: backward runs later nodes first */
    uint64_t run;        /* the backward that last visited the node */
    weft_tensor_t **buf; /* gradient being summed per output during backward */
    /* Output shapes beyond the first WEFT__AG_MAX_IN (split into many pieces). */
    int *out_ndim_ext;
    int64_t (*out_shape_ext)[WEFT_MAX_DIMS];
    weft__ag_edge_t edges_inline[WEFT__AG_MAX_IN];
};

/** True when grad mode is on and at least one of the tensors requires grad. */
int weft__ag_should_record(int n, weft_tensor_t *const *inputs);
/**
 * A node for an operation with @p n_in inputs (one edge per input: to the input's grad_fn, or
 * to the input itself if it is a leaf that requires grad, or none). One reference to the caller.
 */
weft_status_t weft__ag_node_new(const char *name, weft__ag_backward_cb_t backward, int n_in,
                                weft_tensor_t *const *inputs, weft__ag_node_t **node_p);
/**
 * Saves @p t for backward in the next slot: a data-only alias of a float tensor (no grad_fn, so
 * no reference cycle; like torch without version counters, a later in-place write to it changes
 * the gradient), a private copy of an integer tensor (indices, labels: backward indexes memory
 * with them, so they must not change after the forward checked them).
 */
weft_status_t weft__ag_save(weft__ag_node_t *n, weft_tensor_t *t);
/** Makes @p n the grad_fn of each output (which must be fresh tensors with no grad_fn). */
weft_status_t weft__ag_attach(weft__ag_node_t *n, int n_out, weft_tensor_t *const *outputs);
void weft__ag_node_ref(weft__ag_node_t *n);
void weft__ag_node_unref(weft__ag_node_t *n);
/** True when input @p i of @p n leads to something that needs its gradient. */
int weft__ag_needs_grad(const weft__ag_node_t *n, int i);
/**
 * Inside backward: gives input @p i a sparse gradient instead of a dense one (its grad_in stays
 * NULL). @p indices (i64 [nnz]) and @p rows ([nnz, row...]) are retained. Only a leaf input can
 * take a sparse gradient; for others it is densified.
 */
weft_status_t weft__ag_grad_sparse(weft__ag_node_t *n, int i, weft_tensor_t *indices,
                                   weft_tensor_t *rows);
/**
 * Inside the backward or a resume callback of @p n: ends this step without gradients and has the
 * engine call @p resume(n, f, arg, ...) on its own thread once @p f has completed successfully
 * (see the top of this file). The step must return what this returns.
 * @param f retained by the engine until the node is resumed or the backward ends; the caller
 *          keeps its own reference.
 * @param arg borrowed; must stay valid until resume is called or the backward returns (the
 *            engine never frees it: state that must outlive a failed backward belongs in n->ctx).
 * @return WEFT__AG_WAITING when the wait is recorded; WEFT_ERR_INVALID_ARG (NULL argument),
 *         WEFT_ERR_INVALID_STATE (outside a step of @p n, or a second wait in one step).
 */
weft_status_t weft__ag_wait(weft__ag_node_t *n, weft_future_t *f, weft__ag_resume_cb_t resume,
                            void *arg);

/* ---- helpers for op writers (autograd/ops_*.c) ---------------------------------------------- */

/** True for f32 and f64. */
int weft__op_is_float(weft_dtype_t dt);
/**
 * Sums @p g over the broadcast dimensions so that it has shape (@p ndim, @p shape) (numpy
 * broadcasting rules); returns a new reference (@p g itself, retained, if the shapes match).
 */
weft_status_t weft__op_sum_to(weft_tensor_t *g, int ndim, const int64_t *shape,
                              weft_tensor_t **out_p);
/** A new zero tensor like the given shape. */
weft_status_t weft__op_zeros(weft_dtype_t dt, int ndim, const int64_t *shape,
                             weft_tensor_t **out_p);
/** out = a + b for equal shapes (no graph); used by the engine to sum gradients. */
weft_status_t weft__op_add_same(weft_tensor_t *a, weft_tensor_t *b, weft_tensor_t **out_p);
/** a += b in place for equal shapes and dtypes. */
weft_status_t weft__op_add_inplace(weft_tensor_t *a, const weft_tensor_t *b);

/** A CPU tensor of f32 or f64 (WEFT_ERR_INVALID_ARG, WEFT_ERR_DTYPE with a text naming @p op). */
weft_status_t weft__op_check_float(const char *op, const weft_tensor_t *t);
/** WEFT_ERR_INVALID_ARG unless @p reduction is MEAN, SUM or NONE. */
weft_status_t weft__op_check_reduction(const char *op, int reduction); /* a weft_reduction_t */
/** Whether @p v fits BLAS's int dimensions. */
int weft__op_fits_blas(int64_t v);
/**
 * C[m, nn] = A[m, k] B[k, nn] + beta C (f32 or f64) for contiguous row-major matrices, A and B
 * optionally transposed (then stored as [k, m] and [nn, k]); through OpenBLAS. Empty products
 * give beta C (0 when beta == 0).
 */
void weft__op_gemm(weft_dtype_t dt, int ta, int tb, int64_t m, int64_t nn, int64_t k, const void *a,
                   const void *b, double beta, void *c);
/** weft__op_check_float of @p a, and a non-NULL @p out_p. */
weft_status_t weft__op_check_one(const char *op, const weft_tensor_t *a, weft_tensor_t **out_p);
/** A fresh tensor of @p t's dtype and shape, contents uninitialised. */
weft_status_t weft__op_empty_like(const weft_tensor_t *t, weft_tensor_t **out_p);
/**
 * For a one-output op: a node (weft__ag_node_new) when grad mode and the inputs call for one,
 * *n_p = NULL otherwise. Finish with weft__op_node_end.
 */
weft_status_t weft__op_node_begin(const char *name, weft__ag_backward_cb_t backward, int n_in,
                                  weft_tensor_t *const *inputs, weft__ag_node_t **n_p);
/** Attaches @p n to @p out unless @p st already failed; drops the caller's reference to @p n.
 * Returns the first failure. */
weft_status_t weft__op_node_end(weft__ag_node_t *n, weft_status_t st, weft_tensor_t *out);

/**
 * dst[idx[i] * width + j] += src[i * width + j] for i < @p k, j < @p width: rows of an f32 or f64
 * gradient added into the rows they were taken from (embedding, index_select, a sparse gradient
 * made dense, packing sparse gradients). The caller has checked the indices.
 */
void weft__op_scatter_add_rows(weft_dtype_t dt, void *dst, const void *src, const int64_t *idx,
                               int64_t k, int64_t width);

/** A shape as text for error messages, by value so that it can go straight into a format. */
typedef struct {
    char s[WEFT_MAX_DIMS * 22 + 8]; /* "[" + 8 x ", <20 digits>" + ", ...]" */
} weft__shape_str_t;
/**
 * "[2, 3, 4]" ("[]" for no dims): weft__shape_str(nd, shape).s. At most WEFT_MAX_DIMS dims are
 * written, then ", ...".
 */
weft__shape_str_t weft__shape_str(int ndim, const int64_t *shape);
/** weft__shape_str of @p t's shape. */
weft__shape_str_t weft__tensor_shape_str(const weft_tensor_t *t);

#endif
