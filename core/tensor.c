/* Dense contiguous tensors over refcounted storage shared by views. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"

/*
 * The bytes behind one or more tensors. Owned storage lives in one weft_alloc block: this header,
 * then the data at the next WEFT__TENSOR_ALIGN boundary. Wrapped storage points at the caller's
 * buffer and calls release once when the last tensor goes.
 */
typedef struct {
    atomic_long refs;
    void *data;
    size_t nbytes;
    weft_device_t device;
    weft_release_cb_t release;
    void *release_arg;
    int owned;
    size_t block; /* size of the owned block when it came from the large-block cache path */
} storage_t;

/*
 * Large blocks (>= 1 MiB, sized in whole MiB) are kept for reuse when freed, up to
 * WEFT_TENSOR_CACHE_MB (default 1024) in at most CACHE_SLOTS blocks: a fresh large
 * block costs the kernel a page fault and a zeroed page per 4 KiB on first touch,
 * which halves receive bandwidth for tensors of tens of MiB. So are the blocks of tensors made
 * from CACHE_MID up, sized in quarters of their power of two (at most a quarter more than asked
 * for): malloc gives such blocks back to the kernel when they are freed (it trims the heap), and
 * a parameter server's replies of a few hundred KiB, made and freed for every request, paid a
 * page fault per 4 KiB each time.
 */
#define CACHE_MIN   ((size_t)1 << 20)
#define CACHE_MID   ((size_t)128 << 10)
#define CACHE_SLOTS 32

/* The block a tensor of @p total bytes (header included) is given: its cache size class, or 0
 * (not kept for reuse). */
static size_t block_class(size_t total)
{
    if (total >= CACHE_MIN) {
        return (total + CACHE_MIN - 1) & ~(CACHE_MIN - 1);
    }
    if (total < CACHE_MID) {
        return 0;
    }
    size_t q = ((size_t)1 << (63 - __builtin_clzll((unsigned long long)total))) / 4;
    return (total + q - 1) & ~(q - 1);
}

static pthread_mutex_t cache_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t cache_once = PTHREAD_ONCE_INIT;
static size_t cache_cap;
static size_t cache_bytes;
static int cache_n;
static struct {
    void *block;
    size_t size;
} cache[CACHE_SLOTS];

static void cache_init(void)
{
    cache_cap = (size_t)weft__cfg_int(WEFT__CFG_TENSOR_CACHE_MB) << 20;
}

static void *cache_take(size_t size)
{
    void *b = NULL;

    pthread_mutex_lock(&cache_mu);
    /* Newest first: a block freed a moment ago may still be warm in the cache. */
    for (int i = cache_n - 1; i >= 0; i--) {
        if (cache[i].size == size) {
            b = cache[i].block;
            cache_bytes -= size;
            memmove(&cache[i], &cache[i + 1], (size_t)(cache_n - 1 - i) * sizeof(cache[0]));
            cache_n--;
            break;
        }
    }
    pthread_mutex_unlock(&cache_mu);
    return b;
}

/* Keeps @p b for reuse; 0 if the cache is full (the caller frees it). */
static int cache_put(void *b, size_t size)
{
    int kept = 0;

    pthread_once(&cache_once, cache_init);
    pthread_mutex_lock(&cache_mu);
    if (cache_bytes + size > cache_cap && cache_n > 0) {
        /* Make room by dropping the oldest blocks. */
        while (cache_n > 0 && cache_bytes + size > cache_cap) {
            weft_free(cache[0].block);
            cache_bytes -= cache[0].size;
            memmove(&cache[0], &cache[1], (size_t)(cache_n - 1) * sizeof(cache[0]));
            cache_n--;
        }
    }
    if (cache_n == CACHE_SLOTS) {
        weft_free(cache[0].block);
        cache_bytes -= cache[0].size;
        memmove(&cache[0], &cache[1], (size_t)(cache_n - 1) * sizeof(cache[0]));
        cache_n--;
    }
    if (cache_bytes + size <= cache_cap) {
        cache[cache_n].block = b;
        cache[cache_n].size = size;
        cache_n++;
        cache_bytes += size;
        kept = 1;
    }
    pthread_mutex_unlock(&cache_mu);
    return kept;
}

