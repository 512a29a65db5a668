/*
 * all_reduce and broadcast of device tensors (the device entry of the collectives).
 *
 * Staged: the tensor goes through a pinned host buffer in chunks. Every chunk's device-to-host
 * copy is queued on one stream at the call, and every chunk's host collective is issued at the
 * call too (weft_coll_*_staged), so the group's order is the order of the calls; a chunk's
 * collective waits, when the group reaches it, for its copy's event, and when it completes its
 * host-to-device copy is queued on a second stream. Copies in both directions and the transport
 * of other chunks overlap.
 *
 * IPC (ranks of one host): each rank keeps a device buffer the others map (cudaIpc*), copies its
 * tensor there, and after a round that checks every member could map every buffer (the round is
 * also the barrier), reduces its share of the elements from every member's buffer in member
 * order, into its own buffer; after a barrier it copies every member's share into its tensor,
 * and a last barrier lets the buffers be reused. Broadcast: the root's buffer, read by all.
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <weft/collectives.h>
#include <weft/cuda.h>

#include "internal.h"

static _Atomic uint64_t n_ipc_ops, n_staged_ops, n_staged_chunks, n_ipc_maps;

void weft_cuda_stats(weft_cuda_stats_t *s)
{
    if (s == NULL) {
        return;
    }
    s->ipc_ops = atomic_load(&n_ipc_ops);
    s->staged_ops = atomic_load(&n_staged_ops);
    s->staged_chunks = atomic_load(&n_staged_chunks);
    s->ipc_maps = atomic_load(&n_ipc_maps);
}

/* ---- staged through pinned host memory ------------------------------------------------------ */

typedef struct staged staged_t;

typedef struct {
    staged_t *s;
    size_t off, len;
    weft_tensor_t *host; /* a CPU tensor over the pinned buffer's part */
    cudaEvent_t copied;  /* its device-to-host copy done (none: nothing to copy in) */
} chunk_t;

struct staged {
    weft_tensor_t *t; /* the device tensor (reference held) */
    int device;
    bool copy_in, copy_out; /* device-to-host before, host-to-device after */
    unsigned char *host;
    size_t nbytes, host_cap;
    int parts; /* chunks of a tensor of WEFT_CUDA_SPLIT_MIN bytes or more */
    cudaStream_t d2h, h2d;
    chunk_t *chunks;
    size_t nchunks;
    _Atomic size_t left;
    pthread_mutex_t mu;
    weft_status_t st;
    char why[512];
    weft_future_t *f; /* the caller's */
};

static void staged_fail(staged_t *s, weft_status_t st, const char *why)
{
    pthread_mutex_lock(&s->mu);
    if (s->st == WEFT_OK) {
        s->st = st;
        snprintf(s->why, sizeof(s->why), "%s", why);
    }
    pthread_mutex_unlock(&s->mu);
}

/* Frees what was made; waits for the copies still queued (they write the buffers). */
static void staged_free(staged_t *s)
{
    if (s->chunks != NULL) {
        for (size_t i = 0; i < s->nchunks; i++) {
            weft_tensor_release(s->chunks[i].host);
            if (s->chunks[i].copied != NULL) {
                (void)cudaEventDestroy(s->chunks[i].copied);
            }
        }
        weft_free(s->chunks);
    }
    if (s->d2h != NULL) {
        (void)cudaStreamSynchronize(s->d2h);
        (void)cudaStreamDestroy(s->d2h);
    }
    if (s->h2d != NULL) {
        (void)cudaStreamSynchronize(s->h2d);
        (void)cudaStreamDestroy(s->h2d);
    }
    if (s->host != NULL) {
        weft_cuda__pinned_put(s->host, s->host_cap, s->device);
    }
    weft_tensor_release(s->t);
    pthread_mutex_destroy(&s->mu);
    weft_free(s);
}

/* The last chunk is done: the caller's future completes once the copies back have landed. */
static void staged_finish(staged_t *s)
{
    weft_status_t st = s->st;
    char why[600];
    snprintf(why, sizeof(why), "%s", s->why);
    (void)cudaSetDevice(s->device); /* staged_free's frees too, on this (any) thread */
    if (s->h2d != NULL) {
        cudaError_t e = cudaStreamSynchronize(s->h2d);
        if (e != cudaSuccess && st == WEFT_OK) {
            st = weft_cuda__fail(e, "cudaStreamSynchronize (host to device)", __FILE__, __LINE__);
            snprintf(why, sizeof(why), "%s", weft_last_error());
        }
    }
    weft_future_t *f = s->f;
    staged_free(s);
    weft_future_complete(f, st, st == WEFT_OK ? NULL : why, NULL);
    weft_future_release(f);
}

