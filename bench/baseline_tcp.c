/* Raw TCP on 127.0.0.1 with TCP_NODELAY: the floor under any RPC layer on loopback.
 *
 * A message is an 8-byte length header and the payload. The server echoes each message
 * (pingpong, async) or, in stream mode, reads it fully into one reused buffer and then
 * acknowledges it with one byte. Both sides coalesce small writes and flush before they block
 * on a read, as a good hand-written protocol would. The binary forks the server process itself
 * (before anything else), which binds port 0 and hands its port to the client through a pipe.
 *
 *   baseline_tcp pingpong SIZE ITERS | stream SIZE COUNT [WINDOW] | async N [INFLIGHT [SIZE]]
 *
 * Prints {"system":"raw_tcp","metric":...,"value":...} lines (see bench_common.h). */
#include "bench_common.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#define IO_BUF    (256 * 1024) /* buffered reads and coalesced small writes */
#define SMALL_MAX 4096         /* messages up to this size are coalesced */
#define DIRECT_RD (64 * 1024)  /* reads at least this long go straight into the caller's buffer */

typedef struct {
    int fd;
    char *in;
    size_t in_head;
    size_t in_tail;
    char *out;
    size_t out_len;
} conn_t;

static void fail(const char *what)
{
    fprintf(stderr, "baseline_tcp[%d]: %s: %s\n", (int)getpid(), what, strerror(errno));
    exit(1);
}

static void *alloc_prefaulted(size_t len, int byte)
{
    void *p = malloc(len);
    if (p == NULL) {
        fail("malloc");
    }
    memset(p, byte, len);
    return p;
}

static void writev_all(int fd, struct iovec *iov, int cnt)
{
    while (cnt > 0) {
        ssize_t n = writev(fd, iov, cnt);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            fail("writev");
        }
        size_t done = (size_t)n;
        while (cnt > 0 && done >= iov->iov_len) {
            done -= iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (char *)iov->iov_base + done;
            iov->iov_len -= done;
        }
    }
}

static void conn_flush(conn_t *c)
{
    if (c->out_len == 0) {
        return;
    }
    struct iovec iov = {c->out, c->out_len};
    writev_all(c->fd, &iov, 1);
    c->out_len = 0;
}

/* Queues raw bytes (small) for the next flush. */
static void conn_put(conn_t *c, const void *data, size_t len)
{
    if (c->out_len + len > IO_BUF) {
        conn_flush(c);
    }
    memcpy(c->out + c->out_len, data, len);
    c->out_len += len;
}

/* Queues one message; a large one goes out at once, after what is queued. */
static void conn_put_msg(conn_t *c, const void *data, size_t len)
{
    uint64_t hdr = len;
    if (len <= SMALL_MAX) {
        conn_put(c, &hdr, sizeof(hdr));
        conn_put(c, data, len);
        return;
    }
    conn_flush(c);
    struct iovec iov[2] = {{&hdr, sizeof(hdr)}, {(void *)data, len}};
    writev_all(c->fd, iov, 2);
}

/* recv() that flushes queued writes first, since it may block. 0 on EOF. */
static size_t conn_recv(conn_t *c, void *dst, size_t len)
{
    conn_flush(c);
    for (;;) {
        ssize_t n = recv(c->fd, dst, len, 0);
        if (n >= 0) {
            return (size_t)n;
        }
        if (errno != EINTR) {
            fail("recv");
        }
    }
}

/* Reads exactly @p len bytes. Returns -1 on EOF before the first byte, dies on EOF after. */
static int conn_read(conn_t *c, void *dst, size_t len)
{
    char *p = dst;
    size_t have = c->in_tail - c->in_head;
    size_t k = have < len ? have : len;
    int got_any = k > 0;
    memcpy(p, c->in + c->in_head, k);
    c->in_head += k;
    p += k;
    len -= k;
    while (len > 0) {
        size_t n;
        if (len >= DIRECT_RD) {
            n = conn_recv(c, p, len);
        } else {
            c->in_head = 0;
            c->in_tail = conn_recv(c, c->in, IO_BUF);
            n = c->in_tail < len ? c->in_tail : len;
            memcpy(p, c->in, n);
            c->in_head = n;
        }
        if (n == 0) {
            if (!got_any) {
                return -1;
            }
            errno = EPIPE;
            fail("connection closed mid-message");
        }
        got_any = 1;
        p += n;
        len -= n;
    }
    return 0;
}

static void set_nodelay(int fd)
{
    int one = 1;
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) {
        fail("TCP_NODELAY");
    }
}

static void conn_init(conn_t *c, int fd)
{
    c->fd = fd;
    c->in = alloc_prefaulted(IO_BUF, 0);
    c->out = alloc_prefaulted(IO_BUF, 0);
    c->in_head = c->in_tail = 0;
    c->out_len = 0;
}

