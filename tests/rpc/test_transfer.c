/* Tensors of every dtype and of sizes 0 B to 256 MiB cross byte-exact. */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <string.h>

#include "ranks.h"

static void echo(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, weft_call_take_args(call));
}

static void setup(weft_agent_t *a, int rank, void *arg)
{
    (void)rank;
    (void)arg;
    weft_rpc_register(a, "echo", echo, NULL);
}

static void fill(uint8_t *p, size_t n, uint64_t seed)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        memcpy(p + i, &x, 8);
    }
    for (; i < n; i++) {
        p[i] = (uint8_t)(x >> (i % 8));
    }
}

static int body_dtypes(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    (void)world;
    if (rank != 0) {
        return 0;
    }
    /* One value carrying a tensor of every dtype, with assorted shapes. */
    weft_value_t *args;
    weft_value_create(&args);
    int64_t shapes[][3] = {{3, 5, 7}, {0, 4, 1}, {1, 1, 1}, {2, 3, 4}, {17, 1, 3},
                           {5, 5, 5}, {1, 2, 3}, {9, 9, 1}, {4, 0, 0}};
    int ndims[] = {3, 2, 0, 3, 1, 2, 3, 2, 1};
    for (int d = 0; d < WEFT_DTYPE_COUNT; d++) {
        weft_tensor_t *t;
        RANK_CHECK(weft_tensor_empty((weft_dtype_t)d, ndims[d], shapes[d], &t) == WEFT_OK,
                   "empty %d", d);
        fill(weft_tensor_data(t), weft_tensor_nbytes(t), (uint64_t)d);
        if (d == WEFT_BOOL) {
            uint8_t *b = weft_tensor_data(t);
            for (size_t i = 0; i < weft_tensor_nbytes(t); i++) {
                b[i] &= 1;
            }
        }
        weft_value_push_tensor(args, t);
    }
    /* An 8-dim tensor too. */
    int64_t s8[8] = {2, 1, 2, 1, 2, 1, 2, 3};
    weft_tensor_t *t8;
    weft_tensor_empty(WEFT_I64, 8, s8, &t8);
    fill(weft_tensor_data(t8), weft_tensor_nbytes(t8), 99);
    weft_value_push_tensor(args, t8);
    weft_value_set_payload(args, "\0binary\xff payload", 16);

    weft_value_t *res;
    weft_status_t st = weft_rpc_sync(a, 1, "echo", args, 20000, &res);
    RANK_CHECK(st == WEFT_OK, "%s", weft_last_error());
    RANK_CHECK(weft_value_num_tensors(res) == weft_value_num_tensors(args), "count");
    for (size_t i = 0; i < weft_value_num_tensors(args); i++) {
        weft_tensor_t *x = weft_value_tensor(args, i);
        weft_tensor_t *y = weft_value_tensor(res, i);
        RANK_CHECK(weft_tensor_dtype(x) == weft_tensor_dtype(y), "dtype %zu", i);
        RANK_CHECK(weft_tensor_ndim(x) == weft_tensor_ndim(y), "ndim %zu", i);
        RANK_CHECK(memcmp(weft_tensor_shape(x), weft_tensor_shape(y),
                          sizeof(int64_t) * (size_t)weft_tensor_ndim(x)) == 0,
                   "shape %zu", i);
        RANK_CHECK(weft_tensor_equal(x, y), "bytes of tensor %zu (%s)", i,
                   weft_dtype_name(weft_tensor_dtype(x)));
    }
    size_t len;
    const void *pl = weft_value_payload(res, &len);
    RANK_CHECK(len == 16 && memcmp(pl, "\0binary\xff payload", 16) == 0, "payload");
    weft_value_free(res);
    weft_value_free(args);
    return 0;
}

Test(rpc_transfer, every_dtype_and_shape, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_dtypes);
    o.setup = setup;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

static int body_sizes(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    (void)world;
    if (rank != 0) {
        return 0;
    }
    const size_t sizes[] = {0,         1,         7,         4095,     4096,
                            16383,     16384,     65537,     1u << 20, (1u << 20) + 3,
                            16u << 20, 64u << 20, 256u << 20};
    for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
        int64_t n = (int64_t)sizes[k];
        weft_tensor_t *t;
        RANK_CHECK(weft_tensor_empty(WEFT_U8, 1, &n, &t) == WEFT_OK, "alloc %zu", sizes[k]);
        fill(weft_tensor_data(t), sizes[k], sizes[k]);
        weft_value_t *args;
        weft_value_create(&args);
        weft_value_push_tensor(args, t);
        weft_value_t *res;
        weft_status_t st = weft_rpc_sync(a, 1, "echo", args, 60000, &res);
        RANK_CHECK(st == WEFT_OK, "size %zu: %s", sizes[k], weft_last_error());
        weft_tensor_t *r = weft_value_tensor(res, 0);
        RANK_CHECK(r != NULL && weft_tensor_nbytes(r) == sizes[k], "size %zu came back wrong",
                   sizes[k]);
        RANK_CHECK(weft_tensor_equal(t, r), "bytes differ at size %zu", sizes[k]);
        weft_value_free(res);
        weft_value_free(args);
    }
    return 0;
}

