/* RRef deadlines and timed work: control messages and timeouts of 0 follow the agent's default
 * call timeout (weft_agent_call_timeout_ms, set here through opts.default_timeout_ms); negative
 * timeouts are refused; an agent freed while the timer holds rref work drops it cleanly. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ranks.h"

/* ------------------------------------------------- control messages' deadline */

/*
 * Rank 2 is a peer that speaks the reference codec (kind 1) without the rref module: its codec
 * sends rank 0 a fork of reference (1,5), owned by rank 1, as a fork from user 2. Rank 0 asks the
 * owner (FORK_REQUEST); rank 1 has no rref module and never acknowledges. The request carrying
 * the fork then fails when rank 0's control message passes its deadline, which is the agent's
 * default call timeout (1000 ms here), not 60 s nor the call's own 20 s.
 */
static const uint8_t fake_fork[] = {
    0x0a, 0x04, 0x08, 0x01, 0x10, 0x05, /* rref_id {worker 1, local 5} */
    0x12, 0x04, 0x08, 0x02, 0x10, 0x07, /* fork_id {worker 2, local 7} */
    0x18, 0x01,                         /* owner 1 */
    0x20, 0x02,                         /* parent 2 (the sender) */
    0x32, 0x04, 'f',  'a',  'k',  'e',  /* created_by "fake" */
};

static void fake_retain(void *obj)
{
    (void)obj;
}

static void fake_release(void *obj)
{
    (void)obj;
}

static const weft_value_ref_type_t fake_type = {WEFT_REF_KIND_RREF, fake_retain, fake_release};

static weft_status_t fake_encode(void *state, weft_agent_t *a, int to, void *obj, void **bytes_p,
                                 size_t *len_p)
{
    (void)state;
    (void)a;
    (void)to;
    (void)obj;
    void *b = weft_alloc(sizeof(fake_fork));
    if (b == NULL) {
        return WEFT_ERR_NO_MEMORY;
    }
    memcpy(b, fake_fork, sizeof(fake_fork));
    *bytes_p = b;
    *len_p = sizeof(fake_fork);
    return WEFT_OK;
}

static weft_status_t fake_decode(void *state, weft_agent_t *a, int src, const void *bytes,
                                 size_t len, void **obj_p, weft_future_t **ready_p)
{
    (void)state;
    (void)a;
    (void)src;
    (void)bytes;
    (void)len;
    (void)obj_p;
    (void)ready_p;
    return WEFT_ERR_PROTOCOL;
}

static const weft_ref_codec_t fake_codec = {fake_encode, NULL, fake_decode, &fake_type};

static int g_fake_state;

static weft_status_t fake_create(weft_agent_t *a, void **state_p)
{
    (void)a;
    *state_p = &g_fake_state;
    return WEFT_OK;
}

static const weft_module_desc_t fake_module = {
    .name = "fake_rref",
    .channel = 64,
    .create = fake_create,
    .codec = &fake_codec,
};

static void fn_take(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, NULL);
}

static void setup_ctl(weft_agent_t *a, int rank, void *arg)
{
    (void)arg;
    void *state;
    if (rank == 0) {
        if (weft_rref_init(a) != WEFT_OK ||
            weft_rpc_register(a, "take", fn_take, NULL) != WEFT_OK) {
            abort();
        }
    } else if (rank == 2 && weft_agent_module(a, &fake_module, &state) != WEFT_OK) {
        abort();
    }
    /* rank 1: no rref module, so the owner never acknowledges */
}

