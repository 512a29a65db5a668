/* The shared-memory transport: rings between the ranks of one host.
 *
 * Between two ranks of one host a frame need not cross the kernel at all. Each ordered pair of
 * ranks gets a ring in shared memory (a sealed memfd the writer makes and hands to the reader
 * over a Unix socket); the writer copies a frame in, the reader copies it out into the value it
 * delivers (or straight into the caller's memory, weft_rpc_async_into). Single producer (a lock
 * orders the writing threads), single consumer (one thread at a time holds the ring's reading
 * role). Every frame to such a peer takes its ring, in order, whatever its kind or size; the
 * frame layout is the stream's (docs/protocol.md section 5); a frame larger than the ring goes
 * through it in pieces while the reader copies out.
 *
 * Waiting: a side that finds the ring empty (reader) or full (writer) polls it for
 * WEFT_SHM_SPIN_US, then sleeps on a futex word in the ring, which the other side wakes only
 * when it sees the word set (so a busy pair makes no system call at all). Nothing is ever
 * dropped: a full ring holds the writer (back-pressure) until there is room, the peer is lost,
 * or the agent closes.
 *
 * Opening (docs/protocol.md section 4): the first frame to a rank whose listener name says it is
 * on this host (the same boot, PID and network namespace, user and WEFT_SHM_HOST_TAG) opens the
 * ring; frames sent meanwhile wait in order behind it. The listener sends a challenge; the
 * connecting rank answers with a Hello proving its rank (transcript 'M'), the ring's memfd
 * attached (SCM_RIGHTS); the listener checks both (the Hello as every connection's, the memfd's
 * size and seals, the ring's header) and answers with a status. A ring that cannot be opened
 * leaves the pair on the gRPC stream and direct connection for good (order kept: the frames that
 * waited go there first). The peer's gRPC stream is opened too and kept: its keepalive still
 * watches for a stopped process.
 *
 * A peer's death: its end of the Unix socket closes with the process, and a side that sleeps on
 * the ring looks at the socket every SLEEP_MS: the reader drains what was written, then reports
 * the peer lost; a writer held by a full ring fails its frame. A lost peer (from any transport)
 * wakes both.
 *
 * A thread holding a ring's reading role runs what it delivers (handlers, completions, module
 * callbacks) itself; when that work blocks (a weft wait, or a write held by a full ring) it hands
 * the role to a new thread first, so that the ring keeps being read: two ranks filling each
 * other's rings with requests cannot deadlock. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <stdarg.h>
#include <stdalign.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define SHM_MAGIC   0x4d544657u /* "WFTM" little-endian */
#define SHM_VERSION 1u
#define RING_OFF    4096u                /* the ring's bytes start here in its memory */
#define MAX_HELLO   (64u << 10)
#define SLEEP_MS    (atomic_load_explicit(&sleep_ms, memory_order_relaxed)) /* a sleeping side
                                         * looks at the peer's socket this often */
#define PUBLISH_MIN ((uint64_t)64 << 10) /* a long frame is made visible in pieces this large */
#define NAME_PREFIX "weft-shm-"
#define MAX_HANDSHAKES 64 /* connections of a listener still proving their rank */
#define HOT_BYTES   ((uint64_t)256 << 10) /* an unaligned landing goes through this much at a time */

_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2 && ATOMIC_INT_LOCK_FREE == 2,
               "the ring's words are shared between processes: they must be lock-free");

/* The ring's header, at the start of its memory; the bytes follow at RING_OFF. */
typedef struct {
    uint32_t magic, version;
    uint64_t capacity;                             /* a power of two */
    alignas(64) _Atomic uint64_t head;             /* bytes written; the writer's */
    alignas(64) _Atomic uint32_t reader_sleeping;  /* futex: 1 while the reader sleeps */
    alignas(64) _Atomic uint64_t tail;             /* bytes read; the reader's */
    alignas(64) _Atomic uint32_t writer_waiting;   /* futex: 1 while the writer waits for room */
} ring_hdr_t;

_Static_assert(sizeof(ring_hdr_t) <= RING_OFF, "the ring's header fits before its bytes");

typedef struct thr {
    struct thr *next;
    pthread_t t;
    struct shm_in *c;
    _Atomic bool exited; /* its last act: joined and freed by the next reap */
} thr_t;

/* A ring this rank reads: one per peer that opened one to it. */
typedef struct shm_in {
    struct shm_in *next;
    weft_agent_t *agent;
    int sock;
    _Atomic int peer; /* -1 until the handshake */
    ring_hdr_t *ring;
    uint8_t *data;
    uint64_t cap;
    size_t map_len;
    uint64_t tail;   /* the reading role's position */
    uint8_t *ebuf;   /* the reading role's envelope buffer */
    uint8_t *hot;    /* the reading role's landing buffer (unaligned pieces), made when needed */
    size_t ebuf_cap;
    /* 1 while a thread reads frames from the ring: its dedicated reader, or a module's waiting
     * thread taking the frames for its own channel (weft_agent_poll_channel). Whoever holds it
     * owns tail, ebuf and hot. */
    _Atomic int busy;
    thr_t *threads;    /* every thread that held the role (under d->mu); joined when reaped */
    _Atomic int live;  /* of those, the ones still running */
    _Atomic bool done; /* the ring is over (no role holder left) */
    _Atomic bool cut;
    /* The peer was declared lost elsewhere (its stream): the ring is read up to lose_at, then
     * the loss is declared with this status and text (under d->mu until lose is set). */
    _Atomic bool lose;
    bool lose_timed;  /* a timer declares it if the reader stays inside a delivery (d->mu) */
    bool lose_forced; /* that timer ran: the loss is declared at once (d->mu) */
    uint64_t lose_at;
    weft_status_t lose_st;
    char lose_why[256];
    _Atomic uint64_t frames, bytes;
    char broken[200]; /* why the ring cannot be read on, when its writer broke it ("": not) */
    /* How long the reading role polls an empty ring before it sleeps: up to WEFT_SHM_SPIN_US,
     * halved by each wait that polled in vain, doubled by each that polling served (0: not set
     * yet). The reading role's. */
    int64_t spin_ns;
} shm_in_t;

enum { OUT_IDLE = 0, OUT_OPENING, OUT_READY, OUT_FAILED };

/* The ring this rank writes to one peer. */
typedef struct {
    weft_agent_t *agent;
    int peer;
    pthread_mutex_t mu;       /* state, queue */
    pthread_mutex_t write_mu; /* one writer at a time */
    pthread_cond_t cv;        /* the state left OPENING */
    int state;
    weft__outmsg_t *qh, *qt; /* frames sent while the ring opens */
    pthread_t opener;
    bool opener_started;
    _Atomic bool cut;
    int sock;
    ring_hdr_t *ring;
    uint8_t *data;
    uint64_t cap;
    size_t map_len;
    uint64_t head, published; /* under write_mu */
    _Atomic uint64_t frames, bytes, waits;
    _Atomic bool watched; /* the peer's gRPC stream was opened beside the ring */
    _Atomic bool opened;  /* the handshake succeeded (frames that waited may still be flushing) */
} shm_out_t;

struct weft__shm {
    weft_agent_t *agent;
    int listen_fd;
    int wake_fd; /* eventfd: wakes the acceptor to stop */
    char address[128];
    char host[17]; /* this host's identity, 16 hex digits */
    uint64_t ring_bytes;
    int64_t spin_ns;
    pthread_t acceptor;
    bool acceptor_started;
    pthread_mutex_t mu;
    shm_in_t *ins;
    shm_out_t *outs; /* world_size entries, made at the first send (after join) */
    _Atomic bool stop;
};

/* ------------------------------------------------------------ small helpers */

/* WEFT_SHM_SLEEP_MS (50): a wake-up that never comes costs this much, so tests make it long
 * enough that one would hang them. */
static _Atomic int sleep_ms = 50;

static void futex_wait(_Atomic uint32_t *w, uint32_t val, int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    /* Shared (not private): the word lives in memory two processes map. */
    (void)syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *w)
{
    (void)syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Whether the other end of @p fd has closed (or broke); the peer never writes after its
 * handshake, so anything readable means that. */
static bool sock_gone(int fd)
{
    uint8_t b;
    ssize_t k = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) || k > 0;
}

/* Reads exactly @p n bytes by @p deadline_ns; with @p fd_p, a descriptor that came with them
 * (SCM_RIGHTS) goes there (the first one; later ones are closed). */
static bool recv_until(int fd, void *buf, size_t n, int64_t deadline_ns, int *fd_p,
                       _Atomic bool *stop)
{
    uint8_t *p = buf;
    while (n > 0) {
        int64_t left_ms = (deadline_ns - weft__now_ns()) / 1000000;
        if (left_ms <= 0 || atomic_load(stop)) {
            return false;
        }
        struct pollfd pfd = {fd, POLLIN, 0};
        int r = poll(&pfd, 1, (int)(left_ms < 100 ? left_ms : 100));
        if (r < 0 && errno != EINTR) {
            return false;
        }
        if (r <= 0) {
            continue;
        }
        struct iovec iov = {p, n};
        union {
            struct cmsghdr h;
            char buf[CMSG_SPACE(sizeof(int) * 4)];
        } ctl;
        struct msghdr mh = {0};
        mh.msg_iov = &iov;
        mh.msg_iovlen = 1;
        mh.msg_control = ctl.buf;
        mh.msg_controllen = sizeof(ctl.buf);
        ssize_t k = recvmsg(fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) {
            continue;
        }
        if (k <= 0) {
            return false;
        }
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm != NULL; cm = CMSG_NXTHDR(&mh, cm)) {
            if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) {
                continue;
            }
            size_t nfd = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < nfd; i++) {
                int got;
                memcpy(&got, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
                if (fd_p != NULL && *fd_p < 0) {
                    *fd_p = got;
                } else {
                    close(got);
                }
            }
        }
        p += k;
        n -= (size_t)k;
    }
    return true;
}

/* This host as the rings see it: the boot, the PID and network namespaces, the user and the
 * test tag. Ranks that differ in any of them never open rings to each other. */
