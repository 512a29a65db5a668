/*
 * weftrun, driven as a program: WEFTRUN is the launcher, WEFTRUN_CHILD the
 * rank program (tests/tools/child.c). Every run has a 30 s deadline.
 */

#include <criterion/criterion.h>

#include "run.h"
#include "wait.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define DEADLINE_S 30.0
#define MAX_ARGS   32
#define MAX_ENV    512

#define TOKEN "0123456789abcdef0123456789abcdef"

typedef run_result_t result_t;

static const char *child_path(void)
{
    return run_path_from_env("WEFTRUN_CHILD");
}

/*
 * Run weftrun with the NULL-terminated arguments after `env` (extra
 * "NAME=VALUE" entries, NULL-terminated, or NULL). When sig != 0 it is sent
 * to weftrun once sig_ranks ranks have said "sleeping" (child's sleep mode):
 * weftrun installs its handlers before it starts the ranks.
 */
static void run_weftrun(result_t *r, const char *const *env, int sig, int sig_ranks, ...)
{
    const char *argv[MAX_ARGS + 2];
    int nargs = 0;
    va_list ap;
    const char *a;

    argv[nargs++] = run_path_from_env("WEFTRUN");
    va_start(ap, sig_ranks);
    while ((a = va_arg(ap, const char *)) != NULL) {
        cr_assert(nargs < MAX_ARGS);
        argv[nargs++] = a;
    }
    va_end(ap);
    argv[nargs] = NULL;
    run_opts_t o = {.argv = argv,
                    .env = env,
                    .deadline_s = DEADLINE_S,
                    .sig = sig,
                    .sig_when = "sleeping\n",
                    .sig_when_count = sig_ranks};
    run_capture(&o, r);
}

#define result_free run_result_free

/* Iterate over the lines of a buffer. */
static bool next_line(const char **pos, const char *end, const char **line_p, size_t *len_p)
{
    const char *nl;

    if (*pos >= end) {
        return false;
    }
    nl = memchr(*pos, '\n', (size_t)(end - *pos));
    *line_p = *pos;
    *len_p = nl != NULL ? (size_t)(nl - *pos) : (size_t)(end - *pos);
    *pos = nl != NULL ? nl + 1 : end;
    return true;
}

/* Value of NAME in the lines "[rank R] NAME=VALUE" (rank < 0: unprefixed lines). */
static bool get_var(const char *text, int rank, const char *name, char *buf, size_t cap)
{
    const char *pos = text;
    const char *end = text + strlen(text);
    const char *line;
    size_t len;
    char want[128];
    size_t want_len;

    if (rank >= 0) {
        snprintf(want, sizeof(want), "[rank %d] %s=", rank, name);
    } else {
        snprintf(want, sizeof(want), "%s=", name);
    }
    want_len = strlen(want);
    while (next_line(&pos, end, &line, &len)) {
        if (len >= want_len && strncmp(line, want, want_len) == 0) {
            size_t n = len - want_len;
            cr_assert(n < cap);
            memcpy(buf, line + want_len, n);
            buf[n] = '\0';
            return true;
        }
    }
    return false;
}

static void expect_var(const char *text, int rank, const char *name, const char *value)
{
    char buf[256];

    cr_assert(get_var(text, rank, name, buf, sizeof(buf)), "rank %d: %s missing in:\n%s", rank,
              name, text);
    cr_expect_str_eq(buf, value, "rank %d: %s=%s, want %s", rank, name, buf, value);
}

static void expect_var_int(const char *text, int rank, const char *name, int value)
{
    char want[32];

    snprintf(want, sizeof(want), "%d", value);
    expect_var(text, rank, name, want);
}

