/* Creating references (remote, remote_object, remote_method, create) and using them (to_here,
 * local_value, method calls), with the owner's RPC handlers weft.rref.remote, weft.rref.fetch and
 * weft.rref.method. */
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* --------------------------------------------------------------- helpers */

weft_status_t rref__value_copy(const weft_value_t *v, weft_value_t **copy_p)
{
    weft_status_t st;
    weft_value_t *c;
    size_t len = 0;
    const void *p = v != NULL ? weft_value_payload(v, &len) : NULL;

    WEFT_CHECK(weft_value_create(&c));
    if (p != NULL && len > 0) {
        WEFT_CHECK_GOTO(weft_value_set_payload(c, p, len), st, err_free_copy);
    }
    for (size_t i = 0; v != NULL && i < weft_value_num_tensors(v); i++) {
        WEFT_CHECK_GOTO(weft_value_add_tensor(c, weft_value_tensor(v, i)), st, err_free_copy);
    }
    for (size_t i = 0; v != NULL && i < weft_value_num_refs(v); i++) {
        const weft_value_ref_type_t *type;
        void *obj = weft__value_ref_at(v, i, &type);
        WEFT_CHECK_GOTO(weft_value_add_ref(c, type, obj), st, err_free_copy);
    }
    *copy_p = c;
    return WEFT_OK;

err_free_copy:
    weft_value_free(c);
    return st;
}

/* The header of a call of an owner function (weft_msg_pack's frame), its names checked.
 * WEFT_ERR_PROTOCOL when it has none, it does not decode or a name is too long. */
static weft_status_t call_header(const weft_value_t *v, Weft__V1__RRefCall **hdr_p)
{
    ProtobufCMessage *m = NULL;

    WEFT_CHECK(weft_msg_unpack(v, &weft__v1__rref_call__descriptor, &m, NULL));
    Weft__V1__RRefCall *hdr = (Weft__V1__RRefCall *)m;
    if (strlen(hdr->name) > RREF_MAX_NAME || strlen(hdr->type) > RREF_MAX_NAME) {
        weft_msg_header_free(m);
        return weft__set_error(WEFT_ERR_PROTOCOL, "rref: name in a call header over %d bytes",
                               RREF_MAX_NAME);
    }
    *hdr_p = hdr;
    return WEFT_OK;
}

/* The length of a deadline given as a timeout_ms argument (already checked): 0 is the agent's
 * default call timeout; at most RREF_MAX_TIMEOUT_MS. */
static int64_t timeout_resolve(const rref_ctx_t *ctx, int64_t timeout_ms)
{
    if (timeout_ms == 0) {
        timeout_ms = ctx->ctl_timeout_ms;
    }
    return timeout_ms < RREF_MAX_TIMEOUT_MS ? timeout_ms : RREF_MAX_TIMEOUT_MS;
}

/* Checks a timeout_ms argument of @p what: a negative one is refused. */
static weft_status_t timeout_check(int64_t timeout_ms, const char *what)
{
    if (timeout_ms < 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "%s: a timeout of %lld ms (0 means the agent's default call "
                               "timeout; a deadline cannot be infinite)",
                               what, (long long)timeout_ms);
    }
    return WEFT_OK;
}

static weft_status_t check_ref(const weft_rref_t *r, const char *what)
{
    if (r == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: NULL reference", what);
    }
    return WEFT_OK;
}

static bool ctx_dead(rref_ctx_t *ctx)
{
    pthread_mutex_lock(&ctx->mu);
    bool dead = ctx->dead;
    pthread_mutex_unlock(&ctx->mu);
    return dead;
}

/* ------------------------------------------------------ owner: creation */

/* The creating call of owner entry @p arg ended. */
static void creation_done(weft_future_t *f, void *arg)
{
    weft_rref_t *e = arg;
    weft_status_t st = weft_future_status(f);
    weft_value_t *v = NULL;

    if (st == WEFT_OK) {
        (void)weft_future_take_value(f, &v);
        if (v == NULL && weft_value_create(&v) != WEFT_OK) {
            st = WEFT_ERR_NO_MEMORY;
        }
        rref__owner_set(e, st, st == WEFT_OK ? NULL : "rref: no memory for the value", v, NULL);
    } else {
        rref__owner_set(e, st, weft_future_error(f), NULL, NULL);
    }
    weft_future_release(f);
    weft_rref_release(e); /* the creation's hold */
}

/*
 * Starts the creation of owner entry @p e (which holds one reference for it, released when the
 * creation ends): runs function @p name, constructs an object of type @p name, or calls method
 * @p name of @p target, with @p args (taken).
 */
static void owner_create(rref_ctx_t *ctx, weft_rref_t *e, Weft__V1__RRefCreateKind kind,
                         const char *name, weft_rref_id_t target, weft_value_t *args,
                         int64_t timeout_ms)
{
    weft_status_t st = WEFT_OK;
    weft_future_t *f = NULL;

    if (timeout_ms <= 0) {
        weft_value_free(args);
        rref__owner_set(e, WEFT_ERR_TIMEOUT, "the caller's deadline passed before the creation ran",
                        NULL, NULL);
        weft_rref_release(e);
        return;
    }
    switch (kind) {
    case WEFT__V1__RREF_CREATE_KIND__RREF_CREATE_FUNCTION:
        /* In-process: the owner keeps the very value the function returned. */
        st = weft_rpc_call_local(ctx->a, name, args, timeout_ms, &f);
        if (st == WEFT_OK) {
            args = NULL; /* taken */
        }
        break;
    case WEFT__V1__RREF_CREATE_KIND__RREF_CREATE_METHOD: {
        Weft__V1__RRefCall hdr = WEFT__V1__RREF_CALL__INIT;
        Weft__V1__RRefId pt;
        weft_value_t *v = NULL;
        rref__id_to_pb(target, &pt);
        hdr.rref_id = &pt;
        hdr.name = (char *)name;
        st = weft_msg_pack(&hdr.base, args, &v);
        if (st == WEFT_OK) {
            st = weft_rpc_call_local(ctx->a, RREF_FN_METHOD, v, timeout_ms, &f);
            if (st == WEFT_OK) {
                v = NULL; /* taken */
            }
        }
        weft_value_free(v);
        break;
    }
    case WEFT__V1__RREF_CREATE_KIND__RREF_CREATE_OBJECT: {
        const rref_type_t *t = rref__type_find(ctx, name);
        void *obj = NULL;
        if (t == NULL) {
            char why[512];
            snprintf(why, sizeof(why), "no rref type '%s' is registered on %s", name,
                     rref__worker_name(ctx, ctx->rank));
            weft_value_free(args);
            rref__owner_set(e, WEFT_ERR_NOT_FOUND, why, NULL, NULL);
            weft_rref_release(e);
            return;
        }
        st = t->ctor(args, t->arg, &obj);
        weft_value_free(args);
        if (st != WEFT_OK) {
            char why[WEFT__ERROR_MAX];
            snprintf(why, sizeof(why), "the constructor of '%s' failed on %s: %s", name,
                     rref__worker_name(ctx, ctx->rank), weft_last_error());
            rref__owner_set(e, st, why, NULL, NULL);
        } else {
            e->rtype = t;
            rref__owner_set(e, WEFT_OK, NULL, NULL, obj);
        }
        weft_rref_release(e);
        return;
    }
    default:
        st = weft__set_error(WEFT_ERR_PROTOCOL, "rref: unknown creation kind %d", (int)kind);
        break;
    }
    weft_value_free(args);
    if (st != WEFT_OK) {
        char why[WEFT__ERROR_MAX];
        snprintf(why, sizeof(why), "%s", weft_last_error());
        rref__owner_set(e, st, why, NULL, NULL);
        weft_rref_release(e);
        return;
    }
    if (weft_future_then(f, creation_done, e) != WEFT_OK) {
        rref__owner_set(e, WEFT_ERR_NO_MEMORY, "rref: no memory", NULL, NULL);
        weft_future_release(f);
        weft_rref_release(e);
    }
}

