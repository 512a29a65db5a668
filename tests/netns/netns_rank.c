/*
 * Rank program of tests/netns: one rank of a job whose hosts are network namespaces, each with a
 * PID namespace of its own, started by one weftrun --nnodes per host (the rank variables come
 * from it; tests/netns/netns_test.py sets the hosts up).
 *
 *   netns_rank job HOST0 HOST1
 *   netns_rank partition HOST0 HOST1 DIR
 *
 * HOSTk is the address of host k's interface; ranks r / WEFT_LOCAL_WORLD_SIZE run on host k.
 *
 * job: joins; checks that every rank advertises its host's address; calls every other rank;
 * echoes ECHO_BYTES with its counterpart on the other host and finds that call's direct
 * connection in /proc/net/tcp, from this host's address to the counterpart's direct listener;
 * all_reduces WORLD_FLOATS over the world, which must be exact and go by the ring with no
 * cross-memory read (the hosts differ); all_reduces HOST_FLOATS within its host's group, which
 * must go by cross-memory reads where this process can read its own memory (a control: the
 * counter does see reads where they can happen); shuts down. Prints
 * "NETNS OK rank R checksum C" (C: FNV-1a 64 of the world all_reduce's result, the same on
 * every rank and every run) and exits 0, or says why and exits 1.
 *
 * partition: joins and warms every path up as job does (calls, the direct connection, an
 * all_reduce), creates DIR/ready.R, prints "READY" and waits for DIR/cut (the test cuts the
 * link between the hosts, then creates it). Then it calls its counterpart on the other host
 * and all_reduces over the world, both with a deadline of CUT_TIMEOUT_MS, far beyond the peer
 * timeout the test sets: both must fail with WEFT_ERR_PEER_LOST (the lost peer is found, not
 * waited out). A call to the other rank of its own host must still succeed. Prints
 * "PARTITION OK rank R ..." and exits 0 whatever its shutdown returns (rank 0 is lost to the
 * other host's ranks); exits 1 saying why otherwise.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <sys/uio.h>

#include <weft/weft.h>

#include "../common/host_rank.h"

/* White-box counters: which all_reduce algorithm ran, and cross-memory reads. */
#include "../../collectives/internal.h"

#define ECHO_BYTES     (512u << 10) /* over 64 KiB: a direct connection */
#define WORLD_FLOATS   (256u << 10) /* 1 MiB: the ring with 4 members */
#define HOST_FLOATS    (1u << 20)   /* 4 MiB: cross-memory reads with 2 members, where possible */
#define TIMEOUT_MS     30000
#define CUT_TIMEOUT_MS 30000
#define READY_WAIT_MS  40000

static int rank = -1;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "netns_rank %d: %s:%d: %s: ", rank, __FILE__, __LINE__, #cond);        \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

typedef struct {
    weft_agent_t *a;
    int world, local;     /* ranks in all, ranks per host */
    const char *hosts[2]; /* each host's address */
    int peer;             /* the counterpart on the other host */
    weft_pg_t *pg;        /* the world */
} job_t;

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Whether this network namespace has an established TCP connection from @p local_host to
 * @p address ("a.b.c.d:port"). */
static bool connected(const char *local_host, const char *address)
{
    char host[64], line[512];
    struct in_addr want, mine;
    const char *colon = strrchr(address, ':');
    bool found = false;

    if (colon == NULL || (size_t)(colon - address) >= sizeof(host)) {
        return false;
    }
    memcpy(host, address, (size_t)(colon - address));
    host[colon - address] = '\0';
    unsigned port = (unsigned)atoi(colon + 1);
    if (inet_pton(AF_INET, host, &want) != 1 || inet_pton(AF_INET, local_host, &mine) != 1) {
        return false;
    }
    FILE *f = fopen("/proc/net/tcp", "r");
    if (f == NULL) {
        return false;
    }
    while (!found && fgets(line, sizeof(line), f) != NULL) {
        unsigned loc_addr, rem_addr, rem_port, state;
        /* "  sl  local_address rem_address   st ...": addresses as hex, in network order. */
        if (sscanf(line, " %*u: %x:%*x %x:%x %x", &loc_addr, &rem_addr, &rem_port, &state) == 4) {
            found = loc_addr == mine.s_addr && rem_addr == want.s_addr && rem_port == port &&
                    state == 1 /* ESTABLISHED */;
        }
    }
    fclose(f);
    return found;
}

/* Whether process_vm_readv works on this process's own memory (else no rank here can read
 * another: seccomp, or the system call missing). */
