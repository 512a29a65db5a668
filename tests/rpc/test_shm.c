/* The shared-memory transport (rpc/shm.c): every kind of frame through the rings in order, rings
 * full in both directions, back-pressure, a peer that exits or dies with its ring full, ranks on
 * other hosts or with WEFT_SHM=0 beside ranks with rings, and handshakes that are refused. */
#include <criterion/criterion.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ranks.h"
#include "rawpeer.h"

#define CHANNEL 64
#define MAXW    8

/* ------------------------------------------------------------ an ordered inbox */

typedef struct {
    pthread_mutex_t mu;
    int next[MAXW]; /* per source: the sequence number expected next */
    int bad;
    int expect; /* messages from each source (0: no total) */
    int world, self;
    weft_future_t *all_in;
    /* blocking: the first message blocks its callback until `release` completes */
    bool block;
    pthread_cond_t cv;
    bool released;
    /* peer loss */
    weft_future_t *lost;
    _Atomic int received_at_loss;
} inbox_t;

static inbox_t inbox = {PTHREAD_MUTEX_INITIALIZER, {0}, 0, 0, 0, 0, NULL, false,
                        PTHREAD_COND_INITIALIZER, false, NULL, -1};

static int inbox_total(void)
{
    int n = 0;
    for (int r = 0; r < MAXW; r++) {
        n += inbox.next[r];
    }
    return n;
}

static void on_message(void *state, int src, weft_value_t *msg)
{
    (void)state;
    size_t len = 0;
    const int *seq = weft_value_payload(msg, &len);
    pthread_mutex_lock(&inbox.mu);
    if (inbox.block) {
        /* Held (not in a weft wait: the ring's reading role stays with this thread). */
        while (!inbox.released) {
            pthread_cond_wait(&inbox.cv, &inbox.mu);
        }
    }
    if (seq == NULL || len < sizeof(int) || src < 0 || src >= MAXW || *seq != inbox.next[src]) {
        inbox.bad++;
    } else {
        weft_tensor_t *t = weft_value_tensor(msg, 0);
        if (t != NULL) {
            /* Its bytes are the sequence number, repeated. */
            const int *p = weft_tensor_data(t);
            int64_t n = weft_tensor_numel(t);
            if (p[0] != *seq || p[n / 2] != *seq || p[n - 1] != *seq) {
                inbox.bad++;
            }
        }
        inbox.next[src]++;
    }
    bool done = inbox.expect > 0;
    for (int r = 0; r < inbox.world; r++) {
        done &= r == inbox.self || inbox.next[r] == inbox.expect;
    }
    pthread_mutex_unlock(&inbox.mu);
    if (done) {
        weft_future_complete(inbox.all_in, WEFT_OK, NULL, NULL);
    }
    weft_value_free(msg);
}

static void on_peer_lost(void *state, int rank, const char *why)
{
    (void)state;
    (void)rank;
    pthread_mutex_lock(&inbox.mu);
    atomic_store(&inbox.received_at_loss, inbox_total());
    pthread_mutex_unlock(&inbox.mu);
    weft_future_complete(inbox.lost, WEFT_ERR_PEER_LOST, why, NULL);
}

static weft_status_t inbox_create(weft_agent_t *a, void **state_p)
{
    (void)a;
    *state_p = &inbox;
    return WEFT_OK;
}

static const weft_module_desc_t inbox_module = {.name = "inbox",
                                                .channel = CHANNEL,
                                                .create = inbox_create,
                                                .on_message = on_message,
                                                .on_peer_lost = on_peer_lost};

static void echo(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, weft_call_take_args(call));
}

static void setup(weft_agent_t *a, int rank, void *arg)
{
    void *state;
    (void)arg;
    inbox.world = weft_agent_world_size(a);
    inbox.self = rank;
    weft_future_create(&inbox.all_in);
    weft_future_create(&inbox.lost);
    weft_agent_module(a, &inbox_module, &state);
    weft_rpc_register(a, "echo", echo, NULL);
}

/* Runs @p body on @p world ranks over 64 KiB rings (frames of any size go in pieces, writers
 * wait for room); 0 when every rank exited 0. */
static int run_small_rings(int world, rank_main_cb_t body, int64_t deadline_ms)
{
    ranks_opts_t o;
    int codes[MAXW];
    setenv("WEFT_SHM_RING_KB", "64", 1);
    ranks_opts_init(&o, world, body);
    o.setup = setup;
    o.deadline_ms = deadline_ms;
    return ranks_run(&o, codes);
}

