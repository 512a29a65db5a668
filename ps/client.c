/* The parameter server's API: the module (one per agent), roles, tables created collectively,
 * and the workers' operations, each fanned out to the servers concerned as calls of "__weft.ps"
 * and gathered into one future. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <weft/reduce.h>

#include "internal.h"

/* ------------------------------------------------------------------ the module */

static weft_status_t ps_module_create(weft_agent_t *a, void **state_p)
{
    weft_ps_t *ps = weft_calloc(1, sizeof(*ps));
    if (ps == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory");
    }
    ps->agent = a;
    ps->rank = weft_agent_rank(a);
    ps->world = weft_agent_world_size(a);
    ps->server_index = ps->worker_index = -1;
    pthread_mutex_init(&ps->mu, NULL);
    pthread_mutex_init(&ps->seq_mu, NULL);
    ps->fault_dup = weft__cfg_bool(WEFT__CFG_PS_FAULT_DUP);
    ps->fault_delay_us = weft__cfg_int(WEFT__CFG_PS_FAULT_DELAY_US);
    weft_status_t st = weft_rpc_register(a, PS_FN, weft__ps_handle, ps);
    if (st != WEFT_OK) {
        pthread_mutex_destroy(&ps->seq_mu);
        pthread_mutex_destroy(&ps->mu);
        weft_free(ps);
        return st;
    }
    *state_p = ps;
    return WEFT_OK;
}

static void ps_module_destroy(void *state)
{
    weft_ps_t *ps = state;
    weft__ps_server_free(ps->srv);
    for (uint32_t i = 0; i < atomic_load(&ps->n_tables); i++) {
        weft_ps_table_t *t = ps->tables[i];
        weft__ps_layout_free(&t->l);
        weft_free((void *)t->pushes);
        weft_free(t);
    }
    weft_free(ps->servers);
    weft_free(ps->workers);
    weft_free((void *)ps->seq);
    weft_free((void *)ps->n_seq_free);
    weft_free(ps->seq_free);
    weft_free((void *)ps->server_lost);
    pthread_mutex_destroy(&ps->seq_mu);
    pthread_mutex_destroy(&ps->mu);
    weft_free(ps);
}

static void ps_module_peer_lost(void *state, int rank, const char *why)
{
    weft_ps_t *ps = state;
    pthread_mutex_lock(&ps->mu);
    bool ready = ps->roles_set;
    pthread_mutex_unlock(&ps->mu);
    if (!ready) {
        return;
    }
    for (uint32_t s = 0; s < ps->n_servers; s++) {
        if (ps->servers[s] == rank) {
            atomic_store(&ps->server_lost[s], true);
        }
    }
    if (ps->srv != NULL) {
        weft__ps_server_peer_lost(ps->srv, rank, why);
    }
}

static const weft_module_desc_t ps_desc = {
    .name = "ps",
    .channel = WEFT_CHANNEL_PS,
    .create = ps_module_create,
    .destroy = ps_module_destroy,
    .on_peer_lost = ps_module_peer_lost,
};

/* ------------------------------------------------------------------ roles */

void weft_ps_opts_init(weft_ps_opts_t *opts)
{
    memset(opts, 0, sizeof(*opts));
}

/* "N" (ranks 0..N-1) or "a,b,c" into @p out (world entries); the count, or -1. */
static int parse_ranks(const char *s, bool count_ok, int world, int *out)
{
    if (count_ok && strchr(s, ',') == NULL) {
        char *end;
        long n = strtol(s, &end, 10);
        if (*s == '\0' || *end != '\0' || n < 1 || n > world) {
            return -1;
        }
        for (int i = 0; i < n; i++) {
            out[i] = i;
        }
        return (int)n;
    }
    int n = 0;
    while (*s != '\0') {
        char *end;
        long r = strtol(s, &end, 10);
        if (end == s || r < 0 || r >= world || n >= world) {
            return -1;
        }
        out[n++] = (int)r;
        s = *end == ',' ? end + 1 : end;
        if (*end != ',' && *end != '\0') {
            return -1;
        }
    }
    return n;
}

static weft_status_t check_ranks(const int *r, int n, int world, const char *what)
{
    if (n < 1) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: no %s", what);
    }
    for (int i = 0; i < n; i++) {
        if (r[i] < 0 || r[i] >= world) {
            return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: %s rank %d is out of [0, %d)", what,
                                   r[i], world);
        }
        for (int j = 0; j < i; j++) {
            if (r[j] == r[i]) {
                return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: %s rank %d is named twice", what,
                                       r[i]);
            }
        }
    }
    return WEFT_OK;
}

static weft_status_t roles_of(const weft_ps_t *ps, const weft_ps_opts_t *o, int *servers, int *ns,
                              int *workers, int *nw)
{
    int world = ps->world;
    if (o != NULL && o->servers != NULL) {
        if (o->n_servers > (size_t)world) {
            return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: %zu servers in a world of %d",
                                   o->n_servers, world);
        }
        memcpy(servers, o->servers, o->n_servers * sizeof(int));
        *ns = (int)o->n_servers;
    } else {
        const char *env = weft__cfg_str(WEFT__CFG_PS_SERVERS);
        *ns = parse_ranks(env, true, world, servers);
        if (*ns < 0) {
            return weft__set_error(WEFT_ERR_INVALID_ARG,
                                   "ps: WEFT_PS_SERVERS='%s' is neither a count in 1..%d nor a "
                                   "list of ranks",
                                   env, world);
        }
    }
    WEFT_CHECK(check_ranks(servers, *ns, world, "server"));
    if (o != NULL && o->workers != NULL) {
        if (o->n_workers > (size_t)world) {
            return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: %zu workers in a world of %d",
                                   o->n_workers, world);
        }
        memcpy(workers, o->workers, o->n_workers * sizeof(int));
        *nw = (int)o->n_workers;
    } else if (weft__cfg_str(WEFT__CFG_PS_WORKERS)[0] != '\0') {
        const char *env = weft__cfg_str(WEFT__CFG_PS_WORKERS);
        *nw = parse_ranks(env, false, world, workers);
        if (*nw < 0) {
            return weft__set_error(WEFT_ERR_INVALID_ARG,
                                   "ps: WEFT_PS_WORKERS='%s' is not a list of ranks", env);
        }
    } else {
        *nw = 0;
        for (int r = 0; r < world; r++) {
            bool serves = false;
            for (int i = 0; i < *ns; i++) {
                serves = serves || servers[i] == r;
            }
            if (!serves) {
                workers[(*nw)++] = r;
            }
        }
        if (*nw == 0) { /* every rank serves: every rank works too */
            for (int r = 0; r < world; r++) {
                workers[r] = r;
            }
            *nw = world;
        }
    }
    return check_ranks(workers, *nw, world, "worker");
}

weft_status_t weft_ps_create(weft_agent_t *a, const weft_ps_opts_t *opts, weft_ps_t **ps_p)
{
    weft_ps_t *ps;
    if (a == NULL || ps_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: NULL agent or output");
    }
    WEFT_CHECK(weft_agent_module(a, &ps_desc, (void **)&ps));
    int *servers = weft_alloc((size_t)ps->world * sizeof(int));
    int *workers = weft_alloc((size_t)ps->world * sizeof(int));
    int ns = 0, nw = 0;
    weft_status_t st = WEFT_ERR_NO_MEMORY;
    if (servers == NULL || workers == NULL) {
        st = weft__set_error(st, "ps: no memory");
        goto out;
    }
    if ((st = roles_of(ps, opts, servers, &ns, workers, &nw)) != WEFT_OK) {
        goto out;
    }
    pthread_mutex_lock(&ps->mu);
    if (ps->roles_set) {
        bool same = (uint32_t)ns == ps->n_servers && (uint32_t)nw == ps->n_workers &&
                    memcmp(servers, ps->servers, (size_t)ns * sizeof(int)) == 0 &&
                    memcmp(workers, ps->workers, (size_t)nw * sizeof(int)) == 0;
        pthread_mutex_unlock(&ps->mu);
        st = same ? WEFT_OK
                  : weft__set_error(WEFT_ERR_INVALID_ARG,
                                    "ps: the parameter server of rank %d has other roles already",
                                    ps->rank);
        goto out;
    }
    ps->servers = servers;
    ps->workers = workers;
    ps->n_servers = (uint32_t)ns;
    ps->n_workers = (uint32_t)nw;
    servers = workers = NULL;
    for (uint32_t i = 0; i < ps->n_servers; i++) {
        if (ps->servers[i] == ps->rank) {
            ps->server_index = (int)i;
        }
    }
    for (uint32_t i = 0; i < ps->n_workers; i++) {
        if (ps->workers[i] == ps->rank) {
            ps->worker_index = (int)i;
        }
    }
    ps->seq = weft_calloc(ps->n_servers, sizeof(*ps->seq));
    ps->n_seq_free = weft_calloc(ps->n_servers, sizeof(*ps->n_seq_free));
    ps->seq_free = weft_calloc(ps->n_servers, sizeof(*ps->seq_free));
    ps->server_lost = weft_calloc(ps->n_servers, sizeof(*ps->server_lost));
    st = ps->seq == NULL || ps->n_seq_free == NULL || ps->seq_free == NULL ||
                 ps->server_lost == NULL
             ? weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory")
             : WEFT_OK;
    if (st == WEFT_OK && ps->server_index >= 0) {
        st = weft__ps_server_new(ps, &ps->srv);
    }
    ps->roles_set = st == WEFT_OK;
    pthread_mutex_unlock(&ps->mu);

out:
    weft_free(servers);
    weft_free(workers);
    if (st == WEFT_OK) {
        *ps_p = ps;
    }
    return st;
}

