/* Process groups: the world and sub-groups, each with a worker thread that runs
 * its collective operations in the order they were issued. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static uint64_t hash_members(const int *world, int n)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a over the member list */
    for (int i = 0; i < n; i++) {
        uint32_t v = (uint32_t)world[i];
        for (int b = 0; b < 4; b++) {
            h ^= (v >> (8 * b)) & 0xff;
            h *= 1099511628211ull;
        }
    }
    return h ^ (uint64_t)n;
}

/* What a group reads of the configuration, once, when it is created: later changes of the
 * environment do not change it (the table reads each variable once per process anyway). */
static void read_config(coll_group_t *g)
{
    g->default_timeout_ms = weft__cfg_int(WEFT__CFG_COLL_TIMEOUT_MS);
    g->cma_allowed = weft__cfg_bool(WEFT__CFG_COLL_CMA);
    atomic_init(&g->timeout_ms, g->default_timeout_ms);
    for (int k = 0; k < COLL_KINDS; k++) {
        g->env_algo[k] = -1;
    }
    const char *algo = weft__cfg_str(WEFT__CFG_COLL_ALGO);
    if (strcmp(algo, "auto") != 0) {
        /* One of the table's all_reduce entries: the table validated it. */
        g->env_algo[OP_ALL_REDUCE] = coll__algo_find(OP_ALL_REDUCE, algo);
    }
    for (int k = 0; k < COLL_KINDS; k++) {
        g->algo[k] = g->env_algo[k];
        g->algo_from[k] = g->env_algo[k] >= 0 ? COLL_FROM_ENV : COLL_FROM_DEFAULT;
    }
}

_Static_assert(WEFT_COLL_BARRIER == (int)OP_BARRIER && WEFT_COLL_ALL_TO_ALL == (int)OP_ALL_TO_ALL &&
                   WEFT_COLL_ALL_REDUCE == (int)OP_ALL_REDUCE,
               "weft_coll_op_t follows the wire's CollOp");

static void *worker_main(void *arg);

static weft_status_t group_new(coll_ctx_t *ctx, uint32_t id, const int *world, int n, int rank,
                               weft_pg_t **pg_p)
{
    weft_pg_t *pg = weft_calloc(1, sizeof(*pg));
    coll_group_t *g = weft_calloc(1, sizeof(*g));

    if (pg == NULL || g == NULL || (g->world = weft_calloc((size_t)n, sizeof(int))) == NULL) {
        weft_free(pg);
        weft_free(g);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "new_group: no memory");
    }
    memcpy(g->world, world, (size_t)n * sizeof(int));
    g->ctx = ctx;
    g->id = id;
    g->size = n;
    g->rank = rank;
    g->hash = hash_members(world, n);
    read_config(g);
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    if (rank >= 0) {
        if (pthread_create(&g->thread, NULL, worker_main, g) != 0) {
            pthread_mutex_destroy(&g->mu);
            pthread_cond_destroy(&g->cv);
            weft_free(g->world);
            weft_free(g);
            weft_free(pg);
            return weft__set_error(WEFT_ERR_NO_MEMORY, "new_group: cannot start a thread");
        }
        g->started = true;
        coll__ctx_add_group(ctx, g);
    }
    pg->g = g;
    *pg_p = pg;
    return WEFT_OK;
}

weft_status_t weft_pg_world(weft_agent_t *a, weft_pg_t **pg_p)
{
    coll_ctx_t *ctx;

    if (a == NULL || pg_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "pg_world: NULL argument");
    }
    WEFT_CHECK(coll__ctx(a, &ctx));
    /* Every handle to the world shares one group: one sequence of operations. */
    pthread_mutex_lock(&ctx->mu);
    if (ctx->world != NULL) {
        weft_pg_t *pg = weft_calloc(1, sizeof(*pg));
        if (pg == NULL) {
            pthread_mutex_unlock(&ctx->mu);
            return weft__set_error(WEFT_ERR_NO_MEMORY, "pg_world: no memory");
        }
        ctx->world_refs++;
        pg->g = ctx->world;
        pthread_mutex_unlock(&ctx->mu);
        *pg_p = pg;
        return WEFT_OK;
    }
    pthread_mutex_unlock(&ctx->mu);
    int n = weft_agent_world_size(a);
    int *world = weft_alloc((size_t)n * sizeof(int));
    if (world == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "pg_world: no memory");
    }
    for (int i = 0; i < n; i++) {
        world[i] = i;
    }
    weft_status_t st = group_new(ctx, 0, world, n, weft_agent_rank(a), pg_p);
    weft_free(world);
    if (st == WEFT_OK) {
        pthread_mutex_lock(&ctx->mu);
        if (ctx->world == NULL) {
            ctx->world = (*pg_p)->g;
            ctx->world_refs = 1;
            pthread_mutex_unlock(&ctx->mu);
        } else {
            /* Another thread made it first: use that one. */
            coll_group_t *mine = (*pg_p)->g;
            ctx->world_refs++;
            (*pg_p)->g = ctx->world;
            pthread_mutex_unlock(&ctx->mu);
            weft_pg_t tmp = {mine};
            weft_pg_t *tp = weft_alloc(sizeof(*tp));
            if (tp != NULL) {
                *tp = tmp;
                weft_pg_free(tp);
            }
        }
    }
    return st;
}

