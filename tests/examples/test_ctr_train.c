/*
 * examples/ctr_train under weftrun as a user would run it: 4 ranks, ranks 0 and 1 serve, ranks 2
 * and 3 work (rank 2, the first worker, prints). WEFTRUN is the launcher, CTR_TRAIN the example.
 * Its Criteo TSV loader is tested through the binary (--data on a small file written here), and
 * a short synthetic run must learn the planted model's signal. Every run has a 60 s deadline,
 * after which it is killed and the test fails.
 */

#include <criterion/criterion.h>

#include "example.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define LEAD "[rank 2] " /* the first worker */

static const example_t CTR_TRAIN = {.ranks = "4", .servers = "2", .prog_env = "CTR_TRAIN"};

/* Runs weftrun -n 4 --servers 2 ctr_train with the arguments. */
#define run_ctr(r, ...) example_run_with((r), &CTR_TRAIN, __VA_ARGS__)

/* A valid line: label, 13 integers, 26 categories; @p i varies the values, and some fields are
 * left empty as in Criteo's files. */
static void valid_line(FILE *f, int i)
{
    fprintf(f, "%d", i % 3 == 0);
    for (int j = 0; j < 13; j++) {
        if ((i + j) % 5 == 0) {
            fprintf(f, "\t"); /* empty */
        } else {
            fprintf(f, "\t%d", j == 1 ? i - 3 : (i * 7 + j) % 50); /* I2 may be negative */
        }
    }
    for (int c = 0; c < 26; c++) {
        if ((i + c) % 7 == 0) {
            fprintf(f, "\t");
        } else {
            fprintf(f, (i + c) % 2 == 0 ? "\t%08x" : "\t%08X",
                    (unsigned)(0x9e3779b1u * (unsigned)(i % 9 + 1) + (unsigned)c));
        }
    }
}

/* Writes 24 valid lines (one with CRLF) and 6 malformed ones to @p path. */
static void write_criteo(const char *path)
{
    FILE *f = fopen(path, "w");
    int valid = 0;

    cr_assert(f != NULL, "%s: %s", path, strerror(errno));
    for (int i = 0; i < 24; i++) {
        valid_line(f, i);
        fprintf(f, i == 5 ? "\r\n" : "\n");
        valid++;
        switch (i) {
        case 2: /* 39 fields: an unlabelled test-file line */
            fprintf(f, "1");
            for (int j = 0; j < 37; j++) {
                fprintf(f, "\t1");
            }
            fprintf(f, "\n");
            break;
        case 6: /* a label that is not 0 or 1 */
            fprintf(f, "2");
            valid_line(f, i);
            fprintf(f, "\n");
            break;
        case 9: /* an integer that does not parse */
            fprintf(f, "0\t12x");
            for (int j = 1; j < 13; j++) {
                fprintf(f, "\t%d", j);
            }
            for (int c = 0; c < 26; c++) {
                fprintf(f, "\t68fd1e64");
            }
            fprintf(f, "\n");
            break;
        case 13: /* a category that is not hexadecimal */
        case 17: /* a category of more than 8 digits */
            fprintf(f, "1");
            for (int j = 0; j < 13; j++) {
                fprintf(f, "\t%d", j);
            }
            for (int c = 0; c < 26; c++) {
                fprintf(f, "\t%s", c != 20 ? "68fd1e64" : i == 13 ? "68fd1g64" : "168fd1e64");
            }
            fprintf(f, "\n");
            break;
        case 20: /* an empty line */
            fprintf(f, "\n");
            break;
        default:
            break;
        }
    }
    cr_assert_eq(valid, 24);
    cr_assert(fclose(f) == 0);
}

