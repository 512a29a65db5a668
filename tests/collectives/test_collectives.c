/* Collectives against references computed locally: every dtype x reduce op,
 * world sizes 1 to 8, direct and ring, broadcast from every root, sub-groups,
 * point-to-point, mismatches and a dead rank; deadlines, buffers the transport
 * holds, blocking calls from callbacks, late pieces. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "ranks.h"
#include <weft/collectives.h>

/* White-box counters (coll__mailbox_count, coll__held_pieces). */
#include "../../collectives/internal.h"

static const weft_dtype_t DTYPES[] = {WEFT_F32, WEFT_F64, WEFT_F16, WEFT_BF16,
                                      WEFT_I8,  WEFT_I32, WEFT_I64, WEFT_U8};
#define NDTYPES 8

/* Small integer contributions, so that every result is exact in every dtype. */
static double contribution(int rank, size_t i, weft_reduce_op_t op)
{
    if (op == WEFT_PRODUCT) {
        return (double)(1 + (int)((rank + i) % 2)); /* 1 or 2: products stay powers of two */
    }
    return (double)((rank * 7 + (int)i * 3) % 5);
}

static void store(void *p, weft_dtype_t dt, size_t i, double v)
{
    switch (dt) {
    case WEFT_F32:
        ((float *)p)[i] = (float)v;
        break;
    case WEFT_F64:
        ((double *)p)[i] = v;
        break;
    case WEFT_F16:
        ((uint16_t *)p)[i] = weft_f32_to_f16((float)v);
        break;
    case WEFT_BF16:
        ((uint16_t *)p)[i] = weft_f32_to_bf16((float)v);
        break;
    case WEFT_I8:
        ((int8_t *)p)[i] = (int8_t)v;
        break;
    case WEFT_I32:
        ((int32_t *)p)[i] = (int32_t)v;
        break;
    case WEFT_I64:
        ((int64_t *)p)[i] = (int64_t)v;
        break;
    default:
        ((uint8_t *)p)[i] = (uint8_t)v;
        break;
    }
}

/* The reference: contributions reduced in rank order in double, then stored. */
static double reference(int world, size_t i, weft_reduce_op_t op, weft_dtype_t dt)
{
    bool integer = dt == WEFT_I8 || dt == WEFT_I32 || dt == WEFT_I64 || dt == WEFT_U8;
    long long iacc = (long long)contribution(0, i, op);
    double acc = contribution(0, i, op);
    for (int r = 1; r < world; r++) {
        double c = contribution(r, i, op);
        long long ic = (long long)c;
        switch (op) {
        case WEFT_SUM:
        case WEFT_AVG:
            acc += c;
            iacc += ic;
            break;
        case WEFT_PRODUCT:
            acc *= c;
            iacc *= ic;
            break;
        case WEFT_MIN:
            acc = c < acc ? c : acc;
            break;
        case WEFT_MAX:
            acc = c > acc ? c : acc;
            break;
        case WEFT_BAND:
            iacc &= ic;
            break;
        case WEFT_BOR:
            iacc |= ic;
            break;
        default:
            iacc ^= ic;
            break;
        }
    }
    if (op == WEFT_BAND || op == WEFT_BOR || op == WEFT_BXOR) {
        return (double)iacc;
    }
    if (op == WEFT_AVG) {
        if (integer) {
            return (double)((long long)acc / world);
        }
        /* The division happens in f32 for f32/f16/bf16 and in f64 for f64. */
        return dt == WEFT_F64 ? acc / world : (double)((float)acc / (float)world);
    }
    return acc;
}

static int check_all_reduce(weft_pg_t *pg, int world, size_t count, weft_dtype_t dt,
                            weft_reduce_op_t op)
{
    int rank = weft_pg_rank(pg);
    int64_t n = (int64_t)count;
    weft_tensor_t *t, *want;
    weft_tensor_empty(dt, 1, &n, &t);
    weft_tensor_empty(dt, 1, &n, &want);
    for (size_t i = 0; i < count; i++) {
        store(weft_tensor_data(t), dt, i, contribution(rank, i, op));
        store(weft_tensor_data(want), dt, i, reference(world, i, op, dt));
    }
    weft_status_t st = weft_coll_all_reduce(pg, t, op, NULL);
    RANK_CHECK(st == WEFT_OK, "all_reduce %s %s x%zu: %s", weft_dtype_name(dt),
               weft_reduce_op_name(op), count, weft_last_error());
    RANK_CHECK(weft_tensor_equal(t, want), "all_reduce %s %s x%zu on %d ranks: wrong result",
               weft_dtype_name(dt), weft_reduce_op_name(op), count, world);
    weft_tensor_release(t);
    weft_tensor_release(want);
    return 0;
}

static int check_broadcast(weft_pg_t *pg, size_t count, weft_dtype_t dt, int root)
{
    int rank = weft_pg_rank(pg);
    int64_t n = (int64_t)count;
    weft_tensor_t *t, *want;
    weft_tensor_empty(dt, 1, &n, &t);
    weft_tensor_empty(dt, 1, &n, &want);
    for (size_t i = 0; i < count; i++) {
        store(weft_tensor_data(t), dt, i, (double)((rank + (int)i) % 100));
        store(weft_tensor_data(want), dt, i, (double)((root + (int)i) % 100));
    }
    weft_status_t st = weft_coll_broadcast(pg, t, root, NULL);
    RANK_CHECK(st == WEFT_OK, "broadcast from %d: %s", root, weft_last_error());
    RANK_CHECK(weft_tensor_equal(t, want), "broadcast %s x%zu from %d: wrong data",
               weft_dtype_name(dt), count, root);
    weft_tensor_release(t);
    weft_tensor_release(want);
    return 0;
}

/* Value of element i of rank r's input in the data-movement checks. */
static double val(int r, size_t i)
{
    return (double)((r * 31 + (int)i * 7) % 97);
}

static weft_tensor_t *make(weft_dtype_t dt, size_t count, int r, size_t base)
{
    int64_t n = (int64_t)count;
    weft_tensor_t *t;
    weft_tensor_empty(dt, 1, &n, &t);
    for (size_t i = 0; i < count; i++) {
        store(weft_tensor_data(t), dt, i, val(r, base + i));
    }
    return t;
}

static weft_tensor_t *scalar_f32(float v)
{
    int64_t one = 1;
    weft_tensor_t *t;
    weft_tensor_create(WEFT_F32, 1, &one, &t);
    *(float *)weft_tensor_data(t) = v;
    return t;
}

static int check_others(weft_pg_t *pg, int world, weft_dtype_t dt, size_t count)
{
    int me = weft_pg_rank(pg);
    size_t es = weft_dtype_size(dt);

    /* reduce to every root */
    for (int root = 0; root < world; root++) {
        int64_t n = (int64_t)count;
        weft_tensor_t *t, *want;
        weft_tensor_empty(dt, 1, &n, &t);
        weft_tensor_empty(dt, 1, &n, &want);
        for (size_t i = 0; i < count; i++) {
            store(weft_tensor_data(t), dt, i, contribution(me, i, WEFT_SUM));
            store(weft_tensor_data(want), dt, i,
                  me == root ? reference(world, i, WEFT_SUM, dt) : contribution(me, i, WEFT_SUM));
        }
        RANK_CHECK(weft_coll_reduce(pg, t, root, WEFT_SUM, NULL) == WEFT_OK, "reduce: %s",
                   weft_last_error());
        RANK_CHECK(weft_tensor_equal(t, want), "reduce %s x%zu to %d", weft_dtype_name(dt), count,
                   root);
        weft_tensor_release(t);
        weft_tensor_release(want);
    }
    /* gather and scatter through the last rank */
    int root = world - 1;
    weft_tensor_t *in = make(dt, count, me, 0);
    weft_tensor_t *flat = make(dt, count * (size_t)world, -1, 0);
    RANK_CHECK(weft_coll_gather(pg, in, flat, root, NULL) == WEFT_OK, "gather: %s",
               weft_last_error());
    if (me == root) {
        for (int r = 0; r < world; r++) {
            weft_tensor_t *w = make(dt, count, r, 0);
            RANK_CHECK(count == 0 ||
                           memcmp((uint8_t *)weft_tensor_data(flat) + (size_t)r * count * es,
                                  weft_tensor_data(w), count * es) == 0,
                       "gather part %d", r);
            weft_tensor_release(w);
        }
    }
    weft_tensor_t *all = make(dt, count * (size_t)world, root, 0);
    weft_tensor_t *part = make(dt, count, -1, 0);
    RANK_CHECK(weft_coll_scatter(pg, me == root ? all : NULL, part, root, NULL) == WEFT_OK,
               "scatter: %s", weft_last_error());
    weft_tensor_t *wpart = make(dt, count, root, (size_t)me * count);
    RANK_CHECK(weft_tensor_equal(part, wpart), "scatter part on %d", me);
    weft_tensor_release(wpart);
    /* all_gather, flat and into a list */
    RANK_CHECK(weft_coll_all_gather(pg, in, flat, NULL) == WEFT_OK, "all_gather: %s",
               weft_last_error());
    weft_tensor_t *list[8];
    for (int r = 0; r < world; r++) {
        weft_tensor_t *w = make(dt, count, r, 0);
        RANK_CHECK(count == 0 || memcmp((uint8_t *)weft_tensor_data(flat) + (size_t)r * count * es,
                                        weft_tensor_data(w), count * es) == 0,
                   "all_gather part %d", r);
        weft_tensor_release(w);
        list[r] = make(dt, count, -1, 0);
    }
    RANK_CHECK(weft_coll_all_gather_list(pg, in, list, NULL) == WEFT_OK, "all_gather list: %s",
               weft_last_error());
    for (int r = 0; r < world; r++) {
        weft_tensor_t *w = make(dt, count, r, 0);
        RANK_CHECK(weft_tensor_equal(list[r], w), "all_gather list %d", r);
        weft_tensor_release(w);
        weft_tensor_release(list[r]);
    }
    /* reduce_scatter: part r of everyone's input, summed, lands on r */
    weft_tensor_t *rin, *rout, *rwant;
    int64_t total = (int64_t)count * world, n1 = (int64_t)count;
    weft_tensor_empty(dt, 1, &total, &rin);
    weft_tensor_empty(dt, 1, &n1, &rout);
    weft_tensor_empty(dt, 1, &n1, &rwant);
    for (size_t i = 0; i < (size_t)total; i++) {
        store(weft_tensor_data(rin), dt, i, contribution(me, i, WEFT_SUM));
    }
    for (size_t i = 0; i < count; i++) {
        store(weft_tensor_data(rwant), dt, i,
              reference(world, (size_t)me * count + i, WEFT_SUM, dt));
    }
    RANK_CHECK(weft_coll_reduce_scatter(pg, rin, rout, WEFT_SUM, NULL) == WEFT_OK,
               "reduce_scatter: %s", weft_last_error());
    RANK_CHECK(weft_tensor_equal(rout, rwant), "reduce_scatter %s x%zu", weft_dtype_name(dt),
               count);
    weft_tensor_release(rin);
    weft_tensor_release(rout);
    weft_tensor_release(rwant);
    /* all_to_all, equal parts: part r of rank s's input lands in part s of rank r's output */
    weft_tensor_t *ain = make(dt, count * (size_t)world, me, 0);
    weft_tensor_t *aout = make(dt, count * (size_t)world, -1, 0);
    RANK_CHECK(weft_coll_all_to_all(pg, ain, aout, NULL, NULL, NULL) == WEFT_OK, "all_to_all: %s",
               weft_last_error());
    for (int s = 0; s < world; s++) {
        weft_tensor_t *w = make(dt, count, s, (size_t)me * count);
        RANK_CHECK(count == 0 || memcmp((uint8_t *)weft_tensor_data(aout) + (size_t)s * count * es,
                                        weft_tensor_data(w), count * es) == 0,
                   "all_to_all part from %d", s);
        weft_tensor_release(w);
    }
    weft_tensor_release(ain);
    weft_tensor_release(aout);
    /* all_to_all, uneven: rank s sends s + r + 1 elements to rank r */
    int64_t ins[8], outs[8], tin = 0, tout = 0;
    for (int r = 0; r < world; r++) {
        ins[r] = me + r + 1;
        outs[r] = r + me + 1;
        tin += ins[r];
        tout += outs[r];
    }
    weft_tensor_t *uin = make(dt, (size_t)tin, me, 0);
    weft_tensor_t *uout = make(dt, (size_t)tout, -1, 0);
    RANK_CHECK(weft_coll_all_to_all(pg, uin, uout, ins, outs, NULL) == WEFT_OK,
               "uneven all_to_all: %s", weft_last_error());
    size_t off = 0;
    for (int s = 0; s < world; s++) {
        size_t from = 0;
        for (int r = 0; r < me; r++) {
            from += (size_t)(s + r + 1); /* what rank s sent to ranks before me */
        }
        weft_tensor_t *w = make(dt, (size_t)outs[s], s, from);
        RANK_CHECK(memcmp((uint8_t *)weft_tensor_data(uout) + off * es, weft_tensor_data(w),
                          (size_t)outs[s] * es) == 0,
                   "uneven all_to_all part from %d", s);
        off += (size_t)outs[s];
        weft_tensor_release(w);
    }
    weft_tensor_release(uin);
    weft_tensor_release(uout);
    /* In place: all_gather whose input is its own part of the output, and all_to_all
     * with one tensor for both. */
    if (count > 0) {
        weft_tensor_t *ip = make(dt, count * (size_t)world, me, 0);
        int64_t cn = (int64_t)count;
        weft_tensor_t *mine;
        weft_tensor_wrap(dt, 1, &cn, (uint8_t *)weft_tensor_data(ip) + (size_t)me * count * es,
                         count * es, WEFT_CPU, NULL, NULL, &mine);
        weft_tensor_t *src = make(dt, count, me, 0);
        memcpy(weft_tensor_data(mine), weft_tensor_data(src), count * es);
        RANK_CHECK(weft_coll_all_gather(pg, mine, ip, NULL) == WEFT_OK, "in-place all_gather");
        for (int r = 0; r < world; r++) {
            weft_tensor_t *w = make(dt, count, r, 0);
            RANK_CHECK(memcmp((uint8_t *)weft_tensor_data(ip) + (size_t)r * count * es,
                              weft_tensor_data(w), count * es) == 0,
                       "in-place all_gather part %d", r);
            weft_tensor_release(w);
        }
        weft_tensor_release(mine);
        weft_tensor_release(src);
        weft_tensor_release(ip);
        weft_tensor_t *same = make(dt, count * (size_t)world, me, 0);
        RANK_CHECK(weft_coll_all_to_all(pg, same, same, NULL, NULL, NULL) == WEFT_OK,
                   "in-place all_to_all");
        for (int s2 = 0; s2 < world; s2++) {
            weft_tensor_t *w = make(dt, count, s2, (size_t)me * count);
            RANK_CHECK(memcmp((uint8_t *)weft_tensor_data(same) + (size_t)s2 * count * es,
                              weft_tensor_data(w), count * es) == 0,
                       "in-place all_to_all part from %d", s2);
            weft_tensor_release(w);
        }
        weft_tensor_release(same);
    }
    weft_tensor_release(in);
    weft_tensor_release(flat);
    weft_tensor_release(all);
    weft_tensor_release(part);
    return 0;
}

static int body_world(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)rank;
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    RANK_CHECK(weft_pg_size(pg) == world && weft_pg_rank(pg) == weft_agent_rank(a), "ranks");
    /* Small counts take the direct exchange, large ones the ring (counts not divisible by
     * the world size included). */
    const size_t counts[] = {0, 1, 13, 40003};
    for (int d = 0; d < NDTYPES; d++) {
        for (int op = 0; op < WEFT_REDUCE_OP_COUNT; op++) {
            if (weft_reduce_check((weft_reduce_op_t)op, DTYPES[d]) != WEFT_OK) {
                continue;
            }
            for (size_t c = 0; c < sizeof(counts) / sizeof(counts[0]); c++) {
                if (check_all_reduce(pg, world, counts[c], DTYPES[d], (weft_reduce_op_t)op) != 0) {
                    return 1;
                }
            }
        }
    }
    for (int root = 0; root < world; root++) {
        if (check_broadcast(pg, 1000, DTYPES[root % NDTYPES], root) != 0 ||
            check_broadcast(pg, 0, WEFT_F32, root) != 0) {
            return 1;
        }
    }
    RANK_CHECK(check_broadcast(pg, 3 << 20, WEFT_F32, world - 1) == 0, "large broadcast");
    const weft_dtype_t moved[] = {WEFT_F32, WEFT_BF16, WEFT_I64, WEFT_U8};
    const size_t moved_counts[] = {0, 5, 3001};
    for (int d = 0; d < 4; d++) {
        for (int c = 0; c < 3; c++) {
            if (check_others(pg, world, moved[d], moved_counts[c]) != 0) {
                return 1;
            }
        }
    }
    RANK_CHECK(weft_coll_barrier(pg, NULL) == WEFT_OK, "barrier: %s", weft_last_error());
    /* Bitwise ops on a float are refused before anything is sent. */
    int64_t one = 4;
    weft_tensor_t *f;
    weft_tensor_create(WEFT_F32, 1, &one, &f);
    RANK_CHECK(weft_coll_all_reduce(pg, f, WEFT_BXOR, NULL) == WEFT_ERR_DTYPE, "bxor on f32");
    weft_tensor_release(f);
    weft_pg_free(pg);
    return 0;
}

