/*
 * The autograd engine: a dynamic graph recorded by the operations of <weft/ops.h> on tensors that
 * require gradients, and backward through it.
 *
 * A tensor that requires gradients and was not made by a recorded operation is a leaf (a
 * parameter); backward accumulates into its gradient (weft_tensor_grad). A tensor made by a
 * recorded operation holds its graph node (grad_fn), and the graph lives as long as some tensor
 * that holds a node of it. Backward frees what the nodes saved unless retain_graph is set;
 * backward through a freed graph is an error.
 *
 * Thread-safety: grad mode is per thread. One graph must not be used by two threads at once;
 * separate graphs may run backward concurrently, also when they share leaves (a leaf's gradient
 * is summed under its lock). Backward runs on the thread that calls it (the engine's thread):
 * hooks run there, and so do the nodes that wait on futures (distributed autograd) when they
 * resume, whatever thread completed the future.
 */
#ifndef WEFT_AUTOGRAD_H
#define WEFT_AUTOGRAD_H

#include <weft/api.h>

/* Layering (docs/architecture.md): only autograd and the modules above it may include this. */
#if defined(WEFT_BUILDING) && !defined(WEFT_SEES_AUTOGRAD)
#error "weft/autograd.h is above the module being built: dependencies point downward only"
#endif

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <weft/future.h>
#include <weft/status.h>
#include <weft/tensor.h>

