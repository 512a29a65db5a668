/* RRefs: every flow (owner->user, user->owner, user->user, self), values and objects, failures of
 * creation, lost owners and users, shutdown with leaks, introspection, bad input. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ranks.h"

#define WAIT_MS 15000

/* Per rank process: objects destroyed, the reference a rank keeps. */
static int64_t g_dtors;
static weft_rref_t *g_kept;
static weft_rref_t *g_kept2; /* remote_keep's, apart from keep_rref's */

/* ------------------------------------------------------------ functions */

static void fn_make(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_value_t *v = value_of_string("hello");
    weft_value_push_tensor(v, tensor_f32_range(4, 1.0f));
    weft_call_reply(call, v);
}

/* Answers with its arguments. */
static void fn_echo(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, weft_call_take_args(call));
}

static void fn_fail(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_fail(call, WEFT_ERR_INVALID_ARG, "bad input x");
}

/* Fetches its RRef argument (which must be confirmed by now) and answers with the value. */
static void fn_take_rref(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_rref_t *r = weft_value_rref(weft_call_args(call), 0);
    weft_future_t *f;

    if (r == NULL) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "no rref in the arguments");
        return;
    }
    if (!weft_rref_confirmed_by_owner(r)) {
        weft_call_fail(call, WEFT_ERR_INVALID_STATE, "the handler ran before confirmation");
        return;
    }
    weft_status_t st = weft_rref_to_here_async(r, 5000, &f);
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "to_here: %s", weft_last_error());
        return;
    }
    weft_call_reply_future(call, f);
}

/* The same with a blocking to_here in the handler (torch's def use(rref): return
 * rref.to_here()): the handler runs from the fork's readiness and must not wait behind it. */
static void fn_take_rref_sync(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_rref_t *r = weft_value_rref(weft_call_args(call), 0);
    weft_value_t *v = NULL;

    if (r == NULL) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "no rref in the arguments");
        return;
    }
    weft_status_t st = weft_rref_to_here(r, 5000, &v);
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "to_here: %s", weft_last_error());
        return;
    }
    weft_call_reply(call, v);
}

/* Forwards its RRef to the rank in its payload ("take_rref" there). */
static void fn_forward(weft_call_t *call, void *arg)
{
    (void)arg;
    const weft_value_t *in = weft_call_args(call);
    size_t len;
    const int *to = weft_value_payload(in, &len);
    weft_value_t *v;
    weft_future_t *f;

    weft_value_create(&v);
    weft_value_add_rref(v, weft_value_rref(in, 0));
    weft_status_t st = weft_rpc_async(weft_call_agent(call), *to, "take_rref", v, 5000, &f);
    weft_value_free(v);
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "forward: %s", weft_last_error());
        return;
    }
    weft_call_reply_future(call, f);
}

/* Answers with a new reference owned by this rank. */
static void fn_return_rref(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_rref_t *r;
    weft_value_t *res;

    if (weft_rref_create(weft_call_agent(call), value_of_string("owned"), &r) != WEFT_OK) {
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "create");
        return;
    }
    weft_value_create(&res);
    weft_value_add_rref(res, r);
    weft_rref_release(r);
    weft_call_reply(call, res);
}

static void fn_keep_rref(weft_call_t *call, void *arg)
{
    (void)arg;
    g_kept = weft_rref_retain(weft_value_rref(weft_call_args(call), 0));
    weft_call_reply(call, NULL);
}

static void fn_drop_rref(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_rref_release(g_kept);
    g_kept = NULL;
    weft_call_reply(call, NULL);
}

/* Creates a reference owned by the caller and keeps it. */
static void fn_remote_keep(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_status_t st = weft_rref_remote(weft_call_agent(call), weft_call_caller_rank(call), "make",
                                        NULL, 5000, &g_kept2);
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "%s", weft_last_error());
        return;
    }
    weft_call_reply(call, NULL);
}

/* "gated_echo" answers with its arguments once "open_gate" is called. */
static pthread_mutex_t g_gate_mu = PTHREAD_MUTEX_INITIALIZER;
static weft_call_t *g_gated;

static void fn_gated_echo(weft_call_t *call, void *arg)
{
    (void)arg;
    pthread_mutex_lock(&g_gate_mu);
    g_gated = call;
    pthread_mutex_unlock(&g_gate_mu);
}

/* "slow" answers "late" once "open_gate" is called. */
static void fn_slow(weft_call_t *call, void *arg)
{
    weft_call_set_args(call, value_of_string("late"));
    fn_gated_echo(call, arg);
}

static weft_call_t *take_gated(void)
{
    pthread_mutex_lock(&g_gate_mu);
    weft_call_t *gated = g_gated;
    g_gated = NULL;
    pthread_mutex_unlock(&g_gate_mu);
    return gated;
}

static void fn_open_gate(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_t *gated = NULL;
    bool came;
    WAIT_UNTIL(came, (gated = take_gated()) != NULL, 5000);
    if (!came) {
        weft_call_fail(call, WEFT_ERR_TIMEOUT, "no gated call came");
        return;
    }
    weft_call_reply(gated, weft_call_take_args(gated));
    weft_call_reply(call, NULL);
}

static void fn_debug(weft_call_t *call, void *arg)
{
    (void)arg;
    char *json;
    weft_rref_debug_info(weft_call_agent(call), &json);
    weft_value_t *v = value_of_string(json);
    weft_free(json);
    weft_call_reply(call, v);
}

static void fn_dtors(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_value_t *v;
    weft_value_create(&v);
    int64_t n = __atomic_load_n(&g_dtors, __ATOMIC_SEQ_CST);
    weft_value_set_payload(v, &n, sizeof(n));
    weft_call_reply(call, v);
}

static void fn_die(weft_call_t *call, void *arg)
{
    (void)call;
    (void)arg;
    raise(SIGKILL);
}

/* ----------------------------------------------------------- counter type */

typedef struct {
    pthread_mutex_t mu;
    int64_t v;
} counter_t;

static weft_status_t counter_ctor(const weft_value_t *args, void *type_arg, void **obj_p)
{
    (void)type_arg;
    size_t len = 0;
    const int64_t *init = weft_value_payload(args, &len);
    counter_t *c = calloc(1, sizeof(*c));
    pthread_mutex_init(&c->mu, NULL);
    c->v = len == sizeof(int64_t) ? *init : 0;
    *obj_p = c;
    return WEFT_OK;
}

static void counter_dtor(void *obj, void *type_arg)
{
    (void)type_arg;
    counter_t *c = obj;
    pthread_mutex_destroy(&c->mu);
    free(c);
    __atomic_add_fetch(&g_dtors, 1, __ATOMIC_SEQ_CST);
}

static void reply_i64(weft_call_t *call, int64_t n)
{
    weft_value_t *v;
    weft_value_create(&v);
    weft_value_set_payload(v, &n, sizeof(n));
    weft_call_reply(call, v);
}

static void counter_add(void *obj, weft_call_t *call, void *type_arg)
{
    (void)type_arg;
    counter_t *c = obj;
    size_t len = 0;
    const int64_t *d = weft_value_payload(weft_call_args(call), &len);
    if (len != sizeof(int64_t)) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "add wants one int64, got %zu bytes", len);
        return;
    }
    pthread_mutex_lock(&c->mu);
    int64_t v = c->v += *d;
    pthread_mutex_unlock(&c->mu);
    reply_i64(call, v);
}