static int body_ctl_deadline(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 2) {
        return 0;
    }
    RANK_CHECK(weft_agent_call_timeout_ms(a) == 1000, "default timeout %lld",
               (long long)weft_agent_call_timeout_ms(a));
    weft_value_t *v;
    weft_value_create(&v);
    int dummy = 0;
    RANK_CHECK(weft_value_add_ref(v, &fake_type, &dummy) == WEFT_OK, "add_ref");
    int64_t t0 = now_ms();
    weft_status_t st = weft_rpc_sync(a, 0, "take", v, 20000, NULL);
    int64_t took = now_ms() - t0;
    weft_value_free(v);
    RANK_CHECK(st == WEFT_ERR_TIMEOUT, "the fork's confirmation timed out: %s: %s",
               weft_strerror(st), weft_last_error());
    RANK_CHECK(strstr(weft_last_error(), "not acknowledged within 1000 ms") != NULL, "text: %s",
               weft_last_error());
    RANK_CHECK(took >= 900 && took < 3000, "failed at the default deadline: after %lld ms",
               (long long)took);
    return 0;
}

Test(rref_timeouts, control_messages_follow_the_agents_default_timeout, .timeout = 60)
{
    ranks_opts_t o;
    int codes[3];
    unsetenv("WEFT_RPC_TIMEOUT_MS");
    ranks_opts_init(&o, 3, body_ctl_deadline);
    o.setup = setup_ctl;
    o.call_timeout_ms = 1000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ------------------------------------------------- timeouts of 0 and negative ones */

/* "gated" (a function) and method "hold" of type "box" answer only when "open_gate" is called:
 * one call at a time waits at the gate of its rank. */
static pthread_mutex_t g_gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_gate_cv = PTHREAD_COND_INITIALIZER;
static weft_call_t *g_gated;

static void gate_hold(weft_call_t *call)
{
    pthread_mutex_lock(&g_gate_mu);
    g_gated = call;
    pthread_cond_broadcast(&g_gate_cv);
    pthread_mutex_unlock(&g_gate_mu);
}

static void fn_gated(weft_call_t *call, void *arg)
{
    (void)arg;
    gate_hold(call);
}

/* Answers the call waiting at the gate ("opened"), waiting up to 5 s for one to come. */
static void fn_open_gate(weft_call_t *call, void *arg)
{
    (void)arg;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 5;
    pthread_mutex_lock(&g_gate_mu);
    while (g_gated == NULL) {
        if (pthread_cond_timedwait(&g_gate_cv, &g_gate_mu, &ts) != 0) {
            break;
        }
    }
    weft_call_t *gated = g_gated;
    g_gated = NULL;
    pthread_mutex_unlock(&g_gate_mu);
    if (gated == NULL) {
        weft_call_fail(call, WEFT_ERR_TIMEOUT, "no call came to the gate");
        return;
    }
    weft_call_reply(gated, value_of_string("opened"));
    weft_call_reply(call, NULL);
}

static void fn_make_value(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, value_of_string("value"));
}

static weft_status_t box_ctor(const weft_value_t *args, void *type_arg, void **obj_p)
{
    (void)args;
    (void)type_arg;
    int *box = malloc(sizeof(int));
    *box = 7;
    *obj_p = box;
    return WEFT_OK;
}

static void box_dtor(void *obj, void *type_arg)
{
    (void)type_arg;
    free(obj);
}

static void box_get(void *obj, weft_call_t *call, void *type_arg)
{
    (void)obj;
    (void)type_arg;
    weft_call_reply(call, value_of_string("box"));
}

static void box_hold(void *obj, weft_call_t *call, void *type_arg)
{
    (void)obj;
    (void)type_arg;
    gate_hold(call);
}

static void setup_zero(weft_agent_t *a, int rank, void *arg)
{
    (void)rank;
    (void)arg;
    static const weft_rref_method_t methods[] = {{"get", box_get}, {"hold", box_hold}};
    if (weft_rref_init(a) != WEFT_OK ||
        weft_rref_register_type(a, "box", box_ctor, box_dtor, methods, 2, NULL) != WEFT_OK ||
        weft_rpc_register(a, "make", fn_make_value, NULL) != WEFT_OK ||
        weft_rpc_register(a, "gated", fn_gated, NULL) != WEFT_OK ||
        weft_rpc_register(a, "open_gate", fn_open_gate, NULL) != WEFT_OK) {
        abort();
    }
}

