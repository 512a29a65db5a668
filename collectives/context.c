/* The per-agent context of the collectives: the channel they speak on, the
 * mailbox of received pieces, aborts and lost ranks; sending and receiving a
 * piece of an operation; point-to-point delivery. */
#include <stdio.h>
#include <string.h>
#include <sched.h>
#include <time.h>

#include "internal.h"

/* ------------------------------------------------------------ posted receives */

/* Deadline tasks of posted receives on the agent's timer: queued and not yet run, cancelled
 * or dropped; and the receives they failed (white-box tests). */
static _Atomic long deadlines_armed;
static _Atomic long deadlines_fired;

long coll__recv_deadlines_armed(void)
{
    return atomic_load(&deadlines_armed);
}

long coll__recv_deadlines_fired(void)
{
    return atomic_load(&deadlines_fired);
}

static void precv_free(coll_precv_t *p)
{
    weft_future_release(p->f);
    weft_tensor_release(p->dst);
    weft_free(p);
}

/* Takes back the deadline task of @p p, which its caller has just taken out of ctx->precvs.
 * If the task is running already, it will not find @p p there: it does nothing. */
static void precv_disarm(coll_ctx_t *ctx, const coll_precv_t *p)
{
    if (p->timer != 0 && weft_agent_timer_cancel(ctx->agent, p->timer)) {
        atomic_fetch_sub(&deadlines_armed, 1);
    }
}

/* The deadline task of the posted receive @p id (on the agent's timer thread). The task
 * holds the receive's id, not its address: a receive matched or failed meanwhile is gone
 * from the list, and the task finds nothing. */
static void precv_deadline(void *arg, uint64_t id)
{
    coll_ctx_t *ctx = arg;
    coll_precv_t *p = NULL;

    atomic_fetch_sub(&deadlines_armed, 1);
    pthread_mutex_lock(&ctx->mu);
    for (coll_precv_t **pp = &ctx->precvs; *pp != NULL; pp = &(*pp)->next) {
        if ((*pp)->id == id) {
            p = *pp;
            *pp = p->next;
            break;
        }
    }
    pthread_mutex_unlock(&ctx->mu);
    if (p == NULL) {
        return;
    }
    atomic_fetch_add(&deadlines_fired, 1);
    weft_future_fail(p->f, WEFT_ERR_TIMEOUT,
                     "recv: no matching send from %s %d (tag %d) before the deadline",
                     p->src == WEFT_ANY_SOURCE ? "any rank of group" : "group rank",
                     p->src == WEFT_ANY_SOURCE ? (int)p->group : p->src, p->tag);
    precv_free(p);
}

/* The task will never run (the context goes, or the timer could not take it). */
static void precv_deadline_dropped(void *arg, uint64_t id)
{
    (void)arg;
    (void)id;
    atomic_fetch_sub(&deadlines_armed, 1);
}

/* ------------------------------------------------------------ context */

static void ctx_destroy(void *state)
{
    coll_ctx_t *ctx = state;

    /* The agent has dropped this context's deadline tasks (it owns them) and closed the
     * transport: nothing else looks at it any more. */
    while (ctx->msgs != NULL) {
        coll_msg_t *m = ctx->msgs;
        ctx->msgs = m->next;
        coll__msg_free(m);
    }
    while (ctx->precvs != NULL) {
        coll_precv_t *p = ctx->precvs;
        ctx->precvs = p->next;
        weft_future_complete(p->f, WEFT_ERR_SHUTDOWN, "the agent was closed", NULL);
        precv_free(p);
    }
    while (ctx->aborts != NULL) {
        coll_abort_t *x = ctx->aborts;
        ctx->aborts = x->next;
        weft_free(x->why);
        weft_free(x);
    }
    int n = weft_agent_world_size(ctx->agent);
    for (int i = 0; i < n; i++) {
        weft_free(ctx->why[i]);
    }
    weft_free(ctx->why);
    weft_free(ctx->lost);
    pthread_mutex_destroy(&ctx->mu);
    pthread_cond_destroy(&ctx->cv);
    weft_free(ctx);
}

void coll__msg_free(coll_msg_t *m)
{
    if (m == NULL) {
        return;
    }
    weft_msg_header_free(&m->hdr->base);
    weft_value_free(m->value);
    weft_free(m);
}

weft_tensor_t *coll__msg_tensor(const coll_msg_t *m)
{
    return weft_value_tensor(m->value, 0);
}

/* Completes a posted receive with a matching message. Called without ctx->mu. */
static void deliver_p2p(coll_precv_t *p, coll_msg_t *m)
{
    weft_tensor_t *t = coll__msg_tensor(m);
    size_t want = weft_tensor_nbytes(p->dst);

    if (t == NULL ? want != 0
                  : weft_tensor_dtype(t) != weft_tensor_dtype(p->dst) ||
                        weft_tensor_numel(t) != weft_tensor_numel(p->dst)) {
        weft_future_fail(p->f, WEFT_ERR_MISMATCH,
                         "recv: rank %u sent %lld elements of %s with tag %d, this rank expects "
                         "%lld of %s",
                         m->hdr->src, t == NULL ? 0LL : (long long)weft_tensor_numel(t),
                         t == NULL ? "-" : weft_dtype_name(weft_tensor_dtype(t)), m->hdr->tag,
                         (long long)weft_tensor_numel(p->dst),
                         weft_dtype_name(weft_tensor_dtype(p->dst)));
    } else {
        if (want > 0) {
            memcpy(weft_tensor_data(p->dst), weft_tensor_data(t), want);
        }
        weft_value_t *v = NULL;
        int src = (int)m->hdr->src;
        if (weft_value_create(&v) == WEFT_OK) {
            weft_value_set_payload(v, &src, sizeof(src));
        }
        weft_future_complete(p->f, WEFT_OK, NULL, v);
    }
    precv_free(p);
    coll__msg_free(m);
}