Test(rpc_transfer, sizes_0B_to_256MiB_byte_exact, .timeout = 300)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_sizes);
    o.setup = setup;
    o.deadline_ms = 280000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* Rank 1 has no direct listener: large frames to it take the stream, its large
 * answers take rank 0's direct connection; both paths byte-exact. */
Test(rpc_transfer, large_frames_with_one_rank_without_direct_connections, .timeout = 300)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_sizes);
    o.setup = setup;
    o.no_direct_rank = 1;
    o.deadline_ms = 280000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ------------------------------------------------------------------ results landing in place */

/* rank 1: a "hold" call, answered by "release" (which fails while no hold has come: the large
 * hold travels on the direct connection and may be overtaken) */
static _Atomic(weft_call_t *) held_call;

static void hold(weft_call_t *call, void *arg)
{
    (void)arg;
    atomic_store(&held_call, call);
}

static void release(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_t *h = atomic_exchange(&held_call, NULL);
    if (h == NULL) {
        weft_call_fail(call, WEFT_ERR_NOT_FOUND, "no call held yet");
        return;
    }
    weft_call_reply(h, weft_call_take_args(h));
    weft_call_reply(call, NULL);
}

static void setup_into(weft_agent_t *a, int rank, void *arg)
{
    setup(a, rank, arg);
    weft_rpc_register(a, "hold", hold, NULL);
    weft_rpc_register(a, "release", release, NULL);
}

static bool all_bytes(const uint8_t *p, size_t n, uint8_t b)
{
    for (size_t i = 0; i < n; i++) {
        if (p[i] != b) {
            return false;
        }
    }
    return true;
}

static weft_value_t *u8_args(size_t n, uint64_t seed)
{
    int64_t k = (int64_t)n;
    weft_tensor_t *t = NULL;
    weft_value_t *v = NULL;
    if (weft_tensor_empty(WEFT_U8, 1, &k, &t) != WEFT_OK || weft_value_create(&v) != WEFT_OK) {
        return NULL;
    }
    fill(weft_tensor_data(t), n, seed);
    weft_value_push_tensor(v, t);
    return v;
}

