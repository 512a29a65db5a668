/*
 * Optimizer update rules as tensor kernels: torch 1.13's SGD, Adagrad, Adam and AdamW
 * (torch.optim, single-tensor path, maximize=False), applied in place to one parameter from its
 * gradient and its state tensors, without autograd. A parameter server applies them to its shards;
 * the optimizer objects of <weft/nn.h> apply them to a module's parameters.
 *
 * Conventions for every function here:
 * - Tensors are borrowed for the call. @p param and the state tensors are updated in place; the
 *   gradient is only read. All are CPU tensors of one dtype, f32 or f64, and the same shape as
 *   @p param (sparse rows: see below); distinct tensors must not share storage.
 * - f32 arithmetic runs in f32 with torch's order of operations and its scalars rounded to f32
 *   as torch rounds them, so results agree with torch to a few ulps; f64 runs in f64.
 * - @p step is the parameter's step number counting this update: 1 on its first update. Each
 *   parameter counts its own steps (torch's per-parameter state["step"]).
 * - Nothing is written unless the call succeeds; on failure weft_last_error() names the bad
 *   value or tensor. Statuses: WEFT_ERR_INVALID_ARG (a NULL argument, a bad hyperparameter,
 *   step < 1, tensors sharing storage, an index out of range), WEFT_ERR_DTYPE (not f32/f64, or
 *   dtypes differ; indices not i64), WEFT_ERR_SHAPE (shapes differ), WEFT_ERR_UNSUPPORTED (a
 *   non-CPU tensor; an option the sparse rule does not take), WEFT_ERR_NO_MEMORY (sparse only).
 * - Thread-safe for distinct tensors; two threads must not update the same parameter at once.
 *
 * Sparse-row variants (for embedding tables): the gradient is @p indices (i64 [nnz]) and @p rows
 * ([nnz, param dims 1...], param's dtype): rows[k] is the gradient of row indices[k] of @p param.
 * Rows of repeated indices are summed first (torch coalesces), and only the named rows change.
 */
#ifndef WEFT_OPTIM_H
#define WEFT_OPTIM_H

#include <weft/api.h>

#include <stdint.h>

#include <weft/status.h>
#include <weft/tensor.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- SGD ------------------------------------------------------------------------------------- */

/** torch.optim.SGD's hyperparameters. */
typedef struct {
    double lr;           /**< learning rate, >= 0 */
    double momentum;     /**< >= 0; 0 turns momentum (and its buffer) off */
    double dampening;    /**< the buffer takes (1 - dampening) of each gradient after the first */
    double weight_decay; /**< L2 penalty added to the gradient, >= 0 */
    int nesterov;        /**< Nesterov momentum: needs momentum > 0 and dampening == 0 */
} weft_optim_sgd_config_t;

/** Initialiser with torch's defaults (torch 1.13 has no default lr; this takes 2.x's 1e-3). */
#define WEFT_OPTIM_SGD_DEFAULTS                                                                    \
    {                                                                                              \
        .lr = 1e-3, .momentum = 0.0, .dampening = 0.0, .weight_decay = 0.0, .nesterov = 0          \
    }
/** WEFT_OPTIM_SGD_DEFAULTS as a value. */
WEFT_API weft_optim_sgd_config_t weft_optim_sgd_defaults(void);
/**
 * Checks the hyperparameters as torch's constructor does.
 * @return WEFT_OK; WEFT_ERR_INVALID_ARG (NULL, lr < 0, momentum < 0, weight_decay < 0, NaN,
 *         nesterov without momentum or with dampening), with the value in weft_last_error().
 */
WEFT_API weft_status_t weft_optim_sgd_config_check(const weft_optim_sgd_config_t *cfg);
/**
 * One SGD step: d = grad + weight_decay * param; with momentum, buf = d on step 1 and
 * buf = momentum * buf + (1 - dampening) * d after, then d = buf (or d + momentum * buf with
 * Nesterov); param -= lr * d.
 * @param[in] cfg hyperparameters (checked as weft_optim_sgd_config_check).
 * @param[in,out] param the parameter.
 * @param[in] grad its gradient.
 * @param[in,out] momentum_buf the momentum buffer (contents ignored on step 1); NULL when
 *                cfg->momentum == 0, required otherwise.
 * @param[in] step 1 on the parameter's first update (initialises the buffer), then 2, 3, ...
 */
WEFT_API weft_status_t weft_optim_sgd_step(const weft_optim_sgd_config_t *cfg, weft_tensor_t *param,
                                           const weft_tensor_t *grad, weft_tensor_t *momentum_buf,
                                           int64_t step);
/**
 * SGD from a sparse-row gradient: param[indices[k]] -= lr * (sum of the rows of that index).
 * Like torch, takes no momentum and no weight decay (WEFT_ERR_UNSUPPORTED otherwise).
 * @param[in] indices i64 [nnz], each in [0, param dim 0); @param[in] rows [nnz, param dims 1...].
 */
WEFT_API weft_status_t weft_optim_sgd_sparse_step(const weft_optim_sgd_config_t *cfg,
                                                  weft_tensor_t *param,
                                                  const weft_tensor_t *indices,
                                                  const weft_tensor_t *rows);

/* ---- Adagrad --------------------------------------------------------------------------------- */

/** torch.optim.Adagrad's hyperparameters. */
typedef struct {
    double lr;                        /**< >= 0 */
    double lr_decay;                  /**< step t uses lr / (1 + (t - 1) * lr_decay); >= 0 */
    double weight_decay;              /**< L2 penalty added to the gradient, >= 0 */
    double initial_accumulator_value; /**< the sum's initial value, >= 0 (the caller fills it) */
    double eps;                       /**< added to the root of the sum, >= 0 */
} weft_optim_adagrad_config_t;

