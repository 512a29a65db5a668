/*
 * examples/hybrid_train, the main job, under weftrun as a user would run it: 4 ranks, ranks 0
 * and 1 serve the embedding tables, ranks 2 and 3 train the replicated MLP under the DDP reducer
 * (rank 2, the first trainer, prints). WEFTRUN is the launcher, HYBRID_TRAIN the example. The
 * runs train on a small synthetic set (60000 samples: 54000 to train, 52 steps of 1024 an epoch,
 * about 2 s); every run has a 60 s deadline, after which it is killed and the test fails.
 */

#include <criterion/criterion.h>

#include "example.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define LEAD    "[rank 2] " /* the first trainer */
#define SAMPLES "60000"
#define STEPS   52 /* per epoch: 54000 training samples / 1024 */

static const example_t HYBRID = {.ranks = "4", .servers = "2", .prog_env = "HYBRID_TRAIN"};

/* Runs weftrun -n 4 --servers 2 hybrid_train --samples SAMPLES with the arguments. */
#define run_hybrid(r, ...) example_run_with((r), &HYBRID, "--samples", SAMPLES, __VA_ARGS__)

/* ------------------------------------------------------------------ what it prints */

/* The number after "KEY": in the lead's JSON line; NAN for null; fails the test if missing. */
static double json_field(const result_t *r, const char *key)
{
    const char *line = run_find_line(r->out, LEAD "{\"system\":\"weft\",", true);
    char want[64];
    const char *at;
    char *end = NULL;
    double v;

    cr_assert(line != NULL, "no JSON line\nstdout:\n%s\nstderr:\n%s", r->out, r->err);
    snprintf(want, sizeof(want), "\"%s\":", key);
    at = strstr(line, want);
    cr_assert(at != NULL && at < strchr(line, '\n'), "no %s in %.600s", key, line);
    at += strlen(want);
    if (strncmp(at, "null", 4) == 0) {
        return NAN;
    }
    v = strtod(at, &end);
    cr_assert(end != at && (*end == ',' || *end == '}'), "%s: %.40s", key, at);
    return v;
}

/* The held-out AUC and logloss of the lead's line for epoch @p epoch of @p epochs. */
static void epoch_auc(const result_t *r, int epoch, int epochs, double *auc_p, double *ll_p)
{
    char want[64];
    const char *line;
    double train = 0, secs = 0, rate = 0;

    snprintf(want, sizeof(want), LEAD "epoch %d/%d: train logloss ", epoch, epochs);
    line = run_find_line(r->out, want, true);
    cr_assert(line != NULL, "no line for epoch %d\nstdout:\n%s\nstderr:\n%s", epoch, r->out,
              r->err);
    cr_assert(sscanf(line,
                     LEAD "epoch %*d/%*d: train logloss %lf, held-out logloss %lf AUC %lf "
                          "(ceiling %*f), %lf s, %lf samples/s",
                     &train, ll_p, auc_p, &secs, &rate) == 5,
              "%.300s", line);
    cr_assert(isfinite(train) && *auc_p > 0.5 && *auc_p < 1.0 && rate > 0.0, "%.300s", line);
}

/* The final line: held-out AUC and the planted model's (the ceiling). */
static void final_auc(const result_t *r, double *auc_p, double *ceiling_p)
{
    const char *line = run_find_line(r->out, LEAD "final: held-out AUC ", true);
    double gap = 0, logloss = 0;

    cr_assert(line != NULL, "no final line\nstdout:\n%s\nstderr:\n%s", r->out, r->err);
    cr_assert(sscanf(line, LEAD "final: held-out AUC %lf, ceiling %lf (gap %lf), logloss %lf",
                     auc_p, ceiling_p, &gap, &logloss) == 4,
              "%.300s", line);
}

/* The hash of the trainers' replicas, which they found bit-identical. */
static unsigned long long replicas_hash(const result_t *r)
{
    const char *line = run_find_line(
        r->out, LEAD "dense replicas bit-identical on all 2 trainers (fnv1a64 ", true);
    unsigned long long h = 0;

    cr_assert(line != NULL, "no replica line\nstdout:\n%s\nstderr:\n%s", r->out, r->err);
    cr_assert(
        sscanf(line, LEAD "dense replicas bit-identical on all 2 trainers (fnv1a64 %llx)", &h) == 1,
        "%.200s", line);
    return h;
}

