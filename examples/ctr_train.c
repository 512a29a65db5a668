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
#include <getopt.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <weft/weft.h>

#include "criteo.h"

#define PROG                "ctr_train"
#define MAX_LAYERS          8
#define MAX_PARAMS          (2 * MAX_LAYERS)
#define N_PULLS             (CRITEO_SPARSE + MAX_PARAMS)
#define SHUTDOWN_TIMEOUT_MS 30000
#define EXIT_USAGE          2
#define EVAL_CHUNK          8192
#define EMB_INIT            0.01
#define EMB_ACC             3e-5 /* Adagrad's initial accumulator for a batch of EMB_ACC_BATCH */
#define EMB_ACC_BATCH       1024
#define CHUNK_BYTES         (64 * 1024)

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
    int n_hidden;
    int64_t hidden[MAX_LAYERS];
    uint64_t seed;
    const char *data;
    weft_ps_consistency_t mode;
    int64_t staleness;
    int staleness_set;
    int json;
    int threads;
} config_t;

static const char *mode_name(weft_ps_consistency_t mode)
{
    return mode == WEFT_PS_SYNC ? "sync" : mode == WEFT_PS_ASYNC ? "async" : "bounded";
}

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

static int parse_hidden(const char *s, config_t *cfg)
{
    char buf[256];
    char *save = NULL;
    int n = 0;

    if (strlen(s) >= sizeof(buf)) {
        return -1;
    }
    strcpy(buf, s);
    for (char *tok = strtok_r(buf, ",", &save); tok != NULL; tok = strtok_r(NULL, ",", &save)) {
        if (n == MAX_LAYERS - 1 || criteo_parse_int(tok, 1, 1 << 16, &cfg->hidden[n]) != 0) {
            return -1;
        }
        n++;
    }
    if (n == 0) {
        return -1;
    }
    cfg->n_hidden = n;
    return 0;
}

static int parse_mode(const char *s, weft_ps_consistency_t *mode_p)
{
    if (strcmp(s, "sync") == 0) {
        *mode_p = WEFT_PS_SYNC;
    } else if (strcmp(s, "async") == 0) {
        *mode_p = WEFT_PS_ASYNC;
    } else if (strcmp(s, "bounded") == 0) {
        *mode_p = WEFT_PS_BOUNDED;
    } else {
        return -1;
    }
    return 0;
}

