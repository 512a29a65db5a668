/* weft's side of the RPC benchmark (bench/run_rpc.py): two ranks over loopback, forked here.
 *
 * The parent forks rank 0 before any weft call; rank 0 creates its agent on a free master port
 * and hands the port back through a pipe; the parent then forks rank 1 with that port. Rank 1
 * registers "echo" (replies with the call's own arguments) and "sink" (replies with nothing),
 * both join, rank 0 measures, then both shut down collectively. Rank 1 waits for rank 0 to finish
 * (a byte, or EOF, on a pipe) before it calls weft_agent_shutdown, so that no shutdown overlaps the
 * measurement. Modes are those of bench_common.h:
 *
 *   bench_rpc pingpong SIZE ITERS          weft_rpc_sync("echo") of a SIZE-byte u8 tensor
 *   bench_rpc stream SIZE COUNT [WINDOW]   weft_rpc_async("sink") of a SIZE-byte tensor,
 *                                          WINDOW futures in flight
 *   bench_rpc async N [INFLIGHT [SIZE]]    weft_rpc_async("echo"), INFLIGHT futures in flight
 *
 * BENCH_TLS=1 in the environment: both ranks use TLS with client certificates (a job CA and
 * their certificates made before the fork, bench_tls.h).
 *
 * Prints {"system":"weft","metric":...,"value":...} lines on stdout. */
#include "bench_common.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <weft/weft.h>

#include "bench_tls.h"

#define SHUTDOWN_TIMEOUT_MS   30000
#define RENDEZVOUS_TIMEOUT_MS 30000

static int my_rank = -1;
static bench_tls_t g_tls; /* dir "" without BENCH_TLS */

static void fail(const char *what, weft_status_t s, const char *detail)
{
    fprintf(stderr, "bench_rpc[rank %d]: %s: %s (%s)\n", my_rank, what, weft_strerror(s),
            detail != NULL ? detail : "");
    exit(1);
}

static void check(weft_status_t s, const char *what)
{
    if (s != WEFT_OK) {
        fail(what, s, weft_last_error());
    }
}

static void echo_cb(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, weft_call_take_args(call));
}

static void sink_cb(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, NULL);
}

/* A value holding one prefaulted u8 tensor of @p size bytes. */
static weft_value_t *make_args(size_t size)
{
    int64_t shape = (int64_t)size;
    weft_tensor_t *t = NULL;
    weft_value_t *v = NULL;
    check(weft_tensor_empty(WEFT_U8, 1, &shape, &t), "weft_tensor_empty");
    memset(weft_tensor_data(t), 1, size);
    check(weft_value_create(&v), "weft_value_create");
    weft_status_t s = weft_value_push_tensor(v, t);
    if (s != WEFT_OK) {
        weft_tensor_release(t);
        fail("weft_value_push_tensor", s, weft_last_error());
    }
    return v;
}

static void wait_release(weft_future_t *f, const char *what)
{
    weft_status_t s = weft_future_wait(f, -1);
    if (s != WEFT_OK) {
        fail(what, s, weft_future_error(f));
    }
    weft_future_release(f);
}

/* Issues @p n calls of @p fn keeping at most b->window in flight, and waits for all of them. */
static void run_window(weft_agent_t *a, const bench_args_t *b, const char *fn,
                       const weft_value_t *args, weft_future_t **ring, size_t n)
{
    size_t head = 0;
    size_t inflight = 0;
    for (size_t i = 0; i < n; i++) {
        if (inflight == b->window) {
            wait_release(ring[head], fn);
            head = (head + 1) % b->window;
            inflight--;
        }
        weft_future_t *f = NULL;
        check(weft_rpc_async(a, 1, fn, args, 0, &f), "weft_rpc_async");
        ring[(head + inflight) % b->window] = f;
        inflight++;
    }
    while (inflight > 0) {
        wait_release(ring[head], fn);
        head = (head + 1) % b->window;
        inflight--;
    }
}

static void measure(weft_agent_t *a, const bench_args_t *b, uint64_t *rtt_ns, uint64_t *elapsed_ns)
{
    weft_value_t *args = make_args(b->size);
    if (b->mode == BENCH_PINGPONG) {
        for (size_t i = 0; i < b->warmup + b->count; i++) {
            weft_value_t *res = NULL;
            uint64_t t0 = bench_now_ns();
            check(weft_rpc_sync(a, 1, "echo", args, 0, &res), "weft_rpc_sync(echo)");
            uint64_t dt = bench_now_ns() - t0;
            weft_tensor_t *t = weft_value_tensor(res, 0);
            if (t == NULL || weft_tensor_nbytes(t) != b->size) {
                fail("echo", WEFT_ERR_PROTOCOL, "reply does not hold the tensor sent");
            }
            weft_value_free(res);
            if (i >= b->warmup) {
                rtt_ns[i - b->warmup] = dt;
            }
        }
    } else {
        const char *fn = b->mode == BENCH_STREAM ? "sink" : "echo";
        weft_future_t **ring = calloc(b->window, sizeof(*ring));
        if (ring == NULL) {
            fail("calloc", WEFT_ERR_NO_MEMORY, NULL);
        }
        run_window(a, b, fn, args, ring, b->warmup);
        uint64_t t0 = bench_now_ns();
        run_window(a, b, fn, args, ring, b->count);
        *elapsed_ns = bench_now_ns() - t0;
        free(ring);
    }
    weft_value_free(args);
}

