/*
 * Neural-network modules (Linear, MLP, Embedding, EmbeddingBag, Conv2d, BatchNorm2d, ResNet's
 * BasicBlock) over the operations of <weft/ops.h>, named parameter lists, and optimizer objects
 * (SGD, Adagrad, Adam, AdamW) that apply the kernels of <weft/optim.h> to a parameter list.
 *
 * Modules create their parameters as leaf tensors that require gradients, initialised as torch
 * initialises them, from an explicit weft_rng_t (the same seed gives the same parameters). A
 * module holds a reference to each parameter and releases it when freed; a parameter list holds
 * its own references, so parameters outlive a module while a list or an optimizer holds them.
 *
 * Thread-safety: a module, a parameter list or an optimizer must not be used by two threads at
 * once. Forward passes of one module on several threads at once are fine while nothing modifies
 * its parameters.
 */
#ifndef WEFT_NN_H
#define WEFT_NN_H

#include <weft/api.h>

/* Layering (docs/architecture.md): only autograd and the modules above it may include this. */
#if defined(WEFT_BUILDING) && !defined(WEFT_SEES_AUTOGRAD)
#error "weft/nn.h is above the module being built: dependencies point downward only"
#endif

#include <stdint.h>

#include <weft/ops.h>
#include <weft/optim.h>
#include <weft/random.h>
#include <weft/status.h>
#include <weft/tensor.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- parameter lists (autograd/nn.c) --------------------------------------------------------- */

/** An ordered list of named parameters ("fc1.weight", "fc1.bias", ...). */
typedef struct weft_param_list weft_param_list_t;

/** Creates an empty list. @param[out] list_p caller frees with weft_param_list_free. */
WEFT_API weft_status_t weft_param_list_create(weft_param_list_t **list_p);
/** Releases the list's references to its parameters and frees it. NULL is a no-op. */
WEFT_API void weft_param_list_free(weft_param_list_t *list);
/**
 * Appends @p param under @p name (copied). The list retains @p param; the caller keeps its own
 * reference.
 * @return WEFT_ERR_INVALID_ARG (NULL), WEFT_ERR_ALREADY_EXISTS (the name is taken),
 *         WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_param_list_add(weft_param_list_t *list, const char *name,
                                           weft_tensor_t *param);
/**
 * Appends every parameter of @p other, named "<prefix>.<its name>" (its own name when @p prefix
 * is NULL or empty). On failure @p list is unchanged.
 */
WEFT_API weft_status_t weft_param_list_extend(weft_param_list_t *list, const char *prefix,
                                              const weft_param_list_t *other);
/** Number of parameters. */
WEFT_API int weft_param_list_size(const weft_param_list_t *list);
/** Parameter @p i (0 <= i < size), borrowed from the list; NULL when out of range. */
WEFT_API weft_tensor_t *weft_param_list_get(const weft_param_list_t *list, int i);
/** Name of parameter @p i, borrowed from the list; NULL when out of range. */
WEFT_API const char *weft_param_list_name(const weft_param_list_t *list, int i);
/** The parameter named @p name, borrowed; NULL when there is none. */
WEFT_API weft_tensor_t *weft_param_list_find(const weft_param_list_t *list, const char *name);
/** Total number of elements of the parameters. */
WEFT_API int64_t weft_param_list_numel(const weft_param_list_t *list);
/** Drops every parameter's gradient, dense and sparse (weft_tensor_grad_clear). */
WEFT_API void weft_param_list_zero_grad(const weft_param_list_t *list);

/**
 * Copies the parameters, in list order, into the 1-D tensor @p flat of weft_param_list_numel
 * elements and the parameters' common dtype (for broadcasting or averaging a model as one
 * buffer).
 * @return WEFT_ERR_DTYPE (the parameters' dtypes differ, or @p flat's differs),
 *         WEFT_ERR_SHAPE (@p flat is not 1-D of that size), WEFT_ERR_INVALID_ARG (NULL).
 */
