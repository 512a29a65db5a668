/*
 * Optimizers step for step against torch 1.13 (data/optim_table.h, made by data/gen_optim.py):
 * the core kernels of <weft/optim.h> and the optimizer objects of <weft/nn.h>, dense and sparse,
 * f64 within 1e-12 and f32 within 1e-6 (relative to max(|torch's value|, 1)); bad
 * hyperparameters, mismatched tensors and sparse options torch refuses give the right status.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <weft/weft.h>

#include "data/optim_table.h"

TestSuite(optim, .timeout = 120);

#define N_CASES        (sizeof optim_cases / sizeof optim_cases[0])
#define N_SPARSE_CASES (sizeof sparse_cases / sizeof sparse_cases[0])

#define F64_RTOL 1e-12
#define F32_RTOL 1e-6

/* ---- helpers --------------------------------------------------------------------------------- */

static weft_tensor_t *tensor(weft_dtype_t dt, int64_t rows, int64_t cols)
{
    weft_tensor_t *t = NULL;
    int64_t shape[2] = {rows, cols};

    cr_assert_eq(weft_tensor_create(dt, 2, shape, &t), WEFT_OK);
    return t;
}

static weft_tensor_t *tensor_i64(int64_t n, const int64_t *values)
{
    weft_tensor_t *t = NULL;

    cr_assert_eq(weft_tensor_create(WEFT_I64, 1, &n, &t), WEFT_OK);
    memcpy(weft_tensor_data(t), values, (size_t)n * sizeof(int64_t));
    return t;
}

static void set(weft_tensor_t *t, int64_t i, double v)
{
    if (weft_tensor_dtype(t) == WEFT_F32) {
        ((float *)weft_tensor_data(t))[i] = (float)v;
    } else {
        ((double *)weft_tensor_data(t))[i] = v;
    }
}

static double get(const weft_tensor_t *t, int64_t i)
{
    if (weft_tensor_dtype(t) == WEFT_F32) {
        return ((const float *)weft_tensor_data(t))[i];
    }
    return ((const double *)weft_tensor_data(t))[i];
}

/* Element i takes values[i % n]: a wide tensor repeats the table, so the kernels' full-block
 * (vectorised) loops meet torch's values too. */
static void fill_cyclic(weft_tensor_t *t, const double *values, int64_t n)
{
    for (int64_t i = 0, numel = weft_tensor_numel(t); i < numel; i++) {
        set(t, i, values[i % n]);
    }
}

static void expect_cyclic(const char *name, weft_dtype_t dt, int step, const weft_tensor_t *t,
                          const double *want, int64_t n)
{
    double rtol = dt == WEFT_F32 ? F32_RTOL : F64_RTOL;

    for (int64_t i = 0, numel = weft_tensor_numel(t); i < numel; i++) {
        double w = want[i % n];
        double g = get(t, i);
        cr_assert(fabs(g - w) <= rtol * fmax(fabs(w), 1.0),
                  "%s %s step %d element %lld: got %.17g, torch %.17g", name, weft_dtype_name(dt),
                  step + 1, (long long)i, g, w);
    }
}

static weft_optim_sgd_config_t sgd_config(const optim_case_t *c)
{
    weft_optim_sgd_config_t cfg = {.lr = c->lr,
                                   .momentum = c->momentum,
                                   .dampening = c->dampening,
                                   .weight_decay = c->weight_decay,
                                   .nesterov = c->nesterov};
    return cfg;
}

static weft_optim_adagrad_config_t adagrad_config(const optim_case_t *c)
{
    weft_optim_adagrad_config_t cfg = {.lr = c->lr,
                                       .lr_decay = c->lr_decay,
                                       .weight_decay = c->weight_decay,
                                       .initial_accumulator_value = c->initial_accumulator_value,
                                       .eps = c->eps};
    return cfg;
}

static weft_optim_adam_config_t adam_config(const optim_case_t *c)
{
    weft_optim_adam_config_t cfg = {.lr = c->lr,
                                    .beta1 = c->beta1,
                                    .beta2 = c->beta2,
                                    .eps = c->eps,
                                    .weight_decay = c->weight_decay,
                                    .amsgrad = c->amsgrad};
    return cfg;
}

/* The sparse table's cases share the dense struct's leading fields. */
static optim_case_t sparse_as_dense(const sparse_case_t *s)
{
    optim_case_t c = {.name = s->name,
                      .kind = s->kind,
                      .lr = s->lr,
                      .momentum = s->momentum,
                      .dampening = s->dampening,
                      .weight_decay = s->weight_decay,
                      .nesterov = s->nesterov,
                      .lr_decay = s->lr_decay,
                      .initial_accumulator_value = s->initial_accumulator_value,
                      .eps = s->eps,
                      .beta1 = s->beta1,
                      .beta2 = s->beta2,
                      .amsgrad = s->amsgrad};
    return c;
}

/* ---- kernels, dense -------------------------------------------------------------------------- */

