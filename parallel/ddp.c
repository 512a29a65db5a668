/* The bucketed DDP reducer (include/weft/ddp.h, docs/ddp.md): gradient-ready hooks of the
 * autograd engine fill buckets whose gradients are views of one flat tensor per bucket; a full
 * bucket starts an asynchronous all_reduce (or the comm hook) in bucket order while backward goes
 * on; the end of backward reduces what is left, waits, and checks the bookkeeping that travelled
 * in each bucket (who missed which parameter). */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include <weft/ddp.h>
#include <weft/reduce.h>

#include "../core/internal.h"

#define DDP_CAP_DEFAULT   ((size_t)25 << 20)
#define DDP_FIRST_DEFAULT ((size_t)1 << 20)
#define DDP_REC           11 /* i64 per parameter in the likeness check: name hash, dtype, ndim, shape */
/* A bucket's bookkeeping after its gradients, averaged with them: [grads] a parameter of it got no
 * gradient on some member; [grads + 1] backward failed on some member (the last bucket, launched
 * after backward, carries it); then one per parameter: it had its gradient here. */
#define BOOK_MISSING 0
#define BOOK_FAILED  1
#define BOOKS        2

typedef struct weft_ddp weft_ddp_t;

typedef struct {
    weft_ddp_t *ddp;
    weft_tensor_t *param; /* borrowed from the list */
    const char *name;     /* borrowed from the list */
    int64_t numel;
    weft_dtype_t dt;
    int bucket;
    int slot;            /* index within its bucket */
    int64_t off;         /* elements from the bucket's start */
    weft_tensor_t *view; /* the gradient: a view of the bucket */
    int hook_id;
    bool ready; /* this step */
} ddp_param_t;

typedef struct {
    weft_dtype_t dt;
    int *params; /* in bucket order */
    int n_params;
    int64_t grads;  /* elements of gradients; then the bookkeeping: BOOKS + n_params */
    int64_t total;  /* grads + BOOKS + n_params */
    int first_pos;  /* where its first parameter stands in the order it was built from */
    weft_tensor_t *buf;
    weft_tensor_t *comm; /* compressed copy, or NULL */
    int pending;
    bool launched;
    weft_future_t *work;
    uint64_t launch_ns;
    struct ddp_clock *clock; /* when its reduction ended */
} ddp_bucket_t;

struct weft_ddp {
    weft_pg_t *pg;
    const weft_param_list_t *list;
    weft_ddp_opts_t o;
    int n;
    ddp_param_t *p;
    int nb;
    ddp_bucket_t *b;
    int next_launch;
    bool sync;
    bool in_step;
    weft_status_t hook_st;
    char hook_why[256];
    /* the first synchronised step's ready order, for the rebuild */
    int *order;
    int n_order;
    bool recording;
    bool rebuild_due;
    bool rebuilt;
    /* stats of the last synchronised step */
    uint64_t steps;
    uint64_t bytes;
    uint64_t backward_end_ns, wait_end_ns;
    double comm_us, exposed_us;
};

/* ------------------------------------------------------------------ small helpers */

static uint64_t fnv(const char *s)
{
    uint64_t h = UINT64_C(0xcbf29ce484222325);
    for (; *s != '\0'; s++) {
        h = (h ^ (uint8_t)*s) * UINT64_C(0x100000001b3);
    }
    return h;
}

static bool dtype_ok(weft_dtype_t dt)
{
    return dt == WEFT_F32 || dt == WEFT_F64 || dt == WEFT_F16 || dt == WEFT_BF16;
}

/* Element @p i of @p t (a float dtype) as a double, and the reverse. */
static double get_elem(const weft_tensor_t *t, int64_t i)
{
    const void *d = weft_tensor_data(t);
    switch (weft_tensor_dtype(t)) {
    case WEFT_F32:
        return ((const float *)d)[i];
    case WEFT_F64:
        return ((const double *)d)[i];
    default: {
        float f;
        weft_reduce_widen(&f, (const uint8_t *)d + i * 2, 1, weft_tensor_dtype(t));
        return f;
    }
    }
}

static void set_elem(weft_tensor_t *t, int64_t i, double v)
{
    void *d = weft_tensor_data(t);
    switch (weft_tensor_dtype(t)) {
    case WEFT_F32:
        ((float *)d)[i] = (float)v;
        break;
    case WEFT_F64:
        ((double *)d)[i] = v;
        break;
    default: {
        float f = (float)v;
        weft_reduce_narrow((uint8_t *)d + i * 2, &f, 1, weft_tensor_dtype(t), WEFT_SUM, 1);
        break;
    }
    }
}

static void view_release(void *data, void *arg)
{
    (void)data;
    weft_tensor_release(arg);
}

/* ------------------------------------------------------------------ buckets */

static void clock_release(struct ddp_clock *c);

