/* The algorithms: barrier, broadcast, all_reduce. Each runs on its group's
 * worker thread, sends pieces without copying (waiting until the transport has
 * let go of a region before writing into it again) and reduces straight from
 * the received buffers. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Direct exchange below this many bytes (latency: one round), ring above (2 ranks: from
 * RING2_MIN_BYTES). */
#define DIRECT_MAX_BYTES (64u << 10)
#define RING2_MIN_BYTES  (1u << 20)
/* From these sizes ranks on one host read each other's buffers (cma.c): three short
 * rounds of messages, then one kernel copy per byte moved. Two ranks: the ring's single
 * exchange is faster below 2 MiB (measured: 2.9 against 2.1 GB/s at 1 MiB). */
#define CMA_MIN_BYTES  (256u << 10)
#define CMA2_MIN_BYTES (2u << 20)
/* Ring segments: large enough for the direct connections (>= 1 MiB), small enough
 * to overlap transfer and reduction. */
#define RING_SEGMENT_BYTES (2u << 20)
/* The step of the messages that carry only a rank's view of the operation. */
#define VERIFY_STEP 0xffff0000u

/* Waits until the transport has let go of the sent pieces @p rel (and releases them). An
 * operation may not end while the transport still reads its buffers, deadline or not: one
 * still held at the deadline makes it fail with WEFT_ERR_TIMEOUT, once let go (a stalled
 * write ends when written, or when its connection fails). */
weft_status_t coll__wait_released(weft_future_t **rel, size_t n, int64_t deadline_ns)
{
    weft_status_t st = WEFT_OK;
    for (size_t i = 0; i < n; i++) {
        if (rel[i] == NULL) {
            continue;
        }
        int64_t left = (deadline_ns - weft__now_ns()) / 1000000;
        weft_status_t s = weft_future_wait(rel[i], left > 0 ? left : 0);
        if (s != WEFT_OK) {
            (void)weft_future_wait(rel[i], -1);
            if (st == WEFT_OK) {
                st = weft__set_error(WEFT_ERR_TIMEOUT, "the transport did not release a sent "
                                                       "buffer before the deadline");
            }
        }
        weft_future_release(rel[i]);
        rel[i] = NULL;
    }
    return st;
}

static weft_status_t run_barrier(coll_group_t *g, const coll_desc_t *d, int64_t deadline)
{
    for (int r = 0; r < g->size; r++) {
        if (r != g->rank) {
            WEFT_CHECK(coll__send(g, d, 0, r, NULL, 0, WEFT_U8, NULL));
        }
    }
    for (int r = 0; r < g->size; r++) {
        if (r == g->rank) {
            continue;
        }
        coll_msg_t *m;
        WEFT_CHECK(coll__recv(g, d, 0, r, deadline, &m));
        coll__msg_free(m);
    }
    return WEFT_OK;
}

/* Copies a received piece into @p dst after checking its size and dtype. */
static weft_status_t take_piece(coll_msg_t *m, void *dst, size_t count, weft_dtype_t dtype, int src)
{
    weft_tensor_t *t = coll__msg_tensor(m);
    size_t nb = count * weft_dtype_size(dtype);
    if (count == 0) {
        return WEFT_OK;
    }
    if (t == NULL || weft_tensor_dtype(t) != dtype || (size_t)weft_tensor_numel(t) != count) {
        return weft__set_error(WEFT_ERR_PROTOCOL,
                               "collectives: group rank %d sent a piece of the wrong size", src);
    }
    memcpy(dst, weft_tensor_data(t), nb);
    return WEFT_OK;
}