/* Runs one case of the table through the kernels on a [reps * ROWS, COLS] tensor. */
static void run_kernel_case(const optim_case_t *c, weft_dtype_t dt, int64_t reps)
{
    weft_tensor_t *param = tensor(dt, reps * OPTIM_ROWS, OPTIM_COLS);
    weft_tensor_t *grad = tensor(dt, reps * OPTIM_ROWS, OPTIM_COLS);
    weft_tensor_t *s1 = tensor(dt, reps * OPTIM_ROWS, OPTIM_COLS);
    weft_tensor_t *s2 = tensor(dt, reps * OPTIM_ROWS, OPTIM_COLS);
    weft_tensor_t *s3 = tensor(dt, reps * OPTIM_ROWS, OPTIM_COLS);
    weft_optim_sgd_config_t sgd = sgd_config(c);
    weft_optim_adagrad_config_t adagrad = adagrad_config(c);
    weft_optim_adam_config_t adam = adam_config(c);

    fill_cyclic(param, optim_init, OPTIM_NUMEL);
    if (c->kind == OPTIM_ADAGRAD) {
        cr_assert_eq(weft_tensor_fill(s1, c->initial_accumulator_value), WEFT_OK);
    }
    for (int step = 0; step < OPTIM_STEPS; step++) {
        weft_status_t st = WEFT_ERR_INVALID_STATE;

        fill_cyclic(grad, optim_grads[step], OPTIM_NUMEL);
        switch (c->kind) {
        case OPTIM_SGD:
            st = weft_optim_sgd_step(&sgd, param, grad, c->momentum != 0 ? s1 : NULL, step + 1);
            break;
        case OPTIM_ADAGRAD:
            st = weft_optim_adagrad_step(&adagrad, param, grad, s1, step + 1);
            break;
        case OPTIM_ADAM:
            st = weft_optim_adam_step(&adam, param, grad, s1, s2, c->amsgrad ? s3 : NULL, step + 1);
            break;
        case OPTIM_ADAMW:
            st =
                weft_optim_adamw_step(&adam, param, grad, s1, s2, c->amsgrad ? s3 : NULL, step + 1);
            break;
        }
        cr_assert_eq(st, WEFT_OK, "%s: %s", c->name, weft_last_error());
        expect_cyclic(c->name, dt, step, param, dt == WEFT_F32 ? c->f32[step] : c->f64[step],
                      OPTIM_NUMEL);
    }
    weft_tensor_release(param);
    weft_tensor_release(grad);
    weft_tensor_release(s1);
    weft_tensor_release(s2);
    weft_tensor_release(s3);
}

Test(optim, kernels_match_torch_dense)
{
    for (size_t k = 0; k < N_CASES; k++) {
        run_kernel_case(&optim_cases[k], WEFT_F64, 1);
        run_kernel_case(&optim_cases[k], WEFT_F32, 1);
    }
}

Test(optim, kernels_match_torch_dense_wide)
{
    /* 17 * 12 = 204 elements: three full blocks of 64 and a tail */
    for (size_t k = 0; k < N_CASES; k++) {
        run_kernel_case(&optim_cases[k], WEFT_F64, 17);
        run_kernel_case(&optim_cases[k], WEFT_F32, 17);
    }
}

/* ---- kernels, sparse ------------------------------------------------------------------------- */

/* Runs one sparse case on a [V, D * widen] table whose column j repeats the table's j % D. */
static void run_sparse_kernel_case(const sparse_case_t *s, weft_dtype_t dt, int64_t widen)
{
    int64_t d = SPARSE_D * widen;
    weft_tensor_t *param = tensor(dt, SPARSE_V, d);
    weft_tensor_t *sum = tensor(dt, SPARSE_V, d);
    weft_tensor_t *rows = tensor(dt, SPARSE_NNZ, d);
    optim_case_t c = sparse_as_dense(s);
    weft_optim_sgd_config_t sgd = sgd_config(&c);
    weft_optim_adagrad_config_t adagrad = adagrad_config(&c);

    for (int64_t r = 0; r < SPARSE_V; r++) {
        for (int64_t j = 0; j < d; j++) {
            set(param, r * d + j, sparse_init[r * SPARSE_D + j % SPARSE_D]);
        }
    }
    cr_assert_eq(weft_tensor_fill(sum, c.initial_accumulator_value), WEFT_OK);
    for (int step = 0; step < OPTIM_STEPS; step++) {
        weft_tensor_t *idx = tensor_i64(SPARSE_NNZ, sparse_indices[step]);
        weft_status_t st;

        for (int64_t k = 0; k < SPARSE_NNZ; k++) {
            for (int64_t j = 0; j < d; j++) {
                set(rows, k * d + j, sparse_rows[step][k * SPARSE_D + j % SPARSE_D]);
            }
        }
        if (c.kind == OPTIM_SGD) {
            st = weft_optim_sgd_sparse_step(&sgd, param, idx, rows);
        } else {
            st = weft_optim_adagrad_sparse_step(&adagrad, param, idx, rows, sum, step + 1);
        }
        cr_assert_eq(st, WEFT_OK, "%s: %s", c.name, weft_last_error());
        for (int64_t r = 0; r < SPARSE_V; r++) {
            for (int64_t j = 0; j < d; j++) {
                double want = (dt == WEFT_F32 ? s->f32 : s->f64)[step][r * SPARSE_D + j % SPARSE_D];
                double got = get(param, r * d + j);
                double rtol = dt == WEFT_F32 ? F32_RTOL : F64_RTOL;
                cr_assert(fabs(got - want) <= rtol * fmax(fabs(want), 1.0),
                          "%s %s step %d [%lld, %lld]: got %.17g, torch %.17g", c.name,
                          weft_dtype_name(dt), step + 1, (long long)r, (long long)j, got, want);
            }
        }
        weft_tensor_release(idx);
    }
    weft_tensor_release(param);
    weft_tensor_release(sum);
    weft_tensor_release(rows);
}

