/*
 * rpc_ps_tutorial: torch's tutorial "Implementing a Parameter Server Using Distributed RPC
 * Framework" in C, with weft's distributed autograd, RRefs and distributed optimizer.
 *
 *   weftrun -n 3 build/examples/rpc_ps_tutorial [--epochs 1] [--batch 32] [--lr 0.03]
 *           [--limit N] [--test-limit N] [--data DIR]   (--help lists all)
 *
 * Rank 0 is the parameter server. It holds the tutorial's CNN (torch's Net, for 1 x 28 x 28
 * images), whose parameters are leaves that require gradients:
 *
 *   conv1    Conv2d(1 -> 32, 3x3), ReLU                    32 x 26 x 26
 *   conv2    Conv2d(32 -> 64, 3x3), max_pool2d(2)          64 x 12 x 12
 *            dropout2d(0.25), flatten                       9216
 *   fc1      Linear(9216 -> 128), ReLU, dropout(0.5)        128
 *   fc2      Linear(128 -> 10), log_softmax                 10
 *
 * and serves four functions:
 *
 *   forward             runs the model on the batch it received and answers with the output
 *                       (log-probabilities), under a lock as the tutorial's ParameterServer does:
 *                       the model, and its dropout generator, are shared by every trainer;
 *   get_param_rrefs     answers with a new RRef of each parameter (torch's [RRef(p) for p in
 *                       model.parameters()]): weft_rref_create on a value holding the tensor;
 *   get_dist_gradients  how many parameters have a gradient in the caller's context, and the
 *                       sum of their squares (the tutorial asserts the gradients are not empty);
 *   param_checksum      an FNV-1a hash of the parameters' bytes.
 *
 * Ranks 1..N-1 are trainers. Each gets the parameters' RRefs from the server and makes a
 * DistributedOptimizer of them (SGD, --lr), then loops over its shard of Fashion-MNIST (trainer
 * t of T takes the samples t, t + T, ... of each epoch's shuffle; batches of --batch). Per batch,
 * in a distributed autograd context: the server's forward by RPC (the answer records a send
 * function on the server and a receive function here), nll_loss here, weft_dist_backward (the
 * gradient flows back into the server's graph, whose leaves are the parameters), the check that
 * the server holds a gradient for every parameter in this context, the optimizer's step with this
 * context's gradients, and the context's release. The parameters are shared by the trainers
 * concurrently (hogwild, as in the tutorial): each trainer's gradients go to its own context and
 * its optimizer steps with them. After training, each trainer scores the test set through the
 * server's forward in eval mode (no dropout, no graph, no context; the tutorial leaves the
 * server's model in training mode there, a slip this example does not copy).
 *
 * The server's functions run on weft's threads: the trainers' optimizer steps (small messages) on
 * the transport thread, one at a time with the default WEFT_HANDLER_THREADS=1 (with more, two
 * trainers' steps could update the shared parameters at once: dist_autograd serializes the steps
 * of one DistributedOptimizer, not those of two over the same parameters); the forward passes of
 * full batches (over 64 KiB) on the thread that serves large messages, concurrently with the
 * steps (hogwild, as in the tutorial). The server serves until every trainer is done
 * (common.h's wait_done: ex_wait_done), then every rank shuts down.
 *
 * Output, as the tutorial's: "Rank R training batch I loss L" every 20 batches (and the last),
 * "Training complete!", "Getting accuracy....", "Accuracy A" (the fraction of the test images
 * classified right), each from every trainer; weftrun prefixes "[rank R]".
 *
 * Exit status: 0 on success, 2 for bad options, fewer than 2 ranks, or missing or corrupt data,
 * 1 for any other failure.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <weft/weft.h>

#include "common.h"
#include "mnist.h"

#define PROG            "rpc_ps_tutorial"
#define PS_RANK         0
#define NCLASS          MNIST_CLASSES
#define LOG_EVERY       20
#define CALL_TIMEOUT_MS 0 /* the agent's call timeout */
#define IMAGE_SIDE      28

/* ---------------------------------------------------------- configuration */

typedef struct {
    int epochs;
    int batch;
    double lr;
    int64_t limit;      /* batches per trainer and epoch; 0: the whole shard */
    int64_t test_limit; /* test images scored; 0: all */
    uint64_t seed;
    const char *data_dir;
} config_t;

