/* References and forks: handles and their release (G1: a released user reference tells its
 * owner), the owner's forks and tombstones, the parent's pending children (G2), the codec that
 * forks a reference into a message, the control requests' handlers, and lost peers. */
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* ------------------------------------------------------------- structs */

weft_rref_t *rref__alloc(rref_ctx_t *ctx, rref_role_t role, weft_rref_id_t id, int owner,
                         const char *type, const char *created_by)
{
    weft_rref_t *r = weft_calloc(1, sizeof(*r));

    if (r == NULL) {
        return NULL;
    }
    r->type = type != NULL && type[0] != '\0' ? weft_strdup(type) : NULL;
    r->created_by = weft_strdup(created_by != NULL ? created_by : "?");
    if ((type != NULL && type[0] != '\0' && r->type == NULL) || r->created_by == NULL ||
        weft_future_create(&r->ready) != WEFT_OK) {
        weft_free(r->type);
        weft_free(r->created_by);
        weft_free(r);
        return NULL;
    }
    r->ctx = ctx;
    r->role = role;
    r->id = id;
    r->owner = owner;
    r->refs = 1;
    r->parent = -1;
    rref__ctx_ref(ctx);
    return r;
}

void rref__free(weft_rref_t *r)
{
    rref_ctx_t *ctx = r->ctx;

    if (r->obj != NULL && r->rtype != NULL && r->rtype->dtor != NULL) {
        r->rtype->dtor(r->obj, r->rtype->arg);
    }
    weft_value_free(r->value);
    weft_value_free(r->eager);
    weft_future_release(r->ready);
    weft_free(r->forks);
    weft_free(r->tombs);
    weft_free(r->type);
    weft_free(r->created_by);
    weft_free(r);
    rref__ctx_unref(ctx);
}

static size_t owner_bucket(weft_rref_id_t id)
{
    uint64_t h = (id.local * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)(uint32_t)id.worker << 32);
    return (size_t)((h * 0xBF58476D1CE4E5B9ull) >> 40) % RREF_OWNER_BUCKETS;
}

weft_rref_t *rref__owner_find_locked(rref_ctx_t *ctx, weft_rref_id_t id)
{
    for (weft_rref_t *e = ctx->owners[owner_bucket(id)]; e != NULL; e = e->next) {
        if (rref__id_eq(e->id, id)) {
            return e;
        }
    }
    return NULL;
}

void rref__owner_insert_locked(rref_ctx_t *ctx, weft_rref_t *e)
{
    weft_rref_t **head = &ctx->owners[owner_bucket(e->id)];
    e->prev = NULL;
    e->next = *head;
    if (*head != NULL) {
        (*head)->prev = e;
    }
    *head = e;
    e->in_map = true;
    ctx->nowners++;
}

static void owner_unlink_locked(rref_ctx_t *ctx, weft_rref_t *e)
{
    if (e->prev != NULL) {
        e->prev->next = e->next;
    } else {
        ctx->owners[owner_bucket(e->id)] = e->next;
    }
    if (e->next != NULL) {
        e->next->prev = e->prev;
    }
    e->next = e->prev = NULL;
    e->in_map = false;
    ctx->nowners--;
}

void rref__user_insert_locked(rref_ctx_t *ctx, weft_rref_t *u)
{
    u->prev = NULL;
    u->next = ctx->users;
    if (ctx->users != NULL) {
        ctx->users->prev = u;
    }
    ctx->users = u;
    u->listed = true;
    ctx->nusers++;
}

static void user_unlink_locked(rref_ctx_t *ctx, weft_rref_t *u)
{
    if (!u->listed) {
        return;
    }
    if (u->prev != NULL) {
        u->prev->next = u->next;
    } else {
        ctx->users = u->next;
    }
    if (u->next != NULL) {
        u->next->prev = u->prev;
    }
    u->next = u->prev = NULL;
    u->listed = false;
    ctx->nusers--;
}

/* -------------------------------------------------- owner: forks, deletion */

static bool tomb_has(const weft_rref_t *e, weft_rref_id_t fork)
{
    for (size_t i = 0; i < e->ntombs; i++) {
        if (rref__id_eq(e->tombs[i], fork)) {
            return true;
        }
    }
    return false;
}

