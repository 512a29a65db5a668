/* References in values (weft_value_add_ref, reference codecs): they travel in the arguments and
 * results of calls and in one-way messages, calls to this rank itself keep the objects, a
 * request's handler waits for its objects to be ready, errors and bad peers are refused with the
 * right status, unsent runs for messages that never left, nothing leaks; shutdown listeners. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "ranks.h"
#include "rawpeer.h"

#define KIND    2u
#define NOCODEC 7u /* a kind nobody registers */
#define CHANNEL 64

/* Flags in an object's id that steer the test codec. */
#define F_SLOW       (1ull << 40) /* decode: ready 300 ms later (or when no longer held) */
#define F_FAIL_LATER (1ull << 41) /* decode: its future fails 200 ms later */
#define F_GONE       (1ull << 42) /* decode: fails at once */
#define F_BIG        (1ull << 43) /* encode: 5000 bytes */
#define F_NO_ENCODE  (1ull << 44) /* encode: fails */

/* ------------------------------------------------------- the test codec */

typedef struct {
    _Atomic int refs;
    uint64_t id;
} obj_t;

/* Per process (each rank is one). */
static _Atomic int64_t n_created, n_destroyed, n_encodes, n_decodes, n_unsent, n_unsent_bad;
static _Atomic int n_handler_runs, n_chan_msgs, slow_done;
/* Threads completing objects' futures later that have not ended yet; while later_held is set, an
 * F_SLOW object decoded here is ready only once it is cleared, not after its 300 ms. */
static _Atomic int later_live, later_held;

static void obj_retain(void *o)
{
    atomic_fetch_add(&((obj_t *)o)->refs, 1);
}

static void obj_release(void *o)
{
    obj_t *x = o;
    if (atomic_fetch_sub(&x->refs, 1) == 1) {
        atomic_fetch_add(&n_destroyed, 1);
        weft_free(x);
    }
}

static const weft_value_ref_type_t obj_type = {KIND, obj_retain, obj_release};
static const weft_value_ref_type_t nocodec_type = {NOCODEC, obj_retain, obj_release};

static obj_t *obj_new(uint64_t id)
{
    obj_t *x = weft_alloc(sizeof(*x));
    atomic_init(&x->refs, 1);
    x->id = id;
    atomic_fetch_add(&n_created, 1);
    return x;
}

static weft_status_t t_encode(void *state, weft_agent_t *a, int to, void *obj, void **bytes_p,
                              size_t *len_p)
{
    (void)state;
    (void)a;
    (void)to;
    obj_t *x = obj;
    if (x->id & F_NO_ENCODE) {
        return WEFT_ERR_INVALID_STATE;
    }
    size_t len = (x->id & F_BIG) ? 5000 : 8;
    uint8_t *b = weft_calloc(1, len);
    memcpy(b, &x->id, 8);
    atomic_fetch_add(&n_encodes, 1);
    *bytes_p = b;
    *len_p = len;
    return WEFT_OK;
}

static void t_unsent(void *state, weft_agent_t *a, int to, void *obj, const void *bytes, size_t len)
{
    (void)state;
    (void)a;
    (void)to;
    obj_t *x = obj;
    uint64_t id = 0;
    if (len >= 8) {
        memcpy(&id, bytes, 8);
    }
    if (len < 8 || id != x->id) {
        atomic_fetch_add(&n_unsent_bad, 1);
    }
    atomic_fetch_add(&n_unsent, 1);
}

typedef struct {
    weft_future_t *f;
    int ms;
    bool fail;
    bool held;
    uint64_t id;
} later_t;

static void *complete_later(void *arg)
{
    later_t *l = arg;
    if (l->held) {
        bool released;
        WAIT_UNTIL(released, !atomic_load(&later_held), 20000);
        if (!released) {
            fprintf(stderr, "object %llu: held for 20 s\n", (unsigned long long)l->id);
        }
    } else {
        /* The object arrives later: the scenario itself. What the tests check does not depend on
         * the delay (a handler waits for the future, however long it takes). */
        usleep((useconds_t)l->ms * 1000);
    }
    if (l->fail) {
        weft_future_fail(l->f, WEFT_ERR_NOT_FOUND, "test: object %llu failed to arrive",
                         (unsigned long long)(l->id & 0xffffffffu));
    } else {
        atomic_store(&slow_done, 1);
        weft_future_complete(l->f, WEFT_OK, NULL, NULL);
    }
    weft_future_release(l->f);
    weft_free(l);
    atomic_fetch_sub(&later_live, 1);
    return NULL;
}

static weft_status_t t_decode(void *state, weft_agent_t *a, int src, const void *bytes, size_t len,
                              void **obj_p, weft_future_t **ready_p)
{
    (void)state;
    (void)a;
    (void)src;
    uint64_t id;
    if (len != 8) {
        return WEFT_ERR_PROTOCOL;
    }
    memcpy(&id, bytes, 8);
    if (id & F_GONE) {
        return WEFT_ERR_NOT_FOUND;
    }
    atomic_fetch_add(&n_decodes, 1);
    *ready_p = NULL;
    if (id & (F_SLOW | F_FAIL_LATER)) {
        later_t *l = weft_alloc(sizeof(*l));
        weft_future_create(&l->f);
        l->ms = (id & F_SLOW) ? 300 : 200;
        l->fail = (id & F_FAIL_LATER) != 0;
        l->held = (id & F_SLOW) != 0 && atomic_load(&later_held);
        l->id = id;
        *ready_p = weft_future_retain(l->f);
        atomic_fetch_add(&later_live, 1);
        pthread_t th;
        pthread_create(&th, NULL, complete_later, l);
        pthread_detach(th);
    }
    *obj_p = obj_new(id);
    return WEFT_OK;
}

static const weft_ref_codec_t codec = {t_encode, t_unsent, t_decode, &obj_type};

/* ------------------------------------------------------------ functions */

