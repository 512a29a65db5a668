/*
 * nn modules and parameter lists: shapes and parameter names, torch's initialisation (bounds,
 * statistics, reproducibility from a seed), EmbeddingBag against hand-computed bags, an MLP that
 * learns XOR with SGD and with Adam, sparse embedding gradients through the optimizers,
 * zero_grad, and packing parameters and gradients into one flat tensor.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <weft/weft.h>

TestSuite(nn, .timeout = 120);

/* ---- helpers --------------------------------------------------------------------------------- */

static weft_tensor_t *tensor_from(weft_dtype_t dt, int ndim, const int64_t *shape,
                                  const double *values)
{
    weft_tensor_t *t = NULL;

    cr_assert_eq(weft_tensor_create(dt, ndim, shape, &t), WEFT_OK);
    for (int64_t i = 0, n = weft_tensor_numel(t); values != NULL && i < n; i++) {
        if (dt == WEFT_F32) {
            ((float *)weft_tensor_data(t))[i] = (float)values[i];
        } else if (dt == WEFT_F64) {
            ((double *)weft_tensor_data(t))[i] = values[i];
        } else {
            ((int64_t *)weft_tensor_data(t))[i] = (int64_t)values[i];
        }
    }
    return t;
}

static double get(const weft_tensor_t *t, int64_t i)
{
    if (weft_tensor_dtype(t) == WEFT_F32) {
        return ((const float *)weft_tensor_data(t))[i];
    }
    return ((const double *)weft_tensor_data(t))[i];
}

static void expect_shape(const weft_tensor_t *t, int ndim, const int64_t *shape)
{
    cr_assert_not_null(t);
    cr_assert_eq(weft_tensor_ndim(t), ndim);
    for (int d = 0; d < ndim; d++) {
        cr_assert_eq(weft_tensor_shape(t)[d], shape[d], "dim %d: %lld, want %lld", d,
                     (long long)weft_tensor_shape(t)[d], (long long)shape[d]);
    }
}

/* ---- shapes and names ------------------------------------------------------------------------ */

