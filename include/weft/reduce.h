/*
 * Element-wise reduction kernels (the arithmetic of the collectives) and f16/bf16 conversions.
 * On x86-64 CPUs with F16C (f16) or AVX2 (bf16) the half-precision kernels use vector paths,
 * chosen at first use; they give the same results (NaN payloads aside). WEFT_REDUCE_SIMD=0 in the
 * environment keeps the portable kernels.
 */
#ifndef WEFT_REDUCE_H
#define WEFT_REDUCE_H

#include <weft/api.h>

#include <stddef.h>
#include <stdint.h>

#include <weft/status.h>
#include <weft/tensor.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Values cross the wire: never renumber. */
typedef enum {
    WEFT_SUM = 0,
    WEFT_AVG = 1,
    WEFT_PRODUCT = 2,
    WEFT_MIN = 3,
    WEFT_MAX = 4,
    WEFT_BAND = 5,
    WEFT_BOR = 6,
    WEFT_BXOR = 7,
    WEFT_REDUCE_OP_COUNT = 8,
} weft_reduce_op_t;

/** "sum", "avg", "product", "min", "max", "band", "bor", "bxor"; "invalid" for another value.
 * Thread-safe. */
WEFT_API const char *weft_reduce_op_name(weft_reduce_op_t op);

/**
 * Whether @p op applies to @p dtype. Reductions take f32 f64 f16 bf16 i8 i32 i64 u8; bool is
 * refused. Bitwise ops (band, bor, bxor) apply to the integer dtypes only. Records the reason for
 * weft_last_error() on failure ("reduce: bxor applies to integer dtypes, not f32"). Thread-safe.
 * @return WEFT_OK; WEFT_ERR_INVALID_ARG for an op or dtype outside its enum; WEFT_ERR_DTYPE for
 *         bool, or a bitwise op on a floating dtype.
 */
WEFT_API weft_status_t weft_reduce_check(weft_reduce_op_t op, weft_dtype_t dtype);

/**
 * dst[i] = dst[i] (op) src[i] for i < n. AVG reduces as SUM does: scale once afterwards with
 * weft_reduce_finish. Integer sum and product wrap around; float min/max give NaN when either
 * operand is NaN; f16/bf16 compute each element in f32 and round back to nearest even, so a
 * reduction of several f16/bf16 contributions rounds at every step: to round once (AVG above
 * all), accumulate in f32 instead (weft_reduce_widen, the f32 kernels, weft_reduce_narrow), as
 * the collectives do.
 * The pair must pass weft_reduce_check; a pair it refuses leaves @p dst unchanged.
 * @param[in,out] dst n elements; borrowed for the call.
 * @param[in] src n elements; borrowed for the call. It may be @p dst itself but may not overlap
 *            it otherwise.
 * Thread-safe (on buffers no other thread writes).
 */
WEFT_API void weft_reduce_into(void *dst, const void *src, size_t n, weft_dtype_t dtype,
                               weft_reduce_op_t op);

/**
 * dst[i] = a[i] (op) b[i] for i < n, out of place: reduces straight from a received buffer into
 * the output. Same arithmetic and preconditions as weft_reduce_into.
 * @param[out] dst n elements; borrowed for the call. It may be @p a or @p b (or both) but may
 *             not overlap either otherwise.
 * @param[in] a, b n elements each; borrowed for the call; they may be the same buffer.
 * Thread-safe (on buffers no other thread writes).
 */
WEFT_API void weft_reduce_to(void *dst, const void *a, const void *b, size_t n, weft_dtype_t dtype,
                             weft_reduce_op_t op);

/**
 * Completes a reduction of @p count contributions. AVG divides every element by @p count: floats
 * by IEEE division correctly rounded to the dtype, integers truncating toward zero as C does.
 * Other ops, and count <= 1, leave @p dst unchanged.
 * @param[in,out] dst n elements; borrowed for the call.
 * @param[in] count number of contributions, >= 1.
 * Thread-safe (on buffers no other thread writes).
 */
WEFT_API void weft_reduce_finish(void *dst, size_t n, weft_dtype_t dtype, weft_reduce_op_t op,
                                 int count);

/**
 * Widens @p n f16 or bf16 elements to f32, exactly: the accumulator of a reduction that rounds
 * once (see weft_reduce_narrow). f32 elements are copied. Other dtypes leave @p dst unchanged.
 * @param[out] dst n floats; borrowed for the call; may not overlap @p src.
 * @param[in] src n elements of @p dtype; borrowed for the call.
 * Thread-safe (on buffers no other thread writes).
 */
WEFT_API void weft_reduce_widen(float *dst, const void *src, size_t n, weft_dtype_t dtype);

