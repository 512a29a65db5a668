/*
 * examples/pipeline_ddp under weftrun as a user would run it (WEFTRUN the launcher, PIPELINE_DDP
 * the example): rank 0 the master, ranks 1 and 2 stage 1's replicas, ranks 3 and 4 stage 2's.
 * The assertions are exact properties, not timings: both throughput lines and the ratio line of
 * --compare, the warm-up step's check (averaging two pipelines' halves gives one pipeline's
 * gradient of the whole batch), the twins of each stage bit-identical, how many forward passes
 * and steps each stage object ran, the JSON line (parsed), and the exit statuses of bad command
 * lines. The training run skips when Fashion-MNIST is not installed.
 */

#include <criterion/criterion.h>

#include "example.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const example_t PDDP5 = {.ranks = "5", .prog_env = "PIPELINE_DDP", .deadline_s = 240.0};
static const example_t PDDP4 = {.ranks = "4", .prog_env = "PIPELINE_DDP", .deadline_s = 120.0};
static const example_t PDDP1 = {.ranks = "1", .prog_env = "PIPELINE_DDP", .deadline_s = 120.0};

/* How many times @p want occurs in stdout. */
static int count(const result_t *r, const char *want)
{
    int n = 0;

    for (const char *at = strstr(r->out, want); at != NULL; at = strstr(at + 1, want)) {
        n++;
    }
    return n;
}

/* ------------------------------------------------------------------ a flat JSON object */

#define MAX_FIELDS 32

typedef enum { J_NUM, J_STR, J_BOOL, J_NULL } jkind_t;

typedef struct {
    char key[48];
    jkind_t kind;
    double num;
} jfield_t;

typedef struct {
    int n;
    jfield_t f[MAX_FIELDS];
} jobj_t;

static const char *skip_ws(const char *p)
{
    while (*p == ' ' || *p == '\t') {
        p++;
    }
    return p;
}

/* Parses the flat JSON object (string keys; number, string, true, false or null values) that
 * starts at @p p and ends its line. @return 0, or -1 if it is not one. */
static int json_parse(const char *p, jobj_t *o)
{
    memset(o, 0, sizeof(*o));
    p = skip_ws(p);
    if (*p++ != '{') {
        return -1;
    }
    p = skip_ws(p);
    if (*p == '}') {
        p++;
        goto end;
    }
    for (;;) {
        jfield_t *f;
        size_t n = 0;

        if (o->n == MAX_FIELDS) {
            return -1;
        }
        f = &o->f[o->n++];
        p = skip_ws(p);
        if (*p++ != '"') {
            return -1;
        }
        while (*p != '"' && *p != '\0' && *p != '\n' && n + 1 < sizeof(f->key)) {
            f->key[n++] = *p++;
        }
        if (*p++ != '"') {
            return -1;
        }
        p = skip_ws(p);
        if (*p++ != ':') {
            return -1;
        }
        p = skip_ws(p);
        if (*p == '"') {
            p++;
            while (*p != '"' && *p != '\0' && *p != '\n') {
                p += *p == '\\' && p[1] != '\0' ? 2 : 1;
            }
            if (*p++ != '"') {
                return -1;
            }
            f->kind = J_STR;
        } else if (strncmp(p, "true", 4) == 0 || strncmp(p, "false", 5) == 0) {
            f->kind = J_BOOL;
            f->num = *p == 't';
            p += *p == 't' ? 4 : 5;
        } else if (strncmp(p, "null", 4) == 0) {
            f->kind = J_NULL;
            p += 4;
        } else {
            char *end;
            f->num = strtod(p, &end);
            if (end == p || !(*p == '-' || isdigit((unsigned char)*p))) {
                return -1;
            }
            f->kind = J_NUM;
            p = end;
        }
        p = skip_ws(p);
        if (*p == ',') {
            p++;
            continue;
        }
        if (*p++ != '}') {
            return -1;
        }
        break;
    }
end:
    p = skip_ws(p);
    return *p == '\n' || *p == '\0' ? 0 : -1;
}

static const jfield_t *json_get(const jobj_t *o, const char *key)
{
    for (int i = 0; i < o->n; i++) {
        if (strcmp(o->f[i].key, key) == 0) {
            return &o->f[i];
        }
    }
    return NULL;
}

