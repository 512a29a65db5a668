/* Direct connections for large frames.
 *
 * gRPC's HTTP/2 path costs a user-space copy and framing work on each side,
 * which on a few cores holds a large transfer well under what the socket can
 * do. Frames of WEFT__DIRECT_MIN bytes or more (requests and responses; one-way
 * messages stay on the stream, which keeps their order) go instead over a TCP
 * connection per pair of ranks: written with writev straight from the tensors,
 * read with recv straight into the destination tensors, one kernel copy per
 * side. The frame layout is the stream's (docs/protocol.md). A connection
 * opens with a handshake: magic, version, rank and the job's token. If a peer
 * cannot be reached this way, its frames fall back to the gRPC stream.
 *
 * A channel with a landing callback (collectives) says, from a one-way message's
 * payload, where its tensor goes before it is read: straight into a buffer it
 * posted, or through a small hot buffer into a sink that reduces it as it arrives,
 * with no fresh tensor and no copy after. A sender that asks for it
 * (WEFT_SEND_INLINE) writes on an idle connection itself, without waking the
 * sender thread. */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "internal.h"

#define DIRECT_MAGIC     0x42544657u /* "WFTB" little-endian */
#define DIRECT_VERSION   1u
#define MAX_TOKEN        4096
#define HANDSHAKE_S      10 /* a connection that has not shaken hands by then is dropped */
#define LAND_CHUNK       ((size_t)256 << 10) /* bytes handed to a landing sink at a time */
#define LAND_MAX_PAYLOAD 65536               /* larger payloads do not ask where to land */
#define LOWAT_MIN        ((size_t)64 << 10)  /* reads this large wake less often */
#define LOWAT_MAX        ((size_t)256 << 10)

typedef struct conn_in {
    struct conn_in *next;
    weft_agent_t *agent;
    int fd;
    _Atomic int peer; /* -1 until the handshake (weft__direct_cut reads it) */
    pthread_t thread;
    _Atomic bool done; /* the reader has finished: the acceptor reaps it */
    uint8_t *hot;      /* landing buffer for messages reduced as they arrive (lazily) */
    int lowat;         /* the socket's SO_RCVLOWAT */
} conn_in_t;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int fd;                /* -1 until connected */
    bool started;          /* sender thread running */
    _Atomic bool unusable; /* connect failed: this peer's frames take the stream */
    weft__outmsg_t *qh, *qt;
    pthread_t thread;
    weft_agent_t *agent;
    int peer;
    bool cut;     /* the peer was lost: nothing more goes this way */
    bool writing; /* a frame is being written (by the sender or a caller): one at a time */
} conn_out_t;

struct weft__direct {
    weft_agent_t *agent;
    int listen_fd;
    char *address;
    pthread_t acceptor;
    bool acceptor_started;
    pthread_mutex_t mu;
    conn_in_t *ins;
    conn_out_t *outs; /* world_size entries */
    _Atomic bool stop;
};

/* ------------------------------------------------------------ socket helpers */

static bool write_all(int fd, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    while (n > 0) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) {
            continue;
        }
        if (k <= 0) {
            return false;
        }
        p += k;
        n -= (size_t)k;
    }
    return true;
}

static bool read_all(int fd, void *buf, size_t n)
{
    uint8_t *p = buf;
    while (n > 0) {
        ssize_t k = recv(fd, p, n, MSG_WAITALL);
        if (k < 0 && errno == EINTR) {
            continue;
        }
        if (k <= 0) {
            return false;
        }
        p += k;
        n -= (size_t)k;
    }
    return true;
}

static bool skip_all(int fd, uint64_t n)
{
    uint8_t buf[65536];
    while (n > 0) {
        size_t k = n < sizeof(buf) ? (size_t)n : sizeof(buf);
        if (!read_all(fd, buf, k)) {
            return false;
        }
        n -= k;
    }
    return true;
}

/* Writes a byte buffer's slices with writev, resuming after partial writes. */
static bool write_buffer(int fd, grpc_byte_buffer *bb)
{
    grpc_slice_buffer *sb = &bb->data.raw.slice_buffer;
    size_t i = 0, off = 0;

    while (i < sb->count) {
        struct iovec iov[64];
        int n = 0;
        for (size_t j = i; j < sb->count && n < 64; j++) {
            size_t skip = j == i ? off : 0;
            iov[n].iov_base = GRPC_SLICE_START_PTR(sb->slices[j]) + skip;
            iov[n].iov_len = GRPC_SLICE_LENGTH(sb->slices[j]) - skip;
            n++;
        }
        struct msghdr mh = {0};
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)n;
        ssize_t k = sendmsg(fd, &mh, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) {
            continue;
        }
        if (k <= 0) {
            return false;
        }
        size_t left = (size_t)k;
        while (left > 0 && i < sb->count) {
            size_t avail = GRPC_SLICE_LENGTH(sb->slices[i]) - off;
            if (left >= avail) {
                left -= avail;
                i++;
                off = 0;
            } else {
                off += left;
                left = 0;
            }
        }
        while (i < sb->count && GRPC_SLICE_LENGTH(sb->slices[i]) == 0) {
            i++;
        }
    }
    return true;
}

