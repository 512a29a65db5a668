/* core: the timer service (due order, cancel, owners dropped, a running task waited for). */
#include <criterion/criterion.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "counting_alloc.h"
#include "internal.h"

TestSuite(timer, .init = use_counting, .timeout = 30);

#define MS (1000000LL)

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t order[64];
    int n;
    int dropped;
    uint64_t dropped_data[64];
} log_t;

static log_t lg = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, {0}, 0, 0, {0}};

static void record(void *arg, uint64_t data)
{
    log_t *l = arg;
    pthread_mutex_lock(&l->mu);
    l->order[l->n++] = data;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
}

static void record_drop(void *arg, uint64_t data)
{
    log_t *l = arg;
    pthread_mutex_lock(&l->mu);
    l->dropped_data[l->dropped++] = data;
    pthread_mutex_unlock(&l->mu);
}

/* Waits (deadline 10 s) until @p n tasks have run. */
static void wait_runs(int n)
{
    int64_t end = weft__now_ns() + 10000 * MS;
    pthread_mutex_lock(&lg.mu);
    while (lg.n < n) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 10 * MS;
        if (ts.tv_nsec >= 1000000000) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000;
        }
        pthread_cond_timedwait(&lg.cv, &lg.mu, &ts);
        cr_assert_lt(weft__now_ns(), end, "only %d of %d tasks ran", lg.n, n);
    }
    pthread_mutex_unlock(&lg.mu);
}

Test(timer, runs_in_due_order_then_added_order)
{
    weft__timer_t *t;
    int64_t now = weft__now_ns();

    cr_assert_eq(weft__timer_create("test", &t), WEFT_OK);
    /* Added out of order; 3 and 4 share a due time and keep the order they were added in. */
    cr_assert_gt(weft__timer_add(t, now + 40 * MS, record, NULL, &lg, 5, NULL), 0);
    cr_assert_gt(weft__timer_add(t, now + 10 * MS, record, NULL, &lg, 2, NULL), 0);
    cr_assert_gt(weft__timer_add(t, now + 20 * MS, record, NULL, &lg, 3, NULL), 0);
    cr_assert_gt(weft__timer_add(t, now + 20 * MS, record, NULL, &lg, 4, NULL), 0);
    cr_assert_gt(weft__timer_add(t, now - 5 * MS, record, NULL, &lg, 1, NULL),
                 0); /* past: at once */
    wait_runs(5);
    for (int i = 0; i < 5; i++) {
        cr_assert_eq(lg.order[i], (uint64_t)i + 1, "position %d ran task %llu", i,
                     (unsigned long long)lg.order[i]);
    }
    cr_assert_eq(weft__timer_pending(t), 0);
    weft__timer_free(t);
    check_balanced();
}

Test(timer, an_earlier_task_wakes_a_sleeping_timer)
{
    weft__timer_t *t;
    int64_t now = weft__now_ns();

    cr_assert_eq(weft__timer_create("test", &t), WEFT_OK);
    /* The thread sleeps until an hour from now; the next task must not wait for that. */
    uint64_t late = weft__timer_add(t, now + 3600000 * MS, record, record_drop, &lg, 9, NULL);
    cr_assert_gt(late, 0);
    cr_assert_gt(weft__timer_add(t, now + MS, record, NULL, &lg, 1, NULL), 0);
    wait_runs(1);
    cr_assert_eq(lg.order[0], 1);
    cr_assert_eq(weft__timer_pending(t), 1);
    weft__timer_free(t); /* the hour-long task is dropped, not run */
    cr_assert_eq(lg.n, 1);
    cr_assert_eq(lg.dropped, 1);
    cr_assert_eq(lg.dropped_data[0], 9);
    check_balanced();
}