static void host_identity(char out[17])
{
    uint64_t h = 1469598103934665603ull;
    char boot[64] = "";
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f != NULL) {
        if (fgets(boot, sizeof(boot), f) == NULL) {
            boot[0] = '\0';
        }
        fclose(f);
    }
    struct stat st;
    uint64_t vals[3] = {
        stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0,
        stat("/proc/self/ns/net", &st) == 0 ? (uint64_t)st.st_ino : 0,
        (uint64_t)getuid(),
    };
    for (const char *c = boot; *c != '\0'; c++) {
        h = (h ^ (uint8_t)*c) * 1099511628211ull;
    }
    for (int i = 0; i < 3; i++) {
        h = (h ^ vals[i]) * 1099511628211ull;
    }
    for (const char *c = weft__cfg_str(WEFT__CFG_SHM_HOST_TAG); *c != '\0'; c++) {
        h = (h ^ (uint8_t)*c) * 1099511628211ull;
    }
    snprintf(out, 17, "%016llx", (unsigned long long)h);
}

/* The socket address of a listener name (the abstract namespace: nothing in the file system). */
static socklen_t name_addr(const char *name, struct sockaddr_un *sa)
{
    size_t n = strlen(name);
    memset(sa, 0, sizeof(*sa));
    sa->sun_family = AF_UNIX;
    if (n > sizeof(sa->sun_path) - 1) {
        n = sizeof(sa->sun_path) - 1;
    }
    memcpy(sa->sun_path + 1, name, n);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

/* Whether @p peer advertises a listener on this host. */
static bool same_host(const weft__shm_t *d, const char *addr)
{
    size_t k = sizeof(NAME_PREFIX) - 1;
    return addr != NULL && strncmp(addr, NAME_PREFIX, k) == 0 && strncmp(addr + k, d->host, 16) == 0 &&
           addr[k + 16] == '-';
}

/* Maps a ring's memory; NULL on failure. */
static ring_hdr_t *map_ring(int fd, size_t len)
{
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    return p == MAP_FAILED ? NULL : p;
}

/* ------------------------------------------------------------ the reading role */

/* The ring's writer broke it (@p fmt: how): it is read no further. */
static bool in_broke(shm_in_t *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool in_broke(shm_in_t *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->broken, sizeof(c->broken), fmt, ap);
    va_end(ap);
    WEFT_WARN("shared-memory ring from rank %d: %s; closing", atomic_load(&c->peer), c->broken);
    return false;
}

/* Whether @p n (from in_avail) says the writer's position is impossible: then the ring broke. */
static bool in_corrupt(shm_in_t *c, uint64_t n)
{
    if (n != UINT64_MAX) {
        return false;
    }
    (void)in_broke(c, "its writer's position is impossible (head %llu, tail %llu, ring of %llu bytes)",
                   (unsigned long long)atomic_load(&c->ring->head),
                   (unsigned long long)atomic_load(&c->ring->tail), (unsigned long long)c->cap);
    return true;
}

/* Takes the ring for reading (busy: BUSY_READER or BUSY_POLLER); its tail is then this
 * thread's. */
enum { BUSY_READER = 1, BUSY_POLLER = 2 };
static bool in_take(shm_in_t *c, int who)
{
    int z = 0;
    if (!atomic_compare_exchange_strong(&c->busy, &z, who)) {
        return false;
    }
    c->tail = atomic_load_explicit(&c->ring->tail, memory_order_acquire);
    return true;
}

static void in_release(shm_in_t *c)
{
    atomic_store(&c->busy, 0);
}

static _Thread_local shm_in_t *tl_role; /* the ring whose reading role this thread holds */
static _Thread_local const void *tl_opener; /* the ring this thread opens (an shm_out_t) */
static _Thread_local shm_in_t *tl_dedicated; /* the ring this thread was started to read */

static void *role_main(void *arg);

/* This thread is about to block while holding a ring's reading role: a new thread takes the role
 * (the ring keeps being read), and this one ends once its work returns. */
static void role_hand_over(void)
{
    shm_in_t *c = tl_role;
    if (c == NULL) {
        return;
    }
    if (tl_dedicated != c) {
        /* A module's polling thread: the ring's own reader is there; it takes the ring back. */
        tl_role = NULL;
        in_release(c);
        futex_wake(&c->ring->reader_sleeping);
        return;
    }
    weft__shm_t *d = c->agent->shm;
    thr_t *t = weft_calloc(1, sizeof(*t));
    if (t == NULL) {
        return; /* it keeps the role: correct unless the work waits on this very ring */
    }
    t->c = c;
    pthread_mutex_lock(&d->mu);
    for (thr_t **tp = &c->threads; *tp != NULL;) {
        thr_t *e = *tp;
        if (atomic_load(&e->exited)) { /* an earlier hand-over's thread, gone */
            *tp = e->next;
            pthread_join(e->t, NULL);
            weft_free(e);
        } else {
            tp = &e->next;
        }
    }
    atomic_fetch_add(&c->live, 1);
    if (pthread_create(&t->t, NULL, role_main, t) != 0) {
        atomic_fetch_sub(&c->live, 1);
        pthread_mutex_unlock(&d->mu);
        weft_free(t);
        return;
    }
    t->next = c->threads;
    c->threads = t;
    tl_role = NULL;
    in_release(c); /* the frame being delivered was read whole: the new thread reads on */
    pthread_mutex_unlock(&d->mu);
}

static void role_block_hook(int entering, void *arg)
{
    (void)arg;
    if (entering) {
        role_hand_over();
    }
}

/* Whether the reader must stop. */
static bool in_stopped(shm_in_t *c)
{
    return atomic_load(&c->cut) || atomic_load(&c->agent->shm->stop);
}

/* Bytes written and not read yet; UINT64_MAX when the writer's position is impossible. */
static uint64_t in_avail(shm_in_t *c)
{
    /* The tail first: another reader of this process may move it on meanwhile (never past
     * the head), and the head only grows; read the other way round, a tail moved past an old
     * head would look like a corrupt ring. */
    uint64_t t, h;
    do {
        /* A consistent pair: the tail did not move while the head was read (else a head the
         * writer advanced into room freed after the tail was read looks too far ahead). */
        t = atomic_load_explicit(&c->ring->tail, memory_order_acquire);
        h = atomic_load_explicit(&c->ring->head, memory_order_acquire);
    } while (atomic_load_explicit(&c->ring->tail, memory_order_acquire) != t);
    uint64_t n = h - t;
    return n > c->cap ? UINT64_MAX : n;
}


/* Waits until there are bytes to read: false when the ring is over (the peer closed it or died
 * with nothing left to read, a lost peer, the agent closing, a corrupt position). */
static bool in_wait(shm_in_t *c)
{
    ring_hdr_t *r = c->ring;
    uint64_t n = in_avail(c);
    if (n != 0) {
        return !in_corrupt(c, n);
    }
    /* Polling pays while the writer answers within it (a ping-pong); when it does not (a peer
     * that computes between frames), every yield below is a context switch taken from ranks
     * that have work, on a host with more of them than processors: so the poll adapts, from
     * WEFT_SHM_SPIN_US down to 1/32 of it. */
    int64_t max = c->agent->shm->spin_ns;
    int64_t spin = c->spin_ns > 0 && c->spin_ns < max ? c->spin_ns : max;
    int64_t t0 = 0;
    bool crowded = false; /* a yield gave the processor to another thread */
    if (spin > 0) {
        t0 = weft__now_ns();
        int64_t end = t0 + spin, now = t0;
        do {
            for (int i = 0; i < 64; i++) {
                if ((n = in_avail(c)) != 0) {
                    c->spin_ns = spin * 2;
                    return !in_corrupt(c, n);
                }
                cpu_relax();
            }
            /* The core goes to a runnable thread (the writer, on a machine with few cores); back
             * at once if there is none. */
            int64_t before = weft__now_ns();
            sched_yield();
            now = weft__now_ns();
            crowded |= now - before > 20000;
        } while (now < end);
        c->spin_ns = spin / 2 > max / 32 ? spin / 2 : max / 32;
    }
    for (;;) {
        if (in_stopped(c)) {
            return false;
        }
        if (atomic_load(&c->lose) && (n = in_avail(c)) == 0) {
            return false; /* lost, and all it wrote was read */
        }
        atomic_store(&r->reader_sleeping, 1);
        atomic_thread_fence(memory_order_seq_cst);
        if ((n = in_avail(c)) != 0) {
            atomic_store(&r->reader_sleeping, 0);
            return !in_corrupt(c, n);
        }
        futex_wait(&r->reader_sleeping, 1, SLEEP_MS);
        atomic_store(&r->reader_sleeping, 0);
        if ((n = in_avail(c)) != 0) {
            if (t0 != 0 && !crowded) {
                /* Polling this long would have served this wait, and polling took the processor
                 * from nobody (every yield came straight back): the next polls that long. */
                int64_t waited = weft__now_ns() - t0;
                if (waited < max && 2 * waited > c->spin_ns) {
                    c->spin_ns = 2 * waited < max ? 2 * waited : max;
                }
            }
            return !in_corrupt(c, n);
        }
        if (sock_gone(c->sock)) {
            /* What was written before the peer went is still read. */
            n = in_avail(c);
            return n != 0 && !in_corrupt(c, n);
        }
    }
}

/* Copies @p n bytes out of the ring into @p buf (NULL: skips them), waiting as they come. */
static bool in_read(shm_in_t *c, void *buf, uint64_t n)
{
    ring_hdr_t *r = c->ring;
    uint8_t *p = buf;
    while (n > 0) {
        if (!in_wait(c)) {
            return false;
        }
        uint64_t k = in_avail(c);
        if (k == UINT64_MAX) {
            return false;
        }
        if (k > n) {
            k = n;
        }
        if (p != NULL) {
            uint64_t off = c->tail & (c->cap - 1);
            uint64_t first = c->cap - off < k ? c->cap - off : k;
            memcpy(p, c->data + off, first);
            memcpy(p + first, c->data, k - first);
            p += k;
        }
        c->tail += k;
        n -= k;
        atomic_store_explicit(&r->tail, c->tail, memory_order_release);
        atomic_thread_fence(memory_order_seq_cst);
        if (atomic_load_explicit(&r->writer_waiting, memory_order_relaxed) != 0) {
            atomic_store(&r->writer_waiting, 0);
            futex_wake(&r->writer_waiting);
        }
    }
    return true;
}

/* Hands @p n bytes of the ring to a landing's sink straight from the shared memory (no copy of
 * its own), piece by piece as they come. A piece is a multiple of 8 bytes (whole elements of
 * every dtype) but for the last: a few bytes split by the ring's end or not all there yet go
 * through a small copy instead. With @p aligned, pieces start 8-byte aligned (a collective's sink
 * loads elements): unaligned ones go through a hot buffer. */
static bool in_sink(shm_in_t *c, const weft_landing_t *l, uint64_t n, bool aligned)
{
    ring_hdr_t *r = c->ring;
    uint64_t done = 0;
    while (done < n) {
        if (!in_wait(c)) {
            return false;
        }
        uint64_t k = in_avail(c);
        if (k == UINT64_MAX) {
            return false;
        }
        uint64_t off = c->tail & (c->cap - 1);
        if (k > n - done) {
            k = n - done;
        }
        if (k > c->cap - off) {
            k = c->cap - off; /* up to the ring's end; the rest next time round */
        }
        if (k < n - done) {
            k &= ~(uint64_t)7;
        }
        bool odd = aligned && ((uintptr_t)(c->data + off) & 7) != 0;
        if (k > 0 && odd && c->hot == NULL) {
            c->hot = weft_alloc(HOT_BYTES); /* NULL: 8 bytes at a time below */
        }
        if (k > 0 && odd && c->hot == NULL) {
            k = 0;
        }
        if (k > 0 && odd) {
            /* Not aligned for the sink's element loads (a frame starts anywhere in the ring):
             * through a small hot buffer. */
            if (k > HOT_BYTES) {
                k = HOT_BYTES;
            }
            if (!in_read(c, c->hot, k)) {
                return false;
            }
            l->sink(l->arg, (size_t)done, c->hot, (size_t)k);
            done += k;
            continue;
        }
        if (k == 0) {
            alignas(8) uint8_t tmp[8];
            uint64_t t = n - done < 8 ? n - done : 8;
            if (!in_read(c, tmp, t)) {
                return false;
            }
            l->sink(l->arg, (size_t)done, tmp, (size_t)t);
            done += t;
            continue;
        }
        l->sink(l->arg, (size_t)done, c->data + off, (size_t)k);
        done += k;
        c->tail += k;
        atomic_store_explicit(&r->tail, c->tail, memory_order_release);
        atomic_thread_fence(memory_order_seq_cst);
        if (atomic_load_explicit(&r->writer_waiting, memory_order_relaxed) != 0) {
            atomic_store(&r->writer_waiting, 0);
            futex_wake(&r->writer_waiting);
        }
    }
    return true;
}

/* A one-way message with one tensor, on a channel whose module may say where it lands (the
 * collectives' pieces): its payload first, then the tensor's bytes, straight into the module's
 * buffer or through its sink, else into a fresh tensor; delivered in the channel's order. The
 * envelope is consumed; false when the ring is over. */
static bool read_landing(shm_in_t *c, Weft__V1__Envelope *env, const weft__module_t *mod,
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
        return in_read(c, NULL, body);
    }
    if (!in_read(c, pl, env->payload_bytes)) {
        ok = false;
        goto out;
    }
    int64_t numel = 1;
    for (size_t i = 0; i < tm->n_shape; i++) {
        numel *= tm->shape[i];
    }
    weft_landing_t l = {0};
    bool deliver = true;
    /* Mid-frame: the module's callbacks must not hand the ring over (they must not block). */
    shm_in_t *role = tl_role;
    tl_role = NULL;
    bool landing = mod->desc.lander(mod->state, peer, pl, env->payload_bytes,
                                    (weft_dtype_t)tm->dtype, numel, &l);
    if (landing) {
        ok = l.sink != NULL ? in_sink(c, &l, nb, true) : in_read(c, l.dst, nb);
        l.done(l.arg, ok);
    }
    tl_role = role;
    if (!landing) {
        weft_tensor_t *t = NULL;
        if (weft_tensor_empty((weft_dtype_t)tm->dtype, (int)tm->n_shape, tm->shape, &t) !=
                WEFT_OK ||
            weft_value_push_tensor(v, t) != WEFT_OK) {
            weft_tensor_release(t);
            WEFT_WARN("shared-memory ring from rank %d: no memory for a message; dropped", peer);
            ok = in_read(c, NULL, nb);
            deliver = false;
        } else {
            ok = in_read(c, weft_tensor_data(t), nb);
        }
    }
    if (ok) {
        atomic_fetch_add_explicit(&c->frames, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&c->bytes, body, memory_order_relaxed);
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

/* A frame's value, copied out of the ring (a RESPONSE's tensors straight into the caller's
 * memory when its call asked, weft_rpc_async_into). False when the ring broke mid-frame; *st_p a
 * refusal (no memory) with the frame's body skipped. */
static bool read_value(shm_in_t *c, const Weft__V1__Envelope *env, uint64_t body,
                       weft_value_t **v_p, weft_status_t *st_p)
{
    weft_rpc_into_t *into = NULL;
    size_t n_into = 0;
    weft_value_t *v = NULL;
    uint64_t done = 0;
    bool ok = true;
    int peer = atomic_load(&c->peer);
    bool claimed = env->kind == WEFT__V1__KIND__KIND_RESPONSE && env->n_tensors > 0 &&
                   env->status == 0 &&
                   weft__pending_claim(c->agent, env->request_id, peer, WEFT__TP_SHM, &into,
                                       &n_into);

    *v_p = NULL;
    *st_p = weft_value_create(&v);
    if (*st_p != WEFT_OK) {
        ok = in_read(c, NULL, body);
        goto out;
    }
    if (env->payload_bytes > 0) {
        void *pl = weft_alloc(env->payload_bytes);
        if (pl == NULL) {
            *st_p = weft__set_error(WEFT_ERR_NO_MEMORY, "shm: no memory for a %llu-byte payload",
                                    (unsigned long long)env->payload_bytes);
        } else if (!in_read(c, pl, env->payload_bytes)) {
            weft_free(pl);
            ok = false;
            goto out_free;
        } else {
            done += env->payload_bytes;
            *st_p = weft_value_take_payload(v, pl, env->payload_bytes);
            if (*st_p != WEFT_OK) {
                weft_free(pl);
            }
        }
    }
    for (size_t i = 0; *st_p == WEFT_OK && i < env->n_tensors; i++) {
        const Weft__V1__TensorMeta *tm = env->tensors[i];
        weft_tensor_t *t = NULL;
        weft_status_t st;
        bool fits = i < n_into && into[i].nbytes == tm->nbytes && tm->nbytes > 0 &&
                    (int)into[i].dtype == (int)tm->dtype;
        bool sink = fits && into[i].data == NULL;
        if (sink) {
            /* Handed to the caller's sink straight from the ring; an empty tensor in its place. */
            int64_t zero = 0;
            st = weft_tensor_empty((weft_dtype_t)tm->dtype, 1, &zero, &t);
        } else if (fits) {
            st = weft_tensor_wrap((weft_dtype_t)tm->dtype, (int)tm->n_shape, tm->shape,
                                  into[i].data, into[i].nbytes, WEFT_CPU, NULL, NULL, &t);
        } else {
            st = weft_tensor_empty((weft_dtype_t)tm->dtype, (int)tm->n_shape, tm->shape, &t);
        }
        bool got = true;
        if (st == WEFT_OK && sink) {
            /* Mid-frame: the sink must not hand the ring over (it must not block). */
            weft_landing_t l = {.sink = into[i].sink, .arg = into[i].sink_arg};
            shm_in_t *role = tl_role;
            tl_role = NULL;
            got = in_sink(c, &l, tm->nbytes, false);
            tl_role = role;
        } else if (st == WEFT_OK) {
            got = in_read(c, weft_tensor_data(t), tm->nbytes);
        }
        if (!got) {
            weft_tensor_release(t);
            ok = false;
            goto out_free;
        }
        if (st == WEFT_OK) {
            done += tm->nbytes;
            st = weft_value_push_tensor(v, t);
            if (st != WEFT_OK) {
                weft_tensor_release(t);
            }
        }
        *st_p = st;
    }
    if (*st_p == WEFT_OK && env->kind == WEFT__V1__KIND__KIND_ONEWAY && env->n_refs > 0) {
        /* Decoded at delivery, in the channel's order (as on a stream). */
        *st_p = weft__refs_keep_raw(env, v);
    }
    if (*st_p != WEFT_OK) {
        /* Refused: the rest of the body is skipped, the ring stays framed. */
        ok = in_read(c, NULL, body - done);
        goto out_free;
    }
    *v_p = v;
    goto out;

out_free:
    weft_value_free(v);
out:
    if (claimed) {
        weft__pending_unclaim(c->agent, env->request_id, ok);
        weft_free(into);
    }
    return ok;
}

/* Reads and delivers one frame; false when the ring is over or cannot be framed any more. */
static bool read_frame(shm_in_t *c)
{
    weft_agent_t *a = c->agent;
    int peer = atomic_load(&c->peer);
    weft__origin_t o = {WEFT__TP_SHM, peer, NULL, false};
    uint8_t lenb[4];

    if (!in_read(c, lenb, 4)) {
        return false;
    }
    uint32_t elen = weft__get_u32(lenb);
    if (elen > WEFT__MAX_ENVELOPE) {
        return in_broke(c, "an envelope of %u bytes (max %u)", elen, WEFT__MAX_ENVELOPE);
    }
    if (elen > c->ebuf_cap) {
        size_t cap = elen < 4096 ? 4096 : elen;
        uint8_t *b = weft_alloc(cap);
        if (b == NULL) {
            WEFT_WARN("shared-memory ring from rank %d: no memory for an envelope; closing", peer);
            return false;
        }
        weft_free(c->ebuf);
        c->ebuf = b;
        c->ebuf_cap = cap;
    }
    if (!in_read(c, c->ebuf, elen)) {
        return false;
    }
    Weft__V1__Envelope *env = weft__v1__envelope__unpack(&weft__pb_allocator, elen, c->ebuf);
    if (env == NULL) {
        return in_broke(c, "an envelope of %u bytes that does not decode", elen);
    }
    uint64_t body = 0;
    bool framed = true;
    weft_status_t st = weft__frame_check(env, elen, a->max_message_bytes, &body, &framed);
    if (st != WEFT_OK) {
        /* Refused before its body is read: its request is answered, or its answer fails our
         * call. Over the limit (the sender checked it: it is broken) or unframed, the ring ends. */
        bool over = st == WEFT_ERR_TOO_LARGE;
        char why[WEFT__ERROR_MAX];
        snprintf(why, sizeof(why), "%s", weft_last_error());
        bool keep = framed && !over && in_read(c, NULL, body);
        weft__set_error(st, "%s", why);
        shm_in_t *role = tl_role;
        if (!keep) {
            tl_role = NULL; /* the ring cannot be read on: nobody takes it over */
        }
        weft__deliver(a, &o, env, NULL, st);
        if (!keep) {
            tl_role = role; /* (when kept, the delivery may have handed the role on) */
        }
        return keep || in_broke(c, "%s", why);
    }
    if (env->kind == WEFT__V1__KIND__KIND_ONEWAY && env->n_tensors == 1 && env->n_refs == 0 &&
        env->payload_bytes > 0 && env->payload_bytes <= 65536 && env->channel >= 1 &&
        env->channel <= WEFT_CHANNEL_MAX) {
        const weft__module_t *mod = weft__module_at(a, env->channel);
        if (mod != NULL && mod->desc.lander != NULL) {
            return read_landing(c, env, mod, body);
        }
    }
    weft_value_t *v = NULL;
    weft_status_t vst = WEFT_OK;
    if (!read_value(c, env, body, &v, &vst)) {
        /* The ring broke mid-frame: the peer is going away. Keep the shutdown counters whole:
         * the sender counted this request. */
        if (env->kind == WEFT__V1__KIND__KIND_REQUEST &&
            (env->function == NULL || !weft__fn_internal(env->function))) {
            atomic_fetch_add(&a->requests_received, 1);
        }
        weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
        return false;
    }
    atomic_fetch_add_explicit(&c->frames, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&c->bytes, 4 + elen + body, memory_order_relaxed);
    /* Delivered on this thread: a handler, a completion, a module's callback. One that blocks
     * hands the reading role on first (role_block_hook). */
    weft__deliver(a, &o, env, v, vst);
    return true;
}

/* ------------------------------------------------------------ accepting a ring */

static bool answer(int fd, weft_status_t st, const char *text)
{
    size_t n = strlen(text);
    uint8_t hdr[8];
    weft__put_u32(hdr, (uint32_t)(int32_t)st);
    weft__put_u32(hdr + 4, (uint32_t)n);
    return weft__send_all(fd, hdr, sizeof(hdr)) && (n == 0 || weft__send_all(fd, text, n));
}

/* Checks the memory a connecting rank handed over and maps it. */
static weft_status_t take_ring(shm_in_t *c, int memfd, char *why, size_t n)
{
    struct stat st;
    if (memfd < 0) {
        snprintf(why, n, "no ring memory came with the Hello");
        return WEFT_ERR_PROTOCOL;
    }
    int seals = fcntl(memfd, F_GET_SEALS);
    if (fstat(memfd, &st) != 0 || seals < 0 || (seals & F_SEAL_SHRINK) == 0 ||
        (uint64_t)st.st_size <= RING_OFF) {
        snprintf(why, n, "the ring's memory is not a sealed memfd (size %lld, seals %d)",
                 (long long)st.st_size, seals);
        return WEFT_ERR_PROTOCOL;
    }
    uint64_t cap = (uint64_t)st.st_size - RING_OFF;
    if (cap < (64u << 10) || cap > ((uint64_t)256 << 20) || (cap & (cap - 1)) != 0) {
        snprintf(why, n, "a ring of %llu bytes (a power of two from 64 KiB to 256 MiB)",
                 (unsigned long long)cap);
        return WEFT_ERR_PROTOCOL;
    }
    ring_hdr_t *r = map_ring(memfd, (size_t)st.st_size);
    if (r == NULL) {
        snprintf(why, n, "cannot map the ring: %s", strerror(errno));
        return WEFT_ERR_NO_MEMORY;
    }
    if (r->magic != SHM_MAGIC || r->version != SHM_VERSION || r->capacity != cap ||
        atomic_load(&r->head) != 0 || atomic_load(&r->tail) != 0) {
        snprintf(why, n, "the ring's header is not a new ring (magic %08x, version %u)", r->magic,
                 r->version);
        munmap(r, (size_t)st.st_size);
        return WEFT_ERR_PROTOCOL;
    }
    c->ring = r;
    c->data = (uint8_t *)r + RING_OFF;
    c->cap = cap;
    c->map_len = (size_t)st.st_size;
    return WEFT_OK;
}

/* The listener's side of the handshake, within one deadline; the rank it proved, or -1. */
static int handshake_in(shm_in_t *c)
{
    weft_agent_t *a = c->agent;
    weft__shm_t *d = a->shm;
    int64_t deadline = weft__now_ns() + a->handshake_timeout_ms * 1000000;
    uint8_t ch[8 + WEFT__CHALLENGE_BYTES];
    uint8_t hdr[12];
    char why[512];
    int memfd = -1;
    weft__tls_id_t tls = {0};

    struct ucred cred;
    socklen_t clen = sizeof(cred);
    if (getsockopt(c->sock, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0 || cred.uid != getuid()) {
        /* The abstract namespace has no permissions: a process of another user is refused
         * before anything else. */
        snprintf(why, sizeof(why), "a shared-memory connection from another user (uid %d)",
                 (int)cred.uid);
        WEFT_WARN("refused %s", why);
        (void)answer(c->sock, WEFT_ERR_AUTH, why);
        return -1;
    }
    weft__put_u32(ch, SHM_MAGIC);
    weft__put_u32(ch + 4, SHM_VERSION);
    if (weft__random_bytes(ch + 8, WEFT__CHALLENGE_BYTES) != WEFT_OK ||
        !weft__send_all(c->sock, ch, sizeof(ch))) {
        return -1;
    }
    if (!recv_until(c->sock, hdr, sizeof(hdr), deadline, &memfd, &d->stop)) {
        WEFT_WARN("a shared-memory connection closed or timed out before its handshake");
        goto err_close_fd;
    }
    uint32_t hlen = weft__get_u32(hdr + 8);
    if (weft__get_u32(hdr) != SHM_MAGIC || weft__get_u32(hdr + 4) != SHM_VERSION || hlen > MAX_HELLO) {
        snprintf(why, sizeof(why), "bad handshake (magic %08x, version %u, hello of %u bytes)",
                 weft__get_u32(hdr), weft__get_u32(hdr + 4), hlen);
        WEFT_WARN("refused a shared-memory connection: %s", why);
        (void)answer(c->sock, weft__get_u32(hdr + 4) != SHM_VERSION ? WEFT_ERR_VERSION
                                                                : WEFT_ERR_PROTOCOL,
                     why);
        goto err_close_fd;
    }
    uint8_t *buf = weft_alloc(hlen == 0 ? 1 : hlen);
    if (buf == NULL || !recv_until(c->sock, buf, hlen, deadline, &memfd, &d->stop)) {
        weft_free(buf);
        goto err_close_fd;
    }
    Weft__V1__Hello *h = weft__v1__hello__unpack(&weft__pb_allocator, hlen, buf);
    weft_free(buf);
    weft_status_t st =
        weft__hello_check(a, h, WEFT__HELLO_SHM, ch + 8, deadline, &tls, why, sizeof(why));
    int rank = st == WEFT_OK ? h->rank : -1;
    if (h != NULL) {
        weft__v1__hello__free_unpacked(h, &weft__pb_allocator);
    }
    if (st == WEFT_OK) {
        st = take_ring(c, memfd, why, sizeof(why));
    }
    if (st == WEFT_OK) {
        /* One ring per ordered pair: a second one claiming the rank is refused. */
        pthread_mutex_lock(&d->mu);
        for (shm_in_t *o = d->ins; o != NULL; o = o->next) {
            if (o != c && !atomic_load(&o->done) && atomic_load(&o->peer) == rank) {
                st = WEFT_ERR_ALREADY_EXISTS;
                snprintf(why, sizeof(why), "rank %d has a shared-memory ring to %s already", rank,
                         a->name);
                break;
            }
        }
        if (st == WEFT_OK) {
            atomic_store(&c->peer, rank);
        }
        pthread_mutex_unlock(&d->mu);
    }
    if (memfd >= 0) {
        close(memfd); /* the mapping stays */
        memfd = -1;
    }
    if (st != WEFT_OK) {
        WEFT_WARN("refused a shared-memory connection: %s", why);
        (void)answer(c->sock, st, why);
        return -1;
    }
    /* The writer confirms it took the answer (it may have given up meanwhile: then the ring is
     * not used, and its end is no loss). Waited for a handshake's time from now, not from the
     * accept: a writer that got the answer just before the deadline has sent its ack and uses
     * the ring, which must then be read. */
    uint8_t ack = 0;
    int64_t ack_deadline = weft__now_ns() + c->agent->handshake_timeout_ms * 1000000;
    if (!answer(c->sock, WEFT_OK, "") ||
        !recv_until(c->sock, &ack, 1, ack_deadline > deadline ? ack_deadline : deadline, NULL,
                    &d->stop) ||
        ack != 1) {
        atomic_store(&c->peer, -1);
        return -1;
    }
    return rank;

err_close_fd:
    if (memfd >= 0) {
        close(memfd);
    }
    return -1;
}

/* A thread of a ring this rank reads: the first one shakes hands; each reads while it holds the
 * reading role. */
static void *role_main(void *arg)
{
    thr_t *self = arg;
    shm_in_t *c = self->c;
    weft_agent_t *a = c->agent;

    weft__nopipe_thread();
    /* The first thread shakes hands (before it holds the role: the Hello's check may wait). */
    bool ok = atomic_load(&c->peer) >= 0 || handshake_in(c) >= 0;
    tl_role = c;
    tl_dedicated = c;
    weft__set_block_hook(role_block_hook, NULL);
    while (ok && tl_role == c && !in_stopped(c)) {
        if (atomic_load(&c->lose) &&
            atomic_load_explicit(&c->ring->tail, memory_order_acquire) >= c->lose_at) {
            break;
        }
        /* Waits for a frame without holding the ring: a module's thread waiting for its own
         * messages may take them meanwhile (weft_agent_poll_channel). */
        if (!in_wait(c)) {
            break;
        }
        if (!in_take(c, BUSY_READER)) {
            sched_yield(); /* that thread is taking a frame: briefly */
            continue;
        }
        uint64_t n = in_avail(c);
        ok = n == 0 || (!in_corrupt(c, n) && read_frame(c));
        if (tl_role == c) {
            in_release(c); /* unless it was handed over meanwhile (then released there) */
        }
    }
    if (tl_role == c) {
        /* The ring is over with this thread: the peer closed it or died, was lost, or the agent
         * closes. A peer gone while the agent runs is lost (after what it wrote was read). */
        int peer = atomic_load(&c->peer);
        tl_role = NULL;
        pthread_mutex_lock(&a->shm->mu);
        atomic_store(&c->done, true); /* from here on, losses are declared at once */
        bool lose = atomic_load(&c->lose);
        pthread_mutex_unlock(&a->shm->mu);
        shutdown(c->sock, SHUT_RDWR); /* its writer, if alive, stops waiting */
        if (lose) {
            weft__agent_peer_lost(a, peer, c->lose_st, c->lose_why);
        } else if (peer >= 0 && !in_stopped(c) && !weft__agent_closing(a) &&
                   atomic_load(&a->state) < WEFT__AGENT_SHUTTING_DOWN) {
            char why[400];
            const char *who = a->peers[peer].name != NULL ? a->peers[peer].name : "?";
            if (c->broken[0] != '\0') {
                /* Its frames can no longer be found: nothing it sends arrives any more. */
                snprintf(why, sizeof(why), "%s (rank %d) broke its shared-memory ring: %s", who,
                         peer, c->broken);
            } else {
                snprintf(why, sizeof(why), "%s (rank %d) closed its shared-memory ring (it exited?)",
                         who, peer);
            }
            weft__agent_peer_lost(a, peer, WEFT_ERR_PEER_LOST, why);
        }
    }
    weft__set_block_hook(NULL, NULL);
    atomic_fetch_sub(&c->live, 1);
    atomic_store(&self->exited, true); /* the last thing it does with @p c */
    return NULL;
}

/* Frees a ring whose threads have all ended. */
static void in_free(shm_in_t *c)
{
    for (thr_t *t = c->threads; t != NULL;) {
        thr_t *next = t->next;
        pthread_join(t->t, NULL);
        weft_free(t);
        t = next;
    }
    if (c->ring != NULL) {
        munmap(c->ring, c->map_len);
    }
    close(c->sock);
    weft_free(c->ebuf);
    weft_free(c->hot);
    weft_free(c);
}

/* Unlinks and frees the rings that are over, and joins the threads of the others that have
 * ended (one ends at each hand-over). Called with d->mu held; returns the rings it unlinked. */
static shm_in_t *reap_locked(weft__shm_t *d)
{
    shm_in_t *gone = NULL;
    shm_in_t **pp = &d->ins;
    while (*pp != NULL) {
        shm_in_t *c = *pp;
        for (thr_t **tp = &c->threads; *tp != NULL;) {
            thr_t *t = *tp;
            if (atomic_load(&t->exited)) {
                *tp = t->next;
                pthread_join(t->t, NULL); /* it has returned, or is returning */
                weft_free(t);
            } else {
                tp = &t->next;
            }
        }
        if (atomic_load(&c->done) && atomic_load(&c->live) == 0) {
            *pp = c->next;
            c->next = gone;
            gone = c;
        } else {
            pp = &c->next;
        }
    }
    return gone;
}

static void free_list(shm_in_t *c)
{
    while (c != NULL) {
        shm_in_t *next = c->next;
        in_free(c);
        c = next;
    }
}

/* Connections still in their handshake. */
static int count_handshakes(weft__shm_t *d)
{
    int n = 0;
    pthread_mutex_lock(&d->mu);
    for (shm_in_t *c = d->ins; c != NULL; c = c->next) {
        n += atomic_load(&c->peer) < 0 && !atomic_load(&c->done);
    }
    pthread_mutex_unlock(&d->mu);
    return n;
}

static void *acceptor_main(void *arg)
{
    weft__shm_t *d = arg;
    weft_agent_t *a = d->agent;

    while (!atomic_load(&d->stop)) {
        struct pollfd pf[2] = {{d->listen_fd, POLLIN, 0}, {d->wake_fd, POLLIN, 0}};
        int r = poll(pf, 2, 1000);
        pthread_mutex_lock(&d->mu);
        shm_in_t *gone = reap_locked(d);
        pthread_mutex_unlock(&d->mu);
        free_list(gone);
        if (r <= 0 || (pf[0].revents & POLLIN) == 0 || atomic_load(&d->stop)) {
            continue;
        }
        int fd = accept4(d->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            continue;
        }
        if (count_handshakes(d) >= MAX_HANDSHAKES) {
            close(fd); /* so many unproven connections: one more waits for none of them */
            continue;
        }
        shm_in_t *c = weft_calloc(1, sizeof(*c));
        thr_t *t = weft_calloc(1, sizeof(*t));
        if (c == NULL || t == NULL) {
            weft_free(c);
            weft_free(t);
            close(fd);
            continue;
        }
        c->agent = a;
        c->sock = fd;
        atomic_init(&c->peer, -1);
        atomic_init(&c->live, 1);
        t->c = c;
        pthread_mutex_lock(&d->mu);
        if (pthread_create(&t->t, NULL, role_main, t) != 0) {
            pthread_mutex_unlock(&d->mu);
            weft_free(t);
            weft_free(c);
            close(fd);
            continue;
        }
        t->next = NULL;
        c->threads = t;
        c->next = d->ins;
        d->ins = c;
        pthread_mutex_unlock(&d->mu);
    }
    return NULL;
}

/* ------------------------------------------------------------ writing a ring */

static bool out_stopped(shm_out_t *o)
{
    return atomic_load(&o->cut) || atomic_load(&o->agent->shm->stop);
}

/* Makes what was written visible, and wakes the reader if it sleeps. */
static void out_publish(shm_out_t *o)
{
    ring_hdr_t *r = o->ring;
    if (o->published == o->head) {
        return;
    }
    o->published = o->head;
    atomic_store_explicit(&r->head, o->head, memory_order_release);
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&r->reader_sleeping, memory_order_relaxed) != 0) {
        atomic_store(&r->reader_sleeping, 0);
        futex_wake(&r->reader_sleeping);
    }
}

/* Room in the ring; UINT64_MAX when the reader's position is impossible. */
static uint64_t out_room(shm_out_t *o)
{
    uint64_t t = atomic_load_explicit(&o->ring->tail, memory_order_acquire);
    if (t > o->head || o->head - t > o->cap) {
        return UINT64_MAX;
    }
    return o->cap - (o->head - t);
}

/* Waits for room (back-pressure): false when the peer is gone or lost or the agent closes. */
static bool out_wait_room(shm_out_t *o)
{
    ring_hdr_t *r = o->ring;
    uint64_t n;

    out_publish(o);
    atomic_fetch_add_explicit(&o->waits, 1, memory_order_relaxed);
    int64_t spin = o->agent->shm->spin_ns;
    if (spin > 0) {
        int64_t end = weft__now_ns() + spin;
        do {
            for (int i = 0; i < 64; i++) {
                if ((n = out_room(o)) != 0) {
                    return n != UINT64_MAX;
                }
                cpu_relax();
            }
            sched_yield();
        } while (weft__now_ns() < end);
    }
    /* This may take long: the thread's blocking hook runs (a thread reading a ring lets another
     * read it meanwhile; a transport's polling thread gets a companion). */
    weft__blocking(1);
    bool ok;
    for (;;) {
        if (out_stopped(o)) {
            ok = false;
            break;
        }
        atomic_store(&r->writer_waiting, 1);
        atomic_thread_fence(memory_order_seq_cst);
        if ((n = out_room(o)) != 0) {
            atomic_store(&r->writer_waiting, 0);
            ok = n != UINT64_MAX;
            break;
        }
        futex_wait(&r->writer_waiting, 1, SLEEP_MS);
        atomic_store(&r->writer_waiting, 0);
        if ((n = out_room(o)) != 0) {
            ok = n != UINT64_MAX;
            break;
        }
        if (sock_gone(o->sock)) {
            ok = false;
            break;
        }
    }
    weft__blocking(0);
    return ok;
}

static bool out_write(shm_out_t *o, const uint8_t *p, size_t n)
{
    while (n > 0) {
        uint64_t room = out_room(o);
        if (room == 0 && !out_wait_room(o)) {
            return false;
        }
        room = out_room(o);
        if (room == UINT64_MAX) {
            return false;
        }
        uint64_t k = room < n ? room : n;
        uint64_t off = o->head & (o->cap - 1);
        uint64_t first = o->cap - off < k ? o->cap - off : k;
        memcpy(o->data + off, p, first);
        memcpy(o->data, p + first, k - first);
        o->head += k;
        p += k;
        n -= k;
        if (o->head - o->published >= PUBLISH_MIN) {
            out_publish(o); /* the reader starts on a long frame while the rest is copied */
        }
    }
    return true;
}

/* Writes a frame (the caller holds write_mu). */
static bool out_frame(shm_out_t *o, grpc_byte_buffer *bb)
{
    grpc_slice_buffer *sb = &bb->data.raw.slice_buffer;
    for (size_t i = 0; i < sb->count; i++) {
        if (!out_write(o, GRPC_SLICE_START_PTR(sb->slices[i]), GRPC_SLICE_LENGTH(sb->slices[i]))) {
            return false;
        }
    }
    out_publish(o);
    return true;
}

/* Writes @p m and settles it. */
static void write_out(shm_out_t *o, weft__outmsg_t *m)
{
    weft_agent_t *a = o->agent;

    /* While the agent closes, a frame that finds room still goes (an answer of a handler that
     * ran meanwhile); only waiting for room gives up. */
    if (pthread_mutex_trylock(&o->write_mu) != 0) {
        /* Another writer has the ring (it may wait for room): the thread's blocking hook runs
         * while this one waits its turn (as in out_wait_room). */
        weft__blocking(1);
        pthread_mutex_lock(&o->write_mu);
        weft__blocking(0);
    }
    bool ok = !atomic_load(&o->cut) && out_frame(o, m->bb);
    if (!ok) {
        /* Part of the frame may be in the ring: nothing may follow it there (the reader would
         * take the next frame's bytes for the rest of this one's body). */
        atomic_store(&o->cut, true);
    }
    pthread_mutex_unlock(&o->write_mu);
    if (ok) {
        atomic_fetch_add_explicit(&o->frames, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&o->bytes, m->nbytes, memory_order_relaxed);
        weft__outmsg_free(m, WEFT_OK, NULL);
        if (!atomic_load_explicit(&o->watched, memory_order_relaxed) &&
            !atomic_exchange(&o->watched, true)) {
            /* The first frame: the peer's gRPC stream opens beside the ring (as it would for
             * it), and its keepalive watches the peer (a stopped process, which a ring cannot
             * tell from a busy one). */
            weft__stream_t *s;
            if (weft__peer_stream(a, o->peer, &s) == WEFT_OK) {
                weft__stream_unref(s);
            }
        }
        return;
    }
    bool closed = atomic_load(&a->shm->stop);
    char why[300];
    snprintf(why, sizeof(why), "%s (rank %d) %s while a frame was written to its ring",
             a->peers[o->peer].name != NULL ? a->peers[o->peer].name : "?", o->peer,
             closed ? "was closed" : "was lost");
    if (m->user_request) {
        /* Never delivered: uncount it, or shutdown's counters cannot agree. */
        atomic_fetch_sub(&a->requests_sent, 1);
    }
    weft__outmsg_free(m, closed ? WEFT_ERR_SHUTDOWN : WEFT_ERR_PEER_LOST, why);
    if (!closed && !weft__agent_closing(a) && atomic_load(&a->state) < WEFT__AGENT_SHUTTING_DOWN) {
        weft__agent_peer_lost(a, o->peer, WEFT_ERR_PEER_LOST, why);
    }
}

/* Makes the ring's memory (sealed: neither side can shrink it under the other). */
static int make_ring(shm_out_t *o, uint64_t cap)
{
    size_t len = RING_OFF + (size_t)cap;
    int fd = memfd_create("weft-shm-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) {
        return -1;
    }
    if (ftruncate(fd, (off_t)len) != 0 ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        close(fd);
        return -1;
    }
    ring_hdr_t *r = map_ring(fd, len);
    if (r == NULL) {
        close(fd);
        return -1;
    }
    r->magic = SHM_MAGIC;
    r->version = SHM_VERSION;
    r->capacity = cap;
    o->ring = r;
    o->data = (uint8_t *)r + RING_OFF;
    o->cap = cap;
    o->map_len = len;
    return fd;
}

/* Opens the ring to o->peer; false (logged) when it cannot. */
static bool open_out(shm_out_t *o)
{
    weft_agent_t *a = o->agent;
    weft__shm_t *d = a->shm;
    int peer = o->peer;
    const char *addr = a->peers[peer].shm_address;
    int64_t deadline = weft__now_ns() + a->handshake_timeout_ms * 1000000;
    const char *why = "the peer went away during the handshake";
    uint8_t ch[8 + WEFT__CHALLENGE_BYTES];
    uint8_t sig[WEFT__ID_SIG_BYTES];
    uint8_t *hello = NULL;
    int memfd = -1;

    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        why = "no socket";
        goto err;
    }
    struct timeval tv = {(time_t)(a->handshake_timeout_ms / 1000),
                         (suseconds_t)(a->handshake_timeout_ms % 1000) * 1000};
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    struct sockaddr_un sa;
    socklen_t salen = name_addr(addr, &sa);
    if (connect(fd, (struct sockaddr *)&sa, salen) != 0) {
        why = "its listener cannot be reached";
        goto err;
    }
    /* The name is the peer's (its process and user) before anything is sent to it. */
    struct ucred cred;
    socklen_t clen = sizeof(cred);
    int name_pid = 0;
    if (sscanf(addr + sizeof(NAME_PREFIX) - 1 + 17, "%d-", &name_pid) != 1 ||
        getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0 || cred.uid != getuid() ||
        cred.pid != name_pid) {
        why = "the listener of that name is not the peer's process";
        goto err;
    }
    if (!recv_until(fd, ch, sizeof(ch), deadline, NULL, &d->stop)) {
        goto err;
    }
    if (weft__get_u32(ch) != SHM_MAGIC || weft__get_u32(ch + 4) != SHM_VERSION) {
        why = "the peer speaks another handshake";
        goto err;
    }
    if (weft__hello_sign(a, 'M', ch + 8, peer, sig) != WEFT_OK) {
        why = "cannot sign the challenge";
        goto err;
    }
    memfd = make_ring(o, d->ring_bytes);
    if (memfd < 0) {
        why = "cannot make the ring's memory (memfd)";
        goto err;
    }
    Weft__V1__Hello h = WEFT__V1__HELLO__INIT;
    weft__hello_fill(a, &h);
    h.proof.data = sig;
    h.proof.len = sizeof(sig);
    size_t hlen = weft__v1__hello__get_packed_size(&h);
    hello = weft_alloc(12 + hlen);
    if (hello == NULL) {
        why = "no memory";
        goto err;
    }
    weft__put_u32(hello, SHM_MAGIC);
    weft__put_u32(hello + 4, SHM_VERSION);
    weft__put_u32(hello + 8, (uint32_t)hlen);
    weft__v1__hello__pack(&h, hello + 12);
    /* The memfd travels with the header. */
    struct iovec iov = {hello, 12};
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } ctl;
    memset(&ctl, 0, sizeof(ctl));
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.buf;
    mh.msg_controllen = sizeof(ctl.buf);
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &memfd, sizeof(int));
    ssize_t k;
    do {
        k = sendmsg(fd, &mh, MSG_NOSIGNAL);
    } while (k < 0 && errno == EINTR);
    uint8_t ans[8];
    if (k != 12 || !weft__send_all(fd, hello + 12, hlen) ||
        !recv_until(fd, ans, sizeof(ans), deadline, NULL, &d->stop)) {
        goto err;
    }
    close(memfd);
    memfd = -1;
    int32_t status = (int32_t)weft__get_u32(ans);
    uint32_t tlen = weft__get_u32(ans + 4);
    if (status != 0) {
        char text[512] = "";
        size_t tk = tlen < sizeof(text) - 1 ? tlen : sizeof(text) - 1;
        if (recv_until(fd, text, tk, deadline, NULL, &d->stop)) {
            text[tk] = '\0';
        }
        WEFT_WARN("shared-memory ring to rank %d refused (%s): %s; its frames take the network "
                  "transports",
                  peer,
                  weft_strerror(weft_status_valid(status) ? (weft_status_t)status
                                                          : WEFT_ERR_PROTOCOL),
                  text);
        weft_free(hello);
        close(fd);
        return false;
    }
    weft_free(hello);
    uint8_t ack = 1;
    if (!weft__send_all(fd, &ack, 1)) {
        why = "the peer went away after accepting";
        goto err;
    }
    o->sock = fd;
    return true;

