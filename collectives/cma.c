/* Collectives between ranks on one host by cross-memory attach (process_vm_readv): each rank
 * pulls what it needs straight from the other ranks' buffers. One kernel copy per byte moved
 * (TCP: two, plus the socket's system calls and wake-ups); the messages that carry the
 * addresses and say when a rank is done go over the agent's connections like every other
 * piece.
 *
 *   all_reduce      each rank pulls its chunk of every other rank's buffer, reduces it in a
 *                   cache-resident buffer, then pulls the other ranks' reduced chunks
 *   broadcast       every other rank pulls the root's buffer
 *   all_gather      each rank pulls every other rank's input into its part of the output
 *   reduce_scatter  each rank pulls its part of every other rank's input and reduces them,
 *                   in rank order
 *   all_to_all      each rank pulls from every other rank the part of its input meant for it
 *
 * Ranks only ever read each other, never write. A rank keeps what it announced unchanged
 * while others may read it: from its HELLO until every other rank's FIN. A rank that leaves
 * the operation early (a failure, a deadline) clears its epoch word first; a reader checks
 * that word after reading, so that bytes read after the owner left become an error, never a
 * wrong result.
 *
 * Whether the reads work (same host, same user, the system call allowed) is settled by a
 * vote on the first such operation of a group: every rank reads every other's epoch word,
 * and all ranks fall back to the other algorithms together unless every read worked
 * everywhere. */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

/* The steps of the messages of these algorithms (the ring's are below 2^31, basic.c's
 * VERIFY_STEP is 0xffff0000: an operation that falls back never meets them). */
#define CMA_STEP_HELLO 0xfff00000u
#define CMA_STEP_VOTE  0xfff00001u
#define CMA_STEP_DONE  0xfff00002u
#define CMA_STEP_FIN   0xfff00003u

/* Pulled and reduced in pieces this large: two of them stay in cache. */
#define CMA_SEG_BYTES (256u << 10)

/* oneshot's area: a word (the operations this rank finished), two slots (a header, then up
 * to COLL_ONESHOT_MAX_BYTES), then two scratch buffers of that size. */
#define ONESHOT_HDR_BYTES  64u
#define ONESHOT_SLOT_BYTES (ONESHOT_HDR_BYTES + COLL_ONESHOT_MAX_BYTES)
#define ONESHOT_AREA_BYTES (ONESHOT_HDR_BYTES + 2 * ONESHOT_SLOT_BYTES + 2 * COLL_ONESHOT_MAX_BYTES)

/* The HELLO: what a rank tells every other about itself and its buffer; an operation may
 * add words of its own after these (all_to_all: its split lists). */
enum { H_PID, H_ADDR, H_BYTES, H_EPOCH_ADDR, H_EPOCH, H_WILLING, H_NEED_VOTE, H_HOST, H_N };

/* How an operation signals (coll_cma_board_t.mode). */
#define CMA_MODE_BOARDS   1u
#define CMA_MODE_MESSAGES 2u

/* A wait on the boards looks, yielding the processor in between, this many times (a look
 * and a yield: about 2 us when nothing else runs; 1000 measured slower at 4 ranks on 2
 * cores), then naps this long between looks: a member late by more than some 40 ms costs the
 * waiters little processor time. */
#define CMA_SPINS  20000
#define CMA_NAP_NS 50000

/* Votes: every other rank can be read; one cannot; one has already left the operation (no
 * verdict: the operation fails everywhere and the next one votes again). */
enum { VOTE_NO = 0, VOTE_YES = 1, VOTE_LEFT = 2 };

typedef struct {
    pid_t pid;
    uint64_t addr, bytes, epoch_addr, epoch;
} cma_peer_t;

/* One operation's reads: what every member announced, and the messages sent. Opened by
 * cma_open, closed by cma_close, whatever happened in between. */
typedef struct {
    coll_group_t *g;
    const coll_desc_t *d;
    int64_t deadline;
    uint64_t epoch;    /* this operation's value of the epoch words */
    bool fast;         /* signalled on the boards (the group settled), not by messages */
    bool nap;          /* a long wait with nothing to do: nap from the start (wait_a_bit) */
    cma_peer_t *peers; /* by group rank */
    int64_t *hello;    /* ours, H_N + nextra words (sent without copying) */
    int64_t *extra;    /* n rows of nextra words: what each member added (ours too) */
    size_t nextra;
    weft_future_t **rel; /* HELLO to r at r, VOTE to r at n + r */
} cma_t;

static _Atomic long cma_ops;

long coll__cma_ops(void)
{
    return atomic_load(&cma_ops);
}

/* Whether the system call works on this process's own memory. Allows same-user peers to
 * read it where Yama restricts ptrace to descendants (ptrace_scope 1), as MPI's CMA
 * transports do. */
static bool self_readable(void)
{
    /* 0 not yet, 1 works, -1 does not; for the process that probed (a forked child probes
     * again: the Yama exception is not inherited). */
    static _Atomic int probed;
    static _Atomic pid_t probed_by;

    int p = atomic_load(&probed_by) == getpid() ? atomic_load(&probed) : 0;
    if (p == 0) {
        uint64_t src = 0x5745465443u, dst = 0;
        struct iovec l = {&dst, sizeof(dst)}, r = {&src, sizeof(src)};
        p = process_vm_readv(getpid(), &l, 1, &r, 1, 0) == (ssize_t)sizeof(dst) && dst == src ? 1
                                                                                              : -1;
        if (p == 1) {
#ifdef PR_SET_PTRACER
            (void)prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0); /* EINVAL without Yama */
#endif
        }
        atomic_store(&probed, p);
        atomic_store(&probed_by, getpid());
    }
    return p == 1;
}

/* The processors this process may run on, read once. */
static int online_processors(void)
{
    static _Atomic int n;
    int v = atomic_load(&n);
    if (v == 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        v = c > 0 && c < INT32_MAX ? (int)c : 1;
        atomic_store(&n, v);
    }
    return v;
}

/* This host and PID namespace: ranks that differ here never read each other. */
static int64_t host_id(void)
{
    static _Atomic int64_t id;
    int64_t v = atomic_load(&id);

    if (v == 0) {
        uint64_t h = 1469598103934665603ull;
        char boot[64] = "";
        FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
        if (f != NULL) {
            if (fgets(boot, sizeof(boot), f) == NULL) {
                boot[0] = '\0';
            }
            fclose(f);
        }
        struct stat ns;
        uint64_t ino = stat("/proc/self/ns/pid", &ns) == 0 ? (uint64_t)ns.st_ino : 0;
        for (const char *c = boot; *c != '\0'; c++) {
            h = (h ^ (uint8_t)*c) * 1099511628211ull;
        }
        h = (h ^ ino) * 1099511628211ull;
        v = (int64_t)(h >> 1) | 1;
        atomic_store(&id, v);
    }
    return v;
}

/* ------------------------------------------------------------ reading a member's memory */

/* Reads @p n bytes at @p off of group rank @p q's announced region @p base (@p limit bytes
 * long) into @p dst. */