/* Message @p seq: its number, and every @p every-th one a tensor of @p ints ints holding it. */
static weft_value_t *message(int seq, int every, int64_t ints)
{
    weft_value_t *v = NULL;
    weft_value_create(&v);
    weft_value_set_payload(v, &seq, sizeof(seq));
    if (every > 0 && seq % every == 0) {
        weft_tensor_t *t;
        weft_tensor_empty(WEFT_I32, 1, &ints, &t);
        int *p = weft_tensor_data(t);
        for (int64_t i = 0; i < ints; i++) {
            p[i] = seq;
        }
        weft_value_push_tensor(v, t);
    }
    return v;
}

static int call_echo(weft_agent_t *a, int to, int64_t bytes, int fill)
{
    weft_tensor_t *t;
    weft_value_t *v = NULL, *r = NULL;
    weft_tensor_empty(WEFT_U8, 1, &bytes, &t);
    memset(weft_tensor_data(t), fill, (size_t)bytes);
    weft_value_create(&v);
    weft_value_push_tensor(v, t);
    weft_status_t st = weft_rpc_sync(a, to, "echo", v, 20000, &r);
    int ok = st == WEFT_OK && weft_value_num_tensors(r) == 1 &&
             weft_tensor_equal(weft_value_tensor(r, 0), t);
    if (st != WEFT_OK) {
        fprintf(stderr, "echo to %d: %s\n", to, weft_last_error());
    }
    weft_value_free(v);
    weft_value_free(r);
    return ok ? 0 : -1;
}

/* ------------------------------------------------------------ order, kinds, sizes */

#define COUNT 1000

static int order_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    inbox.expect = COUNT;
    for (int i = 0; i < COUNT; i++) {
        /* Every 100th carries 1.5 MiB: 24 times the 64 KiB ring, so it goes in pieces. */
        weft_value_t *v = message(i, 100, 393216);
        for (int r = 0; r < world; r++) {
            if (r != rank) {
                RANK_CHECK(weft_agent_send(a, r, CHANNEL, v, NULL) == WEFT_OK, "send: %s",
                           weft_last_error());
            }
        }
        weft_value_free(v);
        if (i % 50 == 0) {
            for (int r = 0; r < world; r++) {
                if (r != rank) {
                    RANK_CHECK(call_echo(a, r, 1000 + i, i & 0xff) == 0, "echo %d to %d", i, r);
                }
            }
        }
    }
    RANK_CHECK(weft_future_wait(inbox.all_in, 60000) == WEFT_OK, "messages missing");
    RANK_CHECK(inbox.bad == 0, "%d messages out of order or wrong", inbox.bad);
    for (int r = 0; r < world; r++) {
        if (r == rank) {
            continue;
        }
        weft_shm_stats_t s;
        RANK_CHECK(weft_agent_shm_stats(a, r, &s) == WEFT_OK, "stats");
        RANK_CHECK(s.ring_open, "no ring to rank %d", r);
        /* Every message and call went through the rings; the long ones waited for room. */
        RANK_CHECK(s.frames_sent >= COUNT + COUNT / 50 && s.frames_received >= COUNT + COUNT / 50,
                   "rank %d: %llu frames sent, %llu received", r,
                   (unsigned long long)s.frames_sent, (unsigned long long)s.frames_received);
        RANK_CHECK(s.writer_waits > 0, "a 1.5 MiB frame never waited for room in 64 KiB");
        RANK_CHECK(strncmp(weft_agent_worker_shm_address(a, r), "weft-shm-", 9) == 0,
                   "address %s", weft_agent_worker_shm_address(a, r));
    }
    return 0;
}

Test(rpc_shm, every_kind_of_frame_goes_through_the_rings_in_order, .timeout = 120)
{
    cr_assert_eq(run_small_rings(3, order_body, 110000), 0);
}

/* ------------------------------------------------------------ full both ways */

#define FLOOD     48
#define FLOOD_LEN ((int64_t)256 << 10)