static int payload_is(const weft_value_t *v, const char *s)
{
    size_t len;
    const char *p = weft_value_payload(v, &len);
    return p != NULL && len == strlen(s) && memcmp(p, s, len) == 0;
}

/* Took about the agent's default of 300 ms (not 0, not a far deadline). */
#define AT_DEFAULT(ms) ((ms) >= 250 && (ms) < 2500)

/*
 * With an agent whose default call timeout is 300 ms, every rref function given a timeout of 0
 * waits that long: remote() and remote_method() (the creation's deadline), to_here, a method
 * call, local_value. What waits is held at a gate, opened afterwards.
 */
static int body_zero(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    weft_value_t *v = NULL;
    weft_status_t st;
    int64_t t0, took;

    if (rank != 0) {
        return 0;
    }
    RANK_CHECK(weft_agent_call_timeout_ms(a) == 300, "default %lld",
               (long long)weft_agent_call_timeout_ms(a));
    /* remote(): the creation's own deadline */
    weft_rref_t *r;
    t0 = now_ms();
    RANK_CHECK(weft_rref_remote(a, 1, "gated", NULL, 0, &r) == WEFT_OK, "remote: %s",
               weft_last_error());
    st = weft_rref_to_here(r, 10000, &v);
    took = now_ms() - t0;
    RANK_CHECK(st == WEFT_ERR_TIMEOUT && strstr(weft_last_error(), "creation") != NULL,
               "remote, 0: the creation timed out: %s: %s", weft_strerror(st), weft_last_error());
    RANK_CHECK(AT_DEFAULT(took), "remote, 0: after %lld ms", (long long)took);
    weft_rref_release(r);
    RANK_CHECK(weft_rpc_sync(a, 1, "open_gate", NULL, 10000, NULL) == WEFT_OK, "open: %s",
               weft_last_error());

    /* to_here: its own deadline while the creation waits */
    RANK_CHECK(weft_rref_remote(a, 1, "gated", NULL, 10000, &r) == WEFT_OK, "remote");
    t0 = now_ms();
    st = weft_rref_to_here(r, 0, &v);
    took = now_ms() - t0;
    RANK_CHECK(st == WEFT_ERR_TIMEOUT, "to_here, 0: %s", weft_strerror(st));
    RANK_CHECK(AT_DEFAULT(took), "to_here, 0: after %lld ms", (long long)took);
    RANK_CHECK(weft_rpc_sync(a, 1, "open_gate", NULL, 10000, NULL) == WEFT_OK, "open: %s",
               weft_last_error());
    st = weft_rref_to_here(r, 0, &v);
    RANK_CHECK(st == WEFT_OK && payload_is(v, "opened"), "to_here, 0, after: %s",
               weft_last_error());
    weft_value_free(v);
    weft_rref_release(r);

    /* a method call and remote_method() */
    weft_rref_t *box;
    RANK_CHECK(weft_rref_remote_object(a, 1, "box", NULL, 0, &box) == WEFT_OK, "box");
    st = weft_rref_rpc_sync(box, "get", NULL, 0, &v);
    RANK_CHECK(st == WEFT_OK && payload_is(v, "box"), "get, 0: %s", weft_last_error());
    weft_value_free(v);
    t0 = now_ms();
    st = weft_rref_rpc_sync(box, "hold", NULL, 0, &v);
    took = now_ms() - t0;
    RANK_CHECK(st == WEFT_ERR_TIMEOUT, "rpc_sync, 0: %s", weft_strerror(st));
    RANK_CHECK(AT_DEFAULT(took), "rpc_sync, 0: after %lld ms", (long long)took);
    RANK_CHECK(weft_rpc_sync(a, 1, "open_gate", NULL, 10000, NULL) == WEFT_OK, "open: %s",
               weft_last_error());
    weft_rref_t *held;
    t0 = now_ms();
    RANK_CHECK(weft_rref_remote_method(box, "hold", NULL, 0, &held) == WEFT_OK, "remote_method");
    st = weft_rref_to_here(held, 10000, &v);
    took = now_ms() - t0;
    RANK_CHECK(st == WEFT_ERR_TIMEOUT && strstr(weft_last_error(), "creation") != NULL,
               "remote_method, 0: %s: %s", weft_strerror(st), weft_last_error());
    RANK_CHECK(AT_DEFAULT(took), "remote_method, 0: after %lld ms", (long long)took);
    weft_rref_release(held);
    RANK_CHECK(weft_rpc_sync(a, 1, "open_gate", NULL, 10000, NULL) == WEFT_OK, "open: %s",
               weft_last_error());
    weft_rref_release(box);

    /* local_value: on the owner, while its creation waits at this rank's gate */
    weft_rref_t *mine;
    const weft_value_t *lv;
    RANK_CHECK(weft_rref_remote(a, 0, "gated", NULL, 10000, &mine) == WEFT_OK, "remote self");
    t0 = now_ms();
    st = weft_rref_local_value(mine, 0, &lv);
    took = now_ms() - t0;
    RANK_CHECK(st == WEFT_ERR_TIMEOUT, "local_value, 0: %s", weft_strerror(st));
    RANK_CHECK(AT_DEFAULT(took), "local_value, 0: after %lld ms", (long long)took);
    RANK_CHECK(weft_rpc_sync(a, 0, "open_gate", NULL, 10000, NULL) == WEFT_OK, "open: %s",
               weft_last_error());
    st = weft_rref_local_value(mine, 0, &lv);
    RANK_CHECK(st == WEFT_OK && payload_is(lv, "opened"), "local_value, 0, after: %s",
               weft_last_error());
    weft_rref_release(mine);
    return 0;
}

