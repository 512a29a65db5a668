/* u64 -> pointer maps for the rows of sparse tables: open addressing, linear probing, deletion by
 * backward shift (no tombstones), grown at 3/4 full. */
#include <string.h>

#include "internal.h"

static size_t slot_of(uint64_t key, size_t cap)
{
    return (size_t)((key * UINT64_C(0xff51afd7ed558ccd)) >> 17) & (cap - 1);
}

void *weft__ps_map_get(const ps_map_t *m, uint64_t key)
{
    if (m->cap == 0) {
        return NULL;
    }
    for (size_t i = slot_of(key, m->cap);; i = (i + 1) & (m->cap - 1)) {
        if (m->vals[i] == NULL) {
            return NULL;
        }
        if (m->keys[i] == key) {
            return m->vals[i];
        }
    }
}

static void insert(uint64_t *keys, void **vals, size_t cap, uint64_t key, void *val)
{
    size_t i = slot_of(key, cap);
    while (vals[i] != NULL) {
        i = (i + 1) & (cap - 1);
    }
    keys[i] = key;
    vals[i] = val;
}

static weft_status_t grow(ps_map_t *m)
{
    size_t cap = m->cap == 0 ? 64 : m->cap * 2;
    uint64_t *keys = weft_alloc(cap * sizeof(*keys));
    void **vals = weft_calloc(cap, sizeof(*vals));
    if (keys == NULL || vals == NULL) {
        weft_free(keys);
        weft_free(vals);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory for a map of %zu slots", cap);
    }
    for (size_t i = 0; i < m->cap; i++) {
        if (m->vals[i] != NULL) {
            insert(keys, vals, cap, m->keys[i], m->vals[i]);
        }
    }
    weft_free(m->keys);
    weft_free(m->vals);
    m->keys = keys;
    m->vals = vals;
    m->cap = cap;
    return WEFT_OK;
}

weft_status_t weft__ps_map_put(ps_map_t *m, uint64_t key, void *val)
{
    if (m->cap != 0) {
        for (size_t i = slot_of(key, m->cap); m->vals[i] != NULL; i = (i + 1) & (m->cap - 1)) {
            if (m->keys[i] == key) {
                m->vals[i] = val;
                return WEFT_OK;
            }
        }
    }
    if ((m->n + 1) * 4 > m->cap * 3) {
        WEFT_CHECK(grow(m));
    }
    insert(m->keys, m->vals, m->cap, key, val);
    m->n++;
    return WEFT_OK;
}

void *weft__ps_map_del(ps_map_t *m, uint64_t key)
{
    if (m->cap == 0) {
        return NULL;
    }
    size_t mask = m->cap - 1, i = slot_of(key, m->cap);
    while (m->vals[i] != NULL && m->keys[i] != key) {
        i = (i + 1) & mask;
    }
    void *val = m->vals[i];
    if (val == NULL) {
        return NULL;
    }
    /* Backward shift: move later members of the run into the hole when their home allows. */
    size_t hole = i;
    for (size_t j = (i + 1) & mask; m->vals[j] != NULL; j = (j + 1) & mask) {
        size_t home = slot_of(m->keys[j], m->cap);
        bool movable = hole <= j ? (home <= hole || home > j) : (home <= hole && home > j);
        if (movable) {
            m->keys[hole] = m->keys[j];
            m->vals[hole] = m->vals[j];
            hole = j;
        }
    }
    m->vals[hole] = NULL;
    m->n--;
    return val;
}

bool weft__ps_map_next(const ps_map_t *m, size_t *pos, uint64_t *key_p, void **val_p)
{
    for (size_t i = *pos; i < m->cap; i++) {
        if (m->vals[i] != NULL) {
            *key_p = m->keys[i];
            *val_p = m->vals[i];
            *pos = i + 1;
            return true;
        }
    }
    *pos = m->cap;
    return false;
}

void weft__ps_map_free(ps_map_t *m)
{
    weft_free(m->keys);
    weft_free(m->vals);
    memset(m, 0, sizeof(*m));
}