#define WORLD_TEST(N)                                                                              \
    Test(collectives, world_of_##N, .timeout = 240)                                                \
    {                                                                                              \
        ranks_opts_t o;                                                                            \
        int codes[N];                                                                              \
        ranks_opts_init(&o, N, body_world);                                                        \
        o.deadline_ms = 230000;                                                                    \
        cr_assert_eq(ranks_run(&o, codes), 0);                                                     \
    }

WORLD_TEST(1)
WORLD_TEST(2)
WORLD_TEST(3)
WORLD_TEST(4)
WORLD_TEST(5)
WORLD_TEST(6)
WORLD_TEST(7)
WORLD_TEST(8)

static int body_ring_large(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)rank;
    (void)arg;
    weft_pg_t *pg;
    weft_pg_world(a, &pg);
    /* 8 MiB of f32 and of f16 through the ring. */
    RANK_CHECK(check_all_reduce(pg, world, (8u << 20) / 4 + 3, WEFT_F32, WEFT_SUM) == 0, "f32");
    RANK_CHECK(check_all_reduce(pg, world, (8u << 20) / 2 + 1, WEFT_F16, WEFT_AVG) == 0, "f16");
    /* 64 MiB worth. */
    RANK_CHECK(check_all_reduce(pg, world, (64u << 20) / 4, WEFT_F32, WEFT_MAX) == 0, "64 MiB");
    weft_pg_free(pg);
    return 0;
}

Test(collectives, large_ring_all_reduce, .timeout = 240)
{
    ranks_opts_t o;
    int codes[4];
    setenv("WEFT_COLL_ALGO", "ring", 1); /* large sizes would read each other's memory */
    ranks_opts_init(&o, 4, body_ring_large);
    o.deadline_ms = 230000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* Ring pieces on direct connections land in place: reduce-scatter pieces reduced as
 * they arrive, all-gather pieces received straight into the tensor; the results are
 * those of the fresh-tensor path (odd counts: chunks of unequal size). */
static int body_ring_lands(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)rank;
    (void)arg;
    weft_pg_t *pg;
    weft_pg_world(a, &pg);
    long before = coll__landed_pieces();
    RANK_CHECK(check_all_reduce(pg, world, (4u << 20) / 4 + 5, WEFT_F32, WEFT_SUM) == 0, "f32");
    RANK_CHECK(check_all_reduce(pg, world, (3u << 20) / 4 + 1, WEFT_F32, WEFT_MIN) == 0, "min");
    RANK_CHECK(check_all_reduce(pg, world, (4u << 20) / 2 + 3, WEFT_BF16, WEFT_AVG) == 0, "bf16");
    RANK_CHECK(coll__landed_pieces() > before, "no piece landed in place");
    weft_pg_free(pg);
    return 0;
}

Test(collectives, ring_pieces_land_in_place, .timeout = 120)
{
    setenv("WEFT_COLL_ALGO", "ring", 1);
    for (int world = 2; world <= 3; world++) {
        ranks_opts_t o;
        int codes[3];
        ranks_opts_init(&o, world, body_ring_lands);
        o.deadline_ms = 110000 / 2;
        cr_assert_eq(ranks_run(&o, codes), 0, "world %d", world);
    }
}

/* ------------------------------------------------ reading each other's memory (cma.c) */

/* Forced for every size (WEFT_COLL_ALGO=cma): every dtype x reduce op, counts from 0 to
 * 40003 (not divisible by the world size), in a sub-group too; every call took that path. */
static int body_cma(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    long before = coll__cma_ops(), calls = 0;
    const size_t counts[] = {0, 1, 13, 40003};
    for (int d = 0; d < NDTYPES; d++) {
        for (int op = 0; op < WEFT_REDUCE_OP_COUNT; op++) {
            if (weft_reduce_check((weft_reduce_op_t)op, DTYPES[d]) != WEFT_OK) {
                continue;
            }
            for (size_t c = 0; c < sizeof(counts) / sizeof(counts[0]); c++) {
                if (check_all_reduce(pg, world, counts[c], DTYPES[d], (weft_reduce_op_t)op) != 0) {
                    return 1;
                }
                calls++;
            }
        }
    }
    RANK_CHECK(coll__cma_ops() - before == calls, "%ld of %ld calls read the others' memory",
               coll__cma_ops() - before, calls);
    /* The last world - 1 ranks as a group of their own (group ranks differ from world ranks). */
    int members[8];
    for (int r = 1; r < world; r++) {
        members[r - 1] = r;
    }
    weft_pg_t *sub;
    RANK_CHECK(weft_pg_new(a, members, world - 1, &sub) == WEFT_OK, "new_group");
    if (rank > 0 && world > 2) {
        int64_t n = 100003;
        weft_tensor_t *t;
        weft_tensor_empty(WEFT_I32, 1, &n, &t);
        int32_t *v = weft_tensor_data(t);
        for (int64_t i = 0; i < n; i++) {
            v[i] = (int32_t)(i % 1000) * rank;
        }
        RANK_CHECK(weft_coll_all_reduce(sub, t, WEFT_SUM, NULL) == WEFT_OK, "sub-group: %s",
                   weft_last_error());
        int32_t ranks_sum = (int32_t)(world * (world - 1) / 2);
        for (int64_t i = 0; i < n; i++) {
            RANK_CHECK(v[i] == (int32_t)(i % 1000) * ranks_sum, "sub-group element %lld: %d",
                       (long long)i, v[i]);
        }
        weft_tensor_release(t);
    }
    weft_pg_free(sub);
    weft_pg_free(pg);
    return 0;
}

Test(collectives, cma_all_reduce, .timeout = 240)
{
    setenv("WEFT_COLL_ALGO", "cma", 1);
    const int worlds[] = {2, 3, 5};
    for (int i = 0; i < 3; i++) {
        ranks_opts_t o;
        int codes[5];
        ranks_opts_init(&o, worlds[i], body_cma);
        o.deadline_ms = 70000;
        cr_assert_eq(ranks_run(&o, codes), 0, "world %d", worlds[i]);
    }
}

/* Chosen by size and world size: from 2 MiB with two ranks, from 256 KiB with more; large
 * f32, f16 (through f32) and 64 MiB results are right. */
static int body_cma_auto(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)rank;
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    size_t min = world == 2 ? (2u << 20) : (256u << 10);
    long before = coll__cma_ops();
    RANK_CHECK(check_all_reduce(pg, world, min / 4 - 1, WEFT_F32, WEFT_SUM) == 0, "below");
    RANK_CHECK(coll__cma_ops() == before, "below the threshold it read the others' memory");
    RANK_CHECK(check_all_reduce(pg, world, min / 4, WEFT_F32, WEFT_SUM) == 0, "at");
    RANK_CHECK(coll__cma_ops() == before + 1, "at the threshold it did not");
    RANK_CHECK(check_all_reduce(pg, world, (8u << 20) / 2 + 1, WEFT_F16, WEFT_AVG) == 0, "f16");
    RANK_CHECK(check_all_reduce(pg, world, (64u << 20) / 4, WEFT_F32, WEFT_MAX) == 0, "64 MiB");
    RANK_CHECK(coll__cma_ops() == before + 3, "large ones did not");
    weft_pg_free(pg);
    return 0;
}

/* Runs @p body in worlds of 2 and of 4 ranks, each within @p deadline_ms. */
static void worlds_2_and_4(rank_main_cb_t body, int64_t deadline_ms)
{
    for (int world = 2; world <= 4; world += 2) {
        ranks_opts_t o;
        int codes[4];
        ranks_opts_init(&o, world, body);
        o.deadline_ms = deadline_ms;
        cr_assert_eq(ranks_run(&o, codes), 0, "world %d", world);
    }
}

Test(collectives, cma_chosen_by_size, .timeout = 240)
{
    worlds_2_and_4(body_cma_auto, 110000);
}

/* One rank may not take part (WEFT_COLL_CMA=0): every rank runs the ring instead, with the
 * right results, on the first operation and the later ones. The variable is set in rank 1
 * before its groups are created (a group reads it once, when it is created). */
static void cma_declined_setup(weft_agent_t *a, int rank, void *arg)
{
    (void)a;
    (void)arg;
    if (rank == 1) {
        setenv("WEFT_COLL_CMA", "0", 1);
    }
}

static int body_cma_declined(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)rank;
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    long before = coll__cma_ops();
    for (int i = 0; i < 3; i++) {
        RANK_CHECK(check_all_reduce(pg, world, (1u << 20) + 7, WEFT_F32, WEFT_SUM) == 0, "%d", i);
    }
    RANK_CHECK(coll__cma_ops() == before, "read the others' memory though rank 1 declined");
    weft_pg_free(pg);
    return 0;
}

Test(collectives, cma_declined_by_one_rank, .timeout = 120)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_cma_declined);
    o.setup = cma_declined_setup;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* Counts that differ at sizes that read each other's memory: a mismatch on every rank
 * (caught from the announcements, before any read), then the group goes on. */
static int body_cma_mismatch(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    int64_t n = (4 << 20) / 4 + rank;
    weft_tensor_t *t;
    weft_tensor_create(WEFT_F32, 1, &n, &t);
    weft_status_t st = weft_coll_all_reduce(pg, t, WEFT_SUM, NULL);
    RANK_CHECK(st == WEFT_ERR_MISMATCH, "count mismatch gave %s: %s", weft_strerror(st),
               weft_last_error());
    RANK_CHECK(strstr(weft_last_error(), "count") != NULL, "text: %s", weft_last_error());
    weft_tensor_release(t);
    RANK_CHECK(check_all_reduce(pg, world, (4u << 20) / 4, WEFT_F32, WEFT_SUM) == 0, "after");
    weft_pg_free(pg);
    return 0;
}

Test(collectives, cma_mismatch_fails_everywhere, .timeout = 120)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_cma_mismatch);
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ------------------------------------------------ oneshot: small all_reduce by one round of reads
 */

/* Every dtype and reduce op at sizes up to oneshot's 64 KiB, with other operations in between
 * (a slot is rewritten only once every member is done with what it held), on @p pg: exact
 * results; the first call settles the group (one cma operation), every call ran oneshot. */
static int check_oneshot(weft_pg_t *pg, int world)
{
    const weft_reduce_op_t fops[] = {WEFT_SUM, WEFT_PRODUCT, WEFT_MIN, WEFT_MAX, WEFT_AVG};
    const weft_reduce_op_t iops[] = {WEFT_BAND, WEFT_BOR, WEFT_BXOR};
    const size_t counts[] = {1000, 0, 1, 8192};
    long o = coll__algo_runs(OP_ALL_REDUCE, "oneshot"), cma = coll__cma_ops(), calls = 0;
    int k = 0;

    for (int d = 0; d < NDTYPES; d++) {
        bool integer = DTYPES[d] == WEFT_I8 || DTYPES[d] == WEFT_I32 || DTYPES[d] == WEFT_I64 ||
                       DTYPES[d] == WEFT_U8;
        for (size_t c = 0; c < 4; c++) {
            for (int i = 0; i < 5 + (integer ? 3 : 0); i++) {
                weft_reduce_op_t op = i < 5 ? fops[i] : iops[i - 5];
                if (check_all_reduce(pg, world, counts[c], DTYPES[d], op) != 0) {
                    return 1;
                }
                calls++;
                /* Another operation now and then: the next all_reduce takes the slot of the
                 * one before this one. */
                if (++k % 3 == 0 && check_broadcast(pg, 7, WEFT_I32, k % world) != 0) {
                    return 1;
                }
                if (k % 5 == 0) {
                    RANK_CHECK(weft_coll_barrier(pg, NULL) == WEFT_OK, "barrier: %s",
                               weft_last_error());
                }
            }
        }
    }
    /* The largest: 64 KiB of f32. */
    if (check_all_reduce(pg, world, (64u << 10) / 4, WEFT_F32, WEFT_SUM) != 0) {
        return 1;
    }
    calls++;
    RANK_CHECK(coll__algo_runs(OP_ALL_REDUCE, "oneshot") - o == calls,
               "%ld of %ld all_reduces ran oneshot", coll__algo_runs(OP_ALL_REDUCE, "oneshot") - o,
               calls);
    RANK_CHECK(coll__cma_ops() - cma == 1, "%ld operations read by cma (the settling one only)",
               coll__cma_ops() - cma);
    return 0;
}

/* A check of a group of @p world members (ranks_opts_t.arg of body_world_and_sub). */
typedef struct {
    int (*check)(weft_pg_t *pg, int world);
} group_check_t;

/* Runs the check @p arg names on the world and on a sub-group of the last world - 1 ranks
 * (group ranks differ from world ranks). */
static int body_world_and_sub(weft_agent_t *a, int rank, int world, void *arg)
{
    const group_check_t *gc = arg;
    weft_pg_t *pg, *sub;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    if (gc->check(pg, world) != 0) {
        return 1;
    }
    int members[8];
    for (int r = 1; r < world; r++) {
        members[r - 1] = r;
    }
    RANK_CHECK(weft_pg_new(a, members, world - 1, &sub) == WEFT_OK, "new_group");
    if (rank > 0 && world > 2 && gc->check(sub, world - 1) != 0) {
        return 1;
    }
    weft_pg_free(sub);
    weft_pg_free(pg);
    return 0;
}

/* Runs @p check on the world and a sub-group at worlds 2, 3 and 4. */
static void worlds_2_to_4(int (*check)(weft_pg_t *pg, int world))
{
    group_check_t gc = {check};
    for (int world = 2; world <= 4; world++) {
        ranks_opts_t o;
        int codes[4];
        ranks_opts_init(&o, world, body_world_and_sub);
        o.arg = &gc;
        o.deadline_ms = 75000;
        cr_assert_eq(ranks_run(&o, codes), 0, "world %d", world);
    }
}

Test(collectives, oneshot_all_reduce, .timeout = 240)
{
    worlds_2_to_4(check_oneshot);
}

/* Async calls queued back to back: each rank's operations overtake nothing, and the slots
 * alternate under them. */
static int body_oneshot_queued(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    enum { N = 64 };
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    weft_tensor_t *t[N];
    weft_future_t *f[N];
    for (int i = 0; i < N; i++) {
        int64_t n = 1 + i * 37;
        weft_tensor_empty(WEFT_I64, 1, &n, &t[i]);
        int64_t *v = weft_tensor_data(t[i]);
        for (int64_t j = 0; j < n; j++) {
            v[j] = (int64_t)(rank + 1) * (i + j);
        }
        RANK_CHECK(weft_coll_all_reduce(pg, t[i], WEFT_SUM, &f[i]) == WEFT_OK, "issue %d: %s", i,
                   weft_last_error());
    }
    int64_t ranks = (int64_t)world * (world + 1) / 2;
    for (int i = 0; i < N; i++) {
        RANK_CHECK(weft_future_wait(f[i], 30000) == WEFT_OK, "call %d: %s", i,
                   weft_future_error(f[i]));
        const int64_t *v = weft_tensor_data(t[i]);
        for (int64_t j = 0; j < 1 + i * 37; j++) {
            RANK_CHECK(v[j] == ranks * (i + j), "call %d element %lld: %lld", i, (long long)j,
                       (long long)v[j]);
        }
        weft_future_release(f[i]);
        weft_tensor_release(t[i]);
    }
    weft_pg_free(pg);
    return 0;
}

Test(collectives, oneshot_queued_calls, .timeout = 120)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_oneshot_queued);
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* A call one member refuses (weft_coll_fail) while another runs it by oneshot, having shown its
 * slot: the refusal finishes that operation for the refusing member too, so the next oneshot
 * operation that takes the same slot does not wait for the refusing member to finish it (it
 * waited out its whole deadline). */
/* Rank 1 says "go" to rank 0 by a call (rank 0 waits on g_go). */
static weft_future_t *g_go;

static void go_fn(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_future_complete(g_go, WEFT_OK, NULL, NULL);
    weft_call_reply(call, NULL);
}

static void go_setup(weft_agent_t *a, int rank, void *arg)
{
    (void)rank;
    (void)arg;
    weft_future_create(&g_go);
    weft_rpc_register(a, "go", go_fn, NULL);
}