static int flood_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    (void)world;
    int to = 1 - rank;
    weft_future_t *fs[FLOOD];
    weft_value_t *vs[FLOOD];
    /* Both ranks call at once: each ring fills with requests one way and answers the other. */
    for (int i = 0; i < FLOOD; i++) {
        weft_tensor_t *t;
        int64_t n = FLOOD_LEN;
        weft_tensor_empty(WEFT_U8, 1, &n, &t);
        memset(weft_tensor_data(t), (rank * 64 + i) & 0xff, (size_t)n);
        weft_value_create(&vs[i]);
        weft_value_push_tensor(vs[i], t);
        RANK_CHECK(weft_rpc_async(a, to, "echo", vs[i], 60000, &fs[i]) == WEFT_OK, "call %d: %s",
                   i, weft_last_error());
    }
    for (int i = 0; i < FLOOD; i++) {
        RANK_CHECK(weft_future_wait(fs[i], 60000) == WEFT_OK, "call %d: %s", i,
                   weft_future_error(fs[i]));
        weft_value_t *r = weft_future_value(fs[i]);
        RANK_CHECK(weft_value_num_tensors(r) == 1 &&
                       weft_tensor_equal(weft_value_tensor(r, 0), weft_value_tensor(vs[i], 0)),
                   "answer %d differs", i);
        weft_future_release(fs[i]);
        weft_value_free(vs[i]);
    }
    weft_shm_stats_t s;
    RANK_CHECK(weft_agent_shm_stats(a, to, &s) == WEFT_OK && s.ring_open, "no ring (%llu frames sent, %llu received)", (unsigned long long)s.frames_sent, (unsigned long long)s.frames_received);
    RANK_CHECK(s.writer_waits > 0, "12 MiB went through a 64 KiB ring without waiting");
    return 0;
}

Test(rpc_shm, rings_full_both_ways_do_not_deadlock, .timeout = 120)
{
    cr_assert_eq(run_small_rings(2, flood_body, 110000), 0);
}

/* ------------------------------------------------------------ back-pressure */

/* A pipe between the two ranks, made before they fork: a word that does not go through the
 * ring under test. */
static int side[2] = {-1, -1};

static bool side_wait(int ms)
{
    struct pollfd p = {side[0], POLLIN, 0};
    return poll(&p, 1, ms) == 1;
}

static void side_say(void)
{
    uint8_t b = 1;
    ssize_t k = write(side[1], &b, 1);
    (void)k;
}

#define HELD 300

typedef struct {
    weft_agent_t *a;
    weft_status_t st;
    int sent;
} sender_t;

/* ------------------------------------------------------------ wake-ups */

/* Without polling (WEFT_SHM_SPIN_US=0) every wait on a ring sleeps on its futex word, and with
 * WEFT_SHM_SLEEP_MS long a wake-up that never comes holds its side far past every deadline
 * here: a lost wake-up, of a reader (ping-pongs) or of a writer held by a full 64 KiB ring (both
 * ways full), fails this test instead of costing 50 ms. */
static int wake_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank == 0) {
        for (int i = 0; i < 2000; i++) {
            RANK_CHECK(call_echo(a, 1, 64, i & 0xff) == 0, "ping-pong %d", i);
        }
    }
    /* Both ways full: each ring fills with requests one way and answers the other. */
    int to = 1 - rank;
    weft_future_t *fs[16];
    weft_value_t *vs[16];
    for (int i = 0; i < 16; i++) {
        weft_tensor_t *t;
        int64_t n = (int64_t)256 << 10;
        weft_tensor_empty(WEFT_U8, 1, &n, &t);
        memset(weft_tensor_data(t), (rank * 16 + i) & 0xff, (size_t)n);
        weft_value_create(&vs[i]);
        weft_value_push_tensor(vs[i], t);
        RANK_CHECK(weft_rpc_async(a, to, "echo", vs[i], 20000, &fs[i]) == WEFT_OK, "call %d: %s",
                   i, weft_last_error());
    }
    for (int i = 0; i < 16; i++) {
        RANK_CHECK(weft_future_wait(fs[i], 25000) == WEFT_OK, "call %d: %s", i,
                   weft_future_error(fs[i]));
        weft_value_t *r = weft_future_value(fs[i]);
        RANK_CHECK(weft_tensor_equal(weft_value_tensor(r, 0), weft_value_tensor(vs[i], 0)),
                   "answer %d differs", i);
        weft_future_release(fs[i]);
        weft_value_free(vs[i]);
    }
    weft_shm_stats_t st;
    RANK_CHECK(weft_agent_shm_stats(a, to, &st) == WEFT_OK && st.ring_open && st.writer_waits > 0,
               "no ring, or 4 MiB through a 64 KiB ring without the writer waiting");
    return 0;
}