/* A new owner entry in the map, with one reference (for the caller). */
static weft_status_t owner_new(rref_ctx_t *ctx, weft_rref_id_t id, const char *type,
                               const char *created_by, weft_rref_t **e_p)
{
    weft_rref_t *e = rref__alloc(ctx, RREF_OWNER, id, ctx->rank, type, created_by);

    if (e == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rref: no memory for a reference");
    }
    pthread_mutex_lock(&ctx->mu);
    if (ctx->dead) {
        pthread_mutex_unlock(&ctx->mu);
        e->refs = 0;
        rref__free(e);
        return weft__set_error(WEFT_ERR_SHUTDOWN, "rref: the agent is closed");
    }
    rref__owner_insert_locked(ctx, e);
    pthread_mutex_unlock(&ctx->mu);
    *e_p = e;
    return WEFT_OK;
}

weft_status_t weft_rref_create(weft_agent_t *a, weft_value_t *value, weft_rref_t **rref_p)
{
    rref_ctx_t *ctx = NULL;
    weft_rref_t *e;

    if (value == NULL || rref_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "rref_create: NULL value or rref_p");
    }
    WEFT_CHECK(rref__ctx(a, &ctx));
    WEFT_CHECK(owner_new(ctx, rref__new_id(ctx), NULL, "weft_rref_create", &e));
    rref__owner_set(e, WEFT_OK, NULL, value, NULL);
    *rref_p = e;
    return WEFT_OK;
}

/* ----------------------------------------------------- operations (user) */

typedef enum {
    OP_FETCH,
    OP_METHOD,
    OP_REMOTE,
} op_kind_t;

/*
 * An operation on a reference: waits for the reference to be usable, then calls its owner; or,
 * pipelined, calls the owner at once when this worker's remote() made the reference and its
 * creation is still on the way (the call follows the creation request), watching the creation's
 * outcome at the same time.
 */
typedef struct {
    rref_ctx_t *ctx;
    op_kind_t kind;
    weft_rref_t *r;     /* the target (held), or NULL */
    weft_rref_t *u;     /* OP_REMOTE: the new user reference (its pending hold is the op's) */
    weft_future_t *out; /* OP_FETCH, OP_METHOD: the caller's future (held) */
    weft_value_t *msg;  /* the call to send */
    int to;
    const char *fn;
    char *what; /* the function, type or method (for texts) */
    int64_t deadline_ms;
    uint64_t ag_context; /* the caller's distributed autograd context: the call carries it */
    /* pipelined (every field under ctx->mu after the start) */
    bool pipelined;
    int holds;       /* callbacks still to run: the call's answer, the creation's outcome */
    int ready_state; /* the creation's outcome seen: 0 not yet, 1 success, -1 failure */
    bool deferred;   /* a failed answer (dst, dtext) waits for the creation's outcome */
    bool resent;     /* the call was sent again (at most once) */
    weft_status_t dst;
    char *dtext;
} op_t;

static void op_free(op_t *op)
{
    weft_rref_release(op->r);
    weft_future_release(op->out);
    weft_value_free(op->msg);
    weft_free(op->what);
    weft_free(op->dtext);
    weft_free(op);
}

/* One of the callbacks of @p op is over: frees it after the last one (a pipelined op has two). */
static void op_done(op_t *op)
{
    if (op->pipelined) {
        pthread_mutex_lock(&op->ctx->mu);
        bool last = --op->holds == 0;
        pthread_mutex_unlock(&op->ctx->mu);
        if (!last) {
            return;
        }
    }
    op_free(op);
}

static void op_fail(op_t *op, weft_status_t st, const char *text)
{
    if (st == WEFT_ERR_PEER_LOST && op->r != NULL && op->to == op->r->owner) {
        /* The owner is gone (its loss may be reported here before the listener runs). */
        pthread_mutex_lock(&op->ctx->mu);
        op->r->owner_lost = op->r->role == RREF_USER;
        pthread_mutex_unlock(&op->ctx->mu);
        st = WEFT_ERR_OWNER_LOST;
    }
    if (op->kind == OP_REMOTE) {
        char why[WEFT__ERROR_MAX + 256];
        snprintf(why, sizeof(why), "rref (%d,%llu): creation by '%s' on %s failed: %s",
                 op->u->id.worker, (unsigned long long)op->u->id.local, op->what,
                 rref__worker_name(op->ctx, op->to), text);
        /* The owner may hold the fork: after a timeout, or when its answer could not be sent. */
        bool maybe = st == WEFT_ERR_TIMEOUT || st == WEFT_ERR_TOO_LARGE;
        if (st == WEFT_ERR_PEER_LOST) {
            st = WEFT_ERR_OWNER_LOST;
        }
        rref__user_settle(op->u, false, maybe, st, why);
    } else {
        weft_future_complete(op->out, st, text, NULL);
    }
    op_done(op);
}

static void op_send(op_t *op);

/* The deadline of an operation's future (a timer task that holds the future). */
static void deadline_run(void *arg, uint64_t data)
{
    (void)data;
    weft_future_fail(arg, WEFT_ERR_TIMEOUT, "rref: the operation passed its deadline");
    weft_future_release(arg);
}

static void deadline_drop(void *arg, uint64_t data)
{
    (void)data;
    weft_future_release(arg);
}

/* Bounds the wait of @p op for its target, which may outlast the op's own deadline. */
static void op_deadline_arm(op_t *op)
{
    int64_t left = op->deadline_ms - weft__now_ms();
    (void)weft_agent_timer_add(op->ctx->a, (left > 0 ? left : 0) * 1000, deadline_run,
                               deadline_drop, weft_future_retain(op->out), 0, op->ctx);
}

/*
 * The pipelined call of @p op failed with @p st (not a timeout nor a lost owner): the owner may not
 * have had the creation yet (WEFT_ERR_PENDING), or the creation failed there. Decided with the
 * creation's outcome here, so that a failed creation reports its own status and text. True when
 * handled (the call's hold is dropped or passed on).
 */
