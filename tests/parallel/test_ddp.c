/* The DDP reducer over forked ranks: gradients equal one all_reduce AVG of the whole model, bit
 * for bit, whatever the buckets; rank 0's parameters broadcast; parameters that differ refused
 * naming the parameter; a parameter without gradient fails every member, never hangs;
 * find_unused_parameters, no_sync, compression and a user comm hook. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "ranks.h"

#define IN    12
#define HID   20
#define OUT   5
#define BATCH 7

typedef struct {
    size_t cap, first;
    bool find_unused;
    weft_ddp_compress_t compress;
    bool hook;
    int accumulate; /* backwards under no_sync before the synchronised one */
    int steps;
    bool skip_fc2_on_rank0; /* rank 0's forward leaves fc2 out */
    bool skip_fc2;          /* every rank's forward leaves fc2 out */
} cfg_t;

static int hook_calls;

static weft_status_t avg_hook(void *arg, weft_pg_t *pg, int bucket, weft_tensor_t *t,
                              weft_future_t **work_p)
{
    (void)arg;
    (void)bucket;
    hook_calls++;
    return weft_coll_all_reduce(pg, t, WEFT_AVG, work_p);
}

/* A batch of this rank's, step @p s. */
static void batch(int rank, int s, weft_tensor_t **x_p, weft_tensor_t **y_p)
{
    int64_t xs[2] = {BATCH, IN}, ys[1] = {BATCH};
    weft_tensor_create(WEFT_F32, 2, xs, x_p);
    weft_tensor_create(WEFT_I64, 1, ys, y_p);
    weft_rng_t rng;
    weft_rng_init(&rng, 1000 + (uint64_t)rank, (uint64_t)s);
    float *x = weft_tensor_data(*x_p);
    int64_t *y = weft_tensor_data(*y_p);
    for (int i = 0; i < BATCH * IN; i++) {
        x[i] = (float)weft_rng_normal(&rng);
    }
    for (int i = 0; i < BATCH; i++) {
        y[i] = (int64_t)(weft_rng_next(&rng) % OUT);
    }
}

/* fc1 -> relu -> (fc2 -> relu, unless skipped) -> fc3; loss: cross entropy. */
static weft_status_t loss_of(weft_nn_linear_t *const *l, bool skip2, weft_tensor_t *x,
                             weft_tensor_t *y, weft_tensor_t **loss_p)
{
    weft_tensor_t *h = NULL, *a = NULL, *h2 = NULL, *a2 = NULL, *o = NULL;
    weft_status_t st = weft_nn_linear_forward(l[0], x, &h);
    if (st == WEFT_OK) {
        st = weft_nn_activation(WEFT_NN_ACT_RELU, h, &a);
    }
    weft_tensor_t *in3 = a;
    if (st == WEFT_OK && !skip2) {
        st = weft_nn_linear_forward(l[1], a, &h2);
        if (st == WEFT_OK) {
            st = weft_nn_activation(WEFT_NN_ACT_RELU, h2, &a2);
        }
        in3 = a2;
    }
    if (st == WEFT_OK) {
        st = weft_nn_linear_forward(l[2], in3, &o);
    }
    if (st == WEFT_OK) {
        st = weft_op_cross_entropy(o, y, WEFT_REDUCTION_MEAN, loss_p);
    }
    weft_tensor_release(h);
    weft_tensor_release(a);
    weft_tensor_release(h2);
    weft_tensor_release(a2);
    weft_tensor_release(o);
    return st;
}

typedef struct {
    weft_nn_linear_t *l[3];
    weft_param_list_t *params;
} model_t;

static int model_make(model_t *m, uint64_t seed, int64_t hid2)
{
    weft_rng_t rng;
    weft_rng_init(&rng, seed, 0);
    int64_t in[3] = {IN, HID, hid2}, out[3] = {HID, hid2, OUT};
    weft_param_list_create(&m->params);
    const char *names[3] = {"fc1", "fc2", "fc3"};
    for (int i = 0; i < 3; i++) {
        if (weft_nn_linear_create(in[i], out[i], 1, WEFT_F32, &rng, &m->l[i]) != WEFT_OK ||
            weft_param_list_extend(m->params, names[i], weft_nn_linear_params(m->l[i])) !=
                WEFT_OK) {
            return 1;
        }
    }
    return 0;
}

