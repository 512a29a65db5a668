/* The replaceable allocator and string helpers built on it. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static void *libc_malloc(size_t size, void *ctx)
{
    (void)ctx;
    return malloc(size);
}

static void *libc_realloc(void *ptr, size_t size, void *ctx)
{
    (void)ctx;
    return realloc(ptr, size);
}

static void libc_free(void *ptr, void *ctx)
{
    (void)ctx;
    free(ptr);
}

static const weft_allocator_t libc_allocator = {
    .malloc_fn = libc_malloc,
    .realloc_fn = libc_realloc,
    .free_fn = libc_free,
    .ctx = NULL,
};

static weft_allocator_t allocator = {
    .malloc_fn = libc_malloc,
    .realloc_fn = libc_realloc,
    .free_fn = libc_free,
    .ctx = NULL,
};

void weft_set_allocator(const weft_allocator_t *a)
{
    /* Blocks kept for reuse belong to the allocator being replaced. */
    weft_tensor_cache_clear();
    /* An allocator missing any function cannot be used consistently: keep the C library's. */
    if (a == NULL || a->malloc_fn == NULL || a->realloc_fn == NULL || a->free_fn == NULL) {
        allocator = libc_allocator;
        return;
    }
    allocator = *a;
}

void *weft_alloc(size_t size)
{
    /* Size 0 still gets a unique pointer (malloc(0) may return NULL). */
    return allocator.malloc_fn(size == 0 ? 1 : size, allocator.ctx);
}

void *weft_calloc(size_t count, size_t size)
{
    size_t total;
    void *p;

    if (__builtin_mul_overflow(count, size, &total)) {
        return NULL;
    }
    p = weft_alloc(total);
    if (p == NULL) {
        return NULL;
    }
    memset(p, 0, total);
    return p;
}

void *weft_realloc(void *ptr, size_t size)
{
    if (ptr == NULL) {
        return weft_alloc(size);
    }
    return allocator.realloc_fn(ptr, size == 0 ? 1 : size, allocator.ctx);
}

void weft_free(void *ptr)
{
    if (ptr == NULL) {
        return;
    }
    allocator.free_fn(ptr, allocator.ctx);
}

char *weft_strdup(const char *s)
{
    size_t len;
    char *copy;

    if (s == NULL) {
        return NULL;
    }
    len = strlen(s);
    copy = weft_alloc(len + 1);
    if (copy == NULL) {
        return NULL;
    }
    memcpy(copy, s, len + 1);
    return copy;
}

char *weft__vstrfmt(const char *fmt, va_list ap)
{
    va_list ap2;
    int len;
    char *s;

    va_copy(ap2, ap);
    len = vsnprintf(NULL, 0, fmt, ap2);
    va_end(ap2);
    if (len < 0) {
        return NULL;
    }
    s = weft_alloc((size_t)len + 1);
    if (s == NULL) {
        return NULL;
    }
    vsnprintf(s, (size_t)len + 1, fmt, ap);
    return s;
}

char *weft__strfmt(const char *fmt, ...)
{
    va_list ap;
    char *s;

    va_start(ap, fmt);
    s = weft__vstrfmt(fmt, ap);
    va_end(ap);
    return s;
}
