/* Working buffers and the end of reductions: a copy in the accumulation dtype (f32 for
 * f16 and bf16), and the result written back in the tensor's dtype, rounded once. */
#include <string.h>

#include "internal.h"

bool coll__is_half(weft_dtype_t dt)
{
    return dt == WEFT_F16 || dt == WEFT_BF16;
}

/* A working copy in the accumulation dtype (f32 for f16/bf16), or the data itself. */
weft_status_t coll__widen(const weft_tensor_t *t, size_t count, weft_dtype_t *wt_p,
                          uint8_t **work_p, float **owned_p)
{
    weft_dtype_t dt = weft_tensor_dtype(t);
    *owned_p = NULL;
    *wt_p = coll__is_half(dt) ? WEFT_F32 : dt;
    *work_p = weft_tensor_data(t);
    if (coll__is_half(dt) && count > 0) {
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

/* Completes a reduction of @p size contributions accumulated in @p acc (f32 for f16/bf16)
 * and writes its @p count elements into @p t, in t's dtype. f16/bf16 round once, from the
 * f32 accumulator (an AVG from the exact quotient). @p acc may be t's data; it is modified. */
void coll__finish(weft_tensor_t *t, uint8_t *acc, size_t count, weft_dtype_t wt,
                  weft_reduce_op_t rop, int size)
{
    weft_dtype_t dt = weft_tensor_dtype(t);
    uint8_t *dst = weft_tensor_data(t);
    if (count == 0) {
        return;
    }
    if (coll__is_half(dt)) {
        weft_reduce_narrow(dst, (const float *)acc, count, dt, rop, size);
        return;
    }
    weft_reduce_finish(acc, count, wt, rop, size);
    if (dst != acc) {
        memcpy(dst, acc, count * weft_dtype_size(wt));
    }
}
