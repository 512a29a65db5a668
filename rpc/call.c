/* Calls: the registry of functions, incoming calls and their answers, outgoing calls (the pending
 * table, each call's deadline a task on the agent's timer), and the user's call and send
 * functions. Every frame leaves through weft__route. */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

struct weft_call {
    weft_agent_t *agent;
    weft__origin_t origin; /* where the request came from (its stream held); the answer goes back */
    uint64_t request_id;
    int caller;
    char *function;
    weft_value_t *args;
    int64_t deadline_ns;
    bool internal;
    /* while the objects of the arguments' references get ready */
    weft_rpc_handler_cb_t handler;
    void *handler_arg;
    /* weft_rpc_call_local: the caller's future, completed with the reply value itself */
    weft_future_t *local;
    /* distributed autograd's context of the request: its handler's thread context, and its
     * answer's */
    uint64_t ag_context;
};

_Thread_local uint64_t weft__thread_ag_context;

uint64_t weft_rpc_thread_context(void)
{
    return weft__thread_ag_context;
}

uint64_t weft_rpc_set_thread_context(uint64_t context)
{
    uint64_t prev = weft__thread_ag_context;

    weft__thread_ag_context = context;
    return prev;
}

uint64_t weft_call_context(const weft_call_t *call)
{
    return call == NULL ? 0 : call->ag_context;
}

weft_status_t weft_agent_set_call_hooks(weft_agent_t *a, const weft_call_hooks_t *hooks)
{
    if (a == NULL || hooks == NULL || hooks->on_send == NULL || hooks->on_recv == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "agent_set_call_hooks: NULL argument");
    }
    bool claimed = false;
    /* Claimed once, without a lock (a module's create calls this under the module lock). */
    if (!atomic_compare_exchange_strong(&a->call_hooks_claimed, &claimed, true)) {
        return weft__set_error(WEFT_ERR_ALREADY_EXISTS,
                               "agent_set_call_hooks: the agent has its hooks already");
    }
    a->call_hooks = *hooks;
    atomic_store(&a->has_call_hooks, true);
    return WEFT_OK;
}

void weft__call_ag_dead(weft_agent_t *a, uint64_t context, uint64_t message)
{
    if (message != 0 && atomic_load(&a->has_call_hooks) && a->call_hooks.on_dead != NULL) {
        a->call_hooks.on_dead(a->call_hooks.arg, context, message);
    }
}

weft_status_t weft__call_ag_recv(weft_agent_t *a, const Weft__V1__Envelope *env, int from,
                                 const char *fn, bool reply, weft_value_t **v_p)
{
    weft_call_autograd_t ag = {
        .context = env->autograd_context,
        .message = env->autograd_message,
        .grads = env->autograd_grads,
        .n_grads = env->n_autograd_grads,
    };

    if (!atomic_load(&a->has_call_hooks)) {
        return weft__set_error(WEFT_ERR_INVALID_STATE,
                               "'%s' from rank %d carries distributed autograd context %llx, and "
                               "%s has not set up distributed autograd (weft_dist_init)",
                               fn != NULL ? fn : "?", from, (unsigned long long)ag.context,
                               a->name);
    }
    if (ag.message != 0 && ag.n_grads > 0) {
        size_t nt = *v_p == NULL ? 0 : weft_value_num_tensors(*v_p);

        for (size_t i = 0; i < ag.n_grads; i++) {
            if (ag.grads[i] >= nt) {
                return weft__set_error(WEFT_ERR_PROTOCOL,
                                       "'%s' from rank %d marks tensor %u for gradients; the "
                                       "value has %zu",
                                       fn != NULL ? fn : "?", from, ag.grads[i], nt);
            }
        }
    }
    if (*v_p == NULL) {
        WEFT_CHECK(weft_value_create(v_p));
    }
    return a->call_hooks.on_recv(a->call_hooks.arg, from, fn, reply, &ag, *v_p);
}

/* Runs a handler with the request's context as the thread's. */
static void run_handler(weft_call_t *call, weft_rpc_handler_cb_t cb, void *arg)
{
    uint64_t prev = weft__thread_ag_context;

    weft__thread_ag_context = call->ag_context;
    cb(call, arg);
    weft__thread_ag_context = prev;
}

static void drop_ready(weft_future_t **ready, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        weft_future_release(ready[i]);
    }
    weft_free(ready);
}

/* ---------------------------------------------------------------- registry */

weft_status_t weft_rpc_register(weft_agent_t *a, const char *name, weft_rpc_handler_cb_t fn,
                                void *arg)
{
    if (a == NULL || name == NULL || fn == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "rpc_register: NULL argument");
    }
    size_t len = strlen(name);
    if (len == 0 || len > WEFT__MAX_NAME) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "rpc_register: a name has 1 to %d bytes, got %zu", WEFT__MAX_NAME,
                               len);
    }
    weft__fn_t *f = weft_calloc(1, sizeof(*f));
    if (f == NULL || (f->name = weft_strdup(name)) == NULL) {
        weft_free(f);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rpc_register: no memory");
    }
    f->cb = fn;
    f->arg = arg;
    pthread_rwlock_wrlock(&a->reg_mu);
    for (weft__fn_t *g = a->fns; g != NULL; g = g->next) {
        if (strcmp(g->name, name) == 0) {
            pthread_rwlock_unlock(&a->reg_mu);
            weft_free(f->name);
            weft_free(f);
            return weft__set_error(WEFT_ERR_ALREADY_EXISTS,
                                   "rpc_register: '%s' is already registered", name);
        }
    }
    f->next = a->fns;
    a->fns = f;
    pthread_rwlock_unlock(&a->reg_mu);
    return WEFT_OK;
}

