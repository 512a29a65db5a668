/*
 * ddp_rpc: torch's tutorial "Combining Distributed DataParallel with Distributed RPC Framework"
 * in C, with weft's RRefs, distributed autograd, DDP reducer and distributed optimizer.
 *
 *   weftrun -n 4 build/examples/ddp_rpc [--epochs 100] [--seed 1]
 *
 * The tutorial's four workers: ranks 0 and 1 are the trainers, rank 2 the master, rank 3 the
 * parameter server (ps). The model has a sparse part and a dense part:
 *
 *   sparse   EmbeddingBag(100, 16, mode sum) on the ps: a remote object (type "embedding_bag",
 *            registered on every rank) that the master makes with weft_rref_remote_object
 *            (torch's RemoteModule), with the methods
 *              forward(indices, offsets)  the bags' sums [B, 16], computed in the caller's
 *                                         distributed autograd context: the answer records a
 *                                         send function on the ps and a receive function on the
 *                                         caller, whose backward brings the gradient back here;
 *              parameter_rrefs()          an RRef of the weight (torch's remote_parameters());
 *              weight()                   a copy of the weight (the check at the end);
 *   dense    Linear(16, 8) on each trainer, replicated with the DDP reducer over a process group
 *            of the two trainers only (both made from the same seed; the reducer broadcasts
 *            trainer 0's values anyway).
 *
 * The master makes the embedding, calls run_trainer on both trainers with the embedding's RRef
 * and waits for both. Each trainer makes a DistributedOptimizer (SGD, lr 0.05) over the
 * embedding's parameter RRefs and RRefs of its own Linear's parameters (weft_rref_create on a
 * value holding each: owned by the trainer), and trains for --epochs epochs of 10 batches drawn
 * as the tutorial's get_next_batch does (20..50 indices in [0, 100), bags of 1..10 of them, a
 * label in [0, 8) per bag; a generator seeded per trainer). Per batch, in a distributed autograd
 * context of its own:
 *
 *   output = fc(emb.forward(indices, offsets))      the embedding by an RPC method call
 *   loss = cross_entropy(output, target)
 *   weft_ddp_backward_with(ddp, dist_backward)      weft_dist_backward with accumulate_grad: the
 *                                                   gradient flows to the ps along the recorded
 *                                                   call, the fc's .grad gets this trainer's
 *                                                   gradients and the reducer averages them
 *                                                   across the two trainers;
 *   weft_dist_context_set_gradient(fc params)       the averaged gradients into the context
 *   weft_dist_optim_step(ctx)                       the ps's embedding with this trainer's
 *                                                   gradient, the local fc with the averaged one
 *
 * and "Training done for epoch N" after each epoch, as the tutorial prints. The checks the
 * tutorial leaves implicit: after every epoch the trainers compare their fc parameters bit for
 * bit ("epoch N: ... fc replicas bit-identical on both trainers (fnv1a64 H)", a failure
 * otherwise); at the end the master compares the embedding's weight before and after training:
 * every row both trainers looked up changed, every row nobody looked up did not.
 *
 * The ps and the master serve until the master's work is over (common.h's wait_done); the trainers
 * wait for it too, then every rank shuts down (collectively). Each rank uses one BLAS thread.
 *
 * Exit status: 0 on success, 2 for bad options or a world other than 4 ranks, 1 for any other
 * failure (a check included).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <weft/weft.h>

#include "common.h"

#define PROG              "ddp_rpc"
#define WORLD             4
#define N_TRAINERS        2
#define MASTER            2
#define PS                3
#define NUM_EMBEDDINGS    100
#define EMBEDDING_DIM     16
#define NUM_CLASSES       8
#define BATCHES_PER_EPOCH 10
#define MIN_INDICES       20
#define MAX_INDICES       50
#define MAX_BAG           10
#define LR                0.05
#define CALL_TIMEOUT_MS   0 /* the agent's call timeout */

/* ---------------------------------------------------------- configuration */

typedef struct {
    int epochs;
    uint64_t seed;
} config_t;

static void usage(FILE *out)
{
    fprintf(out, "usage: weftrun -n 4 ddp_rpc [options]   (ranks 0 and 1 the trainers, rank 2 the\n"
                 "       master, rank 3 the parameter server)\n"
                 "  --epochs N   epochs of 10 batches each (default 100)\n"
                 "  --seed N     the models' and the batches' seed (default 1)\n");
}

/* Returns 0, 1 after --help, or EX_EXIT_USAGE after a message. */
static int parse_args(int argc, char **argv, config_t *cfg)
{
    const ex_opt_t opts[] = {
        EX_INT("epochs", &cfg->epochs, 1, 1000000),
        EX_U64("seed", &cfg->seed, 0, INT64_MAX),
    };

    memset(cfg, 0, sizeof(*cfg));
    cfg->epochs = 100;
    cfg->seed = 1;
    return ex_parse_opts(PROG, argc, argv, opts, sizeof(opts) / sizeof(opts[0]), usage);
}