static bool op_pipelined_failed(op_t *op, weft_status_t st, const char *text)
{
    rref_ctx_t *ctx = op->ctx;
    bool defer = false, resend = false;

    pthread_mutex_lock(&ctx->mu);
    int seen = op->ready_state;
    if (seen == 0) {
        /* The creation's answer is still on the way: its outcome decides. */
        char *copy = weft_strdup(text != NULL ? text : "");
        if (copy != NULL) {
            op->deferred = true;
            op->dst = st;
            op->dtext = copy;
            defer = true;
        }
    } else if (seen > 0 && st == WEFT_ERR_PENDING && op->kind == OP_FETCH && !op->resent) {
        /* Answers overtook each other: the owner has it now. A fetch can be sent again. */
        op->resent = true;
        resend = true;
    }
    pthread_mutex_unlock(&ctx->mu);
    if (defer) {
        op_deadline_arm(op);
        op_done(op);
        return true;
    }
    if (seen < 0) {
        op_done(op); /* the creation's failure was reported */
        return true;
    }
    if (resend) {
        op_send(op);
        return true;
    }
    return false;
}

/* Pipelined: the creation of the target ended (its answer reached this worker). */
static void op_creation_seen(weft_future_t *f, void *arg)
{
    op_t *op = arg;
    rref_ctx_t *ctx = op->ctx;
    weft_status_t st = weft_future_status(f);
    bool resend = false;

    pthread_mutex_lock(&ctx->mu);
    op->ready_state = st == WEFT_OK ? 1 : -1;
    bool deferred = op->deferred;
    op->deferred = false;
    if (deferred && st == WEFT_OK && op->dst == WEFT_ERR_PENDING && !op->resent) {
        op->resent = true;
        resend = true;
    }
    pthread_mutex_unlock(&ctx->mu);
    if (st != WEFT_OK) {
        /* First use reports the creation's failure (the call's answer, if any, is dropped). */
        weft_future_complete(op->out, st, weft_future_error(f), NULL);
    } else if (resend) {
        /* The owner had not got the creation when the call came: send it again (the hold
         * passes to the new call). */
        op_send(op);
        return;
    } else if (deferred) {
        weft_future_complete(op->out, op->dst, op->dtext, NULL);
    }
    op_done(op);
}

/*
 * Reads the answer @p v of weft.rref.remote for @p op (NULL if unreadable). When the answer
 * carries the value, a copy goes to the new reference for the uses waiting for the answer.
 */
static Weft__V1__RRefCreated *created_unpack(op_t *op, const weft_value_t *v)
{
    ProtobufCMessage *m = NULL;

    if (!op->u->eager_asked ||
        weft_msg_unpack(v, &weft__v1__rref_created__descriptor, &m, NULL) != WEFT_OK) {
        /* Not asked, or an owner that does not know eager_max: the header alone. */
        size_t len = 0;
        const void *p = weft_value_payload(v, &len);
        /* An empty payload is a valid (all default: success) answer. */
        return weft__v1__rref_created__unpack(&weft__pb_allocator, p != NULL ? len : 0,
                                              p != NULL ? p : (const void *)"");
    }
    Weft__V1__RRefCreated *c = (Weft__V1__RRefCreated *)m;
    if (!c->has_value || c->status != WEFT_OK || weft_value_num_refs(v) > 0) {
        return c; /* a value with references is not taken: uses fetch it */
    }
    weft_value_t *val = NULL;
    if (weft_msg_body(v, &val) != WEFT_OK) {
        return c; /* uses fetch it */
    }
    pthread_mutex_lock(&op->ctx->mu);
    weft_value_t *old = op->u->eager;
    op->u->eager = val;
    pthread_mutex_unlock(&op->ctx->mu);
    weft_value_free(old);
    return c;
}

/* The owner answered. */
static void op_rpc_done(weft_future_t *f, void *arg)
{
    op_t *op = arg;
    weft_status_t st = weft_future_status(f);
    char text[WEFT__ERROR_MAX];

    snprintf(text, sizeof(text), "%s", weft_future_error(f));
    if (st == WEFT_ERR_PEER_LOST && op->r != NULL && op->to == op->r->owner) {
        char why[WEFT__ERROR_MAX + 128];
        snprintf(why, sizeof(why), "rref (%d,%llu): owner %s (rank %d) was lost: %s",
                 op->r->id.worker, (unsigned long long)op->r->id.local,
                 rref__worker_name(op->ctx, op->to), op->to, text);
        weft_future_release(f);
        op_fail(op, WEFT_ERR_OWNER_LOST, why);
        return;
    }
    if (st != WEFT_OK) {
        weft_future_release(f);
        if (op->pipelined && st != WEFT_ERR_TIMEOUT && op_pipelined_failed(op, st, text)) {
            return;
        }
        op_fail(op, st, text);
        return;
    }
    if (op->kind == OP_REMOTE) {
        Weft__V1__RRefCreated *c = created_unpack(op, weft_future_value(f));
        weft_future_release(f);
        if (c == NULL) {
            /* The owner has it (it answered), but the answer is unreadable. */
            rref__user_settle(op->u, true, false, WEFT_ERR_PROTOCOL,
                              "rref: unreadable answer of weft.rref.remote");
        } else {
            weft_status_t cst =
                weft_status_valid(c->status) ? (weft_status_t)c->status : WEFT_ERR_REMOTE;
            char why[WEFT__ERROR_MAX + 256];
            snprintf(why, sizeof(why), "rref (%d,%llu): creation by '%s' on %s failed: %s",
                     op->u->id.worker, (unsigned long long)op->u->id.local, op->what,
                     rref__worker_name(op->ctx, op->to),
                     c->error[0] != '\0' ? c->error : weft_strerror(cst));
            weft_msg_header_free(&c->base);
            rref__user_settle(op->u, true, false, cst, cst == WEFT_OK ? NULL : why);
        }
        op_free(op);
        return;
    }
    weft_value_t *v = NULL;
    (void)weft_future_take_value(f, &v);
    weft_future_release(f);
    weft_future_complete(op->out, WEFT_OK, NULL, v);
    op_done(op);
}

static void op_send(op_t *op)
{
    weft_future_t *f;
    int64_t left = op->deadline_ms - weft__now_ms();

    if (left <= 0) {
        op_fail(op, WEFT_ERR_TIMEOUT, "rref: the deadline passed before the call was sent");
        return;
    }
    /* Sent from whichever thread gets here (a target's readiness, a retry): in the caller's
     * context all the same. */
    uint64_t prev = weft_rpc_set_thread_context(op->ag_context);
    weft_status_t st = weft_rpc_async(op->ctx->a, op->to, op->fn, op->msg, left, &f);
    weft_rpc_set_thread_context(prev);
    if (st != WEFT_OK) {
        char why[WEFT__ERROR_MAX];
        snprintf(why, sizeof(why), "%s", weft_last_error());
        op_fail(op, st, why);
        return;
    }
    if (weft_future_then(f, op_rpc_done, op) != WEFT_OK) {
        /* The call goes on; its answer is dropped. */
        weft_future_release(f);
        op_fail(op, WEFT_ERR_NO_MEMORY, "rref: no memory");
    }
}

/* An operation held back by fault injection (a timer task that holds the operation): sent, or
 * failed when the task is dropped (which releases what the operation holds). */
static void op_send_run(void *arg, uint64_t data)
{
    (void)data;
    op_send(arg);
}