Test(ctr_train, loads_criteo_tsv, .timeout = 120)
{
    char dir[128];
    char path[256];
    char want[512];
    result_t r;

    example_tmp_dir(dir, sizeof(dir), "ctr");
    snprintf(path, sizeof(path), "%s/day_0.tsv", dir);
    write_criteo(path);
    run_ctr(&r, "--data", path, "--epochs", "1", "--batch", "8", "--rows", "1000", "--json");
    assert_exit(&r, 0);
    snprintf(want, sizeof(want), LEAD "loaded 24 samples (6 skipped) from %s", path);
    assert_line_prefix(&r, want);
    /* 24 samples: the last 2 held out (10%, rounded down), 22 to train: 2 steps of 8. */
    assert_line_prefix(&r, LEAD "CTR model: 26 sparse tables (dim 16, 1000 rows, ");
    cr_assert(strstr(r.out, "22 train / 2 held-out samples, 2 steps per epoch") != NULL, "%s",
              r.out);
    assert_line_prefix(&r, LEAD "epoch 1/1: train logloss ");
    assert_line_prefix(&r, LEAD "final: held-out AUC ");
    /* No planted model for a file: no ceiling. */
    cr_assert(strstr(r.out, "\"ceiling\":null") != NULL, "%s", r.out);
    cr_assert(strstr(r.out, "\"train_samples\":22,\"eval_samples\":2") != NULL, "%s", r.out);
    result_free(&r);

    /* A file without one valid line. */
    FILE *f = fopen(path, "w");
    cr_assert(f != NULL);
    fprintf(f, "label\tI1\n\n");
    cr_assert(fclose(f) == 0);
    run_ctr(&r, "--data", path);
    assert_exit(&r, 2);
    snprintf(want, sizeof(want), "ctr_train: %s: no valid Criteo line (2 skipped)", path);
    assert_stderr_has(&r, want);
    result_free(&r);

    example_remove_dir(dir);
}

Test(ctr_train, missing_file_exits_2, .timeout = 90)
{
    result_t r;

    run_ctr(&r, "--data", "/nonexistent/day_0.tsv");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "ctr_train: cannot read Criteo data: /nonexistent/day_0.tsv: No such "
                          "file or directory");
    result_free(&r);

    run_ctr(&r, "--mode", "eventual");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "ctr_train: bad value 'eventual' for --mode");
    result_free(&r);
}

/* A short synthetic run in @p mode: the held-out AUC must come near the planted model's. */
static void learns(const char *mode)
{
    result_t r;
    const char *line;
    double auc = 0, ceiling = 0, gap = 0, logloss = 0;

    run_ctr(&r, "--samples", "150000", "--epochs", "1", "--mode", mode, "--json");
    assert_exit(&r, 0);
    assert_line_prefix(&r, LEAD "synthetic Criteo-like data: 150000 samples (seed 1, ");
    assert_line_prefix(&r, LEAD "planted model on the held-out split: logloss ");
    assert_line_prefix(&r, LEAD "epoch 1/1: train logloss ");
    line = run_find_line(r.out, LEAD "final: held-out AUC ", true);
    cr_assert(line != NULL, "no final line\nstdout:\n%s\nstderr:\n%s", r.out, r.err);
    cr_assert(sscanf(line, LEAD "final: held-out AUC %lf, ceiling %lf (gap %lf), logloss %lf", &auc,
                     &ceiling, &gap, &logloss) == 4,
              "%.300s", line);
    cr_assert(ceiling > 0.75 && ceiling < 1.0, "planted AUC %.4f", ceiling);
    /* A short run (135000 training samples, one epoch) comes within about 0.035 of it. */
    cr_assert(auc >= ceiling - 0.08, "%s: AUC %.4f, ceiling %.4f", mode, auc, ceiling);
    cr_assert(isfinite(logloss) && logloss < 0.5, "%s: held-out logloss %.4f", mode, logloss);
    cr_assert(strstr(r.out, "{\"system\":\"weft-ps\",\"example\":\"ctr_train\",\"mode\":") != NULL,
              "%s", r.out);
    cr_assert(strstr(r.out, "\"auc\":") != NULL && strstr(r.out, "\"samples_per_s\":") != NULL,
              "%s", r.out);
    result_free(&r);
}

Test(ctr_train, synthetic_sync_learns, .timeout = 120)
{
    learns("sync");
}

Test(ctr_train, synthetic_async_learns, .timeout = 120)
{
    learns("async");
}