WEFT_API weft_status_t weft_param_list_pack(const weft_param_list_t *list, weft_tensor_t *flat);
/** The inverse of weft_param_list_pack: writes @p flat's slices into the parameters. */
WEFT_API weft_status_t weft_param_list_unpack(const weft_param_list_t *list,
                                              const weft_tensor_t *flat);
/**
 * Copies the gradients into @p flat as weft_param_list_pack copies the parameters: a parameter
 * without a gradient gives zeros, and a sparse gradient is written densely (rows of repeated
 * indices summed). For all-reducing gradients as one buffer.
 */
WEFT_API weft_status_t weft_param_list_pack_grads(const weft_param_list_t *list,
                                                  weft_tensor_t *flat);
/**
 * Writes @p flat's slices into the parameters' dense gradients: in place where a parameter has
 * a dense gradient, as a new one (replacing a sparse one) where it does not.
 * @return as weft_param_list_pack, and WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_param_list_unpack_grads(const weft_param_list_t *list,
                                                    const weft_tensor_t *flat);

/* ---- activations ----------------------------------------------------------------------------- */

typedef enum {
    WEFT_NN_ACT_NONE = 0,
    WEFT_NN_ACT_RELU = 1,
    WEFT_NN_ACT_TANH = 2,
    WEFT_NN_ACT_SIGMOID = 3,
    WEFT_NN_ACT_GELU = 4,
} weft_nn_activation_t;

/**
 * Applies @p act to @p x (NONE: a new reference to @p x itself).
 * @param[out] y_p caller releases with weft_tensor_release.
 * @return the op's status; WEFT_ERR_INVALID_ARG for an unknown activation.
 */
WEFT_API weft_status_t weft_nn_activation(weft_nn_activation_t act, weft_tensor_t *x,
                                          weft_tensor_t **y_p);

/* ---- Linear ---------------------------------------------------------------------------------- */

/** torch.nn.Linear: y = x W^T + b, W [out, in], b [out]. */
typedef struct weft_nn_linear weft_nn_linear_t;

/**
 * Creates a Linear layer with torch's initialisation: W from kaiming_uniform (a = sqrt(5)),
 * which is uniform(-1/sqrt(in), 1/sqrt(in)), then b from uniform(-1/sqrt(in), 1/sqrt(in)).
 * @param[in] in_features, out_features >= 0. @param[in] bias 0 for none.
 * @param[in] dtype WEFT_F32 or WEFT_F64. @param[in,out] rng the stream the values come from.
 * @param[out] lin_p caller frees with weft_nn_linear_free.
 * @return WEFT_ERR_INVALID_ARG (negative size, NULL rng), WEFT_ERR_DTYPE, WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_nn_linear_create(int64_t in_features, int64_t out_features, int bias,
                                             weft_dtype_t dtype, weft_rng_t *rng,
                                             weft_nn_linear_t **lin_p);
/** Releases the layer's parameters (lists and optimizers keep theirs) and frees it. */
WEFT_API void weft_nn_linear_free(weft_nn_linear_t *lin);
/**
 * y = linear(x, W, b) for x [..., in] (weft_op_linear; records the graph when grad mode is on).
 * @param[out] y_p [..., out]; caller releases.
 */
WEFT_API weft_status_t weft_nn_linear_forward(weft_nn_linear_t *lin, weft_tensor_t *x,
                                              weft_tensor_t **y_p);
/** The weight [out, in], borrowed from the layer. */
WEFT_API weft_tensor_t *weft_nn_linear_weight(const weft_nn_linear_t *lin);
/** The bias [out], borrowed; NULL for a layer without bias. */
WEFT_API weft_tensor_t *weft_nn_linear_bias(const weft_nn_linear_t *lin);
/** Its parameters, "weight" and "bias"; borrowed from the layer. */
WEFT_API const weft_param_list_t *weft_nn_linear_params(const weft_nn_linear_t *lin);

/* ---- MLP ------------------------------------------------------------------------------------- */