/* weft_coll_ready_fn_t: the chunk's bytes are in the pinned buffer. */
static weft_status_t chunk_ready(void *arg)
{
    chunk_t *c = arg;
    staged_t *s = c->s;
    pthread_mutex_lock(&s->mu);
    weft_status_t st = s->st;
    if (st != WEFT_OK) {
        /* A status of its own (not a loss or a mismatch, which the others would take as
         * theirs): the group tells the others, who fail this chunk at once. */
        weft__set_error(WEFT_ERR_INVALID_STATE, "an earlier part of this operation failed: %s",
                        s->why);
    }
    pthread_mutex_unlock(&s->mu);
    if (st != WEFT_OK) {
        return WEFT_ERR_INVALID_STATE;
    }
    if (c->copied == NULL) {
        return WEFT_OK;
    }
    /* on the thread that runs the operation: the device made current there, or CUDA would
     * make a context on device 0 for it */
    WEFT_CUDA_CHECK(cudaSetDevice(s->device));
    WEFT_CUDA_CHECK(cudaEventSynchronize(c->copied));
    return WEFT_OK;
}

/* A chunk's collective ended with @p st (text @p why): queue its copy back. */
static void chunk_done(chunk_t *c, weft_status_t st, const char *why)
{
    staged_t *s = c->s;
    if (st != WEFT_OK) {
        staged_fail(s, st, why);
    } else if (s->copy_out && c->len > 0) {
        cudaError_t e = cudaSetDevice(s->device);
        if (e == cudaSuccess) {
            e = cudaMemcpyAsync((unsigned char *)weft_tensor_data(s->t) + c->off, s->host + c->off,
                                c->len, cudaMemcpyHostToDevice, s->h2d);
        }
        if (e != cudaSuccess) {
            weft_status_t fst =
                weft_cuda__fail(e, "cudaMemcpyAsync (host to device)", __FILE__, __LINE__);
            staged_fail(s, fst, weft_last_error());
        }
    }
    atomic_fetch_add(&n_staged_chunks, 1);
    if (atomic_fetch_sub(&s->left, 1) == 1) {
        staged_finish(s);
    }
}

static void chunk_done_cb(weft_future_t *f, void *arg)
{
    chunk_done(arg, weft_future_status(f), weft_future_error(f));
    weft_future_release(f);
}

/* Sets up @p s for @p t: the buffer, streams, chunks, and the device-to-host copies queued. */
static weft_status_t staged_prepare(staged_t *s)
{
    size_t esize = weft_dtype_size(weft_tensor_dtype(s->t));
    s->nbytes = weft_tensor_nbytes(s->t);
    /* A fixed number of chunks whatever the size: members that called with different sizes
     * (both under WEFT_CUDA_SPLIT_MIN, or both over it) fail every chunk alike with MISMATCH
     * and stay in step. */
    size_t elems = s->nbytes / esize;
    s->nchunks = s->nbytes >= WEFT_CUDA_SPLIT_MIN ? (size_t)s->parts : 1;
    size_t align = 16 / esize;
    size_t per = (elems + s->nchunks - 1) / s->nchunks;
    per = (per + align - 1) / align * align;
    size_t chunk = per * esize;
    /* The chunks first: whatever fails after, every chunk still takes its place in the group. */
    s->chunks = weft_calloc(s->nchunks, sizeof(*s->chunks));
    if (s->chunks == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "cuda: no memory for %zu chunks", s->nchunks);
    }
    for (size_t i = 0; i < s->nchunks; i++) {
        chunk_t *c = &s->chunks[i];
        c->s = s;
        c->off = i * chunk < s->nbytes ? i * chunk : s->nbytes;
        c->len = s->nbytes - c->off < chunk ? s->nbytes - c->off : chunk; /* may be 0 */
    }
    WEFT_CHECK(weft_cuda__use(s->device));
    WEFT_CHECK(weft_cuda__pinned_get(s->nbytes, (void **)&s->host, &s->host_cap));
    /* The copies down come after the caller's work queued on the legacy default stream (a
     * kernel that wrote the gradients); nothing waits for its later work (the caller waits for
     * the operation). */
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s->d2h, cudaStreamNonBlocking));
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s->h2d, cudaStreamNonBlocking));
    {
        /* both ways: a broadcast's members write the tensor only after the caller's earlier
         * work on it */
        cudaEvent_t before;
        WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&before, cudaEventDisableTiming));
        cudaError_t e = cudaEventRecord(before, 0);
        if (e == cudaSuccess) {
            e = cudaStreamWaitEvent(s->d2h, before, 0);
        }
        if (e == cudaSuccess) {
            e = cudaStreamWaitEvent(s->h2d, before, 0);
        }
        (void)cudaEventDestroy(before); /* released once the waits are over */
        WEFT_CUDA_CHECK(e);
    }
    const unsigned char *dev = weft_tensor_data(s->t);
    for (size_t i = 0; i < s->nchunks; i++) {
        chunk_t *c = &s->chunks[i];
        int64_t n = (int64_t)(c->len / esize);
        WEFT_CHECK(weft_tensor_wrap(weft_tensor_dtype(s->t), 1, &n, s->host + c->off, c->len,
                                    WEFT_CPU, NULL, NULL, &c->host));
        if (s->copy_in && c->len > 0) {
            /* a wait on it sleeps (the thread running the group's operations) */
            WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&c->copied, cudaEventDisableTiming |
                                                                     cudaEventBlockingSync));
            WEFT_CUDA_CHECK(cudaMemcpyAsync(s->host + c->off, dev + c->off, c->len,
                                            cudaMemcpyDeviceToHost, s->d2h));
            WEFT_CUDA_CHECK(cudaEventRecord(c->copied, s->d2h));
        }
    }
    return WEFT_OK;
}