/* Whether group rank @p src of @p g is world rank @p src_world: a piece's header names the
 * member that sent it, and only that member's own messages may say so. */
static bool sent_by(const coll_group_t *g, uint32_t src, int src_world)
{
    return src < (uint32_t)g->size && g->world[src] == src_world;
}

static bool p2p_matches(const coll_precv_t *p, const coll_msg_t *m)
{
    const Weft__V1__CollHeader *h = m->hdr;
    return h->op == WEFT__V1__COLL_OP__COLL_OP_P2P && h->group == p->group &&
           (p->src == WEFT_ANY_SOURCE || (uint32_t)p->src == h->src) && h->tag == p->tag &&
           sent_by(p->g, h->src, m->src_world);
}

/* Whether operation @p seq of group @p id has finished on this rank. Called with ctx->mu. */
static bool seq_finished(const coll_ctx_t *ctx, uint32_t id, uint64_t seq)
{
    for (const coll_group_t *g = ctx->groups; g != NULL; g = g->gnext) {
        if (g->id != id) {
            continue;
        }
        if (seq < g->done_below) {
            return true;
        }
        for (size_t i = 0; i < g->ndone_extra; i++) {
            if (g->done_extra[i] == seq) {
                return true;
            }
        }
        return false;
    }
    return false; /* a group not created here yet: keep its pieces */
}

static void on_message(void *state, int src_world, weft_value_t *msg)
{
    coll_ctx_t *ctx = state;
    ProtobufCMessage *hm = NULL;
    Weft__V1__CollHeader *h = NULL;

    if (weft_msg_unpack(msg, &weft__v1__coll_header__descriptor, &hm, NULL) == WEFT_OK) {
        h = (Weft__V1__CollHeader *)hm;
    }
    if (h == NULL || h->version != COLL_VERSION) {
        WEFT_WARN("collectives: dropped an unreadable message from rank %d", src_world);
        weft_msg_header_free(hm);
        weft_value_free(msg);
        return;
    }
    if (h->kind == WEFT__V1__COLL_KIND__COLL_ABORT) {
        coll_abort_t *x = weft_calloc(1, sizeof(*x));
        if (x != NULL) {
            x->group = h->group;
            x->seq = h->seq;
            x->status =
                weft_status_valid(h->tag) && h->tag < 0 ? (weft_status_t)h->tag : WEFT_ERR_MISMATCH;
            x->why = weft_strdup(h->error != NULL ? h->error : "aborted");
            pthread_mutex_lock(&ctx->mu);
            if (seq_finished(ctx, x->group, x->seq)) {
                /* The operation is over here: nobody will look at it. */
                pthread_mutex_unlock(&ctx->mu);
                weft_free(x->why);
                weft_free(x);
            } else {
                x->next = ctx->aborts;
                ctx->aborts = x;
                pthread_cond_broadcast(&ctx->cv);
                pthread_mutex_unlock(&ctx->mu);
            }
        }
        weft_msg_header_free(&h->base);
        weft_value_free(msg);
        return;
    }
    coll_msg_t *m = weft_calloc(1, sizeof(*m));
    if (m == NULL) {
        weft_msg_header_free(&h->base);
        weft_value_free(msg);
        return;
    }
    m->hdr = h;
    m->value = msg;
    m->src_world = src_world;
    pthread_mutex_lock(&ctx->mu);
    if (h->op == WEFT__V1__COLL_OP__COLL_OP_P2P) {
        /* The oldest matching posted receive takes it. */
        coll_precv_t **pp = &ctx->precvs;
        coll_precv_t *hit = NULL;
        while (*pp != NULL) {
            if (p2p_matches(*pp, m)) {
                hit = *pp;
                *pp = hit->next;
                break;
            }
            pp = &(*pp)->next;
        }
        if (hit != NULL) {
            pthread_mutex_unlock(&ctx->mu);
            precv_disarm(ctx, hit);
            deliver_p2p(hit, m);
            return;
        }
    } else if (seq_finished(ctx, h->group, h->seq)) {
        /* A late piece of an operation that failed or finished here: nobody takes it. */
        pthread_mutex_unlock(&ctx->mu);
        coll__msg_free(m);
        return;
    }
    /* Kept in arrival order (the oldest first) until an operation takes it. */
    coll_msg_t **tail = &ctx->msgs;
    while (*tail != NULL) {
        tail = &(*tail)->next;
    }
    *tail = m;
    pthread_cond_broadcast(&ctx->cv);
    pthread_mutex_unlock(&ctx->mu);
}

static void on_lost(void *state, int rank, const char *why)
{
    coll_ctx_t *ctx = state;
    coll_precv_t *fail = NULL;

    pthread_mutex_lock(&ctx->mu);
    ctx->lost[rank] = true;
    weft_free(ctx->why[rank]);
    ctx->why[rank] = weft_strdup(why);
    /* Posted receives that can only be served by the lost rank fail now. */
    coll_precv_t **pp = &ctx->precvs;
    while (*pp != NULL) {
        coll_precv_t *p = *pp;
        int from = p->src == WEFT_ANY_SOURCE ? -1 : p->g->world[p->src];
        bool none_left = p->src == WEFT_ANY_SOURCE;
        for (int r = 0; none_left && r < p->g->size; r++) {
            if (r != p->g->rank && !ctx->lost[p->g->world[r]]) {
                none_left = false; /* another member can still serve it */
            }
        }
        if (from == rank || none_left) {
            *pp = p->next;
            p->next = fail;
            fail = p;
        } else {
            pp = &p->next;
        }
    }
    pthread_cond_broadcast(&ctx->cv);
    pthread_mutex_unlock(&ctx->mu);
    while (fail != NULL) {
        coll_precv_t *next = fail->next;
        precv_disarm(ctx, fail);
        weft_future_fail(fail->f, WEFT_ERR_PEER_LOST, "recv: rank %d was lost: %s", rank, why);
        precv_free(fail);
        fail = next;
    }
}

