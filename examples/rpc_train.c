/*
 * rpc_train: synchronous data-parallel training over weft RPC.
 *
 *   weftrun -n 2 build/examples/rpc_train [--epochs 3] [--batch 64] [--lr 0.1]
 *           [--momentum 0.9] [--limit N] [--data DIR]
 *
 * The model is multinomial logistic regression (softmax regression) from the
 * 784 pixels of a Fashion-MNIST image to its 10 classes: logits = W x + b,
 * trained on the mean cross-entropy with SGD and momentum; the learning rate
 * falls linearly to a tenth of its initial value over the run.
 *
 * Rank 0 is also the parameter server: it owns W[10 x 784] and b[10] and
 * serves three functions.
 *   params  returns the current parameters (and checks that the caller runs
 *           the same configuration);
 *   step    takes one rank's minibatch gradient for step s; when the
 *           gradients of every rank have arrived, it applies the averaged
 *           gradient and answers all the waiting calls with the new
 *           parameters;
 *   verify  takes a checksum of the caller's parameters; once every rank's
 *           has arrived it answers all of them with how many matched.
 * step and verify never block a transport thread: a handler that is not the
 * last to arrive keeps its weft_call_t and returns; the handler of the last
 * arrival replies to every kept call (the async reply pattern).
 *
 * Every rank, rank 0 included, runs the same worker loop: fetch the
 * parameters, then per step compute the gradient on its minibatch and call
 * step on rank 0 (a call to itself for rank 0), which returns the parameters
 * for the next step. Rank r trains on the samples i with i % world == r.
 *
 * The data are the IDX files of Fashion-MNIST: --data DIR, else
 * $WEFT_DATA_DIR, else /usr/share/datasets/fashion-mnist (Debian package
 * dataset-fashion-mnist). Exit status: 0 on success, 2 for bad options or
 * missing or corrupt data, 1 for any other failure.
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

#define PROG            "rpc_train"
#define NCLASS          MNIST_CLASSES
#define CALL_TIMEOUT_MS 60000
#define EXIT_USAGE      EX_EXIT_USAGE

/* ---------------------------------------------------------- configuration */

typedef struct {
    int epochs;
    int batch; /* per rank */
    double lr;
    double momentum;
    int64_t limit; /* 0: all training samples */
    uint64_t seed;
    const char *data_dir;
} config_t;

static void usage(FILE *out)
{
    fprintf(out,
            "usage: weftrun -n N rpc_train [options]\n"
            "  --epochs N     passes over the training set (default 3)\n"
            "  --batch N      minibatch size per rank (default 64)\n"
            "  --lr X         initial learning rate, falling linearly to a tenth (default 0.1)\n"
            "  --momentum X   SGD momentum (default 0.9)\n"
            "  --limit N      train on the first N training samples only\n"
            "  --seed N       shuffling seed (default 1)\n"
            "  --data DIR     Fashion-MNIST IDX files (default $WEFT_DATA_DIR, else\n"
            "                 " MNIST_DEFAULT_DIR ")\n");
}

/* Returns 0, 1 after --help, or EXIT_USAGE after a message. */
static int parse_args(int argc, char **argv, config_t *cfg)
{
    const ex_opt_t opts[] = {
        EX_INT("epochs", &cfg->epochs, 1, 100000),
        EX_INT("batch", &cfg->batch, 1, 1 << 20),
        EX_DOUBLE("lr", &cfg->lr, 0.0, 1e6),
        EX_DOUBLE("momentum", &cfg->momentum, 0.0, 0.999999),
        EX_I64("limit", &cfg->limit, 1, INT64_MAX),
        EX_U64("seed", &cfg->seed, 0, INT64_MAX),
        EX_STR("data", &cfg->data_dir),
    };

    cfg->epochs = 3;
    cfg->batch = 64;
    cfg->lr = 0.1;
    cfg->momentum = 0.9;
    cfg->limit = 0;
    cfg->seed = 1;
    cfg->data_dir = mnist_default_dir();
    return ex_parse_opts(PROG, argc, argv, opts, sizeof(opts) / sizeof(opts[0]), usage);
}