weft_status_t weft_pg_new(weft_agent_t *a, const int *ranks, int n, weft_pg_t **pg_p)
{
    coll_ctx_t *ctx;

    if (a == NULL || pg_p == NULL || ranks == NULL || n < 1) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "new_group: NULL argument or no ranks");
    }
    int world = weft_agent_world_size(a);
    if (n > world) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "new_group: %d ranks in a world of %d", n,
                               world);
    }
    int me = -1;
    for (int i = 0; i < n; i++) {
        if (ranks[i] < 0 || ranks[i] >= world) {
            return weft__set_error(WEFT_ERR_INVALID_ARG,
                                   "new_group: rank %d is not in the world of %d", ranks[i], world);
        }
        for (int j = 0; j < i; j++) {
            if (ranks[j] == ranks[i]) {
                return weft__set_error(WEFT_ERR_INVALID_ARG, "new_group: rank %d is listed twice",
                                       ranks[i]);
            }
        }
        if (ranks[i] == weft_agent_rank(a)) {
            me = i;
        }
    }
    WEFT_CHECK(coll__ctx(a, &ctx));
    pthread_mutex_lock(&ctx->mu);
    uint32_t id = ++ctx->next_group; /* every rank creates groups in the same order */
    pthread_mutex_unlock(&ctx->mu);
    return group_new(ctx, id, ranks, n, me, pg_p);
}

int weft_pg_rank(const weft_pg_t *pg)
{
    return pg->g->rank;
}

int weft_pg_size(const weft_pg_t *pg)
{
    return pg->g->size;
}

int weft_pg_world_rank(const weft_pg_t *pg, int r)
{
    if (r < 0 || r >= pg->g->size) {
        return -1;
    }
    return pg->g->world[r];
}

void weft_pg_set_timeout(weft_pg_t *pg, int64_t timeout_ms)
{
    if (timeout_ms == 0) {
        atomic_store(&pg->g->timeout_ms, pg->g->default_timeout_ms);
    } else if (timeout_ms > 0) {
        atomic_store(&pg->g->timeout_ms, timeout_ms);
    }
}

static bool valid_kind(weft_coll_op_t op)
{
    return op >= WEFT_COLL_BARRIER && op <= WEFT_COLL_ALL_TO_ALL;
}

weft_status_t weft_pg_set_algorithm(weft_pg_t *pg, weft_coll_op_t op, const char *name)
{
    if (pg == NULL || !valid_kind(op)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "set_algorithm: NULL group or operation %d",
                               (int)op);
    }
    coll_group_t *g = pg->g;
    coll_kind_t kind = (coll_kind_t)op;
    int i = -1;
    coll_from_t from = COLL_FROM_CALL;
    if (name == NULL) {
        i = g->env_algo[kind]; /* as read when the group was created */
        from = i >= 0 ? COLL_FROM_ENV : COLL_FROM_DEFAULT;
    } else if (strcmp(name, "auto") != 0) {
        i = coll__algo_find(kind, name);
        if (i < 0) {
            char known[256] = "";
            size_t len = 0;
            coll__algo_names(kind, known, sizeof(known), &len);
            return weft__set_error(WEFT_ERR_NOT_FOUND,
                                   "set_algorithm: %s has no algorithm '%s' (it has auto, %s)",
                                   coll__kind_name(kind), name, known);
        }
    }
    pthread_mutex_lock(&g->mu);
    g->algo[kind] = i;
    g->algo_from[kind] = from;
    pthread_mutex_unlock(&g->mu);
    return WEFT_OK;
}

size_t weft_pg_describe(const weft_pg_t *pg, char *buf, size_t n)
{
    size_t len = 0;

    if (buf == NULL) {
        n = 0;
    } else if (n > 0) {
        buf[0] = '\0';
    }
    if (pg == NULL) {
        return 0;
    }
    coll_group_t *g = pg->g;
    coll__appendf(buf, n, &len, "group %u: ", g->id);
    if (g->rank >= 0) {
        coll__appendf(buf, n, &len, "rank %d of %d", g->rank, g->size);
    } else {
        coll__appendf(buf, n, &len, "not a member (%d members)", g->size);
    }
    coll__appendf(buf, n, &len, ", timeout %lld ms (default %lld ms), cross-memory reads %s\n",
                  (long long)atomic_load(&g->timeout_ms), (long long)g->default_timeout_ms,
                  g->cma_allowed ? "allowed" : "refused here (WEFT_COLL_CMA=0)");
    pthread_mutex_lock(&g->mu);
    coll__algo_describe(g, buf, n, &len);
    pthread_mutex_unlock(&g->mu);
    return len;
}