static bool on_land(void *state, int src_world, const void *payload, size_t len, weft_dtype_t dtype,
                    int64_t numel, weft_landing_t *l);

static weft_status_t ctx_create(weft_agent_t *a, void **state_p)
{
    int n = weft_agent_world_size(a);
    coll_ctx_t *ctx = weft_calloc(1, sizeof(*ctx));

    if (ctx == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "collectives: no memory");
    }
    ctx->agent = a;
    ctx->lost = weft_calloc((size_t)n, sizeof(bool));
    ctx->why = weft_calloc((size_t)n, sizeof(char *));
    pthread_mutex_init(&ctx->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&ctx->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (ctx->lost == NULL || ctx->why == NULL) {
        ctx_destroy(ctx);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "collectives: no memory");
    }
    *state_p = ctx;
    return WEFT_OK;
}

static const weft_module_desc_t coll_module = {
    .name = "collectives",
    .channel = WEFT_CHANNEL_COLLECTIVES,
    .create = ctx_create,
    .destroy = ctx_destroy,
    .on_message = on_message,
    .lander = on_land,
    .on_peer_lost = on_lost,
};

weft_status_t coll__ctx(weft_agent_t *a, coll_ctx_t **ctx_p)
{
    void *state;
    WEFT_CHECK(weft_agent_module(a, &coll_module, &state));
    *ctx_p = state;
    return WEFT_OK;
}

/* ------------------------------------------------------------ pieces of operations */

const char *coll__kind_name(coll_kind_t k)
{
    switch ((int)k) {
    case OP_BARRIER:
        return "barrier";
    case OP_BROADCAST:
        return "broadcast";
    case OP_ALL_REDUCE:
        return "all_reduce";
    case OP_REDUCE:
        return "reduce";
    case OP_GATHER:
        return "gather";
    case OP_SCATTER:
        return "scatter";
    case OP_ALL_GATHER:
        return "all_gather";
    case OP_REDUCE_SCATTER:
        return "reduce_scatter";
    case OP_ALL_TO_ALL:
        return "all_to_all";
    case WEFT__V1__COLL_OP__COLL_OP_P2P:
        return "send/recv";
    default:
        return "unknown";
    }
}

/* Sent pieces whose bytes the transport still holds (white-box tests). */
static _Atomic long held_pieces;

long coll__held_pieces(void)
{
    return atomic_load(&held_pieces);
}

static void release_cb(void *data, void *arg)
{
    (void)data;
    atomic_fetch_sub(&held_pieces, 1);
    weft_future_complete(arg, WEFT_OK, NULL, NULL);
    weft_future_release(arg);
}

/* Packs @p h into a value with @p data (borrowed; *released_p tells when). */
static weft_status_t send_header(coll_group_t *g, int dst, Weft__V1__CollHeader *h, void *data,
                                 size_t count, weft_dtype_t dtype, weft_future_t **released_p)
{
    weft_status_t st;
    weft_value_t *v;
    weft_future_t *rel = NULL;

    /* The kit's framing: payload = [u32 LE header length][CollHeader]; the data is the
     * message's tensor. */
    WEFT_CHECK(weft_msg_pack(&h->base, NULL, &v));
    if (data != NULL) {
        weft_tensor_t *t;
        int64_t cnt = (int64_t)count;
        WEFT_CHECK_GOTO(weft_future_create(&rel), st, err_free_value);
        atomic_fetch_add(&held_pieces, 1);
        st = weft_tensor_wrap(dtype, 1, &cnt, data, count * weft_dtype_size(dtype), WEFT_CPU,
                              release_cb, weft_future_retain(rel), &t);
        if (st != WEFT_OK) {
            atomic_fetch_sub(&held_pieces, 1);
            weft_future_release(rel); /* the retain for the callback */
            goto err_free_future;
        }
        st = weft_value_push_tensor(v, t);
        if (st != WEFT_OK) {
            weft_tensor_release(t);
            goto err_free_future;
        }
    }
    /* Pieces of collectives are matched by (seq, step, src), not by arrival order: they
     * may take a direct connection. Point-to-point keeps its order. */
    uint32_t flags =
        h->op != WEFT__V1__COLL_OP__COLL_OP_P2P ? WEFT_SEND_UNORDERED | WEFT_SEND_INLINE : 0;
    st = weft_agent_send_flags(g->ctx->agent, g->world[dst], WEFT_CHANNEL_COLLECTIVES, v, flags,
                               NULL);
    weft_value_free(v); /* the transport holds its own references to the bytes */
    if (released_p != NULL && st == WEFT_OK) {
        *released_p = rel;
    } else if (rel != NULL) {
        weft_future_release(rel);
    }
    return st;

err_free_future:
    weft_future_release(rel);
err_free_value:
    weft_value_free(v);
    return st;
}

weft_status_t coll__send(coll_group_t *g, const coll_desc_t *d, uint32_t step, int dst, void *data,
                         size_t count, weft_dtype_t dtype, weft_future_t **released_p)
{
    Weft__V1__CollHeader h = WEFT__V1__COLL_HEADER__INIT;

    h.version = COLL_VERSION;
    h.kind = WEFT__V1__COLL_KIND__COLL_DATA;
    h.group = g->id;
    h.group_hash = g->hash;
    h.seq = d->seq;
    h.step = step;
    h.src = (uint32_t)g->rank;
    h.op = (Weft__V1__CollOp)d->kind;
    h.dtype = (int32_t)d->dtype;
    h.reduce_op = (int32_t)d->rop;
    h.root = d->root;
    h.count = d->count;
    return send_header(g, dst, &h, data, count, dtype, released_p);
}

