/* Many calls in flight, nested chains, blocking nested calls, 8 ranks. */
#include <criterion/criterion.h>
#include <string.h>

#include "ranks.h"

static void scale(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_value_t *v = weft_call_take_args(call);
    weft_tensor_t *t = weft_value_tensor(v, 0);
    float *p = weft_tensor_data(t);
    for (int64_t i = 0; i < weft_tensor_numel(t); i++) {
        p[i] *= 2.0f;
    }
    weft_call_reply(call, v);
}

/* chain(n, peer): n == 0 answers its own rank; else calls chain(n-1) on the
 * caller, replying through the future (never blocks a thread). */
static void chain(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_agent_t *a = weft_call_agent(call);
    size_t len;
    const int *n = weft_value_payload(weft_call_args(call), &len);
    if (n == NULL || len != sizeof(int)) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "chain wants an int");
        return;
    }
    if (*n == 0) {
        weft_value_t *v;
        weft_value_create(&v);
        int r = weft_agent_rank(a);
        weft_value_set_payload(v, &r, sizeof(r));
        weft_call_reply(call, v);
        return;
    }
    int next = *n - 1;
    weft_value_t *args;
    weft_value_create(&args);
    weft_value_set_payload(args, &next, sizeof(next));
    weft_future_t *f;
    weft_status_t st = weft_rpc_async(a, weft_call_caller_rank(call), "chain", args, 0, &f);
    weft_value_free(args);
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "%s", weft_last_error());
        return;
    }
    weft_call_reply_future(call, f);
}

/* The same, but blocking in rpc_sync inside the handler. */
static void chain_blocking(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_agent_t *a = weft_call_agent(call);
    size_t len;
    const int *n = weft_value_payload(weft_call_args(call), &len);
    if (*n == 0) {
        weft_value_t *v;
        weft_value_create(&v);
        int r = weft_agent_rank(a);
        weft_value_set_payload(v, &r, sizeof(r));
        weft_call_reply(call, v);
        return;
    }
    int next = *n - 1;
    weft_value_t *args, *res = NULL;
    weft_value_create(&args);
    weft_value_set_payload(args, &next, sizeof(next));
    weft_status_t st =
        weft_rpc_sync(a, weft_call_caller_rank(call), "chain_blocking", args, 0, &res);
    weft_value_free(args);
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "%s", weft_last_error());
        return;
    }
    weft_call_reply(call, res);
}

/* Like chain_blocking, with a 2 MiB tensor travelling each way: large
 * messages are served on the bulk queue, which must not stall behind a
 * handler blocked in a nested call. */
static void chain_blocking_big(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_agent_t *a = weft_call_agent(call);
    weft_value_t *in = weft_call_take_args(call);
    size_t len;
    const int *n = weft_value_payload(in, &len);
    if (*n == 0) {
        weft_call_reply(call, in);
        return;
    }
    int next = *n - 1;
    weft_value_set_payload(in, &next, sizeof(next));
    weft_value_t *res = NULL;
    weft_status_t st =
        weft_rpc_sync(a, weft_call_caller_rank(call), "chain_blocking_big", in, 0, &res);
    weft_value_free(in);
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "%s", weft_last_error());
        return;
    }
    weft_call_reply(call, res);
}

static void setup(weft_agent_t *a, int rank, void *arg)
{
    (void)rank;
    (void)arg;
    weft_rpc_register(a, "scale", scale, NULL);
    weft_rpc_register(a, "chain", chain, NULL);
    weft_rpc_register(a, "chain_blocking", chain_blocking, NULL);
    weft_rpc_register(a, "chain_blocking_big", chain_blocking_big, NULL);
}

