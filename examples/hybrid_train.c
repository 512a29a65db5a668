/*
 * hybrid_train: the main job. A click-through-rate model (ctr_train's: 13 dense and 26
 * categorical features, Criteo's shape) trained the way large recommendation models are: the
 * sparse embedding tables live on parameter servers, the dense MLP is replicated on the trainers
 * and kept in step by the DDP reducer (torch's DistributedDataParallel), as in DLRM or TorchRec
 * with a parameter server for the embeddings.
 *
 *   weftrun -n 4 --servers 2 build/examples/hybrid_train [--mode sync|async|bounded]
 *           [--epochs 2] [--batch 1024] [--lr 0.002] [--data FILE.tsv]
 *           [--checkpoint-dir DIR [--checkpoint-every N]] [--resume DIR] [--json] ...  (--help)
 *
 * Ranks 0..S-1 serve (weftrun --servers S sets WEFT_PS_SERVERS), the others train (by default
 * 2 servers and 2 trainers). Every rank creates the sparse tables emb.C1 .. emb.C26 (criteo.c:
 * rows of --dim floats below --rows, made on first use, Adagrad --emb-lr on the servers), and
 * the trainers form a process group of their own for the reducer. Each trainer builds the MLP
 * (13 + 26 * dim -> --hidden 64,32 -> 1, ReLU between layers, torch's nn.Linear initialisation
 * from --seed); the reducer broadcasts trainer 0's values and checks the replicas alike.
 *
 * Data (every trainer holds it all; criteo.c describes both sources): by default --samples
 * synthetic samples from a planted logistic model with Zipf-distributed ids, else --data FILE, a
 * Criteo TSV file (read on every rank first, so that a file that cannot be read ends every rank
 * before any waits for another; the servers drop it). The last 10% of the samples are held out.
 *
 * One step covers --batch samples of the epoch's shuffle (the same seeded permutation on every
 * trainer; rounded down to a multiple of the trainers, and the remainder of an epoch that does
 * not fill a batch is dropped, so every trainer runs the same number of steps). Trainer t of T
 * takes the batch's positions t, t + T, ... and:
 *   1. de-duplicates the ids of each feature and pulls the rows of the unique ids from the 26
 *      tables, all pulls in flight at once;
 *   2. runs the forward: each feature's rows (a leaf that requires gradients) gathered per
 *      sample, concatenated with the dense features, through its MLP replica, and the mean
 *      binary cross-entropy with logits;
 *   3. runs backward through the reducer (weft_ddp_backward): the MLP's gradients are averaged
 *      over the trainers in buckets while backward is still running, and a hook on each
 *      feature's rows pushes their gradient to the servers as soon as backward has it, as
 *      row-sparse gradients ([unique ids, dim] to those ids, never a dense embedding gradient),
 *      while the reducer's last buckets are on the wire;
 *   4. steps the MLP with Adam (--lr) locally: every replica applies the same averaged gradients,
 *      so the replicas stay bit-identical; then waits for its pushes and ends the step
 *      (weft_ps_clock). The servers apply Adagrad to the rows.
 * --mode sets the tables' consistency: sync (the servers apply the mean of the trainers' row
 * gradients once every trainer ended the step; with the reducer's mean for the MLP this is
 * exactly synchronous data-parallel training), async (each push applied on arrival) or bounded
 * (stale synchronous, --staleness steps). The MLP is synchronous in every mode.
 *
 * After each epoch the trainers meet (a barrier: every trainer's pushes are in), each scores its
 * share of the held-out samples with the rows as they are on the servers then, trainer 0 gathers
 * the scores and prints the held-out logloss and AUC (exact: scores sorted, ties given their mean
 * rank) and, for synthetic data, the planted model's own AUC on those samples: the ceiling. A
 * progress line shows the loss and samples/s (the training clock stops during evaluation and
 * checkpoints). At the end the trainers compare their replicas bit for bit (exit 1 if they
 * differ); --json prints one summary line (trainer 0) after the servers have finished, with the
 * peak resident memory over every rank.
 *
 * Checkpoints, with --checkpoint-dir DIR: after every --checkpoint-every steps, else at the end
 * of each epoch, and at the end of training, every trainer saves at the same step. Trainer 0
 * first writes the dense part to DIR/hybrid_train.dense.<step> (the MLP's values and Adam's
 * moments and step count, the options that give a step its meaning, an FNV-1a checksum; a
 * temporary file, fsync, rename), then every trainer calls weft_ps_save for the tables (a
 * consistent cut with the servers' Adagrad state; its manifest is written last), then trainer 0
 * removes the dense files of other steps. A process killed at any point leaves a pair that
 * matches: the manifest's step and a dense file of that step. --resume DIR loads the tables
 * (weft_ps_load: the trainers' clock becomes the checkpoint's step) and, on every trainer, the
 * dense file of that step, and goes on from that step (its epoch and position in the epoch) until
 * --epochs. The dense optimizer is Adam's kernel over state held here (weft_optimizer_t cannot
 * restore its step counts), so a resumed sync run ends with the very parameters of an
 * uninterrupted one. It needs the same --batch, --samples (or data), --seed and trainers; the
 * tables' specs (--dim, --rows, --mode, --emb-lr...) are checked by weft_ps_load.
 *
 * Runs unchanged across machines: weftrun --nnodes (or torchrun's, Slurm's, Open MPI's
 * variables) gives each rank its identity; checkpoints need a directory every server and
 * trainer can reach.
 *
 * Exit status: 0 on success, 2 for bad options, data that cannot be read or a checkpoint that
 * does not fit, 1 for any other failure (including replicas that differ).
 */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <weft/weft.h>

