/* CUDA: device and pinned tensors, the device kernels against the CPU kernels, and all_reduce /
 * broadcast of device tensors (staged through pinned memory, and through CUDA IPC) against the
 * CPU collectives. Every test but the first needs a device and skips with a message without
 * one; the first checks what a machine without one gets.
 *
 * CUDA does not survive fork(): the test process never calls CUDA itself. A forked probe tells
 * whether a device is present; single-process checks run in a forked child too, and the ranks of
 * multi-rank checks are forked before any of them touches CUDA. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ranks.h"
#include <weft/collectives.h>
#include <weft/cuda.h>

/* Runs @p fn in a forked child; its exit code (0: pass), or 128 + signal. */
static int in_child(int (*fn)(void *), void *arg)
{
    pid_t pid = fork();
    if (pid == 0) {
        _exit(fn(arg));
    }
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid) {
        return 255;
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static int probe(void *arg)
{
    (void)arg;
    int n = 0;
    weft_status_t st = weft_cuda_device_count(&n);
    if (st != WEFT_OK) {
        fprintf(stderr, "no CUDA device: %s\n", weft_last_error());
        return 0;
    }
    return n > 100 ? 100 : n;
}

/* The number of devices (0: none), asked once. */
static int devices(void)
{
    static int n = -1;
    if (n < 0) {
        n = in_child(probe, NULL);
    }
    return n;
}

#define NEED_DEVICE()                                                                              \
    do {                                                                                           \
        if (devices() == 0) {                                                                      \
            cr_skip_test("skipped: no CUDA device here (the device tests run where one is)");      \
        }                                                                                          \
    } while (0)

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "check failed at %s:%d: %s: ", __FILE__, __LINE__, #cond);             \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

/* ---- without a device ------------------------------------------------------------------------ */

static int absent_or_present(void *arg)
{
    (void)arg;
    int n = -1;
    weft_status_t st = weft_cuda_device_count(&n);
    weft_tensor_t *t = NULL;
    int64_t shape[1] = {4};
    if (st != WEFT_OK) {
        /* A GPU that CUDA cannot use (a driver older than the runtime, say) is a failure
         * here, not a reason for every device test to skip quietly. */
        CHECK(access("/dev/nvidiactl", F_OK) != 0 ||
                  strstr(weft_last_error(), "cudaErrorNoDevice") != NULL,
              "an NVIDIA device node is present but CUDA says: %s", weft_last_error());
        CHECK(st == WEFT_ERR_NO_DEVICE, "count gave %s", weft_status_name(st));
        CHECK(n == 0, "count %d", n);
        CHECK(strstr(weft_last_error(), "cuda") != NULL, "text: %s", weft_last_error());
        st = weft_cuda_init();
        CHECK(st == WEFT_ERR_NO_DEVICE, "init gave %s", weft_status_name(st));
        st = weft_cuda_tensor_empty(WEFT_F32, 1, shape, 0, &t);
        CHECK(st == WEFT_ERR_NO_DEVICE && t == NULL, "tensor_empty gave %s", weft_status_name(st));
        st = weft_cuda_pinned_empty(WEFT_F32, 1, shape, &t);
        CHECK(st == WEFT_ERR_NO_DEVICE && t == NULL, "pinned_empty gave %s", weft_status_name(st));
        return 0;
    }
    CHECK(n >= 1, "count %d", n);
    CHECK(weft_cuda_init() == WEFT_OK, "init: %s", weft_last_error());
    st = weft_cuda_tensor_empty(WEFT_F32, 1, shape, n, &t);
    CHECK(st == WEFT_ERR_NO_DEVICE && t == NULL, "device %d of %d gave %s", n, n,
          weft_status_name(st));
    CHECK(strstr(weft_last_error(), "no device") != NULL, "text: %s", weft_last_error());
    return 0;
}

Test(cuda, a_missing_device_is_a_clear_status, .timeout = 60)
{
    cr_assert_eq(in_child(absent_or_present, NULL), 0);
}

/* ---- data ------------------------------------------------------------------------------------ */

static uint64_t next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* Element i of a seeded sequence in @p dt: floats in [-8, 8) with 1/64 steps (no NaN), integers
 * over their whole range. */
static void fill(void *p, weft_dtype_t dt, size_t n, uint64_t seed)
{
    uint64_t s = seed * 2654435761u + 88172645463325252ull;
    for (size_t i = 0; i < n; i++) {
        uint64_t r = next(&s);
        float f = (float)((int)(r % 1024) - 512) / 64.0f;
        switch (dt) {
        case WEFT_F32:
            ((float *)p)[i] = f;
            break;
        case WEFT_F64:
            ((double *)p)[i] = (double)f / 3.0;
            break;
        case WEFT_F16:
            ((uint16_t *)p)[i] = weft_f32_to_f16(f / 3.0f);
            break;
        case WEFT_BF16:
            ((uint16_t *)p)[i] = weft_f32_to_bf16(f / 3.0f);
            break;
        case WEFT_I8:
        case WEFT_U8:
            ((uint8_t *)p)[i] = (uint8_t)r;
            break;
        case WEFT_I32:
            ((uint32_t *)p)[i] = (uint32_t)r;
            break;
        default:
            ((uint64_t *)p)[i] = r;
            break;
        }
    }
}

static weft_tensor_t *host_filled(weft_dtype_t dt, size_t n, uint64_t seed)
{
    int64_t shape[1] = {(int64_t)n};
    weft_tensor_t *t = NULL;
    if (weft_tensor_empty(dt, 1, shape, &t) != WEFT_OK) {
        return NULL;
    }
    fill(weft_tensor_data(t), dt, n, seed);
    return t;
}

/* A device view of @p base starting @p skip elements in (misaligned loads), @p n long. */
static weft_tensor_t *device_view(weft_tensor_t *base, size_t skip, size_t n)
{
    size_t es = weft_dtype_size(weft_tensor_dtype(base));
    int64_t shape[1] = {(int64_t)n};
    weft_tensor_t *t = NULL;
    if (weft_tensor_wrap(weft_tensor_dtype(base), 1, shape,
                         (unsigned char *)weft_tensor_data(base) + skip * es, n * es,
                         weft_tensor_device(base), NULL, NULL, &t) != WEFT_OK) {
        return NULL;
    }
    return t;
}

static const weft_dtype_t DTYPES[] = {WEFT_F32, WEFT_F64, WEFT_F16, WEFT_BF16,
                                      WEFT_I8,  WEFT_U8,  WEFT_I32, WEFT_I64};
#define NDTYPES 8

/* ---- single process -------------------------------------------------------------------------- */

static int copies(void *arg)
{
    (void)arg;
    int64_t shape[2] = {3, 5};
    weft_tensor_t *h = host_filled(WEFT_F32, 15, 1), *back = NULL, *d = NULL, *p = NULL, *z = NULL;
    CHECK(h != NULL, "host tensor");
    CHECK(weft_cuda_to_device(h, 0, &d) == WEFT_OK, "to_device: %s", weft_last_error());
    CHECK(weft_tensor_device(d).type == WEFT_DEVICE_CUDA && weft_tensor_device(d).index == 0,
          "device of the copy");
    CHECK(weft_cuda_to_host(d, &back) == WEFT_OK, "to_host: %s", weft_last_error());
    CHECK(weft_tensor_device(back).type == WEFT_DEVICE_CPU, "host copy on the CPU");
    CHECK(memcmp(weft_tensor_data(h), weft_tensor_data(back), 15 * 4) == 0, "round trip");
    /* pinned, and another shape of the same count */
    CHECK(weft_cuda_pinned_empty(WEFT_F32, 2, shape, &p) == WEFT_OK, "pinned: %s",
          weft_last_error());
    CHECK(weft_cuda_copy(p, d) == WEFT_OK, "device to pinned: %s", weft_last_error());
    CHECK(memcmp(weft_tensor_data(h), weft_tensor_data(p), 15 * 4) == 0, "pinned copy");
    CHECK(weft_cuda_tensor_zeros(WEFT_F32, 2, shape, 0, &z) == WEFT_OK, "zeros");
    CHECK(weft_cuda_copy(p, z) == WEFT_OK, "zeros to pinned");
    for (int i = 0; i < 15; i++) {
        CHECK(((float *)weft_tensor_data(p))[i] == 0.0f, "zero %d", i);
    }
    /* refusals */
    weft_tensor_t *i32 = host_filled(WEFT_I32, 15, 2), *short_t = host_filled(WEFT_F32, 14, 3);
    CHECK(weft_cuda_copy(d, i32) == WEFT_ERR_DTYPE, "dtype mismatch");
    CHECK(weft_cuda_copy(d, short_t) == WEFT_ERR_SHAPE, "count mismatch");
    CHECK(weft_cuda_to_device(h, devices(), &z) == WEFT_ERR_NO_DEVICE, "device past the count");
    CHECK(weft_cuda_scale(i32, 2.0) == WEFT_ERR_INVALID_ARG, "scale of a CPU tensor");
    weft_tensor_t *hi = NULL;
    CHECK(weft_cuda_to_device(i32, 0, &hi) == WEFT_OK, "i32 to device");
    CHECK(weft_cuda_scale(hi, 2.0) == WEFT_ERR_DTYPE, "scale of integers");
    weft_tensor_release(hi);
    weft_tensor_release(i32);
    weft_tensor_release(short_t);
    weft_tensor_release(h);
    weft_tensor_release(back);
    weft_tensor_release(d);
    weft_tensor_release(p);
    weft_tensor_release(z);
    return 0;
}

Test(cuda, copies_between_host_pinned_and_device, .timeout = 60)
{
    NEED_DEVICE();
    cr_assert_eq(in_child(copies, NULL), 0);
}

/* dst = a (op) b on the device, for every dtype and op, aligned and not, against
 * weft_reduce_to: the same bits. */
static int kernels(void *arg)
{
    (void)arg;
    static const size_t sizes[] = {1, 7, 33, 4099, 100003};
    for (int di = 0; di < NDTYPES; di++) {
        weft_dtype_t dt = DTYPES[di];
        size_t es = weft_dtype_size(dt);
        for (int op = 0; op < WEFT_REDUCE_OP_COUNT; op++) {
            if (weft_reduce_check((weft_reduce_op_t)op, dt) != WEFT_OK) {
                continue;
            }
            for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
                for (size_t skip = 0; skip < 2; skip++) {
                    size_t n = sizes[si];
                    weft_tensor_t *a = host_filled(dt, n + skip, 10 + si);
                    weft_tensor_t *b = host_filled(dt, n + skip, 20 + si);
                    weft_tensor_t *da = NULL, *db = NULL, *out = NULL;
                    CHECK(weft_cuda_to_device(a, 0, &da) == WEFT_OK, "%s", weft_last_error());
                    CHECK(weft_cuda_to_device(b, 0, &db) == WEFT_OK, "%s", weft_last_error());
                    weft_tensor_t *va = device_view(da, skip, n), *vb = device_view(db, skip, n);
                    CHECK(weft_cuda_reduce_into(va, vb, (weft_reduce_op_t)op) == WEFT_OK,
                          "reduce_into %s %s: %s", weft_dtype_name(dt),
                          weft_reduce_op_name((weft_reduce_op_t)op), weft_last_error());
                    CHECK(weft_cuda_to_host(va, &out) == WEFT_OK, "%s", weft_last_error());
                    unsigned char *ha = (unsigned char *)weft_tensor_data(a) + skip * es;
                    unsigned char *hb = (unsigned char *)weft_tensor_data(b) + skip * es;
                    weft_reduce_into(ha, hb, n, dt, (weft_reduce_op_t)op);
                    CHECK(memcmp(ha, weft_tensor_data(out), n * es) == 0,
                          "%s %s n=%zu skip=%zu differs from the CPU", weft_dtype_name(dt),
                          weft_reduce_op_name((weft_reduce_op_t)op), n, skip);
                    weft_tensor_release(out);
                    weft_tensor_release(va);
                    weft_tensor_release(vb);
                    weft_tensor_release(da);
                    weft_tensor_release(db);
                    weft_tensor_release(a);
                    weft_tensor_release(b);
                }
            }
        }
    }
    /* refusals */
    weft_tensor_t *f = host_filled(WEFT_F32, 8, 1), *df = NULL, *dg = NULL;
    CHECK(weft_cuda_to_device(f, 0, &df) == WEFT_OK && weft_cuda_to_device(f, 0, &dg) == WEFT_OK,
          "to device");
    CHECK(weft_cuda_reduce_into(df, dg, WEFT_BXOR) == WEFT_ERR_DTYPE, "bxor on f32");
    CHECK(weft_cuda_reduce_into(df, f, WEFT_SUM) == WEFT_ERR_INVALID_ARG, "a CPU source");
    weft_tensor_release(f);
    weft_tensor_release(df);
    weft_tensor_release(dg);
    return 0;
}

