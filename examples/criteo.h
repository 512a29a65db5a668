/*
 * Click-through-rate data for examples/ctr_train: the Criteo display-advertising TSV format and a
 * synthetic generator of the same shape (criteo.c describes both).
 */
#ifndef WEFT_EXAMPLES_CRITEO_H
#define WEFT_EXAMPLES_CRITEO_H

#include <stdint.h>

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

#endif
