/* The agent: options and environment, the gRPC server and completion queue,
 * transport threads, peer loss, creation, join and teardown. */
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <grpc/grpc_security.h>
#include <grpc/support/time.h>

#include "internal.h"

#define container_of(p, type, member) ((type *)((char *)(p)-offsetof(type, member)))
#define SERVER_REQUESTS               8
#define POLL_MS                       20

/* ------------------------------------------------------------ options */

void weft_agent_opts_init(weft_agent_opts_t *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->rank = -1;
    opts->world_size = -1;
    opts->master_port = -1;
}

bool weft__address_loopback(const char *address)
{
    char host[300];
    const char *end;

    /* "host:port", "[v6]:port", or a bare host ("::1": colons but no port). */
    if (address[0] == '[') {
        address++;
        end = strchr(address, ']');
    } else {
        end = strchr(address, ':');
        if (end == NULL || strchr(end + 1, ':') != NULL) {
            end = address + strlen(address);
        }
    }
    if (end == NULL || (size_t)(end - address) >= sizeof(host)) {
        return false;
    }
    memcpy(host, address, (size_t)(end - address));
    host[end - address] = '\0';
    struct in_addr v4;
    struct in6_addr v6;
    if (inet_pton(AF_INET, host, &v4) == 1) {
        return (ntohl(v4.s_addr) >> 24) == 127;
    }
    if (inet_pton(AF_INET6, host, &v6) == 1) {
        return IN6_IS_ADDR_LOOPBACK(&v6) || (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127);
    }
    return strcmp(host, "localhost") == 0;
}

/* The IPv4 address of the interface named @p ifname (WEFT_SOCKET_IFNAME) into @p buf. */
static weft_status_t ifname_host(const char *ifname, char *buf, size_t n)
{
    struct ifaddrs *ifs;
    char names[256] = "";
    size_t off = 0;
    bool found = false;

    if (getifaddrs(&ifs) != 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "agent: cannot list the network interfaces for "
                               "WEFT_SOCKET_IFNAME=%s (%s)",
                               ifname, strerror(errno));
    }
    for (struct ifaddrs *i = ifs; i != NULL; i = i->ifa_next) {
        bool v4 = i->ifa_addr != NULL && i->ifa_addr->sa_family == AF_INET;
        if (strcmp(i->ifa_name, ifname) == 0) {
            found = true;
            if (v4) {
                inet_ntop(AF_INET, &((struct sockaddr_in *)(void *)i->ifa_addr)->sin_addr, buf,
                          (socklen_t)n);
                freeifaddrs(ifs);
                return WEFT_OK;
            }
        } else if (v4 && off < sizeof(names)) {
            off += (size_t)snprintf(names + off, sizeof(names) - off, "%s%s", off > 0 ? ", " : "",
                                    i->ifa_name);
        }
    }
    freeifaddrs(ifs);
    return weft__set_error(WEFT_ERR_INVALID_ARG,
                           "agent: WEFT_SOCKET_IFNAME=%s: %s (interfaces with an IPv4 address: "
                           "%s)",
                           ifname,
                           found ? "the interface has no IPv4 address" : "no such interface",
                           off > 0 ? names : "none");
}

/* The address of the first interface that is up, not loopback, with an IPv4 address. */
static bool first_interface_host(char *buf, size_t n)
{
    struct ifaddrs *ifs;
    bool got = false;

    if (getifaddrs(&ifs) != 0) {
        return false;
    }
    for (struct ifaddrs *i = ifs; i != NULL && !got; i = i->ifa_next) {
        if (i->ifa_addr != NULL && i->ifa_addr->sa_family == AF_INET &&
            (i->ifa_flags & IFF_UP) != 0 && (i->ifa_flags & IFF_LOOPBACK) == 0) {
            got = inet_ntop(AF_INET, &((struct sockaddr_in *)(void *)i->ifa_addr)->sin_addr, buf,
                            (socklen_t)n) != NULL;
        }
    }
    freeifaddrs(ifs);
    return got;
}

/* The IPv4 address of the interface this host reaches @p host:@p port by: the local address of
 * a UDP socket connected there (the kernel's route lookup; nothing is sent). */
static bool route_host(const char *host, int port, char *buf, size_t n)
{
    char ps[16];
    struct addrinfo hints = {0}, *res = NULL;
    bool got = false;

    snprintf(ps, sizeof(ps), "%d", port > 0 ? port : 9);
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_DGRAM;
    if (getaddrinfo(host, ps, &hints, &res) != 0) {
        return false;
    }
    for (struct addrinfo *ai = res; ai != NULL && !got; ai = ai->ai_next) {
        struct sockaddr_in sa;
        socklen_t sl = sizeof(sa);
        int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            continue;
        }
        got = connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
              getsockname(fd, (struct sockaddr *)&sa, &sl) == 0 && sa.sin_family == AF_INET &&
              inet_ntop(AF_INET, &sa.sin_addr, buf, (socklen_t)n) != NULL;
        close(fd);
    }
    freeaddrinfo(res);
    return got;
}