static bool cma_possible(void)
{
    uint64_t src = 0x5745465443u, dst = 0;
    struct iovec l = {&dst, sizeof(dst)}, r = {&src, sizeof(src)};
    return process_vm_readv(getpid(), &l, 1, &r, 1, 0) == (ssize_t)sizeof(dst) && dst == src;
}

static uint64_t fnv1a64(const void *p, size_t n)
{
    const uint8_t *b = p;
    uint64_t h = 14695981039346656037ull;
    for (size_t i = 0; i < n; i++) {
        h = (h ^ b[i]) * 1099511628211ull;
    }
    return h;
}

static int check_addresses(const job_t *j)
{
    for (int r = 0; r < j->world; r++) {
        const char *addr = weft_agent_worker_address(j->a, r);
        const char *direct = weft_agent_worker_direct_address(j->a, r);
        CHECK(at_host(addr, j->hosts[r / j->local]) && at_host(direct, j->hosts[r / j->local]),
              "rank %d advertises %s (direct %s), not host %d's address %s", r, addr, direct,
              r / j->local, j->hosts[r / j->local]);
    }
    return 0;
}

/* whoami on rank @p r: WEFT_OK with its name checked, or the call's status. */
static weft_status_t whoami(const job_t *j, int r, int64_t timeout_ms)
{
    weft_value_t *res = NULL;
    char want[32];
    size_t len = 0;

    weft_status_t st = weft_rpc_sync(j->a, r, "whoami", NULL, timeout_ms, &res);
    if (st != WEFT_OK) {
        return st;
    }
    const char *got = weft_value_payload(res, &len);
    snprintf(want, sizeof(want), "worker%d", r);
    st = len == strlen(want) && memcmp(got, want, len) == 0 ? WEFT_OK : WEFT_ERR_MISMATCH;
    weft_value_free(res);
    return st;
}

static int call_everyone(const job_t *j)
{
    for (int r = 0; r < j->world; r++) {
        if (r != rank) {
            weft_status_t st = whoami(j, r, TIMEOUT_MS);
            CHECK(st == WEFT_OK, "whoami on rank %d: %s: %s", r, weft_strerror(st),
                  weft_last_error());
        }
    }
    return 0;
}

/* Echoes ECHO_BYTES with the counterpart on the other host, over a direct connection from this
 * host's interface. */
static int echo_big(const job_t *j)
{
    int64_t n = ECHO_BYTES;
    weft_tensor_t *t;
    weft_value_t *args, *res = NULL;

    CHECK(weft_tensor_empty(WEFT_U8, 1, &n, &t) == WEFT_OK, "tensor");
    uint8_t *p = weft_tensor_data(t);
    for (int64_t i = 0; i < n; i++) {
        p[i] = (uint8_t)(i * 131 + rank * 7 + (i >> 12));
    }
    CHECK(weft_value_create(&args) == WEFT_OK, "value");
    CHECK(weft_value_add_tensor(args, t) == WEFT_OK, "add");
    weft_status_t st = weft_rpc_sync(j->a, j->peer, "echo", args, TIMEOUT_MS, &res);
    CHECK(st == WEFT_OK, "echo of %u bytes with rank %d: %s: %s", ECHO_BYTES, j->peer,
          weft_strerror(st), weft_last_error());
    CHECK(weft_value_num_tensors(res) == 1 && weft_tensor_equal(weft_value_tensor(res, 0), t),
          "the %u bytes came back different", ECHO_BYTES);
    weft_value_free(res);
    weft_value_free(args);
    weft_tensor_release(t);
    const char *direct = weft_agent_worker_direct_address(j->a, j->peer);
    const char *mine = j->hosts[rank / j->local];
    CHECK(connected(mine, direct), "no connection from %s to rank %d's direct listener %s", mine,
          j->peer, direct);
    printf("echo of %u KiB with rank %d: direct connection %s -> %s\n", ECHO_BYTES >> 10, j->peer,
           mine, direct);
    return 0;
}

/* all_reduce SUM of @p count f32 over @p pg, checked exactly; fills @p sum_p with the result's
 * FNV-1a 64 when not NULL. */
static int reduce_exact(weft_pg_t *pg, size_t count, uint64_t *sum_p)
{
    int64_t n = (int64_t)count;
    weft_tensor_t *t;
    int size = weft_pg_size(pg), me = weft_pg_rank(pg);

    CHECK(weft_tensor_empty(WEFT_F32, 1, &n, &t) == WEFT_OK, "tensor");
    float *p = weft_tensor_data(t);
    for (int64_t i = 0; i < n; i++) {
        p[i] = (float)((weft_pg_world_rank(pg, me) + 1) * (int)(i % 7 + 1));
    }
    weft_status_t st = weft_coll_all_reduce(pg, t, WEFT_SUM, NULL);
    CHECK(st == WEFT_OK, "all_reduce: %s: %s", weft_strerror(st), weft_last_error());
    int ranks_sum = 0;
    for (int r = 0; r < size; r++) {
        ranks_sum += weft_pg_world_rank(pg, r) + 1;
    }
    for (int64_t i = 0; i < n; i++) {
        float want = (float)(ranks_sum * (int)(i % 7 + 1));
        CHECK(p[i] == want, "element %" PRId64 ": %g, want %g", i, (double)p[i], (double)want);
    }
    if (sum_p != NULL) {
        *sum_p = fnv1a64(p, weft_tensor_nbytes(t));
    }
    weft_tensor_release(t);
    return 0;
}

