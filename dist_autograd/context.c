/* Distributed autograd's module: contexts, the call hooks that record send and receive functions,
 * and the control messages (finish, fail, release) that travel from worker to worker. */
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* ------------------------------------------------------------------ names and small helpers */

char *dist__name_of(dist_t *d, int rank, char *buf, size_t n)
{
    const char *name = weft_agent_worker_name(d->a, rank);

    if (name != NULL) {
        snprintf(buf, n, "%s", name);
    } else {
        snprintf(buf, n, "rank %d", rank);
    }
    return buf;
}

void dist__known_add_locked(dctx_t *c, int rank)
{
    for (size_t i = 0; i < c->n_known; i++) {
        if (c->known[i] == rank) {
            return;
        }
    }
    if (c->n_known == c->cap_known) {
        size_t ncap = c->cap_known == 0 ? 4 : c->cap_known * 2;
        int *k = weft_realloc(c->known, ncap * sizeof(*k));

        if (k == NULL) {
            return; /* out of memory: this worker is not told of release; its TTL drops it */
        }
        c->known = k;
        c->cap_known = ncap;
    }
    c->known[c->n_known++] = rank;
}

void dist__send_unref(dsend_t *s)
{
    if (s != NULL && atomic_fetch_sub(&s->refs, 1) == 1) {
        weft_future_release(s->arrived);
        weft_free(s->fn);
        weft_free(s->dtype);
        weft_free(s->numel);
        weft_free(s);
    }
}

static void send_unref_cb(void *p)
{
    dist__send_unref(p);
}

void dist__recv_free(void *p)
{
    drecv_t *r = p;

    if (r != NULL) {
        weft_free(r->fn);
        weft_free(r);
    }
}

void dist__fail_futures(weft_future_t **f, size_t n, weft_status_t st, const char *why)
{
    for (size_t i = 0; i < n; i++) {
        weft_future_complete(f[i], st, why, NULL);
        weft_future_release(f[i]);
    }
    weft_free(f);
}

/* ------------------------------------------------------------------ the table */

static size_t bucket_of(const dist_t *d, uint64_t id)
{
    return (size_t)((id * 0x9E3779B97F4A7C15ull) >> 32) & (d->nbuckets - 1);
}

static void ctx_free(dctx_t *c)
{
    for (size_t i = 0; i < c->n_sends; i++) {
        weft_ag_node_release(c->sends[i]->node);
        c->sends[i]->node = NULL;
        dist__send_unref(c->sends[i]);
    }
    weft_free(c->sends);
    dist__grads_free_locked(c);
    weft_free(c->known);
    if (c->run != NULL) {
        dist__run_unref(c->run);
    }
    pthread_mutex_destroy(&c->mu);
    weft_free(c);
}

void dist__ctx_unref(dctx_t *c)
{
    if (c != NULL && atomic_fetch_sub(&c->refs, 1) == 1) {
        ctx_free(c);
    }
}

dctx_t *dist__find(dist_t *d, uint64_t id)
{
    dctx_t *c;

    pthread_mutex_lock(&d->mu);
    for (c = d->buckets[bucket_of(d, id)]; c != NULL; c = c->next) {
        if (c->id == id) {
            atomic_fetch_add(&c->refs, 1);
            break;
        }
    }
    pthread_mutex_unlock(&d->mu);
    return c;
}

/* Called with d->mu held. */
static weft_status_t table_grow_locked(dist_t *d)
{
    size_t nb = d->nbuckets * 2;
    dctx_t **b = weft_calloc(nb, sizeof(*b));

    if (b == NULL) {
        return WEFT_OK; /* longer chains, still correct */
    }
    for (size_t i = 0; i < d->nbuckets; i++) {
        dctx_t *c = d->buckets[i];

        while (c != NULL) {
            dctx_t *next = c->next;
            size_t k = (size_t)((c->id * 0x9E3779B97F4A7C15ull) >> 32) & (nb - 1);

            c->next = b[k];
            b[k] = c;
            c = next;
        }
    }
    weft_free(d->buckets);
    d->buckets = b;
    d->nbuckets = nb;
    return WEFT_OK;
}

/* The context @p id, made (in the table) if this worker does not have it yet. Retained. */
static weft_status_t ctx_get(dist_t *d, uint64_t id, bool create, dctx_t **c_p)
{
    dctx_t *c;

    pthread_mutex_lock(&d->mu);
    for (c = d->buckets[bucket_of(d, id)]; c != NULL; c = c->next) {
        if (c->id == id) {
            atomic_fetch_add(&c->refs, 1);
            pthread_mutex_unlock(&d->mu);
            *c_p = c;
            return WEFT_OK;
        }
    }
    if (!create) {
        pthread_mutex_unlock(&d->mu);
        return weft__set_error(WEFT_ERR_NOT_FOUND,
                               "distributed autograd context %llx does not exist on %s",
                               (unsigned long long)id, d->name);
    }
    c = weft_calloc(1, sizeof(*c));
    if (c == NULL) {
        pthread_mutex_unlock(&d->mu);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "dist_autograd: no memory for a context");
    }
    atomic_init(&c->refs, 2); /* the table's and the caller's */
    c->d = d;
    c->id = id;
    c->origin = (int)(id >> 48);
    pthread_mutex_init(&c->mu, NULL);
    c->touched_ns = weft__now_ns();
    c->in_table = true;
    if (d->n + 1 > d->nbuckets) {
        (void)table_grow_locked(d);
    }
    size_t b = bucket_of(d, id);
    c->next = d->buckets[b];
    d->buckets[b] = c;
    d->n++;
    pthread_mutex_unlock(&d->mu);
    *c_p = c;
    return WEFT_OK;
}

