/* The server's side: the function "__weft.ps", tables made when every rank agrees on them, pushes
 * counted exactly once per (worker, sequence), SYNC steps gathered and applied as one, pulls that
 * wait (parked calls) until the table's consistency allows them, lost workers, counters. */
#include <errno.h>
#include <stdio.h>
#include <sys/mman.h>
#include <string.h>
#include <time.h>

#include <weft/reduce.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "internal.h"

struct ps_park {
    ps_park_t *next;
    uint64_t id;
    weft_call_t *call;
    Weft__V1__PsRequest *req; /* owned */
    weft_value_t *args;       /* a parked push's tensors; owned */
    bool push;                /* a SYNC push of a later step (else a pull) */
};

/* A call answered once the table's lock is released. */
typedef struct done {
    struct done *next;
    weft_call_t *call;
    weft_value_t *reply;  /* success */
    weft_status_t status; /* else */
    char why[256];
} done_t;

static void done_add(done_t **list, weft_call_t *call, weft_value_t *reply, weft_status_t st,
                     const char *why)
{
    done_t *d = weft_calloc(1, sizeof(*d));
    if (d == NULL) {
        /* Nothing better is left than answering at once. */
        if (reply != NULL) {
            weft_call_reply(call, reply);
        } else {
            weft_call_fail(call, st, "%s", why);
        }
        return;
    }
    d->call = call;
    d->reply = reply;
    d->status = st;
    snprintf(d->why, sizeof(d->why), "%s", why != NULL ? why : "");
    d->next = *list;
    *list = d;
}

static void done_run(done_t *list)
{
    while (list != NULL) {
        done_t *d = list;
        list = d->next;
        if (d->status == WEFT_OK) {
            weft_call_reply(d->call, d->reply);
        } else {
            weft_call_fail(d->call, d->status, "%s", d->why);
        }
        weft_free(d);
    }
}

static void park_free(ps_park_t *p)
{
    weft__v1__ps_request__free_unpacked(p->req, &weft__pb_allocator);
    weft_value_free(p->args);
    weft_free(p);
}

static weft_value_t *reply_pack(Weft__V1__PsReply *r, weft_value_t *body)
{
    weft_value_t *v = NULL;
    if (weft_msg_pack(&r->base, body, &v) != WEFT_OK) {
        v = NULL;
    }
    return v;
}

static weft_value_t *reply_empty(void)
{
    Weft__V1__PsReply r = WEFT__V1__PS_REPLY__INIT;
    return reply_pack(&r, NULL);
}

/* ------------------------------------------------------------------ tables */

weft_status_t weft__ps_row_put(ps_stable_t *t, ps_stripe_t *s, uint64_t id, ps_cell_t *c)
{
    if (t->direct != NULL) {
        t->direct[id] = c;
        return WEFT_OK;
    }
    return weft__ps_map_put(&s->rows, id, c);
}

ps_cell_t *weft__ps_row_del(ps_stable_t *t, ps_stripe_t *s, uint64_t id)
{
    if (t->direct != NULL) {
        ps_cell_t *c = t->direct[id];
        t->direct[id] = NULL;
        return c;
    }
    return weft__ps_map_del(&s->rows, id);
}

void weft__ps_rows_each(ps_stable_t *t, void (*fn)(ps_cell_t *c, void *arg), void *arg)
{
    if (t->direct != NULL) {
        for (uint64_t id = 0; id < t->l.spec.id_bound; id++) {
            if (t->direct[id] != NULL) {
                fn(t->direct[id], arg);
            }
        }
        return;
    }
    for (int i = 0; i < PS_STRIPES; i++) {
        size_t pos = 0;
        uint64_t key;
        void *val;
        while (weft__ps_map_next(&t->stripes[i].rows, &pos, &key, &val)) {
            fn(val, arg);
        }
    }
}

/* The direct index of a bounded sparse table without a capacity (ps_stable_t.direct): one pointer
 * per id of the bound, mapped lazily (the pages an id touches are made, zeroed, when it is). It
 * replaces the stripes' maps of rows: a lookup is one load, and ids numbered by frequency share
 * its lines. */
static weft_status_t direct_new(ps_stable_t *t)
{
    const weft_ps_table_spec_t *sp = &t->l.spec;
    if (sp->kind != WEFT_PS_SPARSE || sp->id_bound == 0 || sp->id_bound > PS_DIRECT_MAX_IDS ||
        sp->capacity > 0) {
        return WEFT_OK;
    }
    size_t bytes = (size_t)sp->id_bound * sizeof(ps_cell_t *);
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) {
        /* Address space refused (RLIMIT_AS, or strict overcommit, which charges it all now): the
         * maps serve instead. */
        return WEFT_OK;
    }
    t->direct = p;
    t->direct_bytes = bytes;
    return WEFT_OK;
}


static void direct_free(ps_stable_t *t)
{
    if (t->direct != NULL) {
        munmap(t->direct, t->direct_bytes);
        t->direct = NULL;
    }
}

static void row_free(ps_cell_t *c, void *arg)
{
    (void)arg;
    weft__ps_cell_free(c);
}

void weft__ps_stable_drop_rows(ps_stable_t *t)
{
    if (t->direct != NULL) {
        for (uint64_t id = 0; id < t->l.spec.id_bound; id++) {
            if (t->direct[id] != NULL) {
                weft__ps_cell_free(t->direct[id]);
                t->direct[id] = NULL;
            }
        }
        /* Gives the index's pages back (all NULL now); where that is refused (locked memory)
         * they stay, as written. */
        (void)madvise(t->direct, t->direct_bytes, MADV_DONTNEED);
    } else {
        weft__ps_rows_each(t, row_free, NULL);
    }
    for (int i = 0; i < PS_STRIPES; i++) {
        ps_stripe_t *s = &t->stripes[i];
        weft__ps_map_free(&s->rows);
        weft__ps_map_free(&s->admit);
    }
    if (t->l.spec.kind == WEFT_PS_SPARSE) {
        atomic_store(&t->n_rows, 0);
    }
}

static void stable_free(ps_stable_t *t)
{
    if (t == NULL) {
        return;
    }
    if (t->chunks != NULL) {
        for (uint32_t c = 0; c < t->l.n_chunks; c++) {
            weft__ps_cell_free(t->chunks[c]);
        }
        weft_free(t->chunks);
    }
    weft__ps_stable_drop_rows(t);
    direct_free(t);
    for (int i = 0; i < PS_STRIPES; i++) {
        pthread_mutex_destroy(&t->stripes[i].mu);
    }
    while (t->parked != NULL) {
        ps_park_t *p = t->parked;
        t->parked = p->next;
        weft_call_fail(p->call, WEFT_ERR_SHUTDOWN, "ps: the server on rank %d is closing",
                       t->srv->ps->rank);
        park_free(p);
    }
    weft_free(t->clock);
    weft_free(t->ann);
    weft_free(t->ann_ring);
    weft_free(t->recv);
    weft_free(t->dead);
    pthread_mutex_destroy(&t->mu);
    weft__ps_layout_free(&t->l);
    weft_free(t);
}

static weft_status_t spec_from_pb(const Weft__V1__PsTableSpec *pb, weft_ps_table_spec_t *s)
{
    weft_ps_table_spec_init(s, pb->name, (weft_ps_kind_t)pb->kind);
    s->dtype = (weft_dtype_t)pb->dtype;
    if (pb->n_shape > WEFT_MAX_DIMS) {
        return weft__set_error(WEFT_ERR_SHAPE, "ps: %zu dimensions", pb->n_shape);
    }
    s->ndim = (int)pb->n_shape;
    for (size_t i = 0; i < pb->n_shape; i++) {
        s->shape[i] = pb->shape[i];
    }
    s->dim = pb->dim;
    s->id_bound = pb->id_bound;
    s->admit_after = pb->admit_after;
    s->capacity = pb->capacity;
    s->init = (weft_ps_init_t)pb->init;
    s->init_a = pb->init_a;
    s->init_b = pb->init_b;
    s->seed = pb->seed;
    s->optimizer = (weft_ps_optimizer_t)pb->optimizer;
    double h[8] = {0};
    for (size_t i = 0; i < pb->n_hyper && i < 8; i++) {
        h[i] = pb->hyper[i];
    }
    switch (s->optimizer) {
    case WEFT_PS_SGD:
        s->sgd = (weft_optim_sgd_config_t){h[0], h[1], h[2], h[3], (int)h[4]};
        break;
    case WEFT_PS_ADAGRAD:
        s->adagrad = (weft_optim_adagrad_config_t){h[0], h[1], h[2], h[3], h[4]};
        break;
    case WEFT_PS_ADAM:
    case WEFT_PS_ADAMW:
        s->adam = (weft_optim_adam_config_t){h[0], h[1], h[2], h[3], h[4], (int)h[5]};
        break;
    default:
        break;
    }
    s->consistency = (weft_ps_consistency_t)pb->consistency;
    s->staleness = pb->staleness;
    s->chunk_bytes = pb->chunk_bytes;
    return WEFT_OK;
}

