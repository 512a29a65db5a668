/* The RPC agent, the user's API: rendezvous of a world of named ranks, remote calls by name,
 * failure detection, collective shutdown. Modules above the RPC layer plug in through
 * weft/module.h.
 *
 * Timeouts, everywhere in weft: a timeout_ms > 0 is that many milliseconds; 0 means the default
 * (for a call, the agent's call timeout, weft_agent_call_timeout_ms; for a wait on a future,
 * until it completes); a negative timeout is refused with WEFT_ERR_INVALID_ARG where a deadline
 * is required (calls, shutdown) and means "no limit" for waits.
 *
 * Thread-safety: every function below says whether it may be called from several threads at
 * once. A handler runs on a transport thread: it must not block for long (see
 * weft_rpc_handler_cb_t). */
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

/** Wire protocol version carried in every Hello (docs/protocol.md). */
#define WEFT_PROTOCOL_VERSION 3

typedef struct weft_agent weft_agent_t;
typedef struct weft_call weft_call_t;

/**
 * An agent's options. A field left at its weft_agent_opts_init value is taken from the
 * environment (the variables named; `weftrun --print-config` lists them all), else the default.
 */
typedef struct {
    const char *name; /**< worker name; NULL: WEFT_NAME or "worker<rank>" */
    int rank;         /**< -1: WEFT_RANK / RANK / SLURM_PROCID / OMPI_COMM_WORLD_RANK / PMI_RANK */
    int world_size;   /**< -1: WEFT_WORLD_SIZE / WORLD_SIZE / SLURM_NTASKS / OMPI_COMM_WORLD_SIZE */
    const char *master_addr; /**< NULL: WEFT_MASTER_ADDR / MASTER_ADDR, else "127.0.0.1" */
    int master_port; /**< -1: WEFT_MASTER_PORT / MASTER_PORT (rank 0 may use 0: any free port) */
    const char *listen_host; /**< host other ranks reach this one at; NULL: WEFT_LISTEN_HOST, else
                                WEFT_SOCKET_IFNAME's IPv4 address, else 127.0.0.1 when master_addr
                                is loopback, else the address of the interface toward the master
                                (docs/weftrun.md) */
    const char *auth_token;  /**< the job's shared secret; NULL: WEFT_AUTH_TOKEN or none */
    int64_t rendezvous_timeout_ms; /**< 0: WEFT_RENDEZVOUS_TIMEOUT_MS or 60000 */
    int64_t default_timeout_ms;    /**< a call's deadline when it gives 0; 0: WEFT_RPC_TIMEOUT_MS
                                      or 60000 */
    int64_t peer_timeout_ms;       /**< failure detection bound; 0: WEFT_PEER_TIMEOUT_MS or 2000 */
    int handler_threads;           /**< threads serving the transport and handlers; 0:
                                      WEFT_HANDLER_THREADS or 1 (one more is started whenever one
                                      blocks in a weft wait) */
    int64_t max_message_bytes;     /**< largest message this rank accepts; 0:
                                      WEFT_MAX_MESSAGE_BYTES or 4 GiB - 1 (a gRPC message's limit) */
    /**
     * TLS with client certificates (mTLS) on every connection: the gRPC streams, the join and the
     * direct connections (docs/security.md). On when a CA is given (here or WEFT_TLS_CA); then
     * the certificate and key are required. A field left NULL is taken from WEFT_TLS_CA,
     * WEFT_TLS_CERT, WEFT_TLS_KEY (`weftrun --tls` makes a job CA and sets them). The certificate
     * must name this rank: a subjectAltName DNS entry "weft-rank-<rank>"; a common name other than
     * that binds the worker name too. The files are read again when they change (rotation without
     * a restart: new connections use the new ones).
     */
    const char *tls_ca_file;   /**< PEM: the CA(s) that sign every rank's certificate */
    const char *tls_cert_file; /**< PEM: this rank's certificate, then any intermediates */
    const char *tls_key_file;  /**< PEM: its private key */
} weft_agent_opts_t;

/** Fills @p opts with "take from the environment / default" markers. Thread-safe. */
WEFT_API void weft_agent_opts_init(weft_agent_opts_t *opts);

/**
 * Starts the transport of one rank: binds its server (rank 0 binds the master port), makes its
 * identity key and starts its threads. No peer is contacted yet. Caller frees with
 * weft_agent_free (after weft_agent_shutdown for a graceful end). Thread-safe (each call makes
 * its own agent).
 * @return WEFT_ERR_INVALID_ARG (rank/world/name missing or out of range, a negative timeout),
 *         WEFT_ERR_TRANSPORT (the port could not be bound), WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_agent_create(const weft_agent_opts_t *opts, weft_agent_t **agent_p);

/** The port this rank's server listens on (rank 0: the master port). Thread-safe. */
WEFT_API int weft_agent_port(const weft_agent_t *a);

