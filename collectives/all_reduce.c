/* all_reduce over the agent's connections: the direct exchange (one round, for small
 * tensors) and the pipelined ring (reduce-scatter + all-gather, for large ones). Both run on
 * the group's worker, send pieces without copying (waiting until the transport has let go of
 * a region before writing into it again) and reduce straight from the received buffers. */
#include <string.h>

#include "internal.h"

/* Ring segments: large enough for the direct connections (>= 1 MiB), small enough
 * to overlap transfer and reduction. */
#define RING_SEGMENT_BYTES (2u << 20)

/* Every rank sends its whole buffer to every other and reduces all of them in
 * rank order: one round, identical results everywhere. The reduction runs in
 * place, once our own sends have let go of the buffer: the ranks before us are
 * folded into rank 0's received buffer, which is then combined with ours. */
weft_status_t coll__all_reduce_direct(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                                      bool *declined_p)
{
    const coll_desc_t *d = a->d;
    uint8_t *work = a->work;
    size_t count = a->count;
    weft_dtype_t wt = a->wt;
    const coll_kern_t *kern = &a->op->kern;
    int n = g->size, me = g->rank;
    weft_future_t **rel = weft_calloc((size_t)n, sizeof(*rel));
    coll_msg_t **msgs = weft_calloc((size_t)n, sizeof(*msgs));
    weft_status_t st = WEFT_OK;

    (void)declined_p; /* never declines */
    if (rel == NULL || msgs == NULL) {
        weft_free(rel);
        weft_free(msgs);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "all_reduce: no memory");
    }
    for (int r = 0; r < n && st == WEFT_OK; r++) {
        if (r != me) {
            st = coll__send(g, d, 0, r, count > 0 ? work : NULL, count, wt, &rel[r]);
        }
    }
    for (int r = 0; r < n && st == WEFT_OK; r++) {
        if (r == me) {
            continue;
        }
        st = coll__recv(g, d, 0, r, deadline, &msgs[r]);
        if (st == WEFT_OK && count > 0) {
            weft_tensor_t *t = coll__msg_tensor(msgs[r]);
            if (t == NULL || weft_tensor_dtype(t) != wt || (size_t)weft_tensor_numel(t) != count) {
                st = weft__set_error(WEFT_ERR_PROTOCOL,
                                     "all_reduce: group rank %d sent a piece of the wrong size", r);
            }
        }
    }
    weft_status_t w = coll__wait_released(rel, (size_t)n, deadline);
    if (st == WEFT_OK) {
        st = w;
    }
    if (st == WEFT_OK && count > 0) {
#define PIECE(r) ((uint8_t *)weft_tensor_data(coll__msg_tensor(msgs[(r)])))
        if (me > 0) {
            uint8_t *left = PIECE(0); /* ours to write: a fresh receive buffer */
            for (int r = 1; r < me; r++) {
                coll__reduce_into(kern, left, PIECE(r), count, wt, d->rop);
            }
            coll__reduce_to(kern, work, left, work, count, wt, d->rop);
        }
        for (int r = me + 1; r < n; r++) {
            coll__reduce_into(kern, work, PIECE(r), count, wt, d->rop);
        }
#undef PIECE
    }
    for (int r = 0; r < n; r++) {
        coll__msg_free(msgs[r]);
    }
    weft_free(msgs);
    weft_free(rel);
    return st;
}

/* Ring: reduce-scatter then all-gather, n-1 steps each; each rank sends and
 * receives 2(n-1)/n of the data: bandwidth-optimal. Chunks travel in segments,
 * and a segment goes on to the next step as soon as it is reduced (or, in the
 * all-gather, received), so sending, receiving and reducing overlap. Step t of
 * the 2(n-1) steps carries chunk (me - t) mod n from each rank to its right. */
weft_status_t coll__all_reduce_ring(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                                    bool *declined_p)
{
    const coll_desc_t *d = a->d;
    uint8_t *work = a->work;
    size_t count = a->count;
    weft_dtype_t wt = a->wt;
    const coll_kern_t *kern = &a->op->kern;
    int n = g->size, me = g->rank;
    int right = (me + 1) % n, left = (me - 1 + n) % n;
    size_t es = weft_dtype_size(wt);
    size_t seg = RING_SEGMENT_BYTES / es;
    size_t *off = weft_calloc((size_t)n + 1, sizeof(size_t));
    weft_status_t st = WEFT_OK;

    (void)declined_p; /* never declines */
    if (off == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "all_reduce: no memory");
    }
    size_t base = count / (size_t)n, rem = count % (size_t)n;
    for (int i = 0; i < n; i++) {
        off[i + 1] = off[i] + base + ((size_t)i < rem ? 1 : 0);
    }
    size_t maxlen = base + (rem > 0 ? 1 : 0);
    size_t nseg = maxlen == 0 ? 1 : (maxlen + seg - 1) / seg;
    /* rel[c * nseg + k]: the last send of segment k of chunk c still being read. */
    weft_future_t **rel = weft_calloc((size_t)n * nseg, sizeof(*rel));
    if (rel == NULL) {
        weft_free(off);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "all_reduce: no memory");
    }
    int steps = 2 * (n - 1);
    /* slots[t * nseg + k]: where piece (t, k) lands in place, posted for all at once. */
    coll_slot_t *slots = weft_calloc((size_t)steps * nseg, sizeof(*slots));
    if (slots == NULL) {
        weft_free(rel);
        weft_free(off);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "all_reduce: no memory");
    }
