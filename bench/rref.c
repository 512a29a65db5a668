/* weft's side of the remote-reference benchmark (bench/run_rref.py): ranks over loopback, forked
 * here as bench/rpc.c does (rank 0 first, on a free master port it hands back through a pipe, then
 * the others). Rank 1 registers "echo" (its result is the call's arguments); rank 2 registers
 * "pass_back" (its result holds the RRef it received: a fork back to the caller); every rank
 * registers "rref_counts" (its result is weft_rref_debug_info's JSON). Rank 0 measures; the
 * others wait for it to finish (EOF on a pipe) before the collective weft_agent_shutdown, so that
 * no shutdown overlaps the measurement.
 *
 *   bench_rref latency SIZE ITERS   2 ranks. weft_rref_remote(1, "echo", a SIZE-byte u8 tensor)
 *                                   then weft_rref_to_here, one at a time; the reference is
 *                                   released after each (outside the timing). Prints
 *                                   remote_to_here_p50_<SIZE> and remote_to_here_p99_<SIZE> (us).
 *   bench_rref fork N [INFLIGHT]    3 ranks. N times: rank 0 creates a reference to a 64-byte
 *                                   value on rank 1 (weft_rref_remote), sends it to rank 2 inside
 *                                   the arguments of "pass_back" (fork 0->2) and drops its handle
 *                                   at once; rank 2 answers with it (fork 2->0); rank 0 checks the
 *                                   id and drops that too. INFLIGHT (default 16) operations in
 *                                   flight. The clock stops once rank 1 owns no reference any
 *                                   more (every one released). Prints fork_throughput
 *                                   (forks/s, two per operation) and fork_ops_throughput (ops/s).
 *
 * Warm-up: a tenth of the count (at least one window), untimed, drained before the clock starts.
 * Prints {"system":"weft","metric":...,"value":...} lines on stdout. */
#include "bench_common.h"
#include "bench_ranks.h"

#include <unistd.h>

#include <weft/weft.h>

#define SHUTDOWN_TIMEOUT_MS   60000
#define RENDEZVOUS_TIMEOUT_MS 30000
#define CALL_TIMEOUT_MS       30000
#define MAX_WORLD             3

typedef enum {
    MODE_LATENCY,
    MODE_FORK,
} bench_rref_mode_t;

typedef struct {
    bench_rref_mode_t mode;
    int world;
    bench_args_t b; /* size, count, window, warmup (for the JSON line) */
} args_t;

static int my_rank = -1;

static void fail(const char *what, weft_status_t s, const char *detail)
{
    fprintf(stderr, "bench_rref[rank %d]: %s: %s (%s)\n", my_rank, what, weft_strerror(s),
            detail != NULL ? detail : "");
    exit(1);
}

static void check(weft_status_t s, const char *what)
{
    if (s != WEFT_OK) {
        fail(what, s, weft_last_error());
    }
}

/* ------------------------------------------------------------ functions */

static void echo_cb(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, weft_call_take_args(call));
}

/* Replies with a value holding the RRef of the arguments: a fork back to the caller. */
static void pass_back_cb(weft_call_t *call, void *arg)
{
    weft_rref_t *r = weft_value_rref(weft_call_args(call), 0);
    weft_value_t *res = NULL;
    weft_status_t s;

    (void)arg;
    if (r == NULL) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "pass_back wants an RRef");
        return;
    }
    s = weft_value_create(&res);
    if (s == WEFT_OK) {
        s = weft_value_add_rref(res, r);
    }
    if (s != WEFT_OK) {
        weft_value_free(res);
        weft_call_fail(call, s, "pass_back: %s", weft_last_error());
        return;
    }
    weft_call_reply(call, res);
}

static void rref_counts_cb(weft_call_t *call, void *arg)
{
    char *json = NULL;
    weft_value_t *res = NULL;
    weft_status_t s;

    (void)arg;
    s = weft_rref_debug_info(weft_call_agent(call), &json);
    if (s == WEFT_OK) {
        s = weft_value_create(&res);
    }
    if (s == WEFT_OK) {
        s = weft_value_set_string(res, json);
    }
    weft_free(json);
    if (s != WEFT_OK) {
        weft_value_free(res);
        weft_call_fail(call, s, "rref_counts: %s", weft_last_error());
        return;
    }
    weft_call_reply(call, res);
}

/* --------------------------------------------------------------- rank 0 */

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

/* One remote() + to_here() of the echo of @p args; returns its duration in ns. */
static uint64_t remote_to_here(weft_agent_t *a, const weft_value_t *args, size_t size)
{
    weft_rref_t *r = NULL;
    weft_value_t *v = NULL;
    uint64_t t0 = bench_now_ns();
    check(weft_rref_remote(a, 1, "echo", args, CALL_TIMEOUT_MS, &r), "weft_rref_remote(echo)");
    check(weft_rref_to_here(r, CALL_TIMEOUT_MS, &v), "weft_rref_to_here");
    uint64_t dt = bench_now_ns() - t0;
    weft_tensor_t *t = weft_value_tensor(v, 0);
    if (t == NULL || weft_tensor_nbytes(t) != size) {
        fail("to_here", WEFT_ERR_PROTOCOL, "the value is not the tensor sent");
    }
    weft_value_free(v);
    weft_rref_release(r);
    return dt;
}