#ifdef __cplusplus
extern "C" {
#endif

/** A node of the autograd graph (opaque; weft_ag_node_create). */
typedef struct weft__ag_node weft_ag_node_t;

/** True when operations on this thread record graphs (the default). */
WEFT_API int weft_grad_enabled(void);
/**
 * Turns recording on or off for the calling thread (torch.no_grad is weft_grad_set_enabled(0)).
 * @return the previous setting, to restore.
 */
WEFT_API int weft_grad_set_enabled(int enabled);

/**
 * Marks a leaf tensor as requiring gradients (or not).
 * @return WEFT_ERR_DTYPE (only f32 and f64 tensors can require gradients),
 *         WEFT_ERR_INVALID_STATE (the tensor is not a leaf: it was made by a recorded operation),
 *         WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_tensor_set_requires_grad(weft_tensor_t *t, int requires_grad);
/** True when @p t requires gradients (a leaf marked so, or the output of a recorded op). */
WEFT_API int weft_tensor_requires_grad(const weft_tensor_t *t);
/** True when @p t has no grad_fn (every tensor not made by a recorded operation). */
WEFT_API int weft_tensor_is_leaf(const weft_tensor_t *t);
/** Name of the node that made @p t ("MatmulBackward"), or NULL for a leaf. Borrowed. */
WEFT_API const char *weft_tensor_grad_fn_name(const weft_tensor_t *t);

/**
 * The dense gradient accumulated into leaf @p t, or NULL if none. Borrowed: valid until the next
 * backward, weft_tensor_grad_clear or weft_tensor_set_grad on @p t. It may be written in place
 * (optimizers and the DDP reducer do).
 */
WEFT_API weft_tensor_t *weft_tensor_grad(const weft_tensor_t *t);
/**
 * The sparse gradient of leaf @p t (from embedding lookups made with sparse gradients): row
 * indices (i64 [nnz]) and rows ([nnz, row...], same dtype as @p t). Rows of repeated indices are
 * not summed (like torch's uncoalesced sparse gradient): index i adds rows[k] to row indices[k].
 * Borrowed, like weft_tensor_grad.
 * @return WEFT_ERR_NOT_FOUND when @p t has no sparse gradient.
 */
WEFT_API weft_status_t weft_tensor_sparse_grad(const weft_tensor_t *t, weft_tensor_t **indices_p,
                                               weft_tensor_t **rows_p);
/** True when leaf @p t has a sparse gradient (records no error text when it has none). */
WEFT_API int weft_tensor_has_sparse_grad(const weft_tensor_t *t);
/** Drops the gradient of @p t, dense and sparse (zero_grad with set_to_none). */
WEFT_API void weft_tensor_grad_clear(weft_tensor_t *t);
/**
 * Replaces the dense gradient of leaf @p t with @p grad (retained; NULL clears it). Backward then
 * adds into @p grad in place: a trainer can place every gradient in one flat buffer.
 * @return WEFT_ERR_SHAPE / WEFT_ERR_DTYPE when @p grad does not match @p t,
 *         WEFT_ERR_INVALID_STATE when @p t is not a leaf.
 */
WEFT_API weft_status_t weft_tensor_set_grad(weft_tensor_t *t, weft_tensor_t *grad);

/**
 * A tensor sharing @p t's storage that is a leaf and does not require gradients.
 * @param[out] out_p caller releases with weft_tensor_release.
 */
WEFT_API weft_status_t weft_tensor_detach(weft_tensor_t *t, weft_tensor_t **out_p);

/**
 * Runs backward from @p root. @p grad is the gradient of the root (same shape and dtype); NULL
 * means 1 and needs a root with one element. Gradients accumulate into the leaves that require
 * them. Unless @p retain_graph, what the graph's nodes saved is freed as backward passes, and a
 * second backward through a node that had saved something fails with WEFT_ERR_INVALID_STATE
 * (as in torch, nodes that saved nothing can be gone through again).
 * A node that waits on a future (distributed autograd) may wait WEFT_BACKWARD_WAIT_TIMEOUT_MS;
 * weft_backward_run takes another bound.
 * @return WEFT_ERR_INVALID_ARG (the root does not require gradients, or NULL grad with a
 *         non-scalar root), WEFT_ERR_SHAPE (grad's shape differs), WEFT_ERR_INVALID_STATE (the
 *         graph was freed by an earlier backward), WEFT_ERR_TIMEOUT (a node waited too long), or
 *         the status of a failing node, hook or future a node waited on.
 */
WEFT_API weft_status_t weft_backward(weft_tensor_t *root, weft_tensor_t *grad, int retain_graph);
/** Backward from several roots at once (each with its gradient, NULL for 1). */
WEFT_API weft_status_t weft_backward_many(int n, weft_tensor_t *const *roots,
                                          weft_tensor_t *const *grads, int retain_graph);

/** The bound on one wait of a node in backward when weft_backward_opts_t gives 0 (5 minutes). */
#define WEFT_BACKWARD_WAIT_TIMEOUT_MS 300000

/** Options of weft_backward_run. Fill with weft_backward_opts_init, then set fields. */
typedef struct {
    bool retain_graph; /**< keep what the nodes saved, for another backward (default false) */
    /**
     * How long one node may wait on a future (nodes of distributed autograd that send or await
     * gradients), from when it begins to wait; past it backward fails with WEFT_ERR_TIMEOUT. The
     * engine sleeps only while every node it could run is waiting, never past the earliest
     * deadline. 0: WEFT_BACKWARD_WAIT_TIMEOUT_MS; negative is WEFT_ERR_INVALID_ARG.
     */
    int64_t wait_timeout_ms;
    /**
     * More roots: nodes (weft_ag_node_create) that start with no gradient, run once their
     * dependencies are in like any node, and usually wait for theirs (distributed autograd's send
     * nodes, whose gradients come from another worker). With these, @p n of weft_backward_run may
     * be 0. Borrowed for the call.
     */
    size_t n_root_nodes;
    weft_ag_node_t *const *root_nodes;
    /**
     * Where leaves' gradients go. NULL: into each leaf's gradient (weft_tensor_grad), then its
     * hooks. Otherwise leaf_fn gets each leaf's gradient of this backward once it is complete
     * (@p grad dense and borrowed, or @p indices and @p rows of a sparse gradient, borrowed), and
     * the leaf's own gradient is left alone unless leaf_also_grad. A status other than WEFT_OK
     * stops backward and is returned.
     */
    weft_status_t (*leaf_fn)(void *arg, weft_tensor_t *leaf, weft_tensor_t *grad,
                             weft_tensor_t *indices, weft_tensor_t *rows);
    void *leaf_arg;
    bool leaf_also_grad;
    /**
     * Called on the engine's thread each time nothing can run and the @p n_waiting nodes left all
     * wait on futures, just before the engine sleeps on them (it may complete some of them).
     */
    void (*idle_fn)(void *arg, size_t n_waiting);
    void *idle_arg;
} weft_backward_opts_t;

/** Fills @p opts with the defaults (no retain_graph, the default wait bound). Thread-safe. */
WEFT_API void weft_backward_opts_init(weft_backward_opts_t *opts);

/**
 * Backward from @p n roots with options (weft_backward_many is this with the default wait bound).
 * Runs on the calling thread, which is the engine's thread: when every node it could run waits on
 * a future, it sleeps on those futures (weft_future_wait_any, so an rpc handler thread that calls
 * it counts as blocked), and resumes each waiting node on this thread once its future completes.
 * Gradients reach the leaves in completion order then, so a leaf summed from several waiting
 * nodes may differ in the last bits between runs; graphs without waiting nodes run as
 * weft_backward does, in a fixed order.
 * @param roots, grads borrowed, as for weft_backward_many (@p grads may be NULL: 1 for each).
 * @param opts borrowed; NULL for the defaults.
 * @return as weft_backward, and WEFT_ERR_INVALID_ARG (a negative wait_timeout_ms),
 *         WEFT_ERR_TIMEOUT (a node waited longer than wait_timeout_ms), or the status of a failed
 *         future a node waited on, with a text naming the node. Thread-safe for separate graphs.
 */
WEFT_API weft_status_t weft_backward_run(size_t n, weft_tensor_t *const *roots,
                                         weft_tensor_t *const *grads,
                                         const weft_backward_opts_t *opts);

/* ---- nodes of one's own (modules above autograd: distributed autograd) -------------------------
 *
 * A node records one step of a computation the engine does not know: made over the inputs that
 * require gradients, attached to its outputs, and run by backward like any operation's node. Its
 * backward gets one gradient per output (zeros for outputs that received none) and sets
 * grad_in[i] to a new reference for each input i with weft_ag_node_needs_grad, leaving the
 * others NULL. A backward that cannot finish at once waits on a future (weft_ag_wait) and is
 * resumed on the engine's thread once it completes (docs/autograd.md, "Nodes that wait on a
 * future"). */

typedef weft_status_t (*weft_ag_backward_cb_t)(weft_ag_node_t *n, weft_tensor_t *const *grad_out,
                                               weft_tensor_t **grad_in);
/** Resumes @p n once @p f (borrowed; its value may be taken) has completed successfully. */
typedef weft_status_t (*weft_ag_resume_cb_t)(weft_ag_node_t *n, weft_future_t *f, void *arg,
                                             weft_tensor_t *const *grad_out,
                                             weft_tensor_t **grad_in);
/** What a step that waits returns (weft_ag_wait's status). */
#define WEFT_AG_WAITING WEFT_ERR_PENDING

/** True when grad mode is on and one of the @p n tensors requires gradients. */
WEFT_API int weft_ag_should_record(int n, weft_tensor_t *const *inputs);
/**
 * A node named @p name (a string that outlives the node) over @p n_in inputs (>= 0; each input
 * that requires gradients gets an edge to its node or leaf). @p ctx is the node's state, freed
 * with @p ctx_free (may be NULL) when the node goes, or after its backward ran without
 * retain_graph (a second backward through it is then refused). One reference to the caller.
 */
WEFT_API weft_status_t weft_ag_node_create(const char *name, weft_ag_backward_cb_t backward,
                                           int n_in, weft_tensor_t *const *inputs, void *ctx,
                                           void (*ctx_free)(void *ctx), weft_ag_node_t **node_p);
/**
 * Makes @p n the node of @p n_out (>= 0) fresh outputs (no node yet): they require gradients
 * from now on. A node with no outputs is a root of its own (weft_backward_opts_t.root_nodes).
 */
WEFT_API weft_status_t weft_ag_node_attach(weft_ag_node_t *n, int n_out,
                                           weft_tensor_t *const *outputs);
/** The node's state (NULL once freed). */
WEFT_API void *weft_ag_node_ctx(const weft_ag_node_t *n);
/** True when input @p i of @p n leads to something that needs its gradient. */
WEFT_API int weft_ag_node_needs_grad(const weft_ag_node_t *n, int i);
WEFT_API weft_ag_node_t *weft_ag_node_retain(weft_ag_node_t *n);
WEFT_API void weft_ag_node_release(weft_ag_node_t *n);
/**
 * Inside the backward or a resume callback of @p n: ends the step without gradients; the engine
 * calls @p resume(n, f, arg, ...) on its own thread once @p f has completed successfully (a failed
 * @p f fails the backward, naming the node). The step returns what this returns.
 * @return WEFT_AG_WAITING; WEFT_ERR_INVALID_ARG, WEFT_ERR_INVALID_STATE (outside a step of @p n,
 *         or a second wait in one step).
 */
WEFT_API weft_status_t weft_ag_wait(weft_ag_node_t *n, weft_future_t *f,
                                    weft_ag_resume_cb_t resume, void *arg);

/**
 * Called when backward has finished accumulating into @p param's gradient, once per backward
 * (torch's post-accumulate-grad hook; the DDP reducer hangs its buckets on these). @p grad is
 * the parameter's dense gradient (NULL when it has none, e.g. only a sparse one). Hooks of one
 * parameter run in order from a snapshot taken before the first: one may remove itself or add
 * others (which run from the next backward on). Return WEFT_OK to go on; any other status stops
 * backward and is returned by it.
 */
typedef weft_status_t (*weft_grad_hook_cb_t)(weft_tensor_t *param, weft_tensor_t *grad, void *arg);
/**
 * Adds a hook to leaf @p param (which must require gradients). Hooks of one parameter run in the
 * order they were added.
 * @param[out] id_p identifies the hook for weft_tensor_remove_grad_hook (may be NULL).
 */
WEFT_API weft_status_t weft_tensor_add_grad_hook(weft_tensor_t *param, weft_grad_hook_cb_t cb,
                                                 void *arg, int *id_p);
/** Removes a hook. @return WEFT_ERR_NOT_FOUND for an unknown id. */
WEFT_API weft_status_t weft_tensor_remove_grad_hook(weft_tensor_t *param, int id);

#ifdef __cplusplus
}
#endif
#endif