static weft_status_t run_broadcast(coll_group_t *g, const coll_desc_t *d, weft_tensor_t *t,
                                   int64_t deadline)
{
    int n = g->size, root = d->root;
    int vr = (g->rank - root + n) % n;
    size_t count = (size_t)weft_tensor_numel(t);
    weft_dtype_t dt = weft_tensor_dtype(t);
    weft_future_t *rel[32] = {NULL};
    int nrel = 0;
    weft_status_t st = WEFT_OK;

    /* Every rank's view of the operation goes to every other, alongside the tree: the
     * tree alone lets a rank that wrongly believes it is the root finish unnoticed. */
    for (int r = 0; r < n; r++) {
        if (r != g->rank) {
            WEFT_CHECK(coll__send(g, d, VERIFY_STEP, r, NULL, 0, WEFT_U8, NULL));
        }
    }
    /* Binomial tree: receive from the parent, then send to the children. */
    int mask = 1;
    while (mask < n) {
        if (vr & mask) {
            int src = (vr - mask + root) % n;
            coll_msg_t *m;
            WEFT_CHECK(coll__recv(g, d, 0, src, deadline, &m));
            st = take_piece(m, weft_tensor_data(t), count, dt, src);
            coll__msg_free(m);
            WEFT_CHECK(st);
            break;
        }
        mask <<= 1;
    }
    mask >>= 1;
    while (mask > 0) {
        if (vr + mask < n) {
            int dst = (vr + mask + root) % n;
            st = coll__send(g, d, 0, dst, count > 0 ? weft_tensor_data(t) : NULL, count, dt,
                            &rel[nrel]);
            nrel++;
            if (st != WEFT_OK) {
                break;
            }
        }
        mask >>= 1;
    }
    for (int r = 0; r < n && st == WEFT_OK; r++) {
        if (r != g->rank) {
            coll_msg_t *m;
            st = coll__recv(g, d, VERIFY_STEP, r, deadline, &m);
            if (st == WEFT_OK) {
                coll__msg_free(m);
            }
        }
    }
    weft_status_t w = coll__wait_released(rel, (size_t)nrel, deadline);
    return st != WEFT_OK ? st : w;
}

static bool is_half(weft_dtype_t dt)
{
    return dt == WEFT_F16 || dt == WEFT_BF16;
}

/* Completes a reduction of @p size contributions accumulated in @p acc (f32 for f16/bf16)
 * and writes its @p count elements into @p t, in t's dtype. f16/bf16 round once, from the
 * f32 accumulator (an AVG from the exact quotient). @p acc may be t's data; it is modified. */
static void finish(weft_tensor_t *t, uint8_t *acc, size_t count, weft_dtype_t wt,
                   weft_reduce_op_t rop, int size)
{
    weft_dtype_t dt = weft_tensor_dtype(t);
    uint8_t *dst = weft_tensor_data(t);
    if (count == 0) {
        return;
    }
    if (is_half(dt)) {
        weft_reduce_narrow(dst, (const float *)acc, count, dt, rop, size);
        return;
    }
    weft_reduce_finish(acc, count, wt, rop, size);
    if (dst != acc) {
        memcpy(dst, acc, count * weft_dtype_size(wt));
    }
}

/* Every rank sends its whole buffer to every other and reduces all of them in
 * rank order: one round, identical results everywhere. The reduction runs in
 * place, once our own sends have let go of the buffer: the ranks before us are
 * folded into rank 0's received buffer, which is then combined with ours. */
