/* The parameter server: every consistency guarantee with exact values (a slow worker in the way),
 * exactly-once pushes under duplication and reordering, sparse rows against core's optimizer
 * kernels bit for bit, bad input (a clear status, nothing applied), tables created differently,
 * a capacity that evicts, checkpoints restored into 1, 2 and 3 servers, a save killed half-way,
 * lost servers and workers. Ranks are forked processes on 127.0.0.1. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <weft/weft.h>

#include "ps.pb-c.h"
#include "ranks.h"

/* Roles of the world under test: set by each Test before ranks_run (the ranks inherit them). */
static int g_servers[4], g_ns, g_workers[4], g_nw;
static weft_ps_t *PS; /* in each rank */
static char g_dir[256];

static void ps_setup(weft_agent_t *a, int rank, void *arg)
{
    (void)rank;
    (void)arg;
    weft_ps_opts_t o;
    weft_ps_opts_init(&o);
    o.servers = g_servers;
    o.n_servers = (size_t)g_ns;
    o.workers = g_workers;
    o.n_workers = (size_t)g_nw;
    if (weft_ps_create(a, &o, &PS) != WEFT_OK) {
        fprintf(stderr, "weft_ps_create: %s\n", weft_last_error());
        _exit(90);
    }
}

static void roles(int ns, int nw)
{
    g_ns = ns;
    g_nw = nw;
    for (int i = 0; i < ns; i++) {
        g_servers[i] = i;
    }
    for (int i = 0; i < nw; i++) {
        g_workers[i] = ns + i;
    }
}

static void run_world(rank_main_cb_t body, int64_t deadline_ms)
{
    ranks_opts_t o;
    int codes[8];
    ranks_opts_init(&o, g_ns + g_nw, body);
    o.setup = ps_setup;
    o.deadline_ms = deadline_ms;
    o.handler_threads = 2;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

static weft_tensor_t *zeros(int64_t n)
{
    weft_tensor_t *t = NULL;
    weft_tensor_create(WEFT_F32, 1, &n, &t);
    return t;
}

static weft_tensor_t *filled(int64_t n, float v)
{
    weft_tensor_t *t = zeros(n);
    float *p = weft_tensor_data(t);
    for (int64_t i = 0; i < n; i++) {
        p[i] = v;
    }
    return t;
}

static void dense_spec(weft_ps_table_spec_t *s, const char *name, int64_t n)
{
    weft_ps_table_spec_init(s, name, WEFT_PS_DENSE);
    s->ndim = 1;
    s->shape[0] = n;
    s->chunk_bytes = 1024; /* 256 elements a chunk: several chunks on each server */
}

/* ------------------------------------------------------------------ SYNC */

#define SYNC_N     1000
#define SYNC_STEPS 6

/* SGD lr 1 on the mean gradient: worker w pushes (w+1)*(k+1) everywhere at step k, so after k
 * steps every element is 1 - sum_{j<k} mean_w((w+1)(j+1)) = 1 - 1.5 * k(k+1)/2 (two workers). */
static int sync_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    weft_ps_table_spec_t s;
    weft_ps_table_t *t;
    dense_spec(&s, "w", SYNC_N);
    s.init = WEFT_PS_CONSTANT;
    s.init_a = 1.0;
    s.sgd.lr = 1.0;
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &t) == WEFT_OK, "create: %s", weft_last_error());
    if (!weft_ps_is_worker(PS)) {
        return 0;
    }
    int w = weft_ps_worker_index(PS);
    weft_tensor_t *v = zeros(SYNC_N);
    for (int k = 0; k < SYNC_STEPS; k++) {
        weft_status_t pst = weft_ps_pull(t, v, 20000);
        RANK_CHECK(pst == WEFT_OK, "pull: %s: %s", weft_strerror(pst), weft_last_error());
        float want = 1.0f - 1.5f * (float)(k * (k + 1) / 2);
        const float *p = weft_tensor_data(v);
        for (int i = 0; i < SYNC_N; i++) {
            RANK_CHECK(p[i] == want, "step %d: element %d is %g, not %g", k, i, p[i], want);
        }
        if (w == 1) {
            /* The slow worker: the other one's pull of the next step must wait for it. */
            struct timespec ts = {0, 20 * 1000000};
            nanosleep(&ts, NULL);
        }
        weft_tensor_t *g = filled(SYNC_N, (float)((w + 1) * (k + 1)));
        RANK_CHECK(weft_ps_push(t, g, 20000) == WEFT_OK, "push: %s", weft_last_error());
        weft_tensor_release(g);
        RANK_CHECK(weft_ps_clock(PS, 20000) == WEFT_OK, "clock: %s", weft_last_error());
    }
    /* The pull at clock SYNC_STEPS waits for every step: then every push is counted. */
    RANK_CHECK(weft_ps_pull(t, v, 20000) == WEFT_OK, "pull: %s", weft_last_error());
    weft_ps_load_t loads[4];
    RANK_CHECK(weft_ps_table_stats(t, loads, 20000) == WEFT_OK, "stats");
    uint64_t pulls = 0, stale0 = 0, pushes = 0;
    for (int i = 0; i < g_ns; i++) {
        pulls += loads[i].pulls;
        stale0 += loads[i].staleness[0];
        pushes += loads[i].pushes;
    }
    /* Every pull of a SYNC table had staleness 0; every push counted once per server. */
    RANK_CHECK(pulls == stale0, "%llu pulls, %llu with staleness 0", (unsigned long long)pulls,
               (unsigned long long)stale0);
    RANK_CHECK(pushes == (uint64_t)(2 * SYNC_STEPS * g_ns), "%llu pushes counted",
               (unsigned long long)pushes);
    weft_tensor_release(v);
    return 0;
}

Test(ps, sync_pulls_see_exactly_the_steps_before_theirs, .timeout = 120)
{
    roles(2, 2);
    run_world(sync_body, 100000);
}

/* ------------------------------------------------------------------ BOUNDED */

#define BND_STEPS 12
#define BND_S     2

/* SUM table [workers]: worker w adds 1 to element w each step. A pull at clock c must show every
 * other worker's count >= c - s (no update of clocks <= c-s-1 missing) and exactly c of its own. */
static int bounded_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    weft_ps_table_spec_t s;
    weft_ps_table_t *t;
    dense_spec(&s, "count", 2);
    s.optimizer = WEFT_PS_SUM;
    s.consistency = WEFT_PS_BOUNDED;
    s.staleness = BND_S;
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &t) == WEFT_OK, "create: %s", weft_last_error());
    if (!weft_ps_is_worker(PS)) {
        return 0;
    }
    int w = weft_ps_worker_index(PS);
    weft_tensor_t *v = zeros(2), *g = zeros(2);
    ((float *)weft_tensor_data(g))[w] = 1.0f;
    for (int c = 0; c < BND_STEPS; c++) {
        RANK_CHECK(weft_ps_pull(t, v, 20000) == WEFT_OK, "pull: %s", weft_last_error());
        const float *p = weft_tensor_data(v);
        RANK_CHECK(p[w] == (float)c, "clock %d: own count %g", c, p[w]);
        RANK_CHECK(p[1 - w] >= (float)(c - BND_S) && p[1 - w] <= (float)BND_STEPS,
                   "clock %d: the other worker's count %g misses updates older than %d", c,
                   p[1 - w], c - BND_S - 1);
        if (w == 1) {
            struct timespec ts = {0, 15 * 1000000};
            nanosleep(&ts, NULL);
        }
        RANK_CHECK(weft_ps_push(t, g, 20000) == WEFT_OK, "push: %s", weft_last_error());
        RANK_CHECK(weft_ps_clock(PS, 20000) == WEFT_OK, "clock: %s", weft_last_error());
    }
    /* At clock BND_STEPS + s every update is in. */
    for (int k = 0; k < BND_S; k++) {
        RANK_CHECK(weft_ps_clock(PS, 20000) == WEFT_OK, "clock: %s", weft_last_error());
    }
    RANK_CHECK(weft_ps_pull(t, v, 20000) == WEFT_OK, "pull: %s", weft_last_error());
    const float *p = weft_tensor_data(v);
    RANK_CHECK(p[0] == BND_STEPS && p[1] == BND_STEPS, "final counts %g %g", p[0], p[1]);
    weft_tensor_release(v);
    weft_tensor_release(g);
    return 0;
}

Test(ps, bounded_staleness_never_reads_older_than_the_bound, .timeout = 120)
{
    roles(1, 2);
    run_world(bounded_body, 100000);
}

/* ------------------------------------------------------------------ exactly once */

#define EO_PUSHES 40

/* Every push sent twice and delayed at random (reordered): each counted once. Dense SUM ASYNC
 * plus sparse SUM ASYNC with repeated ids in one call (summed on the worker). */
static int once_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    weft_ps_table_spec_t s;
    weft_ps_table_t *d, *sp, *gate;
    dense_spec(&s, "dense", 700);
    s.optimizer = WEFT_PS_SUM;
    s.consistency = WEFT_PS_ASYNC;
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &d) == WEFT_OK, "create: %s", weft_last_error());
    weft_ps_table_spec_init(&s, "rows", WEFT_PS_SPARSE);
    s.dim = 4;
    s.optimizer = WEFT_PS_SUM;
    s.consistency = WEFT_PS_ASYNC;
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &sp) == WEFT_OK, "create: %s",
               weft_last_error());
    /* A BOUNDED(0) table as the barrier: its pull at clock 1 waits for every worker's clock. */
    dense_spec(&s, "gate", 1);
    s.consistency = WEFT_PS_BOUNDED;
    s.staleness = 0;
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &gate) == WEFT_OK, "create: %s",
               weft_last_error());
    if (!weft_ps_is_worker(PS)) {
        return 0;
    }
    weft_tensor_t *one = filled(700, 1.0f);
    weft_future_t *fs[EO_PUSHES * 2];
    uint64_t ids[6] = {5, 1000000007, 5, 42, 1u << 31, 42};
    int64_t shape[2] = {6, 4};
    weft_tensor_t *rows = NULL;
    weft_tensor_create(WEFT_F32, 2, shape, &rows);
    float *r = weft_tensor_data(rows);
    for (int i = 0; i < 24; i++) {
        r[i] = (float)(i % 4 + 1);
    }
    for (int i = 0; i < EO_PUSHES; i++) {
        RANK_CHECK(weft_ps_push_async(d, one, 20000, &fs[2 * i]) == WEFT_OK, "push: %s",
                   weft_last_error());
        RANK_CHECK(weft_ps_push_rows_async(sp, ids, 6, rows, 20000, &fs[2 * i + 1]) == WEFT_OK,
                   "push rows: %s", weft_last_error());
    }
    RANK_CHECK(weft_future_wait_all(fs, EO_PUSHES * 2, 30000) == WEFT_OK, "pushes: %s",
               weft_future_error(fs[0]));
    for (int i = 0; i < EO_PUSHES * 2; i++) {
        weft_future_release(fs[i]);
    }
    RANK_CHECK(weft_ps_clock(PS, 20000) == WEFT_OK, "clock: %s", weft_last_error());
    weft_tensor_t *g1 = zeros(1);
    RANK_CHECK(weft_ps_pull(gate, g1, 20000) == WEFT_OK, "gate: %s", weft_last_error());
    weft_tensor_t *v = zeros(700);
    RANK_CHECK(weft_ps_pull(d, v, 20000) == WEFT_OK, "pull: %s", weft_last_error());
    const float *p = weft_tensor_data(v);
    for (int i = 0; i < 700; i++) {
        RANK_CHECK(p[i] == 2.0f * EO_PUSHES, "element %d is %g, not %d", i, p[i], 2 * EO_PUSHES);
    }
    uint64_t q[4] = {5, 42, 1000000007, 77};
    int64_t qs[2] = {4, 4};
    weft_tensor_t *out = NULL;
    weft_tensor_create(WEFT_F32, 2, qs, &out);
    RANK_CHECK(weft_ps_pull_rows(sp, q, 4, out, 20000) == WEFT_OK, "pull rows: %s",
               weft_last_error());
    const float *o = weft_tensor_data(out);
    for (int j = 0; j < 4; j++) {
        float twice = 2.0f * 2 * EO_PUSHES * (float)(j + 1); /* ids 5 and 42 come twice a call */
        float once = 2.0f * EO_PUSHES * (float)(j + 1);
        RANK_CHECK(o[j] == twice && o[4 + j] == twice && o[8 + j] == once && o[12 + j] == 0.0f,
                   "rows: %g %g %g %g", o[j], o[4 + j], o[8 + j], o[12 + j]);
    }
    weft_ps_load_t loads[4];
    RANK_CHECK(weft_ps_table_stats(d, loads, 20000) == WEFT_OK, "stats");
    uint64_t dups = 0;
    for (int i = 0; i < g_ns; i++) {
        dups += loads[i].duplicates;
    }
    RANK_CHECK(dups > 0, "no duplicate was seen: the fault injector did not run");
    weft_tensor_release(one);
    weft_tensor_release(rows);
    weft_tensor_release(g1);
    weft_tensor_release(v);
    weft_tensor_release(out);
    return 0;
}