/* The handler of @p name; false when none is registered. */
static bool find_fn(weft_agent_t *a, const char *name, weft_rpc_handler_cb_t *cb_p, void **arg_p)
{
    bool found = false;
    pthread_rwlock_rdlock(&a->reg_mu);
    for (weft__fn_t *e = a->fns; e != NULL; e = e->next) {
        if (strcmp(e->name, name) == 0) {
            *cb_p = e->cb;
            *arg_p = e->arg;
            found = true;
            break;
        }
    }
    pthread_rwlock_unlock(&a->reg_mu);
    return found;
}

/* ------------------------------------------------------------ incoming calls */

const weft_value_t *weft_call_args(const weft_call_t *call)
{
    return call->args;
}

weft_value_t *weft_call_take_args(weft_call_t *call)
{
    weft_value_t *v = call->args;
    if (weft_value_create(&call->args) != WEFT_OK) {
        call->args = NULL;
    }
    return v;
}

int weft_call_caller_rank(const weft_call_t *call)
{
    return call->caller;
}

const char *weft_call_function(const weft_call_t *call)
{
    return call->function;
}

weft_agent_t *weft_call_agent(const weft_call_t *call)
{
    return call->agent;
}

int64_t weft_call_time_left_ms(const weft_call_t *call)
{
    return (call->deadline_ns - weft__now_ns()) / 1000000;
}

static void call_free(weft_call_t *call)
{
    weft_agent_t *a = call->agent;
    bool internal = call->internal;

    if (call->origin.stream != NULL) {
        weft__stream_unref(call->origin.stream);
    }
    weft_future_release(call->local);
    weft_value_free(call->args);
    weft_free(call->function);
    weft_free(call);
    if (!internal && atomic_fetch_sub(&a->calls_in_progress, 1) == 1) {
        weft__agent_passive_check(a);
    }
}

static void send_response(weft_call_t *call, weft_status_t st, const char *text,
                          const weft_value_t *result)
{
    weft_agent_t *a = call->agent;

    if (call->local != NULL) {
        /* A local call's failure (its success goes through weft_call_reply). */
        weft_future_complete(call->local, st, text, NULL);
        return;
    }
    weft__frame_t fr = {
        .kind = WEFT__V1__KIND__KIND_RESPONSE,
        .to = call->caller,
        .value = result,
        .function = call->function,
        .request_id = call->request_id,
        .status = st,
        .error = text,
        .reply_to = &call->origin,
        .ag_context = call->ag_context,
    };
    weft__path_t path;
    weft_status_t rst = weft__route(a, &fr, &path);
    if (rst == WEFT_OK) {
        return;
    }
    if (st == WEFT_OK && !path.handed) {
        /* The result could not be sent (over the caller's limit, a reference that does not
         * encode): the caller hears why instead. */
        char why[WEFT__ERROR_MAX];
        if (rst == WEFT_ERR_TOO_LARGE) {
            snprintf(why, sizeof(why), "%s", weft_last_error());
        } else {
            snprintf(why, sizeof(why), "result of '%s' on %s could not be encoded: %s",
                     call->function, a->name, weft_last_error());
        }
        send_response(call, rst, why, NULL);
        return;
    }
    WEFT_DEBUG("answer to rank %d for '%s' dropped: %s", call->caller, call->function,
               weft_last_error());
}

void weft_call_reply(weft_call_t *call, weft_value_t *result)
{
    if (call->local != NULL) {
        /* The value itself goes to the caller: nothing is copied. */
        if (result == NULL && weft_value_create(&result) != WEFT_OK) {
            weft_future_complete(call->local, WEFT_ERR_NO_MEMORY, "no memory for the result", NULL);
        } else {
            weft_future_complete(call->local, WEFT_OK, NULL, result);
        }
        call_free(call);
        return;
    }
    send_response(call, WEFT_OK, NULL, result);
    weft_value_free(result);
    call_free(call);
}

void weft_call_set_args(weft_call_t *call, weft_value_t *args)
{
    weft_value_free(call->args);
    call->args = args;
}

void weft_call_fail(weft_call_t *call, weft_status_t status, const char *fmt, ...)
{
    char text[1024];
    char full[1400];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    if (status == WEFT_OK) {
        status = WEFT_ERR_REMOTE;
    }
    snprintf(full, sizeof(full), "%s (in '%s' on %s)", text, call->function, call->agent->name);
    send_response(call, status, full, NULL);
    call_free(call);
}

static void reply_future_cb(weft_future_t *f, void *arg)
{
    weft_call_t *call = arg;
    weft_status_t st = weft_future_status(f);

    if (st == WEFT_OK) {
        weft_value_t *v = NULL;
        (void)weft_future_take_value(f, &v);
        weft_call_reply(call, v);
    } else {
        weft_call_fail(call, st, "%s", weft_future_error(f));
    }
    weft_future_release(f);
}

void weft_call_reply_future(weft_call_t *call, weft_future_t *f)
{
    if (weft_future_then(f, reply_future_cb, call) != WEFT_OK) {
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "could not chain the reply");
        weft_future_release(f);
    }
}