static weft_status_t all_reduce_direct(coll_group_t *g, const coll_desc_t *d, uint8_t *work,
                                       size_t count, weft_dtype_t wt, int64_t deadline)
{
    int n = g->size, me = g->rank;
    weft_future_t **rel = weft_calloc((size_t)n, sizeof(*rel));
    coll_msg_t **msgs = weft_calloc((size_t)n, sizeof(*msgs));
    weft_status_t st = WEFT_OK;

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
                weft_reduce_into(left, PIECE(r), count, wt, d->rop);
            }
            weft_reduce_to(work, left, work, count, wt, d->rop);
        }
        for (int r = me + 1; r < n; r++) {
            weft_reduce_into(work, PIECE(r), count, wt, d->rop);
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
static weft_status_t all_reduce_ring(coll_group_t *g, const coll_desc_t *d, uint8_t *work,
                                     size_t count, weft_dtype_t wt, int64_t deadline)
{
    int n = g->size, me = g->rank;
    int right = (me + 1) % n, left = (me - 1 + n) % n;
    size_t es = weft_dtype_size(wt);
    size_t seg = RING_SEGMENT_BYTES / es;
    size_t *off = weft_calloc((size_t)n + 1, sizeof(size_t));
    weft_status_t st = WEFT_OK;

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
                                len, wt, t < n - 1, d->rop);
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
                weft_reduce_into(dst, weft_tensor_data(tt), len, wt, d->rop);
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

static weft_status_t run_all_reduce(coll_group_t *g, const coll_desc_t *d, weft_tensor_t *t,
                                    int64_t deadline)
{
    weft_dtype_t dt = weft_tensor_dtype(t);
    size_t count = (size_t)weft_tensor_numel(t);
    weft_dtype_t wt = is_half(dt) ? WEFT_F32 : dt;
    uint8_t *work = weft_tensor_data(t);
    float *wide = NULL;
    weft_status_t st = WEFT_OK;

    if (is_half(dt) && count > 0) {
        wide = weft_alloc(count * sizeof(float));
        if (wide == NULL) {
            return weft__set_error(WEFT_ERR_NO_MEMORY, "all_reduce: no memory");
        }
        weft_reduce_widen(wide, weft_tensor_data(t), count, dt);
        work = (uint8_t *)wide;
    }
    const char *algo = getenv("WEFT_COLL_ALGO");
    /* With two ranks the direct exchange moves the same bytes as the ring in one round;
     * from 1 MiB the ring wins: each rank reduces half the tensor, as it arrives, and
     * its pieces (>= 256 KiB each, on the direct connections) land in place. */
    size_t bytes = count * weft_dtype_size(wt);
    bool ring = bytes > DIRECT_MAX_BYTES && (g->size > 2 || bytes >= RING2_MIN_BYTES);
    if (algo != NULL && strcmp(algo, "ring") == 0) {
        ring = true;
    } else if (algo != NULL && strcmp(algo, "direct") == 0) {
        ring = false;
    }
    bool cma = bytes >= (g->size == 2 ? CMA2_MIN_BYTES : CMA_MIN_BYTES);
    if (algo != NULL && strcmp(algo, "cma") == 0) {
        cma = true;
    } else if (algo != NULL && (strcmp(algo, "ring") == 0 || strcmp(algo, "direct") == 0)) {
        cma = false;
    }
    bool declined = false;
    if (g->size > 1 && cma) {
        st = coll__all_reduce_cma(g, d, work, count, wt, deadline, &declined);
    }
    if (g->size == 1 || (cma && !declined)) {
        st = g->size == 1 ? WEFT_OK : st;
    } else if (ring) {
        st = all_reduce_ring(g, d, work, count, wt, deadline);
    } else {
        st = all_reduce_direct(g, d, work, count, wt, deadline);
    }
    if (st == WEFT_OK && count > 0) {
        finish(t, work, count, wt, d->rop, g->size);
    }
    weft_free(wide);
    return st;
}

/* ------------------------------------------------------------ the other collectives */

/* Rooted operations: the tree or star alone lets a rank that wrongly believes it
 * is the root finish unnoticed, so every rank's view also goes to every other. */
static weft_status_t verify_send(coll_group_t *g, const coll_desc_t *d)
{
    for (int r = 0; r < g->size; r++) {
        if (r != g->rank) {
            WEFT_CHECK(coll__send(g, d, VERIFY_STEP, r, NULL, 0, WEFT_U8, NULL));
        }
    }
    return WEFT_OK;
}

static weft_status_t verify_recv(coll_group_t *g, const coll_desc_t *d, int64_t deadline)
{
    for (int r = 0; r < g->size; r++) {
        if (r != g->rank) {
            coll_msg_t *m;
            WEFT_CHECK(coll__recv(g, d, VERIFY_STEP, r, deadline, &m));
            coll__msg_free(m);
        }
    }
    return WEFT_OK;
}

/* A working copy in the accumulation dtype (f32 for f16/bf16), or the data itself. */
static weft_status_t widen(const weft_tensor_t *t, size_t count, weft_dtype_t *wt_p,
                           uint8_t **work_p, float **owned_p)
{
    weft_dtype_t dt = weft_tensor_dtype(t);
    *owned_p = NULL;
    *wt_p = is_half(dt) ? WEFT_F32 : dt;
    *work_p = weft_tensor_data(t);
    if (is_half(dt) && count > 0) {
        float *w = weft_alloc(count * sizeof(float));
        if (w == NULL) {
            return weft__set_error(WEFT_ERR_NO_MEMORY, "collectives: no memory");
        }
        weft_reduce_widen(w, weft_tensor_data(t), count, dt);
        *owned_p = w;
        *work_p = (uint8_t *)w;
    }
    return WEFT_OK;
}

/* Receives one piece from every other rank at @p step and reduces all pieces, own
 * included, in rank order into @p acc: identical results wherever it runs. */
static weft_status_t reduce_from_all(coll_group_t *g, const coll_desc_t *d, uint32_t step,
                                     const uint8_t *own, uint8_t *acc, size_t count,
                                     weft_dtype_t wt, int64_t deadline)
{
    size_t nb = count * weft_dtype_size(wt);
    for (int r = 0; r < g->size; r++) {
        const uint8_t *c = own;
        coll_msg_t *m = NULL;
        if (r != g->rank) {
            WEFT_CHECK(coll__recv(g, d, step, r, deadline, &m));
            weft_tensor_t *t = coll__msg_tensor(m);
            if (count > 0 && (t == NULL || weft_tensor_dtype(t) != wt ||
                              (size_t)weft_tensor_numel(t) != count)) {
                coll__msg_free(m);
                return weft__set_error(WEFT_ERR_PROTOCOL,
                                       "%s: group rank %d sent a piece of the wrong size",
                                       coll__kind_name(d->kind), r);
            }
            c = count > 0 ? weft_tensor_data(t) : NULL;
        }
        if (count > 0) {
            if (r == 0) {
                memcpy(acc, c, nb);
            } else {
                weft_reduce_into(acc, c, count, wt, d->rop);
            }
        }
        coll__msg_free(m);
    }
    return WEFT_OK;
}

static weft_status_t run_reduce(coll_group_t *g, const coll_desc_t *d, weft_tensor_t *t,
                                int64_t deadline)
{
    size_t count = (size_t)weft_tensor_numel(t);
    weft_dtype_t wt;
    uint8_t *work;
    float *owned;
    weft_future_t *rel = NULL;
    weft_status_t st;

    WEFT_CHECK(widen(t, count, &wt, &work, &owned));
    st = verify_send(g, d);
    if (st == WEFT_OK && g->rank != d->root) {
        st = coll__send(g, d, 0, d->root, count > 0 ? work : NULL, count, wt, &rel);
    } else if (st == WEFT_OK) {
        uint8_t *acc = weft_alloc(count * weft_dtype_size(wt) + 1);
        if (acc == NULL) {
            st = weft__set_error(WEFT_ERR_NO_MEMORY, "reduce: no memory");
        } else {
            st = reduce_from_all(g, d, 0, work, acc, count, wt, deadline);
            if (st == WEFT_OK) {
                finish(t, acc, count, wt, d->rop, g->size);
            }
            weft_free(acc);
        }
    }
    if (st == WEFT_OK) {
        st = verify_recv(g, d, deadline);
    }
    weft_status_t w = coll__wait_released(&rel, 1, deadline);
    weft_free(owned);
    return st != WEFT_OK ? st : w;
}

static weft_status_t run_gather(coll_group_t *g, const coll_desc_t *d, weft_tensor_t *in,
                                weft_tensor_t *out, int64_t deadline)
{
    size_t count = (size_t)weft_tensor_numel(in);
    weft_dtype_t dt = weft_tensor_dtype(in);
    size_t nb = count * weft_dtype_size(dt);
    weft_future_t *rel = NULL;
    weft_status_t st = verify_send(g, d);

    if (st == WEFT_OK && g->rank != d->root) {
        st = coll__send(g, d, 0, d->root, count > 0 ? weft_tensor_data(in) : NULL, count, dt, &rel);
    } else if (st == WEFT_OK) {
        uint8_t *o = weft_tensor_data(out);
        for (int r = 0; r < g->size && st == WEFT_OK; r++) {
            if (r == g->rank) {
                if (nb > 0) {
                    memmove(o + (size_t)r * nb, weft_tensor_data(in), nb);
                }
                continue;
            }
            coll_msg_t *m;
            st = coll__recv(g, d, 0, r, deadline, &m);
            if (st == WEFT_OK) {
                st = take_piece(m, o + (size_t)r * nb, count, dt, r);
                coll__msg_free(m);
            }
        }
    }
    if (st == WEFT_OK) {
        st = verify_recv(g, d, deadline);
    }
    weft_status_t w = coll__wait_released(&rel, 1, deadline);
    return st != WEFT_OK ? st : w;
}

static weft_status_t run_scatter(coll_group_t *g, const coll_desc_t *d, weft_tensor_t *in,
                                 weft_tensor_t *out, int64_t deadline)
{
    size_t count = (size_t)weft_tensor_numel(out);
    weft_dtype_t dt = weft_tensor_dtype(out);
    size_t nb = count * weft_dtype_size(dt);
    weft_future_t **rel = weft_calloc((size_t)g->size, sizeof(*rel));
    weft_status_t st;

    if (rel == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "scatter: no memory");
    }
    st = verify_send(g, d);
    if (st == WEFT_OK && g->rank == d->root) {
        uint8_t *i = weft_tensor_data(in);
        for (int r = 0; r < g->size && st == WEFT_OK; r++) {
            if (r == g->rank) {
                if (nb > 0) {
                    memmove(weft_tensor_data(out), i + (size_t)r * nb, nb);
                }
            } else {
                st = coll__send(g, d, 0, r, count > 0 ? i + (size_t)r * nb : NULL, count, dt,
                                &rel[r]);
            }
        }
    } else if (st == WEFT_OK) {
        coll_msg_t *m;
        st = coll__recv(g, d, 0, d->root, deadline, &m);
        if (st == WEFT_OK) {
            st = take_piece(m, weft_tensor_data(out), count, dt, d->root);
            coll__msg_free(m);
        }
    }
    if (st == WEFT_OK) {
        st = verify_recv(g, d, deadline);
    }
    weft_status_t w = coll__wait_released(rel, (size_t)g->size, deadline);
    weft_free(rel);
    return st != WEFT_OK ? st : w;
}

