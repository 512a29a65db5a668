/* Tables as every rank sees them (layouts: chunks, owners, the spec on the wire) and the cells
 * that hold a dense chunk's or a sparse row's value with its optimizer state, updated with core's
 * optimizer kernels. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <weft/random.h>
#include <weft/reduce.h>

#include "internal.h"

/* ------------------------------------------------------------------ layouts */

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) {
        h = (h ^ b[i]) * UINT64_C(0x100000001b3);
    }
    return h;
}

static int n_state_of(const weft_ps_table_spec_t *s)
{
    switch (s->optimizer) {
    case WEFT_PS_SGD:
        return s->sgd.momentum > 0 ? 1 : 0;
    case WEFT_PS_ADAGRAD:
        return 1;
    case WEFT_PS_ADAM:
    case WEFT_PS_ADAMW:
        return s->adam.amsgrad ? 3 : 2;
    default:
        return 0;
    }
}

static weft_status_t check_spec(const weft_ps_table_spec_t *s)
{
    if (s->name == NULL || s->name[0] == '\0' || strlen(s->name) > PS_NAME_MAX) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: a table's name must have 1 to %d bytes",
                               PS_NAME_MAX);
    }
    if (s->kind != WEFT_PS_DENSE && s->kind != WEFT_PS_SPARSE) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "ps: table '%s': kind %d is neither dense "
                               "nor sparse",
                               s->name, (int)s->kind);
    }
    if (s->dtype != WEFT_F32 && s->dtype != WEFT_F16 && s->dtype != WEFT_BF16) {
        return weft__set_error(WEFT_ERR_DTYPE,
                               "ps: table '%s': storage dtype %s (f32, f16 or "
                               "bf16)",
                               s->name, weft_dtype_name(s->dtype));
    }
    if (s->kind == WEFT_PS_DENSE) {
        if (s->ndim < 1 || s->ndim > WEFT_MAX_DIMS) {
            return weft__set_error(WEFT_ERR_SHAPE, "ps: table '%s': %d dimensions (1..%d)", s->name,
                                   s->ndim, WEFT_MAX_DIMS);
        }
        for (int i = 0; i < s->ndim; i++) {
            if (s->shape[i] < 1) {
                return weft__set_error(WEFT_ERR_SHAPE, "ps: table '%s': dimension %d is %lld",
                                       s->name, i, (long long)s->shape[i]);
            }
        }
    } else if (s->dim < 1 || s->dim > (int64_t)1 << 24) {
        return weft__set_error(WEFT_ERR_SHAPE, "ps: table '%s': row length %lld (1..2^24)", s->name,
                               (long long)s->dim);
    }
    if (s->init < WEFT_PS_ZEROS || s->init > WEFT_PS_CONSTANT) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: table '%s': initializer %d", s->name,
                               (int)s->init);
    }
    if (s->init == WEFT_PS_UNIFORM && !(s->init_a <= s->init_b)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: table '%s': uniform in [%g, %g)", s->name,
                               s->init_a, s->init_b);
    }
    if (s->init == WEFT_PS_NORMAL && !(s->init_b >= 0)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: table '%s': normal with deviation %g",
                               s->name, s->init_b);
    }
    weft_status_t st;
    switch (s->optimizer) {
    case WEFT_PS_SGD:
        st = weft_optim_sgd_config_check(&s->sgd);
        break;
    case WEFT_PS_ADAGRAD:
        st = weft_optim_adagrad_config_check(&s->adagrad);
        break;
    case WEFT_PS_ADAM:
    case WEFT_PS_ADAMW:
        st = weft_optim_adam_config_check(&s->adam);
        break;
    case WEFT_PS_SUM:
        st = WEFT_OK;
        break;
    default:
        return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: table '%s': optimizer %d", s->name,
                               (int)s->optimizer);
    }
    if (st != WEFT_OK) {
        return weft__set_error(st, "ps: table '%s': %s", s->name, weft_last_error());
    }
    if (s->consistency < WEFT_PS_SYNC || s->consistency > WEFT_PS_BOUNDED) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: table '%s': consistency %d", s->name,
                               (int)s->consistency);
    }
    if (s->consistency == WEFT_PS_BOUNDED && s->staleness < 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: table '%s': staleness %lld (>= 0)",
                               s->name, (long long)s->staleness);
    }
    return WEFT_OK;
}

