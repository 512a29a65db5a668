/*
 * Criteo display-advertising data for examples/ctr_train and examples/hybrid_train: a loader for
 * the TSV format and a synthetic generator of the same shape; then the CTR model's pieces the two
 * programs share (criteo.h).
 *
 * The TSV format (Criteo's Kaggle train.txt and the 1TB click logs' day_N files): one sample per
 * line, 40 tab-separated fields: the label (0 or 1), 13 integer features (counts; they may be
 * negative) and 26 categorical features (32-bit hashes written as 8 hexadecimal digits). Every
 * field but the label may be empty. The loader keeps what the model needs:
 *   - dense feature j: log(1 + max(x, 0)) (DLRM's preprocessing), 0 when empty;
 *   - categorical feature f: the hexadecimal value v reduced to an id 1 + v mod (rows - 1), so
 *     that it addresses a table of `rows` rows (the id_bound); id 0 stands for an empty field.
 * A line with another number of fields, a label other than 0 or 1, an integer that does not
 * parse or a category that is not 1 to 8 hexadecimal digits is skipped and counted. (Criteo's
 * unlabelled test files, with 39 fields, are not read.)
 *
 * The synthetic generator draws samples of that shape from a planted logistic model, so that the
 * best possible AUC is known (the planted model's own AUC on the same samples):
 *   - dense feature j (j = 0..12) is a count floor(exp(m_j + s_j z)), z ~ N(0, 1), with
 *     m_j = 0.5 + 2.5 j / 12 and s_j = 0.75 + 0.25 (j mod 3), empty with probability 0.05; the
 *     model sees x_j = log(1 + count) (0 when empty), as from the loader;
 *   - categorical feature f draws a rank r in [1, V] from Zipf(s) (P(r) proportional to r^-s;
 *     V = 10000 values per feature and s = 1.2 by default) and writes the id
 *     1 + hash(seed, f, r) mod (rows - 1): a fixed scatter of the values over the table;
 *   - the planted logit is b + sum_j a_j (x_j - m_j) / s_j + sum_f w_f(id_f), where a_j is drawn
 *     once from the seed (|a_j| in [0.15, 0.45], random sign), w_f(id) ~ N(0, 0.2^2) is drawn once
 *     per (feature, id) from a hash of (seed, f, id) (so two values that share an id share their
 *     weight, and the planted model is a function of what the learner sees), and b is set (by
 *     bisection, on the first 100000 samples) so that the mean click probability is 0.25,
 *     Criteo's rate;
 *   - the label is 1 with probability sigmoid(logit).
 * Everything comes from the seed: the same seed gives the same samples on every rank.
 */
#include "criteo.h"

#include "common.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <weft/weft.h>

#define N_FIELDS      (1 + CRITEO_DENSE + CRITEO_SPARSE)
#define SYNTH_MISSING 0.05
#define SYNTH_CTR     0.25
#define SYNTH_CALIB   100000 /* samples the bias is set on */
#define EMB_INIT      0.01
#define EMB_ACC       3e-5 /* Adagrad's initial accumulator for a batch of EMB_ACC_BATCH */
#define EMB_ACC_BATCH 1024
#define MAX_OPTS      64

/* ------------------------------------------------------------------ common */

void criteo_free(criteo_set_t *set)
{
    free(set->label);
    free(set->dense);
    free(set->cat);
    free(set->logit);
    memset(set, 0, sizeof(*set));
}

static int reserve(criteo_set_t *set, int64_t cap, int with_logit)
{
    uint8_t *label = realloc(set->label, (size_t)cap);
    float *dense;
    uint32_t *cat;

    if (label == NULL) {
        return -1;
    }
    set->label = label;
    dense = realloc(set->dense, (size_t)cap * CRITEO_DENSE * sizeof(*dense));
    if (dense == NULL) {
        return -1;
    }
    set->dense = dense;
    cat = realloc(set->cat, (size_t)cap * CRITEO_SPARSE * sizeof(*cat));
    if (cat == NULL) {
        return -1;
    }
    set->cat = cat;
    if (with_logit) {
        float *logit = realloc(set->logit, (size_t)cap * sizeof(*logit));

        if (logit == NULL) {
            return -1;
        }
        set->logit = logit;
    }
    return 0;
}

