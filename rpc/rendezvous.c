/* Rendezvous: rank 0 gathers a Hello from every rank over a unary Join call
 * and answers all of them with the world map, or with why there is none. */
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>

#include <grpc/grpc_security.h>
#include <grpc/support/time.h>

#include "internal.h"

#define container_of(p, type, member) ((type *)((char *)(p)-offsetof(type, member)))

typedef struct join_call {
    weft__op_t recv_op;
    weft__op_t send_op;
    weft__op_t close_op;
    weft_agent_t *agent;
    grpc_call *call;
    grpc_byte_buffer *bb;
    int cancelled;
    int rank;   /* -1 until its Hello is accepted */
    char *peer; /* where the call came from, as gRPC says ("ipv4:10.0.0.2:5000"); gpr_free */
    int refs;
    bool answered;
} join_call_t;

struct weft__join {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    Weft__V1__Hello **hellos; /* per rank */
    join_call_t **calls;      /* per rank; rank 0's is NULL */
    int arrived;
    bool decided;
    weft_status_t failed; /* the world was decided against: every rank's join fails with it */
    char why[1024];       /* ... and this text */
};

static void join_call_destroy(join_call_t *j)
{
    grpc_call_unref(j->call);
    gpr_free(j->peer);
    weft_free(j);
}

static void join_call_unref(join_call_t *j)
{
    weft__join_t *jn = j->agent->join;

    pthread_mutex_lock(&jn->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&jn->mu);
    if (left == 0) {
        join_call_destroy(j);
    }
}

void weft__join_init(weft_agent_t *a)
{
    if (a->rank != 0) {
        return;
    }
    weft__join_t *jn = weft_calloc(1, sizeof(*jn));
    if (jn == NULL) {
        return;
    }
    jn->hellos = weft_calloc((size_t)a->world_size, sizeof(*jn->hellos));
    jn->calls = weft_calloc((size_t)a->world_size, sizeof(*jn->calls));
    if (jn->hellos == NULL || jn->calls == NULL) {
        weft_free(jn->hellos);
        weft_free(jn->calls);
        weft_free(jn);
        return;
    }
    pthread_mutex_init(&jn->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&jn->cv, &ca);
    pthread_condattr_destroy(&ca);
    a->join = jn;
}

void weft__join_free(weft_agent_t *a)
{
    weft__join_t *jn = a->join;

    if (jn == NULL) {
        return;
    }
    for (int i = 0; i < a->world_size; i++) {
        if (jn->hellos[i] != NULL) {
            weft__v1__hello__free_unpacked(jn->hellos[i], &weft__pb_allocator);
        }
    }
    weft_free(jn->hellos);
    weft_free(jn->calls);
    pthread_mutex_destroy(&jn->mu);
    pthread_cond_destroy(&jn->cv);
    weft_free(jn);
    a->join = NULL;
}

static void send_done(weft__op_t *op, int ok)
{
    join_call_t *j = container_of(op, join_call_t, send_op);

    (void)ok;
    join_call_unref(j);
}

/* Answers one Join call with @p map (status inside). Called with jn->mu held. */
static void answer_locked(join_call_t *j, const Weft__V1__WorldMap *map)
{
    grpc_op ops[3];

    if (j->answered) {
        return;
    }
    j->answered = true;
    grpc_byte_buffer *bb = weft__wire_pack(&map->base);
    grpc_slice details = grpc_empty_slice();
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = bb;
    ops[2].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[2].data.send_status_from_server.status = GRPC_STATUS_OK;
    ops[2].data.send_status_from_server.status_details = &details;
    j->refs++;
    if (grpc_call_start_batch(j->call, ops, 3, &j->send_op, NULL) != GRPC_CALL_OK) {
        j->refs--;
    }
    grpc_byte_buffer_destroy(bb);
}

static void answer_error_locked(join_call_t *j, weft_status_t st, const char *why)
{
    Weft__V1__WorldMap map = WEFT__V1__WORLD_MAP__INIT;

    map.protocol_version = WEFT_PROTOCOL_VERSION;
    map.status = st;
    map.error = (char *)why;
    answer_locked(j, &map);
}

