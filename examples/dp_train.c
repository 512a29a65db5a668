/*
 * dp_train: data-parallel training of an MLP on Fashion-MNIST with weft's autograd and
 * collectives (what torch's DistributedDataParallel does, in C).
 *
 *   weftrun -n 2 build/examples/dp_train [--epochs 3] [--batch 64] [--lr 0.02]
 *           [--momentum 0.9] [--hidden 256] [--data DIR] ...   (--help lists all)
 *
 * Every rank builds the same MLP (784-256-10 by default: Linear, ReLU, Linear), with torch's
 * default initialisation (weft_nn_mlp), and rank 0's parameters are broadcast to all at the
 * start. The gradients live in one flat buffer (each parameter's gradient is a tensor over a
 * region of it, like DDP's gradient_as_bucket_view), so that after backward one all_reduce AVG
 * averages every gradient at once; then the SGD optimizer steps. Each epoch shuffles the training
 * set with the same seed on every rank and gives rank r the samples at positions r, r + W, ...
 * (torch's DistributedSampler, padding the last round by repeating the first samples), so all ranks
 * run the same number of steps.
 *
 * Test accuracy is measured after each epoch (and every --eval-every steps), each rank scoring
 * its share of the 10000 test images, the counts summed with all_reduce. The training clock
 * stops during evaluation. At the end the ranks compare their parameters bit for bit and rank 0
 * prints the result; with --json it also prints one JSON line for bench/run_train.py.
 *
 * Exit status: 0 on success, 2 for bad options or missing or corrupt data, 1 for any other
 * failure (including parameters that differ between ranks).
 */
#include <getopt.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <weft/weft.h>

#include "mnist.h"

#define DEFAULT_DATA_DIR    "/usr/share/datasets/fashion-mnist"
#define NCLASS              MNIST_CLASSES
#define MAX_LAYERS          8
#define SHUTDOWN_TIMEOUT_MS 30000
#define EXIT_USAGE          2

/* ---------------------------------------------------------- configuration */

typedef struct {
    int epochs;
    int batch; /* per rank */
    double lr;
    double momentum;
    double weight_decay;
    int nesterov;
    int n_hidden;
    int64_t hidden[MAX_LAYERS];
    uint64_t seed;
    int64_t limit;  /* 0: all training samples */
    int eval_every; /* steps; 0: after each epoch only */
    double target;
    int stop_at_target;
    int json;
    int threads;
    const char *data_dir;
} config_t;

static void usage(FILE *out)
{
    fprintf(out,
            "usage: weftrun -n N dp_train [options]\n"
            "  --epochs N         passes over the training set (default 3)\n"
            "  --batch N          minibatch size per rank (default 64)\n"
            "  --lr X             SGD learning rate (default 0.02)\n"
            "  --momentum X       SGD momentum (default 0.9)\n"
            "  --nesterov         Nesterov momentum\n"
            "  --weight-decay X   L2 weight decay (default 0)\n"
            "  --hidden N[,N...]  hidden layer sizes (default 256: MLP 784-256-10)\n"
            "  --seed N           initialisation and shuffling seed (default 1)\n"
            "  --limit N          train on the first N training samples only\n"
            "  --eval-every N     also measure test accuracy every N steps (default: per epoch)\n"
            "  --target X         test accuracy whose first crossing is timed (default 0.85)\n"
            "  --stop-at-target   stop as soon as the test accuracy reaches the target\n"
            "  --threads N        BLAS threads per rank (default 1)\n"
            "  --json             print a JSON summary line at the end (rank 0)\n"
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
        {"eval-every", required_argument, NULL, 'E'},
        {"target", required_argument, NULL, 't'},
        {"stop-at-target", no_argument, NULL, 'S'},
        {"threads", required_argument, NULL, 'T'},
        {"json", no_argument, NULL, 'j'},
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
        case 'E':
            bad = parse_int_arg(optarg, 0, INT32_MAX, &iv);
            cfg->eval_every = (int)iv;
            break;
        case 't':
            bad = parse_double_arg(optarg, 0.0, 1.0, &cfg->target);
            break;
        case 'S':
            cfg->stop_at_target = 1;
            break;
        case 'T':
            bad = parse_int_arg(optarg, 1, 256, &iv);
            cfg->threads = (int)iv;
            break;
        case 'j':
            cfg->json = 1;
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
            fprintf(stderr, "dp_train: bad value '%s' for --%s\n", optarg, longopts[index].name);
            usage(stderr);
            return EXIT_USAGE;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "dp_train: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return EXIT_USAGE;
    }
    if (cfg->nesterov && cfg->momentum == 0.0) {
        fprintf(stderr, "dp_train: --nesterov needs a momentum above 0\n");
        return EXIT_USAGE;
    }
    return 0;
}

