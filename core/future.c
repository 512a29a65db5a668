#include <sched.h>
/* Futures: one-shot completion with a status, an error text, a value and callbacks. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"

/* wait_all/wait_any keep their waiter nodes on the stack up to this many futures. */
#define STACK_NODES 16

typedef struct cb_node {
    weft_future_cb_t cb;
    void *arg;
    struct cb_node *next;
} cb_node_t;

/* One thread waiting on several futures (wait_all/wait_any): completions count up. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_size_t completed; /* changed under mu; read without it while spinning */
} multi_t;

/* A multi_t's entry in one future's waiter list (guarded by that future's mu). */
typedef struct waiter_node {
    multi_t *m;
    struct waiter_node *prev;
    struct waiter_node *next;
    int linked;
} waiter_node_t;

struct weft_future {
    atomic_long refs;
    atomic_int done; /* set once, under mu, after status/text/value */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    weft_status_t status;
    char *text; /* NULL on success */
    weft_value_t *value;
    cb_node_t *cb_head; /* under mu: callbacks not yet fired, in order added */
    cb_node_t *cb_tail;
    int cb_running; /* under mu: the completing thread is still firing callbacks */
    waiter_node_t *waiters;
};

typedef struct {
    weft__block_hook_cb_t cb;
    void *arg;
} block_hook_t;

static _Thread_local block_hook_t block_hook;

static pthread_once_t spin_once = PTHREAD_ONCE_INIT;
static int64_t spin_ns;

static void spin_init(void)
{
    spin_ns = weft__cfg_int(WEFT__CFG_SPIN_US) * 1000;
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

void weft__set_block_hook(weft__block_hook_cb_t cb, void *arg)
{
    block_hook.cb = cb;
    block_hook.arg = cb == NULL ? NULL : arg;
}

static void hook_call(int entering)
{
    if (block_hook.cb != NULL) {
        block_hook.cb(entering, block_hook.arg);
    }
}

void weft__get_block_hook(weft__block_hook_cb_t *cb_p, void **arg_p)
{
    *cb_p = block_hook.cb;
    *arg_p = block_hook.arg;
}

void weft__blocking(int entering)
{
    hook_call(entering);
}

/* Absolute monotonic deadline in ns for a timeout (INT64_MAX: none). */
static int64_t deadline_after(int64_t timeout_ms)
{
    int64_t now = weft__now_ns();
    int64_t span;

    if (timeout_ms < 0 || timeout_ms > INT64_MAX / 1000000) {
        return INT64_MAX;
    }
    span = timeout_ms * 1000000;
    if (now > INT64_MAX - span) {
        return INT64_MAX;
    }
    return now + span;
}

static struct timespec to_timespec(int64_t ns)
{
    struct timespec ts;

    ts.tv_sec = (time_t)(ns / 1000000000);
    ts.tv_nsec = (long)(ns % 1000000000);
    return ts;
}

/* Waits on @p cv until signalled or @p deadline_ns; returns 0 when the deadline has passed. */
static int cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, int64_t deadline_ns)
{
    struct timespec ts;

    if (deadline_ns == INT64_MAX) {
        pthread_cond_wait(cv, mu);
        return 1;
    }
    ts = to_timespec(deadline_ns);
    return pthread_cond_timedwait(cv, mu, &ts) != ETIMEDOUT;
}

static weft_status_t cond_init_monotonic(pthread_cond_t *cv)
{
    pthread_condattr_t attr;
    int rc;

    if (pthread_condattr_init(&attr) != 0) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "future: pthread_condattr_init failed");
    }
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    rc = pthread_cond_init(cv, &attr);
    pthread_condattr_destroy(&attr);
    if (rc != 0) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "future: pthread_cond_init failed: %s",
                               strerror(rc));
    }
    return WEFT_OK;
}

static int is_done(const weft_future_t *f)
{
    return atomic_load_explicit(&((weft_future_t *)f)->done, memory_order_acquire);
}