void coll__abort(coll_group_t *g, uint64_t seq, weft_status_t st, const char *why)
{
    Weft__V1__CollHeader h = WEFT__V1__COLL_HEADER__INIT;

    h.version = COLL_VERSION;
    h.kind = WEFT__V1__COLL_KIND__COLL_ABORT;
    h.group = g->id;
    h.group_hash = g->hash;
    h.seq = seq;
    h.src = (uint32_t)g->rank;
    h.error = (char *)why;
    h.tag = (int32_t)st; /* the status every member fails the operation with */
    for (int r = 0; r < g->size; r++) {
        if (r != g->rank) {
            (void)send_header(g, r, &h, NULL, 0, WEFT_U8, NULL);
        }
    }
    /* And here, so that this rank's own later waits on it fail the same way. */
    coll_abort_t *x = weft_calloc(1, sizeof(*x));
    if (x != NULL) {
        x->group = g->id;
        x->seq = seq;
        x->status = st;
        x->why = weft_strdup(why);
        pthread_mutex_lock(&g->ctx->mu);
        x->next = g->ctx->aborts;
        g->ctx->aborts = x;
        pthread_cond_broadcast(&g->ctx->cv);
        pthread_mutex_unlock(&g->ctx->mu);
    }
}

static void describe(char *buf, size_t n, uint32_t op, int32_t dtype, int32_t rop, int32_t root,
                     uint64_t count)
{
    int k = snprintf(buf, n, "%s(count=%llu, dtype=%s", coll__kind_name((coll_kind_t)op),
                     (unsigned long long)count,
                     weft_dtype_valid(dtype) ? weft_dtype_name((weft_dtype_t)dtype) : "?");
    bool reducing = op == OP_ALL_REDUCE || op == OP_REDUCE || op == OP_REDUCE_SCATTER;
    bool rooted = op == OP_BROADCAST || op == OP_REDUCE || op == OP_GATHER || op == OP_SCATTER;
    if (k > 0 && (size_t)k < n && reducing) {
        k +=
            snprintf(buf + k, n - (size_t)k, ", op=%s", weft_reduce_op_name((weft_reduce_op_t)rop));
    }
    if (k > 0 && (size_t)k < n && op == OP_ALL_TO_ALL) {
        k += snprintf(buf + k, n - (size_t)k, " sent, expecting %d back", root);
    }
    if (k > 0 && (size_t)k < n && rooted) {
        k += snprintf(buf + k, n - (size_t)k, ", root=%d", root);
    }
    if (k > 0 && (size_t)k < n) {
        snprintf(buf + k, n - (size_t)k, ")");
    }
}

/* Compares the sender's view with ours; fills @p why on a mismatch. @p loose: a
 * piece we are not waiting for (all_to_all sizes are per pair: not compared). */
static bool same_op(const coll_group_t *g, const coll_desc_t *d, const Weft__V1__CollHeader *h,
                    bool loose, char *why, size_t n)
{
    bool reducing =
        d->kind == OP_ALL_REDUCE || d->kind == OP_REDUCE || d->kind == OP_REDUCE_SCATTER;
    bool rooted = d->kind == OP_BROADCAST || d->kind == OP_REDUCE || d->kind == OP_GATHER ||
                  d->kind == OP_SCATTER || (d->kind == OP_ALL_TO_ALL && !loose);
    bool counted = !(loose && d->kind == OP_ALL_TO_ALL);
    if (h->group_hash == g->hash && h->op == (Weft__V1__CollOp)d->kind &&
        h->dtype == (int32_t)d->dtype && (!counted || h->count == d->count) &&
        (!reducing || h->reduce_op == (int32_t)d->rop) && (!rooted || h->root == d->root)) {
        return true;
    }
    char mine[160], theirs[160];
    describe(mine, sizeof(mine), (uint32_t)d->kind, (int32_t)d->dtype, (int32_t)d->rop, d->root,
             d->count);
    describe(theirs, sizeof(theirs), (uint32_t)h->op, h->dtype, h->reduce_op, h->root, h->count);
    if (h->group_hash != g->hash) {
        snprintf(why, n,
                 "operation %llu of group %u: rank %u has another member list for this group "
                 "(groups created in another order?)",
                 (unsigned long long)d->seq, g->id, h->src);
    } else {
        snprintf(why, n, "operation %llu of group %u: rank %u called %s, rank %d called %s",
                 (unsigned long long)d->seq, g->id, h->src, theirs, g->rank, mine);
    }
    return false;
}

/* ------------------------------------------------------------ pieces landing in place */

static void slot_sink(void *arg, size_t off, const void *bytes, size_t n)
{
    coll_slot_t *s = arg;
    size_t es = weft_dtype_size(s->dtype);
    /* Through the device's reduce ops, as every reduction of the collectives. */
    s->kern->ops->reduce_into(s->kern->device, s->dst + off, bytes, n / es, s->dtype, s->rop);
}

/* Pieces that landed in place (white-box tests). */
static _Atomic long landed_pieces;

long coll__landed_pieces(void)
{
    return atomic_load(&landed_pieces);
}

static void slot_done(void *arg, bool landed)
{
    coll_slot_t *s = arg;
    if (landed) {
        atomic_fetch_add(&landed_pieces, 1);
    }
    coll_ctx_t *ctx = s->g->ctx;
    pthread_mutex_lock(&ctx->mu);
    atomic_store(&s->state, landed ? COLL_SLOT_LANDED : COLL_SLOT_FAILED);
    pthread_cond_broadcast(&ctx->cv);
    pthread_mutex_unlock(&ctx->mu);
}

/* The direct connection's reader asks where a piece lands: into its posted slot when
 * the piece is the one expected there, with the operation's view. */