static void buckets_free(ddp_bucket_t *b, int nb)
{
    for (int i = 0; b != NULL && i < nb; i++) {
        clock_release(b[i].clock);
        weft_free(b[i].params);
        weft_tensor_release(b[i].buf);
        weft_tensor_release(b[i].comm);
        weft_future_release(b[i].work);
    }
    weft_free(b);
}

/* Buckets for the parameters in @p order (the first to become ready first), by dtype, the first
 * of each dtype capped at first_bucket_bytes; views made, each gradient's values carried over
 * from what the parameter holds now. On failure nothing changes. */
/* Whether every member could do something (@p ok here): an all_reduce MIN of a flag. */
static weft_status_t agree(weft_ddp_t *d, bool ok)
{
    int64_t one = 1;
    weft_tensor_t *t = NULL;
    weft_status_t st = weft_tensor_create(WEFT_I64, 1, &one, &t);
    if (st != WEFT_OK) {
        return st;
    }
    ((int64_t *)weft_tensor_data(t))[0] = ok ? 1 : 0;
    st = weft_coll_all_reduce(d->pg, t, WEFT_MIN, NULL);
    if (st == WEFT_OK && ((int64_t *)weft_tensor_data(t))[0] == 0) {
        st = weft__set_error(WEFT_ERR_NO_MEMORY,
                             "ddp: a member could not rebuild its buckets; every member keeps "
                             "the buckets it had");
    }
    weft_tensor_release(t);
    return st;
}

static weft_status_t buckets_build(weft_ddp_t *d, const int *order, bool collective)
{
    int n = d->n, nb = 0;
    int *bucket_of = weft_alloc((size_t)n * sizeof(int));
    ddp_bucket_t *b = weft_calloc((size_t)n, sizeof(*b)); /* at most one per parameter */
    weft_tensor_t **views = weft_calloc((size_t)n, sizeof(*views));
    int64_t *offs = weft_alloc((size_t)n * sizeof(int64_t));
    int *slots = weft_alloc((size_t)n * sizeof(int));
    weft_status_t st = WEFT_OK;
    if (bucket_of == NULL || b == NULL || views == NULL || offs == NULL || slots == NULL) {
        st = weft__set_error(WEFT_ERR_NO_MEMORY, "ddp: no memory for buckets");
        goto decide;
    }
    /* The current bucket of each dtype, and how many that dtype has. */
    int cur[WEFT_DTYPE_COUNT], made[WEFT_DTYPE_COUNT];
    size_t bytes[WEFT_DTYPE_COUNT];
    for (int t = 0; t < WEFT_DTYPE_COUNT; t++) {
        cur[t] = -1;
        made[t] = 0;
        bytes[t] = 0;
    }
    for (int k = 0; k < n; k++) {
        int i = order[k];
        ddp_param_t *p = &d->p[i];
        size_t pb = (size_t)p->numel * weft_dtype_size(p->dt);
        /* the open bucket of this dtype is its first: the small cap */
        size_t cap = made[p->dt] == 1 ? d->o.first_bucket_bytes : d->o.bucket_cap_bytes;
        if (cur[p->dt] >= 0 && bytes[p->dt] + pb > cap) {
            cur[p->dt] = -1;
        }
        if (cur[p->dt] < 0) {
            cur[p->dt] = nb;
            b[nb].dt = p->dt;
            b[nb].first_pos = k;
            b[nb].params = weft_alloc((size_t)n * sizeof(int));
            if (b[nb].params == NULL) {
                st = weft__set_error(WEFT_ERR_NO_MEMORY, "ddp: no memory for buckets");
                nb++;
                goto decide;
            }
            nb++;
            made[p->dt]++;
            bytes[p->dt] = 0;
        }
        ddp_bucket_t *bk = &b[cur[p->dt]];
        slots[i] = bk->n_params;
        offs[i] = bk->grads;
        bk->params[bk->n_params++] = i;
        bk->grads += p->numel;
        bytes[p->dt] += pb;
        bucket_of[i] = cur[p->dt];
    }
    /* Buckets are made in the order their first parameter comes: already sorted by first_pos. */
    for (int j = 0; j < nb && st == WEFT_OK; j++) {
        ddp_bucket_t *bk = &b[j];
        bk->total = bk->grads + BOOKS + bk->n_params;
        st = weft_tensor_create(bk->dt, 1, &bk->total, &bk->buf);
        if (st == WEFT_OK && d->o.comm_hook == NULL && d->o.compress != WEFT_DDP_COMPRESS_NONE &&
            bk->dt == WEFT_F32) {
            st = weft_tensor_empty(d->o.compress == WEFT_DDP_COMPRESS_FP16 ? WEFT_F16 : WEFT_BF16,
                                   1, &bk->total, &bk->comm);
        }
    }
    for (int i = 0; i < n && st == WEFT_OK; i++) {
        ddp_param_t *p = &d->p[i];
        ddp_bucket_t *bk = &b[bucket_of[i]];
        size_t esz = weft_dtype_size(p->dt);
        char *at = (char *)weft_tensor_data(bk->buf) + (size_t)offs[i] * esz;
        st = weft_tensor_wrap(p->dt, weft_tensor_ndim(p->param), weft_tensor_shape(p->param), at,
                              (size_t)p->numel * esz, WEFT_CPU, view_release,
                              weft_tensor_retain(bk->buf), &views[i]);
        if (st != WEFT_OK) {
            weft_tensor_release(bk->buf); /* the view's reference, not taken */
            break;
        }
        /* What the parameter's gradient holds now goes on in the new bucket. */
        weft_tensor_t *g = weft_tensor_grad(p->param);
        if (g != NULL) {
            memcpy(at, weft_tensor_data(g), (size_t)p->numel * esz);
        }
    }
decide:
    if (collective) {
        /* The new layout only if every member has it: otherwise all keep the old one. */
        weft_status_t agreed = agree(d, st == WEFT_OK);
        if (st == WEFT_OK) {
            st = agreed;
        }
    }
    if (st != WEFT_OK) {
        goto out;
    }
    for (int i = 0; i < n; i++) {
        ddp_param_t *p = &d->p[i];
        bool had = weft_tensor_grad(p->param) != NULL;
        weft_tensor_release(p->view);
        p->view = views[i];
        views[i] = NULL;
        p->bucket = bucket_of[i];
        p->slot = slots[i];
        p->off = offs[i];
        if (had) {
            (void)weft_tensor_set_grad(p->param, p->view);
        }
    }
    buckets_free(d->b, d->nb);
    d->b = b;
    d->nb = nb;
    b = NULL;
    nb = 0;

out:
    for (int i = 0; views != NULL && i < n; i++) {
        weft_tensor_release(views[i]);
    }
    buckets_free(b, nb);
    weft_free(views);
    weft_free(bucket_of);
    weft_free(offs);
    weft_free(slots);
    return st;
}