/* ------------------------------------------------------------------ model */

/* Softmax regression: logits = W x + b, W is NCLASS x d (row-major). */
typedef struct {
    int d;
    float *w;
    float *b;
} model_t;

static int model_alloc(model_t *m, int d)
{
    m->d = d;
    m->w = calloc((size_t)NCLASS * (size_t)d, sizeof(float));
    m->b = calloc(NCLASS, sizeof(float));
    return m->w != NULL && m->b != NULL ? 0 : -1;
}

static void model_free(model_t *m)
{
    free(m->w);
    free(m->b);
    m->w = NULL;
    m->b = NULL;
}

/* Pixels of sample @p i scaled to [0, 1]. */
static void load_x(const mnist_set_t *set, int64_t i, int d, float *x)
{
    const uint8_t *px = set->pixels + i * d;

    for (int j = 0; j < d; j++) {
        x[j] = (float)px[j] * (1.0f / 255.0f);
    }
}

static void logits_of(const model_t *m, const float *x, float *z)
{
    for (int k = 0; k < NCLASS; k++) {
        const float *wk = m->w + (size_t)k * (size_t)m->d;
        float s = 0.0f;
        for (int j = 0; j < m->d; j++) {
            s += wk[j] * x[j];
        }
        z[k] = s + m->b[k];
    }
}

/*
 * Gradient of the mean cross-entropy over the @p n samples idx[] into gw, gb
 * (shapes of W and b); returns the summed loss. x is scratch of d floats.
 */
static double minibatch_gradient(const model_t *m, const mnist_set_t *set, const int64_t *idx,
                                 int n, float *x, float *gw, float *gb)
{
    const int d = m->d;
    double loss = 0.0;

    memset(gw, 0, (size_t)NCLASS * (size_t)d * sizeof(float));
    memset(gb, 0, NCLASS * sizeof(float));
    for (int i = 0; i < n; i++) {
        float z[NCLASS];
        float zmax;
        float sum = 0.0f;
        int y = set->labels[idx[i]];

        load_x(set, idx[i], d, x);
        logits_of(m, x, z);
        zmax = z[0];
        for (int k = 1; k < NCLASS; k++) {
            zmax = z[k] > zmax ? z[k] : zmax;
        }
        for (int k = 0; k < NCLASS; k++) {
            z[k] = expf(z[k] - zmax);
            sum += z[k];
        }
        /* -log softmax(z)[y] */
        loss += log((double)sum) - log((double)z[y]);
        for (int k = 0; k < NCLASS; k++) {
            float dz = z[k] / sum - (k == y ? 1.0f : 0.0f);
            float *gk = gw + (size_t)k * (size_t)d;
            gb[k] += dz;
            for (int j = 0; j < d; j++) {
                gk[j] += dz * x[j];
            }
        }
    }
    if (n > 0) {
        float inv = 1.0f / (float)n;
        for (size_t j = 0; j < (size_t)NCLASS * (size_t)d; j++) {
            gw[j] *= inv;
        }
        for (int k = 0; k < NCLASS; k++) {
            gb[k] *= inv;
        }
    }
    return loss;
}

/* Fraction of @p set classified right. */
static double accuracy(const model_t *m, const mnist_set_t *set, float *x)
{
    int64_t right = 0;

    for (int64_t i = 0; i < set->count; i++) {
        float z[NCLASS];
        int best = 0;

        load_x(set, i, m->d, x);
        logits_of(m, x, z);
        for (int k = 1; k < NCLASS; k++) {
            best = z[k] > z[best] ? k : best;
        }
        right += best == set->labels[i];
    }
    return (double)right / (double)set->count;
}

/* FNV-1a over the bytes of W and b: equal checksums mean bit-identical parameters. It starts
 * from 1469598103934665603 rather than FNV's offset basis (a digit short), as it always has: the
 * checksums it prints stay comparable with earlier runs'. */
static uint64_t model_checksum(const model_t *m)
{
    uint64_t h =
        ex_fnv1a(1469598103934665603ull, m->w, (size_t)NCLASS * (size_t)m->d * sizeof(float));

    return ex_fnv1a(h, m->b, NCLASS * sizeof(float));
}