/** Linear layers with an activation between them. */
typedef struct weft_nn_mlp weft_nn_mlp_t;

typedef struct {
    weft_nn_activation_t activation;        /**< between layers */
    weft_nn_activation_t output_activation; /**< after the last layer */
    int bias;                               /**< layers with bias */
    weft_dtype_t dtype;                     /**< WEFT_F32 or WEFT_F64 */
} weft_nn_mlp_config_t;

/** ReLU between layers, nothing after the last, biases, f32. */
#define WEFT_NN_MLP_DEFAULTS                                                                       \
    {                                                                                              \
        .activation = WEFT_NN_ACT_RELU, .output_activation = WEFT_NN_ACT_NONE, .bias = 1,          \
        .dtype = WEFT_F32                                                                          \
    }

/**
 * Creates an MLP of @p n_sizes - 1 Linear layers: layer i maps sizes[i] to sizes[i + 1] (so
 * {784, 256, 10} is 784 -> 256 -> 10). Layers are created in order from @p rng, and their
 * parameters are named "fc1.weight", "fc1.bias", "fc2.weight", ...
 * @param[in] cfg NULL for WEFT_NN_MLP_DEFAULTS.
 * @param[out] mlp_p caller frees with weft_nn_mlp_free.
 * @return WEFT_ERR_INVALID_ARG (fewer than 2 sizes, a negative size, a bad activation), and as
 *         weft_nn_linear_create.
 */
WEFT_API weft_status_t weft_nn_mlp_create(int n_sizes, const int64_t *sizes,
                                          const weft_nn_mlp_config_t *cfg, weft_rng_t *rng,
                                          weft_nn_mlp_t **mlp_p);
WEFT_API void weft_nn_mlp_free(weft_nn_mlp_t *mlp);
/** y = the layers applied in turn to x [..., sizes[0]]; @param[out] y_p caller releases. */
WEFT_API weft_status_t weft_nn_mlp_forward(weft_nn_mlp_t *mlp, weft_tensor_t *x,
                                           weft_tensor_t **y_p);
/** Number of Linear layers. */
WEFT_API int weft_nn_mlp_num_layers(const weft_nn_mlp_t *mlp);
/** Layer @p i (0-based), borrowed; NULL when out of range. */
WEFT_API weft_nn_linear_t *weft_nn_mlp_layer(const weft_nn_mlp_t *mlp, int i);
/** All parameters in layer order; borrowed from the MLP. */
WEFT_API const weft_param_list_t *weft_nn_mlp_params(const weft_nn_mlp_t *mlp);

/* ---- Embedding and EmbeddingBag -------------------------------------------------------------- */

/** torch.nn.Embedding: a [num, dim] table looked up by i64 indices. */
typedef struct weft_nn_embedding weft_nn_embedding_t;

/**
 * Creates a table [num_embeddings, dim] initialised normal(0, 1) from @p rng. With @p sparse,
 * lookups give the table sparse gradients (weft_tensor_sparse_grad; for SGD and Adagrad).
 * @param[out] emb_p caller frees with weft_nn_embedding_free.
 * @return WEFT_ERR_INVALID_ARG (negative size, NULL rng), WEFT_ERR_DTYPE, WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_nn_embedding_create(int64_t num_embeddings, int64_t dim, int sparse,
                                                weft_dtype_t dtype, weft_rng_t *rng,
                                                weft_nn_embedding_t **emb_p);
WEFT_API void weft_nn_embedding_free(weft_nn_embedding_t *emb);
/** Rows at @p indices (i64, any shape S): [S..., dim] (weft_op_embedding). */
WEFT_API weft_status_t weft_nn_embedding_forward(weft_nn_embedding_t *emb, weft_tensor_t *indices,
                                                 weft_tensor_t **y_p);
/** The table, borrowed. */
WEFT_API weft_tensor_t *weft_nn_embedding_weight(const weft_nn_embedding_t *emb);
/** Its parameter, "weight"; borrowed. */
WEFT_API const weft_param_list_t *weft_nn_embedding_params(const weft_nn_embedding_t *emb);