static void counter_get(void *obj, weft_call_t *call, void *type_arg)
{
    (void)type_arg;
    counter_t *c = obj;
    pthread_mutex_lock(&c->mu);
    int64_t v = c->v;
    pthread_mutex_unlock(&c->mu);
    reply_i64(call, v);
}

static weft_status_t failing_ctor(const weft_value_t *args, void *type_arg, void **obj_p)
{
    (void)args;
    (void)type_arg;
    (void)obj_p;
    return WEFT_ERR_INVALID_ARG;
}

static void setup(weft_agent_t *a, int rank, void *arg)
{
    (void)rank;
    (void)arg;
    static const weft_rref_method_t methods[] = {{"add", counter_add}, {"get", counter_get}};
    if (weft_rref_init(a) != WEFT_OK || weft_rref_init(a) != WEFT_OK /* idempotent */) {
        abort();
    }
    weft_rref_register_type(a, "counter", counter_ctor, counter_dtor, methods, 2, NULL);
    weft_rref_register_type(a, "broken", failing_ctor, NULL, NULL, 0, NULL);
    weft_rpc_register(a, "make", fn_make, NULL);
    weft_rpc_register(a, "fail", fn_fail, NULL);
    weft_rpc_register(a, "echo", fn_echo, NULL);
    weft_rpc_register(a, "slow", fn_slow, NULL);
    weft_rpc_register(a, "take_rref", fn_take_rref, NULL);
    weft_rpc_register(a, "take_rref_sync", fn_take_rref_sync, NULL);
    weft_rpc_register(a, "forward", fn_forward, NULL);
    weft_rpc_register(a, "return_rref", fn_return_rref, NULL);
    weft_rpc_register(a, "keep_rref", fn_keep_rref, NULL);
    weft_rpc_register(a, "drop_rref", fn_drop_rref, NULL);
    weft_rpc_register(a, "remote_keep", fn_remote_keep, NULL);
    weft_rpc_register(a, "debug", fn_debug, NULL);
    weft_rpc_register(a, "gated_echo", fn_gated_echo, NULL);
    weft_rpc_register(a, "open_gate", fn_open_gate, NULL);
    weft_rpc_register(a, "dtors", fn_dtors, NULL);
    weft_rpc_register(a, "die", fn_die, NULL);
}

/* ---------------------------------------------------------------- helpers */

static int64_t json_int(const char *json, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof(pat), "\"%s\":", key);
    const char *p = strstr(json, pat);
    return p != NULL ? strtoll(p + strlen(pat), NULL, 10) : -1;
}

/* Debug info of @p rank (this one or another). Caller frees. */
static char *debug_of(weft_agent_t *a, int rank)
{
    if (rank == weft_agent_rank(a)) {
        char *json = NULL;
        weft_rref_debug_info(a, &json);
        return json;
    }
    weft_value_t *v = NULL;
    if (weft_rpc_sync(a, rank, "debug", NULL, 5000, &v) != WEFT_OK) {
        return NULL;
    }
    size_t len;
    const char *p = weft_value_payload(v, &len);
    char *s = weft_alloc(len + 1);
    memcpy(s, p, len);
    s[len] = '\0';
    weft_value_free(v);
    return s;
}

/* Waits until @p rank has no owner entry, fork, user, pending user or pending child and at least
 * @p deleted owners freed. Returns 1 when so. */
static int wait_settled(weft_agent_t *a, int rank, int64_t deleted)
{
    int64_t until = now_ms() + WAIT_MS;
    char *json = NULL;
    do {
        weft_free(json);
        json = debug_of(a, rank);
        if (json != NULL && json_int(json, "owners") == 0 && json_int(json, "forks") == 0 &&
            json_int(json, "users") == 0 && json_int(json, "pending_users") == 0 &&
            json_int(json, "pending_children") == 0 &&
            json_int(json, "deleted_owners") >= deleted) {
            weft_free(json);
            return 1;
        }
        usleep(10 * 1000);
    } while (now_ms() < until);
    fprintf(stderr, "rank %d never settled: %s\n", rank, json != NULL ? json : "(no answer)");
    weft_free(json);
    return 0;
}

static int is_hello(const weft_value_t *v)
{
    size_t len;
    const char *p = weft_value_payload(v, &len);
    weft_tensor_t *t = weft_value_tensor(v, 0);
    return p != NULL && len == 5 && memcmp(p, "hello", 5) == 0 && t != NULL &&
           weft_tensor_numel(t) == 4 && ((const float *)weft_tensor_data(t))[3] == 4.0f;
}

static int payload_is(const weft_value_t *v, const char *s)
{
    size_t len;
    const char *p = weft_value_payload(v, &len);
    return p != NULL && len == strlen(s) && memcmp(p, s, len) == 0;
}

static weft_value_t *value_with_rref(weft_rref_t *r, int to)
{
    weft_value_t *v;
    weft_value_create(&v);
    weft_value_add_rref(v, r);
    weft_value_set_payload(v, &to, sizeof(to));
    return v;
}

static int64_t remote_dtors(weft_agent_t *a, int rank)
{
    weft_value_t *v = NULL;
    if (weft_rpc_sync(a, rank, "dtors", NULL, 5000, &v) != WEFT_OK) {
        return -1;
    }
    size_t len;
    int64_t n = *(const int64_t *)weft_value_payload(v, &len);
    weft_value_free(v);
    return n;
}

/* ------------------------------------------------------------------ flows */

