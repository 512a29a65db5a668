/*
 * What the example programs share: their command lines (a table of options over getopt_long),
 * the parameter server's start-up and end, the end of a run whose serving ranks wait for the
 * working ones (wait_done), small helpers of RPC handlers, and the pieces of their training loops
 * (the clock, the progress bar, the epoch's shuffle, waiting for futures, the workers'
 * bit-for-bit parameter check, the MLP's dense tables). Functions are ex_-prefixed; @p prog is the
 * program's name for messages ("PROG: ..." on stderr).
 */
#ifndef WEFT_EXAMPLES_COMMON_H
#define WEFT_EXAMPLES_COMMON_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <weft/weft.h>

/** Exit status for bad options (and, by the examples' convention, data that cannot be read). */
#define EX_EXIT_USAGE 2
/** Layers of an MLP at most: EX_MAX_LAYERS - 1 hidden ones. */
#define EX_MAX_LAYERS 8
/** How long weft_agent_shutdown may wait for the other ranks. */
#define EX_SHUTDOWN_TIMEOUT_MS 30000
/** FNV-1a's offset basis: ex_fnv1a's @p h for the first bytes. */
#define EX_FNV1A_BASIS 0xcbf29ce484222325ULL

/* ------------------------------------------------------------------ options */

/** Parses a whole decimal integer in [min, max] into *v_p. @return 0, or -1 (nothing set). */
int ex_parse_int(const char *s, int64_t min, int64_t max, int64_t *v_p);
/** Parses a whole finite number in [min, max] into *v_p. @return 0, or -1 (nothing set). */
int ex_parse_double(const char *s, double min, double max, double *v_p);

/** Hidden layer sizes, from a comma list ("256" or "512,256"), each in [1, 65536]. */
typedef struct {
    int n;
    int64_t v[EX_MAX_LAYERS - 1];
} ex_sizes_t;

/** What an option's argument sets (see ex_opt_t). */
typedef enum {
    EX_OPT_FLAG,   /**< no argument: *(int *)dst = 1 */
    EX_OPT_INT,    /**< *(int *)dst, a whole number in [min, max] */
    EX_OPT_I64,    /**< *(int64_t *)dst, in [min, max] */
    EX_OPT_U64,    /**< *(uint64_t *)dst, in [min, max] (min >= 0) */
    EX_OPT_DOUBLE, /**< *(double *)dst, finite, in [fmin, fmax] */
    EX_OPT_STR,    /**< *(const char **)dst = the argument, borrowed from argv */
    EX_OPT_SIZES,  /**< *(ex_sizes_t *)dst, a comma list of sizes */
    EX_OPT_MODE,   /**< *(weft_ps_consistency_t *)dst: sync, async or bounded */
} ex_opt_kind_t;

/** One long option "--name" of a command line. Build them with the EX_* macros below. */
typedef struct {
    const char *name;
    ex_opt_kind_t kind;
    void *dst;
    int64_t min, max;
    double fmin, fmax;
    int *given; /**< if not NULL, set to 1 when the option is given */
} ex_opt_t;

/* The table's rows; each checks at compile time that @p p points to the type its kind sets. */
#define EX_FLAG(name, p)                                                                           \
    {                                                                                              \
        (name), EX_OPT_FLAG, (void *)(1 ? (p) : (int *)0), 0, 0, 0, 0, NULL                        \
    }
#define EX_INT(name, p, lo, hi)                                                                    \
    {                                                                                              \
        (name), EX_OPT_INT, (void *)(1 ? (p) : (int *)0), (lo), (hi), 0, 0, NULL                   \
    }
#define EX_I64(name, p, lo, hi)                                                                    \
    {                                                                                              \
        (name), EX_OPT_I64, (void *)(1 ? (p) : (int64_t *)0), (lo), (hi), 0, 0, NULL               \
    }
#define EX_U64(name, p, lo, hi)                                                                    \
    {                                                                                              \
        (name), EX_OPT_U64, (void *)(1 ? (p) : (uint64_t *)0), (lo), (hi), 0, 0, NULL              \
    }
#define EX_DOUBLE(name, p, lo, hi)                                                                 \
    {                                                                                              \
        (name), EX_OPT_DOUBLE, (void *)(1 ? (p) : (double *)0), 0, 0, (lo), (hi), NULL             \
    }
#define EX_STR(name, p)                                                                            \
    {                                                                                              \
        (name), EX_OPT_STR, (void *)(1 ? (p) : (const char **)0), 0, 0, 0, 0, NULL                 \
    }
