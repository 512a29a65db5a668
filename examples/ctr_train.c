/*
 * ctr_train: a click-through-rate model with large sparse embedding tables on weft's parameter
 * server, the workload parameter-server users run (DLRM-style: 13 dense and 26 categorical
 * features, Criteo's shape).
 *
 *   weftrun -n 4 --servers 2 build/examples/ctr_train [--mode sync|async|bounded]
 *           [--epochs 2] [--batch 1024] [--samples 1000000] [--data FILE.tsv] ...  (--help)
 *
 * Ranks 0..S-1 serve (weftrun --servers S sets WEFT_PS_SERVERS), the others work. Every rank
 * creates, in the same order, the tables:
 *   - emb.C1 .. emb.C26: one sparse table per categorical feature, rows of --dim (16) floats
 *     addressed by ids below --rows (1M, the id_bound); a row is made on first use by the
 *     table's seeded initializer (uniform in [-0.01, 0.01)); the servers apply Adagrad
 *     (--emb-lr) to the rows' gradients, its accumulator starting at 3e-5 (for a batch of 1024;
 *     it scales with 1 / batch^2, as the gradients of a mean loss do), a prior that keeps the
 *     rows of ids seen a few times from fitting those few labels (with 0, a second epoch
 *     overfits: the held-out AUC falls);
 *   - mlp.fc1.weight, mlp.fc1.bias, ...: the MLP (13 + 26 * dim -> --hidden 64,32 -> 1, ReLU
 *     between layers) in dense tables of 64 KiB chunks spread over the servers, initialised by
 *     the tables' own seeded initializer to uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)), which is
 *     torch's nn.Linear distribution (the parameter server has no "set": a push is always a
 *     gradient, so the initial values can only come from the table's initializer); the servers
 *     apply Adam (--lr) to them.
 *
 * Data (every worker holds it all; criteo.c describes both sources): by default a synthetic set
 * of --samples samples drawn from a planted logistic model with Zipf-distributed ids (seeded:
 * --seed), else --data FILE, a Criteo TSV file (each rank reads it, so that a missing or empty
 * file ends every rank before any waits for another; the servers drop it). The last 10% of the
 * samples are held out. The synthetic defaults (1M samples, 2 epochs, Zipf 1.2 over 10000 values
 * per feature) are set so that the model comes within 0.02 of the planted AUC in about a minute on
 * two cores: the frequent ids are seen thousands of times, while about an eighth of the id
 * occurrences are of ids seen fewer than 100 times, whose weights no learner can estimate well;
 * they make most of the gap that remains.
 *
 * Each step covers --batch samples of the epoch's shuffle (the same seeded permutation on every
 * worker; the remainder of an epoch that does not fill a batch is dropped, so every worker runs
 * the same number of steps, as sync mode needs). Worker w of W takes the batch's positions w,
 * w + W, ... and:
 *   1. de-duplicates the ids of each feature (the unique ids, and each sample's position among
 *      them);
 *   2. pulls the rows of the unique ids from all 26 tables and the MLP's dense tables, every
 *      pull in flight at once (weft_future_wait_all);
 *   3. builds the forward with weft's autograd: each feature's pulled rows are a leaf tensor
 *      that requires grad, gathered per sample by position (weft_op_embedding), concatenated
 *      with the dense features, through the MLP to one logit per sample, and the mean binary
 *      cross-entropy with logits (max(z, 0) + log(1 + exp(-|z|)) - y z, from elementwise ops);
 *   4. runs backward and pushes each feature's row gradients ([n_unique, dim], to the same ids)
 *      and the MLP's gradients, all in flight at once; then ends the step (weft_ps_clock).
 * --mode sets the tables' consistency: sync (the servers apply the mean of the workers' step),
 * async (each push applied on arrival) or bounded (stale synchronous, --staleness steps).
 *
 * After each epoch the first worker pulls the rows of the held-out samples' ids and the MLP and
 * prints the held-out logloss and AUC (exact: scores sorted, ties given their mean rank), and for
 * synthetic data the planted model's own AUC on the same samples: the ceiling. The training
 * clock (samples/s) stops during evaluation. --json prints one JSON line at the end.
 *
 * Exit status: 0 on success, 2 for bad options or data that cannot be read, 1 for any other
 * failure.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <weft/weft.h>

#include "common.h"
#include "criteo.h"

#define PROG          "ctr_train"
#define MAX_PARAMS    (2 * EX_MAX_LAYERS)
#define N_PULLS       (CRITEO_SPARSE + MAX_PARAMS)
#define EXIT_USAGE    EX_EXIT_USAGE
#define EVAL_CHUNK    8192
#define EMB_INIT      0.01
#define EMB_ACC       3e-5 /* Adagrad's initial accumulator for a batch of EMB_ACC_BATCH */
#define EMB_ACC_BATCH 1024
#define CHUNK_BYTES   (64 * 1024)

