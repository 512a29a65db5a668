/* Deadlines, dead and frozen peers, bad input on the port, limits,
 * rendezvous failures and shutdown. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ranks.h"
#include "rawpeer.h"

static void echo(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, weft_call_take_args(call));
}

/* "slow" calls, in the order they came, and how many of them "release" let answer (per rank). */
static _Atomic int64_t slow_came, slow_released, slow_answered;

typedef struct {
    weft_call_t *call;
    int64_t ticket;
} late_t;

static void *late_reply(void *arg)
{
    late_t *l = arg;
    bool released;
    WAIT_UNTIL(released, atomic_load(&slow_released) > l->ticket, 30000);
    if (released) {
        weft_call_reply(l->call, NULL);
    } else {
        weft_call_fail(l->call, WEFT_ERR_TIMEOUT, "test: slow call %lld never released",
                       (long long)l->ticket);
    }
    atomic_fetch_add(&slow_answered, 1);
    free(l);
    return NULL;
}

/* Answers from another thread once "release" lets it (never, if nobody does). */
static void slow(weft_call_t *call, void *arg)
{
    (void)arg;
    late_t *l = malloc(sizeof(*l));
    l->call = call;
    l->ticket = atomic_fetch_add(&slow_came, 1);
    pthread_t th;
    pthread_create(&th, NULL, late_reply, l);
    pthread_detach(th);
}

/* Lets the first n (an int64 payload) "slow" calls answer, and answers once they have: their
 * answers leave before this one. */
static void release(weft_call_t *call, void *arg)
{
    (void)arg;
    size_t len;
    const int64_t *n = weft_value_payload(weft_call_args(call), &len);
    if (n == NULL || len != sizeof(*n)) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "release: want one int64");
        return;
    }
    int64_t want = *n;
    int64_t cur = atomic_load(&slow_released);
    while (cur < want && !atomic_compare_exchange_weak(&slow_released, &cur, want)) {
    }
    bool answered;
    WAIT_UNTIL(answered, atomic_load(&slow_answered) >= want, 10000);
    if (!answered) {
        weft_call_fail(call, WEFT_ERR_TIMEOUT, "release: %lld of %lld slow calls answered",
                       (long long)atomic_load(&slow_answered), (long long)want);
        return;
    }
    weft_call_reply(call, NULL);
}

/* Lets the first @p n "slow" calls on @p rank answer; 0 once they have. */
static int release_slow(weft_agent_t *a, int rank, int64_t n)
{
    weft_value_t *v;
    weft_value_create(&v);
    weft_value_set_payload(v, &n, sizeof(n));
    weft_status_t st = weft_rpc_sync(a, rank, "release", v, 20000, NULL);
    weft_value_free(v);
    RANK_CHECK(st == WEFT_OK, "release %lld on rank %d: %s", (long long)n, rank, weft_last_error());
    return 0;
}

static void time_left(weft_call_t *call, void *arg)
{
    (void)arg;
    int64_t left = weft_call_time_left_ms(call);
    weft_value_t *v;
    weft_value_create(&v);
    weft_value_set_payload(v, &left, sizeof(left));
    weft_call_reply(call, v);
}

static void get_pid(weft_call_t *call, void *arg)
{
    (void)arg;
    int pid = getpid();
    weft_value_t *v;
    weft_value_create(&v);
    weft_value_set_payload(v, &pid, sizeof(pid));
    weft_call_reply(call, v);
}

static void die(weft_call_t *call, void *arg)
{
    (void)call;
    (void)arg;
    raise(SIGKILL);
}

static void freeze(weft_call_t *call, void *arg)
{
    (void)call;
    (void)arg;
    raise(SIGSTOP);
}

static void make_big(weft_call_t *call, void *arg)
{
    (void)arg;
    int64_t n = 2 << 20;
    weft_tensor_t *t;
    weft_tensor_create(WEFT_U8, 1, &n, &t);
    weft_value_t *v;
    weft_value_create(&v);
    weft_value_push_tensor(v, t);
    weft_call_reply(call, v);
}