/* Every rank sends its input to every other: each sends and receives (n-1) pieces,
 * the same bytes as a ring, in one round. */
static weft_status_t run_all_gather(coll_group_t *g, const coll_desc_t *d, weft_tensor_t *in,
                                    weft_tensor_t *out, weft_tensor_t **outs, int64_t deadline)
{
    size_t count = (size_t)weft_tensor_numel(in);
    weft_dtype_t dt = weft_tensor_dtype(in);
    size_t nb = count * weft_dtype_size(dt);
    weft_future_t **rel = weft_calloc((size_t)g->size, sizeof(*rel));
    weft_status_t st = WEFT_OK;

    if (rel == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "all_gather: no memory");
    }
    for (int r = 0; r < g->size && st == WEFT_OK; r++) {
        if (r != g->rank) {
            st =
                coll__send(g, d, 0, r, count > 0 ? weft_tensor_data(in) : NULL, count, dt, &rel[r]);
        }
    }
    for (int r = 0; r < g->size && st == WEFT_OK; r++) {
        uint8_t *dst = outs != NULL ? (uint8_t *)weft_tensor_data(outs[r])
                                    : (uint8_t *)weft_tensor_data(out) + (size_t)r * nb;
        if (r == g->rank) {
            if (nb > 0) {
                memmove(dst, weft_tensor_data(in), nb); /* in place: in may be this very part */
            }
            continue;
        }
        coll_msg_t *m;
        st = coll__recv(g, d, 0, r, deadline, &m);
        if (st == WEFT_OK) {
            st = take_piece(m, dst, count, dt, r);
            coll__msg_free(m);
        }
    }
    weft_status_t w = coll__wait_released(rel, (size_t)g->size, deadline);
    weft_free(rel);
    return st != WEFT_OK ? st : w;
}