static weft_status_t pull(const cma_t *c, int q, uint64_t base, uint64_t limit, uint64_t off,
                          void *dst, size_t n)
{
    const cma_peer_t *p = &c->peers[q];
    const char *what = coll__kind_name(c->d->kind);

    if (off > limit || n > limit - off) {
        return weft__set_error(WEFT_ERR_PROTOCOL,
                               "%s: read of %zu bytes at %llu is outside the %llu bytes group "
                               "rank %d announced",
                               what, n, (unsigned long long)off, (unsigned long long)limit, q);
    }
    uint8_t *d = dst;
    while (n > 0) {
        struct iovec l = {d, n}, r = {(void *)(uintptr_t)(base + off), n};
        ssize_t got = process_vm_readv(p->pid, &l, 1, &r, 1, 0);
        if (got <= 0) {
            int e = got < 0 ? errno : EIO;
            if (e == ESRCH) {
                return weft__set_error(WEFT_ERR_PEER_LOST, "%s: group rank %d (pid %d) is gone",
                                       what, q, (int)p->pid);
            }
            if (e == EFAULT) {
                return weft__set_error(WEFT_ERR_PROTOCOL,
                                       "%s: group rank %d announced memory it does not have "
                                       "(pid %d, 0x%llx)",
                                       what, q, (int)p->pid, (unsigned long long)(base + off));
            }
            return weft__set_error(WEFT_ERR_TRANSPORT,
                                   "%s: cross-memory read from group rank %d (pid %d) failed: %s",
                                   what, q, (int)p->pid, strerror(e));
        }
        d += got;
        off += (uint64_t)got;
        n -= (size_t)got;
    }
    return WEFT_OK;
}

/* Whether group rank @p q is still in the operation: its epoch word still holds the value
 * it announced. Everything read from it before this check was read while it was. */
static weft_status_t still_there(const cma_t *c, int q)
{
    const cma_peer_t *p = &c->peers[q];
    uint64_t e = 0;
    WEFT_CHECK(pull(c, q, p->epoch_addr, sizeof(e), 0, &e, sizeof(e)));
    if (e != p->epoch) {
        /* Not PEER_LOST: the rank may be alive, having given up (a deadline, a failure). */
        return weft__set_error(WEFT_ERR_TRANSPORT,
                               "%s: group rank %d left the operation while its buffer was being "
                               "read",
                               coll__kind_name(c->d->kind), q);
    }
    return WEFT_OK;
}

/* Reads @p n bytes at @p off of @p q's announced buffer; a failed read of an owner that has
 * left says so. The caller checks still_there() once done reading @p q. */
static weft_status_t cma_read(const cma_t *c, int q, uint64_t off, void *dst, size_t n)
{
    const cma_peer_t *p = &c->peers[q];
    weft_status_t st = pull(c, q, p->addr, p->bytes, off, dst, n);
    if (st != WEFT_OK && st != WEFT_ERR_PEER_LOST) {
        char why[WEFT__ERROR_MAX];
        snprintf(why, sizeof(why), "%s", weft_last_error());
        weft_status_t there = still_there(c, q);
        if (there != WEFT_OK) {
            return there;
        }
        return weft__set_error(st, "%s", why);
    }
    return st;
}

/* The value of the epoch word while operation @p seq runs: never 0, and differs between
 * operations and groups. */
static uint64_t epoch_of(const coll_group_t *g, uint64_t seq)
{
    uint64_t x = (seq + 1) * 0x9e3779b97f4a7c15ull ^ ((uint64_t)g->id << 32) ^ g->hash;
    return x != 0 ? x : 1;
}

/* ------------------------------------------------------------ an operation's reads */

/* Reads group rank @p q's board (once the group settled). */
static weft_status_t read_board(const cma_t *c, int q, coll_cma_board_t *b)
{
    return pull(c, q, c->g->cma_boards[q], sizeof(*b), 0, b, sizeof(*b));
}

/* One more round of a wait on the members' boards: fails as a wait on a piece would (an
 * abort, a lost member, the deadline); yields the processor, then, past a while, sleeps. */
static weft_status_t wait_a_bit(cma_t *c, int *spins)
{
    if ((*spins)++ % 8 == 0) {
        WEFT_CHECK(coll__check(c->g, c->d, c->deadline));
    }
    if (*spins < CMA_SPINS && !c->nap) {
        sched_yield();
    } else {
        struct timespec ts = {0, CMA_NAP_NS};
        nanosleep(&ts, NULL);
    }
    return WEFT_OK;
}

/* Tells the members this rank reached @p step (DONE: to all; FIN: to @p r). */
static weft_status_t cma_tell(cma_t *c, uint32_t step, int r)
{
    return coll__send(c->g, c->d, step, r, NULL, 0, WEFT_U8, NULL);
}

/* This rank reduced its chunk (all_reduce): the others may read it. */
static weft_status_t cma_reduced(cma_t *c)
{
    atomic_store(&c->g->cma_board.done, c->d->seq + 1);
    for (int r = 0; r < c->g->size && !c->fast; r++) {
        if (r != c->g->rank) {
            WEFT_CHECK(cma_tell(c, CMA_STEP_DONE, r));
        }
    }
    return WEFT_OK;
}

/* This rank read all it needed of the others (each checked and told by cma_done_with). */
static void cma_finished(cma_t *c)
{
    atomic_store(&c->g->cma_board.fin, c->d->seq + 1);
}

/* Waits until group rank @p r reached @p step (DONE, FIN). On the boards, the words hold
 * exactly this operation's seq + 1 then: the rank cannot be further while this one waits
 * (and a torn read never shows that value). */
static weft_status_t cma_await(cma_t *c, uint32_t step, int r)
{
    if (!c->fast) {
        coll_msg_t *m;
        WEFT_CHECK(coll__recv(c->g, c->d, step, r, c->deadline, &m));
        coll__msg_free(m);
        return WEFT_OK;
    }
    for (int spins = 0;;) {
        coll_cma_board_t b;
        WEFT_CHECK(read_board(c, r, &b));
        if ((step == CMA_STEP_DONE ? b.done : b.fin) == c->d->seq + 1) {
            return WEFT_OK;
        }
        WEFT_CHECK(wait_a_bit(c, &spins));
    }
}

/* Waits for every other rank's FIN: nobody reads this rank any more. */
static weft_status_t cma_await_all(cma_t *c)
{
    for (int k = 1; k < c->g->size; k++) {
        WEFT_CHECK(cma_await(c, CMA_STEP_FIN, (c->g->rank + k) % c->g->size));
    }
    return WEFT_OK;
}

/* Checks that group rank @p q is still there after this rank read what it needed of it, and
 * tells it so (its FIN; on the boards, cma_finished says it for all). */
static weft_status_t cma_done_with(cma_t *c, int q)
{
    WEFT_CHECK(still_there(c, q));
    return c->fast ? WEFT_OK : cma_tell(c, CMA_STEP_FIN, q);
}

/* Takes group rank @p r's HELLO words @p h into c->peers[r] and c->extra's row r; ANDs its
 * willingness into *willing_p and ORs its need of a vote into *vote_p. */