/* The master's JSON line, parsed into @p o. */
static void json_line(const result_t *r, jobj_t *o)
{
    const char *prefix = "[rank 0] {\"system\":\"weft\",\"model\":\"pipeline_ddp\",";
    const char *line = find_line(r->out, prefix, true);

    cr_assert(line != NULL, "no JSON line\nstdout:\n%s\nstderr:\n%s", r->out, r->err);
    cr_assert(json_parse(line + strlen("[rank 0] "), o) == 0, "not a flat JSON object: %.600s",
              line);
}

/* Field @p key of @p o is a finite number (returned), or null when @p null_ok. */
static double json_num(const jobj_t *o, const char *key, bool null_ok)
{
    const jfield_t *f = json_get(o, key);

    cr_assert(f != NULL, "JSON lacks %s", key);
    if (null_ok && f->kind == J_NULL) {
        return NAN;
    }
    cr_assert(f->kind == J_NUM && isfinite(f->num), "JSON %s is not a number", key);
    return f->num;
}

static void json_null(const jobj_t *o, const char *key)
{
    const jfield_t *f = json_get(o, key);

    cr_assert(f != NULL && f->kind == J_NULL, "JSON %s is not null", key);
}

/* ------------------------------------------------------------------ the lines */

/* "[rank 0] replicas = R, splits = K, samples/s = X": X, which must be positive. */
static double rate_line(const result_t *r, int replicas, int splits)
{
    char want[96];
    const char *line;
    double x = -1;

    snprintf(want, sizeof(want), "[rank 0] replicas = %d, splits = %d, samples/s = ", replicas,
             splits);
    line = find_line(r->out, want, true);
    cr_assert(line != NULL, "missing: %s\nstdout:\n%s\nstderr:\n%s", want, r->out, r->err);
    cr_assert(sscanf(line + strlen(want), "%lf", &x) == 1 && isfinite(x) && x > 0.0, "%.200s",
              line);
    return x;
}

/* The warm-up step of @p replicas: every parameter of both stages got an averaged gradient. */
static void warmup_line(const result_t *r, int replicas, double *loss, double *sq1, double *sq2)
{
    char want[64];
    const char *line;
    int g1 = 0, p1 = 0, g2 = 0, p2 = 0;

    snprintf(want, sizeof(want), "[rank 0] replicas %d warm-up step: loss ", replicas);
    line = find_line(r->out, want, true);
    cr_assert(line != NULL, "no warm-up line for %d replicas\nstdout:\n%s\nstderr:\n%s", replicas,
              r->out, r->err);
    cr_assert(sscanf(line + strlen(want),
                     "%lf, averaged gradients for %d of %d parameters on stage 1 (sum of squares "
                     "%lf) and %d of %d on stage 2 (%lf)",
                     loss, &g1, &p1, sq1, &g2, &p2, sq2) == 7,
              "%.300s", line);
    cr_assert(g1 == 4 && p1 == 4 && g2 == 4 && p2 == 4, "%.300s", line);
    cr_assert(isfinite(*loss) && *loss > 0.0 && *sq1 > 0.0 && *sq2 > 0.0 && isfinite(*sq1) &&
                  isfinite(*sq2),
              "%.300s", line);
}

/* Both stages' "stage K replicas bit-identical: yes (fnv1a64 H, WHEN)", once each. */
static void assert_identical(const result_t *r, const char *when)
{
    for (int k = 1; k <= 2; k++) {
        char prefix[64];
        char suffix[96];
        const char *line;
        int n = 0;

        snprintf(prefix, sizeof(prefix), "[rank 0] stage %d replicas bit-identical: yes (fnv1a64 ",
                 k);
        snprintf(suffix, sizeof(suffix), ", %s)\n", when);
        for (line = strstr(r->out, prefix); line != NULL; line = strstr(line + 1, prefix)) {
            const char *eol = strchr(line, '\n');
            size_t len = eol != NULL ? (size_t)(eol - line) + 1 : strlen(line);
            n += len >= strlen(suffix) &&
                 strncmp(line + len - strlen(suffix), suffix, strlen(suffix)) == 0;
        }
        cr_assert(n == 1, "stage %d: %d lines '%s...%s'\nstdout:\n%s\nstderr:\n%s", k, n, prefix,
                  when, r->out, r->err);
    }
    cr_assert(strstr(r->out, "bit-identical: NO") == NULL, "%s", r->out);
}

/* "[rank R] stage K replica (N replica[s]) freed by its owner after F forward passes (C in a
 * context) and S steps" @p times times in all. */
