/* The parameter server's insides: the client (ps/client.c), the server (ps/server.c), the cells
 * that hold values and optimizer state (ps/store.c), the id maps (ps/map.c) and checkpoints
 * (ps/checkpoint.c). docs/ps.md describes the protocol. */
#ifndef WEFT_PS_INTERNAL_H
#define WEFT_PS_INTERNAL_H

#if !defined(WEFT_IN_PS)
#error "ps/internal.h is the parameter server's own"
#endif

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include <weft/module.h>
#include <weft/ps.h>
#include <weft/rpc.h>

#include "../core/internal.h"
#include "ps.pb-c.h"
#include "weft_pb.h"

#define PS_FN            "__weft.ps"
#define PS_STRIPES       64 /* lock stripes of a sparse table on a server */
/* A bounded sparse table without a capacity, of at most this many ids, finds its rows on a server
 * through a direct index (one pointer per id of the bound, its pages made as they are touched)
 * instead of the stripes' maps. */
#define PS_DIRECT_MAX_IDS ((uint64_t)1 << 25)
#define PS_MAX_TABLES    1024
#define PS_DEDUP_WINDOW  4096 /* pushes of one worker that may overtake each other */
#define PS_SEQ_FREE      64   /* per server: numbers of unsent pushes kept to be used again */
#define PS_SYNC_AHEAD    64   /* steps a worker's clock may run ahead of a SYNC table */
#define PS_NAME_MAX      127
#define PS_DEFAULT_CHUNK ((uint64_t)4 << 20)

/* ------------------------------------------------------------------ maps (ps/map.c) */

/* u64 -> non-NULL pointer, open addressing with linear probing; not thread-safe. */
typedef struct {
    uint64_t key;
    void *val; /* NULL: empty slot */
} ps_map_slot_t;

typedef struct {
    ps_map_slot_t *slots; /* key and value side by side: one cache line per probe */
    size_t cap;           /* a power of two, or 0 */
    size_t n;
} ps_map_t;

/* d[i] = x[i] * s, d and x disjoint (weft__ps_scale_in: in place; weft__ps_scale: either).
 * restrict and fixed blocks, so that GCC's -O2 vectoriser takes the loops (it takes no loop that
 * needs a runtime overlap check or a tail). */
static inline void weft__ps_scale_to(float *restrict d, const float *restrict x, float s, size_t n)
{
    size_t nb = n / 16;
    for (size_t b = 0; b < nb; b++) {
        for (size_t i = b * 16; i < b * 16 + 16; i++) {
            d[i] = x[i] * s;
        }
    }
    for (size_t i = nb * 16; i < n; i++) {
        d[i] = x[i] * s;
    }
}
static inline void weft__ps_scale_in(float *restrict d, float s, size_t n)
{
    size_t nb = n / 16;
    for (size_t b = 0; b < nb; b++) {
        for (size_t i = b * 16; i < b * 16 + 16; i++) {
            d[i] *= s;
        }
    }
    for (size_t i = nb * 16; i < n; i++) {
        d[i] *= s;
    }
}
static inline void weft__ps_scale(float *d, const float *x, float s, int64_t n)
{
    if (d == x) {
        weft__ps_scale_in(d, s, (size_t)n);
    } else {
        weft__ps_scale_to(d, x, s, (size_t)n);
    }
}

static inline size_t weft__ps_map_home(uint64_t key, size_t cap)
{
    return (size_t)((key * UINT64_C(0xff51afd7ed558ccd)) >> 17) & (cap - 1);
}
/* Asks the cache for the slot where @p key's probe starts (a later get finds it there). */
static inline void weft__ps_map_prefetch(const ps_map_t *m, uint64_t key)
{
    if (m->cap != 0) {
        __builtin_prefetch(&m->slots[weft__ps_map_home(key, m->cap)]);
    }
}
void *weft__ps_map_get(const ps_map_t *m, uint64_t key);
/* Room for @p n keys without growing. */
weft_status_t weft__ps_map_reserve(ps_map_t *m, size_t n);
weft_status_t weft__ps_map_put(ps_map_t *m, uint64_t key, void *val);
void *weft__ps_map_del(ps_map_t *m, uint64_t key);
void weft__ps_map_free(ps_map_t *m);
/* The slot index of the i-th occupied slot scan: iterate with weft__ps_map_next from 0. */
bool weft__ps_map_next(const ps_map_t *m, size_t *pos, uint64_t *key_p, void **val_p);

/* The server a sparse id lives on: Fibonacci hashing, top 32 bits, modulo the servers. */
static inline uint32_t weft__ps_id_server(uint64_t id, uint32_t n_servers)
{
    /* The top 32 bits as a u32 first: a 32-bit division, several times cheaper than a 64-bit one
     * (the same value). */
    return (uint32_t)((id * UINT64_C(11400714819323198549)) >> 32) % n_servers;
}
/* The stripe of an id within a server (other bits than the server's). */
static inline uint32_t weft__ps_id_stripe(uint64_t id)
{
    return (uint32_t)((id * UINT64_C(0x9E3779B97F4A7C15)) >> 58) % PS_STRIPES;
}