static weft_status_t take_hello(cma_t *c, int r, const int64_t *h, uint64_t bytes, bool same_bytes,
                                bool *willing_p, bool *vote_p)
{
    const char *what = coll__kind_name(c->d->kind);

    if (h[H_PID] <= 0 || h[H_PID] > INT32_MAX) {
        return weft__set_error(WEFT_ERR_PROTOCOL, "%s: group rank %d announced process id %lld",
                               what, r, (long long)h[H_PID]);
    }
    cma_peer_t *p = &c->peers[r];
    p->pid = (pid_t)h[H_PID];
    p->addr = (uint64_t)h[H_ADDR];
    p->bytes = (uint64_t)h[H_BYTES];
    p->epoch_addr = (uint64_t)h[H_EPOCH_ADDR];
    p->epoch = (uint64_t)h[H_EPOCH];
    if (c->nextra > 0) {
        memcpy(c->extra + (size_t)r * c->nextra, h + H_N, c->nextra * sizeof(int64_t));
    }
    /* Another host (or PID namespace): nobody reads anybody, decided alike. */
    *willing_p = *willing_p && h[H_WILLING] == 1 && h[H_HOST] == c->hello[H_HOST];
    *vote_p = *vote_p || h[H_NEED_VOTE] == 1;
    if (same_bytes && p->bytes != bytes) {
        return weft__set_error(WEFT_ERR_PROTOCOL,
                               "%s: group rank %d announced %llu bytes where this rank has %llu",
                               what, r, (unsigned long long)p->bytes, (unsigned long long)bytes);
    }
    return WEFT_OK;
}

/* Receives group rank @p r's HELLO message and takes it. */
static weft_status_t hello_by_message(cma_t *c, int r, uint64_t bytes, bool same_bytes,
                                      bool *willing_p, bool *vote_p)
{
    coll_msg_t *m;
    weft_status_t st;

    WEFT_CHECK(coll__recv(c->g, c->d, CMA_STEP_HELLO, r, c->deadline, &m));
    weft_tensor_t *t = coll__msg_tensor(m);
    if (t == NULL || weft_tensor_dtype(t) != WEFT_I64 ||
        (size_t)weft_tensor_numel(t) != H_N + c->nextra) {
        st = weft__set_error(WEFT_ERR_PROTOCOL, "%s: group rank %d sent a malformed announcement",
                             coll__kind_name(c->d->kind), r);
    } else {
        st = take_hello(c, r, weft_tensor_data(t), bytes, same_bytes, willing_p, vote_p);
    }
    coll__msg_free(m);
    return st;
}

/* The check word of board @p b showing @p epoch. */
static uint64_t board_check(const coll_cma_board_t *b, uint64_t epoch)
{
    const uint64_t w[] = {epoch,   b->mode, b->addr,  b->bytes, b->hello, b->nhello, b->hash,
                          b->kind, b->seq,  b->dtype, b->rop,   b->root,  b->count};
    uint64_t h = 0x6a09e667f3bcc909ull;
    for (size_t i = 0; i < sizeof(w) / sizeof(w[0]); i++) {
        h = (h ^ w[i]) * 0x100000001b3ull;
        h ^= h >> 29;
    }
    h *= 0xbf58476d1ce4e5b9ull;
    return h ^ (h >> 31);
}

/*
 * Takes group rank @p r's announcement from its board once it shows this operation, and
 * checks its view. With @p need_all false (nobody reads @p r), a rank already through its
 * reads of this operation (its FIN: it checked every view, ours included) will do.
 */
static weft_status_t hello_by_board(cma_t *c, int r, uint64_t bytes, bool same_bytes, bool need_all,
                                    int64_t *words)
{
    const coll_desc_t *d = c->d;
    const char *what = coll__kind_name(d->kind);
    size_t nw = H_N + c->nextra;
    cma_peer_t *p = &c->peers[r];
    coll_cma_board_t b;

    p->epoch_addr = c->g->cma_boards[r];
    p->epoch = c->epoch;
    for (int spins = 0;;) {
        WEFT_CHECK(read_board(c, r, &b));
        /* Its words are this operation's while its epoch stays (still_there checks it after
         * reading): read whole, they match their check. */
        if (atomic_load(&b.epoch) == c->epoch && b.check == board_check(&b, c->epoch)) {
            break;
        }
        if (!need_all && atomic_load(&b.epoch) != c->epoch && b.fin == d->seq + 1) {
            return WEFT_OK;
        }
        WEFT_CHECK(wait_a_bit(c, &spins));
    }
    if (b.mode != CMA_MODE_BOARDS) {
        /* It did not settle as we did (its first operation failed half-way there): this
         * operation fails, and the group votes again on its next one. */
        c->g->cma_state = 0;
        return weft__set_error(WEFT_ERR_TRANSPORT,
                               "%s: group rank %d has not settled cross-memory reads; the group "
                               "settles them again on its next operation",
                               what, r);
    }
    coll_desc_t theirs = {(coll_kind_t)b.kind,     b.seq,       (weft_dtype_t)b.dtype,
                          (weft_reduce_op_t)b.rop, (int)b.root, b.count};
    WEFT_CHECK(coll__check_view(c->g, d, &theirs, b.hash, r));
    p->addr = b.addr;
    p->bytes = b.bytes;
    if (same_bytes && p->bytes != bytes) {
        return weft__set_error(WEFT_ERR_PROTOCOL,
                               "%s: group rank %d announced %llu bytes where this rank has %llu",
                               what, r, (unsigned long long)p->bytes, (unsigned long long)bytes);
    }
    if (c->nextra > 0) {
        /* The words it adds (all_to_all: its split lists), read while it stays. */
        if (b.nhello != nw) {
            return weft__set_error(WEFT_ERR_PROTOCOL,
                                   "%s: group rank %d shows a malformed announcement", what, r);
        }
        WEFT_CHECK(pull(c, r, b.hello, nw * sizeof(int64_t), 0, words, nw * sizeof(int64_t)));
        WEFT_CHECK(still_there(c, r));
        memcpy(c->extra + (size_t)r * c->nextra, words + H_N, c->nextra * sizeof(int64_t));
    }
    return WEFT_OK;
}

/* Can every rank read every other? Each says what it found; all decide alike: *yes_p. */
static weft_status_t vote(cma_t *c, bool *yes_p)
{
    int n = c->g->size, me = c->g->rank;
    int64_t mine = VOTE_YES;
    weft_status_t st = WEFT_OK;

    for (int r = 0; r < n && mine == VOTE_YES; r++) {
        uint64_t e = 0;
        if (r == me) {
            continue;
        }
        if (pull(c, r, c->peers[r].epoch_addr, sizeof(e), 0, &e, sizeof(e)) != WEFT_OK) {
            mine = VOTE_NO;
        } else if (e != c->peers[r].epoch) {
            mine = VOTE_LEFT;
        }
    }
    c->hello[H_N + c->nextra] = mine; /* the word after the HELLO: sent without copying */
    int64_t verdict = mine;
    int left = mine == VOTE_LEFT ? me : -1;
    for (int r = 0; r < n && st == WEFT_OK; r++) {
        if (r != me) {
            st = coll__send(c->g, c->d, CMA_STEP_VOTE, r, &c->hello[H_N + c->nextra], 1, WEFT_I64,
                            &c->rel[n + r]);
        }
    }
    for (int r = 0; r < n && st == WEFT_OK; r++) {
        if (r == me) {
            continue;
        }
        coll_msg_t *m;
        st = coll__recv(c->g, c->d, CMA_STEP_VOTE, r, c->deadline, &m);
        if (st == WEFT_OK) {
            weft_tensor_t *t = coll__msg_tensor(m);
            int64_t v = t != NULL && weft_tensor_dtype(t) == WEFT_I64 && weft_tensor_numel(t) == 1
                            ? *(const int64_t *)weft_tensor_data(t)
                            : VOTE_NO;
            if (v == VOTE_LEFT) {
                verdict = VOTE_LEFT;
                left = left < 0 ? r : left;
            } else if (v != VOTE_YES && verdict == VOTE_YES) {
                verdict = VOTE_NO;
            }
            coll__msg_free(m);
        }
    }
    if (st == WEFT_OK && verdict == VOTE_LEFT) {
        /* Every rank sees the same votes: all fail, and nothing is settled. */
        return weft__set_error(WEFT_ERR_TRANSPORT,
                               "%s: a member left the operation while group rank %d checked "
                               "whether the members can read each other",
                               coll__kind_name(c->d->kind), left);
    }
    *yes_p = verdict == VOTE_YES;
    return st;
}