/* splitmix64: a small seedable generator for the shuffles. */
static uint64_t next_random(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void shuffle(int64_t *v, int64_t n, uint64_t seed)
{
    uint64_t state = seed;

    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)(next_random(&state) % (uint64_t)(i + 1));
        int64_t t = v[i];
        v[i] = v[j];
        v[j] = t;
    }
}

/* ----------------------------------------------------------- wire format */

/*
 * Payloads are fixed-layout structs copied as bytes: every rank runs this
 * same program on the same kind of machine. A real program would pin the
 * byte order.
 */
typedef struct {
    int64_t epochs;
    int64_t batch;
    int64_t steps_per_epoch;
    int64_t limit;
    double lr;
    double momentum;
} run_msg_t; /* params request: the caller's configuration */

typedef struct {
    int64_t step;
    int64_t samples;
    double loss_sum;
} step_msg_t; /* step request (this rank's batch) and reply (all ranks together) */

typedef struct {
    uint64_t checksum;
} verify_msg_t;

typedef struct {
    int32_t matching;
    int32_t world;
    uint64_t checksum;
} verify_reply_t;

/* --------------------------------------------------------------- server */

typedef struct {
    pthread_mutex_t mu;
    int world;
    run_msg_t run;         /* rank 0's configuration; callers must match it */
    model_t model;         /* the parameters */
    float *vw, *vb;        /* momentum buffers */
    float *gw, *gb;        /* sample-weighted gradient sums of the step being gathered */
    int64_t step;          /* the step being gathered */
    int64_t samples;       /* samples of that step so far */
    double loss_sum;       /* their summed loss */
    int arrived;           /* ranks whose gradient has arrived */
    weft_call_t **waiting; /* [world] their calls, answered by the last arrival */
    int verify_arrived;
    int verify_matching;
    weft_call_t **verify_waiting; /* [world] */
} server_t;

static int server_init(server_t *s, int world, int d, const run_msg_t *run)
{
    size_t n = (size_t)NCLASS * (size_t)d;

    memset(s, 0, sizeof(*s));
    pthread_mutex_init(&s->mu, NULL);
    s->world = world;
    s->run = *run;
    if (model_alloc(&s->model, d) != 0) {
        return -1;
    }
    s->vw = calloc(n, sizeof(float));
    s->vb = calloc(NCLASS, sizeof(float));
    s->gw = calloc(n, sizeof(float));
    s->gb = calloc(NCLASS, sizeof(float));
    s->waiting = calloc((size_t)world, sizeof(*s->waiting));
    s->verify_waiting = calloc((size_t)world, sizeof(*s->verify_waiting));
    if (s->vw == NULL || s->vb == NULL || s->gw == NULL || s->gb == NULL || s->waiting == NULL ||
        s->verify_waiting == NULL) {
        return -1;
    }
    return 0;
}

static void server_free(server_t *s)
{
    model_free(&s->model);
    free(s->vw);
    free(s->vb);
    free(s->gw);
    free(s->gb);
    free(s->waiting);
    free(s->verify_waiting);
    pthread_mutex_destroy(&s->mu);
}

/* Copies of the parameters as tensors W [NCLASS, d] and b [NCLASS]. */
static weft_status_t params_tensors(const model_t *m, weft_tensor_t **w_p, weft_tensor_t **b_p)
{
    const int64_t wshape[2] = {NCLASS, m->d};
    const int64_t bshape[1] = {NCLASS};
    weft_tensor_t *w, *b;
    weft_status_t st;

    st = weft_tensor_empty(WEFT_F32, 2, wshape, &w);
    if (st != WEFT_OK) {
        return st;
    }
    st = weft_tensor_empty(WEFT_F32, 1, bshape, &b);
    if (st != WEFT_OK) {
        weft_tensor_release(w);
        return st;
    }
    memcpy(weft_tensor_data(w), m->w, weft_tensor_nbytes(w));
    memcpy(weft_tensor_data(b), m->b, weft_tensor_nbytes(b));
    *w_p = w;
    *b_p = b;
    return WEFT_OK;
}