static void install_world(weft_agent_t *a, Weft__V1__Worker **workers)
{
    for (int i = 0; i < a->world_size; i++) {
        weft__peer_t *p = &a->peers[i];
        pthread_mutex_lock(&p->mu);
        weft_free(p->name);
        weft_free(p->address);
        p->name = weft_strdup(workers[i]->name);
        p->address = weft_strdup(workers[i]->address);
        p->max_message_bytes = workers[i]->max_message_bytes;
        weft_free(p->direct_address);
        p->direct_address =
            weft_strdup(workers[i]->direct_address != NULL ? workers[i]->direct_address : "");
        weft_free(p->shm_address);
        p->shm_address =
            weft_strdup(workers[i]->shm_address != NULL ? workers[i]->shm_address : "");
        p->has_key = workers[i]->identity_key.len == WEFT__ID_KEY_BYTES;
        if (p->has_key) {
            memcpy(p->identity_key, workers[i]->identity_key.data, WEFT__ID_KEY_BYTES);
        }
        pthread_mutex_unlock(&p->mu);
    }
}

/* The host part of gRPC's peer text ("ipv4:10.0.0.2:5000", "ipv6:[::1]:5000", or with the
 * brackets as %5B and %5D) into @p buf; false for anything else. */
static bool peer_host(const char *peer, char *buf, size_t n)
{
    char tmp[300];
    size_t k = 0;

    if (peer == NULL || (strncmp(peer, "ipv4:", 5) != 0 && strncmp(peer, "ipv6:", 5) != 0)) {
        return false;
    }
    for (const char *c = peer + 5; *c != '\0' && k < sizeof(tmp) - 1; c++) {
        if (strncmp(c, "%5B", 3) == 0 || strncmp(c, "%5D", 3) == 0) {
            tmp[k++] = c[2] == 'B' ? '[' : ']';
            c += 2;
        } else {
            tmp[k++] = *c;
        }
    }
    tmp[k] = '\0';
    char *colon = strrchr(tmp, ':'), *h = tmp;
    if (colon == NULL) {
        return false;
    }
    *colon = '\0';
    size_t len = strlen(h);
    if (len > 1 && h[0] == '[' && h[len - 1] == ']') {
        h[len - 1] = '\0';
        h++;
    }
    return (size_t)snprintf(buf, n, "%s", h) < n;
}

/* Whether a connection from @p host (an address) came from another host: the address is not
 * loopback and none of this host's interfaces has it. Not an address: false (not judged). */
static bool other_host(const char *host, const struct ifaddrs *ifs)
{
    struct in6_addr v6;
    struct in_addr v4;
    bool is4 = inet_pton(AF_INET, host, &v4) == 1;

    if (!is4) {
        if (inet_pton(AF_INET6, host, &v6) != 1 || IN6_IS_ADDR_LOOPBACK(&v6)) {
            return false;
        }
        if (IN6_IS_ADDR_V4MAPPED(&v6)) {
            memcpy(&v4, &v6.s6_addr[12], sizeof(v4));
            is4 = true;
        }
    }
    if (is4 && (ntohl(v4.s_addr) >> 24) == 127) {
        return false;
    }
    for (const struct ifaddrs *i = ifs; i != NULL; i = i->ifa_next) {
        if (i->ifa_addr == NULL) {
            continue;
        }
        if (is4 && i->ifa_addr->sa_family == AF_INET &&
            memcmp(&((const struct sockaddr_in *)(const void *)i->ifa_addr)->sin_addr, &v4,
                   sizeof(v4)) == 0) {
            return false;
        }
        if (!is4 && i->ifa_addr->sa_family == AF_INET6 &&
            memcmp(&((const struct sockaddr_in6 *)(const void *)i->ifa_addr)->sin6_addr, &v6,
                   sizeof(v6)) == 0) {
            return false;
        }
    }
    return true;
}

/*
 * A world that would fail at its first connection: ranks run on more than one host (a Join came
 * from an address of none of this host's interfaces) and a rank advertises a loopback address,
 * which the other hosts cannot reach. Writes why to @p why and returns true. The first such rank
 * is named; one on another host than rank 0 comes first. Called with jn->mu held.
 */