#include "common.h"
#include "criteo.h"

#define PROG         "hybrid_train"
#define MAX_PARAMS   (2 * EX_MAX_LAYERS)
#define EXIT_USAGE   EX_EXIT_USAGE
#define DENSE_FILE   "hybrid_train.dense" /* DENSE_FILE.<step> in the checkpoint directory */
#define DENSE_MAGIC  "weft hybrid_train dense 1"
#define DENSE_STATES 3 /* the values, Adam's exp_avg and exp_avg_sq */

/* ---------------------------------------------------------- configuration */

typedef struct {
    criteo_cfg_t c;
    const char *checkpoint_dir;
    int64_t checkpoint_every; /* steps; 0: at the end of each epoch */
    const char *resume_dir;
    int eval_every;    /* steps; 0: after each epoch only */
    double target_auc; /* NAN: none */
} config_t;

static void usage(FILE *out)
{
    fprintf(out, "usage: weftrun -n N --servers S hybrid_train [options]\n"
                 "  (embedding tables on the S servers; the MLP replicated on the other N - S\n"
                 "  ranks, the trainers, under the DDP reducer)\n");
    criteo_cfg_usage(out);
    fprintf(out,
            "  --checkpoint-dir D    write checkpoints to D: the tables and the dense replica\n"
            "  --checkpoint-every N  steps between checkpoints (default: each epoch's end)\n"
            "  --resume D            go on from the checkpoint in D until --epochs\n"
            "  --eval-every N        also measure the held-out AUC every N steps\n"
            "  --target-auc X        the held-out AUC whose training time --json reports\n");
}

/* Returns 0, 1 after --help, or EXIT_USAGE after a message. */
static int parse_args(int argc, char **argv, config_t *cfg)
{
    const ex_opt_t extra[] = {
        EX_STR("checkpoint-dir", &cfg->checkpoint_dir),
        EX_I64("checkpoint-every", &cfg->checkpoint_every, 1, INT64_MAX),
        EX_STR("resume", &cfg->resume_dir),
        EX_INT("eval-every", &cfg->eval_every, 1, INT32_MAX),
        EX_DOUBLE("target-auc", &cfg->target_auc, 0.0, 1.0),
    };
    int rc;

    memset(cfg, 0, sizeof(*cfg));
    criteo_cfg_defaults(&cfg->c);
    cfg->target_auc = NAN;
    rc = criteo_parse_opts(PROG, argc, argv, &cfg->c, extra, sizeof(extra) / sizeof(extra[0]),
                           usage);
    if (rc != 0) {
        return rc;
    }
    if (cfg->checkpoint_every > 0 && cfg->checkpoint_dir == NULL) {
        fprintf(stderr, PROG ": --checkpoint-every needs --checkpoint-dir\n");
        return EXIT_USAGE;
    }
    return 0;
}

static void fail(const char *what, weft_status_t st)
{
    ex_fail(PROG, what, st);
}

/* ------------------------------------------------------------------ the dense replica */

/*
 * A trainer's replica of the MLP, its reducer, and Adam over it: the kernel
 * (weft_optim_adam_step) with the moments held here, so that a checkpoint can restore them and
 * the step count exactly. state[0] are the parameters themselves (borrowed from the MLP).
 */
typedef struct {
    int n_sizes;
    int64_t sizes[EX_MAX_LAYERS + 1];
    weft_nn_mlp_t *mlp;
    const weft_param_list_t *params; /* borrowed from the MLP */
    int n;
    int64_t numel;
    weft_optim_adam_config_t adam;
    int64_t adam_step; /* Adam steps taken: every parameter has a gradient every step */
    weft_tensor_t *state[DENSE_STATES][MAX_PARAMS];
    weft_ddp_t *ddp;
} dense_t;

static void dense_free(dense_t *d)
{
    weft_ddp_free(d->ddp);
    for (int s = 1; s < DENSE_STATES; s++) {
        for (int i = 0; i < d->n; i++) {
            weft_tensor_release(d->state[s][i]);
        }
    }
    weft_nn_mlp_free(d->mlp);
    memset(d, 0, sizeof(*d));
}

/* The MLP from the seed, Adam's zero moments, and the reducer over the trainers' group @p tpg
 * (collective: it broadcasts trainer 0's values and checks the replicas alike). */
