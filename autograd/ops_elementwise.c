/*
 * Elementwise operations: binary operations with numpy broadcasting (add, sub, mul, div, pow),
 * scalar and unary maps, and dropout, for f32 and f64, each with its backward.
 *
 * A binary operation runs over its output in memory order. The operands' shapes are first folded
 * into a few loops (dims of size 1 dropped, neighbouring dims merged where both operands step
 * through them alike), so that the innermost loop is one run over which each operand moves by 1
 * or stays put: equal shapes are one loop, a scalar operand one loop with a fixed value, and row
 * broadcasting ([N, C] + [C]) N runs of C. The row kernels are specialised on those two strides,
 * so the common cases compile to plain vectorisable loops (see ops_math.h).
 */
#include <math.h>
#include <string.h>

#include "graph.h"
#include "ops_math.h"

#include <weft/ops.h>

/* ---- checks ---------------------------------------------------------------------------------- */

static weft_status_t check_two(const char *op, const weft_tensor_t *a, const weft_tensor_t *b,
                               weft_tensor_t **out_p)
{
    WEFT_CHECK(weft__op_check_one(op, a, out_p));
    WEFT_CHECK(weft__op_check_float(op, b));
    if (weft_tensor_dtype(a) != weft_tensor_dtype(b)) {
        return weft__set_error(WEFT_ERR_DTYPE, "%s: dtypes %s and %s differ", op,
                               weft_dtype_name(weft_tensor_dtype(a)),
                               weft_dtype_name(weft_tensor_dtype(b)));
    }
    return WEFT_OK;
}

/* The numpy broadcast of two shapes into (*nd_p, shape); 0 when they do not broadcast. */
static int broadcast_shapes(int na, const int64_t *sa, int nb, const int64_t *sb, int *nd_p,
                            int64_t *shape)
{
    int nd = na > nb ? na : nb;

    for (int d = 0; d < nd; d++) {
        int da = d - (nd - na);
        int db = d - (nd - nb);
        int64_t ea = da >= 0 ? sa[da] : 1;
        int64_t eb = db >= 0 ? sb[db] : 1;

        if (ea != eb && ea != 1 && eb != 1) {
            return 0;
        }
        shape[d] = ea == 1 ? eb : ea;
    }
    *nd_p = nd;
    return 1;
}

/* ---- graph recording ------------------------------------------------------------------------- */

/* ---- broadcast loops ------------------------------------------------------------------------- */

typedef struct {
    int ndim; /* folded loops, outermost first; at least 1 */
    int64_t size[WEFT_MAX_DIMS];
    int64_t sa[WEFT_MAX_DIMS]; /* element strides of a and b; 0 along broadcast dims */
    int64_t sb[WEFT_MAX_DIMS];
} bcast_t;

/* out[i] = f(a[i * sa], b[i * sb]) for i < n, where sa and sb are 0 or 1. */
typedef void (*bin_row_fn)(int64_t n, const void *a, int64_t sa, const void *b, int64_t sb,
                           void *out);

static void bcast_plan(int nd, const int64_t *shape, int na, const int64_t *ashape, int nb,
                       const int64_t *bshape, bcast_t *p)
{
    int64_t fa[WEFT_MAX_DIMS];
    int64_t fb[WEFT_MAX_DIMS];
    int64_t ca = 1;
    int64_t cb = 1;

    for (int d = nd - 1; d >= 0; d--) {
        int64_t ea = d - (nd - na) >= 0 ? ashape[d - (nd - na)] : 1;
        int64_t eb = d - (nd - nb) >= 0 ? bshape[d - (nd - nb)] : 1;

        fa[d] = ea == 1 ? 0 : ca;
        fb[d] = eb == 1 ? 0 : cb;
        ca *= ea;
        cb *= eb;
    }
    p->ndim = 0;
    for (int d = 0; d < nd; d++) {
        int k = p->ndim - 1;

        if (shape[d] == 1) {
            continue;
        }
        if (k >= 0 && p->sa[k] == fa[d] * shape[d] && p->sb[k] == fb[d] * shape[d]) {
            p->size[k] *= shape[d];
            p->sa[k] = fa[d];
            p->sb[k] = fb[d];
            continue;
        }
        p->size[k + 1] = shape[d];
        p->sa[k + 1] = fa[d];
        p->sb[k + 1] = fb[d];
        p->ndim++;
    }
    if (p->ndim == 0) {
        p->ndim = 1;
        p->size[0] = 1;
        p->sa[0] = 0;
        p->sb[0] = 0;
    }
}

/* Runs @p row over every innermost run of the plan, writing @p out contiguously. */
static void bcast_run(const bcast_t *p, size_t esz, bin_row_fn row, const char *a, const char *b,
                      char *out)
{
    const int last = p->ndim - 1;
    const int64_t n = p->size[last];
    int64_t idx[WEFT_MAX_DIMS] = {0};
    int64_t rows = 1;
    int64_t oa = 0;
    int64_t ob = 0;

    for (int d = 0; d < last; d++) {
        rows *= p->size[d];
    }
    for (int64_t r = 0; r < rows; r++) {
        row(n, a + oa * (int64_t)esz, p->sa[last], b + ob * (int64_t)esz, p->sb[last],
            out + r * n * (int64_t)esz);
        for (int d = last - 1; d >= 0; d--) {
            if (++idx[d] < p->size[d]) {
                oa += p->sa[d];
                ob += p->sb[d];
                break;
            }
            oa -= p->sa[d] * (p->size[d] - 1);
            ob -= p->sb[d] * (p->size[d] - 1);
            idx[d] = 0;
        }
    }
}

