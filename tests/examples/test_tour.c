/*
 * examples/collectives_tour run under weftrun on 4 ranks, as a user would:
 * WEFTRUN is the launcher, TOUR the example. The run has a 120 s deadline,
 * after which it is killed and the test fails. The expected lines are the
 * values the torch.distributed tutorials of /work/shared/seeds print
 * (docs/collectives-tour.md maps them).
 */

#include <criterion/criterion.h>

#include "example.h"

#include <stdio.h>
#include <string.h>

/* Runs `weftrun -n NPROC collectives_tour`, with a 120 s deadline. */
static void run_tour(result_t *r, const char *nproc)
{
    const example_t ex = {.ranks = nproc, .prog_env = "TOUR", .deadline_s = 120.0};

    example_run(r, &ex, NULL);
}

static void check_seed_000_collectives(const result_t *r)
{
    static const char *const want[] = {
        /* Task 1 - all gather of strings */
        "[rank 0] Task 1 - all gather",
        "[rank 0] Process 0 Information...",
        "[rank 0] Process 1 Information...",
        "[rank 0] Process 2 Information...",
        "[rank 0] Process 3 Information...",
        /* Task 2 - all reduce */
        "[rank 0] All reduce for all processes: in rank 0, tensor = tensor([4., 4., 4., 4.])",
        "[rank 3] All reduce for all processes: in rank 3, tensor = tensor([4., 4., 4., 4.])",
        /* Task 3 - the sub-group {1, 3} */
        "[rank 1] Sub group all reduce: in rank 1, tensor = tensor([2., 2., 2., 2.])",
        "[rank 3] Sub group all reduce: in rank 3, tensor = tensor([2., 2., 2., 2.])",
        /* Task 4 - two half-world groups, then MAX across the world */
        "[rank 0] In rank 0, group_1_sum=tensor([2, 2, 2, 2]), group_2_sum=tensor([3., 3., 3., "
        "3.])",
        "[rank 1] In rank 1, group_1_sum=tensor([2, 2, 2, 2]), group_2_sum=tensor([3., 3., 3., "
        "3.])",
        "[rank 2] In rank 2, group_1_sum=tensor([2, 2, 2, 2]), group_2_sum=tensor([3., 3., 3., "
        "3.])",
        "[rank 3] In rank 3, group_1_sum=tensor([2, 2, 2, 2]), group_2_sum=tensor([3., 3., 3., "
        "3.])",
        /* all_reduce & all_gather */
        "[rank 0] Original tensor=tensor([0., 1.])",
        "[rank 0] rank 1 data = tensor([10., 11.])",
        "[rank 0] rank 3 data = tensor([30., 31.])",
        "[rank 0] tensor([60., 64.])",
        /* the distributed softmax (torch.manual_seed(rank) logits) */
        "[rank 0] In rank=0, logit=-0.075, prob=0.005",
        "[rank 1] In rank=1, logit=5.153, prob=0.941",
        "[rank 2] In rank=2, logit=2.294, prob=0.054",
        "[rank 3] In rank=3, logit=-9.915, prob=0.000",
        "[rank 0] torch.allclose(norm_prob_sum, torch.ones(1)): True",
        /* broadcast from two sources */
        "[rank 0] rank=0, tensor_1=tensor([1., 2., 3.]), tensor_2=tensor([4., 5.])",
        "[rank 3] rank=3, tensor_1=tensor([1., 2., 3.]), tensor_2=tensor([4., 5.])",
        /* scatter: the seed's printed output */
        "[rank 0] rank=0, output_t=tensor([0., 0.])",
        "[rank 1] rank=1, output_t=tensor([1., 1.])",
        "[rank 2] rank=2, output_t=tensor([2., 2.])",
        "[rank 3] rank=3, output_t=tensor([3., 3.])",
        "[rank 0] Finishing process with rank=0, world_size=4",
        "[rank 3] Finishing process with rank=3, world_size=4",
        NULL,
    };

    example_assert_lines(r, want);
}

static void check_seed_000_p2p(const result_t *r)
{
    static const char *const want[] = {
        /* the chain 0 -> 1 -> 2 with +100, blocking and overlapped */
        "[rank 0] Initial data in rank=0 is: tensor([100., 200.])",
        "[rank 0] Rank 0 sent data to Rank 1 ...",
        "[rank 1] Initial data in rank=1 is: tensor([0., 0.])",
        "[rank 1] Rank 1 received data from Rank 0 ...",
        "[rank 1] Modified data in rank=1 is: tensor([200., 300.])",
        "[rank 1] Rank 1 sent data to Rank 2 ...",
        "[rank 2] Rank 2 received data from Rank 1 ...",
        "[rank 0] Data in rank=0 is: tensor([100., 200.])",
        "[rank 1] Data in rank=1 is: tensor([200., 300.])",
        "[rank 2] Data in rank=2 is: tensor([200., 300.])",
        "[rank 3] Data in rank=3 is: tensor([0., 0.])",
        "[rank 0] Rank 0 sending data to Rank 1 ...",
        "[rank 0] Rank 0 is doing other work ...",
        "[rank 1] Rank 1 is receiving data from Rank 0 ...",
        "[rank 1] Rank 1 is sending data to Rank 2 ...",
        "[rank 1] Rank 1 is doing other work ...",
        "[rank 2] Rank 2 is receiving data from Rank 1 ...",
        "[rank 2] Rank 2 is doing other work ...",
        NULL,
    };

    example_assert_lines(r, want);
}