static weft_status_t dense_init(dense_t *d, const config_t *cfg, weft_pg_t *tpg)
{
    weft_ddp_opts_t o;
    weft_rng_t rng;
    weft_status_t st;

    memset(d, 0, sizeof(*d));
    d->n_sizes =
        ex_mlp_sizes(&cfg->c.hidden, CRITEO_DENSE + CRITEO_SPARSE * cfg->c.dim, 1, d->sizes);
    weft_rng_init(&rng, cfg->c.seed, 0);
    st = weft_nn_mlp_create(d->n_sizes, d->sizes, NULL, &rng, &d->mlp);
    if (st != WEFT_OK) {
        return st;
    }
    d->params = weft_nn_mlp_params(d->mlp);
    d->n = weft_param_list_size(d->params);
    d->numel = weft_param_list_numel(d->params);
    d->adam = weft_optim_adam_defaults();
    d->adam.lr = cfg->c.lr;
    for (int i = 0; st == WEFT_OK && i < d->n; i++) {
        weft_tensor_t *p = weft_param_list_get(d->params, i);

        d->state[0][i] = p;
        for (int s = 1; st == WEFT_OK && s < DENSE_STATES; s++) {
            st = weft_tensor_create(WEFT_F32, weft_tensor_ndim(p), weft_tensor_shape(p),
                                    &d->state[s][i]);
        }
    }
    if (st == WEFT_OK) {
        weft_ddp_opts_init(&o);
        st = weft_ddp_create(tpg, d->params, &o, &d->ddp);
    }
    if (st != WEFT_OK) {
        dense_free(d);
    }
    return st;
}

/* One Adam step of every parameter on its (averaged) gradient. */
static weft_status_t dense_step(dense_t *d)
{
    for (int i = 0; i < d->n; i++) {
        weft_tensor_t *p = d->state[0][i];
        weft_tensor_t *g = weft_tensor_grad(p);
        weft_status_t st;

        if (g == NULL) {
            fprintf(stderr, PROG ": %s has no gradient\n", weft_param_list_name(d->params, i));
            return WEFT_ERR_INVALID_STATE;
        }
        st = weft_optim_adam_step(&d->adam, p, g, d->state[1][i], d->state[2][i], NULL,
                                  d->adam_step + 1);
        if (st != WEFT_OK) {
            return st;
        }
    }
    d->adam_step++;
    return WEFT_OK;
}

/* ------------------------------------------------------------------ the job */

typedef struct {
    double auc, logloss, ceil_auc, ceil_logloss, train_loss;
    double time_to_target; /* training seconds at the first evaluation reaching --target-auc */
    double rate;           /* samples/s */
    double train_s;
    int epochs_run;
    int64_t steps; /* the trainers' clock at the end */
    int identical;
    double comm_hidden; /* the reducer's share of communication hidden behind backward; NAN */
} summary_t;

typedef struct {
    const config_t *cfg;
    weft_ps_t *ps;
    weft_pg_t *tpg; /* the trainers: group rank = worker index */
    weft_ps_table_t *emb[CRITEO_SPARSE];
    const criteo_set_t *set;
    int w;  /* trainer (worker) index */
    int nw; /* trainers */
    int64_t n_train;
    int64_t n_eval; /* samples n_train .. n_train + n_eval - 1 */
    int64_t batch;  /* global, a multiple of nw, <= n_train */
    int64_t steps;  /* per epoch */
    summary_t sum;
} job_t;

/* ------------------------------------------------------------------ one step */

/* The row pushes of one step, issued by the hooks on the rows while backward runs. */
typedef struct {
    weft_ps_table_t *const *emb;
    const criteo_lookup_t *lk;
    weft_future_t *fs[CRITEO_SPARSE];
    int n;
} pushes_t;

/* The post-accumulate hook of a feature's rows: their gradient is complete, so it goes to the
 * servers now, while backward and the reducer go on. */
static weft_status_t push_rows_hook(weft_tensor_t *rows, weft_tensor_t *grad, void *arg)
{
    pushes_t *pu = arg;

    if (grad == NULL) {
        return WEFT_OK;
    }
    for (int f = 0; f < CRITEO_SPARSE; f++) {
        if (pu->lk->rows[f] == rows) {
            weft_status_t st = weft_ps_push_rows_async(pu->emb[f], pu->lk->ids[f], pu->lk->n[f],
                                                       grad, 0, &pu->fs[pu->n]);
            if (st == WEFT_OK) {
                pu->n++;
            }
            return st;
        }
    }
    return WEFT_OK;
}

/* One step on samples idx[0..k): pull, forward, backward through the reducer with the row
 * pushes on the way, Adam, clock; *loss_p gets the mean loss. */