static void handler_task(void *arg)
{
    weft_call_t *call = arg;

    run_handler(call, call->handler, call->handler_arg);
}

/* The objects of the arguments' references are ready (or one failed): run the handler, on a bulk
 * worker: the thread that made the last object ready may be any (the timer's, a module's) and
 * must not be held by a handler that blocks (a bulk worker that blocks gets company). */
static void args_ready(weft_status_t st, const char *text, void *arg)
{
    weft_call_t *call = arg;

    if (st != WEFT_OK) {
        weft_call_fail(call, st, "%s", text);
        return;
    }
    if (call->agent->bulk == NULL || weft__bulk_submit(call->agent->bulk, handler_task, call) != WEFT_OK) {
        run_handler(call, call->handler, call->handler_arg);
    }
}

void weft__call_refuse(weft_agent_t *a, const weft__origin_t *o, const Weft__V1__Envelope *env,
                       weft_status_t st)
{
    char why[600];

    /* The sender counted it: count it as received, or shutdown never settles. */
    if (env->function == NULL || !weft__fn_internal(env->function)) {
        atomic_fetch_add(&a->requests_received, 1);
    }
    snprintf(why, sizeof(why), "%s (on %s)", weft_last_error(), a->name);
    weft__frame_t fr = {
        .kind = WEFT__V1__KIND__KIND_RESPONSE,
        .to = o->peer,
        .function = env->function,
        .request_id = env->request_id,
        .status = st,
        .error = why,
        .reply_to = o,
    };
    (void)weft__route(a, &fr, NULL);
}

void weft__call_dispatch(weft_agent_t *a, const weft__origin_t *o, Weft__V1__Envelope *env,
                         weft_value_t *args)
{
    weft_call_t *call = weft_calloc(1, sizeof(*call));
    weft_future_t **ready = NULL;
    size_t nready = 0;

    if (call == NULL) {
        weft__set_error(WEFT_ERR_NO_MEMORY, "no memory for an incoming call");
        weft__call_refuse(a, o, env, WEFT_ERR_NO_MEMORY);
        goto out;
    }
    call->agent = a;
    call->origin = *o;
    if (o->stream != NULL) {
        weft__stream_ref(o->stream);
    }
    call->request_id = env->request_id;
    call->caller = o->peer;
    call->function = weft_strdup(env->function != NULL ? env->function : "");
    call->internal = weft__fn_internal(call->function);
    int64_t left = env->timeout_ms < WEFT__MAX_TIMEOUT_MS ? env->timeout_ms : WEFT__MAX_TIMEOUT_MS;
    call->deadline_ns = weft__now_ns() + (left > 0 ? left : 0) * 1000000;
    if (!call->internal) {
        atomic_fetch_add(&a->calls_in_progress, 1);
        atomic_fetch_add(&a->requests_received, 1);
    }
    call->args = args;
    args = NULL;
    if (env->n_refs > 0) {
        /* First, whatever follows: every reference sent is decoded (and released with the
         * arguments when the call fails), so that its module settles what the sender recorded. */
        weft_status_t rst = call->args != NULL ? WEFT_OK : weft_value_create(&call->args);
        if (rst == WEFT_OK) {
            rst = weft__refs_decode(a, o->peer, env, call->args, &ready, &nready);
        }
        if (rst != WEFT_OK) {
            weft_call_fail(call, rst, "%s", weft_last_error());
            goto out;
        }
    }
    if (env->timeout_ms <= 0) {
        drop_ready(ready, nready);
        weft_call_fail(call, WEFT_ERR_TIMEOUT, "the caller's deadline passed before the call ran");
        goto out;
    }
    if (env->autograd_context != 0) {
        /* Distributed autograd: a receive function on the arguments; the handler runs in the
         * context and the answer carries it. */
        weft_status_t ast =
            weft__call_ag_recv(a, env, o->peer, call->function, false, &call->args);
        if (ast != WEFT_OK) {
            drop_ready(ready, nready);
            weft_call_fail(call, ast, "%s", weft_last_error());
            goto out;
        }
        call->ag_context = env->autograd_context;
    }
    weft_rpc_handler_cb_t cb = NULL;
    void *arg = NULL;
    if (!find_fn(a, call->function, &cb, &arg)) {
        drop_ready(ready, nready);
        weft_call_fail(call, WEFT_ERR_NO_SUCH_FUNCTION, "no function named '%s' is registered",
                       call->function);
        goto out;
    }
    /* The envelope goes before the handler runs: it may take long. */
    weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
    if (nready > 0) {
        /* The handler runs once every object is ready, on the thread that completes the last. */
        call->handler = cb;
        call->handler_arg = arg;
        weft__refs_when_ready(ready, nready, args_ready, call);
        return;
    }
    run_handler(call, cb, arg);
    return;
out:
    weft_value_free(args);
    weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
}

/* ------------------------------------------------------------ outgoing calls */

static size_t bucket(uint64_t id)
{
    return (size_t)((id * 0x9E3779B97F4A7C15ull) >> 54) % WEFT__PENDING_BUCKETS;
}

/* Called with pend_mu held. */
static void pending_insert(weft_agent_t *a, weft__pending_t *p)
{
    size_t b = bucket(p->id);
    if (!p->internal) {
        atomic_fetch_add(&a->pending_user, 1);
    }
    p->next = a->pending[b];
    a->pending[b] = p;
    a->npending++;
}

