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
 * Checkpoints: with --checkpoint-dir every worker calls weft_ps_save after the same step (every
 * --checkpoint-every steps, else at the end of each epoch, and at the end of training). --resume
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
#include <getopt.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <weft/weft.h>

#include "mnist.h"

#define DEFAULT_DATA_DIR    "/usr/share/datasets/fashion-mnist"
#define NCLASS              MNIST_CLASSES
#define MAX_LAYERS          8
#define MAX_PARAMS          (2 * MAX_LAYERS)
#define SHUTDOWN_TIMEOUT_MS 30000
#define EXIT_USAGE          2
#define META_FILE           "ps_train.meta"

/* ---------------------------------------------------------- configuration */

typedef struct {
    int epochs;
    int batch; /* per worker */
    double lr;
    double momentum;
    double weight_decay;
    int nesterov;
    int n_hidden;
    int64_t hidden[MAX_LAYERS];
    uint64_t seed;
    int64_t limit; /* 0: all training samples */
    weft_ps_consistency_t mode;
    int64_t staleness;
    int staleness_set;
    int64_t chunk_bytes;
    const char *checkpoint_dir;
    int64_t checkpoint_every; /* steps; 0: at the end of each epoch */
    int64_t eval_every;       /* steps; 0: after each epoch only */
    const char *resume_dir;
    double target;
    int json;
    int verbose;
    int threads;
    const char *data_dir;
} config_t;

static const char *mode_name(weft_ps_consistency_t mode)
{
    return mode == WEFT_PS_SYNC ? "sync" : mode == WEFT_PS_ASYNC ? "async" : "bounded";
}

static void usage(FILE *out)
{
    fprintf(out,
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
            "  --checkpoint-every N  steps between checkpoints (default: each epoch's end)\n"
            "  --resume D         go on from the checkpoint in D until --epochs\n"
            "  --target X         test accuracy the final line compares with (default 0.85)\n"
            "  --eval-every N     also measure test accuracy every N steps (default: per epoch)\n"
            "  --threads N        BLAS threads per worker (default 1)\n"
            "  --json             print a JSON summary line at the end (first worker)\n"
            "  --verbose          print the servers' counters at the end\n"
            "  --data DIR         Fashion-MNIST IDX files (default $WEFT_DATA_DIR, else\n"
            "                     " DEFAULT_DATA_DIR ")\n");
}

static int parse_hidden(const char *s, config_t *cfg)
{
    char buf[256];
    char *save = NULL;
    int n = 0;

    if (strlen(s) >= sizeof(buf)) {
        return -1;
    }
    strcpy(buf, s);
    for (char *tok = strtok_r(buf, ",", &save); tok != NULL; tok = strtok_r(NULL, ",", &save)) {
        if (n == MAX_LAYERS - 1 || parse_int_arg(tok, 1, 1 << 16, &cfg->hidden[n]) != 0) {
            return -1;
        }
        n++;
    }
    if (n == 0) {
        return -1;
    }
    cfg->n_hidden = n;
    return 0;
}

static int parse_mode(const char *s, weft_ps_consistency_t *mode_p)
{
    if (strcmp(s, "sync") == 0) {
        *mode_p = WEFT_PS_SYNC;
    } else if (strcmp(s, "async") == 0) {
        *mode_p = WEFT_PS_ASYNC;
    } else if (strcmp(s, "bounded") == 0) {
        *mode_p = WEFT_PS_BOUNDED;
    } else {
        return -1;
    }
    return 0;
}

