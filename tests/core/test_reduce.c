/* core: reduction kernels against reference loops, AVG finish, op checks, f16/bf16 conversions. */
#include <criterion/criterion.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <weft/weft.h>

TestSuite(reduce, .timeout = 120);

/* ---- helpers --------------------------------------------------------------------------------- */

static uint64_t rng;

static uint64_t rnd(void)
{
    /* xorshift64* */
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return rng * UINT64_C(2685821657736338717);
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint64_t f64_bits(double f)
{
    uint64_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static int f16_is_nan(uint16_t h)
{
    return (h & 0x7c00u) == 0x7c00u && (h & 0x03ffu) != 0;
}

static int bf16_is_nan(uint16_t h)
{
    return (h & 0x7f80u) == 0x7f80u && (h & 0x007fu) != 0;
}

static const weft_dtype_t reduce_dtypes[] = {WEFT_F32, WEFT_F64, WEFT_F16, WEFT_BF16,
                                             WEFT_I8,  WEFT_I32, WEFT_I64, WEFT_U8};

/* A float for the random data: mostly small values (sums and products stay finite and
 * interesting), sometimes a special one. */
static double rnd_value(void)
{
    static const double specials[] = {0.0,  -0.0,  INFINITY, -INFINITY, NAN,     -NAN,
                                      1e38, -3e38, 1e-40,    1e-310,    65504.0, 1.0};
    uint64_t r = rnd();

    if (r % 16 == 0) {
        return specials[(r >> 8) % (sizeof specials / sizeof specials[0])];
    }
    return ((double)(int64_t)(r >> 11) / (double)(INT64_C(1) << 50)) - 4.0; /* [-4, 4) */
}

static void fill_random(weft_dtype_t dt, void *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint64_t r = rnd();
        switch (dt) {
        case WEFT_F32:
            ((float *)p)[i] = (float)rnd_value();
            break;
        case WEFT_F64:
            ((double *)p)[i] = rnd_value();
            break;
        case WEFT_F16:
            /* half raw bit patterns (NaN, inf, subnormals), half small values */
            ((uint16_t *)p)[i] =
                (r & 1) ? (uint16_t)(r >> 16) : weft_f32_to_f16((float)rnd_value());
            break;
        case WEFT_BF16:
            ((uint16_t *)p)[i] =
                (r & 1) ? (uint16_t)(r >> 16) : weft_f32_to_bf16((float)rnd_value());
            break;
        default:
            memcpy((char *)p + i * weft_dtype_size(dt), &r, weft_dtype_size(dt));
            break;
        }
    }
}

static int64_t get_int(weft_dtype_t dt, const void *p, size_t i)
{
    switch (dt) {
    case WEFT_I8:
        return ((const int8_t *)p)[i];
    case WEFT_U8:
        return ((const uint8_t *)p)[i];
    case WEFT_I32:
        return ((const int32_t *)p)[i];
    default:
        return ((const int64_t *)p)[i];
    }
}

static void put_int(weft_dtype_t dt, void *p, size_t i, uint64_t v)
{
    switch (dt) {
    case WEFT_I8:
        ((int8_t *)p)[i] = (int8_t)(uint8_t)v;
        break;
    case WEFT_U8:
        ((uint8_t *)p)[i] = (uint8_t)v;
        break;
    case WEFT_I32:
        ((int32_t *)p)[i] = (int32_t)(uint32_t)v;
        break;
    default:
        ((int64_t *)p)[i] = (int64_t)v;
        break;
    }
}

static double ref_float_op(weft_reduce_op_t op, double x, double y)
{
    switch (op) {
    case WEFT_SUM:
    case WEFT_AVG:
        return x + y;
    case WEFT_PRODUCT:
        return x * y;
    case WEFT_MIN:
        return isnan(x) || isnan(y) ? NAN : (x < y ? x : y);
    case WEFT_MAX:
        return isnan(x) || isnan(y) ? NAN : (x > y ? x : y);
    default:
        cr_assert_fail("not a float op: %d", op);
        return 0;
    }
}

static float ref_float_op_f(weft_reduce_op_t op, float x, float y)
{
    switch (op) {
    case WEFT_SUM:
    case WEFT_AVG:
        return x + y;
    case WEFT_PRODUCT:
        return x * y;
    default:
        return (float)ref_float_op(op, x, y); /* min/max pick an operand: exact */
    }
}

/* out[i] = a[i] (op) b[i], one element at a time, the obvious way. */
static void ref_reduce(weft_dtype_t dt, weft_reduce_op_t op, void *out, const void *a,
                       const void *b, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        switch (dt) {
        case WEFT_F32:
            ((float *)out)[i] = ref_float_op_f(op, ((const float *)a)[i], ((const float *)b)[i]);
            break;
        case WEFT_F64:
            ((double *)out)[i] = ref_float_op(op, ((const double *)a)[i], ((const double *)b)[i]);
            break;
        case WEFT_F16:
            ((uint16_t *)out)[i] =
                weft_f32_to_f16(ref_float_op_f(op, weft_f16_to_f32(((const uint16_t *)a)[i]),
                                               weft_f16_to_f32(((const uint16_t *)b)[i])));
            break;
        case WEFT_BF16:
            ((uint16_t *)out)[i] =
                weft_f32_to_bf16(ref_float_op_f(op, weft_bf16_to_f32(((const uint16_t *)a)[i]),
                                                weft_bf16_to_f32(((const uint16_t *)b)[i])));
            break;
        default: {
            int64_t x = get_int(dt, a, i);
            int64_t y = get_int(dt, b, i);
            uint64_t r;
            switch (op) {
            case WEFT_SUM:
            case WEFT_AVG:
                r = (uint64_t)x + (uint64_t)y;
                break;
            case WEFT_PRODUCT:
                r = (uint64_t)x * (uint64_t)y;
                break;
            case WEFT_MIN:
                r = (uint64_t)(x < y ? x : y);
                break;
            case WEFT_MAX:
                r = (uint64_t)(x > y ? x : y);
                break;
            case WEFT_BAND:
                r = (uint64_t)x & (uint64_t)y;
                break;
            case WEFT_BOR:
                r = (uint64_t)x | (uint64_t)y;
                break;
            default:
                r = (uint64_t)x ^ (uint64_t)y;
                break;
            }
            put_int(dt, out, i, r);
            break;
        }
        }
    }
}

/* Bit-for-bit equal, except that any NaN matches any NaN. */
static void assert_same(weft_dtype_t dt, weft_reduce_op_t op, const void *got, const void *want,
                        size_t n, const char *mode, size_t off)
{
    for (size_t i = 0; i < n; i++) {
        int same;
        switch (dt) {
        case WEFT_F32: {
            float g = ((const float *)got)[i];
            float w = ((const float *)want)[i];
            same = (isnan(g) && isnan(w)) || f32_bits(g) == f32_bits(w);
            break;
        }
        case WEFT_F64: {
            double g = ((const double *)got)[i];
            double w = ((const double *)want)[i];
            same = (isnan(g) && isnan(w)) || f64_bits(g) == f64_bits(w);
            break;
        }
        case WEFT_F16: {
            uint16_t g = ((const uint16_t *)got)[i];
            uint16_t w = ((const uint16_t *)want)[i];
            same = (f16_is_nan(g) && f16_is_nan(w)) || g == w;
            break;
        }
        case WEFT_BF16: {
            uint16_t g = ((const uint16_t *)got)[i];
            uint16_t w = ((const uint16_t *)want)[i];
            same = (bf16_is_nan(g) && bf16_is_nan(w)) || g == w;
            break;
        }
        default:
            same = get_int(dt, got, i) == get_int(dt, want, i);
            break;
        }
        cr_assert(same, "%s %s, %s, n=%zu offset=%zu: element %zu differs", weft_dtype_name(dt),
                  weft_reduce_op_name(op), mode, n, off, i);
    }
}

