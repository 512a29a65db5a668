/* The distributed backward (torch's FAST mode, with a completion check).
 *
 * Each worker's part of a pass is one run of the local engine whose roots are the worker's send
 * functions (and, on the root, the loss). A send function waits for its gradients to arrive; a
 * receive function sends its outputs' gradients to the worker that sent the frame and waits for
 * the answer. The answer to the first gradient that makes a worker busy comes once that worker is
 * idle again (nothing to run, every gradient it sent answered); any other comes at once
 * (Dijkstra-Scholten termination detection). So the root, which is busy until the end, knows when
 * no gradient is in flight anywhere: a send function still waiting then never gets one, and the
 * backward ends with an error naming it instead of hanging. */
#include <stdio.h>
#include <string.h>

#include "internal.h"

static _Thread_local drun_t *cur_run;

/* ------------------------------------------------------------------ runs */

void dist__run_unref(drun_t *r)
{
    if (r == NULL || atomic_fetch_sub(&r->refs, 1) != 1) {
        return;
    }
    for (int i = 0; i < r->n_sends; i++) {
        weft_ag_node_release(r->nodes[i]);
        dist__send_unref(r->sends[i]);
    }
    weft_free(r->nodes);
    weft_free(r->sends);
    for (size_t i = 0; i < r->n_unused; i++) {
        weft_free(r->unused[i].fn);
    }
    weft_free(r->unused);
    weft_free(r->defer_msg);
    weft_free(r->defer_count);
    weft_value_free(r->defer_body);
    weft_future_release(r->done);
    weft_free(r->error);
    weft_free(r);
}

/* A new run of pass @p pass on @p c (its current one from now on), with every send function of
 * the context waiting for this pass's gradient. Called with c->mu held. */
static weft_status_t run_start_locked(dctx_t *c, uint32_t pass, bool root, int root_rank,
                                      int64_t deadline_ns, bool accumulate, bool retain,
                                      drun_t **r_p)
{
    drun_t *r = weft_calloc(1, sizeof(*r));

    if (r == NULL || weft_future_create(&r->done) != WEFT_OK) {
        weft_free(r);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "dist_autograd: no memory for a backward");
    }
    r->nodes = weft_calloc(c->n_sends + 1, sizeof(*r->nodes));
    r->sends = weft_calloc(c->n_sends + 1, sizeof(*r->sends));
    if (r->nodes == NULL || r->sends == NULL) {
        weft_free(r->nodes);
        weft_free(r->sends);
        weft_future_release(r->done);
        weft_free(r);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "dist_autograd: no memory for a backward");
    }
    atomic_init(&r->refs, 1);
    for (size_t i = 0; i < c->n_sends; i++) {
        dsend_t *s = c->sends[i];
        weft_future_t *f = NULL;

        if (s->dead) {
            continue; /* its frame never got through: nothing will come for it */
        }
        if (weft_future_create(&f) != WEFT_OK) {
            dist__run_unref(r);
            return weft__set_error(WEFT_ERR_NO_MEMORY, "dist_autograd: no memory for a backward");
        }
        weft_future_release(s->arrived);
        s->arrived = f;
        s->pass = pass;
        s->got = false;
        r->nodes[r->n_sends] = weft_ag_node_retain(s->node);
        atomic_fetch_add(&s->refs, 1);
        r->sends[r->n_sends++] = s;
    }
    atomic_fetch_add(&r->refs, 1); /* the context's and the caller's */
    r->c = c;
    r->pass = pass;
    r->root = root;
    r->root_rank = root_rank;
    r->deadline_ns = deadline_ns;
    r->accumulate_grad = accumulate;
    r->retain_graph = retain;
    r->engaged = root;
    if (c->run != NULL) {
        dist__run_unref(c->run);
    }
    c->run = r;
    if (pass > c->pass) {
        c->pass = pass;
    }
    *r_p = r;
    return WEFT_OK;
}

static int pending_sends_locked(const drun_t *r)
{
    int n = 0;

    for (int i = 0; i < r->n_sends; i++) {
        n += !r->sends[i]->got;
    }
    return n;
}

static void unused_add(dunused_t **arr, size_t *n, int worker, const dsend_t *s)
{
    dunused_t *u = weft_realloc(*arr, (*n + 1) * sizeof(*u));

    if (u == NULL) {
        return;
    }
    *arr = u;
    u[*n].worker = worker;
    u[*n].peer = s->peer;
    u[*n].reply = s->reply;
    u[*n].msg = s->msg;
    u[*n].fn = weft_strdup(s->fn);
    if (u[*n].fn != NULL) {
        (*n)++;
    }
}

static void fail_list_add(weft_future_t ***arr, size_t *n, weft_future_t *f)
{
    weft_future_t **a = weft_realloc(*arr, (*n + 1) * sizeof(*a));

    if (a == NULL) {
        return;
    }
    *arr = a;
    a[(*n)++] = weft_future_retain(f);
}

drun_t *dist__run_stop_locked(dctx_t *c, uint32_t pass, bool finish, weft_status_t st,
                              const char *why, dunused_t **out, size_t *n_out,
                              weft_future_t ***fail_p, size_t *n_fail)
{
    drun_t *r = c->run;

    (void)st;
    (void)why;
    if (r == NULL || r->pass != pass) {
        /* No part of this pass ran here: this worker took no part in the backward. Its send
         * functions' frames were not used, and nobody waits for them: they are not reported. */
        return NULL;
    }
    if (!r->ended) {
        r->stopping = true;
        for (int i = 0; i < r->n_sends; i++) {
            dsend_t *s = r->sends[i];

            if (!s->got && !weft_future_done(s->arrived)) {
                if (finish && out != NULL) {
                    unused_add(out, n_out, c->d->rank, s);
                }
                fail_list_add(fail_p, n_fail, s->arrived);
            }
        }
    }
    atomic_fetch_add(&r->refs, 1);
    return r;
}