/* The steps of the "checkpoint at step N in DIR" lines: how many, and the last (-1: none). */
static int checkpoints(const result_t *r, const char *dir, long long *last_p)
{
    char want[256];
    int n = 0;

    snprintf(want, sizeof(want), LEAD "checkpoint at step %%lld in %s (", dir);
    *last_p = -1;
    for (const char *at = strstr(r->out, LEAD "checkpoint at step "); at != NULL;
         at = strstr(at + 1, LEAD "checkpoint at step ")) {
        cr_assert(sscanf(at, want, last_p) == 1, "%.200s", at);
        n++;
    }
    return n;
}

/* Whether @p dir holds @p name. */
static bool has_file(const char *dir, const char *name)
{
    char path[256];

    snprintf(path, sizeof(path), "%s/%s", dir, name);
    return access(path, F_OK) == 0;
}

/* ------------------------------------------------------------------ training */

/* Two epochs in @p mode: per-epoch lines, the AUC near the planted model's, replicas identical,
 * and the JSON line a benchmark runner reads. */
static void learns(const char *mode)
{
    result_t r;
    double auc1 = 0, auc2 = 0, ll1 = 0, ll2 = 0, auc = 0, ceiling = 0;
    char want[128];

    run_hybrid(&r, "--epochs", "2", "--mode", mode, "--json");
    assert_exit(&r, 0);
    assert_line_prefix(&r, LEAD "synthetic Criteo-like data: " SAMPLES " samples (seed 1, ");
    snprintf(want, sizeof(want), "replicated on 2 trainers (DDP, Adam lr 0.002); batch 1024, %s",
             mode);
    cr_assert(strstr(r.out, want) != NULL, "%s", r.out);
    cr_assert(strstr(r.out, "on 2 servers, MLP 429-64-32-1 (29633 parameters)") != NULL, "%s",
              r.out);
    assert_line_prefix(&r, LEAD "planted model on the held-out split: logloss ");
    assert_line_prefix(&r, LEAD "epoch 1/2 [");                    /* progress */
    cr_assert(strstr(r.out, " samples/s\n") != NULL, "%s", r.out); /* ... with its rate */
    epoch_auc(&r, 1, 2, &auc1, &ll1);
    epoch_auc(&r, 2, 2, &auc2, &ll2);
    final_auc(&r, &auc, &ceiling);
    cr_assert(ceiling > 0.8 && ceiling < 0.9, "planted AUC %.4f", ceiling);
    /* 2 epochs of 54000 samples come within about 0.035 of it; the second epoch learns. */
    cr_assert(auc == auc2 && auc >= ceiling - 0.06, "%s: AUC %.4f, ceiling %.4f", mode, auc,
              ceiling);
    cr_assert(auc2 > auc1 && ll2 < ll1 && ll2 < 0.5, "%s: %.4f %.4f -> %.4f %.4f", mode, auc1, ll1,
              auc2, ll2);
    replicas_hash(&r);
    cr_assert(strstr(r.out, "DIFFER") == NULL, "%s", r.out);

    snprintf(want, sizeof(want),
             LEAD "{\"system\":\"weft\",\"example\":\"hybrid_train\",\"mode\":\"%s\",", mode);
    assert_line_prefix(&r, want);
    cr_assert(fabs(json_field(&r, "auc") - auc) < 1e-4, "%s", r.out);
    cr_assert(fabs(json_field(&r, "logloss") - ll2) < 1e-4, "%s", r.out);
    cr_assert(json_field(&r, "samples_per_s") > 1000.0, "%s", r.out);
    cr_assert(json_field(&r, "peak_rss_mb") > 10.0 && json_field(&r, "peak_rss_mb") < 4096.0, "%s",
              r.out);
    cr_assert(json_field(&r, "peak_rss_mb_total") >= json_field(&r, "peak_rss_mb"), "%s", r.out);
    cr_assert(json_field(&r, "wall_s") > 0.0 && json_field(&r, "wall_s") < 60.0, "%s", r.out);
    cr_assert(json_field(&r, "epochs") == 2 && json_field(&r, "epochs_run") == 2, "%s", r.out);
    cr_assert(json_field(&r, "steps") == 2 * STEPS && json_field(&r, "trainers") == 2, "%s", r.out);
    cr_assert(isnan(json_field(&r, "time_to_target_s")), "%s", r.out);
    cr_assert(strstr(r.out, "\"peak_rss_mb_ranks\":[") != NULL, "%s", r.out);
    cr_assert(strstr(r.out, "\"replicas_identical\":true}") != NULL, "%s", r.out);
    result_free(&r);
}

