/* The distributed optimizer: one local optimizer per parameter owner, stepped with the gradients
 * of a context by one call per owner. */
#include <stdio.h>
#include <string.h>

#include <weft/nn.h>

#include "internal.h"

/* A local optimizer on this worker (an owner of some parameters). */
typedef struct dopt {
    struct dopt *next;
    uint64_t id;
    pthread_mutex_t mu; /* steps on the same parameters are serialized */
    weft_optimizer_t *opt;
    weft_param_list_t *params;
    weft_rref_t **rrefs; /* kept: the parameters live as long as the optimizer */
    int n;
} dopt_t;

static void dopt_free(dopt_t *o)
{
    if (o == NULL) {
        return;
    }
    weft_optimizer_free(o->opt);
    weft_param_list_free(o->params);
    for (int i = 0; i < o->n; i++) {
        weft_rref_release(o->rrefs[i]);
    }
    weft_free(o->rrefs);
    pthread_mutex_destroy(&o->mu);
    weft_free(o);
}

void dist__opts_free(dist_t *d)
{
    dopt_t *o = d->opts;

    while (o != NULL) {
        dopt_t *next = o->next;
        dopt_free(o);
        o = next;
    }
    d->opts = NULL;
}

static weft_status_t optimizer_make(const Weft__V1__DistOptim *m, const weft_param_list_t *params,
                                    weft_optimizer_t **opt_p)
{
    switch (m->kind) {
    case WEFT_DIST_OPTIM_SGD: {
        weft_optim_sgd_config_t c = weft_optim_sgd_defaults();
        c.lr = m->lr;
        c.momentum = m->momentum;
        c.weight_decay = m->weight_decay;
        c.nesterov = m->nesterov;
        return weft_optimizer_sgd_create(params, &c, opt_p);
    }
    case WEFT_DIST_OPTIM_ADAGRAD: {
        weft_optim_adagrad_config_t c = weft_optim_adagrad_defaults();
        c.lr = m->lr;
        c.weight_decay = m->weight_decay;
        c.eps = m->eps;
        return weft_optimizer_adagrad_create(params, &c, opt_p);
    }
    case WEFT_DIST_OPTIM_ADAM:
    case WEFT_DIST_OPTIM_ADAMW: {
        weft_optim_adam_config_t c = WEFT_OPTIM_ADAM_DEFAULTS;
        c.lr = m->lr;
        c.beta1 = m->beta1;
        c.beta2 = m->beta2;
        c.eps = m->eps;
        c.weight_decay = m->weight_decay;
        return m->kind == WEFT_DIST_OPTIM_ADAM ? weft_optimizer_adam_create(params, &c, opt_p)
                                               : weft_optimizer_adamw_create(params, &c, opt_p);
    }
    default:
        return weft__set_error(WEFT_ERR_INVALID_ARG, "dist_optim: unknown optimizer kind %d",
                               m->kind);
    }
}