Test(optim, kernels_match_torch_sparse)
{
    for (size_t k = 0; k < N_SPARSE_CASES; k++) {
        run_sparse_kernel_case(&sparse_cases[k], WEFT_F64, 1);
        run_sparse_kernel_case(&sparse_cases[k], WEFT_F32, 1);
        run_sparse_kernel_case(&sparse_cases[k], WEFT_F64, 23); /* rows of 69: a full block */
        run_sparse_kernel_case(&sparse_cases[k], WEFT_F32, 23);
    }
}

Test(optim, sparse_untouched_rows_and_empty_gradient)
{
    weft_tensor_t *param = tensor(WEFT_F32, 4, 2);
    weft_tensor_t *sum = tensor(WEFT_F32, 4, 2);
    weft_tensor_t *rows = tensor(WEFT_F32, 2, 2);
    weft_tensor_t *none = tensor(WEFT_F32, 0, 2);
    int64_t zero = 0;
    weft_tensor_t *empty = NULL;
    weft_tensor_t *idx = tensor_i64(2, (const int64_t[]){2, 2});
    weft_optim_sgd_config_t sgd = {.lr = 0.5};
    weft_optim_adagrad_config_t adagrad = weft_optim_adagrad_defaults();

    cr_assert_eq(weft_tensor_create(WEFT_I64, 1, &zero, &empty), WEFT_OK);
    weft_tensor_fill(param, 1.0);
    weft_tensor_fill(rows, 1.0);
    cr_assert_eq(weft_optim_sgd_sparse_step(&sgd, param, idx, rows), WEFT_OK);
    for (int64_t i = 0; i < 8; i++) {
        /* row 2 gets both rows: 1 - 0.5 * (1 + 1) */
        cr_assert_eq(get(param, i), i / 2 == 2 ? 0.0 : 1.0, "element %lld", (long long)i);
    }
    cr_assert_eq(weft_optim_sgd_sparse_step(&sgd, param, empty, none), WEFT_OK);
    cr_assert_eq(weft_optim_adagrad_sparse_step(&adagrad, param, empty, none, sum, 1), WEFT_OK);
    for (int64_t i = 0; i < 8; i++) {
        cr_assert_eq(get(param, i), i / 2 == 2 ? 0.0 : 1.0);
        cr_assert_eq(get(sum, i), 0.0);
    }
    weft_tensor_release(param);
    weft_tensor_release(sum);
    weft_tensor_release(rows);
    weft_tensor_release(none);
    weft_tensor_release(empty);
    weft_tensor_release(idx);
}

/* ---- kernels, errors ------------------------------------------------------------------------- */

static void expect_error(weft_status_t st, weft_status_t want, const char *needle)
{
    cr_assert_eq(st, want, "got %s, want %s (%s)", weft_status_name(st), weft_status_name(want),
                 weft_last_error());
    if (needle != NULL) {
        cr_assert(strstr(weft_last_error(), needle) != NULL, "'%s' does not name '%s'",
                  weft_last_error(), needle);
    }
}

