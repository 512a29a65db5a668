/*
 * autograd: elementwise operations (binary with broadcasting, scalar and unary maps, dropout):
 * gradients against central differences, forward values against torch (data/, made by
 * data/gen_ops_elementwise.py), f32 against f64, and the errors.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "data/ops_elementwise_table.h"
#include "gradcheck.h"

#include <weft/weft.h>

typedef weft_status_t (*binop_t)(weft_tensor_t *, weft_tensor_t *, weft_tensor_t **);
typedef weft_status_t (*unop_t)(weft_tensor_t *, weft_tensor_t **);
typedef weft_status_t (*scalarop_t)(weft_tensor_t *, double, weft_tensor_t **);

/* ---- helpers --------------------------------------------------------------------------------- */

static weft_tensor_t *make(weft_dtype_t dt, int ndim, const int64_t *shape, const double *v)
{
    weft_tensor_t *t = NULL;

    cr_assert_eq(weft_tensor_empty(dt, ndim, shape, &t), WEFT_OK, "%s", weft_last_error());
    for (int64_t i = 0; i < weft_tensor_numel(t); i++) {
        if (dt == WEFT_F32) {
            ((float *)weft_tensor_data(t))[i] = (float)v[i];
        } else {
            ((double *)weft_tensor_data(t))[i] = v[i];
        }
    }
    return t;
}

static double at(const weft_tensor_t *t, int64_t i)
{
    if (weft_tensor_dtype(t) == WEFT_F32) {
        return ((const float *)weft_tensor_data(t))[i];
    }
    return ((const double *)weft_tensor_data(t))[i];
}

/* Rounds every element of an f64 tensor to the nearest f32, so that f32 copies are exact. */
static void round_to_f32(weft_tensor_t *t)
{
    double *d = weft_tensor_data(t);

    for (int64_t i = 0; i < weft_tensor_numel(t); i++) {
        d[i] = (float)d[i];
    }
}

/* Moves elements at least @p gap away from 0 (for relu, whose derivative jumps there). */
static void away_from_zero(weft_tensor_t *t, double gap)
{
    double *d = weft_tensor_data(t);

    for (int64_t i = 0; i < weft_tensor_numel(t); i++) {
        d[i] += d[i] < 0 ? -gap : gap;
    }
}

/* @p t (either dtype) against @p want: |got - want| <= tol * max(1, |want|). */
static void expect_values(const char *what, const weft_tensor_t *t, int64_t n, const double *want64,
                          const float *want32, double tol)
{
    cr_assert_eq(weft_tensor_numel(t), n, "%s: %lld elements, want %lld", what,
                 (long long)weft_tensor_numel(t), (long long)n);
    for (int64_t i = 0; i < n; i++) {
        double want = want32 != NULL ? (double)want32[i] : want64[i];
        double got = at(t, i);

        cr_assert(fabs(got - want) <= tol * fmax(1.0, fabs(want)),
                  "%s (%s) element %lld: got %.17g want %.17g", what,
                  weft_dtype_name(weft_tensor_dtype(t)), (long long)i, got, want);
    }
}

/* f32 result against the f64 one: within 1e-5 relative (1e-30 absolute for exact zeros). */
static void expect_f32_matches_f64(const char *what, const weft_tensor_t *t32,
                                   const weft_tensor_t *t64)
{
    cr_assert_eq(weft_tensor_dtype(t32), WEFT_F32);
    cr_assert_eq(weft_tensor_dtype(t64), WEFT_F64);
    cr_assert_eq(weft_tensor_ndim(t32), weft_tensor_ndim(t64));
    cr_assert_eq(weft_tensor_numel(t32), weft_tensor_numel(t64));
    for (int64_t i = 0; i < weft_tensor_numel(t64); i++) {
        double a = at(t32, i);
        double b = at(t64, i);

        cr_assert(fabs(a - b) <= 1e-5 * fabs(b) + 1e-30, "%s element %lld: f32 %.9g f64 %.17g",
                  what, (long long)i, a, b);
    }
}

static void expect_error(weft_status_t got, weft_status_t want, const char *needle)
{
    cr_assert_eq(got, want, "status %s, want %s (%s)", weft_strerror(got), weft_strerror(want),
                 weft_last_error());
    cr_assert(strstr(weft_last_error(), needle) != NULL, "error text \"%s\" lacks \"%s\"",
              weft_last_error(), needle);
}

