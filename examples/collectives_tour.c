/*
 * collectives_tour: every collective and point-to-point example of the
 * torch.distributed tutorials weft grew from, on 4 ranks, printing the values
 * the tutorials print, the way torch prints them ("tensor([1., 2., 3.])").
 *
 *   weftrun -n 4 build/examples/collectives_tour
 *
 * docs/collectives-tour.md maps each tutorial example to the lines printed
 * here. Tutorials that ran on GPUs (NCCL) run here on the CPU, so their
 * tensors print without ", device='cuda:N'"; those that drew random numbers or
 * slept random times are made deterministic (each says how in its comment).
 *
 * Every rank runs every step, in the same order: the operations of a group
 * match by order, and sub-groups are numbered by order of creation. A world
 * barrier separates the steps, so that the lines of one come before the
 * next one's.
 *
 * Exit status: 0 on success, 2 when not started with 4 ranks, 1 on any
 * failure (with a message on stderr).
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <weft/weft.h>

#define WORLD_SIZE          4
#define SHUTDOWN_TIMEOUT_MS 30000
#define WORK_TIMEOUT_MS     30000
#define OTHER_WORK_MS       500 /* do_other_work() of the async p2p example */
#define LINE_CAP            1024
#define HELD_MAX            16

typedef struct {
    weft_agent_t *agent;
    weft_pg_t *world;
    weft_pg_t *trio; /* ranks {0, 1, 2}: the three GPUs of seed 002 */
    int rank;
    int size;
} tour_t;

/* ------------------------------------------------------------- printing */

typedef struct {
    char s[LINE_CAP];
    size_t len;
} line_t;

static void line_add(line_t *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Appends to @p l; what does not fit is cut off. */
static void line_add(line_t *l, const char *fmt, ...)
{
    size_t room = sizeof(l->s) - l->len;
    va_list ap;
    int n;

    va_start(ap, fmt);
    n = vsnprintf(l->s + l->len, room, fmt, ap);
    va_end(ap);
    if (n > 0) {
        l->len += (size_t)n < room ? (size_t)n : room - 1;
    }
}

static bool dtype_floating(weft_dtype_t dtype)
{
    return dtype == WEFT_F32 || dtype == WEFT_F64;
}

/* Element @p i of @p t (f32, f64, i32, i64 or u8; the tour prints no other dtype). */
static double element(const weft_tensor_t *t, int64_t i)
{
    const void *p = weft_tensor_data(t);

    switch (weft_tensor_dtype(t)) {
    case WEFT_F32:
        return ((const float *)p)[i];
    case WEFT_F64:
        return ((const double *)p)[i];
    case WEFT_I32:
        return ((const int32_t *)p)[i];
    case WEFT_I64:
        return (double)((const int64_t *)p)[i];
    case WEFT_U8:
        return ((const uint8_t *)p)[i];
    default:
        return NAN;
    }
}

/*
 * How torch's _Formatter prints the elements of one tensor, with the default
 * print options (precision 4): integers as they are; floats that are all whole
 * numbers as "3."; others as "1.5000"; in scientific notation when they span
 * more than 3 decades (or exceed 1e8, or a non-whole one is under 1e-4). Every
 * element is right-aligned to the widest nonzero finite one.
 */
typedef struct {
    bool floating;
    bool int_mode;
    bool sci_mode;
    int width;
} torch_fmt_t;

static int format_element(const torch_fmt_t *f, double v, char *buf, size_t cap)
{
    if (!f->floating) {
        return snprintf(buf, cap, "%.0f", v);
    }
    if (f->sci_mode) {
        return snprintf(buf, cap, "%.4e", v);
    }
    if (f->int_mode) {
        return snprintf(buf, cap, isfinite(v) ? "%.0f." : "%.0f", v);
    }
    return snprintf(buf, cap, "%.4f", v);
}

/* The format of elements [off, off + n) of @p t, printed as one tensor. */
static torch_fmt_t torch_fmt_of(const weft_tensor_t *t, int64_t off, int64_t n)
{
    torch_fmt_t f = {dtype_floating(weft_tensor_dtype(t)), true, false, 1};
    double lo = INFINITY, hi = 0.0;
    bool any = false;
    char buf[64];

    for (int64_t i = off; i < off + n; i++) {
        double v = element(t, i);

        if (!f.floating) {
            int w = format_element(&f, v, buf, sizeof(buf));
            f.width = w > f.width ? w : f.width;
        } else if (isfinite(v) && v != 0.0) {
            any = true;
            lo = fmin(lo, fabs(v));
            hi = fmax(hi, fabs(v));
            f.int_mode = f.int_mode && v == ceil(v);
        }
    }
    if (!any) {
        return f;
    }
    f.sci_mode = hi / lo > 1000.0 || hi > 1.0e8 || (!f.int_mode && lo < 1.0e-4);
    for (int64_t i = off; i < off + n; i++) {
        double v = element(t, i);

        if (isfinite(v) && v != 0.0) {
            int w = format_element(&f, v, buf, sizeof(buf));
            f.width = w > f.width ? w : f.width;
        }
    }
    return f;
}

/* "tensor([1., 2.])" for elements [off, off + n) of @p t, "tensor(1.)" for a scalar. */
static void line_tensor(line_t *l, const weft_tensor_t *t, int64_t off, int64_t n, bool scalar)
{
    torch_fmt_t f = torch_fmt_of(t, off, n);
    char buf[64];

    line_add(l, "%s", scalar ? "tensor(" : "tensor([");
    for (int64_t i = off; i < off + n; i++) {
        format_element(&f, element(t, i), buf, sizeof(buf));
        line_add(l, "%s%*s", i > off ? ", " : "", f.width, buf);
    }
    line_add(l, "%s", scalar ? ")" : "])");
}

/*
 * Prints one line. @p fmt takes %d (int), %s (string), %T (a tensor, printed
 * as torch prints it), %P (a tensor and an int count: the tensor cut into that
 * many equal parts, printed as a Python list of tensors) and %%.
 */
static void say(const char *fmt, ...)
{
    line_t l = {.len = 0};
    va_list ap;

    l.s[0] = '\0';
    va_start(ap, fmt);
    for (const char *p = fmt; *p != '\0'; p++) {
        size_t run = strcspn(p, "%");

        if (run > 0) {
            line_add(&l, "%.*s", (int)run, p);
            p += run - 1;
            continue;
        }
        p++;
        if (*p == 'd') {
            line_add(&l, "%d", va_arg(ap, int));
        } else if (*p == 's') {
            line_add(&l, "%s", va_arg(ap, const char *));
        } else if (*p == 'T') {
            const weft_tensor_t *t = va_arg(ap, const weft_tensor_t *);
            line_tensor(&l, t, 0, weft_tensor_numel(t), weft_tensor_ndim(t) == 0);
        } else if (*p == 'P') {
            const weft_tensor_t *t = va_arg(ap, const weft_tensor_t *);
            int parts = va_arg(ap, int);
            int64_t n = weft_tensor_numel(t) / parts;

            line_add(&l, "%s", "[");
            for (int i = 0; i < parts; i++) {
                line_add(&l, "%s", i > 0 ? ", " : "");
                line_tensor(&l, t, i * n, n, false);
            }
            line_add(&l, "%s", "]");
        } else if (*p == '%') {
            line_add(&l, "%%");
        } else {
            break; /* a stray '%' at the end */
        }
    }
    va_end(ap);
    puts(l.s);
}

/* @p v as Python's repr prints a float: the shortest digits that read back the same, "6.0". */
static const char *py_float(double v, char *buf, size_t cap)
{
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) {
            break;
        }
    }
    if (strpbrk(buf, ".en") == NULL && strlen(buf) + 2 < cap) {
        strcat(buf, ".0");
    }
    return buf;
}