/** torch.nn.EmbeddingBag: sums or means of bags of rows. */
typedef struct weft_nn_embedding_bag weft_nn_embedding_bag_t;

/** As weft_nn_embedding_create, with the bag reduction @p mode. */
WEFT_API weft_status_t weft_nn_embedding_bag_create(int64_t num_embeddings, int64_t dim,
                                                    weft_bag_mode_t mode, int sparse,
                                                    weft_dtype_t dtype, weft_rng_t *rng,
                                                    weft_nn_embedding_bag_t **bag_p);
WEFT_API void weft_nn_embedding_bag_free(weft_nn_embedding_bag_t *bag);
/**
 * Bag b reduces the rows at indices [offsets[b], offsets[b + 1]) (weft_op_embedding_bag):
 * output [numel(offsets), dim].
 */
WEFT_API weft_status_t weft_nn_embedding_bag_forward(weft_nn_embedding_bag_t *bag,
                                                     weft_tensor_t *indices, weft_tensor_t *offsets,
                                                     weft_tensor_t **y_p);
WEFT_API weft_tensor_t *weft_nn_embedding_bag_weight(const weft_nn_embedding_bag_t *bag);
WEFT_API const weft_param_list_t *weft_nn_embedding_bag_params(const weft_nn_embedding_bag_t *bag);

/* ---- optimizers (autograd/optim.c) ----------------------------------------------------------- */

/**
 * An optimizer over a parameter list: it retains the parameters and owns their state tensors
 * (created zero, Adagrad's sums filled with initial_accumulator_value), and counts steps per
 * parameter as torch does (a parameter's count advances on the steps where it has a gradient).
 */
typedef struct weft_optimizer weft_optimizer_t;

/**
 * Creates an optimizer for the parameters of @p params (each f32 or f64; the list is read, not
 * kept: parameters added to it later are not optimized).
 * @param[in] cfg hyperparameters, copied; checked as weft_optim_*_config_check.
 * @param[out] opt_p caller frees with weft_optimizer_free.
 * @return WEFT_ERR_INVALID_ARG (NULL, bad hyperparameters), WEFT_ERR_DTYPE (a parameter that is
 *         not f32/f64), WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_optimizer_sgd_create(const weft_param_list_t *params,
                                                 const weft_optim_sgd_config_t *cfg,
                                                 weft_optimizer_t **opt_p);
WEFT_API weft_status_t weft_optimizer_adagrad_create(const weft_param_list_t *params,
                                                     const weft_optim_adagrad_config_t *cfg,
                                                     weft_optimizer_t **opt_p);
WEFT_API weft_status_t weft_optimizer_adam_create(const weft_param_list_t *params,
                                                  const weft_optim_adam_config_t *cfg,
                                                  weft_optimizer_t **opt_p);
/** AdamW: Adam's hyperparameters with decoupled weight decay (WEFT_OPTIM_ADAMW_DEFAULTS). */
WEFT_API weft_status_t weft_optimizer_adamw_create(const weft_param_list_t *params,
                                                   const weft_optim_adam_config_t *cfg,
                                                   weft_optimizer_t **opt_p);
/** Releases the parameters and frees the state. NULL is a no-op. */
WEFT_API void weft_optimizer_free(weft_optimizer_t *opt);
/**
 * One update of every parameter that has a gradient: a dense one (weft_tensor_grad) or, for
 * SGD (without momentum and weight decay) and Adagrad (without weight decay), a sparse one
 * (weft_tensor_sparse_grad). Parameters without a gradient are left alone. Everything is
 * checked before anything is written, so a failing step changes nothing (short of memory running
 * out while coalescing a sparse gradient, which leaves the parameters before it updated).
 * @return WEFT_ERR_UNSUPPORTED (a sparse gradient for Adam/AdamW, for SGD with momentum or
 *         weight decay, or for Adagrad with weight decay; a parameter with both a dense and a
 *         sparse gradient), WEFT_ERR_NO_MEMORY (coalescing sparse rows), or a kernel's status.
 */