/* Makes what a settled group keeps (each member's process and board, the oneshot area and
 * what it learns of the others'), before the vote: a rank that cannot votes unwilling, so that
 * every member declines alike. */
static bool cma_prepare(coll_group_t *g)
{
    int n = g->size;

    if (g->cma_small != NULL) {
        return true;
    }
    g->cma_pids = weft_calloc((size_t)n, sizeof(*g->cma_pids));
    g->cma_boards = weft_calloc((size_t)n, sizeof(*g->cma_boards));
    g->cma_smalls = weft_calloc((size_t)n, sizeof(*g->cma_smalls));
    g->cma_small_fin = weft_calloc((size_t)n, sizeof(*g->cma_small_fin));
    g->cma_small = weft_calloc(1, ONESHOT_AREA_BYTES);
    if (g->cma_pids == NULL || g->cma_boards == NULL || g->cma_smalls == NULL ||
        g->cma_small_fin == NULL || g->cma_small == NULL) {
        weft_free(g->cma_pids);
        weft_free(g->cma_boards);
        weft_free(g->cma_smalls);
        weft_free(g->cma_small_fin);
        weft_free(g->cma_small);
        g->cma_pids = NULL;
        g->cma_boards = NULL;
        g->cma_smalls = NULL;
        g->cma_small_fin = NULL;
        g->cma_small = NULL;
        return false;
    }
    return true;
}

/* The group settled on reading: keeps where each member's board is, for the operations to
 * come to signal through them, and shows where our oneshot area is. The arrays were made
 * before the vote (cma_prepare). */
static void keep_boards(cma_t *c)
{
    coll_group_t *g = c->g;
    int n = g->size;

    if (g->cma_small == NULL || g->cma_board.small != 0) {
        return; /* never made (then this rank voted unwilling), or kept already */
    }
    for (int r = 0; r < n; r++) {
        g->cma_pids[r] = r == g->rank ? getpid() : c->peers[r].pid;
        g->cma_boards[r] =
            r == g->rank ? (uint64_t)(uintptr_t)&g->cma_board : c->peers[r].epoch_addr;
    }
    g->cma_board.small = (uint64_t)(uintptr_t)g->cma_small;
}

/*
 * Opens operation @p d's reads: announces @p bytes at @p addr (unchanged from here until
 * every other rank's FIN, or until cma_close) and @p nextra words @p extra to every member,
 * takes theirs (@p same_bytes: each must announce @p bytes too; @p need_all: this rank needs
 * every member's, else only those it reads, or that read it, must be in the operation still).
 *
 * The group's first such operation goes by messages and votes on whether the members can
 * read each other; once they can, an operation goes by the members' boards: a rank shows
 * its HELLO, DONE and FIN there, and the others poll them, with no message at all. Sets
 * *declined_p when the members agreed not to read each other: nothing was read. The caller
 * calls cma_close whatever this returns.
 */
static weft_status_t cma_open(cma_t *c, coll_group_t *g, const coll_desc_t *d, int64_t deadline,
                              const void *addr, uint64_t bytes, bool same_bytes, bool need_all,
                              const int64_t *extra, size_t nextra, bool *declined_p)
{
    int n = g->size, me = g->rank;
    weft_status_t st = WEFT_OK;

    *declined_p = false;
    memset(c, 0, sizeof(*c));
    c->g = g;
    c->d = d;
    c->deadline = deadline;
    c->nextra = nextra;
    c->epoch = epoch_of(g, d->seq);
    c->fast = g->cma_state == 1 && g->cma_board.small != 0; /* kept: keep_boards */
    c->peers = weft_calloc((size_t)n, sizeof(*c->peers));
    c->rel = weft_calloc(2 * (size_t)n, sizeof(*c->rel));
    c->hello = weft_calloc(H_N + nextra + 1, sizeof(int64_t)); /* + the vote */
    c->extra = weft_calloc((size_t)n * nextra + 1, sizeof(int64_t));
    int64_t *words = weft_calloc(H_N + nextra, sizeof(int64_t));
    if (c->peers == NULL || c->rel == NULL || c->hello == NULL || c->extra == NULL ||
        words == NULL) {
        weft_free(words);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "%s: no memory", coll__kind_name(d->kind));
    }

    /* Willing: the group lets the members read (WEFT_COLL_CMA when it was created), the reads
     * work here, and the group has not settled against them. */
    bool willing = g->cma_allowed && g->cma_state >= 0 && self_readable() && cma_prepare(g);
    int64_t *h = c->hello;
    h[H_PID] = (int64_t)getpid();
    h[H_ADDR] = (int64_t)(uintptr_t)addr;
    h[H_BYTES] = (int64_t)bytes;
    h[H_EPOCH_ADDR] = (int64_t)(uintptr_t)&g->cma_board;
    h[H_EPOCH] = (int64_t)c->epoch;
    h[H_WILLING] = willing ? 1 : 0;
    h[H_NEED_VOTE] = g->cma_state == 0 ? 1 : 0;
    h[H_HOST] = host_id();
    if (nextra > 0) {
        memcpy(h + H_N, extra, nextra * sizeof(int64_t));
        memcpy(c->extra + (size_t)me * nextra, extra, nextra * sizeof(int64_t));
    }
    /* From here until every FIN (or until we leave), others may read what we announce. */
    coll_cma_board_t *b = &g->cma_board;
    b->mode = c->fast ? CMA_MODE_BOARDS : CMA_MODE_MESSAGES;
    b->addr = (uint64_t)(uintptr_t)addr;
    b->bytes = bytes;
    b->hello = (uint64_t)(uintptr_t)h;
    b->nhello = H_N + nextra;
    b->hash = g->hash;
    b->kind = (uint64_t)d->kind;
    b->seq = d->seq;
    b->dtype = (uint64_t)d->dtype;
    b->rop = (uint64_t)d->rop;
    b->root = (uint64_t)(int64_t)d->root;
    b->count = d->count;
    b->check = board_check(b, c->epoch);
    atomic_store(&b->epoch, c->epoch);
    g->cma_last_epoch = c->epoch;

    if (c->fast) {
        for (int r = 0; r < n; r++) {
            c->peers[r].pid = g->cma_pids[r];
        }
        for (int k = 1; k < n && st == WEFT_OK; k++) {
            st = hello_by_board(c, (me + k) % n, bytes, same_bytes, need_all, words);
        }
        weft_free(words);
        if (st == WEFT_OK) {
            atomic_fetch_add(&cma_ops, 1);
        }
        return st;
    }
    weft_free(words);
    for (int r = 0; r < n && st == WEFT_OK; r++) {
        if (r != me) {
            st = coll__send(g, d, CMA_STEP_HELLO, r, h, H_N + nextra, WEFT_I64, &c->rel[r]);
        }
    }
    bool all_willing = willing, need_vote = g->cma_state == 0;
    for (int r = 0; r < n && st == WEFT_OK; r++) {
        if (r != me) {
            st = hello_by_message(c, r, bytes, same_bytes, &all_willing, &need_vote);
        }
    }
    if (st == WEFT_OK && all_willing && need_vote) {
        st = vote(c, &all_willing);
    }
    if (st != WEFT_OK) {
        return st;
    }
    g->cma_state = all_willing ? 1 : -1;
    if (!all_willing) {
        *declined_p = true; /* every rank falls back here, with the same operation */
        return WEFT_OK;
    }
    keep_boards(c);
    atomic_fetch_add(&cma_ops, 1);
    return WEFT_OK;
}