/* A buffer of n elements at byte offset `off` in a 64-byte aligned block whose other bytes are a
 * guard pattern. */
typedef struct {
    unsigned char *block;
    size_t total;
    void *data;
} guarded_t;

#define GUARD_BYTE 0xa5

static void guarded_init(guarded_t *g, size_t n, size_t size, size_t off, const void *src)
{
    g->total = (off + n * size + 64 + 63) / 64 * 64;
    g->block = aligned_alloc(64, g->total);
    cr_assert_not_null(g->block);
    memset(g->block, GUARD_BYTE, g->total);
    g->data = g->block + off;
    if (src != NULL && n > 0) {
        memcpy(g->data, src, n * size);
    }
}

static void guarded_check_free(guarded_t *g, size_t n, size_t size, size_t off)
{
    for (size_t i = 0; i < g->total; i++) {
        if (i < off || i >= off + n * size) {
            cr_assert_eq(g->block[i], GUARD_BYTE, "byte %zu outside the buffer was written", i);
        }
    }
    free(g->block);
}

/* Every way of calling the kernels for one (dtype, op, n, offset) against the reference. */
static void check_kernels(weft_dtype_t dt, weft_reduce_op_t op, size_t n, size_t off)
{
    size_t size = weft_dtype_size(dt);
    size_t bytes = n * size + 1;
    void *a = malloc(bytes);
    void *b = malloc(bytes);
    void *want = malloc(bytes);
    void *want_self = malloc(bytes);
    guarded_t ga, gb, gd;

    cr_assert(a != NULL && b != NULL && want != NULL && want_self != NULL);
    fill_random(dt, a, n);
    fill_random(dt, b, n);
    ref_reduce(dt, op, want, a, b, n);
    ref_reduce(dt, op, want_self, a, a, n);

    /* into: dst = a, src = b */
    guarded_init(&gd, n, size, off, a);
    guarded_init(&gb, n, size, off, b);
    weft_reduce_into(gd.data, gb.data, n, dt, op);
    assert_same(dt, op, gd.data, want, n, "into", off);
    assert_same(dt, op, gb.data, b, n, "into (src unchanged)", off);
    guarded_check_free(&gd, n, size, off);

    /* to, three distinct buffers */
    guarded_init(&ga, n, size, off, a);
    guarded_init(&gd, n, size, off, NULL);
    weft_reduce_to(gd.data, ga.data, gb.data, n, dt, op);
    assert_same(dt, op, gd.data, want, n, "to", off);
    assert_same(dt, op, ga.data, a, n, "to (a unchanged)", off);
    assert_same(dt, op, gb.data, b, n, "to (b unchanged)", off);
    guarded_check_free(&gd, n, size, off);

    /* to, dst == a */
    weft_reduce_to(ga.data, ga.data, gb.data, n, dt, op);
    assert_same(dt, op, ga.data, want, n, "to dst==a", off);
    guarded_check_free(&ga, n, size, off);

    /* to, dst == b (operand order kept: a op b) */
    guarded_init(&ga, n, size, off, a);
    weft_reduce_to(gb.data, ga.data, gb.data, n, dt, op);
    assert_same(dt, op, gb.data, want, n, "to dst==b", off);
    guarded_check_free(&gb, n, size, off);

    /* into itself, and to with all three the same */
    weft_reduce_into(ga.data, ga.data, n, dt, op);
    assert_same(dt, op, ga.data, want_self, n, "into dst==src", off);
    memcpy(ga.data, a, n * size);
    weft_reduce_to(ga.data, ga.data, ga.data, n, dt, op);
    assert_same(dt, op, ga.data, want_self, n, "to dst==a==b", off);
    guarded_check_free(&ga, n, size, off);

    /* to, a == b, dst distinct */
    guarded_init(&ga, n, size, off, a);
    guarded_init(&gd, n, size, off, NULL);
    weft_reduce_to(gd.data, ga.data, ga.data, n, dt, op);
    assert_same(dt, op, gd.data, want_self, n, "to a==b", off);
    guarded_check_free(&gd, n, size, off);
    guarded_check_free(&ga, n, size, off);

    free(a);
    free(b);
    free(want);
    free(want_self);
}

static void check_dtype(weft_dtype_t dt)
{
    static const size_t sizes[] = {0, 1, 7, 64, 1000, 4097};
    size_t size = weft_dtype_size(dt);
    int ops_run = 0;

    rng = UINT64_C(0x9e3779b97f4a7c15) + (uint64_t)dt;
    for (int op = 0; op < WEFT_REDUCE_OP_COUNT; op++) {
        if (weft_reduce_check((weft_reduce_op_t)op, dt) != WEFT_OK) {
            continue;
        }
        ops_run++;
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
            check_kernels(dt, (weft_reduce_op_t)op, sizes[s], 64);   /* aligned */
            check_kernels(dt, (weft_reduce_op_t)op, sizes[s], size); /* one element off */
        }
    }
    cr_assert_eq(ops_run,
                 dt == WEFT_F32 || dt == WEFT_F64 || dt == WEFT_F16 || dt == WEFT_BF16 ? 5 : 8);
}

/* ---- kernels --------------------------------------------------------------------------------- */

Test(reduce, kernels_f32)
{
    check_dtype(WEFT_F32);
}

Test(reduce, kernels_f64)
{
    check_dtype(WEFT_F64);
}

Test(reduce, kernels_f16)
{
    check_dtype(WEFT_F16);
}

Test(reduce, kernels_bf16)
{
    check_dtype(WEFT_BF16);
}

Test(reduce, kernels_i8)
{
    check_dtype(WEFT_I8);
}

Test(reduce, kernels_i32)
{
    check_dtype(WEFT_I32);
}

Test(reduce, kernels_i64)
{
    check_dtype(WEFT_I64);
}

Test(reduce, kernels_u8)
{
    check_dtype(WEFT_U8);
}