/*
 * A row kernel evaluating EXPR of x (from a) and y (from b), specialised on the strides. The loops
 * sit in functions whose pointer parameters are restrict-qualified: GCC vectorises those, not loops
 * over restrict locals.
 */
#define BIN_ROW(fn, T, EXPR)                                                                       \
    static inline void fn##_vv(int64_t n, const T *restrict a, const T *restrict b, T *restrict o) \
    {                                                                                              \
        WEFT__FOR_EACH(i, n, {                                                                     \
            const T x = a[i];                                                                      \
            const T y = b[i];                                                                      \
            o[i] = (EXPR);                                                                         \
        });                                                                                        \
    }                                                                                              \
    static inline void fn##_vs(int64_t n, const T *restrict a, const T y, T *restrict o)           \
    {                                                                                              \
        WEFT__FOR_EACH(i, n, {                                                                     \
            const T x = a[i];                                                                      \
            o[i] = (EXPR);                                                                         \
        });                                                                                        \
    }                                                                                              \
    static inline void fn##_sv(int64_t n, const T x, const T *restrict b, T *restrict o)           \
    {                                                                                              \
        WEFT__FOR_EACH(i, n, {                                                                     \
            const T y = b[i];                                                                      \
            o[i] = (EXPR);                                                                         \
        });                                                                                        \
    }                                                                                              \
    static void fn(int64_t n, const void *va, int64_t sa, const void *vb, int64_t sb, void *vo)    \
    {                                                                                              \
        const T *a = va;                                                                           \
        const T *b = vb;                                                                           \
        T *o = vo;                                                                                 \
        if (sa != 0 && sb != 0) {                                                                  \
            fn##_vv(n, a, b, o);                                                                   \
        } else if (sa != 0) {                                                                      \
            fn##_vs(n, a, b[0], o);                                                                \
        } else if (sb != 0) {                                                                      \
            fn##_sv(n, a[0], b, o);                                                                \
        } else {                                                                                   \
            const T x = a[0];                                                                      \
            const T y = b[0];                                                                      \
            const T v = (EXPR);                                                                    \
            WEFT__FOR_EACH(i, n, { o[i] = v; });                                                   \
        }                                                                                          \
    }

BIN_ROW(add_f32, float, (x + y))
BIN_ROW(add_f64, double, (x + y))
BIN_ROW(sub_f32, float, (x - y))
BIN_ROW(sub_f64, double, (x - y))
BIN_ROW(mul_f32, float, (x * y))
BIN_ROW(mul_f64, double, (x * y))
BIN_ROW(div_f32, float, (x / y))
BIN_ROW(div_f64, double, (x / y))
BIN_ROW(pow_f32, float, powf(x, y))
BIN_ROW(pow_f64, double, pow(x, y))
BIN_ROW(first_f32, float, ((void)y, x))
BIN_ROW(first_f64, double, ((void)y, x))

enum { BIN_ADD, BIN_SUB, BIN_MUL, BIN_DIV, BIN_POW, BIN_FIRST };

static const struct {
    const char *name;
    const char *node;
    bin_row_fn row[2]; /* f32, f64 */
} bin_ops[] = {
    [BIN_ADD] = {"add", "AddBackward", {add_f32, add_f64}},
    [BIN_SUB] = {"sub", "SubBackward", {sub_f32, sub_f64}},
    [BIN_MUL] = {"mul", "MulBackward", {mul_f32, mul_f64}},
    [BIN_DIV] = {"div", "DivBackward", {div_f32, div_f64}},
    [BIN_POW] = {"pow", "PowBackward", {pow_f32, pow_f64}},
    [BIN_FIRST] = {"expand", NULL, {first_f32, first_f64}},
};

/*
 * out = a op b with output shape (nd, shape), which a and b broadcast to; no checks, no graph.
 * BIN_FIRST broadcasts a to the shape (b is only read for its shape).
 */
static weft_status_t bin_eval(int op, const weft_tensor_t *a, const weft_tensor_t *b, int nd,
                              const int64_t *shape, weft_tensor_t **out_p)
{
    weft_dtype_t dt = weft_tensor_dtype(a);
    weft_tensor_t *out = NULL;
    bcast_t p;

    WEFT_CHECK(weft_tensor_empty(dt, nd, shape, &out));
    if (weft_tensor_numel(out) > 0) {
        bcast_plan(nd, shape, weft_tensor_ndim(a), weft_tensor_shape(a), weft_tensor_ndim(b),
                   weft_tensor_shape(b), &p);
        bcast_run(&p, weft_dtype_size(dt), bin_ops[op].row[dt == WEFT_F64], weft_tensor_data(a),
                  weft_tensor_data(b), weft_tensor_data(out));
    }
    *out_p = out;
    return WEFT_OK;
}