Test(cuda, reduce_kernels_give_the_cpu_kernels_bits, .timeout = 240)
{
    NEED_DEVICE();
    cr_assert_eq(in_child(kernels, NULL), 0);
}

/* The reduction an all_reduce of @p k members computes, on the CPU: f16/bf16 and f32 accumulate
 * in f32 in member order and round once (AVG: the exact quotient). */
static void cpu_reduce_many(void *dst, weft_tensor_t *const *srcs, int k, size_t n, weft_dtype_t dt,
                            weft_reduce_op_t op)
{
    size_t es = weft_dtype_size(dt);
    if (dt == WEFT_F16 || dt == WEFT_BF16) {
        float *acc = malloc(n * 4), *tmp = malloc(n * 4);
        weft_reduce_widen(acc, weft_tensor_data(srcs[0]), n, dt);
        for (int i = 1; i < k; i++) {
            weft_reduce_widen(tmp, weft_tensor_data(srcs[i]), n, dt);
            weft_reduce_into(acc, tmp, n, WEFT_F32, op);
        }
        weft_reduce_narrow(dst, acc, n, dt, op, k);
        free(acc);
        free(tmp);
        return;
    }
    memcpy(dst, weft_tensor_data(srcs[0]), n * es);
    for (int i = 1; i < k; i++) {
        weft_reduce_into(dst, weft_tensor_data(srcs[i]), n, dt, op);
    }
    weft_reduce_finish(dst, n, dt, op, k);
}