/*
 * The host this rank listens on and advertises (docs/weftrun.md, "How a rank chooses its
 * address"): opts.listen_host or WEFT_LISTEN_HOST as given; else the IPv4 address of
 * WEFT_SOCKET_IFNAME; else 127.0.0.1 when the master is loopback; else the address of the
 * interface the route to the master leaves by; when that is loopback too (the master's name is
 * this host's, mapped to 127.0.1.1) or there is no route yet, the first interface that is up and
 * not loopback. Rank 0 is reached at the master address; the interface is checked all the same.
 */
static weft_status_t choose_listen_host(weft_agent_t *a, const char *given, char *buf, size_t n,
                                        const char **host_p)
{
    const char *ifname = weft__cfg_str(WEFT__CFG_SOCKET_IFNAME);

    if (ifname[0] != '\0') {
        WEFT_CHECK(ifname_host(ifname, buf, n));
    }
    *host_p = buf;
    if (given[0] != '\0') {
        *host_p = given;
    } else if (a->rank == 0) {
        *host_p = a->master_addr;
    } else if (ifname[0] != '\0') {
        WEFT_INFO("this rank's address: %s (WEFT_SOCKET_IFNAME=%s)", buf, ifname);
    } else if (weft__address_loopback(a->master_addr)) {
        snprintf(buf, n, "127.0.0.1");
    } else if (route_host(a->master_addr, a->master_port, buf, n)) {
        if (!weft__address_loopback(buf)) {
            WEFT_INFO("this rank's address: %s (the interface toward the master %s)", buf,
                      a->master_addr);
        } else if (first_interface_host(buf, n)) {
            /* The master's name is this host's, mapped to 127.0.1.1 (Debian's /etc/hosts). */
            WEFT_INFO("this rank's address: %s, the first interface that is up (the master %s "
                      "is this host, reached by loopback)",
                      buf, a->master_addr);
        }
    } else if (first_interface_host(buf, n)) {
        WEFT_WARN("this rank's address: %s, the first interface that is up (no route to the "
                  "master %s: its name does not resolve yet?); set WEFT_LISTEN_HOST or "
                  "WEFT_SOCKET_IFNAME if the other hosts reach this one at another",
                  buf, a->master_addr);
    } else {
        snprintf(buf, n, "127.0.0.1"); /* no other interface: one host */
    }
    return WEFT_OK;
}