/* Takes @p c out of the table (the table's reference goes to the caller). False if it was out. */
static bool ctx_remove(dist_t *d, dctx_t *c)
{
    bool found = false;

    pthread_mutex_lock(&d->mu);
    for (dctx_t **pp = &d->buckets[bucket_of(d, c->id)]; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == c) {
            *pp = c->next;
            c->next = NULL;
            d->n--;
            found = true;
            break;
        }
    }
    pthread_mutex_unlock(&d->mu);
    if (found) {
        pthread_mutex_lock(&c->mu);
        c->in_table = false;
        pthread_mutex_unlock(&c->mu);
    }
    return found;
}

/* Every context in the table, retained (for sweeps). */
static dctx_t **ctx_snapshot(dist_t *d, size_t *n_p)
{
    dctx_t **all;
    size_t k = 0;

    pthread_mutex_lock(&d->mu);
    all = weft_calloc(d->n + 1, sizeof(*all));
    if (all != NULL) {
        for (size_t i = 0; i < d->nbuckets; i++) {
            for (dctx_t *c = d->buckets[i]; c != NULL; c = c->next) {
                atomic_fetch_add(&c->refs, 1);
                all[k++] = c;
            }
        }
    }
    pthread_mutex_unlock(&d->mu);
    *n_p = k;
    return all;
}

/* ------------------------------------------------------------------ recording (the call hooks) */

static weft_status_t on_send(void *arg, int to, const char *fn, bool reply, const weft_value_t *v,
                             weft_call_autograd_t *ag)
{
    dist_t *d = arg;
    dctx_t *c = NULL;
    weft_tensor_t *in_inline[16];
    weft_tensor_t **in = in_inline;
    uint32_t *idx = NULL;
    dsend_t *s = NULL;
    weft_ag_node_t *node = NULL;
    weft_status_t st;
    size_t nt = v == NULL ? 0 : weft_value_num_tensors(v);
    int k = 0;

    if (ctx_get(d, ag->context, false, &c) != WEFT_OK) {
        return weft__set_error(WEFT_ERR_NOT_FOUND,
                               "%s of '%s': distributed autograd context %llx does not exist on %s "
                               "(released already?)",
                               reply ? "the answer" : "a call", fn != NULL ? fn : "?",
                               (unsigned long long)ag->context, d->name);
    }
    pthread_mutex_lock(&c->mu);
    dist__known_add_locked(c, to);
    c->touched_ns = weft__now_ns();
    pthread_mutex_unlock(&c->mu);
    /* An answer is recorded whatever the answering thread's grad mode: its tensors require
     * gradients because the handler computed them so. */
    if (nt == 0 || (!reply && !weft_grad_enabled())) {
        dist__ctx_unref(c);
        return WEFT_OK;
    }
    for (size_t i = 0; i < nt; i++) {
        if (weft_tensor_requires_grad(weft_value_tensor(v, i))) {
            k++;
        }
    }
    if (k == 0) {
        dist__ctx_unref(c);
        return WEFT_OK;
    }
    if ((size_t)k > sizeof(in_inline) / sizeof(in_inline[0])) {
        in = weft_calloc((size_t)k, sizeof(*in));
    }
    idx = weft_alloc((size_t)k * sizeof(*idx));
    s = weft_calloc(1, sizeof(*s));
    if (s != NULL) {
        s->dtype = weft_calloc((size_t)k, sizeof(*s->dtype));
        s->numel = weft_calloc((size_t)k, sizeof(*s->numel));
    }
    if (in == NULL || idx == NULL || s == NULL || s->dtype == NULL || s->numel == NULL ||
        (s->fn = weft_strdup(fn != NULL ? fn : "?")) == NULL) {
        st = weft__set_error(WEFT_ERR_NO_MEMORY, "dist_autograd: no memory to record a call");
        goto fail;
    }
    k = 0;
    for (size_t i = 0; i < nt; i++) {
        weft_tensor_t *t = weft_value_tensor(v, i);

        if (weft_tensor_requires_grad(t)) {
            in[k] = t;
            s->dtype[k] = weft_tensor_dtype(t);
            s->numel[k] = weft_tensor_numel(t);
            idx[k++] = (uint32_t)i;
        }
    }
    atomic_init(&s->refs, 2); /* the context's list and the node's state */
    s->msg = ((uint64_t)d->rank << 48) | (atomic_fetch_add(&d->next_msg, 1) & 0xFFFFFFFFFFFFull);
    s->peer = to;
    s->reply = reply;
    s->n = k;
    st = weft_ag_node_create("SendRpcBackward", dist__send_backward, k, in, s, send_unref_cb, &node);
    if (st != WEFT_OK) {
        atomic_store(&s->refs, 1);
        goto fail;
    }
    s->node = node; /* the list's reference */
    pthread_mutex_lock(&c->mu);
    if (c->n_sends == c->cap_sends) {
        size_t ncap = c->cap_sends == 0 ? 8 : c->cap_sends * 2;
        dsend_t **ns = weft_realloc(c->sends, ncap * sizeof(*ns));

        if (ns == NULL) {
            pthread_mutex_unlock(&c->mu);
            weft_ag_node_release(node); /* drops the node's reference to s */
            s->node = NULL;
            atomic_store(&s->refs, 1);
            st = weft__set_error(WEFT_ERR_NO_MEMORY, "dist_autograd: no memory to record a call");
            goto fail;
        }
        c->sends = ns;
        c->cap_sends = ncap;
    }
    c->sends[c->n_sends++] = s;
    pthread_mutex_unlock(&c->mu);
    ag->message = s->msg;
    ag->grads = idx;
    ag->n_grads = (size_t)k;
    if (in != in_inline) {
        weft_free(in);
    }
    dist__ctx_unref(c);
    return WEFT_OK;

fail:
    if (s != NULL) {
        dist__send_unref(s);
    }
    weft_free(idx);
    if (in != in_inline) {
        weft_free(in);
    }
    dist__ctx_unref(c);
    return st;
}