/* ---- gradient checks ------------------------------------------------------------------------- */

typedef struct {
    binop_t f;
} binarg_t;

static weft_status_t gc_binary(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    return ((binarg_t *)arg)->f(in[0], in[1], out_p);
}

typedef struct {
    unop_t f;
} unarg_t;

static weft_status_t gc_unary(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    return ((unarg_t *)arg)->f(in[0], out_p);
}

typedef struct {
    scalarop_t f;
    double s;
} scalararg_t;

static weft_status_t gc_scalar(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    return ((scalararg_t *)arg)->f(in[0], ((scalararg_t *)arg)->s, out_p);
}

/* Gradient check of a binary op on fresh inputs of the given shapes and ranges. */
static void gc_bin(const char *name, binop_t f, int na, const int64_t *sa, double alo, double ahi,
                   int nb, const int64_t *sb, double blo, double bhi, uint64_t seed)
{
    weft_rng_t rng;
    binarg_t arg = {f};

    weft_rng_init(&rng, seed, 0);
    weft_tensor_t *a = gc_rand(&rng, na, sa, alo, ahi, 1);
    weft_tensor_t *b = gc_rand(&rng, nb, sb, blo, bhi, 1);
    gradcheck(name, gc_binary, &arg, 2, (weft_tensor_t *[]){a, b}, &rng);
    /* Only one side requiring grad takes the other paths through the backward. */
    cr_assert_eq(weft_tensor_set_requires_grad(b, 0), WEFT_OK);
    gradcheck(name, gc_binary, &arg, 2, (weft_tensor_t *[]){a, b}, &rng);
    cr_assert_eq(weft_tensor_set_requires_grad(b, 1), WEFT_OK);
    cr_assert_eq(weft_tensor_set_requires_grad(a, 0), WEFT_OK);
    gradcheck(name, gc_binary, &arg, 2, (weft_tensor_t *[]){a, b}, &rng);
    weft_tensor_release(a);
    weft_tensor_release(b);
}

TestSuite(ops_elementwise, .timeout = 60);

Test(ops_elementwise, grad_binary_broadcast)
{
    const int64_t s314[] = {3, 1, 4};
    const int64_t s24[] = {2, 4};
    const int64_t s23[] = {2, 3};
    const int64_t s5[] = {5};
    const int64_t s1[] = {1};
    const int64_t s41[] = {4, 1};
    const int64_t s15[] = {1, 5};
    const binop_t ops[] = {weft_op_add, weft_op_sub, weft_op_mul};
    const char *names[] = {"add", "sub", "mul"};

    for (int k = 0; k < 3; k++) {
        gc_bin(names[k], ops[k], 3, s314, -2, 2, 2, s24, -2, 2, 100 + (uint64_t)k);
        gc_bin(names[k], ops[k], 2, s24, -2, 2, 3, s314, -2, 2, 110 + (uint64_t)k);
        gc_bin(names[k], ops[k], 2, s23, -2, 2, 2, s23, -2, 2, 120 + (uint64_t)k);
        gc_bin(names[k], ops[k], 1, s5, -2, 2, 1, s1, -2, 2, 130 + (uint64_t)k);
        gc_bin(names[k], ops[k], 2, s23, -2, 2, 0, NULL, -2, 2, 140 + (uint64_t)k);
        gc_bin(names[k], ops[k], 2, s41, -2, 2, 2, s15, -2, 2, 150 + (uint64_t)k);
    }
    /* div away from b == 0; pow on a > 0 (the exponent may be anything). */
    gc_bin("div", weft_op_div, 3, s314, -2, 2, 2, s24, 0.5, 2, 200);
    gc_bin("div", weft_op_div, 1, s1, -2, 2, 2, s23, 0.5, 2, 201);
    gc_bin("div", weft_op_div, 2, s41, -2, 2, 2, s15, -2, -0.5, 202);
    gc_bin("pow", weft_op_pow, 3, s314, 0.5, 2, 2, s24, -2, 2, 210);
    gc_bin("pow", weft_op_pow, 2, s23, 0.5, 2, 0, NULL, -2, 2, 211);
    gc_bin("pow", weft_op_pow, 2, s41, 0.5, 2, 2, s15, -2, 2, 212);
}