/* Options in code win; else the environment through the configuration table (read once). */
static weft_status_t resolve_opts(weft_agent_t *a, const weft_agent_opts_t *o)
{
    char buf[300];

    if (o->rendezvous_timeout_ms < 0 || o->default_timeout_ms < 0 || o->peer_timeout_ms < 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "agent: a negative timeout in the options (0 means the default)");
    }
    a->rank = o->rank >= 0 ? o->rank : (int)weft__cfg_int(WEFT__CFG_RANK);
    a->world_size = o->world_size > 0 ? o->world_size : (int)weft__cfg_int(WEFT__CFG_WORLD_SIZE);
    if (a->world_size < 1 || a->world_size > 1 << 20) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "agent: world size missing or out of range (set opts.world_size, "
                               "WEFT_WORLD_SIZE or WORLD_SIZE; got %d)",
                               a->world_size);
    }
    if (a->rank < 0 || a->rank >= a->world_size) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "agent: rank missing or out of range (set opts.rank, WEFT_RANK or "
                               "RANK; got %d for a world of %d)",
                               a->rank, a->world_size);
    }
    const char *addr =
        o->master_addr != NULL ? o->master_addr : weft__cfg_str(WEFT__CFG_MASTER_ADDR);
    a->master_addr = weft_strdup(addr[0] != '\0' ? addr : "127.0.0.1");
    a->master_port =
        o->master_port >= 0 ? o->master_port : (int)weft__cfg_int(WEFT__CFG_MASTER_PORT);
    if (a->master_port < 0 || a->master_port > 65535 || (a->master_port == 0 && a->rank != 0)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "agent: master port missing or invalid (set opts.master_port, "
                               "WEFT_MASTER_PORT or MASTER_PORT; got %d)",
                               a->master_port);
    }
    const char *name = o->name != NULL ? o->name : weft__cfg_str(WEFT__CFG_NAME);
    if (name[0] == '\0' && o->name == NULL) {
        snprintf(buf, sizeof(buf), "worker%d", a->rank);
        name = buf;
    }
    if (strlen(name) == 0 || strlen(name) > WEFT__MAX_NAME) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "agent: a worker name has 1 to %d bytes",
                               WEFT__MAX_NAME);
    }
    a->name = weft_strdup(name);
    if (a->master_addr == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "agent: no memory");
    }
    const char *host;
    WEFT_CHECK(choose_listen_host(
        a, o->listen_host != NULL ? o->listen_host : weft__cfg_str(WEFT__CFG_LISTEN_HOST), buf,
        sizeof(buf), &host));
    a->listen_host = weft_strdup(host);
    a->auth_token =
        weft_strdup(o->auth_token != NULL ? o->auth_token : weft__cfg_str(WEFT__CFG_AUTH_TOKEN));
    a->rendezvous_timeout_ms = o->rendezvous_timeout_ms > 0
                                   ? o->rendezvous_timeout_ms
                                   : weft__cfg_int(WEFT__CFG_RENDEZVOUS_TIMEOUT_MS);
    a->default_timeout_ms =
        o->default_timeout_ms > 0 ? o->default_timeout_ms : weft__cfg_int(WEFT__CFG_RPC_TIMEOUT_MS);
    a->peer_timeout_ms =
        o->peer_timeout_ms > 0 ? o->peer_timeout_ms : weft__cfg_int(WEFT__CFG_PEER_TIMEOUT_MS);
    a->handshake_timeout_ms = weft__cfg_int(WEFT__CFG_HANDSHAKE_TIMEOUT_MS);
    a->handler_threads =
        o->handler_threads > 0 ? o->handler_threads : (int)weft__cfg_int(WEFT__CFG_HANDLER_THREADS);
    int64_t maxb = o->max_message_bytes > 0 ? o->max_message_bytes
                                            : weft__cfg_int(WEFT__CFG_MAX_MESSAGE_BYTES);
    if (maxb > (int64_t)WEFT__MAX_MESSAGE) {
        maxb = (int64_t)WEFT__MAX_MESSAGE; /* what one gRPC message can carry */
    }
    a->direct_enabled = weft__cfg_bool(WEFT__CFG_DIRECT);
    if (a->rendezvous_timeout_ms < 0 || a->default_timeout_ms < 0 || a->peer_timeout_ms < 200 ||
        a->handler_threads < 1 || a->handler_threads > WEFT__MAX_POLLERS / 2 || maxb < 1024) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "agent: timeouts must be >= 0 (0: the default; peer timeout >= 200 "
                               "ms), handler threads 1..%d, max message >= 1024 bytes",
                               WEFT__MAX_POLLERS / 2);
    }
    a->max_message_bytes = (uint64_t)maxb;
    if (a->master_addr == NULL || a->name == NULL || a->listen_host == NULL ||
        a->auth_token == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "agent: no memory");
    }
    return WEFT_OK;
}

/* ------------------------------------------------------------ gRPC settings */

