/* The rref module's per-agent context: creation (channel, functions, codec, listeners), fault
 * injection, object types, introspection, and the shutdown listener that settles every reference
 * and reports leaks. */
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

/* ------------------------------------------------------- fault injection */

int64_t rref__fault_delay(rref_ctx_t *ctx)
{
    if (ctx->fault_delay_us <= 0) {
        return 0;
    }
    /* xorshift64* */
    uint64_t old = atomic_load(&ctx->rng), x;
    do {
        x = old;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
    } while (!atomic_compare_exchange_weak(&ctx->rng, &old, x));
    return (int64_t)((x * 0x2545F4914F6CDD1Dull) % (uint64_t)(ctx->fault_delay_us + 1));
}

/* ---------------------------------------------------------------- context */

void rref__ctx_ref(rref_ctx_t *ctx)
{
    atomic_fetch_add(&ctx->nrefs, 1);
}

void rref__ctx_unref(rref_ctx_t *ctx)
{
    if (atomic_fetch_sub(&ctx->nrefs, 1) != 1) {
        return;
    }
    while (ctx->types != NULL) {
        rref_type_t *t = ctx->types;
        ctx->types = t->next;
        for (int i = 0; i < t->n_methods; i++) {
            weft_free((char *)t->methods[i].name);
        }
        weft_free(t->methods);
        weft_free(t->name);
        weft_free(t);
    }
    while (ctx->orphans != NULL) {
        rref_orphan_t *o = ctx->orphans;
        ctx->orphans = o->next;
        weft_free(o);
    }
    weft_free(ctx->lost);
    pthread_cond_destroy(&ctx->settle_cv);
    pthread_mutex_destroy(&ctx->mu);
    weft_free(ctx);
}

weft_rref_id_t rref__new_id(rref_ctx_t *ctx)
{
    weft_rref_id_t id = {ctx->rank, atomic_fetch_add(&ctx->next_local, 1)};
    return id;
}

const char *rref__worker_name(rref_ctx_t *ctx, int rank)
{
    const char *n = weft_agent_worker_name(ctx->a, rank);
    return n != NULL ? n : "?";
}

static void ctx_destroy(void *state)
{
    rref_ctx_t *ctx = state;

    /* The kit has dropped the context's timer tasks (their drops released what they held). From
     * here on nothing is sent and no task is added: ctx->a goes with the agent. */
    pthread_mutex_lock(&ctx->mu);
    ctx->dead = true;
    pthread_mutex_unlock(&ctx->mu);

    /* Control messages can no longer be answered. */
    rref__ctl_fail_rank(ctx, -1, WEFT_ERR_SHUTDOWN, "the agent was closed");

    /* Pending children: their parents are released (nothing is sent any more). */
    pthread_mutex_lock(&ctx->mu);
    rref_child_t *children = ctx->children;
    ctx->children = NULL;
    ctx->nchildren = 0;
    pthread_mutex_unlock(&ctx->mu);
    while (children != NULL) {
        rref_child_t *c = children;
        children = c->next;
        weft_rref_release(c->parent);
        weft_free(c);
    }

    /* Users still waiting: nothing will confirm them. */
    weft_future_t **fail = NULL;
    size_t nfail = 0;
    pthread_mutex_lock(&ctx->mu);
    fail = weft_calloc(ctx->nusers + 1, sizeof(*fail));
    for (weft_rref_t *u = ctx->users; u != NULL && fail != NULL; u = u->next) {
        if (!weft_future_done(u->ready)) {
            fail[nfail++] = weft_future_retain(u->ready);
        }
    }
    pthread_mutex_unlock(&ctx->mu);
    for (size_t i = 0; i < nfail; i++) {
        weft_future_fail(fail[i], WEFT_ERR_SHUTDOWN, "the agent was closed");
        weft_future_release(fail[i]);
    }
    weft_free(fail);

    /* Owner entries: those only remote workers held are freed now; those the program still
     * holds go with their last handle. */
    weft_rref_t *free_list = NULL;
    pthread_mutex_lock(&ctx->mu);
    for (size_t b = 0; b < RREF_OWNER_BUCKETS; b++) {
        while (ctx->owners[b] != NULL) {
            weft_rref_t *e = ctx->owners[b];
            ctx->owners[b] = e->next;
            e->in_map = false;
            ctx->nforks -= e->nforks;
            e->nforks = 0;
            ctx->nowners--;
            if (e->refs == 0) {
                ctx->deleted_owners++;
                e->next = free_list;
                free_list = e;
            } else {
                e->next = e->prev = NULL;
            }
        }
    }
    /* Users the program still holds stay valid; they are just out of the list. */
    while (ctx->users != NULL) {
        weft_rref_t *u = ctx->users;
        ctx->users = u->next;
        u->next = u->prev = NULL;
        u->listed = false;
    }
    ctx->nusers = 0;
    pthread_mutex_unlock(&ctx->mu);
    while (free_list != NULL) {
        weft_rref_t *e = free_list;
        free_list = e->next;
        rref__free(e);
    }
    rref__ctx_unref(ctx);
}

