/*
 * Shapes and indexing: reshape, transpose, permute, concat, split, chunk and index_select.
 * Gradients by gradcheck in f64, forward values against torch (data/ops_shape_table.h, made by
 * data/gen_ops_shape.py), the permute kernel against a naive copy for every dtype size, storage
 * sharing of reshape, and the error statuses and texts.
 */
#include <math.h>
#include <string.h>

#include <criterion/criterion.h>

#include "../core/counting_alloc.h"
#include "gradcheck.h"

#include "data/ops_shape_table.h"

#include <weft/weft.h>

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

/* Shape ops only move values: @p got equals @p want (rounded to the dtype) exactly. */
static void expect_tt(const weft_tensor_t *got, const tt_t *want, const char *what, int c)
{
    cr_assert_eq(weft_tensor_ndim(got), want->ndim, "%s %d: ndim %d, want %d", what, c,
                 weft_tensor_ndim(got), want->ndim);
    for (int i = 0; i < want->ndim; i++) {
        cr_assert_eq(weft_tensor_shape(got)[i], want->shape[i], "%s %d: dim %d is %lld, want %lld",
                     what, c, i, (long long)weft_tensor_shape(got)[i], (long long)want->shape[i]);
    }
    for (int64_t i = 0; i < weft_tensor_numel(got); i++) {
        double w = weft_tensor_dtype(got) == WEFT_F32 ? (float)want->data[i] : want->data[i];

        cr_assert(elem(got, i) == w, "%s %d: element %lld is %.10g, torch %.10g", what, c,
                  (long long)i, elem(got, i), w);
    }
}

static void expect_error(weft_status_t st, weft_status_t want, const char *needle)
{
    cr_assert_eq(st, want, "status %s, want %s (%s)", weft_status_name(st), weft_status_name(want),
                 weft_last_error());
    cr_assert(strstr(weft_last_error(), needle) != NULL, "error text \"%s\" lacks \"%s\"",
              weft_last_error(), needle);
}

static weft_tensor_t *zeros(weft_dtype_t dt, int ndim, const int64_t *shape)
{
    weft_tensor_t *t = NULL;

    cr_assert_eq(weft_tensor_create(dt, ndim, shape, &t), WEFT_OK);
    return t;
}

static weft_tensor_t *index_tensor(int64_t k, const int64_t *v)
{
    weft_tensor_t *t = zeros(WEFT_I64, 1, &k);

    if (k > 0) {
        memcpy(weft_tensor_data(t), v, (size_t)k * sizeof(*v));
    }
    return t;
}

static void release_all(int n, weft_tensor_t **ts)
{
    for (int i = 0; i < n; i++) {
        weft_tensor_release(ts[i]);
    }
}

/* ---- gradients ------------------------------------------------------------------------------- */

typedef struct {
    int ndim;
    int64_t shape[WEFT_MAX_DIMS];
    int dims[WEFT_MAX_DIMS];
    int64_t sizes[WEFT_MAX_DIMS];
    int n;
    int dim;
    int pick; /* split: -1 concatenates the pieces reversed; else only that piece */
    weft_tensor_t *index;
} shape_arg_t;

static weft_status_t f_reshape(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    shape_arg_t *a = arg;
    weft_tensor_t *r = NULL;
    weft_status_t st;

    /* reshape then a copying op, so that the output owns its storage. */
    st = weft_op_reshape(in[0], a->ndim, a->shape, &r);
    if (st != WEFT_OK) {
        return st;
    }
    st = weft_op_transpose(r, 0, a->ndim - 1, out_p);
    weft_tensor_release(r);
    return st;
}

static weft_status_t f_transpose(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    shape_arg_t *a = arg;

    return weft_op_transpose(in[0], a->dims[0], a->dims[1], out_p);
}

static weft_status_t f_permute(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    shape_arg_t *a = arg;

    return weft_op_permute(in[0], a->dims, out_p);
}

static weft_status_t f_concat(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    shape_arg_t *a = arg;

    return weft_op_concat(a->n, in, a->dim, out_p);
}