Test(rpc_shm, no_wake_up_is_lost_when_both_sides_sleep_at_once, .timeout = 120)
{
    setenv("WEFT_SHM_SPIN_US", "0", 1);
    setenv("WEFT_SHM_SLEEP_MS", "120000", 1);
    int rc = run_small_rings(2, wake_body, 100000);
    unsetenv("WEFT_SHM_SPIN_US");
    unsetenv("WEFT_SHM_SLEEP_MS");
    cr_assert_eq(rc, 0);
}

/* ------------------------------------------------------------ results handed to a sink */

typedef struct {
    uint8_t *buf;
    size_t cap, got;
    int pieces, out_of_order;
    bool wait;
} sunk_t;

static weft_future_t *sink_gate; /* never completed: a sink that waits on it waits its time */

static void sink_take(void *arg, size_t off, const void *bytes, size_t n)
{
    sunk_t *k = arg;
    if (k->wait && k->pieces == 0) {
        /* A sink must not block; one that does anyway (a weft wait) must not hand the ring to
         * another reader in the middle of its frame. */
        (void)weft_future_wait(sink_gate, 5);
    }
    if (off != k->got || off + n > k->cap) {
        k->out_of_order++;
        return;
    }
    memcpy(k->buf + off, bytes, n);
    k->got += n;
    k->pieces++;
}

static int sink_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    (void)world;
    if (rank != 0) {
        return 0;
    }
    /* An odd length (the last piece is not whole words) through a 64 KiB ring (pieces split at
     * its end and wherever the writer has got to). */
    const size_t len = ((size_t)1 << 20) + 3;
    int64_t n = (int64_t)len;
    weft_tensor_t *t = NULL;
    weft_value_t *args = NULL;
    RANK_CHECK(weft_tensor_empty(WEFT_U8, 1, &n, &t) == WEFT_OK &&
                   weft_value_create(&args) == WEFT_OK,
               "no memory");
    uint8_t *src = weft_tensor_data(t);
    for (size_t i = 0; i < len; i++) {
        src[i] = (uint8_t)(i * 131 + (i >> 9));
    }
    weft_value_push_tensor(args, t);
    sunk_t k = {.buf = calloc(1, len), .cap = len};
    RANK_CHECK(k.buf != NULL, "no memory");
    weft_rpc_into_t into = {.nbytes = len, .dtype = WEFT_U8, .sink = sink_take, .sink_arg = &k};
    weft_future_t *f = NULL;
    RANK_CHECK(weft_rpc_async_into(a, 1, "echo", args, 20000, &into, 1, &f) == WEFT_OK, "%s",
               weft_last_error());
    RANK_CHECK(weft_future_wait(f, 30000) == WEFT_OK, "%s", weft_future_error(f));
    weft_tensor_t *r = weft_value_tensor(weft_future_value(f), 0);
    RANK_CHECK(r != NULL && weft_tensor_numel(r) == 0 && weft_tensor_dtype(r) == WEFT_U8,
               "the result's tensor is not the empty one in place of the sunk bytes");
    RANK_CHECK(k.out_of_order == 0 && k.got == len, "%d pieces out of order, %zu of %zu bytes",
               k.out_of_order, k.got, len);
    RANK_CHECK(memcmp(k.buf, src, len) == 0, "the sunk bytes differ");
    RANK_CHECK(k.pieces > 1, "1 MiB through a 64 KiB ring came in %d piece", k.pieces);
    weft_future_release(f);

    /* A result that does not fit the entry (another byte count) comes as a tensor of its own;
     * the sink hears nothing of it. */
    sunk_t k2 = {.buf = k.buf, .cap = len};
    into = (weft_rpc_into_t){.nbytes = len - 1, .dtype = WEFT_U8, .sink = sink_take, .sink_arg = &k2};
    RANK_CHECK(weft_rpc_async_into(a, 1, "echo", args, 20000, &into, 1, &f) == WEFT_OK, "%s",
               weft_last_error());
    RANK_CHECK(weft_future_wait(f, 30000) == WEFT_OK, "%s", weft_future_error(f));
    r = weft_value_tensor(weft_future_value(f), 0);
    RANK_CHECK(r != NULL && weft_tensor_equal(r, t), "the unfitting result differs");
    RANK_CHECK(k2.got == 0 && k2.pieces == 0 && k2.out_of_order == 0, "the sink was called");
    weft_future_release(f);

    /* A sink that waits (against the rule) holds the ring, and nothing breaks. */
    sunk_t k3 = {.buf = k.buf, .cap = len, .wait = true};
    memset(k.buf, 0, len);
    RANK_CHECK(weft_future_create(&sink_gate) == WEFT_OK, "no memory");
    into = (weft_rpc_into_t){.nbytes = len, .dtype = WEFT_U8, .sink = sink_take, .sink_arg = &k3};
    RANK_CHECK(weft_rpc_async_into(a, 1, "echo", args, 20000, &into, 1, &f) == WEFT_OK, "%s",
               weft_last_error());
    RANK_CHECK(weft_future_wait(f, 30000) == WEFT_OK, "a waiting sink: %s", weft_future_error(f));
    RANK_CHECK(k3.out_of_order == 0 && k3.got == len && memcmp(k.buf, src, len) == 0,
               "a waiting sink got %zu of %zu bytes, %d out of order", k3.got, len,
               k3.out_of_order);
    weft_future_release(f);
    RANK_CHECK(call_echo(a, 1, 1000, 5) == 0, "the ring is broken after a waiting sink");
    weft_future_release(sink_gate);

    /* An entry with neither memory nor a sink is refused. */
    into = (weft_rpc_into_t){.nbytes = len, .dtype = WEFT_U8};
    RANK_CHECK(weft_rpc_async_into(a, 1, "echo", args, 20000, &into, 1, &f) ==
                   WEFT_ERR_INVALID_ARG,
               "an entry with neither data nor sink was taken");
    free(k.buf);
    weft_value_free(args);
    return 0;
}