/* The mean of @p t's elements as torch computes it for an f32 tensor (an f32 result). */
static const char *mean_str(const weft_tensor_t *t, char *buf, size_t cap)
{
    double sum = 0.0;

    for (int64_t i = 0; i < weft_tensor_numel(t); i++) {
        sum += element(t, i);
    }
    return py_float((double)(float)(sum / (double)weft_tensor_numel(t)), buf, cap);
}

/* ------------------------------------------------------- tensors, groups */

/* The tensors and sub-groups of one step, freed together when it ends. */
typedef struct {
    weft_tensor_t *t[HELD_MAX];
    int nt;
    weft_pg_t *pg[HELD_MAX];
    int npg;
} held_t;

/* A CPU tensor of @p dtype and @p shape holding @p values (numel elements), or zeros (NULL). */
static weft_status_t held_tensor(held_t *h, weft_dtype_t dtype, int ndim, const int64_t *shape,
                                 const void *values, weft_tensor_t **t_p)
{
    weft_tensor_t *t;
    weft_status_t st;

    if (h->nt == HELD_MAX) {
        fprintf(stderr, "collectives_tour: more than %d tensors in one step\n", HELD_MAX);
        return WEFT_ERR_NO_MEMORY;
    }
    st = weft_tensor_create(dtype, ndim, shape, &t);
    if (st != WEFT_OK) {
        return st;
    }
    if (values != NULL) {
        memcpy(weft_tensor_data(t), values, weft_tensor_nbytes(t));
    }
    h->t[h->nt++] = t;
    *t_p = t;
    return WEFT_OK;
}

/* A 1-D tensor of @p n elements. */
static weft_status_t held_vec(held_t *h, weft_dtype_t dtype, int64_t n, const void *values,
                              weft_tensor_t **t_p)
{
    return held_tensor(h, dtype, 1, &n, values, t_p);
}

/* A copy of @p src. */
static weft_status_t held_clone(held_t *h, const weft_tensor_t *src, weft_tensor_t **t_p)
{
    return held_tensor(h, weft_tensor_dtype(src), weft_tensor_ndim(src), weft_tensor_shape(src),
                       weft_tensor_data(src), t_p);
}

/* A 0-dim view of the one-element tensor @p t: what torch's t[0] prints. */
static weft_status_t held_item(held_t *h, weft_tensor_t *t, weft_tensor_t **t_p)
{
    weft_tensor_t *v;
    weft_status_t st;

    if (h->nt == HELD_MAX) {
        fprintf(stderr, "collectives_tour: more than %d tensors in one step\n", HELD_MAX);
        return WEFT_ERR_NO_MEMORY;
    }
    st = weft_tensor_view(t, 0, NULL, &v);
    if (st != WEFT_OK) {
        return st;
    }
    h->t[h->nt++] = v;
    *t_p = v;
    return WEFT_OK;
}

/* torch's new_group(ranks): every rank calls it, in the same order. */
static weft_status_t held_group(held_t *h, tour_t *tour, const int *ranks, int n, weft_pg_t **pg_p)
{
    weft_pg_t *pg;
    weft_status_t st;

    if (h->npg == HELD_MAX) {
        fprintf(stderr, "collectives_tour: more than %d groups in one step\n", HELD_MAX);
        return WEFT_ERR_NO_MEMORY;
    }
    st = weft_pg_new(tour->agent, ranks, n, &pg);
    if (st != WEFT_OK) {
        return st;
    }
    h->pg[h->npg++] = pg;
    *pg_p = pg;
    return WEFT_OK;
}

/* Frees the groups (each waits for its operations) and then the tensors. */
static void held_release(held_t *h)
{
    while (h->npg > 0) {
        weft_pg_free(h->pg[--h->npg]);
    }
    while (h->nt > 0) {
        weft_tensor_release(h->t[--h->nt]);
    }
}

/*
 * Runs a weft call of a step; on failure prints it and jumps to the step's
 * release_held label.
 */
#define TRY(call)                                                                                  \
    do {                                                                                           \
        weft_status_t st_ = (call);                                                                \
        if (st_ != WEFT_OK) {                                                                      \
            fprintf(stderr, "collectives_tour: %s: %s: %s\n", #call, weft_status_name(st_),        \
                    weft_last_error());                                                            \
            goto release_held;                                                                     \
        }                                                                                          \
    } while (0)

/* Waits for the operation *@p work_p and releases it (NULL afterwards; NULL: nothing to do). */
static weft_status_t work_wait(weft_future_t **work_p)
{
    weft_status_t st;

    if (*work_p == NULL) {
        return WEFT_OK;
    }
    st = weft_future_wait(*work_p, WORK_TIMEOUT_MS);
    if (st != WEFT_OK) {
        fprintf(stderr, "collectives_tour: operation failed: %s: %s\n", weft_status_name(st),
                weft_future_error(*work_p));
    }
    weft_future_release(*work_p);
    *work_p = NULL;
    return st;
}

#define TRY_WAIT(work)                                                                             \
    do {                                                                                           \
        if (work_wait(&(work)) != WEFT_OK) {                                                       \
            goto release_held;                                                                     \
        }                                                                                          \
    } while (0)

static float *f32(const weft_tensor_t *t)
{
    return weft_tensor_data(t);
}

static double now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_ms(int64_t ms)
{
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};

    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* ======================== seed 000: Torch dist practice (gloo, 4 processes) */

/*
 * Task 1 - all gather of strings. The seed copies each string into an int32
 * tensor of a fixed 100 elements; here, as torch's all_gather_object does, the
 * strings travel as u8 tensors padded to the longest one, whose length an
 * all_reduce MAX finds first.
 */
