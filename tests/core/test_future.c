/* core: futures (complete, wait, callbacks, wait_all/wait_any, block hook). */
#include <criterion/criterion.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "counting_alloc.h"
#include "internal.h"
#include "wait.h"

/* n_alloc, n_free, counting, use_counting, check_balanced */

TestSuite(future, .init = use_counting, .timeout = 30);

static weft_future_t *new_future(void)
{
    weft_future_t *f = NULL;

    cr_assert_eq(weft_future_create(&f), WEFT_OK);
    return f;
}

static weft_value_t *string_value(const char *s)
{
    weft_value_t *v = NULL;

    cr_assert_eq(weft_value_create(&v), WEFT_OK);
    cr_assert_eq(weft_value_set_string(v, s), WEFT_OK);
    return v;
}

/* ---- a thread that completes a future after a delay, or once a counter reaches a value ---- */

typedef struct {
    weft_future_t *f; /* own reference, released by the thread */
    int delay_ms;
    atomic_int *counter; /* if not NULL: complete once it reaches at_least (10 s at most) */
    int at_least;
    weft_status_t status;
    const char *text;
    pthread_t th;
} completer_t;

static void *completer_main(void *arg)
{
    completer_t *c = arg;

    if (c->counter != NULL) {
        bool reached;

        WAIT_UNTIL(reached, atomic_load(c->counter) >= c->at_least, 10000);
        (void)reached; /* the waiter's own assertions fail if it never came */
    } else {
        /* The delay only makes it likely that the waiter sleeps first; what the tests check
         * holds whichever comes first. */
        usleep((useconds_t)c->delay_ms * 1000);
    }
    weft_future_complete(c->f, c->status, c->text, NULL);
    weft_future_release(c->f);
    return NULL;
}

static void complete_later(completer_t *c, weft_future_t *f, int delay_ms, weft_status_t status,
                           const char *text)
{
    c->f = weft_future_retain(f);
    c->delay_ms = delay_ms;
    c->counter = NULL;
    c->status = status;
    c->text = text;
    cr_assert_eq(pthread_create(&c->th, NULL, completer_main, c), 0);
}

/* Completes @p f once @p counter reaches @p at_least. */
static void complete_when(completer_t *c, weft_future_t *f, atomic_int *counter, int at_least,
                          weft_status_t status, const char *text)
{
    c->f = weft_future_retain(f);
    c->delay_ms = 0;
    c->counter = counter;
    c->at_least = at_least;
    c->status = status;
    c->text = text;
    cr_assert_eq(pthread_create(&c->th, NULL, completer_main, c), 0);
}

static void join_completer(completer_t *c)
{
    pthread_join(c->th, NULL);
}

/* ---- basics ---- */

Test(future, pending_state)
{
    weft_future_t *f = new_future();
    weft_value_t *sentinel = (weft_value_t *)(uintptr_t)0x99;
    weft_value_t *v = sentinel;

    cr_assert_not(weft_future_done(f));
    cr_assert_eq(weft_future_status(f), WEFT_ERR_PENDING);
    cr_assert_str_eq(weft_future_error(f), "");
    cr_assert_null(weft_future_value(f));
    cr_assert_eq(weft_future_take_value(f, &v), WEFT_ERR_PENDING);
    cr_assert_eq(v, sentinel);
    cr_assert_eq(weft_future_wait(f, 1), WEFT_ERR_TIMEOUT);
    weft_future_release(weft_future_retain(f));
    weft_future_release(f);
    weft_future_release(NULL);
    check_balanced();
}

/* A timeout of 0 means the default, which for a wait is until the future completes. */
Test(future, wait_with_timeout_0_waits_until_done)
{
    weft_future_t *f = new_future();
    weft_future_t *g = new_future();
    completer_t c, d;

    complete_later(&c, f, 50, WEFT_ERR_NOT_FOUND, "later");
    cr_assert_eq(weft_future_wait(f, 0), WEFT_ERR_NOT_FOUND);
    cr_assert_str_eq(weft_future_error(f), "later");
    join_completer(&c);
    complete_later(&d, g, 50, WEFT_OK, NULL);
    weft_future_t *both[2] = {f, g};
    cr_assert_eq(weft_future_wait_all(both, 2, 0), WEFT_ERR_NOT_FOUND);
    cr_assert(weft_future_done(g), "wait_all(0) returned before every future completed");
    join_completer(&d);
    weft_future_release(f);
    weft_future_release(g);
    check_balanced();
}

