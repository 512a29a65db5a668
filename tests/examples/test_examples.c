/*
 * The example programs, run under weftrun as a user would: WEFTRUN is the
 * launcher, RPC_BASICS, RPC_TRAIN and DP_TRAIN the examples. Every run has a 60 s
 * deadline, after which it is killed and the test fails.
 */

#include <criterion/criterion.h>

#include "example.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

/* Runs weftrun -n NRANKS with the example that variable ENV names and its arguments (NULL: none).
 */
#define run_example(r, nranks, env, ...)                                                           \
    do {                                                                                           \
        const example_t ex_ = {.ranks = (nranks), .prog_env = (env)};                              \
        example_run_with((r), &ex_, __VA_ARGS__);                                                  \
    } while (0)

/* ------------------------------------------------------------- rpc_basics */

Test(examples, rpc_basics_on_three_ranks, .timeout = 90)
{
    result_t r;
    const char *line;

    run_example(&r, "3", "RPC_BASICS", NULL);
    assert_exit(&r, 0);
    assert_line(&r, "[rank 0] rpc_sync add on worker1 -> [11, 22, 33]");
    assert_line(&r, "[rank 0] rpc_async square on worker1 -> [1, 4, 9]");
    assert_line(&r, "[rank 0] rpc_async square on worker2 -> [16, 25, 36]");
    assert_line(&r, "[rank 0] nested 0->1->2 -> [101, 202, 303]");
    assert_line(&r, "[rank 0] rpc_sync divide on worker2 -> [5, 5, 6]");
    assert_line_prefix(&r, "[rank 0] remote error caught: WEFT_ERR_INVALID_ARG: division by zero");
    line = find_line(r.out, "[rank 0] remote error caught: ", true);
    cr_assert(strstr(line, "worker2") != NULL && strstr(line, "divide") != NULL,
              "the remote error names where it happened: %.200s", line);
    assert_line_prefix(&r, "[rank 0] unknown function caught: WEFT_ERR_NO_SUCH_FUNCTION: ");
    line = find_line(r.out, "[rank 0] unknown function caught: ", true);
    cr_assert(strstr(line, "no_such_function") != NULL, "names the function: %.200s", line);
    assert_line(&r, "[rank 0] payload round trip via worker2: \"hello from worker0\" (18 bytes)");
    assert_line(&r, "[rank 0] done");
    assert_line(&r, "[rank 1] done");
    assert_line(&r, "[rank 2] done");
    result_free(&r);
}

Test(examples, rpc_basics_wants_three_ranks, .timeout = 90)
{
    result_t r;

    run_example(&r, "2", "RPC_BASICS", NULL);
    assert_exit(&r, 2);
    assert_stderr_has(&r, "needs 3 ranks");
    result_free(&r);
}

/* -------------------------------------------------------------- rpc_train */

Test(examples, rpc_train_learns_on_two_ranks, .timeout = 120)
{
    result_t r;
    const char *line;
    double acc = 0.0;

    SKIP_WITHOUT_FASHION_MNIST();
    run_example(&r, "2", "RPC_TRAIN", "--epochs", "1", "--limit", "6000");
    assert_exit(&r, 0);
    assert_line_prefix(&r, "[rank 0] epoch 1/1: train loss ");
    line = find_line(r.out, "[rank 0] final test accuracy: ", true);
    cr_assert(line != NULL, "no final accuracy\nstdout:\n%s\nstderr:\n%s", r.out, r.err);
    cr_assert(sscanf(line, "[rank 0] final test accuracy: %lf%%", &acc) == 1, "%.200s", line);
    cr_assert(acc > 50.0 && acc <= 100.0, "accuracy %.2f%% after one epoch on 6000 samples", acc);
    assert_line_prefix(&r, "[rank 0] parameters identical on all ranks: yes");
    assert_line_prefix(&r, "[rank 1] parameters identical on all ranks: yes");
    result_free(&r);
}

Test(examples, rpc_train_missing_data_exits_2, .timeout = 90)
{
    result_t r;

    run_example(&r, "2", "RPC_TRAIN", "--data", "/nonexistent");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "cannot load Fashion-MNIST: /nonexistent/train-images-idx3-ubyte");
    cr_assert(strstr(r.err, "dataset-fashion-mnist") != NULL, "says what to install:\n%s", r.err);
    result_free(&r);
}

/* Writes a file of @p len bytes. */
static void write_file(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");

    cr_assert(f != NULL, "%s: %s", path, strerror(errno));
    cr_assert(fwrite(data, 1, len, f) == len);
    cr_assert(fclose(f) == 0);
}

Test(examples, corrupt_data_exits_2, .timeout = 90)
{
    /* Uncompressed IDX files (the reader takes those too): a label file's
     * magic number on the training images, and a test set cut short. */
    static const unsigned char bad_magic[] = {0, 0, 8, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0};
    static const unsigned char images[] = {0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 1, 7};
    static const unsigned char labels[] = {0, 0, 8, 1, 0, 0, 0, 2, 3, 4};
    char dir[128];
    char path[256];
    result_t r;

    example_tmp_dir(dir, sizeof(dir), "idx");
    snprintf(path, sizeof(path), "%s/train-images-idx3-ubyte", dir);
    write_file(path, bad_magic, sizeof(bad_magic));
    snprintf(path, sizeof(path), "%s/train-labels-idx1-ubyte", dir);
    write_file(path, labels, sizeof(labels));
    run_example(&r, "1", "RPC_TRAIN", "--data", dir);
    assert_exit(&r, 2);
    assert_stderr_has(&r, "bad magic number");
    result_free(&r);
    run_example(&r, "2", "DP_TRAIN", "--data", dir);
    assert_exit(&r, 2);
    cr_assert(strstr(r.err, "dp_train: cannot load Fashion-MNIST: ") != NULL &&
                  strstr(r.err, "bad magic number") != NULL,
              "stderr:\n%s", r.err);
    result_free(&r);

    snprintf(path, sizeof(path), "%s/train-images-idx3-ubyte", dir);
    write_file(path, images, sizeof(images)); /* 2 images of 1x1 announced, 1 byte present */
    run_example(&r, "1", "RPC_TRAIN", "--data", dir);
    assert_exit(&r, 2);
    assert_stderr_has(&r, "truncated");
    result_free(&r);

    example_remove_dir(dir);
}

