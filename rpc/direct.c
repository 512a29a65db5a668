/* The direct transport: TCP connections for large frames.
 *
 * gRPC's HTTP/2 path costs a user-space copy and framing work on each side, which on a few cores
 * holds a large transfer well under what the socket can do. The route sends large frames here
 * instead (see weft__route): one TCP connection per ordered pair of ranks, written with writev
 * straight from the tensors, read with recv straight into the destination tensors, one kernel
 * copy per side. The frame layout is the stream's (docs/protocol.md section 5).
 *
 * Opening (docs/protocol.md section 4): the acceptor sends its challenge; the connecting rank
 * answers with a Hello that proves its rank (weft__hello_check), within one deadline for the
 * whole handshake; the acceptor answers with a status. One connection per ordered pair: a second
 * one claiming a rank already connected is refused. A peer that cannot be reached this way gets
 * its frames on the stream (weft__route_fallback).
 *
 * Reading: a frame's envelope is checked before its body is read (weft__frame_check); a frame
 * over this rank's limit is refused at once and its connection closed (its bytes are never
 * waited for); a refused frame whose sizes can be trusted is skipped and the next one read; a
 * tensor's memory is taken as its bytes arrive, not when its size is announced.
 *
 * A module with a lander (collectives) says, from a one-way message's payload, where its tensor
 * goes before it is read: straight into a buffer it posted, or through a small hot buffer into a
 * sink that reduces it as it arrives. A sender that asks for it (WEFT_SEND_INLINE) writes on an
 * idle connection itself, without waking the sender thread.
 *
 * With TLS on (tls.c), a connection is TLS from its first byte: the TLS handshake (both
 * certificates verified, the acceptor's naming the rank connected to, the connecting rank's the
 * rank its Hello claims), then the handshake above inside it. Never plaintext then. */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <openssl/ssl.h>

#include "internal.h"

#define DIRECT_MAGIC     0x42544657u /* "WFTB" little-endian */
#define DIRECT_VERSION   3u
#define MAX_HELLO        (64u << 10)
#define LAND_CHUNK       ((size_t)256 << 10) /* bytes handed to a landing sink at a time */
#define LAND_MAX_PAYLOAD 65536               /* larger payloads do not ask where to land */
#define GROW_MIN         ((size_t)64 << 20) /* tensors this large grow as their bytes arrive */

typedef struct conn_in {
    struct conn_in *next;
    weft_agent_t *agent;
    int fd;
    SSL *ssl;           /* TLS on: the session on fd, during the handshake */
    weft__seal_t *seal; /* TLS on: the records after it (seal.c) */
    _Atomic int peer;   /* -1 until the handshake */
    pthread_t thread;
    _Atomic bool done; /* the reader has finished: the acceptor reaps it */
    uint8_t *hot;      /* landing buffer for messages reduced as they arrive (lazily) */
    int lowat;         /* the socket's SO_RCVLOWAT */
} conn_in_t;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int fd;                   /* -1 until connected */
    weft__seal_t *seal;       /* TLS on: the records on fd (seal.c) */
    bool started;             /* sender thread running */
    _Atomic bool unusable;    /* the last connect failed: this peer's frames take the stream */
    _Atomic int64_t retry_ns; /* while unusable: when to try connecting again */
    int fails;                /* connects failed in a row (the wait before the next doubles) */
    weft__outmsg_t *qh, *qt;
    pthread_t thread;
    weft_agent_t *agent;
    int peer;
    bool cut;     /* the peer was lost: nothing more goes this way */
    bool writing; /* a frame is being written (by the sender or a caller): one at a time */
    bool warm;    /* asked to connect ahead of the frames (weft__direct_ready) */
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
    int64_t fault_silent_ms; /* WEFT_DIRECT_FAULT_SILENT_MS */
};

/* ------------------------------------------------------------ socket helpers */

/* A failed SSL_read or SSL_write that a signal interrupted: the same call goes again. */
static bool ssl_interrupted(SSL *ssl, int k)
{
    int e = SSL_get_error(ssl, k);
    return (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) && errno == EINTR;
}