static void tune(int fd)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

static int connect_to(const char *address)
{
    char host[300];
    snprintf(host, sizeof(host), "%s", address);
    char *colon = strrchr(host, ':');
    if (colon == NULL) {
        return -1;
    }
    *colon = '\0';
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, colon + 1, &hints, &res) != 0) {
        return -1;
    }
    int fd = -1;
    for (struct addrinfo *ai = res; ai != NULL; ai = ai->ai_next) {
        fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            continue;
        }
        /* A bounded connect (and handshake); writes have no timeout after it. */
        struct timeval tv = {10, 0};
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
            break;
        }
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd >= 0) {
        tune(fd);
    }
    return fd;
}

/* ------------------------------------------------------------ sending */

static void put_u32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static uint32_t get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Connects and shakes hands; -1 on failure. */
static int open_out(weft_agent_t *a, int peer)
{
    const char *addr = a->peers[peer].direct_address;
    if (addr == NULL || addr[0] == '\0') {
        return -1;
    }
    int fd = connect_to(addr);
    if (fd < 0) {
        return -1;
    }
    size_t tlen = strlen(a->auth_token);
    uint8_t hdr[20];
    put_u32(hdr, DIRECT_MAGIC);
    put_u32(hdr + 4, DIRECT_VERSION);
    put_u32(hdr + 8, (uint32_t)a->rank);
    put_u32(hdr + 12, (uint32_t)a->world_size);
    put_u32(hdr + 16, (uint32_t)tlen);
    uint8_t ok = 1;
    if (!write_all(fd, hdr, sizeof(hdr)) || !write_all(fd, a->auth_token, tlen) ||
        !read_all(fd, &ok, 1) || ok != 0) {
        WEFT_WARN("direct connection to rank %d at %s refused; using the stream", peer, addr);
        close(fd);
        return -1;
    }
    struct timeval none = {0, 0};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &none, sizeof(none));
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof(none));
    return fd;
}

/* Sends @p m over the peer's stream instead (fallback). */
static void send_on_stream(weft_agent_t *a, int peer, weft__outmsg_t *m)
{
    weft__stream_t *s;
    if (weft__peer_stream(a, peer, &s) != WEFT_OK) {
        weft__outmsg_free(m, WEFT_ERR_PEER_LOST, weft_last_error());
        return;
    }
    (void)weft__stream_send(s, m);
    weft__stream_unref(s);
}

/* Writes @p m on the connection (the caller holds c->writing) and settles it. */
static void write_out(conn_out_t *c, int fd, weft__outmsg_t *m)
{
    weft_agent_t *a = c->agent;

    if (write_buffer(fd, m->bb)) {
        weft__outmsg_free(m, WEFT_OK, NULL);
        return;
    }
    char why[300];
    snprintf(why, sizeof(why), "direct connection to %s (rank %d) broke while sending",
             a->peers[c->peer].name != NULL ? a->peers[c->peer].name : "?", c->peer);
    if (m->user_request) {
        /* Never delivered: uncount it, or shutdown's counters cannot agree. */
        atomic_fetch_sub(&a->requests_sent, 1);
    }
    weft__outmsg_free(m, WEFT_ERR_PEER_LOST, why);
    if (!weft__agent_closing(a)) {
        weft__agent_peer_lost(a, c->peer, WEFT_ERR_PEER_LOST, why);
    }
}

