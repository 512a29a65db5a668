/*
 * pipeline_ddp: pipeline parallelism combined with data parallelism, what torch's tutorials
 * describe ("Combining Distributed DataParallel with Distributed RPC Framework", "Distributed
 * Pipeline Parallelism Using RPC") but ship no code for: the CNN of examples/pipeline_train cut
 * into two pipeline stages driven over RPC, each stage replicated twice, the replicas of a stage
 * averaging their gradients over a collectives sub-group of their own.
 *
 *   weftrun -n 5 build/examples/pipeline_ddp [--replicas 1|2] [--compare] [--splits 4]
 *           [--batch 64] [--lr 0.05] [--momentum 0] [--timing-steps 10] [--epochs 1]
 *           [--limit N] [--check-every N] [--json] [--data DIR]
 *
 *   rank 0        the master: it feeds the micro-batches, takes the loss, runs the backward
 *   ranks 1, 2    stage 1 (conv(1->32)-relu-maxpool-conv(32->64)-relu-maxpool), replicas A, B
 *   ranks 3, 4    stage 2 (flatten-fc(3136->128)-relu-fc(128->10)), replicas A, B
 *
 *   pipeline A    rank 1 -> rank 3          stage 1's group: ranks {1, 2}
 *   pipeline B    rank 2 -> rank 4          stage 2's group: ranks {3, 4}
 *
 * Each stage replica is a remote object (type "stage", made by the master with
 * weft_rref_remote_object from the same seed) with the methods
 *
 *   forward(x_rref)  pipeline_train's: x = to_here(x_rref), the stage's layers under its lock, in
 *                    the caller's distributed autograd context, on a thread of the rank's pool;
 *   step(ctx)        the DDP part: the replica's parameters' gradients from the context
 *                    (weft_dist_get_gradients), averaged with its twin's over the stage's group,
 *                    then a step of its own local SGD (--lr, --momentum) on the averages;
 *   sync()           group rank 0's parameters broadcast to its twin (once, when made: the
 *                    replicas start identical even if their constructions were not);
 *   check()          ex_params_identical over the group: the twins' parameters bit for bit.
 *
 * Per step the master takes a batch of 2 x --batch images, gives each pipeline half of it (with
 * --replicas 1 the whole batch goes through pipeline A: the same work per step), cuts each half
 * into --splits micro-batches and drives them exactly as pipeline_train does (x_rref =
 * weft_rref_create(micro-batch); y_rref = weft_rref_remote_method(stage 1 replica, "forward",
 * x_rref); z = weft_rref_rpc_async(stage 2 replica, "forward", y_rref); at most --splits in flight
 * per pipeline), both pipelines at once and all in ONE distributed autograd context. It
 * concatenates the outputs (A's, then B's), takes the cross entropy over the 2 x --batch images,
 * runs one weft_dist_backward (the gradients flow back along both pipelines), then calls step(ctx)
 * on every working replica in parallel and releases the context.
 *
 * The averaging is DDP's. The loss is the mean over the whole batch, so replica A's gradient in
 * the context is (1 / 2B) x the sum over A's half: the replica first multiplies it by the number
 * of replicas (exact: a power of two), which gives the gradient of the mean loss over its own B
 * images, what a DDP replica holds before its all_reduce, then averages it with its twin's by
 * all_reduce AVG: the mean over the replicas, DDP's. Both replicas end with the gradient of the
 * whole batch's loss, the same (up to the order of sums) as one pipeline's with --replicas 1:
 * with --compare the master checks that the first step's averaged gradients agree.
 *
 * Why one all_reduce of a flat buffer rather than the DDP reducer (weft_ddp_t): the reducer
 * averages while backward runs, from hooks the engine fires as each parameter's .grad is
 * accumulated. Here the stages' parameters are leaves on workers other than the backward's root:
 * distributed autograd puts their gradients in the context and neither writes their .grad nor
 * runs their hooks (as torch; weft_ddp_backward_with exists for replicas that hold the loss, as
 * in examples/ddp_rpc). Driving the reducer would mean a second local backward per step just to
 * fire its hooks, after the real one has ended: no overlap to win, a graph more to build. So each
 * replica packs all of its stage's gradients (stage 1: 18,816 floats; stage 2: 402,826) and one
 * flag into one buffer and all_reduces it (AVG) over the stage's group, once per step. The flag
 * is DDP's bookkeeping: 1 on a replica that lacks a parameter's gradient (or the context), so
 * that both twins still meet in the all_reduce and both refuse the step instead of one of them
 * waiting forever. The collectives give every member the same result bit for bit and the local
 * SGDs start from the same values, so the replicas stay bit-identical: after each timing run
 * with two replicas, every --check-every training steps and after training, the master has the
 * twins compare their parameters ("stage K replicas bit-identical: yes (...)"; a failure
 * otherwise).
 *
 * First the timing: --timing-steps steps (after one warm-up step) on batches of 2 x --batch
 * random images and labels (a fixed seed), "replicas = R, splits = k, samples/s = x" for
 * --replicas; with --compare, fresh stage objects with 1 and then 2 replicas on the same batches,
 * and "2 replicas / 1 replica = r". Then fresh stages train on Fashion-MNIST for --epochs
 * (--epochs 0: timing only, no data needed) and the test accuracy is measured through the
 * pipelines without a context. --json prints one line at the end.
 *
 * The stages' ranks (the idle ones too, with --replicas 1) serve until the master is done
 * (common.h's wait_done), then every rank shuts down collectively. Each rank uses one BLAS
 * thread. The stage type's layers and forward, the ranks' thread pool and the micro-batch driver
 * are pipeline_stage.c's, shared with pipeline_train.
 *
 * Exit status: 0 on success, 2 for bad options, a world other than 5 ranks, or missing or corrupt
 * data, 1 for any other failure (a check included).
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
#include "pipeline_stage.h"

#define PROG            "pipeline_ddp"
#define IMAGE_SIDE      PIPE_IMAGE_SIDE
#define MASTER          0
#define N_STAGES        2
#define MAX_REPLICAS    PIPE_MAX_LINES
#define WORLD           (1 + N_STAGES * MAX_REPLICAS)
#define MAX_SPLITS      PIPE_MAX_SPLITS
#define CHECK_RTOL      1e-4
#define CALL_TIMEOUT_MS 0 /* the agent's call timeout */