Test(reduce, integer_wraparound_and_signedness)
{
    int8_t i8a[] = {127, -128, -1, 100};
    int8_t i8b[] = {1, -1, 1, 3};
    uint8_t u8a[] = {255, 200, 255, 0x0f};
    uint8_t u8b[] = {1, 2, 1, 0xf0};
    int32_t i32a[] = {INT32_MAX, INT32_MIN};
    int32_t i32b[] = {1, -1};
    int64_t i64a[] = {INT64_MAX, INT64_C(1) << 62};
    int64_t i64b[] = {1, 4};

    weft_reduce_into(i8a, i8b, 4, WEFT_I8, WEFT_SUM);
    cr_assert(i8a[0] == -128 && i8a[1] == 127 && i8a[2] == 0 && i8a[3] == 103);
    weft_reduce_into(i8a, i8b, 4, WEFT_I8, WEFT_PRODUCT);
    cr_assert(i8a[0] == -128 && i8a[1] == -127 && i8a[2] == 0 && i8a[3] == 53); /* 309 - 256 */
    weft_reduce_into(i8a, i8b, 4, WEFT_I8, WEFT_MIN);
    cr_assert(i8a[0] == -128 && i8a[1] == -127 && i8a[2] == 0 && i8a[3] == 3);

    weft_reduce_into(u8a, u8b, 4, WEFT_U8, WEFT_MAX); /* unsigned: 255 > 1 */
    cr_assert(u8a[0] == 255 && u8a[1] == 200 && u8a[2] == 255 && u8a[3] == 0xf0);
    weft_reduce_into(u8a, u8b, 4, WEFT_U8, WEFT_SUM);
    cr_assert(u8a[0] == 0 && u8a[1] == 202 && u8a[2] == 0 && u8a[3] == 0xe0);
    weft_reduce_into(u8a, u8b, 4, WEFT_U8, WEFT_PRODUCT);
    cr_assert(u8a[0] == 0 && u8a[1] == 148 && u8a[2] == 0 && u8a[3] == 0x00); /* 404 - 256 */

    weft_reduce_into(i32a, i32b, 2, WEFT_I32, WEFT_SUM);
    cr_assert(i32a[0] == INT32_MIN && i32a[1] == INT32_MAX);
    weft_reduce_to(i64a, i64a, i64b, 2, WEFT_I64, WEFT_SUM);
    cr_assert(i64a[0] == INT64_MIN && i64a[1] == (INT64_C(1) << 62) + 4);
    i64a[1] = INT64_C(1) << 62;
    weft_reduce_to(i64a, i64a, i64b, 2, WEFT_I64, WEFT_PRODUCT);
    cr_assert(i64a[0] == INT64_MIN && i64a[1] == 0);
}

Test(reduce, bitwise)
{
    uint8_t u8a[] = {0xf0, 0x3c};
    uint8_t u8b[] = {0x0f, 0x0c};
    int32_t i32a[] = {-1, 0x12345678};
    int32_t i32b[] = {0x0000ff00, 0x0f0f0f0f};
    int32_t out[2];

    weft_reduce_into(u8a, u8b, 2, WEFT_U8, WEFT_BOR);
    cr_assert(u8a[0] == 0xff && u8a[1] == 0x3c);
    weft_reduce_into(u8a, u8b, 2, WEFT_U8, WEFT_BXOR);
    cr_assert(u8a[0] == 0xf0 && u8a[1] == 0x30);
    weft_reduce_to(out, i32a, i32b, 2, WEFT_I32, WEFT_BAND);
    cr_assert(out[0] == 0x0000ff00 && out[1] == 0x02040608);
    weft_reduce_to(out, i32a, i32b, 2, WEFT_I32, WEFT_BXOR);
    cr_assert(out[0] == (int32_t)0xffff00ff && out[1] == 0x1d3b5977);
}

Test(reduce, float_min_max_nan)
{
    float a[] = {NAN, 1.0f, -INFINITY, 2.0f, -0.5f, NAN};
    float b[] = {1.0f, NAN, 1.0f, INFINITY, -0.25f, NAN};
    float lo[6];
    float hi[6];
    uint16_t ha[6];
    uint16_t hb[6];

    weft_reduce_to(lo, a, b, 6, WEFT_F32, WEFT_MIN);
    weft_reduce_to(hi, a, b, 6, WEFT_F32, WEFT_MAX);
    cr_assert(isnan(lo[0]) && isnan(lo[1]) && lo[2] == -INFINITY && lo[3] == 2.0f &&
              lo[4] == -0.5f && isnan(lo[5]));
    cr_assert(isnan(hi[0]) && isnan(hi[1]) && hi[2] == 1.0f && hi[3] == INFINITY &&
              hi[4] == -0.25f && isnan(hi[5]));

    for (int i = 0; i < 6; i++) {
        ha[i] = weft_f32_to_f16(a[i]);
        hb[i] = weft_f32_to_f16(b[i]);
    }
    weft_reduce_into(ha, hb, 6, WEFT_F16, WEFT_MAX);
    cr_assert(f16_is_nan(ha[0]) && f16_is_nan(ha[1]) && f16_is_nan(ha[5]));
    cr_assert(ha[2] == 0x3c00 && ha[3] == 0x7c00 && ha[4] == 0xb400); /* 1, inf, -0.25 */
}

Test(reduce, f16_bf16_round_after_each_op)
{
    /* 2048 + 1 is not an f16: the f32 sum 2049 rounds to even, 2048; a second +1 again 2048 */
    uint16_t acc[] = {weft_f32_to_f16(2048.0f)};
    uint16_t one[] = {weft_f32_to_f16(1.0f)};
    uint16_t bacc[] = {weft_f32_to_bf16(256.0f)};
    uint16_t bone[] = {weft_f32_to_bf16(1.0f)};

    weft_reduce_into(acc, one, 1, WEFT_F16, WEFT_SUM);
    weft_reduce_into(acc, one, 1, WEFT_F16, WEFT_SUM);
    cr_assert_eq(acc[0], 0x6800); /* 2048 */
    one[0] = weft_f32_to_f16(3.0f);
    weft_reduce_into(acc, one, 1, WEFT_F16, WEFT_SUM); /* 2051 -> 2052 */
    cr_assert_eq(weft_f16_to_f32(acc[0]), 2052.0f);
    weft_reduce_into(bacc, bone, 1, WEFT_BF16, WEFT_SUM); /* 257 -> 256 */
    cr_assert_eq(weft_bf16_to_f32(bacc[0]), 256.0f);
}

Test(reduce, refused_pairs_leave_dst_unchanged)
{
    float f[] = {1.5f, -2.0f};
    float g[] = {3.0f, 4.0f};
    uint8_t bl[] = {1, 0};
    uint8_t bm[] = {1, 1};

    weft_reduce_into(f, g, 2, WEFT_F32, WEFT_BXOR);
    cr_assert(f[0] == 1.5f && f[1] == -2.0f);
    weft_reduce_into(bl, bm, 2, WEFT_BOOL, WEFT_SUM);
    cr_assert(bl[0] == 1 && bl[1] == 0);
    weft_reduce_into(f, g, 2, WEFT_F32, WEFT_REDUCE_OP_COUNT);
    weft_reduce_into(f, g, 2, WEFT_DTYPE_COUNT, WEFT_SUM);
    cr_assert(f[0] == 1.5f && f[1] == -2.0f);
    /* n == 0 touches nothing */
    weft_reduce_into(NULL, NULL, 0, WEFT_F32, WEFT_SUM);
    weft_reduce_to(NULL, NULL, NULL, 0, WEFT_I64, WEFT_MAX);
    weft_reduce_finish(NULL, 0, WEFT_F32, WEFT_AVG, 4);
}

/* ---- check and names ------------------------------------------------------------------------- */

Test(reduce, op_names)
{
    const char *names[] = {"sum", "avg", "product", "min", "max", "band", "bor", "bxor"};

    for (int op = 0; op < WEFT_REDUCE_OP_COUNT; op++) {
        cr_assert_str_eq(weft_reduce_op_name((weft_reduce_op_t)op), names[op]);
    }
    cr_assert_str_eq(weft_reduce_op_name(WEFT_REDUCE_OP_COUNT), "invalid");
    cr_assert_str_eq(weft_reduce_op_name((weft_reduce_op_t)-1), "invalid");
}