/* Answers @p call with the tensors w, b (the value takes its own references) and a payload. */
static void reply_params(weft_call_t *call, weft_tensor_t *w, weft_tensor_t *b, const void *payload,
                         size_t len)
{
    weft_value_t *v;
    weft_status_t st = weft_value_create(&v);

    if (st == WEFT_OK) {
        st = weft_value_add_tensor(v, w);
    }
    if (st == WEFT_OK) {
        st = weft_value_add_tensor(v, b);
    }
    if (st == WEFT_OK && payload != NULL) {
        st = weft_value_set_payload(v, payload, len);
    }
    if (st != WEFT_OK) {
        weft_value_free(v);
        weft_call_fail(call, st, "no memory for the reply");
        return;
    }
    weft_call_reply(call, v);
}

/* Copies the call's fixed-size payload into @p out; fails the call if the size is wrong. */
static int payload_of(weft_call_t *call, void *out, size_t len)
{
    size_t got;
    const void *p = weft_value_payload(weft_call_args(call), &got);

    if (p == NULL || got != len) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "%s wants a %zu-byte payload, got %zu",
                       weft_call_function(call), len, p == NULL ? (size_t)0 : got);
        return -1;
    }
    memcpy(out, p, len);
    return 0;
}

/* params(run_msg_t) -> W, b */
static void fn_params(weft_call_t *call, void *arg)
{
    server_t *s = arg;
    run_msg_t run;
    weft_tensor_t *w, *b;
    weft_status_t st;

    if (payload_of(call, &run, sizeof(run)) != 0) {
        return;
    }
    if (memcmp(&run, &s->run, sizeof(run)) != 0) {
        weft_call_fail(call, WEFT_ERR_MISMATCH,
                       "rank %d runs another configuration than rank 0 (epochs, batch, "
                       "limit, lr, momentum must agree)",
                       weft_call_caller_rank(call));
        return;
    }
    pthread_mutex_lock(&s->mu);
    st = params_tensors(&s->model, &w, &b);
    pthread_mutex_unlock(&s->mu);
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "no memory for the parameters");
        return;
    }
    reply_params(call, w, b, NULL, 0);
    weft_tensor_release(w);
    weft_tensor_release(b);
}

/* SGD with momentum on the averaged gradient of the step. Called with s->mu held. */
static void apply_update(server_t *s)
{
    const size_t n = (size_t)NCLASS * (size_t)s->model.d;
    /* The learning rate falls linearly from lr to lr/10 over the run. */
    const double total = (double)(s->run.epochs * s->run.steps_per_epoch);
    const float lr = (float)(s->run.lr * (1.0 - 0.9 * (double)s->step / total));
    const float mu = (float)s->run.momentum;
    float inv;

    if (s->samples == 0) {
        return;
    }
    inv = 1.0f / (float)s->samples;
    for (size_t j = 0; j < n; j++) {
        s->vw[j] = mu * s->vw[j] + s->gw[j] * inv;
        s->model.w[j] -= lr * s->vw[j];
    }
    for (int k = 0; k < NCLASS; k++) {
        s->vb[k] = mu * s->vb[k] + s->gb[k] * inv;
        s->model.b[k] -= lr * s->vb[k];
    }
}

/*
 * step(gW, gb; step_msg_t) -> W, b; step_msg_t totals. Keeps the call until
 * every rank's gradient for the step is in; the last arrival updates the
 * parameters and answers everyone.
 */