void weft_tensor_cache_clear(void)
{
    pthread_mutex_lock(&cache_mu);
    for (int i = 0; i < cache_n; i++) {
        weft_free(cache[i].block);
    }
    cache_n = 0;
    cache_bytes = 0;
    pthread_mutex_unlock(&cache_mu);
}

struct weft_tensor {
    atomic_long refs;
    storage_t *storage;
    weft_dtype_t dtype;
    int ndim;
    int64_t shape[WEFT_MAX_DIMS];
    int64_t numel;
    size_t nbytes;
    void *ag; /* autograd metadata (the autograd module's), owned */
    void (*ag_free)(void *ag);
};

static const struct {
    size_t size;
    const char *name;
} dtype_info[WEFT_DTYPE_COUNT] = {
    [WEFT_F32] = {4, "f32"},   [WEFT_F64] = {8, "f64"}, [WEFT_F16] = {2, "f16"},
    [WEFT_BF16] = {2, "bf16"}, [WEFT_I8] = {1, "i8"},   [WEFT_I32] = {4, "i32"},
    [WEFT_I64] = {8, "i64"},   [WEFT_U8] = {1, "u8"},   [WEFT_BOOL] = {1, "bool"},
};

int weft_dtype_valid(int dtype)
{
    return dtype >= 0 && dtype < WEFT_DTYPE_COUNT;
}

size_t weft_dtype_size(weft_dtype_t dtype)
{
    if (!weft_dtype_valid((int)dtype)) {
        return 0;
    }
    return dtype_info[dtype].size;
}

const char *weft_dtype_name(weft_dtype_t dtype)
{
    if (!weft_dtype_valid((int)dtype)) {
        return "invalid";
    }
    return dtype_info[dtype].name;
}

int64_t weft_shape_numel(int ndim, const int64_t *shape)
{
    int64_t numel = 1;
    int zero = 0;

    if (ndim < 0 || ndim > WEFT_MAX_DIMS || (ndim > 0 && shape == NULL)) {
        return -1;
    }
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) {
            return -1;
        }
        if (shape[i] == 0) {
            zero = 1;
        }
    }
    if (zero) {
        return 0;
    }
    for (int i = 0; i < ndim; i++) {
        if (__builtin_mul_overflow(numel, shape[i], &numel)) {
            return -1;
        }
    }
    return numel;
}

weft_status_t weft__tensor_shape_check(int dtype, int ndim, const int64_t *shape, int64_t *numel_p,
                                       size_t *nbytes_p)
{
    int64_t numel;
    int64_t nbytes;

    if (!weft_dtype_valid(dtype)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "tensor: invalid dtype %d", dtype);
    }
    if (ndim < 0 || ndim > WEFT_MAX_DIMS) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "tensor: %d dims (must be 0..%d)", ndim,
                               WEFT_MAX_DIMS);
    }
    if (ndim > 0 && shape == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "tensor: shape is NULL with %d dims", ndim);
    }
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) {
            return weft__set_error(WEFT_ERR_INVALID_ARG, "tensor: dim %d has negative size %lld", i,
                                   (long long)shape[i]);
        }
    }
    numel = weft_shape_numel(ndim, shape);
    if (numel < 0 || __builtin_mul_overflow(numel, (int64_t)dtype_info[dtype].size, &nbytes) ||
        (uint64_t)nbytes > SIZE_MAX) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "tensor: %d-dim %s shape overflows 64-bit byte size", ndim,
                               dtype_info[dtype].name);
    }
    if (numel_p != NULL) {
        *numel_p = numel;
    }
    if (nbytes_p != NULL) {
        *nbytes_p = (size_t)nbytes;
    }
    return WEFT_OK;
}