/* The same tensor on both sides: both gradients accumulate into it. */
static weft_status_t gc_self(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    return ((binarg_t *)arg)->f(in[0], in[0], out_p);
}

Test(ops_elementwise, grad_shared_input)
{
    const int64_t s[] = {2, 3};
    weft_rng_t rng;
    binarg_t mul = {weft_op_mul};
    binarg_t pow = {weft_op_pow};
    binarg_t div = {weft_op_div};

    weft_rng_init(&rng, 7, 0);
    weft_tensor_t *a = gc_rand(&rng, 2, s, 0.5, 2, 1);
    gradcheck("mul(a, a)", gc_self, &mul, 1, &a, &rng);
    gradcheck("pow(a, a)", gc_self, &pow, 1, &a, &rng);
    gradcheck("div(a, a)", gc_self, &div, 1, &a, &rng);
    weft_tensor_release(a);
}

Test(ops_elementwise, grad_unary)
{
    const int64_t s[] = {3, 5};
    const unop_t ops[] = {weft_op_neg,     weft_op_relu, weft_op_gelu, weft_op_tanh,
                          weft_op_sigmoid, weft_op_exp,  weft_op_log};
    const char *names[] = {"neg", "relu", "gelu", "tanh", "sigmoid", "exp", "log"};
    weft_rng_t rng;

    weft_rng_init(&rng, 11, 0);
    for (int k = 0; k < 7; k++) {
        unarg_t arg = {ops[k]};
        weft_tensor_t *a =
            ops[k] == weft_op_log ? gc_rand(&rng, 2, s, 0.2, 3, 1) : gc_rand(&rng, 2, s, -3, 3, 1);

        if (ops[k] == weft_op_relu) {
            away_from_zero(a, 0.05);
        }
        gradcheck(names[k], gc_unary, &arg, 1, &a, &rng);
        weft_tensor_release(a);
    }
}

Test(ops_elementwise, grad_scalar_ops)
{
    const int64_t s[] = {4, 3};
    const struct {
        const char *name;
        scalarop_t f;
        double s;
        double lo;
        double hi;
    } cases[] = {
        {"add_scalar", weft_op_add_scalar, 0.7, -2, 2},
        {"mul_scalar", weft_op_mul_scalar, -1.3, -2, 2},
        {"pow_scalar 2.5", weft_op_pow_scalar, 2.5, 0.2, 2},
        {"pow_scalar 2", weft_op_pow_scalar, 2, -2, 2},
        {"pow_scalar 3", weft_op_pow_scalar, 3, -2, 2},
        {"pow_scalar 1", weft_op_pow_scalar, 1, -2, 2},
        {"pow_scalar 0", weft_op_pow_scalar, 0, -2, 2},
        {"pow_scalar -0.5", weft_op_pow_scalar, -0.5, 0.2, 2},
        {"pow_scalar 0.5", weft_op_pow_scalar, 0.5, 0.2, 2},
        {"pow_scalar -1", weft_op_pow_scalar, -1, 0.5, 2},
        {"pow_scalar -2", weft_op_pow_scalar, -2, 0.5, 2},
        {"pow_scalar -1.7", weft_op_pow_scalar, -1.7, 0.5, 2},
    };
    weft_rng_t rng;

    weft_rng_init(&rng, 13, 0);
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        scalararg_t arg = {cases[k].f, cases[k].s};
        weft_tensor_t *a = gc_rand(&rng, 2, s, cases[k].lo, cases[k].hi, 1);

        gradcheck(cases[k].name, gc_scalar, &arg, 1, &a, &rng);
        weft_tensor_release(a);
    }
}

typedef struct {
    double p;
    int training;
    uint64_t seed;
} droparg_t;

/* Dropout with the same mask on every call: the rng is reseeded each time. */
static weft_status_t gc_dropout(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    const droparg_t *d = arg;
    weft_rng_t rng;

    weft_rng_init(&rng, d->seed, 0);
    return weft_op_dropout(in[0], d->p, d->training, &rng, out_p);
}

Test(ops_elementwise, grad_dropout)
{
    const int64_t s[] = {6, 7};
    const droparg_t cases[] = {{0.4, 1, 5}, {0.0, 1, 5}, {1.0, 1, 5}, {0.4, 0, 5}};
    weft_rng_t rng;

    weft_rng_init(&rng, 17, 0);
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        weft_tensor_t *a = gc_rand(&rng, 2, s, -2, 2, 1);

        gradcheck("dropout", gc_dropout, (void *)&cases[k], 1, &a, &rng);
        weft_tensor_release(a);
    }
}