static void usage(FILE *out)
{
    fprintf(out,
            "usage: weftrun -n N rpc_ps_tutorial [options]   (rank 0 the parameter server, ranks\n"
            "       1..N-1 trainers; N >= 2, default 3)\n"
            "  --epochs N       passes over each trainer's shard (default 1)\n"
            "  --batch N        minibatch size (default 32)\n"
            "  --lr X           SGD learning rate of the distributed optimizer (default 0.03)\n"
            "  --limit N        at most N batches per trainer and epoch\n"
            "  --test-limit N   score the first N test images only (default: all 10000)\n"
            "  --seed N         initialisation, dropout and shuffling seed (default 1)\n"
            "  --data DIR       Fashion-MNIST IDX files (default $WEFT_DATA_DIR, else\n"
            "                   " MNIST_DEFAULT_DIR ")\n");
}

/* Returns 0, 1 after --help, or EX_EXIT_USAGE after a message. */
static int parse_args(int argc, char **argv, config_t *cfg)
{
    const ex_opt_t opts[] = {
        EX_INT("epochs", &cfg->epochs, 1, 100000),
        EX_INT("batch", &cfg->batch, 1, 1 << 16),
        EX_DOUBLE("lr", &cfg->lr, 0.0, 1e6),
        EX_I64("limit", &cfg->limit, 1, INT64_MAX),
        EX_I64("test-limit", &cfg->test_limit, 1, INT64_MAX),
        EX_U64("seed", &cfg->seed, 0, INT64_MAX),
        EX_STR("data", &cfg->data_dir),
    };

    memset(cfg, 0, sizeof(*cfg));
    cfg->epochs = 1;
    cfg->batch = 32;
    cfg->lr = 0.03;
    cfg->seed = 1;
    cfg->data_dir = mnist_default_dir();
    return ex_parse_opts(PROG, argc, argv, opts, sizeof(opts) / sizeof(opts[0]), usage);
}

/* ------------------------------------------------------- the server's model */

/* The tutorial's Net. Its parameters are leaves that require gradients; the lock serialises the
 * forward passes (and the dropout generator they draw from). */
typedef struct {
    pthread_mutex_t mu;
    weft_nn_conv2d_t *conv1;
    weft_nn_conv2d_t *conv2;
    weft_nn_linear_t *fc1;
    weft_nn_linear_t *fc2;
    weft_param_list_t *params; /* conv1.weight, conv1.bias, ..., fc2.bias */
    weft_rng_t dropout_rng;
    int64_t forwards; /* under mu */
    int64_t training_forwards;
} net_t;

static void net_free(net_t *n)
{
    weft_param_list_free(n->params);
    weft_nn_linear_free(n->fc2);
    weft_nn_linear_free(n->fc1);
    weft_nn_conv2d_free(n->conv2);
    weft_nn_conv2d_free(n->conv1);
    pthread_mutex_destroy(&n->mu);
    memset(n, 0, sizeof(*n));
}

static weft_status_t net_init(net_t *n, uint64_t seed)
{
    weft_rng_t rng;
    weft_status_t st;

    memset(n, 0, sizeof(*n));
    pthread_mutex_init(&n->mu, NULL);
    weft_rng_init(&rng, seed, 0);
    weft_rng_init(&n->dropout_rng, seed, 1);
    st = weft_nn_conv2d_create(1, 32, (const int64_t[]){3, 3}, NULL, &rng, &n->conv1);
    if (st == WEFT_OK) {
        st = weft_nn_conv2d_create(32, 64, (const int64_t[]){3, 3}, NULL, &rng, &n->conv2);
    }
    if (st == WEFT_OK) {
        st = weft_nn_linear_create(9216, 128, 1, WEFT_F32, &rng, &n->fc1);
    }
    if (st == WEFT_OK) {
        st = weft_nn_linear_create(128, NCLASS, 1, WEFT_F32, &rng, &n->fc2);
    }
    if (st == WEFT_OK) {
        st = weft_param_list_create(&n->params);
    }
    if (st == WEFT_OK) {
        st = weft_param_list_extend(n->params, "conv1", weft_nn_conv2d_params(n->conv1));
    }
    if (st == WEFT_OK) {
        st = weft_param_list_extend(n->params, "conv2", weft_nn_conv2d_params(n->conv2));
    }
    if (st == WEFT_OK) {
        st = weft_param_list_extend(n->params, "fc1", weft_nn_linear_params(n->fc1));
    }
    if (st == WEFT_OK) {
        st = weft_param_list_extend(n->params, "fc2", weft_nn_linear_params(n->fc2));
    }
    if (st != WEFT_OK) {
        net_free(n);
    }
    return st;
}