static weft_status_t on_recv(void *arg, int from, const char *fn, bool reply,
                             const weft_call_autograd_t *ag, weft_value_t *v)
{
    dist_t *d = arg;
    dctx_t *c = NULL;
    weft_tensor_t *out_inline[16];
    weft_tensor_t **out = out_inline;
    drecv_t *r = NULL;
    weft_ag_node_t *node = NULL;
    weft_status_t st = WEFT_OK;
    size_t k = ag->message != 0 ? ag->n_grads : 0;

    if ((int)(ag->context >> 48) >= d->world) {
        return weft__set_error(WEFT_ERR_PROTOCOL, "'%s' from rank %d carries context %llx of no rank",
                               fn != NULL ? fn : "?", from, (unsigned long long)ag->context);
    }
    /* A context comes to life here only by another worker's call: an answer, or a call in one
     * of this worker's own contexts, that finds none came after its release. */
    if (ctx_get(d, ag->context, !reply && (int)(ag->context >> 48) != d->rank, &c) != WEFT_OK) {
        return weft__set_error(WEFT_ERR_NOT_FOUND,
                               "%s '%s' from rank %d is in distributed autograd context %llx, "
                               "which %s no longer holds (released)",
                               reply ? "the answer of" : "a call of", fn != NULL ? fn : "?", from,
                               (unsigned long long)ag->context, d->name);
    }
    pthread_mutex_lock(&c->mu);
    dist__known_add_locked(c, from);
    c->touched_ns = weft__now_ns();
    pthread_mutex_unlock(&c->mu);
    if (k == 0) {
        dist__ctx_unref(c);
        return WEFT_OK;
    }
    if (k > sizeof(out_inline) / sizeof(out_inline[0])) {
        out = weft_calloc(k, sizeof(*out));
    }
    r = weft_calloc(1, sizeof(*r));
    if (out == NULL || r == NULL || (r->fn = weft_strdup(fn != NULL ? fn : "?")) == NULL) {
        st = weft__set_error(WEFT_ERR_NO_MEMORY, "dist_autograd: no memory to record a call");
        goto out;
    }
    for (size_t i = 0; i < k; i++) {
        weft_tensor_t *t = weft_value_tensor(v, ag->grads[i]);
        weft_dtype_t dt = weft_tensor_dtype(t);

        for (size_t j = 0; j < i; j++) {
            if (ag->grads[j] == ag->grads[i]) {
                st = weft__set_error(WEFT_ERR_PROTOCOL,
                                     "'%s' from rank %d marks tensor %u twice for gradients",
                                     r->fn, from, ag->grads[i]);
                goto out;
            }
        }
        if (dt != WEFT_F32 && dt != WEFT_F64) {
            st = weft__set_error(WEFT_ERR_PROTOCOL,
                                 "'%s' from rank %d marks a %s tensor for gradients (f32 and f64 "
                                 "only)",
                                 r->fn, from, weft_dtype_name(dt));
            goto out;
        }
        out[i] = t;
    }
    r->d = d;
    r->ctx = ag->context;
    r->peer = from;
    r->msg = ag->message;
    r->reply = reply;
    r->n = (int)k;
    st = weft_ag_node_create("RecvRpcBackward", dist__recv_backward, 0, NULL, r, dist__recv_free,
                             &node);
    if (st != WEFT_OK) {
        goto out;
    }
    r = NULL; /* the node's */
    st = weft_ag_node_attach(node, (int)k, out);
    weft_ag_node_release(node);

out:
    dist__recv_free(r);
    if (out != out_inline) {
        weft_free(out);
    }
    dist__ctx_unref(c);
    return st;
}

static void on_dead(void *arg, uint64_t context, uint64_t message)
{
    dist_t *d = arg;
    dctx_t *c = dist__find(d, context);
    weft_future_t *f = NULL;

    if (c == NULL) {
        return;
    }
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < c->n_sends; i++) {
        dsend_t *s = c->sends[i];
        drun_t *r = c->run;

        if (s->msg != message) {
            continue;
        }
        s->dead = true;
        /* A run waiting for it lets it go without a gradient. */
        if (r != NULL && !r->ended && !r->stopping && s->pass == r->pass && !s->got) {
            s->got = true;
            r->delivered++;
            f = weft_future_retain(s->arrived);
        }
        break;
    }
    pthread_mutex_unlock(&c->mu);
    if (f != NULL) {
        weft_future_complete(f, WEFT_OK, NULL, NULL);
        weft_future_release(f);
    }
    dist__ctx_unref(c);
}

/* ------------------------------------------------------------------ control messages */

typedef struct {
    _Atomic int left;
    pthread_mutex_t mu;
    dist_t *d;
    int kind;
    dunused_t *unused;
    size_t n_unused, cap_unused;
    weft_status_t status;
    char error[600];
    weft_future_t *out;
} gather_t;

static void gather_unused(gather_t *g, int worker, int peer, bool reply, uint64_t msg,
                          const char *fn)
{
    if (g->n_unused == g->cap_unused) {
        size_t ncap = g->cap_unused == 0 ? 4 : g->cap_unused * 2;
        dunused_t *u = weft_realloc(g->unused, ncap * sizeof(*u));

        if (u == NULL) {
            return;
        }
        g->unused = u;
        g->cap_unused = ncap;
    }
    dunused_t *u = &g->unused[g->n_unused];
    u->fn = weft_strdup(fn != NULL ? fn : "?");
    if (u->fn == NULL) {
        return;
    }
    u->worker = worker;
    u->peer = peer;
    u->reply = reply;
    u->msg = msg;
    g->n_unused++;
}

