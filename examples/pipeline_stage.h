/*
 * What pipeline_train and pipeline_ddp share: the CNN of torch's pipeline tutorial cut into two
 * stages, a stage object on its rank (its layers, its forward method, the pool of threads its
 * methods run on), and the master's side of the pipeline (micro-batches through stage 1 then
 * stage 2, over RRefs, in the caller's distributed autograd context), its evaluation and its random
 * timing batches.
 *
 *   stage 1   Conv2d(1 -> 32, 3x3, padding 1), ReLU, MaxPool2d(2),
 *             Conv2d(32 -> 64, 3x3, padding 1), ReLU, MaxPool2d(2)      64 x 7 x 7
 *   stage 2   Flatten, Linear(3136 -> 128), ReLU, Linear(128 -> 10)      10
 *
 * Functions are pipe_-prefixed; @p prog is the program's name for messages ("PROG: ..." on
 * stderr).
 */
#ifndef WEFT_EXAMPLES_PIPELINE_STAGE_H
#define WEFT_EXAMPLES_PIPELINE_STAGE_H

#include <pthread.h>
#include <stdint.h>

#include <weft/weft.h>

#include "mnist.h"

#define PIPE_IMAGE_SIDE 28
#define PIPE_STAGE2_IN  (64 * 7 * 7)
#define PIPE_CLASSES    MNIST_CLASSES
/** Micro-batches per pipeline and batch at most. */
#define PIPE_MAX_SPLITS 64
/** Pipelines one forward drives at most. */
#define PIPE_MAX_LINES 2
/** Threads of a stage rank's pool. */
#define PIPE_STAGE_THREADS 8

/* ------------------------------------------------------------------ a stage on its rank */

/** A stage (or a stage replica) on its rank. The lock serialises its forward passes (and the
 * program's other methods that touch its parameters). */
typedef struct {
    int k; /**< 1 or 2 */
    pthread_mutex_t mu;
    weft_nn_conv2d_t *conv1, *conv2; /**< stage 1 */
    weft_nn_linear_t *fc1, *fc2;     /**< stage 2 */
    weft_param_list_t *params;
    int64_t forwards; /**< under mu */
    int64_t recorded; /**< of which in a context (graph recorded) */
    /* pipeline_ddp's: the replica's bookkeeping and its local optimizer (NULL in pipeline_train) */
    int replicas;
    int rank;
    weft_optimizer_t *opt; /**< freed by pipe_stage_free */
    int64_t steps;
} pipe_stage_t;

/**
 * Stage @p k (1 or 2) with its layers' parameters drawn from random stream (@p seed, @p k);
 * the other fields zero.
 * @param[out] s_p set on success; caller frees with pipe_stage_free.
 * @return WEFT_ERR_INVALID_ARG for another @p k, WEFT_ERR_NO_MEMORY, the layers' errors.
 */
weft_status_t pipe_stage_create(int k, uint64_t seed, pipe_stage_t **s_p);

/** Frees @p s, its optimizer included. */
void pipe_stage_free(pipe_stage_t *s);

/* ------------------------------------------------------------------ the stage rank's pool */

/*
 * The stages' methods run on a few threads of the stage's rank (torch's RPC thread pool): a
 * method hands its call to them and returns. A forward blocks in to_here until the previous
 * stage's output exists and then computes for a while (and pipeline_ddp's step blocks in the
 * all_reduce until its twin gets there); on threads of their own they keep the agent's transport
 * threads free for the other micro-batches' messages meanwhile. More calls in flight than threads
 * queue here.
 */
typedef struct pipe_pool pipe_pool_t;

/** What runs a queued call on a thread of the pool; it answers @p call. */
typedef void (*pipe_task_fn_t)(pipe_pool_t *pool, pipe_stage_t *s, weft_call_t *call);

typedef struct pipe_task pipe_task_t;

/** The pool: the stage type's argument on a stage rank. */
struct pipe_pool {
    weft_agent_t *a;
    weft_pg_t *pg; /**< the program's: pipeline_ddp's stage group (borrowed), else NULL */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pipe_task_t *head, *tail;
    int stop;
    int n_threads;
    pthread_t threads[PIPE_STAGE_THREADS];
};

