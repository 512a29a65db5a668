/* A counting allocator for the core tests: every test checks that what it
 * allocated through weft was freed. Header-only: each test binary has one. */
#ifndef WEFT_TEST_COUNTING_ALLOC_H
#define WEFT_TEST_COUNTING_ALLOC_H

#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdlib.h>

#include <weft/alloc.h>
#include <weft/tensor.h>

static atomic_long n_alloc;
static atomic_long n_free;

static void *count_malloc(size_t size, void *ctx)
{
    (void)ctx;
    atomic_fetch_add(&n_alloc, 1);
    return malloc(size);
}

static void *count_realloc(void *p, size_t size, void *ctx)
{
    (void)ctx;
    return realloc(p, size);
}

static void count_free(void *p, void *ctx)
{
    (void)ctx;
    atomic_fetch_add(&n_free, 1);
    free(p);
}

static const weft_allocator_t counting = {count_malloc, count_realloc, count_free, NULL};

static inline void use_counting(void)
{
    weft_set_allocator(&counting);
}

/* Called at the end of each test (criterion does not fail a test from .fini). */
static inline void check_balanced(void)
{
    /* Blocks that released tensors left in the cache for reuse are not leaks: give them back. */
    weft_tensor_cache_clear();
    cr_assert_eq(atomic_load(&n_alloc), atomic_load(&n_free), "%ld allocations, %ld frees",
                 atomic_load(&n_alloc), atomic_load(&n_free));
}

#endif