static int step(const job_t *job, dense_t *d, const int64_t *idx, int64_t k, double *loss_p)
{
    weft_future_t *fs[CRITEO_SPARSE];
    int nf = 0;
    pushes_t pu;
    criteo_lookup_t lk;
    weft_tensor_t *loss = NULL;
    weft_status_t st;
    int rc = -1;

    memset(&pu, 0, sizeof(pu));
    st = criteo_lookup_prepare(job->set, idx, k, job->cfg->c.dim, &lk);
    if (st != WEFT_OK) {
        fail("step", st);
        return -1;
    }
    st = criteo_lookup_pull(job->emb, &lk, fs, &nf);
    if (st != WEFT_OK) {
        fail("pull", st);
    }
    if (ex_wait_all(PROG, fs, nf, "pull") != 0 || st != WEFT_OK) {
        goto out;
    }
    weft_param_list_zero_grad(d->params);
    st = criteo_loss(d->mlp, job->set, idx, &lk, &loss);
    pu.emb = job->emb;
    pu.lk = &lk;
    for (int f = 0; st == WEFT_OK && f < CRITEO_SPARSE; f++) {
        st = weft_tensor_add_grad_hook(lk.rows[f], push_rows_hook, &pu, NULL);
    }
    if (st == WEFT_OK) {
        *loss_p = ((const float *)weft_tensor_data(loss))[0];
        st = weft_ddp_backward(d->ddp, loss, NULL);
    }
    if (st == WEFT_OK) {
        st = dense_step(d); /* while the row pushes travel */
    }
    if (st != WEFT_OK) {
        fail("training step", st);
        ex_wait_all(PROG, pu.fs, pu.n, "push");
        goto out;
    }
    if (ex_ps_end_step(PROG, job->ps, pu.fs, pu.n) != 0) {
        goto out;
    }
    rc = 0;
out:
    weft_tensor_release(loss);
    criteo_lookup_free(&lk);
    return rc;
}

/* ------------------------------------------------------------------ evaluation */

/* The held-out logloss and AUC into trainer 0's @p logloss_p, @p auc_p: the trainers meet, each
 * scores a contiguous share of the held-out samples, and trainer 0 gathers the scores. */
static int evaluate(const job_t *job, dense_t *d, double *logloss_p, double *auc_p)
{
    const int64_t share = (job->n_eval + job->nw - 1) / job->nw;
    const int64_t first = job->w * share < job->n_eval ? job->w * share : job->n_eval;
    const int64_t n = job->n_eval - first < share ? job->n_eval - first : share;
    int64_t all_n = share * job->nw;
    weft_tensor_t *mine = NULL;
    weft_tensor_t *all = NULL;
    weft_status_t st;
    int rc = -1;

    st = weft_coll_barrier(job->tpg, NULL); /* every trainer's pushes are in */
    if (st == WEFT_OK) {
        st = weft_tensor_create(WEFT_F32, 1, &share, &mine);
    }
    if (st == WEFT_OK && job->w == 0) {
        st = weft_tensor_empty(WEFT_F32, 1, &all_n, &all);
    }
    if (st != WEFT_OK) {
        fail("evaluate", st);
        goto out;
    }
    if (criteo_score(PROG, job->set, job->n_train + first, n, job->emb, d->mlp, job->cfg->c.dim,
                     weft_tensor_data(mine)) != 0) {
        goto out;
    }
    st = weft_coll_gather(job->tpg, mine, all, 0, NULL);
    if (st != WEFT_OK) {
        fail("evaluate: gather", st);
        goto out;
    }
    if (job->w == 0 && criteo_metrics(job->set, job->n_train, job->n_eval, weft_tensor_data(all),
                                      logloss_p, auc_p) != 0) {
        fprintf(stderr, PROG ": out of memory\n");
        goto out;
    }
    rc = 0;
out:
    weft_tensor_release(mine);
    weft_tensor_release(all);
    return rc;
}

/* ------------------------------------------------------------------ checkpoints */

static void dense_path(char *buf, size_t n, const char *dir, int64_t step)
{
    snprintf(buf, n, "%s/" DENSE_FILE ".%lld", dir, (long long)step);
}

/* What a checkpoint's step means (the data and its cut into steps) and the replica's size. */
static void meta_text(const job_t *job, const dense_t *d, char *buf, size_t n)
{
    snprintf(buf, n, "batch %lld samples %lld trainers %d seed %llu parameters %lld\n",
             (long long)job->batch, (long long)job->n_train, job->nw,
             (unsigned long long)job->cfg->c.seed, (long long)d->numel);
}

/* Trainer 0: the replica, Adam's moments and step count at @p step into DIR/DENSE_FILE.<step>:
 * three text lines (magic; step and Adam's step; meta_text), the tensors' bytes, their FNV-1a. */