static weft_status_t stable_new(ps_server_t *srv, const Weft__V1__PsTableSpec *pb, uint32_t id,
                                ps_stable_t **t_p)
{
    weft_ps_t *ps = srv->ps;
    weft_ps_table_spec_t spec;
    ps_stable_t *t = weft_calloc(1, sizeof(*t));
    weft_status_t st;
    if (t == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory for a table");
    }
    t->srv = srv;
    t->me = (uint32_t)ps->server_index;
    pthread_mutex_init(&t->mu, NULL);
    for (int i = 0; i < PS_STRIPES; i++) {
        pthread_mutex_init(&t->stripes[i].mu, NULL);
    }
    st = spec_from_pb(pb, &spec);
    if (st == WEFT_OK) {
        st = weft__ps_layout_init(&t->l, &spec, id, ps->n_servers, ps->n_workers);
    }
    if (st == WEFT_OK) {
        st = direct_new(t);
    }
    if (st != WEFT_OK) {
        goto err_free;
    }
    uint32_t nw = ps->n_workers;
    t->clock = weft_calloc(nw, sizeof(*t->clock));
    t->ann = weft_calloc(nw, sizeof(*t->ann));
    t->ann_ring = weft_calloc(nw, sizeof(*t->ann_ring));
    t->recv = weft_calloc(nw, sizeof(*t->recv));
    t->dead = weft_calloc(nw, sizeof(*t->dead));
    if (t->clock == NULL || t->ann == NULL || t->ann_ring == NULL || t->recv == NULL ||
        t->dead == NULL) {
        st = weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory for a table");
        goto err_free;
    }
    if (spec.kind == WEFT_PS_DENSE) {
        t->chunks = weft_calloc(t->l.n_chunks, sizeof(*t->chunks));
        if (t->chunks == NULL) {
            st = weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory for a table");
            goto err_free;
        }
        for (uint32_t c = 0; c < t->l.n_chunks; c++) {
            if (t->l.owner[c] == t->me) {
                int64_t len = weft__ps_chunk_len(&t->l, c);
                st = weft__ps_cell_new(&t->l, c, len, &t->chunks[c]);
                if (st != WEFT_OK) {
                    goto err_free;
                }
                atomic_fetch_add(&t->n_rows, (uint64_t)len);
            }
        }
    }
    *t_p = t;
    return WEFT_OK;

err_free:
    stable_free(t);
    return st;
}

/* ------------------------------------------------------------------ the server */

weft_status_t weft__ps_server_new(weft_ps_t *ps, ps_server_t **srv_p)
{
    ps_server_t *srv = weft_calloc(1, sizeof(*srv));
    if (srv == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory for a server");
    }
    srv->ps = ps;
    pthread_mutex_init(&srv->mu, NULL);
    pthread_cond_init(&srv->finish_cv, NULL);
    srv->finished = weft_calloc(ps->n_workers, sizeof(*srv->finished));
    srv->dedup_next = weft_alloc(ps->n_workers * sizeof(*srv->dedup_next));
    srv->dedup_seen = weft_calloc(ps->n_workers, sizeof(*srv->dedup_seen));
    if (srv->dedup_next == NULL || srv->dedup_seen == NULL || srv->finished == NULL) {
        weft__ps_server_free(srv);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory for a server");
    }
    for (uint32_t w = 0; w < ps->n_workers; w++) {
        srv->dedup_next[w] = 1;
    }
    *srv_p = srv;
    return WEFT_OK;
}

static void create_clear(ps_server_t *srv, ps_pending_create_t *pc)
{
    if (pc->specs != NULL) {
        for (int r = 0; r < srv->ps->world; r++) {
            if (pc->specs[r] != NULL) {
                weft__v1__ps_table_spec__free_unpacked(pc->specs[r], &weft__pb_allocator);
            }
        }
    }
    weft_free(pc->specs);
    weft_free(pc->calls);
    memset(pc, 0, sizeof(*pc));
}

void weft__ps_server_free(ps_server_t *srv)
{
    if (srv == NULL) {
        return;
    }
    for (uint32_t i = 0; i < PS_MAX_TABLES; i++) {
        ps_pending_create_t *pc = &srv->creates[i];
        if (pc->calls != NULL) {
            for (int r = 0; r < srv->ps->world; r++) {
                if (pc->calls[r] != NULL) {
                    weft_call_fail(pc->calls[r], WEFT_ERR_SHUTDOWN,
                                   "ps: the server on rank %d is closing", srv->ps->rank);
                }
            }
        }
        create_clear(srv, pc);
    }
    weft__ps_server_checkpoint_free(srv);
    for (uint32_t i = 0; i < srv->n_tables; i++) {
        stable_free(srv->tables[i]);
    }
    weft_free(srv->dedup_next);
    weft_free(srv->dedup_seen);
    weft_free(srv->finished);
    pthread_cond_destroy(&srv->finish_cv);
    pthread_mutex_destroy(&srv->mu);
    weft_free(srv);
}

static bool participant(const weft_ps_t *ps, int rank)
{
    for (uint32_t i = 0; i < ps->n_servers; i++) {
        if (ps->servers[i] == rank) {
            return true;
        }
    }
    for (uint32_t i = 0; i < ps->n_workers; i++) {
        if (ps->workers[i] == rank) {
            return true;
        }
    }
    return false;
}

static int n_participants(const weft_ps_t *ps)
{
    int n = 0;
    for (int r = 0; r < ps->world; r++) {
        n += participant(ps, r) ? 1 : 0;
    }
    return n;
}

/* CREATE: parked until every participant has sent its spec; then one verdict for all. */
static void handle_create(ps_server_t *srv, weft_call_t *call, Weft__V1__PsRequest *req)
{
    weft_ps_t *ps = srv->ps;
    int caller = weft_call_caller_rank(call);
    uint32_t id = req->table;
    done_t *done = NULL;

    if (req->spec == NULL || req->spec->name == NULL || !participant(ps, caller) ||
        id >= PS_MAX_TABLES) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG,
                       "ps: a table creation from rank %d without a spec, from a rank that is "
                       "neither server nor worker, or past %d tables",
                       caller, PS_MAX_TABLES);
        weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
        return;
    }
    pthread_mutex_lock(&srv->mu);
    ps_pending_create_t *pc = &srv->creates[id];
    if (id < srv->n_tables) {
        pthread_mutex_unlock(&srv->mu);
        weft_call_fail(call, WEFT_ERR_ALREADY_EXISTS, "ps: table %u ('%s') exists on rank %d", id,
                       srv->tables[id]->l.name, ps->rank);
        weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
        return;
    }
    if (pc->specs == NULL) {
        pc->specs = weft_calloc((size_t)ps->world, sizeof(*pc->specs));
        pc->calls = weft_calloc((size_t)ps->world, sizeof(*pc->calls));
        if (pc->specs == NULL || pc->calls == NULL) {
            create_clear(srv, pc);
            pthread_mutex_unlock(&srv->mu);
            weft_call_fail(call, WEFT_ERR_NO_MEMORY, "ps: no memory");
            weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
            return;
        }
    }
    if (pc->specs[caller] != NULL) {
        pthread_mutex_unlock(&srv->mu);
        weft_call_fail(call, WEFT_ERR_ALREADY_EXISTS, "ps: rank %d asked twice for table %u",
                       caller, id);
        weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
        return;
    }
    pc->specs[caller] = req->spec;
    req->spec = NULL;
    weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
    pc->calls[caller] = call;
    pc->arrived++;
    if (pc->arrived < n_participants(ps)) {
        pthread_mutex_unlock(&srv->mu);
        return;
    }
    /* Everyone is here: compare every spec with the lowest rank's. */
    char why[512] = "", field_why[256];
    weft_status_t st = WEFT_OK;
    int first = -1;
    for (int r = 0; r < ps->world && st == WEFT_OK; r++) {
        if (pc->specs[r] == NULL) {
            continue;
        }
        if (first < 0) {
            first = r;
            continue;
        }
        const char *f =
            weft__ps_spec_diff(pc->specs[first], pc->specs[r], field_why, sizeof(field_why));
        if (f != NULL) {
            st = WEFT_ERR_MISMATCH;
            snprintf(why, sizeof(why), "ps: table %u ('%s'): rank %d and rank %d differ in %s (%s)",
                     id, pc->specs[first]->name, first, r, f, field_why);
        }
    }
    ps_stable_t *t = NULL;
    if (st == WEFT_OK && id != srv->n_tables) {
        st = WEFT_ERR_INVALID_STATE;
        snprintf(why, sizeof(why), "ps: table %u ('%s') created before table %u on rank %d", id,
                 pc->specs[first]->name, srv->n_tables, ps->rank);
    }
    if (st == WEFT_OK) {
        st = stable_new(srv, pc->specs[first], id, &t);
        if (st != WEFT_OK) {
            snprintf(why, sizeof(why), "%s", weft_last_error());
        }
    }
    if (st == WEFT_OK) {
        srv->tables[id] = t;
        srv->n_tables = id + 1;
    }
    for (int r = 0; r < ps->world; r++) {
        if (pc->calls[r] != NULL) {
            done_add(&done, pc->calls[r], st == WEFT_OK ? reply_empty() : NULL, st, why);
        }
    }
    create_clear(srv, pc);
    pthread_mutex_unlock(&srv->mu);
    done_run(done);
}