err:
    WEFT_WARN("shared-memory ring to rank %d failed (%s); its frames take the network transports",
              peer, why);
    weft_free(hello);
    if (memfd >= 0) {
        close(memfd);
    }
    if (fd >= 0) {
        close(fd);
    }
    return false;
}

/* Opens the ring, then sends what waited for it (there, or to the network transports). */
static void *opener_main(void *arg)
{
    shm_out_t *o = arg;
    weft_agent_t *a = o->agent;

    weft__nopipe_thread();
    tl_opener = o; /* a frame sent from a callback of its flush queues (to any peer) */
    bool ok = open_out(o);
    if (ok && !atomic_exchange(&o->watched, true)) {
        /* The peer's gRPC stream opens beside the ring before the ring carries anything: its
         * keepalive must be watching before a call waits on a peer that stops (a peer stopped
         * during the stream's handshake is found only at the handshake's deadline). */
        weft__stream_t *ws;
        if (weft__peer_stream(o->agent, o->peer, &ws) == WEFT_OK) {
            (void)weft__stream_wait_handshake(
                ws, weft__now_ns() + 2 * o->agent->handshake_timeout_ms * 1000000,
                &o->agent->shm->stop);
            weft__stream_unref(ws);
        }
    }
    atomic_store(&o->opened, ok);
    if (!ok && o->ring != NULL) {
        munmap(o->ring, o->map_len);
        o->ring = NULL;
    }
    pthread_mutex_lock(&o->mu);
    while (o->qh != NULL) {
        weft__outmsg_t *m = o->qh;
        o->qh = m->next;
        if (o->qh == NULL) {
            o->qt = NULL;
        }
        m->next = NULL;
        pthread_mutex_unlock(&o->mu);
        if (ok) {
            write_out(o, m);
        } else {
            weft__route_fallback(a, o->peer, m);
        }
        pthread_mutex_lock(&o->mu);
    }
    __atomic_store_n(&o->state, ok ? OUT_READY : OUT_FAILED, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&o->cv);
    pthread_mutex_unlock(&o->mu);
    return NULL;
}