/* The "rank R: NAME=VALUE ..." line that --print-env writes for rank R, or NULL. */
static const char *print_env_line(const char *text, int rank, char *buf, size_t cap)
{
    const char *pos = text;
    const char *end = text + strlen(text);
    const char *line;
    size_t len;
    char want[32];

    snprintf(want, sizeof(want), "rank %d:", rank);
    while (next_line(&pos, end, &line, &len)) {
        if (len >= strlen(want) && strncmp(line, want, strlen(want)) == 0) {
            cr_assert(len + 2 < cap);
            buf[0] = ' ';
            memcpy(buf + 1, line, len);
            buf[len + 1] = ' ';
            buf[len + 2] = '\0';
            return buf;
        }
    }
    return NULL;
}

static void expect_has(const char *line, const char *kv)
{
    char want[256];

    snprintf(want, sizeof(want), " %s ", kv);
    cr_expect(strstr(line, want) != NULL, "'%s' missing in: %s", kv, line);
}

/* ---- rank variables ---------------------------------------------------- */

Test(weftrun, four_ranks_get_their_variables)
{
    result_t r;
    char port[32] = "";
    char token[256] = "";

    run_weftrun(&r, NULL, 0, 0, "-n", "4", child_path(), "env", NULL);
    cr_assert_eq(r.code, 0, "exit %d\nstderr:\n%s", r.code, r.err);
    for (int rank = 0; rank < 4; rank++) {
        char buf[256];

        expect_var_int(r.out, rank, "WEFT_RANK", rank);
        expect_var_int(r.out, rank, "RANK", rank);
        expect_var_int(r.out, rank, "WEFT_LOCAL_RANK", rank);
        expect_var_int(r.out, rank, "LOCAL_RANK", rank);
        expect_var_int(r.out, rank, "WEFT_WORLD_SIZE", 4);
        expect_var_int(r.out, rank, "WORLD_SIZE", 4);
        expect_var_int(r.out, rank, "WEFT_LOCAL_WORLD_SIZE", 4);
        expect_var_int(r.out, rank, "LOCAL_WORLD_SIZE", 4);
        expect_var_int(r.out, rank, "WEFT_NODE_RANK", 0);
        expect_var(r.out, rank, "WEFT_MASTER_ADDR", "127.0.0.1");
        expect_var(r.out, rank, "MASTER_ADDR", "127.0.0.1");

        cr_assert(get_var(r.out, rank, "WEFT_MASTER_PORT", buf, sizeof(buf)));
        if (rank == 0) {
            int p = atoi(buf);
            cr_expect(p > 0 && p < 65536, "bad port '%s'", buf);
            strcpy(port, buf);
        }
        expect_var(r.out, rank, "WEFT_MASTER_PORT", port);
        expect_var(r.out, rank, "MASTER_PORT", port);

        cr_assert(get_var(r.out, rank, "WEFT_AUTH_TOKEN", buf, sizeof(buf)));
        if (rank == 0) {
            cr_expect_eq(strlen(buf), 32, "token '%s' is not 32 chars", buf);
            cr_expect_eq(strspn(buf, "0123456789abcdef"), 32, "token '%s' is not hex", buf);
            strcpy(token, buf);
        }
        expect_var(r.out, rank, "WEFT_AUTH_TOKEN", token);
    }
    result_free(&r);
}

Test(weftrun, keeps_auth_token_from_environment)
{
    static const char *const env[] = {"WEFT_AUTH_TOKEN=" TOKEN, NULL};
    result_t r;

    run_weftrun(&r, env, 0, 0, "-n", "2", child_path(), "env", NULL);
    cr_assert_eq(r.code, 0, "exit %d\nstderr:\n%s", r.code, r.err);
    expect_var(r.out, 0, "WEFT_AUTH_TOKEN", TOKEN);
    expect_var(r.out, 1, "WEFT_AUTH_TOKEN", TOKEN);
    result_free(&r);
}

/* --print-config: every WEFT_* variable, with the value in effect and where it came from; the
 * job's token is never printed. */
