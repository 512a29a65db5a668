/*
 * The device kernels: element-wise reductions for every reduce op and dtype, the multi-source
 * reduction of the IPC all_reduce, scaling, and batched copies (flatten/unflatten). Their
 * arithmetic is core/reduce.c's, element for element: f16/bf16 computed in f32 and rounded to
 * nearest even, integer sum and product wrapping, float min/max giving NaN when either operand
 * is, AVG quotients rounded once from the exact value.
 *
 * Loads and stores are 16 bytes wide (a pack of 16 / sizeof(T) elements) when every pointer is
 * 16-byte aligned, element by element otherwise and for the tail.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "internal.h"

namespace
{

constexpr int kThreads = 256;

/* Blocks for n units of work: enough to fill the device, grid-stride beyond. */
unsigned blocks_for(size_t n)
{
    size_t b = (n + kThreads - 1) / kThreads;
    return (unsigned)(b < 1 ? 1 : b > 4096 ? 4096 : b);
}

/* ---- element types: storage T, arithmetic in acc_t ------------------------------------------ */

template <typename T> struct elem {
    typedef T acc_t;
    __device__ static acc_t load(T x)
    {
        return x;
    }
    __device__ static T store(acc_t x)
    {
        return x;
    }
};
template <> struct elem<__half> {
    typedef float acc_t;
    __device__ static float load(__half x)
    {
        return __half2float(x);
    }
    __device__ static __half store(float x)
    {
        return __float2half_rn(x);
    }
};
template <> struct elem<__nv_bfloat16> {
    typedef float acc_t;
    __device__ static float load(__nv_bfloat16 x)
    {
        return __bfloat162float(x);
    }
    __device__ static __nv_bfloat16 store(float x)
    {
        return __float2bfloat16_rn(x);
    }
};

template <typename T> struct is_float_t {
    static constexpr bool value = false;
};
template <> struct is_float_t<float> {
    static constexpr bool value = true;
};
template <> struct is_float_t<double> {
    static constexpr bool value = true;
};
template <> struct is_float_t<__half> {
    static constexpr bool value = true;
};
template <> struct is_float_t<__nv_bfloat16> {
    static constexpr bool value = true;
};

/* Integer arithmetic wraps: done in the unsigned type of the same width. */
template <typename A> __device__ A wrap_add(A x, A y)
{
    if constexpr (sizeof(A) == 8) {
        return (A)((uint64_t)x + (uint64_t)y);
    } else {
        return (A)((uint32_t)x + (uint32_t)y);
    }
}
template <typename A> __device__ A wrap_mul(A x, A y)
{
    if constexpr (sizeof(A) == 8) {
        return (A)((uint64_t)x * (uint64_t)y);
    } else {
        return (A)((uint32_t)x * (uint32_t)y);
    }
}

/* ---- ops on acc_t ---------------------------------------------------------------------------- */

template <int OP, bool FLOAT> struct op_t;
template <bool FLOAT> struct op_t<WEFT_SUM, FLOAT> {
    template <typename A> __device__ static A apply(A x, A y)
    {
        if constexpr (FLOAT) {
            return x + y;
        } else {
            return wrap_add(x, y);
        }
    }
};
template <bool FLOAT> struct op_t<WEFT_PRODUCT, FLOAT> {
    template <typename A> __device__ static A apply(A x, A y)
    {
        if constexpr (FLOAT) {
            return x * y;
        } else {
            return wrap_mul(x, y);
        }
    }
};
template <bool FLOAT> struct op_t<WEFT_MIN, FLOAT> {
    /* (x < y || x is NaN) ? x : y, as OP_FMIN; integers as OP_MIN */
    template <typename A> __device__ static A apply(A x, A y)
    {
        return (x < y || x != x) ? x : y;
    }
};
template <bool FLOAT> struct op_t<WEFT_MAX, FLOAT> {
    template <typename A> __device__ static A apply(A x, A y)
    {
        return (x > y || x != x) ? x : y;
    }
};
template <bool FLOAT> struct op_t<WEFT_BAND, FLOAT> {
    template <typename A> __device__ static A apply(A x, A y)
    {
        return x & y;
    }
};
template <bool FLOAT> struct op_t<WEFT_BOR, FLOAT> {
    template <typename A> __device__ static A apply(A x, A y)
    {
        return x | y;
    }
};
template <bool FLOAT> struct op_t<WEFT_BXOR, FLOAT> {
    template <typename A> __device__ static A apply(A x, A y)
    {
        return x ^ y;
    }
};

