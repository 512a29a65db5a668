/* Module channels: one-way messages arrive once each, in the order sent,
 * mixed small and large; sent futures complete; bad channels are refused. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <string.h>

#include "ranks.h"

#define CHANNEL 64
#define COUNT   2000

typedef struct {
    pthread_mutex_t mu;
    int received[8]; /* per source rank: next expected sequence number */
    int bad;
    weft_future_t *all_in;
    int world;
} inbox_t;

static inbox_t inbox = {PTHREAD_MUTEX_INITIALIZER, {0}, 0, NULL, 0};

static void on_message(weft_agent_t *a, int src, weft_value_t *msg, void *arg)
{
    (void)a;
    (void)arg;
    size_t len;
    const int *seq = weft_value_payload(msg, &len);
    pthread_mutex_lock(&inbox.mu);
    if (seq == NULL || len != sizeof(int) || src < 0 || src >= 8 || *seq != inbox.received[src]) {
        inbox.bad++;
    } else {
        /* Every 100th message carries a 1.5 MiB tensor: check its bytes. */
        if (*seq % 100 == 0) {
            weft_tensor_t *t = weft_value_tensor(msg, 0);
            const float *p = t != NULL ? weft_tensor_data(t) : NULL;
            if (p == NULL || weft_tensor_numel(t) != 393216 || p[0] != (float)*seq ||
                p[393215] != (float)*seq + 393215.0f) {
                inbox.bad++;
            }
        }
        inbox.received[src]++;
    }
    int done = 1;
    for (int r = 0; r < inbox.world; r++) {
        done &= inbox.received[r] == COUNT;
    }
    pthread_mutex_unlock(&inbox.mu);
    if (done) {
        weft_future_complete(inbox.all_in, WEFT_OK, NULL, NULL);
    }
    weft_value_free(msg);
}

static void setup(weft_agent_t *a, int rank, void *arg)
{
    (void)rank;
    (void)arg;
    inbox.world = weft_agent_world_size(a);
    weft_future_create(&inbox.all_in);
    weft_agent_register_channel(a, CHANNEL, on_message, NULL);
}

static int body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    RANK_CHECK(weft_agent_register_channel(a, CHANNEL, on_message, NULL) == WEFT_ERR_ALREADY_EXISTS,
               "second registration");
    RANK_CHECK(weft_agent_register_channel(a, 0, on_message, NULL) == WEFT_ERR_INVALID_ARG,
               "channel 0");
    RANK_CHECK(weft_agent_send(a, 0, WEFT_CHANNEL_MAX + 1, NULL, NULL) == WEFT_ERR_INVALID_ARG,
               "channel out of range");
    weft_future_t *last[8] = {NULL};
    for (int i = 0; i < COUNT; i++) {
        for (int to = 0; to < world; to++) {
            weft_value_t *m;
            weft_value_create(&m);
            weft_value_set_payload(m, &i, sizeof(i));
            if (i % 100 == 0) {
                weft_tensor_t *t = tensor_f32_range(393216, (float)i);
                weft_value_push_tensor(m, t);
            }
            weft_future_t **sent = i == COUNT - 1 ? &last[to] : NULL;
            weft_status_t st = weft_agent_send(a, to, CHANNEL, m, sent);
            weft_value_free(m);
            RANK_CHECK(st == WEFT_OK, "send %d to %d: %s", i, to, weft_last_error());
        }
    }
    for (int to = 0; to < world; to++) {
        RANK_CHECK(weft_future_wait(last[to], 20000) == WEFT_OK, "sent future to %d", to);
        weft_future_release(last[to]);
    }
    RANK_CHECK(weft_future_wait(inbox.all_in, 30000) == WEFT_OK, "rank %d got %d/%d/%d", rank,
               inbox.received[0], inbox.received[1], inbox.received[2]);
    RANK_CHECK(inbox.bad == 0, "%d messages out of order or damaged", inbox.bad);
    weft_future_release(inbox.all_in);
    return 0;
}

Test(rpc_channel, ordered_one_way_messages_between_3_ranks, .timeout = 120)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body);
    o.setup = setup;
    o.deadline_ms = 110000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* ------------------------------------------------------------ lazy sends */

#define LAZY_CHANNEL 65
#define LAZY_COUNT   6

static struct {
    pthread_mutex_t mu;
    int next; /* next expected sequence number */
    int bad;
    weft_future_t *all_in;
} lazy_inbox = {PTHREAD_MUTEX_INITIALIZER, 0, 0, NULL};