Test(reduce, check)
{
    for (size_t d = 0; d < sizeof reduce_dtypes / sizeof reduce_dtypes[0]; d++) {
        weft_dtype_t dt = reduce_dtypes[d];
        int is_float = dt == WEFT_F32 || dt == WEFT_F64 || dt == WEFT_F16 || dt == WEFT_BF16;
        for (int op = 0; op < WEFT_REDUCE_OP_COUNT; op++) {
            int bitwise = op == WEFT_BAND || op == WEFT_BOR || op == WEFT_BXOR;
            weft_status_t want = (bitwise && is_float) ? WEFT_ERR_DTYPE : WEFT_OK;
            cr_assert_eq(weft_reduce_check((weft_reduce_op_t)op, dt), want, "%s %s",
                         weft_reduce_op_name((weft_reduce_op_t)op), weft_dtype_name(dt));
        }
    }
    cr_assert_eq(weft_reduce_check(WEFT_SUM, WEFT_U8), WEFT_OK);

    cr_assert_eq(weft_reduce_check(WEFT_BXOR, WEFT_F32), WEFT_ERR_DTYPE);
    cr_assert_str_eq(weft_last_error(), "reduce: bxor applies to integer dtypes, not f32");
    cr_assert_eq(weft_reduce_check(WEFT_BAND, WEFT_BF16), WEFT_ERR_DTYPE);
    cr_assert_str_eq(weft_last_error(), "reduce: band applies to integer dtypes, not bf16");

    for (int op = 0; op < WEFT_REDUCE_OP_COUNT; op++) {
        cr_assert_eq(weft_reduce_check((weft_reduce_op_t)op, WEFT_BOOL), WEFT_ERR_DTYPE);
    }
    cr_assert_str_eq(weft_last_error(), "reduce: bxor does not apply to bool");

    cr_assert_eq(weft_reduce_check(WEFT_REDUCE_OP_COUNT, WEFT_F32), WEFT_ERR_INVALID_ARG);
    cr_assert_str_eq(weft_last_error(), "reduce: invalid op 8");
    cr_assert_eq(weft_reduce_check((weft_reduce_op_t)-1, WEFT_F32), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(weft_reduce_check(WEFT_SUM, WEFT_DTYPE_COUNT), WEFT_ERR_INVALID_ARG);
    cr_assert_str_eq(weft_last_error(), "reduce: invalid dtype 9");
    cr_assert_eq(weft_reduce_check(WEFT_SUM, (weft_dtype_t)-2), WEFT_ERR_INVALID_ARG);
}

/* ---- AVG ------------------------------------------------------------------------------------- */

static void check_finish_half_known(void)
{
    uint16_t h[] = {0x3c00, 0xc700, 0x7bff, 0x0001, 0x0003}; /* 1, -7, 65504, 2^-24, 3*2^-24 */
    uint16_t bf[] = {0x3f80, 0xc0e0, 0x7f7f, 0x0001};        /* 1, -7, max, 2^-133 */

    weft_reduce_finish(h, 5, WEFT_F16, WEFT_AVG, 3);
    cr_assert_eq(h[0], 0x3555); /* 1/3 in f16 */
    cr_assert_eq(h[1], 0xc0ab); /* -7/3 = -2.3333: -2.333984375 */
    cr_assert_eq(h[2], 0x7555); /* 21834.67 -> 21840 */
    cr_assert_eq(h[3], 0x0000); /* 2^-24 / 3 -> 0 */
    cr_assert_eq(h[4], 0x0001); /* 3*2^-24 / 3 */

    weft_reduce_finish(bf, 4, WEFT_BF16, WEFT_AVG, 3);
    cr_assert_eq(bf[0], 0x3eab); /* 1/3 in bf16 */
    cr_assert_eq(bf[1], 0xc015); /* -7/3: -2.328125 */
    cr_assert_eq(bf[2], weft_f32_to_bf16(weft_bf16_to_f32(0x7f7f) / 3.0f));
    cr_assert_eq(bf[3], 0x0000);
}

/* AVG finish of random data against x / count computed in f64 and rounded to the dtype (for
 * f16/bf16 through f32: each rounding keeps enough bits for the result to be the correctly
 * rounded quotient). */
static void check_finish_random(void)
{
    static const int counts[] = {2, 3, 7, 1000};
    const size_t n = 1003;

    rng = 99;
    for (size_t d = 0; d < sizeof reduce_dtypes / sizeof reduce_dtypes[0]; d++) {
        weft_dtype_t dt = reduce_dtypes[d];
        size_t size = weft_dtype_size(dt);
        void *x = malloc(n * size);
        void *want = malloc(n * size);
        cr_assert(x != NULL && want != NULL);
        for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
            int count = counts[c];
            fill_random(dt, x, n);
            for (size_t i = 0; i < n; i++) {
                switch (dt) {
                case WEFT_F32:
                    ((float *)want)[i] = (float)((double)((float *)x)[i] / count);
                    break;
                case WEFT_F64:
                    ((double *)want)[i] = ((double *)x)[i] / count;
                    break;
                case WEFT_F16:
                    ((uint16_t *)want)[i] = weft_f32_to_f16(
                        (float)((double)weft_f16_to_f32(((uint16_t *)x)[i]) / count));
                    break;
                case WEFT_BF16:
                    ((uint16_t *)want)[i] = weft_f32_to_bf16(
                        (float)((double)weft_bf16_to_f32(((uint16_t *)x)[i]) / count));
                    break;
                default:
                    put_int(dt, want, i, (uint64_t)(get_int(dt, x, i) / count));
                    break;
                }
            }
            weft_reduce_finish(x, n, dt, WEFT_AVG, count);
            assert_same(dt, WEFT_AVG, x, want, n, "finish", 0);
        }
        free(x);
        free(want);
    }
}

Test(reduce, finish_avg_random)
{
    check_finish_random();
}

/*
 * The portable f16/bf16 kernels, where the CPU would otherwise get vector paths (F16C, AVX2).
 * Relies on criterion running each test in its own process: the choice is made at first use.
 */
Test(reduce, kernels_half_portable)
{
    cr_assert_eq(setenv("WEFT_REDUCE_SIMD", "0", 1), 0);
    check_dtype(WEFT_F16);
    check_dtype(WEFT_BF16);
    check_finish_half_known();
    check_finish_random();
}

