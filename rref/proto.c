/* The rref module's messages: ids, and the control messages (FORK_REQUEST, CHILD_ACCEPT,
 * USER_DELETE and their ACKs) on channel WEFT_CHANNEL_RREF, retried until acked,
 * delayed and duplicated on request for tests. */
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* ------------------------------------------------------------------- ids */

void rref__id_to_pb(weft_rref_id_t id, Weft__V1__RRefId *pb)
{
    weft__v1__rref_id__init(pb);
    pb->worker = id.worker;
    pb->local = id.local;
}

bool rref__id_from_pb(const rref_ctx_t *ctx, const Weft__V1__RRefId *pb, weft_rref_id_t *id_p)
{
    if (pb == NULL || pb->worker < 0 || pb->worker >= ctx->world || pb->local == 0) {
        return false;
    }
    id_p->worker = pb->worker;
    id_p->local = pb->local;
    return true;
}

bool rref__id_eq(weft_rref_id_t x, weft_rref_id_t y)
{
    return x.worker == y.worker && x.local == y.local;
}

/* ------------------------------------------------------ control messages */

/* A control message held back by fault injection (a timer task; data: the rank it goes to). */
typedef struct {
    rref_ctx_t *ctx;
    weft_value_t *v;
} delayed_send_t;

static void delayed_drop(void *arg, uint64_t to)
{
    delayed_send_t *d = arg;
    (void)to;
    weft_value_free(d->v);
    weft_free(d);
}

static void delayed_run(void *arg, uint64_t to)
{
    delayed_send_t *d = arg;
    rref_ctx_t *ctx = d->ctx;
    pthread_mutex_lock(&ctx->mu);
    bool dead = ctx->dead;
    pthread_mutex_unlock(&ctx->mu);
    if (!dead && weft_agent_send(ctx->a, (int)to, WEFT_CHANNEL_RREF, d->v, NULL) != WEFT_OK) {
        WEFT_DEBUG("rref: control message to rank %d not sent: %s", (int)to, weft_last_error());
    }
    delayed_drop(d, to);
}

/* Sends one packed control message to @p to: now, or (fault injection) after a random delay, and
 * twice when duplication is on. */
static void transmit(rref_ctx_t *ctx, int to, const Weft__V1__RRefControl *m)
{
    size_t len = weft__v1__rref_control__get_packed_size(m);
    uint8_t *buf = weft_alloc(len > 0 ? len : 1);
    weft_value_t *v = NULL;

    if (buf == NULL || weft_value_create(&v) != WEFT_OK) {
        weft_free(buf);
        WEFT_ERROR("rref: no memory for a control message to rank %d", to);
        return;
    }
    weft__v1__rref_control__pack(m, buf);
    if (weft_value_take_payload(v, buf, len) != WEFT_OK) {
        weft_free(buf);
        weft_value_free(v);
        WEFT_ERROR("rref: no memory for a control message to rank %d", to);
        return;
    }
    int copies = ctx->fault_dup ? 2 : 1;
    for (int i = 0; i < copies; i++) {
        if (ctx->fault_delay_us > 0) {
            delayed_send_t *d = weft_alloc(sizeof(*d));
            weft_value_t *c = NULL;
            if (d == NULL || rref__value_copy(v, &c) != WEFT_OK) {
                weft_free(d);
                continue;
            }
            d->ctx = ctx;
            d->v = c;
            (void)weft_agent_timer_add(ctx->a, rref__fault_delay(ctx), delayed_run, delayed_drop, d,
                                       (uint64_t)to, ctx);
        } else if (weft_agent_send(ctx->a, to, WEFT_CHANNEL_RREF, v, NULL) != WEFT_OK) {
            WEFT_DEBUG("rref: control message to rank %d not sent: %s", to, weft_last_error());
        }
    }
    weft_value_free(v);
}

static void ctl_fill(const rref_ctl_t *c, Weft__V1__RRefControl *m, Weft__V1__RRefId *id,
                     Weft__V1__RRefId *fork)
{
    weft__v1__rref_control__init(m);
    m->kind = c->kind;
    m->msg_id = c->msg_id;
    rref__id_to_pb(c->id, id);
    rref__id_to_pb(c->fork, fork);
    m->rref_id = id;
    m->fork_id = fork;
}