static int dense_save(const job_t *job, const dense_t *d, const char *dir, int64_t step)
{
    char path[4096];
    char tmp[4200];
    char meta[256];
    uint64_t h = EX_FNV1A_BASIS;
    FILE *f;
    int ok;

    if (mkdir(dir, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, PROG ": checkpoint: %s: %s\n", dir, strerror(errno));
        return -1;
    }
    dense_path(path, sizeof(path), dir, step);
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    meta_text(job, d, meta, sizeof(meta));
    f = fopen(tmp, "wb");
    ok = f != NULL && fprintf(f, DENSE_MAGIC "\nstep %lld adam_step %lld\n%s", (long long)step,
                              (long long)d->adam_step, meta) > 0;
    for (int s = 0; ok && s < DENSE_STATES; s++) {
        for (int i = 0; ok && i < d->n; i++) {
            const void *p = weft_tensor_data(d->state[s][i]);
            size_t nb = weft_tensor_nbytes(d->state[s][i]);

            ok = fwrite(p, 1, nb, f) == nb;
            h = ex_fnv1a(h, p, nb);
        }
    }
    ok = ok && fwrite(&h, sizeof(h), 1, f) == 1 && fflush(f) == 0 && fsync(fileno(f)) == 0;
    if (f != NULL && fclose(f) != 0) {
        ok = 0;
    }
    if (!ok || rename(tmp, path) != 0) {
        fprintf(stderr, PROG ": checkpoint: %s: %s\n", path, strerror(errno));
        remove(tmp);
        return -1;
    }
    return 0;
}

/* Trainer 0, once the tables' checkpoint of @p step is complete: the dense files of other steps
 * go. */
static void dense_prune(const char *dir, int64_t step)
{
    const size_t plen = strlen(DENSE_FILE ".");
    char keep[64];
    char path[4096];
    DIR *dh = opendir(dir);
    struct dirent *e;

    if (dh == NULL) {
        return;
    }
    snprintf(keep, sizeof(keep), DENSE_FILE ".%lld", (long long)step);
    while ((e = readdir(dh)) != NULL) {
        if (strncmp(e->d_name, DENSE_FILE ".", plen) == 0 && strcmp(e->d_name, keep) != 0) {
            snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
            remove(path);
        }
    }
    closedir(dh);
}

/* Every trainer: the dense part of the checkpoint of @p step in @p dir into @p d.
 * @return 0, or -1 after a message (missing, written for other options, or corrupt). */
static int dense_load(const job_t *job, dense_t *d, const char *dir, int64_t step)
{
    char path[4096];
    char want[256];
    char line[256];
    char have[256] = "";
    long long file_step = -1, adam_step = -1;
    uint64_t h = EX_FNV1A_BASIS;
    uint64_t stored = 0;
    FILE *f;
    int ok;

    dense_path(path, sizeof(path), dir, step);
    meta_text(job, d, want, sizeof(want));
    f = fopen(path, "rb");
    if (f == NULL) {
        fprintf(stderr, PROG ": resume: %s: %s (the dense replica of the tables' step %lld)\n",
                path, strerror(errno), (long long)step);
        return -1;
    }
    ok = fgets(line, sizeof(line), f) != NULL && strcmp(line, DENSE_MAGIC "\n") == 0 &&
         fgets(line, sizeof(line), f) != NULL &&
         sscanf(line, "step %lld adam_step %lld", &file_step, &adam_step) == 2 &&
         file_step == step && adam_step >= 0 && fgets(have, sizeof(have), f) != NULL;
    if (ok && strcmp(have, want) != 0) {
        have[strcspn(have, "\n")] = '\0';
        want[strcspn(want, "\n")] = '\0';
        fprintf(stderr, PROG ": the checkpoint in %s was written with %s, this run has %s\n", dir,
                have, want);
        fclose(f);
        return -1;
    }
    for (int s = 0; ok && s < DENSE_STATES; s++) {
        for (int i = 0; ok && i < d->n; i++) {
            void *p = weft_tensor_data(d->state[s][i]);
            size_t nb = weft_tensor_nbytes(d->state[s][i]);

            ok = fread(p, 1, nb, f) == nb;
            h = ex_fnv1a(h, p, nb);
        }
    }
    ok = ok && fread(&stored, sizeof(stored), 1, f) == 1 && stored == h && fgetc(f) == EOF;
    fclose(f);
    if (!ok) {
        fprintf(stderr,
                PROG ": resume: %s is not a dense replica of step %lld written by this "
                     "program (truncated or corrupt)\n",
                path, (long long)step);
        return -1;
    }
    d->adam_step = adam_step;
    return 0;
}

/* Every trainer at the same step: the dense file (trainer 0), the tables, the old files gone. */
static int checkpoint(const job_t *job, const dense_t *d, int64_t step)
{
    const char *dir = job->cfg->checkpoint_dir;
    double t0 = ex_now();
    weft_status_t st;

    if (job->w == 0 && dense_save(job, d, dir, step) != 0) {
        return -1;
    }
    st = weft_ps_save(job->ps, dir, 0);
    if (st != WEFT_OK) {
        fail("checkpoint", st);
        return -1;
    }
    if (job->w == 0) {
        dense_prune(dir, step);
        printf("checkpoint at step %lld in %s (%.2f s)\n", (long long)step, dir, ex_now() - t0);
    }
    return 0;
}

/* The tables, then every trainer's replica, from the checkpoint in --resume; *clock_p gets its
 * step. @return 0, or an exit status after a message. */
