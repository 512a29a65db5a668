/*
 * Tensor operations on CPU tensors. Every operation that takes floating-point tensors is
 * differentiable: when grad mode is on (<weft/autograd.h>) and an input requires gradients, the
 * output records a graph node, and weft_backward propagates through it.
 *
 * Conventions for every function here:
 * - Inputs are borrowed. Outputs (the last arguments, ending in _p) are new tensors the caller
 *   releases with weft_tensor_release; they are set only on success.
 * - Floating-point operations take f32 or f64 (f32 is the fast path; f64 is for gradient
 *   checks); mixing dtypes is WEFT_ERR_DTYPE. Index arguments (labels, indices, offsets) are i64.
 * - Binary elementwise operations broadcast with numpy's rules; shapes that do not broadcast are
 *   WEFT_ERR_SHAPE with a text naming both shapes. A dim argument may be negative (counted from
 *   the end); out of range is WEFT_ERR_INVALID_ARG.
 * - Outputs are fresh contiguous tensors, except weft_op_reshape, which shares storage.
 * - Thread-safe for distinct tensors.
 */
#ifndef WEFT_OPS_H
#define WEFT_OPS_H

#include <weft/api.h>

/* Layering (docs/architecture.md): only autograd and the modules above it may include this. */
#if defined(WEFT_BUILDING) && !defined(WEFT_SEES_AUTOGRAD)
#error "weft/ops.h is above the module being built: dependencies point downward only"
#endif

#include <stdint.h>

#include <weft/random.h>
#include <weft/status.h>
#include <weft/tensor.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- elementwise (autograd/ops_elementwise.c) ---------------------------------------------- */

WEFT_API weft_status_t weft_op_add(weft_tensor_t *a, weft_tensor_t *b, weft_tensor_t **out_p);
WEFT_API weft_status_t weft_op_sub(weft_tensor_t *a, weft_tensor_t *b, weft_tensor_t **out_p);
WEFT_API weft_status_t weft_op_mul(weft_tensor_t *a, weft_tensor_t *b, weft_tensor_t **out_p);
WEFT_API weft_status_t weft_op_div(weft_tensor_t *a, weft_tensor_t *b, weft_tensor_t **out_p);
/** a ** b elementwise, with broadcasting. */
WEFT_API weft_status_t weft_op_pow(weft_tensor_t *a, weft_tensor_t *b, weft_tensor_t **out_p);
/** a + s. */
WEFT_API weft_status_t weft_op_add_scalar(weft_tensor_t *a, double s, weft_tensor_t **out_p);
/** a * s. */
WEFT_API weft_status_t weft_op_mul_scalar(weft_tensor_t *a, double s, weft_tensor_t **out_p);
/** a ** e. */
WEFT_API weft_status_t weft_op_pow_scalar(weft_tensor_t *a, double e, weft_tensor_t **out_p);
WEFT_API weft_status_t weft_op_neg(weft_tensor_t *a, weft_tensor_t **out_p);
WEFT_API weft_status_t weft_op_relu(weft_tensor_t *a, weft_tensor_t **out_p);
/** GELU, the exact (erf) form, as torch's default. */
WEFT_API weft_status_t weft_op_gelu(weft_tensor_t *a, weft_tensor_t **out_p);
WEFT_API weft_status_t weft_op_tanh(weft_tensor_t *a, weft_tensor_t **out_p);
WEFT_API weft_status_t weft_op_sigmoid(weft_tensor_t *a, weft_tensor_t **out_p);
WEFT_API weft_status_t weft_op_exp(weft_tensor_t *a, weft_tensor_t **out_p);
WEFT_API weft_status_t weft_op_log(weft_tensor_t *a, weft_tensor_t **out_p);
/**
 * Dropout: when @p training, zeroes each element with probability @p p (drawn from @p rng in
 * element order: one weft_rng_uniform per element, zeroed when it is below p) and scales the rest
 * by 1 / (1 - p); otherwise (or p == 0) a copy. p == 0 and p == 1 draw nothing.
 * @return WEFT_ERR_INVALID_ARG for p outside [0, 1] or a NULL rng while training.
 */
WEFT_API weft_status_t weft_op_dropout(weft_tensor_t *a, double p, int training, weft_rng_t *rng,
                                       weft_tensor_t **out_p);

/* ---- reductions, softmax and losses (autograd/ops_reduce.c) --------------------------------- */

/**
 * Sum over @p n_dims dims (@p dims; n_dims == 0 sums over all of them), keeping them as size 1
 * when @p keepdim. A repeated dim is WEFT_ERR_INVALID_ARG.
 */
WEFT_API weft_status_t weft_op_sum(weft_tensor_t *a, int n_dims, const int *dims, int keepdim,
                                   weft_tensor_t **out_p);
