/*
 * examples/cnn_train under weftrun as a user would run it (WEFTRUN the launcher, CNN_TRAIN the
 * example), and the ResNet BasicBlock it is built from (weft_nn_basic_block, in-process). The
 * tests that train skip when Fashion-MNIST is not installed.
 */

#include <criterion/criterion.h>

#include "example.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include <weft/weft.h>

/* Slow under ASan: one training run takes seconds plain. */
static const example_t CNN2 = {.ranks = "2", .prog_env = "CNN_TRAIN", .deadline_s = 240.0};
static const example_t CNN1 = {.ranks = "1", .prog_env = "CNN_TRAIN", .deadline_s = 240.0};

/* ------------------------------------------------------------------ BasicBlock */

/* x [n, c, h, w] uniform in [-1, 1) from seed 7. */
static weft_tensor_t *random_images(int64_t n, int64_t c, int64_t h, int64_t w)
{
    weft_tensor_t *x = NULL;
    weft_rng_t rng;

    weft_rng_init(&rng, 7, 0);
    cr_assert_eq(weft_tensor_create(WEFT_F32, 4, (const int64_t[]){n, c, h, w}, &x), WEFT_OK);
    cr_assert_eq(weft_tensor_fill_uniform(x, -1.0, 1.0, &rng), WEFT_OK);
    return x;
}

static void assert_shape4(const weft_tensor_t *t, int64_t n, int64_t c, int64_t h, int64_t w)
{
    const int64_t *s = weft_tensor_shape(t);

    cr_assert_eq(weft_tensor_ndim(t), 4);
    cr_assert(s[0] == n && s[1] == c && s[2] == h && s[3] == w,
              "shape [%lld, %lld, %lld, %lld], want [%lld, %lld, %lld, %lld]", (long long)s[0],
              (long long)s[1], (long long)s[2], (long long)s[3], (long long)n, (long long)c,
              (long long)h, (long long)w);
}

static void assert_names(const weft_param_list_t *l, const char *const *want, int n)
{
    cr_assert_eq(weft_param_list_size(l), n);
    for (int i = 0; i < n; i++) {
        cr_assert_str_eq(weft_param_list_name(l, i), want[i]);
    }
}

Test(basic_block, downsample_block_shapes_and_torchvision_names)
{
    static const char *const params[] = {
        "conv1.weight",        "bn1.weight",          "bn1.bias",
        "conv2.weight",        "bn2.weight",          "bn2.bias",
        "downsample.0.weight", "downsample.1.weight", "downsample.1.bias",
    };
    static const char *const buffers[] = {
        "bn1.running_mean", "bn1.running_var",           "bn2.running_mean",
        "bn2.running_var",  "downsample.1.running_mean", "downsample.1.running_var",
    };
    weft_nn_basic_block_t *b = NULL;
    weft_tensor_t *x = random_images(2, 16, 14, 14);
    weft_tensor_t *y = NULL;
    weft_rng_t rng;

    weft_rng_init(&rng, 1, 0);
    cr_assert_eq(weft_nn_basic_block_create(16, 32, 2, WEFT_F32, &rng, &b), WEFT_OK);
    cr_assert_eq(weft_nn_basic_block_has_downsample(b), 1);
    cr_assert_eq(weft_nn_basic_block_training(b), 1);
    assert_names(weft_nn_basic_block_params(b), params, 9);
    assert_names(weft_nn_basic_block_buffers(b), buffers, 6);
    /* 32*16*9 + 32*32*9 + 32*16 weights, 3 batch norms of 32 weights and 32 biases */
    cr_assert_eq(weft_param_list_numel(weft_nn_basic_block_params(b)),
                 32 * 16 * 9 + 32 * 32 * 9 + 32 * 16 + 3 * 64);
    assert_shape4(weft_param_list_find(weft_nn_basic_block_params(b), "conv1.weight"), 32, 16, 3,
                  3);
    assert_shape4(weft_param_list_find(weft_nn_basic_block_params(b), "downsample.0.weight"), 32,
                  16, 1, 1);
    cr_assert_eq(weft_nn_basic_block_forward(b, x, &y), WEFT_OK);
    assert_shape4(y, 2, 32, 7, 7);
    /* The last op is a ReLU. */
    for (int64_t i = 0; i < weft_tensor_numel(y); i++) {
        cr_assert(((const float *)weft_tensor_data(y))[i] >= 0.0f);
    }
    weft_tensor_release(y);
    /* Odd sizes: (15 - 1) / 2 + 1 = 8. */
    weft_tensor_release(x);
    x = random_images(3, 16, 15, 15);
    cr_assert_eq(weft_nn_basic_block_forward(b, x, &y), WEFT_OK);
    assert_shape4(y, 3, 32, 8, 8);
    weft_tensor_release(y);
    weft_tensor_release(x);
    /* The wrong channel count is the conv's shape error. */
    x = random_images(2, 8, 14, 14);
    cr_assert_eq(weft_nn_basic_block_forward(b, x, &y), WEFT_ERR_SHAPE);
    weft_tensor_release(x);
    weft_nn_basic_block_free(b);
}