static int task1_all_gather_strings(tour_t *tour)
{
    held_t h = {.nt = 0};
    weft_tensor_t *len, *mine, *all;
    char info[64];
    int64_t n, width;
    int rc = 1;

    n = snprintf(info, sizeof(info), "Process %d Information...", tour->rank);
    TRY(held_vec(&h, WEFT_I64, 1, &n, &len));
    TRY(weft_coll_all_reduce(tour->world, len, WEFT_MAX, NULL));
    width = *(const int64_t *)weft_tensor_data(len);
    TRY(held_vec(&h, WEFT_U8, width, NULL, &mine));
    memcpy(weft_tensor_data(mine), info, (size_t)n);
    TRY(held_vec(&h, WEFT_U8, width * tour->size, NULL, &all));
    TRY(weft_coll_all_gather(tour->world, mine, all, NULL));
    if (tour->rank == 0) {
        const char *text = weft_tensor_data(all);

        for (int r = 0; r < tour->size; r++) {
            const char *s = text + r * width;

            /* decode('utf-8').strip('\x00') */
            printf("%.*s\n", (int)strnlen(s, (size_t)width), s);
        }
    }
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* Task 2 - all reduce (sum) of ones(4): tensor([4., 4., 4., 4.]) everywhere. */
static int task2_all_reduce(tour_t *tour)
{
    held_t h = {.nt = 0};
    weft_tensor_t *t;
    int rc = 1;

    TRY(held_vec(&h, WEFT_F32, 4, (const float[]){1, 1, 1, 1}, &t));
    TRY(weft_coll_all_reduce(tour->world, t, WEFT_SUM, NULL));
    say("All reduce for all processes: in rank %d, tensor = %T", tour->rank, t);
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* Task 3 - all reduce (sum) of ones(4) in the sub-group {1, 3}: tensor([2., 2., 2., 2.]). */
static int task3_sub_group(tour_t *tour)
{
    held_t h = {.nt = 0};
    weft_pg_t *sub;
    weft_tensor_t *t;
    int rc = 1;

    /* Every rank creates the group, members or not, as torch's new_group wants. */
    TRY(held_group(&h, tour, (const int[]){1, 3}, 2, &sub));
    if (weft_pg_rank(sub) >= 0) {
        TRY(held_vec(&h, WEFT_F32, 4, (const float[]){1, 1, 1, 1}, &t));
        TRY(weft_coll_all_reduce(sub, t, WEFT_SUM, NULL));
        say("Sub group all reduce: in rank %d, tensor = %T", tour->rank, t);
    }
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/*
 * Task 4 - all reduce (sum) in each half of the world, then MAX over the world.
 * group_1_sum is int64 (torch.tensor([1, 1, 1, 1])): [2, 2, 2, 2] on ranks 0-1,
 * [1, 1, 1, 1] on 2-3, so the MAX is [2, 2, 2, 2]; group_2_sum (1.5 each) sums
 * to 3 on ranks 2-3, and the MAX gives [3., 3., 3., 3.] everywhere.
 */
static int task4_halves_then_max(tour_t *tour)
{
    int half = tour->size / 2;
    int ranks_1[WORLD_SIZE], ranks_2[WORLD_SIZE];
    held_t h = {.nt = 0};
    weft_pg_t *group_1, *group_2;
    weft_tensor_t *group_1_sum, *group_2_sum;
    int rc = 1;

    TRY(held_vec(&h, WEFT_I64, 4, (const int64_t[]){1, 1, 1, 1}, &group_1_sum));
    TRY(held_vec(&h, WEFT_F32, 4, (const float[]){1.5f, 1.5f, 1.5f, 1.5f}, &group_2_sum));
    for (int i = 0; i < half; i++) {
        ranks_1[i] = i;
        ranks_2[i] = half + i;
    }
    TRY(held_group(&h, tour, ranks_1, half, &group_1));
    TRY(held_group(&h, tour, ranks_2, tour->size - half, &group_2));
    if (weft_pg_rank(group_1) >= 0) {
        TRY(weft_coll_all_reduce(group_1, group_1_sum, WEFT_SUM, NULL));
    } else {
        TRY(weft_coll_all_reduce(group_2, group_2_sum, WEFT_SUM, NULL));
    }
    /* Communicate the sub-group sums to the entire group. */
    TRY(weft_coll_all_reduce(tour->world, group_1_sum, WEFT_MAX, NULL));
    TRY(weft_coll_all_reduce(tour->world, group_2_sum, WEFT_MAX, NULL));
    say("In rank %d, group_1_sum=%T, group_2_sum=%T", tour->rank, group_1_sum, group_2_sum);
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* init_process_p2p: [100., 200.] goes 0 -> 1, gets +100 there, then 1 -> 2. Rank 3 looks on. */
static int p2p_chain(tour_t *tour)
{
    int rank = tour->rank;
    held_t h = {.nt = 0};
    weft_tensor_t *t;
    int rc = 1;

    if (rank == 0) {
        TRY(held_vec(&h, WEFT_F32, 2, (const float[]){100, 200}, &t));
        say("Initial data in rank=%d is: %T", rank, t);
        TRY(weft_coll_send(tour->world, t, 1, 0, NULL));
        say("Rank 0 sent data to Rank 1 ...");
    } else if (rank == 1) {
        TRY(held_vec(&h, WEFT_F32, 2, NULL, &t));
        say("Initial data in rank=%d is: %T", rank, t);
        TRY(weft_coll_recv(tour->world, t, 0, 0, NULL, NULL));
        say("Rank 1 received data from Rank 0 ...");
        f32(t)[0] += 100;
        f32(t)[1] += 100;
        say("Modified data in rank=%d is: %T", rank, t);
        TRY(weft_coll_send(tour->world, t, 2, 0, NULL));
        say("Rank 1 sent data to Rank 2 ...");
    } else if (rank == 2) {
        TRY(held_vec(&h, WEFT_F32, 2, NULL, &t));
        say("Initial data in rank=%d is: %T", rank, t);
        TRY(weft_coll_recv(tour->world, t, 1, 0, NULL, NULL));
        say("Rank 2 received data from Rank 1 ...");
    } else {
        TRY(held_vec(&h, WEFT_F32, 2, NULL, &t));
    }
    TRY(weft_coll_barrier(tour->world, NULL));
    say("Data in rank=%d is: %T", rank, t);
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* The seed sleeps random.uniform(1.0, 3.0) seconds; the tour sleeps a fixed OTHER_WORK_MS. */
static void do_other_work(int rank)
{
    say("Rank %d is doing other work ...", rank);
    sleep_ms(OTHER_WORK_MS);
}

/*
 * init_process_p2p_async: the same chain with isend/irecv (a work future),
 * other work done while the tensor travels, then wait().
 */
static int p2p_async(tour_t *tour)
{
    int rank = tour->rank;
    held_t h = {.nt = 0};
    weft_future_t *req = NULL;
    weft_tensor_t *t;
    int rc = 1;

    if (rank == 0) {
        TRY(held_vec(&h, WEFT_F32, 2, (const float[]){100, 200}, &t));
        say("Initial data in rank=%d is: %T", rank, t);
        TRY(weft_coll_send(tour->world, t, 1, 0, &req));
        say("Rank 0 sending data to Rank 1 ...");
        do_other_work(rank);
        TRY_WAIT(req);
        say("Rank 0 sent data to Rank 1 ...");
    } else if (rank == 1) {
        TRY(held_vec(&h, WEFT_F32, 2, NULL, &t));
        say("Initial data in rank=%d is: %T", rank, t);
        TRY(weft_coll_recv(tour->world, t, 0, 0, &req, NULL));
        say("Rank 1 is receiving data from Rank 0 ...");
        do_other_work(rank);
        TRY_WAIT(req);
        say("Rank 1 received data from Rank 0 ...");
        f32(t)[0] += 100;
        f32(t)[1] += 100;
        say("Modified data in rank=%d is: %T", rank, t);
        TRY(weft_coll_send(tour->world, t, 2, 0, &req));
        say("Rank 1 is sending data to Rank 2 ...");
        do_other_work(rank);
        TRY_WAIT(req);
        say("Rank 1 sent data to Rank 2 ...");
    } else if (rank == 2) {
        TRY(held_vec(&h, WEFT_F32, 2, NULL, &t));
        say("Initial data in rank=%d is: %T", rank, t);
        TRY(weft_coll_recv(tour->world, t, 1, 0, &req, NULL));
        say("Rank 2 is receiving data from Rank 1 ...");
        do_other_work(rank);
        TRY_WAIT(req);
        say("Rank 2 received data from Rank 1 ...");
    } else {
        TRY(held_vec(&h, WEFT_F32, 2, NULL, &t));
    }
    /* No barrier here: the seed comments it out. */
    say("Data in rank=%d is: %T", rank, t);
    rc = 0;
release_held:
    work_wait(&req); /* an operation still in flight must end before its tensor goes */
    held_release(&h);
    return rc;
}

/*
 * init_process_all_reduce_n_all_gather: [10 r, 10 r + 1] gathered into a list,
 * then summed: tensor([60., 64.]). The seed labels every gathered tensor
 * "rank {rank}" (its own rank, 0); the tour labels each with its source rank.
 */
static int all_reduce_n_all_gather(tour_t *tour)
{
    int rank = tour->rank;
    weft_tensor_t *gathered[WORLD_SIZE];
    held_t h = {.nt = 0};
    weft_tensor_t *t, *reduced;
    int rc = 1;

    TRY(held_vec(&h, WEFT_F32, 2, (const float[]){rank * 10.0f, rank * 10.0f + 1}, &t));
    for (int i = 0; i < tour->size; i++) {
        TRY(held_vec(&h, WEFT_F32, 2, NULL, &gathered[i]));
    }
    TRY(weft_coll_all_gather_list(tour->world, t, gathered, NULL));
    if (rank == 0) {
        say("=== all_gather result ===");
        say("Original tensor=%T", t);
        say("Gathered tensor:");
        for (int i = 0; i < tour->size; i++) {
            say("rank %d data = %T", i, gathered[i]);
        }
    }
    TRY(weft_coll_barrier(tour->world, NULL));

    TRY(held_clone(&h, t, &reduced));
    if (rank == 0) {
        say("Before all_reduce: %T", reduced);
    }
    TRY(weft_coll_all_reduce(tour->world, reduced, WEFT_SUM, NULL));
    if (rank == 0) {
        say("=== all_reduce result ===");
        say("%T", reduced);
    }
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/*
 * torch.manual_seed(seed); torch.zeros(1).uniform_(lo, hi) on the CPU, bit for
 * bit: torch's CPU generator is a mt19937 seeded with @p seed, and uniform_ on
 * an f32 tensor takes the low 24 bits of its first 32-bit output as a fraction
 * of 2^24, scaled to [lo, hi) in f32.
 */
static float torch_seeded_uniform(uint32_t seed, float lo, float hi)
{
    uint32_t mt[624];
    uint32_t y, v;

    mt[0] = seed;
    for (uint32_t i = 1; i < 624; i++) {
        mt[i] = 1812433253u * (mt[i - 1] ^ (mt[i - 1] >> 30)) + i;
    }
    /* The first output: state word 0 twisted, then tempered. */
    y = (mt[0] & 0x80000000u) | (mt[1] & 0x7fffffffu);
    v = mt[397] ^ (y >> 1) ^ ((y & 1u) != 0 ? 0x9908b0dfu : 0u);
    v ^= v >> 11;
    v ^= (v << 7) & 0x9d2c5680u;
    v ^= (v << 15) & 0xefc60000u;
    v ^= v >> 18;
    return (float)(v & 0xffffffu) * (1.0f / 16777216.0f) * (hi - lo) + lo;
}

/*
 * init_process_softmax: a softmax over one logit per rank, with an all_reduce
 * MAX for the stable shift and an all_reduce SUM for the denominator. The
 * logits are the ones torch.manual_seed(rank) + uniform_(-10, 10) draws (see
 * torch_seeded_uniform): -0.075, 5.153, 2.294, -9.915.
 */
static int softmax(tour_t *tour)
{
    held_t h = {.nt = 0};
    weft_tensor_t *logit, *max_logit, *prob_sum, *norm_prob_sum;
    char logit_s[32], prob_s[32];
    float prob, norm_prob;
    int rc = 1;

    float x = torch_seeded_uniform((uint32_t)tour->rank, -10.0f, 10.0f);
    TRY(held_vec(&h, WEFT_F32, 1, &x, &logit));
    TRY(held_clone(&h, logit, &max_logit));
    TRY(weft_coll_all_reduce(tour->world, max_logit, WEFT_MAX, NULL));
    prob = expf(x - f32(max_logit)[0]);
    TRY(held_vec(&h, WEFT_F32, 1, &prob, &prob_sum));
    TRY(weft_coll_all_reduce(tour->world, prob_sum, WEFT_SUM, NULL));
    norm_prob = prob / f32(prob_sum)[0];
    snprintf(logit_s, sizeof(logit_s), "%.3f", (double)x);
    snprintf(prob_s, sizeof(prob_s), "%.3f", (double)norm_prob);
    say("In rank=%d, logit=%s, prob=%s", tour->rank, logit_s, prob_s);

    /* The probabilities sum to 1 (the seed's torch.allclose, which it does not print). */
    TRY(held_vec(&h, WEFT_F32, 1, &norm_prob, &norm_prob_sum));
    TRY(weft_coll_all_reduce(tour->world, norm_prob_sum, WEFT_SUM, NULL));
    if (tour->rank == 0) {
        say("torch.allclose(norm_prob_sum, torch.ones(1)): %s",
            fabsf(f32(norm_prob_sum)[0] - 1.0f) <= 1e-5f ? "True" : "False");
    }
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* init_process_broadcast: tensor_1 from rank 0 and tensor_2 from rank 1, to everyone. */
static int broadcast_two_sources(tour_t *tour)
{
    int rank = tour->rank;
    held_t h = {.nt = 0};
    weft_tensor_t *tensor_1, *tensor_2;
    int rc = 1;

    TRY(held_vec(&h, WEFT_F32, 3, rank == 0 ? (const float[]){1, 2, 3} : NULL, &tensor_1));
    TRY(held_vec(&h, WEFT_F32, 2, rank == 1 ? (const float[]){4, 5} : NULL, &tensor_2));
    say("rank=%d", rank);
    TRY(weft_coll_broadcast(tour->world, tensor_1, 0, NULL));
    TRY(weft_coll_broadcast(tour->world, tensor_2, 1, NULL));
    say("rank=%d, tensor_1=%T, tensor_2=%T", rank, tensor_1, tensor_2);
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* init_process_scatter: ones(2) * i from rank 0 to rank i. */
static int scatter_ones(tour_t *tour)
{
    held_t h = {.nt = 0};
    weft_tensor_t *scatter_list = NULL, *output_t;
    int rc = 1;

    TRY(held_vec(&h, WEFT_F32, 2, NULL, &output_t));
    if (tour->rank == 0) {
        TRY(held_vec(&h, WEFT_F32, 2 * tour->size, NULL, &scatter_list));
        for (int i = 0; i < 2 * tour->size; i++) {
            f32(scatter_list)[i] = (float)(i / 2);
        }
    }
    TRY(weft_coll_scatter(tour->world, scatter_list, output_t, 0, NULL));
    say("rank=%d, output_t=%T", tour->rank, output_t);
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* ======================= seed 001: Communication Primitives (nccl, 4 GPUs) */

/* A 2-D f32 tensor of @p rows x 5 filled with @p value: torch.ones((rows, 5)) * value. */
static weft_status_t held_filled(held_t *h, int64_t rows, float value, weft_tensor_t **t_p)
{
    const int64_t shape[2] = {rows, 5};
    weft_status_t st = held_tensor(h, WEFT_F32, 2, shape, NULL, t_p);

    for (int64_t i = 0; st == WEFT_OK && i < rows * 5; i++) {
        f32(*t_p)[i] = value;
    }
    return st;
}

/*
 * The seed's all_reduce, reduce, boardcast, all_gather and reduce_scatter of
 * ones((5, 5)) * rank, on the GPUs there, on the CPU here; it asserts on the
 * means, which the tour prints. reduce leaves the other ranks' tensors as they
 * were (mean = rank), what the seed asserts (and notes that gloo breaks).
 */
static int primitives(tour_t *tour)
{
    int rank = tour->rank;
    held_t h = {.nt = 0};
    weft_tensor_t *t, *gather, *big, *reduce_rst;
    char mean[32];
    int rc = 1;

    TRY(held_filled(&h, 5, (float)rank, &t));
    TRY(weft_coll_all_reduce(tour->world, t, WEFT_SUM, NULL));
    say("all_reduce(%d): t.mean() = %s", rank, mean_str(t, mean, sizeof(mean)));

    TRY(held_filled(&h, 5, (float)rank, &t));
    TRY(weft_coll_reduce(tour->world, t, 0, WEFT_SUM, NULL));
    say("reduce(%d): t.mean() = %s", rank, mean_str(t, mean, sizeof(mean)));

    TRY(held_filled(&h, 5, (float)rank, &t));
    TRY(weft_coll_broadcast(tour->world, t, 3, NULL));
    say("broadcast(%d): t.mean() = %s", rank, mean_str(t, mean, sizeof(mean)));

    /* all_gather into a list, then torch.concat(outputs, dim=0): one [20, 5] tensor. */
    TRY(held_filled(&h, 5, (float)rank, &t));
    TRY(held_filled(&h, 5 * tour->size, 0.0f, &gather));
    TRY(weft_coll_all_gather(tour->world, t, gather, NULL));
    say("all_gather(%d): gather.shape = torch.Size([%d, %d]), gather.mean() = %s", rank,
        (int)weft_tensor_shape(gather)[0], (int)weft_tensor_shape(gather)[1],
        mean_str(gather, mean, sizeof(mean)));

    TRY(held_filled(&h, 5 * tour->size, (float)rank, &big));
    TRY(held_filled(&h, 5, 0.0f, &reduce_rst));
    TRY(weft_coll_reduce_scatter(tour->world, big, reduce_rst, WEFT_SUM, NULL));
    say("reduce_scatter(%d): reduce_rst.mean() = %s", rank,
        mean_str(reduce_rst, mean, sizeof(mean)));
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* ============== seed 002: Parallel Programming (nccl, 3 GPUs: ranks 0-2 here) */

/* [v, v, v, v, v] */
static weft_status_t held_five(held_t *h, float v, weft_tensor_t **t_p)
{
    return held_vec(h, WEFT_F32, 5, (const float[]){v, v, v, v, v}, t_p);
}

/* 7.2 Broadcast: [1., 2., 3., 4., 5.] from rank 0. */
static int trio_broadcast(tour_t *tour)
{
    int me = weft_pg_rank(tour->trio);
    held_t h = {.nt = 0};
    weft_tensor_t *tensor;
    int rc = 1;

    if (me < 0) {
        return 0;
    }
    TRY(held_vec(&h, WEFT_F32, 5, me == 0 ? (const float[]){1, 2, 3, 4, 5} : NULL, &tensor));
    say("Before broadcast on rank %d: %T", me, tensor);
    TRY(weft_coll_broadcast(tour->trio, tensor, 0, NULL));
    say("After broadcast on rank %d: %T", me, tensor);
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* 7.3 Reduce: [rank + 1] * 5 summed into rank 0: [6., ...]; the others keep theirs. */
static int trio_reduce(tour_t *tour)
{
    int me = weft_pg_rank(tour->trio);
    held_t h = {.nt = 0};
    weft_tensor_t *tensor;
    int rc = 1;

    if (me < 0) {
        return 0;
    }
    TRY(held_five(&h, (float)(me + 1), &tensor));
    say("Before reduce on rank %d: %T", me, tensor);
    TRY(weft_coll_reduce(tour->trio, tensor, 0, WEFT_SUM, NULL));
    say("After reduce on rank %d: %T", me, tensor);
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* 7.4 AllReduce: [rank + 1] * 5 summed everywhere: [6., ...]. */
static int trio_all_reduce(tour_t *tour)
{
    int me = weft_pg_rank(tour->trio);
    held_t h = {.nt = 0};
    weft_tensor_t *tensor;
    int rc = 1;

    if (me < 0) {
        return 0;
    }
    TRY(held_five(&h, (float)(me + 1), &tensor));
    say("Before all_reduce on rank %d: %T", me, tensor);
    TRY(weft_coll_all_reduce(tour->trio, tensor, WEFT_SUM, NULL));
    say("After all_reduce on rank %d: %T", me, tensor);
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* 7.5 Gather: [rank + 1] * 5 of every rank into rank 0's gather_list. */
static int trio_gather(tour_t *tour)
{
    int me = weft_pg_rank(tour->trio);
    int n = weft_pg_size(tour->trio);
    held_t h = {.nt = 0};
    weft_tensor_t *tensor, *gather_list = NULL;
    int rc = 1;

    if (me < 0) {
        return 0;
    }
    TRY(held_five(&h, (float)(me + 1), &tensor));
    if (me == 0) {
        TRY(held_vec(&h, WEFT_F32, 5 * n, NULL, &gather_list));
    }
    say("Before gather on rank %d: %T", me, tensor);
    TRY(weft_coll_gather(tour->trio, tensor, gather_list, 0, NULL));
    if (me == 0) {
        say("After gather on rank 0: %P", gather_list, n);
    }
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* 7.6 AllGather: every rank gets [1., ...], [2., ...], [3., ...]. */
static int trio_all_gather(tour_t *tour)
{
    int me = weft_pg_rank(tour->trio);
    int n = weft_pg_size(tour->trio);
    held_t h = {.nt = 0};
    weft_tensor_t *tensor, *gather_list;
    int rc = 1;

    if (me < 0) {
        return 0;
    }
    TRY(held_five(&h, (float)(me + 1), &tensor));
    TRY(held_vec(&h, WEFT_F32, 5 * n, NULL, &gather_list));
    say("Before all_gather on rank %d: %T", me, tensor);
    TRY(weft_coll_all_gather(tour->trio, tensor, gather_list, NULL));
    say("After all_gather on rank %d: %P", me, gather_list, n);
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* 7.7 Scatter: [i + 1] * 5 from rank 0 to rank i. */
static int trio_scatter(tour_t *tour)
{
    int me = weft_pg_rank(tour->trio);
    int n = weft_pg_size(tour->trio);
    held_t h = {.nt = 0};
    weft_tensor_t *scatter_list = NULL, *tensor;
    int rc = 1;

    if (me < 0) {
        return 0;
    }
    if (me == 0) {
        TRY(held_vec(&h, WEFT_F32, 5 * n, NULL, &scatter_list));
        for (int i = 0; i < 5 * n; i++) {
            f32(scatter_list)[i] = (float)(i / 5 + 1);
        }
        say("Rank 0: Tensor to scatter: %P", scatter_list, n);
    }
    TRY(held_vec(&h, WEFT_F32, 5, NULL, &tensor));
    say("Before scatter on rank %d: %T", me, tensor);
    TRY(weft_coll_scatter(tour->trio, scatter_list, tensor, 0, NULL));
    say("After scatter on rank %d: %T", me, tensor);
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/*
 * 7.8 ReduceScatter: rank r holds parts j = 0..2 of [(r + 1), 2 (r + 1)] ** (j + 1);
 * part j summed over the ranks goes to rank j: [6., 12.], [14., 56.], [36., 288.].
 */
static int trio_reduce_scatter(tour_t *tour)
{
    int me = weft_pg_rank(tour->trio);
    int n = weft_pg_size(tour->trio);
    held_t h = {.nt = 0};
    weft_tensor_t *input_tensor, *output_tensor;
    int rc = 1;

    if (me < 0) {
        return 0;
    }
    TRY(held_vec(&h, WEFT_F32, 2 * n, NULL, &input_tensor));
    for (int j = 0; j < n; j++) {
        for (int i = 1; i <= 2; i++) {
            f32(input_tensor)[2 * j + i - 1] = powf((float)((me + 1) * i), (float)(j + 1));
        }
    }
    TRY(held_vec(&h, WEFT_F32, 2, NULL, &output_tensor));
    say("Before ReduceScatter on rank %d: %P", me, input_tensor, n);
    TRY(weft_coll_reduce_scatter(tour->trio, input_tensor, output_tensor, WEFT_SUM, NULL));
    say("After ReduceScatter on rank %d: %T", me, output_tensor);
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* 7.9 Barrier: rank r sleeps r seconds; all leave the barrier after 2 s, with the last. */
static int trio_barrier(tour_t *tour)
{
    int me = weft_pg_rank(tour->trio);
    char delta[32];
    double t_start;

    if (me < 0) {
        return 0;
    }
    t_start = now_s();
    say("Rank %d sleeps %d seconds.", me, me);
    sleep_ms(1000 * (int64_t)me); /* simulate different processing times */
    if (weft_coll_barrier(tour->trio, NULL) != WEFT_OK) {
        fprintf(stderr, "collectives_tour: barrier: %s\n", weft_last_error());
        return 1;
    }
    snprintf(delta, sizeof(delta), "%.4f", now_s() - t_start);
    say("Rank %d after barrier time delta: %s", me, delta);
    return 0;
}

/* ================== seed 003: point-to-point and collectives (gloo, int64) */

/*
 * The ping-pong: rank 0 sends zeros(1) + 1 to rank 1, which adds 1 and sends
 * it back. Ranks 2 and 3 sit it out (the seed runs it with 2 processes). The
 * lines are worded as the seed's output shows them.
 */
static int ping_pong(tour_t *tour)
{
    int rank = tour->rank;
    held_t h = {.nt = 0};
    weft_tensor_t *tensor, *item;
    int rc = 1;

    if (rank > 1) {
        return 0;
    }
    TRY(held_vec(&h, WEFT_F32, 1, NULL, &tensor));
    TRY(held_item(&h, tensor, &item)); /* tensor[0] */
    if (rank == 0) {
        f32(tensor)[0] += 1;
        TRY(weft_coll_send(tour->world, tensor, 1, 0, NULL));
        say("after send, Rank %d has data %T", rank, item);
        TRY(weft_coll_recv(tour->world, tensor, 1, 0, NULL, NULL));
        say("after recv, Rank %d has data %T", rank, item);
    } else {
        TRY(weft_coll_recv(tour->world, tensor, 0, 0, NULL, NULL));
        say("after recv Rank %d has data %T", rank, item);
        f32(tensor)[0] += 1;
        TRY(weft_coll_send(tour->world, tensor, 0, 0, NULL));
        say("after send Rank %d has data %T", rank, item);
    }
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* torch.arange(2, dtype=torch.int64) + 1 + 2 * rank: [1, 2], [3, 4], [5, 6], [7, 8]. */
static weft_status_t held_arange(held_t *h, int rank, weft_tensor_t **t_p)
{
    return held_vec(h, WEFT_I64, 2, (const int64_t[]){1 + 2 * rank, 2 + 2 * rank}, t_p);
}

/* broadcast of rank 0's [1, 2]. */
static int i64_broadcast(tour_t *tour)
{
    held_t h = {.nt = 0};
    weft_tensor_t *tensor;
    int rc = 1;

    TRY(held_arange(&h, tour->rank, &tensor));
    say("before broadcast Rank %d has data %T", tour->rank, tensor);
    TRY(weft_coll_broadcast(tour->world, tensor, 0, NULL));
    say("after broadcast Rank %d has data %T", tour->rank, tensor);
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* scatter of rank 0's [[0, 0], [1, 1], [2, 2], [3, 3]] (the seed prints "scater list"). */
static int i64_scatter(tour_t *tour)
{
    held_t h = {.nt = 0};
    weft_tensor_t *tensor, *scatter_list = NULL;
    int rc = 1;

    TRY(held_arange(&h, tour->rank, &tensor));
    say("before scatter Rank %d has data %T", tour->rank, tensor);
    if (tour->rank == 0) {
        TRY(held_vec(&h, WEFT_I64, 2 * tour->size, NULL, &scatter_list));
        for (int i = 0; i < 2 * tour->size; i++) {
            ((int64_t *)weft_tensor_data(scatter_list))[i] = i / 2;
        }
        say("scatter list: %P", scatter_list, tour->size);
    }
    TRY(weft_coll_scatter(tour->world, scatter_list, tensor, 0, NULL));
    say("after scatter Rank %d has data %T", tour->rank, tensor);
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* gather of every rank's pair into rank 0's gather_list. */
static int i64_gather(tour_t *tour)
{
    held_t h = {.nt = 0};
    weft_tensor_t *tensor, *gather_list = NULL;
    int rc = 1;

    TRY(held_arange(&h, tour->rank, &tensor));
    say("before gather Rank %d has data %T", tour->rank, tensor);
    if (tour->rank == 0) {
        TRY(held_vec(&h, WEFT_I64, 2 * tour->size, NULL, &gather_list));
    }
    TRY(weft_coll_gather(tour->world, tensor, gather_list, 0, NULL));
    say("after gather Rank %d has data %T", tour->rank, tensor);
    if (tour->rank == 0) {
        say("gather_list: %P", gather_list, tour->size);
    }
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/*
 * reduce (sum) to dst 3: [16, 20] on rank 3. The seed's output (gloo) shows
 * partial sums left on ranks 0-2 ([16, 20], [15, 18], [12, 14]), scratch of
 * gloo's algorithm; weft leaves the other ranks' tensors unchanged.
 */
static int i64_reduce(tour_t *tour)
{
    held_t h = {.nt = 0};
    weft_tensor_t *tensor;
    int rc = 1;

    TRY(held_arange(&h, tour->rank, &tensor));
    say("before reduce Rank %d has data %T", tour->rank, tensor);
    TRY(weft_coll_reduce(tour->world, tensor, 3, WEFT_SUM, NULL));
    say("after reduce Rank %d has data %T", tour->rank, tensor);
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* all_gather into a list of 4 (the seed's lines say "gather"; these say "all_gather"). */
static int i64_all_gather(tour_t *tour)
{
    weft_tensor_t *list[WORLD_SIZE];
    held_t h = {.nt = 0};
    weft_tensor_t *tensor, *flat;
    int rc = 1;

    TRY(held_arange(&h, tour->rank, &tensor));
    TRY(held_vec(&h, WEFT_I64, 2 * tour->size, NULL, &flat));
    for (int i = 0; i < tour->size; i++) {
        TRY(held_vec(&h, WEFT_I64, 2, NULL, &list[i]));
    }
    say("before all_gather Rank %d has data %T", tour->rank, tensor);
    TRY(weft_coll_all_gather_list(tour->world, tensor, list, NULL));
    say("after all_gather Rank %d has data %T", tour->rank, tensor);
    /* Print the list as one Python list: copy it side by side into flat. */
    for (int i = 0; i < tour->size; i++) {
        memcpy((int64_t *)weft_tensor_data(flat) + 2 * i, weft_tensor_data(list[i]),
               weft_tensor_nbytes(list[i]));
    }
    say("after all_gather Rank %d has gather list %P", tour->rank, flat, tour->size);
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* all_reduce (sum): [16, 20] everywhere (the seed's lines say "reudce"; these say "all_reduce"). */
static int i64_all_reduce(tour_t *tour)
{
    held_t h = {.nt = 0};
    weft_tensor_t *tensor;
    int rc = 1;

    TRY(held_arange(&h, tour->rank, &tensor));
    say("before all_reduce Rank %d has data %T", tour->rank, tensor);
    TRY(weft_coll_all_reduce(tour->world, tensor, WEFT_SUM, NULL));
    say("after all_reduce Rank %d has data %T", tour->rank, tensor);
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* ========================= seed 004: lecture notes (4 GPUs; CPU here) */

/*
 * tensor([0., 1, 2, 3]) + rank: all-reduce gives [6, 10, 14, 18]; reduce-scatter
 * gives rank r the r-th of those; all-gather of those gives them all back.
 */
static int lecture_collectives(tour_t *tour)
{
    int rank = tour->rank;
    held_t h = {.nt = 0};
    weft_tensor_t *tensor, *reduced, *part, *gathered;
    int rc = 1;

    TRY(held_vec(&h, WEFT_F32, 4,
                 (const float[]){0.0f + rank, 1.0f + rank, 2.0f + rank, 3.0f + rank}, &tensor));
    TRY(held_clone(&h, tensor, &reduced));
    TRY(weft_coll_all_reduce(tour->world, reduced, WEFT_SUM, NULL));
    say("all-reduce: rank %d %T -> %T", rank, tensor, reduced);

    TRY(held_vec(&h, WEFT_F32, 1, NULL, &part));
    TRY(weft_coll_reduce_scatter(tour->world, tensor, part, WEFT_SUM, NULL));
    say("reduce-scatter: rank %d %T -> %T", rank, tensor, part);

    TRY(held_vec(&h, WEFT_F32, 4, NULL, &gathered));
    TRY(weft_coll_all_gather(tour->world, part, gathered, NULL));
    say("all-gather: rank %d %T -> %T", rank, part, gathered);
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/*
 * data_parallelism_main, reduced to its communication: the lecture trains an
 * MLP from random parameters and data and prints losses it does not show.
 * Here: one parameter w = 1, data 1..8 split 2 per rank, loss = mean((w x)^2),
 * so the local gradient is 2 w mean(x^2) (5, 25, 61, 113); all_reduce AVG
 * makes it 51 everywhere, and every rank takes the same SGD step (lr 1e-3).
 */
static int data_parallel(tour_t *tour)
{
    int rank = tour->rank;
    held_t h = {.nt = 0};
    weft_tensor_t *grad, *local, *param;
    float x0 = (float)(2 * rank + 1), x1 = (float)(2 * rank + 2);
    float w = 1.0f;
    int rc = 1;

    float g = 2.0f * w * (x0 * x0 + x1 * x1) / 2.0f;
    TRY(held_vec(&h, WEFT_F32, 1, &g, &local));
    TRY(held_clone(&h, local, &grad));
    TRY(weft_coll_all_reduce(tour->world, grad, WEFT_AVG, NULL));
    w -= 1e-3f * f32(grad)[0];
    TRY(held_vec(&h, WEFT_F32, 1, &w, &param));
    say("[data_parallelism] Rank %d: local grad = %T, averaged grad = %T, params = %T", rank, local,
        grad, param);
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/*
 * tensor_parallelism_main, reduced to its communication: each rank holds 2 of
 * the 8 output columns of a layer and computes its slice of the activations;
 * all_gather puts the whole activation on every rank. Input ones(1, 8), weight
 * W[i][j] = j, and no gelu (the lecture's parameters are random): the slices
 * are [16 r, 16 r + 8], the whole [0, 8, ..., 56].
 */
static int tensor_parallel(tour_t *tour)
{
    int rank = tour->rank;
    int local_num_dim = 2;
    held_t h = {.nt = 0};
    weft_tensor_t *x, *activations;
    int rc = 1;

    TRY(held_vec(&h, WEFT_F32, local_num_dim, NULL, &x));
    for (int j = 0; j < local_num_dim; j++) {
        int col = rank * local_num_dim + j;

        f32(x)[j] = 8.0f * (float)col; /* sum over the 8 inputs of 1 * W[i][col] */
    }
    TRY(held_vec(&h, WEFT_F32, local_num_dim * tour->size, NULL, &activations));
    TRY(weft_coll_all_gather(tour->world, x, activations, NULL));
    say("[tensor_parallelism] Rank %d: local activations %T, all-gathered %T", rank, x,
        activations);
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/*
 * pipeline_parallelism_main, reduced to its communication: rank r owns one
 * layer x -> 2 x; rank 0 cuts the batch [1, 2, 3, 4] into 2 micro-batches and
 * each goes through the ranks with send/recv: [16., 32.] and [48., 64.] out of
 * rank 3.
 */
static int pipeline_parallel(tour_t *tour)
{
    int rank = tour->rank;
    held_t h = {.nt = 0};
    weft_tensor_t *x;
    int rc = 1;

    TRY(held_vec(&h, WEFT_F32, 2, NULL, &x));
    for (int mb = 0; mb < 2; mb++) {
        if (rank == 0) {
            f32(x)[0] = (float)(2 * mb + 1);
            f32(x)[1] = (float)(2 * mb + 2);
        } else {
            TRY(weft_coll_recv(tour->world, x, rank - 1, 0, NULL, NULL));
        }
        f32(x)[0] *= 2.0f;
        f32(x)[1] *= 2.0f;
        if (rank + 1 < tour->size) {
            say("[pipeline_parallelism] Rank %d: sending %T to rank %d", rank, x, rank + 1);
            TRY(weft_coll_send(tour->world, x, rank + 1, 0, NULL));
        } else {
            say("[pipeline_parallelism] Rank %d: micro-batch %d output %T", rank, mb, x);
        }
    }
    rc = 0;
release_held:
    held_release(&h);
    return rc;
}

/* ------------------------------------------------------------------ main */

/*
 * The steps, in order. Rank 0 prints a step's title ("== title ==", opening a
 * seed example) and heading (a line the seed prints first) between two world
 * barriers, after the previous step's lines and before the step's own.
 */
static const struct {
    const char *title;
    const char *heading;
    int (*run)(tour_t *tour);
} steps[] = {
    {"seed 000: init_process (gloo, 4 processes)", "Task 1 - all gather", task1_all_gather_strings},
    {NULL, "Task 2 - all reduce", task2_all_reduce},
    {NULL, "Task 3 - all reduce for sub-group", task3_sub_group},
    /* The seed's heading says "Rank 4"; it is its fourth task. */
    {NULL, "Task 4 - all reduce (sum) in a sub-group, then sync results to the entire group.",
     task4_halves_then_max},
    {"seed 000: init_process_p2p", NULL, p2p_chain},
    {"seed 000: init_process_p2p_async", NULL, p2p_async},
    {"seed 000: init_process_all_reduce_n_all_gather", NULL, all_reduce_n_all_gather},
    {"seed 000: init_process_softmax", NULL, softmax},
    {"seed 000: init_process_broadcast", NULL, broadcast_two_sources},
    {"seed 000: init_process_scatter", NULL, scatter_ones},
    {"seed 001: Communication Primitives (5x5 tensors)", NULL, primitives},
    {"seed 002: 7.2 Broadcast (3 GPUs there: the group of ranks {0, 1, 2} here)", NULL,
     trio_broadcast},
    {"seed 002: 7.3 Reduce", NULL, trio_reduce},
    {"seed 002: 7.4 AllReduce", NULL, trio_all_reduce},
    {"seed 002: 7.5 Gather", NULL, trio_gather},
    {"seed 002: 7.6 AllGather", NULL, trio_all_gather},
    {"seed 002: 7.7 Scatter", NULL, trio_scatter},
    {"seed 002: 7.8 ReduceScatter", NULL, trio_reduce_scatter},
    {"seed 002: 7.9 Barrier", NULL, trio_barrier},
    {"seed 003: ping-pong with send/recv (ranks 0 and 1)", NULL, ping_pong},
    {"seed 003: broadcast", NULL, i64_broadcast},
    {"seed 003: scatter", NULL, i64_scatter},
    {"seed 003: gather", NULL, i64_gather},
    {"seed 003: reduce to dst 3", NULL, i64_reduce},
    {"seed 003: all_gather", NULL, i64_all_gather},
    {"seed 003: all_reduce", NULL, i64_all_reduce},
    {"seed 004: all-reduce, reduce-scatter, all-gather", NULL, lecture_collectives},
    {"seed 004: data parallel", NULL, data_parallel},
    {"seed 004: tensor parallel", NULL, tensor_parallel},
    {"seed 004: pipeline parallel", NULL, pipeline_parallel},
};

/* A world barrier: the lines printed before it come before those printed after it. */
static int step_barrier(tour_t *tour)
{
    weft_status_t st = weft_coll_barrier(tour->world, NULL);

    if (st != WEFT_OK) {
        fprintf(stderr, "collectives_tour: barrier: %s: %s\n", weft_status_name(st),
                weft_last_error());
        return 1;
    }
    return 0;
}

static int run_steps(tour_t *tour)
{
    for (size_t i = 0; i < sizeof(steps) / sizeof(steps[0]); i++) {
        /* The previous step's lines, then the title, then the step's lines. */
        if (step_barrier(tour) != 0) {
            return 1;
        }
        if (steps[i].title != NULL && tour->rank == 0) {
            say("== %s ==", steps[i].title);
        }
        if (steps[i].heading != NULL && tour->rank == 0) {
            say("%s", steps[i].heading);
        }
        if (step_barrier(tour) != 0 || steps[i].run(tour) != 0) {
            return 1;
        }
    }
    return step_barrier(tour);
}

int main(void)
{
    static const int trio_ranks[] = {0, 1, 2};
    weft_agent_opts_t opts;
    tour_t tour = {.agent = NULL};
    weft_status_t st;
    int rc = 1;

    setvbuf(stdout, NULL, _IOLBF, 0);
    weft_agent_opts_init(&opts);
    st = weft_agent_create(&opts, &tour.agent);
    if (st != WEFT_OK) {
        fprintf(stderr, "collectives_tour: cannot start the agent: %s: %s\n", weft_status_name(st),
                weft_last_error());
        return 1;
    }
    if (weft_agent_world_size(tour.agent) != WORLD_SIZE) {
        fprintf(stderr, "collectives_tour: needs %d ranks (weftrun -n %d %s), got %d\n", WORLD_SIZE,
                WORLD_SIZE, "collectives_tour", weft_agent_world_size(tour.agent));
        weft_agent_free(tour.agent);
        return 2;
    }
    st = weft_agent_join(tour.agent);
    if (st != WEFT_OK) {
        fprintf(stderr, "collectives_tour: join: %s: %s\n", weft_status_name(st),
                weft_last_error());
        goto err_free_agent;
    }
    tour.rank = weft_agent_rank(tour.agent);
    tour.size = weft_agent_world_size(tour.agent);
    st = weft_pg_world(tour.agent, &tour.world);
    if (st != WEFT_OK) {
        fprintf(stderr, "collectives_tour: world group: %s\n", weft_last_error());
        goto err_shutdown;
    }
    st = weft_pg_new(tour.agent, trio_ranks, 3, &tour.trio);
    if (st != WEFT_OK) {
        fprintf(stderr, "collectives_tour: group {0, 1, 2}: %s\n", weft_last_error());
        goto err_free_world;
    }

    say("Starting process with rank=%d, world_size=%d", tour.rank, tour.size);
    rc = run_steps(&tour);
    if (rc == 0) {
        say("Finishing process with rank=%d, world_size=%d", tour.rank, tour.size);
    }

    weft_pg_free(tour.trio);
err_free_world:
    weft_pg_free(tour.world);
err_shutdown:
    st = weft_agent_shutdown(tour.agent, SHUTDOWN_TIMEOUT_MS);
    if (st != WEFT_OK) {
        fprintf(stderr, "collectives_tour: shutdown: %s: %s\n", weft_status_name(st),
                weft_last_error());
        rc = 1;
    }
err_free_agent:
    weft_agent_free(tour.agent);
    return rc;
}