static int body_oneshot_refused(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    RANK_CHECK(check_all_reduce(pg, world, 16, WEFT_F32, WEFT_SUM) == 0, "settling");
    RANK_CHECK(check_all_reduce(pg, world, 16, WEFT_F32, WEFT_SUM) == 0, "oneshot");
    long o = coll__algo_runs(OP_ALL_REDUCE, "oneshot");
    for (int k = 0; k < 2; k++) {
        if (rank == 0) {
            /* Refused once rank 1 has its call running (its slot shown). */
            RANK_CHECK(weft_future_wait(g_go, 20000) == WEFT_OK, "rank 1 never said go");
            weft_future_release(g_go);
            RANK_CHECK(weft_future_create(&g_go) == WEFT_OK, "no memory");
            weft_status_t st = weft_coll_fail(pg, WEFT_ERR_INVALID_ARG, "refused on purpose");
            RANK_CHECK(st == WEFT_ERR_INVALID_ARG, "weft_coll_fail: %s", weft_strerror(st));
        } else {
            int64_t n = 16;
            weft_tensor_t *t;
            weft_future_t *f;
            weft_tensor_create(WEFT_F32, 1, &n, &t);
            RANK_CHECK(weft_coll_all_reduce(pg, t, WEFT_SUM, &f) == WEFT_OK, "issue: %s",
                       weft_last_error());
            RANK_CHECK(weft_rpc_sync(a, 0, "go", NULL, 20000, NULL) == WEFT_OK, "go: %s",
                       weft_last_error());
            weft_status_t st = weft_future_wait(f, 20000);
            RANK_CHECK(st == WEFT_ERR_INVALID_ARG && strstr(weft_future_error(f), "on purpose"),
                       "the refused call gave %s: %s", weft_strerror(st), weft_future_error(f));
            weft_future_release(f);
            weft_tensor_release(t);
        }
    }
    /* The next ones take the slots the refused calls held. */
    for (int k = 0; k < 3; k++) {
        int64_t n = 16;
        weft_tensor_t *t;
        weft_future_t *f;
        weft_tensor_create(WEFT_F32, 1, &n, &t);
        float *p = weft_tensor_data(t);
        for (int i = 0; i < 16; i++) {
            p[i] = (float)(rank + 1);
        }
        RANK_CHECK(weft_coll_all_reduce(pg, t, WEFT_SUM, &f) == WEFT_OK, "issue: %s",
                   weft_last_error());
        weft_status_t st = weft_future_wait(f, 10000);
        RANK_CHECK(st == WEFT_OK, "all_reduce %d after the refusals: %s: %s", k,
                   weft_strerror(st), weft_future_error(f));
        RANK_CHECK(p[0] == 3.0f && p[15] == 3.0f, "all_reduce %d: %g", k, (double)p[0]);
        weft_future_release(f);
        weft_tensor_release(t);
    }
    RANK_CHECK(coll__algo_runs(OP_ALL_REDUCE, "oneshot") - o >= 3, "oneshot ran %ld times",
               coll__algo_runs(OP_ALL_REDUCE, "oneshot") - o);
    weft_future_release(g_go);
    weft_pg_free(pg);
    return 0;
}

Test(collectives, oneshot_after_calls_a_member_refused, .timeout = 120)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_oneshot_refused);
    o.setup = go_setup;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* Counts that differ, once the group settled: a mismatch on every rank (from the slots'
 * views, before any byte is reduced), then the group goes on. */
static int body_oneshot_mismatch(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    RANK_CHECK(check_all_reduce(pg, world, 100, WEFT_F32, WEFT_SUM) == 0, "settling");
    long o = coll__algo_runs(OP_ALL_REDUCE, "oneshot");
    int64_t n = 100 + rank;
    weft_tensor_t *t;
    weft_tensor_create(WEFT_F32, 1, &n, &t);
    weft_status_t st = weft_coll_all_reduce(pg, t, WEFT_SUM, NULL);
    RANK_CHECK(st == WEFT_ERR_MISMATCH, "count mismatch gave %s: %s", weft_strerror(st),
               weft_last_error());
    RANK_CHECK(strstr(weft_last_error(), "count") != NULL, "text: %s", weft_last_error());
    weft_tensor_release(t);
    RANK_CHECK(check_all_reduce(pg, world, 100, WEFT_F32, WEFT_SUM) == 0, "after");
    RANK_CHECK(check_all_reduce(pg, world, 3, WEFT_I32, WEFT_MAX) == 0, "after, twice");
    RANK_CHECK(coll__algo_runs(OP_ALL_REDUCE, "oneshot") - o == 3, "oneshot ran %ld times",
               coll__algo_runs(OP_ALL_REDUCE, "oneshot") - o);
    weft_pg_free(pg);
    return 0;
}

Test(collectives, oneshot_mismatch_fails_everywhere, .timeout = 120)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_oneshot_mismatch);
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* Different operations at the same point of a settled group: ranks 0 and 1 run a small
 * all_reduce (oneshot: no message) while rank 2 waits in a broadcast from rank 0 (the tree:
 * it only receives). The all_reduce's waits hail the member that shows nothing; every rank
 * fails with WEFT_ERR_MISMATCH, none at its deadline, and the group goes on. */
static int body_oneshot_kind_mismatch(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    weft_pg_set_timeout(pg, 30000);
    RANK_CHECK(check_all_reduce(pg, world, 10, WEFT_F32, WEFT_SUM) == 0, "settling");
    RANK_CHECK(check_all_reduce(pg, world, 10, WEFT_F32, WEFT_SUM) == 0, "settled");
    int64_t n = 10;
    weft_tensor_t *t;
    weft_tensor_create(WEFT_F32, 1, &n, &t);
    int64_t t0 = now_ms();
    weft_status_t st = rank == 2 ? weft_coll_broadcast(pg, t, 0, NULL)
                                 : weft_coll_all_reduce(pg, t, WEFT_SUM, NULL);
    RANK_CHECK(st == WEFT_ERR_MISMATCH, "different operations gave %s: %s", weft_strerror(st),
               weft_last_error());
    RANK_CHECK(now_ms() - t0 < 15000, "failed after %lld ms", (long long)(now_ms() - t0));
    weft_tensor_release(t);
    RANK_CHECK(check_all_reduce(pg, world, 10, WEFT_F32, WEFT_SUM) == 0, "after");
    weft_pg_free(pg);
    return 0;
}

Test(collectives, oneshot_kind_mismatch_fails_everywhere, .timeout = 120)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_oneshot_kind_mismatch);
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* One rank does not let the others read its memory (WEFT_COLL_CMA=0): the small all_reduces
 * run direct everywhere, exact, the first and the later ones. */
static int body_oneshot_declined(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)rank;
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    long o = coll__algo_runs(OP_ALL_REDUCE, "oneshot"),
         d = coll__algo_runs(OP_ALL_REDUCE, "direct"), cma = coll__cma_ops();
    for (int i = 0; i < 3; i++) {
        RANK_CHECK(check_all_reduce(pg, world, 1000 + (size_t)i, WEFT_F32, WEFT_SUM) == 0, "%d", i);
    }
    RANK_CHECK(coll__algo_runs(OP_ALL_REDUCE, "oneshot") == o &&
                   coll__algo_runs(OP_ALL_REDUCE, "direct") == d + 3 && coll__cma_ops() == cma,
               "oneshot %ld, direct %ld, cma %ld", coll__algo_runs(OP_ALL_REDUCE, "oneshot") - o,
               coll__algo_runs(OP_ALL_REDUCE, "direct") - d, coll__cma_ops() - cma);
    weft_pg_free(pg);
    return 0;
}

Test(collectives, oneshot_declined_by_one_rank, .timeout = 120)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_oneshot_declined);
    o.setup = cma_declined_setup;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ------------------------------------------------ every collective by cross-memory reads */

/* The operations that read each other's memory besides all_reduce. */
static const coll_kind_t CMA_KINDS[] = {OP_BROADCAST, OP_ALL_GATHER, OP_REDUCE_SCATTER,
                                        OP_ALL_TO_ALL};
static const weft_coll_op_t CMA_OPS[] = {WEFT_COLL_BROADCAST, WEFT_COLL_ALL_GATHER,
                                         WEFT_COLL_REDUCE_SCATTER, WEFT_COLL_ALL_TO_ALL};

static void cma_runs(long *out)
{
    for (int k = 0; k < 4; k++) {
        out[k] = coll__algo_runs(CMA_KINDS[k], "cma");
    }
}

/* Broadcast from every root, then check_others (all_gather flat, into a list and in place;
 * reduce_scatter; all_to_all even, uneven and in place) on @p pg of @p world members with
 * cma forced: exact results, and every such call read the others' memory. */
static int check_cma_moves(weft_pg_t *pg, int world)
{
    for (int k = 0; k < 4; k++) {
        RANK_CHECK(weft_pg_set_algorithm(pg, CMA_OPS[k], "cma") == WEFT_OK, "set cma: %s",
                   weft_last_error());
    }
    long before[4], after[4], want[4] = {0, 0, 0, 0};
    cma_runs(before);
    const size_t counts[] = {0, 5, 3001, (1u << 18) + 3}; /* the last: above 1 MiB of f32 */
    for (size_t c = 0; c < 4; c++) {
        for (int root = 0; root < world; root++) {
            if (check_broadcast(pg, counts[c], c == 3 ? WEFT_F32 : DTYPES[root % NDTYPES], root) !=
                0) {
                return 1;
            }
            want[0]++;
        }
    }
    const weft_dtype_t moved[] = {WEFT_F32, WEFT_BF16, WEFT_I64, WEFT_U8};
    for (int d = 0; d < 4; d++) {
        for (size_t c = 0; c < 4; c++) {
            size_t count = d == 0 ? counts[c] : counts[c] % 70001; /* the large one in f32 */
            if (check_others(pg, world, moved[d], count) != 0) {
                return 1;
            }
            want[1] += 2 + (count > 0);
            want[2] += 1;
            want[3] += 2 + (count > 0);
        }
    }
    cma_runs(after);
    for (int k = 0; k < 4; k++) {
        RANK_CHECK(after[k] - before[k] == want[k], "%s: %ld of %ld calls read the others' memory",
                   coll__kind_name(CMA_KINDS[k]), after[k] - before[k], want[k]);
    }
    return 0;
}

/* Forced for every size: broadcast, all_gather, reduce_scatter and all_to_all give exact
 * results, on the world and on a sub-group. */
Test(collectives, cma_every_collective, .timeout = 240)
{
    worlds_2_to_4(check_cma_moves);
}

/* By size: broadcast, all_gather and reduce_scatter read the others' memory from 64 KiB per
 * member (the tensor of broadcast, the input of all_gather, the output part of reduce_scatter),
 * and not below (f32: 16384 elements); all_to_all at every size (its members' sizes may differ:
 * a choice by size could differ between them). */
static int body_cma_moves_by_size(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)rank;
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    const size_t min = (64u << 10) / 4; /* f32 */
    long before[4], after[4];
    cma_runs(before);
    RANK_CHECK(check_broadcast(pg, min - 1, WEFT_F32, world - 1) == 0, "broadcast below");
    RANK_CHECK(check_others(pg, world, WEFT_F32, min - 1) == 0, "others below");
    cma_runs(after);
    long below[4] = {0, 0, 0, 3}; /* all_to_all: even, uneven and in place */
    for (int k = 0; k < 4; k++) {
        RANK_CHECK(after[k] - before[k] == below[k],
                   "%s: %ld calls below 64 KiB read the "
                   "others' memory",
                   coll__kind_name(CMA_KINDS[k]), after[k] - before[k]);
    }
    RANK_CHECK(check_broadcast(pg, min, WEFT_F32, world - 1) == 0, "broadcast at");
    RANK_CHECK(check_others(pg, world, WEFT_F32, min) == 0, "others at");
    long want[4] = {1, 3, 1, 3};
    cma_runs(before);
    for (int k = 0; k < 4; k++) {
        RANK_CHECK(before[k] - after[k] == want[k],
                   "%s: %ld of %ld calls at 64 KiB read the "
                   "others' memory",
                   coll__kind_name(CMA_KINDS[k]), before[k] - after[k], want[k]);
    }
    weft_pg_free(pg);
    return 0;
}

/* An uneven all_to_all whose members' tensors lie on both sides of every size threshold (rank
 * 0 sends a few elements, the others 100000 each way): every member must run the same
 * algorithm, whatever its own size, and the results are exact. */
static int body_all_to_all_sizes_differ(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    int64_t ins[4], outs[4], tin = 0, tout = 0;
    for (int r = 0; r < world; r++) {
        ins[r] = rank == 0 ? 3 : 100000; /* what this rank sends to r */
        outs[r] = r == 0 ? 3 : 100000;   /* what r sends to this rank */
        tin += ins[r];
        tout += outs[r];
    }
    weft_tensor_t *in = NULL, *out = NULL;
    weft_tensor_create(WEFT_F32, 1, &tin, &in);
    weft_tensor_create(WEFT_F32, 1, &tout, &out);
    float *ip = weft_tensor_data(in);
    for (int64_t i = 0; i < tin; i++) {
        ip[i] = (float)(rank * 1000000 + i);
    }
    weft_status_t st = weft_coll_all_to_all(pg, in, out, ins, outs, NULL);
    RANK_CHECK(st == WEFT_OK, "all_to_all: %s: %s", weft_strerror(st), weft_last_error());
    const float *op = weft_tensor_data(out);
    int64_t off = 0;
    for (int s = 0; s < world; s++) {
        int64_t from = (int64_t)rank * (s == 0 ? 3 : 100000); /* where s's part for me starts */
        for (int64_t i = 0; i < outs[s]; i++) {
            RANK_CHECK(op[off + i] == (float)(s * 1000000 + from + i),
                       "element %lld from rank %d", (long long)i, s);
        }
        off += outs[s];
    }
    weft_tensor_release(in);
    weft_tensor_release(out);
    weft_pg_free(pg);
    return 0;
}

Test(collectives, uneven_all_to_all_with_sizes_on_both_sides_of_the_thresholds, .timeout = 120)
{
    worlds_2_and_4(body_all_to_all_sizes_differ, 50000);
}

Test(collectives, cma_every_collective_by_size, .timeout = 120)
{
    worlds_2_and_4(body_cma_moves_by_size, 55000);
}

/* One rank does not let the others read its memory (WEFT_COLL_CMA=0): every rank runs the
 * other algorithms instead, with exact results, at sizes that would read. */
static int body_cma_moves_declined(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)rank;
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    long ops = coll__cma_ops(), tree = coll__algo_runs(OP_BROADCAST, "tree"),
         direct = coll__algo_runs(OP_ALL_GATHER, "direct");
    for (int i = 0; i < 2; i++) {
        RANK_CHECK(check_broadcast(pg, (1u << 20) + 7, WEFT_F32, i) == 0, "broadcast %d", i);
        RANK_CHECK(check_others(pg, world, WEFT_F32, 70001) == 0, "others %d", i);
    }
    RANK_CHECK(coll__cma_ops() == ops, "read the others' memory though rank 1 declined");
    RANK_CHECK(coll__algo_runs(OP_BROADCAST, "tree") == tree + 2 &&
                   coll__algo_runs(OP_ALL_GATHER, "direct") == direct + 6,
               "tree %ld, direct %ld", coll__algo_runs(OP_BROADCAST, "tree") - tree,
               coll__algo_runs(OP_ALL_GATHER, "direct") - direct);
    weft_pg_free(pg);
    return 0;
}

Test(collectives, cma_every_collective_declined_by_one_rank, .timeout = 120)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_cma_moves_declined);
    o.setup = cma_declined_setup;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* Once the members read each other, they signal through their boards: views that differ
 * (counts of all_gather, roots of broadcast) still fail on every rank, and the group goes
 * on. */
static int body_cma_moves_mismatch(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    const size_t n = (256u << 10) / 4;
    RANK_CHECK(check_broadcast(pg, n, WEFT_F32, 0) == 0, "before"); /* settles: messages */
    RANK_CHECK(check_broadcast(pg, n, WEFT_F32, 1) == 0, "boards");
    int64_t cn = (int64_t)n + rank, total = cn * world;
    weft_tensor_t *in, *out;
    weft_tensor_create(WEFT_F32, 1, &cn, &in);
    weft_tensor_create(WEFT_F32, 1, &total, &out);
    weft_status_t st = weft_coll_all_gather(pg, in, out, NULL);
    RANK_CHECK(st == WEFT_ERR_MISMATCH, "count mismatch gave %s: %s", weft_strerror(st),
               weft_last_error());
    RANK_CHECK(strstr(weft_last_error(), "count") != NULL, "text: %s", weft_last_error());
    weft_tensor_release(in);
    weft_tensor_release(out);
    int64_t bn = (int64_t)n;
    weft_tensor_t *t;
    weft_tensor_create(WEFT_F32, 1, &bn, &t);
    st = weft_coll_broadcast(pg, t, rank == 0 ? 0 : 1, NULL);
    RANK_CHECK(st == WEFT_ERR_MISMATCH, "root mismatch gave %s: %s", weft_strerror(st),
               weft_last_error());
    weft_tensor_release(t);
    long ops = coll__cma_ops();
    RANK_CHECK(check_broadcast(pg, n, WEFT_F32, world - 1) == 0, "after");
    RANK_CHECK(check_others(pg, world, WEFT_F32, n) == 0, "others after");
    RANK_CHECK(coll__cma_ops() == ops + 8, "%ld of 8 calls after read the others' memory",
               coll__cma_ops() - ops);
    weft_pg_free(pg);
    return 0;
}

Test(collectives, cma_every_collective_mismatch_fails_everywhere, .timeout = 120)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_cma_moves_mismatch);
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ------------------------------------------------ the algorithm table */

/* Runs of all_reduce by each algorithm in this process. */
static long runs(const char *name)
{
    return coll__algo_runs(OP_ALL_REDUCE, name);
}