Test(reduce, finish_avg_float)
{
    float f[] = {1.0f, -7.0f, 3.5f, 1e30f, NAN, INFINITY, -0.0f, FLT_MAX, 0x1p-149f};
    double d[] = {1.0, -7.0, 1e300, -0.0, 0x1p-1074};

    weft_reduce_finish(f, 9, WEFT_F32, WEFT_AVG, 3);
    cr_assert_eq(f32_bits(f[0]), f32_bits(1.0f / 3.0f));
    cr_assert_eq(f32_bits(f[0]), 0x3eaaaaabu);
    cr_assert_eq(f[1], -7.0f / 3.0f);
    cr_assert_eq(f[2], 3.5f / 3.0f);
    cr_assert_eq(f[3], 1e30f / 3.0f);
    cr_assert(isnan(f[4]));
    cr_assert_eq(f[5], INFINITY);
    cr_assert_eq(f32_bits(f[6]), 0x80000000u);
    cr_assert_eq(f[7], FLT_MAX / 3.0f);
    cr_assert_eq(f32_bits(f[8]), 0u); /* 2^-149 / 3 rounds to 0 */

    weft_reduce_finish(d, 5, WEFT_F64, WEFT_AVG, 2);
    cr_assert(d[0] == 0.5 && d[1] == -3.5 && d[2] == 5e299);
    cr_assert_eq(f64_bits(d[3]), UINT64_C(0x8000000000000000));
    cr_assert_eq(f64_bits(d[4]), 0u); /* 2^-1074 / 2: tie, to even 0 */

    check_finish_half_known();

    /* a count past 2^24 still divides exactly */
    f[0] = 33554436.0f; /* 2^25 + 4 */
    weft_reduce_finish(f, 1, WEFT_F32, WEFT_AVG, (1 << 25) + 4);
    cr_assert_eq(f[0], 1.0f);
    f[0] = 1.0f;
    weft_reduce_finish(f, 1, WEFT_F32, WEFT_AVG, (1 << 24) + 1);
    cr_assert_eq(f[0], (float)(1.0 / 16777217.0));
}

Test(reduce, finish_avg_int)
{
    int8_t i8[] = {-7, 7, -128, 127, -1};
    uint8_t u8[] = {255, 7, 1};
    int32_t i32[] = {-7, 7, -8, INT32_MIN, INT32_MAX};
    int64_t i64[] = {-7, INT64_MIN, INT64_MAX, -3};

    weft_reduce_finish(i8, 5, WEFT_I8, WEFT_AVG, 2);
    cr_assert(i8[0] == -3 && i8[1] == 3 && i8[2] == -64 && i8[3] == 63 && i8[4] == 0);
    weft_reduce_finish(u8, 3, WEFT_U8, WEFT_AVG, 2);
    cr_assert(u8[0] == 127 && u8[1] == 3 && u8[2] == 0);
    weft_reduce_finish(i32, 5, WEFT_I32, WEFT_AVG, 2);
    cr_assert(i32[0] == -3 && i32[1] == 3 && i32[2] == -4 && i32[3] == INT32_MIN / 2 &&
              i32[4] == INT32_MAX / 2);
    weft_reduce_finish(i64, 4, WEFT_I64, WEFT_AVG, 3);
    cr_assert(i64[0] == -2 && i64[1] == INT64_MIN / 3 && i64[2] == INT64_MAX / 3 && i64[3] == -1);
    u8[0] = 200;
    weft_reduce_finish(u8, 1, WEFT_U8, WEFT_AVG, 1000);
    cr_assert_eq(u8[0], 0);
}

Test(reduce, finish_other_ops_and_count_one_unchanged)
{
    float f[] = {3.0f, -7.0f};
    int32_t i[] = {-7, 9};

    for (int op = 0; op < WEFT_REDUCE_OP_COUNT; op++) {
        if (op != WEFT_AVG) {
            weft_reduce_finish(f, 2, WEFT_F32, (weft_reduce_op_t)op, 4);
            weft_reduce_finish(i, 2, WEFT_I32, (weft_reduce_op_t)op, 4);
        }
    }
    weft_reduce_finish(f, 2, WEFT_F32, WEFT_AVG, 1);
    weft_reduce_finish(i, 2, WEFT_I32, WEFT_AVG, 1);
    cr_assert(f[0] == 3.0f && f[1] == -7.0f && i[0] == -7 && i[1] == 9);
}

Test(reduce, avg_of_three_contributions)
{
    float r0[] = {1.0f, 2.0f, -3.0f};
    float r1[] = {2.0f, 2.0f, 0.5f};
    float r2[] = {3.0f, 5.0f, 1.0f};
    int32_t i0[] = {1, -5, 100};
    int32_t i1[] = {2, -1, 1};
    int32_t i2[] = {4, -1, 0};
    float out[3];

    weft_reduce_to(out, r0, r1, 3, WEFT_F32, WEFT_AVG);
    weft_reduce_into(out, r2, 3, WEFT_F32, WEFT_AVG);
    weft_reduce_finish(out, 3, WEFT_F32, WEFT_AVG, 3);
    cr_assert(out[0] == 2.0f && out[1] == 3.0f && out[2] == -1.5f / 3.0f);

    weft_reduce_into(i0, i1, 3, WEFT_I32, WEFT_AVG);
    weft_reduce_into(i0, i2, 3, WEFT_I32, WEFT_AVG);
    weft_reduce_finish(i0, 3, WEFT_I32, WEFT_AVG, 3);
    cr_assert(i0[0] == 2 && i0[1] == -2 && i0[2] == 33); /* 7/3, -7/3, 101/3 */
}

/* ---- conversions ----------------------------------------------------------------------------- */

/* Exact value of a non-NaN f16 (inf for 0x7c00), computed independently of the library. */
static double ref_f16_value(uint16_t h)
{
    int e = (h >> 10) & 31;
    int m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : (e == 31 ? INFINITY : ldexp(1024 + m, e - 25));

    return (h & 0x8000) ? -v : v;
}

static double ref_bf16_value(uint16_t h)
{
    int e = (h >> 7) & 255;
    int m = h & 127;
    double v = e == 0 ? ldexp(m, -133) : (e == 255 ? INFINITY : ldexp(128 + m, e - 134));

    return (h & 0x8000) ? -v : v;
}

/*
 * Nearest-even rounding of a non-NaN float into a 16-bit format whose positive patterns
 * 0..inf_bits are ordered by value, by binary search and midpoints (exact in double). Beyond the
 * largest finite value, inf plays the next step up (2^16 for f16, 2^128 for bf16), as IEEE
 * overflow does.
 */