static void check_seed_001_primitives(const result_t *r)
{
    static const char *const want[] = {
        "[rank 0] all_reduce(0): t.mean() = 6.0",
        "[rank 3] all_reduce(3): t.mean() = 6.0",
        "[rank 0] reduce(0): t.mean() = 6.0",
        "[rank 1] reduce(1): t.mean() = 1.0",
        "[rank 2] reduce(2): t.mean() = 2.0",
        "[rank 3] reduce(3): t.mean() = 3.0",
        "[rank 0] broadcast(0): t.mean() = 3.0",
        "[rank 2] all_gather(2): gather.shape = torch.Size([20, 5]), gather.mean() = 1.5",
        "[rank 1] reduce_scatter(1): reduce_rst.mean() = 6.0",
        NULL,
    };

    example_assert_lines(r, want);
}

static void check_seed_002_three_ranks(const result_t *r)
{
    static const char *const want[] = {
        "[rank 0] Before broadcast on rank 0: tensor([1., 2., 3., 4., 5.])",
        "[rank 1] Before broadcast on rank 1: tensor([0., 0., 0., 0., 0.])",
        "[rank 2] After broadcast on rank 2: tensor([1., 2., 3., 4., 5.])",
        "[rank 0] After reduce on rank 0: tensor([6., 6., 6., 6., 6.])",
        "[rank 1] After reduce on rank 1: tensor([2., 2., 2., 2., 2.])",
        "[rank 2] After reduce on rank 2: tensor([3., 3., 3., 3., 3.])",
        "[rank 1] After all_reduce on rank 1: tensor([6., 6., 6., 6., 6.])",
        "[rank 0] After gather on rank 0: [tensor([1., 1., 1., 1., 1.]), "
        "tensor([2., 2., 2., 2., 2.]), tensor([3., 3., 3., 3., 3.])]",
        "[rank 2] After all_gather on rank 2: [tensor([1., 1., 1., 1., 1.]), "
        "tensor([2., 2., 2., 2., 2.]), tensor([3., 3., 3., 3., 3.])]",
        "[rank 0] Rank 0: Tensor to scatter: [tensor([1., 1., 1., 1., 1.]), "
        "tensor([2., 2., 2., 2., 2.]), tensor([3., 3., 3., 3., 3.])]",
        "[rank 1] After scatter on rank 1: tensor([2., 2., 2., 2., 2.])",
        "[rank 2] After scatter on rank 2: tensor([3., 3., 3., 3., 3.])",
        "[rank 1] Before ReduceScatter on rank 1: [tensor([2., 4.]), tensor([ 4., 16.]), "
        "tensor([ 8., 64.])]",
        "[rank 2] Before ReduceScatter on rank 2: [tensor([3., 6.]), tensor([ 9., 36.]), "
        "tensor([ 27., 216.])]",
        "[rank 0] After ReduceScatter on rank 0: tensor([ 6., 12.])",
        "[rank 1] After ReduceScatter on rank 1: tensor([14., 56.])",
        "[rank 2] After ReduceScatter on rank 2: tensor([ 36., 288.])",
        "[rank 2] Rank 2 sleeps 2 seconds.",
        NULL,
    };

    example_assert_lines(r, want);
    /* The barrier after sleeps of 0, 1 and 2 s: everyone leaves it after about 2 s. */
    for (int rank = 0; rank < 3; rank++) {
        char want_prefix[64];
        const char *line;
        double delta = 0.0;

        snprintf(want_prefix, sizeof(want_prefix),
                 "[rank %d] Rank %d after barrier time delta: ", rank, rank);
        line = find_line(r->out, want_prefix, true);
        cr_assert(line != NULL, "missing line starting with: %s\nstdout:\n%s", want_prefix, r->out);
        cr_assert(sscanf(line + strlen(want_prefix), "%lf", &delta) == 1, "%.200s", line);
        cr_assert(delta >= 1.99 && delta < 10.0, "rank %d left the barrier after %.4f s", rank,
                  delta);
    }
    cr_assert(find_line(r->out, "[rank 3] Rank 3 sleeps", true) == NULL,
              "rank 3 is not in the 3-rank group");
}