/* The world's all_reduce: by the ring, with no cross-memory read. */
static int reduce_world(const job_t *j, uint64_t *sum_p)
{
    long ring = coll__algo_runs(OP_ALL_REDUCE, "ring"), cma = coll__cma_ops();
    if (reduce_exact(j->pg, WORLD_FLOATS, sum_p) != 0) {
        return 1;
    }
    long ring_runs = coll__algo_runs(OP_ALL_REDUCE, "ring") - ring;
    long cma_runs = coll__cma_ops() - cma;
    CHECK(ring_runs == 1 && cma_runs == 0,
          "across the hosts: %ld runs of the ring, %ld cross-memory operations", ring_runs,
          cma_runs);
    printf("world all_reduce of %u KiB: the ring, 0 cross-memory operations\n",
           (unsigned)(WORLD_FLOATS * 4 >> 10));
    return 0;
}

/* The host group's all_reduce: cross-memory reads where they are possible. Every rank makes both
 * hosts' groups, in the same order. */
static int reduce_host(const job_t *j)
{
    weft_pg_t *groups[2] = {NULL, NULL};
    int ranks[2][64];

    CHECK(j->local <= 64, "%d ranks per host", j->local);
    for (int h = 0; h < 2; h++) {
        for (int i = 0; i < j->local; i++) {
            ranks[h][i] = h * j->local + i;
        }
        CHECK(weft_pg_new(j->a, ranks[h], j->local, &groups[h]) == WEFT_OK, "pg_new: %s",
              weft_last_error());
    }
    weft_pg_t *mine = groups[rank / j->local];
    bool possible = cma_possible();
    long cma = coll__cma_ops();
    int rc = reduce_exact(mine, HOST_FLOATS, NULL);
    long cma_runs = coll__cma_ops() - cma;
    weft_pg_free(groups[0]);
    weft_pg_free(groups[1]);
    if (rc != 0) {
        return 1;
    }
    if (possible) {
        CHECK(cma_runs == 1, "within the host: %ld cross-memory operations, want 1", cma_runs);
    }
    printf("host all_reduce of %u KiB: %ld cross-memory operations%s\n",
           (unsigned)(HOST_FLOATS * 4 >> 10), cma_runs,
           possible ? "" : " (process_vm_readv refused here)");
    return 0;
}

static int run_job(job_t *j)
{
    uint64_t sum = 0;

    if (check_addresses(j) != 0 || call_everyone(j) != 0 || echo_big(j) != 0 ||
        reduce_world(j, &sum) != 0 || (j->local > 1 && reduce_host(j) != 0)) {
        return 1;
    }
    printf("NETNS OK rank %d checksum %016" PRIx64 "\n", rank, sum);
    return 0;
}

/* Creates @p dir/@p name (empty). */
static int touch(const char *dir, const char *name)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    CHECK(fd >= 0, "create %s: %s", path, strerror(errno));
    close(fd);
    return 0;
}