/* @p t broadcast to (nd, shape): @p t itself (retained) when it already has that shape. */
static weft_status_t expand(weft_tensor_t *t, int nd, const int64_t *shape, weft_tensor_t **out_p)
{
    if (weft_tensor_ndim(t) == nd &&
        memcmp(weft_tensor_shape(t), shape, (size_t)nd * sizeof(int64_t)) == 0) {
        *out_p = weft_tensor_retain(t);
        return WEFT_OK;
    }
    return bin_eval(BIN_FIRST, t, t, nd, shape, out_p);
}

/* ---- unary maps ------------------------------------------------------------------------------ */

/* out[i] = f(a[i]) with the op's scalar argument @p s. */
typedef void (*un_row_fn)(int64_t n, const void *a, double s, void *out);
/* gin[i] = g[i] * f'(...) from the saved input or output @p v (or g itself when nothing is saved).
 */
typedef void (*gr_row_fn)(int64_t n, const void *g, const void *v, double s, void *gin);

#define UN_ROW(fn, T, EXPR)                                                                        \
    static inline void fn##_k(int64_t n, const T *restrict a, const T s, T *restrict o)            \
    {                                                                                              \
        (void)s;                                                                                   \
        WEFT__FOR_EACH(i, n, {                                                                     \
            const T x = a[i];                                                                      \
            o[i] = (EXPR);                                                                         \
        });                                                                                        \
    }                                                                                              \
    static void fn(int64_t n, const void *a, double s, void *o)                                    \
    {                                                                                              \
        fn##_k(n, a, (T)s, o);                                                                     \
    }

#define GR_ROW(fn, T, EXPR)                                                                        \
    static inline void fn##_k(int64_t n, const T *restrict gp, const T *restrict vp, const T s,    \
                              T *restrict o)                                                       \
    {                                                                                              \
        (void)s;                                                                                   \
        WEFT__FOR_EACH(i, n, {                                                                     \
            const T g = gp[i];                                                                     \
            const T v = vp[i];                                                                     \
            (void)v;                                                                               \
            o[i] = (EXPR);                                                                         \
        });                                                                                        \
    }                                                                                              \
    static void fn(int64_t n, const void *g, const void *v, double s, void *o)                     \
    {                                                                                              \
        fn##_k(n, g, v, (T)s, o);                                                                  \
    }

#define GELU_PDF 0.39894228040143267794 /* 1 / sqrt(2 pi) */

/* d gelu / dx = Phi(x) + x phi(x), Phi and phi the standard normal's cdf and pdf. */
static inline float gelu_slope_f32(float x)
{
    return 0.5f * erfcf(-x * (float)M_SQRT1_2) + x * (float)GELU_PDF * expf(-0.5f * x * x);
}

static inline double gelu_slope_f64(double x)
{
    return 0.5 * erfc(-x * M_SQRT1_2) + x * GELU_PDF * exp(-0.5 * x * x);
}

/* GELU as 0.5 x erfc(-x / sqrt 2): the same function as 0.5 x (1 + erf(x / sqrt 2)), without the
 * cancellation of 1 + erf for negative x. */
UN_ROW(gelu_f32, float, (0.5f * x * erfcf(-x * (float)M_SQRT1_2)))
UN_ROW(gelu_f64, double, (0.5 * x * erfc(-x * M_SQRT1_2)))
GR_ROW(gelu_grad_f32, float, (g * gelu_slope_f32(v)))
GR_ROW(gelu_grad_f64, double, (g * gelu_slope_f64(v)))
UN_ROW(add_scalar_f32, float, (x + s))
UN_ROW(add_scalar_f64, double, (x + s))
UN_ROW(mul_scalar_f32, float, (x * s))
UN_ROW(mul_scalar_f64, double, (x * s))
GR_ROW(mul_scalar_grad_f32, float, (g * s))
GR_ROW(mul_scalar_grad_f64, double, (g * s))
UN_ROW(neg_f32, float, (-x))
UN_ROW(neg_f64, double, (-x))
GR_ROW(neg_grad_f32, float, (-g))
GR_ROW(neg_grad_f64, double, (-g))
/* relu keeps NaN (torch does) and -0.0. */
UN_ROW(relu_f32, float, (x < 0 ? 0.0f : x))
UN_ROW(relu_f64, double, (x < 0 ? 0.0 : x))
GR_ROW(relu_grad_f32, float, (v > 0 ? g : 0.0f))
GR_ROW(relu_grad_f64, double, (v > 0 ? g : 0.0))
UN_ROW(tanh_f32, float, tanhf(x))
UN_ROW(tanh_f64, double, tanh(x))
GR_ROW(tanh_grad_f32, float, (g * (1.0f - v * v)))
GR_ROW(tanh_grad_f64, double, (g * (1.0 - v * v)))
UN_ROW(sigmoid_f32, float, (1.0f / (1.0f + weft__exp_f32(-x))))
UN_ROW(sigmoid_f64, double, (1.0 / (1.0 + exp(-x))))
GR_ROW(sigmoid_grad_f32, float, (g * v * (1.0f - v)))
GR_ROW(sigmoid_grad_f64, double, (g * v * (1.0 - v)))
UN_ROW(exp_f32, float, weft__exp_f32(x))
UN_ROW(exp_f64, double, exp(x))
GR_ROW(exp_grad_f32, float, (g * v))
GR_ROW(exp_grad_f64, double, (g * v))
UN_ROW(log_f32, float, logf(x))
UN_ROW(log_f64, double, log(x))
GR_ROW(log_grad_f32, float, (g / v))
GR_ROW(log_grad_f64, double, (g / v))