static void gather_merge(gather_t *g, const Weft__V1__DistControlReply *r)
{
    pthread_mutex_lock(&g->mu);
    for (size_t i = 0; i < r->n_unused; i++) {
        const Weft__V1__DistUnused *u = r->unused[i];
        gather_unused(g, u->worker, u->peer, u->reply, u->message, u->function);
    }
    if (r->status != 0 && g->status == WEFT_OK) {
        g->status = weft_status_valid(r->status) ? (weft_status_t)r->status : WEFT_ERR_REMOTE;
        snprintf(g->error, sizeof(g->error), "%s", r->error != NULL ? r->error : "");
    }
    pthread_mutex_unlock(&g->mu);
}

static void gather_fail(gather_t *g, weft_status_t st, const char *text)
{
    pthread_mutex_lock(&g->mu);
    if (g->status == WEFT_OK) {
        g->status = st;
        snprintf(g->error, sizeof(g->error), "%s", text != NULL ? text : weft_strerror(st));
    }
    pthread_mutex_unlock(&g->mu);
}

static void gather_item_done(gather_t *g)
{
    if (atomic_fetch_sub(&g->left, 1) != 1) {
        return;
    }
    Weft__V1__DistControlReply rep = WEFT__V1__DIST_CONTROL_REPLY__INIT;
    Weft__V1__DistUnused *ub = weft_calloc(g->n_unused + 1, sizeof(*ub));
    Weft__V1__DistUnused **up = weft_calloc(g->n_unused + 1, sizeof(*up));
    weft_value_t *v = NULL;
    weft_status_t st;

    if (ub == NULL || up == NULL) {
        st = WEFT_ERR_NO_MEMORY;
    } else {
        for (size_t i = 0; i < g->n_unused; i++) {
            weft__v1__dist_unused__init(&ub[i]);
            ub[i].worker = g->unused[i].worker;
            ub[i].peer = g->unused[i].peer;
            ub[i].reply = g->unused[i].reply;
            ub[i].message = g->unused[i].msg;
            ub[i].function = g->unused[i].fn;
            up[i] = &ub[i];
        }
        rep.n_unused = g->n_unused;
        rep.unused = up;
        rep.status = g->status;
        rep.error = g->error;
        st = weft_msg_pack(&rep.base, NULL, &v);
    }
    if (st == WEFT_OK) {
        weft_future_complete(g->out, WEFT_OK, NULL, v);
    } else {
        weft_future_complete(g->out, st, "dist_autograd: no memory for a control answer", NULL);
    }
    weft_free(ub);
    weft_free(up);
    for (size_t i = 0; i < g->n_unused; i++) {
        weft_free(g->unused[i].fn);
    }
    weft_free(g->unused);
    weft_future_release(g->out);
    pthread_mutex_destroy(&g->mu);
    weft_free(g);
}

static void forwarded_done(weft_future_t *f, void *arg)
{
    gather_t *g = arg;
    weft_status_t st = weft_future_status(f);

    if (st == WEFT_OK) {
        Weft__V1__DistControlReply *r = NULL;

        if (weft_msg_unpack(weft_future_value(f), &weft__v1__dist_control_reply__descriptor,
                            (ProtobufCMessage **)&r, NULL) == WEFT_OK) {
            gather_merge(g, r);
            weft_msg_header_free(&r->base);
        } else {
            gather_fail(g, WEFT_ERR_PROTOCOL, "dist_autograd: a control answer did not decode");
        }
    } else if (st != WEFT_ERR_PEER_LOST || g->kind == WEFT__V1__DIST_CONTROL_KIND__DIST_FINISH) {
        /* A lost worker has nothing left to release or stop; a finish that cannot ask it fails. */
        if (st != WEFT_ERR_PEER_LOST || g->kind != WEFT__V1__DIST_CONTROL_KIND__DIST_RELEASE) {
            gather_fail(g, st, weft_future_error(f));
        }
    }
    weft_future_release(f);
    gather_item_done(g);
}

static void local_done(weft_future_t *f, void *arg)
{
    gather_t *g = arg;

    if (weft_future_status(f) != WEFT_OK && g->kind != WEFT__V1__DIST_CONTROL_KIND__DIST_RELEASE) {
        gather_fail(g, weft_future_status(f), weft_future_error(f));
    }
    weft_future_release(f);
    gather_item_done(g);
}

weft_status_t dist__propagate(dist_t *d, dctx_t *c, const Weft__V1__DistControl *msg, int except,
                              const Weft__V1__DistControlReply *local, weft_future_t *local_done_f,
                              weft_future_t **f_p)
{
    gather_t *g = weft_calloc(1, sizeof(*g));
    int *to = NULL;
    size_t n_to = 0;
    weft_value_t *v = NULL;
    weft_status_t st;

    if (g == NULL || weft_future_create(&g->out) != WEFT_OK) {
        weft_free(g);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "dist_autograd: no memory");
    }
    pthread_mutex_init(&g->mu, NULL);
    g->d = d;
    g->kind = msg->kind;
    pthread_mutex_lock(&c->mu);
    to = weft_calloc(c->n_known + 1, sizeof(*to));
    if (to != NULL) {
        for (size_t i = 0; i < c->n_known; i++) {
            if (c->known[i] != except && c->known[i] != d->rank) {
                to[n_to++] = c->known[i];
            }
        }
    }
    pthread_mutex_unlock(&c->mu);
    if (local != NULL) {
        gather_merge(g, local);
    }
    atomic_init(&g->left, (int)n_to + 1 + (local_done_f != NULL));
    *f_p = weft_future_retain(g->out);
    st = weft_msg_pack(&msg->base, NULL, &v);
    for (size_t i = 0; i < n_to; i++) {
        weft_future_t *f = NULL;
        weft_status_t cst = st;

        if (cst == WEFT_OK) {
            uint64_t prev = weft_rpc_set_thread_context(0);

            cst = weft_rpc_async(d->a, to[i], DIST_FN_CONTROL, v, d->call_timeout_ms, &f);
            weft_rpc_set_thread_context(prev);
        }
        if (cst != WEFT_OK) {
            if (cst != WEFT_ERR_PEER_LOST) {
                gather_fail(g, cst, weft_last_error());
            }
            gather_item_done(g);
            continue;
        }
        if (weft_future_then(f, forwarded_done, g) != WEFT_OK) {
            gather_fail(g, WEFT_ERR_NO_MEMORY, "dist_autograd: no memory");
            weft_future_release(f);
            gather_item_done(g);
        }
    }
    weft_value_free(v);
    weft_free(to);
    if (local_done_f != NULL &&
        weft_future_then(weft_future_retain(local_done_f), local_done, g) != WEFT_OK) {
        weft_future_release(local_done_f);
        gather_item_done(g);
    }
    gather_item_done(g);
    return WEFT_OK;
}

