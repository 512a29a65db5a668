/* The operation runner: runs an operation of a group with its algorithm (all_reduce: chosen
 * by size), tells the other members when it failed here, and completes its future. */
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

static weft_status_t run_all_reduce(coll_group_t *g, const coll_desc_t *d, weft_tensor_t *t,
                                    int64_t deadline)
{
    weft_dtype_t dt = weft_tensor_dtype(t);
    size_t count = (size_t)weft_tensor_numel(t);
    weft_dtype_t wt = coll__is_half(dt) ? WEFT_F32 : dt;
    uint8_t *work = weft_tensor_data(t);
    float *wide = NULL;
    weft_status_t st = WEFT_OK;

    if (coll__is_half(dt) && count > 0) {
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
        st = coll__all_reduce_ring(g, d, work, count, wt, deadline);
    } else {
        st = coll__all_reduce_direct(g, d, work, count, wt, deadline);
    }
    if (st == WEFT_OK && count > 0) {
        coll__finish(t, work, count, wt, d->rop, g->size);
    }
    weft_free(wide);
    return st;
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
            st = coll__reduce(g, &d, op->t, deadline);
            break;
        case OP_GATHER:
            st = coll__gather(g, &d, op->t, op->out, deadline);
            break;
        case OP_SCATTER:
            st = coll__scatter(g, &d, op->t, op->out, deadline);
            break;
        case OP_ALL_GATHER:
            st = coll__all_gather(g, &d, op->t, op->out, op->outs, deadline);
            break;
        case OP_REDUCE_SCATTER:
            st = coll__reduce_scatter(g, &d, op->t, op->out, deadline);
            break;
        case OP_ALL_TO_ALL:
            st = coll__all_to_all(g, &d, op, deadline);
            break;
        case OP_BARRIER:
            st = coll__barrier(g, &d, deadline);
            break;
        case OP_BROADCAST:
            st = coll__broadcast(g, &d, op->t, deadline);
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

void coll__op_free(coll_op_t *op, int size)
{
    weft_tensor_release(op->t);
    weft_tensor_release(op->out);
    if (op->outs != NULL) {
        for (int i = 0; i < size; i++) {
            weft_tensor_release(op->outs[i]);
        }
        weft_free(op->outs);
    }
    weft_free(op->in_splits);
    weft_free(op->out_splits);
    weft_free(op);
}
