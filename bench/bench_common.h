/* Shared by the RPC benchmark programs (bench_rpc, baseline_tcp, baseline_grpc): argument
 * parsing, the one definition of warm-up lengths, percentiles and the JSON result line. Every
 * system measures the same three modes so that bench/run_rpc.py can compare them:
 *
 *   pingpong SIZE ITERS          one message of SIZE bytes echoed back, one at a time;
 *                                prints latency_p50_<SIZE> and latency_p99_<SIZE> in us.
 *   stream SIZE COUNT [WINDOW]   COUNT messages of SIZE bytes one way, at most WINDOW sent
 *                                and not yet acknowledged by a small reply; prints
 *                                bandwidth_<SIZE> in GB/s (1e9 B/s).
 *   async N [INFLIGHT [SIZE]]    N echoes of SIZE bytes (default 64) with INFLIGHT
 *                                (default 64) outstanding; prints async_throughput in calls/s.
 *
 * Each mode first runs an untimed warm-up (bench_warmup) and waits for it to drain. */
#ifndef WEFT_BENCH_COMMON_H
#define WEFT_BENCH_COMMON_H

#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BENCH_DEFAULT_WINDOW   4
#define BENCH_DEFAULT_INFLIGHT 64
#define BENCH_DEFAULT_SMALL    64

typedef enum {
    BENCH_PINGPONG = 0,
    BENCH_STREAM = 1,
    BENCH_ASYNC = 2,
} bench_mode_t;

typedef struct {
    bench_mode_t mode;
    size_t size;   /**< payload bytes of one message */
    size_t count;  /**< timed messages (pingpong: ITERS, async: N) */
    size_t window; /**< messages outstanding at most (pingpong: 1) */
    size_t warmup; /**< untimed messages before the timed ones */
} bench_args_t;

static inline uint64_t bench_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* "64", "4096", "16M", "16MiB", "1G": binary suffixes. Returns 0 on a bad number. */
static inline size_t bench_parse_size(const char *s)
{
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || end == s) {
        return 0;
    }
    switch (*end) {
    case 'k':
    case 'K':
        v <<= 10;
        break;
    case 'm':
    case 'M':
        v <<= 20;
        break;
    case 'g':
    case 'G':
        v <<= 30;
        break;
    default:
        break;
    }
    return (size_t)v;
}

/* The same warm-up for every system: a tenth of the timed messages, at least one window. */
static inline size_t bench_warmup(const bench_args_t *b)
{
    size_t w = b->mode == BENCH_STREAM ? b->count / 16 : b->count / 10;
    if (w < b->window) {
        w = b->window;
    }
    return w < 1 ? 1 : w;
}

static inline void bench_usage(const char *prog)
{
    fprintf(stderr,
            "usage: %s pingpong SIZE ITERS\n"
            "       %s stream SIZE COUNT [WINDOW=%d]\n"
            "       %s async N [INFLIGHT=%d [SIZE=%d]]\n"
            "SIZE takes K/M/G (binary) suffixes.\n",
            prog, prog, BENCH_DEFAULT_WINDOW, prog, BENCH_DEFAULT_INFLIGHT, BENCH_DEFAULT_SMALL);
}

/* Parses argv[1..]; returns 0 on success, prints usage and returns -1 otherwise. */
static inline int bench_parse_args(int argc, char **argv, bench_args_t *b)
{
    memset(b, 0, sizeof(*b));
    if (argc < 3) {
        goto err_usage;
    }
    if (strcmp(argv[1], "pingpong") == 0 && argc == 4) {
        b->mode = BENCH_PINGPONG;
        b->size = bench_parse_size(argv[2]);
        b->count = bench_parse_size(argv[3]);
        b->window = 1;
    } else if (strcmp(argv[1], "stream") == 0 && (argc == 4 || argc == 5)) {
        b->mode = BENCH_STREAM;
        b->size = bench_parse_size(argv[2]);
        b->count = bench_parse_size(argv[3]);
        b->window = argc == 5 ? bench_parse_size(argv[4]) : BENCH_DEFAULT_WINDOW;
    } else if (strcmp(argv[1], "async") == 0 && argc >= 3 && argc <= 5) {
        b->mode = BENCH_ASYNC;
        b->count = bench_parse_size(argv[2]);
        b->window = argc >= 4 ? bench_parse_size(argv[3]) : BENCH_DEFAULT_INFLIGHT;
        b->size = argc == 5 ? bench_parse_size(argv[4]) : BENCH_DEFAULT_SMALL;
    } else {
        goto err_usage;
    }
    if (b->size == 0 || b->count == 0 || b->window == 0 || b->window > 4096) {
        goto err_usage;
    }
    b->warmup = bench_warmup(b);
    return 0;

err_usage:
    bench_usage(argv[0]);
    return -1;
}

/* "64B", "4KiB", "16MiB", "1GiB" (exact multiples only). */
static inline const char *bench_size_label(size_t size, char *buf, size_t len)
{
    if (size >= (1u << 30) && size % (1u << 30) == 0) {
        snprintf(buf, len, "%zuGiB", size >> 30);
    } else if (size >= (1u << 20) && size % (1u << 20) == 0) {
        snprintf(buf, len, "%zuMiB", size >> 20);
    } else if (size >= 1024 && size % 1024 == 0) {
        snprintf(buf, len, "%zuKiB", size >> 10);
    } else {
        snprintf(buf, len, "%zuB", size);
    }
    return buf;
}

static inline int bench_cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a;
    uint64_t y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentile of @p n samples (sorts them in place). */
static inline uint64_t bench_percentile(uint64_t *v, size_t n, double p)
{
    qsort(v, n, sizeof(*v), bench_cmp_u64);
    size_t k = (size_t)(p / 100.0 * (double)n + 0.999999);
    if (k < 1) {
        k = 1;
    }
    if (k > n) {
        k = n;
    }
    return v[k - 1];
}

static inline void bench_print(const char *system, const bench_args_t *b, const char *metric,
                               double value, const char *unit)
{
    printf("{\"system\":\"%s\",\"metric\":\"%s\",\"value\":%.6g,\"unit\":\"%s\","
           "\"size\":%zu,\"count\":%zu,\"window\":%zu,\"warmup\":%zu}\n",
           system, metric, value, unit, b->size, b->count, b->window, b->warmup);
    fflush(stdout);
}

/* Prints the result lines of a finished run. @p rtt_ns: pingpong's count round trips (sorted
 * here); @p elapsed_ns: the timed part of stream and async. */
static inline void bench_report(const char *system, const bench_args_t *b, uint64_t *rtt_ns,
                                uint64_t elapsed_ns)
{
    char label[32];
    char metric[64];
    bench_size_label(b->size, label, sizeof(label));
    switch (b->mode) {
    case BENCH_PINGPONG:
        snprintf(metric, sizeof(metric), "latency_p50_%s", label);
        bench_print(system, b, metric, (double)bench_percentile(rtt_ns, b->count, 50) / 1e3, "us");
        snprintf(metric, sizeof(metric), "latency_p99_%s", label);
        bench_print(system, b, metric, (double)bench_percentile(rtt_ns, b->count, 99) / 1e3, "us");
        break;
    case BENCH_STREAM:
        snprintf(metric, sizeof(metric), "bandwidth_%s", label);
        bench_print(system, b, metric, (double)b->size * (double)b->count / (double)elapsed_ns,
                    "GB/s");
        break;
    case BENCH_ASYNC:
        bench_print(system, b, "async_throughput", (double)b->count * 1e9 / (double)elapsed_ns,
                    "calls/s");
        break;
    }
}

#endif