/* Leaves the operation (a rank still reading us from here on sees it and fails) once the
 * transport let go of what we sent; frees what cma_open took. Returns @p st, or the
 * transport's failure to let go. */
static weft_status_t cma_close(cma_t *c, weft_status_t st)
{
    atomic_store(&c->g->cma_board.epoch, 0);
    weft_status_t w =
        c->rel != NULL ? coll__wait_released(c->rel, 2 * (size_t)c->g->size, c->deadline) : WEFT_OK;
    weft_free(c->peers);
    weft_free(c->rel);
    weft_free(c->hello);
    weft_free(c->extra);
    return st != WEFT_OK ? st : w;
}

/* ------------------------------------------------------------ all_reduce and reduce_scatter */

/*
 * Reduces @p len elements of every member's region, from element @p lo (in @p wt), in rank
 * order, into @p dst; this rank's own elements are at @p own, which may be @p dst (reduced in
 * place: @p acc holds the ranks before us). @p acc and @p tmp: CMA_SEG_BYTES each.
 */
static weft_status_t reduce_pulled(cma_t *c, const coll_kern_t *k, size_t lo, size_t len,
                                   const uint8_t *own, uint8_t *dst, weft_dtype_t wt, uint8_t *acc,
                                   uint8_t *tmp)
{
    int n = c->g->size, me = c->g->rank;
    weft_reduce_op_t rop = c->d->rop;
    size_t es = weft_dtype_size(wt), seg = CMA_SEG_BYTES / es;

    for (size_t s = 0; s < len; s += seg) {
        size_t m = len - s < seg ? len - s : seg;
        const uint8_t *o = own + s * es;
        uint8_t *out = dst + s * es;
        uint64_t off = (uint64_t)(lo + s) * es;
        if (me > 0) {
            /* The ranks before us, folded in order, then combined with ours. */
            uint8_t *into = out == o ? acc : out;
            WEFT_CHECK(cma_read(c, 0, off, into, m * es));
            for (int q = 1; q < me; q++) {
                WEFT_CHECK(cma_read(c, q, off, tmp, m * es));
                coll__reduce_into(k, into, tmp, m, wt, rop);
            }
            if (out == o) {
                coll__reduce_to(k, out, acc, o, m, wt, rop);
            } else {
                coll__reduce_into(k, out, o, m, wt, rop);
            }
        } else if (out != o) {
            memcpy(out, o, m * es);
        }
        for (int q = me + 1; q < n; q++) {
            WEFT_CHECK(cma_read(c, q, off, tmp, m * es));
            coll__reduce_into(k, out, tmp, m, wt, rop);
        }
    }
    return WEFT_OK;
}

weft_status_t coll__all_reduce_cma(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                                   bool *declined_p)
{
    uint8_t *work = a->work;
    size_t count = a->count;
    weft_dtype_t wt = a->wt;
    int n = g->size, me = g->rank;
    size_t es = weft_dtype_size(wt);
    cma_t c;

    size_t *off = weft_calloc((size_t)n + 1, sizeof(*off));
    uint8_t *bounce = weft_alloc(2 * (size_t)CMA_SEG_BYTES);
    if (off == NULL || bounce == NULL) {
        weft_free(off);
        weft_free(bounce);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "all_reduce: no memory");
    }
    size_t base = count / (size_t)n, rem = count % (size_t)n;
    for (int i = 0; i < n; i++) {
        off[i + 1] = off[i] + base + ((size_t)i < rem ? 1 : 0);
    }
    weft_status_t st = cma_open(&c, g, a->d, deadline, work, (uint64_t)count * es, true, true, NULL,
                                0, declined_p);
    if (st != WEFT_OK || *declined_p) {
        goto out;
    }
    /* Our chunk, from everyone. */
    st = reduce_pulled(&c, &a->op->kern, off[me], off[me + 1] - off[me], work + off[me] * es,
                       work + off[me] * es, wt, bounce, bounce + CMA_SEG_BYTES);
    for (int r = 0; r < n && st == WEFT_OK; r++) {
        if (r != me) {
            st = still_there(&c, r);
        }
    }
    if (st == WEFT_OK) {
        st = cma_reduced(&c);
    }
    /* The others' chunks, each once its rank has reduced it (nobody reads that region of
     * ours before: each rank reads only its own chunk of our buffer). */
    for (int k = 1; k < n && st == WEFT_OK; k++) {
        int q = (me + k) % n;
        st = cma_await(&c, CMA_STEP_DONE, q);
        if (st == WEFT_OK) {
            st = cma_read(&c, q, (uint64_t)off[q] * es, work + off[q] * es,
                          (off[q + 1] - off[q]) * es);
        }
        if (st == WEFT_OK) {
            st = cma_done_with(&c, q);
        }
    }
    /* Nobody reads us any more once every rank said FIN. */
    if (st == WEFT_OK) {
        cma_finished(&c);
        st = cma_await_all(&c);
    }
out:
    st = cma_close(&c, st);
    weft_free(off);
    weft_free(bounce);
    return st;
}

/* ------------------------------------------------------------ oneshot: small all_reduce */

/*
 * A slot of a rank's oneshot area: the operation whose bytes follow the header. The owner
 * clears seq, writes the bytes and the other words, then sets seq (a seqlock: a reader that
 * finds seq unchanged after reading the bytes read them whole). The area's first word says
 * which operations the owner finished (seq + 1: every one below), reading included, failed
 * or not; an owner rewrites a slot only once every member finished the operation the slot
 * held. A member that read our slot of operation s had finished every operation before s,
 * so back-to-back operations never wait for that word: no message says when a rank is done.
 */
typedef struct {
    _Atomic uint64_t seq; /* seq + 1 of the operation; 0 while being written */
    uint64_t hash, kind, dtype, rop, root, count, bytes;
} oneshot_hdr_t;
_Static_assert(sizeof(oneshot_hdr_t) <= ONESHOT_HDR_BYTES, "oneshot header");

/* Group rank @p q's slot of operation @p seq, in its process: 0 while unknown. */
static uint64_t oneshot_slot(const coll_group_t *g, int q, uint64_t seq)
{
    uint64_t area = g->cma_smalls[q];
    return area == 0 ? 0 : area + ONESHOT_HDR_BYTES + (seq & 1) * ONESHOT_SLOT_BYTES;
}

/* Learns where group rank @p q's area is: on its board from when it settled (it may settle
 * after us). */
static weft_status_t oneshot_area(cma_t *c, int q)
{
    for (int spins = 0; c->g->cma_smalls[q] == 0;) {
        coll_cma_board_t b;
        WEFT_CHECK(read_board(c, q, &b));
        c->g->cma_smalls[q] = b.small;
        if (b.small == 0) {
            WEFT_CHECK(wait_a_bit(c, &spins));
        }
    }
    return WEFT_OK;
}

/* Waits until every member finished the operation (seq + 1) @p last: nobody reads the slot
 * that held it any more. */