static void *sender_main(void *arg)
{
    conn_out_t *c = arg;
    weft_agent_t *a = c->agent;
    weft__direct_t *d = a->direct;

    pthread_mutex_lock(&c->mu);
    for (;;) {
        while ((c->qh == NULL || c->writing) && !atomic_load(&d->stop)) {
            pthread_cond_wait(&c->cv, &c->mu);
        }
        weft__outmsg_t *m = c->qh;
        if (m == NULL) {
            break;
        }
        c->qh = m->next;
        if (c->qh == NULL) {
            c->qt = NULL;
        }
        m->next = NULL;
        if (atomic_load(&d->stop) || c->cut) {
            pthread_mutex_unlock(&c->mu);
            weft__outmsg_free(m, WEFT_ERR_PEER_LOST, "direct connection closed");
            pthread_mutex_lock(&c->mu);
            continue;
        }
        if (c->fd < 0 && !atomic_load(&c->unusable)) {
            pthread_mutex_unlock(&c->mu);
            int fd = open_out(a, c->peer);
            pthread_mutex_lock(&c->mu);
            if (fd >= 0 && (atomic_load(&d->stop) || c->cut)) {
                /* Closed or cut while we connected. */
                close(fd);
                fd = -1;
                pthread_mutex_unlock(&c->mu);
                weft__outmsg_free(m, WEFT_ERR_PEER_LOST, "direct connection closed");
                pthread_mutex_lock(&c->mu);
                continue;
            }
            c->fd = fd;
            atomic_store(&c->unusable, fd < 0);
        }
        int fd = c->fd;
        bool unusable = atomic_load(&c->unusable);
        c->writing = !unusable;
        pthread_mutex_unlock(&c->mu);
        if (unusable) {
            send_on_stream(a, c->peer, m);
        } else {
            write_out(c, fd, m);
        }
        pthread_mutex_lock(&c->mu);
        c->writing = false;
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

bool weft__direct_usable(weft_agent_t *a, int peer, size_t nbytes)
{
    return nbytes >= WEFT__DIRECT_MIN && weft__direct_available(a, peer);
}

void weft__direct_cut(weft_agent_t *a, int peer)
{
    weft__direct_t *d = a->direct;
    if (d == NULL || peer < 0 || peer >= a->world_size) {
        return;
    }
    conn_out_t *c = &d->outs[peer];
    pthread_mutex_lock(&c->mu);
    c->cut = true;
    if (c->fd >= 0) {
        shutdown(c->fd, SHUT_RDWR); /* a send blocked on the lost peer returns */
    }
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    /* And what comes from it: a reader blocked mid-frame on the lost peer returns (a
     * message landing in place must not hold its destination forever). */
    pthread_mutex_lock(&d->mu);
    for (conn_in_t *in = d->ins; in != NULL; in = in->next) {
        if (atomic_load(&in->peer) == peer && !atomic_load(&in->done)) {
            shutdown(in->fd, SHUT_RDWR);
        }
    }
    pthread_mutex_unlock(&d->mu);
}

bool weft__direct_available(weft_agent_t *a, int peer)
{
    weft__direct_t *d = a->direct;
    if (d == NULL || atomic_load(&d->stop) || peer < 0 || peer >= a->world_size) {
        return false;
    }
    const char *addr = a->peers[peer].direct_address;
    return addr != NULL && addr[0] != '\0' && !atomic_load(&d->outs[peer].unusable) &&
           !d->outs[peer].cut;
}

weft_status_t weft__direct_send(weft_agent_t *a, int peer, weft__outmsg_t *m)
{
    return weft__direct_send_ex(a, peer, m, false);
}

weft_status_t weft__direct_send_ex(weft_agent_t *a, int peer, weft__outmsg_t *m, bool write_here)
{
    weft__direct_t *d = a->direct;
    conn_out_t *c = &d->outs[peer];

    /* Keep a stream to the peer open: its keepalive watches the peer's health. */
    weft__stream_t *s;
    weft_status_t st = weft__peer_stream(a, peer, &s);
    if (st != WEFT_OK) {
        weft__outmsg_free(m, st, weft_last_error());
        return st;
    }
    weft__stream_unref(s);
    pthread_mutex_lock(&c->mu);
    if (atomic_load(&d->stop) || c->cut) {
        bool stopped = atomic_load(&d->stop);
        pthread_mutex_unlock(&c->mu);
        weft__outmsg_free(m, stopped ? WEFT_ERR_SHUTDOWN : WEFT_ERR_PEER_LOST,
                          stopped ? "agent closed" : "peer lost");
        return stopped ? weft__set_error(WEFT_ERR_SHUTDOWN, "rpc: the agent is closed")
                       : weft__set_error(WEFT_ERR_PEER_LOST, "rpc: rank %d was lost", peer);
    }
    if (write_here && c->fd >= 0 && !atomic_load(&c->unusable) && !c->writing && c->qh == NULL) {
        /* The connection is idle: write it from this thread, without waking the sender. */
        int fd = c->fd;
        c->writing = true;
        pthread_mutex_unlock(&c->mu);
        write_out(c, fd, m);
        pthread_mutex_lock(&c->mu);
        c->writing = false;
        pthread_cond_broadcast(&c->cv); /* the sender, or weft__direct_stop, may wait */
        pthread_mutex_unlock(&c->mu);
        return WEFT_OK;
    }
    if (!c->started) {
        if (pthread_create(&c->thread, NULL, sender_main, c) != 0) {
            pthread_mutex_unlock(&c->mu);
            send_on_stream(a, peer, m);
            return WEFT_OK;
        }
        c->started = true;
    }
    if (c->qt == NULL) {
        c->qh = c->qt = m;
    } else {
        c->qt->next = m;
        c->qt = m;
    }
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return WEFT_OK;
}

/* ------------------------------------------------------------ receiving */

typedef struct {
    weft_agent_t *agent;
    int peer;
    Weft__V1__Envelope *env;
    weft_value_t *args;
} dispatch_t;

static void dispatch_run(void *arg)
{
    dispatch_t *t = arg;
    if (t->env->kind == WEFT__V1__KIND__KIND_RESPONSE) {
        weft__call_response(t->agent, t->peer, t->env, t->args);
    } else {
        weft__call_dispatch_from(t->agent, NULL, t->peer, t->env, t->args);
    }
    weft_free(t);
}

/* Answers a request that could not be accepted, over the stream back to the caller. */
static void refuse(weft_agent_t *a, int peer, const Weft__V1__Envelope *env, weft_status_t st)
{
    Weft__V1__Envelope resp = WEFT__V1__ENVELOPE__INIT;
    char why[600];
    weft__outmsg_t *m;

    if (env->function == NULL || !weft__fn_internal(env->function)) {
        atomic_fetch_add(&a->requests_received, 1);
    }
    snprintf(why, sizeof(why), "%s (on %s)", weft_last_error(), a->name);
    resp.kind = WEFT__V1__KIND__KIND_RESPONSE;
    resp.request_id = env->request_id;
    resp.src_rank = a->rank;
    resp.status = st;
    resp.error = why;
    if (weft__wire_encode(&resp, NULL, &m) == WEFT_OK) {
        send_on_stream(a, peer, m);
    }
}

/* Sets the socket's receive low-water mark (cached). */
static void set_lowat(conn_in_t *c, int v)
{
    if (c->lowat != v && setsockopt(c->fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof(v)) == 0) {
        c->lowat = v;
    }
}

/* read_all for a frame's body. A reader blocked in recv is woken for every segment
 * that arrives (64 KiB on loopback), and those wake-ups cost more than the copying;
 * so it waits in poll until LOWAT_MAX bytes (or all that is left of the body, which
 * must come) are there, then takes what is there without blocking. (A blocking recv
 * cannot be given a low-water mark: it sleeps with part of it copied, and the kernel
 * wakes it only when the mark is reached again, which the tail may never do.) */
static bool read_body(conn_in_t *c, void *buf, size_t n)
{
    uint8_t *p = buf;
    if (n < LOWAT_MIN) {
        return read_all(c->fd, buf, n);
    }
    while (n > 0) {
        set_lowat(c, (int)(n < LOWAT_MAX ? n : LOWAT_MAX));
        ssize_t k = recv(c->fd, p, n, MSG_DONTWAIT);
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            struct pollfd pfd = {c->fd, POLLIN, 0};
            if (poll(&pfd, 1, -1) < 0 && errno != EINTR) {
                return false;
            }
            continue;
        }
        if (k <= 0) {
            return false;
        }
        p += k;
        n -= (size_t)k;
    }
    return true;
}

/* Reads @p n bytes into a landing; false when the connection broke. */
static bool land_bytes(conn_in_t *c, const weft_landing_t *l, uint64_t n)
{
    if (l->sink == NULL) {
        return read_body(c, l->dst, (size_t)n);
    }
    if (c->hot == NULL) {
        c->hot = weft_alloc(LAND_CHUNK);
    }
    uint8_t small[16384];
    uint8_t *buf = c->hot != NULL ? c->hot : small;
    size_t cap = c->hot != NULL ? LAND_CHUNK : sizeof(small);
    for (uint64_t off = 0; off < n;) {
        size_t k = n - off < cap ? (size_t)(n - off) : cap;
        if (!read_body(c, buf, k)) {
            return false;
        }
        l->sink(l->arg, (size_t)off, buf, k);
        off += k;
    }
    return true;
}

/* A one-way message with one tensor, on a channel that may say where it lands: its
 * payload first, then the tensor's bytes, in place or into a fresh tensor. The
 * envelope is consumed; false when the connection is over or broken. */
static bool read_landing(conn_in_t *c, Weft__V1__Envelope *env, const weft__module_t *mod,
                         uint64_t body)
{
    weft_agent_t *a = c->agent;
    const Weft__V1__TensorMeta *tm = env->tensors[0];
    uint64_t nb = body - env->payload_bytes;
    uint32_t ch = env->channel;
    weft_value_t *v = NULL;
    uint8_t *pl = weft_alloc(env->payload_bytes);
    bool ok;

    if (pl == NULL || weft_value_create(&v) != WEFT_OK) {
        weft_free(pl);
        weft_value_free(v);
        weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
        return skip_all(c->fd, body);
    }
    if (!read_all(c->fd, pl, env->payload_bytes)) {
        ok = false;
        goto out;
    }
    int64_t numel = 1;
    for (size_t i = 0; i < tm->n_shape; i++) {
        numel *= tm->shape[i];
    }
    weft_landing_t l = {0};
    bool deliver = true;
    if (mod->desc.lander(mod->state, c->peer, pl, env->payload_bytes, (weft_dtype_t)tm->dtype,
                         numel, &l)) {
        ok = land_bytes(c, &l, nb);
        l.done(l.arg, ok);
    } else {
        weft_tensor_t *t = NULL;
        if (weft_tensor_empty((weft_dtype_t)tm->dtype, (int)tm->n_shape, tm->shape, &t) !=
                WEFT_OK ||
            weft_value_push_tensor(v, t) != WEFT_OK) {
            /* No memory: the message is dropped, the connection stays framed. */
            weft_tensor_release(t);
            WEFT_WARN("direct connection from rank %d: no memory for a message; dropped",
                      (int)c->peer);
            ok = skip_all(c->fd, nb);
            deliver = false;
        } else {
            ok = read_body(c, weft_tensor_data(t), (size_t)nb);
        }
    }
    if (ok && deliver && weft_value_take_payload(v, pl, env->payload_bytes) == WEFT_OK) {
        pl = NULL;
        weft__channel_deliver(a, ch, c->peer, v);
        v = NULL;
    }
out:
    weft_free(pl);
    weft_value_free(v);
    weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
    return ok;
}

/* Reads one frame; false when the connection is over or broken. */
static bool read_frame(conn_in_t *c)
{
    weft_agent_t *a = c->agent;
    uint8_t lenb[4];

    set_lowat(c, 1); /* the next frame may be small */
    if (!read_all(c->fd, lenb, 4)) {
        return false;
    }
    uint32_t elen = get_u32(lenb);
    if (elen > WEFT__MAX_ENVELOPE) {
        WEFT_WARN("direct connection from rank %d: envelope of %u bytes; closing", c->peer, elen);
        return false;
    }
    uint8_t *ebuf = weft_alloc(elen == 0 ? 1 : elen);
    if (ebuf == NULL || !read_all(c->fd, ebuf, elen)) {
        weft_free(ebuf);
        return false;
    }
    Weft__V1__Envelope *env = weft__v1__envelope__unpack(&weft__pb_allocator, elen, ebuf);
    weft_free(ebuf);
    if (env == NULL) {
        WEFT_WARN("direct connection from rank %d: envelope does not decode; closing", c->peer);
        return false;
    }
    uint64_t body = 0;
    weft_status_t st = weft__wire_check_frame(env, &body);
    if (st != WEFT_OK) {
        /* The lengths cannot be trusted: the connection cannot be framed any more. */
        WEFT_WARN("direct connection from rank %d: %s; closing", c->peer, weft_last_error());
        if (env->kind == WEFT__V1__KIND__KIND_REQUEST) {
            refuse(a, c->peer, env, st);
        }
        weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
        return false;
    }
    if (a->max_message_bytes > 0 && 4 + (uint64_t)elen + body > a->max_message_bytes) {
        st = weft__set_error(
            WEFT_ERR_TOO_LARGE, "wire: message of %llu bytes exceeds the limit of %llu bytes",
            (unsigned long long)(4 + elen + body), (unsigned long long)a->max_message_bytes);
        bool ok = skip_all(c->fd, body);
        if (env->kind == WEFT__V1__KIND__KIND_REQUEST) {
            refuse(a, c->peer, env, st);
        } else if (env->kind == WEFT__V1__KIND__KIND_RESPONSE) {
            weft__pending_fail_id(a, c->peer, env->request_id, st, weft_last_error());
        }
        weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
        return ok;
    }
    if (env->kind == WEFT__V1__KIND__KIND_ONEWAY && env->n_tensors == 1 && env->payload_bytes > 0 &&
        env->payload_bytes <= LAND_MAX_PAYLOAD && env->channel >= 1 &&
        env->channel <= WEFT_CHANNEL_MAX) {
        const weft__module_t *mod = weft__module_at(a, env->channel);
        if (mod != NULL && mod->desc.lander != NULL) {
            return read_landing(c, env, mod, body);
        }
    }
    /* The body, straight into its destinations: allocate them all first, so that a
     * failure to allocate leaves the connection framed (the body is skipped). */
    weft_value_t *v = NULL;
    void *pl = NULL;
    weft_status_t ast = weft_value_create(&v);
    if (ast == WEFT_OK && env->payload_bytes > 0) {
        pl = weft_alloc(env->payload_bytes);
        if (pl == NULL) {
            ast = weft__set_error(WEFT_ERR_NO_MEMORY, "no memory for a %llu-byte payload",
                                  (unsigned long long)env->payload_bytes);
        }
    }
    for (size_t i = 0; ast == WEFT_OK && i < env->n_tensors; i++) {
        const Weft__V1__TensorMeta *tm = env->tensors[i];
        weft_tensor_t *t;
        ast = weft_tensor_empty((weft_dtype_t)tm->dtype, (int)tm->n_shape, tm->shape, &t);
        if (ast == WEFT_OK && weft_value_push_tensor(v, t) != WEFT_OK) {
            weft_tensor_release(t);
            ast = weft__set_error(WEFT_ERR_NO_MEMORY, "no memory");
        }
    }
    if (ast != WEFT_OK) {
        weft_free(pl);
        weft_value_free(v);
        bool framed = skip_all(c->fd, body);
        if (env->kind == WEFT__V1__KIND__KIND_REQUEST) {
            refuse(a, c->peer, env, ast);
        } else if (env->kind == WEFT__V1__KIND__KIND_RESPONSE) {
            weft__pending_fail_id(a, c->peer, env->request_id, ast, weft_last_error());
        }
        weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
        return framed;
    }
    bool ok = true;
    if (pl != NULL) {
        ok = read_all(c->fd, pl, env->payload_bytes);
        if (weft_value_take_payload(v, pl, env->payload_bytes) != WEFT_OK) {
            weft_free(pl);
        }
    }
    for (size_t i = 0; ok && i < env->n_tensors; i++) {
        weft_tensor_t *t = weft_value_tensor(v, i);
        ok = read_body(c, weft_tensor_data(t), env->tensors[i]->nbytes);
    }
    if (!ok) {
        /* The connection broke mid-frame: the peer is going away. Keep the shutdown
         * counters whole: the sender counted this request. */
        if (env->kind == WEFT__V1__KIND__KIND_REQUEST &&
            (env->function == NULL || !weft__fn_internal(env->function))) {
            atomic_fetch_add(&a->requests_received, 1);
        }
        weft_value_free(v);
        weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
        return false;
    }
    if (env->kind == WEFT__V1__KIND__KIND_ONEWAY) {
        /* An unordered one-way message: straight to its channel (callbacks are quick). */
        if (env->channel >= 1 && env->channel <= WEFT_CHANNEL_MAX) {
            weft__channel_deliver(a, env->channel, c->peer, v);
        } else {
            weft_value_free(v);
        }
        weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
        return true;
    }
    if (env->kind != WEFT__V1__KIND__KIND_REQUEST && env->kind != WEFT__V1__KIND__KIND_RESPONSE) {
        WEFT_WARN("direct connection from rank %d: frame of kind %d ignored", c->peer,
                  (int)env->kind);
        weft_value_free(v);
        weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
        return true;
    }
    /* Handlers and completions (whose callbacks may make calls of their own) run on
     * the bulk queue: this thread goes back to the socket. */
    dispatch_t *t = weft_alloc(sizeof(*t));
    if (t != NULL) {
        t->agent = a;
        t->peer = c->peer;
        t->env = env;
        t->args = v;
        if (a->bulk != NULL && weft__bulk_submit(a->bulk, dispatch_run, t) == WEFT_OK) {
            return true;
        }
        weft_free(t);
    }
    if (env->kind == WEFT__V1__KIND__KIND_RESPONSE) {
        weft__call_response(a, c->peer, env, v);
    } else {
        weft__call_dispatch_from(a, NULL, c->peer, env, v);
    }
    return true;
}

static bool handshake_in(conn_in_t *c)
{
    weft_agent_t *a = c->agent;
    uint8_t hdr[20];
    uint8_t status = 1;

    /* Bounded: a connection that says nothing is dropped. */
    struct timeval tv = {HANDSHAKE_S, 0};
    setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    if (!read_all(c->fd, hdr, sizeof(hdr))) {
        return false;
    }
    uint32_t magic = get_u32(hdr), version = get_u32(hdr + 4), tlen = get_u32(hdr + 16);
    int rank = (int)get_u32(hdr + 8);
    int world = (int)get_u32(hdr + 12);
    if (magic != DIRECT_MAGIC || version != DIRECT_VERSION || tlen > MAX_TOKEN || rank < 0 ||
        rank >= a->world_size || world != a->world_size) {
        WEFT_WARN("refused a direct connection: bad handshake (magic %08x version %u rank %d)",
                  magic, version, rank);
        (void)write_all(c->fd, &status, 1);
        return false;
    }
    char token[MAX_TOKEN + 1];
    if (!read_all(c->fd, token, tlen)) {
        return false;
    }
    token[tlen] = '\0';
    if (a->auth_token[0] != '\0' && strcmp(token, a->auth_token) != 0) {
        WEFT_WARN("refused a direct connection from rank %d: wrong token", rank);
        (void)write_all(c->fd, &status, 1);
        return false;
    }
    status = 0;
    c->peer = rank;
    struct timeval none = {0, 0};
    setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof(none));
    return write_all(c->fd, &status, 1);
}

