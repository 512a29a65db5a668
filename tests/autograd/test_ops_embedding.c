/*
 * Embeddings: embedding and embedding_bag (sum, mean, empty bags). Gradients by gradcheck in f64
 * (dense mode), sparse gradients densified against the dense ones, forward values and weight
 * gradients against torch (data/ops_embedding_table.h, made by data/gen_ops_embedding.py), and the
 * error statuses and texts.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "../core/counting_alloc.h"
#include "gradcheck.h"

#include "data/ops_embedding_table.h"

#include <weft/weft.h>

#define N_OF(a) (sizeof(a) / sizeof((a)[0]))

/* ---- helpers --------------------------------------------------------------------------------- */

static weft_tensor_t *from_tt(const tt_t *t, weft_dtype_t dt)
{
    weft_tensor_t *x = NULL;

    cr_assert_eq(weft_tensor_empty(dt, t->ndim, t->shape, &x), WEFT_OK);
    for (int64_t i = 0; i < weft_tensor_numel(x); i++) {
        if (dt == WEFT_F32) {
            ((float *)weft_tensor_data(x))[i] = (float)t->data[i];
        } else {
            ((double *)weft_tensor_data(x))[i] = t->data[i];
        }
    }
    return x;
}

static double elem(const weft_tensor_t *t, int64_t i)
{
    if (weft_tensor_dtype(t) == WEFT_F32) {
        return ((const float *)weft_tensor_data(t))[i];
    }
    return ((const double *)weft_tensor_data(t))[i];
}

static void expect_tt(const weft_tensor_t *got, const tt_t *want, double tol, const char *what,
                      int c)
{
    cr_assert_eq(weft_tensor_ndim(got), want->ndim, "%s %d: ndim %d, want %d", what, c,
                 weft_tensor_ndim(got), want->ndim);
    for (int i = 0; i < want->ndim; i++) {
        cr_assert_eq(weft_tensor_shape(got)[i], want->shape[i], "%s %d: dim %d is %lld, want %lld",
                     what, c, i, (long long)weft_tensor_shape(got)[i], (long long)want->shape[i]);
    }
    for (int64_t i = 0; i < weft_tensor_numel(got); i++) {
        double w = want->data[i];

        cr_assert(fabs(elem(got, i) - w) <= tol * fmax(1.0, fabs(w)),
                  "%s %d: element %lld is %.10g, torch %.10g", what, c, (long long)i, elem(got, i),
                  w);
    }
}

static void expect_error(weft_status_t st, weft_status_t want, const char *needle)
{
    cr_assert_eq(st, want, "status %s, want %s (%s)", weft_status_name(st), weft_status_name(want),
                 weft_last_error());
    cr_assert(strstr(weft_last_error(), needle) != NULL, "error text \"%s\" lacks \"%s\"",
              weft_last_error(), needle);
}

static weft_tensor_t *ints(int ndim, const int64_t *shape, const int64_t *v)
{
    weft_tensor_t *t = NULL;

    cr_assert_eq(weft_tensor_create(WEFT_I64, ndim, shape, &t), WEFT_OK);
    if (weft_tensor_numel(t) > 0) {
        memcpy(weft_tensor_data(t), v, (size_t)weft_tensor_numel(t) * sizeof(*v));
    }
    return t;
}

static weft_tensor_t *ints1(int64_t k, const int64_t *v)
{
    return ints(1, &k, v);
}

/* 1, 2, 3, ... in the shape of @p like (the output gradient of the torch table). */
static weft_tensor_t *ramp(const weft_tensor_t *like)
{
    weft_tensor_t *t = NULL;

    cr_assert_eq(weft_tensor_empty(weft_tensor_dtype(like), weft_tensor_ndim(like),
                                   weft_tensor_shape(like), &t),
                 WEFT_OK);
    for (int64_t i = 0; i < weft_tensor_numel(t); i++) {
        if (weft_tensor_dtype(t) == WEFT_F32) {
            ((float *)weft_tensor_data(t))[i] = (float)(i + 1);
        } else {
            ((double *)weft_tensor_data(t))[i] = (double)(i + 1);
        }
    }
    return t;
}

/* ---- gradients ------------------------------------------------------------------------------- */

typedef struct {
    weft_bag_mode_t mode;
    int sparse;
} emb_arg_t;

static weft_status_t f_embedding(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    emb_arg_t *a = arg;

    return weft_op_embedding(in[0], in[1], a->sparse, out_p);
}