/**
 * Starts @p pool's PIPE_STAGE_THREADS threads for agent @p a (borrowed). Call pipe_pool_stop
 * after it, even when it fails (it stops what started).
 * @return 0, or -1 after a message ("PROG: cannot start the stage's threads").
 */
int pipe_pool_start(const char *prog, pipe_pool_t *pool, weft_agent_t *a);

/** Lets the threads finish what is queued, then joins them. */
void pipe_pool_stop(pipe_pool_t *pool);

/** Queues @p call for @p fn on a thread of @p pool, which answers it (or fails it at once when
 * there is no memory). */
void pipe_pool_queue(pipe_pool_t *pool, pipe_task_fn_t fn, pipe_stage_t *s, weft_call_t *call);

/**
 * The tutorial's forward, a pipe_task_fn_t: x = to_here(x_rref), then the stage's layers under
 * the stage's lock, in the call's distributed autograd context (entered on this thread), so the
 * owner of x records a send function for its answer and this worker a receive function; the graph
 * of the layers is recorded, and the answer's send function leads back to the parameters. Without
 * a context (evaluation) no graph is recorded.
 */
void pipe_stage_forward_run(pipe_pool_t *pool, pipe_stage_t *s, weft_call_t *call);

/** The "forward" method of a stage type (a weft_rref_method_t's function, the type's argument a
 * pipe_pool_t): queues pipe_stage_forward_run. */
void pipe_stage_forward(void *obj, weft_call_t *call, void *type_arg);

/* ------------------------------------------------------------------ the master's pipelines */

/** The pipelines a forward drives, on the master. */
typedef struct {
    const char *prog;
    weft_agent_t *a;
    int n;                      /**< pipelines, 1 .. PIPE_MAX_LINES */
    weft_rref_t *const *first;  /**< n: each pipeline's stage 1 (borrowed) */
    weft_rref_t *const *second; /**< n: each pipeline's stage 2 (borrowed) */
    int named;                  /**< messages name the pipeline ("pipeline A, micro-batch i") */
} pipe_lines_t;

/**
 * The forward of batch @p x [b, ...] through the pipelines @p l (in the thread's current context,
 * if any): pipeline p gets its share of the rows (the first b % n one more), cut into
 * min(@p splits, share) micro-batches (tensor_split: the first ones one longer), at most @p splits
 * of each pipeline in flight at a time (the next starts when the oldest has come back); all
 * pipelines are fed at once. Each micro-batch: x_rref = weft_rref_create(micro-batch); y_rref =
 * weft_rref_remote_method(stage 1, "forward", x_rref) (the output stays on stage 1's rank); z =
 * weft_rref_rpc_async(stage 2, "forward", y_rref). The outputs, concatenated in row order, into
 * @p out_p [b, 10] (caller releases).
 * @return 0, or -1 after a message.
 */
int pipe_forward(const pipe_lines_t *l, weft_tensor_t *x, int splits, weft_tensor_t **out_p);

/**
 * The fraction of the first @p n images of @p test classified right into @p acc_p (0 for n = 0),
 * through pipe_forward in batches of @p batch without a context: no graph is recorded anywhere.
 * @return 0, or -1 after a message.
 */
int pipe_evaluate(const pipe_lines_t *l, const mnist_set_t *test, int64_t n, int64_t batch,
                  int splits, double *acc_p);

/**
 * @p nb batches of @p b random images (N(0, 1), [b, 1, 28, 28]) into @p xs and labels (uniform in
 * [0, 10)) into @p ys (both of @p nb entries, NULL), the same for the same @p seed. The caller
 * releases what they hold, after a failure too.
 * @return 0, or -1 after a message ("PROG: random batches: ...").
 */
int pipe_random_batches(const char *prog, uint64_t seed, int nb, int64_t b, weft_tensor_t **xs,
                        weft_tensor_t **ys);

#endif