/* ------------------------------------------------------------------ reductions */

/* When a bucket's reduction ended: written by its future's callback, which may still be running
 * when a wait on the future returns; so the callback and the bucket each hold a reference. */
typedef struct ddp_clock {
    _Atomic uint64_t done_ns;
    _Atomic int refs;
} ddp_clock_t;

static void clock_release(ddp_clock_t *c)
{
    if (c != NULL && atomic_fetch_sub(&c->refs, 1) == 1) {
        weft_free(c);
    }
}

static void bucket_done(weft_future_t *f, void *arg)
{
    (void)f;
    ddp_clock_t *c = arg;
    atomic_store(&c->done_ns, (uint64_t)weft__now_ns());
    clock_release(c);
}

/* Starts bucket @p j's reduction: its bookkeeping written (1 for a parameter that had its
 * gradient here, whether one did not, whether backward failed here), then the hook, the
 * compressed all_reduce or the all_reduce AVG. */
static weft_status_t bucket_launch(weft_ddp_t *d, int j, bool failed)
{
    ddp_bucket_t *bk = &d->b[j];
    int missing = 0;
    for (int k = 0; k < bk->n_params; k++) {
        bool ready = d->p[bk->params[k]].ready;
        missing += ready ? 0 : 1;
        set_elem(bk->buf, bk->grads + BOOKS + k, ready ? 1.0 : 0.0);
    }
    set_elem(bk->buf, bk->grads + BOOK_MISSING, missing > 0 ? 1.0 : 0.0);
    set_elem(bk->buf, bk->grads + BOOK_FAILED, failed ? 1.0 : 0.0);
    bk->launched = true;
    bk->launch_ns = (uint64_t)weft__now_ns();
    clock_release(bk->clock);
    bk->clock = weft_calloc(1, sizeof(*bk->clock));
    if (bk->clock != NULL) {
        atomic_init(&bk->clock->refs, 1);
    }
    weft_future_release(bk->work);
    bk->work = NULL;
    weft_status_t st;
    if (d->o.comm_hook != NULL) {
        st = d->o.comm_hook(d->o.comm_hook_arg, d->pg, j, bk->buf, &bk->work);
        if (st == WEFT_OK && bk->work == NULL) {
            st = weft__set_error(WEFT_ERR_INVALID_STATE, "ddp: the comm hook of bucket %d gave no "
                                                         "future", j);
        }
        if (st != WEFT_OK && bk->work == NULL) {
            /* It issued nothing: the others' reduction of this bucket fails with its reason,
             * and the group's operations stay paired. */
            char why[600];
            snprintf(why, sizeof(why), "ddp: the comm hook of bucket %d failed: %s", j,
                     weft_last_error());
            st = weft_coll_fail(d->pg, st, why);
        }
        d->bytes += weft_tensor_nbytes(bk->buf);
    } else if (bk->comm != NULL) {
        weft_reduce_narrow(weft_tensor_data(bk->comm), weft_tensor_data(bk->buf), (size_t)bk->total,
                           weft_tensor_dtype(bk->comm), WEFT_SUM, 1);
        st = weft_coll_all_reduce(d->pg, bk->comm, WEFT_AVG, &bk->work);
        d->bytes += weft_tensor_nbytes(bk->comm);
    } else {
        st = weft_coll_all_reduce(d->pg, bk->buf, WEFT_AVG, &bk->work);
        d->bytes += weft_tensor_nbytes(bk->buf);
    }
    if (st == WEFT_OK && bk->clock != NULL) {
        atomic_fetch_add(&bk->clock->refs, 1);
        weft_future_then(bk->work, bucket_done, bk->clock);
    }
    return st;
}