static void fail(const char *what, weft_status_t st)
{
    ex_fail(PROG, what, st);
}

/* ------------------------------------------------------- the remote EmbeddingBag */

/* The constructor's payload. Payloads are fixed-layout structs: every rank runs this program on
 * one kind of machine (a real program would pin the byte order). */
typedef struct {
    int64_t num_embeddings;
    int64_t dim;
    uint64_t seed;
} emb_msg_t;

/* The embedding on its owner. Forward passes and the optimizer's steps (dist_autograd's, under
 * its own lock) touch the weight concurrently, hogwild, as torch's RemoteModule does; mu guards
 * the counters. */
typedef struct {
    pthread_mutex_t mu;
    weft_nn_embedding_bag_t *bag;
    int64_t forwards; /* under mu */
    int64_t recorded; /* of which in a context (graph recorded) */
} emb_t;

static weft_status_t emb_ctor(const weft_value_t *args, void *type_arg, void **obj_p)
{
    const emb_msg_t *m;
    emb_t *e;
    weft_rng_t rng;
    size_t len = 0;
    weft_status_t st;

    (void)type_arg;
    m = weft_value_payload(args, &len);
    if (m == NULL || len != sizeof(*m) || m->num_embeddings < 1 || m->dim < 1) {
        return WEFT_ERR_INVALID_ARG;
    }
    e = calloc(1, sizeof(*e));
    if (e == NULL) {
        return WEFT_ERR_NO_MEMORY;
    }
    pthread_mutex_init(&e->mu, NULL);
    weft_rng_init(&rng, m->seed, 7);
    st = weft_nn_embedding_bag_create(m->num_embeddings, m->dim, WEFT_BAG_SUM, 0, WEFT_F32, &rng,
                                      &e->bag);
    if (st != WEFT_OK) {
        pthread_mutex_destroy(&e->mu);
        free(e);
        return st;
    }
    *obj_p = e;
    return WEFT_OK;
}

static void emb_dtor(void *obj, void *type_arg)
{
    emb_t *e = obj;

    (void)type_arg;
    printf("EmbeddingBag freed by its owner after %lld forward passes (%lld in a context)\n",
           (long long)e->forwards, (long long)e->recorded);
    weft_nn_embedding_bag_free(e->bag);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

/*
 * forward(indices, offsets) -> the bags' sums [B, dim]. A method runs in its call's distributed
 * autograd context: with one, the graph is recorded (the weight is a leaf that requires
 * gradients) and the answer records a send function, whose backward is the gradient's way to the
 * weight. Without one (none of this program's calls), no graph.
 */
static void emb_forward(void *obj, weft_call_t *call, void *type_arg)
{
    emb_t *e = obj;
    const weft_value_t *args = weft_call_args(call);
    weft_tensor_t *indices = weft_value_tensor(args, 0);
    weft_tensor_t *offsets = weft_value_tensor(args, 1);
    const uint64_t ctx = weft_call_context(call);
    weft_value_t *res = NULL;
    weft_tensor_t *y = NULL;
    weft_status_t st;
    int prev;

    (void)type_arg;
    if (indices == NULL || offsets == NULL || weft_tensor_dtype(indices) != WEFT_I64 ||
        weft_tensor_dtype(offsets) != WEFT_I64) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG,
                       "embedding_bag: forward wants i64 indices and offsets");
        return;
    }
    prev = weft_grad_set_enabled(ctx != 0);
    st = weft_nn_embedding_bag_forward(e->bag, indices, offsets, &y);
    weft_grad_set_enabled(prev);
    if (st == WEFT_OK) {
        pthread_mutex_lock(&e->mu);
        e->forwards++;
        e->recorded += ctx != 0;
        pthread_mutex_unlock(&e->mu);
        st = weft_value_create(&res);
    }
    if (st == WEFT_OK) {
        st = weft_value_push_tensor(res, y);
    }
    if (st != WEFT_OK) {
        weft_tensor_release(y);
        weft_value_free(res);
        weft_call_fail(call, st, "embedding_bag: forward: %s", weft_last_error());
        return;
    }
    weft_call_reply(call, res);
}