Test(rref_timeouts, zero_means_the_agents_default_timeout, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    unsetenv("WEFT_RPC_TIMEOUT_MS");
    ranks_opts_init(&o, 2, body_zero);
    o.setup = setup_zero;
    o.call_timeout_ms = 300;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* Every function with a timeout refuses a negative one, and starts nothing. */
static int body_negative(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 0) {
        return 0;
    }
    static const int64_t bad[] = {-1, -1000, INT64_MIN};
    weft_rref_t *u, *box, *mine, *mybox;
    RANK_CHECK(weft_rref_remote(a, 1, "make", NULL, 5000, &u) == WEFT_OK, "remote");
    RANK_CHECK(weft_rref_remote_object(a, 1, "box", NULL, 5000, &box) == WEFT_OK, "box");
    RANK_CHECK(weft_rref_remote(a, 0, "make", NULL, 5000, &mine) == WEFT_OK, "mine");
    RANK_CHECK(weft_rref_remote_object(a, 0, "box", NULL, 5000, &mybox) == WEFT_OK, "my box");
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int64_t t = bad[i];
        weft_rref_t *r = NULL;
        weft_value_t *v = NULL;
        weft_future_t *f = NULL;
        const weft_value_t *lv = NULL;
        void *obj = NULL;
        RANK_CHECK(weft_rref_remote(a, 1, "make", NULL, t, &r) == WEFT_ERR_INVALID_ARG && r == NULL,
                   "remote, %lld", (long long)t);
        RANK_CHECK(strstr(weft_last_error(), "timeout") != NULL, "text: %s", weft_last_error());
        RANK_CHECK(weft_rref_remote(a, 0, "make", NULL, t, &r) == WEFT_ERR_INVALID_ARG && r == NULL,
                   "remote to self, %lld", (long long)t);
        RANK_CHECK(weft_rref_remote_object(a, 1, "box", NULL, t, &r) == WEFT_ERR_INVALID_ARG &&
                       r == NULL,
                   "remote_object, %lld", (long long)t);
        RANK_CHECK(weft_rref_remote_method(box, "get", NULL, t, &r) == WEFT_ERR_INVALID_ARG &&
                       r == NULL,
                   "remote_method, %lld", (long long)t);
        RANK_CHECK(weft_rref_to_here(u, t, &v) == WEFT_ERR_INVALID_ARG && v == NULL,
                   "to_here, %lld", (long long)t);
        RANK_CHECK(weft_rref_to_here(mine, t, &v) == WEFT_ERR_INVALID_ARG && v == NULL,
                   "to_here on the owner, %lld", (long long)t);
        RANK_CHECK(weft_rref_to_here_async(u, t, &f) == WEFT_ERR_INVALID_ARG && f == NULL,
                   "to_here_async, %lld", (long long)t);
        RANK_CHECK(weft_rref_local_value(mine, t, &lv) == WEFT_ERR_INVALID_ARG && lv == NULL,
                   "local_value, %lld", (long long)t);
        RANK_CHECK(weft_rref_local_object(mybox, t, &obj) == WEFT_ERR_INVALID_ARG && obj == NULL,
                   "local_object, %lld", (long long)t);
        RANK_CHECK(weft_rref_rpc_sync(box, "get", NULL, t, &v) == WEFT_ERR_INVALID_ARG && v == NULL,
                   "rpc_sync, %lld", (long long)t);
        RANK_CHECK(weft_rref_rpc_async(box, "get", NULL, t, &f) == WEFT_ERR_INVALID_ARG &&
                       f == NULL,
                   "rpc_async, %lld", (long long)t);
    }
    /* Nothing was started: the two user references are all there is, and they work. */
    char *json = NULL;
    RANK_CHECK(weft_rref_debug_info(a, &json) == WEFT_OK, "debug_info");
    RANK_CHECK(strstr(json, "\"users\":2,") != NULL && strstr(json, "\"owners\":2,") != NULL,
               "no reference was made: %s", json);
    weft_free(json);
    weft_value_t *v = NULL;
    RANK_CHECK(weft_rref_to_here(u, 0, &v) == WEFT_OK && payload_is(v, "value"), "to_here: %s",
               weft_last_error());
    weft_value_free(v);
    RANK_CHECK(weft_rref_rpc_sync(box, "get", NULL, 0, &v) == WEFT_OK && payload_is(v, "box"),
               "rpc_sync: %s", weft_last_error());
    weft_value_free(v);
    void *obj = NULL;
    RANK_CHECK(weft_rref_local_object(mybox, 0, &obj) == WEFT_OK && *(int *)obj == 7,
               "local_object: %s", weft_last_error());
    weft_rref_release(u);
    weft_rref_release(box);
    weft_rref_release(mine);
    weft_rref_release(mybox);
    return 0;
}