/* ------------------------------------------------------------------ loader */

static int parse_count(const char *s, const char *end, float *x_p)
{
    char buf[32];
    int64_t v = 0;
    size_t len = (size_t)(end - s);

    if (len == 0) {
        *x_p = 0.0f;
        return 0;
    }
    if (len >= sizeof(buf)) {
        return -1;
    }
    memcpy(buf, s, len);
    buf[len] = '\0';
    if (ex_parse_int(buf, INT64_MIN, INT64_MAX, &v) != 0) {
        return -1;
    }
    *x_p = v > 0 ? (float)log1p((double)v) : 0.0f;
    return 0;
}

static int parse_category(const char *s, const char *end, uint64_t rows, uint32_t *id_p)
{
    uint64_t v = 0;

    if (s == end) {
        *id_p = 0;
        return 0;
    }
    if (end - s > 8) {
        return -1;
    }
    for (const char *p = s; p < end; p++) {
        int d;

        if (*p >= '0' && *p <= '9') {
            d = *p - '0';
        } else if (*p >= 'a' && *p <= 'f') {
            d = *p - 'a' + 10;
        } else if (*p >= 'A' && *p <= 'F') {
            d = *p - 'A' + 10;
        } else {
            return -1;
        }
        v = v * 16 + (uint64_t)d;
    }
    *id_p = (uint32_t)(1 + v % (rows - 1));
    return 0;
}

/* One line (without its newline) into sample @p i. @return 0, or -1 when malformed. */
static int parse_line(char *line, uint64_t rows, criteo_set_t *set, int64_t i)
{
    const char *start[N_FIELDS];
    const char *stop[N_FIELDS];
    int n = 0;
    char *p = line;

    for (;;) {
        char *tab = strchr(p, '\t');
        char *end = tab != NULL ? tab : p + strlen(p);

        if (n == N_FIELDS) {
            return -1;
        }
        start[n] = p;
        stop[n] = end;
        n++;
        if (tab == NULL) {
            break;
        }
        p = tab + 1;
    }
    if (n != N_FIELDS || stop[0] - start[0] != 1 || (start[0][0] != '0' && start[0][0] != '1')) {
        return -1;
    }
    set->label[i] = (uint8_t)(start[0][0] - '0');
    for (int j = 0; j < CRITEO_DENSE; j++) {
        if (parse_count(start[1 + j], stop[1 + j], &set->dense[i * CRITEO_DENSE + j]) != 0) {
            return -1;
        }
    }
    for (int f = 0; f < CRITEO_SPARSE; f++) {
        int k = 1 + CRITEO_DENSE + f;

        if (parse_category(start[k], stop[k], rows, &set->cat[i * CRITEO_SPARSE + f]) != 0) {
            return -1;
        }
    }
    return 0;
}

int criteo_load(const char *prog, const char *path, uint64_t rows, criteo_set_t *set)
{
    FILE *f;
    char *line = NULL;
    size_t cap_line = 0;
    ssize_t len;
    int64_t cap = 0;
    int rc = 0;

    memset(set, 0, sizeof(*set));
    if (rows < 2) {
        fprintf(stderr, "%s: the tables need at least 2 rows\n", prog);
        return -1;
    }
    f = fopen(path, "r");
    if (f == NULL) {
        fprintf(stderr, "%s: cannot read Criteo data: %s: %s\n", prog, path, strerror(errno));
        return -1;
    }
    while ((len = getline(&line, &cap_line, f)) != -1) {
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) {
            line[--len] = '\0';
        }
        if (set->n == cap) {
            cap = cap > 0 ? 2 * cap : 4096;
            if (reserve(set, cap, 0) != 0) {
                fprintf(stderr, "%s: %s: out of memory after %lld samples\n", prog, path,
                        (long long)set->n);
                rc = -1;
                break;
            }
        }
        if (parse_line(line, rows, set, set->n) == 0) {
            set->n++;
        } else {
            set->skipped++;
        }
    }
    if (rc == 0 && ferror(f)) {
        fprintf(stderr, "%s: cannot read Criteo data: %s: %s\n", prog, path, strerror(errno));
        rc = -1;
    }
    if (rc == 0 && set->n == 0) {
        fprintf(stderr, "%s: %s: no valid Criteo line (%lld skipped)\n", prog, path,
                (long long)set->skipped);
        rc = -1;
    }
    free(line);
    fclose(f);
    if (rc != 0) {
        criteo_free(set);
    }
    return rc;
}