/* The log-probabilities [k, 10] of images @p x [k, 784] or [k, 1, 28, 28]. Called with n->mu
 * held (dropout draws from the shared generator). */
static weft_status_t net_forward_locked(net_t *n, weft_tensor_t *x, int training,
                                        weft_tensor_t **y_p)
{
    const int64_t k = weft_tensor_shape(x)[0];
    weft_tensor_t *t[12] = {NULL};
    weft_status_t st;
    int i = 0;

    st = weft_op_reshape(x, 4, (const int64_t[]){k, 1, IMAGE_SIDE, IMAGE_SIDE}, &t[i]);
    if (st == WEFT_OK) {
        st = weft_nn_conv2d_forward(n->conv1, t[i], &t[i + 1]);
        i++;
    }
    if (st == WEFT_OK) {
        st = weft_op_relu(t[i], &t[i + 1]);
        i++;
    }
    if (st == WEFT_OK) {
        st = weft_nn_conv2d_forward(n->conv2, t[i], &t[i + 1]);
        i++;
    }
    if (st == WEFT_OK) {
        st = weft_op_max_pool2d(t[i], (const int64_t[]){2, 2}, NULL, NULL, &t[i + 1]);
        i++;
    }
    if (st == WEFT_OK) {
        st = weft_op_dropout2d(t[i], 0.25, training, &n->dropout_rng, &t[i + 1]);
        i++;
    }
    if (st == WEFT_OK) {
        st = weft_op_flatten(t[i], 1, -1, &t[i + 1]);
        i++;
    }
    if (st == WEFT_OK) {
        st = weft_nn_linear_forward(n->fc1, t[i], &t[i + 1]);
        i++;
    }
    if (st == WEFT_OK) {
        st = weft_op_relu(t[i], &t[i + 1]);
        i++;
    }
    if (st == WEFT_OK) {
        st = weft_op_dropout(t[i], 0.5, training, &n->dropout_rng, &t[i + 1]);
        i++;
    }
    if (st == WEFT_OK) {
        st = weft_nn_linear_forward(n->fc2, t[i], &t[i + 1]);
        i++;
    }
    if (st == WEFT_OK) {
        st = weft_op_log_softmax(t[i], 1, y_p);
    }
    for (int j = 0; j < 12; j++) {
        weft_tensor_release(t[j]);
    }
    return st;
}

/* --------------------------------------------------------- the server's functions */

/* The forward request's payload: whether to train (dropout on, graph recorded). A real program
 * would pin the byte order; every rank runs this program on one kind of machine. */
typedef struct {
    int32_t training;
} forward_msg_t;

/* What get_dist_gradients answers. */
typedef struct {
    int32_t with_grad; /* parameters with a gradient in the context */
    int32_t params;
    double sum_sq; /* of those gradients' elements */
} grads_msg_t;

/* forward(x [k, 784] f32; forward_msg_t) -> log-probabilities [k, 10]. Runs in the caller's
 * distributed autograd context (the thread's current one): the answer records a send function
 * for the output, whose graph leads back to the parameters. */
static void fn_forward(weft_call_t *call, void *arg)
{
    net_t *n = arg;
    const weft_value_t *in = weft_call_args(call);
    weft_tensor_t *x = weft_value_tensor(in, 0);
    const forward_msg_t *m;
    weft_tensor_t *y = NULL;
    weft_value_t *v = NULL;
    weft_status_t st;
    size_t len = 0;
    int prev;

    m = weft_value_payload(in, &len);
    if (m == NULL || len != sizeof(*m)) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "forward wants a %zu-byte payload, got %zu",
                       sizeof(*m), len);
        return;
    }
    if (x == NULL || weft_value_num_tensors(in) != 1 || weft_tensor_dtype(x) != WEFT_F32 ||
        weft_tensor_ndim(x) < 2 || weft_tensor_shape(x)[0] < 1 ||
        weft_tensor_numel(x) != weft_tensor_shape(x)[0] * IMAGE_SIDE * IMAGE_SIDE) {
        weft_call_fail(call, WEFT_ERR_SHAPE, "forward wants one f32 batch of %dx%d images",
                       IMAGE_SIDE, IMAGE_SIDE);
        return;
    }
    /* Evaluation records no graph (torch.no_grad()). */
    prev = weft_grad_set_enabled(m->training != 0);
    pthread_mutex_lock(&n->mu);
    st = net_forward_locked(n, x, m->training != 0, &y);
    n->forwards++;
    n->training_forwards += m->training != 0;
    pthread_mutex_unlock(&n->mu);
    weft_grad_set_enabled(prev);
    if (st == WEFT_OK) {
        st = weft_value_create(&v);
    }
    if (st == WEFT_OK) {
        st = weft_value_push_tensor(v, y);
    }
    if (st != WEFT_OK) {
        weft_tensor_release(y);
        weft_value_free(v);
        weft_call_fail(call, st, "forward on the parameter server: %s", weft_last_error());
        return;
    }
    weft_call_reply(call, v);
}

