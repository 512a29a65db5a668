/*
 * Remote references (RRefs) with the reference-counting protocol of torch.distributed.rpc.
 *
 * weft_rref_remote() runs a registered function (or constructs an object of a registered type) on
 * another worker, the owner, and returns at once a reference to the result. The reference can be
 * fetched (to_here), passed to other workers inside the arguments and results of calls
 * (weft_value_add_rref: a fork), and used as the target of method calls on the owner's object.
 * The owner frees the value exactly when the last reference anywhere is released, even when
 * control messages arrive out of order and when workers die. docs/rref.md documents the
 * protocol (owner and user references, forks, confirmations, deletion, failures).
 *
 * Timeouts: a timeout_ms of 0 means the agent's default call timeout (weft_agent_call_timeout_ms);
 * a negative one is refused with WEFT_ERR_INVALID_ARG.
 *
 * Handles: a weft_rref_t is a local handle, refcounted (weft_rref_retain/release). Releasing the
 * last local handle of a user reference tells the owner (once the reference is confirmed).
 * Thread-safety: every function is thread-safe. Functions that wait take a timeout; none waits
 * forever.
 */
#ifndef WEFT_RREF_H
#define WEFT_RREF_H

#include <weft/api.h>

/* Layering (docs/architecture.md): only rref and the modules above it may include this. */
#if defined(WEFT_BUILDING) && !defined(WEFT_SEES_RREF)
#error "weft/rref.h is above the module being built: dependencies point downward only"
#endif

#include <stdint.h>

#include <weft/future.h>
#include <weft/rpc.h>
#include <weft/value.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Ids cross the wire: the worker that created the id and a counter local to it. */
typedef struct {
    int32_t worker;
    uint64_t local;
} weft_rref_id_t;

typedef struct weft_rref weft_rref_t;

/* ---- setup ------------------------------------------------------------------------------------
 */

/**
 * Sets up the rref module on @p a: its control channel, its codec for references inside values,
 * the functions owners serve (weft.rref.remote, weft.rref.fetch, weft.rref.method), and its
 * peer-lost and shutdown listeners. Every worker that may own, receive or use references calls it
 * after weft_agent_create and before weft_agent_join (weft_rref_register_type calls it too);
 * later calls do nothing. Control messages are retried until acknowledged, up to the agent's
 * default call timeout. Reads WEFT_RREF_EAGER_BYTES, WEFT_RREF_FAULT_DELAY_US and
 * WEFT_RREF_FAULT_DUP (the last two for tests only: see docs/rref.md). Thread-safe.
 * @return WEFT_ERR_ALREADY_EXISTS if one of those names or the channel is taken,
 *         WEFT_ERR_INVALID_STATE without a rank and world size, WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_rref_init(weft_agent_t *a);

/* ---- user object types ------------------------------------------------------------------------
 */

/** Constructs an object from @p args; *obj_p gets it. Runs on the owner. */
typedef weft_status_t (*weft_rref_ctor_cb_t)(const weft_value_t *args, void *type_arg,
                                             void **obj_p);
/** Destroys an object when the owner frees it. */
typedef void (*weft_rref_dtor_cb_t)(void *obj, void *type_arg);
/**
 * A method: runs on the owner with the object and the call's arguments; answers with
 * weft_call_reply / weft_call_fail (now or later, like an RPC handler; @p call carries the
 * arguments). Calls of methods on one object are not serialised by weft: guard the object.
 */
typedef void (*weft_rref_method_cb_t)(void *obj, weft_call_t *call, void *type_arg);

typedef struct {
    const char *name;
    weft_rref_method_cb_t fn;
} weft_rref_method_t;

/**
 * Registers a type of objects RRefs can own (an observer, a parameter holder): its constructor,
 * destructor and methods by name. Every worker that may own such objects registers it (before
 * weft_agent_join, like functions). Strings are copied.
 * @return WEFT_ERR_ALREADY_EXISTS, WEFT_ERR_INVALID_ARG.
 */
WEFT_API weft_status_t weft_rref_register_type(weft_agent_t *a, const char *type,
                                               weft_rref_ctor_cb_t ctor, weft_rref_dtor_cb_t dtor,
                                               const weft_rref_method_t *methods, int n_methods,
                                               void *type_arg);

/* ---- creation ---------------------------------------------------------------------------------
 */

/**
 * Runs the registered function @p fn with @p args (borrowed until return) on rank @p to, which
 * owns the result; returns at once. A failure (the function's error, a timeout after
 * @p timeout_ms, a lost owner) is reported by the first use of the reference (to_here, a method
 * call, local_value) with its status and text. @p to may be the caller's own rank. A value of at
 * most WEFT_RREF_EAGER_BYTES (default 65536; 0: never) comes back with the creation's answer,
 * so that a to_here issued before that answer needs no message of its own (docs/rref.md §4).
 * @param[out] rref_p a handle; caller releases with weft_rref_release.
 */