static void tomb_add(weft_rref_t *e, weft_rref_id_t fork)
{
    if (tomb_has(e, fork)) {
        return;
    }
    if (e->ntombs == e->captombs) {
        size_t cap = e->captombs == 0 ? 4 : e->captombs * 2;
        weft_rref_id_t *g = weft_realloc(e->tombs, cap * sizeof(*g));
        if (g == NULL) {
            WEFT_WARN("rref: no memory for a tombstone of (%d,%llu)", e->id.worker,
                      (unsigned long long)e->id.local);
            return;
        }
        e->tombs = g;
        e->captombs = cap;
    }
    e->tombs[e->ntombs++] = fork;
}

bool rref__owner_add_fork_locked(rref_ctx_t *ctx, weft_rref_t *e, weft_rref_id_t fork, int holder)
{
    if (tomb_has(e, fork)) {
        return false;
    }
    for (size_t i = 0; i < e->nforks; i++) {
        if (rref__id_eq(e->forks[i].fork, fork)) {
            return true;
        }
    }
    if (e->nforks == e->capforks) {
        size_t cap = e->capforks == 0 ? 4 : e->capforks * 2;
        rref_fork_t *g = weft_realloc(e->forks, cap * sizeof(*g));
        if (g == NULL) {
            return false;
        }
        e->forks = g;
        e->capforks = cap;
    }
    e->forks[e->nforks].fork = fork;
    e->forks[e->nforks].holder = holder;
    e->nforks++;
    ctx->nforks++;
    return true;
}

/* Removes @p fork; true if it was there. */
static bool owner_del_fork_locked(rref_ctx_t *ctx, weft_rref_t *e, weft_rref_id_t fork)
{
    for (size_t i = 0; i < e->nforks; i++) {
        if (rref__id_eq(e->forks[i].fork, fork)) {
            e->forks[i] = e->forks[--e->nforks];
            ctx->nforks--;
            return true;
        }
    }
    return false;
}

bool rref__freed_locked(const rref_ctx_t *ctx, weft_rref_id_t id)
{
    for (size_t i = 0; i < ctx->nfreed; i++) {
        if (rref__id_eq(ctx->freed[i], id)) {
            return true;
        }
    }
    return false;
}

bool rref__owner_maybe_free_locked(rref_ctx_t *ctx, weft_rref_t *e)
{
    if (e->refs > 0 || e->nforks > 0) {
        return false;
    }
    if (e->in_map) {
        owner_unlink_locked(ctx, e);
        ctx->freed[ctx->freed_next] = e->id;
        ctx->freed_next = (ctx->freed_next + 1) % RREF_FREED_RING;
        if (ctx->nfreed < RREF_FREED_RING) {
            ctx->nfreed++;
        }
        ctx->deleted_owners++;
    }
    return true;
}

void rref__orphan_add_locked(rref_ctx_t *ctx, weft_rref_id_t id, weft_rref_id_t fork)
{
    int64_t now = weft__now_ms();

    /* Forget the old ones first. */
    for (rref_orphan_t **pp = &ctx->orphans; *pp != NULL;) {
        rref_orphan_t *o = *pp;
        if (now - o->at_ms > RREF_ORPHAN_TTL_MS) {
            *pp = o->next;
            ctx->norphans--;
            weft_free(o);
        } else {
            pp = &o->next;
        }
    }
    if (ctx->norphans >= RREF_ORPHAN_MAX) {
        WEFT_WARN("rref: too many deletes of unknown references; (%d,%llu) forgotten", id.worker,
                  (unsigned long long)id.local);
        return;
    }
    rref_orphan_t *o = weft_alloc(sizeof(*o));
    if (o == NULL) {
        return;
    }
    o->id = id;
    o->fork = fork;
    o->at_ms = now;
    o->next = ctx->orphans;
    ctx->orphans = o;
    ctx->norphans++;
}