/**
 * Rendezvous: rank 0 gathers a Hello from every rank and hands out the world map (name <-> rank
 * <-> address <-> identity key); the others send theirs to the master. Blocks until all have
 * arrived or the rendezvous timeout; then every rank's join fails with WEFT_ERR_RENDEZVOUS and a
 * text naming the ranks that never came. Also WEFT_ERR_VERSION, WEFT_ERR_AUTH,
 * WEFT_ERR_ALREADY_EXISTS (duplicate rank or name), WEFT_ERR_MISMATCH (another world size),
 * WEFT_ERR_INVALID_ARG (rank out of range), WEFT_ERR_INVALID_STATE (joined already). Call it
 * once, from one thread; register functions and create modules with codecs before it.
 */
WEFT_API weft_status_t weft_agent_join(weft_agent_t *a);

/** weft_agent_create then weft_agent_join; on failure nothing is left behind. As those. */
WEFT_API weft_status_t weft_agent_init(const weft_agent_opts_t *opts, weft_agent_t **agent_p);

/** This rank. Thread-safe. */
WEFT_API int weft_agent_rank(const weft_agent_t *a);
/** The number of ranks. Thread-safe. */
WEFT_API int weft_agent_world_size(const weft_agent_t *a);
/** Borrowed name of this worker. Thread-safe. */
WEFT_API const char *weft_agent_name(const weft_agent_t *a);
/** Borrowed name of @p rank (after join), NULL if out of range. Thread-safe after join. */
WEFT_API const char *weft_agent_worker_name(const weft_agent_t *a, int rank);
/** Rank of the worker named @p name. WEFT_ERR_NOT_FOUND if none. Thread-safe after join. */
WEFT_API weft_status_t weft_agent_worker_rank(const weft_agent_t *a, const char *name, int *rank_p);
/** The deadline a call given a timeout of 0 gets (opts.default_timeout_ms, else
 * WEFT_RPC_TIMEOUT_MS, else 60000). Thread-safe. */
WEFT_API int64_t weft_agent_call_timeout_ms(const weft_agent_t *a);
/** The largest message @p rank accepts (this one's from its options, a peer's after join); 0 if
 * out of range. Thread-safe after join. */
WEFT_API uint64_t weft_agent_max_message_bytes(const weft_agent_t *a, int rank);
/** Borrowed "host:port" of @p rank (after join). Thread-safe after join. */
WEFT_API const char *weft_agent_worker_address(const weft_agent_t *a, int rank);
/**
 * Borrowed "host:port" of @p rank's direct listener (after join): frames of 64 KiB or more travel
 * there over plain TCP, "" when the rank has none (WEFT_DIRECT=0), in which case they take the
 * gRPC stream. Thread-safe after join.
 */
WEFT_API const char *weft_agent_worker_direct_address(const weft_agent_t *a, int rank);

/**
 * Borrowed name of @p rank's shared-memory listener (after join; "" when it has none, with
 * WEFT_SHM=0). Ranks of one host (same boot, PID and network namespace, user) exchange every
 * frame through a ring in shared memory, opened at the first frame (docs/protocol.md section 4).
 * Thread-safe after join.
 */
WEFT_API const char *weft_agent_worker_shm_address(const weft_agent_t *a, int rank);

/** What went between this rank and a peer through shared memory (weft_agent_shm_stats). */
typedef struct {
    bool ring_open;          /**< frames to the peer take its ring now */
    uint64_t frames_sent;    /**< frames written to the peer's ring */
    uint64_t bytes_sent;     /**< their bytes (envelopes, payloads, tensors) */
    uint64_t frames_received; /**< frames read from the ring the peer writes to this rank */
    uint64_t bytes_received;
    uint64_t writer_waits;   /**< times a frame to the peer found its ring full */
} weft_shm_stats_t;

/**
 * The shared-memory counters of this rank with @p rank (all 0 when no ring was opened). Any
 * thread. WEFT_ERR_INVALID_ARG (NULL agent or output, rank out of range).
 */
WEFT_API weft_status_t weft_agent_shm_stats(const weft_agent_t *a, int rank,
                                            weft_shm_stats_t *stats_p);

/**
 * Graceful, collective shutdown: every rank calls it. The modules settle first (rref waits until
 * every reference is settled), then the ranks wait until no call is in flight anywhere in the
 * world (they agree on it through rank 0), then connections close. New calls fail with
 * WEFT_ERR_SHUTDOWN meanwhile. A second call returns WEFT_OK. Call it from one thread, not from a
 * handler.
 * @return WEFT_ERR_TIMEOUT if the world did not settle within @p timeout_ms (0: the call
 *         timeout); the agent is closed either way. WEFT_ERR_INVALID_ARG (negative timeout),
 *         WEFT_ERR_INVALID_STATE (not joined).
 */