static int body_concurrent(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    enum { N = 64 };
    weft_future_t *fs[N];
    weft_tensor_t *ts[N];
    for (int i = 0; i < N; i++) {
        int to = (rank + 1 + i % (world - 1)) % world;
        ts[i] = tensor_f32_range(1 + i * 37, (float)(i * 1000 + rank));
        weft_value_t *args;
        weft_value_create(&args);
        weft_value_add_tensor(args, ts[i]);
        weft_status_t st = weft_rpc_async(a, to, "scale", args, 20000, &fs[i]);
        weft_value_free(args);
        RANK_CHECK(st == WEFT_OK, "async %d: %s", i, weft_last_error());
    }
    weft_status_t st = weft_future_wait_all(fs, N, 30000);
    RANK_CHECK(st == WEFT_OK, "wait_all: %s", weft_strerror(st));
    for (int i = 0; i < N; i++) {
        weft_tensor_t *r = weft_value_tensor(weft_future_value(fs[i]), 0);
        RANK_CHECK(r != NULL && weft_tensor_numel(r) == 1 + i * 37, "call %d size", i);
        const float *p = weft_tensor_data(r);
        const float *q = weft_tensor_data(ts[i]);
        for (int64_t j = 0; j < weft_tensor_numel(r); j++) {
            RANK_CHECK(p[j] == 2.0f * q[j], "call %d element %lld", i, (long long)j);
        }
        weft_future_release(fs[i]);
        weft_tensor_release(ts[i]);
    }
    return 0;
}

Test(rpc_async, sixty_four_concurrent_calls_on_4_ranks, .timeout = 60)
{
    ranks_opts_t o;
    int codes[4];
    ranks_opts_init(&o, 4, body_concurrent);
    o.setup = setup;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

static int run_chain(weft_agent_t *a, const char *fn, int depth)
{
    weft_value_t *args, *res = NULL;
    weft_value_create(&args);
    weft_value_set_payload(args, &depth, sizeof(depth));
    weft_status_t st = weft_rpc_sync(a, 1, fn, args, 30000, &res);
    weft_value_free(args);
    RANK_CHECK(st == WEFT_OK, "%s depth %d: %s", fn, depth, weft_last_error());
    size_t len;
    const int *who = weft_value_payload(res, &len);
    /* depth d ends on rank 1 when d is even (0 -> 1 -> 0 -> ...). */
    RANK_CHECK(len == sizeof(int) && *who == (depth % 2 == 0 ? 1 : 0), "ended on %d", *who);
    weft_value_free(res);
    return 0;
}

static int body_chain(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        return 0;
    }
    for (int d = 0; d <= 40; d += 7) {
        if (run_chain(a, "chain", d) != 0) {
            return 1;
        }
    }
    /* Several chains at once. */
    weft_future_t *fs[8];
    for (int i = 0; i < 8; i++) {
        int depth = 10 + i;
        weft_value_t *args;
        weft_value_create(&args);
        weft_value_set_payload(args, &depth, sizeof(depth));
        RANK_CHECK(weft_rpc_async(a, 1, "chain", args, 30000, &fs[i]) == WEFT_OK, "async");
        weft_value_free(args);
    }
    RANK_CHECK(weft_future_wait_all(fs, 8, 30000) == WEFT_OK, "chains");
    for (int i = 0; i < 8; i++) {
        weft_future_release(fs[i]);
    }
    return 0;
}

Test(rpc_async, nested_chains_with_one_handler_thread, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_chain);
    o.setup = setup;
    o.handler_threads = 1;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

static int body_chain_blocking(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        return 0;
    }
    return run_chain(a, "chain_blocking", 12);
}

Test(rpc_async, blocking_nested_calls_do_not_deadlock, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_chain_blocking);
    o.setup = setup;
    o.handler_threads = 1;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

static int body_chain_big(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        return 0;
    }
    int64_t n = (2 << 20) / 4;
    weft_tensor_t *t = tensor_f32_range(n, 3.0f);
    weft_value_t *args, *res = NULL;
    weft_value_create(&args);
    weft_value_add_tensor(args, t);
    int depth = 8;
    weft_value_set_payload(args, &depth, sizeof(depth));
    weft_status_t st = weft_rpc_sync(a, 1, "chain_blocking_big", args, 20000, &res);
    RANK_CHECK(st == WEFT_OK, "big chain: %s", weft_last_error());
    RANK_CHECK(weft_tensor_equal(weft_value_tensor(res, 0), t), "tensor changed on the way");
    weft_value_free(res);
    weft_value_free(args);
    weft_tensor_release(t);
    return 0;
}

Test(rpc_async, blocking_nested_calls_with_large_tensors, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_chain_big);
    o.setup = setup;
    o.handler_threads = 1;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