/* The pieces of split or chunk, reversed and concatenated (or one picked). */
static weft_status_t pieces_out(int n, weft_tensor_t **p, shape_arg_t *a, weft_tensor_t **out_p)
{
    weft_tensor_t *rev[WEFT_MAX_DIMS] = {NULL};
    weft_status_t st;

    if (a->pick >= 0) {
        *out_p = weft_tensor_retain(p[a->pick]);
        release_all(n, p);
        return WEFT_OK;
    }
    for (int i = 0; i < n; i++) {
        rev[i] = p[n - 1 - i];
    }
    st = weft_op_concat(n, rev, a->dim, out_p);
    release_all(n, p);
    return st;
}

static weft_status_t f_split(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    shape_arg_t *a = arg;
    weft_tensor_t *p[WEFT_MAX_DIMS];
    weft_status_t st = weft_op_split(in[0], a->n, a->sizes, a->dim, p);

    if (st != WEFT_OK) {
        return st;
    }
    return pieces_out(a->n, p, a, out_p);
}

static weft_status_t f_chunk(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    shape_arg_t *a = arg;
    weft_tensor_t *p[WEFT_MAX_DIMS];
    int n = 0;
    weft_status_t st = weft_op_chunk(in[0], a->n, a->dim, p, &n);

    if (st != WEFT_OK) {
        return st;
    }
    return pieces_out(n, p, a, out_p);
}

static weft_status_t f_index_select(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    shape_arg_t *a = arg;

    return weft_op_index_select(in[0], a->dim, a->index, out_p);
}

TestSuite(shape, .init = use_counting);

Test(shape, reshape_grad)
{
    const int64_t s[] = {2, 3, 4};
    shape_arg_t a = {.ndim = 2, .shape = {4, -1}};
    weft_tensor_t *x;
    weft_rng_t rng;

    weft_rng_init(&rng, 21, 0);
    x = gc_rand(&rng, 3, s, -1, 1, 1);
    gradcheck("reshape", f_reshape, &a, 1, &x, &rng);
    weft_tensor_release(x);
    check_balanced();
}

Test(shape, transpose_permute_grad)
{
    const int64_t s[] = {2, 3, 4, 5};
    shape_arg_t t = {.dims = {1, -1}};
    shape_arg_t p = {.dims = {2, 0, 3, 1}};
    weft_tensor_t *x;
    weft_rng_t rng;

    weft_rng_init(&rng, 22, 0);
    x = gc_rand(&rng, 4, s, -1, 1, 1);
    gradcheck("transpose", f_transpose, &t, 1, &x, &rng);
    gradcheck("permute", f_permute, &p, 1, &x, &rng);
    weft_tensor_release(x);
    check_balanced();
}

Test(shape, concat_grad)
{
    const int64_t s0[] = {2, 1, 3};
    const int64_t s1[] = {2, 4, 3};
    const int64_t s2[] = {2, 2, 3};
    shape_arg_t a = {.n = 3, .dim = 1};
    weft_tensor_t *x[3];
    weft_rng_t rng;

    weft_rng_init(&rng, 23, 0);
    x[0] = gc_rand(&rng, 3, s0, -1, 1, 1);
    x[1] = gc_rand(&rng, 3, s1, -1, 1, 1);
    x[2] = gc_rand(&rng, 3, s2, -1, 1, 1);
    gradcheck("concat", f_concat, &a, 3, x, &rng);
    /* The middle one constant. */
    cr_assert_eq(weft_tensor_set_requires_grad(x[1], 0), WEFT_OK);
    gradcheck("concat, middle constant", f_concat, &a, 3, x, &rng);
    release_all(3, x);
    check_balanced();
}

Test(shape, concat_many_grad)
{
    /* More inputs than a node keeps inline. */
    const int64_t s[] = {1, 2};
    shape_arg_t a = {.n = 11, .dim = 0};
    weft_tensor_t *x[11];
    weft_rng_t rng;

    weft_rng_init(&rng, 24, 0);
    for (int i = 0; i < 11; i++) {
        x[i] = gc_rand(&rng, 2, s, -1, 1, 1);
    }
    gradcheck("concat of 11", f_concat, &a, 11, x, &rng);
    release_all(11, x);
    check_balanced();
}