static void *reader_main(void *arg)
{
    conn_in_t *c = arg;

    if (handshake_in(c)) {
        while (!atomic_load(&c->agent->direct->stop) && read_frame(c)) {
        }
    }
    shutdown(c->fd, SHUT_RDWR);
    atomic_store(&c->done, true);
    return NULL;
}

/* Joins and frees the readers that have finished. Called with d->mu held. */
static int reap_locked(weft__direct_t *d)
{
    int live = 0;
    conn_in_t **pp = &d->ins;
    while (*pp != NULL) {
        conn_in_t *c = *pp;
        if (atomic_load(&c->done)) {
            *pp = c->next;
            pthread_join(c->thread, NULL);
            close(c->fd);
            weft_free(c->hot);
            weft_free(c);
        } else {
            live++;
            pp = &c->next;
        }
    }
    return live;
}

static void *acceptor_main(void *arg)
{
    weft__direct_t *d = arg;

    while (!atomic_load(&d->stop)) {
        struct pollfd pfd = {d->listen_fd, POLLIN, 0};
        int r = poll(&pfd, 1, 100);
        if (r <= 0) {
            continue;
        }
        int fd = accept4(d->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOMEM || errno == ENOBUFS) {
                usleep(100 * 1000); /* out of descriptors: do not spin on the backlog */
            }
            continue;
        }
        pthread_mutex_lock(&d->mu);
        int live = reap_locked(d);
        pthread_mutex_unlock(&d->mu);
        if (live >= 4 * d->agent->world_size + 16) {
            WEFT_WARN("direct: %d connections open already; refusing another", live);
            close(fd);
            continue;
        }
        tune(fd);
        conn_in_t *c = weft_calloc(1, sizeof(*c));
        if (c == NULL) {
            close(fd);
            continue;
        }
        c->agent = d->agent;
        c->fd = fd;
        c->peer = -1;
        c->lowat = 1;
        pthread_mutex_lock(&d->mu);
        if (atomic_load(&d->stop) || pthread_create(&c->thread, NULL, reader_main, c) != 0) {
            pthread_mutex_unlock(&d->mu);
            close(fd);
            weft_free(c);
            continue;
        }
        c->next = d->ins;
        d->ins = c;
        pthread_mutex_unlock(&d->mu);
    }
    return NULL;
}