/* ------------------------------------------------------------------ exactly once */

typedef enum { SEQ_NEW, SEQ_DUP, SEQ_BAD } seq_t;

static seq_t seq_check(ps_server_t *srv, int w, uint64_t seq)
{
    seq_t r = SEQ_NEW;
    pthread_mutex_lock(&srv->mu);
    uint64_t next = srv->dedup_next[w];
    uint64_t *seen = srv->dedup_seen[w];
    if (seq == 0 || seq >= next + PS_DEDUP_WINDOW) {
        r = SEQ_BAD;
    } else if (seq < next) {
        r = SEQ_DUP;
    } else {
        uint64_t off = seq - next;
        if (seen[off / 64] & (UINT64_C(1) << (off % 64))) {
            r = SEQ_DUP;
        } else {
            seen[off / 64] |= UINT64_C(1) << (off % 64);
            /* Slide past the prefix now complete. */
            while (seen[0] & 1) {
                for (size_t i = 0; i < PS_DEDUP_WINDOW / 64; i++) {
                    seen[i] =
                        (seen[i] >> 1) | (i + 1 < PS_DEDUP_WINDOW / 64 ? seen[i + 1] << 63 : 0);
                }
                srv->dedup_next[w]++;
            }
        }
    }
    pthread_mutex_unlock(&srv->mu);
    return r;
}

/* ------------------------------------------------------------------ rows */

/* Evicts the least recently used of a sample of up to 16 rows of @p s (held), not @p keep and not
 * one in a SYNC step's sums (Redis's approximated LRU). False when @p s has no such row. */
static bool evict_one(ps_stable_t *t, ps_stripe_t *s, uint64_t keep)
{
    if (s->rows.n == 0) {
        return false;
    }
    uint64_t best_key = 0, best_touch = UINT64_MAX;
    size_t start = (size_t)(atomic_load(&t->tick) * UINT64_C(0x9E3779B97F4A7C15) >> 40);
    size_t seen = 0;
    for (size_t k = 0; k < s->rows.cap && seen < 16; k++) {
        size_t i = (start + k) & (s->rows.cap - 1);
        ps_cell_t *c = s->rows.slots[i].val;
        if (c == NULL || c->id == keep || c->acc_on) {
            continue;
        }
        seen++;
        if (c->touch < best_touch) {
            best_touch = c->touch;
            best_key = c->id;
        }
    }
    if (best_touch == UINT64_MAX) {
        return false;
    }
    weft__ps_cell_free(weft__ps_row_del(t, s, best_key));
    atomic_fetch_sub(&t->n_rows, 1);
    atomic_fetch_add(&t->evicted, 1);
    return true;
}

/* Makes room for one row of stripe @p s (held) in a table at its capacity: a row of @p s if it
 * has one to give, else of the next stripe that has one and is free now (trylock: waiting here
 * could deadlock with a thread holding the stripes of each_row's look-ahead, or with this one's own
 * look-ahead, whose stripes it skips too). Only while every other stripe is busy
 * does the table go past its capacity, by the rows made meanwhile (the next rows made evict them).
 * False when no row could be evicted. */
static bool make_room(ps_stable_t *t, ps_stripe_t *s, uint64_t keep)
{
    if (evict_one(t, s, keep)) {
        return true;
    }
    size_t b = (size_t)(s - t->stripes);
    for (size_t k = 1; k < PS_STRIPES; k++) {
        ps_stripe_t *o = &t->stripes[(b + k) % PS_STRIPES];
        if (pthread_mutex_trylock(&o->mu) != 0) {
            continue;
        }
        bool done = evict_one(t, o, keep);
        pthread_mutex_unlock(&o->mu);
        if (done) {
            return true;
        }
    }
    return false;
}

/* The row @p id of stripe @p s (held): made when missing if @p make (counting a push toward
 * admission when @p push). NULL with *st_p OK: not admitted yet. */
static ps_cell_t *row_get(ps_stable_t *t, ps_stripe_t *s, uint64_t id, bool make, bool push,
                          ps_cell_t *known, weft_status_t *st_p)
{
    *st_p = WEFT_OK;
    ps_cell_t *c = known != NULL ? known : weft__ps_row_find(t, s, id);
    /* The last use, for eviction only: without a capacity no row is evicted, and the shared
     * counter would be one more contended line per row between the threads serving workers. */
    bool lru = t->l.spec.capacity > 0;
    if (c != NULL || !make) {
        if (c != NULL && lru) {
            c->touch = atomic_fetch_add(&t->tick, 1);
        }
        return c;
    }
    uint64_t k = t->l.spec.admit_after;
    if (k > 1) {
        if (!push) {
            return NULL;
        }
        uintptr_t seen = (uintptr_t)weft__ps_map_get(&s->admit, id) + 1;
        if (seen < k) {
            *st_p = weft__ps_map_put(&s->admit, id, (void *)seen);
            return NULL;
        }
        weft__ps_map_del(&s->admit, id);
    }
    /* Down to one below the capacity: rows made past it meanwhile by another thread, or loaded
     * from a checkpoint of more servers, go at the next rows made. */
    while (t->l.spec.capacity > 0 && atomic_load(&t->n_rows) >= t->l.spec.capacity &&
           make_room(t, s, id)) {
    }
    *st_p = weft__ps_cell_new(&t->l, id, t->l.spec.dim, &c);
    if (*st_p != WEFT_OK) {
        return NULL;
    }
    *st_p = weft__ps_row_put(t, s, id, c);
    if (*st_p != WEFT_OK) {
        weft__ps_cell_free(c);
        return NULL;
    }
    atomic_fetch_add(&t->n_rows, 1);
    if (lru) {
        c->touch = atomic_fetch_add(&t->tick, 1);
    }
    return c;
}

/* ------------------------------------------------------------------ checks of a request */

/* The worker index of a push or pull, checked against the caller. */
static weft_status_t check_worker(ps_stable_t *t, weft_call_t *call, const Weft__V1__PsRequest *r,
                                  char *why, size_t n)
{
    weft_ps_t *ps = t->srv->ps;
    int caller = weft_call_caller_rank(call);
    if (r->worker < 0 || (uint32_t)r->worker >= ps->n_workers || ps->workers[r->worker] != caller) {
        snprintf(why, n, "ps: table '%s': rank %d is not worker %d", t->l.name, caller, r->worker);
        return WEFT_ERR_INVALID_ARG;
    }
    return WEFT_OK;
}