/* ------------------------------------------------------------ the transport */

/* Starts opening the ring (o->mu held, state IDLE); false (state FAILED) when it cannot. */
static bool start_opener_locked(shm_out_t *o)
{
    if (pthread_create(&o->opener, NULL, opener_main, o) != 0) {
        __atomic_store_n(&o->state, OUT_FAILED, __ATOMIC_RELEASE);
        return false;
    }
    o->opener_started = true;
    __atomic_store_n(&o->state, OUT_OPENING, __ATOMIC_RELEASE);
    return true;
}

void weft__shm_open_all(weft_agent_t *a)
{
    weft__shm_t *d = a->shm;
    for (int i = 0; d != NULL && i < a->world_size; i++) {
        shm_out_t *o = &d->outs[i];
        if (i == a->rank || !same_host(d, a->peers[i].shm_address)) {
            continue;
        }
        pthread_mutex_lock(&o->mu);
        if (o->state == OUT_IDLE && !atomic_load(&d->stop) && !atomic_load(&o->cut)) {
            (void)start_opener_locked(o);
        }
        pthread_mutex_unlock(&o->mu);
    }
}

static weft_status_t tp_send(weft_agent_t *a, int peer, weft__stream_t *via, weft__outmsg_t *m,
                             uint32_t flags, weft__path_t *path_p)
{
    weft__shm_t *d = a->shm;
    shm_out_t *o = &d->outs[peer];

    (void)via; /* kept in the message (reply_via) for a fallback */
    (void)flags;
    (void)path_p;
    pthread_mutex_lock(&o->mu);
    if (o->state == OUT_OPENING && atomic_load(&o->opened) && tl_opener == NULL) {
        /* The ring is open and the frames that waited for it are being written: this one goes
         * after them, from this thread (the queue stays bounded). */
        pthread_mutex_unlock(&o->mu); /* the hook may send (held answers) */
        weft__blocking(1);
        pthread_mutex_lock(&o->mu);
        while (o->state == OUT_OPENING && !atomic_load(&o->cut)) {
            pthread_cond_wait(&o->cv, &o->mu);
        }
        weft__blocking(0);
    }
    /* A peer declared lost is cut only after its pending calls failed: a call made in between
     * must not go into its ring (nothing would fail it). */
    if (__atomic_load_n(&a->peers[peer].lost, __ATOMIC_ACQUIRE)) {
        atomic_store(&o->cut, true);
    }
    if ((atomic_load(&d->stop) && o->state != OUT_READY) || atomic_load(&o->cut)) {
        bool stopped = !atomic_load(&o->cut);
        pthread_mutex_unlock(&o->mu);
        weft__outmsg_free(m, stopped ? WEFT_ERR_SHUTDOWN : WEFT_ERR_PEER_LOST,
                          stopped ? "agent closed" : "peer lost");
        return stopped ? weft__set_error(WEFT_ERR_SHUTDOWN, "rpc: the agent is closed")
                       : weft__set_error(WEFT_ERR_PEER_LOST, "rpc: rank %d was lost", peer);
    }
    switch (o->state) {
    case OUT_READY:
        pthread_mutex_unlock(&o->mu);
        write_out(o, m);
        return WEFT_OK;
    case OUT_FAILED:
        pthread_mutex_unlock(&o->mu);
        weft__route_fallback(a, peer, m);
        return WEFT_OK;
    case OUT_IDLE:
        if (!start_opener_locked(o)) {
            pthread_mutex_unlock(&o->mu);
            weft__route_fallback(a, peer, m);
            return WEFT_OK;
        }
        /* fallthrough */
    default:
        /* Opening: in order behind the frames that wait already. */
        if (o->qt == NULL) {
            o->qh = o->qt = m;
        } else {
            o->qt->next = m;
            o->qt = m;
        }
        pthread_mutex_unlock(&o->mu);
        return WEFT_OK;
    }
}

