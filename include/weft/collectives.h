/* Process groups and collective operations over the RPC agent's connections. */
#ifndef WEFT_COLLECTIVES_H
#define WEFT_COLLECTIVES_H

#include <weft/api.h>

/* Layering (docs/architecture.md): only collectives and the modules above it may include this. */
#if defined(WEFT_BUILDING) && !defined(WEFT_SEES_COLLECTIVES)
#error "weft/collectives.h is above the module being built: dependencies point downward only"
#endif

#include <stddef.h>
#include <stdint.h>

#include <weft/future.h>
#include <weft/reduce.h>
#include <weft/rpc.h>
#include <weft/tensor.h>

#ifdef __cplusplus
extern "C" {
#endif

/** A process group: a set of ranks of the world with ranks of its own (0..size-1). */
typedef struct weft_pg weft_pg_t;

#define WEFT_ANY_SOURCE (-1)

/**
 * The group of the whole world of @p a (group rank = world rank). Each call
 * returns a new handle to the same group (id 0). Caller frees with weft_pg_free,
 * before the agent. Thread-safe.
 */
WEFT_API weft_status_t weft_pg_world(weft_agent_t *a, weft_pg_t **pg_p);

/**
 * Creates a sub-group of the world from @p n distinct world @p ranks, like
 * torch's new_group: every rank of the world calls it, in the same order with
 * the same list (groups are numbered by order of creation). A rank not in the
 * list gets a non-member handle (weft_pg_rank() == -1) on which every
 * operation fails with WEFT_ERR_INVALID_STATE. Group rank i is @p ranks[i]. The group reads
 * its configuration now (WEFT_COLL_TIMEOUT_MS, WEFT_COLL_ALGO, WEFT_COLL_CMA: see
 * weft_pg_set_timeout and weft_pg_set_algorithm). Caller frees with weft_pg_free, before the
 * agent. Thread-safe, but the ranks number groups by the order of these calls: make them in
 * one order on every rank (from one thread, say).
 * @param[in] ranks borrowed for the call (copied).
 * @return WEFT_ERR_INVALID_ARG for a bad or repeated rank, WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_pg_new(weft_agent_t *a, const int *ranks, int n, weft_pg_t **pg_p);

/** This rank's rank in the group, -1 if not a member. Thread-safe. */
WEFT_API int weft_pg_rank(const weft_pg_t *pg);
/** Number of ranks in the group. Thread-safe. */
WEFT_API int weft_pg_size(const weft_pg_t *pg);
/** World rank of group rank @p r (-1 if out of range). Thread-safe. */
WEFT_API int weft_pg_world_rank(const weft_pg_t *pg, int r);
/**
 * Timeout of each operation of the group, counted from the call that issues it, as torch's:
 * time queued behind the group's earlier operations counts. Applies to operations (and
 * receives) issued after it. @p timeout_ms 0 sets the group's default again: WEFT_COLL_TIMEOUT_MS
 * as read when the group was created (60000 when unset), which is also its timeout until this is
 * called; a negative one is ignored. Every handle to the world shares its timeout. Thread-safe.
 */
WEFT_API void weft_pg_set_timeout(weft_pg_t *pg, int64_t timeout_ms);

/** The collective operations (values as `CollOp` on the wire, docs/protocol.md §6.8). */
typedef enum {
    WEFT_COLL_BARRIER = 1,
    WEFT_COLL_BROADCAST = 2,
    WEFT_COLL_ALL_REDUCE = 3,
    WEFT_COLL_REDUCE = 4,
    WEFT_COLL_GATHER = 5,
    WEFT_COLL_SCATTER = 6,
    WEFT_COLL_ALL_GATHER = 7,
    WEFT_COLL_REDUCE_SCATTER = 8,
    WEFT_COLL_ALL_TO_ALL = 9,
} weft_coll_op_t;

/**
 * Forces the algorithm of @p op in the group, for the operations issued after it returns.
 * A group chooses by size unless told otherwise: all_reduce runs "direct" up to 64 KiB and
 * "ring" above (with two members: "ring" from 1 MiB); between ranks of one host, "oneshot"
 * (one round of cross-memory reads, no message once the group settled) up to 64 KiB and
 * "cma" (cross-memory reads) from 256 KiB (two members: from 2 MiB); broadcast, all_gather,
 * reduce_scatter and all_to_all run "cma" from 64 KiB per member (the tensor of broadcast, the
 * input of all_gather and all_to_all, the output part of reduce_scatter), else "tree"
 * (broadcast) or "direct"; barrier, reduce, gather and scatter have one algorithm each
 * ("direct"). WEFT_COLL_ALGO (auto|direct|ring|cma|oneshot), read when the group is created, forces
 * all_reduce's for that group. weft_pg_describe prints the choice.
 *
 * Every member must force the same algorithm at the same point of the group's sequence of
 * operations: the algorithms do not interoperate, and their pieces do not say which one sent
 * them, so members that differ fail the operation (WEFT_ERR_PROTOCOL for a piece of the wrong
 * size, or WEFT_ERR_TIMEOUT at its deadline). A forced "cma" or "oneshot" that the members cannot
 * use (another host, reads not permitted, WEFT_COLL_CMA=0 on a member) falls back, on every member,
 * to the choice by size among the others. Every handle to the world shares its choice.
 * @param[in] name the algorithm; "auto": choose by size; NULL: back to the choice the group
 *            had when it was created (WEFT_COLL_ALGO). Borrowed for the call.
 * Thread-safe.
 * @return WEFT_ERR_INVALID_ARG (NULL group, an op outside weft_coll_op_t), WEFT_ERR_NOT_FOUND
 *         (@p op has no algorithm of that name; the text lists those it has).
 */
WEFT_API weft_status_t weft_pg_set_algorithm(weft_pg_t *pg, weft_coll_op_t op, const char *name);

/**
 * Writes a description of the group into @p buf (at most @p n bytes, NUL-terminated when
 * @p n > 0, as snprintf does): its id, this rank's rank and size, its timeout and default,
 * whether cross-memory reads are allowed here, then one line per operation with how its
 * algorithm is chosen, e.g. "all_reduce: by size: cma from 256 KiB (unless ...), else ring
 * above 64 KiB, else direct" or "all_reduce: ring (weft_pg_set_algorithm)".
 * @param[out] buf may be NULL when @p n is 0.
 * Thread-safe.
 * @return the length of the whole text (without the NUL): a result >= @p n means it was cut.
 */
WEFT_API size_t weft_pg_describe(const weft_pg_t *pg, char *buf, size_t n);
/**
 * Waits for the group's operations to end (each by its deadline, and once the transport has let
 * go of its buffers), fails its posted receives, then frees it. Not from a callback of the
 * group's futures (it would wait for itself). NULL: no-op. Not thread-safe with other calls on
 * the same handle (other handles to the world may be used meanwhile).
 */
WEFT_API void weft_pg_free(weft_pg_t *pg);

/*
 * Operations. Each one is asynchronous when @p work_p is not NULL: it returns at
 * once and *work_p gets a future that completes when the operation is done on
 * this rank (wait with weft_future_wait; caller releases it). With @p work_p
 * NULL the call blocks and returns the operation's status (text in
 * weft_last_error()). Operations of one group run in the order they were
 * issued; groups run concurrently.
 *
 * Tensors are borrowed: they must stay valid, and unchanged by the caller,
 * until the work completes (the blocking call returns). Sent pieces are not
 * copied: the transport reads them from the tensors, and an operation completes,
 * whatever its status, only once the transport has let go of every buffer of it,
 * so the caller may free or reuse its tensors as soon as it has completed. A
 * piece still held at the deadline (a stalled peer) keeps the operation pending
 * until it is written or its connection fails; it then fails with
 * WEFT_ERR_TIMEOUT.
 *
 * Deadline: the group's timeout (weft_pg_set_timeout) from the call, time spent
 * queued behind earlier operations of the group included. An operation still
 * queued at its deadline fails without running, and the other members fail it
 * too.
 *
 * Callbacks: the futures of a group's operations complete on its worker thread,
 * which runs their callbacks (weft_future_then). A callback may issue operations
 * on the group, blocking ones included: the worker runs a blocking one there,
 * after the operations issued before it, and the call returns its status. It
 * must not wait on another future of the group, nor free the group. The futures of
 * point-to-point operations complete on the agent's threads (a transport thread when the data
 * arrives, is sent or its peer is lost; the agent's timer thread at a receive's deadline) or
 * on the calling thread (a message that was already there): their callbacks must not block.
 *
 * Threads: every operation is thread-safe. Operations of a group issued from several threads
 * at once are ordered by their calls, and every member must issue the group's operations in
 * the same order: issue them from one thread, or order the threads yourself.
 *
 * Statuses of a failed operation: WEFT_ERR_MISMATCH when ranks called
 * different operations (op, count, dtype, root, reduce op, or all_to_all split
 * sizes; the text names the ranks and values) — every member gets it;
 * WEFT_ERR_PEER_LOST when a member died; WEFT_ERR_TIMEOUT at the deadline;
 * WEFT_ERR_DTYPE for a reduce op that does not apply to the dtype; WEFT_ERR_UNSUPPORTED for a
 * reduction of tensors on a device without reduce ops (weft_reduce_ops_for), or tensors of a
 * device other than the CPU in an operation that does not reduce. A member whose call is
 * refused (bad argument) fails it with its status, and so do the others.
 */

/**
 * Sends @p t to group rank @p dst with @p tag (>= 0). @p t is borrowed until the work completes:
 * when the transport no longer reads it (no copy is made). Blocking: returns then, with
 * WEFT_ERR_TIMEOUT if that was past the group's timeout. Thread-safe.
 */
WEFT_API weft_status_t weft_coll_send(weft_pg_t *pg, const weft_tensor_t *t, int dst, int tag,
                                      weft_future_t **work_p);
/**
 * Receives into @p t (same dtype and element count as sent) from group rank
 * @p src or WEFT_ANY_SOURCE, with @p tag. The future's value carries the
 * source's group rank as a 4-byte payload; with @p work_p NULL it goes to
 * @p src_p (may be NULL). @p t is borrowed until the work completes. With no
 * matching send by the group's timeout from this call, the receive fails with
 * WEFT_ERR_TIMEOUT (asynchronous ones too) and @p t is left unwritten. Thread-safe.
 */
WEFT_API weft_status_t weft_coll_recv(weft_pg_t *pg, weft_tensor_t *t, int src, int tag,
                                      weft_future_t **work_p, int *src_p);

/** One operation of a batch of point-to-point operations. */
typedef struct {
    int send;         /**< 1: send t to peer; 0: receive t from peer (or WEFT_ANY_SOURCE) */
    weft_tensor_t *t; /**< borrowed until its future completes */
    int peer;         /**< group rank */
    int tag;
} weft_p2p_op_t;

/**
 * Starts @p n point-to-point operations at once (torch's batch_isend_irecv):
 * @p works[i] gets the future of @p ops[i]. All are checked before any starts; on
 * an error none was started. Thread-safe.
 */
WEFT_API weft_status_t weft_coll_batch_p2p(weft_pg_t *pg, const weft_p2p_op_t *ops, size_t n,
                                           weft_future_t **works);

/** Every member waits until all members have called it. Thread-safe. */
WEFT_API weft_status_t weft_coll_barrier(weft_pg_t *pg, weft_future_t **work_p);

/**
 * Takes the group's next operation on this member as failed with @p status (< 0) and @p why:
 * the other members fail their same operation with it at once. For a caller that cannot issue
 * its part of an operation the others will (a DDP comm hook that failed, no memory for a
 * bucket): the group's operations stay paired by number. Returns @p status, with @p why as the
 * error text. Thread-safe.
 */
WEFT_API weft_status_t weft_coll_fail(weft_pg_t *pg, weft_status_t status, const char *why);

/** Copies @p t of group rank @p root into @p t on every member. Thread-safe. */
WEFT_API weft_status_t weft_coll_broadcast(weft_pg_t *pg, weft_tensor_t *t, int root,
                                           weft_future_t **work_p);

/**
 * Reduces @p t element-wise over the members with @p op; every member ends with
 * the same result, bit for bit, in @p t (in place). f16 and bf16 accumulate
 * in f32 and round once at the end (AVG: the exact quotient of the f32 sum,
 * rounded once). Algorithm by size (see weft_pg_set_algorithm): direct exchange for small
 * tensors, ring reduce-scatter + all-gather for large ones, and cross-memory reads between
 * ranks of one host for large ones when they can. Thread-safe.
 */
WEFT_API weft_status_t weft_coll_all_reduce(weft_pg_t *pg, weft_tensor_t *t, weft_reduce_op_t op,
                                            weft_future_t **work_p);

/**
 * Reduces @p t over the members with @p op into @p t on @p root (in place);
 * other members' @p t is left unchanged. Thread-safe.
 */
WEFT_API weft_status_t weft_coll_reduce(weft_pg_t *pg, weft_tensor_t *t, int root,
                                        weft_reduce_op_t op, weft_future_t **work_p);

/**
 * Gathers @p in of every member into @p out on @p root, member r's at element
 * offset r * numel(in). @p out: size * numel(in) elements of in's dtype on the
 * root; ignored (may be NULL) elsewhere. Thread-safe.
 */
WEFT_API weft_status_t weft_coll_gather(weft_pg_t *pg, const weft_tensor_t *in, weft_tensor_t *out,
                                        int root, weft_future_t **work_p);

/**
 * Splits @p in (size * numel(out) elements, on @p root only; may be NULL
 * elsewhere) and sends part r to member r's @p out. Thread-safe.
 */
WEFT_API weft_status_t weft_coll_scatter(weft_pg_t *pg, const weft_tensor_t *in, weft_tensor_t *out,
                                         int root, weft_future_t **work_p);

/**
 * Every member gets every member's @p in in @p out (flat: size * numel(in) elements).
 * Thread-safe.
 */
WEFT_API weft_status_t weft_coll_all_gather(weft_pg_t *pg, const weft_tensor_t *in,
                                            weft_tensor_t *out, weft_future_t **work_p);
/**
 * As weft_coll_all_gather into a list: @p outs[r] (numel(in) elements each) gets member r's.
 * Thread-safe.
 */
WEFT_API weft_status_t weft_coll_all_gather_list(weft_pg_t *pg, const weft_tensor_t *in,
                                                 weft_tensor_t *const *outs,
                                                 weft_future_t **work_p);

/**
 * Reduces @p in (size * numel(out) elements) over the members with @p op and
 * gives member r the reduced part r in @p out. Thread-safe.
 */
WEFT_API weft_status_t weft_coll_reduce_scatter(weft_pg_t *pg, const weft_tensor_t *in,
                                                weft_tensor_t *out, weft_reduce_op_t op,
                                                weft_future_t **work_p);

/**
 * Member r sends the r-th part of @p in to member r and receives its parts in
 * @p out, in member order. Parts are equal (numel / size) when @p in_splits and
 * @p out_splits are NULL, else in_splits[r] elements go to r and out_splits[r]
 * come from r (arrays of size() entries, copied). Every member checks every
 * pair: when s sends r another size than r expects from s, every member fails
 * with WEFT_ERR_MISMATCH naming s, r and both sizes. Thread-safe.
 */
WEFT_API weft_status_t weft_coll_all_to_all(weft_pg_t *pg, const weft_tensor_t *in,
                                            weft_tensor_t *out, const int64_t *in_splits,
                                            const int64_t *out_splits, weft_future_t **work_p);

/*
 * Device collectives. An all_reduce or broadcast of a tensor on a device other than the CPU goes
 * to the entry registered for its device type: the CUDA build's weft_cuda_init registers one
 * (include/weft/cuda.h), which stages the tensor through pinned host memory in chunks with the
 * staged operations below, or exchanges device memory directly between ranks of one host.
 * Without an entry such tensors behave as described above (reductions use their device's reduce
 * ops; other operations fail with WEFT_ERR_UNSUPPORTED).
 */

/** A device type's collectives. Each has the contract of the CPU function of its name. */
typedef struct {
    /** Names the entry in errors and logs ("cuda"). */
    const char *name;
    weft_status_t (*all_reduce)(weft_pg_t *pg, weft_tensor_t *t, weft_reduce_op_t op,
                                weft_future_t **work_p);
    weft_status_t (*broadcast)(weft_pg_t *pg, weft_tensor_t *t, int root, weft_future_t **work_p);
    /** Optional (may be NULL): @p pg is being freed (weft_pg_free, once no operation of it runs
     * any more, before anything of it goes): drop what the entry keeps for that handle. */
    void (*group_freed)(weft_pg_t *pg);
} weft_coll_device_ops_t;

/**
 * Registers @p ops for tensors on devices of @p type, replacing the previous entry; NULL removes
 * it. Register before issuing operations on such tensors. Thread-safe.
 * @param[in] ops borrowed: must stay valid until replaced or removed (usually a static const).
 * @return WEFT_ERR_INVALID_ARG (a type outside weft_device_type_t, WEFT_DEVICE_CPU, an entry
 *         without a name or a function).
 */
WEFT_API weft_status_t weft_coll_device_register(weft_device_type_t type,
                                                 const weft_coll_device_ops_t *ops);

/**
 * Runs before a staged operation reads or writes its tensor, on the thread that runs it (the
 * group's worker, or the caller of a blocking call), after the group's earlier operations: it
 * may wait there for the tensor's contents (a device-to-host copy). A status other than WEFT_OK
 * (text in weft_last_error()) fails the operation on this member, and the other members fail it
 * too. Not called for an operation that fails before it starts (its deadline passed in the
 * queue).
 */
typedef weft_status_t (*weft_coll_ready_fn_t)(void *arg);

/**
 * weft_coll_all_reduce of a CPU tensor whose contents are ready only when @p ready returns
 * (NULL: at once). A device entry issues one per chunk of a device tensor, all at the call, so
 * that the group's order is the order of the calls while the chunks' copies are still running.
 * Thread-safe.
 */
WEFT_API weft_status_t weft_coll_all_reduce_staged(weft_pg_t *pg, weft_tensor_t *t,
                                                   weft_reduce_op_t op, weft_coll_ready_fn_t ready,
                                                   void *ready_arg, weft_future_t **work_p);
/** weft_coll_broadcast with a @p ready hook, as weft_coll_all_reduce_staged. Thread-safe. */
WEFT_API weft_status_t weft_coll_broadcast_staged(weft_pg_t *pg, weft_tensor_t *t, int root,
                                                  weft_coll_ready_fn_t ready, void *ready_arg,
                                                  weft_future_t **work_p);

#ifdef __cplusplus
}
#endif
#endif