/** Mean, same arguments as weft_op_sum. */
WEFT_API weft_status_t weft_op_mean(weft_tensor_t *a, int n_dims, const int *dims, int keepdim,
                                    weft_tensor_t **out_p);
/**
 * Max over @p dim: values (differentiable; the gradient goes to the first maximal element) and
 * their i64 indices (@p indices_p may be NULL). An empty dim is WEFT_ERR_SHAPE.
 */
WEFT_API weft_status_t weft_op_max(weft_tensor_t *a, int dim, int keepdim, weft_tensor_t **values_p,
                                   weft_tensor_t **indices_p);
/** i64 index of the first maximum over @p dim. */
WEFT_API weft_status_t weft_op_argmax(weft_tensor_t *a, int dim, int keepdim,
                                      weft_tensor_t **out_p);
WEFT_API weft_status_t weft_op_softmax(weft_tensor_t *a, int dim, weft_tensor_t **out_p);
WEFT_API weft_status_t weft_op_log_softmax(weft_tensor_t *a, int dim, weft_tensor_t **out_p);

typedef enum {
    WEFT_REDUCTION_MEAN = 0,
    WEFT_REDUCTION_SUM = 1,
    WEFT_REDUCTION_NONE = 2,
} weft_reduction_t;

/**
 * Cross entropy from @p logits [N, C] and i64 @p labels [N] (each in [0, C); otherwise
 * WEFT_ERR_INVALID_ARG naming the first bad label): a scalar for MEAN/SUM, [N] for NONE.
 */
WEFT_API weft_status_t weft_op_cross_entropy(weft_tensor_t *logits, weft_tensor_t *labels,
                                             weft_reduction_t reduction, weft_tensor_t **out_p);
/** Mean squared error between @p a and @p b (same shape). */
WEFT_API weft_status_t weft_op_mse_loss(weft_tensor_t *a, weft_tensor_t *b,
                                        weft_reduction_t reduction, weft_tensor_t **out_p);

/* ---- matrix products (autograd/ops_linalg.c, OpenBLAS) ------------------------------------- */

/**
 * Matrix product with torch.matmul's rules: 1-D x 1-D is a dot product, 2-D x 2-D a matrix
 * product, 1-D operands are promoted and the added dim removed, and N-D operands are batches of
 * matrices whose batch dims broadcast.
 * @return WEFT_ERR_SHAPE (a 0-D operand, inner sizes that differ or batch dims that do not
 *         broadcast; the text names both shapes), WEFT_ERR_DTYPE.
 */
WEFT_API weft_status_t weft_op_matmul(weft_tensor_t *a, weft_tensor_t *b, weft_tensor_t **out_p);
/** Batched product of [B, n, m] and [B, m, p]; other shapes are WEFT_ERR_SHAPE naming both. */
WEFT_API weft_status_t weft_op_bmm(weft_tensor_t *a, weft_tensor_t *b, weft_tensor_t **out_p);
/**
 * x W^T + b for x [..., in] (at least 1-D), W [out, in], b [out] or NULL
 * (torch.nn.functional.linear). A W or b of another shape is WEFT_ERR_SHAPE.
 */
WEFT_API weft_status_t weft_op_linear(weft_tensor_t *x, weft_tensor_t *w, weft_tensor_t *b,
                                      weft_tensor_t **out_p);

/* ---- shapes and indexing (autograd/ops_shape.c) --------------------------------------------- */
/* These take tensors of any dtype (gradients flow for f32 and f64). */

/**
 * Same elements in a new shape, sharing storage; one size may be -1 (inferred). Two -1s or
 * another negative size are WEFT_ERR_INVALID_ARG; a shape of another element count is
 * WEFT_ERR_SHAPE.
 */
WEFT_API weft_status_t weft_op_reshape(weft_tensor_t *a, int ndim, const int64_t *shape,
                                       weft_tensor_t **out_p);
/** Swaps two dims (a contiguous copy). */
WEFT_API weft_status_t weft_op_transpose(weft_tensor_t *a, int dim0, int dim1,
                                         weft_tensor_t **out_p);
/** Reorders the dims: output dim i is input dim perm[i] (a contiguous copy). */
WEFT_API weft_status_t weft_op_permute(weft_tensor_t *a, const int *perm, weft_tensor_t **out_p);
/**
 * Concatenates @p n >= 1 tensors along @p dim (all other dims equal, else WEFT_ERR_SHAPE naming
 * both shapes; dtypes equal, else WEFT_ERR_DTYPE).
 */
WEFT_API weft_status_t weft_op_concat(int n, weft_tensor_t *const *ts, int dim,
                                      weft_tensor_t **out_p);
/**
 * Splits along @p dim into pieces of the given @p sizes (summing to the dim's size, else
 * WEFT_ERR_INVALID_ARG).
 * @param[out] outs n tensors, each released by the caller.
 */