/* Takes @p p's counts out. Called with pend_mu held. */
static void pending_unlinked_locked(weft_agent_t *a, weft__pending_t *p)
{
    a->npending--;
    if (!p->internal && atomic_fetch_sub(&a->pending_user, 1) == 1) {
        pthread_cond_broadcast(&a->passive_cv);
    }
    if (a->npending == 0) {
        pthread_cond_broadcast(&a->pend_cv);
    }
}

/* Removes the call @p id made to @p peer (-1: any peer). Called with pend_mu held. */
static weft__pending_t *pending_remove(weft_agent_t *a, uint64_t id, int peer)
{
    weft__pending_t **pp = &a->pending[bucket(id)];

    for (; *pp != NULL; pp = &(*pp)->next) {
        if ((*pp)->id == id && (peer < 0 || (*pp)->peer == peer)) {
            weft__pending_t *p = *pp;
            *pp = p->next;
            pending_unlinked_locked(a, p);
            return p;
        }
    }
    return NULL;
}

/* Called with pend_mu held: a pending call by id, left in the table. */
static weft__pending_t *pending_find(weft_agent_t *a, uint64_t id)
{
    for (weft__pending_t *p = a->pending[bucket(id)]; p != NULL; p = p->next) {
        if (p->id == id) {
            return p;
        }
    }
    return NULL;
}

static void pending_free(weft__pending_t *p)
{
    weft_future_release(p->f);
    weft_free(p->fn);
    weft_free(p->into);
    weft_free(p->held_why);
    weft_free(p);
}

static void pending_finish(weft_agent_t *a, weft__pending_t *p, weft_status_t st, const char *text,
                           weft_value_t *v)
{
    if (p->timer_id != 0 && a->timer != NULL) {
        (void)weft__timer_cancel(a->timer, p->timer_id);
    }
    if (st != WEFT_OK) {
        weft__call_ag_dead(a, p->ag_context, p->ag_message);
    }
    weft_future_complete(p->f, st, text, v);
    pending_free(p);
}

static void deadline_text(weft_agent_t *a, const weft__pending_t *p, char *text, size_t n)
{
    snprintf(text, n, "call to '%s' on %s (rank %d) passed its deadline", p->fn,
             a->peers[p->peer].name != NULL ? a->peers[p->peer].name : "?", p->peer);
}

/* A call's deadline passed (a task on the agent's timer; @p id is the request's). */
static void pending_deadline(void *arg, uint64_t id)
{
    weft_agent_t *a = arg;

    pthread_mutex_lock(&a->pend_mu);
    weft__pending_t *p = pending_find(a, id);
    if (p != NULL && p->landing && !p->landed) {
        /* Its answer is being written into the caller's memory: it ends when that is over. */
        p->timer_id = 0;
        p->expired = true;
        p = NULL;
    } else if (p != NULL) {
        /* (A landed answer whose delivery is late, queued behind busy workers, ends here too:
         * the call fails with no value, so nothing it returns wraps the caller's memory.) */
        p = pending_remove(a, id, -1);
    }
    pthread_mutex_unlock(&a->pend_mu);
    if (p == NULL) {
        return; /* answered meanwhile, or landing */
    }
    p->timer_id = 0; /* this task is running: nothing to cancel */
    char text[512];
    deadline_text(a, p, text, sizeof(text));
    pending_finish(a, p, WEFT_ERR_TIMEOUT, text, NULL);
}

bool weft__pending_claim(weft_agent_t *a, uint64_t id, int peer, int tp, weft_rpc_into_t **into_p,
                         size_t *n_p)
{
    bool claimed = false;
    pthread_mutex_lock(&a->pend_mu);
    weft__pending_t *p = pending_find(a, id);
    /* Only an answer that may answer the call lands (answer_way_ok: a request that went on a
     * stream is answered there, or direct). */
    if (p != NULL && p->peer == peer && p->n_into > 0 && !p->landing && !p->expired &&
        p->held == WEFT_OK && (tp == WEFT__TP_DIRECT || p->path.tp != WEFT__TP_STREAM)) {
        *into_p = weft_alloc(p->n_into * sizeof(**into_p));
        if (*into_p != NULL) {
            memcpy(*into_p, p->into, p->n_into * sizeof(**into_p));
            *n_p = p->n_into;
            p->landing = claimed = true;
        }
    }
    pthread_mutex_unlock(&a->pend_mu);
    return claimed;
}

typedef struct {
    weft_agent_t *a;
    weft__pending_t *p;
} unclaimed_t;

/* A call whose landing broke off after its deadline passed or its peer was lost: finished. */
static void unclaimed_end(weft_agent_t *a, weft__pending_t *p)
{
    char text[1024];
    if (p->held != WEFT_OK) {
        snprintf(text, sizeof(text), "%s", p->held_why != NULL ? p->held_why : "failed");
    } else {
        deadline_text(a, p, text, sizeof(text));
    }
    pending_finish(a, p, p->held != WEFT_OK ? p->held : WEFT_ERR_TIMEOUT, text, NULL);
}

static void unclaimed_run(void *arg)
{
    unclaimed_t *u = arg;
    unclaimed_end(u->a, u->p);
    weft_free(u);
}