static void setup(weft_agent_t *a, int rank, void *arg)
{
    (void)rank;
    (void)arg;
    weft_rpc_register(a, "echo", echo, NULL);
    weft_rpc_register(a, "slow", slow, NULL);
    weft_rpc_register(a, "release", release, NULL);
    weft_rpc_register(a, "time_left", time_left, NULL);
    weft_rpc_register(a, "pid", get_pid, NULL);
    weft_rpc_register(a, "die", die, NULL);
    weft_rpc_register(a, "freeze", freeze, NULL);
    weft_rpc_register(a, "make_big", make_big, NULL);
}

static int body_deadline(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        return 0;
    }
    weft_value_t *res = NULL;
    int64_t t0 = now_ms();
    weft_status_t st = weft_rpc_sync(a, 1, "slow", NULL, 150, &res);
    RANK_CHECK(st == WEFT_ERR_TIMEOUT, "slow call gave %s", weft_strerror(st));
    RANK_CHECK(strstr(weft_last_error(), "deadline") != NULL, "text: %s", weft_last_error());
    RANK_CHECK(now_ms() - t0 < 600, "failed at the deadline, not at the late reply");
    /* The late reply arrives (before release's own) and is dropped; the stream keeps working. */
    RANK_CHECK(release_slow(a, 1, 1) == 0, "release");
    st = weft_rpc_sync(a, 1, "echo", NULL, 5000, &res);
    RANK_CHECK(st == WEFT_OK, "after timeout: %s", weft_last_error());
    weft_value_free(res);
    /* The deadline travels with the call. */
    st = weft_rpc_sync(a, 1, "time_left", NULL, 4000, &res);
    RANK_CHECK(st == WEFT_OK, "time_left: %s", weft_last_error());
    size_t len;
    const int64_t *left = weft_value_payload(res, &len);
    RANK_CHECK(len == 8 && *left > 3000 && *left <= 4000, "callee saw %lld ms left",
               (long long)*left);
    weft_value_free(res);
    /* A future outlives a wait that timed out, and completes later. */
    weft_future_t *f;
    RANK_CHECK(weft_rpc_async(a, 1, "slow", NULL, 5000, &f) == WEFT_OK, "async");
    RANK_CHECK(weft_future_wait(f, 10) == WEFT_ERR_TIMEOUT, "wait 10 ms");
    RANK_CHECK(release_slow(a, 1, 2) == 0, "release");
    RANK_CHECK(weft_future_wait(f, 5000) == WEFT_OK, "then done: %s", weft_future_error(f));
    weft_future_release(f);
    return 0;
}

Test(rpc_failure, deadlines, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_deadline);
    o.setup = setup;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

static int body_killed(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        return 0; /* rank 1 dies inside "die" */
    }
    weft_future_t *other, *large;
    RANK_CHECK(weft_rpc_async(a, 1, "slow", NULL, 30000, &other) == WEFT_OK, "async");
    /* A large call (direct connection) pending when the peer dies fails too. */
    int64_t big = 4 << 20;
    weft_tensor_t *bt;
    weft_tensor_create(WEFT_U8, 1, &big, &bt);
    weft_value_t *bargs;
    weft_value_create(&bargs);
    weft_value_push_tensor(bargs, bt);
    RANK_CHECK(weft_rpc_async(a, 1, "slow", bargs, 30000, &large) == WEFT_OK, "async large");
    weft_value_free(bargs);
    int64_t t0 = now_ms();
    weft_status_t st = weft_rpc_sync(a, 1, "die", NULL, 30000, NULL);
    int64_t took = now_ms() - t0;
    RANK_CHECK(st == WEFT_ERR_PEER_LOST, "call to a killed peer gave %s: %s", weft_strerror(st),
               weft_last_error());
    RANK_CHECK(took < 2000, "detected after %lld ms", (long long)took);
    fprintf(stderr, "killed peer detected after %lld ms: %s\n", (long long)took, weft_last_error());
    /* The other pending call to it fails too, and new calls fail at once. */
    RANK_CHECK(weft_future_wait(other, 5000) == WEFT_ERR_PEER_LOST, "other pending call: %s",
               weft_future_error(other));
    weft_future_release(other);
    RANK_CHECK(weft_future_wait(large, 5000) == WEFT_ERR_PEER_LOST, "large pending call: %s",
               weft_future_error(large));
    weft_future_release(large);
    st = weft_rpc_sync(a, 1, "echo", NULL, 30000, NULL);
    RANK_CHECK(st == WEFT_ERR_PEER_LOST, "later call: %s", weft_strerror(st));
    /* Calls to the live ranks keep working. */
    RANK_CHECK(weft_rpc_sync(a, 2, "echo", NULL, 5000, NULL) == WEFT_OK, "rank 2: %s",
               weft_last_error());
    return 0;
}