WEFT_API weft_status_t weft_optimizer_step(weft_optimizer_t *opt);
/** Drops the gradients of the optimizer's parameters (weft_tensor_grad_clear). */
WEFT_API void weft_optimizer_zero_grad(weft_optimizer_t *opt);
/** The current learning rate. */
WEFT_API double weft_optimizer_lr(const weft_optimizer_t *opt);
/** Sets the learning rate for later steps (schedules). @return WEFT_ERR_INVALID_ARG for lr < 0. */
WEFT_API weft_status_t weft_optimizer_set_lr(weft_optimizer_t *opt, double lr);
/** Number of parameters the optimizer updates. */
WEFT_API int weft_optimizer_num_params(const weft_optimizer_t *opt);
/** How many updates parameter @p i has had (torch's state["step"]); -1 when out of range. */
WEFT_API int64_t weft_optimizer_param_steps(const weft_optimizer_t *opt, int i);
/**
 * A state tensor of parameter @p i, borrowed from the optimizer (it may be read or written in
 * place, e.g. to checkpoint it): "momentum_buffer" (SGD with momentum), "sum" (Adagrad),
 * "exp_avg", "exp_avg_sq", "max_exp_avg_sq" (Adam/AdamW, the last with amsgrad).
 * @return NULL when there is no such state.
 */
WEFT_API weft_tensor_t *weft_optimizer_state(const weft_optimizer_t *opt, int i, const char *name);

/* ---- Conv2d and BatchNorm2d (autograd/nn.c) -------------------------------------------------- */

/** torch.nn.Conv2d: y = conv2d(x, W, b), W [out, in / groups, kH, kW], b [out]. */
typedef struct weft_nn_conv2d weft_nn_conv2d_t;

typedef struct {
    int64_t stride[2];   /**< {height, width}, >= 1 */
    int64_t padding[2];  /**< zeros on each side, >= 0 */
    int64_t dilation[2]; /**< >= 1 */
    int64_t groups;      /**< >= 1, dividing in_channels and out_channels */
    int bias;            /**< 0 for none */
    weft_dtype_t dtype;  /**< WEFT_F32 or WEFT_F64 */
} weft_nn_conv2d_config_t;

/** torch's defaults: stride 1, no padding, dilation 1, one group, a bias; f32. */
#define WEFT_NN_CONV2D_DEFAULTS                                                                    \
    {                                                                                              \
        .stride = {1, 1}, .padding = {0, 0}, .dilation = {1, 1}, .groups = 1, .bias = 1,           \
        .dtype = WEFT_F32                                                                          \
    }

/**
 * Creates a Conv2d layer with torch's initialisation: W from kaiming_uniform (a = sqrt(5)),
 * which is uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan_in = in / groups * kH * kW, then b
 * from the same range.
 * @param[in] in_channels, out_channels >= 1; @param[in] kernel {kH, kW}, each >= 1.
 * @param[in] cfg NULL for WEFT_NN_CONV2D_DEFAULTS; copied.
 * @param[in,out] rng the stream the values come from.
 * @param[out] conv_p caller frees with weft_nn_conv2d_free.
 * @return WEFT_ERR_INVALID_ARG (sizes, stride, padding, dilation or groups out of range, groups
 *         not dividing the channels, NULL), WEFT_ERR_DTYPE, WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_nn_conv2d_create(int64_t in_channels, int64_t out_channels,
                                             const int64_t *kernel,
                                             const weft_nn_conv2d_config_t *cfg, weft_rng_t *rng,
                                             weft_nn_conv2d_t **conv_p);
/** Releases the layer's parameters (lists and optimizers keep theirs) and frees it. */
WEFT_API void weft_nn_conv2d_free(weft_nn_conv2d_t *conv);
/**
 * y = conv2d(x, W, b) for x [N, in, H, W] (weft_op_conv2d; records the graph when grad mode is
 * on). @param[out] y_p [N, out, OH, OW]; caller releases.
 */