Test(ps, duplicated_and_reordered_pushes_count_once, .timeout = 120)
{
    setenv("WEFT_PS_FAULT_DUP", "1", 1);
    setenv("WEFT_PS_FAULT_DELAY_US", "3000", 1);
    roles(2, 2);
    run_world(once_body, 100000);
}

/* ------------------------------------------------------------------ sparse optimizers */

#define SP_DIM   8
#define SP_STEPS 4

static float grad_of(int w, int k, uint64_t id, int j)
{
    return (float)((int)(id % 7) - 3) * 0.25f + (float)(w + 1) * 0.5f - (float)k * 0.125f +
           (float)j * 0.0625f;
}

/* SYNC Adagrad on rows made by a seeded uniform initializer: each step's rows equal core's
 * Adagrad applied to the mean of both workers' gradients, bit for bit. */
static int sparse_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    weft_ps_table_spec_t s;
    weft_ps_table_t *t;
    weft_ps_table_spec_init(&s, "emb", WEFT_PS_SPARSE);
    s.dim = SP_DIM;
    s.init = WEFT_PS_UNIFORM;
    s.init_a = -0.5;
    s.init_b = 0.5;
    s.seed = 1234;
    s.optimizer = WEFT_PS_ADAGRAD;
    s.adagrad.lr = 0.1;
    s.id_bound = 1000;
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &t) == WEFT_OK, "create: %s", weft_last_error());
    if (!weft_ps_is_worker(PS)) {
        return 0;
    }
    int w = weft_ps_worker_index(PS);
    uint64_t ids[5] = {3, 17, 256, 999, 17};
    int64_t shape[2] = {5, SP_DIM}, one[1] = {SP_DIM};
    weft_tensor_t *rows = NULL, *g = NULL;
    weft_tensor_create(WEFT_F32, 2, shape, &rows);
    weft_tensor_create(WEFT_F32, 2, shape, &g);
    /* The reference: rows as first pulled, then core's Adagrad on the mean gradient. */
    weft_tensor_t *ref[4], *sum[4];
    RANK_CHECK(weft_ps_pull_rows(t, ids, 5, rows, 20000) == WEFT_OK, "pull: %s", weft_last_error());
    for (int r = 0; r < 4; r++) {
        weft_tensor_create(WEFT_F32, 1, one, &ref[r]);
        weft_tensor_create(WEFT_F32, 1, one, &sum[r]);
        memcpy(weft_tensor_data(ref[r]), (float *)weft_tensor_data(rows) + r * SP_DIM,
               SP_DIM * sizeof(float));
    }
    /* The same id pulled twice in one call came back alike; and it is not all zeros. */
    RANK_CHECK(memcmp((float *)weft_tensor_data(rows) + 1 * SP_DIM,
                      (float *)weft_tensor_data(rows) + 4 * SP_DIM, SP_DIM * 4) == 0,
               "a repeated id's rows differ");
    RANK_CHECK(((float *)weft_tensor_data(rows))[0] != 0.0f, "the initializer did not run");
    /* Each row's initial values are weft_rng's uniform stream number id, of the seed mixed with
     * the table's name (FNV-1a), as docs/ps.md says: the same on any number of servers. */
    for (int r = 0; r < 4; r++) {
        uint64_t h = UINT64_C(0xcbf29ce484222325);
        for (const char *c = "emb"; *c != '\0'; c++) {
            h = (h ^ (uint8_t)*c) * UINT64_C(0x100000001b3);
        }
        weft_rng_t rng;
        weft_rng_init(&rng, s.seed ^ h, ids[r]);
        for (int j = 0; j < SP_DIM; j++) {
            float want = (float)(s.init_a + (s.init_b - s.init_a) * weft_rng_uniform(&rng));
            float got = ((float *)weft_tensor_data(rows))[r * SP_DIM + j];
            RANK_CHECK(memcmp(&want, &got, 4) == 0, "row %llu[%d] is %.9g, the stream's %.9g",
                       (unsigned long long)ids[r], j, got, want);
        }
    }
    for (int k = 0; k < SP_STEPS; k++) {
        float *gp = weft_tensor_data(g);
        for (int i = 0; i < 5; i++) {
            for (int j = 0; j < SP_DIM; j++) {
                gp[i * SP_DIM + j] = grad_of(w, k, ids[i], j);
            }
        }
        RANK_CHECK(weft_ps_push_rows(t, ids, 5, g, 20000) == WEFT_OK, "push: %s",
                   weft_last_error());
        RANK_CHECK(weft_ps_clock(PS, 20000) == WEFT_OK, "clock: %s", weft_last_error());
        for (int r = 0; r < 4; r++) {
            int reps = ids[r] == 17 ? 2 : 1;
            weft_tensor_t *mg = zeros(SP_DIM);
            float *m = weft_tensor_data(mg);
            for (int j = 0; j < SP_DIM; j++) {
                /* Per worker, repeats summed; then the mean of the workers' sums. */
                float a0 = grad_of(0, k, ids[r], j) * (float)reps;
                float a1 = grad_of(1, k, ids[r], j) * (float)reps;
                m[j] = (a0 + a1) * 0.5f;
            }
            weft_optim_adagrad_config_t cfg = s.adagrad;
            RANK_CHECK(weft_optim_adagrad_step(&cfg, ref[r], mg, sum[r], k + 1) == WEFT_OK,
                       "reference step");
            weft_tensor_release(mg);
        }
        RANK_CHECK(weft_ps_pull_rows(t, ids, 5, rows, 20000) == WEFT_OK, "pull: %s",
                   weft_last_error());
        for (int r = 0; r < 4; r++) {
            RANK_CHECK(
                memcmp(weft_tensor_data(ref[r]), (float *)weft_tensor_data(rows) + r * SP_DIM,
                       SP_DIM * sizeof(float)) == 0,
                "step %d: row %llu differs from core's Adagrad", k, (unsigned long long)ids[r]);
        }
    }
    for (int r = 0; r < 4; r++) {
        weft_tensor_release(ref[r]);
        weft_tensor_release(sum[r]);
    }
    weft_tensor_release(rows);
    weft_tensor_release(g);
    return 0;
}

Test(ps, sparse_rows_follow_cores_adagrad_bit_for_bit, .timeout = 120)
{
    roles(2, 2);
    run_world(sparse_body, 100000);
}

/* ------------------------------------------------------------------ optimizers */

#define OPT_N     300
#define OPT_DIM   8
#define OPT_STEPS 5

typedef struct {
    const char *name;
    weft_ps_optimizer_t opt;
    weft_dtype_t dtype;
    weft_optim_sgd_config_t sgd;
    weft_optim_adam_config_t adam;
} opt_case_t;

static float opt_grad(int k, int i)
{
    return sinf((float)(i * 3 + k * 17)) * 0.5f + (float)(k % 3) * 0.125f;
}

/* Rounds @p p through the table's storage dtype, as the server stores it. */
static void opt_store(float *p, int64_t n, weft_dtype_t dt)
{
    for (int64_t i = 0; dt == WEFT_F16 && i < n; i++) {
        p[i] = weft_f16_to_f32(weft_f32_to_f16(p[i]));
    }
}

/* One reference step of core's kernel for case @p c on [n] values. */
static int opt_ref_step(const opt_case_t *c, weft_tensor_t *p, weft_tensor_t *g, weft_tensor_t **st,
                        int64_t step)
{
    switch (c->opt) {
    case WEFT_PS_SGD:
        return weft_optim_sgd_step(&c->sgd, p, g, st[0], step) == WEFT_OK ? 0 : 1;
    case WEFT_PS_ADAM:
        return weft_optim_adam_step(&c->adam, p, g, st[0], st[1], st[2], step) == WEFT_OK ? 0 : 1;
    case WEFT_PS_ADAMW:
        return weft_optim_adamw_step(&c->adam, p, g, st[0], st[1], st[2], step) == WEFT_OK ? 0 : 1;
    default:
        return 1;
    }
}

/* Every server-side optimizer configuration the tests did not reach: dense SGD with Nesterov
 * momentum and weight decay, SGD with dampening, Adam with AMSGrad, AdamW, Adam on f16 storage,
 * and sparse rows under lazy row-wise Adam (each row its own step count: rows pushed at different
 * rates). Each equals core's kernels applied in the same order, bit for bit. */