WEFT_API weft_status_t weft_agent_shutdown(weft_agent_t *a, int64_t timeout_ms);
/** Frees the agent; closes it abruptly if weft_agent_shutdown was not called (pending calls fail
 * with WEFT_ERR_SHUTDOWN). Not with other calls on @p a; never from a handler. */
WEFT_API void weft_agent_free(weft_agent_t *a);

/* ------------------------------------------------------------------ calls */

/**
 * A registered function. It runs on a transport thread with the call's arguments (when objects
 * of the arguments' references were not ready, on the thread that completed the last of their
 * futures) and must finish the call exactly once, now or later from any thread, with
 * weft_call_reply, weft_call_fail or weft_call_reply_future. To wait on other calls, reply
 * through a future (like torch's @rpc.functions.async_execution) instead of blocking: then
 * chains of nested calls never exhaust the threads.
 */
typedef void (*weft_rpc_handler_cb_t)(weft_call_t *call, void *arg);

/**
 * Registers @p fn under @p name (copied; 1 to 255 bytes). Names starting with "__weft." are
 * reserved for weft's modules. Register before weft_agent_join (a call to a name not yet
 * registered fails with WEFT_ERR_NO_SUCH_FUNCTION). Thread-safe.
 * @return WEFT_ERR_ALREADY_EXISTS if the name is taken, WEFT_ERR_INVALID_ARG, WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_rpc_register(weft_agent_t *a, const char *name,
                                         weft_rpc_handler_cb_t fn, void *arg);

/* A call (weft_call_t) belongs to the handler until it is finished: its functions are for the
 * one thread that holds it at a time. */

/** Arguments of the call; borrowed, valid until the call is finished. */
WEFT_API const weft_value_t *weft_call_args(const weft_call_t *call);
/** Moves the arguments out (they become empty). Caller frees with weft_value_free. */
WEFT_API weft_value_t *weft_call_take_args(weft_call_t *call);
/** Replaces the call's arguments with @p args (takes ownership; NULL leaves none). */
WEFT_API void weft_call_set_args(weft_call_t *call, weft_value_t *args);
/** The rank that called (proven at connection). */
WEFT_API int weft_call_caller_rank(const weft_call_t *call);
/** The function's name; borrowed, valid until the call is finished. */
WEFT_API const char *weft_call_function(const weft_call_t *call);
/** The agent that serves the call. */
WEFT_API weft_agent_t *weft_call_agent(const weft_call_t *call);
/** Milliseconds left before the caller's deadline (<= 0: already passed). */
WEFT_API int64_t weft_call_time_left_ms(const weft_call_t *call);

/** Finishes the call successfully; takes ownership of @p result (may be NULL). Frees @p call. */
WEFT_API void weft_call_reply(weft_call_t *call, weft_value_t *result);
/** Finishes the call with an error status and text (WEFT_OK becomes WEFT_ERR_REMOTE). Frees
 * @p call. */