Test(rpc_shm, a_result_handed_to_a_sink_comes_whole_and_in_order, .timeout = 90)
{
    cr_assert_eq(run_small_rings(2, sink_body, 80000), 0);
}

/* Sends HELD messages of 16 KiB to rank 1 (4.7 MiB into a 64 KiB ring); every one must be
 * handed over. */
static void *sender_main(void *arg)
{
    sender_t *s = arg;
    for (int i = 0; i < HELD && s->st == WEFT_OK; i++) {
        weft_value_t *v = message(i, 1, 4096);
        weft_future_t *sent = NULL;
        s->st = weft_agent_send(s->a, 1, CHANNEL, v, &sent);
        if (s->st == WEFT_OK) {
            s->st = weft_future_wait(sent, 60000);
            weft_future_release(sent);
            s->sent += s->st == WEFT_OK;
        }
        weft_value_free(v);
    }
    return NULL;
}

static int held_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    (void)world;
    if (rank == 1) {
        inbox.expect = HELD;
        /* The first message's callback holds the ring's reader until the sender has found the
         * ring full. */
        RANK_CHECK(side_wait(60000), "the sender never found the ring full");
        pthread_mutex_lock(&inbox.mu);
        inbox.released = true;
        pthread_cond_broadcast(&inbox.cv);
        pthread_mutex_unlock(&inbox.mu);
        RANK_CHECK(weft_future_wait(inbox.all_in, 60000) == WEFT_OK, "messages missing");
        RANK_CHECK(inbox.next[0] == HELD && inbox.bad == 0, "%d of %d messages, %d bad",
                   inbox.next[0], HELD, inbox.bad);
        return 0;
    }
    sender_t s = {a, WEFT_OK, 0};
    pthread_t t;
    RANK_CHECK(pthread_create(&t, NULL, sender_main, &s) == 0, "thread");
    weft_shm_stats_t ss = {0};
    RANK_WAIT(weft_agent_shm_stats(a, 1, &ss) == WEFT_OK && ss.writer_waits > 0, 60000,
              "the ring never filled");
    side_say();
    pthread_join(t, NULL);
    RANK_CHECK(s.st == WEFT_OK && s.sent == HELD, "%d sent, then %s", s.sent,
               weft_strerror(s.st));
    RANK_CHECK(call_echo(a, 1, 100, 7) == 0, "a call after the flood");
    return 0;
}

