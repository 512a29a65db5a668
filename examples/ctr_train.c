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

#define PROG        "ctr_train"
#define MAX_PARAMS  (2 * EX_MAX_LAYERS)
#define N_PULLS     (CRITEO_SPARSE + MAX_PARAMS)
#define EXIT_USAGE  EX_EXIT_USAGE
#define CHUNK_BYTES (64 * 1024)

/* ---------------------------------------------------------- configuration */

typedef criteo_cfg_t config_t;

static void usage(FILE *out)
{
    fprintf(out, "usage: weftrun -n N --servers S ctr_train [options]\n");
    criteo_cfg_usage(out);
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

/* Every rank, in the same order: the 26 sparse tables, then the MLP's weight and bias tables. */
static int tables_create(weft_ps_t *ps, const config_t *cfg, tables_t *tb)
{
    char name[32];
    weft_ps_table_spec_t spec;

    memset(tb, 0, sizeof(*tb));
    tb->n_sizes = ex_mlp_sizes(&cfg->hidden, CRITEO_DENSE + CRITEO_SPARSE * cfg->dim, 1, tb->sizes);
    tb->n_dense = 2 * (tb->n_sizes - 1);

    if (criteo_emb_tables_create(PROG, ps, cfg, tb->emb) != 0) {
        return -1;
    }
    for (int i = 0; i < tb->n_dense; i++) {
        ex_linear_name(i, tb->names[i], sizeof(tb->names[i]));
        snprintf(name, sizeof(name), "mlp.%s", tb->names[i]);
        ex_ps_linear_spec(tb->sizes, i, name, &spec);
        criteo_table_common(cfg, &spec);
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

/* Issues the pulls of @p lk's rows (with @p lk) and, with @p m, of the MLP's tables; waits for
 * all. */
static int pull_all(const tables_t *tb, criteo_lookup_t *lk, const model_t *m)
{
    weft_future_t *fs[N_PULLS];
    int n = 0;
    weft_status_t st = WEFT_OK;

    if (lk != NULL) {
        st = criteo_lookup_pull(tb->emb, lk, fs, &n);
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
    if (pull_all(job->tb, NULL, m) != 0) {
        return -1;
    }
    return criteo_evaluate(PROG, job->set, job->n_train, job->n_eval, job->tb->emb, m->mlp,
                           job->cfg->dim, logloss_p, auc_p);
}

/* One step on samples idx[0..k): pull, forward, backward, push; *loss_p gets the mean loss. */
static int step(const job_t *job, const model_t *m, const int64_t *idx, int64_t k, double *loss_p)
{
    weft_future_t *fs[N_PULLS];
    int nf = 0;
    criteo_lookup_t lk;
    weft_tensor_t *loss = NULL;
    weft_status_t st;
    int rc = -1;

    st = criteo_lookup_prepare(job->set, idx, k, job->cfg->dim, &lk);
    if (st != WEFT_OK) {
        fail("step", st);
        return -1;
    }
    if (pull_all(job->tb, &lk, m) != 0) {
        goto out;
    }
    st = criteo_loss(m->mlp, job->set, idx, &lk, &loss);
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
    if (ex_ps_end_step(PROG, job->ps, fs, nf) != 0) {
        goto out;
    }
    rc = 0;
out:
    weft_param_list_zero_grad(m->params);
    weft_tensor_release(loss);
    criteo_lookup_free(&lk);
    return rc;
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
        criteo_ceiling(job->set, job->n_train, job->n_eval, &ceil_ll, &ceil_auc);
        criteo_print_ceiling(ceil_ll, ceil_auc);
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
            criteo_print_epoch(epoch, cfg->epochs, train_loss, ll, au, ceil_auc, t_epoch,
                               train_time > 0 ? (double)samples / train_time : 0.0);
        }
    }
    if (lead) {
        double rate = train_time > 0 ? (double)samples / train_time : 0.0;

        criteo_print_final(au, ceil_auc, ll, rate, weft_ps_worker_clock(job->ps),
                           ex_now() - t_start);
        if (cfg->json) {
            printf("{\"system\":\"weft-ps\",\"example\":\"ctr_train\",\"mode\":\"%s\","
                   "\"servers\":%zu,\"workers\":%d,\"batch\":%lld,\"dim\":%lld,\"epochs\":%d,"
                   "\"steps\":%lld,\"train_samples\":%lld,\"eval_samples\":%lld",
                   ex_mode_name(cfg->mode), weft_ps_num_servers(job->ps), job->nw,
                   (long long)job->batch, (long long)cfg->dim, cfg->epochs,
                   (long long)weft_ps_worker_clock(job->ps), (long long)job->n_train,
                   (long long)job->n_eval);
            ex_json_num("auc", au, "%.5f");
            ex_json_num("logloss", ll, "%.5f");
            ex_json_num("ceiling", ceil_auc, "%.5f");
            ex_json_num("ceiling_logloss", ceil_ll, "%.5f");
            ex_json_num("train_logloss", train_loss, "%.5f");
            ex_json_num("samples_per_s", rate, "%.1f");
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
    criteo_cfg_defaults(&cfg);
    rc = criteo_parse_opts(PROG, argc, argv, &cfg, NULL, 0, usage);
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
            rc = criteo_synth_cfg(PROG, &cfg, job.w == 0, &set) == 0 ? 0 : 1;
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
