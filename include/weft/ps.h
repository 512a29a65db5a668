/* The parameter server: ranks with the server role hold shards of named tables, dense (a tensor
 * of any shape) or sparse (rows of a fixed length addressed by u64 ids, made on first use);
 * workers push gradients and pull values with futures; servers apply the table's optimizer;
 * consistency (sync, async, bounded staleness) is chosen per table; checkpoints are consistent
 * cuts, restorable into another number of servers. docs/ps.md has the model and the protocol.
 *
 * Roles: weft_ps_opts_t names the server ranks (else WEFT_PS_SERVERS: a count N, meaning ranks
 * 0..N-1, or a list "0,3"); the workers are the other ranks, or every rank when every rank
 * serves (WEFT_PS_WORKERS names them explicitly). A rank may be both.
 *
 * Every operation below is asynchronous (a future; the call's error means no future was made)
 * with a blocking wrapper. Timeouts follow rpc.h: 0 is the agent's call timeout. */
#ifndef WEFT_PS_H
#define WEFT_PS_H

#include <weft/api.h>

/* Layering (docs/architecture.md): the parameter server sits above rpc. */
#if defined(WEFT_BUILDING) && !defined(WEFT_SEES_PS)
#error "weft/ps.h is above the module being built: dependencies point downward only"
#endif

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <weft/future.h>
#include <weft/optim.h>
#include <weft/rpc.h>
#include <weft/tensor.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct weft_ps weft_ps_t;
typedef struct weft_ps_table weft_ps_table_t;

/** Roles. Arrays are borrowed for the call. */
typedef struct {
    const int *servers; /**< server ranks; NULL: WEFT_PS_SERVERS */
    size_t n_servers;
    const int *workers; /**< worker ranks; NULL: WEFT_PS_WORKERS, else every non-server rank
                             (every rank when all serve) */
    size_t n_workers;
} weft_ps_opts_t;

/** Fills @p opts with "from the environment" markers. Thread-safe. */
WEFT_API void weft_ps_opts_init(weft_ps_opts_t *opts);

/**
 * The parameter server of @p a (one per agent: a later call returns the same one and checks that
 * the roles agree). Call it on every rank, before weft_agent_join (its function must be there
 * when the first peer's request comes); it is freed with the agent. Thread-safe.
 * @return WEFT_ERR_INVALID_ARG (a rank out of range or twice, no server, no worker, roles that
 *         differ from the first call's), WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_ps_create(weft_agent_t *a, const weft_ps_opts_t *opts,
                                      weft_ps_t **ps_p);

/** Whether this rank serves / works. Thread-safe. */
WEFT_API bool weft_ps_is_server(const weft_ps_t *ps);
WEFT_API bool weft_ps_is_worker(const weft_ps_t *ps);
/** The number of servers / workers. Thread-safe. */
WEFT_API size_t weft_ps_num_servers(const weft_ps_t *ps);
WEFT_API size_t weft_ps_num_workers(const weft_ps_t *ps);
/** This rank's index among the workers, -1 if it is not one. Thread-safe. */
WEFT_API int weft_ps_worker_index(const weft_ps_t *ps);

/* ------------------------------------------------------------------ tables */

typedef enum { WEFT_PS_DENSE = 1, WEFT_PS_SPARSE = 2 } weft_ps_kind_t;

/**
 * Consistency of a table, checked on the servers:
 * - SYNC (BSP): the servers apply a step once every worker has ended it (weft_ps_clock), to the
 *   mean of the workers' gradients of that step; a pull at clock k sees exactly the pushes of
 *   steps < k. A step's pushes are counted once per worker.
 * - ASYNC: each push is applied on arrival; a pull sees at least its own earlier pushes.
 * - BOUNDED (SSP, staleness s): pushes are applied on arrival; a pull at clock c waits until every
 *   worker has ended step c-s-1 (so it misses no update of clocks <= c-s-1) and sees its own
 *   pushes. s = 0 waits for every worker to reach c.
 */