/* parameter_rrefs() -> an RRef of the weight, owned here (torch's remote_parameters()). */
static void emb_parameter_rrefs(void *obj, weft_call_t *call, void *type_arg)
{
    emb_t *e = obj;
    weft_value_t *res = NULL;
    weft_value_t *pv = NULL;
    weft_rref_t *r = NULL;
    weft_status_t st;

    (void)type_arg;
    st = weft_value_create(&res);
    if (st == WEFT_OK) {
        st = weft_value_create(&pv);
    }
    if (st == WEFT_OK) {
        st = weft_value_add_tensor(pv, weft_nn_embedding_bag_weight(e->bag));
    }
    if (st == WEFT_OK) {
        st = weft_rref_create(weft_call_agent(call), pv, &r); /* takes pv */
        if (st == WEFT_OK) {
            pv = NULL;
        }
    }
    if (st == WEFT_OK) {
        st = weft_value_add_rref(res, r);
    }
    weft_rref_release(r);
    weft_value_free(pv);
    if (st != WEFT_OK) {
        weft_value_free(res);
        weft_call_fail(call, st, "embedding_bag: parameter_rrefs: %s", weft_last_error());
        return;
    }
    weft_call_reply(call, res);
}

/* weight() -> a copy of the weight [num_embeddings, dim]. */
static void emb_weight(void *obj, weft_call_t *call, void *type_arg)
{
    emb_t *e = obj;
    weft_value_t *res = NULL;
    weft_tensor_t *w = NULL;
    weft_status_t st;

    (void)type_arg;
    st = weft_tensor_clone(weft_nn_embedding_bag_weight(e->bag), &w);
    if (st == WEFT_OK) {
        st = weft_value_create(&res);
    }
    if (st == WEFT_OK) {
        st = weft_value_push_tensor(res, w);
    }
    if (st != WEFT_OK) {
        weft_tensor_release(w);
        weft_value_free(res);
        weft_call_fail(call, st, "embedding_bag: weight: %s", weft_last_error());
        return;
    }
    weft_call_reply(call, res);
}

static const weft_rref_method_t emb_methods[] = {
    {"forward", emb_forward},
    {"parameter_rrefs", emb_parameter_rrefs},
    {"weight", emb_weight},
};

/* ------------------------------------------------------------------ the trainers */

/* What a trainer answers run_trainer with. */
typedef struct {
    int32_t rank;
    int32_t steps;
    uint8_t touched[NUM_EMBEDDINGS]; /* rows of the embedding this trainer looked up */
} trainer_msg_t;

/*
 * The run_trainer call, handed to the trainer's main thread: the handler keeps the call and
 * completes @p started; the main thread trains and answers it (torch runs _run_trainer on its RPC
 * thread; weft's handlers must not block the transport).
 */
typedef struct {
    pthread_mutex_t mu;
    weft_future_t *started;
    weft_call_t *call; /* under mu until started completes */
    int closed;        /* under mu: no (more) run_trainer taken */
} trainer_slot_t;

/* run_trainer(emb_rref) -> trainer_msg_t, once this trainer's training is over. */
static void fn_run_trainer(weft_call_t *call, void *arg)
{
    trainer_slot_t *s = arg;

    pthread_mutex_lock(&s->mu);
    if (s->closed || s->call != NULL || weft_value_rref(weft_call_args(call), 0) == NULL) {
        pthread_mutex_unlock(&s->mu);
        weft_call_fail(call, WEFT_ERR_INVALID_STATE,
                       "run_trainer: wants the embedding's RRef, once per run");
        return;
    }
    s->call = call;
    pthread_mutex_unlock(&s->mu);
    (void)weft_future_complete(s->started, WEFT_OK, NULL, NULL);
}

/* A trainer's model and optimizer. */
typedef struct {
    weft_agent_t *a;
    weft_pg_t *pg;                   /* the two trainers */
    weft_rref_t *emb;                /* the remote EmbeddingBag */
    weft_nn_linear_t *fc;            /* Linear(16, 8), replicated */
    const weft_param_list_t *params; /* fc's, borrowed from it */
    weft_ddp_t *ddp;
    weft_rref_t *prefs[8]; /* the optimizer's parameters: the embedding's, then the fc's */
    size_t n_prefs;
    weft_dist_optim_t *opt;
} trainer_t;

static void trainer_free(trainer_t *t)
{
    weft_dist_optim_free(t->opt);
    for (size_t i = 0; i < t->n_prefs; i++) {
        weft_rref_release(t->prefs[i]);
    }
    weft_ddp_free(t->ddp);
    weft_nn_linear_free(t->fc);
    weft_rref_release(t->emb);
    memset(t, 0, sizeof(*t));
}

/* Adds @p r (retained) to the optimizer's parameters. */
static weft_status_t add_pref(trainer_t *t, weft_rref_t *r)
{
    if (t->n_prefs == sizeof(t->prefs) / sizeof(t->prefs[0])) {
        return WEFT_ERR_INVALID_STATE;
    }
    t->prefs[t->n_prefs++] = weft_rref_retain(r);
    return WEFT_OK;
}

/* The model: fc under the DDP reducer (collective over the two trainers), the parameter RRefs
 * (the embedding's remote ones and the fc's local ones), the distributed optimizer.
 * @return 0, or -1 after a message. */