/* The world rank of replica @p p (0: A, 1: B) of stage @p k (0-based). */
static int stage_rank(int k, int p)
{
    return 1 + k * MAX_REPLICAS + p;
}

/* ---------------------------------------------------------- configuration */

typedef struct {
    int replicas;
    int compare;
    int splits;
    int batch; /* per pipeline; a step takes 2 x batch images */
    double lr;
    double momentum;
    int timing_steps;
    int epochs;
    int64_t limit;      /* training steps per epoch; 0: all */
    int64_t test_limit; /* test images scored; 0: all */
    int64_t check_every;
    uint64_t seed;
    int json;
    const char *data_dir;
} config_t;

static void usage(FILE *out)
{
    fprintf(
        out,
        "usage: weftrun -n 5 pipeline_ddp [options]   (rank 0 the master, ranks 1 and 2 stage\n"
        "       1's replicas, ranks 3 and 4 stage 2's: pipeline A = ranks 1 -> 3, B = 2 -> 4)\n"
        "  --replicas N         1 or 2 pipelines (default 2; 1: pipeline A only, ranks 2 and 4\n"
        "                       idle)\n"
        "  --compare            time 1 and then 2 replicas on the same batches and print the\n"
        "                       ratio (needs --timing-steps > 0)\n"
        "  --splits N           micro-batches per pipeline and step (default 4, at most 64)\n"
        "  --batch N            images per pipeline and step (default 64): a step takes 2 x N\n"
        "  --lr X               the replicas' SGD learning rate (default 0.05)\n"
        "  --momentum X         the replicas' SGD momentum (default 0, as pipeline_train)\n"
        "  --timing-steps N     timed steps on random data, after a warm-up one (default 10;\n"
        "                       0: no timing)\n"
        "  --epochs N           passes over Fashion-MNIST (default 1; 0: timing only, no data\n"
        "                       needed)\n"
        "  --limit N            at most N training steps per epoch\n"
        "  --test-limit N       score the first N test images only (default: all 10000)\n"
        "  --check-every N      compare the replicas every N training steps (default 0: after\n"
        "                       training only)\n"
        "  --seed N             initialisation, data and shuffling seed (default 1)\n"
        "  --json               print a JSON summary line at the end\n"
        "  --data DIR           Fashion-MNIST IDX files (default $WEFT_DATA_DIR, else\n"
        "                       " MNIST_DEFAULT_DIR ")\n");
}

/* Returns 0, 1 after --help, or EX_EXIT_USAGE after a message. */
static int parse_args(int argc, char **argv, config_t *cfg)
{
    const ex_opt_t opts[] = {
        EX_INT("replicas", &cfg->replicas, 1, MAX_REPLICAS),
        EX_FLAG("compare", &cfg->compare),
        EX_INT("splits", &cfg->splits, 1, MAX_SPLITS),
        EX_INT("batch", &cfg->batch, 1, 1 << 15),
        EX_DOUBLE("lr", &cfg->lr, 0.0, 1e6),
        EX_DOUBLE("momentum", &cfg->momentum, 0.0, 1.0),
        EX_INT("timing-steps", &cfg->timing_steps, 0, 1000000),
        EX_INT("epochs", &cfg->epochs, 0, 100000),
        EX_I64("limit", &cfg->limit, 1, INT64_MAX),
        EX_I64("test-limit", &cfg->test_limit, 1, INT64_MAX),
        EX_I64("check-every", &cfg->check_every, 0, INT64_MAX),
        EX_U64("seed", &cfg->seed, 0, INT64_MAX),
        EX_FLAG("json", &cfg->json),
        EX_STR("data", &cfg->data_dir),
    };
    int rc;

    memset(cfg, 0, sizeof(*cfg));
    cfg->replicas = MAX_REPLICAS;
    cfg->splits = 4;
    cfg->batch = 64;
    cfg->lr = 0.05;
    cfg->timing_steps = 10;
    cfg->epochs = 1;
    cfg->seed = 1;
    cfg->data_dir = mnist_default_dir();
    rc = ex_parse_opts(PROG, argc, argv, opts, sizeof(opts) / sizeof(opts[0]), usage);
    if (rc == 0 && cfg->compare && cfg->timing_steps == 0) {
        fprintf(stderr, PROG ": --compare needs timing steps (--timing-steps > 0)\n");
        usage(stderr);
        rc = EX_EXIT_USAGE;
    }
    return rc;
}

static void fail(const char *what, weft_status_t st)
{
    ex_fail(PROG, what, st);
}

/* ------------------------------------------------------------------ stages */

/* The constructor's payload. Payloads are fixed-layout structs: every rank runs this program on
 * one kind of machine (a real program would pin the byte order). */
typedef struct {
    int32_t k;        /* 1 or 2 */
    int32_t replicas; /* 1: no averaging; 2: averaged with the twin over the stage's group */
    uint64_t seed;    /* the parameters' stream */
    double lr, momentum;
} stage_msg_t;

/* What step answers: the averaged gradient's bookkeeping. */
typedef struct {
    int32_t with_grad; /* parameters that had a gradient in the context here */
    int32_t params;
    double sum_sq; /* of the averaged gradient */
} step_msg_t;

