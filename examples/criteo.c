/*
 * Criteo display-advertising data for examples/ctr_train: a loader for the TSV format and a
 * synthetic generator of the same shape.
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