/* x ** e with torch's special cases (which are also the fast ones). */
#define POW_SCALAR_ROW(fn, T, POW, SQRT)                                                           \
    static inline void fn##_k(int64_t n, const T *restrict a, double e, T *restrict o)             \
    {                                                                                              \
        if (e == 2) {                                                                              \
            WEFT__FOR_EACH(i, n, { o[i] = a[i] * a[i]; });                                         \
        } else if (e == 3) {                                                                       \
            WEFT__FOR_EACH(i, n, { o[i] = a[i] * a[i] * a[i]; });                                  \
        } else if (e == 1) {                                                                       \
            memcpy(o, a, (size_t)n * sizeof(T));                                                   \
        } else if (e == 0) {                                                                       \
            WEFT__FOR_EACH(i, n, { o[i] = 1; });                                                   \
        } else if (e == 0.5) {                                                                     \
            WEFT__FOR_EACH(i, n, { o[i] = SQRT(a[i]); });                                          \
        } else if (e == -0.5) {                                                                    \
            WEFT__FOR_EACH(i, n, { o[i] = 1 / SQRT(a[i]); });                                      \
        } else if (e == -1) {                                                                      \
            WEFT__FOR_EACH(i, n, { o[i] = 1 / a[i]; });                                            \
        } else if (e == -2) {                                                                      \
            WEFT__FOR_EACH(i, n, { o[i] = 1 / (a[i] * a[i]); });                                   \
        } else {                                                                                   \
            const T et = (T)e;                                                                     \
            WEFT__FOR_EACH(i, n, { o[i] = POW(a[i], et); });                                       \
        }                                                                                          \
    }                                                                                              \
    static void fn(int64_t n, const void *a, double e, void *o)                                    \
    {                                                                                              \
        fn##_k(n, a, e, o);                                                                        \
    }

/* g * e * x ** (e - 1); 0 for e == 0 (as torch, so that x == 0 gives no NaN). */
#define POW_SCALAR_GRAD_ROW(fn, T, POW)                                                            \
    static inline void fn##_k(int64_t n, const T *restrict g, const T *restrict x, double e,       \
                              T *restrict o)                                                       \
    {                                                                                              \
        const T et = (T)e;                                                                         \
        const T em1 = (T)(e - 1);                                                                  \
        if (e == 0) {                                                                              \
            memset(o, 0, (size_t)n * sizeof(T));                                                   \
        } else if (e == 1) {                                                                       \
            memcpy(o, g, (size_t)n * sizeof(T));                                                   \
        } else if (e == 2) {                                                                       \
            WEFT__FOR_EACH(i, n, { o[i] = g[i] * (2 * x[i]); });                                   \
        } else {                                                                                   \
            WEFT__FOR_EACH(i, n, { o[i] = g[i] * (et * POW(x[i], em1)); });                        \
        }                                                                                          \
    }                                                                                              \
    static void fn(int64_t n, const void *g, const void *x, double e, void *o)                     \
    {                                                                                              \
        fn##_k(n, g, x, e, o);                                                                     \
    }

POW_SCALAR_ROW(pow_scalar_f32, float, powf, sqrtf)
POW_SCALAR_ROW(pow_scalar_f64, double, pow, sqrt)
POW_SCALAR_GRAD_ROW(pow_scalar_grad_f32, float, powf)
POW_SCALAR_GRAD_ROW(pow_scalar_grad_f64, double, pow)

enum { SAVE_NONE, SAVE_INPUT, SAVE_OUTPUT };

enum {
    UN_ADD_SCALAR,
    UN_MUL_SCALAR,
    UN_POW_SCALAR,
    UN_NEG,
    UN_RELU,
    UN_GELU,
    UN_TANH,
    UN_SIGMOID,
    UN_EXP,
    UN_LOG,
};