static weft_status_t on_shutdown(void *state, int64_t deadline_ms);

static weft_status_t ctx_create(weft_agent_t *a, void **state_p)
{
    weft_status_t st;
    rref_ctx_t *ctx = weft_calloc(1, sizeof(*ctx));

    if (ctx == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rref: no memory for the module");
    }
    ctx->a = a;
    ctx->rank = weft_agent_rank(a);
    ctx->world = weft_agent_world_size(a);
    if (ctx->world < 1 || ctx->rank < 0 || ctx->rank >= ctx->world) {
        weft_free(ctx);
        return weft__set_error(WEFT_ERR_INVALID_STATE,
                               "rref: the agent has no valid rank and world size");
    }
    atomic_init(&ctx->nrefs, 1);
    atomic_init(&ctx->next_local, 1);
    ctx->next_msg = 1;
    pthread_mutex_init(&ctx->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* the clock of weft__now_ms */
    pthread_cond_init(&ctx->settle_cv, &ca);
    pthread_condattr_destroy(&ca);
    ctx->lost = weft_calloc((size_t)ctx->world, sizeof(bool));
    if (ctx->lost == NULL) {
        rref__ctx_unref(ctx);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rref: no memory for the module");
    }
    /* Control messages get the deadline of the agent's calls given a timeout of 0. */
    ctx->ctl_timeout_ms = weft_agent_call_timeout_ms(a);
    if (ctx->ctl_timeout_ms > RREF_MAX_TIMEOUT_MS) {
        ctx->ctl_timeout_ms = RREF_MAX_TIMEOUT_MS;
    }
    ctx->eager_max = weft__cfg_int(WEFT__CFG_RREF_EAGER_BYTES);
    ctx->fault_delay_us = weft__cfg_int(WEFT__CFG_RREF_FAULT_DELAY_US);
    ctx->fault_dup = weft__cfg_bool(WEFT__CFG_RREF_FAULT_DUP);
    uint64_t seed = 0x9E3779B97F4A7C15ull ^ ((uint64_t)getpid() << 20) ^ (uint64_t)weft__now_ns() ^
                    (uint64_t)ctx->rank;
    atomic_init(&ctx->rng, seed != 0 ? seed : 1);
    if (ctx->fault_delay_us > 0 || ctx->fault_dup) {
        WEFT_INFO("rref: fault injection: control messages delayed by up to %lld us%s",
                  (long long)ctx->fault_delay_us, ctx->fault_dup ? ", each sent twice" : "");
    }
    /* From here on the agent may call into ctx: on a failure it is kept (not freed), stopped. */
    WEFT_CHECK_GOTO(weft_rpc_register(a, RREF_FN_REMOTE, rref__handle_remote, ctx), st, err_keep);
    WEFT_CHECK_GOTO(weft_rpc_register(a, RREF_FN_FETCH, rref__handle_fetch, ctx), st, err_keep);
    WEFT_CHECK_GOTO(weft_rpc_register(a, RREF_FN_METHOD, rref__handle_method, ctx), st, err_keep);
    *state_p = ctx;
    return WEFT_OK;

err_keep:
    WEFT_ERROR("rref: the module could not be set up: %s", weft_last_error());
    pthread_mutex_lock(&ctx->mu);
    ctx->dead = true;
    pthread_mutex_unlock(&ctx->mu);
    return st;
}

static const weft_module_desc_t rref_module = {
    .name = "rref",
    .channel = WEFT_CHANNEL_RREF,
    .create = ctx_create,
    .destroy = ctx_destroy,
    .on_message = rref__on_message,
    .on_peer_lost = rref__on_peer_lost,
    .on_shutdown = on_shutdown,
    .codec = &rref__codec,
};

weft_status_t rref__ctx(weft_agent_t *a, rref_ctx_t **ctx_p)
{
    void *state;

    if (a == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "rref: NULL agent");
    }
    WEFT_CHECK(weft_agent_module(a, &rref_module, &state));
    *ctx_p = state;
    return WEFT_OK;
}

weft_status_t weft_rref_init(weft_agent_t *a)
{
    rref_ctx_t *ctx = NULL;
    return rref__ctx(a, &ctx);
}

/* ------------------------------------------------------------------ types */

