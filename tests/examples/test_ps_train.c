/*
 * examples/ps_train under weftrun as a user would run it: 4 ranks, ranks 0 and 1 serve, ranks 2
 * and 3 work (rank 2 prints). WEFTRUN is the launcher, PS_TRAIN the example. Every run has a
 * 60 s deadline, after which it is killed and the test fails. The tests that train skip when
 * Fashion-MNIST is not installed.
 */

#include <criterion/criterion.h>

#include "example.h"

#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#define LEAD "[rank 2] " /* the first worker */

static const example_t PS_TRAIN = {.ranks = "4", .servers = "2", .prog_env = "PS_TRAIN"};

/* Runs weftrun -n 4 --servers 2 ps_train with the arguments. */
#define run_ps_train(r, ...) example_run_with((r), &PS_TRAIN, __VA_ARGS__)

/* What the lead worker printed at the end of epoch @p epoch. */
typedef struct {
    double loss, acc, stale_mean;
    int stale_max;
} epoch_line_t;

static void epoch_line(const result_t *r, int epoch, epoch_line_t *e)
{
    char want[64];
    const char *line;
    double secs = 0, rate = 0;

    snprintf(want, sizeof(want), LEAD "epoch %d: train loss ", epoch);
    line = run_find_line(r->out, want, true);
    cr_assert(line != NULL, "no line for epoch %d\nstdout:\n%s\nstderr:\n%s", epoch, r->out,
              r->err);
    cr_assert(sscanf(line + strlen(LEAD),
                     "epoch %*d: train loss %lf, test accuracy %lf%%, %lf s, %lf samples/s, "
                     "staleness mean %lf max %d",
                     &e->loss, &e->acc, &secs, &rate, &e->stale_mean, &e->stale_max) == 6,
              "%.300s", line);
    cr_assert(e->acc >= 0.0 && e->acc <= 100.0 && rate > 0.0, "%.300s", line);
}

static double final_accuracy(const result_t *r)
{
    const char *line = run_find_line(r->out, LEAD "final test accuracy ", true);
    double acc = -1.0;

    cr_assert(line != NULL, "no final accuracy\nstdout:\n%s\nstderr:\n%s", r->out, r->err);
    cr_assert(sscanf(line, LEAD "final test accuracy %lf%%", &acc) == 1, "%.200s", line);
    return acc;
}

/* The hash of the final parameters, checked equal on both workers. */
static unsigned long long final_hash(const result_t *r)
{
    const char *line =
        run_find_line(r->out, LEAD "parameters bit-identical on all 2 workers (fnv1a64 ", true);
    unsigned long long h = 0;

    cr_assert(line != NULL, "no parameter line\nstdout:\n%s\nstderr:\n%s", r->out, r->err);
    cr_assert(sscanf(line, LEAD "parameters bit-identical on all 2 workers (fnv1a64 %llx)", &h) ==
                  1,
              "%.200s", line);
    cr_assert(strstr(r->out, "DIFFER") == NULL, "%s", r->out);
    return h;
}

/* The step of the last "checkpoint at step N in DIR" line; -1 if none. */
static long long last_checkpoint(const result_t *r)
{
    long long step = -1;

    for (const char *at = strstr(r->out, LEAD "checkpoint at step "); at != NULL;
         at = strstr(at + 1, LEAD "checkpoint at step ")) {
        long long s = -1;

        if (sscanf(at, LEAD "checkpoint at step %lld in ", &s) == 1) {
            step = s;
        }
    }
    return step;
}

/* ------------------------------------------------------------------ training */

