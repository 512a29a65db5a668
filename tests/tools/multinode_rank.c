/*
 * Rank program for tests/tools/test_multinode.c: one rank of a job whose nodes are network
 * namespaces joined by a veth pair, started by weftrun --nnodes (the rank variables come from it).
 *
 *   multinode_rank HOST0 HOST1
 *   multinode_rank --create
 *
 * HOSTk is the address of node k's interface. The rank joins (rendezvous), checks that every
 * rank advertises its node's address (agent and direct listener), calls every other rank
 * (RPC both ways between the nodes), echoes a 2 MiB tensor with its counterpart on the other
 * node and finds the direct connection to it in /proc/net/tcp, runs an all_reduce of 4 MiB that
 * must give exact sums by the ring (cross-memory reads are impossible across hosts), and shuts
 * down. It prints "MULTINODE OK rank R" and exits 0, or prints why and exits 1; a failed join
 * prints "JOIN FAILED <status>: <text>" and exits 3.
 *
 * With --create it only creates its agent from the environment and frees it: "CREATED", exit 0,
 * or "CREATE FAILED <status>: <text>", exit 4.
 */
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <arpa/inet.h>

#include <weft/weft.h>

#include "../common/host_rank.h"

/* White-box counters: which all_reduce algorithm ran, and cross-memory reads. */
#include "../../collectives/internal.h"

#define BIG_BYTES     (2u << 20)
#define REDUCE_FLOATS ((4u << 20) / 4)
#define TIMEOUT_MS    30000

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "multinode_rank %d: %s:%d: %s: ", rank, __FILE__, __LINE__, #cond);    \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

/* Whether this network namespace has an established TCP connection to @p address (an IPv4
 * "a.b.c.d:port"). */
static bool connected_to(const char *address)
{
    char host[64], line[512];
    struct in_addr want;
    const char *colon = strrchr(address, ':');
    bool found = false;

    if (colon == NULL || (size_t)(colon - address) >= sizeof(host)) {
        return false;
    }
    memcpy(host, address, (size_t)(colon - address));
    host[colon - address] = '\0';
    unsigned port = (unsigned)atoi(colon + 1);
    if (inet_pton(AF_INET, host, &want) != 1) {
        return false;
    }
    FILE *f = fopen("/proc/net/tcp", "r");
    if (f == NULL) {
        return false;
    }
    while (!found && fgets(line, sizeof(line), f) != NULL) {
        unsigned rem_addr, rem_port, state;
        /* "  sl  local_address rem_address   st ...": addresses as hex, in network order. */
        if (sscanf(line, " %*u: %*x:%*x %x:%x %x", &rem_addr, &rem_port, &state) == 3) {
            found = rem_addr == want.s_addr && rem_port == port && state == 1 /* ESTABLISHED */;
        }
    }
    fclose(f);
    return found;
}

/* Calls whoami on every other rank. */
static int call_everyone(weft_agent_t *a, int rank, int world)
{
    for (int r = 0; r < world; r++) {
        weft_value_t *res = NULL;
        char want[32];
        if (r == rank) {
            continue;
        }
        weft_status_t st = weft_rpc_sync(a, r, "whoami", NULL, TIMEOUT_MS, &res);
        CHECK(st == WEFT_OK, "whoami on rank %d: %s: %s", r, weft_strerror(st), weft_last_error());
        size_t len = 0;
        const char *got = weft_value_payload(res, &len);
        snprintf(want, sizeof(want), "worker%d", r);
        CHECK(len == strlen(want) && memcmp(got, want, len) == 0, "rank %d answered '%.*s'", r,
              (int)len, got);
        weft_value_free(res);
    }
    return 0;
}

/* Echoes 2 MiB with @p peer (on the other node): they take the direct connections. */
static int echo_big(weft_agent_t *a, int rank, int peer)
{
    int64_t n = BIG_BYTES;
    weft_tensor_t *t;
    weft_value_t *args, *res = NULL;

    CHECK(weft_tensor_empty(WEFT_U8, 1, &n, &t) == WEFT_OK, "tensor");
    uint8_t *p = weft_tensor_data(t);
    for (int64_t i = 0; i < n; i++) {
        p[i] = (uint8_t)(i * 131 + rank * 7 + (i >> 12));
    }
    CHECK(weft_value_create(&args) == WEFT_OK, "value");
    CHECK(weft_value_push_tensor(args, t) == WEFT_OK, "push");
    weft_status_t st = weft_rpc_sync(a, peer, "echo", args, TIMEOUT_MS, &res);
    CHECK(st == WEFT_OK, "echo of 2 MiB with rank %d: %s: %s", peer, weft_strerror(st),
          weft_last_error());
    CHECK(weft_value_num_tensors(res) == 1, "%zu tensors back", weft_value_num_tensors(res));
    weft_tensor_t *back = weft_value_tensor(res, 0);
    CHECK(weft_tensor_equal(back, t), "the 2 MiB came back different");
    weft_value_free(res);
    weft_value_free(args);
    const char *direct = weft_agent_worker_direct_address(a, peer);
    CHECK(connected_to(direct), "no connection to rank %d's direct listener %s", peer, direct);
    return 0;
}