/* The deferred gradients of @p r, taken (the caller sends them with the answer to the parent).
 * Called with c->mu held. */
typedef struct {
    uint64_t *msg;
    uint32_t *count;
    size_t n;
    weft_value_t *body;
} deferred_t;

static deferred_t deferred_take_locked(drun_t *r)
{
    deferred_t d = {r->defer_msg, r->defer_count, r->n_defer, r->defer_body};

    r->defer_msg = NULL;
    r->defer_count = NULL;
    r->n_defer = 0;
    r->defer_body = NULL;
    return d;
}

static void deferred_free(deferred_t *d)
{
    weft_free(d->msg);
    weft_free(d->count);
    weft_value_free(d->body);
    memset(d, 0, sizeof(*d));
}

/* The answer to a gradient: how many send functions of the answering worker (and the workers it
 * asked) still wait, and the gradients it holds for the asker's send functions (taken). */
static void ack(weft_call_t *call, uint32_t pending, deferred_t *d)
{
    Weft__V1__DistAck a = WEFT__V1__DIST_ACK__INIT;
    weft_value_t *v = NULL;

    a.pending_sends = pending;
    if (d != NULL) {
        a.n_grad_messages = d->n;
        a.grad_messages = d->msg;
        a.n_grad_counts = d->n;
        a.grad_counts = d->count;
    }
    if (weft_msg_pack(&a.base, d != NULL ? d->body : NULL, &v) == WEFT_OK) {
        weft_call_reply(call, v);
    } else {
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "dist_autograd: no memory for an answer");
    }
    if (d != NULL) {
        deferred_free(d);
    }
}

/* The engine has nothing to run and every node left waits: is this worker idle (every gradient
 * it sent answered, every one it received taken)? Then a busy non-root worker answers the call
 * that made it busy; the root knows the pass is over everywhere, and its send functions still
 * waiting never get a gradient. */
static void run_idle(void *arg, size_t n_waiting)
{
    drun_t *r = arg;
    dctx_t *c = r->c;
    weft_call_t *parent = NULL;
    weft_future_t **fail = NULL;
    size_t n_fail = 0;
    uint32_t pending = 0;
    deferred_t dfr = {0};

    pthread_mutex_lock(&c->mu);
    /* Idle only when every waiting node is one of ours: a send function waiting for its gradient
     * (none has come: delivered == 0, and no receive function waits: unacked == 0); a node of
     * the user's own that waits on its future is work still going on. */
    if (r->unacked == 0 && r->delivered == 0 && !r->stopping &&
        n_waiting == (size_t)(r->n_sends - r->resumed)) {
        if (r->root) {
            for (int i = 0; i < r->n_sends; i++) {
                dsend_t *s = r->sends[i];

                if (!s->got && !weft_future_done(s->arrived)) {
                    unused_add(&r->unused, &r->n_unused, c->d->rank, s);
                    fail_list_add(&fail, &n_fail, s->arrived);
                }
            }
            if (n_fail > 0) {
                r->unused_fired = true;
                r->stopping = true;
            }
        } else if (r->engaged) {
            parent = r->parent;
            r->parent = NULL;
            r->engaged = false;
            pending = (uint32_t)pending_sends_locked(r) + (r->remote_pending ? 1u : 0u);
            r->remote_pending = false;
            dfr = deferred_take_locked(r);
        }
    }
    pthread_mutex_unlock(&c->mu);
    if (parent != NULL) {
        ack(parent, pending, &dfr);
    }
    dist__fail_futures(fail, n_fail, WEFT_ERR_INVALID_STATE,
                       "the distributed backward ended without a gradient for it");
}

static void grad_add(weft_tensor_t *dst, const weft_tensor_t *src)
{
    int64_t n = weft_tensor_numel(dst);

    if (weft_tensor_dtype(dst) == WEFT_F32) {
        float *a = weft_tensor_data(dst);
        const float *b = weft_tensor_data(src);
        for (int64_t i = 0; i < n; i++) {
            a[i] += b[i];
        }
    } else {
        double *a = weft_tensor_data(dst);
        const double *b = weft_tensor_data(src);
        for (int64_t i = 0; i < n; i++) {
            a[i] += b[i];
        }
    }
}