/* The device collectives by device type (index WEFT_DEVICE_CPU unused). */
static _Atomic(const weft_coll_device_ops_t *) device_ops[WEFT_DEVICE_CUDA + 1];

/* The device entries drop what they keep for @p pg: once nothing can issue on it any more
 * (its worker joined, or other handles of the world keep the group). */
static void tell_freed(weft_pg_t *pg)
{
    for (int type = WEFT_DEVICE_CPU + 1; type <= WEFT_DEVICE_CUDA; type++) {
        const weft_coll_device_ops_t *dev = atomic_load(&device_ops[type]);
        if (dev != NULL && dev->group_freed != NULL) {
            dev->group_freed(pg);
        }
    }
}

void weft_pg_free(weft_pg_t *pg)
{
    if (pg == NULL) {
        return;
    }
    coll_group_t *g = pg->g;
    coll_ctx_t *ctx = g->ctx;
    pthread_mutex_lock(&ctx->mu);
    if (ctx->world == g) {
        if (--ctx->world_refs > 0) {
            pthread_mutex_unlock(&ctx->mu);
            tell_freed(pg);
            weft_free(pg); /* other handles still use the world */
            return;
        }
        ctx->world = NULL;
    }
    pthread_mutex_unlock(&ctx->mu);
    if (g->started) {
        pthread_mutex_lock(&g->mu);
        g->stop = true; /* the worker runs what is queued, then exits */
        pthread_cond_broadcast(&g->cv);
        pthread_mutex_unlock(&g->mu);
        pthread_join(g->thread, NULL);
    }
    /* Members may still be reading our last oneshot slot, or our board: not freed under
     * them. */
    coll__oneshot_drain(g);
    coll__cma_drain(g);
    tell_freed(pg); /* nothing issues on it any more; it is still whole */
    /* Then its posted receives fail, and its pieces go. */
    coll__ctx_drop_group(ctx, g);
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    weft_free(g->done_extra);
    weft_free(g->cma_pids);
    weft_free(g->cma_boards);
    weft_free(g->cma_small);
    weft_free(g->cma_smalls);
    weft_free(g->cma_small_fin);
    weft_free(g->world);
    weft_free(g);
    weft_free(pg);
}

/* ------------------------------------------------------------ the worker */

/* The group whose worker this thread is (NULL elsewhere). */
static _Thread_local coll_group_t *tls_worker;