Test(rref_timeouts, negative_timeouts_refused, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_negative);
    o.setup = setup_zero;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ------------------------------------------------- freed with timed work pending */

/*
 * Rank 0 frees its agent (no shutdown) while the agent's timer holds rref work: a remote() call
 * and control messages held back by fault injection (up to 600 s), a control message's retry and
 * a to_here's deadline. The kit drops them before the module is destroyed, and their drops must
 * fail what waits and release what they hold: the remote() call's drop fails its creation, which
 * the to_here reports (its status and text go through a pipe to the test; the context's own
 * teardown would have failed it with another text). The work is done on a thread of the test's
 * own, so that ASan's leak check (the rank's exit) sees what a drop failed to release; nothing
 * may be used after it was freed. Rank 1 stays up until rank 0 is gone.
 */
static void fn_make(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, value_of_string("made"));
}

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

static void fn_ping(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, NULL);
}

static void setup_teardown(weft_agent_t *a, int rank, void *arg)
{
    (void)rank;
    (void)arg;
    if (weft_rref_init(a) != WEFT_OK || weft_rpc_register(a, "make", fn_make, NULL) != WEFT_OK ||
        weft_rpc_register(a, "return_rref", fn_return_rref, NULL) != WEFT_OK ||
        weft_rpc_register(a, "ping", fn_ping, NULL) != WEFT_OK) {
        abort();
    }
}