/* One element of dst = a (op) b. f16/bf16 min and max pick an operand, bits and all, as the CPU
 * kernels do (the f32 round trip would keep them too, NaN payloads aside). */
template <typename T, int OP> __device__ T combine(T a, T b)
{
    typedef elem<T> E;
    typedef op_t<OP, is_float_t<T>::value> O;
    if constexpr (OP == WEFT_MIN) {
        typename E::acc_t fa = E::load(a), fb = E::load(b);
        return (fa < fb || fa != fa) ? a : b;
    } else if constexpr (OP == WEFT_MAX) {
        typename E::acc_t fa = E::load(a), fb = E::load(b);
        return (fa > fb || fa != fa) ? a : b;
    } else {
        return E::store(O::apply(E::load(a), E::load(b)));
    }
}

template <typename T, int V> struct alignas(16) pack_t {
    T v[V];
};

template <typename T, int OP>
__global__ void reduce_to_kernel(T *dst, const T *a, const T *b, size_t n, bool wide)
{
    constexpr int V = 16 / sizeof(T);
    typedef pack_t<T, V> P;
    size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t packs = wide ? n / V : 0;
    for (size_t i = tid; i < packs; i += stride) {
        P x = reinterpret_cast<const P *>(a)[i];
        P y = reinterpret_cast<const P *>(b)[i];
        P r;
#pragma unroll
        for (int k = 0; k < V; k++) {
            r.v[k] = combine<T, OP>(x.v[k], y.v[k]);
        }
        reinterpret_cast<P *>(dst)[i] = r;
    }
    for (size_t i = packs * V + tid; i < n; i += stride) {
        dst[i] = combine<T, OP>(a[i], b[i]);
    }
}

bool aligned16(const void *p)
{
    return ((uintptr_t)p & 15u) == 0;
}

template <typename T, int OP>
cudaError_t launch_reduce_to(cudaStream_t s, void *dst, const void *a, const void *b, size_t n)
{
    bool wide = aligned16(dst) && aligned16(a) && aligned16(b);
    size_t units = wide ? n / (16 / sizeof(T)) + 1 : n;
    reduce_to_kernel<T, OP>
        <<<blocks_for(units), kThreads, 0, s>>>((T *)dst, (const T *)a, (const T *)b, n, wide);
    return cudaGetLastError();
}

/* ---- the multi-source reduction (all_reduce through IPC) ------------------------------------ */

/* x rounded to f32 "to odd" (core/reduce.c's f32_round_odd): a later rounding to f16/bf16 then
 * rounds x itself, once. */
__device__ float f32_round_odd(double x)
{
    float f = __double2float_rz(x);
    double back = (double)f;
    if (back != x && x == x) {
        uint32_t u = __float_as_uint(f);
        if ((u & 1u) == 0) {
            u += 1; /* truncation toward zero: the odd neighbour lies away from zero */
        }
        f = __uint_as_float(u);
    }
    return f;
}

/* The accumulator's final value for storage type T with AVG over count members. */
template <typename T> __device__ T finish(typename elem<T>::acc_t acc, int count, bool avg)
{
    typedef elem<T> E;
    if (!avg || count <= 1) {
        return E::store(acc);
    }
    if constexpr (sizeof(T) == 2 && is_float_t<T>::value) {
        return E::store(f32_round_odd((double)acc / (double)count)); /* exact quotient, once */
    } else if constexpr (is_float_t<T>::value) {
        if constexpr (sizeof(T) == 4) {
            if (count <= (1 << 24)) {
                return acc / (float)count;
            }
            return (float)((double)acc / (double)count);
        } else {
            return acc / (double)count;
        }
    } else if constexpr (sizeof(T) == 8) {
        return (T)(acc / (int64_t)count);
    } else {
        return (T)((int32_t)acc / (int32_t)count);
    }
}

template <typename T, int OP>
__global__ void reduce_many_kernel(T *dst, weft_cuda__sources_t srcs, int nsrc, size_t n, bool avg)
{
    typedef elem<T> E;
    typedef op_t<OP, is_float_t<T>::value> O;
    size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = tid; i < n; i += stride) {
        typename E::acc_t acc = E::load(((const T *)srcs.p[0])[i]);
        for (int k = 1; k < nsrc; k++) {
            acc = O::apply(acc, E::load(((const T *)srcs.p[k])[i]));
        }
        dst[i] = finish<T>(acc, nsrc, avg);
    }
}