static uint16_t ref_round(float f, uint16_t inf_bits, double (*value)(uint16_t), double inf_step)
{
    double a = fabs((double)f);
    uint16_t sign = signbit(f) ? 0x8000 : 0;
    uint32_t lo = 0;
    uint32_t hi = inf_bits;

    if (isinf(f)) {
        return sign | inf_bits;
    }
    /* largest pattern in [0, inf_bits] whose value is <= a */
    while (lo < hi) {
        uint32_t mid = (lo + hi + 1) / 2;
        double v = mid == inf_bits ? inf_step : value((uint16_t)mid);
        if (v <= a) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    if (lo == inf_bits) {
        return sign | inf_bits;
    }
    double v_lo = value((uint16_t)lo);
    double v_hi = lo + 1 == inf_bits ? inf_step : value((uint16_t)(lo + 1));
    double midpoint = (v_lo + v_hi) / 2;
    uint32_t r = a < midpoint ? lo : (a > midpoint ? lo + 1 : ((lo & 1) ? lo + 1 : lo));
    return (uint16_t)(sign | r);
}

static uint16_t ref_f32_to_f16(float f)
{
    return ref_round(f, 0x7c00, ref_f16_value, 65536.0);
}

static uint16_t ref_f32_to_bf16(float f)
{
    return ref_round(f, 0x7f80, ref_bf16_value, ldexp(1.0, 128));
}

Test(reduce, f16_known_values)
{
    cr_assert_eq(weft_f32_to_f16(1.0f), 0x3c00);
    cr_assert_eq(weft_f16_to_f32(0x3c00), 1.0f);
    cr_assert_eq(weft_f32_to_f16(-2.5f), 0xc100);
    cr_assert_eq(weft_f16_to_f32(0xc100), -2.5f);
    cr_assert_eq(weft_f32_to_f16(65504.0f), 0x7bff);
    cr_assert_eq(weft_f16_to_f32(0x7bff), 65504.0f);
    cr_assert_eq(weft_f32_to_f16(65519.99f), 0x7bff);
    cr_assert_eq(weft_f32_to_f16(65520.0f), 0x7c00); /* halfway to 2^16: to even, inf */
    cr_assert_eq(weft_f32_to_f16(-65520.0f), 0xfc00);
    cr_assert_eq(weft_f32_to_f16(1e10f), 0x7c00);
    cr_assert_eq(weft_f32_to_f16(FLT_MAX), 0x7c00);
    cr_assert_eq(weft_f32_to_f16(INFINITY), 0x7c00);
    cr_assert_eq(weft_f32_to_f16(-INFINITY), 0xfc00);
    cr_assert_eq(weft_f16_to_f32(0x7c00), INFINITY);
    cr_assert_eq(weft_f16_to_f32(0xfc00), -INFINITY);

    /* subnormals */
    cr_assert_eq(weft_f32_to_f16(0x1p-24f), 0x0001);
    cr_assert_eq(weft_f16_to_f32(0x0001), 0x1p-24f);
    cr_assert_eq(weft_f16_to_f32(0x03ff), 0x1.ff8p-15f); /* largest subnormal */
    cr_assert_eq(weft_f32_to_f16(0x1.ff8p-15f), 0x03ff);
    cr_assert_eq(weft_f32_to_f16(0x1p-14f), 0x0400);     /* smallest normal */
    cr_assert_eq(weft_f32_to_f16(0x1.ffcp-15f), 0x0400); /* halfway 0x3ff/0x400: to even */
    cr_assert_eq(weft_f32_to_f16(0x1p-25f), 0x0000);     /* halfway 0/2^-24: to even 0 */
    cr_assert_eq(weft_f32_to_f16(0x1.8p-25f), 0x0001);
    cr_assert_eq(weft_f32_to_f16(0x1.8p-24f), 0x0002); /* halfway 1/2: to even 2 */
    cr_assert_eq(weft_f32_to_f16(-0x1p-24f), 0x8001);
    cr_assert_eq(weft_f32_to_f16(0x1p-149f), 0x0000);

    /* ties to even among normals */
    cr_assert_eq(weft_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);
    cr_assert_eq(weft_f32_to_f16(1.0f + 0x3p-11f), 0x3c02);
    cr_assert_eq(weft_f32_to_f16(1.0f + 0x1p-11f + 0x1p-23f), 0x3c01);

    /* zeros keep their sign */
    cr_assert_eq(weft_f32_to_f16(0.0f), 0x0000);
    cr_assert_eq(weft_f32_to_f16(-0.0f), 0x8000);
    cr_assert_eq(f32_bits(weft_f16_to_f32(0x0000)), 0x00000000u);
    cr_assert_eq(f32_bits(weft_f16_to_f32(0x8000)), 0x80000000u);

    /* NaN stays NaN, sign kept; f16 -> f32 keeps the payload */
    cr_assert(f16_is_nan(weft_f32_to_f16(NAN)));
    cr_assert(f16_is_nan(weft_f32_to_f16(bits_f32(0x7f800001u)))); /* low payload bits only */
    cr_assert_eq(weft_f32_to_f16(-NAN) & 0x8000, 0x8000);
    cr_assert(isnan(weft_f16_to_f32(0x7e00)));
    cr_assert_eq(f32_bits(weft_f16_to_f32(0x7c01)), 0x7f802000u);
    cr_assert_eq(f32_bits(weft_f16_to_f32(0xfe00)), 0xffc00000u);
}

Test(reduce, bf16_known_values)
{
    cr_assert_eq(weft_f32_to_bf16(1.0f), 0x3f80);
    cr_assert_eq(weft_bf16_to_f32(0x3f80), 1.0f);
    cr_assert_eq(weft_f32_to_bf16(-2.5f), 0xc020);
    cr_assert_eq(weft_bf16_to_f32(0xc020), -2.5f);
    cr_assert_eq(weft_f32_to_bf16(1.0f / 3.0f), 0x3eab);           /* 0x3eaaaaab rounds up */
    cr_assert_eq(weft_f32_to_bf16(bits_f32(0x3f808000u)), 0x3f80); /* tie to even (down) */
    cr_assert_eq(weft_f32_to_bf16(bits_f32(0x3f818000u)), 0x3f82); /* tie to even (up) */
    cr_assert_eq(weft_f32_to_bf16(bits_f32(0x3f808001u)), 0x3f81);
    cr_assert_eq(weft_f32_to_bf16(FLT_MAX), 0x7f80); /* rounds past the largest bf16 */
    cr_assert_eq(weft_f32_to_bf16(-FLT_MAX), 0xff80);
    cr_assert_eq(weft_f32_to_bf16(bits_f32(0x7f7f7fffu)), 0x7f7f);
    cr_assert_eq(weft_f32_to_bf16(INFINITY), 0x7f80);
    cr_assert_eq(weft_f32_to_bf16(-INFINITY), 0xff80);
    cr_assert_eq(weft_f32_to_bf16(0.0f), 0x0000);
    cr_assert_eq(weft_f32_to_bf16(-0.0f), 0x8000);
    cr_assert_eq(weft_bf16_to_f32(0x0001), 0x1p-133f); /* smallest subnormal */
    cr_assert_eq(weft_f32_to_bf16(0x1p-133f), 0x0001);
    cr_assert_eq(weft_f32_to_bf16(0x1p-134f), 0x0000); /* tie to even 0 */
    cr_assert_eq(weft_f32_to_bf16(0x1.8p-134f), 0x0001);
    cr_assert_eq(weft_f32_to_bf16(0x1p-149f), 0x0000);
    /* NaN stays NaN, even one whose payload lies only in the low 16 bits */
    cr_assert_eq(weft_f32_to_bf16(bits_f32(0x7f800001u)), 0x7fc0);
    cr_assert_eq(weft_f32_to_bf16(bits_f32(0xffc00000u)), 0xffc0);
    cr_assert(bf16_is_nan(weft_f32_to_bf16(NAN)));
    cr_assert(isnan(weft_bf16_to_f32(0x7fc0)));
}

Test(reduce, f16_to_f32_exhaustive)
{
    for (uint32_t h = 0; h <= 0xffff; h++) {
        float f = weft_f16_to_f32((uint16_t)h);
        if (f16_is_nan((uint16_t)h)) {
            uint32_t want = ((h & 0x8000u) << 16) | 0x7f800000u | ((h & 0x3ffu) << 13);
            cr_assert_eq(f32_bits(f), want, "h=0x%04x", h);
            continue;
        }
        cr_assert_eq(f32_bits(f), f32_bits((float)ref_f16_value((uint16_t)h)), "h=0x%04x", h);
        cr_assert_eq(weft_f32_to_f16(f), h, "round trip h=0x%04x", h);
    }
}

Test(reduce, bf16_to_f32_exhaustive)
{
    for (uint32_t h = 0; h <= 0xffff; h++) {
        float f = weft_bf16_to_f32((uint16_t)h);
        cr_assert_eq(f32_bits(f), h << 16, "h=0x%04x", h);
        if (bf16_is_nan((uint16_t)h)) {
            cr_assert(bf16_is_nan(weft_f32_to_bf16(f)));
            continue;
        }
        cr_assert_eq(f32_bits(f), f32_bits((float)ref_bf16_value((uint16_t)h)), "h=0x%04x", h);
        cr_assert_eq(weft_f32_to_bf16(f), h, "round trip h=0x%04x", h);
    }
}

static void check_rounding(uint16_t (*conv)(float), uint16_t (*ref)(float),
                           double (*value)(uint16_t), uint16_t inf_bits, double inf_step,
                           int exp_lo, int exp_hi)
{
    /* every midpoint between neighbours, and the floats on either side of it */
    for (uint32_t h = 0; h < inf_bits; h++) {
        double next = h + 1 == inf_bits ? inf_step : value((uint16_t)(h + 1));
        float mid = (float)((value((uint16_t)h) + next) / 2);
        float cases[] = {mid, nextafterf(mid, 0.0f), nextafterf(mid, INFINITY)};
        for (int c = 0; c < 3; c++) {
            for (int s = 0; s < 2; s++) {
                float f = s ? -cases[c] : cases[c];
                cr_assert_eq(conv(f), ref(f), "f=%a (bits 0x%08x)", (double)f, f32_bits(f));
            }
        }
    }
    /* random floats around the format's range, and random bit patterns */
    rng = UINT64_C(12345);
    for (int i = 0; i < 200000; i++) {
        uint64_t r = rnd();
        uint32_t e = (uint32_t)(exp_lo + (int)((r >> 32) % (uint64_t)(exp_hi - exp_lo + 1)));
        uint32_t bits = (uint32_t)(r & 0x807fffffu) | (e << 23);
        float f = bits_f32((i & 1) ? bits : (uint32_t)(r >> 16));
        if (isnan(f)) {
            continue;
        }
        cr_assert_eq(conv(f), ref(f), "f=%a (bits 0x%08x)", (double)f, f32_bits(f));
    }
}

Test(reduce, f32_to_f16_rounds_to_nearest_even)
{
    /* f32 exponents from far below f16's subnormals to past its overflow */
    check_rounding(weft_f32_to_f16, ref_f32_to_f16, ref_f16_value, 0x7c00, 65536.0, 127 - 30,
                   127 + 17);
}

Test(reduce, f32_to_bf16_rounds_to_nearest_even)
{
    check_rounding(weft_f32_to_bf16, ref_f32_to_bf16, ref_bf16_value, 0x7f80, ldexp(1.0, 128), 0,
                   254);
}

/* ---- f16/bf16 AVG rounds once ---------------------------------------------------------------- */

/*
 * The nearest-even 16-bit value to num / count (num >= 0), computed exactly: as ref_round, but
 * comparing num with count times each value or midpoint (exact in long double: num has 24 bits,
 * count times a 12-bit midpoint at most 29).
 */
static uint16_t ref_quotient(long double num, int count, weft_dtype_t dt)
{
    uint16_t inf_bits = dt == WEFT_F16 ? 0x7c00 : 0x7f80;
    double (*value)(uint16_t) = dt == WEFT_F16 ? ref_f16_value : ref_bf16_value;
    double inf_step = dt == WEFT_F16 ? 65536.0 : ldexp(1.0, 128);
    long double c = (long double)count;
    uint32_t lo = 0;
    uint32_t hi = inf_bits;

    while (lo < hi) {
        uint32_t mid = (lo + hi + 1) / 2;
        double v = mid == inf_bits ? inf_step : value((uint16_t)mid);
        if (c * (long double)v <= num) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    if (lo == inf_bits) {
        return inf_bits;
    }
    double v_lo = value((uint16_t)lo);
    double v_hi = lo + 1 == inf_bits ? inf_step : value((uint16_t)(lo + 1));
    long double at_mid = c * (((long double)v_lo + (long double)v_hi) / 2);
    return (uint16_t)(num < at_mid ? lo : (num > at_mid ? lo + 1 : ((lo & 1) ? lo + 1 : lo)));
}

static uint16_t to_half(weft_dtype_t dt, float f)
{
    return dt == WEFT_F16 ? weft_f32_to_f16(f) : weft_f32_to_bf16(f);
}

/*
 * AVG of three contributions accumulated in f32 (weft_reduce_widen, the f32 kernels,
 * weft_reduce_narrow) rounds once, where the f16/bf16 kernels round each partial sum: 2048 + 1
 * is 2048 in f16 (256 + 1 is 256 in bf16), so they give 2048/3 where the average is 2050/3.
 */
static void check_avg_of_three_rounds_once(weft_dtype_t dt)
{
    float big = dt == WEFT_F16 ? 2048.0f : 256.0f;
    uint16_t c0[] = {to_half(dt, big), to_half(dt, 1.0f), to_half(dt, 3.0f)};
    uint16_t c1[] = {to_half(dt, 1.0f), to_half(dt, big), to_half(dt, 5.0f)};
    uint16_t c2[] = {to_half(dt, 1.0f), to_half(dt, 1.0f), to_half(dt, 7.0f)};
    float acc[3], w1[3], w2[3];
    uint16_t got[3], twice[3];

    weft_reduce_widen(acc, c0, 3, dt);
    weft_reduce_widen(w1, c1, 3, dt);
    weft_reduce_widen(w2, c2, 3, dt);
    weft_reduce_into(acc, w1, 3, WEFT_F32, WEFT_AVG);
    weft_reduce_into(acc, w2, 3, WEFT_F32, WEFT_AVG);
    weft_reduce_narrow(got, acc, 3, dt, WEFT_AVG, 3);
    /* the same in the f16/bf16 kernels, for contrast: rounded at each step */
    weft_reduce_to(twice, c0, c1, 3, dt, WEFT_AVG);
    weft_reduce_into(twice, c2, 3, dt, WEFT_AVG);
    weft_reduce_finish(twice, 3, dt, WEFT_AVG, 3);
    for (int i = 0; i < 2; i++) {
        uint16_t want = ref_quotient((long double)big + 2, 3, dt);
        cr_assert_eq(got[i], want, "%s avg element %d: %04x, want %04x", weft_dtype_name(dt), i,
                     got[i], want);
        cr_assert_neq(twice[i], want, "the data must tell one rounding from several");
    }
    cr_assert_eq(got[2], ref_quotient(15, 3, dt));
}

/* Quotients of f32 accumulators whose f32 rounding lands on a midpoint of the narrow dtype
 * (rounding it again would go the wrong way), and random ones, against the exact reference. */
static void check_narrow_exact(void)
{
    static const int counts[] = {1, 2, 3, 7, 4095, 4097, 8195, 70001};
    float acc[257];
    uint16_t got[257];

    /* 10928 / 8195 in f32 is an f16 midpoint; the exact quotient is below it */
    acc[0] = 10928.0f;
    weft_reduce_narrow(got, acc, 1, WEFT_F16, WEFT_AVG, 8195);
    cr_assert_eq(got[0], ref_quotient(10928.0L, 8195, WEFT_F16));
    cr_assert_eq(got[0], 0x3d55);
    /* an f32 subnormal over 3: its f32 quotient is a bf16 midpoint, the exact one above it */
    acc[0] = bits_f32(0x00018001u);
    weft_reduce_narrow(got, acc, 1, WEFT_BF16, WEFT_AVG, 3);
    cr_assert_eq(got[0], 0x0001);
    cr_assert_eq(got[0], ref_quotient((long double)acc[0], 3, WEFT_BF16));

    rng = 4242;
    for (int d = 0; d < 2; d++) {
        weft_dtype_t dt = d == 0 ? WEFT_F16 : WEFT_BF16;
        for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
            for (size_t i = 0; i < 257; i++) {
                /* positive finite f32, exponents spanning the dtype's range and below */
                uint32_t e = dt == WEFT_F16 ? 90 + (uint32_t)(rnd() % 60) : (uint32_t)(rnd() % 200);
                acc[i] = bits_f32((e << 23) | (uint32_t)(rnd() & 0x7fffffu));
            }
            weft_reduce_narrow(got, acc, 257, dt, WEFT_AVG, counts[c]);
            for (size_t i = 0; i < 257; i++) {
                uint16_t want = ref_quotient((long double)acc[i], counts[c], dt);
                cr_assert_eq(got[i], want, "%s: %a / %d gave %04x, want %04x", weft_dtype_name(dt),
                             (double)acc[i], counts[c], got[i], want);
            }
        }
    }
}

/* weft_reduce_finish of f16 data by a count past 2^13: the f32 quotient 0x3aca / 11067 is an
 * f16 midpoint, the exact quotient above it. */
static void check_finish_half_large_count(void)
{
    uint16_t h[] = {0x3aca, 0x3eca, 0x7bff};
    uint16_t want[3];

    for (int i = 0; i < 3; i++) {
        want[i] = ref_quotient((long double)ref_f16_value(h[i]), 11067, WEFT_F16);
    }
    cr_assert_eq(want[0], 0x0507);
    weft_reduce_finish(h, 3, WEFT_F16, WEFT_AVG, 11067);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(h[i], want[i], "element %d: %04x, want %04x", i, h[i], want[i]);
    }
}