/* ------------------------------------------------------------------ specs */

/* A table's spec and what follows from it, identical on every rank. */
typedef struct {
    weft_ps_table_spec_t spec; /* name points into name[] */
    char name[PS_NAME_MAX + 1];
    uint32_t id;
    int64_t numel;       /* dense: elements */
    int64_t chunk_elems; /* dense */
    uint32_t n_chunks;   /* dense */
    uint32_t *owner;     /* dense: chunk -> server index */
    uint32_t n_servers;
    uint32_t n_workers;
    uint64_t map_hash;
    int n_state; /* optimizer state tensors per cell */
} ps_layout_t;

weft_status_t weft__ps_layout_init(ps_layout_t *l, const weft_ps_table_spec_t *spec, uint32_t id,
                                   uint32_t n_servers, uint32_t n_workers);
void weft__ps_layout_free(ps_layout_t *l);
/* A spec on the wire (fields borrowed from @p l); free with weft__ps_spec_pb_free. */
weft_status_t weft__ps_spec_to_pb(const ps_layout_t *l, const int *servers, const int *workers,
                                  Weft__V1__PsTableSpec *pb);
void weft__ps_spec_pb_free(Weft__V1__PsTableSpec *pb);
/* The first field in which two wire specs differ (NULL when equal), its values in @p why. */
const char *weft__ps_spec_diff(const Weft__V1__PsTableSpec *a, const Weft__V1__PsTableSpec *b,
                               char *why, size_t n);
/* Elements of dense chunk @p c. */
static inline int64_t weft__ps_chunk_len(const ps_layout_t *l, uint32_t c)
{
    int64_t left = l->numel - (int64_t)c * l->chunk_elems;
    return left < l->chunk_elems ? left : l->chunk_elems;
}

/* ------------------------------------------------------------------ cells (ps/store.c) */

/* A dense chunk or a sparse row: its value and optimizer state. A dense chunk's value is a tensor
 * (a pull lends it, copy on write); a sparse row is one allocation, this header followed by its
 * value and its state, so that serving a row touches one run of memory. */
typedef struct ps_cell {
    /* What serving a row reads, in its first cache line (a row's block starts on one). */
    uint64_t id;              /* sparse id, or chunk index */
    int64_t n;                /* elements */
    int64_t step;             /* optimizer steps applied */
    void *vdata;              /* the value's bytes (storage dtype) */
    float *sdata[3];          /* the optimizer state's, f32 [n] each, as many as it keeps */
    weft_dtype_t dtype;       /* storage */
    bool dense;               /* a dense chunk: a pull may share its value (copy on write) */
    bool acc_on;              /* SYNC: acc holds this step's gradient (the cell is listed) */
    /* The rest: eviction, SYNC steps, dense chunks, the block's own allocation. */
    uint64_t touch;           /* last use (sparse eviction) */
    float *acc;               /* SYNC: the step's summed gradient (a dense chunk keeps it) */
    struct ps_cell *next_acc; /* SYNC: cells with a gradient this step */
    weft_tensor_t *value;     /* a dense chunk's value (vdata is its data); NULL for a row */
    weft_tensor_t *state[3];  /* a dense chunk's state tensors; NULL for a row */
    void *block;              /* what was allocated (the cell starts at its first cache line) */
} ps_cell_t;

/* Where a row's value starts in its block, past the header (a multiple of the cache line). */
#define PS_CELL_HEAD (((sizeof(ps_cell_t)) + 63) & ~(size_t)63)
_Static_assert(offsetof(ps_cell_t, acc_on) < 64, "a row's hot header fields fit one cache line");

/* Makes a cell of @p n elements with its initial value (id = row or chunk) and zero state. */
weft_status_t weft__ps_cell_new(const ps_layout_t *l, uint64_t id, int64_t n, ps_cell_t **c_p);
void weft__ps_cell_free(ps_cell_t *c);
/* The initial values of row/chunk @p id into @p out (f32 [n]). */
void weft__ps_init_values(const ps_layout_t *l, uint64_t id, int64_t n, float *out);
/* Applies gradient @p grad (f32 [n]) scaled by @p scale with the table's optimizer. */
weft_status_t weft__ps_cell_apply(const ps_layout_t *l, ps_cell_t *c, const float *grad,
                                  float scale);
/* Makes the cell's value its own before it is written (a pull may be sending the old bytes). */
weft_status_t weft__ps_cell_own(ps_cell_t *c);
/* The cell's value as f32 into @p out. */
void weft__ps_cell_read(const ps_cell_t *c, float *out);
/* Bytes of a cell's value + state (stats, checkpoints). */
size_t weft__ps_cell_bytes(const ps_layout_t *l, int64_t n);

