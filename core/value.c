/* Values: a growable list of tensor references, an owned byte payload and a list of references
 * to upper modules' objects (RRefs). */
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"

typedef struct {
    const weft_value_ref_type_t *type;
    void *obj; /* one reference, dropped with type->release */
} ref_t;

struct weft_value {
    weft_tensor_t **tensors;
    size_t num_tensors;
    size_t cap_tensors;
    void *payload;
    size_t payload_len;
    ref_t *refs;
    size_t num_refs;
    size_t cap_refs;
};

weft_status_t weft_value_create(weft_value_t **v_p)
{
    weft_value_t *v;

    if (v_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "value: v_p is NULL");
    }
    v = weft_calloc(1, sizeof(*v));
    if (v == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "value: out of memory");
    }
    *v_p = v;
    return WEFT_OK;
}

void weft_value_free(weft_value_t *v)
{
    if (v == NULL) {
        return;
    }
    for (size_t i = 0; i < v->num_tensors; i++) {
        weft_tensor_release(v->tensors[i]);
    }
    weft_free(v->tensors);
    weft_free(v->payload);
    for (size_t i = 0; i < v->num_refs; i++) {
        v->refs[i].type->release(v->refs[i].obj);
    }
    weft_free(v->refs);
    weft_free(v);
}

/* Makes room for one more tensor. */
static weft_status_t reserve_one(weft_value_t *v)
{
    weft_tensor_t **grown;
    size_t cap;

    if (v->num_tensors < v->cap_tensors) {
        return WEFT_OK;
    }
    cap = v->cap_tensors == 0 ? 4 : v->cap_tensors * 2;
    if (cap > SIZE_MAX / sizeof(*grown)) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "value: too many tensors");
    }
    grown = weft_realloc(v->tensors, cap * sizeof(*grown));
    if (grown == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "value: out of memory for %zu tensors", cap);
    }
    v->tensors = grown;
    v->cap_tensors = cap;
    return WEFT_OK;
}

weft_status_t weft_value_push_tensor(weft_value_t *v, weft_tensor_t *t)
{
    if (v == NULL || t == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "value: NULL value or tensor");
    }
    WEFT_CHECK(reserve_one(v));
    v->tensors[v->num_tensors++] = t;
    return WEFT_OK;
}

weft_status_t weft_value_add_tensor(weft_value_t *v, weft_tensor_t *t)
{
    if (v == NULL || t == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "value: NULL value or tensor");
    }
    WEFT_CHECK(reserve_one(v));
    v->tensors[v->num_tensors++] = weft_tensor_retain(t);
    return WEFT_OK;
}

weft_status_t weft_value_take_payload(weft_value_t *v, void *data, size_t len)
{
    if (v == NULL || (data == NULL && len > 0)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "value: NULL value or payload");
    }
    if (data != v->payload) {
        weft_free(v->payload);
    }
    if (len == 0) {
        /* An empty payload reads as NULL: the taken buffer is not needed. */
        weft_free(data);
        data = NULL;
    }
    v->payload = data;
    v->payload_len = len;
    return WEFT_OK;
}

weft_status_t weft_value_set_payload(weft_value_t *v, const void *data, size_t len)
{
    void *copy = NULL;

    if (v == NULL || (data == NULL && len > 0)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "value: NULL value or payload");
    }
    if (len > 0) {
        /* Copy before freeing the old payload: @p data may point into it. */
        copy = weft_alloc(len);
        if (copy == NULL) {
            return weft__set_error(WEFT_ERR_NO_MEMORY, "value: out of memory for %zu bytes", len);
        }
        memcpy(copy, data, len);
    }
    return weft_value_take_payload(v, copy, len);
}

weft_status_t weft_value_set_string(weft_value_t *v, const char *s)
{
    if (s == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "value: NULL string");
    }
    return weft_value_set_payload(v, s, strlen(s));
}

/* Makes room for one more reference. */
static weft_status_t reserve_ref(weft_value_t *v)
{
    ref_t *grown;
    size_t cap;

    if (v->num_refs < v->cap_refs) {
        return WEFT_OK;
    }
    cap = v->cap_refs == 0 ? 2 : v->cap_refs * 2;
    if (cap > SIZE_MAX / sizeof(*grown)) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "value: too many references");
    }
    grown = weft_realloc(v->refs, cap * sizeof(*grown));
    if (grown == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "value: out of memory for %zu references", cap);
    }
    v->refs = grown;
    v->cap_refs = cap;
    return WEFT_OK;
}

static bool ref_type_valid(const weft_value_ref_type_t *type)
{
    return type != NULL && type->retain != NULL && type->release != NULL;
}

weft_status_t weft__value_push_ref(weft_value_t *v, const weft_value_ref_type_t *type, void *obj)
{
    if (v == NULL || !ref_type_valid(type) || obj == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "value: NULL value, type or object");
    }
    WEFT_CHECK(reserve_ref(v));
    v->refs[v->num_refs].type = type;
    v->refs[v->num_refs].obj = obj;
    v->num_refs++;
    return WEFT_OK;
}

weft_status_t weft_value_add_ref(weft_value_t *v, const weft_value_ref_type_t *type, void *obj)
{
    WEFT_CHECK(weft__value_push_ref(v, type, obj));
    type->retain(obj);
    return WEFT_OK;
}

size_t weft_value_num_refs(const weft_value_t *v)
{
    return v == NULL ? 0 : v->num_refs;
}

void *weft_value_ref(const weft_value_t *v, size_t i, uint32_t *kind_p)
{
    if (v == NULL || i >= v->num_refs) {
        return NULL;
    }
    if (kind_p != NULL) {
        *kind_p = v->refs[i].type->kind;
    }
    return v->refs[i].obj;
}

void *weft__value_ref_at(const weft_value_t *v, size_t i, const weft_value_ref_type_t **type_p)
{
    if (v == NULL || i >= v->num_refs) {
        return NULL;
    }
    *type_p = v->refs[i].type;
    return v->refs[i].obj;
}

void weft__value_replace_ref(weft_value_t *v, size_t i, const weft_value_ref_type_t *type,
                             void *obj)
{
    ref_t old = v->refs[i];

    v->refs[i].type = type;
    v->refs[i].obj = obj;
    old.type->release(old.obj);
}

size_t weft_value_num_tensors(const weft_value_t *v)
{
    return v == NULL ? 0 : v->num_tensors;
}

weft_tensor_t *weft_value_tensor(const weft_value_t *v, size_t i)
{
    if (v == NULL || i >= v->num_tensors) {
        return NULL;
    }
    return v->tensors[i];
}

const void *weft_value_payload(const weft_value_t *v, size_t *len_p)
{
    if (v == NULL) {
        if (len_p != NULL) {
            *len_p = 0;
        }
        return NULL;
    }
    if (len_p != NULL) {
        *len_p = v->payload_len;
    }
    return v->payload;
}

size_t weft__value_tensors_nbytes(const weft_value_t *v)
{
    size_t sum = 0;

    if (v == NULL) {
        return 0;
    }
    for (size_t i = 0; i < v->num_tensors; i++) {
        sum += weft_tensor_nbytes(v->tensors[i]);
    }
    return sum;
}