Test(weftrun, print_config_lists_every_variable)
{
    static const char *const env[] = {"WEFT_AUTH_TOKEN=" TOKEN, "WEFT_COLL_ALGO=ring",
                                      "MASTER_PORT=29501", "WEFT_PEER_TIMEOUT_MS=7", NULL};
    static const char *const names[] = {
        "WEFT_LOG",         "WEFT_SPIN_US",          "WEFT_TENSOR_CACHE_MB",
        "WEFT_REDUCE_SIMD", "WEFT_RANK",             "WEFT_WORLD_SIZE",
        "WEFT_MASTER_ADDR", "WEFT_MASTER_PORT",      "WEFT_NAME",
        "WEFT_LISTEN_HOST", "WEFT_SOCKET_IFNAME",    "WEFT_AUTH_TOKEN",
        "WEFT_RENDEZVOUS_TIMEOUT_MS",
        "WEFT_RPC_TIMEOUT_MS", "WEFT_PEER_TIMEOUT_MS", "WEFT_HANDLER_THREADS",
        "WEFT_MAX_MESSAGE_BYTES", "WEFT_HANDSHAKE_TIMEOUT_MS", "WEFT_DIRECT",
        "WEFT_RREF_EAGER_BYTES", "WEFT_RREF_FAULT_DELAY_US", "WEFT_RREF_FAULT_DUP",
        "WEFT_COLL_TIMEOUT_MS", "WEFT_COLL_ALGO", "WEFT_COLL_CMA", "WEFT_DATA_DIR"};
    result_t r;

    run_weftrun(&r, env, 0, 0, "--print-config", NULL);
    cr_assert_eq(r.code, 0, "exit %d\nstderr:\n%s", r.code, r.err);
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        char want[64];
        snprintf(want, sizeof(want), "%-28s = ", names[i]);
        cr_expect_not_null(strstr(r.out, want), "%s is not listed:\n%s", names[i], r.out);
    }
    cr_expect_null(strstr(r.out, TOKEN), "the token was printed");
    static const char *const lines[] = {
        "WEFT_AUTH_TOKEN              = (set, hidden)            (from WEFT_AUTH_TOKEN)",
        "WEFT_COLL_ALGO               = ring                     (from WEFT_COLL_ALGO)",
        "WEFT_MASTER_PORT             = 29501                    (from MASTER_PORT)",
        /* An invalid value is reported and the default used. */
        "WEFT_PEER_TIMEOUT_MS         = 2000                     (default)",
    };
    for (size_t i = 0; i < sizeof(lines) / sizeof(lines[0]); i++) {
        cr_expect_not_null(run_find_line(r.out, lines[i], false), "missing: %s\n%s", lines[i],
                           r.out);
    }
    cr_expect_not_null(strstr(r.err, "ignoring WEFT_PEER_TIMEOUT_MS=7"), "stderr: %s", r.err);
    result_free(&r);
}

Test(weftrun, print_env_second_node)
{
    static const char *const env[] = {"WEFT_AUTH_TOKEN=" TOKEN, NULL};
    result_t r;
    char buf[4096];
    const char *line;

    run_weftrun(&r, env, 0, 0, "--nnodes", "2", "--node-rank", "1", "-n", "2", "--master-port",
                "29999", "--master-addr", "10.0.0.1", "--print-env", child_path(), NULL);
    cr_assert_eq(r.code, 0, "exit %d\nstderr:\n%s", r.code, r.err);
    cr_expect_null(print_env_line(r.out, 0, buf, sizeof(buf)), "rank 0 printed:\n%s", r.out);
    cr_expect_null(print_env_line(r.out, 1, buf, sizeof(buf)), "rank 1 printed:\n%s", r.out);
    for (int rank = 2; rank < 4; rank++) {
        char kv[64];

        line = print_env_line(r.out, rank, buf, sizeof(buf));
        cr_assert_not_null(line, "rank %d missing:\n%s", rank, r.out);
        snprintf(kv, sizeof(kv), "WEFT_RANK=%d", rank);
        expect_has(line, kv);
        snprintf(kv, sizeof(kv), "RANK=%d", rank);
        expect_has(line, kv);
        snprintf(kv, sizeof(kv), "WEFT_LOCAL_RANK=%d", rank - 2);
        expect_has(line, kv);
        expect_has(line, "WEFT_WORLD_SIZE=4");
        expect_has(line, "WORLD_SIZE=4");
        expect_has(line, "WEFT_LOCAL_WORLD_SIZE=2");
        expect_has(line, "WEFT_NODE_RANK=1");
        expect_has(line, "WEFT_MASTER_PORT=29999");
        expect_has(line, "MASTER_PORT=29999");
        expect_has(line, "MASTER_ADDR=10.0.0.1");
        expect_has(line, "WEFT_AUTH_TOKEN=" TOKEN);
    }
    result_free(&r);
}