static void model_free(model_t *m)
{
    for (int i = 0; i < 3; i++) {
        weft_nn_linear_free(m->l[i]);
    }
    weft_param_list_free(m->params);
}

static weft_tensor_t *flat(const weft_param_list_t *p, bool grads)
{
    int64_t n = weft_param_list_numel(p);
    weft_tensor_t *t = NULL;
    weft_tensor_create(WEFT_F32, 1, &n, &t);
    if (grads) {
        weft_param_list_pack_grads(p, t);
    } else {
        weft_param_list_pack(p, t);
    }
    return t;
}

/* Trains @p cfg->steps steps with the reducer and, beside it, a twin model whose gradients one
 * all_reduce AVG of the flat buffer averages; after every step the gradients must agree. */
static int body_train(weft_agent_t *a, int rank, int world, void *arg)
{
    const cfg_t *cfg = arg;
    (void)world;
    weft_pg_t *pg = NULL;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg");
    model_t m, twin;
    RANK_CHECK(model_make(&m, 7 + (uint64_t)rank, HID) == 0, "model");
    RANK_CHECK(model_make(&twin, 7, HID) == 0, "twin"); /* rank 0's values: what DDP broadcasts */
    weft_ddp_opts_t o;
    weft_ddp_opts_init(&o);
    o.bucket_cap_bytes = cfg->cap;
    o.first_bucket_bytes = cfg->first;
    o.find_unused_parameters = cfg->find_unused;
    o.compress = cfg->compress;
    if (cfg->hook) {
        o.comm_hook = avg_hook;
    }
    weft_ddp_t *ddp = NULL;
    RANK_CHECK(weft_ddp_create(pg, m.params, &o, &ddp) == WEFT_OK, "create: %s", weft_last_error());
    weft_tensor_t *pm = flat(m.params, false), *pt = flat(twin.params, false);
    RANK_CHECK(weft_tensor_equal(pm, pt), "rank 0's parameters were not broadcast");
    weft_tensor_release(pm);
    weft_tensor_release(pt);
    bool skip = (cfg->skip_fc2_on_rank0 && rank == 0) || cfg->skip_fc2;
    for (int s = 0; s < cfg->steps; s++) {
        weft_param_list_zero_grad(m.params);
        weft_param_list_zero_grad(twin.params);
        hook_calls = 0;
        for (int k = 0; k <= cfg->accumulate; k++) {
            weft_tensor_t *x, *y, *loss = NULL, *tloss = NULL;
            batch(rank, s * 10 + k, &x, &y);
            RANK_CHECK(loss_of(m.l, skip, x, y, &loss) == WEFT_OK, "forward");
            RANK_CHECK(loss_of(twin.l, skip, x, y, &tloss) == WEFT_OK, "twin forward");
            weft_ddp_set_sync(ddp, k == cfg->accumulate);
            weft_status_t st = weft_ddp_backward(ddp, loss, NULL);
            RANK_CHECK(st == WEFT_OK, "step %d: %s", s, weft_last_error());
            RANK_CHECK(weft_backward(tloss, NULL, 0) == WEFT_OK, "twin backward");
            weft_tensor_release(x);
            weft_tensor_release(y);
            weft_tensor_release(loss);
            weft_tensor_release(tloss);
        }
        weft_tensor_t *want = flat(twin.params, true), *got = flat(m.params, true);
        RANK_CHECK(weft_coll_all_reduce(pg, want, WEFT_AVG, NULL) == WEFT_OK, "reference");
        const float *w = weft_tensor_data(want), *g = weft_tensor_data(got);
        for (int64_t i = 0; i < weft_tensor_numel(want); i++) {
            if (cfg->compress != WEFT_DDP_COMPRESS_NONE) {
                float tol = 2e-2f * fabsf(w[i]) + 1e-3f;
                RANK_CHECK(fabsf(w[i] - g[i]) <= tol, "step %d: element %lld: %g, want %g", s,
                           (long long)i, g[i], w[i]);
            } else {
                RANK_CHECK(memcmp(&w[i], &g[i], sizeof(float)) == 0,
                           "step %d: element %lld: %.9g, want %.9g", s, (long long)i, g[i], w[i]);
            }
        }
        weft_tensor_release(want);
        weft_tensor_release(got);
        weft_ddp_stats_t st;
        weft_ddp_stats(ddp, &st);
        RANK_CHECK(st.steps == (uint64_t)s + 1, "steps %llu", (unsigned long long)st.steps);
        RANK_CHECK(st.bytes > 0, "no bytes reduced");
        if (cfg->hook) {
            RANK_CHECK(hook_calls == st.buckets, "hook called %d times for %d buckets", hook_calls,
                       st.buckets);
        }
        if (s >= 1 && !cfg->find_unused) {
            RANK_CHECK(st.rebuilt, "buckets not rebuilt after the first step");
        }
        weft_tensor_t *g0 = weft_tensor_grad(weft_param_list_get(m.params, 0));
        RANK_CHECK(g0 != NULL, "no gradient");
        if (cfg->skip_fc2) {
            /* no member gave fc2 a gradient: it has none, as in torch */
            RANK_CHECK(weft_tensor_grad(weft_param_list_find(m.params, "fc2.weight")) == NULL &&
                           weft_tensor_grad(weft_param_list_find(m.params, "fc2.bias")) == NULL,
                       "step %d: fc2 has a gradient though no member used it", s);
        }
    }
    if (cfg->cap > 0 && cfg->cap < 4096) {
        char plan[4096];
        weft_ddp_describe(ddp, plan, sizeof(plan));
        RANK_CHECK(strstr(plan, "bucket 1:") != NULL, "one bucket only:\n%s", plan);
    }
    weft_ddp_free(ddp);
    /* The gradients outlive the reducer. */
    RANK_CHECK(weft_tensor_grad(weft_param_list_get(m.params, 0)) != NULL, "gradient lost");
    model_free(&m);
    model_free(&twin);
    weft_pg_free(pg);
    return 0;
}