/* Checks a request's body against the table; nothing is applied unless all of it is good. */
static weft_status_t check_body(ps_stable_t *t, const Weft__V1__PsRequest *r,
                                const weft_value_t *args, bool push, char *why, size_t n)
{
    const ps_layout_t *l = &t->l;
    size_t nt = weft_value_num_tensors(args);
    if (l->spec.kind == WEFT_PS_DENSE) {
        if (r->n_chunks == 0) {
            snprintf(why, n, "ps: table '%s': a request without chunks", l->name);
            return WEFT_ERR_INVALID_ARG;
        }
        if (push && nt != r->n_chunks) {
            snprintf(why, n, "ps: table '%s': %zu chunks named, %zu tensors", l->name, r->n_chunks,
                     nt);
            return WEFT_ERR_INVALID_ARG;
        }
        for (size_t i = 0; i < r->n_chunks; i++) {
            uint32_t c = r->chunks[i];
            if (c >= l->n_chunks || l->owner[c] != t->me) {
                snprintf(why, n, "ps: table '%s': chunk %u is not held by server %u", l->name, c,
                         t->me);
                return WEFT_ERR_INVALID_ARG;
            }
            for (size_t j = 0; j < i; j++) {
                if (r->chunks[j] == c) {
                    snprintf(why, n, "ps: table '%s': chunk %u named twice", l->name, c);
                    return WEFT_ERR_INVALID_ARG;
                }
            }
            if (push) {
                weft_tensor_t *g = weft_value_tensor(args, i);
                if (weft_tensor_dtype(g) != WEFT_F32) {
                    snprintf(why, n, "ps: table '%s': chunk %u's gradient is %s, not f32", l->name,
                             c, weft_dtype_name(weft_tensor_dtype(g)));
                    return WEFT_ERR_DTYPE;
                }
                if (weft_tensor_numel(g) != weft__ps_chunk_len(l, c)) {
                    snprintf(why, n, "ps: table '%s': chunk %u has %lld elements, %lld sent",
                             l->name, c, (long long)weft__ps_chunk_len(l, c),
                             (long long)weft_tensor_numel(g));
                    return WEFT_ERR_SHAPE;
                }
            }
        }
        return WEFT_OK;
    }
    if (nt != (push ? 2u : 1u)) {
        snprintf(why, n, "ps: table '%s': %zu tensors in a sparse %s", l->name, nt,
                 push ? "push" : "pull");
        return WEFT_ERR_INVALID_ARG;
    }
    weft_tensor_t *ids = weft_value_tensor(args, 0);
    if (weft_tensor_dtype(ids) != WEFT_I64 || weft_tensor_ndim(ids) != 1) {
        snprintf(why, n, "ps: table '%s': ids must be i64 [n]", l->name);
        return WEFT_ERR_DTYPE;
    }
    int64_t k = weft_tensor_numel(ids);
    const uint64_t *id = weft_tensor_data(ids);
    for (int64_t i = 0; i < k; i++) {
        if (l->spec.id_bound != 0 && id[i] >= l->spec.id_bound) {
            snprintf(why, n, "ps: table '%s': id %llu is out of [0, %llu)", l->name,
                     (unsigned long long)id[i], (unsigned long long)l->spec.id_bound);
            return WEFT_ERR_INVALID_ARG;
        }
        if (weft__ps_id_server(id[i], l->n_servers) != t->me) {
            snprintf(why, n, "ps: table '%s': id %llu is not held by server %u", l->name,
                     (unsigned long long)id[i], t->me);
            return WEFT_ERR_INVALID_ARG;
        }
    }
    if (push) {
        weft_tensor_t *rows = weft_value_tensor(args, 1);
        const int64_t *sh = weft_tensor_shape(rows);
        if (weft_tensor_dtype(rows) != WEFT_F32) {
            snprintf(why, n, "ps: table '%s': rows are %s, not f32", l->name,
                     weft_dtype_name(weft_tensor_dtype(rows)));
            return WEFT_ERR_DTYPE;
        }
        if (weft_tensor_ndim(rows) != 2 || sh[0] != k || sh[1] != l->spec.dim) {
            snprintf(why, n, "ps: table '%s': rows must be [%lld, %lld]", l->name, (long long)k,
                     (long long)l->spec.dim);
            return WEFT_ERR_SHAPE;
        }
    }
    return WEFT_OK;
}

/* ------------------------------------------------------------------ rows of a request */

typedef weft_status_t (*row_fn_t)(ps_stable_t *t, ps_stripe_t *s, uint64_t id, ps_cell_t *known,
                                  int64_t i, void *arg);

static weft_status_t row_read(ps_stable_t *t, ps_stripe_t *s, uint64_t id, ps_cell_t *known,
                             int64_t i, void *arg);

#define PF_SLOT 16
#define PF_ROW  6
#define PF_AHEAD 8 /* > PF_ROW: the rows found ahead, by position */

/* Runs @p fn on each of @p k ids, grouped by lock stripe (positions sorted stably by stripe): one
 * lock per stripe and request, not one per row. Stops at the first error.
 *
 * The rows are asked for ahead across stripes, so the pipeline of prefetches does not restart at
 * each stripe (a request's ~1000 ids on a server make ~16 per stripe): a stripe is taken when the
 * first of its ids is looked up ahead and let go once its last id is served. So a thread holds the
 * stripes its PF_SLOT ids ahead span, always taken in increasing order; every other taker of
 * several stripes takes them in that order too (the checkpoint's writer) or only tries
 * (eviction), so no two threads wait for each other. */
static weft_status_t each_row(ps_stable_t *t, const uint64_t *id, int64_t k, row_fn_t fn, void *arg)
{
    /* What @p fn touches of a row, as far as it is worth asking for ahead: the header's first
     * line, then a read the value, an apply or a gather the state too (a row is one block:
     * header, value, state, the header on a line of its own). */
    size_t data_bytes = fn == row_read
                            ? weft_dtype_size(t->l.spec.dtype) * (size_t)t->l.spec.dim
                            : weft__ps_cell_bytes(&t->l, t->l.spec.dim);
    size_t row_end = PS_CELL_HEAD + (data_bytes < 1024 ? data_bytes : 1024);
    bool reads = fn == row_read; /* a row found ahead is read without its header (row_read) */
    uint32_t start[PS_STRIPES + 1] = {0}, stack[4096];
    uint8_t stripe_stack[4096];
    ps_cell_t *ahead[PF_AHEAD] = {0};
    bool evicts = t->l.spec.capacity > 0;
    uint32_t *order = k <= 4096 ? stack : weft_alloc((size_t)k * sizeof(*order));
    uint8_t *sb = k <= 4096 ? stripe_stack : weft_alloc((size_t)k);
    weft_status_t st = WEFT_OK;
    if (order == NULL || sb == NULL) {
        if (order != stack) {
            weft_free(order);
            weft_free(sb);
        }
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory for %lld ids", (long long)k);
    }
    for (int64_t i = 0; i < k; i++) {
        start[weft__ps_id_stripe(id[i]) + 1]++;
    }
    for (int b = 0; b < PS_STRIPES; b++) {
        start[b + 1] += start[b];
    }
    uint32_t fill[PS_STRIPES];
    memcpy(fill, start, sizeof(fill));
    for (int64_t i = 0; i < k; i++) {
        uint32_t b = weft__ps_id_stripe(id[i]);
        sb[fill[b]] = (uint8_t)b;
        order[fill[b]++] = (uint32_t)i;
    }
    uint32_t n = (uint32_t)k;
    int taken = 0; /* stripes below this were taken (those with ids) */
    int held = 0;  /* ... and those below this let go again */
    for (uint32_t j = 0; j < n && j < PF_SLOT; j++) {
        for (; taken <= sb[j]; taken++) {
            if (start[taken] != start[taken + 1]) {
                pthread_mutex_lock(&t->stripes[taken].mu);
            }
        }
        weft__ps_row_prefetch(t, &t->stripes[sb[j]], id[order[j]]);
    }
    for (uint32_t j = 0; j < n && st == WEFT_OK; j++) {
        if (j + PF_SLOT < n) {
            uint32_t a = j + PF_SLOT;
            for (; taken <= sb[a]; taken++) {
                if (start[taken] != start[taken + 1]) {
                    pthread_mutex_lock(&t->stripes[taken].mu);
                }
            }
            weft__ps_row_prefetch(t, &t->stripes[sb[a]], id[order[a]]);
        }
        if (j + PF_ROW < n) {
            uint32_t a = j + PF_ROW;
            ps_cell_t *c = weft__ps_row_find(t, &t->stripes[sb[a]], id[order[a]]);
            if (c != NULL && !reads) {
                __builtin_prefetch(c, 1);
            }
            for (size_t off = PS_CELL_HEAD; c != NULL && off < row_end; off += 64) {
                if (reads) {
                    __builtin_prefetch((const char *)c + off, 0);
                } else {
                    __builtin_prefetch((const char *)c + off, 1);
                }
            }
            ahead[a % PF_AHEAD] = c;
        }
        for (; held < sb[j]; held++) {
            if (start[held] != start[held + 1]) {
                pthread_mutex_unlock(&t->stripes[held].mu);
            }
        }
        /* The row found when it was asked for ahead, unless rows may have gone since (eviction)
         * or it was not there then (fn makes it). */
        ps_cell_t *known = j >= PF_ROW && !evicts ? ahead[j % PF_AHEAD] : NULL;
        st = fn(t, &t->stripes[sb[j]], id[order[j]], known, order[j], arg);
    }
    for (; held < taken; held++) {
        if (start[held] != start[held + 1]) {
            pthread_mutex_unlock(&t->stripes[held].mu);
        }
    }
    if (order != stack) {
        weft_free(order);
        weft_free(sb);
    }
    return st;
}