Test(optim, bad_hyperparameters)
{
    weft_tensor_t *p = tensor(WEFT_F32, 3, 4);
    weft_tensor_t *g = tensor(WEFT_F32, 3, 4);
    weft_tensor_t *s1 = tensor(WEFT_F32, 3, 4);
    weft_tensor_t *s2 = tensor(WEFT_F32, 3, 4);
    weft_optim_sgd_config_t sgd;
    weft_optim_adagrad_config_t ada;
    weft_optim_adam_config_t adam;

    weft_tensor_fill(p, 1.0);
    weft_tensor_fill(g, 1.0);

    sgd = weft_optim_sgd_defaults();
    sgd.lr = -0.1;
    expect_error(weft_optim_sgd_step(&sgd, p, g, NULL, 1), WEFT_ERR_INVALID_ARG, "lr -0.1");
    expect_error(weft_optim_sgd_config_check(&sgd), WEFT_ERR_INVALID_ARG, "lr");
    sgd.lr = NAN;
    expect_error(weft_optim_sgd_step(&sgd, p, g, NULL, 1), WEFT_ERR_INVALID_ARG, "lr");
    sgd = weft_optim_sgd_defaults();
    sgd.momentum = -0.5;
    expect_error(weft_optim_sgd_step(&sgd, p, g, s1, 1), WEFT_ERR_INVALID_ARG, "momentum -0.5");
    sgd = weft_optim_sgd_defaults();
    sgd.weight_decay = -1;
    expect_error(weft_optim_sgd_step(&sgd, p, g, NULL, 1), WEFT_ERR_INVALID_ARG, "weight_decay");
    sgd = weft_optim_sgd_defaults();
    sgd.nesterov = 1;
    expect_error(weft_optim_sgd_step(&sgd, p, g, NULL, 1), WEFT_ERR_INVALID_ARG, "nesterov");
    sgd.momentum = 0.9;
    sgd.dampening = 0.1;
    expect_error(weft_optim_sgd_step(&sgd, p, g, s1, 1), WEFT_ERR_INVALID_ARG, "dampening 0.1");
    expect_error(weft_optim_sgd_config_check(NULL), WEFT_ERR_INVALID_ARG, NULL);

    ada = weft_optim_adagrad_defaults();
    ada.lr_decay = -1;
    expect_error(weft_optim_adagrad_step(&ada, p, g, s1, 1), WEFT_ERR_INVALID_ARG, "lr_decay");
    ada = weft_optim_adagrad_defaults();
    ada.eps = -1e-10;
    expect_error(weft_optim_adagrad_step(&ada, p, g, s1, 1), WEFT_ERR_INVALID_ARG, "eps");
    ada = weft_optim_adagrad_defaults();
    ada.initial_accumulator_value = -1;
    expect_error(weft_optim_adagrad_config_check(&ada), WEFT_ERR_INVALID_ARG,
                 "initial_accumulator_value");

    adam = weft_optim_adam_defaults();
    adam.beta1 = 1.0;
    expect_error(weft_optim_adam_step(&adam, p, g, s1, s2, NULL, 1), WEFT_ERR_INVALID_ARG,
                 "beta1 1");
    adam = weft_optim_adam_defaults();
    adam.beta2 = -0.1;
    expect_error(weft_optim_adam_step(&adam, p, g, s1, s2, NULL, 1), WEFT_ERR_INVALID_ARG,
                 "beta2 -0.1");
    adam = weft_optim_adamw_defaults();
    adam.eps = -1;
    expect_error(weft_optim_adamw_step(&adam, p, g, s1, s2, NULL, 1), WEFT_ERR_INVALID_ARG, "eps");
    adam = weft_optim_adamw_defaults();
    adam.lr = -1;
    expect_error(weft_optim_adam_config_check(&adam), WEFT_ERR_INVALID_ARG, "lr");
    adam = weft_optim_adam_defaults();
    adam.weight_decay = -0.01;
    expect_error(weft_optim_adam_step(&adam, p, g, s1, s2, NULL, 1), WEFT_ERR_INVALID_ARG,
                 "weight_decay");

    /* nothing was written */
    for (int64_t i = 0; i < 12; i++) {
        cr_assert_eq(get(p, i), 1.0);
        cr_assert_eq(get(s1, i), 0.0);
    }
    weft_tensor_release(p);
    weft_tensor_release(g);
    weft_tensor_release(s1);
    weft_tensor_release(s2);
}

Test(optim, defaults_are_torchs)
{
    weft_optim_sgd_config_t sgd = WEFT_OPTIM_SGD_DEFAULTS;
    weft_optim_adagrad_config_t ada = weft_optim_adagrad_defaults();
    weft_optim_adam_config_t adam = weft_optim_adam_defaults();
    weft_optim_adam_config_t adamw = WEFT_OPTIM_ADAMW_DEFAULTS;

    cr_assert_eq(sgd.momentum, 0.0);
    cr_assert_eq(sgd.nesterov, 0);
    cr_assert_eq(ada.lr, 1e-2);
    cr_assert_eq(ada.eps, 1e-10);
    cr_assert_eq(adam.lr, 1e-3);
    cr_assert_eq(adam.beta1, 0.9);
    cr_assert_eq(adam.beta2, 0.999);
    cr_assert_eq(adam.eps, 1e-8);
    cr_assert_eq(adam.weight_decay, 0.0);
    cr_assert_eq(adamw.weight_decay, 1e-2);
    cr_assert_eq(weft_optim_sgd_config_check(&sgd), WEFT_OK);
    cr_assert_eq(weft_optim_adagrad_config_check(&ada), WEFT_OK);
    cr_assert_eq(weft_optim_adam_config_check(&adam), WEFT_OK);
    cr_assert_eq(weft_optim_adam_config_check(&adamw), WEFT_OK);
}