/* Drops @p c here: out of the table, its run's waiting send functions failed. Returns the run's
 * done future (retained) when its engine still runs, else NULL. */
static weft_future_t *ctx_drop(dist_t *d, dctx_t *c, weft_status_t st, const char *why)
{
    weft_future_t **fail = NULL;
    size_t n_fail = 0;
    weft_future_t *wait = NULL;
    bool removed = ctx_remove(d, c);

    pthread_mutex_lock(&c->mu);
    if (c->run != NULL && !c->run->ended) {
        drun_t *r = dist__run_stop_locked(c, c->run->pass, false, st, why, NULL, NULL, &fail,
                                          &n_fail);
        wait = weft_future_retain(r->done);
        dist__run_unref(r);
    }
    pthread_mutex_unlock(&c->mu);
    dist__fail_futures(fail, n_fail, st, why);
    if (removed) {
        dist__ctx_unref(c); /* the table's reference */
    }
    return wait;
}

static void handle_control(weft_call_t *call, void *arg)
{
    dist_t *d = arg;
    Weft__V1__DistControl *m = NULL;
    dctx_t *c = NULL;
    weft_future_t *f = NULL;
    weft_future_t *local = NULL;
    Weft__V1__DistControlReply rep = WEFT__V1__DIST_CONTROL_REPLY__INIT;
    Weft__V1__DistUnused *ub = NULL;
    Weft__V1__DistUnused **up = NULL;
    dunused_t *un = NULL;
    size_t n_un = 0;
    weft_future_t **fail = NULL;
    size_t n_fail = 0;
    char why[700];
    weft_status_t st;
    bool again = false;

    if (weft_msg_unpack(weft_call_args(call), &weft__v1__dist_control__descriptor,
                        (ProtobufCMessage **)&m, NULL) != WEFT_OK) {
        weft_call_fail(call, WEFT_ERR_PROTOCOL, "dist_autograd: a control message did not decode");
        return;
    }
    if (ctx_get(d, m->context, false, &c) != WEFT_OK) {
        /* Released here already (or never reached): nothing to do, nothing to pass on. */
        weft_msg_header_free(&m->base);
        weft_value_t *v = NULL;
        if (weft_msg_pack(&rep.base, NULL, &v) == WEFT_OK) {
            weft_call_reply(call, v);
        } else {
            weft_call_fail(call, WEFT_ERR_NO_MEMORY, "dist_autograd: no memory");
        }
        return;
    }
    switch (m->kind) {
    case WEFT__V1__DIST_CONTROL_KIND__DIST_RELEASE:
        local = ctx_drop(d, c, WEFT_ERR_CANCELLED, "the context was released during its backward");
        again = false;
        break;
    case WEFT__V1__DIST_CONTROL_KIND__DIST_FINISH:
    case WEFT__V1__DIST_CONTROL_KIND__DIST_FAIL: {
        bool finish = m->kind == WEFT__V1__DIST_CONTROL_KIND__DIST_FINISH;
        weft_status_t fst = finish ? WEFT_ERR_INVALID_STATE
                                   : (weft_status_valid(m->status) && m->status != 0
                                          ? (weft_status_t)m->status
                                          : WEFT_ERR_REMOTE);
        if (finish) {
            snprintf(why, sizeof(why), "the distributed backward ended without a gradient for it");
        } else {
            snprintf(why, sizeof(why), "the distributed backward failed: %s",
                     m->error != NULL ? m->error : "");
        }
        pthread_mutex_lock(&c->mu);
        uint32_t *seen = finish ? &c->finished_pass : &c->failed_pass;
        again = *seen >= m->pass;
        if (!again) {
            *seen = m->pass;
            drun_t *r = dist__run_stop_locked(c, m->pass, finish, fst, why, &un, &n_un, &fail,
                                              &n_fail);
            if (r != NULL) {
                /* A finish waits for the part here to end (it is idle: at once) to report how it
                 * ended; a failure does not wait for a node that computes (the release does). */
                local = finish ? weft_future_retain(r->done) : NULL;
                dist__run_unref(r);
            }
        }
        pthread_mutex_unlock(&c->mu);
        dist__fail_futures(fail, n_fail, fst, why);
        break;
    }
    default:
        weft_msg_header_free(&m->base);
        dist__ctx_unref(c);
        weft_call_fail(call, WEFT_ERR_PROTOCOL, "dist_autograd: unknown control kind");
        return;
    }
    if (n_un > 0) {
        ub = weft_calloc(n_un, sizeof(*ub));
        up = weft_calloc(n_un, sizeof(*up));
        if (ub != NULL && up != NULL) {
            for (size_t i = 0; i < n_un; i++) {
                weft__v1__dist_unused__init(&ub[i]);
                ub[i].worker = un[i].worker;
                ub[i].peer = un[i].peer;
                ub[i].reply = un[i].reply;
                ub[i].message = un[i].msg;
                ub[i].function = un[i].fn;
                up[i] = &ub[i];
            }
            rep.n_unused = n_un;
            rep.unused = up;
        }
    }
    if (again) {
        weft_value_t *v = NULL;
        if (weft_msg_pack(&rep.base, NULL, &v) == WEFT_OK) {
            weft_call_reply(call, v);
        } else {
            weft_call_fail(call, WEFT_ERR_NO_MEMORY, "dist_autograd: no memory");
        }
        st = WEFT_OK;
    } else {
        st = dist__propagate(d, c, m, weft_call_caller_rank(call), &rep, local, &f);
        if (st == WEFT_OK) {
            weft_call_reply_future(call, f);
        } else {
            weft_call_fail(call, st, "%s", weft_last_error());
        }
    }
    weft_future_release(local);
    for (size_t i = 0; i < n_un; i++) {
        weft_free(un[i].fn);
    }
    weft_free(un);
    weft_free(ub);
    weft_free(up);
    weft_msg_header_free(&m->base);
    dist__ctx_unref(c);
}