void weft__agent_channel_args(weft_agent_t *a, bool server, grpc_channel_args *out, grpc_arg *args)
{
    int keep = (int)(a->peer_timeout_ms / 2);
    size_t n = 0;

#define INT_ARG(k, v)                                                                              \
    do {                                                                                           \
        args[n].type = GRPC_ARG_INTEGER;                                                           \
        args[n].key = (char *)(k);                                                                 \
        args[n].value.integer = (v);                                                               \
        n++;                                                                                       \
    } while (0)
    /* weft enforces its own (configurable) limit and answers with a clear error. */
    INT_ARG(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, -1);
    INT_ARG(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, -1);
    INT_ARG(GRPC_ARG_KEEPALIVE_TIME_MS, keep);
    INT_ARG(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, keep);
    INT_ARG(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    INT_ARG(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    INT_ARG(GRPC_ARG_ENABLE_RETRIES, 0);
    if (server) {
        /* Accept the peers' keepalive pings however often they come. */
        INT_ARG(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, keep / 2);
        INT_ARG(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
    } else {
        INT_ARG(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
        INT_ARG(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
        /* Not GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: it is also the connect timeout, and a
         * handshake on a loaded machine can take longer than a short one. */
        INT_ARG(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    }
#undef INT_ARG
    weft__tls_grpc_args(a, args, &n);
    out->num_args = n;
    out->args = args;
}

/* ------------------------------------------------------------ transport threads */

static void *poller_main(void *arg);

static void block_hook(int entering, void *arg)
{
    weft_agent_t *a = arg;

    if (!entering) {
        atomic_fetch_sub(&a->blocked, 1);
        return;
    }
    /* Answers held for the message being run must not wait for this wait. */
    weft__stream_uncork_current();
    int blocked = atomic_fetch_add(&a->blocked, 1) + 1;
    pthread_mutex_lock(&a->threads_mu);
    /* Keep handler_threads transport threads free while others block in waits. */
    if (a->npollers - blocked < a->handler_threads && a->npollers < WEFT__MAX_POLLERS &&
        atomic_load(&a->state) < WEFT__AGENT_CLOSED) {
        if (pthread_create(&a->pollers[a->npollers], NULL, poller_main, a) == 0) {
            a->npollers++;
        }
    }
    pthread_mutex_unlock(&a->threads_mu);
}

static void *poller_main(void *arg)
{
    weft_agent_t *a = arg;

    weft__set_block_hook(block_hook, a);
    for (;;) {
        gpr_timespec dl =
            gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(POLL_MS, GPR_TIMESPAN));
        grpc_event ev = grpc_completion_queue_next(a->cq, dl, NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) {
            break;
        }
        if (ev.type == GRPC_OP_COMPLETE) {
            weft__op_t *op = ev.tag;
            op->cb(op, ev.success);
        }
    }
    weft__set_block_hook(NULL, NULL);
    return NULL;
}

/* ------------------------------------------------------------ server */

typedef struct {
    weft__op_t op;
    weft_agent_t *agent;
    grpc_call *call;
    grpc_call_details details;
    grpc_metadata_array md;
} server_req_t;

typedef struct {
    weft__op_t op;
    grpc_call *call;
    int cancelled;
} reject_t;

static void reject_done(weft__op_t *op, int ok)
{
    reject_t *r = container_of(op, reject_t, op);

    (void)ok;
    grpc_call_unref(r->call);
    weft_free(r);
}

static void reject(grpc_call *call, grpc_status_code code, const char *text)
{
    grpc_op ops[3];
    reject_t *r = weft_calloc(1, sizeof(*r));

    if (r == NULL) {
        grpc_call_cancel(call, NULL);
        grpc_call_unref(call);
        return;
    }
    r->op.cb = reject_done;
    r->call = call;
    memset(ops, 0, sizeof(ops));
    grpc_slice details = grpc_slice_from_copied_string(text);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[1].data.send_status_from_server.status = code;
    ops[1].data.send_status_from_server.status_details = &details;
    ops[2].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[2].data.recv_close_on_server.cancelled = &r->cancelled;
    if (grpc_call_start_batch(call, ops, 3, &r->op, NULL) != GRPC_CALL_OK) {
        grpc_call_unref(call);
        weft_free(r);
    }
    grpc_slice_unref(details);
}

static void server_request(weft_agent_t *a);

static void server_req_done(weft__op_t *op, int ok)
{
    server_req_t *r = container_of(op, server_req_t, op);
    weft_agent_t *a = r->agent;

    atomic_fetch_sub(&a->server_requests, 1);
    if (ok) {
        if (atomic_load(&a->state) < WEFT__AGENT_CLOSING) {
            server_request(a);
        }
        if (grpc_slice_str_cmp(r->details.method, WEFT__METHOD_STREAM) == 0) {
            weft__stream_accept(a, r->call);
        } else if (grpc_slice_str_cmp(r->details.method, WEFT__METHOD_JOIN) == 0) {
            weft__join_accept(a, r->call);
        } else {
            char *m = grpc_slice_to_c_string(r->details.method);
            char text[300];
            snprintf(text, sizeof(text), "weft: unknown method %.200s", m);
            WEFT_WARN("refused a call: %s", text);
            gpr_free(m);
            reject(r->call, GRPC_STATUS_UNIMPLEMENTED, text);
        }
    }
    grpc_call_details_destroy(&r->details);
    grpc_metadata_array_destroy(&r->md);
    weft_free(r);
}

static void server_request(weft_agent_t *a)
{
    server_req_t *r = weft_calloc(1, sizeof(*r));

    if (r == NULL) {
        WEFT_ERROR("no memory to accept calls");
        return;
    }
    r->op.cb = server_req_done;
    r->agent = a;
    grpc_call_details_init(&r->details);
    grpc_metadata_array_init(&r->md);
    atomic_fetch_add(&a->server_requests, 1);
    if (grpc_server_request_call(a->server, &r->call, &r->details, &r->md, a->cq, a->cq, &r->op) !=
        GRPC_CALL_OK) {
        atomic_fetch_sub(&a->server_requests, 1);
        grpc_call_details_destroy(&r->details);
        grpc_metadata_array_destroy(&r->md);
        weft_free(r);
    }
}

/* ------------------------------------------------------------ streams and peers */

void weft__agent_track_stream(weft_agent_t *a, bool add)
{
    pthread_mutex_lock(&a->streams_mu);
    if (add) {
        a->nstreams++;
    } else {
        a->nstreams--;
        if (a->nstreams == 0) {
            pthread_cond_broadcast(&a->streams_cv);
        }
    }
    pthread_mutex_unlock(&a->streams_mu);
}

weft_status_t weft__agent_wait_joined(weft_agent_t *a)
{
    return weft__agent_wait_joined_until(a, weft__now_ns() +
                                                (a->rendezvous_timeout_ms + 5000) * 1000000);
}

weft_status_t weft__agent_wait_joined_until(weft_agent_t *a, int64_t deadline_ns)
{
    if (atomic_load(&a->state) != WEFT__AGENT_CREATED) {
        return WEFT_OK;
    }
    if (!atomic_load(&a->joining)) {
        return weft__set_error(WEFT_ERR_INVALID_STATE, "rpc: the agent has not joined yet");
    }
    /* A peer that joined first calls us: wait for our own join to end. */
    int64_t left_ms = (deadline_ns - weft__now_ns()) / 1000000;
    weft_status_t st = weft_future_wait(a->join_done, left_ms > 0 ? left_ms : 1);
    if (st != WEFT_OK) {
        return weft__set_error(WEFT_ERR_INVALID_STATE, "rpc: the agent's join failed: %s",
                               weft_future_done(a->join_done) ? weft_future_error(a->join_done)
                                                              : "it did not end in time");
    }
    return WEFT_OK;
}

void weft__agent_passive_check(weft_agent_t *a)
{
    pthread_mutex_lock(&a->pend_mu);
    pthread_cond_broadcast(&a->passive_cv);
    pthread_mutex_unlock(&a->pend_mu);
}

bool weft__agent_closing(const weft_agent_t *a)
{
    return atomic_load(&((weft_agent_t *)a)->state) >= WEFT__AGENT_CLOSING;
}

void weft__agent_peer_lost(weft_agent_t *a, int rank, weft_status_t st, const char *why)
{
    if (rank < 0 || rank >= a->world_size) {
        return;
    }
    /* A peer with a ring to this rank: what it wrote there before it went is read first (its
     * answers are on the ring, the end of its process on the stream); the ring's reader then
     * declares the loss with this reason. */
    if (weft__shm_defer_loss(a, rank, st, why)) {
        return;
    }
    weft__peer_t *p = &a->peers[rank];
    pthread_mutex_lock(&p->mu);
    bool first = !p->lost;
    if (first) {
        p->lost = true;
        p->lost_why = weft_strdup(why);
    }
    pthread_mutex_unlock(&p->mu);
    weft__pending_fail_peer(a, rank, st, why);
    if (!first) {
        return;
    }
    for (int i = 0; i < WEFT__TP_COUNT; i++) {
        a->transports[i]->cut(a, rank);
    }
    WEFT_WARN("%s", why);
    weft__shutdown_peer_lost(a, rank);
    weft__modules_peer_lost(a, rank, why);
}

/* ------------------------------------------------------------ lifecycle */

static pthread_mutex_t grpc_init_mu = PTHREAD_MUTEX_INITIALIZER;

weft_status_t weft_agent_create(const weft_agent_opts_t *opts, weft_agent_t **agent_p)
{
    weft_status_t st;
    weft_agent_t *a;
    weft_agent_opts_t dflt;
    char addr[400];

    if (agent_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "agent_create: NULL agent pointer");
    }
    if (opts == NULL) {
        weft_agent_opts_init(&dflt);
        opts = &dflt;
    }
    a = weft_calloc(1, sizeof(*a));
    if (a == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "agent_create: no memory");
    }
    pthread_mutex_init(&a->threads_mu, NULL);
    pthread_rwlock_init(&a->reg_mu, NULL);
    pthread_mutex_init(&a->pend_mu, NULL);
    pthread_cond_init(&a->pend_cv, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&a->passive_cv, &ca);
    pthread_condattr_destroy(&ca);
    a->transports[WEFT__TP_STREAM] = &weft__stream_transport;
    a->transports[WEFT__TP_DIRECT] = &weft__direct_transport;
    a->transports[WEFT__TP_SHM] = &weft__shm_transport;
    pthread_mutex_init(&a->streams_mu, NULL);
    pthread_cond_init(&a->streams_cv, NULL);
    pthread_mutex_init(&a->sd_mu, NULL);
    pthread_mutex_init(&a->module_mu, NULL);
    pthread_mutex_init(&a->chan_mu, NULL);
    atomic_init(&a->state, WEFT__AGENT_CREATED);
    atomic_init(&a->next_request_id, 1);
    WEFT_CHECK_GOTO(weft_future_create(&a->join_done), st, err_free_agent);
    WEFT_CHECK_GOTO(resolve_opts(a, opts), st, err_free_agent);
    weft_log_set_rank(a->rank, a->name);
    WEFT_CHECK_GOTO(weft__identity_create(a), st, err_free_agent);
    WEFT_CHECK_GOTO(weft__tls_create(a,
                                     opts->tls_ca_file != NULL ? opts->tls_ca_file
                                                               : weft__cfg_str(WEFT__CFG_TLS_CA),
                                     opts->tls_cert_file != NULL
                                         ? opts->tls_cert_file
                                         : weft__cfg_str(WEFT__CFG_TLS_CERT),
                                     opts->tls_key_file != NULL ? opts->tls_key_file
                                                                : weft__cfg_str(WEFT__CFG_TLS_KEY)),
                    st, err_free_agent);
    WEFT_CHECK_GOTO(weft__timer_create("weft-timer", &a->timer), st, err_free_agent);

    a->peers = weft_calloc((size_t)a->world_size, sizeof(*a->peers));
    if (a->peers == NULL) {
        st = weft__set_error(WEFT_ERR_NO_MEMORY, "agent_create: no memory for %d peers",
                             a->world_size);
        goto err_free_agent;
    }
    for (int i = 0; i < a->world_size; i++) {
        a->peers[i].rank = i;
        pthread_mutex_init(&a->peers[i].mu, NULL);
    }

    pthread_mutex_lock(&grpc_init_mu);
    grpc_init();
    pthread_mutex_unlock(&grpc_init_mu);
    weft__agent_channel_args(a, false, &a->chan_args_s, a->chan_arg_v);
    a->chan_args = &a->chan_args_s;
    a->cq = grpc_completion_queue_create_for_next(NULL);
    weft__agent_channel_args(a, true, &a->server_args_s, a->server_arg_v);
    a->server = grpc_server_create(&a->server_args_s, NULL);
    grpc_server_register_completion_queue(a->server, a->cq, NULL);

    const char *bind_host = a->rank == 0 ? a->master_addr : a->listen_host;
    int want = a->rank == 0 ? a->master_port : 0;
    if (!weft__address_loopback(bind_host)) {
        bind_host = "0.0.0.0";
    }
    snprintf(addr, sizeof(addr), "%s:%d", bind_host, want);
    grpc_server_credentials *creds = weft__tls_server_credentials(a);
    a->port = creds != NULL ? grpc_server_add_http2_port(a->server, addr, creds) : 0;
    if (creds != NULL) {
        grpc_server_credentials_release(creds);
    }
    if (a->port == 0) {
        st = weft__set_error(WEFT_ERR_TRANSPORT, "agent_create: cannot listen on %s", addr);
        goto err_destroy_grpc;
    }
    snprintf(addr, sizeof(addr), "%s:%d", a->rank == 0 ? a->master_addr : a->listen_host, a->port);
    a->address = weft_strdup(addr);
    (void)weft__direct_create(a, bind_host, a->rank == 0 ? a->master_addr : a->listen_host);
    (void)weft__shm_create(a);
    weft__join_init(a);
    if (weft__bulk_create(&a->bulk) != WEFT_OK) {
        a->bulk = NULL; /* large messages are then read on the transport threads */
    }
    grpc_server_start(a->server);
    for (int i = 0; i < SERVER_REQUESTS; i++) {
        server_request(a);
    }
    weft__shutdown_register(a);
    pthread_mutex_lock(&a->threads_mu);
    for (int i = 0; i < a->handler_threads; i++) {
        if (pthread_create(&a->pollers[a->npollers], NULL, poller_main, a) != 0) {
            break;
        }
        a->npollers++;
    }
    pthread_mutex_unlock(&a->threads_mu);
    if (a->npollers == 0) {
        st = weft__set_error(WEFT_ERR_NO_MEMORY, "agent_create: cannot start threads");
        goto err_destroy_grpc;
    }
    WEFT_INFO("listening on %s (world of %d)", a->address, a->world_size);
    *agent_p = a;
    return WEFT_OK;

err_destroy_grpc:
    weft_agent_free(a);
    return st;
err_free_agent:
    weft_agent_free(a);
    return st;
}

int weft_agent_port(const weft_agent_t *a)
{
    return a->port;
}

weft_status_t weft_agent_join(weft_agent_t *a)
{
    if (a == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "agent_join: NULL agent");
    }
    if (atomic_load(&a->state) != WEFT__AGENT_CREATED) {
        return weft__set_error(WEFT_ERR_INVALID_STATE, "agent_join: already joined or closed");
    }
    atomic_store(&a->joining, true);
    weft_status_t st = weft__rendezvous(a);
    if (st == WEFT_OK) {
        atomic_store(&a->state, WEFT__AGENT_JOINED);
        weft__shm_open_all(a); /* rings to the ranks of this host, before the first frames */
    }
    /* Handlers that called out while the join was under way go on now. */
    weft_future_complete(a->join_done, st, st == WEFT_OK ? NULL : weft_last_error(), NULL);
    atomic_store(&a->joining, false);
    return st;
}

weft_status_t weft_agent_init(const weft_agent_opts_t *opts, weft_agent_t **agent_p)
{
    weft_agent_t *a;

    WEFT_CHECK(weft_agent_create(opts, &a));
    weft_status_t st = weft_agent_join(a);
    if (st != WEFT_OK) {
        char why[1024];
        snprintf(why, sizeof(why), "%s", weft_last_error());
        weft_agent_free(a);
        return weft__set_error(st, "%s", why);
    }
    *agent_p = a;
    return WEFT_OK;
}

int weft_agent_rank(const weft_agent_t *a)
{
    return a->rank;
}

int weft_agent_world_size(const weft_agent_t *a)
{
    return a->world_size;
}

const char *weft_agent_name(const weft_agent_t *a)
{
    return a->name;
}

const char *weft_agent_worker_name(const weft_agent_t *a, int rank)
{
    if (a == NULL || rank < 0 || rank >= a->world_size) {
        return NULL;
    }
    return a->peers[rank].name;
}

int64_t weft_agent_call_timeout_ms(const weft_agent_t *a)
{
    return a != NULL ? a->default_timeout_ms : 0;
}

uint64_t weft_agent_max_message_bytes(const weft_agent_t *a, int rank)
{
    if (a == NULL || rank < 0 || rank >= a->world_size) {
        return 0;
    }
    return rank == a->rank ? a->max_message_bytes : a->peers[rank].max_message_bytes;
}

const char *weft_agent_worker_address(const weft_agent_t *a, int rank)
{
    if (a == NULL || rank < 0 || rank >= a->world_size) {
        return NULL;
    }
    return a->peers[rank].address;
}

const char *weft_agent_worker_direct_address(const weft_agent_t *a, int rank)
{
    if (a == NULL || rank < 0 || rank >= a->world_size) {
        return NULL;
    }
    return a->peers[rank].direct_address != NULL ? a->peers[rank].direct_address : "";
}

weft_status_t weft_agent_worker_rank(const weft_agent_t *a, const char *name, int *rank_p)
{
    if (a == NULL || name == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "worker_rank: NULL argument");
    }
    for (int i = 0; i < a->world_size; i++) {
        if (a->peers[i].name != NULL && strcmp(a->peers[i].name, name) == 0) {
            *rank_p = i;
            return WEFT_OK;
        }
    }
    return weft__set_error(WEFT_ERR_NOT_FOUND, "no worker named '%s' in this world", name);
}

/* Waits until at most @p target streams are alive or @p deadline_ns passes;
 * returns how many are left. */
static int wait_streams(weft_agent_t *a, int target, int64_t deadline_ns)
{
    pthread_mutex_lock(&a->streams_mu);
    while (a->nstreams > target && weft__now_ns() < deadline_ns) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 20000000;
        if (ts.tv_nsec >= 1000000000) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000;
        }
        pthread_cond_timedwait(&a->streams_cv, &a->streams_mu, &ts);
    }
    int left = a->nstreams;
    pthread_mutex_unlock(&a->streams_mu);
    return left;
}