static weft_status_t oneshot_slot_free(cma_t *c, uint64_t last)
{
    coll_group_t *g = c->g;

    for (int q = 0; q < g->size; q++) {
        if (q == g->rank) {
            continue;
        }
        for (int spins = 0; g->cma_small_fin[q] < last;) {
            uint64_t fin = 0;
            WEFT_CHECK(oneshot_area(c, q));
            WEFT_CHECK(pull(c, q, g->cma_smalls[q], sizeof(fin), 0, &fin, sizeof(fin)));
            if (fin > g->cma_small_fin[q]) {
                g->cma_small_fin[q] = fin;
            }
            if (g->cma_small_fin[q] < last) {
                WEFT_CHECK(wait_a_bit(c, &spins));
            }
        }
    }
    return WEFT_OK;
}

/* A wait on a member's slot this long (in rounds of wait_a_bit: ~2 ms) asks why. */
#define ONESHOT_HAIL_SPINS 1024
#define CMA_STEP_VIEW      0xfff00004u

/*
 * Group rank @p q has not shown this operation for a while: it may run another one at this
 * seq. Sends it, once (@p first), a piece carrying this operation's view, which a member
 * waiting for pieces compares with its own (a difference: a mismatch everywhere, through the
 * abort; a member in this same operation drops it with the operation's other pieces). Looks
 * at its board too: a member whose board shows an operation of this seq by messages has not
 * settled (the group settles again on its next operation, on every member: this one fails
 * everywhere through the abort); one that reads by boards compares its view.
 */
static weft_status_t oneshot_hail(cma_t *c, int q, bool first)
{
    coll_group_t *g = c->g;
    const coll_desc_t *d = c->d;
    coll_cma_board_t b;

    if (first) {
        WEFT_CHECK(coll__send(g, d, CMA_STEP_VIEW, q, NULL, 0, WEFT_U8, NULL));
    }
    WEFT_CHECK(read_board(c, q, &b));
    uint64_t epoch = epoch_of(g, d->seq);
    if (atomic_load(&b.epoch) != epoch || b.check != board_check(&b, epoch)) {
        return WEFT_OK;
    }
    if (b.mode != CMA_MODE_BOARDS) {
        g->cma_state = 0;
        return weft__set_error(WEFT_ERR_TRANSPORT,
                               "%s: group rank %d has not settled cross-memory reads; the group "
                               "settles them again on its next operation",
                               coll__kind_name(d->kind), q);
    }
    coll_desc_t theirs = {(coll_kind_t)b.kind,     b.seq,       (weft_dtype_t)b.dtype,
                          (weft_reduce_op_t)b.rop, (int)b.root, b.count};
    WEFT_CHECK(coll__check_view(g, d, &theirs, b.hash, q));
    return weft__set_error(WEFT_ERR_TRANSPORT,
                           "%s: group rank %d runs another algorithm for operation %llu (force "
                           "the same on every member)",
                           coll__kind_name(d->kind), q, (unsigned long long)d->seq);
}

/* Reads @p nb bytes of group rank @p q's slot of this operation into @p dst once it shows
 * this operation, and checks its view. */
static weft_status_t oneshot_read(cma_t *c, int q, uint8_t *dst, size_t nb)
{
    coll_group_t *g = c->g;
    const coll_desc_t *d = c->d;
    const char *what = coll__kind_name(d->kind);
    oneshot_hdr_t h;
    int spins = 0;

    WEFT_CHECK(oneshot_area(c, q));
    uint64_t slot = oneshot_slot(g, q, d->seq);
    for (;;) {
        weft_status_t rs = pull(c, q, slot, sizeof(h), 0, &h, sizeof(h));
        if (rs != WEFT_OK) {
            /* Its area is gone (it freed the group after leaving this operation): whatever
             * made it leave (an abort, a lost member, the deadline) is the reason. */
            char why[WEFT__ERROR_MAX];
            snprintf(why, sizeof(why), "%s", weft_last_error());
            WEFT_CHECK(coll__check(g, d, c->deadline));
            return weft__set_error(rs, "%s", why);
        }
        uint64_t got = atomic_load(&h.seq);
        if (got == d->seq + 1) {
            break;
        }
        if (spins > 0 && spins % ONESHOT_HAIL_SPINS == 0) {
            WEFT_CHECK(oneshot_hail(c, q, spins == ONESHOT_HAIL_SPINS));
        }
        if (got > d->seq + 1) {
            return weft__set_error(WEFT_ERR_PROTOCOL,
                                   "%s: group rank %d shows operation %llu in the slot of "
                                   "operation %llu",
                                   what, q, (unsigned long long)(got - 1),
                                   (unsigned long long)d->seq);
        }
        WEFT_CHECK(wait_a_bit(c, &spins));
    }
    coll_desc_t theirs = {(coll_kind_t)h.kind,     d->seq,      (weft_dtype_t)h.dtype,
                          (weft_reduce_op_t)h.rop, (int)h.root, h.count};
    WEFT_CHECK(coll__check_view(g, d, &theirs, h.hash, q));
    if (h.bytes != nb) {
        return weft__set_error(WEFT_ERR_PROTOCOL,
                               "%s: group rank %d shows %llu bytes where this rank has %zu", what,
                               q, (unsigned long long)h.bytes, nb);
    }
    if (nb > 0) {
        WEFT_CHECK(pull(c, q, slot, ONESHOT_SLOT_BYTES, ONESHOT_HDR_BYTES, dst, nb));
    }
    /* Still this operation's: the bytes were read whole. */
    uint64_t again = 0;
    WEFT_CHECK(pull(c, q, slot, sizeof(again), 0, &again, sizeof(again)));
    if (again != d->seq + 1) {
        return weft__set_error(WEFT_ERR_TRANSPORT,
                               "%s: group rank %d rewrote its slot while it was being read", what,
                               q);
    }
    /* It showed this operation: it finished every one before. */
    if (g->cma_small_fin[q] < d->seq) {
        g->cma_small_fin[q] = d->seq;
    }
    return WEFT_OK;
}