static int trainer_init(trainer_t *t, weft_agent_t *a, weft_pg_t *pg, weft_rref_t *emb,
                        const config_t *cfg)
{
    weft_dist_optim_config_t oc;
    weft_ddp_opts_t o;
    weft_value_t *res = NULL;
    weft_rng_t rng;
    const char *what = "fc";
    weft_status_t st;

    memset(t, 0, sizeof(*t));
    t->a = a;
    t->pg = pg;
    t->emb = weft_rref_retain(emb);
    /* The same seed on both trainers: the replicas start equal (the reducer broadcasts group
     * rank 0's values anyway). */
    weft_rng_init(&rng, cfg->seed, 1);
    st = weft_nn_linear_create(EMBEDDING_DIM, NUM_CLASSES, 1, WEFT_F32, &rng, &t->fc);
    if (st == WEFT_OK) {
        t->params = weft_nn_linear_params(t->fc);
        what = "DDP reducer";
        weft_ddp_opts_init(&o);
        st = weft_ddp_create(pg, t->params, &o, &t->ddp);
    }
    if (st == WEFT_OK) {
        what = "parameter_rrefs";
        st = weft_rref_rpc_sync(emb, "parameter_rrefs", NULL, CALL_TIMEOUT_MS, &res);
    }
    for (size_t i = 0; st == WEFT_OK && i < weft_value_num_refs(res); i++) {
        st = add_pref(t, weft_value_rref(res, i));
    }
    weft_value_free(res);
    /* The fc's parameters: RRefs owned by this trainer (torch's RRef(param)). */
    for (int i = 0; st == WEFT_OK && i < weft_param_list_size(t->params); i++) {
        weft_value_t *pv = NULL;
        weft_rref_t *r = NULL;

        what = "RRef of a local parameter";
        st = weft_value_create(&pv);
        if (st == WEFT_OK) {
            st = weft_value_add_tensor(pv, weft_param_list_get(t->params, i));
        }
        if (st == WEFT_OK) {
            st = weft_rref_create(a, pv, &r); /* takes pv */
            if (st == WEFT_OK) {
                pv = NULL;
            }
        }
        if (st == WEFT_OK) {
            st = add_pref(t, r);
        }
        weft_rref_release(r);
        weft_value_free(pv);
    }
    if (st == WEFT_OK) {
        what = "distributed optimizer";
        weft_dist_optim_config_init(&oc, WEFT_DIST_OPTIM_SGD, LR);
        st = weft_dist_optim_create(a, &oc, t->n_prefs, t->prefs, &t->opt);
    }
    if (st != WEFT_OK) {
        fail(what, st);
        trainer_free(t);
        return -1;
    }
    return 0;
}

/* One batch, the tutorial's get_next_batch: 20..50 indices in [0, 100), bags of 1..10 of them
 * (offsets), a label in [0, 8) per bag. Rows looked up are marked in @p touched. */
static weft_status_t next_batch(weft_rng_t *rng, uint8_t *touched, weft_tensor_t **indices_p,
                                weft_tensor_t **offsets_p, weft_tensor_t **target_p)
{
    const int64_t n = MIN_INDICES + (int64_t)weft_rng_below(rng, MAX_INDICES - MIN_INDICES + 1);
    int64_t offs[MAX_INDICES];
    int64_t b = 0;
    weft_tensor_t *indices = NULL;
    weft_tensor_t *offsets = NULL;
    weft_tensor_t *target = NULL;
    weft_status_t st;

    st = weft_tensor_create(WEFT_I64, 1, &n, &indices);
    for (int64_t i = 0; st == WEFT_OK && i < n; i++) {
        int64_t row = (int64_t)weft_rng_below(rng, NUM_EMBEDDINGS);
        ((int64_t *)weft_tensor_data(indices))[i] = row;
        touched[row] = 1;
    }
    for (int64_t start = 0; start < n; start += 1 + (int64_t)weft_rng_below(rng, MAX_BAG)) {
        offs[b++] = start;
    }
    if (st == WEFT_OK) {
        st = weft_tensor_create(WEFT_I64, 1, &b, &offsets);
    }
    if (st == WEFT_OK) {
        memcpy(weft_tensor_data(offsets), offs, (size_t)b * sizeof(offs[0]));
        st = weft_tensor_create(WEFT_I64, 1, &b, &target);
    }
    for (int64_t i = 0; st == WEFT_OK && i < b; i++) {
        ((int64_t *)weft_tensor_data(target))[i] = (int64_t)weft_rng_below(rng, NUM_CLASSES);
    }
    if (st != WEFT_OK) {
        weft_tensor_release(indices);
        weft_tensor_release(offsets);
        weft_tensor_release(target);
        return st;
    }
    *indices_p = indices;
    *offsets_p = offsets;
    *target_p = target;
    return WEFT_OK;
}

/* The backward weft_ddp_backward_with runs: the whole job's, from this trainer's loss. */
typedef struct {
    weft_agent_t *a;
    uint64_t ctx;
    weft_tensor_t *loss;
} step_t;

