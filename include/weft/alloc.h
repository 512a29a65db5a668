/* Replaceable allocator: all weft memory goes through these. */
#ifndef WEFT_ALLOC_H
#define WEFT_ALLOC_H

#include <weft/api.h>

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    void *(*malloc_fn)(size_t size, void *ctx);
    void *(*realloc_fn)(void *ptr, size_t size, void *ctx);
    void (*free_fn)(void *ptr, void *ctx);
    void *ctx;
} weft_allocator_t;

/**
 * Replaces the allocator used by every weft allocation from now on (protobuf
 * unpacking included). Call before any other weft call; memory allocated by
 * the previous allocator must not be alive. NULL restores the C library's.
 * Not thread-safe.
 */
WEFT_API void weft_set_allocator(const weft_allocator_t *allocator);

/** malloc/calloc/realloc/free through the current allocator. Thread-safe. */
WEFT_API void *weft_alloc(size_t size);
WEFT_API void *weft_calloc(size_t count, size_t size);
WEFT_API void *weft_realloc(void *ptr, size_t size);
WEFT_API void weft_free(void *ptr);
/** Duplicates a NUL-terminated string (NULL for NULL). Caller frees with weft_free. */
WEFT_API char *weft_strdup(const char *s);

#ifdef __cplusplus
}
#endif
#endif