/* A leaf's gradient of this backward: summed into the context. */
static weft_status_t leaf_give(void *arg, weft_tensor_t *leaf, weft_tensor_t *grad,
                               weft_tensor_t *indices, weft_tensor_t *rows)
{
    drun_t *r = arg;
    dctx_t *c = r->c;
    dgrad_t *e = NULL;
    weft_status_t st = WEFT_OK;

    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < c->n_grads; i++) {
        if (c->grads[i].leaf == leaf) {
            e = &c->grads[i];
            break;
        }
    }
    if (e == NULL) {
        if (c->n_grads == c->cap_grads) {
            size_t ncap = c->cap_grads == 0 ? 8 : c->cap_grads * 2;
            dgrad_t *g = weft_realloc(c->grads, ncap * sizeof(*g));

            if (g == NULL) {
                pthread_mutex_unlock(&c->mu);
                return weft__set_error(WEFT_ERR_NO_MEMORY, "dist_autograd: no memory for a "
                                                           "gradient");
            }
            c->grads = g;
            c->cap_grads = ncap;
        }
        e = &c->grads[c->n_grads++];
        e->leaf = weft_tensor_retain(leaf);
        e->grad = NULL;
    }
    if (grad != NULL) {
        if (weft_tensor_numel(grad) != weft_tensor_numel(leaf) ||
            weft_tensor_dtype(grad) != weft_tensor_dtype(leaf)) {
            st = weft__set_error(WEFT_ERR_SHAPE, "dist_autograd: a leaf's gradient does not match "
                                                 "it");
        } else if (e->grad == NULL) {
            st = weft_tensor_clone(grad, &e->grad);
        } else {
            grad_add(e->grad, grad);
        }
    } else {
        /* A sparse gradient: its rows added into a dense one. */
        int64_t nnz = weft_tensor_shape(indices)[0];
        int64_t width = nnz > 0 ? weft_tensor_numel(rows) / nnz : 0;
        int64_t nrows = weft_tensor_ndim(leaf) > 0 ? weft_tensor_shape(leaf)[0] : 1;
        const int64_t *idx = weft_tensor_data(indices);

        if (e->grad == NULL) {
            st = weft_tensor_empty(weft_tensor_dtype(leaf), weft_tensor_ndim(leaf),
                                   weft_tensor_shape(leaf), &e->grad);
            if (st == WEFT_OK) {
                memset(weft_tensor_data(e->grad), 0, weft_tensor_nbytes(e->grad));
            }
        }
        for (int64_t k = 0; st == WEFT_OK && k < nnz; k++) {
            if (idx[k] < 0 || idx[k] >= nrows) {
                st = weft__set_error(WEFT_ERR_INVALID_ARG, "dist_autograd: sparse row %lld of %lld",
                                     (long long)idx[k], (long long)nrows);
                break;
            }
            if (weft_tensor_dtype(leaf) == WEFT_F32) {
                float *d = (float *)weft_tensor_data(e->grad) + idx[k] * width;
                const float *s = (const float *)weft_tensor_data(rows) + k * width;
                for (int64_t j = 0; j < width; j++) {
                    d[j] += s[j];
                }
            } else {
                double *d = (double *)weft_tensor_data(e->grad) + idx[k] * width;
                const double *s = (const double *)weft_tensor_data(rows) + k * width;
                for (int64_t j = 0; j < width; j++) {
                    d[j] += s[j];
                }
            }
        }
    }
    pthread_mutex_unlock(&c->mu);
    return st;
}

void dist__grads_free_locked(dctx_t *c)
{
    for (size_t i = 0; i < c->n_grads; i++) {
        weft_tensor_release(c->grads[i].leaf);
        weft_tensor_release(c->grads[i].grad);
    }
    weft_free(c->grads);
    c->grads = NULL;
    c->n_grads = c->cap_grads = 0;
}

static void engine_opts(drun_t *r, weft_backward_opts_t *eo)
{
    int64_t left = (r->deadline_ns - weft__now_ns()) / 1000000;

    weft_backward_opts_init(eo);
    eo->retain_graph = r->retain_graph;
    eo->wait_timeout_ms = left > 1 ? left : 1;
    eo->n_root_nodes = (size_t)r->n_sends;
    eo->root_nodes = r->nodes;
    eo->leaf_fn = leaf_give;
    eo->leaf_arg = r;
    eo->leaf_also_grad = r->accumulate_grad;
    eo->idle_fn = run_idle;
    eo->idle_arg = r;
}

/* ------------------------------------------------------------------ send and receive functions */

static weft_status_t send_resume(weft_ag_node_t *n, weft_future_t *f, void *arg,
                                 weft_tensor_t *const *grad_out, weft_tensor_t **grad_in)
{
    dsend_t *s = arg;
    drun_t *r = cur_run;
    weft_value_t *v = NULL;
    weft_status_t st = WEFT_OK;

    (void)n;
    (void)grad_out;
    pthread_mutex_lock(&r->c->mu);
    r->delivered--;
    r->resumed++;
    bool dead = s->dead;
    pthread_mutex_unlock(&r->c->mu);
    WEFT_CHECK(weft_future_take_value(f, &v));
    if (v == NULL && dead) {
        return WEFT_OK; /* its call failed: no gradient */
    }
    if (v == NULL || weft_value_num_tensors(v) != (size_t)s->n) {
        st = weft__set_error(WEFT_ERR_PROTOCOL,
                             "the gradient for '%s' (%s) came with %zu tensors for %d", s->fn,
                             s->reply ? "answer" : "arguments",
                             v == NULL ? (size_t)0 : weft_value_num_tensors(v), s->n);
    } else {
        for (int i = 0; i < s->n && st == WEFT_OK; i++) {
            weft_tensor_t *g = weft_value_tensor(v, (size_t)i);

            if (weft_tensor_dtype(g) != s->dtype[i] || weft_tensor_numel(g) != s->numel[i]) {
                st = weft__set_error(WEFT_ERR_PROTOCOL,
                                     "the gradient for tensor %d of '%s' (%s) is %s of %lld "
                                     "elements, for %s of %lld",
                                     i, s->fn, s->reply ? "answer" : "arguments",
                                     weft_dtype_name(weft_tensor_dtype(g)),
                                     (long long)weft_tensor_numel(g),
                                     weft_dtype_name(s->dtype[i]), (long long)s->numel[i]);
                break;
            }
            grad_in[i] = weft_tensor_retain(g);
        }
    }
    weft_value_free(v);
    return st;
}

weft_status_t dist__send_backward(weft_ag_node_t *n, weft_tensor_t *const *grad_out,
                                  weft_tensor_t **grad_in)
{
    dsend_t *s = weft_ag_node_ctx(n);
    drun_t *r = cur_run;
    weft_future_t *f;

    (void)grad_out;
    (void)grad_in;
    if (r == NULL || s == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_STATE,
                               "SendRpcBackward runs only inside weft_dist_backward");
    }
    pthread_mutex_lock(&r->c->mu);
    f = s->pass == r->pass ? weft_future_retain(s->arrived) : NULL;
    pthread_mutex_unlock(&r->c->mu);
    if (f == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_STATE,
                               "the send function of '%s' is not part of this backward", s->fn);
    }
    weft_status_t st = weft_ag_wait(n, f, send_resume, s);
    weft_future_release(f);
    return st;
}