Test(ps_train, sync_learns_with_two_servers_and_two_workers, .timeout = 120)
{
    result_t r;
    epoch_line_t e1, e2;
    double acc;

    SKIP_WITHOUT_FASHION_MNIST();
    run_ps_train(&r, "--epochs", "2", "--limit", "6000", "--json");
    assert_exit(&r, 0);
    assert_line_prefix(&r, LEAD "MLP 784-256-10 (203530 parameters) on 6000 Fashion-MNIST images, "
                                "2 servers, 2 workers, batch 64 per worker, sync, SGD lr 0.02 "
                                "momentum 0.9 on the servers, 47 steps per epoch");
    /* 64 KiB chunks: the large weight matrix is spread over both servers. */
    assert_line_prefix(&r, LEAD "table 'fc1.weight' (id 0), shard map ");
    assert_line_prefix(&r, LEAD "  server 0 (rank 0): 7 chunks, 409600 bytes:");
    assert_line_prefix(&r, LEAD "  server 1 (rank 1): 6 chunks, 393216 bytes:");
    epoch_line(&r, 1, &e1);
    epoch_line(&r, 2, &e2);
    /* Sync: a pull at clock k waits until every worker has ended step k - 1. */
    cr_assert(e1.stale_max == 0 && e2.stale_max == 0 && e2.stale_mean == 0.0, "%s", r.out);
    cr_assert(e2.loss < e1.loss, "the loss went from %.4f to %.4f", e1.loss, e2.loss);
    acc = final_accuracy(&r);
    cr_assert(acc == e2.acc, "final %.2f%%, last epoch %.2f%%", acc, e2.acc);
    cr_assert(acc > 70.0, "accuracy %.2f%% after 2 epochs on 6000 samples", acc);
    final_hash(&r);
    assert_line_prefix(&r, LEAD "{\"system\":\"weft-ps\",\"mode\":\"sync\",\"servers\":2,"
                                "\"workers\":2,");
    cr_assert(strstr(r.out, "\"params_identical\":true") != NULL, "%s", r.out);
    result_free(&r);
}

Test(ps_train, bounded_staleness_stays_within_its_bound, .timeout = 120)
{
    result_t r;
    epoch_line_t e1;

    SKIP_WITHOUT_FASHION_MNIST();
    run_ps_train(&r, "--mode", "bounded", "--staleness", "1", "--epochs", "1", "--limit", "6000");
    assert_exit(&r, 0);
    assert_line_prefix(&r, LEAD "MLP 784-256-10 (203530 parameters) on 6000 Fashion-MNIST images, "
                                "2 servers, 2 workers, batch 64 per worker, bounded (staleness 1)");
    epoch_line(&r, 1, &e1);
    /* A pull at clock c waits until every worker has ended step c - 2: it is at most 1 behind. */
    cr_assert(e1.stale_max <= 1 && e1.stale_mean <= 1.0, "%s", r.out);
    cr_assert(final_accuracy(&r) > 60.0, "%s", r.out);
    final_hash(&r);
    result_free(&r);
}

Test(ps_train, async_trains, .timeout = 120)
{
    result_t r;
    epoch_line_t e1;

    SKIP_WITHOUT_FASHION_MNIST();
    run_ps_train(&r, "--mode", "async", "--epochs", "1", "--limit", "6000");
    assert_exit(&r, 0);
    epoch_line(&r, 1, &e1);
    cr_assert(final_accuracy(&r) > 60.0, "%s", r.out);
    /* The workers meet before they pull for evaluation: they score the same parameters. */
    final_hash(&r);
    result_free(&r);
}

/* ------------------------------------------------------------------ checkpoints */

/* One epoch with a checkpoint at its end, then --resume to 2 epochs: it goes on from step 47
 * (the second epoch's first step) and ends with the very parameters of an uninterrupted 2-epoch
 * run (sync mode, the same shuffles). */
Test(ps_train, resume_goes_on_from_the_checkpointed_step, .timeout = 180)
{
    char dir[128];
    char want[256];
    result_t r;
    unsigned long long whole, resumed;
    epoch_line_t e2;

    SKIP_WITHOUT_FASHION_MNIST();
    example_tmp_dir(dir, sizeof(dir), "ck");
    run_ps_train(&r, "--epochs", "2", "--limit", "6000");
    assert_exit(&r, 0);
    whole = final_hash(&r);
    result_free(&r);

    run_ps_train(&r, "--epochs", "1", "--limit", "6000", "--checkpoint-dir", dir);
    assert_exit(&r, 0);
    snprintf(want, sizeof(want), LEAD "checkpoint at step 47 in %s (", dir);
    assert_line_prefix(&r, want);
    cr_assert_eq(last_checkpoint(&r), 47, "%s", r.out);
    result_free(&r);

    run_ps_train(&r, "--epochs", "2", "--limit", "6000", "--resume", dir);
    assert_exit(&r, 0);
    snprintf(want, sizeof(want),
             LEAD "resumed at step 47 from %s: continuing with epoch 2, step 1 of 47", dir);
    assert_line_prefix(&r, want);
    cr_assert(run_find_line(r.out, LEAD "epoch 1: ", true) == NULL, "epoch 1 again:\n%s", r.out);
    epoch_line(&r, 2, &e2);
    cr_assert(strstr(r.out, "after 94 steps") != NULL, "%s", r.out);
    resumed = final_hash(&r);
    cr_assert_eq(resumed, whole, "resumed %016llx, uninterrupted %016llx", resumed, whole);
    result_free(&r);

    /* A checkpoint whose steps mean other samples is refused. */
    run_ps_train(&r, "--epochs", "2", "--limit", "6000", "--batch", "32", "--resume", dir);
    assert_exit(&r, 2);
    assert_stderr_has(&r, "was written with batch 64 samples 6000 workers 2 seed 1, this run "
                          "has batch 32");
    result_free(&r);
    example_remove_dir(dir);
}

