/* CUDA devices, device and pinned tensors, copies, the device kernels' entry points. */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include <weft/collectives.h>
#include <weft/cuda.h>

#include "internal.h"

weft_status_t weft_cuda__fail(cudaError_t e, const char *what, const char *file, int line)
{
    /* No device, no driver, a driver too old for this runtime, or the driver's stub library:
     * nothing here can run on a GPU. */
    weft_status_t st = (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver ||
                        e == cudaErrorInvalidDevice || e == cudaErrorStubLibrary)
                           ? WEFT_ERR_NO_DEVICE
                       : e == cudaErrorMemoryAllocation ? WEFT_ERR_NO_MEMORY
                                                        : WEFT_ERR_CUDA;
    const char *base = strrchr(file, '/');
    (void)cudaGetLastError(); /* a non-sticky error must not fail the next call */
    return weft__set_error(st, "cuda: %s: %s: %s (%s:%d)", what, cudaGetErrorName(e),
                           cudaGetErrorString(e), base != NULL ? base + 1 : file, line);
}

weft_status_t weft_cuda_device_count(int *n_p)
{
    int n = 0;
    if (n_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "cuda: NULL count");
    }
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        *n_p = 0;
        return e != cudaSuccess ? weft_cuda__fail(e, "cudaGetDeviceCount", __FILE__, __LINE__)
                                : weft__set_error(WEFT_ERR_NO_DEVICE, "cuda: no CUDA device");
    }
    *n_p = n;
    return WEFT_OK;
}

weft_status_t weft_cuda__use(int device)
{
    int n;
    WEFT_CHECK(weft_cuda_device_count(&n));
    if (device < 0 || device >= n) {
        return weft__set_error(WEFT_ERR_NO_DEVICE, "cuda: no device %d (this process sees %d)",
                               device, n);
    }
    WEFT_CUDA_CHECK(cudaSetDevice(device));
    return WEFT_OK;
}

weft_status_t weft_cuda__device_of(const weft_tensor_t *t, const char *what, int *device_p)
{
    if (t == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "cuda: %s: NULL tensor", what);
    }
    weft_device_t d = weft_tensor_device(t);
    if (d.type != WEFT_DEVICE_CUDA) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "cuda: %s: a CPU tensor, not a device one",
                               what);
    }
    *device_p = d.index;
    return WEFT_OK;
}

static pthread_mutex_t init_mu = PTHREAD_MUTEX_INITIALIZER;

weft_status_t weft_cuda_init(void)
{
    int n;
    WEFT_CHECK(weft_cuda_device_count(&n));
    pthread_mutex_lock(&init_mu);
    weft_status_t st = weft_coll_device_register(WEFT_DEVICE_CUDA, &weft_cuda__coll_ops);
    pthread_mutex_unlock(&init_mu);
    return st;
}

/* ---- tensors --------------------------------------------------------------------------------- */

/* Frees device memory (a tensor's release). The device is made current on the releasing
 * thread: restoring another would create a context there (CUDA 12 and later). */
static void device_release(void *data, void *arg)
{
    if (cudaSetDevice((int)(intptr_t)arg) == cudaSuccess) {
        (void)cudaFree(data);
    }
}

static weft_status_t shape_bytes(weft_dtype_t dtype, int ndim, const int64_t *shape, size_t *n_p)
{
    if (!weft_dtype_valid((int)dtype) || ndim < 0 || (ndim > 0 && shape == NULL)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "cuda: invalid dtype or shape");
    }
    int64_t numel = weft_shape_numel(ndim, shape);
    if (numel < 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "cuda: invalid shape");
    }
    *n_p = (size_t)numel * weft_dtype_size(dtype);
    return WEFT_OK;
}