/* Keeps @p n gradients for send function @p msg of the parent. Called with c->mu held. */
static weft_status_t defer_locked(drun_t *r, uint64_t msg, int n, weft_tensor_t *const *grads)
{
    uint64_t *m = weft_realloc(r->defer_msg, (r->n_defer + 1) * sizeof(*m));
    if (m == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "dist_autograd: no memory");
    }
    r->defer_msg = m;
    uint32_t *k = weft_realloc(r->defer_count, (r->n_defer + 1) * sizeof(*k));
    if (k == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "dist_autograd: no memory");
    }
    r->defer_count = k;
    if (r->defer_body == NULL) {
        WEFT_CHECK(weft_value_create(&r->defer_body));
    }
    /* Whole or not at all: a partial entry would shift every later one. */
    size_t before = weft_value_num_tensors(r->defer_body);
    weft_value_t *tmp = NULL;
    WEFT_CHECK(weft_value_create(&tmp));
    for (int i = 0; i < n; i++) {
        weft_status_t st = weft_value_add_tensor(tmp, grads[i]);
        if (st != WEFT_OK) {
            weft_value_free(tmp);
            return st;
        }
    }
    for (int i = 0; i < n; i++) {
        weft_status_t st = weft_value_add_tensor(r->defer_body, weft_value_tensor(tmp, (size_t)i));
        if (st != WEFT_OK) {
            /* Cannot take the added ones back: this run's answer is spoiled. */
            weft_value_free(tmp);
            (void)before;
            r->stopping = true;
            return st;
        }
    }
    weft_value_free(tmp);
    r->defer_msg[r->n_defer] = msg;
    r->defer_count[r->n_defer] = (uint32_t)n;
    r->n_defer++;
    return WEFT_OK;
}

/* Gradients @p g (taken) for send function @p msg of this worker's run @p r, on its engine's
 * thread: as a gradient call would deliver them. */
static weft_status_t deliver_grad(drun_t *r, uint64_t msg, weft_value_t *g)
{
    dsend_t *s = NULL;
    weft_future_t *f = NULL;
    weft_status_t st = WEFT_OK;

    pthread_mutex_lock(&r->c->mu);
    for (int i = 0; i < r->n_sends; i++) {
        if (r->sends[i]->msg == msg) {
            s = r->sends[i];
            break;
        }
    }
    if (s == NULL || s->got || s->pass != r->pass) {
        st = weft__set_error(WEFT_ERR_PROTOCOL,
                             "an answer carries a gradient for send function %llx, which %s",
                             (unsigned long long)msg,
                             s == NULL ? "this backward does not have" : "had one already");
    } else if (!r->stopping) {
        s->got = true;
        r->delivered++;
        f = weft_future_retain(s->arrived);
    }
    pthread_mutex_unlock(&r->c->mu);
    if (f != NULL) {
        weft_future_complete(f, WEFT_OK, NULL, g);
        g = NULL;
        weft_future_release(f);
    }
    weft_value_free(g);
    return st;
}

static weft_status_t recv_resume(weft_ag_node_t *n, weft_future_t *f, void *arg,
                                 weft_tensor_t *const *grad_out, weft_tensor_t **grad_in)
{
    drun_t *r = arg;
    Weft__V1__DistAck *a = NULL;
    weft_value_t *body = NULL;
    weft_status_t st = WEFT_OK;

    (void)n;
    (void)grad_out;
    (void)grad_in;
    if (weft_msg_unpack(weft_future_value(f), &weft__v1__dist_ack__descriptor,
                        (ProtobufCMessage **)&a, NULL) != WEFT_OK ||
        a->n_grad_counts != a->n_grad_messages ||
        (a->n_grad_messages > 0 && weft_msg_body(weft_future_value(f), &body) != WEFT_OK)) {
        weft_msg_header_free(a != NULL ? &a->base : NULL);
        pthread_mutex_lock(&r->c->mu);
        r->unacked--;
        pthread_mutex_unlock(&r->c->mu);
        return weft__set_error(WEFT_ERR_PROTOCOL, "an answer to a gradient did not decode");
    }
    /* Gradients for this worker's send functions that came with the answer: delivered before the
     * answer counts, so that this worker is never idle with them unread. */
    size_t off = 0;
    size_t nt = body != NULL ? weft_value_num_tensors(body) : 0;
    for (size_t i = 0; st == WEFT_OK && i < a->n_grad_messages; i++) {
        weft_value_t *g = NULL;
        size_t k = a->grad_counts[i];

        if (off + k > nt) {
            st = weft__set_error(WEFT_ERR_PROTOCOL, "an answer to a gradient carries %zu tensors "
                                                    "for more",
                                 nt);
            break;
        }
        st = weft_value_create(&g);
        for (size_t j = 0; st == WEFT_OK && j < k; j++) {
            st = weft_value_add_tensor(g, weft_value_tensor(body, off + j));
        }
        off += k;
        if (st == WEFT_OK) {
            st = deliver_grad(r, a->grad_messages[i], g);
        } else {
            weft_value_free(g);
        }
    }
    weft_value_free(body);
    pthread_mutex_lock(&r->c->mu);
    r->unacked--;
    if (a->pending_sends > 0) {
        r->remote_pending = true;
    }
    pthread_mutex_unlock(&r->c->mu);
    weft_msg_header_free(&a->base);
    return st;
}