weft_status_t coll__all_reduce_oneshot(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                                       bool *declined_p)
{
    const coll_desc_t *d = a->d;
    int n = g->size, me = g->rank;
    size_t nb = a->count * weft_dtype_size(a->wt);
    weft_status_t st = WEFT_OK;

    if (nb > COLL_ONESHOT_MAX_BYTES) {
        /* Forced above its size: every member sees the same size and declines alike. */
        *declined_p = true;
        return WEFT_OK;
    }
    if (g->cma_state != 1) {
        /* Not settled yet (alike on every member): this operation settles, by messages. */
        return coll__all_reduce_cma(g, a, deadline, declined_p);
    }
    if (g->cma_board.small == 0) {
        /* Settled everywhere means this rank voted willing, which it does only once its area
         * exists and keep_boards shows it: never here. */
        return weft__set_error(WEFT_ERR_INVALID_STATE, "all_reduce: settled without its slots");
    }
    cma_t c;
    memset(&c, 0, sizeof(c));
    c.g = g;
    c.d = d;
    c.deadline = deadline;
    c.peers = weft_calloc((size_t)n, sizeof(*c.peers));
    if (c.peers == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "all_reduce: no memory");
    }
    for (int r = 0; r < n; r++) {
        c.peers[r].pid = g->cma_pids[r];
    }
    g->cma_small_entered = d->seq + 1; /* members may poll our area from now on */
    /* Show ours, in the slot of this operation's parity, once nobody reads what it held. */
    uint64_t *last = &g->cma_small_last[d->seq & 1];
    uint8_t *slot = g->cma_small + ONESHOT_HDR_BYTES + (d->seq & 1) * ONESHOT_SLOT_BYTES;
    oneshot_hdr_t *h = (oneshot_hdr_t *)(void *)slot;
    st = oneshot_slot_free(&c, *last);
    if (st != WEFT_OK) {
        goto out;
    }
    *last = d->seq + 1;
    atomic_store(&h->seq, 0);
    if (nb > 0) {
        memcpy(slot + ONESHOT_HDR_BYTES, a->work, nb);
    }
    h->hash = g->hash;
    h->kind = (uint64_t)d->kind;
    h->dtype = (uint64_t)d->dtype;
    h->rop = (uint64_t)d->rop;
    h->root = (uint64_t)(int64_t)d->root;
    h->count = d->count;
    h->bytes = nb;
    atomic_store(&h->seq, d->seq + 1);

    /* Everyone's, reduced in rank order: the same result on every member. */
    uint8_t *acc = g->cma_small + ONESHOT_HDR_BYTES + 2 * ONESHOT_SLOT_BYTES,
            *tmp = acc + COLL_ONESHOT_MAX_BYTES;
    for (int q = 0; q < n && st == WEFT_OK; q++) {
        const uint8_t *src = a->work;
        if (q != me) {
            src = q == 0 ? acc : tmp;
            st = oneshot_read(&c, q, q == 0 ? acc : tmp, nb);
        }
        if (st == WEFT_OK && nb > 0) {
            if (q == 0 && src != acc) {
                memcpy(acc, src, nb);
            } else if (q > 0) {
                coll__reduce_into(&a->op->kern, acc, src, a->count, a->wt, d->rop);
            }
        }
    }
    if (st == WEFT_OK && nb > 0) {
        memcpy(a->work, acc, nb);
    }
out:
    /* Done reading the others, whatever happened: our slots of this operation may go. */
    coll__oneshot_finished(g, d->seq);
    weft_free(c.peers);
    return st;
}

void coll__oneshot_finished(coll_group_t *g, uint64_t seq)
{
    if (g->cma_small != NULL) {
        /* Only forward: the worker and a thread refusing a call may both get here. */
        _Atomic uint64_t *fin = (_Atomic uint64_t *)(void *)g->cma_small;
        uint64_t cur = atomic_load(fin);
        while (cur < seq + 1 && !atomic_compare_exchange_weak(fin, &cur, seq + 1)) {
        }
    }
}

/* Whether group rank @p q was lost (the agent said so). */
static bool member_lost(coll_group_t *g, int q)
{
    pthread_mutex_lock(&g->ctx->mu);
    bool lost = g->ctx->lost[g->world[q]];
    pthread_mutex_unlock(&g->ctx->mu);
    return lost;
}

/* Before the group's memory goes: waits until member @p q's word at @p addr (in its process)
 * is past what we wait for: != @p value (@p above false) or >= @p value (@p above true; then
 * *seen_p gets it). False when the group's time (@p deadline) ran out; a member lost, gone or
 * past its group is not waited for. */
static bool drain_member(coll_group_t *g, int q, uint64_t addr, uint64_t value, bool above,
                         uint64_t *seen_p, int64_t deadline)
{
    for (int spins = 0; !(spins % 64 == 0 && member_lost(g, q)); spins++) {
        uint64_t w = 0;
        struct iovec l = {&w, sizeof(w)}, r = {(void *)(uintptr_t)addr, sizeof(w)};
        if (process_vm_readv(g->cma_pids[q], &l, 1, &r, 1, 0) != (ssize_t)sizeof(w)) {
            return true; /* gone, or its group too: nobody reads us from there */
        }
        if (above ? w >= value : w != value) {
            if (seen_p != NULL) {
                *seen_p = w;
            }
            return true;
        }
        if (weft__now_ns() >= deadline) {
            return false;
        }
        if (spins < CMA_SPINS) {
            sched_yield();
        } else {
            struct timespec ts = {0, CMA_NAP_NS};
            nanosleep(&ts, NULL);
        }
    }
    return true;
}

static int64_t drain_deadline(const coll_group_t *g)
{
    int64_t ms = atomic_load(&g->timeout_ms);
    return weft__now_ns() + (ms > INT64_MAX / 2000000 ? INT64_MAX / 2 : ms * 1000000);
}

void coll__cma_drain(coll_group_t *g)
{
    uint64_t last = g->cma_last_epoch;
    if (last == 0 || g->cma_boards == NULL) {
        return;
    }
    int64_t deadline = drain_deadline(g);
    for (int q = 0; q < g->size; q++) {
        /* Its board shows that operation's epoch until it has left it: then it reads ours no
         * more (a member waits for our FIN on our board after we saw its own). */
        if (q != g->rank && g->cma_boards[q] != 0 &&
            !drain_member(g, q, g->cma_boards[q] + offsetof(coll_cma_board_t, epoch), last,
                          false, NULL, deadline)) {
            WEFT_WARN("collectives: group %u freed while group rank %d may still read its board",
                      g->id, q);
            return;
        }
    }
}

void coll__oneshot_drain(coll_group_t *g)
{
    /* The last operation in which members may have polled our area, shown or not. */
    uint64_t last = g->cma_small_entered;
    if (g->cma_small == NULL || last == 0) {
        return;
    }
    int64_t deadline = drain_deadline(g);
    for (int q = 0; q < g->size; q++) {
        if (q != g->rank && g->cma_small_fin[q] < last && g->cma_smalls[q] != 0 &&
            !drain_member(g, q, g->cma_smalls[q], last, true, &g->cma_small_fin[q], deadline)) {
            WEFT_WARN("collectives: group %u freed while group rank %d may still read its last "
                      "all_reduce slot",
                      g->id, q);
            return;
        }
    }
}

weft_status_t coll__reduce_scatter_cma(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                                       bool *declined_p)
{
    weft_tensor_t *in = a->op->t, *out = a->op->out;
    int n = g->size, me = g->rank;
    size_t count = (size_t)weft_tensor_numel(out);
    weft_dtype_t wt;
    uint8_t *work;
    float *owned;
    cma_t c;

    WEFT_CHECK(coll__widen(&a->op->kern, in, count * (size_t)n, &wt, &work, &owned));
    size_t nb = count * weft_dtype_size(wt);
    uint8_t *acc = weft_alloc(nb + 2 * (size_t)CMA_SEG_BYTES);
    if (acc == NULL) {
        weft_free(owned);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "reduce_scatter: no memory");
    }
    uint8_t *bounce = acc + nb;
    weft_status_t st = cma_open(&c, g, a->d, deadline, work, (uint64_t)nb * (uint64_t)n, true, true,
                                NULL, 0, declined_p);
    if (st == WEFT_OK && !*declined_p) {
        /* Our part, from everyone, in rank order. */
        st = reduce_pulled(&c, &a->op->kern, (size_t)me * count, count, work + (size_t)me * nb, acc,
                           wt, bounce, bounce + CMA_SEG_BYTES);
        for (int k = 1; k < n && st == WEFT_OK; k++) {
            st = cma_done_with(&c, (me + k) % n);
        }
        /* The output may overlap the input: written once nobody reads it any more. */
        if (st == WEFT_OK) {
            cma_finished(&c);
            st = cma_await_all(&c);
        }
        if (st == WEFT_OK) {
            coll__finish(&a->op->kern, out, acc, count, wt, a->d->rop, n);
        }
    }
    st = cma_close(&c, st);
    weft_free(acc);
    weft_free(owned);
    return st;
}

