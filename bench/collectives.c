/* weft's side of the collectives benchmark (bench/run_collectives.py): WORLD ranks over loopback,
 * forked here.
 *
 * The parent forks rank 0 before any weft call; rank 0 creates its agent on a free master port
 * and hands the port back through a pipe; the parent then forks ranks 1..WORLD-1 with that port.
 * Every rank joins, takes the world group and runs the points of coll_common.h (ops x sizes,
 * blocking calls, f32, sum, root 0); rank 0 prints one line per point:
 *
 *   {"system":"weft","op":"all_reduce","world":2,"bytes":4096,"time_us":..,"algbw":..,
 *    "busbw":..,"iters":..}
 *
 * then all shut down collectively. The parent kills every rank when one fails or at --timeout.
 *
 *   bench_collectives WORLD [--quick] [--ops OP,...] [--sizes SIZE,...] [--budget S]
 *                     [--max-iters N] [--timeout S] [--system NAME] */
#include "coll_common.h"

#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <weft/weft.h>

#define SHUTDOWN_TIMEOUT_MS   30000
#define RENDEZVOUS_TIMEOUT_MS 30000
#define OP_TIMEOUT_MS         120000
#define MAX_WORLD             64

static int my_rank = -1;

static void fail(const char *what, weft_status_t s, const char *detail)
{
    fprintf(stderr, "bench_collectives[rank %d]: %s: %s (%s)\n", my_rank, what, weft_strerror(s),
            detail != NULL ? detail : "");
    exit(1);
}

static void check(weft_status_t s, const char *what)
{
    if (s != WEFT_OK) {
        fail(what, s, weft_last_error());
    }
}

/* A 1-D f32 tensor of @p n zeros, every page written. NULL for n == 0. */
static weft_tensor_t *zeros(size_t n)
{
    if (n == 0) {
        return NULL;
    }
    int64_t shape = (int64_t)n;
    weft_tensor_t *t = NULL;
    check(weft_tensor_empty(WEFT_F32, 1, &shape, &t), "weft_tensor_empty");
    memset(weft_tensor_data(t), 0, weft_tensor_nbytes(t));
    return t;
}

static void run_op(weft_pg_t *pg, coll_op_t op, weft_tensor_t *in, weft_tensor_t *out)
{
    weft_status_t s = WEFT_OK;
    switch (op) {
    case COLL_ALL_REDUCE:
        s = weft_coll_all_reduce(pg, in, WEFT_SUM, NULL);
        break;
    case COLL_BROADCAST:
        s = weft_coll_broadcast(pg, in, 0, NULL);
        break;
    case COLL_ALL_GATHER:
        s = weft_coll_all_gather(pg, in, out, NULL);
        break;
    case COLL_REDUCE_SCATTER:
        s = weft_coll_reduce_scatter(pg, in, out, WEFT_SUM, NULL);
        break;
    case COLL_ALL_TO_ALL:
        s = weft_coll_all_to_all(pg, in, out, NULL, NULL, NULL);
        break;
    default:
        s = WEFT_ERR_INVALID_ARG;
        break;
    }
    check(s, coll_op_names[op]);
}

/* The maximum of @p v over the group's ranks. */
static double max_over_ranks(weft_pg_t *pg, double v)
{
    int64_t shape = 1;
    weft_tensor_t *t = NULL;
    check(weft_tensor_empty(WEFT_F64, 1, &shape, &t), "weft_tensor_empty");
    *(double *)weft_tensor_data(t) = v;
    check(weft_coll_all_reduce(pg, t, WEFT_MAX, NULL), "all_reduce(max)");
    double r = *(double *)weft_tensor_data(t);
    weft_tensor_release(t);
    return r;
}

static void measure_point(weft_pg_t *pg, const coll_args_t *a, coll_op_t op, size_t bytes)
{
    int world = weft_pg_size(pg);
    size_t n_in = 0;
    size_t n_out = 0;
    coll_counts(op, bytes, world, &n_in, &n_out);
    weft_tensor_t *in = zeros(n_in);
    weft_tensor_t *out = zeros(n_out);

    size_t warmup = coll_warmup_iters(a, bytes);
    uint64_t t_first = 0;
    uint64_t t0 = bench_now_ns();
    for (size_t i = 0; i < warmup; i++) {
        run_op(pg, op, in, out);
        if (i == 0) {
            t_first = bench_now_ns();
        }
    }
    uint64_t t1 = bench_now_ns();
    double est =
        warmup > 1 ? (double)(t1 - t_first) / 1e9 / (double)(warmup - 1) : (double)(t1 - t0) / 1e9;
    size_t iters = coll_timed_iters(a, max_over_ranks(pg, est));

    check(weft_coll_barrier(pg, NULL), "barrier");
    t0 = bench_now_ns();
    for (size_t i = 0; i < iters; i++) {
        run_op(pg, op, in, out);
    }
    t1 = bench_now_ns();
    double per_op = max_over_ranks(pg, (double)(t1 - t0) / 1e9 / (double)iters);
    if (weft_pg_rank(pg) == 0) {
        coll_print(a->system != NULL ? a->system : "weft", op, world, bytes, per_op, iters);
    }
    weft_tensor_release(out);
    weft_tensor_release(in);
}