static int body_flows(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    weft_value_t *v = NULL;
    weft_status_t st;

    if (rank != 0) {
        return 0;
    }
    /* remote(): rank 1 owns the result. */
    weft_rref_t *r;
    RANK_CHECK(weft_rref_remote(a, 1, "make", NULL, 5000, &r) == WEFT_OK, "remote");
    RANK_CHECK(!weft_rref_is_owner(r) && weft_rref_owner(r) == 1, "owner");
    RANK_CHECK(strcmp(weft_rref_owner_name(r), "worker1") == 0, "name %s", weft_rref_owner_name(r));
    RANK_CHECK(weft_rref_id(r).worker == 0, "the creator makes the id");
    st = weft_rref_to_here(r, 5000, &v);
    RANK_CHECK(st == WEFT_OK && is_hello(v), "to_here: %s", weft_last_error());
    weft_value_free(v);
    RANK_CHECK(weft_rref_confirmed_by_owner(r), "confirmed after to_here");
    const weft_value_t *lv;
    RANK_CHECK(weft_rref_local_value(r, 100, &lv) == WEFT_ERR_INVALID_STATE, "local_value: user");

    /* user -> owner */
    weft_value_t *args = value_with_rref(r, 0);
    st = weft_rpc_sync(a, 1, "take_rref", args, 5000, &v);
    RANK_CHECK(st == WEFT_OK && is_hello(v), "user->owner: %s", weft_last_error());
    weft_value_free(v);
    /* user -> user */
    st = weft_rpc_sync(a, 2, "take_rref", args, 5000, &v);
    RANK_CHECK(st == WEFT_OK && is_hello(v), "user->user: %s", weft_last_error());
    weft_value_free(v);
    /* user -> user, the receiver's handler blocking in to_here */
    st = weft_rpc_sync(a, 2, "take_rref_sync", args, 5000, &v);
    RANK_CHECK(st == WEFT_OK && is_hello(v), "user->user, blocking to_here: %s",
               weft_last_error());
    weft_value_free(v);
    /* user -> user -> user (rank 2 forwards to rank 3) and user -> user -> owner */
    int to = 3;
    weft_value_set_payload(args, &to, sizeof(to));
    st = weft_rpc_sync(a, 2, "forward", args, 5000, &v);
    RANK_CHECK(st == WEFT_OK && is_hello(v), "user->user->user: %s", weft_last_error());
    weft_value_free(v);
    to = 1;
    weft_value_set_payload(args, &to, sizeof(to));
    st = weft_rpc_sync(a, 2, "forward", args, 5000, &v);
    RANK_CHECK(st == WEFT_OK && is_hello(v), "user->user->owner: %s", weft_last_error());
    weft_value_free(v);
    /* several forks in flight at once */
    weft_future_t *fs[6];
    for (int i = 0; i < 6; i++) {
        RANK_CHECK(weft_rpc_async(a, 1 + i % 3, "take_rref", args, 5000, &fs[i]) == WEFT_OK,
                   "async %d", i);
    }
    RANK_CHECK(weft_future_wait_all(fs, 6, 10000) == WEFT_OK, "concurrent forks");
    for (int i = 0; i < 6; i++) {
        RANK_CHECK(is_hello(weft_future_value(fs[i])), "value %d", i);
        weft_future_release(fs[i]);
    }
    weft_value_free(args);

    /* owner -> user: rank 2 answers with a reference it owns */
    st = weft_rpc_sync(a, 2, "return_rref", NULL, 5000, &v);
    RANK_CHECK(st == WEFT_OK, "return_rref: %s", weft_last_error());
    weft_rref_t *owned2 = weft_rref_retain(weft_value_rref(v, 0));
    weft_value_free(v);
    RANK_CHECK(owned2 != NULL && weft_rref_owner(owned2) == 2, "owned by 2");
    RANK_CHECK(weft_rref_confirmed_by_owner(owned2), "an owner's fork is confirmed at once");
    st = weft_rref_to_here(owned2, 5000, &v);
    RANK_CHECK(st == WEFT_OK && payload_is(v, "owned"), "owner->user to_here: %s",
               weft_last_error());
    weft_value_free(v);
    /* ... and passed on to another user (rank 1) */
    args = value_with_rref(owned2, 0);
    st = weft_rpc_sync(a, 1, "take_rref", args, 5000, &v);
    RANK_CHECK(st == WEFT_OK && payload_is(v, "owned"), "user->user of 2's: %s", weft_last_error());
    weft_value_free(v);
    weft_value_free(args);

    /* self: remote to this rank, local value, passing it to itself and to others */
    weft_rref_t *mine;
    RANK_CHECK(weft_rref_remote(a, 0, "make", NULL, 5000, &mine) == WEFT_OK, "remote self");
    RANK_CHECK(weft_rref_is_owner(mine) && weft_rref_confirmed_by_owner(mine), "own");
    RANK_CHECK(weft_rref_local_value(mine, 5000, &lv) == WEFT_OK && is_hello(lv), "local_value");
    args = value_with_rref(mine, 0);
    st = weft_rpc_sync(a, 0, "take_rref", args, 5000, &v);
    RANK_CHECK(st == WEFT_OK && is_hello(v), "self->self: %s", weft_last_error());
    weft_value_free(v);
    st = weft_rpc_sync(a, 3, "take_rref", args, 5000, &v);
    RANK_CHECK(st == WEFT_OK && is_hello(v), "owner->user: %s", weft_last_error());
    weft_value_free(v);
    weft_value_free(args);
    st = weft_rref_to_here(mine, 5000, &v);
    RANK_CHECK(st == WEFT_OK && is_hello(v), "to_here on the owner: %s", weft_last_error());
    weft_value_free(v);
    weft_rref_t *created;
    RANK_CHECK(weft_rref_create(a, value_of_string("local"), &created) == WEFT_OK, "create");
    RANK_CHECK(weft_rref_local_value(created, 0, &lv) == WEFT_OK && payload_is(lv, "local"),
               "created value");

    /* rank 3 keeps a fork of r until told to drop it */
    args = value_with_rref(r, 0);
    RANK_CHECK(weft_rpc_sync(a, 3, "keep_rref", args, 5000, NULL) == WEFT_OK, "keep: %s",
               weft_last_error());
    weft_value_free(args);
    weft_rref_release(r);
    char *json = debug_of(a, 1);
    RANK_CHECK(json != NULL && json_int(json, "owners") == 1 && json_int(json, "forks") >= 1,
               "rank 1 still owns the value a user holds: %s", json);
    weft_free(json);
    RANK_CHECK(weft_rpc_sync(a, 3, "drop_rref", NULL, 5000, NULL) == WEFT_OK, "drop");

    weft_rref_release(owned2);
    weft_rref_release(mine);
    weft_rref_release(created);
    /* Every owner frees its values once everything is released; no user is left anywhere. */
    RANK_CHECK(wait_settled(a, 1, 1), "rank 1");
    RANK_CHECK(wait_settled(a, 2, 1), "rank 2");
    RANK_CHECK(wait_settled(a, 3, 0), "rank 3");
    RANK_CHECK(wait_settled(a, 0, 2), "rank 0");
    return 0;
}