static bool on_land(void *state, int src_world, const void *payload, size_t len, weft_dtype_t dtype,
                    int64_t numel, weft_landing_t *l)
{
    coll_ctx_t *ctx = state;
    ProtobufCMessage *hm;
    bool taken = false;
    char why[700];

    if (weft_msg_unpack_payload(payload, len, &weft__v1__coll_header__descriptor, &hm, NULL) !=
        WEFT_OK) {
        return false; /* on_message says what is wrong with it */
    }
    Weft__V1__CollHeader *h = (Weft__V1__CollHeader *)hm;
    if (h->version == COLL_VERSION && h->kind == WEFT__V1__COLL_KIND__COLL_DATA &&
        h->op != WEFT__V1__COLL_OP__COLL_OP_P2P) {
        pthread_mutex_lock(&ctx->mu);
        for (coll_slot_t *s = ctx->slots; s != NULL; s = s->next) {
            if (s->g->id != h->group || s->d->seq != h->seq || s->step != h->step ||
                (uint32_t)s->src != h->src) {
                continue;
            }
            if (atomic_load(&s->state) == COLL_SLOT_POSTED && s->g->world[s->src] == src_world &&
                dtype == s->dtype && numel >= 0 && (uint64_t)numel == s->count &&
                same_op(s->g, s->d, h, false, why, sizeof(why))) {
                atomic_store(&s->state, COLL_SLOT_CLAIMED);
                l->dst = s->dst;
                l->sink = s->kern != NULL ? slot_sink : NULL;
                l->done = slot_done;
                l->arg = s;
                taken = true;
            }
            break;
        }
        pthread_mutex_unlock(&ctx->mu);
    }
    weft_msg_header_free(&h->base);
    return taken;
}

void coll__slot_post(coll_group_t *g, const coll_desc_t *d, coll_slot_t *s, uint32_t step, int src,
                     void *dst, size_t count, weft_dtype_t dtype, const coll_kern_t *kern,
                     weft_reduce_op_t rop)
{
    coll_ctx_t *ctx = g->ctx;

    s->g = g;
    s->d = d;
    s->step = step;
    s->src = src;
    s->dst = dst;
    s->count = count;
    s->dtype = dtype;
    s->rop = rop;
    s->kern = kern;
    atomic_store(&s->state, COLL_SLOT_POSTED);
    pthread_mutex_lock(&ctx->mu);
    s->next = ctx->slots;
    ctx->slots = s;
    pthread_mutex_unlock(&ctx->mu);
}

bool coll__slot_landed(const coll_slot_t *s)
{
    return atomic_load(&s->state) == COLL_SLOT_LANDED;
}

void coll__slot_end(coll_group_t *g, coll_slot_t *s)
{
    coll_ctx_t *ctx = g->ctx;

    if (atomic_load(&s->state) == COLL_SLOT_IDLE) {
        return;
    }
    pthread_mutex_lock(&ctx->mu);
    /* The reader is writing into it: it finishes, or its connection breaks (a lost
     * peer's connections are cut). */
    while (atomic_load(&s->state) == COLL_SLOT_CLAIMED) {
        pthread_cond_wait(&ctx->cv, &ctx->mu);
    }
    for (coll_slot_t **pp = &ctx->slots; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == s) {
            *pp = s->next;
            break;
        }
    }
    pthread_mutex_unlock(&ctx->mu);
    s->next = NULL;
    atomic_store(&s->state, COLL_SLOT_IDLE);
}

/* With ctx->mu held: whether operation @p d was aborted (its status), else WEFT_OK. */
static weft_status_t aborted_locked(coll_group_t *g, const coll_desc_t *d)
{
    for (coll_abort_t *x = g->ctx->aborts; x != NULL; x = x->next) {
        if (x->group == g->id && x->seq == d->seq) {
            return weft__set_error(x->status, "%s", x->why);
        }
    }
    return WEFT_OK;
}

/* With ctx->mu held: whether waiting on for operation @p d (for group rank @p src, -1: any) is
 * pointless: a piece of it shows a differing view (*mismatch_p: the caller tells the others;
 * the text is in @p why), a member was lost, or its deadline passed. */
static weft_status_t stuck_locked(coll_group_t *g, const coll_desc_t *d, int src,
                                  int64_t deadline_ns, char *why, size_t n, bool *mismatch_p)
{
    coll_ctx_t *ctx = g->ctx;

    *mismatch_p = false;
    /* Any piece of this operation, whatever its step or sender, can show a differing
     * view: checked while waiting, so that a wrong root is caught rather than waited
     * out (the pieces we wait for may never come). */
    for (coll_msg_t *o = ctx->msgs; o != NULL; o = o->next) {
        const Weft__V1__CollHeader *h = o->hdr;
        if (h->group == g->id && h->seq == d->seq && h->op != WEFT__V1__COLL_OP__COLL_OP_P2P &&
            !same_op(g, d, h, true, why, n)) {
            *mismatch_p = true;
            return weft__set_error(WEFT_ERR_MISMATCH, "%s", why);
        }
    }
    for (int r = 0; r < g->size; r++) {
        int w = g->world[r];
        if (ctx->lost[w]) {
            return weft__set_error(
                WEFT_ERR_PEER_LOST, "%s: group rank %d (world rank %d) was lost: %s",
                coll__kind_name(d->kind), r, w, ctx->why[w] != NULL ? ctx->why[w] : "");
        }
    }
    if (weft__now_ns() >= deadline_ns) {
        if (src < 0) {
            return weft__set_error(WEFT_ERR_TIMEOUT,
                                   "%s: waited for the members past the deadline (operation "
                                   "%llu of group %u)",
                                   coll__kind_name(d->kind), (unsigned long long)d->seq, g->id);
        }
        return weft__set_error(WEFT_ERR_TIMEOUT,
                               "%s: waited for group rank %d past the deadline (operation %llu "
                               "of group %u)",
                               coll__kind_name(d->kind), src, (unsigned long long)d->seq, g->id);
    }
    return WEFT_OK;
}