/* get_param_rrefs() -> an RRef of each parameter, in the model's order (owned here: each holds a
 * value with the parameter tensor itself, so the optimizers' steps change the model). */
static void fn_get_param_rrefs(weft_call_t *call, void *arg)
{
    net_t *n = arg;
    weft_agent_t *a = weft_call_agent(call);
    weft_value_t *res = NULL;
    weft_status_t st = weft_value_create(&res);

    for (int i = 0; st == WEFT_OK && i < weft_param_list_size(n->params); i++) {
        weft_value_t *pv = NULL;
        weft_rref_t *r = NULL;

        st = weft_value_create(&pv);
        if (st == WEFT_OK) {
            st = weft_value_add_tensor(pv, weft_param_list_get(n->params, i));
        }
        if (st == WEFT_OK) {
            st = weft_rref_create(a, pv, &r);
        }
        if (st != WEFT_OK) {
            weft_value_free(pv);
            break;
        }
        st = weft_value_add_rref(res, r); /* the value retains it */
        weft_rref_release(r);
    }
    if (st != WEFT_OK) {
        weft_value_free(res);
        weft_call_fail(call, st, "get_param_rrefs: %s", weft_last_error());
        return;
    }
    weft_call_reply(call, res);
}

/* get_dist_gradients(payload: the context id) -> grads_msg_t for the server's parameters. */
static void fn_get_dist_gradients(weft_call_t *call, void *arg)
{
    net_t *n = arg;
    size_t len = 0;
    const uint64_t *ctx = weft_value_payload(weft_call_args(call), &len);
    weft_dist_grads_t *g = NULL;
    grads_msg_t m;
    weft_value_t *v = NULL;
    weft_status_t st;

    if (ctx == NULL || len != sizeof(*ctx)) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "get_dist_gradients wants a context id");
        return;
    }
    st = weft_dist_get_gradients(weft_call_agent(call), *ctx, &g);
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "%s", weft_last_error());
        return;
    }
    memset(&m, 0, sizeof(m));
    m.params = weft_param_list_size(n->params);
    for (int i = 0; i < m.params; i++) {
        const weft_tensor_t *gr = weft_dist_grads_find(g, weft_param_list_get(n->params, i));
        const float *d = gr != NULL ? weft_tensor_data(gr) : NULL;

        m.with_grad += gr != NULL;
        for (int64_t j = 0; d != NULL && j < weft_tensor_numel(gr); j++) {
            m.sum_sq += (double)d[j] * (double)d[j];
        }
    }
    weft_dist_grads_free(g);
    st = weft_value_create(&v);
    if (st == WEFT_OK) {
        st = weft_value_set_payload(v, &m, sizeof(m));
    }
    if (st != WEFT_OK) {
        weft_value_free(v);
        weft_call_fail(call, st, "no memory");
        return;
    }
    weft_call_reply(call, v);
}

/* param_checksum() -> the FNV-1a 64 of the parameters' bytes (payload, 8 bytes). */
static void fn_param_checksum(weft_call_t *call, void *arg)
{
    net_t *n = arg;
    uint64_t h = EX_FNV1A_BASIS;
    weft_value_t *v = NULL;

    for (int i = 0; i < weft_param_list_size(n->params); i++) {
        const weft_tensor_t *p = weft_param_list_get(n->params, i);
        h = ex_fnv1a(h, weft_tensor_data(p), weft_tensor_nbytes(p));
    }
    if (weft_value_create(&v) != WEFT_OK || weft_value_set_payload(v, &h, sizeof(h)) != WEFT_OK) {
        weft_value_free(v);
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "no memory");
        return;
    }
    weft_call_reply(call, v);
}

/* ------------------------------------------------------------------ trainers */

