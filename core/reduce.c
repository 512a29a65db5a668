/* Element-wise reduction kernels for the collectives, f16/bf16 conversions, and the reduce ops
 * of each device type (the CPU's wrap these kernels). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define REDUCE_X86 1
#else
#define REDUCE_X86 0
#endif

/* ---- f16 / bf16 ------------------------------------------------------------------------------ */

/*
 * Branch-free conversions so that the kernel loops using them vectorise.
 * The f16 ones follow F. Giesen's "half_to_float" / "float_to_half_fast3_rtne".
 */

static inline float as_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t as_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* c ? a : b for c in {0, 1}, as masks: GCC turns ternaries here into branches, which stop the
 * vectoriser. */
static inline uint32_t select_u32(uint32_t c, uint32_t a, uint32_t b)
{
    uint32_t m = 0u - c;
    return (a & m) | (b & ~m);
}

static inline float h2f(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t o = (uint32_t)(h & 0x7fffu) << 13; /* exponent and mantissa in f32 position */
    uint32_t exp = o & 0x0f800000u;
    uint32_t normal = o + ((uint32_t)(127 - 15) << 23);
    uint32_t inf_nan = normal + ((uint32_t)(128 - 16) << 23);
    /* subnormal: let the FPU normalise m * 2^-24 as (2^-14 + m * 2^-24) - 2^-14 */
    uint32_t sub = as_bits(as_float(normal + (1u << 23)) - as_float(113u << 23));

    o = select_u32(exp == 0x0f800000u, inf_nan, select_u32(exp == 0, sub, normal));
    return as_float(o | sign);
}

static inline uint16_t f2h(float f)
{
    uint32_t u = as_bits(f);
    uint32_t sign = u & 0x80000000u;
    uint32_t denorm_magic = ((127 - 15) + (23 - 10) + 1) << 23; /* 0.5f: ulp 2^-24 */

    u ^= sign;
    /* >= 65536: inf, or a quiet NaN */
    uint32_t big = select_u32(u > 0x7f800000u, 0x7e00u, 0x7c00u);
    /* < 2^-14: the FPU rounds to a multiple of 2^-24 (to nearest even) when adding 0.5 */
    uint32_t sub = as_bits(as_float(u) + as_float(denorm_magic)) - denorm_magic;
    /* normal: rebias, round to nearest even on bit 13; a carry may reach inf, as it should */
    uint32_t odd = (u >> 13) & 1u;
    uint32_t normal = (u - ((uint32_t)(127 - 15) << 23) + 0xfffu + odd) >> 13;
    uint32_t o = select_u32(u >= (143u << 23), big, select_u32(u < (113u << 23), sub, normal));

    return (uint16_t)(o | (sign >> 16));
}

static inline float bf2f(uint16_t h)
{
    return as_float((uint32_t)h << 16);
}

static inline uint16_t f2bf(float f)
{
    uint32_t u = as_bits(f);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u >> 16) | 0x40u;

    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

float weft_f16_to_f32(uint16_t h)
{
    return h2f(h);
}

uint16_t weft_f32_to_f16(float f)
{
    return f2h(f);
}

float weft_bf16_to_f32(uint16_t h)
{
    return bf2f(h);
}

uint16_t weft_f32_to_bf16(float f)
{
    return f2bf(f);
}

/* ---- element operations ---------------------------------------------------------------------- */

/* Integer sum and product run on the unsigned type of the same width: they wrap, as two's
 * complement does, without undefined behaviour. (uint8_t promotes to int: 255 * 255 fits.) */
#define OP_ADD(T, x, y) ((T)((x) + (y)))
#define OP_MUL(T, x, y) ((T)((x) * (y)))
#define OP_MIN(T, x, y) ((x) < (y) ? (x) : (y))
#define OP_MAX(T, x, y) ((x) > (y) ? (x) : (y))
#define OP_AND(T, x, y) ((T)((x) & (y)))
#define OP_OR(T, x, y)  ((T)((x) | (y)))
#define OP_XOR(T, x, y) ((T)((x) ^ (y)))
/* Float min/max: NaN when either is (as torch); ties give y. Shaped so that no ordered compare
 * is conditional, which lets GCC if-convert and vectorise them under -ftrapping-math. */
#define OP_FMIN(T, x, y) (((x) < (y) || (x) != (x)) ? (x) : (y))
#define OP_FMAX(T, x, y) (((x) > (y) || (x) != (x)) ? (x) : (y))