/* ------------------------------------------------------------ moving data */

weft_status_t coll__broadcast_cma(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                                  bool *declined_p)
{
    weft_tensor_t *t = a->op->t;
    int root = a->d->root;
    uint64_t nb = (uint64_t)weft_tensor_numel(t) * weft_dtype_size(weft_tensor_dtype(t));
    uint8_t *data = weft_tensor_data(t);
    cma_t c;

    /* Only the root is read: the others need only its announcement (and to know that every
     * member's view is theirs). */
    weft_status_t st = cma_open(&c, g, a->d, deadline, data, nb, true, false, NULL, 0, declined_p);
    if (st == WEFT_OK && !*declined_p) {
        if (g->rank != root) {
            st = cma_read(&c, root, 0, data, nb);
            if (st == WEFT_OK) {
                st = cma_done_with(&c, root);
            }
            if (st == WEFT_OK) {
                cma_finished(&c);
            }
        } else {
            /* The root waits while the others copy: with more members than processors, a
             * root that yields in a loop takes their processor time (4 MiB at 4 members on 2
             * processors: 3.1-3.3 -> 3.7-3.9 GB/s). */
            c.nap = nb >= CMA_SEG_BYTES && g->size > online_processors();
            cma_finished(&c);
            st = cma_await_all(&c);
        }
    }
    return cma_close(&c, st);
}

/* Whether [a, a + an) and [b, b + bn) overlap. */
static bool overlap(const uint8_t *a, size_t an, const uint8_t *b, size_t bn)
{
    return an > 0 && bn > 0 && a < b + bn && b < a + an;
}

weft_status_t coll__all_gather_cma(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                                   bool *declined_p)
{
    weft_tensor_t *in = a->op->t, *out = a->op->out, **outs = a->op->outs;
    int n = g->size, me = g->rank;
    size_t nb = (size_t)weft_tensor_numel(in) * weft_dtype_size(weft_tensor_dtype(in));
    uint8_t *src = weft_tensor_data(in), *copy = NULL;
    cma_t c;

#define PART(r)                                                                                    \
    (outs != NULL ? (uint8_t *)weft_tensor_data(outs[r])                                           \
                  : (uint8_t *)weft_tensor_data(out) + (size_t)(r)*nb)
    /* Others read our input while we write the other parts of our output: an input that is
     * not exactly our own part and overlaps a part is read from a copy. */
    for (int r = 0; r < n && copy == NULL && nb > 0; r++) {
        if (overlap(src, nb, PART(r), nb) && (r != me || PART(r) != src)) {
            copy = weft_alloc(nb);
            if (copy == NULL) {
                return weft__set_error(WEFT_ERR_NO_MEMORY, "all_gather: no memory");
            }
            memcpy(copy, src, nb);
            src = copy;
        }
    }
    /* Our own part first, while the others come (nobody reads our output; unless it overlaps
     * the input, which a fallback would still need). */
    bool own_first = copy == NULL && nb > 0 && PART(me) != src;
    if (own_first) {
        memcpy(PART(me), src, nb);
    }
    weft_status_t st = cma_open(&c, g, a->d, deadline, src, nb, true, true, NULL, 0, declined_p);
    if (st == WEFT_OK && !*declined_p) {
        /* Each rank starts with the next one: the ranks' reads spread over the owners. */
        for (int k = 1; k < n && st == WEFT_OK; k++) {
            int q = (me + k) % n;
            st = cma_read(&c, q, 0, PART(q), nb);
            if (st == WEFT_OK) {
                st = cma_done_with(&c, q);
            }
        }
        if (st == WEFT_OK && !own_first && nb > 0 && PART(me) != src) {
            memmove(PART(me), src, nb);
        }
        if (st == WEFT_OK) {
            cma_finished(&c);
            st = cma_await_all(&c);
        }
    }
#undef PART
    st = cma_close(&c, st);
    weft_free(copy);
    return st;
}

weft_status_t coll__all_to_all_cma(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                                   bool *declined_p)
{
    coll_op_t *op = a->op;
    int n = g->size, me = g->rank;
    size_t es = weft_dtype_size(weft_tensor_dtype(op->t));
    uint8_t *in = weft_tensor_data(op->t), *out = weft_tensor_data(op->out), *copy = NULL;
    size_t inb = (size_t)weft_tensor_numel(op->t) * es,
           outb = (size_t)weft_tensor_numel(op->out) * es;
    size_t row = 2 * (size_t)n;
    cma_t c;

    int64_t *mine = weft_alloc(row * sizeof(int64_t));
    if (mine == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "all_to_all: no memory");
    }
    if (overlap(in, inb, out, outb)) {
        /* In place: others read our input while we write our output. */
        copy = weft_alloc(inb);
        if (copy == NULL) {
            weft_free(mine);
            return weft__set_error(WEFT_ERR_NO_MEMORY, "all_to_all: no memory");
        }
        memcpy(copy, in, inb);
        in = copy;
    }
    /* The split lists go with the HELLO; the pieces' sizes differ between ranks, so the
     * messages carry the view of basic.c's split lists (no count, no root). */
    memcpy(mine, op->in_splits, (size_t)n * sizeof(int64_t));
    memcpy(mine + n, op->out_splits, (size_t)n * sizeof(int64_t));
    coll_desc_t dv = *a->d;
    dv.count = 0;
    dv.root = 0;
    weft_status_t st = cma_open(&c, g, &dv, deadline, in, inb, false, true, mine, row, declined_p);
    if (st == WEFT_OK && !*declined_p) {
        st = coll__all_to_all_pairs(g, &dv, c.extra);
    }
    if (st == WEFT_OK && !*declined_p) {
        size_t *ooff = weft_calloc((size_t)n + 1, sizeof(*ooff));
        if (ooff == NULL) {
            st = weft__set_error(WEFT_ERR_NO_MEMORY, "all_to_all: no memory");
        }
        for (int r = 0; r < n && st == WEFT_OK; r++) {
            ooff[r + 1] = ooff[r] + (size_t)op->out_splits[r];
        }
        for (int k = 0; k < n && st == WEFT_OK; k++) {
            int q = (me + k) % n;
            const int64_t *qin = c.extra + (size_t)q * row; /* q's in_splits */
            uint64_t from = 0;
            for (int r = 0; r < me; r++) {
                if (qin[r] < 0) {
                    st = weft__set_error(WEFT_ERR_PROTOCOL,
                                         "all_to_all: group rank %d announced a negative split", q);
                    break;
                }
                from += (uint64_t)qin[r];
            }
            size_t len = (size_t)op->out_splits[q] * es; /* == qin[me]: checked */
            if (st != WEFT_OK) {
                break;
            }
            if (q == me) {
                if (len > 0) {
                    memcpy(out + ooff[q] * es, in + from * es, len);
                }
                continue;
            }
            if (from > UINT64_MAX / es) {
                st = weft__set_error(WEFT_ERR_PROTOCOL,
                                     "all_to_all: group rank %d announced splits out of range", q);
            } else if (len > 0) {
                st = cma_read(&c, q, from * es, out + ooff[q] * es, len);
            }
            if (st == WEFT_OK) {
                st = cma_done_with(&c, q);
            }
        }
        if (st == WEFT_OK) {
            cma_finished(&c);
            st = cma_await_all(&c);
        }
        weft_free(ooff);
    }
    st = cma_close(&c, st);
    weft_free(mine);
    weft_free(copy);
    return st;
}