/* A tensor object over @p s (whose reference it takes over on success). Shape already checked. */
static weft_status_t tensor_new(storage_t *s, weft_dtype_t dtype, int ndim, const int64_t *shape,
                                int64_t numel, size_t nbytes, weft_tensor_t **t_p)
{
    weft_tensor_t *t = weft_alloc(sizeof(*t));

    if (t == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "tensor: out of memory for a tensor");
    }
    atomic_init(&t->refs, 1);
    t->storage = s;
    t->dtype = dtype;
    t->ndim = ndim;
    memset(t->shape, 0, sizeof(t->shape));
    if (ndim > 0) {
        memcpy(t->shape, shape, (size_t)ndim * sizeof(shape[0]));
    }
    t->numel = numel;
    t->nbytes = nbytes;
    t->ag = NULL;
    t->ag_free = NULL;
    *t_p = t;
    return WEFT_OK;
}

static void storage_release(storage_t *s)
{
    if (atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) != 1) {
        return;
    }
    if (!s->owned && s->release != NULL) {
        s->release(s->data, s->release_arg);
    }
    if (s->block != 0 && cache_put(s, s->block)) {
        return;
    }
    weft_free(s);
}

static weft_status_t tensor_alloc(weft_dtype_t dtype, int ndim, const int64_t *shape, int zero,
                                  weft_tensor_t **t_p)
{
    const size_t header =
        (sizeof(storage_t) + WEFT__TENSOR_ALIGN - 1) & ~(size_t)(WEFT__TENSOR_ALIGN - 1);
    weft_status_t status;
    storage_t *s;
    int64_t numel;
    size_t nbytes;
    size_t total;
    uintptr_t data;

    WEFT_CHECK(weft__tensor_shape_check((int)dtype, ndim, shape, &numel, &nbytes));
    /* header + nbytes + slack to reach the alignment (weft_alloc gives at least 16). */
    if (__builtin_add_overflow(nbytes, header + WEFT__TENSOR_ALIGN, &total)) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "tensor: %zu bytes is too large", nbytes);
    }
    size_t block = 0;
    s = NULL;
    if (total > SIZE_MAX - CACHE_MIN) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "tensor: %zu bytes is too large", nbytes);
    }
    if ((block = block_class(total)) != 0) {
        total = block;
        s = cache_take(block);
    }
    if (s == NULL) {
        s = weft_alloc(total);
    }
    if (s == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "tensor: out of memory for %zu bytes", nbytes);
    }
    data = ((uintptr_t)s + header + WEFT__TENSOR_ALIGN - 1) & ~(uintptr_t)(WEFT__TENSOR_ALIGN - 1);
    atomic_init(&s->refs, 1);
    s->data = (void *)data;
    s->nbytes = nbytes;
    s->device = WEFT_CPU;
    s->release = NULL;
    s->release_arg = NULL;
    s->owned = 1;
    s->block = block;
    if (zero && nbytes > 0) {
        memset(s->data, 0, nbytes);
    }
    WEFT_CHECK_GOTO(tensor_new(s, dtype, ndim, shape, numel, nbytes, t_p), status,
                    err_free_storage);
    return WEFT_OK;

err_free_storage:
    weft_free(s);
    return status;
}

/* ---- tensors that grow as their bytes arrive ---------------------------------------------- */

struct weft__tgrow {
    storage_t *s; /* the block: the storage header, then the data at its aligned offset */
    size_t cap;   /* bytes of data the block holds now */
    size_t final; /* the block's final size (its large-block cache size class) */
    size_t off;   /* the data's offset in the block */
    weft_dtype_t dtype;
    int ndim;
    int64_t shape[WEFT_MAX_DIMS];
    int64_t numel;
    size_t nbytes;
};

static size_t grow_header(void)
{
    return (sizeof(storage_t) + WEFT__TENSOR_ALIGN - 1) & ~(size_t)(WEFT__TENSOR_ALIGN - 1);
}