static void op_send_drop(void *arg, uint64_t data)
{
    (void)data;
    op_fail(arg, WEFT_ERR_SHUTDOWN, "rref: the agent was closed");
}

/* The target is usable (or failed). */
static void op_target_ready(weft_future_t *f, void *arg)
{
    op_t *op = arg;
    weft_rref_t *r = op->r;

    if (f != NULL && weft_future_status(f) != WEFT_OK) {
        op_fail(op, weft_future_status(f), weft_future_error(f));
        return;
    }
    if (r != NULL) {
        pthread_mutex_lock(&op->ctx->mu);
        bool lost = r->owner_lost;
        pthread_mutex_unlock(&op->ctx->mu);
        if (lost) {
            char why[256];
            snprintf(why, sizeof(why), "rref (%d,%llu): its owner %s (rank %d) was lost",
                     r->id.worker, (unsigned long long)r->id.local,
                     rref__worker_name(op->ctx, r->owner), r->owner);
            op_fail(op, WEFT_ERR_OWNER_LOST, why);
            return;
        }
    }
    if (op->kind == OP_FETCH && r != NULL && r->role == RREF_OWNER) {
        weft_value_t *v = NULL;
        weft_status_t st = rref__value_copy(r->value, &v);
        if (st != WEFT_OK) {
            op_fail(op, st, weft_last_error());
            return;
        }
        weft_future_complete(op->out, WEFT_OK, NULL, v);
        op_done(op);
        return;
    }
    int64_t delay = op->kind == OP_REMOTE ? rref__fault_delay(op->ctx) : 0;
    if (delay > 0) {
        /* Fault injection: calls that carry forks are delayed like control messages. */
        (void)weft_agent_timer_add(op->ctx->a, delay, op_send_run, op_send_drop, op, 0, op->ctx);
    } else {
        op_send(op);
    }
}

/* A to_here issued before the creation's answer, which may carry the value: takes it, or
 * fetches once the answer came without it (or another use took it). */
static void op_eager_ready(weft_future_t *f, void *arg)
{
    op_t *op = arg;
    weft_value_t *v = NULL;

    if (weft_future_status(f) == WEFT_OK) {
        /* The first use takes it; others fetch (each result has tensors of its own). */
        pthread_mutex_lock(&op->ctx->mu);
        v = op->r->eager;
        op->r->eager = NULL;
        pthread_mutex_unlock(&op->ctx->mu);
    }
    if (v == NULL) {
        op_target_ready(f, op);
        return;
    }
    weft_future_complete(op->out, WEFT_OK, NULL, v);
    op_done(op);
}

/* Starts @p op: at once, pipelined behind the creation of its target, or once the target is
 * usable. */
static void op_start(op_t *op)
{
    weft_rref_t *r = op->r;

    if (op->out != NULL && op->kind == OP_FETCH && r != NULL && r->role == RREF_USER &&
        r->created_here && !weft_future_done(r->ready)) {
        pthread_mutex_lock(&op->ctx->mu);
        bool forked = r->forked;
        pthread_mutex_unlock(&op->ctx->mu);
        if (r->eager_asked && !forked) {
            /* The creation's answer may carry the value: no fetch unless it does not. Nothing
             * changed the value since its creation: no other worker has heard of it yet. The
             * creating call's own deadline ends the wait unless this one's ends first. */
            if (op->deadline_ms < r->create_deadline_ms) {
                op_deadline_arm(op);
            }
            if (weft_future_then(r->ready, op_eager_ready, op) != WEFT_OK) {
                op_fail(op, WEFT_ERR_NO_MEMORY, "rref: no memory");
            }
            return;
        }
        /* This worker sent the creation: the owner gets this fetch after it (or answers
         * WEFT_ERR_PENDING and the fetch goes again once the creation's answer is here). No timer:
         * the call carries the deadline. Only fetches are pipelined: they can be sent twice
         * safely, while a method that answered WEFT_ERR_PENDING itself must not run again. */
        op->pipelined = true;
        op->holds = 2;
        if (weft_future_then(r->ready, op_creation_seen, op) != WEFT_OK) {
            op->pipelined = false;
            op_fail(op, WEFT_ERR_NO_MEMORY, "rref: no memory");
            return;
        }
        pthread_mutex_lock(&op->ctx->mu);
        bool failed = op->ready_state < 0;
        pthread_mutex_unlock(&op->ctx->mu);
        if (failed) {
            op_done(op); /* reported already */
            return;
        }
        op_target_ready(NULL, op);
        return;
    }
    if (op->out != NULL && r != NULL && !weft_future_done(r->ready)) {
        /* Waiting for the target may outlast the call's own deadline: a timer bounds it. */
        op_deadline_arm(op);
    }
    if (r != NULL && weft_future_done(r->ready)) {
        /* At once: a callback added now would queue behind the ones the ready future may still
         * be running, one of which may be the caller itself (a handler that got this reference
         * in its arguments runs from the fork's readiness and waits for this operation). */
        op_target_ready(r->ready, op);
        return;
    }
    if (r != NULL) {
        if (weft_future_then(op->r->ready, op_target_ready, op) != WEFT_OK) {
            op_fail(op, WEFT_ERR_NO_MEMORY, "rref: no memory");
        }
        return;
    }
    op_target_ready(NULL, op);
}

static weft_status_t op_new(rref_ctx_t *ctx, op_kind_t kind, weft_rref_t *target, int to,
                            const char *fn, const char *what, int64_t timeout_ms, op_t **op_p)
{
    op_t *op = weft_calloc(1, sizeof(*op));

    if (op == NULL || (op->what = weft_strdup(what != NULL ? what : "")) == NULL) {
        weft_free(op);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rref: no memory for an operation");
    }
    op->ctx = ctx;
    op->kind = kind;
    op->r = weft_rref_retain(target);
    op->to = to;
    op->fn = fn;
    op->deadline_ms = weft__now_ms() + timeout_resolve(ctx, timeout_ms);
    op->ag_context = weft_rpc_thread_context();
    *op_p = op;
    return WEFT_OK;
}

/* ------------------------------------------------------------- creation */

/* @p want capped so that an answer with a value of that size fits @p rank's message limit. */
static uint64_t eager_limit(rref_ctx_t *ctx, int rank, uint64_t want)
{
    uint64_t limit = weft_agent_max_message_bytes(ctx->a, rank);

    if (limit == 0) {
        return want;
    }
    if (limit <= RREF_EAGER_MARGIN) {
        return 0;
    }
    return want < limit - RREF_EAGER_MARGIN ? want : limit - RREF_EAGER_MARGIN;
}