WEFT_API weft_status_t weft_op_split(weft_tensor_t *a, int n, const int64_t *sizes, int dim,
                                     weft_tensor_t **outs);
/**
 * torch.chunk: splits into at most @p chunks pieces of ceil(size / chunks) along @p dim (a dim of
 * size 0 gives @p chunks empty pieces).
 * @param[out] outs room for @p chunks tensors; @param[out] n_p how many were made.
 */
WEFT_API weft_status_t weft_op_chunk(weft_tensor_t *a, int chunks, int dim, weft_tensor_t **outs,
                                     int *n_p);
/**
 * Picks entries along @p dim at the i64 @p index [k] (or 0-D: one entry); an index out of range
 * is WEFT_ERR_INVALID_ARG naming it and its position.
 */
WEFT_API weft_status_t weft_op_index_select(weft_tensor_t *a, int dim, weft_tensor_t *index,
                                            weft_tensor_t **out_p);

/* ---- embeddings (autograd/ops_embedding.c) -------------------------------------------------- */

/**
 * Rows of @p weight [V, D] (f32 or f64) at the i64 @p indices (any shape S): output [S..., D].
 * An index outside [0, V) is WEFT_ERR_INVALID_ARG naming it and its position. With @p sparse,
 * the weight (a leaf) receives a sparse gradient (weft_tensor_sparse_grad: a copy of the
 * indices, flattened, and one gradient row per index) instead of a dense [V, D] one.
 */
WEFT_API weft_status_t weft_op_embedding(weft_tensor_t *weight, weft_tensor_t *indices, int sparse,
                                         weft_tensor_t **out_p);

typedef enum {
    WEFT_BAG_SUM = 0,
    WEFT_BAG_MEAN = 1,
} weft_bag_mode_t;

/**
 * torch.nn.functional.embedding_bag: bag b sums (or averages) the rows of @p weight [V, D] at
 * @p indices [offsets[b], offsets[b+1]) (the last bag ends at the end of @p indices); output
 * [B, D] with B = numel(offsets). @p indices and @p offsets are 1-D i64. An empty bag gives
 * zeros. Offsets must start at 0, not decrease and not pass numel(indices)
 * (WEFT_ERR_INVALID_ARG). With @p sparse, as weft_op_embedding, one row per index (scaled by
 * 1 / bag size for the mean).
 */
WEFT_API weft_status_t weft_op_embedding_bag(weft_tensor_t *weight, weft_tensor_t *indices,
                                             weft_tensor_t *offsets, weft_bag_mode_t mode,
                                             int sparse, weft_tensor_t **out_p);

/* ---- threads (autograd/ops_common.c) ------------------------------------------------------ */

/**
 * Sets how many threads the matrix products (OpenBLAS) may use in this process; 0 restores
 * OpenBLAS's default (its OPENBLAS_NUM_THREADS or the core count). Ranks that share a machine
 * should split its cores between them.
 */
WEFT_API void weft_op_set_threads(int n);
/** The number of threads the matrix products use. */
WEFT_API int weft_op_threads(void);

/* ---- convolution, pooling, normalisation (autograd/ops_conv.c) ------------------------------ */
/*
 * Images are NCHW: x [N, C, H, W], f32 or f64, 4-D (other ranks are WEFT_ERR_SHAPE). Pairs
 * (kernel, stride, padding, dilation, output size) are {height, width}. Output sizes follow
 * torch (floor mode): (H + 2 pad - dilation (k - 1) - 1) / stride + 1. A size argument out of
 * range (stride or dilation < 1, padding < 0, ...) is WEFT_ERR_INVALID_ARG naming it; an input
 * too small for its (padded) window is WEFT_ERR_SHAPE naming the input shape and the window.
 */

/**
 * torch.nn.functional.conv2d: x [N, C, H, W], @p weight [O, C / groups, kH, kW], @p bias [O]
 * or NULL; output [N, O, OH, OW]. Each group of C / groups input channels makes O / groups
 * output channels (im2col and one BLAS gemm per sample and group). Differentiable in x, weight
 * and bias.
 * @param[in] stride NULL for {1, 1}; @param[in] padding NULL for {0, 0} (zeros);
 * @param[in] dilation NULL for {1, 1}; @param[in] groups >= 1, dividing C and O.
 * @return WEFT_ERR_SHAPE (ranks, a weight whose dim 1 is not C / groups, a bias not [O], a
 *         kernel larger than the padded input), WEFT_ERR_INVALID_ARG (stride, padding,
 *         dilation or groups out of range, groups not dividing C or O), WEFT_ERR_DTYPE,
 *         WEFT_ERR_UNSUPPORTED (matrices too large for BLAS), WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_op_conv2d(weft_tensor_t *x, weft_tensor_t *weight, weft_tensor_t *bias,
                                      const int64_t *stride, const int64_t *padding,
                                      const int64_t *dilation, int64_t groups,
                                      weft_tensor_t **out_p);
/**
 * torch.nn.functional.max_pool2d (dilation 1, floor mode): the maximum of each window, padding
 * counting as -inf (a NaN in a window is its maximum, as torch). The gradient goes to the first
 * maximal element of the window in row-major order.
 * @param[in] kernel >= 1; @param[in] stride NULL for kernel (torch's default), else >= 1;
 * @param[in] padding NULL for {0, 0}; each at most half the kernel (as torch).
 */