Test(rref, flows, .timeout = 120)
{
    ranks_opts_t o;
    int codes[4];
    ranks_opts_init(&o, 4, body_flows);
    o.setup = setup;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* The same flows with control messages reordered (delayed up to 3 ms) and sent twice. */
Test(rref, flows_reordered_and_duplicated, .timeout = 120)
{
    ranks_opts_t o;
    int codes[4];
    setenv("WEFT_RREF_FAULT_DELAY_US", "3000", 1);
    setenv("WEFT_RREF_FAULT_DUP", "1", 1);
    ranks_opts_init(&o, 4, body_flows);
    o.setup = setup;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ---------------------------------------------------------------- objects */

static int body_objects(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    weft_value_t *v = NULL;
    weft_status_t st;
    int64_t n;

    if (rank != 0) {
        return 0;
    }
    weft_value_t *init;
    weft_value_create(&init);
    n = 5;
    weft_value_set_payload(init, &n, sizeof(n));
    weft_rref_t *c;
    RANK_CHECK(weft_rref_remote_object(a, 1, "counter", init, 5000, &c) == WEFT_OK, "object");
    weft_value_free(init);
    weft_value_t *three;
    weft_value_create(&three);
    n = 3;
    weft_value_set_payload(three, &n, sizeof(n));
    st = weft_rref_rpc_sync(c, "add", three, 5000, &v);
    RANK_CHECK(st == WEFT_OK, "add: %s", weft_last_error());
    size_t len;
    RANK_CHECK(*(const int64_t *)weft_value_payload(v, &len) == 8, "5 + 3");
    weft_value_free(v);
    weft_future_t *f;
    RANK_CHECK(weft_rref_rpc_async(c, "get", NULL, 5000, &f) == WEFT_OK, "get async");
    RANK_CHECK(weft_future_wait(f, 5000) == WEFT_OK, "get: %s", weft_future_error(f));
    RANK_CHECK(*(const int64_t *)weft_value_payload(weft_future_value(f), &len) == 8, "get 8");
    weft_future_release(f);
    /* remote_method: the result stays on the owner */
    weft_rref_t *got;
    RANK_CHECK(weft_rref_remote_method(c, "add", three, 5000, &got) == WEFT_OK, "remote_method");
    RANK_CHECK(weft_rref_owner(got) == 1, "result owned by the object's owner");
    st = weft_rref_to_here(got, 5000, &v);
    RANK_CHECK(st == WEFT_OK && *(const int64_t *)weft_value_payload(v, &len) == 11,
               "remote_method result: %s", weft_last_error());
    weft_value_free(v);
    weft_rref_release(got);
    /* bad input: unknown method, bad arguments, to_here of an object */
    st = weft_rref_rpc_sync(c, "nope", NULL, 5000, &v);
    RANK_CHECK(st == WEFT_ERR_NO_SUCH_FUNCTION, "unknown method: %s", weft_strerror(st));
    RANK_CHECK(strstr(weft_last_error(), "nope") != NULL, "text: %s", weft_last_error());
    st = weft_rref_rpc_sync(c, "add", NULL, 5000, &v);
    RANK_CHECK(st == WEFT_ERR_INVALID_ARG, "bad args: %s", weft_strerror(st));
    st = weft_rref_to_here(c, 5000, &v);
    RANK_CHECK(st == WEFT_ERR_UNSUPPORTED, "to_here of an object: %s", weft_strerror(st));
    /* a method of a value reference */
    weft_rref_t *val;
    RANK_CHECK(weft_rref_remote(a, 1, "make", NULL, 5000, &val) == WEFT_OK, "value");
    st = weft_rref_rpc_sync(val, "get", NULL, 5000, &v);
    RANK_CHECK(st == WEFT_ERR_UNSUPPORTED, "method of a value: %s", weft_strerror(st));
    weft_rref_release(val);
    /* unknown type, failing constructor: reported on first use */
    weft_rref_t *bad;
    RANK_CHECK(weft_rref_remote_object(a, 1, "no_such_type", NULL, 5000, &bad) == WEFT_OK, "bad");
    st = weft_rref_rpc_sync(bad, "get", NULL, 5000, &v);
    RANK_CHECK(st == WEFT_ERR_NOT_FOUND, "unknown type: %s", weft_strerror(st));
    RANK_CHECK(strstr(weft_last_error(), "no_such_type") != NULL, "text: %s", weft_last_error());
    weft_rref_release(bad);
    RANK_CHECK(weft_rref_remote_object(a, 1, "broken", NULL, 5000, &bad) == WEFT_OK, "broken");
    st = weft_rref_rpc_sync(bad, "get", NULL, 5000, &v);
    RANK_CHECK(st == WEFT_ERR_INVALID_ARG, "failing constructor: %s", weft_strerror(st));
    weft_rref_release(bad);
    /* the object travels: rank 2 holds a fork, calls it, releases */
    weft_value_free(three);
    /* an object owned here */
    weft_rref_t *mine;
    RANK_CHECK(weft_rref_remote_object(a, 0, "counter", NULL, 5000, &mine) == WEFT_OK, "mine");
    void *obj;
    RANK_CHECK(weft_rref_local_object(mine, 5000, &obj) == WEFT_OK && obj != NULL, "local_object");
    st = weft_rref_rpc_sync(mine, "get", NULL, 5000, &v);
    RANK_CHECK(st == WEFT_OK && *(const int64_t *)weft_value_payload(v, &len) == 0, "own get: %s",
               weft_last_error());
    weft_value_free(v);
    weft_rref_release(mine);
    /* The last hold may be an operation's, let go on the thread that delivered its answer. */
    for (int64_t until = now_ms() + WAIT_MS;
         __atomic_load_n(&g_dtors, __ATOMIC_SEQ_CST) == 0 && now_ms() < until;) {
        usleep(1000);
    }
    RANK_CHECK(__atomic_load_n(&g_dtors, __ATOMIC_SEQ_CST) == 1, "own object destroyed once");

    RANK_CHECK(remote_dtors(a, 1) == 0, "alive while referenced");
    weft_rref_release(c);
    RANK_CHECK(wait_settled(a, 1, 4), "rank 1");
    RANK_CHECK(remote_dtors(a, 1) == 1, "the object was destroyed exactly once");
    RANK_CHECK(wait_settled(a, 0, 1), "rank 0");
    return 0;
}

Test(rref, objects_and_methods, .timeout = 60)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_objects);
    o.setup = setup;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* --------------------------------------------------------- creation fails */

static int body_creation_fails(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    weft_value_t *v = NULL;
    weft_status_t st;

    if (rank != 0) {
        return 0;
    }
    weft_rref_t *r;
    RANK_CHECK(weft_rref_remote(a, 1, "fail", NULL, 5000, &r) == WEFT_OK, "remote fail");
    st = weft_rref_to_here(r, 5000, &v);
    RANK_CHECK(st == WEFT_ERR_INVALID_ARG, "function error: %s", weft_strerror(st));
    RANK_CHECK(strstr(weft_last_error(), "bad input x") != NULL, "text: %s", weft_last_error());
    /* every later use reports it too, and the reference cannot be shared */
    RANK_CHECK(weft_rref_to_here(r, 5000, &v) == WEFT_ERR_INVALID_ARG, "again");
    weft_value_t *args = value_with_rref(r, 0);
    RANK_CHECK(weft_rpc_sync(a, 2, "take_rref", args, 5000, &v) == WEFT_ERR_INVALID_ARG,
               "shared failed ref");
    weft_value_free(args);
    weft_rref_release(r);

    RANK_CHECK(weft_rref_remote(a, 1, "no_such_fn", NULL, 5000, &r) == WEFT_OK, "remote nope");
    st = weft_rref_to_here(r, 5000, &v);
    RANK_CHECK(st == WEFT_ERR_NO_SUCH_FUNCTION, "unknown function: %s", weft_strerror(st));
    weft_rref_release(r);

    int64_t t0 = now_ms();
    RANK_CHECK(weft_rref_remote(a, 1, "slow", NULL, 200, &r) == WEFT_OK, "remote slow");
    st = weft_rref_to_here(r, 5000, &v);
    RANK_CHECK(st == WEFT_ERR_TIMEOUT, "timed out: %s", weft_strerror(st));
    RANK_CHECK(strstr(weft_last_error(), "creation") != NULL, "text: %s", weft_last_error());
    RANK_CHECK(now_ms() - t0 < 4000, "reported at the deadline");
    weft_rref_release(r);
    /* Its answer comes late. */
    RANK_CHECK(weft_rpc_sync(a, 1, "open_gate", NULL, 10000, NULL) == WEFT_OK, "gate: %s",
               weft_last_error());

    /* to_here's own timeout while the creation runs */
    RANK_CHECK(weft_rref_remote(a, 1, "slow", NULL, 5000, &r) == WEFT_OK, "remote slow 2");
    st = weft_rref_to_here(r, 100, &v);
    RANK_CHECK(st == WEFT_ERR_TIMEOUT, "to_here timeout: %s", weft_strerror(st));
    RANK_CHECK(weft_rpc_sync(a, 1, "open_gate", NULL, 10000, NULL) == WEFT_OK, "gate: %s",
               weft_last_error());
    st = weft_rref_to_here(r, 5000, &v);
    RANK_CHECK(st == WEFT_OK && payload_is(v, "late"), "later: %s", weft_last_error());
    weft_value_free(v);
    weft_rref_release(r);

    /* bad arguments */
    RANK_CHECK(weft_rref_remote(a, 7, "make", NULL, 0, &r) == WEFT_ERR_INVALID_ARG, "bad rank");
    RANK_CHECK(weft_rref_remote(a, 1, "", NULL, 0, &r) == WEFT_ERR_INVALID_ARG, "no name");
    RANK_CHECK(weft_rref_to_here(NULL, 0, &v) == WEFT_ERR_INVALID_ARG, "NULL");

    /* The owner frees everything, the timed-out one included. */
    RANK_CHECK(wait_settled(a, 1, 4), "rank 1");
    RANK_CHECK(wait_settled(a, 0, 0), "rank 0");
    return 0;
}

Test(rref, creation_failures_reported_on_first_use, .timeout = 60)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_creation_fails);
    o.setup = setup;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ------------------------------------------------- pipelined uses (reordered) */