/* Issues one host collective per chunk. Blocking (@p work_p NULL): one after the other on this
 * thread (the copies still overlap them); else asynchronously, the caller's future completing
 * after the last chunk's copy back. */
static weft_status_t staged_run(weft_pg_t *pg, weft_tensor_t *t, int device, bool bcast, int root,
                                weft_reduce_op_t rop, int parts, weft_future_t **work_p)
{
    staged_t *s = weft_calloc(1, sizeof(*s));
    weft_status_t st;
    if (s == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "cuda: no memory");
    }
    pthread_mutex_init(&s->mu, NULL);
    s->t = weft_tensor_retain(t);
    s->device = device;
    s->parts = parts;
    s->copy_in = !bcast || weft_pg_rank(pg) == root;
    s->copy_out = !bcast || weft_pg_rank(pg) != root;
    WEFT_CHECK_GOTO(weft_future_create(&s->f), st, err_free);
    st = staged_prepare(s);
    if (st != WEFT_OK) {
        /* Nothing issued yet: the group learns of it from a failing first chunk, so that the
         * others do not wait; this rank's later chunks are issued as usual. */
        staged_fail(s, st, weft_last_error());
        if (s->chunks == NULL) {
            goto err_free;
        }
    }
    atomic_fetch_add(&n_staged_ops, 1);
    weft_future_t *f = weft_future_retain(s->f);
    /* s is freed when its last chunk is done, which may be before the loop looks again */
    const size_t nchunks = s->nchunks;
    chunk_t *const chunks = s->chunks;
    atomic_store(&s->left, nchunks);
    for (size_t i = 0; i < nchunks; i++) {
        chunk_t *c = &chunks[i];
        weft_future_t *cf = NULL;
        if (c->host == NULL) {
            /* its tensor could not be made: an empty stand-in keeps the group in step */
            int64_t zero = 0;
            (void)weft_tensor_wrap(weft_tensor_dtype(t), 1, &zero, NULL, 0, WEFT_CPU, NULL, NULL,
                                   &c->host);
        }
        weft_future_t **cfp = work_p != NULL ? &cf : NULL;
        st = bcast ? weft_coll_broadcast_staged(pg, c->host, root, chunk_ready, c, cfp)
                   : weft_coll_all_reduce_staged(pg, c->host, rop, chunk_ready, c, cfp);
        if (st != WEFT_OK || cf == NULL) {
            chunk_done(c, st, st == WEFT_OK ? "" : weft_last_error());
        } else if (weft_future_then(cf, chunk_done_cb, c) != WEFT_OK) { /* releases cf */
            weft_status_t cst = weft_future_wait(cf, -1);
            chunk_done(c, cst, weft_future_error(cf));
            weft_future_release(cf);
        }
    }
    /* s may be gone: f is the caller's reference. */
    if (work_p != NULL) {
        *work_p = f;
        return WEFT_OK;
    }
    st = weft_future_wait(f, -1);
    if (st != WEFT_OK) {
        weft__set_error(st, "%s", weft_future_error(f));
    }
    weft_future_release(f);
    (void)cudaSetDevice(device); /* its chunks may have run other operations' hooks here */
    return st;

err_free:
    if (s->f != NULL) {
        weft_future_release(s->f);
    }
    staged_free(s);
    return st;
}

/* ---- CUDA IPC between ranks of one host ------------------------------------------------------ */

/* What each member shows the others (gathered at every IPC operation). */
typedef struct {
    uint64_t host[2]; /* this host: hashes of its name and boot id */
    uint64_t nonce;   /* this process, drawn at random once (a pid may be reused) */
    int32_t slot;     /* its buffer's slot in its table (the mapping's key with the nonce) */
    int32_t ok;       /* IPC allowed here and the buffer exported */
    uint64_t gen;     /* the buffer's generation in the process */
    uint64_t cap;     /* its size */
    /* the operation as this rank sees it: members that disagree all fail with MISMATCH */
    uint64_t bytes;
    int32_t dtype, rop, root, bcast;
    int32_t parts;   /* its WEFT_CUDA_CHUNKS: the staged path takes the smallest */
    int32_t refused; /* its own checks refused its call: this status (every member fails) */
    cudaIpcMemHandle_t handle;
} ipc_desc_t;