WEFT_API void weft_call_fail(weft_call_t *call, weft_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/**
 * Finishes the call when @p f completes, with its status, text and value.
 * Takes over the caller's reference to @p f. Frees @p call (later).
 */
WEFT_API void weft_call_reply_future(weft_call_t *call, weft_future_t *f);

/**
 * Calls @p fn on @p to_rank (may be this rank) with @p args. @p args is borrowed: the call takes
 * its own tensor references (their bytes are sent without copying, so do not modify them until
 * the future completes) and copies the payload. The transport may let go of a tensor just after
 * the future completes (a sender still returning from its system call): a tensor that wraps
 * memory it does not own (weft_tensor_wrap) keeps that memory alive until its release callback
 * runs, not merely until the future completes. @p timeout_ms: the call's deadline, which travels
 * to the callee (0: the agent's call timeout). The future completes with the result value, the
 * remote handler's status and text, WEFT_ERR_NO_SUCH_FUNCTION, WEFT_ERR_TIMEOUT,
 * WEFT_ERR_PEER_LOST; caller releases it with weft_future_release. Thread-safe.
 * @return an error and no future: WEFT_ERR_INVALID_ARG (a bad rank, name or negative timeout),
 *         WEFT_ERR_TOO_LARGE (over the callee's limit), WEFT_ERR_SHUTDOWN, WEFT_ERR_INVALID_STATE
 *         (not joined), a reference codec's status.
 */
WEFT_API weft_status_t weft_rpc_async(weft_agent_t *a, int to_rank, const char *fn,
                                      const weft_value_t *args, int64_t timeout_ms,
                                      weft_future_t **f_p);
/**
 * Memory a result's tensor may be received into (weft_rpc_async_into), or, with @p data NULL, a
 * sink its bytes may be handed to: @p sink(@p sink_arg, off, bytes, n) is called in order with
 * consecutive pieces (@p off: their offset in the tensor's data; n a multiple of 8 but for the
 * last; not aligned), from the transport's own memory, valid only during the call. A sink must
 * not block.
 */
typedef struct {
    void *data;
    size_t nbytes;
    weft_dtype_t dtype;
    void (*sink)(void *sink_arg, size_t off, const void *bytes, size_t n);
    void *sink_arg;
} weft_rpc_into_t;

/**
 * weft_rpc_async whose result's tensors may be received straight into the caller's memory, with
 * no copy: tensor i of the result lands in @p into[i] when the answer comes over a direct
 * connection (a large answer) or a shared-memory ring (a rank of this host, any size) and the
 * tensor has exactly into[i]'s dtype and byte count. That
 * tensor of the result value then wraps into[i].data (weft_tensor_data(x) == into[i].data tells);
 * otherwise it is a fresh tensor, as with weft_rpc_async. @p into is copied; the memory it names
 * must stay valid, and not be read or written by the caller, until the future completes or
 * weft_rpc_withdraw_into returns true; a result tensor that wraps it is valid as long as that
 * memory is. Bytes are written only before the future completes: a deadline or a lost peer that
 * comes while the answer is being received completes the call once the answer is in (then with
 * its result) or its connection broke, which a stalled peer's does when it is declared lost
 * (within the agent's peer timeout). Thread-safe.
 *
 * An entry with a sink instead of memory takes the tensor's bytes only over a shared-memory ring
 * (elsewhere the tensor is received as with weft_rpc_async): every byte then went to the sink
 * and the result value holds an empty tensor (shape [0], the dtype) in the tensor's place. The
 * sink is called only before the future completes, and not once weft_rpc_withdraw_into returned
 * true; if the ring broke midway, some pieces went to it and the call fails.
 * @return as weft_rpc_async; WEFT_ERR_INVALID_ARG for into entries with neither data nor sink.
 */
WEFT_API weft_status_t weft_rpc_async_into(weft_agent_t *a, int to_rank, const char *fn,
                                           const weft_value_t *args, int64_t timeout_ms,
                                           const weft_rpc_into_t *into, size_t n_into,
                                           weft_future_t **f_p);
/**
 * Stops the call of @p f (from weft_rpc_async_into) from writing into the caller's memory: true
 * when no byte of its answer will be written there any more (the call goes on; its result then
 * comes in fresh tensors) or the call is over; false while its answer is being received into that
 * memory (the future completes once it is in). Thread-safe.
 */
WEFT_API bool weft_rpc_withdraw_into(weft_agent_t *a, const weft_future_t *f);
/** weft_rpc_async to a worker by name (WEFT_ERR_NOT_FOUND for an unknown one). Thread-safe. */
WEFT_API weft_status_t weft_rpc_async_to(weft_agent_t *a, const char *to, const char *fn,
                                         const weft_value_t *args, int64_t timeout_ms,
                                         weft_future_t **f_p);
/**
 * Blocking call, as weft_rpc_async; the result goes to @p result_p (caller frees with
 * weft_value_free; may be NULL to drop it). The error text is in weft_last_error() on failure.
 * Thread-safe; a handler may call it (a spare thread takes over the transport while it waits).
 */
WEFT_API weft_status_t weft_rpc_sync(weft_agent_t *a, int to_rank, const char *fn,
                                     const weft_value_t *args, int64_t timeout_ms,
                                     weft_value_t **result_p);
/** weft_rpc_sync to a worker by name. Thread-safe. */
WEFT_API weft_status_t weft_rpc_sync_to(weft_agent_t *a, const char *to, const char *fn,
                                        const weft_value_t *args, int64_t timeout_ms,
                                        weft_value_t **result_p);
/**
 * Runs the registered function @p fn of this agent in-process, on the calling thread, with
 * @p args (takes ownership; NULL for none; the handler sees these tensors, not copies). The future
 * completes when the handler replies, with the reply value itself (no copy, no serialisation: its
 * tensors are the handler's) or its failure. No message is sent, so references in the values pass
 * as they are. @p timeout_ms is the call's deadline as weft_call_time_left_ms reports it (0: the
 * agent's call timeout). Thread-safe.
 * @return WEFT_ERR_NO_SUCH_FUNCTION (@p args is then still the caller's), WEFT_ERR_INVALID_ARG,
 *         WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_rpc_call_local(weft_agent_t *a, const char *fn, weft_value_t *args,
                                           int64_t timeout_ms, weft_future_t **f_p);

#ifdef __cplusplus
}
#endif
#endif