bool weft_ps_is_server(const weft_ps_t *ps)
{
    return ps->server_index >= 0;
}

bool weft_ps_is_worker(const weft_ps_t *ps)
{
    return ps->worker_index >= 0;
}

size_t weft_ps_num_servers(const weft_ps_t *ps)
{
    return ps->n_servers;
}

size_t weft_ps_num_workers(const weft_ps_t *ps)
{
    return ps->n_workers;
}

int weft_ps_worker_index(const weft_ps_t *ps)
{
    return ps->worker_index;
}

int64_t weft_ps_worker_clock(const weft_ps_t *ps)
{
    return atomic_load(&ps->clock);
}

/* ------------------------------------------------------------------ calls to servers */

weft_status_t weft__ps_call(weft_ps_t *ps, uint32_t s, const Weft__V1__PsRequest *hdr,
                            weft_tensor_t *const *tensors, size_t n_tensors, int64_t timeout_ms,
                            weft_future_t **f_p)
{
    weft_value_t *body = NULL, *msg = NULL;
    weft_status_t st = WEFT_OK;
    if (n_tensors > 0) {
        st = weft_value_create(&body);
        for (size_t i = 0; i < n_tensors && st == WEFT_OK; i++) {
            st = weft_value_add_tensor(body, tensors[i]);
        }
    }
    if (st == WEFT_OK) {
        st = weft_msg_pack(&hdr->base, body, &msg);
    }
    if (st == WEFT_OK) {
        st = weft_rpc_async(ps->agent, ps->servers[s], PS_FN, msg, timeout_ms, f_p);
    }
    weft_value_free(msg);
    weft_value_free(body);
    return st;
}

weft_status_t weft__ps_reply_unpack(const weft_value_t *v, Weft__V1__PsReply **r_p)
{
    if (v == NULL) {
        return weft__set_error(WEFT_ERR_PROTOCOL, "ps: an empty reply");
    }
    return weft_msg_unpack(v, &weft__v1__ps_reply__descriptor, (ProtobufCMessage **)r_p, NULL);
}

/* ------------------------------------------------------------------ operations */

typedef enum { OP_PUSH, OP_PULL, OP_PUSH_PULL, OP_OTHER } op_kind_t;

typedef struct ps_op ps_op_t;

/* One request of an operation: to server s, for a dense table the chunks it names. */
typedef struct {
    ps_op_t *op;
    uint32_t s;
    const uint32_t *chunks; /* dense: the request's chunks, in order (into op->chunk_ids) */
    size_t n_chunks;
    weft_value_t *delayed; /* fault injection: the message sent later */
    int64_t timeout_ms;
    weft_future_t *f; /* its call, while it may land bytes in the caller's memory */
    bool over;        /* its sub_done ran (under op->mu) */
    uint64_t seq;     /* a push's number (0: not a push) */
    /* a sparse pull: its distinct rows (numbered from op->first[base]), and the bytes of them
     * handed to pull_sink straight from a shared-memory ring */
    uint32_t base;
    uint32_t rows;
    uint64_t sunk;
} ps_sub_t;

/* What a request or reply carries besides its tensors' bytes, at most (envelope, header). */
#define PS_HEADROOM ((uint64_t)4096)

/* A dense operation's bytes per request: a server applies one request while the next arrives. */
#define PS_REQUEST_BYTES ((size_t)4 << 20)

struct ps_op {
    _Atomic int left;
    op_kind_t kind;
    weft_ps_table_t *t;
    weft_future_t *user;
    pthread_mutex_t mu;
    weft_status_t st;
    char why[384];
    /* dense pulls: where chunks land */
    float *dst;
    /* sparse pulls: per position of the caller's ids, its server and place in that request */
    uint32_t *srv_of;
    uint32_t *pos_of;
    /* ... and per distinct row (all servers', numbered by server), the positions it goes to:
     * dests[first[g] .. first[g + 1]) */
    uint32_t *first;
    uint32_t *dests;
    size_t n_ids;
    int64_t dim;
    weft_value_t *keep;  /* tensors kept alive until the end (ids, summed rows) */
    ps_sub_t *subs;      /* per server (sparse), or per request (dense) */
    uint32_t *chunk_ids; /* dense: every chunk, grouped by server */
};

static void op_free(ps_op_t *op)
{
    weft_future_release(op->user);
    weft_value_free(op->keep);
    weft_free(op->srv_of);
    weft_free(op->pos_of);
    weft_free(op->first);
    weft_free(op->dests);
    size_t nsub = op->t->ps->n_servers +
                  (op->t->l.spec.kind == WEFT_PS_DENSE ? op->t->l.n_chunks : 0);
    for (size_t i = 0; op->subs != NULL && i < nsub; i++) {
        weft_future_release(op->subs[i].f);
    }
    weft_free(op->subs);
    weft_free(op->chunk_ids);
    pthread_mutex_destroy(&op->mu);
    weft_free(op);
}

static weft_status_t op_new(weft_ps_table_t *t, op_kind_t kind, ps_op_t **op_p)
{
    weft_ps_t *ps = t->ps;
    ps_op_t *op = weft_calloc(1, sizeof(*op));
    if (op == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory");
    }
    pthread_mutex_init(&op->mu, NULL);
    op->kind = kind;
    op->t = t;
    size_t nsub = ps->n_servers + (t->l.spec.kind == WEFT_PS_DENSE ? t->l.n_chunks : 0);
    op->subs = weft_calloc(nsub, sizeof(*op->subs));
    if (op->subs == NULL || weft_future_create(&op->user) != WEFT_OK ||
        weft_value_create(&op->keep) != WEFT_OK) {
        op_free(op);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory");
    }
    for (uint32_t s = 0; s < ps->n_servers; s++) {
        op->subs[s].op = op;
        op->subs[s].s = s;
    }
    atomic_init(&op->left, 1); /* the caller's, dropped by op_launched */
    *op_p = op;
    return WEFT_OK;
}

static void op_fail(ps_op_t *op, weft_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void op_fail(ps_op_t *op, weft_status_t st, const char *fmt, ...)
{
    pthread_mutex_lock(&op->mu);
    if (op->st == WEFT_OK) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(op->why, sizeof(op->why), fmt, ap);
        va_end(ap);
        op->st = st;
    }
    pthread_mutex_unlock(&op->mu);
}

static void op_part_done(ps_op_t *op)
{
    if (atomic_fetch_sub(&op->left, 1) != 1) {
        return;
    }
    weft_future_t *user = weft_future_retain(op->user);
    weft_status_t st = op->st;
    char why[sizeof(op->why)];
    memcpy(why, op->why, sizeof(why));
    op_free(op);
    weft_future_complete(user, st, st == WEFT_OK ? NULL : why, NULL);
    weft_future_release(user);
}

/* Copies a server's part of a pull into the caller's memory (op->mu held); false when the reply
 * is malformed (op->st and op->why then say so). */