Test(basic_block, identity_block_has_no_downsample)
{
    static const char *const params[] = {"conv1.weight", "bn1.weight", "bn1.bias",
                                         "conv2.weight", "bn2.weight", "bn2.bias"};
    weft_nn_basic_block_t *b = NULL;
    weft_tensor_t *x = random_images(2, 8, 6, 5);
    weft_tensor_t *y = NULL;
    weft_rng_t rng;

    weft_rng_init(&rng, 1, 0);
    cr_assert_eq(weft_nn_basic_block_create(8, 8, 1, WEFT_F32, &rng, &b), WEFT_OK);
    cr_assert_eq(weft_nn_basic_block_has_downsample(b), 0);
    assert_names(weft_nn_basic_block_params(b), params, 6);
    cr_assert_eq(weft_param_list_size(weft_nn_basic_block_buffers(b)), 4);
    cr_assert_eq(weft_nn_basic_block_forward(b, x, &y), WEFT_OK);
    assert_shape4(y, 2, 8, 6, 5);
    weft_tensor_release(y);
    weft_tensor_release(x);
    weft_nn_basic_block_free(b);
    /* Same channels but stride 2, and stride 1 with new channels: both downsample. */
    cr_assert_eq(weft_nn_basic_block_create(8, 8, 2, WEFT_F32, &rng, &b), WEFT_OK);
    cr_assert_eq(weft_nn_basic_block_has_downsample(b), 1);
    weft_nn_basic_block_free(b);
    cr_assert_eq(weft_nn_basic_block_create(8, 4, 1, WEFT_F64, &rng, &b), WEFT_OK);
    cr_assert_eq(weft_nn_basic_block_has_downsample(b), 1);
    weft_nn_basic_block_free(b);
}

