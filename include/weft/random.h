/* Reproducible random streams (xoshiro256**) and tensor fills. */
#ifndef WEFT_RANDOM_H
#define WEFT_RANDOM_H

#include <weft/api.h>

#include <stdint.h>

#include <weft/tensor.h>

#ifdef __cplusplus
extern "C" {
#endif

/**
 * One random stream. The state is plain data: copy it to fork a stream, store it in a checkpoint
 * to resume one. Not thread-safe: give each thread its own stream.
 */
typedef struct {
    uint64_t s[4];
} weft_rng_t;

/**
 * Seeds stream number @p stream of @p seed. Streams of one seed are independent (each state is a
 * hash of (seed, stream)), so rank r of a job can use stream r and rank counts can change
 * without changing what the other streams draw. The same (seed, stream) always gives the same
 * numbers on every machine.
 */
WEFT_API void weft_rng_init(weft_rng_t *rng, uint64_t seed, uint64_t stream);
/** The next 64 random bits. */
WEFT_API uint64_t weft_rng_next(weft_rng_t *rng);
/** Uniform in [0, 1), 53 random bits. */
WEFT_API double weft_rng_uniform(weft_rng_t *rng);
/** Standard normal (Box-Muller; draws two uniforms per value). */
WEFT_API double weft_rng_normal(weft_rng_t *rng);
/** Uniform integer in [0, n); 0 when n == 0. Unbiased (rejection). */
WEFT_API uint64_t weft_rng_below(weft_rng_t *rng, uint64_t n);

/**
 * Fills a CPU f32 or f64 tensor with values uniform in [lo, hi), in element order.
 * @return WEFT_ERR_INVALID_ARG (NULL, hi < lo), WEFT_ERR_DTYPE (not f32/f64).
 */
WEFT_API weft_status_t weft_tensor_fill_uniform(weft_tensor_t *t, double lo, double hi,
                                                weft_rng_t *rng);
/** Fills a CPU f32 or f64 tensor with normal values (mean, std >= 0), in element order. */
WEFT_API weft_status_t weft_tensor_fill_normal(weft_tensor_t *t, double mean, double std,
                                               weft_rng_t *rng);
/** Sets every element of a CPU f32, f64, i32 or i64 tensor to @p v. */
WEFT_API weft_status_t weft_tensor_fill(weft_tensor_t *t, double v);

/**
 * Fan-in and fan-out of a weight as torch computes them: dim 1 and dim 0 times the product of
 * the dims after 1 (a 2-D [out, in] weight gives fan_in = in, fan_out = out).
 * @return WEFT_ERR_SHAPE for fewer than 2 dims.
 */
WEFT_API weft_status_t weft_init_fans(const weft_tensor_t *t, int64_t *fan_in_p,
                                      int64_t *fan_out_p);
/** torch.nn.init.kaiming_uniform_ (fan_in mode, leaky_relu gain with slope @p a). */
WEFT_API weft_status_t weft_init_kaiming_uniform(weft_tensor_t *t, double a, weft_rng_t *rng);
/** torch.nn.init.kaiming_normal_ (fan_in mode, relu gain). */
WEFT_API weft_status_t weft_init_kaiming_normal(weft_tensor_t *t, weft_rng_t *rng);
/** torch.nn.init.xavier_uniform_ with @p gain. */
WEFT_API weft_status_t weft_init_xavier_uniform(weft_tensor_t *t, double gain, weft_rng_t *rng);
/** torch.nn.init.xavier_normal_ with @p gain. */
WEFT_API weft_status_t weft_init_xavier_normal(weft_tensor_t *t, double gain, weft_rng_t *rng);

#ifdef __cplusplus
}
#endif
#endif