static int optimizers_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    opt_case_t cases[5];
    memset(cases, 0, sizeof(cases));
    const char *names[5] = {"sgd_nesterov", "sgd_dampening", "adam_ams", "adamw", "adam_f16"};
    for (int c = 0; c < 5; c++) {
        cases[c].name = names[c];
        cases[c].dtype = c == 4 ? WEFT_F16 : WEFT_F32;
        cases[c].opt = c < 2 ? WEFT_PS_SGD : c == 3 ? WEFT_PS_ADAMW : WEFT_PS_ADAM;
        cases[c].sgd = weft_optim_sgd_defaults();
        cases[c].adam = c == 3 ? weft_optim_adamw_defaults() : weft_optim_adam_defaults();
        cases[c].adam.lr = 0.01;
    }
    cases[0].sgd.lr = 0.1;
    cases[0].sgd.momentum = 0.9;
    cases[0].sgd.weight_decay = 0.01;
    cases[0].sgd.nesterov = 1;
    cases[1].sgd.lr = 0.05;
    cases[1].sgd.momentum = 0.8;
    cases[1].sgd.dampening = 0.3;
    cases[1].sgd.weight_decay = 0.02;
    cases[2].adam.weight_decay = 0.01;
    cases[2].adam.amsgrad = 1;
    cases[3].adam.weight_decay = 0.1;
    weft_ps_table_t *t[5], *rows_t;
    weft_ps_table_spec_t s;
    for (int c = 0; c < 5; c++) {
        dense_spec(&s, cases[c].name, OPT_N);
        s.consistency = WEFT_PS_ASYNC;
        s.dtype = cases[c].dtype;
        s.init = WEFT_PS_UNIFORM;
        s.init_a = -1;
        s.init_b = 1;
        s.seed = 11 + (uint64_t)c;
        s.optimizer = cases[c].opt;
        s.sgd = cases[c].sgd;
        s.adam = cases[c].adam;
        RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &t[c]) == WEFT_OK, "create %s: %s",
                   cases[c].name, weft_last_error());
    }
    weft_ps_table_spec_init(&s, "lazy_adam", WEFT_PS_SPARSE);
    s.dim = OPT_DIM;
    s.consistency = WEFT_PS_ASYNC;
    s.init = WEFT_PS_NORMAL;
    s.init_b = 0.5;
    s.seed = 5;
    s.optimizer = WEFT_PS_ADAM;
    s.adam = weft_optim_adam_defaults();
    s.adam.lr = 0.02;
    weft_optim_adam_config_t row_cfg = s.adam;
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &rows_t) == WEFT_OK, "create: %s",
               weft_last_error());
    if (!weft_ps_is_worker(PS)) {
        return weft_ps_finish(PS, 60000) == WEFT_OK ? 0 : 1;
    }
    weft_tensor_t *got = zeros(OPT_N), *g = zeros(OPT_N);
    float *gp = weft_tensor_data(g);
    for (int c = 0; c < 5; c++) {
        weft_tensor_t *ref = zeros(OPT_N), *st[3] = {zeros(OPT_N), zeros(OPT_N), zeros(OPT_N)};
        RANK_CHECK(weft_ps_pull(t[c], ref, 20000) == WEFT_OK, "pull: %s", weft_last_error());
        for (int k = 1; k <= OPT_STEPS; k++) {
            for (int i = 0; i < OPT_N; i++) {
                gp[i] = opt_grad(k, i);
            }
            RANK_CHECK(weft_ps_push(t[c], g, 20000) == WEFT_OK, "push: %s", weft_last_error());
            RANK_CHECK(opt_ref_step(&cases[c], ref, g, st, k) == 0, "reference %s: %s",
                       cases[c].name, weft_last_error());
            opt_store(weft_tensor_data(ref), OPT_N, cases[c].dtype);
            RANK_CHECK(weft_ps_pull(t[c], got, 20000) == WEFT_OK, "pull: %s", weft_last_error());
            const float *r = weft_tensor_data(ref), *q = weft_tensor_data(got);
            for (int i = 0; i < OPT_N; i++) {
                RANK_CHECK(memcmp(&r[i], &q[i], 4) == 0, "%s, step %d, element %d: %.9g, not %.9g",
                           cases[c].name, k, i, (double)q[i], (double)r[i]);
            }
        }
        weft_tensor_release(ref);
        for (int j = 0; j < 3; j++) {
            weft_tensor_release(st[j]);
        }
    }
    /* Lazy Adam: row 4 pushed every step, row 9 every other one, row 30 once. */
    uint64_t ids[3] = {4, 9, 30};
    int64_t one[2] = {1, OPT_DIM}, dim1 = OPT_DIM;
    weft_tensor_t *rg = NULL, *rv = NULL, *ref[3], *m[3], *v2[3];
    weft_tensor_create(WEFT_F32, 2, one, &rg);
    weft_tensor_create(WEFT_F32, 2, one, &rv);
    int64_t steps[3] = {0, 0, 0};
    for (int r = 0; r < 3; r++) {
        weft_tensor_create(WEFT_F32, 1, &dim1, &ref[r]);
        weft_tensor_create(WEFT_F32, 1, &dim1, &m[r]);
        weft_tensor_create(WEFT_F32, 1, &dim1, &v2[r]);
        RANK_CHECK(weft_ps_pull_rows(rows_t, &ids[r], 1, rv, 20000) == WEFT_OK, "pull: %s",
                   weft_last_error());
        memcpy(weft_tensor_data(ref[r]), weft_tensor_data(rv), OPT_DIM * 4);
    }
    for (int k = 1; k <= 6; k++) {
        for (int r = 0; r < 3; r++) {
            if (!(r == 0 || (r == 1 && k % 2 == 0) || (r == 2 && k == 3))) {
                continue;
            }
            float *rgp = weft_tensor_data(rg);
            for (int j = 0; j < OPT_DIM; j++) {
                rgp[j] = opt_grad(k, j + 10 * r);
            }
            RANK_CHECK(weft_ps_push_rows(rows_t, &ids[r], 1, rg, 20000) == WEFT_OK, "push: %s",
                       weft_last_error());
            weft_tensor_t *g1 = NULL;
            weft_tensor_create(WEFT_F32, 1, &dim1, &g1);
            memcpy(weft_tensor_data(g1), rgp, OPT_DIM * 4);
            RANK_CHECK(weft_optim_adam_step(&row_cfg, ref[r], g1, m[r], v2[r], NULL,
                                            ++steps[r]) == WEFT_OK,
                       "reference: %s", weft_last_error());
            weft_tensor_release(g1);
        }
        for (int r = 0; r < 3; r++) {
            RANK_CHECK(weft_ps_pull_rows(rows_t, &ids[r], 1, rv, 20000) == WEFT_OK, "pull: %s",
                       weft_last_error());
            RANK_CHECK(memcmp(weft_tensor_data(rv), weft_tensor_data(ref[r]), OPT_DIM * 4) == 0,
                       "lazy Adam, step %d: row %llu (its step %lld) differs from core's", k,
                       (unsigned long long)ids[r], (long long)steps[r]);
        }
    }
    for (int r = 0; r < 3; r++) {
        weft_tensor_release(ref[r]);
        weft_tensor_release(m[r]);
        weft_tensor_release(v2[r]);
    }
    weft_tensor_release(rg);
    weft_tensor_release(rv);
    weft_tensor_release(got);
    weft_tensor_release(g);
    RANK_CHECK(weft_ps_finish(PS, 30000) == WEFT_OK, "finish: %s", weft_last_error());
    return 0;
}

Test(ps, every_optimizer_follows_cores_kernels_bit_for_bit, .timeout = 120)
{
    roles(1, 1);
    run_world(optimizers_body, 100000);
}

/* ------------------------------------------------------------------ push_pull */

/* push_pull answers with the value its push is part of: ASYNC at once (blocking form), SYNC once
 * the step ends (async form, then the clock, then the wait). */
static int push_pull_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    weft_ps_table_spec_t s;
    weft_ps_table_t *as, *sy;
    dense_spec(&s, "as", 700);
    s.consistency = WEFT_PS_ASYNC;
    s.optimizer = WEFT_PS_SUM;
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &as) == WEFT_OK, "create: %s",
               weft_last_error());
    dense_spec(&s, "sy", 700);
    s.consistency = WEFT_PS_SYNC;
    s.optimizer = WEFT_PS_SGD;
    s.sgd.lr = 0.5;
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &sy) == WEFT_OK, "create: %s",
               weft_last_error());
    if (!weft_ps_is_worker(PS)) {
        return weft_ps_finish(PS, 60000) == WEFT_OK ? 0 : 1;
    }
    int w = weft_ps_worker_index(PS);
    weft_tensor_t *g = filled(700, 1.0f + (float)w), *v = zeros(700);
    const float *p = weft_tensor_data(v);
    /* ASYNC SUM: the value after this worker's push includes it (the other's may or may not). */
    RANK_CHECK(weft_ps_push_pull(as, g, v, 20000) == WEFT_OK, "push_pull: %s", weft_last_error());
    /* (chunk by chunk, the other worker's push may be in some chunks and not yet in others) */
    for (int i = 0; i < 700; i++) {
        RANK_CHECK(p[i] == 1.0f + (float)w || p[i] == 3.0f, "ASYNC push_pull gave %g at %d",
                   (double)p[i], i);
    }
    /* SYNC SGD lr 0.5 on the mean of 1 and 2: each step subtracts 0.75. */
    for (int k = 1; k <= 3; k++) {
        weft_future_t *f = NULL;
        RANK_CHECK(weft_ps_push_pull_async(sy, g, v, 20000, &f) == WEFT_OK, "push_pull: %s",
                   weft_last_error());
        RANK_CHECK(weft_ps_clock(PS, 20000) == WEFT_OK, "clock: %s", weft_last_error());
        RANK_CHECK(weft_future_wait(f, -1) == WEFT_OK && weft_future_status(f) == WEFT_OK,
                   "step %d: %s", k, weft_future_error(f));
        weft_future_release(f);
        for (int i = 0; i < 700; i++) {
            RANK_CHECK(p[i] == -0.75f * (float)k, "step %d, element %d: %g, not %g", k, i,
                       (double)p[i], -0.75 * k);
        }
    }
    weft_tensor_release(g);
    weft_tensor_release(v);
    RANK_CHECK(weft_ps_finish(PS, 30000) == WEFT_OK, "finish: %s", weft_last_error());
    return 0;
}

Test(ps, push_pull_answers_with_the_value_its_push_is_part_of, .timeout = 120)
{
    roles(1, 2);
    run_world(push_pull_body, 100000);
}

/* ------------------------------------------------------------------ capacity */

#define CAP_ROWS 8
#define CAP_NEW  2000

/* A table of at most CAP_ROWS rows per server: rows past it evict others, so the server holds
 * exactly CAP_ROWS after CAP_NEW new ids; an evicted row comes back with its initial value, the
 * push it had forgotten; and a row made again is pushed to as any other. */
static int capacity_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    weft_ps_table_spec_t s;
    weft_ps_table_t *t;
    weft_ps_table_spec_init(&s, "lru", WEFT_PS_SPARSE);
    s.dim = 4;
    s.init = WEFT_PS_CONSTANT;
    s.init_a = 0.5;
    s.optimizer = WEFT_PS_SUM;
    s.consistency = WEFT_PS_ASYNC;
    s.capacity = CAP_ROWS;
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &t) == WEFT_OK, "create: %s", weft_last_error());
    if (!weft_ps_is_worker(PS)) {
        return 0;
    }
    int64_t one[2] = {1, 4}, many[2] = {CAP_NEW, 4};
    weft_tensor_t *row = NULL, *g = NULL, *rows = NULL;
    weft_tensor_create(WEFT_F32, 2, one, &row);
    weft_tensor_create(WEFT_F32, 2, one, &g);
    weft_tensor_create(WEFT_F32, 2, many, &rows);
    float *gp = weft_tensor_data(g), *rp = weft_tensor_data(row);
    for (int j = 0; j < 4; j++) {
        gp[j] = 2.0f;
    }
    uint64_t x = 5, *ids = malloc(CAP_NEW * sizeof(*ids));
    for (int i = 0; i < CAP_NEW; i++) {
        ids[i] = 1000 + (uint64_t)i;
    }
    RANK_CHECK(weft_ps_push_rows(t, &x, 1, g, 20000) == WEFT_OK, "push: %s", weft_last_error());
    RANK_CHECK(weft_ps_pull_rows(t, &x, 1, row, 20000) == WEFT_OK, "pull: %s", weft_last_error());
    RANK_CHECK(rp[0] == 2.5f && rp[3] == 2.5f, "row 5 is %g, not 0.5 + 2", (double)rp[0]);
    /* CAP_NEW rows made by one pull: every one past the capacity evicts one (row 5, the oldest of
     * its stripe, among them). */
    RANK_CHECK(weft_ps_pull_rows(t, ids, CAP_NEW, rows, 20000) == WEFT_OK, "pull: %s",
               weft_last_error());
    const float *all = weft_tensor_data(rows);
    for (int i = 0; i < CAP_NEW * 4; i++) {
        RANK_CHECK(all[i] == 0.5f, "a new row's element %d is %g, not its initial 0.5", i,
                   (double)all[i]);
    }
    weft_ps_load_t load;
    RANK_CHECK(weft_ps_table_stats(t, &load, 20000) == WEFT_OK, "stats: %s", weft_last_error());
    RANK_CHECK(load.rows == CAP_ROWS, "the server holds %llu rows, not its capacity %d",
               (unsigned long long)load.rows, CAP_ROWS);
    RANK_CHECK(load.evicted == 1 + CAP_NEW - CAP_ROWS, "%llu rows evicted, not %d",
               (unsigned long long)load.evicted, 1 + CAP_NEW - CAP_ROWS);
    /* Row 5 was forgotten with its push: made again from its initial value. */
    RANK_CHECK(weft_ps_pull_rows(t, &x, 1, row, 20000) == WEFT_OK, "pull: %s", weft_last_error());
    RANK_CHECK(rp[0] == 0.5f && rp[3] == 0.5f, "evicted row 5 came back as %g, not 0.5",
               (double)rp[0]);
    RANK_CHECK(weft_ps_push_rows(t, &x, 1, g, 20000) == WEFT_OK, "push: %s", weft_last_error());
    RANK_CHECK(weft_ps_pull_rows(t, &x, 1, row, 20000) == WEFT_OK, "pull: %s", weft_last_error());
    RANK_CHECK(rp[0] == 2.5f, "row 5 made again is %g after a push, not 2.5", (double)rp[0]);
    RANK_CHECK(weft_ps_table_stats(t, &load, 20000) == WEFT_OK, "stats: %s", weft_last_error());
    RANK_CHECK(load.rows == CAP_ROWS, "%llu rows held, not %d", (unsigned long long)load.rows,
               CAP_ROWS);
    free(ids);
    weft_tensor_release(rows);
    weft_tensor_release(g);
    weft_tensor_release(row);
    return 0;
}