#define EX_SIZES(name, p)                                                                          \
    {                                                                                              \
        (name), EX_OPT_SIZES, (void *)(1 ? (p) : (ex_sizes_t *)0), 0, 0, 0, 0, NULL                \
    }
#define EX_MODE(name, p)                                                                           \
    {                                                                                              \
        (name), EX_OPT_MODE, (void *)(1 ? (p) : (weft_ps_consistency_t *)0), 0, 0, 0, 0, NULL      \
    }

/**
 * Parses @p argv's long options against @p opts (@p n of them, at most 64; "--help" and "-h" are
 * added), storing each argument as its row says. A bad value prints "PROG: bad value 'V' for
 * --NAME" and @p usage on stderr; an unknown option (getopt_long's message) and a stray argument
 * ("PROG: unexpected argument 'A'") print @p usage on stderr too; --help prints it on stdout.
 * Defaults are the caller's: set them before.
 * @return 0; 1 after --help; EX_EXIT_USAGE after a message.
 */
int ex_parse_opts(const char *prog, int argc, char **argv, const ex_opt_t *opts, size_t n,
                  void (*usage)(FILE *out));

/** "sync", "async" or "bounded". */
const char *ex_mode_name(weft_ps_consistency_t mode);

/* ------------------------------------------------------------------ running */

/** Seconds of CLOCK_MONOTONIC. */
double ex_now(void);

/** Prints "PROG: WHAT: STATUS: weft_last_error()" on stderr. */
void ex_fail(const char *prog, const char *what, weft_status_t st);

/**
 * Waits for @p n futures and releases them all; on a failure prints the first failed one's
 * error ("PROG: WHAT: STATUS: text"). @return 0, or -1 if any failed.
 */
int ex_wait_all(const char *prog, weft_future_t **fs, int n, const char *what);

/**
 * Creates the agent (2 handler threads: a server answers pushes while pulls wait for a step) and
 * the parameter server, before the join so that the servers' function exists when the first
 * request comes (roles from WEFT_PS_SERVERS, which weftrun --servers sets), and joins. On failure
 * prints "PROG: cannot start the parameter server: ..." and frees what it made.
 * @param[out] a_p, ps_p set on success; the caller shuts the agent down and frees it (which
 *             frees the PS).
 * @return 0, or -1 after the message.
 */
int ex_ps_start(const char *prog, weft_agent_t **a_p, weft_ps_t **ps_p);

/**
 * The group of the parameter server's workers, group rank = worker index: every rank tells the
 * world its worker index (one all_gather over the world), then weft_pg_new. Every rank calls it;
 * a rank that does not work gets a non-member.
 * @param[out] wpg_p set on success; caller frees with weft_pg_free.
 * @return 0, or -1 after a message ("PROG: the workers' group: ...").
 */
int ex_ps_workers_group(const char *prog, weft_agent_t *a, weft_ps_t *ps, weft_pg_t **wpg_p);

/**
 * The end of a worker's step: waits for its @p n pushes @p fs (ex_wait_all: released) and, if
 * they all succeeded, ends the step (weft_ps_clock).
 * @return 0, or -1 after a message ("PROG: push: ..." or "PROG: clock: ...").
 */
int ex_ps_end_step(const char *prog, weft_ps_t *ps, weft_future_t **fs, int n);

/**
 * weft_ps_finish: servers serve until every worker is done; workers say they are.
 * @return @p rc, or 1 if it was 0 and the finish failed (after a message).
 */
int ex_ps_finish(const char *prog, weft_ps_t *ps, int rc);

/**
 * weft_agent_shutdown with EX_SHUTDOWN_TIMEOUT_MS.
 * @return @p rc, or 1 if it was 0 and the shutdown failed (after a message).
 */
int ex_agent_shutdown(const char *prog, weft_agent_t *a, int rc);

/** The timeout of a call made while serving @p call: what is left of its deadline, at least 1 ms.
 */
int64_t ex_call_time_left_ms(const weft_call_t *call);

/** Answers @p call with the @p len bytes at @p p (a copy); fails it with WEFT_ERR_NO_MEMORY
 * ("no memory") if the answer cannot be made. */
void ex_reply_payload(weft_call_t *call, const void *p, size_t len);

/* ------------------------------------------------------------------ the end of a run */