/* Replies with [n, slow_done, (id, pointer) x n] of its arguments' references. */
static void ids(weft_call_t *call, void *arg)
{
    (void)arg;
    const weft_value_t *args = weft_call_args(call);
    size_t n = weft_value_num_refs(args);
    uint64_t out[2 + 2 * 16] = {n, (uint64_t)atomic_load(&slow_done)};
    atomic_fetch_add(&n_handler_runs, 1);
    for (size_t i = 0; i < n && i < 16; i++) {
        uint32_t kind = 0;
        obj_t *x = weft_value_ref(args, i, &kind);
        out[2 + 2 * i] = kind == KIND ? x->id : 0;
        out[3 + 2 * i] = (uint64_t)(uintptr_t)x;
    }
    weft_value_t *r;
    weft_value_create(&r);
    weft_value_set_payload(r, out, (2 + 2 * (n < 16 ? n : 16)) * sizeof(uint64_t));
    weft_call_reply(call, r);
}

/* Replies with its arguments, references included. */
static void echo(weft_call_t *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&n_handler_runs, 1);
    weft_call_reply(call, weft_call_take_args(call));
}

/* Replies with new objects whose ids are the u64 payload; a payload of 0 bytes: one object of a
 * kind without a codec; "big" (u64 ids then 100 KiB) over the caller's limit. */
static void make(weft_call_t *call, void *arg)
{
    (void)arg;
    size_t len;
    const uint8_t *p = weft_value_payload(weft_call_args(call), &len);
    weft_value_t *r;
    weft_value_create(&r);
    if (len == 0) {
        obj_t *x = obj_new(1);
        weft_value_add_ref(r, &nocodec_type, x);
        obj_release(x);
    }
    for (size_t i = 0; i + 8 <= len && i < 64; i += 8) {
        uint64_t id;
        memcpy(&id, p + i, 8);
        obj_t *x = obj_new(id);
        weft_value_add_ref(r, &obj_type, x);
        obj_release(x);
    }
    if (len > 64) {
        weft_value_set_payload(r, p, len); /* large: over the caller's limit */
    }
    weft_call_reply(call, r);
}

/* Replies with this rank's counters. */
static void stats(weft_call_t *call, void *arg)
{
    (void)arg;
    int64_t s[8] = {atomic_load(&n_handler_runs), atomic_load(&n_created),
                    atomic_load(&n_destroyed),    atomic_load(&n_encodes),
                    atomic_load(&n_decodes),      atomic_load(&n_unsent),
                    atomic_load(&n_chan_msgs),    atomic_load(&n_unsent_bad)};
    weft_value_t *r;
    weft_value_create(&r);
    weft_value_set_payload(r, s, sizeof(s));
    weft_call_reply(call, r);
}

/* One-way messages: kept for the body to look at. */
#define INBOX 16
static pthread_mutex_t inbox_mu = PTHREAD_MUTEX_INITIALIZER;
static weft_value_t *inbox[INBOX];
static int inbox_src[INBOX];
static weft_future_t *inbox_full; /* completed when inbox_want messages are in */
static int inbox_want;
static int inbox_drop; /* free messages at once */

static void on_message(void *state, int src, weft_value_t *msg)
{
    (void)state;
    pthread_mutex_lock(&inbox_mu);
    int k = atomic_fetch_add(&n_chan_msgs, 1);
    if (k < INBOX && !inbox_drop) {
        inbox[k] = msg;
        inbox_src[k] = src;
        msg = NULL;
    }
    bool full = k + 1 == inbox_want;
    pthread_mutex_unlock(&inbox_mu);
    weft_value_free(msg);
    if (full) {
        weft_future_complete(inbox_full, WEFT_OK, NULL, NULL);
    }
}

static void inbox_clear(void)
{
    pthread_mutex_lock(&inbox_mu);
    for (int i = 0; i < INBOX; i++) {
        weft_value_free(inbox[i]);
        inbox[i] = NULL;
    }
    pthread_mutex_unlock(&inbox_mu);
}

/* Set by the test of lost peers. */
static weft_future_t *lost;

static void on_lost(void *state, int rank, const char *why)
{
    (void)state;
    (void)rank;
    (void)why;
    if (lost != NULL) {
        weft_future_complete(lost, WEFT_OK, NULL, NULL);
    }
}

static int module_state;

static weft_status_t test_create(weft_agent_t *a, void **state_p)
{
    (void)a;
    *state_p = &module_state;
    return WEFT_OK;
}

/* The test's module: its codec, its channel's messages, lost peers. */
static const weft_module_desc_t test_module = {.name = "test",
                                               .channel = CHANNEL,
                                               .create = test_create,
                                               .on_message = on_message,
                                               .on_peer_lost = on_lost,
                                               .codec = &codec};

static void setup(weft_agent_t *a, int rank, void *arg)
{
    void *state;
    (void)rank;
    (void)arg;
    weft_agent_module(a, &test_module, &state);
    weft_rpc_register(a, "ids", ids, NULL);
    weft_rpc_register(a, "echo", echo, NULL);
    weft_rpc_register(a, "make", make, NULL);
    weft_rpc_register(a, "stats", stats, NULL);
    weft_future_create(&inbox_full);
}

/* "Done" messages: a rank that leaves without the collective shutdown waits for one from its peer,
 * the proof that the answers it had to give have arrived. */
#define DONE_CHANNEL 69
static weft_future_t *done_msg; /* kept to the end: a late message may still complete it */

static void on_done(void *state, int src, weft_value_t *msg)
{
    (void)state;
    (void)src;
    weft_value_free(msg);
    weft_future_complete(done_msg, WEFT_OK, NULL, NULL);
}

static const weft_module_desc_t done_module = {
    .name = "done", .channel = DONE_CHANNEL, .create = test_create, .on_message = on_done};

static void done_setup(weft_agent_t *a)
{
    void *state;
    weft_future_create(&done_msg);
    weft_agent_module(a, &done_module, &state);
}