void weft__pending_unclaim(weft_agent_t *a, uint64_t id, bool delivered)
{
    weft__pending_t *p = NULL;
    pthread_mutex_lock(&a->pend_mu);
    weft__pending_t *q = pending_find(a, id);
    if (q != NULL && q->landing && delivered) {
        q->landed = true; /* claimed until its delivery, which comes next on this thread */
    } else if (q != NULL && q->landing) {
        q->landing = false;
        if (q->expired || q->held != WEFT_OK) {
            p = pending_remove(a, id, -1);
        }
    }
    pthread_mutex_unlock(&a->pend_mu);
    if (p == NULL) {
        return;
    }
    /* The caller's callbacks run on the bulk queue, not on this reader. */
    unclaimed_t *u = weft_alloc(sizeof(*u));
    if (u != NULL) {
        u->a = a;
        u->p = p;
        if (a->bulk != NULL && weft__bulk_submit(a->bulk, unclaimed_run, u) == WEFT_OK) {
            return;
        }
    }
    weft_free(u);
    unclaimed_end(a, p);
}

bool weft_rpc_withdraw_into(weft_agent_t *a, const weft_future_t *f)
{
    bool ok = true;
    if (a == NULL || f == NULL) {
        return true;
    }
    pthread_mutex_lock(&a->pend_mu);
    for (size_t b = 0; a->npending > 0 && b < WEFT__PENDING_BUCKETS; b++) {
        for (weft__pending_t *p = a->pending[b]; p != NULL; p = p->next) {
            if (p->f == f) {
                if (p->landing) {
                    ok = false;
                } else {
                    p->n_into = 0;
                }
            }
        }
    }
    pthread_mutex_unlock(&a->pend_mu);
    return ok;
}

/* Whether a RESPONSE from @p o may answer @p p: from the rank the request went to, back the way
 * it went (a request on a stream: its answer on that stream, or a large one direct). A request
 * handed to the direct connection may be answered on any connection of that rank: direct, its
 * stream to us (it has no direct connection to us), or our stream to it (the request fell back to
 * it when the direct connection could not be opened). Every one of those is the rank's: proven
 * by its key, or opened by us to its address. */
static bool answer_way_ok(const weft__pending_t *p, const weft__origin_t *o)
{
    if (p->peer != o->peer) {
        return false;
    }
    if (o->tp == WEFT__TP_DIRECT || p->path.tp != WEFT__TP_STREAM) {
        /* Direct connections carry large answers to every request. A request handed to a ring
         * or a direct connection may be answered on any connection of that rank (its ring to
         * us, its direct connection, its stream: it may have none of the others; and a frame
         * that waited for a ring that did not open took our stream). Until the route has
         * recorded the way (the microseconds while it is handed over) any is accepted too. */
        return true;
    }
    return o->client && o->stream == p->path.stream;
}

void weft__call_response(weft_agent_t *a, const weft__origin_t *o, Weft__V1__Envelope *env,
                         weft_value_t *v, weft_status_t st)
{
    pthread_mutex_lock(&a->pend_mu);
    weft__pending_t *p = pending_find(a, env->request_id);
    if (p != NULL && !answer_way_ok(p, o)) {
        /* (A landed answer is never this one: a landing is claimed only the ways answer_way_ok
         * takes; a landed call still ends at its deadline.) */
        pthread_mutex_unlock(&a->pend_mu);
        WEFT_WARN("an answer to call %llu came from rank %d over a way its request did not take; "
                  "ignored",
                  (unsigned long long)env->request_id, o->peer);
        weft_value_free(v);
        weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
        return;
    }
    if (p != NULL && p->landing && !p->landed) {
        /* Another answer to a call whose answer is being received into the caller's memory:
         * the first one stands. */
        pthread_mutex_unlock(&a->pend_mu);
        WEFT_WARN("a second answer to call %llu from rank %d while the first is landing; ignored",
                  (unsigned long long)env->request_id, o->peer);
        weft_value_free(v);
        weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
        return;
    }
    if (p != NULL) {
        p = pending_remove(a, env->request_id, o->peer);
    }
    pthread_mutex_unlock(&a->pend_mu);

    if (st != WEFT_OK) {
        /* The answer's frame was refused (weft_last_error() says why). */
        char text[WEFT__ERROR_MAX];
        snprintf(text, sizeof(text), "the answer from rank %d could not be read: %s", o->peer,
                 weft_last_error());
        WEFT_WARN("%s", text);
        if (p != NULL) {
            pending_finish(a, p, st, text, NULL);
        }
        weft_value_free(v);
        weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
        return;
    }
    if (env->status == 0 && env->n_refs > 0) {
        /* Decoded even when no call waits any more: released with the value, they settle. Their
         * objects are not awaited. */
        weft_future_t **ready = NULL;
        size_t nready = 0;
        weft_status_t rst = v != NULL ? WEFT_OK : weft_value_create(&v);
        if (rst == WEFT_OK) {
            rst = weft__refs_decode(a, o->peer, env, v, &ready, &nready);
        }
        drop_ready(ready, nready);
        if (rst != WEFT_OK) {
            char text[WEFT__ERROR_MAX];
            snprintf(text, sizeof(text), "result from rank %d: %s", o->peer, weft_last_error());
            WEFT_WARN("%s", text);
            weft_value_free(v);
            v = NULL;
            if (p != NULL) {
                pending_finish(a, p, rst, text, NULL);
            }
            weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
            return;
        }
    }
    weft_status_t ast;
    if (p == NULL) {
        /* Timed out or failed already (or not a call to this peer): dropped. */
        WEFT_DEBUG("response %llu from rank %d matches no pending call; dropped",
                   (unsigned long long)env->request_id, o->peer);
    } else if (env->status != 0) {
        weft_status_t est =
            weft_status_valid(env->status) ? (weft_status_t)env->status : WEFT_ERR_REMOTE;
        char text[1400];
        snprintf(text, sizeof(text), "%s",
                 env->error != NULL && env->error[0] != '\0' ? env->error : weft_strerror(est));
        pending_finish(a, p, est, text, NULL);
    } else if (env->autograd_context != 0 &&
               (ast = weft__call_ag_recv(a, env, o->peer, p->fn, true, &v)) != WEFT_OK) {
        char text[WEFT__ERROR_MAX];
        snprintf(text, sizeof(text), "%s", weft_last_error());
        pending_finish(a, p, ast, text, NULL);
        weft_value_free(v);
    } else {
        if (v == NULL && weft_value_create(&v) != WEFT_OK) {
            pending_finish(a, p, WEFT_ERR_NO_MEMORY, "no memory for the result", NULL);
        } else {
            pending_finish(a, p, WEFT_OK, NULL, v);
            v = NULL;
        }
    }
    weft_value_free(v);
    weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
}

