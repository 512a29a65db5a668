/* Calls: the registry of functions, incoming calls and their replies,
 * outgoing calls (pending table, deadlines), module channel sends. */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

struct weft_call {
    weft_agent_t *agent;
    weft__stream_t *stream;
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
};

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

    if (call->stream != NULL) {
        weft__stream_unref(call->stream);
    }
    weft_future_release(call->local);
    weft_value_free(call->args);
    weft_free(call->function);
    weft_free(call);
    if (!internal) {
        atomic_fetch_sub(&a->calls_in_progress, 1);
    }
}

static void send_response(weft_call_t *call, weft_status_t st, const char *text,
                          const weft_value_t *result)
{
    weft_agent_t *a = call->agent;
    Weft__V1__Envelope env = WEFT__V1__ENVELOPE__INIT;
    weft__outmsg_t *m;

    if (call->local != NULL) {
        /* A local call's failure (its success goes through weft_call_reply). */
        weft_future_complete(call->local, st, text, NULL);
        return;
    }

    env.kind = WEFT__V1__KIND__KIND_RESPONSE;
    env.request_id = call->request_id;
    env.src_rank = a->rank;
    env.status = st;
    env.error = (char *)(text != NULL ? text : "");
    weft__refs_out_t *refs = NULL;
    weft_status_t est =
        st == WEFT_OK ? weft__refs_encode(a, call->caller, result, &env, &refs) : WEFT_OK;
    if (est == WEFT_OK) {
        est = weft__wire_encode(&env, st == WEFT_OK ? result : NULL, &m);
        if (est == WEFT_OK) {
            m->refs = refs; /* "unsent" if the answer is freed unsent */
        } else {
            weft__refs_out_free(refs, false);
        }
    }
    if (est == WEFT_OK && st == WEFT_OK) {
        uint64_t limit = call->stream != NULL ? weft__stream_peer_max(call->stream)
                                              : a->peers[call->caller].max_message_bytes;
        if (limit > 0 && m->nbytes > limit) {
            char why[256];
            snprintf(why, sizeof(why),
                     "result of '%s' on %s is %zu bytes, over the caller's limit of %llu bytes",
                     call->function, a->name, m->nbytes, (unsigned long long)limit);
            weft__outmsg_free(m, WEFT_ERR_TOO_LARGE, why);
            send_response(call, WEFT_ERR_TOO_LARGE, why, NULL);
            return;
        }
    }
    if (est != WEFT_OK) {
        char why[512];
        snprintf(why, sizeof(why), "result of '%s' on %s could not be encoded: %s", call->function,
                 a->name, weft_last_error());
        if (st == WEFT_OK) {
            send_response(call, est, why, NULL);
        }
        return;
    }
    weft_status_t sst;
    /* Large answers go direct; so does every answer to a request that came direct,
     * which keeps a bulk transfer's round trips off the stream. */
    if (weft__direct_usable(a, call->caller, m->nbytes) ||
        (call->stream == NULL && weft__direct_available(a, call->caller))) {
        sst = weft__direct_send(a, call->caller, m);
    } else if (call->stream != NULL) {
        sst = weft__stream_send(call->stream, m);
    } else {
        /* The request came directly: answer on our own stream to the caller. */
        weft__stream_t *s;
        sst = weft__peer_stream(a, call->caller, &s);
        if (sst == WEFT_OK) {
            sst = weft__stream_send(s, m);
            weft__stream_unref(s);
        } else {
            weft__outmsg_free(m, sst, weft_last_error());
        }
    }
    if (sst != WEFT_OK) {
        WEFT_DEBUG("reply to rank %d for '%s' dropped: %s", call->caller, call->function,
                   weft_last_error());
    }
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

void weft__call_dispatch(weft_agent_t *a, weft__stream_t *s, Weft__V1__Envelope *env,
                         weft_value_t *args)
{
    weft__call_dispatch_from(a, s, weft__stream_peer(s), env, args);
}

/* The objects of the arguments' references are ready (or one failed): run the handler. */
static void args_ready(weft_status_t st, const char *text, void *arg)
{
    weft_call_t *call = arg;

    if (st != WEFT_OK) {
        weft_call_fail(call, st, "%s", text);
        return;
    }
    call->handler(call, call->handler_arg);
}

void weft__call_dispatch_from(weft_agent_t *a, weft__stream_t *s, int peer, Weft__V1__Envelope *env,
                              weft_value_t *args)
{
    weft_call_t *call = weft_calloc(1, sizeof(*call));
    weft__fn_t *fn = NULL;
    weft_future_t **ready = NULL;
    size_t nready = 0;

    if (call == NULL) {
        WEFT_ERROR("no memory for an incoming call");
        goto out;
    }
    if (s != NULL) {
        weft__stream_ref(s);
    }
    call->agent = a;
    call->stream = s;
    call->request_id = env->request_id;
    call->caller = peer;
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
            rst = weft__refs_decode(a, peer, env, call->args, &ready, &nready);
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
    pthread_rwlock_rdlock(&a->reg_mu);
    for (fn = a->fns; fn != NULL; fn = fn->next) {
        if (strcmp(fn->name, call->function) == 0) {
            break;
        }
    }
    weft_rpc_handler_cb_t cb = fn != NULL ? fn->cb : NULL;
    void *arg = fn != NULL ? fn->arg : NULL;
    pthread_rwlock_unlock(&a->reg_mu);
    if (cb == NULL) {
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
    cb(call, arg);
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

/* Removes the call @p id made to @p peer (-1: any peer). */
static weft__pending_t *pending_remove(weft_agent_t *a, uint64_t id, int peer)
{
    weft__pending_t **pp = &a->pending[bucket(id)];

    for (; *pp != NULL; pp = &(*pp)->next) {
        if ((*pp)->id == id && (peer < 0 || (*pp)->peer == peer)) {
            weft__pending_t *p = *pp;
            *pp = p->next;
            a->npending--;
            if (!p->internal) {
                atomic_fetch_sub(&a->pending_user, 1);
            }
            if (a->npending == 0) {
                pthread_cond_broadcast(&a->pend_cv);
            }
            return p;
        }
    }
    return NULL;
}

static void pending_finish(weft__pending_t *p, weft_status_t st, const char *text, weft_value_t *v)
{
    weft_future_complete(p->f, st, text, v);
    weft_future_release(p->f);
    weft_free(p->fn);
    weft_free(p);
}

void weft__call_response(weft_agent_t *a, int peer, Weft__V1__Envelope *env, weft_value_t *v)
{
    pthread_mutex_lock(&a->pend_mu);
    weft__pending_t *p = pending_remove(a, env->request_id, peer);
    pthread_mutex_unlock(&a->pend_mu);

    if (env->status == 0 && env->n_refs > 0) {
        /* Decoded even when no call waits any more: released with the value, they settle. Their
         * objects are not awaited. */
        weft_future_t **ready = NULL;
        size_t nready = 0;
        weft_status_t rst = v != NULL ? WEFT_OK : weft_value_create(&v);
        if (rst == WEFT_OK) {
            rst = weft__refs_decode(a, peer, env, v, &ready, &nready);
        }
        drop_ready(ready, nready);
        if (rst != WEFT_OK) {
            char text[WEFT__ERROR_MAX];
            snprintf(text, sizeof(text), "result from rank %d: %s", peer, weft_last_error());
            WEFT_WARN("%s", text);
            weft_value_free(v);
            v = NULL;
            if (p != NULL) {
                pending_finish(p, rst, text, NULL);
            }
            weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
            return;
        }
    }
    if (p == NULL) {
        /* Timed out or failed already (or not a call to this peer): dropped. */
        WEFT_DEBUG("response %llu from rank %d matches no pending call; dropped",
                   (unsigned long long)env->request_id, peer);
    } else if (env->status != 0) {
        weft_status_t st =
            weft_status_valid(env->status) ? (weft_status_t)env->status : WEFT_ERR_REMOTE;
        char text[1400];
        snprintf(text, sizeof(text), "%s",
                 env->error != NULL && env->error[0] != '\0' ? env->error : weft_strerror(st));
        pending_finish(p, st, text, NULL);
    } else {
        pending_finish(p, WEFT_OK, NULL, v);
        v = NULL;
    }
    weft_value_free(v);
    weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
}

void weft__pending_fail_id(weft_agent_t *a, int peer, uint64_t id, weft_status_t st,
                           const char *why)
{
    pthread_mutex_lock(&a->pend_mu);
    weft__pending_t *p = pending_remove(a, id, peer);
    pthread_mutex_unlock(&a->pend_mu);
    if (p != NULL) {
        pending_finish(p, st, why, NULL);
    }
}

/* Fails every pending call matching @p rank (-1: all). */
/* Takes out every pending call to @p rank (-1: any rank) whose deadline is at or
 * before @p due_ns (INT64_MAX: any deadline); returns them as a list. */
static weft__pending_t *take_matching(weft_agent_t *a, int rank, int64_t due_ns)
{
    weft__pending_t *list = NULL;

    pthread_mutex_lock(&a->pend_mu);
    for (size_t b = 0; a->npending > 0 && b < WEFT__PENDING_BUCKETS; b++) {
        weft__pending_t **pp = &a->pending[b];
        while (*pp != NULL) {
            weft__pending_t *p = *pp;
            if ((rank < 0 || p->peer == rank) && p->deadline_ns <= due_ns) {
                *pp = p->next;
                a->npending--;
                if (!p->internal) {
                    atomic_fetch_sub(&a->pending_user, 1);
                }
                p->next = list;
                list = p;
            } else {
                pp = &p->next;
            }
        }
    }
    if (a->npending == 0) {
        pthread_cond_broadcast(&a->pend_cv);
    }
    pthread_mutex_unlock(&a->pend_mu);
    return list;
}

static void fail_matching(weft_agent_t *a, int rank, weft_status_t st, const char *why)
{
    weft__pending_t *list = take_matching(a, rank, INT64_MAX);

    while (list != NULL) {
        weft__pending_t *next = list->next;
        char text[1024];
        snprintf(text, sizeof(text), "call to '%s' on rank %d failed: %s", list->fn, list->peer,
                 why);
        pending_finish(list, st, text, NULL);
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

void weft__pending_sweep(weft_agent_t *a)
{
    weft__pending_t *list = take_matching(a, -1, weft__now_ns());

    while (list != NULL) {
        weft__pending_t *next = list->next;
        char text[512];
        snprintf(text, sizeof(text), "call to '%s' on %s (rank %d) passed its deadline", list->fn,
                 a->peers[list->peer].name != NULL ? a->peers[list->peer].name : "?", list->peer);
        pending_finish(list, WEFT_ERR_TIMEOUT, text, NULL);
        list = next;
    }
}

weft_status_t weft__peer_stream(weft_agent_t *a, int to, weft__stream_t **s_p)
{
    weft_status_t st = WEFT_OK;
    weft__peer_t *p = &a->peers[to];

    if (atomic_load(&a->state) >= WEFT__AGENT_CLOSED) {
        /* The queue is shut down: no stream can be opened any more. */
        return weft__set_error(WEFT_ERR_SHUTDOWN, "rpc: the agent is closed");
    }
    pthread_mutex_lock(&p->mu);
    if (p->lost) {
        st = weft__set_error(WEFT_ERR_PEER_LOST, "%s (rank %d) was lost: %s", p->name, to,
                             p->lost_why != NULL ? p->lost_why : "");
    } else if (p->stream == NULL) {
        st = weft__stream_open(a, p, &p->stream);
    }
    if (st == WEFT_OK) {
        weft__stream_ref(p->stream);
        *s_p = p->stream;
    }
    pthread_mutex_unlock(&p->mu);
    return st;
}

static weft_status_t check_target(weft_agent_t *a, int to, bool internal)
{
    if (a == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "rpc: NULL agent");
    }
    int state = atomic_load(&a->state);
    if (state == WEFT__AGENT_CREATED && atomic_load(&a->joining)) {
        /* A handler serving a peer that joined first: wait for our own join to end. */
        weft_status_t st = weft_future_wait(a->join_done, a->rendezvous_timeout_ms + 5000);
        if (st != WEFT_OK) {
            return weft__set_error(WEFT_ERR_INVALID_STATE, "rpc: the agent's join failed: %s",
                                   weft_future_error(a->join_done));
        }
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

weft_status_t weft__rpc_async(weft_agent_t *a, int to, const char *fn, const weft_value_t *args,
                              int64_t timeout_ms, bool internal, weft_future_t **f_p)
{
    weft_status_t st;
    weft__stream_t *s;
    weft__outmsg_t *m;
    weft_future_t *f;
    weft__pending_t *p;

    WEFT_CHECK(check_target(a, to, internal));
    if (fn == NULL || fn[0] == '\0' || strlen(fn) > WEFT__MAX_NAME) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "rpc: function name missing or too long");
    }
    /* Counted as the callee counts it: by the reserved prefix. */
    internal = weft__fn_internal(fn);
    if (timeout_ms <= 0) {
        timeout_ms = a->default_timeout_ms;
    }
    if (timeout_ms > WEFT__MAX_TIMEOUT_MS) {
        timeout_ms = WEFT__MAX_TIMEOUT_MS;
    }
    Weft__V1__Envelope env = WEFT__V1__ENVELOPE__INIT;
    uint64_t id = atomic_fetch_add(&a->next_request_id, 1);
    env.kind = WEFT__V1__KIND__KIND_REQUEST;
    env.request_id = id;
    env.function = (char *)fn;
    env.timeout_ms = timeout_ms;
    env.src_rank = a->rank;
    weft__refs_out_t *refs;
    WEFT_CHECK(weft__refs_encode(a, to, args, &env, &refs));
    st = weft__wire_encode(&env, args, &m);
    if (st != WEFT_OK) {
        weft__refs_out_free(refs, false);
        return st;
    }
    m->refs = refs; /* from here on, freeing @p m unsent runs the codecs' unsent */
    uint64_t limit = a->peers[to].max_message_bytes;
    if (limit > 0 && m->nbytes > limit) {
        st = weft__set_error(WEFT_ERR_TOO_LARGE,
                             "rpc: call to '%s' is %zu bytes, over %s's limit of %llu bytes", fn,
                             m->nbytes, a->peers[to].name, (unsigned long long)limit);
        goto err_free_msg;
    }
    WEFT_CHECK_GOTO(weft_future_create(&f), st, err_free_msg);
    p = weft_calloc(1, sizeof(*p));
    if (p == NULL || (p->fn = weft_strdup(fn)) == NULL) {
        weft_free(p);
        st = weft__set_error(WEFT_ERR_NO_MEMORY, "rpc: no memory");
        goto err_free_future;
    }
    bool direct = weft__direct_usable(a, to, m->nbytes);
    WEFT_CHECK_GOTO(weft__peer_stream(a, to, &s), st, err_free_pending);
    p->id = id;
    p->internal = internal;
    p->peer = to;
    p->deadline_ns = weft__now_ns() + timeout_ms * 1000000;
    p->f = weft_future_retain(f);
    pthread_mutex_lock(&a->pend_mu);
    pending_insert(a, p);
    pthread_mutex_unlock(&a->pend_mu);
    if (!internal) {
        atomic_fetch_add(&a->requests_sent, 1);
        m->user_request = true;
    }
    weft_status_t sst = direct ? weft__direct_send(a, to, m) : weft__stream_send(s, m);
    if (sst != WEFT_OK) {
        /* Not sent: the call fails through its future like any lost call. */
        char why[512];
        snprintf(why, sizeof(why), "%s", weft_last_error());
        if (!internal) {
            atomic_fetch_sub(&a->requests_sent, 1);
        }
        pthread_mutex_lock(&a->pend_mu);
        weft__pending_t *q = pending_remove(a, id, -1);
        pthread_mutex_unlock(&a->pend_mu);
        if (q != NULL) {
            pending_finish(q, sst, why, NULL);
        }
    }
    weft__stream_unref(s);
    *f_p = f;
    return WEFT_OK;

err_free_pending:
    weft_free(p->fn);
    weft_free(p);
err_free_future:
    weft_future_release(f);
err_free_msg:
    weft__outmsg_free(m, st, NULL); /* not sent (it has no sent future) */
    return st;
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
    pthread_rwlock_rdlock(&a->reg_mu);
    for (weft__fn_t *e = a->fns; e != NULL; e = e->next) {
        if (strcmp(e->name, fn) == 0) {
            cb = e->cb;
            cb_arg = e->arg;
            break;
        }
    }
    pthread_rwlock_unlock(&a->reg_mu);
    if (cb == NULL) {
        return weft__set_error(WEFT_ERR_NO_SUCH_FUNCTION, "no function named '%s' is registered",
                               fn);
    }
    if (timeout_ms <= 0) {
        timeout_ms = a->default_timeout_ms;
    }
    if (timeout_ms > WEFT__MAX_TIMEOUT_MS) {
        timeout_ms = WEFT__MAX_TIMEOUT_MS;
    }
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
    call->request_id = 0;
    call->internal = true; /* not a message: the termination test does not count it */
    call->deadline_ns = weft__now_ns() + timeout_ms * 1000000;
    call->args = args;
    call->local = weft_future_retain(f);
    *f_p = f;
    cb(call, cb_arg);
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

    WEFT_CHECK(weft_rpc_async(a, to_rank, fn, args, timeout_ms, &f));
    /* The call's own deadline fails the future; the margin covers the sweep period. */
    int64_t limit = (timeout_ms > 0 ? timeout_ms : a->default_timeout_ms) + 2000;
    weft_status_t st = weft_future_wait(f, limit);
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
    weft_status_t st;
    weft__stream_t *s;
    weft__outmsg_t *m;
    weft_future_t *f = NULL;

    WEFT_CHECK(check_target(a, to_rank, true));
    if (channel < 1 || channel > WEFT_CHANNEL_MAX) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "agent_send: channel %u out of 1..%d", channel,
                               WEFT_CHANNEL_MAX);
    }
    Weft__V1__Envelope env = WEFT__V1__ENVELOPE__INIT;
    env.kind = WEFT__V1__KIND__KIND_ONEWAY;
    env.channel = channel;
    env.src_rank = a->rank;
    weft__refs_out_t *refs;
    WEFT_CHECK(weft__refs_encode(a, to_rank, msg, &env, &refs));
    st = weft__wire_encode(&env, msg, &m);
    if (st != WEFT_OK) {
        weft__refs_out_free(refs, false);
        return st;
    }
    m->refs = refs;
    uint64_t limit = a->peers[to_rank].max_message_bytes;
    if (limit > 0 && m->nbytes > limit) {
        st = weft__set_error(WEFT_ERR_TOO_LARGE,
                             "agent_send: message is %zu bytes, over %s's limit of %llu bytes",
                             m->nbytes, a->peers[to_rank].name, (unsigned long long)limit);
        goto err_free_msg;
    }
    if (sent_p != NULL) {
        WEFT_CHECK_GOTO(weft_future_create(&f), st, err_free_msg);
        m->sent = weft_future_retain(f);
    }
    /* With references it stays on the stream, whose receiver decodes them. */
    if ((flags & WEFT_SEND_UNORDERED) != 0 && m->nbytes >= WEFT__DIRECT_MIN_UNORDERED &&
        refs == NULL && weft__direct_available(a, to_rank)) {
        /* takes the message either way */
        st = weft__direct_send_ex(a, to_rank, m, (flags & WEFT_SEND_INLINE) != 0);
        if (st != WEFT_OK) {
            weft_future_release(f);
            return st;
        }
        if (sent_p != NULL) {
            *sent_p = f;
        }
        return WEFT_OK;
    }
    WEFT_CHECK_GOTO(weft__peer_stream(a, to_rank, &s), st, err_free_future);
    st = weft__stream_send(s, m); /* takes the message either way */
    weft__stream_unref(s);
    if (st != WEFT_OK) {
        weft_future_release(f);
        return st;
    }
    if (sent_p != NULL) {
        *sent_p = f;
    }
    return WEFT_OK;

err_free_future:
    if (f != NULL) {
        weft_future_release(m->sent);
        m->sent = NULL;
        weft_future_release(f);
    }
err_free_msg:
    weft__outmsg_free(m, st, NULL); /* not sent (its sent future is gone) */
    return st;
}