/* This process's exported buffers: one per group and device, grown (doubling) when a larger
 * tensor comes. A grown buffer's old memory is retired, and freed only after an operation in
 * which every member mapped the new one (having closed the old: a mapping must be closed before
 * the exporter frees). Slots are never given to another group: a full table stages. */
#define MAX_OWN 32
static pthread_mutex_t ipc_mu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic uint64_t ipc_gen;
static uint64_t ipc_nonce;
static pthread_once_t nonce_once = PTHREAD_ONCE_INIT;
#define MAX_RETIRED 4
typedef struct {
    const weft_pg_t *pg; /* the handle (NULL: the slot is free) */
    int device;
    bool inited;
    pthread_mutex_t op_mu; /* held through an operation: one at a time per group and device */
    void *buf;
    void *retired[MAX_RETIRED]; /* older generations, freed once every member mapped buf */
    int nretired;
    size_t cap;
    uint64_t gen;
    cudaIpcMemHandle_t handle;
} own_t;
static own_t own[MAX_OWN];

/* Peers' buffers mapped here, by (nonce, slot, local device): a new generation closes the old
 * mapping. */
#define MAX_MAPS 256
static struct {
    uint64_t nonce;
    int32_t slot;
    int device;
    uint64_t gen;
    void *p;
} maps[MAX_MAPS];

static uint64_t hash_str(const char *s, uint64_t h)
{
    for (; *s != '\0'; s++) {
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    }
    return h;
}

static uint64_t host_keys[2];

static void host_key_init(void)
{
    uint64_t *key = host_keys;
    char name[256] = "", boot[64] = "";
    (void)gethostname(name, sizeof(name) - 1);
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        ssize_t n = read(fd, boot, sizeof(boot) - 1);
        boot[n > 0 ? n : 0] = '\0';
        close(fd);
    }
    key[0] = hash_str(name, 1469598103934665603ull);
    key[1] = hash_str(boot, 1469598103934665603ull);
}

static void nonce_init(void)
{
    host_key_init();
    uint64_t n = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0 || read(fd, &n, sizeof(n)) != (ssize_t)sizeof(n)) {
        n = 0;
    }
    if (fd >= 0) {
        close(fd);
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ipc_nonce = n ^ ((uint64_t)getpid() << 32) ^ (uint64_t)ts.tv_nsec ^ (uint64_t)ts.tv_sec;
}

/* The slot of (@p pg, @p device), its op_mu locked: -1 when the table is full or another
 * thread is in an operation of that group (the members then all stage: never wait here, a
 * callback on the group's worker may be the caller). */
static int own_slot(const weft_pg_t *pg, int device)
{
    int slot = -1;
    pthread_mutex_lock(&ipc_mu);
    for (int i = 0; i < MAX_OWN; i++) {
        if (own[i].pg == pg && own[i].device == device) {
            slot = i;
            break;
        }
    }
    for (int i = 0; i < MAX_OWN && slot < 0; i++) {
        if (own[i].pg == NULL) {
            slot = i;
            own[i].pg = pg;
            own[i].device = device;
            if (!own[i].inited) {
                pthread_mutex_init(&own[i].op_mu, NULL);
                own[i].inited = true;
            }
        }
    }
    pthread_mutex_unlock(&ipc_mu);
    if (slot >= 0 && pthread_mutex_trylock(&own[slot].op_mu) != 0) {
        slot = -1;
    }
    return slot;
}

/* Buffers of freed groups: other members may still map them (their mapping closes only when
 * they see a newer generation of that slot), so they are never freed: kept to the end of the
 * process, as few as groups that ran IPC operations. */
#define MAX_GRAVE 256
static void *grave[MAX_GRAVE];
static int ngrave;

static void bury(void *p)
{
    if (p != NULL && ngrave < MAX_GRAVE) {
        grave[ngrave++] = p;
    }
    /* past that many, the memory is only forgotten: never freed under a mapping */
}

/* weft_coll_device_ops_t.group_freed: the handle's slots are given up (their buffers kept). */
static void ipc_group_freed(weft_pg_t *pg)
{
    pthread_mutex_lock(&ipc_mu);
    for (int i = 0; i < MAX_OWN; i++) {
        if (own[i].pg == pg) {
            /* no operation of the handle runs (freeing a group while one does is the caller's
             * error, as for every collective): op_mu is not taken here (it comes before ipc_mu) */
            bury(own[i].buf);
            for (int k = 0; k < own[i].nretired; k++) {
                bury(own[i].retired[k]);
            }
            own[i].buf = NULL;
            own[i].nretired = 0;
            own[i].cap = 0;
            own[i].gen = 0;
            own[i].pg = NULL;
        }
    }
    pthread_mutex_unlock(&ipc_mu);
}