/* A job killed (SIGTERM to weftrun) once it has saved step 50 or later, resumed from whatever
 * checkpoint it left, mid-epoch: it ends with the parameters of an uninterrupted run. */
Test(ps_train, a_killed_job_resumes_mid_epoch, .timeout = 180)
{
    char dir[128];
    result_t r;
    unsigned long long whole, resumed;
    long long saved;
    long long v[4] = {-1, -1, -1, -1};

    SKIP_WITHOUT_FASHION_MNIST();
    example_tmp_dir(dir, sizeof(dir), "kill");
    run_ps_train(&r, "--epochs", "2", "--limit", "30000");
    assert_exit(&r, 0);
    whole = final_hash(&r);
    result_free(&r);

    {
        const char *const args[] = {
            "--epochs",           "2",  "--limit", "30000", "--checkpoint-dir", dir,
            "--checkpoint-every", "25", NULL};
        example_t ex = PS_TRAIN;

        ex.sig = SIGTERM;
        ex.sig_when = LEAD "checkpoint at step 50 in ";
        example_run(&r, &ex, args);
    }
    saved = last_checkpoint(&r);
    cr_assert(saved >= 50, "no checkpoint at step 50 or later\nstdout:\n%s\nstderr:\n%s", r.out,
              r.err);
    result_free(&r);

    run_ps_train(&r, "--epochs", "2", "--limit", "30000", "--resume", dir);
    assert_exit(&r, 0);
    example_resumed_at(&r, LEAD, dir, v); /* step, epoch, position, steps per epoch */
    /* The last checkpoint it printed, or one it completed as it was killed. */
    cr_assert(v[0] >= saved && (v[0] % 25 == 0 || v[0] == 2 * v[3]), "step %lld (saved %lld)", v[0],
              saved);
    cr_assert(v[3] == 235 && v[1] == v[0] / v[3] + 1 && v[2] == v[0] % v[3] + 1,
              "%lld %lld %lld %lld", v[0], v[1], v[2], v[3]);
    resumed = final_hash(&r);
    cr_assert_eq(resumed, whole, "resumed %016llx, uninterrupted %016llx", resumed, whole);
    result_free(&r);
    example_remove_dir(dir);
}

/* How many "checkpoint at step N in DIR" lines the lead worker printed; the first step in @p
 * first_p. */
static int checkpoints(const result_t *r, long long *first_p)
{
    int n = 0;

    *first_p = -1;
    for (const char *at = strstr(r->out, LEAD "checkpoint at step "); at != NULL;
         at = strstr(at + 1, LEAD "checkpoint at step ")) {
        if (n++ == 0) {
            cr_assert(sscanf(at, LEAD "checkpoint at step %lld in ", first_p) == 1, "%.200s", at);
        }
    }
    return n;
}