static weft_status_t row_apply(ps_stable_t *t, ps_stripe_t *s, uint64_t id, ps_cell_t *known,
                               int64_t i, void *arg)
{
    weft_status_t st;
    ps_cell_t *c = row_get(t, s, id, true, true, known, &st);
    return c == NULL ? st
                     : weft__ps_cell_apply(&t->l, c, (const float *)arg + i * t->l.spec.dim, 1.0f);
}

static weft_status_t acc_add(ps_stable_t *t, ps_cell_t *c, const float *g, int64_t n);

static weft_status_t row_gather(ps_stable_t *t, ps_stripe_t *s, uint64_t id, ps_cell_t *known,
                                int64_t i, void *arg)
{
    weft_status_t st;
    ps_cell_t *c = row_get(t, s, id, true, true, known, &st);
    return c == NULL ? st : acc_add(t, c, (const float *)arg + i * t->l.spec.dim, t->l.spec.dim);
}

static weft_status_t row_read(ps_stable_t *t, ps_stripe_t *s, uint64_t id, ps_cell_t *known,
                             int64_t i, void *arg)
{
    weft_status_t st;
    float *o = (float *)arg + i * t->l.spec.dim;
    if (known != NULL && t->l.spec.dtype == WEFT_F32) {
        /* A row found ahead (no capacity: nothing to touch): its f32 value lies right after its
         * header in its block (weft__ps_cell_new), so the header's line is not read at all. */
        memcpy(o, (const char *)known + PS_CELL_HEAD, (size_t)t->l.spec.dim * sizeof(float));
        return WEFT_OK;
    }
    ps_cell_t *c = row_get(t, s, id, true, false, known, &st);
    if (c != NULL) {
        weft__ps_cell_read(c, o);
    } else if (st == WEFT_OK) {
        weft__ps_init_values(&t->l, id, t->l.spec.dim, o); /* not admitted: nothing stored */
    }
    return st;
}

/* ------------------------------------------------------------------ applying pushes */

static weft_status_t acc_add(ps_stable_t *t, ps_cell_t *c, const float *g, int64_t n)
{
    if (!c->acc_on) {
        /* The step's first gradient is copied in (a dense chunk keeps its buffer from step to
         * step: nothing allocated or zeroed per step). */
        if (c->acc == NULL && (c->acc = weft_alloc((size_t)n * sizeof(float))) == NULL) {
            return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory for a step's gradient");
        }
        memcpy(c->acc, g, (size_t)n * sizeof(float));
        c->acc_on = true;
        c->next_acc = t->acc_list;
        t->acc_list = c;
        return WEFT_OK;
    }
    weft_reduce_into(c->acc, g, (size_t)n, WEFT_F32, WEFT_SUM);
    return WEFT_OK;
}

/* Takes a push, cell by cell under the stripes' locks: ASYNC/BOUNDED apply it now; SYNC
 * (@p gather, t->mu held) adds it to the step's sums. */
static weft_status_t take_push(ps_stable_t *t, const Weft__V1__PsRequest *r,
                               const weft_value_t *args, bool gather)
{
    const ps_layout_t *l = &t->l;
    weft_status_t st = WEFT_OK;
    if (l->spec.kind == WEFT_PS_DENSE) {
        for (size_t i = 0; i < r->n_chunks && st == WEFT_OK; i++) {
            uint32_t c = r->chunks[i];
            const float *g = weft_tensor_data(weft_value_tensor(args, i));
            ps_stripe_t *s = &t->stripes[c % PS_STRIPES];
            pthread_mutex_lock(&s->mu);
            st = gather ? acc_add(t, t->chunks[c], g, weft__ps_chunk_len(l, c))
                        : weft__ps_cell_apply(l, t->chunks[c], g, 1.0f);
            pthread_mutex_unlock(&s->mu);
        }
        return st;
    }
    weft_tensor_t *ids = weft_value_tensor(args, 0);
    const float *g = weft_tensor_data(weft_value_tensor(args, 1));
    return each_row(t, weft_tensor_data(ids), weft_tensor_numel(ids),
                    gather ? row_gather : row_apply, (void *)g);
}

static uint64_t tensor_bytes(const weft_value_t *v)
{
    uint64_t b = 0;
    for (size_t i = 0; i < weft_value_num_tensors(v); i++) {
        b += weft_tensor_nbytes(weft_value_tensor(v, i));
    }
    return b;
}

/* ------------------------------------------------------------------ consistency (t->mu held) */

static int64_t min_clock(const ps_stable_t *t)
{
    int64_t m = INT64_MAX;
    for (uint32_t w = 0; w < t->l.n_workers; w++) {
        if (!t->dead[w] && t->clock[w] < m) {
            m = t->clock[w];
        }
    }
    return m == INT64_MAX ? 0 : m;
}

/* Whether a pull (or the pull of a push_pull) may be answered now. */
static bool pull_ready(const ps_stable_t *t, const Weft__V1__PsRequest *r)
{
    if (t->recv[r->worker] < r->pushes) {
        return false; /* its own pushes first */
    }
    switch (t->l.spec.consistency) {
    case WEFT_PS_SYNC:
        return t->cur_step >= r->clock + (r->op == WEFT__V1__PS_OP__PS_PUSH_PULL ? 1 : 0);
    case WEFT_PS_BOUNDED:
        for (uint32_t w = 0; w < t->l.n_workers; w++) {
            if (t->dead[w]) {
                continue;
            }
            if (t->clock[w] < r->clock - t->l.spec.staleness || t->recv[w] < t->ann[w]) {
                return false;
            }
        }
        return true;
    default:
        return true;
    }
}