/* Starts every bucket that is full, in bucket order (the same on every member). */
static weft_status_t launch_ready(weft_ddp_t *d)
{
    weft_status_t st = WEFT_OK;
    /* The last bucket leaves when backward has returned: it says whether backward failed. */
    while (st == WEFT_OK && d->next_launch < d->nb - 1 && d->b[d->next_launch].pending == 0) {
        st = bucket_launch(d, d->next_launch++, false);
    }
    return st;
}

/* The engine's post-accumulate hook of every parameter. */
static weft_status_t on_grad(weft_tensor_t *param, weft_tensor_t *grad, void *arg)
{
    ddp_param_t *p = arg;
    weft_ddp_t *d = p->ddp;
    (void)param;
    if (!d->in_step || p->ready) {
        return WEFT_OK; /* outside weft_ddp_backward, in no_sync, or a second visit */
    }
    if (grad == NULL) {
        return weft__set_error(WEFT_ERR_UNSUPPORTED,
                               "ddp: parameter '%s' has a sparse gradient (the reducer averages "
                               "dense ones)",
                               p->name);
    }
    if (grad != p->view) {
        /* Someone replaced the gradient during backward: its values go into the bucket, and the
         * bucket's view is the gradient again (it gets the average). */
        memcpy(weft_tensor_data(p->view), weft_tensor_data(grad), weft_tensor_nbytes(p->view));
        weft_status_t st = weft_tensor_set_grad(p->param, p->view);
        if (st != WEFT_OK) {
            return st;
        }
    }
    p->ready = true;
    if (d->recording) {
        d->order[d->n_order++] = (int)(p - d->p);
    }
    d->b[p->bucket].pending--;
    return launch_ready(d);
}

/* ------------------------------------------------------------------ create */

void weft_ddp_opts_init(weft_ddp_opts_t *o)
{
    memset(o, 0, sizeof(*o));
    o->bucket_cap_bytes = DDP_CAP_DEFAULT;
    o->first_bucket_bytes = DDP_FIRST_DEFAULT;
    o->rebuild_buckets = true;
}

/* Every member has the same parameters: counts, then (name hash, dtype, shape) each. */
static weft_status_t check_alike(weft_ddp_t *d)
{
    weft_pg_t *pg = d->pg;
    int world = weft_pg_size(pg), me = weft_pg_rank(pg);
    int64_t one = 1, nw = world;
    weft_tensor_t *cnt = NULL, *cnts = NULL, *rec = NULL, *recs = NULL;
    weft_status_t st = weft_tensor_create(WEFT_I64, 1, &one, &cnt);
    if (st == WEFT_OK) {
        st = weft_tensor_create(WEFT_I64, 1, &nw, &cnts);
    }
    if (st == WEFT_OK) {
        ((int64_t *)weft_tensor_data(cnt))[0] = d->n;
        st = weft_coll_all_gather(pg, cnt, cnts, NULL);
    }
    if (st != WEFT_OK) {
        goto out;
    }
    const int64_t *c = weft_tensor_data(cnts);
    for (int r = 1; r < world; r++) {
        if (c[r] != c[0]) {
            st = weft__set_error(WEFT_ERR_MISMATCH,
                                 "ddp: group rank 0 has %lld parameters, group rank %d has %lld",
                                 (long long)c[0], r, (long long)c[r]);
            goto out;
        }
    }
    int64_t nrec = (int64_t)d->n * DDP_REC, nall = nrec * world;
    if (nrec == 0) {
        goto out;
    }
    st = weft_tensor_create(WEFT_I64, 1, &nrec, &rec);
    if (st == WEFT_OK) {
        st = weft_tensor_create(WEFT_I64, 1, &nall, &recs);
    }
    if (st != WEFT_OK) {
        goto out;
    }
    int64_t *mine = weft_tensor_data(rec);
    for (int i = 0; i < d->n; i++) {
        int64_t *r = mine + (int64_t)i * DDP_REC;
        const weft_tensor_t *t = d->p[i].param;
        r[0] = (int64_t)fnv(d->p[i].name);
        r[1] = weft_tensor_dtype(t);
        r[2] = weft_tensor_ndim(t);
        for (int k = 0; k < weft_tensor_ndim(t) && k < DDP_REC - 3; k++) {
            r[3 + k] = weft_tensor_shape(t)[k];
        }
    }
    st = weft_coll_all_gather(d->pg, rec, recs, NULL);
    if (st != WEFT_OK) {
        goto out;
    }
    const int64_t *all = weft_tensor_data(recs);
    for (int i = 0; i < d->n; i++) {
        for (int r = 1; r < world; r++) {
            const int64_t *a = all + (int64_t)i * DDP_REC, *b = all + (nrec * r) + i * DDP_REC;
            const char *field = a[0] != b[0]   ? "name"
                                : a[1] != b[1] ? "dtype"
                                : memcmp(a + 2, b + 2, (DDP_REC - 2) * sizeof(int64_t)) != 0
                                    ? "shape"
                                    : NULL;
            if (field == NULL) {
                continue;
            }
            char sa[160] = "", sb[160] = "";
            for (int k = 0; k < a[2] && k < DDP_REC - 3; k++) {
                snprintf(sa + strlen(sa), sizeof(sa) - strlen(sa), "%s%lld", k ? "," : "",
                         (long long)a[3 + k]);
            }
            for (int k = 0; k < b[2] && k < DDP_REC - 3; k++) {
                snprintf(sb + strlen(sb), sizeof(sb) - strlen(sb), "%s%lld", k ? "," : "",
                         (long long)b[3 + k]);
            }
            st = weft__set_error(
                WEFT_ERR_MISMATCH,
                "ddp: parameter %d ('%s' here, on group rank %d) differs in %s between group rank "
                "0 (%s [%s]) and group rank %d (%s [%s])",
                i, d->p[i].name, me, field, weft_dtype_name((weft_dtype_t)a[1]), sa, r,
                weft_dtype_name((weft_dtype_t)b[1]), sb);
            goto out;
        }
    }
out:
    weft_tensor_release(cnt);
    weft_tensor_release(cnts);
    weft_tensor_release(rec);
    weft_tensor_release(recs);
    return st;
}