/*
 * Uses issued right after remote() go at once, behind the creation; with creation calls delayed
 * (WEFT_RREF_FAULT_DELAY_US) they reach the owner first, are answered "not yet" and go again once
 * the creation's answer is here. Values must be the right ones and failed creations must report
 * their own status and text.
 */
static int body_pipelined(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    weft_value_t *v = NULL;
    weft_status_t st;
    size_t len;

    if (rank != 0) {
        return 0;
    }
    for (int64_t i = 0; i < 40; i++) {
        weft_value_t *args;
        weft_value_create(&args);
        weft_value_set_payload(args, &i, sizeof(i));
        weft_rref_t *r;
        RANK_CHECK(weft_rref_remote(a, 1, "echo", args, 5000, &r) == WEFT_OK, "remote %lld",
                   (long long)i);
        weft_value_free(args);
        st = weft_rref_to_here(r, 5000, &v);
        RANK_CHECK(st == WEFT_OK, "to_here %lld: %s", (long long)i, weft_last_error());
        const int64_t *p = weft_value_payload(v, &len);
        RANK_CHECK(len == sizeof(i) && *p == i, "value %lld", (long long)i);
        weft_value_free(v);
        RANK_CHECK(weft_rref_confirmed_by_owner(r), "confirmed after to_here");
        weft_rref_release(r);
    }
    /* several fetches in flight before the creation's answer */
    weft_rref_t *r;
    weft_future_t *fs[4];
    RANK_CHECK(weft_rref_remote(a, 1, "make", NULL, 5000, &r) == WEFT_OK, "remote make");
    for (int k = 0; k < 4; k++) {
        RANK_CHECK(weft_rref_to_here_async(r, 5000, &fs[k]) == WEFT_OK, "to_here_async");
    }
    for (int k = 0; k < 4; k++) {
        RANK_CHECK(weft_future_wait(fs[k], 5000) == WEFT_OK && is_hello(weft_future_value(fs[k])),
                   "fetch %d: %s", k, weft_future_error(fs[k]));
        weft_future_release(fs[k]);
    }
    weft_rref_release(r);
    /* a method call right after remote_object */
    weft_value_t *init;
    weft_value_create(&init);
    int64_t n = 5;
    weft_value_set_payload(init, &n, sizeof(n));
    RANK_CHECK(weft_rref_remote_object(a, 1, "counter", init, 5000, &r) == WEFT_OK, "object");
    st = weft_rref_rpc_sync(r, "add", init, 5000, &v);
    RANK_CHECK(st == WEFT_OK && *(const int64_t *)weft_value_payload(v, &len) == 10, "add: %s",
               weft_last_error());
    weft_value_free(v);
    weft_value_free(init);
    weft_rref_release(r);
    /* failed creations, seen through a pipelined to_here and method call */
    for (int k = 0; k < 5; k++) {
        RANK_CHECK(weft_rref_remote(a, 1, "fail", NULL, 5000, &r) == WEFT_OK, "remote fail");
        st = weft_rref_to_here(r, 5000, &v);
        RANK_CHECK(st == WEFT_ERR_INVALID_ARG, "function error: %s", weft_strerror(st));
        RANK_CHECK(strstr(weft_last_error(), "bad input x") != NULL &&
                       strstr(weft_last_error(), "creation by 'fail'") != NULL,
                   "text: %s", weft_last_error());
        RANK_CHECK(weft_rref_to_here(r, 5000, &v) == WEFT_ERR_INVALID_ARG, "again");
        weft_rref_release(r);
        RANK_CHECK(weft_rref_remote_object(a, 1, "broken", NULL, 5000, &r) == WEFT_OK, "broken");
        st = weft_rref_rpc_sync(r, "get", NULL, 5000, &v);
        RANK_CHECK(st == WEFT_ERR_INVALID_ARG, "failing constructor: %s", weft_strerror(st));
        RANK_CHECK(strstr(weft_last_error(), "constructor of 'broken'") != NULL, "text: %s",
                   weft_last_error());
        weft_rref_release(r);
    }
    RANK_CHECK(weft_rref_remote(a, 1, "no_such_fn", NULL, 5000, &r) == WEFT_OK, "remote nope");
    st = weft_rref_to_here(r, 5000, &v);
    RANK_CHECK(st == WEFT_ERR_NO_SUCH_FUNCTION, "unknown function: %s", weft_strerror(st));
    weft_rref_release(r);
    /* the owner frees everything; nothing is left pending here */
    RANK_CHECK(wait_settled(a, 1, 40 + 1 + 1 + 10 + 1), "rank 1");
    RANK_CHECK(wait_settled(a, 0, 0), "rank 0");
    return 0;
}

Test(rref, pipelined_uses_reordered, .timeout = 120)
{
    ranks_opts_t o;
    int codes[2];
    setenv("WEFT_RREF_FAULT_DELAY_US", "3000", 1);
    ranks_opts_init(&o, 2, body_pipelined);
    o.setup = setup;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* The same without fault injection: the uses follow the creation on the connection. */
Test(rref, pipelined_uses, .timeout = 120)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_pipelined);
    o.setup = setup;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ---------------------------------------------- values with the creation's answer */

/* @p n payload bytes and a tensor of @p numel floats (none if 0), from @p seed. */
static weft_value_t *pattern_value(size_t n, int64_t numel, int seed)
{
    weft_value_t *v;
    weft_value_create(&v);
    if (n > 0) {
        uint8_t *b = malloc(n);
        for (size_t i = 0; i < n; i++) {
            b[i] = (uint8_t)(seed + 7 * i);
        }
        weft_value_set_payload(v, b, n);
        free(b);
    }
    if (numel > 0) {
        weft_value_push_tensor(v, tensor_f32_range(numel, (float)seed));
    }
    return v;
}

static int is_pattern(const weft_value_t *v, size_t n, int64_t numel, int seed)
{
    size_t len = 0;
    const uint8_t *b = weft_value_payload(v, &len);
    if (len != n || weft_value_num_tensors(v) != (numel > 0 ? 1u : 0u)) {
        return 0;
    }
    for (size_t i = 0; i < n; i++) {
        if (b[i] != (uint8_t)(seed + 7 * i)) {
            return 0;
        }
    }
    if (numel > 0) {
        weft_tensor_t *t = weft_value_tensor(v, 0);
        const float *f = weft_tensor_data(t);
        if (weft_tensor_numel(t) != numel || f[0] != (float)seed ||
            f[numel - 1] != (float)seed + (float)(numel - 1)) {
            return 0;
        }
    }
    return 1;
}

static int64_t counter_of(weft_agent_t *a, int rank, const char *key)
{
    char *json = debug_of(a, rank);
    int64_t n = json != NULL ? json_int(json, key) : -1;
    weft_free(json);
    return n;
}