#define SEG_LO(c, k) (off[(c)] + (size_t)(k)*seg)
#define SEG_LEN(c, k)                                                                              \
    (SEG_LO(c, k) >= off[(c) + 1]                                                                  \
         ? 0                                                                                       \
         : (off[(c) + 1] - SEG_LO(c, k) < seg ? off[(c) + 1] - SEG_LO(c, k) : seg))
    /* Every piece may land in place from the start: a reduce-scatter piece is reduced
     * into a region no send of ours reads yet (we forward it once reduced), and an
     * all-gather piece can only come after the whole ring, this rank included, has
     * passed on what this rank sent from that region (its bytes were written out). */
    for (int t = 0; t < steps; t++) {
        int ri = ((me - t - 1) % n + n) % n;
        for (size_t k = 0; k < nseg; k++) {
            size_t len = SEG_LEN(ri, k);
            if (len > 0) {
                coll__slot_post(g, d, &slots[(size_t)t * nseg + k],
                                (uint32_t)((size_t)t * nseg + k), left, work + SEG_LO(ri, k) * es,
                                len, wt, t < n - 1 ? kern : NULL, d->rop);
            }
        }
    }
    /* Step 0: every segment of our own chunk goes out. */
    for (size_t k = 0; k < nseg && st == WEFT_OK; k++) {
        size_t len = SEG_LEN(me, k);
        st = coll__send(g, d, (uint32_t)k, right, len > 0 ? work + SEG_LO(me, k) * es : NULL, len,
                        wt, &rel[(size_t)me * nseg + k]);
    }
    for (int t = 0; t < steps && st == WEFT_OK; t++) {
        int ri = ((me - t - 1) % n + n) % n; /* the chunk arriving at step t */
        for (size_t k = 0; k < nseg && st == WEFT_OK; k++) {
            size_t len = SEG_LEN(ri, k);
            coll_slot_t *slot = &slots[(size_t)t * nseg + k];
            coll_msg_t *m;
            st = coll__recv(g, d, (uint32_t)((size_t)t * nseg + k), left, deadline, &m);
            if (st != WEFT_OK) {
                break;
            }
            bool landed = coll__slot_landed(slot);
            coll__slot_end(g, slot);
            weft_tensor_t *tt = coll__msg_tensor(m);
            uint8_t *dst = work + SEG_LO(ri, k) * es;
            if (landed) {
                /* Reduced or copied in place as it arrived. */
            } else if (len > 0 && (tt == NULL || weft_tensor_dtype(tt) != wt ||
                                   (size_t)weft_tensor_numel(tt) != len)) {
                st = weft__set_error(WEFT_ERR_PROTOCOL,
                                     "all_reduce: group rank %d sent a piece of the wrong size",
                                     left);
            } else if (len > 0 && t < n - 1) {
                /* Reduce-scatter: reduce straight from the received buffer. */
                coll__reduce_into(kern, dst, weft_tensor_data(tt), len, wt, d->rop);
            } else if (len > 0) {
                /* All-gather: the final value. The region may still be read by an
                 * earlier send of ours: wait until the transport has let go of it. */
                weft_future_t **r = &rel[(size_t)ri * nseg + k];
                st = coll__wait_released(r, 1, deadline);
                if (st == WEFT_OK) {
                    memcpy(dst, weft_tensor_data(tt), len * es);
                }
            }
            coll__msg_free(m);
            /* Forward it at once: it is this rank's piece of step t + 1. */
            if (st == WEFT_OK && t + 1 < steps) {
                weft_future_t **r = &rel[(size_t)ri * nseg + k];
                if (*r != NULL) {
                    weft_future_release(*r); /* a newer send supersedes it */
                    *r = NULL;
                }
                st = coll__send(g, d, (uint32_t)((size_t)(t + 1) * nseg + k), right,
                                len > 0 ? dst : NULL, len, wt, r);
            }
        }
    }
    /* Pieces that never came (a failure) may be landing still: wait for their writers. */
    for (size_t i = 0; i < (size_t)steps * nseg; i++) {
        coll__slot_end(g, &slots[i]);
    }
#undef SEG_LO
#undef SEG_LEN
    weft_status_t w = coll__wait_released(rel, (size_t)n * nseg, deadline);
    weft_free(slots);
    weft_free(rel);
    weft_free(off);
    return st != WEFT_OK ? st : w;
}