Test(weftrun, multi_node_needs_port_and_token)
{
    static const char *const env[] = {"WEFT_AUTH_TOKEN=" TOKEN, NULL};
    result_t r;

    run_weftrun(&r, env, 0, 0, "--nnodes", "2", "-n", "2", "--print-env", child_path(), NULL);
    cr_expect_eq(r.code, 2, "exit %d", r.code);
    cr_expect(strstr(r.err, "--master-port") != NULL, "stderr:\n%s", r.err);
    result_free(&r);

    run_weftrun(&r, NULL, 0, 0, "--nnodes", "2", "-n", "2", "--master-port", "29999", "--print-env",
                child_path(), NULL);
    cr_expect_eq(r.code, 2, "exit %d", r.code);
    cr_expect(strstr(r.err, "WEFT_AUTH_TOKEN") != NULL, "stderr:\n%s", r.err);
    result_free(&r);

    run_weftrun(&r, env, 0, 0, "--nnodes", "2", "--node-rank", "2", "--master-port", "29999",
                child_path(), NULL);
    cr_expect_eq(r.code, 2, "exit %d", r.code);
    cr_expect(strstr(r.err, "--node-rank") != NULL, "stderr:\n%s", r.err);
    result_free(&r);
}

/* ---- srun / mpirun ----------------------------------------------------- */

Test(weftrun, mpirun_task_execs_one_rank)
{
    static const char *const env[] = {
        "OMPI_COMM_WORLD_RANK=3",       "OMPI_COMM_WORLD_SIZE=4",
        "OMPI_COMM_WORLD_LOCAL_RANK=1", "OMPI_COMM_WORLD_LOCAL_SIZE=2",
        "MASTER_ADDR=10.1.2.3",         "MASTER_PORT=29500",
        "WEFT_AUTH_TOKEN=" TOKEN,       NULL,
    };
    result_t r;
    char buf[64];

    run_weftrun(&r, env, 0, 0, child_path(), "env", NULL);
    cr_assert_eq(r.code, 0, "exit %d\nstderr:\n%s", r.code, r.err);
    expect_var_int(r.out, -1, "WEFT_RANK", 3);
    expect_var_int(r.out, -1, "RANK", 3);
    expect_var_int(r.out, -1, "WEFT_WORLD_SIZE", 4);
    expect_var_int(r.out, -1, "WEFT_LOCAL_RANK", 1);
    expect_var_int(r.out, -1, "LOCAL_RANK", 1);
    expect_var_int(r.out, -1, "WEFT_LOCAL_WORLD_SIZE", 2);
    expect_var_int(r.out, -1, "WEFT_NODE_RANK", 1);
    expect_var(r.out, -1, "WEFT_MASTER_ADDR", "10.1.2.3");
    expect_var(r.out, -1, "WEFT_MASTER_PORT", "29500");
    expect_var(r.out, -1, "WEFT_AUTH_TOKEN", TOKEN);
    /* exec'd in place: the rank is the very process that was started. */
    cr_assert(get_var(r.out, -1, "PID", buf, sizeof(buf)));
    cr_expect_eq(atoi(buf), (int)r.pid, "rank pid %s, weftrun pid %d", buf, (int)r.pid);
    result_free(&r);
}