/* Part r of every rank's input goes to rank r, which reduces the parts in rank order. */
static weft_status_t run_reduce_scatter(coll_group_t *g, const coll_desc_t *d, weft_tensor_t *in,
                                        weft_tensor_t *out, int64_t deadline)
{
    size_t count = (size_t)weft_tensor_numel(out);
    weft_dtype_t wt;
    uint8_t *work;
    float *owned;
    weft_future_t **rel = weft_calloc((size_t)g->size, sizeof(*rel));
    weft_status_t st = WEFT_OK;

    if (rel == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "reduce_scatter: no memory");
    }
    st = widen(in, count * (size_t)g->size, &wt, &work, &owned);
    size_t nb = count * weft_dtype_size(wt);
    for (int r = 0; r < g->size && st == WEFT_OK; r++) {
        if (r != g->rank) {
            st = coll__send(g, d, 0, r, count > 0 ? work + (size_t)r * nb : NULL, count, wt,
                            &rel[r]);
        }
    }
    if (st == WEFT_OK) {
        uint8_t *acc = weft_alloc(nb + 1);
        if (acc == NULL) {
            st = weft__set_error(WEFT_ERR_NO_MEMORY, "reduce_scatter: no memory");
        } else {
            st = reduce_from_all(g, d, 0, work + (size_t)g->rank * nb, acc, count, wt, deadline);
            /* out may overlap the input: write it once the sends have let go of it. */
            weft_status_t w0 = coll__wait_released(rel, (size_t)g->size, deadline);
            if (st == WEFT_OK) {
                st = w0;
            }
            if (st == WEFT_OK) {
                finish(out, acc, count, wt, d->rop, g->size);
            }
            weft_free(acc);
        }
    }
    weft_status_t w = coll__wait_released(rel, (size_t)g->size, deadline);
    weft_free(rel);
    weft_free(owned);
    return st != WEFT_OK ? st : w;
}