Test(future, wait_times_out_then_completes_later)
{
    weft_future_t *f = new_future();
    completer_t c;
    int64_t t0 = weft__now_ms();
    int64_t waited;

    cr_assert_eq(weft_future_wait(f, 50), WEFT_ERR_TIMEOUT);
    waited = weft__now_ms() - t0;
    cr_assert_geq(waited, 45, "returned after %lld ms", (long long)waited);
    cr_assert_lt(waited, 5000, "returned after %lld ms", (long long)waited);
    cr_assert_str_eq(weft_last_error(), "future: timed out after 50 ms");
    cr_assert_not(weft_future_done(f));

    complete_later(&c, f, 30, WEFT_OK, NULL);
    t0 = weft__now_ms();
    cr_assert_eq(weft_future_wait(f, 10000), WEFT_OK);
    cr_assert_lt(weft__now_ms() - t0, 9000);
    cr_assert(weft_future_done(f));
    cr_assert_eq(weft_future_status(f), WEFT_OK);
    cr_assert_str_eq(weft_future_error(f), "");
    join_completer(&c);
    weft_future_release(f);
    check_balanced();
}

Test(future, complete_once_and_second_is_ignored)
{
    weft_future_t *f = new_future();
    weft_value_t *first = string_value("first");

    cr_assert_eq(weft_future_complete(f, WEFT_OK, NULL, first), 1);
    cr_assert_eq(weft_future_complete(f, WEFT_ERR_IO, "late", string_value("second")), 0);
    cr_assert_eq(weft_future_fail(f, WEFT_ERR_REMOTE, "later %d", 2), 0);
    cr_assert_eq(weft_future_status(f), WEFT_OK);
    cr_assert_eq(weft_future_value(f), first);
    cr_assert_eq(weft_future_wait(f, 1000), WEFT_OK);
    cr_assert_str_eq(weft_future_error(f), "");
    weft_future_release(f);
    check_balanced();
}

Test(future, failure_text_is_copied_and_recorded)
{
    weft_future_t *f = new_future();
    weft_future_t *g = new_future();
    weft_future_t *h = new_future();
    char text[32] = "handler exploded";

    cr_assert_eq(weft_future_complete(f, WEFT_ERR_REMOTE, text, NULL), 1);
    memset(text, 'z', sizeof(text) - 1);
    cr_assert_str_eq(weft_future_error(f), "handler exploded");
    weft__clear_error();
    cr_assert_eq(weft_future_wait(f, 1000), WEFT_ERR_REMOTE);
    cr_assert_str_eq(weft_last_error(), "handler exploded");

    cr_assert_eq(weft_future_fail(g, WEFT_ERR_PEER_LOST, "rank %d lost", 3), 1);
    cr_assert_eq(weft_future_status(g), WEFT_ERR_PEER_LOST);
    cr_assert_str_eq(weft_future_error(g), "rank 3 lost");

    /* No text: the status text stands in. */
    cr_assert_eq(weft_future_complete(h, WEFT_ERR_IO, NULL, NULL), 1);
    cr_assert_str_eq(weft_future_error(h), "input/output error");
    weft_future_release(f);
    weft_future_release(g);
    weft_future_release(h);
    check_balanced();
}

