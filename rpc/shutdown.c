/* Collective graceful shutdown. Every rank waits until it is passive (no
 * call of its own pending, no incoming call unanswered), then reports its
 * counters of requests sent and received to rank 0 ("__weft.shutdown").
 * Rank 0 answers a round once every live rank has reported: the world is
 * quiet when, in two consecutive rounds, every rank was passive with the same
 * counters and all requests sent were received (a four-counter termination
 * test); otherwise everyone waits and reports again. Before it, the modules settle their state
 * (their on_shutdown) while the RPC layer still works. */
#include <string.h>
#include <time.h>

#include "internal.h"

typedef struct weft__sd_state {
    uint64_t round;
    int reported;
    weft_call_t **calls;
    uint64_t *sent, *recv;           /* this round */
    uint64_t *prev_sent, *prev_recv; /* the previous round */
    bool prev_valid;
    bool *lost;
    int64_t reply_gap_ms; /* WEFT_SHUTDOWN_FAULT_GAP_MS */
} sd_state_t;

static void put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) {
        p[i] = (uint8_t)(v >> (8 * i));
    }
}

static uint64_t get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) {
        v |= (uint64_t)p[i] << (8 * i);
    }
    return v;
}

static int live_ranks(weft_agent_t *a, sd_state_t *sd)
{
    int n = 0;
    for (int i = 0; i < a->world_size; i++) {
        n += sd->lost[i] ? 0 : 1;
    }
    return n;
}

/* Every live rank reported: decide and answer them all. Called with sd_mu held. */
static void decide_locked(weft_agent_t *a, sd_state_t *sd)
{
    uint64_t sent = 0, recv = 0;
    bool same = sd->prev_valid;
    bool any_lost = false;

    for (int i = 0; i < a->world_size; i++) {
        if (sd->lost[i]) {
            any_lost = true;
            continue;
        }
        sent += sd->sent[i];
        recv += sd->recv[i];
        if (sd->prev_sent[i] != sd->sent[i] || sd->prev_recv[i] != sd->recv[i]) {
            same = false;
        }
    }
    /* With a lost rank, requests to it can never be counted as received. */
    bool done = same && (any_lost || sent == recv);
    WEFT_DEBUG("shutdown round %llu: sent %llu received %llu same %d -> %s",
               (unsigned long long)sd->round, (unsigned long long)sent, (unsigned long long)recv,
               same, done ? "done" : "again");
    for (int i = 0; i < a->world_size; i++) {
        sd->prev_sent[i] = sd->sent[i];
        sd->prev_recv[i] = sd->recv[i];
    }
    sd->prev_valid = true;
    sd->round++;
    sd->reported = 0;
    /* The other ranks' answers first, this rank's own last: once its own barrier has its answer
     * it may close its streams, and an answer that must take one of them (to a report that came
     * on a direct connection, while this rank's own connection there is not open) would then be
     * refused as the stream closes, and its rank wait for it until the close's deadline. */
    for (int k = 0; k < a->world_size; k++) {
        int i = (a->rank + 1 + k) % a->world_size;
        weft_call_t *c = sd->calls[i];
        sd->calls[i] = NULL;
        if (c == NULL) {
            continue;
        }
        weft_value_t *v;
        uint8_t b = done ? 1 : 0;
        if (weft_value_create(&v) == WEFT_OK && weft_value_set_payload(v, &b, 1) == WEFT_OK) {
            weft_call_reply(c, v);
        } else {
            weft_value_free(v);
            weft_call_fail(c, WEFT_ERR_NO_MEMORY, "no memory");
        }
        if (i == a->rank && done && sd->reply_gap_ms > 0) {
            /* tests (WEFT_SHUTDOWN_FAULT_GAP_MS): what a thread preempted right after answering
             * this rank's own last report would do; no answer may come after it. */
            struct timespec ts = {sd->reply_gap_ms / 1000, (sd->reply_gap_ms % 1000) * 1000000};
            weft__blocking(1); /* as a send waiting for room would: another thread serves */
            nanosleep(&ts, NULL);
            weft__blocking(0);
        }
    }
}