static void retry_run(void *arg, uint64_t gen);

/* Arms the retry of @p c after @p delay_ms, cut to its deadline (when the task then fails it); the
 * task armed before is cancelled, and would not act anyway (its gen is old). ctx->mu held. */
static void ctl_arm_locked(rref_ctx_t *ctx, rref_ctl_t *c, int64_t delay_ms)
{
    int64_t left = c->deadline_ms - weft__now_ms();
    if (delay_ms > left) {
        delay_ms = left > 0 ? left : 0;
    }
    if (c->task != 0) {
        (void)weft_agent_timer_cancel(ctx->a, c->task);
    }
    c->gen = ++ctx->next_gen;
    /* 0 (no memory for the task): no retry, and no deadline either; shutdown bounds the wait. */
    c->task = weft_agent_timer_add(ctx->a, delay_ms * 1000, retry_run, NULL, ctx, c->gen, ctx);
}

/* Takes *pp out of the list of control messages in flight; its retry will not run. */
static rref_ctl_t *ctl_unlink_locked(rref_ctx_t *ctx, rref_ctl_t **pp)
{
    rref_ctl_t *c = *pp;
    *pp = c->next;
    ctx->nctls--;
    rref__settle_signal_locked(ctx);
    if (c->task != 0) {
        (void)weft_agent_timer_cancel(ctx->a, c->task);
        c->task = 0;
    }
    return c;
}

static rref_ctl_t *ctl_take_locked(rref_ctx_t *ctx, uint64_t msg_id, int from)
{
    for (rref_ctl_t **pp = &ctx->ctls; *pp != NULL; pp = &(*pp)->next) {
        rref_ctl_t *c = *pp;
        if (c->msg_id == msg_id && (from < 0 || c->to == from)) {
            return ctl_unlink_locked(ctx, pp);
        }
    }
    return NULL;
}

static rref_ctl_t *ctl_find_locked(rref_ctx_t *ctx, uint64_t msg_id)
{
    for (rref_ctl_t *c = ctx->ctls; c != NULL; c = c->next) {
        if (c->msg_id == msg_id) {
            return c;
        }
    }
    return NULL;
}

/* The message whose retry task @p gen is (none if it settled or was armed again since). */
static rref_ctl_t *ctl_find_gen_locked(rref_ctx_t *ctx, uint64_t gen)
{
    for (rref_ctl_t *c = ctx->ctls; c != NULL; c = c->next) {
        if (c->gen == gen) {
            return c;
        }
    }
    return NULL;
}

static void ctl_finish(rref_ctx_t *ctx, rref_ctl_t *c, weft_status_t st, const char *why)
{
    if (c->done != NULL) {
        c->done(ctx, st, why, c->arg);
    }
    weft_free(c);
}

/* The retry task of a control message (a timer task; data: its gen): sends it again, or fails it
 * at its deadline. */
static void retry_run(void *arg, uint64_t gen)
{
    rref_ctx_t *ctx = arg;
    Weft__V1__RRefControl m;
    Weft__V1__RRefId id, fork;

    pthread_mutex_lock(&ctx->mu);
    rref_ctl_t *c = ctx->dead ? NULL : ctl_find_gen_locked(ctx, gen);
    if (c == NULL) {
        pthread_mutex_unlock(&ctx->mu);
        return;
    }
    c->task = 0; /* this one, running */
    if (weft__now_ms() >= c->deadline_ms) {
        c = ctl_take_locked(ctx, c->msg_id, -1);
        pthread_mutex_unlock(&ctx->mu);
        char why[256];
        snprintf(why, sizeof(why),
                 "rref: control message %d to %s (rank %d) was not acknowledged "
                 "within %lld ms",
                 (int)c->kind, rref__worker_name(ctx, c->to), c->to,
                 (long long)ctx->ctl_timeout_ms);
        WEFT_WARN("%s", why);
        ctl_finish(ctx, c, WEFT_ERR_TIMEOUT, why);
        return;
    }
    ctl_fill(c, &m, &id, &fork);
    int to = c->to;
    c->retry_ms = c->retry_ms * 2 < RREF_RETRY_MAX_MS ? c->retry_ms * 2 : RREF_RETRY_MAX_MS;
    ctl_arm_locked(ctx, c, c->retry_ms);
    pthread_mutex_unlock(&ctx->mu);
    transmit(ctx, to, &m);
}

