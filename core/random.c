/* Reproducible random streams: xoshiro256** seeded through splitmix64, and tensor fills. */
#include <math.h>
#include <stdint.h>

#include "internal.h"

#include <weft/random.h>

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

void weft_rng_init(weft_rng_t *rng, uint64_t seed, uint64_t stream)
{
    /* Two rounds of mixing so that neighbouring (seed, stream) pairs land far apart. */
    uint64_t a = seed;
    uint64_t b = stream ^ 0x6a09e667f3bcc909ULL;
    uint64_t x = splitmix64(&a) ^ rotl(splitmix64(&b), 17);

    for (int i = 0; i < 4; i++) {
        rng->s[i] = splitmix64(&x);
    }
    if ((rng->s[0] | rng->s[1] | rng->s[2] | rng->s[3]) == 0) {
        rng->s[0] = 1; /* the all-zero state is the one fixed point */
    }
}

uint64_t weft_rng_next(weft_rng_t *rng)
{
    uint64_t *s = rng->s;
    const uint64_t result = rotl(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;

    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double weft_rng_uniform(weft_rng_t *rng)
{
    return (double)(weft_rng_next(rng) >> 11) * 0x1.0p-53;
}

double weft_rng_normal(weft_rng_t *rng)
{
    /* 1 - u is in (0, 1], so the log is finite. */
    double u1 = 1.0 - weft_rng_uniform(rng);
    double u2 = weft_rng_uniform(rng);

    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

uint64_t weft_rng_below(weft_rng_t *rng, uint64_t n)
{
    uint64_t limit;
    uint64_t r;

    if (n == 0) {
        return 0;
    }
    limit = UINT64_MAX - UINT64_MAX % n;
    do {
        r = weft_rng_next(rng);
    } while (r >= limit);
    return r % n;
}

static weft_status_t float_check(const weft_tensor_t *t, const char *what)
{
    if (t == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: tensor is NULL", what);
    }
    if (weft_tensor_device(t).type != WEFT_DEVICE_CPU) {
        return weft__set_error(WEFT_ERR_UNSUPPORTED, "%s: only CPU tensors", what);
    }
    if (weft_tensor_dtype(t) != WEFT_F32 && weft_tensor_dtype(t) != WEFT_F64) {
        return weft__set_error(WEFT_ERR_DTYPE, "%s: needs f32 or f64, got %s", what,
                               weft_dtype_name(weft_tensor_dtype(t)));
    }
    return WEFT_OK;
}

static void store(weft_tensor_t *t, int64_t i, double v)
{
    if (weft_tensor_dtype(t) == WEFT_F32) {
        ((float *)weft_tensor_data(t))[i] = (float)v;
    } else {
        ((double *)weft_tensor_data(t))[i] = v;
    }
}

weft_status_t weft_tensor_fill_uniform(weft_tensor_t *t, double lo, double hi, weft_rng_t *rng)
{
    WEFT_CHECK(float_check(t, "fill_uniform"));
    if (rng == NULL || !(hi >= lo)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "fill_uniform: NULL rng or hi < lo");
    }
    for (int64_t i = 0, n = weft_tensor_numel(t); i < n; i++) {
        store(t, i, lo + (hi - lo) * weft_rng_uniform(rng));
    }
    return WEFT_OK;
}

weft_status_t weft_tensor_fill_normal(weft_tensor_t *t, double mean, double std, weft_rng_t *rng)
{
    WEFT_CHECK(float_check(t, "fill_normal"));
    if (rng == NULL || !(std >= 0)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "fill_normal: NULL rng or std < 0");
    }
    for (int64_t i = 0, n = weft_tensor_numel(t); i < n; i++) {
        store(t, i, mean + std * weft_rng_normal(rng));
    }
    return WEFT_OK;
}

weft_status_t weft_tensor_fill(weft_tensor_t *t, double v)
{
    int64_t n;
    void *d;

    if (t == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "fill: tensor is NULL");
    }
    if (weft_tensor_device(t).type != WEFT_DEVICE_CPU) {
        return weft__set_error(WEFT_ERR_UNSUPPORTED, "fill: only CPU tensors");
    }
    n = weft_tensor_numel(t);
    d = weft_tensor_data(t);
    switch (weft_tensor_dtype(t)) {
    case WEFT_F32:
        for (int64_t i = 0; i < n; i++) {
            ((float *)d)[i] = (float)v;
        }
        return WEFT_OK;
    case WEFT_F64:
        for (int64_t i = 0; i < n; i++) {
            ((double *)d)[i] = v;
        }
        return WEFT_OK;
    case WEFT_I32:
        for (int64_t i = 0; i < n; i++) {
            ((int32_t *)d)[i] = (int32_t)v;
        }
        return WEFT_OK;
    case WEFT_I64:
        for (int64_t i = 0; i < n; i++) {
            ((int64_t *)d)[i] = (int64_t)v;
        }
        return WEFT_OK;
    default:
        return weft__set_error(WEFT_ERR_DTYPE, "fill: %s is not supported",
                               weft_dtype_name(weft_tensor_dtype(t)));
    }
}