WEFT_API weft_status_t weft_nn_conv2d_forward(weft_nn_conv2d_t *conv, weft_tensor_t *x,
                                              weft_tensor_t **y_p);
/** The weight [out, in / groups, kH, kW], borrowed from the layer. */
WEFT_API weft_tensor_t *weft_nn_conv2d_weight(const weft_nn_conv2d_t *conv);
/** The bias [out], borrowed; NULL for a layer without bias. */
WEFT_API weft_tensor_t *weft_nn_conv2d_bias(const weft_nn_conv2d_t *conv);
/** Its parameters, "weight" and "bias"; borrowed from the layer. */
WEFT_API const weft_param_list_t *weft_nn_conv2d_params(const weft_nn_conv2d_t *conv);

/**
 * torch.nn.BatchNorm2d (affine, tracking running statistics): normalises each channel of
 * x [N, C, H, W] with the batch's statistics while training (updating the running ones) and
 * with the running ones in eval mode (weft_op_batch_norm2d).
 */
typedef struct weft_nn_batch_norm2d weft_nn_batch_norm2d_t;

/**
 * Creates the layer in training mode: weight 1, bias 0, running_mean 0, running_var 1.
 * @param[in] num_features C >= 1; @param[in] eps > 0 (torch: 1e-5);
 * @param[in] momentum in [0, 1] (torch: 0.1); @param[in] dtype WEFT_F32 or WEFT_F64.
 * @param[out] bn_p caller frees with weft_nn_batch_norm2d_free.
 * @return WEFT_ERR_INVALID_ARG, WEFT_ERR_DTYPE, WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_nn_batch_norm2d_create(int64_t num_features, double eps,
                                                   double momentum, weft_dtype_t dtype,
                                                   weft_nn_batch_norm2d_t **bn_p);
/** Releases the layer's parameters and running statistics and frees it. NULL is a no-op. */
WEFT_API void weft_nn_batch_norm2d_free(weft_nn_batch_norm2d_t *bn);
/** Training (non-zero, the default) or eval mode, as torch's module.train() / .eval(). */
WEFT_API void weft_nn_batch_norm2d_set_training(weft_nn_batch_norm2d_t *bn, int training);
/** 1 in training mode, 0 in eval mode. */
WEFT_API int weft_nn_batch_norm2d_training(const weft_nn_batch_norm2d_t *bn);
/**
 * y = batch_norm2d(x) in the layer's mode; in training mode the running statistics are updated
 * in place. @param[out] y_p x's shape; caller releases.
 */
WEFT_API weft_status_t weft_nn_batch_norm2d_forward(weft_nn_batch_norm2d_t *bn, weft_tensor_t *x,
                                                    weft_tensor_t **y_p);
/** gamma [C], borrowed. */
WEFT_API weft_tensor_t *weft_nn_batch_norm2d_weight(const weft_nn_batch_norm2d_t *bn);
/** beta [C], borrowed. */
WEFT_API weft_tensor_t *weft_nn_batch_norm2d_bias(const weft_nn_batch_norm2d_t *bn);
/** The running mean [C], borrowed (not a parameter: no gradient). */
WEFT_API weft_tensor_t *weft_nn_batch_norm2d_running_mean(const weft_nn_batch_norm2d_t *bn);
/** The running variance [C], borrowed. */
WEFT_API weft_tensor_t *weft_nn_batch_norm2d_running_var(const weft_nn_batch_norm2d_t *bn);
/** Its parameters, "weight" and "bias"; borrowed from the layer. */
WEFT_API const weft_param_list_t *weft_nn_batch_norm2d_params(const weft_nn_batch_norm2d_t *bn);
/**
 * Its buffers, "running_mean" and "running_var" (torch's state_dict entries, e.g. to broadcast
 * or checkpoint them); borrowed from the layer.
 */