Test(weftrun, mpirun_task_needs_master)
{
    static const char *const env[] = {
        "OMPI_COMM_WORLD_RANK=0",       "OMPI_COMM_WORLD_SIZE=2", "OMPI_COMM_WORLD_LOCAL_RANK=0",
        "OMPI_COMM_WORLD_LOCAL_SIZE=2", "WEFT_AUTH_TOKEN=" TOKEN, NULL,
    };
    result_t r;

    run_weftrun(&r, env, 0, 0, child_path(), "env", NULL);
    cr_expect_eq(r.code, 2, "exit %d", r.code);
    cr_expect(strstr(r.err, "MASTER_ADDR") != NULL, "stderr:\n%s", r.err);
    result_free(&r);
}

Test(weftrun, srun_task_print_env)
{
    static const char *const env[] = {
        "SLURM_PROCID=5",
        "SLURM_NTASKS=8",
        "SLURM_LOCALID=1",
        "SLURM_NODEID=2",
        "SLURM_STEP_ID=0",
        "SLURM_JOB_NUM_NODES=4",
        "SLURM_STEP_TASKS_PER_NODE=2(x4)",
        "SLURM_JOB_NODELIST=gpu[007-010]",
        "MASTER_PORT=29500",
        "WEFT_AUTH_TOKEN=" TOKEN,
        NULL,
    };
    result_t r;
    char buf[4096];
    const char *line;

    run_weftrun(&r, env, 0, 0, "--print-env", child_path(), NULL);
    cr_assert_eq(r.code, 0, "exit %d\nstderr:\n%s", r.code, r.err);
    line = print_env_line(r.out, 5, buf, sizeof(buf));
    cr_assert_not_null(line, "stdout:\n%s", r.out);
    expect_has(line, "WEFT_RANK=5");
    expect_has(line, "WEFT_WORLD_SIZE=8");
    expect_has(line, "WEFT_LOCAL_RANK=1");
    expect_has(line, "WEFT_LOCAL_WORLD_SIZE=2");
    expect_has(line, "WEFT_NODE_RANK=2");
    expect_has(line, "WEFT_MASTER_ADDR=gpu007");
    expect_has(line, "MASTER_PORT=29500");
    result_free(&r);
}

Test(weftrun, srun_task_per_node_with_n)
{
    static const char *const env[] = {
        "SLURM_PROCID=1",           "SLURM_NTASKS=2",
        "SLURM_LOCALID=0",          "SLURM_NODEID=1",
        "SLURM_STEP_ID=3",          "SLURM_NTASKS_PER_NODE=1",
        "SLURM_JOB_NODELIST=n1,n2", "MASTER_PORT=29501",
        "WEFT_AUTH_TOKEN=" TOKEN,   NULL,
    };
    result_t r;
    char buf[4096];
    const char *line;

    run_weftrun(&r, env, 0, 0, "-n", "2", "--print-env", child_path(), NULL);
    cr_assert_eq(r.code, 0, "exit %d\nstderr:\n%s", r.code, r.err);
    line = print_env_line(r.out, 3, buf, sizeof(buf));
    cr_assert_not_null(line, "stdout:\n%s", r.out);
    expect_has(line, "WEFT_WORLD_SIZE=4");
    expect_has(line, "WEFT_LOCAL_RANK=1");
    expect_has(line, "WEFT_NODE_RANK=1");
    expect_has(line, "WEFT_MASTER_ADDR=n1");
    cr_expect_not_null(print_env_line(r.out, 2, buf, sizeof(buf)), "stdout:\n%s", r.out);
    result_free(&r);
}

/* ---- output ------------------------------------------------------------ */

