/*
 * Click-through-rate data and model for examples/ctr_train and examples/hybrid_train: the Criteo
 * display-advertising TSV format and a synthetic generator of the same shape (criteo.c describes
 * both), and the pieces of the CTR model the two programs share: their common options, the 26
 * sparse embedding tables on the parameter server, a batch's lookups, the forward and the loss,
 * the held-out logloss and AUC and the lines that report them.
 */
#ifndef WEFT_EXAMPLES_CRITEO_H
#define WEFT_EXAMPLES_CRITEO_H

#include <stdint.h>
#include <stdio.h>

#include <weft/weft.h>

#include "common.h"

#define CRITEO_DENSE  13 /* integer features I1..I13 */
#define CRITEO_SPARSE 26 /* categorical features C1..C26 */

/** Samples, in file (or generation) order. The arrays are malloc'd; free with criteo_free. */
typedef struct {
    int64_t n;
    uint8_t *label;  /**< [n], 0 or 1 */
    float *dense;    /**< [n, CRITEO_DENSE]: log(1 + max(x, 0)), 0 for an empty field */
    uint32_t *cat;   /**< [n, CRITEO_SPARSE]: ids in [0, rows); 0 for an empty field */
    float *logit;    /**< [n]: the planted model's logit (synthetic data), else NULL */
    int64_t skipped; /**< malformed lines the loader skipped */
} criteo_set_t;

/**
 * Reads a Criteo TSV file (label, 13 integers, 26 hexadecimal categories, tab-separated; any
 * field but the label may be empty), reducing each category into [1, rows) (0 is "empty").
 * Malformed lines are skipped and counted in set->skipped.
 * @param prog the program's name for messages (printed to stderr on failure).
 * @return 0, or -1 after a message (the file cannot be read, or holds no valid line).
 */
int criteo_load(const char *prog, const char *path, uint64_t rows, criteo_set_t *set);

/** The synthetic generator's parameters (criteo.c's header comment has the model). */
typedef struct {
    int64_t n;        /**< samples */
    uint64_t rows;    /**< ids are in [1, rows) */
    uint64_t seed;    /**< the planted model and the samples */
    double zipf_s;    /**< Zipf exponent of the ids (default 1.2) */
    int64_t values;   /**< distinct values of each categorical feature (default 10000) */
    double cat_scale; /**< standard deviation of a planted per-id weight (default 0.2) */
} criteo_synth_opts_t;

/** Fills @p o with the defaults for @p n samples, @p rows, @p seed. */
void criteo_synth_opts_init(criteo_synth_opts_t *o, int64_t n, uint64_t rows, uint64_t seed);

/** Generates @p o->n samples (with their planted logits). @return 0, or -1 (no memory). */
int criteo_synth(const criteo_synth_opts_t *o, criteo_set_t *set);

/** Frees the arrays of @p set and zeroes it. */
void criteo_free(criteo_set_t *set);

/* ------------------------------------------------------------------ the CTR model */

/** Held-out samples scored per forward. */
#define CRITEO_EVAL_CHUNK 8192

/** The options of the CTR programs (criteo_cfg_defaults, criteo_parse_opts). */
typedef struct {
    int epochs;
    int64_t batch; /**< global: the workers share it */
    double lr;     /**< the MLP's Adam */
    double emb_lr; /**< the embeddings' Adagrad, on the servers */
    int64_t dim;
    int64_t rows; /**< id_bound of every sparse table */
    int64_t samples;
    int64_t values; /**< synthetic: distinct values per feature */
    double zipf;    /**< synthetic: Zipf exponent */
    ex_sizes_t hidden;
    uint64_t seed;
    const char *data;
    weft_ps_consistency_t mode;
    int64_t staleness;
    int staleness_set;
    int json;
    int threads;
} criteo_cfg_t;

/** The defaults: 2 epochs of 1M synthetic samples, batch 1024, MLP 64,32, dim 16, 1M rows... */
void criteo_cfg_defaults(criteo_cfg_t *c);

/** Prints the usage lines of criteo_cfg_t's options (after the program's "usage:" line). */
void criteo_cfg_usage(FILE *out);

/**
 * ex_parse_opts over criteo_cfg_t's options (into @p c, whose defaults the caller set) and the
 * program's own @p extra (@p n_extra rows), then the checks a table cannot make (--staleness needs
 * --mode bounded). @return 0; 1 after --help; EX_EXIT_USAGE after a message.
 */
int criteo_parse_opts(const char *prog, int argc, char **argv, criteo_cfg_t *c,
                      const ex_opt_t *extra, size_t n_extra, void (*usage)(FILE *out));

/** Sets @p spec's seed, consistency and staleness from @p c. */
void criteo_table_common(const criteo_cfg_t *c, weft_ps_table_spec_t *spec);

/**
 * Creates the sparse tables emb.C1 .. emb.C26 into @p emb (every rank, in this order, at the same
 * point of its table creations): rows of c->dim floats addressed by ids below c->rows, made on
 * first use uniform in [-0.01, 0.01), Adagrad (c->emb_lr) on the servers with an initial
 * accumulator of 3e-5 for a batch of 1024 (scaled by 1 / batch^2: gradients of a mean loss).
 * @return 0, or -1 after a message.
 */
