/*
 * CUDA tensors and GPU gradient reduction. These functions exist in builds with the `cuda`
 * feature (meson -Dcuda=enabled, or auto where nvcc is found; docs/cuda.md).
 *
 * Device tensors are weft tensors whose device is {WEFT_DEVICE_CUDA, index} and whose data is
 * device memory (cudaMalloc): weft_tensor_data gives the device pointer, which the host must not
 * dereference. Pinned tensors are CPU tensors in page-locked host memory (cudaHostAlloc), which
 * the GPU copies at full speed.
 *
 * Collectives: after weft_cuda_init, weft_coll_all_reduce and weft_coll_broadcast take device
 * tensors. Between ranks of one host whose devices can share memory (CUDA IPC; same or peer
 * devices), for tensors of WEFT_CUDA_IPC_MIN_KB (256 KiB) or more, the ranks copy their tensors
 * into device buffers the others map, each reduces its share of the elements from every member's
 * buffer on its device, in member order, and gathers the others' shares: no host memory, the
 * summation on the GPU; that path blocks the caller. Elsewhere (other hosts, smaller tensors,
 * IPC off or refused) the tensor is staged through pinned host memory in WEFT_CUDA_CHUNKS (8)
 * chunks from 1 MiB: every chunk's device-to-host copy is queued at the call, each chunk's host
 * collective starts when its copy is done and its host-to-device copy when it completes, so
 * copies and transport overlap. Every member gets the same bits either way; f16/bf16 accumulate
 * in f32 and round once, as on the CPU. Other collectives of device tensors fail with
 * WEFT_ERR_UNSUPPORTED: copy to the host first. docs/cuda.md says how streams are ordered.
 *
 * Processes: CUDA does not survive fork(); a process that forks ranks must not call CUDA (any of
 * these functions) before it forks.
 *
 * Statuses: WEFT_ERR_NO_DEVICE (no device, no driver, or an index past the count),
 * WEFT_ERR_CUDA (any other CUDA failure; the text names the call, the file, the line and CUDA's
 * own message), WEFT_ERR_INVALID_ARG, WEFT_ERR_DTYPE, WEFT_ERR_SHAPE, WEFT_ERR_NO_MEMORY.
 */
#ifndef WEFT_CUDA_H
#define WEFT_CUDA_H

#include <weft/api.h>

/* Layering (docs/architecture.md): only cuda/ and programs may include this. */
#if defined(WEFT_BUILDING) && !defined(WEFT_SEES_CUDA)
#error "weft/cuda.h is above the module being built: dependencies point downward only"
#endif

#include <stddef.h>
#include <stdint.h>

#include <weft/reduce.h>
#include <weft/status.h>
#include <weft/tensor.h>