/* Makes the slot's buffer at least @p bytes (the device current); fills @p d. */
static weft_status_t own_grow(int slot, size_t bytes, ipc_desc_t *d)
{
    own_t *o = &own[slot];
    if (o->cap < bytes) {
        size_t cap = o->cap * 2 > bytes ? o->cap * 2 : bytes;
        void *p = NULL;
        cudaIpcMemHandle_t h;
        WEFT_CUDA_CHECK(cudaMalloc(&p, cap));
        cudaError_t e = cudaIpcGetMemHandle(&h, p);
        if (e != cudaSuccess) {
            (void)cudaFree(p);
            return weft_cuda__fail(e, "cudaIpcGetMemHandle", __FILE__, __LINE__);
        }
        if (o->buf != NULL && o->nretired == MAX_RETIRED) {
            /* grown that often with no operation in between that every member mapped */
            (void)cudaFree(p);
            return weft__set_error(WEFT_ERR_UNSUPPORTED,
                                   "cuda: %d retired IPC buffers wait for the members",
                                   MAX_RETIRED);
        }
        if (o->buf != NULL) {
            o->retired[o->nretired++] = o->buf;
        }
        o->buf = p;
        o->cap = cap;
        o->gen = atomic_fetch_add(&ipc_gen, 1) + 1;
        o->handle = h;
    }
    d->slot = slot;
    d->gen = o->gen;
    d->cap = o->cap;
    d->handle = o->handle;
    return WEFT_OK;
}

/* The address of @p peer's buffer in this process (mapped once per generation; the older
 * generation's mapping closed first). */
static weft_status_t map_peer(const ipc_desc_t *peer, int device, void **p_p)
{
    weft_status_t st = WEFT_OK;
    int slot = -1;
    pthread_mutex_lock(&ipc_mu);
    for (int i = 0; i < MAX_MAPS; i++) {
        if (maps[i].p != NULL && maps[i].nonce == peer->nonce && maps[i].slot == peer->slot) {
            if (maps[i].gen == peer->gen && maps[i].device == device) {
                *p_p = maps[i].p;
                pthread_mutex_unlock(&ipc_mu);
                return WEFT_OK;
            }
            if (maps[i].gen < peer->gen) {
                /* the peer grew its buffer: every mapping of an older one closes (on whichever
                 * device it was opened), so that the peer may free it after the agreement; one
                 * that does not close fails this rank's agreement (the peer keeps the memory) */
                cudaError_t e = cudaSuccess;
                if (maps[i].device != device) {
                    e = cudaSetDevice(maps[i].device);
                }
                if (e == cudaSuccess) {
                    e = cudaIpcCloseMemHandle(maps[i].p);
                }
                if (maps[i].device != device) {
                    (void)cudaSetDevice(device);
                }
                if (e != cudaSuccess) {
                    st = weft_cuda__fail(e, "cudaIpcCloseMemHandle", __FILE__, __LINE__);
                    pthread_mutex_unlock(&ipc_mu);
                    return st;
                }
                maps[i].p = NULL;
            }
        }
        if (maps[i].p == NULL && slot < 0) {
            slot = i;
        }
    }
    if (slot < 0) {
        pthread_mutex_unlock(&ipc_mu);
        return weft__set_error(WEFT_ERR_UNSUPPORTED, "cuda: %d peer buffers are mapped already",
                               MAX_MAPS);
    }
    void *p = NULL;
    WEFT_CUDA_CHECK_GOTO(cudaIpcOpenMemHandle(&p, peer->handle, cudaIpcMemLazyEnablePeerAccess), st,
                         out);
    maps[slot].nonce = peer->nonce;
    maps[slot].slot = peer->slot;
    maps[slot].device = device;
    maps[slot].gen = peer->gen;
    maps[slot].p = p;
    atomic_fetch_add(&n_ipc_maps, 1);
    *p_p = p;
out:
    pthread_mutex_unlock(&ipc_mu);
    return st;
}

/* A blocking host collective on a small CPU tensor over @p data. */
static weft_status_t host_all_gather(weft_pg_t *pg, const void *mine, void *all, size_t bytes)
{
    weft_tensor_t *in = NULL, *out = NULL;
    int64_t n = (int64_t)bytes, nall = n * weft_pg_size(pg);
    weft_status_t st;
    WEFT_CHECK(weft_tensor_wrap(WEFT_U8, 1, &n, (void *)mine, bytes, WEFT_CPU, NULL, NULL, &in));
    WEFT_CHECK_GOTO(
        weft_tensor_wrap(WEFT_U8, 1, &nall, all, (size_t)nall, WEFT_CPU, NULL, NULL, &out), st,
        out);
    st = weft_coll_all_gather(pg, in, out, NULL);
out:
    weft_tensor_release(in);
    weft_tensor_release(out);
    return st;
}

