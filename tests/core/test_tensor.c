/* core: dtypes, shapes, tensor create/wrap/view/clone/equal and storage lifetime. */
#include <criterion/criterion.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "counting_alloc.h"
#include "internal.h"

/* n_alloc, n_free, counting, use_counting, check_balanced */

static atomic_int released;
static void *released_data;

static void on_release(void *data, void *arg)
{
    atomic_fetch_add(&released, 1);
    released_data = data;
    cr_assert_eq(arg, (void *)&released);
}

TestSuite(tensor, .init = use_counting, .timeout = 30);

Test(tensor, dtypes)
{
    const size_t sizes[] = {4, 8, 2, 2, 1, 4, 8, 1, 1};
    const char *names[] = {"f32", "f64", "f16", "bf16", "i8", "i32", "i64", "u8", "bool"};

    for (int d = 0; d < WEFT_DTYPE_COUNT; d++) {
        cr_assert(weft_dtype_valid(d));
        cr_assert_eq(weft_dtype_size((weft_dtype_t)d), sizes[d]);
        cr_assert_str_eq(weft_dtype_name((weft_dtype_t)d), names[d]);
    }
    cr_assert_not(weft_dtype_valid(-1));
    cr_assert_not(weft_dtype_valid(WEFT_DTYPE_COUNT));
    cr_assert_eq(weft_dtype_size(WEFT_DTYPE_COUNT), 0);
    cr_assert_str_eq(weft_dtype_name((weft_dtype_t)-3), "invalid");
    check_balanced();
}

Test(tensor, shape_numel)
{
    const int64_t s3[] = {2, 3, 4};
    const int64_t zero[] = {5, 0, 7};
    const int64_t neg[] = {2, -1};
    const int64_t big[] = {INT64_C(1) << 32, INT64_C(1) << 32};
    const int64_t big_zero[] = {INT64_C(1) << 40, INT64_C(1) << 40, 0};
    const int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};

    cr_assert_eq(weft_shape_numel(0, NULL), 1);
    cr_assert_eq(weft_shape_numel(3, s3), 24);
    cr_assert_eq(weft_shape_numel(3, zero), 0);
    cr_assert_eq(weft_shape_numel(3, big_zero), 0);
    cr_assert_eq(weft_shape_numel(2, neg), -1);
    cr_assert_eq(weft_shape_numel(2, big), -1);
    cr_assert_eq(weft_shape_numel(9, nine), -1);
    cr_assert_eq(weft_shape_numel(-1, s3), -1);
    cr_assert_eq(weft_shape_numel(2, NULL), -1);
    check_balanced();
}

Test(tensor, create_is_zeroed_and_aligned)
{
    const int64_t shape[] = {3, 5};
    weft_tensor_t *t = NULL;
    float *data;

    cr_assert_eq(weft_tensor_create(WEFT_F32, 2, shape, &t), WEFT_OK);
    cr_assert_eq(weft_tensor_ndim(t), 2);
    cr_assert_eq(weft_tensor_shape(t)[0], 3);
    cr_assert_eq(weft_tensor_shape(t)[1], 5);
    cr_assert_eq(weft_tensor_numel(t), 15);
    cr_assert_eq(weft_tensor_nbytes(t), 60);
    cr_assert_eq(weft_tensor_dtype(t), WEFT_F32);
    cr_assert_eq(weft_tensor_device(t).type, WEFT_DEVICE_CPU);
    data = weft_tensor_data(t);
    cr_assert_not_null(data);
    cr_assert_eq((uintptr_t)data % WEFT__TENSOR_ALIGN, 0);
    for (int i = 0; i < 15; i++) {
        cr_assert_eq(data[i], 0.0f);
    }
    data[14] = 1.5f; /* the whole buffer is writable */
    cr_assert_geq(atomic_load(&n_alloc), 1, "the counting allocator is in use");
    weft_tensor_release(t);
    check_balanced();
}