/* --------------------------------------------------------------- dp_train */

/* Runs dp_train on @p ranks ranks over the first @p limit samples for one epoch; checks that it
 * learned and that every rank ended with the same parameters. */
static void dp_train_run(const char *ranks, const char *limit, double min_acc)
{
    char want[128];
    result_t r;
    const char *line;
    double acc = 0.0;

    run_example(&r, ranks, "DP_TRAIN", "--epochs", "1", "--limit", limit, "--json");
    assert_exit(&r, 0);
    assert_line_prefix(&r, "[rank 0] MLP 784-256-10 (203530 parameters)");
    assert_line_prefix(&r, "[rank 0] epoch 1: train loss ");
    line = find_line(r.out, "[rank 0] final test accuracy ", true);
    cr_assert(line != NULL, "no final accuracy\nstdout:\n%s\nstderr:\n%s", r.out, r.err);
    cr_assert(sscanf(line, "[rank 0] final test accuracy %lf%%", &acc) == 1, "%.200s", line);
    cr_assert(acc >= min_acc && acc <= 100.0, "accuracy %.2f%% on %s ranks, %s samples", acc, ranks,
              limit);
    snprintf(want, sizeof(want), "[rank 0] parameters bit-identical on all %s ranks", ranks);
    assert_line_prefix(&r, want);
    assert_line_prefix(&r, "[rank 0] {\"system\":\"weft\",\"world\":");
    cr_assert(strstr(r.out, "\"params_identical\":true") != NULL, "%s", r.out);
    result_free(&r);
}

Test(examples, dp_train_learns_on_two_ranks, .timeout = 120)
{
    SKIP_WITHOUT_FASHION_MNIST();
    dp_train_run("2", "6000", 70.0);
}

Test(examples, dp_train_runs_on_one_and_four_ranks, .timeout = 180)
{
    SKIP_WITHOUT_FASHION_MNIST();
    dp_train_run("1", "3000", 60.0);
    dp_train_run("4", "6000", 60.0);
}

Test(examples, dp_train_bad_input_exits_2, .timeout = 90)
{
    result_t r;

    run_example(&r, "2", "DP_TRAIN", "--data", "/nonexistent");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "cannot load Fashion-MNIST: /nonexistent/train-images-idx3-ubyte");
    cr_assert(strstr(r.err, "dataset-fashion-mnist") != NULL, "says what to install:\n%s", r.err);
    result_free(&r);

    run_example(&r, "1", "DP_TRAIN", "--hidden", "256,x");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "bad value '256,x' for --hidden");
    result_free(&r);
}

/* The hash of the parameters dp_train ends with (its "bit-identical" line), into @p hash. */
static void dp_train_hash(const char *reducer, const char *compress, char *hash, size_t n)
{
    result_t r;
    run_example(&r, "2", "DP_TRAIN", "--epochs", "1", "--limit", "3000", "--reducer", reducer,
                "--compress", compress, "--bucket-mb", "0.25");
    assert_exit(&r, 0);
    const char *line = find_line(r.out, "[rank 0] parameters bit-identical on all 2 ranks", true);
    cr_assert(line != NULL, "replicas differ or no line\nstdout:\n%s\nstderr:\n%s", r.out, r.err);
    const char *h = strstr(line, "fnv1a64 ");
    cr_assert(h != NULL, "%s", line);
    snprintf(hash, n, "%.16s", h + 8);
    if (strcmp(reducer, "ddp") == 0) {
        /* 203530 parameters in 0.25 MiB buckets (1 MiB first, capped at 0.25): several */
        assert_line_prefix(&r, "[rank 0] ddp: ");
        cr_assert(strstr(r.out, " buckets (rebuilt)") != NULL, "%s", r.out);
    }
    result_free(&r);
}

/* The DDP reducer's buckets average exactly what one flat all_reduce does: the same parameters,
 * bit for bit; fp16 compression trains to other (close) values. */
Test(examples, dp_train_ddp_reducer_equals_the_flat_all_reduce, .timeout = 180)
{
    SKIP_WITHOUT_FASHION_MNIST();
    char flat[32], ddp[32], fp16[32];
    dp_train_hash("flat", "none", flat, sizeof(flat));
    dp_train_hash("ddp", "none", ddp, sizeof(ddp));
    dp_train_hash("ddp", "fp16", fp16, sizeof(fp16));
    cr_assert_str_eq(flat, ddp, "ddp %s, flat %s", ddp, flat);
    cr_assert_str_neq(fp16, flat, "fp16 compression changed nothing");
}

Test(examples, dp_train_bad_reducer_options_exit_2, .timeout = 60)
{
    result_t r;
    run_example(&r, "1", "DP_TRAIN", "--reducer", "ring");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "--reducer is ddp or flat, not 'ring'");
    result_free(&r);
    run_example(&r, "1", "DP_TRAIN", "--compress", "int8");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "--compress is none, fp16 or bf16, not 'int8'");
    result_free(&r);
    run_example(&r, "1", "DP_TRAIN", "--reducer", "flat", "--compress", "bf16");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "--compress needs --reducer ddp");
    result_free(&r);
}