/* Receives every member's split lists (sent at VERIFY_STEP) into @p all (n rows of 2n:
 * in_splits, then out_splits) and checks every pair: what s sends r is what r expects from
 * s. Every member checks every pair, so that every member fails a disagreement, not only
 * the two ranks of the pair. */
static weft_status_t all_to_all_check(coll_group_t *g, const coll_desc_t *dv, int64_t *all,
                                      int64_t deadline)
{
    int n = g->size;
    size_t row = 2 * (size_t)n;

    for (int r = 0; r < n; r++) {
        if (r == g->rank) {
            continue;
        }
        coll_msg_t *m;
        WEFT_CHECK(coll__recv(g, dv, VERIFY_STEP, r, deadline, &m));
        weft_status_t st = take_piece(m, all + (size_t)r * row, row, WEFT_I64, r);
        coll__msg_free(m);
        WEFT_CHECK(st);
    }
    for (int s = 0; s < n; s++) {
        for (int r = 0; r < n; r++) {
            int64_t sent = all[(size_t)s * row + (size_t)r];
            int64_t expected = all[(size_t)r * row + (size_t)n + (size_t)s];
            if (sent != expected) {
                return weft__set_error(WEFT_ERR_MISMATCH,
                                       "all_to_all (operation %llu of group %u): rank %d sends "
                                       "%lld elements to rank %d, which expects %lld from it",
                                       (unsigned long long)dv->seq, g->id, s, (long long)sent, r,
                                       (long long)expected);
            }
        }
    }
    return WEFT_OK;
}