Test(reduce, half_avg_rounds_once)
{
    check_avg_of_three_rounds_once(WEFT_F16);
    check_avg_of_three_rounds_once(WEFT_BF16);
    check_narrow_exact();
    check_finish_half_large_count();
}

Test(reduce, half_avg_rounds_once_portable)
{
    cr_assert_eq(setenv("WEFT_REDUCE_SIMD", "0", 1), 0);
    check_avg_of_three_rounds_once(WEFT_F16);
    check_avg_of_three_rounds_once(WEFT_BF16);
    check_narrow_exact();
    check_finish_half_large_count();
}

Test(reduce, widen_is_exact)
{
    uint16_t h[] = {0x3c00, 0xc700, 0x7bff, 0x0001, 0x7c00};
    uint16_t b[] = {0x3f80, 0xc0e0, 0x7f7f, 0x0001};
    float f[5];

    weft_reduce_widen(f, h, 5, WEFT_F16);
    for (int i = 0; i < 5; i++) {
        cr_assert_eq((double)f[i], ref_f16_value(h[i]));
    }
    weft_reduce_widen(f, b, 4, WEFT_BF16);
    for (int i = 0; i < 4; i++) {
        cr_assert_eq((double)f[i], ref_bf16_value(b[i]));
    }
}

/* The vector conversions (F16C, AVX2, where the CPU has them) give the scalar conversions' bits
 * for every f16 and bf16 value and for f32 values all over the range (NaNs: NaN). */