static void *worker_main(void *arg)
{
    coll_group_t *g = arg;

    tls_worker = g;
    pthread_mutex_lock(&g->mu);
    for (;;) {
        while ((g->qh == NULL || g->busy) && !(g->stop && g->qh == NULL && !g->busy)) {
            pthread_cond_wait(&g->cv, &g->mu);
        }
        coll_op_t *op = g->qh;
        if (op == NULL) {
            break;
        }
        g->qh = op->next;
        if (g->qh == NULL) {
            g->qt = NULL;
        }
        g->busy = true;
        pthread_mutex_unlock(&g->mu);
        coll__run(g, op);
        pthread_mutex_lock(&g->mu);
        g->busy = false;
        pthread_cond_broadcast(&g->cv);
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

static bool reduces(coll_kind_t kind)
{
    return kind == OP_ALL_REDUCE || kind == OP_REDUCE || kind == OP_REDUCE_SCATTER;
}

/* Checks what every operation needs of a tensor. Tensors of another device than the CPU are
 * only reduced (with their device's kernels, see find_kernels): the collectives move host
 * memory. */
static weft_status_t check_tensor(const weft_tensor_t *t, coll_kind_t kind)
{
    weft_device_t dev = weft_tensor_device(t);
    if (dev.type != WEFT_DEVICE_CPU && !reduces(kind)) {
        return weft__set_error(WEFT_ERR_UNSUPPORTED,
                               "%s: %s tensors are not supported (the collectives move host "
                               "memory; only reductions take other devices, with their reduce ops)",
                               coll__kind_name(kind),
                               dev.type == WEFT_DEVICE_CUDA ? "cuda" : "non-cpu");
    }
    if (weft_tensor_dtype(t) == WEFT_BOOL) {
        return weft__set_error(WEFT_ERR_DTYPE, "%s: bool tensors are not supported",
                               coll__kind_name(kind));
    }
    return WEFT_OK;
}

/* The reduction kernels of a reducing operation: those of its tensors' device (one device for
 * the input and the output). */
static weft_status_t find_kernels(coll_op_t *op)
{
    weft_device_t dev = weft_tensor_device(op->t);
    if (op->out != NULL) {
        weft_device_t odev = weft_tensor_device(op->out);
        if (odev.type != dev.type || odev.index != dev.index) {
            return weft__set_error(WEFT_ERR_INVALID_ARG,
                                   "%s: the input and the output are on different devices",
                                   coll__kind_name(op->kind));
        }
    }
    const weft_reduce_ops_t *ops;
    weft_status_t st = weft_reduce_ops_for(dev, &ops);
    if (st != WEFT_OK) {
        return weft__set_error(st, "%s: %s", coll__kind_name(op->kind), weft_last_error());
    }
    op->kern.ops = ops;
    op->kern.device = dev;
    return WEFT_OK;
}

/* The deadline @p timeout_ms from now (never past INT64_MAX). */
static int64_t deadline_after(int64_t timeout_ms)
{
    int64_t now = weft__now_ns();
    return timeout_ms > (INT64_MAX - now) / 1000000 ? INT64_MAX : now + timeout_ms * 1000000;
}

/* A member's call that fails its checks still takes its place in the group's
 * sequence, and tells the others, so that they fail that operation too rather
 * than wait for it, and later operations stay in step. Returns @p st. */
static weft_status_t reject(coll_group_t *g, weft_status_t st)
{
    if (g->rank < 0) {
        return st;
    }
    char why[600];
    snprintf(why, sizeof(why), "rank %d: %s", g->rank, weft_last_error());
    pthread_mutex_lock(&g->mu);
    uint64_t seq = g->next_seq++;
    pthread_mutex_unlock(&g->mu);
    coll__abort(g, seq, st, why);
    coll__seq_done(g, seq);
    return weft__set_error(st, "%s", why);
}

weft_status_t weft_coll_fail(weft_pg_t *pg, weft_status_t status, const char *why)
{
    if (status >= 0 || !weft_status_valid(status)) {
        status = WEFT_ERR_INVALID_ARG;
    }
    weft_status_t st = weft__set_error(status, "%s", why != NULL ? why : "failed");
    return pg != NULL && pg->g != NULL ? reject(pg->g, st) : st;
}

/* A NULL tensor: refused here, and (through reject) on the other members at once, instead of
 * their waiting for this one until the deadline. */
static weft_status_t null_tensor(weft_pg_t *pg, const char *what)
{
    weft_status_t st = weft__set_error(WEFT_ERR_INVALID_ARG, "%s", what);
    return pg != NULL && pg->g != NULL ? reject(pg->g, st) : st;
}

/* A blocking call from a callback of one of the group's futures, running on its worker
 * while it completes an operation: the worker cannot run @p op for it. This thread runs
 * the operations queued before it, then it, in order (as the worker would have). */
static void run_nested(coll_group_t *g, coll_op_t *op)
{
    for (;;) {
        pthread_mutex_lock(&g->mu);
        coll_op_t *head = g->qh; /* op is queued: the queue is not empty */
        g->qh = head->next;
        if (g->qh == NULL) {
            g->qt = NULL;
        }
        pthread_mutex_unlock(&g->mu);
        bool last = head == op;
        coll__run(g, head); /* frees head */
        if (last) {
            return;
        }
    }
}

/* Queues @p op (taken either way); with @p work_p NULL waits for it. */
static weft_status_t submit_op(weft_pg_t *pg, coll_op_t *op, weft_future_t **work_p)
{
    coll_group_t *g = pg->g;
    weft_future_t *f;
    coll_kind_t kind = op->kind;
    weft_status_t st = WEFT_OK;
    /* The deadline counts from the call, as torch's timeout does: time spent queued
     * behind the group's earlier operations counts. */
    int64_t deadline = deadline_after(atomic_load(&g->timeout_ms));

    if (g->rank < 0) {
        st = weft__set_error(WEFT_ERR_INVALID_STATE, "%s: this rank is not a member of group %u",
                             coll__kind_name(kind), g->id);
    }
    if (st == WEFT_OK && op->t != NULL) {
        st = check_tensor(op->t, kind);
    }
    if (st == WEFT_OK && op->out != NULL) {
        st = check_tensor(op->out, kind);
    }
    if (st == WEFT_OK && op->t != NULL && op->out != NULL &&
        weft_tensor_dtype(op->t) != weft_tensor_dtype(op->out)) {
        st = weft__set_error(WEFT_ERR_DTYPE, "%s: input is %s, output %s", coll__kind_name(kind),
                             weft_dtype_name(weft_tensor_dtype(op->t)),
                             weft_dtype_name(weft_tensor_dtype(op->out)));
    }
    if (st == WEFT_OK && reduces(kind)) {
        st = weft_reduce_check(op->rop, weft_tensor_dtype(op->t));
    }
    if (st == WEFT_OK && reduces(kind)) {
        st = find_kernels(op);
    }
    if (st == WEFT_OK && (op->root < 0 || op->root >= g->size)) {
        st = weft__set_error(WEFT_ERR_INVALID_ARG, "%s: root %d is not in the group of %d",
                             coll__kind_name(kind), op->root, g->size);
    }
    if (st == WEFT_OK) {
        st = weft_future_create(&f);
    }
    if (st != WEFT_OK) {
        coll__op_free(op, g->size);
        return g->rank < 0 ? st : reject(g, st);
    }
    op->f = weft_future_retain(f);
    op->deadline_ns = deadline;
    pthread_mutex_lock(&g->mu);
    op->seq = g->next_seq++;
    op->algo = g->algo[kind]; /* what the group says when the operation is issued */
    if (work_p == NULL && tls_worker == g) {
        /* On the worker itself (a callback of the group's futures): it is busy with the
         * operation that completed, so nobody else takes ops off the queue. */
        if (g->qt == NULL) {
            g->qh = g->qt = op;
        } else {
            g->qt->next = op;
            g->qt = op;
        }
        pthread_mutex_unlock(&g->mu);
        run_nested(g, op);
        st = weft_future_status(f);
        if (st != WEFT_OK) {
            weft__set_error(st, "%s", weft_future_error(f));
        }
        weft_future_release(f);
        return st;
    }
    if (work_p == NULL && g->qh == NULL && !g->busy) {
        /* A blocking call on an idle group runs on the caller's thread: no hand-off
         * to the worker and back. The worker waits while it runs (order is kept). */
        g->busy = true;
        pthread_mutex_unlock(&g->mu);
        coll__run(g, op);
        pthread_mutex_lock(&g->mu);
        g->busy = false;
        if (g->qh != NULL || g->stop) {
            /* The worker waits for that (else it would wake up for nothing: a context
             * switch per operation, on a core the ranks may need). */
            pthread_cond_broadcast(&g->cv);
        }
        pthread_mutex_unlock(&g->mu);
        st = weft_future_status(f);
        if (st != WEFT_OK) {
            weft__set_error(st, "%s", weft_future_error(f));
        }
        weft_future_release(f);
        return st;
    }
    if (g->qt == NULL) {
        g->qh = g->qt = op;
    } else {
        g->qt->next = op;
        g->qt = op;
    }
    pthread_cond_signal(&g->cv);
    pthread_mutex_unlock(&g->mu);
    if (work_p != NULL) {
        *work_p = f;
        return WEFT_OK;
    }
    /* The operation ends by its own deadline (and once the transport has let go of its
     * buffers): returning before would hand the caller tensors still in use. */
    st = weft_future_wait(f, -1);
    if (st != WEFT_OK) {
        weft__set_error(st, "%s", weft_future_error(f));
    }
    weft_future_release(f);
    return st;
}

static coll_op_t *op_new(coll_kind_t kind, const weft_tensor_t *t, const weft_tensor_t *out,
                         int root, weft_reduce_op_t rop)
{
    coll_op_t *op = weft_calloc(1, sizeof(*op));
    if (op == NULL) {
        weft__set_error(WEFT_ERR_NO_MEMORY, "%s: no memory", coll__kind_name(kind));
        return NULL;
    }
    op->kind = kind;
    op->t = t != NULL ? weft_tensor_retain((weft_tensor_t *)t) : NULL;
    op->out = out != NULL ? weft_tensor_retain((weft_tensor_t *)out) : NULL;
    op->root = root;
    op->rop = rop;
    return op;
}

static weft_status_t submit(weft_pg_t *pg, coll_kind_t kind, weft_tensor_t *t, int root,
                            weft_reduce_op_t rop, weft_future_t **work_p)
{
    coll_op_t *op = op_new(kind, t, NULL, root, rop);
    if (op == NULL) {
        return WEFT_ERR_NO_MEMORY;
    }
    return submit_op(pg, op, work_p);
}

weft_status_t weft_coll_barrier(weft_pg_t *pg, weft_future_t **work_p)
{
    return submit(pg, OP_BARRIER, NULL, 0, WEFT_SUM, work_p);
}


weft_status_t weft_coll_device_register(weft_device_type_t type, const weft_coll_device_ops_t *ops)
{
    if ((int)type <= (int)WEFT_DEVICE_CPU || (int)type > (int)WEFT_DEVICE_CUDA) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "collectives: device type %d cannot get device collectives",
                               (int)type);
    }
    if (ops != NULL && (ops->name == NULL || ops->all_reduce == NULL || ops->broadcast == NULL)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "collectives: a device entry needs a name and every function");
    }
    atomic_store(&device_ops[type], ops);
    return WEFT_OK;
}

