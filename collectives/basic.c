/* The algorithm of each collective other than all_reduce: barrier, broadcast (a binomial
 * tree), reduce, gather, scatter, all_gather, reduce_scatter and all_to_all (one piece per
 * pair of members). Each runs on its group's worker and sends pieces without copying. */
#include <string.h>

#include "internal.h"

/* The step of the messages that carry only a rank's view of the operation. */
#define VERIFY_STEP 0xffff0000u

weft_status_t coll__barrier(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                            bool *declined_p)
{
    const coll_desc_t *d = a->d;

    (void)declined_p;
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

weft_status_t coll__broadcast(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                              bool *declined_p)
{
    const coll_desc_t *d = a->d;
    weft_tensor_t *t = a->op->t;
    int n = g->size, root = d->root;
    int vr = (g->rank - root + n) % n;
    size_t count = (size_t)weft_tensor_numel(t);
    weft_dtype_t dt = weft_tensor_dtype(t);
    weft_future_t *rel[32] = {NULL};
    int nrel = 0;
    weft_status_t st = WEFT_OK;

    (void)declined_p; /* never declines */
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
            st = coll__take_piece(m, weft_tensor_data(t), count, dt, src);
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

/* Receives one piece from every other rank at @p step and reduces all pieces, own
 * included, in rank order into @p acc: identical results wherever it runs. */
static weft_status_t reduce_from_all(coll_group_t *g, const coll_desc_t *d, const coll_kern_t *k,
                                     uint32_t step, const uint8_t *own, uint8_t *acc, size_t count,
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
                coll__reduce_into(k, acc, c, count, wt, d->rop);
            }
        }
        coll__msg_free(m);
    }
    return WEFT_OK;
}

weft_status_t coll__reduce(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                           bool *declined_p)
{
    const coll_desc_t *d = a->d;
    weft_tensor_t *t = a->op->t;
    size_t count = (size_t)weft_tensor_numel(t);
    weft_dtype_t wt;
    uint8_t *work;
    float *owned;
    weft_future_t *rel = NULL;
    weft_status_t st;

    (void)declined_p; /* never declines */
    WEFT_CHECK(coll__widen(&a->op->kern, t, count, &wt, &work, &owned));
    st = verify_send(g, d);
    if (st == WEFT_OK && g->rank != d->root) {
        st = coll__send(g, d, 0, d->root, count > 0 ? work : NULL, count, wt, &rel);
    } else if (st == WEFT_OK) {
        uint8_t *acc = weft_alloc(count * weft_dtype_size(wt) + 1);
        if (acc == NULL) {
            st = weft__set_error(WEFT_ERR_NO_MEMORY, "reduce: no memory");
        } else {
            st = reduce_from_all(g, d, &a->op->kern, 0, work, acc, count, wt, deadline);
            if (st == WEFT_OK) {
                coll__finish(&a->op->kern, t, acc, count, wt, d->rop, g->size);
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

weft_status_t coll__gather(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                           bool *declined_p)
{
    const coll_desc_t *d = a->d;
    weft_tensor_t *in = a->op->t, *out = a->op->out;
    size_t count = (size_t)weft_tensor_numel(in);
    weft_dtype_t dt = weft_tensor_dtype(in);
    size_t nb = count * weft_dtype_size(dt);
    weft_future_t *rel = NULL;
    weft_status_t st = verify_send(g, d);

    (void)declined_p; /* never declines */
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
                st = coll__take_piece(m, o + (size_t)r * nb, count, dt, r);
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

weft_status_t coll__scatter(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                            bool *declined_p)
{
    const coll_desc_t *d = a->d;
    weft_tensor_t *in = a->op->t, *out = a->op->out;
    size_t count = (size_t)weft_tensor_numel(out);
    weft_dtype_t dt = weft_tensor_dtype(out);
    size_t nb = count * weft_dtype_size(dt);
    weft_future_t **rel = weft_calloc((size_t)g->size, sizeof(*rel));
    weft_status_t st;

    (void)declined_p; /* never declines */
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
            st = coll__take_piece(m, weft_tensor_data(out), count, dt, d->root);
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
weft_status_t coll__all_gather(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                               bool *declined_p)
{
    const coll_desc_t *d = a->d;
    weft_tensor_t *in = a->op->t, *out = a->op->out, **outs = a->op->outs;
    size_t count = (size_t)weft_tensor_numel(in);
    weft_dtype_t dt = weft_tensor_dtype(in);
    size_t nb = count * weft_dtype_size(dt);
    weft_future_t **rel = weft_calloc((size_t)g->size, sizeof(*rel));
    weft_status_t st = WEFT_OK;

    (void)declined_p; /* never declines */
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
            st = coll__take_piece(m, dst, count, dt, r);
            coll__msg_free(m);
        }
    }
    weft_status_t w = coll__wait_released(rel, (size_t)g->size, deadline);
    weft_free(rel);
    return st != WEFT_OK ? st : w;
}

/* Part r of every rank's input goes to rank r, which reduces the parts in rank order. */
weft_status_t coll__reduce_scatter(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                                   bool *declined_p)
{
    const coll_desc_t *d = a->d;
    weft_tensor_t *in = a->op->t, *out = a->op->out;
    size_t count = (size_t)weft_tensor_numel(out);
    weft_dtype_t wt;
    uint8_t *work;
    float *owned;
    weft_future_t **rel = weft_calloc((size_t)g->size, sizeof(*rel));
    weft_status_t st = WEFT_OK;

    (void)declined_p; /* never declines */
    if (rel == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "reduce_scatter: no memory");
    }
    st = coll__widen(&a->op->kern, in, count * (size_t)g->size, &wt, &work, &owned);
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
            st = reduce_from_all(g, d, &a->op->kern, 0, work + (size_t)g->rank * nb, acc, count, wt,
                                 deadline);
            /* out may overlap the input: write it once the sends have let go of it. */
            weft_status_t w0 = coll__wait_released(rel, (size_t)g->size, deadline);
            if (st == WEFT_OK) {
                st = w0;
            }
            if (st == WEFT_OK) {
                coll__finish(&a->op->kern, out, acc, count, wt, d->rop, g->size);
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
        weft_status_t st = coll__take_piece(m, all + (size_t)r * row, row, WEFT_I64, r);
        coll__msg_free(m);
        WEFT_CHECK(st);
    }
    return coll__all_to_all_pairs(g, dv, all);
}

weft_status_t coll__all_to_all_pairs(const coll_group_t *g, const coll_desc_t *dv,
                                     const int64_t *all)
{
    int n = g->size;
    size_t row = 2 * (size_t)n;

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

weft_status_t coll__all_to_all(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                               bool *declined_p)
{
    const coll_desc_t *d0 = a->d;
    coll_op_t *op = a->op;
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

    (void)declined_p; /* never declines */
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
                st = coll__take_piece(m, out + ooff * es, c, dt, r);
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