/* What check answers. */
typedef struct {
    int32_t same; /* every member's parameters equal group rank 0's, bit for bit */
    int32_t pad;
    uint64_t hash; /* FNV-1a 64 of this replica's packed parameters */
} check_msg_t;

/* A stage replica on its rank (pipe_stage_t: its lock serialises its forward passes and its
 * steps), served by the rank's pool (pipe_pool_t, whose pg is this rank's stage group: set after
 * the join, before any object exists). */
static weft_status_t stage_ctor(const weft_value_t *args, void *type_arg, void **obj_p)
{
    pipe_pool_t *sv = type_arg;
    weft_optim_sgd_config_t oc = WEFT_OPTIM_SGD_DEFAULTS;
    const stage_msg_t *m;
    pipe_stage_t *s = NULL;
    size_t len = 0;
    weft_status_t st;

    m = weft_value_payload(args, &len);
    if (m == NULL || len != sizeof(*m) || (m->k != 1 && m->k != 2) || m->replicas < 1 ||
        m->replicas > MAX_REPLICAS) {
        return WEFT_ERR_INVALID_ARG;
    }
    /* A replica averages with its twin over this rank's group: it must be the stage's. */
    if (m->replicas > 1 &&
        (sv->pg == NULL || weft_pg_rank(sv->pg) < 0 || weft_pg_size(sv->pg) != m->replicas ||
         weft_pg_world_rank(sv->pg, 0) != stage_rank(m->k - 1, 0))) {
        return WEFT_ERR_INVALID_STATE;
    }
    st = pipe_stage_create(m->k, m->seed, &s);
    if (st != WEFT_OK) {
        return st;
    }
    s->replicas = m->replicas;
    s->rank = weft_agent_rank(sv->a);
    oc.lr = m->lr;
    oc.momentum = m->momentum;
    st = weft_optimizer_sgd_create(s->params, &oc, &s->opt);
    if (st != WEFT_OK) {
        pipe_stage_free(s);
        return st;
    }
    *obj_p = s;
    return WEFT_OK;
}

static void stage_dtor(void *obj, void *type_arg)
{
    pipe_stage_t *s = obj;

    (void)type_arg;
    printf("stage %d replica (%d replica%s) freed by its owner after %lld forward passes (%lld in "
           "a context) and %lld steps\n",
           s->k, s->replicas, s->replicas > 1 ? "s" : "", (long long)s->forwards,
           (long long)s->recorded, (long long)s->steps);
    pipe_stage_free(s);
}

/*
 * step(payload: a context id) -> step_msg_t. The gradients the context holds for the replica's
 * parameters, times the number of replicas (the gradient of this replica's own half's mean loss),
 * packed with one flag (1: something is missing here) into one buffer; with two replicas one
 * all_reduce AVG of it over the stage's group; then, unless some member's flag is set, the
 * averages become the parameters' .grad and the local SGD steps. Both twins take part in the
 * all_reduce whatever happened before it, so that neither waits for the other in vain.
 */
static void stage_step_run(pipe_pool_t *sv, pipe_stage_t *s, weft_call_t *call)
{
    size_t len = 0;
    const uint64_t *ctx = weft_value_payload(weft_call_args(call), &len);
    const int np = weft_param_list_size(s->params);
    int64_t n = weft_param_list_numel(s->params);
    const int64_t nflat = n + 1;
    weft_tensor_t *flat = NULL;
    weft_tensor_t *avg = NULL;
    weft_dist_grads_t *g = NULL;
    char why[256] = "";
    step_msg_t m;
    weft_status_t st;
    float *d;
    int mine_bad;

    if (ctx == NULL || len != sizeof(*ctx)) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "step wants a context id");
        return;
    }
    st = weft_tensor_create(WEFT_F32, 1, &nflat, &flat);
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "stage %d: step: no memory", s->k);
        return;
    }
    d = weft_tensor_data(flat);
    memset(&m, 0, sizeof(m));
    m.params = np;
    st = weft_dist_get_gradients(sv->a, *ctx, &g);
    if (st == WEFT_OK) {
        const float scale = (float)s->replicas;
        int64_t off = 0;

        for (int i = 0; i < np; i++) {
            const weft_tensor_t *p = weft_param_list_get(s->params, i);
            const weft_tensor_t *gr = weft_dist_grads_find(g, p);
            const int64_t pn = weft_tensor_numel(p);

            if (gr != NULL && weft_tensor_dtype(gr) == WEFT_F32 && weft_tensor_numel(gr) == pn) {
                const float *gd = weft_tensor_data(gr);
                for (int64_t j = 0; j < pn; j++) {
                    d[off + j] = gd[j] * scale;
                }
                m.with_grad++;
            } else if (why[0] == '\0') {
                snprintf(why, sizeof(why), "no gradient for '%s' in context %llu",
                         weft_param_list_name(s->params, i), (unsigned long long)*ctx);
            }
            off += pn;
        }
        weft_dist_grads_free(g);
    } else {
        snprintf(why, sizeof(why), "context %llu: %s: %s", (unsigned long long)*ctx,
                 weft_status_name(st), weft_last_error());
    }
    mine_bad = why[0] != '\0';
    d[n] = mine_bad ? 1.0f : 0.0f;
    if (s->replicas > 1) {
        st = weft_coll_all_reduce(sv->pg, flat, WEFT_AVG, NULL);
        if (st != WEFT_OK) {
            weft_call_fail(call, st, "stage %d replica on rank %d: all_reduce of the gradients: %s",
                           s->k, s->rank, weft_last_error());
            weft_tensor_release(flat);
            return;
        }
    }
    if (d[n] != 0.0f) {
        if (mine_bad) {
            weft_call_fail(call, WEFT_ERR_INVALID_STATE, "stage %d replica on rank %d: %s", s->k,
                           s->rank, why);
        } else {
            weft_call_fail(call, WEFT_ERR_REMOTE,
                           "stage %d replica on rank %d: the other replica lacks gradients: no "
                           "step on either",
                           s->k, s->rank);
        }
        weft_tensor_release(flat);
        return;
    }
    /* The averages: the first n elements of the buffer, as a tensor of their own. */
    st =
        weft_tensor_wrap(WEFT_F32, 1, &n, d, (size_t)n * sizeof(float), WEFT_CPU, NULL, NULL, &avg);
    if (st == WEFT_OK) {
        pthread_mutex_lock(&s->mu);
        st = weft_param_list_unpack_grads(s->params, avg);
        if (st == WEFT_OK) {
            st = weft_optimizer_step(s->opt);
        }
        s->steps += st == WEFT_OK;
        pthread_mutex_unlock(&s->mu);
    }
    weft_tensor_release(avg);
    for (int64_t j = 0; j < n; j++) {
        m.sum_sq += (double)d[j] * (double)d[j];
    }
    weft_tensor_release(flat);
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "stage %d replica on rank %d: step: %s", s->k, s->rank,
                       weft_last_error());
        return;
    }
    ex_reply_payload(call, &m, sizeof(m));
}