/* Group rank 0's values on every member: every parameter's broadcast started, then waited. */
static weft_status_t broadcast_params(weft_ddp_t *d)
{
    weft_future_t **w = weft_calloc((size_t)d->n + 1, sizeof(*w));
    weft_status_t st = w == NULL ? weft__set_error(WEFT_ERR_NO_MEMORY, "ddp: no memory") : WEFT_OK;
    int k = 0;
    for (; k < d->n && st == WEFT_OK; k++) {
        st = weft_coll_broadcast(d->pg, d->p[k].param, 0, &w[k]);
    }
    for (int i = 0; i < k; i++) {
        if (w[i] == NULL) {
            continue;
        }
        weft_status_t s = weft_future_wait(w[i], 0);
        if (s != WEFT_OK && st == WEFT_OK) {
            st = weft__set_error(s, "ddp: broadcasting '%s': %s", d->p[i].name,
                                 weft_future_error(w[i]));
        }
        weft_future_release(w[i]);
    }
    weft_free(w);
    return st;
}

weft_status_t weft_ddp_create(weft_pg_t *pg, const weft_param_list_t *params,
                              const weft_ddp_opts_t *opts, weft_ddp_t **ddp_p)
{
    if (pg == NULL || params == NULL || ddp_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "ddp: NULL group, parameters or reducer");
    }
    weft_ddp_t *d = weft_calloc(1, sizeof(*d));
    if (d == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ddp: no memory");
    }
    d->pg = pg;
    d->list = params;
    d->sync = true;
    if (opts != NULL) {
        d->o = *opts;
    } else {
        weft_ddp_opts_init(&d->o);
    }
    if (d->o.bucket_cap_bytes == 0) {
        d->o.bucket_cap_bytes = DDP_CAP_DEFAULT;
    }
    if (d->o.first_bucket_bytes == 0) {
        d->o.first_bucket_bytes = DDP_FIRST_DEFAULT;
    }
    weft_status_t st = WEFT_OK;
    int total = weft_param_list_size(params);
    d->p = weft_calloc((size_t)total + 1, sizeof(*d->p));
    d->order = weft_alloc(((size_t)total + 1) * sizeof(int));
    if (d->p == NULL || d->order == NULL) {
        st = weft__set_error(WEFT_ERR_NO_MEMORY, "ddp: no memory");
        goto fail;
    }
    for (int i = 0; i < total; i++) {
        weft_tensor_t *t = weft_param_list_get(params, i);
        if (!weft_tensor_requires_grad(t)) {
            continue;
        }
        if (!dtype_ok(weft_tensor_dtype(t)) || weft_tensor_device(t).type != WEFT_DEVICE_CPU) {
            st = weft__set_error(WEFT_ERR_DTYPE,
                                 "ddp: parameter '%s' is %s%s (the reducer takes f32, f64, f16 "
                                 "and bf16 parameters on the CPU)",
                                 weft_param_list_name(params, i),
                                 weft_dtype_name(weft_tensor_dtype(t)),
                                 weft_tensor_device(t).type != WEFT_DEVICE_CPU ? " off the CPU"
                                                                               : "");
            goto fail;
        }
        for (int j = 0; j < d->n; j++) {
            if (d->p[j].param == t) {
                st = weft__set_error(WEFT_ERR_INVALID_ARG,
                                     "ddp: '%s' and '%s' are the same tensor (a shared parameter "
                                     "goes in the list once)",
                                     d->p[j].name, weft_param_list_name(params, i));
                goto fail;
            }
        }
        ddp_param_t *p = &d->p[d->n++];
        p->ddp = d;
        p->param = t;
        p->name = weft_param_list_name(params, i);
        p->numel = weft_tensor_numel(t);
        p->dt = weft_tensor_dtype(t);
        p->hook_id = -1;
    }
    if ((st = check_alike(d)) != WEFT_OK || (st = broadcast_params(d)) != WEFT_OK) {
        goto fail;
    }
    /* Reverse parameter order: roughly the order backward reaches them. */
    for (int i = 0; i < d->n; i++) {
        d->order[i] = d->n - 1 - i;
    }
    if ((st = buckets_build(d, d->order, false)) != WEFT_OK) {
        goto fail;
    }
    for (int i = 0; i < d->n && st == WEFT_OK; i++) {
        st = weft_tensor_add_grad_hook(d->p[i].param, on_grad, &d->p[i], &d->p[i].hook_id);
    }
    if (st != WEFT_OK) {
        goto fail;
    }
    d->recording = d->o.rebuild_buckets && !d->o.find_unused_parameters;
    *ddp_p = d;
    return WEFT_OK;

