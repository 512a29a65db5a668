/* u64 -> pointer maps for the rows of sparse tables: open addressing, linear probing over slots
 * that hold the key and its value side by side (one cache line per probe), deletion by backward
 * shift (no tombstones), grown at 3/4 full. */
#include <string.h>

#include "internal.h"

static size_t slot_of(uint64_t key, size_t cap)
{
    return weft__ps_map_home(key, cap);
}

void *weft__ps_map_get(const ps_map_t *m, uint64_t key)
{
    if (m->cap == 0) {
        return NULL;
    }
    for (size_t i = slot_of(key, m->cap);; i = (i + 1) & (m->cap - 1)) {
        const ps_map_slot_t *e = &m->slots[i];
        if (e->val == NULL) {
            return NULL;
        }
        if (e->key == key) {
            return e->val;
        }
    }
}

static void insert(ps_map_slot_t *slots, size_t cap, uint64_t key, void *val)
{
    size_t i = slot_of(key, cap);
    while (slots[i].val != NULL) {
        i = (i + 1) & (cap - 1);
    }
    slots[i].key = key;
    slots[i].val = val;
}

static weft_status_t grow_to(ps_map_t *m, size_t cap)
{
    ps_map_slot_t *slots = weft_calloc(cap, sizeof(*slots));
    if (slots == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory for a map of %zu slots", cap);
    }
    for (size_t i = 0; i < m->cap; i++) {
        if (m->slots[i].val != NULL) {
            insert(slots, cap, m->slots[i].key, m->slots[i].val);
        }
    }
    weft_free(m->slots);
    m->slots = slots;
    m->cap = cap;
    return WEFT_OK;
}

static weft_status_t grow(ps_map_t *m)
{
    return grow_to(m, m->cap == 0 ? 64 : m->cap * 2);
}

weft_status_t weft__ps_map_reserve(ps_map_t *m, size_t n)
{
    size_t cap = m->cap == 0 ? 64 : m->cap;
    while ((n + 1) * 4 > cap * 3) {
        cap *= 2;
    }
    return cap == m->cap ? WEFT_OK : grow_to(m, cap);
}

weft_status_t weft__ps_map_put(ps_map_t *m, uint64_t key, void *val)
{
    if (m->cap != 0) {
        for (size_t i = slot_of(key, m->cap); m->slots[i].val != NULL; i = (i + 1) & (m->cap - 1)) {
            if (m->slots[i].key == key) {
                m->slots[i].val = val;
                return WEFT_OK;
            }
        }
    }
    if ((m->n + 1) * 4 > m->cap * 3) {
        WEFT_CHECK(grow(m));
    }
    insert(m->slots, m->cap, key, val);
    m->n++;
    return WEFT_OK;
}

void *weft__ps_map_del(ps_map_t *m, uint64_t key)
{
    if (m->cap == 0) {
        return NULL;
    }
    size_t mask = m->cap - 1, i = slot_of(key, m->cap);
    while (m->slots[i].val != NULL && m->slots[i].key != key) {
        i = (i + 1) & mask;
    }
    void *val = m->slots[i].val;
    if (val == NULL) {
        return NULL;
    }
    /* Backward shift: move later members of the run into the hole when their home allows. */
    size_t hole = i;
    for (size_t j = (i + 1) & mask; m->slots[j].val != NULL; j = (j + 1) & mask) {
        size_t home = slot_of(m->slots[j].key, m->cap);
        bool movable = hole <= j ? (home <= hole || home > j) : (home <= hole && home > j);
        if (movable) {
            m->slots[hole] = m->slots[j];
            hole = j;
        }
    }
    m->slots[hole].val = NULL;
    m->n--;
    return val;
}

bool weft__ps_map_next(const ps_map_t *m, size_t *pos, uint64_t *key_p, void **val_p)
{
    for (size_t i = *pos; i < m->cap; i++) {
        if (m->slots[i].val != NULL) {
            *key_p = m->slots[i].key;
            *val_p = m->slots[i].val;
            *pos = i + 1;
            return true;
        }
    }
    *pos = m->cap;
    return false;
}

void weft__ps_map_free(ps_map_t *m)
{
    weft_free(m->slots);
    memset(m, 0, sizeof(*m));
}