static int many(void *arg)
{
    (void)arg;
    static const weft_dtype_t dts[] = {WEFT_F32, WEFT_F64, WEFT_F16, WEFT_BF16, WEFT_I32, WEFT_I8};
    static const weft_reduce_op_t ops[] = {WEFT_SUM, WEFT_AVG, WEFT_MAX, WEFT_PRODUCT};
    size_t n = 5003;
    for (size_t di = 0; di < sizeof(dts) / sizeof(dts[0]); di++) {
        for (size_t oi = 0; oi < sizeof(ops) / sizeof(ops[0]); oi++) {
            for (int k = 1; k <= 5; k += 2) {
                weft_dtype_t dt = dts[di];
                weft_tensor_t *h[5], *d[5], *out = NULL;
                for (int i = 0; i < k; i++) {
                    h[i] = host_filled(dt, n, 100 + (uint64_t)i);
                    CHECK(weft_cuda_to_device(h[i], 0, &d[i]) == WEFT_OK, "%s", weft_last_error());
                }
                /* into the first source: in place, as the IPC all_reduce does */
                CHECK(weft_cuda_reduce_many(d[0], d, k, ops[oi]) == WEFT_OK, "%s %s k=%d: %s",
                      weft_dtype_name(dt), weft_reduce_op_name(ops[oi]), k, weft_last_error());
                CHECK(weft_cuda_to_host(d[0], &out) == WEFT_OK, "%s", weft_last_error());
                void *want = malloc(n * weft_dtype_size(dt));
                cpu_reduce_many(want, h, k, n, dt, ops[oi]);
                CHECK(memcmp(want, weft_tensor_data(out), n * weft_dtype_size(dt)) == 0,
                      "%s %s k=%d differs from the CPU", weft_dtype_name(dt),
                      weft_reduce_op_name(ops[oi]), k);
                free(want);
                weft_tensor_release(out);
                for (int i = 0; i < k; i++) {
                    weft_tensor_release(h[i]);
                    weft_tensor_release(d[i]);
                }
            }
        }
    }
    return 0;
}