static bool loopback_across_hosts(weft_agent_t *a, char *why, size_t n)
{
    weft__join_t *jn = a->join;
    struct ifaddrs *ifs;
    char host[300], from[300] = "", list[128] = "";
    int remote = -1, bad = -1, nbad = 0;
    bool bad_remote = false;
    size_t off = 0;

    if (getifaddrs(&ifs) != 0) {
        return false; /* cannot tell the hosts apart: the connections will say */
    }
    for (int i = 1; i < a->world_size; i++) {
        bool far = peer_host(jn->calls[i]->peer, host, sizeof(host)) && other_host(host, ifs);
        if (far && remote < 0) {
            remote = i;
            snprintf(from, sizeof(from), "%s", host);
        }
        if (weft__address_loopback(jn->hellos[i]->address) && far && !bad_remote) {
            bad = i;
            bad_remote = true;
            snprintf(from, sizeof(from), "%s", host);
        }
    }
    freeifaddrs(ifs);
    if (remote < 0) {
        return false; /* one host: loopback addresses reach every rank */
    }
    for (int i = 0; i < a->world_size; i++) {
        if (!weft__address_loopback(jn->hellos[i]->address)) {
            continue;
        }
        if (bad < 0) {
            bad = i;
        }
        if (off < sizeof(list)) {
            off +=
                (size_t)snprintf(list + off, sizeof(list) - off, "%s%d", nbad > 0 ? ", " : "", i);
        }
        nbad++;
    }
    if (bad < 0) {
        return false;
    }
    char more[192] = "";
    if (nbad > 1) {
        snprintf(more, sizeof(more), " (%d ranks advertise loopback addresses: %s)", nbad, list);
    }
    const Weft__V1__Hello *h = jn->hellos[bad];
    if (bad_remote) {
        snprintf(why, n,
                 "rank %d (%s) advertises %s, a loopback address, but it runs on another host "
                 "than rank 0 (its join came from %s): set WEFT_LISTEN_HOST or WEFT_SOCKET_IFNAME "
                 "on its node to an address the other hosts can reach%s",
                 bad, h->name, h->address, from, more);
    } else {
        snprintf(why, n,
                 "rank %d (%s) advertises %s, a loopback address, but rank %d runs on another "
                 "host (its join came from %s): set WEFT_LISTEN_HOST or WEFT_SOCKET_IFNAME on "
                 "rank %d's node to an address the other hosts can reach%s",
                 bad, h->name, h->address, remote, from, bad, more);
    }
    return true;
}

/* The world is decided against: every joiner's join fails with @p st and jn->why, and so does
 * rank 0's. Called with jn->mu held. */
static void refuse_world_locked(weft_agent_t *a, weft_status_t st)
{
    weft__join_t *jn = a->join;

    jn->failed = st;
    WEFT_ERROR("rendezvous: %s", jn->why);
    for (int i = 1; i < a->world_size; i++) {
        answer_error_locked(jn->calls[i], st, jn->why);
    }
    pthread_cond_broadcast(&jn->cv);
}

/* All ranks are in: answer everyone with the world. Called with jn->mu held. */
static void decide_world_locked(weft_agent_t *a)
{
    weft__join_t *jn = a->join;
    Weft__V1__WorldMap map = WEFT__V1__WORLD_MAP__INIT;

    jn->decided = true;
    if (loopback_across_hosts(a, jn->why, sizeof(jn->why))) {
        refuse_world_locked(a, WEFT_ERR_RENDEZVOUS);
        return;
    }
    Weft__V1__Worker *w = weft_calloc((size_t)a->world_size, sizeof(*w));
    Weft__V1__Worker **wp = weft_calloc((size_t)a->world_size, sizeof(*wp));
    if (w == NULL || wp == NULL) {
        weft_free(w);
        weft_free(wp);
        snprintf(jn->why, sizeof(jn->why), "master ran out of memory");
        refuse_world_locked(a, WEFT_ERR_NO_MEMORY);
        return;
    }
    for (int i = 0; i < a->world_size; i++) {
        weft__v1__worker__init(&w[i]);
        w[i].name = jn->hellos[i]->name;
        w[i].rank = i;
        w[i].address = jn->hellos[i]->address;
        w[i].max_message_bytes = jn->hellos[i]->max_message_bytes;
        w[i].direct_address = jn->hellos[i]->direct_address;
        w[i].shm_address = jn->hellos[i]->shm_address;
        w[i].identity_key = jn->hellos[i]->identity_key;
        wp[i] = &w[i];
    }
    map.protocol_version = WEFT_PROTOCOL_VERSION;
    map.n_workers = (size_t)a->world_size;
    map.workers = wp;
    install_world(a, wp);
    for (int i = 1; i < a->world_size; i++) {
        answer_locked(jn->calls[i], &map);
    }
    weft_free(w);
    weft_free(wp);
    pthread_cond_broadcast(&jn->cv);
}

