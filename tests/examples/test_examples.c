/*
 * The example programs, run under weftrun as a user would: WEFTRUN is the
 * launcher, RPC_BASICS, RPC_TRAIN and DP_TRAIN the examples. Every run has a 60 s
 * deadline, after which it is killed and the test fails.
 */

#include <criterion/criterion.h>

#include "run.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define DEADLINE_S       60.0
#define MAX_ARGS         32
#define MAX_ENV          512
#define DEFAULT_DATA_DIR "/usr/share/datasets/fashion-mnist"

typedef run_result_t result_t;

/* Runs weftrun with the NULL-terminated arguments; kills it at the deadline. */
static void run_weftrun(result_t *r, ...)
{
    static const char *const keep[] = {"WEFT_DATA_DIR=", "WEFT_LOG=", NULL};
    const char *argv[MAX_ARGS + 2];
    int nargs = 0;
    va_list ap;
    const char *a;

    argv[nargs++] = run_path_from_env("WEFTRUN");
    va_start(ap, r);
    while ((a = va_arg(ap, const char *)) != NULL) {
        cr_assert(nargs < MAX_ARGS);
        argv[nargs++] = a;
    }
    va_end(ap);
    argv[nargs] = NULL;
    run_opts_t o = {.argv = argv, .keep = keep, .deadline_s = DEADLINE_S};
    run_capture(&o, r);
}

#define result_free   run_result_free
#define find_line     run_find_line
#define path_from_env run_path_from_env

#define assert_line(r, want)                                                                       \
    cr_assert(find_line((r)->out, (want), false) != NULL,                                          \
              "missing line: %s\nstdout:\n%s\nstderr:\n%s", (want), (r)->out, (r)->err)

#define assert_line_prefix(r, want)                                                                \
    cr_assert(find_line((r)->out, (want), true) != NULL,                                           \
              "missing line starting with: %s\nstdout:\n%s\nstderr:\n%s", (want), (r)->out,        \
              (r)->err)

/* ------------------------------------------------------------- rpc_basics */

Test(examples, rpc_basics_on_three_ranks, .timeout = 90)
{
    result_t r;
    const char *line;

    run_weftrun(&r, "-n", "3", path_from_env("RPC_BASICS"), NULL);
    cr_assert_eq(r.code, 0, "exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.out, r.err);
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

    run_weftrun(&r, "-n", "2", path_from_env("RPC_BASICS"), NULL);
    cr_assert_eq(r.code, 2, "exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.out, r.err);
    cr_assert(strstr(r.err, "needs 3 ranks") != NULL, "stderr:\n%s", r.err);
    result_free(&r);
}

/* -------------------------------------------------------------- rpc_train */

static bool have_data(void)
{
    const char *dir = getenv("WEFT_DATA_DIR");
    char path[4096];
    struct stat sb;

    snprintf(path, sizeof(path), "%s/train-images-idx3-ubyte.gz",
             dir != NULL && *dir != '\0' ? dir : DEFAULT_DATA_DIR);
    return stat(path, &sb) == 0;
}

Test(examples, rpc_train_learns_on_two_ranks, .timeout = 120)
{
    result_t r;
    const char *line;
    double acc = 0.0;

    if (!have_data()) {
        cr_skip_test("Fashion-MNIST is not installed (package dataset-fashion-mnist)");
    }
    run_weftrun(&r, "-n", "2", path_from_env("RPC_TRAIN"), "--epochs", "1", "--limit", "6000",
                NULL);
    cr_assert_eq(r.code, 0, "exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.out, r.err);
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

    run_weftrun(&r, "-n", "2", path_from_env("RPC_TRAIN"), "--data", "/nonexistent", NULL);
    cr_assert_eq(r.code, 2, "exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.out, r.err);
    cr_assert(strstr(r.err, "cannot load Fashion-MNIST: /nonexistent/train-images-idx3-ubyte") !=
                  NULL,
              "stderr:\n%s", r.err);
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
    char dir[] = "/tmp/weft_examples_XXXXXX";
    char path[256];
    result_t r;

    cr_assert(mkdtemp(dir) != NULL);
    snprintf(path, sizeof(path), "%s/train-images-idx3-ubyte", dir);
    write_file(path, bad_magic, sizeof(bad_magic));
    snprintf(path, sizeof(path), "%s/train-labels-idx1-ubyte", dir);
    write_file(path, labels, sizeof(labels));
    run_weftrun(&r, "-n", "1", path_from_env("RPC_TRAIN"), "--data", dir, NULL);
    cr_assert_eq(r.code, 2, "exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.out, r.err);
    cr_assert(strstr(r.err, "bad magic number") != NULL, "stderr:\n%s", r.err);
    result_free(&r);
    run_weftrun(&r, "-n", "2", path_from_env("DP_TRAIN"), "--data", dir, NULL);
    cr_assert_eq(r.code, 2, "exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.out, r.err);
    cr_assert(strstr(r.err, "dp_train: cannot load Fashion-MNIST: ") != NULL &&
                  strstr(r.err, "bad magic number") != NULL,
              "stderr:\n%s", r.err);
    result_free(&r);

    snprintf(path, sizeof(path), "%s/train-images-idx3-ubyte", dir);
    write_file(path, images, sizeof(images)); /* 2 images of 1x1 announced, 1 byte present */
    run_weftrun(&r, "-n", "1", path_from_env("RPC_TRAIN"), "--data", dir, NULL);
    cr_assert_eq(r.code, 2, "exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.out, r.err);
    cr_assert(strstr(r.err, "truncated") != NULL, "stderr:\n%s", r.err);
    result_free(&r);

    snprintf(path, sizeof(path), "%s/train-images-idx3-ubyte", dir);
    unlink(path);
    snprintf(path, sizeof(path), "%s/train-labels-idx1-ubyte", dir);
    unlink(path);
    rmdir(dir);
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

    run_weftrun(&r, "-n", ranks, path_from_env("DP_TRAIN"), "--epochs", "1", "--limit", limit,
                "--json", NULL);
    cr_assert_eq(r.code, 0, "exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.out, r.err);
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
    if (!have_data()) {
        cr_skip_test("Fashion-MNIST is not installed (package dataset-fashion-mnist)");
    }
    dp_train_run("2", "6000", 70.0);
}

Test(examples, dp_train_runs_on_one_and_four_ranks, .timeout = 180)
{
    if (!have_data()) {
        cr_skip_test("Fashion-MNIST is not installed (package dataset-fashion-mnist)");
    }
    dp_train_run("1", "3000", 60.0);
    dp_train_run("4", "6000", 60.0);
}

Test(examples, dp_train_bad_input_exits_2, .timeout = 90)
{
    result_t r;

    run_weftrun(&r, "-n", "2", path_from_env("DP_TRAIN"), "--data", "/nonexistent", NULL);
    cr_assert_eq(r.code, 2, "exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.out, r.err);
    cr_assert(strstr(r.err, "cannot load Fashion-MNIST: /nonexistent/train-images-idx3-ubyte") !=
                  NULL,
              "stderr:\n%s", r.err);
    cr_assert(strstr(r.err, "dataset-fashion-mnist") != NULL, "says what to install:\n%s", r.err);
    result_free(&r);

    run_weftrun(&r, "-n", "1", path_from_env("DP_TRAIN"), "--hidden", "256,x", NULL);
    cr_assert_eq(r.code, 2, "exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.out, r.err);
    cr_assert(strstr(r.err, "bad value '256,x' for --hidden") != NULL, "stderr:\n%s", r.err);
    result_free(&r);
}
