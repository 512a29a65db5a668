/*
 * The example programs, run under weftrun as a user would: WEFTRUN is the
 * launcher, RPC_BASICS and RPC_TRAIN the examples. Every run has a 60 s
 * deadline, after which it is killed and the test fails.
 */

#include <criterion/criterion.h>

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

typedef struct {
    int code; /* exit status, or 128 + signal */
    char *out;
    size_t out_len;
    char *err;
    size_t err_len;
} result_t;

static double now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static const char *path_from_env(const char *name)
{
    const char *p = getenv(name);

    cr_assert(p != NULL && *p != '\0', "%s must name the built program", name);
    return p;
}

/* Rank variables of an outer launcher must not leak into the run; the data
 * directory and the log level may. */
static bool scrubbed(const char *entry)
{
    static const char *const prefixes[] = {"SLURM_", "OMPI_", "PMI_", "WEFT_"};
    static const char *const kept[] = {"WEFT_DATA_DIR=", "WEFT_LOG="};
    static const char *const exact[] = {"MASTER_ADDR", "MASTER_PORT", "RANK",
                                        "WORLD_SIZE",  "LOCAL_RANK",  "LOCAL_WORLD_SIZE"};
    size_t name_len = strcspn(entry, "=");

    for (size_t i = 0; i < sizeof(kept) / sizeof(kept[0]); i++) {
        if (strncmp(entry, kept[i], strlen(kept[i])) == 0) {
            return false;
        }
    }
    for (size_t i = 0; i < sizeof(prefixes) / sizeof(prefixes[0]); i++) {
        if (strncmp(entry, prefixes[i], strlen(prefixes[i])) == 0) {
            return true;
        }
    }
    for (size_t i = 0; i < sizeof(exact) / sizeof(exact[0]); i++) {
        if (strlen(exact[i]) == name_len && strncmp(entry, exact[i], name_len) == 0) {
            return true;
        }
    }
    return false;
}

static void append(char **buf, size_t *len, const char *data, size_t n)
{
    *buf = realloc(*buf, *len + n + 1);
    cr_assert(*buf != NULL);
    memcpy(*buf + *len, data, n);
    *len += n;
    (*buf)[*len] = '\0';
}

/* Runs weftrun with the NULL-terminated arguments; kills it at the deadline. */
static void run_weftrun(result_t *r, ...)
{
    const char *argv[MAX_ARGS + 2];
    const char *envp[MAX_ENV];
    int out_pipe[2];
    int err_pipe[2];
    int nargs = 0;
    int nenv = 0;
    int status = 0;
    double deadline;
    va_list ap;
    const char *a;
    pid_t pid;

    memset(r, 0, sizeof(*r));
    append(&r->out, &r->out_len, "", 0);
    append(&r->err, &r->err_len, "", 0);
    argv[nargs++] = path_from_env("WEFTRUN");
    va_start(ap, r);
    while ((a = va_arg(ap, const char *)) != NULL) {
        cr_assert(nargs < MAX_ARGS);
        argv[nargs++] = a;
    }
    va_end(ap);
    argv[nargs] = NULL;
    for (char **e = environ; *e != NULL && nenv < MAX_ENV - 1; e++) {
        if (!scrubbed(*e)) {
            envp[nenv++] = *e;
        }
    }
    envp[nenv] = NULL;

    cr_assert(pipe2(out_pipe, O_CLOEXEC) == 0);
    cr_assert(pipe2(err_pipe, O_CLOEXEC) == 0);
    deadline = now_s() + DEADLINE_S;
    pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        int null_fd = open("/dev/null", O_RDONLY);
        dup2(null_fd, STDIN_FILENO);
        dup2(out_pipe[1], STDOUT_FILENO);
        dup2(err_pipe[1], STDERR_FILENO);
        execve(argv[0], (char *const *)argv, (char *const *)envp);
        _exit(126);
    }
    close(out_pipe[1]);
    close(err_pipe[1]);

    struct pollfd pfds[2] = {{.fd = out_pipe[0], .events = POLLIN},
                             {.fd = err_pipe[0], .events = POLLIN}};
    int open_fds = 2;
    while (open_fds > 0 && now_s() < deadline) {
        if (poll(pfds, 2, (int)((deadline - now_s()) * 1000) + 1) < 0) {
            cr_assert(errno == EINTR);
            continue;
        }
        for (int i = 0; i < 2; i++) {
            char buf[65536];
            ssize_t n;

            if (pfds[i].fd < 0 || pfds[i].revents == 0) {
                continue;
            }
            n = read(pfds[i].fd, buf, sizeof(buf));
            if (n > 0) {
                if (i == 0) {
                    append(&r->out, &r->out_len, buf, (size_t)n);
                } else {
                    append(&r->err, &r->err_len, buf, (size_t)n);
                }
            } else if (n == 0 || errno != EINTR) {
                close(pfds[i].fd);
                pfds[i].fd = -1;
                open_fds--;
            }
        }
    }
    for (int i = 0; i < 2; i++) {
        if (pfds[i].fd >= 0) {
            close(pfds[i].fd);
        }
    }

    for (;;) {
        pid_t w = waitpid(pid, &status, WNOHANG);
        if (w == pid) {
            break;
        }
        if (now_s() >= deadline) {
            /* weftrun passes SIGTERM on to the ranks and stops them. */
            kill(pid, SIGTERM);
            sleep(1);
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            cr_assert_fail("weftrun did not finish within %g s\nstdout:\n%s\nstderr:\n%s",
                           DEADLINE_S, r->out, r->err);
        }
        usleep(10000);
    }
    r->code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static void result_free(result_t *r)
{
    free(r->out);
    free(r->err);
}

/*
 * The first line of @p text that equals @p want (prefix == false) or starts
 * with it (prefix == true); NULL if none. Points into @p text.
 */
static const char *find_line(const char *text, const char *want, bool prefix)
{
    size_t want_len = strlen(want);
    const char *line = text;

    while (*line != '\0') {
        size_t len = strcspn(line, "\n");
        if ((prefix ? len >= want_len : len == want_len) && strncmp(line, want, want_len) == 0) {
            return line;
        }
        line += len + (line[len] == '\n' ? 1 : 0);
    }
    return NULL;
}

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

Test(examples, rpc_train_corrupt_data_exits_2, .timeout = 90)
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