/* The device entry for @p t's device, or NULL (a CPU tensor, or none registered). */
static const weft_coll_device_ops_t *device_entry(const weft_tensor_t *t)
{
    weft_device_t dev = weft_tensor_device(t);
    if (dev.type == WEFT_DEVICE_CPU || (int)dev.type < 0 || (int)dev.type > (int)WEFT_DEVICE_CUDA) {
        return NULL;
    }
    return atomic_load(&device_ops[dev.type]);
}

static weft_status_t submit_staged(weft_pg_t *pg, coll_kind_t kind, weft_tensor_t *t, int root,
                                   weft_reduce_op_t rop, weft_coll_ready_fn_t ready,
                                   void *ready_arg, weft_future_t **work_p)
{
    coll_op_t *op = op_new(kind, t, NULL, root, rop);
    if (op == NULL) {
        return WEFT_ERR_NO_MEMORY;
    }
    op->ready = ready;
    op->ready_arg = ready_arg;
    return submit_op(pg, op, work_p);
}

weft_status_t weft_coll_broadcast(weft_pg_t *pg, weft_tensor_t *t, int root, weft_future_t **work_p)
{
    if (t == NULL) {
        return null_tensor(pg, "broadcast: NULL tensor");
    }
    const weft_coll_device_ops_t *dev = device_entry(t);
    if (dev != NULL && pg != NULL) {
        return dev->broadcast(pg, t, root, work_p);
    }
    return submit(pg, OP_BROADCAST, t, root, WEFT_SUM, work_p);
}