/* Takes out every pending call to @p rank (-1: any rank); returns them as a list. */
static weft__pending_t *take_matching(weft_agent_t *a, int rank, weft_status_t st,
                                      const char *why)
{
    weft__pending_t *list = NULL;

    pthread_mutex_lock(&a->pend_mu);
    for (size_t b = 0; a->npending > 0 && b < WEFT__PENDING_BUCKETS; b++) {
        weft__pending_t **pp = &a->pending[b];
        while (*pp != NULL) {
            weft__pending_t *p = *pp;
            if ((rank < 0 || p->peer == rank) && p->landing) {
                /* Being written into the caller's memory: it ends when the reader is done. */
                if (p->held == WEFT_OK) {
                    char text[1024];
                    snprintf(text, sizeof(text), "call to '%s' on rank %d failed: %s", p->fn,
                             p->peer, why);
                    p->held = st;
                    p->held_why = weft_strdup(text);
                }
                pp = &p->next;
            } else if (rank < 0 || p->peer == rank) {
                *pp = p->next;
                pending_unlinked_locked(a, p);
                p->next = list;
                list = p;
            } else {
                pp = &p->next;
            }
        }
    }
    pthread_mutex_unlock(&a->pend_mu);
    return list;
}

static void fail_matching(weft_agent_t *a, int rank, weft_status_t st, const char *why)
{
    weft__pending_t *list = take_matching(a, rank, st, why);

    while (list != NULL) {
        weft__pending_t *next = list->next;
        char text[1024];
        snprintf(text, sizeof(text), "call to '%s' on rank %d failed: %s", list->fn, list->peer,
                 why);
        pending_finish(a, list, st, text, NULL);
        list = next;
    }
}

void weft__pending_fail_peer(weft_agent_t *a, int rank, weft_status_t st, const char *why)
{
    fail_matching(a, rank, st, why);
}

void weft__pending_fail_all(weft_agent_t *a, weft_status_t st, const char *why)
{
    fail_matching(a, -1, st, why);
}

static weft_status_t check_target(weft_agent_t *a, int to, bool internal)
{
    if (a == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "rpc: NULL agent");
    }
    int state = atomic_load(&a->state);
    if (state == WEFT__AGENT_CREATED && atomic_load(&a->joining)) {
        /* A handler serving a peer that joined first: wait for our own join to end. */
        WEFT_CHECK(weft__agent_wait_joined(a));
        state = atomic_load(&a->state);
    }
    if (state == WEFT__AGENT_CREATED) {
        return weft__set_error(WEFT_ERR_INVALID_STATE, "rpc: the agent has not joined yet");
    }
    if (state >= WEFT__AGENT_CLOSING || (state == WEFT__AGENT_SHUTTING_DOWN && !internal)) {
        /* Handlers may still call during the shutdown barrier: their callers wait for them. */
        if (!(state == WEFT__AGENT_SHUTTING_DOWN && atomic_load(&a->calls_in_progress) > 0)) {
            return weft__set_error(WEFT_ERR_SHUTDOWN, "rpc: the agent is shutting down");
        }
    }
    if (to < 0 || to >= a->world_size) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "rpc: rank %d is not in the world of %d", to,
                               a->world_size);
    }
    return WEFT_OK;
}

weft_status_t weft__call_timeout(const weft_agent_t *a, int64_t timeout_ms, int64_t *ms_p)
{
    if (timeout_ms < 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "rpc: a timeout of %lld ms (0 means the default; a deadline cannot "
                               "be infinite)",
                               (long long)timeout_ms);
    }
    if (timeout_ms == 0) {
        timeout_ms = a->default_timeout_ms;
    }
    *ms_p = timeout_ms < WEFT__MAX_TIMEOUT_MS ? timeout_ms : WEFT__MAX_TIMEOUT_MS;
    return WEFT_OK;
}

static weft_status_t rpc_async(weft_agent_t *a, int to, const char *fn, const weft_value_t *args,
                               int64_t timeout_ms, bool internal, const weft_rpc_into_t *into,
                               size_t n_into, weft_future_t **f_p);

weft_status_t weft__rpc_async(weft_agent_t *a, int to, const char *fn, const weft_value_t *args,
                              int64_t timeout_ms, bool internal, weft_future_t **f_p)
{
    return rpc_async(a, to, fn, args, timeout_ms, internal, NULL, 0, f_p);
}