static bool same_or_both_nan_f(float a, float b)
{
    return (a != a && b != b) || memcmp(&a, &b, sizeof(a)) == 0;
}

static bool same_or_both_nan_h(uint16_t a, uint16_t b, weft_dtype_t dt)
{
    uint16_t exp = dt == WEFT_F16 ? 0x7c00 : 0x7f80;
    bool na = (a & exp) == exp && (a & (uint16_t)~(exp | 0x8000)) != 0;
    bool nb = (b & exp) == exp && (b & (uint16_t)~(exp | 0x8000)) != 0;
    return (na && nb) || a == b;
}

Test(reduce, vector_conversions_match_the_scalar_ones)
{
    enum { N = 65536 + 5 }; /* a tail the vector loop leaves */
    uint16_t *h = malloc(N * sizeof(*h)), *back = malloc(N * sizeof(*back));
    float *f = malloc(N * sizeof(*f));
    cr_assert(h != NULL && back != NULL && f != NULL);
    weft_dtype_t dts[2] = {WEFT_F16, WEFT_BF16};
    for (int k = 0; k < 2; k++) {
        weft_dtype_t dt = dts[k];
        for (size_t i = 0; i < N; i++) {
            h[i] = (uint16_t)i;
        }
        weft_reduce_widen(f, h, N, dt);
        for (size_t i = 0; i < N; i++) {
            float want = dt == WEFT_F16 ? weft_f16_to_f32(h[i]) : weft_bf16_to_f32(h[i]);
            cr_assert(same_or_both_nan_f(f[i], want), "%s widen %04x: %a, want %a",
                      weft_dtype_name(dt), h[i], (double)f[i], (double)want);
        }
        /* f32 bit patterns spread over every exponent, ties and subnormals included */
        uint64_t x = 0x9E3779B97F4A7C15ull;
        for (size_t i = 0; i < N; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            uint32_t u = (uint32_t)x;
            if (i % 4 == 1) {
                u = (u & 0xffff0000u) | 0x8000u; /* a tie for bf16 */
            } else if (i % 4 == 2) {
                u = (u & 0xffffe000u) | 0x1000u; /* a tie for f16 normals */
            }
            memcpy(&f[i], &u, sizeof(u));
        }
        weft_reduce_narrow(back, f, N, dt, WEFT_SUM, 1);
        for (size_t i = 0; i < N; i++) {
            uint16_t want = dt == WEFT_F16 ? weft_f32_to_f16(f[i]) : weft_f32_to_bf16(f[i]);
            cr_assert(same_or_both_nan_h(back[i], want, dt), "%s narrow %a: %04x, want %04x",
                      weft_dtype_name(dt), (double)f[i], back[i], want);
        }
    }
    free(h);
    free(back);
    free(f);
}

/* ---- throughput (printed, not asserted) ------------------------------------------------------ */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

Test(reduce, throughput_print)
{
    const size_t n = (size_t)16 << 20;
    const weft_dtype_t dts[] = {WEFT_F32, WEFT_BF16, WEFT_F16};
    const int reps = 3;

    for (size_t d = 0; d < sizeof dts / sizeof dts[0]; d++) {
        size_t size = weft_dtype_size(dts[d]);
        void *dst = calloc(n, size);
        void *src = calloc(n, size);
        cr_assert(dst != NULL && src != NULL);
        weft_reduce_into(dst, src, n, dts[d], WEFT_SUM); /* fault the pages in */
        double t0 = now_s();
        for (int r = 0; r < reps; r++) {
            weft_reduce_into(dst, src, n, dts[d], WEFT_SUM);
        }
        double dt = (now_s() - t0) / reps;
        /* bytes of the buffer reduced per second (each pass reads 2n and writes n elements) */
        fprintf(stderr, "reduce: %s sum into, 16M elements: %.2f ms, %.2f GB/s of dst\n",
                weft_dtype_name(dts[d]), dt * 1e3, (double)(n * size) / dt / 1e9);
        free(dst);
        free(src);
    }
}