static bool scatter(ps_op_t *op, const ps_sub_t *sub, const weft_value_t *body)
{
    weft_ps_table_t *t = op->t;
    uint32_t s = sub->s;
    if (t->l.spec.kind == WEFT_PS_DENSE) {
        size_t k = 0;
        for (size_t j = 0; j < sub->n_chunks; j++) {
            uint32_t c = sub->chunks[j];
            weft_tensor_t *x = k < weft_value_num_tensors(body) ? weft_value_tensor(body, k) : NULL;
            int64_t len = weft__ps_chunk_len(&t->l, c);
            if (x == NULL || weft_tensor_dtype(x) != WEFT_F32 || weft_tensor_numel(x) != len) {
                snprintf(op->why, sizeof(op->why),
                         "ps: table '%s', server %u: chunk %u of the reply is missing or "
                         "malformed",
                         t->l.name, s, c);
                return false;
            }
            float *dst = op->dst + (int64_t)c * t->l.chunk_elems;
            if (weft_tensor_data(x) != dst) { /* else it landed there (weft_rpc_async_into) */
                memcpy(dst, weft_tensor_data(x), (size_t)len * sizeof(float));
            }
            k++;
        }
        return true;
    }
    weft_tensor_t *x = weft_value_num_tensors(body) == 1 ? weft_value_tensor(body, 0) : NULL;
    if (x != NULL && weft_tensor_numel(x) == 0 && sub->rows > 0 &&
        sub->sunk == (uint64_t)sub->rows * (uint64_t)op->dim * sizeof(float)) {
        return true; /* every row went to the caller's memory through pull_sink */
    }
    size_t want = 0;
    for (size_t i = 0; i < op->n_ids; i++) {
        if (op->srv_of[i] == s && op->pos_of[i] + 1 > want) {
            want = op->pos_of[i] + 1;
        }
    }
    if (x == NULL || weft_tensor_dtype(x) != WEFT_F32 || weft_tensor_ndim(x) != 2 ||
        weft_tensor_shape(x)[1] != op->dim || (size_t)weft_tensor_shape(x)[0] < want) {
        snprintf(op->why, sizeof(op->why), "ps: table '%s', server %u: malformed rows", t->l.name,
                 s);
        return false;
    }
    const float *src = weft_tensor_data(x);
    size_t row = (size_t)op->dim * sizeof(float);
    for (size_t i = 0; i < op->n_ids; i++) {
        if (op->srv_of[i] == s) {
            memcpy(op->dst + i * (size_t)op->dim, src + op->pos_of[i] * (size_t)op->dim, row);
        }
    }
    return true;
}

/* A failed pull completes its future at once, unless a part still outstanding is writing into
 * the caller's memory right now: then that part's own completion comes back here. */
static void pull_fail_early(ps_op_t *op)
{
    weft_ps_t *ps = op->t->ps;
    size_t nsub = ps->n_servers + (op->t->l.spec.kind == WEFT_PS_DENSE ? op->t->l.n_chunks : 0);
    pthread_mutex_lock(&op->mu);
    weft_status_t ost = op->st;
    char why[sizeof(op->why)];
    memcpy(why, op->why, sizeof(why));
    bool quiet = true;
    for (size_t i = 0; ost != WEFT_OK && i < nsub; i++) {
        ps_sub_t *o = &op->subs[i];
        if (o->f != NULL && !o->over && !weft_rpc_withdraw_into(ps->agent, o->f)) {
            quiet = false;
        }
    }
    pthread_mutex_unlock(&op->mu);
    if (ost != WEFT_OK && quiet) {
        weft_future_complete(op->user, ost, why, NULL); /* the first completion counts */
    }
}

/* A server answered (or failed) its part. A pull fails at its first failed part (the caller's
 * memory is written only while the pull is good, under op->mu): a part parked on a live server
 * (a SYNC step that a lost worker will never end) does not hold it to its deadline. A push waits
 * for every part, whose tensors are the caller's memory in flight. */
static void sub_done(weft_future_t *f, void *arg)
{
    ps_sub_t *sub = arg;
    ps_op_t *op = sub->op;
    weft_ps_table_t *t = op->t;
    weft_ps_t *ps = t->ps;
    weft_status_t st = weft_future_status(f);
    if (st != WEFT_OK) {
        op_fail(op, st, "ps: table '%s', server %u (rank %d): %s", t->l.name, sub->s,
                ps->servers[sub->s], weft_future_error(f));
    } else if (op->kind == OP_PULL || op->kind == OP_PUSH_PULL) {
        weft_value_t *body = NULL;
        bool ok = weft_msg_body(weft_future_value(f), &body) == WEFT_OK;
        pthread_mutex_lock(&op->mu);
        if (op->st == WEFT_OK && !(ok && scatter(op, sub, body))) {
            if (!ok) {
                snprintf(op->why, sizeof(op->why),
                         "ps: table '%s', server %u: a reply without "
                         "a body",
                         t->l.name, sub->s);
            }
            op->st = WEFT_ERR_PROTOCOL;
        }
        pthread_mutex_unlock(&op->mu);
        weft_value_free(body);
    }
    pthread_mutex_lock(&op->mu);
    sub->over = true;
    pthread_mutex_unlock(&op->mu);
    if (op->kind == OP_PULL) {
        pull_fail_early(op);
    }
    weft_future_release(f);
    op_part_done(op);
}

/* A push's number for server @p s: one of a push that never left, else the next. */
static uint64_t seq_take(weft_ps_t *ps, uint32_t s)
{
    uint64_t seq = 0;
    if (atomic_load(&ps->n_seq_free[s]) > 0) {
        pthread_mutex_lock(&ps->seq_mu);
        uint32_t n = atomic_load(&ps->n_seq_free[s]);
        if (n > 0) {
            seq = ps->seq_free[s][n - 1];
            atomic_store(&ps->n_seq_free[s], n - 1);
        }
        pthread_mutex_unlock(&ps->seq_mu);
    }
    return seq != 0 ? seq : atomic_fetch_add(&ps->seq[s], 1) + 1;
}

/* A push to server @p s numbered @p seq was refused before it left this process: it is not
 * counted among the table's pushes, and its number goes to the next push (a number never sent
 * would stay a hole in the server's window, and 4096 pushes later every push would be refused).
 */
static void push_unsent(weft_ps_table_t *t, uint32_t s, uint64_t seq)
{
    weft_ps_t *ps = t->ps;
    atomic_fetch_sub(&t->pushes[s], 1);
    pthread_mutex_lock(&ps->seq_mu);
    uint32_t n = atomic_load(&ps->n_seq_free[s]);
    if (n < PS_SEQ_FREE) {
        ps->seq_free[s][n] = seq;
        atomic_store(&ps->n_seq_free[s], n + 1);
    } else {
        WEFT_WARN("ps: %u pushes to server %u refused before they left: push number %llu is lost "
                  "to the server's window",
                  PS_SEQ_FREE, s, (unsigned long long)seq);
    }
    pthread_mutex_unlock(&ps->seq_mu);
}

/* A piece of a sparse pull's reply rows, straight from a shared-memory ring: each row's bytes go
 * to every position of the caller's ids that asked for it (a piece may start or end mid-row). */
static void pull_sink(void *arg, size_t off, const void *bytes, size_t n)
{
    ps_sub_t *sub = arg;
    ps_op_t *op = sub->op;
    size_t rb = (size_t)op->dim * sizeof(float);
    const char *src = bytes;
    size_t end = off + n;
    while (off < end) {
        size_t r = off / rb, in = off % rb;
        size_t take = rb - in < end - off ? rb - in : end - off;
        const uint32_t *g = op->first + sub->base + r;
        for (uint32_t k = g[0]; k < g[1]; k++) {
            memcpy((char *)(op->dst + (size_t)op->dests[k] * (size_t)op->dim) + in, src, take);
        }
        off += take;
        src += take;
    }
    sub->sunk += n;
}