Test(rpc_shm, a_full_ring_holds_the_writer_and_drops_nothing, .timeout = 120)
{
    ranks_opts_t o;
    int codes[2];
    setenv("WEFT_SHM_RING_KB", "64", 1);
    cr_assert_eq(pipe(side), 0);
    inbox.block = true;
    ranks_opts_init(&o, 2, held_body);
    o.setup = setup;
    o.deadline_ms = 110000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ------------------------------------------------------------ a peer that exits */

#define LAST_WORDS 500

static int exit_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    (void)world;
    if (rank == 1) {
        /* Everything goes into the ring; then the process ends at once. */
        for (int i = 0; i < LAST_WORDS; i++) {
            weft_value_t *v = message(i, 50, 20000);
            RANK_CHECK(weft_agent_send(a, 0, CHANNEL, v, NULL) == WEFT_OK, "send %d", i);
            weft_value_free(v);
        }
        /* Once every one is in the ring (the first ones may wait for it to open). */
        weft_shm_stats_t s = {0};
        RANK_WAIT(weft_agent_shm_stats(a, 0, &s) == WEFT_OK && s.frames_sent >= LAST_WORDS,
                  60000, "%llu of the messages went into the ring",
                  (unsigned long long)s.frames_sent);
        _exit(0);
    }
    inbox.expect = 0;
    RANK_CHECK(weft_future_wait(inbox.lost, 60000) == WEFT_ERR_PEER_LOST, "rank 1 never lost");
    /* Lost only after every message it wrote before it went was delivered, in order. */
    RANK_CHECK(atomic_load(&inbox.received_at_loss) == LAST_WORDS && inbox.bad == 0,
               "%d of %d messages delivered before the loss, %d bad",
               atomic_load(&inbox.received_at_loss), LAST_WORDS, inbox.bad);
    weft_status_t st = weft_rpc_sync(a, 1, "echo", NULL, 10000, NULL);
    RANK_CHECK(st == WEFT_ERR_PEER_LOST, "a call to the lost rank gave %s", weft_strerror(st));
    return 0;
}

Test(rpc_shm, a_peer_that_exits_has_all_it_wrote_delivered_first, .timeout = 90)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, exit_body);
    o.setup = setup;
    o.no_shutdown = 1;
    o.deadline_ms = 80000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ------------------------------------------------------------ death with the ring full */

static int death_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    (void)world;
    if (rank == 1) {
        /* Held in its first callback (never let go) until the ring is full; then it dies. */
        RANK_CHECK(side_wait(60000), "the sender never found the ring full");
        _exit(0);
    }
    sender_t s = {a, WEFT_OK, 0};
    pthread_t t;
    RANK_CHECK(pthread_create(&t, NULL, sender_main, &s) == 0, "thread");
    weft_shm_stats_t ss = {0};
    RANK_WAIT(weft_agent_shm_stats(a, 1, &ss) == WEFT_OK && ss.writer_waits > 0, 60000,
              "the ring never filled");
    side_say();
    /* The writer held by the full ring fails: the peer is lost; nothing waits forever. */
    pthread_join(t, NULL);
    RANK_CHECK(s.st == WEFT_ERR_PEER_LOST && s.sent < HELD, "%d sent, then %s", s.sent,
               weft_strerror(s.st));
    RANK_CHECK(weft_future_wait(inbox.lost, 60000) == WEFT_ERR_PEER_LOST, "rank 1 never lost");
    weft_status_t st = weft_rpc_sync(a, 1, "echo", NULL, 10000, NULL);
    RANK_CHECK(st == WEFT_ERR_PEER_LOST, "a call to the lost rank gave %s", weft_strerror(st));
    return 0;
}