/* ---- scaling and batched copies ---------------------------------------------------------------
 */

template <typename T> __global__ void scale_kernel(T *p, size_t n, double factor)
{
    typedef elem<T> E;
    size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = tid; i < n; i += stride) {
        if constexpr (sizeof(T) == 8) {
            p[i] = (T)(p[i] * factor);
        } else {
            p[i] = E::store(E::load(p[i]) * (float)factor);
        }
    }
}

/* Copies n bytes in units of U (src and dst U-aligned), grid-stride over the block's threads. */
template <typename U>
__device__ void copy_units(unsigned char *dst, const unsigned char *src, size_t n, size_t tid,
                           size_t stride)
{
    size_t units = n / sizeof(U);
    for (size_t i = tid; i < units; i += stride) {
        reinterpret_cast<U *>(dst)[i] = reinterpret_cast<const U *>(src)[i];
    }
    for (size_t i = units * sizeof(U) + tid; i < n; i += stride) {
        dst[i] = src[i];
    }
}

/* blockIdx.y: the part. The widest moves both ends allow: a few head bytes bring them to the
 * largest alignment they share (16, 8, 4 or 2 bytes), the rest goes in units of it. */
__global__ void copy_parts_kernel(const weft_cuda__part_t *parts)
{
    weft_cuda__part_t part = parts[blockIdx.y];
    size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    const unsigned char *src = (const unsigned char *)part.src;
    unsigned char *dst = (unsigned char *)part.dst;
    uintptr_t x = ((uintptr_t)src ^ (uintptr_t)dst) | 16u;
    size_t align = (size_t)(x & (~x + 1)); /* the lowest set bit: 1, 2, 4, 8 or 16 */
    size_t head = (size_t)(-(uintptr_t)dst & (align - 1));
    if (head > part.nbytes) {
        head = part.nbytes;
    }
    for (size_t i = tid; i < head; i += stride) {
        dst[i] = src[i];
    }
    dst += head;
    src += head;
    size_t n = part.nbytes - head;
    switch (align) {
    case 16:
        copy_units<uint4>(dst, src, n, tid, stride);
        break;
    case 8:
        copy_units<unsigned long long>(dst, src, n, tid, stride);
        break;
    case 4:
        copy_units<unsigned int>(dst, src, n, tid, stride);
        break;
    case 2:
        copy_units<unsigned short>(dst, src, n, tid, stride);
        break;
    default:
        copy_units<unsigned char>(dst, src, n, tid, stride);
        break;
    }
}

/* ---- dispatch by (dtype, op) ------------------------------------------------------------------
 */

template <template <typename, int> class F, typename T> struct by_op_float {
    template <typename... Args> static cudaError_t run(weft_reduce_op_t op, Args... args)
    {
        switch (op) {
        case WEFT_SUM:
        case WEFT_AVG:
            return F<T, WEFT_SUM>::run(args...);
        case WEFT_PRODUCT:
            return F<T, WEFT_PRODUCT>::run(args...);
        case WEFT_MIN:
            return F<T, WEFT_MIN>::run(args...);
        case WEFT_MAX:
            return F<T, WEFT_MAX>::run(args...);
        default:
            return cudaErrorInvalidValue;
        }
    }
};
template <template <typename, int> class F, typename T> struct by_op_int {
    template <typename... Args> static cudaError_t run(weft_reduce_op_t op, Args... args)
    {
        switch (op) {
        case WEFT_BAND:
            return F<T, WEFT_BAND>::run(args...);
        case WEFT_BOR:
            return F<T, WEFT_BOR>::run(args...);
        case WEFT_BXOR:
            return F<T, WEFT_BXOR>::run(args...);
        default:
            return by_op_float<F, T>::run(op, args...);
        }
    }
};