static void assert_freed(const result_t *r, int rank, int replicas, int f, int c, int s, int times)
{
    char want[192];

    snprintf(want, sizeof(want),
             "[rank %d] stage %d replica (%d replica%s) freed by its owner after %d forward passes "
             "(%d in a context) and %d steps\n",
             rank, rank <= 2 ? 1 : 2, replicas, replicas > 1 ? "s" : "", f, c, s);
    cr_assert(count(r, want) == times, "%d times, not %d: %s\nstdout:\n%s", count(r, want), times,
              want, r->out);
}

static double rel(double a, double b)
{
    return fabs(a - b) / fmax(fabs(a), fabs(b));
}

/* ------------------------------------------------------------------ tests */

/* The comparison, without data: 1 and then 2 replicas on the same random batches. */
Test(pipeline_ddp, compare_timing_only, .timeout = 300)
{
    result_t r;
    jobj_t o;
    double r1, r2, ratio = -1, loss1, a1, b1, loss2, a2, b2;
    const char *line;

    example_run_with(&r, &PDDP5, "--compare", "--timing-steps", "2", "--epochs", "0", "--json");
    assert_exit(&r, 0);
    assert_line(&r, "[rank 0] 2 pipelines of 2 stages (stage 1: "
                    "conv(1->32)-relu-maxpool-conv(32->64)-relu-maxpool, stage 2: "
                    "flatten-fc(3136->128)-relu-fc(128->10)): A = worker1 -> worker3, B = worker2 "
                    "-> worker4; stage groups {worker1, worker2} and {worker3, worker4}; master "
                    "worker0");
    assert_line(&r, "[rank 0] timing: steps of 128 random images (64 per pipeline with 2 "
                    "replicas), 1 warm-up and 2 timed steps per run");
    r1 = rate_line(&r, 1, 4);
    r2 = rate_line(&r, 2, 4);
    line = find_line(r.out, "[rank 0] 2 replicas / 1 replica = ", true);
    cr_assert(line != NULL, "no ratio line\nstdout:\n%s\nstderr:\n%s", r.out, r.err);
    cr_assert(sscanf(line + strlen("[rank 0] 2 replicas / 1 replica = "), "%lf", &ratio) == 1 &&
                  isfinite(ratio) && ratio > 0.0,
              "%.200s", line);
    /* Averaging the two halves' gradients (DDP's mean over the replicas) is one pipeline's
     * gradient of the whole batch: the same first step, up to the order of sums. */
    warmup_line(&r, 1, &loss1, &a1, &b1);
    warmup_line(&r, 2, &loss2, &a2, &b2);
    cr_assert(rel(loss1, loss2) < 1e-4 && rel(a1, a2) < 1e-4 && rel(b1, b2) < 1e-4,
              "1 replica: %g, %g %g; 2 replicas: %g, %g %g", loss1, a1, b1, loss2, a2, b2);
    assert_line_prefix(&r, "[rank 0] warm-up step's loss and averaged gradients agree between 1 "
                           "and 2 replicas: yes (largest relative difference ");
    assert_identical(&r, "after the timing run");
    /* Each run: 3 steps (a warm-up and 2 timed) of 4 micro-batches per pipeline, all in a
     * context. The 1-replica run's objects live on ranks 1 and 3 only. */
    for (int rank = 1; rank <= 4; rank++) {
        assert_freed(&r, rank, 1, 12, 12, 3, rank == 1 || rank == 3 ? 1 : 0);
        assert_freed(&r, rank, 2, 12, 12, 3, 1);
    }
    cr_assert(count(&r, "freed by its owner") == 6, "%s", r.out);
    json_line(&r, &o);
    cr_assert(json_num(&o, "replicas", false) == 2 && json_num(&o, "splits", false) == 4 &&
                  json_num(&o, "batch", false) == 64 && json_num(&o, "timing_steps", false) == 2,
              "%s", r.out);
    cr_assert(rel(json_num(&o, "samples_per_s_r1", false), r1) < 1e-3, "%s", r.out);
    cr_assert(rel(json_num(&o, "samples_per_s_r2", false), r2) < 1e-3, "%s", r.out);
    cr_assert(fabs(json_num(&o, "ratio", false) - ratio) < 2e-3, "%s", r.out);
    json_null(&o, "accuracy");
    cr_assert(json_num(&o, "epochs_run", false) == 0, "%s", r.out);
    result_free(&r);
}