/* ------------------------------------------------------------------ model */

/*
 * The MLP (weft_nn_mlp: Linear layers with ReLU between them, torch's initialisation) and its
 * gradients, which live in one flat buffer: each parameter's gradient is a tensor over a region
 * of it (weft_tensor_set_grad, like DDP's gradient_as_bucket_view), so backward accumulates
 * straight into the buffer that one all_reduce then averages.
 */
typedef struct {
    int n_sizes;
    int64_t sizes[MAX_LAYERS + 1];
    weft_nn_mlp_t *mlp;
    const weft_param_list_t *params; /* borrowed from the MLP */
    int64_t numel;
    weft_tensor_t *grad;
    weft_optimizer_t *opt;
} model_t;

static void model_free(model_t *m)
{
    weft_optimizer_free(m->opt);
    weft_nn_mlp_free(m->mlp);
    weft_tensor_release(m->grad);
    memset(m, 0, sizeof(*m));
}

static weft_status_t model_init(model_t *m, const config_t *cfg, int64_t inputs)
{
    weft_optim_sgd_config_t sgd = weft_optim_sgd_defaults();
    weft_rng_t rng;
    int64_t off = 0;
    weft_status_t st;

    memset(m, 0, sizeof(*m));
    m->n_sizes = cfg->n_hidden + 2;
    m->sizes[0] = inputs;
    for (int l = 0; l < cfg->n_hidden; l++) {
        m->sizes[l + 1] = cfg->hidden[l];
    }
    m->sizes[m->n_sizes - 1] = NCLASS;
    weft_rng_init(&rng, cfg->seed, 0);
    st = weft_nn_mlp_create(m->n_sizes, m->sizes, NULL, &rng, &m->mlp);
    if (st != WEFT_OK) {
        return st;
    }
    m->params = weft_nn_mlp_params(m->mlp);
    m->numel = weft_param_list_numel(m->params);
    st = weft_tensor_create(WEFT_F32, 1, &m->numel, &m->grad);
    for (int i = 0; st == WEFT_OK && i < weft_param_list_size(m->params); i++) {
        weft_tensor_t *p = weft_param_list_get(m->params, i);
        weft_tensor_t *g = NULL;

        /* The region is borrowed from m->grad, which outlives the parameters' use of it. */
        st = weft_tensor_wrap(WEFT_F32, weft_tensor_ndim(p), weft_tensor_shape(p),
                              (float *)weft_tensor_data(m->grad) + off, weft_tensor_nbytes(p),
                              WEFT_CPU, NULL, NULL, &g);
        if (st == WEFT_OK) {
            st = weft_tensor_set_grad(p, g);
        }
        weft_tensor_release(g);
        off += weft_tensor_numel(p);
    }
    sgd.lr = cfg->lr;
    sgd.momentum = cfg->momentum;
    sgd.nesterov = cfg->nesterov;
    sgd.weight_decay = cfg->weight_decay;
    if (st == WEFT_OK) {
        st = weft_optimizer_sgd_create(m->params, &sgd, &m->opt);
    }
    if (st != WEFT_OK) {
        model_free(m);
    }
    return st;
}

/* Every parameter of rank 0 on every rank. */
static weft_status_t model_broadcast(const model_t *m, weft_pg_t *pg)
{
    weft_status_t st = WEFT_OK;

    for (int i = 0; st == WEFT_OK && i < weft_param_list_size(m->params); i++) {
        st = weft_coll_broadcast(pg, weft_param_list_get(m->params, i), 0, NULL);
    }
    return st;
}

/* The parameters, packed into one new flat tensor. */
static weft_status_t model_pack(const model_t *m, weft_tensor_t **flat_p)
{
    weft_tensor_t *flat = NULL;
    int64_t n = m->numel;
    weft_status_t st;

    st = weft_tensor_empty(WEFT_F32, 1, &n, &flat);
    if (st == WEFT_OK) {
        st = weft_param_list_pack(m->params, flat);
    }
    if (st != WEFT_OK) {
        weft_tensor_release(flat);
        return st;
    }
    *flat_p = flat;
    return WEFT_OK;
}

