/*
 * pipeline_train: torch's tutorial "Distributed Pipeline Parallelism Using RPC" in C, with weft's
 * RRefs, distributed autograd and distributed optimizer, on a small CNN for Fashion-MNIST.
 *
 *   weftrun -n 3 build/examples/pipeline_train [--splits 4] [--epochs 1] [--batch 128]
 *           [--lr 0.05] [--timing-batches 10] [--limit N] [--json] [--data DIR]
 *
 * Rank 0 is the master, rank 1 holds stage 1 and rank 2 stage 2 (the model of
 * bench/torch_dist_autograd.py's "pipeline" mode, its torch twin):
 *
 *   stage 1   Conv2d(1 -> 32, 3x3, padding 1), ReLU, MaxPool2d(2),
 *             Conv2d(32 -> 64, 3x3, padding 1), ReLU, MaxPool2d(2)      64 x 7 x 7
 *   stage 2   Flatten, Linear(3136 -> 128), ReLU, Linear(128 -> 10)      10
 *
 * and the loss is the cross entropy of the logits. Each stage is a remote object (type "stage",
 * made by the master with weft_rref_remote_object) with the methods
 *
 *   forward(x_rref)      x = to_here(x_rref), then the stage's layers under the stage's lock
 *                        (the tutorial's ResNetShard.forward), in the caller's distributed
 *                        autograd context, so the fetch records a send function on the value's
 *                        owner and a receive function here; the method hands this to one of
 *                        PIPE_STAGE_THREADS threads of the stage's rank (torch's RPC thread
 *                        pool), which answers the call (see pipeline_stage.h for why);
 *   parameter_rrefs()    an RRef of each parameter (weft_rref_create on a value holding it);
 *   grad_stats(ctx)      how many parameters have a gradient in a context, and its sum of squares;
 *   param_sum()          the sum of the parameters' elements.
 *
 * Per batch the master, in a context, cuts the batch into k micro-batches (torch's tensor_split)
 * and for each: x_rref = weft_rref_create(micro-batch); y_rref = weft_rref_remote_method(stage 1,
 * "forward", x_rref) (the output stays on rank 1); z = weft_rref_rpc_async(stage 2, "forward",
 * y_rref) (stage 2 fetches y from rank 1 and answers with its output). Stage 1 works on micro-batch
 * i + 1 while stage 2 works on micro-batch i: the pipeline. The master then waits for every z,
 * concatenates them, takes the loss, runs weft_dist_backward (the gradients flow back from rank 0
 * to rank 2, from rank 2 to rank 1, along the recorded calls) and steps a DistributedOptimizer
 * (SGD, --lr) over both stages' parameter RRefs with the context's gradients.
 *
 * First the timing runs, as the tutorial's: for k = 1, 2, 4 and 8 splits, fresh stages (the same
 * seed) train on batches of 128 random images and labels (the same for every k, from a fixed
 * seed): one warm-up batch, then --timing-batches timed ones; "number of splits = k, execution
 * time = t" gives the mean seconds per batch (forward, backward and the optimizer's step). The
 * warm-up batch is also a check: every stage parameter got a gradient, stage 1's parameters
 * changed with the step, and the loss and the gradients' sums of squares agree across the split
 * counts (the model treats each image alone: splitting a batch changes only the order of the
 * sums). Then fresh stages train on Fashion-MNIST for --epochs with --splits, and the test
 * accuracy is measured through the pipeline without a context (no graph anywhere).
 *
 * The stages' ranks serve until the master is done (common.h's wait_done: ex_wait_done), then
 * every rank shuts down. The machine's cores are shared by the three ranks: each uses one BLAS
 * thread. The stage type's layers and forward, the stages' thread pool and the micro-batch
 * driver are pipeline_stage.c's, shared with pipeline_ddp.
 *
 * Exit status: 0 on success, 2 for bad options, a world other than 3 ranks, or missing or corrupt
 * data, 1 for any other failure (a check included).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <weft/weft.h>

#include "common.h"
#include "mnist.h"
#include "pipeline_stage.h"

#define PROG            "pipeline_train"
#define IMAGE_SIDE      PIPE_IMAGE_SIDE
#define MASTER          0
#define N_STAGES        2
#define TIMING_BATCH    128
#define MAX_SPLITS      PIPE_MAX_SPLITS
#define CHECK_RTOL      1e-4
#define CALL_TIMEOUT_MS 0 /* the agent's call timeout */