Test(hybrid_train, sync_learns, .timeout = 120)
{
    learns("sync");
}

Test(hybrid_train, async_learns, .timeout = 120)
{
    learns("async");
}

/* Bounded staleness, with the AUC measured within epochs too and a time to a target. */
Test(hybrid_train, bounded_with_eval_every_and_target, .timeout = 120)
{
    result_t r;
    double tt;

    run_hybrid(&r, "--epochs", "1", "--mode", "bounded", "--staleness", "1", "--eval-every", "20",
               "--target-auc", "0.7", "--json");
    assert_exit(&r, 0);
    cr_assert(strstr(r.out, "batch 1024, bounded (staleness 1);") != NULL, "%s", r.out);
    assert_line_prefix(&r, LEAD "step 20: held-out logloss ");
    assert_line_prefix(&r, LEAD "step 40: held-out logloss ");
    cr_assert(run_find_line(r.out, LEAD "step 52: ", true) == NULL, "%s", r.out); /* epoch line */
    assert_line_prefix(&r, LEAD "epoch 1/1: train logloss ");
    replicas_hash(&r);
    tt = json_field(&r, "time_to_target_s");
    cr_assert(isfinite(tt) && tt > 0.0 && tt <= json_field(&r, "train_s"), "%s", r.out);
    cr_assert(json_field(&r, "target_auc") == 0.7, "%s", r.out);
    result_free(&r);
}

/* A Criteo TSV file through --data. */
Test(hybrid_train, trains_on_a_criteo_file, .timeout = 120)
{
    char dir[128];
    char path[256];
    char want[512];
    result_t r;
    FILE *f;

    example_tmp_dir(dir, sizeof(dir), "hybrid_tsv");
    snprintf(path, sizeof(path), "%s/day_0.tsv", dir);
    f = fopen(path, "w");
    cr_assert(f != NULL, "%s: %s", path, strerror(errno));
    for (int i = 0; i < 400; i++) {
        fprintf(f, "%d", (i * 7) % 3 == 0);
        for (int j = 0; j < 13; j++) {
            if ((i + j) % 6 == 0) {
                fprintf(f, "\t"); /* empty */
            } else {
                fprintf(f, "\t%d", (i * 13 + j * 5) % 40);
            }
        }
        for (int c = 0; c < 26; c++) {
            fprintf(f, "\t%08x",
                    (unsigned)(0x9e3779b1u * (unsigned)(i % (c + 3) + 1) + (unsigned)c));
        }
        fprintf(f, "\n");
    }
    fprintf(f, "not a Criteo line\n");
    cr_assert(fclose(f) == 0);
    run_hybrid(&r, "--data", path, "--epochs", "2", "--batch", "64", "--rows", "5000", "--json");
    assert_exit(&r, 0);
    snprintf(want, sizeof(want), LEAD "loaded 400 samples (1 skipped) from %s", path);
    assert_line(&r, want);
    /* 40 held out, 360 to train: 5 steps of 64. No planted model: no ceiling. */
    cr_assert(strstr(r.out, "360 train / 40 held-out samples, 5 steps per epoch") != NULL, "%s",
              r.out);
    assert_line_prefix(&r, LEAD "epoch 2/2: train logloss ");
    cr_assert(run_find_line(r.out, LEAD "planted model", true) == NULL, "%s", r.out);
    replicas_hash(&r);
    cr_assert(isnan(json_field(&r, "ceiling")) && json_field(&r, "steps") == 10, "%s", r.out);
    result_free(&r);
    example_remove_dir(dir);
}

/* ------------------------------------------------------------------ checkpoints */

/* One epoch with a checkpoint, then --resume to two: the replicas end bit-identical to an
 * uninterrupted two-epoch run's (sync mode), with the same held-out AUC. */