static int body_into(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    (void)world;
    if (rank != 0) {
        return 0;
    }
    const size_t big = (size_t)4 << 20, small = 64;
    uint8_t *dst = malloc(big), *dst2 = malloc(big);
    RANK_CHECK(dst != NULL && dst2 != NULL, "malloc");

    /* A large answer on the direct connection lands in the caller's memory. */
    weft_value_t *args = u8_args(big, 7);
    RANK_CHECK(args != NULL, "args");
    weft_rpc_into_t into[2] = {{.data = dst, .nbytes = big, .dtype = WEFT_U8},
                               {.data = dst2, .nbytes = big, .dtype = WEFT_U8}};
    memset(dst, 0xAA, big);
    weft_future_t *f = NULL;
    RANK_CHECK(weft_rpc_async_into(a, 1, "echo", args, 20000, into, 1, &f) == WEFT_OK, "%s",
               weft_last_error());
    RANK_CHECK(weft_future_wait(f, -1) == WEFT_OK, "%s", weft_future_error(f));
    weft_tensor_t *r = weft_value_tensor(weft_future_value(f), 0);
    RANK_CHECK(weft_tensor_data(r) == dst, "the result did not land in place");
    RANK_CHECK(memcmp(dst, weft_tensor_data(weft_value_tensor(args, 0)), big) == 0,
               "landed bytes differ");
    weft_future_release(f);

    /* A size or a dtype that differs: a fresh tensor, the caller's memory untouched. */
    memset(dst, 0xAA, big);
    into[0] = (weft_rpc_into_t){.data = dst, .nbytes = big - 1, .dtype = WEFT_U8};
    into[1] = (weft_rpc_into_t){.data = dst2, .nbytes = big, .dtype = WEFT_I8};
    weft_value_t *two = u8_args(big, 8);
    weft_value_push_tensor(two, weft_tensor_retain(weft_value_tensor(args, 0)));
    RANK_CHECK(weft_rpc_async_into(a, 1, "echo", two, 20000, into, 2, &f) == WEFT_OK, "%s",
               weft_last_error());
    RANK_CHECK(weft_future_wait(f, -1) == WEFT_OK, "%s", weft_future_error(f));
    for (size_t i = 0; i < 2; i++) {
        r = weft_value_tensor(weft_future_value(f), i);
        RANK_CHECK(weft_tensor_data(r) != into[i].data, "tensor %zu landed though it differs", i);
        RANK_CHECK(weft_tensor_equal(r, weft_value_tensor(two, i)), "tensor %zu differs", i);
    }
    RANK_CHECK(all_bytes(dst, big, 0xAA), "memory of a refused landing was written");
    weft_future_release(f);
    weft_value_free(two);

    /* A small answer comes on the stream: a fresh tensor. Between ranks of one host it comes
     * through the shared-memory ring, which lands answers of every size. */
    weft_shm_stats_t ss;
    RANK_CHECK(weft_agent_shm_stats(a, 1, &ss) == WEFT_OK, "%s", weft_last_error());
    weft_value_t *tiny = u8_args(small, 9);
    into[0] = (weft_rpc_into_t){.data = dst, .nbytes = small, .dtype = WEFT_U8};
    RANK_CHECK(weft_rpc_async_into(a, 1, "echo", tiny, 20000, into, 1, &f) == WEFT_OK, "%s",
               weft_last_error());
    RANK_CHECK(weft_future_wait(f, -1) == WEFT_OK, "%s", weft_future_error(f));
    r = weft_value_tensor(weft_future_value(f), 0);
    RANK_CHECK(weft_tensor_equal(r, weft_value_tensor(tiny, 0)), "small result differs");
    if (ss.ring_open) {
        RANK_CHECK(weft_tensor_data(r) == dst, "a small answer through the ring did not land");
        memset(dst, 0xAA, big);
    } else {
        RANK_CHECK(all_bytes(dst, big, 0xAA), "a stream answer wrote the caller's memory");
    }
    weft_future_release(f);
    weft_value_free(tiny);

    /* Withdrawn before the answer comes: it arrives in a fresh tensor. */
    into[0] = (weft_rpc_into_t){.data = dst, .nbytes = big, .dtype = WEFT_U8};
    RANK_CHECK(weft_rpc_async_into(a, 1, "hold", args, 20000, into, 1, &f) == WEFT_OK, "%s",
               weft_last_error());
    RANK_CHECK(weft_rpc_withdraw_into(a, f), "withdrawing an unanswered call");
    weft_status_t rst = WEFT_ERR_NOT_FOUND;
    for (int tries = 0; tries < 20000 && rst == WEFT_ERR_NOT_FOUND; tries++) {
        rst = weft_rpc_sync(a, 1, "release", NULL, 20000, NULL); /* until the hold is there */
    }
    RANK_CHECK(rst == WEFT_OK, "release: %s", weft_last_error());
    RANK_CHECK(weft_future_wait(f, -1) == WEFT_OK, "%s", weft_future_error(f));
    r = weft_value_tensor(weft_future_value(f), 0);
    RANK_CHECK(weft_tensor_data(r) != dst, "a withdrawn call landed");
    RANK_CHECK(weft_tensor_equal(r, weft_value_tensor(args, 0)), "withdrawn result differs");
    RANK_CHECK(all_bytes(dst, big, 0xAA), "a withdrawn call wrote the caller's memory");
    RANK_CHECK(weft_rpc_withdraw_into(a, f), "withdrawing a finished call");
    weft_future_release(f);

    /* Bad arguments. */
    into[0] = (weft_rpc_into_t){.data = NULL, .nbytes = big, .dtype = WEFT_U8};
    RANK_CHECK(weft_rpc_async_into(a, 1, "echo", args, 20000, into, 1, &f) ==
                   WEFT_ERR_INVALID_ARG,
               "an entry without memory");
    RANK_CHECK(weft_rpc_async_into(a, 1, "echo", args, 20000, NULL, 1, &f) == WEFT_ERR_INVALID_ARG,
               "no entries");
    weft_value_free(args);
    free(dst);
    free(dst2);
    return 0;
}

Test(rpc_transfer, results_land_in_the_callers_memory, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_into);
    o.setup = setup_into;
    cr_assert_eq(ranks_run(&o, codes), 0);
}