WEFT_API const weft_param_list_t *weft_nn_batch_norm2d_buffers(const weft_nn_batch_norm2d_t *bn);

/* ---- ResNet BasicBlock (autograd/nn.c) ------------------------------------------------------ */

/**
 * torchvision's ResNet BasicBlock: y = relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)), with
 * conv1 3x3 of stride s and conv2 3x3 of stride 1 (padding 1, no bias), each followed by a
 * BatchNorm2d (eps 1e-5, momentum 0.1). The shortcut is x itself, or, when s != 1 or the channels
 * change, a 1x1 convolution of stride s (no bias) then a BatchNorm2d (torchvision's downsample).
 */
typedef struct weft_nn_basic_block weft_nn_basic_block_t;

/**
 * Creates the block in training mode. The convolutions are initialised as torch.nn.Conv2d
 * (weft_nn_conv2d_create: conv1, then conv2, then the downsample's, from @p rng); the
 * BatchNorm2d layers as weft_nn_batch_norm2d_create.
 * @param[in] in_channels, out_channels >= 1; @param[in] stride >= 1 (of conv1 and the
 *            downsample); @param[in] dtype WEFT_F32 or WEFT_F64; @param[in,out] rng the stream
 *            the weights come from.
 * @param[out] block_p caller frees with weft_nn_basic_block_free.
 * @return WEFT_ERR_INVALID_ARG (sizes or stride out of range, NULL), WEFT_ERR_DTYPE,
 *         WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_nn_basic_block_create(int64_t in_channels, int64_t out_channels,
                                                  int64_t stride, weft_dtype_t dtype,
                                                  weft_rng_t *rng, weft_nn_basic_block_t **block_p);
/** Releases the block's layers (lists and optimizers keep their parameters). NULL is a no-op. */
WEFT_API void weft_nn_basic_block_free(weft_nn_basic_block_t *block);
/**
 * The block applied to x [N, in, H, W] in its mode (records the graph when grad mode is on; in
 * training mode the running statistics of its BatchNorm2d layers are updated in place).
 * @param[out] y_p [N, out, OH, OW] with OH = (H - 1) / stride + 1 (likewise OW); caller releases.
 * @return the ops' statuses (WEFT_ERR_SHAPE for x not [N, in, H, W]), WEFT_ERR_INVALID_ARG (NULL).
 */
WEFT_API weft_status_t weft_nn_basic_block_forward(weft_nn_basic_block_t *block, weft_tensor_t *x,
                                                   weft_tensor_t **y_p);
/** Training (non-zero, the default) or eval mode of its BatchNorm2d layers (module.train()). */
WEFT_API void weft_nn_basic_block_set_training(weft_nn_basic_block_t *block, int training);
/** 1 in training mode, 0 in eval mode. */
WEFT_API int weft_nn_basic_block_training(const weft_nn_basic_block_t *block);
/** 1 when the shortcut is the 1x1 convolution and BatchNorm2d, 0 when it is the identity. */
WEFT_API int weft_nn_basic_block_has_downsample(const weft_nn_basic_block_t *block);
/**
 * Its parameters with torchvision's names, in its order: "conv1.weight", "bn1.weight",
 * "bn1.bias", "conv2.weight", "bn2.weight", "bn2.bias", then with a downsample
 * "downsample.0.weight", "downsample.1.weight", "downsample.1.bias"; borrowed from the block.
 */
WEFT_API const weft_param_list_t *weft_nn_basic_block_params(const weft_nn_basic_block_t *block);
/**
 * Its buffers (no gradients): "bn1.running_mean", "bn1.running_var", "bn2.running_mean",
 * "bn2.running_var", then "downsample.1.running_mean", "downsample.1.running_var" (torch's
 * state_dict entries, less num_batches_tracked); borrowed from the block.
 */
WEFT_API const weft_param_list_t *weft_nn_basic_block_buffers(const weft_nn_basic_block_t *block);

#ifdef __cplusplus
}
#endif
#endif