/* Closes every stream and the server, then the queue and the threads. */
static void close_transport(weft_agent_t *a, int64_t deadline_ns)
{
    atomic_store(&a->state, WEFT__AGENT_CLOSING);
    /* Half-close our client streams: peers finish them once their replies are out. */
    for (int i = 0; i < a->world_size; i++) {
        weft__peer_t *p = &a->peers[i];
        pthread_mutex_lock(&p->mu);
        if (p->stream != NULL) {
            weft__stream_close(p->stream);
        }
        pthread_mutex_unlock(&p->mu);
    }
    /* Wait for the streams to end gracefully, each side closing its own. */
    /* Our client streams stay referenced by their peers until free: wait for the rest. */
    int held = 0;
    for (int i = 0; i < a->world_size; i++) {
        held += a->peers[i].stream != NULL ? 1 : 0;
    }
    (void)wait_streams(a, held, deadline_ns);
}

weft_status_t weft_agent_shutdown(weft_agent_t *a, int64_t timeout_ms)
{
    if (a == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "agent_shutdown: NULL agent");
    }
    int state = atomic_load(&a->state);
    if (state >= WEFT__AGENT_CLOSING && a->shut_down) {
        return WEFT_OK; /* shut down already */
    }
    if (state != WEFT__AGENT_JOINED) {
        return weft__set_error(WEFT_ERR_INVALID_STATE, "agent_shutdown: agent is not running");
    }
    WEFT_CHECK(weft__call_timeout(a, timeout_ms, &timeout_ms));
    int64_t deadline = weft__now_ns() + timeout_ms * 1000000;
    /* Modules settle first (their on_shutdown), while calls still go. */
    weft__modules_shutdown(a, deadline / 1000000);
    atomic_store(&a->state, WEFT__AGENT_SHUTTING_DOWN);
    weft_status_t st = weft__shutdown_barrier(a, deadline);
    char why[1024];
    snprintf(why, sizeof(why), "%s", weft_last_error());
    int64_t close_deadline = weft__now_ns() + 5000 * 1000000LL;
    close_transport(a, close_deadline < deadline || st != WEFT_OK ? close_deadline : deadline);
    a->shut_down = true;
    if (st != WEFT_OK) {
        return weft__set_error(st, "%s", why);
    }
    return WEFT_OK;
}