/* The answer to a pull: values of the chunks or rows asked for (t->mu held). */
static weft_status_t pull_reply(ps_stable_t *t, const Weft__V1__PsRequest *r,
                                const weft_value_t *args, weft_value_t **reply_p)
{
    const ps_layout_t *l = &t->l;
    Weft__V1__PsReply rep = WEFT__V1__PS_REPLY__INIT;
    weft_value_t *body = NULL;
    weft_status_t st = weft_value_create(&body);
    if (st != WEFT_OK) {
        return st;
    }
    int64_t stale = r->clock - min_clock(t);
    if (stale < 0) {
        stale = 0;
    }
    rep.staleness = stale;
    atomic_fetch_add(
        &t->hist[stale < WEFT_PS_STALENESS_BUCKETS - 1 ? stale : WEFT_PS_STALENESS_BUCKETS - 1], 1);
    if (l->spec.kind == WEFT_PS_DENSE) {
        for (size_t i = 0; i < r->n_chunks && st == WEFT_OK; i++) {
            uint32_t c = r->chunks[i];
            int64_t len = weft__ps_chunk_len(l, c);
            ps_stripe_t *s = &t->stripes[c % PS_STRIPES];
            if (l->spec.dtype == WEFT_F32) {
                /* The value itself, sent without a copy: a push that comes meanwhile writes a
                 * copy of its own (copy on write, weft__ps_cell_own). */
                pthread_mutex_lock(&s->mu);
                st = weft_value_add_tensor(body, t->chunks[c]->value);
                pthread_mutex_unlock(&s->mu);
                continue;
            }
            weft_tensor_t *out = NULL;
            st = weft_tensor_empty(WEFT_F32, 1, &len, &out);
            if (st == WEFT_OK) {
                pthread_mutex_lock(&s->mu);
                weft__ps_cell_read(t->chunks[c], weft_tensor_data(out));
                pthread_mutex_unlock(&s->mu);
                st = weft_value_push_tensor(body, out);
                if (st != WEFT_OK) {
                    weft_tensor_release(out);
                }
            }
        }
    } else {
        weft_tensor_t *ids = weft_value_tensor(args, 0);
        const uint64_t *id = weft_tensor_data(ids);
        int64_t shape[2] = {weft_tensor_numel(ids), l->spec.dim};
        weft_tensor_t *out = NULL;
        st = weft_tensor_empty(WEFT_F32, 2, shape, &out);
        if (st == WEFT_OK) {
            st = each_row(t, id, shape[0], row_read, weft_tensor_data(out));
        }
        if (st == WEFT_OK) {
            st = weft_value_push_tensor(body, out);
        }
        if (st != WEFT_OK) {
            weft_tensor_release(out);
        }
    }
    if (st == WEFT_OK) {
        atomic_fetch_add(&t->bytes_out, tensor_bytes(body));
        atomic_fetch_add(&t->pulls, 1);
        *reply_p = reply_pack(&rep, body);
        if (*reply_p == NULL) {
            st = weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory for a reply");
        }
    }
    weft_value_free(body);
    return st;
}

static void park_expire(void *arg, uint64_t id);

static void park_add(ps_stable_t *t, weft_call_t *call, Weft__V1__PsRequest *req,
                     weft_value_t *args, bool push)
{
    ps_park_t *p = weft_calloc(1, sizeof(*p));
    if (p == NULL) {
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "ps: no memory to wait");
        weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
        weft_value_free(args);
        return;
    }
    p->id = atomic_fetch_add(&t->srv->park_ids, 1) + 1;
    p->call = call;
    p->req = req;
    p->args = args;
    p->push = push;
    p->next = t->parked;
    t->parked = p;
    int64_t left_ms = weft_call_time_left_ms(call);
    /* The caller gives up at its deadline; the server lets go of the call just after it. */
    /* Its timer finds the entry gone when it was answered before. */
    weft_agent_timer_add(t->srv->ps->agent, (left_ms > 0 ? left_ms : 0) * 1000 + 100000,
                         park_expire, NULL, t, p->id, t->srv->ps);
}

static void park_expire(void *arg, uint64_t id)
{
    ps_stable_t *t = arg;
    ps_park_t *p = NULL;
    pthread_mutex_lock(&t->mu);
    for (ps_park_t **pp = &t->parked; *pp != NULL; pp = &(*pp)->next) {
        if ((*pp)->id == id) {
            p = *pp;
            *pp = p->next;
            break;
        }
    }
    int64_t slow = min_clock(t), step = t->cur_step;
    pthread_mutex_unlock(&t->mu);
    if (p != NULL) {
        weft_call_fail(p->call, WEFT_ERR_TIMEOUT,
                       "ps: table '%s': a %s at clock %lld waited past its deadline (slowest "
                       "worker at clock %lld, step %lld gathered)",
                       t->l.name, p->push ? "push" : "pull", (long long)p->req->clock,
                       (long long)slow, (long long)step);
        park_free(p);
    }
}

/* SYNC: applies every complete step; later steps' parked pushes are gathered as theirs come. */
static void sync_advance(ps_stable_t *t, done_t **done)
{
    for (;;) {
        int64_t k = t->cur_step;
        for (uint32_t w = 0; w < t->l.n_workers; w++) {
            if (t->clock[w] < k + 1 || t->recv[w] < t->ann_ring[w][k % PS_SYNC_AHEAD]) {
                return;
            }
        }
        float scale = t->l.spec.optimizer == WEFT_PS_SUM ? 1.0f : 1.0f / (float)t->l.n_workers;
        weft_status_t st = WEFT_OK;
        while (t->acc_list != NULL) {
            ps_cell_t *c = t->acc_list;
            t->acc_list = c->next_acc;
            if (st == WEFT_OK) {
                if (scale != 1.0f) { /* the mean, in the step's own buffer */
                    weft__ps_scale(c->acc, c->acc, scale, c->n);
                }
                st = weft__ps_cell_apply(&t->l, c, c->acc, 1.0f);
            }
            if (!c->dense) {
                weft_free(c->acc); /* rows: most are not in the next step */
                c->acc = NULL;
            }
            c->acc_on = false;
            c->next_acc = NULL;
        }
        if (st != WEFT_OK) {
            t->failed = st;
            snprintf(t->failed_why, sizeof(t->failed_why), "ps: table '%s': step %lld: %s",
                     t->l.name, (long long)k, weft_last_error());
            WEFT_ERROR("%s", t->failed_why);
            return;
        }
        t->cur_step = k + 1;
        /* Pushes of the new step that came early. */
        for (ps_park_t **pp = &t->parked; *pp != NULL;) {
            ps_park_t *p = *pp;
            if (!p->push || p->req->clock != t->cur_step) {
                pp = &p->next;
                continue;
            }
            *pp = p->next;
            st = take_push(t, p->req, p->args, true);
            if (st == WEFT_OK) {
                t->recv[p->req->worker]++;
            }
            if (p->req->op == WEFT__V1__PS_OP__PS_PUSH_PULL && st == WEFT_OK) {
                p->push = false; /* now waits as a pull */
                p->next = t->parked;
                t->parked = p;
                continue;
            }
            done_add(done, p->call, st == WEFT_OK ? reply_empty() : NULL, st, weft_last_error());
            p->call = NULL;
            park_free(p);
        }
    }
}

/* Answers every parked pull that may be answered now. */
static void parked_run(ps_stable_t *t, done_t **done)
{
    for (ps_park_t **pp = &t->parked; *pp != NULL;) {
        ps_park_t *p = *pp;
        if (p->push || !pull_ready(t, p->req)) {
            pp = &p->next;
            continue;
        }
        *pp = p->next;
        weft_value_t *reply = NULL;
        weft_status_t st = pull_reply(t, p->req, p->args, &reply);
        done_add(done, p->call, reply, st, weft_last_error());
        park_free(p);
    }
}

static void fail_parked(ps_stable_t *t, done_t **done)
{
    while (t->parked != NULL) {
        ps_park_t *p = t->parked;
        t->parked = p->next;
        done_add(done, p->call, NULL, t->failed, t->failed_why);
        park_free(p);
    }
}

/* ------------------------------------------------------------------ push and pull */