static void fn_step(weft_call_t *call, void *arg)
{
    server_t *s = arg;
    const weft_value_t *args = weft_call_args(call);
    const size_t n = (size_t)NCLASS * (size_t)s->model.d;
    const int from = weft_call_caller_rank(call);
    weft_tensor_t *gw = weft_value_tensor(args, 0);
    weft_tensor_t *gb = weft_value_tensor(args, 1);
    weft_call_t **ready;
    weft_tensor_t *w, *b;
    step_msg_t m, total;
    weft_status_t st;

    if (payload_of(call, &m, sizeof(m)) != 0) {
        return;
    }
    if (from < 0 || from >= s->world) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "caller rank %d is out of range", from);
        return;
    }
    if (weft_value_num_tensors(args) != 2 || weft_tensor_dtype(gw) != WEFT_F32 ||
        weft_tensor_dtype(gb) != WEFT_F32 || (size_t)weft_tensor_numel(gw) != n ||
        weft_tensor_numel(gb) != NCLASS || m.samples < 0) {
        weft_call_fail(call, WEFT_ERR_SHAPE, "step wants f32 gradients of %zu and %d elements", n,
                       NCLASS);
        return;
    }
    ready = calloc((size_t)s->world, sizeof(*ready));
    if (ready == NULL) {
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "no memory");
        return;
    }

    pthread_mutex_lock(&s->mu);
    if (m.step != s->step || s->waiting[from] != NULL) {
        int64_t expected = s->step;
        pthread_mutex_unlock(&s->mu);
        free(ready);
        weft_call_fail(call, WEFT_ERR_MISMATCH, "rank %d sent step %lld; step %lld is gathered",
                       from, (long long)m.step, (long long)expected);
        return;
    }
    /* The rank sent its batch's mean gradient: weigh it by the batch size. */
    const float *pw = weft_tensor_data(gw);
    const float *pb = weft_tensor_data(gb);
    const float c = (float)m.samples;
    for (size_t j = 0; j < n; j++) {
        s->gw[j] += c * pw[j];
    }
    for (int k = 0; k < NCLASS; k++) {
        s->gb[k] += c * pb[k];
    }
    s->samples += m.samples;
    s->loss_sum += m.loss_sum;
    s->waiting[from] = call;
    if (++s->arrived < s->world) {
        /* Not the last: the call stays open and this thread goes back to serve. */
        pthread_mutex_unlock(&s->mu);
        free(ready);
        return;
    }

    apply_update(s);
    total.step = s->step;
    total.samples = s->samples;
    total.loss_sum = s->loss_sum;
    st = params_tensors(&s->model, &w, &b);
    memcpy(ready, s->waiting, (size_t)s->world * sizeof(*ready));
    memset(s->waiting, 0, (size_t)s->world * sizeof(*s->waiting));
    memset(s->gw, 0, n * sizeof(float));
    memset(s->gb, 0, NCLASS * sizeof(float));
    s->samples = 0;
    s->loss_sum = 0.0;
    s->arrived = 0;
    s->step++;
    pthread_mutex_unlock(&s->mu);

    /* Replies go out without the lock: a reply may run callbacks on this thread. */
    for (int r = 0; r < s->world; r++) {
        if (st != WEFT_OK) {
            weft_call_fail(ready[r], st, "no memory for the parameters");
        } else {
            reply_params(ready[r], w, b, &total, sizeof(total));
        }
    }
    if (st == WEFT_OK) {
        weft_tensor_release(w);
        weft_tensor_release(b);
    }
    free(ready);
}

/* verify(verify_msg_t) -> verify_reply_t, once every rank has sent its checksum. */
static void fn_verify(weft_call_t *call, void *arg)
{
    server_t *s = arg;
    const int from = weft_call_caller_rank(call);
    verify_msg_t m;
    verify_reply_t reply;
    weft_call_t **ready;

    if (payload_of(call, &m, sizeof(m)) != 0) {
        return;
    }
    if (from < 0 || from >= s->world) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "caller rank %d is out of range", from);
        return;
    }
    ready = calloc((size_t)s->world, sizeof(*ready));
    if (ready == NULL) {
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "no memory");
        return;
    }
    pthread_mutex_lock(&s->mu);
    if (s->verify_waiting[from] != NULL) {
        pthread_mutex_unlock(&s->mu);
        free(ready);
        weft_call_fail(call, WEFT_ERR_MISMATCH, "rank %d verified twice", from);
        return;
    }
    reply.checksum = model_checksum(&s->model);
    s->verify_matching += m.checksum == reply.checksum;
    s->verify_waiting[from] = call;
    if (++s->verify_arrived < s->world) {
        pthread_mutex_unlock(&s->mu);
        free(ready);
        return;
    }
    reply.matching = s->verify_matching;
    reply.world = s->world;
    memcpy(ready, s->verify_waiting, (size_t)s->world * sizeof(*ready));
    memset(s->verify_waiting, 0, (size_t)s->world * sizeof(*s->verify_waiting));
    s->verify_arrived = 0;
    s->verify_matching = 0;
    pthread_mutex_unlock(&s->mu);

    for (int r = 0; r < s->world; r++) {
        weft_value_t *v;
        weft_status_t st = weft_value_create(&v);
        if (st == WEFT_OK) {
            st = weft_value_set_payload(v, &reply, sizeof(reply));
        }
        if (st != WEFT_OK) {
            weft_value_free(v);
            weft_call_fail(ready[r], st, "no memory for the reply");
            continue;
        }
        weft_call_reply(ready[r], v);
    }
    free(ready);
}