/* f16/bf16: each element to f32, one f32 operation, rounded back. Min/max pick an operand. */
#define HALF_OPS(P, TOF, FROMF)                                                                    \
    static inline uint16_t P##_elem_add(uint16_t x, uint16_t y)                                    \
    {                                                                                              \
        return FROMF(TOF(x) + TOF(y));                                                             \
    }                                                                                              \
    static inline uint16_t P##_elem_mul(uint16_t x, uint16_t y)                                    \
    {                                                                                              \
        return FROMF(TOF(x) * TOF(y));                                                             \
    }                                                                                              \
    static inline uint16_t P##_elem_min(uint16_t x, uint16_t y)                                    \
    {                                                                                              \
        float fx = TOF(x);                                                                         \
        float fy = TOF(y);                                                                         \
        return (fx < fy || fx != fx) ? x : y;                                                      \
    }                                                                                              \
    static inline uint16_t P##_elem_max(uint16_t x, uint16_t y)                                    \
    {                                                                                              \
        float fx = TOF(x);                                                                         \
        float fy = TOF(y);                                                                         \
        return (fx > fy || fx != fx) ? x : y;                                                      \
    }

HALF_OPS(f16, h2f, f2h)
HALF_OPS(bf16, bf2f, f2bf)

#define OP_F16_ADD(T, x, y)  f16_elem_add(x, y)
#define OP_F16_MUL(T, x, y)  f16_elem_mul(x, y)
#define OP_F16_MIN(T, x, y)  f16_elem_min(x, y)
#define OP_F16_MAX(T, x, y)  f16_elem_max(x, y)
#define OP_BF16_ADD(T, x, y) bf16_elem_add(x, y)
#define OP_BF16_MUL(T, x, y) bf16_elem_mul(x, y)
#define OP_BF16_MIN(T, x, y) bf16_elem_min(x, y)
#define OP_BF16_MAX(T, x, y) bf16_elem_max(x, y)

/* ---- kernels --------------------------------------------------------------------------------- */

/*
 * Each loop runs over whole blocks of BLOCK elements, then over the rest: GCC's -O2 vectoriser
 * (the "very cheap" cost model) only takes loops whose trip count is a known multiple of the
 * vector length, as the inner block loop's is. BLOCK covers 64-byte vectors of bytes.
 */
#define BLOCK ((size_t)64)

#define LOOP(n, body)                                                                              \
    do {                                                                                           \
        size_t nb_ = (n) / BLOCK;                                                                  \
        for (size_t b_ = 0; b_ < nb_; b_++) {                                                      \
            for (size_t i = b_ * BLOCK; i < b_ * BLOCK + BLOCK; i++) {                             \
                body;                                                                              \
            }                                                                                      \
        }                                                                                          \
        for (size_t i = nb_ * BLOCK; i < (n); i++) {                                               \
            body;                                                                                  \
        }                                                                                          \
    } while (0)

typedef void (*kernel_fn_t)(void *dst, const void *a, const void *b, size_t n);

/*
 * One kernel per (element type, op): four restrict-qualified loops, one per way dst can alias the
 * operands (none, a, b, both), and a dispatcher that picks one. Partial overlap is not allowed.
 */
#define KERNEL(name, T, OP)                                                                        \
    static void name##_to(T *restrict d, const T *restrict x, const T *restrict y, size_t n)       \
    {                                                                                              \
        LOOP(n, d[i] = OP(T, x[i], y[i]));                                                         \
    }                                                                                              \
    static void name##_acc(T *restrict d, const T *restrict y, size_t n)                           \
    {                                                                                              \
        LOOP(n, d[i] = OP(T, d[i], y[i]));                                                         \
    }                                                                                              \
    static void name##_racc(T *restrict d, const T *restrict x, size_t n)                          \
    {                                                                                              \
        LOOP(n, d[i] = OP(T, x[i], d[i]));                                                         \
    }                                                                                              \
    static void name##_self(T *restrict d, size_t n)                                               \
    {                                                                                              \
        LOOP(n, d[i] = OP(T, d[i], d[i]));                                                         \
    }                                                                                              \
    static void name(void *dst, const void *a, const void *b, size_t n)                            \
    {                                                                                              \
        if (dst != a && dst != b) {                                                                \
            name##_to(dst, a, b, n);                                                               \
        } else if (a == b) {                                                                       \
            name##_self(dst, n);                                                                   \
        } else if (dst == a) {                                                                     \
            name##_acc(dst, b, n);                                                                 \
        } else {                                                                                   \
            name##_racc(dst, a, n);                                                                \
        }                                                                                          \
    }

