/*
 * Loop and math helpers for the elementwise and reduction kernels (autograd/ops_elementwise.c,
 * autograd/ops_reduce.c). Not installed.
 *
 * The project builds with -O2, where GCC's cheap vector cost model only vectorises loops whose
 * trip count is a known multiple of the vector width, and only over restrict-qualified parameters
 * (not restrict locals). Kernels therefore loop with WEFT__FOR_EACH inside small functions whose
 * pointer parameters are restrict, and call weft__exp_f32 (branch-free, so it vectorises too)
 * rather than libm's expf.
 */
#ifndef WEFT_AUTOGRAD_OPS_MATH_H
#define WEFT_AUTOGRAD_OPS_MATH_H

#if defined(WEFT_BUILDING) && !defined(WEFT_IN_AUTOGRAD)
#error "autograd/ops_math.h is internal to autograd: other modules use its public or module API"
#endif

#include <stdint.h>
#include <string.h>

/* Runs the block for i in [0, n): in runs of 8 with a constant trip count, then the rest. */
#define WEFT__FOR_EACH(i, n, ...)                                                                  \
    do {                                                                                           \
        int64_t i##_0 = 0;                                                                         \
        for (; i##_0 + 8 <= (n); i##_0 += 8) {                                                     \
            for (int i##_k = 0; i##_k < 8; i##_k++) {                                              \
                const int64_t i = i##_0 + i##_k;                                                   \
                __VA_ARGS__                                                                        \
            }                                                                                      \
        }                                                                                          \
        for (int64_t i = i##_0; i < (n); i++) {                                                    \
            __VA_ARGS__                                                                            \
        }                                                                                          \
    } while (0)

static inline float weft__f32_from_bits(int32_t b)
{
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static inline int32_t weft__f32_bits(float f)
{
    int32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

/* c ? a : b for c in {0, 1}, as masks: GCC turns a float ternary followed by arithmetic into a
 * branch, which stops the vectoriser. */
static inline float weft__select_f32(int c, float a, float b)
{
    const int32_t m = -c;
    return weft__f32_from_bits((weft__f32_bits(a) & m) | (weft__f32_bits(b) & ~m));
}

/*
 * e^x in f32 without branches: x = k ln 2 + r with |r| <= ln 2 / 2, e^r by Cephes' expf
 * polynomial, times 2^k applied in two halves so that results near the overflow and underflow
 * thresholds come out right. Within 2 ulp of the exact value; 0 for x <= -104 (so exp(-inf) is
 * 0), inf for x >= 89, NaN for NaN.
 */
static inline float weft__exp_f32(float x)
{
    const float round = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float v = weft__select_f32(x < -110.0f, -110.0f, x);

    v = weft__select_f32(v > 89.0f, 89.0f, v); /* NaN stays NaN, and through the polynomial */
    const float k = (v * 1.44269504088896341f + round) - round;
    float r = v - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    /* The scale 2^k, as two powers of 2 in range; k = 0 for NaN, whose p is NaN anyway. */
    const int32_t ki = (int32_t)weft__select_f32(k != k, 0.0f, k);
    const int32_t k1 = ki / 2;
    const int32_t k2 = ki - k1;
    return p * weft__f32_from_bits((k1 + 127) * (1 << 23)) *
           weft__f32_from_bits((k2 + 127) * (1 << 23));
}

#endif