/* all_reduce SUM of 4 MiB of f32 across the nodes: exact, by the ring. */
static int reduce_across(weft_agent_t *a, int rank, int world)
{
    int64_t n = REDUCE_FLOATS;
    weft_pg_t *pg;
    weft_tensor_t *t;

    CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world: %s", weft_last_error());
    CHECK(weft_tensor_empty(WEFT_F32, 1, &n, &t) == WEFT_OK, "tensor");
    float *p = weft_tensor_data(t);
    for (int64_t i = 0; i < n; i++) {
        p[i] = (float)((rank + 1) * (int)(i % 7 + 1));
    }
    long ring = coll__algo_runs(OP_ALL_REDUCE, "ring"), cma = coll__cma_ops();
    weft_status_t st = weft_coll_all_reduce(pg, t, WEFT_SUM, NULL);
    CHECK(st == WEFT_OK, "all_reduce: %s: %s", weft_strerror(st), weft_last_error());
    int ranks_sum = world * (world + 1) / 2;
    for (int64_t i = 0; i < n; i++) {
        float want = (float)(ranks_sum * (int)(i % 7 + 1));
        CHECK(p[i] == want, "element %" PRId64 ": %g, want %g", i, (double)p[i], (double)want);
    }
    CHECK(coll__algo_runs(OP_ALL_REDUCE, "ring") == ring + 1 && coll__cma_ops() == cma,
          "the ring did not run (ring runs %ld, cross-memory operations %ld)",
          coll__algo_runs(OP_ALL_REDUCE, "ring") - ring, coll__cma_ops() - cma);
    weft_tensor_release(t);
    weft_pg_free(pg);
    printf("all_reduce of %u MiB by the ring\n", (unsigned)(REDUCE_FLOATS * 4 >> 20));
    return 0;
}

static int run(weft_agent_t *a, int rank, const char *const hosts[2])
{
    int world = weft_agent_world_size(a), local = env_int("WEFT_LOCAL_WORLD_SIZE");

    CHECK(local > 0 && world == 2 * local, "world %d, %d per node", world, local);
    for (int r = 0; r < world; r++) {
        const char *addr = weft_agent_worker_address(a, r);
        const char *direct = weft_agent_worker_direct_address(a, r);
        CHECK(at_host(addr, hosts[r / local]) && at_host(direct, hosts[r / local]),
              "rank %d advertises %s (direct %s), not node %d's address %s", r, addr, direct,
              r / local, hosts[r / local]);
    }
    if (call_everyone(a, rank, world) != 0 || echo_big(a, rank, (rank + local) % world) != 0 ||
        reduce_across(a, rank, world) != 0) {
        return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    int rank = env_int("WEFT_RANK");
    weft_agent_t *a;

    if (argc == 2 && strcmp(argv[1], "--create") == 0) {
        weft_status_t st = weft_agent_create(NULL, &a);
        if (st != WEFT_OK) {
            printf("CREATE FAILED %s: %s\n", weft_status_name(st), weft_last_error());
            return 4;
        }
        weft_agent_free(a);
        printf("CREATED\n");
        return 0;
    }
    if (argc != 3) {
        fprintf(stderr, "usage: multinode_rank HOST0 HOST1 | --create\n");
        return 2;
    }
    const char *const hosts[2] = {argv[1], argv[2]};
    /* Every rank says how its join ended before weftrun, seeing the first rank fail, may stop
     * the others: SIGTERM waits until then (weftrun's SIGKILL comes 5 s later all the same). */
    sigset_t term;
    sigemptyset(&term);
    sigaddset(&term, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &term, NULL);
    CHECK(weft_agent_create(NULL, &a) == WEFT_OK, "agent_create: %s", weft_last_error());
    CHECK(weft_rpc_register(a, "whoami", fn_whoami, NULL) == WEFT_OK, "register");
    CHECK(weft_rpc_register(a, "echo", fn_echo, NULL) == WEFT_OK, "register");
    weft_status_t st = weft_agent_join(a);
    if (st != WEFT_OK) {
        printf("JOIN FAILED %s: %s\n", weft_status_name(st), weft_last_error());
        fflush(stdout);
        weft_agent_free(a);
        return 3;
    }
    pthread_sigmask(SIG_UNBLOCK, &term, NULL);
    int rc = run(a, rank, hosts);
    char why[1024] = "";
    st = weft_agent_shutdown(a, TIMEOUT_MS);
    if (st != WEFT_OK) {
        snprintf(why, sizeof(why), "%s", weft_last_error());
    }
    weft_agent_free(a);
    CHECK(rc == 0, "failed");
    CHECK(st == WEFT_OK, "shutdown: %s: %s", weft_strerror(st), why);
    const char *ca = getenv("WEFT_TLS_CA");
    if (ca != NULL && ca[0] != '\0') {
        printf("MULTINODE TLS rank %d\n", rank); /* its agent ran with TLS (the variables are set) */
    }
    printf("MULTINODE OK rank %d\n", rank);
    return 0;
}