weft_status_t dist__recv_backward(weft_ag_node_t *n, weft_tensor_t *const *grad_out,
                                  weft_tensor_t **grad_in)
{
    drecv_t *rv = weft_ag_node_ctx(n);
    drun_t *r = cur_run;
    Weft__V1__DistGrad h = WEFT__V1__DIST_GRAD__INIT;
    weft_value_t *body = NULL;
    weft_value_t *msg = NULL;
    weft_future_t *f = NULL;
    weft_status_t st;
    char name[128];

    (void)grad_in;
    if (rv == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_STATE, "RecvRpcBackward: no state");
    }
    if (r == NULL || r->c->id != rv->ctx) {
        return weft__set_error(WEFT_ERR_INVALID_STATE,
                               "the receive function of '%s' (context %llx) runs only inside "
                               "weft_dist_backward of its context",
                               rv->fn, (unsigned long long)rv->ctx);
    }
    int64_t left = (r->deadline_ns - weft__now_ns()) / 1000000;
    if (left < 1) {
        left = 1;
    }
    /* To the worker that made this one busy: with the answer to it (it waits for that anyway). */
    pthread_mutex_lock(&r->c->mu);
    if (!r->root && r->parent != NULL && weft_call_caller_rank(r->parent) == rv->peer) {
        st = defer_locked(r, rv->msg, rv->n, grad_out);
        pthread_mutex_unlock(&r->c->mu);
        return st;
    }
    pthread_mutex_unlock(&r->c->mu);
    h.context = rv->ctx;
    h.message = rv->msg;
    h.pass = r->pass;
    h.root = r->root_rank;
    h.time_left_ms = left;
    h.accumulate_grad = false; /* .grad is the root's leaves' only */
    h.retain_graph = r->retain_graph;
    st = weft_value_create(&body);
    for (int i = 0; st == WEFT_OK && i < rv->n; i++) {
        st = weft_value_add_tensor(body, grad_out[i]);
    }
    if (st == WEFT_OK) {
        st = weft_msg_pack(&h.base, body, &msg);
    }
    weft_value_free(body);
    if (st == WEFT_OK) {
        uint64_t prev = weft_rpc_set_thread_context(0);

        st = weft_rpc_async(r->c->d->a, rv->peer, DIST_FN_GRAD, msg, left, &f);
        weft_rpc_set_thread_context(prev);
    }
    weft_value_free(msg);
    if (st != WEFT_OK) {
        return weft__set_error(st, "sending the gradient of '%s' (%s) back to %s: %s", rv->fn,
                               rv->reply ? "answer" : "arguments",
                               dist__name_of(r->c->d, rv->peer, name, sizeof(name)),
                               weft_last_error());
    }
    pthread_mutex_lock(&r->c->mu);
    r->unacked++;
    pthread_mutex_unlock(&r->c->mu);
    st = weft_ag_wait(n, f, recv_resume, r);
    weft_future_release(f);
    return st;
}

/* ------------------------------------------------------------------ another worker's part */

static void run_main(void *arg)
{
    drun_t *r = arg;
    dctx_t *c = r->c;
    weft_backward_opts_t eo;
    weft_status_t st;
    weft_call_t *parent;
    uint32_t pending;
    bool stopping;
    char text[WEFT__ERROR_MAX];

    engine_opts(r, &eo);
    cur_run = r;
    st = weft_backward_run(0, NULL, NULL, &eo);
    cur_run = NULL;
    snprintf(text, sizeof(text), "%s", st == WEFT_OK ? "" : weft_last_error());
    pthread_mutex_lock(&c->mu);
    r->ended = true;
    r->status = st;
    r->error = weft_strdup(text);
    parent = r->parent;
    r->parent = NULL;
    r->engaged = false;
    pending = (uint32_t)pending_sends_locked(r) + (r->remote_pending ? 1u : 0u);
    stopping = r->stopping;
    deferred_t dfr = deferred_take_locked(r);
    pthread_mutex_unlock(&c->mu);
    if (st == WEFT_OK || stopping) {
        weft_future_complete(r->done, WEFT_OK, NULL, NULL);
    } else {
        weft_future_fail(r->done, st, "backward on %s: %s", c->d->name, text);
    }
    if (parent != NULL) {
        if (st == WEFT_OK) {
            ack(parent, pending, &dfr);
        } else {
            weft_call_fail(parent, st, "backward on %s: %s", c->d->name, text);
        }
    }
    deferred_free(&dfr);
    dist__run_unref(r);
    dist__ctx_unref(c);
}