Test(basic_block, bad_arguments)
{
    weft_nn_basic_block_t *b = NULL;
    weft_rng_t rng;

    weft_rng_init(&rng, 1, 0);
    cr_assert_eq(weft_nn_basic_block_create(8, 8, 0, WEFT_F32, &rng, &b), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(weft_nn_basic_block_create(0, 8, 1, WEFT_F32, &rng, &b), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(weft_nn_basic_block_create(8, 8, 1, WEFT_F32, NULL, &b), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(weft_nn_basic_block_create(8, 8, 1, WEFT_I64, &rng, &b), WEFT_ERR_DTYPE);
    cr_assert_null(b);
    cr_assert_eq(weft_nn_basic_block_forward(NULL, NULL, NULL), WEFT_ERR_INVALID_ARG);
    weft_nn_basic_block_free(NULL);
    weft_nn_basic_block_set_training(NULL, 0);
    cr_assert_null(weft_nn_basic_block_params(NULL));
}

Test(basic_block, every_parameter_gets_a_gradient)
{
    weft_nn_basic_block_t *b = NULL;
    weft_tensor_t *x = random_images(4, 4, 8, 8);
    weft_tensor_t *y = NULL;
    weft_tensor_t *w = NULL;
    weft_tensor_t *yw = NULL;
    weft_tensor_t *loss = NULL;
    const weft_param_list_t *params;
    weft_rng_t rng;

    weft_rng_init(&rng, 3, 0);
    cr_assert_eq(weft_nn_basic_block_create(4, 6, 2, WEFT_F32, &rng, &b), WEFT_OK);
    cr_assert_eq(weft_tensor_set_requires_grad(x, 1), WEFT_OK);
    cr_assert_eq(weft_nn_basic_block_forward(b, x, &y), WEFT_OK);
    /* A weighted sum, so that the batch norms' gradients do not vanish (as a plain sum's would
     * for weights that only scale normalised values). */
    cr_assert_eq(weft_tensor_create(WEFT_F32, 4, weft_tensor_shape(y), &w), WEFT_OK);
    cr_assert_eq(weft_tensor_fill_uniform(w, -1.0, 1.0, &rng), WEFT_OK);
    cr_assert_eq(weft_op_mul(y, w, &yw), WEFT_OK);
    cr_assert_eq(weft_op_sum(yw, 0, NULL, 0, &loss), WEFT_OK);
    cr_assert_eq(weft_backward(loss, NULL, 0), WEFT_OK);
    params = weft_nn_basic_block_params(b);
    for (int i = 0; i < weft_param_list_size(params); i++) {
        const weft_tensor_t *p = weft_param_list_get(params, i);
        const weft_tensor_t *g = weft_tensor_grad(p);
        double norm = 0;

        cr_assert_not_null(g, "%s has no gradient", weft_param_list_name(params, i));
        cr_assert_eq(weft_tensor_numel(g), weft_tensor_numel(p));
        for (int64_t j = 0; j < weft_tensor_numel(g); j++) {
            double v = ((const float *)weft_tensor_data(g))[j];
            cr_assert(isfinite(v));
            norm += v * v;
        }
        cr_assert(norm > 0, "%s has a zero gradient", weft_param_list_name(params, i));
    }
    cr_assert_not_null(weft_tensor_grad(x));
    /* Buffers are not part of the graph. */
    for (int i = 0; i < weft_param_list_size(weft_nn_basic_block_buffers(b)); i++) {
        cr_assert_null(weft_tensor_grad(weft_param_list_get(weft_nn_basic_block_buffers(b), i)));
    }
    weft_tensor_release(loss);
    weft_tensor_release(yw);
    weft_tensor_release(w);
    weft_tensor_release(y);
    weft_tensor_release(x);
    weft_nn_basic_block_free(b);
}

/* A copy of buffer @p i's values. */
static void buffer_copy(const weft_nn_basic_block_t *b, int i, float *out, int64_t n)
{
    const weft_tensor_t *t = weft_param_list_get(weft_nn_basic_block_buffers(b), i);

    cr_assert_eq(weft_tensor_numel(t), n);
    memcpy(out, weft_tensor_data(t), (size_t)n * sizeof(float));
}

Test(basic_block, train_and_eval_modes)
{
    weft_nn_basic_block_t *b = NULL;
    weft_tensor_t *x = random_images(3, 4, 6, 6);
    weft_tensor_t *x0 = NULL;
    weft_tensor_t *y = NULL;
    weft_tensor_t *y0 = NULL;
    weft_tensor_t *ye = NULL;
    float before[6], after[6];
    weft_rng_t rng;
    const int64_t per = 6 * 3 * 3; /* one sample's output elements */

    weft_rng_init(&rng, 5, 0);
    cr_assert_eq(weft_nn_basic_block_create(4, 6, 2, WEFT_F32, &rng, &b), WEFT_OK);
    /* Training: the batch's statistics, and the running ones move (running_mean starts at 0). */
    buffer_copy(b, 0, before, 6);
    cr_assert_eq(weft_nn_basic_block_forward(b, x, &y), WEFT_OK);
    buffer_copy(b, 0, after, 6);
    cr_assert(memcmp(before, after, sizeof(before)) != 0, "bn1.running_mean did not move");

    /* Eval: the running statistics, left alone, and each sample's output its own. */
    weft_nn_basic_block_set_training(b, 0);
    cr_assert_eq(weft_nn_basic_block_training(b), 0);
    buffer_copy(b, 0, before, 6);
    cr_assert_eq(weft_nn_basic_block_forward(b, x, &ye), WEFT_OK);
    buffer_copy(b, 0, after, 6);
    cr_assert(memcmp(before, after, sizeof(before)) == 0, "eval mode moved bn1.running_mean");
    cr_assert_eq(weft_tensor_create(WEFT_F32, 4, (const int64_t[]){1, 4, 6, 6}, &x0), WEFT_OK);
    memcpy(weft_tensor_data(x0), weft_tensor_data(x), 4 * 36 * sizeof(float));
    cr_assert_eq(weft_nn_basic_block_forward(b, x0, &y0), WEFT_OK);
    for (int64_t i = 0; i < per; i++) {
        float a = ((const float *)weft_tensor_data(y0))[i];
        float e = ((const float *)weft_tensor_data(ye))[i];
        cr_assert(fabsf(a - e) <= 1e-5f * (1.0f + fabsf(e)), "element %lld: %g alone, %g in batch",
                  (long long)i, (double)a, (double)e);
    }
    {
        int differ = 0;
        for (int64_t i = 0; i < weft_tensor_numel(y); i++) {
            differ |=
                ((const float *)weft_tensor_data(y))[i] != ((const float *)weft_tensor_data(ye))[i];
        }
        cr_assert(differ, "train and eval outputs are the same");
    }
    /* And back to training. */
    weft_nn_basic_block_set_training(b, 1);
    cr_assert_eq(weft_nn_basic_block_training(b), 1);
    weft_tensor_release(y0);
    weft_tensor_release(ye);
    weft_tensor_release(y);
    weft_tensor_release(x0);
    weft_tensor_release(x);
    weft_nn_basic_block_free(b);
}

/* ------------------------------------------------------------------ cnn_train */

static double final_accuracy(const result_t *r)
{
    const char *line = find_line(r->out, "[rank 0] final test accuracy ", true);
    double acc = -1.0;

    cr_assert(line != NULL, "no final accuracy\nstdout:\n%s\nstderr:\n%s", r->out, r->err);
    cr_assert(sscanf(line, "[rank 0] final test accuracy %lf%%", &acc) == 1, "%.200s", line);
    return acc;
}

Test(cnn_train, learns_on_two_ranks, .timeout = 300)
{
    result_t r;
    double acc;

    SKIP_WITHOUT_FASHION_MNIST();
    example_run_with(&r, &CNN2, "--epochs", "1", "--limit", "6000", "--json");
    assert_exit(&r, 0);
    assert_line_prefix(&r, "[rank 0] CNN conv1(1->16)-bn-relu-maxpool, BasicBlock(16->32, stride "
                           "2), avgpool, fc(32->10) (15034 parameters) on 6000 Fashion-MNIST "
                           "images, 2 ranks, batch 64 per rank, SGD lr 0.05 momentum 0.9, 47 "
                           "steps per epoch");
    assert_line_prefix(&r, "[rank 0] epoch 1: train loss ");
    acc = final_accuracy(&r);
    /* 47 steps of 128 images: about 57%; chance is 10%. */
    cr_assert(acc > 40.0, "accuracy %.2f%% after 1 epoch on 6000 samples", acc);
    assert_line_prefix(&r, "[rank 0] parameters bit-identical on all 2 ranks (fnv1a64 ");
    cr_assert(strstr(r.out, "DIFFER") == NULL, "%s", r.out);
    assert_line_prefix(&r, "[rank 0] {\"system\":\"weft\",\"model\":\"cnn\",\"world\":2,");
    cr_assert(strstr(r.out, "\"params_identical\":true") != NULL, "%s", r.out);
    cr_assert(strstr(r.out, "\"samples_per_s\":") != NULL && strstr(r.out, "\"step_ms\":") != NULL,
              "%s", r.out);
    result_free(&r);
}

Test(cnn_train, runs_on_one_rank_with_step_evaluations, .timeout = 300)
{
    result_t r;

    SKIP_WITHOUT_FASHION_MNIST();
    /* 641 samples: 10 batches of 64 and a last one of 1, which is dropped (BatchNorm). */
    example_run_with(&r, &CNN1, "--epochs", "1", "--limit", "641", "--eval-every", "5");
    assert_exit(&r, 0);
    assert_line_prefix(&r, "[rank 0] CNN conv1(1->16)");
    cr_assert(strstr(r.out, "1 rank, batch 64 per rank, SGD lr 0.05 momentum 0.9, 10 steps per "
                            "epoch") != NULL,
              "%s", r.out);
    assert_line_prefix(&r, "[rank 0] step 5: test accuracy ");
    cr_assert(final_accuracy(&r) > 10.0, "%s", r.out);
    assert_line_prefix(&r, "[rank 0] parameters bit-identical on all 1 ranks (fnv1a64 ");
    result_free(&r);
}

Test(cnn_train, bad_options_exit_2, .timeout = 120)
{
    result_t r;

    example_run_with(&r, &CNN1, "--batch", "1");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "bad value '1' for --batch");
    result_free(&r);

    example_run_with(&r, &CNN1, "--lr", "fast");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "bad value 'fast' for --lr");
    result_free(&r);

    example_run_with(&r, &CNN1, "--hidden", "256");
    assert_exit(&r, 2);
    result_free(&r);

    example_run_with(&r, &CNN2, "--data", "/nonexistent");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "cnn_train: cannot load Fashion-MNIST: ");
    result_free(&r);

    example_run_with(&r, &CNN1, "--help");
    assert_exit(&r, 0);
    assert_line_prefix(&r, "[rank 0] usage: weftrun -n N cnn_train [options]");
    result_free(&r);
}