Test(rpc_failure, killed_peer_fails_pending_calls, .timeout = 60)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_killed);
    o.setup = setup;
    ranks_run(&o, codes);
    cr_assert_eq(codes[0], 0);
    cr_assert_eq(codes[1], 128 + SIGKILL);
    cr_assert_eq(codes[2], 0);
}

/* A call made while its peer is being declared lost (here: from a completion of a call that
 * the loss fails, which runs before the transports are cut) fails at once, on the direct
 * connection too: it is not queued on a connection about to be cut, to wait for its deadline. */
static weft_agent_t *g_agent;
static weft_future_t *g_in_loss;     /* the call made from inside the loss, once made */
static weft_status_t g_in_loss_st;   /* ... or why it could not be made */
static weft_future_t *g_in_loss_set; /* completes once the above are set */

static void call_from_loss(weft_future_t *f, void *arg)
{
    (void)f;
    (void)arg;
    int64_t big = 1 << 20; /* large: it goes on the direct connection */
    weft_tensor_t *bt;
    weft_value_t *args;
    weft_tensor_create(WEFT_U8, 1, &big, &bt);
    weft_value_create(&args);
    weft_value_push_tensor(args, bt);
    g_in_loss_st = weft_rpc_async(g_agent, 1, "echo", args, 30000, &g_in_loss);
    weft_value_free(args);
    weft_future_complete(g_in_loss_set, WEFT_OK, NULL, NULL);
}

static int body_call_in_loss(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        return 0; /* rank 1 freezes inside "freeze" */
    }
    g_agent = a;
    RANK_CHECK(weft_future_create(&g_in_loss_set) == WEFT_OK, "no memory");
    /* The direct connection is up before the loss (a large echo). */
    int64_t big = 1 << 20;
    weft_tensor_t *bt;
    weft_value_t *bargs;
    weft_tensor_create(WEFT_U8, 1, &big, &bt);
    weft_value_create(&bargs);
    weft_value_push_tensor(bargs, bt);
    RANK_CHECK(weft_rpc_sync(a, 1, "echo", bargs, 20000, NULL) == WEFT_OK, "echo: %s",
               weft_last_error());
    weft_value_free(bargs);
    weft_value_t *res;
    RANK_CHECK(weft_rpc_sync(a, 1, "pid", NULL, 5000, &res) == WEFT_OK, "pid");
    size_t len;
    int pid = *(const int *)weft_value_payload(res, &len);
    weft_value_free(res);
    weft_future_t *pending;
    RANK_CHECK(weft_rpc_async(a, 1, "slow", NULL, 30000, &pending) == WEFT_OK, "async");
    RANK_CHECK(weft_future_then(pending, call_from_loss, NULL) == WEFT_OK, "then");
    /* Frozen, not dead: its connections stay open, and only the peer timeout finds it lost. */
    weft_status_t fst = weft_rpc_sync(a, 1, "freeze", NULL, 30000, NULL);
    RANK_CHECK(fst == WEFT_ERR_PEER_LOST, "freeze: %s", weft_last_error());
    RANK_CHECK(weft_future_wait(g_in_loss_set, 20000) == WEFT_OK, "the loss failed no call");
    kill(pid, SIGKILL);
    if (g_in_loss_st == WEFT_OK) {
        weft_status_t st = weft_future_wait(g_in_loss, 10000);
        RANK_CHECK(st == WEFT_ERR_PEER_LOST, "a call made during the loss: %s (%s)",
                   weft_strerror(st), weft_future_error(g_in_loss));
        weft_future_release(g_in_loss);
    } else {
        RANK_CHECK(g_in_loss_st == WEFT_ERR_PEER_LOST, "a call made during the loss: %s",
                   weft_strerror(g_in_loss_st));
    }
    weft_future_release(g_in_loss_set);
    return 0;
}