/* Tells @p to that this rank is done with it. */
static int send_done(weft_agent_t *a, int to)
{
    weft_value_t *v;
    RANK_CHECK(weft_value_create(&v) == WEFT_OK, "value");
    weft_status_t st = weft_agent_send(a, to, DONE_CHANNEL, v, NULL);
    weft_value_free(v);
    RANK_CHECK(st == WEFT_OK, "done to rank %d: %s", to, weft_last_error());
    return 0;
}

/* A value holding new objects with @p ids (the value keeps the only references). */
static weft_value_t *value_of_ids(const uint64_t *ids_, size_t n)
{
    weft_value_t *v;
    weft_value_create(&v);
    for (size_t i = 0; i < n; i++) {
        obj_t *x = obj_new(ids_[i]);
        weft_value_add_ref(v, &obj_type, x);
        obj_release(x);
    }
    return v;
}

/* A rank's counters, once its objects are all released (3 s at most: a call's arguments are
 * freed just after its answer leaves). */
static int get_stats(weft_agent_t *a, int rank, int64_t s[8]);
static int settled_stats(weft_agent_t *a, int rank, int64_t s[8])
{
    int64_t until = now_ms() + 3000;
    do {
        RANK_CHECK(get_stats(a, rank, s) == 0, "stats");
        if (s[1] == s[2]) {
            return 0;
        }
        usleep(20 * 1000);
    } while (now_ms() < until);
    return 0;
}

static int get_stats(weft_agent_t *a, int rank, int64_t s[8])
{
    weft_value_t *r = NULL;
    RANK_CHECK(weft_rpc_sync(a, rank, "stats", NULL, 10000, &r) == WEFT_OK, "stats: %s",
               weft_last_error());
    size_t len;
    const void *p = weft_value_payload(r, &len);
    RANK_CHECK(len == 8 * sizeof(int64_t), "stats payload");
    memcpy(s, p, len);
    weft_value_free(r);
    return 0;
}

#define LEAK_CHECK()                                                                               \
    RANK_CHECK(atomic_load(&n_created) == atomic_load(&n_destroyed),                               \
               "objects created %lld, destroyed %lld", (long long)atomic_load(&n_created),         \
               (long long)atomic_load(&n_destroyed))

/* ------------------------------------------------------------ the tests */

/* Checks an "ids" reply against @p want; @p same: the objects must be @p objs themselves. */
static int check_ids(weft_value_t *r, const uint64_t *want, size_t n, const weft_value_t *sent,
                     bool same)
{
    size_t len;
    const uint64_t *p = weft_value_payload(r, &len);
    RANK_CHECK(p != NULL && len == (2 + 2 * n) * 8 && p[0] == n, "ids reply of %zu bytes", len);
    for (size_t i = 0; i < n; i++) {
        RANK_CHECK(p[2 + 2 * i] == want[i], "ref %zu has id %llu, want %llu", i,
                   (unsigned long long)p[2 + 2 * i], (unsigned long long)want[i]);
        /* (Another process's addresses may match ours by chance: only self is checked.) */
        void *mine = weft_value_ref(sent, i, NULL);
        RANK_CHECK(!same || p[3 + 2 * i] == (uint64_t)(uintptr_t)mine,
                   "ref %zu: not the same object", i);
    }
    return 0;
}

static int carry_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    int peer = (rank + 1) % world;
    uint64_t want[3] = {rank * 100 + 1, rank * 100 + 2, rank * 100 + 3};
    weft_value_t *v = value_of_ids(want, 3);
    weft_value_t *r = NULL;

    RANK_CHECK(weft_value_num_refs(v) == 3, "3 refs");
    uint32_t kind = 0;
    RANK_CHECK(weft_value_ref(v, 1, &kind) != NULL && kind == KIND, "ref 1 kind");
    RANK_CHECK(weft_value_ref(v, 3, &kind) == NULL, "ref 3 out of range");

    /* Arguments to another rank: new objects with the same ids. */
    RANK_CHECK(weft_rpc_sync(a, peer, "ids", v, 10000, &r) == WEFT_OK, "ids: %s",
               weft_last_error());
    RANK_CHECK(check_ids(r, want, 3, v, false) == 0, "ids to the peer");
    weft_value_free(r);

    /* Results from another rank: the objects of the echoed arguments, decoded here. */
    RANK_CHECK(weft_rpc_sync(a, peer, "echo", v, 10000, &r) == WEFT_OK, "echo: %s",
               weft_last_error());
    RANK_CHECK(weft_value_num_refs(r) == 3, "echo result has %zu refs", weft_value_num_refs(r));
    for (size_t i = 0; i < 3; i++) {
        obj_t *x = weft_value_ref(r, i, &kind);
        RANK_CHECK(kind == KIND && x->id == want[i] && x != weft_value_ref(v, i, NULL),
                   "echoed ref %zu", i);
    }
    weft_value_free(r);

    /* References made by the callee come back too (weft_rpc_async, a future's value). */
    uint64_t made[2] = {rank * 100 + 50, rank * 100 + 51};
    weft_value_t *req;
    weft_value_create(&req);
    weft_value_set_payload(req, made, sizeof(made));
    weft_future_t *f;
    RANK_CHECK(weft_rpc_async(a, peer, "make", req, 10000, &f) == WEFT_OK, "make");
    RANK_CHECK(weft_future_wait(f, 10000) == WEFT_OK, "make: %s", weft_future_error(f));
    r = weft_future_value(f);
    RANK_CHECK(weft_value_num_refs(r) == 2 &&
                   ((obj_t *)weft_value_ref(r, 0, NULL))->id == made[0] &&
                   ((obj_t *)weft_value_ref(r, 1, NULL))->id == made[1],
               "made refs");
    weft_future_release(f);
    weft_value_free(req);

    /* Calls to this rank itself keep the objects (no encode, no decode: the codec's decode
     * would make new ones). */
    RANK_CHECK(weft_rpc_sync(a, rank, "ids", v, 10000, &r) == WEFT_OK, "ids to self: %s",
               weft_last_error());
    RANK_CHECK(check_ids(r, want, 3, v, true) == 0, "ids to self");
    weft_value_free(r);
    RANK_CHECK(weft_rpc_sync(a, rank, "echo", v, 10000, &r) == WEFT_OK, "echo to self: %s",
               weft_last_error());
    for (size_t i = 0; i < 3; i++) {
        RANK_CHECK(weft_value_ref(r, i, NULL) == weft_value_ref(v, i, NULL), "self echo ref %zu",
                   i);
    }
    weft_value_free(r);

    /* One-way messages, to the peer and to this rank. */
    RANK_CHECK(weft_agent_send(a, peer, CHANNEL, v, NULL) == WEFT_OK, "send: %s",
               weft_last_error());
    weft_future_t *sent;
    RANK_CHECK(weft_agent_send(a, rank, CHANNEL, v, &sent) == WEFT_OK, "send to self: %s",
               weft_last_error());
    RANK_CHECK(weft_future_wait(sent, 10000) == WEFT_OK, "sent to self");
    weft_future_release(sent);
    RANK_CHECK(weft_future_wait(inbox_full, 10000) == WEFT_OK, "%d one-way messages in",
               atomic_load(&n_chan_msgs));
    pthread_mutex_lock(&inbox_mu);
    for (int k = 0; k < 2; k++) {
        weft_value_t *m = inbox[k];
        int src = inbox_src[k];
        RANK_CHECK(weft_value_num_refs(m) == 3, "message from %d has %zu refs", src,
                   weft_value_num_refs(m));
        for (size_t i = 0; i < 3; i++) {
            obj_t *x = weft_value_ref(m, i, &kind);
            RANK_CHECK(kind == KIND && x->id == (uint64_t)src * 100 + 1 + i, "message ref %zu", i);
            RANK_CHECK((x == weft_value_ref(v, i, NULL)) == (src == rank), "message ref %zu: self",
                       i);
        }
    }
    pthread_mutex_unlock(&inbox_mu);
    inbox_clear();
    weft_value_free(v);

    /* Everything settles: after shutdown every object here has been released. */
    RANK_CHECK(weft_agent_shutdown(a, 20000) == WEFT_OK, "shutdown: %s", weft_last_error());
    LEAK_CHECK();
    RANK_CHECK(atomic_load(&n_unsent) == 0, "unsent without a failure");
    weft_future_release(inbox_full);
    return 0;
}