/* An all_reduce of @p count f32 on @p pg that must be run by @p algo (exact result). */
static int check_ran(weft_pg_t *pg, int world, size_t count, const char *algo)
{
    long d = runs("direct"), r = runs("ring"), c = runs("cma"), o = runs("oneshot"),
         cma_ops = coll__cma_ops();
    if (check_all_reduce(pg, world, count, WEFT_F32, WEFT_SUM) != 0) {
        return 1;
    }
    long want_d = strcmp(algo, "direct") == 0, want_r = strcmp(algo, "ring") == 0,
         want_c = strcmp(algo, "cma") == 0, want_o = strcmp(algo, "oneshot") == 0;
    /* oneshot settles an unsettled group with cma's messages (one cma operation). */
    RANK_CHECK(
        runs("direct") - d == want_d && runs("ring") - r == want_r && runs("cma") - c == want_c &&
            runs("oneshot") - o == want_o && (want_o || coll__cma_ops() - cma_ops == want_c),
        "%zu floats: %s should have run; ran direct %ld, ring %ld, cma %ld, oneshot %ld", count,
        algo, runs("direct") - d, runs("ring") - r, runs("cma") - c, runs("oneshot") - o);
    return 0;
}

/* Each group has its own algorithm: three groups of the same members force ring, direct and
 * cma, and run a small all_reduce (by size: direct) and a large one (by size: cma) each;
 * every result is exact and each ran the algorithm its group forced. The choice is taken when
 * an operation is issued: one issued before a change keeps the old choice. "auto" and NULL
 * go back to the choice by size. */
static int body_forced(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)rank;
    (void)arg;
    const char *names[] = {"ring", "direct", "cma"};
    int all[3] = {0, 1, 2};
    weft_pg_t *pgs[3];
    for (int i = 0; i < 3; i++) {
        RANK_CHECK(weft_pg_new(a, all, world, &pgs[i]) == WEFT_OK, "new_group");
        RANK_CHECK(weft_pg_set_algorithm(pgs[i], WEFT_COLL_ALL_REDUCE, names[i]) == WEFT_OK,
                   "set %s: %s", names[i], weft_last_error());
    }
    const size_t small = 1000, large = (1u << 20) / 4 + 3; /* 4000 bytes; 1 MiB + 12 */
    for (int i = 0; i < 3; i++) {
        if (check_ran(pgs[i], world, small, names[i]) != 0 ||
            check_ran(pgs[i], world, large, names[i]) != 0) {
            return 1;
        }
    }
    /* Back to the choice by size. */
    RANK_CHECK(weft_pg_set_algorithm(pgs[0], WEFT_COLL_ALL_REDUCE, "auto") == WEFT_OK, "auto");
    RANK_CHECK(weft_pg_set_algorithm(pgs[1], WEFT_COLL_ALL_REDUCE, NULL) == WEFT_OK, "NULL");
    for (int i = 0; i < 2; i++) {
        if (check_ran(pgs[i], world, small, "oneshot") != 0 ||
            check_ran(pgs[i], world, large, "cma") != 0) {
            return 1;
        }
    }
    /* Issued before the change: the algorithm of its issue. */
    long r = runs("ring"), d = runs("direct");
    weft_pg_set_algorithm(pgs[2], WEFT_COLL_ALL_REDUCE, "ring");
    weft_tensor_t *t1 = scalar_f32(1.0f), *t2 = scalar_f32(2.0f);
    weft_future_t *f1;
    RANK_CHECK(weft_coll_all_reduce(pgs[2], t1, WEFT_SUM, &f1) == WEFT_OK, "async");
    weft_pg_set_algorithm(pgs[2], WEFT_COLL_ALL_REDUCE, "direct");
    RANK_CHECK(weft_coll_all_reduce(pgs[2], t2, WEFT_SUM, NULL) == WEFT_OK, "blocking: %s",
               weft_last_error());
    RANK_CHECK(weft_future_wait(f1, 30000) == WEFT_OK, "async: %s", weft_future_error(f1));
    weft_future_release(f1);
    RANK_CHECK(*(float *)weft_tensor_data(t1) == (float)world &&
                   *(float *)weft_tensor_data(t2) == 2.0f * (float)world,
               "results %f %f", *(float *)weft_tensor_data(t1), *(float *)weft_tensor_data(t2));
    RANK_CHECK(runs("ring") - r == 1 && runs("direct") - d == 1, "ring %ld, direct %ld",
               runs("ring") - r, runs("direct") - d);
    weft_tensor_release(t1);
    weft_tensor_release(t2);
    /* The other operations' algorithms can be named too: the tree even at a size that would
     * read the others' memory. */
    RANK_CHECK(weft_pg_set_algorithm(pgs[2], WEFT_COLL_BROADCAST, "tree") == WEFT_OK, "tree");
    RANK_CHECK(weft_pg_set_algorithm(pgs[2], WEFT_COLL_BARRIER, "direct") == WEFT_OK, "barrier");
    long tree = coll__algo_runs(OP_BROADCAST, "tree");
    RANK_CHECK(check_broadcast(pgs[2], (1u << 20) / 4, WEFT_I32, 1) == 0, "broadcast");
    RANK_CHECK(coll__algo_runs(OP_BROADCAST, "tree") == tree + 1, "the tree did not run");
    for (int i = 0; i < 3; i++) {
        weft_pg_free(pgs[i]);
    }
    return 0;
}

Test(collectives, algorithm_forced_per_group, .timeout = 120)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_forced);
    o.deadline_ms = 110000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* The choice by size, at its thresholds (bytes in the accumulation dtype: f16 counts as f32):
 * oneshot up to 64 KiB, direct above (more than two members: none), ring above 64 KiB (two
 * members: from 1 MiB), cma from 256 KiB (two members: from 2 MiB). */
static int body_thresholds(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)rank;
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    size_t one = 64u << 10, ring = world == 2 ? (1u << 20) : (64u << 10) + 4,
           cma = world == 2 ? 2u << 20 : 256u << 10;
    const char *below_ring = world == 2 ? "direct" : "oneshot";
    if (check_ran(pg, world, 1, "oneshot") != 0 || check_ran(pg, world, one / 4, "oneshot") != 0 ||
        (world == 2 && check_ran(pg, world, one / 4 + 1, "direct") != 0) ||
        check_ran(pg, world, ring / 4 - 1, below_ring) != 0 ||
        check_ran(pg, world, ring / 4, "ring") != 0 ||
        check_ran(pg, world, cma / 4 - 1, "ring") != 0 ||
        check_ran(pg, world, cma / 4, "cma") != 0) {
        return 1;
    }
    long o = runs("oneshot"), d = runs("direct"), r = runs("ring");
    RANK_CHECK(check_all_reduce(pg, world, one / 4, WEFT_F16, WEFT_SUM) == 0, "f16 oneshot");
    RANK_CHECK(check_all_reduce(pg, world, ring / 4 - 1, WEFT_F16, WEFT_SUM) == 0, "f16 below");
    RANK_CHECK(check_all_reduce(pg, world, ring / 4, WEFT_BF16, WEFT_SUM) == 0, "bf16 at");
    RANK_CHECK(runs("oneshot") == o + (world == 2 ? 1 : 2) && runs("direct") == d + (world == 2) &&
                   runs("ring") == r + 1,
               "halves: oneshot %ld, direct %ld, ring %ld", runs("oneshot") - o, runs("direct") - d,
               runs("ring") - r);
    weft_pg_free(pg);
    return 0;
}

Test(collectives, algorithm_thresholds_by_size, .timeout = 120)
{
    for (int world = 2; world <= 3; world++) {
        ranks_opts_t o;
        int codes[3];
        ranks_opts_init(&o, world, body_thresholds);
        o.deadline_ms = 55000;
        cr_assert_eq(ranks_run(&o, codes), 0, "world %d", world);
    }
}

/* Names a group does not have are refused (the text lists those it has), and so are
 * operations outside the enum; the group keeps its choice. */
static int body_unknown_algo(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)rank;
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    RANK_CHECK(weft_pg_set_algorithm(pg, WEFT_COLL_ALL_REDUCE, "ring") == WEFT_OK, "ring");
    weft_status_t st = weft_pg_set_algorithm(pg, WEFT_COLL_ALL_REDUCE, "tree");
    RANK_CHECK(st == WEFT_ERR_NOT_FOUND, "tree for all_reduce gave %s", weft_strerror(st));
    RANK_CHECK(strstr(weft_last_error(), "'tree'") != NULL &&
                   strstr(weft_last_error(), "direct, ring, cma, oneshot") != NULL,
               "text: %s", weft_last_error());
    st = weft_pg_set_algorithm(pg, WEFT_COLL_BROADCAST, "ring");
    RANK_CHECK(st == WEFT_ERR_NOT_FOUND, "ring for broadcast gave %s", weft_strerror(st));
    st = weft_pg_set_algorithm(pg, WEFT_COLL_ALL_REDUCE, "");
    RANK_CHECK(st == WEFT_ERR_NOT_FOUND, "an empty name gave %s", weft_strerror(st));
    st = weft_pg_set_algorithm(pg, (weft_coll_op_t)0, "direct");
    RANK_CHECK(st == WEFT_ERR_INVALID_ARG, "operation 0 gave %s", weft_strerror(st));
    st = weft_pg_set_algorithm(pg, (weft_coll_op_t)10, "direct");
    RANK_CHECK(st == WEFT_ERR_INVALID_ARG, "operation 10 gave %s", weft_strerror(st));
    RANK_CHECK(weft_pg_set_algorithm(NULL, WEFT_COLL_ALL_REDUCE, "ring") == WEFT_ERR_INVALID_ARG,
               "NULL group");
    if (check_ran(pg, world, 10, "ring") != 0) { /* still the ring */
        return 1;
    }
    weft_pg_free(pg);
    return 0;
}

Test(collectives, unknown_algorithm_is_refused, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_unknown_algo);
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* Whether @p text has @p line as one of its lines. */
static bool has_line(const char *text, const char *line)
{
    size_t n = strlen(line);
    for (const char *p = text; p != NULL && *p != '\0'; p = strchr(p, '\n'), p = p ? p + 1 : p) {
        if (strncmp(p, line, n) == 0 && (p[n] == '\n' || p[n] == '\0')) {
            return true;
        }
    }
    return false;
}

/* The description of a group: its members, timeout and every operation's choice, with the
 * thresholds for its size, as forced; cut to a small buffer, with the whole length returned. */
static int body_describe(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    weft_pg_t *pg, *pair;
    char buf[4096];
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    int two[] = {0, 1};
    RANK_CHECK(weft_pg_new(a, two, 2, &pair) == WEFT_OK, "new_group");
    size_t len = weft_pg_describe(pg, buf, sizeof(buf));
    RANK_CHECK(len == strlen(buf) && len < sizeof(buf), "length %zu", len);
    char first[128];
    snprintf(first, sizeof(first),
             "group 0: rank %d of %d, timeout 60000 ms (default 60000 ms), cross-memory reads "
             "allowed",
             rank, world);
    RANK_CHECK(has_line(buf, first), "world:\n%s", buf);
    RANK_CHECK(has_line(buf, "all_reduce: by size: oneshot up to 64 KiB (unless a member cannot "
                             "read the others' memory or does not let them (WEFT_COLL_CMA=0)), "
                             "else cma from 256 KiB (unless a member cannot read the others' "
                             "memory or does not let them (WEFT_COLL_CMA=0)), else ring above 64 "
                             "KiB, else direct"),
               "world:\n%s", buf);
#define CMA_OR(what, other)                                                                        \
    what ": by size: cma from 64 KiB (unless a member cannot read the others' memory or does "     \
         "not let them (WEFT_COLL_CMA=0)), else " other
    const char *others[] = {"barrier: direct",
                            CMA_OR("broadcast", "tree"),
                            "reduce: direct",
                            "gather: direct",
                            "scatter: direct",
                            CMA_OR("all_gather", "direct"),
                            CMA_OR("reduce_scatter", "direct"),
                            CMA_OR("all_to_all", "direct")};
#undef CMA_OR
    for (int i = 0; i < 8; i++) {
        RANK_CHECK(has_line(buf, others[i]), "no line '%s' in:\n%s", others[i], buf);
    }
    /* Two members: other thresholds; forced; another timeout. */
    weft_pg_describe(pair, buf, sizeof(buf));
    if (rank < 2) {
        RANK_CHECK(has_line(buf, "all_reduce: by size: oneshot up to 64 KiB (unless a member "
                                 "cannot read the others' memory or does not let them "
                                 "(WEFT_COLL_CMA=0)), else cma from 2 MiB (unless a member cannot "
                                 "read the others' memory or does not let them "
                                 "(WEFT_COLL_CMA=0)), else ring from 1 MiB, else direct"),
                   "pair:\n%s", buf);
    } else {
        RANK_CHECK(strncmp(buf, "group 1: not a member (2 members)", 33) == 0, "pair:\n%s", buf);
    }
    weft_pg_set_algorithm(pair, WEFT_COLL_ALL_REDUCE, "cma");
    weft_pg_set_algorithm(pg, WEFT_COLL_ALL_REDUCE, "direct");
    weft_pg_set_timeout(pg, 1234);
    weft_pg_describe(pair, buf, sizeof(buf));
    RANK_CHECK(has_line(buf, "all_reduce: cma (weft_pg_set_algorithm) unless a member cannot read "
                             "the others' memory or does not let them (WEFT_COLL_CMA=0); else by "
                             "size: ring from 1 MiB, else direct"),
               "pair forced:\n%s", buf);
    weft_pg_describe(pg, buf, sizeof(buf));
    RANK_CHECK(has_line(buf, "all_reduce: direct (weft_pg_set_algorithm)"), "world forced:\n%s",
               buf);
    /* Forced with a size limit: above it, the others compete by size, cma among them. */
    weft_pg_set_algorithm(pair, WEFT_COLL_ALL_REDUCE, "oneshot");
    weft_pg_describe(pair, buf, sizeof(buf));
    RANK_CHECK(has_line(buf, "all_reduce: oneshot (weft_pg_set_algorithm) up to 64 KiB, unless a "
                             "member cannot read the others' memory or does not let them "
                             "(WEFT_COLL_CMA=0); else by size: cma from 2 MiB (unless a member "
                             "cannot read the others' memory or does not let them "
                             "(WEFT_COLL_CMA=0)), else ring from 1 MiB, else direct"),
               "pair forced oneshot:\n%s", buf);
    weft_pg_describe(pg, buf, sizeof(buf));
    RANK_CHECK(strstr(buf, "timeout 1234 ms (default 60000 ms)") != NULL, "timeout:\n%s", buf);
    weft_pg_set_timeout(pg, 0); /* the default again */
    size_t whole = weft_pg_describe(pg, buf, sizeof(buf));
    RANK_CHECK(strstr(buf, "timeout 60000 ms (default 60000 ms)") != NULL, "timeout 0:\n%s", buf);
    weft_pg_set_timeout(pg, -5); /* ignored */
    weft_pg_describe(pg, buf, sizeof(buf));
    RANK_CHECK(strstr(buf, "timeout 60000 ms") != NULL, "timeout -5:\n%s", buf);
    /* Cut short: NUL-terminated, the whole length returned. */
    char small[16];
    memset(small, 'x', sizeof(small));
    RANK_CHECK(weft_pg_describe(pg, small, sizeof(small)) == whole && small[15] == '\0' &&
                   strncmp(small, buf, 15) == 0,
               "cut: '%.16s'", small);
    RANK_CHECK(weft_pg_describe(pg, NULL, 0) == whole, "length only");
    weft_pg_free(pair);
    weft_pg_free(pg);
    return 0;
}

Test(collectives, group_description, .timeout = 60)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_describe);
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* The configuration is read once per process and each group takes it when it is created: a
 * group created after the environment changed (in the same process) keeps the values read at
 * the start (WEFT_COLL_ALGO=ring and WEFT_COLL_TIMEOUT_MS=45000 from the test's environment,
 * cross-memory reads allowed), and so does a group created before. */
static int body_env_once(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)rank;
    (void)arg;
    weft_pg_t *pg, *later;
    char buf[4096];
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    setenv("WEFT_COLL_ALGO", "direct", 1);
    setenv("WEFT_COLL_TIMEOUT_MS", "1000", 1);
    setenv("WEFT_COLL_CMA", "0", 1);
    int all[] = {0, 1};
    RANK_CHECK(weft_pg_new(a, all, world, &later) == WEFT_OK, "new_group");
    weft_pg_t *both[] = {pg, later};
    for (int i = 0; i < 2; i++) {
        weft_pg_describe(both[i], buf, sizeof(buf));
        RANK_CHECK(has_line(buf, "all_reduce: ring (WEFT_COLL_ALGO)") &&
                       strstr(buf, "timeout 45000 ms (default 45000 ms), cross-memory reads "
                                   "allowed") != NULL,
                   "group %d:\n%s", i, buf);
        /* A small all_reduce runs the ring (by size it would be direct). */
        if (check_ran(both[i], world, 10, "ring") != 0) {
            return 1;
        }
    }
    /* Back to the values the group was created with. */
    weft_pg_set_algorithm(later, WEFT_COLL_ALL_REDUCE, "direct");
    weft_pg_set_timeout(later, 500);
    weft_pg_set_algorithm(later, WEFT_COLL_ALL_REDUCE, NULL);
    weft_pg_set_timeout(later, 0);
    weft_pg_describe(later, buf, sizeof(buf));
    RANK_CHECK(has_line(buf, "all_reduce: ring (WEFT_COLL_ALGO)") &&
                   strstr(buf, "timeout 45000 ms") != NULL,
               "reset:\n%s", buf);
    if (check_ran(later, world, 10, "ring") != 0) {
        return 1;
    }
    weft_pg_free(later);
    weft_pg_free(pg);
    return 0;
}