/* A receiver polls this long (taking its pieces from the shared-memory rings, yielding the core
 * between looks) before it sleeps: a piece usually follows within tens of microseconds, and a
 * wake-up across cores, or behind other ranks on few cores, costs more. */
#define COLL_SPIN_NS 10000000

static weft_status_t recv_wait(coll_group_t *g, const coll_desc_t *d, uint32_t step, int src,
                               int64_t deadline_ns, coll_msg_t **m_p, bool *hooked_p)
{
    coll_ctx_t *ctx = g->ctx;
    weft_status_t st = WEFT_OK;
    char why[700];
    int spins = 0;
    int64_t spin_until = 0;
    bool mismatch = false;

    pthread_mutex_lock(&ctx->mu);
    for (;;) {
        st = aborted_locked(g, d);
        if (st != WEFT_OK) {
            goto out;
        }
        coll_msg_t **pp = &ctx->msgs;
        for (; *pp != NULL; pp = &(*pp)->next) {
            const Weft__V1__CollHeader *h = (*pp)->hdr;
            if (h->group == g->id && h->seq == d->seq && h->step == step &&
                h->src == (uint32_t)src && h->op != WEFT__V1__COLL_OP__COLL_OP_P2P &&
                sent_by(g, h->src, (*pp)->src_world)) {
                break;
            }
        }
        if (*pp != NULL) {
            coll_msg_t *m = *pp;
            *pp = m->next;
            m->next = NULL;
            pthread_mutex_unlock(&ctx->mu);
            if (!same_op(g, d, m->hdr, false, why, sizeof(why))) {
                coll__msg_free(m);
                coll__abort(g, d->seq, WEFT_ERR_MISMATCH, why);
                return weft__set_error(WEFT_ERR_MISMATCH, "%s", why);
            }
            *m_p = m;
            return WEFT_OK;
        }
        st = stuck_locked(g, d, src, deadline_ns, why, sizeof(why), &mismatch);
        if (st != WEFT_OK) {
            pthread_mutex_unlock(&ctx->mu);
            if (mismatch) {
                coll__abort(g, d->seq, WEFT_ERR_MISMATCH, why);
                st = weft__set_error(WEFT_ERR_MISMATCH, "%s", why);
            }
            return st;
        }
        int64_t now = weft__now_ns();
        if (spins == 0) {
            spin_until = now + COLL_SPIN_NS;
        }
        if (now < spin_until) {
            spins++;
            pthread_mutex_unlock(&ctx->mu);
            /* Pieces from ranks of this host: taken from their rings on this thread. */
            if (weft_agent_poll_channel(ctx->agent, WEFT_CHANNEL_COLLECTIVES) == 0) {
                sched_yield();
            }
            pthread_mutex_lock(&ctx->mu);
            continue;
        }
        int64_t wake = deadline_ns < now + 200000000LL ? deadline_ns : now + 200000000LL;
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        int64_t abs = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec + (wake - now);
        ts.tv_sec = abs / 1000000000LL;
        ts.tv_nsec = abs % 1000000000LL;
        if (!*hooked_p) {
            /* About to sleep: a thread that reads a shared-memory ring hands it over first (the
             * pieces may be in it), a transport thread gets company. Then the checks again:
             * a piece may have come meanwhile. */
            *hooked_p = true;
            pthread_mutex_unlock(&ctx->mu);
            weft__blocking(1);
            pthread_mutex_lock(&ctx->mu);
            continue;
        }
        pthread_cond_timedwait(&ctx->cv, &ctx->mu, &ts);
    }
out:
    pthread_mutex_unlock(&ctx->mu);
    return st;
}

weft_status_t coll__recv(coll_group_t *g, const coll_desc_t *d, uint32_t step, int src,
                         int64_t deadline_ns, coll_msg_t **m_p)
{
    bool hooked = false;
    weft_status_t st = recv_wait(g, d, step, src, deadline_ns, m_p, &hooked);
    if (hooked) {
        char why[WEFT__ERROR_MAX];
        snprintf(why, sizeof(why), "%s", st != WEFT_OK ? weft_last_error() : "");
        weft__blocking(0);
        if (st != WEFT_OK) {
            weft__set_error(st, "%s", why); /* the hook may have set another */
        }
    }
    return st;
}

weft_status_t coll__check(coll_group_t *g, const coll_desc_t *d, int64_t deadline_ns)
{
    char why[700];
    bool mismatch = false;

    pthread_mutex_lock(&g->ctx->mu);
    weft_status_t st = aborted_locked(g, d);
    if (st == WEFT_OK) {
        st = stuck_locked(g, d, -1, deadline_ns, why, sizeof(why), &mismatch);
    }
    pthread_mutex_unlock(&g->ctx->mu);
    if (st != WEFT_OK && mismatch) {
        coll__abort(g, d->seq, WEFT_ERR_MISMATCH, why);
        st = weft__set_error(WEFT_ERR_MISMATCH, "%s", why);
    }
    return st;
}

weft_status_t coll__check_view(coll_group_t *g, const coll_desc_t *d, const coll_desc_t *theirs,
                               uint64_t hash, int src)
{
    Weft__V1__CollHeader h = WEFT__V1__COLL_HEADER__INIT;
    char why[700];

    h.group = g->id;
    h.group_hash = hash;
    h.seq = theirs->seq;
    h.src = (uint32_t)src;
    h.op = (Weft__V1__CollOp)theirs->kind;
    h.dtype = (int32_t)theirs->dtype;
    h.reduce_op = (int32_t)theirs->rop;
    h.root = theirs->root;
    h.count = theirs->count;
    if (same_op(g, d, &h, false, why, sizeof(why))) {
        return WEFT_OK;
    }
    coll__abort(g, d->seq, WEFT_ERR_MISMATCH, why);
    return weft__set_error(WEFT_ERR_MISMATCH, "%s", why);
}