weft_status_t weft_coll_all_reduce(weft_pg_t *pg, weft_tensor_t *t, weft_reduce_op_t op,
                                   weft_future_t **work_p)
{
    if (t == NULL) {
        return null_tensor(pg, "all_reduce: NULL tensor");
    }
    const weft_coll_device_ops_t *dev = device_entry(t);
    if (dev != NULL && pg != NULL) {
        return dev->all_reduce(pg, t, op, work_p);
    }
    return submit(pg, OP_ALL_REDUCE, t, 0, op, work_p);
}

weft_status_t weft_coll_all_reduce_staged(weft_pg_t *pg, weft_tensor_t *t, weft_reduce_op_t op,
                                          weft_coll_ready_fn_t ready, void *ready_arg,
                                          weft_future_t **work_p)
{
    if (t == NULL) {
        return null_tensor(pg, "all_reduce: NULL tensor");
    }
    return submit_staged(pg, OP_ALL_REDUCE, t, 0, op, ready, ready_arg, work_p);
}

weft_status_t weft_coll_broadcast_staged(weft_pg_t *pg, weft_tensor_t *t, int root,
                                         weft_coll_ready_fn_t ready, void *ready_arg,
                                         weft_future_t **work_p)
{
    if (t == NULL) {
        return null_tensor(pg, "broadcast: NULL tensor");
    }
    return submit_staged(pg, OP_BROADCAST, t, root, WEFT_SUM, ready, ready_arg, work_p);
}

weft_status_t weft_coll_reduce(weft_pg_t *pg, weft_tensor_t *t, int root, weft_reduce_op_t op,
                               weft_future_t **work_p)
{
    if (t == NULL) {
        return null_tensor(pg, "reduce: NULL tensor");
    }
    return submit(pg, OP_REDUCE, t, root, op, work_p);
}

/* out must hold @p parts times @p per elements (when it is given). */
static weft_status_t check_parts(const char *what, const weft_tensor_t *out, int64_t parts,
                                 int64_t per)
{
    if (out != NULL && weft_tensor_numel(out) != parts * per) {
        return weft__set_error(WEFT_ERR_SHAPE, "%s: %lld elements where %lld x %lld are needed",
                               what, (long long)weft_tensor_numel(out), (long long)parts,
                               (long long)per);
    }
    return WEFT_OK;
}

weft_status_t weft_coll_gather(weft_pg_t *pg, const weft_tensor_t *in, weft_tensor_t *out, int root,
                               weft_future_t **work_p)
{
    if (in == NULL || (pg->g->rank == root && out == NULL)) {
        return reject(pg->g, weft__set_error(WEFT_ERR_INVALID_ARG,
                                             "gather: NULL input, or no output on the root"));
    }
    weft_status_t cst =
        check_parts("gather", pg->g->rank == root ? out : NULL, pg->g->size, weft_tensor_numel(in));
    if (cst != WEFT_OK) {
        return reject(pg->g, cst);
    }
    coll_op_t *op = op_new(OP_GATHER, in, pg->g->rank == root ? out : NULL, root, WEFT_SUM);
    return op == NULL ? WEFT_ERR_NO_MEMORY : submit_op(pg, op, work_p);
}

weft_status_t weft_coll_scatter(weft_pg_t *pg, const weft_tensor_t *in, weft_tensor_t *out,
                                int root, weft_future_t **work_p)
{
    if (out == NULL || (pg->g->rank == root && in == NULL)) {
        return reject(pg->g, weft__set_error(WEFT_ERR_INVALID_ARG,
                                             "scatter: NULL output, or no input on the root"));
    }
    weft_status_t cst = check_parts("scatter", pg->g->rank == root ? in : NULL, pg->g->size,
                                    weft_tensor_numel(out));
    if (cst != WEFT_OK) {
        return reject(pg->g, cst);
    }
    coll_op_t *op = op_new(OP_SCATTER, pg->g->rank == root ? in : NULL, out, root, WEFT_SUM);
    return op == NULL ? WEFT_ERR_NO_MEMORY : submit_op(pg, op, work_p);
}