static const struct {
    const char *name;
    const char *node;
    un_row_fn fwd[2]; /* f32, f64 */
    gr_row_fn bwd[2]; /* NULL: the gradient passes through unchanged */
    int save;
} un_ops[] = {
    [UN_ADD_SCALAR] = {"add_scalar",
                       "AddScalarBackward",
                       {add_scalar_f32, add_scalar_f64},
                       {NULL, NULL},
                       SAVE_NONE},
    [UN_MUL_SCALAR] = {"mul_scalar",
                       "MulScalarBackward",
                       {mul_scalar_f32, mul_scalar_f64},
                       {mul_scalar_grad_f32, mul_scalar_grad_f64},
                       SAVE_NONE},
    [UN_POW_SCALAR] = {"pow_scalar",
                       "PowScalarBackward",
                       {pow_scalar_f32, pow_scalar_f64},
                       {pow_scalar_grad_f32, pow_scalar_grad_f64},
                       SAVE_INPUT},
    [UN_NEG] = {"neg", "NegBackward", {neg_f32, neg_f64}, {neg_grad_f32, neg_grad_f64}, SAVE_NONE},
    [UN_RELU] =
        {"relu", "ReluBackward", {relu_f32, relu_f64}, {relu_grad_f32, relu_grad_f64}, SAVE_OUTPUT},
    [UN_GELU] =
        {"gelu", "GeluBackward", {gelu_f32, gelu_f64}, {gelu_grad_f32, gelu_grad_f64}, SAVE_INPUT},
    [UN_TANH] =
        {"tanh", "TanhBackward", {tanh_f32, tanh_f64}, {tanh_grad_f32, tanh_grad_f64}, SAVE_OUTPUT},
    [UN_SIGMOID] = {"sigmoid",
                    "SigmoidBackward",
                    {sigmoid_f32, sigmoid_f64},
                    {sigmoid_grad_f32, sigmoid_grad_f64},
                    SAVE_OUTPUT},
    [UN_EXP] =
        {"exp", "ExpBackward", {exp_f32, exp_f64}, {exp_grad_f32, exp_grad_f64}, SAVE_OUTPUT},
    [UN_LOG] = {"log", "LogBackward", {log_f32, log_f64}, {log_grad_f32, log_grad_f64}, SAVE_INPUT},
};

/* A unary map of @p a; no checks, no graph. */
static weft_status_t un_eval(int op, const weft_tensor_t *a, double s, weft_tensor_t **out_p)
{
    weft_tensor_t *out = NULL;

    WEFT_CHECK(weft__op_empty_like(a, &out));
    un_ops[op].fwd[weft_tensor_dtype(a) == WEFT_F64](weft_tensor_numel(a), weft_tensor_data(a), s,
                                                     weft_tensor_data(out));
    *out_p = out;
    return WEFT_OK;
}

/* iargs[0]: the op; dargs[0]: its scalar; saved[0]: its input or output, or nothing. */
static weft_status_t unary_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                    weft_tensor_t **grad_in)
{
    const int op = (int)n->iargs[0];
    weft_tensor_t *g = grad_out[0];
    const weft_tensor_t *v = un_ops[op].save == SAVE_NONE ? g : n->saved[0];
    weft_tensor_t *gin = NULL;

    if (!weft__ag_needs_grad(n, 0)) {
        return WEFT_OK;
    }
    if (un_ops[op].bwd[0] == NULL) {
        grad_in[0] = weft_tensor_retain(g);
        return WEFT_OK;
    }
    WEFT_CHECK(weft__op_empty_like(g, &gin));
    un_ops[op].bwd[weft_tensor_dtype(g) == WEFT_F64](weft_tensor_numel(g), weft_tensor_data(g),
                                                     weft_tensor_data(v), n->dargs[0],
                                                     weft_tensor_data(gin));
    grad_in[0] = gin;
    return WEFT_OK;
}

static weft_status_t unary(int op, weft_tensor_t *a, double s, weft_tensor_t **out_p)
{
    weft_tensor_t *out = NULL;
    weft__ag_node_t *n = NULL;
    weft_status_t st;

    WEFT_CHECK(weft__op_check_one(un_ops[op].name, a, out_p));
    WEFT_CHECK(un_eval(op, a, s, &out));
    WEFT_CHECK_GOTO(weft__op_node_begin(un_ops[op].node, unary_backward, 1, &a, &n), st,
                    err_release_out);
    if (n != NULL) {
        n->iargs[0] = op;
        n->dargs[0] = s;
        st = WEFT_OK;
        if (un_ops[op].save == SAVE_INPUT) {
            st = weft__ag_save(n, a);
        } else if (un_ops[op].save == SAVE_OUTPUT) {
            st = weft__ag_save(n, out);
        }
        WEFT_CHECK_GOTO(weft__op_node_end(n, st, out), st, err_release_out);
    }
    *out_p = out;
    return WEFT_OK;

err_release_out:
    weft_tensor_release(out);
    return st;
}

weft_status_t weft_op_add_scalar(weft_tensor_t *a, double s, weft_tensor_t **out_p)
{
    return unary(UN_ADD_SCALAR, a, s, out_p);
}

weft_status_t weft_op_mul_scalar(weft_tensor_t *a, double s, weft_tensor_t **out_p)
{
    return unary(UN_MUL_SCALAR, a, s, out_p);
}

weft_status_t weft_op_pow_scalar(weft_tensor_t *a, double e, weft_tensor_t **out_p)
{
    return unary(UN_POW_SCALAR, a, e, out_p);
}

weft_status_t weft_op_neg(weft_tensor_t *a, weft_tensor_t **out_p)
{
    return unary(UN_NEG, a, 0, out_p);
}

weft_status_t weft_op_relu(weft_tensor_t *a, weft_tensor_t **out_p)
{
    return unary(UN_RELU, a, 0, out_p);
}

weft_status_t weft_op_gelu(weft_tensor_t *a, weft_tensor_t **out_p)
{
    return unary(UN_GELU, a, 0, out_p);
}

weft_status_t weft_op_tanh(weft_tensor_t *a, weft_tensor_t **out_p)
{
    return unary(UN_TANH, a, 0, out_p);
}