static weft_status_t owner_create(dist_t *d, const Weft__V1__DistOptim *m, const weft_value_t *v,
                                  uint64_t *id_p)
{
    dopt_t *o = weft_calloc(1, sizeof(*o));
    size_t nr = weft_value_num_refs(v);
    weft_status_t st = WEFT_OK;

    if (o == NULL || (o->rrefs = weft_calloc(nr + 1, sizeof(*o->rrefs))) == NULL) {
        weft_free(o);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "dist_optim: no memory");
    }
    pthread_mutex_init(&o->mu, NULL);
    WEFT_CHECK_GOTO(weft_param_list_create(&o->params), st, fail);
    for (size_t i = 0; i < nr; i++) {
        weft_rref_t *r = weft_value_rref(v, i);
        const weft_value_t *pv = NULL;
        char name[32];

        if (r == NULL) {
            st = weft__set_error(WEFT_ERR_INVALID_ARG, "dist_optim: parameter %zu is not an RRef",
                                 i);
            goto fail;
        }
        o->rrefs[o->n++] = weft_rref_retain(r);
        WEFT_CHECK_GOTO(weft_rref_local_value(r, d->call_timeout_ms, &pv), st, fail);
        weft_tensor_t *t = weft_value_num_tensors(pv) == 1 ? weft_value_tensor(pv, 0) : NULL;
        if (t == NULL || !weft_tensor_is_leaf(t) || !weft_tensor_requires_grad(t)) {
            st = weft__set_error(WEFT_ERR_INVALID_ARG,
                                 "dist_optim: parameter %zu on %s is not one leaf tensor that "
                                 "requires gradients",
                                 i, d->name);
            goto fail;
        }
        snprintf(name, sizeof(name), "p%zu", i);
        WEFT_CHECK_GOTO(weft_param_list_add(o->params, name, t), st, fail);
    }
    WEFT_CHECK_GOTO(optimizer_make(m, o->params, &o->opt), st, fail);
    pthread_mutex_lock(&d->opt_mu);
    o->id = atomic_fetch_add(&d->next_opt, 1);
    o->next = d->opts;
    d->opts = o;
    pthread_mutex_unlock(&d->opt_mu);
    *id_p = o->id;
    return WEFT_OK;

fail:
    dopt_free(o);
    return st;
}

/* Called with d->opt_mu held. */
static dopt_t *dopt_find_locked(dist_t *d, uint64_t id, bool unlink)
{
    for (dopt_t **pp = &d->opts; *pp != NULL; pp = &(*pp)->next) {
        if ((*pp)->id == id) {
            dopt_t *o = *pp;
            if (unlink) {
                *pp = o->next;
            }
            return o;
        }
    }
    return NULL;
}

static weft_status_t owner_step(dist_t *d, uint64_t id, uint64_t ctx)
{
    dopt_t *o;
    dctx_t *c;
    weft_status_t st = WEFT_OK;
    int n;

    pthread_mutex_lock(&d->opt_mu);
    o = dopt_find_locked(d, id, false);
    if (o != NULL) {
        pthread_mutex_lock(&o->mu); /* a step at a time; freeing waits for it */
    }
    pthread_mutex_unlock(&d->opt_mu);
    if (o == NULL) {
        return weft__set_error(WEFT_ERR_NOT_FOUND, "dist_optim: no optimizer %llu on %s",
                               (unsigned long long)id, d->name);
    }
    c = dist__find(d, ctx);
    if (c == NULL) {
        /* The context never reached this owner: none of its parameters has a gradient. */
        pthread_mutex_unlock(&o->mu);
        return WEFT_OK;
    }
    n = weft_param_list_size(o->params);
    weft_tensor_t **old = weft_calloc((size_t)n + 1, sizeof(*old));
    weft_tensor_t **g = weft_calloc((size_t)n + 1, sizeof(*g));
    if (old == NULL || g == NULL) {
        st = weft__set_error(WEFT_ERR_NO_MEMORY, "dist_optim: no memory");
        goto out;
    }
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < n; i++) {
        weft_tensor_t *p = weft_param_list_get(o->params, i);
        for (size_t k = 0; k < c->n_grads; k++) {
            if (c->grads[k].leaf == p) {
                g[i] = weft_tensor_retain(c->grads[k].grad);
                break;
            }
        }
    }
    pthread_mutex_unlock(&c->mu);
    /* The local optimizer steps with the context's gradients in place of the parameters' own,
     * which come back afterwards; one step at a time on this owner, as optimizers of several
     * workers may hold the same parameters. */
    pthread_mutex_lock(&d->step_mu);
    for (int i = 0; i < n; i++) {
        weft_tensor_t *p = weft_param_list_get(o->params, i);
        old[i] = weft_tensor_retain(weft_tensor_grad(p));
        (void)weft_tensor_set_grad(p, g[i]);
    }
    st = weft_optimizer_step(o->opt);
    for (int i = 0; i < n; i++) {
        (void)weft_tensor_set_grad(weft_param_list_get(o->params, i), old[i]);
    }
    pthread_mutex_unlock(&d->step_mu);