/* ------------------------------------------------------------------ runner threads */

static void *runner_main(void *arg)
{
    dist_t *d = arg;

    pthread_mutex_lock(&d->run_mu);
    for (;;) {
        while (d->tasks == NULL && !d->stopping) {
            d->idle++;
            pthread_cond_wait(&d->run_cv, &d->run_mu);
            d->idle--;
        }
        if (d->tasks == NULL) {
            break;
        }
        dtask_t *t = d->tasks;
        d->tasks = t->next;
        if (d->tasks == NULL) {
            d->tasks_tail = NULL;
        }
        pthread_mutex_unlock(&d->run_mu);
        t->fn(t->arg);
        weft_free(t);
        pthread_mutex_lock(&d->run_mu);
    }
    d->live--;
    pthread_cond_broadcast(&d->run_idle_cv);
    pthread_mutex_unlock(&d->run_mu);
    return NULL;
}

void dist__run_task(dist_t *d, void (*fn)(void *arg), void *arg)
{
    dtask_t *t = weft_calloc(1, sizeof(*t));
    pthread_t th;

    if (t == NULL) {
        fn(arg); /* out of memory: on this thread (it counts as blocked where it waits) */
        return;
    }
    t->fn = fn;
    t->arg = arg;
    pthread_mutex_lock(&d->run_mu);
    if (d->tasks_tail != NULL) {
        d->tasks_tail->next = t;
    } else {
        d->tasks = t;
    }
    d->tasks_tail = t;
    /* Idle threads not yet woken are counted against the queue: one more thread only when the
     * queue outgrows them. */
    int queued = 0;
    for (dtask_t *q = d->tasks; q != NULL; q = q->next) {
        queued++;
    }
    bool inline_run = false;
    if (queued > d->idle) {
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&th, &at, runner_main, d) == 0) {
            d->live++;
        } else if (d->live == 0) {
            /* No thread at all: this one runs it (it counts as blocked where it waits). */
            d->tasks = t->next;
            if (d->tasks == NULL) {
                d->tasks_tail = NULL;
            }
            inline_run = true;
        }
        pthread_attr_destroy(&at);
    }
    pthread_cond_signal(&d->run_cv);
    pthread_mutex_unlock(&d->run_mu);
    if (inline_run) {
        weft_free(t);
        fn(arg);
    }
}

/* ------------------------------------------------------------------ expiry and peer loss */

static void sweep(void *arg, uint64_t data);

static void sweep_arm(dist_t *d)
{
    d->ttl_ms = d->ttl_ms < 100 ? 100 : d->ttl_ms;
    (void)weft_agent_timer_add(d->a, d->ttl_ms * 500, sweep, NULL, d, 0, d);
}

/* Contexts other workers' calls brought here and nobody used for the TTL go (their creator's
 * release normally drops them first; its loss too). */
static void sweep(void *arg, uint64_t data)
{
    dist_t *d = arg;
    size_t n = 0;
    dctx_t **all = ctx_snapshot(d, &n);
    int64_t now = weft__now_ns();

    (void)data;
    for (size_t i = 0; all != NULL && i < n; i++) {
        dctx_t *c = all[i];
        bool expired;

        pthread_mutex_lock(&c->mu);
        expired = c->origin != d->rank && now - c->touched_ns > d->ttl_ms * 1000000 &&
                  (c->run == NULL || c->run->ended);
        pthread_mutex_unlock(&c->mu);
        if (expired) {
            WEFT_INFO("dist_autograd: context %llx from %d unused for %lld ms: dropped",
                      (unsigned long long)c->id, c->origin, (long long)d->ttl_ms);
            weft_future_t *w = ctx_drop(d, c, WEFT_ERR_TIMEOUT, "the context expired");
            weft_future_release(w);
        }
        dist__ctx_unref(c);
    }
    weft_free(all);
    sweep_arm(d);
}