static weft_status_t run_all_to_all(coll_group_t *g, const coll_desc_t *d0, coll_op_t *op,
                                    int64_t deadline)
{
    int n = g->size;
    weft_dtype_t dt = weft_tensor_dtype(op->t);
    size_t es = weft_dtype_size(dt);
    uint8_t *in = weft_tensor_data(op->t), *out = weft_tensor_data(op->out);
    size_t inb = (size_t)weft_tensor_numel(op->t) * es,
           outb = (size_t)weft_tensor_numel(op->out) * es;
    size_t row = 2 * (size_t)n;
    uint8_t *copy = NULL;
    /* rel[r]: the data piece to r; rel[n + r]: the split lists to r */
    weft_future_t **rel = weft_calloc(2 * (size_t)n, sizeof(*rel));
    int64_t *all = weft_alloc((size_t)n * row * sizeof(int64_t));
    weft_status_t st = WEFT_OK;

    if (rel == NULL || all == NULL) {
        weft_free(rel);
        weft_free(all);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "all_to_all: no memory");
    }
    if (inb > 0 && outb > 0 && in < out + outb && out < in + inb) {
        /* In place: pieces are sent from the input while others land in the output. */
        copy = weft_alloc(inb);
        if (copy == NULL) {
            weft_free(rel);
            weft_free(all);
            return weft__set_error(WEFT_ERR_NO_MEMORY, "all_to_all: no memory");
        }
        memcpy(copy, in, inb);
        in = copy;
    }
    /* This rank's split lists, to every member, in the same round as the data. */
    int64_t *mine = all + (size_t)g->rank * row;
    memcpy(mine, op->in_splits, (size_t)n * sizeof(int64_t));
    memcpy(mine + n, op->out_splits, (size_t)n * sizeof(int64_t));
    coll_desc_t dv = *d0;
    dv.count = 0;
    dv.root = 0;
    for (int r = 0; r < n && st == WEFT_OK; r++) {
        if (r != g->rank) {
            st = coll__send(g, &dv, VERIFY_STEP, r, mine, row, WEFT_I64, &rel[(size_t)n + r]);
        }
    }
    size_t ioff = 0;
    for (int r = 0; r < n && st == WEFT_OK; r++) {
        size_t c = (size_t)op->in_splits[r];
        if (r != g->rank) {
            /* Each piece also carries its size and what this rank expects back from r. */
            coll_desc_t d = *d0;
            d.count = c;
            d.root = (int)op->out_splits[r];
            st = coll__send(g, &d, 0, r, c > 0 ? in + ioff * es : NULL, c, dt, &rel[r]);
        }
        ioff += c;
    }
    if (st == WEFT_OK) {
        st = all_to_all_check(g, &dv, all, deadline);
    }
    size_t ooff = 0;
    for (int r = 0; r < n && st == WEFT_OK; r++) {
        size_t c = (size_t)op->out_splits[r];
        if (r == g->rank) {
            size_t from = 0;
            for (int k = 0; k < r; k++) {
                from += (size_t)op->in_splits[k];
            }
            if (c > 0) {
                memcpy(out + ooff * es, in + from * es, c * es);
            }
        } else {
            coll_desc_t d = *d0;
            d.count = c;                    /* what r must send us */
            d.root = (int)op->in_splits[r]; /* what r must expect from us */
            coll_msg_t *m;
            st = coll__recv(g, &d, 0, r, deadline, &m);
            if (st == WEFT_OK) {
                st = take_piece(m, out + ooff * es, c, dt, r);
                coll__msg_free(m);
            }
        }
        ooff += c;
    }
    weft_status_t w = coll__wait_released(rel, 2 * (size_t)n, deadline);
    weft_free(rel);
    weft_free(all);
    weft_free(copy);
    return st != WEFT_OK ? st : w;
}

