/*
 * examples/pipeline_train under weftrun as a user would run it (WEFTRUN the launcher,
 * PIPELINE_TRAIN the example): rank 0 the master, ranks 1 and 2 the stages. The assertions are
 * exact properties rather than learning curves: every split count's timing line, the warm-up
 * batch's check (every stage parameter got a gradient through the pipeline, stage 1's
 * parameters changed with the optimizer's step, the same loss and gradients whatever the split
 * count), how many forward passes each stage object ran and how many of them recorded a graph
 * (the micro-batches of each split count; none while evaluating), finite losses, an accuracy in
 * [0, 100], the JSON line. The tests that run skip when Fashion-MNIST is not installed.
 *
 * Found while writing the example (rref, not fixed here; the example works around it with a
 * thread pool of its own for the stages' forwards): a handler whose arguments carry an RRef
 * forked from another user (user A -> user B: B must have the fork confirmed by the owner before
 * the handler runs) and that calls weft_rref_to_here on it synchronously waits until its own
 * deadline and fails with WEFT_ERR_TIMEOUT. The handler runs inside the callbacks of that
 * reference's readiness future (fork_request_done -> rref__user_settle -> waiter_done ->
 * args_ready -> the handler), and to_here's op_start adds op_target_ready to the same future with
 * weft_future_then, which queues it behind the callback that is running: it never runs while
 * the handler waits.
 */

#include <criterion/criterion.h>

#include "example.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

static const example_t PIPE3 = {.ranks = "3", .prog_env = "PIPELINE_TRAIN", .deadline_s = 240.0};
static const example_t PIPE2 = {.ranks = "2", .prog_env = "PIPELINE_TRAIN", .deadline_s = 120.0};
static const example_t PIPE1 = {.ranks = "1", .prog_env = "PIPELINE_TRAIN", .deadline_s = 120.0};

/* How many times @p want occurs in stdout. */
static int count(const result_t *r, const char *want)
{
    int n = 0;

    for (const char *at = strstr(r->out, want); at != NULL; at = strstr(at + 1, want)) {
        n++;
    }
    return n;
}

/* The warm-up check of @p k splits: its loss and both stages' sums of squares. */
static void warmup_line(const result_t *r, int k, double *loss, double *sq1, double *sq2)
{
    char want[64];
    const char *line;
    int g1 = 0, p1 = 0, g2 = 0, p2 = 0;
    char changed[8] = "";

    snprintf(want, sizeof(want), "[rank 0] splits %d warm-up batch: loss ", k);
    line = find_line(r->out, want, true);
    cr_assert(line != NULL, "no warm-up line for %d splits\nstdout:\n%s\nstderr:\n%s", k, r->out,
              r->err);
    cr_assert(sscanf(line + strlen(want),
                     "%lf, gradients for %d of %d parameters on stage 1 (sum of squares %lf) and "
                     "%d of %d on stage 2 (%lf), stage 1 parameters changed: %3s",
                     loss, &g1, &p1, sq1, &g2, &p2, sq2, changed) == 8,
              "%.300s", line);
    /* Both conv layers and both linear layers, weight and bias each. */
    cr_assert(g1 == 4 && p1 == 4 && g2 == 4 && p2 == 4, "%.300s", line);
    cr_assert(strcmp(changed, "yes") == 0, "%.300s", line);
    cr_assert(isfinite(*loss) && *loss > 0.0 && *sq1 > 0.0 && *sq2 > 0.0 && isfinite(*sq1) &&
                  isfinite(*sq2),
              "%.300s", line);
}

static double rel(double a, double b)
{
    return fabs(a - b) / fmax(fabs(a), fabs(b));
}

/* "[rank R] stage K freed by its owner after N forward passes (M in a context)", once. */
static void assert_freed(const result_t *r, int k, int n, int recorded)
{
    char want[128];

    snprintf(want, sizeof(want),
             "[rank %d] stage %d freed by its owner after %d forward passes (%d in a context)\n", k,
             k, n, recorded);
    cr_assert(count(r, want) == 1, "%d times: %s\nstdout:\n%s", count(r, want), want, r->out);
}