bool rref__orphan_take_locked(rref_ctx_t *ctx, weft_rref_id_t id, weft_rref_id_t fork)
{
    for (rref_orphan_t **pp = &ctx->orphans; *pp != NULL; pp = &(*pp)->next) {
        rref_orphan_t *o = *pp;
        if (rref__id_eq(o->id, id) && rref__id_eq(o->fork, fork)) {
            *pp = o->next;
            ctx->norphans--;
            weft_free(o);
            return true;
        }
    }
    return false;
}

void rref__owner_set(weft_rref_t *e, weft_status_t st, const char *text, weft_value_t *value,
                     void *obj)
{
    if (st == WEFT_OK) {
        e->value = value;
        e->obj = obj;
    } else {
        weft_value_free(value);
    }
    weft_future_complete(e->ready, st, text, NULL);
}

/* -------------------------------------------------------------- handles */

weft_rref_t *weft_rref_retain(weft_rref_t *r)
{
    if (r == NULL) {
        return NULL;
    }
    pthread_mutex_lock(&r->ctx->mu);
    r->refs++;
    pthread_mutex_unlock(&r->ctx->mu);
    return r;
}

void weft_rref_release(weft_rref_t *r)
{
    if (r == NULL) {
        return;
    }
    rref_ctx_t *ctx = r->ctx;
    pthread_mutex_lock(&ctx->mu);
    if (--r->refs > 0) {
        pthread_mutex_unlock(&ctx->mu);
        return;
    }
    if (r->role == RREF_USER) {
        user_unlink_locked(ctx, r);
        /* G1: the owner hears of every released user reference it knows (or may know). */
        bool send =
            !ctx->dead && !r->detached && !r->owner_lost && (r->confirmed || r->maybe_known);
        pthread_mutex_unlock(&ctx->mu);
        if (send) {
            rref__ctl_send(ctx, WEFT__V1__RREF_MSG_KIND__RREF_USER_DELETE, r->owner, r->id, r->fork,
                           NULL, NULL);
        }
        rref__free(r);
        return;
    }
    bool free_it = !r->in_map ? r->nforks == 0 : rref__owner_maybe_free_locked(ctx, r);
    pthread_mutex_unlock(&ctx->mu);
    if (free_it) {
        rref__free(r);
    }
}

void rref__user_settle(weft_rref_t *u, bool confirmed, bool maybe_known, weft_status_t st,
                       const char *text)
{
    rref_ctx_t *ctx = u->ctx;

    pthread_mutex_lock(&ctx->mu);
    u->confirmed = confirmed;
    u->maybe_known = maybe_known;
    u->pending = false;
    rref__settle_signal_locked(ctx);
    if (st == WEFT_ERR_OWNER_LOST) {
        u->owner_lost = true;
    }
    pthread_mutex_unlock(&ctx->mu);
    weft_future_complete(u->ready, st, text, NULL);
    /* The first use waiting for the answer took its value (the callbacks ran); later ones
     * fetch. */
    pthread_mutex_lock(&ctx->mu);
    weft_value_t *eager = u->eager;
    u->eager = NULL;
    pthread_mutex_unlock(&ctx->mu);
    weft_value_free(eager);
    weft_rref_release(u); /* the pending confirmation's hold */
}

/* --------------------------------------------------------------- codec */

static void ref_retain(void *obj)
{
    weft_rref_retain(obj);
}

static void ref_release(void *obj)
{
    weft_rref_release(obj);
}

const weft_value_ref_type_t rref__ref_type = {WEFT_REF_KIND_RREF, ref_retain, ref_release};

static Weft__V1__RRefFork *fork_unpack(rref_ctx_t *ctx, const void *bytes, size_t len,
                                       weft_rref_id_t *id_p, weft_rref_id_t *fork_p)
{
    Weft__V1__RRefFork *f = weft__v1__rref_fork__unpack(&weft__pb_allocator, len, bytes);
    if (f == NULL) {
        weft__set_error(WEFT_ERR_PROTOCOL, "rref: unreadable fork");
        return NULL;
    }
    if (!rref__id_from_pb(ctx, f->rref_id, id_p) || !rref__id_from_pb(ctx, f->fork_id, fork_p) ||
        f->owner < 0 || f->owner >= ctx->world || f->parent < 0 || f->parent >= ctx->world ||
        strlen(f->type) > RREF_MAX_NAME || strlen(f->created_by) > RREF_MAX_NAME) {
        weft__v1__rref_fork__free_unpacked(f, &weft__pb_allocator);
        weft__set_error(WEFT_ERR_PROTOCOL, "rref: fork with bad ids, ranks or names");
        return NULL;
    }
    return f;
}