void dist__handle_grad(weft_call_t *call, void *arg)
{
    dist_t *d = arg;
    Weft__V1__DistGrad *h = NULL;
    weft_value_t *body = NULL;
    dctx_t *c;
    drun_t *r;
    dsend_t *s = NULL;
    weft_future_t *f = NULL;
    bool start = false;
    bool answer_now = false;
    weft_status_t st = WEFT_OK;
    char why[600] = "";

    if (weft_msg_unpack(weft_call_args(call), &weft__v1__dist_grad__descriptor,
                        (ProtobufCMessage **)&h, NULL) != WEFT_OK ||
        weft_msg_body(weft_call_args(call), &body) != WEFT_OK) {
        weft_msg_header_free(h != NULL ? &h->base : NULL);
        weft_call_fail(call, WEFT_ERR_PROTOCOL, "dist_autograd: a gradient message did not decode");
        return;
    }
    c = dist__find(d, h->context);
    if (c == NULL) {
        weft_call_fail(call, WEFT_ERR_NOT_FOUND,
                       "a gradient for context %llx, which does not exist on %s (released or "
                       "expired)",
                       (unsigned long long)h->context, d->name);
        goto out;
    }
    pthread_mutex_lock(&c->mu);
    r = c->run;
    for (size_t i = 0; i < c->n_sends; i++) {
        if (c->sends[i]->msg == h->message) {
            s = c->sends[i];
            break;
        }
    }
    if (s == NULL) {
        st = WEFT_ERR_NOT_FOUND;
        snprintf(why, sizeof(why), "no send function %llx in context %llx on %s",
                 (unsigned long long)h->message, (unsigned long long)h->context, d->name);
    } else if (r == NULL || r->pass != h->pass) {
        if (r != NULL && !r->ended) {
            st = WEFT_ERR_INVALID_STATE;
            snprintf(why, sizeof(why), "a gradient for pass %u of context %llx while pass %u runs",
                     h->pass, (unsigned long long)h->context, r->pass);
        } else if (h->pass <= c->finished_pass || h->pass <= c->failed_pass ||
                   (r != NULL && h->pass < r->pass)) {
            st = WEFT_ERR_INVALID_STATE;
            snprintf(why, sizeof(why), "a gradient for pass %u of context %llx, which is over",
                     h->pass, (unsigned long long)h->context);
        } else {
            int64_t left = h->time_left_ms > 0 ? h->time_left_ms : 1;

            st = run_start_locked(c, h->pass, false, h->root, weft__now_ns() + left * 1000000,
                                  h->accumulate_grad, h->retain_graph, &r);
            if (st == WEFT_OK) {
                start = true; /* the caller's reference goes to the runner */
            } else {
                snprintf(why, sizeof(why), "%s", weft_last_error());
            }
        }
    }
    if (st == WEFT_OK) {
        if (s->pass != r->pass) {
            st = WEFT_ERR_INVALID_STATE;
            snprintf(why, sizeof(why), "the send function of '%s' was recorded after its "
                                       "backward began",
                     s->fn);
        } else if (s->got) {
            st = WEFT_ERR_INVALID_STATE;
            snprintf(why, sizeof(why), "a second gradient for '%s' (%s) in one backward", s->fn,
                     s->reply ? "answer" : "arguments");
        } else if (r->stopping || r->ended) {
            st = WEFT_ERR_INVALID_STATE;
            snprintf(why, sizeof(why), "a gradient for '%s' after this worker's part of the "
                                       "backward ended",
                     s->fn);
        } else {
            s->got = true;
            r->delivered++;
            f = weft_future_retain(s->arrived);
            if (!r->engaged) {
                r->engaged = true;
                r->parent = call;
            } else {
                answer_now = true;
            }
            c->touched_ns = weft__now_ns();
        }
    }
    pthread_mutex_unlock(&c->mu);
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "%s", why);
    } else {
        weft_future_complete(f, WEFT_OK, NULL, body);
        body = NULL;
        weft_future_release(f);
    }
    if (start) {
        atomic_fetch_add(&c->refs, 1); /* the runner's */
        dist__run_task(d, run_main, r);
    }
    if (st == WEFT_OK && answer_now) {
        ack(call, 0, NULL);
    }
    dist__ctx_unref(c);
out:
    weft_value_free(body);
    weft_msg_header_free(&h->base);
}

/* ------------------------------------------------------------------ the root */

static void deadline_run(void *arg, uint64_t data)
{
    drun_t *r = arg;
    weft_future_t **fail = NULL;
    size_t n_fail = 0;

    (void)data;
    pthread_mutex_lock(&r->c->mu);
    if (!r->ended) {
        drun_t *x = dist__run_stop_locked(r->c, r->pass, false, WEFT_ERR_TIMEOUT, NULL, NULL, NULL,
                                          &fail, &n_fail);
        dist__run_unref(x);
    }
    pthread_mutex_unlock(&r->c->mu);
    dist__fail_futures(fail, n_fail, WEFT_ERR_TIMEOUT,
                       "the distributed backward passed its deadline");
}

void weft_dist_backward_opts_init(weft_dist_backward_opts_t *opts)
{
    if (opts != NULL) {
        memset(opts, 0, sizeof(*opts));
    }
}

/* Ends the pass on every worker: FINISH (collecting send functions that got no gradient) or FAIL.
 * Returns the merged answer's status and text, and the unused list. */
static weft_status_t round_trip(dist_t *d, dctx_t *c, int kind, uint32_t pass, weft_status_t fst,
                                const char *ferr, int64_t deadline_ns,
                                Weft__V1__DistControlReply **rep_p)
{
    Weft__V1__DistControl m = WEFT__V1__DIST_CONTROL__INIT;
    weft_future_t *f = NULL;
    weft_status_t st;
    int64_t left = (deadline_ns - weft__now_ns()) / 1000000;

    m.kind = kind;
    m.context = c->id;
    m.pass = pass;
    m.status = fst;
    m.error = (char *)(ferr != NULL ? ferr : "");
    pthread_mutex_lock(&c->mu);
    if (kind == WEFT__V1__DIST_CONTROL_KIND__DIST_FINISH) {
        c->finished_pass = pass;
    } else {
        c->failed_pass = pass;
    }
    pthread_mutex_unlock(&c->mu);
    WEFT_CHECK(dist__propagate(d, c, &m, -1, NULL, NULL, &f));
    st = weft_future_wait(f, (left > 0 ? left : 0) + 2000);
    if (st == WEFT_ERR_TIMEOUT && !weft_future_done(f)) {
        weft_future_release(f);
        return weft__set_error(WEFT_ERR_TIMEOUT, "the workers did not all answer in time");
    }
    st = weft_future_status(f);
    if (st == WEFT_OK) {
        st = weft_msg_unpack(weft_future_value(f), &weft__v1__dist_control_reply__descriptor,
                             (ProtobufCMessage **)rep_p, NULL);
    } else {
        weft__set_error(st, "%s", weft_future_error(f));
    }
    weft_future_release(f);
    return st;
}