static int body_eight(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    RANK_CHECK(world == 8 && weft_agent_world_size(a) == 8, "world");
    enum { PER = 6 };
    weft_future_t *fs[8 * PER];
    weft_tensor_t *ts[8 * PER];
    int n = 0;
    for (int to = 0; to < world; to++) {
        for (int k = 0; k < PER; k++) {
            ts[n] = tensor_f32_range(100 + k, (float)(rank * 100 + to));
            weft_value_t *args;
            weft_value_create(&args);
            weft_value_add_tensor(args, ts[n]);
            RANK_CHECK(weft_rpc_async(a, to, "scale", args, 30000, &fs[n]) == WEFT_OK, "async");
            weft_value_free(args);
            n++;
        }
    }
    RANK_CHECK(weft_future_wait_all(fs, (size_t)n, 40000) == WEFT_OK, "wait_all");
    for (int i = 0; i < n; i++) {
        const float *p = weft_tensor_data(weft_value_tensor(weft_future_value(fs[i]), 0));
        const float *q = weft_tensor_data(ts[i]);
        RANK_CHECK(p[0] == 2 * q[0] && p[99] == 2 * q[99], "result %d", i);
        weft_future_release(fs[i]);
        weft_tensor_release(ts[i]);
    }
    for (int r = 0; r < world; r++) {
        char name[16];
        snprintf(name, sizeof(name), "worker%d", r);
        int got = -1;
        RANK_CHECK(weft_agent_worker_rank(a, name, &got) == WEFT_OK && got == r, "map %d", r);
    }
    return 0;
}

Test(rpc_async, eight_ranks_all_to_all, .timeout = 120)
{
    ranks_opts_t o;
    int codes[8];
    ranks_opts_init(&o, 8, body_eight);
    o.setup = setup;
    o.deadline_ms = 110000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* Answers to the requests of one received message leave together, after all of them have
 * run; a handler among them that blocks in a weft wait lets the answers made before it go
 * first. Rank 0 sends pad, mark and ask_back at once (mark and ask_back queue behind pad and
 * leave as one message); rank 1's ask_back blocks in an rpc_sync to rank 0 whose handler
 * waits for mark's answer. Held until ask_back returned, that answer would never come. */
static weft_future_t *mark_answer; /* rank 0: the answer to its mark call */

static void mark(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, NULL);
}

static void wait_mark(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_status_t st = weft_future_wait(mark_answer, 5000);
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "the answer to mark did not come: %s", weft_strerror(st));
        return;
    }
    weft_call_reply(call, NULL);
}

static void ask_back(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_value_t *res = NULL;
    weft_status_t st = weft_rpc_sync(weft_call_agent(call), weft_call_caller_rank(call),
                                     "wait_mark", NULL, 20000, &res);
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "%s", weft_last_error());
        return;
    }
    weft_call_reply(call, res);
}

static void setup_held(weft_agent_t *a, int rank, void *arg)
{
    (void)rank;
    (void)arg;
    weft_rpc_register(a, "mark", mark, NULL);
    weft_rpc_register(a, "wait_mark", wait_mark, NULL);
    weft_rpc_register(a, "ask_back", ask_back, NULL);
}

static int body_held_answers(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        return 0;
    }
    for (int round = 0; round < 20; round++) {
        weft_future_t *pad, *back;
        RANK_CHECK(weft_rpc_async(a, 1, "mark", NULL, 20000, &pad) == WEFT_OK, "pad");
        RANK_CHECK(weft_rpc_async(a, 1, "mark", NULL, 20000, &mark_answer) == WEFT_OK, "mark");
        RANK_CHECK(weft_rpc_async(a, 1, "ask_back", NULL, 20000, &back) == WEFT_OK, "ask_back");
        weft_status_t st = weft_future_wait(back, 20000);
        RANK_CHECK(st == WEFT_OK, "round %d: ask_back gave %s: %s", round, weft_strerror(st),
                   weft_future_error(back));
        RANK_CHECK(weft_future_wait(pad, 20000) == WEFT_OK, "pad");
        weft_future_release(pad);
        weft_future_release(back);
        weft_future_release(mark_answer);
        mark_answer = NULL;
    }
    return 0;
}

Test(rpc_async, held_answers_go_before_a_blocking_handler, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_held_answers);
    o.setup = setup_held;
    o.handler_threads = 1;
    cr_assert_eq(ranks_run(&o, codes), 0);
}