Test(rpc_shm, a_peer_that_dies_with_its_ring_full_fails_the_writer, .timeout = 90)
{
    ranks_opts_t o;
    int codes[2];
    setenv("WEFT_SHM_RING_KB", "64", 1);
    cr_assert_eq(pipe(side), 0);
    inbox.block = true;
    ranks_opts_init(&o, 2, death_body);
    o.setup = setup;
    o.no_shutdown = 1;
    o.deadline_ms = 80000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ------------------------------------------------------------ mixed transports */

/* Rank 2 is "on another host" (its own WEFT_SHM_HOST_TAG), rank 3 has WEFT_SHM=0; ranks 0 and 1
 * share rings. Every pair works, in order, by whatever way it has. */
static int mixed_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    inbox.expect = 200;
    for (int i = 0; i < 200; i++) {
        weft_value_t *v = message(i, 40, 100000);
        for (int r = 0; r < world; r++) {
            if (r != rank) {
                RANK_CHECK(weft_agent_send(a, r, CHANNEL, v, NULL) == WEFT_OK, "send");
            }
        }
        weft_value_free(v);
    }
    for (int r = 0; r < world; r++) {
        if (r != rank) {
            RANK_CHECK(call_echo(a, r, 300000, r) == 0, "echo to %d", r);
        }
    }
    RANK_CHECK(weft_future_wait(inbox.all_in, 60000) == WEFT_OK, "messages missing");
    RANK_CHECK(inbox.bad == 0, "%d messages out of order or wrong", inbox.bad);
    for (int r = 0; r < world; r++) {
        if (r == rank) {
            continue;
        }
        weft_shm_stats_t s;
        RANK_CHECK(weft_agent_shm_stats(a, r, &s) == WEFT_OK, "stats");
        bool rings = rank < 2 && r < 2;
        RANK_CHECK(s.ring_open == rings && (s.frames_sent > 0) == rings &&
                       (s.frames_received > 0) == rings,
                   "rank %d: ring %d, %llu frames sent, %llu received", r, (int)s.ring_open,
                   (unsigned long long)s.frames_sent, (unsigned long long)s.frames_received);
    }
    RANK_CHECK(weft_agent_worker_shm_address(a, 3)[0] == '\0', "rank 3 advertises %s",
               weft_agent_worker_shm_address(a, 3));
    RANK_CHECK(weft_agent_worker_shm_address(a, 2)[0] != '\0', "rank 2 advertises none");
    return 0;
}

Test(rpc_shm, ranks_on_other_hosts_or_without_rings_use_the_network, .timeout = 120)
{
    ranks_opts_t o;
    int codes[4];
    ranks_opts_init(&o, 4, mixed_body);
    o.setup = setup;
    o.rank_env[2] = "WEFT_SHM_HOST_TAG=another-host";
    o.rank_env[3] = "WEFT_SHM=0";
    o.deadline_ms = 110000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ------------------------------------------------------------ refused handshakes */

static int refused_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    if (rank == 0) {
        RANK_CHECK(weft_future_wait(inbox.all_in, 60000) == WEFT_OK, "rank 1 never finished");
        return 0;
    }
    RANK_CHECK(call_echo(a, 0, 10, 1) == 0, "first call"); /* the real ring is open */
    const char *name = weft_agent_worker_shm_address(a, 0);
    static const struct {
        uint32_t magic, version;
        bool proven;
        rawpeer_ring_t ring;
        int status;
        const char *text;
    } cases[] = {
        {0x12345678u, 1, true, RAWPEER_RING_GOOD, WEFT_ERR_PROTOCOL, "bad handshake"},
        {0x4d544657u, 9, true, RAWPEER_RING_GOOD, WEFT_ERR_VERSION, "version 9"},
        {0x4d544657u, 1, false, RAWPEER_RING_GOOD, WEFT_ERR_AUTH, "did not prove"},
        {0x4d544657u, 1, true, RAWPEER_RING_NONE, WEFT_ERR_PROTOCOL, "no ring memory"},
        {0x4d544657u, 1, true, RAWPEER_RING_UNSEALED, WEFT_ERR_PROTOCOL, "sealed"},
        {0x4d544657u, 1, true, RAWPEER_RING_BAD_HEAD, WEFT_ERR_PROTOCOL, "header"},
        {0x4d544657u, 1, true, RAWPEER_RING_GOOD, WEFT_ERR_ALREADY_EXISTS, "already"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        uint8_t ch[32];
        char why[512];
        int fd = rawpeer_shm_open(name, ch);
        RANK_CHECK(fd >= 0, "case %zu: cannot reach %s", i, name);
        int st = rawpeer_shm_hello(fd, cases[i].magic, cases[i].version, ch, 0, 1, world, "",
                                   cases[i].proven ? a : NULL, cases[i].ring, why, sizeof(why));
        close(fd);
        RANK_CHECK(st == cases[i].status && strstr(why, cases[i].text) != NULL,
                   "case %zu: %d (%s)", i, st, why);
    }
    /* The real rings still work, both ways. */
    RANK_CHECK(call_echo(a, 0, 70000, 2) == 0, "a call after the refusals");
    weft_shm_stats_t s;
    RANK_CHECK(weft_agent_shm_stats(a, 0, &s) == WEFT_OK && s.ring_open && s.frames_received >= 2,
               "the ring is gone");
    weft_value_t *v = message(0, 0, 0);
    RANK_CHECK(weft_agent_send(a, 0, CHANNEL, v, NULL) == WEFT_OK, "done");
    weft_value_free(v);
    return 0;
}

Test(rpc_shm, handshakes_that_do_not_prove_a_rank_or_bring_a_bad_ring_are_refused,
     .timeout = 90)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, refused_body);
    o.setup = setup;
    o.deadline_ms = 80000;
    inbox.expect = 1;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ------------------------------------------------------------ a ring its writer breaks */