static void unused_text(char *buf, size_t n, dist_t *d, const dunused_t *u, size_t nu,
                        Weft__V1__DistUnused **ru, size_t nr)
{
    size_t off = 0;
    size_t total = nu + nr;
    char a[96], b[96];

    off += (size_t)snprintf(buf + off, n - off,
                            "%zu send function%s never received a gradient (an RPC's %s not "
                            "used by the loss): ",
                            total, total == 1 ? "" : "s", total == 1 ? "result or argument was"
                                                                     : "results or arguments were");
    for (size_t i = 0; i < total && off < n - 1; i++) {
        int w = i < nu ? u[i].worker : ru[i - nu]->worker;
        int p = i < nu ? u[i].peer : ru[i - nu]->peer;
        bool reply = i < nu ? u[i].reply : ru[i - nu]->reply;
        const char *fn = i < nu ? u[i].fn : ru[i - nu]->function;

        if (i == 6) {
            snprintf(buf + off, n - off, ", ...");
            break;
        }
        off += (size_t)snprintf(buf + off, n - off, "%s'%s' (%s, %s -> %s)", i > 0 ? ", " : "", fn,
                                reply ? "its answer" : "its arguments",
                                dist__name_of(d, w, a, sizeof(a)),
                                dist__name_of(d, p, b, sizeof(b)));
    }
}

weft_status_t weft_dist_backward(weft_agent_t *a, uint64_t id, size_t n,
                                 weft_tensor_t *const *roots, const weft_dist_backward_opts_t *opts)
{
    weft_dist_backward_opts_t o;
    weft_backward_opts_t eo;
    dist_t *d = NULL;
    dctx_t *c;
    drun_t *r = NULL;
    weft_status_t st;
    char text[WEFT__ERROR_MAX];
    Weft__V1__DistControlReply *rep = NULL;

    weft_dist_backward_opts_init(&o);
    if (opts != NULL) {
        o = *opts;
    }
    WEFT_CHECK(dist__get(a, &d));
    if (n == 0 || roots == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "dist_backward: no roots");
    }
    if (o.timeout_ms < 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "dist_backward: negative timeout");
    }
    for (size_t i = 0; i < n; i++) {
        if (roots[i] == NULL || !weft_tensor_requires_grad(roots[i]) ||
            weft_tensor_numel(roots[i]) != 1) {
            return weft__set_error(WEFT_ERR_INVALID_ARG,
                                   "dist_backward: root %zu is not a scalar that requires "
                                   "gradients",
                                   i);
        }
    }
    int64_t timeout = o.timeout_ms > 0 ? o.timeout_ms : d->call_timeout_ms;
    int64_t deadline = weft__now_ns() + timeout * 1000000;
    c = dist__find(d, id);
    if (c == NULL) {
        return weft__set_error(WEFT_ERR_NOT_FOUND,
                               "dist_backward: context %llx does not exist on %s",
                               (unsigned long long)id, d->name);
    }
    pthread_mutex_lock(&c->mu);
    if (c->origin != d->rank) {
        st = weft__set_error(WEFT_ERR_INVALID_STATE,
                             "dist_backward: context %llx was created on rank %d; its backward runs "
                             "there",
                             (unsigned long long)id, c->origin);
    } else if (c->run != NULL && !c->run->ended) {
        st = weft__set_error(WEFT_ERR_INVALID_STATE,
                             "dist_backward: a backward already runs in context %llx on %s",
                             (unsigned long long)id, d->name);
    } else {
        st = run_start_locked(c, c->pass + 1, true, d->rank, deadline, o.accumulate_grad,
                              o.retain_graph, &r);
    }
    pthread_mutex_unlock(&c->mu);
    if (st != WEFT_OK) {
        dist__ctx_unref(c);
        return st;
    }
    (void)weft_agent_timer_add(a, timeout * 1000, deadline_run, NULL, r, 0, r);

    engine_opts(r, &eo);
    cur_run = r;
    st = weft_backward_run(n, roots, NULL, &eo);
    cur_run = NULL;
    snprintf(text, sizeof(text), "%s", st == WEFT_OK ? "" : weft_last_error());
    weft_agent_timer_cancel_owner(a, r);

    pthread_mutex_lock(&c->mu);
    r->ended = true;
    r->status = st;
    bool unused = r->unused_fired;
    bool remote_pending = r->remote_pending;
    pthread_mutex_unlock(&c->mu);
    weft_future_complete(r->done, WEFT_OK, NULL, NULL);

    if (st == WEFT_OK && !remote_pending) {
        goto out;
    }
    if (st == WEFT_OK || unused) {
        /* Every worker reports its send functions that are still waiting (they never will). */
        weft_status_t rst = round_trip(d, c, WEFT__V1__DIST_CONTROL_KIND__DIST_FINISH, r->pass,
                                       WEFT_OK, NULL, deadline, &rep);
        if (rst != WEFT_OK) {
            st = weft__set_error(rst, "dist_backward: context %llx: ending the pass: %s",
                                 (unsigned long long)id, weft_last_error());
        } else if (r->n_unused + rep->n_unused > 0) {
            unused_text(text, sizeof(text), d, r->unused, r->n_unused, rep->unused,
                        rep->n_unused);
            st = weft__set_error(WEFT_ERR_INVALID_STATE, "dist_backward: context %llx: %s",
                                 (unsigned long long)id, text);
        } else if (rep->status != 0) {
            st = weft__set_error(weft_status_valid(rep->status) ? (weft_status_t)rep->status
                                                                : WEFT_ERR_REMOTE,
                                 "dist_backward: context %llx: %s", (unsigned long long)id,
                                 rep->error);
        } else {
            st = WEFT_OK;
        }
        weft_msg_header_free(rep != NULL ? &rep->base : NULL);
        goto out;
    }
    /* A failure: every other worker's part stops too. */
    (void)round_trip(d, c, WEFT__V1__DIST_CONTROL_KIND__DIST_FAIL, r->pass, st, text, deadline,
                     &rep);
    weft_msg_header_free(rep != NULL ? &rep->base : NULL);
    st = weft__set_error(st, "dist_backward: context %llx: %s", (unsigned long long)id, text);

out:
    dist__run_unref(r);
    dist__ctx_unref(c);
    return st;
}