weft_status_t weft_coll_all_gather(weft_pg_t *pg, const weft_tensor_t *in, weft_tensor_t *out,
                                   weft_future_t **work_p)
{
    if (in == NULL || out == NULL) {
        return null_tensor(pg, "all_gather: NULL tensor");
    }
    weft_status_t cst = check_parts("all_gather", out, pg->g->size, weft_tensor_numel(in));
    if (cst != WEFT_OK) {
        return reject(pg->g, cst);
    }
    coll_op_t *op = op_new(OP_ALL_GATHER, in, out, 0, WEFT_SUM);
    return op == NULL ? WEFT_ERR_NO_MEMORY : submit_op(pg, op, work_p);
}

weft_status_t weft_coll_all_gather_list(weft_pg_t *pg, const weft_tensor_t *in,
                                        weft_tensor_t *const *outs, weft_future_t **work_p)
{
    int n = pg->g->size;
    if (in == NULL || outs == NULL) {
        return null_tensor(pg, "all_gather: NULL tensor or list");
    }
    for (int r = 0; r < n; r++) {
        if (outs[r] == NULL || weft_tensor_numel(outs[r]) != weft_tensor_numel(in) ||
            weft_tensor_dtype(outs[r]) != weft_tensor_dtype(in)) {
            return reject(pg->g,
                          weft__set_error(WEFT_ERR_SHAPE,
                                          "all_gather: list entry %d is missing or differs from "
                                          "the input in size or dtype",
                                          r));
        }
    }
    coll_op_t *op = op_new(OP_ALL_GATHER, in, NULL, 0, WEFT_SUM);
    if (op == NULL) {
        return WEFT_ERR_NO_MEMORY;
    }
    op->outs = weft_calloc((size_t)n, sizeof(*op->outs));
    if (op->outs == NULL) {
        coll__op_free(op, n);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "all_gather: no memory");
    }
    for (int r = 0; r < n; r++) {
        op->outs[r] = weft_tensor_retain(outs[r]);
    }
    return submit_op(pg, op, work_p);
}

weft_status_t weft_coll_reduce_scatter(weft_pg_t *pg, const weft_tensor_t *in, weft_tensor_t *out,
                                       weft_reduce_op_t rop, weft_future_t **work_p)
{
    if (in == NULL || out == NULL) {
        return null_tensor(pg, "reduce_scatter: NULL tensor");
    }
    weft_status_t cst = check_parts("reduce_scatter", in, pg->g->size, weft_tensor_numel(out));
    if (cst != WEFT_OK) {
        return reject(pg->g, cst);
    }
    coll_op_t *op = op_new(OP_REDUCE_SCATTER, in, out, 0, rop);
    return op == NULL ? WEFT_ERR_NO_MEMORY : submit_op(pg, op, work_p);
}

weft_status_t weft_coll_all_to_all(weft_pg_t *pg, const weft_tensor_t *in, weft_tensor_t *out,
                                   const int64_t *in_splits, const int64_t *out_splits,
                                   weft_future_t **work_p)
{
    int n = pg->g->size;
    if (in == NULL || out == NULL || (in_splits == NULL) != (out_splits == NULL)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "all_to_all: NULL tensor, or only one of the split lists");
    }
    int64_t *ins = weft_calloc((size_t)n, sizeof(int64_t));
    int64_t *outs = weft_calloc((size_t)n, sizeof(int64_t));
    if (ins == NULL || outs == NULL) {
        weft_free(ins);
        weft_free(outs);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "all_to_all: no memory");
    }
    int64_t tin = 0, tout = 0;
    for (int r = 0; r < n; r++) {
        ins[r] = in_splits != NULL ? in_splits[r] : weft_tensor_numel(in) / n;
        outs[r] = out_splits != NULL ? out_splits[r] : weft_tensor_numel(out) / n;
        if (ins[r] < 0 || outs[r] < 0 || ins[r] > weft_tensor_numel(in) ||
            outs[r] > weft_tensor_numel(out)) {
            weft_free(ins);
            weft_free(outs);
            return reject(pg->g, weft__set_error(WEFT_ERR_INVALID_ARG,
                                                 "all_to_all: split %d out of range", r));
        }
        tin += ins[r];
        tout += outs[r];
    }
    if (tin != weft_tensor_numel(in) || tout != weft_tensor_numel(out)) {
        weft_free(ins);
        weft_free(outs);
        return reject(pg->g, weft__set_error(
                                 WEFT_ERR_SHAPE,
                                 "all_to_all: splits add up to %lld in and %lld out for "
                                 "tensors of %lld and %lld elements",
                                 (long long)tin, (long long)tout, (long long)weft_tensor_numel(in),
                                 (long long)weft_tensor_numel(out)));
    }
    coll_op_t *op = op_new(OP_ALL_TO_ALL, in, out, 0, WEFT_SUM);
    if (op == NULL) {
        weft_free(ins);
        weft_free(outs);
        return WEFT_ERR_NO_MEMORY;
    }
    op->in_splits = ins;
    op->out_splits = outs;
    return submit_op(pg, op, work_p);
}

/* ------------------------------------------------------------ point to point */