weft_status_t weft__ps_layout_init(ps_layout_t *l, const weft_ps_table_spec_t *spec, uint32_t id,
                                   uint32_t n_servers, uint32_t n_workers)
{
    memset(l, 0, sizeof(*l));
    WEFT_CHECK(check_spec(spec));
    l->spec = *spec;
    snprintf(l->name, sizeof(l->name), "%s", spec->name);
    l->spec.name = l->name;
    if (l->spec.chunk_bytes == 0) {
        l->spec.chunk_bytes = PS_DEFAULT_CHUNK;
    }
    if (spec->kind == WEFT_PS_SPARSE) {
        l->spec.ndim = 0;
        memset(l->spec.shape, 0, sizeof(l->spec.shape));
    } else {
        l->spec.dim = 0;
        l->spec.id_bound = l->spec.admit_after = l->spec.capacity = 0;
    }
    l->id = id;
    l->n_servers = n_servers;
    l->n_workers = n_workers;
    l->n_state = n_state_of(&l->spec);
    uint64_t h = fnv(UINT64_C(0xcbf29ce484222325), &n_servers, sizeof(n_servers));
    if (spec->kind == WEFT_PS_DENSE) {
        l->numel = weft_shape_numel(spec->ndim, spec->shape);
        size_t esz = weft_dtype_size(spec->dtype);
        l->chunk_elems = (int64_t)(l->spec.chunk_bytes / esz);
        if (l->chunk_elems < 1) {
            l->chunk_elems = 1;
        }
        int64_t nc = (l->numel + l->chunk_elems - 1) / l->chunk_elems;
        if (nc > UINT32_MAX / 2) {
            return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: table '%s': %lld chunks", l->name,
                                   (long long)nc);
        }
        l->n_chunks = (uint32_t)nc;
        l->owner = weft_alloc((size_t)nc * sizeof(*l->owner));
        uint64_t *load = weft_calloc(n_servers, sizeof(*load));
        if (l->owner == NULL || load == NULL) {
            weft_free(l->owner);
            weft_free(load);
            l->owner = NULL;
            return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory for a shard map");
        }
        /* Each chunk to the server with the fewest bytes so far (the lowest index on a tie). */
        for (uint32_t c = 0; c < l->n_chunks; c++) {
            uint32_t best = 0;
            for (uint32_t s = 1; s < n_servers; s++) {
                if (load[s] < load[best]) {
                    best = s;
                }
            }
            l->owner[c] = best;
            load[best] += (uint64_t)weft__ps_chunk_len(l, c) * esz;
        }
        weft_free(load);
        h = fnv(h, l->owner, (size_t)nc * sizeof(*l->owner));
    } else {
        h = fnv(h, "fibonacci64", 11);
    }
    l->map_hash = h;
    return WEFT_OK;
}

void weft__ps_layout_free(ps_layout_t *l)
{
    weft_free(l->owner);
    l->owner = NULL;
}

/* ------------------------------------------------------------------ specs on the wire */

static size_t hyper_of(const weft_ps_table_spec_t *s, double *h)
{
    switch (s->optimizer) {
    case WEFT_PS_SGD:
        h[0] = s->sgd.lr, h[1] = s->sgd.momentum, h[2] = s->sgd.dampening;
        h[3] = s->sgd.weight_decay, h[4] = s->sgd.nesterov;
        return 5;
    case WEFT_PS_ADAGRAD:
        h[0] = s->adagrad.lr, h[1] = s->adagrad.lr_decay, h[2] = s->adagrad.weight_decay;
        h[3] = s->adagrad.initial_accumulator_value, h[4] = s->adagrad.eps;
        return 5;
    case WEFT_PS_ADAM:
    case WEFT_PS_ADAMW:
        h[0] = s->adam.lr, h[1] = s->adam.beta1, h[2] = s->adam.beta2, h[3] = s->adam.eps;
        h[4] = s->adam.weight_decay, h[5] = s->adam.amsgrad;
        return 6;
    default:
        return 0;
    }
}