WEFT_API weft_status_t weft_op_max_pool2d(weft_tensor_t *x, const int64_t *kernel,
                                          const int64_t *stride, const int64_t *padding,
                                          weft_tensor_t **out_p);
/**
 * torch.nn.functional.avg_pool2d (floor mode): the mean of each window, zero padding. With
 * @p count_include_pad (torch's default) the divisor is the window's size clipped to the padded
 * input; without, the number of input elements in the window. Arguments as weft_op_max_pool2d.
 */
WEFT_API weft_status_t weft_op_avg_pool2d(weft_tensor_t *x, const int64_t *kernel,
                                          const int64_t *stride, const int64_t *padding,
                                          int count_include_pad, weft_tensor_t **out_p);
/**
 * torch.nn.functional.adaptive_avg_pool2d to @p out_hw (each >= 1; larger than the input is
 * allowed): output row i averages input rows [floor(i H / oh), ceil((i + 1) H / oh)), and
 * likewise for columns.
 */
WEFT_API weft_status_t weft_op_adaptive_avg_pool2d(weft_tensor_t *x, const int64_t *out_hw,
                                                   weft_tensor_t **out_p);
/**
 * torch.nn.functional.batch_norm over the channels of x [N, C, H, W]:
 * y = (x - mean) / sqrt(var + eps) * weight + bias per channel.
 * - @p training: mean and var are the batch's (biased var), and backward goes through them. The
 *   running estimates, when given, are updated in place: r = (1 - momentum) r + momentum s, with
 *   the unbiased variance for running_var. Needs more than one value per channel
 *   (WEFT_ERR_SHAPE).
 * - Otherwise mean and var are @p running_mean and @p running_var (required).
 * @param[in] weight, bias [C] (the affine parameters, differentiable), or NULL for 1 and 0.
 * @param[in,out] running_mean, running_var [C] or NULL while training; borrowed, never part of
 *                the graph. All tensors of x's dtype.
 * @param[in] momentum in [0, 1]; @param[in] eps > 0.
 * Not thread-safe for one pair of running estimates.
 */
WEFT_API weft_status_t weft_op_batch_norm2d(weft_tensor_t *x, weft_tensor_t *weight,
                                            weft_tensor_t *bias, weft_tensor_t *running_mean,
                                            weft_tensor_t *running_var, int training,
                                            double momentum, double eps, weft_tensor_t **out_p);
/**
 * torch.nn.functional.dropout2d for x [N, C, H, W]: when @p training, zeroes each whole channel
 * (n, c) with probability @p p (one weft_rng_uniform per channel, in (n, c) order, zeroed when
 * it is below p) and scales the others by 1 / (1 - p); otherwise (or p == 0) a copy. p == 0 and
 * p == 1 draw nothing. Arguments as weft_op_dropout.
 * @return WEFT_ERR_INVALID_ARG for p outside [0, 1] or a NULL rng while training.
 */
WEFT_API weft_status_t weft_op_dropout2d(weft_tensor_t *x, double p, int training, weft_rng_t *rng,
                                         weft_tensor_t **out_p);
/**
 * torch.flatten: dims @p start_dim..@p end_dim (negative counted from the end) merged into one;
 * a 0-D tensor becomes [1]. Shares storage (weft_op_reshape); any dtype.
 * @return WEFT_ERR_INVALID_ARG for a dim out of range or start_dim after end_dim.
 */
WEFT_API weft_status_t weft_op_flatten(weft_tensor_t *x, int start_dim, int end_dim,
                                       weft_tensor_t **out_p);
/**
 * torch.nn.functional.nll_loss (no class weights): loss_i = -log_probs[i, target[i]] for
 * @p log_probs [N, C] and i64 @p target [N] (each in [0, C), else WEFT_ERR_INVALID_ARG naming
 * the first bad one; torch's ignore_index is not supported); a scalar for MEAN/SUM, [N] for NONE.
 */
WEFT_API weft_status_t weft_op_nll_loss(weft_tensor_t *log_probs, weft_tensor_t *target,
                                        weft_reduction_t reduction, weft_tensor_t **out_p);

#ifdef __cplusplus
}
#endif
#endif
