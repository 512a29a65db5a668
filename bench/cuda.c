/*
 * GPU benchmark (issue: CUDA gradient reduction), one JSON line per figure:
 *
 *   bench_cuda copies      64 MiB host<->device, pageable and pinned
 *   bench_cuda kernel      the sum kernel's effective bandwidth (2 reads + 1 write per element)
 *                          against a device-to-device copy (1 read + 1 write) in the same run
 *   bench_cuda all_reduce  world 2 (two processes sharing device 0, or devices 0 and 1 when there
 *                          are two) from 1 to 256 MiB of f32 sum: "ipc" (CUDA IPC, the default
 *                          between ranks of one host) and "staged" (WEFT_CUDA_IPC=0: chunks
 *                          through pinned host memory)
 *
 * Without a device it prints {"system":"weft_cuda","skipped":"<why>"} and exits 0. CUDA does
 * not survive fork(): every measurement runs in a fresh child. Times are medians of --iters
 * runs after 2 warm-up runs; all_reduce is timed on rank 0 between barriers.
 * The torch twin is bench/torch_gloo_cuda.py; bench/run_cuda.py runs both.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_common.h"
#include "bench_ranks.h"
#include <weft/collectives.h>
#include <weft/cuda.h>
#include <weft/weft.h>

static int iters = 10;

static void die(const char *what)
{
    fprintf(stderr, "bench_cuda: %s: %s\n", what, weft_last_error());
    exit(1);
}

#define CHECK_OK(call)                                                                             \
    do {                                                                                           \
        if ((call) != WEFT_OK) {                                                                   \
            die(#call);                                                                            \
        }                                                                                          \
    } while (0)

static int child(int (*fn)(void *), void *arg)
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        int rc = fn(arg);
        fflush(stdout);
        _exit(rc);
    }
    int st = 0;
    if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st)) {
        return 1;
    }
    return WEXITSTATUS(st);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median seconds of iters runs of fn(arg) after two warm-up runs. */
static double timed(void (*fn)(void *), void *arg)
{
    double t[256];
    int n = iters < 256 ? iters : 256;
    fn(arg);
    fn(arg);
    for (int i = 0; i < n; i++) {
        uint64_t t0 = bench_now_ns();
        fn(arg);
        t[i] = (double)(bench_now_ns() - t0) / 1e9;
    }
    qsort(t, (size_t)n, sizeof(t[0]), cmp_double);
    return t[n / 2];
}

typedef struct {
    weft_tensor_t *dst, *src, *other;
} pair_t;

static void copy_once(void *arg)
{
    pair_t *p = arg;
    CHECK_OK(weft_cuda_copy(p->dst, p->src));
}

static void sum_once(void *arg)
{
    pair_t *p = arg;
    CHECK_OK(weft_cuda_reduce_into(p->dst, p->src, WEFT_SUM));
}

static int probe(void *arg)
{
    (void)arg;
    int n = 0;
    if (weft_cuda_device_count(&n) != WEFT_OK) {
        printf("{\"system\":\"weft_cuda\",\"skipped\":\"%s\"}\n", weft_last_error());
        return 0;
    }
    return n > 100 ? 100 : n;
}

static int copies(void *arg)
{
    (void)arg;
    int64_t n = (64 << 20) / 4;
    weft_tensor_t *pageable = NULL, *pinned = NULL, *dev = NULL;
    CHECK_OK(weft_tensor_create(WEFT_F32, 1, &n, &pageable));
    CHECK_OK(weft_cuda_pinned_empty(WEFT_F32, 1, &n, &pinned));
    memset(weft_tensor_data(pinned), 0, (size_t)n * 4);
    CHECK_OK(weft_cuda_tensor_zeros(WEFT_F32, 1, &n, 0, &dev));
    struct {
        const char *memory, *dir;
        pair_t p;
    } cases[] = {
        {"pageable", "h2d", {dev, pageable, NULL}},
        {"pinned", "h2d", {dev, pinned, NULL}},
        {"pageable", "d2h", {pageable, dev, NULL}},
        {"pinned", "d2h", {pinned, dev, NULL}},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        double s = timed(copy_once, &cases[i].p);
        printf("{\"system\":\"weft_cuda\",\"bench\":\"copy\",\"memory\":\"%s\",\"dir\":\"%s\","
               "\"bytes\":%lld,\"time_us\":%.1f,\"gbps\":%.2f}\n",
               cases[i].memory, cases[i].dir, (long long)n * 4, s * 1e6, (double)n * 4 / s / 1e9);
    }
    weft_tensor_release(pageable);
    weft_tensor_release(pinned);
    weft_tensor_release(dev);
    return 0;
}

static int kernel(void *arg)
{
    (void)arg;
    int64_t n = (256 << 20) / 4;
    weft_tensor_t *a = NULL, *b = NULL;
    CHECK_OK(weft_cuda_tensor_zeros(WEFT_F32, 1, &n, 0, &a));
    CHECK_OK(weft_cuda_tensor_zeros(WEFT_F32, 1, &n, 0, &b));
    pair_t p = {a, b, NULL};
    double copy_s = timed(copy_once, &p);
    double sum_s = timed(sum_once, &p);
    double copy_gbps = 2.0 * (double)n * 4 / copy_s / 1e9;
    double sum_gbps = 3.0 * (double)n * 4 / sum_s / 1e9;
    printf("{\"system\":\"weft_cuda\",\"bench\":\"kernel\",\"bytes\":%lld,\"copy_us\":%.1f,"
           "\"copy_gbps\":%.1f,\"sum_us\":%.1f,\"sum_gbps\":%.1f,\"sum_over_copy\":%.3f}\n",
           (long long)n * 4, copy_s * 1e6, copy_gbps, sum_s * 1e6, sum_gbps, sum_gbps / copy_gbps);
    weft_tensor_release(a);
    weft_tensor_release(b);
    return 0;
}