/* A small composed graph: tanh(a * b + c) / exp(c), c used twice. */
static weft_status_t gc_composed(weft_tensor_t *const *in, void *arg, weft_tensor_t **out_p)
{
    weft_tensor_t *ab = NULL;
    weft_tensor_t *s = NULL;
    weft_tensor_t *t = NULL;
    weft_tensor_t *e = NULL;
    weft_status_t st;

    (void)arg;
    st = weft_op_mul(in[0], in[1], &ab);
    if (st == WEFT_OK) {
        st = weft_op_add(ab, in[2], &s);
    }
    if (st == WEFT_OK) {
        st = weft_op_tanh(s, &t);
    }
    if (st == WEFT_OK) {
        st = weft_op_exp(in[2], &e);
    }
    if (st == WEFT_OK) {
        st = weft_op_div(t, e, out_p);
    }
    weft_tensor_release(ab);
    weft_tensor_release(s);
    weft_tensor_release(t);
    weft_tensor_release(e);
    return st;
}

Test(ops_elementwise, grad_composed)
{
    const int64_t s34[] = {3, 4};
    const int64_t s4[] = {4};
    const int64_t s31[] = {3, 1};
    weft_rng_t rng;

    weft_rng_init(&rng, 19, 0);
    weft_tensor_t *a = gc_rand(&rng, 2, s34, -1, 1, 1);
    weft_tensor_t *b = gc_rand(&rng, 1, s4, -1, 1, 1);
    weft_tensor_t *c = gc_rand(&rng, 2, s31, -1, 1, 1);
    gradcheck("composed", gc_composed, NULL, 3, (weft_tensor_t *[]){a, b, c}, &rng);
    weft_tensor_release(a);
    weft_tensor_release(b);
    weft_tensor_release(c);
}

/* ---- forward values against torch ------------------------------------------------------------ */

static void torch_binary(const char *name, binop_t f, int na, const int64_t *sa, const double *a,
                         int nb, const int64_t *sb, const double *b, int64_t n, const double *r64,
                         const float *r32)
{
    for (int k = 0; k < 2; k++) {
        weft_dtype_t dt = k == 0 ? WEFT_F64 : WEFT_F32;
        weft_tensor_t *ta = make(dt, na, sa, a);
        weft_tensor_t *tb = make(dt, nb, sb, b);
        weft_tensor_t *out = NULL;

        cr_assert_eq(f(ta, tb, &out), WEFT_OK, "%s: %s", name, weft_last_error());
        cr_assert_eq(weft_tensor_dtype(out), dt);
        expect_values(name, out, n, r64, dt == WEFT_F32 ? r32 : NULL,
                      dt == WEFT_F32 ? 1e-6 : 1e-13);
        weft_tensor_release(out);
        weft_tensor_release(ta);
        weft_tensor_release(tb);
    }
}

static void torch_unary(const char *name, unop_t f, scalarop_t fs, double s, int na,
                        const int64_t *sa, const double *a, int64_t n, const double *r64,
                        const float *r32)
{
    for (int k = 0; k < 2; k++) {
        weft_dtype_t dt = k == 0 ? WEFT_F64 : WEFT_F32;
        weft_tensor_t *ta = make(dt, na, sa, a);
        weft_tensor_t *out = NULL;

        cr_assert_eq(f != NULL ? f(ta, &out) : fs(ta, s, &out), WEFT_OK, "%s: %s", name,
                     weft_last_error());
        expect_values(name, out, n, r64, dt == WEFT_F32 ? r32 : NULL,
                      dt == WEFT_F32 ? 1e-6 : 1e-13);
        weft_tensor_release(out);
        weft_tensor_release(ta);
    }
}