void rref__ctl_send(rref_ctx_t *ctx, Weft__V1__RRefMsgKind kind, int to, weft_rref_id_t id,
                    weft_rref_id_t fork, rref_ctl_done_cb_t done, void *arg)
{
    rref_ctl_t *c = weft_calloc(1, sizeof(*c));
    Weft__V1__RRefControl m;
    Weft__V1__RRefId pid, pfork;

    if (c == NULL) {
        WEFT_ERROR("rref: no memory for a control message to rank %d", to);
        if (done != NULL) {
            done(ctx, WEFT_ERR_NO_MEMORY, "rref: no memory for a control message", arg);
        }
        return;
    }
    c->kind = kind;
    c->to = to;
    c->id = id;
    c->fork = fork;
    c->done = done;
    c->arg = arg;
    c->deadline_ms = weft__now_ms() + ctx->ctl_timeout_ms;
    c->retry_ms = RREF_RETRY_FIRST_MS;
    c->backoff_ms = RREF_BACKOFF_MS;
    pthread_mutex_lock(&ctx->mu);
    if (ctx->dead || to < 0 || to >= ctx->world || ctx->lost[to]) {
        bool dead = ctx->dead;
        pthread_mutex_unlock(&ctx->mu);
        ctl_finish(ctx, c, dead ? WEFT_ERR_SHUTDOWN : WEFT_ERR_PEER_LOST,
                   dead ? "rref: the agent was closed" : "rref: the peer was lost");
        return;
    }
    c->msg_id = ctx->next_msg++;
    c->next = ctx->ctls;
    ctx->ctls = c;
    ctx->nctls++;
    ctl_fill(c, &m, &pid, &pfork);
    ctl_arm_locked(ctx, c, c->retry_ms);
    pthread_mutex_unlock(&ctx->mu);
    transmit(ctx, to, &m);
}

void rref__ctl_fail_rank(rref_ctx_t *ctx, int rank, weft_status_t st, const char *why)
{
    rref_ctl_t *list = NULL;

    pthread_mutex_lock(&ctx->mu);
    for (rref_ctl_t **pp = &ctx->ctls; *pp != NULL;) {
        rref_ctl_t *c = *pp;
        if (rank < 0 || c->to == rank) {
            ctl_unlink_locked(ctx, pp);
            c->next = list;
            list = c;
        } else {
            pp = &c->next;
        }
    }
    pthread_mutex_unlock(&ctx->mu);
    while (list != NULL) {
        rref_ctl_t *c = list;
        list = c->next;
        ctl_finish(ctx, c, st, why);
    }
}

/* An ACK from @p src for our message @p msg_id. */
static void on_ack(rref_ctx_t *ctx, int src, uint64_t msg_id, weft_status_t st, const char *error)
{
    pthread_mutex_lock(&ctx->mu);
    rref_ctl_t *c = ctl_find_locked(ctx, msg_id);
    if (c == NULL || c->to != src) {
        /* A duplicate, or the answer to a message already settled. */
        pthread_mutex_unlock(&ctx->mu);
        return;
    }
    if (st == WEFT_ERR_PENDING) {
        /* The receiver does not know the reference yet (its creation is on the way): again,
         * after a while, until the deadline. */
        int64_t wait = c->backoff_ms;
        c->backoff_ms = wait * 2 < RREF_BACKOFF_MAX_MS ? wait * 2 : RREF_BACKOFF_MAX_MS;
        if (weft__now_ms() + wait >= c->deadline_ms) {
            c = ctl_take_locked(ctx, msg_id, src);
            pthread_mutex_unlock(&ctx->mu);
            char why[256];
            snprintf(why, sizeof(why),
                     "rref: %s (rank %d) did not come to know reference (%d,%llu) within %lld ms",
                     rref__worker_name(ctx, src), src, c->id.worker,
                     (unsigned long long)c->id.local, (long long)ctx->ctl_timeout_ms);
            ctl_finish(ctx, c, WEFT_ERR_TIMEOUT, why);
            return;
        }
        /* Sent again after the backoff by the retry task, from which the periodic retries
         * restart. */
        ctl_arm_locked(ctx, c, wait);
        pthread_mutex_unlock(&ctx->mu);
        return;
    }
    c = ctl_take_locked(ctx, msg_id, src);
    pthread_mutex_unlock(&ctx->mu);
    ctl_finish(ctx, c, st, error);
}