static weft_status_t device_tensor(weft_dtype_t dtype, int ndim, const int64_t *shape, int device,
                                   bool zero, weft_tensor_t **t_p)
{
    size_t nbytes;
    void *p = NULL;
    weft_status_t st;
    if (t_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "cuda: NULL output");
    }
    WEFT_CHECK(shape_bytes(dtype, ndim, shape, &nbytes));
    WEFT_CHECK(weft_cuda__use(device));
    /* cudaMalloc(0) gives NULL; a tensor wants an address. */
    WEFT_CUDA_CHECK(cudaMalloc(&p, nbytes > 0 ? nbytes : 1));
    if (zero) {
        /* asynchronous to the host: the tensor is ready when this returns */
        WEFT_CUDA_CHECK_GOTO(cudaMemset(p, 0, nbytes), st, err_free);
        WEFT_CUDA_CHECK_GOTO(cudaStreamSynchronize(0), st, err_free);
    }
    weft_device_t dev = {WEFT_DEVICE_CUDA, device};
    WEFT_CHECK_GOTO(weft_tensor_wrap(dtype, ndim, shape, p, nbytes, dev, device_release,
                                     (void *)(intptr_t)device, t_p),
                    st, err_free);
    return WEFT_OK;

err_free:
    (void)cudaFree(p);
    return st;
}

weft_status_t weft_cuda_tensor_empty(weft_dtype_t dtype, int ndim, const int64_t *shape, int device,
                                     weft_tensor_t **t_p)
{
    return device_tensor(dtype, ndim, shape, device, false, t_p);
}

weft_status_t weft_cuda_tensor_zeros(weft_dtype_t dtype, int ndim, const int64_t *shape, int device,
                                     weft_tensor_t **t_p)
{
    return device_tensor(dtype, ndim, shape, device, true, t_p);
}

/* Frees pinned memory with the device current when it was made (@p device; -1: none known):
 * on a thread with no device made current, the runtime would start a context on device 0. As
 * device_release, the thread is left on that device (restoring another would start a context
 * there); a thread already on it is not touched. */
static void free_host_on(void *data, int device)
{
    int cur = -1;
    if (device >= 0 && (cudaGetDevice(&cur) != cudaSuccess || cur != device)) {
        (void)cudaSetDevice(device);
    }
    (void)cudaFreeHost(data);
}

static void pinned_release(void *data, void *arg)
{
    free_host_on(data, (int)(intptr_t)arg - 1);
}

/* The device current on this thread, or -1. */
static int current_device(void)
{
    int d = -1;
    return cudaGetDevice(&d) == cudaSuccess ? d : -1;
}

weft_status_t weft_cuda_pinned_empty(weft_dtype_t dtype, int ndim, const int64_t *shape,
                                     weft_tensor_t **t_p)
{
    size_t nbytes;
    void *p = NULL;
    int n;
    weft_status_t st;
    if (t_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "cuda: NULL output");
    }
    WEFT_CHECK(shape_bytes(dtype, ndim, shape, &nbytes));
    WEFT_CHECK(weft_cuda_device_count(&n));
    int device = current_device();
    WEFT_CUDA_CHECK(cudaHostAlloc(&p, nbytes > 0 ? nbytes : 1, cudaHostAllocPortable));
    WEFT_CHECK_GOTO(weft_tensor_wrap(dtype, ndim, shape, p, nbytes, WEFT_CPU, pinned_release,
                                     (void *)(intptr_t)(device + 1), t_p),
                    st, err_free);
    return WEFT_OK;

err_free:
    free_host_on(p, device);
    return st;
}

/* ---- pinned staging buffers ------------------------------------------------------------------ */

/* Freed buffers are kept (pinning is slow: milliseconds per call), enough for the buckets a
 * DDP step has in flight. */
#define PINNED_KEEP 16
static pthread_mutex_t pinned_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
    void *p;
    size_t nbytes;
    int device;
} pinned_free[PINNED_KEEP];

