/* core: thread pool (every task once, FIFO, destroy drains, submit after shutdown). */
#include <criterion/criterion.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "counting_alloc.h"
#include "internal.h"
#include "wait.h"

/* n_alloc, n_free, counting, use_counting, check_balanced */

TestSuite(pool, .init = use_counting, .timeout = 30);

#define NTASKS 2000

static atomic_int runs[NTASKS];

static void count_task(void *arg)
{
    atomic_fetch_add(&runs[(intptr_t)arg], 1);
}

Test(pool, runs_every_task_once)
{
    weft_pool_t *pool = NULL;

    cr_assert_eq(weft_pool_create(4, &pool), WEFT_OK);
    for (intptr_t i = 0; i < NTASKS; i++) {
        cr_assert_eq(weft_pool_submit(pool, count_task, (void *)i), WEFT_OK);
    }
    weft_pool_destroy(pool);
    for (int i = 0; i < NTASKS; i++) {
        cr_assert_eq(atomic_load(&runs[i]), 1, "task %d ran %d times", i, atomic_load(&runs[i]));
    }
    check_balanced();
}

static int order[64];
static atomic_int order_next;

static void order_task(void *arg)
{
    order[atomic_fetch_add(&order_next, 1)] = (int)(intptr_t)arg;
}

Test(pool, one_thread_is_fifo)
{
    weft_pool_t *pool = NULL;

    cr_assert_eq(weft_pool_create(1, &pool), WEFT_OK);
    for (intptr_t i = 0; i < 64; i++) {
        cr_assert_eq(weft_pool_submit(pool, order_task, (void *)i), WEFT_OK);
    }
    weft_pool_destroy(pool);
    cr_assert_eq(atomic_load(&order_next), 64);
    for (int i = 0; i < 64; i++) {
        cr_assert_eq(order[i], i);
    }
    check_balanced();
}

static weft_pool_t *drain_pool;
static atomic_int slow_done, refused, probes, probe_runs;

static void probe_task(void *arg)
{
    (void)arg;
    atomic_fetch_add(&probe_runs, 1);
}

/* Whether destroy has begun: the pool refused a probe (each accepted one is one more task for
 * destroy to run). */
static bool destroy_began(void)
{
    if (atomic_load(&refused)) {
        return true;
    }
    if (weft_pool_submit(drain_pool, probe_task, NULL) != WEFT_OK) {
        atomic_store(&refused, 1);
        return true;
    }
    atomic_fetch_add(&probes, 1);
    return false;
}

/* Holds its thread until destroy has begun (10 s at most). */
static void slow_task(void *arg)
{
    bool began;

    (void)arg;
    WAIT_UNTIL(began, destroy_began(), 10000);
    (void)began; /* the test asserts refused */
    atomic_fetch_add(&slow_done, 1);
}

Test(pool, destroy_drains_the_queue)
{
    cr_assert_eq(weft_pool_create(2, &drain_pool), WEFT_OK);
    for (int i = 0; i < 50; i++) {
        cr_assert_eq(weft_pool_submit(drain_pool, slow_task, NULL), WEFT_OK);
    }
    /* Both threads hold until destroy begins: at least 48 tasks are still queued then, and
     * destroy must run them all. */
    weft_pool_destroy(drain_pool);
    cr_assert(atomic_load(&refused), "the tasks never saw destroy begin");
    cr_assert_eq(atomic_load(&slow_done), 50);
    cr_assert_eq(atomic_load(&probe_runs), atomic_load(&probes));
    check_balanced();
}

static weft_pool_t *the_pool;
static atomic_int destroying;
static atomic_int resubmitted;
static atomic_int noop_runs;
static weft_status_t final_submit = WEFT_OK;

static void noop_task(void *arg)
{
    (void)arg;
    atomic_fetch_add(&noop_runs, 1);
}

/* Runs while the main thread destroys the pool: submits until refused. */
static void resubmit_task(void *arg)
{
    int64_t deadline = weft__now_ms() + 10000;

    (void)arg;
    /* A wait for the flag, with a deadline. */
    while (!atomic_load(&destroying) && weft__now_ms() < deadline) {
        usleep(100);
    }
    /* Submits until refused; the pause only paces the loop. */
    while (weft__now_ms() < deadline) {
        weft_status_t st = weft_pool_submit(the_pool, noop_task, NULL);

        if (st != WEFT_OK) {
            final_submit = st;
            return;
        }
        atomic_fetch_add(&resubmitted, 1);
        usleep(100);
    }
}

Test(pool, submit_after_destroy_began_is_refused)
{
    cr_assert_eq(weft_pool_create(2, &the_pool), WEFT_OK);
    cr_assert_eq(weft_pool_submit(the_pool, resubmit_task, NULL), WEFT_OK);
    atomic_store(&destroying, 1);
    weft_pool_destroy(the_pool);
    cr_assert_eq(final_submit, WEFT_ERR_SHUTDOWN);
    /* Whatever was accepted before the refusal ran. */
    cr_assert_eq(atomic_load(&noop_runs), atomic_load(&resubmitted));
    check_balanced();
}

Test(pool, bad_arguments)
{
    weft_pool_t *sentinel = (weft_pool_t *)(uintptr_t)0x77;
    weft_pool_t *pool = sentinel;

    cr_assert_eq(weft_pool_create(0, &pool), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(pool, sentinel);
    cr_assert_str_neq(weft_last_error(), "");
    cr_assert_eq(weft_pool_create(-3, &pool), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(weft_pool_create(1, NULL), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(weft_pool_create(1, &pool), WEFT_OK);
    cr_assert_eq(weft_pool_submit(pool, NULL, NULL), WEFT_ERR_INVALID_ARG);
    weft_pool_destroy(pool);
    weft_pool_destroy(NULL);
    check_balanced();
}