/**
 * Completes a reduction of @p count contributions accumulated in f32 and writes it as @p dtype
 * (f16 or bf16) with a single rounding to nearest even: AVG rounds the exact quotient
 * acc[i] / count (never a rounded f32 quotient), other ops the f32 value. f32 is finished as
 * weft_reduce_finish does and copied. Other dtypes leave @p dst unchanged.
 * @param[out] dst n elements of @p dtype; borrowed for the call; may not overlap @p acc
 *             unless it is @p acc itself (f32).
 * @param[in] acc n floats; borrowed for the call.
 * @param[in] count number of contributions, >= 1.
 * Thread-safe (on buffers no other thread writes).
 */
WEFT_API void weft_reduce_narrow(void *dst, const float *acc, size_t n, weft_dtype_t dtype,
                                 weft_reduce_op_t op, int count);

/*
 * Reduce ops by device: the collectives (and, later, the gradient reducer) reduce a tensor with
 * the kernels of its device type, looked up with weft_reduce_ops_for. The CPU's entry wraps the
 * kernels above; another device type (CUDA) has one once the build that has its kernels
 * registers it; until then an operation that reduces tensors of that device fails with
 * WEFT_ERR_UNSUPPORTED.
 */

/**
 * The reduction kernels of one device type. Each has the arithmetic, preconditions and
 * aliasing rules of the CPU function of the same name above, and gets the device of the tensor
 * being reduced (@p device: its type is the entry's; its index says which device). The
 * buffers are the tensor's memory and buffers of the caller's (received pieces, f32
 * accumulators), which the collectives keep in host memory: until they stage device memory, an
 * entry must accept host pointers and its device's memory must be addressable by the host.
 * A kernel must not block on other weft work; it may run on a transport thread.
 */
typedef struct {
    /** Names the entry in errors and logs ("cpu"). */
    const char *name;
    void (*reduce_into)(weft_device_t device, void *dst, const void *src, size_t n,
                        weft_dtype_t dtype, weft_reduce_op_t op);
    void (*reduce_to)(weft_device_t device, void *dst, const void *a, const void *b, size_t n,
                      weft_dtype_t dtype, weft_reduce_op_t op);
    void (*finish)(weft_device_t device, void *dst, size_t n, weft_dtype_t dtype,
                   weft_reduce_op_t op, int count);
    void (*widen)(weft_device_t device, float *dst, const void *src, size_t n, weft_dtype_t dtype);
    void (*narrow)(weft_device_t device, void *dst, const float *acc, size_t n, weft_dtype_t dtype,
                   weft_reduce_op_t op, int count);
} weft_reduce_ops_t;

/**
 * Registers @p ops as the reduction kernels of tensors on devices of @p type, replacing the
 * previous entry; NULL removes it. The CPU's entry is weft's own and cannot be replaced.
 * Register before issuing operations on such tensors: an operation looks its entry up when it
 * is issued.
 * @param[in] ops borrowed: must stay valid (and unchanged) until it is replaced or removed and
 *            no operation issued before uses it any more; usually a static const.
 * Thread-safe.
 * @return WEFT_ERR_INVALID_ARG (a type outside weft_device_type_t, WEFT_DEVICE_CPU, an entry
 *         without a name or a kernel).
 */
WEFT_API weft_status_t weft_reduce_ops_register(weft_device_type_t type,
                                                const weft_reduce_ops_t *ops);

/**
 * The reduction kernels for tensors on @p device. Records the reason for weft_last_error() on
 * failure ("reduce: no reduction kernels for cuda tensors (cuda:0): ..."). Thread-safe.
 * @param[out] ops_p the entry (borrowed, see weft_reduce_ops_register); set only on success.
 * @return WEFT_ERR_INVALID_ARG (a type outside weft_device_type_t), WEFT_ERR_UNSUPPORTED (no
 *         entry for that device type).
 */
WEFT_API weft_status_t weft_reduce_ops_for(weft_device_t device, const weft_reduce_ops_t **ops_p);

/** IEEE binary16 bits to f32 (exact: subnormals, infinities; NaN stays NaN). Thread-safe. */
WEFT_API float weft_f16_to_f32(uint16_t h);
/** f32 to IEEE binary16 bits, rounding to nearest even: overflow gives inf, small values
 * subnormals or zero, NaN a quiet NaN of the same sign. Thread-safe. */
WEFT_API uint16_t weft_f32_to_f16(float f);
/** bfloat16 bits to f32 (exact). Thread-safe. */
WEFT_API float weft_bf16_to_f32(uint16_t h);
/** f32 to bfloat16 bits, rounding to nearest even: overflow gives inf, NaN a quiet NaN with the
 * same sign and leading payload bits. Thread-safe. */
WEFT_API uint16_t weft_f32_to_bf16(float f);

#ifdef __cplusplus
}
#endif
#endif