static double test_accuracy(const result_t *r)
{
    const char *line = find_line(r->out, "[rank 0] Test accuracy: ", true);
    double acc = -1.0;

    cr_assert(line != NULL, "no test accuracy\nstdout:\n%s\nstderr:\n%s", r->out, r->err);
    cr_assert(sscanf(line, "[rank 0] Test accuracy: %lf%%", &acc) == 1, "%.200s", line);
    cr_assert(acc >= 0.0 && acc <= 100.0, "%.200s", line);
    return acc;
}

static void assert_epoch_loss_finite(const result_t *r)
{
    const char *line = find_line(r->out, "[rank 0] epoch 1: train loss ", true);
    double loss = -1.0;

    cr_assert(line != NULL, "no epoch line\nstdout:\n%s\nstderr:\n%s", r->out, r->err);
    cr_assert(sscanf(line, "[rank 0] epoch 1: train loss %lf", &loss) == 1, "%.200s", line);
    cr_assert(isfinite(loss) && loss > 0.0, "%.200s", line);
}

Test(pipeline_train, timing_runs_and_training, .timeout = 300)
{
    static const int splits[] = {1, 2, 4, 8};
    result_t r;
    double loss0 = 0, sq10 = 0, sq20 = 0;

    SKIP_WITHOUT_FASHION_MNIST();
    example_run_with(&r, &PIPE3, "--timing-batches", "1", "--limit", "3", "--test-limit", "256",
                     "--json");
    assert_exit(&r, 0);
    assert_line(&r, "[rank 0] pipeline over worker1 (stage 1: "
                    "conv(1->32)-relu-maxpool-conv(32->64)-relu-maxpool) and worker2 (stage 2: "
                    "flatten-fc(3136->128)-relu-fc(128->10)), master worker0");
    assert_line(&r, "[rank 0] timing: batches of 128 random images, 1 warm-up and 1 timed "
                    "batches per split count");
    for (int i = 0; i < 4; i++) {
        char want[96];
        const char *line;
        double t = -1, loss, sq1, sq2;

        snprintf(want, sizeof(want),
                 "[rank 0] number of splits = %d, execution time = ", splits[i]);
        line = find_line(r.out, want, true);
        cr_assert(line != NULL, "missing: %s\nstdout:\n%s\nstderr:\n%s", want, r.out, r.err);
        cr_assert(sscanf(line + strlen(want), "%lf", &t) == 1 && isfinite(t) && t > 0.0, "%.200s",
                  line);
        /* The same fresh stages on the same batch: the split count only reorders the sums. */
        warmup_line(&r, splits[i], &loss, &sq1, &sq2);
        if (i == 0) {
            loss0 = loss;
            sq10 = sq1;
            sq20 = sq2;
        }
        cr_assert(rel(loss, loss0) < 1e-4 && rel(sq1, sq10) < 1e-4 && rel(sq2, sq20) < 1e-4,
                  "%d splits: loss %g, sums of squares %g %g; 1 split: %g, %g %g", splits[i], loss,
                  sq1, sq2, loss0, sq10, sq20);
    }
    assert_line_prefix(&r, "[rank 0] first batch's loss and gradients agree across 1, 2, 4 and 8 "
                           "splits: yes (largest relative difference ");
    assert_line(&r, "[rank 0] training on Fashion-MNIST: 3 batches of 128 per epoch, 4 splits, "
                    "DistributedOptimizer SGD lr 0.05 over 8 parameter RRefs, 256 test images");
    assert_epoch_loss_finite(&r);
    (void)test_accuracy(&r);
    /* Fresh stages for each split count (a warm-up and a timed batch of k micro-batches, all in
     * a context), then for the training: 3 batches of 4 micro-batches in a context, and 2 test
     * batches of 4 without one. */
    for (int k = 1; k <= 2; k++) {
        for (int i = 0; i < 4; i++) {
            assert_freed(&r, k, 2 * splits[i], 2 * splits[i]);
        }
        assert_freed(&r, k, 20, 12);
        char freed[64];
        snprintf(freed, sizeof(freed), "[rank %d] stage %d freed by its owner", k, k);
        cr_assert(count(&r, freed) == 5, "stage %d freed %d times", k, count(&r, freed));
    }
    assert_line_prefix(&r, "[rank 0] {\"system\":\"weft\",\"model\":\"pipeline\",\"batch\":128,"
                           "\"timing_batch\":128,\"timing_batches\":1,\"pipeline_s1_ms\":");
    for (int i = 0; i < 4; i++) {
        char key[32];
        snprintf(key, sizeof(key), "\"pipeline_s%d_ms\":", splits[i]);
        const char *at = strstr(r.out, key);
        cr_assert(at != NULL && isdigit((unsigned char)at[strlen(key)]), "%s: %s", key, r.out);
    }
    cr_assert(strstr(r.out, "\"splits\":4,") != NULL && strstr(r.out, "\"accuracy\":") != NULL,
              "%s", r.out);
    result_free(&r);
}