typedef struct {
    weft_agent_t *a;
    const config_t *cfg;
    const mnist_set_t *train;
    const mnist_set_t *test;
    int rank;
    int world;
} job_t;

static void fail(const char *what, weft_status_t st)
{
    ex_fail(PROG, what, st);
}

/* The server's forward on @p x (training: in the thread's current context); the output into
 * @p out_p. */
static weft_status_t remote_forward(weft_agent_t *a, weft_tensor_t *x, int training,
                                    weft_tensor_t **out_p)
{
    forward_msg_t m = {.training = training};
    weft_value_t *args = NULL;
    weft_value_t *res = NULL;
    weft_status_t st;

    st = weft_value_create(&args);
    if (st == WEFT_OK) {
        st = weft_value_add_tensor(args, x);
    }
    if (st == WEFT_OK) {
        st = weft_value_set_payload(args, &m, sizeof(m));
    }
    if (st == WEFT_OK) {
        st = weft_rpc_sync(a, PS_RANK, "forward", args, CALL_TIMEOUT_MS, &res);
    }
    if (st == WEFT_OK) {
        weft_tensor_t *y = weft_value_tensor(res, 0);
        if (y == NULL || weft_tensor_ndim(y) != 2 || weft_tensor_shape(y)[1] != NCLASS ||
            weft_tensor_shape(y)[0] != weft_tensor_shape(x)[0]) {
            st = WEFT_ERR_SHAPE;
            fprintf(stderr, PROG ": the parameter server's forward answered the wrong shape\n");
        } else {
            *out_p = weft_tensor_retain(y);
        }
    }
    weft_value_free(res);
    weft_value_free(args);
    return st;
}

/* The server's gradients in context @p ctx. */
static weft_status_t remote_grads(weft_agent_t *a, uint64_t ctx, grads_msg_t *m)
{
    weft_value_t *args = NULL;
    weft_value_t *res = NULL;
    weft_status_t st;
    size_t len = 0;

    st = weft_value_create(&args);
    if (st == WEFT_OK) {
        st = weft_value_set_payload(args, &ctx, sizeof(ctx));
    }
    if (st == WEFT_OK) {
        st = weft_rpc_sync(a, PS_RANK, "get_dist_gradients", args, CALL_TIMEOUT_MS, &res);
    }
    if (st == WEFT_OK) {
        const void *p = weft_value_payload(res, &len);
        if (p == NULL || len != sizeof(*m)) {
            st = WEFT_ERR_PROTOCOL;
        } else {
            memcpy(m, p, sizeof(*m));
        }
    }
    weft_value_free(res);
    weft_value_free(args);
    return st;
}

static weft_status_t remote_checksum(weft_agent_t *a, uint64_t *h_p)
{
    weft_value_t *res = NULL;
    weft_status_t st = weft_rpc_sync(a, PS_RANK, "param_checksum", NULL, CALL_TIMEOUT_MS, &res);
    size_t len = 0;

    if (st == WEFT_OK) {
        const void *p = weft_value_payload(res, &len);
        if (p == NULL || len != sizeof(*h_p)) {
            st = WEFT_ERR_PROTOCOL;
        } else {
            memcpy(h_p, p, sizeof(*h_p));
        }
    }
    weft_value_free(res);
    return st;
}

/* The RRefs of the server's parameters (torch's TrainerNet.get_global_param_rrefs). */
static weft_status_t get_param_rrefs(weft_agent_t *a, weft_rref_t ***rrefs_p, size_t *n_p)
{
    weft_value_t *res = NULL;
    weft_rref_t **rrefs = NULL;
    size_t n = 0;
    weft_status_t st = weft_rpc_sync(a, PS_RANK, "get_param_rrefs", NULL, CALL_TIMEOUT_MS, &res);

    if (st == WEFT_OK) {
        n = weft_value_num_refs(res);
        rrefs = calloc(n + 1, sizeof(*rrefs));
        if (rrefs == NULL) {
            st = WEFT_ERR_NO_MEMORY;
        }
    }
    for (size_t i = 0; st == WEFT_OK && i < n; i++) {
        weft_rref_t *r = weft_value_rref(res, i);
        if (r == NULL) {
            st = WEFT_ERR_PROTOCOL;
            break;
        }
        rrefs[i] = weft_rref_retain(r);
    }
    weft_value_free(res);
    if (st != WEFT_OK) {
        for (size_t i = 0; rrefs != NULL && i < n; i++) {
            weft_rref_release(rrefs[i]);
        }
        free(rrefs);
        return st;
    }
    *rrefs_p = rrefs;
    *n_p = n;
    return WEFT_OK;
}