/* Returns 0, 1 after --help, or EXIT_USAGE after a message. */
static int parse_args(int argc, char **argv, config_t *cfg)
{
    static const struct option longopts[] = {
        {"epochs", required_argument, NULL, 'e'},
        {"batch", required_argument, NULL, 'b'},
        {"lr", required_argument, NULL, 'l'},
        {"momentum", required_argument, NULL, 'm'},
        {"nesterov", no_argument, NULL, 'N'},
        {"weight-decay", required_argument, NULL, 'w'},
        {"hidden", required_argument, NULL, 'H'},
        {"seed", required_argument, NULL, 's'},
        {"limit", required_argument, NULL, 'n'},
        {"mode", required_argument, NULL, 'M'},
        {"staleness", required_argument, NULL, 'A'},
        {"chunk-bytes", required_argument, NULL, 'C'},
        {"checkpoint-dir", required_argument, NULL, 'c'},
        {"checkpoint-every", required_argument, NULL, 'k'},
        {"resume", required_argument, NULL, 'r'},
        {"target", required_argument, NULL, 't'},
        {"eval-every", required_argument, NULL, 'E'},
        {"threads", required_argument, NULL, 'T'},
        {"json", no_argument, NULL, 'j'},
        {"verbose", no_argument, NULL, 'v'},
        {"data", required_argument, NULL, 'd'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *env = weft_config_str("WEFT_DATA_DIR"); /* its default is DEFAULT_DATA_DIR */
    int64_t iv = 0;
    int index = 0;
    int c;

    memset(cfg, 0, sizeof(*cfg));
    cfg->epochs = 3;
    cfg->batch = 64;
    cfg->lr = 0.02;
    cfg->momentum = 0.9;
    cfg->n_hidden = 1;
    cfg->hidden[0] = 256;
    cfg->seed = 1;
    cfg->mode = WEFT_PS_SYNC;
    cfg->staleness = 2;
    cfg->chunk_bytes = 64 * 1024;
    cfg->target = 0.85;
    cfg->threads = 1;
    cfg->data_dir = env != NULL && *env != '\0' ? env : DEFAULT_DATA_DIR;

    while ((c = getopt_long(argc, argv, "h", longopts, &index)) != -1) {
        int bad = 0;
        switch (c) {
        case 'e':
            bad = parse_int_arg(optarg, 1, 100000, &iv);
            cfg->epochs = (int)iv;
            break;
        case 'b':
            bad = parse_int_arg(optarg, 1, 1 << 20, &iv);
            cfg->batch = (int)iv;
            break;
        case 'l':
            bad = parse_double_arg(optarg, 0.0, 1e6, &cfg->lr);
            break;
        case 'm':
            bad = parse_double_arg(optarg, 0.0, 0.999999, &cfg->momentum);
            break;
        case 'N':
            cfg->nesterov = 1;
            break;
        case 'w':
            bad = parse_double_arg(optarg, 0.0, 1e6, &cfg->weight_decay);
            break;
        case 'H':
            bad = parse_hidden(optarg, cfg);
            break;
        case 's':
            bad = parse_int_arg(optarg, 0, INT64_MAX, &iv);
            cfg->seed = (uint64_t)iv;
            break;
        case 'n':
            bad = parse_int_arg(optarg, 1, INT64_MAX, &cfg->limit);
            break;
        case 'M':
            bad = parse_mode(optarg, &cfg->mode);
            break;
        case 'A':
            bad = parse_int_arg(optarg, 0, 1000000, &cfg->staleness);
            cfg->staleness_set = 1;
            break;
        case 'C':
            bad = parse_int_arg(optarg, 4, INT32_MAX, &cfg->chunk_bytes);
            break;
        case 'c':
            cfg->checkpoint_dir = optarg;
            break;
        case 'k':
            bad = parse_int_arg(optarg, 1, INT64_MAX, &cfg->checkpoint_every);
            break;
        case 'r':
            cfg->resume_dir = optarg;
            break;
        case 't':
            bad = parse_double_arg(optarg, 0.0, 1.0, &cfg->target);
            break;
        case 'E':
            bad = parse_int_arg(optarg, 1, INT64_MAX, &cfg->eval_every);
            break;
        case 'T':
            bad = parse_int_arg(optarg, 1, 256, &iv);
            cfg->threads = (int)iv;
            break;
        case 'j':
            cfg->json = 1;
            break;
        case 'v':
            cfg->verbose = 1;
            break;
        case 'd':
            cfg->data_dir = optarg;
            break;
        case 'h':
            usage(stdout);
            return 1;
        default:
            usage(stderr);
            return EXIT_USAGE;
        }
        if (bad != 0) {
            fprintf(stderr, "ps_train: bad value '%s' for --%s\n", optarg, longopts[index].name);
            usage(stderr);
            return EXIT_USAGE;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "ps_train: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return EXIT_USAGE;
    }
    if (cfg->nesterov && cfg->momentum == 0.0) {
        fprintf(stderr, "ps_train: --nesterov needs a momentum above 0\n");
        return EXIT_USAGE;
    }
    if (cfg->staleness_set && cfg->mode != WEFT_PS_BOUNDED) {
        fprintf(stderr, "ps_train: --staleness is for --mode bounded\n");
        return EXIT_USAGE;
    }
    if (cfg->checkpoint_every > 0 && cfg->checkpoint_dir == NULL) {
        fprintf(stderr, "ps_train: --checkpoint-every needs --checkpoint-dir\n");
        return EXIT_USAGE;
    }
    return 0;
}

/* ------------------------------------------------------------------ tables */

typedef struct {
    int n_sizes;
    int64_t sizes[MAX_LAYERS + 1];
    int n;                          /* tables: weight and bias of each layer */
    char names[MAX_PARAMS][32];     /* weft_nn_mlp's parameter names */
    weft_ps_table_t *t[MAX_PARAMS]; /* owned by the PS */
} tables_t;

static void layer_sizes(const config_t *cfg, int64_t inputs, tables_t *tb)
{
    memset(tb, 0, sizeof(*tb));
    tb->n_sizes = cfg->n_hidden + 2;
    tb->sizes[0] = inputs;
    for (int l = 0; l < cfg->n_hidden; l++) {
        tb->sizes[l + 1] = cfg->hidden[l];
    }
    tb->sizes[tb->n_sizes - 1] = NCLASS;
    tb->n = 2 * (tb->n_sizes - 1);
}

/* Every rank, in the same order: fc<l>.weight [out, in] and fc<l>.bias [out], both initialised
 * uniform(-1/sqrt(in), 1/sqrt(in)) by the servers (torch's nn.Linear distribution). */
static int tables_create(weft_ps_t *ps, const config_t *cfg, tables_t *tb)
{
    for (int i = 0; i < tb->n; i++) {
        int l = i / 2;
        double bound = 1.0 / sqrt((double)tb->sizes[l]);
        weft_ps_table_spec_t spec;
        weft_status_t st;

        snprintf(tb->names[i], sizeof(tb->names[i]), "fc%d.%s", l + 1,
                 i % 2 == 0 ? "weight" : "bias");
        weft_ps_table_spec_init(&spec, tb->names[i], WEFT_PS_DENSE);
        if (i % 2 == 0) {
            spec.ndim = 2;
            spec.shape[0] = tb->sizes[l + 1];
            spec.shape[1] = tb->sizes[l];
        } else {
            spec.ndim = 1;
            spec.shape[0] = tb->sizes[l + 1];
        }
        spec.init = WEFT_PS_UNIFORM;
        spec.init_a = -bound;
        spec.init_b = bound;
        spec.seed = cfg->seed;
        spec.optimizer = WEFT_PS_SGD;
        spec.sgd.lr = cfg->lr;
        spec.sgd.momentum = cfg->momentum;
        spec.sgd.nesterov = cfg->nesterov;
        spec.sgd.weight_decay = cfg->weight_decay;
        spec.consistency = cfg->mode;
        spec.staleness = cfg->mode == WEFT_PS_BOUNDED ? cfg->staleness : 0;
        spec.chunk_bytes = (uint64_t)cfg->chunk_bytes;
        st = weft_ps_table_create(ps, &spec, 0, &tb->t[i]);
        if (st != WEFT_OK) {
            fprintf(stderr, "ps_train: table %s: %s: %s\n", tb->names[i], weft_status_name(st),
                    weft_last_error());
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
    weft_rng_t rng;
    int64_t off = 0;
    weft_status_t st;

    memset(m, 0, sizeof(*m));
    weft_rng_init(&rng, cfg->seed, 0);
    st = weft_nn_mlp_create(tb->n_sizes, tb->sizes, NULL, &rng, &m->mlp);
    if (st != WEFT_OK) {
        return st;
    }
    m->params = weft_nn_mlp_params(m->mlp);
    m->n = weft_param_list_size(m->params);
    m->numel = weft_param_list_numel(m->params);
    if (m->n != tb->n) {
        fprintf(stderr, "ps_train: the MLP has %d parameters, the tables are %d\n", m->n, tb->n);
        model_free(m);
        return WEFT_ERR_INVALID_STATE;
    }
    st = weft_tensor_create(WEFT_F32, 1, &m->numel, &m->grad);
    for (int i = 0; st == WEFT_OK && i < m->n; i++) {
        weft_tensor_t *p = weft_param_list_get(m->params, i);

        if (strcmp(weft_param_list_name(m->params, i), tb->names[i]) != 0) {
            fprintf(stderr, "ps_train: parameter %d is %s, its table %s\n", i,
                    weft_param_list_name(m->params, i), tb->names[i]);
            st = WEFT_ERR_INVALID_STATE;
            break;
        }
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

static uint64_t fnv1a(uint64_t h, const void *p, size_t n)
{
    const unsigned char *c = p;

    for (size_t i = 0; i < n; i++) {
        h = (h ^ c[i]) * 0x100000001b3ULL;
    }
    return h;
}

/* ------------------------------------------------------------------- data */

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

static double now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void fail(const char *what, weft_status_t st)
{
    fprintf(stderr, "ps_train: %s: %s: %s\n", what, weft_status_name(st), weft_last_error());
}

/* Waits for @p n futures and releases them; on a failure prints the first failed one's error. */
static int wait_all(weft_future_t **fs, int n, const char *what)
{
    weft_status_t st = weft_future_wait_all(fs, (size_t)n, 0);
    int rc = 0;

    for (int i = 0; i < n; i++) {
        weft_status_t fst = weft_future_status(fs[i]);

        if (rc == 0 && (st != WEFT_OK || fst != WEFT_OK)) {
            if (fst != WEFT_OK) {
                fprintf(stderr, "ps_train: %s: %s: %s\n", what, weft_status_name(fst),
                        weft_future_error(fs[i]));
                rc = -1;
            }
        }
        weft_future_release(fs[i]);
    }
    if (st != WEFT_OK && rc == 0) {
        fprintf(stderr, "ps_train: %s: %s\n", what, weft_status_name(st));
        rc = -1;
    }
    return rc;
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

static void progress(const job_t *job, int epoch, int64_t step, double loss, double rate, int tty)
{
    char bar[31];
    int fill = (int)(30 * (step + 1) / job->steps);

    for (int i = 0; i < 30; i++) {
        bar[i] = i < fill ? '#' : '.';
    }
    bar[30] = '\0';
    printf("%sepoch %d/%d [%s] %lld/%lld loss %.4f %.0f samples/s%s", tty ? "\r" : "", epoch + 1,
           job->cfg->epochs, bar, (long long)(step + 1), (long long)job->steps, loss, rate,
           tty ? "" : "\n");
    fflush(stdout);
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
        fprintf(stderr, "ps_train: %s: %s\n", path, strerror(errno));
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
                    "ps_train: no %s: assuming the same --batch, --limit, --seed and "
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
        fprintf(stderr, "ps_train: the checkpoint in %s was written with %s, this run has %s\n",
                dir, have, want);
        return -1;
    }
    return 0;
}

static int checkpoint(const job_t *job, int64_t step)
{
    const char *dir = job->cfg->checkpoint_dir;
    double t0 = now_s();
    weft_status_t st = weft_ps_save(job->ps, dir, 0);

    if (st != WEFT_OK) {
        fail("checkpoint", st);
        return -1;
    }
    if (job->w == 0) {
        if (meta_write(job, dir) != 0) {
            return -1;
        }
        printf("checkpoint at step %lld in %s (%.2f s)\n", (long long)step, dir, now_s() - t0);
    }
    return 0;
}

/* Compares every worker's parameters with worker 0's, bit for bit. */
static int params_identical(const job_t *job, const model_t *m, int *same_p, uint64_t *hash_p)
{
    int64_t n = m->numel;
    int64_t one = 1;
    weft_tensor_t *mine = NULL;
    weft_tensor_t *copy = NULL;
    weft_tensor_t *flag = NULL;
    weft_status_t st;

    st = weft_tensor_empty(WEFT_F32, 1, &n, &mine);
    if (st == WEFT_OK) {
        st = weft_param_list_pack(m->params, mine);
    }
    if (st == WEFT_OK) {
        st = weft_tensor_clone(mine, &copy);
    }
    if (st == WEFT_OK) {
        st = weft_coll_broadcast(job->wpg, copy, 0, NULL);
    }
    if (st == WEFT_OK) {
        st = weft_tensor_create(WEFT_I32, 1, &one, &flag);
    }
    if (st == WEFT_OK) {
        ((int32_t *)weft_tensor_data(flag))[0] =
            memcmp(weft_tensor_data(copy), weft_tensor_data(mine), weft_tensor_nbytes(copy)) == 0;
        st = weft_coll_all_reduce(job->wpg, flag, WEFT_MIN, NULL);
    }
    if (st == WEFT_OK) {
        *same_p = ((int32_t *)weft_tensor_data(flag))[0];
        *hash_p = fnv1a(0xcbf29ce484222325ULL, weft_tensor_data(mine), weft_tensor_nbytes(mine));
    }
    weft_tensor_release(mine);
    weft_tensor_release(copy);
    weft_tensor_release(flag);
    if (st != WEFT_OK) {
        fail("parameter check", st);
        return -1;
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

    if (perm == NULL || shard == NULL) {
        fprintf(stderr, "ps_train: out of memory\n");
        free(perm);
        free(shard);
        return 1;
    }
    st = model_init(&m, cfg, job->tb);
    if (st != WEFT_OK) {
        fail("model", st);
        free(perm);
        free(shard);
        return 1;
    }
    if (lead) {
        printf("MLP %lld", (long long)job->tb->sizes[0]);
        for (int l = 1; l < job->tb->n_sizes; l++) {
            printf("-%lld", (long long)job->tb->sizes[l]);
        }
        printf(" (%lld parameters) on %lld Fashion-MNIST images, %zu servers, %d workers, "
               "batch %d per worker, %s",
               (long long)m.numel, (long long)job->used, weft_ps_num_servers(job->ps), job->nw,
               cfg->batch, mode_name(cfg->mode));
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

    for (int epoch = (int)(clock0 / steps); epoch < cfg->epochs; epoch++) {
        double t_epoch = 0;
        double loss_sum = 0;
        int64_t loss_n = 0;
        uint64_t pulls = 0;

        mnist_epoch_shard(cfg->seed, epoch, job->used, job->w, job->nw, perm, shard, shard_n);
        for (int64_t s = epoch == clock0 / steps ? clock0 % steps : 0; s < steps; s++) {
            int64_t k = s + 1 < steps ? cfg->batch : shard_n - s * cfg->batch;
            int64_t clock;
            weft_tensor_t *x = NULL;
            weft_tensor_t *y = NULL;
            weft_tensor_t *logits = NULL;
            weft_tensor_t *loss = NULL;
            double t0 = now_s();

            if (!fresh && pull_all(job, &m) != 0) {
                goto out;
            }
            fresh = 0;
            st = mnist_batch(job->train, shard + s * cfg->batch, k, &x, &y);
            if (st == WEFT_OK) {
                st = weft_nn_mlp_forward(m.mlp, x, &logits);
            }
            if (st == WEFT_OK) {
                st = weft_op_cross_entropy(logits, y, WEFT_REDUCTION_MEAN, &loss);
            }
            if (st == WEFT_OK) {
                memset(weft_tensor_data(m.grad), 0, weft_tensor_nbytes(m.grad));
                st = weft_backward(loss, NULL, 0);
            }
            if (st == WEFT_OK) {
                loss_sum += ((float *)weft_tensor_data(loss))[0];
                loss_n++;
            }
            weft_tensor_release(loss);
            weft_tensor_release(logits);
            weft_tensor_release(x);
            weft_tensor_release(y);
            if (st != WEFT_OK) {
                fail("training step", st);
                goto out;
            }
            if (push_all(job, &m) != 0) {
                goto out;
            }
            st = weft_ps_clock(job->ps, 0);
            if (st != WEFT_OK) {
                fail("clock", st);
                goto out;
            }
            t_epoch += now_s() - t0;
            samples += k * job->nw;
            step_total++;
            clock = weft_ps_worker_clock(job->ps);
            if (lead &&
                (tty || (s + 1) % (steps / 10 > 0 ? steps / 10 : 1) == 0 || s + 1 == steps)) {
                progress(job, epoch, s, loss_sum / (double)loss_n,
                         (double)samples / (train_time + t_epoch), tty);
            }
            if (cfg->checkpoint_dir != NULL &&
                (cfg->checkpoint_every > 0 ? clock % cfg->checkpoint_every == 0 : s + 1 == steps)) {
                if (lead && tty) {
                    printf("\n");
                }
                if (checkpoint(job, clock) != 0) {
                    goto out;
                }
                last_saved = clock;
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
    if (epochs_run == 0 && sync_and_evaluate(job, &m, &acc) != 0) {
        goto out; /* nothing left to train: score the checkpoint */
    }
    if (cfg->checkpoint_dir != NULL && last_saved != weft_ps_worker_clock(job->ps)) {
        if (checkpoint(job, weft_ps_worker_clock(job->ps)) != 0) {
            goto out;
        }
    }
    if (params_identical(job, &m, &same, &hash) != 0) {
        goto out;
    }
    if (lead) {
        double rate = train_time > 0 ? (double)samples / train_time : 0.0;

        printf("final test accuracy %.2f%%; %s %.0f%% after %lld steps (%s, %.0f samples/s)\n",
               100.0 * acc, acc >= cfg->target ? "reached" : "did not reach", 100.0 * cfg->target,
               (long long)weft_ps_worker_clock(job->ps), mode_name(cfg->mode), rate);
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
                   mode_name(cfg->mode), weft_ps_num_servers(job->ps), job->nw, cfg->batch, cfg->lr,
                   cfg->momentum, (long long)cfg->hidden[0], epochs_run, (long long)step_total,
                   rate, acc, loss_avg, stale_pulls > 0 ? stale_sum / (double)stale_pulls : 0.0,
                   same ? "true" : "false");
        }
    }
    rc = same ? 0 : 1;

out:
    model_free(&m);
    free(perm);
    free(shard);
    return rc;
}

/* ----------------------------------------------------------------- main */

/* The workers' ranks in worker order (every rank tells the world its worker index), and their
 * group. Every rank calls it. */
static int workers_group(weft_agent_t *a, weft_ps_t *ps, weft_pg_t **wpg_p)
{
    int world = weft_agent_world_size(a);
    int64_t one = 1;
    int64_t nworld = world;
    int *ranks = calloc((size_t)world, sizeof(*ranks));
    weft_pg_t *pg = NULL;
    weft_tensor_t *in = NULL;
    weft_tensor_t *out = NULL;
    int n = 0;
    weft_status_t st;

    if (ranks == NULL) {
        return -1;
    }
    st = weft_pg_world(a, &pg);
    if (st == WEFT_OK) {
        st = weft_tensor_create(WEFT_I32, 1, &one, &in);
    }
    if (st == WEFT_OK) {
        st = weft_tensor_create(WEFT_I32, 1, &nworld, &out);
    }
    if (st == WEFT_OK) {
        ((int32_t *)weft_tensor_data(in))[0] = weft_ps_worker_index(ps);
        st = weft_coll_all_gather(pg, in, out, NULL);
    }
    for (int r = 0; st == WEFT_OK && r < world; r++) {
        int32_t w = ((int32_t *)weft_tensor_data(out))[r];

        if (w >= 0 && w < world) {
            ranks[w] = r;
            n++;
        }
    }
    if (st == WEFT_OK && (size_t)n != weft_ps_num_workers(ps)) {
        fprintf(stderr, "ps_train: %d ranks say they work, the parameter server has %zu workers\n",
                n, weft_ps_num_workers(ps));
        st = WEFT_ERR_INVALID_STATE;
    }
    if (st == WEFT_OK) {
        st = weft_pg_new(a, ranks, n, wpg_p);
    }
    weft_tensor_release(in);
    weft_tensor_release(out);
    weft_pg_free(pg);
    free(ranks);
    if (st != WEFT_OK) {
        fail("the workers' group", st);
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    config_t cfg;
    mnist_set_t train_set = {0};
    mnist_set_t test_set = {0};
    weft_agent_opts_t opts;
    weft_ps_opts_t ps_opts;
    weft_agent_t *a = NULL;
    weft_ps_t *ps = NULL;
    weft_pg_t *wpg = NULL;
    tables_t tb;
    job_t job;
    weft_status_t st;
    int rc;

    setvbuf(stdout, NULL, _IOLBF, 0);
    rc = parse_args(argc, argv, &cfg);
    if (rc != 0) {
        return rc == 1 ? 0 : rc;
    }
    weft_op_set_threads(cfg.threads);
    /* Data first, on every rank: a missing or corrupt file ends the run before any rank waits
     * for it. The servers do not keep it. */
    if (mnist_load_splits("ps_train", cfg.data_dir, &train_set, &test_set) != 0) {
        return EXIT_USAGE;
    }
    layer_sizes(&cfg, (int64_t)train_set.rows * train_set.cols, &tb);

    weft_agent_opts_init(&opts);
    opts.handler_threads = 2; /* a server answers pushes while pulls wait for a step */
    st = weft_agent_create(&opts, &a);
    if (st == WEFT_OK) {
        /* Before the join: the servers' function must exist when the first request comes. */
        weft_ps_opts_init(&ps_opts); /* roles from WEFT_PS_SERVERS (weftrun --servers) */
        st = weft_ps_create(a, &ps_opts, &ps);
    }
    if (st == WEFT_OK) {
        st = weft_agent_join(a);
    }
    if (st != WEFT_OK) {
        fail("cannot start the parameter server", st);
        rc = 1;
        goto out;
    }
    if (!weft_ps_is_worker(ps)) {
        mnist_free(&train_set);
        mnist_free(&test_set);
    }
    rc = 1;
    if (workers_group(a, ps, &wpg) != 0 || tables_create(ps, &cfg, &tb) != 0) {
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
    /* Servers serve until every worker is done; workers say they are. */
    st = weft_ps_finish(ps, 0);
    if (st != WEFT_OK) {
        fail("finish", st);
        rc = rc != 0 ? rc : 1;
    }

out_shutdown:
    weft_pg_free(wpg);
    st = weft_agent_shutdown(a, SHUTDOWN_TIMEOUT_MS);
    if (st != WEFT_OK) {
        fail("shutdown", st);
        rc = rc != 0 ? rc : 1;
    }
out:
    weft_agent_free(a);
    mnist_free(&train_set);
    mnist_free(&test_set);
    return rc;
}