/* Removes the pending child @p fork (held by @p holder, -1: any); returns its parent (held). */
static weft_rref_t *child_take_locked(rref_ctx_t *ctx, weft_rref_id_t fork, int holder)
{
    for (rref_child_t **pp = &ctx->children; *pp != NULL; pp = &(*pp)->next) {
        rref_child_t *c = *pp;
        if (rref__id_eq(c->fork, fork) && (holder < 0 || c->holder == holder)) {
            weft_rref_t *parent = c->parent;
            *pp = c->next;
            ctx->nchildren--;
            rref__settle_signal_locked(ctx);
            weft_free(c);
            return parent;
        }
    }
    return NULL;
}

static weft_status_t codec_encode(void *state, weft_agent_t *a, int to, void *obj, void **bytes_p,
                                  size_t *len_p)
{
    rref_ctx_t *ctx = state;
    weft_rref_t *r = obj;
    weft_status_t st = WEFT_OK;
    weft_rref_id_t fork = rref__new_id(ctx);
    rref_child_t *child = NULL;

    (void)a;
    if (r->role == RREF_USER) {
        if (weft_future_done(r->ready) && weft_future_status(r->ready) != WEFT_OK) {
            return weft__set_error(weft_future_status(r->ready),
                                   "rref (%d,%llu) cannot be shared: %s", r->id.worker,
                                   (unsigned long long)r->id.local, weft_future_error(r->ready));
        }
        child = weft_calloc(1, sizeof(*child));
        if (child == NULL) {
            return weft__set_error(WEFT_ERR_NO_MEMORY, "rref: no memory for a fork");
        }
    }
    pthread_mutex_lock(&ctx->mu);
    if (ctx->dead) {
        st = weft__set_error(WEFT_ERR_SHUTDOWN, "rref: the agent is closed");
    } else if (to < 0 || to >= ctx->world || ctx->lost[to]) {
        st = weft__set_error(WEFT_ERR_PEER_LOST, "rref: rank %d was lost", to);
    } else if (r->role == RREF_OWNER) {
        /* Early fork registration: the owner knows the fork before it leaves. */
        if (!r->in_map || !rref__owner_add_fork_locked(ctx, r, fork, to)) {
            st = weft__set_error(WEFT_ERR_INVALID_STATE, "rref (%d,%llu): owner entry is gone",
                                 r->id.worker, (unsigned long long)r->id.local);
        }
    } else if (r->owner_lost) {
        st = weft__set_error(WEFT_ERR_OWNER_LOST, "rref (%d,%llu): its owner %s (rank %d) was lost",
                             r->id.worker, (unsigned long long)r->id.local,
                             rref__worker_name(ctx, r->owner), r->owner);
    } else if (r->detached) {
        st = weft__set_error(WEFT_ERR_SHUTDOWN, "rref (%d,%llu) was released at shutdown",
                             r->id.worker, (unsigned long long)r->id.local);
    } else {
        /* G2: the parent stays alive until the child is accepted. */
        r->forked = true;
        child->fork = fork;
        child->holder = to;
        child->parent = r;
        r->refs++;
        child->next = ctx->children;
        ctx->children = child;
        ctx->nchildren++;
        child = NULL;
    }
    pthread_mutex_unlock(&ctx->mu);
    weft_free(child);
    if (st != WEFT_OK) {
        return st;
    }

    Weft__V1__RRefFork f = WEFT__V1__RREF_FORK__INIT;
    Weft__V1__RRefId pid, pfork;
    rref__id_to_pb(r->id, &pid);
    rref__id_to_pb(fork, &pfork);
    f.rref_id = &pid;
    f.fork_id = &pfork;
    f.owner = r->owner;
    f.parent = ctx->rank;
    f.type = r->type != NULL ? r->type : "";
    f.created_by = r->created_by;
    size_t len = weft__v1__rref_fork__get_packed_size(&f);
    uint8_t *buf = weft_alloc(len);
    if (buf == NULL) {
        weft_rref_t *parent = NULL;
        bool free_it = false;
        pthread_mutex_lock(&ctx->mu);
        if (r->role == RREF_OWNER) {
            owner_del_fork_locked(ctx, r, fork);
            free_it = rref__owner_maybe_free_locked(ctx, r);
        } else {
            parent = child_take_locked(ctx, fork, to);
        }
        pthread_mutex_unlock(&ctx->mu);
        if (free_it) {
            rref__free(r);
        }
        weft_rref_release(parent);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rref: no memory for a fork");
    }
    weft__v1__rref_fork__pack(&f, buf);
    *bytes_p = buf;
    *len_p = len;
    return WEFT_OK;
}