fail:
    weft_ddp_free(d);
    return st;
}

void weft_ddp_free(weft_ddp_t *d)
{
    if (d == NULL) {
        return;
    }
    for (int i = 0; d->p != NULL && i < d->n; i++) {
        ddp_param_t *p = &d->p[i];
        if (p->hook_id >= 0) {
            (void)weft_tensor_remove_grad_hook(p->param, p->hook_id);
        }
        /* The gradient stays the parameter's: a tensor of its own, no longer the bucket's. */
        weft_tensor_t *g = weft_tensor_grad(p->param);
        if (g != NULL && g == p->view) {
            weft_tensor_t *c = NULL;
            if (weft_tensor_clone(g, &c) == WEFT_OK) {
                (void)weft_tensor_set_grad(p->param, c);
                weft_tensor_release(c);
            } else {
                weft_tensor_grad_clear(p->param);
            }
        }
        weft_tensor_release(p->view);
    }
    buckets_free(d->b, d->nb);
    weft_free(d->p);
    weft_free(d->order);
    weft_free(d);
}

/* ------------------------------------------------------------------ a step */

/* Rank 0's ready order of the first step, broadcast; every member rebuilds its buckets from it
 * (a member whose own order was incomplete follows rank 0's; an incomplete order at rank 0 keeps
 * the buckets). */
static weft_status_t rebuild(weft_ddp_t *d)
{
    int64_t n1 = d->n + 1;
    weft_tensor_t *t = NULL;
    weft_status_t st = weft_tensor_create(WEFT_I64, 1, &n1, &t);
    if (st != WEFT_OK) {
        return st;
    }
    int64_t *o = weft_tensor_data(t);
    if (weft_pg_rank(d->pg) == 0) {
        o[0] = d->n_order == d->n ? 1 : 0;
        for (int i = 0; i < d->n_order; i++) {
            o[1 + i] = d->order[i];
        }
    }
    st = weft_coll_broadcast(d->pg, t, 0, NULL);
    if (st == WEFT_OK && o[0] == 1) {
        for (int i = 0; i < d->n; i++) {
            if (o[1 + i] < 0 || o[1 + i] >= d->n) {
                st = weft__set_error(WEFT_ERR_PROTOCOL, "ddp: rank 0's bucket order names "
                                                        "parameter %lld",
                                     (long long)o[1 + i]);
                break;
            }
            d->order[i] = (int)o[1 + i];
        }
        /* (the order is the same on every member, so all get here or none; inside, every
         * member reaches the agreement whatever its own build did) */
        if (st == WEFT_OK && (st = buckets_build(d, d->order, true)) == WEFT_OK) {
            d->rebuilt = true;
        }
    }
    weft_tensor_release(t);
    return st;
}

/* Every parameter's gradient is its view of the bucket (the values it had carried over). */
static weft_status_t attach_views(weft_ddp_t *d)
{
    for (int i = 0; i < d->n; i++) {
        ddp_param_t *p = &d->p[i];
        weft_tensor_t *g = weft_tensor_grad(p->param);
        if (g == p->view) {
            continue;
        }
        if (g != NULL) {
            memcpy(weft_tensor_data(p->view), weft_tensor_data(g), weft_tensor_nbytes(p->view));
        } else {
            memset(weft_tensor_data(p->view), 0, weft_tensor_nbytes(p->view));
        }
        WEFT_CHECK(weft_tensor_set_grad(p->param, p->view));
    }
    return WEFT_OK;
}