Test(shape, split_chunk_grad)
{
    const int64_t s[] = {3, 7};
    shape_arg_t sp = {.n = 3, .sizes = {2, 0, 5}, .dim = 1, .pick = -1};
    shape_arg_t sp1 = {.n = 3, .sizes = {2, 4, 1}, .dim = -1, .pick = 1};
    shape_arg_t ch = {.n = 3, .dim = 1, .pick = -1}; /* 7 in chunks of 3, 3, 1 */
    shape_arg_t ch0 = {.n = 2, .dim = 0, .pick = 0}; /* 3 in chunks of 2, 1 */
    weft_tensor_t *x;
    weft_rng_t rng;

    weft_rng_init(&rng, 25, 0);
    x = gc_rand(&rng, 2, s, -1, 1, 1);
    gradcheck("split", f_split, &sp, 1, &x, &rng);
    gradcheck("split, one piece used", f_split, &sp1, 1, &x, &rng);
    gradcheck("chunk uneven", f_chunk, &ch, 1, &x, &rng);
    gradcheck("chunk, one piece used", f_chunk, &ch0, 1, &x, &rng);
    weft_tensor_release(x);
    check_balanced();
}

Test(shape, index_select_grad)
{
    const int64_t s[] = {3, 5, 2};
    const int64_t idx[] = {4, 0, 4, 4, 2};
    shape_arg_t a = {.dim = 1};
    weft_tensor_t *x;
    weft_rng_t rng;

    weft_rng_init(&rng, 26, 0);
    x = gc_rand(&rng, 3, s, -1, 1, 1);
    a.index = index_tensor(5, idx);
    gradcheck("index_select", f_index_select, &a, 1, &x, &rng);
    weft_tensor_release(a.index);
    a.index = index_tensor(4, (const int64_t[]){1, 1, 0, 2});
    a.dim = 0;
    gradcheck("index_select dim 0", f_index_select, &a, 1, &x, &rng);
    weft_tensor_release(a.index);
    a.index = index_tensor(3, (const int64_t[]){1, 1, 0});
    a.dim = -1;
    gradcheck("index_select last dim", f_index_select, &a, 1, &x, &rng);
    weft_tensor_release(a.index);
    a.index = index_tensor(0, (const int64_t[]){0});
    gradcheck("index_select, no indices", f_index_select, &a, 1, &x, &rng);
    weft_tensor_release(a.index);
    weft_tensor_release(x);
    check_balanced();
}

/* ---- forward values against torch ------------------------------------------------------------ */

#define N_OF(a) (sizeof(a) / sizeof((a)[0]))

Test(shape, reshape_matches_torch)
{
    for (size_t c = 0; c < N_OF(reshape_cases); c++) {
        const reshape_case_t *rc = &reshape_cases[c];
        weft_tensor_t *x = from_tt(&rc->in, WEFT_F64);
        weft_tensor_t *out = NULL;

        cr_assert_eq(weft_op_reshape(x, rc->ndim, rc->shape, &out), WEFT_OK, "%s",
                     weft_last_error());
        expect_tt(out, &rc->out, "reshape", (int)c);
        weft_tensor_release(out);
        weft_tensor_release(x);
    }
    check_balanced();
}

Test(shape, reshape_shares_storage)
{
    const int64_t s[] = {2, 6};
    const int64_t ns[] = {3, -1, 2};
    weft_tensor_t *x = zeros(WEFT_F32, 2, s);
    weft_tensor_t *out = NULL;

    cr_assert_eq(weft_tensor_set_requires_grad(x, 1), WEFT_OK);
    cr_assert_eq(weft_op_reshape(x, 3, ns, &out), WEFT_OK);
    cr_assert_eq(weft_tensor_data(out), weft_tensor_data(x));
    cr_assert_eq(weft_tensor_shape(out)[1], 2);
    cr_assert_str_eq(weft_tensor_grad_fn_name(out), "ReshapeBackward");
    /* A write through the view shows in the input. */
    ((float *)weft_tensor_data(out))[7] = 3.5f;
    cr_assert_eq(((float *)weft_tensor_data(x))[7], 3.5f);
    weft_tensor_release(x);
    /* The view keeps the storage alive. */
    cr_assert_eq(((float *)weft_tensor_data(out))[7], 3.5f);
    weft_tensor_release(out);
    check_balanced();
}