Test(collectives, environment_read_once_per_group, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    setenv("WEFT_COLL_ALGO", "ring", 1);
    setenv("WEFT_COLL_TIMEOUT_MS", "45000", 1);
    ranks_opts_init(&o, 2, body_env_once);
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ------------------------------------------------ reductions by device */

/* A stand-in for another device's reduce ops: the CPU's kernels, counting the calls and
 * recording the device they were given. Its "device" tensors are host memory wrapped with
 * the CUDA device type (what such an entry's kernels get until the collectives stage). */
static _Atomic long fake_calls;
static _Atomic int fake_index = -1;

static const weft_reduce_ops_t *cpu_ops(void)
{
    const weft_reduce_ops_t *ops = NULL;
    weft_reduce_ops_for(WEFT_CPU, &ops);
    return ops;
}

static void fake_seen(weft_device_t dev)
{
    atomic_fetch_add(&fake_calls, 1);
    atomic_store(&fake_index, dev.type == WEFT_DEVICE_CUDA ? dev.index : -2);
}

static void fake_reduce_into(weft_device_t dev, void *dst, const void *src, size_t n,
                             weft_dtype_t dt, weft_reduce_op_t op)
{
    fake_seen(dev);
    cpu_ops()->reduce_into(WEFT_CPU, dst, src, n, dt, op);
}

static void fake_reduce_to(weft_device_t dev, void *dst, const void *a, const void *b, size_t n,
                           weft_dtype_t dt, weft_reduce_op_t op)
{
    fake_seen(dev);
    cpu_ops()->reduce_to(WEFT_CPU, dst, a, b, n, dt, op);
}

static void fake_finish(weft_device_t dev, void *dst, size_t n, weft_dtype_t dt,
                        weft_reduce_op_t op, int count)
{
    fake_seen(dev);
    cpu_ops()->finish(WEFT_CPU, dst, n, dt, op, count);
}

static void fake_widen(weft_device_t dev, float *dst, const void *src, size_t n, weft_dtype_t dt)
{
    fake_seen(dev);
    cpu_ops()->widen(WEFT_CPU, dst, src, n, dt);
}

static void fake_narrow(weft_device_t dev, void *dst, const float *acc, size_t n, weft_dtype_t dt,
                        weft_reduce_op_t op, int count)
{
    fake_seen(dev);
    cpu_ops()->narrow(WEFT_CPU, dst, acc, n, dt, op, count);
}

static const weft_reduce_ops_t fake_ops = {"fake",      fake_reduce_into, fake_reduce_to,
                                           fake_finish, fake_widen,       fake_narrow};

static void release_host(void *data, void *arg)
{
    (void)data;
    weft_tensor_release(arg);
}

/* @p host's memory as a tensor of @p dev (it keeps @p host alive). */
static weft_tensor_t *on_device(weft_tensor_t *host, weft_device_t dev)
{
    int64_t n = weft_tensor_numel(host);
    weft_tensor_t *t = NULL;
    weft_tensor_wrap(weft_tensor_dtype(host), 1, &n, weft_tensor_data(host),
                     weft_tensor_nbytes(host), dev, release_host, weft_tensor_retain(host), &t);
    return t;
}

/* check_all_reduce on a tensor of @p dev. */
static int check_all_reduce_on(weft_pg_t *pg, int world, size_t count, weft_dtype_t dt,
                               weft_reduce_op_t op, weft_device_t dev)
{
    int rank = weft_pg_rank(pg);
    int64_t n = (int64_t)count;
    weft_tensor_t *host, *want;
    weft_tensor_empty(dt, 1, &n, &host);
    weft_tensor_empty(dt, 1, &n, &want);
    for (size_t i = 0; i < count; i++) {
        store(weft_tensor_data(host), dt, i, contribution(rank, i, op));
        store(weft_tensor_data(want), dt, i, reference(world, i, op, dt));
    }
    weft_tensor_t *t = on_device(host, dev);
    RANK_CHECK(t != NULL, "wrap: %s", weft_last_error());
    weft_status_t st = weft_coll_all_reduce(pg, t, op, NULL);
    RANK_CHECK(st == WEFT_OK, "all_reduce %s x%zu on device %d: %s", weft_dtype_name(dt), count,
               (int)dev.type, weft_last_error());
    RANK_CHECK(weft_tensor_equal(host, want), "all_reduce %s %s x%zu on device %d: wrong result",
               weft_dtype_name(dt), weft_reduce_op_name(op), count, (int)dev.type);
    weft_tensor_release(t);
    weft_tensor_release(host);
    weft_tensor_release(want);
    return 0;
}

/* Reductions run the reduce ops of their tensors' device. A device type without an entry is
 * refused on every member with WEFT_ERR_UNSUPPORTED, and the group goes on; once an entry is
 * registered, its kernels do every reduction of such tensors (direct, ring with pieces
 * reduced as they land, f16 through f32, reduce, reduce_scatter) and the CPU's the others;
 * removed, the device is refused again. */
static int body_device_ops(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)rank;
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    const weft_device_t cuda = {WEFT_DEVICE_CUDA, 1};
    int64_t n = 8;
    weft_tensor_t *host, *host2;
    weft_tensor_create(WEFT_F32, 1, &n, &host);
    int64_t n2 = 8 * world;
    weft_tensor_create(WEFT_F32, 1, &n2, &host2);
    weft_tensor_t *t = on_device(host, cuda), *t2 = on_device(host2, cuda);
    RANK_CHECK(t != NULL && t2 != NULL, "wrap: %s", weft_last_error());
    const weft_reduce_ops_t *ops = NULL;
    RANK_CHECK(weft_reduce_ops_for(cuda, &ops) == WEFT_ERR_UNSUPPORTED && ops == NULL,
               "an entry for cuda");
    weft_status_t st = weft_coll_all_reduce(pg, t, WEFT_SUM, NULL);
    RANK_CHECK(st == WEFT_ERR_UNSUPPORTED, "all_reduce on cuda gave %s", weft_strerror(st));
    RANK_CHECK(strstr(weft_last_error(), "no reduction kernels for cuda tensors") != NULL,
               "text: %s", weft_last_error());
    st = weft_coll_reduce(pg, t, 0, WEFT_SUM, NULL);
    RANK_CHECK(st == WEFT_ERR_UNSUPPORTED, "reduce on cuda gave %s", weft_strerror(st));
    st = weft_coll_reduce_scatter(pg, t2, t, WEFT_SUM, NULL);
    RANK_CHECK(st == WEFT_ERR_UNSUPPORTED, "reduce_scatter on cuda gave %s", weft_strerror(st));
    st = weft_coll_broadcast(pg, t, 0, NULL); /* moves device memory: not yet */
    RANK_CHECK(st == WEFT_ERR_UNSUPPORTED, "broadcast on cuda gave %s", weft_strerror(st));
    RANK_CHECK(weft_coll_barrier(pg, NULL) == WEFT_OK, "barrier: %s", weft_last_error());

    /* Registration. */
    RANK_CHECK(weft_reduce_ops_register(WEFT_DEVICE_CPU, &fake_ops) == WEFT_ERR_INVALID_ARG,
               "the cpu entry replaced");
    weft_reduce_ops_t partial = fake_ops;
    partial.narrow = NULL;
    RANK_CHECK(weft_reduce_ops_register(WEFT_DEVICE_CUDA, &partial) == WEFT_ERR_INVALID_ARG,
               "an entry without narrow");
    RANK_CHECK(weft_reduce_ops_register((weft_device_type_t)7, &fake_ops) == WEFT_ERR_INVALID_ARG,
               "device type 7");
    RANK_CHECK(weft_reduce_ops_register(WEFT_DEVICE_CUDA, &fake_ops) == WEFT_OK, "register: %s",
               weft_last_error());
    RANK_CHECK(weft_reduce_ops_for(cuda, &ops) == WEFT_OK && ops == &fake_ops, "lookup");
    long before = atomic_load(&fake_calls);
    if (check_all_reduce_on(pg, world, 1000, WEFT_F32, WEFT_SUM, cuda) != 0 ||
        check_all_reduce_on(pg, world, 1001, WEFT_F16, WEFT_AVG, cuda) != 0 ||
        check_all_reduce_on(pg, world, 77, WEFT_I32, WEFT_MAX, cuda) != 0) {
        return 1;
    }
    RANK_CHECK(atomic_load(&fake_calls) > before && atomic_load(&fake_index) == 1,
               "the entry was not used (%ld calls, device index %d)",
               atomic_load(&fake_calls) - before, atomic_load(&fake_index));
    /* The ring: large pieces are reduced as they land, on the transport's thread. */
    long landed = coll__landed_pieces();
    RANK_CHECK(weft_pg_set_algorithm(pg, WEFT_COLL_ALL_REDUCE, "ring") == WEFT_OK, "ring");
    before = atomic_load(&fake_calls);
    if (check_all_reduce_on(pg, world, (4u << 20) / 4 + 5, WEFT_F32, WEFT_SUM, cuda) != 0) {
        return 1;
    }
    RANK_CHECK(atomic_load(&fake_calls) > before, "the ring did not use the entry");
    RANK_CHECK(coll__landed_pieces() > landed, "no piece landed in place");
    weft_pg_set_algorithm(pg, WEFT_COLL_ALL_REDUCE, NULL);
    /* reduce and reduce_scatter. */
    for (int64_t i = 0; i < n2; i++) {
        ((float *)weft_tensor_data(host2))[i] = (float)(i + rank);
    }
    before = atomic_load(&fake_calls);
    RANK_CHECK(weft_coll_reduce_scatter(pg, t2, t, WEFT_SUM, NULL) == WEFT_OK, "reduce_scatter: %s",
               weft_last_error());
    for (int64_t i = 0; i < n; i++) {
        float want = (float)(world * (rank * n + i)) + (float)(world * (world - 1) / 2);
        RANK_CHECK(((float *)weft_tensor_data(host))[i] == want, "reduce_scatter element %lld",
                   (long long)i);
    }
    for (int64_t i = 0; i < n; i++) {
        ((float *)weft_tensor_data(host))[i] = (float)rank;
    }
    RANK_CHECK(weft_coll_reduce(pg, t, 0, WEFT_SUM, NULL) == WEFT_OK, "reduce: %s",
               weft_last_error());
    RANK_CHECK(rank != 0 ||
                   ((float *)weft_tensor_data(host))[3] == (float)(world * (world - 1) / 2),
               "reduce result");
    RANK_CHECK(atomic_load(&fake_calls) > before, "reduce, reduce_scatter did not use the entry");
    /* CPU tensors keep the CPU's kernels. */
    before = atomic_load(&fake_calls);
    RANK_CHECK(check_all_reduce(pg, world, 1000, WEFT_F16, WEFT_SUM) == 0, "cpu");
    RANK_CHECK(atomic_load(&fake_calls) == before, "a cpu tensor used the cuda entry");
    /* Removed: refused again. */
    RANK_CHECK(weft_reduce_ops_register(WEFT_DEVICE_CUDA, NULL) == WEFT_OK, "unregister");
    st = weft_coll_all_reduce(pg, t, WEFT_SUM, NULL);
    RANK_CHECK(st == WEFT_ERR_UNSUPPORTED, "after removal: %s", weft_strerror(st));
    RANK_CHECK(weft_coll_barrier(pg, NULL) == WEFT_OK, "barrier: %s", weft_last_error());
    weft_tensor_release(t);
    weft_tensor_release(t2);
    weft_tensor_release(host);
    weft_tensor_release(host2);
    weft_pg_free(pg);
    return 0;
}

Test(collectives, reductions_by_device, .timeout = 120)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_device_ops);
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ------------------------------------------------ staged operations and device entries */

/* A staged operation's ready hook: the tensor's contents "land" there (as a device-to-host
 * copy's would), so the operation must not read the tensor before it ran. */
typedef struct {
    weft_tensor_t *t;
    int rank, seq;
    weft_status_t fail; /* WEFT_OK: fill; else fail with it */
    _Atomic int calls;
} staged_hook_t;

static weft_status_t staged_ready(void *arg)
{
    staged_hook_t *h = arg;
    atomic_fetch_add(&h->calls, 1);
    float *x = weft_tensor_data(h->t);
    for (int64_t i = 0; i < weft_tensor_numel(h->t); i++) {
        x[i] = (float)((h->rank + 1) * (h->seq + 1)) + (float)(i % 7);
    }
    return WEFT_OK;
}

static weft_status_t staged_ready_failing(void *arg)
{
    staged_hook_t *h = arg;
    atomic_fetch_add(&h->calls, 1);
    /* what a device copy that failed records */
    return h->fail;
}

/* Staged all_reduce and broadcast: several issued at once, asynchronously, each hook run before
 * its operation reads the tensor (the tensors hold NaN until then), in order with a plain
 * operation between; a hook that fails on one member fails that operation on every member, and
 * the group goes on. */
static int body_staged(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    enum { K = 4, N = 3000 };
    int64_t n = N;
    staged_hook_t h[K];
    weft_future_t *f[K + 1];
    weft_tensor_t *plain = NULL;
    weft_tensor_create(WEFT_F32, 1, &n, &plain);
    ((float *)weft_tensor_data(plain))[0] = (float)rank;
    for (int k = 0; k < K; k++) {
        memset(&h[k], 0, sizeof(h[k]));
        weft_tensor_empty(WEFT_F32, 1, &n, &h[k].t);
        float *x = weft_tensor_data(h[k].t);
        for (int i = 0; i < N; i++) {
            x[i] = __builtin_nanf("");
        }
        h[k].rank = rank;
        h[k].seq = k;
        h[k].fail = WEFT_OK;
    }
    /* all_reduce, all_reduce, plain all_reduce, broadcast from the last rank, all_reduce */
    RANK_CHECK(weft_coll_all_reduce_staged(pg, h[0].t, WEFT_SUM, staged_ready, &h[0], &f[0]) ==
                   WEFT_OK,
               "%s", weft_last_error());
    RANK_CHECK(weft_coll_all_reduce_staged(pg, h[1].t, WEFT_MAX, staged_ready, &h[1], &f[1]) ==
                   WEFT_OK,
               "%s", weft_last_error());
    RANK_CHECK(weft_coll_all_reduce(pg, plain, WEFT_SUM, &f[K]) == WEFT_OK, "%s",
               weft_last_error());
    RANK_CHECK(weft_coll_broadcast_staged(pg, h[2].t, world - 1, staged_ready, &h[2], &f[2]) ==
                   WEFT_OK,
               "%s", weft_last_error());
    /* blocking, after the asynchronous ones */
    RANK_CHECK(weft_coll_all_reduce_staged(pg, h[3].t, WEFT_SUM, staged_ready, &h[3], NULL) ==
                   WEFT_OK,
               "blocking staged: %s", weft_last_error());
    f[3] = NULL;
    for (int k = 0; k <= K; k++) {
        if (f[k] != NULL) {
            RANK_CHECK(weft_future_wait(f[k], -1) == WEFT_OK, "op %d: %s", k,
                       weft_future_error(f[k]));
            weft_future_release(f[k]);
        }
    }
    for (int k = 0; k < K; k++) {
        RANK_CHECK(atomic_load(&h[k].calls) == 1, "hook %d ran %d times", k,
                   atomic_load(&h[k].calls));
        const float *x = weft_tensor_data(h[k].t);
        for (int i = 0; i < N; i++) {
            float base = (float)(i % 7), want;
            if (k == 1) { /* MAX: the last rank's */
                want = (float)(world * (k + 1)) + base;
            } else if (k == 2) { /* broadcast from the last rank */
                want = (float)(world * (k + 1)) + base;
            } else { /* SUM */
                want = (float)((k + 1) * world * (world + 1) / 2) + (float)world * base;
            }
            RANK_CHECK(x[i] == want, "staged op %d element %d: %g, want %g", k, i, (double)x[i],
                       (double)want);
        }
    }
    RANK_CHECK(((float *)weft_tensor_data(plain))[0] == (float)(world * (world - 1) / 2),
               "the plain all_reduce between them");
    /* a hook failing on rank 1 only */
    staged_hook_t bad;
    memset(&bad, 0, sizeof(bad));
    bad.t = h[0].t;
    bad.rank = rank;
    bad.fail = rank == 1 ? WEFT_ERR_CUDA : WEFT_OK;
    weft_status_t st = weft_coll_all_reduce_staged(
        pg, bad.t, WEFT_SUM, rank == 1 ? staged_ready_failing : staged_ready, &bad, NULL);
    RANK_CHECK(st != WEFT_OK, "a failing hook on rank 1: rank %d got OK", rank);
    if (rank == 1) {
        RANK_CHECK(st == WEFT_ERR_CUDA, "rank 1 got %s", weft_status_name(st));
        RANK_CHECK(strstr(weft_last_error(), "not made ready") != NULL, "text: %s",
                   weft_last_error());
    }
    /* the group is still in step */
    ((float *)weft_tensor_data(plain))[0] = 1.0f;
    RANK_CHECK(weft_coll_all_reduce(pg, plain, WEFT_SUM, NULL) == WEFT_OK, "after: %s",
               weft_last_error());
    RANK_CHECK(((float *)weft_tensor_data(plain))[0] == (float)world, "after: wrong sum");
    for (int k = 0; k < K; k++) {
        weft_tensor_release(h[k].t);
    }
    weft_tensor_release(plain);
    weft_pg_free(pg);
    return 0;
}