/* remote, remote_object, remote_method: @p target is the object for a method, else NULL. */
static weft_status_t remote_common(weft_agent_t *a, int to, Weft__V1__RRefCreateKind kind,
                                   const char *name, weft_rref_t *target, const weft_value_t *args,
                                   int64_t timeout_ms, weft_rref_t **rref_p)
{
    rref_ctx_t *ctx = NULL;
    weft_status_t st;
    const char *type = NULL;

    if (rref_p == NULL || name == NULL || name[0] == '\0' || strlen(name) > RREF_MAX_NAME) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "rref_remote: a name of 1..%d bytes and rref_p are needed",
                               RREF_MAX_NAME);
    }
    WEFT_CHECK(timeout_check(timeout_ms, "rref_remote"));
    WEFT_CHECK(rref__ctx(a, &ctx));
    if (to < 0 || to >= ctx->world) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "rref_remote: rank %d is not in the world of %d", to, ctx->world);
    }
    if (ctx_dead(ctx)) {
        return weft__set_error(WEFT_ERR_SHUTDOWN, "rref_remote: the agent is closed");
    }
    if (kind == WEFT__V1__RREF_CREATE_KIND__RREF_CREATE_OBJECT) {
        type = name;
    }
    weft_rref_id_t id = rref__new_id(ctx);
    weft_rref_id_t target_id = target != NULL ? target->id : (weft_rref_id_t){0, 0};
    timeout_ms = timeout_resolve(ctx, timeout_ms);

    if (to == ctx->rank) {
        /* This worker owns the result: no protocol, a local creation. */
        weft_rref_t *e;
        weft_value_t *copy = NULL;
        if (args != NULL) {
            WEFT_CHECK(rref__value_copy(args, &copy));
        }
        st = owner_new(ctx, id, type, name, &e);
        if (st != WEFT_OK) {
            weft_value_free(copy);
            return st;
        }
        weft_rref_retain(e); /* the creation's hold */
        owner_create(ctx, e, kind, name, target_id, copy, timeout_ms);
        *rref_p = e;
        return WEFT_OK;
    }

    weft_rref_t *u = rref__alloc(ctx, RREF_USER, id, to, type, name);
    if (u == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rref_remote: no memory");
    }
    u->fork = rref__new_id(ctx);
    u->parent = ctx->rank;

    Weft__V1__RRefCall hdr = WEFT__V1__RREF_CALL__INIT;
    Weft__V1__RRefId pid, pfork, ptarget;
    rref__id_to_pb(id, &pid);
    rref__id_to_pb(u->fork, &pfork);
    hdr.rref_id = &pid;
    hdr.fork_id = &pfork;
    hdr.create = kind;
    hdr.name = (char *)name;
    hdr.type = (char *)(type != NULL ? type : "");
    if (target != NULL) {
        rref__id_to_pb(target_id, &ptarget);
        hdr.target = &ptarget;
    }
    uint64_t eager_max = eager_limit(ctx, ctx->rank, (uint64_t)ctx->eager_max);
    if (type == NULL && eager_max > 0) {
        hdr.eager_max = eager_max;
        u->eager_asked = true;
    }
    op_t *op;
    st = op_new(ctx, OP_REMOTE, target, to, RREF_FN_REMOTE, name, timeout_ms, &op);
    if (st != WEFT_OK) {
        u->refs = 0;
        rref__free(u);
        return st;
    }
    st = weft_msg_pack(&hdr.base, args, &op->msg);
    if (st != WEFT_OK) {
        op_free(op);
        u->refs = 0;
        rref__free(u);
        return st;
    }
    pthread_mutex_lock(&ctx->mu);
    u->pending = true;
    u->created_here = true;
    u->refs++; /* the pending creation's hold, dropped when it ends */
    rref__user_insert_locked(ctx, u);
    pthread_mutex_unlock(&ctx->mu);
    /* A creation by a method may first wait for its target, unbounded by this deadline. */
    u->create_deadline_ms = target == NULL ? op->deadline_ms : INT64_MAX;
    op->u = u;
    *rref_p = u;
    op_start(op);
    return WEFT_OK;
}

weft_status_t weft_rref_remote(weft_agent_t *a, int to, const char *fn, const weft_value_t *args,
                               int64_t timeout_ms, weft_rref_t **rref_p)
{
    return remote_common(a, to, WEFT__V1__RREF_CREATE_KIND__RREF_CREATE_FUNCTION, fn, NULL, args,
                         timeout_ms, rref_p);
}

weft_status_t weft_rref_remote_object(weft_agent_t *a, int to, const char *type,
                                      const weft_value_t *args, int64_t timeout_ms,
                                      weft_rref_t **rref_p)
{
    return remote_common(a, to, WEFT__V1__RREF_CREATE_KIND__RREF_CREATE_OBJECT, type, NULL, args,
                         timeout_ms, rref_p);
}

weft_status_t weft_rref_remote_method(weft_rref_t *r, const char *method, const weft_value_t *args,
                                      int64_t timeout_ms, weft_rref_t **result_p)
{
    WEFT_CHECK(check_ref(r, "rref_remote_method"));
    return remote_common(r->ctx->a, r->owner, WEFT__V1__RREF_CREATE_KIND__RREF_CREATE_METHOD,
                         method, r, args, timeout_ms, result_p);
}

/* ------------------------------------------------------------------- use */

weft_status_t weft_rref_to_here_async(weft_rref_t *r, int64_t timeout_ms, weft_future_t **f_p)
{
    op_t *op;
    weft_status_t st;

    WEFT_CHECK(check_ref(r, "rref_to_here"));
    if (f_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "rref_to_here: NULL f_p");
    }
    WEFT_CHECK(timeout_check(timeout_ms, "rref_to_here"));
    rref_ctx_t *ctx = r->ctx;
    if (r->type != NULL) {
        return weft__set_error(WEFT_ERR_UNSUPPORTED,
                               "rref (%d,%llu) holds an object of type '%s': call its methods",
                               r->id.worker, (unsigned long long)r->id.local, r->type);
    }
    if (ctx_dead(ctx)) {
        return weft__set_error(WEFT_ERR_SHUTDOWN, "rref_to_here: the agent is closed");
    }
    WEFT_CHECK(op_new(ctx, OP_FETCH, r, r->owner, RREF_FN_FETCH, "to_here", timeout_ms, &op));
    st = weft_future_create(&op->out);
    if (st == WEFT_OK && r->role == RREF_USER) {
        Weft__V1__RRefCall hdr = WEFT__V1__RREF_CALL__INIT;
        Weft__V1__RRefId pid, pfork;
        rref__id_to_pb(r->id, &pid);
        hdr.rref_id = &pid;
        if (r->created_here) {
            /* May be pipelined behind the creation (see handler_target). */
            rref__id_to_pb(r->fork, &pfork);
            hdr.fork_id = &pfork;
        }
        st = weft_msg_pack(&hdr.base, NULL, &op->msg);
    }
    if (st != WEFT_OK) {
        op_free(op);
        return st;
    }
    weft_future_t *f = weft_future_retain(op->out);
    op_start(op);
    *f_p = f;
    return WEFT_OK;
}

/* Waits for @p f (which has its own deadline) and takes its value. Releases @p f. */
static weft_status_t wait_value(weft_future_t *f, int64_t timeout_ms, weft_value_t **value_p)
{
    weft_status_t st = weft_future_wait(f, timeout_ms + 2000);

    if (st == WEFT_ERR_TIMEOUT && !weft_future_done(f)) {
        st = weft__set_error(st, "rref: the operation passed its deadline");
    } else if (st != WEFT_OK) {
        st = weft__set_error(st, "%s", weft_future_error(f));
    } else {
        weft_value_t *v = NULL;
        (void)weft_future_take_value(f, &v);
        if (v == NULL) {
            st = weft_value_create(&v);
        }
        if (st == WEFT_OK && value_p != NULL) {
            *value_p = v;
        } else {
            weft_value_free(v);
        }
    }
    weft_future_release(f);
    return st;
}