Test(shape, transpose_permute_match_torch)
{
    for (size_t c = 0; c < N_OF(transpose_cases); c++) {
        const transpose_case_t *tc = &transpose_cases[c];

        for (int d = 0; d < 2; d++) {
            weft_tensor_t *x = from_tt(&tc->in, d == 0 ? WEFT_F64 : WEFT_F32);
            weft_tensor_t *out = NULL;

            cr_assert_eq(weft_op_transpose(x, tc->dim0, tc->dim1, &out), WEFT_OK, "%s",
                         weft_last_error());
            expect_tt(out, &tc->out, "transpose", (int)c);
            weft_tensor_release(out);
            weft_tensor_release(x);
        }
    }
    for (size_t c = 0; c < N_OF(permute_cases); c++) {
        const permute_case_t *pc = &permute_cases[c];
        weft_tensor_t *x = from_tt(&pc->in, WEFT_F64);
        weft_tensor_t *out = NULL;

        cr_assert_eq(weft_op_permute(x, pc->perm, &out), WEFT_OK, "%s", weft_last_error());
        expect_tt(out, &pc->out, "permute", (int)c);
        weft_tensor_release(out);
        weft_tensor_release(x);
    }
    check_balanced();
}

Test(shape, concat_split_chunk_match_torch)
{
    for (size_t c = 0; c < N_OF(concat_cases); c++) {
        const concat_case_t *cc = &concat_cases[c];
        weft_tensor_t *x[3];
        weft_tensor_t *out = NULL;

        for (int i = 0; i < cc->n; i++) {
            x[i] = from_tt(&cc->in[i], WEFT_F32);
        }
        cr_assert_eq(weft_op_concat(cc->n, x, cc->dim, &out), WEFT_OK, "%s", weft_last_error());
        expect_tt(out, &cc->out, "concat", (int)c);
        weft_tensor_release(out);
        release_all(cc->n, x);
    }
    for (size_t c = 0; c < N_OF(split_cases); c++) {
        const split_case_t *sc = &split_cases[c];
        weft_tensor_t *x = from_tt(&sc->in, WEFT_F64);
        weft_tensor_t *p[8];

        cr_assert_eq(weft_op_split(x, sc->n, sc->sizes, sc->dim, p), WEFT_OK, "%s",
                     weft_last_error());
        for (int i = 0; i < sc->n; i++) {
            expect_tt(p[i], &sc->out[i], "split", (int)c);
        }
        release_all(sc->n, p);
        weft_tensor_release(x);
    }
    for (size_t c = 0; c < N_OF(chunk_cases); c++) {
        const chunk_case_t *cc = &chunk_cases[c];
        weft_tensor_t *x = from_tt(&cc->in, WEFT_F64);
        weft_tensor_t *p[8];
        int n = -1;

        cr_assert_eq(weft_op_chunk(x, cc->chunks, cc->dim, p, &n), WEFT_OK, "%s",
                     weft_last_error());
        cr_assert_eq(n, cc->n, "chunk %zu: %d pieces, torch %d", c, n, cc->n);
        for (int i = 0; i < n; i++) {
            expect_tt(p[i], &cc->out[i], "chunk", (int)c);
        }
        release_all(n, p);
        weft_tensor_release(x);
    }
    check_balanced();
}

Test(shape, index_select_matches_torch)
{
    for (size_t c = 0; c < N_OF(index_select_cases); c++) {
        const index_select_case_t *ic = &index_select_cases[c];
        weft_tensor_t *x = from_tt(&ic->in, WEFT_F64);
        weft_tensor_t *idx = index_tensor(ic->k, ic->index);
        weft_tensor_t *out = NULL;

        cr_assert_eq(weft_op_index_select(x, ic->dim, idx, &out), WEFT_OK, "%s", weft_last_error());
        expect_tt(out, &ic->out, "index_select", (int)c);
        weft_tensor_release(out);
        weft_tensor_release(idx);
        weft_tensor_release(x);
    }
    check_balanced();
}

/* ---- the permute kernel against a naive copy ------------------------------------------------- */