KERNEL(f32_sum, float, OP_ADD)
KERNEL(f32_prod, float, OP_MUL)
KERNEL(f32_min, float, OP_FMIN)
KERNEL(f32_max, float, OP_FMAX)
KERNEL(f64_sum, double, OP_ADD)
KERNEL(f64_prod, double, OP_MUL)
KERNEL(f64_min, double, OP_FMIN)
KERNEL(f64_max, double, OP_FMAX)
KERNEL(f16_sum, uint16_t, OP_F16_ADD)
KERNEL(f16_prod, uint16_t, OP_F16_MUL)
KERNEL(f16_min, uint16_t, OP_F16_MIN)
KERNEL(f16_max, uint16_t, OP_F16_MAX)
KERNEL(bf16_sum, uint16_t, OP_BF16_ADD)
KERNEL(bf16_prod, uint16_t, OP_BF16_MUL)
KERNEL(bf16_min, uint16_t, OP_BF16_MIN)
KERNEL(bf16_max, uint16_t, OP_BF16_MAX)
/* sum, product and bitwise: i8 and u8 share the u8 kernels, i32 and i64 the unsigned ones */
KERNEL(u8_sum, uint8_t, OP_ADD)
KERNEL(u8_prod, uint8_t, OP_MUL)
KERNEL(u8_and, uint8_t, OP_AND)
KERNEL(u8_or, uint8_t, OP_OR)
KERNEL(u8_xor, uint8_t, OP_XOR)
KERNEL(u32_sum, uint32_t, OP_ADD)
KERNEL(u32_prod, uint32_t, OP_MUL)
KERNEL(u32_and, uint32_t, OP_AND)
KERNEL(u32_or, uint32_t, OP_OR)
KERNEL(u32_xor, uint32_t, OP_XOR)
KERNEL(u64_sum, uint64_t, OP_ADD)
KERNEL(u64_prod, uint64_t, OP_MUL)
KERNEL(u64_and, uint64_t, OP_AND)
KERNEL(u64_or, uint64_t, OP_OR)
KERNEL(u64_xor, uint64_t, OP_XOR)
KERNEL(i8_min, int8_t, OP_MIN)
KERNEL(i8_max, int8_t, OP_MAX)
KERNEL(u8_min, uint8_t, OP_MIN)
KERNEL(u8_max, uint8_t, OP_MAX)
KERNEL(i32_min, int32_t, OP_MIN)
KERNEL(i32_max, int32_t, OP_MAX)
KERNEL(i64_min, int64_t, OP_MIN)
KERNEL(i64_max, int64_t, OP_MAX)

/* ---- x86-64 vector paths for f16 / bf16 ------------------------------------------------------ */

/*
 * The portable f16 kernels cost ~6 cycles an element at the SSE2 baseline; F16C converts 8
 * elements in one instruction, and AVX2 does the bf16 shifts and rounding 8 at a time. Chosen at
 * run time from the CPU (WEFT_REDUCE_SIMD=0 keeps the portable kernels). Results are the same
 * bit for bit, except for the payload of NaNs. Loads of a block precede its store, so dst may be
 * a or b.
 */
#if REDUCE_X86

#define TARGET_AVX  __attribute__((target("avx")))
#define TARGET_F16C __attribute__((target("avx,f16c")))
#define TARGET_AVX2 __attribute__((target("avx2")))

TARGET_AVX static inline __m256 v_add(__m256 x, __m256 y)
{
    return _mm256_add_ps(x, y);
}

TARGET_AVX static inline __m256 v_mul(__m256 x, __m256 y)
{
    return _mm256_mul_ps(x, y);
}

/* mask ? x : y, by bit operations: GCC 12 turns _mm256_blendv_ps of a compare into branches */
TARGET_AVX static inline __m256 v_select(__m256 mask, __m256 x, __m256 y)
{
    return _mm256_or_ps(_mm256_and_ps(mask, x), _mm256_andnot_ps(mask, y));
}

/* as OP_FMIN / OP_FMAX: (x < y || x is NaN) ? x : y */
TARGET_AVX static inline __m256 v_min(__m256 x, __m256 y)
{
    __m256 lt = _mm256_cmp_ps(x, y, _CMP_LT_OQ);
    return v_select(_mm256_or_ps(lt, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)), x, y);
}

TARGET_AVX static inline __m256 v_max(__m256 x, __m256 y)
{
    __m256 gt = _mm256_cmp_ps(x, y, _CMP_GT_OQ);
    return v_select(_mm256_or_ps(gt, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)), x, y);
}