/*
 * The shutdown is collective and bounded (EX_SHUTDOWN_TIMEOUT_MS), while training is not: a rank
 * that only serves first waits until the ranks that drive the work are done. Each of those
 * registers "wait_done" (ex_wait_done_fn, its argument an ex_done_t) and, once its main loop has
 * ended, calls ex_done_announce; a serving rank calls ex_wait_done on them. The call stays open
 * until then and fails at once with WEFT_ERR_PEER_LOST if the rank is lost (a long deadline,
 * EX_SERVE_TIMEOUT_MS, bounds it otherwise).
 */
#define EX_SERVE_TIMEOUT_MS (7LL * 24 * 3600 * 1000)
/** wait_done calls one rank holds open at most; ranks one ex_wait_done waits for at most. */
#define EX_MAX_WAITERS 64

/** A working rank's end, for the wait_done calls. Initialise with EX_DONE_INIT. */
typedef struct {
    pthread_mutex_t mu;
    int done;
    int n;
    weft_call_t *calls[EX_MAX_WAITERS];
} ex_done_t;

#define EX_DONE_INIT                                                                               \
    {                                                                                              \
        .mu = PTHREAD_MUTEX_INITIALIZER                                                            \
    }

/** The "wait_done" handler (@p arg an ex_done_t): answers nothing once ex_done_announce has been
 * called; fails with WEFT_ERR_NO_MEMORY past EX_MAX_WAITERS open calls. Thread-safe. */
void ex_wait_done_fn(weft_call_t *call, void *arg);

/** This rank's work is over: answers the wait_done calls, and those still to come at once. */
void ex_done_announce(ex_done_t *d);

/**
 * Waits until ranks @p first .. @p last are done (or one of them failed or was lost): calls
 * "wait_done" on each (at most EX_MAX_WAITERS) and waits for them all (ex_wait_all with @p what).
 * @return 0, or -1 after a message ("PROG: wait_done: ..." or "PROG: WHAT: ...").
 */
int ex_wait_done(const char *prog, weft_agent_t *a, int first, int last, const char *what);

/* ------------------------------------------------------------------ training */

/** |a - b| relative to the larger of |a| and |b| (0 when both are 0). */
double ex_rel_diff(double a, double b);

/**
 * Prints the progress line of step @p step (0-based) of @p steps in epoch @p epoch (0-based) of
 * @p epochs: "epoch E/N [###...] S/T loss L R samples/s", over itself (\r) on a terminal
 * (@p tty), one line each otherwise.
 */
void ex_progress(int epoch, int epochs, int64_t step, int64_t steps, double loss, double rate,
                 int tty);

/**
 * Epoch @p epoch's order of @p n samples: a permutation of 0..n-1 (into @p perm) drawn from
 * @p seed and the epoch alone, so the same on every rank.
 */
void ex_epoch_perm(uint64_t seed, int epoch, int64_t n, int64_t *perm);

/** FNV-1a 64 of @p n bytes, going on from @p h (EX_FNV1A_BASIS for the first bytes). */
uint64_t ex_fnv1a(uint64_t h, const void *p, size_t n);

/**
 * Compares every member's parameters @p params with group rank 0's, bit for bit (a broadcast and
 * an all_reduce MIN over @p pg; every member calls it). @p same_p gets 1 if all match, @p hash_p
 * the FNV-1a 64 of this member's packed parameters.
 * @return 0, or -1 after a message ("PROG: parameter check: ...").
 */
int ex_params_identical(const char *prog, weft_pg_t *pg, const weft_param_list_t *params,
                        int *same_p, uint64_t *hash_p);

/**
 * The layer sizes of an MLP @p in -> @p hidden -> @p out into @p sizes (EX_MAX_LAYERS + 1
 * entries). @return how many there are (hidden->n + 2).
 */
int ex_mlp_sizes(const ex_sizes_t *hidden, int64_t in, int64_t out, int64_t *sizes);

/**
 * weft_ps_table_create (no timeout; every rank creates every table, in the same order).
 * @return 0, or -1 after a message ("PROG: table NAME: STATUS: text").
 */
int ex_ps_table_create(const char *prog, weft_ps_t *ps, const weft_ps_table_spec_t *spec,
                       weft_ps_table_t **t_p);

/** Prints "MLP 784-256-10" (no newline). */
void ex_print_mlp(int n_sizes, const int64_t *sizes);

/** The name of parameter @p i of an MLP in weft_nn_mlp's order: fc1.weight, fc1.bias, fc2.weight...
 */
void ex_linear_name(int i, char *name, size_t cap);