Test(rpc_refs, arguments_results_and_messages_carry_objects, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, carry_body);
    o.setup = setup;
    inbox_want = 2;
    o.deadline_ms = 50000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

static int ready_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    (void)world;
    if (rank == 0) {
        weft_future_release(inbox_full);
        return 0; /* serves */
    }
    /* The handler runs only once the object is ready (300 ms after decoding). */
    uint64_t slow[2] = {1, F_SLOW | 2};
    weft_value_t *v = value_of_ids(slow, 2);
    weft_value_t *r = NULL;
    int64_t t0 = now_ms();
    RANK_CHECK(weft_rpc_sync(a, 0, "ids", v, 10000, &r) == WEFT_OK, "slow ids: %s",
               weft_last_error());
    int64_t took = now_ms() - t0;
    RANK_CHECK(check_ids(r, slow, 2, v, false) == 0, "slow ids");
    const uint64_t *p = weft_value_payload(r, NULL);
    RANK_CHECK(p[1] == 1, "the handler ran before the object was ready");
    RANK_CHECK(took >= 250, "answered after %lld ms", (long long)took);
    weft_value_free(r);
    weft_value_free(v);

    /* A future that fails: the call fails with its status and text; no handler ran. */
    int64_t s0[8], s1[8];
    RANK_CHECK(get_stats(a, 0, s0) == 0, "stats");
    uint64_t bad[3] = {F_SLOW | 3, F_FAIL_LATER | 4, 5};
    v = value_of_ids(bad, 3);
    weft_status_t st = weft_rpc_sync(a, 0, "ids", v, 10000, &r);
    RANK_CHECK(st == WEFT_ERR_NOT_FOUND, "failed object gave %s", weft_strerror(st));
    RANK_CHECK(strstr(weft_last_error(), "object 4 failed to arrive") != NULL, "text: %s",
               weft_last_error());
    weft_value_free(v);

    /* A decode error: the call fails with it at once. */
    uint64_t gone[2] = {6, F_GONE | 7};
    v = value_of_ids(gone, 2);
    st = weft_rpc_sync(a, 0, "ids", v, 10000, &r);
    RANK_CHECK(st == WEFT_ERR_NOT_FOUND, "gone object gave %s: %s", weft_strerror(st),
               weft_last_error());
    RANK_CHECK(strstr(weft_last_error(), "kind 2") != NULL, "text: %s", weft_last_error());
    weft_value_free(v);
    RANK_CHECK(settled_stats(a, 0, s1) == 0, "stats");
    RANK_CHECK(s1[0] == s0[0], "handlers ran %lld times, want 0", (long long)(s1[0] - s0[0]));
    /* Every decoded object, the ones of failed calls too, was released on the callee. */
    RANK_CHECK(s1[1] == s1[2], "callee: %lld objects made, %lld released", (long long)s1[1],
               (long long)s1[2]);

    /* A result whose object fails to decode fails the call; ready futures are not awaited. */
    uint64_t ids_[2] = {8, F_GONE | 9};
    weft_value_t *req;
    weft_value_create(&req);
    weft_value_set_payload(req, ids_, sizeof(ids_));
    st = weft_rpc_sync(a, 0, "make", req, 10000, &r);
    RANK_CHECK(st == WEFT_ERR_NOT_FOUND, "bad result gave %s", weft_strerror(st));
    RANK_CHECK(strstr(weft_last_error(), "result from rank 0") != NULL, "text: %s",
               weft_last_error());
    uint64_t slow_ids[1] = {F_SLOW | 10};
    weft_value_set_payload(req, slow_ids, sizeof(slow_ids));
    atomic_store(&slow_done, 0);
    /* The result's object is held (never ready) until the call has returned. */
    atomic_store(&later_held, 1);
    RANK_CHECK(weft_rpc_sync(a, 0, "make", req, 10000, &r) == WEFT_OK, "slow result: %s",
               weft_last_error());
    RANK_CHECK(atomic_load(&slow_done) == 0, "the caller waited for a result's object");
    RANK_CHECK(weft_value_num_refs(r) == 1, "slow result refs");
    atomic_store(&later_held, 0);
    weft_value_free(r);
    weft_value_free(req);
    RANK_WAIT(atomic_load(&later_live) == 0, 20000, "%d completing threads left",
              atomic_load(&later_live));
    RANK_CHECK(atomic_load(&slow_done) == 1, "the result's object never became ready");
    LEAK_CHECK();
    weft_future_release(inbox_full);
    return 0;
}