Test(future, take_value_moves_it_out)
{
    weft_future_t *f = new_future();
    weft_value_t *v = string_value("result");
    weft_value_t *got = NULL;
    size_t len = 0;

    cr_assert_eq(weft_future_complete(f, WEFT_OK, NULL, v), 1);
    cr_assert_eq(weft_future_value(f), v);
    cr_assert_eq(weft_future_take_value(f, &got), WEFT_OK);
    cr_assert_eq(got, v);
    cr_assert_eq(memcmp(weft_value_payload(got, &len), "result", 6), 0);
    cr_assert_null(weft_future_value(f));
    got = (weft_value_t *)(uintptr_t)0x1;
    cr_assert_eq(weft_future_take_value(f, &got), WEFT_OK);
    cr_assert_null(got);
    weft_future_release(f);
    weft_value_free(v);
    check_balanced();
}

/* Waiters that went to sleep in a wait (their block hook's calls with entering = 1). */
static atomic_int asleep;

static void count_asleep(int entering, void *arg)
{
    (void)arg;
    if (entering) {
        atomic_fetch_add(&asleep, 1);
    }
}

static void *wait_long(void *arg)
{
    weft_future_t *f = arg;

    weft__set_block_hook(count_asleep, NULL);
    return (void *)(intptr_t)weft_future_wait(f, 10000);
}

Test(future, many_waiters_wake)
{
    enum { N = 4 };
    weft_future_t *f = new_future();
    pthread_t th[N];

    for (int i = 0; i < N; i++) {
        cr_assert_eq(pthread_create(&th[i], NULL, wait_long, f), 0);
    }
    TEST_WAIT(atomic_load(&asleep) == N, 10000, "%d of %d waiters asleep", atomic_load(&asleep), N);
    cr_assert_eq(weft_future_fail(f, WEFT_ERR_CANCELLED, "stop"), 1);
    for (int i = 0; i < N; i++) {
        void *ret = NULL;

        pthread_join(th[i], &ret);
        cr_assert_eq((weft_status_t)(intptr_t)ret, WEFT_ERR_CANCELLED);
    }
    weft_future_release(f);
    check_balanced();
}

/* ---- callbacks ---- */

typedef struct {
    atomic_int order[16];
    atomic_int next;
    atomic_int early; /* callbacks that saw the future pending */
    pthread_t thread[16];
} cb_log_t;

typedef struct {
    cb_log_t *log;
    int id;
} cb_arg_t;

static void record_cb(weft_future_t *f, void *arg)
{
    cb_arg_t *a = arg;
    int slot = atomic_fetch_add(&a->log->next, 1);

    if (!weft_future_done(f)) {
        atomic_fetch_add(&a->log->early, 1);
    }
    a->log->order[slot] = a->id;
    a->log->thread[slot] = pthread_self();
}

Test(future, callbacks_fire_once_in_order)
{
    weft_future_t *f = new_future();
    cb_log_t log = {0};
    cb_arg_t args[5];
    completer_t c;

    for (int i = 0; i < 5; i++) {
        args[i].log = &log;
        args[i].id = i;
    }
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(weft_future_then(f, record_cb, &args[i]), WEFT_OK);
    }
    cr_assert_eq(atomic_load(&log.next), 0);
    complete_later(&c, f, 10, WEFT_OK, NULL);
    cr_assert_eq(weft_future_wait(f, 10000), WEFT_OK);
    join_completer(&c);
    cr_assert_eq(atomic_load(&log.next), 3);
    cr_assert_eq(atomic_load(&log.early), 0);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(log.order[i], i);
        cr_assert(pthread_equal(log.thread[i], c.th), "callback %d ran off the completer", i);
    }
    /* Added after completion: runs at once, on this thread. */
    cr_assert_eq(weft_future_then(f, record_cb, &args[3]), WEFT_OK);
    cr_assert_eq(atomic_load(&log.next), 4);
    cr_assert(pthread_equal(log.thread[3], pthread_self()));
    cr_assert_eq(weft_future_then(f, record_cb, &args[4]), WEFT_OK);
    cr_assert_eq(atomic_load(&log.next), 5);
    cr_assert_eq(log.order[4], 4);
    cr_assert_eq(weft_future_complete(f, WEFT_OK, NULL, NULL), 0);
    cr_assert_eq(atomic_load(&log.next), 5, "a second completion fired callbacks again");
    weft_future_release(f);
    check_balanced();
}