/* Runs @p body on two forked ranks with @p arg; every rank must return 0. */
static void run_body(rank_main_cb_t body, void *arg)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body);
    o.arg = arg;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

static void run(cfg_t *cfg)
{
    run_body(body_train, cfg);
}

Test(ddp, one_bucket_equals_one_all_reduce, .timeout = 120)
{
    cfg_t c = {.steps = 3};
    run(&c);
}

Test(ddp, many_buckets_rebuilt_equal_one_all_reduce, .timeout = 120)
{
    cfg_t c = {.cap = 600, .first = 100, .steps = 4};
    run(&c);
}

Test(ddp, no_sync_accumulates_then_averages, .timeout = 120)
{
    cfg_t c = {.cap = 600, .first = 100, .steps = 3, .accumulate = 2};
    run(&c);
}

Test(ddp, fp16_and_bf16_compression, .timeout = 120)
{
    cfg_t c = {.cap = 600, .first = 100, .steps = 2, .compress = WEFT_DDP_COMPRESS_FP16};
    run(&c);
    cfg_t d = {.cap = 600, .first = 100, .steps = 2, .compress = WEFT_DDP_COMPRESS_BF16};
    run(&d);
}

Test(ddp, user_comm_hook, .timeout = 120)
{
    cfg_t c = {.cap = 600, .first = 100, .steps = 2, .hook = true};
    run(&c);
}

Test(ddp, find_unused_parameters, .timeout = 120)
{
    cfg_t c = {
        .cap = 600, .first = 100, .steps = 3, .find_unused = true, .skip_fc2_on_rank0 = true};
    run(&c);
    cfg_t d = {.cap = 600, .first = 100, .steps = 2, .find_unused = true, .skip_fc2 = true};
    run(&d);
}