static weft_status_t f_bag(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    emb_arg_t *a = arg;

    return weft_op_embedding_bag(in[0], in[1], in[2], a->mode, a->sparse, out_p);
}

TestSuite(embedding, .init = use_counting);

Test(embedding, embedding_grad)
{
    const int64_t ws[] = {6, 3};
    const int64_t is[] = {2, 4};
    const int64_t iv[] = {1, 5, 1, 0, 3, 1, 5, 2};
    emb_arg_t a = {0};
    weft_tensor_t *in[2];
    weft_rng_t rng;

    weft_rng_init(&rng, 31, 0);
    in[0] = gc_rand(&rng, 2, ws, -1, 1, 1);
    in[1] = ints(2, is, iv);
    gradcheck("embedding", f_embedding, &a, 2, in, &rng);
    weft_tensor_release(in[1]);
    in[1] = ints(0, NULL, (const int64_t[]){4}); /* a 0-D index gives one row */
    gradcheck("embedding 0-D index", f_embedding, &a, 2, in, &rng);
    weft_tensor_release(in[0]);
    weft_tensor_release(in[1]);
    check_balanced();
}

Test(embedding, bag_grad)
{
    const int64_t ws[] = {7, 3};
    const int64_t iv[] = {1, 5, 1, 0, 6, 3, 2, 2};
    const int64_t ov[] = {0, 2, 2, 5, 8}; /* an empty bag in the middle and at the end */
    weft_tensor_t *in[3];
    weft_rng_t rng;

    weft_rng_init(&rng, 32, 0);
    in[0] = gc_rand(&rng, 2, ws, -1, 1, 1);
    in[1] = ints1(8, iv);
    in[2] = ints1(5, ov);
    gradcheck("embedding_bag sum", f_bag, &(emb_arg_t){WEFT_BAG_SUM, 0}, 3, in, &rng);
    gradcheck("embedding_bag mean", f_bag, &(emb_arg_t){WEFT_BAG_MEAN, 0}, 3, in, &rng);
    weft_tensor_release(in[0]);
    weft_tensor_release(in[1]);
    weft_tensor_release(in[2]);
    check_balanced();
}