/* ------------------------------------------------------------ lifecycle */

weft_status_t weft__direct_create(weft_agent_t *a, const char *bind_host, const char *adv_host)
{
    const char *env = getenv("WEFT_DIRECT");
    if (env != NULL && strcmp(env, "0") == 0) {
        return WEFT_OK; /* frames of every size take the stream */
    }
    weft__direct_t *d = weft_calloc(1, sizeof(*d));
    if (d == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "direct: no memory");
    }
    d->agent = a;
    d->listen_fd = -1;
    pthread_mutex_init(&d->mu, NULL);
    d->outs = weft_calloc((size_t)a->world_size, sizeof(*d->outs));
    if (d->outs == NULL) {
        goto err_free;
    }
    for (int i = 0; i < a->world_size; i++) {
        pthread_mutex_init(&d->outs[i].mu, NULL);
        pthread_cond_init(&d->outs[i].cv, NULL);
        d->outs[i].fd = -1;
        d->outs[i].agent = a;
        d->outs[i].peer = i;
    }
    struct sockaddr_in sa = {0};
    sa.sin_family = AF_INET;
    sa.sin_port = 0;
    if (strcmp(bind_host, "localhost") == 0 || strcmp(bind_host, "::1") == 0 ||
        strcmp(bind_host, "[::1]") == 0) {
        bind_host = "127.0.0.1"; /* loopback stays loopback */
    }
    if (inet_pton(AF_INET, bind_host, &sa.sin_addr) != 1) {
        sa.sin_addr.s_addr = htonl(INADDR_ANY); /* a host name: listen as gRPC does */
    }
    d->listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    socklen_t sl = sizeof(sa);
    if (d->listen_fd < 0 || bind(d->listen_fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
        listen(d->listen_fd, 64) != 0 ||
        getsockname(d->listen_fd, (struct sockaddr *)&sa, &sl) != 0) {
        WEFT_WARN("direct: cannot listen (%s); large frames take the stream", strerror(errno));
        goto err_free;
    }
    char addr[400];
    snprintf(addr, sizeof(addr), "%s:%d", adv_host, (int)ntohs(sa.sin_port));
    d->address = weft_strdup(addr);
    a->direct = d;
    if (pthread_create(&d->acceptor, NULL, acceptor_main, d) != 0) {
        a->direct = NULL;
        goto err_free;
    }
    d->acceptor_started = true;
    return WEFT_OK;

err_free:
    if (d->listen_fd >= 0) {
        close(d->listen_fd);
    }
    if (d->outs != NULL) {
        for (int i = 0; i < a->world_size; i++) {
            pthread_mutex_destroy(&d->outs[i].mu);
            pthread_cond_destroy(&d->outs[i].cv);
        }
    }
    weft_free(d->outs);
    weft_free(d->address);
    pthread_mutex_destroy(&d->mu);
    weft_free(d);
    return WEFT_OK; /* not fatal: the stream carries everything */
}