/* --------------------------------------------------------------- worker */

/* Copies W and b out of a params/step reply into @p m. */
static int take_params(const weft_value_t *res, model_t *m)
{
    weft_tensor_t *w = weft_value_tensor(res, 0);
    weft_tensor_t *b = weft_value_tensor(res, 1);

    if (w == NULL || b == NULL || weft_tensor_dtype(w) != WEFT_F32 ||
        weft_tensor_dtype(b) != WEFT_F32 || weft_tensor_numel(w) != (int64_t)NCLASS * m->d ||
        weft_tensor_numel(b) != NCLASS) {
        fprintf(stderr, PROG ": rank 0 sent parameters of the wrong shape\n");
        return -1;
    }
    memcpy(m->w, weft_tensor_data(w), weft_tensor_nbytes(w));
    memcpy(m->b, weft_tensor_data(b), weft_tensor_nbytes(b));
    return 0;
}

typedef struct {
    weft_agent_t *a;
    const config_t *cfg;
    const run_msg_t *run;
    const mnist_set_t *train;
    const mnist_set_t *test;
    int64_t used; /* training samples in use (--limit) */
} job_t;

static int train(const job_t *job)
{
    const config_t *cfg = job->cfg;
    const int rank = weft_agent_rank(job->a);
    const int world = weft_agent_world_size(job->a);
    const int d = job->train->rows * job->train->cols;
    const int64_t shard_n = job->used / world + (rank < job->used % world ? 1 : 0);
    const int64_t wshape[2] = {NCLASS, d};
    const int64_t bshape[1] = {NCLASS};
    weft_tensor_t *gw = NULL, *gb = NULL;
    weft_value_t *args = NULL;  /* step: gradients and step_msg_t */
    weft_value_t *query = NULL; /* params and verify: a payload only */
    weft_value_t *res = NULL;
    int64_t *shard = NULL;
    float *x = NULL;
    model_t m = {0};
    double acc = 0.0;
    weft_status_t st;
    int rc = 1;

    shard = malloc((size_t)(shard_n > 0 ? shard_n : 1) * sizeof(*shard));
    x = malloc((size_t)d * sizeof(float));
    if (shard == NULL || x == NULL || model_alloc(&m, d) != 0) {
        fprintf(stderr, PROG ": out of memory\n");
        goto out;
    }
    for (int64_t i = 0; i < shard_n; i++) {
        shard[i] = rank + i * world; /* the samples i with i % world == rank */
    }
    printf("%s: %lld training samples in this rank's shard\n", weft_agent_name(job->a),
           (long long)shard_n);

    /* Gradients are computed straight into the tensors the calls send; the
     * next step overwrites them only once the previous call has completed. */
    st = weft_tensor_create(WEFT_F32, 2, wshape, &gw);
    if (st == WEFT_OK) {
        st = weft_tensor_create(WEFT_F32, 1, bshape, &gb);
    }
    if (st == WEFT_OK) {
        st = weft_value_create(&args);
    }
    if (st == WEFT_OK) {
        st = weft_value_add_tensor(args, gw);
    }
    if (st == WEFT_OK) {
        st = weft_value_add_tensor(args, gb);
    }
    if (st == WEFT_OK) {
        st = weft_value_create(&query);
    }
    if (st == WEFT_OK) {
        st = weft_value_set_payload(query, job->run, sizeof(*job->run));
    }
    if (st != WEFT_OK) {
        fprintf(stderr, PROG ": %s\n", weft_last_error());
        goto out;
    }

    /* The initial parameters; rank 0 checks that we run its configuration. */
    st = weft_rpc_sync(job->a, 0, "params", query, CALL_TIMEOUT_MS, &res);
    if (st != WEFT_OK) {
        fprintf(stderr, PROG ": params: %s: %s\n", weft_status_name(st), weft_last_error());
        goto out;
    }
    if (take_params(res, &m) != 0) {
        goto out;
    }
    weft_value_free(res);
    res = NULL;

    for (int epoch = 0; epoch < cfg->epochs; epoch++) {
        double t0 = ex_now();
        double loss_sum = 0.0;
        int64_t samples = 0;

        shuffle(shard, shard_n, cfg->seed * 1000003u + (uint64_t)epoch * 7919u + (uint64_t)rank);
        for (int64_t s = 0; s < job->run->steps_per_epoch; s++) {
            int64_t lo = s * cfg->batch;
            int64_t hi = lo + cfg->batch < shard_n ? lo + cfg->batch : shard_n;
            int n = hi > lo ? (int)(hi - lo) : 0;
            step_msg_t msg;
            size_t len;
            const step_msg_t *total;

            msg.step = epoch * job->run->steps_per_epoch + s;
            msg.samples = n;
            msg.loss_sum = minibatch_gradient(&m, job->train, shard + (n > 0 ? lo : 0), n, x,
                                              weft_tensor_data(gw), weft_tensor_data(gb));
            st = weft_value_set_payload(args, &msg, sizeof(msg));
            if (st == WEFT_OK) {
                st = weft_rpc_sync(job->a, 0, "step", args, CALL_TIMEOUT_MS, &res);
            }
            if (st != WEFT_OK) {
                fprintf(stderr, PROG ": step %lld: %s: %s\n", (long long)msg.step,
                        weft_status_name(st), weft_last_error());
                goto out;
            }
            total = weft_value_payload(res, &len);
            if (total == NULL || len != sizeof(*total) || total->step != msg.step ||
                take_params(res, &m) != 0) {
                fprintf(stderr, PROG ": step %lld: malformed reply\n", (long long)msg.step);
                goto out;
            }
            loss_sum += total->loss_sum;
            samples += total->samples;
            weft_value_free(res);
            res = NULL;
        }

        if (rank == 0) {
            double secs = ex_now() - t0;
            acc = accuracy(&m, job->test, x);
            printf("epoch %d/%d: train loss %.4f, %.0f samples/s, test accuracy %.2f%%\n",
                   epoch + 1, cfg->epochs, samples > 0 ? loss_sum / (double)samples : 0.0,
                   secs > 0 ? (double)samples / secs : 0.0, 100.0 * acc);
        }
    }
    if (rank == 0) {
        printf("final test accuracy: %.2f%%\n", 100.0 * acc);
    }

    /* Every rank checks that it ends with rank 0's parameters, bit for bit. */
    {
        verify_msg_t vm = {model_checksum(&m)};
        const verify_reply_t *vr;
        size_t len;

        st = weft_value_set_payload(query, &vm, sizeof(vm));
        if (st == WEFT_OK) {
            st = weft_rpc_sync(job->a, 0, "verify", query, CALL_TIMEOUT_MS, &res);
        }
        if (st != WEFT_OK) {
            fprintf(stderr, PROG ": verify: %s: %s\n", weft_status_name(st), weft_last_error());
            goto out;
        }
        vr = weft_value_payload(res, &len);
        if (vr == NULL || len != sizeof(*vr)) {
            fprintf(stderr, PROG ": verify: malformed reply\n");
            goto out;
        }
        printf("parameters identical on all ranks: %s (%d of %d match checksum %016llx)\n",
               vr->matching == vr->world ? "yes" : "no", vr->matching, vr->world,
               (unsigned long long)vr->checksum);
        if (vr->matching != vr->world) {
            goto out;
        }
    }
    rc = 0;

out:
    weft_value_free(res);
    weft_value_free(args);
    weft_value_free(query);
    weft_tensor_release(gw);
    weft_tensor_release(gb);
    model_free(&m);
    free(x);
    free(shard);
    return rc;
}