weft_status_t weft_op_sigmoid(weft_tensor_t *a, weft_tensor_t **out_p)
{
    return unary(UN_SIGMOID, a, 0, out_p);
}

weft_status_t weft_op_exp(weft_tensor_t *a, weft_tensor_t **out_p)
{
    return unary(UN_EXP, a, 0, out_p);
}

weft_status_t weft_op_log(weft_tensor_t *a, weft_tensor_t **out_p)
{
    return unary(UN_LOG, a, 0, out_p);
}

/* ---- binary operations ----------------------------------------------------------------------- */

/* Saved tensor slots of a binary node (NULL where the backward does not need one). */
enum { SLOT_A, SLOT_B, SLOT_OUT };

/*
 * Gradients of a ** b over the output shape: ga = g b a^(b-1) (0 where b == 0) and
 * gb = g out log(a) (0 where a == 0 and b >= 0), as torch; @p ga or @p gb may be NULL.
 */
#define POW_GRAD(fn, T, POW, LOG)                                                                  \
    static void fn(int64_t n, const T *restrict g, const T *restrict a, const T *restrict b,       \
                   const T *restrict y, T *restrict ga, T *restrict gb)                            \
    {                                                                                              \
        if (ga != NULL) {                                                                          \
            WEFT__FOR_EACH(i, n,                                                                   \
                           { ga[i] = b[i] == 0 ? 0 : g[i] * (b[i] * POW(a[i], b[i] - 1)); });      \
        }                                                                                          \
        if (gb != NULL) {                                                                          \
            WEFT__FOR_EACH(i, n,                                                                   \
                           { gb[i] = a[i] == 0 && b[i] >= 0 ? 0 : g[i] * (y[i] * LOG(a[i])); });   \
        }                                                                                          \
    }

POW_GRAD(pow_grad_f32, float, powf, logf)
POW_GRAD(pow_grad_f64, double, pow, log)

/* Full-shape gradients of pow into *ta_p and *tb_p (for the inputs that need them). */
static weft_status_t pow_grads(weft__ag_node_t *n, weft_tensor_t *g, int need_a, int need_b,
                               weft_tensor_t **ta_p, weft_tensor_t **tb_p)
{
    const int nd = weft_tensor_ndim(g);
    const int64_t *shape = weft_tensor_shape(g);
    weft_tensor_t *a = NULL;
    weft_tensor_t *b = NULL;
    weft_tensor_t *ta = NULL;
    weft_tensor_t *tb = NULL;
    const weft_tensor_t *y = n->saved[SLOT_OUT];
    weft_status_t st;

    WEFT_CHECK_GOTO(expand(n->saved[SLOT_A], nd, shape, &a), st, err);
    WEFT_CHECK_GOTO(expand(n->saved[SLOT_B], nd, shape, &b), st, err);
    if (need_a) {
        WEFT_CHECK_GOTO(weft__op_empty_like(g, &ta), st, err);
    }
    if (need_b) {
        WEFT_CHECK_GOTO(weft__op_empty_like(g, &tb), st, err);
    }
    if (weft_tensor_dtype(g) == WEFT_F32) {
        pow_grad_f32(weft_tensor_numel(g), weft_tensor_data(g), weft_tensor_data(a),
                     weft_tensor_data(b), need_b ? weft_tensor_data(y) : NULL,
                     ta != NULL ? weft_tensor_data(ta) : NULL,
                     tb != NULL ? weft_tensor_data(tb) : NULL);
    } else {
        pow_grad_f64(weft_tensor_numel(g), weft_tensor_data(g), weft_tensor_data(a),
                     weft_tensor_data(b), need_b ? weft_tensor_data(y) : NULL,
                     ta != NULL ? weft_tensor_data(ta) : NULL,
                     tb != NULL ? weft_tensor_data(tb) : NULL);
    }
    weft_tensor_release(a);
    weft_tensor_release(b);
    *ta_p = ta;
    *tb_p = tb;
    return WEFT_OK;

err:
    weft_tensor_release(ta);
    weft_tensor_release(a);
    weft_tensor_release(b);
    return st;
}

/*
 * iargs[0]: the op. ta and tb are the gradients over the output shape, summed down to each
 * input's shape at the end; the gradient of b is negated after that sum for sub and div.
 */