/* The replica's parameters packed into a new flat tensor @p flat_p. Called with s->mu held. */
static weft_status_t pack_params_locked(pipe_stage_t *s, weft_tensor_t **flat_p)
{
    int64_t n = weft_param_list_numel(s->params);
    weft_tensor_t *flat = NULL;
    weft_status_t st = weft_tensor_empty(WEFT_F32, 1, &n, &flat);

    if (st == WEFT_OK) {
        st = weft_param_list_pack(s->params, flat);
    }
    if (st != WEFT_OK) {
        weft_tensor_release(flat);
        return st;
    }
    *flat_p = flat;
    return WEFT_OK;
}

/* sync() -> nothing: group rank 0's parameters broadcast to its twin (DDP's construction). */
static void stage_sync_run(pipe_pool_t *sv, pipe_stage_t *s, weft_call_t *call)
{
    weft_tensor_t *flat = NULL;
    weft_status_t st = WEFT_OK;

    if (s->replicas > 1) {
        pthread_mutex_lock(&s->mu);
        st = pack_params_locked(s, &flat);
        if (st == WEFT_OK) {
            st = weft_coll_broadcast(sv->pg, flat, 0, NULL);
        }
        if (st == WEFT_OK) {
            st = weft_param_list_unpack(s->params, flat);
        }
        pthread_mutex_unlock(&s->mu);
        weft_tensor_release(flat);
    }
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "stage %d replica on rank %d: sync: %s", s->k, s->rank,
                       weft_last_error());
        return;
    }
    weft_call_reply(call, NULL);
}

/* check() -> check_msg_t: with two replicas ex_params_identical over the stage's group; with one,
 * the replica's hash alone. */
static void stage_check_run(pipe_pool_t *sv, pipe_stage_t *s, weft_call_t *call)
{
    check_msg_t m;
    int same = 1;
    uint64_t hash = 0;
    int rc = 0;

    memset(&m, 0, sizeof(m));
    pthread_mutex_lock(&s->mu);
    if (s->replicas > 1) {
        rc = ex_params_identical(PROG, sv->pg, s->params, &same, &hash);
    } else {
        weft_tensor_t *flat = NULL;

        rc = pack_params_locked(s, &flat) == WEFT_OK ? 0 : -1;
        if (rc == 0) {
            hash = ex_fnv1a(EX_FNV1A_BASIS, weft_tensor_data(flat), weft_tensor_nbytes(flat));
        }
        weft_tensor_release(flat);
    }
    pthread_mutex_unlock(&s->mu);
    if (rc != 0) {
        weft_call_fail(call, WEFT_ERR_INVALID_STATE, "stage %d replica on rank %d: check failed",
                       s->k, s->rank);
        return;
    }
    m.same = same;
    m.hash = hash;
    ex_reply_payload(call, &m, sizeof(m));
}

static void stage_step(void *obj, weft_call_t *call, void *type_arg)
{
    pipe_pool_queue(type_arg, stage_step_run, obj, call);
}

static void stage_sync(void *obj, weft_call_t *call, void *type_arg)
{
    pipe_pool_queue(type_arg, stage_sync_run, obj, call);
}

static void stage_check(void *obj, weft_call_t *call, void *type_arg)
{
    pipe_pool_queue(type_arg, stage_check_run, obj, call);
}

static const weft_rref_method_t stage_methods[] = {
    {"forward", pipe_stage_forward},
    {"step", stage_step},
    {"sync", stage_sync},
    {"check", stage_check},
};

/* ------------------------------------------------------------------ the master's model */

typedef struct {
    weft_agent_t *a;
    int replicas;
    weft_rref_t *stage[N_STAGES][MAX_REPLICAS]; /* replica p of stage k on stage_rank(k, p) */
} model_t;

static void model_free(model_t *m)
{
    for (int k = 0; k < N_STAGES; k++) {
        for (int p = 0; p < MAX_REPLICAS; p++) {
            weft_rref_release(m->stage[k][p]);
        }
    }
    memset(m, 0, sizeof(*m));
}

/*
 * Calls @p method with @p args (may be NULL) on every working replica at once and waits for all
 * of them; when @p out is not NULL, replica (k, p)'s answer, a payload of @p len bytes, goes to
 * byte offset (k * MAX_REPLICAS + p) * len of it. @return 0, or -1 after a message.
 */