static size_t aligned_off(const void *block)
{
    uintptr_t data = ((uintptr_t)block + grow_header() + WEFT__TENSOR_ALIGN - 1) &
                     ~(uintptr_t)(WEFT__TENSOR_ALIGN - 1);
    return (size_t)(data - (uintptr_t)block);
}

weft_status_t weft__tensor_grow_begin(weft_dtype_t dtype, int ndim, const int64_t *shape,
                                      size_t first, weft__tgrow_t **g_p, uint8_t **data_p,
                                      size_t *cap_p)
{
    int64_t numel;
    size_t nbytes, total, block;

    WEFT_CHECK(weft__tensor_shape_check((int)dtype, ndim, shape, &numel, &nbytes));
    if (__builtin_add_overflow(nbytes, grow_header() + WEFT__TENSOR_ALIGN, &total) ||
        total > SIZE_MAX - CACHE_MIN) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "tensor: %zu bytes is too large", nbytes);
    }
    block = (total + CACHE_MIN - 1) & ~(CACHE_MIN - 1);
    weft__tgrow_t *g = weft_calloc(1, sizeof(*g));
    if (g == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "tensor: no memory");
    }
    /* A block of the whole size kept in the cache is memory this process holds already: take it
     * (its pages are warm). Otherwise start with @p first bytes and grow as they arrive. */
    storage_t *s = block >= CACHE_MIN ? cache_take(block) : NULL;
    size_t cap = nbytes;
    if (s == NULL) {
        cap = first < nbytes ? first : nbytes;
        s = weft_alloc(grow_header() + WEFT__TENSOR_ALIGN + cap);
        if (s == NULL) {
            weft_free(g);
            return weft__set_error(WEFT_ERR_NO_MEMORY, "tensor: out of memory for %zu bytes", cap);
        }
    }
    g->s = s;
    g->cap = cap;
    g->final = block;
    g->off = aligned_off(s);
    g->dtype = dtype;
    g->ndim = ndim;
    if (ndim > 0) {
        memcpy(g->shape, shape, (size_t)ndim * sizeof(shape[0]));
    }
    g->numel = numel;
    g->nbytes = nbytes;
    *g_p = g;
    *data_p = (uint8_t *)s + g->off;
    *cap_p = cap;
    return WEFT_OK;
}

weft_status_t weft__tensor_grow_to(weft__tgrow_t *g, size_t cap, size_t filled, uint8_t **data_p)
{
    if (cap > g->nbytes) {
        cap = g->nbytes;
    }
    if (cap <= g->cap) {
        *data_p = (uint8_t *)g->s + g->off;
        return WEFT_OK;
    }
    /* realloc keeps the bytes (and, with glibc, moves a large block's pages without copying). */
    storage_t *s = weft_realloc(g->s, grow_header() + WEFT__TENSOR_ALIGN + cap);
    if (s == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "tensor: out of memory for %zu bytes", cap);
    }
    size_t off = aligned_off(s);
    if (off != g->off) {
        /* The new block sits at another alignment: move what came so far into place. */
        memmove((uint8_t *)s + off, (uint8_t *)s + g->off, filled);
    }
    g->s = s;
    g->off = off;
    g->cap = cap;
    *data_p = (uint8_t *)s + off;
    return WEFT_OK;
}

weft_status_t weft__tensor_grow_end(weft__tgrow_t *g, weft_tensor_t **t_p)
{
    weft_status_t st;
    storage_t *s = g->s;
    size_t block = 0;

    if (g->final >= CACHE_MIN && g->cap == g->nbytes) {
        /* Its final size is the cache's size class, so that it may be kept for reuse. */
        storage_t *r = weft_realloc(s, g->final);
        if (r != NULL) {
            size_t off = aligned_off(r);
            if (off != g->off) {
                memmove((uint8_t *)r + off, (uint8_t *)r + g->off, g->nbytes);
                g->off = off;
            }
            s = r;
            block = g->final;
        }
    }
    atomic_init(&s->refs, 1);
    s->data = (uint8_t *)s + g->off;
    s->nbytes = g->nbytes;
    s->device = WEFT_CPU;
    s->release = NULL;
    s->release_arg = NULL;
    s->owned = 1;
    s->block = block;
    g->s = NULL;
    st = tensor_new(s, g->dtype, g->ndim, g->shape, g->numel, g->nbytes, t_p);
    if (st != WEFT_OK) {
        weft_free(s);
    }
    weft_free(g);
    return st;
}