/* admit_after = 3: pulls before a row's third push read its initial value and store nothing;
 * its first two pushes are counted, not applied; the third makes the row and is applied. */
static int admission_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    weft_ps_table_spec_t s;
    weft_ps_table_t *t;
    weft_ps_table_spec_init(&s, "admit", WEFT_PS_SPARSE);
    s.dim = 4;
    s.init = WEFT_PS_CONSTANT;
    s.init_a = 0.25;
    s.optimizer = WEFT_PS_SUM;
    s.consistency = WEFT_PS_ASYNC;
    s.admit_after = 3;
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &t) == WEFT_OK, "create: %s", weft_last_error());
    if (!weft_ps_is_worker(PS)) {
        return 0;
    }
    int64_t one[2] = {1, 4};
    weft_tensor_t *row = NULL, *g = NULL;
    weft_tensor_create(WEFT_F32, 2, one, &row);
    weft_tensor_create(WEFT_F32, 2, one, &g);
    float *gp = weft_tensor_data(g), *rp = weft_tensor_data(row);
    for (int j = 0; j < 4; j++) {
        gp[j] = 1.0f;
    }
    uint64_t x = 77;
    weft_ps_load_t load;
    for (int k = 1; k <= 4; k++) {
        RANK_CHECK(weft_ps_pull_rows(t, &x, 1, row, 20000) == WEFT_OK, "pull: %s",
                   weft_last_error());
        float want = k <= 3 ? 0.25f : 1.25f; /* pushes 1, 2 not applied; push 3 applied */
        RANK_CHECK(rp[0] == want && rp[3] == want, "before push %d: %g, not %g", k, (double)rp[0],
                   (double)want);
        RANK_CHECK(weft_ps_table_stats(t, &load, 20000) == WEFT_OK, "stats: %s",
                   weft_last_error());
        RANK_CHECK(load.rows == (k <= 3 ? 0u : 1u), "before push %d: %llu rows stored", k,
                   (unsigned long long)load.rows);
        RANK_CHECK(weft_ps_push_rows(t, &x, 1, g, 20000) == WEFT_OK, "push: %s",
                   weft_last_error());
    }
    RANK_CHECK(weft_ps_pull_rows(t, &x, 1, row, 20000) == WEFT_OK, "pull: %s", weft_last_error());
    RANK_CHECK(rp[0] == 2.25f, "after 4 pushes: %g, not 0.25 + 2", (double)rp[0]);
    weft_tensor_release(g);
    weft_tensor_release(row);
    return 0;
}

Test(ps, rows_are_made_by_their_kth_push_and_not_before, .timeout = 120)
{
    roles(1, 1);
    run_world(admission_body, 100000);
}

Test(ps, a_table_at_its_capacity_evicts_rows_and_forgets_them, .timeout = 120)
{
    roles(1, 1);
    run_world(capacity_body, 100000);
}

/* ------------------------------------------------------------------ refused sends */

#define SMALL_LIMIT  (32 << 10) /* the server's message limit */
#define REFUSED_IDS  1000       /* x (8 + 16 * 4) bytes: over it */
#define AFTER_PUSHES 4200       /* more than the server's window of push numbers (4096) */

/* Pushes refused before they leave the worker apply nothing and leave nothing behind: a sparse
 * push over the server's message limit is refused whole, up front; a dense push whose one chunk
 * is over it is refused by the transport after it was numbered, and its number and count are
 * given back, so a pull right after does not wait for it and more than a window of pushes later
 * every push still counts once. */
static int refused_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    weft_ps_table_spec_t s;
    weft_ps_table_t *sp, *d;
    weft_ps_table_spec_init(&s, "rows", WEFT_PS_SPARSE);
    s.dim = 16;
    s.init = WEFT_PS_ZEROS;
    s.optimizer = WEFT_PS_SUM;
    s.consistency = WEFT_PS_ASYNC;
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &sp) == WEFT_OK, "create: %s",
               weft_last_error());
    dense_spec(&s, "one_chunk", 16384);
    s.chunk_bytes = 65536; /* one chunk, over the limit */
    s.optimizer = WEFT_PS_SUM;
    s.consistency = WEFT_PS_ASYNC;
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &d) == WEFT_OK, "create: %s",
               weft_last_error());
    if (!weft_ps_is_worker(PS)) {
        return 0;
    }
    uint64_t *ids = malloc(REFUSED_IDS * sizeof(*ids));
    for (int i = 0; i < REFUSED_IDS; i++) {
        ids[i] = 7 + (uint64_t)i;
    }
    int64_t shape[2] = {REFUSED_IDS, 16}, one[2] = {1, 16};
    weft_tensor_t *rows = NULL, *row = NULL;
    weft_tensor_create(WEFT_F32, 2, shape, &rows);
    weft_tensor_create(WEFT_F32, 2, one, &row);
    float *rp = weft_tensor_data(rows);
    for (int i = 0; i < REFUSED_IDS * 16; i++) {
        rp[i] = 1.0f;
    }
    weft_status_t st = weft_ps_push_rows(sp, ids, REFUSED_IDS, rows, 20000);
    RANK_CHECK(st == WEFT_ERR_TOO_LARGE, "an oversized sparse push gave %s: %s",
               weft_status_name(st), weft_last_error());
    RANK_CHECK(strstr(weft_last_error(), "message limit") != NULL &&
                   strstr(weft_last_error(), "'rows'") != NULL,
               "the refusal does not say why: %s", weft_last_error());
    /* A pull of 5000 ids: 40000 bytes of ids to the server, over its limit too. */
    uint64_t *many = malloc(5000 * sizeof(*many));
    for (int i = 0; i < 5000; i++) {
        many[i] = (uint64_t)i;
    }
    int64_t sh5[2] = {5000, 16};
    weft_tensor_t *rows5 = NULL;
    weft_tensor_create(WEFT_F32, 2, sh5, &rows5);
    st = weft_ps_pull_rows(sp, many, 5000, rows5, 20000);
    RANK_CHECK(st == WEFT_ERR_TOO_LARGE && strstr(weft_last_error(), "message limit") != NULL,
               "an oversized sparse pull gave %s: %s", weft_status_name(st), weft_last_error());
    free(many);
    weft_tensor_release(rows5);
    weft_tensor_t *grad = filled(16384, 1.0f), *val = zeros(16384);
    st = weft_ps_push(d, grad, 20000);
    RANK_CHECK(st == WEFT_ERR_TOO_LARGE, "an oversized dense push gave %s: %s",
               weft_status_name(st), weft_last_error());
    /* Not waited for: the pull is answered at once, with nothing applied. */
    RANK_CHECK(weft_ps_pull(d, val, 20000) == WEFT_OK, "pull after a refused push: %s",
               weft_last_error());
    RANK_CHECK(((float *)weft_tensor_data(val))[0] == 0.0f &&
                   ((float *)weft_tensor_data(val))[16383] == 0.0f,
               "a refused dense push was applied");
    /* Nothing of the sparse push either, in pulls small enough to come back. */
    for (int i = 0; i < REFUSED_IDS; i += 100) {
        int64_t sh[2] = {100, 16};
        weft_tensor_t *part = NULL;
        weft_tensor_create(WEFT_F32, 2, sh, &part);
        RANK_CHECK(weft_ps_pull_rows(sp, ids + i, 100, part, 20000) == WEFT_OK, "pull: %s",
                   weft_last_error());
        const float *pp = weft_tensor_data(part);
        for (int j = 0; j < 100 * 16; j++) {
            RANK_CHECK(pp[j] == 0.0f, "a refused sparse push was applied to id %d",
                       7 + i + j / 16);
        }
        weft_tensor_release(part);
    }
    /* More than a window of pushes after the dense one's number was given back: each counts. */
    float *op = weft_tensor_data(row);
    for (int j = 0; j < 16; j++) {
        op[j] = 1.0f;
    }
    for (int k = 0; k < AFTER_PUSHES; k++) {
        st = weft_ps_push_rows(sp, ids, 1, row, 20000);
        RANK_CHECK(st == WEFT_OK, "push %d after the refused ones: %s", k, weft_last_error());
    }
    RANK_CHECK(weft_ps_pull_rows(sp, ids, 1, row, 20000) == WEFT_OK, "pull: %s",
               weft_last_error());
    RANK_CHECK(op[0] == (float)AFTER_PUSHES && op[15] == (float)AFTER_PUSHES,
               "id 7 is %g after %d pushes of 1", (double)op[0], AFTER_PUSHES);
    weft_ps_load_t load;
    RANK_CHECK(weft_ps_table_stats(sp, &load, 20000) == WEFT_OK, "stats: %s", weft_last_error());
    RANK_CHECK(load.pushes == AFTER_PUSHES && load.duplicates == 0,
               "the server counted %llu pushes, %llu duplicates", (unsigned long long)load.pushes,
               (unsigned long long)load.duplicates);
    free(ids);
    weft_tensor_release(grad);
    weft_tensor_release(val);
    weft_tensor_release(rows);
    weft_tensor_release(row);
    return 0;
}

Test(ps, pushes_refused_before_they_leave_apply_nothing_and_leave_nothing_behind,
     .timeout = 120)
{
    roles(1, 1);
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, refused_body);
    o.setup = ps_setup;
    o.deadline_ms = 100000;
    o.max_message_bytes = SMALL_LIMIT;
    o.max_message_bytes_rank1 = (uint64_t)64 << 20; /* the worker's own */
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ------------------------------------------------------------------ bad input */

/* A request as a raw caller would send it. */
static weft_status_t raw_call(weft_agent_t *a, int to, Weft__V1__PsRequest *r, weft_tensor_t **ts,
                              size_t n, char *why, size_t wn)
{
    weft_value_t *body = NULL, *msg = NULL;
    weft_value_create(&body);
    for (size_t i = 0; i < n; i++) {
        weft_value_add_tensor(body, ts[i]);
    }
    weft_msg_pack(&r->base, body, &msg);
    weft_status_t st = weft_rpc_sync(a, to, "__weft.ps", msg, 10000, NULL);
    snprintf(why, wn, "%s", st == WEFT_OK ? "" : weft_last_error());
    weft_value_free(msg);
    weft_value_free(body);
    return st;
}