/* Every member's flag, MIN: also the barrier that orders the buffers' writes and reads. */
static weft_status_t agree(weft_pg_t *pg, int32_t *flag)
{
    weft_tensor_t *t;
    int64_t one = 1;
    WEFT_CHECK(weft_tensor_wrap(WEFT_I32, 1, &one, flag, sizeof(*flag), WEFT_CPU, NULL, NULL, &t));
    weft_status_t st = weft_coll_all_reduce(pg, t, WEFT_MIN, NULL);
    weft_tensor_release(t);
    return st;
}

/* The element range of member @p r's share: 16-byte aligned boundaries. */
static void share(size_t n, size_t esize, int size, int r, size_t *lo_p, size_t *len_p)
{
    size_t per = (n + (size_t)size - 1) / (size_t)size;
    size_t align = 16 / esize;
    per = (per + align - 1) / align * align;
    size_t lo = per * (size_t)r < n ? per * (size_t)r : n;
    *lo_p = lo;
    *len_p = n - lo < per ? n - lo : per;
}

/* The first member whose view of the operation differs from group rank 0's (-1: none). */
static int first_unlike(const ipc_desc_t *all, int size)
{
    for (int r = 1; r < size; r++) {
        if (all[r].bytes != all[0].bytes || all[r].dtype != all[0].dtype ||
            all[r].rop != all[0].rop || all[r].root != all[0].root ||
            all[r].bcast != all[0].bcast) {
            return r;
        }
    }
    return -1;
}

/* Whether every member can take the IPC path (the same host, buffers made). */
static bool all_ipc(const ipc_desc_t *all, int size)
{
    for (int r = 0; r < size; r++) {
        if (!all[r].ok || all[r].host[0] != all[0].host[0] || all[r].host[1] != all[0].host[1] ||
            all[r].cap < all[r].bytes) {
            return false;
        }
    }
    return true;
}

/*
 * Every device operation starts here: the members show each other their view of it (one small
 * all_gather on the host). Members that see different operations fail it alike
 * (WEFT_ERR_MISMATCH, nothing issued after). When every member is on this host with a buffer
 * for it, the operation runs through CUDA IPC here (*done_p); else (*done_p false, WEFT_OK)
 * every member stages it in *parts_p chunks (the members' smallest WEFT_CUDA_CHUNKS). Blocks
 * the caller through three (broadcast) or four host collectives on the IPC path.
 */