static void shutdown_handler(weft_call_t *call, void *arg)
{
    weft_agent_t *a = arg;
    sd_state_t *sd = a->sd;
    size_t len;
    const uint8_t *p = weft_value_payload(weft_call_args(call), &len);
    int r = weft_call_caller_rank(call);

    if (sd == NULL || a->rank != 0) {
        weft_call_fail(call, WEFT_ERR_INVALID_STATE, "shutdown reports go to rank 0");
        return;
    }
    if (p == NULL || len != 24 || r < 0 || r >= a->world_size) {
        weft_call_fail(call, WEFT_ERR_PROTOCOL, "malformed shutdown report");
        return;
    }
    uint64_t round = get_u64(p);
    pthread_mutex_lock(&a->sd_mu);
    if (sd->lost[r]) {
        pthread_mutex_unlock(&a->sd_mu);
        weft_call_fail(call, WEFT_ERR_PEER_LOST, "rank %d was declared lost by rank 0", r);
        return;
    }
    if (sd->calls[r] != NULL) {
        pthread_mutex_unlock(&a->sd_mu);
        weft_call_fail(call, WEFT_ERR_PROTOCOL, "rank %d reported twice in round %llu", r,
                       (unsigned long long)round);
        return;
    }
    if (round != sd->round) {
        pthread_mutex_unlock(&a->sd_mu);
        weft_call_fail(call, WEFT_ERR_PROTOCOL, "shutdown report for round %llu, expected %llu",
                       (unsigned long long)round, (unsigned long long)sd->round);
        return;
    }
    sd->calls[r] = call;
    sd->sent[r] = get_u64(p + 8);
    sd->recv[r] = get_u64(p + 16);
    sd->reported++;
    if (sd->reported >= live_ranks(a, sd)) {
        decide_locked(a, sd);
    }
    pthread_mutex_unlock(&a->sd_mu);
}

void weft__shutdown_peer_lost(weft_agent_t *a, int rank)
{
    sd_state_t *sd = a->sd;

    if (sd == NULL) {
        return;
    }
    pthread_mutex_lock(&a->sd_mu);
    if (!sd->lost[rank]) {
        sd->lost[rank] = true;
        if (sd->calls[rank] != NULL) {
            sd->reported--;
            weft_call_t *c = sd->calls[rank];
            sd->calls[rank] = NULL;
            weft_call_fail(c, WEFT_ERR_PEER_LOST, "lost");
        }
        if (sd->reported > 0 && sd->reported >= live_ranks(a, sd)) {
            decide_locked(a, sd);
        }
    }
    pthread_mutex_unlock(&a->sd_mu);
}

void weft__shutdown_register(weft_agent_t *a)
{
    (void)weft_rpc_register(a, WEFT__SHUTDOWN_FN, shutdown_handler, a);
    if (a->rank != 0) {
        return;
    }
    sd_state_t *sd = weft_calloc(1, sizeof(*sd));
    if (sd == NULL) {
        return;
    }
    size_t n = (size_t)a->world_size;
    sd->calls = weft_calloc(n, sizeof(*sd->calls));
    sd->sent = weft_calloc(n, sizeof(uint64_t));
    sd->recv = weft_calloc(n, sizeof(uint64_t));
    sd->prev_sent = weft_calloc(n, sizeof(uint64_t));
    sd->prev_recv = weft_calloc(n, sizeof(uint64_t));
    sd->lost = weft_calloc(n, sizeof(bool));
    sd->reply_gap_ms = weft__cfg_int(WEFT__CFG_SHUTDOWN_FAULT_GAP_MS);
    a->sd = sd;
    if (sd->calls == NULL || sd->sent == NULL || sd->recv == NULL || sd->prev_sent == NULL ||
        sd->prev_recv == NULL || sd->lost == NULL) {
        weft__shutdown_free(a);
        return;
    }
}

