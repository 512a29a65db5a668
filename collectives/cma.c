/* all_reduce between ranks on one host by cross-memory attach (process_vm_readv): each
 * rank pulls its chunk of every other rank's buffer straight from that rank's memory,
 * reduces it in a cache-resident buffer, and then pulls the other ranks' reduced chunks
 * into place. One kernel copy per byte moved (TCP: two, plus the socket's system calls
 * and wake-ups); the messages that carry the addresses and say when a chunk is ready go
 * over the agent's connections like every other piece.
 *
 * Ranks only ever read each other, never write. A rank keeps its buffer unchanged while
 * others may read it: from its HELLO until every other rank's FIN. A rank that leaves
 * the operation early (a failure, a deadline) clears its epoch word first; a reader
 * checks that word after reading, so that bytes read after the owner left become an
 * error, never a wrong result.
 *
 * Whether the reads work (same host, same user, the system call allowed) is settled by a
 * vote on the first such operation of a group: every rank reads every other's epoch word,
 * and all ranks fall back to the ring together unless every read worked everywhere. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "internal.h"

/* The steps of the messages of this algorithm (the ring's are below 2^31). */
#define CMA_STEP_HELLO 0xfff00000u
#define CMA_STEP_VOTE  0xfff00001u
#define CMA_STEP_DONE  0xfff00002u
#define CMA_STEP_FIN   0xfff00003u

/* Pulled and reduced in pieces this large: two of them stay in cache. */
#define CMA_SEG_BYTES (256u << 10)

/* The HELLO: what a rank tells every other about itself and its buffer. */
enum { H_PID, H_ADDR, H_BYTES, H_EPOCH_ADDR, H_EPOCH, H_WILLING, H_NEED_VOTE, H_HOST, H_N };

/* Votes: every other rank can be read; one cannot; one has already left the operation (no
 * verdict: the operation fails everywhere and the next one votes again). */
enum { VOTE_NO = 0, VOTE_YES = 1, VOTE_LEFT = 2 };

typedef struct {
    pid_t pid;
    uint64_t addr, bytes, epoch_addr, epoch;
} cma_peer_t;

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

/* Reads @p n bytes at @p off of group rank @p q's announced region @p base (@p limit bytes
 * long) into @p dst. */
static weft_status_t pull(const cma_peer_t *p, int q, uint64_t base, uint64_t limit, uint64_t off,
                          void *dst, size_t n)
{
    if (off > limit || n > limit - off) {
        return weft__set_error(WEFT_ERR_PROTOCOL,
                               "all_reduce: read of %zu bytes at %llu is outside the %llu bytes "
                               "group rank %d announced",
                               n, (unsigned long long)off, (unsigned long long)limit, q);
    }
    uint8_t *d = dst;
    while (n > 0) {
        struct iovec l = {d, n}, r = {(void *)(uintptr_t)(base + off), n};
        ssize_t got = process_vm_readv(p->pid, &l, 1, &r, 1, 0);
        if (got <= 0) {
            int e = got < 0 ? errno : EIO;
            if (e == ESRCH) {
                return weft__set_error(WEFT_ERR_PEER_LOST,
                                       "all_reduce: group rank %d (pid %d) is gone", q,
                                       (int)p->pid);
            }
            if (e == EFAULT) {
                return weft__set_error(WEFT_ERR_PROTOCOL,
                                       "all_reduce: group rank %d announced memory it does not "
                                       "have (pid %d, 0x%llx)",
                                       q, (int)p->pid, (unsigned long long)(base + off));
            }
            return weft__set_error(WEFT_ERR_TRANSPORT,
                                   "all_reduce: cross-memory read from group rank %d (pid %d) "
                                   "failed: %s",
                                   q, (int)p->pid, strerror(e));
        }
        d += got;
        off += (uint64_t)got;
        n -= (size_t)got;
    }
    return WEFT_OK;
}

/* Whether group rank @p q is still in the operation: its epoch word still holds the value
 * it announced. Everything read from it before this check was read while it was. */
static weft_status_t still_there(const cma_peer_t *p, int q)
{
    uint64_t e = 0;
    WEFT_CHECK(pull(p, q, p->epoch_addr, sizeof(e), 0, &e, sizeof(e)));
    if (e != p->epoch) {
        /* Not PEER_LOST: the rank may be alive, having given up (a deadline, a failure). */
        return weft__set_error(WEFT_ERR_TRANSPORT,
                               "all_reduce: group rank %d left the operation while its buffer "
                               "was being read",
                               q);
    }
    return WEFT_OK;
}