Test(rpc_refs, handler_waits_for_ready_objects_and_failures_fail_the_call, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, ready_body);
    o.setup = setup;
    o.deadline_ms = 50000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

static int refused_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    (void)world;
    if (rank == 1) {
        weft_future_release(inbox_full);
        return 0; /* serves; its limit is 64 KiB */
    }
    weft_value_t *r = NULL;
    weft_future_t *f = NULL;
    /* A kind without a codec: refused at the sender; the reference encoded before it is unsent. */
    uint64_t one[1] = {1};
    weft_value_t *v = value_of_ids(one, 1);
    obj_t *x = obj_new(2);
    weft_value_add_ref(v, &nocodec_type, x);
    obj_release(x);
    weft_status_t st = weft_rpc_async(a, 1, "ids", v, 10000, &f);
    RANK_CHECK(st == WEFT_ERR_UNSUPPORTED, "no codec gave %s", weft_strerror(st));
    RANK_CHECK(strstr(weft_last_error(), "kind 7") != NULL, "text: %s", weft_last_error());
    RANK_CHECK(atomic_load(&n_unsent) == 1 && atomic_load(&n_encodes) == 1, "unsent %lld",
               (long long)atomic_load(&n_unsent));
    st = weft_agent_send(a, 1, CHANNEL, v, NULL);
    RANK_CHECK(st == WEFT_ERR_UNSUPPORTED, "no codec (send) gave %s", weft_strerror(st));
    st = weft_rpc_async(a, 0, "ids", v, 10000, &f);
    RANK_CHECK(st == WEFT_ERR_UNSUPPORTED, "no codec (self) gave %s", weft_strerror(st));
    RANK_CHECK(atomic_load(&n_unsent) == 2, "unsent %lld", (long long)atomic_load(&n_unsent));
    weft_value_free(v);

    /* Over the receiver's limit: nothing leaves, every encoded reference is unsent. */
    uint64_t two[2] = {3, 4};
    v = value_of_ids(two, 2);
    static uint8_t big[100 << 10];
    weft_value_set_payload(v, big, sizeof(big));
    st = weft_rpc_async(a, 1, "ids", v, 10000, &f);
    RANK_CHECK(st == WEFT_ERR_TOO_LARGE, "too large gave %s", weft_strerror(st));
    st = weft_agent_send(a, 1, CHANNEL, v, NULL);
    RANK_CHECK(st == WEFT_ERR_TOO_LARGE, "too large (send) gave %s", weft_strerror(st));
    RANK_CHECK(atomic_load(&n_unsent) == 6, "unsent %lld", (long long)atomic_load(&n_unsent));
    weft_value_free(v);

    /* An encoding over 4 KiB, an encoder's failure. */
    uint64_t large[2] = {5, F_BIG | 6};
    v = value_of_ids(large, 2);
    st = weft_rpc_async(a, 1, "ids", v, 10000, &f);
    RANK_CHECK(st == WEFT_ERR_TOO_LARGE, "large encoding gave %s", weft_strerror(st));
    RANK_CHECK(atomic_load(&n_unsent) == 8, "unsent %lld", (long long)atomic_load(&n_unsent));
    weft_value_free(v);
    uint64_t noenc[3] = {7, F_NO_ENCODE | 8, 9};
    v = value_of_ids(noenc, 3);
    st = weft_agent_send(a, 1, CHANNEL, v, NULL);
    RANK_CHECK(st == WEFT_ERR_INVALID_STATE, "encoder failure gave %s", weft_strerror(st));
    RANK_CHECK(strstr(weft_last_error(), "reference 1 (kind 2)") != NULL, "text: %s",
               weft_last_error());
    RANK_CHECK(atomic_load(&n_unsent) == 9, "unsent %lld", (long long)atomic_load(&n_unsent));
    weft_value_free(v);
    RANK_CHECK(atomic_load(&n_unsent_bad) == 0, "unsent got the wrong bytes");

    /* More than 4096 references: refused before any is encoded. */
    weft_value_create(&v);
    x = obj_new(11);
    for (int i = 0; i < 4097; i++) {
        weft_value_add_ref(v, &obj_type, x);
    }
    obj_release(x);
    int64_t enc = atomic_load(&n_encodes);
    st = weft_rpc_async(a, 1, "ids", v, 10000, &f);
    RANK_CHECK(st == WEFT_ERR_TOO_LARGE, "4097 references gave %s", weft_strerror(st));
    RANK_CHECK(strstr(weft_last_error(), "max 4096") != NULL, "text: %s", weft_last_error());
    RANK_CHECK(atomic_load(&n_encodes) == enc && atomic_load(&n_unsent) == 9, "encoded some");
    weft_value_free(v);

    /* Results: a kind without a codec, a result over the caller's limit (rank 0: unlimited, so
     * rank 1 calls; here a reply to rank 0 with no codec). */
    weft_value_t *req;
    weft_value_create(&req);
    st = weft_rpc_sync(a, 1, "make", req, 10000, &r);
    RANK_CHECK(st == WEFT_ERR_UNSUPPORTED, "reply without codec gave %s", weft_strerror(st));
    RANK_CHECK(strstr(weft_last_error(), "kind 7") != NULL, "text: %s", weft_last_error());
    weft_value_free(req);

    /* The world still works. */
    uint64_t ok[1] = {10};
    v = value_of_ids(ok, 1);
    RANK_CHECK(weft_rpc_sync(a, 1, "ids", v, 10000, &r) == WEFT_OK, "ids after: %s",
               weft_last_error());
    RANK_CHECK(check_ids(r, ok, 1, v, false) == 0, "ids after");
    weft_value_free(r);
    weft_value_free(v);
    RANK_CHECK(weft_agent_shutdown(a, 20000) == WEFT_OK, "shutdown: %s", weft_last_error());
    LEAK_CHECK();
    weft_future_release(inbox_full);
    return 0;
}