static bool ssl_write_all(SSL *ssl, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    while (n > 0) {
        int k = SSL_write(ssl, p, n > (1u << 30) ? (1 << 30) : (int)n);
        if (k <= 0 && ssl_interrupted(ssl, k)) {
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

static bool io_write(int fd, SSL *ssl, const void *buf, size_t n)
{
    if (ssl == NULL) {
        return weft__send_all(fd, buf, n);
    }
    weft__nopipe_t np;
    weft__nopipe_begin(&np);
    bool ok = ssl_write_all(ssl, buf, n);
    weft__nopipe_end(&np, !ok);
    return ok;
}

/* Frees a connection's TLS session or its sealed records and closes its socket. */
static void conn_close(int fd, SSL *ssl, weft__seal_t *seal)
{
    SSL_free(ssl);
    weft__seal_free(seal);
    close(fd);
}

/* A blocking read of exactly @p n bytes: sealed records under TLS, else the socket's bytes
 * (large reads wait on the low-water mark, small ones set it back to 1 first: a mark left from a
 * large body would leave the last bytes of a stream unread; weft__recv_exact). */
static bool read_all(conn_in_t *c, void *buf, size_t n)
{
    if (c->seal != NULL) {
        return weft__seal_read(c->seal, c->fd, buf, n);
    }
    return weft__recv_exact(c->fd, buf, n, &c->lowat);
}

/* read_all that gives up at @p deadline_ns (one deadline for a whole exchange, however the bytes
 * trickle in: under TLS too, where one record may come a byte at a time). */
static bool read_until(int fd, SSL *ssl, void *buf, size_t n, int64_t deadline_ns)
{
    uint8_t *p = buf;
    if (ssl != NULL) {
        return weft__tls_read_until(ssl, fd, buf, n, deadline_ns);
    }
    while (n > 0) {
        int64_t left_ms = (deadline_ns - weft__now_ns()) / 1000000;
        if (left_ms <= 0) {
            return false;
        }
        struct pollfd pfd = {fd, POLLIN, 0};
        int r = poll(&pfd, 1, (int)(left_ms < 1000 ? left_ms : 1000));
        if (r < 0 && errno != EINTR) {
            return false;
        }
        if (r <= 0) {
            continue;
        }
        ssize_t k = recv(fd, p, n, MSG_DONTWAIT);
        if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) {
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

static bool skip_all(conn_in_t *c, uint64_t n)
{
    uint8_t buf[65536];
    while (n > 0) {
        size_t k = n < sizeof(buf) ? (size_t)n : sizeof(buf);
        if (!read_all(c, buf, k)) {
            return false;
        }
        n -= k;
    }
    return true;
}

/* TLS: a byte buffer's slices sealed as they are (a frame's small slices share one record),
 * its last record sent at its end. (A large slice is not given records of its own, which would
 * spare the reader copying the first one out of its buffer: measured, that was slower.) */
static bool write_buffer_sealed(int fd, weft__seal_t *seal, grpc_byte_buffer *bb)
{
    grpc_slice_buffer *sb = &bb->data.raw.slice_buffer;
    bool ok = true;
    for (size_t i = 0; ok && i < sb->count; i++) {
        ok = weft__seal_write(seal, fd, GRPC_SLICE_START_PTR(sb->slices[i]),
                              GRPC_SLICE_LENGTH(sb->slices[i]));
    }
    return ok && weft__seal_flush(seal, fd);
}

/* Writes a byte buffer's slices with writev, resuming after partial writes. */
static bool write_buffer(int fd, weft__seal_t *seal, grpc_byte_buffer *bb)
{
    grpc_slice_buffer *sb = &bb->data.raw.slice_buffer;
    size_t i = 0, off = 0;

    if (seal != NULL) {
        return write_buffer_sealed(fd, seal, bb);
    }

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

static int connect_to(const char *address, int64_t deadline_ns)
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
        /* A bounded connect; the handshake has its own deadline; writes none after it. */
        int64_t left_ms = (deadline_ns - weft__now_ns()) / 1000000;
        struct timeval tv = {left_ms > 0 ? left_ms / 1000 : 0,
                             left_ms > 0 ? (left_ms % 1000) * 1000 : 1000};
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
            struct timeval none = {0, 0};
            setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &none, sizeof(none));
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

/* ------------------------------------------------------------ opening */

/* Connects to @p peer and proves this rank; -1 on failure (logged). *seal_p: the sealed records
 * (TLS on). */
static int open_out(weft_agent_t *a, int peer, weft__seal_t **seal_p)
{
    const char *addr = a->peers[peer].direct_address;
    if (addr == NULL || addr[0] == '\0') {
        return -1;
    }
    int64_t deadline = weft__now_ns() + a->handshake_timeout_ms * 1000000;
    int fd = connect_to(addr, deadline);
    if (fd < 0) {
        WEFT_WARN("direct connection to rank %d at %s failed; large frames take the stream", peer,
                  addr);
        return -1;
    }
    uint8_t ch[8 + WEFT__CHALLENGE_BYTES];
    uint8_t sig[WEFT__ID_SIG_BYTES];
    uint8_t *hello = NULL;
    SSL *ssl = NULL;
    char tls_why[512];
    const char *why = "the peer went away during the handshake";
    *seal_p = NULL;
    if (a->tls != NULL) {
        ssl = weft__tls_connect(a, fd, peer, deadline, tls_why, sizeof(tls_why));
        if (ssl == NULL) {
            why = tls_why;
            goto err_close;
        }
    }
    if (!read_until(fd, ssl, ch, sizeof(ch), deadline)) {
        goto err_close;
    }
    if (weft__get_u32(ch) != DIRECT_MAGIC || weft__get_u32(ch + 4) != DIRECT_VERSION) {
        why = "the peer speaks another handshake";
        goto err_close;
    }
    if (weft__hello_sign(a, 'D', ch + 8, peer, sig) != WEFT_OK) {
        why = weft_last_error();
        goto err_close;
    }
    Weft__V1__Hello h = WEFT__V1__HELLO__INIT;
    weft__hello_fill(a, &h);
    h.proof.data = sig;
    h.proof.len = sizeof(sig);
    size_t hlen = weft__v1__hello__get_packed_size(&h);
    hello = weft_alloc(12 + hlen);
    if (hello == NULL) {
        why = "no memory";
        goto err_close;
    }
    weft__put_u32(hello, DIRECT_MAGIC);
    weft__put_u32(hello + 4, DIRECT_VERSION);
    weft__put_u32(hello + 8, (uint32_t)hlen);
    weft__v1__hello__pack(&h, hello + 12);
    uint8_t ans[8];
    if (!io_write(fd, ssl, hello, 12 + hlen) || !read_until(fd, ssl, ans, sizeof(ans), deadline)) {
        goto err_close;
    }
    int32_t status = (int32_t)weft__get_u32(ans);
    uint32_t tlen = weft__get_u32(ans + 4);
    if (status != 0) {
        char text[512] = "";
        size_t k = tlen < sizeof(text) - 1 ? tlen : sizeof(text) - 1;
        if (read_until(fd, ssl, text, k, deadline)) {
            text[k] = '\0';
        }
        WEFT_WARN(
            "direct connection to rank %d at %s refused (%s): %s; large frames take the "
            "stream",
            peer, addr,
            weft_strerror(weft_status_valid(status) ? (weft_status_t)status : WEFT_ERR_PROTOCOL),
            text);
        weft_free(hello);
        conn_close(fd, ssl, NULL);
        return -1;
    }
    weft_free(hello);
    if (ssl != NULL) {
        /* From here on the records are sealed (seal.c); the session is done with. */
        weft__tls_after_handshake(fd);
        weft__seal_t *seal = weft__seal_of_tls(ssl, true, NULL, tls_why, sizeof(tls_why));
        if (seal == NULL) {
            why = tls_why;
            goto err_close;
        }
        SSL_free(ssl);
        *seal_p = seal;
    }
    return fd;

err_close:
    WEFT_WARN("direct connection to rank %d at %s failed (%s); large frames take the stream", peer,
              addr, why);
    weft_free(hello);
    conn_close(fd, ssl, NULL);
    return -1;
}

/* Answers a handshake: a status and its text. */
static bool handshake_answer(int fd, SSL *ssl, weft_status_t st, const char *text)
{
    size_t n = strlen(text);
    uint8_t hdr[8];
    weft__put_u32(hdr, (uint32_t)(int32_t)st);
    weft__put_u32(hdr + 4, (uint32_t)n);
    return io_write(fd, ssl, hdr, sizeof(hdr)) && (n == 0 || io_write(fd, ssl, text, n));
}

/* The acceptor's side of the handshake, within one deadline; the rank it proved, or -1. */
static int handshake_in(conn_in_t *c)
{
    weft_agent_t *a = c->agent;
    weft__direct_t *d = a->direct;
    int64_t deadline = weft__now_ns() + a->handshake_timeout_ms * 1000000;
    uint8_t ch[8 + WEFT__CHALLENGE_BYTES];
    uint8_t hdr[12];
    char why[512];
    weft__tls_id_t tls = {0};

    if (a->tls != NULL) {
        c->ssl = weft__tls_accept(a, c->fd, deadline, &tls, why, sizeof(why));
        if (c->ssl == NULL) {
            WEFT_WARN("refused a direct connection: %s", why);
            return -1;
        }
    }
    if (d->fault_silent_ms > 0) {
        /* tests: a port that accepts and then says nothing for this long (or until the peer
         * gives up, or the agent stops) */
        int64_t ms = d->fault_silent_ms < 86400000 ? d->fault_silent_ms : 86400000;
        int64_t until = weft__now_ns() + ms * 1000000;
        while (weft__now_ns() < until && !atomic_load(&d->stop)) {
            struct pollfd pfd = {c->fd, POLLRDHUP, 0};
            if (poll(&pfd, 1, 50) > 0) {
                break;
            }
        }
    }
    weft__put_u32(ch, DIRECT_MAGIC);
    weft__put_u32(ch + 4, DIRECT_VERSION);
    if (weft__random_bytes(ch + 8, WEFT__CHALLENGE_BYTES) != WEFT_OK ||
        !io_write(c->fd, c->ssl, ch, sizeof(ch))) {
        return -1;
    }
    if (!read_until(c->fd, c->ssl, hdr, sizeof(hdr), deadline)) {
        if (weft__now_ns() >= deadline) {
            WEFT_WARN("closed a direct connection: no handshake within %lld ms",
                      (long long)a->handshake_timeout_ms);
        } else {
            WEFT_WARN("a direct connection closed or failed before its handshake");
        }
        return -1;
    }
    uint32_t hlen = weft__get_u32(hdr + 8);
    if (weft__get_u32(hdr) != DIRECT_MAGIC || weft__get_u32(hdr + 4) != DIRECT_VERSION || hlen > MAX_HELLO) {
        snprintf(why, sizeof(why), "bad handshake (magic %08x, version %u, hello of %u bytes)",
                 weft__get_u32(hdr), weft__get_u32(hdr + 4), hlen);
        WEFT_WARN("refused a direct connection: %s", why);
        (void)handshake_answer(c->fd, c->ssl, WEFT_ERR_PROTOCOL, why);
        return -1;
    }
    uint8_t *buf = weft_alloc(hlen == 0 ? 1 : hlen);
    if (buf == NULL || !read_until(c->fd, c->ssl, buf, hlen, deadline)) {
        weft_free(buf);
        return -1;
    }
    Weft__V1__Hello *h = weft__v1__hello__unpack(&weft__pb_allocator, hlen, buf);
    weft_free(buf);
    weft_status_t st =
        weft__hello_check(a, h, WEFT__HELLO_DIRECT, ch + 8, deadline, &tls, why, sizeof(why));
    int rank = st == WEFT_OK ? h->rank : -1;
    if (h != NULL) {
        weft__v1__hello__free_unpacked(h, &weft__pb_allocator);
    }
    if (st == WEFT_OK && c->ssl != NULL) {
        /* The records after the answer are sealed (seal.c) with keys from the session: made
         * before the answer, so that a failure is told to the sender, which then takes the
         * stream, rather than found by its first frame. */
        c->seal = weft__seal_of_tls(c->ssl, false, &c->lowat, why, sizeof(why));
        st = c->seal != NULL ? WEFT_OK : WEFT_ERR_PROTOCOL;
    }
    if (st == WEFT_OK) {
        /* One connection per ordered pair: a second one claiming the rank is refused. */
        pthread_mutex_lock(&d->mu);
        for (conn_in_t *o = d->ins; o != NULL; o = o->next) {
            if (o != c && !atomic_load(&o->done) && atomic_load(&o->peer) == rank) {
                st = WEFT_ERR_ALREADY_EXISTS;
                snprintf(why, sizeof(why), "rank %d has a direct connection to %s already", rank,
                         a->name);
                break;
            }
        }
        /* A rank declared lost is lost for good (its loss is set before the transports are cut,
         * and the cut looks under d->mu: either it finds this connection or this finds the
         * loss). */
        if (st == WEFT_OK && __atomic_load_n(&a->peers[rank].lost, __ATOMIC_ACQUIRE)) {
            st = WEFT_ERR_PEER_LOST;
            snprintf(why, sizeof(why), "rank %d was declared lost by %s", rank, a->name);
        }
        if (st == WEFT_OK) {
            atomic_store(&c->peer, rank);
        }
        pthread_mutex_unlock(&d->mu);
    }
    if (st != WEFT_OK) {
        WEFT_WARN("refused a direct connection: %s", why);
        (void)handshake_answer(c->fd, c->ssl, st, why);
        return -1;
    }
    if (!handshake_answer(c->fd, c->ssl, WEFT_OK, "")) {
        return -1;
    }
    if (c->ssl != NULL) {
        /* From here on the records are sealed; the session is done with. */
        weft__tls_after_handshake(c->fd);
        SSL_free(c->ssl);
        c->ssl = NULL;
    }
    return rank;
}

/* ------------------------------------------------------------ sending */

/* Writes @p m on the connection (the caller holds c->writing) and settles it. */
static void write_out(conn_out_t *c, int fd, weft__seal_t *seal, weft__outmsg_t *m)
{
    weft_agent_t *a = c->agent;

    if (write_buffer(fd, seal, m->bb)) {
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

/* Whether a connection may be tried: never tried, or the wait after the last failure is over. */
static bool retry_due(conn_out_t *c)
{
    return !atomic_load(&c->unusable) || weft__now_ns() >= atomic_load(&c->retry_ns);
}

/* Connects to the peer (c->mu held, let go meanwhile); false when the agent stopped or the
 * peer was cut while it connected (the connection is closed then). */
static bool connect_out(conn_out_t *c)
{
    weft_agent_t *a = c->agent;
    weft__direct_t *d = a->direct;
    pthread_mutex_unlock(&c->mu);
    weft__seal_t *seal = NULL;
    int fd = open_out(a, c->peer, &seal);
    pthread_mutex_lock(&c->mu);
    if (fd >= 0 && (atomic_load(&d->stop) || c->cut)) {
        conn_close(fd, NULL, seal);
        return false;
    }
    c->fd = fd;
    c->seal = seal;
    if (fd >= 0) {
        c->fails = 0;
    } else {
        /* Tried again after 1 s, then 2, 4 ... up to a minute: a peer whose direct listener was
         * full or unreachable for a while gets its direct path back. */
        int64_t wait_ms = (int64_t)1000 << (c->fails < 6 ? c->fails : 6);
        c->fails++;
        atomic_store(&c->retry_ns, weft__now_ns() + wait_ms * 1000000);
    }
    atomic_store(&c->unusable, fd < 0);
    return true;
}

static void *sender_main(void *arg)
{
    conn_out_t *c = arg;
    weft_agent_t *a = c->agent;
    weft__direct_t *d = a->direct;

    weft__nopipe_thread();
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (((c->qh == NULL && !c->warm) || c->writing) && !atomic_load(&d->stop)) {
            pthread_cond_wait(&c->cv, &c->mu);
        }
        weft__outmsg_t *m = c->qh;
        if (m == NULL && atomic_load(&d->stop)) {
            break;
        }
        if (m == NULL) {
            /* Asked to connect ahead: the frames that wanted this connection meanwhile took the
             * stream, none waits behind the connect. */
            c->warm = false;
            if (c->fd < 0 && retry_due(c) && !c->cut) {
                (void)connect_out(c);
            }
            continue;
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
        if (c->fd < 0 && retry_due(c) && !connect_out(c)) {
            /* Closed or cut while we connected. */
            pthread_mutex_unlock(&c->mu);
            weft__outmsg_free(m, WEFT_ERR_PEER_LOST, "direct connection closed");
            pthread_mutex_lock(&c->mu);
            continue;
        }
        int fd = c->fd;
        weft__seal_t *seal = c->seal;
        bool unusable = atomic_load(&c->unusable);
        c->writing = !unusable;
        pthread_mutex_unlock(&c->mu);
        if (unusable) {
            /* No direct connection to this peer: back through the route, to the stream. */
            weft__route_fallback(a, c->peer, m);
        } else {
            write_out(c, fd, seal, m);
        }
        pthread_mutex_lock(&c->mu);
        c->writing = false;
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

static weft_status_t tp_send(weft_agent_t *a, int peer, weft__stream_t *via, weft__outmsg_t *m,
                             uint32_t flags, weft__path_t *path_p)
{
    weft__direct_t *d = a->direct;
    conn_out_t *c = &d->outs[peer];
    bool write_here = (flags & WEFT_SEND_INLINE) != 0;

    (void)via; /* kept in the message (reply_via) for a fallback */
    (void)path_p;
    pthread_mutex_lock(&c->mu);
    /* A peer declared lost is cut only after its pending calls failed: a call made in between
     * must not go to its connection (nothing would fail it), as on a ring. */
    if (__atomic_load_n(&a->peers[peer].lost, __ATOMIC_ACQUIRE)) {
        c->cut = true;
    }
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
        weft__seal_t *seal = c->seal;
        c->writing = true;
        pthread_mutex_unlock(&c->mu);
        write_out(c, fd, seal, m);
        pthread_mutex_lock(&c->mu);
        c->writing = false;
        pthread_cond_broadcast(&c->cv); /* the sender, or stop, may wait */
        pthread_mutex_unlock(&c->mu);
        return WEFT_OK;
    }
    if (!c->started) {
        if (pthread_create(&c->thread, NULL, sender_main, c) != 0) {
            pthread_mutex_unlock(&c->mu);
            weft__route_fallback(a, peer, m);
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

static bool tp_usable(weft_agent_t *a, int peer)
{
    weft__direct_t *d = a->direct;
    if (d == NULL || atomic_load(&d->stop) || peer < 0 || peer >= a->world_size) {
        return false;
    }
    const char *addr = a->peers[peer].direct_address;
    return addr != NULL && addr[0] != '\0' && retry_due(&d->outs[peer]) && !d->outs[peer].cut;
}

bool weft__direct_ready(weft_agent_t *a, int peer)
{
    weft__direct_t *d = a->direct;
    if (d == NULL || peer < 0 || peer >= a->world_size || atomic_load(&d->stop)) {
        return false;
    }
    const char *addr = a->peers[peer].direct_address;
    if (addr == NULL || addr[0] == '\0') {
        return false;
    }
    conn_out_t *c = &d->outs[peer];
    pthread_mutex_lock(&c->mu);
    bool ready = c->fd >= 0 && !atomic_load(&c->unusable) && !c->cut;
    if (!ready && !c->cut && retry_due(c) && !c->warm) {
        c->warm = true;
        if (!c->started && pthread_create(&c->thread, NULL, sender_main, c) == 0) {
            c->started = true;
        }
        pthread_cond_broadcast(&c->cv);
    }
    pthread_mutex_unlock(&c->mu);
    return ready;
}

static void tp_cut(weft_agent_t *a, int peer)
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

/* ------------------------------------------------------------ receiving */

typedef struct {
    weft_agent_t *agent;
    int peer;
    Weft__V1__Envelope *env;
    weft_value_t *v;
} dispatch_t;

static void dispatch_run(void *arg)
{
    dispatch_t *t = arg;
    weft__origin_t o = {WEFT__TP_DIRECT, t->peer, NULL, false};
    weft__deliver(t->agent, &o, t->env, t->v, WEFT_OK);
    weft_free(t);
}

/* Waits until the next bytes of the connection are there (a frame's next part has begun to
 * arrive): memory for it is taken only then. False when the connection is over. */
static bool await_bytes(conn_in_t *c)
{
    if (c->seal != NULL && weft__seal_pending(c->seal)) {
        return true;
    }
    weft__set_lowat(c->fd, &c->lowat, 1);
    for (;;) {
        struct pollfd pfd = {c->fd, POLLIN, 0};
        int r = poll(&pfd, 1, -1);
        if (r > 0) {
            return (pfd.revents & POLLIN) != 0;
        }
        if (r < 0 && errno != EINTR) {
            return false;
        }
    }
}

/* A large tensor: received into a buffer that grows as its bytes arrive (core's growing tensors:
 * a block the large-block cache holds already is taken whole), so that a frame announcing
 * gigabytes holds only what was sent. *got_p: the bytes of it read from the connection (all of
 * them on success; on a failure, what the rest of the body must be skipped from). */
static weft_status_t read_grown(conn_in_t *c, const Weft__V1__TensorMeta *tm, weft_tensor_t **t_p,
                                uint64_t *got_p, bool *broke_p)
{
    size_t n = (size_t)tm->nbytes;
    weft__tgrow_t *g;
    uint8_t *data;
    size_t cap, got = 0;

    *broke_p = false;
    *got_p = 0;
    WEFT_CHECK(weft__tensor_grow_begin((weft_dtype_t)tm->dtype, (int)tm->n_shape, tm->shape,
                                       GROW_MIN, &g, &data, &cap));
    while (got < n) {
        if (got == cap) {
            weft_status_t st = weft__tensor_grow_to(g, cap * 2, got, &data);
            if (st != WEFT_OK) {
                weft__tensor_grow_abort(g);
                *got_p = got;
                return st;
            }
            cap = cap * 2 < n ? cap * 2 : n;
        }
        size_t k = cap - got;
        if (!read_all(c, data + got, k)) {
            weft__tensor_grow_abort(g);
            *broke_p = true;
            return WEFT_ERR_PEER_LOST;
        }
        got += k;
    }
    *got_p = got;
    return weft__tensor_grow_end(g, t_p);
}

/* A payload, in a buffer that grows as its bytes arrive (from GROW_MIN, doubling), as large
 * tensors do. *got_p as for read_grown. */
static weft_status_t read_payload(conn_in_t *c, uint64_t n, void **pl_p, uint64_t *got_p,
                                  bool *broke_p)
{
    size_t cap = n < GROW_MIN ? (size_t)n : GROW_MIN, got = 0;
    uint8_t *p = weft_alloc(cap);

    *broke_p = false;
    *got_p = 0;
    *pl_p = NULL;
    while (p != NULL && got < n) {
        if (got == cap) {
            size_t next = (uint64_t)cap * 2 < n ? cap * 2 : (size_t)n;
            uint8_t *q = weft_realloc(p, next);
            if (q == NULL) {
                break;
            }
            p = q;
            cap = next;
        }
        if (!read_all(c, p + got, cap - got)) {
            weft_free(p);
            *broke_p = true;
            return WEFT_ERR_PEER_LOST;
        }
        got = cap;
    }
    *got_p = got;
    if (p == NULL || got < n) {
        weft_free(p);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "no memory for a %llu-byte payload",
                               (unsigned long long)n);
    }
    *pl_p = p;
    return WEFT_OK;
}

/* Reads @p n bytes into a landing; false when the connection broke. */
static bool land_bytes(conn_in_t *c, const weft_landing_t *l, uint64_t n)
{
    if (l->sink == NULL) {
        return read_all(c, l->dst, (size_t)n);
    }
    if (c->hot == NULL) {
        c->hot = weft_alloc(LAND_CHUNK);
    }
    uint8_t small[16384];
    uint8_t *buf = c->hot != NULL ? c->hot : small;
    size_t cap = c->hot != NULL ? LAND_CHUNK : sizeof(small);
    for (uint64_t off = 0; off < n;) {
        size_t k = n - off < cap ? (size_t)(n - off) : cap;
        if (!read_all(c, buf, k)) {
            return false;
        }
        l->sink(l->arg, (size_t)off, buf, k);
        off += k;
    }
    return true;
}

/* A one-way message with one tensor, on a channel whose module may say where it lands: its
 * payload first, then the tensor's bytes, in place or into a fresh tensor. The envelope is
 * consumed; false when the connection is over or broken. */
static bool read_landing(conn_in_t *c, Weft__V1__Envelope *env, const weft__module_t *mod,
                         uint64_t body)
{
    weft_agent_t *a = c->agent;
    const Weft__V1__TensorMeta *tm = env->tensors[0];
    uint64_t nb = body - env->payload_bytes;
    uint32_t ch = env->channel;
    weft_value_t *v = NULL;
    uint8_t *pl = weft_alloc(env->payload_bytes);
    int peer = atomic_load(&c->peer);
    bool ok;

    if (pl == NULL || weft_value_create(&v) != WEFT_OK) {
        weft_free(pl);
        weft_value_free(v);
        weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
        return skip_all(c, body);
    }
    if (!read_all(c, pl, env->payload_bytes)) {
        ok = false;
        goto out;
    }
    int64_t numel = 1;
    for (size_t i = 0; i < tm->n_shape; i++) {
        numel *= tm->shape[i];
    }
    weft_landing_t l = {0};
    bool deliver = true;
    if (mod->desc.lander(mod->state, peer, pl, env->payload_bytes, (weft_dtype_t)tm->dtype, numel,
                         &l)) {
        ok = land_bytes(c, &l, nb);
        l.done(l.arg, ok);
    } else if (nb > 0 && !await_bytes(c)) {
        /* (Memory is taken as the bytes begin to arrive, never for an announced size alone.) */
        ok = false;
    } else {
        weft_tensor_t *t = NULL;
        weft_status_t st = WEFT_OK;
        uint64_t got = 0;
        bool broke = false;
        if (nb >= GROW_MIN) {
            st = read_grown(c, tm, &t, &got, &broke); /* grows as its bytes arrive */
        } else {
            st = weft_tensor_empty((weft_dtype_t)tm->dtype, (int)tm->n_shape, tm->shape, &t);
            if (st == WEFT_OK) {
                broke = !read_all(c, weft_tensor_data(t), (size_t)nb);
                got = nb;
            }
        }
        if (broke) {
            weft_tensor_release(t);
            ok = false;
        } else if (st != WEFT_OK || weft_value_push_tensor(v, t) != WEFT_OK) {
            /* No memory: the message is dropped, the connection stays framed. */
            weft_tensor_release(t);
            WEFT_WARN("direct connection from rank %d: no memory for a message; dropped", peer);
            ok = skip_all(c, nb - got);
            deliver = false;
        } else {
            ok = true;
        }
    }
    if (ok && deliver && weft_value_take_payload(v, pl, env->payload_bytes) == WEFT_OK) {
        pl = NULL;
        weft__channel_deliver(a, ch, peer, v);
        v = NULL;
    }
out:
    weft_free(pl);
    weft_value_free(v);
    weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
    return ok;
}

/* Reads a frame's body into a new value, each part's memory taken as its bytes begin to arrive.
 * On an allocation failure the rest of the body is skipped (*skipped_p): the connection stays
 * framed. False when the connection broke. */
static bool read_value_into(conn_in_t *c, const Weft__V1__Envelope *env, uint64_t body,
                            const weft_rpc_into_t *into, size_t n_into, weft_value_t **v_p,
                            weft_status_t *st_p);

static bool read_value(conn_in_t *c, const Weft__V1__Envelope *env, uint64_t body,
                       weft_value_t **v_p, weft_status_t *st_p)
{
    weft_rpc_into_t *into = NULL;
    size_t n_into = 0;
    /* An answer whose call said where its tensors land (weft_rpc_async_into). */
    bool claimed = env->kind == WEFT__V1__KIND__KIND_RESPONSE && env->n_tensors > 0 &&
                   env->status == 0 &&
                   weft__pending_claim(c->agent, env->request_id, atomic_load(&c->peer),
                                       WEFT__TP_DIRECT, &into, &n_into);
    bool ok = read_value_into(c, env, body, into, n_into, v_p, st_p);
    if (claimed) {
        weft__pending_unclaim(c->agent, env->request_id, ok);
        weft_free(into);
    }
    return ok;
}

static bool read_value_into(conn_in_t *c, const Weft__V1__Envelope *env, uint64_t body,
                            const weft_rpc_into_t *into, size_t n_into, weft_value_t **v_p,
                            weft_status_t *st_p)
{
    weft_value_t *v = NULL;
    uint64_t done = 0;

    *v_p = NULL;
    *st_p = weft_value_create(&v);
    if (*st_p != WEFT_OK) {
        return skip_all(c, body);
    }
    if (env->payload_bytes > 0) {
        if (!await_bytes(c)) {
            weft_value_free(v);
            return false;
        }
        void *pl = NULL;
        uint64_t got = 0;
        bool broke = false;
        weft_status_t st = read_payload(c, env->payload_bytes, &pl, &got, &broke);
        if (broke) {
            weft_value_free(v);
            return false;
        }
        done += got;
        if (st == WEFT_OK) {
            st = weft_value_take_payload(v, pl, env->payload_bytes);
            if (st != WEFT_OK) {
                weft_free(pl);
            }
        }
        if (st != WEFT_OK) {
            *st_p = st;
            weft_value_free(v);
            return skip_all(c, body - done);
        }
    }
    for (size_t i = 0; i < env->n_tensors; i++) {
        const Weft__V1__TensorMeta *tm = env->tensors[i];
        weft_tensor_t *t = NULL;
        weft_status_t st;
        uint64_t got = 0; /* this tensor's bytes read from the connection */
        if (tm->nbytes > 0 && !await_bytes(c)) {
            weft_value_free(v);
            return false;
        }
        if (i < n_into && into[i].data != NULL && into[i].nbytes == tm->nbytes &&
            tm->nbytes > 0 && (int)into[i].dtype == (int)tm->dtype) {
            /* Straight into the caller's memory; the value's tensor wraps it. */
            st = weft_tensor_wrap((weft_dtype_t)tm->dtype, (int)tm->n_shape, tm->shape,
                                  into[i].data, into[i].nbytes, WEFT_CPU, NULL, NULL, &t);
            if (st == WEFT_OK) {
                if (!read_all(c, into[i].data, (size_t)tm->nbytes)) {
                    weft_tensor_release(t);
                    weft_value_free(v);
                    return false;
                }
                got = tm->nbytes;
            }
        } else if (tm->nbytes >= GROW_MIN) {
            bool broke = false;
            st = read_grown(c, tm, &t, &got, &broke);
            if (broke) {
                weft_value_free(v);
                return false;
            }
        } else {
            st = weft_tensor_empty((weft_dtype_t)tm->dtype, (int)tm->n_shape, tm->shape, &t);
            if (st == WEFT_OK) {
                if (!read_all(c, weft_tensor_data(t), (size_t)tm->nbytes)) {
                    weft_tensor_release(t);
                    weft_value_free(v);
                    return false;
                }
                got = tm->nbytes;
            }
        }
        done += got;
        if (st == WEFT_OK && weft_value_push_tensor(v, t) != WEFT_OK) {
            weft_tensor_release(t);
            st = weft__set_error(WEFT_ERR_NO_MEMORY, "no memory");
        }
        if (st != WEFT_OK) {
            /* The rest of the body, from what was read: the connection stays framed. */
            *st_p = st;
            weft_value_free(v);
            return skip_all(c, body - done);
        }
    }
    *v_p = v;
    return true;
}

/* Reads one frame; false when the connection is over, broken or cannot be framed any more. */
static bool read_frame(conn_in_t *c)
{
    weft_agent_t *a = c->agent;
    int peer = atomic_load(&c->peer);
    weft__origin_t o = {WEFT__TP_DIRECT, peer, NULL, false};
    uint8_t lenb[4];

    if (!read_all(c, lenb, 4)) { /* the next frame may be small */
        return false;
    }
    uint32_t elen = weft__get_u32(lenb);
    if (elen > WEFT__MAX_ENVELOPE) {
        WEFT_WARN("direct connection from rank %d: an envelope of %u bytes (max %u); closing", peer,
                  elen, WEFT__MAX_ENVELOPE);
        return false;
    }
    uint8_t *ebuf = weft_alloc(elen == 0 ? 1 : elen);
    if (ebuf == NULL || !read_all(c, ebuf, elen)) {
        weft_free(ebuf);
        return false;
    }
    Weft__V1__Envelope *env = weft__v1__envelope__unpack(&weft__pb_allocator, elen, ebuf);
    weft_free(ebuf);
    if (env == NULL) {
        WEFT_WARN("direct connection from rank %d: an envelope that does not decode; closing",
                  peer);
        return false;
    }
    uint64_t body = 0;
    bool framed = true;
    weft_status_t st = weft__frame_check(env, elen, a->max_message_bytes, &body, &framed);
    if (st != WEFT_OK) {
        /* Refused at once, before any of its body is read: its request is answered, or its
         * answer fails our call. */
        bool over = st == WEFT_ERR_TOO_LARGE;
        char why[WEFT__ERROR_MAX];
        snprintf(why, sizeof(why), "%s", weft_last_error());
        bool keep = framed && !over && skip_all(c, body);
        weft__set_error(st, "%s", why);
        weft__deliver(a, &o, env, NULL, st);
        if (!keep) {
            /* Over the limit the sender was told (its bytes are never waited for), or sizes
             * that cannot be trusted: the connection cannot go on. */
            WEFT_WARN("direct connection from rank %d: %s; closing", peer, why);
        }
        return keep;
    }
    if (env->kind == WEFT__V1__KIND__KIND_ONEWAY && env->n_tensors == 1 && env->payload_bytes > 0 &&
        env->payload_bytes <= LAND_MAX_PAYLOAD && env->channel >= 1 &&
        env->channel <= WEFT_CHANNEL_MAX) {
        const weft__module_t *mod = weft__module_at(a, env->channel);
        if (mod != NULL && mod->desc.lander != NULL) {
            return read_landing(c, env, mod, body);
        }
    }
    weft_value_t *v = NULL;
    weft_status_t vst = WEFT_OK;
    if (!read_value(c, env, body, &v, &vst)) {
        /* The connection broke mid-frame: the peer is going away. Keep the shutdown counters
         * whole: the sender counted this request. */
        if (env->kind == WEFT__V1__KIND__KIND_REQUEST &&
            (env->function == NULL || !weft__fn_internal(env->function))) {
            atomic_fetch_add(&a->requests_received, 1);
        }
        weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
        return false;
    }
    if (vst != WEFT_OK || env->kind == WEFT__V1__KIND__KIND_ONEWAY) {
        /* A refusal (no memory), or an unordered one-way message: straight to the delivery
         * (a module's callback is quick). */
        weft__deliver(a, &o, env, v, vst);
        return true;
    }
    /* Handlers and completions (whose callbacks may make calls of their own) run on
     * the bulk queue: this thread goes back to the socket. */
    dispatch_t *t = weft_alloc(sizeof(*t));
    if (t != NULL) {
        t->agent = a;
        t->peer = peer;
        t->env = env;
        t->v = v;
        if (a->bulk != NULL && weft__bulk_submit(a->bulk, dispatch_run, t) == WEFT_OK) {
            return true;
        }
        weft_free(t);
    }
    weft__deliver(a, &o, env, v, WEFT_OK);
    return true;
}

static void *reader_main(void *arg)
{
    conn_in_t *c = arg;

    weft__nopipe_thread(); /* OpenSSL may write (an alert) during the handshake */

    if (handshake_in(c) >= 0) {
        while (!atomic_load(&c->agent->direct->stop) && read_frame(c)) {
        }
    }
    weft_agent_t *a = c->agent;
    int peer = atomic_load(&c->peer);
    if (c->seal != NULL && weft__seal_broken(c->seal) && peer >= 0 &&
        !atomic_load(&a->direct->stop) && !weft__agent_closing(a)) {
        /* A record that fails its check (bytes changed on the way, or a broken sender): what
         * was in flight on it is gone, so the peer is lost for good, loudly, rather than its
         * calls waiting for their deadlines. Declared before this reader is marked done: the
         * acceptor joins done readers holding the lock the loss's cut takes. */
        char why[300];
        snprintf(why, sizeof(why), "direct connection from %s (rank %d): %s",
                 a->peers[peer].name != NULL ? a->peers[peer].name : "?", peer,
                 weft__seal_why(c->seal));
        WEFT_WARN("%s; the peer is lost", why);
        weft__agent_peer_lost(a, peer, WEFT_ERR_PEER_LOST, why);
    } else if (c->seal != NULL && weft__seal_failed(c->seal)) {
        WEFT_WARN("direct connection from rank %d: %s; closed", peer, weft__seal_why(c->seal));
    }
    /* Done before the peer can see the end: a new connection of the same rank is then allowed
     * (a lost one never is). */
    atomic_store(&c->done, true);
    shutdown(c->fd, SHUT_RDWR);
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
            conn_close(c->fd, c->ssl, c->seal);
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
        atomic_init(&c->peer, -1);
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
    if (!a->direct_enabled) {
        return WEFT_OK; /* frames of every size take the stream */
    }
    weft__direct_t *d = weft_calloc(1, sizeof(*d));
    if (d == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "direct: no memory");
    }
    d->agent = a;
    d->fault_silent_ms = weft__cfg_int(WEFT__CFG_DIRECT_FAULT_SILENT_MS);
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

static void tp_stop(weft_agent_t *a)
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
        /* A caller writing inline finishes first: its socket was shut down above, so it does
         * not take long. */
        pthread_mutex_lock(&c->mu);
        while (c->writing) {
            pthread_cond_wait(&c->cv, &c->mu);
        }
        pthread_mutex_unlock(&c->mu);
        if (c->fd >= 0) {
            conn_close(c->fd, NULL, c->seal);
            c->fd = -1;
            c->seal = NULL;
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
        conn_close(ins->fd, ins->ssl, ins->seal);
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
    tp_stop(a);
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

const weft__transport_t weft__direct_transport = {
    .name = "its direct connection",
    .send = tp_send,
    .usable = tp_usable,
    .cut = tp_cut,
    .stop = tp_stop,
};