weft_status_t weft_cuda__pinned_get(size_t nbytes, void **p_p, size_t *cap_p)
{
    pthread_mutex_lock(&pinned_mu);
    int best = -1;
    for (int i = 0; i < PINNED_KEEP; i++) {
        if (pinned_free[i].p != NULL && pinned_free[i].nbytes >= nbytes &&
            (best < 0 || pinned_free[i].nbytes < pinned_free[best].nbytes)) {
            best = i;
        }
    }
    if (best >= 0) {
        *p_p = pinned_free[best].p;
        *cap_p = pinned_free[best].nbytes;
        pinned_free[best].p = NULL;
        pthread_mutex_unlock(&pinned_mu);
        return WEFT_OK;
    }
    pthread_mutex_unlock(&pinned_mu);
    void *p = NULL;
    size_t cap = nbytes > 0 ? nbytes : 1;
    WEFT_CUDA_CHECK(cudaHostAlloc(&p, cap, cudaHostAllocPortable));
    *p_p = p;
    *cap_p = cap;
    return WEFT_OK;
}

void weft_cuda__pinned_put(void *p, size_t cap, int device)
{
    void *drop = p;
    int drop_device = device;
    pthread_mutex_lock(&pinned_mu);
    int slot = -1;
    for (int i = 0; i < PINNED_KEEP; i++) {
        if (pinned_free[i].p == NULL) {
            slot = i;
            break;
        }
        if (slot < 0 || pinned_free[i].nbytes < pinned_free[slot].nbytes) {
            slot = i; /* the smallest kept one makes room for a larger one */
        }
    }
    if (pinned_free[slot].p == NULL || pinned_free[slot].nbytes < cap) {
        drop = pinned_free[slot].p;
        drop_device = pinned_free[slot].device;
        pinned_free[slot].p = p;
        pinned_free[slot].nbytes = cap;
        pinned_free[slot].device = device;
    }
    pthread_mutex_unlock(&pinned_mu);
    if (drop != NULL) {
        free_host_on(drop, drop_device);
    }
}

/* ---- copies ---------------------------------------------------------------------------------- */

static weft_status_t same_elements(const weft_tensor_t *a, const weft_tensor_t *b, const char *what)
{
    if (a == NULL || b == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "cuda: %s: NULL tensor", what);
    }
    if (weft_tensor_dtype(a) != weft_tensor_dtype(b)) {
        return weft__set_error(WEFT_ERR_DTYPE, "cuda: %s: %s and %s", what,
                               weft_dtype_name(weft_tensor_dtype(a)),
                               weft_dtype_name(weft_tensor_dtype(b)));
    }
    if (weft_tensor_numel(a) != weft_tensor_numel(b)) {
        return weft__set_error(WEFT_ERR_SHAPE, "cuda: %s: %lld and %lld elements", what,
                               (long long)weft_tensor_numel(a), (long long)weft_tensor_numel(b));
    }
    return WEFT_OK;
}

weft_status_t weft_cuda_copy(weft_tensor_t *dst, const weft_tensor_t *src)
{
    WEFT_CHECK(same_elements(dst, src, "copy"));
    weft_device_t dd = weft_tensor_device(dst), sd = weft_tensor_device(src);
    int device = dd.type == WEFT_DEVICE_CUDA   ? dd.index
                 : sd.type == WEFT_DEVICE_CUDA ? sd.index
                                               : -1;
    size_t nbytes = weft_tensor_nbytes(src);
    if (device < 0) {
        memcpy(weft_tensor_data(dst), weft_tensor_data(src), nbytes);
        return WEFT_OK;
    }
    WEFT_CHECK(weft_cuda__use(device));
    /* Unified addressing: the runtime tells the direction from the pointers. */
    WEFT_CUDA_CHECK(
        cudaMemcpy(weft_tensor_data(dst), weft_tensor_data(src), nbytes, cudaMemcpyDefault));
    /* A copy from pageable memory returns once the bytes are staged, a device-to-device one at
     * once: the copy is done only after this. */
    WEFT_CUDA_CHECK(cudaStreamSynchronize(0));
    return WEFT_OK;
}

