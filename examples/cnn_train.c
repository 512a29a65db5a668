/*
 * cnn_train: data-parallel training of a small ResNet-style CNN on Fashion-MNIST with weft's
 * convolution ops, nn modules and the DDP reducer (torch's DistributedDataParallel, in C).
 *
 *   weftrun -n 2 build/examples/cnn_train [--epochs 2] [--batch 64] [--lr 0.05]
 *           [--momentum 0.9] [--data DIR] ...   (--help lists all)
 *
 * The model (the same in bench/torch_cnn_train.py), for 1 x 28 x 28 images:
 *
 *   conv1   Conv2d(1 -> 16, 3x3, padding 1, no bias)  16 x 28 x 28
 *   bn1     BatchNorm2d(16), ReLU, max_pool2d(2)      16 x 14 x 14
 *   layer1  BasicBlock(16 -> 32, stride 2)            32 x 7 x 7   (1x1 conv + BN shortcut)
 *           adaptive_avg_pool2d(1), flatten            32
 *   fc      Linear(32 -> 10), log_softmax              10
 *
 * trained with SGD (momentum) on the mean nll_loss. Every rank builds it from the same seed, and
 * the DDP reducer broadcasts rank 0's parameters at the start and averages the gradients in
 * buckets while backward runs. Each epoch gives rank r the samples r, r + W, ... of a shuffle
 * drawn from the seed and the epoch (torch's DistributedSampler), so all ranks run the same
 * number of steps.
 *
 * BatchNorm's running statistics are buffers, not parameters: the reducer does not touch them.
 * As torch DDP does by default (broadcast_buffers=True), rank 0's buffers are broadcast to every
 * rank before each training forward (one broadcast of all of them packed), and once more before
 * each evaluation, so every rank scores the test set with rank 0's statistics and the replicas
 * stay identical, buffers included. (The batch statistics used while training are each rank's
 * own batch's, as in torch without SyncBatchNorm.)
 *
 * Test accuracy (eval mode: running statistics) is measured after each epoch and every
 * --eval-every steps, each rank scoring its share of the 10000 test images, the counts summed
 * with all_reduce; the training clock stops during evaluation. At the end the ranks compare their
 * parameters bit for bit and rank 0 prints the result; with --json also one JSON line for
 * bench/run_cnn.py.
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

#define PROG       "cnn_train"
#define NCLASS     MNIST_CLASSES
#define STEM_C     16 /* conv1's channels */
#define BLOCK_C    32 /* layer1's */
#define EVAL_CHUNK 500

/* ---------------------------------------------------------- configuration */

typedef struct {
    int epochs;
    int batch; /* per rank */
    double lr;
    double momentum;
    uint64_t seed;
    int64_t limit;  /* 0: all training samples */
    int eval_every; /* steps; 0: after each epoch only */
    int json;
    int threads;
    const char *data_dir;
} config_t;

static void usage(FILE *out)
{
    fprintf(out,
            "usage: weftrun -n N cnn_train [options]\n"
            "  --epochs N         passes over the training set (default 2)\n"
            "  --batch N          minibatch size per rank (default 64, at least 2: BatchNorm)\n"
            "  --lr X             SGD learning rate (default 0.05)\n"
            "  --momentum X       SGD momentum (default 0.9)\n"
            "  --seed N           initialisation and shuffling seed (default 1)\n"
            "  --limit N          train on the first N training samples only\n"
            "  --eval-every N     also measure test accuracy every N steps (default: per epoch)\n"
            "  --threads N        BLAS threads per rank (default 1)\n"
            "  --json             print a JSON summary line at the end (rank 0)\n"
            "  --data DIR         Fashion-MNIST IDX files (default $WEFT_DATA_DIR, else\n"
            "                     " MNIST_DEFAULT_DIR ")\n");
}