static const int TIMING_SPLITS[] = {1, 2, 4, 8};
#define N_TIMING ((int)(sizeof(TIMING_SPLITS) / sizeof(TIMING_SPLITS[0])))

/* ---------------------------------------------------------- configuration */

typedef struct {
    int epochs;
    int batch;
    int splits;
    double lr;
    int64_t limit;      /* training batches per epoch; 0: all */
    int64_t test_limit; /* test images scored; 0: all */
    int timing_batches; /* 0: no timing runs */
    uint64_t seed;
    int json;
    const char *data_dir;
} config_t;

static void usage(FILE *out)
{
    fprintf(out,
            "usage: weftrun -n 3 pipeline_train [options]   (rank 0 the master, ranks 1 and 2\n"
            "       the stages)\n"
            "  --splits N           micro-batches per training batch (default 4, at most 64)\n"
            "  --epochs N           passes over the training set (default 1; 0: the timing runs\n"
            "                       only, no data needed)\n"
            "  --batch N            training batch size (default 128)\n"
            "  --lr X               the distributed optimizer's SGD learning rate (default 0.05)\n"
            "  --limit N            at most N training batches per epoch\n"
            "  --test-limit N       score the first N test images only (default: all 10000)\n"
            "  --timing-batches N   timed batches per split count, after a warm-up one\n"
            "                       (default 10; 0: no timing runs)\n"
            "  --seed N             initialisation, data and shuffling seed (default 1)\n"
            "  --json               print a JSON summary line at the end\n"
            "  --data DIR           Fashion-MNIST IDX files (default $WEFT_DATA_DIR, else\n"
            "                       " MNIST_DEFAULT_DIR ")\n");
}

/* Returns 0, 1 after --help, or EX_EXIT_USAGE after a message. */
static int parse_args(int argc, char **argv, config_t *cfg)
{
    const ex_opt_t opts[] = {
        EX_INT("splits", &cfg->splits, 1, MAX_SPLITS),
        EX_INT("epochs", &cfg->epochs, 0, 100000),
        EX_INT("batch", &cfg->batch, 1, 1 << 16),
        EX_DOUBLE("lr", &cfg->lr, 0.0, 1e6),
        EX_I64("limit", &cfg->limit, 1, INT64_MAX),
        EX_I64("test-limit", &cfg->test_limit, 1, INT64_MAX),
        EX_INT("timing-batches", &cfg->timing_batches, 0, 1000000),
        EX_U64("seed", &cfg->seed, 0, INT64_MAX),
        EX_FLAG("json", &cfg->json),
        EX_STR("data", &cfg->data_dir),
    };

    memset(cfg, 0, sizeof(*cfg));
    cfg->epochs = 1;
    cfg->batch = 128;
    cfg->splits = 4;
    cfg->lr = 0.05;
    cfg->timing_batches = 10;
    cfg->seed = 1;
    cfg->data_dir = mnist_default_dir();
    return ex_parse_opts(PROG, argc, argv, opts, sizeof(opts) / sizeof(opts[0]), usage);
}

/* ------------------------------------------------------------------ stages */

/* The constructor's payload. Payloads are fixed-layout structs: every rank runs this program on
 * one kind of machine (a real program would pin the byte order). */
typedef struct {
    int32_t k;     /* 1 or 2 */
    uint64_t seed; /* the parameters' stream */
} stage_msg_t;

/* What grad_stats answers. */
typedef struct {
    int32_t with_grad;
    int32_t params;
    double sum_sq;
} grads_msg_t;

static weft_status_t stage_ctor(const weft_value_t *args, void *type_arg, void **obj_p)
{
    const stage_msg_t *m;
    pipe_stage_t *s = NULL;
    size_t len = 0;
    weft_status_t st;

    (void)type_arg;
    m = weft_value_payload(args, &len);
    if (m == NULL || len != sizeof(*m) || (m->k != 1 && m->k != 2)) {
        return WEFT_ERR_INVALID_ARG;
    }
    st = pipe_stage_create(m->k, m->seed, &s);
    if (st != WEFT_OK) {
        return st;
    }
    *obj_p = s;
    return WEFT_OK;
}