typedef struct {
    cb_log_t *log;
    cb_arg_t inner;
} chain_arg_t;

static void chaining_cb(weft_future_t *f, void *arg)
{
    chain_arg_t *a = arg;

    record_cb(f, &(cb_arg_t){a->log, 0});
    cr_assert_eq(weft_future_then(f, record_cb, &a->inner), WEFT_OK);
    /* Queued behind the callbacks still to fire: not run yet. */
    cr_assert_eq(atomic_load(&a->log->next), 1);
}

Test(future, callback_added_from_a_callback_runs_after_the_others)
{
    weft_future_t *f = new_future();
    cb_log_t log = {0};
    chain_arg_t chain = {&log, {&log, 2}};
    cb_arg_t second = {&log, 1};

    cr_assert_eq(weft_future_then(f, chaining_cb, &chain), WEFT_OK);
    cr_assert_eq(weft_future_then(f, record_cb, &second), WEFT_OK);
    cr_assert_eq(weft_future_complete(f, WEFT_OK, NULL, NULL), 1);
    cr_assert_eq(atomic_load(&log.next), 3);
    cr_assert_eq(log.order[0], 0);
    cr_assert_eq(log.order[1], 1);
    cr_assert_eq(log.order[2], 2);
    weft_future_release(f);
    check_balanced();
}

static void release_cb(weft_future_t *f, void *arg)
{
    (void)arg;
    weft_future_release(f);
}

static void status_cb(weft_future_t *f, void *arg)
{
    *(weft_status_t *)arg = weft_future_status(f);
}

Test(future, future_stays_alive_while_callbacks_run)
{
    weft_future_t *f = new_future();
    weft_status_t seen = WEFT_OK;

    cr_assert_eq(weft_future_then(f, release_cb, NULL), WEFT_OK);
    cr_assert_eq(weft_future_then(f, status_cb, &seen), WEFT_OK);
    /* The first callback drops the only outside reference. */
    cr_assert_eq(weft_future_fail(f, WEFT_ERR_SHUTDOWN, "bye"), 1);
    cr_assert_eq(seen, WEFT_ERR_SHUTDOWN);
    check_balanced();
}

Test(future, callbacks_of_a_future_freed_pending_never_fire)
{
    weft_future_t *f = new_future();
    cb_log_t log = {0};
    cb_arg_t a = {&log, 0};

    cr_assert_eq(weft_future_then(f, record_cb, &a), WEFT_OK);
    weft_future_release(f);
    cr_assert_eq(atomic_load(&log.next), 0);
    check_balanced();
}

typedef struct {
    weft_future_t *f;
    atomic_int *wins;
} racer_t;

static void *race_complete(void *arg)
{
    racer_t *r = arg;
    weft_value_t *v = NULL;

    weft_value_create(&v);
    if (weft_future_complete(r->f, WEFT_OK, NULL, v) == 1) {
        atomic_fetch_add(r->wins, 1);
    }
    return NULL;
}

Test(future, concurrent_completions_one_wins)
{
    enum { N = 6, ROUNDS = 50 };

    for (int round = 0; round < ROUNDS; round++) {
        weft_future_t *f = new_future();
        atomic_int wins = 0;
        racer_t r = {f, &wins};
        pthread_t th[N];

        for (int i = 0; i < N; i++) {
            cr_assert_eq(pthread_create(&th[i], NULL, race_complete, &r), 0);
        }
        for (int i = 0; i < N; i++) {
            pthread_join(th[i], NULL);
        }
        cr_assert_eq(atomic_load(&wins), 1);
        cr_assert_not_null(weft_future_value(f));
        weft_future_release(f);
    }
    check_balanced();
}

/* ---- wait_all / wait_any ---- */

