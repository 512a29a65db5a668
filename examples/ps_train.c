/*
 * ps_train: data-parallel training of an MLP on Fashion-MNIST through weft's parameter server
 * (what torch's parameter-server tutorial and ps-lite users do, in C).
 *
 *   weftrun -n 4 --servers 2 build/examples/ps_train [--mode sync|async|bounded]
 *           [--staleness S] [--epochs 3] [--batch 64] [--lr 0.02] [--momentum 0.9]
 *           [--hidden 256] [--checkpoint-dir DIR] [--resume DIR] ...   (--help lists all)
 *
 * Ranks 0..N-1 serve (weftrun --servers N sets WEFT_PS_SERVERS), the others work. Every rank
 * creates one dense table per parameter of the MLP (784-256-10 by default: fc1.weight, fc1.bias,
 * fc2.weight, fc2.bias), in 64 KiB chunks so that the large weight matrix is spread over the
 * servers (each table is placed on its own, from server 0: with 4 MiB chunks every table would
 * sit on server 0). The servers hold the values and apply SGD with momentum to the gradients the
 * workers push. Each step of a worker pulls every table into its copy of the model, runs
 * forward and backward with weft's autograd, pushes the gradients and ends the step with
 * weft_ps_clock. --mode picks the tables' consistency: sync (the servers apply the mean of the
 * workers' gradients once every worker has ended the step; like dp_train's all_reduce), async
 * (each push applied on arrival) or bounded (stale synchronous parallel, --staleness steps).
 *
 * Initial values: the tables' own seeded initializer, uniform(-1/sqrt(fan_in), 1/sqrt(fan_in))
 * for weights and biases, which is torch's nn.Linear default distribution exactly
 * (kaiming_uniform with a = sqrt(5) reduces to it). The values differ from weft_nn_mlp's for the
 * same seed (another random stream), and they do not depend on the number of servers. The
 * parameter server has no "set" operation that would let one worker upload its model: a push is
 * always a gradient for the table's optimizer.
 *
 * Each epoch shuffles the training set with the same seed on every worker and gives worker w the
 * samples at positions w, w + W, ... (torch's DistributedSampler, padding the last round by
 * repeating the first samples), so every worker runs the same number of steps: sync mode needs
 * that. At the end of an epoch the workers meet (a barrier of the workers' group), pull the
 * parameters (the same on every worker, in every mode) and score their shares of the 10000 test
 * images, the counts summed with all_reduce; the first worker prints the epoch's loss, the test
 * accuracy, samples/s (the training clock stops during evaluation and checkpoints) and the
 * staleness the servers observed for the epoch's pulls (a pull's clock minus the slowest
 * worker's; weft_ps_table_stats). --eval-every N scores the same way every N steps too ("step N:
 * test accuracy X%, training T s"; bench/run_train.py takes time to target from these lines).
 *
 * Checkpoints: with --checkpoint-dir every worker calls weft_ps_save after the same step: every
 * --checkpoint-every steps and/or once --checkpoint-seconds of wall clock have passed since the
 * last checkpoint (whichever comes first; worker 0's clock decides for all, see ck_timer_t),
 * else at the end of each epoch; and at the end of training. --resume
 * DIR loads such a checkpoint into the new tables (weft_ps_load) and goes on from its step (the
 * restored weft_ps_worker_clock) until --epochs: the step gives the epoch and the position in it,
 * and the shuffle of an epoch depends only on the seed, so a resumed sync run ends with the very
 * parameters of an uninterrupted one. It needs the same --batch, --limit, --seed and number of
 * workers (DIR/ps_train.meta records them); the tables' specs (--hidden, --mode, --lr, ...) are
 * checked by weft_ps_load.
 *
 * Exit status: 0 on success, 2 for bad options, missing or corrupt data or a checkpoint that does
 * not fit, 1 for any other failure (including parameters that differ between workers).
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <weft/weft.h>

#include "common.h"
#include "mnist.h"

#define PROG       "ps_train"
#define NCLASS     MNIST_CLASSES
#define MAX_PARAMS (2 * EX_MAX_LAYERS)
#define EXIT_USAGE EX_EXIT_USAGE
#define META_FILE  "ps_train.meta"
#define CK_LAG_MAX 16 /* steps a decision of --checkpoint-seconds may lag (ck_timer_t) */

/* ---------------------------------------------------------- configuration */

typedef struct {
    int epochs;
    int batch; /* per worker */
    double lr;
    double momentum;
    double weight_decay;
    int nesterov;
    ex_sizes_t hidden;
    uint64_t seed;
    int64_t limit; /* 0: all training samples */
    weft_ps_consistency_t mode;
    int64_t staleness;
    int staleness_set;
    int64_t chunk_bytes;
    const char *checkpoint_dir;
    int64_t checkpoint_every;  /* steps; 0: none by step */
    double checkpoint_seconds; /* 0: none by time; without either, at the end of each epoch */
    int64_t eval_every;        /* steps; 0: after each epoch only */
    const char *resume_dir;
    double target;
    int json;
    int verbose;
    int threads;
    const char *data_dir;
} config_t;