Test(rpc_failure, a_call_made_while_its_peer_is_declared_lost_fails_at_once, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_call_in_loss);
    o.setup = setup;
    o.rank_env[0] = "WEFT_SHM=0";
    o.rank_env[1] = "WEFT_SHM=0";
    ranks_run(&o, codes);
    cr_assert_eq(codes[0], 0);
    cr_assert_eq(codes[1], 128 + SIGKILL);
}

/* A rank that only ever called (its callee never called it back) and then dies is lost to its
 * callee too: the callee learns it from the caller's stream, and its modules hear of it. */
static weft_future_t *g_lost;

static weft_status_t watch_create(weft_agent_t *a, void **state_p)
{
    (void)a;
    *state_p = &g_lost;
    return WEFT_OK;
}

static void watch_peer_lost(void *state, int rank, const char *why)
{
    (void)state;
    weft_future_fail(g_lost, WEFT_ERR_PEER_LOST, "rank %d: %s", rank, why);
}

static const weft_module_desc_t watch_desc = {
    .name = "watch", .channel = 100, .create = watch_create, .on_peer_lost = watch_peer_lost};

static void watch_setup(weft_agent_t *a, int rank, void *arg)
{
    void *state;
    setup(a, rank, arg);
    weft_future_create(&g_lost);
    weft_agent_module(a, &watch_desc, &state);
}

static int body_caller_dies(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank == 1) {
        RANK_CHECK(weft_rpc_sync(a, 0, "echo", NULL, 5000, NULL) == WEFT_OK, "echo");
        kill(getpid(), SIGKILL);
    }
    RANK_CHECK(weft_future_wait(g_lost, 20000) == WEFT_ERR_PEER_LOST,
               "rank 0 never learnt that its caller died");
    RANK_CHECK(strstr(weft_future_error(g_lost), "rank 1") != NULL, "%s",
               weft_future_error(g_lost));
    return 0;
}

Test(rpc_failure, a_caller_that_dies_is_lost_to_its_callee, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_caller_dies);
    o.setup = watch_setup;
    o.no_shutdown = 1;
    ranks_run(&o, codes);
    cr_assert_eq(codes[0], 0);
    cr_assert_eq(codes[1], 128 + SIGKILL);
}

static int body_frozen(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        return 0;
    }
    weft_value_t *res;
    RANK_CHECK(weft_rpc_sync(a, 1, "pid", NULL, 5000, &res) == WEFT_OK, "pid");
    size_t len;
    int pid = *(const int *)weft_value_payload(res, &len);
    weft_value_free(res);
    int64_t t0 = now_ms();
    weft_status_t st = weft_rpc_sync(a, 1, "freeze", NULL, 30000, NULL);
    int64_t took = now_ms() - t0;
    kill(pid, SIGKILL);
    RANK_CHECK(st == WEFT_ERR_PEER_LOST, "call to a frozen peer gave %s: %s", weft_strerror(st),
               weft_last_error());
    fprintf(stderr, "frozen peer detected after %lld ms: %s\n", (long long)took, weft_last_error());
    RANK_CHECK(took < 10000, "detected after %lld ms", (long long)took);
    return 0;
}

Test(rpc_failure, frozen_peer_detected_by_keepalive, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_frozen);
    o.setup = setup;
    ranks_run(&o, codes);
    cr_assert_eq(codes[0], 0);
    cr_assert_eq(codes[1], 128 + SIGKILL);
}

/* Rank 0 tells rank 1 it is done (the test runs without the collective shutdown). */
static weft_future_t *all_done;