static void handle_data(ps_server_t *srv, weft_call_t *call, Weft__V1__PsRequest *req)
{
    char why[512];
    weft_status_t st;
    ps_stable_t *t = NULL;
    done_t *done = NULL;
    bool push = req->op == WEFT__V1__PS_OP__PS_PUSH || req->op == WEFT__V1__PS_OP__PS_PUSH_PULL;
    bool pull = req->op == WEFT__V1__PS_OP__PS_PULL || req->op == WEFT__V1__PS_OP__PS_PUSH_PULL;
    weft_value_t *args = NULL;

    pthread_mutex_lock(&srv->mu);
    if (req->table < srv->n_tables) {
        t = srv->tables[req->table];
    }
    pthread_mutex_unlock(&srv->mu);
    if (t == NULL || strcmp(t->l.name, req->table_name) != 0) {
        st = WEFT_ERR_NOT_FOUND;
        snprintf(why, sizeof(why), "ps: no table '%s' (id %u) on server rank %d", req->table_name,
                 req->table, srv->ps->rank);
        goto fail;
    }
    if ((st = check_worker(t, call, req, why, sizeof(why))) != WEFT_OK) {
        goto fail;
    }
    /* The body of the message (after its header) holds the tensors. */
    st = weft_msg_body(weft_call_args(call), &args);
    if (st != WEFT_OK) {
        snprintf(why, sizeof(why), "ps: table '%s': %s", t->l.name, weft_last_error());
        goto fail;
    }
    if ((st = check_body(t, req, args, push, why, sizeof(why))) != WEFT_OK) {
        goto fail;
    }
    if (push) {
        seq_t sq = seq_check(srv, req->worker, req->seq);
        if (sq == SEQ_BAD) {
            st = WEFT_ERR_INVALID_ARG;
            snprintf(why, sizeof(why), "ps: table '%s': push sequence %llu out of the window",
                     t->l.name, (unsigned long long)req->seq);
            goto fail;
        }
        if (sq == SEQ_DUP) {
            atomic_fetch_add(&t->duplicates, 1);
            push = false;
            if (!pull) {
                weft_value_free(args);
                weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
                weft_call_reply(call, reply_empty());
                return;
            }
        }
    }
    if (push) {
        atomic_fetch_add(&t->bytes_in, tensor_bytes(args));
        atomic_fetch_add(&t->pushes, 1);
    }
    if (push && t->l.spec.consistency == WEFT_PS_BOUNDED) {
        /* A failed table (a BOUNDED one that lost a worker; an ASYNC one never fails) applies
         * nothing more: checked before the push is applied, which is done outside t->mu. */
        pthread_mutex_lock(&t->mu);
        st = t->failed;
        if (st != WEFT_OK) {
            snprintf(why, sizeof(why), "%s", t->failed_why);
        }
        pthread_mutex_unlock(&t->mu);
        if (st != WEFT_OK) {
            goto fail;
        }
    }
    if (push && t->l.spec.consistency != WEFT_PS_SYNC) {
        st = take_push(t, req, args, false);
        if (st != WEFT_OK) {
            snprintf(why, sizeof(why), "%s", weft_last_error());
            goto fail;
        }
    }
    pthread_mutex_lock(&t->mu);
    if (t->failed != WEFT_OK) {
        st = t->failed;
        snprintf(why, sizeof(why), "%s", t->failed_why);
        pthread_mutex_unlock(&t->mu);
        goto fail;
    }
    if (push && t->l.spec.consistency == WEFT_PS_SYNC) {
        if (req->clock > t->cur_step) {
            park_add(t, call, req, args, true); /* a later step's: gathered when it begins */
            pthread_mutex_unlock(&t->mu);
            return;
        }
        if (req->clock < t->cur_step) {
            pthread_mutex_unlock(&t->mu);
            st = WEFT_ERR_INVALID_STATE;
            snprintf(why, sizeof(why),
                     "ps: table '%s': a push of step %lld after the step was "
                     "applied (now %lld)",
                     t->l.name, (long long)req->clock, (long long)t->cur_step);
            goto fail;
        }
        st = take_push(t, req, args, true);
        if (st != WEFT_OK) {
            pthread_mutex_unlock(&t->mu);
            snprintf(why, sizeof(why), "%s", weft_last_error());
            goto fail;
        }
    }
    if (push) {
        t->recv[req->worker]++;
        if (t->l.spec.consistency == WEFT_PS_SYNC) {
            sync_advance(t, &done);
        }
    }
    if (pull && !pull_ready(t, req)) {
        park_add(t, call, req, args, false);
        req = NULL;
        args = NULL;
        call = NULL;
    } else if (pull) {
        weft_value_t *reply = NULL;
        st = pull_reply(t, req, args, &reply);
        done_add(&done, call, reply, st, weft_last_error());
        call = NULL;
    }
    parked_run(t, &done);
    pthread_mutex_unlock(&t->mu);
    done_run(done);
    if (call != NULL) {
        weft_call_reply(call, reply_empty());
    }
    weft_value_free(args);
    if (req != NULL) {
        weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
    }
    return;

fail:
    weft_value_free(args);
    weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
    weft_call_fail(call, st, "%s", why);
}

/* ------------------------------------------------------------------ clocks */

static void handle_clock(ps_server_t *srv, weft_call_t *call, Weft__V1__PsRequest *req)
{
    weft_ps_t *ps = srv->ps;
    int caller = weft_call_caller_rank(call);
    int w = req->worker;
    int64_t c = req->clock;
    char why[256] = "";
    weft_status_t st = WEFT_OK;
    done_t *done = NULL;

    if (w < 0 || (uint32_t)w >= ps->n_workers || ps->workers[w] != caller || c < 1) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "ps: rank %d is not worker %d, or clock %lld",
                       caller, w, (long long)c);
        weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
        return;
    }
    pthread_mutex_lock(&srv->mu);
    uint32_t n = srv->n_tables;
    pthread_mutex_unlock(&srv->mu);
    for (uint32_t i = 0; i < n && i < req->n_step_pushes && st == WEFT_OK; i++) {
        ps_stable_t *t = srv->tables[i];
        pthread_mutex_lock(&t->mu);
        if (t->failed != WEFT_OK) {
            st = t->failed;
            snprintf(why, sizeof(why), "%s", t->failed_why);
        } else if (c > t->clock[w]) {
            if (t->l.spec.consistency == WEFT_PS_SYNC) {
                if (c - 1 - t->cur_step >= PS_SYNC_AHEAD) {
                    st = WEFT_ERR_INVALID_STATE;
                    snprintf(why, sizeof(why),
                             "ps: table '%s': worker %d ended step %lld while "
                             "step %lld is gathered (at most %d ahead)",
                             t->l.name, w, (long long)(c - 1), (long long)t->cur_step,
                             PS_SYNC_AHEAD);
                } else {
                    /* Steps ended without a clock call each (a jump) announce the same total. */
                    for (int64_t k = t->clock[w]; k < c; k++) {
                        t->ann_ring[w][k % PS_SYNC_AHEAD] = req->step_pushes[i];
                    }
                }
            }
            if (st == WEFT_OK) {
                t->clock[w] = c;
                t->ann[w] = req->step_pushes[i];
                if (t->l.spec.consistency == WEFT_PS_SYNC) {
                    sync_advance(t, &done);
                }
                parked_run(t, &done);
            }
        }
        pthread_mutex_unlock(&t->mu);
    }
    done_run(done);
    weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
    if (st == WEFT_OK) {
        weft_call_reply(call, reply_empty());
    } else {
        weft_call_fail(call, st, "%s", why);
    }
}

/* ------------------------------------------------------------------ stats */

static void handle_stats(ps_server_t *srv, weft_call_t *call, Weft__V1__PsRequest *req)
{
    Weft__V1__PsReply r = WEFT__V1__PS_REPLY__INIT;
    pthread_mutex_lock(&srv->mu);
    uint32_t n = srv->n_tables;
    pthread_mutex_unlock(&srv->mu);
    uint64_t *buf = weft_calloc((size_t)n * (8 + WEFT_PS_STALENESS_BUCKETS) + 1, sizeof(uint64_t));
    if (buf == NULL) {
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "ps: no memory");
        weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
        return;
    }
    uint64_t *p = buf;
    r.bytes_in = p, p += n;
    r.bytes_out = p, p += n;
    r.rows = p, p += n;
    r.pushes = p, p += n;
    r.pulls = p, p += n;
    r.duplicates = p, p += n;
    r.evicted = p, p += n;
    r.staleness_hist = p;
    r.n_bytes_in = r.n_bytes_out = r.n_rows = r.n_pushes = r.n_pulls = r.n_duplicates =
        r.n_evicted = n;
    r.n_staleness_hist = (size_t)n * WEFT_PS_STALENESS_BUCKETS;
    for (uint32_t i = 0; i < n; i++) {
        ps_stable_t *t = srv->tables[i];
        r.bytes_in[i] = atomic_load(&t->bytes_in);
        r.bytes_out[i] = atomic_load(&t->bytes_out);
        r.rows[i] = atomic_load(&t->n_rows);
        r.pushes[i] = atomic_load(&t->pushes);
        r.pulls[i] = atomic_load(&t->pulls);
        r.duplicates[i] = atomic_load(&t->duplicates);
        r.evicted[i] = atomic_load(&t->evicted);
        for (int b = 0; b < WEFT_PS_STALENESS_BUCKETS; b++) {
            r.staleness_hist[(size_t)i * WEFT_PS_STALENESS_BUCKETS + b] = atomic_load(&t->hist[b]);
        }
    }
    weft_value_t *v = reply_pack(&r, NULL);
    weft_free(buf);
    weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
    if (v == NULL) {
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "ps: no memory");
    } else {
        weft_call_reply(call, v);
    }
}