typedef enum { WEFT_PS_SYNC = 1, WEFT_PS_ASYNC = 2, WEFT_PS_BOUNDED = 3 } weft_ps_consistency_t;

/** The servers' optimizer (core's kernels, <weft/optim.h>); SUM only adds gradients up (SYNC:
 * the value after step k is the sum of step k's pushes; ASYNC/BOUNDED: value += push). */
typedef enum {
    WEFT_PS_SGD = 1,
    WEFT_PS_ADAGRAD = 2,
    WEFT_PS_ADAM = 3,
    WEFT_PS_ADAMW = 4,
    WEFT_PS_SUM = 5,
} weft_ps_optimizer_t;

/** Initial values (sparse rows when made; dense tables at creation), from @p seed, the table's
 * name and the element's position only, so that they do not depend on the servers. */
typedef enum {
    WEFT_PS_ZEROS = 1,
    WEFT_PS_UNIFORM = 2,  /**< in [a, b) */
    WEFT_PS_NORMAL = 3,   /**< mean a, standard deviation b */
    WEFT_PS_CONSTANT = 4, /**< a */
} weft_ps_init_t;

/** A table. Fill with weft_ps_table_spec_init, then set what differs. */
typedef struct {
    const char *name; /**< 1..127 bytes, unique per PS */
    weft_ps_kind_t kind;
    weft_dtype_t dtype; /**< storage: F32, F16 or BF16 (math in f32); default F32 */
    int ndim;           /**< dense shape */
    int64_t shape[WEFT_MAX_DIMS];
    int64_t dim;          /**< sparse row length */
    uint64_t id_bound;    /**< sparse: ids must be < id_bound; 0: any */
    uint64_t admit_after; /**< sparse: a row is made by its k-th push (pulls before that read the
                               initial values); 0 or 1: made on first use */
    uint64_t capacity;    /**< sparse: rows per server; beyond, a least recently used row (of a
                               sample, docs/ps.md) is evicted (forgotten); 0: no bound */
    weft_ps_init_t init;
    double init_a, init_b;
    uint64_t seed;
    weft_ps_optimizer_t optimizer;
    /** the hyperparameters of the optimizer in use (<weft/optim.h>; the others are ignored) */
    weft_optim_sgd_config_t sgd;
    weft_optim_adagrad_config_t adagrad;
    weft_optim_adam_config_t adam; /**< ADAM and ADAMW */
    weft_ps_consistency_t consistency;
    int64_t staleness;    /**< BOUNDED: s >= 0 */
    uint64_t chunk_bytes; /**< dense: bytes per chunk placed on a server; 0: 4 MiB */
} weft_ps_table_spec_t;

/** Defaults: dense f32, zeros, SGD lr 0.01, SYNC, 4 MiB chunks. Thread-safe. */
WEFT_API void weft_ps_table_spec_init(weft_ps_table_spec_t *spec, const char *name,
                                      weft_ps_kind_t kind);

/**
 * Creates a table, collectively: every rank (servers and workers) calls it with the same spec, in
 * the same order as its other tables. Returns once every rank has; the servers then hold their
 * shards, initialised. @p spec is borrowed for the call.
 * @return WEFT_ERR_MISMATCH (ranks gave different specs: the text names the field and the ranks),
 *         WEFT_ERR_INVALID_ARG (a bad spec, named), WEFT_ERR_ALREADY_EXISTS, WEFT_ERR_TIMEOUT (a
 *         rank never created it), WEFT_ERR_PEER_LOST, WEFT_ERR_NO_MEMORY. Not thread-safe with
 *         other creations.
 */
WEFT_API weft_status_t weft_ps_table_create(weft_ps_t *ps, const weft_ps_table_spec_t *spec,
                                            int64_t timeout_ms, weft_ps_table_t **table_p);
/** A table by name (NULL if none); it lives as long as the PS. Thread-safe. */
WEFT_API weft_ps_table_t *weft_ps_table(weft_ps_t *ps, const char *name);
/** Borrowed spec of @p t, as created. Thread-safe. */
WEFT_API const weft_ps_table_spec_t *weft_ps_table_spec(const weft_ps_table_t *t);
/** Prints the shard map: version, dense chunks and their servers, or the sparse hash, and bytes
 * per server. Thread-safe. */