static void done_fn(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_future_complete(all_done, WEFT_OK, NULL, NULL);
    weft_call_reply(call, NULL);
}

static void bad_input_setup(weft_agent_t *a, int rank, void *arg)
{
    setup(a, rank, arg);
    weft_future_create(&all_done);
    weft_rpc_register(a, "done", done_fn, NULL);
}

/* Rank 1, on its own server (the only process that can prove rank 1): garbage after an accepted
 * Hello drops that message only; the stream goes on and answers the next request. */
static int garbage_after_hello(weft_agent_t *a)
{
    char why[512];
    rawpeer_t *p = rawpeer_open(weft_agent_worker_address(a, 1));
    RANK_CHECK(rawpeer_challenge(p) != NULL, "no challenge");
    int st = rawpeer_say_hello(p, WEFT_PROTOCOL_VERSION, 1, 2, "secret", a, why, sizeof(why));
    RANK_CHECK(st == 0, "own hello refused: %d (%s)", st, why);
    /* A well-framed gRPC message that is not a weft message. */
    RANK_CHECK(rawpeer_send_bytes(p, "\xff\xff\xff\x7fthis is not weft", 20) == 0, "garbage");
    Weft__V1__Envelope e = WEFT__V1__ENVELOPE__INIT;
    e.kind = WEFT__V1__KIND__KIND_REQUEST;
    e.request_id = 7;
    e.function = "echo";
    e.timeout_ms = 10000;
    e.src_rank = 1;
    e.payload_bytes = 2;
    uint8_t buf[256];
    size_t n = rawpeer_frame(buf, sizeof(buf), &e, "ok", 2);
    RANK_CHECK(rawpeer_send_bytes(p, buf, n) == 0, "request after garbage");
    uint64_t id = 7;
    rawpeer_reply_t r;
    RANK_CHECK(rawpeer_answers(p, &id, 1, &r, 10000) == 0, "no answer after garbage");
    RANK_CHECK(r.status == 0 && r.payload_len == 2 && memcmp(r.payload, "ok", 2) == 0,
               "answer after garbage: %d (%s)", r.status, r.why);
    RANK_CHECK(rawpeer_close(p, why, sizeof(why)) == 0, "the stream ended with an error: %s", why);
    rawpeer_free(p);
    RANK_CHECK(weft_future_wait(all_done, 40000) == WEFT_OK, "rank 0 never said it was done");
    return 0;
}