static weft_status_t ipc_run(weft_pg_t *pg, weft_tensor_t *t, int device, bool bcast, int root,
                             weft_reduce_op_t rop, weft_status_t refused, bool *done_p,
                             int *parts_p)
{
    int size = weft_pg_size(pg), me = weft_pg_rank(pg);
    size_t nbytes = weft_tensor_nbytes(t), esize = weft_dtype_size(weft_tensor_dtype(t));
    size_t n = nbytes / esize;
    weft_status_t st = WEFT_OK;
    ipc_desc_t mine, *all = NULL;
    void *bufs[WEFT_CUDA_MAX_SOURCES];

    *done_p = false;
    pthread_once(&nonce_once, nonce_init);
    memset(&mine, 0, sizeof(mine));
    mine.host[0] = host_keys[0];
    mine.host[1] = host_keys[1];
    mine.nonce = ipc_nonce;
    mine.slot = -1;
    mine.bytes = nbytes;
    mine.dtype = (int32_t)weft_tensor_dtype(t);
    mine.rop = bcast ? -1 : (int32_t)rop;
    mine.root = bcast ? root : -1;
    mine.bcast = bcast ? 1 : 0;
    mine.parts = (int32_t)weft__cfg_int(WEFT__CFG_CUDA_CHUNKS);
    mine.refused = (int32_t)refused;
    char why_refused[600];
    snprintf(why_refused, sizeof(why_refused), "%s", refused != WEFT_OK ? weft_last_error() : "");
    int slot = -1;
    if (refused == WEFT_OK && weft__cfg_bool(WEFT__CFG_CUDA_IPC) && size <= WEFT_CUDA_MAX_SOURCES &&
        nbytes > 0 && nbytes >= (size_t)weft__cfg_int(WEFT__CFG_CUDA_IPC_MIN_KB) * 1024 &&
        weft_cuda__use(device) == WEFT_OK && (slot = own_slot(pg, device)) >= 0) {
        if (own_grow(slot, nbytes, &mine) == WEFT_OK) {
            mine.ok = 1;
        } else {
            WEFT_INFO("cuda: IPC buffer: %s; staging instead", weft_last_error());
        }
    }
    all = weft_calloc((size_t)size, sizeof(*all));
    if (all == NULL) {
        st = weft__set_error(WEFT_ERR_NO_MEMORY, "cuda: no memory");
        goto out;
    }
    WEFT_CHECK_GOTO(host_all_gather(pg, &mine, all, sizeof(mine)), st, out);
    (void)cudaSetDevice(device); /* the gather may have run other operations' hooks here */
    if (refused != WEFT_OK) {
        st = weft__set_error(refused, "%s", why_refused);
        goto out;
    }
    for (int r = 0; r < size; r++) {
        if (all[r].refused != WEFT_OK) {
            st = weft__set_error(WEFT_ERR_INVALID_ARG,
                                 "%s: group rank %d refused its call (%s): every member fails it",
                                 bcast ? "broadcast" : "all_reduce", r,
                                 weft_strerror((weft_status_t)all[r].refused));
            goto out;
        }
    }
    int unlike = first_unlike(all, size);
    if (unlike >= 0) {
        st = weft__set_error(
            WEFT_ERR_MISMATCH,
            "%s: group ranks 0 and %d called different operations on device "
            "tensors (%s of %llu bytes of dtype %d, op %d, root %d; %s of %llu "
            "bytes of dtype %d, op %d, root %d)",
            bcast ? "broadcast" : "all_reduce", unlike, all[0].bcast ? "broadcast" : "all_reduce",
            (unsigned long long)all[0].bytes, all[0].dtype, all[0].rop, all[0].root,
            all[unlike].bcast ? "broadcast" : "all_reduce", (unsigned long long)all[unlike].bytes,
            all[unlike].dtype, all[unlike].rop, all[unlike].root);
        goto out;
    }
    *parts_p = all[0].parts;
    for (int r = 1; r < size; r++) {
        *parts_p = all[r].parts < *parts_p ? all[r].parts : *parts_p;
    }
    if (!all_ipc(all, size)) {
        goto out; /* every member sees the same: all take the staged path */
    }
    /* Map the others' buffers and copy this tensor into this rank's own; then agree. */
    int32_t ok = 1;
    for (int r = 0; r < size && ok; r++) {
        if (r == me) {
            bufs[r] = own[slot].buf;
        } else if (map_peer(&all[r], device, &bufs[r]) != WEFT_OK) {
            WEFT_INFO("cuda: IPC refused, staging instead: %s", weft_last_error());
            ok = 0;
        }
    }
    if (ok && (!bcast || me == root)) {
        /* after the caller's work on the legacy stream; done before the others read it */
        cudaError_t e = cudaMemcpy(bufs[me], weft_tensor_data(t), nbytes, cudaMemcpyDeviceToDevice);
        if (e == cudaSuccess) {
            e = cudaStreamSynchronize(0);
        }
        if (e != cudaSuccess) {
            WEFT_INFO("cuda: IPC copy failed, staging instead: %s", cudaGetErrorString(e));
            (void)cudaGetLastError();
            ok = 0;
        }
    }
    WEFT_CHECK_GOTO(agree(pg, &ok), st, out);
    (void)cudaSetDevice(device);
    if (!ok) {
        goto out;
    }
    for (int k = 0; k < own[slot].nretired; k++) {
        /* every member mapped this generation, closing the older ones */
        (void)cudaFree(own[slot].retired[k]);
    }
    own[slot].nretired = 0;
    *done_p = true;
    atomic_fetch_add(&n_ipc_ops, 1);
    if (bcast) {
        if (me != root) {
            WEFT_CUDA_CHECK_GOTO(
                cudaMemcpy(weft_tensor_data(t), bufs[root], nbytes, cudaMemcpyDeviceToDevice), st,
                fail);
            WEFT_CUDA_CHECK_GOTO(cudaStreamSynchronize(0), st, fail);
        }
    } else {
        weft_cuda__sources_t srcs;
        size_t lo, len;
        share(n, esize, size, me, &lo, &len);
        for (int r = 0; r < size; r++) {
            srcs.p[r] = (const unsigned char *)bufs[r] + lo * esize;
        }
        WEFT_CUDA_CHECK_GOTO(weft_cuda__reduce_many(0, (unsigned char *)bufs[me] + lo * esize,
                                                    &srcs, size, len, weft_tensor_dtype(t), rop),
                             st, fail);
        WEFT_CUDA_CHECK_GOTO(cudaStreamSynchronize(0), st, fail);
        WEFT_CHECK_GOTO(weft_coll_barrier(pg, NULL), st, out);
        (void)cudaSetDevice(device);
        for (int r = 0; r < size; r++) {
            share(n, esize, size, r, &lo, &len);
            if (len > 0) {
                WEFT_CUDA_CHECK_GOTO(
                    cudaMemcpyAsync((unsigned char *)weft_tensor_data(t) + lo * esize,
                                    (const unsigned char *)bufs[r] + lo * esize, len * esize,
                                    cudaMemcpyDeviceToDevice, 0),
                    st, fail);
            }
        }
        WEFT_CUDA_CHECK_GOTO(cudaStreamSynchronize(0), st, fail);
    }
    /* Nobody rewrites its buffer (the next operation) while another still reads it. */
    WEFT_CHECK_GOTO(weft_coll_barrier(pg, NULL), st, out);
    goto out;

fail:
    /* A device failure half-way: the others are (or will be) at a barrier; this rank's
     * all_reduce there does not match it, so every member fails the operation. */
    {
        char why[600];
        snprintf(why, sizeof(why), "%s", weft_last_error());
        int32_t bad = 0;
        (void)agree(pg, &bad);
        st = weft__set_error(st, "%s", why);
    }
out:
    if (slot >= 0) {
        pthread_mutex_unlock(&own[slot].op_mu);
    }
    weft_free(all);
    return st;
}