static weft_status_t dist_backward(void *arg)
{
    step_t *s = arg;
    weft_dist_backward_opts_t o;

    weft_dist_backward_opts_init(&o);
    o.accumulate_grad = true; /* into the fc's .grad too: the reducer's hooks run */
    return weft_dist_backward(s->a, s->ctx, 1, &s->loss, &o);
}

/* The embedding's forward by RPC in the current context: [B, 16] into @p y_p. */
static weft_status_t remote_emb_forward(trainer_t *t, weft_tensor_t *indices,
                                        weft_tensor_t *offsets, weft_tensor_t **y_p)
{
    weft_value_t *args = NULL;
    weft_value_t *res = NULL;
    weft_tensor_t *y;
    weft_status_t st;

    st = weft_value_create(&args);
    if (st == WEFT_OK) {
        st = weft_value_add_tensor(args, indices);
    }
    if (st == WEFT_OK) {
        st = weft_value_add_tensor(args, offsets);
    }
    if (st == WEFT_OK) {
        st = weft_rref_rpc_sync(t->emb, "forward", args, CALL_TIMEOUT_MS, &res);
    }
    weft_value_free(args);
    if (st != WEFT_OK) {
        return st;
    }
    y = weft_value_tensor(res, 0);
    if (y == NULL || weft_tensor_ndim(y) != 2 || weft_tensor_shape(y)[1] != EMBEDDING_DIM ||
        weft_tensor_shape(y)[0] != weft_tensor_numel(offsets)) {
        weft_value_free(res);
        return WEFT_ERR_PROTOCOL;
    }
    *y_p = weft_tensor_retain(y);
    weft_value_free(res);
    return WEFT_OK;
}

/* One batch in a context of its own; its loss into @p loss_p. @return 0, or -1 after a message. */
static int train_batch(trainer_t *t, weft_tensor_t *indices, weft_tensor_t *offsets,
                       weft_tensor_t *target, double *loss_p)
{
    weft_tensor_t *emb_out = NULL;
    weft_tensor_t *out = NULL;
    weft_tensor_t *loss = NULL;
    const char *what = "context";
    step_t step;
    uint64_t ctx = 0;
    weft_status_t st;
    int rc = -1;

    st = weft_dist_context_create(t->a, &ctx);
    if (st != WEFT_OK) {
        fail(what, st);
        return -1;
    }
    what = "embedding forward";
    st = remote_emb_forward(t, indices, offsets, &emb_out);
    if (st == WEFT_OK) {
        what = "fc forward";
        st = weft_nn_linear_forward(t->fc, emb_out, &out);
    }
    if (st == WEFT_OK) {
        what = "loss";
        st = weft_op_cross_entropy(out, target, WEFT_REDUCTION_MEAN, &loss);
    }
    if (st == WEFT_OK) {
        *loss_p = ((const float *)weft_tensor_data(loss))[0];
        what = "distributed backward under DDP";
        step = (step_t){.a = t->a, .ctx = ctx, .loss = loss};
        st = weft_ddp_backward_with(t->ddp, dist_backward, &step);
    }
    /* The fc's averaged gradients are what the optimizer steps them with. */
    for (int i = 0; st == WEFT_OK && i < weft_param_list_size(t->params); i++) {
        weft_tensor_t *p = weft_param_list_get(t->params, i);
        weft_tensor_t *g = weft_tensor_grad(p);

        what = "averaged gradient into the context";
        st = g != NULL ? weft_dist_context_set_gradient(t->a, ctx, p, g) : WEFT_ERR_INVALID_STATE;
    }
    weft_param_list_zero_grad(t->params);
    if (st == WEFT_OK) {
        what = "optimizer step";
        st = weft_dist_optim_step(t->opt, ctx, 0);
    }
    if (st != WEFT_OK) {
        fail(what, st);
        goto out;
    }
    rc = 0;

out:
    st = weft_dist_context_release(t->a, ctx, 0);
    if (st != WEFT_OK && rc == 0) {
        fail("context release", st);
        rc = -1;
    }
    weft_tensor_release(loss);
    weft_tensor_release(out);
    weft_tensor_release(emb_out);
    return rc;
}

/* torch's _run_trainer on trainer @p rank with the embedding @p emb; the answer into @p msg.
 * @return 0, or 1 after a message. */