out:
    for (int i = 0; old != NULL && g != NULL && i < n; i++) {
        weft_tensor_release(old[i]);
        weft_tensor_release(g[i]);
    }
    weft_free(old);
    weft_free(g);
    pthread_mutex_unlock(&o->mu);
    dist__ctx_unref(c);
    return st;
}

static void owner_free(dist_t *d, uint64_t id)
{
    dopt_t *o;

    pthread_mutex_lock(&d->opt_mu);
    o = dopt_find_locked(d, id, true);
    pthread_mutex_unlock(&d->opt_mu);
    if (o != NULL) {
        pthread_mutex_lock(&o->mu); /* a step under way ends first */
        pthread_mutex_unlock(&o->mu);
        dopt_free(o);
    }
}

void dist__handle_optim(weft_call_t *call, void *arg)
{
    dist_t *d = arg;
    Weft__V1__DistOptim *m = NULL;
    Weft__V1__DistOptim rep = WEFT__V1__DIST_OPTIM__INIT;
    weft_value_t *body = NULL;
    weft_value_t *v = NULL;
    weft_status_t st;

    if (weft_msg_unpack(weft_call_args(call), &weft__v1__dist_optim__descriptor,
                        (ProtobufCMessage **)&m, NULL) != WEFT_OK) {
        weft_call_fail(call, WEFT_ERR_PROTOCOL, "dist_optim: a message did not decode");
        return;
    }
    rep.op = m->op;
    switch (m->op) {
    case WEFT__V1__DIST_OPTIM_OP__DIST_OPTIM_CREATE:
        st = weft_msg_body(weft_call_args(call), &body);
        if (st == WEFT_OK) {
            st = owner_create(d, m, body, &rep.id);
        }
        weft_value_free(body);
        break;
    case WEFT__V1__DIST_OPTIM_OP__DIST_OPTIM_STEP:
        st = owner_step(d, m->id, m->context);
        break;
    case WEFT__V1__DIST_OPTIM_OP__DIST_OPTIM_FREE:
        owner_free(d, m->id);
        st = WEFT_OK;
        break;
    default:
        st = weft__set_error(WEFT_ERR_PROTOCOL, "dist_optim: unknown operation %d", m->op);
        break;
    }
    weft_msg_header_free(&m->base);
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "%s", weft_last_error());
        return;
    }
    if (weft_msg_pack(&rep.base, NULL, &v) != WEFT_OK) {
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "dist_optim: no memory");
        return;
    }
    weft_call_reply(call, v);
}

/* ------------------------------------------------------------------ the caller's side */

typedef struct {
    int rank;
    uint64_t id;
} owner_t;

struct weft_dist_optim {
    weft_agent_t *a;
    dist_t *d;
    owner_t *owners;
    int n_owners;
};

void weft_dist_optim_config_init(weft_dist_optim_config_t *cfg, weft_dist_optim_kind_t kind,
                                 double lr)
{
    if (cfg == NULL) {
        return;
    }
    memset(cfg, 0, sizeof(*cfg));
    cfg->kind = kind;
    cfg->lr = lr;
    cfg->beta1 = 0.9;
    cfg->beta2 = 0.999;
    cfg->eps = kind == WEFT_DIST_OPTIM_ADAGRAD ? 1e-10 : 1e-8;
    if (kind == WEFT_DIST_OPTIM_ADAMW) {
        cfg->weight_decay = 1e-2;
    }
}