static void send_ack(rref_ctx_t *ctx, int to, uint64_t msg_id, weft_status_t st, const char *why)
{
    Weft__V1__RRefControl m;

    weft__v1__rref_control__init(&m);
    m.kind = WEFT__V1__RREF_MSG_KIND__RREF_ACK;
    m.msg_id = msg_id;
    m.status = st;
    m.error = (char *)(why != NULL ? why : "");
    transmit(ctx, to, &m);
}

void rref__on_message(void *state, int src, weft_value_t *msg)
{
    rref_ctx_t *ctx = state;
    size_t len = 0;
    const uint8_t *p = weft_value_payload(msg, &len);
    weft_rref_id_t id = {0, 0}, fork = {0, 0};
    char why[512] = "";
    weft_status_t st;

    Weft__V1__RRefControl *m =
        p != NULL ? weft__v1__rref_control__unpack(&weft__pb_allocator, len, p) : NULL;
    weft_value_free(msg);
    if (m == NULL) {
        WEFT_WARN("rref: unreadable control message from rank %d dropped", src);
        return;
    }
    if (src < 0 || src >= ctx->world) {
        goto out;
    }
    if (m->kind == WEFT__V1__RREF_MSG_KIND__RREF_ACK) {
        weft_status_t ast =
            weft_status_valid(m->status) ? (weft_status_t)m->status : WEFT_ERR_PROTOCOL;
        on_ack(ctx, src, m->msg_id, ast, m->error);
        goto out;
    }
    if (m->msg_id == 0) {
        WEFT_WARN("rref: control message of kind %d without an id from rank %d dropped",
                  (int)m->kind, src);
        goto out;
    }
    bool ids_ok =
        rref__id_from_pb(ctx, m->rref_id, &id) && rref__id_from_pb(ctx, m->fork_id, &fork);
    switch (m->kind) {
    case WEFT__V1__RREF_MSG_KIND__RREF_FORK_REQUEST:
        st = ids_ok ? rref__on_fork_request(ctx, src, id, fork, why, sizeof(why))
                    : WEFT_ERR_PROTOCOL;
        break;
    case WEFT__V1__RREF_MSG_KIND__RREF_CHILD_ACCEPT:
        st = ids_ok ? rref__on_child_accept(ctx, src, fork) : WEFT_ERR_PROTOCOL;
        break;
    case WEFT__V1__RREF_MSG_KIND__RREF_USER_DELETE:
        st = ids_ok ? rref__on_user_delete(ctx, src, id, fork) : WEFT_ERR_PROTOCOL;
        break;
    default:
        st = WEFT_ERR_PROTOCOL;
        snprintf(why, sizeof(why), "rref: unknown control message kind %d", (int)m->kind);
        break;
    }
    if (st == WEFT_ERR_PROTOCOL) {
        if (why[0] == '\0') {
            snprintf(why, sizeof(why), "rref: control message with missing or bad ids");
        }
        WEFT_WARN("%s (from rank %d)", why, src);
    }
    if (st == WEFT_ERR_PEER_LOST) {
        goto out; /* from a rank declared lost: not answered */
    }
    send_ack(ctx, src, m->msg_id, st, why);
out:
    weft__v1__rref_control__free_unpacked(m, &weft__pb_allocator);
}