WEFT_API void weft_ps_table_print_map(const weft_ps_table_t *t, FILE *out);

/* ------------------------------------------------------------------ push and pull (workers) */

/**
 * Pushes a dense gradient: @p grad (borrowed until the future completes; f32, the table's shape)
 * is cut into chunks, each sent to its server. The future completes when every server has counted
 * it (applied it, for ASYNC and BOUNDED).
 * @return WEFT_ERR_INVALID_STATE (not a worker), WEFT_ERR_INVALID_ARG (a sparse table, NULL),
 *         WEFT_ERR_SHAPE, WEFT_ERR_DTYPE, WEFT_ERR_PEER_LOST (a server was lost), send errors.
 *         The future: WEFT_ERR_PEER_LOST naming the table and the server, WEFT_ERR_TIMEOUT, a
 *         server's status.
 */
WEFT_API weft_status_t weft_ps_push_async(weft_ps_table_t *t, const weft_tensor_t *grad,
                                          int64_t timeout_ms, weft_future_t **f_p);
/** Pulls a dense table into @p dst (borrowed until the future completes; f32, the table's shape;
 * written only by a successful pull). Statuses as weft_ps_push_async. */
WEFT_API weft_status_t weft_ps_pull_async(weft_ps_table_t *t, weft_tensor_t *dst,
                                          int64_t timeout_ms, weft_future_t **f_p);
/** A push, then a pull of the value the push is part of, in one round trip per server. */
WEFT_API weft_status_t weft_ps_push_pull_async(weft_ps_table_t *t, const weft_tensor_t *grad,
                                               weft_tensor_t *dst, int64_t timeout_ms,
                                               weft_future_t **f_p);
/**
 * Pushes gradients of sparse rows: @p rows (f32 [n, dim], borrowed until the future completes) is
 * the gradient of rows @p ids (borrowed for the call). Rows of a repeated id are summed here
 * first. WEFT_ERR_INVALID_ARG for an id >= the table's id_bound (nothing is sent).
 */
WEFT_API weft_status_t weft_ps_push_rows_async(weft_ps_table_t *t, const uint64_t *ids, size_t n,
                                               const weft_tensor_t *rows, int64_t timeout_ms,
                                               weft_future_t **f_p);
/** Pulls rows @p ids (borrowed for the call; repeats allowed, fetched once) into @p rows
 * (f32 [n, dim], borrowed until the future completes). */
WEFT_API weft_status_t weft_ps_pull_rows_async(weft_ps_table_t *t, const uint64_t *ids, size_t n,
                                               weft_tensor_t *rows, int64_t timeout_ms,
                                               weft_future_t **f_p);

/** Blocking forms: wait for the future; the error text is in weft_last_error(). weft_ps_push_pull
 * on a SYNC table is WEFT_ERR_INVALID_STATE: its pull waits for the step the caller's own clock
 * ends (use the async form, weft_ps_clock, then wait). */
WEFT_API weft_status_t weft_ps_push(weft_ps_table_t *t, const weft_tensor_t *grad,
                                    int64_t timeout_ms);
WEFT_API weft_status_t weft_ps_pull(weft_ps_table_t *t, weft_tensor_t *dst, int64_t timeout_ms);
WEFT_API weft_status_t weft_ps_push_pull(weft_ps_table_t *t, const weft_tensor_t *grad,
                                         weft_tensor_t *dst, int64_t timeout_ms);
WEFT_API weft_status_t weft_ps_push_rows(weft_ps_table_t *t, const uint64_t *ids, size_t n,
                                         const weft_tensor_t *rows, int64_t timeout_ms);
WEFT_API weft_status_t weft_ps_pull_rows(weft_ps_table_t *t, const uint64_t *ids, size_t n,
                                         weft_tensor_t *rows, int64_t timeout_ms);