/**
 * Sets up @p spec for a dense table named @p table (borrowed: the spec points to it) that holds
 * parameter @p i (see ex_linear_name) of the MLP of layer sizes @p sizes: weft_ps_table_spec_init,
 * the shape ([out, in] or [out]) and the initializer, uniform(-1/sqrt(in), 1/sqrt(in)) for weights
 * and biases, torch's nn.Linear distribution. The caller sets the optimizer, seed, consistency
 * and chunk size.
 */
void ex_ps_linear_spec(const int64_t *sizes, int i, const char *table, weft_ps_table_spec_t *spec);

/**
 * A worker's copy of the MLP of @p n_sizes layer sizes @p sizes (weft_nn_mlp, random stream
 * (@p seed, 0)), whose parameters the pulls overwrite; checks that its parameters are those of
 * ex_linear_name, in that order (the tables').
 * @param[out] mlp_p set on success; caller frees with weft_nn_mlp_free.
 * @return WEFT_ERR_INVALID_STATE after a message if they are not; weft_nn_mlp_create's errors.
 */
weft_status_t ex_mlp_for_tables(const char *prog, int n_sizes, const int64_t *sizes, uint64_t seed,
                                weft_nn_mlp_t **mlp_p);

/**
 * The peak resident set of this process in MiB, over the members of @p pg (every member calls
 * it): the maximum into @p max_p and, when @p sum_p is not NULL, the sum into @p sum_p.
 * @return 0, or -1 after a message ("PROG: peak memory: ...").
 */
int ex_peak_rss(const char *prog, weft_pg_t *pg, double *max_p, double *sum_p);

/** Prints a JSON field ,"NAME":V with @p v in @p fmt, or ,"NAME":null when @p v is not finite. */
void ex_json_num(const char *name, double v, const char *fmt);

/** Prints "parameters bit-identical|DIFFER on all W ranks (fnv1a64 HASH)" (ex_params_identical's).
 */
void ex_print_params_check(int same, int world, uint64_t hash);

/* ------------------------------------------------------------------ training loop */

/**
 * The bookkeeping of a data-parallel training loop: the training clock (stopped while the test
 * set is scored), the samples and steps over all ranks, each epoch's mean loss, the DDP reducer's
 * communication time, and the progress, accuracy and epoch lines that rank 0 prints.
 */
typedef struct {
    int rank;
    int world;
    int epochs;
    int64_t steps;     /**< per epoch */
    int eval_every;    /**< steps; 0: at the end of each epoch only */
    int tty;           /**< stdout is a terminal: the progress line redraws itself */
    double train_time; /**< seconds of training in the finished epochs */
    double t_epoch;    /**< ... in this one so far */
    double loss_sum;   /**< this epoch's */
    int64_t loss_n;
    double loss_avg; /**< the last finished epoch's mean loss */
    int64_t samples; /**< trained on, over all ranks */
    int64_t step_total;
    int epochs_run;
    double comm_us;    /**< the DDP reducer's communication time, summed over steps */
    double exposed_us; /**< ... of which after backward ended */
} ex_loop_t;

/** Starts the bookkeeping of @p epochs epochs of @p steps steps each. */
void ex_loop_init(ex_loop_t *l, int rank, int world, int epochs, int64_t steps, int eval_every);

/** Starts an epoch: its clock and loss from zero. */
void ex_loop_epoch_begin(ex_loop_t *l);

/** Adds the communication times of @p ddp's last backward. */
void ex_loop_add_ddp(ex_loop_t *l, weft_ddp_t *ddp);

/**
 * Ends step @p s (0-based) of epoch @p epoch, begun at ex_now() @p t0, that trained on @p k
 * samples per rank with mean loss @p loss: the clock, the counts and rank 0's progress line
 * (every step on a terminal, else every tenth of the epoch).
 * @return 1 when the test accuracy is due (every eval_every steps and at the epoch's end), else 0.
 */
int ex_loop_step_end(ex_loop_t *l, int epoch, int64_t s, int64_t k, double loss, double t0);

/** Rank 0's "step N: test accuracy A%" after an evaluation within step @p s of an epoch (none
 * after its last step: the epoch's line says it). */
void ex_loop_eval_line(const ex_loop_t *l, int64_t s, double acc);

/** Ends epoch @p epoch: the clock, its mean loss, and rank 0's "epoch E: train loss ..." line
 * with the test accuracy @p acc. */
void ex_loop_epoch_end(ex_loop_t *l, int epoch, double acc);

/** Training samples a second over all ranks (0 before any training time). */
double ex_loop_rate(const ex_loop_t *l);

/** Milliseconds of training a step (0 before any step). */
double ex_loop_step_ms(const ex_loop_t *l);

#endif