/* Returns 0, 1 after --help, or EX_EXIT_USAGE after a message. */
static int parse_args(int argc, char **argv, config_t *cfg)
{
    const ex_opt_t opts[] = {
        EX_INT("epochs", &cfg->epochs, 1, 100000),
        EX_INT("batch", &cfg->batch, 2, 1 << 16),
        EX_DOUBLE("lr", &cfg->lr, 0.0, 1e6),
        EX_DOUBLE("momentum", &cfg->momentum, 0.0, 0.999999),
        EX_U64("seed", &cfg->seed, 0, INT64_MAX),
        EX_I64("limit", &cfg->limit, 1, INT64_MAX),
        EX_INT("eval-every", &cfg->eval_every, 0, INT32_MAX),
        EX_INT("threads", &cfg->threads, 1, 256),
        EX_FLAG("json", &cfg->json),
        EX_STR("data", &cfg->data_dir),
    };

    memset(cfg, 0, sizeof(*cfg));
    cfg->epochs = 2;
    cfg->batch = 64;
    cfg->lr = 0.05;
    cfg->momentum = 0.9;
    cfg->seed = 1;
    cfg->threads = 1;
    cfg->data_dir = mnist_default_dir();
    return ex_parse_opts(PROG, argc, argv, opts, sizeof(opts) / sizeof(opts[0]), usage);
}

/* ------------------------------------------------------------------ model */

typedef struct {
    weft_nn_conv2d_t *conv1;
    weft_nn_batch_norm2d_t *bn1;
    weft_nn_basic_block_t *layer1;
    weft_nn_linear_t *fc;
    weft_param_list_t *params;   /* torch's names: conv1.weight, bn1.weight, ..., fc.bias */
    weft_param_list_t *buffers;  /* bn1.running_mean, ..., layer1.downsample.1.running_var */
    weft_tensor_t *flat_buffers; /* the buffers packed, for their broadcast */
    int64_t numel;
    weft_ddp_t *ddp;
    weft_optimizer_t *opt;
} model_t;

static void model_free(model_t *m)
{
    weft_ddp_free(m->ddp);
    weft_optimizer_free(m->opt);
    weft_tensor_release(m->flat_buffers);
    weft_param_list_free(m->buffers);
    weft_param_list_free(m->params);
    weft_nn_linear_free(m->fc);
    weft_nn_basic_block_free(m->layer1);
    weft_nn_batch_norm2d_free(m->bn1);
    weft_nn_conv2d_free(m->conv1);
    memset(m, 0, sizeof(*m));
}

/* Builds the model from the seed (conv1, layer1, fc in that order from one stream), the
 * optimizer, and the DDP reducer over @p pg (which broadcasts rank 0's parameters). */
static weft_status_t model_init(model_t *m, const config_t *cfg, weft_pg_t *pg)
{
    weft_nn_conv2d_config_t cc = WEFT_NN_CONV2D_DEFAULTS;
    weft_optim_sgd_config_t sgd = weft_optim_sgd_defaults();
    weft_ddp_opts_t o;
    weft_rng_t rng;
    int64_t nbuf;
    weft_status_t st;

    memset(m, 0, sizeof(*m));
    weft_rng_init(&rng, cfg->seed, 0);
    cc.padding[0] = cc.padding[1] = 1;
    cc.bias = 0;
    st = weft_nn_conv2d_create(1, STEM_C, (const int64_t[]){3, 3}, &cc, &rng, &m->conv1);
    if (st == WEFT_OK) {
        st = weft_nn_batch_norm2d_create(STEM_C, 1e-5, 0.1, WEFT_F32, &m->bn1);
    }
    if (st == WEFT_OK) {
        st = weft_nn_basic_block_create(STEM_C, BLOCK_C, 2, WEFT_F32, &rng, &m->layer1);
    }
    if (st == WEFT_OK) {
        st = weft_nn_linear_create(BLOCK_C, NCLASS, 1, WEFT_F32, &rng, &m->fc);
    }
    if (st == WEFT_OK) {
        st = weft_param_list_create(&m->params);
    }
    if (st == WEFT_OK) {
        st = weft_param_list_create(&m->buffers);
    }
    if (st == WEFT_OK) {
        st = weft_param_list_extend(m->params, "conv1", weft_nn_conv2d_params(m->conv1));
    }
    if (st == WEFT_OK) {
        st = weft_param_list_extend(m->params, "bn1", weft_nn_batch_norm2d_params(m->bn1));
    }
    if (st == WEFT_OK) {
        st = weft_param_list_extend(m->params, "layer1", weft_nn_basic_block_params(m->layer1));
    }
    if (st == WEFT_OK) {
        st = weft_param_list_extend(m->params, "fc", weft_nn_linear_params(m->fc));
    }
    if (st == WEFT_OK) {
        st = weft_param_list_extend(m->buffers, "bn1", weft_nn_batch_norm2d_buffers(m->bn1));
    }
    if (st == WEFT_OK) {
        st = weft_param_list_extend(m->buffers, "layer1", weft_nn_basic_block_buffers(m->layer1));
    }
    if (st == WEFT_OK) {
        nbuf = weft_param_list_numel(m->buffers);
        st = weft_tensor_create(WEFT_F32, 1, &nbuf, &m->flat_buffers);
    }
    if (st == WEFT_OK) {
        m->numel = weft_param_list_numel(m->params);
        sgd.lr = cfg->lr;
        sgd.momentum = cfg->momentum;
        st = weft_optimizer_sgd_create(m->params, &sgd, &m->opt);
    }
    if (st == WEFT_OK) {
        weft_ddp_opts_init(&o);
        st = weft_ddp_create(pg, m->params, &o, &m->ddp);
    }
    if (st != WEFT_OK) {
        model_free(m);
    }
    return st;
}