/* Validates a Hello against the world so far. Called with jn->mu held. */
static weft_status_t check_join(weft_agent_t *a, const Weft__V1__Hello *h,
                                const weft__tls_id_t *tls, char *why, size_t n)
{
    weft__join_t *jn = a->join;

    weft_status_t st = weft__hello_check(a, h, WEFT__HELLO_JOIN, NULL, 0, tls, why, n);
    if (st != WEFT_OK) {
        return st;
    }
    if (jn->decided) {
        snprintf(why, n, "rank %d came after the rendezvous ended (the world formed or timed out)",
                 h->rank);
        return WEFT_ERR_RENDEZVOUS;
    }
    if (jn->hellos[h->rank] != NULL) {
        snprintf(why, n, "rank %d joined twice", h->rank);
        return WEFT_ERR_ALREADY_EXISTS;
    }
    for (int i = 0; i < a->world_size; i++) {
        if (jn->hellos[i] != NULL && strcmp(jn->hellos[i]->name, h->name) == 0) {
            snprintf(why, n, "rank %d asks for the name '%s' of rank %d", h->rank, h->name, i);
            return WEFT_ERR_ALREADY_EXISTS;
        }
    }
    return WEFT_OK;
}

static void recv_done(weft__op_t *op, int ok)
{
    join_call_t *j = container_of(op, join_call_t, recv_op);
    weft_agent_t *a = j->agent;
    weft__join_t *jn = a->join;
    uint8_t *buf = NULL;
    size_t len = 0;
    Weft__V1__Hello *h = NULL;
    char why[512];
    weft_status_t st = WEFT_ERR_PROTOCOL;

    snprintf(why, sizeof(why), "no Hello received");
    if (ok && j->bb != NULL) {
        st = weft__wire_flatten(j->bb, 1 << 20, &buf, &len);
        if (st == WEFT_OK) {
            h = weft__v1__hello__unpack(&weft__pb_allocator, len, buf);
            weft_free(buf);
            if (h == NULL) {
                st = WEFT_ERR_PROTOCOL;
                snprintf(why, sizeof(why), "the Hello does not decode");
            }
        } else {
            snprintf(why, sizeof(why), "%s", weft_last_error());
        }
    }
    if (j->bb != NULL) {
        grpc_byte_buffer_destroy(j->bb);
        j->bb = NULL;
    }
    weft__tls_id_t tls;
    weft__tls_call_id(j->call, &tls);
    pthread_mutex_lock(&jn->mu);
    if (h != NULL) {
        st = check_join(a, h, &tls, why, sizeof(why));
    }
    if (st != WEFT_OK) {
        WEFT_WARN("rendezvous: refused a join: %s", why);
        answer_error_locked(j, st, why);
        if (h != NULL) {
            weft__v1__hello__free_unpacked(h, &weft__pb_allocator);
        }
    } else {
        WEFT_INFO("rendezvous: rank %d (%s) at %s joined", h->rank, h->name, h->address);
        j->rank = h->rank;
        jn->hellos[h->rank] = h;
        jn->calls[h->rank] = j;
        jn->arrived++;
        if (jn->arrived == a->world_size) {
            decide_world_locked(a);
        }
    }
    j->refs--;
    int left = j->refs;
    pthread_mutex_unlock(&jn->mu);
    if (left == 0) {
        join_call_destroy(j);
    }
}