Test(optim, mismatched_tensors)
{
    weft_tensor_t *p = tensor(WEFT_F32, 3, 4);
    weft_tensor_t *g = tensor(WEFT_F32, 3, 4);
    weft_tensor_t *gt = tensor(WEFT_F32, 4, 3);
    weft_tensor_t *g64 = tensor(WEFT_F64, 3, 4);
    weft_tensor_t *s1 = tensor(WEFT_F32, 3, 4);
    weft_tensor_t *s2 = tensor(WEFT_F32, 3, 4);
    weft_tensor_t *s12 = tensor(WEFT_F32, 12, 1);
    weft_tensor_t *pi = NULL;
    weft_tensor_t *view = NULL;
    int64_t shape[2] = {3, 4};
    weft_optim_sgd_config_t sgd = {.lr = 0.1, .momentum = 0.9};
    weft_optim_adagrad_config_t ada = weft_optim_adagrad_defaults();
    weft_optim_adam_config_t adam = weft_optim_adam_defaults();

    cr_assert_eq(weft_tensor_create(WEFT_I32, 2, shape, &pi), WEFT_OK);
    cr_assert_eq(weft_tensor_view(g, 2, shape, &view), WEFT_OK);
    weft_tensor_fill(p, 1.0);

    expect_error(weft_optim_sgd_step(&sgd, p, gt, s1, 1), WEFT_ERR_SHAPE, "grad has shape [4, 3]");
    expect_error(weft_optim_sgd_step(&sgd, p, g64, s1, 1), WEFT_ERR_DTYPE, "grad is f64");
    expect_error(weft_optim_sgd_step(&sgd, p, g, s12, 1), WEFT_ERR_SHAPE, "momentum_buf");
    expect_error(weft_optim_sgd_step(&sgd, p, g, NULL, 1), WEFT_ERR_INVALID_ARG, "momentum_buf");
    expect_error(weft_optim_sgd_step(&sgd, pi, pi, NULL, 1), WEFT_ERR_DTYPE, "i32");
    expect_error(weft_optim_sgd_step(&sgd, p, NULL, s1, 1), WEFT_ERR_INVALID_ARG, "grad");
    expect_error(weft_optim_sgd_step(&sgd, NULL, g, s1, 1), WEFT_ERR_INVALID_ARG, "param");
    expect_error(weft_optim_sgd_step(&sgd, p, g, s1, 0), WEFT_ERR_INVALID_ARG, "step 0");
    expect_error(weft_optim_sgd_step(&sgd, p, p, s1, 1), WEFT_ERR_INVALID_ARG, "share storage");
    expect_error(weft_optim_adagrad_step(&ada, p, g, s12, 1), WEFT_ERR_SHAPE, "sum");
    expect_error(weft_optim_adagrad_step(&ada, p, g, g, 1), WEFT_ERR_INVALID_ARG, "share");
    expect_error(weft_optim_adam_step(&adam, p, g, s1, gt, NULL, 1), WEFT_ERR_SHAPE, "exp_avg_sq");
    expect_error(weft_optim_adam_step(&adam, p, g, s1, NULL, NULL, 1), WEFT_ERR_INVALID_ARG,
                 "exp_avg_sq");
    expect_error(weft_optim_adam_step(&adam, p, g, s1, s1, NULL, 1), WEFT_ERR_INVALID_ARG, "share");
    adam.amsgrad = 1;
    expect_error(weft_optim_adam_step(&adam, p, g, s1, s2, NULL, 1), WEFT_ERR_INVALID_ARG,
                 "max_exp_avg_sq");
    expect_error(weft_optim_adamw_step(&adam, p, g, s1, s2, g64, 1), WEFT_ERR_DTYPE,
                 "max_exp_avg_sq is f64");
    /* a view of grad's storage as the state */
    expect_error(weft_optim_sgd_step(&sgd, p, g, view, 2), WEFT_ERR_INVALID_ARG,
                 "grad and momentum_buf share storage");

    for (int64_t i = 0; i < 12; i++) {
        cr_assert_eq(get(p, i), 1.0);
    }
    weft_tensor_release(p);
    weft_tensor_release(g);
    weft_tensor_release(gt);
    weft_tensor_release(g64);
    weft_tensor_release(s1);
    weft_tensor_release(s2);
    weft_tensor_release(s12);
    weft_tensor_release(pi);
    weft_tensor_release(view);
}

Test(optim, sparse_errors)
{
    weft_tensor_t *p = tensor(WEFT_F64, 5, 2);
    weft_tensor_t *sum = tensor(WEFT_F64, 5, 2);
    weft_tensor_t *rows = tensor(WEFT_F64, 3, 2);
    weft_tensor_t *rows_wide = tensor(WEFT_F64, 3, 3);
    weft_tensor_t *rows32 = tensor(WEFT_F32, 3, 2);
    weft_tensor_t *idx = tensor_i64(3, (const int64_t[]){0, 4, 1});
    weft_tensor_t *bad = tensor_i64(3, (const int64_t[]){0, 5, 1});
    weft_tensor_t *neg = tensor_i64(3, (const int64_t[]){0, 1, -1});
    weft_tensor_t *idx32 = NULL;
    int64_t three = 3;
    weft_optim_sgd_config_t sgd = {.lr = 0.1};
    weft_optim_adagrad_config_t ada = weft_optim_adagrad_defaults();

    cr_assert_eq(weft_tensor_create(WEFT_I32, 1, &three, &idx32), WEFT_OK);
    weft_tensor_fill(p, 1.0);
    weft_tensor_fill(rows, 1.0);

    expect_error(weft_optim_sgd_sparse_step(&sgd, p, bad, rows), WEFT_ERR_INVALID_ARG,
                 "index 5 at position 1");
    expect_error(weft_optim_adagrad_sparse_step(&ada, p, neg, rows, sum, 1), WEFT_ERR_INVALID_ARG,
                 "index -1");
    expect_error(weft_optim_sgd_sparse_step(&sgd, p, idx32, rows), WEFT_ERR_DTYPE, "i64");
    expect_error(weft_optim_sgd_sparse_step(&sgd, p, idx, rows_wide), WEFT_ERR_SHAPE, "rows");
    expect_error(weft_optim_sgd_sparse_step(&sgd, p, idx, rows32), WEFT_ERR_DTYPE, "rows");
    expect_error(weft_optim_adagrad_sparse_step(&ada, p, idx, rows, NULL, 1), WEFT_ERR_INVALID_ARG,
                 "sum");
    sgd.momentum = 0.9;
    expect_error(weft_optim_sgd_sparse_step(&sgd, p, idx, rows), WEFT_ERR_UNSUPPORTED, "momentum");
    sgd.momentum = 0;
    sgd.weight_decay = 0.1;
    expect_error(weft_optim_sgd_sparse_step(&sgd, p, idx, rows), WEFT_ERR_UNSUPPORTED,
                 "weight_decay");
    ada.weight_decay = 0.1;
    expect_error(weft_optim_adagrad_sparse_step(&ada, p, idx, rows, sum, 1), WEFT_ERR_UNSUPPORTED,
                 "weight_decay");
    for (int64_t i = 0; i < 10; i++) {
        cr_assert_eq(get(p, i), 1.0);
        cr_assert_eq(get(sum, i), 0.0);
    }
    weft_tensor_release(p);
    weft_tensor_release(sum);
    weft_tensor_release(rows);
    weft_tensor_release(rows_wide);
    weft_tensor_release(rows32);
    weft_tensor_release(idx);
    weft_tensor_release(bad);
    weft_tensor_release(neg);
    weft_tensor_release(idx32);
}

