/* A value: a list of tensors plus an opaque byte payload (RPC args/results, RRef values). */
#ifndef WEFT_VALUE_H
#define WEFT_VALUE_H

#include <weft/api.h>

#include <stddef.h>
#include <stdint.h>

#include <weft/tensor.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct weft_value weft_value_t;

/** Creates an empty value. Caller frees with weft_value_free. */
WEFT_API weft_status_t weft_value_create(weft_value_t **v_p);
/** Frees the value and drops its tensor references. NULL is a no-op. */
WEFT_API void weft_value_free(weft_value_t *v);

/** Appends @p t; the value takes its own reference (the caller keeps its one). */
WEFT_API weft_status_t weft_value_add_tensor(weft_value_t *v, weft_tensor_t *t);
/** Appends @p t, taking over the caller's reference on success; caller keeps it on failure. */
WEFT_API weft_status_t weft_value_push_tensor(weft_value_t *v, weft_tensor_t *t);
/** Replaces the payload with a copy of @p len bytes at @p data. */
WEFT_API weft_status_t weft_value_set_payload(weft_value_t *v, const void *data, size_t len);
/** Sets the payload to a NUL-terminated string's bytes (without the NUL). */
WEFT_API weft_status_t weft_value_set_string(weft_value_t *v, const char *s);
/** Takes ownership of @p data (allocated with weft_alloc) on success. */
WEFT_API weft_status_t weft_value_take_payload(weft_value_t *v, void *data, size_t len);

/*
 * References: objects of upper modules that travel inside a value (an RRef in the arguments or the
 * result of a call). On the wire each is encoded by the codec its kind is registered with
 * (weft_module_desc_t.codec, weft/module.h); in a value it is the module's object plus how to retain and
 * release it.
 */
typedef struct {
    uint32_t kind;              /**< the codec's kind (WEFT_REF_KIND_*) */
    void (*retain)(void *obj);  /**< adds a reference to obj */
    void (*release)(void *obj); /**< drops one */
} weft_value_ref_type_t;

/** Kinds of references (codecs). */
#define WEFT_REF_KIND_RREF 1u

/**
 * Appends a reference to @p obj of @p type (borrowed; must outlive the value). The value takes
 * its own reference to @p obj (type->retain) and drops it when freed. Sending the value sends the
 * reference (see weft_module_desc_t.codec in weft/module.h).
 * @return WEFT_ERR_INVALID_ARG (NULL value, type, callback or object), WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_value_add_ref(weft_value_t *v, const weft_value_ref_type_t *type,
                                          void *obj);
/** Number of references in @p v (0 for NULL). */
WEFT_API size_t weft_value_num_refs(const weft_value_t *v);
/** Borrowed object of reference @p i (NULL when out of range); its kind goes to @p kind_p. */
WEFT_API void *weft_value_ref(const weft_value_t *v, size_t i, uint32_t *kind_p);

WEFT_API size_t weft_value_num_tensors(const weft_value_t *v);
/** Borrowed; valid while @p v lives. NULL when @p i is out of range. */
WEFT_API weft_tensor_t *weft_value_tensor(const weft_value_t *v, size_t i);
/** Borrowed payload pointer (NULL when empty); its length goes to @p len_p. */
WEFT_API const void *weft_value_payload(const weft_value_t *v, size_t *len_p);

#ifdef __cplusplus
}
#endif
#endif