/* One training step in a context of its own; the loss into @p loss_p. The first step also checks
 * that the server's parameters got gradients and changed with the step. */
static int train_step(const job_t *job, weft_dist_optim_t *opt, size_t n_params, const int64_t *idx,
                      int64_t k, int first, double *loss_p)
{
    weft_agent_t *a = job->a;
    weft_tensor_t *x = NULL;
    weft_tensor_t *y = NULL;
    weft_tensor_t *out = NULL;
    weft_tensor_t *loss = NULL;
    grads_msg_t gm;
    uint64_t ctx = 0;
    uint64_t before = 0, after = 0;
    const char *what = "context";
    weft_status_t st;
    int rc = -1;

    st = mnist_batch(job->train, idx, k, &x, &y);
    if (st == WEFT_OK) {
        what = "context";
        st = weft_dist_context_create(a, &ctx);
    }
    if (st == WEFT_OK) {
        what = "forward on the parameter server";
        st = remote_forward(a, x, 1, &out);
    }
    if (st == WEFT_OK) {
        what = "loss";
        st = weft_op_nll_loss(out, y, WEFT_REDUCTION_MEAN, &loss);
    }
    if (st == WEFT_OK) {
        *loss_p = ((const float *)weft_tensor_data(loss))[0];
        what = "distributed backward";
        st = weft_dist_backward(a, ctx, 1, &loss, NULL);
    }
    if (st == WEFT_OK) {
        what = "get_dist_gradients";
        st = remote_grads(a, ctx, &gm);
    }
    if (st == WEFT_OK && (gm.with_grad != gm.params || (size_t)gm.params != n_params ||
                          !(gm.sum_sq > 0) || !isfinite(gm.sum_sq))) {
        fprintf(stderr,
                PROG ": rank %d: the parameter server holds gradients for %d of its %d parameters "
                     "(sum of squares %g) in context %llx\n",
                job->rank, gm.with_grad, gm.params, gm.sum_sq, (unsigned long long)ctx);
        goto out;
    }
    if (st == WEFT_OK && first) {
        what = "param_checksum";
        st = remote_checksum(a, &before);
    }
    if (st == WEFT_OK) {
        what = "optimizer step";
        st = weft_dist_optim_step(opt, ctx, 0);
    }
    if (st == WEFT_OK && first) {
        what = "param_checksum";
        st = remote_checksum(a, &after);
        if (st == WEFT_OK) {
            printf("Rank %d: first step: gradients for %d of %d parameters on the parameter "
                   "server, parameters changed: %s\n",
                   job->rank, gm.with_grad, gm.params, after != before ? "yes" : "no");
        }
    }
    if (st != WEFT_OK) {
        fail(what, st);
        goto out;
    }
    if (first && after == before) {
        fprintf(stderr, PROG ": rank %d: the first step left the parameters as they were\n",
                job->rank);
        goto out;
    }
    rc = 0;

out:
    if (ctx != 0) {
        st = weft_dist_context_release(a, ctx, 0);
        if (st != WEFT_OK && rc == 0) {
            fail("context release", st);
            rc = -1;
        }
    }
    weft_tensor_release(loss);
    weft_tensor_release(out);
    weft_tensor_release(x);
    weft_tensor_release(y);
    return rc;
}

/* The fraction of the first @p n test images the server's model (eval mode) classifies right. */
static int get_accuracy(const job_t *job, int64_t n, double *acc_p)
{
    const int64_t b = job->cfg->batch;
    int64_t *idx = malloc((size_t)b * sizeof(*idx));
    int64_t correct = 0;
    weft_status_t st = WEFT_OK;

    if (idx == NULL) {
        fprintf(stderr, PROG ": out of memory\n");
        return -1;
    }
    for (int64_t start = 0; st == WEFT_OK && start < n; start += b) {
        int64_t k = n - start < b ? n - start : b;
        weft_tensor_t *x = NULL;
        weft_tensor_t *y = NULL;
        weft_tensor_t *out = NULL;
        weft_tensor_t *pred = NULL;

        for (int64_t i = 0; i < k; i++) {
            idx[i] = start + i;
        }
        st = mnist_batch(job->test, idx, k, &x, &y);
        if (st == WEFT_OK) {
            st = remote_forward(job->a, x, 0, &out);
        }
        if (st == WEFT_OK) {
            st = weft_op_argmax(out, 1, 0, &pred);
        }
        for (int64_t i = 0; st == WEFT_OK && i < k; i++) {
            correct += ((const int64_t *)weft_tensor_data(pred))[i] ==
                       ((const int64_t *)weft_tensor_data(y))[i];
        }
        weft_tensor_release(pred);
        weft_tensor_release(out);
        weft_tensor_release(x);
        weft_tensor_release(y);
    }
    free(idx);
    if (st != WEFT_OK) {
        fail("accuracy", st);
        return -1;
    }
    *acc_p = (double)correct / (double)n;
    return 0;
}