static int call_all(model_t *m, const char *method, const weft_value_t *args, void *out, size_t len)
{
    weft_future_t *fs[N_STAGES][MAX_REPLICAS] = {{NULL}};
    int rc = 0;

    for (int k = 0; k < N_STAGES; k++) {
        for (int p = 0; p < m->replicas; p++) {
            weft_status_t st =
                weft_rref_rpc_async(m->stage[k][p], method, args, CALL_TIMEOUT_MS, &fs[k][p]);
            if (st != WEFT_OK && rc == 0) {
                fprintf(stderr, PROG ": %s on stage %d replica %c: %s: %s\n", method, k + 1,
                        'A' + p, weft_status_name(st), weft_last_error());
                rc = -1;
            }
        }
    }
    /* Every call that started is waited for, a failed one's twin included. */
    for (int k = 0; k < N_STAGES; k++) {
        for (int p = 0; p < m->replicas; p++) {
            weft_value_t *v = NULL;
            const void *pl;
            size_t got = 0;
            weft_status_t st;

            if (fs[k][p] == NULL) {
                continue;
            }
            st = weft_future_wait(fs[k][p], 0);
            if (st != WEFT_OK && rc == 0) {
                fprintf(stderr, PROG ": %s on stage %d replica %c: %s: %s\n", method, k + 1,
                        'A' + p, weft_status_name(st), weft_future_error(fs[k][p]));
                rc = -1;
            }
            if (st == WEFT_OK && out != NULL) {
                (void)weft_future_take_value(fs[k][p], &v);
                pl = v != NULL ? weft_value_payload(v, &got) : NULL;
                if (pl == NULL || got != len) {
                    if (rc == 0) {
                        fprintf(stderr, PROG ": %s on stage %d replica %c: a bad answer\n", method,
                                k + 1, 'A' + p);
                    }
                    rc = -1;
                } else {
                    memcpy((char *)out + (size_t)(k * MAX_REPLICAS + p) * len, pl, len);
                }
                weft_value_free(v);
            }
            weft_future_release(fs[k][p]);
        }
    }
    return rc;
}

/* @p replicas fresh pipelines' stages made from @p cfg's seed on their ranks, and with two
 * replicas each stage's twins synchronised. @return 0, or -1 after a message. */