void weft__tensor_grow_abort(weft__tgrow_t *g)
{
    if (g != NULL) {
        weft_free(g->s);
        weft_free(g);
    }
}

weft_status_t weft_tensor_create(weft_dtype_t dtype, int ndim, const int64_t *shape,
                                 weft_tensor_t **t_p)
{
    if (t_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "tensor: t_p is NULL");
    }
    return tensor_alloc(dtype, ndim, shape, 1, t_p);
}

weft_status_t weft_tensor_empty(weft_dtype_t dtype, int ndim, const int64_t *shape,
                                weft_tensor_t **t_p)
{
    if (t_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "tensor: t_p is NULL");
    }
    return tensor_alloc(dtype, ndim, shape, 0, t_p);
}

weft_status_t weft_tensor_wrap(weft_dtype_t dtype, int ndim, const int64_t *shape, void *data,
                               size_t nbytes, weft_device_t device, weft_release_cb_t release,
                               void *release_arg, weft_tensor_t **t_p)
{
    weft_status_t status;
    storage_t *s;
    int64_t numel;
    size_t want;

    if (t_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "tensor: t_p is NULL");
    }
    WEFT_CHECK(weft__tensor_shape_check((int)dtype, ndim, shape, &numel, &want));
    if (nbytes != want) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "tensor: wrapped buffer has %zu bytes, shape needs %zu", nbytes,
                               want);
    }
    if (data == NULL && nbytes > 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "tensor: wrapped buffer is NULL");
    }
    if (device.type != WEFT_DEVICE_CPU && device.type != WEFT_DEVICE_CUDA) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "tensor: invalid device type %d",
                               (int)device.type);
    }
    if (device.index < 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "tensor: invalid device index %d",
                               device.index);
    }
    s = weft_alloc(sizeof(*s));
    if (s == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "tensor: out of memory for a storage");
    }
    atomic_init(&s->refs, 1);
    s->data = data;
    s->nbytes = nbytes;
    s->device = device;
    s->release = release;
    s->release_arg = release_arg;
    s->owned = 0;
    s->block = 0;
    WEFT_CHECK_GOTO(tensor_new(s, dtype, ndim, shape, numel, nbytes, t_p), status,
                    err_free_storage);
    return WEFT_OK;

err_free_storage:
    /* The caller keeps the buffer on failure: do not call release. */
    weft_free(s);
    return status;
}

weft_status_t weft_tensor_view(weft_tensor_t *t, int ndim, const int64_t *shape,
                               weft_tensor_t **t_p)
{
    weft_status_t status;
    int64_t numel;
    size_t nbytes;

    if (t == NULL || t_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "tensor view: NULL argument");
    }
    WEFT_CHECK(weft__tensor_shape_check((int)t->dtype, ndim, shape, &numel, &nbytes));
    if (numel != t->numel) {
        return weft__set_error(WEFT_ERR_SHAPE,
                               "tensor view: %lld elements cannot view a tensor of %lld",
                               (long long)numel, (long long)t->numel);
    }
    atomic_fetch_add_explicit(&t->storage->refs, 1, memory_order_relaxed);
    WEFT_CHECK_GOTO(tensor_new(t->storage, t->dtype, ndim, shape, numel, nbytes, t_p), status,
                    err_release_storage);
    return WEFT_OK;

err_release_storage:
    storage_release(t->storage);
    return status;
}