/* The count @p key of rank @p rank's weft_rref_debug_info. */
static long remote_count(weft_agent_t *a, int rank, const char *key)
{
    weft_value_t *res = NULL;
    char buf[512];
    char pat[64];
    size_t len = 0;
    long n = -1;

    check(weft_rpc_sync(a, rank, "rref_counts", NULL, CALL_TIMEOUT_MS, &res), "rref_counts");
    const char *p = weft_value_payload(res, &len);
    if (p != NULL && len < sizeof(buf)) {
        memcpy(buf, p, len);
        buf[len] = '\0';
        snprintf(pat, sizeof(pat), "\"%s\":", key);
        const char *at = strstr(buf, pat);
        if (at != NULL) {
            n = strtol(at + strlen(pat), NULL, 10);
        }
    }
    weft_value_free(res);
    if (n < 0) {
        fail("rref_counts", WEFT_ERR_PROTOCOL, key);
    }
    return n;
}

/* Waits until rank 1 owns no reference (every one created so far is released everywhere). */
static void wait_owner_settled(weft_agent_t *a)
{
    uint64_t deadline = bench_now_ns() + (uint64_t)CALL_TIMEOUT_MS * 1000000u;
    while (remote_count(a, 1, "owners") != 0) {
        if (bench_now_ns() > deadline) {
            fail("waiting for rank 1's references to go", WEFT_ERR_TIMEOUT, NULL);
        }
        usleep(50);
    }
}

typedef struct {
    weft_future_t *f;
    weft_rref_id_t id;
} op_t;

static void finish_op(op_t *op)
{
    weft_status_t s = weft_future_wait(op->f, CALL_TIMEOUT_MS);
    if (s != WEFT_OK) {
        fail("pass_back", s, weft_future_error(op->f));
    }
    weft_rref_t *back = weft_value_rref(weft_future_value(op->f), 0);
    if (back == NULL) {
        fail("pass_back", WEFT_ERR_PROTOCOL, "no RRef in the result");
    }
    weft_rref_id_t id = weft_rref_id(back);
    if (id.worker != op->id.worker || id.local != op->id.local || weft_rref_owner(back) != 1) {
        fail("pass_back", WEFT_ERR_PROTOCOL, "another RRef came back");
    }
    weft_future_release(op->f); /* drops the fork that came back */
    op->f = NULL;
}

/* @p n operations (create on 1, fork to 2, fork back), @p window in flight. */
static void fork_ops(weft_agent_t *a, const weft_value_t *val, op_t *ring, size_t window, size_t n)
{
    size_t head = 0;
    size_t inflight = 0;
    for (size_t i = 0; i < n; i++) {
        if (inflight == window) {
            finish_op(&ring[head]);
            head = (head + 1) % window;
            inflight--;
        }
        op_t *op = &ring[(head + inflight) % window];
        weft_rref_t *r = NULL;
        weft_value_t *args = NULL;
        check(weft_rref_remote(a, 1, "echo", val, CALL_TIMEOUT_MS, &r), "weft_rref_remote(echo)");
        op->id = weft_rref_id(r);
        check(weft_value_create(&args), "weft_value_create");
        check(weft_value_add_rref(args, r), "weft_value_add_rref");
        check(weft_rpc_async(a, 2, "pass_back", args, CALL_TIMEOUT_MS, &op->f), "pass_back");
        weft_value_free(args);
        weft_rref_release(r); /* released while its fork to rank 2 may be unconfirmed */
        inflight++;
    }
    while (inflight > 0) {
        finish_op(&ring[head]);
        head = (head + 1) % window;
        inflight--;
    }
}