static void stage_dtor(void *obj, void *type_arg)
{
    pipe_stage_t *s = obj;

    (void)type_arg;
    printf("stage %d freed by its owner after %lld forward passes (%lld in a context)\n", s->k,
           (long long)s->forwards, (long long)s->recorded);
    pipe_stage_free(s);
}

/* parameter_rrefs() -> an RRef of each parameter, owned here. */
static void stage_parameter_rrefs(void *obj, weft_call_t *call, void *type_arg)
{
    pipe_stage_t *s = obj;
    weft_value_t *res = NULL;
    weft_status_t st = weft_value_create(&res);

    (void)type_arg;
    for (int i = 0; st == WEFT_OK && i < weft_param_list_size(s->params); i++) {
        weft_value_t *pv = NULL;
        weft_rref_t *r = NULL;

        st = weft_value_create(&pv);
        if (st == WEFT_OK) {
            st = weft_value_add_tensor(pv, weft_param_list_get(s->params, i));
        }
        if (st == WEFT_OK) {
            st = weft_rref_create(weft_call_agent(call), pv, &r);
        }
        if (st != WEFT_OK) {
            weft_value_free(pv);
            break;
        }
        st = weft_value_add_rref(res, r);
        weft_rref_release(r);
    }
    if (st != WEFT_OK) {
        weft_value_free(res);
        weft_call_fail(call, st, "stage %d: parameter_rrefs: %s", s->k, weft_last_error());
        return;
    }
    weft_call_reply(call, res);
}

/* grad_stats(payload: a context id) -> grads_msg_t. */
static void stage_grad_stats(void *obj, weft_call_t *call, void *type_arg)
{
    pipe_stage_t *s = obj;
    size_t len = 0;
    const uint64_t *ctx = weft_value_payload(weft_call_args(call), &len);
    weft_dist_grads_t *g = NULL;
    grads_msg_t m;
    weft_status_t st;

    (void)type_arg;
    if (ctx == NULL || len != sizeof(*ctx)) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "grad_stats wants a context id");
        return;
    }
    st = weft_dist_get_gradients(weft_call_agent(call), *ctx, &g);
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "%s", weft_last_error());
        return;
    }
    memset(&m, 0, sizeof(m));
    m.params = weft_param_list_size(s->params);
    for (int i = 0; i < m.params; i++) {
        const weft_tensor_t *gr = weft_dist_grads_find(g, weft_param_list_get(s->params, i));
        const float *d = gr != NULL ? weft_tensor_data(gr) : NULL;

        m.with_grad += gr != NULL;
        for (int64_t j = 0; d != NULL && j < weft_tensor_numel(gr); j++) {
            m.sum_sq += (double)d[j] * (double)d[j];
        }
    }
    weft_dist_grads_free(g);
    ex_reply_payload(call, &m, sizeof(m));
}

/* param_sum() -> the sum of the parameters' elements (a double). */
static void stage_param_sum(void *obj, weft_call_t *call, void *type_arg)
{
    pipe_stage_t *s = obj;
    double sum = 0;

    (void)type_arg;
    for (int i = 0; i < weft_param_list_size(s->params); i++) {
        const weft_tensor_t *p = weft_param_list_get(s->params, i);
        const float *d = weft_tensor_data(p);
        for (int64_t j = 0; j < weft_tensor_numel(p); j++) {
            sum += d[j];
        }
    }
    ex_reply_payload(call, &sum, sizeof(sum));
}

static const weft_rref_method_t stage_methods[] = {
    {"forward", pipe_stage_forward},
    {"parameter_rrefs", stage_parameter_rrefs},
    {"grad_stats", stage_grad_stats},
    {"param_sum", stage_param_sum},
};

/* ------------------------------------------------------------------ the master's model */

typedef struct {
    weft_agent_t *a;
    weft_rref_t *stage[N_STAGES]; /* stage k + 1 on rank k + 1 */
    weft_rref_t **params;         /* both stages' parameter RRefs */
    size_t n_params;
    weft_dist_optim_t *opt;
} model_t;

static void fail(const char *what, weft_status_t st)
{
    ex_fail(PROG, what, st);
}