Test(hybrid_train, checkpoint_then_resume_is_exact, .timeout = 180)
{
    char dir[128];
    char want[256];
    char name[64];
    result_t r;
    unsigned long long whole;
    double auc_whole = 0, auc = 0, ceiling = 0;
    long long last = -1;

    example_tmp_dir(dir, sizeof(dir), "hybrid_ck");
    run_hybrid(&r, "--epochs", "2");
    assert_exit(&r, 0);
    whole = replicas_hash(&r);
    final_auc(&r, &auc_whole, &ceiling);
    result_free(&r);

    run_hybrid(&r, "--epochs", "1", "--checkpoint-dir", dir);
    assert_exit(&r, 0);
    cr_assert_eq(checkpoints(&r, dir, &last), 1, "%s", r.out); /* the epoch's end: no second */
    cr_assert_eq(last, STEPS);
    cr_assert(has_file(dir, "MANIFEST"), "no MANIFEST in %s", dir);
    snprintf(name, sizeof(name), "hybrid_train.dense.%d", STEPS);
    cr_assert(has_file(dir, name), "no %s in %s", name, dir);
    result_free(&r);

    run_hybrid(&r, "--epochs", "2", "--resume", dir);
    assert_exit(&r, 0);
    snprintf(want, sizeof(want),
             LEAD "resumed at step %d from %s: continuing with epoch 2, step 1 of %d", STEPS, dir,
             STEPS);
    assert_line(&r, want);
    cr_assert(run_find_line(r.out, LEAD "epoch 1/2: ", true) == NULL, "%s", r.out);
    assert_line_prefix(&r, LEAD "epoch 2/2: train logloss ");
    final_auc(&r, &auc, &ceiling);
    cr_assert_eq(auc, auc_whole);
    cr_assert_eq(replicas_hash(&r), whole, "resumed %016llx, uninterrupted %016llx",
                 replicas_hash(&r), whole);
    result_free(&r);

    /* Nothing left to train: the checkpoint is scored again. */
    run_hybrid(&r, "--epochs", "1", "--resume", dir);
    assert_exit(&r, 0);
    assert_line(&r, LEAD "nothing left to train for --epochs 1");
    result_free(&r);
    example_remove_dir(dir);
}

/* A job killed (SIGTERM to weftrun) once it has saved step 20, resumed from whatever checkpoint
 * it left (mid-epoch): it ends with the replicas of an uninterrupted run. */
Test(hybrid_train, a_killed_job_resumes_mid_epoch, .timeout = 180)
{
    char dir[128];
    result_t r;
    unsigned long long whole;
    long long saved = -1;
    long long v[4] = {-1, -1, -1, -1};

    example_tmp_dir(dir, sizeof(dir), "hybrid_kill");
    run_hybrid(&r, "--epochs", "2");
    assert_exit(&r, 0);
    whole = replicas_hash(&r);
    result_free(&r);

    {
        const char *const args[] = {
            "--samples",          SAMPLES, "--epochs", "2", "--checkpoint-dir", dir,
            "--checkpoint-every", "10",    NULL};
        example_t ex = HYBRID;

        ex.sig = SIGTERM;
        ex.sig_when = LEAD "checkpoint at step 20 in ";
        example_run(&r, &ex, args);
    }
    checkpoints(&r, dir, &saved);
    cr_assert(saved >= 20, "no checkpoint at step 20 or later\nstdout:\n%s\nstderr:\n%s", r.out,
              r.err);
    result_free(&r);

    run_hybrid(&r, "--epochs", "2", "--resume", dir);
    assert_exit(&r, 0);
    example_resumed_at(&r, LEAD, dir, v); /* step, epoch, position, steps per epoch */
    /* The last checkpoint it printed, or one it completed as it was killed. */
    cr_assert(v[0] >= saved && (v[0] % 10 == 0 || v[0] == 2 * STEPS), "step %lld (saved %lld)",
              v[0], saved);
    cr_assert(v[3] == STEPS && v[1] == v[0] / v[3] + 1 && v[2] == v[0] % v[3] + 1,
              "%lld %lld %lld %lld", v[0], v[1], v[2], v[3]);
    cr_assert_eq(replicas_hash(&r), whole, "resumed %016llx, uninterrupted %016llx",
                 replicas_hash(&r), whole);
    result_free(&r);
    example_remove_dir(dir);
}