weft_status_t weft_future_create(weft_future_t **f_p)
{
    weft_status_t status;
    weft_future_t *f;
    int rc;

    if (f_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "future: f_p is NULL");
    }
    f = weft_calloc(1, sizeof(*f));
    if (f == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "future: out of memory");
    }
    atomic_init(&f->refs, 1);
    atomic_init(&f->done, 0);
    rc = pthread_mutex_init(&f->mu, NULL);
    if (rc != 0) {
        status = weft__set_error(WEFT_ERR_NO_MEMORY, "future: pthread_mutex_init failed: %s",
                                 strerror(rc));
        goto err_free_future;
    }
    WEFT_CHECK_GOTO(cond_init_monotonic(&f->cv), status, err_destroy_mutex);
    f->status = WEFT_OK;
    *f_p = f;
    return WEFT_OK;

err_destroy_mutex:
    pthread_mutex_destroy(&f->mu);
err_free_future:
    weft_free(f);
    return status;
}

weft_future_t *weft_future_retain(weft_future_t *f)
{
    if (f != NULL) {
        atomic_fetch_add_explicit(&f->refs, 1, memory_order_relaxed);
    }
    return f;
}

void weft_future_release(weft_future_t *f)
{
    cb_node_t *node;

    if (f == NULL) {
        return;
    }
    if (atomic_fetch_sub_explicit(&f->refs, 1, memory_order_acq_rel) != 1) {
        return;
    }
    /* Callbacks of a future freed while pending never fire. */
    node = f->cb_head;
    while (node != NULL) {
        cb_node_t *next = node->next;
        weft_free(node);
        node = next;
    }
    weft_free(f->text);
    weft_value_free(f->value);
    pthread_cond_destroy(&f->cv);
    pthread_mutex_destroy(&f->mu);
    weft_free(f);
}

/* Fires the queued callbacks in order, without the lock, until none is left. */
static void run_callbacks(weft_future_t *f)
{
    /* Keep the future alive even if a callback drops the last outside reference. */
    weft_future_retain(f);
    for (;;) {
        cb_node_t *node;

        pthread_mutex_lock(&f->mu);
        node = f->cb_head;
        if (node == NULL) {
            f->cb_tail = NULL;
            f->cb_running = 0;
            pthread_mutex_unlock(&f->mu);
            break;
        }
        f->cb_head = node->next;
        if (f->cb_head == NULL) {
            f->cb_tail = NULL;
        }
        pthread_mutex_unlock(&f->mu);
        node->cb(f, node->arg);
        weft_free(node);
    }
    weft_future_release(f);
}

/* Completes with an owned @p text (may be NULL); frees text and value if already completed. */
static int complete_take(weft_future_t *f, weft_status_t status, char *text, weft_value_t *value)
{
    int fire;

    if (status == WEFT_OK) {
        weft_free(text);
        text = NULL;
    }
    pthread_mutex_lock(&f->mu);
    if (is_done(f)) {
        pthread_mutex_unlock(&f->mu);
        weft_free(text);
        weft_value_free(value);
        return 0;
    }
    f->status = status;
    f->text = text;
    f->value = value;
    atomic_store_explicit(&f->done, 1, memory_order_release);
    /* Signal multi-waiters while holding mu: a waiter unlinks under mu before it goes away. */
    for (waiter_node_t *w = f->waiters; w != NULL; w = w->next) {
        pthread_mutex_lock(&w->m->mu);
        atomic_fetch_add_explicit(&w->m->completed, 1, memory_order_release);
        pthread_cond_signal(&w->m->cv);
        pthread_mutex_unlock(&w->m->mu);
        w->linked = 0;
    }
    f->waiters = NULL;
    pthread_cond_broadcast(&f->cv);
    fire = f->cb_head != NULL;
    f->cb_running = fire;
    pthread_mutex_unlock(&f->mu);
    if (fire) {
        run_callbacks(f);
    }
    return 1;
}