/**
 * Ends this worker's step on every server and table: its clock advances by one. Issue the step's
 * pushes first: the clock tells each server how many this worker sent it, and the server counts
 * the step ended once all of them arrived, so their futures need not have completed (a SYNC
 * push_pull of this step completes only after its clock: issue it, clock, then wait). A SYNC
 * table applies the step when every worker has ended it. Blocking; not thread-safe with this
 * PS's other clock calls.
 * @return as weft_ps_push_async.
 */
WEFT_API weft_status_t weft_ps_clock(weft_ps_t *ps, int64_t timeout_ms);
/** This worker's clock: the number of steps it has ended. Thread-safe. */
WEFT_API int64_t weft_ps_worker_clock(const weft_ps_t *ps);

/**
 * The end of a job's use of the parameter server, on every rank: a worker tells every server it is
 * done; a server returns once every worker has done so (or was lost), so that server ranks can
 * serve for as long as training lasts and then call weft_agent_shutdown. @p timeout_ms: 0 waits
 * without limit on a server; a worker's messages have the agent's call timeout. Call it once, not
 * from a handler.
 * @return WEFT_ERR_PEER_LOST (a worker or server was lost: named), WEFT_ERR_TIMEOUT.
 */
WEFT_API weft_status_t weft_ps_finish(weft_ps_t *ps, int64_t timeout_ms);

/* ------------------------------------------------------------------ stats */

#define WEFT_PS_STALENESS_BUCKETS 17 /* 0..15, then 16 and more */

/** One table on one server. */
typedef struct {
    uint64_t bytes_in, bytes_out;                  /**< tensor bytes received / sent */
    uint64_t rows;                                 /**< sparse rows held, or dense elements */
    uint64_t pushes, pulls;                        /**< requests served */
    uint64_t duplicates;                           /**< pushes seen again and not applied */
    uint64_t evicted;                              /**< sparse rows evicted */
    uint64_t staleness[WEFT_PS_STALENESS_BUCKETS]; /**< pulls by the staleness they had */
} weft_ps_load_t;

/**
 * Asks every server for its counters of table @p t: @p loads (n_servers entries, caller's) gets
 * one per server, in server order. Thread-safe.
 */
WEFT_API weft_status_t weft_ps_table_stats(weft_ps_table_t *t, weft_ps_load_t *loads,
                                           int64_t timeout_ms);
/** Prints every table's counters per server and its staleness histogram. Thread-safe. */
WEFT_API weft_status_t weft_ps_print_stats(weft_ps_t *ps, FILE *out, int64_t timeout_ms);

/* ------------------------------------------------------------------ checkpoints */

/**
 * Writes a checkpoint of every table to @p dir (made if missing; a directory every server can
 * write and read), collectively: every worker calls it at the same point of its loop (after the
 * same number of weft_ps_clock calls). Each server waits until every worker's pushes before the
 * call are applied (SYNC: the step is applied), writes one file per table shard (temporary file,
 * then rename) with the optimizer state, and the first worker writes the MANIFEST last (format
 * version, specs, shard map, row counts, CRC32C of every file), so that a process killed during a
 * save leaves the previous checkpoint loadable. Returns once the checkpoint is complete.
 * @return WEFT_ERR_IO (with the path), WEFT_ERR_PEER_LOST, WEFT_ERR_TIMEOUT.
 */
WEFT_API weft_status_t weft_ps_save(weft_ps_t *ps, const char *dir, int64_t timeout_ms);
/**
 * Restores the checkpoint in @p dir into the tables created so far (same names and specs; servers
 * may be more or fewer than when it was written: rows and chunks go to the servers that hold them
 * now), collectively on every worker, before any push. The workers' clocks become the
 * checkpoint's step. Bit-exact.
 * @return WEFT_ERR_NOT_FOUND (no manifest), WEFT_ERR_IO, WEFT_ERR_MISMATCH (a table that differs),
 *         WEFT_ERR_PROTOCOL (a file whose checksum or format is wrong).
 */
WEFT_API weft_status_t weft_ps_load(weft_ps_t *ps, const char *dir, int64_t timeout_ms);

#ifdef __cplusplus
}
#endif
#endif