TARGET_F16C static inline __m256 f16x8_load(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

TARGET_F16C static inline void f16x8_store(uint16_t *p, __m256 v)
{
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

TARGET_AVX2 static inline __m256 bf16x8_load(const uint16_t *p)
{
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* as f2bf, 8 at a time */
TARGET_AVX2 static inline void bf16x8_store(uint16_t *p, __m256 v)
{
    __m256i u = _mm256_castps_si256(v);
    __m256i hi = _mm256_srli_epi32(u, 16);
    __m256i odd = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    __m256i nan = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
    __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    __m256i r = _mm256_blendv_epi8(rounded, nan, is_nan);

    /* each lane is <= 0xffff, so the saturating pack is a plain narrowing */
    _mm_storeu_si128((__m128i *)p,
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

#define SIMD_KERNEL(name, TARGET, LOAD, STORE, VOP, SOP)                                           \
    TARGET static void name(void *dst, const void *a, const void *b, size_t n)                     \
    {                                                                                              \
        uint16_t *d = dst;                                                                         \
        const uint16_t *x = a;                                                                     \
        const uint16_t *y = b;                                                                     \
        size_t i = 0;                                                                              \
        for (; i + 8 <= n; i += 8) {                                                               \
            STORE(d + i, VOP(LOAD(x + i), LOAD(y + i)));                                           \
        }                                                                                          \
        for (; i < n; i++) {                                                                       \
            d[i] = SOP(x[i], y[i]);                                                                \
        }                                                                                          \
    }

SIMD_KERNEL(f16c_sum, TARGET_F16C, f16x8_load, f16x8_store, v_add, f16_elem_add)
SIMD_KERNEL(f16c_prod, TARGET_F16C, f16x8_load, f16x8_store, v_mul, f16_elem_mul)
SIMD_KERNEL(f16c_min, TARGET_F16C, f16x8_load, f16x8_store, v_min, f16_elem_min)
SIMD_KERNEL(f16c_max, TARGET_F16C, f16x8_load, f16x8_store, v_max, f16_elem_max)
SIMD_KERNEL(bf16avx2_sum, TARGET_AVX2, bf16x8_load, bf16x8_store, v_add, bf16_elem_add)
SIMD_KERNEL(bf16avx2_prod, TARGET_AVX2, bf16x8_load, bf16x8_store, v_mul, bf16_elem_mul)
SIMD_KERNEL(bf16avx2_min, TARGET_AVX2, bf16x8_load, bf16x8_store, v_min, bf16_elem_min)
SIMD_KERNEL(bf16avx2_max, TARGET_AVX2, bf16x8_load, bf16x8_store, v_max, bf16_elem_max)

/* AVG for count <= F16_AVG_F32 / BF16_AVG_F32 (the caller checks): one f32 division, rounded
 * back (exact there: see AVG below) */
#define SIMD_AVG(name, TARGET, LOAD, STORE, TOF, FROMF)                                            \
    TARGET static void name(uint16_t *d, size_t n, int count)                                      \
    {                                                                                              \
        float c = (float)count;                                                                    \
        __m256 vc = _mm256_set1_ps(c);                                                             \
        size_t i = 0;                                                                              \
        for (; i + 8 <= n; i += 8) {                                                               \
            STORE(d + i, _mm256_div_ps(LOAD(d + i), vc));                                          \
        }                                                                                          \
        for (; i < n; i++) {                                                                       \
            d[i] = FROMF(TOF(d[i]) / c);                                                           \
        }                                                                                          \
    }

SIMD_AVG(f16c_avg, TARGET_F16C, f16x8_load, f16x8_store, h2f, f2h)
SIMD_AVG(bf16avx2_avg, TARGET_AVX2, bf16x8_load, bf16x8_store, bf2f, f2bf)

/* Conversions to and from f32, 8 at a time (weft_reduce_widen, and weft_reduce_narrow of one
 * contribution: the DDP reducer's compression, the accumulators of 16-bit reductions). */
#define SIMD_CONVERT(widen_name, narrow_name, TARGET, LOAD, STORE, TOF, FROMF)                     \
    TARGET static void widen_name(float *restrict d, const uint16_t *restrict h, size_t n)         \
    {                                                                                              \
        size_t i = 0;                                                                              \
        for (; i + 8 <= n; i += 8) {                                                               \
            _mm256_storeu_ps(d + i, LOAD(h + i));                                                  \
        }                                                                                          \
        for (; i < n; i++) {                                                                       \
            d[i] = TOF(h[i]);                                                                      \
        }                                                                                          \
    }                                                                                              \
    TARGET static void narrow_name(uint16_t *restrict h, const float *restrict f, size_t n)        \
    {                                                                                              \
        size_t i = 0;                                                                              \
        for (; i + 8 <= n; i += 8) {                                                               \
            STORE(h + i, _mm256_loadu_ps(f + i));                                                  \
        }                                                                                          \
        for (; i < n; i++) {                                                                       \
            h[i] = FROMF(f[i]);                                                                    \
        }                                                                                          \
    }

SIMD_CONVERT(f16c_widen, f16c_narrow, TARGET_F16C, f16x8_load, f16x8_store, h2f, f2h)
SIMD_CONVERT(bf16avx2_widen, bf16avx2_narrow, TARGET_AVX2, bf16x8_load, bf16x8_store, bf2f, f2bf)

#endif /* REDUCE_X86 */

/* NULL where the op does not apply to the dtype (bool throughout). AVG reduces as SUM. */
static const kernel_fn_t kernels[WEFT_DTYPE_COUNT][WEFT_REDUCE_OP_COUNT] = {
    [WEFT_F32] = {f32_sum, f32_sum, f32_prod, f32_min, f32_max, NULL, NULL, NULL},
    [WEFT_F64] = {f64_sum, f64_sum, f64_prod, f64_min, f64_max, NULL, NULL, NULL},
    [WEFT_F16] = {f16_sum, f16_sum, f16_prod, f16_min, f16_max, NULL, NULL, NULL},
    [WEFT_BF16] = {bf16_sum, bf16_sum, bf16_prod, bf16_min, bf16_max, NULL, NULL, NULL},
    [WEFT_I8] = {u8_sum, u8_sum, u8_prod, i8_min, i8_max, u8_and, u8_or, u8_xor},
    [WEFT_I32] = {u32_sum, u32_sum, u32_prod, i32_min, i32_max, u32_and, u32_or, u32_xor},
    [WEFT_I64] = {u64_sum, u64_sum, u64_prod, i64_min, i64_max, u64_and, u64_or, u64_xor},
    [WEFT_U8] = {u8_sum, u8_sum, u8_prod, u8_min, u8_max, u8_and, u8_or, u8_xor},
};

/* The kernels in use: the portable ones, some replaced by vector paths the CPU has. */
static kernel_fn_t active[WEFT_DTYPE_COUNT][WEFT_REDUCE_OP_COUNT];
#if REDUCE_X86
static int simd_f16c;
static int simd_avx2;
#endif
static pthread_once_t active_once = PTHREAD_ONCE_INIT;

#if REDUCE_X86
/* CPUID and XGETBV directly: clang's __builtin_cpu_supports does not know "f16c". */
static void cpu_detect(int *f16c_p, int *avx2_p)
{
    unsigned int a, b, c, d;
    uint32_t xcr0_lo, xcr0_hi;

    *f16c_p = 0;
    *avx2_p = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) {
        return;
    }
    /* OSXSAVE (27) and AVX (28), and the OS saves XMM and YMM state (XCR0 bits 1 and 2) */
    if (((c >> 27) & 3u) != 3u) {
        return;
    }
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    (void)xcr0_hi;
    if ((xcr0_lo & 6u) != 6u) {
        return;
    }
    *f16c_p = (int)((c >> 29) & 1u);
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        *avx2_p = (int)((b >> 5) & 1u);
    }
}
#endif

static void active_init(void)
{
    memcpy(active, kernels, sizeof active);
    if (!weft__cfg_bool(WEFT__CFG_REDUCE_SIMD)) {
        return;
    }
#if REDUCE_X86
    cpu_detect(&simd_f16c, &simd_avx2);
    if (simd_f16c) {
        active[WEFT_F16][WEFT_SUM] = f16c_sum;
        active[WEFT_F16][WEFT_AVG] = f16c_sum;
        active[WEFT_F16][WEFT_PRODUCT] = f16c_prod;
        active[WEFT_F16][WEFT_MIN] = f16c_min;
        active[WEFT_F16][WEFT_MAX] = f16c_max;
    }
    if (simd_avx2) {
        active[WEFT_BF16][WEFT_SUM] = bf16avx2_sum;
        active[WEFT_BF16][WEFT_AVG] = bf16avx2_sum;
        active[WEFT_BF16][WEFT_PRODUCT] = bf16avx2_prod;
        active[WEFT_BF16][WEFT_MIN] = bf16avx2_min;
        active[WEFT_BF16][WEFT_MAX] = bf16avx2_max;
    }
#endif
}

static kernel_fn_t kernel_for(weft_dtype_t dtype, weft_reduce_op_t op)
{
    if ((unsigned)dtype >= WEFT_DTYPE_COUNT || (unsigned)op >= WEFT_REDUCE_OP_COUNT) {
        return NULL;
    }
    pthread_once(&active_once, active_init);
    return active[dtype][op];
}

/* ---- public ---------------------------------------------------------------------------------- */

static const char *const op_names[WEFT_REDUCE_OP_COUNT] = {
    "sum", "avg", "product", "min", "max", "band", "bor", "bxor",
};

const char *weft_reduce_op_name(weft_reduce_op_t op)
{
    if ((unsigned)op >= WEFT_REDUCE_OP_COUNT) {
        return "invalid";
    }
    return op_names[op];
}

weft_status_t weft_reduce_check(weft_reduce_op_t op, weft_dtype_t dtype)
{
    if ((unsigned)op >= WEFT_REDUCE_OP_COUNT) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "reduce: invalid op %d", (int)op);
    }
    if (!weft_dtype_valid((int)dtype)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "reduce: invalid dtype %d", (int)dtype);
    }
    if (dtype == WEFT_BOOL) {
        return weft__set_error(WEFT_ERR_DTYPE, "reduce: %s does not apply to bool", op_names[op]);
    }
    if (kernels[dtype][op] == NULL) {
        return weft__set_error(WEFT_ERR_DTYPE, "reduce: %s applies to integer dtypes, not %s",
                               op_names[op], weft_dtype_name(dtype));
    }
    return WEFT_OK;
}