int weft_future_complete(weft_future_t *f, weft_status_t status, const char *text,
                         weft_value_t *value)
{
    char *copy = NULL;

    if (f == NULL) {
        weft_value_free(value);
        return 0;
    }
    if (status != WEFT_OK && text != NULL && text[0] != '\0') {
        /* Out of memory only loses the text: weft_future_error falls back to the status text. */
        copy = weft_strdup(text);
    }
    return complete_take(f, status, copy, value);
}

int weft_future_fail(weft_future_t *f, weft_status_t status, const char *fmt, ...)
{
    char *text = NULL;
    va_list ap;

    if (f == NULL) {
        return 0;
    }
    if (status != WEFT_OK && fmt != NULL) {
        va_start(ap, fmt);
        text = weft__vstrfmt(fmt, ap);
        va_end(ap);
    }
    return complete_take(f, status, text, NULL);
}

int weft_future_done(const weft_future_t *f)
{
    return f != NULL && is_done(f);
}

weft_status_t weft_future_status(const weft_future_t *f)
{
    if (f == NULL) {
        return WEFT_ERR_INVALID_ARG;
    }
    if (!is_done(f)) {
        return WEFT_ERR_PENDING;
    }
    return f->status;
}

const char *weft_future_error(const weft_future_t *f)
{
    if (f == NULL || !is_done(f) || f->status == WEFT_OK) {
        return "";
    }
    if (f->text == NULL) {
        return weft_strerror(f->status);
    }
    return f->text;
}

weft_value_t *weft_future_value(const weft_future_t *f)
{
    if (f == NULL || !is_done(f)) {
        return NULL;
    }
    return f->value;
}

weft_status_t weft_future_take_value(weft_future_t *f, weft_value_t **v_p)
{
    weft_value_t *v;

    if (f == NULL || v_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "future: NULL future or v_p");
    }
    pthread_mutex_lock(&f->mu);
    if (!is_done(f)) {
        pthread_mutex_unlock(&f->mu);
        return weft__set_error(WEFT_ERR_PENDING, "future: take_value while pending");
    }
    v = f->value;
    f->value = NULL;
    pthread_mutex_unlock(&f->mu);
    *v_p = v;
    return f->status;
}

weft_status_t weft_future_then(weft_future_t *f, weft_future_cb_t cb, void *arg)
{
    cb_node_t *node;

    if (f == NULL || cb == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "future: NULL future or callback");
    }
    node = weft_alloc(sizeof(*node));
    pthread_mutex_lock(&f->mu);
    /* Queue behind callbacks still being fired so that the order added holds. */
    if (!is_done(f) || f->cb_running) {
        if (node == NULL) {
            pthread_mutex_unlock(&f->mu);
            return weft__set_error(WEFT_ERR_NO_MEMORY, "future: out of memory for a callback");
        }
        node->cb = cb;
        node->arg = arg;
        node->next = NULL;
        if (f->cb_tail == NULL) {
            f->cb_head = node;
        } else {
            f->cb_tail->next = node;
        }
        f->cb_tail = node;
        pthread_mutex_unlock(&f->mu);
        return WEFT_OK;
    }
    pthread_mutex_unlock(&f->mu);
    weft_free(node);
    cb(f, arg);
    return WEFT_OK;
}

/* Status of a completed future, recording its text for weft_last_error() on failure. */
static weft_status_t finished_status(const weft_future_t *f)
{
    if (f->status != WEFT_OK) {
        weft__set_error(f->status, "%s", weft_future_error(f));
    }
    return f->status;
}

/* Polls @p f's done flag until the spin budget or @p deadline_ns runs out; 1 if done. */
static int spin_future(const weft_future_t *f, int64_t deadline_ns)
{
    int64_t end;

    pthread_once(&spin_once, spin_init);
    if (spin_ns <= 0) {
        return is_done(f);
    }
    end = weft__now_ns() + spin_ns;
    if (end > deadline_ns) {
        end = deadline_ns;
    }
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if (is_done(f)) {
                return 1;
            }
            cpu_relax();
        }
        if (weft__now_ns() >= end) {
            return is_done(f);
        }
        /* Give the core to a runnable thread (the transport thread that will
         * complete this future, on a machine with few cores); back at once if none. */
        sched_yield();
    }
}