static bool tp_usable(weft_agent_t *a, int peer)
{
    weft__shm_t *d = a->shm;
    if (d == NULL || d->outs == NULL || peer < 0 || peer >= a->world_size || peer == a->rank) {
        return false;
    }
    shm_out_t *o = &d->outs[peer];
    /* The state only ever leaves IDLE, and FAILED is final: read without the lock. While the
     * agent closes, an open ring still carries what finds room in it. */
    int state = __atomic_load_n(&o->state, __ATOMIC_ACQUIRE);
    if (atomic_load(&d->stop)) {
        return state == OUT_READY && !atomic_load(&o->cut);
    }
    return state != OUT_FAILED && !atomic_load(&o->cut) && same_host(d, a->peers[peer].shm_address);
}

static void tp_cut(weft_agent_t *a, int peer)
{
    weft__shm_t *d = a->shm;
    if (d == NULL || d->outs == NULL || peer < 0 || peer >= a->world_size) {
        return;
    }
    shm_out_t *o = &d->outs[peer];
    pthread_mutex_lock(&o->mu);
    atomic_store(&o->cut, true);
    pthread_cond_broadcast(&o->cv);
    if (o->state == OUT_READY && o->ring != NULL) {
        futex_wake(&o->ring->writer_waiting); /* a writer held by the full ring gives up */
    }
    pthread_mutex_unlock(&o->mu);
    /* And what comes from it: its reader stops (what it wrote is of a lost peer). */
    pthread_mutex_lock(&d->mu);
    for (shm_in_t *c = d->ins; c != NULL; c = c->next) {
        if (atomic_load(&c->peer) == peer && !atomic_load(&c->done)) {
            atomic_store(&c->cut, true);
            if (c->ring != NULL) {
                futex_wake(&c->ring->reader_sleeping);
            }
        }
    }
    pthread_mutex_unlock(&d->mu);
}