void coll__run(coll_group_t *g, coll_op_t *op)
{
    int64_t deadline = op->deadline_ns;
    coll_desc_t d = {op->kind, op->seq, WEFT_U8, op->rop, op->root, 0};
    weft_status_t st;
    bool expired = false;

    if (op->t != NULL) {
        d.dtype = weft_tensor_dtype(op->t);
        d.count = (uint64_t)weft_tensor_numel(op->t);
    }
    if (op->kind == OP_SCATTER || op->kind == OP_REDUCE_SCATTER) {
        d.dtype = weft_tensor_dtype(op->out);
        d.count = (uint64_t)weft_tensor_numel(op->out); /* per part */
    }
    if (weft__now_ns() >= deadline) {
        /* Queued behind earlier operations past its deadline: it fails without starting. */
        expired = true;
        st = weft__set_error(WEFT_ERR_TIMEOUT,
                             "%s: operation %llu of group %u waited in the queue past its "
                             "deadline",
                             coll__kind_name(op->kind), (unsigned long long)op->seq, g->id);
    } else {
        switch (op->kind) {
        case OP_REDUCE:
            st = run_reduce(g, &d, op->t, deadline);
            break;
        case OP_GATHER:
            st = run_gather(g, &d, op->t, op->out, deadline);
            break;
        case OP_SCATTER:
            st = run_scatter(g, &d, op->t, op->out, deadline);
            break;
        case OP_ALL_GATHER:
            st = run_all_gather(g, &d, op->t, op->out, op->outs, deadline);
            break;
        case OP_REDUCE_SCATTER:
            st = run_reduce_scatter(g, &d, op->t, op->out, deadline);
            break;
        case OP_ALL_TO_ALL:
            st = run_all_to_all(g, &d, op, deadline);
            break;
        case OP_BARRIER:
            st = run_barrier(g, &d, deadline);
            break;
        case OP_BROADCAST:
            st = run_broadcast(g, &d, op->t, deadline);
            break;
        case OP_ALL_REDUCE:
            st = run_all_reduce(g, &d, op->t, deadline);
            break;
        default:
            st = weft__set_error(WEFT_ERR_INVALID_ARG, "collectives: unknown operation");
            break;
        }
    }
    char why[800] = "";
    if (st != WEFT_OK) {
        snprintf(why, sizeof(why), "%s", weft_last_error());
        /* A failure of this rank's own (not a mismatch or a loss, which every member
         * sees for itself; not a deadline met while waiting, which they reach too): tell
         * the others, so that they fail now instead of waiting for pieces that will not
         * come. */
        if (((st != WEFT_ERR_MISMATCH && st != WEFT_ERR_PEER_LOST && st != WEFT_ERR_TIMEOUT) ||
             expired) &&
            g->size > 1) {
            char text[900];
            snprintf(text, sizeof(text), "rank %d: %s", g->rank, why);
            coll__abort(g, op->seq, st, text);
        }
    }
    /* Over here: its pieces nobody took, and those still to come, are dropped. Before
     * the future completes, whose callbacks may issue the next operations. */
    coll__seq_done(g, op->seq);
    weft_future_complete(op->f, st, st == WEFT_OK ? NULL : why, NULL);
    weft_future_release(op->f);
    coll__op_free(op, g->size);
}