static void codec_unsent(void *state, weft_agent_t *a, int to, void *obj, const void *bytes,
                         size_t len)
{
    rref_ctx_t *ctx = state;
    weft_rref_t *r = obj;
    weft_rref_id_t id, fork;

    (void)a;
    Weft__V1__RRefFork *f = fork_unpack(ctx, bytes, len, &id, &fork);
    if (f == NULL) {
        return;
    }
    weft__v1__rref_fork__free_unpacked(f, &weft__pb_allocator);
    weft_rref_t *parent = NULL;
    pthread_mutex_lock(&ctx->mu);
    if (r->role == RREF_OWNER) {
        /* The value holds the entry, so it is not freed here. */
        owner_del_fork_locked(ctx, r, fork);
    } else {
        parent = child_take_locked(ctx, fork, to);
    }
    pthread_mutex_unlock(&ctx->mu);
    weft_rref_release(parent);
}

/* A user->user fork's FORK_REQUEST ended: confirm (or fail) the child, tell the parent. */
static void fork_request_done(rref_ctx_t *ctx, weft_status_t st, const char *why, void *arg)
{
    weft_rref_t *u = arg;
    weft_rref_id_t id = u->id, fork = u->fork;
    int parent = u->parent;

    if (st == WEFT_OK) {
        rref__user_settle(u, true, false, WEFT_OK, NULL);
    } else {
        char text[1024];
        if (st == WEFT_ERR_PEER_LOST) {
            st = WEFT_ERR_OWNER_LOST;
        }
        snprintf(text, sizeof(text),
                 "rref (%d,%llu): its owner %s (rank %d) did not accept the "
                 "fork: %s",
                 id.worker, (unsigned long long)id.local, rref__worker_name(ctx, u->owner),
                 u->owner, why != NULL && why[0] != '\0' ? why : weft_strerror(st));
        rref__user_settle(u, false, false, st, text);
    }
    rref__ctl_send(ctx, WEFT__V1__RREF_MSG_KIND__RREF_CHILD_ACCEPT, parent, id, fork, NULL, NULL);
}

/* Whether the creation of @p id may still come to this owner: made by another rank, which is
 * not lost, and not freed here. */
static bool creation_may_come_locked(rref_ctx_t *ctx, weft_rref_id_t id)
{
    return id.worker != ctx->rank && id.worker >= 0 && id.worker < ctx->world &&
           !ctx->lost[id.worker] && !rref__freed_locked(ctx, id);
}

/* A placeholder's creation did not come in time (or never will: the agent closes): it fails
 * and lets go of the creation's hold; then of the task's. */
static void placeholder_end(weft_rref_t *e, weft_status_t st)
{
    rref_ctx_t *ctx = e->ctx;
    pthread_mutex_lock(&ctx->mu);
    bool expired = e->awaiting_creation;
    e->awaiting_creation = false;
    pthread_mutex_unlock(&ctx->mu);
    if (expired) {
        char text[256];
        snprintf(text, sizeof(text),
                 "rref (%d,%llu): a call carrying it reached its owner %s, but its creation "
                 "never did",
                 e->id.worker, (unsigned long long)e->id.local,
                 rref__worker_name(ctx, ctx->rank));
        rref__owner_set(e, st, text, NULL, NULL);
        weft_rref_release(e); /* the creation's hold */
    }
    weft_rref_release(e); /* the task's */
}