static int bad_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)rank, (void)world, (void)arg;
    char why[512];
    weft_ps_table_spec_t s;
    weft_ps_table_t *d, *sp;
    dense_spec(&s, "d", 300);
    s.optimizer = WEFT_PS_SUM;
    s.consistency = WEFT_PS_ASYNC;
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &d) == WEFT_OK, "create: %s", weft_last_error());
    weft_ps_table_spec_init(&s, "s", WEFT_PS_SPARSE);
    s.dim = 3;
    s.id_bound = 100;
    s.optimizer = WEFT_PS_SUM;
    s.consistency = WEFT_PS_ASYNC;
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &sp) == WEFT_OK, "create: %s",
               weft_last_error());
    /* A second table of the same name. */
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &sp) == WEFT_ERR_ALREADY_EXISTS, "twice");
    weft_ps_table_t *sy;
    dense_spec(&s, "sy", 300);
    s.consistency = WEFT_PS_SYNC;
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &sy) == WEFT_OK, "create: %s",
               weft_last_error());
    if (!weft_ps_is_worker(PS)) {
        /* A server is not a worker. */
        weft_tensor_t *v = zeros(300);
        RANK_CHECK(weft_ps_pull(d, v, 1000) == WEFT_ERR_INVALID_STATE, "a server pulled");
        weft_tensor_release(v);
        return 0;
    }
    weft_tensor_t *g = filled(300, 1.0f), *v = zeros(300), *wrong = zeros(299);
    int64_t sh[2] = {2, 3}, sh4[2] = {2, 4};
    weft_tensor_t *rows = NULL, *rows4 = NULL, *i64 = NULL;
    weft_tensor_create(WEFT_F32, 2, sh, &rows);
    weft_tensor_create(WEFT_F32, 2, sh4, &rows4);
    weft_tensor_create(WEFT_I64, 2, sh, &i64);
    uint64_t ok_ids[2] = {1, 2}, bad_ids[2] = {1, 100};
    /* Client-side checks: a clear status, nothing sent. */
    RANK_CHECK(weft_ps_push(d, wrong, 1000) == WEFT_ERR_SHAPE, "wrong shape");
    RANK_CHECK(weft_ps_push(d, i64, 1000) == WEFT_ERR_DTYPE, "wrong dtype");
    RANK_CHECK(weft_ps_push_rows(sp, bad_ids, 2, rows, 1000) == WEFT_ERR_INVALID_ARG &&
                   strstr(weft_last_error(), "100") != NULL,
               "id out of range: %s", weft_last_error());
    RANK_CHECK(weft_ps_push_rows(sp, ok_ids, 2, rows4, 1000) == WEFT_ERR_SHAPE, "wrong dim");
    RANK_CHECK(weft_ps_push_rows(d, ok_ids, 2, rows, 1000) == WEFT_ERR_INVALID_ARG,
               "rows to a dense table");
    RANK_CHECK(weft_ps_push(sp, g, 1000) == WEFT_ERR_INVALID_ARG, "a tensor to a sparse table");
    /* A blocking push_pull on a SYNC table would wait for its own clock: refused at once. */
    RANK_CHECK(weft_ps_push_pull(sy, g, v, 60000) == WEFT_ERR_INVALID_STATE &&
                   strstr(weft_last_error(), "weft_ps_push_pull_async") != NULL,
               "a blocking SYNC push_pull: %s", weft_last_error());
    /* Tensors that say they live on a device (host bytes here, never read). */
    weft_device_t gpu = {WEFT_DEVICE_CUDA, 0};
    weft_tensor_t *on_gpu = NULL, *rows_gpu = NULL;
    int64_t n300 = 300;
    RANK_CHECK(weft_tensor_wrap(WEFT_F32, 1, &n300, weft_tensor_data(g), 300 * 4, gpu, NULL, NULL,
                                &on_gpu) == WEFT_OK &&
                   weft_tensor_wrap(WEFT_F32, 2, sh, weft_tensor_data(rows), 6 * 4, gpu, NULL,
                                    NULL, &rows_gpu) == WEFT_OK,
               "wrap: %s", weft_last_error());
    RANK_CHECK(weft_ps_push(d, on_gpu, 1000) == WEFT_ERR_UNSUPPORTED &&
                   strstr(weft_last_error(), "CPU") != NULL,
               "a device gradient: %s", weft_last_error());
    RANK_CHECK(weft_ps_push_rows(sp, ok_ids, 2, rows_gpu, 1000) == WEFT_ERR_UNSUPPORTED &&
                   strstr(weft_last_error(), "CPU") != NULL,
               "device rows: %s", weft_last_error());
    RANK_CHECK(weft_ps_pull_rows(sp, ok_ids, 2, rows_gpu, 1000) == WEFT_ERR_UNSUPPORTED,
               "a pull into device rows: %s", weft_last_error());
    weft_tensor_release(on_gpu);
    weft_tensor_release(rows_gpu);
    /* Server-side checks of raw requests. */
    Weft__V1__PsRequest r = WEFT__V1__PS_REQUEST__INIT;
    r.op = WEFT__V1__PS_OP__PS_PUSH;
    r.table = 0;
    r.table_name = "nope";
    r.worker = weft_ps_worker_index(PS);
    r.seq = 1000;
    uint32_t chunk = 0;
    r.n_chunks = 1;
    r.chunks = &chunk;
    weft_tensor_t *c256 = filled(256, 5.0f);
    RANK_CHECK(raw_call(a, 0, &r, &c256, 1, why, sizeof(why)) == WEFT_ERR_NOT_FOUND &&
                   strstr(why, "nope") != NULL,
               "unknown table: %s", why);
    r.table_name = "d";
    r.worker = 1 - weft_ps_worker_index(PS); /* impersonating the other worker */
    RANK_CHECK(raw_call(a, 0, &r, &c256, 1, why, sizeof(why)) == WEFT_ERR_INVALID_ARG &&
                   strstr(why, "is not worker") != NULL,
               "impersonation: %s", why);
    r.worker = weft_ps_worker_index(PS);
    chunk = 1; /* held by server 1, sent to server 0 */
    RANK_CHECK(raw_call(a, 0, &r, &c256, 1, why, sizeof(why)) == WEFT_ERR_INVALID_ARG &&
                   strstr(why, "not held") != NULL,
               "wrong server: %s", why);
    chunk = 0;
    weft_tensor_t *c255 = filled(255, 5.0f);
    RANK_CHECK(raw_call(a, 0, &r, &c255, 1, why, sizeof(why)) == WEFT_ERR_SHAPE, "chunk length: %s",
               why);
    r.table = 1;
    r.table_name = "s";
    r.n_chunks = 0;
    weft_tensor_t *idt = NULL;
    int64_t two = 2;
    weft_tensor_create(WEFT_I64, 1, &two, &idt);
    ((int64_t *)weft_tensor_data(idt))[0] = 99;
    ((int64_t *)weft_tensor_data(idt))[1] = 150;
    weft_tensor_t *pair[2] = {idt, rows};
    int s0 = 0;
    RANK_CHECK(raw_call(a, s0, &r, pair, 2, why, sizeof(why)) == WEFT_ERR_INVALID_ARG,
               "raw id out of bound: %s", why);
    /* Garbage in place of a header. */
    weft_value_t *junk = value_of_string("\x05\x00\x00\x00garbage");
    RANK_CHECK(weft_rpc_sync(a, 0, "__weft.ps", junk, 10000, NULL) == WEFT_ERR_PROTOCOL,
               "garbage: %s", weft_last_error());
    weft_value_free(junk);
    /* Nothing of the above was applied: the table still holds zeros; a good push lands. */
    RANK_CHECK(weft_ps_pull(d, v, 10000) == WEFT_OK, "pull: %s", weft_last_error());
    for (int i = 0; i < 300; i++) {
        RANK_CHECK(((float *)weft_tensor_data(v))[i] == 0.0f, "element %d changed", i);
    }
    weft_tensor_release(g);
    weft_tensor_release(v);
    weft_tensor_release(wrong);
    weft_tensor_release(rows);
    weft_tensor_release(rows4);
    weft_tensor_release(i64);
    weft_tensor_release(c256);
    weft_tensor_release(c255);
    weft_tensor_release(idt);
    return 0;
}

Test(ps, bad_input_gets_a_clear_status_and_applies_nothing, .timeout = 120)
{
    roles(2, 2);
    run_world(bad_body, 100000);
}

/* Ranks that create a table differently: every rank gets MISMATCH naming the field. */
static int mismatch_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    weft_ps_table_spec_t s;
    weft_ps_table_t *t;
    dense_spec(&s, "m", rank == 2 ? 101 : 100);
    weft_status_t st = weft_ps_table_create(PS, &s, 20000, &t);
    RANK_CHECK(st == WEFT_ERR_MISMATCH && strstr(weft_last_error(), "shape") != NULL,
               "rank %d: %s: %s", rank, weft_strerror(st), weft_last_error());
    return 0;
}

Test(ps, tables_created_differently_are_refused_on_every_rank, .timeout = 120)
{
    roles(1, 2);
    run_world(mismatch_body, 100000);
}

/* ------------------------------------------------------------------ checkpoints */

#define CK_STEPS 3

static weft_ps_table_t *ck_gate;
/* A bounded sparse table: its rows are found through the direct index (PS_DIRECT_MAX_IDS). */
static weft_ps_table_t *ck_bounded;
static uint64_t ck_bounded_ids[5] = {0, 5, 17, 62, 63};

static void ck_tables(weft_ps_table_t **d, weft_ps_table_t **sp, weft_ps_table_t **h)
{
    weft_ps_table_spec_t s;
    /* BOUNDED(0): a pull at clock c waits until every worker has reached c (a barrier). */
    dense_spec(&s, "gate", 1);
    s.consistency = WEFT_PS_BOUNDED;
    s.staleness = 0;
    cr_assert_eq(weft_ps_table_create(PS, &s, 20000, &ck_gate), WEFT_OK, "%s", weft_last_error());
    dense_spec(&s, "dense", 1500);
    s.init = WEFT_PS_NORMAL;
    s.init_b = 0.1;
    s.seed = 7;
    s.optimizer = WEFT_PS_ADAM;
    s.adam.lr = 0.01;
    cr_assert_eq(weft_ps_table_create(PS, &s, 20000, d), WEFT_OK, "%s", weft_last_error());
    weft_ps_table_spec_init(&s, "sparse", WEFT_PS_SPARSE);
    s.dim = 5;
    s.init = WEFT_PS_UNIFORM;
    s.init_a = -1;
    s.init_b = 1;
    s.optimizer = WEFT_PS_ADAGRAD;
    s.admit_after = 2;
    cr_assert_eq(weft_ps_table_create(PS, &s, 20000, sp), WEFT_OK, "%s", weft_last_error());
    s.admit_after = 0;
    s.id_bound = 64;
    s.name = "bounded";
    s.optimizer = WEFT_PS_ADAM;
    s.adam.lr = 0.05;
    cr_assert_eq(weft_ps_table_create(PS, &s, 20000, &ck_bounded), WEFT_OK, "%s",
                 weft_last_error());
    dense_spec(&s, "half", 600);
    s.dtype = WEFT_BF16;
    s.init = WEFT_PS_UNIFORM;
    s.init_a = -1;
    s.init_b = 1;
    s.optimizer = WEFT_PS_SGD;
    s.sgd.momentum = 0.9;
    s.consistency = WEFT_PS_ASYNC;
    cr_assert_eq(weft_ps_table_create(PS, &s, 20000, h), WEFT_OK, "%s", weft_last_error());
}

static uint64_t ck_ids[7] = {1, 2, 3, 50, 51, 52, 1u << 30};

/* Writes the pulled values of every table to @p path (one file per worker). */
static int ck_snapshot(weft_ps_table_t *d, weft_ps_table_t *sp, weft_ps_table_t *h, float *out)
{
    weft_tensor_t *v = zeros(1500), *hv = zeros(600), *rows = NULL;
    int64_t sh[2] = {7, 5};
    weft_tensor_create(WEFT_F32, 2, sh, &rows);
    RANK_CHECK(weft_ps_pull(d, v, 20000) == WEFT_OK, "pull: %s", weft_last_error());
    RANK_CHECK(weft_ps_pull(h, hv, 20000) == WEFT_OK, "pull: %s", weft_last_error());
    RANK_CHECK(weft_ps_pull_rows(sp, ck_ids, 7, rows, 20000) == WEFT_OK, "pull: %s",
               weft_last_error());
    memcpy(out, weft_tensor_data(v), 1500 * 4);
    memcpy(out + 1500, weft_tensor_data(hv), 600 * 4);
    memcpy(out + 2100, weft_tensor_data(rows), 35 * 4);
    weft_tensor_release(rows);
    sh[0] = 5;
    weft_tensor_create(WEFT_F32, 2, sh, &rows);
    RANK_CHECK(weft_ps_pull_rows(ck_bounded, ck_bounded_ids, 5, rows, 20000) == WEFT_OK,
               "pull: %s", weft_last_error());
    memcpy(out + 2135, weft_tensor_data(rows), 25 * 4);
    weft_tensor_release(v);
    weft_tensor_release(hv);
    weft_tensor_release(rows);
    return 0;
}