static int run_trainer(weft_agent_t *a, weft_pg_t *pg, weft_rref_t *emb, const config_t *cfg,
                       int rank, trainer_msg_t *msg)
{
    trainer_t t;
    weft_rng_t rng;
    double t0, loss_sum = 0;
    int rc = 1;

    if (trainer_init(&t, a, pg, emb, cfg) != 0) {
        return 1;
    }
    memset(msg, 0, sizeof(*msg));
    msg->rank = rank;
    printf("trainer %d: fc Linear(%d, %d) under DDP with trainer %d, EmbeddingBag(%d, %d, mode "
           "sum) on %s, DistributedOptimizer SGD lr %g over %zu parameter RRefs\n",
           rank, EMBEDDING_DIM, NUM_CLASSES, 1 - rank, NUM_EMBEDDINGS, EMBEDDING_DIM,
           weft_rref_owner_name(emb), LR, t.n_prefs);
    weft_rng_init(&rng, cfg->seed, 100 + (uint64_t)rank); /* this trainer's batches */
    t0 = ex_now();
    for (int epoch = 0; epoch < cfg->epochs; epoch++) {
        uint64_t hash = 0;
        int same = 0;

        loss_sum = 0;
        for (int b = 0; b < BATCHES_PER_EPOCH; b++) {
            weft_tensor_t *indices = NULL, *offsets = NULL, *target = NULL;
            double loss = 0;
            weft_status_t st = next_batch(&rng, msg->touched, &indices, &offsets, &target);
            int bad;

            if (st != WEFT_OK) {
                fail("batch", st);
                goto out;
            }
            bad = train_batch(&t, indices, offsets, target, &loss) != 0;
            weft_tensor_release(indices);
            weft_tensor_release(offsets);
            weft_tensor_release(target);
            if (bad) {
                goto out;
            }
            if (!isfinite(loss)) {
                fprintf(stderr, PROG ": trainer %d: epoch %d batch %d: the loss is %g\n", rank,
                        epoch, b, loss);
                goto out;
            }
            loss_sum += loss;
            msg->steps++;
        }
        /* The check the tutorial leaves implicit: DDP keeps the replicas equal, bit for bit. */
        if (ex_params_identical(PROG, pg, t.params, &same, &hash) != 0) {
            goto out;
        }
        printf("epoch %d: mean loss %.4f, fc replicas %s on both trainers (fnv1a64 %016llx)\n",
               epoch, loss_sum / BATCHES_PER_EPOCH, same ? "bit-identical" : "DIFFER",
               (unsigned long long)hash);
        if (!same) {
            fprintf(stderr, PROG ": trainer %d: epoch %d: the fc replicas differ\n", rank, epoch);
            goto out;
        }
        printf("Training done for epoch %d\n", epoch);
    }
    {
        const double s = ex_now() - t0;
        printf("trainer %d: %d epochs of %d batches in %.3f s (%.3f ms per batch), last epoch's "
               "mean loss %.4f\n",
               rank, cfg->epochs, BATCHES_PER_EPOCH, s, 1e3 * s / msg->steps,
               loss_sum / BATCHES_PER_EPOCH);
    }
    rc = 0;

out:
    trainer_free(&t);
    return rc;
}

/* A trainer's rank after the join: waits for the master's run_trainer (or the master's end),
 * trains, answers. @return the exit status. */
static int trainer_main(weft_agent_t *a, weft_pg_t *pg, trainer_slot_t *slot, const config_t *cfg)
{
    const int rank = weft_agent_rank(a);
    weft_future_t *done_f = NULL;
    weft_call_t *call;
    trainer_msg_t msg;
    weft_status_t st;
    size_t which = 0;
    int rc;

    st = weft_rpc_async(a, MASTER, "wait_done", NULL, EX_SERVE_TIMEOUT_MS, &done_f);
    if (st != WEFT_OK) {
        fail("wait_done", st);
        return 1;
    }
    {
        weft_future_t *fs[2] = {slot->started, done_f};
        (void)weft_future_wait_any(fs, 2, 0, &which);
    }
    pthread_mutex_lock(&slot->mu);
    slot->closed = 1;
    call = slot->call;
    pthread_mutex_unlock(&slot->mu);
    if (call == NULL) {
        fprintf(stderr, PROG ": trainer %d: the master ended without starting the training\n",
                rank);
        (void)ex_wait_all(PROG, &done_f, 1, "waiting for the master");
        return 1;
    }
    rc = run_trainer(a, pg, weft_value_rref(weft_call_args(call), 0), cfg, rank, &msg);
    if (rc == 0) {
        weft_value_t *res = NULL;

        st = weft_value_create(&res);
        if (st == WEFT_OK) {
            st = weft_value_set_payload(res, &msg, sizeof(msg));
        }
        if (st != WEFT_OK) {
            weft_value_free(res);
            weft_call_fail(call, st, "trainer %d: no memory for the answer", rank);
            rc = 1;
        } else {
            weft_call_reply(call, res);
        }
    } else {
        weft_call_fail(call, WEFT_ERR_REMOTE, "trainer %d failed (see its stderr)", rank);
    }
    /* Serve until the master is done: the shutdown is collective. */
    if (ex_wait_all(PROG, &done_f, 1, "waiting for the master") != 0 && rc == 0) {
        rc = 1;
    }
    return rc;
}