WEFT_API weft_status_t weft_rref_remote(weft_agent_t *a, int to, const char *fn,
                                        const weft_value_t *args, int64_t timeout_ms,
                                        weft_rref_t **rref_p);
/** As weft_rref_remote, constructing an object of the registered @p type on @p to. */
WEFT_API weft_status_t weft_rref_remote_object(weft_agent_t *a, int to, const char *type,
                                               const weft_value_t *args, int64_t timeout_ms,
                                               weft_rref_t **rref_p);
/** A reference owned by this worker to @p value (takes ownership on success), like torch's RRef(v).
 */
WEFT_API weft_status_t weft_rref_create(weft_agent_t *a, weft_value_t *value, weft_rref_t **rref_p);

/* ---- use --------------------------------------------------------------------------------------
 */

/**
 * A copy of the value (tensors shared with the owner's copy when the owner is this worker),
 * waiting up to @p timeout_ms. For an object reference: WEFT_ERR_UNSUPPORTED (call a method).
 * @param[out] value_p caller frees with weft_value_free.
 * @return the creation's failure, WEFT_ERR_OWNER_LOST, WEFT_ERR_TIMEOUT.
 */
WEFT_API weft_status_t weft_rref_to_here(weft_rref_t *r, int64_t timeout_ms,
                                         weft_value_t **value_p);
/** As weft_rref_to_here, asynchronously: the future's value is the copy. */
WEFT_API weft_status_t weft_rref_to_here_async(weft_rref_t *r, int64_t timeout_ms,
                                               weft_future_t **f_p);
/**
 * The owner's value, borrowed while @p r lives (owner only: WEFT_ERR_INVALID_STATE elsewhere);
 * waits up to @p timeout_ms for the creating function to finish.
 */
WEFT_API weft_status_t weft_rref_local_value(weft_rref_t *r, int64_t timeout_ms,
                                             const weft_value_t **value_p);
/** The owner's object of an object reference, borrowed as weft_rref_local_value. */
WEFT_API weft_status_t weft_rref_local_object(weft_rref_t *r, int64_t timeout_ms, void **obj_p);

/** Calls @p method of the owner's object with @p args (torch's rref.rpc_sync().method()). */
WEFT_API weft_status_t weft_rref_rpc_sync(weft_rref_t *r, const char *method,
                                          const weft_value_t *args, int64_t timeout_ms,
                                          weft_value_t **result_p);
WEFT_API weft_status_t weft_rref_rpc_async(weft_rref_t *r, const char *method,
                                           const weft_value_t *args, int64_t timeout_ms,
                                           weft_future_t **f_p);
/** Calls @p method on the owner and keeps its result there, as a new reference owned by it. */
WEFT_API weft_status_t weft_rref_remote_method(weft_rref_t *r, const char *method,
                                               const weft_value_t *args, int64_t timeout_ms,
                                               weft_rref_t **result_p);

/* ---- identity ---------------------------------------------------------------------------------
 */

WEFT_API weft_rref_id_t weft_rref_id(const weft_rref_t *r);
WEFT_API int weft_rref_owner(const weft_rref_t *r);
/** The owner's worker name; borrowed from the agent. */
WEFT_API const char *weft_rref_owner_name(const weft_rref_t *r);
WEFT_API int weft_rref_is_owner(const weft_rref_t *r);
/** True once the owner knows of this reference (always for the owner's own). */
WEFT_API int weft_rref_confirmed_by_owner(const weft_rref_t *r);

WEFT_API weft_rref_t *weft_rref_retain(weft_rref_t *r);
/** Drops a local handle; the last one of a user reference tells the owner. NULL is a no-op. */
WEFT_API void weft_rref_release(weft_rref_t *r);

/* ---- inside values (forks) ----------------------------------------------------------------------
 */

/** Appends @p r to @p v (retained): sending @p v forks the reference to the receiver. */
WEFT_API weft_status_t weft_value_add_rref(weft_value_t *v, weft_rref_t *r);
/** The @p i-th reference of @p v that is an RRef, borrowed (retain to keep it); NULL if none. */
WEFT_API weft_rref_t *weft_value_rref(const weft_value_t *v, size_t i);

/* ---- introspection ----------------------------------------------------------------------------
 */

/**
 * Counts as JSON: {"owners":N,"users":N,"pending_users":N,"pending_children":N,"forks":N,
 * "confirmed_users":N,"deleted_owners":N,"leaks":N,"control_in_flight":N,"fetches_served":N,
 * "values_sent_with_creation":N} (torch's _get_debug_info, plus weft's; docs/rref.md §7).
 * @param[out] json_p caller frees with weft_free.
 */
WEFT_API weft_status_t weft_rref_debug_info(weft_agent_t *a, char **json_p);

#ifdef __cplusplus
}
#endif
#endif