void weft__shutdown_free(weft_agent_t *a)
{
    sd_state_t *sd = a->sd;

    if (sd == NULL) {
        return;
    }
    weft_free(sd->calls);
    weft_free(sd->sent);
    weft_free(sd->recv);
    weft_free(sd->prev_sent);
    weft_free(sd->prev_recv);
    weft_free(sd->lost);
    weft_free(sd);
    a->sd = NULL;
}

/* Waits until this rank has no call of its own pending and no incoming call unanswered (woken
 * when either count reaches 0). */
static weft_status_t wait_passive(weft_agent_t *a, int64_t deadline_ns)
{
    weft_status_t st = WEFT_OK;

    pthread_mutex_lock(&a->pend_mu);
    while (atomic_load(&a->pending_user) > 0 || atomic_load(&a->calls_in_progress) > 0) {
        if (weft__now_ns() >= deadline_ns) {
            st = weft__set_error(WEFT_ERR_TIMEOUT,
                                 "shutdown: %lld calls of this rank still pending and %lld "
                                 "incoming calls unanswered at the deadline",
                                 (long long)atomic_load(&a->pending_user),
                                 (long long)atomic_load(&a->calls_in_progress));
            break;
        }
        struct timespec ts = {deadline_ns / 1000000000LL, deadline_ns % 1000000000LL};
        pthread_cond_timedwait(&a->passive_cv, &a->pend_mu, &ts);
    }
    pthread_mutex_unlock(&a->pend_mu);
    return st;
}

weft_status_t weft__shutdown_barrier(weft_agent_t *a, int64_t deadline_ns)
{
    weft_value_t *v;
    uint8_t buf[24];

    WEFT_CHECK(weft_value_create(&v));
    for (uint64_t round = 0;; round++) {
        weft_status_t st = wait_passive(a, deadline_ns);
        if (st != WEFT_OK) {
            weft_value_free(v);
            return st;
        }
        put_u64(buf, round);
        put_u64(buf + 8, atomic_load(&a->requests_sent));
        put_u64(buf + 16, atomic_load(&a->requests_received));
        if ((st = weft_value_set_payload(v, buf, sizeof(buf))) != WEFT_OK) {
            weft_value_free(v);
            return st;
        }
        int64_t delay_ms = weft__cfg_int(WEFT__CFG_SHUTDOWN_FAULT_DELAY_MS);
        if (delay_ms > 0) {
            /* tests (WEFT_SHUTDOWN_FAULT_DELAY_MS): this rank's reports come last */
            struct timespec ts = {delay_ms / 1000, (delay_ms % 1000) * 1000000};
            nanosleep(&ts, NULL);
        }
        int64_t left_ms = (deadline_ns - weft__now_ns()) / 1000000;
        if (left_ms <= 0) {
            weft_value_free(v);
            return weft__set_error(WEFT_ERR_TIMEOUT, "shutdown: the world did not settle in time");
        }
        weft_future_t *f;
        st = weft__rpc_async(a, 0, WEFT__SHUTDOWN_FN, v, left_ms, true, &f);
        if (st != WEFT_OK) {
            weft_value_free(v);
            return st;
        }
        st = weft_future_wait(f, left_ms + 1000);
        if (st != WEFT_OK) {
            char why[1024];
            snprintf(why, sizeof(why), "%s",
                     weft_future_done(f) ? weft_future_error(f) : "rank 0 did not answer");
            weft_future_release(f);
            weft_value_free(v);
            return weft__set_error(st, "shutdown: %s", why);
        }
        size_t len;
        const uint8_t *p = weft_value_payload(weft_future_value(f), &len);
        bool done = p != NULL && len == 1 && p[0] == 1;
        weft_future_release(f);
        if (done) {
            break;
        }
    }
    weft_value_free(v);
    return WEFT_OK;
}