weft_status_t weft_rref_to_here(weft_rref_t *r, int64_t timeout_ms, weft_value_t **value_p)
{
    weft_future_t *f;

    if (value_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "rref_to_here: NULL value_p");
    }
    WEFT_CHECK(weft_rref_to_here_async(r, timeout_ms, &f));
    return wait_value(f, timeout_resolve(r->ctx, timeout_ms), value_p);
}

/* Waits (owner only) for the creation of @p r. */
static weft_status_t wait_local(weft_rref_t *r, int64_t timeout_ms, const char *what)
{
    WEFT_CHECK(check_ref(r, what));
    WEFT_CHECK(timeout_check(timeout_ms, what));
    if (r->role != RREF_OWNER) {
        return weft__set_error(WEFT_ERR_INVALID_STATE,
                               "%s: rref (%d,%llu) is owned by %s (rank %d), not by this worker",
                               what, r->id.worker, (unsigned long long)r->id.local,
                               rref__worker_name(r->ctx, r->owner), r->owner);
    }
    weft_status_t st = weft_future_wait(r->ready, timeout_resolve(r->ctx, timeout_ms));
    if (st == WEFT_ERR_TIMEOUT && !weft_future_done(r->ready)) {
        return weft__set_error(st, "%s: rref (%d,%llu) is still being created by '%s'", what,
                               r->id.worker, (unsigned long long)r->id.local, r->created_by);
    }
    if (st != WEFT_OK) {
        return weft__set_error(st, "%s", weft_future_error(r->ready));
    }
    return WEFT_OK;
}

weft_status_t weft_rref_local_value(weft_rref_t *r, int64_t timeout_ms,
                                    const weft_value_t **value_p)
{
    if (value_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "rref_local_value: NULL value_p");
    }
    WEFT_CHECK(wait_local(r, timeout_ms, "rref_local_value"));
    if (r->value == NULL) {
        return weft__set_error(WEFT_ERR_UNSUPPORTED,
                               "rref_local_value: rref (%d,%llu) holds an object: use "
                               "weft_rref_local_object",
                               r->id.worker, (unsigned long long)r->id.local);
    }
    *value_p = r->value;
    return WEFT_OK;
}

weft_status_t weft_rref_local_object(weft_rref_t *r, int64_t timeout_ms, void **obj_p)
{
    if (obj_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "rref_local_object: NULL obj_p");
    }
    WEFT_CHECK(wait_local(r, timeout_ms, "rref_local_object"));
    if (r->obj == NULL) {
        return weft__set_error(WEFT_ERR_UNSUPPORTED,
                               "rref_local_object: rref (%d,%llu) holds a value: use "
                               "weft_rref_local_value",
                               r->id.worker, (unsigned long long)r->id.local);
    }
    *obj_p = r->obj;
    return WEFT_OK;
}

weft_status_t weft_rref_rpc_async(weft_rref_t *r, const char *method, const weft_value_t *args,
                                  int64_t timeout_ms, weft_future_t **f_p)
{
    op_t *op;
    weft_status_t st;

    WEFT_CHECK(check_ref(r, "rref_rpc"));
    if (f_p == NULL || method == NULL || method[0] == '\0' || strlen(method) > RREF_MAX_NAME) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "rref_rpc: a method name of 1..%d bytes and f_p are needed",
                               RREF_MAX_NAME);
    }
    WEFT_CHECK(timeout_check(timeout_ms, "rref_rpc"));
    rref_ctx_t *ctx = r->ctx;
    if (ctx_dead(ctx)) {
        return weft__set_error(WEFT_ERR_SHUTDOWN, "rref_rpc: the agent is closed");
    }
    WEFT_CHECK(op_new(ctx, OP_METHOD, r, r->owner, RREF_FN_METHOD, method, timeout_ms, &op));
    Weft__V1__RRefCall hdr = WEFT__V1__RREF_CALL__INIT;
    Weft__V1__RRefId pid, pfork;
    rref__id_to_pb(r->id, &pid);
    hdr.rref_id = &pid;
    hdr.name = (char *)method;
    if (r->role == RREF_USER && r->created_here) {
        /* May be pipelined behind the creation (see handler_target). */
        rref__id_to_pb(r->fork, &pfork);
        hdr.fork_id = &pfork;
    }
    st = weft_future_create(&op->out);
    if (st == WEFT_OK) {
        st = weft_msg_pack(&hdr.base, args, &op->msg);
    }
    if (st != WEFT_OK) {
        op_free(op);
        return st;
    }
    weft_future_t *f = weft_future_retain(op->out);
    op_start(op);
    *f_p = f;
    return WEFT_OK;
}

weft_status_t weft_rref_rpc_sync(weft_rref_t *r, const char *method, const weft_value_t *args,
                                 int64_t timeout_ms, weft_value_t **result_p)
{
    weft_future_t *f;

    WEFT_CHECK(weft_rref_rpc_async(r, method, args, timeout_ms, &f));
    return wait_value(f, timeout_resolve(r->ctx, timeout_ms), result_p);
}

/* -------------------------------------------------------------- identity */

weft_rref_id_t weft_rref_id(const weft_rref_t *r)
{
    weft_rref_id_t none = {-1, 0};
    return r != NULL ? r->id : none;
}

int weft_rref_owner(const weft_rref_t *r)
{
    return r != NULL ? r->owner : -1;
}

const char *weft_rref_owner_name(const weft_rref_t *r)
{
    return r != NULL ? weft_agent_worker_name(r->ctx->a, r->owner) : NULL;
}

int weft_rref_is_owner(const weft_rref_t *r)
{
    return r != NULL && r->role == RREF_OWNER;
}

int weft_rref_confirmed_by_owner(const weft_rref_t *r)
{
    if (r == NULL) {
        return 0;
    }
    if (r->role == RREF_OWNER) {
        return 1;
    }
    pthread_mutex_lock(&r->ctx->mu);
    int c = r->confirmed ? 1 : 0;
    pthread_mutex_unlock(&r->ctx->mu);
    return c;
}

weft_status_t weft_value_add_rref(weft_value_t *v, weft_rref_t *r)
{
    if (v == NULL || r == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "value_add_rref: NULL value or reference");
    }
    return weft_value_add_ref(v, &rref__ref_type, r);
}

weft_rref_t *weft_value_rref(const weft_value_t *v, size_t i)
{
    size_t n = v != NULL ? weft_value_num_refs(v) : 0;

    for (size_t k = 0; k < n; k++) {
        uint32_t kind = 0;
        void *obj = weft_value_ref(v, k, &kind);
        if (kind == WEFT_REF_KIND_RREF) {
            if (i == 0) {
                return obj;
            }
            i--;
        }
    }
    return NULL;
}

/* ------------------------------------------------------ owner: handlers */