static void model_set_training(model_t *m, int training)
{
    weft_nn_batch_norm2d_set_training(m->bn1, training);
    weft_nn_basic_block_set_training(m->layer1, training);
}

/* Rank 0's BatchNorm buffers on every rank (torch DDP's broadcast_buffers): one broadcast. */
static weft_status_t model_sync_buffers(model_t *m, weft_pg_t *pg, int world)
{
    weft_status_t st;

    if (world < 2) {
        return WEFT_OK;
    }
    st = weft_param_list_pack(m->buffers, m->flat_buffers);
    if (st == WEFT_OK) {
        st = weft_coll_broadcast(pg, m->flat_buffers, 0, NULL);
    }
    if (st == WEFT_OK) {
        st = weft_param_list_unpack(m->buffers, m->flat_buffers);
    }
    return st;
}

/* The log-probabilities [k, 10] of images @p x [k, 784], in the model's mode. */
static weft_status_t model_forward(model_t *m, weft_tensor_t *x, weft_tensor_t **y_p)
{
    const int64_t k = weft_tensor_shape(x)[0];
    weft_tensor_t *t[10] = {NULL};
    weft_status_t st;
    int n = 0;

    st = weft_op_reshape(x, 4, (const int64_t[]){k, 1, 28, 28}, &t[n]);
    if (st == WEFT_OK) {
        st = weft_nn_conv2d_forward(m->conv1, t[n], &t[n + 1]);
        n++;
    }
    if (st == WEFT_OK) {
        st = weft_nn_batch_norm2d_forward(m->bn1, t[n], &t[n + 1]);
        n++;
    }
    if (st == WEFT_OK) {
        st = weft_op_relu(t[n], &t[n + 1]);
        n++;
    }
    if (st == WEFT_OK) {
        st = weft_op_max_pool2d(t[n], (const int64_t[]){2, 2}, NULL, NULL, &t[n + 1]);
        n++;
    }
    if (st == WEFT_OK) {
        st = weft_nn_basic_block_forward(m->layer1, t[n], &t[n + 1]);
        n++;
    }
    if (st == WEFT_OK) {
        st = weft_op_adaptive_avg_pool2d(t[n], (const int64_t[]){1, 1}, &t[n + 1]);
        n++;
    }
    if (st == WEFT_OK) {
        st = weft_op_flatten(t[n], 1, -1, &t[n + 1]);
        n++;
    }
    if (st == WEFT_OK) {
        st = weft_nn_linear_forward(m->fc, t[n], &t[n + 1]);
        n++;
    }
    if (st == WEFT_OK) {
        st = weft_op_log_softmax(t[n], 1, y_p);
    }
    for (int i = 0; i < 10; i++) {
        weft_tensor_release(t[i]);
    }
    return st;
}

