/* Open MPI's side of the collectives benchmark (bench/run_collectives.py): the points of
 * coll_common.h with MPI_Allreduce, MPI_Bcast, MPI_Allgather, MPI_Reduce_scatter_block and
 * MPI_Alltoall on MPI_FLOAT (sum, root 0), every rank of MPI_COMM_WORLD. Rank 0 prints the
 * lines of coll_print with "system":"mpi" (or --system NAME, e.g. mpi_tcp under
 * `--mca btl tcp,self`). Built by the runner with mpicc, not by meson:
 *
 *   mpicc -O2 -std=c11 -D_GNU_SOURCE -o BUILDDIR/bench/mpi_collectives bench/mpi_collectives.c
 *   mpirun --allow-run-as-root --oversubscribe -np W mpi_collectives [--quick] [--ops ...] ...
 *
 * Each rank arms alarm(--timeout) so that a stuck run ends. */
#include "coll_common.h"

#include <unistd.h>

#include <mpi.h>

static void mpi_check(int rc, const char *what)
{
    if (rc != MPI_SUCCESS) {
        char text[MPI_MAX_ERROR_STRING];
        int len = 0;
        MPI_Error_string(rc, text, &len);
        fprintf(stderr, "mpi_collectives: %s: %s\n", what, text);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
}

/* @p n zeros (every page written); NULL for n == 0. */
static float *zeros(size_t n)
{
    if (n == 0) {
        return NULL;
    }
    float *p = malloc(n * sizeof(float));
    if (p == NULL) {
        fprintf(stderr, "mpi_collectives: out of memory\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    memset(p, 0, n * sizeof(float));
    return p;
}

static void run_op(coll_op_t op, float *in, float *out, size_t n_in, size_t n_out, int world)
{
    int rc = MPI_SUCCESS;
    switch (op) {
    case COLL_ALL_REDUCE:
        rc = MPI_Allreduce(MPI_IN_PLACE, in, (int)n_in, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
    case COLL_BROADCAST:
        rc = MPI_Bcast(in, (int)n_in, MPI_FLOAT, 0, MPI_COMM_WORLD);
        break;
    case COLL_ALL_GATHER:
        rc = MPI_Allgather(in, (int)n_in, MPI_FLOAT, out, (int)n_in, MPI_FLOAT, MPI_COMM_WORLD);
        break;
    case COLL_REDUCE_SCATTER:
        rc = MPI_Reduce_scatter_block(in, out, (int)n_out, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
    case COLL_ALL_TO_ALL: {
        int part = (int)(n_in / (size_t)world);
        rc = MPI_Alltoall(in, part, MPI_FLOAT, out, part, MPI_FLOAT, MPI_COMM_WORLD);
        break;
    }
    default:
        rc = MPI_ERR_OP;
        break;
    }
    mpi_check(rc, coll_op_names[op]);
}

static double max_over_ranks(double v)
{
    double r = 0.0;
    mpi_check(MPI_Allreduce(&v, &r, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD), "allreduce(max)");
    return r;
}

static void measure_point(const coll_args_t *a, coll_op_t op, size_t bytes, int rank, int world)
{
    size_t n_in = 0;
    size_t n_out = 0;
    coll_counts(op, bytes, world, &n_in, &n_out);
    float *in = zeros(n_in);
    float *out = zeros(n_out);

    size_t warmup = coll_warmup_iters(a, bytes);
    uint64_t t_first = 0;
    uint64_t t0 = bench_now_ns();
    for (size_t i = 0; i < warmup; i++) {
        run_op(op, in, out, n_in, n_out, world);
        if (i == 0) {
            t_first = bench_now_ns();
        }
    }
    uint64_t t1 = bench_now_ns();
    double est =
        warmup > 1 ? (double)(t1 - t_first) / 1e9 / (double)(warmup - 1) : (double)(t1 - t0) / 1e9;
    size_t iters = coll_timed_iters(a, max_over_ranks(est));

    mpi_check(MPI_Barrier(MPI_COMM_WORLD), "barrier");
    t0 = bench_now_ns();
    for (size_t i = 0; i < iters; i++) {
        run_op(op, in, out, n_in, n_out, world);
    }
    t1 = bench_now_ns();
    double per_op = max_over_ranks((double)(t1 - t0) / 1e9 / (double)iters);
    if (rank == 0) {
        coll_print(a->system != NULL ? a->system : "mpi", op, world, bytes, per_op, iters);
    }
    free(out);
    free(in);
}

int main(int argc, char **argv)
{
    coll_args_t a;
    int rank = 0;
    int world = 0;
    MPI_Init(&argc, &argv);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (coll_parse_args(argc, argv, &a) != 0) {
        MPI_Finalize();
        return 2;
    }
    if ((a.world != 0 && a.world != world) || coll_check_world(&a, world) != 0) {
        if (rank == 0) {
            fprintf(stderr, "mpi_collectives: world %d does not fit (asked %d)\n", world, a.world);
        }
        MPI_Finalize();
        return 2;
    }
    alarm((unsigned)(a.timeout_s + 0.5));
    for (int op = 0; op < COLL_OP_COUNT; op++) {
        if ((a.ops & (1u << op)) == 0) {
            continue;
        }
        for (int i = 0; i < a.nsizes; i++) {
            measure_point(&a, (coll_op_t)op, a.sizes[i], rank, world);
        }
    }
    MPI_Finalize();
    return 0;
}