weft_status_t weft_future_wait(weft_future_t *f, int64_t timeout_ms)
{
    int64_t deadline;

    if (f == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "future: wait on NULL");
    }
    if (is_done(f)) {
        return finished_status(f);
    }
    {
        /* 0 is the default: until it completes (a weft operation completes its future by its
         * own deadline); < 0 is no limit either. Poll with weft_future_done. */
        deadline = deadline_after(timeout_ms == 0 ? -1 : timeout_ms);
        if (!spin_future(f, deadline)) {
            hook_call(1);
            pthread_mutex_lock(&f->mu);
            while (!is_done(f)) {
                if (!cond_wait_until(&f->cv, &f->mu, deadline)) {
                    break;
                }
            }
            pthread_mutex_unlock(&f->mu);
            hook_call(0);
        }
    }
    if (!is_done(f)) {
        return weft__set_error(WEFT_ERR_TIMEOUT, "future: timed out after %lld ms",
                               (long long)timeout_ms);
    }
    return finished_status(f);
}

static size_t count_done(weft_future_t *const *futs, size_t n)
{
    size_t done = 0;

    for (size_t i = 0; i < n; i++) {
        done += (size_t)is_done(futs[i]);
    }
    return done;
}

/* Polls until @p need futures are done or the spin budget or @p deadline_ns runs out. */
static int spin_multi(weft_future_t *const *futs, size_t n, size_t need, int64_t deadline_ns)
{
    int64_t end;

    pthread_once(&spin_once, spin_init);
    if (spin_ns <= 0) {
        return count_done(futs, n) >= need;
    }
    end = weft__now_ns() + spin_ns;
    if (end > deadline_ns) {
        end = deadline_ns;
    }
    for (;;) {
        for (int i = 0; i < 8; i++) {
            if (count_done(futs, n) >= need) {
                return 1;
            }
            cpu_relax();
        }
        if (weft__now_ns() >= end) {
            return count_done(futs, n) >= need;
        }
        sched_yield();
    }
}

/* Sleeps until @p need of the futures are done or @p deadline_ns passes. */
static weft_status_t sleep_multi(weft_future_t *const *futs, size_t n, size_t need,
                                 int64_t deadline_ns)
{
    waiter_node_t stack_nodes[STACK_NODES];
    waiter_node_t *nodes = stack_nodes;
    weft_status_t status;
    multi_t m;
    int rc;

    if (n > STACK_NODES) {
        nodes = weft_calloc(n, sizeof(*nodes));
        if (nodes == NULL) {
            return weft__set_error(WEFT_ERR_NO_MEMORY, "future: out of memory waiting on %zu", n);
        }
    }
    rc = pthread_mutex_init(&m.mu, NULL);
    if (rc != 0) {
        status = weft__set_error(WEFT_ERR_NO_MEMORY, "future: pthread_mutex_init failed: %s",
                                 strerror(rc));
        goto err_free_nodes;
    }
    WEFT_CHECK_GOTO(cond_init_monotonic(&m.cv), status, err_destroy_mutex);
    atomic_init(&m.completed, 0);

    /* Register with each future; lock order is future mu, then m.mu (as in complete_take). */
    for (size_t i = 0; i < n; i++) {
        weft_future_t *f = futs[i];

        nodes[i].m = &m;
        nodes[i].prev = NULL;
        nodes[i].linked = 0;
        pthread_mutex_lock(&f->mu);
        if (is_done(f)) {
            pthread_mutex_lock(&m.mu);
            atomic_fetch_add_explicit(&m.completed, 1, memory_order_relaxed);
            pthread_mutex_unlock(&m.mu);
        } else {
            nodes[i].next = f->waiters;
            if (f->waiters != NULL) {
                f->waiters->prev = &nodes[i];
            }
            f->waiters = &nodes[i];
            nodes[i].linked = 1;
        }
        pthread_mutex_unlock(&f->mu);
    }

    hook_call(1);
    pthread_mutex_lock(&m.mu);
    while (atomic_load_explicit(&m.completed, memory_order_relaxed) < need) {
        if (!cond_wait_until(&m.cv, &m.mu, deadline_ns)) {
            break;
        }
    }
    pthread_mutex_unlock(&m.mu);
    hook_call(0);

    /* Unregister: once each future's mu has been taken, no completer can touch m any more. */
    for (size_t i = 0; i < n; i++) {
        weft_future_t *f = futs[i];

        pthread_mutex_lock(&f->mu);
        if (nodes[i].linked) {
            if (nodes[i].prev == NULL) {
                f->waiters = nodes[i].next;
            } else {
                nodes[i].prev->next = nodes[i].next;
            }
            if (nodes[i].next != NULL) {
                nodes[i].next->prev = nodes[i].prev;
            }
            nodes[i].linked = 0;
        }
        pthread_mutex_unlock(&f->mu);
    }
    status = WEFT_OK;

    pthread_cond_destroy(&m.cv);
err_destroy_mutex:
    pthread_mutex_destroy(&m.mu);
err_free_nodes:
    if (nodes != stack_nodes) {
        weft_free(nodes);
    }
    return status;
}