/* ------------------------------------------------------------------ train */

typedef mnist_job_t job_t;

static void fail(const char *what, weft_status_t st)
{
    ex_fail(PROG, what, st);
}

/* One step's forward and backward through the reducer (gradients averaged over the ranks) on
 * samples idx[0..k); the mean loss into @p loss_p. */
static weft_status_t loss_backward(const job_t *job, model_t *m, const int64_t *idx, int64_t k,
                                   double *loss_p)
{
    weft_tensor_t *x = NULL;
    weft_tensor_t *y = NULL;
    weft_tensor_t *logp = NULL;
    weft_tensor_t *loss = NULL;
    weft_status_t st;

    st = mnist_batch(job->train, idx, k, &x, &y);
    if (st == WEFT_OK) {
        st = model_forward(m, x, &logp);
    }
    if (st == WEFT_OK) {
        st = weft_op_nll_loss(logp, y, WEFT_REDUCTION_MEAN, &loss);
    }
    if (st == WEFT_OK) {
        st = weft_ddp_backward(m->ddp, loss, NULL);
    }
    if (st == WEFT_OK) {
        *loss_p = ((const float *)weft_tensor_data(loss))[0];
    }
    weft_tensor_release(loss);
    weft_tensor_release(logp);
    weft_tensor_release(x);
    weft_tensor_release(y);
    return st;
}

/* Test accuracy in eval mode with rank 0's running statistics: each rank scores images rank,
 * rank + W, ..., the counts summed over the group. */
static int evaluate(const job_t *job, model_t *m, double *acc_p)
{
    const mnist_set_t *set = job->test;
    int64_t idx[EVAL_CHUNK];
    int64_t one = 1;
    int64_t correct = 0;
    weft_tensor_t *counts = NULL;
    weft_status_t st;
    int prev;

    st = model_sync_buffers(m, job->pg, job->world);
    model_set_training(m, 0);
    prev = weft_grad_set_enabled(0);
    for (int64_t start = job->rank; st == WEFT_OK && start < set->count;
         start += (int64_t)EVAL_CHUNK * job->world) {
        weft_tensor_t *x = NULL;
        weft_tensor_t *y = NULL;
        weft_tensor_t *logp = NULL;
        weft_tensor_t *pred = NULL;
        int64_t k = 0;

        for (int64_t i = start; i < set->count && k < EVAL_CHUNK; i += job->world) {
            idx[k++] = i;
        }
        st = mnist_batch(set, idx, k, &x, &y);
        if (st == WEFT_OK) {
            st = model_forward(m, x, &logp);
        }
        if (st == WEFT_OK) {
            st = weft_op_argmax(logp, 1, 0, &pred);
        }
        for (int64_t i = 0; st == WEFT_OK && i < k; i++) {
            correct +=
                ((int64_t *)weft_tensor_data(pred))[i] == ((int64_t *)weft_tensor_data(y))[i];
        }
        weft_tensor_release(pred);
        weft_tensor_release(logp);
        weft_tensor_release(x);
        weft_tensor_release(y);
    }
    weft_grad_set_enabled(prev);
    model_set_training(m, 1);
    if (st == WEFT_OK) {
        st = weft_tensor_create(WEFT_I64, 1, &one, &counts);
    }
    if (st == WEFT_OK) {
        ((int64_t *)weft_tensor_data(counts))[0] = correct;
        st = weft_coll_all_reduce(job->pg, counts, WEFT_SUM, NULL);
    }
    if (st == WEFT_OK) {
        *acc_p = (double)((int64_t *)weft_tensor_data(counts))[0] / (double)set->count;
    }
    weft_tensor_release(counts);
    if (st != WEFT_OK) {
        fail("evaluate", st);
        return -1;
    }
    return 0;
}