static void sub_send(ps_sub_t *sub, weft_value_t *msg)
{
    ps_op_t *op = sub->op;
    weft_ps_t *ps = op->t->ps;
    weft_future_t *f = NULL;
    weft_status_t st;
    const ps_layout_t *l = &op->t->l;
    bool land = false;
    if (op->dst != NULL && l->spec.kind == WEFT_PS_DENSE && sub->n_chunks > 0 &&
        sub->n_chunks <= 64) {
        /* A dense pull's chunks are received straight into the caller's tensor; decided and sent
         * under op->mu, so that a pull failing meanwhile (pull_fail_early) either sees this part
         * and withdraws it, or this part sees the failure and takes no part of that memory. */
        weft_rpc_into_t into[64];
        pthread_mutex_lock(&op->mu);
        land = op->st == WEFT_OK;
        if (land) {
            for (size_t j = 0; j < sub->n_chunks; j++) {
                uint32_t c = sub->chunks[j];
                into[j] = (weft_rpc_into_t){
                    .data = op->dst + (int64_t)c * l->chunk_elems,
                    .nbytes = (size_t)weft__ps_chunk_len(l, c) * sizeof(float),
                    .dtype = WEFT_F32,
                };
            }
            st = weft_rpc_async_into(ps->agent, ps->servers[sub->s], PS_FN, msg, sub->timeout_ms,
                                     into, sub->n_chunks, &f);
            if (st == WEFT_OK) {
                sub->f = weft_future_retain(f);
            }
        }
        pthread_mutex_unlock(&op->mu);
    }
    if (op->dst != NULL && l->spec.kind == WEFT_PS_SPARSE && op->first != NULL && sub->rows > 0) {
        /* A sparse pull's rows go from the ring to the caller's rows (pull_sink), under op->mu
         * for the reason above. */
        pthread_mutex_lock(&op->mu);
        land = op->st == WEFT_OK;
        if (land) {
            weft_rpc_into_t into = {
                .nbytes = (size_t)sub->rows * (size_t)op->dim * sizeof(float),
                .dtype = WEFT_F32,
                .sink = pull_sink,
                .sink_arg = sub,
            };
            st = weft_rpc_async_into(ps->agent, ps->servers[sub->s], PS_FN, msg, sub->timeout_ms,
                                     &into, 1, &f);
            if (st == WEFT_OK) {
                sub->f = weft_future_retain(f);
            }
        }
        pthread_mutex_unlock(&op->mu);
    }
    if (!land) {
        st = weft_rpc_async(ps->agent, ps->servers[sub->s], PS_FN, msg, sub->timeout_ms, &f);
    }
    if (st != WEFT_OK) {
        op_fail(op, st, "ps: table '%s', server %u (rank %d): %s", op->t->l.name, sub->s,
                ps->servers[sub->s], weft_last_error());
        if (sub->seq != 0) {
            push_unsent(op->t, sub->s, sub->seq);
        }
        op_part_done(op);
        return;
    }
    weft_future_then(f, sub_done, sub);
}

static void delayed_run(void *arg, uint64_t data)
{
    (void)data;
    ps_sub_t *sub = arg;
    weft_value_t *msg = sub->delayed;
    sub->delayed = NULL;
    sub_send(sub, msg);
    weft_value_free(msg);
}

static void delayed_drop(void *arg, uint64_t data)
{
    (void)data;
    ps_sub_t *sub = arg;
    weft_value_free(sub->delayed);
    sub->delayed = NULL;
    op_fail(sub->op, WEFT_ERR_SHUTDOWN, "ps: the agent closed");
    if (sub->seq != 0) {
        push_unsent(sub->op->t, sub->s, sub->seq);
    }
    op_part_done(sub->op);
}

/* Sends one server's part of @p op. */
static weft_status_t op_send(ps_op_t *op, ps_sub_t *sub, const Weft__V1__PsRequest *hdr,
                             weft_tensor_t *const *tensors, size_t n, int64_t timeout_ms)
{
    uint32_t s = sub->s;
    weft_ps_t *ps = op->t->ps;
    weft_value_t *body = NULL, *msg = NULL;
    weft_status_t st = WEFT_OK;
    bool push = hdr->op == WEFT__V1__PS_OP__PS_PUSH || hdr->op == WEFT__V1__PS_OP__PS_PUSH_PULL;
    if (n > 0) {
        st = weft_value_create(&body);
        for (size_t i = 0; i < n && st == WEFT_OK; i++) {
            st = weft_value_add_tensor(body, tensors[i]);
        }
    }
    if (st == WEFT_OK) {
        st = weft_msg_pack(&hdr->base, body, &msg);
    }
    weft_value_free(body);
    if (st != WEFT_OK) {
        return st;
    }
    sub->timeout_ms = timeout_ms;
    atomic_fetch_add(&op->left, 1);
    if (push && ps->fault_dup) {
        weft_future_t *dup = NULL;
        if (weft_rpc_async(ps->agent, ps->servers[s], PS_FN, msg, timeout_ms, &dup) == WEFT_OK) {
            weft_future_release(dup);
            sub->seq = 0; /* the push has left (as its duplicate), whatever happens to it now */
        }
    }
    if (push && ps->fault_delay_us > 0) {
        sub->delayed = msg;
        int64_t d = (int64_t)((uint64_t)weft__now_ns() % (uint64_t)ps->fault_delay_us);
        /* (When it cannot be queued, delayed_drop has failed the part.) */
        weft_agent_timer_add(ps->agent, d, delayed_run, delayed_drop, sub, 0, NULL);
        return WEFT_OK;
    }
    sub_send(sub, msg);
    weft_value_free(msg);
    return WEFT_OK;
}

/* The caller's part is over: the future completes when every server's is. */
static void op_launched(ps_op_t *op, weft_future_t **f_p)
{
    *f_p = weft_future_retain(op->user);
    op_part_done(op);
}

static weft_status_t check_worker(weft_ps_table_t *t)
{
    weft_ps_t *ps = t->ps;
    if (ps->worker_index < 0) {
        return weft__set_error(WEFT_ERR_INVALID_STATE, "ps: table '%s': rank %d is not a worker",
                               t->l.name, ps->rank);
    }
    for (uint32_t s = 0; s < ps->n_servers; s++) {
        if (atomic_load(&ps->server_lost[s])) {
            return weft__set_error(WEFT_ERR_PEER_LOST,
                                   "ps: table '%s': server %u (rank %d) was lost", t->l.name, s,
                                   ps->servers[s]);
        }
    }
    return WEFT_OK;
}

static weft_status_t check_dense(weft_ps_table_t *t, const weft_tensor_t *x, const char *what)
{
    const ps_layout_t *l = &t->l;
    if (x == NULL || l->spec.kind != WEFT_PS_DENSE) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "ps: table '%s': a %s needs a dense table "
                               "and a tensor",
                               l->name, what);
    }
    if (weft_tensor_dtype(x) != WEFT_F32) {
        return weft__set_error(WEFT_ERR_DTYPE, "ps: table '%s': the %s is %s, not f32", l->name,
                               what, weft_dtype_name(weft_tensor_dtype(x)));
    }
    if (weft_tensor_device(x).type != WEFT_DEVICE_CPU) {
        return weft__set_error(WEFT_ERR_UNSUPPORTED, "ps: table '%s': the %s is not on the CPU",
                               l->name, what);
    }
    bool same = weft_tensor_ndim(x) == l->spec.ndim;
    for (int i = 0; same && i < l->spec.ndim; i++) {
        same = weft_tensor_shape(x)[i] == l->spec.shape[i];
    }
    if (!same) {
        return weft__set_error(WEFT_ERR_SHAPE,
                               "ps: table '%s': the %s's shape is not the "
                               "table's",
                               l->name, what);
    }
    return WEFT_OK;
}

static void request_init(weft_ps_table_t *t, Weft__V1__PsRequest *r, Weft__V1__PsOp op)
{
    weft__v1__ps_request__init(r);
    r->op = op;
    r->table = t->l.id;
    r->table_name = t->l.name;
    r->worker = t->ps->worker_index;
    r->clock = atomic_load(&t->ps->clock);
}

static void view_release(void *data, void *arg)
{
    (void)data;
    weft_tensor_release(arg);
}