/* Waits until the transport has let go of the sent pieces @p rel (and releases them). An
 * operation may not end while the transport still reads its buffers, deadline or not: one
 * still held at the deadline makes it fail with WEFT_ERR_TIMEOUT, once let go (a stalled
 * write ends when written, or when its connection fails). */
weft_status_t coll__wait_released(weft_future_t **rel, size_t n, int64_t deadline_ns)
{
    weft_status_t st = WEFT_OK;
    for (size_t i = 0; i < n; i++) {
        if (rel[i] == NULL) {
            continue;
        }
        int64_t left = (deadline_ns - weft__now_ns()) / 1000000;
        weft_status_t s = left > 0                   ? weft_future_wait(rel[i], left)
                          : weft_future_done(rel[i]) ? weft_future_status(rel[i])
                                                     : WEFT_ERR_TIMEOUT;
        if (s != WEFT_OK) {
            (void)weft_future_wait(rel[i], -1);
            if (st == WEFT_OK) {
                st = weft__set_error(WEFT_ERR_TIMEOUT, "the transport did not release a sent "
                                                       "buffer before the deadline");
            }
        }
        weft_future_release(rel[i]);
        rel[i] = NULL;
    }
    return st;
}

/* Copies a received piece into @p dst after checking its size and dtype. */
weft_status_t coll__take_piece(coll_msg_t *m, void *dst, size_t count, weft_dtype_t dtype, int src)
{
    weft_tensor_t *t = coll__msg_tensor(m);
    size_t nb = count * weft_dtype_size(dtype);
    if (count == 0) {
        return WEFT_OK;
    }
    if (t == NULL || weft_tensor_dtype(t) != dtype || (size_t)weft_tensor_numel(t) != count) {
        return weft__set_error(WEFT_ERR_PROTOCOL,
                               "collectives: group rank %d sent a piece of the wrong size", src);
    }
    memcpy(dst, weft_tensor_data(t), nb);
    return WEFT_OK;
}

/* ------------------------------------------------------------ point to point */

weft_status_t coll__p2p_send(coll_group_t *g, const weft_tensor_t *t, int dst, int tag,
                             weft_future_t **f_p)
{
    Weft__V1__CollHeader h = WEFT__V1__COLL_HEADER__INIT;
    weft_future_t *rel = NULL;

    h.version = COLL_VERSION;
    h.kind = WEFT__V1__COLL_KIND__COLL_DATA;
    h.group = g->id;
    h.group_hash = g->hash;
    h.src = (uint32_t)g->rank;
    h.op = WEFT__V1__COLL_OP__COLL_OP_P2P;
    h.dtype = (int32_t)weft_tensor_dtype(t);
    h.count = (uint64_t)weft_tensor_numel(t);
    h.tag = tag;
    WEFT_CHECK(send_header(g, dst, &h, weft_tensor_data(t), (size_t)weft_tensor_numel(t),
                           weft_tensor_dtype(t), &rel));
    /* The send is done when the transport no longer reads the tensor's bytes. */
    *f_p = rel;
    return WEFT_OK;
}

weft_status_t coll__p2p_recv(coll_group_t *g, weft_tensor_t *t, int src, int tag,
                             weft_future_t **f_p)
{
    coll_ctx_t *ctx = g->ctx;
    coll_precv_t *p = weft_calloc(1, sizeof(*p));
    weft_future_t *f;

    if (p == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "recv: no memory");
    }
    weft_status_t st = weft_future_create(&f);
    if (st != WEFT_OK) {
        weft_free(p);
        return st;
    }
    p->group = g->id;
    p->src = src;
    p->tag = tag;
    p->dst = weft_tensor_retain(t);
    p->f = weft_future_retain(f);
    p->g = g;
    int64_t timeout_ms = atomic_load(&g->timeout_ms);
    pthread_mutex_lock(&ctx->mu);
    if (src != WEFT_ANY_SOURCE && ctx->lost[g->world[src]]) {
        pthread_mutex_unlock(&ctx->mu);
        precv_free(p);
        weft_future_release(f);
        return weft__set_error(WEFT_ERR_PEER_LOST, "recv: group rank %d was lost", src);
    }
    /* A message that came before the receive was posted: the oldest match. */
    coll_msg_t **pp = &ctx->msgs;
    for (; *pp != NULL; pp = &(*pp)->next) {
        if (p2p_matches(p, *pp)) {
            break;
        }
    }
    if (*pp != NULL) {
        coll_msg_t *m = *pp;
        *pp = m->next;
        pthread_mutex_unlock(&ctx->mu);
        deliver_p2p(p, m);
        *f_p = f;
        return WEFT_OK;
    }
    coll_precv_t **tail = &ctx->precvs;
    while (*tail != NULL) {
        tail = &(*tail)->next;
    }
    *tail = p;
    /* Its deadline, on the agent's timer: armed under ctx->mu, so that the task, which
     * looks the receive up under it, finds it posted even if it runs at once. */
    p->id = ++ctx->next_precv;
    atomic_fetch_add(&deadlines_armed, 1);
    p->timer = weft_agent_timer_add(ctx->agent, timeout_ms * 1000, precv_deadline,
                                    precv_deadline_dropped, ctx, p->id, ctx);
    if (p->timer == 0) {
        /* Not queued (the agent is closing, or no memory): a receive without a deadline
         * could wait forever, so it is not posted. */
        *tail = NULL;
        pthread_mutex_unlock(&ctx->mu);
        precv_free(p);
        weft_future_release(f);
        return weft__set_error(WEFT_ERR_SHUTDOWN, "recv: its deadline could not be set (the "
                                                  "agent is closing?)");
    }
    pthread_mutex_unlock(&ctx->mu);
    *f_p = f;
    return WEFT_OK;
}