/* Rank 1 runs with WEFT_SHM=0 and opens a ring to rank 0 by hand (proving its rank), writes one
 * good message, then breaks the ring as @p how says: rank 0 delivers the good one, closes the
 * ring and declares rank 1 lost with the reason, and nothing hangs. */
typedef enum { BREAK_ENVELOPE_LENGTH, BREAK_ENVELOPE_BYTES, BREAK_HEAD } break_t;

static break_t breaking;

static int broken_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    if (rank == 0) {
        inbox.expect = 0;
        RANK_CHECK(weft_future_wait(inbox.lost, 30000) == WEFT_ERR_PEER_LOST, "rank 1 never lost");
        const char *why = weft_future_error(inbox.lost);
        const char *want[] = {"an envelope of 2147483647 bytes", "does not decode",
                              "writer's position is impossible"};
        RANK_CHECK(strstr(why, "broke its shared-memory ring") != NULL &&
                       strstr(why, want[breaking]) != NULL,
                   "loss: %s", why);
        RANK_CHECK(inbox.next[1] == 1 && inbox.bad == 0, "%d good messages, %d bad", inbox.next[1],
                   inbox.bad);
        return 0;
    }
    rawpeer_shm_t r;
    char why[512];
    int st = rawpeer_shm_ring(weft_agent_worker_shm_address(a, 0), 0, 1, world, "", a, &r, why,
                              sizeof(why));
    RANK_CHECK(st == 0, "ring refused: %d (%s)", st, why);
    uint8_t buf[256];
    int seq = 0;
    Weft__V1__Envelope e = WEFT__V1__ENVELOPE__INIT;
    e.kind = WEFT__V1__KIND__KIND_ONEWAY;
    e.channel = CHANNEL;
    e.src_rank = 1;
    e.payload_bytes = sizeof(seq);
    size_t n = rawpeer_frame(buf, sizeof(buf), &e, &seq, sizeof(seq));
    rawpeer_shm_write(&r, buf, n);
    /* Read (the reader's tail has reached it) before the ring breaks. */
    RANK_WAIT(__atomic_load_n((uint64_t *)(r.mem + 192), __ATOMIC_ACQUIRE) == r.head, 30000,
              "rank 0 never read the good message");
    uint8_t bad[16] = {0xff, 0xff, 0xff, 0x7f};
    switch (breaking) {
    case BREAK_ENVELOPE_LENGTH:
        rawpeer_shm_write(&r, bad, 4); /* 2^31 - 1 bytes of envelope */
        break;
    case BREAK_ENVELOPE_BYTES:
        bad[0] = 12, bad[1] = bad[2] = bad[3] = 0;
        memset(bad + 4, 0xff, 12); /* 12 bytes that are no protobuf */
        rawpeer_shm_write(&r, bad, 16);
        break;
    case BREAK_HEAD:
        rawpeer_shm_set_head(&r, r.head + (1u << 20)); /* 1 MiB ahead in a 64 KiB ring */
        break;
    }
    /* Rank 0 closes the ring's socket once it gave up on it. */
    RANK_CHECK(rawpeer_closed_within(r.fd, 30000), "rank 0 kept reading a broken ring");
    rawpeer_shm_close(&r);
    return 0;
}

static void run_broken(break_t how)
{
    ranks_opts_t o;
    int codes[2];
    breaking = how;
    ranks_opts_init(&o, 2, broken_body);
    o.setup = setup;
    o.rank_env[1] = "WEFT_SHM=0";
    o.no_shutdown = 1;
    o.deadline_ms = 60000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

Test(rpc_shm, a_ring_whose_envelope_length_is_impossible_ends_and_its_rank_is_lost, .timeout = 90)
{
    run_broken(BREAK_ENVELOPE_LENGTH);
}

Test(rpc_shm, a_ring_whose_envelope_does_not_decode_ends_and_its_rank_is_lost, .timeout = 90)
{
    run_broken(BREAK_ENVELOPE_BYTES);
}

Test(rpc_shm, a_ring_whose_head_runs_past_its_tail_ends_and_its_rank_is_lost, .timeout = 90)
{
    run_broken(BREAK_HEAD);
}