Test(future, wait_all_success_and_first_failure)
{
    weft_future_t *f[3] = {new_future(), new_future(), new_future()};

    cr_assert_eq(weft_future_wait_all(NULL, 0, 0), WEFT_OK);
    for (int i = 0; i < 3; i++) {
        weft_future_complete(f[i], WEFT_OK, NULL, NULL);
    }
    cr_assert_eq(weft_future_wait_all(f, 3, 1000), WEFT_OK);
    for (int i = 0; i < 3; i++) {
        weft_future_release(f[i]);
        f[i] = new_future();
    }
    weft_future_complete(f[2], WEFT_ERR_REMOTE, "third", NULL);
    weft_future_complete(f[0], WEFT_OK, NULL, NULL);
    weft_future_complete(f[1], WEFT_ERR_IO, "second", NULL);
    cr_assert_eq(weft_future_wait_all(f, 3, 1000), WEFT_ERR_IO);
    cr_assert_not_null(strstr(weft_last_error(), "second"), "%s", weft_last_error());
    for (int i = 0; i < 3; i++) {
        weft_future_release(f[i]);
    }
    check_balanced();
}

Test(future, wait_all_times_out_then_completes_from_threads)
{
    enum { N = 20 }; /* more than fit on the stack */
    weft_future_t *f[N];
    completer_t c[N];
    int64_t t0;

    for (int i = 0; i < N; i++) {
        f[i] = new_future();
    }
    for (int i = 1; i < N; i++) {
        weft_future_complete(f[i], WEFT_OK, NULL, NULL);
    }
    t0 = weft__now_ms();
    cr_assert_eq(weft_future_wait_all(f, N, 40), WEFT_ERR_TIMEOUT);
    cr_assert_geq(weft__now_ms() - t0, 35);
    cr_assert_str_neq(weft_last_error(), "");
    for (int i = 1; i < N; i++) {
        weft_future_release(f[i]);
        f[i] = new_future();
    }
    for (int i = 0; i < N; i++) {
        complete_later(&c[i], f[i], (i * 7) % 30, WEFT_OK, NULL);
    }
    cr_assert_eq(weft_future_wait_all(f, N, 10000), WEFT_OK);
    for (int i = 0; i < N; i++) {
        cr_assert(weft_future_done(f[i]));
        join_completer(&c[i]);
        weft_future_release(f[i]);
    }
    check_balanced();
}

Test(future, wait_any_index)
{
    weft_future_t *f[4] = {new_future(), new_future(), new_future(), new_future()};
    size_t index = 77;
    completer_t c;
    int64_t t0 = weft__now_ms();

    cr_assert_eq(weft_future_wait_any(f, 4, 30, &index), WEFT_ERR_TIMEOUT);
    cr_assert_geq(weft__now_ms() - t0, 25);
    cr_assert_eq(index, 77);
    cr_assert_eq(weft_future_wait_any(f, 0, 30, &index), WEFT_ERR_INVALID_ARG);

    complete_later(&c, f[3], 20, WEFT_ERR_REMOTE, "x");
    cr_assert_eq(weft_future_wait_any(f, 4, 10000, &index), WEFT_OK);
    cr_assert_eq(index, 3);
    join_completer(&c);

    weft_future_complete(f[2], WEFT_OK, NULL, NULL);
    weft_future_complete(f[1], WEFT_OK, NULL, NULL);
    cr_assert_eq(weft_future_wait_any(f, 4, 1000, &index), WEFT_OK);
    cr_assert_eq(index, 1);
    for (int i = 0; i < 4; i++) {
        weft_future_release(f[i]);
    }
    check_balanced();
}

static void *complete_all_now(void *arg)
{
    weft_future_t **f = arg;

    for (int i = 3; i >= 0; i--) {
        weft_future_complete(f[i], WEFT_OK, NULL, NULL);
    }
    return NULL;
}

Test(future, waiters_race_with_completions)
{
    for (int round = 0; round < 300; round++) {
        weft_future_t *f[4] = {new_future(), new_future(), new_future(), new_future()};
        size_t index = 0;
        pthread_t th;

        cr_assert_eq(pthread_create(&th, NULL, complete_all_now, f), 0);
        if (round % 2 == 0) {
            cr_assert_eq(weft_future_wait_any(f, 4, 10000, &index), WEFT_OK);
            cr_assert_lt(index, 4);
        }
        cr_assert_eq(weft_future_wait_all(f, 4, 10000), WEFT_OK);
        pthread_join(th, NULL);
        for (int i = 0; i < 4; i++) {
            weft_future_release(f[i]);
        }
    }
    check_balanced();
}