static void close_done(weft__op_t *op, int ok)
{
    join_call_t *j = container_of(op, join_call_t, close_op);
    weft__join_t *jn = j->agent->join;

    (void)ok;
    pthread_mutex_lock(&jn->mu);
    /* A joiner that went away before the world formed gives its place back. */
    if (j->cancelled && !jn->decided && j->rank > 0 && jn->calls[j->rank] == j) {
        WEFT_WARN("rendezvous: rank %d left before the world formed", j->rank);
        weft__v1__hello__free_unpacked(jn->hellos[j->rank], &weft__pb_allocator);
        jn->hellos[j->rank] = NULL;
        jn->calls[j->rank] = NULL;
        jn->arrived--;
    }
    pthread_mutex_unlock(&jn->mu);
    join_call_unref(j);
}

void weft__join_accept(weft_agent_t *a, grpc_call *call)
{
    grpc_op op;

    if (a->join == NULL) {
        /* Not the master. */
        grpc_call_cancel_with_status(call, GRPC_STATUS_FAILED_PRECONDITION,
                                     "weft: this rank is not the rendezvous master", NULL);
        grpc_call_unref(call);
        return;
    }
    join_call_t *j = weft_calloc(1, sizeof(*j));
    if (j == NULL) {
        grpc_call_cancel(call, NULL);
        grpc_call_unref(call);
        return;
    }
    j->agent = a;
    j->call = call;
    j->peer = grpc_call_get_peer(call);
    j->rank = -1;
    j->recv_op.cb = recv_done;
    j->send_op.cb = send_done;
    j->close_op.cb = close_done;
    /* References: the receive and the close; each answer adds one. */
    j->refs = 2;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &j->cancelled;
    if (grpc_call_start_batch(call, &op, 1, &j->close_op, NULL) != GRPC_CALL_OK) {
        j->refs--;
    }
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &j->bb;
    if (grpc_call_start_batch(call, &op, 1, &j->recv_op, NULL) != GRPC_CALL_OK) {
        j->refs--;
    }
}