#define TORCH_BIN(f, A, B, R)                                                                      \
    torch_binary(#R, f, A##_NDIM, A##_SHAPE, A, B##_NDIM, B##_SHAPE, B, R##_NUMEL, R##_F64, R##_F32)
#define TORCH_UN(f, A, R)                                                                          \
    torch_unary(#R, f, NULL, 0, A##_NDIM, A##_SHAPE, A, R##_NUMEL, R##_F64, R##_F32)
#define TORCH_SC(f, s, A, R)                                                                       \
    torch_unary(#R, NULL, f, s, A##_NDIM, A##_SHAPE, A, R##_NUMEL, R##_F64, R##_F32)

Test(ops_elementwise, torch_values)
{
    TORCH_BIN(weft_op_add, EW_X, EW_Y, EW_ADD);
    TORCH_BIN(weft_op_sub, EW_X, EW_Y, EW_SUB);
    TORCH_BIN(weft_op_mul, EW_X, EW_Y, EW_MUL);
    TORCH_BIN(weft_op_div, EW_X, EW_YP, EW_DIV);
    TORCH_BIN(weft_op_pow, EW_XP, EW_Y, EW_POW);
    TORCH_BIN(weft_op_mul, EW_X, EW_S, EW_MUL_S);
    TORCH_BIN(weft_op_sub, EW_C, EW_R, EW_SUB_CR);
    TORCH_SC(weft_op_add_scalar, 0.7, EW_U, EW_ADD_SCALAR);
    TORCH_SC(weft_op_mul_scalar, -1.3, EW_U, EW_MUL_SCALAR);
    TORCH_SC(weft_op_pow_scalar, 2.5, EW_UP, EW_POW_SCALAR_2_5);
    TORCH_SC(weft_op_pow_scalar, 2, EW_U, EW_POW_SCALAR_2);
    TORCH_SC(weft_op_pow_scalar, 3, EW_U, EW_POW_SCALAR_3);
    TORCH_SC(weft_op_pow_scalar, -0.5, EW_UP, EW_POW_SCALAR_M0_5);
    TORCH_SC(weft_op_pow_scalar, 0.5, EW_UP, EW_POW_SCALAR_0_5);
    TORCH_UN(weft_op_neg, EW_U, EW_NEG);
    TORCH_UN(weft_op_relu, EW_U, EW_RELU);
    TORCH_UN(weft_op_gelu, EW_U, EW_GELU);
    TORCH_UN(weft_op_tanh, EW_U, EW_TANH);
    TORCH_UN(weft_op_sigmoid, EW_U, EW_SIGMOID);
    TORCH_UN(weft_op_exp, EW_U, EW_EXP);
    TORCH_UN(weft_op_log, EW_UP, EW_LOG);
}

Test(ops_elementwise, broadcast_shapes)
{
    const int64_t s314[] = {3, 1, 4};
    const int64_t s24[] = {2, 4};
    const int64_t want[] = {3, 2, 4};
    weft_tensor_t *a = make(WEFT_F32, 3, s314, EW_X);
    weft_tensor_t *b = make(WEFT_F32, 2, s24, EW_Y);
    weft_tensor_t *out = NULL;

    cr_assert_eq(weft_op_add(a, b, &out), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(weft_tensor_ndim(out), 3);
    cr_assert_arr_eq(weft_tensor_shape(out), want, sizeof(want));
    weft_tensor_release(out);
    weft_tensor_release(a);
    weft_tensor_release(b);
}

/* ---- f32 against f64 ------------------------------------------------------------------------- */

Test(ops_elementwise, f32_matches_f64)
{
    const int64_t s[] = {7, 33};
    const int64_t srow[] = {33};
    const int64_t scol[] = {7, 1};
    const binop_t bops[] = {weft_op_add, weft_op_sub, weft_op_mul, weft_op_div, weft_op_pow};
    const unop_t uops[] = {weft_op_neg,     weft_op_relu, weft_op_gelu, weft_op_tanh,
                           weft_op_sigmoid, weft_op_exp,  weft_op_log};
    const scalarop_t sops[] = {weft_op_add_scalar, weft_op_mul_scalar, weft_op_pow_scalar,
                               weft_op_pow_scalar, weft_op_pow_scalar};
    const double svals[] = {0.3, -2.5, 2, 1.5, -0.5};
    weft_rng_t rng;

    weft_rng_init(&rng, 23, 0);
    weft_tensor_t *x = gc_rand(&rng, 2, s, -6, 6, 0);       /* any sign, wide for gelu/sigmoid */
    weft_tensor_t *p = gc_rand(&rng, 2, s, 0.1, 4, 0);      /* positive */
    weft_tensor_t *row = gc_rand(&rng, 1, srow, 0.5, 2, 0); /* positive, for div and pow */
    weft_tensor_t *col = gc_rand(&rng, 2, scol, -2, 2, 0);
    weft_tensor_t *ins[] = {x, p, row, col};
    weft_tensor_t *ins32[4];

    for (int k = 0; k < 4; k++) {
        round_to_f32(ins[k]);
        ins32[k] = make(WEFT_F32, weft_tensor_ndim(ins[k]), weft_tensor_shape(ins[k]),
                        weft_tensor_data(ins[k]));
    }
    for (int k = 0; k < 5; k++) {
        /* [7, 33] op [33] (row broadcasting) and positive [7, 33] op [7, 1] (columns). */
        const int la = k == 4 ? 1 : 0;
        const int pairs[2][2] = {{la, 2}, {1, 3}};

        for (int q = 0; q < 2; q++) {
            weft_tensor_t *o64 = NULL;
            weft_tensor_t *o32 = NULL;

            cr_assert_eq(bops[k](ins[pairs[q][0]], ins[pairs[q][1]], &o64), WEFT_OK);
            cr_assert_eq(bops[k](ins32[pairs[q][0]], ins32[pairs[q][1]], &o32), WEFT_OK);
            expect_f32_matches_f64("binary", o32, o64);
            weft_tensor_release(o64);
            weft_tensor_release(o32);
        }
    }
    for (int k = 0; k < 7; k++) {
        const int i = uops[k] == weft_op_log ? 1 : 0;
        weft_tensor_t *o64 = NULL;
        weft_tensor_t *o32 = NULL;

        cr_assert_eq(uops[k](ins[i], &o64), WEFT_OK);
        cr_assert_eq(uops[k](ins32[i], &o32), WEFT_OK);
        expect_f32_matches_f64("unary", o32, o64);
        weft_tensor_release(o64);
        weft_tensor_release(o32);
    }
    for (int k = 0; k < 5; k++) {
        weft_tensor_t *o64 = NULL;
        weft_tensor_t *o32 = NULL;

        cr_assert_eq(sops[k](ins[1], svals[k], &o64), WEFT_OK);
        cr_assert_eq(sops[k](ins32[1], svals[k], &o32), WEFT_OK);
        expect_f32_matches_f64("scalar", o32, o64);
        weft_tensor_release(o64);
        weft_tensor_release(o32);
    }
    for (int k = 0; k < 4; k++) {
        weft_tensor_release(ins[k]);
        weft_tensor_release(ins32[k]);
    }
}

/* f32 exp (a vectorised polynomial) at the edges of its range, against libm. */
Test(ops_elementwise, exp_f32_edges)
{
    const double v[] = {-INFINITY, INFINITY, NAN,  88.72, 88.73, -87.3, -103.0, -104.5,
                        0.0,       -0.0,     1e-7, -1e-7, 1.0,   10.5,  -20.25, 50.0};
    const int64_t n = sizeof(v) / sizeof(v[0]);
    weft_tensor_t *a = make(WEFT_F32, 1, &n, v);
    weft_tensor_t *out = NULL;

    cr_assert_eq(weft_op_exp(a, &out), WEFT_OK);
    for (int64_t i = 0; i < n; i++) {
        float got = ((const float *)weft_tensor_data(out))[i];
        float want = (float)exp((double)(float)v[i]);

        if (isnan(want)) {
            cr_assert(isnan(got), "exp(%g) = %g", v[i], got);
        } else if (isinf(want) || want == 0) {
            cr_assert_eq(got, want, "exp(%g) = %g, want %g", v[i], got, want);
        } else {
            /* Subnormal results are allowed an error of their last place. */
            cr_assert(fabsf(got - want) <= 3e-7f * want + 2e-45f, "exp(%g) = %.9g, want %.9g", v[i],
                      got, want);
        }
    }
    weft_tensor_release(out);
    weft_tensor_release(a);
}

/* ---- dropout --------------------------------------------------------------------------------- */

Test(ops_elementwise, dropout_fraction_and_seed)
{
    const int64_t n = 100000;
    weft_tensor_t *a = NULL;
    weft_tensor_t *o1 = NULL;
    weft_tensor_t *o2 = NULL;
    weft_tensor_t *o3 = NULL;
    weft_rng_t r1;
    weft_rng_t r2;
    weft_rng_t r3;
    int64_t zeros = 0;

    cr_assert_eq(weft_tensor_empty(WEFT_F32, 1, &n, &a), WEFT_OK);
    cr_assert_eq(weft_tensor_fill(a, 1.0), WEFT_OK);
    weft_rng_init(&r1, 99, 3);
    weft_rng_init(&r2, 99, 3);
    weft_rng_init(&r3, 100, 3);
    cr_assert_eq(weft_op_dropout(a, 0.3, 1, &r1, &o1), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(weft_op_dropout(a, 0.3, 1, &r2, &o2), WEFT_OK);
    cr_assert_eq(weft_op_dropout(a, 0.3, 1, &r3, &o3), WEFT_OK);
    cr_assert(weft_tensor_equal(o1, o2), "same seed, different masks");
    cr_assert_not(weft_tensor_equal(o1, o3), "different seeds, same mask");
    for (int64_t i = 0; i < n; i++) {
        float v = ((const float *)weft_tensor_data(o1))[i];

        if (v == 0) {
            zeros++;
        } else {
            cr_assert_eq(v, (float)(1 / 0.7), "kept element %lld is %.9g", (long long)i, v);
        }
    }
    cr_assert(fabs((double)zeros / (double)n - 0.3) < 0.01, "zero fraction %.4f",
              (double)zeros / (double)n);
    weft_tensor_release(o1);
    weft_tensor_release(o2);
    weft_tensor_release(o3);
    weft_tensor_release(a);
}

/* Elements are drawn in order: dropout's mask is u >= p for successive weft_rng_uniform draws. */
Test(ops_elementwise, dropout_element_order)
{
    const int64_t n = 50;
    weft_tensor_t *a = NULL;
    weft_tensor_t *out = NULL;
    weft_rng_t r;
    weft_rng_t ref;

    cr_assert_eq(weft_tensor_empty(WEFT_F64, 1, &n, &a), WEFT_OK);
    cr_assert_eq(weft_tensor_fill(a, 2.0), WEFT_OK);
    weft_rng_init(&r, 5, 1);
    ref = r;
    cr_assert_eq(weft_op_dropout(a, 0.5, 1, &r, &out), WEFT_OK);
    for (int64_t i = 0; i < n; i++) {
        double want = weft_rng_uniform(&ref) >= 0.5 ? 4.0 : 0.0;

        cr_assert_eq(((const double *)weft_tensor_data(out))[i], want, "element %lld",
                     (long long)i);
    }
    cr_assert_eq(memcmp(&r, &ref, sizeof(r)), 0, "dropout drew %s than one number per element",
                 "other");
    weft_tensor_release(out);
    weft_tensor_release(a);
}

Test(ops_elementwise, dropout_eval_and_edges)
{
    const int64_t n = 64;
    weft_tensor_t *a = NULL;
    weft_tensor_t *out = NULL;
    weft_rng_t r;

    weft_rng_init(&r, 1, 0);
    cr_assert_eq(weft_tensor_empty(WEFT_F32, 1, &n, &a), WEFT_OK);
    cr_assert_eq(weft_tensor_fill_uniform(a, -1, 1, &r), WEFT_OK);
    /* Not training: a copy, and no rng needed. */
    cr_assert_eq(weft_op_dropout(a, 0.5, 0, NULL, &out), WEFT_OK, "%s", weft_last_error());
    cr_assert(weft_tensor_equal(a, out));
    cr_assert_neq(weft_tensor_data(a), weft_tensor_data(out));
    weft_tensor_release(out);
    cr_assert_eq(weft_op_dropout(a, 0.0, 1, &r, &out), WEFT_OK);
    cr_assert(weft_tensor_equal(a, out));
    weft_tensor_release(out);
    cr_assert_eq(weft_op_dropout(a, 1.0, 1, &r, &out), WEFT_OK);
    for (int64_t i = 0; i < n; i++) {
        cr_assert_eq(((const float *)weft_tensor_data(out))[i], 0.0f);
    }
    weft_tensor_release(out);
    weft_tensor_release(a);
}

/* ---- recording ------------------------------------------------------------------------------- */

Test(ops_elementwise, records_only_when_needed)
{
    const int64_t s[] = {2, 2};
    weft_rng_t rng;
    weft_tensor_t *out = NULL;

    weft_rng_init(&rng, 29, 0);
    weft_tensor_t *a = gc_rand(&rng, 2, s, -1, 1, 1);
    weft_tensor_t *b = gc_rand(&rng, 2, s, -1, 1, 0);

    cr_assert_eq(weft_op_mul(a, b, &out), WEFT_OK);
    cr_assert(weft_tensor_requires_grad(out));
    cr_assert_str_eq(weft_tensor_grad_fn_name(out), "MulBackward");
    weft_tensor_release(out);
    cr_assert_eq(weft_op_gelu(b, &out), WEFT_OK);
    cr_assert_not(weft_tensor_requires_grad(out));
    cr_assert(weft_tensor_is_leaf(out));
    weft_tensor_release(out);
    int prev = weft_grad_set_enabled(0);
    cr_assert_eq(weft_op_sigmoid(a, &out), WEFT_OK);
    weft_grad_set_enabled(prev);
    cr_assert_not(weft_tensor_requires_grad(out));
    weft_tensor_release(out);
    weft_tensor_release(a);
    weft_tensor_release(b);
}

/* ---- errors ---------------------------------------------------------------------------------- */

Test(ops_elementwise, errors)
{
    const int64_t s23[] = {2, 3};
    const int64_t s4[] = {4};
    const int64_t s6[] = {6};
    weft_tensor_t *a = NULL;
    weft_tensor_t *b = NULL;
    weft_tensor_t *a64 = NULL;
    weft_tensor_t *ints = NULL;
    weft_tensor_t *out = NULL;
    weft_rng_t rng;

    weft_rng_init(&rng, 1, 0);
    cr_assert_eq(weft_tensor_create(WEFT_F32, 2, s23, &a), WEFT_OK);
    cr_assert_eq(weft_tensor_create(WEFT_F32, 1, s4, &b), WEFT_OK);
    cr_assert_eq(weft_tensor_create(WEFT_F64, 2, s23, &a64), WEFT_OK);
    cr_assert_eq(weft_tensor_create(WEFT_I64, 1, s6, &ints), WEFT_OK);

    expect_error(weft_op_add(a, b, &out), WEFT_ERR_SHAPE,
                 "add: shapes [2, 3] and [4] do not broadcast");
    expect_error(weft_op_pow(b, a, &out), WEFT_ERR_SHAPE,
                 "pow: shapes [4] and [2, 3] do not broadcast");
    expect_error(weft_op_mul(a, a64, &out), WEFT_ERR_DTYPE, "f32 and f64");
    expect_error(weft_op_div(a64, a, &out), WEFT_ERR_DTYPE, "div: dtypes f64 and f32");
    expect_error(weft_op_sub(ints, ints, &out), WEFT_ERR_DTYPE, "i64");
    expect_error(weft_op_exp(ints, &out), WEFT_ERR_DTYPE, "exp: dtype i64");
    expect_error(weft_op_add(NULL, a, &out), WEFT_ERR_INVALID_ARG, "add: NULL");
    expect_error(weft_op_add(a, NULL, &out), WEFT_ERR_INVALID_ARG, "add: NULL");
    expect_error(weft_op_relu(a, NULL), WEFT_ERR_INVALID_ARG, "relu: NULL output");
    expect_error(weft_op_mul_scalar(NULL, 2, &out), WEFT_ERR_INVALID_ARG, "mul_scalar: NULL");
    expect_error(weft_op_dropout(a, -0.1, 1, &rng, &out), WEFT_ERR_INVALID_ARG,
                 "dropout: p = -0.1 is outside [0, 1]");
    expect_error(weft_op_dropout(a, 1.5, 1, &rng, &out), WEFT_ERR_INVALID_ARG, "outside [0, 1]");
    expect_error(weft_op_dropout(a, NAN, 0, &rng, &out), WEFT_ERR_INVALID_ARG, "outside [0, 1]");
    expect_error(weft_op_dropout(a, 0.5, 1, NULL, &out), WEFT_ERR_INVALID_ARG, "NULL rng");
    expect_error(weft_op_dropout(ints, 0.5, 1, &rng, &out), WEFT_ERR_DTYPE, "dropout: dtype i64");
    cr_assert_null(out, "an output was set on failure");

    weft_tensor_release(a);
    weft_tensor_release(b);
    weft_tensor_release(a64);
    weft_tensor_release(ints);
}