/* The sparse gradient, densified (rows of repeated indices summed), equals the dense one. */
static void check_sparse(const char *name, gc_fn_t f, void *dense_arg, void *sparse_arg,
                         weft_tensor_t *const *in, weft_dtype_t dt, weft_rng_t *rng)
{
    weft_tensor_t *w = in[0];
    weft_tensor_t *out = NULL;
    weft_tensor_t *v = NULL;
    weft_tensor_t *dense = NULL;
    weft_tensor_t *idx = NULL;
    weft_tensor_t *rows = NULL;
    int64_t d = weft_tensor_shape(w)[1];
    double *acc;

    cr_assert_eq(f(in, dense_arg, &out), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(weft_tensor_empty(dt, weft_tensor_ndim(out), weft_tensor_shape(out), &v), WEFT_OK);
    cr_assert_eq(weft_tensor_fill_uniform(v, -1, 1, rng), WEFT_OK);
    cr_assert_eq(weft_backward(out, v, 0), WEFT_OK, "%s", weft_last_error());
    weft_tensor_release(out);
    cr_assert_eq(weft_tensor_clone(weft_tensor_grad(w), &dense), WEFT_OK);
    cr_assert_eq(weft_tensor_sparse_grad(w, &idx, &rows), WEFT_ERR_NOT_FOUND);
    weft_tensor_grad_clear(w);

    cr_assert_eq(f(in, sparse_arg, &out), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(weft_backward(out, v, 0), WEFT_OK, "%s", weft_last_error());
    weft_tensor_release(out);
    cr_assert_eq(weft_tensor_sparse_grad(w, &idx, &rows), WEFT_OK, "%s: no sparse grad", name);
    cr_assert_null(weft_tensor_grad(w), "%s: a dense grad next to the sparse one", name);
    cr_assert_eq(weft_tensor_dtype(idx), WEFT_I64);
    cr_assert_eq(weft_tensor_dtype(rows), dt);
    cr_assert_eq(weft_tensor_ndim(rows), 2);
    cr_assert_eq(weft_tensor_shape(rows)[0], weft_tensor_numel(idx));
    cr_assert_eq(weft_tensor_shape(rows)[1], d);
    acc = calloc((size_t)weft_tensor_numel(w), sizeof(double));
    cr_assert_not_null(acc);
    for (int64_t k = 0; k < weft_tensor_numel(idx); k++) {
        int64_t r = ((const int64_t *)weft_tensor_data(idx))[k];

        for (int64_t e = 0; e < d; e++) {
            acc[r * d + e] += elem(rows, k * d + e);
        }
    }
    for (int64_t i = 0; i < weft_tensor_numel(w); i++) {
        cr_assert(fabs(acc[i] - elem(dense, i)) <= 1e-5 * fmax(1.0, fabs(acc[i])),
                  "%s: element %lld: sparse %.10g, dense %.10g", name, (long long)i, acc[i],
                  elem(dense, i));
    }
    free(acc);
    weft_tensor_grad_clear(w);
    weft_tensor_release(dense);
    weft_tensor_release(v);
}

Test(embedding, sparse_grads_match_dense)
{
    const int64_t ws[] = {9, 4};
    const int64_t is[] = {3, 2};
    const int64_t iv[] = {8, 0, 8, 3, 3, 8};
    const int64_t bv[] = {1, 5, 1, 0, 6, 3, 2, 2, 8};
    const int64_t ov[] = {0, 3, 3, 7};
    weft_rng_t rng;

    weft_rng_init(&rng, 33, 0);
    for (int d = 0; d < 2; d++) {
        weft_dtype_t dt = d == 0 ? WEFT_F64 : WEFT_F32;
        weft_tensor_t *w = NULL;
        weft_tensor_t *idx = ints(2, is, iv);
        weft_tensor_t *bidx = ints1(9, bv);
        weft_tensor_t *off = ints1(4, ov);

        cr_assert_eq(weft_tensor_empty(dt, 2, ws, &w), WEFT_OK);
        cr_assert_eq(weft_tensor_fill_uniform(w, -1, 1, &rng), WEFT_OK);
        cr_assert_eq(weft_tensor_set_requires_grad(w, 1), WEFT_OK);
        check_sparse("embedding", f_embedding, &(emb_arg_t){0, 0}, &(emb_arg_t){0, 1},
                     (weft_tensor_t *[]){w, idx}, dt, &rng);
        check_sparse("embedding_bag sum", f_bag, &(emb_arg_t){WEFT_BAG_SUM, 0},
                     &(emb_arg_t){WEFT_BAG_SUM, 1}, (weft_tensor_t *[]){w, bidx, off}, dt, &rng);
        check_sparse("embedding_bag mean", f_bag, &(emb_arg_t){WEFT_BAG_MEAN, 0},
                     &(emb_arg_t){WEFT_BAG_MEAN, 1}, (weft_tensor_t *[]){w, bidx, off}, dt, &rng);
        weft_tensor_release(w);
        weft_tensor_release(idx);
        weft_tensor_release(bidx);
        weft_tensor_release(off);
    }
    check_balanced();
}

Test(embedding, sparse_grad_keeps_its_indices)
{
    /* Writing the index tensor after backward does not change the sparse gradient. */
    const int64_t ws[] = {4, 2};
    const int64_t iv[] = {3, 1};
    weft_tensor_t *w = NULL;
    weft_tensor_t *idx = ints1(2, iv);
    weft_tensor_t *out = NULL;
    weft_tensor_t *gi = NULL;
    weft_tensor_t *gr = NULL;
    weft_tensor_t *v;

    cr_assert_eq(weft_tensor_create(WEFT_F32, 2, ws, &w), WEFT_OK);
    cr_assert_eq(weft_tensor_set_requires_grad(w, 1), WEFT_OK);
    cr_assert_eq(weft_op_embedding(w, idx, 1, &out), WEFT_OK);
    cr_assert_str_eq(weft_tensor_grad_fn_name(out), "EmbeddingBackward");
    v = ramp(out);
    cr_assert_eq(weft_backward(out, v, 0), WEFT_OK, "%s", weft_last_error());
    ((int64_t *)weft_tensor_data(idx))[0] = 0;
    cr_assert_eq(weft_tensor_sparse_grad(w, &gi, &gr), WEFT_OK);
    cr_assert_eq(((int64_t *)weft_tensor_data(gi))[0], 3);
    cr_assert_eq(((int64_t *)weft_tensor_data(gi))[1], 1);
    cr_assert_eq(((float *)weft_tensor_data(gr))[3], 4.0f);
    weft_tensor_release(v);
    weft_tensor_release(out);
    weft_tensor_release(idx);
    weft_tensor_release(w);
    check_balanced();
}

/* ---- forward values and gradients against torch ---------------------------------------------- */

Test(embedding, embedding_matches_torch)
{
    for (size_t c = 0; c < N_OF(embedding_cases); c++) {
        const embedding_case_t *ec = &embedding_cases[c];

        for (int d = 0; d < 2; d++) {
            weft_dtype_t dt = d == 0 ? WEFT_F64 : WEFT_F32;
            weft_tensor_t *w = from_tt(&ec->weight, dt);
            weft_tensor_t *idx = ints(ec->idx_ndim, ec->idx_shape, ec->idx);
            weft_tensor_t *out = NULL;
            weft_tensor_t *v;

            cr_assert_eq(weft_tensor_set_requires_grad(w, 1), WEFT_OK);
            cr_assert_eq(weft_op_embedding(w, idx, 0, &out), WEFT_OK, "%s", weft_last_error());
            expect_tt(out, &ec->out, dt == WEFT_F64 ? 0 : 1e-6, "embedding", (int)c);
            v = ramp(out);
            cr_assert_eq(weft_backward(out, v, 0), WEFT_OK, "%s", weft_last_error());
            expect_tt(weft_tensor_grad(w), &ec->grad, 0, "embedding grad", (int)c);
            weft_tensor_release(v);
            weft_tensor_release(out);
            weft_tensor_release(idx);
            weft_tensor_release(w);
        }
    }
    check_balanced();
}

Test(embedding, bag_matches_torch)
{
    for (size_t c = 0; c < N_OF(bag_cases); c++) {
        const bag_case_t *bc = &bag_cases[c];

        for (int d = 0; d < 2; d++) {
            weft_dtype_t dt = d == 0 ? WEFT_F64 : WEFT_F32;
            double tol = dt == WEFT_F64 ? 1e-12 : 1e-6;
            weft_tensor_t *w = from_tt(&bc->weight, dt);
            weft_tensor_t *idx = ints1(bc->n_idx, bc->idx);
            weft_tensor_t *off = ints1(bc->n_off, bc->off);
            weft_tensor_t *out = NULL;
            weft_tensor_t *v;

            cr_assert_eq(weft_tensor_set_requires_grad(w, 1), WEFT_OK);
            cr_assert_eq(weft_op_embedding_bag(w, idx, off, (weft_bag_mode_t)bc->mode, 0, &out),
                         WEFT_OK, "%s", weft_last_error());
            cr_assert_str_eq(weft_tensor_grad_fn_name(out), "EmbeddingBagBackward");
            expect_tt(out, &bc->out, tol, "embedding_bag", (int)c);
            v = ramp(out);
            cr_assert_eq(weft_backward(out, v, 0), WEFT_OK, "%s", weft_last_error());
            expect_tt(weft_tensor_grad(w), &bc->grad, tol, "embedding_bag grad", (int)c);
            weft_tensor_release(v);
            weft_tensor_release(out);
            weft_tensor_release(idx);
            weft_tensor_release(off);
            weft_tensor_release(w);
        }
    }
    check_balanced();
}

Test(embedding, empty_bags_and_no_bags)
{
    const int64_t ws[] = {3, 2};
    weft_tensor_t *w = NULL;
    weft_tensor_t *idx = ints1(0, NULL);
    weft_tensor_t *off = ints1(2, (const int64_t[]){0, 0});
    weft_tensor_t *none = ints1(0, NULL);
    weft_tensor_t *out = NULL;

    cr_assert_eq(weft_tensor_create(WEFT_F64, 2, ws, &w), WEFT_OK);
    cr_assert_eq(weft_tensor_fill(w, 2.0), WEFT_OK);
    cr_assert_eq(weft_op_embedding_bag(w, idx, off, WEFT_BAG_MEAN, 0, &out), WEFT_OK);
    cr_assert_eq(weft_tensor_shape(out)[0], 2);
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(((double *)weft_tensor_data(out))[i], 0.0);
    }
    weft_tensor_release(out);
    cr_assert_eq(weft_op_embedding_bag(w, idx, none, WEFT_BAG_SUM, 0, &out), WEFT_OK);
    cr_assert_eq(weft_tensor_shape(out)[0], 0);
    cr_assert_eq(weft_tensor_shape(out)[1], 2);
    weft_tensor_release(out);
    weft_tensor_release(w);
    weft_tensor_release(idx);
    weft_tensor_release(off);
    weft_tensor_release(none);
    check_balanced();
}

/* ---- errors ---------------------------------------------------------------------------------- */

Test(embedding, errors)
{
    const int64_t ws[] = {5, 3};
    weft_tensor_t *w = NULL;
    weft_tensor_t *wi = NULL;
    weft_tensor_t *w1 = NULL;
    weft_tensor_t *good = ints1(3, (const int64_t[]){0, 4, 2});
    weft_tensor_t *high = ints1(3, (const int64_t[]){0, 4, 5});
    weft_tensor_t *neg = ints1(2, (const int64_t[]){-1, 0});
    weft_tensor_t *i32 = NULL;
    weft_tensor_t *off_ok = ints1(2, (const int64_t[]){0, 1});
    weft_tensor_t *off_dec = ints1(3, (const int64_t[]){0, 2, 1});
    weft_tensor_t *off_start = ints1(2, (const int64_t[]){1, 2});
    weft_tensor_t *off_past = ints1(2, (const int64_t[]){0, 4});
    weft_tensor_t *idx2d = ints(2, (const int64_t[]){1, 3}, (const int64_t[]){0, 1, 2});
    weft_tensor_t *out = NULL;

    cr_assert_eq(weft_tensor_create(WEFT_F32, 2, ws, &w), WEFT_OK);
    cr_assert_eq(weft_tensor_create(WEFT_I64, 2, ws, &wi), WEFT_OK);
    cr_assert_eq(weft_tensor_create(WEFT_F32, 1, ws, &w1), WEFT_OK);
    cr_assert_eq(weft_tensor_create(WEFT_I32, 1, (const int64_t[]){2}, &i32), WEFT_OK);

    expect_error(weft_op_embedding(w, high, 0, &out), WEFT_ERR_INVALID_ARG,
                 "index 5 at position 2 is out of range for a weight of 5 rows");
    expect_error(weft_op_embedding(w, neg, 1, &out), WEFT_ERR_INVALID_ARG,
                 "index -1 at position 0");
    expect_error(weft_op_embedding(w, i32, 0, &out), WEFT_ERR_DTYPE, "indices must be i64");
    expect_error(weft_op_embedding(wi, good, 0, &out), WEFT_ERR_DTYPE, "f32 or f64");
    expect_error(weft_op_embedding(w1, good, 0, &out), WEFT_ERR_SHAPE, "2-D");

    expect_error(weft_op_embedding_bag(w, high, off_ok, WEFT_BAG_SUM, 0, &out),
                 WEFT_ERR_INVALID_ARG, "index 5 at position 2");
    expect_error(weft_op_embedding_bag(w, neg, off_ok, WEFT_BAG_SUM, 0, &out), WEFT_ERR_INVALID_ARG,
                 "index -1 at position 0");
    expect_error(weft_op_embedding_bag(w, i32, off_ok, WEFT_BAG_SUM, 0, &out), WEFT_ERR_DTYPE,
                 "indices must be i64");
    expect_error(weft_op_embedding_bag(w, good, i32, WEFT_BAG_SUM, 0, &out), WEFT_ERR_DTYPE,
                 "offsets must be i64");
    expect_error(weft_op_embedding_bag(w, good, off_dec, WEFT_BAG_SUM, 0, &out),
                 WEFT_ERR_INVALID_ARG, "offsets decrease at position 2 (1 after 2)");
    expect_error(weft_op_embedding_bag(w, good, off_start, WEFT_BAG_MEAN, 0, &out),
                 WEFT_ERR_INVALID_ARG, "offsets must start at 0, got 1");
    expect_error(weft_op_embedding_bag(w, good, off_past, WEFT_BAG_SUM, 0, &out),
                 WEFT_ERR_INVALID_ARG, "past the end");
    expect_error(weft_op_embedding_bag(w, idx2d, off_ok, WEFT_BAG_SUM, 0, &out), WEFT_ERR_SHAPE,
                 "indices must be 1-D");
    expect_error(weft_op_embedding_bag(w, good, off_ok, (weft_bag_mode_t)7, 0, &out),
                 WEFT_ERR_INVALID_ARG, "mode 7");
    cr_assert_null(out);

    weft_tensor_release(w);
    weft_tensor_release(wi);
    weft_tensor_release(w1);
    weft_tensor_release(good);
    weft_tensor_release(high);
    weft_tensor_release(neg);
    weft_tensor_release(i32);
    weft_tensor_release(off_ok);
    weft_tensor_release(off_dec);
    weft_tensor_release(off_start);
    weft_tensor_release(off_past);
    weft_tensor_release(idx2d);
    check_balanced();
}