Test(rpc_refs, refused_sends_run_unsent, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, refused_body);
    o.setup = setup;
    o.max_message_bytes_rank1 = 64 << 10;
    o.deadline_ms = 50000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* A result over the caller's limit: the callee unsends its references. */
static int big_result_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    (void)world;
    weft_future_release(inbox_full);
    if (rank == 0) {
        return 0; /* serves */
    }
    weft_value_t *req, *r = NULL;
    static uint64_t ids_[(100 << 10) / 8];
    ids_[0] = 11;
    ids_[1] = 12;
    weft_value_create(&req);
    weft_value_set_payload(req, ids_, sizeof(ids_));
    weft_status_t st = weft_rpc_sync(a, 0, "make", req, 10000, &r);
    RANK_CHECK(st == WEFT_ERR_TOO_LARGE, "large result gave %s: %s", weft_strerror(st),
               weft_last_error());
    weft_value_free(req);
    int64_t s[8];
    RANK_CHECK(get_stats(a, 0, s) == 0, "stats");
    RANK_CHECK(s[5] == 8 && s[3] == 8, "callee encoded %lld, unsent %lld (want 8, 8)",
               (long long)s[3], (long long)s[5]);
    RANK_CHECK(s[7] == 0, "unsent got the wrong bytes");
    return 0;
}

Test(rpc_refs, result_over_the_limit_is_unsent, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, big_result_body);
    o.setup = setup;
    o.max_message_bytes_rank1 = 64 << 10;
    o.deadline_ms = 50000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* Sends to a peer that is gone: unsent for each reference. */

static weft_future_t *pinged;

static void ping(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, NULL);
    weft_future_complete(pinged, WEFT_OK, NULL, NULL);
}

static void dead_setup(weft_agent_t *a, int rank, void *arg)
{
    setup(a, rank, arg);
    done_setup(a);
    weft_future_create(&lost);
    weft_future_create(&pinged);
    weft_rpc_register(a, "ping", ping, NULL);
}

static int dead_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    (void)world;
    weft_future_release(inbox_full);
    if (rank == 1) {
        /* Answers one call, then goes away without a shutdown once rank 0 has the answer. */
        RANK_CHECK(weft_future_wait(pinged, 20000) == WEFT_OK, "pinged");
        RANK_CHECK(weft_future_wait(done_msg, 20000) == WEFT_OK, "rank 0 never had the answer");
        return 0;
    }
    RANK_CHECK(weft_rpc_sync(a, 1, "ping", NULL, 10000, NULL) == WEFT_OK, "ping: %s",
               weft_last_error());
    RANK_CHECK(send_done(a, 1) == 0, "done");
    RANK_CHECK(weft_future_wait(lost, 20000) == WEFT_OK, "rank 1 was not seen lost");
    uint64_t two[2] = {1, 2};
    weft_value_t *v = value_of_ids(two, 2);
    weft_future_t *f;
    weft_status_t st = weft_rpc_async(a, 1, "ids", v, 10000, &f);
    if (st == WEFT_OK) {
        st = weft_future_wait(f, 10000);
        weft_future_release(f);
    }
    RANK_CHECK(st == WEFT_ERR_PEER_LOST, "call to a lost peer gave %s", weft_strerror(st));
    st = weft_agent_send(a, 1, CHANNEL, v, NULL);
    RANK_CHECK(st == WEFT_ERR_PEER_LOST, "send to a lost peer gave %s", weft_strerror(st));
    RANK_CHECK(atomic_load(&n_unsent) == 4 && atomic_load(&n_encodes) == 4,
               "encoded %lld, unsent %lld", (long long)atomic_load(&n_encodes),
               (long long)atomic_load(&n_unsent));
    weft_value_free(v);
    LEAK_CHECK();
    return 0;
}

Test(rpc_refs, sends_to_a_lost_peer_are_unsent, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, dead_body);
    o.setup = dead_setup;
    o.no_shutdown = 1;
    o.peer_timeout_ms = 500;
    o.deadline_ms = 50000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* A raw peer sends references that do not decode: refused with WEFT_ERR_PROTOCOL; the
 * connection and the agent keep working. */
static weft_future_t *bye;

static void bye_fn(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, NULL);
    weft_future_complete(bye, WEFT_OK, NULL, NULL);
}

static void raw_setup(weft_agent_t *a, int rank, void *arg)
{
    inbox_drop = 1;
    setup(a, rank, arg);
    done_setup(a);
    weft_future_create(&lost);
    weft_future_create(&bye);
    weft_rpc_register(a, "bye", bye_fn, NULL);
}