/* Returns 0, 1 after --help, or EXIT_USAGE after a message. */
static int parse_args(int argc, char **argv, config_t *cfg)
{
    static const struct option longopts[] = {
        {"epochs", required_argument, NULL, 'e'},  {"batch", required_argument, NULL, 'b'},
        {"lr", required_argument, NULL, 'l'},      {"emb-lr", required_argument, NULL, 'E'},
        {"dim", required_argument, NULL, 'D'},     {"rows", required_argument, NULL, 'R'},
        {"hidden", required_argument, NULL, 'H'},  {"samples", required_argument, NULL, 'n'},
        {"values", required_argument, NULL, 'V'},  {"zipf", required_argument, NULL, 'z'},
        {"seed", required_argument, NULL, 's'},    {"data", required_argument, NULL, 'd'},
        {"mode", required_argument, NULL, 'M'},    {"staleness", required_argument, NULL, 'A'},
        {"threads", required_argument, NULL, 'T'}, {"json", no_argument, NULL, 'j'},
        {"help", no_argument, NULL, 'h'},          {NULL, 0, NULL, 0},
    };
    int64_t iv = 0;
    int index = 0;
    int c;

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
    cfg->n_hidden = 2;
    cfg->hidden[0] = 64;
    cfg->hidden[1] = 32;
    cfg->seed = 1;
    cfg->mode = WEFT_PS_SYNC;
    cfg->staleness = 2;
    cfg->threads = 1;

    while ((c = getopt_long(argc, argv, "h", longopts, &index)) != -1) {
        int bad = 0;
        switch (c) {
        case 'e':
            bad = criteo_parse_int(optarg, 1, 100000, &iv);
            cfg->epochs = (int)iv;
            break;
        case 'b':
            bad = criteo_parse_int(optarg, 1, 1 << 22, &cfg->batch);
            break;
        case 'l':
            bad = criteo_parse_double(optarg, 0.0, 1e6, &cfg->lr);
            break;
        case 'E':
            bad = criteo_parse_double(optarg, 0.0, 1e6, &cfg->emb_lr);
            break;
        case 'D':
            bad = criteo_parse_int(optarg, 1, 4096, &cfg->dim);
            break;
        case 'R':
            bad = criteo_parse_int(optarg, 2, UINT32_MAX, &cfg->rows);
            break;
        case 'H':
            bad = parse_hidden(optarg, cfg);
            break;
        case 'n':
            bad = criteo_parse_int(optarg, 2, 1LL << 31, &cfg->samples);
            break;
        case 'V':
            bad = criteo_parse_int(optarg, 1, 1 << 20, &cfg->values);
            break;
        case 'z':
            bad = criteo_parse_double(optarg, 0.0, 10.0, &cfg->zipf);
            break;
        case 's':
            bad = criteo_parse_int(optarg, 0, INT64_MAX, &iv);
            cfg->seed = (uint64_t)iv;
            break;
        case 'd':
            cfg->data = optarg;
            break;
        case 'M':
            bad = parse_mode(optarg, &cfg->mode);
            break;
        case 'A':
            bad = criteo_parse_int(optarg, 0, 1000000, &cfg->staleness);
            cfg->staleness_set = 1;
            break;
        case 'T':
            bad = criteo_parse_int(optarg, 1, 256, &iv);
            cfg->threads = (int)iv;
            break;
        case 'j':
            cfg->json = 1;
            break;
        case 'h':
            usage(stdout);
            return 1;
        default:
            usage(stderr);
            return EXIT_USAGE;
        }
        if (bad != 0) {
            fprintf(stderr, PROG ": bad value '%s' for --%s\n", optarg, longopts[index].name);
            usage(stderr);
            return EXIT_USAGE;
        }
    }
    if (optind != argc) {
        fprintf(stderr, PROG ": unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return EXIT_USAGE;
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
    int64_t sizes[MAX_LAYERS + 1];
    weft_ps_table_t *emb[CRITEO_SPARSE]; /* owned by the PS */
    int n_dense;
    char names[MAX_PARAMS][32];
    weft_ps_table_t *dense[MAX_PARAMS];
} tables_t;

static void fail(const char *what, weft_status_t st)
{
    fprintf(stderr, PROG ": %s: %s: %s\n", what, weft_status_name(st), weft_last_error());
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
    weft_status_t st;

    memset(tb, 0, sizeof(*tb));
    tb->n_sizes = cfg->n_hidden + 2;
    tb->sizes[0] = CRITEO_DENSE + CRITEO_SPARSE * cfg->dim;
    for (int l = 0; l < cfg->n_hidden; l++) {
        tb->sizes[l + 1] = cfg->hidden[l];
    }
    tb->sizes[tb->n_sizes - 1] = 1;
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
        st = weft_ps_table_create(ps, &spec, 0, &tb->emb[f]);
        if (st != WEFT_OK) {
            fprintf(stderr, PROG ": table %s: %s: %s\n", name, weft_status_name(st),
                    weft_last_error());
            return -1;
        }
    }
    for (int i = 0; i < tb->n_dense; i++) {
        int l = i / 2;
        double bound = 1.0 / sqrt((double)tb->sizes[l]);

        snprintf(tb->names[i], sizeof(tb->names[i]), "fc%d.%s", l + 1,
                 i % 2 == 0 ? "weight" : "bias");
        snprintf(name, sizeof(name), "mlp.%s", tb->names[i]);
        weft_ps_table_spec_init(&spec, name, WEFT_PS_DENSE);
        table_common(cfg, &spec);
        if (i % 2 == 0) {
            spec.ndim = 2;
            spec.shape[0] = tb->sizes[l + 1];
            spec.shape[1] = tb->sizes[l];
        } else {
            spec.ndim = 1;
            spec.shape[0] = tb->sizes[l + 1];
        }
        spec.init = WEFT_PS_UNIFORM; /* torch's nn.Linear: uniform(+-1/sqrt(fan_in)) */
        spec.init_a = -bound;
        spec.init_b = bound;
        spec.optimizer = WEFT_PS_ADAM;
        spec.adam.lr = cfg->lr;
        spec.chunk_bytes = CHUNK_BYTES;
        st = weft_ps_table_create(ps, &spec, 0, &tb->dense[i]);
        if (st != WEFT_OK) {
            fprintf(stderr, PROG ": table %s: %s: %s\n", name, weft_status_name(st),
                    weft_last_error());
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ futures */

/* Waits for @p n futures and releases them; on a failure prints the first failed one's error. */
static int wait_all(weft_future_t **fs, int n, const char *what)
{
    weft_status_t st = n > 0 ? weft_future_wait_all(fs, (size_t)n, 0) : WEFT_OK;
    int rc = 0;

    for (int i = 0; i < n; i++) {
        weft_status_t fst = weft_future_status(fs[i]);

        if (rc == 0 && fst != WEFT_OK) {
            fprintf(stderr, PROG ": %s: %s: %s\n", what, weft_status_name(fst),
                    weft_future_error(fs[i]));
            rc = -1;
        }
        weft_future_release(fs[i]);
    }
    if (st != WEFT_OK && rc == 0) {
        fprintf(stderr, PROG ": %s: %s\n", what, weft_status_name(st));
        rc = -1;
    }
    return rc;
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
    weft_rng_t rng;
    weft_status_t st;

    memset(m, 0, sizeof(*m));
    weft_rng_init(&rng, cfg->seed, 0);
    st = weft_nn_mlp_create(tb->n_sizes, tb->sizes, NULL, &rng, &m->mlp);
    if (st != WEFT_OK) {
        return st;
    }
    m->params = weft_nn_mlp_params(m->mlp);
    m->n = weft_param_list_size(m->params);
    for (int i = 0; i < m->n; i++) {
        if (i >= tb->n_dense || strcmp(weft_param_list_name(m->params, i), tb->names[i]) != 0) {
            fprintf(stderr, PROG ": parameter %d is %s, its table %s\n", i,
                    weft_param_list_name(m->params, i), i < tb->n_dense ? tb->names[i] : "none");
            weft_nn_mlp_free(m->mlp);
            return WEFT_ERR_INVALID_STATE;
        }
    }
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

static double now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

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

/* This epoch's order of the training samples: a seeded permutation, the same on every worker. */
static void epoch_perm(uint64_t seed, int epoch, int64_t n, int64_t *perm)
{
    weft_rng_t rng;

    weft_rng_init(&rng, seed, 1000 + (uint64_t)epoch);
    for (int64_t i = 0; i < n; i++) {
        perm[i] = i;
    }
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)weft_rng_below(&rng, (uint64_t)i + 1);
        int64_t t = perm[i];

        perm[i] = perm[j];
        perm[j] = t;
    }
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
    double t_start = now_s();
    double train_time = 0;
    double ll = NAN, au = NAN, ceil_ll = NAN, ceil_auc = NAN, train_loss = NAN;
    int64_t samples = 0;
    weft_status_t st;
    int rc = 1;

    if (perm == NULL || idx == NULL) {
        fprintf(stderr, PROG ": out of memory\n");
        free(perm);
        free(idx);
        return 1;
    }
    st = model_init(&m, cfg, job->tb);
    if (st != WEFT_OK) {
        fail("model", st);
        free(perm);
        free(idx);
        return 1;
    }
    if (lead) {
        printf("CTR model: 26 sparse tables (dim %lld, %lld rows, Adagrad lr %g), MLP %lld",
               (long long)cfg->dim, (long long)cfg->rows, cfg->emb_lr,
               (long long)job->tb->sizes[0]);
        for (int l = 1; l < job->tb->n_sizes; l++) {
            printf("-%lld", (long long)job->tb->sizes[l]);
        }
        printf(" (Adam lr %g); %zu servers, %d workers, batch %lld, %s", cfg->lr,
               weft_ps_num_servers(job->ps), job->nw, (long long)job->batch, mode_name(cfg->mode));
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

        epoch_perm(cfg->seed, epoch, job->n_train, perm);
        for (int64_t s = 0; s < job->steps; s++) {
            const int64_t *b = perm + s * job->batch;
            double t0 = now_s();
            double loss = 0;
            int64_t k = 0;

            for (int64_t i = job->w; i < job->batch; i += job->nw) {
                idx[k++] = b[i];
            }
            if (step(job, &m, idx, k, &loss) != 0) {
                goto out;
            }
            loss_sum += loss;
            t_epoch += now_s() - t0;
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
               (long long)weft_ps_worker_clock(job->ps), now_s() - t_start);
        if (cfg->json) {
            printf("{\"system\":\"weft-ps\",\"example\":\"ctr_train\",\"mode\":\"%s\","
                   "\"servers\":%zu,\"workers\":%d,\"batch\":%lld,\"dim\":%lld,\"epochs\":%d,"
                   "\"steps\":%lld,\"train_samples\":%lld,\"eval_samples\":%lld",
                   mode_name(cfg->mode), weft_ps_num_servers(job->ps), job->nw,
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
    weft_agent_opts_t opts;
    weft_ps_opts_t ps_opts;
    weft_agent_t *a = NULL;
    weft_ps_t *ps = NULL;
    tables_t tb;
    job_t job;
    weft_status_t st;
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

    weft_agent_opts_init(&opts);
    opts.handler_threads = 2; /* a server answers pushes while pulls wait for a step */
    st = weft_agent_create(&opts, &a);
    if (st == WEFT_OK) {
        /* Before the join: the servers' function must exist when the first request comes. */
        weft_ps_opts_init(&ps_opts); /* roles from WEFT_PS_SERVERS (weftrun --servers) */
        st = weft_ps_create(a, &ps_opts, &ps);
    }
    if (st == WEFT_OK) {
        st = weft_agent_join(a);
    }
    if (st != WEFT_OK) {
        fail("cannot start the parameter server", st);
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
            double t0 = now_s();

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
                       (long long)cfg.values, (double)pos / (double)set.n, now_s() - t0);
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
    /* Servers serve until every worker is done; workers say they are. */
    st = weft_ps_finish(ps, 0);
    if (st != WEFT_OK) {
        fail("finish", st);
        rc = rc != 0 ? rc : 1;
    }

out_shutdown:
    st = weft_agent_shutdown(a, SHUTDOWN_TIMEOUT_MS);
    if (st != WEFT_OK) {
        fail("shutdown", st);
        rc = rc != 0 ? rc : 1;
    }
out:
    weft_agent_free(a);
    criteo_free(&set);
    return rc;
}