static void opts_for(weft_agent_opts_t *o, int rank, int port)
{
    weft_agent_opts_init(o);
    o->rank = rank;
    o->world_size = 2;
    o->master_addr = "127.0.0.1";
    o->master_port = port;
    o->rendezvous_timeout_ms = RENDEZVOUS_TIMEOUT_MS;
    bench_tls_opts(&g_tls, o, rank);
}

static int rank0_main(const bench_args_t *b, int port_fd, int done_fd)
{
    weft_agent_opts_t o;
    weft_agent_t *a = NULL;
    my_rank = 0;
    opts_for(&o, 0, 0);
    check(weft_agent_create(&o, &a), "weft_agent_create");
    int port = weft_agent_port(a);
    if (write(port_fd, &port, sizeof(port)) != (ssize_t)sizeof(port)) {
        fail("write port", WEFT_ERR_IO, NULL);
    }
    close(port_fd);
    check(weft_agent_join(a), "weft_agent_join");

    uint64_t *rtt = calloc(b->mode == BENCH_PINGPONG ? b->count : 1, sizeof(*rtt));
    if (rtt == NULL) {
        fail("calloc", WEFT_ERR_NO_MEMORY, NULL);
    }
    uint64_t elapsed = 0;
    measure(a, b, rtt, &elapsed);
    if (write(done_fd, "x", 1) != 1) {
        fail("write done", WEFT_ERR_IO, NULL);
    }
    close(done_fd);
    bench_report("weft", b, rtt, elapsed);
    free(rtt);

    weft_status_t s = weft_agent_shutdown(a, SHUTDOWN_TIMEOUT_MS);
    weft_agent_free(a);
    check(s, "weft_agent_shutdown");
    return 0;
}

static int rank1_main(int port, int done_fd)
{
    weft_agent_opts_t o;
    weft_agent_t *a = NULL;
    my_rank = 1;
    opts_for(&o, 1, port);
    check(weft_agent_create(&o, &a), "weft_agent_create");
    check(weft_rpc_register(a, "echo", echo_cb, NULL), "register echo");
    check(weft_rpc_register(a, "sink", sink_cb, NULL), "register sink");
    check(weft_agent_join(a), "weft_agent_join");

    char c;
    while (read(done_fd, &c, 1) < 0 && errno == EINTR) {
    }
    close(done_fd);

    weft_status_t s = weft_agent_shutdown(a, SHUTDOWN_TIMEOUT_MS);
    weft_agent_free(a);
    check(s, "weft_agent_shutdown");
    return 0;
}

static int reap(pid_t pid, const char *who)
{
    int st = 0;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "bench_rpc: %s exited abnormally (status %d)\n", who, st);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    bench_args_t b;
    if (bench_parse_args(argc, argv, &b) != 0) {
        return 2;
    }
    int port_pipe[2];
    int done_pipe[2];
    const char *tls = getenv("BENCH_TLS");
    if (tls != NULL && strcmp(tls, "1") == 0 && bench_tls_make(&g_tls, 2) != 0) {
        return 1;
    }
    if (pipe(port_pipe) != 0 || pipe(done_pipe) != 0) {
        perror("pipe");
        return 1;
    }
    fflush(stdout);
    pid_t r0 = fork();
    if (r0 < 0) {
        perror("fork");
        return 1;
    }
    if (r0 == 0) {
        close(port_pipe[0]);
        close(done_pipe[0]);
        exit(rank0_main(&b, port_pipe[1], done_pipe[1]));
    }
    close(port_pipe[1]);
    int port = 0;
    ssize_t n = read(port_pipe[0], &port, sizeof(port));
    close(port_pipe[0]);
    if (n != (ssize_t)sizeof(port)) {
        fprintf(stderr, "bench_rpc: rank 0 did not start\n");
        close(done_pipe[0]);
        close(done_pipe[1]);
        reap(r0, "rank 0");
        return 1;
    }
    pid_t r1 = fork();
    if (r1 < 0) {
        perror("fork");
        kill(r0, SIGTERM);
        reap(r0, "rank 0");
        return 1;
    }
    if (r1 == 0) {
        close(done_pipe[1]);
        exit(rank1_main(port, done_pipe[0]));
    }
    close(done_pipe[0]);
    close(done_pipe[1]);
    int bad = reap(r0, "rank 0");
    bad |= reap(r1, "rank 1");
    bench_tls_remove(&g_tls);
    return bad;
}