#define CK_VALUES 2160

static int ck_step(weft_ps_table_t *d, weft_ps_table_t *sp, weft_ps_table_t *h, int w, int k)
{
    weft_tensor_t *g = zeros(1500), *hg = zeros(600), *rows = NULL;
    int64_t sh[2] = {4, 5};
    weft_tensor_create(WEFT_F32, 2, sh, &rows);
    float *p = weft_tensor_data(g), *hp = weft_tensor_data(hg), *r = weft_tensor_data(rows);
    for (int i = 0; i < 1500; i++) {
        p[i] = sinf((float)(i + 31 * k + 7 * w));
    }
    for (int i = 0; i < 600; i++) {
        hp[i] = 0.01f * (float)((i + k + w) % 13);
    }
    for (int i = 0; i < 20; i++) {
        r[i] = cosf((float)(i + k * 5 + w));
    }
    /* Only the first 4 ids are pushed every step: the others are pulled but never admitted. */
    RANK_CHECK(weft_ps_push(d, g, 20000) == WEFT_OK, "push: %s", weft_last_error());
    RANK_CHECK(weft_ps_push(h, hg, 20000) == WEFT_OK, "push: %s", weft_last_error());
    RANK_CHECK(weft_ps_push_rows(sp, ck_ids, 4, rows, 20000) == WEFT_OK, "push: %s",
               weft_last_error());
    /* The bounded table: 4 of its 5 ids, one of them twice (its gradients summed). */
    uint64_t bids[5] = {ck_bounded_ids[(k + w) % 5], 63, 5, ck_bounded_ids[(k + w) % 5], 0};
    int64_t bsh[2] = {5, 5};
    weft_tensor_t *brows = NULL;
    weft_tensor_create(WEFT_F32, 2, bsh, &brows);
    float *br = weft_tensor_data(brows);
    for (int i = 0; i < 25; i++) {
        br[i] = sinf((float)(3 * i + k + 11 * w));
    }
    RANK_CHECK(weft_ps_push_rows(ck_bounded, bids, 5, brows, 20000) == WEFT_OK, "push: %s",
               weft_last_error());
    weft_tensor_release(brows);
    weft_tensor_release(g);
    weft_tensor_release(hg);
    weft_tensor_release(rows);
    return weft_ps_clock(PS, 20000) == WEFT_OK ? 0 : 1;
}

/* BOUNDED(0) gate: every worker ends a step, then waits here until all have. */
static int ck_barrier(void)
{
    weft_tensor_t *g1 = zeros(1);
    RANK_CHECK(weft_ps_clock(PS, 20000) == WEFT_OK, "clock: %s", weft_last_error());
    RANK_CHECK(weft_ps_pull(ck_gate, g1, 20000) == WEFT_OK, "gate: %s", weft_last_error());
    weft_tensor_release(g1);
    return 0;
}

/* Saves, records what worker @p w pulls right after (in g_dir/expected.w<w>), then waits until
 * every worker has (the ASYNC table would move under a slower worker's snapshot). */
static int ck_save_and_record(weft_ps_table_t *d, weft_ps_table_t *sp, weft_ps_table_t *h, int w)
{
    static float vals[CK_VALUES];
    char path[512];
    RANK_CHECK(weft_ps_save(PS, g_dir, 30000) == WEFT_OK, "save: %s", weft_last_error());
    RANK_CHECK(ck_snapshot(d, sp, h, vals) == 0, "snapshot");
    snprintf(path, sizeof(path), "%s/expected.w%d", g_dir, w);
    FILE *f = fopen(path, "wb");
    RANK_CHECK(f != NULL && fwrite(vals, 4, CK_VALUES, f) == CK_VALUES && fclose(f) == 0,
               "expected values");
    return ck_barrier();
}

/* Loads, checks the clock, and that worker @p w pulls bit for bit what was recorded. */
static int ck_load_and_compare(weft_ps_table_t *d, weft_ps_table_t *sp, weft_ps_table_t *h, int w,
                               int64_t clock)
{
    static float want[CK_VALUES], got[CK_VALUES];
    char path[512];
    RANK_CHECK(weft_ps_load(PS, g_dir, 30000) == WEFT_OK, "load: %s", weft_last_error());
    RANK_CHECK(weft_ps_worker_clock(PS) == clock, "clock %lld after the load, not %lld",
               (long long)weft_ps_worker_clock(PS), (long long)clock);
    snprintf(path, sizeof(path), "%s/expected.w%d", g_dir, w);
    FILE *f = fopen(path, "rb");
    RANK_CHECK(f != NULL && fread(want, 4, CK_VALUES, f) == CK_VALUES, "expected values");
    fclose(f);
    RANK_CHECK(ck_snapshot(d, sp, h, got) == 0, "snapshot");
    for (int i = 0; i < CK_VALUES; i++) {
        RANK_CHECK(memcmp(&want[i], &got[i], 4) == 0, "value %d: %.9g restored, %.9g saved", i,
                   got[i], want[i]);
    }
    return 0;
}

/* World A: trains, saves at clock CK_STEPS, records what it pulled, trains on (the checkpoint
 * must not see that). */
static int ck_save_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    weft_ps_table_t *d, *sp, *h;
    ck_tables(&d, &sp, &h);
    if (!weft_ps_is_worker(PS)) {
        return 0;
    }
    int w = weft_ps_worker_index(PS);
    for (int k = 0; k < CK_STEPS; k++) {
        RANK_CHECK(ck_step(d, sp, h, w, k) == 0, "step %d: %s", k, weft_last_error());
    }
    RANK_CHECK(ck_save_and_record(d, sp, h, w) == 0, "save");
    for (int k = CK_STEPS; k < CK_STEPS + 2; k++) {
        RANK_CHECK(ck_step(d, sp, h, w, k) == 0, "step %d", k);
    }
    return 0;
}

/* World B (another number of servers): loads, and pulls exactly what world A pulled. */
static int ck_load_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    weft_ps_table_t *d, *sp, *h;
    ck_tables(&d, &sp, &h);
    if (!weft_ps_is_worker(PS)) {
        return 0;
    }
    int w = weft_ps_worker_index(PS);
    RANK_CHECK(ck_load_and_compare(d, sp, h, w, CK_STEPS) == 0, "load");
    /* Training goes on from there, once both have looked. */
    RANK_CHECK(ck_barrier() == 0, "barrier");
    RANK_CHECK(ck_step(d, sp, h, w, CK_STEPS) == 0, "a step after the load: %s", weft_last_error());
    return 0;
}

static void tmpdir(const char *what)
{
    snprintf(g_dir, sizeof(g_dir), "/tmp/weft-ps-%s-%d", what, (int)getpid());
    char cmd[400];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", g_dir);
    cr_assert_eq(system(cmd), 0);
}

static void rmdir_all(void)
{
    char cmd[400];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", g_dir);
    (void)system(cmd);
}

Test(ps, checkpoints_restore_bit_exact_into_one_two_and_three_servers, .timeout = 240)
{
    tmpdir("ck");
    roles(2, 2);
    run_world(ck_save_body, 100000);
    for (int ns = 1; ns <= 3; ns++) {
        roles(ns, 2);
        run_world(ck_load_body, 100000);
    }
    rmdir_all();
}

/* ------------------------------------------------------------------ a save killed half-way */

/* World A saves at clock 2, trains on, and a server dies (as if killed) while writing the save of
 * clock 4: the workers' save fails, and the checkpoint directory still loads clock 2's values. */
static int kill_save_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    weft_ps_table_t *d, *sp, *h;
    ck_tables(&d, &sp, &h);
    if (!weft_ps_is_worker(PS)) {
        weft_status_t st = weft_ps_finish(PS, 60000);
        RANK_CHECK(st == WEFT_OK || st == WEFT_ERR_PEER_LOST, "finish: %s", weft_last_error());
        return 0;
    }
    int w = weft_ps_worker_index(PS);
    for (int k = 0; k < 2; k++) {
        RANK_CHECK(ck_step(d, sp, h, w, k) == 0, "step %d: %s", k, weft_last_error());
    }
    RANK_CHECK(ck_save_and_record(d, sp, h, w) == 0, "save");
    RANK_CHECK(ck_step(d, sp, h, w, 3) == 0, "step 3: %s", weft_last_error());
    /* Clock 4: a server exits half-way through its files. */
    weft_status_t st = weft_ps_save(PS, g_dir, 30000);
    RANK_CHECK(st == WEFT_ERR_PEER_LOST, "a save whose server died: %s: %s", weft_strerror(st),
               weft_last_error());
    (void)weft_ps_finish(PS, 10000);
    return 0;
}

/* World B: clock 2's checkpoint, whole. */
static int after_kill_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    weft_ps_table_t *d, *sp, *h;
    ck_tables(&d, &sp, &h);
    if (!weft_ps_is_worker(PS)) {
        return weft_ps_finish(PS, 60000) == WEFT_OK ? 0 : 1;
    }
    int w = weft_ps_worker_index(PS);
    RANK_CHECK(ck_load_and_compare(d, sp, h, w, 2) == 0, "the values are not clock 2's");
    /* And a new save over the debris works. */
    RANK_CHECK(weft_ps_save(PS, g_dir, 30000) == WEFT_OK, "save: %s", weft_last_error());
    RANK_CHECK(weft_ps_finish(PS, 30000) == WEFT_OK, "finish: %s", weft_last_error());
    return 0;
}

Test(ps, a_server_killed_during_a_save_leaves_the_previous_checkpoint_loadable, .timeout = 240)
{
    tmpdir("kill");
    roles(2, 2);
    setenv("WEFT_PS_FAULT_SAVE_EXIT", "2", 1); /* the save at clock 4, the servers' second */
    ranks_opts_t o;
    int codes[4];
    ranks_opts_init(&o, 4, kill_save_body);
    o.setup = ps_setup;
    o.deadline_ms = 100000;
    o.handler_threads = 2;
    o.no_shutdown = 1;
    ranks_run(&o, codes);
    cr_assert(codes[0] == 9 && codes[1] == 9, "the servers exit 9 in the save: %d %d", codes[0],
              codes[1]);
    cr_assert(codes[2] == 0 && codes[3] == 0, "workers: %d %d", codes[2], codes[3]);
    unsetenv("WEFT_PS_FAULT_SAVE_EXIT");
    run_world(after_kill_body, 100000);
    rmdir_all();
}

/* Two ASYNC tables saved twice at the same clock (no clock in between, as an ASYNC job does),
 * the second save killed on the server after the first table's file is written: the first
 * checkpoint must still load, bit for bit (its files must not have been renamed over). */
#define SC_N 3000

static void sc_tables(weft_ps_table_t **t1, weft_ps_table_t **t2)
{
    weft_ps_table_spec_t s;
    dense_spec(&s, "first", SC_N);
    s.consistency = WEFT_PS_ASYNC;
    s.optimizer = WEFT_PS_SUM;
    cr_assert_eq(weft_ps_table_create(PS, &s, 20000, t1), WEFT_OK, "%s", weft_last_error());
    dense_spec(&s, "second", SC_N);
    s.consistency = WEFT_PS_ASYNC;
    s.optimizer = WEFT_PS_SUM;
    cr_assert_eq(weft_ps_table_create(PS, &s, 20000, t2), WEFT_OK, "%s", weft_last_error());
}