weft_status_t weft__ps_spec_to_pb(const ps_layout_t *l, const int *servers, const int *workers,
                                  Weft__V1__PsTableSpec *pb)
{
    const weft_ps_table_spec_t *s = &l->spec;
    weft__v1__ps_table_spec__init(pb);
    pb->name = (char *)l->name;
    pb->kind = (Weft__V1__PsKind)s->kind;
    pb->dtype = (int32_t)s->dtype;
    pb->n_shape = s->kind == WEFT_PS_DENSE ? (size_t)s->ndim : 0;
    pb->shape = (int64_t *)s->shape;
    pb->dim = s->dim;
    pb->id_bound = s->id_bound;
    pb->admit_after = s->admit_after;
    pb->capacity = s->capacity;
    pb->init = (Weft__V1__PsInit)s->init;
    pb->init_a = s->init_a;
    pb->init_b = s->init_b;
    pb->seed = s->seed;
    pb->optimizer = (Weft__V1__PsOptimizer)s->optimizer;
    pb->hyper = weft_alloc(8 * sizeof(double));
    if (pb->hyper == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory");
    }
    pb->n_hyper = hyper_of(s, pb->hyper);
    pb->consistency = (Weft__V1__PsConsistency)s->consistency;
    pb->staleness = s->consistency == WEFT_PS_BOUNDED ? s->staleness : 0;
    pb->chunk_bytes = s->kind == WEFT_PS_DENSE ? s->chunk_bytes : 0;
    pb->n_servers = l->n_servers;
    pb->servers = (int32_t *)servers;
    pb->n_workers = l->n_workers;
    pb->workers = (int32_t *)workers;
    pb->map_hash = l->map_hash;
    return WEFT_OK;
}

void weft__ps_spec_pb_free(Weft__V1__PsTableSpec *pb)
{
    weft_free(pb->hyper);
    pb->hyper = NULL;
}

#define DIFF_NUM(field, fmt, cast)                                                                 \
    do {                                                                                           \
        if (a->field != b->field) {                                                                \
            snprintf(why, n, fmt " vs " fmt, (cast)a->field, (cast)b->field);                      \
            return #field;                                                                         \
        }                                                                                          \
    } while (0)

static const char *diff_array(const char *name, size_t na, const void *pa, size_t nb,
                              const void *pb, size_t esz, char *why, size_t n)
{
    if (na != nb) {
        snprintf(why, n, "%zu vs %zu entries", na, nb);
        return name;
    }
    for (size_t i = 0; i < na; i++) {
        if (memcmp((const char *)pa + i * esz, (const char *)pb + i * esz, esz) != 0) {
            snprintf(why, n, "entry %zu differs", i);
            return name;
        }
    }
    return NULL;
}

static const char *enum_name(const char *field, int v)
{
    static const char *const kinds[] = {"none", "dense", "sparse"};
    static const char *const cons[] = {"none", "sync", "async", "bounded"};
    static const char *const opts[] = {"none", "sgd", "adagrad", "adam", "adamw", "sum"};
    static const char *const inits[] = {"none", "zeros", "uniform", "normal", "constant"};
    if (strcmp(field, "kind") == 0 && v >= 0 && v < 3) {
        return kinds[v];
    }
    if (strcmp(field, "consistency") == 0 && v >= 0 && v < 4) {
        return cons[v];
    }
    if (strcmp(field, "optimizer") == 0 && v >= 0 && v < 6) {
        return opts[v];
    }
    if (strcmp(field, "init") == 0 && v >= 0 && v < 5) {
        return inits[v];
    }
    if (strcmp(field, "dtype") == 0 && weft_dtype_valid(v)) {
        return weft_dtype_name((weft_dtype_t)v);
    }
    return "?";
}