static void placeholder_expire(void *arg, uint64_t data)
{
    (void)data;
    placeholder_end(arg, WEFT_ERR_NOT_FOUND);
}

static void placeholder_drop(void *arg, uint64_t data)
{
    (void)data;
    placeholder_end(arg, WEFT_ERR_SHUTDOWN);
}

static weft_status_t codec_decode(void *state, weft_agent_t *a, int src, const void *bytes,
                                  size_t len, void **obj_p, weft_future_t **ready_p)
{
    rref_ctx_t *ctx = state;
    weft_rref_id_t id, fork;
    weft_status_t st = WEFT_OK;

    (void)a;
    Weft__V1__RRefFork *f = fork_unpack(ctx, bytes, len, &id, &fork);
    if (f == NULL) {
        return WEFT_ERR_PROTOCOL;
    }
    if (f->parent != src) {
        int parent = f->parent;
        weft__v1__rref_fork__free_unpacked(f, &weft__pb_allocator);
        return weft__set_error(WEFT_ERR_PROTOCOL, "rref: fork from rank %d names parent %d", src,
                               parent);
    }
    if (f->owner == ctx->rank) {
        /* A fork that comes home: the owner entry itself; the parent may let go. */
        pthread_mutex_lock(&ctx->mu);
        weft_rref_t *e = ctx->dead ? NULL : rref__owner_find_locked(ctx, id);
        bool on_the_way = e == NULL && !ctx->dead && creation_may_come_locked(ctx, id);
        pthread_mutex_unlock(&ctx->mu);
        weft_rref_t *fresh =
            on_the_way ? rref__alloc(ctx, RREF_OWNER, id, ctx->rank, f->type, f->created_by) : NULL;
        bool placeholder = false;
        pthread_mutex_lock(&ctx->mu);
        e = ctx->dead ? NULL : rref__owner_find_locked(ctx, id);
        if (e == NULL && fresh != NULL && creation_may_come_locked(ctx, id)) {
            /* Its creation was sent before this call but runs on another handler thread: a
             * placeholder (its one reference is the creation's hold) that the creation fills. */
            e = fresh;
            fresh = NULL;
            e->awaiting_creation = true;
            rref__owner_insert_locked(ctx, e);
            e->refs++; /* the expiry task's */
            placeholder = true;
        }
        if (e != NULL) {
            e->refs++;
        }
        pthread_mutex_unlock(&ctx->mu);
        if (fresh != NULL) {
            fresh->refs = 0;
            rref__free(fresh);
        }
        if (placeholder) {
            /* Not queued (the agent is closing): placeholder_drop has run. */
            (void)weft_agent_timer_add(ctx->a, ctx->ctl_timeout_ms * 1000, placeholder_expire,
                                       placeholder_drop, e, 0, ctx);
        }
        weft__v1__rref_fork__free_unpacked(f, &weft__pb_allocator);
        rref__ctl_send(ctx, WEFT__V1__RREF_MSG_KIND__RREF_CHILD_ACCEPT, src, id, fork, NULL, NULL);
        if (e == NULL) {
            return weft__set_error(WEFT_ERR_NOT_FOUND,
                                   "rref (%d,%llu) is no longer known to its owner %s", id.worker,
                                   (unsigned long long)id.local,
                                   ctx->a != NULL ? rref__worker_name(ctx, ctx->rank) : "?");
        }
        *obj_p = e;
        /* A placeholder: the request runs once the creation filled it (or failed, or it
         * expired), never on a handler thread waiting for it. */
        *ready_p = placeholder ? weft_future_retain(e->ready) : NULL;
        return WEFT_OK;
    }
    weft_rref_t *u = rref__alloc(ctx, RREF_USER, id, f->owner, f->type, f->created_by);
    int owner = f->owner;
    bool from_owner = f->parent == f->owner;
    weft__v1__rref_fork__free_unpacked(f, &weft__pb_allocator);
    if (u == NULL) {
        if (!from_owner) {
            rref__ctl_send(ctx, WEFT__V1__RREF_MSG_KIND__RREF_CHILD_ACCEPT, src, id, fork, NULL,
                           NULL);
        }
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rref: no memory for a user reference");
    }
    u->fork = fork;
    u->parent = src;
    pthread_mutex_lock(&ctx->mu);
    bool lost = ctx->lost[owner];
    bool dead = ctx->dead;
    u->owner_lost = lost;
    if (from_owner) {
        /* Registered by the owner when it sent it: confirmed at once. */
        u->confirmed = !lost && !dead;
    } else if (!lost && !dead) {
        u->pending = true;
        u->refs++; /* the pending confirmation's hold */
    }
    rref__user_insert_locked(ctx, u);
    pthread_mutex_unlock(&ctx->mu);
    if (from_owner || lost || dead) {
        if (lost || dead) {
            st = lost ? WEFT_ERR_OWNER_LOST : WEFT_ERR_SHUTDOWN;
            weft_future_fail(u->ready, st, "rref (%d,%llu): its owner %s (rank %d) %s", id.worker,
                             (unsigned long long)id.local, rref__worker_name(ctx, owner), owner,
                             lost ? "was lost" : "cannot be reached: the agent is closed");
            if (!from_owner) {
                rref__ctl_send(ctx, WEFT__V1__RREF_MSG_KIND__RREF_CHILD_ACCEPT, src, id, fork, NULL,
                               NULL);
            }
            *ready_p = weft_future_retain(u->ready);
        } else {
            weft_future_complete(u->ready, WEFT_OK, NULL, NULL);
            *ready_p = NULL;
        }
        *obj_p = u;
        return WEFT_OK;
    }
    /* User to user: ask the owner; the child is usable once it accepts (the handler of a request
     * carrying it runs after that). */
    *ready_p = weft_future_retain(u->ready);
    *obj_p = u;
    rref__ctl_send(ctx, WEFT__V1__RREF_MSG_KIND__RREF_FORK_REQUEST, owner, id, fork,
                   fork_request_done, u);
    return WEFT_OK;
}