weft_status_t weft_cuda_to_device(const weft_tensor_t *src, int device, weft_tensor_t **t_p)
{
    weft_tensor_t *t;
    if (src == NULL || t_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "cuda: to_device: NULL argument");
    }
    WEFT_CHECK(weft_cuda_tensor_empty(weft_tensor_dtype(src), weft_tensor_ndim(src),
                                      weft_tensor_shape(src), device, &t));
    weft_status_t st = weft_cuda_copy(t, src);
    if (st != WEFT_OK) {
        weft_tensor_release(t);
        return st;
    }
    *t_p = t;
    return WEFT_OK;
}

weft_status_t weft_cuda_to_host(const weft_tensor_t *src, weft_tensor_t **t_p)
{
    weft_tensor_t *t;
    if (src == NULL || t_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "cuda: to_host: NULL argument");
    }
    WEFT_CHECK(weft_tensor_empty(weft_tensor_dtype(src), weft_tensor_ndim(src),
                                 weft_tensor_shape(src), &t));
    weft_status_t st = weft_cuda_copy(t, src);
    if (st != WEFT_OK) {
        weft_tensor_release(t);
        return st;
    }
    *t_p = t;
    return WEFT_OK;
}

/* ---- kernels --------------------------------------------------------------------------------- */

/* Both on one device, alike: the device made current. */
static weft_status_t pair_on_device(const weft_tensor_t *a, const weft_tensor_t *b,
                                    const char *what)
{
    int da, db;
    WEFT_CHECK(same_elements(a, b, what));
    WEFT_CHECK(weft_cuda__device_of(a, what, &da));
    WEFT_CHECK(weft_cuda__device_of(b, what, &db));
    if (da != db) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "cuda: %s: tensors on devices %d and %d", what,
                               da, db);
    }
    return weft_cuda__use(da);
}

weft_status_t weft_cuda_reduce_into(weft_tensor_t *dst, const weft_tensor_t *src,
                                    weft_reduce_op_t op)
{
    WEFT_CHECK(pair_on_device(dst, src, "reduce_into"));
    WEFT_CHECK(weft_reduce_check(op, weft_tensor_dtype(dst)));
    void *d = weft_tensor_data(dst);
    WEFT_CUDA_CHECK(weft_cuda__reduce_to(0, d, d, weft_tensor_data(src),
                                         (size_t)weft_tensor_numel(dst), weft_tensor_dtype(dst),
                                         op));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(0));
    return WEFT_OK;
}

weft_status_t weft_cuda_reduce_many(weft_tensor_t *dst, weft_tensor_t *const *srcs, int n,
                                    weft_reduce_op_t op)
{
    weft_cuda__sources_t s;
    if (srcs == NULL || n < 1 || n > WEFT_CUDA_MAX_SOURCES) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "cuda: reduce_many: %d sources (1 to %d)", n,
                               WEFT_CUDA_MAX_SOURCES);
    }
    for (int i = 0; i < n; i++) {
        WEFT_CHECK(pair_on_device(dst, srcs[i], "reduce_many"));
        s.p[i] = weft_tensor_data(srcs[i]);
    }
    WEFT_CHECK(weft_reduce_check(op, weft_tensor_dtype(dst)));
    WEFT_CUDA_CHECK(weft_cuda__reduce_many(0, weft_tensor_data(dst), &s, n,
                                           (size_t)weft_tensor_numel(dst), weft_tensor_dtype(dst),
                                           op));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(0));
    return WEFT_OK;
}

