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
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <weft/weft.h>

#include "common.h"
#include "mnist.h"

#define PROG       "dp_train"
#define NCLASS     MNIST_CLASSES
#define EXIT_USAGE EX_EXIT_USAGE

/* ---------------------------------------------------------- configuration */

typedef struct {
    int epochs;
    int batch; /* per rank */
    double lr;
    double momentum;
    double weight_decay;
    int nesterov;
    ex_sizes_t hidden;
    uint64_t seed;
    int64_t limit;  /* 0: all training samples */
    int eval_every; /* steps; 0: after each epoch only */
    double target;
    int stop_at_target;
    int json;
    int threads;
    const char *data_dir;
    const char *reducer;  /* "ddp" (bucketed, overlapping backward) or "flat" (one all_reduce) */
    double bucket_mb;     /* ddp bucket cap */
    const char *compress; /* ddp: "none", "fp16", "bf16" */
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
            "  --reducer R        ddp: the bucketed DDP reducer, all_reduces overlapping backward\n"
            "                     (default); flat: one all_reduce of all gradients after backward\n"
            "  --bucket-mb X      ddp bucket cap in MiB (default 25; the first bucket 1 MiB)\n"
            "  --compress C       ddp: none (default), fp16 or bf16 gradients on the wire\n"
            "  --json             print a JSON summary line at the end (rank 0)\n"
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
        EX_INT("eval-every", &cfg->eval_every, 0, INT32_MAX),
        EX_DOUBLE("target", &cfg->target, 0.0, 1.0),
        EX_FLAG("stop-at-target", &cfg->stop_at_target),
        EX_INT("threads", &cfg->threads, 1, 256),
        EX_FLAG("json", &cfg->json),
        EX_STR("data", &cfg->data_dir),
        EX_STR("reducer", &cfg->reducer),
        EX_DOUBLE("bucket-mb", &cfg->bucket_mb, 0.001, 65536),
        EX_STR("compress", &cfg->compress),
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
    cfg->target = 0.85;
    cfg->threads = 1;
    cfg->data_dir = mnist_default_dir();
    cfg->reducer = "ddp";
    cfg->bucket_mb = 25;
    cfg->compress = "none";
    rc = ex_parse_opts(PROG, argc, argv, opts, sizeof(opts) / sizeof(opts[0]), usage);
    if (rc != 0) {
        return rc;
    }
    if (cfg->nesterov && cfg->momentum == 0.0) {
        fprintf(stderr, PROG ": --nesterov needs a momentum above 0\n");
        return EXIT_USAGE;
    }
    if (strcmp(cfg->reducer, "ddp") != 0 && strcmp(cfg->reducer, "flat") != 0) {
        fprintf(stderr, PROG ": --reducer is ddp or flat, not '%s'\n", cfg->reducer);
        return EXIT_USAGE;
    }
    if (strcmp(cfg->compress, "none") != 0 && strcmp(cfg->compress, "fp16") != 0 &&
        strcmp(cfg->compress, "bf16") != 0) {
        fprintf(stderr, PROG ": --compress is none, fp16 or bf16, not '%s'\n", cfg->compress);
        return EXIT_USAGE;
    }
    if (strcmp(cfg->compress, "none") != 0 && strcmp(cfg->reducer, "ddp") != 0) {
        fprintf(stderr, PROG ": --compress needs --reducer ddp\n");
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
    int64_t sizes[EX_MAX_LAYERS + 1];
    weft_nn_mlp_t *mlp;
    const weft_param_list_t *params; /* borrowed from the MLP */
    int64_t numel;
    weft_tensor_t *grad; /* --reducer flat: every gradient, a region each */
    weft_ddp_t *ddp;     /* --reducer ddp */
    weft_optimizer_t *opt;
} model_t;

static void model_free(model_t *m)
{
    weft_ddp_free(m->ddp);
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
    m->n_sizes = ex_mlp_sizes(&cfg->hidden, inputs, NCLASS, m->sizes);
    weft_rng_init(&rng, cfg->seed, 0);
    st = weft_nn_mlp_create(m->n_sizes, m->sizes, NULL, &rng, &m->mlp);
    if (st != WEFT_OK) {
        return st;
    }
    m->params = weft_nn_mlp_params(m->mlp);
    m->numel = weft_param_list_numel(m->params);
    if (strcmp(cfg->reducer, "flat") == 0) {
        st = weft_tensor_create(WEFT_F32, 1, &m->numel, &m->grad);
    }
    for (int i = 0; st == WEFT_OK && m->grad != NULL && i < weft_param_list_size(m->params); i++) {
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

/* Every parameter of rank 0 on every rank: the DDP reducer broadcasts them as it is made (and
 * checks the model is the same everywhere); the flat path broadcasts them one by one. */
static weft_status_t model_broadcast(model_t *m, const config_t *cfg, weft_pg_t *pg)
{
    weft_status_t st = WEFT_OK;

    if (m->grad == NULL) {
        weft_ddp_opts_t o;
        weft_ddp_opts_init(&o);
        o.bucket_cap_bytes = (size_t)(cfg->bucket_mb * 1048576.0);
        if (o.first_bucket_bytes > o.bucket_cap_bytes) {
            o.first_bucket_bytes = o.bucket_cap_bytes;
        }
        o.compress = strcmp(cfg->compress, "fp16") == 0   ? WEFT_DDP_COMPRESS_FP16
                     : strcmp(cfg->compress, "bf16") == 0 ? WEFT_DDP_COMPRESS_BF16
                                                          : WEFT_DDP_COMPRESS_NONE;
        return weft_ddp_create(pg, m->params, &o, &m->ddp);
    }
    for (int i = 0; st == WEFT_OK && i < weft_param_list_size(m->params); i++) {
        st = weft_coll_broadcast(pg, weft_param_list_get(m->params, i), 0, NULL);
    }
    return st;
}

/* ------------------------------------------------------------------ train */

typedef mnist_job_t job_t;

static void fail(const char *what, weft_status_t st)
{
    ex_fail(PROG, what, st);
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

static int train(const job_t *job, void *arg)
{
    const config_t *cfg = arg;
    const int64_t d = (int64_t)job->train->rows * job->train->cols;
    mnist_shard_t sh;
    model_t m;
    ex_loop_t l;
    int64_t steps;
    uint64_t hash = 0;
    double time_to_target = -1;
    double acc = 0;
    double rss_max = 0;
    double rss_sum = 0;
    int reached = 0;
    int same = 0;
    weft_status_t st;
    int rc = 1;

    memset(&m, 0, sizeof(m));
    if (mnist_shard_init(PROG, job, cfg->seed, &sh) != 0) {
        goto out;
    }
    steps = (sh.n + cfg->batch - 1) / cfg->batch;
    ex_loop_init(&l, job->rank, job->world, cfg->epochs, steps, cfg->eval_every);
    st = model_init(&m, cfg, d);
    if (st != WEFT_OK) {
        fail("model", st);
        goto out;
    }
    /* Rank 0's initial parameters everywhere. */
    st = model_broadcast(&m, cfg, job->pg);
    if (st != WEFT_OK) {
        fail("broadcast", st);
        goto out;
    }
    if (job->rank == 0) {
        ex_print_mlp(m.n_sizes, m.sizes);
        printf(" (%lld parameters) on %lld Fashion-MNIST images, %d rank%s, batch %d per rank, "
               "SGD lr %g momentum %g, %lld steps per epoch\n",
               (long long)m.numel, (long long)job->used, job->world, job->world > 1 ? "s" : "",
               cfg->batch, cfg->lr, cfg->momentum, (long long)steps);
    }

    for (int epoch = 0; epoch < cfg->epochs && !(reached && cfg->stop_at_target); epoch++) {
        ex_loop_epoch_begin(&l);
        mnist_shard_epoch(&sh, epoch);
        for (int64_t s = 0; s < steps; s++) {
            int64_t k = s + 1 < steps ? cfg->batch : sh.n - s * cfg->batch;
            double loss = 0;
            double t0 = ex_now();

            if (m.ddp != NULL) {
                /* Backward with the buckets' all_reduces overlapping it, averaged in place. */
                weft_param_list_zero_grad(m.params);
                st = mnist_loss_backward(job->train, m.mlp, sh.idx + s * cfg->batch, k, m.ddp,
                                         &loss);
                if (st == WEFT_OK) {
                    ex_loop_add_ddp(&l, m.ddp);
                }
            } else {
                memset(weft_tensor_data(m.grad), 0, weft_tensor_nbytes(m.grad));
                st =
                    mnist_loss_backward(job->train, m.mlp, sh.idx + s * cfg->batch, k, NULL, &loss);
                if (st == WEFT_OK) {
                    /* Average the gradients of every rank: one all_reduce over the flat buffer. */
                    st = weft_coll_all_reduce(job->pg, m.grad, WEFT_AVG, NULL);
                }
            }
            if (st == WEFT_OK) {
                st = weft_optimizer_step(m.opt);
            }
            if (st != WEFT_OK) {
                fail("training step", st);
                goto out;
            }
            if (ex_loop_step_end(&l, epoch, s, k, loss, t0)) {
                if (evaluate(job, &m, &acc) != 0) {
                    goto out;
                }
                if (!reached && acc >= cfg->target) {
                    reached = 1;
                    time_to_target = l.train_time + l.t_epoch;
                }
                ex_loop_eval_line(&l, s, acc);
                if (reached && cfg->stop_at_target) {
                    break;
                }
            }
        }
        ex_loop_epoch_end(&l, epoch, acc);
    }

    if (ex_params_identical(PROG, job->pg, m.params, &same, &hash) != 0 ||
        ex_peak_rss(PROG, job->pg, &rss_max, &rss_sum) != 0) {
        goto out;
    }
    if (job->rank == 0) {
        printf("final test accuracy %.2f%%; %s %.0f%% after %.1f s of training\n", 100.0 * acc,
               reached ? "reached" : "did not reach", 100.0 * cfg->target,
               reached ? time_to_target : l.train_time);
        ex_print_params_check(same, job->world, hash);
        if (m.ddp != NULL && l.step_total > 0) {
            weft_ddp_stats_t ds;
            weft_ddp_stats(m.ddp, &ds);
            printf("ddp: %d bucket%s%s, %.2f MiB a step on the wire, %.0f%% of the "
                   "communication hidden behind backward (%.2f ms of %.2f ms a step exposed)\n",
                   ds.buckets, ds.buckets == 1 ? "" : "s", ds.rebuilt ? " (rebuilt)" : "",
                   (double)ds.bytes / 1048576.0,
                   l.comm_us > 0 ? 100.0 * (1.0 - l.exposed_us / l.comm_us) : 0.0,
                   l.exposed_us / 1e3 / (double)l.step_total,
                   l.comm_us / 1e3 / (double)l.step_total);
        }
        if (cfg->json) {
            printf("{\"system\":\"weft\",\"world\":%d,\"batch\":%d,\"lr\":%g,\"momentum\":%g,"
                   "\"hidden\":%lld,\"epochs_run\":%d,\"steps\":%lld,\"samples_per_s\":%.1f,"
                   "\"time_to_target_s\":",
                   job->world, cfg->batch, cfg->lr, cfg->momentum, (long long)cfg->hidden.v[0],
                   l.epochs_run, (long long)l.step_total, ex_loop_rate(&l));
            if (reached) {
                printf("%.3f", time_to_target);
            } else {
                printf("null");
            }
            printf(",\"target\":%g,\"final_acc\":%.4f,\"train_loss\":%.4f,\"peak_rss_mb_max\":%.1f,"
                   "\"peak_rss_mb_sum\":%.1f,\"params_identical\":%s,\"reducer\":\"%s\","
                   "\"compress\":\"%s\",\"step_ms\":%.3f,\"comm_hidden\":",
                   cfg->target, acc, l.loss_avg, rss_max, rss_sum, same ? "true" : "false",
                   cfg->reducer, cfg->compress, ex_loop_step_ms(&l));
            if (m.ddp != NULL && l.comm_us > 0) {
                weft_ddp_stats_t ds;
                weft_ddp_stats(m.ddp, &ds);
                printf("%.3f,\"wire_mib_per_step\":%.3f}\n", 1.0 - l.exposed_us / l.comm_us,
                       (double)ds.bytes / 1048576.0);
            } else {
                printf("null,\"wire_mib_per_step\":%.3f}\n", (double)m.numel * 4.0 / 1048576.0);
            }
        }
    }
    rc = same ? 0 : 1;

out:
    model_free(&m);
    mnist_shard_free(&sh);
    return rc;
}

/* ----------------------------------------------------------------- main */

int main(int argc, char **argv)
{
    config_t cfg;
    int rc;

    setvbuf(stdout, NULL, _IOLBF, 0);
    rc = parse_args(argc, argv, &cfg);
    if (rc != 0) {
        return rc == 1 ? 0 : rc;
    }
    return mnist_dp_main(PROG, cfg.data_dir, cfg.threads, cfg.limit, 0, 0, train, &cfg);
}