static bool file_exists(const char *dir, const char *name)
{
    char path[256];
    struct stat sb;

    snprintf(path, sizeof(path), "%s/%s", dir, name);
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* --checkpoint-seconds far below a step's time: worker 0 finds after every step that it is due,
 * and every worker checkpoints after the next one (sync mode: its decision lags one step). Without
 * --checkpoint-every those are the only checkpoints before the one at the end of training (none
 * at the end of epoch 1). The checkpoints change nothing: the parameters are those of an
 * uninterrupted run, and so are those of a job killed once it has written two checkpoints and
 * resumed from whatever it left. */
Test(ps_train, checkpoints_by_time_and_resumes_from_them, .timeout = 180)
{
    char dir[128];
    char want[256];
    result_t r;
    unsigned long long whole, resumed;
    long long first = -1, saved, step = -1;
    const char *line;
    int n;

    SKIP_WITHOUT_FASHION_MNIST();
    example_tmp_dir(dir, sizeof(dir), "cksec");
    run_ps_train(&r, "--epochs", "2", "--limit", "3000");
    assert_exit(&r, 0);
    whole = final_hash(&r);
    result_free(&r);

    run_ps_train(&r, "--epochs", "2", "--limit", "3000", "--checkpoint-dir", dir,
                 "--checkpoint-seconds", "0.001");
    assert_exit(&r, 0);
    assert_line_prefix(&r, LEAD "MLP 784-256-10 (203530 parameters) on 3000 Fashion-MNIST images, "
                                "2 servers, 2 workers, batch 64 per worker, sync, SGD lr 0.02 "
                                "momentum 0.9 on the servers, 24 steps per epoch");
    n = checkpoints(&r, &first);
    /* The first decision goes out after step 1 and is taken after step 2. */
    cr_assert(n >= 2 && first >= 2 && first < 48, "%d checkpoints, the first at step %lld\n%s", n,
              first, r.out);
    cr_assert_eq(last_checkpoint(&r), 48, "%s", r.out);
    cr_assert(file_exists(dir, "MANIFEST") && file_exists(dir, "ps_train.meta"), "%s", dir);
    cr_assert_eq(final_hash(&r), whole, "checkpoints by time changed the parameters");
    result_free(&r);
    example_remove_dir(dir);

    example_tmp_dir(dir, sizeof(dir), "cksec");
    {
        const char *const args[] = {
            "--epochs", "2", "--limit", "3000", "--checkpoint-dir", dir, "--checkpoint-seconds",
            "0.001",    NULL};
        example_t ex = PS_TRAIN;

        ex.sig = SIGTERM;
        ex.sig_when = LEAD "checkpoint at step ";
        ex.sig_when_count = 2;
        example_run(&r, &ex, args);
    }
    saved = last_checkpoint(&r);
    cr_assert(saved >= 2, "no checkpoint\nstdout:\n%s\nstderr:\n%s", r.out, r.err);
    result_free(&r);
    cr_assert(file_exists(dir, "MANIFEST"), "%s", dir);

    run_ps_train(&r, "--epochs", "2", "--limit", "3000", "--resume", dir);
    assert_exit(&r, 0);
    line = run_find_line(r.out, LEAD "resumed at step ", true);
    cr_assert(line != NULL, "stdout:\n%s\nstderr:\n%s", r.out, r.err);
    snprintf(want, sizeof(want), LEAD "resumed at step %%lld from %s: ", dir);
    cr_assert(sscanf(line, want, &step) == 1 && step >= saved, "%.300s (saved %lld)", line, saved);
    resumed = final_hash(&r);
    cr_assert_eq(resumed, whole, "resumed %016llx, uninterrupted %016llx", resumed, whole);
    result_free(&r);
    example_remove_dir(dir);
}

/* ------------------------------------------------------------------ bad input */

Test(ps_train, bad_options_exit_2, .timeout = 90)
{
    result_t r;

    run_ps_train(&r, "--mode", "eventual");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "ps_train: bad value 'eventual' for --mode");
    result_free(&r);

    run_ps_train(&r, "--staleness", "1");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "ps_train: --staleness is for --mode bounded");
    result_free(&r);

    run_ps_train(&r, "--checkpoint-seconds", "60");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "ps_train: --checkpoint-seconds needs --checkpoint-dir");
    result_free(&r);

    run_ps_train(&r, "--checkpoint-seconds", "0", "--checkpoint-dir", "/tmp");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "ps_train: bad value '0' for --checkpoint-seconds");
    result_free(&r);

    run_ps_train(&r, "--data", "/nonexistent");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "ps_train: cannot load Fashion-MNIST: /nonexistent/");
    result_free(&r);
}