weft_status_t weft_cuda_scale(weft_tensor_t *t, double factor)
{
    int device;
    WEFT_CHECK(weft_cuda__device_of(t, "scale", &device));
    weft_dtype_t dt = weft_tensor_dtype(t);
    if (dt != WEFT_F32 && dt != WEFT_F64 && dt != WEFT_F16 && dt != WEFT_BF16) {
        return weft__set_error(WEFT_ERR_DTYPE, "cuda: scale: %s is not a floating dtype",
                               weft_dtype_name(dt));
    }
    WEFT_CHECK(weft_cuda__use(device));
    WEFT_CUDA_CHECK(
        weft_cuda__scale(0, weft_tensor_data(t), (size_t)weft_tensor_numel(t), dt, factor));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(0));
    return WEFT_OK;
}

/* flatten (to_flat) or unflatten: the parts' table goes to the device, one launch copies all. */
static weft_status_t move_parts(weft_tensor_t *flat, weft_tensor_t *const *ts, size_t n,
                                bool to_flat, const char *what)
{
    int device;
    weft_status_t st = WEFT_OK;
    weft_cuda__part_t *parts = NULL, *dparts = NULL;
    if (ts == NULL && n > 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "cuda: %s: NULL tensor list", what);
    }
    WEFT_CHECK(weft_cuda__device_of(flat, what, &device));
    weft_dtype_t dt = weft_tensor_dtype(flat);
    int64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        int d;
        WEFT_CHECK(weft_cuda__device_of(ts[i], what, &d));
        if (d != device || weft_tensor_dtype(ts[i]) != dt) {
            return weft__set_error(WEFT_ERR_INVALID_ARG,
                                   "cuda: %s: tensor %zu is %s on device %d, the flat one %s on "
                                   "device %d",
                                   what, i, weft_dtype_name(weft_tensor_dtype(ts[i])), d,
                                   weft_dtype_name(dt), device);
        }
        total += weft_tensor_numel(ts[i]);
    }
    if (total != weft_tensor_numel(flat)) {
        return weft__set_error(WEFT_ERR_SHAPE,
                               "cuda: %s: the tensors have %lld elements, the "
                               "flat one %lld",
                               what, (long long)total, (long long)weft_tensor_numel(flat));
    }
    if (n == 0) {
        return WEFT_OK;
    }
    WEFT_CHECK(weft_cuda__use(device));
    parts = weft_calloc(n, sizeof(*parts));
    if (parts == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "cuda: %s: no memory", what);
    }
    size_t off = 0, max_bytes = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char *f = (unsigned char *)weft_tensor_data(flat) + off;
        size_t nb = weft_tensor_nbytes(ts[i]);
        max_bytes = nb > max_bytes ? nb : max_bytes;
        parts[i].src = to_flat ? weft_tensor_data(ts[i]) : f;
        parts[i].dst = to_flat ? (void *)f : weft_tensor_data(ts[i]);
        parts[i].nbytes = nb;
        off += nb;
    }
    WEFT_CUDA_CHECK_GOTO(cudaMalloc((void **)&dparts, n * sizeof(*parts)), st, out);
    WEFT_CUDA_CHECK_GOTO(cudaMemcpy(dparts, parts, n * sizeof(*parts), cudaMemcpyHostToDevice), st,
                         out);
    WEFT_CUDA_CHECK_GOTO(weft_cuda__copy_parts(0, dparts, n, max_bytes), st, out);
    WEFT_CUDA_CHECK_GOTO(cudaStreamSynchronize(0), st, out);
out:
    if (dparts != NULL) {
        (void)cudaFree(dparts);
    }
    weft_free(parts);
    return st;
}

weft_status_t weft_cuda_flatten(weft_tensor_t *flat, weft_tensor_t *const *tensors, size_t n)
{
    return move_parts(flat, tensors, n, true, "flatten");
}

weft_status_t weft_cuda_unflatten(weft_tensor_t *const *tensors, size_t n,
                                  const weft_tensor_t *flat)
{
    return move_parts((weft_tensor_t *)flat, tensors, n, false, "unflatten");
}
