/* The RPC agent: rendezvous of a world of named ranks, remote calls by name,
 * module channels for upper layers, failure detection, collective shutdown. */
#ifndef WEFT_RPC_H
#define WEFT_RPC_H

#include <weft/api.h>

/* Layering (docs/architecture.md): only rpc and the modules above it may include this. */
#if defined(WEFT_BUILDING) && !defined(WEFT_SEES_RPC)
#error "weft/rpc.h is above the module being built: dependencies point downward only"
#endif

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <weft/future.h>
#include <weft/value.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Wire protocol version carried in every Hello. */
#define WEFT_PROTOCOL_VERSION 1

typedef struct weft_agent weft_agent_t;
typedef struct weft_call weft_call_t;

typedef struct {
    const char *name; /**< worker name; NULL: WEFT_NAME or "worker<rank>" */
    int rank;         /**< -1: from WEFT_RANK / RANK / SLURM_PROCID / OMPI_COMM_WORLD_RANK */
    int world_size; /**< -1: from WEFT_WORLD_SIZE / WORLD_SIZE / SLURM_NTASKS / OMPI_COMM_WORLD_SIZE
                     */
    const char *master_addr; /**< NULL: WEFT_MASTER_ADDR / MASTER_ADDR, else "127.0.0.1" */
    int master_port; /**< -1: WEFT_MASTER_PORT / MASTER_PORT (rank 0 may use 0: any free port) */
    const char *listen_host; /**< host other ranks reach this one at; NULL: WEFT_LISTEN_HOST, else
                                master_addr when it is loopback, else this host's name */
    const char
        *auth_token; /**< shared secret checked in every Hello; NULL: WEFT_AUTH_TOKEN or none */
    int64_t rendezvous_timeout_ms; /**< 0: WEFT_RENDEZVOUS_TIMEOUT_MS or 60000 */
    int64_t default_timeout_ms; /**< per-call deadline when a call gives 0; 0: WEFT_RPC_TIMEOUT_MS
                                   or 60000 */
    int64_t peer_timeout_ms;    /**< failure detection bound; 0: WEFT_PEER_TIMEOUT_MS or 2000 */
    int handler_threads; /**< threads serving the transport and handlers; 0: WEFT_HANDLER_THREADS or
                            1 (one more is started whenever one blocks in a weft wait) */
    int64_t max_message_bytes; /**< largest message this rank accepts; 0: WEFT_MAX_MESSAGE_BYTES or
                                  4 GiB - 1 (a gRPC message's limit) */
} weft_agent_opts_t;

/** Fills @p opts with "take from the environment / default" markers. */
WEFT_API void weft_agent_opts_init(weft_agent_opts_t *opts);

/**
 * Starts the transport of one rank: binds its server (rank 0 binds the master
 * port) and its threads. No peer is contacted yet. Caller frees with
 * weft_agent_free (after weft_agent_shutdown for a graceful end).
 * @return WEFT_ERR_INVALID_ARG (rank/world/name missing or out of range),
 *         WEFT_ERR_TRANSPORT (the port could not be bound).
 */
WEFT_API weft_status_t weft_agent_create(const weft_agent_opts_t *opts, weft_agent_t **agent_p);

/** The port this rank's server listens on (rank 0: the master port). */
WEFT_API int weft_agent_port(const weft_agent_t *a);

/**
 * Rendezvous: rank 0 gathers a Hello from every rank and hands out the world
 * map (name <-> rank <-> address); the others send theirs to the master. Blocks
 * until all have arrived or the rendezvous timeout; then every rank's join
 * fails with WEFT_ERR_RENDEZVOUS and a text naming the ranks that never came.
 * Also WEFT_ERR_VERSION, WEFT_ERR_AUTH, WEFT_ERR_ALREADY_EXISTS (duplicate
 * rank or name), WEFT_ERR_MISMATCH (another world size), WEFT_ERR_INVALID_ARG
 * (rank out of range).
 */
WEFT_API weft_status_t weft_agent_join(weft_agent_t *a);

