/* Every reduction of the collectives, through the reduce ops of the operation's device (the
 * table in core/reduce.c: the CPU's kernels, or another device's once registered); working
 * buffers in the accumulation dtype (f32 for f16 and bf16), and the result written back in the
 * tensor's dtype, rounded once. */
#include <string.h>

#include "internal.h"

void coll__reduce_into(const coll_kern_t *k, void *dst, const void *src, size_t n,
                       weft_dtype_t dtype, weft_reduce_op_t op)
{
    k->ops->reduce_into(k->device, dst, src, n, dtype, op);
}

void coll__reduce_to(const coll_kern_t *k, void *dst, const void *a, const void *b, size_t n,
                     weft_dtype_t dtype, weft_reduce_op_t op)
{
    k->ops->reduce_to(k->device, dst, a, b, n, dtype, op);
}

static bool is_half(weft_dtype_t dt)
{
    return dt == WEFT_F16 || dt == WEFT_BF16;
}

weft_status_t coll__widen(const coll_kern_t *k, const weft_tensor_t *t, size_t count,
                          weft_dtype_t *wt_p, uint8_t **work_p, float **owned_p)
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
        k->ops->widen(k->device, w, weft_tensor_data(t), count, dt);
        *owned_p = w;
        *work_p = (uint8_t *)w;
    }
    return WEFT_OK;
}

void coll__finish(const coll_kern_t *k, weft_tensor_t *t, uint8_t *acc, size_t count,
                  weft_dtype_t wt, weft_reduce_op_t rop, int size)
{
    weft_dtype_t dt = weft_tensor_dtype(t);
    uint8_t *dst = weft_tensor_data(t);
    if (count == 0) {
        return;
    }
    if (is_half(dt)) {
        k->ops->narrow(k->device, dst, (const float *)acc, count, dt, rop, size);
        return;
    }
    k->ops->finish(k->device, acc, count, wt, rop, size);
    if (dst != acc) {
        memcpy(dst, acc, count * weft_dtype_size(wt));
    }
}