weft_status_t weft_init_fans(const weft_tensor_t *t, int64_t *fan_in_p, int64_t *fan_out_p)
{
    int64_t field = 1;
    const int64_t *shape;
    int ndim;

    if (t == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "init: tensor is NULL");
    }
    ndim = weft_tensor_ndim(t);
    shape = weft_tensor_shape(t);
    if (ndim < 2) {
        return weft__set_error(WEFT_ERR_SHAPE,
                               "init: fan in and fan out need at least 2 dims, got %d", ndim);
    }
    for (int i = 2; i < ndim; i++) {
        field *= shape[i];
    }
    if (fan_in_p != NULL) {
        *fan_in_p = shape[1] * field;
    }
    if (fan_out_p != NULL) {
        *fan_out_p = shape[0] * field;
    }
    return WEFT_OK;
}

weft_status_t weft_init_kaiming_uniform(weft_tensor_t *t, double a, weft_rng_t *rng)
{
    int64_t fan_in;
    double gain;
    double bound;

    WEFT_CHECK(weft_init_fans(t, &fan_in, NULL));
    if (fan_in == 0) {
        return WEFT_OK; /* nothing to fill: the tensor is empty */
    }
    gain = sqrt(2.0 / (1.0 + a * a));
    bound = gain * sqrt(3.0 / (double)fan_in);
    return weft_tensor_fill_uniform(t, -bound, bound, rng);
}

weft_status_t weft_init_kaiming_normal(weft_tensor_t *t, weft_rng_t *rng)
{
    int64_t fan_in;

    WEFT_CHECK(weft_init_fans(t, &fan_in, NULL));
    if (fan_in == 0) {
        return WEFT_OK;
    }
    return weft_tensor_fill_normal(t, 0.0, sqrt(2.0) / sqrt((double)fan_in), rng);
}

weft_status_t weft_init_xavier_uniform(weft_tensor_t *t, double gain, weft_rng_t *rng)
{
    int64_t fan_in;
    int64_t fan_out;
    double bound;

    WEFT_CHECK(weft_init_fans(t, &fan_in, &fan_out));
    if (fan_in + fan_out == 0) {
        return WEFT_OK;
    }
    bound = gain * sqrt(6.0 / (double)(fan_in + fan_out));
    return weft_tensor_fill_uniform(t, -bound, bound, rng);
}

weft_status_t weft_init_xavier_normal(weft_tensor_t *t, double gain, weft_rng_t *rng)
{
    int64_t fan_in;
    int64_t fan_out;

    WEFT_CHECK(weft_init_fans(t, &fan_in, &fan_out));
    if (fan_in + fan_out == 0) {
        return WEFT_OK;
    }
    return weft_tensor_fill_normal(t, 0.0, gain * sqrt(2.0 / (double)(fan_in + fan_out)), rng);
}