/* ---- block hook ---- */

typedef struct {
    int events[8];
    atomic_int n;
    int tag;
} hook_log_t;

static void hook_cb(int entering, void *arg)
{
    hook_log_t *h = arg;

    cr_assert_eq(h->tag, 0x600d);
    int n = atomic_load(&h->n);
    if (n < 8) {
        h->events[n] = entering;
    }
    atomic_store(&h->n, n + 1); /* after the event: a completer waits on it */
}

Test(future, block_hook_called_around_a_sleep_only)
{
    hook_log_t h = {.tag = 0x600d};
    weft_future_t *f = new_future();
    weft_future_t *g = new_future();
    weft_future_t *both[2];
    size_t index = 9;
    completer_t c;

    weft__set_block_hook(hook_cb, &h);

    /* Each future completes once its waiter has gone to sleep (the hook's call with 1). */
    complete_when(&c, f, &h.n, 1, WEFT_OK, NULL);
    cr_assert_eq(weft_future_wait(f, 10000), WEFT_OK);
    join_completer(&c);
    cr_assert_eq(atomic_load(&h.n), 2);
    cr_assert_eq(h.events[0], 1);
    cr_assert_eq(h.events[1], 0);

    /* Already done, or no time to sleep: the hook is not called. */
    cr_assert_eq(weft_future_wait(f, 10000), WEFT_OK);
    cr_assert_not(weft_future_done(g)); /* looking does not wait */
    cr_assert_eq(weft_future_wait_all(&f, 1, 1000), WEFT_OK);
    cr_assert_eq(weft_future_wait_any(&f, 1, 1000, &index), WEFT_OK);
    cr_assert_eq(atomic_load(&h.n), 2);

    /* wait_any and wait_all sleep through the hook too. */
    both[0] = g;
    both[1] = f;
    weft_future_release(f);
    f = new_future();
    both[1] = f;
    complete_when(&c, g, &h.n, 3, WEFT_OK, NULL);
    cr_assert_eq(weft_future_wait_any(both, 2, 10000, &index), WEFT_OK);
    join_completer(&c);
    cr_assert_eq(index, 0);
    cr_assert_eq(atomic_load(&h.n), 4);
    cr_assert_eq(h.events[2], 1);
    cr_assert_eq(h.events[3], 0);
    complete_when(&c, f, &h.n, 5, WEFT_OK, NULL);
    cr_assert_eq(weft_future_wait_all(both, 2, 10000), WEFT_OK);
    join_completer(&c);
    cr_assert_eq(atomic_load(&h.n), 6);
    cr_assert_eq(h.events[4], 1);
    cr_assert_eq(h.events[5], 0);

    /* Cleared: no more calls. */
    weft__set_block_hook(NULL, NULL);
    weft_future_release(g);
    g = new_future();
    cr_assert_eq(weft_future_wait(g, 20), WEFT_ERR_TIMEOUT);
    cr_assert_eq(atomic_load(&h.n), 6);
    weft_future_release(f);
    weft_future_release(g);
    check_balanced();
}

static void *wait_without_hook(void *arg)
{
    weft_future_wait(arg, 30);
    return NULL;
}

Test(future, block_hook_is_per_thread)
{
    hook_log_t h = {.tag = 0x600d};
    weft_future_t *f = new_future();
    pthread_t th;

    weft__set_block_hook(hook_cb, &h);
    cr_assert_eq(pthread_create(&th, NULL, wait_without_hook, f), 0);
    pthread_join(th, NULL);
    cr_assert_eq(atomic_load(&h.n), 0);
    weft__set_block_hook(NULL, NULL);
    weft_future_release(f);
    check_balanced();
}