/* ---- optimizer objects ----------------------------------------------------------------------- */

static weft_optimizer_t *make_optimizer(const optim_case_t *c, const weft_param_list_t *ps)
{
    weft_optim_sgd_config_t sgd = sgd_config(c);
    weft_optim_adagrad_config_t adagrad = adagrad_config(c);
    weft_optim_adam_config_t adam = adam_config(c);
    weft_optimizer_t *opt = NULL;
    weft_status_t st = WEFT_ERR_INVALID_STATE;

    switch (c->kind) {
    case OPTIM_SGD:
        st = weft_optimizer_sgd_create(ps, &sgd, &opt);
        break;
    case OPTIM_ADAGRAD:
        st = weft_optimizer_adagrad_create(ps, &adagrad, &opt);
        break;
    case OPTIM_ADAM:
        st = weft_optimizer_adam_create(ps, &adam, &opt);
        break;
    case OPTIM_ADAMW:
        st = weft_optimizer_adamw_create(ps, &adam, &opt);
        break;
    }
    cr_assert_eq(st, WEFT_OK, "%s: %s", c->name, weft_last_error());
    return opt;
}

/* A leaf parameter [rows, cols] that requires gradients, from @p values (cyclic). */
static weft_tensor_t *param_from(weft_dtype_t dt, int64_t rows, int64_t cols, const double *values,
                                 int64_t n)
{
    weft_tensor_t *p = tensor(dt, rows, cols);

    fill_cyclic(p, values, n);
    cr_assert_eq(weft_tensor_set_requires_grad(p, 1), WEFT_OK);
    return p;
}

/* One case through an optimizer object: dense gradients set on the parameter each step; a
 * second parameter never has a gradient and must not move. */
static void run_object_case(const optim_case_t *c, weft_dtype_t dt)
{
    weft_tensor_t *p = param_from(dt, OPTIM_ROWS, OPTIM_COLS, optim_init, OPTIM_NUMEL);
    weft_tensor_t *idle = param_from(dt, 2, 2, optim_init, OPTIM_NUMEL);
    weft_tensor_t *idle0 = NULL;
    weft_param_list_t *ps = NULL;
    weft_optimizer_t *opt;

    cr_assert_eq(weft_tensor_clone(idle, &idle0), WEFT_OK);
    cr_assert_eq(weft_param_list_create(&ps), WEFT_OK);
    cr_assert_eq(weft_param_list_add(ps, "p", p), WEFT_OK);
    cr_assert_eq(weft_param_list_add(ps, "idle", idle), WEFT_OK);
    opt = make_optimizer(c, ps);
    for (int step = 0; step < OPTIM_STEPS; step++) {
        weft_tensor_t *g = tensor(dt, OPTIM_ROWS, OPTIM_COLS);

        fill_cyclic(g, optim_grads[step], OPTIM_NUMEL);
        cr_assert_eq(weft_tensor_set_grad(p, g), WEFT_OK);
        weft_tensor_release(g);
        cr_assert_eq(weft_optimizer_step(opt), WEFT_OK, "%s: %s", c->name, weft_last_error());
        expect_cyclic(c->name, dt, step, p, dt == WEFT_F32 ? c->f32[step] : c->f64[step],
                      OPTIM_NUMEL);
        weft_optimizer_zero_grad(opt);
        cr_assert_null(weft_tensor_grad(p));
    }
    cr_assert_eq(weft_optimizer_param_steps(opt, 0), OPTIM_STEPS);
    cr_assert_eq(weft_optimizer_param_steps(opt, 1), 0);
    cr_assert(weft_tensor_equal(idle, idle0), "%s: a parameter without gradient moved", c->name);
    weft_optimizer_free(opt);
    weft_param_list_free(ps);
    weft_tensor_release(p);
    weft_tensor_release(idle);
    weft_tensor_release(idle0);
}

Test(optim, objects_match_torch_dense)
{
    for (size_t k = 0; k < N_CASES; k++) {
        run_object_case(&optim_cases[k], WEFT_F64);
        run_object_case(&optim_cases[k], WEFT_F32);
    }
}