/* torch's run_training_loop for trainer @p job->rank. */
static int run_trainer(const job_t *job)
{
    const config_t *cfg = job->cfg;
    const int trainers = job->world - 1;
    const int t = job->rank - 1;
    const int64_t n = job->train->count;
    const int64_t shard_n = (n + trainers - 1) / trainers;
    int64_t steps = (shard_n + cfg->batch - 1) / cfg->batch;
    const int64_t test_n = cfg->test_limit > 0 && cfg->test_limit < job->test->count
                               ? cfg->test_limit
                               : job->test->count;
    weft_dist_optim_config_t oc;
    weft_dist_optim_t *opt = NULL;
    weft_rref_t **params = NULL;
    size_t n_params = 0;
    int64_t *perm = malloc((size_t)n * sizeof(*perm));
    int64_t *shard = malloc((size_t)shard_n * sizeof(*shard));
    ex_loop_t l;
    double acc = 0;
    weft_status_t st;
    int rc = 1;

    if (perm == NULL || shard == NULL) {
        fprintf(stderr, PROG ": out of memory\n");
        goto out;
    }
    if (cfg->limit > 0 && cfg->limit < steps) {
        steps = cfg->limit;
    }
    st = get_param_rrefs(job->a, &params, &n_params);
    if (st != WEFT_OK) {
        fail("get_param_rrefs", st);
        goto out;
    }
    weft_dist_optim_config_init(&oc, WEFT_DIST_OPTIM_SGD, cfg->lr);
    st = weft_dist_optim_create(job->a, &oc, n_params, params, &opt);
    if (st != WEFT_OK) {
        fail("distributed optimizer", st);
        goto out;
    }
    printf("Rank %d: %zu parameter RRefs owned by %s, DistributedOptimizer SGD lr %g, %lld "
           "batches of %d per epoch\n",
           job->rank, n_params, weft_rref_owner_name(params[0]), cfg->lr, (long long)steps,
           cfg->batch);

    /* The rank field of the loop is who prints its progress lines: nobody here (the tutorial's
     * lines are printed below). */
    ex_loop_init(&l, -1, 1, cfg->epochs, steps, 0);
    for (int epoch = 0; epoch < cfg->epochs; epoch++) {
        ex_loop_epoch_begin(&l);
        mnist_epoch_shard(cfg->seed, epoch, n, t, trainers, perm, shard, shard_n);
        for (int64_t i = 0; i < steps; i++) {
            int64_t k = (i + 1) * cfg->batch <= shard_n ? cfg->batch : shard_n - i * cfg->batch;
            double loss = 0;
            double t0 = ex_now();

            if (train_step(job, opt, n_params, shard + i * cfg->batch, k, epoch == 0 && i == 0,
                           &loss) != 0) {
                goto out;
            }
            if (!isfinite(loss)) {
                fprintf(stderr, PROG ": rank %d: batch %lld: the loss is %g\n", job->rank,
                        (long long)i, loss);
                goto out;
            }
            if (i % LOG_EVERY == 0 || i + 1 == steps) {
                printf("Rank %d training batch %lld loss %.6f\n", job->rank, (long long)i, loss);
            }
            (void)ex_loop_step_end(&l, epoch, i, k, loss, t0);
        }
        ex_loop_epoch_end(&l, epoch, 0.0);
        printf("Rank %d: epoch %d: mean loss %.4f, %.1f s, %.1f ms per batch\n", job->rank,
               epoch + 1, l.loss_avg, l.t_epoch, 1e3 * l.t_epoch / (double)steps);
    }
    printf("Training complete!\n");
    printf("Getting accuracy....\n");
    if (get_accuracy(job, test_n, &acc) != 0) {
        goto out;
    }
    printf("Accuracy %.4f\n", acc);
    rc = 0;

out:
    weft_dist_optim_free(opt);
    for (size_t i = 0; i < n_params; i++) {
        weft_rref_release(params[i]);
    }
    free(params);
    free(shard);
    free(perm);
    return rc;
}