/* --replicas 1 alone: pipeline A only, ranks 2 and 4 idle; nothing to compare. */
Test(pipeline_ddp, one_replica_timing_only, .timeout = 300)
{
    result_t r;
    jobj_t o;

    example_run_with(&r, &PDDP5, "--replicas", "1", "--timing-steps", "1", "--splits", "3",
                     "--batch", "10", "--epochs", "0", "--json");
    assert_exit(&r, 0);
    (void)rate_line(&r, 1, 3);
    cr_assert(strstr(r.out, "replicas = 2") == NULL && strstr(r.out, "bit-identical") == NULL &&
                  strstr(r.out, "2 replicas / 1 replica") == NULL,
              "%s", r.out);
    /* 20 images a step in 3 micro-batches, 2 steps. */
    assert_freed(&r, 1, 1, 6, 6, 2, 1);
    assert_freed(&r, 3, 1, 6, 6, 2, 1);
    cr_assert(count(&r, "freed by its owner") == 2, "%s", r.out);
    json_line(&r, &o);
    cr_assert(json_num(&o, "replicas", false) == 1, "%s", r.out);
    (void)json_num(&o, "samples_per_s_r1", false);
    json_null(&o, "samples_per_s_r2");
    json_null(&o, "ratio");
    result_free(&r);
}

/* A short training run with two replicas, compared every 2 steps and at the end. */
Test(pipeline_ddp, short_training, .timeout = 300)
{
    result_t r;
    jobj_t o;
    const char *line;
    double acc = -1, loss = -1;

    SKIP_WITHOUT_FASHION_MNIST();
    example_run_with(&r, &PDDP5, "--timing-steps", "0", "--limit", "3", "--test-limit", "256",
                     "--check-every", "2", "--json");
    assert_exit(&r, 0);
    cr_assert(strstr(r.out, "samples/s = ") == NULL, "%s", r.out);
    assert_line(&r, "[rank 0] training on Fashion-MNIST: 3 steps of 128 images per epoch through 2 "
                    "pipelines, 4 splits, SGD lr 0.05 momentum 0 on each replica, 256 test images");
    assert_identical(&r, "after training step 2");
    assert_identical(&r, "after training");
    line = find_line(r.out, "[rank 0] epoch 1: train loss ", true);
    cr_assert(line != NULL, "no epoch line\nstdout:\n%s\nstderr:\n%s", r.out, r.err);
    cr_assert(sscanf(line, "[rank 0] epoch 1: train loss %lf", &loss) == 1 && isfinite(loss) &&
                  loss > 0.0,
              "%.200s", line);
    line = find_line(r.out, "[rank 0] Test accuracy: ", true);
    cr_assert(line != NULL, "no test accuracy\nstdout:\n%s\nstderr:\n%s", r.out, r.err);
    cr_assert(sscanf(line, "[rank 0] Test accuracy: %lf%%", &acc) == 1 && acc >= 0.0 &&
                  acc <= 100.0,
              "%.200s", line);
    /* Per replica: 3 steps of 4 micro-batches in a context, then 2 test batches of 128 images,
     * 64 per pipeline in 4 micro-batches, without one. */
    for (int rank = 1; rank <= 4; rank++) {
        assert_freed(&r, rank, 2, 20, 12, 3, 1);
    }
    json_line(&r, &o);
    json_null(&o, "samples_per_s_r1");
    json_null(&o, "samples_per_s_r2");
    json_null(&o, "ratio");
    cr_assert(json_num(&o, "steps", false) == 3 && json_num(&o, "epochs_run", false) == 1, "%s",
              r.out);
    cr_assert(fabs(100.0 * json_num(&o, "accuracy", false) - acc) < 0.01, "%s", r.out);
    result_free(&r);
}

Test(pipeline_ddp, bad_options_exit_2, .timeout = 120)
{
    result_t r;

    example_run_with(&r, &PDDP5, "--replicas", "3", "--epochs", "0");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "bad value '3' for --replicas");
    result_free(&r);

    example_run_with(&r, &PDDP5, "--splits", "0", "--epochs", "0");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "bad value '0' for --splits");
    result_free(&r);

    example_run_with(&r, &PDDP5, "--compare", "--timing-steps", "0", "--epochs", "0");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "pipeline_ddp: --compare needs timing steps");
    result_free(&r);

    example_run_with(&r, &PDDP5, "--data", "/nonexistent");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "pipeline_ddp: cannot load Fashion-MNIST: ");
    result_free(&r);

    example_run_with(&r, &PDDP4, "--epochs", "0");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "pipeline_ddp: runs on exactly 5 ranks (the master and 2 replicas of 2 "
                          "stages), not 4");
    result_free(&r);

    example_run_with(&r, &PDDP1, "--help");
    assert_exit(&r, 0);
    assert_line_prefix(&r, "[rank 0] usage: weftrun -n 5 pipeline_ddp [options]");
    result_free(&r);
}