/* A checkpoint that does not fit this run, or whose dense file is damaged: exit 2, saying why. */
Test(hybrid_train, a_checkpoint_that_does_not_fit_exits_2, .timeout = 180)
{
    char dir[128];
    char path[256];
    char want[512];
    result_t r;

    example_tmp_dir(dir, sizeof(dir), "hybrid_fit");
    run_hybrid(&r, "--epochs", "1", "--checkpoint-dir", dir);
    assert_exit(&r, 0);
    result_free(&r);

    /* Other data: the step would mean other samples. */
    example_run_with(&r, &HYBRID, "--samples", "50000", "--epochs", "2", "--resume", dir);
    assert_exit(&r, 2);
    snprintf(want, sizeof(want),
             "hybrid_train: the checkpoint in %s was written with batch 1024 samples 54000 "
             "trainers 2 seed 1 parameters 29633, this run has batch 1024 samples 45000 trainers 2 "
             "seed 1 parameters 29633",
             dir);
    assert_stderr_has(&r, want);
    result_free(&r);

    /* Another table spec (the embeddings' dimension): the parameter server refuses it. */
    run_hybrid(&r, "--epochs", "2", "--dim", "8", "--resume", dir);
    assert_exit(&r, 2);
    assert_stderr_has(&r, "hybrid_train: resume: WEFT_ERR_MISMATCH: ");
    result_free(&r);

    /* A dense file cut short. */
    snprintf(path, sizeof(path), "%s/hybrid_train.dense.%d", dir, STEPS);
    cr_assert(truncate(path, 1000) == 0, "%s: %s", path, strerror(errno));
    run_hybrid(&r, "--epochs", "2", "--resume", dir);
    assert_exit(&r, 2);
    snprintf(want, sizeof(want),
             "hybrid_train: resume: %s is not a dense replica of step %d written by this program "
             "(truncated or corrupt)",
             path, STEPS);
    assert_stderr_has(&r, want);
    result_free(&r);

    /* No checkpoint at all. */
    run_hybrid(&r, "--resume", "/nonexistent/hybrid");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "hybrid_train: resume: WEFT_ERR_NOT_FOUND: ");
    result_free(&r);
    example_remove_dir(dir);
}

/* ------------------------------------------------------------------ options */

Test(hybrid_train, bad_options_exit_2, .timeout = 120)
{
    static const struct {
        const char *args[4];
        const char *says;
    } cases[] = {
        {{"--mode", "eventual"}, "hybrid_train: bad value 'eventual' for --mode"},
        {{"--staleness", "3"}, "hybrid_train: --staleness is for --mode bounded"},
        {{"--checkpoint-every", "5"}, "hybrid_train: --checkpoint-every needs --checkpoint-dir"},
        {{"--batch", "0"}, "hybrid_train: bad value '0' for --batch"},
        {{"--target-auc", "1.5"}, "hybrid_train: bad value '1.5' for --target-auc"},
        {{"--epochs", "2", "extra"}, "hybrid_train: unexpected argument 'extra'"},
        {{"--data", "/nonexistent/day_0.tsv"},
         "hybrid_train: cannot read Criteo data: /nonexistent/day_0.tsv: No such file"},
    };
    result_t r;

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const char *const *a = cases[i].args;

        if (a[2] != NULL) {
            example_run_with(&r, &HYBRID, a[0], a[1], a[2]);
        } else {
            example_run_with(&r, &HYBRID, a[0], a[1]);
        }
        assert_exit(&r, 2);
        assert_stderr_has(&r, cases[i].says);
        result_free(&r);
    }

    /* --help is not an error, and names the options a benchmark runner looks for. */
    example_run_with(&r, &HYBRID, "--help");
    assert_exit(&r, 0);
    cr_assert(strstr(r.out, "--checkpoint-every N") != NULL &&
                  strstr(r.out, "--resume D") != NULL && strstr(r.out, "--eval-every N") != NULL &&
                  strstr(r.out, "--target-auc X") != NULL,
              "%s", r.out);
    result_free(&r);
}