static void on_peer_lost(void *state, int rank, const char *why)
{
    dist_t *d = state;
    size_t n = 0;
    dctx_t **all = ctx_snapshot(d, &n);
    char text[600];
    char name[128];

    snprintf(text, sizeof(text), "%s was lost: %s", dist__name_of(d, rank, name, sizeof(name)),
             why != NULL ? why : "");
    for (size_t i = 0; all != NULL && i < n; i++) {
        dctx_t *c = all[i];
        bool involved = c->origin == rank;
        weft_future_t **fail = NULL;
        size_t n_fail = 0;

        pthread_mutex_lock(&c->mu);
        for (size_t k = 0; k < c->n_known && !involved; k++) {
            involved = c->known[k] == rank;
        }
        if (involved && c->run != NULL && !c->run->ended) {
            drun_t *r = dist__run_stop_locked(c, c->run->pass, false, WEFT_ERR_PEER_LOST, text,
                                              NULL, NULL, &fail, &n_fail);
            dist__run_unref(r);
        }
        pthread_mutex_unlock(&c->mu);
        dist__fail_futures(fail, n_fail, WEFT_ERR_PEER_LOST, text);
        if (c->origin == rank && rank != d->rank) {
            /* Orphaned: its creator will never release it. */
            weft_future_t *w = ctx_drop(d, c, WEFT_ERR_PEER_LOST, text);
            weft_future_release(w);
        }
        dist__ctx_unref(c);
    }
    weft_free(all);
}

/* ------------------------------------------------------------------ the module */

static weft_status_t on_shutdown(void *state, int64_t deadline_ms)
{
    dist_t *d = state;
    size_t n = 0;
    dctx_t **all = ctx_snapshot(d, &n);
    char ids[256] = "";
    size_t off = 0;

    (void)deadline_ms;
    for (size_t i = 0; all != NULL && i < n; i++) {
        if (i < 8 && off < sizeof(ids) - 24) {
            off += (size_t)snprintf(ids + off, sizeof(ids) - off, "%s%llx", i > 0 ? ", " : "",
                                    (unsigned long long)all[i]->id);
        }
        dist__ctx_unref(all[i]);
    }
    weft_free(all);
    if (n > 0) {
        WEFT_WARN("dist_autograd: %zu distributed autograd context%s still live at shutdown on %s "
                  "(not released: %s%s)",
                  n, n == 1 ? "" : "s", d->name, ids, n > 8 ? ", ..." : "");
    }
    return WEFT_OK;
}

static weft_status_t dist_create(weft_agent_t *a, void **state_p)
{
    dist_t *d = weft_calloc(1, sizeof(*d));
    weft_call_hooks_t hooks = {.on_send = on_send, .on_recv = on_recv, .on_dead = on_dead};
    weft_status_t st;

    if (d == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "dist_autograd: no memory for the module");
    }
    d->a = a;
    d->rank = weft_agent_rank(a);
    d->world = weft_agent_world_size(a);
    if (d->world < 1 || d->rank < 0 || d->rank >= d->world || d->world > 65535) {
        weft_free(d);
        return weft__set_error(WEFT_ERR_INVALID_STATE,
                               "dist_autograd: the agent has no valid rank and world size (world "
                               "sizes up to 65535)");
    }
    d->name = weft_strdup(weft_agent_name(a) != NULL ? weft_agent_name(a) : "?");
    d->nbuckets = 64;
    d->buckets = weft_calloc(d->nbuckets, sizeof(*d->buckets));
    if (d->name == NULL || d->buckets == NULL) {
        weft_free(d->name);
        weft_free(d->buckets);
        weft_free(d);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "dist_autograd: no memory for the module");
    }
    pthread_mutex_init(&d->mu, NULL);
    pthread_mutex_init(&d->run_mu, NULL);
    pthread_cond_init(&d->run_cv, NULL);
    pthread_cond_init(&d->run_idle_cv, NULL);
    pthread_mutex_init(&d->opt_mu, NULL);
    pthread_mutex_init(&d->step_mu, NULL);
    atomic_init(&d->next_ctx, 1);
    atomic_init(&d->next_msg, 1);
    atomic_init(&d->next_opt, 1);
    d->ttl_ms = weft__cfg_int(WEFT__CFG_DIST_CONTEXT_TTL_MS);
    d->call_timeout_ms = weft_agent_call_timeout_ms(a);
    hooks.arg = d;
    WEFT_CHECK_GOTO(weft_rpc_register(a, DIST_FN_GRAD, dist__handle_grad, d), st, err);
    WEFT_CHECK_GOTO(weft_rpc_register(a, DIST_FN_CONTROL, handle_control, d), st, err);
    WEFT_CHECK_GOTO(weft_rpc_register(a, DIST_FN_OPTIM, dist__handle_optim, d), st, err);
    WEFT_CHECK_GOTO(weft_agent_set_call_hooks(a, &hooks), st, err);
    sweep_arm(d);
    *state_p = d;
    return WEFT_OK;

err:
    /* The functions may be registered: the state stays (leaked with the agent's failure). */
    WEFT_ERROR("dist_autograd: the module could not be set up: %s", weft_last_error());
    return st;
}

static void dist_destroy(void *state)
{
    dist_t *d = state;
    size_t n = 0;
    dctx_t **all;

    /* The contexts first: their runs' waiting nodes fail, so the runner threads come back. */
    all = ctx_snapshot(d, &n);
    for (size_t i = 0; all != NULL && i < n; i++) {
        weft_future_t *w = ctx_drop(d, all[i], WEFT_ERR_SHUTDOWN, "the agent was freed");
        weft_future_release(w);
        dist__ctx_unref(all[i]);
    }
    weft_free(all);
    pthread_mutex_lock(&d->run_mu);
    d->stopping = true;
    pthread_cond_broadcast(&d->run_cv);
    while (d->live > 0) {
        pthread_cond_wait(&d->run_idle_cv, &d->run_mu);
    }
    pthread_mutex_unlock(&d->run_mu);
    dist__opts_free(d);
    weft_free(d->buckets);
    weft_free(d->name);
    pthread_mutex_destroy(&d->mu);
    pthread_mutex_destroy(&d->run_mu);
    pthread_cond_destroy(&d->run_cv);
    pthread_cond_destroy(&d->run_idle_cv);
    pthread_mutex_destroy(&d->opt_mu);
    pthread_mutex_destroy(&d->step_mu);
    weft_free(d);
}