static weft_status_t dense_op(weft_ps_table_t *t, op_kind_t kind, const weft_tensor_t *grad,
                              weft_tensor_t *dst, int64_t timeout_ms, weft_future_t **f_p)
{
    weft_ps_t *ps = t->ps;
    const ps_layout_t *l = &t->l;
    ps_op_t *op = NULL;
    weft_status_t st;
    WEFT_CHECK(check_worker(t));
    if (f_p == NULL || timeout_ms < 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: no future, or a negative timeout");
    }
    if (kind != OP_PULL) {
        WEFT_CHECK(check_dense(t, grad, "gradient"));
    }
    if (kind != OP_PUSH) {
        WEFT_CHECK(check_dense(t, dst, "destination"));
    }
    WEFT_CHECK(op_new(t, kind, &op));
    op->dst = dst != NULL ? weft_tensor_data(dst) : NULL;
    op->chunk_ids = weft_alloc(l->n_chunks * sizeof(*op->chunk_ids));
    weft_tensor_t **views = weft_calloc(l->n_chunks, sizeof(*views));
    st = op->chunk_ids == NULL || views == NULL
             ? weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory")
             : WEFT_OK;
    Weft__V1__PsOp wop = kind == OP_PUSH   ? WEFT__V1__PS_OP__PS_PUSH
                         : kind == OP_PULL ? WEFT__V1__PS_OP__PS_PULL
                                           : WEFT__V1__PS_OP__PS_PUSH_PULL;
    size_t esz = weft_dtype_size(l->spec.dtype), nsub = 0, at = 0;
    for (uint32_t s = 0; s < ps->n_servers && st == WEFT_OK; s++) {
        /* The server's chunks, cut into requests of at most PS_REQUEST_BYTES (one chunk at
         * least): the server applies one while the next is on its way. */
        size_t first = at;
        for (uint32_t c = 0; c < l->n_chunks; c++) {
            if (l->owner[c] == s) {
                op->chunk_ids[at++] = c;
            }
        }
        for (size_t g = first; g < at && st == WEFT_OK;) {
            size_t n = 0, bytes = 0;
            while (g + n < at &&
                   (n == 0 || bytes + (size_t)weft__ps_chunk_len(l, op->chunk_ids[g + n]) * esz <=
                                  PS_REQUEST_BYTES)) {
                bytes += (size_t)weft__ps_chunk_len(l, op->chunk_ids[g + n]) * esz;
                n++;
            }
            for (size_t i = 0; i < n && grad != NULL && st == WEFT_OK; i++) {
                uint32_t c = op->chunk_ids[g + i];
                int64_t len = weft__ps_chunk_len(l, c);
                float *p = (float *)weft_tensor_data(grad) + (int64_t)c * l->chunk_elems;
                /* The view holds the gradient: the transport may still be handing its bytes to
                 * the kernel when the server's answer completes the push (and the caller frees
                 * the gradient). */
                weft_tensor_t *owner = weft_tensor_retain((weft_tensor_t *)grad);
                st = weft_tensor_wrap(WEFT_F32, 1, &len, p, (size_t)len * sizeof(float), WEFT_CPU,
                                      view_release, owner, &views[i]);
                if (st != WEFT_OK) {
                    weft_tensor_release(owner);
                }
            }
            ps_sub_t *sub = &op->subs[nsub++];
            sub->op = op;
            sub->s = s;
            sub->chunks = &op->chunk_ids[g];
            sub->n_chunks = n;
            Weft__V1__PsRequest r;
            request_init(t, &r, wop);
            r.n_chunks = n;
            r.chunks = (uint32_t *)sub->chunks;
            if (st == WEFT_OK) {
                if (grad != NULL) {
                    r.seq = sub->seq = seq_take(ps, s);
                    r.pushes = atomic_fetch_add(&t->pushes[s], 1) + 1;
                } else {
                    r.pushes = atomic_load(&t->pushes[s]);
                }
                st = op_send(op, sub, &r, views, grad != NULL ? n : 0, timeout_ms);
                if (st != WEFT_OK && grad != NULL) {
                    push_unsent(t, s, r.seq);
                }
            }
            for (size_t i = 0; i < n; i++) {
                weft_tensor_release(views[i]);
                views[i] = NULL;
            }
            g += n;
        }
    }
    weft_free(views);
    if (st != WEFT_OK) {
        /* Parts already sent complete on their own; the operation fails. */
        op_fail(op, st, "%s", weft_last_error());
    }
    op_launched(op, f_p);
    return WEFT_OK;
}

weft_status_t weft_ps_push_async(weft_ps_table_t *t, const weft_tensor_t *grad, int64_t timeout_ms,
                                 weft_future_t **f_p)
{
    return dense_op(t, OP_PUSH, grad, NULL, timeout_ms, f_p);
}

weft_status_t weft_ps_pull_async(weft_ps_table_t *t, weft_tensor_t *dst, int64_t timeout_ms,
                                 weft_future_t **f_p)
{
    return dense_op(t, OP_PULL, NULL, dst, timeout_ms, f_p);
}

weft_status_t weft_ps_push_pull_async(weft_ps_table_t *t, const weft_tensor_t *grad,
                                      weft_tensor_t *dst, int64_t timeout_ms, weft_future_t **f_p)
{
    return dense_op(t, OP_PUSH_PULL, grad, dst, timeout_ms, f_p);
}

/* Sparse: the distinct ids of a call per server (gradients of repeats summed), then one request
 * per server. */
/* Places each of the @p n ids on its server: srv_of[i], and pos_of[i], the place of its distinct
 * id among those of that server, numbered in the order of first sight (count[s]: how many). An
 * open-addressing table of first sights (index + 1, 0: empty), 4 bytes a slot at most half full:
 * 32 KiB for 4096 ids. */
static weft_status_t distinct_ids(const uint64_t *ids, size_t n, uint32_t ns, uint32_t *srv_of,
                                  uint32_t *pos_of, size_t *count)
{
    if (n >= UINT32_MAX) {
        return weft__set_error(WEFT_ERR_TOO_LARGE, "ps: %zu ids in one call", n);
    }
    int bits = 4;
    while (((size_t)1 << bits) < 2 * n) {
        bits++;
    }
    size_t mask = ((size_t)1 << bits) - 1;
    uint32_t *slot = weft_calloc(mask + 1, sizeof(*slot));
    if (slot == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory for %zu ids", n);
    }
    for (size_t i = 0; i < n; i++) {
        size_t h = (size_t)((ids[i] * UINT64_C(0x9E3779B97F4A7C15)) >> (64 - bits));
        for (;; h = (h + 1) & mask) {
            uint32_t f = slot[h];
            if (f == 0) {
                uint32_t s = weft__ps_id_server(ids[i], ns);
                slot[h] = (uint32_t)i + 1;
                srv_of[i] = s;
                pos_of[i] = (uint32_t)count[s]++;
                break;
            }
            if (ids[f - 1] == ids[i]) {
                srv_of[i] = srv_of[f - 1];
                pos_of[i] = pos_of[f - 1];
                break;
            }
        }
    }
    weft_free(slot);
    return WEFT_OK;
}