static int rank_main(const coll_args_t *a, int rank, int port, int port_fd)
{
    weft_agent_opts_t o;
    weft_agent_t *ag = NULL;
    weft_pg_t *pg = NULL;
    my_rank = rank;
    weft_agent_opts_init(&o);
    o.rank = rank;
    o.world_size = a->world;
    o.master_addr = "127.0.0.1";
    o.master_port = port;
    o.rendezvous_timeout_ms = RENDEZVOUS_TIMEOUT_MS;
    check(weft_agent_create(&o, &ag), "weft_agent_create");
    if (rank == 0) {
        int p = weft_agent_port(ag);
        if (write(port_fd, &p, sizeof(p)) != (ssize_t)sizeof(p)) {
            fail("write port", WEFT_ERR_IO, NULL);
        }
        close(port_fd);
    }
    check(weft_agent_join(ag), "weft_agent_join");
    check(weft_pg_world(ag, &pg), "weft_pg_world");
    weft_pg_set_timeout(pg, OP_TIMEOUT_MS);

    for (int op = 0; op < COLL_OP_COUNT; op++) {
        if ((a->ops & (1u << op)) == 0) {
            continue;
        }
        for (int i = 0; i < a->nsizes; i++) {
            measure_point(pg, a, (coll_op_t)op, a->sizes[i]);
        }
    }

    weft_pg_free(pg);
    weft_status_t s = weft_agent_shutdown(ag, SHUTDOWN_TIMEOUT_MS);
    weft_agent_free(ag);
    check(s, "weft_agent_shutdown");
    return 0;
}

/* Forks a rank that dies with the parent. Returns the child's pid in the parent, -1 on failure. */
static pid_t fork_rank(void)
{
    pid_t parent = getpid();
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) {
            _exit(1);
        }
    }
    return pid;
}

static void kill_all(pid_t *pids, int n)
{
    for (int i = 0; i < n; i++) {
        if (pids[i] > 0) {
            kill(pids[i], SIGKILL);
        }
    }
}

/* Waits for the @p n ranks until @p deadline_ns; kills all of them when one fails or at the
 * deadline. Returns 0 when every rank exited with status 0. */
static int reap_all(pid_t *pids, int n, uint64_t deadline_ns)
{
    int left = 0;
    int bad = 0;
    for (int i = 0; i < n; i++) {
        left += pids[i] > 0;
    }
    while (left > 0) {
        int st = 0;
        pid_t p = waitpid(-1, &st, WNOHANG);
        if (p > 0) {
            for (int i = 0; i < n; i++) {
                if (pids[i] != p) {
                    continue;
                }
                pids[i] = -1;
                left--;
                if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
                    fprintf(stderr, "bench_collectives: rank %d exited abnormally (status %d)\n", i,
                            st);
                    if (!bad) {
                        kill_all(pids, n);
                    }
                    bad = 1;
                }
            }
            continue;
        }
        if (p < 0 && errno != EINTR) {
            perror("waitpid");
            kill_all(pids, n);
            return 1;
        }
        if (bench_now_ns() > deadline_ns) {
            fprintf(stderr, "bench_collectives: timed out; killing the ranks\n");
            kill_all(pids, n);
            deadline_ns = UINT64_MAX;
            bad = 1;
        }
        usleep(10000);
    }
    return bad;
}

int main(int argc, char **argv)
{
    coll_args_t a;
    if (coll_parse_args(argc, argv, &a) != 0) {
        return 2;
    }
    if (a.world < 2 || a.world > MAX_WORLD) {
        fprintf(stderr, "bench_collectives: WORLD (2..%d) is required\n", MAX_WORLD);
        coll_usage(argv[0]);
        return 2;
    }
    if (coll_check_world(&a, a.world) != 0) {
        return 2;
    }
    uint64_t deadline = bench_now_ns() + (uint64_t)(a.timeout_s * 1e9);
    pid_t pids[MAX_WORLD];
    for (int i = 0; i < a.world; i++) {
        pids[i] = -1;
    }
    int port_pipe[2];
    if (pipe(port_pipe) != 0) {
        perror("pipe");
        return 1;
    }
    pids[0] = fork_rank();
    if (pids[0] < 0) {
        perror("fork");
        return 1;
    }
    if (pids[0] == 0) {
        close(port_pipe[0]);
        exit(rank_main(&a, 0, 0, port_pipe[1]));
    }
    close(port_pipe[1]);
    int port = 0;
    ssize_t got = -1;
    struct pollfd pfd = {.fd = port_pipe[0], .events = POLLIN};
    if (poll(&pfd, 1, RENDEZVOUS_TIMEOUT_MS) == 1) {
        got = read(port_pipe[0], &port, sizeof(port));
    }
    close(port_pipe[0]);
    if (got != (ssize_t)sizeof(port)) {
        fprintf(stderr, "bench_collectives: rank 0 did not start\n");
        kill_all(pids, 1);
        reap_all(pids, 1, deadline);
        return 1;
    }
    for (int r = 1; r < a.world; r++) {
        pids[r] = fork_rank();
        if (pids[r] < 0) {
            perror("fork");
            kill_all(pids, r);
            reap_all(pids, r, deadline);
            return 1;
        }
        if (pids[r] == 0) {
            exit(rank_main(&a, r, port, -1));
        }
    }
    return reap_all(pids, a.world, deadline);
}