weft_status_t weft_coll_send(weft_pg_t *pg, const weft_tensor_t *t, int dst, int tag,
                             weft_future_t **work_p)
{
    coll_group_t *g = pg->g;
    weft_future_t *f;

    if (g->rank < 0) {
        return weft__set_error(WEFT_ERR_INVALID_STATE, "send: not a member of group %u", g->id);
    }
    if (t == NULL || dst < 0 || dst >= g->size || tag < 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "send: NULL tensor, destination %d out of the group of %d, or "
                               "negative tag %d",
                               dst, g->size, tag);
    }
    WEFT_CHECK(check_tensor(t, (coll_kind_t)WEFT__V1__COLL_OP__COLL_OP_P2P));
    WEFT_CHECK(coll__p2p_send(g, t, dst, tag, &f));
    if (work_p != NULL) {
        *work_p = f;
        return WEFT_OK;
    }
    weft_status_t st = weft_future_wait(f, atomic_load(&g->timeout_ms));
    if (st == WEFT_ERR_TIMEOUT && !weft_future_done(f)) {
        /* Past the deadline the transport still reads t: the call may not return before
         * it lets go (a stalled write ends once written, or with its connection). */
        (void)weft_future_wait(f, -1);
        st = weft__set_error(WEFT_ERR_TIMEOUT,
                             "send: the transport held the tensor past the deadline (group "
                             "rank %d, tag %d)",
                             dst, tag);
    } else if (st != WEFT_OK) {
        weft__set_error(st, "send: %s", weft_future_error(f));
    }
    weft_future_release(f);
    return st;
}

weft_status_t weft_coll_recv(weft_pg_t *pg, weft_tensor_t *t, int src, int tag,
                             weft_future_t **work_p, int *src_p)
{
    coll_group_t *g = pg->g;
    weft_future_t *f;

    if (g->rank < 0) {
        return weft__set_error(WEFT_ERR_INVALID_STATE, "recv: not a member of group %u", g->id);
    }
    if (t == NULL || (src != WEFT_ANY_SOURCE && (src < 0 || src >= g->size)) || tag < 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "recv: NULL tensor, source %d out of the group of %d, or negative "
                               "tag %d",
                               src, g->size, tag);
    }
    WEFT_CHECK(check_tensor(t, (coll_kind_t)WEFT__V1__COLL_OP__COLL_OP_P2P));
    WEFT_CHECK(coll__p2p_recv(g, t, src, tag, &f));
    if (work_p != NULL) {
        *work_p = f;
        return WEFT_OK;
    }
    /* The posted receive fails at its deadline (the group's timeout from now). */
    weft_status_t st = weft_future_wait(f, -1);
    if (st != WEFT_OK) {
        weft__set_error(st, "%s", weft_future_error(f));
    } else if (src_p != NULL) {
        size_t len;
        const int *s = weft_value_payload(weft_future_value(f), &len);
        *src_p = s != NULL && len == sizeof(int) ? *s : -1;
    }
    weft_future_release(f);
    return st;
}

weft_status_t weft_coll_batch_p2p(weft_pg_t *pg, const weft_p2p_op_t *ops, size_t n,
                                  weft_future_t **works)
{
    coll_group_t *g = pg->g;

    if (g->rank < 0) {
        return weft__set_error(WEFT_ERR_INVALID_STATE, "batch_p2p: not a member of group %u",
                               g->id);
    }
    if (ops == NULL || works == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "batch_p2p: NULL argument");
    }
    for (size_t i = 0; i < n; i++) {
        bool any = !ops[i].send && ops[i].peer == WEFT_ANY_SOURCE;
        if (ops[i].t == NULL || ops[i].tag < 0 ||
            (!any && (ops[i].peer < 0 || ops[i].peer >= g->size))) {
            return weft__set_error(WEFT_ERR_INVALID_ARG, "batch_p2p: operation %zu is malformed",
                                   i);
        }
        /* the tensor checks of send and recv, before any starts */
        weft_status_t cst = check_tensor(ops[i].t, (coll_kind_t)WEFT__V1__COLL_OP__COLL_OP_P2P);
        if (cst != WEFT_OK) {
            return weft__set_error(cst, "batch_p2p: operation %zu: %s", i, weft_last_error());
        }
    }
    for (size_t i = 0; i < n; i++) {
        weft_status_t st =
            ops[i].send ? weft_coll_send(pg, ops[i].t, ops[i].peer, ops[i].tag, &works[i])
                        : weft_coll_recv(pg, ops[i].t, ops[i].peer, ops[i].tag, &works[i], NULL);
        if (st != WEFT_OK) {
            /* Only a transport failure gets here: fail the rest through their futures. */
            for (size_t j = i; j < n; j++) {
                if (weft_future_create(&works[j]) == WEFT_OK) {
                    weft_future_fail(works[j], st, "batch_p2p: %s", weft_last_error());
                }
            }
            return WEFT_OK;
        }
    }
    return WEFT_OK;
}