static int same_clock_kill_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    weft_ps_table_t *t1, *t2;
    sc_tables(&t1, &t2);
    if (!weft_ps_is_worker(PS)) {
        (void)weft_ps_finish(PS, 60000);
        return 0;
    }
    weft_tensor_t *g = filled(SC_N, 1.5f);
    RANK_CHECK(weft_ps_push(t1, g, 20000) == WEFT_OK, "push: %s", weft_last_error());
    RANK_CHECK(weft_ps_push(t2, g, 20000) == WEFT_OK, "push: %s", weft_last_error());
    RANK_CHECK(weft_ps_save(PS, g_dir, 30000) == WEFT_OK, "save: %s", weft_last_error());
    /* Other values, the same clock: the server dies writing "second", after "first". */
    RANK_CHECK(weft_ps_push(t1, g, 20000) == WEFT_OK, "push: %s", weft_last_error());
    RANK_CHECK(weft_ps_push(t2, g, 20000) == WEFT_OK, "push: %s", weft_last_error());
    weft_status_t st = weft_ps_save(PS, g_dir, 30000);
    RANK_CHECK(st == WEFT_ERR_PEER_LOST, "a save whose server died: %s: %s", weft_strerror(st),
               weft_last_error());
    weft_tensor_release(g);
    (void)weft_ps_finish(PS, 10000);
    return 0;
}

static int same_clock_load_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    weft_ps_table_t *t1, *t2;
    sc_tables(&t1, &t2);
    if (!weft_ps_is_worker(PS)) {
        return weft_ps_finish(PS, 60000) == WEFT_OK ? 0 : 1;
    }
    RANK_CHECK(weft_ps_load(PS, g_dir, 30000) == WEFT_OK, "the first checkpoint: %s",
               weft_last_error());
    weft_tensor_t *v = zeros(SC_N);
    weft_ps_table_t *ts[2] = {t1, t2};
    for (int k = 0; k < 2; k++) {
        RANK_CHECK(weft_ps_pull(ts[k], v, 20000) == WEFT_OK, "pull: %s", weft_last_error());
        const float *p = weft_tensor_data(v);
        for (int i = 0; i < SC_N; i++) {
            RANK_CHECK(p[i] == 1.5f, "table %d, element %d: %g, not the first save's 1.5", k, i,
                       (double)p[i]);
        }
    }
    weft_tensor_release(v);
    RANK_CHECK(weft_ps_finish(PS, 30000) == WEFT_OK, "finish: %s", weft_last_error());
    return 0;
}

Test(ps, a_save_killed_at_the_clock_of_the_last_leaves_that_checkpoint_loadable, .timeout = 240)
{
    tmpdir("same_clock");
    roles(1, 1);
    setenv("WEFT_PS_FAULT_SAVE_EXIT", "2", 1);
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, same_clock_kill_body);
    o.setup = ps_setup;
    o.deadline_ms = 100000;
    o.no_shutdown = 1;
    ranks_run(&o, codes);
    cr_assert(codes[0] == 9, "the server exits 9 in the second save: %d", codes[0]);
    cr_assert(codes[1] == 0, "worker: %d", codes[1]);
    unsetenv("WEFT_PS_FAULT_SAVE_EXIT");
    run_world(same_clock_load_body, 100000);
    rmdir_all();
}

/* A checkpoint loaded into a job with a SYNC table it does not have: that table keeps its values
 * and its steps go on from the checkpoint's clock, as the loaded table's do. */
static void nt_table(const char *name, weft_ps_table_t **t)
{
    weft_ps_table_spec_t s;
    dense_spec(&s, name, 64);
    s.consistency = WEFT_PS_SYNC;
    s.optimizer = WEFT_PS_SUM;
    cr_assert_eq(weft_ps_table_create(PS, &s, 20000, t), WEFT_OK, "%s", weft_last_error());
}

/* One SYNC step of SUM on @p t: push @p g, clock, pull; the value must be @p want everywhere. */
static int nt_step(weft_ps_table_t *t, float g, float want)
{
    weft_tensor_t *gt = filled(64, g), *v = zeros(64);
    RANK_CHECK(weft_ps_push(t, gt, 20000) == WEFT_OK, "push: %s", weft_last_error());
    RANK_CHECK(weft_ps_clock(PS, 20000) == WEFT_OK, "clock: %s", weft_last_error());
    RANK_CHECK(weft_ps_pull(t, v, 20000) == WEFT_OK, "pull at clock %lld: %s",
               (long long)weft_ps_worker_clock(PS), weft_last_error());
    RANK_CHECK(((float *)weft_tensor_data(v))[63] == want, "%g, not %g",
               (double)((float *)weft_tensor_data(v))[63], (double)want);
    weft_tensor_release(gt);
    weft_tensor_release(v);
    return 0;
}

static int nt_save_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    weft_ps_table_t *t;
    nt_table("saved", &t);
    if (!weft_ps_is_worker(PS)) {
        return weft_ps_finish(PS, 60000) == WEFT_OK ? 0 : 1;
    }
    for (int k = 0; k < 3; k++) {
        RANK_CHECK(nt_step(t, 2.0f, 2.0f) == 0, "step %d", k); /* a SYNC SUM's value: the sum */
    }
    RANK_CHECK(weft_ps_save(PS, g_dir, 30000) == WEFT_OK, "save: %s", weft_last_error());
    RANK_CHECK(weft_ps_finish(PS, 30000) == WEFT_OK, "finish: %s", weft_last_error());
    return 0;
}

static int nt_load_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    weft_ps_table_t *t, *fresh;
    nt_table("saved", &t);
    nt_table("fresh", &fresh);
    if (!weft_ps_is_worker(PS)) {
        return weft_ps_finish(PS, 60000) == WEFT_OK ? 0 : 1;
    }
    RANK_CHECK(weft_ps_load(PS, g_dir, 30000) == WEFT_OK, "load: %s", weft_last_error());
    RANK_CHECK(weft_ps_worker_clock(PS) == 3, "clock %lld after the load",
               (long long)weft_ps_worker_clock(PS));
    RANK_CHECK(nt_step(fresh, 5.0f, 5.0f) == 0, "a step of the table the checkpoint lacks");
    RANK_CHECK(nt_step(t, 1.0f, 1.0f) == 0, "a step of the loaded table");
    RANK_CHECK(weft_ps_finish(PS, 30000) == WEFT_OK, "finish: %s", weft_last_error());
    return 0;
}

Test(ps, a_table_a_checkpoint_lacks_steps_on_from_its_clock, .timeout = 120)
{
    tmpdir("new_table");
    roles(1, 1);
    run_world(nt_save_body, 60000);
    run_world(nt_load_body, 60000);
    rmdir_all();
}

/* Worker 0 dies after the servers wrote their files and before the MANIFEST: the other worker's
 * save must not say OK (the checkpoint does not exist); it fails with PEER_LOST saying so. And a
 * save that a lost worker can never join fails at once for the others. */
static int commit_lost_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    weft_ps_table_t *d, *sp, *h;
    ck_tables(&d, &sp, &h);
    if (!weft_ps_is_worker(PS)) {
        weft_status_t st = weft_ps_finish(PS, 60000);
        RANK_CHECK(st == WEFT_ERR_PEER_LOST, "finish: %s", weft_last_error());
        return 0;
    }
    int w = weft_ps_worker_index(PS);
    for (int k = 0; k < 2; k++) {
        RANK_CHECK(ck_step(d, sp, h, w, k) == 0, "step %d: %s", k, weft_last_error());
    }
    weft_status_t st = weft_ps_save(PS, g_dir, 60000); /* worker 0 exits 8 in it */
    RANK_CHECK(st == WEFT_ERR_PEER_LOST &&
                   strstr(weft_last_error(), "was lost before it did") != NULL,
               "worker %d: a save whose MANIFEST never came: %s: %s", w, weft_strerror(st),
               weft_last_error());
    char path[400];
    snprintf(path, sizeof(path), "%s/MANIFEST", g_dir);
    RANK_CHECK(access(path, F_OK) != 0, "a MANIFEST exists");
    /* The next save cannot complete either: worker 0 will never join it. */
    st = weft_ps_save(PS, g_dir, 60000);
    RANK_CHECK(st == WEFT_ERR_PEER_LOST && strstr(weft_last_error(), "worker 0") != NULL,
               "a save without worker 0: %s: %s", weft_strerror(st), weft_last_error());
    (void)weft_ps_finish(PS, 10000);
    return 0;
}

Test(ps, a_save_is_ok_only_once_its_manifest_exists, .timeout = 240)
{
    tmpdir("commit");
    roles(2, 2);
    setenv("WEFT_PS_FAULT_COMMIT_EXIT", "2", 1);
    ranks_opts_t o;
    int codes[4];
    ranks_opts_init(&o, 4, commit_lost_body);
    o.setup = ps_setup;
    o.deadline_ms = 100000;
    o.handler_threads = 2;
    o.no_shutdown = 1;
    ranks_run(&o, codes);
    unsetenv("WEFT_PS_FAULT_COMMIT_EXIT");
    cr_expect(codes[2] == 8, "worker 0 exits 8 before its MANIFEST: %d", codes[2]);
    cr_expect(codes[0] == 0 && codes[1] == 0 && codes[3] == 0, "servers %d %d, worker 1 %d",
              codes[0], codes[1], codes[3]);
    rmdir_all();
}

/* ------------------------------------------------------------------ lost peers */

static void die(weft_call_t *call, void *arg)
{
    (void)call, (void)arg;
    _exit(7);
}

static void die_setup(weft_agent_t *a, int rank, void *arg)
{
    weft_rpc_register(a, "die", die, NULL);
    ps_setup(a, rank, arg);
}

/* Servers are ranks 1 and 2, workers 0 and 3; rank 2 dies after two steps. Both workers' next
 * operations fail with PEER_LOST naming the table and the server, long before their deadlines. */
static int lost_server_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world, (void)arg;
    weft_ps_table_spec_t s;
    weft_ps_table_t *t;
    dense_spec(&s, "w", 2000);
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &t) == WEFT_OK, "create: %s", weft_last_error());
    if (!weft_ps_is_worker(PS)) {
        weft_status_t st = weft_ps_finish(PS, 60000);
        RANK_CHECK(st == WEFT_OK, "finish on rank %d: %s", rank, weft_last_error());
        return 0;
    }
    weft_tensor_t *v = zeros(2000), *g = filled(2000, 1.0f);
    for (int k = 0; k < 2; k++) {
        RANK_CHECK(weft_ps_pull(t, v, 60000) == WEFT_OK, "pull: %s", weft_last_error());
        RANK_CHECK(weft_ps_push(t, g, 60000) == WEFT_OK, "push: %s", weft_last_error());
        RANK_CHECK(weft_ps_clock(PS, 60000) == WEFT_OK, "clock: %s", weft_last_error());
    }
    if (rank == 0) {
        /* This pull at clock 2 waits for step 1: rank 3 has ended its two steps too. */
        RANK_CHECK(weft_ps_pull(t, v, 60000) == WEFT_OK, "pull: %s", weft_last_error());
        weft_future_t *f = NULL;
        RANK_CHECK(weft_rpc_async(a, 2, "die", NULL, 60000, &f) == WEFT_OK, "die");
        weft_future_wait(f, 60000);
        weft_future_release(f);
    }
    weft_status_t st = WEFT_OK;
    bool clocking = false; /* a clock names the server; a push or pull names the table too */
    for (int k = 2; k < 100 && st == WEFT_OK; k++) {
        st = weft_ps_pull(t, v, 60000);
        if (st == WEFT_OK) {
            st = weft_ps_push(t, g, 60000);
        }
        if (st == WEFT_OK) {
            clocking = true;
            st = weft_ps_clock(PS, 60000);
            clocking = st == WEFT_OK ? false : clocking;
        }
    }
    RANK_CHECK(st == WEFT_ERR_PEER_LOST &&
                   (clocking || strstr(weft_last_error(), "table 'w'") != NULL) &&
                   strstr(weft_last_error(), "rank 2") != NULL,
               "rank %d: %s: %s", rank, weft_strerror(st), weft_last_error());
    /* Every later operation fails at once, the same way. */
    RANK_CHECK(weft_ps_pull(t, v, 60000) == WEFT_ERR_PEER_LOST, "after: %s", weft_last_error());
    weft_tensor_release(v);
    weft_tensor_release(g);
    RANK_CHECK(weft_ps_finish(PS, 20000) == WEFT_ERR_PEER_LOST, "finish: %s", weft_last_error());
    return 0;
}