/* Checks the arguments of wait_all/wait_any. */
static weft_status_t check_futs(const char *what, weft_future_t *const *futs, size_t n)
{
    if (n > 0 && futs == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "future: %s on a NULL array of %zu", what, n);
    }
    for (size_t i = 0; i < n; i++) {
        if (futs[i] == NULL) {
            return weft__set_error(WEFT_ERR_INVALID_ARG, "future: %s: future %zu is NULL", what, i);
        }
    }
    return WEFT_OK;
}

/* Waits until @p need futures are done, the deadline passes or an error occurs. */
static weft_status_t wait_count(weft_future_t *const *futs, size_t n, size_t need,
                                int64_t timeout_ms)
{
    int64_t deadline;

    if (count_done(futs, n) >= need) {
        return WEFT_OK;
    }
    deadline = deadline_after(timeout_ms == 0 ? -1 : timeout_ms);
    if (spin_multi(futs, n, need, deadline)) {
        return WEFT_OK;
    }
    return sleep_multi(futs, n, need, deadline);
}

weft_status_t weft_future_wait_all(weft_future_t *const *futs, size_t n, int64_t timeout_ms)
{
    WEFT_CHECK(check_futs("wait_all", futs, n));
    WEFT_CHECK(wait_count(futs, n, n, timeout_ms));
    if (count_done(futs, n) < n) {
        return weft__set_error(WEFT_ERR_TIMEOUT,
                               "future: wait_all timed out after %lld ms with %zu of %zu pending",
                               (long long)timeout_ms, n - count_done(futs, n), n);
    }
    for (size_t i = 0; i < n; i++) {
        if (futs[i]->status != WEFT_OK) {
            return weft__set_error(futs[i]->status, "future %zu of %zu: %s", i, n,
                                   weft_future_error(futs[i]));
        }
    }
    return WEFT_OK;
}

weft_status_t weft_future_wait_any(weft_future_t *const *futs, size_t n, int64_t timeout_ms,
                                   size_t *index_p)
{
    WEFT_CHECK(check_futs("wait_any", futs, n));
    if (n == 0 || index_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "future: wait_any on %zu futures%s", n,
                               index_p == NULL ? " with a NULL index_p" : "");
    }
    WEFT_CHECK(wait_count(futs, n, 1, timeout_ms));
    for (size_t i = 0; i < n; i++) {
        if (is_done(futs[i])) {
            *index_p = i;
            return WEFT_OK;
        }
    }
    return weft__set_error(WEFT_ERR_TIMEOUT, "future: wait_any timed out after %lld ms",
                           (long long)timeout_ms);
}
