/*
 * examples/rpc_ps_tutorial under weftrun as a user would run it (WEFTRUN the launcher,
 * RPC_PS_TUTORIAL the example): rank 0 the parameter server, the other ranks trainers. The
 * assertions are exact properties, not learning curves (two trainers share the parameters
 * hogwild, so their losses depend on timing): the tutorial's lines, finite losses, an accuracy
 * in [0, 1], every parameter with a gradient on the server in each trainer's context, the
 * parameters changed by a step, the count of forward passes the server ran, and (one trainer)
 * a run that repeats itself bit for bit. The tests that train skip when Fashion-MNIST is not
 * installed.
 */

#include <criterion/criterion.h>

#include "example.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* Slow under ASan: a batch of the tutorial's CNN takes tens of milliseconds plain. */
static const example_t PS3 = {.ranks = "3", .prog_env = "RPC_PS_TUTORIAL", .deadline_s = 240.0};
static const example_t PS2 = {.ranks = "2", .prog_env = "RPC_PS_TUTORIAL", .deadline_s = 240.0};
static const example_t PS1 = {.ranks = "1", .prog_env = "RPC_PS_TUTORIAL", .deadline_s = 120.0};

/* The loss on trainer @p rank's line for batch @p batch (the @p nth such line, from 1), checked
 * finite and positive. */
static double loss_line(const result_t *r, int rank, int batch, int nth)
{
    char want[96];
    const char *at = r->out;
    double loss = -1.0;

    snprintf(want, sizeof(want), "[rank %d] Rank %d training batch %d loss ", rank, rank, batch);
    for (int i = 0; i < nth; i++) {
        at = strstr(i == 0 ? at : at + 1, want);
        cr_assert(at != NULL, "line %d of: %s\nstdout:\n%s\nstderr:\n%s", i + 1, want, r->out,
                  r->err);
    }
    cr_assert(sscanf(at + strlen(want), "%lf", &loss) == 1, "%.200s", at);
    cr_assert(isfinite(loss) && loss > 0.0, "batch %d loss %g on rank %d", batch, loss, rank);
    return loss;
}

static double accuracy_line(const result_t *r, int rank)
{
    char want[64];
    const char *line;
    double acc = -1.0;

    snprintf(want, sizeof(want), "[rank %d] Accuracy ", rank);
    line = find_line(r->out, want, true);
    cr_assert(line != NULL, "no accuracy on rank %d\nstdout:\n%s\nstderr:\n%s", rank, r->out,
              r->err);
    cr_assert(sscanf(line + strlen(want), "%lf", &acc) == 1, "%.200s", line);
    cr_assert(acc >= 0.0 && acc <= 1.0, "accuracy %g", acc);
    return acc;
}

/* Where @p want starts a line of stdout, as an offset (fails when absent). */
static size_t line_at(const result_t *r, const char *want)
{
    const char *line = find_line(r->out, want, true);

    cr_assert(line != NULL, "missing line starting with: %s\nstdout:\n%s\nstderr:\n%s", want,
              r->out, r->err);
    return (size_t)(line - r->out);
}

/* The tutorial's lines of trainer @p rank, in order, after its last batch @p last. */
static void assert_tutorial_ending(const result_t *r, int rank, int last)
{
    char batch[96], done[64], getting[64], acc[64];

    snprintf(batch, sizeof(batch), "[rank %d] Rank %d training batch %d loss ", rank, rank, last);
    snprintf(done, sizeof(done), "[rank %d] Training complete!", rank);
    snprintf(getting, sizeof(getting), "[rank %d] Getting accuracy....", rank);
    snprintf(acc, sizeof(acc), "[rank %d] Accuracy ", rank);
    cr_assert(line_at(r, batch) < line_at(r, done) && line_at(r, done) < line_at(r, getting) &&
                  line_at(r, getting) < line_at(r, acc),
              "rank %d's lines are out of order\nstdout:\n%s", rank, r->out);
}