static uint64_t fnv1a(const void *p, size_t n)
{
    const unsigned char *c = p;
    uint64_t h = 0xcbf29ce484222325ULL;

    for (size_t i = 0; i < n; i++) {
        h = (h ^ c[i]) * 0x100000001b3ULL;
    }
    return h;
}

/* ------------------------------------------------------------------- data */

/* ------------------------------------------------------------------ train */

typedef struct {
    const config_t *cfg;
    weft_agent_t *a;
    weft_pg_t *pg;
    int rank;
    int world;
    const mnist_set_t *train;
    const mnist_set_t *test;
    int64_t used;
} job_t;

static double now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void fail(const char *what, weft_status_t st)
{
    fprintf(stderr, "dp_train: %s: %s: %s\n", what, weft_status_name(st), weft_last_error());
}

/* Test accuracy over all ranks: each scores images rank, rank + W, ... */
static int evaluate(const job_t *job, const model_t *m, double *acc_p)
{
    weft_status_t st = mnist_accuracy(job->test, m->mlp, job->rank, job->world, job->pg, acc_p);
    if (st != WEFT_OK) {
        fail("evaluate", st);
        return -1;
    }
    return 0;
}

static void progress(const job_t *job, int epoch, int64_t step, int64_t steps, double loss,
                     double rate, int tty)
{
    char bar[31];
    int fill = (int)(30 * (step + 1) / steps);

    for (int i = 0; i < 30; i++) {
        bar[i] = i < fill ? '#' : '.';
    }
    bar[30] = '\0';
    printf("%sepoch %d/%d [%s] %lld/%lld loss %.4f %.0f samples/s%s", tty ? "\r" : "", epoch + 1,
           job->cfg->epochs, bar, (long long)(step + 1), (long long)steps, loss, rate,
           tty ? "" : "\n");
    fflush(stdout);
}

/* Max and sum over ranks of the peak resident set, in MiB. */
static int peak_rss(const job_t *job, double *max_p, double *sum_p)
{
    struct rusage ru;
    int64_t two = 2;
    weft_tensor_t *t = NULL;
    weft_tensor_t *s = NULL;
    double mine;
    weft_status_t st;

    getrusage(RUSAGE_SELF, &ru);
    mine = (double)ru.ru_maxrss / 1024.0;
    st = weft_tensor_create(WEFT_F64, 1, &two, &t);
    if (st == WEFT_OK) {
        st = weft_tensor_create(WEFT_F64, 1, &two, &s);
    }
    if (st == WEFT_OK) {
        ((double *)weft_tensor_data(t))[0] = mine;
        ((double *)weft_tensor_data(s))[0] = mine;
        st = weft_coll_all_reduce(job->pg, t, WEFT_MAX, NULL);
    }
    if (st == WEFT_OK) {
        st = weft_coll_all_reduce(job->pg, s, WEFT_SUM, NULL);
    }
    if (st == WEFT_OK) {
        *max_p = ((double *)weft_tensor_data(t))[0];
        *sum_p = ((double *)weft_tensor_data(s))[0];
    }
    weft_tensor_release(t);
    weft_tensor_release(s);
    if (st != WEFT_OK) {
        fail("peak memory", st);
        return -1;
    }
    return 0;
}