/* ------------------------------------------------------------------ the server (ps/server.c) */

typedef struct ps_park ps_park_t;

typedef struct {
    pthread_mutex_t mu;
    ps_map_t rows;  /* id -> ps_cell_t */
    ps_map_t admit; /* id -> pushes seen before admission (as a pointer-sized count) */
} ps_stripe_t;

typedef struct ps_stable {
    struct ps_server *srv;
    ps_layout_t l;
    uint32_t me;        /* this server's index */
    ps_cell_t **chunks; /* dense: by chunk, NULL where another server holds it */
    ps_stripe_t stripes[PS_STRIPES];
    /* Bounded tables (PS_DIRECT_MAX_IDS): id -> its row, or NULL, in place of the stripes' maps
     * of rows (which stay empty); an entry is written and read under its id's stripe lock, or
     * by whoever holds t->mu with no request running (loading, dropping), as the maps are.
     * NULL: the maps (also where the address space for it was refused). */
    ps_cell_t **direct;
    size_t direct_bytes;
    _Atomic uint64_t tick;

    /* consistency, under mu */
    pthread_mutex_t mu;
    int64_t cur_step;                    /* SYNC: the step being gathered (steps applied) */
    int64_t *clock;                      /* per worker: steps it ended, as this server knows */
    uint64_t *ann;                       /* per worker: its pushes here through its latest clock */
    uint64_t (*ann_ring)[PS_SYNC_AHEAD]; /* SYNC: ann at the end of each step */
    uint64_t *recv;                      /* per worker: pushes counted */
    bool *dead;
    ps_cell_t *acc_list;  /* SYNC: cells with a gradient this step */
    weft_status_t failed; /* a lost worker stops SYNC/BOUNDED tables */
    char failed_why[256];
    ps_park_t *parked;

    /* stats */
    _Atomic uint64_t bytes_in, bytes_out, pushes, pulls, duplicates, evicted, n_rows;
    _Atomic uint64_t hist[WEFT_PS_STALENESS_BUCKETS];
} ps_stable_t;

/* A table being created: the spec of each rank that asked, and their calls. */
typedef struct {
    Weft__V1__PsTableSpec **specs; /* per rank (unpacked, owned), NULL: not yet */
    weft_call_t **calls;           /* per rank */
    int arrived;
} ps_pending_create_t;

typedef struct ps_server {
    weft_ps_t *ps;
    pthread_mutex_t mu; /* tables, creates, dedup */
    ps_stable_t *tables[PS_MAX_TABLES];
    uint32_t n_tables;
    ps_pending_create_t creates[PS_MAX_TABLES];
    /* exactly once: per worker, every seq < next was seen; seen[] marks those after it */
    uint64_t *dedup_next;
    uint64_t (*dedup_seen)[PS_DEDUP_WINDOW / 64];
    _Atomic uint64_t park_ids;
    /* weft_ps_finish: workers that said they are done, or were lost */
    pthread_cond_t finish_cv;
    bool *finished;
    char lost_why[256];
    /* a checkpoint being gathered: each worker's request and call (under mu) */
    Weft__V1__PsRequest **ckpt_reqs;
    weft_call_t **ckpt_calls;
    uint32_t ckpt_arrived;
    /* a SAVE answered to worker 0: the others' calls wait for its COMMIT (the MANIFEST) */
    weft_call_t **held_calls;
    uint64_t held_version;
    /* a COMMIT that came before its save's calls were held here (the save still being
     * written when worker 0 gave up on it): its outcome, for them */
    bool commit_seen;
    uint64_t commit_version;
    int32_t commit_status;
    char commit_text[640];
    bool ckpt_running;
    pthread_t ckpt_thread;
    bool ckpt_joinable;
    int64_t saves; /* saves this server began (WEFT_PS_FAULT_SAVE_EXIT counts them) */
} ps_server_t;