Test(rpc_ps_tutorial, two_trainers_share_the_parameter_server, .timeout = 300)
{
    result_t r;

    SKIP_WITHOUT_FASHION_MNIST();
    /* 21 batches: lines for batches 0 and 20; 300 test images: 10 eval batches per trainer. */
    example_run_with(&r, &PS3, "--limit", "21", "--test-limit", "300");
    assert_exit(&r, 0);
    assert_line(&r, "[rank 0] parameter server on worker0: CNN conv1(1->32)-relu, "
                    "conv2(32->64)-maxpool-dropout2d, fc1(9216->128)-relu-dropout, "
                    "fc2(128->10)-log_softmax (1199882 parameters in 8 tensors), 2 trainers");
    for (int rank = 1; rank <= 2; rank++) {
        char want[256];

        snprintf(want, sizeof(want),
                 "[rank %d] Rank %d: 8 parameter RRefs owned by worker0, DistributedOptimizer "
                 "SGD lr 0.03, 21 batches of 32 per epoch",
                 rank, rank);
        assert_line(&r, want);
        /* The gradient of the trainer's loss reached every parameter on the server, in the
         * trainer's context, and the optimizer's step changed them. */
        snprintf(want, sizeof(want),
                 "[rank %d] Rank %d: first step: gradients for 8 of 8 parameters on the parameter "
                 "server, parameters changed: yes",
                 rank, rank);
        assert_line(&r, want);
        (void)loss_line(&r, rank, 0, 1);
        (void)loss_line(&r, rank, 20, 1);
        snprintf(want, sizeof(want), "[rank %d] Rank %d training batch 10 loss ", rank, rank);
        cr_assert(strstr(r.out, want) == NULL, "a line between the 20s\n%s", r.out);
        assert_tutorial_ending(&r, rank, 20);
        (void)accuracy_line(&r, rank);
    }
    /* 2 x 21 training forwards, 2 x ceil(300 / 32) = 2 x 10 evaluation ones. */
    assert_line(&r, "[rank 0] parameter server: 62 forward passes served, 42 of them training");
    result_free(&r);
}

/* One trainer: nothing runs concurrently on the model, so its dropout draws and updates come in
 * one order, and two runs print the same losses and accuracy. Two epochs of 3 batches of 16. */
Test(rpc_ps_tutorial, one_trainer_repeats_itself, .timeout = 300)
{
    result_t r1, r2;
    const char *const args[] = {"--limit",      "3",  "--batch", "16",   "--epochs", "2",
                                "--test-limit", "64", "--lr",    "0.05", NULL};

    SKIP_WITHOUT_FASHION_MNIST();
    example_run(&r1, &PS2, args);
    assert_exit(&r1, 0);
    assert_line(&r1, "[rank 1] Rank 1: 8 parameter RRefs owned by worker0, DistributedOptimizer "
                     "SGD lr 0.05, 3 batches of 16 per epoch");
    assert_line_prefix(&r1, "[rank 0] parameter server on worker0: ");
    cr_assert(strstr(r1.out, "(1199882 parameters in 8 tensors), 1 trainer\n") != NULL, "%s",
              r1.out);
    /* Each epoch logs batch 0 and its last batch, 2. */
    double l[4] = {loss_line(&r1, 1, 0, 1), loss_line(&r1, 1, 2, 1), loss_line(&r1, 1, 0, 2),
                   loss_line(&r1, 1, 2, 2)};
    assert_line_prefix(&r1, "[rank 1] Rank 1: epoch 1: mean loss ");
    assert_line_prefix(&r1, "[rank 1] Rank 1: epoch 2: mean loss ");
    assert_tutorial_ending(&r1, 1, 2);
    double acc = accuracy_line(&r1, 1);
    /* 2 x 3 training forwards, 64 / 16 = 4 evaluation ones. */
    assert_line(&r1, "[rank 0] parameter server: 10 forward passes served, 6 of them training");

    example_run(&r2, &PS2, args);
    assert_exit(&r2, 0);
    cr_assert(loss_line(&r2, 1, 0, 1) == l[0] && loss_line(&r2, 1, 2, 1) == l[1] &&
                  loss_line(&r2, 1, 0, 2) == l[2] && loss_line(&r2, 1, 2, 2) == l[3],
              "the losses differ between two runs\nfirst:\n%s\nsecond:\n%s", r1.out, r2.out);
    cr_assert(accuracy_line(&r2, 1) == acc, "the accuracy differs between two runs");
    result_free(&r1);
    result_free(&r2);
}

Test(rpc_ps_tutorial, bad_options_exit_2, .timeout = 120)
{
    result_t r;

    example_run_with(&r, &PS2, "--batch", "0");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "bad value '0' for --batch");
    result_free(&r);

    example_run_with(&r, &PS2, "--lr", "fast");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "bad value 'fast' for --lr");
    result_free(&r);

    example_run_with(&r, &PS2, "--splits", "4");
    assert_exit(&r, 2);
    result_free(&r);

    example_run_with(&r, &PS2, "--data", "/nonexistent");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "rpc_ps_tutorial: cannot load Fashion-MNIST: ");
    result_free(&r);

    example_run_with(&r, &PS1, "--help");
    assert_exit(&r, 0);
    assert_line_prefix(&r, "[rank 0] usage: weftrun -n N rpc_ps_tutorial [options]");
    result_free(&r);

    if (example_have_fashion_mnist()) {
        example_run_with(&r, &PS1, "--limit", "1");
        assert_exit(&r, 2);
        assert_stderr_has(&r, "rpc_ps_tutorial: needs 2 ranks or more");
        result_free(&r);
    }
}