/* The target of a fetch or method call, held; NULL (the call failed) if unknown. */
static weft_rref_t *handler_target(rref_ctx_t *ctx, weft_call_t *call, Weft__V1__RRefCall **hdr_p)
{
    Weft__V1__RRefCall *hdr = NULL;
    weft_rref_id_t id;

    if (call_header(weft_call_args(call), &hdr) != WEFT_OK) {
        weft_call_fail(call, WEFT_ERR_PROTOCOL, "%s", weft_last_error());
        return NULL;
    }
    if (!rref__id_from_pb(ctx, hdr->rref_id, &id)) {
        weft_msg_header_free(&hdr->base);
        weft_call_fail(call, WEFT_ERR_PROTOCOL, "rref: call without a valid reference id");
        return NULL;
    }
    /* A call of the reference's creator, sent before the creation's answer (its header names the
     * creator's fork), may overtake the creation: unknown means "not yet" unless it is gone. */
    int caller = weft_call_caller_rank(call);
    weft_rref_id_t fork;
    bool pipelined = hdr->fork_id != NULL && rref__id_from_pb(ctx, hdr->fork_id, &fork) &&
                     fork.worker == caller && id.worker == caller && caller != ctx->rank;
    pthread_mutex_lock(&ctx->mu);
    weft_rref_t *e = rref__owner_find_locked(ctx, id);
    bool may_come =
        e == NULL && pipelined && !ctx->lost[caller] && !ctx->dead && !rref__freed_locked(ctx, id);
    if (e != NULL) {
        e->refs++;
    }
    pthread_mutex_unlock(&ctx->mu);
    if (e == NULL) {
        weft_msg_header_free(&hdr->base);
        if (may_come) {
            weft_call_fail(call, WEFT_ERR_PENDING, "rref (%d,%llu) is not created on %s yet",
                           id.worker, (unsigned long long)id.local,
                           rref__worker_name(ctx, ctx->rank));
        } else {
            weft_call_fail(call, WEFT_ERR_NOT_FOUND, "rref (%d,%llu) is not known to its owner %s",
                           id.worker, (unsigned long long)id.local,
                           rref__worker_name(ctx, ctx->rank));
        }
        return NULL;
    }
    *hdr_p = hdr;
    return e;
}

typedef struct {
    weft_call_t *call;
    weft_rref_t *e;
    char *method;
    uint64_t eager_max; /* weft.rref.remote: RRefCall.eager_max */
} pending_call_t;

static pending_call_t *pending_call(weft_call_t *call, weft_rref_t *e, const char *method)
{
    pending_call_t *p = weft_calloc(1, sizeof(*p));
    if (p == NULL || (method != NULL && (p->method = weft_strdup(method)) == NULL)) {
        weft_free(p);
        return NULL;
    }
    p->call = call;
    p->e = e;
    return p;
}

static void fetch_ready(weft_future_t *f, void *arg)
{
    pending_call_t *p = arg;
    weft_rref_t *e = p->e;
    weft_status_t st = weft_future_status(f);

    if (st != WEFT_OK) {
        weft_call_fail(p->call, st, "%s", weft_future_error(f));
    } else if (e->value == NULL) {
        weft_call_fail(p->call, WEFT_ERR_UNSUPPORTED,
                       "rref (%d,%llu) holds an object of type '%s': call its methods",
                       e->id.worker, (unsigned long long)e->id.local,
                       e->type != NULL ? e->type : "?");
    } else {
        weft_value_t *v = NULL;
        st = rref__value_copy(e->value, &v);
        if (st != WEFT_OK) {
            weft_call_fail(p->call, st, "%s", weft_last_error());
        } else {
            atomic_fetch_add(&e->ctx->fetches_served, 1);
            weft_call_reply(p->call, v);
        }
    }
    weft_free(p);
    weft_rref_release(e);
}

void rref__handle_fetch(weft_call_t *call, void *arg)
{
    rref_ctx_t *ctx = arg;
    Weft__V1__RRefCall *hdr;
    weft_rref_t *e = handler_target(ctx, call, &hdr);

    if (e == NULL) {
        return;
    }
    weft_msg_header_free(&hdr->base);
    pending_call_t *p = pending_call(call, e, NULL);
    if (p == NULL || weft_future_then(e->ready, fetch_ready, p) != WEFT_OK) {
        weft_free(p);
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "rref: no memory");
        weft_rref_release(e);
    }
}

/* Puts the user arguments (the header stripped) back into @p call, so that the method reads them
 * with weft_call_args. */
static weft_status_t call_strip_header(weft_call_t *call)
{
    weft_value_t *in = weft_call_take_args(call);
    weft_value_t *args = NULL;
    weft_status_t st = weft_msg_body(in, &args);

    weft_value_free(in);
    if (st != WEFT_OK) {
        return st;
    }
    weft_call_set_args(call, args);
    return WEFT_OK;
}

static void method_ready(weft_future_t *f, void *arg)
{
    pending_call_t *p = arg;
    weft_rref_t *e = p->e;
    weft_status_t st = weft_future_status(f);
    const weft_rref_method_t *m = NULL;

    if (st != WEFT_OK) {
        weft_call_fail(p->call, st, "%s", weft_future_error(f));
        goto out;
    }
    if (e->obj == NULL || e->rtype == NULL) {
        weft_call_fail(p->call, WEFT_ERR_UNSUPPORTED,
                       "rref (%d,%llu) holds a value, not an object: it has no method '%s'",
                       e->id.worker, (unsigned long long)e->id.local, p->method);
        goto out;
    }
    for (int i = 0; i < e->rtype->n_methods; i++) {
        if (strcmp(e->rtype->methods[i].name, p->method) == 0) {
            m = &e->rtype->methods[i];
            break;
        }
    }
    if (m == NULL) {
        weft_call_fail(p->call, WEFT_ERR_NO_SUCH_FUNCTION, "rref type '%s' has no method '%s'",
                       e->rtype->name, p->method);
        goto out;
    }
    st = call_strip_header(p->call);
    if (st != WEFT_OK) {
        weft_call_fail(p->call, st, "%s", weft_last_error());
        goto out;
    }
    /* The entry is held while the method runs (its caller's reference keeps it after), in the
     * call's distributed autograd context whatever thread made the target ready. */
    uint64_t prev = weft_rpc_set_thread_context(weft_call_context(p->call));
    m->fn(e->obj, p->call, e->rtype->arg);
    weft_rpc_set_thread_context(prev);
out:
    weft_free(p->method);
    weft_free(p);
    weft_rref_release(e);
}

void rref__handle_method(weft_call_t *call, void *arg)
{
    rref_ctx_t *ctx = arg;
    Weft__V1__RRefCall *hdr;
    weft_rref_t *e = handler_target(ctx, call, &hdr);

    if (e == NULL) {
        return;
    }
    if (hdr->name[0] == '\0') {
        weft_msg_header_free(&hdr->base);
        weft_call_fail(call, WEFT_ERR_PROTOCOL, "rref: method call without a method name");
        weft_rref_release(e);
        return;
    }
    pending_call_t *p = pending_call(call, e, hdr->name);
    weft_msg_header_free(&hdr->base);
    if (p == NULL || weft_future_then(e->ready, method_ready, p) != WEFT_OK) {
        if (p != NULL) {
            weft_free(p->method);
        }
        weft_free(p);
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "rref: no memory");
        weft_rref_release(e);
    }
}