static weft_status_t sparse_op(weft_ps_table_t *t, op_kind_t kind, const uint64_t *ids, size_t n,
                               const weft_tensor_t *rows, weft_tensor_t *out, int64_t timeout_ms,
                               weft_future_t **f_p)
{
    weft_ps_t *ps = t->ps;
    const ps_layout_t *l = &t->l;
    int64_t d = l->spec.dim;
    weft_tensor_t *x = kind == OP_PUSH ? (weft_tensor_t *)rows : out;
    WEFT_CHECK(check_worker(t));
    if (f_p == NULL || timeout_ms < 0 || (ids == NULL && n > 0) || x == NULL ||
        l->spec.kind != WEFT_PS_SPARSE) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "ps: table '%s': a sparse operation needs a "
                               "sparse table, ids, rows and a future",
                               l->name);
    }
    if (weft_tensor_dtype(x) != WEFT_F32) {
        return weft__set_error(WEFT_ERR_DTYPE, "ps: table '%s': rows are %s, not f32", l->name,
                               weft_dtype_name(weft_tensor_dtype(x)));
    }
    if (weft_tensor_device(x).type != WEFT_DEVICE_CPU) {
        return weft__set_error(WEFT_ERR_UNSUPPORTED, "ps: table '%s': the rows are not on the CPU",
                               l->name);
    }
    if (weft_tensor_ndim(x) != 2 || weft_tensor_shape(x)[0] != (int64_t)n ||
        weft_tensor_shape(x)[1] != d) {
        return weft__set_error(WEFT_ERR_SHAPE, "ps: table '%s': rows must be [%zu, %lld]", l->name,
                               n, (long long)d);
    }
    for (size_t i = 0; i < n; i++) {
        if (l->spec.id_bound != 0 && ids[i] >= l->spec.id_bound) {
            return weft__set_error(WEFT_ERR_INVALID_ARG,
                                   "ps: table '%s': id %llu is out of "
                                   "[0, %llu)",
                                   l->name, (unsigned long long)ids[i],
                                   (unsigned long long)l->spec.id_bound);
        }
    }
    ps_op_t *op = NULL;
    WEFT_CHECK(op_new(t, kind, &op));
    weft_status_t st = WEFT_OK;
    uint32_t ns = ps->n_servers;
    size_t *count = weft_calloc(ns, sizeof(*count));
    uint64_t **sids = weft_calloc(ns, sizeof(*sids));
    float **srows = weft_calloc(ns, sizeof(*srows));
    weft_tensor_t **tid = weft_calloc(ns, sizeof(*tid)), **trow = weft_calloc(ns, sizeof(*trow));
    op->srv_of = weft_alloc((n + 1) * sizeof(*op->srv_of));
    op->pos_of = weft_alloc((n + 1) * sizeof(*op->pos_of));
    op->n_ids = n;
    op->dim = d;
    op->dst = kind == OP_PULL ? weft_tensor_data(out) : NULL;
    if (count == NULL || sids == NULL || srows == NULL || tid == NULL || trow == NULL ||
        op->srv_of == NULL || op->pos_of == NULL) {
        st = weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory");
        goto out;
    }
    /* Distinct ids, each placed on its server. */
    if (st == WEFT_OK) {
        st = distinct_ids(ids, n, ns, op->srv_of, op->pos_of, count);
    }
    /* A pull's rows per distinct id, for pull_sink: the positions each goes to. */
    if (st == WEFT_OK && kind == OP_PULL && n > 0) {
        size_t u = 0;
        for (uint32_t s = 0; s < ns; s++) {
            op->subs[s].base = (uint32_t)u;
            op->subs[s].rows = (uint32_t)count[s];
            u += count[s];
        }
        op->first = weft_calloc(u + 1, sizeof(*op->first));
        op->dests = weft_alloc(n * sizeof(*op->dests));
        if (op->first == NULL || op->dests == NULL) {
            st = weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory");
        }
        for (size_t i = 0; i < n && st == WEFT_OK; i++) {
            op->first[op->subs[op->srv_of[i]].base + op->pos_of[i] + 1]++;
        }
        for (size_t g = 0; g < u && st == WEFT_OK; g++) {
            op->first[g + 1] += op->first[g];
        }
        /* first[g] as g's cursor, then shifted back by one row */
        for (size_t i = 0; i < n && st == WEFT_OK; i++) {
            op->dests[op->first[op->subs[op->srv_of[i]].base + op->pos_of[i]]++] = (uint32_t)i;
        }
        if (st == WEFT_OK) {
            memmove(op->first + 1, op->first, u * sizeof(*op->first));
            op->first[0] = 0;
        }
    }
    /* A part over its receiver's message limit is refused here, before anything is sent or
     * numbered: the operation applies nothing. */
    for (uint32_t s = 0; s < 2 * ns && st == WEFT_OK; s++) {
        /* Each server's part twice: what goes to it (a push: ids and rows; a pull: ids), then
         * what comes back to this rank (a pull: the rows). */
        bool back = s >= ns;
        uint32_t sv = s % ns;
        int to = back ? ps->rank : ps->servers[sv];
        uint64_t per_row = kind == OP_PUSH ? sizeof(uint64_t) + (uint64_t)d * sizeof(float)
                                           : back ? (uint64_t)d * sizeof(float) : sizeof(uint64_t);
        uint64_t bytes = (uint64_t)count[sv] * per_row + PS_HEADROOM;
        uint64_t limit = weft_agent_max_message_bytes(ps->agent, to);
        if (count[sv] > 0 && limit > 0 && bytes > limit && !(back && kind == OP_PUSH)) {
            st = weft__set_error(WEFT_ERR_TOO_LARGE,
                                 "ps: table '%s': a %s of %zu distinct rows makes %llu bytes "
                                 "for server %u (rank %d), over rank %d's message limit of %llu; "
                                 "%s fewer ids at a time",
                                 l->name, kind == OP_PUSH ? "push" : "pull", count[sv],
                                 (unsigned long long)bytes, sv, ps->servers[sv], to,
                                 (unsigned long long)limit, kind == OP_PUSH ? "push" : "pull");
        }
    }
    for (uint32_t s = 0; s < ns && st == WEFT_OK; s++) {
        if (count[s] == 0) {
            continue;
        }
        int64_t k = (int64_t)count[s], shape[2] = {k, d};
        st = weft_tensor_empty(WEFT_I64, 1, &k, &tid[s]);
        if (st == WEFT_OK && kind == OP_PUSH) {
            st = weft_tensor_empty(WEFT_F32, 2, shape, &trow[s]);
        }
        if (st == WEFT_OK) {
            sids[s] = weft_tensor_data(tid[s]);
            srows[s] = trow[s] != NULL ? weft_tensor_data(trow[s]) : NULL;
        }
    }
    /* A push's rows: an id's first row copied, its repeats added (positions are numbered in the
     * order of first sight, so a position seen for the first time is the next one of its
     * server; count[] counts them again). */
    const float *g = kind == OP_PUSH ? weft_tensor_data(rows) : NULL;
    if (g != NULL) {
        memset(count, 0, ns * sizeof(*count));
    }
    for (size_t i = 0; i < n && st == WEFT_OK; i++) {
        uint32_t s = op->srv_of[i], p = op->pos_of[i];
        sids[s][p] = ids[i];
        if (g != NULL) {
            float *dstrow = srows[s] + (size_t)p * (size_t)d;
            const float *src = g + i * (size_t)d;
            if (p == count[s]) {
                memcpy(dstrow, src, (size_t)d * sizeof(float));
                count[s]++;
            } else {
                weft_reduce_into(dstrow, src, (size_t)d, WEFT_F32, WEFT_SUM);
            }
        }
    }
    for (uint32_t s = 0; s < ns && st == WEFT_OK; s++) {
        if (count[s] == 0) {
            continue;
        }
        Weft__V1__PsRequest r;
        request_init(t, &r, kind == OP_PUSH ? WEFT__V1__PS_OP__PS_PUSH : WEFT__V1__PS_OP__PS_PULL);
        weft_tensor_t *ts[2] = {tid[s], trow[s]};
        if (kind == OP_PUSH) {
            r.seq = op->subs[s].seq = seq_take(ps, s);
            r.pushes = atomic_fetch_add(&t->pushes[s], 1) + 1;
        } else {
            r.pushes = atomic_load(&t->pushes[s]);
        }
        st = op_send(op, &op->subs[s], &r, ts, kind == OP_PUSH ? 2 : 1, timeout_ms);
        if (st != WEFT_OK && kind == OP_PUSH) {
            push_unsent(t, s, r.seq);
        }
    }

out:
    for (uint32_t s = 0; tid != NULL && s < ns; s++) {
        weft_tensor_release(tid[s]);
    }
    for (uint32_t s = 0; trow != NULL && s < ns; s++) {
        weft_tensor_release(trow[s]);
    }
    weft_free(count);
    weft_free(sids);
    weft_free(srows);
    weft_free(tid);
    weft_free(trow);
    if (st != WEFT_OK) {
        op_fail(op, st, "%s", weft_last_error());
    }
    op_launched(op, f_p);
    return WEFT_OK;
}

weft_status_t weft_ps_push_rows_async(weft_ps_table_t *t, const uint64_t *ids, size_t n,
                                      const weft_tensor_t *rows, int64_t timeout_ms,
                                      weft_future_t **f_p)
{
    return sparse_op(t, OP_PUSH, ids, n, rows, NULL, timeout_ms, f_p);
}

weft_status_t weft_ps_pull_rows_async(weft_ps_table_t *t, const uint64_t *ids, size_t n,
                                      weft_tensor_t *rows, int64_t timeout_ms, weft_future_t **f_p)
{
    return sparse_op(t, OP_PULL, ids, n, NULL, rows, timeout_ms, f_p);
}

/* Waits for the future of a call that returned @p st (its future is *f_p). */
static weft_status_t wait_op(weft_status_t st, weft_future_t **f_p)
{
    weft_future_t *f = *f_p;
    if (st != WEFT_OK) {
        return st;
    }
    weft_future_wait(f, 0);
    st = weft_future_status(f);
    if (st != WEFT_OK) {
        weft__set_error(st, "%s", weft_future_error(f));
    }
    weft_future_release(f);
    return st;
}

weft_status_t weft_ps_push(weft_ps_table_t *t, const weft_tensor_t *grad, int64_t timeout_ms)
{
    weft_future_t *f = NULL;
    weft_status_t st = weft_ps_push_async(t, grad, timeout_ms, &f);
    return wait_op(st, &f);
}