/* ------------------------------------------------------------------ the master */

/* A copy of the embedding's weight into @p w_p. */
static weft_status_t emb_weight_copy(weft_rref_t *emb, weft_tensor_t **w_p)
{
    weft_value_t *res = NULL;
    weft_tensor_t *w;
    weft_status_t st = weft_rref_rpc_sync(emb, "weight", NULL, CALL_TIMEOUT_MS, &res);

    if (st != WEFT_OK) {
        return st;
    }
    w = weft_value_tensor(res, 0);
    if (w == NULL || weft_tensor_dtype(w) != WEFT_F32 ||
        weft_tensor_numel(w) != NUM_EMBEDDINGS * EMBEDDING_DIM) {
        weft_value_free(res);
        return WEFT_ERR_PROTOCOL;
    }
    *w_p = weft_tensor_retain(w);
    weft_value_free(res);
    return WEFT_OK;
}

/* Every row both trainers looked up changed; no row nobody looked up did. @return 0, or 1 after
 * a message. */
static int check_embedding(const weft_tensor_t *before, const weft_tensor_t *after,
                           const trainer_msg_t *msg)
{
    const size_t row = EMBEDDING_DIM * sizeof(float);
    int both = 0, both_changed = 0, neither = 0, neither_changed = 0;

    for (int r = 0; r < NUM_EMBEDDINGS; r++) {
        const int changed =
            memcmp((const char *)weft_tensor_data(before) + (size_t)r * row,
                   (const char *)weft_tensor_data(after) + (size_t)r * row, row) != 0;

        if (msg[0].touched[r] && msg[1].touched[r]) {
            both++;
            both_changed += changed;
        } else if (!msg[0].touched[r] && !msg[1].touched[r]) {
            neither++;
            neither_changed += changed;
        }
    }
    printf("embedding rows looked up by both trainers: %d of %d, changed by training: %d of %d; "
           "rows looked up by neither: %d, changed: %d\n",
           both, NUM_EMBEDDINGS, both_changed, both, neither, neither_changed);
    if (both == 0 || both_changed != both || neither_changed != 0) {
        printf("embedding check: FAILED\n");
        fprintf(stderr, PROG ": the embedding's rows did not change as the lookups say\n");
        return 1;
    }
    printf("embedding check: passed\n");
    return 0;
}

/* The master: the remote embedding, run_trainer on both trainers, the embedding's check.
 * @return the exit status. */
static int master_main(weft_agent_t *a, const config_t *cfg)
{
    emb_msg_t em = {.num_embeddings = NUM_EMBEDDINGS, .dim = EMBEDDING_DIM, .seed = cfg->seed};
    weft_future_t *fs[N_TRAINERS] = {NULL};
    trainer_msg_t msg[N_TRAINERS];
    weft_tensor_t *before = NULL;
    weft_tensor_t *after = NULL;
    weft_value_t *args = NULL;
    weft_rref_t *emb = NULL;
    const char *what = "embedding";
    int started = 0;
    int malformed = 0;
    double t0;
    weft_status_t st;
    int rc = 1;

    st = weft_value_create(&args);
    if (st == WEFT_OK) {
        st = weft_value_set_payload(args, &em, sizeof(em));
    }
    if (st == WEFT_OK) {
        st = weft_rref_remote_object(a, PS, "embedding_bag", args, CALL_TIMEOUT_MS, &emb);
    }
    weft_value_free(args);
    args = NULL;
    if (st == WEFT_OK) {
        what = "the embedding's weight before training";
        st = emb_weight_copy(emb, &before);
    }
    if (st != WEFT_OK) {
        fail(what, st);
        goto out;
    }
    printf("master: EmbeddingBag(%d, %d, mode sum) on %s (the parameter server); training on "
           "%s and %s for %d epochs of %d batches\n",
           NUM_EMBEDDINGS, EMBEDDING_DIM, weft_rref_owner_name(emb), weft_agent_worker_name(a, 0),
           weft_agent_worker_name(a, 1), cfg->epochs, BATCHES_PER_EPOCH);
    t0 = ex_now();
    for (int r = 0; r < N_TRAINERS; r++) {
        st = weft_value_create(&args);
        if (st == WEFT_OK) {
            st = weft_value_add_rref(args, emb);
        }
        if (st == WEFT_OK) {
            /* wait_done's long deadline: run_trainer lasts the whole training. */
            st = weft_rpc_async(a, r, "run_trainer", args, EX_SERVE_TIMEOUT_MS, &fs[r]);
        }
        weft_value_free(args);
        args = NULL;
        if (st != WEFT_OK) {
            fail("run_trainer", st);
            (void)ex_wait_all(PROG, fs, started, "training");
            goto out;
        }
        started++;
    }
    /* Wait for all training to finish. */
    (void)weft_future_wait_all(fs, N_TRAINERS, 0);
    for (int r = 0; r < N_TRAINERS; r++) {
        const weft_value_t *v = weft_future_value(fs[r]);
        const void *p = NULL;
        size_t len = 0;

        if (weft_future_status(fs[r]) != WEFT_OK) {
            continue; /* ex_wait_all says why */
        }
        p = v != NULL ? weft_value_payload(v, &len) : NULL;
        if (p == NULL || len != sizeof(msg[r])) {
            fprintf(stderr, PROG ": trainer %d answered run_trainer with %zu bytes, not %zu\n", r,
                    len, sizeof(msg[r]));
            malformed = 1;
        } else {
            memcpy(&msg[r], p, sizeof(msg[r]));
        }
    }
    if (ex_wait_all(PROG, fs, N_TRAINERS, "training") != 0 || malformed) {
        goto out;
    }
    printf("master: training done on both trainers in %.3f s (%d steps each)\n", ex_now() - t0,
           msg[0].steps);
    st = emb_weight_copy(emb, &after);
    if (st != WEFT_OK) {
        fail("the embedding's weight after training", st);
        goto out;
    }
    rc = check_embedding(before, after, msg);

out:
    weft_tensor_release(after);
    weft_tensor_release(before);
    weft_rref_release(emb);
    return rc;
}