static int resume(const job_t *job, dense_t *d, int64_t *clock_p)
{
    const char *dir = job->cfg->resume_dir;
    weft_status_t st = weft_ps_load(job->ps, dir, 0);
    int64_t clock;

    if (st != WEFT_OK) {
        fail("resume", st);
        return st == WEFT_ERR_NOT_FOUND || st == WEFT_ERR_MISMATCH ? EXIT_USAGE : 1;
    }
    clock = weft_ps_worker_clock(job->ps);
    if (dense_load(job, d, dir, clock) != 0) {
        return EXIT_USAGE;
    }
    if (job->w == 0) {
        printf("resumed at step %lld from %s: continuing with epoch %lld, step %lld of %lld\n",
               (long long)clock, dir, (long long)(clock / job->steps + 1),
               (long long)(clock % job->steps + 1), (long long)job->steps);
        if (clock >= (int64_t)job->cfg->c.epochs * job->steps) {
            printf("nothing left to train for --epochs %d\n", job->cfg->c.epochs);
        }
    }
    *clock_p = clock;
    return 0;
}

/* --------------------------------------------------------------------- train */

/* Trainer 0 after an evaluation at @p trained seconds of training: the first to reach
 * --target-auc gives the time to target. */
static void reached(const config_t *cfg, summary_t *sum, double trained)
{
    if (!isnan(cfg->target_auc) && isnan(sum->time_to_target) && sum->auc >= cfg->target_auc) {
        sum->time_to_target = trained;
    }
}

static void print_header(const job_t *job, const dense_t *d)
{
    const criteo_cfg_t *c = &job->cfg->c;

    printf("CTR model: 26 sparse tables (dim %lld, %lld rows, Adagrad lr %g) on %zu servers, ",
           (long long)c->dim, (long long)c->rows, c->emb_lr, weft_ps_num_servers(job->ps));
    ex_print_mlp(d->n_sizes, d->sizes);
    printf(" (%lld parameters) replicated on %d trainers (DDP, Adam lr %g); batch %lld, %s",
           (long long)d->numel, job->nw, c->lr, (long long)job->batch, ex_mode_name(c->mode));
    if (c->mode == WEFT_PS_BOUNDED) {
        printf(" (staleness %lld)", (long long)c->staleness);
    }
    printf("; %lld train / %lld held-out samples, %lld steps per epoch\n", (long long)job->n_train,
           (long long)job->n_eval, (long long)job->steps);
}