Test(nn, linear_shapes_and_names)
{
    weft_rng_t rng;
    weft_nn_linear_t *lin = NULL;
    weft_nn_linear_t *nob = NULL;
    const weft_param_list_t *ps;
    weft_tensor_t *x = tensor_from(WEFT_F32, 2, (const int64_t[]){5, 4}, NULL);
    weft_tensor_t *y = NULL;

    weft_rng_init(&rng, 1, 0);
    cr_assert_eq(weft_nn_linear_create(4, 3, 1, WEFT_F32, &rng, &lin), WEFT_OK);
    expect_shape(weft_nn_linear_weight(lin), 2, (const int64_t[]){3, 4});
    expect_shape(weft_nn_linear_bias(lin), 1, (const int64_t[]){3});
    ps = weft_nn_linear_params(lin);
    cr_assert_eq(weft_param_list_size(ps), 2);
    cr_assert_str_eq(weft_param_list_name(ps, 0), "weight");
    cr_assert_str_eq(weft_param_list_name(ps, 1), "bias");
    cr_assert_eq(weft_param_list_get(ps, 0), weft_nn_linear_weight(lin));
    cr_assert_eq(weft_param_list_find(ps, "bias"), weft_nn_linear_bias(lin));
    cr_assert_null(weft_param_list_get(ps, 2));
    cr_assert_eq(weft_param_list_numel(ps), 15);
    for (int i = 0; i < 2; i++) {
        cr_assert(weft_tensor_requires_grad(weft_param_list_get(ps, i)));
        cr_assert(weft_tensor_is_leaf(weft_param_list_get(ps, i)));
        cr_assert_eq(weft_tensor_dtype(weft_param_list_get(ps, i)), WEFT_F32);
    }
    cr_assert_eq(weft_nn_linear_forward(lin, x, &y), WEFT_OK, "%s", weft_last_error());
    expect_shape(y, 2, (const int64_t[]){5, 3});
    cr_assert(weft_tensor_requires_grad(y));
    weft_tensor_release(y);

    cr_assert_eq(weft_nn_linear_create(4, 3, 0, WEFT_F64, &rng, &nob), WEFT_OK);
    cr_assert_null(weft_nn_linear_bias(nob));
    cr_assert_eq(weft_param_list_size(weft_nn_linear_params(nob)), 1);

    cr_assert_eq(weft_nn_linear_create(-1, 3, 1, WEFT_F32, &rng, &lin), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(weft_nn_linear_create(4, 3, 1, WEFT_I32, &rng, &lin), WEFT_ERR_DTYPE);
    cr_assert_eq(weft_nn_linear_create(4, 3, 1, WEFT_F32, NULL, &lin), WEFT_ERR_INVALID_ARG);

    weft_nn_linear_free(lin);
    weft_nn_linear_free(nob);
    weft_tensor_release(x);
}

Test(nn, mlp_shapes_and_names)
{
    static const char *const names[] = {"fc1.weight", "fc1.bias",   "fc2.weight",
                                        "fc2.bias",   "fc3.weight", "fc3.bias"};
    static const int64_t shapes[][2] = {{256, 784}, {256, 0}, {64, 256},
                                        {64, 0},    {10, 64}, {10, 0}};
    weft_rng_t rng;
    weft_nn_mlp_t *mlp = NULL;
    const weft_param_list_t *ps;
    weft_tensor_t *x = tensor_from(WEFT_F32, 2, (const int64_t[]){3, 784}, NULL);
    weft_tensor_t *y = NULL;

    weft_rng_init(&rng, 2, 0);
    cr_assert_eq(weft_nn_mlp_create(4, (const int64_t[]){784, 256, 64, 10}, NULL, &rng, &mlp),
                 WEFT_OK);
    cr_assert_eq(weft_nn_mlp_num_layers(mlp), 3);
    ps = weft_nn_mlp_params(mlp);
    cr_assert_eq(weft_param_list_size(ps), 6);
    for (int i = 0; i < 6; i++) {
        cr_assert_str_eq(weft_param_list_name(ps, i), names[i]);
        expect_shape(weft_param_list_get(ps, i), i % 2 == 0 ? 2 : 1, shapes[i]);
    }
    cr_assert_eq(weft_param_list_get(ps, 2), weft_nn_linear_weight(weft_nn_mlp_layer(mlp, 1)));
    cr_assert_null(weft_nn_mlp_layer(mlp, 3));
    cr_assert_eq(weft_param_list_numel(ps), 784 * 256 + 256 + 256 * 64 + 64 + 64 * 10 + 10);
    cr_assert_eq(weft_nn_mlp_forward(mlp, x, &y), WEFT_OK, "%s", weft_last_error());
    expect_shape(y, 2, (const int64_t[]){3, 10});
    weft_tensor_release(y);

    cr_assert_eq(weft_nn_mlp_create(1, (const int64_t[]){4}, NULL, &rng, &mlp),
                 WEFT_ERR_INVALID_ARG);
    cr_assert_eq(weft_nn_mlp_create(2, (const int64_t[]){4, -2}, NULL, &rng, &mlp),
                 WEFT_ERR_INVALID_ARG);
    weft_nn_mlp_free(mlp);
    weft_tensor_release(x);
}

Test(nn, mlp_activations)
{
    /* 1 -> 1 -> 1 with hand-set weights: y = out_act(w2 * act(w1 * x + b1) + b2) */
    weft_nn_mlp_config_t cfg = WEFT_NN_MLP_DEFAULTS;
    weft_rng_t rng;
    weft_nn_mlp_t *mlp = NULL;
    weft_tensor_t *x = tensor_from(WEFT_F64, 2, (const int64_t[]){2, 1}, (const double[]){1, -1});
    weft_tensor_t *y = NULL;

    weft_rng_init(&rng, 3, 0);
    cfg.dtype = WEFT_F64;
    cfg.activation = WEFT_NN_ACT_RELU;
    cfg.output_activation = WEFT_NN_ACT_TANH;
    cr_assert_eq(weft_nn_mlp_create(3, (const int64_t[]){1, 1, 1}, &cfg, &rng, &mlp), WEFT_OK);
    *(double *)weft_tensor_data(weft_nn_linear_weight(weft_nn_mlp_layer(mlp, 0))) = 2.0;
    *(double *)weft_tensor_data(weft_nn_linear_bias(weft_nn_mlp_layer(mlp, 0))) = 0.5;
    *(double *)weft_tensor_data(weft_nn_linear_weight(weft_nn_mlp_layer(mlp, 1))) = -1.0;
    *(double *)weft_tensor_data(weft_nn_linear_bias(weft_nn_mlp_layer(mlp, 1))) = 0.25;
    cr_assert_eq(weft_nn_mlp_forward(mlp, x, &y), WEFT_OK, "%s", weft_last_error());
    cr_assert_float_eq(get(y, 0), tanh(-2.5 + 0.25), 1e-12); /* relu(2.5) = 2.5 */
    cr_assert_float_eq(get(y, 1), tanh(0.25), 1e-12);        /* relu(-1.5) = 0 */
    weft_tensor_release(y);
    weft_nn_mlp_free(mlp);

    cfg.activation = (weft_nn_activation_t)42;
    cr_assert_eq(weft_nn_mlp_create(3, (const int64_t[]){1, 1, 1}, &cfg, &rng, &mlp),
                 WEFT_ERR_INVALID_ARG);
    weft_tensor_release(x);
}

/* ---- initialisation -------------------------------------------------------------------------- */

Test(nn, linear_init_bounds_and_statistics)
{
    weft_rng_t rng;
    weft_nn_linear_t *lin = NULL;
    weft_tensor_t *w;
    weft_tensor_t *b;
    double bound = 1.0 / sqrt(400.0);
    double sum = 0;
    double sq = 0;
    double lo = 1;
    double hi = -1;
    int64_t n;

    weft_rng_init(&rng, 7, 0);
    cr_assert_eq(weft_nn_linear_create(400, 300, 1, WEFT_F64, &rng, &lin), WEFT_OK);
    w = weft_nn_linear_weight(lin);
    b = weft_nn_linear_bias(lin);
    n = weft_tensor_numel(w);
    for (int64_t i = 0; i < n; i++) {
        double v = get(w, i);
        sum += v;
        sq += v * v;
        lo = fmin(lo, v);
        hi = fmax(hi, v);
    }
    /* kaiming_uniform(a = sqrt(5)): uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) */
    cr_assert(lo >= -bound && hi < bound, "weight in [%g, %g], bound %g", lo, hi, bound);
    cr_assert(lo < -0.99 * bound && hi > 0.99 * bound, "weight spans [%g, %g]", lo, hi);
    cr_assert(fabs(sum / n) < 0.01 * bound, "mean %g", sum / n);
    cr_assert(fabs(sq / n / (bound * bound / 3) - 1) < 0.02, "variance %g, want %g", sq / n,
              bound * bound / 3);
    lo = 1;
    hi = -1;
    for (int64_t i = 0; i < 300; i++) {
        lo = fmin(lo, get(b, i));
        hi = fmax(hi, get(b, i));
    }
    cr_assert(lo >= -bound && hi < bound && lo < -0.8 * bound && hi > 0.8 * bound,
              "bias in [%g, %g], bound %g", lo, hi, bound);
    weft_nn_linear_free(lin);
}

Test(nn, init_is_reproducible)
{
    weft_rng_t r1;
    weft_rng_t r2;
    weft_rng_t r3;
    weft_nn_mlp_t *a = NULL;
    weft_nn_mlp_t *b = NULL;
    weft_nn_mlp_t *c = NULL;
    const int64_t sizes[] = {10, 20, 5};

    weft_rng_init(&r1, 42, 0);
    weft_rng_init(&r2, 42, 0);
    weft_rng_init(&r3, 43, 0);
    cr_assert_eq(weft_nn_mlp_create(3, sizes, NULL, &r1, &a), WEFT_OK);
    cr_assert_eq(weft_nn_mlp_create(3, sizes, NULL, &r2, &b), WEFT_OK);
    cr_assert_eq(weft_nn_mlp_create(3, sizes, NULL, &r3, &c), WEFT_OK);
    for (int i = 0; i < 4; i++) {
        cr_assert(weft_tensor_equal(weft_param_list_get(weft_nn_mlp_params(a), i),
                                    weft_param_list_get(weft_nn_mlp_params(b), i)),
                  "parameter %d differs with the same seed", i);
        cr_assert(!weft_tensor_equal(weft_param_list_get(weft_nn_mlp_params(a), i),
                                     weft_param_list_get(weft_nn_mlp_params(c), i)),
                  "parameter %d equal with another seed", i);
    }
    /* both streams advanced alike */
    cr_assert_eq(weft_rng_next(&r1), weft_rng_next(&r2));
    weft_nn_mlp_free(a);
    weft_nn_mlp_free(b);
    weft_nn_mlp_free(c);
}

Test(nn, embedding_init_and_forward)
{
    weft_rng_t rng;
    weft_nn_embedding_t *emb = NULL;
    weft_tensor_t *w;
    weft_tensor_t *idx =
        tensor_from(WEFT_I64, 2, (const int64_t[]){2, 3}, (const double[]){0, 5, 999, 5, 5, 1});
    weft_tensor_t *y = NULL;
    double sum = 0;
    double sq = 0;
    int64_t n;

    weft_rng_init(&rng, 11, 0);
    cr_assert_eq(weft_nn_embedding_create(1000, 16, 0, WEFT_F32, &rng, &emb), WEFT_OK);
    w = weft_nn_embedding_weight(emb);
    expect_shape(w, 2, (const int64_t[]){1000, 16});
    cr_assert_str_eq(weft_param_list_name(weft_nn_embedding_params(emb), 0), "weight");
    n = weft_tensor_numel(w);
    for (int64_t i = 0; i < n; i++) {
        sum += get(w, i);
        sq += get(w, i) * get(w, i);
    }
    /* normal(0, 1): 16000 draws */
    cr_assert(fabs(sum / n) < 0.05, "mean %g", sum / n);
    cr_assert(fabs(sqrt(sq / n - (sum / n) * (sum / n)) - 1) < 0.03, "std %g",
              sqrt(sq / n - (sum / n) * (sum / n)));
    cr_assert_eq(weft_nn_embedding_forward(emb, idx, &y), WEFT_OK, "%s", weft_last_error());
    expect_shape(y, 3, (const int64_t[]){2, 3, 16});
    for (int64_t j = 0; j < 16; j++) {
        cr_assert_eq(get(y, 2 * 16 + j), get(w, 999 * 16 + j));
        cr_assert_eq(get(y, 4 * 16 + j), get(w, 5 * 16 + j));
    }
    weft_tensor_release(y);
    weft_tensor_release(idx);
    weft_nn_embedding_free(emb);
}

Test(nn, embedding_bag_forward_by_hand)
{
    /* table rows r_i = (i, 10 i + 1); bags: {0, 2}, {}, {1, 1, 3} */
    static const double table[] = {0, 1, 1, 11, 2, 21, 3, 31};
    static const double want_sum[] = {2, 22, 0, 0, 5, 53};
    static const double want_mean[] = {1, 11, 0, 0, 5.0 / 3, 53.0 / 3};
    weft_tensor_t *idx =
        tensor_from(WEFT_I64, 1, (const int64_t[]){5}, (const double[]){0, 2, 1, 1, 3});
    weft_tensor_t *off = tensor_from(WEFT_I64, 1, (const int64_t[]){3}, (const double[]){0, 2, 2});

    for (int mode = 0; mode < 2; mode++) {
        weft_rng_t rng;
        weft_nn_embedding_bag_t *bag = NULL;
        weft_tensor_t *y = NULL;
        const double *want = mode == 0 ? want_sum : want_mean;

        weft_rng_init(&rng, 5, 0);
        cr_assert_eq(weft_nn_embedding_bag_create(4, 2, mode == 0 ? WEFT_BAG_SUM : WEFT_BAG_MEAN, 0,
                                                  WEFT_F64, &rng, &bag),
                     WEFT_OK);
        memcpy(weft_tensor_data(weft_nn_embedding_bag_weight(bag)), table, sizeof table);
        cr_assert_eq(weft_nn_embedding_bag_forward(bag, idx, off, &y), WEFT_OK, "%s",
                     weft_last_error());
        expect_shape(y, 2, (const int64_t[]){3, 2});
        for (int64_t i = 0; i < 6; i++) {
            cr_assert_float_eq(get(y, i), want[i], 1e-12, "mode %d [%lld]: %g, want %g", mode,
                               (long long)i, get(y, i), want[i]);
        }
        cr_assert_str_eq(weft_param_list_name(weft_nn_embedding_bag_params(bag), 0), "weight");
        weft_tensor_release(y);
        weft_nn_embedding_bag_free(bag);
    }
    weft_tensor_release(idx);
    weft_tensor_release(off);
}

/* ---- training -------------------------------------------------------------------------------- */

/*
 * Trains a 2-H-C MLP on XOR (cross entropy on 2 classes, or MSE on one output) until it
 * classifies all four points with a loss below @p max_loss; returns the steps taken, or -1.
 */
static int train_xor(const weft_nn_mlp_config_t *cfg, int64_t hidden, int classes,
                     weft_optimizer_t *(*make)(const weft_param_list_t *), uint64_t seed,
                     int max_steps, double max_loss)
{
    static const double xs[] = {0, 0, 0, 1, 1, 0, 1, 1};
    static const double ys[] = {0, 1, 1, 0};
    weft_rng_t rng;
    weft_nn_mlp_t *mlp = NULL;
    weft_optimizer_t *opt;
    weft_tensor_t *x = tensor_from(cfg->dtype, 2, (const int64_t[]){4, 2}, xs);
    weft_tensor_t *labels = tensor_from(WEFT_I64, 1, (const int64_t[]){4}, ys);
    weft_tensor_t *targets = tensor_from(cfg->dtype, 2, (const int64_t[]){4, 1}, ys);
    int done = -1;

    weft_rng_init(&rng, seed, 0);
    cr_assert_eq(weft_nn_mlp_create(3, (const int64_t[]){2, hidden, classes}, cfg, &rng, &mlp),
                 WEFT_OK);
    opt = make(weft_nn_mlp_params(mlp));
    for (int step = 0; step < max_steps && done < 0; step++) {
        weft_tensor_t *out = NULL;
        weft_tensor_t *loss = NULL;
        int correct = 0;

        cr_assert_eq(weft_nn_mlp_forward(mlp, x, &out), WEFT_OK, "%s", weft_last_error());
        for (int i = 0; i < 4; i++) {
            int pred = classes == 2 ? get(out, 2 * i + 1) > get(out, 2 * i) : get(out, i) > 0.5;
            correct += pred == (int)ys[i];
        }
        if (classes == 2) {
            cr_assert_eq(weft_op_cross_entropy(out, labels, WEFT_REDUCTION_MEAN, &loss), WEFT_OK,
                         "%s", weft_last_error());
        } else {
            cr_assert_eq(weft_op_mse_loss(out, targets, WEFT_REDUCTION_MEAN, &loss), WEFT_OK, "%s",
                         weft_last_error());
        }
        if (correct == 4 && get(loss, 0) < max_loss) {
            done = step;
        }
        weft_optimizer_zero_grad(opt);
        cr_assert_eq(weft_backward(loss, NULL, 0), WEFT_OK, "%s", weft_last_error());
        cr_assert_eq(weft_optimizer_step(opt), WEFT_OK, "%s", weft_last_error());
        weft_tensor_release(loss);
        weft_tensor_release(out);
    }
    weft_optimizer_free(opt);
    weft_nn_mlp_free(mlp);
    weft_tensor_release(x);
    weft_tensor_release(labels);
    weft_tensor_release(targets);
    return done;
}

static weft_optimizer_t *make_adam(const weft_param_list_t *ps)
{
    weft_optim_adam_config_t cfg = WEFT_OPTIM_ADAM_DEFAULTS;
    weft_optimizer_t *opt = NULL;

    cfg.lr = 0.05;
    cr_assert_eq(weft_optimizer_adam_create(ps, &cfg, &opt), WEFT_OK, "%s", weft_last_error());
    return opt;
}

static weft_optimizer_t *make_sgd(const weft_param_list_t *ps)
{
    weft_optim_sgd_config_t cfg = {.lr = 0.2, .momentum = 0.9};
    weft_optimizer_t *opt = NULL;

    cr_assert_eq(weft_optimizer_sgd_create(ps, &cfg, &opt), WEFT_OK, "%s", weft_last_error());
    return opt;
}

Test(nn, mlp_learns_xor_with_adam)
{
    weft_nn_mlp_config_t cfg = WEFT_NN_MLP_DEFAULTS; /* relu, f32 */
    int steps = train_xor(&cfg, 16, 2, make_adam, 2024, 500, 0.01);

    cr_assert(steps >= 0, "2-16-2 relu MLP with Adam did not learn XOR (loss < 0.01) in 500 steps");
    cr_log_info("XOR with Adam: 100%%, loss < 0.01 after %d steps", steps);
}

Test(nn, mlp_learns_xor_with_sgd)
{
    weft_nn_mlp_config_t cfg = WEFT_NN_MLP_DEFAULTS;
    int steps;

    cfg.activation = WEFT_NN_ACT_TANH;
    cfg.dtype = WEFT_F64;
    steps = train_xor(&cfg, 8, 1, make_sgd, 7, 1000, 0.001);
    cr_assert(steps >= 0, "2-8-1 tanh MLP with SGD did not learn XOR (loss < 0.001) in 1000 steps");
    cr_log_info("XOR with SGD: 100%%, loss < 0.001 after %d steps", steps);
}

/* ---- gradients and optimizers ---------------------------------------------------------------- */

Test(nn, zero_grad_clears_grads)
{
    weft_rng_t rng;
    weft_nn_linear_t *lin = NULL;
    weft_optimizer_t *opt = NULL;
    weft_optim_sgd_config_t cfg = {.lr = 0.1};
    const weft_param_list_t *ps;
    weft_tensor_t *x =
        tensor_from(WEFT_F32, 2, (const int64_t[]){2, 3}, (const double[]){1, 2, 3, 4, 5, 6});
    weft_tensor_t *y = NULL;
    weft_tensor_t *loss = NULL;

    weft_rng_init(&rng, 9, 0);
    cr_assert_eq(weft_nn_linear_create(3, 2, 1, WEFT_F32, &rng, &lin), WEFT_OK);
    ps = weft_nn_linear_params(lin);
    cr_assert_eq(weft_optimizer_sgd_create(ps, &cfg, &opt), WEFT_OK);
    for (int round = 0; round < 2; round++) {
        cr_assert_eq(weft_nn_linear_forward(lin, x, &y), WEFT_OK);
        cr_assert_eq(weft_op_sum(y, 0, NULL, 0, &loss), WEFT_OK);
        cr_assert_eq(weft_backward(loss, NULL, 0), WEFT_OK, "%s", weft_last_error());
        for (int i = 0; i < 2; i++) {
            cr_assert_not_null(weft_tensor_grad(weft_param_list_get(ps, i)));
        }
        /* d sum / d bias = number of rows */
        cr_assert_float_eq(get(weft_tensor_grad(weft_nn_linear_bias(lin)), 0), 2.0, 1e-6);
        if (round == 0) {
            weft_optimizer_zero_grad(opt);
        } else {
            weft_param_list_zero_grad(ps);
        }
        for (int i = 0; i < 2; i++) {
            cr_assert_null(weft_tensor_grad(weft_param_list_get(ps, i)));
        }
        cr_assert_eq(weft_optimizer_step(opt), WEFT_OK); /* no gradients: nothing to do */
        cr_assert_eq(weft_optimizer_param_steps(opt, 0), 0);
        weft_tensor_release(loss);
        weft_tensor_release(y);
    }
    weft_optimizer_free(opt);
    weft_nn_linear_free(lin);
    weft_tensor_release(x);
}

/* Looks up rows 1, 3, 1 of a sparse embedding and backpropagates their sum. */
static void sparse_backward(weft_nn_embedding_t *emb)
{
    weft_tensor_t *idx = tensor_from(WEFT_I64, 1, (const int64_t[]){3}, (const double[]){1, 3, 1});
    weft_tensor_t *y = NULL;
    weft_tensor_t *loss = NULL;

    cr_assert_eq(weft_nn_embedding_forward(emb, idx, &y), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(weft_op_sum(y, 0, NULL, 0, &loss), WEFT_OK);
    cr_assert_eq(weft_backward(loss, NULL, 0), WEFT_OK, "%s", weft_last_error());
    weft_tensor_release(loss);
    weft_tensor_release(y);
    weft_tensor_release(idx);
}

Test(nn, sparse_embedding_with_optimizers)
{
    weft_rng_t rng;
    weft_nn_embedding_t *emb = NULL;
    weft_optimizer_t *sgd = NULL;
    weft_optimizer_t *adam = NULL;
    weft_optimizer_t *sgd_mom = NULL;
    weft_optim_sgd_config_t cfg = {.lr = 0.5};
    weft_optim_sgd_config_t cfg_mom = {.lr = 0.5, .momentum = 0.9};
    weft_optim_adam_config_t acfg = WEFT_OPTIM_ADAM_DEFAULTS;
    weft_tensor_t *w;
    weft_tensor_t *before = NULL;
    weft_tensor_t *sidx = NULL;
    weft_tensor_t *srows = NULL;

    weft_rng_init(&rng, 13, 0);
    cr_assert_eq(weft_nn_embedding_create(5, 2, 1, WEFT_F32, &rng, &emb), WEFT_OK);
    w = weft_nn_embedding_weight(emb);
    cr_assert_eq(weft_tensor_clone(w, &before), WEFT_OK);
    cr_assert_eq(weft_optimizer_sgd_create(weft_nn_embedding_params(emb), &cfg, &sgd), WEFT_OK);
    cr_assert_eq(weft_optimizer_sgd_create(weft_nn_embedding_params(emb), &cfg_mom, &sgd_mom),
                 WEFT_OK);
    cr_assert_eq(weft_optimizer_adam_create(weft_nn_embedding_params(emb), &acfg, &adam), WEFT_OK);

    sparse_backward(emb);
    cr_assert_null(weft_tensor_grad(w));
    cr_assert_eq(weft_tensor_sparse_grad(w, &sidx, &srows), WEFT_OK);
    cr_assert_eq(weft_optimizer_step(adam), WEFT_ERR_UNSUPPORTED);
    cr_assert(strstr(weft_last_error(), "sparse") != NULL, "%s", weft_last_error());
    cr_assert_eq(weft_optimizer_step(sgd_mom), WEFT_ERR_UNSUPPORTED);
    cr_assert(weft_tensor_equal(w, before), "a refused step changed the table");

    cr_assert_eq(weft_optimizer_step(sgd), WEFT_OK, "%s", weft_last_error());
    for (int64_t r = 0; r < 5; r++) {
        /* rows 1 (looked up twice) and 3 (once) move by -lr * count; the others stay */
        double count = r == 1 ? 2 : r == 3 ? 1 : 0;
        for (int64_t j = 0; j < 2; j++) {
            cr_assert_float_eq(get(w, r * 2 + j), get(before, r * 2 + j) - 0.5 * count, 1e-6,
                               "row %lld", (long long)r);
        }
    }
    cr_assert_eq(weft_optimizer_param_steps(sgd, 0), 1);
    weft_optimizer_zero_grad(sgd);
    cr_assert_eq(weft_tensor_sparse_grad(w, NULL, NULL), WEFT_ERR_NOT_FOUND);

    weft_optimizer_free(sgd);
    weft_optimizer_free(sgd_mom);
    weft_optimizer_free(adam);
    weft_nn_embedding_free(emb);
    weft_tensor_release(before);
}

Test(nn, optimizer_lr_and_state)
{
    weft_rng_t rng;
    weft_nn_linear_t *lin = NULL;
    weft_optimizer_t *opt = NULL;
    weft_optim_adam_config_t cfg = WEFT_OPTIM_ADAM_DEFAULTS;
    weft_param_list_t *twice = NULL;

    weft_rng_init(&rng, 17, 0);
    cr_assert_eq(weft_nn_linear_create(3, 2, 1, WEFT_F32, &rng, &lin), WEFT_OK);
    cfg.amsgrad = 1;
    cr_assert_eq(weft_optimizer_adamw_create(weft_nn_linear_params(lin), &cfg, &opt), WEFT_OK);
    cr_assert_eq(weft_optimizer_num_params(opt), 2);
    cr_assert_eq(weft_optimizer_lr(opt), 1e-3);
    cr_assert_eq(weft_optimizer_set_lr(opt, 0.25), WEFT_OK);
    cr_assert_eq(weft_optimizer_lr(opt), 0.25);
    cr_assert_eq(weft_optimizer_set_lr(opt, -1), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(weft_optimizer_lr(opt), 0.25);
    expect_shape(weft_optimizer_state(opt, 0, "exp_avg"), 2, (const int64_t[]){2, 3});
    expect_shape(weft_optimizer_state(opt, 1, "max_exp_avg_sq"), 1, (const int64_t[]){2});
    cr_assert_null(weft_optimizer_state(opt, 0, "sum"));
    cr_assert_null(weft_optimizer_state(opt, 2, "exp_avg"));
    cr_assert_eq(weft_optimizer_param_steps(opt, 2), -1);
    weft_optimizer_free(opt);

    cfg.beta1 = 1.5;
    cr_assert_eq(weft_optimizer_adam_create(weft_nn_linear_params(lin), &cfg, &opt),
                 WEFT_ERR_INVALID_ARG);
    cfg.beta1 = 0.9;
    /* the same tensor twice */
    cr_assert_eq(weft_param_list_create(&twice), WEFT_OK);
    cr_assert_eq(weft_param_list_add(twice, "a", weft_nn_linear_weight(lin)), WEFT_OK);
    cr_assert_eq(weft_param_list_add(twice, "a", weft_nn_linear_bias(lin)),
                 WEFT_ERR_ALREADY_EXISTS);
    cr_assert_eq(weft_param_list_add(twice, "b", weft_nn_linear_weight(lin)), WEFT_OK);
    cr_assert_eq(weft_optimizer_adam_create(twice, &cfg, &opt), WEFT_ERR_INVALID_ARG);
    weft_param_list_free(twice);
    weft_nn_linear_free(lin);
}

Test(nn, pack_and_unpack)
{
    weft_rng_t rng;
    weft_nn_mlp_t *a = NULL;
    weft_nn_mlp_t *b = NULL;
    const int64_t sizes[] = {3, 4, 2};
    const weft_param_list_t *pa;
    const weft_param_list_t *pb;
    int64_t n;
    weft_tensor_t *flat = NULL;
    weft_tensor_t *wrong = NULL;
    weft_tensor_t *x = tensor_from(WEFT_F32, 2, (const int64_t[]){1, 3}, (const double[]){1, 2, 3});
    weft_tensor_t *y = NULL;
    weft_tensor_t *loss = NULL;

    weft_rng_init(&rng, 21, 0);
    cr_assert_eq(weft_nn_mlp_create(3, sizes, NULL, &rng, &a), WEFT_OK);
    cr_assert_eq(weft_nn_mlp_create(3, sizes, NULL, &rng, &b), WEFT_OK);
    pa = weft_nn_mlp_params(a);
    pb = weft_nn_mlp_params(b);
    n = weft_param_list_numel(pa);
    cr_assert_eq(n, 3 * 4 + 4 + 4 * 2 + 2);
    cr_assert_eq(weft_tensor_create(WEFT_F32, 1, &n, &flat), WEFT_OK);
    cr_assert_eq(weft_tensor_create(WEFT_F64, 1, &n, &wrong), WEFT_OK);
    cr_assert_eq(weft_param_list_pack(pa, wrong), WEFT_ERR_DTYPE);
    cr_assert_eq(weft_param_list_pack(pa, flat), WEFT_OK);
    cr_assert_eq(get(flat, 0), get(weft_param_list_get(pa, 0), 0));
    cr_assert_eq(get(flat, 12), get(weft_param_list_get(pa, 1), 0));
    cr_assert(!weft_tensor_equal(weft_param_list_get(pb, 0), weft_param_list_get(pa, 0)));
    cr_assert_eq(weft_param_list_unpack(pb, flat), WEFT_OK);
    for (int i = 0; i < 4; i++) {
        cr_assert(weft_tensor_equal(weft_param_list_get(pa, i), weft_param_list_get(pb, i)));
    }

    /* gradients: the output bias's gradient is 1 for each output of a sum */
    cr_assert_eq(weft_nn_mlp_forward(b, x, &y), WEFT_OK);
    cr_assert_eq(weft_op_sum(y, 0, NULL, 0, &loss), WEFT_OK);
    cr_assert_eq(weft_backward(loss, NULL, 0), WEFT_OK);
    cr_assert_eq(weft_param_list_pack_grads(pb, flat), WEFT_OK);
    cr_assert_eq(get(flat, n - 1), 1.0);
    cr_assert_eq(get(flat, n - 2), 1.0);
    cr_assert_eq(weft_param_list_unpack_grads(pa, flat), WEFT_OK); /* a had no gradients */
    for (int i = 0; i < 4; i++) {
        cr_assert(weft_tensor_equal(weft_tensor_grad(weft_param_list_get(pa, i)),
                                    weft_tensor_grad(weft_param_list_get(pb, i))));
    }
    weft_tensor_release(loss);
    weft_tensor_release(y);
    weft_tensor_release(flat);
    weft_tensor_release(wrong);
    weft_tensor_release(x);
    weft_nn_mlp_free(a);
    weft_nn_mlp_free(b);
}

Test(nn, parameters_outlive_their_module)
{
    weft_rng_t rng;
    weft_nn_linear_t *lin = NULL;
    weft_param_list_t *list = NULL;
    weft_tensor_t *w;

    weft_rng_init(&rng, 23, 0);
    cr_assert_eq(weft_nn_linear_create(2, 2, 1, WEFT_F32, &rng, &lin), WEFT_OK);
    cr_assert_eq(weft_param_list_create(&list), WEFT_OK);
    cr_assert_eq(weft_param_list_extend(list, "layer", weft_nn_linear_params(lin)), WEFT_OK);
    cr_assert_eq(weft_param_list_extend(list, "layer", weft_nn_linear_params(lin)),
                 WEFT_ERR_ALREADY_EXISTS);
    cr_assert_eq(weft_param_list_size(list), 2);
    cr_assert_str_eq(weft_param_list_name(list, 0), "layer.weight");
    cr_assert_str_eq(weft_param_list_name(list, 1), "layer.bias");
    w = weft_param_list_find(list, "layer.weight");
    weft_nn_linear_free(lin);
    cr_assert_eq(weft_tensor_numel(w), 4); /* the list still holds it */
    weft_param_list_free(list);
}