Test(cuda, reduce_many_rounds_once_as_the_collectives_do, .timeout = 240)
{
    NEED_DEVICE();
    cr_assert_eq(in_child(many, NULL), 0);
}

static int buckets(void *arg)
{
    (void)arg;
    int64_t n3 = 3, n1000 = 1000, n17 = 17, nall = 1020;
    weft_tensor_t *h[3] = {host_filled(WEFT_F32, 3, 1), host_filled(WEFT_F32, 1000, 2),
                           host_filled(WEFT_F32, 17, 3)};
    weft_tensor_t *d[3], *flat = NULL, *back = NULL;
    (void)n3;
    (void)n1000;
    (void)n17;
    for (int i = 0; i < 3; i++) {
        CHECK(weft_cuda_to_device(h[i], 0, &d[i]) == WEFT_OK, "%s", weft_last_error());
    }
    CHECK(weft_cuda_tensor_zeros(WEFT_F32, 1, &nall, 0, &flat) == WEFT_OK, "flat");
    CHECK(weft_cuda_flatten(flat, d, 3) == WEFT_OK, "flatten: %s", weft_last_error());
    CHECK(weft_cuda_scale(flat, 0.5) == WEFT_OK, "scale: %s", weft_last_error());
    CHECK(weft_cuda_to_host(flat, &back) == WEFT_OK, "to host");
    const float *b = weft_tensor_data(back);
    size_t off = 0;
    for (int i = 0; i < 3; i++) {
        const float *src = weft_tensor_data(h[i]);
        for (int64_t j = 0; j < weft_tensor_numel(h[i]); j++) {
            CHECK(b[off + (size_t)j] == src[j] * 0.5f, "element %d.%lld", i, (long long)j);
        }
        off += (size_t)weft_tensor_numel(h[i]);
    }
    /* and back into the parts */
    for (int i = 0; i < 3; i++) {
        CHECK(weft_cuda_scale(d[i], 0.0) == WEFT_OK, "clear");
    }
    CHECK(weft_cuda_unflatten(d, 3, flat) == WEFT_OK, "unflatten: %s", weft_last_error());
    for (int i = 0; i < 3; i++) {
        weft_tensor_t *part = NULL;
        CHECK(weft_cuda_to_host(d[i], &part) == WEFT_OK, "to host");
        const float *p = weft_tensor_data(part), *src = weft_tensor_data(h[i]);
        for (int64_t j = 0; j < weft_tensor_numel(h[i]); j++) {
            CHECK(p[j] == src[j] * 0.5f, "part %d element %lld", i, (long long)j);
        }
        weft_tensor_release(part);
    }
    /* a count that does not add up */
    CHECK(weft_cuda_flatten(flat, d, 2) == WEFT_ERR_SHAPE, "short list");
    for (int i = 0; i < 3; i++) {
        weft_tensor_release(h[i]);
        weft_tensor_release(d[i]);
    }
    weft_tensor_release(flat);
    weft_tensor_release(back);
    return 0;
}