static int body_bad_input(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        return garbage_after_hello(a);
    }
    const char *addr1 = weft_agent_worker_address(a, 1);
    const char *addr0 = weft_agent_worker_address(a, 0);
    char why[512];
    RANK_CHECK(weft_rpc_sync(a, 1, "echo", NULL, 5000, NULL) == WEFT_OK, "before");

    RANK_CHECK(rawpeer_garbage_tcp(addr1, 65536) == 0, "garbage tcp");
    const char *direct1 = weft_agent_worker_direct_address(a, 1);
    RANK_CHECK(direct1 != NULL && direct1[0] != '\0', "rank 1 has a direct listener");
    RANK_CHECK(rawpeer_garbage_tcp(direct1, 65536) == 0, "garbage on the direct port");
    int st = rawpeer_hello(addr1, 99, 1, 2, "secret", NULL, why, sizeof(why));
    RANK_CHECK(st == WEFT_ERR_VERSION, "version 99 gave %d (%s)", st, why);
    RANK_CHECK(strstr(why, "version 99") != NULL, "text: %s", why);
    st = rawpeer_hello(addr1, WEFT_PROTOCOL_VERSION, 1, 2, "wrong", NULL, why, sizeof(why));
    RANK_CHECK(st == WEFT_ERR_AUTH, "wrong token gave %d (%s)", st, why);
    st = rawpeer_hello(addr1, WEFT_PROTOCOL_VERSION, 5, 2, "secret", NULL, why, sizeof(why));
    RANK_CHECK(st == WEFT_ERR_INVALID_ARG, "rank 5 of 2 gave %d (%s)", st, why);
    st = rawpeer_hello(addr1, WEFT_PROTOCOL_VERSION, 1, 3, "secret", NULL, why, sizeof(why));
    RANK_CHECK(st == WEFT_ERR_MISMATCH, "world of 3 gave %d (%s)", st, why);
    st = rawpeer_join(addr0, 99, 1, 2, "secret", why, sizeof(why));
    RANK_CHECK(st == WEFT_ERR_VERSION, "join with version 99 gave %d (%s)", st, why);
    /* The world keeps working, large frames (direct) included. */
    int64_t big = 3 << 20;
    weft_tensor_t *bt;
    weft_tensor_create(WEFT_U8, 1, &big, &bt);
    ((uint8_t *)weft_tensor_data(bt))[big - 1] = 7;
    weft_value_t *bargs, *bres;
    weft_value_create(&bargs);
    weft_value_push_tensor(bargs, bt);
    RANK_CHECK(weft_rpc_sync(a, 1, "echo", bargs, 10000, &bres) == WEFT_OK, "large after: %s",
               weft_last_error());
    RANK_CHECK(weft_tensor_equal(weft_value_tensor(bres, 0), bt), "large echo differs");
    weft_value_free(bres);
    weft_value_free(bargs);
    weft_value_t *args = value_of_string("still here");
    weft_value_t *res;
    RANK_CHECK(weft_rpc_sync(a, 1, "echo", args, 5000, &res) == WEFT_OK, "after: %s",
               weft_last_error());
    weft_value_free(res);
    weft_value_free(args);
    RANK_CHECK(weft_rpc_sync(a, 1, "done", NULL, 5000, NULL) == WEFT_OK, "done: %s",
               weft_last_error());
    return 0;
}

Test(rpc_failure, garbage_and_wrong_version_are_refused, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_bad_input);
    o.setup = bad_input_setup;
    o.auth_token = "secret";
    o.no_shutdown = 1; /* rank 1's raw peer sent a request no agent counted as sent */
    cr_assert_eq(ranks_run(&o, codes), 0);
}

static int body_limit(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank == 1) {
        /* A result over this rank's own limit is refused by the callee with a clear error. */
        weft_status_t st = weft_rpc_sync(a, 2, "make_big", NULL, 5000, NULL);
        RANK_CHECK(st == WEFT_ERR_TOO_LARGE, "big result gave %s: %s", weft_strerror(st),
                   weft_last_error());
        RANK_CHECK(strstr(weft_last_error(), "limit") != NULL, "text: %s", weft_last_error());
        RANK_CHECK(weft_rpc_sync(a, 2, "echo", NULL, 5000, NULL) == WEFT_OK, "after");
        return 0;
    }
    if (rank != 0) {
        return 0;
    }
    int64_t n = 2 << 20;
    weft_tensor_t *t;
    weft_tensor_create(WEFT_U8, 1, &n, &t);
    weft_value_t *args;
    weft_value_create(&args);
    weft_value_push_tensor(args, t);
    weft_status_t st = weft_rpc_sync(a, 1, "echo", args, 5000, NULL);
    RANK_CHECK(st == WEFT_ERR_TOO_LARGE, "2 MiB to a 1 MiB peer gave %s", weft_strerror(st));
    RANK_CHECK(strstr(weft_last_error(), "limit") != NULL, "text: %s", weft_last_error());
    weft_value_free(args);
    /* The stream is alive: a smaller call goes through. */
    n = 512 << 10;
    weft_tensor_create(WEFT_U8, 1, &n, &t);
    weft_value_create(&args);
    weft_value_push_tensor(args, t);
    RANK_CHECK(weft_rpc_sync(a, 1, "echo", args, 5000, NULL) == WEFT_OK, "512 KiB: %s",
               weft_last_error());
    weft_value_free(args);
    return 0;
}

Test(rpc_failure, over_limit_messages, .timeout = 60)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_limit);
    o.setup = setup;
    o.max_message_bytes = 64 << 20;
    o.max_message_bytes_rank1 = 1 << 20;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