const char *weft__direct_address(const weft_agent_t *a)
{
    return a->direct != NULL ? a->direct->address : "";
}

void weft__direct_stop(weft_agent_t *a)
{
    weft__direct_t *d = a->direct;
    if (d == NULL) {
        return;
    }
    atomic_store(&d->stop, true);
    if (d->acceptor_started) {
        pthread_join(d->acceptor, NULL);
        d->acceptor_started = false;
    }
    /* Senders fail what is left (a quiet world has nothing queued) and exit; a send
     * blocked on a stalled peer is cut. */
    for (int i = 0; i < a->world_size; i++) {
        conn_out_t *c = &d->outs[i];
        pthread_mutex_lock(&c->mu);
        bool started = c->started;
        c->started = false;
        if (c->fd >= 0) {
            shutdown(c->fd, SHUT_RDWR);
        }
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        if (started) {
            pthread_join(c->thread, NULL);
        }
        /* A caller writing inline (weft__direct_send_ex) finishes first: its socket was
         * shut down above, so it does not take long. */
        pthread_mutex_lock(&c->mu);
        while (c->writing) {
            pthread_cond_wait(&c->cv, &c->mu);
        }
        pthread_mutex_unlock(&c->mu);
        if (c->fd >= 0) {
            close(c->fd);
            c->fd = -1;
        }
    }
    /* Readers are blocked in recv: cut their sockets, then join. */
    pthread_mutex_lock(&d->mu);
    conn_in_t *ins = d->ins;
    d->ins = NULL;
    pthread_mutex_unlock(&d->mu);
    for (conn_in_t *c = ins; c != NULL; c = c->next) {
        shutdown(c->fd, SHUT_RDWR);
    }
    while (ins != NULL) {
        conn_in_t *next = ins->next;
        pthread_join(ins->thread, NULL);
        close(ins->fd);
        weft_free(ins->hot);
        weft_free(ins);
        ins = next;
    }
    if (d->listen_fd >= 0) {
        close(d->listen_fd);
        d->listen_fd = -1;
    }
}

void weft__direct_destroy(weft_agent_t *a)
{
    weft__direct_t *d = a->direct;
    if (d == NULL) {
        return;
    }
    weft__direct_stop(a);
    for (int i = 0; i < a->world_size; i++) {
        pthread_mutex_destroy(&d->outs[i].mu);
        pthread_cond_destroy(&d->outs[i].cv);
    }
    weft_free(d->outs);
    weft_free(d->address);
    pthread_mutex_destroy(&d->mu);
    weft_free(d);
    a->direct = NULL;
}
