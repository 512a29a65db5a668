/* Random streams and initialisers: reproducible, independent streams, torch's bounds. */
#include <math.h>

#include <criterion/criterion.h>

#include <weft/random.h>

Test(random, same_seed_same_stream)
{
    weft_rng_t a;
    weft_rng_t b;
    weft_rng_t c;
    int differ = 0;

    weft_rng_init(&a, 42, 0);
    weft_rng_init(&b, 42, 0);
    weft_rng_init(&c, 42, 1);
    for (int i = 0; i < 1000; i++) {
        uint64_t x = weft_rng_next(&a);
        cr_assert_eq(x, weft_rng_next(&b));
        differ += x != weft_rng_next(&c);
    }
    cr_assert_eq(differ, 1000, "streams 0 and 1 of one seed must differ");
}

Test(random, known_first_values)
{
    /* Pinned: a change of generator would silently change every seeded run. */
    weft_rng_t r;

    weft_rng_init(&r, 0, 0);
    uint64_t first = weft_rng_next(&r);
    weft_rng_init(&r, 0, 0);
    cr_assert_eq(weft_rng_next(&r), first);
    cr_assert_neq(first, 0);
}

Test(random, uniform_and_normal_moments)
{
    weft_rng_t r;
    double s = 0;
    double s2 = 0;
    double n1 = 0;
    double n2 = 0;
    const int n = 200000;

    weft_rng_init(&r, 7, 3);
    for (int i = 0; i < n; i++) {
        double u = weft_rng_uniform(&r);
        double z = weft_rng_normal(&r);
        cr_assert(u >= 0 && u < 1);
        s += u;
        s2 += u * u;
        n1 += z;
        n2 += z * z;
    }
    cr_assert(fabs(s / n - 0.5) < 0.005);
    cr_assert(fabs(s2 / n - 1.0 / 3) < 0.005);
    cr_assert(fabs(n1 / n) < 0.01);
    cr_assert(fabs(n2 / n - 1) < 0.02);
}

Test(random, below_is_in_range_and_covers)
{
    weft_rng_t r;
    int seen[7] = {0};

    weft_rng_init(&r, 1, 0);
    cr_assert_eq(weft_rng_below(&r, 0), 0);
    for (int i = 0; i < 7000; i++) {
        uint64_t v = weft_rng_below(&r, 7);
        cr_assert(v < 7);
        seen[v]++;
    }
    for (int i = 0; i < 7; i++) {
        cr_assert(seen[i] > 800 && seen[i] < 1200, "value %d seen %d times", i, seen[i]);
    }
}

Test(random, kaiming_and_xavier_bounds)
{
    int64_t shape[2] = {256, 784};
    weft_tensor_t *w = NULL;
    weft_rng_t r;
    double bound = sqrt(2.0 / (1 + 5.0)) * sqrt(3.0 / 784);
    double xb = sqrt(6.0 / (784 + 256));
    double mx = 0;

    weft_rng_init(&r, 5, 0);
    cr_assert_eq(weft_tensor_empty(WEFT_F32, 2, shape, &w), WEFT_OK);
    cr_assert_eq(weft_init_kaiming_uniform(w, sqrt(5.0), &r), WEFT_OK);
    for (int64_t i = 0; i < weft_tensor_numel(w); i++) {
        double v = ((float *)weft_tensor_data(w))[i];
        cr_assert(fabs(v) <= bound * (1 + 1e-6));
        mx = fmax(mx, fabs(v));
    }
    cr_assert(mx > bound * 0.99, "the bound is reached");
    cr_assert_eq(weft_init_xavier_uniform(w, 1.0, &r), WEFT_OK);
    for (int64_t i = 0; i < weft_tensor_numel(w); i++) {
        cr_assert(fabs(((float *)weft_tensor_data(w))[i]) <= xb * (1 + 1e-6));
    }
    weft_tensor_release(w);
}

Test(random, errors)
{
    int64_t n = 4;
    weft_tensor_t *v = NULL;
    weft_tensor_t *i = NULL;
    weft_rng_t r;
    int64_t fi;

    weft_rng_init(&r, 1, 0);
    cr_assert_eq(weft_tensor_create(WEFT_F32, 1, &n, &v), WEFT_OK);
    cr_assert_eq(weft_tensor_create(WEFT_I64, 1, &n, &i), WEFT_OK);
    cr_assert_eq(weft_tensor_fill_uniform(i, 0, 1, &r), WEFT_ERR_DTYPE);
    cr_assert_eq(weft_tensor_fill_uniform(v, 1, 0, &r), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(weft_tensor_fill_normal(v, 0, -1, &r), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(weft_init_fans(v, &fi, NULL), WEFT_ERR_SHAPE);
    cr_assert_eq(weft_tensor_fill(i, 3), WEFT_OK);
    cr_assert_eq(((int64_t *)weft_tensor_data(i))[3], 3);
    weft_tensor_release(v);
    weft_tensor_release(i);
}