Test(collectives, staged_operations_wait_for_their_ready_hook, .timeout = 120)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_staged);
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* A device entry gets all_reduce and broadcast of its device's tensors (the entry here runs the
 * CPU collective on the host memory behind them, counting its calls); CPU tensors never reach
 * it; other operations keep the rules without an entry; removed, reductions of such tensors are
 * refused again. Registration refuses the CPU and incomplete entries. */
static _Atomic int entry_all_reduce, entry_broadcast, entry_freed;

static weft_tensor_t *as_cpu(weft_tensor_t *t)
{
    int64_t n = weft_tensor_numel(t);
    weft_tensor_t *c = NULL;
    weft_tensor_wrap(weft_tensor_dtype(t), 1, &n, weft_tensor_data(t), weft_tensor_nbytes(t),
                     WEFT_CPU, NULL, NULL, &c);
    return c;
}

static weft_status_t entry_ar(weft_pg_t *pg, weft_tensor_t *t, weft_reduce_op_t op,
                              weft_future_t **work_p)
{
    atomic_fetch_add(&entry_all_reduce, 1);
    weft_tensor_t *c = as_cpu(t);
    weft_status_t st = weft_coll_all_reduce(pg, c, op, work_p);
    weft_tensor_release(c); /* the operation holds its own reference */
    return st;
}

static weft_status_t entry_bc(weft_pg_t *pg, weft_tensor_t *t, int root, weft_future_t **work_p)
{
    atomic_fetch_add(&entry_broadcast, 1);
    weft_tensor_t *c = as_cpu(t);
    weft_status_t st = weft_coll_broadcast(pg, c, root, work_p);
    weft_tensor_release(c);
    return st;
}

static void entry_gone(weft_pg_t *pg)
{
    (void)pg;
    atomic_fetch_add(&entry_freed, 1);
}

static int body_device_entry(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    static const weft_coll_device_ops_t entry = {"fake", entry_ar, entry_bc, entry_gone};
    static const weft_coll_device_ops_t nameless = {NULL, entry_ar, entry_bc, NULL};
    RANK_CHECK(weft_coll_device_register(WEFT_DEVICE_CPU, &entry) == WEFT_ERR_INVALID_ARG,
               "the CPU");
    RANK_CHECK(weft_coll_device_register(WEFT_DEVICE_CUDA, &nameless) == WEFT_ERR_INVALID_ARG,
               "no name");
    RANK_CHECK(weft_coll_device_register((weft_device_type_t)7, &entry) == WEFT_ERR_INVALID_ARG,
               "type 7");
    RANK_CHECK(weft_coll_device_register(WEFT_DEVICE_CUDA, &entry) == WEFT_OK, "register");
    const weft_device_t cuda = {WEFT_DEVICE_CUDA, 0};
    int64_t n = 100;
    weft_tensor_t *host = NULL, *host2 = NULL;
    weft_tensor_create(WEFT_I32, 1, &n, &host);
    weft_tensor_create(WEFT_I32, 1, &n, &host2);
    int32_t *x = weft_tensor_data(host);
    for (int i = 0; i < 100; i++) {
        x[i] = rank + i;
    }
    weft_tensor_t *t = on_device(host, cuda);
    weft_future_t *f = NULL;
    RANK_CHECK(weft_coll_all_reduce(pg, t, WEFT_SUM, &f) == WEFT_OK, "%s", weft_last_error());
    RANK_CHECK(weft_future_wait(f, -1) == WEFT_OK, "%s", weft_future_error(f));
    weft_future_release(f);
    for (int i = 0; i < 100; i++) {
        RANK_CHECK(x[i] == world * (world - 1) / 2 + world * i, "element %d: %d", i, x[i]);
        x[i] = rank == 0 ? 1000 + i : -1;
    }
    RANK_CHECK(weft_coll_broadcast(pg, t, 0, NULL) == WEFT_OK, "%s", weft_last_error());
    for (int i = 0; i < 100; i++) {
        RANK_CHECK(x[i] == 1000 + i, "broadcast element %d: %d", i, x[i]);
    }
    RANK_CHECK(atomic_load(&entry_all_reduce) == 1 && atomic_load(&entry_broadcast) == 1,
               "entry calls %d %d", atomic_load(&entry_all_reduce),
               atomic_load(&entry_broadcast));
    /* CPU tensors never reach it */
    RANK_CHECK(weft_coll_all_reduce(pg, host2, WEFT_SUM, NULL) == WEFT_OK, "cpu");
    RANK_CHECK(atomic_load(&entry_all_reduce) == 1, "a CPU tensor reached the entry");
    /* an operation the entry does not take: refused as without one */
    weft_status_t st = weft_coll_barrier(pg, NULL);
    RANK_CHECK(st == WEFT_OK, "barrier");
    weft_tensor_t *t2 = on_device(host2, cuda);
    st = weft_coll_reduce(pg, t2, 0, WEFT_SUM, NULL);
    RANK_CHECK(st == WEFT_ERR_UNSUPPORTED, "reduce of device tensors without reduce ops: %s",
               weft_status_name(st));
    /* a handle being freed is told to the entry */
    weft_pg_t *second = NULL;
    RANK_CHECK(weft_pg_world(a, &second) == WEFT_OK, "second handle");
    weft_pg_free(second);
    RANK_CHECK(atomic_load(&entry_freed) == 1, "group_freed ran %d times",
               atomic_load(&entry_freed));
    /* removed: the reductions are refused again */
    RANK_CHECK(weft_coll_device_register(WEFT_DEVICE_CUDA, NULL) == WEFT_OK, "unregister");
    st = weft_coll_all_reduce(pg, t, WEFT_SUM, NULL);
    RANK_CHECK(st == WEFT_ERR_UNSUPPORTED, "all_reduce without the entry: %s",
               weft_status_name(st));
    weft_tensor_release(t);
    weft_tensor_release(t2);
    weft_tensor_release(host);
    weft_tensor_release(host2);
    weft_pg_free(pg);
    return 0;
}

Test(collectives, a_device_entry_takes_its_devices_tensors, .timeout = 120)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_device_entry);
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* The seeds' sub-group {1, 3}, two half-world groups at once, then MAX over the world. */
static int body_groups(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    weft_pg_t *w, *odd, *lo, *hi;
    weft_pg_world(a, &w);
    int odd_ranks[] = {1, 3};
    int lo_ranks[] = {0, 1}, hi_ranks[] = {2, 3};
    RANK_CHECK(weft_pg_new(a, odd_ranks, 2, &odd) == WEFT_OK, "new_group");
    RANK_CHECK(weft_pg_new(a, lo_ranks, 2, &lo) == WEFT_OK, "new_group lo");
    RANK_CHECK(weft_pg_new(a, hi_ranks, 2, &hi) == WEFT_OK, "new_group hi");
    int64_t n = 1;
    weft_tensor_t *t;
    weft_tensor_empty(WEFT_F32, 1, &n, &t);
    float *v = weft_tensor_data(t);
    *v = (float)rank;
    if (rank == 1 || rank == 3) {
        RANK_CHECK(weft_pg_rank(odd) == (rank == 1 ? 0 : 1), "group rank");
        RANK_CHECK(weft_coll_all_reduce(odd, t, WEFT_SUM, NULL) == WEFT_OK, "odd sum");
        RANK_CHECK(*v == 4.0f, "sum over {1,3} is %f", *v);
    } else {
        RANK_CHECK(weft_pg_rank(odd) == -1, "non-member rank");
        RANK_CHECK(weft_coll_all_reduce(odd, t, WEFT_SUM, NULL) == WEFT_ERR_INVALID_STATE,
                   "non-member use");
    }
    /* Both half groups at once, asynchronously. */
    *v = (float)(rank + 1);
    weft_pg_t *mine = rank < 2 ? lo : hi;
    weft_future_t *f;
    RANK_CHECK(weft_coll_all_reduce(mine, t, WEFT_PRODUCT, &f) == WEFT_OK, "async");
    RANK_CHECK(weft_future_wait(f, 30000) == WEFT_OK, "half group: %s", weft_future_error(f));
    weft_future_release(f);
    RANK_CHECK(*v == (rank < 2 ? 2.0f : 12.0f), "product %f", *v);
    RANK_CHECK(weft_coll_all_reduce(w, t, WEFT_MAX, NULL) == WEFT_OK, "max");
    RANK_CHECK(*v == 12.0f, "max %f", *v);
    RANK_CHECK(world == 4, "world");
    weft_tensor_release(t);
    weft_pg_free(odd);
    weft_pg_free(lo);
    weft_pg_free(hi);
    weft_pg_free(w);
    return 0;
}

Test(collectives, sub_groups_and_concurrent_groups, .timeout = 120)
{
    ranks_opts_t o;
    int codes[4];
    ranks_opts_init(&o, 4, body_groups);
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* The seeds' p2p chain 0 -> 1 -> 2 with +100, isend/irecv, any source and tags. */
static int body_p2p(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    weft_pg_t *pg;
    weft_pg_world(a, &pg);
    int64_t n = 4;
    weft_tensor_t *t;
    weft_tensor_create(WEFT_F32, 1, &n, &t);
    float *v = weft_tensor_data(t);
    if (rank == 0) {
        for (int i = 0; i < 4; i++) {
            v[i] = (float)i;
        }
        RANK_CHECK(weft_coll_send(pg, t, 1, 0, NULL) == WEFT_OK, "send: %s", weft_last_error());
    } else if (rank < world) {
        int src = -1;
        RANK_CHECK(weft_coll_recv(pg, t, rank - 1, 0, NULL, &src) == WEFT_OK, "recv: %s",
                   weft_last_error());
        RANK_CHECK(src == rank - 1, "src %d", src);
        for (int i = 0; i < 4; i++) {
            RANK_CHECK(v[i] == (float)(100 * (rank - 1) + i), "chain value %f", v[i]);
            v[i] += 100.0f;
        }
        if (rank + 1 < world) {
            RANK_CHECK(weft_coll_send(pg, t, rank + 1, 0, NULL) == WEFT_OK, "forward");
        }
    }
    /* Everyone sends to rank 0 with its rank as tag; rank 0 receives from any source,
     * tags in reverse order, while its own sends are in flight. */
    weft_tensor_t *mine;
    int64_t one = 1;
    weft_tensor_create(WEFT_I32, 1, &one, &mine);
    *(int32_t *)weft_tensor_data(mine) = rank * 10;
    weft_future_t *sf;
    RANK_CHECK(weft_coll_send(pg, mine, 0, rank, &sf) == WEFT_OK, "isend");
    if (rank == 0) {
        for (int tag = world - 1; tag >= 0; tag--) {
            weft_tensor_t *in;
            weft_tensor_create(WEFT_I32, 1, &one, &in);
            int src = -1;
            RANK_CHECK(weft_coll_recv(pg, in, WEFT_ANY_SOURCE, tag, NULL, &src) == WEFT_OK,
                       "recv tag %d: %s", tag, weft_last_error());
            RANK_CHECK(src == tag && *(int32_t *)weft_tensor_data(in) == tag * 10, "tag %d from %d",
                       tag, src);
            weft_tensor_release(in);
        }
        /* A wrong size is refused, not written. */
        weft_tensor_t *wrong;
        int64_t two = 2;
        weft_tensor_create(WEFT_I32, 1, &two, &wrong);
        weft_future_t *rf;
        weft_tensor_t *x;
        weft_tensor_create(WEFT_I32, 1, &one, &x);
        RANK_CHECK(weft_coll_send(pg, x, 0, 99, NULL) == WEFT_OK, "self send");
        RANK_CHECK(weft_coll_recv(pg, wrong, 0, 99, &rf, NULL) == WEFT_OK, "irecv");
        RANK_CHECK(weft_future_wait(rf, 10000) == WEFT_ERR_MISMATCH, "size mismatch: %s",
                   weft_future_error(rf));
        weft_future_release(rf);
        weft_tensor_release(x);
        weft_tensor_release(wrong);
    }
    RANK_CHECK(weft_future_wait(sf, 10000) == WEFT_OK, "isend done");
    weft_future_release(sf);
    /* A batch: everyone sends to its right and receives from its left at once. */
    {
        weft_tensor_t *out1, *in1;
        weft_tensor_create(WEFT_I64, 1, &one, &out1);
        weft_tensor_create(WEFT_I64, 1, &one, &in1);
        *(int64_t *)weft_tensor_data(out1) = 1000 + rank;
        weft_p2p_op_t ops[2] = {{0, in1, (rank - 1 + world) % world, 5},
                                {1, out1, (rank + 1) % world, 5}};
        weft_future_t *works[2];
        RANK_CHECK(weft_coll_batch_p2p(pg, ops, 2, works) == WEFT_OK, "batch");
        RANK_CHECK(weft_future_wait_all(works, 2, 10000) == WEFT_OK, "batch done");
        RANK_CHECK(*(int64_t *)weft_tensor_data(in1) == 1000 + (rank - 1 + world) % world,
                   "batch value");
        weft_future_release(works[0]);
        weft_future_release(works[1]);
        /* A batch whose second tensor cannot travel (bool): refused whole, none started (the
         * first would have been sent, and its receiver's next receive would take it). */
        weft_tensor_t *flag;
        weft_tensor_create(WEFT_BOOL, 1, &one, &flag);
        weft_p2p_op_t bad[2] = {{1, out1, (rank + 1) % world, 6}, {1, flag, (rank + 1) % world, 6}};
        weft_future_t *none[2] = {NULL, NULL};
        weft_status_t bst = weft_coll_batch_p2p(pg, bad, 2, none);
        RANK_CHECK(bst == WEFT_ERR_DTYPE && strstr(weft_last_error(), "operation 1") != NULL &&
                       none[0] == NULL,
                   "a batch with a bool tensor gave %s: %s", weft_strerror(bst), weft_last_error());
        weft_tensor_release(flag);
        weft_tensor_release(out1);
        weft_tensor_release(in1);
    }
    weft_tensor_release(mine);
    weft_tensor_release(t);
    RANK_CHECK(weft_coll_barrier(pg, NULL) == WEFT_OK, "barrier");
    weft_pg_free(pg);
    return 0;
}

/* A message that claims another member as its sender is not taken as that member's: rank 2
 * sends a point-to-point piece whose header names group rank 1 (its group's rank changed under
 * it, as a forger would write it); rank 0's receive from rank 1 gets rank 1's own data. */
static int body_forged_source(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    weft_tensor_t *t = tensor_f32_range(4, rank == 2 ? 99.0f : (float)rank);
    weft_future_t *f = NULL;
    if (rank == 0) {
        RANK_CHECK(weft_coll_recv(pg, t, 1, 7, &f, NULL) == WEFT_OK, "irecv: %s",
                   weft_last_error());
    } else if (rank == 2) {
        int mine = pg->g->rank;
        pg->g->rank = 1; /* the forgery */
        weft_status_t st = coll__p2p_send(pg->g, t, 0, 7, &f);
        pg->g->rank = mine;
        RANK_CHECK(st == WEFT_OK && weft_future_wait(f, 20000) == WEFT_OK, "forged send: %s",
                   weft_last_error());
        weft_future_release(f);
        f = NULL;
    }
    /* (rank 2's barrier piece follows its forged message to rank 0 on the same ring) */
    RANK_CHECK(weft_coll_barrier(pg, NULL) == WEFT_OK, "barrier: %s", weft_last_error());
    if (rank == 1) {
        RANK_CHECK(weft_coll_send(pg, t, 0, 7, NULL) == WEFT_OK, "send: %s", weft_last_error());
    }
    if (rank == 0) {
        RANK_CHECK(weft_future_wait(f, 20000) == WEFT_OK && weft_future_status(f) == WEFT_OK,
                   "recv: %s", weft_future_error(f));
        weft_future_release(f);
        const float *p = weft_tensor_data(t);
        RANK_CHECK(p[0] == 1.0f && p[3] == 4.0f, "received %g %g, not rank 1's 1 .. 4",
                   (double)p[0], (double)p[3]);
    }
    weft_tensor_release(t);
    RANK_CHECK(weft_coll_barrier(pg, NULL) == WEFT_OK, "barrier: %s", weft_last_error());
    weft_pg_free(pg);
    return 0;
}

Test(collectives, a_message_claiming_another_sender_is_not_taken_as_its, .timeout = 120)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_forged_source);
    o.deadline_ms = 60000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* An operation that timed out on one member fails at once, with that member's reason, on a
 * member that comes to it later: not after its own deadline, and never completing there with
 * what the first one had already shown (one member applying a step the other did not). Rank 0
 * times out first (a 300 ms group timeout), then tells rank 1 by a call, and only then does
 * rank 1 call the same all_reduce (it waited out its 20 s before). */

static int body_late_member(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    weft_tensor_t *t = tensor_f32_range(16, 1.0f);
    weft_status_t st;
    if (rank == 0) {
        weft_pg_set_timeout(pg, 300);
        st = weft_coll_all_reduce(pg, t, WEFT_SUM, NULL);
        RANK_CHECK(st == WEFT_ERR_TIMEOUT, "alone: %s: %s", weft_strerror(st), weft_last_error());
        weft_value_t *out = NULL;
        RANK_CHECK(weft_rpc_sync(a, 1, "go", NULL, 20000, &out) == WEFT_OK, "go: %s",
                   weft_last_error());
        weft_value_free(out);
    } else {
        RANK_CHECK(weft_future_wait(g_go, 20000) == WEFT_OK, "rank 0 never said go");
        weft_pg_set_timeout(pg, 20000);
        st = weft_coll_all_reduce(pg, t, WEFT_SUM, NULL);
        RANK_CHECK(st == WEFT_ERR_TIMEOUT &&
                       strstr(weft_last_error(), "rank 0: all_reduce") != NULL,
                   "the late member's all_reduce gave %s: %s", weft_strerror(st),
                   weft_last_error());
    }
    weft_tensor_release(t);
    weft_pg_free(pg);
    return 0;
}