/* --------------------------------------------------------------- generator */

static uint64_t mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static uint64_t hash3(uint64_t seed, uint64_t a, uint64_t b)
{
    return mix64(mix64(mix64(seed) ^ a) ^ (b * 0xd6e8feb86659fd93ULL));
}

/* A uniform in (0, 1) from a hash. */
static double hash_unit(uint64_t h)
{
    return ((double)(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

/* The planted weight of id @p id of feature @p f: N(0, scale^2), from the hash (Box-Muller). */
static double planted_weight(uint64_t seed, int f, uint32_t id, double scale)
{
    uint64_t h = hash3(seed ^ 0x5eed0f1d5ULL, (uint64_t)f, id);
    double u1 = hash_unit(h);
    double u2 = hash_unit(mix64(h));

    return scale * sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

void criteo_synth_opts_init(criteo_synth_opts_t *o, int64_t n, uint64_t rows, uint64_t seed)
{
    memset(o, 0, sizeof(*o));
    o->n = n;
    o->rows = rows;
    o->seed = seed;
    o->zipf_s = 1.2;
    o->values = 10000;
    o->cat_scale = 0.2;
}

static double mean_ctr(const float *z, int64_t n, double b)
{
    double sum = 0;

    for (int64_t i = 0; i < n; i++) {
        sum += 1.0 / (1.0 + exp(-(z[i] + b)));
    }
    return sum / (double)n;
}

int criteo_synth(const criteo_synth_opts_t *o, criteo_set_t *set)
{
    const int64_t v = o->values;
    double *cdf = NULL;
    uint32_t *ids = NULL; /* [CRITEO_SPARSE, v]: the id of each feature's rank */
    float *wts = NULL;    /* [CRITEO_SPARSE, v]: its planted weight */
    double a[CRITEO_DENSE], m[CRITEO_DENSE], s[CRITEO_DENSE];
    double lo = -10.0, hi = 10.0;
    int64_t calib = o->n < SYNTH_CALIB ? o->n : SYNTH_CALIB;
    weft_rng_t rng;

    memset(set, 0, sizeof(*set));
    if (o->n < 1 || o->rows < 2 || o->values < 1) {
        return -1;
    }
    cdf = malloc((size_t)v * sizeof(*cdf));
    ids = malloc((size_t)v * CRITEO_SPARSE * sizeof(*ids));
    wts = malloc((size_t)v * CRITEO_SPARSE * sizeof(*wts));
    if (cdf == NULL || ids == NULL || wts == NULL || reserve(set, o->n, 1) != 0) {
        free(cdf);
        free(ids);
        free(wts);
        criteo_free(set);
        return -1;
    }
    set->n = o->n;
    for (int64_t r = 0; r < v; r++) {
        cdf[r] = (r > 0 ? cdf[r - 1] : 0.0) + pow((double)(r + 1), -o->zipf_s);
    }
    for (int f = 0; f < CRITEO_SPARSE; f++) {
        for (int64_t r = 0; r < v; r++) {
            uint32_t id = (uint32_t)(1 + hash3(o->seed, (uint64_t)f, (uint64_t)r) % (o->rows - 1));

            ids[f * v + r] = id;
            wts[f * v + r] = (float)planted_weight(o->seed, f, id, o->cat_scale);
        }
    }
    weft_rng_init(&rng, o->seed, 0xc71e0);
    for (int j = 0; j < CRITEO_DENSE; j++) {
        m[j] = 0.5 + 2.5 * j / (CRITEO_DENSE - 1);
        s[j] = 0.75 + 0.25 * (j % 3);
        a[j] = (0.15 + 0.3 * weft_rng_uniform(&rng)) * (weft_rng_uniform(&rng) < 0.5 ? -1 : 1);
    }
    for (int64_t i = 0; i < o->n; i++) {
        double logit = 0;

        for (int j = 0; j < CRITEO_DENSE; j++) {
            float x = 0.0f;

            if (weft_rng_uniform(&rng) >= SYNTH_MISSING) {
                double count = floor(exp(m[j] + s[j] * weft_rng_normal(&rng)));

                x = (float)log1p(count);
            }
            set->dense[i * CRITEO_DENSE + j] = x;
            logit += a[j] * ((double)x - m[j]) / s[j];
        }
        for (int f = 0; f < CRITEO_SPARSE; f++) {
            double u = weft_rng_uniform(&rng) * cdf[v - 1];
            int64_t l = 0, h = v - 1;

            while (l < h) { /* the first rank whose cumulative weight reaches u */
                int64_t mid = l + (h - l) / 2;

                if (cdf[mid] < u) {
                    l = mid + 1;
                } else {
                    h = mid;
                }
            }
            set->cat[i * CRITEO_SPARSE + f] = ids[f * v + l];
            logit += wts[f * v + l];
        }
        set->logit[i] = (float)logit;
    }
    free(cdf);
    free(ids);
    free(wts);
    for (int it = 0; it < 40; it++) { /* the bias that gives the mean rate SYNTH_CTR */
        double mid = 0.5 * (lo + hi);

        if (mean_ctr(set->logit, calib, mid) < SYNTH_CTR) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    for (int64_t i = 0; i < o->n; i++) {
        double p;

        set->logit[i] += (float)(0.5 * (lo + hi));
        p = 1.0 / (1.0 + exp(-(double)set->logit[i]));
        set->label[i] = weft_rng_uniform(&rng) < p;
    }
    return 0;
}

/* ------------------------------------------------------------------ options */

void criteo_cfg_defaults(criteo_cfg_t *c)
{
    memset(c, 0, sizeof(*c));
    c->epochs = 2;
    c->batch = 1024;
    c->lr = 0.002;
    c->emb_lr = 0.05;
    c->dim = 16;
    c->rows = 1000000;
    c->samples = 1000000;
    c->values = 10000;
    c->zipf = 1.2;
    c->hidden.n = 2;
    c->hidden.v[0] = 64;
    c->hidden.v[1] = 32;
    c->seed = 1;
    c->mode = WEFT_PS_SYNC;
    c->staleness = 2;
    c->threads = 1;
}

void criteo_cfg_usage(FILE *out)
{
    fprintf(out, "  --mode M        sync, async or bounded (default sync)\n"
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

int criteo_parse_opts(const char *prog, int argc, char **argv, criteo_cfg_t *c,
                      const ex_opt_t *extra, size_t n_extra, void (*usage)(FILE *out))
{
    const ex_opt_t own[] = {
        EX_INT("epochs", &c->epochs, 1, 100000),
        EX_I64("batch", &c->batch, 1, 1 << 22),
        EX_DOUBLE("lr", &c->lr, 0.0, 1e6),
        EX_DOUBLE("emb-lr", &c->emb_lr, 0.0, 1e6),
        EX_I64("dim", &c->dim, 1, 4096),
        EX_I64("rows", &c->rows, 2, UINT32_MAX),
        EX_SIZES("hidden", &c->hidden),
        EX_I64("samples", &c->samples, 2, 1LL << 31),
        EX_I64("values", &c->values, 1, 1 << 20),
        EX_DOUBLE("zipf", &c->zipf, 0.0, 10.0),
        EX_U64("seed", &c->seed, 0, INT64_MAX),
        EX_STR("data", &c->data),
        EX_MODE("mode", &c->mode),
        {"staleness", EX_OPT_I64, &c->staleness, 0, 1000000, 0, 0, &c->staleness_set},
        EX_INT("threads", &c->threads, 1, 256),
        EX_FLAG("json", &c->json),
    };
    const size_t n_own = sizeof(own) / sizeof(own[0]);
    ex_opt_t opts[MAX_OPTS];
    int rc;

    if (n_own + n_extra > MAX_OPTS) {
        fprintf(stderr, "%s: %zu options, at most %d\n", prog, n_own + n_extra, MAX_OPTS);
        return EX_EXIT_USAGE;
    }
    memcpy(opts, own, sizeof(own));
    if (n_extra > 0) {
        memcpy(opts + n_own, extra, n_extra * sizeof(*extra));
    }
    rc = ex_parse_opts(prog, argc, argv, opts, n_own + n_extra, usage);
    if (rc != 0) {
        return rc;
    }
    if (c->staleness_set && c->mode != WEFT_PS_BOUNDED) {
        fprintf(stderr, "%s: --staleness is for --mode bounded\n", prog);
        return EX_EXIT_USAGE;
    }
    return 0;
}

/* ------------------------------------------------------------------ tables */

void criteo_table_common(const criteo_cfg_t *c, weft_ps_table_spec_t *spec)
{
    spec->seed = c->seed;
    spec->consistency = c->mode;
    spec->staleness = c->mode == WEFT_PS_BOUNDED ? c->staleness : 0;
}

/* Adagrad's initial accumulator for the rows: a prior that keeps a row seen a few times from
 * moving far on those few samples (with 0, a row's first step is lr in every coordinate, whatever
 * the gradient; a second epoch then overfits and the held-out AUC falls). Gradients are of a
 * mean over the batch, so it scales with 1 / batch^2. */
static double emb_accumulator(const criteo_cfg_t *c)
{
    double r = (double)EMB_ACC_BATCH / (double)c->batch;

    return EMB_ACC * r * r;
}

int criteo_emb_tables_create(const char *prog, weft_ps_t *ps, const criteo_cfg_t *c,
                             weft_ps_table_t **emb)
{
    char name[32];
    weft_ps_table_spec_t spec;

    for (int f = 0; f < CRITEO_SPARSE; f++) {
        snprintf(name, sizeof(name), "emb.C%d", f + 1);
        weft_ps_table_spec_init(&spec, name, WEFT_PS_SPARSE);
        criteo_table_common(c, &spec);
        spec.dim = c->dim;
        spec.id_bound = (uint64_t)c->rows;
        spec.init = WEFT_PS_UNIFORM;
        spec.init_a = -EMB_INIT;
        spec.init_b = EMB_INIT;
        spec.optimizer = WEFT_PS_ADAGRAD;
        spec.adagrad.lr = c->emb_lr;
        spec.adagrad.initial_accumulator_value = emb_accumulator(c);
        if (ex_ps_table_create(prog, ps, &spec, &emb[f]) != 0) {
            return -1;
        }
    }
    return 0;
}

int criteo_synth_cfg(const char *prog, const criteo_cfg_t *c, int print, criteo_set_t *set)
{
    criteo_synth_opts_t so;
    double t0 = ex_now();
    int64_t pos = 0;

    criteo_synth_opts_init(&so, c->samples, (uint64_t)c->rows, c->seed);
    so.values = c->values;
    so.zipf_s = c->zipf;
    if (criteo_synth(&so, set) != 0) {
        fprintf(stderr, "%s: cannot generate %lld samples: out of memory\n", prog,
                (long long)c->samples);
        return -1;
    }
    if (print) {
        for (int64_t i = 0; i < set->n; i++) {
            pos += set->label[i];
        }
        printf("synthetic Criteo-like data: %lld samples (seed %llu, Zipf %g over %lld values per "
               "feature, click rate %.3f), made in %.1f s\n",
               (long long)set->n, (unsigned long long)c->seed, c->zipf, (long long)c->values,
               (double)pos / (double)set->n, ex_now() - t0);
    }
    return 0;
}

/* ------------------------------------------------------------------ lookups */

/*
 * Sorts @p n keys (id << 32 | position, positions ascending on entry) by id, keeping the
 * positions' order among equal ids: the order a sort of the whole keys gives. A stable LSD
 * radix sort over the id bits in use, 11 at a time, through @p tmp (n keys): a batch's few
 * hundred keys per feature took glibc's qsort (a merge sort calling a comparison) 8% of a
 * training step.
 */
static void sort_keys(uint64_t *keys, uint64_t *tmp, size_t n)
{
    uint64_t all = 0;
    for (size_t i = 0; i < n; i++) {
        all |= keys[i] >> 32;
    }
    uint64_t *src = keys, *dst = tmp;
    for (unsigned shift = 32; shift < 64 && (all >> (shift - 32)) != 0; shift += 11) {
        size_t count[2048] = {0};
        for (size_t i = 0; i < n; i++) {
            count[(src[i] >> shift) & 2047]++;
        }
        size_t at = 0;
        for (size_t d = 0; d < 2048; d++) {
            size_t c = count[d];
            count[d] = at;
            at += c;
        }
        for (size_t i = 0; i < n; i++) {
            dst[count[(src[i] >> shift) & 2047]++] = src[i];
        }
        uint64_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != keys) {
        memcpy(keys, src, n * sizeof(*keys));
    }
}

void criteo_lookup_free(criteo_lookup_t *lk)
{
    for (int f = 0; f < CRITEO_SPARSE; f++) {
        free(lk->ids[f]);
        weft_tensor_release(lk->pos[f]);
        weft_tensor_release(lk->rows[f]);
    }
    free(lk->keys);
    memset(lk, 0, sizeof(*lk));
}

/* Sorting (id << 32 | position) keys groups each id's samples. */
weft_status_t criteo_lookup_prepare(const criteo_set_t *set, const int64_t *idx, int64_t k,
                                    int64_t dim, criteo_lookup_t *lk)
{
    weft_status_t st = WEFT_OK;

    memset(lk, 0, sizeof(*lk));
    lk->k = k;
    lk->keys = malloc(2 * (size_t)k * sizeof(*lk->keys)); /* the keys, then sort_keys' room */
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
        sort_keys(lk->keys, lk->keys + k, (size_t)k);
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
        criteo_lookup_free(lk);
    }
    return st;
}

weft_status_t criteo_lookup_pull(weft_ps_table_t *const *emb, criteo_lookup_t *lk,
                                 weft_future_t **fs, int *n_p)
{
    for (int f = 0; f < CRITEO_SPARSE; f++) {
        weft_status_t st =
            weft_ps_pull_rows_async(emb[f], lk->ids[f], lk->n[f], lk->rows[f], 0, &fs[*n_p]);

        if (st != WEFT_OK) {
            return st;
        }
        (*n_p)++;
    }
    return WEFT_OK;
}

/* ------------------------------------------------------------------ forward and loss */

weft_status_t criteo_forward(weft_nn_mlp_t *mlp, const criteo_set_t *set, const int64_t *idx,
                             const criteo_lookup_t *lk, weft_tensor_t **z_p)
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
        st = weft_nn_mlp_forward(mlp, x, z_p);
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

weft_status_t criteo_loss(weft_nn_mlp_t *mlp, const criteo_set_t *set, const int64_t *idx,
                          criteo_lookup_t *lk, weft_tensor_t **loss_p)
{
    int64_t yshape[2] = {lk->k, 1};
    weft_tensor_t *y = NULL;
    weft_tensor_t *z = NULL;
    weft_status_t st = WEFT_OK;

    for (int f = 0; st == WEFT_OK && f < CRITEO_SPARSE; f++) {
        st = weft_tensor_set_requires_grad(lk->rows[f], 1);
    }
    if (st == WEFT_OK) {
        st = weft_tensor_empty(WEFT_F32, 2, yshape, &y);
    }
    if (st == WEFT_OK) {
        for (int64_t i = 0; i < lk->k; i++) {
            ((float *)weft_tensor_data(y))[i] = set->label[idx[i]];
        }
        st = criteo_forward(mlp, set, idx, lk, &z);
    }
    if (st == WEFT_OK) {
        st = bce_with_logits(z, y, loss_p);
    }
    weft_tensor_release(z);
    weft_tensor_release(y);
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

int criteo_score(const char *prog, const criteo_set_t *set, int64_t first, int64_t n,
                 weft_ps_table_t *const *emb, weft_nn_mlp_t *mlp, int64_t dim, float *scores)
{
    int64_t *idx = malloc(CRITEO_EVAL_CHUNK * sizeof(*idx));
    int prev = weft_grad_set_enabled(0);
    int rc = -1;

    if (idx == NULL) {
        fprintf(stderr, "%s: out of memory\n", prog);
        goto out;
    }
    for (int64_t start = 0; start < n; start += CRITEO_EVAL_CHUNK) {
        int64_t k = n - start < CRITEO_EVAL_CHUNK ? n - start : CRITEO_EVAL_CHUNK;
        weft_future_t *fs[CRITEO_SPARSE];
        int nf = 0;
        criteo_lookup_t lk;
        weft_tensor_t *z = NULL;
        weft_status_t st;

        for (int64_t i = 0; i < k; i++) {
            idx[i] = first + start + i;
        }
        st = criteo_lookup_prepare(set, idx, k, dim, &lk);
        if (st != WEFT_OK) {
            ex_fail(prog, "evaluate", st);
            goto out;
        }
        st = criteo_lookup_pull(emb, &lk, fs, &nf);
        if (st != WEFT_OK) {
            ex_fail(prog, "evaluate: pull", st);
        }
        if (ex_wait_all(prog, fs, nf, "evaluate: pull") != 0 || st != WEFT_OK) {
            criteo_lookup_free(&lk);
            goto out;
        }
        st = criteo_forward(mlp, set, idx, &lk, &z);
        criteo_lookup_free(&lk);
        if (st != WEFT_OK) {
            ex_fail(prog, "evaluate", st);
            goto out;
        }
        memcpy(scores + start, weft_tensor_data(z), (size_t)k * sizeof(*scores));
        weft_tensor_release(z);
    }
    rc = 0;
out:
    weft_grad_set_enabled(prev);
    free(idx);
    return rc;
}

int criteo_metrics(const criteo_set_t *set, int64_t first, int64_t n, const float *scores,
                   double *logloss_p, double *auc_p)
{
    scored_t *s = malloc((size_t)n * sizeof(*s));
    double loss = 0;

    if (s == NULL) {
        return -1;
    }
    for (int64_t i = 0; i < n; i++) {
        s[i].score = scores[i];
        s[i].label = set->label[first + i];
        loss += bce(scores[i], s[i].label);
    }
    *logloss_p = loss / (double)n;
    *auc_p = auc(s, n);
    free(s);
    return 0;
}

int criteo_evaluate(const char *prog, const criteo_set_t *set, int64_t first, int64_t n,
                    weft_ps_table_t *const *emb, weft_nn_mlp_t *mlp, int64_t dim, double *logloss_p,
                    double *auc_p)
{
    float *scores = malloc((size_t)n * sizeof(*scores));
    int rc = -1;

    if (scores == NULL) {
        fprintf(stderr, "%s: out of memory\n", prog);
        return -1;
    }
    if (criteo_score(prog, set, first, n, emb, mlp, dim, scores) == 0) {
        rc = criteo_metrics(set, first, n, scores, logloss_p, auc_p);
        if (rc != 0) {
            fprintf(stderr, "%s: out of memory\n", prog);
        }
    }
    free(scores);
    return rc;
}

void criteo_ceiling(const criteo_set_t *set, int64_t first, int64_t n, double *logloss_p,
                    double *auc_p)
{
    *logloss_p = NAN;
    *auc_p = NAN;
    if (set->logit != NULL) {
        criteo_metrics(set, first, n, set->logit + first, logloss_p, auc_p);
    }
}

/* ------------------------------------------------------------------ reports */

void criteo_print_ceiling(double ceil_ll, double ceil_auc)
{
    if (isfinite(ceil_auc)) {
        printf("planted model on the held-out split: logloss %.4f, AUC %.4f (the ceiling)\n",
               ceil_ll, ceil_auc);
    }
}

void criteo_print_epoch(int epoch, int epochs, double train_loss, double logloss, double auc,
                        double ceil_auc, double t_epoch, double rate)
{
    printf("epoch %d/%d: train logloss %.4f, held-out logloss %.4f AUC %.4f", epoch + 1, epochs,
           train_loss, logloss, auc);
    if (isfinite(ceil_auc)) {
        printf(" (ceiling %.4f)", ceil_auc);
    }
    printf(", %.1f s, %.0f samples/s\n", t_epoch, rate);
}

void criteo_print_final(double auc, double ceil_auc, double logloss, double rate, int64_t steps,
                        double seconds)
{
    printf("final: held-out AUC %.4f", auc);
    if (isfinite(ceil_auc)) {
        printf(", ceiling %.4f (gap %.4f)", ceil_auc, ceil_auc - auc);
    }
    printf(", logloss %.4f, %.0f samples/s, %lld steps, %.1f s\n", logloss, rate, (long long)steps,
           seconds);
}