void coll__ctx_add_group(coll_ctx_t *ctx, coll_group_t *g)
{
    pthread_mutex_lock(&ctx->mu);
    g->gnext = ctx->groups;
    ctx->groups = g;
    pthread_mutex_unlock(&ctx->mu);
}

/* Takes the pieces of group @p g (of operation @p seq only, unless @p all) out of the
 * mailbox into *drop_p, and its aborts likewise. Called with ctx->mu. */
static void take_pieces(coll_ctx_t *ctx, const coll_group_t *g, uint64_t seq, bool all,
                        coll_msg_t **drop_p, coll_abort_t **xdrop_p)
{
    coll_msg_t **pp = &ctx->msgs;
    while (*pp != NULL) {
        coll_msg_t *m = *pp;
        if (m->hdr->group == g->id && (all || m->hdr->seq == seq) &&
            m->hdr->op != WEFT__V1__COLL_OP__COLL_OP_P2P) {
            *pp = m->next;
            m->next = *drop_p;
            *drop_p = m;
        } else {
            pp = &m->next;
        }
    }
    coll_abort_t **xp = &ctx->aborts;
    while (*xp != NULL) {
        coll_abort_t *x = *xp;
        if (x->group == g->id && (all || x->seq == seq)) {
            *xp = x->next;
            x->next = *xdrop_p;
            *xdrop_p = x;
        } else {
            xp = &x->next;
        }
    }
}

static void free_pieces(coll_msg_t *drop, coll_abort_t *xdrop)
{
    while (drop != NULL) {
        coll_msg_t *next = drop->next;
        coll__msg_free(drop);
        drop = next;
    }
    while (xdrop != NULL) {
        coll_abort_t *next = xdrop->next;
        weft_free(xdrop->why);
        weft_free(xdrop);
        xdrop = next;
    }
}

void coll__ctx_drop_group(coll_ctx_t *ctx, coll_group_t *g)
{
    coll_precv_t *fail = NULL;
    coll_msg_t *drop = NULL;
    coll_abort_t *xdrop = NULL;

    pthread_mutex_lock(&ctx->mu);
    for (coll_group_t **gp = &ctx->groups; *gp != NULL; gp = &(*gp)->gnext) {
        if (*gp == g) {
            *gp = g->gnext;
            break;
        }
    }
    /* Another group with its id (the world made again) keeps what is its. */
    bool id_taken = false;
    for (coll_group_t *o = ctx->groups; o != NULL; o = o->gnext) {
        id_taken = id_taken || o->id == g->id;
    }
    if (!id_taken && g->rank >= 0) {
        take_pieces(ctx, g, 0, true, &drop, &xdrop);
    }
    coll_precv_t **pp = &ctx->precvs;
    while (*pp != NULL) {
        coll_precv_t *p = *pp;
        if (p->g == g) {
            *pp = p->next;
            p->next = fail;
            fail = p;
        } else {
            pp = &p->next;
        }
    }
    pthread_mutex_unlock(&ctx->mu);
    free_pieces(drop, xdrop);
    while (fail != NULL) {
        coll_precv_t *next = fail->next;
        precv_disarm(ctx, fail);
        weft_future_fail(fail->f, WEFT_ERR_INVALID_STATE, "recv: its group was freed");
        precv_free(fail);
        fail = next;
    }
}

void coll__seq_done(coll_group_t *g, uint64_t seq)
{
    coll_ctx_t *ctx = g->ctx;
    coll_msg_t *drop = NULL;
    coll_abort_t *xdrop = NULL;

    pthread_mutex_lock(&ctx->mu);
    if (seq == g->done_below) {
        g->done_below++;
        /* Refused calls finished out of order may follow. */
        for (size_t i = 0; i < g->ndone_extra;) {
            if (g->done_extra[i] == g->done_below) {
                g->done_extra[i] = g->done_extra[--g->ndone_extra];
                g->done_below++;
                i = 0;
            } else {
                i++;
            }
        }
    } else if (seq > g->done_below) {
        if (g->ndone_extra == g->done_cap) {
            size_t cap = g->done_cap == 0 ? 8 : 2 * g->done_cap;
            uint64_t *n = weft_alloc(cap * sizeof(*n));
            if (n != NULL) {
                if (g->ndone_extra > 0) {
                    memcpy(n, g->done_extra, g->ndone_extra * sizeof(*n));
                }
                weft_free(g->done_extra);
                g->done_extra = n;
                g->done_cap = cap;
            }
        }
        if (g->ndone_extra < g->done_cap) {
            g->done_extra[g->ndone_extra++] = seq;
        }
    }
    take_pieces(ctx, g, seq, false, &drop, &xdrop);
    uint64_t below = g->done_below;
    pthread_mutex_unlock(&ctx->mu);
    free_pieces(drop, xdrop);
    /* Every operation below is over, refused ones too: the members' oneshot slots they held may
     * be rewritten (a refused call never reaches oneshot's own exit). */
    if (below > 0) {
        coll__oneshot_finished(g, below - 1);
    }
}

size_t coll__mailbox_count(const weft_pg_t *pg)
{
    coll_group_t *g = pg->g;
    coll_ctx_t *ctx = g->ctx;
    size_t n = 0;

    pthread_mutex_lock(&g->mu);
    uint64_t issued = g->next_seq;
    pthread_mutex_unlock(&g->mu);
    pthread_mutex_lock(&ctx->mu);
    for (const coll_msg_t *m = ctx->msgs; m != NULL; m = m->next) {
        n += m->hdr->group == g->id && m->hdr->op != WEFT__V1__COLL_OP__COLL_OP_P2P &&
             m->hdr->seq < issued;
    }
    for (const coll_abort_t *x = ctx->aborts; x != NULL; x = x->next) {
        n += x->group == g->id && x->seq < issued;
    }
    pthread_mutex_unlock(&ctx->mu);
    return n;
}
