/* Gradient checks for the autograd tests: analytic gradients against central differences. */
#ifndef WEFT_TESTS_GRADCHECK_H
#define WEFT_TESTS_GRADCHECK_H

#include <weft/autograd.h>
#include <weft/ops.h>
#include <weft/random.h>

/** Builds one output from @p inputs (the function under test). */
typedef weft_status_t (*gc_fn_t)(weft_tensor_t *const *inputs, void *arg, weft_tensor_t **out_p);

/**
 * Checks the gradient of @p f with respect to each of the @p n f64 @p inputs that requires grad:
 * backward from f(inputs) with a random output gradient v (from @p rng) gives J^T v, compared
 * element by element with (f(x + eps) - f(x - eps)) . v / (2 eps), eps = 1e-6. Fails the current
 * criterion test, naming @p name, the input and the element, when
 * |analytic - numeric| > 1e-6 * max(1, |numeric|). Leaves the inputs' gradients cleared.
 */
void gradcheck(const char *name, gc_fn_t f, void *arg, int n, weft_tensor_t *const *inputs,
               weft_rng_t *rng);

/** A fresh f64 tensor of the given shape, uniform in [lo, hi), requiring grad if @p rg. */
weft_tensor_t *gc_rand(weft_rng_t *rng, int ndim, const int64_t *shape, double lo, double hi,
                       int rg);

#endif