static weft_status_t binary_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                     weft_tensor_t **grad_in)
{
    const int op = (int)n->iargs[0];
    const int need_a = weft__ag_needs_grad(n, 0);
    const int need_b = weft__ag_needs_grad(n, 1);
    weft_tensor_t *g = grad_out[0];
    const int nd = weft_tensor_ndim(g);
    const int64_t *shape = weft_tensor_shape(g);
    weft_tensor_t *ta = NULL;
    weft_tensor_t *tb = NULL;
    weft_tensor_t *ra = NULL;
    weft_tensor_t *rb = NULL;
    weft_status_t st = WEFT_OK;

    switch (op) {
    case BIN_ADD:
    case BIN_SUB:
        ta = need_a ? weft_tensor_retain(g) : NULL;
        tb = need_b ? weft_tensor_retain(g) : NULL;
        break;
    case BIN_MUL:
        if (need_a) {
            WEFT_CHECK_GOTO(bin_eval(BIN_MUL, g, n->saved[SLOT_B], nd, shape, &ta), st, err);
        }
        if (need_b) {
            WEFT_CHECK_GOTO(bin_eval(BIN_MUL, g, n->saved[SLOT_A], nd, shape, &tb), st, err);
        }
        break;
    case BIN_DIV: {
        /* ga = g / b; gb = -g a / b^2 = -(g / b) out. */
        weft_tensor_t *q = NULL;

        WEFT_CHECK_GOTO(bin_eval(BIN_DIV, g, n->saved[SLOT_B], nd, shape, &q), st, err);
        if (need_b) {
            st = bin_eval(BIN_MUL, q, n->saved[SLOT_OUT], nd, shape, &tb);
            if (st != WEFT_OK) {
                weft_tensor_release(q);
                goto err;
            }
        }
        if (need_a) {
            ta = q;
        } else {
            weft_tensor_release(q);
        }
        break;
    }
    default:
        WEFT_CHECK_GOTO(pow_grads(n, g, need_a, need_b, &ta, &tb), st, err);
        break;
    }
    if (ta != NULL) {
        WEFT_CHECK_GOTO(weft__op_sum_to(ta, n->in_ndim[0], n->in_shape[0], &ra), st, err);
    }
    if (tb != NULL) {
        WEFT_CHECK_GOTO(weft__op_sum_to(tb, n->in_ndim[1], n->in_shape[1], &rb), st, err);
        if (op == BIN_SUB || op == BIN_DIV) {
            weft_tensor_t *neg = NULL;

            WEFT_CHECK_GOTO(un_eval(UN_NEG, rb, 0, &neg), st, err);
            weft_tensor_release(rb);
            rb = neg;
        }
    }
    weft_tensor_release(ta);
    weft_tensor_release(tb);
    grad_in[0] = ra;
    grad_in[1] = rb;
    return WEFT_OK;

err:
    weft_tensor_release(ra);
    weft_tensor_release(rb);
    weft_tensor_release(ta);
    weft_tensor_release(tb);
    return st;
}

static weft_status_t binary(int op, weft_tensor_t *a, weft_tensor_t *b, weft_tensor_t **out_p)
{
    const char *name = bin_ops[op].name;
    int64_t shape[WEFT_MAX_DIMS];
    int nd = 0;
    weft_tensor_t *out = NULL;
    weft__ag_node_t *n = NULL;
    weft_status_t st;

    WEFT_CHECK(check_two(name, a, b, out_p));
    if (!broadcast_shapes(weft_tensor_ndim(a), weft_tensor_shape(a), weft_tensor_ndim(b),
                          weft_tensor_shape(b), &nd, shape)) {

        return weft__set_error(WEFT_ERR_SHAPE, "%s: shapes %s and %s do not broadcast", name,
                               weft__tensor_shape_str(a).s, weft__tensor_shape_str(b).s);
    }
    WEFT_CHECK(bin_eval(op, a, b, nd, shape, &out));
    WEFT_CHECK_GOTO(
        weft__op_node_begin(bin_ops[op].node, binary_backward, 2, (weft_tensor_t *[]){a, b}, &n),
        st, err_release_out);
    if (n != NULL) {
        const int need_a = weft__ag_needs_grad(n, 0);
        const int need_b = weft__ag_needs_grad(n, 1);
        /* What each backward reads (the slots stay in order: a, b, out). */
        const int save_a = (op == BIN_MUL && need_b) || op == BIN_POW;
        const int save_b = (op == BIN_MUL && need_a) || op == BIN_DIV || op == BIN_POW;
        const int save_out = (op == BIN_DIV || op == BIN_POW) && need_b;

        n->iargs[0] = op;
        st = weft__ag_save(n, save_a ? a : NULL);
        if (st == WEFT_OK) {
            st = weft__ag_save(n, save_b ? b : NULL);
        }
        if (st == WEFT_OK) {
            st = weft__ag_save(n, save_out ? out : NULL);
        }
        WEFT_CHECK_GOTO(weft__op_node_end(n, st, out), st, err_release_out);
    }
    *out_p = out;
    return WEFT_OK;

err_release_out:
    weft_tensor_release(out);
    return st;
}

weft_status_t weft_op_add(weft_tensor_t *a, weft_tensor_t *b, weft_tensor_t **out_p)
{
    return binary(BIN_ADD, a, b, out_p);
}

weft_status_t weft_op_sub(weft_tensor_t *a, weft_tensor_t *b, weft_tensor_t **out_p)
{
    return binary(BIN_SUB, a, b, out_p);
}

weft_status_t weft_op_mul(weft_tensor_t *a, weft_tensor_t *b, weft_tensor_t **out_p)
{
    return binary(BIN_MUL, a, b, out_p);
}

weft_status_t weft_op_div(weft_tensor_t *a, weft_tensor_t *b, weft_tensor_t **out_p)
{
    return binary(BIN_DIV, a, b, out_p);
}

weft_status_t weft_op_pow(weft_tensor_t *a, weft_tensor_t *b, weft_tensor_t **out_p)
{
    return binary(BIN_POW, a, b, out_p);
}

/* ---- dropout --------------------------------------------------------------------------------- */