/** weft_agent_create then weft_agent_join; on failure nothing is left behind. */
WEFT_API weft_status_t weft_agent_init(const weft_agent_opts_t *opts, weft_agent_t **agent_p);

WEFT_API int weft_agent_rank(const weft_agent_t *a);
WEFT_API int weft_agent_world_size(const weft_agent_t *a);
/** Borrowed name of this worker. */
WEFT_API const char *weft_agent_name(const weft_agent_t *a);
/** Borrowed name of @p rank (after join), NULL if out of range. */
WEFT_API const char *weft_agent_worker_name(const weft_agent_t *a, int rank);
/** Rank of the worker named @p name. WEFT_ERR_NOT_FOUND if none. */
WEFT_API weft_status_t weft_agent_worker_rank(const weft_agent_t *a, const char *name, int *rank_p);
/** The largest message @p rank accepts (this one's from its options, a peer's after join); 0 if
 * out of range. */
WEFT_API uint64_t weft_agent_max_message_bytes(const weft_agent_t *a, int rank);
/** Borrowed "host:port" of @p rank (after join). */
WEFT_API const char *weft_agent_worker_address(const weft_agent_t *a, int rank);
/**
 * Borrowed "host:port" of @p rank's direct listener (after join): frames of
 * 1 MiB or more travel there over plain TCP, "" when the rank has none
 * (WEFT_DIRECT=0), in which case they take the gRPC stream.
 */
WEFT_API const char *weft_agent_worker_direct_address(const weft_agent_t *a, int rank);

/**
 * Graceful, collective shutdown: every rank calls it. Waits until no call is
 * in flight anywhere in the world (the ranks agree on it through rank 0), then
 * closes connections. New calls fail with WEFT_ERR_SHUTDOWN meanwhile.
 * @return WEFT_ERR_TIMEOUT if the world did not settle within @p timeout_ms
 * (<= 0: the default call timeout); the agent is closed either way.
 */
WEFT_API weft_status_t weft_agent_shutdown(weft_agent_t *a, int64_t timeout_ms);
/** Frees the agent; closes it abruptly if weft_agent_shutdown was not called. */
WEFT_API void weft_agent_free(weft_agent_t *a);

/* ------------------------------------------------------------------ calls */

/**
 * A registered function. It runs on a transport thread with the call's
 * arguments (when objects of the arguments' references were not ready, on the
 * thread that completed the last of their futures) and must finish the call exactly once, now or
 * later from any thread, with weft_call_reply, weft_call_fail or weft_call_reply_future. To wait on
 * other calls, reply through a future (like torch's
 * @rpc.functions.async_execution) instead of blocking: then chains of nested
 * calls never exhaust the threads.
 */
typedef void (*weft_rpc_handler_cb_t)(weft_call_t *call, void *arg);

/**
 * Registers @p fn under @p name (copied; at most 255 bytes). Names starting
 * with "__weft." are reserved for weft's modules. Thread-safe.
 * @return WEFT_ERR_ALREADY_EXISTS if the name is taken.
 */
WEFT_API weft_status_t weft_rpc_register(weft_agent_t *a, const char *name, weft_rpc_handler_cb_t fn,
                                void *arg);

/** Arguments of the call; borrowed, valid until the call is finished. */
WEFT_API const weft_value_t *weft_call_args(const weft_call_t *call);
/** Moves the arguments out (they become empty). Caller frees with weft_value_free. */
WEFT_API weft_value_t *weft_call_take_args(weft_call_t *call);
/** Replaces the call's arguments with @p args (takes ownership; NULL leaves none). */
WEFT_API void weft_call_set_args(weft_call_t *call, weft_value_t *args);
WEFT_API int weft_call_caller_rank(const weft_call_t *call);
WEFT_API const char *weft_call_function(const weft_call_t *call);
WEFT_API weft_agent_t *weft_call_agent(const weft_call_t *call);
/** Milliseconds left before the caller's deadline (<= 0: already passed). */
WEFT_API int64_t weft_call_time_left_ms(const weft_call_t *call);

