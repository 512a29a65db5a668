/*
 * The bucketed DDP reducer (torch's DistributedDataParallel): the gradients of a model replicated
 * on every member of a process group are averaged in buckets while backward is still running.
 *
 * weft_ddp_create broadcasts the group rank 0's parameters and checks that every member has the
 * same parameters (names, dtypes, shapes: WEFT_ERR_MISMATCH naming the first that differs). The
 * parameters are packed into buckets in reverse order (the order backward reaches them), by
 * dtype, the first of at most first_bucket_bytes (1 MiB) so that the first reduction starts
 * early, the others of at most bucket_cap_bytes (25 MiB). Each parameter's gradient is a view of
 * its bucket (gradient as bucket view: backward accumulates straight into the bucket, and the
 * averaged values are the gradients, no copy either way). A hook on each parameter counts it
 * ready when backward has accumulated it; a bucket whose parameters are all ready starts its
 * reduction at once, asynchronously, in bucket order on every member, while backward goes on.
 * weft_ddp_backward returns when every bucket is averaged.
 *
 * After the first step the buckets are rebuilt once from the order in which the parameters
 * actually became ready, rank 0's order broadcast so that every member buckets alike.
 *
 * A parameter that gets no gradient in a step leaves its bucket incomplete: without
 * find_unused_parameters, weft_ddp_backward still reduces every bucket (no member waits forever)
 * and then fails on every member with WEFT_ERR_INVALID_STATE naming the parameters (on the member
 * that missed them; the others name the bucket), never a hang. With find_unused_parameters such
 * buckets are reduced when backward ends, the missing gradients counted as zero.
 *
 * Thread-safety: one reducer is used by one thread at a time (its training loop).
 */
#ifndef WEFT_DDP_H
#define WEFT_DDP_H

#include <weft/api.h>

/* Layering (docs/architecture.md): only parallel/ and programs may include this. */
#if defined(WEFT_BUILDING) && !defined(WEFT_SEES_PARALLEL)
#error "weft/ddp.h is above the module being built: dependencies point downward only"
#endif

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <weft/autograd.h>
#include <weft/collectives.h>
#include <weft/nn.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct weft_ddp weft_ddp_t;

/** How a bucket of f32 gradients travels (torch's fp16/bf16 compress hooks). */
typedef enum {
    WEFT_DDP_COMPRESS_NONE = 0,
    WEFT_DDP_COMPRESS_FP16 = 1, /**< converted to f16, averaged (in f32, one rounding), back */
    WEFT_DDP_COMPRESS_BF16 = 2, /**< the same with bf16 */
} weft_ddp_compress_t;

/**
 * A communication hook (torch's register_comm_hook): starts the reduction of bucket
 * @p bucket_index, whose flat tensor @p bucket holds this member's gradients (then a few
 * bookkeeping elements of the reducer's, which must be averaged like the gradients), and makes
 * *work_p a future that completes when @p bucket holds the result the parameters get (normally
 * the mean over @p pg). Runs on the thread running backward; must not block. An error must come
 * before it issued anything on @p pg: the reducer then fails the group's operation for the other
 * members (weft_coll_fail), so that they fail this bucket at once and stay paired.
 */
typedef weft_status_t (*weft_ddp_comm_hook_t)(void *arg, weft_pg_t *pg, int bucket_index,
                                              weft_tensor_t *bucket, weft_future_t **work_p);

/** Options of weft_ddp_create. Fill with weft_ddp_opts_init, then set fields. */
typedef struct {
    size_t bucket_cap_bytes;     /**< 0: 25 MiB */
    size_t first_bucket_bytes;   /**< 0: 1 MiB */
    bool find_unused_parameters; /**< parameters may get no gradient in a step (default false) */
    bool rebuild_buckets;        /**< rebuild once from the observed order (default true; never
                                      with find_unused_parameters, as in torch) */
    weft_ddp_compress_t compress; /**< f32 buckets only; ignored with comm_hook */
    weft_ddp_comm_hook_t comm_hook; /**< NULL: all_reduce AVG (or compress) */
    void *comm_hook_arg;
} weft_ddp_opts_t;