static weft_status_t rendezvous_master(weft_agent_t *a)
{
    weft__join_t *jn = a->join;
    weft_status_t st = WEFT_OK;
    struct timespec ts;

    if (jn == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rendezvous: no memory");
    }
    Weft__V1__Hello *me = weft_calloc(1, sizeof(*me));
    if (me == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rendezvous: no memory");
    }
    weft__v1__hello__init(me);
    weft__hello_fill(a, me);
    /* Keep a copy that free_unpacked can release: pack and unpack it. */
    size_t n = weft__v1__hello__get_packed_size(me);
    uint8_t *buf = weft_alloc(n + 1);
    if (buf == NULL) {
        weft_free(me);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rendezvous: no memory");
    }
    weft__v1__hello__pack(me, buf);
    weft_free(me);
    me = weft__v1__hello__unpack(&weft__pb_allocator, n, buf);
    weft_free(buf);
    if (me == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rendezvous: no memory");
    }

    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t dl =
        (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec + a->rendezvous_timeout_ms * 1000000;
    ts.tv_sec = dl / 1000000000LL;
    ts.tv_nsec = dl % 1000000000LL;

    pthread_mutex_lock(&jn->mu);
    for (int i = 1; i < a->world_size; i++) {
        if (jn->hellos[i] != NULL && strcmp(jn->hellos[i]->name, me->name) == 0) {
            /* The joiner took the master's name: refuse it, keep waiting for a good one. */
            answer_error_locked(jn->calls[i], WEFT_ERR_ALREADY_EXISTS,
                                "the name is taken by rank 0");
            weft__v1__hello__free_unpacked(jn->hellos[i], &weft__pb_allocator);
            jn->hellos[i] = NULL;
            jn->calls[i] = NULL;
            jn->arrived--;
        }
    }
    jn->hellos[0] = me;
    jn->arrived++;
    if (jn->arrived == a->world_size) {
        decide_world_locked(a);
    }
    while (!jn->decided) {
        if (pthread_cond_timedwait(&jn->cv, &jn->mu, &ts) != 0 && !jn->decided) {
            char missing[512];
            size_t off = 0;
            int count = 0;
            missing[0] = '\0';
            for (int i = 0; i < a->world_size; i++) {
                if (jn->hellos[i] == NULL) {
                    count++;
                    if (off < sizeof(missing) - 16) {
                        off += (size_t)snprintf(missing + off, sizeof(missing) - off, "%s%d",
                                                count > 1 ? ", " : "", i);
                    }
                }
            }
            char why[768];
            snprintf(why, sizeof(why),
                     "rendezvous: rank%s %s never arrived (waited %lld ms for a world of %d)",
                     count > 1 ? "s" : "", missing, (long long)a->rendezvous_timeout_ms,
                     a->world_size);
            jn->decided = true;
            for (int i = 1; i < a->world_size; i++) {
                if (jn->calls[i] != NULL) {
                    answer_error_locked(jn->calls[i], WEFT_ERR_RENDEZVOUS, why);
                }
            }
            st = weft__set_error(WEFT_ERR_RENDEZVOUS, "%s", why);
            WEFT_ERROR("%s", why);
            break;
        }
    }
    if (st == WEFT_OK && jn->failed != WEFT_OK) {
        st = weft__set_error(jn->failed, "rendezvous: %s", jn->why);
    }
    pthread_mutex_unlock(&jn->mu);
    return st;
}

static weft_status_t rendezvous_join(weft_agent_t *a)
{
    weft_status_t st;
    grpc_op ops[6];
    char target[400];
    grpc_metadata_array md_in, trailing;
    grpc_byte_buffer *reply = NULL;
    grpc_status_code code = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    weft__op_t tag = {NULL};

    snprintf(target, sizeof(target), "%s:%d", a->master_addr, a->master_port);
    grpc_channel *ch = weft__channel_create(a, target, 0);
    if (ch == NULL) {
        return weft__set_error(WEFT_ERR_TRANSPORT, "rendezvous: cannot make a channel to %s",
                               target);
    }
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    gpr_timespec dl =
        gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                     gpr_time_from_millis(a->rendezvous_timeout_ms + 3000, GPR_TIMESPAN));
    grpc_call *call =
        grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                 grpc_slice_from_static_string(WEFT__METHOD_JOIN), NULL, dl, NULL);
    Weft__V1__Hello h = WEFT__V1__HELLO__INIT;
    weft__hello_fill(a, &h);
    grpc_byte_buffer *bb = weft__wire_pack(&h.base);
    grpc_metadata_array_init(&md_in);
    grpc_metadata_array_init(&trailing);
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].flags = GRPC_INITIAL_METADATA_WAIT_FOR_READY;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &md_in;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &reply;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trailing;
    ops[5].data.recv_status_on_client.status = &code;
    ops[5].data.recv_status_on_client.status_details = &details;
    if (grpc_call_start_batch(call, ops, 6, &tag, NULL) != GRPC_CALL_OK) {
        st = weft__set_error(WEFT_ERR_TRANSPORT, "rendezvous: gRPC refused the join call");
        goto out;
    }
    /* While the channel cannot connect, a handshake of our own tells a master that is not up
     * yet from one this rank can never reach (TLS on one side only, certificates refused):
     * those end the join at once, with the reason. */
    weft_status_t probe = WEFT_OK, last = WEFT_OK;
    char probe_why[768] = "";
    int64_t next_probe = weft__now_ns() + 200 * 1000000LL;
    for (;;) {
        gpr_timespec tick = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                         gpr_time_from_millis(100, GPR_TIMESPAN));
        if (grpc_completion_queue_pluck(cq, &tag, tick, NULL).type == GRPC_OP_COMPLETE) {
            break;
        }
        int64_t now = weft__now_ns();
        if (probe == WEFT_OK && now >= next_probe &&
            grpc_channel_check_connectivity_state(ch, 0) == GRPC_CHANNEL_TRANSIENT_FAILURE) {
            int64_t budget = a->handshake_timeout_ms < 2000 ? a->handshake_timeout_ms : 2000;
            /* The same verdict twice, a probe apart: a master restarting or shedding
             * connections may look refused once. */
            weft_status_t v = weft__tls_diagnose(a, target, 0, now + budget * 1000000);
            if (v != WEFT_OK && v == last) {
                probe = v;
                snprintf(probe_why, sizeof(probe_why), "%s", weft_last_error());
                grpc_call_cancel(call, NULL);
            }
            last = v;
            next_probe = weft__now_ns() + 300 * 1000000LL;
        }
    }
    if (probe != WEFT_OK) {
        st = weft__set_error(probe, "rendezvous: cannot join the master: %s", probe_why);
        goto out;
    }
    if (code != GRPC_STATUS_OK || reply == NULL) {
        char *d = grpc_slice_to_c_string(details);
        if (code == GRPC_STATUS_DEADLINE_EXCEEDED || code == GRPC_STATUS_UNAVAILABLE) {
            st = weft__set_error(WEFT_ERR_RENDEZVOUS,
                                 "rendezvous: the master at %s did not answer within %lld ms (%s)",
                                 target, (long long)a->rendezvous_timeout_ms, d);
        } else {
            st = weft__set_error(WEFT_ERR_RENDEZVOUS, "rendezvous: join at %s failed: %s (gRPC %d)",
                                 target, d, (int)code);
        }
        gpr_free(d);
        goto out;
    }
    uint8_t *buf;
    size_t len;
    WEFT_CHECK_GOTO(weft__wire_flatten(reply, 64u << 20, &buf, &len), st, out);
    Weft__V1__WorldMap *map = weft__v1__world_map__unpack(&weft__pb_allocator, len, buf);
    weft_free(buf);
    if (map == NULL) {
        st = weft__set_error(WEFT_ERR_PROTOCOL, "rendezvous: the world map from %s does not decode",
                             target);
        goto out;
    }
    if (map->status != 0) {
        st = weft__set_error(weft_status_valid(map->status) ? (weft_status_t)map->status
                                                            : WEFT_ERR_RENDEZVOUS,
                             "rendezvous refused by the master: %s", map->error);
    } else if (map->protocol_version != WEFT_PROTOCOL_VERSION) {
        st = weft__set_error(WEFT_ERR_VERSION, "rendezvous: the master speaks version %u, not %d",
                             map->protocol_version, WEFT_PROTOCOL_VERSION);
    } else if (map->n_workers != (size_t)a->world_size) {
        st = weft__set_error(WEFT_ERR_PROTOCOL, "rendezvous: world map has %zu workers, not %d",
                             map->n_workers, a->world_size);
    } else {
        st = WEFT_OK;
        for (size_t i = 0; i < map->n_workers; i++) {
            if (map->workers[i]->rank != (int32_t)i || map->workers[i]->name == NULL ||
                map->workers[i]->name[0] == '\0' || map->workers[i]->address == NULL ||
                map->workers[i]->address[0] == '\0' ||
                map->workers[i]->identity_key.len != WEFT__ID_KEY_BYTES) {
                st =
                    weft__set_error(WEFT_ERR_PROTOCOL, "rendezvous: world map entry %zu is bad", i);
                break;
            }
        }
        if (st == WEFT_OK) {
            install_world(a, map->workers);
        }
    }
    weft__v1__world_map__free_unpacked(map, &weft__pb_allocator);
out:
    if (reply != NULL) {
        grpc_byte_buffer_destroy(reply);
    }
    grpc_byte_buffer_destroy(bb);
    grpc_metadata_array_destroy(&md_in);
    grpc_metadata_array_destroy(&trailing);
    grpc_slice_unref(details);
    grpc_call_unref(call);
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
    grpc_channel_destroy(ch);
    return st;
}

weft_status_t weft__rendezvous(weft_agent_t *a)
{
    weft_status_t st = a->rank == 0 ? rendezvous_master(a) : rendezvous_join(a);

    if (st == WEFT_OK) {
        WEFT_INFO("joined a world of %d as %s", a->world_size, a->name);
    }
    return st;
}