static void check_seed_003_int64(const result_t *r)
{
    static const char *const want[] = {
        /* the ping-pong */
        "[rank 0] after send, Rank 0 has data tensor(1.)",
        "[rank 1] after recv Rank 1 has data tensor(1.)",
        "[rank 1] after send Rank 1 has data tensor(2.)",
        "[rank 0] after recv, Rank 0 has data tensor(2.)",
        /* broadcast */
        "[rank 1] before broadcast Rank 1 has data tensor([3, 4])",
        "[rank 3] before broadcast Rank 3 has data tensor([7, 8])",
        "[rank 3] after broadcast Rank 3 has data tensor([1, 2])",
        /* scatter */
        "[rank 0] scatter list: [tensor([0, 0]), tensor([1, 1]), tensor([2, 2]), tensor([3, 3])]",
        "[rank 0] after scatter Rank 0 has data tensor([0, 0])",
        "[rank 1] after scatter Rank 1 has data tensor([1, 1])",
        "[rank 3] after scatter Rank 3 has data tensor([3, 3])",
        /* gather */
        "[rank 3] after gather Rank 3 has data tensor([7, 8])",
        "[rank 0] gather_list: [tensor([1, 2]), tensor([3, 4]), tensor([5, 6]), tensor([7, 8])]",
        /* reduce to dst 3; the other ranks keep their data (gloo leaves partial sums) */
        "[rank 3] before reduce Rank 3 has data tensor([7, 8])",
        "[rank 3] after reduce Rank 3 has data tensor([16, 20])",
        "[rank 1] after reduce Rank 1 has data tensor([3, 4])",
        /* all_gather */
        "[rank 1] after all_gather Rank 1 has gather list "
        "[tensor([1, 2]), tensor([3, 4]), tensor([5, 6]), tensor([7, 8])]",
        "[rank 2] after all_gather Rank 2 has gather list "
        "[tensor([1, 2]), tensor([3, 4]), tensor([5, 6]), tensor([7, 8])]",
        /* all_reduce */
        "[rank 0] after all_reduce Rank 0 has data tensor([16, 20])",
        "[rank 2] after all_reduce Rank 2 has data tensor([16, 20])",
        NULL,
    };

    example_assert_lines(r, want);
}

static void check_seed_004_lecture(const result_t *r)
{
    static const char *const want[] = {
        "[rank 0] all-reduce: rank 0 tensor([0., 1., 2., 3.]) -> tensor([ 6., 10., 14., 18.])",
        "[rank 3] all-reduce: rank 3 tensor([3., 4., 5., 6.]) -> tensor([ 6., 10., 14., 18.])",
        "[rank 0] reduce-scatter: rank 0 tensor([0., 1., 2., 3.]) -> tensor([6.])",
        "[rank 1] reduce-scatter: rank 1 tensor([1., 2., 3., 4.]) -> tensor([10.])",
        "[rank 2] reduce-scatter: rank 2 tensor([2., 3., 4., 5.]) -> tensor([14.])",
        "[rank 3] reduce-scatter: rank 3 tensor([3., 4., 5., 6.]) -> tensor([18.])",
        "[rank 2] all-gather: rank 2 tensor([14.]) -> tensor([ 6., 10., 14., 18.])",
        "[rank 1] [data_parallelism] Rank 1: local grad = tensor([25.]), averaged grad = "
        "tensor([51.]), params = tensor([0.9490])",
        "[rank 0] [tensor_parallelism] Rank 0: local activations tensor([0., 8.]), all-gathered "
        "tensor([ 0.,  8., 16., 24., 32., 40., 48., 56.])",
        "[rank 2] [pipeline_parallelism] Rank 2: sending tensor([ 8., 16.]) to rank 3",
        "[rank 3] [pipeline_parallelism] Rank 3: micro-batch 0 output tensor([16., 32.])",
        "[rank 3] [pipeline_parallelism] Rank 3: micro-batch 1 output tensor([48., 64.])",
        NULL,
    };

    example_assert_lines(r, want);
}

/* One run of the tour on 4 ranks; every seed example's lines are checked in it. */
Test(tour, four_ranks, .timeout = 150)
{
    result_t r;

    run_tour(&r, "4");
    assert_exit(&r, 0);
    check_seed_000_collectives(&r);
    check_seed_000_p2p(&r);
    check_seed_001_primitives(&r);
    check_seed_002_three_ranks(&r);
    check_seed_003_int64(&r);
    check_seed_004_lecture(&r);
    result_free(&r);
}

Test(tour, wants_four_ranks, .timeout = 150)
{
    result_t r;

    run_tour(&r, "2");
    assert_exit(&r, 2);
    assert_stderr_has(&r, "needs 4 ranks");
    result_free(&r);
}
