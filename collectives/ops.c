/* The algorithms: barrier, broadcast, all_reduce. Each runs on its group's
 * worker thread, sends pieces without copying (waiting until the transport has
 * let go of a region before writing into it again) and reduces straight from
 * the received buffers. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Direct exchange below this many bytes (latency: one round), ring above. */
#define DIRECT_MAX_BYTES (64u << 10)
/* The step of the messages that carry only a rank's view of the operation. */
#define VERIFY_STEP 0xffff0000u

static weft_status_t wait_released(weft_future_t **rel, size_t n, int64_t deadline_ns)
{
    weft_status_t st = WEFT_OK;
    for (size_t i = 0; i < n; i++) {
        if (rel[i] == NULL) {
            continue;
        }
        int64_t left = (deadline_ns - weft__now_ns()) / 1000000;
        weft_status_t s = weft_future_wait(rel[i], left > 0 ? left : 0);
        if (s != WEFT_OK && st == WEFT_OK) {
            st = weft__set_error(WEFT_ERR_TIMEOUT, "the transport did not release a sent buffer "
                                                   "before the deadline");
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
static weft_status_t take_piece(coll_msg_t *m, void *dst, size_t count, weft_dtype_t dtype,
                                int src)
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
    weft_status_t w = wait_released(rel, (size_t)nrel, deadline);
    return st != WEFT_OK ? st : w;
}

static bool is_half(weft_dtype_t dt)
{
    return dt == WEFT_F16 || dt == WEFT_BF16;
}

/* f16/bf16 accumulate in f32: the working buffer holds f32 copies. */
static void to_f32(float *dst, const uint16_t *src, size_t n, weft_dtype_t dt)
{
    for (size_t i = 0; i < n; i++) {
        dst[i] = dt == WEFT_F16 ? weft_f16_to_f32(src[i]) : weft_bf16_to_f32(src[i]);
    }
}

static void from_f32(uint16_t *dst, const float *src, size_t n, weft_dtype_t dt)
{
    for (size_t i = 0; i < n; i++) {
        dst[i] = dt == WEFT_F16 ? weft_f32_to_f16(src[i]) : weft_f32_to_bf16(src[i]);
    }
}

/* Every rank sends its whole buffer to every other and reduces all of them in
 * rank order: one round, identical results everywhere. */
static weft_status_t all_reduce_direct(coll_group_t *g, const coll_desc_t *d, uint8_t *work,
                                       size_t count, weft_dtype_t wt, int64_t deadline)
{
    int n = g->size;
    size_t es = weft_dtype_size(wt), nb = count * es;
    weft_future_t **rel = weft_calloc((size_t)n, sizeof(*rel));
    uint8_t *acc = weft_alloc(nb > 0 ? nb : 1);
    weft_status_t st = WEFT_OK;

    if (rel == NULL || acc == NULL) {
        weft_free(rel);
        weft_free(acc);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "all_reduce: no memory");
    }
    for (int r = 0; r < n && st == WEFT_OK; r++) {
        if (r != g->rank) {
            st = coll__send(g, d, 0, r, count > 0 ? work : NULL, count, wt, &rel[r]);
        }
    }
    for (int r = 0; r < n && st == WEFT_OK; r++) {
        const uint8_t *c = work;
        coll_msg_t *m = NULL;
        if (r != g->rank) {
            st = coll__recv(g, d, 0, r, deadline, &m);
            if (st != WEFT_OK) {
                break;
            }
            weft_tensor_t *t = coll__msg_tensor(m);
            if (count > 0 && (t == NULL || weft_tensor_dtype(t) != wt ||
                              (size_t)weft_tensor_numel(t) != count)) {
                coll__msg_free(m);
                st = weft__set_error(WEFT_ERR_PROTOCOL,
                                     "all_reduce: group rank %d sent a piece of the wrong size", r);
                break;
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
    weft_status_t w = wait_released(rel, (size_t)n, deadline);
    if (st == WEFT_OK) {
        st = w;
    }
    if (st == WEFT_OK && count > 0) {
        memcpy(work, acc, nb);
    }
    weft_free(acc);
    weft_free(rel);
    return st;
}

/* Ring: reduce-scatter then all-gather, n-1 steps each; each rank sends and
 * receives 2(n-1)/n of the data: bandwidth-optimal. */
static weft_status_t all_reduce_ring(coll_group_t *g, const coll_desc_t *d, uint8_t *work,
                                     size_t count, weft_dtype_t wt, int64_t deadline)
{
    int n = g->size, me = g->rank;
    int right = (me + 1) % n, left = (me - 1 + n) % n;
    size_t es = weft_dtype_size(wt);
    size_t *off = weft_calloc((size_t)n + 1, sizeof(size_t));
    weft_future_t **rel = weft_calloc((size_t)n, sizeof(*rel));
    weft_status_t st = WEFT_OK;

    if (off == NULL || rel == NULL) {
        weft_free(off);
        weft_free(rel);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "all_reduce: no memory");
    }
    size_t base = count / (size_t)n, rem = count % (size_t)n;
    for (int i = 0; i < n; i++) {
        off[i + 1] = off[i] + base + ((size_t)i < rem ? 1 : 0);
    }
#define CHUNK(i) (work + off[(i)] * es)
#define CLEN(i)  (off[(i) + 1] - off[(i)])
    for (int s = 0; s < n - 1 && st == WEFT_OK; s++) {
        int si = (me - s + n) % n, ri = (me - s - 1 + n) % n;
        if (rel[si] != NULL) {
            weft_future_release(rel[si]);
            rel[si] = NULL;
        }
        st = coll__send(g, d, (uint32_t)s, right, CLEN(si) > 0 ? CHUNK(si) : NULL, CLEN(si), wt,
                        &rel[si]);
        if (st != WEFT_OK) {
            break;
        }
        coll_msg_t *m;
        st = coll__recv(g, d, (uint32_t)s, left, deadline, &m);
        if (st != WEFT_OK) {
            break;
        }
        weft_tensor_t *t = coll__msg_tensor(m);
        if (CLEN(ri) > 0) {
            if (t == NULL || weft_tensor_dtype(t) != wt || (size_t)weft_tensor_numel(t) != CLEN(ri)) {
                st = weft__set_error(WEFT_ERR_PROTOCOL,
                                     "all_reduce: group rank %d sent a piece of the wrong size",
                                     left);
            } else {
                /* Reduce straight from the received buffer. */
                weft_reduce_into(CHUNK(ri), weft_tensor_data(t), CLEN(ri), wt, d->rop);
            }
        }
        coll__msg_free(m);
    }
    for (int s = 0; s < n - 1 && st == WEFT_OK; s++) {
        int si = (me + 1 - s + n) % n, ri = (me - s + n) % n;
        if (rel[si] != NULL) {
            weft_future_release(rel[si]);
            rel[si] = NULL;
        }
        st = coll__send(g, d, (uint32_t)(n - 1 + s), right, CLEN(si) > 0 ? CHUNK(si) : NULL,
                        CLEN(si), wt, &rel[si]);
        if (st != WEFT_OK) {
            break;
        }
        coll_msg_t *m;
        st = coll__recv(g, d, (uint32_t)(n - 1 + s), left, deadline, &m);
        if (st != WEFT_OK) {
            break;
        }
        /* This chunk was sent in the reduce-scatter: wait until the transport let go of it. */
        if (rel[ri] != NULL) {
            st = wait_released(&rel[ri], 1, deadline);
        }
        if (st == WEFT_OK) {
            st = take_piece(m, CHUNK(ri), CLEN(ri), wt, left);
        }
        coll__msg_free(m);
    }
#undef CHUNK
#undef CLEN
    weft_status_t w = wait_released(rel, (size_t)n, deadline);
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
    weft_status_t st;

    if (is_half(dt) && count > 0) {
        wide = weft_alloc(count * sizeof(float));
        if (wide == NULL) {
            return weft__set_error(WEFT_ERR_NO_MEMORY, "all_reduce: no memory");
        }
        to_f32(wide, weft_tensor_data(t), count, dt);
        work = (uint8_t *)wide;
    }
    const char *algo = getenv("WEFT_COLL_ALGO");
    bool ring = count * weft_dtype_size(wt) > DIRECT_MAX_BYTES && g->size > 2;
    if (algo != NULL && strcmp(algo, "ring") == 0) {
        ring = true;
    } else if (algo != NULL && strcmp(algo, "direct") == 0) {
        ring = false;
    }
    if (g->size == 1) {
        st = WEFT_OK;
    } else if (ring) {
        st = all_reduce_ring(g, d, work, count, wt, deadline);
    } else {
        st = all_reduce_direct(g, d, work, count, wt, deadline);
    }
    if (st == WEFT_OK && count > 0) {
        weft_reduce_finish(work, count, wt, d->rop, g->size);
        if (wide != NULL) {
            from_f32(weft_tensor_data(t), wide, count, dt);
        }
    }
    weft_free(wide);
    return st;
}

void coll__run(coll_group_t *g, coll_op_t *op)
{
    int64_t deadline = weft__now_ns() + atomic_load(&g->timeout_ms) * 1000000LL;
    coll_desc_t d = {op->kind, op->seq, WEFT_U8, op->rop, op->root, 0};
    weft_status_t st;

    if (op->t != NULL) {
        d.dtype = weft_tensor_dtype(op->t);
        d.count = (uint64_t)weft_tensor_numel(op->t);
    }
    switch (op->kind) {
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
    if (st == WEFT_OK) {
        weft_future_complete(op->f, WEFT_OK, NULL, NULL);
    } else {
        weft_future_complete(op->f, st, weft_last_error(), NULL);
    }
    weft_future_release(op->f);
    weft_tensor_release(op->t);
    /* Pieces of it that were never taken (a failed or mismatched operation). */
    coll__purge(g, op->seq);
    weft_free(op);
}