static int train(job_t *job)
{
    const config_t *cfg = job->cfg;
    const int lead = job->w == 0;
    const int64_t per = job->batch / job->nw;
    int64_t *perm = malloc((size_t)job->n_train * sizeof(*perm));
    int64_t *idx = malloc((size_t)per * sizeof(*idx));
    summary_t *sum = &job->sum;
    dense_t d;
    ex_loop_t l;
    double t_start = ex_now();
    int64_t clock0 = 0;
    int64_t last_saved = -1;
    uint64_t hash = 0;
    weft_status_t st;
    int rc = 1;

    memset(&d, 0, sizeof(d));
    sum->auc = sum->logloss = sum->ceil_auc = sum->ceil_logloss = sum->train_loss = NAN;
    sum->time_to_target = NAN;
    sum->comm_hidden = NAN;
    if (perm == NULL || idx == NULL) {
        fprintf(stderr, PROG ": out of memory\n");
        goto out;
    }
    ex_loop_init(&l, job->w, job->nw, cfg->c.epochs, job->steps, cfg->eval_every);
    st = dense_init(&d, cfg, job->tpg);
    if (st != WEFT_OK) {
        fail("model", st);
        goto out;
    }
    if (lead) {
        print_header(job, &d);
        criteo_ceiling(job->set, job->n_train, job->n_eval, &sum->ceil_logloss, &sum->ceil_auc);
        criteo_print_ceiling(sum->ceil_logloss, sum->ceil_auc);
    }
    if (cfg->resume_dir != NULL) {
        rc = resume(job, &d, &clock0);
        if (rc != 0) {
            goto out;
        }
        rc = 1;
        last_saved = clock0;
    }

    for (int epoch = (int)(clock0 / job->steps); epoch < cfg->c.epochs; epoch++) {
        ex_loop_epoch_begin(&l);
        ex_epoch_perm(cfg->c.seed, epoch, job->n_train, perm);
        for (int64_t s = epoch == clock0 / job->steps ? clock0 % job->steps : 0; s < job->steps;
             s++) {
            const int64_t *b = perm + s * job->batch;
            double t0 = ex_now();
            double loss = 0;
            int64_t clock;
            int64_t k = 0;
            int eval_due;
            int due;

            for (int64_t i = job->w; i < job->batch; i += job->nw) {
                idx[k++] = b[i];
            }
            if (step(job, &d, idx, k, &loss) != 0) {
                goto out;
            }
            ex_loop_add_ddp(&l, d.ddp);
            eval_due = ex_loop_step_end(&l, epoch, s, k, loss, t0) && s + 1 < job->steps;
            clock = weft_ps_worker_clock(job->ps);
            due = cfg->checkpoint_every > 0 ? clock % cfg->checkpoint_every == 0
                                            : s + 1 == job->steps;
            if (cfg->checkpoint_dir != NULL && due) {
                if (lead && l.tty) {
                    printf("\n");
                }
                if (checkpoint(job, &d, clock) != 0) {
                    goto out;
                }
                last_saved = clock;
            }
            if (eval_due) { /* within the epoch (its end has its own line) */
                if (evaluate(job, &d, &sum->logloss, &sum->auc) != 0) {
                    goto out;
                }
                if (lead) {
                    printf("%sstep %lld: held-out logloss %.4f AUC %.4f, training %.3f s\n",
                           l.tty ? "\n" : "", (long long)clock, sum->logloss, sum->auc,
                           l.train_time + l.t_epoch);
                    reached(cfg, sum, l.train_time + l.t_epoch);
                }
            }
        }
        l.train_time += l.t_epoch;
        l.loss_avg = l.loss_n > 0 ? l.loss_sum / (double)l.loss_n : 0;
        l.epochs_run++;
        if (evaluate(job, &d, &sum->logloss, &sum->auc) != 0) {
            goto out;
        }
        if (lead) {
            if (l.tty) {
                printf("\n");
            }
            criteo_print_epoch(epoch, cfg->c.epochs, l.loss_avg, sum->logloss, sum->auc,
                               sum->ceil_auc, l.t_epoch, ex_loop_rate(&l));
            reached(cfg, sum, l.train_time);
        }
    }
    if (l.epochs_run == 0 && evaluate(job, &d, &sum->logloss, &sum->auc) != 0) {
        goto out; /* nothing left to train: score the checkpoint */
    }
    sum->steps = weft_ps_worker_clock(job->ps);
    if (cfg->checkpoint_dir != NULL && last_saved != sum->steps &&
        checkpoint(job, &d, sum->steps) != 0) {
        goto out;
    }
    if (ex_params_identical(PROG, job->tpg, d.params, &sum->identical, &hash) != 0) {
        goto out;
    }
    sum->train_loss = l.epochs_run > 0 ? l.loss_avg : NAN;
    sum->rate = ex_loop_rate(&l);
    sum->train_s = l.train_time;
    sum->epochs_run = l.epochs_run;
    if (l.comm_us > 0) {
        sum->comm_hidden = 1.0 - l.exposed_us / l.comm_us;
    }
    if (lead) {
        criteo_print_final(sum->auc, sum->ceil_auc, sum->logloss, sum->rate, sum->steps,
                           ex_now() - t_start);
        printf("dense replicas %s on all %d trainers (fnv1a64 %016llx)\n",
               sum->identical ? "bit-identical" : "DIFFER", job->nw, (unsigned long long)hash);
        if (l.step_total > 0) {
            weft_ddp_stats_t ds;

            weft_ddp_stats(d.ddp, &ds);
            printf("ddp: %d bucket%s, %.1f KiB a step on the wire, %.0f%% of the communication "
                   "hidden behind backward\n",
                   ds.buckets, ds.buckets == 1 ? "" : "s", (double)ds.bytes / 1024.0,
                   isfinite(sum->comm_hidden) ? 100.0 * sum->comm_hidden : 0.0);
        }
    }
    rc = sum->identical ? 0 : 1;
out:
    dense_free(&d);
    free(perm);
    free(idx);
    return rc;
}

/* --------------------------------------------------------------------- summary */

/* After the servers finished, on every rank, whatever its status @p rc (so that none waits for
 * another): every rank's peak resident memory (one all_gather over the world), then trainer 0's
 * JSON line if all went well here. @return @p rc, or 1 if it was 0 and the gather failed. */