void weft_reduce_to(void *dst, const void *a, const void *b, size_t n, weft_dtype_t dtype,
                    weft_reduce_op_t op)
{
    kernel_fn_t fn = kernel_for(dtype, op);

    if (fn != NULL && n > 0) {
        fn(dst, a, b, n);
    }
}

void weft_reduce_into(void *dst, const void *src, size_t n, weft_dtype_t dtype, weft_reduce_op_t op)
{
    weft_reduce_to(dst, dst, src, n, dtype, op);
}

/* ---- AVG ------------------------------------------------------------------------------------- */

/*
 * Floats: x / count in f32 is the correctly rounded quotient while count is exact in f32
 * (<= 2^24); beyond, divide in f64 (53 >= 2*24+2 bits, so rounding twice is harmless).
 *
 * f16/bf16 results must come from the exact quotient rounded once. Rounding an f32 quotient
 * again is harmless only while the f32 quotient cannot land on a midpoint of the narrow dtype
 * that the exact quotient is not on: for an f16 (bf16) dividend while count <= 2^13 (2^16),
 * for an f32 dividend (an f32 accumulator) while count < 2^12 and the quotient is not an f32
 * subnormal (which bf16 can still tell apart). Elsewhere the quotient is taken in f64, where
 * it cannot land on such a midpoint, and brought to f32 rounding to odd, which a narrower
 * format with at least two bits fewer then rounds exactly as it would the f64 value.
 */