const rref_type_t *rref__type_find(rref_ctx_t *ctx, const char *name)
{
    const rref_type_t *found = NULL;

    pthread_mutex_lock(&ctx->mu);
    for (rref_type_t *t = ctx->types; t != NULL; t = t->next) {
        if (strcmp(t->name, name) == 0) {
            found = t;
            break;
        }
    }
    pthread_mutex_unlock(&ctx->mu);
    return found;
}

weft_status_t weft_rref_register_type(weft_agent_t *a, const char *type, weft_rref_ctor_cb_t ctor,
                                      weft_rref_dtor_cb_t dtor, const weft_rref_method_t *methods,
                                      int n_methods, void *type_arg)
{
    rref_ctx_t *ctx = NULL;

    if (type == NULL || ctor == NULL || n_methods < 0 || (n_methods > 0 && methods == NULL) ||
        type[0] == '\0' || strlen(type) > RREF_MAX_NAME) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "rref_register_type: a name of 1..%d bytes, a constructor and "
                               "n_methods >= 0 methods are needed",
                               RREF_MAX_NAME);
    }
    for (int i = 0; i < n_methods; i++) {
        if (methods[i].name == NULL || methods[i].name[0] == '\0' ||
            strlen(methods[i].name) > RREF_MAX_NAME || methods[i].fn == NULL) {
            return weft__set_error(WEFT_ERR_INVALID_ARG,
                                   "rref_register_type: method %d of '%s' has no name or function",
                                   i, type);
        }
    }
    WEFT_CHECK(rref__ctx(a, &ctx));
    rref_type_t *t = weft_calloc(1, sizeof(*t));
    if (t == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rref_register_type: no memory");
    }
    t->name = weft_strdup(type);
    t->methods = weft_calloc((size_t)n_methods + 1, sizeof(*t->methods));
    bool ok = t->name != NULL && t->methods != NULL;
    for (int i = 0; ok && i < n_methods; i++) {
        t->methods[i].name = weft_strdup(methods[i].name);
        t->methods[i].fn = methods[i].fn;
        ok = t->methods[i].name != NULL;
        t->n_methods = i + 1;
    }
    t->ctor = ctor;
    t->dtor = dtor;
    t->arg = type_arg;
    weft_status_t st = WEFT_OK;
    if (!ok) {
        st = weft__set_error(WEFT_ERR_NO_MEMORY, "rref_register_type: no memory");
        goto err_free_type;
    }
    pthread_mutex_lock(&ctx->mu);
    for (rref_type_t *u = ctx->types; u != NULL; u = u->next) {
        if (strcmp(u->name, type) == 0) {
            st = WEFT_ERR_ALREADY_EXISTS;
            break;
        }
    }
    if (st == WEFT_OK) {
        t->next = ctx->types;
        ctx->types = t;
    }
    pthread_mutex_unlock(&ctx->mu);
    if (st == WEFT_OK) {
        return WEFT_OK;
    }
    weft__set_error(st, "rref_register_type: '%s' is already registered", type);

err_free_type:
    for (int i = 0; i < t->n_methods; i++) {
        weft_free((char *)t->methods[i].name);
    }
    weft_free(t->methods);
    weft_free(t->name);
    weft_free(t);
    return st;
}

/* ---------------------------------------------------------- introspection */

typedef struct {
    size_t owners, forks, users, pending_users, confirmed_users, pending_children, ctls;
    uint64_t deleted_owners, leaks;
} counts_t;

static void counts_locked(rref_ctx_t *ctx, counts_t *c)
{
    memset(c, 0, sizeof(*c));
    c->owners = ctx->nowners;
    c->forks = ctx->nforks;
    c->deleted_owners = ctx->deleted_owners;
    c->pending_children = ctx->nchildren;
    c->ctls = ctx->nctls;
    c->leaks = ctx->leaks;
    for (weft_rref_t *u = ctx->users; u != NULL; u = u->next) {
        c->users++;
        c->pending_users += u->pending ? 1 : 0;
        c->confirmed_users += u->confirmed ? 1 : 0;
    }
}

weft_status_t weft_rref_debug_info(weft_agent_t *a, char **json_p)
{
    rref_ctx_t *ctx = NULL;
    counts_t c;

    if (json_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "rref_debug_info: NULL json_p");
    }
    WEFT_CHECK(rref__ctx(a, &ctx));
    pthread_mutex_lock(&ctx->mu);
    counts_locked(ctx, &c);
    pthread_mutex_unlock(&ctx->mu);
    char *s = weft__strfmt("{\"owners\":%zu,\"users\":%zu,\"pending_users\":%zu,"
                           "\"pending_children\":%zu,\"forks\":%zu,\"confirmed_users\":%zu,"
                           "\"deleted_owners\":%llu,\"leaks\":%llu,\"control_in_flight\":%zu,"
                           "\"fetches_served\":%llu,\"values_sent_with_creation\":%llu}",
                           c.owners, c.users, c.pending_users, c.pending_children, c.forks,
                           c.confirmed_users, (unsigned long long)c.deleted_owners,
                           (unsigned long long)c.leaks, c.ctls,
                           (unsigned long long)atomic_load(&ctx->fetches_served),
                           (unsigned long long)atomic_load(&ctx->values_sent_with_creation));
    if (s == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rref_debug_info: no memory");
    }
    *json_p = s;
    return WEFT_OK;
}