/* ----------------------------------------------------------------- main */

int main(int argc, char **argv)
{
    config_t cfg;
    mnist_set_t train_set = {0}, test_set = {0};
    weft_agent_opts_t opts;
    weft_agent_t *a = NULL;
    net_t net;
    int have_net = 0;
    ex_done_t done = EX_DONE_INIT;
    weft_status_t st;
    int rank, world;
    int rc;

    setvbuf(stdout, NULL, _IOLBF, 0);
    rc = parse_args(argc, argv, &cfg);
    if (rc != 0) {
        return rc == 1 ? 0 : rc;
    }
    weft_op_set_threads(1);
    /* Data first, on every rank: a missing or corrupt file ends the run before anyone waits. */
    if (mnist_load_splits(PROG, cfg.data_dir, &train_set, &test_set) != 0) {
        return EX_EXIT_USAGE;
    }
    if (train_set.rows != IMAGE_SIDE || train_set.cols != IMAGE_SIDE) {
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
    rank = weft_agent_rank(a);
    world = weft_agent_world_size(a);
    if (world < 2) {
        fprintf(stderr, PROG ": needs 2 ranks or more: a parameter server and trainers\n");
        rc = EX_EXIT_USAGE;
        goto err_free_agent;
    }
    /* Every rank, before the join: distributed autograd, then RRefs. */
    st = weft_dist_init(a);
    if (st == WEFT_OK) {
        st = weft_rref_init(a);
    }
    if (st != WEFT_OK) {
        fail("setup", st);
        rc = 1;
        goto err_free_agent;
    }
    if (rank == PS_RANK) {
        st = net_init(&net, cfg.seed);
        if (st != WEFT_OK) {
            fail("model", st);
            rc = 1;
            goto err_free_agent;
        }
        have_net = 1;
        if (weft_rpc_register(a, "forward", fn_forward, &net) != WEFT_OK ||
            weft_rpc_register(a, "get_param_rrefs", fn_get_param_rrefs, &net) != WEFT_OK ||
            weft_rpc_register(a, "get_dist_gradients", fn_get_dist_gradients, &net) != WEFT_OK ||
            weft_rpc_register(a, "param_checksum", fn_param_checksum, &net) != WEFT_OK) {
            fprintf(stderr, PROG ": register: %s\n", weft_last_error());
            rc = 1;
            goto err_free_agent;
        }
    } else {
        st = weft_rpc_register(a, "wait_done", ex_wait_done_fn, &done);
        if (st != WEFT_OK) {
            fail("register", st);
            rc = 1;
            goto err_free_agent;
        }
    }
    st = weft_agent_join(a);
    if (st != WEFT_OK) {
        fail("join", st);
        rc = 1;
        goto err_free_agent;
    }

    if (rank == PS_RANK) {
        printf("parameter server on %s: CNN conv1(1->32)-relu, conv2(32->64)-maxpool-dropout2d, "
               "fc1(9216->128)-relu-dropout, fc2(128->10)-log_softmax (%lld parameters in %d "
               "tensors), %d trainer%s\n",
               weft_agent_name(a), (long long)weft_param_list_numel(net.params),
               weft_param_list_size(net.params), world - 1, world > 2 ? "s" : "");
        rc = ex_wait_done(PROG, a, 1, world - 1, "waiting for the others to be done") == 0 ? 0 : 1;
    } else {
        job_t job = {.a = a,
                     .cfg = &cfg,
                     .train = &train_set,
                     .test = &test_set,
                     .rank = rank,
                     .world = world};
        rc = run_trainer(&job);
        ex_done_announce(&done);
    }
    /* The server has served until every trainer was done: the shutdown is collective. */
    rc = ex_agent_shutdown(PROG, a, rc);
    if (rank == PS_RANK && rc == 0) {
        printf("parameter server: %lld forward passes served, %lld of them training\n",
               (long long)net.forwards, (long long)net.training_forwards);
    }

err_free_agent:
    /* The agent goes first: no handler can run on the model after this. */
    weft_agent_free(a);
    if (have_net) {
        net_free(&net);
    }
err_free_data:
    mnist_free(&train_set);
    mnist_free(&test_set);
    return rc;
}