/* After the reductions: the bookkeeping says who missed what. */
static weft_status_t check_missing(weft_ddp_t *d)
{
    char names[512] = "";
    int bucket = -1, mine = 0;
    for (int j = 0; j < d->nb; j++) {
        ddp_bucket_t *bk = &d->b[j];
        if (get_elem(bk->buf, bk->grads + BOOK_MISSING) <= 0) {
            continue;
        }
        bucket = bucket < 0 ? j : bucket;
        for (int k = 0; k < bk->n_params; k++) {
            ddp_param_t *p = &d->p[bk->params[k]];
            if (!p->ready) {
                size_t len = strlen(names);
                snprintf(names + len, sizeof(names) - len, "%s'%s'", mine ? ", " : "", p->name);
                mine++;
            }
        }
    }
    if (bucket < 0) {
        return WEFT_OK;
    }
    if (mine > 0) {
        return weft__set_error(WEFT_ERR_INVALID_STATE,
                               "ddp: %d parameter%s got no gradient in this backward on group rank "
                               "%d: %s (every bucket was still reduced, the missing gradients as "
                               "zeros; create the reducer with find_unused_parameters if the model "
                               "leaves parameters out)",
                               mine, mine > 1 ? "s" : "", weft_pg_rank(d->pg), names);
    }
    return weft__set_error(WEFT_ERR_INVALID_STATE,
                           "ddp: bucket %d: a parameter got no gradient in this backward on another "
                           "member (every bucket was still reduced; create the reducer with "
                           "find_unused_parameters if the model leaves parameters out)",
                           bucket);
}

/* find_unused_parameters: a parameter no member gave a gradient keeps none (as in torch), so that
 * optimizers leave it alone; the next step attaches its view again. */
static void drop_unused(weft_ddp_t *d)
{
    for (int j = 0; j < d->nb; j++) {
        ddp_bucket_t *bk = &d->b[j];
        for (int k = 0; k < bk->n_params; k++) {
            if (get_elem(bk->buf, bk->grads + BOOKS + k) <= 0) {
                weft_tensor_grad_clear(d->p[bk->params[k]].param);
            }
        }
    }
}

typedef struct {
    weft_tensor_t *loss;
    weft_tensor_t *grad;
} local_bw_t;

static weft_status_t local_backward(void *arg)
{
    local_bw_t *l = arg;
    weft_tensor_t *roots[1] = {l->loss}, *grads[1] = {l->grad};

    return weft_backward_run(1, roots, grads, NULL);
}

static weft_status_t ddp_step(weft_ddp_t *d, weft_ddp_backward_fn_t run, void *arg);

weft_status_t weft_ddp_backward(weft_ddp_t *d, weft_tensor_t *loss, weft_tensor_t *grad)
{
    local_bw_t l = {loss, grad};

    if (d == NULL || loss == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "ddp: NULL reducer or loss");
    }
    return ddp_step(d, local_backward, &l);
}

weft_status_t weft_ddp_backward_with(weft_ddp_t *d, weft_ddp_backward_fn_t run, void *arg)
{
    if (d == NULL || run == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "ddp: NULL reducer or backward");
    }
    return ddp_step(d, run, arg);
}