static void model_free(model_t *m)
{
    weft_dist_optim_free(m->opt);
    for (size_t i = 0; i < m->n_params; i++) {
        weft_rref_release(m->params[i]);
    }
    free(m->params);
    for (int k = 0; k < N_STAGES; k++) {
        weft_rref_release(m->stage[k]);
    }
    memset(m, 0, sizeof(*m));
}

/* Both stages made anew from @p seed on their ranks, their parameters' RRefs and the optimizer. */
static int model_init(model_t *m, weft_agent_t *a, uint64_t seed, double lr)
{
    weft_dist_optim_config_t oc;
    const char *what = "stage";
    weft_status_t st = WEFT_OK;

    memset(m, 0, sizeof(*m));
    m->a = a;
    /* remote_object returns at once: both constructions go on together. */
    for (int k = 0; st == WEFT_OK && k < N_STAGES; k++) {
        stage_msg_t sm = {.k = k + 1, .seed = seed};
        weft_value_t *args = NULL;

        st = weft_value_create(&args);
        if (st == WEFT_OK) {
            st = weft_value_set_payload(args, &sm, sizeof(sm));
        }
        if (st == WEFT_OK) {
            st = weft_rref_remote_object(a, k + 1, "stage", args, CALL_TIMEOUT_MS, &m->stage[k]);
        }
        weft_value_free(args);
    }
    for (int k = 0; st == WEFT_OK && k < N_STAGES; k++) {
        weft_value_t *res = NULL;
        size_t n;
        weft_rref_t **grown;

        what = "parameter_rrefs";
        st = weft_rref_rpc_sync(m->stage[k], "parameter_rrefs", NULL, CALL_TIMEOUT_MS, &res);
        n = st == WEFT_OK ? weft_value_num_refs(res) : 0;
        grown = st == WEFT_OK ? realloc(m->params, (m->n_params + n + 1) * sizeof(*grown)) : NULL;
        if (st == WEFT_OK && grown == NULL) {
            st = WEFT_ERR_NO_MEMORY;
        }
        if (st == WEFT_OK) {
            m->params = grown;
            for (size_t i = 0; i < n; i++) {
                m->params[m->n_params++] = weft_rref_retain(weft_value_rref(res, i));
            }
        }
        weft_value_free(res);
    }
    if (st == WEFT_OK) {
        what = "distributed optimizer";
        weft_dist_optim_config_init(&oc, WEFT_DIST_OPTIM_SGD, lr);
        st = weft_dist_optim_create(a, &oc, m->n_params, m->params, &m->opt);
    }
    if (st != WEFT_OK) {
        fail(what, st);
        model_free(m);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ the pipeline */

/* The pipeline's forward of batch @p x [B, ...] (pipe_forward over the model's one pipeline, at
 * most @p splits micro-batches in flight), into @p out_p [B, 10] (caller releases).
 * @return 0, or -1 after a message. */
static int pipeline_forward(model_t *m, weft_tensor_t *x, int splits, weft_tensor_t **out_p)
{
    const pipe_lines_t l = {
        .prog = PROG, .a = m->a, .n = 1, .first = &m->stage[0], .second = &m->stage[1]};

    return pipe_forward(&l, x, splits, out_p);
}

/* What the check of a batch's step found. */
typedef struct {
    double loss;
    grads_msg_t g[N_STAGES];
    double sum_before, sum_after; /* stage 1's parameters, before and after the step */
} check_t;

/* A method of a stage that answers a payload of @p len bytes into @p out; @p args may be NULL. */
static weft_status_t stage_query(weft_rref_t *stage, const char *method, const weft_value_t *args,
                                 void *out, size_t len)
{
    weft_value_t *res = NULL;
    weft_status_t st = weft_rref_rpc_sync(stage, method, args, CALL_TIMEOUT_MS, &res);
    size_t got = 0;

    if (st == WEFT_OK) {
        const void *p = weft_value_payload(res, &got);
        if (p == NULL || got != len) {
            st = WEFT_ERR_PROTOCOL;
        } else {
            memcpy(out, p, len);
        }
    }
    weft_value_free(res);
    return st;
}

/* Both stages' gradients in context @p ctx, and stage 1's parameter sum. */
static weft_status_t check_grads(model_t *m, uint64_t ctx, check_t *chk)
{
    weft_value_t *args = NULL;
    weft_status_t st = weft_value_create(&args);

    if (st == WEFT_OK) {
        st = weft_value_set_payload(args, &ctx, sizeof(ctx));
    }
    for (int k = 0; st == WEFT_OK && k < N_STAGES; k++) {
        st = stage_query(m->stage[k], "grad_stats", args, &chk->g[k], sizeof(chk->g[k]));
    }
    if (st == WEFT_OK) {
        st = stage_query(m->stage[0], "param_sum", NULL, &chk->sum_before, sizeof(double));
    }
    weft_value_free(args);
    return st;
}

/* One training step on images @p x and labels @p y with @p splits micro-batches, in a context of
 * its own: forward, loss, distributed backward, the optimizer's step. The loss into @p loss_p;
 * with @p chk, what check_t says.
 * @return 0, or -1 after a message. */
static int train_step(model_t *m, weft_tensor_t *x, weft_tensor_t *y, int splits, double *loss_p,
                      check_t *chk)
{
    weft_tensor_t *out = NULL;
    weft_tensor_t *loss = NULL;
    const char *what = "context";
    uint64_t ctx = 0;
    weft_status_t st;
    int rc = -1;

    st = weft_dist_context_create(m->a, &ctx);
    if (st != WEFT_OK) {
        fail(what, st);
        return -1;
    }
    if (pipeline_forward(m, x, splits, &out) != 0) {
        goto out;
    }
    what = "loss";
    st = weft_op_cross_entropy(out, y, WEFT_REDUCTION_MEAN, &loss);
    if (st == WEFT_OK) {
        *loss_p = ((const float *)weft_tensor_data(loss))[0];
        what = "distributed backward";
        st = weft_dist_backward(m->a, ctx, 1, &loss, NULL);
    }
    if (st == WEFT_OK && chk != NULL) {
        chk->loss = *loss_p;
        what = "gradient check";
        st = check_grads(m, ctx, chk);
    }
    if (st == WEFT_OK) {
        what = "optimizer step";
        st = weft_dist_optim_step(m->opt, ctx, 0);
    }
    if (st == WEFT_OK && chk != NULL) {
        what = "param_sum";
        st = stage_query(m->stage[0], "param_sum", NULL, &chk->sum_after, sizeof(double));
    }
    if (st != WEFT_OK) {
        fail(what, st);
        goto out;
    }
    rc = 0;

out:
    st = weft_dist_context_release(m->a, ctx, 0);
    if (st != WEFT_OK && rc == 0) {
        fail("context release", st);
        rc = -1;
    }
    weft_tensor_release(loss);
    weft_tensor_release(out);
    return rc;
}

/* ------------------------------------------------------------------ the timing runs */

/* Whether @p c, the warm-up check of one split count, is sound on its own: every parameter got a
 * gradient, the loss and gradients are finite, and stage 1's parameters changed. */
static int check_sound(const check_t *c)
{
    for (int k = 0; k < N_STAGES; k++) {
        if (c->g[k].params < 1 || c->g[k].with_grad != c->g[k].params || !(c->g[k].sum_sq > 0) ||
            !isfinite(c->g[k].sum_sq)) {
            return 0;
        }
    }
    return isfinite(c->loss) && c->sum_after != c->sum_before;
}

/* For k = 1, 2, 4, 8 splits: fresh stages, one warm-up batch (checked) and @p cfg->timing_batches
 * timed ones of TIMING_BATCH random images; the mean milliseconds per batch into @p ms.
 * @return 0, or -1 after a message. */
static int timing_runs(weft_agent_t *a, const config_t *cfg, double *ms)
{
    const int nb = cfg->timing_batches + 1;
    weft_tensor_t **xs = calloc((size_t)nb, sizeof(*xs));
    weft_tensor_t **ys = calloc((size_t)nb, sizeof(*ys));
    check_t chk[N_TIMING];
    double worst = 0;
    int rc = -1;

    if (xs == NULL || ys == NULL) {
        fprintf(stderr, PROG ": out of memory\n");
        goto out;
    }
    /* The same batches for every split count. */
    if (pipe_random_batches(PROG, cfg->seed, nb, TIMING_BATCH, xs, ys) != 0) {
        goto out;
    }
    for (int t = 0; t < N_TIMING; t++) {
        const int k = TIMING_SPLITS[t];
        model_t m;
        double loss = 0;
        double t0;

        if (model_init(&m, a, cfg->seed, cfg->lr) != 0) {
            goto out;
        }
        if (train_step(&m, xs[0], ys[0], k, &loss, &chk[t]) != 0) {
            model_free(&m);
            goto out;
        }
        t0 = ex_now();
        for (int i = 1; i < nb; i++) {
            if (train_step(&m, xs[i], ys[i], k, &loss, NULL) != 0) {
                model_free(&m);
                goto out;
            }
        }
        ms[t] = cfg->timing_batches > 0 ? 1e3 * (ex_now() - t0) / cfg->timing_batches : 0.0;
        model_free(&m);
        printf("splits %d warm-up batch: loss %.6f, gradients for %d of %d parameters on stage 1 "
               "(sum of squares %.6g) and %d of %d on stage 2 (%.6g), stage 1 parameters "
               "changed: %s\n",
               k, chk[t].loss, chk[t].g[0].with_grad, chk[t].g[0].params, chk[t].g[0].sum_sq,
               chk[t].g[1].with_grad, chk[t].g[1].params, chk[t].g[1].sum_sq,
               chk[t].sum_after != chk[t].sum_before ? "yes" : "no");
        printf("number of splits = %d, execution time = %.4f\n", k, ms[t] / 1e3);
        if (!check_sound(&chk[t])) {
            fprintf(stderr, PROG ": %d splits: the warm-up batch's check failed (see above)\n", k);
            goto out;
        }
        worst = fmax(worst, ex_rel_diff(chk[t].loss, chk[0].loss));
        for (int s = 0; s < N_STAGES; s++) {
            worst = fmax(worst, ex_rel_diff(chk[t].g[s].sum_sq, chk[0].g[s].sum_sq));
        }
    }
    printf("first batch's loss and gradients agree across 1, 2, 4 and 8 splits: %s (largest "
           "relative difference %.1e)\n",
           worst <= CHECK_RTOL ? "yes" : "no", worst);
    if (worst > CHECK_RTOL) {
        fprintf(stderr, PROG ": the split count changed the gradients by more than %g\n",
                CHECK_RTOL);
        goto out;
    }
    rc = 0;

out:
    for (int i = 0; i < nb; i++) {
        if (xs != NULL) {
            weft_tensor_release(xs[i]);
        }
        if (ys != NULL) {
            weft_tensor_release(ys[i]);
        }
    }
    free(xs);
    free(ys);
    return rc;
}

/* ------------------------------------------------------------------ training */

typedef struct {
    weft_agent_t *a;
    const config_t *cfg;
    const mnist_set_t *train;
    const mnist_set_t *test;
} job_t;

/* The fraction of the first @p n test images classified right, through the pipeline without a
 * context: no graph is recorded anywhere. @return 0, or -1 after a message. */
static int evaluate(const job_t *job, model_t *m, int64_t n, double *acc_p)
{
    const pipe_lines_t l = {
        .prog = PROG, .a = m->a, .n = 1, .first = &m->stage[0], .second = &m->stage[1]};

    return pipe_evaluate(&l, job->test, n, job->cfg->batch, job->cfg->splits, acc_p);
}

/* Fresh stages trained on Fashion-MNIST; the test accuracy into @p acc_p, the training's
 * bookkeeping into @p l. @return 0, or -1 after a message. */
static int train(const job_t *job, ex_loop_t *l, int64_t *steps_p, double *acc_p)
{
    const config_t *cfg = job->cfg;
    const int64_t n = job->train->count;
    const int64_t test_n = cfg->test_limit > 0 && cfg->test_limit < job->test->count
                               ? cfg->test_limit
                               : job->test->count;
    int64_t steps = (n + cfg->batch - 1) / cfg->batch;
    int64_t *perm = malloc((size_t)n * sizeof(*perm));
    model_t m;
    double acc = 0;
    int rc = -1;

    memset(&m, 0, sizeof(m));
    if (perm == NULL) {
        fprintf(stderr, PROG ": out of memory\n");
        goto out;
    }
    if (cfg->limit > 0 && cfg->limit < steps) {
        steps = cfg->limit;
    }
    if (model_init(&m, job->a, cfg->seed, cfg->lr) != 0) {
        goto out;
    }
    printf("training on Fashion-MNIST: %lld batches of %d per epoch, %d split%s, "
           "DistributedOptimizer SGD lr %g over %zu parameter RRefs, %lld test images\n",
           (long long)steps, cfg->batch, cfg->splits, cfg->splits > 1 ? "s" : "", cfg->lr,
           m.n_params, (long long)test_n);
    ex_loop_init(l, 0, 1, cfg->epochs, steps, 0);
    for (int epoch = 0; epoch < cfg->epochs; epoch++) {
        ex_loop_epoch_begin(l);
        ex_epoch_perm(cfg->seed, epoch, n, perm);
        for (int64_t s = 0; s < steps; s++) {
            int64_t k = (s + 1) * cfg->batch <= n ? cfg->batch : n - s * cfg->batch;
            weft_tensor_t *x = NULL;
            weft_tensor_t *y = NULL;
            double loss = 0;
            double t0 = ex_now();
            weft_status_t st = mnist_batch(job->train, perm + s * cfg->batch, k, &x, &y);
            int bad;

            if (st != WEFT_OK) {
                fail("batch", st);
                goto out;
            }
            bad = train_step(&m, x, y, cfg->splits, &loss, NULL) != 0;
            weft_tensor_release(x);
            weft_tensor_release(y);
            if (bad) {
                goto out;
            }
            if (!isfinite(loss)) {
                fprintf(stderr, PROG ": batch %lld: the loss is %g\n", (long long)s, loss);
                goto out;
            }
            if (ex_loop_step_end(l, epoch, s, k, loss, t0)) {
                if (evaluate(job, &m, test_n, &acc) != 0) {
                    goto out;
                }
            }
        }
        ex_loop_epoch_end(l, epoch, acc);
    }
    printf("Test accuracy: %.2f%%\n", 100.0 * acc);
    *acc_p = acc;
    *steps_p = steps;
    rc = 0;

out:
    model_free(&m);
    free(perm);
    return rc;
}

/* The master's part: the timing runs, the training, the JSON line. */
static int run_master(const job_t *job)
{
    const config_t *cfg = job->cfg;
    double ms[N_TIMING] = {0};
    double acc = 0;
    int64_t steps = 0;
    ex_loop_t l;

    printf("pipeline over %s (stage 1: conv(1->32)-relu-maxpool-conv(32->64)-relu-maxpool) and "
           "%s (stage 2: flatten-fc(3136->128)-relu-fc(128->10)), master %s\n",
           weft_agent_worker_name(job->a, 1), weft_agent_worker_name(job->a, 2),
           weft_agent_name(job->a));
    if (cfg->timing_batches > 0) {
        printf("timing: batches of %d random images, 1 warm-up and %d timed batches per split "
               "count\n",
               TIMING_BATCH, cfg->timing_batches);
        if (timing_runs(job->a, cfg, ms) != 0) {
            return 1;
        }
    }
    memset(&l, 0, sizeof(l));
    if (cfg->epochs > 0 && train(job, &l, &steps, &acc) != 0) {
        return 1;
    }
    if (cfg->json) {
        printf("{\"system\":\"weft\",\"model\":\"pipeline\",\"batch\":%d,\"timing_batch\":%d,"
               "\"timing_batches\":%d",
               cfg->batch, TIMING_BATCH, cfg->timing_batches);
        for (int t = 0; t < N_TIMING; t++) {
            if (cfg->timing_batches > 0) {
                printf(",\"pipeline_s%d_ms\":%.3f", TIMING_SPLITS[t], ms[t]);
            } else {
                printf(",\"pipeline_s%d_ms\":null", TIMING_SPLITS[t]);
            }
        }
        printf(",\"splits\":%d,\"lr\":%g,\"epochs_run\":%d,\"steps\":%lld,\"train_s\":%.3f,"
               "\"step_ms\":%.3f,\"train_loss\":%.4f,\"accuracy\":%.4f}\n",
               cfg->splits, cfg->lr, l.epochs_run, (long long)l.step_total, l.train_time,
               ex_loop_step_ms(&l), l.loss_avg, acc);
    }
    (void)steps;
    return 0;
}

/* ----------------------------------------------------------------- main */

int main(int argc, char **argv)
{
    config_t cfg;
    mnist_set_t train_set = {0}, test_set = {0};
    weft_agent_opts_t opts;
    weft_agent_t *a = NULL;
    pipe_pool_t pool;
    int have_pool = 0;
    ex_done_t done = EX_DONE_INIT;
    weft_status_t st;
    int rc;

    setvbuf(stdout, NULL, _IOLBF, 0);
    rc = parse_args(argc, argv, &cfg);
    if (rc != 0) {
        return rc == 1 ? 0 : rc;
    }
    weft_op_set_threads(1);
    /* Data first, on every rank: a missing or corrupt file ends the run before anyone waits. */
    if (cfg.epochs > 0 && mnist_load_splits(PROG, cfg.data_dir, &train_set, &test_set) != 0) {
        return EX_EXIT_USAGE;
    }
    if (cfg.epochs > 0 && (train_set.rows != IMAGE_SIDE || train_set.cols != IMAGE_SIDE)) {
        fprintf(stderr, PROG ": the images are %dx%d; the model takes %dx%d\n", train_set.rows,
                train_set.cols, IMAGE_SIDE, IMAGE_SIDE);
        rc = EX_EXIT_USAGE;
        goto err_free_data;
    }

    weft_agent_opts_init(&opts);
    st = weft_agent_create(&opts, &a);
    if (st != WEFT_OK) {
        fail("cannot start the agent", st);
        rc = 1;
        goto err_free_data;
    }
    if (weft_agent_world_size(a) != 1 + N_STAGES) {
        fprintf(stderr, PROG ": runs on exactly %d ranks (the master and %d stages), not %d\n",
                1 + N_STAGES, N_STAGES, weft_agent_world_size(a));
        rc = EX_EXIT_USAGE;
        goto err_free_agent;
    }
    /* Every rank, before the join: distributed autograd, RRefs and the stages' type. */
    st = weft_dist_init(a);
    if (st == WEFT_OK) {
        st = weft_rref_init(a);
    }
    if (st != WEFT_OK) {
        fail("setup", st);
        rc = 1;
        goto err_free_agent;
    }
    /* The master answers the stages' wait_done once it is done. The stages' ranks own stage
     * objects: their type, and the threads of their forwards. */
    if (weft_agent_rank(a) == MASTER) {
        st = weft_rpc_register(a, "wait_done", ex_wait_done_fn, &done);
        if (st != WEFT_OK) {
            fail("register", st);
            rc = 1;
            goto err_free_agent;
        }
    } else {
        have_pool = 1; /* what started is stopped, even after a failure */
        if (pipe_pool_start(PROG, &pool, a) != 0) {
            rc = 1;
            goto err_stop_pool;
        }
        st =
            weft_rref_register_type(a, "stage", stage_ctor, stage_dtor, stage_methods,
                                    (int)(sizeof(stage_methods) / sizeof(stage_methods[0])), &pool);
        if (st != WEFT_OK) {
            fail("setup", st);
            rc = 1;
            goto err_stop_pool;
        }
    }
    st = weft_agent_join(a);
    if (st != WEFT_OK) {
        fail("join", st);
        rc = 1;
        goto err_stop_pool;
    }
    if (weft_agent_rank(a) == MASTER) {
        job_t job = {.a = a, .cfg = &cfg, .train = &train_set, .test = &test_set};
        rc = run_master(&job);
        ex_done_announce(&done);
    } else {
        /* The stages serve until the master is done: the shutdown is collective. */
        rc =
            ex_wait_done(PROG, a, MASTER, MASTER, "waiting for the others to be done") == 0 ? 0 : 1;
    }
    rc = ex_agent_shutdown(PROG, a, rc);

err_stop_pool:
    /* After the shutdown no forward comes: the threads end (the agent still exists for what
     * they were answering). */
    if (have_pool) {
        pipe_pool_stop(&pool);
    }
err_free_agent:
    weft_agent_free(a);
err_free_data:
    mnist_free(&train_set);
    mnist_free(&test_set);
    return rc;
}