weft_status_t weft__ps_server_new(weft_ps_t *ps, ps_server_t **srv_p);
void weft__ps_server_free(ps_server_t *srv);
void weft__ps_handle(weft_call_t *call, void *arg);
void weft__ps_server_peer_lost(ps_server_t *srv, int rank, const char *why);
weft_status_t weft__ps_server_wait_finished(ps_server_t *srv, int64_t timeout_ms);
/* Frees every sparse row and admission counter of @p t (t->mu held or no one else using it). */
void weft__ps_stable_drop_rows(ps_stable_t *t);
/* The row of id @p id of stripe @p s (its lock held; @p id within the table's bound), or NULL. */
static inline ps_cell_t *weft__ps_row_find(const ps_stable_t *t, const ps_stripe_t *s, uint64_t id)
{
    return t->direct != NULL ? t->direct[id] : (ps_cell_t *)weft__ps_map_get(&s->rows, id);
}
/* Asks the cache for where weft__ps_row_find will look for @p id. */
static inline void weft__ps_row_prefetch(const ps_stable_t *t, const ps_stripe_t *s, uint64_t id)
{
    if (t->direct != NULL) {
        __builtin_prefetch(&t->direct[id]);
    } else {
        weft__ps_map_prefetch(&s->rows, id);
    }
}
/* Adds row @p c of id @p id to stripe @p s (its lock held), in place of none. */
weft_status_t weft__ps_row_put(ps_stable_t *t, ps_stripe_t *s, uint64_t id, ps_cell_t *c);
/* Takes the row of id @p id out of stripe @p s (its lock held); returns it, or NULL. */
ps_cell_t *weft__ps_row_del(ps_stable_t *t, ps_stripe_t *s, uint64_t id);
/* Calls @p fn on every sparse row of @p t (every stripe held, or no one else using t). */
void weft__ps_rows_each(ps_stable_t *t, void (*fn)(ps_cell_t *c, void *arg), void *arg);

/* ------------------------------------------------------------------ the client (ps/client.c) */

struct weft_ps_table {
    weft_ps_t *ps;
    ps_layout_t l;
    _Atomic uint64_t *pushes; /* per server: pushes of this table sent there */
};

struct weft_ps {
    weft_agent_t *agent;
    int rank, world;
    pthread_mutex_t mu;
    bool roles_set;
    int *servers;
    uint32_t n_servers;
    int *workers;
    uint32_t n_workers;
    int server_index; /* -1: not a server */
    int worker_index; /* -1: not a worker */
    ps_server_t *srv; /* when this rank serves */
    weft_ps_table_t *tables[PS_MAX_TABLES];
    _Atomic uint32_t n_tables;
    _Atomic uint64_t *seq; /* per server: pushes sent (exactly-once numbering) */
    /* Per server, numbers taken by pushes that never left this process (a send refused at once):
     * the next pushes take them again, so the server's window of numbers has no hole. */
    pthread_mutex_t seq_mu;
    _Atomic uint32_t *n_seq_free;
    uint64_t (*seq_free)[PS_SEQ_FREE];
    _Atomic int64_t clock;
    _Atomic bool *server_lost; /* per server */
    bool fault_dup;
    int64_t fault_delay_us;
};

/* An RPC to server @p s of request @p hdr with @p tensors; the future fails with the table and the
 * server named. */
weft_status_t weft__ps_call(weft_ps_t *ps, uint32_t s, const Weft__V1__PsRequest *hdr,
                            weft_tensor_t *const *tensors, size_t n_tensors, int64_t timeout_ms,
                            weft_future_t **f_p);
/* Sends @p r (or, per server, what @p per_server makes of it) to every server and waits for all;
 * the replies go to @p replies (may be NULL). @p retry_unready: retry a server that has no
 * parameter server yet (a table creation racing a rank's start) until the deadline. */
weft_status_t weft__ps_all_servers(weft_ps_t *ps, Weft__V1__PsRequest *r,
                                   Weft__V1__PsRequest *(*per_server)(weft_ps_t *, uint32_t,
                                                                      void *),
                                   int64_t timeout_ms, weft_value_t **replies, bool retry_unready);
/* per_server for weft__ps_all_servers: @p arg (a request) with step_pushes = this worker's pushes
 * so far to server @p s, per table. */
Weft__V1__PsRequest *weft__ps_counts_request(weft_ps_t *ps, uint32_t s, void *arg);
/* Unpacks a reply value's header. */
weft_status_t weft__ps_reply_unpack(const weft_value_t *v, Weft__V1__PsReply **r_p);

/* checkpoints (ps/checkpoint.c): the server's side. SAVE and LOAD wait until every worker has
 * sent its own; then a thread of the checkpoint's waits for the fence, writes or reads the
 * shards and answers them all. */
void weft__ps_server_checkpoint(ps_server_t *srv, weft_call_t *call, Weft__V1__PsRequest *req);
void weft__ps_server_checkpoint_free(ps_server_t *srv);
/* COMMIT from worker 0: answers the SAVE calls held for its MANIFEST. */
void weft__ps_server_commit(ps_server_t *srv, weft_call_t *call, Weft__V1__PsRequest *req);
/* Worker @p w (rank @p rank) was lost (@p why): the requests of a checkpoint being gathered fail
 * at once with WEFT_ERR_PEER_LOST (its answer cannot reach it, and the others may never come: the
 * workers that see the loss first stop). */
void weft__ps_server_checkpoint_lost(ps_server_t *srv, int w, int rank, const char *why);
uint32_t weft__ps_crc32c(uint32_t crc, const void *data, size_t n);

#endif