/* ---------------------------------------------------------- configuration */

typedef struct {
    int epochs;
    int64_t batch; /* global: the workers share it */
    double lr;     /* the MLP's Adam */
    double emb_lr; /* the embeddings' Adagrad */
    int64_t dim;
    int64_t rows; /* id_bound of every sparse table */
    int64_t samples;
    int64_t values; /* synthetic: distinct values per feature */
    double zipf;    /* synthetic: Zipf exponent */
    ex_sizes_t hidden;
    uint64_t seed;
    const char *data;
    weft_ps_consistency_t mode;
    int64_t staleness;
    int staleness_set;
    int json;
    int threads;
} config_t;

static void usage(FILE *out)
{
    fprintf(out, "usage: weftrun -n N --servers S ctr_train [options]\n"
                 "  --mode M        sync, async or bounded (default sync)\n"
                 "  --staleness S   bounded mode: steps a worker may run ahead (default 2)\n"
                 "  --epochs N      passes over the training split (default 2)\n"
                 "  --batch N       samples per step, over all workers (default 1024)\n"
                 "  --lr X          Adam learning rate of the MLP (default 0.002)\n"
                 "  --emb-lr X      Adagrad learning rate of the embeddings (default 0.05)\n"
                 "  --dim N         embedding dimension (default 16)\n"
                 "  --rows N        rows per embedding table, the id bound (default 1000000)\n"
                 "  --hidden N,...  hidden layer sizes of the MLP (default 64,32)\n"
                 "  --samples N     synthetic samples, 10%% held out (default 1000000)\n"
                 "  --values N      synthetic: distinct values per feature (default 10000)\n"
                 "  --zipf X        synthetic: Zipf exponent of the ids (default 1.2)\n"
                 "  --seed N        data, initialisation and shuffling seed (default 1)\n"
                 "  --data FILE     Criteo TSV file instead of synthetic data\n"
                 "  --threads N     BLAS threads per worker (default 1)\n"
                 "  --json          print a JSON summary line at the end (first worker)\n");
}

/* Returns 0, 1 after --help, or EXIT_USAGE after a message. */
static int parse_args(int argc, char **argv, config_t *cfg)
{
    const ex_opt_t opts[] = {
        EX_INT("epochs", &cfg->epochs, 1, 100000),
        EX_I64("batch", &cfg->batch, 1, 1 << 22),
        EX_DOUBLE("lr", &cfg->lr, 0.0, 1e6),
        EX_DOUBLE("emb-lr", &cfg->emb_lr, 0.0, 1e6),
        EX_I64("dim", &cfg->dim, 1, 4096),
        EX_I64("rows", &cfg->rows, 2, UINT32_MAX),
        EX_SIZES("hidden", &cfg->hidden),
        EX_I64("samples", &cfg->samples, 2, 1LL << 31),
        EX_I64("values", &cfg->values, 1, 1 << 20),
        EX_DOUBLE("zipf", &cfg->zipf, 0.0, 10.0),
        EX_U64("seed", &cfg->seed, 0, INT64_MAX),
        EX_STR("data", &cfg->data),
        EX_MODE("mode", &cfg->mode),
        {"staleness", EX_OPT_I64, &cfg->staleness, 0, 1000000, 0, 0, &cfg->staleness_set},
        EX_INT("threads", &cfg->threads, 1, 256),
        EX_FLAG("json", &cfg->json),
    };
    int rc;

    memset(cfg, 0, sizeof(*cfg));
    cfg->epochs = 2;
    cfg->batch = 1024;
    cfg->lr = 0.002;
    cfg->emb_lr = 0.05;
    cfg->dim = 16;
    cfg->rows = 1000000;
    cfg->samples = 1000000;
    cfg->values = 10000;
    cfg->zipf = 1.2;
    cfg->hidden.n = 2;
    cfg->hidden.v[0] = 64;
    cfg->hidden.v[1] = 32;
    cfg->seed = 1;
    cfg->mode = WEFT_PS_SYNC;
    cfg->staleness = 2;
    cfg->threads = 1;
    rc = ex_parse_opts(PROG, argc, argv, opts, sizeof(opts) / sizeof(opts[0]), usage);
    if (rc != 0) {
        return rc;
    }
    if (cfg->staleness_set && cfg->mode != WEFT_PS_BOUNDED) {
        fprintf(stderr, PROG ": --staleness is for --mode bounded\n");
        return EXIT_USAGE;
    }
    return 0;
}