static void usage(FILE *out)
{
    fprintf(
        out,
        "usage: weftrun -n N --servers S ps_train [options]\n"
        "  --mode M           sync, async or bounded (default sync)\n"
        "  --staleness S      bounded mode: steps a worker may run ahead (default 2)\n"
        "  --epochs N         passes over the training set (default 3)\n"
        "  --batch N          minibatch size per worker (default 64)\n"
        "  --lr X             SGD learning rate on the servers (default 0.02)\n"
        "  --momentum X       SGD momentum (default 0.9)\n"
        "  --nesterov         Nesterov momentum\n"
        "  --weight-decay X   L2 weight decay (default 0)\n"
        "  --hidden N[,N...]  hidden layer sizes (default 256: MLP 784-256-10)\n"
        "  --seed N           initialisation and shuffling seed (default 1)\n"
        "  --limit N          train on the first N training samples only\n"
        "  --chunk-bytes N    bytes per table chunk placed on a server (default 65536)\n"
        "  --checkpoint-dir D write checkpoints to D (weft_ps_save)\n"
        "  --checkpoint-every N    steps between checkpoints\n"
        "  --checkpoint-seconds T  seconds (wall clock, worker 0's) between checkpoints; with\n"
        "                          both, whichever comes first (without either: each epoch's end)\n"
        "  --resume D         go on from the checkpoint in D until --epochs\n"
        "  --target X         test accuracy the final line compares with (default 0.85)\n"
        "  --eval-every N     also measure test accuracy every N steps (default: per epoch)\n"
        "  --threads N        BLAS threads per worker (default 1)\n"
        "  --json             print a JSON summary line at the end (first worker)\n"
        "  --verbose          print the servers' counters at the end\n"
        "  --data DIR         Fashion-MNIST IDX files (default $WEFT_DATA_DIR, else\n"
        "                     " MNIST_DEFAULT_DIR ")\n");
}

/* Returns 0, 1 after --help, or EXIT_USAGE after a message. */
static int parse_args(int argc, char **argv, config_t *cfg)
{
    const ex_opt_t opts[] = {
        EX_INT("epochs", &cfg->epochs, 1, 100000),
        EX_INT("batch", &cfg->batch, 1, 1 << 20),
        EX_DOUBLE("lr", &cfg->lr, 0.0, 1e6),
        EX_DOUBLE("momentum", &cfg->momentum, 0.0, 0.999999),
        EX_FLAG("nesterov", &cfg->nesterov),
        EX_DOUBLE("weight-decay", &cfg->weight_decay, 0.0, 1e6),
        EX_SIZES("hidden", &cfg->hidden),
        EX_U64("seed", &cfg->seed, 0, INT64_MAX),
        EX_I64("limit", &cfg->limit, 1, INT64_MAX),
        EX_MODE("mode", &cfg->mode),
        {"staleness", EX_OPT_I64, &cfg->staleness, 0, 1000000, 0, 0, &cfg->staleness_set},
        EX_I64("chunk-bytes", &cfg->chunk_bytes, 4, INT32_MAX),
        EX_STR("checkpoint-dir", &cfg->checkpoint_dir),
        EX_I64("checkpoint-every", &cfg->checkpoint_every, 1, INT64_MAX),
        EX_DOUBLE("checkpoint-seconds", &cfg->checkpoint_seconds, 0.001, 1e9),
        EX_STR("resume", &cfg->resume_dir),
        EX_DOUBLE("target", &cfg->target, 0.0, 1.0),
        EX_I64("eval-every", &cfg->eval_every, 1, INT64_MAX),
        EX_INT("threads", &cfg->threads, 1, 256),
        EX_FLAG("json", &cfg->json),
        EX_FLAG("verbose", &cfg->verbose),
        EX_STR("data", &cfg->data_dir),
    };
    int rc;

    memset(cfg, 0, sizeof(*cfg));
    cfg->epochs = 3;
    cfg->batch = 64;
    cfg->lr = 0.02;
    cfg->momentum = 0.9;
    cfg->hidden.n = 1;
    cfg->hidden.v[0] = 256;
    cfg->seed = 1;
    cfg->mode = WEFT_PS_SYNC;
    cfg->staleness = 2;
    cfg->chunk_bytes = 64 * 1024;
    cfg->target = 0.85;
    cfg->threads = 1;
    cfg->data_dir = mnist_default_dir();
    rc = ex_parse_opts(PROG, argc, argv, opts, sizeof(opts) / sizeof(opts[0]), usage);
    if (rc != 0) {
        return rc;
    }
    if (cfg->nesterov && cfg->momentum == 0.0) {
        fprintf(stderr, PROG ": --nesterov needs a momentum above 0\n");
        return EXIT_USAGE;
    }
    if (cfg->staleness_set && cfg->mode != WEFT_PS_BOUNDED) {
        fprintf(stderr, PROG ": --staleness is for --mode bounded\n");
        return EXIT_USAGE;
    }
    if (cfg->checkpoint_every > 0 && cfg->checkpoint_dir == NULL) {
        fprintf(stderr, PROG ": --checkpoint-every needs --checkpoint-dir\n");
        return EXIT_USAGE;
    }
    if (cfg->checkpoint_seconds > 0 && cfg->checkpoint_dir == NULL) {
        fprintf(stderr, PROG ": --checkpoint-seconds needs --checkpoint-dir\n");
        return EXIT_USAGE;
    }
    return 0;
}