/* ----------------------------------------------------------------- main */

int main(int argc, char **argv)
{
    config_t cfg;
    weft_agent_opts_t opts;
    weft_agent_t *a = NULL;
    weft_pg_t *pg = NULL;
    ex_done_t done = EX_DONE_INIT;
    trainer_slot_t slot = {.mu = PTHREAD_MUTEX_INITIALIZER};
    const int trainer_ranks[N_TRAINERS] = {0, 1};
    weft_status_t st;
    int rank;
    int rc;

    setvbuf(stdout, NULL, _IOLBF, 0);
    rc = parse_args(argc, argv, &cfg);
    if (rc != 0) {
        return rc == 1 ? 0 : rc;
    }
    weft_op_set_threads(1);

    weft_agent_opts_init(&opts);
    st = weft_agent_create(&opts, &a);
    if (st != WEFT_OK) {
        fail("cannot start the agent", st);
        return 1;
    }
    if (weft_agent_world_size(a) != WORLD) {
        fprintf(stderr,
                PROG ": runs on exactly %d ranks (2 trainers, the master, the parameter server), "
                     "not %d\n",
                WORLD, weft_agent_world_size(a));
        rc = EX_EXIT_USAGE;
        goto err_free_agent;
    }
    rank = weft_agent_rank(a);
    st = weft_future_create(&slot.started);
    if (st != WEFT_OK) {
        fail("setup", st);
        rc = 1;
        goto err_free_agent;
    }
    /* Every rank, before the join: distributed autograd, RRefs, the embedding's type; the
     * master's wait_done and the trainers' run_trainer. */
    st = weft_dist_init(a);
    if (st == WEFT_OK) {
        st = weft_rref_init(a);
    }
    if (st == WEFT_OK) {
        st = weft_rref_register_type(a, "embedding_bag", emb_ctor, emb_dtor, emb_methods,
                                     (int)(sizeof(emb_methods) / sizeof(emb_methods[0])), NULL);
    }
    if (st == WEFT_OK && rank == MASTER) {
        st = weft_rpc_register(a, "wait_done", ex_wait_done_fn, &done);
    }
    if (st == WEFT_OK && rank < N_TRAINERS) {
        st = weft_rpc_register(a, "run_trainer", fn_run_trainer, &slot);
    }
    if (st != WEFT_OK) {
        fail("setup", st);
        rc = 1;
        goto err_free_future;
    }
    st = weft_agent_join(a);
    if (st != WEFT_OK) {
        fail("join", st);
        rc = 1;
        goto err_free_future;
    }
    /* The trainers' group (torch's init_process_group of the two trainers): every rank makes it,
     * the others get a non-member handle. */
    st = weft_pg_new(a, trainer_ranks, N_TRAINERS, &pg);
    if (st != WEFT_OK) {
        fail("the trainers' group", st);
        rc = 1;
    } else if (rank == MASTER) {
        rc = master_main(a, &cfg);
        ex_done_announce(&done);
    } else if (rank == PS) {
        /* The parameter server serves until the master is done. */
        rc = ex_wait_done(PROG, a, MASTER, MASTER, "waiting for the master") == 0 ? 0 : 1;
    } else {
        rc = trainer_main(a, pg, &slot, &cfg);
    }
    weft_pg_free(pg);
    rc = ex_agent_shutdown(PROG, a, rc);

err_free_future:
    /* A run_trainer that came after the trainer gave up was failed by the handler. */
    weft_future_release(slot.started);
err_free_agent:
    weft_agent_free(a);
    return rc;
}
