/* cuda module internals: the kernels' launchers (kernels.cu, C linkage) and the checks.
 * Not installed. Included by the C files (gcc) and by kernels.cu (nvcc). */
#ifndef WEFT_CUDA_INTERNAL_H
#define WEFT_CUDA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include <weft/reduce.h>
#include <weft/tensor.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The most buffers one kernel reduces (members of an all_reduce through CUDA IPC). */
#define WEFT_CUDA_MAX_SOURCES 16

/* A staged tensor of at least this many bytes goes in WEFT_CUDA_CHUNKS chunks, a smaller one in
 * one. */
#define WEFT_CUDA_SPLIT_MIN ((size_t)1 << 20)

/* One part of a batched copy (flatten/unflatten): nbytes from src to dst, device memory. */
typedef struct {
    const void *src;
    void *dst;
    size_t nbytes;
} weft_cuda__part_t;

/* The sources of weft_cuda__reduce_many, passed by value to the kernel. */
typedef struct {
    const void *p[WEFT_CUDA_MAX_SOURCES];
} weft_cuda__sources_t;

/* Launchers: queue the kernel on @p stream and return cudaGetLastError() of the launch. The
 * (dtype, op) pair has passed weft_reduce_check; n == 0 launches nothing. */

/* dst = a (op) b element-wise (dst may be a or b). */
cudaError_t weft_cuda__reduce_to(cudaStream_t stream, void *dst, const void *a, const void *b,
                                 size_t n, weft_dtype_t dtype, weft_reduce_op_t op);
/* dst = srcs[0] (op) srcs[1] ... (op) srcs[nsrc-1], accumulated as the collectives do (f16/bf16
 * in f32, rounded once; AVG divided by @p nsrc, the exact quotient rounded once). dst may be one
 * of the sources. 1 <= nsrc <= WEFT_CUDA_MAX_SOURCES. */
cudaError_t weft_cuda__reduce_many(cudaStream_t stream, void *dst, const weft_cuda__sources_t *srcs,
                                   int nsrc, size_t n, weft_dtype_t dtype, weft_reduce_op_t op);
/* p[i] *= factor for a floating dtype (f16/bf16 in f32, one rounding; f32 in f32). */
cudaError_t weft_cuda__scale(cudaStream_t stream, void *p, size_t n, weft_dtype_t dtype,
                             double factor);
/* The parts' copies, one block row per part (@p parts: device memory, n entries). */
/* @p max_bytes: the largest part's bytes (sizes the grid). */
cudaError_t weft_cuda__copy_parts(cudaStream_t stream, const weft_cuda__part_t *parts, size_t n,
                                  size_t max_bytes);

#ifdef __cplusplus
}
#endif

#ifndef __CUDACC__
#include <weft/collectives.h>

#include "../core/internal.h"

/* The text CUDA gives for @p e, and the weft status it converts to: WEFT_ERR_NO_DEVICE for the
 * absence of a device or driver, WEFT_ERR_CUDA otherwise. Records "cuda: <what>: <CUDA's name>:
 * <CUDA's text> (<file>:<line>)" for weft_last_error() and clears CUDA's last error. */
weft_status_t weft_cuda__fail(cudaError_t e, const char *what, const char *file, int line);

/* Converts a CUDA error at the boundary (STYLE.md 5): returns the weft status. */
#define WEFT_CUDA_CHECK(call)                                                                      \
    do {                                                                                           \
        cudaError_t e__ = (call);                                                                  \
        if (e__ != cudaSuccess) {                                                                  \
            return weft_cuda__fail(e__, #call, __FILE__, __LINE__);                                \
        }                                                                                          \
    } while (0)
/* ... or sets @p st and jumps to @p label. */
#define WEFT_CUDA_CHECK_GOTO(call, st, label)                                                      \
    do {                                                                                           \
        cudaError_t e__ = (call);                                                                  \
        if (e__ != cudaSuccess) {                                                                  \
            (st) = weft_cuda__fail(e__, #call, __FILE__, __LINE__);                                \
            goto label;                                                                            \
        }                                                                                          \
    } while (0)

/* Makes @p device current on this thread (after checking the index). weft's CUDA functions
 * leave their tensor's device current on the calling thread, as cudaSetDevice does: restoring
 * the previous one would create a context on it. */
weft_status_t weft_cuda__use(int device);
/* The device of a CUDA tensor, checked: WEFT_ERR_INVALID_ARG for a CPU tensor. */
weft_status_t weft_cuda__device_of(const weft_tensor_t *t, const char *what, int *device_p);

/* Pinned host buffers, kept for reuse (the staged collectives take one per operation): at
 * least @p nbytes, *cap_p its real size, given back with it. */
weft_status_t weft_cuda__pinned_get(size_t nbytes, void **p_p, size_t *cap_p);
/* @p device: the one current when it was got (freeing pinned memory on a thread with no
 * device made current would start a context on device 0). */
void weft_cuda__pinned_put(void *p, size_t cap, int device);

/* coll.c: the device collectives' entry, registered by weft_cuda_init. */
extern const weft_coll_device_ops_t weft_cuda__coll_ops;
#endif

#endif