static weft_status_t rpc_async(weft_agent_t *a, int to, const char *fn, const weft_value_t *args,
                               int64_t timeout_ms, bool internal, const weft_rpc_into_t *into,
                               size_t n_into, weft_future_t **f_p)
{
    uint64_t ag_message = 0;
    weft_status_t st;
    weft_future_t *f;
    weft__pending_t *p;

    if (fn == NULL || fn[0] == '\0' || strlen(fn) > WEFT__MAX_NAME) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "rpc: function name missing or too long");
    }
    /* Counted as the callee counts it: by the reserved prefix (a module's calls go on during
     * the shutdown barrier, as its settling may need them). */
    internal = internal || weft__fn_internal(fn);
    WEFT_CHECK(check_target(a, to, internal));
    WEFT_CHECK(weft__call_timeout(a, timeout_ms, &timeout_ms));
    WEFT_CHECK(weft_future_create(&f));
    p = weft_calloc(1, sizeof(*p));
    if (p != NULL && n_into > 0) {
        p->into = weft_alloc(n_into * sizeof(*into));
        if (p->into != NULL) {
            memcpy(p->into, into, n_into * sizeof(*into));
            p->n_into = n_into;
        }
    }
    if (p == NULL || (p->fn = weft_strdup(fn)) == NULL || (n_into > 0 && p->into == NULL)) {
        if (p != NULL) {
            weft_free(p->fn);
            weft_free(p->into);
        }
        weft_free(p);
        weft_future_release(f);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rpc: no memory");
    }
    uint64_t id = atomic_fetch_add(&a->next_request_id, 1);
    p->id = id;
    p->internal = internal;
    p->peer = to;
    p->f = weft_future_retain(f);
    /* In the table before the request leaves: its answer may come back at once. The way it went
     * is recorded once the route returns (answer_way_ok). */
    pthread_mutex_lock(&a->pend_mu);
    pending_insert(a, p);
    p->timer_id = weft__timer_add(a->timer, weft__now_ns() + timeout_ms * 1000000, pending_deadline,
                                  NULL, a, id, NULL);
    p->path.tp = WEFT__TP_COUNT; /* not known yet */
    pthread_mutex_unlock(&a->pend_mu);
    if (!internal) {
        atomic_fetch_add(&a->requests_sent, 1);
    }
    weft__frame_t fr = {
        .kind = WEFT__V1__KIND__KIND_REQUEST,
        .to = to,
        .value = args,
        .function = fn,
        .request_id = id,
        .timeout_ms = timeout_ms,
        .user_request = !internal,
        /* A module's calls are not recorded (its own protocol), but rref's, which carry the
         * user's tensors. */
        .ag_context = internal && strncmp(fn, "__weft.rref.", 12) != 0 ? 0 : weft__thread_ag_context,
        .ag_message_p = &ag_message,
    };
    weft__path_t path;
    st = weft__route(a, &fr, &path);
    if (st != WEFT_OK) {
        char why[WEFT__ERROR_MAX];
        snprintf(why, sizeof(why), "%s", weft_last_error());
        if (!internal) {
            atomic_fetch_sub(&a->requests_sent, 1);
        }
        pthread_mutex_lock(&a->pend_mu);
        weft__pending_t *q = pending_remove(a, id, -1);
        pthread_mutex_unlock(&a->pend_mu);
        if (!path.handed) {
            /* Refused before it left (bad arguments, over the limit): an error, no future. */
            if (q != NULL) {
                if (q->timer_id != 0) {
                    (void)weft__timer_cancel(a->timer, q->timer_id);
                }
                pending_free(q);
            }
            weft_future_release(f);
            return weft__set_error(st, "%s", why);
        }
        /* Not sent: the call fails through its future like any lost call. */
        if (q != NULL) {
            q->ag_context = fr.ag_context;
            q->ag_message = ag_message;
            pending_finish(a, q, st, why, NULL);
        }
    } else {
        pthread_mutex_lock(&a->pend_mu);
        weft__pending_t *q = pending_find(a, id);
        if (q != NULL) {
            q->path = path;
            q->ag_context = fr.ag_context;
            q->ag_message = ag_message;
        }
        pthread_mutex_unlock(&a->pend_mu);
        if (q == NULL && ag_message != 0 && weft_future_done(f) &&
            weft_future_status(f) != WEFT_OK) {
            /* It failed before its send function was known to the pending call. */
            weft__call_ag_dead(a, fr.ag_context, ag_message);
        }
    }
    *f_p = f;
    return WEFT_OK;
}

weft_status_t weft_rpc_call_local(weft_agent_t *a, const char *fn, weft_value_t *args,
                                  int64_t timeout_ms, weft_future_t **f_p)
{
    weft_rpc_handler_cb_t cb = NULL;
    void *cb_arg = NULL;
    weft_call_t *call;
    weft_future_t *f = NULL;

    if (a == NULL || fn == NULL || f_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "rpc_call_local: NULL argument");
    }
    if (!find_fn(a, fn, &cb, &cb_arg)) {
        return weft__set_error(WEFT_ERR_NO_SUCH_FUNCTION, "no function named '%s' is registered",
                               fn);
    }
    WEFT_CHECK(weft__call_timeout(a, timeout_ms, &timeout_ms));
    call = weft_calloc(1, sizeof(*call));
    if (call == NULL || weft_future_create(&f) != WEFT_OK) {
        weft_free(call);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rpc_call_local: no memory");
    }
    call->function = weft_strdup(fn);
    if (call->function == NULL) {
        weft_future_release(f);
        weft_free(call);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rpc_call_local: no memory");
    }
    if (args == NULL && weft_value_create(&args) != WEFT_OK) {
        weft_free(call->function);
        weft_future_release(f);
        weft_free(call);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rpc_call_local: no memory");
    }
    call->agent = a;
    call->caller = a->rank;
    call->origin.peer = a->rank;
    call->request_id = 0;
    call->internal = true; /* not a message: the termination test does not count it */
    call->deadline_ns = weft__now_ns() + timeout_ms * 1000000;
    call->args = args;
    call->local = weft_future_retain(f);
    call->ag_context = weft__thread_ag_context;
    *f_p = f;
    run_handler(call, cb, cb_arg);
    return WEFT_OK;
}