static weft_status_t ddp_step(weft_ddp_t *d, weft_ddp_backward_fn_t run, void *arg)
{
    weft_status_t st = WEFT_OK;
    if (d->sync && d->rebuild_due) {
        d->rebuild_due = false;
        /* collective; a failure leaves every member with the buckets it had */
        st = rebuild(d);
        if (st != WEFT_OK) {
            WEFT_WARN("%s", weft_last_error());
            st = WEFT_OK;
        }
    }
    st = attach_views(d);
    if (st != WEFT_OK && d->sync) {
        /* No step here: the others' reductions of every bucket fail with the reason. */
        char why[600];
        snprintf(why, sizeof(why), "ddp: a member could not set up its step: %s",
                 weft_last_error());
        for (int j = 0; j < d->nb; j++) {
            (void)weft_coll_fail(d->pg, st, why);
        }
        return weft__set_error(st, "%s", why);
    }
    WEFT_CHECK(st);
    if (!d->sync) {
        /* no_sync: backward accumulates into the buckets; the next synchronised step averages. */
        return run(arg);
    }
    for (int i = 0; i < d->n; i++) {
        d->p[i].ready = false;
    }
    for (int j = 0; j < d->nb; j++) {
        d->b[j].pending = d->b[j].n_params;
        d->b[j].launched = false;
    }
    d->next_launch = 0;
    d->n_order = 0;
    d->bytes = 0;
    d->in_step = true;
    weft_status_t bst = run(arg);
    char bwhy[512] = "";
    if (bst != WEFT_OK) {
        snprintf(bwhy, sizeof(bwhy), "%s", weft_last_error());
    }
    d->in_step = false;
    d->backward_end_ns = (uint64_t)weft__now_ns();
    /* Whatever did not fill is reduced now, in order, every bucket even after a failure here (no
     * member is left waiting); the last one says whether backward failed. */
    char lwhy[512] = "";
    for (int j = d->next_launch; j < d->nb; j++) {
        weft_status_t s = bucket_launch(d, j, bst != WEFT_OK);
        if (s != WEFT_OK && st == WEFT_OK) {
            st = s;
            snprintf(lwhy, sizeof(lwhy), "%s", weft_last_error());
        }
    }
    d->next_launch = d->nb;
    for (int j = 0; j < d->nb; j++) {
        ddp_bucket_t *bk = &d->b[j];
        if (bk->work == NULL || !bk->launched) {
            continue;
        }
        weft_status_t s = weft_future_wait(bk->work, 0);
        if (s != WEFT_OK && st == WEFT_OK) {
            st = s;
            snprintf(lwhy, sizeof(lwhy), "ddp: reducing bucket %d: %s", j,
                     weft_future_error(bk->work));
        }
        if (s == WEFT_OK && bk->comm != NULL) {
            weft_reduce_widen(weft_tensor_data(bk->buf), weft_tensor_data(bk->comm),
                              (size_t)bk->total, weft_tensor_dtype(bk->comm));
        }
    }
    d->wait_end_ns = (uint64_t)weft__now_ns();
    /* how much of the communication backward hid (a reduction's end is written by its future's
     * callback, which may run just after the wait returned: then it ended about now) */
    uint64_t first = UINT64_MAX, last = 0;
    for (int j = 0; j < d->nb; j++) {
        ddp_bucket_t *bk = &d->b[j];
        if (!bk->launched) {
            continue;
        }
        uint64_t a = bk->launch_ns,
                 z = bk->clock != NULL ? atomic_load(&bk->clock->done_ns) : 0;
        z = z != 0 ? z : d->wait_end_ns;
        first = a < first ? a : first;
        last = z > last ? z : last;
    }
    d->comm_us = last > first && first != UINT64_MAX ? (double)(last - first) / 1e3 : 0;
    d->exposed_us = d->wait_end_ns > d->backward_end_ns
                        ? (double)(d->wait_end_ns - d->backward_end_ns) / 1e3
                        : 0;
    if (d->exposed_us > d->comm_us) {
        d->exposed_us = d->comm_us;
    }
    d->steps++;
    if (d->recording) {
        d->recording = false;
        d->rebuild_due = true;
    }
    if (bst != WEFT_OK) {
        return weft__set_error(bst, "%s", bwhy);
    }
    if (st != WEFT_OK) {
        return weft__set_error(st, "%s", lwhy);
    }
    if (d->nb > 0 && get_elem(d->b[d->nb - 1].buf, d->b[d->nb - 1].grads + BOOK_FAILED) > 0) {
        return weft__set_error(WEFT_ERR_REMOTE,
                               "ddp: backward failed on another member: this step's gradients "
                               "are incomplete on every member (do not step the optimizer)");
    }
    if (d->o.find_unused_parameters) {
        drop_unused(d);
        return WEFT_OK;
    }
    return check_missing(d);
}

void weft_ddp_set_sync(weft_ddp_t *d, bool sync)
{
    if (d != NULL) {
        d->sync = sync;
    }
}

void weft_ddp_stats(const weft_ddp_t *d, weft_ddp_stats_t *s)
{
    memset(s, 0, sizeof(*s));
    if (d == NULL) {
        return;
    }
    s->steps = d->steps;
    s->buckets = d->nb;
    s->bytes = d->bytes;
    s->comm_us = d->comm_us;
    s->exposed_us = d->exposed_us;
    s->hidden_fraction = d->comm_us > 0 ? 1.0 - d->exposed_us / d->comm_us : 0;
    s->rebuilt = d->rebuilt;
}

size_t weft_ddp_describe(const weft_ddp_t *d, char *buf, size_t n)
{
    size_t len = 0;
    char line[256];
    if (n > 0) {
        buf[0] = '\0';
    }
    for (int j = 0; d != NULL && j < d->nb; j++) {
        const ddp_bucket_t *bk = &d->b[j];
        int k = snprintf(line, sizeof(line), "bucket %d: %s, %.2f MiB, %d parameter%s:", j,
                         weft_dtype_name(bk->dt),
                         (double)bk->grads * (double)weft_dtype_size(bk->dt) / 1048576.0,
                         bk->n_params, bk->n_params == 1 ? "" : "s");
        if (len + (size_t)k < n) {
            memcpy(buf + len, line, (size_t)k + 1);
        }
        len += (size_t)k;
        for (int i = 0; i < bk->n_params; i++) {
            k = snprintf(line, sizeof(line), " %s%s", d->p[bk->params[i]].name,
                         i + 1 == bk->n_params ? "\n" : "");
            if (len + (size_t)k < n) {
                memcpy(buf + len, line, (size_t)k + 1);
            }
            len += (size_t)k;
        }
    }
    return len;
}