Test(cuda, flatten_scale_unflatten_a_bucket, .timeout = 60)
{
    NEED_DEVICE();
    cr_assert_eq(in_child(buckets, NULL), 0);
}

/* ---- collectives of device tensors ----------------------------------------------------------- */

typedef struct {
    bool ipc; /* expect the IPC path (else the staged one) */
} coll_case_t;

/* Every rank's input of a case: seeded by rank, so each rank can compute the others'. */
static weft_tensor_t *input_of(int rank, weft_dtype_t dt, size_t n)
{
    return host_filled(dt, n, 1000 + (uint64_t)rank * 7 + n);
}

static int device_collectives_body(weft_agent_t *a, int rank, int world, void *arg)
{
    const coll_case_t *c = arg;
    weft_pg_t *pg = NULL;
    int ndev = 0;
    RANK_CHECK(weft_cuda_device_count(&ndev) == WEFT_OK, "%s", weft_last_error());
    /* IPC: every rank on device 0 (two devices need peer access, which a host may not give);
     * staged: spread over the devices */
    int dev = c->ipc ? 0 : rank % ndev;
    RANK_CHECK(weft_cuda_init() == WEFT_OK, "init: %s", weft_last_error());
    RANK_CHECK(weft_pg_world(a, &pg) == WEFT_OK, "pg: %s", weft_last_error());
    static const weft_dtype_t dts[] = {WEFT_F32, WEFT_F16, WEFT_BF16, WEFT_I64, WEFT_F64};
    static const weft_reduce_op_t ops[] = {WEFT_SUM, WEFT_AVG, WEFT_MAX, WEFT_SUM, WEFT_AVG};
    /* the last: 1.2 MB of f32 (2.4 MB of f64, 600 KB of f16), five chunks when staged from
     * 1 MiB (WEFT_CUDA_CHUNKS=5), one below */
    static const size_t sizes[] = {1, 1000, 300003};
    weft_cuda_stats_t before, after;
    weft_cuda_stats(&before);
    for (size_t di = 0; di < sizeof(dts) / sizeof(dts[0]); di++) {
        for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
            weft_dtype_t dt = dts[di];
            weft_reduce_op_t op = ops[di];
            size_t n = sizes[si], es = weft_dtype_size(dt);
            weft_tensor_t *mine = input_of(rank, dt, n), *d = NULL, *out = NULL;
            RANK_CHECK(weft_cuda_to_device(mine, dev, &d) == WEFT_OK, "%s", weft_last_error());
            bool async = si == 1;
            if (async) {
                weft_future_t *f = NULL;
                RANK_CHECK(weft_coll_all_reduce(pg, d, op, &f) == WEFT_OK, "%s", weft_last_error());
                RANK_CHECK(weft_future_wait(f, -1) == WEFT_OK, "async all_reduce %s: %s",
                           weft_dtype_name(dt), weft_future_error(f));
                weft_future_release(f);
            } else {
                RANK_CHECK(weft_coll_all_reduce(pg, d, op, NULL) == WEFT_OK,
                           "all_reduce %s n=%zu: %s", weft_dtype_name(dt), n, weft_last_error());
            }
            RANK_CHECK(weft_cuda_to_host(d, &out) == WEFT_OK, "%s", weft_last_error());
            void *want = malloc(n * es);
            if (c->ipc) {
                /* member order on the device: computed here from every rank's input */
                weft_tensor_t *ins[8];
                for (int r = 0; r < world; r++) {
                    ins[r] = input_of(r, dt, n);
                }
                cpu_reduce_many(want, ins, world, n, dt, op);
                for (int r = 0; r < world; r++) {
                    weft_tensor_release(ins[r]);
                }
            } else {
                /* staged: the CPU collective on the same data in the same chunks (five
                 * 16-byte aligned parts from 1 MiB, cuda/coll.c), the same bits */
                size_t parts = n * es >= (1u << 20) ? 5 : 1, align = 16 / es;
                size_t chunk = (n + parts - 1) / parts;
                chunk = (chunk + align - 1) / align * align;
                for (size_t off = 0; off < n; off += chunk) {
                    int64_t len = (int64_t)(n - off < chunk ? n - off : chunk);
                    weft_tensor_t *part = NULL;
                    RANK_CHECK(weft_tensor_wrap(
                                   dt, 1, &len, (unsigned char *)weft_tensor_data(mine) + off * es,
                                   (size_t)len * es, WEFT_CPU, NULL, NULL, &part) == WEFT_OK,
                               "%s", weft_last_error());
                    RANK_CHECK(weft_coll_all_reduce(pg, part, op, NULL) == WEFT_OK, "%s",
                               weft_last_error());
                    weft_tensor_release(part);
                }
                memcpy(want, weft_tensor_data(mine), n * es);
            }
            RANK_CHECK(memcmp(want, weft_tensor_data(out), n * es) == 0,
                       "all_reduce %s %s n=%zu: not the expected bits", weft_dtype_name(dt),
                       weft_reduce_op_name(op), n);
            free(want);
            weft_tensor_release(out);
            weft_tensor_release(d);
            weft_tensor_release(mine);
        }
    }
    /* broadcast from the last rank */
    size_t n = 300003;
    weft_tensor_t *mine = input_of(rank, WEFT_F32, n), *root_in = input_of(world - 1, WEFT_F32, n);
    weft_tensor_t *d = NULL, *out = NULL;
    RANK_CHECK(weft_cuda_to_device(mine, dev, &d) == WEFT_OK, "%s", weft_last_error());
    RANK_CHECK(weft_coll_broadcast(pg, d, world - 1, NULL) == WEFT_OK, "broadcast: %s",
               weft_last_error());
    RANK_CHECK(weft_cuda_to_host(d, &out) == WEFT_OK, "%s", weft_last_error());
    RANK_CHECK(memcmp(weft_tensor_data(root_in), weft_tensor_data(out), n * 4) == 0,
               "broadcast: not the root's tensor");
    /* a collective that does not take device tensors */
    int64_t nall = (int64_t)n * world;
    weft_tensor_t *gathered = NULL;
    RANK_CHECK(weft_cuda_tensor_empty(WEFT_F32, 1, &nall, dev, &gathered) == WEFT_OK, "%s",
               weft_last_error());
    weft_status_t st = weft_coll_all_gather(pg, d, gathered, NULL);
    RANK_CHECK(st == WEFT_ERR_UNSUPPORTED, "all_gather of device tensors gave %s",
               weft_status_name(st));
    /* members that call with different sizes all fail with MISMATCH, and the group goes on */
    size_t mism = rank == 0 ? 100 : 101;
    weft_tensor_t *hm = input_of(rank, WEFT_F32, mism), *dm = NULL;
    RANK_CHECK(weft_cuda_to_device(hm, dev, &dm) == WEFT_OK, "%s", weft_last_error());
    st = weft_coll_all_reduce(pg, dm, WEFT_SUM, NULL);
    RANK_CHECK(st == WEFT_ERR_MISMATCH, "all_reduce of 100 and 101 elements gave %s: %s",
               weft_status_name(st), weft_last_error());
    RANK_CHECK(weft_coll_all_reduce(pg, d, WEFT_MAX, NULL) == WEFT_OK, "after the mismatch: %s",
               weft_last_error());
    weft_tensor_release(hm);
    weft_tensor_release(dm);
    weft_cuda_stats(&after);
    if (c->ipc) {
        RANK_CHECK(after.ipc_ops > before.ipc_ops, "no operation took the IPC path");
    } else {
        RANK_CHECK(after.ipc_ops == before.ipc_ops, "an operation took the IPC path");
        RANK_CHECK(after.staged_chunks - before.staged_chunks >= 5, "%llu chunks",
                   (unsigned long long)(after.staged_chunks - before.staged_chunks));
    }
    weft_tensor_release(gathered);
    weft_tensor_release(mine);
    weft_tensor_release(root_in);
    weft_tensor_release(d);
    weft_tensor_release(out);
    weft_pg_free(pg);
    return 0;
}

static void run_world(int world, bool ipc)
{
    coll_case_t c = {ipc};
    ranks_opts_t o;
    ranks_opts_init(&o, world, device_collectives_body);
    o.arg = &c;
    o.deadline_ms = 200000;
    for (int r = 0; r < world; r++) {
        o.rank_env[r] = ipc ? "WEFT_CUDA_IPC_MIN_KB=0" : "WEFT_CUDA_IPC=0";
    }
    /* one setting per rank: the chunk size goes through the environment of the whole run */
    setenv("WEFT_CUDA_CHUNKS", "5", 1);
    int codes[8];
    cr_assert_eq(ranks_run(&o, codes), 0, "a rank failed (codes %d %d %d)", codes[0], codes[1],
                 world > 2 ? codes[2] : 0);
}

Test(cuda, staged_all_reduce_and_broadcast_of_device_tensors, .timeout = 300)
{
    NEED_DEVICE();
    run_world(2, false);
    run_world(3, false);
}

Test(cuda, ipc_all_reduce_and_broadcast_of_device_tensors, .timeout = 300)
{
    NEED_DEVICE();
    run_world(2, true);
    run_world(3, true);
}