/* ------------------------------------------------------------------ tables */

typedef struct {
    int n_sizes;
    int64_t sizes[EX_MAX_LAYERS + 1];
    weft_ps_table_t *emb[CRITEO_SPARSE]; /* owned by the PS */
    int n_dense;
    char names[MAX_PARAMS][32];
    weft_ps_table_t *dense[MAX_PARAMS];
} tables_t;

static void fail(const char *what, weft_status_t st)
{
    ex_fail(PROG, what, st);
}

/* Adagrad's initial accumulator for the rows: a prior that keeps a row seen a few times from
 * moving far on those few samples (with 0, a row's first step is lr in every coordinate, whatever
 * the gradient). Gradients are of a mean over the batch, so it scales with 1 / batch^2. */
static double emb_accumulator(const config_t *cfg)
{
    double r = (double)EMB_ACC_BATCH / (double)cfg->batch;

    return EMB_ACC * r * r;
}

static void table_common(const config_t *cfg, weft_ps_table_spec_t *spec)
{
    spec->seed = cfg->seed;
    spec->consistency = cfg->mode;
    spec->staleness = cfg->mode == WEFT_PS_BOUNDED ? cfg->staleness : 0;
}

/* Every rank, in the same order: the 26 sparse tables, then the MLP's weight and bias tables. */
static int tables_create(weft_ps_t *ps, const config_t *cfg, tables_t *tb)
{
    char name[32];
    weft_ps_table_spec_t spec;

    memset(tb, 0, sizeof(*tb));
    tb->n_sizes = ex_mlp_sizes(&cfg->hidden, CRITEO_DENSE + CRITEO_SPARSE * cfg->dim, 1, tb->sizes);
    tb->n_dense = 2 * (tb->n_sizes - 1);

    for (int f = 0; f < CRITEO_SPARSE; f++) {
        snprintf(name, sizeof(name), "emb.C%d", f + 1);
        weft_ps_table_spec_init(&spec, name, WEFT_PS_SPARSE);
        table_common(cfg, &spec);
        spec.dim = cfg->dim;
        spec.id_bound = (uint64_t)cfg->rows;
        spec.init = WEFT_PS_UNIFORM;
        spec.init_a = -EMB_INIT;
        spec.init_b = EMB_INIT;
        spec.optimizer = WEFT_PS_ADAGRAD;
        spec.adagrad.lr = cfg->emb_lr;
        spec.adagrad.initial_accumulator_value = emb_accumulator(cfg);
        if (ex_ps_table_create(PROG, ps, &spec, &tb->emb[f]) != 0) {
            return -1;
        }
    }
    for (int i = 0; i < tb->n_dense; i++) {
        ex_linear_name(i, tb->names[i], sizeof(tb->names[i]));
        snprintf(name, sizeof(name), "mlp.%s", tb->names[i]);
        ex_ps_linear_spec(tb->sizes, i, name, &spec);
        table_common(cfg, &spec);
        spec.optimizer = WEFT_PS_ADAM;
        spec.adam.lr = cfg->lr;
        spec.chunk_bytes = CHUNK_BYTES;
        if (ex_ps_table_create(PROG, ps, &spec, &tb->dense[i]) != 0) {
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ futures */

static int wait_all(weft_future_t **fs, int n, const char *what)
{
    return ex_wait_all(PROG, fs, n, what);
}

/* ------------------------------------------------------------------ lookups */

/* The embedding rows one forward needs: per feature, the unique ids of the samples, each
 * sample's position among them (i64 [k]), and the pulled rows ([n_unique, dim]). */
typedef struct {
    int64_t k;
    uint64_t *keys; /* [k] scratch */
    uint64_t *ids[CRITEO_SPARSE];
    size_t n[CRITEO_SPARSE];
    weft_tensor_t *pos[CRITEO_SPARSE];
    weft_tensor_t *rows[CRITEO_SPARSE];
} lookup_t;

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a;
    uint64_t y = *(const uint64_t *)b;

    return x < y ? -1 : x > y;
}

static void lookup_free(lookup_t *lk)
{
    for (int f = 0; f < CRITEO_SPARSE; f++) {
        free(lk->ids[f]);
        weft_tensor_release(lk->pos[f]);
        weft_tensor_release(lk->rows[f]);
    }
    free(lk->keys);
    memset(lk, 0, sizeof(*lk));
}

/* De-duplicates the ids of samples idx[0..k) of @p set, feature by feature (sorting
 * (id << 32 | position) keys), and makes the row tensors to pull into. */
static weft_status_t lookup_prepare(const criteo_set_t *set, const int64_t *idx, int64_t k,
                                    int64_t dim, lookup_t *lk)
{
    weft_status_t st = WEFT_OK;

    memset(lk, 0, sizeof(*lk));
    lk->k = k;
    lk->keys = malloc((size_t)k * sizeof(*lk->keys));
    if (lk->keys == NULL) {
        return WEFT_ERR_NO_MEMORY;
    }
    for (int f = 0; st == WEFT_OK && f < CRITEO_SPARSE; f++) {
        int64_t *pos;
        int64_t shape[2] = {0, dim};
        size_t n = 0;

        for (int64_t i = 0; i < k; i++) {
            lk->keys[i] = (uint64_t)set->cat[idx[i] * CRITEO_SPARSE + f] << 32 | (uint64_t)i;
        }
        qsort(lk->keys, (size_t)k, sizeof(*lk->keys), cmp_u64);
        lk->ids[f] = malloc((size_t)k * sizeof(*lk->ids[f]));
        if (lk->ids[f] == NULL) {
            st = WEFT_ERR_NO_MEMORY;
            break;
        }
        st = weft_tensor_empty(WEFT_I64, 1, &k, &lk->pos[f]);
        if (st != WEFT_OK) {
            break;
        }
        pos = weft_tensor_data(lk->pos[f]);
        for (int64_t i = 0; i < k; i++) {
            uint64_t id = lk->keys[i] >> 32;

            if (n == 0 || lk->ids[f][n - 1] != id) {
                lk->ids[f][n++] = id;
            }
            pos[lk->keys[i] & 0xffffffffu] = (int64_t)n - 1;
        }
        lk->n[f] = n;
        shape[0] = (int64_t)n;
        st = weft_tensor_empty(WEFT_F32, 2, shape, &lk->rows[f]);
    }
    if (st != WEFT_OK) {
        lookup_free(lk);
    }
    return st;
}

/* ------------------------------------------------------------------ model */

typedef struct {
    weft_nn_mlp_t *mlp;
    const weft_param_list_t *params; /* borrowed from the MLP */
    int n;
} model_t;

/* The worker's MLP, whose parameters the pulls overwrite. */
static weft_status_t model_init(model_t *m, const config_t *cfg, const tables_t *tb)
{
    weft_status_t st;

    memset(m, 0, sizeof(*m));
    st = ex_mlp_for_tables(PROG, tb->n_sizes, tb->sizes, cfg->seed, &m->mlp);
    if (st != WEFT_OK) {
        return st;
    }
    m->params = weft_nn_mlp_params(m->mlp);
    m->n = weft_param_list_size(m->params);
    return WEFT_OK;
}

/* Issues the pulls of @p lk's rows and, with @p m, of the MLP's tables; waits for all. */
static int pull_all(const tables_t *tb, lookup_t *lk, const model_t *m)
{
    weft_future_t *fs[N_PULLS];
    int n = 0;
    weft_status_t st = WEFT_OK;

    for (int f = 0; lk != NULL && f < CRITEO_SPARSE; f++) {
        st = weft_ps_pull_rows_async(tb->emb[f], lk->ids[f], lk->n[f], lk->rows[f], 0, &fs[n]);
        if (st != WEFT_OK) {
            break;
        }
        n++;
    }
    for (int i = 0; st == WEFT_OK && m != NULL && i < m->n; i++) {
        st = weft_ps_pull_async(tb->dense[i], weft_param_list_get(m->params, i), 0, &fs[n]);
        if (st == WEFT_OK) {
            n++;
        }
    }
    if (st != WEFT_OK) {
        fail("pull", st);
        wait_all(fs, n, "pull");
        return -1;
    }
    return wait_all(fs, n, "pull");
}

/* Logits [k, 1] of samples idx[0..k) from the pulled rows of @p lk. */
static weft_status_t forward(const model_t *m, const criteo_set_t *set, const int64_t *idx,
                             const lookup_t *lk, weft_tensor_t **z_p)
{
    weft_tensor_t *parts[1 + CRITEO_SPARSE] = {NULL};
    int64_t shape[2] = {lk->k, CRITEO_DENSE};
    weft_tensor_t *x = NULL;
    weft_status_t st;

    st = weft_tensor_empty(WEFT_F32, 2, shape, &parts[0]);
    if (st == WEFT_OK) {
        float *d = weft_tensor_data(parts[0]);

        for (int64_t i = 0; i < lk->k; i++) {
            memcpy(d + i * CRITEO_DENSE, set->dense + idx[i] * CRITEO_DENSE,
                   CRITEO_DENSE * sizeof(float));
        }
    }
    for (int f = 0; st == WEFT_OK && f < CRITEO_SPARSE; f++) {
        st = weft_op_embedding(lk->rows[f], lk->pos[f], 0, &parts[1 + f]);
    }
    if (st == WEFT_OK) {
        st = weft_op_concat(1 + CRITEO_SPARSE, parts, 1, &x);
    }
    if (st == WEFT_OK) {
        st = weft_nn_mlp_forward(m->mlp, x, z_p);
    }
    weft_tensor_release(x);
    for (int i = 0; i < 1 + CRITEO_SPARSE; i++) {
        weft_tensor_release(parts[i]);
    }
    return st;
}

/* The mean binary cross-entropy of logits @p z against labels @p y (both [k, 1]), in the stable
 * form max(z, 0) + log(1 + exp(-|z|)) - y z. */
static weft_status_t bce_with_logits(weft_tensor_t *z, weft_tensor_t *y, weft_tensor_t **loss_p)
{
    weft_tensor_t *t[10] = {NULL};
    weft_status_t st;

    st = weft_op_relu(z, &t[0]); /* max(z, 0) */
    if (st == WEFT_OK) {
        st = weft_op_neg(z, &t[1]);
    }
    if (st == WEFT_OK) {
        st = weft_op_relu(t[1], &t[2]); /* max(-z, 0) */
    }
    if (st == WEFT_OK) {
        st = weft_op_add(t[0], t[2], &t[3]); /* |z| */
    }
    if (st == WEFT_OK) {
        st = weft_op_neg(t[3], &t[4]);
    }
    if (st == WEFT_OK) {
        st = weft_op_exp(t[4], &t[5]);
    }
    if (st == WEFT_OK) {
        st = weft_op_add_scalar(t[5], 1.0, &t[6]);
    }
    if (st == WEFT_OK) {
        st = weft_op_log(t[6], &t[7]);
    }
    if (st == WEFT_OK) {
        st = weft_op_add(t[0], t[7], &t[8]); /* softplus(z) */
    }
    if (st == WEFT_OK) {
        st = weft_op_mul(y, z, &t[9]);
    }
    if (st == WEFT_OK) {
        weft_tensor_t *per = NULL;

        st = weft_op_sub(t[8], t[9], &per);
        if (st == WEFT_OK) {
            st = weft_op_mean(per, 0, NULL, 0, loss_p);
        }
        weft_tensor_release(per);
    }
    for (int i = 0; i < 10; i++) {
        weft_tensor_release(t[i]);
    }
    return st;
}

/* ------------------------------------------------------------------ metrics */

typedef struct {
    float score;
    uint8_t label;
} scored_t;

static int cmp_score(const void *a, const void *b)
{
    float x = ((const scored_t *)a)->score;
    float y = ((const scored_t *)b)->score;

    return x < y ? -1 : x > y;
}

/* The exact AUC (Mann-Whitney: tied scores get their mean rank); NAN without both classes.
 * Sorts @p s. */
static double auc(scored_t *s, int64_t n)
{
    double rank_sum = 0;
    int64_t pos = 0;

    qsort(s, (size_t)n, sizeof(*s), cmp_score);
    for (int64_t i = 0; i < n;) {
        int64_t j = i;
        int64_t p = 0;

        while (j < n && s[j].score == s[i].score) {
            p += s[j].label;
            j++;
        }
        rank_sum += (double)p * 0.5 * (double)(i + 1 + j); /* ranks i+1 .. j */
        pos += p;
        i = j;
    }
    if (pos == 0 || pos == n) {
        return NAN;
    }
    return (rank_sum - 0.5 * (double)pos * (double)(pos + 1)) / ((double)pos * (double)(n - pos));
}

/* The binary cross-entropy of logit @p z for label @p y. */
static double bce(double z, int y)
{
    return fmax(z, 0.0) + log1p(exp(-fabs(z))) - (y ? z : 0.0);
}

/* --------------------------------------------------------------------- train */

typedef struct {
    const config_t *cfg;
    weft_ps_t *ps;
    tables_t *tb;
    const criteo_set_t *set;
    int w;  /* worker index */
    int nw; /* workers */
    int64_t n_train;
    int64_t n_eval; /* samples n_train .. n_train + n_eval - 1 */
    int64_t batch;  /* global, <= n_train */
    int64_t steps;  /* per epoch */
} job_t;

/* The held-out logloss and AUC of the model on the servers now. */
static int evaluate(const job_t *job, const model_t *m, double *logloss_p, double *auc_p)
{
    scored_t *s = malloc((size_t)job->n_eval * sizeof(*s));
    int64_t *idx = malloc(EVAL_CHUNK * sizeof(*idx));
    double loss = 0;
    int prev = weft_grad_set_enabled(0);
    int rc = -1;

    if (s == NULL || idx == NULL) {
        fprintf(stderr, PROG ": out of memory\n");
        goto out;
    }
    if (pull_all(job->tb, NULL, m) != 0) {
        goto out;
    }
    for (int64_t start = 0; start < job->n_eval; start += EVAL_CHUNK) {
        int64_t k = job->n_eval - start < EVAL_CHUNK ? job->n_eval - start : EVAL_CHUNK;
        lookup_t lk;
        weft_tensor_t *z = NULL;
        weft_status_t st;

        for (int64_t i = 0; i < k; i++) {
            idx[i] = job->n_train + start + i;
        }
        st = lookup_prepare(job->set, idx, k, job->cfg->dim, &lk);
        if (st != WEFT_OK) {
            fail("evaluate", st);
            goto out;
        }
        if (pull_all(job->tb, &lk, NULL) != 0) {
            lookup_free(&lk);
            goto out;
        }
        st = forward(m, job->set, idx, &lk, &z);
        lookup_free(&lk);
        if (st != WEFT_OK) {
            fail("evaluate", st);
            goto out;
        }
        for (int64_t i = 0; i < k; i++) {
            float zi = ((const float *)weft_tensor_data(z))[i];
            uint8_t y = job->set->label[idx[i]];

            s[start + i].score = zi;
            s[start + i].label = y;
            loss += bce(zi, y);
        }
        weft_tensor_release(z);
    }
    *logloss_p = loss / (double)job->n_eval;
    *auc_p = auc(s, job->n_eval);
    rc = 0;
out:
    weft_grad_set_enabled(prev);
    free(idx);
    free(s);
    return rc;
}

/* The planted model's held-out logloss and AUC (synthetic data), else NAN. */
static void ceiling(const job_t *job, double *logloss_p, double *auc_p)
{
    scored_t *s;
    double loss = 0;

    *logloss_p = NAN;
    *auc_p = NAN;
    if (job->set->logit == NULL || (s = malloc((size_t)job->n_eval * sizeof(*s))) == NULL) {
        return;
    }
    for (int64_t i = 0; i < job->n_eval; i++) {
        int64_t j = job->n_train + i;

        s[i].score = job->set->logit[j];
        s[i].label = job->set->label[j];
        loss += bce(job->set->logit[j], job->set->label[j]);
    }
    *logloss_p = loss / (double)job->n_eval;
    *auc_p = auc(s, job->n_eval);
    free(s);
}

/* One step on samples idx[0..k): pull, forward, backward, push; *loss_p gets the mean loss. */
static int step(const job_t *job, const model_t *m, const int64_t *idx, int64_t k, double *loss_p)
{
    int64_t yshape[2] = {k, 1};
    weft_future_t *fs[N_PULLS];
    int nf = 0;
    lookup_t lk;
    weft_tensor_t *y = NULL;
    weft_tensor_t *z = NULL;
    weft_tensor_t *loss = NULL;
    weft_status_t st;
    int rc = -1;

    st = lookup_prepare(job->set, idx, k, job->cfg->dim, &lk);
    if (st != WEFT_OK) {
        fail("step", st);
        return -1;
    }
    if (pull_all(job->tb, &lk, m) != 0) {
        goto out;
    }
    for (int f = 0; st == WEFT_OK && f < CRITEO_SPARSE; f++) {
        st = weft_tensor_set_requires_grad(lk.rows[f], 1);
    }
    if (st == WEFT_OK) {
        st = weft_tensor_empty(WEFT_F32, 2, yshape, &y);
    }
    if (st == WEFT_OK) {
        for (int64_t i = 0; i < k; i++) {
            ((float *)weft_tensor_data(y))[i] = job->set->label[idx[i]];
        }
        st = forward(m, job->set, idx, &lk, &z);
    }
    if (st == WEFT_OK) {
        st = bce_with_logits(z, y, &loss);
    }
    if (st == WEFT_OK) {
        *loss_p = ((const float *)weft_tensor_data(loss))[0];
        st = weft_backward(loss, NULL, 0);
    }
    if (st != WEFT_OK) {
        fail("step", st);
        goto out;
    }
    for (int f = 0; st == WEFT_OK && f < CRITEO_SPARSE; f++) {
        weft_tensor_t *g = weft_tensor_grad(lk.rows[f]);

        if (g != NULL) {
            st = weft_ps_push_rows_async(job->tb->emb[f], lk.ids[f], lk.n[f], g, 0, &fs[nf]);
            nf += st == WEFT_OK;
        }
    }
    for (int i = 0; st == WEFT_OK && i < m->n; i++) {
        weft_tensor_t *g = weft_tensor_grad(weft_param_list_get(m->params, i));

        if (g != NULL) {
            st = weft_ps_push_async(job->tb->dense[i], g, 0, &fs[nf]);
            nf += st == WEFT_OK;
        }
    }
    if (st != WEFT_OK) {
        fail("push", st);
        wait_all(fs, nf, "push");
        goto out;
    }
    if (wait_all(fs, nf, "push") != 0) {
        goto out;
    }
    st = weft_ps_clock(job->ps, 0);
    if (st != WEFT_OK) {
        fail("clock", st);
        goto out;
    }
    rc = 0;
out:
    weft_param_list_zero_grad(m->params);
    weft_tensor_release(loss);
    weft_tensor_release(z);
    weft_tensor_release(y);
    lookup_free(&lk);
    return rc;
}

static void json_num(const char *name, double v, const char *fmt)
{
    printf(",\"%s\":", name);
    if (isfinite(v)) {
        printf(fmt, v);
    } else {
        printf("null");
    }
}

static int train(const job_t *job)
{
    const config_t *cfg = job->cfg;
    const int lead = job->w == 0;
    int64_t *perm = malloc((size_t)job->n_train * sizeof(*perm));
    int64_t *idx = malloc((size_t)(job->batch / job->nw + 1) * sizeof(*idx));
    model_t m;
    double t_start = ex_now();
    double train_time = 0;
    double ll = NAN, au = NAN, ceil_ll = NAN, ceil_auc = NAN, train_loss = NAN;
    int64_t samples = 0;
    weft_status_t st;
    int rc = 1;

    memset(&m, 0, sizeof(m));
    if (perm == NULL || idx == NULL) {
        fprintf(stderr, PROG ": out of memory\n");
        goto out;
    }
    st = model_init(&m, cfg, job->tb);
    if (st != WEFT_OK) {
        fail("model", st);
        goto out;
    }
    if (lead) {
        printf("CTR model: 26 sparse tables (dim %lld, %lld rows, Adagrad lr %g), ",
               (long long)cfg->dim, (long long)cfg->rows, cfg->emb_lr);
        ex_print_mlp(job->tb->n_sizes, job->tb->sizes);
        printf(" (Adam lr %g); %zu servers, %d workers, batch %lld, %s", cfg->lr,
               weft_ps_num_servers(job->ps), job->nw, (long long)job->batch,
               ex_mode_name(cfg->mode));
        if (cfg->mode == WEFT_PS_BOUNDED) {
            printf(" (staleness %lld)", (long long)cfg->staleness);
        }
        printf("; %lld train / %lld held-out samples, %lld steps per epoch\n",
               (long long)job->n_train, (long long)job->n_eval, (long long)job->steps);
        ceiling(job, &ceil_ll, &ceil_auc);
        if (isfinite(ceil_auc)) {
            printf("planted model on the held-out split: logloss %.4f, AUC %.4f (the ceiling)\n",
                   ceil_ll, ceil_auc);
        }
    }
    for (int epoch = 0; epoch < cfg->epochs; epoch++) {
        double t_epoch = 0;
        double loss_sum = 0;

        ex_epoch_perm(cfg->seed, epoch, job->n_train, perm);
        for (int64_t s = 0; s < job->steps; s++) {
            const int64_t *b = perm + s * job->batch;
            double t0 = ex_now();
            double loss = 0;
            int64_t k = 0;

            for (int64_t i = job->w; i < job->batch; i += job->nw) {
                idx[k++] = b[i];
            }
            if (step(job, &m, idx, k, &loss) != 0) {
                goto out;
            }
            loss_sum += loss;
            t_epoch += ex_now() - t0;
            samples += job->batch;
        }
        train_time += t_epoch;
        train_loss = loss_sum / (double)job->steps;
        if (lead) {
            if (evaluate(job, &m, &ll, &au) != 0) {
                goto out;
            }
            printf("epoch %d/%d: train logloss %.4f, held-out logloss %.4f AUC %.4f", epoch + 1,
                   cfg->epochs, train_loss, ll, au);
            if (isfinite(ceil_auc)) {
                printf(" (ceiling %.4f)", ceil_auc);
            }
            printf(", %.1f s, %.0f samples/s\n", t_epoch,
                   train_time > 0 ? (double)samples / train_time : 0.0);
        }
    }
    if (lead) {
        double rate = train_time > 0 ? (double)samples / train_time : 0.0;

        printf("final: held-out AUC %.4f", au);
        if (isfinite(ceil_auc)) {
            printf(", ceiling %.4f (gap %.4f)", ceil_auc, ceil_auc - au);
        }
        printf(", logloss %.4f, %.0f samples/s, %lld steps, %.1f s\n", ll, rate,
               (long long)weft_ps_worker_clock(job->ps), ex_now() - t_start);
        if (cfg->json) {
            printf("{\"system\":\"weft-ps\",\"example\":\"ctr_train\",\"mode\":\"%s\","
                   "\"servers\":%zu,\"workers\":%d,\"batch\":%lld,\"dim\":%lld,\"epochs\":%d,"
                   "\"steps\":%lld,\"train_samples\":%lld,\"eval_samples\":%lld",
                   ex_mode_name(cfg->mode), weft_ps_num_servers(job->ps), job->nw,
                   (long long)job->batch, (long long)cfg->dim, cfg->epochs,
                   (long long)weft_ps_worker_clock(job->ps), (long long)job->n_train,
                   (long long)job->n_eval);
            json_num("auc", au, "%.5f");
            json_num("logloss", ll, "%.5f");
            json_num("ceiling", ceil_auc, "%.5f");
            json_num("ceiling_logloss", ceil_ll, "%.5f");
            json_num("train_logloss", train_loss, "%.5f");
            json_num("samples_per_s", rate, "%.1f");
            printf("}\n");
        }
    }
    rc = 0;
out:
    weft_nn_mlp_free(m.mlp);
    free(perm);
    free(idx);
    return rc;
}

/* ----------------------------------------------------------------- main */

int main(int argc, char **argv)
{
    config_t cfg;
    criteo_set_t set = {0};
    weft_agent_t *a = NULL;
    weft_ps_t *ps = NULL;
    tables_t tb;
    job_t job;
    int rc;

    setvbuf(stdout, NULL, _IOLBF, 0);
    rc = parse_args(argc, argv, &cfg);
    if (rc != 0) {
        return rc == 1 ? 0 : rc;
    }
    weft_op_set_threads(cfg.threads);
    /* A file is read on every rank: one that cannot be read ends the run before any rank waits
     * for another. */
    if (cfg.data != NULL && criteo_load(PROG, cfg.data, (uint64_t)cfg.rows, &set) != 0) {
        return EXIT_USAGE;
    }

    if (ex_ps_start(PROG, &a, &ps) != 0) {
        rc = 1;
        goto out;
    }
    rc = 1;
    if (tables_create(ps, &cfg, &tb) != 0) {
        goto out_shutdown;
    }
    rc = 0;
    if (weft_ps_is_worker(ps)) {
        memset(&job, 0, sizeof(job));
        job.cfg = &cfg;
        job.ps = ps;
        job.tb = &tb;
        job.set = &set;
        job.w = weft_ps_worker_index(ps);
        job.nw = (int)weft_ps_num_workers(ps);
        if (cfg.data == NULL) {
            criteo_synth_opts_t so;
            double t0 = ex_now();

            criteo_synth_opts_init(&so, cfg.samples, (uint64_t)cfg.rows, cfg.seed);
            so.values = cfg.values;
            so.zipf_s = cfg.zipf;
            if (criteo_synth(&so, &set) != 0) {
                fprintf(stderr, PROG ": cannot generate %lld samples: out of memory\n",
                        (long long)cfg.samples);
                rc = 1;
            } else if (job.w == 0) {
                int64_t pos = 0;

                for (int64_t i = 0; i < set.n; i++) {
                    pos += set.label[i];
                }
                printf("synthetic Criteo-like data: %lld samples (seed %llu, Zipf %g over %lld "
                       "values per feature, click rate %.3f), made in %.1f s\n",
                       (long long)set.n, (unsigned long long)cfg.seed, cfg.zipf,
                       (long long)cfg.values, (double)pos / (double)set.n, ex_now() - t0);
            }
        } else if (job.w == 0) {
            printf("loaded %lld samples (%lld skipped) from %s\n", (long long)set.n,
                   (long long)set.skipped, cfg.data);
        }
        if (rc == 0) {
            job.n_eval = set.n / 10 > 0 ? set.n / 10 : 1;
            job.n_train = set.n - job.n_eval;
            job.batch = cfg.batch < job.n_train ? cfg.batch : job.n_train;
            job.steps = job.batch > 0 ? job.n_train / job.batch : 0;
            if (job.batch < job.nw) {
                fprintf(stderr, PROG ": %lld training samples for %d workers\n",
                        (long long)job.n_train, job.nw);
                rc = EXIT_USAGE;
            } else {
                rc = train(&job);
            }
        }
    }
    criteo_free(&set);
    rc = ex_ps_finish(PROG, ps, rc);

out_shutdown:
    rc = ex_agent_shutdown(PROG, a, rc);
out:
    weft_agent_free(a);
    criteo_free(&set);
    return rc;
}