template <template <typename, int> class F, typename... Args>
cudaError_t dispatch(weft_dtype_t dtype, weft_reduce_op_t op, Args... args)
{
    switch (dtype) {
    case WEFT_F32:
        return by_op_float<F, float>::run(op, args...);
    case WEFT_F64:
        return by_op_float<F, double>::run(op, args...);
    case WEFT_F16:
        return by_op_float<F, __half>::run(op, args...);
    case WEFT_BF16:
        return by_op_float<F, __nv_bfloat16>::run(op, args...);
    case WEFT_I8:
        return by_op_int<F, int8_t>::run(op, args...);
    case WEFT_U8:
        return by_op_int<F, uint8_t>::run(op, args...);
    case WEFT_I32:
        return by_op_int<F, int32_t>::run(op, args...);
    case WEFT_I64:
        return by_op_int<F, int64_t>::run(op, args...);
    default:
        return cudaErrorInvalidValue;
    }
}

template <typename T, int OP> struct reduce_to_fn {
    static cudaError_t run(cudaStream_t s, void *dst, const void *a, const void *b, size_t n)
    {
        return launch_reduce_to<T, OP>(s, dst, a, b, n);
    }
};

template <typename T, int OP> struct reduce_many_fn {
    static cudaError_t run(cudaStream_t s, void *dst, const weft_cuda__sources_t *srcs, int nsrc,
                           size_t n, bool avg)
    {
        reduce_many_kernel<T, OP><<<blocks_for(n), kThreads, 0, s>>>((T *)dst, *srcs, nsrc, n, avg);
        return cudaGetLastError();
    }
};

} // namespace

extern "C" cudaError_t weft_cuda__reduce_to(cudaStream_t stream, void *dst, const void *a,
                                            const void *b, size_t n, weft_dtype_t dtype,
                                            weft_reduce_op_t op)
{
    (void)cudaGetLastError(); /* an earlier call's error is not this launch's */
    if (n == 0) {
        return cudaSuccess;
    }
    return dispatch<reduce_to_fn>(dtype, op, stream, dst, a, b, n);
}

extern "C" cudaError_t weft_cuda__reduce_many(cudaStream_t stream, void *dst,
                                              const weft_cuda__sources_t *srcs, int nsrc, size_t n,
                                              weft_dtype_t dtype, weft_reduce_op_t op)
{
    (void)cudaGetLastError(); /* an earlier call's error is not this launch's */
    if (n == 0) {
        return cudaSuccess;
    }
    if (nsrc < 1 || nsrc > WEFT_CUDA_MAX_SOURCES) {
        return cudaErrorInvalidValue;
    }
    return dispatch<reduce_many_fn>(dtype, op, stream, dst, srcs, nsrc, n, op == WEFT_AVG);
}

extern "C" cudaError_t weft_cuda__scale(cudaStream_t stream, void *p, size_t n, weft_dtype_t dtype,
                                        double factor)
{
    (void)cudaGetLastError(); /* an earlier call's error is not this launch's */
    if (n == 0) {
        return cudaSuccess;
    }
    switch (dtype) {
    case WEFT_F32:
        scale_kernel<float><<<blocks_for(n), kThreads, 0, stream>>>((float *)p, n, factor);
        break;
    case WEFT_F64:
        scale_kernel<double><<<blocks_for(n), kThreads, 0, stream>>>((double *)p, n, factor);
        break;
    case WEFT_F16:
        scale_kernel<__half><<<blocks_for(n), kThreads, 0, stream>>>((__half *)p, n, factor);
        break;
    case WEFT_BF16:
        scale_kernel<__nv_bfloat16>
            <<<blocks_for(n), kThreads, 0, stream>>>((__nv_bfloat16 *)p, n, factor);
        break;
    default:
        return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

extern "C" cudaError_t weft_cuda__copy_parts(cudaStream_t stream, const weft_cuda__part_t *parts,
                                             size_t n, size_t max_bytes)
{
    (void)cudaGetLastError(); /* an earlier call's error is not this launch's */
    /* Blocks per part: enough for the largest part to give each thread a few 16-byte moves
     * (a bucket of one large gradient fills the device), at least 1, at most 1024. */
    size_t bx = max_bytes / ((size_t)kThreads * 16 * 4);
    bx = bx < 1 ? 1 : bx > 1024 ? 1024 : bx;
    /* gridDim.y is at most 65535: the parts go in rows of that many launches. */
    for (size_t first = 0; first < n; first += 65535) {
        size_t rows = n - first < 65535 ? n - first : 65535;
        dim3 grid((unsigned)bx, (unsigned)rows);
        copy_parts_kernel<<<grid, kThreads, 0, stream>>>(parts + first);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) {
            return e;
        }
    }
    return cudaSuccess;
}