static int raw_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    if (rank == 0) {
        RANK_CHECK(weft_future_wait(bye, 40000) == WEFT_OK, "no bye");
        /* Rank 1 has the bye's answer: this rank may go (rank 1 stays until it is gone). */
        RANK_CHECK(weft_future_wait(done_msg, 20000) == WEFT_OK, "rank 1 never had the answer");
        /* A call's arguments are freed just after its answer leaves. */
        RANK_WAIT(atomic_load(&n_created) == atomic_load(&n_destroyed), 10000,
                  "objects created %lld, destroyed %lld", (long long)atomic_load(&n_created),
                  (long long)atomic_load(&n_destroyed));
        weft_future_release(inbox_full);
        return 0;
    }
    uint64_t id77 = 77, id78 = 78;
    static uint8_t huge[5000];
    rawpeer_ref_t unknown = {9, &id77, 8};
    rawpeer_ref_t zero = {0, &id77, 8};
    rawpeer_ref_t shortr = {KIND, "abc", 3};
    rawpeer_ref_t toolong = {KIND, huge, sizeof(huge)};
    rawpeer_ref_t good = {KIND, &id77, 8};
    rawpeer_ref_t good78 = {KIND, &id78, 8};
    rawpeer_ref_t mixed[2] = {{KIND, &id78, 8}, {9, &id77, 8}};
    rawpeer_frame_t frames[] = {
        {"ids", 0, NULL, 0, &unknown, 1},     {"ids", 0, NULL, 0, &zero, 1},
        {"ids", 0, NULL, 0, &shortr, 1},      {"ids", 0, NULL, 0, &toolong, 1},
        {"ids", 0, NULL, 0, mixed, 2},        {NULL, CHANNEL, NULL, 0, &unknown, 1},
        {NULL, CHANNEL, NULL, 0, &good78, 1}, {"ids", 0, NULL, 0, &good, 1},
    };
    size_t n = sizeof(frames) / sizeof(frames[0]);
    rawpeer_reply_t replies[8];
    int st =
        rawpeer_frames(weft_agent_worker_address(a, 0), 1, world, "secret", a, frames, n, replies);
    RANK_CHECK(st == 0, "raw hello refused: %d", st);
    const char *texts[5] = {"kind 9", "kind 0", "kind 2", "max 4096", "kind 9"};
    for (int i = 0; i < 5; i++) {
        RANK_CHECK(replies[i].status == WEFT_ERR_PROTOCOL, "frame %d: status %d (%s)", i,
                   replies[i].status, replies[i].why);
        RANK_CHECK(strstr(replies[i].why, texts[i]) != NULL, "frame %d: text %s", i,
                   replies[i].why);
    }
    RANK_CHECK(replies[7].status == 0, "good frame: %d (%s)", replies[7].status, replies[7].why);
    uint64_t p[4] = {0};
    memcpy(p, replies[7].payload, replies[7].payload_len <= sizeof(p) ? replies[7].payload_len : 0);
    RANK_CHECK(replies[7].payload_len == 4 * 8 && p[0] == 1 && p[2] == 77, "good frame's ids");

    /* Rank 0 ran one handler (the good frame), got one message (the good one), and released
     * every object it decoded. */
    int64_t s[8];
    RANK_CHECK(settled_stats(a, 0, s) == 0, "stats");
    RANK_CHECK(s[0] == 1, "rank 0 ran %lld handlers (want 1)", (long long)s[0]);
    RANK_CHECK(s[6] == 1, "rank 0 got %lld messages (want 1)", (long long)s[6]);
    RANK_CHECK(s[1] == s[2] && s[4] == 3, "rank 0 made %lld objects, released %lld, decoded %lld",
               (long long)s[1], (long long)s[2], (long long)s[4]);

    /* And real calls still work. */
    uint64_t ok[1] = {5};
    weft_value_t *v = value_of_ids(ok, 1), *r = NULL;
    RANK_CHECK(weft_rpc_sync(a, 0, "ids", v, 10000, &r) == WEFT_OK, "ids after: %s",
               weft_last_error());
    RANK_CHECK(check_ids(r, ok, 1, v, false) == 0, "ids after");
    weft_value_free(r);
    weft_value_free(v);
    RANK_CHECK(weft_rpc_sync(a, 0, "bye", NULL, 10000, NULL) == WEFT_OK, "bye: %s",
               weft_last_error());
    RANK_CHECK(send_done(a, 0) == 0, "done");
    RANK_CHECK(weft_future_wait(lost, 20000) == WEFT_OK, "rank 0 never left");
    LEAK_CHECK();
    weft_future_release(inbox_full);
    return 0;
}