/* Every permutation of a 4-D shape (with a size-1 dim and sizes past a tile), each dtype size. */
Test(shape, permute_every_perm_every_size)
{
    const int64_t shapes[][4] = {{3, 5, 37, 33}, {2, 1, 40, 3}, {1, 70, 1, 35}};
    const weft_dtype_t dts[] = {WEFT_U8, WEFT_BF16, WEFT_I32, WEFT_I64};

    for (size_t si = 0; si < N_OF(shapes); si++) {
        const int64_t *s = shapes[si];

        for (size_t di = 0; di < N_OF(dts); di++) {
            size_t es = weft_dtype_size(dts[di]);
            weft_tensor_t *x = zeros(dts[di], 4, s);
            int64_t numel = weft_tensor_numel(x);
            unsigned char *xd = weft_tensor_data(x);

            for (int64_t i = 0; i < numel * (int64_t)es; i++) {
                xd[i] = (unsigned char)(i * 7 + i / 251);
            }
            for (int p = 0; p < 24; p++) {
                int perm[4];
                int rest[4] = {0, 1, 2, 3};
                int code = p;
                int64_t st[4] = {s[1] * s[2] * s[3], s[2] * s[3], s[3], 1};
                weft_tensor_t *out = NULL;
                const unsigned char *od;
                int64_t o = 0;

                /* The p-th permutation (factorial number system). */
                for (int i = 0, left = 4; i < 4; i++, left--) {
                    int f = 1;
                    int pick;

                    for (int k = 2; k < left; k++) {
                        f *= k;
                    }
                    pick = code / f;
                    code %= f;
                    perm[i] = rest[pick];
                    memmove(&rest[pick], &rest[pick + 1], (size_t)(3 - pick) * sizeof(int));
                }
                cr_assert_eq(weft_op_permute(x, perm, &out), WEFT_OK, "%s", weft_last_error());
                od = weft_tensor_data(out);
                for (int64_t i0 = 0; i0 < s[perm[0]]; i0++) {
                    for (int64_t i1 = 0; i1 < s[perm[1]]; i1++) {
                        for (int64_t i2 = 0; i2 < s[perm[2]]; i2++) {
                            for (int64_t i3 = 0; i3 < s[perm[3]]; i3++, o++) {
                                int64_t in = i0 * st[perm[0]] + i1 * st[perm[1]] +
                                             i2 * st[perm[2]] + i3 * st[perm[3]];

                                cr_assert_eq(memcmp(od + (size_t)o * es, xd + (size_t)in * es, es),
                                             0, "shape %zu dtype %s perm %d %d %d %d at %lld", si,
                                             weft_dtype_name(dts[di]), perm[0], perm[1], perm[2],
                                             perm[3], (long long)o);
                            }
                        }
                    }
                }
                weft_tensor_release(out);
            }
            weft_tensor_release(x);
        }
    }
    check_balanced();
}

Test(shape, index_types_and_empty)
{
    /* The copies work on any dtype; empty tensors go through. */
    const int64_t s[] = {4, 0, 3};
    const int64_t s2[] = {3, 2};
    weft_tensor_t *e = zeros(WEFT_F32, 3, s);
    weft_tensor_t *ints = zeros(WEFT_I64, 2, s2);
    weft_tensor_t *idx = index_tensor(2, (const int64_t[]){2, 0});
    weft_tensor_t *out = NULL;

    cr_assert_eq(weft_op_transpose(e, 0, 2, &out), WEFT_OK);
    cr_assert_eq(weft_tensor_shape(out)[0], 3);
    cr_assert_eq(weft_tensor_numel(out), 0);
    weft_tensor_release(out);
    for (int i = 0; i < 6; i++) {
        ((int64_t *)weft_tensor_data(ints))[i] = 10 + i;
    }
    cr_assert_eq(weft_op_index_select(ints, 0, idx, &out), WEFT_OK);
    cr_assert_eq(((int64_t *)weft_tensor_data(out))[0], 14);
    cr_assert_eq(((int64_t *)weft_tensor_data(out))[3], 11);
    weft_tensor_release(out);
    weft_tensor_release(idx);
    weft_tensor_release(ints);
    weft_tensor_release(e);
    check_balanced();
}

/* ---- errors ---------------------------------------------------------------------------------- */