static weft_status_t failing_hook(weft_tensor_t *param, weft_tensor_t *grad, void *arg)
{
    (void)param;
    (void)grad;
    (void)arg;
    return WEFT_ERR_CANCELLED; /* backward stops here, on rank 0 only */
}

/* The world group and the model (seed 7, fc2 of @p hid2 outputs) of a test that expects failures.
 * Returns 0, or 1 after a message. */
static int setup(weft_agent_t *a, int64_t hid2, weft_pg_t **pg_p, model_t *m)
{
    RANK_CHECK(weft_pg_world(a, pg_p) == WEFT_OK, "pg");
    RANK_CHECK(model_make(m, 7, hid2) == 0, "model");
    return 0;
}

static void teardown(weft_ddp_t *ddp, model_t *m, weft_pg_t *pg)
{
    weft_ddp_free(ddp);
    model_free(m);
    weft_pg_free(pg);
}

/* Step @p s of this rank through @p ddp (fc2 left out if @p skip2): the backward's status, or the
 * forward's if that failed. */
static weft_status_t ddp_step(weft_ddp_t *ddp, model_t *m, int rank, int s, bool skip2)
{
    weft_tensor_t *x, *y, *loss = NULL;
    batch(rank, s, &x, &y);
    weft_param_list_zero_grad(m->params);
    weft_status_t st = loss_of(m->l, skip2, x, y, &loss);
    if (st == WEFT_OK) {
        st = weft_ddp_backward(ddp, loss, NULL);
    }
    weft_tensor_release(x);
    weft_tensor_release(y);
    weft_tensor_release(loss);
    return st;
}

/* Backward failing on rank 0 (a hook's error) fails the step on rank 1 too, instead of rank 1
 * averaging an incomplete step and going on; the next step works on both. */
static int body_failing(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    weft_pg_t *pg = NULL;
    model_t m;
    RANK_CHECK(setup(a, HID, &pg, &m) == 0, "setup");
    weft_ddp_opts_t o;
    weft_ddp_opts_init(&o);
    o.bucket_cap_bytes = 600;
    o.first_bucket_bytes = 100;
    weft_ddp_t *ddp = NULL;
    RANK_CHECK(weft_ddp_create(pg, m.params, &o, &ddp) == WEFT_OK, "%s", weft_last_error());
    int hook = -1;
    weft_tensor_t *bias = weft_param_list_find(m.params, "fc3.bias");
    if (rank == 0) {
        RANK_CHECK(weft_tensor_add_grad_hook(bias, failing_hook, NULL, &hook) == WEFT_OK, "hook");
    }
    weft_status_t st = ddp_step(ddp, &m, rank, 0, false);
    if (rank == 0) {
        RANK_CHECK(st == WEFT_ERR_CANCELLED, "rank 0: %s", weft_strerror(st));
        weft_tensor_remove_grad_hook(bias, hook);
    } else {
        RANK_CHECK(st == WEFT_ERR_REMOTE, "rank 1: %s", weft_strerror(st));
        RANK_CHECK(strstr(weft_last_error(), "backward failed on another member") != NULL, "%s",
                   weft_last_error());
    }
    RANK_CHECK(ddp_step(ddp, &m, rank, 1, false) == WEFT_OK, "step 1: %s", weft_last_error());
    teardown(ddp, &m, pg);
    return 0;
}

Test(ddp, a_failed_backward_fails_every_rank, .timeout = 120)
{
    run_body(body_failing, NULL);
}

/* A comm hook that fails on rank 1 (once, on the step's first bucket) issues nothing: rank 0's
 * reduction of that bucket fails at once with rank 1's reason (not at the group's deadline), and
 * the group's operations stay paired: the next step works on both. */
static int g_fail_hook_rank = -1;

static weft_status_t failing_once_hook(void *arg, weft_pg_t *pg, int bucket, weft_tensor_t *t,
                                       weft_future_t **work_p)
{
    int *fail = arg;
    if (*fail) {
        *fail = 0;
        (void)bucket;
        return WEFT_ERR_NO_MEMORY; /* (what a hook that found no memory would say) */
    }
    return weft_coll_all_reduce(pg, t, WEFT_AVG, work_p);
}