/* Compares every rank's parameters with rank 0's, bit for bit; 1 when all match. */
static int params_identical(const job_t *job, const model_t *m, int *same_p, uint64_t *hash_p)
{
    int64_t one = 1;
    weft_tensor_t *copy = NULL;
    weft_tensor_t *flag = NULL;
    weft_status_t st;

    weft_tensor_t *mine = NULL;

    st = model_pack(m, &mine);
    if (st == WEFT_OK) {
        st = weft_tensor_clone(mine, &copy);
    }
    if (st == WEFT_OK) {
        st = weft_coll_broadcast(job->pg, copy, 0, NULL);
    }
    if (st == WEFT_OK) {
        st = weft_tensor_create(WEFT_I32, 1, &one, &flag);
    }
    if (st == WEFT_OK) {
        ((int32_t *)weft_tensor_data(flag))[0] =
            memcmp(weft_tensor_data(copy), weft_tensor_data(mine), weft_tensor_nbytes(copy)) == 0;
        st = weft_coll_all_reduce(job->pg, flag, WEFT_MIN, NULL);
    }
    if (st == WEFT_OK) {
        *same_p = ((int32_t *)weft_tensor_data(flag))[0];
        *hash_p = fnv1a(weft_tensor_data(mine), weft_tensor_nbytes(mine));
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

static int train(const job_t *job)
{
    const config_t *cfg = job->cfg;
    const int64_t d = (int64_t)job->train->rows * job->train->cols;
    const int64_t shard_n = (job->used + job->world - 1) / job->world;
    const int64_t steps = (shard_n + cfg->batch - 1) / cfg->batch;
    const int tty = isatty(STDOUT_FILENO);
    uint64_t hash = 0;
    int64_t *perm = malloc((size_t)job->used * sizeof(*perm));
    int64_t *shard = malloc((size_t)shard_n * sizeof(*shard));
    model_t m;
    double train_time = 0;
    double time_to_target = -1;
    double acc = 0;
    double loss_avg = 0;
    double rss_max = 0;
    double rss_sum = 0;
    int64_t samples = 0;
    int64_t step_total = 0;
    int epochs_run = 0;
    int reached = 0;
    int same = 0;
    weft_status_t st;
    int rc = 1;

    if (perm == NULL || shard == NULL) {
        fprintf(stderr, "dp_train: out of memory\n");
        free(perm);
        free(shard);
        return 1;
    }
    st = model_init(&m, cfg, d);
    if (st != WEFT_OK) {
        fail("model", st);
        free(perm);
        free(shard);
        return 1;
    }
    /* Rank 0's initial parameters everywhere. */
    st = model_broadcast(&m, job->pg);
    if (st != WEFT_OK) {
        fail("broadcast", st);
        goto out;
    }
    if (job->rank == 0) {
        printf("MLP %lld", (long long)m.sizes[0]);
        for (int l = 1; l < m.n_sizes; l++) {
            printf("-%lld", (long long)m.sizes[l]);
        }
        printf(" (%lld parameters) on %lld Fashion-MNIST images, %d rank%s, batch %d per rank, "
               "SGD lr %g momentum %g, %lld steps per epoch\n",
               (long long)m.numel, (long long)job->used, job->world, job->world > 1 ? "s" : "",
               cfg->batch, cfg->lr, cfg->momentum, (long long)steps);
    }

    for (int epoch = 0; epoch < cfg->epochs && !(reached && cfg->stop_at_target); epoch++) {
        double t_epoch = 0;
        double loss_sum = 0;
        int64_t loss_n = 0;

        mnist_epoch_shard(cfg->seed, epoch, job->used, job->rank, job->world, perm, shard, shard_n);
        for (int64_t s = 0; s < steps; s++) {
            int64_t k = s + 1 < steps ? cfg->batch : shard_n - s * cfg->batch;
            weft_tensor_t *x = NULL;
            weft_tensor_t *y = NULL;
            weft_tensor_t *logits = NULL;
            weft_tensor_t *loss = NULL;
            double t0 = now_s();

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
                /* Average the gradients of every rank: one all_reduce over the flat buffer. */
                st = weft_coll_all_reduce(job->pg, m.grad, WEFT_AVG, NULL);
            }
            if (st == WEFT_OK) {
                st = weft_optimizer_step(m.opt);
            }
            weft_tensor_release(loss);
            weft_tensor_release(logits);
            weft_tensor_release(x);
            weft_tensor_release(y);
            if (st != WEFT_OK) {
                fail("training step", st);
                goto out;
            }
            t_epoch += now_s() - t0;
            samples += k * job->world;
            step_total++;
            if (job->rank == 0 &&
                (tty || (s + 1) % (steps / 10 > 0 ? steps / 10 : 1) == 0 || s + 1 == steps)) {
                progress(job, epoch, s, steps, loss_sum / (double)loss_n,
                         (double)samples / (train_time + t_epoch), tty);
            }
            if ((cfg->eval_every > 0 && step_total % cfg->eval_every == 0) || s + 1 == steps) {
                if (evaluate(job, &m, &acc) != 0) {
                    goto out;
                }
                if (!reached && acc >= cfg->target) {
                    reached = 1;
                    time_to_target = train_time + t_epoch;
                }
                if (job->rank == 0 && s + 1 < steps) {
                    printf("%sstep %lld: test accuracy %.2f%%\n", tty ? "\n" : "",
                           (long long)step_total, 100.0 * acc);
                }
                if (reached && cfg->stop_at_target) {
                    break;
                }
            }
        }
        train_time += t_epoch;
        loss_avg = loss_n > 0 ? loss_sum / (double)loss_n : 0;
        epochs_run = epoch + 1;
        if (job->rank == 0) {
            printf("%sepoch %d: train loss %.4f, test accuracy %.2f%%, %.1f s, %.0f samples/s\n",
                   tty ? "\n" : "", epoch + 1, loss_avg, 100.0 * acc, t_epoch,
                   (double)samples / train_time);
        }
    }

    if (params_identical(job, &m, &same, &hash) != 0 || peak_rss(job, &rss_max, &rss_sum) != 0) {
        goto out;
    }
    if (job->rank == 0) {

        printf("final test accuracy %.2f%%; %s %.0f%% after %.1f s of training\n", 100.0 * acc,
               reached ? "reached" : "did not reach", 100.0 * cfg->target,
               reached ? time_to_target : train_time);
        printf("parameters %s on all %d ranks (fnv1a64 %016llx)\n",
               same ? "bit-identical" : "DIFFER", job->world, (unsigned long long)hash);
        if (cfg->json) {
            printf("{\"system\":\"weft\",\"world\":%d,\"batch\":%d,\"lr\":%g,\"momentum\":%g,"
                   "\"hidden\":%lld,\"epochs_run\":%d,\"steps\":%lld,\"samples_per_s\":%.1f,"
                   "\"time_to_target_s\":",
                   job->world, cfg->batch, cfg->lr, cfg->momentum, (long long)cfg->hidden[0],
                   epochs_run, (long long)step_total, (double)samples / train_time);
            if (reached) {
                printf("%.3f", time_to_target);
            } else {
                printf("null");
            }
            printf(",\"target\":%g,\"final_acc\":%.4f,\"train_loss\":%.4f,\"peak_rss_mb_max\":%.1f,"
                   "\"peak_rss_mb_sum\":%.1f,\"params_identical\":%s}\n",
                   cfg->target, acc, loss_avg, rss_max, rss_sum, same ? "true" : "false");
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

int main(int argc, char **argv)
{
    config_t cfg;
    mnist_set_t train_set = {0};
    mnist_set_t test_set = {0};
    weft_agent_opts_t opts;
    weft_agent_t *a = NULL;
    job_t job;
    weft_status_t st;
    int rc;

    setvbuf(stdout, NULL, _IOLBF, 0);
    rc = parse_args(argc, argv, &cfg);
    if (rc != 0) {
        return rc == 1 ? 0 : rc;
    }
    weft_op_set_threads(cfg.threads);
    /* Data first: a missing or corrupt file ends the run before any rank waits for it. */
    if (mnist_load_splits("dp_train", cfg.data_dir, &train_set, &test_set) != 0) {
        return EXIT_USAGE;
    }

    weft_agent_opts_init(&opts);
    st = weft_agent_create(&opts, &a);
    if (st == WEFT_OK) {
        st = weft_agent_join(a);
    }
    if (st != WEFT_OK) {
        fail("cannot start the agent", st);
        rc = 1;
        goto out;
    }
    memset(&job, 0, sizeof(job));
    job.cfg = &cfg;
    job.a = a;
    job.rank = weft_agent_rank(a);
    job.world = weft_agent_world_size(a);
    job.train = &train_set;
    job.test = &test_set;
    job.used = cfg.limit > 0 && cfg.limit < train_set.count ? cfg.limit : train_set.count;
    st = weft_pg_world(a, &job.pg);
    if (st != WEFT_OK) {
        fail("world group", st);
        rc = 1;
        goto out_shutdown;
    }
    rc = train(&job);
    weft_pg_free(job.pg);

out_shutdown:
    st = weft_agent_shutdown(a, SHUTDOWN_TIMEOUT_MS);
    if (st != WEFT_OK) {
        fail("shutdown", st);
        rc = 1;
    }
out:
    weft_agent_free(a);
    mnist_free(&train_set);
    mnist_free(&test_set);
    return rc;
}