/* ---- all_reduce, world 2 ----------------------------------------------------------------------
 */

static const size_t sizes[] = {1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20};
#define NSIZES (sizeof(sizes) / sizeof(sizes[0]))
static const char *mode = "ipc";
static int ndevices = 1;

static weft_agent_t *start(int rank, int port)
{
    weft_agent_opts_t o;
    weft_agent_t *a = NULL;
    weft_agent_opts_init(&o);
    o.rank = rank;
    o.world_size = 2;
    o.master_addr = "127.0.0.1";
    o.master_port = port;
    CHECK_OK(weft_agent_create(&o, &a));
    return a;
}

/* Every size, on every rank; rank 0 prints. */
static void sweep(weft_agent_t *a, int rank)
{
    weft_pg_t *pg = NULL;
    CHECK_OK(weft_cuda_init());
    CHECK_OK(weft_pg_world(a, &pg));
    weft_pg_set_timeout(pg, 600000);
    for (size_t i = 0; i < NSIZES; i++) {
        int64_t n = (int64_t)(sizes[i] / 4);
        weft_tensor_t *t = NULL;
        CHECK_OK(weft_cuda_tensor_zeros(WEFT_F32, 1, &n, rank % ndevices, &t));
        double v[256];
        int runs = iters < 256 ? iters : 256;
        for (int w = 0; w < 2; w++) {
            CHECK_OK(weft_coll_all_reduce(pg, t, WEFT_SUM, NULL));
        }
        for (int k = 0; k < runs; k++) {
            CHECK_OK(weft_coll_barrier(pg, NULL));
            uint64_t t0 = bench_now_ns();
            CHECK_OK(weft_coll_all_reduce(pg, t, WEFT_SUM, NULL));
            v[k] = (double)(bench_now_ns() - t0) / 1e3;
        }
        qsort(v, (size_t)runs, sizeof(v[0]), cmp_double);
        if (rank == 0) {
            weft_cuda_stats_t s;
            weft_cuda_stats(&s);
            double us = v[runs / 2];
            printf("{\"system\":\"weft_cuda_%s\",\"op\":\"all_reduce\",\"world\":2,"
                   "\"devices\":%d,\"bytes\":%zu,\"time_us\":%.1f,\"algbw\":%.3f,"
                   "\"ipc_ops\":%llu,\"staged_ops\":%llu}\n",
                   mode, ndevices, sizes[i], us, (double)sizes[i] / us / 1e3,
                   (unsigned long long)s.ipc_ops, (unsigned long long)s.staged_ops);
            fflush(stdout);
        }
        weft_tensor_release(t);
    }
    weft_pg_free(pg);
}

static int rank0_cb(void *arg, int port_fd, int done_fd)
{
    (void)arg;
    weft_agent_t *a = start(0, 0);
    if (bench_ranks_port(port_fd, weft_agent_port(a)) != 0) {
        die("port");
    }
    CHECK_OK(weft_agent_join(a));
    sweep(a, 0);
    close(done_fd);
    CHECK_OK(weft_agent_shutdown(a, 30000));
    weft_agent_free(a);
    return 0;
}

static int rank_cb(void *arg, int rank, int port, int done_fd)
{
    (void)arg;
    weft_agent_t *a = start(rank, port);
    CHECK_OK(weft_agent_join(a));
    sweep(a, rank);
    bench_ranks_wait_done(done_fd);
    CHECK_OK(weft_agent_shutdown(a, 30000));
    weft_agent_free(a);
    return 0;
}

int main(int argc, char **argv)
{
    const char *what = argc > 1 ? argv[1] : "all";
    if (argc > 2) {
        iters = atoi(argv[2]);
    }
    if (iters < 1) {
        fprintf(stderr, "usage: %s [all|copies|kernel|all_reduce] [ITERS]\n", argv[0]);
        return 2;
    }
    ndevices = child(probe, NULL);
    if (ndevices == 0) {
        return 0; /* the probe printed why */
    }
    ndevices = ndevices >= 2 ? 2 : 1;
    int bad = 0;
    if (strcmp(what, "all") == 0 || strcmp(what, "copies") == 0) {
        bad |= child(copies, NULL);
    }
    if (strcmp(what, "all") == 0 || strcmp(what, "kernel") == 0) {
        bad |= child(kernel, NULL);
    }
    if (strcmp(what, "all") == 0 || strcmp(what, "all_reduce") == 0) {
        const char *modes[] = {"ipc", "staged"};
        for (int m = 0; m < 2; m++) {
            mode = modes[m];
            setenv("WEFT_CUDA_IPC", m == 0 ? "1" : "0", 1);
            setenv("WEFT_CUDA_IPC_MIN_KB", "0", 1);
            bad |= bench_ranks_run("bench_cuda", 2, rank0_cb, rank_cb, NULL, -1);
        }
    }
    return bad;
}