/* Micro-batches of unequal sizes (10 images in 3 splits: 4, 3, 3; the last test batch of 5 too:
 * 2, 2, 1), no timing runs. */
Test(pipeline_train, uneven_splits_without_timing, .timeout = 300)
{
    result_t r;

    SKIP_WITHOUT_FASHION_MNIST();
    example_run_with(&r, &PIPE3, "--timing-batches", "0", "--splits", "3", "--batch", "10",
                     "--limit", "2", "--test-limit", "25", "--json");
    assert_exit(&r, 0);
    cr_assert(strstr(r.out, "number of splits") == NULL && strstr(r.out, "warm-up") == NULL, "%s",
              r.out);
    assert_line(&r, "[rank 0] training on Fashion-MNIST: 2 batches of 10 per epoch, 3 splits, "
                    "DistributedOptimizer SGD lr 0.05 over 8 parameter RRefs, 25 test images");
    assert_epoch_loss_finite(&r);
    (void)test_accuracy(&r);
    /* 2 x 3 training micro-batches; test batches of 10, 10 and 5 images, 3 micro-batches each. */
    assert_freed(&r, 1, 15, 6);
    assert_freed(&r, 2, 15, 6);
    assert_line_prefix(&r, "[rank 0] {\"system\":\"weft\",\"model\":\"pipeline\",\"batch\":10,"
                           "\"timing_batch\":128,\"timing_batches\":0,\"pipeline_s1_ms\":null,"
                           "\"pipeline_s2_ms\":null,\"pipeline_s4_ms\":null,\"pipeline_s8_ms\":"
                           "null,\"splits\":3,");
    result_free(&r);
}

Test(pipeline_train, bad_options_exit_2, .timeout = 120)
{
    result_t r;

    example_run_with(&r, &PIPE3, "--splits", "0");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "bad value '0' for --splits");
    result_free(&r);

    example_run_with(&r, &PIPE3, "--splits", "65");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "bad value '65' for --splits");
    result_free(&r);

    example_run_with(&r, &PIPE3, "--timing-batches", "-1");
    assert_exit(&r, 2);
    result_free(&r);

    example_run_with(&r, &PIPE3, "--data", "/nonexistent");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "pipeline_train: cannot load Fashion-MNIST: ");
    result_free(&r);

    example_run_with(&r, &PIPE1, "--help");
    assert_exit(&r, 0);
    assert_line_prefix(&r, "[rank 0] usage: weftrun -n 3 pipeline_train [options]");
    result_free(&r);

    if (example_have_fashion_mnist()) {
        example_run_with(&r, &PIPE2, "--limit", "1");
        assert_exit(&r, 2);
        assert_stderr_has(&r, "pipeline_train: runs on exactly 3 ranks (the master and 2 stages), "
                              "not 2");
        result_free(&r);
    }
}