/** The defaults: 25 MiB buckets, a 1 MiB first bucket, rebuild, no compression. Thread-safe. */
WEFT_API void weft_ddp_opts_init(weft_ddp_opts_t *opts);

/**
 * Makes a reducer for @p params (every parameter that requires gradients; borrowed, they must
 * outlive the reducer) over @p pg (borrowed, likewise). Collective over @p pg: broadcasts group
 * rank 0's parameter values and checks the parameters are alike on every member.
 * @return WEFT_ERR_MISMATCH (a parameter's name, dtype or shape, or the count, differs; the text
 *         names the parameter and the members), WEFT_ERR_INVALID_ARG, a collective's status.
 */
WEFT_API weft_status_t weft_ddp_create(weft_pg_t *pg, const weft_param_list_t *params,
                                       const weft_ddp_opts_t *opts, weft_ddp_t **ddp_p);
/** Removes the hooks and frees the reducer (the gradients stay, as tensors of their own). */
WEFT_API void weft_ddp_free(weft_ddp_t *ddp);

/**
 * One backward of the replicated model from @p loss (@p grad: its gradient, NULL for 1), with
 * the buckets reduced as they fill. Collective over the group. Returns when every parameter's
 * gradient is the average over the members (accumulated onto what it held, as backward does: clear
 * gradients with weft_param_list_zero_grad between steps). Outside weft_ddp_set_sync(false) every
 * member must call it the same number of times.
 * @return backward's status, a reduction's, or WEFT_ERR_INVALID_STATE (a parameter got no
 *         gradient, see above).
 */
WEFT_API weft_status_t weft_ddp_backward(weft_ddp_t *ddp, weft_tensor_t *loss, weft_tensor_t *grad);

/** A backward for weft_ddp_backward_with: returns its status (weft_last_error() its text). */
typedef weft_status_t (*weft_ddp_backward_fn_t)(void *arg);
/**
 * weft_ddp_backward with the backward run by @p run(@p arg) instead of the local engine's: any
 * backward that accumulates into the parameters' gradients and runs their hooks, as a
 * distributed backward does with accumulate_grad (torch's DDP under distributed autograd):
 *
 *     static weft_status_t dist_bw(void *arg) {
 *         step_t *s = arg;
 *         weft_dist_backward_opts_t o;
 *         weft_dist_backward_opts_init(&o);
 *         o.accumulate_grad = true;
 *         return weft_dist_backward(s->agent, s->ctx, 1, &s->loss, &o);
 *     }
 *     weft_ddp_backward_with(ddp, dist_bw, &step);   // the parameters' .grad: averaged
 *
 * The context keeps each worker's own gradients; weft_dist_context_set_gradient puts the averaged
 * ones there for a DistributedOptimizer. Collective over the group, as weft_ddp_backward.
 */
WEFT_API weft_status_t weft_ddp_backward_with(weft_ddp_t *ddp, weft_ddp_backward_fn_t run,
                                              void *arg);

/**
 * false: later backwards only accumulate locally (torch's no_sync, for gradient accumulation);
 * true again: the next weft_ddp_backward averages everything accumulated since.
 */
WEFT_API void weft_ddp_set_sync(weft_ddp_t *ddp, bool sync);

/** What the last synchronised step did. */
typedef struct {
    uint64_t steps;         /**< synchronised steps so far */
    int buckets;            /**< buckets now */
    uint64_t bytes;         /**< bytes one member's reductions carried in the last step */
    double comm_us;         /**< from the first reduction's start to the last one's end */
    double exposed_us;      /**< of which after backward ended (waited for) */
    double hidden_fraction; /**< 1 - exposed / comm: the share hidden behind backward */
    bool rebuilt;           /**< the buckets were rebuilt from the observed order */
} weft_ddp_stats_t;

/** Fills @p s. */
WEFT_API void weft_ddp_stats(const weft_ddp_t *ddp, weft_ddp_stats_t *s);

/**
 * Writes the bucket plan (one line per bucket: index, dtype, bytes, parameters in order) into
 * @p buf (NUL-terminated, truncated to @p n); returns the length it needed.
 */
WEFT_API size_t weft_ddp_describe(const weft_ddp_t *ddp, char *buf, size_t n);

#ifdef __cplusplus
}
#endif
#endif