static int train(const job_t *job, void *arg)
{
    const config_t *cfg = arg;
    mnist_shard_t sh;
    model_t m;
    ex_loop_t l;
    int64_t steps;
    uint64_t hash = 0;
    double acc = 0;
    double rss_max = 0;
    int same = 0;
    weft_status_t st;
    int rc = 1;

    memset(&m, 0, sizeof(m));
    if (mnist_shard_init(PROG, job, cfg->seed, &sh) != 0) {
        goto out;
    }
    /* A last batch of one sample is dropped: BatchNorm needs two (the same on every rank). */
    steps = sh.n / cfg->batch + (sh.n % cfg->batch >= 2 ? 1 : 0);
    ex_loop_init(&l, job->rank, job->world, cfg->epochs, steps, cfg->eval_every);
    st = model_init(&m, cfg, job->pg);
    if (st != WEFT_OK) {
        fail("model", st);
        goto out;
    }
    if (job->rank == 0) {
        printf(
            "CNN conv1(1->%d)-bn-relu-maxpool, BasicBlock(%d->%d, stride 2), avgpool, fc(%d->%d) "
            "(%lld parameters) on %lld Fashion-MNIST images, %d rank%s, batch %d per rank, SGD "
            "lr %g momentum %g, %lld steps per epoch\n",
            STEM_C, STEM_C, BLOCK_C, BLOCK_C, NCLASS, (long long)m.numel, (long long)job->used,
            job->world, job->world > 1 ? "s" : "", cfg->batch, cfg->lr, cfg->momentum,
            (long long)steps);
    }

    for (int epoch = 0; epoch < cfg->epochs; epoch++) {
        ex_loop_epoch_begin(&l);
        mnist_shard_epoch(&sh, epoch);
        for (int64_t s = 0; s < steps; s++) {
            int64_t k = s + 1 < steps ? cfg->batch : sh.n - s * cfg->batch;
            double loss = 0;
            double t0 = ex_now();

            weft_param_list_zero_grad(m.params);
            st = model_sync_buffers(&m, job->pg, job->world);
            if (st == WEFT_OK) {
                st = loss_backward(job, &m, sh.idx + s * cfg->batch, k, &loss);
            }
            if (st == WEFT_OK) {
                ex_loop_add_ddp(&l, m.ddp);
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
                ex_loop_eval_line(&l, s, acc);
            }
        }
        ex_loop_epoch_end(&l, epoch, acc);
    }

    if (ex_params_identical(PROG, job->pg, m.params, &same, &hash) != 0 ||
        ex_peak_rss(PROG, job->pg, &rss_max, NULL) != 0) {
        goto out;
    }
    if (job->rank == 0) {
        weft_ddp_stats_t ds;

        weft_ddp_stats(m.ddp, &ds);
        printf("final test accuracy %.2f%% after %.1f s of training\n", 100.0 * acc, l.train_time);
        ex_print_params_check(same, job->world, hash);
        if (cfg->json) {
            printf("{\"system\":\"weft\",\"model\":\"cnn\",\"world\":%d,\"batch\":%d,\"lr\":%g,"
                   "\"momentum\":%g,\"threads\":%d,\"limit\":%lld,\"epochs_run\":%d,\"steps\":%lld,"
                   "\"samples_per_s\":%.1f,\"step_ms\":%.3f,\"train_s\":%.3f,\"final_acc\":%.4f,"
                   "\"train_loss\":%.4f,\"params\":%lld,\"peak_rss_mb_max\":%.1f,"
                   "\"params_identical\":%s,\"buckets\":%d,\"comm_hidden\":",
                   job->world, cfg->batch, cfg->lr, cfg->momentum, cfg->threads,
                   (long long)job->used, l.epochs_run, (long long)l.step_total, ex_loop_rate(&l),
                   ex_loop_step_ms(&l), l.train_time, acc, l.loss_avg, (long long)m.numel, rss_max,
                   same ? "true" : "false", ds.buckets);
            if (job->world > 1 && l.comm_us > 0) {
                printf("%.3f}\n", 1.0 - l.exposed_us / l.comm_us);
            } else {
                printf("null}\n");
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
    return mnist_dp_main(PROG, cfg.data_dir, cfg.threads, cfg.limit, 28, 28, train, &cfg);
}