/* One call per owner (this worker's own through the same handler, locally), in parallel. */
static weft_status_t call_owners(weft_dist_optim_t *o, weft_value_t **msgs, int64_t timeout_ms,
                                 weft_value_t **answers)
{
    weft_future_t **f = weft_calloc((size_t)o->n_owners + 1, sizeof(*f));
    weft_status_t first = WEFT_OK;
    char text[WEFT__ERROR_MAX] = "";
    uint64_t prev = weft_rpc_set_thread_context(0);

    if (f == NULL) {
        weft_rpc_set_thread_context(prev);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "dist_optim: no memory");
    }
    for (int i = 0; i < o->n_owners; i++) {
        weft_status_t st;

        if (o->owners[i].rank == o->d->rank) {
            st = weft_rpc_call_local(o->a, DIST_FN_OPTIM, msgs[i], timeout_ms, &f[i]);
            msgs[i] = NULL; /* the call took it */
        } else {
            st = weft_rpc_async(o->a, o->owners[i].rank, DIST_FN_OPTIM, msgs[i], timeout_ms,
                                &f[i]);
        }
        if (st != WEFT_OK && first == WEFT_OK) {
            first = st;
            snprintf(text, sizeof(text), "%s", weft_last_error());
        }
    }
    weft_rpc_set_thread_context(prev);
    for (int i = 0; i < o->n_owners; i++) {
        if (f[i] == NULL) {
            continue;
        }
        weft_status_t st = weft_future_wait(f[i], 0);
        if (st != WEFT_OK && first == WEFT_OK) {
            char name[96];
            first = st;
            snprintf(text, sizeof(text), "the optimizer on %s: %s",
                     dist__name_of(o->d, o->owners[i].rank, name, sizeof(name)),
                     weft_future_error(f[i]));
        }
        if (st == WEFT_OK && answers != NULL) {
            (void)weft_future_take_value(f[i], &answers[i]);
        }
        weft_future_release(f[i]);
    }
    weft_free(f);
    if (first != WEFT_OK) {
        return weft__set_error(first, "dist_optim: %s", text);
    }
    return WEFT_OK;
}

weft_status_t weft_dist_optim_create(weft_agent_t *a, const weft_dist_optim_config_t *cfg,
                                     size_t n, weft_rref_t *const *params,
                                     weft_dist_optim_t **opt_p)
{
    weft_dist_optim_t *o;
    dist_t *d = NULL;
    weft_value_t **msgs = NULL;
    weft_value_t **answers = NULL;
    weft_status_t st = WEFT_OK;

    if (cfg == NULL || params == NULL || opt_p == NULL || n == 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "dist_optim_create: no parameters");
    }
    if (!(cfg->lr >= 0) || cfg->kind < WEFT_DIST_OPTIM_SGD || cfg->kind > WEFT_DIST_OPTIM_ADAMW) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "dist_optim_create: bad kind or lr");
    }
    WEFT_CHECK(dist__get(a, &d));
    o = weft_calloc(1, sizeof(*o));
    if (o == NULL || (o->owners = weft_calloc(n, sizeof(*o->owners))) == NULL) {
        weft_free(o);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "dist_optim_create: no memory");
    }
    o->a = a;
    o->d = d;
    for (size_t i = 0; i < n; i++) {
        int r = weft_rref_owner(params[i]);
        bool seen = false;

        for (int k = 0; k < o->n_owners && !seen; k++) {
            seen = o->owners[k].rank == r;
        }
        if (!seen) {
            o->owners[o->n_owners++].rank = r;
        }
    }
    msgs = weft_calloc((size_t)o->n_owners, sizeof(*msgs));
    answers = weft_calloc((size_t)o->n_owners, sizeof(*answers));
    if (msgs == NULL || answers == NULL) {
        st = weft__set_error(WEFT_ERR_NO_MEMORY, "dist_optim_create: no memory");
        goto out;
    }
    for (int k = 0; k < o->n_owners && st == WEFT_OK; k++) {
        Weft__V1__DistOptim m = WEFT__V1__DIST_OPTIM__INIT;
        weft_value_t *body = NULL;

        m.op = WEFT__V1__DIST_OPTIM_OP__DIST_OPTIM_CREATE;
        m.kind = cfg->kind;
        m.lr = cfg->lr;
        m.momentum = cfg->momentum;
        m.weight_decay = cfg->weight_decay;
        m.beta1 = cfg->beta1;
        m.beta2 = cfg->beta2;
        m.eps = cfg->eps;
        m.nesterov = cfg->nesterov;
        st = weft_value_create(&body);
        for (size_t i = 0; st == WEFT_OK && i < n; i++) {
            if (weft_rref_owner(params[i]) == o->owners[k].rank) {
                st = weft_value_add_rref(body, params[i]);
            }
        }
        if (st == WEFT_OK) {
            st = weft_msg_pack(&m.base, body, &msgs[k]);
        }
        weft_value_free(body);
    }
    if (st == WEFT_OK) {
        st = call_owners(o, msgs, 0, answers);
    }
    /* Every owner that made its optimizer is known, also when another failed: the free below
     * drops them. */
    for (int k = 0; k < o->n_owners; k++) {
        Weft__V1__DistOptim *rep = NULL;

        if (answers[k] != NULL &&
            weft_msg_unpack(answers[k], &weft__v1__dist_optim__descriptor,
                            (ProtobufCMessage **)&rep, NULL) == WEFT_OK) {
            o->owners[k].id = rep->id;
            weft_msg_header_free(&rep->base);
        } else if (st == WEFT_OK) {
            st = weft__set_error(WEFT_ERR_PROTOCOL, "dist_optim_create: an answer did not decode");
        }
    }