/* --------------------------------------------------------------- shutdown */

void rref__settle_signal_locked(rref_ctx_t *ctx)
{
    if (ctx->settle_waiters > 0) {
        pthread_cond_broadcast(&ctx->settle_cv);
    }
}

/* Waits until no confirmation, pending child or control message is in flight (@p ctl_only: no
 * control message), or the deadline (CLOCK_MONOTONIC ms); woken when one of them settles. */
static bool wait_settled(rref_ctx_t *ctx, int64_t deadline_ms, bool ctl_only, counts_t *c)
{
    bool settled;

    pthread_mutex_lock(&ctx->mu);
    ctx->settle_waiters++;
    for (;;) {
        counts_locked(ctx, c);
        settled = c->ctls == 0 && (ctl_only || (c->pending_users == 0 && c->pending_children == 0));
        int64_t now = weft__now_ms();
        if (settled || now >= deadline_ms) {
            break;
        }
        /* At most an hour at a time: a far deadline stays a valid timespec. */
        int64_t until = deadline_ms - now < 3600000 ? deadline_ms : now + 3600000;
        struct timespec ts = {.tv_sec = until / 1000, .tv_nsec = (until % 1000) * 1000000};
        pthread_cond_timedwait(&ctx->settle_cv, &ctx->mu, &ts);
    }
    ctx->settle_waiters--;
    pthread_mutex_unlock(&ctx->mu);
    return settled;
}

static weft_status_t on_shutdown(void *state, int64_t deadline_ms)
{
    rref_ctx_t *ctx = state;
    weft_status_t st = WEFT_OK;
    counts_t c;

    if (!wait_settled(ctx, deadline_ms, false, &c)) {
        st = weft__set_error(WEFT_ERR_TIMEOUT,
                             "rref: at the shutdown deadline %zu user references were still "
                             "unconfirmed, %zu forks unaccepted and %zu control messages unacked",
                             c.pending_users, c.pending_children, c.ctls);
    }
    /* Leaks: user references the program still holds. Each is reported and released for it, so
     * that its owner can free the value; the handle stays valid (and inert). */
    weft_rref_t **leaked = NULL;
    size_t n = 0;
    pthread_mutex_lock(&ctx->mu);
    leaked = weft_calloc(ctx->nusers + 1, sizeof(*leaked));
    for (weft_rref_t *u = ctx->users; u != NULL && leaked != NULL;) {
        weft_rref_t *next = u->next;
        if (u->refs > 0 && !u->pending) {
            u->detached = true;
            u->refs++; /* held while reported */
            leaked[n++] = u;
            ctx->leaks++;
        }
        u = next;
    }
    pthread_mutex_unlock(&ctx->mu);
    for (size_t i = 0; i < n; i++) {
        weft_rref_t *u = leaked[i];
        pthread_mutex_lock(&ctx->mu);
        bool send = (u->confirmed || u->maybe_known) && !u->owner_lost;
        if (u->listed) {
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
        int64_t handles = u->refs - 1;
        pthread_mutex_unlock(&ctx->mu);
        WEFT_WARN("rref leak: user reference (%d,%llu) fork (%d,%llu) of %s (rank %d), created by "
                  "'%s', still had %lld handle(s) at shutdown; released",
                  u->id.worker, (unsigned long long)u->id.local, u->fork.worker,
                  (unsigned long long)u->fork.local, rref__worker_name(ctx, u->owner), u->owner,
                  u->created_by != NULL ? u->created_by : "?", (long long)handles);
        if (send) {
            rref__ctl_send(ctx, WEFT__V1__RREF_MSG_KIND__RREF_USER_DELETE, u->owner, u->id, u->fork,
                           NULL, NULL);
        }
        weft_rref_release(u);
    }
    weft_free(leaked);
    if (!wait_settled(ctx, deadline_ms, true, &c) && st == WEFT_OK) {
        st = weft__set_error(WEFT_ERR_TIMEOUT,
                             "rref: at the shutdown deadline %zu control messages were unacked",
                             c.ctls);
    }
    return st;
}