/* gin = g * mask * scale, the mask 0 or 1. */
#define DROPOUT_GRAD(fn, T)                                                                        \
    static void fn(int64_t n, const T *restrict g, const uint8_t *restrict m, const T s,           \
                   T *restrict o)                                                                  \
    {                                                                                              \
        WEFT__FOR_EACH(i, n, { o[i] = g[i] * ((T)m[i] * s); });                                    \
    }

DROPOUT_GRAD(dropout_grad_f32, float)
DROPOUT_GRAD(dropout_grad_f64, double)

/*
 * iargs[0]: 1 when saved[0] is the u8 keep mask; dargs[0]: the scale of kept elements (1 for the
 * identity of eval mode and p == 0, 0 for p == 1, where nothing is kept).
 */
static weft_status_t dropout_backward(weft__ag_node_t *n, weft_tensor_t *const *grad_out,
                                      weft_tensor_t **grad_in)
{
    weft_tensor_t *g = grad_out[0];
    const double scale = n->dargs[0];
    const int64_t cnt = weft_tensor_numel(g);
    weft_tensor_t *gin = NULL;

    if (!weft__ag_needs_grad(n, 0)) {
        return WEFT_OK;
    }
    if (n->iargs[0] == 0 && scale == 1) {
        grad_in[0] = weft_tensor_retain(g);
        return WEFT_OK;
    }
    if (n->iargs[0] == 0) {
        WEFT_CHECK(
            weft__op_zeros(weft_tensor_dtype(g), weft_tensor_ndim(g), weft_tensor_shape(g), &gin));
        grad_in[0] = gin;
        return WEFT_OK;
    }
    WEFT_CHECK(weft__op_empty_like(g, &gin));
    if (weft_tensor_dtype(g) == WEFT_F32) {
        dropout_grad_f32(cnt, weft_tensor_data(g), weft_tensor_data(n->saved[0]), (float)scale,
                         weft_tensor_data(gin));
    } else {
        dropout_grad_f64(cnt, weft_tensor_data(g), weft_tensor_data(n->saved[0]), scale,
                         weft_tensor_data(gin));
    }
    grad_in[0] = gin;
    return WEFT_OK;
}

/* out = a * scale where u >= p for a uniform u drawn per element in order, else 0. */
#define DROPOUT_LOOP(T)                                                                            \
    do {                                                                                           \
        const T *restrict x = weft_tensor_data(a);                                                 \
        T *restrict o = weft_tensor_data(out);                                                     \
        const T s = (T)scale;                                                                      \
        WEFT__FOR_EACH(i, cnt, {                                                                   \
            const int keep = weft_rng_uniform(rng) >= p;                                           \
            o[i] = keep ? x[i] * s : (T)0;                                                         \
            if (mask != NULL) {                                                                    \
                mask[i] = (uint8_t)keep;                                                           \
            }                                                                                      \
        });                                                                                        \
    } while (0)

weft_status_t weft_op_dropout(weft_tensor_t *a, double p, int training, weft_rng_t *rng,
                              weft_tensor_t **out_p)
{
    weft_tensor_t *out = NULL;
    weft_tensor_t *mask_t = NULL;
    weft__ag_node_t *n = NULL;
    const int drop = training && p > 0 && p < 1;
    double scale = 1;
    weft_status_t st;

    WEFT_CHECK(weft__op_check_one("dropout", a, out_p));
    if (!(p >= 0 && p <= 1)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "dropout: p = %g is outside [0, 1]", p);
    }
    if (training && rng == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "dropout: NULL rng while training");
    }
    const int64_t cnt = weft_tensor_numel(a);
    if (!training || p == 0) {
        WEFT_CHECK(weft_tensor_clone(a, &out));
    } else if (p == 1) {
        scale = 0;
        WEFT_CHECK(
            weft__op_zeros(weft_tensor_dtype(a), weft_tensor_ndim(a), weft_tensor_shape(a), &out));
    } else {
        uint8_t *mask = NULL;

        scale = 1 / (1 - p);
        WEFT_CHECK(weft__op_empty_like(a, &out));
        if (weft__ag_should_record(1, &a)) {
            WEFT_CHECK_GOTO(
                weft_tensor_empty(WEFT_U8, weft_tensor_ndim(a), weft_tensor_shape(a), &mask_t), st,
                err_release_out);
            mask = weft_tensor_data(mask_t);
        }
        if (weft_tensor_dtype(a) == WEFT_F32) {
            DROPOUT_LOOP(float);
        } else {
            DROPOUT_LOOP(double);
        }
    }
    WEFT_CHECK_GOTO(weft__op_node_begin("DropoutBackward", dropout_backward, 1, &a, &n), st,
                    err_release_out);
    if (n != NULL) {
        n->iargs[0] = drop;
        n->dargs[0] = scale;
        st = drop ? weft__ag_save(n, mask_t) : WEFT_OK;
        WEFT_CHECK_GOTO(weft__op_node_end(n, st, out), st, err_release_out);
    }
    weft_tensor_release(mask_t);
    *out_p = out;
    return WEFT_OK;

err_release_out:
    weft_tensor_release(mask_t);
    weft_tensor_release(out);
    return st;
}