/* Every line is "[rank R] <tag> R i" for one i < n, once, or "[rank R] tail R". */
static void check_lines(const char *text, const char *tag, int nranks, int n, bool tails)
{
    const char *pos = text;
    const char *end = text + strlen(text);
    const char *line;
    size_t len;
    int *seen = calloc((size_t)(nranks * n), sizeof(int));
    int tail_seen[8] = {0};
    char fmt[32];
    char tail_fmt[32];

    cr_assert(seen != NULL && nranks <= 8);
    snprintf(fmt, sizeof(fmt), "[rank %%d] %s %%d %%d%%n", tag);
    snprintf(tail_fmt, sizeof(tail_fmt), "[rank %%d] tail %%d%%n");
    while (next_line(&pos, end, &line, &len)) {
        char copy[128];
        int r1 = -1;
        int r2 = -2;
        int i = -1;
        int used = 0;

        cr_assert(len < sizeof(copy), "line too long: %.*s", (int)len, line);
        memcpy(copy, line, len);
        copy[len] = '\0';
        if (sscanf(copy, fmt, &r1, &r2, &i, &used) == 3 && (size_t)used == len) {
            cr_assert(r1 == r2 && r1 >= 0 && r1 < nranks && i >= 0 && i < n, "bad line '%s'", copy);
            seen[r1 * n + i]++;
            continue;
        }
        used = 0;
        if (tails && sscanf(copy, tail_fmt, &r1, &r2, &used) == 2 && (size_t)used == len) {
            cr_assert(r1 == r2 && r1 >= 0 && r1 < nranks, "bad line '%s'", copy);
            tail_seen[r1]++;
            continue;
        }
        cr_assert_fail("unexpected line '%s'", copy);
    }
    for (int r = 0; r < nranks; r++) {
        for (int i = 0; i < n; i++) {
            cr_assert_eq(seen[r * n + i], 1, "'%s %d %d' seen %d times", tag, r, i,
                         seen[r * n + i]);
        }
        if (tails) {
            cr_assert_eq(tail_seen[r], 1, "'tail %d' seen %d times", r, tail_seen[r]);
        }
    }
    free(seen);
}

Test(weftrun, every_line_prefixed_none_lost)
{
    result_t r;

    run_weftrun(&r, NULL, 0, 0, "-n", "4", child_path(), "lines", "1000", NULL);
    cr_assert_eq(r.code, 0, "exit %d\nstderr:\n%.2000s", r.code, r.err);
    check_lines(r.out, "out", 4, 1000, true);
    check_lines(r.err, "err", 4, 1000, false);
    result_free(&r);
}

Test(weftrun, long_lines_come_in_prefixed_pieces)
{
    enum { BYTES = 200000, RANKS = 2 };
    result_t r;
    const char *pos;
    const char *end;
    const char *line;
    size_t len;
    size_t letters[RANKS] = {0};
    int pieces[RANKS] = {0};
    bool after[RANKS] = {false};

    run_weftrun(&r, NULL, 0, 0, "-n", "2", child_path(), "long", "200000", NULL);
    cr_assert_eq(r.code, 0, "exit %d\nstderr:\n%s", r.code, r.err);
    pos = r.out;
    end = r.out + r.out_len;
    while (next_line(&pos, end, &line, &len)) {
        int rank = -1;
        int used = 0;
        char want[32];

        cr_assert(sscanf(line, "[rank %d] %n", &rank, &used) == 1 && used > 0 && rank >= 0 &&
                      rank < RANKS,
                  "unprefixed line '%.40s'", line);
        line += used;
        len -= (size_t)used;
        snprintf(want, sizeof(want), "after %d", rank);
        if (len == strlen(want) && strncmp(line, want, len) == 0) {
            cr_assert(!after[rank]);
            after[rank] = true;
            continue;
        }
        cr_assert(!after[rank], "rank %d: letters after its last line", rank);
        for (size_t i = 0; i < len; i++) {
            cr_assert_eq(line[i], 'a' + rank, "rank %d: byte '%c' in its long line", rank, line[i]);
        }
        letters[rank] += len;
        pieces[rank]++;
    }
    for (int rank = 0; rank < RANKS; rank++) {
        cr_expect_eq(letters[rank], BYTES, "rank %d: %zu of %d bytes", rank, letters[rank], BYTES);
        cr_expect_geq(pieces[rank], 4, "rank %d: %d pieces", rank, pieces[rank]);
        cr_expect(after[rank], "rank %d: no 'after' line", rank);
    }
    result_free(&r);
}