/** Finishes the call successfully; takes ownership of @p result (may be NULL). Frees @p call. */
WEFT_API void weft_call_reply(weft_call_t *call, weft_value_t *result);
/** Finishes the call with an error status and text. Frees @p call. */
WEFT_API void weft_call_fail(weft_call_t *call, weft_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/**
 * Finishes the call when @p f completes, with its status, text and value.
 * Takes over the caller's reference to @p f. Frees @p call (later).
 */
WEFT_API void weft_call_reply_future(weft_call_t *call, weft_future_t *f);

/**
 * Calls @p fn on @p to_rank (may be this rank) with @p args. @p args is
 * borrowed: the call takes its own tensor references (their bytes are sent
 * without copying, so do not modify them until the future completes) and
 * copies the payload. @p timeout_ms: 0 = the agent's default.
 * The future completes with the result value, the remote handler's status and
 * text, WEFT_ERR_NO_SUCH_FUNCTION, WEFT_ERR_TIMEOUT, WEFT_ERR_PEER_LOST,
 * WEFT_ERR_TOO_LARGE. Caller releases it with weft_future_release.
 * @return an error (and no future) for bad arguments or a closed agent.
 */
/**
 * Runs the registered function @p fn of this agent in-process, on the calling thread, with
 * @p args (takes ownership; NULL for none; the handler sees these tensors, not copies). The future
 * completes when the handler replies, with the reply value itself (no copy, no serialisation: its
 * tensors are the handler's) or its failure. No message is sent, so references in the values pass
 * as they are. @p timeout_ms is the call's deadline as weft_call_time_left_ms reports it.
 * @return WEFT_ERR_NO_SUCH_FUNCTION (@p args is then still the caller's), WEFT_ERR_INVALID_ARG,
 *         WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_rpc_call_local(weft_agent_t *a, const char *fn, weft_value_t *args,
                                  int64_t timeout_ms, weft_future_t **f_p);
WEFT_API weft_status_t weft_rpc_async(weft_agent_t *a, int to_rank, const char *fn, const weft_value_t *args,
                             int64_t timeout_ms, weft_future_t **f_p);
/** weft_rpc_async to a worker by name. */
WEFT_API weft_status_t weft_rpc_async_to(weft_agent_t *a, const char *to, const char *fn,
                                const weft_value_t *args, int64_t timeout_ms, weft_future_t **f_p);
/**
 * Blocking call; the result goes to @p result_p (caller frees with
 * weft_value_free; may be NULL to drop it). The error text is in
 * weft_last_error() on failure.
 */
WEFT_API weft_status_t weft_rpc_sync(weft_agent_t *a, int to_rank, const char *fn, const weft_value_t *args,
                            int64_t timeout_ms, weft_value_t **result_p);
WEFT_API weft_status_t weft_rpc_sync_to(weft_agent_t *a, const char *to, const char *fn,
                               const weft_value_t *args, int64_t timeout_ms,
                               weft_value_t **result_p);

/* ------------------------------------------------- module channels (extension) */

/**
 * Upper modules (rref, collectives, ps, autograd) exchange one-way messages on
 * channels of their own, over the same connections and ordered per peer.
 * Channel ids 1..63 are weft's modules' (see WEFT_CHANNEL_*); 64.. are free.
 */
enum {
    WEFT_CHANNEL_RREF = 1,
    WEFT_CHANNEL_COLLECTIVES = 2,
    WEFT_CHANNEL_PS = 3,
    WEFT_CHANNEL_AUTOGRAD = 4,
    WEFT_CHANNEL_MAX = 1023,
};

/**
 * Receives the messages of a channel; takes ownership of @p msg. Runs on a
 * transport thread: must not block.
 */
typedef void (*weft_channel_cb_t)(weft_agent_t *a, int src_rank, weft_value_t *msg, void *arg);
/** Called once for each peer lost (never for ranks left in shutdown). Must not block. */
typedef void (*weft_peer_lost_cb_t)(weft_agent_t *a, int rank, const char *why, void *arg);

/** Registers the receiver of @p channel (1..WEFT_CHANNEL_MAX). WEFT_ERR_ALREADY_EXISTS if taken. */
WEFT_API weft_status_t weft_agent_register_channel(weft_agent_t *a, uint32_t channel, weft_channel_cb_t cb,
                                          void *arg);
/**
 * Sends @p msg to @p to_rank's channel @p channel; borrowed as in
 * weft_rpc_async. Messages to one peer arrive in the order sent.
 * If @p sent_p is not NULL it gets a future that completes once the message
 * has been handed to the transport (or failed: WEFT_ERR_PEER_LOST, ...).
 */
WEFT_API weft_status_t weft_agent_send(weft_agent_t *a, int to_rank, uint32_t channel,
                              const weft_value_t *msg, weft_future_t **sent_p);

/** The message may overtake, or be overtaken by, other messages to the same peer. */
#define WEFT_SEND_UNORDERED 1u
/**
 * The calling thread may write the message itself when its connection is idle
 * (saving a hand-off to the transport's thread): the call may then block until
 * the bytes are in the socket. With WEFT_SEND_UNORDERED only.
 */
#define WEFT_SEND_INLINE 2u
/**
 * weft_agent_send with @p flags. An unordered message of 1 MiB or more may travel
 * on the direct connection to the peer (received straight into its tensors); use
 * it for messages the receiver matches by their contents, not by arrival order.
 */
WEFT_API weft_status_t weft_agent_send_flags(weft_agent_t *a, int to_rank, uint32_t channel,
                                    const weft_value_t *msg, uint32_t flags,
                                    weft_future_t **sent_p);
/**
 * Where the data of an incoming one-way message lands (see weft_channel_land_cb_t).
 * With @p sink NULL its bytes are received straight into @p dst; otherwise they are
 * received into a small buffer of the transport's and handed to @p sink piece by
 * piece (@p off: their offset in the data). @p done then runs once, with true when
 * every byte landed (the message follows, to the channel's callback, without its
 * tensor), false when the connection broke (no message follows).
 */
typedef struct {
    void *dst;
    void (*sink)(void *arg, size_t off, const void *bytes, size_t n);
    void (*done)(void *arg, bool landed);
    void *arg;
} weft_landing_t;
/**
 * Asked, on a transport thread, where the one tensor of a one-way message on a
 * direct connection should land, before its bytes are read: @p payload (borrowed,
 * @p len bytes) is the message's payload, @p dtype and @p numel the tensor's. Fills
 * @p landing_p and returns true to take the bytes, or returns false (the message
 * then arrives as usual, with a fresh tensor). Must not block; gets the channel's arg.
 */
typedef bool (*weft_channel_land_cb_t)(weft_agent_t *a, int src_rank, const void *payload,
                                       size_t len, weft_dtype_t dtype, int64_t numel,
                                       weft_landing_t *landing_p, void *arg);
/**
 * Sets the landing callback of a registered channel (once; it stays while the agent
 * lives). WEFT_ERR_INVALID_ARG for a channel without a receiver.
 */
WEFT_API weft_status_t weft_agent_set_channel_lander(weft_agent_t *a, uint32_t channel,
                                            weft_channel_land_cb_t land);
/** Adds a listener for lost peers. */
WEFT_API weft_status_t weft_agent_on_peer_lost(weft_agent_t *a, weft_peer_lost_cb_t cb, void *arg);

/*
 * Reference codecs: how the objects of a kind (weft_value_add_ref) cross the wire inside the
 * arguments and results of calls and inside one-way messages. The rref module registers the
 * codec of WEFT_REF_KIND_RREF; the agent knows nothing about what it carries.
 */
typedef struct {
    /**
     * Encodes @p obj for a message to @p to_rank, while the message is built on the sending
     * thread (the caller of weft_rpc_async/weft_agent_send, or of weft_call_reply for a result;
     * it may record that the object is being sent, e.g. a fork). Never called for the calling
     * rank itself. *bytes_p (at most 4096 bytes) is allocated with
     * weft_alloc; the agent frees it. An error fails the send (the caller sees the status; a
     * result is answered with it): then unsent runs for the objects encoded before.
     */
    weft_status_t (*encode)(void *state, weft_agent_t *a, int to_rank, void *obj, void **bytes_p,
                            size_t *len_p);
    /**
     * The message that carried @p obj, encoded as @p bytes for @p to_rank, was not sent after
     * all (the send failed before the message left this process: an error returned by the send,
     * a message over the receiver's limit, a later reference that failed to encode, a peer lost
     * or a connection that broke before the message was handed to it): undo what encode
     * recorded. Called once per encoded object of such a message, on the sending thread or on a
     * transport thread; must not block. May be NULL.
     */
    void (*unsent)(void *state, weft_agent_t *a, int to_rank, void *obj, const void *bytes,
                   size_t len);
    /**
     * Decodes an object that came from @p src_rank (never the calling rank itself), on a
     * transport thread; must not block. *obj_p gets one reference. *ready_p is NULL when the
     * object is usable at once, or a future (the codec's reference, released by the agent) that
     * completes when it is: a request's handler runs only once every object of its arguments is
     * ready, and a failed future fails the request with its status and text (the objects of a
     * response or a one-way message are delivered without waiting). An error fails the request
     * (or the call whose response it was; a one-way message is dropped) with that status; the
     * message's other references are still decoded, then released.
     */
    weft_status_t (*decode)(void *state, weft_agent_t *a, int src_rank, const void *bytes,
                            size_t len, void **obj_p, weft_future_t **ready_p);
    /** retain/release of the decoded objects. */
    const weft_value_ref_type_t *type;
} weft_ref_codec_t;

/**
 * Registers the codec of references of @p kind (1..15; codec->type->kind must be @p kind) with
 * its @p state (borrowed; must outlive the agent's transport). @p codec is copied. Register
 * before weft_agent_join. Values sent to the calling rank itself (they loop back through its own
 * stream) keep their objects as they are (retained; no encode, decode or unsent; the codec must
 * still be registered). A value that carries a reference of a kind without a codec fails to send
 * with WEFT_ERR_UNSUPPORTED naming the kind; a message that carries one, or more than 4096
 * references, or an encoding over 4096 bytes, is refused by the receiver with WEFT_ERR_PROTOCOL
 * (the sender refuses the last two itself with WEFT_ERR_TOO_LARGE). Thread-safe.
 * @return WEFT_ERR_ALREADY_EXISTS when the kind has a codec, WEFT_ERR_INVALID_ARG,
 *         WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_agent_register_ref_codec(weft_agent_t *a, uint32_t kind,
                                            const weft_ref_codec_t *codec, void *state);

/**
 * Called by weft_agent_shutdown on the calling thread before the ranks agree to stop (the RPC
 * layer still works): lets a module settle its state (the rref module waits until every
 * reference is confirmed and deleted). @p deadline_ms is the shutdown's deadline on the
 * weft__now_ms clock (CLOCK_MONOTONIC milliseconds). A non-OK status is logged and shutdown goes
 * on.
 */
typedef weft_status_t (*weft_shutdown_cb_t)(weft_agent_t *a, int64_t deadline_ms, void *arg);
/**
 * Adds a shutdown listener; listeners run in the order added, once, at the first
 * weft_agent_shutdown. Thread-safe (a listener may add another: it runs too).
 * @return WEFT_ERR_INVALID_ARG, WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_agent_on_shutdown(weft_agent_t *a, weft_shutdown_cb_t cb, void *arg);

/** Makes a module's state for @p a (see weft_agent_module). */
typedef weft_status_t (*weft_module_create_cb_t)(weft_agent_t *a, void **state_p);
/** Frees a module's state at weft_agent_free, once the transport is closed. */
typedef void (*weft_module_destroy_cb_t)(void *state);
/**
 * The state of the module that owns @p channel, created on first use by
 * @p create (once, under a lock) and freed by @p destroy when the agent is
 * freed. Lets upper modules keep per-agent state without the agent knowing them.
 */
WEFT_API weft_status_t weft_agent_module(weft_agent_t *a, uint32_t channel, weft_module_create_cb_t create,
                                weft_module_destroy_cb_t destroy, void **state_p);

#ifdef __cplusplus
}
#endif
#endif