void weft_agent_free(weft_agent_t *a)
{
    if (a == NULL) {
        return;
    }
    int state = atomic_load(&a->state);
    if (a->server != NULL && state < WEFT__AGENT_CLOSING && state > WEFT__AGENT_CREATED) {
        WEFT_DEBUG("agent freed without shutdown: closing abruptly");
    }
    atomic_store(&a->state, WEFT__AGENT_CLOSED);
    /* Shared-memory rings and direct connections first: their threads feed the agent. */
    a->transports[WEFT__TP_SHM]->stop(a);
    a->transports[WEFT__TP_DIRECT]->stop(a);
    if (a->server != NULL) {
        /* Server: stop accepting, cancel what is left, wait until it is done. */
        weft__op_t done = {NULL};
        grpc_completion_queue *scq = grpc_completion_queue_create_for_pluck(NULL);
        grpc_server_shutdown_and_notify(a->server, scq, &done);
        grpc_server_cancel_all_calls(a->server);
        grpc_completion_queue_pluck(scq, &done, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        grpc_completion_queue_shutdown(scq);
        grpc_completion_queue_destroy(scq);
    }
    a->transports[WEFT__TP_STREAM]->stop(a);
    /* Outgoing calls that are still pending will never be answered now. */
    if (a->cq != NULL) {
        weft__pending_fail_all(a, WEFT_ERR_SHUTDOWN, "the agent was closed");
        /* Wait (bounded) for every stream's operations to come back through the queue. */
        int left = wait_streams(a, 0, weft__now_ns() + 10000 * 1000000LL);
        if (left > 0) {
            WEFT_WARN("%d streams still open at close", left);
        }
        for (int i = 0; a->peers != NULL && i < a->world_size; i++) {
            if (a->peers[i].channel != NULL) {
                grpc_channel_destroy(a->peers[i].channel);
                a->peers[i].channel = NULL;
            }
        }
        grpc_completion_queue_shutdown(a->cq);
    }
    pthread_mutex_lock(&a->threads_mu);
    int n = a->npollers;
    pthread_mutex_unlock(&a->threads_mu);
    if (n == 0 && a->cq != NULL) {
        while (grpc_completion_queue_next(a->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
               GRPC_QUEUE_SHUTDOWN) {
        }
    }
    for (int i = 0; i < n; i++) {
        pthread_join(a->pollers[i], NULL);
    }
    /* Threads started while we joined (a late block hook) are joined too. */
    pthread_mutex_lock(&a->threads_mu);
    int m = a->npollers;
    pthread_mutex_unlock(&a->threads_mu);
    for (int i = n; i < m; i++) {
        pthread_join(a->pollers[i], NULL);
    }
    if (a->bulk != NULL) {
        weft__bulk_destroy(a->bulk);
        a->bulk = NULL;
    }
    /* No thread is left that may look at the direct or shared-memory state. */
    weft__direct_destroy(a);
    weft__shm_destroy(a);
    /* Nor any that may add a task: what is left is dropped (modules' tasks included; their
     * drop callbacks run). */
    weft__timer_free(a->timer);
    a->timer = NULL;
    /* Every completion has been delivered: the rendezvous state can go. */
    weft__join_free(a);
    if (a->cq != NULL) {
        grpc_completion_queue_destroy(a->cq);
    }
    if (a->server != NULL) {
        grpc_server_destroy(a->server);
    }
    weft__shutdown_free(a);
    /* References still kept for this rank itself: released before their modules go. */
    weft__refs_free(a);
    /* Upper modules' state, now that nothing can call into it any more. */
    weft__modules_free(a);
    weft__identity_free(a);
    if (a->server != NULL) {
        pthread_mutex_lock(&grpc_init_mu);
        grpc_shutdown();
        pthread_mutex_unlock(&grpc_init_mu);
    }
    /* After the server: its credentials' fetcher reads this. */
    weft__tls_free(a);
    while (a->fns != NULL) {
        weft__fn_t *f = a->fns;
        a->fns = f->next;
        weft_free(f->name);
        weft_free(f);
    }
    if (a->peers != NULL) {
        for (int i = 0; i < a->world_size; i++) {
            weft_free(a->peers[i].name);
            weft_free(a->peers[i].address);
            weft_free(a->peers[i].lost_why);
            weft_free(a->peers[i].direct_address);
            weft_free(a->peers[i].shm_address);
            pthread_mutex_destroy(&a->peers[i].mu);
        }
        weft_free(a->peers);
    }
    if (a->join_done != NULL) {
        weft_future_complete(a->join_done, WEFT_ERR_SHUTDOWN, "agent closed", NULL);
        weft_future_release(a->join_done);
    }
    weft_free(a->name);
    weft_free(a->master_addr);
    weft_free(a->listen_host);
    weft_free(a->auth_token);
    weft_free(a->address);
    pthread_mutex_destroy(&a->threads_mu);
    pthread_rwlock_destroy(&a->reg_mu);
    pthread_mutex_destroy(&a->pend_mu);
    pthread_cond_destroy(&a->pend_cv);
    pthread_cond_destroy(&a->passive_cv);
    pthread_mutex_destroy(&a->streams_mu);
    pthread_cond_destroy(&a->streams_cv);
    pthread_mutex_destroy(&a->sd_mu);
    pthread_mutex_destroy(&a->module_mu);
    pthread_mutex_destroy(&a->chan_mu);
    weft_free(a);
}