Test(weftrun, no_prefix_passes_output_through)
{
    result_t r;

    run_weftrun(&r, NULL, 0, 0, "--no-prefix", "-n", "2", child_path(), "env", NULL);
    cr_assert_eq(r.code, 0, "exit %d\nstderr:\n%s", r.code, r.err);
    cr_expect_null(strstr(r.out, "[rank"), "stdout:\n%s", r.out);
    cr_expect(strstr(r.out, "\nWEFT_RANK=0\n") != NULL || strncmp(r.out, "WEFT_RANK=0\n", 12) == 0,
              "stdout:\n%s", r.out);
    cr_expect(strstr(r.out, "\nWEFT_RANK=1\n") != NULL || strncmp(r.out, "WEFT_RANK=1\n", 12) == 0,
              "stdout:\n%s", r.out);
    result_free(&r);
}

/* ---- failures ---------------------------------------------------------- */

Test(weftrun, failing_rank_stops_the_others)
{
    result_t r;

    run_weftrun(&r, NULL, 0, 0, "-n", "4", child_path(), "exit", "2", "7", "60", NULL);
    cr_expect_eq(r.code, 7, "exit %d\nstderr:\n%s", r.code, r.err);
    cr_expect(strstr(r.err, "weftrun: rank 2 (pid ") != NULL, "stderr:\n%s", r.err);
    cr_expect(strstr(r.err, "exited with status 7") != NULL, "stderr:\n%s", r.err);
    cr_expect_lt(r.elapsed, 20.0, "took %.1f s: the sleeping ranks were not stopped", r.elapsed);
    result_free(&r);
}

Test(weftrun, segfault_is_reported_as_signal)
{
    result_t r;

    run_weftrun(&r, NULL, 0, 0, "-n", "3", child_path(), "segv", "1", "60", NULL);
    cr_expect_eq(r.code, 139, "exit %d\nstderr:\n%s", r.code, r.err);
    cr_expect(strstr(r.err, "weftrun: rank 1 (pid ") != NULL, "stderr:\n%s", r.err);
    cr_expect(strstr(r.err, "killed by signal SIGSEGV (11)") != NULL, "stderr:\n%s", r.err);
    cr_expect_lt(r.elapsed, 20.0, "took %.1f s", r.elapsed);
    result_free(&r);
}

Test(weftrun, rank_ignoring_sigterm_gets_sigkill)
{
    result_t r;

    run_weftrun(&r, NULL, 0, 0, "-n", "2", child_path(), "stubborn", "0", "3", "60", NULL);
    cr_expect_eq(r.code, 3, "exit %d\nstderr:\n%s", r.code, r.err);
    cr_expect(strstr(r.err, "SIGKILL") != NULL, "stderr:\n%s", r.err);
    cr_expect_geq(r.elapsed, 4.5, "SIGKILL came after %.1f s, before the grace period", r.elapsed);
    cr_expect_lt(r.elapsed, 20.0, "took %.1f s", r.elapsed);
    result_free(&r);
}

Test(weftrun, timeout_exits_124)
{
    result_t r;

    run_weftrun(&r, NULL, 0, 0, "--timeout", "1", "-n", "2", child_path(), "sleep", "60", NULL);
    cr_expect_eq(r.code, 124, "exit %d\nstderr:\n%s", r.code, r.err);
    cr_expect(strstr(r.err, "timeout") != NULL, "stderr:\n%s", r.err);
    cr_expect_geq(r.elapsed, 0.9, "took %.1f s", r.elapsed);
    cr_expect_lt(r.elapsed, 15.0, "took %.1f s", r.elapsed);
    result_free(&r);
}