out:
    for (int k = 0; k < o->n_owners; k++) {
        if (msgs != NULL) {
            weft_value_free(msgs[k]);
        }
        if (answers != NULL) {
            weft_value_free(answers[k]);
        }
    }
    weft_free(msgs);
    weft_free(answers);
    if (st != WEFT_OK) {
        weft_dist_optim_free(o);
        return st;
    }
    *opt_p = o;
    return WEFT_OK;
}

weft_status_t weft_dist_optim_step(weft_dist_optim_t *o, uint64_t ctx, int64_t timeout_ms)
{
    weft_value_t **msgs;
    weft_status_t st = WEFT_OK;

    if (o == NULL || ctx == 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "dist_optim_step: no optimizer or context");
    }
    msgs = weft_calloc((size_t)o->n_owners + 1, sizeof(*msgs));
    if (msgs == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "dist_optim_step: no memory");
    }
    for (int k = 0; k < o->n_owners && st == WEFT_OK; k++) {
        Weft__V1__DistOptim m = WEFT__V1__DIST_OPTIM__INIT;

        m.op = WEFT__V1__DIST_OPTIM_OP__DIST_OPTIM_STEP;
        m.id = o->owners[k].id;
        m.context = ctx;
        st = weft_msg_pack(&m.base, NULL, &msgs[k]);
    }
    if (st == WEFT_OK) {
        st = call_owners(o, msgs, timeout_ms, NULL);
    }
    for (int k = 0; k < o->n_owners; k++) {
        weft_value_free(msgs[k]);
    }
    weft_free(msgs);
    return st;
}

void weft_dist_optim_free(weft_dist_optim_t *o)
{
    weft_value_t **msgs;

    if (o == NULL) {
        return;
    }
    msgs = weft_calloc((size_t)o->n_owners + 1, sizeof(*msgs));
    if (msgs != NULL) {
        /* Only the owners that made one (a failed create frees what it made). */
        int kept = 0;
        for (int k = 0; k < o->n_owners; k++) {
            Weft__V1__DistOptim m = WEFT__V1__DIST_OPTIM__INIT;

            if (o->owners[k].id == 0) {
                continue;
            }
            m.op = WEFT__V1__DIST_OPTIM_OP__DIST_OPTIM_FREE;
            m.id = o->owners[k].id;
            if (weft_msg_pack(&m.base, NULL, &msgs[kept]) == WEFT_OK) {
                o->owners[kept++] = o->owners[k];
            }
        }
        o->n_owners = kept;
        (void)call_owners(o, msgs, 0, NULL);
        for (int k = 0; k < o->n_owners; k++) {
            weft_value_free(msgs[k]);
        }
        weft_free(msgs);
    }
    weft_free(o->owners);
    weft_free(o);
}