/* ------------------------------------------------------------------ gradients */

struct weft_dist_grads {
    size_t n;
    weft_tensor_t **leaf;
    weft_tensor_t **grad;
};

weft_status_t weft_dist_get_gradients(weft_agent_t *a, uint64_t id, weft_dist_grads_t **grads_p)
{
    dist_t *d = NULL;
    dctx_t *c;
    weft_dist_grads_t *g;

    if (grads_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "dist_get_gradients: NULL argument");
    }
    WEFT_CHECK(dist__get(a, &d));
    c = dist__find(d, id);
    if (c == NULL) {
        return weft__set_error(WEFT_ERR_NOT_FOUND,
                               "dist_get_gradients: context %llx does not exist on %s",
                               (unsigned long long)id, d->name);
    }
    g = weft_calloc(1, sizeof(*g));
    pthread_mutex_lock(&c->mu);
    if (g != NULL) {
        g->leaf = weft_calloc(c->n_grads + 1, sizeof(*g->leaf));
        g->grad = weft_calloc(c->n_grads + 1, sizeof(*g->grad));
    }
    if (g == NULL || g->leaf == NULL || g->grad == NULL) {
        pthread_mutex_unlock(&c->mu);
        dist__ctx_unref(c);
        weft_dist_grads_free(g);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "dist_get_gradients: no memory");
    }
    for (size_t i = 0; i < c->n_grads; i++) {
        if (c->grads[i].grad != NULL &&
            weft_tensor_clone(c->grads[i].grad, &g->grad[g->n]) == WEFT_OK) {
            g->leaf[g->n] = weft_tensor_retain(c->grads[i].leaf);
            g->n++;
        }
    }
    pthread_mutex_unlock(&c->mu);
    dist__ctx_unref(c);
    *grads_p = g;
    return WEFT_OK;
}

size_t weft_dist_grads_count(const weft_dist_grads_t *g)
{
    return g == NULL ? 0 : g->n;
}

weft_tensor_t *weft_dist_grads_leaf(const weft_dist_grads_t *g, size_t i)
{
    return g == NULL || i >= g->n ? NULL : g->leaf[i];
}

weft_tensor_t *weft_dist_grads_grad(const weft_dist_grads_t *g, size_t i)
{
    return g == NULL || i >= g->n ? NULL : g->grad[i];
}

weft_tensor_t *weft_dist_grads_find(const weft_dist_grads_t *g, const weft_tensor_t *leaf)
{
    for (size_t i = 0; g != NULL && i < g->n; i++) {
        if (g->leaf[i] == leaf) {
            return g->grad[i];
        }
    }
    return NULL;
}

void weft_dist_grads_free(weft_dist_grads_t *g)
{
    if (g == NULL) {
        return;
    }
    for (size_t i = 0; i < g->n; i++) {
        weft_tensor_release(g->leaf[i]);
        weft_tensor_release(g->grad[i]);
    }
    weft_free(g->leaf);
    weft_free(g->grad);
    weft_free(g);
}

weft_status_t weft_dist_context_set_gradient(weft_agent_t *a, uint64_t id, weft_tensor_t *leaf,
                                             const weft_tensor_t *grad)
{
    dist_t *d = NULL;
    dctx_t *c;
    weft_tensor_t *copy = NULL;
    weft_status_t st = WEFT_OK;

    if (leaf == NULL || grad == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "dist_context_set_gradient: NULL argument");
    }
    if (weft_tensor_dtype(grad) != weft_tensor_dtype(leaf) ||
        weft_tensor_numel(grad) != weft_tensor_numel(leaf)) {
        return weft__set_error(WEFT_ERR_SHAPE,
                               "dist_context_set_gradient: a %s gradient of %lld elements for a "
                               "%s leaf of %lld",
                               weft_dtype_name(weft_tensor_dtype(grad)),
                               (long long)weft_tensor_numel(grad),
                               weft_dtype_name(weft_tensor_dtype(leaf)),
                               (long long)weft_tensor_numel(leaf));
    }
    WEFT_CHECK(dist__get(a, &d));
    c = dist__find(d, id);
    if (c == NULL) {
        return weft__set_error(WEFT_ERR_NOT_FOUND,
                               "dist_context_set_gradient: context %llx does not exist on %s",
                               (unsigned long long)id, d->name);
    }
    WEFT_CHECK_GOTO(weft_tensor_empty(weft_tensor_dtype(leaf), weft_tensor_ndim(leaf),
                                      weft_tensor_shape(leaf), &copy),
                    st, out);
    memcpy(weft_tensor_data(copy), weft_tensor_data(grad), weft_tensor_nbytes(copy));
    pthread_mutex_lock(&c->mu);
    dgrad_t *e = NULL;
    for (size_t i = 0; i < c->n_grads; i++) {
        if (c->grads[i].leaf == leaf) {
            e = &c->grads[i];
            break;
        }
    }
    if (e == NULL && c->n_grads == c->cap_grads) {
        size_t ncap = c->cap_grads == 0 ? 8 : c->cap_grads * 2;
        dgrad_t *g = weft_realloc(c->grads, ncap * sizeof(*g));
        if (g == NULL) {
            pthread_mutex_unlock(&c->mu);
            weft_tensor_release(copy);
            st = weft__set_error(WEFT_ERR_NO_MEMORY, "dist_context_set_gradient: no memory");
            goto out;
        }
        c->grads = g;
        c->cap_grads = ncap;
    }
    if (e == NULL) {
        e = &c->grads[c->n_grads++];
        e->leaf = weft_tensor_retain(leaf);
        e->grad = NULL;
    }
    weft_tensor_release(e->grad);
    e->grad = copy;
    pthread_mutex_unlock(&c->mu);
out:
    dist__ctx_unref(c);
    return st;
}