Test(weftrun, sigterm_and_sigint_are_forwarded)
{
    result_t r;

    run_weftrun(&r, NULL, SIGTERM, 2, "-n", "2", child_path(), "sleep", "60", NULL);
    cr_expect_eq(r.code, 143, "exit %d\nstderr:\n%s", r.code, r.err);
    cr_expect_lt(r.elapsed, 15.0, "took %.1f s", r.elapsed);
    result_free(&r);

    run_weftrun(&r, NULL, SIGINT, 2, "-n", "2", child_path(), "sleep", "60", NULL);
    cr_expect_eq(r.code, 130, "exit %d\nstderr:\n%s", r.code, r.err);
    cr_expect(strstr(r.err, "SIGINT") != NULL, "stderr:\n%s", r.err);
    cr_expect_lt(r.elapsed, 15.0, "took %.1f s", r.elapsed);
    result_free(&r);
}

/* Whether process @p pid is gone (or a zombie). */
static bool process_gone(int pid)
{
    char path[64];
    char stat[512] = "";
    bool gone = false;
    FILE *f;

    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    f = fopen(path, "r");
    if (f == NULL) {
        return true;
    }
    if (fgets(stat, sizeof(stat), f) != NULL) {
        const char *state = strrchr(stat, ')');
        gone = state != NULL && (state[2] == 'Z' || state[2] == 'X');
    }
    fclose(f);
    return gone;
}

/* A process a failed rank leaves behind is killed, and its open pipe does not hang weftrun. */
Test(weftrun, failed_rank_leftovers_are_killed)
{
    result_t r;
    const char *g;
    int pid = 0;
    bool gone = false;

    run_weftrun(&r, NULL, 0, 0, "-n", "2", child_path(), "orphan", "1", "5", NULL);
    cr_expect_eq(r.code, 5, "exit %d\nstderr:\n%s", r.code, r.err);
    cr_expect_lt(r.elapsed, 20.0, "took %.1f s", r.elapsed);
    g = strstr(r.out, "[rank 1] GRANDCHILD ");
    cr_assert_not_null(g, "stdout:\n%s", r.out);
    pid = atoi(g + strlen("[rank 1] GRANDCHILD "));
    cr_assert_gt(pid, 0);
    WAIT_UNTIL(gone, process_gone(pid), 10000);
    if (!gone) {
        kill(pid, SIGKILL);
    }
    cr_expect(gone, "grandchild %d survived", pid);
    result_free(&r);
}

/* ---- usage ------------------------------------------------------------- */

Test(weftrun, missing_program)
{
    result_t r;

    run_weftrun(&r, NULL, 0, 0, "-n", "2", "/nonexistent/weftrun-prog", NULL);
    cr_expect_eq(r.code, 127, "exit %d", r.code);
    cr_expect(strstr(r.err, "cannot execute '/nonexistent/weftrun-prog'") != NULL, "stderr:\n%s",
              r.err);
    result_free(&r);

    run_weftrun(&r, NULL, 0, 0, "-n", "2", NULL);
    cr_expect_eq(r.code, 2, "exit %d", r.code);
    cr_expect(strstr(r.err, "no program") != NULL, "stderr:\n%s", r.err);
    result_free(&r);
}

Test(weftrun, bad_options_exit_2)
{
    result_t r;

    run_weftrun(&r, NULL, 0, 0, "--bogus", child_path(), NULL);
    cr_expect_eq(r.code, 2, "exit %d", r.code);
    cr_expect(strstr(r.err, "unknown option '--bogus'") != NULL, "stderr:\n%s", r.err);
    result_free(&r);

    run_weftrun(&r, NULL, 0, 0, "-n", "0", child_path(), NULL);
    cr_expect_eq(r.code, 2, "exit %d", r.code);
    cr_expect(strstr(r.err, "-n") != NULL, "stderr:\n%s", r.err);
    result_free(&r);

    run_weftrun(&r, NULL, 0, 0, "--timeout", "soon", child_path(), NULL);
    cr_expect_eq(r.code, 2, "exit %d", r.code);
    result_free(&r);

    run_weftrun(&r, NULL, 0, 0, "--help", NULL);
    cr_expect_eq(r.code, 0, "exit %d", r.code);
    cr_expect(strstr(r.out, "Usage: weftrun") != NULL, "stdout:\n%s", r.out);
    result_free(&r);
}