/* ------------------------------------------------------------------ tables */

typedef struct {
    int n_sizes;
    int64_t sizes[EX_MAX_LAYERS + 1];
    int n;                          /* tables: weight and bias of each layer */
    char names[MAX_PARAMS][32];     /* weft_nn_mlp's parameter names */
    weft_ps_table_t *t[MAX_PARAMS]; /* owned by the PS */
} tables_t;

static void layer_sizes(const config_t *cfg, int64_t inputs, tables_t *tb)
{
    memset(tb, 0, sizeof(*tb));
    tb->n_sizes = ex_mlp_sizes(&cfg->hidden, inputs, NCLASS, tb->sizes);
    tb->n = 2 * (tb->n_sizes - 1);
}

/* Every rank, in the same order: fc<l>.weight [out, in] and fc<l>.bias [out], both initialised
 * uniform(-1/sqrt(in), 1/sqrt(in)) by the servers (torch's nn.Linear distribution). */
static int tables_create(weft_ps_t *ps, const config_t *cfg, tables_t *tb)
{
    for (int i = 0; i < tb->n; i++) {
        weft_ps_table_spec_t spec;

        ex_linear_name(i, tb->names[i], sizeof(tb->names[i]));
        ex_ps_linear_spec(tb->sizes, i, tb->names[i], &spec);
        spec.seed = cfg->seed;
        spec.optimizer = WEFT_PS_SGD;
        spec.sgd.lr = cfg->lr;
        spec.sgd.momentum = cfg->momentum;
        spec.sgd.nesterov = cfg->nesterov;
        spec.sgd.weight_decay = cfg->weight_decay;
        spec.consistency = cfg->mode;
        spec.staleness = cfg->mode == WEFT_PS_BOUNDED ? cfg->staleness : 0;
        spec.chunk_bytes = (uint64_t)cfg->chunk_bytes;
        if (ex_ps_table_create(PROG, ps, &spec, &tb->t[i]) != 0) {
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ model */

/*
 * A worker's copy of the MLP (weft_nn_mlp: Linear layers with ReLU between them), whose
 * parameters the pulls overwrite, and its gradients, which live in one flat buffer: each
 * parameter's gradient is a tensor over a region of it (weft_tensor_set_grad), and those region
 * tensors are what the worker pushes.
 */
typedef struct {
    weft_nn_mlp_t *mlp;
    const weft_param_list_t *params; /* borrowed from the MLP */
    int n;
    int64_t numel;
    weft_tensor_t *grad;
    weft_tensor_t *grads[MAX_PARAMS]; /* regions of grad */
} model_t;

static void model_free(model_t *m)
{
    for (int i = 0; i < m->n; i++) {
        weft_tensor_release(m->grads[i]);
    }
    weft_nn_mlp_free(m->mlp);
    weft_tensor_release(m->grad);
    memset(m, 0, sizeof(*m));
}

static weft_status_t model_init(model_t *m, const config_t *cfg, const tables_t *tb)
{
    int64_t off = 0;
    weft_status_t st;

    memset(m, 0, sizeof(*m));
    st = ex_mlp_for_tables(PROG, tb->n_sizes, tb->sizes, cfg->seed, &m->mlp);
    if (st != WEFT_OK) {
        return st;
    }
    m->params = weft_nn_mlp_params(m->mlp);
    m->n = weft_param_list_size(m->params);
    m->numel = weft_param_list_numel(m->params);
    st = weft_tensor_create(WEFT_F32, 1, &m->numel, &m->grad);
    for (int i = 0; st == WEFT_OK && i < m->n; i++) {
        weft_tensor_t *p = weft_param_list_get(m->params, i);

        /* The region is borrowed from m->grad, which outlives the parameters' use of it. */
        st = weft_tensor_wrap(WEFT_F32, weft_tensor_ndim(p), weft_tensor_shape(p),
                              (float *)weft_tensor_data(m->grad) + off, weft_tensor_nbytes(p),
                              WEFT_CPU, NULL, NULL, &m->grads[i]);
        if (st == WEFT_OK) {
            st = weft_tensor_set_grad(p, m->grads[i]);
        }
        off += weft_tensor_numel(p);
    }
    if (st != WEFT_OK) {
        model_free(m);
    }
    return st;
}

/* ------------------------------------------------------------------ train */

typedef struct {
    const config_t *cfg;
    weft_ps_t *ps;
    weft_pg_t *wpg; /* the workers, group rank = worker index */
    tables_t *tb;
    int w;  /* worker index */
    int nw; /* workers */
    const mnist_set_t *train;
    const mnist_set_t *test;
    int64_t used;
    int64_t steps; /* per epoch */
    uint64_t hist[WEFT_PS_STALENESS_BUCKETS];
} job_t;

static void fail(const char *what, weft_status_t st)
{
    ex_fail(PROG, what, st);
}

static int wait_all(weft_future_t **fs, int n, const char *what)
{
    return ex_wait_all(PROG, fs, n, what);
}

/* Every table into the model's parameters, all pulls in flight at once. */
static int pull_all(const job_t *job, const model_t *m)
{
    weft_future_t *fs[MAX_PARAMS];
    int n = 0;
    int rc;

    for (int i = 0; i < m->n; i++) {
        weft_status_t st =
            weft_ps_pull_async(job->tb->t[i], weft_param_list_get(m->params, i), 0, &fs[n]);

        if (st != WEFT_OK) {
            fail("pull", st);
            wait_all(fs, n, "pull");
            return -1;
        }
        n++;
    }
    rc = wait_all(fs, n, "pull");
    return rc;
}

/* Every gradient to its table, all pushes in flight at once; returns once they are counted. */
static int push_all(const job_t *job, const model_t *m)
{
    weft_future_t *fs[MAX_PARAMS];
    int n = 0;

    for (int i = 0; i < m->n; i++) {
        weft_status_t st = weft_ps_push_async(job->tb->t[i], m->grads[i], 0, &fs[n]);

        if (st != WEFT_OK) {
            fail("push", st);
            wait_all(fs, n, "push");
            return -1;
        }
        n++;
    }
    return wait_all(fs, n, "push");
}

/* Test accuracy over all workers: each scores images w, w + W, ... */
static int evaluate(const job_t *job, const model_t *m, double *acc_p)
{
    weft_status_t st = mnist_accuracy(job->test, m->mlp, job->w, job->nw, job->wpg, acc_p);
    if (st != WEFT_OK) {
        fail("evaluate", st);
        return -1;
    }
    return 0;
}

/* The workers meet, pull the parameters (then the same on every worker, whatever the mode)
 * and score them. */
static int sync_and_evaluate(const job_t *job, const model_t *m, double *acc_p)
{
    weft_status_t st = weft_coll_barrier(job->wpg, NULL);

    if (st != WEFT_OK) {
        fail("barrier", st);
        return -1;
    }
    if (pull_all(job, m) != 0) {
        return -1;
    }
    return evaluate(job, m, acc_p);
}

/* The pulls' staleness since the last call, over every table and server: mean and max. */
static int staleness_since(job_t *job, double *mean_p, int *max_p, uint64_t *pulls_p)
{
    uint64_t now[WEFT_PS_STALENESS_BUCKETS] = {0};
    size_t ns = weft_ps_num_servers(job->ps);
    weft_ps_load_t *loads = calloc(ns, sizeof(*loads));
    uint64_t pulls = 0;
    double sum = 0;
    int max = 0;

    if (loads == NULL) {
        return -1;
    }
    for (int i = 0; i < job->tb->n; i++) {
        weft_status_t st = weft_ps_table_stats(job->tb->t[i], loads, 0);

        if (st != WEFT_OK) {
            fail("stats", st);
            free(loads);
            return -1;
        }
        for (size_t s = 0; s < ns; s++) {
            for (int b = 0; b < WEFT_PS_STALENESS_BUCKETS; b++) {
                now[b] += loads[s].staleness[b];
            }
        }
    }
    free(loads);
    for (int b = 0; b < WEFT_PS_STALENESS_BUCKETS; b++) {
        uint64_t d = now[b] - job->hist[b];

        pulls += d;
        sum += (double)b * (double)d;
        if (d > 0) {
            max = b;
        }
        job->hist[b] = now[b];
    }
    *mean_p = pulls > 0 ? sum / (double)pulls : 0.0;
    *max_p = max;
    *pulls_p = pulls;
    return 0;
}

/* What a checkpoint's step means: the sharding of the training set. */
static void meta_text(const job_t *job, char *buf, size_t n)
{
    snprintf(buf, n, "batch %d samples %lld workers %d seed %llu\n", job->cfg->batch,
             (long long)job->used, job->nw, (unsigned long long)job->cfg->seed);
}

static int meta_write(const job_t *job, const char *dir)
{
    char path[4096];
    char tmp[4096];
    char text[256];
    FILE *f;

    meta_text(job, text, sizeof(text));
    snprintf(path, sizeof(path), "%s/" META_FILE, dir);
    snprintf(tmp, sizeof(tmp), "%s/" META_FILE ".tmp", dir);
    f = fopen(tmp, "w");
    if (f == NULL || fputs(text, f) == EOF || fclose(f) != 0 || rename(tmp, path) != 0) {
        fprintf(stderr, PROG ": %s: %s\n", path, strerror(errno));
        return -1;
    }
    return 0;
}

/* 0 if @p dir's checkpoint was written with this sharding (or says nothing), -1 otherwise. */
static int meta_check(const job_t *job, const char *dir)
{
    char path[4096];
    char want[256];
    char have[256] = "";
    FILE *f;

    meta_text(job, want, sizeof(want));
    snprintf(path, sizeof(path), "%s/" META_FILE, dir);
    f = fopen(path, "r");
    if (f == NULL) {
        if (job->w == 0) {
            fprintf(stderr,
                    PROG ": no %s: assuming the same --batch, --limit, --seed and "
                         "workers as the run that wrote the checkpoint\n",
                    path);
        }
        return 0;
    }
    if (fgets(have, sizeof(have), f) == NULL) {
        have[0] = '\0';
    }
    fclose(f);
    if (strcmp(have, want) != 0) {
        have[strcspn(have, "\n")] = '\0';
        want[strcspn(want, "\n")] = '\0';
        fprintf(stderr, PROG ": the checkpoint in %s was written with %s, this run has %s\n", dir,
                have, want);
        return -1;
    }
    return 0;
}

static int checkpoint(const job_t *job, int64_t step)
{
    const char *dir = job->cfg->checkpoint_dir;
    double t0 = ex_now();
    weft_status_t st = weft_ps_save(job->ps, dir, 0);

    if (st != WEFT_OK) {
        fail("checkpoint", st);
        return -1;
    }
    if (job->w == 0) {
        if (meta_write(job, dir) != 0) {
            return -1;
        }
        printf("checkpoint at step %lld in %s (%.2f s)\n", (long long)step, dir, ex_now() - t0);
    }
    return 0;
}

/*
 * --checkpoint-seconds T: when a checkpoint is due by time. weft_ps_save is collective over the
 * workers, so they must all checkpoint after the same step, and their clocks do not agree on when
 * T seconds have passed: worker 0's clock decides, and the workers' group carries its decision.
 * After every step each worker issues one broadcast from worker 0 (asynchronous: it travels while
 * the next steps run), in which worker 0 sends the number of checkpoints written so far if T
 * seconds have passed since the last one ended (or since training started), else -1. The
 * broadcast issued after step k is waited for after step k + lag, and every worker checkpoints
 * there if it names the number of checkpoints written so far (one written meanwhile, by
 * --checkpoint-every, makes it stale rather than doubling it). Every worker issues the same
 * broadcasts in the same order, one per step, and a group runs its operations in the order they
 * were issued, so all take the same decision after the same step, and none waits for a broadcast
 * that another does not issue. The lag is how far a worker may run ahead of the slowest before a
 * decision holds it back: 1 step in sync mode (the workers are in step anyway), the staleness
 * bound + 1 in bounded mode, CK_LAG_MAX at most (async mode); a checkpoint comes that many steps
 * after T.
 */
typedef struct {
    double seconds; /* 0: off */
    int lag;
    int lead;        /* worker 0, whose clock decides */
    double last;     /* worker 0: when the last checkpoint ended, or training started */
    int64_t written; /* checkpoints written so far, by time or by step */
    int64_t asked;   /* worker 0: the count it last asked a checkpoint for; -1: none */
    int head;        /* the oldest broadcast in flight */
    int pending;     /* broadcasts in flight */
    weft_tensor_t *msg[CK_LAG_MAX]; /* i64 [1] each */
    weft_future_t *work[CK_LAG_MAX];
} ck_timer_t;

static void ck_timer_free(ck_timer_t *ck)
{
    for (; ck->pending > 0; ck->pending--, ck->head = (ck->head + 1) % ck->lag) {
        /* The tensor is borrowed by the broadcast until it completes (by its deadline). */
        weft_future_wait(ck->work[ck->head], 0);
        weft_future_release(ck->work[ck->head]);
    }
    for (int i = 0; i < CK_LAG_MAX; i++) {
        weft_tensor_release(ck->msg[i]);
    }
    memset(ck, 0, sizeof(*ck));
}

static int ck_timer_init(ck_timer_t *ck, const job_t *job)
{
    const config_t *cfg = job->cfg;
    int64_t one = 1;
    int64_t lag = cfg->mode == WEFT_PS_SYNC      ? 1
                  : cfg->mode == WEFT_PS_BOUNDED ? cfg->staleness + 1
                                                 : CK_LAG_MAX;

    memset(ck, 0, sizeof(*ck));
    ck->seconds = cfg->checkpoint_seconds;
    ck->lag = (int)(lag < CK_LAG_MAX ? lag : CK_LAG_MAX);
    ck->lead = job->w == 0;
    ck->last = ex_now();
    ck->asked = -1;
    for (int i = 0; ck->seconds > 0 && i < ck->lag; i++) {
        weft_status_t st = weft_tensor_create(WEFT_I64, 1, &one, &ck->msg[i]);

        if (st != WEFT_OK) {
            fail("checkpoint timer", st);
            ck_timer_free(ck);
            return -1;
        }
    }
    return 0;
}

/* Waits for the oldest decision in flight: @p due_p gets whether it asks for a checkpoint now. */
static int ck_timer_take(ck_timer_t *ck, int *due_p)
{
    int i = ck->head;
    weft_status_t st = weft_future_wait(ck->work[i], 0);

    if (st != WEFT_OK) {
        fprintf(stderr, PROG ": checkpoint timer: %s: %s\n", weft_status_name(st),
                weft_future_error(ck->work[i]));
    }
    weft_future_release(ck->work[i]);
    ck->head = (i + 1) % ck->lag;
    ck->pending--;
    if (st != WEFT_OK) {
        return -1;
    }
    *due_p = ((const int64_t *)weft_tensor_data(ck->msg[i]))[0] == ck->written;
    return 0;
}

/* After a step: whether worker 0's decision of lag steps ago asks for a checkpoint now. */
static int ck_timer_due(ck_timer_t *ck, int *due_p)
{
    *due_p = 0;
    if (ck->seconds == 0 || ck->pending < ck->lag) {
        return 0;
    }
    return ck_timer_take(ck, due_p);
}

/* After a step's checkpoint, if any: worker 0's decision goes out. */
static int ck_timer_post(ck_timer_t *ck, const job_t *job)
{
    int i = (ck->head + ck->pending) % ck->lag;
    int64_t *v;
    weft_status_t st;

    if (ck->seconds == 0) {
        return 0;
    }
    v = weft_tensor_data(ck->msg[i]);
    *v = -1;
    if (ck->lead && ck->asked != ck->written && ex_now() - ck->last >= ck->seconds) {
        *v = ck->written;
        ck->asked = ck->written;
    }
    st = weft_coll_broadcast(job->wpg, ck->msg[i], 0, &ck->work[i]);
    if (st != WEFT_OK) {
        fail("checkpoint timer", st);
        return -1;
    }
    ck->pending++;
    return 0;
}

/* A checkpoint was written (after the same step on every worker). */
static void ck_timer_saved(ck_timer_t *ck)
{
    ck->written++;
    ck->last = ex_now();
}

/* The end of training: the decisions still in flight are waited for and dropped. */
static int ck_timer_drain(ck_timer_t *ck)
{
    while (ck->pending > 0) {
        int due = 0;

        if (ck_timer_take(ck, &due) != 0) {
            return -1;
        }
    }
    return 0;
}

static int train(job_t *job)
{
    const config_t *cfg = job->cfg;
    const int64_t shard_n = (job->used + job->nw - 1) / job->nw;
    const int64_t steps = job->steps;
    const int tty = isatty(STDOUT_FILENO);
    const int lead = job->w == 0;
    int64_t *perm = malloc((size_t)job->used * sizeof(*perm));
    int64_t *shard = malloc((size_t)shard_n * sizeof(*shard));
    model_t m;
    ck_timer_t ckt;
    int64_t clock0 = 0;
    int64_t last_saved = -1;
    double train_time = 0;
    double acc = 0;
    double loss_avg = 0;
    double stale_mean = 0;
    double stale_sum = 0;
    uint64_t stale_pulls = 0;
    int stale_max = 0;
    int64_t samples = 0;
    int64_t step_total = 0;
    int epochs_run = 0;
    int fresh = 0; /* the parameters were pulled at this clock already */
    int same = 0;
    uint64_t hash = 0;
    weft_status_t st;
    int rc = 1;

    memset(&ckt, 0, sizeof(ckt));
    memset(&m, 0, sizeof(m));
    if (perm == NULL || shard == NULL) {
        fprintf(stderr, PROG ": out of memory\n");
        goto out;
    }
    st = model_init(&m, cfg, job->tb);
    if (st != WEFT_OK) {
        fail("model", st);
        goto out;
    }
    if (lead) {
        ex_print_mlp(job->tb->n_sizes, job->tb->sizes);
        printf(" (%lld parameters) on %lld Fashion-MNIST images, %zu servers, %d workers, "
               "batch %d per worker, %s",
               (long long)m.numel, (long long)job->used, weft_ps_num_servers(job->ps), job->nw,
               cfg->batch, ex_mode_name(cfg->mode));
        if (cfg->mode == WEFT_PS_BOUNDED) {
            printf(" (staleness %lld)", (long long)cfg->staleness);
        }
        printf(", SGD lr %g momentum %g on the servers, %lld steps per epoch\n", cfg->lr,
               cfg->momentum, (long long)steps);
        for (int i = 0; i < job->tb->n; i++) {
            weft_ps_table_print_map(job->tb->t[i], stdout);
        }
    }
    if (cfg->resume_dir != NULL) {
        if (meta_check(job, cfg->resume_dir) != 0) {
            rc = EXIT_USAGE;
            goto out;
        }
        st = weft_ps_load(job->ps, cfg->resume_dir, 0);
        if (st != WEFT_OK) {
            fail("resume", st);
            rc = st == WEFT_ERR_NOT_FOUND || st == WEFT_ERR_MISMATCH ? EXIT_USAGE : 1;
            goto out;
        }
        clock0 = weft_ps_worker_clock(job->ps);
        last_saved = clock0;
        if (lead) {
            printf("resumed at step %lld from %s: continuing with epoch %lld, step %lld of %lld\n",
                   (long long)clock0, cfg->resume_dir, (long long)(clock0 / steps + 1),
                   (long long)(clock0 % steps + 1), (long long)steps);
            if (clock0 >= (int64_t)cfg->epochs * steps) {
                printf("nothing left to train for --epochs %d\n", cfg->epochs);
            }
        }
    }
    if (ck_timer_init(&ckt, job) != 0) {
        goto out;
    }

    for (int epoch = (int)(clock0 / steps); epoch < cfg->epochs; epoch++) {
        double t_epoch = 0;
        double loss_sum = 0;
        int64_t loss_n = 0;
        uint64_t pulls = 0;

        mnist_epoch_shard(cfg->seed, epoch, job->used, job->w, job->nw, perm, shard, shard_n);
        for (int64_t s = epoch == clock0 / steps ? clock0 % steps : 0; s < steps; s++) {
            int64_t k = s + 1 < steps ? cfg->batch : shard_n - s * cfg->batch;
            int64_t clock;
            int due = 0; /* a checkpoint after this step */
            double loss = 0;
            double t0 = ex_now();

            if (!fresh && pull_all(job, &m) != 0) {
                goto out;
            }
            fresh = 0;
            memset(weft_tensor_data(m.grad), 0, weft_tensor_nbytes(m.grad));
            st = mnist_loss_backward(job->train, m.mlp, shard + s * cfg->batch, k, NULL, &loss);
            if (st != WEFT_OK) {
                fail("training step", st);
                goto out;
            }
            loss_sum += loss;
            loss_n++;
            if (push_all(job, &m) != 0) {
                goto out;
            }
            st = weft_ps_clock(job->ps, 0);
            if (st != WEFT_OK) {
                fail("clock", st);
                goto out;
            }
            t_epoch += ex_now() - t0;
            samples += k * job->nw;
            step_total++;
            clock = weft_ps_worker_clock(job->ps);
            if (lead &&
                (tty || (s + 1) % (steps / 10 > 0 ? steps / 10 : 1) == 0 || s + 1 == steps)) {
                ex_progress(epoch, cfg->epochs, s, steps, loss_sum / (double)loss_n,
                            (double)samples / (train_time + t_epoch), tty);
            }
            if (ck_timer_due(&ckt, &due) != 0) {
                goto out;
            }
            if (cfg->checkpoint_every > 0) {
                due = due || clock % cfg->checkpoint_every == 0;
            } else if (cfg->checkpoint_seconds == 0) {
                due = s + 1 == steps; /* neither option: at the end of each epoch */
            }
            if (cfg->checkpoint_dir != NULL && due) {
                if (lead && tty) {
                    printf("\n");
                }
                if (checkpoint(job, clock) != 0) {
                    goto out;
                }
                last_saved = clock;
                ck_timer_saved(&ckt);
            }
            if (ck_timer_post(&ckt, job) != 0) {
                goto out;
            }
            if (cfg->eval_every > 0 && clock % cfg->eval_every == 0 && s + 1 < steps) {
                /* Between epochs too (the training clock stops meanwhile): the workers meet,
                 * pull and score, then go on from the same parameters. */
                double mid = 0;
                if (sync_and_evaluate(job, &m, &mid) != 0) {
                    goto out;
                }
                fresh = 1;
                if (lead) {
                    printf("%sstep %lld: test accuracy %.2f%%, training %.3f s\n", tty ? "\n" : "",
                           (long long)clock, 100.0 * mid, train_time + t_epoch);
                }
            }
        }
        train_time += t_epoch;
        loss_avg = loss_n > 0 ? loss_sum / (double)loss_n : 0;
        epochs_run++;
        if (sync_and_evaluate(job, &m, &acc) != 0) {
            goto out;
        }
        fresh = 1;
        if (lead) {
            if (staleness_since(job, &stale_mean, &stale_max, &pulls) != 0) {
                goto out;
            }
            stale_sum += stale_mean * (double)pulls;
            stale_pulls += pulls;
            printf("%sepoch %d: train loss %.4f, test accuracy %.2f%%, %.1f s, %.0f samples/s, "
                   "staleness mean %.2f max %d%s\n",
                   tty ? "\n" : "", epoch + 1, loss_avg, 100.0 * acc, t_epoch,
                   train_time > 0 ? (double)samples / train_time : 0.0, stale_mean, stale_max,
                   stale_max == WEFT_PS_STALENESS_BUCKETS - 1 ? "+" : "");
        }
    }
    if (ck_timer_drain(&ckt) != 0) {
        goto out;
    }
    if (epochs_run == 0 && sync_and_evaluate(job, &m, &acc) != 0) {
        goto out; /* nothing left to train: score the checkpoint */
    }
    if (cfg->checkpoint_dir != NULL && last_saved != weft_ps_worker_clock(job->ps)) {
        if (checkpoint(job, weft_ps_worker_clock(job->ps)) != 0) {
            goto out;
        }
    }
    if (ex_params_identical(PROG, job->wpg, m.params, &same, &hash) != 0) {
        goto out;
    }
    if (lead) {
        double rate = train_time > 0 ? (double)samples / train_time : 0.0;

        printf("final test accuracy %.2f%%; %s %.0f%% after %lld steps (%s, %.0f samples/s)\n",
               100.0 * acc, acc >= cfg->target ? "reached" : "did not reach", 100.0 * cfg->target,
               (long long)weft_ps_worker_clock(job->ps), ex_mode_name(cfg->mode), rate);
        printf("parameters bit-identical on all %d workers (fnv1a64 %016llx)\n", job->nw,
               (unsigned long long)hash);
        if (!same) {
            printf("parameters DIFFER between the workers\n");
        }
        if (cfg->verbose) {
            st = weft_ps_print_stats(job->ps, stdout, 0);
            if (st != WEFT_OK) {
                fail("stats", st);
                goto out;
            }
        }
        if (cfg->json) {
            printf("{\"system\":\"weft-ps\",\"mode\":\"%s\",\"servers\":%zu,\"workers\":%d,"
                   "\"batch\":%d,\"lr\":%g,\"momentum\":%g,\"hidden\":%lld,\"epochs_run\":%d,"
                   "\"steps\":%lld,\"samples_per_s\":%.1f,\"final_acc\":%.4f,"
                   "\"train_loss\":%.4f,\"staleness_mean\":%.3f,\"params_identical\":%s}\n",
                   ex_mode_name(cfg->mode), weft_ps_num_servers(job->ps), job->nw, cfg->batch,
                   cfg->lr, cfg->momentum, (long long)cfg->hidden.v[0], epochs_run,
                   (long long)step_total, rate, acc, loss_avg,
                   stale_pulls > 0 ? stale_sum / (double)stale_pulls : 0.0,
                   same ? "true" : "false");
        }
    }
    rc = same ? 0 : 1;

out:
    ck_timer_free(&ckt);
    model_free(&m);
    free(perm);
    free(shard);
    return rc;
}

/* ----------------------------------------------------------------- main */

int main(int argc, char **argv)
{
    config_t cfg;
    mnist_set_t train_set = {0};
    mnist_set_t test_set = {0};
    weft_agent_t *a = NULL;
    weft_ps_t *ps = NULL;
    weft_pg_t *wpg = NULL;
    tables_t tb;
    job_t job;
    int rc;

    setvbuf(stdout, NULL, _IOLBF, 0);
    rc = parse_args(argc, argv, &cfg);
    if (rc != 0) {
        return rc == 1 ? 0 : rc;
    }
    weft_op_set_threads(cfg.threads);
    /* Data first, on every rank: a missing or corrupt file ends the run before any rank waits
     * for it. The servers do not keep it. */
    if (mnist_load_splits(PROG, cfg.data_dir, &train_set, &test_set) != 0) {
        return EXIT_USAGE;
    }
    layer_sizes(&cfg, (int64_t)train_set.rows * train_set.cols, &tb);

    if (ex_ps_start(PROG, &a, &ps) != 0) {
        rc = 1;
        goto out;
    }
    if (!weft_ps_is_worker(ps)) {
        mnist_free(&train_set);
        mnist_free(&test_set);
    }
    rc = 1;
    if (ex_ps_workers_group(PROG, a, ps, &wpg) != 0 || tables_create(ps, &cfg, &tb) != 0) {
        goto out_shutdown;
    }
    rc = 0;
    if (weft_ps_is_worker(ps)) {
        memset(&job, 0, sizeof(job));
        job.cfg = &cfg;
        job.ps = ps;
        job.wpg = wpg;
        job.tb = &tb;
        job.w = weft_ps_worker_index(ps);
        job.nw = (int)weft_ps_num_workers(ps);
        job.train = &train_set;
        job.test = &test_set;
        job.used = cfg.limit > 0 && cfg.limit < train_set.count ? cfg.limit : train_set.count;
        job.steps = ((job.used + job.nw - 1) / job.nw + cfg.batch - 1) / cfg.batch;
        rc = train(&job);
    }
    rc = ex_ps_finish(PROG, ps, rc);

out_shutdown:
    weft_pg_free(wpg);
    rc = ex_agent_shutdown(PROG, a, rc);
out:
    weft_agent_free(a);
    mnist_free(&train_set);
    mnist_free(&test_set);
    return rc;
}