/* One sparse case through an optimizer object, the gradients coming from backward through a
 * sparse embedding lookup (weft_tensor_sparse_grad). */
static void run_sparse_object_case(const sparse_case_t *s, weft_dtype_t dt)
{
    optim_case_t c = sparse_as_dense(s);
    weft_tensor_t *p = param_from(dt, SPARSE_V, SPARSE_D, sparse_init, SPARSE_V * SPARSE_D);
    weft_param_list_t *ps = NULL;
    weft_optimizer_t *opt;

    cr_assert_eq(weft_param_list_create(&ps), WEFT_OK);
    cr_assert_eq(weft_param_list_add(ps, "emb.weight", p), WEFT_OK);
    opt = make_optimizer(&c, ps);
    for (int step = 0; step < OPTIM_STEPS; step++) {
        weft_tensor_t *idx = tensor_i64(SPARSE_NNZ, sparse_indices[step]);
        weft_tensor_t *rows = tensor(dt, SPARSE_NNZ, SPARSE_D);
        weft_tensor_t *out = NULL;

        fill_cyclic(rows, sparse_rows[step], SPARSE_NNZ * SPARSE_D);
        cr_assert_eq(weft_op_embedding(p, idx, 1, &out), WEFT_OK, "%s", weft_last_error());
        cr_assert_eq(weft_backward(out, rows, 0), WEFT_OK, "%s", weft_last_error());
        cr_assert_null(weft_tensor_grad(p));
        cr_assert_eq(weft_tensor_sparse_grad(p, NULL, NULL), WEFT_OK);
        cr_assert_eq(weft_optimizer_step(opt), WEFT_OK, "%s: %s", c.name, weft_last_error());
        expect_cyclic(c.name, dt, step, p, dt == WEFT_F32 ? s->f32[step] : s->f64[step],
                      SPARSE_V * SPARSE_D);
        weft_optimizer_zero_grad(opt);
        weft_tensor_release(out);
        weft_tensor_release(rows);
        weft_tensor_release(idx);
    }
    cr_assert_eq(weft_optimizer_param_steps(opt, 0), OPTIM_STEPS);
    weft_optimizer_free(opt);
    weft_param_list_free(ps);
    weft_tensor_release(p);
}

Test(optim, objects_match_torch_sparse)
{
    for (size_t k = 0; k < N_SPARSE_CASES; k++) {
        run_sparse_object_case(&sparse_cases[k], WEFT_F64);
        run_sparse_object_case(&sparse_cases[k], WEFT_F32);
    }
}

