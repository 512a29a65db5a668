/*
 * examples/ddp_rpc under weftrun as a user would run it (WEFTRUN the launcher, DDP_RPC the
 * example): torch's "Combining Distributed DataParallel with Distributed RPC Framework" on 4
 * ranks, trainers 0 and 1, the master 2, the parameter server 3. The assertions are exact
 * properties rather than learning curves (the two trainers update the shared embedding in
 * whatever order their steps reach it, hogwild, so the losses may differ from run to run): the
 * tutorial's "Training done for epoch N" lines, exactly N = 0..E-1 from each trainer; after every
 * epoch the fc replicas bit-identical on both trainers, with the same hash on both; the
 * embedding's rows looked up by both trainers all changed and those looked up by neither did not;
 * the embedding object's forward passes (all of them in a distributed autograd context) and its
 * release by its owner. Bad options and a world other than 4 ranks exit 2.
 */

#include <criterion/criterion.h>

#include "example.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static const example_t DDP4 = {.ranks = "4", .prog_env = "DDP_RPC", .deadline_s = 120.0};
static const example_t DDP3 = {.ranks = "3", .prog_env = "DDP_RPC", .deadline_s = 60.0};
static const example_t DDP1 = {.ranks = "1", .prog_env = "DDP_RPC", .deadline_s = 60.0};

/* How many times @p want occurs in stdout. */
static int count(const result_t *r, const char *want)
{
    int n = 0;

    for (const char *at = strstr(r->out, want); at != NULL; at = strstr(at + 1, want)) {
        n++;
    }
    return n;
}

/* Trainer @p rank's check line of epoch @p epoch: its mean loss and the fc's hash. */
static void replica_line(const result_t *r, int rank, int epoch, double *loss,
                         unsigned long long *hash)
{
    char want[64];
    char what[32] = "";
    const char *line;

    snprintf(want, sizeof(want), "[rank %d] epoch %d: mean loss ", rank, epoch);
    line = find_line(r->out, want, true);
    cr_assert(line != NULL, "missing line starting with: %s\nstdout:\n%s\nstderr:\n%s", want,
              r->out, r->err);
    cr_assert(sscanf(line + strlen(want), "%lf, fc replicas %31s on both trainers (fnv1a64 %16llx)",
                     loss, what, hash) == 3,
              "%.200s", line);
    cr_assert(strcmp(what, "bit-identical") == 0, "%.200s", line);
    cr_assert(isfinite(*loss) && *loss > 0.0, "%.200s", line);
}

Test(ddp_rpc, three_epochs, .timeout = 180)
{
    result_t r;
    const char *line;
    int both = -1, changed = -1, both2 = -1, neither = -1, neither_changed = -1, total = -1;

    example_run_with(&r, &DDP4, "--epochs", "3");
    assert_exit(&r, 0);
    assert_line(&r, "[rank 2] master: EmbeddingBag(100, 16, mode sum) on worker3 (the parameter "
                    "server); training on worker0 and worker1 for 3 epochs of 10 batches");
    for (int t = 0; t < 2; t++) {
        char want[256];

        snprintf(want, sizeof(want),
                 "[rank %d] trainer %d: fc Linear(16, 8) under DDP with trainer %d, "
                 "EmbeddingBag(100, 16, mode sum) on worker3, DistributedOptimizer SGD lr 0.05 "
                 "over 3 parameter RRefs",
                 t, t, 1 - t);
        assert_line(&r, want);
        snprintf(want, sizeof(want), "[rank %d] trainer %d: 3 epochs of 10 batches in ", t, t);
        assert_line_prefix(&r, want);
    }
    /* The tutorial's lines, epochs 0..2 from each trainer and nothing more. */
    for (int e = 0; e < 3; e++) {
        for (int t = 0; t < 2; t++) {
            char want[64];

            snprintf(want, sizeof(want), "[rank %d] Training done for epoch %d", t, e);
            assert_line(&r, want);
            cr_assert(count(&r, want) == 1, "%d times: %s", count(&r, want), want);
        }
    }
    cr_assert(count(&r, "Training done for epoch ") == 6, "%d lines\nstdout:\n%s",
              count(&r, "Training done for epoch "), r.out);
    /* The replicas after every epoch: bit-identical, the same hash on both trainers, and a
     * different one each epoch (the fc trains). */
    unsigned long long prev = 0;
    for (int e = 0; e < 3; e++) {
        double l0, l1;
        unsigned long long h0, h1;

        replica_line(&r, 0, e, &l0, &h0);
        replica_line(&r, 1, e, &l1, &h1);
        cr_assert(h0 == h1, "epoch %d: fc hashes %016llx and %016llx", e, h0, h1);
        cr_assert(e == 0 || h0 != prev, "epoch %d: the fc did not change", e);
        prev = h0;
    }
    assert_line_prefix(&r, "[rank 2] master: training done on both trainers in ");
    line = find_line(r.out, "[rank 2] embedding rows looked up by both trainers: ", true);
    cr_assert(line != NULL, "no embedding line\nstdout:\n%s\nstderr:\n%s", r.out, r.err);
    cr_assert(sscanf(line,
                     "[rank 2] embedding rows looked up by both trainers: %d of %d, changed by "
                     "training: %d of %d; rows looked up by neither: %d, changed: %d",
                     &both, &total, &changed, &both2, &neither, &neither_changed) == 6,
              "%.300s", line);
    cr_assert(total == 100 && both > 0 && both <= 100 && changed == both && both2 == both &&
                  neither >= 0 && neither_changed == 0,
              "%.300s", line);
    assert_line(&r, "[rank 2] embedding check: passed");
    /* 2 trainers x 3 epochs x 10 batches, each forward in the batch's context. */
    assert_line(&r, "[rank 3] EmbeddingBag freed by its owner after 60 forward passes (60 in a "
                    "context)");
    result_free(&r);
}

Test(ddp_rpc, bad_options_exit_2, .timeout = 180)
{
    result_t r;

    example_run_with(&r, &DDP4, "--epochs", "0");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "bad value '0' for --epochs");
    result_free(&r);

    example_run_with(&r, &DDP4, "--epochs", "x");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "bad value 'x' for --epochs");
    result_free(&r);

    example_run_with(&r, &DDP4, "--bogus");
    assert_exit(&r, 2);
    result_free(&r);

    example_run_with(&r, &DDP4, "stray");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "ddp_rpc: unexpected argument 'stray'");
    result_free(&r);

    example_run_with(&r, &DDP1, "--help");
    assert_exit(&r, 0);
    assert_line_prefix(&r, "[rank 0] usage: weftrun -n 4 ddp_rpc [options]");
    result_free(&r);
}

Test(ddp_rpc, wrong_world_size_exits_2, .timeout = 120)
{
    result_t r;

    example_run_with(&r, &DDP3, "--epochs", "1");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "ddp_rpc: runs on exactly 4 ranks (2 trainers, the master, the "
                          "parameter server), not 3");
    cr_assert(strstr(r.out, "Training done") == NULL, "%s", r.out);
    result_free(&r);
}