Test(ps, a_lost_server_fails_every_workers_operations_naming_the_table, .timeout = 120)
{
    g_ns = 2, g_nw = 2;
    g_servers[0] = 1, g_servers[1] = 2;
    g_workers[0] = 0, g_workers[1] = 3;
    ranks_opts_t o;
    int codes[4];
    ranks_opts_init(&o, 4, lost_server_body);
    o.setup = die_setup;
    o.deadline_ms = 100000;
    o.handler_threads = 2;
    o.no_shutdown = 1;
    ranks_run(&o, codes);
    cr_assert(codes[0] == 0 && codes[1] == 0 && codes[3] == 0 && codes[2] == 7, "codes %d %d %d %d",
              codes[0], codes[1], codes[2], codes[3]);
}

/* SYNC with a worker that dies after a step: the other worker's next step fails with PEER_LOST
 * naming the lost worker (never a hang), and the server's finish reports it. */
/* @p arg: the table's consistency (NULL: SYNC); BOUNDED with a staleness of 1. */
static int lost_worker_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)world;
    weft_ps_table_spec_t s;
    weft_ps_table_t *t;
    weft_ps_consistency_t mode = arg != NULL ? *(const weft_ps_consistency_t *)arg : WEFT_PS_SYNC;
    dense_spec(&s, "w", 500);
    s.consistency = mode;
    s.staleness = 1;
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &t) == WEFT_OK, "create: %s", weft_last_error());
    if (!weft_ps_is_worker(PS)) {
        weft_status_t st = weft_ps_finish(PS, 60000);
        RANK_CHECK(st == WEFT_ERR_PEER_LOST && strstr(weft_last_error(), "rank 2") != NULL,
                   "finish: %s: %s", weft_strerror(st), weft_last_error());
        return 0;
    }
    weft_tensor_t *v = zeros(500), *g = filled(500, 1.0f);
    RANK_CHECK(weft_ps_pull(t, v, 60000) == WEFT_OK, "pull: %s", weft_last_error());
    RANK_CHECK(weft_ps_push(t, g, 60000) == WEFT_OK, "push: %s", weft_last_error());
    RANK_CHECK(weft_ps_clock(PS, 60000) == WEFT_OK, "clock: %s", weft_last_error());
    if (rank == 2) {
        /* Dies once the other worker has ended step 0: SYNC, its pull at clock 1 waits for
         * that; BOUNDED(1), its pull at clock 2 does (ASYNC waits for nothing, and needs
         * nothing: the other goes on). */
        if (mode == WEFT_PS_BOUNDED) {
            RANK_CHECK(weft_ps_clock(PS, 60000) == WEFT_OK, "clock: %s", weft_last_error());
        }
        RANK_CHECK(weft_ps_pull(t, v, 60000) == WEFT_OK, "pull: %s", weft_last_error());
        _exit(5);
    }
    weft_status_t st = WEFT_OK;
    for (int k = 1; k < 100 && st == WEFT_OK; k++) {
        st = weft_ps_pull(t, v, 60000);
        if (st == WEFT_OK) {
            st = weft_ps_push(t, g, 60000);
        }
        if (st == WEFT_OK) {
            st = weft_ps_clock(PS, 60000);
        }
    }
    if (mode == WEFT_PS_ASYNC) {
        /* ASYNC goes on without it. */
        RANK_CHECK(st == WEFT_OK, "an ASYNC table after a lost worker: %s: %s", weft_strerror(st),
                   weft_last_error());
    } else {
        RANK_CHECK(st == WEFT_ERR_PEER_LOST &&
                       strstr(weft_last_error(), "worker 1 (rank 2)") != NULL,
                   "%s: %s", weft_strerror(st), weft_last_error());
    }
    RANK_CHECK(weft_ps_finish(PS, 20000) == WEFT_OK, "finish: %s", weft_last_error());
    weft_tensor_release(v);
    weft_tensor_release(g);
    return 0;
}

static void lost_worker_world(weft_ps_consistency_t mode)
{
    roles(1, 2);
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, lost_worker_body);
    o.setup = ps_setup;
    o.deadline_ms = 100000;
    o.handler_threads = 2;
    o.no_shutdown = 1;
    o.arg = &mode;
    ranks_run(&o, codes);
    cr_assert(codes[0] == 0 && codes[1] == 0 && codes[2] == 5, "codes %d %d %d", codes[0], codes[1],
              codes[2]);
}

Test(ps, a_lost_worker_fails_the_sync_step_for_the_others, .timeout = 120)
{
    lost_worker_world(WEFT_PS_SYNC);
}

Test(ps, a_lost_worker_fails_a_bounded_table_for_the_others, .timeout = 120)
{
    lost_worker_world(WEFT_PS_BOUNDED);
}

Test(ps, an_async_table_goes_on_without_a_lost_worker, .timeout = 120)
{
    lost_worker_world(WEFT_PS_ASYNC);
}

/* ------------------------------------------------------------------ pulls never torn */

#define TORN_N     (4 * 16384)
#define TORN_ITERS 60

/* ASYNC SUM: worker 0 adds 1 everywhere again and again while worker 1 pulls: a pull sends the
 * value's bytes without copying them, so a push that comes meanwhile must write a copy. Every
 * chunk of every pull is uniform (one value throughout), never half old and half new. */
static int torn_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    weft_ps_table_spec_t s;
    weft_ps_table_t *t, *gate;
    dense_spec(&s, "v", TORN_N);
    s.chunk_bytes = 65536;
    s.optimizer = WEFT_PS_SUM;
    s.consistency = WEFT_PS_ASYNC;
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &t) == WEFT_OK, "create: %s", weft_last_error());
    dense_spec(&s, "gate", 1);
    s.consistency = WEFT_PS_BOUNDED;
    s.staleness = 0;
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &gate) == WEFT_OK, "create: %s",
               weft_last_error());
    if (!weft_ps_is_worker(PS)) {
        return weft_ps_finish(PS, 60000) == WEFT_OK ? 0 : 1;
    }
    int w = weft_ps_worker_index(PS);
    weft_tensor_t *g = filled(TORN_N, 1.0f);
    weft_tensor_t *v[4];
    for (int i = 0; i < 4; i++) {
        v[i] = zeros(TORN_N);
    }
    for (int it = 0; it < TORN_ITERS; it++) {
        if (w == 0) {
            RANK_CHECK(weft_ps_push(t, g, 20000) == WEFT_OK, "push: %s", weft_last_error());
            continue;
        }
        weft_future_t *fs[4];
        for (int i = 0; i < 4; i++) {
            RANK_CHECK(weft_ps_pull_async(t, v[i], 20000, &fs[i]) == WEFT_OK, "pull");
        }
        RANK_CHECK(weft_future_wait_all(fs, 4, 20000) == WEFT_OK, "pulls: %s",
                   weft_future_error(fs[0]));
        for (int i = 0; i < 4; i++) {
            weft_future_release(fs[i]);
            const float *p = weft_tensor_data(v[i]);
            for (int64_t c = 0; c < TORN_N; c += 16384) {
                for (int64_t j = 1; j < 16384; j++) {
                    RANK_CHECK(p[c + j] == p[c], "a torn pull: %g then %g in chunk %lld", p[c],
                               p[c + j], (long long)(c / 16384));
                }
            }
        }
    }
    weft_tensor_t *one = zeros(1);
    RANK_CHECK(weft_ps_clock(PS, 20000) == WEFT_OK, "clock");
    RANK_CHECK(weft_ps_pull(gate, one, 20000) == WEFT_OK, "gate: %s", weft_last_error());
    RANK_CHECK(weft_ps_pull(t, v[0], 20000) == WEFT_OK, "pull");
    RANK_CHECK(((float *)weft_tensor_data(v[0]))[TORN_N - 1] == (float)TORN_ITERS, "final %g",
               ((float *)weft_tensor_data(v[0]))[TORN_N - 1]);
    for (int i = 0; i < 4; i++) {
        weft_tensor_release(v[i]);
    }
    weft_tensor_release(g);
    weft_tensor_release(one);
    RANK_CHECK(weft_ps_finish(PS, 20000) == WEFT_OK, "finish: %s", weft_last_error());
    return 0;
}

Test(ps, pulls_are_never_torn_by_concurrent_pushes, .timeout = 120)
{
    roles(1, 2);
    run_world(torn_body, 100000);
}

/* ------------------------------------------------------------------ large tables */

#define BIG_N (3 * 1048576) /* 12 MiB of f32: three requests of 4 MiB per operation */

/* A table larger than one request: its chunks travel in several requests in flight; every step
 * still sees exactly the mean of both workers' pushes, everywhere. */
static int big_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a, (void)rank, (void)world, (void)arg;
    weft_ps_table_spec_t s;
    weft_ps_table_t *t;
    dense_spec(&s, "big", BIG_N);
    s.chunk_bytes = 1 << 20;
    s.init = WEFT_PS_CONSTANT;
    s.init_a = 1.0;
    s.sgd.lr = 1.0;
    RANK_CHECK(weft_ps_table_create(PS, &s, 20000, &t) == WEFT_OK, "create: %s", weft_last_error());
    if (!weft_ps_is_worker(PS)) {
        return weft_ps_finish(PS, 60000) == WEFT_OK ? 0 : 1;
    }
    int w = weft_ps_worker_index(PS);
    weft_tensor_t *v = zeros(BIG_N);
    for (int k = 0; k < 3; k++) {
        RANK_CHECK(weft_ps_pull(t, v, 30000) == WEFT_OK, "pull: %s", weft_last_error());
        float want = 1.0f - 1.5f * (float)(k * (k + 1) / 2);
        const float *p = weft_tensor_data(v);
        for (int64_t i = 0; i < BIG_N; i++) {
            RANK_CHECK(p[i] == want, "step %d: element %lld is %g, not %g", k, (long long)i, p[i],
                       want);
        }
        weft_tensor_t *g = filled(BIG_N, (float)((w + 1) * (k + 1)));
        RANK_CHECK(weft_ps_push(t, g, 30000) == WEFT_OK, "push: %s", weft_last_error());
        weft_tensor_release(g);
        RANK_CHECK(weft_ps_clock(PS, 30000) == WEFT_OK, "clock: %s", weft_last_error());
    }
    /* The pull at clock 3 waits for step 2: then every push of both workers is counted. */
    RANK_CHECK(weft_ps_pull(t, v, 30000) == WEFT_OK, "pull: %s", weft_last_error());
    weft_ps_load_t load;
    RANK_CHECK(weft_ps_table_stats(t, &load, 20000) == WEFT_OK, "stats");
    /* Three requests per push and per pull. */
    RANK_CHECK(load.pushes == 2 * 3 * 3, "%llu pushes counted, not 18",
               (unsigned long long)load.pushes);
    weft_tensor_release(v);
    RANK_CHECK(weft_ps_finish(PS, 30000) == WEFT_OK, "finish: %s", weft_last_error());
    return 0;
}

Test(ps, tables_larger_than_a_request_travel_in_several, .timeout = 120)
{
    roles(1, 2);
    run_world(big_body, 100000);
}