#define F32_EXACT_INT  (1 << 24)
#define F16_AVG_F32    (1 << 13)
#define BF16_AVG_F32   (1 << 16)
#define NARROW_AVG_F32 (1 << 12)

/* @p x rounded to f32 "to odd": truncated, its last bit set when inexact. */
static inline float f32_round_odd(double x)
{
    float f = (float)x;
    double back = (double)f;

    if (back != x && x == x) {
        uint32_t u = as_bits(f);
        if ((u & 1u) == 0) {
            /* f is even: the neighbour on x's side of it is odd */
            u = (x < 0 ? -x : x) > (back < 0 ? -back : back) ? u + 1 : u - 1;
        }
        f = as_float(u);
    }
    return f;
}

static void avg_f32(float *restrict d, size_t n, int count)
{
    if (count <= F32_EXACT_INT) {
        float c = (float)count;
        LOOP(n, d[i] = d[i] / c);
    } else {
        double c = (double)count;
        LOOP(n, d[i] = (float)((double)d[i] / c));
    }
}

static void avg_f64(double *restrict d, size_t n, int count)
{
    double c = (double)count;
    LOOP(n, d[i] = d[i] / c);
}

#define AVG_HALF(name, TOF, FROMF, F32_MAX_COUNT)                                                  \
    static void name(uint16_t *restrict d, size_t n, int count)                                    \
    {                                                                                              \
        if (count <= F32_MAX_COUNT) {                                                              \
            float c = (float)count;                                                                \
            LOOP(n, d[i] = FROMF(TOF(d[i]) / c));                                                  \
        } else {                                                                                   \
            double c = (double)count;                                                              \
            for (size_t i = 0; i < n; i++) {                                                       \
                d[i] = FROMF(f32_round_odd((double)TOF(d[i]) / c));                                \
            }                                                                                      \
        }                                                                                          \
    }

AVG_HALF(avg_f16, h2f, f2h, F16_AVG_F32)
AVG_HALF(avg_bf16, bf2f, f2bf, BF16_AVG_F32)

/* An f32 accumulator to f16/bf16, finishing AVG from the exact quotient (see above). */
#define NARROW_HALF(name, FROMF, TINY_CHECK)                                                       \
    static void name(uint16_t *restrict d, const float *restrict acc, size_t n, int count)         \
    {                                                                                              \
        if (count <= 1) {                                                                          \
            LOOP(n, d[i] = FROMF(acc[i]));                                                         \
        } else if (count < NARROW_AVG_F32) {                                                       \
            float c = (float)count;                                                                \
            double cd = (double)count;                                                             \
            for (size_t b = 0; b < n; b += BLOCK) {                                                \
                size_t e = n - b < BLOCK ? n - b : BLOCK;                                          \
                uint32_t tiny = 0;                                                                 \
                for (size_t i = b; i < b + e; i++) {                                               \
                    float q = acc[i] / c;                                                          \
                    uint32_t u = as_bits(q);                                                       \
                    tiny |= (uint32_t)(TINY_CHECK && (u & 0x7f800000u) == 0 &&                     \
                                       (u & 0x007fffffu) != 0);                                    \
                    d[i] = FROMF(q);                                                               \
                }                                                                                  \
                for (size_t i = b; tiny != 0 && i < b + e; i++) {                                  \
                    d[i] = FROMF(f32_round_odd((double)acc[i] / cd));                              \
                }                                                                                  \
            }                                                                                      \
        } else {                                                                                   \
            double cd = (double)count;                                                             \
            for (size_t i = 0; i < n; i++) {                                                       \
                d[i] = FROMF(f32_round_odd((double)acc[i] / cd));                                  \
            }                                                                                      \
        }                                                                                          \
    }