Test(timer, cancel_takes_a_task_out_before_it_runs)
{
    weft__timer_t *t;
    int64_t now = weft__now_ns();

    cr_assert_eq(weft__timer_create("test", &t), WEFT_OK);
    uint64_t ids[40];
    for (int i = 0; i < 40; i++) {
        ids[i] =
            weft__timer_add(t, now + (20 + i) * MS, record, record_drop, &lg, (uint64_t)i, NULL);
        cr_assert_gt(ids[i], 0);
    }
    /* Every odd one is cancelled: neither run nor drop is called for them. */
    for (int i = 1; i < 40; i += 2) {
        cr_assert(weft__timer_cancel(t, ids[i]));
        cr_assert_not(weft__timer_cancel(t, ids[i]), "a second cancel finds nothing");
    }
    cr_assert_not(weft__timer_cancel(t, 0));
    cr_assert_not(weft__timer_cancel(t, 999999));
    wait_runs(20);
    for (int i = 0; i < 20; i++) {
        cr_assert_eq(lg.order[i], (uint64_t)(2 * i));
    }
    cr_assert_not(weft__timer_cancel(t, ids[0]), "a task that ran cannot be cancelled");
    cr_assert_eq(lg.dropped, 0);
    weft__timer_free(t);
    check_balanced();
}

typedef struct {
    atomic_int entered;
    atomic_int release;
    atomic_int finished;
} slow_t;

static void slow_run(void *arg, uint64_t data)
{
    slow_t *s = arg;
    (void)data;
    atomic_store(&s->entered, 1);
    int64_t end = weft__now_ns() + 10000 * MS;
    while (!atomic_load(&s->release) && weft__now_ns() < end) {
        sched_yield();
    }
    atomic_store(&s->finished, 1);
}

static slow_t slow;

static void *releaser(void *arg)
{
    (void)arg;
    /* Lets the running task go once cancel_owner has had time to start waiting; whether it
     * started before or after this, it must return only after the task finished. */
    int64_t end = weft__now_ns() + 10000 * MS;
    while (!atomic_load(&slow.entered) && weft__now_ns() < end) {
        sched_yield();
    }
    atomic_store(&slow.release, 1);
    return NULL;
}

Test(timer, cancel_owner_drops_its_tasks_and_waits_for_the_running_one)
{
    weft__timer_t *t;
    int owner_a, owner_b;
    int64_t now = weft__now_ns();

    cr_assert_eq(weft__timer_create("test", &t), WEFT_OK);
    cr_assert_gt(weft__timer_add(t, now, slow_run, NULL, &slow, 0, &owner_a), 0);
    for (int i = 0; i < 6; i++) {
        /* a's tasks are due after b's: dropped in due order. */
        cr_assert_gt(weft__timer_add(t, now + (3600000 + 10 - i) * MS, record, record_drop, &lg,
                                     (uint64_t)(100 + i), &owner_a),
                     0);
        cr_assert_gt(
            weft__timer_add(t, now + (5 + i) * MS, record, record_drop, &lg, (uint64_t)i, &owner_b),
            0);
    }
    int64_t end = weft__now_ns() + 10000 * MS;
    while (!atomic_load(&slow.entered)) {
        cr_assert_lt(weft__now_ns(), end, "the slow task never started");
        sched_yield();
    }
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, releaser, NULL), 0);
    weft__timer_cancel_owner(t, &owner_a);
    cr_assert_eq(atomic_load(&slow.finished), 1, "cancel_owner returned while a's task ran");
    pthread_join(th, NULL);
    cr_assert_eq(lg.dropped, 6);
    for (int i = 0; i < 6; i++) {
        cr_assert_eq(lg.dropped_data[i], (uint64_t)(105 - i), "dropped in due order");
    }
    wait_runs(6); /* b's tasks still run */
    for (int i = 0; i < 6; i++) {
        cr_assert_eq(lg.order[i], (uint64_t)i);
    }
    weft__timer_free(t);
    check_balanced();
}

static weft__timer_t *self_t;
static int self_owner;

static void cancel_self(void *arg, uint64_t data)
{
    (void)arg;
    (void)data;
    /* From the timer's own thread: must not wait for itself. */
    weft__timer_cancel_owner(self_t, &self_owner);
    record(&lg, 1);
}

Test(timer, a_task_may_cancel_its_own_owner)
{
    int64_t now = weft__now_ns();

    cr_assert_eq(weft__timer_create("test", &self_t), WEFT_OK);
    cr_assert_gt(weft__timer_add(self_t, now, cancel_self, NULL, NULL, 0, &self_owner), 0);
    cr_assert_gt(
        weft__timer_add(self_t, now + 3600000 * MS, record, record_drop, &lg, 7, &self_owner), 0);
    wait_runs(1);
    cr_assert_eq(lg.dropped, 1);
    weft__timer_free(self_t);
    check_balanced();
}