static void tp_stop(weft_agent_t *a)
{
    weft__shm_t *d = a->shm;
    if (d == NULL) {
        return;
    }
    atomic_store(&d->stop, true);
    if (a->timer != NULL) {
        weft__timer_cancel_owner(a->timer, d); /* no deferred loss is forced from here on */
    }
    if (d->acceptor_started) {
        uint64_t one = 1;
        ssize_t k = write(d->wake_fd, &one, sizeof(one));
        (void)k;
        pthread_join(d->acceptor, NULL);
        d->acceptor_started = false;
    }
    /* Writers held by a full ring and openers give up; then the rings close. */
    for (int i = 0; d->outs != NULL && i < a->world_size; i++) {
        shm_out_t *o = &d->outs[i];
        pthread_mutex_lock(&o->mu);
        bool started = o->opener_started;
        o->opener_started = false;
        pthread_mutex_unlock(&o->mu);
        if (started) {
            pthread_join(o->opener, NULL);
        }
        pthread_mutex_lock(&o->mu);
        if (o->ring != NULL && o->state == OUT_READY) {
            futex_wake(&o->ring->writer_waiting);
        }
        pthread_mutex_unlock(&o->mu);
    }
    /* Readers read no further frame; a thread delivering one finishes it (weft__shm_destroy
     * joins them), and what it sends still goes out through open rings until then. */
    pthread_mutex_lock(&d->mu);
    for (shm_in_t *c = d->ins; c != NULL; c = c->next) {
        atomic_store(&c->cut, true);
        if (c->ring != NULL) {
            futex_wake(&c->ring->reader_sleeping);
        }
        shutdown(c->sock, SHUT_RDWR);
    }
    pthread_mutex_unlock(&d->mu);
}