Test(collectives, an_operation_timed_out_on_one_member_fails_on_a_later_one, .timeout = 120)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_late_member);
    o.setup = go_setup;
    o.deadline_ms = 60000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

Test(collectives, point_to_point, .timeout = 120)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_p2p);
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* Mismatched calls: every member gets WEFT_ERR_MISMATCH naming ranks and values, and the
 * group goes on working. */
static int body_mismatch(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    weft_pg_t *pg;
    weft_pg_world(a, &pg);
    weft_pg_set_timeout(pg, 20000);
    int64_t n = rank == 2 ? 6 : 5;
    weft_tensor_t *t;
    weft_tensor_create(WEFT_F32, 1, &n, &t);
    weft_status_t st = weft_coll_all_reduce(pg, t, WEFT_SUM, NULL);
    RANK_CHECK(st == WEFT_ERR_MISMATCH, "count mismatch gave %s", weft_strerror(st));
    RANK_CHECK(strstr(weft_last_error(), "count=6") != NULL &&
                   strstr(weft_last_error(), "count=5") != NULL,
               "text: %s", weft_last_error());
    weft_tensor_release(t);
    n = 5;
    weft_tensor_create(WEFT_F32, 1, &n, &t);
    st = weft_coll_all_reduce(pg, t, rank == 0 ? WEFT_MAX : WEFT_SUM, NULL);
    RANK_CHECK(st == WEFT_ERR_MISMATCH, "op mismatch gave %s", weft_strerror(st));
    RANK_CHECK(strstr(weft_last_error(), "op=max") != NULL, "text: %s", weft_last_error());
    st = weft_coll_broadcast(pg, t, rank == 1 ? 1 : 0, NULL);
    RANK_CHECK(st == WEFT_ERR_MISMATCH, "root mismatch gave %s", weft_strerror(st));
    st = weft_coll_reduce(pg, t, rank == 3 ? 3 : 1, WEFT_SUM, NULL);
    RANK_CHECK(st == WEFT_ERR_MISMATCH, "reduce root mismatch gave %s", weft_strerror(st));
    RANK_CHECK(strstr(weft_last_error(), "root=") != NULL, "text: %s", weft_last_error());
    {
        int64_t gn = rank == 1 ? 2 : 1, fn = 4;
        weft_tensor_t *gin, *gout;
        weft_tensor_create(WEFT_F32, 1, &gn, &gin);
        weft_tensor_create(WEFT_F32, 1, &fn, &gout);
        st = weft_coll_gather(pg, gin, rank == 0 ? gout : NULL, 0, NULL);
        RANK_CHECK(st == WEFT_ERR_MISMATCH || (rank == 0 && st == WEFT_ERR_SHAPE),
                   "gather size mismatch gave %s", weft_strerror(st));
        weft_tensor_release(gin);
        weft_tensor_release(gout);
    }
    {
        /* One rank passes no tensor: it is refused there, and the others fail now with its
         * reason, not at the deadline. */
        int64_t one = 1, all = world;
        weft_tensor_t *gin = NULL, *gout = NULL;
        weft_tensor_create(WEFT_F32, 1, &one, &gin);
        weft_tensor_create(WEFT_F32, 1, &all, &gout);
        st = weft_coll_all_gather(pg, rank == 2 ? NULL : gin, gout, NULL);
        RANK_CHECK(st == WEFT_ERR_INVALID_ARG && strstr(weft_last_error(), "NULL tensor") != NULL,
                   "all_gather with a NULL tensor on rank 2 gave %s: %s", weft_strerror(st),
                   weft_last_error());
        weft_tensor_release(gin);
        weft_tensor_release(gout);
    }
    /* Half the ranks name another root: caught, not waited out. */
    st = weft_coll_broadcast(pg, t, rank % 2, NULL);
    RANK_CHECK(st == WEFT_ERR_MISMATCH, "split-root broadcast gave %s", weft_strerror(st));
    {
        /* Everyone believes it is the root of a gather. */
        int64_t one = 1, four = 4;
        weft_tensor_t *gin, *gout;
        weft_tensor_create(WEFT_F32, 1, &one, &gin);
        weft_tensor_create(WEFT_F32, 1, &four, &gout);
        st = weft_coll_gather(pg, gin, gout, rank, NULL);
        RANK_CHECK(st == WEFT_ERR_MISMATCH, "all-root gather gave %s", weft_strerror(st));
        /* The root's output is the wrong size: everyone fails that gather with the
         * root's reason, and the group stays in step. */
        int64_t three = 3;
        weft_tensor_t *bad;
        weft_tensor_create(WEFT_F32, 1, &three, &bad);
        st = weft_coll_gather(pg, gin, rank == 0 ? bad : NULL, 0, NULL);
        RANK_CHECK(st == WEFT_ERR_SHAPE, "bad root output gave %s: %s", weft_strerror(st),
                   weft_last_error());
        weft_tensor_release(bad);
        weft_tensor_release(gin);
        weft_tensor_release(gout);
    }
    {
        /* all_to_all: rank 0 expects 2 elements from rank 1, which sends 1. */
        int64_t ins[4] = {1, 1, 1, 1}, outs[4] = {1, 1, 1, 1};
        if (rank == 0) {
            outs[1] = 2;
        }
        int64_t tin = 4, tout = rank == 0 ? 5 : 4;
        weft_tensor_t *ain, *aout;
        weft_tensor_create(WEFT_F32, 1, &tin, &ain);
        weft_tensor_create(WEFT_F32, 1, &tout, &aout);
        st = weft_coll_all_to_all(pg, ain, aout, ins, outs, NULL);
        /* Every member, ranks 2 and 3 included, which agree with everyone. */
        RANK_CHECK(st == WEFT_ERR_MISMATCH, "all_to_all split mismatch gave %s: %s",
                   weft_strerror(st), weft_last_error());
        RANK_CHECK(strstr(weft_last_error(),
                          "rank 1 sends 1 elements to rank 0, which expects 2 from it") != NULL,
                   "text: %s", weft_last_error());
        weft_tensor_release(ain);
        weft_tensor_release(aout);
    }
    /* Different operations altogether. */
    st = rank == world - 1 ? weft_coll_broadcast(pg, t, 0, NULL)
                           : weft_coll_all_reduce(pg, t, WEFT_SUM, NULL);
    RANK_CHECK(st == WEFT_ERR_MISMATCH, "op kind mismatch gave %s", weft_strerror(st));
    /* And then it works. */
    float *v = weft_tensor_data(t);
    for (int i = 0; i < 5; i++) {
        v[i] = 1.0f;
    }
    RANK_CHECK(weft_coll_all_reduce(pg, t, WEFT_SUM, NULL) == WEFT_OK, "after: %s",
               weft_last_error());
    RANK_CHECK(v[4] == (float)world, "sum after mismatches %f", v[4]);
    weft_tensor_release(t);
    weft_pg_free(pg);
    return 0;
}

Test(collectives, mismatched_calls_fail_everywhere, .timeout = 120)
{
    ranks_opts_t o;
    int codes[4];
    ranks_opts_init(&o, 4, body_mismatch);
    cr_assert_eq(ranks_run(&o, codes), 0);
}

static int body_two_handles(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    weft_pg_t *w1, *w2;
    RANK_CHECK(weft_pg_world(a, &w1) == WEFT_OK && weft_pg_world(a, &w2) == WEFT_OK, "handles");
    int64_t n = 3;
    weft_tensor_t *t;
    weft_tensor_create(WEFT_I32, 1, &n, &t);
    for (int i = 0; i < 6; i++) {
        int32_t *v = weft_tensor_data(t);
        v[0] = v[1] = v[2] = rank + i;
        RANK_CHECK(weft_coll_all_reduce(i % 2 ? w1 : w2, t, WEFT_SUM, NULL) == WEFT_OK,
                   "round %d: %s", i, weft_last_error());
        int32_t want = world * i + world * (world - 1) / 2;
        RANK_CHECK(v[2] == want, "round %d: %d, want %d", i, v[2], want);
    }
    weft_pg_free(w1);
    RANK_CHECK(weft_coll_barrier(w2, NULL) == WEFT_OK, "after freeing one handle");
    weft_pg_free(w2);
    weft_tensor_release(t);
    return 0;
}

Test(collectives, handles_to_the_world_share_one_sequence, .timeout = 120)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_two_handles);
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* Rank 2 of the dead-rank test counts the others' notes: each says its sender is past the first
 * barrier and inside the all_reduce. */
#define NOTE_CHANNEL 64
static atomic_int notes;

static void on_note(void *state, int src, weft_value_t *msg)
{
    (void)state;
    (void)src;
    weft_value_free(msg);
    atomic_fetch_add(&notes, 1);
}

static int note_state;

static weft_status_t note_create(weft_agent_t *a, void **state_p)
{
    (void)a;
    *state_p = &note_state;
    return WEFT_OK;
}

static const weft_module_desc_t note_module = {
    .name = "note", .channel = NOTE_CHANNEL, .create = note_create, .on_message = on_note};

static void dead_setup(weft_agent_t *a, int rank, void *arg)
{
    void *state;
    (void)rank;
    (void)arg;
    if (weft_agent_module(a, &note_module, &state) != WEFT_OK) {
        abort();
    }
}

static int body_dead(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    weft_pg_t *pg;
    weft_pg_world(a, &pg);
    weft_pg_set_timeout(pg, 30000);
    RANK_CHECK(weft_coll_barrier(pg, NULL) == WEFT_OK, "first barrier");
    if (rank == 2) {
        /* Dies while the others are inside the next operation; first its part of the barrier
         * must have left the process (a rank that dies at once may take it along): every other
         * rank finished the barrier, which it could not without that part. */
        RANK_WAIT(atomic_load(&notes) == world - 1, 20000, "%d of %d notes", atomic_load(&notes),
                  world - 1);
        raise(SIGKILL);
    }
    int64_t n = 100000;
    weft_tensor_t *t;
    weft_tensor_create(WEFT_F32, 1, &n, &t);
    int64_t t0 = now_ms();
    weft_future_t *f;
    RANK_CHECK(weft_coll_all_reduce(pg, t, WEFT_SUM, &f) == WEFT_OK, "all_reduce: %s",
               weft_last_error());
    weft_value_t *note;
    weft_value_create(&note);
    weft_status_t st = weft_agent_send(a, 2, NOTE_CHANNEL, note, NULL);
    weft_value_free(note);
    RANK_CHECK(st == WEFT_OK, "note to rank 2: %s", weft_last_error());
    st = weft_future_wait(f, 60000);
    RANK_CHECK(st == WEFT_ERR_PEER_LOST, "all_reduce with a dead rank gave %s: %s",
               weft_strerror(st), weft_future_error(f));
    RANK_CHECK(now_ms() - t0 < 10000, "failed after %lld ms", (long long)(now_ms() - t0));
    weft_future_release(f);
    weft_tensor_release(t);
    weft_pg_free(pg);
    return 0;
}

/* 400 KB at world 4: the members read each other's memory (cma.c); then the ring. */
Test(collectives, dead_rank_fails_pending_operations, .timeout = 120)
{
    for (int ring = 0; ring < 2; ring++) {
        ranks_opts_t o;
        int codes[4];
        if (ring) {
            setenv("WEFT_COLL_ALGO", "ring", 1);
        }
        ranks_opts_init(&o, 4, body_dead);
        o.setup = dead_setup;
        ranks_run(&o, codes);
        cr_assert_eq(codes[0], 0, "ring %d", ring);
        cr_assert_eq(codes[1], 0, "ring %d", ring);
        cr_assert_eq(codes[2], 128 + SIGKILL, "ring %d", ring);
        cr_assert_eq(codes[3], 0, "ring %d", ring);
    }
}

/* A member killed while the others are inside a broadcast (arg 0), an all_gather (arg 1) or
 * a small all_reduce (arg 2, oneshot) that reads each other's memory, signalled through the
 * boards or the slots (the group settled on its first such operation): each of them fails
 * with WEFT_ERR_PEER_LOST, within seconds. */
static int body_dead_cma(weft_agent_t *a, int rank, int world, void *arg)
{
    int which = *(const int *)arg;
    bool gather = which == 1, small = which == 2;
    weft_pg_t *pg;
    weft_pg_world(a, &pg);
    weft_pg_set_timeout(pg, 30000);
    const size_t n = small ? 1000 : (1u << 20) / 4;
    for (int i = 0; i < 2; i++) {
        if ((small    ? check_all_reduce(pg, world, n, WEFT_F32, WEFT_SUM)
             : gather ? check_others(pg, world, WEFT_F32, n)
                      : check_broadcast(pg, n, WEFT_F32, i)) != 0) {
            return 1;
        }
    }
    RANK_CHECK(weft_coll_barrier(pg, NULL) == WEFT_OK, "barrier");
    if (rank == 2) {
        RANK_WAIT(atomic_load(&notes) == world - 1, 20000, "%d of %d notes", atomic_load(&notes),
                  world - 1);
        raise(SIGKILL);
    }
    int64_t cn = (int64_t)n, total = cn * world;
    weft_tensor_t *in, *out;
    weft_tensor_create(WEFT_F32, 1, &cn, &in);
    weft_tensor_create(WEFT_F32, 1, &total, &out);
    coll_kind_t kind = small ? OP_ALL_REDUCE : gather ? OP_ALL_GATHER : OP_BROADCAST;
    const char *algo = small ? "oneshot" : "cma";
    long runs_before = coll__algo_runs(kind, algo);
    int64_t t0 = now_ms();
    weft_future_t *f;
    weft_status_t st = small    ? weft_coll_all_reduce(pg, in, WEFT_SUM, &f)
                       : gather ? weft_coll_all_gather(pg, in, out, &f)
                                : weft_coll_broadcast(pg, in, 0, &f);
    RANK_CHECK(st == WEFT_OK, "issue: %s", weft_last_error());
    weft_value_t *note;
    weft_value_create(&note);
    st = weft_agent_send(a, 2, NOTE_CHANNEL, note, NULL);
    weft_value_free(note);
    RANK_CHECK(st == WEFT_OK, "note to rank 2: %s", weft_last_error());
    st = weft_future_wait(f, 60000);
    RANK_CHECK(st == WEFT_ERR_PEER_LOST, "%s with a dead rank gave %s: %s", coll__kind_name(kind),
               weft_strerror(st), weft_future_error(f));
    RANK_CHECK(now_ms() - t0 < 10000, "failed after %lld ms", (long long)(now_ms() - t0));
    RANK_CHECK(coll__algo_runs(kind, algo) == runs_before + 1, "it did not run %s", algo);
    weft_future_release(f);
    weft_tensor_release(in);
    weft_tensor_release(out);
    weft_pg_free(pg);
    return 0;
}

Test(collectives, dead_rank_fails_cma_collectives, .timeout = 120)
{
    for (int op = 0; op < 3; op++) {
        ranks_opts_t o;
        int codes[4];
        ranks_opts_init(&o, 4, body_dead_cma);
        o.setup = dead_setup;
        o.arg = &op;
        ranks_run(&o, codes);
        cr_assert_eq(codes[0], 0, "op %d", op);
        cr_assert_eq(codes[1], 0, "op %d", op);
        cr_assert_eq(codes[2], 128 + SIGKILL, "op %d", op);
        cr_assert_eq(codes[3], 0, "op %d", op);
    }
}

/* ------------------------------------------------------------ deadlines and buffers */

/* A 1-element i64 message from @p from to @p to (tag 99), to order the ranks' steps. */
static int signal_rank(weft_pg_t *pg, int from, int to, int64_t value, int64_t *got)
{
    int64_t one = 1;
    weft_tensor_t *t;
    weft_tensor_create(WEFT_I64, 1, &one, &t);
    weft_status_t st;
    if (weft_pg_rank(pg) == from) {
        *(int64_t *)weft_tensor_data(t) = value;
        st = weft_coll_send(pg, t, to, 99, NULL);
    } else {
        st = weft_coll_recv(pg, t, from, 99, NULL, NULL);
        if (got != NULL) {
            *got = *(int64_t *)weft_tensor_data(t);
        }
    }
    weft_tensor_release(t);
    RANK_CHECK(st == WEFT_OK, "signal %d -> %d: %s", from, to, weft_last_error());
    return 0;
}

typedef struct {
    weft_future_t *done; /* completed by the callback */
    long held;           /* sent pieces the transport held when the operation completed */
} held_probe_t;

static void held_cb(weft_future_t *f, void *arg)
{
    held_probe_t *p = arg;
    (void)f;
    p->held = coll__held_pieces();
    weft_future_complete(p->done, WEFT_OK, NULL, NULL);
}

/* Rank 1 is stopped while rank 0's all_reduce sends it 64 MiB: the transport holds the
 * pieces past the operation's deadline. The operation fails with WEFT_ERR_TIMEOUT, but only
 * once the transport has let go of them (after rank 1 resumes), never while it holds them. */