static int run_partition(job_t *j, const char *dir)
{
    char name[32], cut[512];

    if (check_addresses(j) != 0 || call_everyone(j) != 0 || echo_big(j) != 0 ||
        reduce_world(j, NULL) != 0) {
        return 1;
    }
    weft_pg_set_timeout(j->pg, CUT_TIMEOUT_MS);
    snprintf(name, sizeof(name), "ready.%d", rank);
    if (touch(dir, name) != 0) {
        return 1;
    }
    printf("READY\n");
    fflush(stdout);
    snprintf(cut, sizeof(cut), "%s/cut", dir);
    int64_t until = now_ms() + READY_WAIT_MS;
    while (access(cut, F_OK) != 0) {
        CHECK(now_ms() < until, "%s did not come within %d ms", cut, READY_WAIT_MS);
        usleep(10000);
    }

    /* Both pending together, into a link that carries nothing any more. */
    int64_t t0 = now_ms();
    weft_future_t *call, *reduce;
    int64_t n = WORLD_FLOATS;
    weft_tensor_t *t;
    CHECK(weft_tensor_create(WEFT_F32, 1, &n, &t) == WEFT_OK, "tensor");
    weft_status_t st = weft_rpc_async(j->a, j->peer, "whoami", NULL, CUT_TIMEOUT_MS, &call);
    CHECK(st == WEFT_OK, "rpc_async: %s: %s", weft_strerror(st), weft_last_error());
    st = weft_coll_all_reduce(j->pg, t, WEFT_SUM, &reduce);
    CHECK(st == WEFT_OK, "all_reduce: %s: %s", weft_strerror(st), weft_last_error());
    /* Waits well past their own deadlines: they must end by themselves. */
    (void)weft_future_wait(call, CUT_TIMEOUT_MS + 10000);
    CHECK(weft_future_done(call), "the call never ended");
    int64_t call_ms = now_ms() - t0;
    (void)weft_future_wait(reduce, CUT_TIMEOUT_MS + 10000);
    CHECK(weft_future_done(reduce), "the all_reduce never ended");
    int64_t reduce_ms = now_ms() - t0;
    weft_status_t call_st = weft_future_status(call), reduce_st = weft_future_status(reduce);
    CHECK(call_st == WEFT_ERR_PEER_LOST, "the call to rank %d across the cut ended with %s: %s",
          j->peer, weft_status_name(call_st), weft_future_error(call));
    CHECK(reduce_st == WEFT_ERR_PEER_LOST, "the all_reduce across the cut ended with %s: %s",
          weft_status_name(reduce_st), weft_future_error(reduce));
    printf("call to rank %d: %s after %" PRId64 " ms: %s\n", j->peer, weft_status_name(call_st),
           call_ms, weft_future_error(call));
    printf("all_reduce: %s after %" PRId64 " ms: %s\n", weft_status_name(reduce_st), reduce_ms,
           weft_future_error(reduce));
    weft_future_release(call);
    weft_future_release(reduce);
    weft_tensor_release(t);

    /* This host still works. */
    if (j->local > 1) {
        int near = rank / j->local * j->local + (rank % j->local + 1) % j->local;
        st = whoami(j, near, TIMEOUT_MS);
        CHECK(st == WEFT_OK, "whoami on rank %d, same host, after the cut: %s: %s", near,
              weft_strerror(st), weft_last_error());
    }
    printf("PARTITION OK rank %d: PEER_LOST, this host's ranks still answer\n", rank);
    return 0;
}

int main(int argc, char **argv)
{
    job_t j = {0};
    bool partition = argc == 5 && strcmp(argv[1], "partition") == 0;

    rank = env_int("WEFT_RANK");
    if (!partition && !(argc == 4 && strcmp(argv[1], "job") == 0)) {
        fprintf(stderr, "usage: netns_rank job HOST0 HOST1 | partition HOST0 HOST1 DIR\n");
        return 2;
    }
    j.hosts[0] = argv[2];
    j.hosts[1] = argv[3];
    CHECK(weft_agent_create(NULL, &j.a) == WEFT_OK, "agent_create: %s", weft_last_error());
    CHECK(weft_rpc_register(j.a, "whoami", fn_whoami, NULL) == WEFT_OK, "register");
    CHECK(weft_rpc_register(j.a, "echo", fn_echo, NULL) == WEFT_OK, "register");
    weft_status_t st = weft_agent_join(j.a);
    CHECK(st == WEFT_OK, "join: %s: %s", weft_status_name(st), weft_last_error());
    j.world = weft_agent_world_size(j.a);
    j.local = env_int("WEFT_LOCAL_WORLD_SIZE");
    CHECK(j.local > 0 && j.world == 2 * j.local, "world %d, %d per host", j.world, j.local);
    j.peer = (rank + j.local) % j.world;
    CHECK(weft_pg_world(j.a, &j.pg) == WEFT_OK, "pg_world: %s", weft_last_error());

    int rc = partition ? run_partition(&j, argv[4]) : run_job(&j);
    weft_pg_free(j.pg);
    if (rc != 0) {
        /* No graceful shutdown: the others may never come to it (it would wait its timeout). */
        weft_agent_free(j.a);
        return 1;
    }
    char why[1024] = "";
    st = weft_agent_shutdown(j.a, partition ? 10000 : TIMEOUT_MS);
    if (st != WEFT_OK) {
        snprintf(why, sizeof(why), "%s", weft_last_error());
    }
    weft_agent_free(j.a);
    if (partition) {
        printf("shutdown: %s%s%s\n", weft_status_name(st), st != WEFT_OK ? ": " : "", why);
        return 0;
    }
    CHECK(st == WEFT_OK, "shutdown: %s: %s", weft_strerror(st), why);
    return 0;
}