const weft__transport_t weft__shm_transport = {
    .name = "shared memory",
    .send = tp_send,
    .usable = tp_usable,
    .cut = tp_cut,
    .stop = tp_stop,
};

/* ------------------------------------------------------------ lifecycle */

weft_status_t weft__shm_create(weft_agent_t *a)
{
    if (!weft__cfg_bool(WEFT__CFG_SHM)) {
        return WEFT_OK;
    }
    weft__shm_t *d = weft_calloc(1, sizeof(*d));
    if (d == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "shm: no memory");
    }
    d->agent = a;
    d->listen_fd = -1;
    d->wake_fd = -1;
    pthread_mutex_init(&d->mu, NULL);
    host_identity(d->host);
    uint64_t kb = (uint64_t)weft__cfg_int(WEFT__CFG_SHM_RING_KB);
    uint64_t bytes = (uint64_t)64 << 10;
    while (bytes < kb * 1024 && bytes < ((uint64_t)256 << 20)) {
        bytes <<= 1; /* rounded up to a power of two */
    }
    d->ring_bytes = bytes;
    d->spin_ns = weft__cfg_int(WEFT__CFG_SHM_SPIN_US) * 1000;
    atomic_store_explicit(&sleep_ms, (int)weft__cfg_int(WEFT__CFG_SHM_SLEEP_MS),
                          memory_order_relaxed);
    d->outs = weft_calloc((size_t)a->world_size, sizeof(*d->outs));
    uint8_t rnd[8];
    if (d->outs == NULL || weft__random_bytes(rnd, sizeof(rnd)) != WEFT_OK) {
        goto err_free;
    }
    for (int i = 0; i < a->world_size; i++) {
        shm_out_t *o = &d->outs[i];
        o->agent = a;
        o->peer = i;
        o->sock = -1;
        pthread_mutex_init(&o->mu, NULL);
        pthread_mutex_init(&o->write_mu, NULL);
        pthread_cond_init(&o->cv, NULL);
    }
    snprintf(d->address, sizeof(d->address), NAME_PREFIX "%s-%d-%02x%02x%02x%02x%02x%02x%02x%02x",
             d->host, (int)getpid(), rnd[0], rnd[1], rnd[2], rnd[3], rnd[4], rnd[5], rnd[6],
             rnd[7]);
    d->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    d->wake_fd = eventfd(0, EFD_CLOEXEC);
    struct sockaddr_un sa;
    socklen_t salen = name_addr(d->address, &sa);
    if (d->listen_fd < 0 || d->wake_fd < 0 || bind(d->listen_fd, (struct sockaddr *)&sa, salen) != 0 ||
        listen(d->listen_fd, 128) != 0) {
        WEFT_WARN("shared memory: cannot listen (%s); frames between ranks of this host take the "
                  "network transports",
                  strerror(errno));
        goto err_free;
    }
    a->shm = d;
    if (pthread_create(&d->acceptor, NULL, acceptor_main, d) != 0) {
        a->shm = NULL;
        goto err_free;
    }
    d->acceptor_started = true;
    return WEFT_OK;

err_free:
    if (d->listen_fd >= 0) {
        close(d->listen_fd);
    }
    if (d->wake_fd >= 0) {
        close(d->wake_fd);
    }
    for (int i = 0; d->outs != NULL && i < a->world_size; i++) {
        pthread_mutex_destroy(&d->outs[i].mu);
        pthread_mutex_destroy(&d->outs[i].write_mu);
        pthread_cond_destroy(&d->outs[i].cv);
    }
    weft_free(d->outs);
    pthread_mutex_destroy(&d->mu);
    weft_free(d);
    return WEFT_OK; /* the other transports carry everything */
}