static int body_hook_fails(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    weft_pg_t *pg = NULL;
    model_t m;
    RANK_CHECK(setup(a, HID, &pg, &m) == 0, "setup");
    weft_pg_set_timeout(pg, 30000);
    int fail = rank == g_fail_hook_rank;
    weft_ddp_opts_t o;
    weft_ddp_opts_init(&o);
    o.bucket_cap_bytes = 600;
    o.first_bucket_bytes = 100;
    o.rebuild_buckets = false;
    o.comm_hook = failing_once_hook;
    o.comm_hook_arg = &fail;
    weft_ddp_t *ddp = NULL;
    RANK_CHECK(weft_ddp_create(pg, m.params, &o, &ddp) == WEFT_OK, "%s", weft_last_error());
    weft_status_t st = ddp_step(ddp, &m, rank, 0, false);
    RANK_CHECK(st != WEFT_OK, "step 0 worked on rank %d", rank);
    if (rank == 0) {
        RANK_CHECK(strstr(weft_last_error(), "comm hook of bucket") != NULL,
                   "rank 0 does not give rank 1's reason: %s: %s", weft_strerror(st),
                   weft_last_error());
    }
    for (int s = 1; s <= 2; s++) {
        RANK_CHECK(ddp_step(ddp, &m, rank, s, false) == WEFT_OK, "step %d: %s", s,
                   weft_last_error());
    }
    teardown(ddp, &m, pg);
    return 0;
}

Test(ddp, a_comm_hook_that_fails_fails_the_bucket_everywhere_and_the_next_step_works,
     .timeout = 120)
{
    g_fail_hook_rank = 1;
    run_body(body_hook_fails, NULL);
}

/* Without find_unused_parameters, rank 0 leaving fc2 out fails both ranks, naming fc2 on rank
 * 0; neither hangs, and the next step (fc2 used again) works. */
static int body_unused(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    weft_pg_t *pg = NULL;
    model_t m;
    RANK_CHECK(setup(a, HID, &pg, &m) == 0, "setup");
    weft_ddp_t *ddp = NULL;
    RANK_CHECK(weft_ddp_create(pg, m.params, NULL, &ddp) == WEFT_OK, "%s", weft_last_error());
    weft_status_t st = ddp_step(ddp, &m, rank, 0, rank == 0);
    RANK_CHECK(st == WEFT_ERR_INVALID_STATE, "step 0 gave %s", weft_strerror(st));
    const char *why = weft_last_error();
    if (rank == 0) {
        RANK_CHECK(strstr(why, "'fc2.weight'") != NULL && strstr(why, "'fc2.bias'"),
                   "rank 0 does not name fc2: %s", why);
    } else {
        RANK_CHECK(strstr(why, "another member") != NULL, "rank 1: %s", why);
    }
    RANK_CHECK(ddp_step(ddp, &m, rank, 1, false) == WEFT_OK, "step 1: %s", weft_last_error());
    teardown(ddp, &m, pg);
    return 0;
}

Test(ddp, a_parameter_without_gradient_fails_every_rank, .timeout = 120)
{
    run_body(body_unused, NULL);
}

/* A model that differs is refused on every rank, naming the parameter. */
static int body_mismatch(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    weft_pg_t *pg = NULL;
    model_t m;
    RANK_CHECK(setup(a, rank == 0 ? HID : HID + 1, &pg, &m) == 0, "setup");
    weft_ddp_t *ddp = NULL;
    weft_status_t st = weft_ddp_create(pg, m.params, NULL, &ddp);
    RANK_CHECK(st == WEFT_ERR_MISMATCH, "create gave %s", weft_strerror(st));
    RANK_CHECK(strstr(weft_last_error(), "fc2.weight") != NULL &&
                   strstr(weft_last_error(), "shape") != NULL,
               "%s", weft_last_error());
    RANK_CHECK(ddp == NULL, "a reducer was made");
    teardown(NULL, &m, pg);
    return 0;
}

Test(ddp, parameters_that_differ_are_refused_by_name, .timeout = 120)
{
    run_body(body_mismatch, NULL);
}