static const weft_module_desc_t dist_module = {
    .name = "dist_autograd",
    .channel = WEFT_CHANNEL_AUTOGRAD,
    .create = dist_create,
    .destroy = dist_destroy,
    .on_peer_lost = on_peer_lost,
    .on_shutdown = on_shutdown,
};

weft_status_t dist__get(weft_agent_t *a, dist_t **d_p)
{
    void *state;

    if (a == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "dist_autograd: NULL agent");
    }
    WEFT_CHECK(weft_agent_module(a, &dist_module, &state));
    *d_p = state;
    return WEFT_OK;
}

weft_status_t weft_dist_init(weft_agent_t *a)
{
    dist_t *d = NULL;

    return dist__get(a, &d);
}

/* ------------------------------------------------------------------ the context API */

weft_status_t weft_dist_context_create(weft_agent_t *a, uint64_t *id_p)
{
    dist_t *d = NULL;
    dctx_t *c;
    uint64_t id;

    if (id_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "dist_context_create: NULL id");
    }
    WEFT_CHECK(dist__get(a, &d));
    if (weft_rpc_thread_context() != 0) {
        return weft__set_error(WEFT_ERR_INVALID_STATE,
                               "dist_context_create: this thread is in context %llx already "
                               "(contexts do not nest)",
                               (unsigned long long)weft_rpc_thread_context());
    }
    id = ((uint64_t)d->rank << 48) | (atomic_fetch_add(&d->next_ctx, 1) & 0xFFFFFFFFFFFFull);
    WEFT_CHECK(ctx_get(d, id, true, &c));
    dist__ctx_unref(c);
    weft_rpc_set_thread_context(id);
    *id_p = id;
    return WEFT_OK;
}

uint64_t weft_dist_context_current(void)
{
    return weft_rpc_thread_context();
}

weft_status_t weft_dist_context_enter(weft_agent_t *a, uint64_t id, uint64_t *prev_p)
{
    dist_t *d = NULL;

    WEFT_CHECK(dist__get(a, &d));
    if (id != 0) {
        dctx_t *c = dist__find(d, id);

        if (c == NULL) {
            return weft__set_error(WEFT_ERR_NOT_FOUND,
                                   "dist_context_enter: context %llx does not exist on %s",
                                   (unsigned long long)id, d->name);
        }
        dist__ctx_unref(c);
    }
    uint64_t prev = weft_rpc_set_thread_context(id);
    if (prev_p != NULL) {
        *prev_p = prev;
    }
    return WEFT_OK;
}

weft_status_t weft_dist_context_release(weft_agent_t *a, uint64_t id, int64_t timeout_ms)
{
    dist_t *d = NULL;
    dctx_t *c;
    weft_future_t *f = NULL;
    weft_status_t st;
    Weft__V1__DistControl m = WEFT__V1__DIST_CONTROL__INIT;

    WEFT_CHECK(dist__get(a, &d));
    if (timeout_ms < 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "dist_context_release: negative timeout");
    }
    if (weft_rpc_thread_context() == id) {
        weft_rpc_set_thread_context(0);
    }
    c = dist__find(d, id);
    if (c == NULL) {
        return weft__set_error(WEFT_ERR_NOT_FOUND,
                               "dist_context_release: context %llx does not exist on %s",
                               (unsigned long long)id, d->name);
    }
    pthread_mutex_lock(&c->mu);
    bool busy = c->run != NULL && !c->run->ended && c->run->root;
    pthread_mutex_unlock(&c->mu);
    if (busy) {
        dist__ctx_unref(c);
        return weft__set_error(WEFT_ERR_INVALID_STATE,
                               "dist_context_release: a backward still runs in context %llx",
                               (unsigned long long)id);
    }
    weft_future_t *local = ctx_drop(d, c, WEFT_ERR_CANCELLED, "the context was released");
    m.kind = WEFT__V1__DIST_CONTROL_KIND__DIST_RELEASE;
    m.context = id;
    st = dist__propagate(d, c, &m, -1, NULL, local, &f);
    weft_future_release(local);
    dist__ctx_unref(c);
    WEFT_CHECK(st);
    if (timeout_ms == 0) {
        timeout_ms = d->call_timeout_ms;
    }
    st = weft_future_wait(f, timeout_ms + 1000);
    if (st == WEFT_ERR_TIMEOUT && !weft_future_done(f)) {
        weft_future_release(f);
        return weft__set_error(WEFT_ERR_TIMEOUT,
                               "dist_context_release: context %llx: not every worker acknowledged "
                               "the release within %lld ms",
                               (unsigned long long)id, (long long)timeout_ms);
    }
    st = weft_future_status(f);
    if (st == WEFT_OK) {
        Weft__V1__DistControlReply *r = NULL;
        if (weft_msg_unpack(weft_future_value(f), &weft__v1__dist_control_reply__descriptor,
                            (ProtobufCMessage **)&r, NULL) == WEFT_OK) {
            if (r->status != 0) {
                st = weft__set_error(weft_status_valid(r->status) ? (weft_status_t)r->status
                                                                  : WEFT_ERR_REMOTE,
                                     "dist_context_release: context %llx: %s",
                                     (unsigned long long)id, r->error);
            }
            weft_msg_header_free(&r->base);
        }
    } else {
        st = weft__set_error(st, "dist_context_release: context %llx: %s", (unsigned long long)id,
                             weft_future_error(f));
    }
    weft_future_release(f);
    return st;
}

size_t weft_dist_context_count(weft_agent_t *a)
{
    dist_t *d = NULL;
    size_t n;

    if (dist__get(a, &d) != WEFT_OK) {
        return 0;
    }
    pthread_mutex_lock(&d->mu);
    n = d->n;
    pthread_mutex_unlock(&d->mu);
    return n;
}