/* f16 quotients near f16 values are f32 normals; bf16 reaches into the f32 subnormals. */
NARROW_HALF(narrow_avg_f16, f2h, 0)
NARROW_HALF(narrow_avg_bf16, f2bf, 1)

#if REDUCE_X86
/* narrow_avg_f16 / narrow_avg_bf16 for 1 < count < NARROW_AVG_F32, 8 at a time: the same f32
 * quotient rounded once more; a bf16 block with a quotient in the f32 subnormals takes the exact
 * path as the portable kernel does. */
TARGET_F16C static void f16c_narrow_avg(uint16_t *restrict d, const float *restrict acc, size_t n,
                                        int count)
{
    __m256 c = _mm256_set1_ps((float)count);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        f16x8_store(d + i, _mm256_div_ps(_mm256_loadu_ps(acc + i), c));
    }
    for (; i < n; i++) {
        d[i] = f2h(acc[i] / (float)count);
    }
}

TARGET_AVX2 static void bf16avx2_narrow_avg(uint16_t *restrict d, const float *restrict acc,
                                            size_t n, int count)
{
    __m256 c = _mm256_set1_ps((float)count);
    __m256i exp = _mm256_set1_epi32(0x7f800000), man = _mm256_set1_epi32(0x007fffff);
    __m256i zero = _mm256_setzero_si256();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 q = _mm256_div_ps(_mm256_loadu_ps(acc + i), c);
        __m256i u = _mm256_castps_si256(q);
        __m256i sub = _mm256_andnot_si256(_mm256_cmpeq_epi32(_mm256_and_si256(u, man), zero),
                                          _mm256_cmpeq_epi32(_mm256_and_si256(u, exp), zero));
        if (_mm256_movemask_epi8(sub) == 0) {
            bf16x8_store(d + i, q);
            continue;
        }
        for (size_t k = i; k < i + 8; k++) {
            d[k] = f2bf(f32_round_odd((double)acc[k] / (double)count));
        }
    }
    if (i < n) {
        narrow_avg_bf16(d + i, acc + i, n - i, count);
    }
}
#endif

/* Integers: C division truncates toward zero; count >= 2 keeps INT_MIN / count in range. */
#define AVG_INT(name, T, W)                                                                        \
    static void name(T *restrict d, size_t n, int count)                                           \
    {                                                                                              \
        W c = (W)count;                                                                            \
        for (size_t i = 0; i < n; i++) {                                                           \
            d[i] = (T)((W)d[i] / c);                                                               \
        }                                                                                          \
    }

AVG_INT(avg_i8, int8_t, int32_t)
AVG_INT(avg_u8, uint8_t, int32_t)
AVG_INT(avg_i32, int32_t, int32_t)
AVG_INT(avg_i64, int64_t, int64_t)

void weft_reduce_finish(void *dst, size_t n, weft_dtype_t dtype, weft_reduce_op_t op, int count)
{
    if (op != WEFT_AVG || count <= 1 || n == 0) {
        return;
    }
    switch (dtype) {
    case WEFT_F32:
        avg_f32(dst, n, count);
        break;
    case WEFT_F64:
        avg_f64(dst, n, count);
        break;
    case WEFT_F16:
#if REDUCE_X86
        pthread_once(&active_once, active_init);
        if (simd_f16c && count <= F16_AVG_F32) {
            f16c_avg(dst, n, count);
            break;
        }
#endif
        avg_f16(dst, n, count);
        break;
    case WEFT_BF16:
#if REDUCE_X86
        pthread_once(&active_once, active_init);
        if (simd_avx2 && count <= BF16_AVG_F32) {
            bf16avx2_avg(dst, n, count);
            break;
        }
#endif
        avg_bf16(dst, n, count);
        break;
    case WEFT_I8:
        avg_i8(dst, n, count);
        break;
    case WEFT_U8:
        avg_u8(dst, n, count);
        break;
    case WEFT_I32:
        avg_i32(dst, n, count);
        break;
    case WEFT_I64:
        avg_i64(dst, n, count);
        break;
    default:
        break;
    }
}

void weft_reduce_widen(float *dst, const void *src, size_t n, weft_dtype_t dtype)
{
    const uint16_t *h = src;

#if REDUCE_X86
    pthread_once(&active_once, active_init);
    if (dtype == WEFT_F16 && simd_f16c) {
        f16c_widen(dst, h, n);
        return;
    }
    if (dtype == WEFT_BF16 && simd_avx2) {
        bf16avx2_widen(dst, h, n);
        return;
    }
#endif
    switch (dtype) {
    case WEFT_F16:
        LOOP(n, dst[i] = h2f(h[i]));
        break;
    case WEFT_BF16:
        LOOP(n, dst[i] = bf2f(h[i]));
        break;
    case WEFT_F32:
        if (n > 0) {
            memcpy(dst, src, n * sizeof(float));
        }
        break;
    default:
        break;
    }
}