static int body_held_past_deadline(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    weft_pg_t *pg, *pair;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    int both[] = {0, 1};
    RANK_CHECK(weft_pg_new(a, both, 2, &pair) == WEFT_OK, "new_group"); /* the stalled op's */
    int64_t peer = 0;
    if (signal_rank(pg, 1, 0, (int64_t)getpid(), &peer) != 0) {
        return 1;
    }
    RANK_CHECK(weft_coll_barrier(pg, NULL) == WEFT_OK, "barrier: %s", weft_last_error());
    if (rank == 0) {
        int64_t n = (64 << 20) / 4;
        weft_tensor_t *t;
        weft_tensor_create(WEFT_F32, 1, &n, &t);
        held_probe_t probe = {NULL, -1};
        weft_future_create(&probe.done);
        RANK_CHECK(kill((pid_t)peer, SIGSTOP) == 0, "SIGSTOP");
        weft_pg_set_timeout(pair, 1000);
        weft_future_t *f;
        RANK_CHECK(weft_coll_all_reduce(pair, t, WEFT_SUM, &f) == WEFT_OK, "all_reduce: %s",
                   weft_last_error());
        RANK_CHECK(weft_future_then(f, held_cb, &probe) == WEFT_OK, "then");
        /* Past the deadline (1 s from the call), with rank 1 still stopped: the event is the
         * clock itself; should the operation end in the meantime, probe.held tells. */
        (void)weft_future_wait(f, 3000);
        RANK_CHECK(kill((pid_t)peer, SIGCONT) == 0, "SIGCONT");
        weft_status_t st = weft_future_wait(f, 60000);
        RANK_CHECK(st == WEFT_ERR_TIMEOUT, "stalled all_reduce gave %s: %s", weft_strerror(st),
                   weft_future_error(f));
        RANK_CHECK(weft_future_wait(probe.done, 10000) == WEFT_OK, "callback");
        RANK_CHECK(probe.held == 0,
                   "the operation completed while the transport held %ld of its pieces",
                   probe.held);
        weft_future_release(f);
        weft_future_release(probe.done);
        weft_tensor_release(t);
    }
    RANK_CHECK(weft_coll_barrier(pg, NULL) == WEFT_OK, "barrier after: %s", weft_last_error());
    weft_pg_free(pair);
    weft_pg_free(pg);
    return 0;
}

Test(collectives, completion_waits_for_the_transport, .timeout = 120)
{
    ranks_opts_t o;
    int codes[2];
    setenv("WEFT_COLL_ALGO", "ring", 1); /* the pieces the transport holds are the ring's */
    ranks_opts_init(&o, 2, body_held_past_deadline);
    o.peer_timeout_ms = 60000; /* rank 1 is stopped for a few seconds: not lost */
    o.deadline_ms = 110000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* An operation queued behind a slow one has its deadline from the call: rank 0 issues
 * barrier A (60 s) and barrier B (1 s), and lets rank 1 join A only once B's second has
 * passed. B then fails with WEFT_ERR_TIMEOUT on both ranks (rank 1 joins it at once), and
 * the group stays in step. */
static int body_deadline_from_call(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    weft_status_t st;
    if (rank == 0) {
        weft_future_t *fa, *fb;
        RANK_CHECK(weft_coll_barrier(pg, &fa) == WEFT_OK, "barrier A");
        weft_pg_set_timeout(pg, 1000);
        RANK_CHECK(weft_coll_barrier(pg, &fb) == WEFT_OK, "barrier B");
        int64_t t0 = now_ms(); /* B's deadline is at most t0 + 1 s */
        weft_pg_set_timeout(pg, 60000);
        while (now_ms() - t0 < 1500) {
            /* B's deadline passes while A waits for rank 1: the event is the clock itself
             * (nothing happens at a queued operation's deadline); the wait ends at 1.5 s. */
            usleep(50 * 1000);
        }
        if (signal_rank(pg, 0, 1, 1, NULL) != 0) {
            return 1;
        }
        RANK_CHECK(weft_future_wait(fa, 30000) == WEFT_OK, "A: %s", weft_future_error(fa));
        st = weft_future_wait(fb, 30000);
        RANK_CHECK(st == WEFT_ERR_TIMEOUT, "B gave %s: %s", weft_strerror(st),
                   weft_future_error(fb));
        weft_future_release(fa);
        weft_future_release(fb);
    } else {
        if (signal_rank(pg, 0, 1, 1, NULL) != 0) {
            return 1;
        }
        RANK_CHECK(weft_coll_barrier(pg, NULL) == WEFT_OK, "A: %s", weft_last_error());
        st = weft_coll_barrier(pg, NULL);
        RANK_CHECK(st == WEFT_ERR_TIMEOUT, "B gave %s: %s", weft_strerror(st), weft_last_error());
    }
    RANK_CHECK(weft_coll_barrier(pg, NULL) == WEFT_OK, "after: %s", weft_last_error());
    weft_pg_free(pg);
    return 0;
}

Test(collectives, deadline_counts_from_the_call, .timeout = 120)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_deadline_from_call);
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* An irecv with no matching send fails at the group's deadline, on its own. */
static int body_irecv_deadline(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    if (rank == 0) {
        int64_t n = 3;
        weft_tensor_t *t;
        weft_tensor_create(WEFT_F32, 1, &n, &t);
        weft_pg_set_timeout(pg, 500);
        weft_future_t *from1, *any;
        RANK_CHECK(weft_coll_recv(pg, t, 1, 7, &from1, NULL) == WEFT_OK, "irecv");
        RANK_CHECK(weft_coll_recv(pg, t, WEFT_ANY_SOURCE, 8, &any, NULL) == WEFT_OK, "irecv any");
        weft_pg_set_timeout(pg, 60000);
        weft_status_t st = weft_future_wait(from1, 20000);
        RANK_CHECK(st == WEFT_ERR_TIMEOUT && weft_future_done(from1),
                   "irecv from 1 gave %s (done: %d)", weft_strerror(st), weft_future_done(from1));
        RANK_CHECK(strstr(weft_future_error(from1), "deadline") != NULL, "text: %s",
                   weft_future_error(from1));
        st = weft_future_wait(any, 20000);
        RANK_CHECK(st == WEFT_ERR_TIMEOUT && weft_future_done(any),
                   "irecv from any gave %s (done: %d)", weft_strerror(st), weft_future_done(any));
        weft_future_release(from1);
        weft_future_release(any);
        /* A blocking recv too. */
        weft_pg_set_timeout(pg, 300);
        st = weft_coll_recv(pg, t, 1, 9, NULL, NULL);
        RANK_CHECK(st == WEFT_ERR_TIMEOUT, "recv gave %s", weft_strerror(st));
        weft_pg_set_timeout(pg, 60000);
        weft_tensor_release(t);
    }
    RANK_CHECK(weft_coll_barrier(pg, NULL) == WEFT_OK, "barrier: %s", weft_last_error());
    weft_pg_free(pg);
    return 0;
}

Test(collectives, irecv_fails_at_the_deadline, .timeout = 120)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_irecv_deadline);
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* Receive deadlines are tasks on the agent's timer: a receive that is matched takes its task
 * back at once (none is left queued, and it never fires), one that is not fails by its task.
 * Rank 0 posts A (300 ms) and lets rank 1 send it; then posts B (300 ms, later than A's
 * deadline), which nobody sends: B's failure shows the timer has passed A's deadline too. */
static int body_recv_deadline_tasks(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    int64_t n = 3;
    weft_tensor_t *t;
    weft_tensor_create(WEFT_F32, 1, &n, &t);
    if (rank == 0) {
        long fired = coll__recv_deadlines_fired();
        RANK_CHECK(coll__recv_deadlines_armed() == 0, "%ld tasks queued before any receive",
                   coll__recv_deadlines_armed());
        weft_pg_set_timeout(pg, 300);
        weft_future_t *fa, *fb;
        RANK_CHECK(weft_coll_recv(pg, t, 1, 5, &fa, NULL) == WEFT_OK, "irecv A");
        weft_pg_set_timeout(pg, 60000);
        RANK_CHECK(coll__recv_deadlines_armed() == 1, "A's deadline task is not queued (%ld)",
                   coll__recv_deadlines_armed());
        if (signal_rank(pg, 0, 1, 1, NULL) != 0) {
            return 1;
        }
        RANK_CHECK(weft_future_wait(fa, 10000) == WEFT_OK, "A: %s", weft_future_error(fa));
        RANK_CHECK(coll__recv_deadlines_armed() == 0, "A's deadline task is still queued");
        RANK_CHECK(((float *)weft_tensor_data(t))[2] == 42.0f, "A's data");
        weft_pg_set_timeout(pg, 300);
        RANK_CHECK(weft_coll_recv(pg, t, 1, 6, &fb, NULL) == WEFT_OK, "irecv B");
        weft_pg_set_timeout(pg, 60000);
        weft_status_t st = weft_future_wait(fb, 20000);
        RANK_CHECK(st == WEFT_ERR_TIMEOUT, "B gave %s", weft_strerror(st));
        RANK_CHECK(coll__recv_deadlines_fired() == fired + 1,
                   "%ld receives failed at their deadline, only B should have",
                   coll__recv_deadlines_fired() - fired);
        RANK_CHECK(weft_future_status(fa) == WEFT_OK, "A changed after its deadline");
        RANK_CHECK(coll__recv_deadlines_armed() == 0, "tasks left queued");
        weft_future_release(fa);
        weft_future_release(fb);
    } else {
        if (signal_rank(pg, 0, 1, 1, NULL) != 0) {
            return 1;
        }
        ((float *)weft_tensor_data(t))[2] = 42.0f;
        RANK_CHECK(weft_coll_send(pg, t, 0, 5, NULL) == WEFT_OK, "send A: %s", weft_last_error());
    }
    weft_tensor_release(t);
    RANK_CHECK(weft_coll_barrier(pg, NULL) == WEFT_OK, "barrier: %s", weft_last_error());
    weft_pg_free(pg);
    return 0;
}

Test(collectives, recv_deadlines_are_agent_timer_tasks, .timeout = 120)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_recv_deadline_tasks);
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ------------------------------------------------------------ callbacks on the worker */

typedef struct {
    weft_pg_t *pg;
    weft_tensor_t *t;
    weft_status_t st;
    char why[300];
    weft_future_t *done;
} nested_t;

/* Runs on rank 0's worker, which completed the operation: a blocking call on its group. */
static void nested_cb(weft_future_t *f, void *arg)
{
    nested_t *n = arg;
    (void)f;
    n->st = weft_coll_all_reduce(n->pg, n->t, WEFT_SUM, NULL);
    snprintf(n->why, sizeof(n->why), "%s", n->st == WEFT_OK ? "" : weft_last_error());
    weft_future_complete(n->done, WEFT_OK, NULL, NULL);
}

/* Rank 0 issues A and B asynchronously; A's callback, on the group's worker, makes a blocking
 * all_reduce C. The others issue A, B, C in that order (they are let in only once the
 * callback is set, so that it runs on the worker). Also f16/bf16 AVG over the three ranks,
 * rounded once from the f32 sum. */
static int body_nested(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    weft_pg_set_timeout(pg, 20000);
    float r = (float)(rank + 1);
    weft_tensor_t *ta = scalar_f32(r), *tb = scalar_f32(10 * r), *tc = scalar_f32(100 * r);
    if (rank == 0) {
        nested_t n = {pg, tc, WEFT_ERR_PENDING, "", NULL};
        weft_future_t *fa, *fb;
        weft_future_create(&n.done);
        RANK_CHECK(weft_coll_all_reduce(pg, ta, WEFT_SUM, &fa) == WEFT_OK, "A");
        RANK_CHECK(weft_future_then(fa, nested_cb, &n) == WEFT_OK, "then");
        RANK_CHECK(weft_coll_all_reduce(pg, tb, WEFT_SUM, &fb) == WEFT_OK, "B");
        for (int to = 1; to < world; to++) {
            if (signal_rank(pg, 0, to, 1, NULL) != 0) {
                return 1;
            }
        }
        RANK_CHECK(weft_future_wait(n.done, 60000) == WEFT_OK, "the callback did not finish");
        RANK_CHECK(n.st == WEFT_OK, "nested blocking all_reduce gave %s: %s", weft_strerror(n.st),
                   n.why);
        RANK_CHECK(weft_future_wait(fa, 10000) == WEFT_OK, "A: %s", weft_future_error(fa));
        RANK_CHECK(weft_future_wait(fb, 10000) == WEFT_OK, "B: %s", weft_future_error(fb));
        weft_future_release(fa);
        weft_future_release(fb);
        weft_future_release(n.done);
    } else {
        if (signal_rank(pg, 0, rank, 1, NULL) != 0) {
            return 1;
        }
        RANK_CHECK(weft_coll_all_reduce(pg, ta, WEFT_SUM, NULL) == WEFT_OK, "A");
        RANK_CHECK(weft_coll_all_reduce(pg, tb, WEFT_SUM, NULL) == WEFT_OK, "B");
        RANK_CHECK(weft_coll_all_reduce(pg, tc, WEFT_SUM, NULL) == WEFT_OK, "C");
    }
    float s = (float)(world * (world + 1) / 2);
    RANK_CHECK(*(float *)weft_tensor_data(ta) == s, "A: %f", *(float *)weft_tensor_data(ta));
    RANK_CHECK(*(float *)weft_tensor_data(tb) == 10 * s, "B: %f", *(float *)weft_tensor_data(tb));
    RANK_CHECK(*(float *)weft_tensor_data(tc) == 100 * s, "C: %f", *(float *)weft_tensor_data(tc));
    weft_tensor_release(ta);
    weft_tensor_release(tb);
    weft_tensor_release(tc);

    /* AVG of 2048, 1, 1 in f16: 2050/3 = 683.33 -> 683.5 (a sum rounded in f16 would give
     * 2048/3 -> 682.5); of 256, 1, 1 in bf16: 86 (not 85.5). */
    const weft_dtype_t halves[] = {WEFT_F16, WEFT_BF16};
    for (int d = 0; d < 2; d++) {
        float big = d == 0 ? 2048.0f : 256.0f;
        int64_t two = 2;
        weft_tensor_t *h;
        weft_tensor_create(halves[d], 1, &two, &h);
        for (int i = 0; i < 2; i++) {
            float v = rank == 0 ? big : 1.0f;
            ((uint16_t *)weft_tensor_data(h))[i] =
                d == 0 ? weft_f32_to_f16(v) : weft_f32_to_bf16(v);
        }
        RANK_CHECK(weft_coll_all_reduce(pg, h, WEFT_AVG, NULL) == WEFT_OK, "avg: %s",
                   weft_last_error());
        for (int i = 0; i < 2; i++) {
            uint16_t got = ((uint16_t *)weft_tensor_data(h))[i];
            float f = d == 0 ? weft_f16_to_f32(got) : weft_bf16_to_f32(got);
            RANK_CHECK(f == (d == 0 ? 683.5f : 86.0f), "%s avg %f", weft_dtype_name(halves[d]), f);
        }
        weft_tensor_release(h);
    }
    RANK_CHECK(weft_coll_barrier(pg, NULL) == WEFT_OK, "barrier: %s", weft_last_error());
    weft_pg_free(pg);
    return 0;
}

Test(collectives, blocking_call_from_a_callback_on_the_worker, .timeout = 120)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_nested);
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ------------------------------------------------------------ late pieces */

/* Operations that fail on one rank before the other's pieces of them arrive: rank 1 refuses
 * its call (bxor on f32) while rank 0 sends its part; then two ranks disagree on the count.
 * The late pieces and aborts are dropped, not kept until the agent goes. */
static int body_late_pieces(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    weft_pg_t *pg;
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg_world");
    weft_pg_set_timeout(pg, 20000);
    for (int i = 0; i < 20; i++) {
        int64_t n = i % 2 == 0 ? 64 : 64 + rank; /* odd rounds: a count mismatch */
        weft_tensor_t *t;
        weft_tensor_create(WEFT_F32, 1, &n, &t);
        weft_reduce_op_t op = i % 2 == 0 && rank == 1 ? WEFT_BXOR : WEFT_SUM;
        weft_status_t st = weft_coll_all_reduce(pg, t, op, NULL);
        RANK_CHECK(st == (i % 2 == 0 ? WEFT_ERR_DTYPE : WEFT_ERR_MISMATCH), "round %d gave %s: %s",
                   i, weft_strerror(st), weft_last_error());
        weft_tensor_release(t);
    }
    /* Every piece sent before the barrier's has arrived once the barrier is over (small
     * pieces keep their order on the stream). */
    RANK_CHECK(weft_coll_barrier(pg, NULL) == WEFT_OK, "barrier: %s", weft_last_error());
    size_t left = coll__mailbox_count(pg);
    RANK_CHECK(left == 0, "%zu pieces and aborts of finished operations are still kept", left);
    RANK_CHECK(weft_coll_barrier(pg, NULL) == WEFT_OK, "barrier: %s", weft_last_error());
    weft_pg_free(pg);
    return 0;
}

Test(collectives, late_pieces_of_finished_operations_are_dropped, .timeout = 120)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_late_pieces);
    cr_assert_eq(ranks_run(&o, codes), 0);
}
