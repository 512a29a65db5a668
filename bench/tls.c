/* How long a world takes to be ready, with TLS and without (bench/run_tls.py).
 *
 *   bench_tls ready WORLD ROUNDS
 *
 * Each round starts a world of WORLD forked ranks on loopback twice, plaintext then TLS with
 * client certificates (the order alternating between rounds): rank 0 notes the time before it
 * creates its agent; every rank creates, joins (rendezvous at rank 0), then calls every other
 * rank once (opening the N(N-1) streams, each a TLS handshake) and tells rank 0. Rank 0 reports
 * the time its join returned ("join") and the time the last rank told it it had reached every
 * peer ("ready"), both from its start, in milliseconds:
 *   {"system":"weft_plain"|"weft_tls","metric":"join_w4"|"ready_w4","value":ms,"unit":"ms"} */
#include <errno.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <weft/weft.h>

#include "bench_ranks.h"
#include "bench_tls.h"

#define TIMEOUT_MS 60000

typedef struct {
    int world;
    bench_tls_t tls; /* dir "" for the plaintext run */
} run_t;

static _Atomic int g_arrived;

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void ping_cb(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, NULL);
}

static void arrived_cb(weft_call_t *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&g_arrived, 1);
    weft_call_reply(call, NULL);
}

static weft_agent_t *start(const run_t *r, int rank, int port)
{
    weft_agent_opts_t o;
    weft_agent_t *a = NULL;
    weft_agent_opts_init(&o);
    o.rank = rank;
    o.world_size = r->world;
    o.master_addr = "127.0.0.1";
    o.master_port = port;
    o.rendezvous_timeout_ms = TIMEOUT_MS;
    bench_tls_opts(&r->tls, &o, rank);
    weft_status_t st = weft_agent_create(&o, &a);
    if (st == WEFT_OK) {
        weft_rpc_register(a, "ping", ping_cb, NULL);
        weft_rpc_register(a, "arrived", arrived_cb, NULL);
    }
    if (st != WEFT_OK) {
        fprintf(stderr, "bench_tls: rank %d: create: %s\n", rank, weft_last_error());
        return NULL;
    }
    return a;
}

/* Calls every other rank once. */
static int reach_all(weft_agent_t *a, int rank, int world)
{
    for (int p = 1; p < world; p++) {
        int to = (rank + p) % world;
        weft_value_t *out = NULL;
        weft_status_t st = weft_rpc_sync(a, to, "ping", NULL, TIMEOUT_MS, &out);
        weft_value_free(out);
        if (st != WEFT_OK) {
            fprintf(stderr, "bench_tls: rank %d: ping %d: %s\n", rank, to, weft_last_error());
            return 1;
        }
    }
    return 0;
}

static int finish(weft_agent_t *a, int code)
{
    weft_status_t st = weft_agent_shutdown(a, TIMEOUT_MS);
    weft_agent_free(a);
    return code != 0 ? code : st != WEFT_OK;
}

static int rank0_main(void *arg, int port_fd, int done_fd)
{
    run_t *r = arg;
    int64_t t0 = now_ns();
    weft_agent_t *a = start(r, 0, 0);
    if (a == NULL || bench_ranks_port(port_fd, weft_agent_port(a)) != 0) {
        return 1;
    }
    if (weft_agent_join(a) != WEFT_OK) {
        fprintf(stderr, "bench_tls: rank 0: join: %s\n", weft_last_error());
        return finish(a, 1);
    }
    int64_t t_join = now_ns();
    if (reach_all(a, 0, r->world) != 0) {
        return finish(a, 1);
    }
    while (atomic_load(&g_arrived) < r->world - 1) {
        if (now_ns() - t0 > (int64_t)TIMEOUT_MS * 1000000) {
            fprintf(stderr, "bench_tls: only %d ranks arrived\n", atomic_load(&g_arrived));
            return finish(a, 1);
        }
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
    int64_t t_ready = now_ns();
    close(done_fd);
    const char *sys = r->tls.dir[0] != '\0' ? "weft_tls" : "weft_plain";
    printf("{\"system\":\"%s\",\"metric\":\"join_w%d\",\"value\":%.3f,\"unit\":\"ms\"}\n", sys,
           r->world, (double)(t_join - t0) / 1e6);
    printf("{\"system\":\"%s\",\"metric\":\"ready_w%d\",\"value\":%.3f,\"unit\":\"ms\"}\n", sys,
           r->world, (double)(t_ready - t0) / 1e6);
    fflush(stdout);
    return finish(a, 0);
}

static int rank_main(void *arg, int rank, int port, int done_fd)
{
    run_t *r = arg;
    weft_agent_t *a = start(r, rank, port);
    if (a == NULL) {
        return 1;
    }
    if (weft_agent_join(a) != WEFT_OK) {
        fprintf(stderr, "bench_tls: rank %d: join: %s\n", rank, weft_last_error());
        return finish(a, 1);
    }
    int code = reach_all(a, rank, r->world);
    if (code == 0) {
        weft_value_t *out = NULL;
        code = weft_rpc_sync(a, 0, "arrived", NULL, TIMEOUT_MS, &out) != WEFT_OK;
        weft_value_free(out);
    }
    bench_ranks_wait_done(done_fd);
    return finish(a, code);
}

int main(int argc, char **argv)
{
    if (argc != 4 || strcmp(argv[1], "ready") != 0) {
        fprintf(stderr, "usage: bench_tls ready WORLD ROUNDS\n");
        return 2;
    }
    int world = atoi(argv[2]), rounds = atoi(argv[3]);
    if (world < 2 || world > 64 || rounds < 1) {
        fprintf(stderr, "bench_tls: WORLD 2..64, ROUNDS >= 1\n");
        return 2;
    }
    int bad = 0;
    for (int i = 0; i < rounds && !bad; i++) {
        for (int k = 0; k < 2 && !bad; k++) {
            bool tls = (k == 0) == (i % 2 == 1);
            run_t r;
            memset(&r, 0, sizeof(r));
            r.world = world;
            if (tls && bench_tls_make(&r.tls, world) != 0) {
                return 1;
            }
            bad = bench_ranks_run("bench_tls", world, rank0_main, rank_main, &r, -1);
            bench_tls_remove(&r.tls);
        }
    }
    return bad;
}