/*
 * remote("gated_echo") of a pattern value on rank 1, then to_here issued before the creation's
 * answer (the creation waits for the gate); checks the value and that it came with the answer
 * (@p eager) or by a fetch. The reference goes to @p r_p, or is released if NULL. 0 when so.
 */
static int gated_remote_to_here(weft_agent_t *a, size_t n, int64_t numel, int seed, int eager,
                                weft_rref_t **r_p)
{
    int64_t fetched = counter_of(a, 1, "fetches_served");
    int64_t sent = counter_of(a, 1, "values_sent_with_creation");
    weft_value_t *args = pattern_value(n, numel, seed);
    weft_rref_t *r;
    RANK_CHECK(weft_rref_remote(a, 1, "gated_echo", args, 5000, &r) == WEFT_OK, "remote %d", seed);
    weft_value_free(args);
    weft_future_t *f;
    RANK_CHECK(weft_rref_to_here_async(r, 5000, &f) == WEFT_OK, "to_here %d", seed);
    RANK_CHECK(weft_rpc_sync(a, 1, "open_gate", NULL, 10000, NULL) == WEFT_OK, "gate: %s",
               weft_last_error());
    RANK_CHECK(weft_future_wait(f, 5000) == WEFT_OK, "to_here %d: %s", seed, weft_future_error(f));
    RANK_CHECK(is_pattern(weft_future_value(f), n, numel, seed), "value %d", seed);
    weft_future_release(f);
    RANK_CHECK(counter_of(a, 1, "values_sent_with_creation") == sent + eager,
               "case %d: value with the creation", seed);
    RANK_CHECK(counter_of(a, 1, "fetches_served") == fetched + !eager, "case %d: fetches", seed);
    if (r_p != NULL) {
        *r_p = r;
    } else {
        weft_rref_release(r);
    }
    return 0;
}

/*
 * With WEFT_RREF_EAGER_BYTES=256 (arg: 1) a plain value of at most 256 bytes (payload and tensors)
 * comes with the creation's answer: a to_here issued before that answer sends no fetch; larger
 * values, values with references and references already shared are fetched; later uses fetch.
 * Each creation waits for a gate, so that the use is issued before the creation's answer.
 * With WEFT_RREF_EAGER_BYTES=0 (arg: 0) every to_here fetches.
 */
static int body_eager(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    int on = *(const int *)arg;
    weft_value_t *v = NULL;
    weft_status_t st;

    if (rank != 0) {
        return 0;
    }
    static const struct {
        size_t n;
        int64_t numel;
        int fits;
    } cases[] = {{0, 0, 1},  {200, 0, 1}, {256, 0, 1},     {257, 0, 0},
                 {8, 62, 1}, {8, 63, 0},  {4096, 1024, 0}, {0, 64, 1}};
    for (int k = 0; k < (int)(sizeof(cases) / sizeof(cases[0])); k++) {
        int eager = on && cases[k].fits;
        weft_rref_t *r;
        if (gated_remote_to_here(a, cases[k].n, cases[k].numel, k, eager, &r) != 0) {
            return 1;
        }
        int64_t fetched = counter_of(a, 1, "fetches_served");
        /* A use after the answer fetches what the owner holds. */
        st = weft_rref_to_here(r, 5000, &v);
        RANK_CHECK(st == WEFT_OK && is_pattern(v, cases[k].n, cases[k].numel, k), "again %d: %s", k,
                   weft_last_error());
        weft_value_free(v);
        RANK_CHECK(counter_of(a, 1, "fetches_served") == fetched + 1, "case %d: fetch", k);
        weft_rref_release(r);
    }

    /* A value holding a reference is fetched (its fork is made for this worker). */
    int64_t fetched = counter_of(a, 1, "fetches_served");
    weft_rref_t *r;
    RANK_CHECK(weft_rref_remote(a, 1, "return_rref", NULL, 5000, &r) == WEFT_OK, "return_rref");
    st = weft_rref_to_here(r, 5000, &v);
    RANK_CHECK(st == WEFT_OK, "to_here of a value with a reference: %s", weft_last_error());
    RANK_CHECK(counter_of(a, 1, "fetches_served") == fetched + 1, "fetched");
    weft_value_t *inner = NULL;
    st = weft_rref_to_here(weft_value_rref(v, 0), 5000, &inner);
    RANK_CHECK(st == WEFT_OK && payload_is(inner, "owned"), "the reference inside: %s",
               weft_last_error());
    weft_value_free(inner);
    weft_value_free(v);
    weft_rref_release(r);

    /* A reference shared before its use is fetched, whenever the creation's answer comes. */
    fetched = counter_of(a, 1, "fetches_served");
    weft_value_t *args = pattern_value(16, 0, 3);
    RANK_CHECK(weft_rref_remote(a, 1, "echo", args, 5000, &r) == WEFT_OK, "remote");
    weft_value_free(args);
    weft_value_t *share = value_with_rref(r, 0);
    weft_future_t *kept;
    RANK_CHECK(weft_rpc_async(a, 2, "keep_rref", share, 5000, &kept) == WEFT_OK, "share");
    weft_value_free(share);
    st = weft_rref_to_here(r, 5000, &v);
    RANK_CHECK(st == WEFT_OK && is_pattern(v, 16, 0, 3), "to_here of a shared one: %s",
               weft_last_error());
    weft_value_free(v);
    RANK_CHECK(counter_of(a, 1, "fetches_served") == fetched + 1, "shared: fetched");
    RANK_CHECK(weft_future_wait(kept, 5000) == WEFT_OK, "kept: %s", weft_future_error(kept));
    weft_future_release(kept);
    RANK_CHECK(weft_rpc_sync(a, 2, "drop_rref", NULL, 5000, NULL) == WEFT_OK, "drop");
    weft_rref_release(r);

    /* A to_here with a shorter deadline than a slow creation ends at its own deadline. */
    RANK_CHECK(weft_rref_remote(a, 1, "slow", NULL, 5000, &r) == WEFT_OK, "remote slow");
    st = weft_rref_to_here(r, 100, &v);
    RANK_CHECK(st == WEFT_ERR_TIMEOUT, "short to_here: %s", weft_strerror(st));
    RANK_CHECK(weft_rpc_sync(a, 1, "open_gate", NULL, 10000, NULL) == WEFT_OK, "gate: %s",
               weft_last_error());
    st = weft_rref_to_here(r, 5000, &v);
    RANK_CHECK(st == WEFT_OK && payload_is(v, "late"), "to_here after: %s", weft_last_error());
    weft_value_free(v);
    weft_rref_release(r);

    int64_t n = (int64_t)(sizeof(cases) / sizeof(cases[0])) + 3 + 1;
    RANK_CHECK(wait_settled(a, 1, n), "rank 1");
    RANK_CHECK(wait_settled(a, 2, 0), "rank 2");
    RANK_CHECK(wait_settled(a, 0, 0), "rank 0");
    return 0;
}

/*
 * A reference sent home at once: the call carrying it to its owner follows its creation on the
 * stream, but the owner runs them on different handler threads, so the call may be decoded before
 * the creation made the owner entry (found by the chaos runs). It must wait for the creation, not
 * be refused as a reference already deleted.
 */
