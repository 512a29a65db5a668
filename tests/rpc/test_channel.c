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

static void on_message(void *state, int src, weft_value_t *msg)
{
    (void)state;
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

static weft_status_t inbox_create(weft_agent_t *a, void **state_p)
{
    (void)a;
    *state_p = &inbox;
    return WEFT_OK;
}

static const weft_module_desc_t inbox_module = {
    .name = "inbox", .channel = CHANNEL, .create = inbox_create, .on_message = on_message};
static const weft_module_desc_t other_module = {
    .name = "other", .channel = CHANNEL, .create = inbox_create};
static const weft_module_desc_t channel0_module = {
    .name = "zero", .channel = 0, .create = inbox_create};
static const weft_module_desc_t no_create_module = {.name = "none", .channel = 65};

static void setup(weft_agent_t *a, int rank, void *arg)
{
    void *state;
    (void)rank;
    (void)arg;
    inbox.world = weft_agent_world_size(a);
    weft_future_create(&inbox.all_in);
    weft_agent_module(a, &inbox_module, &state);
}

static int body(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    void *state = NULL;
    RANK_CHECK(weft_agent_module(a, &inbox_module, &state) == WEFT_OK && state == &inbox,
               "the same module again: its state");
    RANK_CHECK(weft_agent_module(a, &other_module, &state) == WEFT_ERR_ALREADY_EXISTS,
               "another module on a channel taken");
    RANK_CHECK(weft_agent_module(a, &channel0_module, &state) == WEFT_ERR_INVALID_ARG,
               "channel 0");
    RANK_CHECK(weft_agent_module(a, &no_create_module, &state) == WEFT_ERR_INVALID_ARG,
               "no create callback");
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