Test(tensor, empty_every_dtype)
{
    const int64_t shape[] = {7};

    for (int d = 0; d < WEFT_DTYPE_COUNT; d++) {
        weft_tensor_t *t = NULL;

        cr_assert_eq(weft_tensor_empty((weft_dtype_t)d, 1, shape, &t), WEFT_OK);
        cr_assert_eq(weft_tensor_nbytes(t), 7 * weft_dtype_size((weft_dtype_t)d));
        cr_assert_eq((uintptr_t)weft_tensor_data(t) % 16, 0);
        memset(weft_tensor_data(t), 0xab, weft_tensor_nbytes(t));
        weft_tensor_release(t);
    }
    check_balanced();
}

Test(tensor, scalar_and_empty_shapes)
{
    const int64_t zero[] = {4, 0, 2};
    weft_tensor_t *s = NULL;
    weft_tensor_t *z = NULL;
    weft_tensor_t *z2 = NULL;

    cr_assert_eq(weft_tensor_create(WEFT_F64, 0, NULL, &s), WEFT_OK);
    cr_assert_eq(weft_tensor_ndim(s), 0);
    cr_assert_eq(weft_tensor_numel(s), 1);
    cr_assert_eq(weft_tensor_nbytes(s), 8);
    cr_assert_eq(*(double *)weft_tensor_data(s), 0.0);

    cr_assert_eq(weft_tensor_create(WEFT_I32, 3, zero, &z), WEFT_OK);
    cr_assert_eq(weft_tensor_numel(z), 0);
    cr_assert_eq(weft_tensor_nbytes(z), 0);
    cr_assert_not_null(weft_tensor_data(z));
    cr_assert_eq(weft_tensor_clone(z, &z2), WEFT_OK);
    cr_assert(weft_tensor_equal(z, z2));
    weft_tensor_release(s);
    weft_tensor_release(z);
    weft_tensor_release(z2);
    check_balanced();
}