static int join_failed(int rank, weft_status_t st, const char *why, void *arg)
{
    (void)arg;
    RANK_CHECK(st == WEFT_ERR_RENDEZVOUS, "rank %d: join gave %s", rank, weft_strerror(st));
    RANK_CHECK(strstr(why, "rank 2 never arrived") != NULL, "rank %d: text: %s", rank, why);
    return 0;
}

static int never_runs(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)a;
    (void)world;
    (void)arg;
    fprintf(stderr, "rank %d joined a world with a rank missing\n", rank);
    return 1;
}

Test(rpc_failure, missing_rank_fails_rendezvous, .timeout = 60)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, never_runs);
    o.skip_rank = 2;
    o.rendezvous_timeout_ms = 1500;
    o.join_failed = join_failed;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* On rank 0, a module whose shutdown listener lets ranks 1 and 2 answer their three "slow" calls
 * each, without waiting for it: the calls are in flight when rank 0's shutdown begins, and the
 * answers come while its barrier waits for them. */
static weft_future_t *drain_released[2];

static weft_status_t releaser_create(weft_agent_t *a, void **state_p)
{
    *state_p = a;
    return WEFT_OK;
}

static weft_status_t releaser_shutdown(void *state, int64_t deadline_ms)
{
    (void)deadline_ms;
    weft_agent_t *a = state;
    weft_status_t st = WEFT_OK;
    int64_t n = 3;
    weft_value_t *v;
    weft_value_create(&v);
    weft_value_set_payload(v, &n, sizeof(n));
    for (int r = 1; r <= 2 && st == WEFT_OK; r++) {
        st = weft_rpc_async(a, r, "release", v, 20000, &drain_released[r - 1]);
    }
    weft_value_free(v);
    return st;
}

static const weft_module_desc_t releaser = {
    .name = "releaser", .channel = 64, .create = releaser_create, .on_shutdown = releaser_shutdown};

static void drain_setup(weft_agent_t *a, int rank, void *arg)
{
    void *state;
    setup(a, rank, arg);
    if (rank == 0) {
        weft_agent_module(a, &releaser, &state);
    }
}

static int body_drain(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        return 0; /* goes straight to shutdown while rank 0's calls run */
    }
    weft_future_t *fs[6];
    for (int i = 0; i < 6; i++) {
        RANK_CHECK(weft_rpc_async(a, 1 + i % 2, "slow", NULL, 20000, &fs[i]) == WEFT_OK, "async");
    }
    weft_status_t st = weft_agent_shutdown(a, 20000);
    RANK_CHECK(st == WEFT_OK, "shutdown: %s", weft_last_error());
    for (int i = 0; i < 6; i++) {
        RANK_CHECK(weft_future_done(fs[i]) && weft_future_status(fs[i]) == WEFT_OK,
                   "call %d drained with %s", i, weft_strerror(weft_future_status(fs[i])));
        weft_future_release(fs[i]);
    }
    for (int i = 0; i < 2; i++) {
        RANK_CHECK(drain_released[i] != NULL && weft_future_done(drain_released[i]) &&
                       weft_future_status(drain_released[i]) == WEFT_OK,
                   "release on rank %d: %s", i + 1,
                   drain_released[i] != NULL ? weft_future_error(drain_released[i]) : "not sent");
        weft_future_release(drain_released[i]);
    }
    st = weft_rpc_sync(a, 1, "echo", NULL, 1000, NULL);
    RANK_CHECK(st == WEFT_ERR_SHUTDOWN, "call after shutdown gave %s", weft_strerror(st));
    return 0;
}

static int body_drain_outer(weft_agent_t *a, int rank, int world, void *arg)
{
    return body_drain(a, rank, world, arg);
}

Test(rpc_failure, shutdown_drains_in_flight_calls, .timeout = 60)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_drain_outer);
    o.setup = drain_setup;
    /* Rank 0 shuts down in its body; the harness shuts down the others. */
    o.no_shutdown = 0;
    cr_assert_eq(ranks_run(&o, codes), 0);
}