static int body_home_at_once(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        return 0;
    }
    for (int i = 0; i < 200; i++) {
        weft_rref_t *r = NULL;
        RANK_CHECK(weft_rref_remote(a, 1, "make", NULL, 20000, &r) == WEFT_OK, "remote: %s",
                   weft_last_error());
        weft_value_t *v = NULL, *out = NULL;
        RANK_CHECK(weft_value_create(&v) == WEFT_OK && weft_value_add_rref(v, r) == WEFT_OK, "v");
        weft_status_t st = weft_rpc_sync(a, 1, "take_rref_sync", v, 20000, &out);
        RANK_CHECK(st == WEFT_OK, "round %d: the owner refused its own reference: %s: %s", i,
                   weft_strerror(st), weft_last_error());
        const weft_tensor_t *t = weft_value_tensor(out, 0);
        RANK_CHECK(t != NULL && weft_tensor_numel(t) == 4 &&
                       ((const float *)weft_tensor_data(t))[3] == 4.0f,
                   "round %d: wrong value", i);
        weft_value_free(out);
        weft_value_free(v);
        weft_rref_release(r);
    }
    return 0;
}

Test(rref, a_reference_sent_home_at_once_waits_for_its_creation, .timeout = 120)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_home_at_once);
    o.setup = setup;
    o.handler_threads = 4;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

Test(rref, small_values_come_with_the_creation, .timeout = 60)
{
    ranks_opts_t o;
    int codes[3];
    static int on = 1;
    setenv("WEFT_RREF_EAGER_BYTES", "256", 1);
    ranks_opts_init(&o, 3, body_eager);
    o.setup = setup;
    o.arg = &on;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/*
 * Under a message limit of 8 KiB the values that come with the creation's answer are capped at
 * the limit less 4 KiB of room (WEFT_RREF_EAGER_BYTES left at its default, 64 KiB): 3000 bytes
 * come along, 5000 bytes are fetched.
 */
static int body_eager_limit(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        return 0;
    }
    static const struct {
        size_t n;
        int eager;
    } cases[] = {{3000, 1}, {5000, 0}};
    for (int k = 0; k < 2; k++) {
        if (gated_remote_to_here(a, cases[k].n, 0, k, cases[k].eager, NULL) != 0) {
            return 1;
        }
    }
    RANK_CHECK(wait_settled(a, 1, 2), "rank 1");
    return 0;
}

Test(rref, small_values_within_the_message_limit, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    unsetenv("WEFT_RREF_EAGER_BYTES");
    ranks_opts_init(&o, 2, body_eager_limit);
    o.setup = setup;
    o.max_message_bytes = 8192;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

Test(rref, small_values_fetched_when_turned_off, .timeout = 60)
{
    ranks_opts_t o;
    int codes[3];
    static int off = 0;
    setenv("WEFT_RREF_EAGER_BYTES", "0", 1);
    ranks_opts_init(&o, 3, body_eager);
    o.setup = setup;
    o.arg = &off;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ------------------------------------------------------------ owner lost */

static int body_owner_lost(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    weft_value_t *v = NULL;
    weft_status_t st;

    if (rank != 0) {
        return 0; /* rank 1 dies in "die" */
    }
    weft_rref_t *r, *pending;
    RANK_CHECK(weft_rref_remote(a, 1, "make", NULL, 5000, &r) == WEFT_OK, "remote");
    st = weft_rref_to_here(r, 5000, &v);
    RANK_CHECK(st == WEFT_OK, "to_here: %s", weft_last_error());
    weft_value_free(v);
    RANK_CHECK(weft_rref_remote(a, 1, "slow", NULL, 20000, &pending) == WEFT_OK, "pending");
    weft_future_t *f;
    RANK_CHECK(weft_rref_to_here_async(pending, 20000, &f) == WEFT_OK, "to_here pending");
    st = weft_rpc_sync(a, 1, "die", NULL, 10000, NULL);
    RANK_CHECK(st == WEFT_ERR_PEER_LOST, "die: %s", weft_strerror(st));
    RANK_CHECK(weft_future_wait(f, 10000) == WEFT_ERR_OWNER_LOST, "pending op: %s",
               weft_future_error(f));
    weft_future_release(f);
    st = weft_rref_to_here(r, 5000, &v);
    RANK_CHECK(st == WEFT_ERR_OWNER_LOST, "later op: %s", weft_strerror(st));
    st = weft_rref_to_here(pending, 5000, &v);
    RANK_CHECK(st == WEFT_ERR_OWNER_LOST, "later op, pending one: %s", weft_strerror(st));
    st = weft_rref_rpc_sync(r, "get", NULL, 5000, &v);
    RANK_CHECK(st == WEFT_ERR_OWNER_LOST || st == WEFT_ERR_UNSUPPORTED, "method: %s",
               weft_strerror(st));
    weft_value_t *args = value_with_rref(r, 0);
    st = weft_rpc_sync(a, 2, "take_rref", args, 5000, &v);
    RANK_CHECK(st == WEFT_ERR_OWNER_LOST, "sharing it: %s", weft_strerror(st));
    weft_value_free(args);
    weft_rref_release(r);
    weft_rref_release(pending);
    RANK_CHECK(wait_settled(a, 0, 0), "rank 0");
    RANK_CHECK(wait_settled(a, 2, 0), "rank 2");
    return 0;
}

Test(rref, owner_killed_fails_pending_and_later_ops, .timeout = 60)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_owner_lost);
    o.setup = setup;
    ranks_run(&o, codes);
    cr_assert_eq(codes[0], 0);
    cr_assert_eq(codes[1], 128 + SIGKILL);
    cr_assert_eq(codes[2], 0);
}

/* ------------------------------------------------------------- user lost */

static int body_user_lost(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;

    if (rank == 1) {
        /* Stays out of shutdown (which would release what it holds) until "die" kills it: the
         * scenario, not a wait for something to happen; past 40 s the rank fails. */
        for (int64_t until = now_ms() + 40000; now_ms() < until;) {
            usleep(10000);
        }
        return 1;
    }
    if (rank != 0) {
        return 0;
    }
    weft_rref_t *r;
    RANK_CHECK(weft_rref_create(a, value_of_string("v"), &r) == WEFT_OK, "create");
    weft_value_t *args = value_with_rref(r, 0);
    RANK_CHECK(weft_rpc_sync(a, 1, "keep_rref", args, 5000, NULL) == WEFT_OK, "keep: %s",
               weft_last_error());
    weft_value_free(args);
    /* rank 1 also makes one owned here and keeps it */
    RANK_CHECK(weft_rpc_sync(a, 1, "remote_keep", NULL, 5000, NULL) == WEFT_OK, "remote_keep: %s",
               weft_last_error());
    weft_rref_release(r);
    int64_t until = now_ms() + WAIT_MS;
    char *json = NULL;
    for (;;) {
        json = debug_of(a, 0);
        if (json_int(json, "owners") == 2 && json_int(json, "forks") == 2) {
            break;
        }
        RANK_CHECK(now_ms() < until, "two owners held by rank 1: %s", json);
        weft_free(json);
        usleep(10000);
    }
    weft_free(json);
    RANK_CHECK(weft_rpc_sync(a, 1, "die", NULL, 10000, NULL) == WEFT_ERR_PEER_LOST, "die");
    RANK_CHECK(wait_settled(a, 0, 2), "rank 0 dropped the dead user's forks");
    return 0;
}

Test(rref, user_killed_owner_frees, .timeout = 60)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_user_lost);
    o.setup = setup;
    ranks_run(&o, codes);
    cr_assert_eq(codes[0], 0);
    cr_assert_eq(codes[1], 128 + SIGKILL);
    cr_assert_eq(codes[2], 0);
}