/* ---- the entry ------------------------------------------------------------------------------- */

static weft_status_t completed(weft_status_t st, weft_future_t **work_p)
{
    if (work_p == NULL) {
        return st;
    }
    weft_future_t *f;
    char why[WEFT__ERROR_MAX];
    snprintf(why, sizeof(why), "%s", st == WEFT_OK ? "" : weft_last_error());
    WEFT_CHECK(weft_future_create(&f));
    weft_future_complete(f, st, st == WEFT_OK ? NULL : why, NULL);
    *work_p = f;
    return WEFT_OK;
}

static weft_status_t run(weft_pg_t *pg, weft_tensor_t *t, bool bcast, int root,
                         weft_reduce_op_t rop, weft_future_t **work_p)
{
    const char *what = bcast ? "broadcast" : "all_reduce";
    int device;
    weft_status_t st;
    WEFT_CHECK(weft_cuda__device_of(t, what, &device));
    if (weft_pg_rank(pg) < 0) {
        return weft__set_error(WEFT_ERR_INVALID_STATE, "%s: this rank is not a member of the group",
                               what);
    }
    /* A call refused here still takes its place in the group, so that the others fail it at
     * once rather than at their deadline: through the gather (IPC sizes), or through the host
     * collectives, which refuse each chunk alike and tell the others. */
    weft_status_t refused = WEFT_OK;
    if (!bcast) {
        refused = weft_reduce_check(rop, weft_tensor_dtype(t));
        if (refused != WEFT_OK) {
            weft__set_error(refused, "%s: %s", what, weft_last_error());
        }
    } else if (root < 0 || root >= weft_pg_size(pg)) {
        refused = weft__set_error(WEFT_ERR_INVALID_ARG, "%s: root %d is not in the group of %d",
                                  what, root, weft_pg_size(pg));
    }
    if (weft_pg_size(pg) == 1) {
        /* one member: the tensor is the result */
        return refused != WEFT_OK ? refused : completed(WEFT_OK, work_p);
    }
    /* Only an operation that may go through IPC gathers the members' views first (and blocks
     * the caller); the others are staged at once, asynchronous as the host collectives. */
    size_t nbytes = weft_tensor_nbytes(t);
    int parts = (int)weft__cfg_int(WEFT__CFG_CUDA_CHUNKS);
    if (weft__cfg_bool(WEFT__CFG_CUDA_IPC) && weft_pg_size(pg) <= WEFT_CUDA_MAX_SOURCES &&
        nbytes > 0 && nbytes >= (size_t)weft__cfg_int(WEFT__CFG_CUDA_IPC_MIN_KB) * 1024) {
        bool done = false;
        st = ipc_run(pg, t, device, bcast, root, rop, refused, &done, &parts);
        if (st != WEFT_OK || done) {
            return completed(st, work_p);
        }
    }
    return staged_run(pg, t, device, bcast, root, rop, parts, work_p);
}

static weft_status_t device_all_reduce(weft_pg_t *pg, weft_tensor_t *t, weft_reduce_op_t op,
                                       weft_future_t **work_p)
{
    return run(pg, t, false, 0, op, work_p);
}

static weft_status_t device_broadcast(weft_pg_t *pg, weft_tensor_t *t, int root,
                                      weft_future_t **work_p)
{
    return run(pg, t, true, root, WEFT_SUM, work_p);
}

const weft_coll_device_ops_t weft_cuda__coll_ops = {
    .name = "cuda",
    .all_reduce = device_all_reduce,
    .broadcast = device_broadcast,
    .group_freed = ipc_group_freed,
};