void weft_reduce_narrow(void *dst, const float *acc, size_t n, weft_dtype_t dtype,
                        weft_reduce_op_t op, int count)
{
    int c = op == WEFT_AVG ? count : 1;

#if REDUCE_X86
    if (c < NARROW_AVG_F32) {
        pthread_once(&active_once, active_init);
        if (dtype == WEFT_F16 && simd_f16c) {
            if (c <= 1) {
                f16c_narrow(dst, acc, n);
            } else {
                f16c_narrow_avg(dst, acc, n, c);
            }
            return;
        }
        if (dtype == WEFT_BF16 && simd_avx2) {
            if (c <= 1) {
                bf16avx2_narrow(dst, acc, n);
            } else {
                bf16avx2_narrow_avg(dst, acc, n, c);
            }
            return;
        }
    }
#endif
    switch (dtype) {
    case WEFT_F16:
        narrow_avg_f16(dst, acc, n, c);
        break;
    case WEFT_BF16:
        narrow_avg_bf16(dst, acc, n, c);
        break;
    case WEFT_F32:
        if (dst != acc && n > 0) {
            memcpy(dst, acc, n * sizeof(float));
        }
        weft_reduce_finish(dst, n, WEFT_F32, op, count);
        break;
    default:
        break;
    }
}

/* ---- the reduce ops of each device type ------------------------------------------------------ */

static void cpu_reduce_into(weft_device_t device, void *dst, const void *src, size_t n,
                            weft_dtype_t dtype, weft_reduce_op_t op)
{
    (void)device;
    weft_reduce_into(dst, src, n, dtype, op);
}

static void cpu_reduce_to(weft_device_t device, void *dst, const void *a, const void *b, size_t n,
                          weft_dtype_t dtype, weft_reduce_op_t op)
{
    (void)device;
    weft_reduce_to(dst, a, b, n, dtype, op);
}

static void cpu_finish(weft_device_t device, void *dst, size_t n, weft_dtype_t dtype,
                       weft_reduce_op_t op, int count)
{
    (void)device;
    weft_reduce_finish(dst, n, dtype, op, count);
}

static void cpu_widen(weft_device_t device, float *dst, const void *src, size_t n,
                      weft_dtype_t dtype)
{
    (void)device;
    weft_reduce_widen(dst, src, n, dtype);
}

static void cpu_narrow(weft_device_t device, void *dst, const float *acc, size_t n,
                       weft_dtype_t dtype, weft_reduce_op_t op, int count)
{
    (void)device;
    weft_reduce_narrow(dst, acc, n, dtype, op, count);
}

static const weft_reduce_ops_t cpu_ops = {
    .name = "cpu",
    .reduce_into = cpu_reduce_into,
    .reduce_to = cpu_reduce_to,
    .finish = cpu_finish,
    .widen = cpu_widen,
    .narrow = cpu_narrow,
};

/* By device type (weft_device_type_t: CPU, CUDA). */
#define DEVICE_TYPES 2
static _Atomic(const weft_reduce_ops_t *) device_ops[DEVICE_TYPES] = {&cpu_ops, NULL};

static const char *device_type_name(int type)
{
    return type == WEFT_DEVICE_CPU ? "cpu" : type == WEFT_DEVICE_CUDA ? "cuda" : "unknown";
}

weft_status_t weft_reduce_ops_register(weft_device_type_t type, const weft_reduce_ops_t *ops)
{
    if ((unsigned)type >= DEVICE_TYPES) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "reduce: invalid device type %d", (int)type);
    }
    if (type == WEFT_DEVICE_CPU) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "reduce: the cpu entry is weft's own and cannot be replaced");
    }
    if (ops != NULL && (ops->name == NULL || ops->reduce_into == NULL || ops->reduce_to == NULL ||
                        ops->finish == NULL || ops->widen == NULL || ops->narrow == NULL)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "reduce: an entry for %s needs a name and every kernel",
                               device_type_name(type));
    }
    atomic_store(&device_ops[type], ops);
    return WEFT_OK;
}

weft_status_t weft_reduce_ops_for(weft_device_t device, const weft_reduce_ops_t **ops_p)
{
    if ((unsigned)device.type >= DEVICE_TYPES) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "reduce: invalid device type %d",
                               (int)device.type);
    }
    const weft_reduce_ops_t *ops = atomic_load(&device_ops[device.type]);
    if (ops == NULL) {
        return weft__set_error(WEFT_ERR_UNSUPPORTED,
                               "reduce: no reduction kernels for %s tensors (%s:%d): none are "
                               "registered for that device type (a build with its kernels "
                               "registers them, weft_reduce_ops_register)",
                               device_type_name((int)device.type),
                               device_type_name((int)device.type), device.index);
    }
    *ops_p = ops;
    return WEFT_OK;
}