const weft_ref_codec_t rref__codec = {codec_encode, codec_unsent, codec_decode, &rref__ref_type};

/* ------------------------------------------------------ control requests */

weft_status_t rref__on_fork_request(rref_ctx_t *ctx, int src, weft_rref_id_t id,
                                    weft_rref_id_t fork, char *why, size_t why_len)
{
    weft_status_t st = WEFT_OK;

    pthread_mutex_lock(&ctx->mu);
    if (ctx->lost[src]) {
        st = WEFT_ERR_PEER_LOST;
    } else {
        weft_rref_t *e = rref__owner_find_locked(ctx, id);
        if (e != NULL) {
            /* A fork deleted already (a late duplicate) stays deleted. */
            if (!tomb_has(e, fork) && !rref__owner_add_fork_locked(ctx, e, fork, src)) {
                st = WEFT_ERR_NO_MEMORY;
                snprintf(why, why_len, "rref: no memory for a fork on %s",
                         rref__worker_name(ctx, ctx->rank));
            }
        } else if (id.worker == ctx->rank || rref__freed_locked(ctx, id)) {
            /* Made here and gone (its creation is never on the way to this owner). */
            st = WEFT_ERR_NOT_FOUND;
            snprintf(why, why_len, "rref (%d,%llu) was deleted on its owner %s", id.worker,
                     (unsigned long long)id.local, rref__worker_name(ctx, ctx->rank));
        } else {
            st = WEFT_ERR_PENDING; /* its creation has not arrived yet */
        }
    }
    pthread_mutex_unlock(&ctx->mu);
    return st;
}

weft_status_t rref__on_child_accept(rref_ctx_t *ctx, int src, weft_rref_id_t fork)
{
    pthread_mutex_lock(&ctx->mu);
    weft_rref_t *parent = child_take_locked(ctx, fork, src);
    pthread_mutex_unlock(&ctx->mu);
    weft_rref_release(parent);
    return WEFT_OK;
}