const char *weft__shm_address(const weft_agent_t *a)
{
    return a->shm != NULL ? a->shm->address : "";
}

void weft__shm_destroy(weft_agent_t *a)
{
    weft__shm_t *d = a->shm;
    if (d == NULL) {
        return;
    }
    /* The rings' threads: the last ones finish what they deliver (the calls they wait on have
     * failed by now: the agent failed every pending call). */
    for (;;) {
        pthread_mutex_lock(&d->mu);
        shm_in_t *gone = reap_locked(d);
        shm_in_t *left = d->ins;
        pthread_mutex_unlock(&d->mu);
        free_list(gone);
        if (left == NULL) {
            break;
        }
        /* Wait for the next one to end: join any thread of the first ring still listed. */
        pthread_mutex_lock(&d->mu);
        thr_t *t = left->threads;
        left->threads = NULL;
        pthread_mutex_unlock(&d->mu);
        for (; t != NULL;) {
            thr_t *next = t->next;
            pthread_join(t->t, NULL);
            weft_free(t);
            t = next;
        }
    }
    for (int i = 0; i < a->world_size; i++) {
        shm_out_t *o = &d->outs[i];
        weft__outmsg_t *m = o->qh;
        if (o->sock >= 0) {
            shutdown(o->sock, SHUT_RDWR); /* the peer reads what is in the ring, then the end */
        }
        while (m != NULL) {
            weft__outmsg_t *next = m->next;
            weft__outmsg_free(m, WEFT_ERR_SHUTDOWN, "agent closed");
            m = next;
        }
        if (o->ring != NULL) {
            munmap(o->ring, o->map_len);
        }
        if (o->sock >= 0) {
            close(o->sock);
        }
        pthread_mutex_destroy(&o->mu);
        pthread_mutex_destroy(&o->write_mu);
        pthread_cond_destroy(&o->cv);
    }
    weft_free(d->outs);
    close(d->listen_fd);
    close(d->wake_fd);
    pthread_mutex_destroy(&d->mu);
    a->shm = NULL;
    weft_free(d);
}

/* Copies @p n bytes at @p at bytes past the tail out of the ring, without consuming them. */
static void in_peek(shm_in_t *c, uint64_t at, void *buf, uint64_t n)
{
    uint64_t off = (c->tail + at) & (c->cap - 1);
    uint64_t first = c->cap - off < n ? c->cap - off : n;
    memcpy(buf, c->data + off, first);
    memcpy((uint8_t *)buf + first, c->data, n - first);
}

/* Whether the ring's next frame is a one-way message on @p channel that is there whole (the
 * caller holds the ring). */
static bool next_is_whole_on(shm_in_t *c, uint32_t channel)
{
    uint64_t avail = in_avail(c);
    uint8_t lenb[4];
    if (avail == UINT64_MAX || avail < 4) {
        return false;
    }
    in_peek(c, 0, lenb, 4);
    uint32_t elen = weft__get_u32(lenb);
    if (elen > WEFT__MAX_ENVELOPE || avail < 4 + (uint64_t)elen) {
        return false;
    }
    if (elen > c->ebuf_cap) {
        size_t cap = elen < 4096 ? 4096 : elen;
        uint8_t *b = weft_alloc(cap);
        if (b == NULL) {
            return false;
        }
        weft_free(c->ebuf);
        c->ebuf = b;
        c->ebuf_cap = cap;
    }
    in_peek(c, 4, c->ebuf, elen);
    Weft__V1__Envelope *env = weft__v1__envelope__unpack(&weft__pb_allocator, elen, c->ebuf);
    if (env == NULL) {
        return false;
    }
    uint64_t body = 0;
    bool framed = true;
    bool ok = env->kind == WEFT__V1__KIND__KIND_ONEWAY && env->channel == channel &&
              weft__frame_check(env, elen, c->agent->max_message_bytes, &body, &framed) ==
                  WEFT_OK &&
              avail - 4 - elen >= body;
    weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
    return ok;
}

#define POLL_RINGS 64

size_t weft_agent_poll_channel(weft_agent_t *a, uint32_t channel)
{
    weft__shm_t *d = a != NULL ? a->shm : NULL;
    shm_in_t *cand[POLL_RINGS];
    int nc = 0;
    size_t n = 0;

    if (d == NULL || channel < 1 || channel > WEFT_CHANNEL_MAX) {
        return 0;
    }
    /* The rings with something in them, held (live) so that none is freed meanwhile. */
    pthread_mutex_lock(&d->mu);
    for (shm_in_t *c = d->ins; c != NULL && nc < POLL_RINGS; c = c->next) {
        if (!atomic_load(&c->done) && atomic_load(&c->peer) >= 0 && c->ring != NULL &&
            atomic_load(&c->busy) == 0 && in_avail(c) != 0) {
            atomic_fetch_add(&c->live, 1);
            cand[nc++] = c;
        }
    }
    pthread_mutex_unlock(&d->mu);
    for (int i = 0; i < nc; i++) {
        shm_in_t *c = cand[i];
        if (in_stopped(c) || atomic_load(&c->lose) || !in_take(c, BUSY_POLLER)) {
            continue;
        }
        /* Only whole frames for this channel, in the ring's order: it never waits for bytes.
         * The module's callback may complete futures whose callbacks block: then the ring goes
         * back to its reader (role_hand_over), as from a reader thread. */
        weft__block_hook_cb_t saved_cb;
        void *saved_arg;
        weft__get_block_hook(&saved_cb, &saved_arg);
        shm_in_t *saved_role = tl_role;
        tl_role = c;
        weft__set_block_hook(role_block_hook, NULL);
        while (tl_role == c && !atomic_load(&c->lose) && next_is_whole_on(c, channel) &&
               read_frame(c)) {
            n++;
        }
        if (tl_role == c) {
            in_release(c);
        }
        tl_role = saved_role;
        weft__set_block_hook(saved_cb, saved_arg);
    }
    pthread_mutex_lock(&d->mu);
    for (int i = 0; i < nc; i++) {
        atomic_fetch_sub(&cand[i]->live, 1);
    }
    pthread_mutex_unlock(&d->mu);
    return n;
}

/* Timer: a deferred loss whose ring's reader did not get to it in time is declared now. */
static void force_loss(void *arg, uint64_t data)
{
    weft_agent_t *a = arg;
    weft__shm_t *d = a->shm;
    int peer = (int)data;
    bool found = false;
    weft_status_t st = WEFT_ERR_PEER_LOST;
    char why[256] = "";
    if (d == NULL) {
        return; /* the transport is gone (the agent closes) */
    }
    pthread_mutex_lock(&d->mu);
    for (shm_in_t *c = d->ins; c != NULL; c = c->next) {
        if (atomic_load(&c->peer) == peer && atomic_load(&c->lose) && !c->lose_forced &&
            !atomic_load(&c->done)) {
            c->lose_forced = true;
            st = c->lose_st;
            snprintf(why, sizeof(why), "%s", c->lose_why);
            found = true;
        }
    }
    pthread_mutex_unlock(&d->mu);
    if (found) {
        weft__agent_peer_lost(a, peer, st, why);
    }
}

bool weft__shm_defer_loss(weft_agent_t *a, int peer, weft_status_t st, const char *why)
{
    weft__shm_t *d = a->shm;
    bool deferred = false;
    if (d == NULL) {
        return false;
    }
    pthread_mutex_lock(&d->mu);
    for (shm_in_t *c = d->ins; c != NULL && !deferred; c = c->next) {
        if (atomic_load(&c->peer) != peer || atomic_load(&c->done) || c->ring == NULL) {
            continue;
        }
        if (c->lose_forced || in_avail(c) == 0) {
            /* Nothing left to read first, or it waited its time: the loss is declared now. */
            break;
        }
        if (!atomic_load(&c->lose)) {
            c->lose_at = atomic_load_explicit(&c->ring->head, memory_order_acquire);
            c->lose_st = st;
            snprintf(c->lose_why, sizeof(c->lose_why), "%s", why != NULL ? why : "peer lost");
            atomic_store(&c->lose, true);
            futex_wake(&c->ring->reader_sleeping);
        }
        if (!c->lose_timed && a->timer != NULL && !atomic_load(&d->stop)) {
            /* Its reader may be inside a delivery, or start one before it reaches the loss,
             * which may not come back soon (a handler that computes or blocks): within a peer
             * timeout the loss is declared anyway. */
            c->lose_timed = weft__timer_add(a->timer,
                                            weft__now_ns() + a->peer_timeout_ms * 1000000,
                                            force_loss, NULL, a, (uint64_t)peer, d) != 0;
        }
        deferred = true;
    }
    pthread_mutex_unlock(&d->mu);
    return deferred;
}

/* ------------------------------------------------------------ public */

const char *weft_agent_worker_shm_address(const weft_agent_t *a, int rank)
{
    if (a == NULL || a->peers == NULL || rank < 0 || rank >= a->world_size) {
        return "";
    }
    return a->peers[rank].shm_address != NULL ? a->peers[rank].shm_address : "";
}

weft_status_t weft_agent_shm_stats(const weft_agent_t *a, int rank, weft_shm_stats_t *stats_p)
{
    if (a == NULL || stats_p == NULL || rank < 0 || rank >= a->world_size) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "agent_shm_stats: bad agent, rank or output");
    }
    weft_shm_stats_t s = {0};
    weft__shm_t *d = a->shm;
    if (d != NULL) {
        shm_out_t *o = &d->outs[rank];
        s.ring_open = atomic_load(&o->opened) && !atomic_load(&o->cut);
        s.frames_sent = atomic_load(&o->frames);
        s.bytes_sent = atomic_load(&o->bytes);
        s.writer_waits = atomic_load(&o->waits);
        pthread_mutex_lock(&d->mu);
        for (shm_in_t *c = d->ins; c != NULL; c = c->next) {
            if (atomic_load(&c->peer) == rank) {
                s.frames_received += atomic_load(&c->frames);
                s.bytes_received += atomic_load(&c->bytes);
            }
        }
        pthread_mutex_unlock(&d->mu);
    }
    *stats_p = s;
    return WEFT_OK;
}