static void check_bad_shape(int dtype, int ndim, const int64_t *shape, const char *needle)
{
    weft_tensor_t *sentinel = (weft_tensor_t *)(uintptr_t)0x1234;
    weft_tensor_t *t = sentinel;

    weft__clear_error();
    cr_assert_eq(weft_tensor_create((weft_dtype_t)dtype, ndim, shape, &t), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(t, sentinel, "output set on failure");
    cr_assert_str_neq(weft_last_error(), "");
    cr_assert_not_null(strstr(weft_last_error(), needle), "error text: %s", weft_last_error());
    weft__clear_error();
    cr_assert_eq(weft_tensor_empty((weft_dtype_t)dtype, ndim, shape, &t), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(t, sentinel);
    cr_assert_str_neq(weft_last_error(), "");
}

Test(tensor, bad_shapes)
{
    const int64_t neg[] = {2, 3, 4, -2};
    const int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    const int64_t over[] = {INT64_C(1) << 31, INT64_C(1) << 31, 4};
    const int64_t bytes_over[] = {INT64_C(1) << 62}; /* numel fits, bytes do not */
    const int64_t ok[] = {2};

    check_bad_shape(WEFT_F32, 4, neg, "dim 3 has negative size -2");
    check_bad_shape(WEFT_F32, 9, nine, "9 dims");
    check_bad_shape(WEFT_F32, -1, ok, "-1 dims");
    check_bad_shape(WEFT_F32, 3, over, "overflow");
    check_bad_shape(WEFT_F32, 1, bytes_over, "overflow");
    check_bad_shape(WEFT_F32, 2, NULL, "NULL");
    check_bad_shape(WEFT_DTYPE_COUNT, 1, ok, "invalid dtype 9");
    check_bad_shape(-1, 1, ok, "invalid dtype -1");
    check_balanced();
}

Test(tensor, shape_check_reports_sizes)
{
    const int64_t shape[] = {3, 4};
    int64_t numel = -7;
    size_t nbytes = 7;

    cr_assert_eq(weft__tensor_shape_check(WEFT_I64, 2, shape, &numel, &nbytes), WEFT_OK);
    cr_assert_eq(numel, 12);
    cr_assert_eq(nbytes, 96);
    cr_assert_eq(weft__tensor_shape_check(WEFT_I64, 2, shape, NULL, NULL), WEFT_OK);
    cr_assert_eq(weft__tensor_shape_check(42, 2, shape, &numel, &nbytes), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(numel, 12);
    cr_assert_eq(nbytes, 96);
    check_balanced();
}

Test(tensor, wrap_release_fires_once_after_last_view)
{
    static int32_t buf[12];
    const int64_t shape[] = {3, 4};
    const int64_t flat[] = {12};
    const int64_t cube[] = {2, 2, 3};
    weft_tensor_t *t = NULL;
    weft_tensor_t *v1 = NULL;
    weft_tensor_t *v2 = NULL;

    for (int i = 0; i < 12; i++) {
        buf[i] = i;
    }
    cr_assert_eq(weft_tensor_wrap(WEFT_I32, 2, shape, buf, sizeof(buf), WEFT_CPU, on_release,
                                  (void *)&released, &t),
                 WEFT_OK);
    cr_assert_eq(weft_tensor_data(t), buf);
    cr_assert_eq(weft_tensor_view(t, 1, flat, &v1), WEFT_OK);
    cr_assert_eq(weft_tensor_view(v1, 3, cube, &v2), WEFT_OK);
    cr_assert_eq(weft_tensor_data(v1), buf);
    cr_assert_eq(weft_tensor_data(v2), buf);
    cr_assert_eq(weft_tensor_numel(v2), 12);
    cr_assert_eq(weft_tensor_ndim(v2), 3);
    ((int32_t *)weft_tensor_data(v2))[5] = 500;
    cr_assert_eq(buf[5], 500);

    weft_tensor_retain(t);
    weft_tensor_release(t);
    weft_tensor_release(t);
    cr_assert_eq(atomic_load(&released), 0);
    weft_tensor_release(v2);
    cr_assert_eq(atomic_load(&released), 0);
    cr_assert_eq(((int32_t *)weft_tensor_data(v1))[11], 11);
    weft_tensor_release(v1);
    cr_assert_eq(atomic_load(&released), 1);
    cr_assert_eq(released_data, buf);
    weft_tensor_release(NULL);
    check_balanced();
}

Test(tensor, wrap_bad_arguments_keep_the_buffer)
{
    static float buf[4];
    const int64_t shape[] = {4};
    weft_tensor_t *t = NULL;

    cr_assert_eq(
        weft_tensor_wrap(WEFT_F32, 1, shape, buf, 15, WEFT_CPU, on_release, (void *)&released, &t),
        WEFT_ERR_INVALID_ARG);
    cr_assert_not_null(strstr(weft_last_error(), "15 bytes"));
    cr_assert_eq(
        weft_tensor_wrap(WEFT_F32, 1, shape, NULL, 16, WEFT_CPU, on_release, (void *)&released, &t),
        WEFT_ERR_INVALID_ARG);
    cr_assert_null(t);
    cr_assert_eq(atomic_load(&released), 0);
    check_balanced();
}

Test(tensor, wrap_without_release_and_on_device)
{
    static double buf[2] = {1.0, 2.0};
    const int64_t shape[] = {2};
    weft_device_t gpu = {WEFT_DEVICE_CUDA, 1};
    weft_tensor_t *t = NULL;
    weft_tensor_t *g = NULL;
    weft_tensor_t *c = NULL;

    cr_assert_eq(weft_tensor_wrap(WEFT_F64, 1, shape, buf, sizeof(buf), WEFT_CPU, NULL, NULL, &t),
                 WEFT_OK);
    cr_assert_eq(
        weft_tensor_wrap(WEFT_F64, 1, shape, (void *)(uintptr_t)0x1000, 16, gpu, NULL, NULL, &g),
        WEFT_OK);
    cr_assert_eq(weft_tensor_device(g).type, WEFT_DEVICE_CUDA);
    cr_assert_eq(weft_tensor_device(g).index, 1);
    cr_assert_eq(weft_tensor_clone(g, &c), WEFT_ERR_UNSUPPORTED);
    cr_assert_null(c);
    cr_assert_not(weft_tensor_equal(t, g));
    cr_assert(weft_tensor_equal(g, g));
    weft_tensor_release(t);
    weft_tensor_release(g);
    check_balanced();
}

Test(tensor, view_of_another_size_fails)
{
    const int64_t shape[] = {2, 3};
    const int64_t wrong[] = {7};
    const int64_t neg[] = {-6};
    weft_tensor_t *t = NULL;
    weft_tensor_t *v = NULL;

    cr_assert_eq(weft_tensor_create(WEFT_U8, 2, shape, &t), WEFT_OK);
    cr_assert_eq(weft_tensor_view(t, 1, wrong, &v), WEFT_ERR_SHAPE);
    cr_assert_null(v);
    cr_assert_str_neq(weft_last_error(), "");
    cr_assert_eq(weft_tensor_view(t, 1, neg, &v), WEFT_ERR_INVALID_ARG);
    cr_assert_null(v);
    weft_tensor_release(t);
    check_balanced();
}

Test(tensor, clone_and_equal)
{
    const int64_t shape[] = {2, 2};
    const int64_t flat[] = {4};
    weft_tensor_t *a = NULL;
    weft_tensor_t *b = NULL;
    weft_tensor_t *c = NULL;
    weft_tensor_t *d = NULL;
    weft_tensor_t *f = NULL;
    float *pa;

    cr_assert_eq(weft_tensor_create(WEFT_F32, 2, shape, &a), WEFT_OK);
    pa = weft_tensor_data(a);
    for (int i = 0; i < 4; i++) {
        pa[i] = (float)i + 0.5f;
    }
    cr_assert_eq(weft_tensor_clone(a, &b), WEFT_OK);
    cr_assert_neq(weft_tensor_data(a), weft_tensor_data(b));
    cr_assert(weft_tensor_equal(a, b));
    ((float *)weft_tensor_data(b))[3] = -1.0f;
    cr_assert_not(weft_tensor_equal(a, b));
    cr_assert_eq(pa[3], 3.5f);

    cr_assert_eq(weft_tensor_create(WEFT_I32, 2, shape, &c), WEFT_OK); /* same bytes size */
    memcpy(weft_tensor_data(c), pa, 16);
    cr_assert_not(weft_tensor_equal(a, c), "dtype differs");
    cr_assert_eq(weft_tensor_view(a, 1, flat, &d), WEFT_OK);
    cr_assert_not(weft_tensor_equal(a, d), "shape differs");
    cr_assert_eq(weft_tensor_clone(d, &f), WEFT_OK);
    cr_assert(weft_tensor_equal(d, f));
    cr_assert_eq(weft_tensor_ndim(f), 1);
    weft_tensor_release(a);
    weft_tensor_release(b);
    weft_tensor_release(c);
    weft_tensor_release(d);
    weft_tensor_release(f);
    check_balanced();
}

#define RACE_THREADS 4
#define RACE_ROUNDS  20000

static void *retain_release_loop(void *arg)
{
    weft_tensor_t *t = arg;

    for (int i = 0; i < RACE_ROUNDS; i++) {
        weft_tensor_release(weft_tensor_retain(t));
    }
    weft_tensor_release(t);
    return NULL;
}

Test(tensor, concurrent_references)
{
    static uint8_t buf[64];
    const int64_t shape[] = {64};
    pthread_t th[RACE_THREADS];
    weft_tensor_t *t = NULL;

    cr_assert_eq(weft_tensor_wrap(WEFT_U8, 1, shape, buf, sizeof(buf), WEFT_CPU, on_release,
                                  (void *)&released, &t),
                 WEFT_OK);
    for (int i = 0; i < RACE_THREADS; i++) {
        weft_tensor_t *v = NULL;

        /* Each thread gets its own view (shared storage) and drops it at the end. */
        cr_assert_eq(weft_tensor_view(t, 1, shape, &v), WEFT_OK);
        cr_assert_eq(pthread_create(&th[i], NULL, retain_release_loop, v), 0);
    }
    weft_tensor_release(t);
    for (int i = 0; i < RACE_THREADS; i++) {
        pthread_join(th[i], NULL);
    }
    cr_assert_eq(atomic_load(&released), 1);
    check_balanced();
}

/* A tensor that grows as its bytes arrive: the bytes written before each growth survive, the
 * result is a normal tensor whose block goes back to the large-block cache, and the next one of
 * its size starts from that block, whole. */
Test(tensor, grows_as_its_bytes_arrive)
{
    const int64_t n = (int64_t)5 << 20; /* 5 MiB of u8 */
    weft__tgrow_t *g = NULL;
    uint8_t *data = NULL;
    size_t cap = 0, got = 0;

    weft_tensor_cache_clear();
    cr_assert_eq(weft__tensor_grow_begin(WEFT_U8, 1, &n, 1 << 20, &g, &data, &cap), WEFT_OK);
    cr_assert_eq(cap, (size_t)1 << 20, "starts with what was asked, not the whole");
    while (got < (size_t)n) {
        if (got == cap) {
            cr_assert_eq(weft__tensor_grow_to(g, cap * 2, got, &data), WEFT_OK);
            cap = cap * 2 < (size_t)n ? cap * 2 : (size_t)n;
        }
        for (; got < cap; got++) {
            data[got] = (uint8_t)(got * 7 + got / 4096);
        }
    }
    weft_tensor_t *t = NULL;
    cr_assert_eq(weft__tensor_grow_end(g, &t), WEFT_OK);
    cr_assert_eq(weft_tensor_numel(t), n);
    cr_assert_eq((uintptr_t)weft_tensor_data(t) % WEFT__TENSOR_ALIGN, 0);
    const uint8_t *p = weft_tensor_data(t);
    for (size_t i = 0; i < (size_t)n; i++) {
        if (p[i] != (uint8_t)(i * 7 + i / 4096)) {
            cr_assert_fail("byte %zu is %u", i, p[i]);
        }
    }
    weft_tensor_release(t); /* its block goes to the cache */
    cr_assert_eq(weft__tensor_grow_begin(WEFT_U8, 1, &n, 1 << 20, &g, &data, &cap), WEFT_OK);
    cr_assert_eq(cap, (size_t)n, "a cached block of the whole size is taken whole");
    weft__tensor_grow_abort(g);
    /* An abandoned one frees everything. */
    cr_assert_eq(weft__tensor_grow_begin(WEFT_F32, 1, &n, 4096, &g, &data, &cap), WEFT_OK);
    cr_assert_eq(weft__tensor_grow_to(g, 8192, 4096, &data), WEFT_OK);
    weft__tensor_grow_abort(g);
    weft_tensor_cache_clear();
    check_balanced();
}

/* A tensor of a few hundred KiB gives its block back to the cache when it goes, and the next one
 * of its size class (a quarter of its power of two) takes that block: no fresh pages for a
 * parameter server's replies made and freed per request. Nothing under 128 KiB is kept. */
Test(tensor, mid_size_blocks_are_kept_for_reuse_by_size_class)
{
    weft_tensor_cache_clear();
    int64_t a = 70000, b = 75000, c = 100000, tiny = 4000; /* f32: 280 KB, 300 KB, 400 KB */
    weft_tensor_t *t = NULL;
    cr_assert_eq(weft_tensor_create(WEFT_F32, 1, &a, &t), WEFT_OK);
    void *first = weft_tensor_data(t);
    memset(first, 0x5a, 4 * (size_t)a);
    weft_tensor_release(t);
    /* 300 KB: the same class (256 KiB + 64 KiB steps: 320 KiB) as 280 KB. */
    long before = atomic_load(&n_alloc);
    cr_assert_eq(weft_tensor_create(WEFT_F32, 1, &b, &t), WEFT_OK);
    cr_assert_eq(atomic_load(&n_alloc) - before, 1, "only the tensor is allocated, not its block");
    cr_assert_eq(weft_tensor_data(t), first, "a block of the same class is taken again");
    const float *p = weft_tensor_data(t);
    for (int64_t i = 0; i < b; i++) {
        if (p[i] != 0.0f) {
            cr_assert_fail("element %lld of a created tensor is %g, not 0", (long long)i, p[i]);
        }
    }
    weft_tensor_release(t);
    /* 400 KB is another class: a block of its own. */
    before = atomic_load(&n_alloc);
    cr_assert_eq(weft_tensor_create(WEFT_F32, 1, &c, &t), WEFT_OK);
    cr_assert_eq(atomic_load(&n_alloc) - before, 2, "the tensor and a block of its own");
    cr_assert_neq(weft_tensor_data(t), first, "a block of another class is not taken");
    weft_tensor_release(t);
    cr_assert_eq(weft_tensor_create(WEFT_F32, 1, &tiny, &t), WEFT_OK);
    cr_assert_neq(weft_tensor_data(t), first, "a small tensor takes no cached block");
    weft_tensor_release(t);
    weft_tensor_cache_clear();
    check_balanced();
}
