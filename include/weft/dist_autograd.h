/*
 * Distributed autograd and the distributed optimizer (docs/dist_autograd.md).
 *
 * A forward pass that spans workers runs inside a context. Every weft call made in a context
 * (weft_rpc_*, RRef remote() / to_here() / method calls, nested calls in handlers) records a send
 * function on the sender and a receive function on the receiver for the tensors that require
 * gradients, for the request and for its answer. weft_dist_backward then runs the backward pass
 * of the whole job from this worker's roots (torch's FAST mode): gradients flow back along the
 * recorded calls and accumulate in the context, on every worker, for its own leaves
 * (weft_dist_get_gradients). The DistributedOptimizer steps parameters owned anywhere with the
 * gradients of one context.
 *
 *     uint64_t ctx;
 *     weft_dist_context_create(agent, &ctx);            // current on this thread
 *     weft_rpc_sync(agent, 1, "add", args, 0, &res);      // records send/recv functions
 *     ... loss = (t3 * t4).sum() ...
 *     weft_dist_backward(agent, ctx, 1, &loss, NULL);     // the whole job's backward
 *     weft_dist_optim_step(opt, ctx, 0);                  // one call per parameter owner
 *     weft_dist_context_release(agent, ctx, 0);           // acknowledged by every worker
 *
 * Every rank calls weft_dist_init before it joins the world.
 */
#ifndef WEFT_DIST_AUTOGRAD_H
#define WEFT_DIST_AUTOGRAD_H

#include <weft/api.h>

#if defined(WEFT_BUILDING) && !defined(WEFT_SEES_DIST_AUTOGRAD)
#error "weft/dist_autograd.h is above the module being built: dependencies point downward only"
#endif

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <weft/autograd.h>
#include <weft/rpc.h>
#include <weft/rref.h>
#include <weft/status.h>
#include <weft/tensor.h>