static int model_init(model_t *m, weft_agent_t *a, const config_t *cfg, int replicas)
{
    weft_status_t st = WEFT_OK;

    memset(m, 0, sizeof(*m));
    m->a = a;
    m->replicas = replicas;
    /* remote_object returns at once: the constructions go on together. */
    for (int k = 0; st == WEFT_OK && k < N_STAGES; k++) {
        for (int p = 0; st == WEFT_OK && p < replicas; p++) {
            stage_msg_t sm = {.k = k + 1,
                              .replicas = replicas,
                              .seed = cfg->seed,
                              .lr = cfg->lr,
                              .momentum = cfg->momentum};
            weft_value_t *args = NULL;

            st = weft_value_create(&args);
            if (st == WEFT_OK) {
                st = weft_value_set_payload(args, &sm, sizeof(sm));
            }
            if (st == WEFT_OK) {
                st = weft_rref_remote_object(a, stage_rank(k, p), "stage", args, CALL_TIMEOUT_MS,
                                             &m->stage[k][p]);
            }
            weft_value_free(args);
        }
    }
    if (st != WEFT_OK) {
        fail("stage", st);
        model_free(m);
        return -1;
    }
    /* The first method call reports a failed construction. */
    if (call_all(m, "sync", NULL, NULL, 0) != 0) {
        model_free(m);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ the pipelines */

/* The forward of batch @p x [b, ...] through the model's pipelines, both fed at once
 * (pipe_forward: pipeline p gets its share of the rows, in min(@p splits, share) micro-batches,
 * at most @p splits of each in flight), into @p out_p [b, 10] (caller releases).
 * @return 0, or -1 after a message. */
static int pipelines_forward(model_t *m, weft_tensor_t *x, int splits, weft_tensor_t **out_p)
{
    const pipe_lines_t l = {.prog = PROG,
                            .a = m->a,
                            .n = m->replicas,
                            .first = m->stage[0],
                            .second = m->stage[1],
                            .named = 1};

    return pipe_forward(&l, x, splits, out_p);
}

/*
 * One training step on images @p x and labels @p y, in a distributed autograd context of its
 * own: both pipelines' forward, the loss over the whole batch, one distributed backward, then
 * step(ctx) on every working replica (the averaging and the local SGD). The loss into @p loss_p;
 * each replica's answer into @p res when it is not NULL. @return 0, or -1 after a message.
 */
static int train_step(model_t *m, weft_tensor_t *x, weft_tensor_t *y, int splits, double *loss_p,
                      step_msg_t res[N_STAGES][MAX_REPLICAS])
{
    step_msg_t tmp[N_STAGES][MAX_REPLICAS];
    weft_tensor_t *out = NULL;
    weft_tensor_t *loss = NULL;
    weft_value_t *args = NULL;
    const char *what = "context";
    uint64_t ctx = 0;
    weft_status_t st;
    int rc = -1;

    st = weft_dist_context_create(m->a, &ctx);
    if (st != WEFT_OK) {
        fail(what, st);
        return -1;
    }
    if (pipelines_forward(m, x, splits, &out) != 0) {
        goto out;
    }
    what = "loss";
    st = weft_op_cross_entropy(out, y, WEFT_REDUCTION_MEAN, &loss);
    if (st == WEFT_OK) {
        *loss_p = ((const float *)weft_tensor_data(loss))[0];
        what = "distributed backward";
        st = weft_dist_backward(m->a, ctx, 1, &loss, NULL);
    }
    if (st == WEFT_OK) {
        what = "step";
        st = weft_value_create(&args);
    }
    if (st == WEFT_OK) {
        st = weft_value_set_payload(args, &ctx, sizeof(ctx));
    }
    if (st != WEFT_OK) {
        fail(what, st);
        goto out;
    }
    if (call_all(m, "step", args, res != NULL ? (void *)res : (void *)tmp, sizeof(step_msg_t)) !=
        0) {
        goto out;
    }
    rc = 0;

out:
    weft_value_free(args);
    st = weft_dist_context_release(m->a, ctx, 0);
    if (st != WEFT_OK && rc == 0) {
        fail("context release", st);
        rc = -1;
    }
    weft_tensor_release(loss);
    weft_tensor_release(out);
    return rc;
}

/*
 * With two replicas: has each stage's twins compare their parameters bit for bit, and prints
 * "stage K replicas bit-identical: yes|NO (fnv1a64 H, @p when)". @return 0, or -1 if they differ
 * or the check failed (after a message).
 */
static int check_replicas(model_t *m, const char *when)
{
    check_msg_t c[N_STAGES][MAX_REPLICAS];
    int rc = 0;

    if (m->replicas < 2) {
        return 0;
    }
    memset(c, 0, sizeof(c));
    if (call_all(m, "check", NULL, c, sizeof(check_msg_t)) != 0) {
        return -1;
    }
    for (int k = 0; k < N_STAGES; k++) {
        int same = 1;

        for (int p = 0; p < m->replicas; p++) {
            same = same && c[k][p].same && c[k][p].hash == c[k][0].hash;
        }
        printf("stage %d replicas bit-identical: %s (fnv1a64 %016llx, %s)\n", k + 1,
               same ? "yes" : "NO", (unsigned long long)c[k][0].hash, when);
        if (!same) {
            fprintf(stderr, PROG ": stage %d's replicas differ %s\n", k + 1, when);
            rc = -1;
        }
    }
    return rc;
}

/* ------------------------------------------------------------------ the timing runs */

/* What the warm-up step of a timing run found. */
typedef struct {
    double loss;
    step_msg_t s[N_STAGES][MAX_REPLICAS];
} warm_t;

/* Whether @p w is sound: every replica's parameters all got a gradient, the loss and the sums of
 * squares are finite and positive, and twins averaged to the same bits. */
static int warm_sound(const warm_t *w, int replicas)
{
    for (int k = 0; k < N_STAGES; k++) {
        for (int p = 0; p < replicas; p++) {
            const step_msg_t *s = &w->s[k][p];
            if (s->params < 1 || s->with_grad != s->params || !(s->sum_sq > 0) ||
                !isfinite(s->sum_sq) || s->sum_sq != w->s[k][0].sum_sq) {
                return 0;
            }
        }
    }
    return isfinite(w->loss) && w->loss > 0;
}

/* One timing run with @p replicas fresh pipelines on the @p nb batches @p xs, @p ys: the warm-up
 * step (checked) into @p w, the timed ones' samples a second into @p rate_p, then with two
 * replicas the replicas' comparison. @return 0, or -1 after a message. */
static int timing_run(weft_agent_t *a, const config_t *cfg, int replicas, weft_tensor_t **xs,
                      weft_tensor_t **ys, int nb, warm_t *w, double *rate_p)
{
    const int64_t per_step = 2 * (int64_t)cfg->batch;
    model_t m;
    double loss = 0;
    double t0, dt;
    int rc = -1;

    if (model_init(&m, a, cfg, replicas) != 0) {
        return -1;
    }
    memset(w, 0, sizeof(*w));
    if (train_step(&m, xs[0], ys[0], cfg->splits, &w->loss, w->s) != 0) {
        goto out;
    }
    printf("replicas %d warm-up step: loss %.6f, averaged gradients for %d of %d parameters on "
           "stage 1 (sum of squares %.6g) and %d of %d on stage 2 (%.6g)\n",
           replicas, w->loss, w->s[0][0].with_grad, w->s[0][0].params, w->s[0][0].sum_sq,
           w->s[1][0].with_grad, w->s[1][0].params, w->s[1][0].sum_sq);
    if (!warm_sound(w, replicas)) {
        fprintf(stderr, PROG ": %d replica%s: the warm-up step's check failed (see above)\n",
                replicas, replicas > 1 ? "s" : "");
        goto out;
    }
    t0 = ex_now();
    for (int i = 1; i < nb; i++) {
        if (train_step(&m, xs[i], ys[i], cfg->splits, &loss, NULL) != 0) {
            goto out;
        }
    }
    dt = ex_now() - t0;
    *rate_p = dt > 0 ? (double)(nb - 1) * (double)per_step / dt : 0.0;
    printf("replicas = %d, splits = %d, samples/s = %.1f\n", replicas, cfg->splits, *rate_p);
    if (check_replicas(&m, "after the timing run") != 0) {
        goto out;
    }
    rc = 0;

out:
    model_free(&m);
    return rc;
}

/* The timing runs: --replicas, or 1 and 2 with --compare, on the same random batches. Their
 * rates into @p rate[R - 1] (left alone for an R not run). @return 0, or -1 after a message. */
static int timing_runs(weft_agent_t *a, const config_t *cfg, double rate[MAX_REPLICAS])
{
    const int nb = cfg->timing_steps + 1;
    const int64_t per_step = 2 * (int64_t)cfg->batch;
    weft_tensor_t **xs = calloc((size_t)nb, sizeof(*xs));
    weft_tensor_t **ys = calloc((size_t)nb, sizeof(*ys));
    warm_t w[MAX_REPLICAS];
    int rc = -1;

    if (xs == NULL || ys == NULL) {
        fprintf(stderr, PROG ": out of memory\n");
        goto out;
    }
    /* The same batches for every run. */
    if (pipe_random_batches(PROG, cfg->seed, nb, per_step, xs, ys) != 0) {
        goto out;
    }
    printf("timing: steps of %lld random images (%d per pipeline with 2 replicas), 1 warm-up and "
           "%d timed steps per run\n",
           (long long)per_step, cfg->batch, cfg->timing_steps);
    for (int r = 1; r <= MAX_REPLICAS; r++) {
        if (!cfg->compare && r != cfg->replicas) {
            continue;
        }
        if (timing_run(a, cfg, r, xs, ys, nb, &w[r - 1], &rate[r - 1]) != 0) {
            goto out;
        }
    }
    if (cfg->compare) {
        /* The same data and initial values: averaging two halves' gradients is one pipeline's
         * gradient of the whole batch (up to the order of sums). */
        double worst = ex_rel_diff(w[0].loss, w[1].loss);

        for (int k = 0; k < N_STAGES; k++) {
            worst = fmax(worst, ex_rel_diff(w[0].s[k][0].sum_sq, w[1].s[k][0].sum_sq));
        }
        printf("warm-up step's loss and averaged gradients agree between 1 and 2 replicas: %s "
               "(largest relative difference %.1e)\n",
               worst <= CHECK_RTOL ? "yes" : "no", worst);
        if (worst > CHECK_RTOL) {
            fprintf(stderr,
                    PROG ": 2 replicas' averaged gradients differ from 1 replica's by more "
                         "than %g\n",
                    CHECK_RTOL);
            goto out;
        }
        printf("2 replicas / 1 replica = %.3f\n", rate[0] > 0 ? rate[1] / rate[0] : 0.0);
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

/* The fraction of the first @p n test images classified right, through the pipelines without a
 * context: no graph is recorded anywhere. @return 0, or -1 after a message. */
static int evaluate(const job_t *job, model_t *m, int64_t n, double *acc_p)
{
    const pipe_lines_t l = {.prog = PROG,
                            .a = m->a,
                            .n = m->replicas,
                            .first = m->stage[0],
                            .second = m->stage[1],
                            .named = 1};

    return pipe_evaluate(&l, job->test, n, 2 * (int64_t)job->cfg->batch, job->cfg->splits, acc_p);
}

/* Fresh stages (--replicas) trained on Fashion-MNIST; the test accuracy into @p acc_p, the
 * training's bookkeeping into @p l. @return 0, or -1 after a message. */
static int train(const job_t *job, ex_loop_t *l, double *acc_p)
{
    const config_t *cfg = job->cfg;
    const int64_t per_step = 2 * (int64_t)cfg->batch;
    const int64_t n = job->train->count;
    const int64_t test_n = cfg->test_limit > 0 && cfg->test_limit < job->test->count
                               ? cfg->test_limit
                               : job->test->count;
    int64_t steps = (n + per_step - 1) / per_step;
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
    if (model_init(&m, job->a, cfg, cfg->replicas) != 0) {
        goto out;
    }
    printf("training on Fashion-MNIST: %lld steps of %lld images per epoch through %d "
           "pipeline%s, %d split%s, SGD lr %g momentum %g on each replica, %lld test images\n",
           (long long)steps, (long long)per_step, cfg->replicas, cfg->replicas > 1 ? "s" : "",
           cfg->splits, cfg->splits > 1 ? "s" : "", cfg->lr, cfg->momentum, (long long)test_n);
    ex_loop_init(l, 0, 1, cfg->epochs, steps, 0);
    for (int epoch = 0; epoch < cfg->epochs; epoch++) {
        ex_loop_epoch_begin(l);
        ex_epoch_perm(cfg->seed, epoch, n, perm);
        for (int64_t s = 0; s < steps; s++) {
            int64_t k = (s + 1) * per_step <= n ? per_step : n - s * per_step;
            weft_tensor_t *x = NULL;
            weft_tensor_t *y = NULL;
            double loss = 0;
            double t0 = ex_now();
            weft_status_t st = mnist_batch(job->train, perm + s * per_step, k, &x, &y);
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
                fprintf(stderr, PROG ": step %lld: the loss is %g\n", (long long)s, loss);
                goto out;
            }
            if (ex_loop_step_end(l, epoch, s, k, loss, t0)) {
                if (evaluate(job, &m, test_n, &acc) != 0) {
                    goto out;
                }
            }
            if (cfg->check_every > 0 && l->step_total % cfg->check_every == 0 &&
                l->step_total < (int64_t)cfg->epochs * steps) {
                char when[64];

                snprintf(when, sizeof(when), "after training step %lld", (long long)l->step_total);
                if (check_replicas(&m, when) != 0) {
                    goto out;
                }
            }
        }
        ex_loop_epoch_end(l, epoch, acc);
    }
    if (check_replicas(&m, "after training") != 0) {
        goto out;
    }
    printf("Test accuracy: %.2f%%\n", 100.0 * acc);
    *acc_p = acc;
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
    double rate[MAX_REPLICAS] = {NAN, NAN};
    double acc = NAN;
    ex_loop_t l;

    printf("%d pipeline%s of 2 stages (stage 1: conv(1->32)-relu-maxpool-conv(32->64)-relu-maxpool,"
           " stage 2: flatten-fc(3136->128)-relu-fc(128->10)): A = %s -> %s, B = %s -> %s; stage "
           "groups {%s, %s} and {%s, %s}; master %s\n",
           cfg->replicas, cfg->replicas > 1 ? "s" : "", weft_agent_worker_name(job->a, 1),
           weft_agent_worker_name(job->a, 3), weft_agent_worker_name(job->a, 2),
           weft_agent_worker_name(job->a, 4), weft_agent_worker_name(job->a, 1),
           weft_agent_worker_name(job->a, 2), weft_agent_worker_name(job->a, 3),
           weft_agent_worker_name(job->a, 4), weft_agent_name(job->a));
    if (cfg->timing_steps > 0 && timing_runs(job->a, cfg, rate) != 0) {
        return 1;
    }
    memset(&l, 0, sizeof(l));
    if (cfg->epochs > 0) {
        double a = 0;

        if (train(job, &l, &a) != 0) {
            return 1;
        }
        acc = a;
    }
    if (cfg->json) {
        printf("{\"system\":\"weft\",\"model\":\"pipeline_ddp\",\"replicas\":%d,\"compare\":%s,"
               "\"splits\":%d,\"batch\":%d,\"timing_steps\":%d",
               cfg->replicas, cfg->compare ? "true" : "false", cfg->splits, cfg->batch,
               cfg->timing_steps);
        ex_json_num("samples_per_s_r1", rate[0], "%.1f");
        ex_json_num("samples_per_s_r2", rate[1], "%.1f");
        ex_json_num("ratio", rate[1] / rate[0], "%.3f");
        printf(",\"lr\":%g,\"momentum\":%g,\"epochs_run\":%d,\"steps\":%lld", cfg->lr,
               cfg->momentum, l.epochs_run, (long long)l.step_total);
        ex_json_num("train_s", cfg->epochs > 0 ? l.train_time : NAN, "%.3f");
        ex_json_num("train_loss", cfg->epochs > 0 ? l.loss_avg : NAN, "%.4f");
        ex_json_num("accuracy", acc, "%.4f");
        printf("}\n");
    }
    return 0;
}

/*
 * The stages' groups, ranks {1, 2} and {3, 4}: every rank creates both, in this order (groups
 * are numbered by order of creation); each stage rank keeps its own in @p sv (the master none).
 * Then a barrier over the world, so that no group operation reaches a rank before its group
 * exists. @return 0, or -1 after a message.
 */
static int make_groups(weft_agent_t *a, pipe_pool_t *sv, weft_pg_t *groups[N_STAGES])
{
    weft_pg_t *world = NULL;
    weft_status_t st = WEFT_OK;

    for (int k = 0; st == WEFT_OK && k < N_STAGES; k++) {
        int ranks[MAX_REPLICAS];

        for (int p = 0; p < MAX_REPLICAS; p++) {
            ranks[p] = stage_rank(k, p);
        }
        st = weft_pg_new(a, ranks, MAX_REPLICAS, &groups[k]);
        if (st == WEFT_OK && sv != NULL && weft_pg_rank(groups[k]) >= 0) {
            sv->pg = groups[k];
        }
    }
    if (st == WEFT_OK) {
        st = weft_pg_world(a, &world);
    }
    if (st == WEFT_OK) {
        st = weft_coll_barrier(world, NULL);
    }
    weft_pg_free(world);
    if (st != WEFT_OK) {
        fail("the stages' groups", st);
        return -1;
    }
    return 0;
}

/* ----------------------------------------------------------------- main */

int main(int argc, char **argv)
{
    config_t cfg;
    mnist_set_t train_set = {0}, test_set = {0};
    weft_agent_opts_t opts;
    weft_agent_t *a = NULL;
    pipe_pool_t sv;
    int have_server = 0;
    weft_pg_t *groups[N_STAGES] = {NULL};
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
    if (weft_agent_world_size(a) != WORLD) {
        fprintf(stderr,
                PROG ": runs on exactly %d ranks (the master and %d replicas of %d stages), not "
                     "%d\n",
                WORLD, MAX_REPLICAS, N_STAGES, weft_agent_world_size(a));
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
    /* The master answers the replicas' wait_done once it is done. The replicas' ranks own stage
     * objects: their type, and the threads of their methods. */
    if (weft_agent_rank(a) == MASTER) {
        st = weft_rpc_register(a, "wait_done", ex_wait_done_fn, &done);
        if (st != WEFT_OK) {
            fail("register", st);
            rc = 1;
            goto err_free_agent;
        }
    } else {
        have_server = 1; /* what started is stopped, even after a failure */
        if (pipe_pool_start(PROG, &sv, a) != 0) {
            rc = 1;
            goto err_stop_server;
        }
        st = weft_rref_register_type(a, "stage", stage_ctor, stage_dtor, stage_methods,
                                     (int)(sizeof(stage_methods) / sizeof(stage_methods[0])), &sv);
        if (st != WEFT_OK) {
            fail("setup", st);
            rc = 1;
            goto err_stop_server;
        }
    }
    st = weft_agent_join(a);
    if (st != WEFT_OK) {
        fail("join", st);
        rc = 1;
        goto err_stop_server;
    }
    if (make_groups(a, have_server ? &sv : NULL, groups) != 0) {
        rc = 1;
    } else if (weft_agent_rank(a) == MASTER) {
        job_t job = {.a = a, .cfg = &cfg, .train = &train_set, .test = &test_set};
        rc = run_master(&job);
    } else {
        /* The replicas serve until the master is done: the shutdown is collective. */
        rc =
            ex_wait_done(PROG, a, MASTER, MASTER, "waiting for the master to be done") == 0 ? 0 : 1;
    }
    if (weft_agent_rank(a) == MASTER) {
        ex_done_announce(&done);
    }
    rc = ex_agent_shutdown(PROG, a, rc);

err_stop_server:
    /* After the shutdown no method comes: the threads end (the agent still exists for what they
     * were answering). */
    if (have_server) {
        pipe_pool_stop(&sv);
    }
    for (int k = 0; k < N_STAGES; k++) {
        weft_pg_free(groups[k]);
    }
err_free_agent:
    weft_agent_free(a);
err_free_data:
    mnist_free(&train_set);
    mnist_free(&test_set);
    return rc;
}