weft_status_t rref__on_user_delete(rref_ctx_t *ctx, int src, weft_rref_id_t id, weft_rref_id_t fork)
{
    bool free_it = false;

    (void)src;
    pthread_mutex_lock(&ctx->mu);
    weft_rref_t *e = rref__owner_find_locked(ctx, id);
    if (e != NULL) {
        owner_del_fork_locked(ctx, e, fork);
        tomb_add(e, fork);
        free_it = rref__owner_maybe_free_locked(ctx, e);
    } else if (id.worker != ctx->rank && !rref__freed_locked(ctx, id)) {
        /* Its creation may still be on the way (the creating call timed out): remembered, so
         * that it is created without this fork. */
        rref__orphan_add_locked(ctx, id, fork);
    }
    pthread_mutex_unlock(&ctx->mu);
    if (free_it) {
        rref__free(e);
    }
    return WEFT_OK;
}

/* ------------------------------------------------------------ lost peers */

void rref__on_peer_lost(void *state, int rank, const char *why)
{
    rref_ctx_t *ctx = state;
    weft_rref_t *free_list = NULL;
    weft_rref_t **parents = NULL;
    size_t nparents = 0;
    weft_future_t **fail = NULL;
    size_t nfail = 0, nfreed = 0;

    if (rank < 0 || rank >= ctx->world) {
        return;
    }
    pthread_mutex_lock(&ctx->mu);
    if (ctx->lost[rank]) {
        pthread_mutex_unlock(&ctx->mu);
        return;
    }
    ctx->lost[rank] = true;
    /* Owners drop the forks the lost rank held: nothing leaks. */
    for (size_t b = 0; b < RREF_OWNER_BUCKETS; b++) {
        for (weft_rref_t *e = ctx->owners[b]; e != NULL;) {
            weft_rref_t *next = e->next;
            for (size_t i = 0; i < e->nforks;) {
                if (e->forks[i].holder == rank) {
                    e->forks[i] = e->forks[--e->nforks];
                    ctx->nforks--;
                } else {
                    i++;
                }
            }
            if (rref__owner_maybe_free_locked(ctx, e)) {
                e->next = free_list;
                free_list = e;
                nfreed++;
            }
            e = next;
        }
    }
    /* Parents drop the forks they sent to it. */
    size_t nc = 0;
    for (rref_child_t *c = ctx->children; c != NULL; c = c->next) {
        nc++;
    }
    parents = weft_calloc(nc + 1, sizeof(*parents));
    for (rref_child_t **pp = &ctx->children; *pp != NULL && parents != NULL;) {
        rref_child_t *c = *pp;
        if (c->holder == rank || c->parent->owner == rank) {
            *pp = c->next;
            ctx->nchildren--;
            rref__settle_signal_locked(ctx);
            parents[nparents++] = c->parent;
            weft_free(c);
        } else {
            pp = &c->next;
        }
    }
    /* Users of its references: every pending and later operation fails. */
    fail = weft_calloc(ctx->nusers + 1, sizeof(*fail));
    for (weft_rref_t *u = ctx->users; u != NULL; u = u->next) {
        if (u->owner == rank) {
            u->owner_lost = true;
            if (fail != NULL && !weft_future_done(u->ready)) {
                fail[nfail++] = weft_future_retain(u->ready);
            }
        }
    }
    pthread_mutex_unlock(&ctx->mu);

    WEFT_INFO("rref: rank %d lost: %zu owner entries freed, %zu pending forks dropped, %zu "
              "references failed",
              rank, nfreed, nparents, nfail);
    rref__ctl_fail_rank(ctx, rank, WEFT_ERR_PEER_LOST, why);
    for (size_t i = 0; i < nfail; i++) {
        weft_future_fail(fail[i], WEFT_ERR_OWNER_LOST, "rref: owner %s (rank %d) was lost: %s",
                         rref__worker_name(ctx, rank), rank, why != NULL ? why : "");
        weft_future_release(fail[i]);
    }
    weft_free(fail);
    for (size_t i = 0; i < nparents; i++) {
        weft_rref_release(parents[i]);
    }
    weft_free(parents);
    while (free_list != NULL) {
        weft_rref_t *e = free_list;
        free_list = e->next;
        rref__free(e);
    }
}