int criteo_emb_tables_create(const char *prog, weft_ps_t *ps, const criteo_cfg_t *c,
                             weft_ps_table_t **emb);

/**
 * The synthetic set of @p c's options (criteo_synth); with @p print, the line "synthetic
 * Criteo-like data: N samples (...)". @return 0, or -1 after a message (no memory).
 */
int criteo_synth_cfg(const char *prog, const criteo_cfg_t *c, int print, criteo_set_t *set);

/**
 * The embedding rows one forward needs: per feature, the unique ids of the samples, each
 * sample's position among them (i64 [k]), and the rows to pull into ([n_unique, dim]).
 */
typedef struct {
    int64_t k;
    uint64_t *keys; /**< [k] scratch */
    uint64_t *ids[CRITEO_SPARSE];
    size_t n[CRITEO_SPARSE];
    weft_tensor_t *pos[CRITEO_SPARSE];
    weft_tensor_t *rows[CRITEO_SPARSE];
} criteo_lookup_t;

/**
 * De-duplicates the ids of samples idx[0..k) of @p set, feature by feature, and makes the row
 * tensors to pull into. On failure @p lk is left empty. @return WEFT_ERR_NO_MEMORY.
 */
weft_status_t criteo_lookup_prepare(const criteo_set_t *set, const int64_t *idx, int64_t k,
                                    int64_t dim, criteo_lookup_t *lk);

/** Frees what criteo_lookup_prepare made and zeroes @p lk. */
void criteo_lookup_free(criteo_lookup_t *lk);

/**
 * Issues the pulls of @p lk's rows from @p emb (CRITEO_SPARSE tables), their futures into
 * fs[*n_p], fs[*n_p + 1], ... (*n_p advanced for each). On failure the futures issued are in
 * @p fs, for the caller to wait for. @return weft_ps_pull_rows_async's statuses.
 */
weft_status_t criteo_lookup_pull(weft_ps_table_t *const *emb, criteo_lookup_t *lk,
                                 weft_future_t **fs, int *n_p);

/**
 * Logits [k, 1] of samples idx[0..k) of @p set: the pulled rows of @p lk gathered per sample
 * (weft_op_embedding), concatenated with the dense features, through @p mlp.
 */
weft_status_t criteo_forward(weft_nn_mlp_t *mlp, const criteo_set_t *set, const int64_t *idx,
                             const criteo_lookup_t *lk, weft_tensor_t **z_p);

/**
 * The training loss of samples idx[0..k) (k = lk->k): @p lk's rows become leaves that require
 * gradients, then criteo_forward and the mean binary cross-entropy with logits (max(z, 0) +
 * log(1 + exp(-|z|)) - y z). Backward from *loss_p gives the rows' gradients ([n_unique, dim],
 * weft_tensor_grad of lk->rows[f]) and @p mlp's.
 * @param[out] loss_p a scalar f32; caller releases it.
 */
weft_status_t criteo_loss(weft_nn_mlp_t *mlp, const criteo_set_t *set, const int64_t *idx,
                          criteo_lookup_t *lk, weft_tensor_t **loss_p);

/**
 * The logits of @p mlp with the rows of @p emb as they are now for samples first .. first + n - 1
 * of @p set into scores[0..n), CRITEO_EVAL_CHUNK at a time (no gradients recorded).
 * @return 0, or -1 after a message.
 */
int criteo_score(const char *prog, const criteo_set_t *set, int64_t first, int64_t n,
                 weft_ps_table_t *const *emb, weft_nn_mlp_t *mlp, int64_t dim, float *scores);

/**
 * The logloss and the exact AUC (tied scores get their mean rank; NAN without both classes) of
 * logits scores[0..n) for samples first .. first + n - 1 of @p set. @return 0, or -1 (no memory).
 */
int criteo_metrics(const criteo_set_t *set, int64_t first, int64_t n, const float *scores,
                   double *logloss_p, double *auc_p);

/**
 * criteo_score then criteo_metrics: the logloss and AUC of @p mlp with the rows of
 * @p emb as they are now on samples first .. first + n - 1 of @p set, CRITEO_EVAL_CHUNK at a time
 * (no gradients recorded). @return 0, or -1 after a message.
 */
int criteo_evaluate(const char *prog, const criteo_set_t *set, int64_t first, int64_t n,
                    weft_ps_table_t *const *emb, weft_nn_mlp_t *mlp, int64_t dim, double *logloss_p,
                    double *auc_p);

/** The planted model's logloss and AUC on samples first .. first + n - 1 (synthetic data), else
 * NAN both. */
void criteo_ceiling(const criteo_set_t *set, int64_t first, int64_t n, double *logloss_p,
                    double *auc_p);

/** Prints "planted model on the held-out split: ..." when @p ceil_auc is finite. */
void criteo_print_ceiling(double ceil_ll, double ceil_auc);

/** Prints "epoch E/N: train logloss L, held-out logloss H AUC A (ceiling C), T s, R samples/s". */
void criteo_print_epoch(int epoch, int epochs, double train_loss, double logloss, double auc,
                        double ceil_auc, double t_epoch, double rate);

/** Prints "final: held-out AUC A, ceiling C (gap G), logloss L, R samples/s, N steps, T s". */
void criteo_print_final(double auc, double ceil_auc, double logloss, double rate, int64_t steps,
                        double seconds);

#endif