Test(optim, objects_refuse_sparse_gradients_they_cannot_take)
{
    weft_tensor_t *p = param_from(WEFT_F32, SPARSE_V, SPARSE_D, sparse_init, SPARSE_V * SPARSE_D);
    weft_tensor_t *q = param_from(WEFT_F32, 2, 2, optim_init, OPTIM_NUMEL);
    weft_tensor_t *p0 = NULL;
    weft_tensor_t *q0 = NULL;
    weft_tensor_t *qg = tensor(WEFT_F32, 2, 2);
    weft_tensor_t *idx = tensor_i64(SPARSE_NNZ, sparse_indices[0]);
    weft_tensor_t *rows = tensor(WEFT_F32, SPARSE_NNZ, SPARSE_D);
    weft_tensor_t *out = NULL;
    weft_param_list_t *ps = NULL;
    weft_optimizer_t *opts[4] = {NULL};
    weft_optim_adam_config_t adam = WEFT_OPTIM_ADAM_DEFAULTS;
    weft_optim_adam_config_t adamw = WEFT_OPTIM_ADAMW_DEFAULTS;
    weft_optim_sgd_config_t sgd = {.lr = 0.1, .weight_decay = 0.01};
    weft_optim_adagrad_config_t adagrad = {.lr = 0.1, .weight_decay = 0.01, .eps = 1e-10};

    cr_assert_eq(weft_tensor_clone(p, &p0), WEFT_OK);
    cr_assert_eq(weft_tensor_clone(q, &q0), WEFT_OK);
    cr_assert_eq(weft_param_list_create(&ps), WEFT_OK);
    /* q, with a dense gradient, comes first: it must not move either */
    cr_assert_eq(weft_param_list_add(ps, "q", q), WEFT_OK);
    cr_assert_eq(weft_param_list_add(ps, "emb.weight", p), WEFT_OK);
    cr_assert_eq(weft_optimizer_adam_create(ps, &adam, &opts[0]), WEFT_OK);
    cr_assert_eq(weft_optimizer_adamw_create(ps, &adamw, &opts[1]), WEFT_OK);
    cr_assert_eq(weft_optimizer_sgd_create(ps, &sgd, &opts[2]), WEFT_OK);
    cr_assert_eq(weft_optimizer_adagrad_create(ps, &adagrad, &opts[3]), WEFT_OK);

    fill_cyclic(rows, sparse_rows[0], SPARSE_NNZ * SPARSE_D);
    weft_tensor_fill(qg, 1.0);
    cr_assert_eq(weft_tensor_set_grad(q, qg), WEFT_OK);
    cr_assert_eq(weft_op_embedding(p, idx, 1, &out), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(weft_backward(out, rows, 0), WEFT_OK, "%s", weft_last_error());
    for (int k = 0; k < 4; k++) {
        weft_status_t st = weft_optimizer_step(opts[k]);
        cr_assert_eq(st, WEFT_ERR_UNSUPPORTED, "optimizer %d: %s", k, weft_status_name(st));
        cr_assert(strstr(weft_last_error(), "emb.weight") != NULL, "%s", weft_last_error());
        cr_assert_eq(weft_optimizer_param_steps(opts[k], 0), 0);
    }
    cr_assert(weft_tensor_equal(p, p0));
    cr_assert(weft_tensor_equal(q, q0));
    for (int k = 0; k < 4; k++) {
        weft_optimizer_free(opts[k]);
    }
    weft_param_list_free(ps);
    weft_tensor_release(out);
    weft_tensor_release(rows);
    weft_tensor_release(idx);
    weft_tensor_release(qg);
    weft_tensor_release(p);
    weft_tensor_release(q);
    weft_tensor_release(p0);
    weft_tensor_release(q0);
}

Test(optim, objects_bad_hyperparameters)
{
    weft_param_list_t *ps = NULL;
    weft_optimizer_t *opt = NULL;
    weft_optim_sgd_config_t sgd = {.lr = -0.5};
    weft_optim_adagrad_config_t adagrad = {.lr = 0.1, .lr_decay = -0.1};
    weft_optim_adam_config_t adam = WEFT_OPTIM_ADAM_DEFAULTS;
    weft_tensor_t *pi = NULL;
    int64_t two = 2;

    cr_assert_eq(weft_param_list_create(&ps), WEFT_OK);
    expect_error(weft_optimizer_sgd_create(ps, &sgd, &opt), WEFT_ERR_INVALID_ARG, "lr -0.5");
    sgd.lr = 0.1;
    sgd.nesterov = 1;
    expect_error(weft_optimizer_sgd_create(ps, &sgd, &opt), WEFT_ERR_INVALID_ARG, "nesterov");
    expect_error(weft_optimizer_adagrad_create(ps, &adagrad, &opt), WEFT_ERR_INVALID_ARG,
                 "lr_decay");
    adam.beta2 = 1.0;
    expect_error(weft_optimizer_adam_create(ps, &adam, &opt), WEFT_ERR_INVALID_ARG, "beta2");
    expect_error(weft_optimizer_adamw_create(ps, NULL, &opt), WEFT_ERR_INVALID_ARG, NULL);
    cr_assert_null(opt);

    /* an i64 "parameter" */
    cr_assert_eq(weft_tensor_create(WEFT_I64, 1, &two, &pi), WEFT_OK);
    cr_assert_eq(weft_param_list_add(ps, "ints", pi), WEFT_OK);
    sgd.nesterov = 0;
    expect_error(weft_optimizer_sgd_create(ps, &sgd, &opt), WEFT_ERR_DTYPE, "ints");
    weft_tensor_release(pi);
    weft_param_list_free(ps);
}

Test(optim, a_failing_step_changes_nothing)
{
    int64_t n = 3;
    weft_tensor_t *a = NULL;
    weft_tensor_t *b = NULL;
    weft_tensor_t *ga = NULL;
    weft_tensor_t *gb = NULL;
    weft_param_list_t *list = NULL;
    weft_optimizer_t *opt = NULL;
    weft_optim_sgd_config_t cfg = weft_optim_sgd_defaults();

    cfg.lr = 1.0;
    cr_assert_eq(weft_tensor_create(WEFT_F32, 1, &n, &a), WEFT_OK);
    cr_assert_eq(weft_tensor_create(WEFT_F32, 1, &n, &b), WEFT_OK);
    cr_assert_eq(weft_tensor_set_requires_grad(a, 1), WEFT_OK);
    cr_assert_eq(weft_tensor_set_requires_grad(b, 1), WEFT_OK);
    cr_assert_eq(weft_tensor_create(WEFT_F32, 1, &n, &ga), WEFT_OK);
    ((float *)weft_tensor_data(ga))[0] = 1.0f;
    cr_assert_eq(weft_tensor_set_grad(a, ga), WEFT_OK);
    /* b's gradient shares b's storage: the SGD kernel refuses it. */
    cr_assert_eq(weft_tensor_view(b, 1, &n, &gb), WEFT_OK);
    cr_assert_eq(weft_tensor_set_grad(b, gb), WEFT_OK);
    cr_assert_eq(weft_param_list_create(&list), WEFT_OK);
    cr_assert_eq(weft_param_list_add(list, "a", a), WEFT_OK);
    cr_assert_eq(weft_param_list_add(list, "b", b), WEFT_OK);
    cr_assert_eq(weft_optimizer_sgd_create(list, &cfg, &opt), WEFT_OK);
    cr_assert_eq(weft_optimizer_step(opt), WEFT_ERR_INVALID_ARG);
    cr_assert(strstr(weft_last_error(), "'b'") != NULL, "%s", weft_last_error());
    cr_assert_eq(((float *)weft_tensor_data(a))[0], 0.0f, "a was updated by a failing step");
    weft_optimizer_free(opt);
    weft_param_list_free(list);
    weft_tensor_release(ga);
    weft_tensor_release(gb);
    weft_tensor_release(a);
    weft_tensor_release(b);
}