Test(shape, errors)
{
    const int64_t s23[] = {2, 3};
    const int64_t s24[] = {2, 4};
    const int64_t bad[] = {4, 2};
    const int64_t two_inferred[] = {-1, 3, -1};
    const int64_t neg[] = {-2, 3};
    weft_tensor_t *a = zeros(WEFT_F64, 2, s23);
    weft_tensor_t *b = zeros(WEFT_F64, 2, s24);
    weft_tensor_t *f = zeros(WEFT_F32, 2, s23);
    weft_tensor_t *idx_bad = index_tensor(3, (const int64_t[]){0, 5, 1});
    weft_tensor_t *idx_neg = index_tensor(2, (const int64_t[]){1, -1});
    weft_tensor_t *idx_i32 = zeros(WEFT_I32, 1, (const int64_t[]){2});
    weft_tensor_t *p[4] = {NULL, NULL, NULL, NULL};
    weft_tensor_t *out = NULL;
    int n = 0;

    expect_error(weft_op_reshape(a, 2, bad, &out), WEFT_ERR_SHAPE, "[4, 2] (8 elements)");
    expect_error(weft_op_reshape(a, 3, two_inferred, &out), WEFT_ERR_INVALID_ARG,
                 "more than one -1");
    expect_error(weft_op_reshape(a, 2, neg, &out), WEFT_ERR_INVALID_ARG, "negative size -2");
    expect_error(weft_op_reshape(a, 2, (const int64_t[]){4, -1}, &out), WEFT_ERR_SHAPE, "[4, -1]");

    expect_error(weft_op_transpose(a, 0, 2, &out), WEFT_ERR_INVALID_ARG, "dim 2 is out of range");
    expect_error(weft_op_permute(a, (const int[]){0, 0}, &out), WEFT_ERR_INVALID_ARG,
                 "appears twice");
    expect_error(weft_op_permute(a, (const int[]){0, -3}, &out), WEFT_ERR_INVALID_ARG,
                 "dim -3 is out of range");

    expect_error(weft_op_concat(2, (weft_tensor_t *[]){a, b}, 0, &out), WEFT_ERR_SHAPE,
                 "tensor 1 has shape [2, 4], tensor 0 has shape [2, 3]");
    expect_error(weft_op_concat(2, (weft_tensor_t *[]){a, f}, 0, &out), WEFT_ERR_DTYPE, "f32");
    expect_error(weft_op_concat(0, (weft_tensor_t *[]){a}, 0, &out), WEFT_ERR_INVALID_ARG,
                 "at least one");
    expect_error(weft_op_concat(2, (weft_tensor_t *[]){a, a}, 2, &out), WEFT_ERR_INVALID_ARG,
                 "dim 2");

    expect_error(weft_op_split(a, 2, (const int64_t[]){1, 1}, 1, p), WEFT_ERR_INVALID_ARG,
                 "sizes sum to 2, but dim 1 of shape [2, 3] has size 3");
    expect_error(weft_op_split(a, 2, (const int64_t[]){4, -1}, 1, p), WEFT_ERR_INVALID_ARG,
                 "negative");
    expect_error(weft_op_chunk(a, 0, 0, p, &n), WEFT_ERR_INVALID_ARG, "0 chunks");
    cr_assert_null(p[0]);

    expect_error(weft_op_index_select(a, 1, idx_bad, &out), WEFT_ERR_INVALID_ARG,
                 "index 5 at position 1 is out of range for dim 1 of size 3");
    expect_error(weft_op_index_select(a, 0, idx_neg, &out), WEFT_ERR_INVALID_ARG,
                 "index -1 at position 1");
    expect_error(weft_op_index_select(a, 0, idx_i32, &out), WEFT_ERR_DTYPE, "i64, got i32");
    expect_error(weft_op_index_select(a, 2, idx_neg, &out), WEFT_ERR_INVALID_ARG, "dim 2");
    cr_assert_null(out);

    weft_tensor_release(a);
    weft_tensor_release(b);
    weft_tensor_release(f);
    weft_tensor_release(idx_bad);
    weft_tensor_release(idx_neg);
    weft_tensor_release(idx_i32);
    check_balanced();
}