/* pull() from @p q's buffer; a failed read of an owner that has left says so. */
static weft_status_t pull_data(const cma_peer_t *p, int q, uint64_t off, void *dst, size_t n)
{
    weft_status_t st = pull(p, q, p->addr, p->bytes, off, dst, n);
    if (st != WEFT_OK && st != WEFT_ERR_PEER_LOST) {
        char why[WEFT__ERROR_MAX];
        snprintf(why, sizeof(why), "%s", weft_last_error());
        weft_status_t there = still_there(p, q);
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

/* Reduces chunk elements [lo, lo + len) from every rank, in rank order, into @p work. */
static weft_status_t reduce_chunk(coll_group_t *g, const coll_desc_t *d, const coll_kern_t *k,
                                  const cma_peer_t *peers, uint8_t *work, size_t lo, size_t len,
                                  weft_dtype_t wt, uint8_t *acc, uint8_t *tmp)
{
    int n = g->size, me = g->rank;
    size_t es = weft_dtype_size(wt), seg = CMA_SEG_BYTES / es;

    for (size_t s = 0; s < len; s += seg) {
        size_t m = len - s < seg ? len - s : seg;
        uint8_t *mine = work + (lo + s) * es;
        uint64_t off = (uint64_t)(lo + s) * es;
#define PULL(q, dst) pull_data(&peers[(q)], (q), off, (dst), m *es)
        if (me > 0) {
            /* The ranks before us, folded in order, then combined with ours. */
            WEFT_CHECK(PULL(0, acc));
            for (int q = 1; q < me; q++) {
                WEFT_CHECK(PULL(q, tmp));
                coll__reduce_into(k, acc, tmp, m, wt, d->rop);
            }
            coll__reduce_to(k, mine, acc, mine, m, wt, d->rop);
        }
        for (int q = me + 1; q < n; q++) {
            WEFT_CHECK(PULL(q, tmp));
            coll__reduce_into(k, mine, tmp, m, wt, d->rop);
        }
#undef PULL
    }
    return WEFT_OK;
}

weft_status_t coll__all_reduce_cma(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                                   bool *declined_p)
{
    const coll_desc_t *d = a->d;
    uint8_t *work = a->work;
    size_t count = a->count;
    weft_dtype_t wt = a->wt;
    int n = g->size, me = g->rank;
    size_t es = weft_dtype_size(wt);
    uint64_t bytes = (uint64_t)count * es;
    int64_t hello[H_N], vote[1];
    weft_status_t st = WEFT_OK;

    *declined_p = false;
    cma_peer_t *peers = weft_calloc((size_t)n, sizeof(*peers));
    weft_future_t **rel = weft_calloc(2 * (size_t)n, sizeof(*rel));
    size_t *off = weft_calloc((size_t)n + 1, sizeof(*off));
    uint8_t *bounce = weft_alloc(2 * (size_t)CMA_SEG_BYTES);
    if (peers == NULL || rel == NULL || off == NULL || bounce == NULL) {
        weft_free(peers);
        weft_free(rel);
        weft_free(off);
        weft_free(bounce);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "all_reduce: no memory");
    }
    size_t base = count / (size_t)n, rem = count % (size_t)n;
    for (int i = 0; i < n; i++) {
        off[i + 1] = off[i] + base + ((size_t)i < rem ? 1 : 0);
    }

    /* From here until every FIN (or until we leave), others may read @p work. */
    uint64_t epoch = epoch_of(g, d->seq);
    atomic_store(&g->cma_epoch, epoch);
    /* Willing: the group lets the members read (WEFT_COLL_CMA when it was created), the reads
     * work here, and the group has not settled against them. */
    bool willing = g->cma_allowed && g->cma_state >= 0 && self_readable();
    hello[H_PID] = (int64_t)getpid();
    hello[H_ADDR] = (int64_t)(uintptr_t)work;
    hello[H_BYTES] = (int64_t)bytes;
    hello[H_EPOCH_ADDR] = (int64_t)(uintptr_t)&g->cma_epoch;
    hello[H_EPOCH] = (int64_t)epoch;
    hello[H_WILLING] = willing ? 1 : 0;
    hello[H_NEED_VOTE] = g->cma_state == 0 ? 1 : 0;
    hello[H_HOST] = host_id();
    for (int r = 0; r < n && st == WEFT_OK; r++) {
        if (r != me) {
            st = coll__send(g, d, CMA_STEP_HELLO, r, hello, H_N, WEFT_I64, &rel[r]);
        }
    }
    bool all_willing = willing, need_vote = g->cma_state == 0;
    for (int r = 0; r < n && st == WEFT_OK; r++) {
        if (r == me) {
            continue;
        }
        coll_msg_t *m;
        st = coll__recv(g, d, CMA_STEP_HELLO, r, deadline, &m);
        if (st != WEFT_OK) {
            break;
        }
        weft_tensor_t *t = coll__msg_tensor(m);
        if (t == NULL || weft_tensor_dtype(t) != WEFT_I64 || weft_tensor_numel(t) != H_N) {
            st = weft__set_error(WEFT_ERR_PROTOCOL,
                                 "all_reduce: group rank %d sent a malformed announcement", r);
        } else {
            const int64_t *h = weft_tensor_data(t);
            if (h[H_PID] <= 0 || h[H_PID] > INT32_MAX) {
                st = weft__set_error(WEFT_ERR_PROTOCOL,
                                     "all_reduce: group rank %d announced process id %lld", r,
                                     (long long)h[H_PID]);
                coll__msg_free(m);
                break;
            }
            peers[r].pid = (pid_t)h[H_PID];
            peers[r].addr = (uint64_t)h[H_ADDR];
            peers[r].bytes = (uint64_t)h[H_BYTES];
            peers[r].epoch_addr = (uint64_t)h[H_EPOCH_ADDR];
            peers[r].epoch = (uint64_t)h[H_EPOCH];
            /* Another host (or PID namespace): nobody reads anybody, decided alike. */
            all_willing = all_willing && h[H_WILLING] == 1 && h[H_HOST] == hello[H_HOST];
            need_vote = need_vote || h[H_NEED_VOTE] == 1;
            if (peers[r].bytes != bytes) {
                st = weft__set_error(WEFT_ERR_PROTOCOL,
                                     "all_reduce: group rank %d announced %llu bytes where this "
                                     "rank has %llu",
                                     r, (unsigned long long)peers[r].bytes,
                                     (unsigned long long)bytes);
            }
        }
        coll__msg_free(m);
    }
    if (st == WEFT_OK && all_willing && need_vote) {
        /* Can every rank read every other? Each says what it found; all decide alike. */
        int64_t mine = VOTE_YES;
        for (int r = 0; r < n && mine == VOTE_YES; r++) {
            uint64_t e = 0;
            if (r == me) {
                continue;
            }
            if (pull(&peers[r], r, peers[r].epoch_addr, sizeof(e), 0, &e, sizeof(e)) != WEFT_OK) {
                mine = VOTE_NO;
            } else if (e != peers[r].epoch) {
                mine = VOTE_LEFT;
            }
        }
        vote[0] = mine;
        int64_t verdict = mine;
        int left = mine == VOTE_LEFT ? me : -1;
        for (int r = 0; r < n && st == WEFT_OK; r++) {
            if (r != me) {
                st = coll__send(g, d, CMA_STEP_VOTE, r, vote, 1, WEFT_I64, &rel[n + r]);
            }
        }
        for (int r = 0; r < n && st == WEFT_OK; r++) {
            if (r == me) {
                continue;
            }
            coll_msg_t *m;
            st = coll__recv(g, d, CMA_STEP_VOTE, r, deadline, &m);
            if (st == WEFT_OK) {
                weft_tensor_t *t = coll__msg_tensor(m);
                int64_t v =
                    t != NULL && weft_tensor_dtype(t) == WEFT_I64 && weft_tensor_numel(t) == 1
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
            st = weft__set_error(WEFT_ERR_TRANSPORT,
                                 "all_reduce: a member left the operation while group rank %d "
                                 "checked whether the members can read each other",
                                 left);
            goto out;
        }
        all_willing = verdict == VOTE_YES;
    }
    if (st == WEFT_OK) {
        g->cma_state = all_willing ? 1 : -1;
        if (!all_willing) {
            *declined_p = true; /* every rank falls back here, with the same operation */
            goto out;
        }
    }
    if (st != WEFT_OK) {
        goto out;
    }
    atomic_fetch_add(&cma_ops, 1);

    /* Our chunk, from everyone. */
    st = reduce_chunk(g, d, &a->op->kern, peers, work, off[me], off[me + 1] - off[me], wt, bounce,
                      bounce + CMA_SEG_BYTES);
    for (int r = 0; r < n && st == WEFT_OK; r++) {
        if (r != me) {
            st = still_there(&peers[r], r);
        }
    }
    for (int r = 0; r < n && st == WEFT_OK; r++) {
        if (r != me) {
            st = coll__send(g, d, CMA_STEP_DONE, r, NULL, 0, WEFT_U8, NULL);
        }
    }
    /* The others' chunks, each once its rank has reduced it (nobody reads that region of
     * ours before: each rank reads only its own chunk of our buffer). */
    for (int k = 1; k < n && st == WEFT_OK; k++) {
        int q = (me + k) % n;
        coll_msg_t *m;
        st = coll__recv(g, d, CMA_STEP_DONE, q, deadline, &m);
        if (st != WEFT_OK) {
            break;
        }
        coll__msg_free(m);
        size_t len = off[q + 1] - off[q];
        st = pull_data(&peers[q], q, (uint64_t)off[q] * es, work + off[q] * es, len * es);
        if (st == WEFT_OK) {
            st = still_there(&peers[q], q);
        }
    }
    /* Nobody reads us any more once every rank said FIN. */
    for (int r = 0; r < n && st == WEFT_OK; r++) {
        if (r != me) {
            st = coll__send(g, d, CMA_STEP_FIN, r, NULL, 0, WEFT_U8, NULL);
        }
    }
    for (int r = 0; r < n && st == WEFT_OK; r++) {
        if (r == me) {
            continue;
        }
        coll_msg_t *m;
        st = coll__recv(g, d, CMA_STEP_FIN, r, deadline, &m);
        if (st == WEFT_OK) {
            coll__msg_free(m);
        }
    }

out:
    /* Leaving: a rank still reading us from here on sees it and fails. */
    atomic_store(&g->cma_epoch, 0);
    weft_status_t w = coll__wait_released(rel, 2 * (size_t)n, deadline);
    weft_free(peers);
    weft_free(rel);
    weft_free(off);
    weft_free(bounce);
    return st != WEFT_OK ? st : w;
}