weft_status_t weft_rpc_async(weft_agent_t *a, int to_rank, const char *fn, const weft_value_t *args,
                             int64_t timeout_ms, weft_future_t **f_p)
{
    if (f_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "rpc_async: NULL future pointer");
    }
    return weft__rpc_async(a, to_rank, fn, args, timeout_ms, false, f_p);
}

weft_status_t weft_rpc_async_into(weft_agent_t *a, int to_rank, const char *fn,
                                  const weft_value_t *args, int64_t timeout_ms,
                                  const weft_rpc_into_t *into, size_t n_into, weft_future_t **f_p)
{
    if (f_p == NULL || (into == NULL && n_into > 0)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "rpc_async_into: NULL future or into");
    }
    for (size_t i = 0; i < n_into; i++) {
        if (into[i].data == NULL && into[i].sink == NULL && into[i].nbytes > 0) {
            return weft__set_error(WEFT_ERR_INVALID_ARG,
                                   "rpc_async_into: entry %zu has neither data nor a sink", i);
        }
    }
    return rpc_async(a, to_rank, fn, args, timeout_ms, false, into, n_into, f_p);
}

weft_status_t weft_rpc_async_to(weft_agent_t *a, const char *to, const char *fn,
                                const weft_value_t *args, int64_t timeout_ms, weft_future_t **f_p)
{
    int rank;

    WEFT_CHECK(weft_agent_worker_rank(a, to, &rank));
    return weft_rpc_async(a, rank, fn, args, timeout_ms, f_p);
}

weft_status_t weft_rpc_sync(weft_agent_t *a, int to_rank, const char *fn, const weft_value_t *args,
                            int64_t timeout_ms, weft_value_t **result_p)
{
    weft_future_t *f;
    int64_t ms = 0;

    WEFT_CHECK(weft_rpc_async(a, to_rank, fn, args, timeout_ms, &f));
    (void)weft__call_timeout(a, timeout_ms, &ms); /* valid: the call was made */
    /* The call's own deadline fails the future (a task on the timer); the margin covers a busy
     * timer thread. */
    weft_status_t st = weft_future_wait(f, ms + 1000);
    if (st == WEFT_ERR_TIMEOUT && !weft_future_done(f)) {
        weft__set_error(st, "rpc_sync: call to '%s' on rank %d passed its deadline", fn, to_rank);
    } else if (st != WEFT_OK) {
        weft__set_error(st, "%s", weft_future_error(f));
    } else if (result_p != NULL) {
        weft_value_t *v = NULL;
        (void)weft_future_take_value(f, &v);
        if (v == NULL) {
            st = weft_value_create(&v);
        }
        if (st == WEFT_OK) {
            *result_p = v;
        }
    }
    weft_future_release(f);
    return st;
}

weft_status_t weft_rpc_sync_to(weft_agent_t *a, const char *to, const char *fn,
                               const weft_value_t *args, int64_t timeout_ms,
                               weft_value_t **result_p)
{
    int rank;

    WEFT_CHECK(weft_agent_worker_rank(a, to, &rank));
    return weft_rpc_sync(a, rank, fn, args, timeout_ms, result_p);
}

/* ------------------------------------------------------------ channel sends */

weft_status_t weft_agent_send(weft_agent_t *a, int to_rank, uint32_t channel,
                              const weft_value_t *msg, weft_future_t **sent_p)
{
    return weft_agent_send_flags(a, to_rank, channel, msg, 0, sent_p);
}

weft_status_t weft_agent_send_flags(weft_agent_t *a, int to_rank, uint32_t channel,
                                    const weft_value_t *msg, uint32_t flags, weft_future_t **sent_p)
{
    weft_future_t *f = NULL;

    WEFT_CHECK(check_target(a, to_rank, true));
    if (channel < 1 || channel > WEFT_CHANNEL_MAX) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "agent_send: channel %u out of 1..%d", channel,
                               WEFT_CHANNEL_MAX);
    }
    if (sent_p != NULL) {
        WEFT_CHECK(weft_future_create(&f));
    }
    weft__frame_t fr = {
        .kind = WEFT__V1__KIND__KIND_ONEWAY,
        .to = to_rank,
        .value = msg,
        .channel = channel,
        .flags = flags,
        .sent = f != NULL ? weft_future_retain(f) : NULL,
    };
    weft_status_t st = weft__route(a, &fr, NULL);
    if (st != WEFT_OK) {
        weft_future_release(f);
        return st;
    }
    if (sent_p != NULL) {
        *sent_p = f;
    }
    return WEFT_OK;
}