/* ------------------------------------------------------------------ the end */

static void handle_finish(ps_server_t *srv, weft_call_t *call, Weft__V1__PsRequest *req)
{
    weft_ps_t *ps = srv->ps;
    int caller = weft_call_caller_rank(call);
    int w = req->worker;
    weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
    if (w < 0 || (uint32_t)w >= ps->n_workers || ps->workers[w] != caller) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "ps: rank %d is not worker %d", caller, w);
        return;
    }
    pthread_mutex_lock(&srv->mu);
    srv->finished[w] = true;
    pthread_cond_broadcast(&srv->finish_cv);
    pthread_mutex_unlock(&srv->mu);
    weft_call_reply(call, reply_empty());
}

weft_status_t weft__ps_server_wait_finished(ps_server_t *srv, int64_t timeout_ms)
{
    weft_ps_t *ps = srv->ps;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    if (timeout_ms > 0) {
        until.tv_sec += timeout_ms / 1000;
        until.tv_nsec += (timeout_ms % 1000) * 1000000;
        if (until.tv_nsec >= 1000000000) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000;
        }
    }
    weft_status_t st = WEFT_OK;
    pthread_mutex_lock(&srv->mu);
    for (;;) {
        uint32_t left = 0;
        for (uint32_t w = 0; w < ps->n_workers; w++) {
            left += srv->finished[w] ? 0 : 1;
        }
        if (left == 0) {
            break;
        }
        int rc = timeout_ms > 0 ? pthread_cond_timedwait(&srv->finish_cv, &srv->mu, &until)
                                : pthread_cond_wait(&srv->finish_cv, &srv->mu);
        if (rc == ETIMEDOUT) {
            st = weft__set_error(WEFT_ERR_TIMEOUT, "ps: %u workers were not done within %lld ms",
                                 left, (long long)timeout_ms);
            break;
        }
    }
    if (st == WEFT_OK && srv->lost_why[0] != '\0') {
        st = weft__set_error(WEFT_ERR_PEER_LOST, "%s", srv->lost_why);
    }
    pthread_mutex_unlock(&srv->mu);
    return st;
}

/* ------------------------------------------------------------------ the function */

/*
 * Subnormal floats are flushed to zero while a server applies and answers (x86: MXCSR's
 * flush-to-zero and denormals-are-zero; elsewhere nothing changes). An optimizer's state whose
 * values decay into the subnormal range makes every operation on them take microcode assists,
 * 10-100x slower on many x86 processors: P2's Adagrad table at 300 batches ran at 2.0-2.5M
 * rows/s against 6-7M; the values lost are below 1.2e-38. TensorFlow's kernels run the same
 * way. Returns what ps_flush_end restores.
 */
static unsigned ps_flush_begin(void)
{
#if defined(__SSE__)
    unsigned m = _mm_getcsr();
    _mm_setcsr(m | 0x8040u); /* FTZ (bit 15) | DAZ (bit 6) */
    return m;
#else
    return 0;
#endif
}

static void ps_flush_end(unsigned m)
{
#if defined(__SSE__)
    _mm_setcsr(m);
#else
    (void)m;
#endif
}

void weft__ps_handle(weft_call_t *call, void *arg)
{
    weft_ps_t *ps = arg;
    Weft__V1__PsRequest *req = NULL;
    if (weft_msg_unpack(weft_call_args(call), &weft__v1__ps_request__descriptor,
                        (ProtobufCMessage **)&req, NULL) != WEFT_OK) {
        weft_call_fail(call, WEFT_ERR_PROTOCOL, "ps: a request that does not decode: %s",
                       weft_last_error());
        return;
    }
    pthread_mutex_lock(&ps->mu);
    bool ready = ps->roles_set;
    ps_server_t *srv = ps->srv;
    pthread_mutex_unlock(&ps->mu);
    if (!ready || srv == NULL) {
        weft_call_fail(call, ready ? WEFT_ERR_INVALID_ARG : WEFT_ERR_INVALID_STATE,
                       ready ? "ps: rank %d is not a parameter server"
                             : "ps: rank %d has not created its parameter server yet",
                       ps->rank);
        weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
        return;
    }
    switch (req->op) {
    case WEFT__V1__PS_OP__PS_CREATE:
        handle_create(srv, call, req);
        return;
    case WEFT__V1__PS_OP__PS_PUSH:
    case WEFT__V1__PS_OP__PS_PULL:
    case WEFT__V1__PS_OP__PS_PUSH_PULL: {
        unsigned m = ps_flush_begin();
        handle_data(srv, call, req);
        ps_flush_end(m);
        return;
    }
    case WEFT__V1__PS_OP__PS_CLOCK: {
        unsigned m = ps_flush_begin();
        handle_clock(srv, call, req);
        ps_flush_end(m);
        return;
    }
    case WEFT__V1__PS_OP__PS_STATS:
        handle_stats(srv, call, req);
        return;
    case WEFT__V1__PS_OP__PS_FINISH:
        handle_finish(srv, call, req);
        return;
    case WEFT__V1__PS_OP__PS_SAVE:
    case WEFT__V1__PS_OP__PS_LOAD:
        weft__ps_server_checkpoint(srv, call, req);
        return;
    case WEFT__V1__PS_OP__PS_COMMIT:
        weft__ps_server_commit(srv, call, req);
        return;
    default:
        weft_call_fail(call, WEFT_ERR_PROTOCOL, "ps: unknown operation %d", (int)req->op);
        weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
        return;
    }
}

/* ------------------------------------------------------------------ lost peers */

void weft__ps_server_peer_lost(ps_server_t *srv, int rank, const char *why)
{
    weft_ps_t *ps = srv->ps;
    done_t *done = NULL;
    int w = -1;
    for (uint32_t i = 0; i < ps->n_workers; i++) {
        if (ps->workers[i] == rank) {
            w = (int)i;
        }
    }
    pthread_mutex_lock(&srv->mu);
    uint32_t n = srv->n_tables;
    if (w >= 0 && !srv->finished[w]) {
        srv->finished[w] = true;        /* it will never say so */
        if (srv->lost_why[0] == '\0') { /* the first one lost is named */
            snprintf(srv->lost_why, sizeof(srv->lost_why), "ps: worker %d (rank %d) was lost: %s",
                     w, rank, why);
        }
        pthread_cond_broadcast(&srv->finish_cv);
    }
    /* Creations that will never have everyone. */
    for (uint32_t i = 0; i < PS_MAX_TABLES; i++) {
        ps_pending_create_t *pc = &srv->creates[i];
        if (pc->calls == NULL || pc->specs[rank] != NULL || !participant(ps, rank)) {
            continue;
        }
        char text[256];
        snprintf(text, sizeof(text), "ps: table %u cannot be created: rank %d was lost (%s)", i,
                 rank, why);
        for (int r = 0; r < ps->world; r++) {
            if (pc->calls[r] != NULL) {
                done_add(&done, pc->calls[r], NULL, WEFT_ERR_PEER_LOST, text);
            }
        }
        create_clear(srv, pc);
    }
    pthread_mutex_unlock(&srv->mu);
    if (w >= 0) {
        weft__ps_server_checkpoint_lost(srv, w, rank, why);
    }
    for (uint32_t i = 0; w >= 0 && i < n; i++) {
        ps_stable_t *t = srv->tables[i];
        pthread_mutex_lock(&t->mu);
        t->dead[w] = true;
        if (t->l.spec.consistency != WEFT_PS_ASYNC && t->failed == WEFT_OK) {
            t->failed = WEFT_ERR_PEER_LOST;
            snprintf(t->failed_why, sizeof(t->failed_why),
                     "ps: table '%s': worker %d (rank %d) was lost (%s); its steps cannot "
                     "complete",
                     t->l.name, w, rank, why);
            fail_parked(t, &done);
        } else {
            parked_run(t, &done);
        }
        pthread_mutex_unlock(&t->mu);
    }
    done_run(done);
}