/* Whether value @p v goes in the creation's answer to a caller that takes up to @p max bytes. */
static bool eager_fits(const weft_value_t *v, uint64_t max)
{
    size_t len = 0;

    if (v == NULL || max == 0 || weft_value_num_refs(v) > 0) {
        return false;
    }
    (void)weft_value_payload(v, &len);
    uint64_t total = len;
    for (size_t i = 0; i < weft_value_num_tensors(v) && total <= max; i++) {
        total += weft_tensor_nbytes(weft_value_tensor(v, i));
    }
    return total <= max;
}

/* An answer of weft.rref.remote for a caller that did not send eager_max: @p c alone. */
static weft_status_t created_alone(const Weft__V1__RRefCreated *c, weft_value_t **v_p)
{
    size_t len = weft__v1__rref_created__get_packed_size(c);
    uint8_t *buf = weft_alloc(len > 0 ? len : 1);
    weft_value_t *v = NULL;

    if (buf == NULL || weft_value_create(&v) != WEFT_OK) {
        weft_free(buf);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rref: no memory");
    }
    weft__v1__rref_created__pack(c, buf);
    if (weft_value_take_payload(v, buf, len) != WEFT_OK) {
        weft_free(buf);
    }
    *v_p = v;
    return WEFT_OK;
}

/* The creation of a reference a remote caller asked for ended: tell it. */
static void created_ready(weft_future_t *f, void *arg)
{
    pending_call_t *p = arg;
    Weft__V1__RRefCreated c = WEFT__V1__RREF_CREATED__INIT;
    weft_value_t *v = NULL;
    weft_status_t st;

    c.status = weft_future_status(f);
    c.error = (char *)(c.status != WEFT_OK ? weft_future_error(f) : "");
    if (p->eager_max > 0) {
        /* A framed answer, with the value when it is small and plain. */
        const weft_value_t *val = c.status == WEFT_OK ? p->e->value : NULL;
        /* Not in a distributed autograd context: to_here then fetches the value, a call that
         * records its gradient's way back (an answer to remote() would record one that the
         * value may never use). */
        c.has_value =
            weft_call_context(p->call) == 0 &&
            eager_fits(val, eager_limit(p->e->ctx, weft_call_caller_rank(p->call), p->eager_max));
        if (c.has_value) {
            atomic_fetch_add(&p->e->ctx->values_sent_with_creation, 1);
        }
        st = weft_msg_pack(&c.base, c.has_value ? val : NULL, &v);
    } else {
        st = created_alone(&c, &v);
    }
    if (st != WEFT_OK) {
        weft_call_fail(p->call, st, "%s", weft_last_error());
    } else {
        weft_call_reply(p->call, v);
    }
    weft_rref_release(p->e);
    weft_free(p);
}

void rref__handle_remote(weft_call_t *call, void *arg)
{
    rref_ctx_t *ctx = arg;
    Weft__V1__RRefCall *hdr = NULL;
    weft_value_t *args = NULL;
    weft_rref_id_t id, fork, target = {0, 0};
    int caller = weft_call_caller_rank(call);
    weft_rref_t *e, *fresh = NULL;
    bool adopt = false;

    if (call_header(weft_call_args(call), &hdr) != WEFT_OK ||
        weft_msg_body(weft_call_args(call), &args) != WEFT_OK) {
        weft_msg_header_free(hdr != NULL ? &hdr->base : NULL);
        weft_call_fail(call, WEFT_ERR_PROTOCOL, "%s", weft_last_error());
        return;
    }
    Weft__V1__RRefCreateKind kind = hdr->create;
    if (!rref__id_from_pb(ctx, hdr->rref_id, &id) || !rref__id_from_pb(ctx, hdr->fork_id, &fork) ||
        id.worker != caller || fork.worker != caller || hdr->name[0] == '\0' ||
        kind < WEFT__V1__RREF_CREATE_KIND__RREF_CREATE_FUNCTION ||
        kind > WEFT__V1__RREF_CREATE_KIND__RREF_CREATE_METHOD ||
        (kind == WEFT__V1__RREF_CREATE_KIND__RREF_CREATE_METHOD &&
         !rref__id_from_pb(ctx, hdr->target, &target))) {
        weft_msg_header_free(&hdr->base);
        weft_value_free(args);
        weft_call_fail(call, WEFT_ERR_PROTOCOL,
                       "rref: remote creation with missing or bad ids, name or kind");
        return;
    }
    fresh = rref__alloc(ctx, RREF_OWNER, id, ctx->rank, hdr->type, hdr->name);
    if (fresh == NULL) {
        weft_msg_header_free(&hdr->base);
        weft_value_free(args);
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "rref: no memory for a reference");
        return;
    }
    pthread_mutex_lock(&ctx->mu);
    weft_status_t st = WEFT_OK;
    e = rref__owner_find_locked(ctx, id);
    if (ctx->dead || ctx->lost[caller]) {
        st = WEFT_ERR_SHUTDOWN;
    } else if (e == NULL && rref__freed_locked(ctx, id)) {
        st = WEFT_ERR_ALREADY_EXISTS;
    } else {
        if (e == NULL) {
            e = fresh; /* its one reference is the creation's hold */
            fresh = NULL;
            rref__owner_insert_locked(ctx, e);
        } else if (e->awaiting_creation) {
            /* The placeholder a call carrying it home made (its one reference is the creation's
             * hold): this creation fills it. */
            e->awaiting_creation = false;
            adopt = true;
        }
        /* A delete that overtook the creation leaves the caller's fork out. */
        if (!rref__orphan_take_locked(ctx, id, fork)) {
            rref__owner_add_fork_locked(ctx, e, fork, caller);
        }
        e->refs++; /* the answer's hold */
    }
    pthread_mutex_unlock(&ctx->mu);
    if (st != WEFT_OK) {
        weft_msg_header_free(&hdr->base);
        weft_value_free(args);
        if (fresh != NULL) {
            fresh->refs = 0;
            rref__free(fresh);
        }
        weft_call_fail(call, st, "rref (%d,%llu) cannot be created on %s", id.worker,
                       (unsigned long long)id.local, rref__worker_name(ctx, ctx->rank));
        return;
    }
    if (adopt) {
        fresh->refs = 0;
        rref__free(fresh);
        fresh = NULL;
    }
    if (fresh == NULL) {
        owner_create(ctx, e, kind, hdr->name, target, args, weft_call_time_left_ms(call));
    } else {
        /* A second request for the same reference: it is being created already. */
        fresh->refs = 0;
        rref__free(fresh);
        weft_value_free(args);
    }
    uint64_t eager_max = hdr->eager_max;
    weft_msg_header_free(&hdr->base);
    pending_call_t *p = pending_call(call, e, NULL);
    if (p != NULL) {
        p->eager_max = eager_max;
    }
    if (p == NULL || weft_future_then(e->ready, created_ready, p) != WEFT_OK) {
        weft_free(p);
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "rref: no memory");
        weft_rref_release(e);
    }
}