/* ----------------------------------------------------------------- main */

int main(int argc, char **argv)
{
    config_t cfg;
    mnist_set_t train_set = {0}, test_set = {0};
    weft_agent_opts_t opts;
    weft_agent_t *a;
    server_t server;
    int have_server = 0;
    run_msg_t run;
    job_t job;
    weft_status_t st;
    int world, rank, d;
    int64_t used, shard_max;
    int rc;

    setvbuf(stdout, NULL, _IOLBF, 0);
    rc = parse_args(argc, argv, &cfg);
    if (rc != 0) {
        return rc == 1 ? 0 : rc;
    }
    /* Data first: a missing or corrupt file ends the run before any rank waits for it. */
    if (mnist_load_splits(PROG, cfg.data_dir, &train_set, &test_set) != 0) {
        return EXIT_USAGE;
    }
    d = train_set.rows * train_set.cols;
    used = cfg.limit > 0 && cfg.limit < train_set.count ? cfg.limit : train_set.count;

    weft_agent_opts_init(&opts);
    st = weft_agent_create(&opts, &a);
    if (st != WEFT_OK) {
        fprintf(stderr, PROG ": cannot start the agent: %s: %s\n", weft_status_name(st),
                weft_last_error());
        rc = 1;
        goto err_free_data;
    }
    world = weft_agent_world_size(a);
    rank = weft_agent_rank(a);
    if (used < world) {
        fprintf(stderr, PROG ": %lld training samples cannot feed %d ranks\n", (long long)used,
                world);
        rc = EXIT_USAGE;
        goto err_free_agent;
    }

    /* Every rank runs the same number of steps: enough for the largest shard. */
    shard_max = (used + world - 1) / world;
    memset(&run, 0, sizeof(run));
    run.epochs = cfg.epochs;
    run.batch = cfg.batch;
    run.steps_per_epoch = (shard_max + cfg.batch - 1) / cfg.batch;
    run.limit = used;
    run.lr = cfg.lr;
    run.momentum = cfg.momentum;

    /* Rank 0 serves the parameters; its functions exist before anyone can call. */
    if (rank == 0) {
        if (server_init(&server, world, d, &run) != 0) {
            fprintf(stderr, PROG ": out of memory\n");
            rc = 1;
            server_free(&server);
            goto err_free_agent;
        }
        have_server = 1;
        if (weft_rpc_register(a, "params", fn_params, &server) != WEFT_OK ||
            weft_rpc_register(a, "step", fn_step, &server) != WEFT_OK ||
            weft_rpc_register(a, "verify", fn_verify, &server) != WEFT_OK) {
            fprintf(stderr, PROG ": register: %s\n", weft_last_error());
            rc = 1;
            goto err_free_agent;
        }
    }
    st = weft_agent_join(a);
    if (st != WEFT_OK) {
        fprintf(stderr, PROG ": join: %s: %s\n", weft_status_name(st), weft_last_error());
        rc = 1;
        goto err_free_agent;
    }
    if (rank == 0) {
        printf("softmax regression %d -> %d on %lld Fashion-MNIST images, %d rank%s, "
               "batch %d per rank, lr %g, momentum %g, %lld steps per epoch\n",
               d, NCLASS, (long long)used, world, world > 1 ? "s" : "", cfg.batch, cfg.lr,
               cfg.momentum, (long long)run.steps_per_epoch);
    }

    job.a = a;
    job.cfg = &cfg;
    job.run = &run;
    job.train = &train_set;
    job.test = &test_set;
    job.used = used;
    rc = train(&job);

    rc = ex_agent_shutdown(PROG, a, rc);

err_free_agent:
    /* The agent goes first: no handler can run on the server after this. */
    weft_agent_free(a);
    if (have_server) {
        server_free(&server);
    }
err_free_data:
    mnist_free(&train_set);
    mnist_free(&test_set);
    return rc;
}