static void measure(weft_agent_t *a, const args_t *g)
{
    const bench_args_t *b = &g->b;
    weft_value_t *val = make_args(b->size);
    if (g->mode == MODE_LATENCY) {
        uint64_t *rtt = calloc(b->count, sizeof(*rtt));
        if (rtt == NULL) {
            fail("calloc", WEFT_ERR_NO_MEMORY, NULL);
        }
        for (size_t i = 0; i < b->warmup + b->count; i++) {
            uint64_t dt = remote_to_here(a, val, b->size);
            if (i >= b->warmup) {
                rtt[i - b->warmup] = dt;
            }
        }
        char label[32];
        char metric[64];
        bench_size_label(b->size, label, sizeof(label));
        snprintf(metric, sizeof(metric), "remote_to_here_p50_%s", label);
        bench_print("weft", b, metric, (double)bench_percentile(rtt, b->count, 50) / 1e3, "us");
        snprintf(metric, sizeof(metric), "remote_to_here_p99_%s", label);
        bench_print("weft", b, metric, (double)bench_percentile(rtt, b->count, 99) / 1e3, "us");
        free(rtt);
    } else {
        op_t *ring = calloc(b->window, sizeof(*ring));
        if (ring == NULL) {
            fail("calloc", WEFT_ERR_NO_MEMORY, NULL);
        }
        fork_ops(a, val, ring, b->window, b->warmup);
        wait_owner_settled(a);
        uint64_t t0 = bench_now_ns();
        fork_ops(a, val, ring, b->window, b->count);
        wait_owner_settled(a);
        uint64_t elapsed = bench_now_ns() - t0;
        free(ring);
        bench_print("weft", b, "fork_throughput", 2.0 * (double)b->count * 1e9 / (double)elapsed,
                    "forks/s");
        bench_print("weft", b, "fork_ops_throughput", (double)b->count * 1e9 / (double)elapsed,
                    "ops/s");
    }
    weft_value_free(val);
}

/* ---------------------------------------------------------------- ranks */

static weft_agent_t *start(int rank, int world, int port)
{
    weft_agent_opts_t o;
    weft_agent_t *a = NULL;
    my_rank = rank;
    weft_agent_opts_init(&o);
    o.rank = rank;
    o.world_size = world;
    o.master_addr = "127.0.0.1";
    o.master_port = port;
    o.rendezvous_timeout_ms = RENDEZVOUS_TIMEOUT_MS;
    check(weft_agent_create(&o, &a), "weft_agent_create");
    check(weft_rref_init(a), "weft_rref_init"); /* every rank may own, receive or use RRefs */
    check(weft_rpc_register(a, "echo", echo_cb, NULL), "register echo");
    check(weft_rpc_register(a, "pass_back", pass_back_cb, NULL), "register pass_back");
    check(weft_rpc_register(a, "rref_counts", rref_counts_cb, NULL), "register rref_counts");
    return a;
}

static void stop(weft_agent_t *a)
{
    weft_status_t s = weft_agent_shutdown(a, SHUTDOWN_TIMEOUT_MS);
    weft_agent_free(a);
    check(s, "weft_agent_shutdown");
}

static int rank0_main(const args_t *g, int port_fd, int done_fd);
static int rank_main(const args_t *g, int rank, int port, int done_fd);

static int rank0_cb(void *arg, int port_fd, int done_fd)
{
    return rank0_main(arg, port_fd, done_fd);
}

static int rank_cb(void *arg, int rank, int port, int done_fd)
{
    return rank_main(arg, rank, port, done_fd);
}

static int rank0_main(const args_t *g, int port_fd, int done_fd)
{
    weft_agent_t *a = start(0, g->world, 0);
    if (bench_ranks_port(port_fd, weft_agent_port(a)) != 0) {
        fail("write port", WEFT_ERR_IO, NULL);
    }
    check(weft_agent_join(a), "weft_agent_join");
    measure(a, g);
    close(done_fd); /* EOF: the others may shut down */
    stop(a);
    return 0;
}

static int rank_main(const args_t *g, int rank, int port, int done_fd)
{
    weft_agent_t *a = start(rank, g->world, port);
    check(weft_agent_join(a), "weft_agent_join");
    bench_ranks_wait_done(done_fd);
    stop(a);
    return 0;
}

static int parse(int argc, char **argv, args_t *g)
{
    memset(g, 0, sizeof(*g));
    if (argc == 4 && strcmp(argv[1], "latency") == 0) {
        g->mode = MODE_LATENCY;
        g->world = 2;
        g->b.mode = BENCH_PINGPONG;
        g->b.size = bench_parse_size(argv[2]);
        g->b.count = bench_parse_size(argv[3]);
        g->b.window = 1;
    } else if ((argc == 3 || argc == 4) && strcmp(argv[1], "fork") == 0) {
        g->mode = MODE_FORK;
        g->world = 3;
        g->b.mode = BENCH_ASYNC;
        g->b.size = BENCH_DEFAULT_SMALL;
        g->b.count = bench_parse_size(argv[2]);
        g->b.window = argc == 4 ? bench_parse_size(argv[3]) : 16;
    } else {
        goto err_usage;
    }
    if (g->b.size == 0 || g->b.count == 0 || g->b.window == 0 || g->b.window > 4096) {
        goto err_usage;
    }
    g->b.warmup = bench_warmup(&g->b);
    return 0;

err_usage:
    fprintf(stderr,
            "usage: %s latency SIZE ITERS\n"
            "       %s fork N [INFLIGHT=16]\n",
            argv[0], argv[0]);
    return -1;
}

int main(int argc, char **argv)
{
    args_t g;
    if (parse(argc, argv, &g) != 0) {
        return 2;
    }
    return bench_ranks_run("bench_rref", g.world, rank0_cb, rank_cb, &g, -1);
}