#define DIFF_ENUM(field)                                                                           \
    do {                                                                                           \
        if ((int)a->field != (int)b->field) {                                                      \
            snprintf(why, n, "%s vs %s", enum_name(#field, (int)a->field),                         \
                     enum_name(#field, (int)b->field));                                            \
            return #field;                                                                         \
        }                                                                                          \
    } while (0)

const char *weft__ps_spec_diff(const Weft__V1__PsTableSpec *a, const Weft__V1__PsTableSpec *b,
                               char *why, size_t n)
{
    const char *f;
    if (strcmp(a->name, b->name) != 0) {
        snprintf(why, n, "'%s' vs '%s'", a->name, b->name);
        return "name";
    }
    DIFF_ENUM(kind);
    DIFF_ENUM(dtype);
    if ((f = diff_array("shape", a->n_shape, a->shape, b->n_shape, b->shape, sizeof(int64_t), why,
                        n)) != NULL) {
        return f;
    }
    DIFF_NUM(dim, "%lld", long long);
    DIFF_NUM(id_bound, "%llu", unsigned long long);
    DIFF_NUM(admit_after, "%llu", unsigned long long);
    DIFF_NUM(capacity, "%llu", unsigned long long);
    DIFF_ENUM(init);
    DIFF_NUM(init_a, "%g", double);
    DIFF_NUM(init_b, "%g", double);
    DIFF_NUM(seed, "%llu", unsigned long long);
    DIFF_ENUM(optimizer);
    if ((f = diff_array("hyperparameters", a->n_hyper, a->hyper, b->n_hyper, b->hyper,
                        sizeof(double), why, n)) != NULL) {
        return f;
    }
    DIFF_ENUM(consistency);
    DIFF_NUM(staleness, "%lld", long long);
    DIFF_NUM(chunk_bytes, "%llu", unsigned long long);
    if ((f = diff_array("servers", a->n_servers, a->servers, b->n_servers, b->servers,
                        sizeof(int32_t), why, n)) != NULL) {
        return f;
    }
    if ((f = diff_array("workers", a->n_workers, a->workers, b->n_workers, b->workers,
                        sizeof(int32_t), why, n)) != NULL) {
        return f;
    }
    DIFF_NUM(map_hash, "%016llx", unsigned long long);
    return NULL;
}

/* ------------------------------------------------------------------ cells */

void weft__ps_init_values(const ps_layout_t *l, uint64_t id, int64_t n, float *out)
{
    const weft_ps_table_spec_t *s = &l->spec;
    weft_rng_t rng;
    switch (s->init) {
    case WEFT_PS_ZEROS:
        memset(out, 0, (size_t)n * sizeof(float));
        return;
    case WEFT_PS_CONSTANT:
        for (int64_t i = 0; i < n; i++) {
            out[i] = (float)s->init_a;
        }
        return;
    default:
        break;
    }
    /* One stream per row or chunk, from the seed and the table's name: independent of servers. */
    weft_rng_init(&rng, s->seed ^ fnv(UINT64_C(0xcbf29ce484222325), l->name, strlen(l->name)), id);
    if (s->init == WEFT_PS_UNIFORM) {
        /* weft_rng_uniform's xoshiro256** step, its state in registers (a row is made on first
         * use, inside training): the same numbers. */
        uint64_t s0 = rng.s[0], s1 = rng.s[1], s2 = rng.s[2], s3 = rng.s[3];
        for (int64_t i = 0; i < n; i++) {
            uint64_t r = s1 * 5;
            r = ((r << 7) | (r >> 57)) * 9;
            uint64_t t = s1 << 17;
            s2 ^= s0;
            s3 ^= s1;
            s1 ^= s2;
            s0 ^= s3;
            s2 ^= t;
            s3 = (s3 << 45) | (s3 >> 19);
            double v = s->init_a + (s->init_b - s->init_a) * ((double)(r >> 11) * 0x1.0p-53);
            out[i] = (float)v;
        }
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        double v = s->init == WEFT_PS_UNIFORM
                       ? s->init_a + (s->init_b - s->init_a) * weft_rng_uniform(&rng)
                       : s->init_a + s->init_b * weft_rng_normal(&rng);
        out[i] = (float)v;
    }
}

size_t weft__ps_cell_bytes(const ps_layout_t *l, int64_t n)
{
    return (size_t)n * (weft_dtype_size(l->spec.dtype) + (size_t)l->n_state * sizeof(float));
}

void weft__ps_cell_free(ps_cell_t *c)
{
    if (c == NULL) {
        return;
    }
    weft_tensor_release(c->value);
    for (int i = 0; i < 3; i++) {
        weft_tensor_release(c->state[i]);
    }
    weft_free(c->acc);
    weft_free(c->block);
}

/* The initial value of cell @p c (vdata, c->n elements in the storage dtype). */
static weft_status_t cell_init_value(const ps_layout_t *l, ps_cell_t *c)
{
    if (l->spec.dtype == WEFT_F32) {
        weft__ps_init_values(l, c->id, c->n, c->vdata);
        return WEFT_OK;
    }
    float stack[256];
    float *tmp = (size_t)c->n <= 256 ? stack : weft_alloc((size_t)c->n * sizeof(float));
    if (tmp == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory");
    }
    weft__ps_init_values(l, c->id, c->n, tmp);
    weft_reduce_narrow(c->vdata, tmp, (size_t)c->n, l->spec.dtype, WEFT_SUM, 1);
    if (tmp != stack) {
        weft_free(tmp);
    }
    return WEFT_OK;
}

#define CELL_ALIGN 16 /* what vector loads like; the block is contiguous either way */

static size_t align_up(size_t n)
{
    return (n + CELL_ALIGN - 1) & ~(size_t)(CELL_ALIGN - 1);
}

weft_status_t weft__ps_cell_new(const ps_layout_t *l, uint64_t id, int64_t n, ps_cell_t **c_p)
{
    bool dense = l->spec.kind == WEFT_PS_DENSE;
    size_t esz = weft_dtype_size(l->spec.dtype);
    /* A row: header, value and state in one allocation. */
    size_t head = PS_CELL_HEAD, vbytes = align_up((size_t)n * esz);
    size_t sbytes = align_up((size_t)n * sizeof(float));
    /* A row's block starts on a cache line: serving it reads the header's first line and the
     * value's (and the state's) lines, no more. */
    size_t total = dense ? sizeof(ps_cell_t) : head + vbytes + (size_t)l->n_state * sbytes + 63;
    void *block = weft_alloc(total);
    weft_status_t st = WEFT_ERR_NO_MEMORY;
    if (block == NULL) {
        return weft__set_error(st, "ps: no memory for a row of %lld elements", (long long)n);
    }
    ps_cell_t *c = dense ? block : (ps_cell_t *)(((uintptr_t)block + 63) & ~(uintptr_t)63);
    memset(c, 0, sizeof(*c));
    c->block = block;
    c->id = id;
    c->n = n;
    c->dtype = l->spec.dtype;
    c->dense = dense;
    if (dense) {
        st = weft_tensor_empty(l->spec.dtype, 1, &n, &c->value);
        for (int i = 0; i < l->n_state && st == WEFT_OK; i++) {
            st = weft_tensor_create(WEFT_F32, 1, &n, &c->state[i]);
        }
        if (st != WEFT_OK) {
            weft__ps_cell_free(c);
            return st;
        }
        c->vdata = weft_tensor_data(c->value);
        for (int i = 0; i < l->n_state; i++) {
            c->sdata[i] = weft_tensor_data(c->state[i]);
        }
    } else {
        char *p = (char *)c + head;
        c->vdata = p;
        p += vbytes;
        for (int i = 0; i < l->n_state; i++, p += sbytes) {
            c->sdata[i] = (float *)(void *)p;
            memset(p, 0, (size_t)n * sizeof(float));
        }
    }
    if ((st = cell_init_value(l, c)) != WEFT_OK) {
        weft__ps_cell_free(c);
        return st;
    }
    if (l->spec.optimizer == WEFT_PS_ADAGRAD && l->spec.adagrad.initial_accumulator_value != 0) {
        float v = (float)l->spec.adagrad.initial_accumulator_value;
        for (int64_t i = 0; i < n; i++) {
            c->sdata[0][i] = v;
        }
    }
    *c_p = c;
    return WEFT_OK;
}

void weft__ps_cell_read(const ps_cell_t *c, float *out)
{
    if (c->dtype == WEFT_F32) {
        memcpy(out, c->vdata, (size_t)c->n * sizeof(float));
    } else {
        weft_reduce_widen(out, c->vdata, (size_t)c->n, c->dtype);
    }
}

weft_status_t weft__ps_cell_own(ps_cell_t *c)
{
    /* Only a dense chunk's value is ever lent to a pull (rows are copied into the reply). */
    if (!c->dense || !weft__tensor_shared(c->value)) {
        return WEFT_OK;
    }
    weft_tensor_t *fresh = NULL;
    WEFT_CHECK(weft_tensor_clone(c->value, &fresh));
    weft_tensor_release(c->value); /* the reader keeps the old bytes */
    c->value = fresh;
    c->vdata = weft_tensor_data(fresh);
    return WEFT_OK;
}

/* Scratch of @p n floats: @p stack when it is large enough (a row), else the heap. */
static float *scratch(float *stack, size_t cap, int64_t n)
{
    return (size_t)n <= cap ? stack : weft_alloc((size_t)n * sizeof(float));
}

static void scratch_free(float *p, float *stack)
{
    if (p != stack) {
        weft_free(p);
    }
}

static float *state_of(ps_cell_t *c, int i)
{
    return c->sdata[i];
}

weft_status_t weft__ps_cell_apply(const ps_layout_t *l, ps_cell_t *c, const float *grad,
                                  float scale)
{
    const weft_ps_table_spec_t *s = &l->spec;
    float gstack[1024], pstack[1024];
    float *scaled = NULL, *p32 = NULL;
    weft_status_t st;

    /* A pull may be sending the value's bytes right now (pull_reply shares f32 values). */
    if ((st = weft__ps_cell_own(c)) != WEFT_OK) {
        return st;
    }
    int64_t n = c->n;
    bool wide = s->dtype != WEFT_F32;
    if (scale != 1.0f) {
        if ((scaled = scratch(gstack, 1024, n)) == NULL) {
            return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory to apply a gradient");
        }
        weft__ps_scale(scaled, grad, scale, n);
        grad = scaled;
    }
    float *p = c->vdata;
    if (wide) {
        if ((p32 = scratch(pstack, 1024, n)) == NULL) {
            scratch_free(scaled, gstack);
            return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory to apply a gradient");
        }
        weft__ps_cell_read(c, p32);
        p = p32;
    }
    int64_t step = c->step + 1;
    /* core's kernels (optim.h), the configuration checked when the table was made */
    switch (s->optimizer) {
    case WEFT_PS_SGD:
        weft__optim_sgd_f32(&s->sgd, p, grad, state_of(c, 0), (size_t)n, step);
        break;
    case WEFT_PS_ADAGRAD:
        weft__optim_adagrad_f32(&s->adagrad, p, grad, state_of(c, 0), (size_t)n, step);
        break;
    case WEFT_PS_ADAM:
    case WEFT_PS_ADAMW:
        weft__optim_adam_f32(&s->adam, s->optimizer == WEFT_PS_ADAMW, p, grad, state_of(c, 0),
                             state_of(c, 1), state_of(c, 2), (size_t)n, step);
        break;
    case WEFT_PS_SUM:
        if (s->consistency == WEFT_PS_SYNC) {
            memcpy(p, grad, (size_t)n * sizeof(float)); /* the step's sum is the value */
        } else {
            weft_reduce_into(p, grad, (size_t)n, WEFT_F32, WEFT_SUM); /* core's SIMD kernel */
        }
        break;
    default:
        break;
    }
    c->step = step;
    if (wide) {
        weft_reduce_narrow(c->vdata, p32, (size_t)n, s->dtype, WEFT_SUM, 1);
    }
    scratch_free(p32, pstack);
    scratch_free(scaled, gstack);
    return WEFT_OK;
}