weft_status_t weft_ps_pull(weft_ps_table_t *t, weft_tensor_t *dst, int64_t timeout_ms)
{
    weft_future_t *f = NULL;
    weft_status_t st = weft_ps_pull_async(t, dst, timeout_ms, &f);
    return wait_op(st, &f);
}

weft_status_t weft_ps_push_pull(weft_ps_table_t *t, const weft_tensor_t *grad, weft_tensor_t *dst,
                                int64_t timeout_ms)
{
    if (t != NULL && t->l.spec.consistency == WEFT_PS_SYNC) {
        /* Its pull waits for the step the push is in, which this worker's clock ends: a clock
         * that would come only after the wait. */
        return weft__set_error(WEFT_ERR_INVALID_STATE,
                               "ps: table '%s' is SYNC: its push_pull's pull waits for the step "
                               "to end, which this worker's clock does; call "
                               "weft_ps_push_pull_async, then weft_ps_clock, then wait",
                               t->l.name);
    }
    weft_future_t *f = NULL;
    weft_status_t st = weft_ps_push_pull_async(t, grad, dst, timeout_ms, &f);
    return wait_op(st, &f);
}

weft_status_t weft_ps_push_rows(weft_ps_table_t *t, const uint64_t *ids, size_t n,
                                const weft_tensor_t *rows, int64_t timeout_ms)
{
    weft_future_t *f = NULL;
    weft_status_t st = weft_ps_push_rows_async(t, ids, n, rows, timeout_ms, &f);
    return wait_op(st, &f);
}

weft_status_t weft_ps_pull_rows(weft_ps_table_t *t, const uint64_t *ids, size_t n,
                                weft_tensor_t *rows, int64_t timeout_ms)
{
    weft_future_t *f = NULL;
    weft_status_t st = weft_ps_pull_rows_async(t, ids, n, rows, timeout_ms, &f);
    return wait_op(st, &f);
}

/* ------------------------------------------------------------------ to every server at once */

weft_status_t weft__ps_all_servers(weft_ps_t *ps, Weft__V1__PsRequest *r,
                                   Weft__V1__PsRequest *(*per_server)(weft_ps_t *, uint32_t,
                                                                      void *),
                                   int64_t timeout_ms, weft_value_t **replies, bool retry_unready)
{
    uint32_t ns = ps->n_servers;
    weft_future_t **fs = weft_calloc(ns, sizeof(*fs));
    weft_status_t st = WEFT_OK;
    if (timeout_ms == 0) {
        timeout_ms = weft_agent_call_timeout_ms(ps->agent);
    }
    int64_t deadline = weft__now_ns() + timeout_ms * 1000000;
    if (fs == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory");
    }
    for (uint32_t s = 0; s < ns && st == WEFT_OK; s++) {
        Weft__V1__PsRequest *rs = per_server != NULL ? per_server(ps, s, r) : r;
        for (int64_t backoff_ms = 5;; backoff_ms = backoff_ms < 200 ? backoff_ms * 2 : 200) {
            int64_t left = (deadline - weft__now_ns()) / 1000000;
            if (left <= 0) {
                st = weft__set_error(WEFT_ERR_TIMEOUT,
                                     "ps: server %u (rank %d) did not answer "
                                     "within %lld ms",
                                     s, ps->servers[s], (long long)timeout_ms);
                break;
            }
            st = weft__ps_call(ps, s, rs, NULL, 0, left, &fs[s]);
            if (st != WEFT_OK) {
                break;
            }
            if (!retry_unready) {
                break;
            }
            /* A creation may reach a rank that has not made its parameter server yet. */
            weft_future_wait(fs[s], 0);
            weft_status_t fst = weft_future_status(fs[s]);
            if (fst != WEFT_ERR_NO_SUCH_FUNCTION && fst != WEFT_ERR_INVALID_STATE) {
                break;
            }
            weft_future_release(fs[s]);
            fs[s] = NULL;
            struct timespec ts = {0, (long)backoff_ms * 1000000};
            nanosleep(&ts, NULL);
        }
    }
    for (uint32_t s = 0; s < ns; s++) {
        if (fs[s] == NULL) {
            continue;
        }
        weft_future_wait(fs[s], 0);
        weft_status_t fst = weft_future_status(fs[s]);
        if (fst != WEFT_OK && st == WEFT_OK) {
            st = weft__set_error(fst, "ps: server %u (rank %d): %s", s, ps->servers[s],
                                 weft_future_error(fs[s]));
        }
        if (fst == WEFT_OK && replies != NULL) {
            weft_future_take_value(fs[s], &replies[s]);
        }
        weft_future_release(fs[s]);
    }
    weft_free(fs);
    return st;
}

/* ------------------------------------------------------------------ tables */

void weft_ps_table_spec_init(weft_ps_table_spec_t *spec, const char *name, weft_ps_kind_t kind)
{
    memset(spec, 0, sizeof(*spec));
    spec->name = name;
    spec->kind = kind;
    spec->dtype = WEFT_F32;
    spec->init = WEFT_PS_ZEROS;
    spec->seed = 0;
    spec->optimizer = WEFT_PS_SGD;
    spec->sgd = weft_optim_sgd_defaults();
    spec->sgd.lr = 0.01;
    spec->adagrad = weft_optim_adagrad_defaults();
    spec->adam = weft_optim_adam_defaults();
    spec->consistency = WEFT_PS_SYNC;
    spec->chunk_bytes = PS_DEFAULT_CHUNK;
}

weft_status_t weft_ps_table_create(weft_ps_t *ps, const weft_ps_table_spec_t *spec,
                                   int64_t timeout_ms, weft_ps_table_t **table_p)
{
    if (ps == NULL || spec == NULL || table_p == NULL || timeout_ms < 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: NULL argument or negative timeout");
    }
    if (spec->name != NULL && weft_ps_table(ps, spec->name) != NULL) {
        return weft__set_error(WEFT_ERR_ALREADY_EXISTS, "ps: table '%s' exists", spec->name);
    }
    uint32_t id = atomic_load(&ps->n_tables);
    if (id >= PS_MAX_TABLES) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: more than %d tables", PS_MAX_TABLES);
    }
    weft_ps_table_t *t = weft_calloc(1, sizeof(*t));
    if (t == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory");
    }
    t->ps = ps;
    weft_status_t st = weft__ps_layout_init(&t->l, spec, id, ps->n_servers, ps->n_workers);
    if (st != WEFT_OK) {
        weft_free(t);
        return st;
    }
    t->pushes = weft_calloc(ps->n_servers, sizeof(*t->pushes));
    Weft__V1__PsTableSpec pb;
    Weft__V1__PsRequest r = WEFT__V1__PS_REQUEST__INIT;
    st = t->pushes == NULL ? weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory")
                           : weft__ps_spec_to_pb(&t->l, ps->servers, ps->workers, &pb);
    if (st == WEFT_OK) {
        r.op = WEFT__V1__PS_OP__PS_CREATE;
        r.table = id;
        r.table_name = t->l.name;
        r.worker = ps->worker_index;
        r.spec = &pb;
        st = weft__ps_all_servers(ps, &r, NULL, timeout_ms, NULL, true);
        weft__ps_spec_pb_free(&pb);
    }
    if (st != WEFT_OK) {
        weft__ps_layout_free(&t->l);
        weft_free((void *)t->pushes);
        weft_free(t);
        return st;
    }
    ps->tables[id] = t;
    atomic_store(&ps->n_tables, id + 1);
    *table_p = t;
    return WEFT_OK;
}

weft_ps_table_t *weft_ps_table(weft_ps_t *ps, const char *name)
{
    uint32_t n = atomic_load(&ps->n_tables);
    for (uint32_t i = 0; i < n; i++) {
        if (strcmp(ps->tables[i]->l.name, name) == 0) {
            return ps->tables[i];
        }
    }
    return NULL;
}

const weft_ps_table_spec_t *weft_ps_table_spec(const weft_ps_table_t *t)
{
    return &t->l.spec;
}