typedef struct {
    int32_t status;
    char text[480];
} outcome_t;

static int g_outcome_fd = -1; /* the pipe's write end */

/* The to_here's outcome (on rank 0 while its agent is freed): written to the pipe. */
static void fetch_settled(weft_future_t *f, void *arg)
{
    (void)arg;
    outcome_t o;
    memset(&o, 0, sizeof(o));
    o.status = weft_future_status(f);
    snprintf(o.text, sizeof(o.text), "%s", weft_future_error(f));
    if (write(g_outcome_fd, &o, sizeof(o)) != (ssize_t)sizeof(o)) {
        abort();
    }
    weft_future_release(f);
}

/* Rank 0's work (on a thread of its own): NULL when done. */
static void *teardown_work(void *arg)
{
    weft_agent_t *a = arg;
    weft_value_t *v = NULL;
    weft_rref_t *r;
    weft_future_t *f;

    /* A reference owned by rank 1, confirmed at once (early registration), then released: its
     * USER_DELETE waits for its ACK (a retry task) and is held back (a delayed send). */
    if (weft_rpc_sync(a, 1, "return_rref", NULL, 5000, &v) != WEFT_OK ||
        weft_value_rref(v, 0) == NULL || !weft_rref_confirmed_by_owner(weft_value_rref(v, 0))) {
        fprintf(stderr, "return_rref: %s\n", weft_last_error());
        weft_value_free(v);
        return (void *)1;
    }
    weft_value_free(v);
    /* remote(): its call is held back; a to_here with a shorter deadline arms a deadline task. */
    if (weft_rref_remote(a, 1, "make", NULL, 20000, &r) != WEFT_OK) {
        fprintf(stderr, "remote: %s\n", weft_last_error());
        return (void *)1;
    }
    if (weft_rref_to_here_async(r, 10000, &f) != WEFT_OK ||
        weft_future_then(f, fetch_settled, NULL) != WEFT_OK) {
        fprintf(stderr, "to_here: %s\n", weft_last_error());
        weft_rref_release(r);
        return (void *)1;
    }
    weft_rref_release(r);
    return NULL;
}

static int body_teardown(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank == 1) {
        for (int64_t until = now_ms() + 30000; now_ms() < until;) {
            if (weft_rpc_sync(a, 0, "ping", NULL, 1000, NULL) != WEFT_OK) {
                return 0; /* rank 0 is gone */
            }
        }
        RANK_CHECK(0, "rank 0 never went away");
    }
    pthread_t th;
    void *res = NULL;
    RANK_CHECK(pthread_create(&th, NULL, teardown_work, a) == 0, "thread");
    pthread_join(th, &res);
    RANK_CHECK(res == NULL, "rank 0's work failed");
    return 0;
}

Test(rref_timeouts, agent_freed_with_timed_work_pending, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    int fds[2];
    outcome_t out;
    cr_assert_eq(pipe(fds), 0);
    g_outcome_fd = fds[1];
    /* Held back by 0..600 s: still on the timer when the agent is freed, a few ms later. */
    setenv("WEFT_RREF_FAULT_DELAY_US", "600000000", 1);
    ranks_opts_init(&o, 2, body_teardown);
    o.setup = setup_teardown;
    o.no_shutdown = 1;
    cr_assert_eq(ranks_run(&o, codes), 0);
    close(fds[1]);
    cr_assert_eq(read(fds[0], &out, sizeof(out)), (ssize_t)sizeof(out),
                 "the to_here never ended while the agent was freed");
    close(fds[0]);
    out.text[sizeof(out.text) - 1] = '\0';
    cr_assert_eq(out.status, WEFT_ERR_SHUTDOWN, "the to_here ended with %s: %s",
                 weft_strerror(out.status), out.text);
    cr_assert(strstr(out.text, "creation by 'make'") != NULL,
              "the remote() call's drop did not fail its creation: %s", out.text);
}