/* --------------------------------------------------------- shutdown leaks */

/* Rank 2's first shutdown listener (its module is made before rref's) opens rank 0's gate: the
 * "slow" creation is answered after rank 2's shutdown has begun, while rref's listener waits. */
static weft_status_t opener_create(weft_agent_t *a, void **state_p)
{
    *state_p = a;
    return WEFT_OK;
}

static weft_status_t opener_shutdown(void *state, int64_t deadline_ms)
{
    (void)deadline_ms;
    return weft_rpc_sync(state, 0, "open_gate", NULL, 10000, NULL);
}

static const weft_module_desc_t opener = {
    .name = "opener", .channel = 64, .create = opener_create, .on_shutdown = opener_shutdown};

static void leaks_setup(weft_agent_t *a, int rank, void *arg)
{
    void *state;
    if (rank == 2 && weft_agent_module(a, &opener, &state) != WEFT_OK) {
        abort();
    }
    setup(a, rank, arg);
}

static int body_leaks(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    weft_rref_t *r = NULL;
    weft_value_t *v = NULL;

    if (rank == 1) {
        /* Never released by the program: reported and released at shutdown. */
        RANK_CHECK(weft_rref_remote(a, 0, "make", NULL, 5000, &r) == WEFT_OK, "remote");
        RANK_CHECK(weft_rref_to_here(r, 5000, &v) == WEFT_OK, "to_here");
        weft_value_free(v);
    }
    if (rank == 2) {
        /* Still unconfirmed when shutdown starts: shutdown waits for it. */
        RANK_CHECK(weft_rref_remote(a, 0, "slow", NULL, 5000, &r) == WEFT_OK, "remote slow");
    }
    weft_status_t st = weft_agent_shutdown(a, 20000);
    RANK_CHECK(st == WEFT_OK, "shutdown: %s", weft_last_error());
    char *json = debug_of(a, rank);
    RANK_CHECK(json != NULL, "debug after shutdown");
    if (rank == 0) {
        RANK_CHECK(json_int(json, "owners") == 0 && json_int(json, "deleted_owners") == 2,
                   "the owner freed both: %s", json);
    } else {
        RANK_CHECK(json_int(json, "leaks") == 1 && json_int(json, "users") == 0 &&
                       json_int(json, "pending_users") == 0,
                   "one leak reported: %s", json);
    }
    weft_free(json);
    /* The handle stays valid and inert. */
    RANK_CHECK(rank == 0 || weft_rref_owner(r) == 0, "handle");
    weft_rref_release(r);
    return 0;
}

Test(rref, shutdown_reports_and_releases_leaks, .timeout = 60)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_leaks);
    o.setup = leaks_setup;
    o.no_shutdown = 1;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* -------------------------------------------------------------- bad input */

static int body_bad_input(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    weft_value_t *v = NULL;
    weft_status_t st;

    if (rank != 0) {
        return 0;
    }
    /* Garbage on the control channel is dropped; the owner keeps working. */
    weft_value_t *junk = value_of_string("\xff\xff\xff garbage");
    RANK_CHECK(weft_agent_send(a, 1, WEFT_CHANNEL_RREF, junk, NULL) == WEFT_OK, "send junk");
    weft_value_free(junk);
    /* A control message with a bad id (worker 99, kind FORK_REQUEST) and an unknown kind. */
    static const uint8_t bad_fork[] = {0x08, 0x01, 0x10, 0x07, 0x1a, 0x04, 0x08, 0x63, 0x10, 0x01};
    static const uint8_t bad_kind[] = {0x08, 0x2a, 0x10, 0x08};
    weft_value_create(&junk);
    weft_value_set_payload(junk, bad_fork, sizeof(bad_fork));
    RANK_CHECK(weft_agent_send(a, 1, WEFT_CHANNEL_RREF, junk, NULL) == WEFT_OK, "send bad fork");
    weft_value_set_payload(junk, bad_kind, sizeof(bad_kind));
    RANK_CHECK(weft_agent_send(a, 1, WEFT_CHANNEL_RREF, junk, NULL) == WEFT_OK, "send bad kind");
    weft_value_free(junk);
    /* The owner's functions called directly with bad headers */
    junk = value_of_string("xx");
    st = weft_rpc_sync(a, 1, "weft.rref.fetch", junk, 5000, &v);
    RANK_CHECK(st == WEFT_ERR_PROTOCOL, "fetch with junk: %s", weft_strerror(st));
    st = weft_rpc_sync(a, 1, "weft.rref.remote", junk, 5000, &v);
    RANK_CHECK(st == WEFT_ERR_PROTOCOL, "remote with junk: %s", weft_strerror(st));
    st = weft_rpc_sync(a, 1, "weft.rref.method", NULL, 5000, &v);
    RANK_CHECK(st == WEFT_ERR_PROTOCOL, "method without header: %s", weft_strerror(st));
    weft_value_free(junk);
    /* fetch of an id the owner never had: header {rref_id {worker 0, local 57}} */
    static const uint8_t hdr[] = {0x06, 0x00, 0x00, 0x00, 0x0a, 0x04, 0x08, 0x00, 0x10, 0x39};
    weft_value_create(&junk);
    weft_value_set_payload(junk, hdr, sizeof(hdr));
    st = weft_rpc_sync(a, 1, "weft.rref.fetch", junk, 5000, &v);
    RANK_CHECK(st == WEFT_ERR_NOT_FOUND, "unknown id: %s: %s", weft_strerror(st),
               weft_last_error());
    weft_value_free(junk);
    /* Still working */
    weft_rref_t *r;
    RANK_CHECK(weft_rref_remote(a, 1, "make", NULL, 5000, &r) == WEFT_OK, "remote");
    st = weft_rref_to_here(r, 5000, &v);
    RANK_CHECK(st == WEFT_OK && is_hello(v), "after bad input: %s", weft_last_error());
    weft_value_free(v);
    weft_rref_release(r);
    /* Argument checks */
    RANK_CHECK(weft_rref_register_type(a, "counter", counter_ctor, NULL, NULL, 0, NULL) ==
                   WEFT_ERR_ALREADY_EXISTS,
               "type twice");
    RANK_CHECK(weft_rref_register_type(a, "", counter_ctor, NULL, NULL, 0, NULL) ==
                   WEFT_ERR_INVALID_ARG,
               "no name");
    RANK_CHECK(weft_rref_rpc_sync(NULL, "get", NULL, 0, &v) == WEFT_ERR_INVALID_ARG, "NULL ref");
    char *json;
    RANK_CHECK(weft_rref_debug_info(a, &json) == WEFT_OK, "debug_info");
    static const char *keys[] = {"owners", "users",           "pending_users",  "pending_children",
                                 "forks",  "confirmed_users", "deleted_owners", "leaks"};
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
        RANK_CHECK(json_int(json, keys[i]) >= 0, "key %s in %s", keys[i], json);
    }
    RANK_CHECK(json[0] == '{' && json[strlen(json) - 1] == '}', "JSON object: %s", json);
    weft_free(json);
    RANK_CHECK(wait_settled(a, 1, 1), "rank 1");
    return 0;
}

Test(rref, bad_input, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_bad_input);
    o.setup = setup;
    cr_assert_eq(ranks_run(&o, codes), 0);
}