Test(rpc_refs, malformed_references_are_refused_and_the_agent_keeps_working, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    /* The raw peer speaks for rank 1 on a stream of its own: rank 1 itself opens none (with
     * rings, it would open its stream to rank 0 beside them at join). */
    setenv("WEFT_SHM", "0", 1);
    ranks_opts_init(&o, 2, raw_body);
    o.setup = raw_setup;
    o.auth_token = "secret";
    o.no_shutdown = 1; /* the raw peer's requests were never counted as sent */
    o.deadline_ms = 50000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* Shutdown listeners: in the order added, with the deadline, while calls still work; a failing
 * one is logged and shutdown goes on. */
static int order[8];
static _Atomic int norder;
static int64_t deadlines[8];
static weft_status_t call_status = WEFT_ERR_PENDING;

static weft_agent_t *listener_agent;

static weft_status_t listener(void *state, int64_t deadline_ms)
{
    weft_agent_t *a = listener_agent;
    int k = atomic_fetch_add(&norder, 1);
    int which = *(int *)state;
    if (k < 8) {
        order[k] = which;
        deadlines[k] = deadline_ms;
    }
    if (which == 1) {
        return WEFT_ERR_INVALID_STATE;
    }
    if (which == 2) {
        /* The RPC layer still works, references included. */
        uint64_t one[1] = {(uint64_t)weft_agent_rank(a) + 1};
        weft_value_t *v = value_of_ids(one, 1), *r = NULL;
        int peer = (weft_agent_rank(a) + 1) % weft_agent_world_size(a);
        call_status = weft_rpc_sync(a, peer, "ids", v, 5000, &r);
        weft_value_free(r);
        weft_value_free(v);
    }
    return WEFT_OK;
}

static int which_of[4] = {0, 1, 2, 3};

static weft_status_t create_1(weft_agent_t *a, void **state_p)
{
    (void)a;
    *state_p = &which_of[1];
    return WEFT_OK;
}

static weft_status_t create_2(weft_agent_t *a, void **state_p)
{
    (void)a;
    *state_p = &which_of[2];
    return WEFT_OK;
}

static weft_status_t create_3(weft_agent_t *a, void **state_p)
{
    (void)a;
    *state_p = &which_of[3];
    return WEFT_OK;
}

static const weft_module_desc_t listener_1 = {
    .name = "one", .channel = 65, .create = create_1, .on_shutdown = listener};
static const weft_module_desc_t listener_2 = {
    .name = "two", .channel = 66, .create = create_2, .on_shutdown = listener};
static const weft_module_desc_t listener_3 = {
    .name = "three", .channel = 67, .create = create_3, .on_shutdown = listener};
static const weft_module_desc_t listener_none = {.name = "none", .channel = 68};

static void *add_third(void *arg)
{
    void *state;
    weft_agent_module(arg, &listener_3, &state);
    return NULL;
}

static int listeners_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    (void)rank;
    (void)world;
    weft_future_release(inbox_full);
    void *state;
    listener_agent = a;
    RANK_CHECK(weft_agent_module(a, &listener_none, &state) == WEFT_ERR_INVALID_ARG,
               "a module without create");
    RANK_CHECK(weft_agent_module(a, &listener_1, &state) == WEFT_OK, "add 1");
    RANK_CHECK(weft_agent_module(a, &listener_2, &state) == WEFT_OK, "add 2");
    pthread_t th;
    pthread_create(&th, NULL, add_third, a);
    pthread_join(th, NULL);
    int64_t t0 = now_ms();
    RANK_CHECK(weft_agent_shutdown(a, 20000) == WEFT_OK, "shutdown: %s", weft_last_error());
    RANK_CHECK(atomic_load(&norder) == 3, "%d listeners ran", atomic_load(&norder));
    for (int i = 0; i < 3; i++) {
        RANK_CHECK(order[i] == i + 1, "listener %d ran in place %d", order[i], i);
        RANK_CHECK(deadlines[i] >= t0 + 19000 && deadlines[i] <= t0 + 21000,
                   "deadline %lld ms from the call", (long long)(deadlines[i] - t0));
    }
    RANK_CHECK(call_status == WEFT_OK, "call from a listener: %s", weft_strerror(call_status));
    /* Shut down already: listeners do not run again. */
    RANK_CHECK(weft_agent_shutdown(a, 20000) == WEFT_OK, "second shutdown");
    RANK_CHECK(atomic_load(&norder) == 3, "listeners ran again");
    LEAK_CHECK();
    return 0;
}

Test(rpc_refs, shutdown_listeners_run_in_order_with_the_deadline, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, listeners_body);
    o.setup = setup;
    o.deadline_ms = 50000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* Registration checks (no world needed). */
static const weft_value_ref_type_t kind0_type = {0, obj_retain, obj_release};
static const weft_value_ref_type_t kind16_type = {16, obj_retain, obj_release};
static const weft_ref_codec_t kind0_codec = {t_encode, t_unsent, t_decode, &kind0_type};
static const weft_ref_codec_t kind16_codec = {t_encode, t_unsent, t_decode, &kind16_type};
static const weft_ref_codec_t no_decode_codec = {t_encode, t_unsent, NULL, &obj_type};
static const weft_ref_codec_t no_type_codec = {t_encode, t_unsent, t_decode, NULL};
static const weft_module_desc_t same_kind_module = {
    .name = "same kind", .channel = 70, .create = test_create, .codec = &codec};
static const weft_module_desc_t kind0_module = {
    .name = "kind 0", .channel = 71, .create = test_create, .codec = &kind0_codec};
static const weft_module_desc_t kind16_module = {
    .name = "kind 16", .channel = 72, .create = test_create, .codec = &kind16_codec};
static const weft_module_desc_t no_decode_module = {
    .name = "no decode", .channel = 73, .create = test_create, .codec = &no_decode_codec};
static const weft_module_desc_t no_type_module = {
    .name = "no type", .channel = 74, .create = test_create, .codec = &no_type_codec};

Test(rpc_refs, codec_registration)
{
    weft_agent_opts_t ao;
    weft_agent_t *a;
    weft_agent_opts_init(&ao);
    ao.rank = 0;
    ao.world_size = 1;
    ao.master_addr = "127.0.0.1";
    ao.master_port = 0;
    cr_assert_eq(weft_agent_create(&ao, &a), WEFT_OK);
    void *state;
    cr_assert_eq(weft_agent_module(a, &test_module, &state), WEFT_OK);
    cr_assert_eq(state, &module_state);
    cr_assert_eq(weft_agent_module(a, &test_module, &state), WEFT_OK, "the same module again");
    cr_assert_eq(weft_agent_module(a, &same_kind_module, &state), WEFT_ERR_ALREADY_EXISTS,
                 "another module with a codec of the same kind");
    cr_assert_eq(weft_agent_module(a, &kind0_module, &state), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(weft_agent_module(a, &kind16_module, &state), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(weft_agent_module(a, &no_decode_module, &state), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(weft_agent_module(a, &no_type_module, &state), WEFT_ERR_INVALID_ARG);
    weft_value_t *v;
    weft_value_create(&v);
    cr_assert_eq(weft_value_add_ref(v, NULL, v), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(weft_value_add_ref(v, &obj_type, NULL), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(weft_value_num_refs(v), 0);
    cr_assert_null(weft_value_ref(v, 0, NULL));
    weft_value_free(v);
    weft_agent_free(a);
}