static void conn_close(conn_t *c)
{
    conn_flush(c);
    close(c->fd);
    free(c->in);
    free(c->out);
}

/* Server process: echo or acknowledge every message until the client closes. */
static void server_main(const bench_args_t *b, int port_fd)
{
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    if (ls < 0) {
        fail("socket");
    }
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = 0};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t alen = sizeof(addr);
    if (bind(ls, (struct sockaddr *)&addr, sizeof(addr)) != 0 || listen(ls, 1) != 0 ||
        getsockname(ls, (struct sockaddr *)&addr, &alen) != 0) {
        fail("bind/listen");
    }
    int port = ntohs(addr.sin_port);
    if (write(port_fd, &port, sizeof(port)) != (ssize_t)sizeof(port)) {
        fail("write port");
    }
    close(port_fd);
    int fd = accept(ls, NULL, NULL);
    if (fd < 0) {
        fail("accept");
    }
    close(ls);
    set_nodelay(fd);

    conn_t c;
    conn_init(&c, fd);
    char *payload = alloc_prefaulted(b->size, 0);
    for (;;) {
        uint64_t len;
        if (conn_read(&c, &len, sizeof(len)) < 0) {
            break;
        }
        if (len != b->size) {
            fprintf(stderr, "baseline_tcp server: message of %" PRIu64 " bytes, expected %zu\n",
                    len, b->size);
            exit(1);
        }
        conn_read(&c, payload, len);
        if (b->mode == BENCH_STREAM) {
            conn_put(&c, "a", 1);
        } else {
            conn_put_msg(&c, payload, len);
        }
    }
    free(payload);
    conn_close(&c);
}

/* Client: keeps at most b->window messages unanswered; warm-up first, then the timed part. */
static void run_client(conn_t *c, const bench_args_t *b, uint64_t *rtt_ns, uint64_t *elapsed_ns)
{
    char *msg = alloc_prefaulted(b->size, 1);
    char *reply = b->mode == BENCH_STREAM ? NULL : alloc_prefaulted(b->size, 0);
    size_t total = b->warmup + b->count;
    size_t target = b->warmup;
    size_t sent = 0;
    size_t recvd = 0;
    uint64_t t0 = 0;
    uint64_t t_send = 0;
    while (recvd < total) {
        if (recvd == target) { /* warm-up drained */
            target = total;
            t0 = bench_now_ns();
        }
        if (sent < target && sent - recvd < b->window) {
            t_send = bench_now_ns();
            conn_put_msg(c, msg, b->size);
            sent++;
            continue;
        }
        if (b->mode == BENCH_STREAM) {
            char ack;
            if (conn_read(c, &ack, 1) < 0) {
                errno = EPIPE;
                fail("server closed");
            }
        } else {
            uint64_t len;
            if (conn_read(c, &len, sizeof(len)) < 0 || len != b->size) {
                errno = EPROTO;
                fail("bad reply");
            }
            conn_read(c, reply, len);
        }
        if (b->mode == BENCH_PINGPONG && recvd >= b->warmup) {
            rtt_ns[recvd - b->warmup] = bench_now_ns() - t_send;
        }
        recvd++;
    }
    *elapsed_ns = bench_now_ns() - t0;
    free(reply);
    free(msg);
}

int main(int argc, char **argv)
{
    bench_args_t b;
    if (bench_parse_args(argc, argv, &b) != 0) {
        return 2;
    }
    int pfd[2];
    if (pipe(pfd) != 0) {
        fail("pipe");
    }
    pid_t pid = fork();
    if (pid < 0) {
        fail("fork");
    }
    if (pid == 0) {
        close(pfd[0]);
        server_main(&b, pfd[1]);
        _exit(0);
    }
    close(pfd[1]);
    int port = 0;
    if (read(pfd[0], &port, sizeof(port)) != (ssize_t)sizeof(port)) {
        fprintf(stderr, "baseline_tcp: server did not start\n");
        waitpid(pid, NULL, 0);
        return 1;
    }
    close(pfd[0]);

    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0) {
        fail("connect");
    }
    set_nodelay(fd);

    uint64_t *rtt = calloc(b.mode == BENCH_PINGPONG ? b.count : 1, sizeof(*rtt));
    if (rtt == NULL) {
        fail("calloc");
    }
    uint64_t elapsed = 0;
    conn_t c;
    conn_init(&c, fd);
    run_client(&c, &b, rtt, &elapsed);
    conn_close(&c);

    int st = 0;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "baseline_tcp: server exited abnormally (status %d)\n", st);
        return 1;
    }
    bench_report("raw_tcp", &b, rtt, elapsed);
    free(rtt);
    return 0;
}