static void on_lazy(weft_agent_t *a, int src, weft_value_t *msg, void *arg)
{
    (void)a;
    (void)arg;
    size_t len;
    const int *seq = weft_value_payload(msg, &len);
    pthread_mutex_lock(&lazy_inbox.mu);
    if (src != 0 || seq == NULL || len != sizeof(int) || *seq != lazy_inbox.next) {
        lazy_inbox.bad++;
    } else {
        lazy_inbox.next++;
    }
    bool done = lazy_inbox.next == LAZY_COUNT;
    pthread_mutex_unlock(&lazy_inbox.mu);
    if (done) {
        weft_future_complete(lazy_inbox.all_in, WEFT_OK, NULL, NULL);
    }
    weft_value_free(msg);
}

static void lazy_setup(weft_agent_t *a, int rank, void *arg)
{
    (void)rank;
    (void)arg;
    weft_future_create(&lazy_inbox.all_in);
    weft_agent_register_channel(a, LAZY_CHANNEL, on_lazy, NULL);
}

static weft_status_t send_seq(weft_agent_t *a, int seq, uint32_t flags, weft_future_t **sent_p)
{
    weft_value_t *m;
    weft_value_create(&m);
    weft_value_set_payload(m, &seq, sizeof(seq));
    weft_status_t st = weft_agent_send_flags(a, 1, LAZY_CHANNEL, m, flags, sent_p);
    weft_value_free(m);
    return st;
}

static int lazy_body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank == 0) {
        weft_future_t *f[LAZY_COUNT];
        /* 0 leaves at once; once it is out the stream is idle. */
        RANK_CHECK(send_seq(a, 0, 0, &f[0]) == WEFT_OK, "send 0: %s", weft_last_error());
        RANK_CHECK(weft_future_wait(f[0], 20000) == WEFT_OK, "0 sent");
        /* 1 and 2 are lazy on an idle stream: they wait... */
        RANK_CHECK(send_seq(a, 1, WEFT_SEND_LAZY, &f[1]) == WEFT_OK, "send 1");
        RANK_CHECK(send_seq(a, 2, WEFT_SEND_LAZY, &f[2]) == WEFT_OK, "send 2");
        /* Nothing else goes to rank 1 in this test: they are still there much later. */
        RANK_CHECK(weft_future_wait(f[2], 300) == WEFT_ERR_TIMEOUT && !weft_future_done(f[1]),
                   "lazy messages left alone");
        RANK_CHECK(weft_agent_lazy_waiting(a, 1) == 1, "they wait");
        /* ... for the next message that is not lazy, which takes them along, in order. */
        RANK_CHECK(send_seq(a, 3, 0, &f[3]) == WEFT_OK, "send 3");
        RANK_CHECK(weft_future_wait(f[3], 20000) == WEFT_OK, "3 sent");
        RANK_CHECK(weft_future_done(f[1]) && weft_future_done(f[2]), "lazy messages went with 3");
        RANK_CHECK(weft_agent_lazy_waiting(a, 1) == 0, "none waits");
        /* Or for a flush. */
        RANK_CHECK(send_seq(a, 4, WEFT_SEND_LAZY, &f[4]) == WEFT_OK, "send 4");
        RANK_CHECK(send_seq(a, 5, WEFT_SEND_LAZY, &f[5]) == WEFT_OK, "send 5");
        RANK_CHECK(weft_future_wait(f[5], 300) == WEFT_ERR_TIMEOUT && !weft_future_done(f[4]),
                   "lazy messages left alone");
        RANK_CHECK(weft_agent_flush(a, 1) == WEFT_OK, "flush: %s", weft_last_error());
        RANK_CHECK(weft_future_wait(f[5], 20000) == WEFT_OK, "5 sent after the flush");
        RANK_CHECK(weft_agent_flush(a, 1) == WEFT_OK, "a flush with nothing waiting");
        RANK_CHECK(weft_agent_flush(a, 7) == WEFT_ERR_INVALID_ARG, "flush to a rank not there");
        RANK_CHECK(weft_agent_lazy_waiting(a, 7) == 0, "none waits for a rank not there");
        for (int i = 0; i < LAZY_COUNT; i++) {
            RANK_CHECK(weft_future_status(f[i]) == WEFT_OK, "sent %d", i);
            weft_future_release(f[i]);
        }
    } else {
        RANK_CHECK(weft_future_wait(lazy_inbox.all_in, 30000) == WEFT_OK, "got %d of %d",
                   lazy_inbox.next, LAZY_COUNT);
        RANK_CHECK(lazy_inbox.bad == 0, "%d messages out of order", lazy_inbox.bad);
    }
    weft_future_release(lazy_inbox.all_in);
    return 0;
}

Test(rpc_channel, lazy_messages_wait_for_the_next_send_or_a_flush, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, lazy_body);
    o.setup = lazy_setup;
    o.deadline_ms = 50000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}