#ifdef __cplusplus
extern "C" {
#endif

/**
 * Sets up distributed autograd on @p a (its module, its functions and the call hooks). Every rank
 * calls it, before weft_agent_join: a call that carries a context to a rank without it is refused
 * (WEFT_ERR_INVALID_STATE). Calling it again is a no-op.
 */
WEFT_API weft_status_t weft_dist_init(weft_agent_t *a);

/* ---- contexts ------------------------------------------------------------------------------- */

/**
 * Creates a context and makes it the calling thread's current one. Its id is unique in the job:
 * this rank << 48 | a counter.
 * @return WEFT_ERR_INVALID_STATE when the thread already has a current context (contexts do not
 *         nest) or weft_dist_init was not called.
 */
WEFT_API weft_status_t weft_dist_context_create(weft_agent_t *a, uint64_t *id_p);
/** The calling thread's current context (0: none). */
WEFT_API uint64_t weft_dist_context_current(void);
/**
 * Makes the existing context @p id current on the calling thread (another thread of the forward,
 * a handler that answers from a thread of its own); 0 leaves it. Returns the previous one.
 * @return WEFT_ERR_NOT_FOUND for an unknown id (the previous context stays).
 */
WEFT_API weft_status_t weft_dist_context_enter(weft_agent_t *a, uint64_t id, uint64_t *prev_p);
/**
 * Releases context @p id on this worker and on every worker it reached (its calls' receivers, and
 * theirs), and waits until each has acknowledged (torch sends these without waiting and leaks).
 * The context stops being current on the calling thread. Workers lost meanwhile are skipped.
 * @param timeout_ms 0: the agent's call timeout.
 * @return WEFT_ERR_NOT_FOUND (unknown id), WEFT_ERR_INVALID_STATE (a backward still runs in it),
 *         WEFT_ERR_TIMEOUT, or the first failure of a worker's release (all are still tried).
 */
WEFT_API weft_status_t weft_dist_context_release(weft_agent_t *a, uint64_t id, int64_t timeout_ms);
/** How many contexts this worker holds (its own and those other workers' calls brought). */
WEFT_API size_t weft_dist_context_count(weft_agent_t *a);

/* ---- backward ------------------------------------------------------------------------------- */

/** Options of weft_dist_backward. Fill with weft_dist_backward_opts_init. */
typedef struct {
    bool retain_graph; /**< keep the graph (on every worker) for another backward in the context */
    /** Also add the gradients of this worker's own leaves (the root's) into their .grad and run
     * their hooks (a DDP reducer's: weft_ddp_backward_with), besides the context. Other workers'
     * leaves get theirs in the context only. */
    bool accumulate_grad;
    /** The bound on the whole backward, on every worker; 0: the agent's call timeout. */
    int64_t timeout_ms;
} weft_dist_backward_opts_t;

WEFT_API void weft_dist_backward_opts_init(weft_dist_backward_opts_t *opts);

/**
 * Runs the distributed backward pass of context @p ctx from @p n scalar @p roots (tensors of this
 * worker; gradient 1 each) and returns when it is done on every worker that took part. Gradients
 * accumulate in the context, per worker, for that worker's leaves; several backwards in one
 * context (retain_graph) add up.
 * @return WEFT_OK; WEFT_ERR_NOT_FOUND (unknown context), WEFT_ERR_INVALID_ARG (a root that does
 *         not require gradients or is not a scalar), WEFT_ERR_INVALID_STATE (a backward already
 *         runs in the context; a send function that never received a gradient: the text names each
 *         such call, its function and workers), WEFT_ERR_TIMEOUT (the bound passed),
 *         WEFT_ERR_PEER_LOST (a worker that took part was lost: every other worker's part fails
 *         too and the contexts that worker created are released), or the status of a failing
 *         node, on any worker, with its text.
 */
WEFT_API weft_status_t weft_dist_backward(weft_agent_t *a, uint64_t ctx, size_t n,
                                          weft_tensor_t *const *roots,
                                          const weft_dist_backward_opts_t *opts);

/** This worker's gradients in a context: leaf i and its gradient (borrowed from the list). */
typedef struct weft_dist_grads weft_dist_grads_t;
/**
 * A snapshot of the gradients context @p ctx holds for this worker's leaves (dense; sparse
 * gradients are made dense). Free with weft_dist_grads_free.
 */
WEFT_API weft_status_t weft_dist_get_gradients(weft_agent_t *a, uint64_t ctx,
                                               weft_dist_grads_t **grads_p);
WEFT_API size_t weft_dist_grads_count(const weft_dist_grads_t *g);
WEFT_API weft_tensor_t *weft_dist_grads_leaf(const weft_dist_grads_t *g, size_t i);
WEFT_API weft_tensor_t *weft_dist_grads_grad(const weft_dist_grads_t *g, size_t i);
/** The gradient of @p leaf in the list (borrowed), NULL if it has none. */
WEFT_API weft_tensor_t *weft_dist_grads_find(const weft_dist_grads_t *g, const weft_tensor_t *leaf);
WEFT_API void weft_dist_grads_free(weft_dist_grads_t *g);
/**
 * Replaces the gradient context @p ctx holds for this worker's leaf @p leaf with a copy of
 * @p grad (same dtype and element count): after a DDP reducer averaged the replicated part's
 * gradients (weft_ddp_backward_with), the averaged ones are what a DistributedOptimizer steps.
 * @return WEFT_ERR_NOT_FOUND (unknown context), WEFT_ERR_SHAPE, WEFT_ERR_INVALID_ARG.
 */
WEFT_API weft_status_t weft_dist_context_set_gradient(weft_agent_t *a, uint64_t ctx,
                                                      weft_tensor_t *leaf,
                                                      const weft_tensor_t *grad);

/* ---- the distributed optimizer -------------------------------------------------------------- */

typedef enum {
    WEFT_DIST_OPTIM_SGD = 0,
    WEFT_DIST_OPTIM_ADAGRAD = 1,
    WEFT_DIST_OPTIM_ADAM = 2,
    WEFT_DIST_OPTIM_ADAMW = 3,
} weft_dist_optim_kind_t;

/** The local optimizer made on every owner; fill with weft_dist_optim_config_init. */
typedef struct {
    weft_dist_optim_kind_t kind;
    double lr;
    double momentum;     /**< SGD */
    double weight_decay; /**< all (AdamW: decoupled) */
    double beta1, beta2, eps; /**< Adam, AdamW; Adagrad's eps */
    bool nesterov;            /**< SGD */
} weft_dist_optim_config_t;

WEFT_API void weft_dist_optim_config_init(weft_dist_optim_config_t *cfg,
                                          weft_dist_optim_kind_t kind, double lr);

typedef struct weft_dist_optim weft_dist_optim_t;
/**
 * torch's DistributedOptimizer: one local optimizer of @p cfg per owner of the parameters
 * @p params (RRefs of leaf tensors that require gradients, owned anywhere, this worker included),
 * made with one call per owner.
 * @return WEFT_ERR_INVALID_ARG (no parameters, a bad config), an owner's failure (a parameter
 *         that is not a tensor requiring gradients).
 */
WEFT_API weft_status_t weft_dist_optim_create(weft_agent_t *a, const weft_dist_optim_config_t *cfg,
                                              size_t n, weft_rref_t *const *params,
                                              weft_dist_optim_t **opt_p);
/**
 * Steps every parameter with its gradient in context @p ctx: one call per owner, in parallel, each
 * applying its local optimizer; steps on the same parameters (from any worker) are serialized by
 * the owner. Parameters without a gradient in the context are left alone.
 * @return WEFT_OK once every owner has stepped; the first owner's failure otherwise (the others
 *         still step).
 */
WEFT_API weft_status_t weft_dist_optim_step(weft_dist_optim_t *opt, uint64_t ctx,
                                            int64_t timeout_ms);
/** Drops the local optimizers (one call per owner) and frees @p opt. */
WEFT_API void weft_dist_optim_free(weft_dist_optim_t *opt);

#ifdef __cplusplus
}
#endif
#endif