/** Initialiser with torch's defaults. */
#define WEFT_OPTIM_ADAGRAD_DEFAULTS                                                                \
    {                                                                                              \
        .lr = 1e-2, .lr_decay = 0.0, .weight_decay = 0.0, .initial_accumulator_value = 0.0,        \
        .eps = 1e-10                                                                               \
    }
/** WEFT_OPTIM_ADAGRAD_DEFAULTS as a value. */
WEFT_API weft_optim_adagrad_config_t weft_optim_adagrad_defaults(void);
/** Checks the hyperparameters: each >= 0 and not NaN; WEFT_ERR_INVALID_ARG naming the value. */
WEFT_API weft_status_t weft_optim_adagrad_config_check(const weft_optim_adagrad_config_t *cfg);
/**
 * One Adagrad step: g = grad + weight_decay * param; sum += g * g;
 * param -= clr * g / (sqrt(sum) + eps) with clr = lr / (1 + (step - 1) * lr_decay).
 * @param[in,out] sum the sum of squares; fill it with cfg->initial_accumulator_value before the
 *                first step (weft_tensor_fill).
 */
WEFT_API weft_status_t weft_optim_adagrad_step(const weft_optim_adagrad_config_t *cfg,
                                               weft_tensor_t *param, const weft_tensor_t *grad,
                                               weft_tensor_t *sum, int64_t step);
/**
 * Adagrad from a sparse-row gradient, as torch's sparse Adagrad: for each distinct index r with
 * summed row g, sum[r] += g * g and param[r] -= clr * g / (sqrt(sum[r]) + eps); other rows do
 * not change. No weight decay (WEFT_ERR_UNSUPPORTED otherwise, as torch).
 */
WEFT_API weft_status_t weft_optim_adagrad_sparse_step(const weft_optim_adagrad_config_t *cfg,
                                                      weft_tensor_t *param,
                                                      const weft_tensor_t *indices,
                                                      const weft_tensor_t *rows, weft_tensor_t *sum,
                                                      int64_t step);

/* ---- Adam and AdamW -------------------------------------------------------------------------- */

/** torch.optim.Adam's and AdamW's hyperparameters. */
typedef struct {
    double lr;           /**< >= 0 */
    double beta1;        /**< in [0, 1) */
    double beta2;        /**< in [0, 1) */
    double eps;          /**< >= 0 */
    double weight_decay; /**< >= 0: Adam adds it to the gradient; AdamW decays the parameter */
    int amsgrad;         /**< keep the maximum of the second moments */
} weft_optim_adam_config_t;

/** Initialiser with torch.optim.Adam's defaults. */
#define WEFT_OPTIM_ADAM_DEFAULTS                                                                   \
    {                                                                                              \
        .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.0, .amsgrad = 0   \
    }
/** Initialiser with torch.optim.AdamW's defaults (weight_decay 1e-2). */
#define WEFT_OPTIM_ADAMW_DEFAULTS                                                                  \
    {                                                                                              \
        .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 1e-2, .amsgrad = 0  \
    }
/** WEFT_OPTIM_ADAM_DEFAULTS as a value. */
WEFT_API weft_optim_adam_config_t weft_optim_adam_defaults(void);
/** WEFT_OPTIM_ADAMW_DEFAULTS as a value. */
WEFT_API weft_optim_adam_config_t weft_optim_adamw_defaults(void);
/**
 * Checks the hyperparameters: lr, eps, weight_decay >= 0, betas in [0, 1), none NaN;
 * WEFT_ERR_INVALID_ARG naming the value.
 */
WEFT_API weft_status_t weft_optim_adam_config_check(const weft_optim_adam_config_t *cfg);
/**
 * One Adam step: g = grad + weight_decay * param; exp_avg = beta1 * exp_avg + (1 - beta1) * g;
 * exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g; with amsgrad, max_exp_avg_sq =
 * max(max_exp_avg_sq, exp_avg_sq) (NaN if either is) and v = max_exp_avg_sq, else v = exp_avg_sq;
 * param -= lr / (1 - beta1^step) * exp_avg / (sqrt(v) / sqrt(1 - beta2^step) + eps).
 * @param[in,out] exp_avg, exp_avg_sq the moments, zero before the first step.
 * @param[in,out] max_exp_avg_sq zero before the first step; required with amsgrad, ignored (may
 *                be NULL) without.
 */
WEFT_API weft_status_t weft_optim_adam_step(const weft_optim_adam_config_t *cfg,
                                            weft_tensor_t *param, const weft_tensor_t *grad,
                                            weft_tensor_t *exp_avg, weft_tensor_t *exp_avg_sq,
                                            weft_tensor_t *max_exp_avg_sq, int64_t step);
/**
 * One AdamW step: param *= 1 - lr * weight_decay, then Adam's update with the raw gradient
 * (no weight decay added to it). Same arguments as weft_optim_adam_step.
 */
WEFT_API weft_status_t weft_optim_adamw_step(const weft_optim_adam_config_t *cfg,
                                             weft_tensor_t *param, const weft_tensor_t *grad,
                                             weft_tensor_t *exp_avg, weft_tensor_t *exp_avg_sq,
                                             weft_tensor_t *max_exp_avg_sq, int64_t step);

#ifdef __cplusplus
}
#endif
#endif