weft_status_t weft_tensor_clone(const weft_tensor_t *t, weft_tensor_t **t_p)
{
    weft_tensor_t *c = NULL;

    if (t == NULL || t_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "tensor clone: NULL argument");
    }
    if (t->storage->device.type != WEFT_DEVICE_CPU) {
        return weft__set_error(WEFT_ERR_UNSUPPORTED, "tensor clone: only CPU tensors (got %s:%d)",
                               t->storage->device.type == WEFT_DEVICE_CUDA ? "cuda" : "?",
                               t->storage->device.index);
    }
    WEFT_CHECK(tensor_alloc(t->dtype, t->ndim, t->shape, 0, &c));
    if (t->nbytes > 0) {
        memcpy(c->storage->data, t->storage->data, t->nbytes);
    }
    *t_p = c;
    return WEFT_OK;
}

weft_tensor_t *weft_tensor_retain(weft_tensor_t *t)
{
    if (t != NULL) {
        atomic_fetch_add_explicit(&t->refs, 1, memory_order_relaxed);
    }
    return t;
}

bool weft__tensor_shared(const weft_tensor_t *t)
{
    return atomic_load_explicit(&t->refs, memory_order_acquire) > 1 ||
           atomic_load_explicit(&t->storage->refs, memory_order_acquire) > 1;
}

void weft_tensor_release(weft_tensor_t *t)
{
    if (t == NULL) {
        return;
    }
    if (atomic_fetch_sub_explicit(&t->refs, 1, memory_order_acq_rel) != 1) {
        return;
    }
    if (t->ag != NULL && t->ag_free != NULL) {
        t->ag_free(t->ag);
    }
    storage_release(t->storage);
    weft_free(t);
}

void *weft__tensor_ag(const weft_tensor_t *t)
{
    return t == NULL ? NULL : t->ag;
}

int weft__tensor_exclusive(const weft_tensor_t *t)
{
    return atomic_load_explicit(&t->refs, memory_order_acquire) == 1 &&
           atomic_load_explicit(&t->storage->refs, memory_order_acquire) == 1 && t->storage->owned;
}

void weft__tensor_set_ag(weft_tensor_t *t, void *ag, void (*ag_free)(void *ag))
{
    t->ag = ag;
    t->ag_free = ag_free;
}

void *weft_tensor_data(const weft_tensor_t *t)
{
    return t == NULL ? NULL : t->storage->data;
}

size_t weft_tensor_nbytes(const weft_tensor_t *t)
{
    return t == NULL ? 0 : t->nbytes;
}

int64_t weft_tensor_numel(const weft_tensor_t *t)
{
    return t == NULL ? 0 : t->numel;
}

int weft_tensor_ndim(const weft_tensor_t *t)
{
    return t == NULL ? 0 : t->ndim;
}

const int64_t *weft_tensor_shape(const weft_tensor_t *t)
{
    return t == NULL ? NULL : t->shape;
}

weft_dtype_t weft_tensor_dtype(const weft_tensor_t *t)
{
    return t == NULL ? WEFT_DTYPE_COUNT : t->dtype;
}

weft_device_t weft_tensor_device(const weft_tensor_t *t)
{
    return t == NULL ? WEFT_CPU : t->storage->device;
}

int weft_tensor_equal(const weft_tensor_t *a, const weft_tensor_t *b)
{
    if (a == NULL || b == NULL) {
        return a == b;
    }
    if (a->dtype != b->dtype || a->ndim != b->ndim) {
        return 0;
    }
    for (int i = 0; i < a->ndim; i++) {
        if (a->shape[i] != b->shape[i]) {
            return 0;
        }
    }
    if (a->nbytes == 0) {
        return 1;
    }
    if (a->storage->data == b->storage->data &&
        a->storage->device.type == b->storage->device.type &&
        a->storage->device.index == b->storage->device.index) {
        return 1;
    }
    /* Device memory cannot be compared from here. */
    if (a->storage->device.type != WEFT_DEVICE_CPU || b->storage->device.type != WEFT_DEVICE_CPU) {
        return 0;
    }
    return memcmp(a->storage->data, b->storage->data, a->nbytes) == 0;
}
