/* Dense contiguous tensors with refcounted storage. */
#ifndef WEFT_TENSOR_H
#define WEFT_TENSOR_H

#include <weft/api.h>

#include <stddef.h>
#include <stdint.h>

#include <weft/status.h>

#ifdef __cplusplus
extern "C" {
#endif

#define WEFT_MAX_DIMS 8

/* Values cross the wire (proto DType): never renumber. */
typedef enum {
    WEFT_F32 = 0,
    WEFT_F64 = 1,
    WEFT_F16 = 2,
    WEFT_BF16 = 3,
    WEFT_I8 = 4,
    WEFT_I32 = 5,
    WEFT_I64 = 6,
    WEFT_U8 = 7,
    WEFT_BOOL = 8,
    WEFT_DTYPE_COUNT = 9,
} weft_dtype_t;

typedef enum {
    WEFT_DEVICE_CPU = 0,
    WEFT_DEVICE_CUDA = 1,
} weft_device_type_t;

typedef struct {
    weft_device_type_t type;
    int index;
} weft_device_t;

#define WEFT_CPU ((weft_device_t){WEFT_DEVICE_CPU, 0})

typedef struct weft_tensor weft_tensor_t;

/** Called once when the last tensor referencing a wrapped buffer is released. */
typedef void (*weft_release_cb_t)(void *data, void *arg);

/** Size in bytes of one element (bool: 1); 0 for an invalid dtype. */
WEFT_API size_t weft_dtype_size(weft_dtype_t dtype);
/** "f32", "bf16", ...; "invalid" for an invalid dtype. */
WEFT_API const char *weft_dtype_name(weft_dtype_t dtype);
WEFT_API int weft_dtype_valid(int dtype);

/**
 * Creates a zero-filled CPU tensor.
 * @param[in] ndim 0..WEFT_MAX_DIMS; @param[in] shape ndim sizes, each >= 0.
 * @param[out] t_p the tensor; caller releases with weft_tensor_release.
 * @return WEFT_ERR_INVALID_ARG (bad dtype/shape), WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_tensor_create(weft_dtype_t dtype, int ndim, const int64_t *shape,
                                          weft_tensor_t **t_p);
/** As weft_tensor_create, but the contents are uninitialised. */
WEFT_API weft_status_t weft_tensor_empty(weft_dtype_t dtype, int ndim, const int64_t *shape,
                                         weft_tensor_t **t_p);
/**
 * Wraps a caller's buffer without copying. The buffer is borrowed: it must stay
 * valid until @p release is called (once, when the last reference goes);
 * @p release may be NULL. @p nbytes must equal numel * dtype size.
 */
WEFT_API weft_status_t weft_tensor_wrap(weft_dtype_t dtype, int ndim, const int64_t *shape,
                                        void *data, size_t nbytes, weft_device_t device,
                                        weft_release_cb_t release, void *release_arg,
                                        weft_tensor_t **t_p);
/**
 * A new tensor of another shape sharing @p t's storage (same numel).
 * @return WEFT_ERR_SHAPE when the element counts differ.
 */
WEFT_API weft_status_t weft_tensor_view(weft_tensor_t *t, int ndim, const int64_t *shape,
                                        weft_tensor_t **t_p);
/** A deep copy into fresh CPU storage. */
WEFT_API weft_status_t weft_tensor_clone(const weft_tensor_t *t, weft_tensor_t **t_p);

/** Adds a reference; returns @p t. Thread-safe. */
WEFT_API weft_tensor_t *weft_tensor_retain(weft_tensor_t *t);
/** Drops a reference; the last one frees the tensor (and its storage's last). NULL is a no-op. */
WEFT_API void weft_tensor_release(weft_tensor_t *t);

WEFT_API void *weft_tensor_data(const weft_tensor_t *t);
WEFT_API size_t weft_tensor_nbytes(const weft_tensor_t *t);
WEFT_API int64_t weft_tensor_numel(const weft_tensor_t *t);
WEFT_API int weft_tensor_ndim(const weft_tensor_t *t);
/** Borrowed array of ndim sizes, valid while @p t lives. */
WEFT_API const int64_t *weft_tensor_shape(const weft_tensor_t *t);
WEFT_API weft_dtype_t weft_tensor_dtype(const weft_tensor_t *t);
WEFT_API weft_device_t weft_tensor_device(const weft_tensor_t *t);
/** True when both have the same dtype, shape and bytes. */
WEFT_API int weft_tensor_equal(const weft_tensor_t *a, const weft_tensor_t *b);

/**
 * Frees the blocks (>= 128 KiB) kept for reuse by released tensors. The cache holds
 * at most WEFT_TENSOR_CACHE_MB MiB (default 1024; 0 disables it). Thread-safe.
 */
WEFT_API void weft_tensor_cache_clear(void);

/** Product of the sizes, or -1 on overflow or a negative size. */
WEFT_API int64_t weft_shape_numel(int ndim, const int64_t *shape);

#ifdef __cplusplus
}
#endif
#endif