#ifdef __cplusplus
extern "C" {
#endif

/**
 * The number of CUDA devices this process sees. Thread-safe.
 * @return WEFT_ERR_NO_DEVICE (none, or no driver; *n_p is set to 0), WEFT_ERR_CUDA.
 */
WEFT_API weft_status_t weft_cuda_device_count(int *n_p);

/**
 * Registers the device collectives (weft_coll_device_register) so that all_reduce and broadcast
 * take device tensors. Idempotent; thread-safe.
 * @return WEFT_ERR_NO_DEVICE when no device is present (nothing registered).
 */
WEFT_API weft_status_t weft_cuda_init(void);

/** An uninitialised tensor in the memory of device @p device. Thread-safe. */
WEFT_API weft_status_t weft_cuda_tensor_empty(weft_dtype_t dtype, int ndim, const int64_t *shape,
                                              int device, weft_tensor_t **t_p);
/** A zero-filled device tensor. Thread-safe. */
WEFT_API weft_status_t weft_cuda_tensor_zeros(weft_dtype_t dtype, int ndim, const int64_t *shape,
                                              int device, weft_tensor_t **t_p);
/**
 * An uninitialised CPU tensor in pinned (page-locked) host memory: the fast source and
 * destination of device copies. Thread-safe.
 * @return WEFT_ERR_NO_DEVICE without a device (pinning needs the driver).
 */
WEFT_API weft_status_t weft_cuda_pinned_empty(weft_dtype_t dtype, int ndim, const int64_t *shape,
                                              weft_tensor_t **t_p);

/**
 * Copies @p src into @p dst: any pair of CPU (pageable or pinned) and device tensors, the same
 * dtype and element count (shapes may differ). Returns when the copy is done. Thread-safe.
 * @return WEFT_ERR_DTYPE, WEFT_ERR_SHAPE (element counts), WEFT_ERR_CUDA.
 */
WEFT_API weft_status_t weft_cuda_copy(weft_tensor_t *dst, const weft_tensor_t *src);
/** A new device tensor on @p device with @p src's dtype, shape and values. Thread-safe. */
WEFT_API weft_status_t weft_cuda_to_device(const weft_tensor_t *src, int device,
                                           weft_tensor_t **t_p);
/** A new (pageable) CPU tensor with @p src's dtype, shape and values. Thread-safe. */
WEFT_API weft_status_t weft_cuda_to_host(const weft_tensor_t *src, weft_tensor_t **t_p);

/**
 * dst = dst (op) src element-wise on the device, with the arithmetic of weft_reduce_into (f16 and
 * bf16 computed in f32 and rounded to nearest even; AVG reduces as SUM). Both on one device, the
 * same dtype and element count. Returns when done. Thread-safe.
 * @return WEFT_ERR_DTYPE (bool, a bitwise op on floats), WEFT_ERR_SHAPE, WEFT_ERR_INVALID_ARG
 *         (a CPU tensor, two devices).
 */
WEFT_API weft_status_t weft_cuda_reduce_into(weft_tensor_t *dst, const weft_tensor_t *src,
                                             weft_reduce_op_t op);
/**
 * dst = reduction of @p n device tensors (same device, dtype and count) in their order, as an
 * all_reduce of @p n members does: f16/bf16 accumulate in f32 and round once, AVG divides by
 * @p n (the exact quotient rounded once). @p dst may be one of @p srcs. Returns when done.
 * Thread-safe.
 */
WEFT_API weft_status_t weft_cuda_reduce_many(weft_tensor_t *dst, weft_tensor_t *const *srcs, int n,
                                             weft_reduce_op_t op);
/** Multiplies a floating device tensor by @p factor on the device: an f64 tensor by @p factor, an
 * f32, f16 or bf16 one by @p factor rounded to f32, the product computed in f32 (f16/bf16
 * widened) and rounded to the element type. Returns when done. Thread-safe. */
WEFT_API weft_status_t weft_cuda_scale(weft_tensor_t *t, double factor);
/**
 * Packs @p n device tensors of one dtype and device into @p flat (their element counts summed,
 * in order) with one kernel launch: a bucket's flatten. Returns when done. Thread-safe.
 */
WEFT_API weft_status_t weft_cuda_flatten(weft_tensor_t *flat, weft_tensor_t *const *tensors,
                                         size_t n);
/** The inverse of weft_cuda_flatten: copies @p flat's consecutive parts into @p tensors. */
WEFT_API weft_status_t weft_cuda_unflatten(weft_tensor_t *const *tensors, size_t n,
                                           const weft_tensor_t *flat);

/** Counters of this process's device collectives (tests, benchmarks). Thread-safe. */
typedef struct {
    uint64_t ipc_ops;       /**< all_reduce/broadcast done through CUDA IPC */
    uint64_t staged_ops;    /**< ... staged through pinned host memory */
    uint64_t staged_chunks; /**< chunks the staged ones moved */
    uint64_t ipc_maps;      /**< peers' buffers mapped (cudaIpcOpenMemHandle) */
} weft_cuda_stats_t;
WEFT_API void weft_cuda_stats(weft_cuda_stats_t *s);

#ifdef __cplusplus
}
#endif
#endif