static int print_json(weft_agent_t *a, const job_t *job, double t_start, int rc)
{
    const summary_t *sum = &job->sum;
    const int world = weft_agent_world_size(a);
    int64_t one = 1;
    int64_t nworld = world;
    weft_pg_t *wpg = NULL;
    weft_tensor_t *mine = NULL;
    weft_tensor_t *all = NULL;
    struct rusage ru;
    double rss_max = 0, rss_sum = 0;
    const double *rss;
    weft_status_t st;

    getrusage(RUSAGE_SELF, &ru);
    st = weft_pg_world(a, &wpg);
    if (st == WEFT_OK) {
        st = weft_tensor_create(WEFT_F64, 1, &one, &mine);
    }
    if (st == WEFT_OK) {
        st = weft_tensor_create(WEFT_F64, 1, &nworld, &all);
    }
    if (st == WEFT_OK) {
        ((double *)weft_tensor_data(mine))[0] = (double)ru.ru_maxrss / 1024.0;
        st = weft_coll_all_gather(wpg, mine, all, NULL);
    }
    if (st != WEFT_OK) {
        fail("peak memory", st);
        rc = rc != 0 ? rc : 1;
    }
    if (rc == 0 && job->cfg != NULL && job->w == 0) {
        rss = weft_tensor_data(all);
        for (int r = 0; r < world; r++) {
            rss_max = rss[r] > rss_max ? rss[r] : rss_max;
            rss_sum += rss[r];
        }
        printf("{\"system\":\"weft\",\"example\":\"hybrid_train\",\"mode\":\"%s\","
               "\"servers\":%zu,\"trainers\":%d,\"batch\":%lld,\"dim\":%lld,\"epochs\":%d,"
               "\"epochs_run\":%d,\"steps\":%lld,\"train_samples\":%lld,\"eval_samples\":%lld",
               ex_mode_name(job->cfg->c.mode), weft_ps_num_servers(job->ps), job->nw,
               (long long)job->batch, (long long)job->cfg->c.dim, job->cfg->c.epochs,
               sum->epochs_run, (long long)sum->steps, (long long)job->n_train,
               (long long)job->n_eval);
        ex_json_num("samples_per_s", sum->rate, "%.1f");
        ex_json_num("logloss", sum->logloss, "%.5f");
        ex_json_num("auc", sum->auc, "%.5f");
        ex_json_num("ceiling", sum->ceil_auc, "%.5f");
        ex_json_num("train_logloss", sum->train_loss, "%.5f");
        ex_json_num("target_auc", job->cfg->target_auc, "%.4f");
        ex_json_num("time_to_target_s", sum->time_to_target, "%.3f");
        ex_json_num("train_s", sum->train_s, "%.3f");
        ex_json_num("wall_s", ex_now() - t_start, "%.3f");
        ex_json_num("comm_hidden", sum->comm_hidden, "%.3f");
        ex_json_num("peak_rss_mb", rss_max, "%.1f");
        ex_json_num("peak_rss_mb_total", rss_sum, "%.1f");
        printf(",\"peak_rss_mb_ranks\":[");
        for (int r = 0; r < world; r++) {
            printf("%s%.1f", r > 0 ? "," : "", rss[r]);
        }
        printf("],\"replicas_identical\":%s}\n", sum->identical ? "true" : "false");
    }
    weft_tensor_release(mine);
    weft_tensor_release(all);
    weft_pg_free(wpg);
    return rc;
}

/* ----------------------------------------------------------------- main */

int main(int argc, char **argv)
{
    const double t_start = ex_now();
    config_t cfg;
    criteo_set_t set = {0};
    weft_agent_t *a = NULL;
    weft_ps_t *ps = NULL;
    weft_pg_t *tpg = NULL;
    job_t job;
    int rc;

    setvbuf(stdout, NULL, _IOLBF, 0);
    memset(&job, 0, sizeof(job));
    rc = parse_args(argc, argv, &cfg);
    if (rc != 0) {
        return rc == 1 ? 0 : rc;
    }
    weft_op_set_threads(cfg.c.threads);
    /* A file is read on every rank: one that cannot be read ends the run before any rank waits
     * for another. */
    if (cfg.c.data != NULL && criteo_load(PROG, cfg.c.data, (uint64_t)cfg.c.rows, &set) != 0) {
        return EXIT_USAGE;
    }

    if (ex_ps_start(PROG, &a, &ps) != 0) {
        rc = 1;
        goto out;
    }
    rc = 1;
    if (ex_ps_workers_group(PROG, a, ps, &tpg) != 0 ||
        criteo_emb_tables_create(PROG, ps, &cfg.c, job.emb) != 0) {
        goto out_shutdown;
    }
    rc = 0;
    job.ps = ps;
    job.w = weft_ps_worker_index(ps);
    job.nw = (int)weft_ps_num_workers(ps);
    if (weft_ps_is_worker(ps)) {
        job.cfg = &cfg;
        job.tpg = tpg;
        job.set = &set;
        if (cfg.c.data == NULL) {
            rc = criteo_synth_cfg(PROG, &cfg.c, job.w == 0, &set) == 0 ? 0 : 1;
        } else if (job.w == 0) {
            printf("loaded %lld samples (%lld skipped) from %s\n", (long long)set.n,
                   (long long)set.skipped, cfg.c.data);
        }
        if (rc == 0) {
            job.n_eval = set.n / 10 > 0 ? set.n / 10 : 1;
            job.n_train = set.n - job.n_eval;
            job.batch = cfg.c.batch < job.n_train ? cfg.c.batch : job.n_train;
            job.batch -= job.batch % job.nw; /* every trainer takes as many samples */
            job.steps = job.batch > 0 ? job.n_train / job.batch : 0;
            if (job.batch == 0) {
                fprintf(stderr,
                        PROG ": a batch of %lld samples (%lld to train on) for %d trainers\n",
                        (long long)cfg.c.batch, (long long)job.n_train, job.nw);
                rc = EXIT_USAGE;
            } else {
                rc = train(&job);
            }
        }
    }
    criteo_free(&set);
    rc = ex_ps_finish(PROG, ps, rc);
    if (cfg.c.json) {
        rc = print_json(a, &job, t_start, rc);
    }

out_shutdown:
    weft_pg_free(tpg);
    rc = ex_agent_shutdown(PROG, a, rc);
out:
    weft_agent_free(a);
    criteo_free(&set);
    return rc;
}