void weft_ps_table_print_map(const weft_ps_table_t *t, FILE *out)
{
    const ps_layout_t *l = &t->l;
    weft_ps_t *ps = t->ps;
    out = out != NULL ? out : stdout;
    fprintf(out, "table '%s' (id %u), shard map %016llx, %u server%s\n", l->name, l->id,
            (unsigned long long)l->map_hash, l->n_servers, l->n_servers == 1 ? "" : "s");
    if (l->spec.kind == WEFT_PS_SPARSE) {
        fprintf(out,
                "  sparse rows of %lld: id -> server by fibonacci64 ((id * 11400714819323198549)"
                " >> 32) %% %u, %d lock stripes per server\n",
                (long long)l->spec.dim, l->n_servers, PS_STRIPES);
        return;
    }
    size_t esz = weft_dtype_size(l->spec.dtype);
    for (uint32_t s = 0; s < l->n_servers; s++) {
        uint64_t bytes = 0, chunks = 0;
        for (uint32_t c = 0; c < l->n_chunks; c++) {
            if (l->owner[c] == s) {
                bytes += (uint64_t)weft__ps_chunk_len(l, c) * esz;
                chunks++;
            }
        }
        fprintf(out, "  server %u (rank %d): %llu chunks, %llu bytes:", s, ps->servers[s],
                (unsigned long long)chunks, (unsigned long long)bytes);
        for (uint32_t c = 0; c < l->n_chunks; c++) {
            if (l->owner[c] == s) {
                fprintf(out, " %u", c);
            }
        }
        fprintf(out, "\n");
    }
}

/* ------------------------------------------------------------------ clocks */

Weft__V1__PsRequest *weft__ps_counts_request(weft_ps_t *ps, uint32_t s, void *arg)
{
    Weft__V1__PsRequest *r = arg;
    uint32_t n = atomic_load(&ps->n_tables);
    for (uint32_t i = 0; i < n; i++) {
        r->step_pushes[i] = atomic_load(&ps->tables[i]->pushes[s]);
    }
    r->n_step_pushes = n;
    return r;
}

weft_status_t weft_ps_clock(weft_ps_t *ps, int64_t timeout_ms)
{
    if (ps == NULL || timeout_ms < 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: NULL or a negative timeout");
    }
    if (ps->worker_index < 0) {
        return weft__set_error(WEFT_ERR_INVALID_STATE, "ps: rank %d is not a worker", ps->rank);
    }
    Weft__V1__PsRequest r = WEFT__V1__PS_REQUEST__INIT;
    uint64_t *counts = weft_calloc(PS_MAX_TABLES, sizeof(*counts));
    if (counts == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory");
    }
    r.op = WEFT__V1__PS_OP__PS_CLOCK;
    r.worker = ps->worker_index;
    r.clock = atomic_load(&ps->clock) + 1;
    r.step_pushes = counts;
    r.table_name = "";
    weft_status_t st =
        weft__ps_all_servers(ps, &r, weft__ps_counts_request, timeout_ms, NULL, false);
    weft_free(counts);
    if (st == WEFT_OK) {
        atomic_fetch_add(&ps->clock, 1);
    }
    return st;
}

/* ------------------------------------------------------------------ stats */

static weft_status_t fetch_stats(weft_ps_t *ps, int64_t timeout_ms, Weft__V1__PsReply ***out)
{
    Weft__V1__PsRequest r = WEFT__V1__PS_REQUEST__INIT;
    r.op = WEFT__V1__PS_OP__PS_STATS;
    r.worker = ps->worker_index;
    r.table_name = "";
    weft_value_t **vals = weft_calloc(ps->n_servers, sizeof(*vals));
    Weft__V1__PsReply **reps = weft_calloc(ps->n_servers, sizeof(*reps));
    if (vals == NULL || reps == NULL) {
        weft_free(vals);
        weft_free(reps);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory");
    }
    weft_status_t st = weft__ps_all_servers(ps, &r, NULL, timeout_ms, vals, false);
    for (uint32_t s = 0; s < ps->n_servers; s++) {
        if (st == WEFT_OK) {
            st = weft__ps_reply_unpack(vals[s], &reps[s]);
        }
        weft_value_free(vals[s]);
    }
    weft_free(vals);
    *out = reps;
    return st;
}

static void free_stats(weft_ps_t *ps, Weft__V1__PsReply **reps)
{
    for (uint32_t s = 0; s < ps->n_servers; s++) {
        if (reps[s] != NULL) {
            weft__v1__ps_reply__free_unpacked(reps[s], &weft__pb_allocator);
        }
    }
    weft_free(reps);
}

static void load_of(const Weft__V1__PsReply *r, uint32_t id, weft_ps_load_t *l)
{
    memset(l, 0, sizeof(*l));
    if (id >= r->n_bytes_in || id >= r->n_rows || id >= r->n_pushes || id >= r->n_pulls ||
        id >= r->n_duplicates || id >= r->n_evicted || id >= r->n_bytes_out ||
        ((size_t)id + 1) * WEFT_PS_STALENESS_BUCKETS > r->n_staleness_hist) {
        return;
    }
    l->bytes_in = r->bytes_in[id];
    l->bytes_out = r->bytes_out[id];
    l->rows = r->rows[id];
    l->pushes = r->pushes[id];
    l->pulls = r->pulls[id];
    l->duplicates = r->duplicates[id];
    l->evicted = r->evicted[id];
    for (int b = 0; b < WEFT_PS_STALENESS_BUCKETS; b++) {
        l->staleness[b] = r->staleness_hist[(size_t)id * WEFT_PS_STALENESS_BUCKETS + b];
    }
}

weft_status_t weft_ps_table_stats(weft_ps_table_t *t, weft_ps_load_t *loads, int64_t timeout_ms)
{
    Weft__V1__PsReply **reps = NULL;
    weft_status_t st = fetch_stats(t->ps, timeout_ms, &reps);
    for (uint32_t s = 0; st == WEFT_OK && s < t->ps->n_servers; s++) {
        load_of(reps[s], t->l.id, &loads[s]);
    }
    if (reps != NULL) {
        free_stats(t->ps, reps);
    }
    return st;
}

weft_status_t weft_ps_print_stats(weft_ps_t *ps, FILE *out, int64_t timeout_ms)
{
    Weft__V1__PsReply **reps = NULL;
    out = out != NULL ? out : stdout;
    weft_status_t st = fetch_stats(ps, timeout_ms, &reps);
    uint32_t n = atomic_load(&ps->n_tables);
    for (uint32_t i = 0; st == WEFT_OK && i < n; i++) {
        weft_ps_table_t *t = ps->tables[i];
        uint64_t hist[WEFT_PS_STALENESS_BUCKETS] = {0};
        fprintf(out, "ps table '%s':\n", t->l.name);
        for (uint32_t s = 0; s < ps->n_servers; s++) {
            weft_ps_load_t l;
            load_of(reps[s], i, &l);
            fprintf(out,
                    "  server %u (rank %d): %llu rows/elements, %llu pushes (%llu duplicates), "
                    "%llu pulls, %.1f MB in, %.1f MB out, %llu evicted\n",
                    s, ps->servers[s], (unsigned long long)l.rows, (unsigned long long)l.pushes,
                    (unsigned long long)l.duplicates, (unsigned long long)l.pulls,
                    (double)l.bytes_in / 1e6, (double)l.bytes_out / 1e6,
                    (unsigned long long)l.evicted);
            for (int b = 0; b < WEFT_PS_STALENESS_BUCKETS; b++) {
                hist[b] += l.staleness[b];
            }
        }
        fprintf(out, "  pulls by staleness:");
        for (int b = 0; b < WEFT_PS_STALENESS_BUCKETS; b++) {
            if (hist[b] != 0) {
                fprintf(out, " %d%s:%llu", b, b == WEFT_PS_STALENESS_BUCKETS - 1 ? "+" : "",
                        (unsigned long long)hist[b]);
            }
        }
        fprintf(out, "\n");
    }
    if (reps != NULL) {
        free_stats(ps, reps);
    }
    return st;
}

/* ------------------------------------------------------------------ the end */

weft_status_t weft_ps_finish(weft_ps_t *ps, int64_t timeout_ms)
{
    weft_status_t st = WEFT_OK;
    if (ps == NULL || !ps->roles_set) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: no parameter server");
    }
    if (ps->worker_index >= 0) {
        Weft__V1__PsRequest r = WEFT__V1__PS_REQUEST__INIT;
        r.op = WEFT__V1__PS_OP__PS_FINISH;
        r.worker = ps->worker_index;
        r.table_name = "";
        st = weft__ps_all_servers(ps, &r, NULL, timeout_ms > 0 ? timeout_ms : 0, NULL, false);
    }
    if (ps->srv != NULL) {
        weft_status_t wst = weft__ps_server_wait_finished(ps->srv, timeout_ms);
        st = st == WEFT_OK ? wst : st;
    }
    return st;
}
