/* The timer service: one thread that runs tasks at their due time, for every module of an agent
 * (rpc's call deadlines, rref's retries, collectives' receive deadlines). Tasks are kept in a
 * binary min-heap by (due time, order added); an id table finds a task to cancel it. The thread
 * sleeps until the earliest due time; a task added with an earlier one wakes it, a later one does
 * not (so that adding a deadline per call costs no wake-up), and cancelled tasks are not woken
 * for: when the thread wakes with nothing due it sleeps again until the new earliest. */
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "internal.h"

#define FREE_KEEP 256 /* finished task records kept for reuse */

typedef struct task {
    int64_t due_ns;
    uint64_t id; /* also the order added: equal due times run in that order */
    weft__timer_cb_t run;
    weft__timer_cb_t drop;
    void *arg;
    uint64_t data;
    const void *owner;
    size_t heap_idx;
    struct task *hnext; /* id table chain, or the free list */
} task_t;

struct weft__timer {
    pthread_mutex_t mu;
    pthread_cond_t cv;      /* the thread's sleep */
    pthread_cond_t idle_cv; /* a task finished running */
    task_t **heap;
    size_t n, cap;
    task_t **ids; /* chained by hnext; size nids (a power of two) */
    size_t nids;
    task_t *free_list;
    size_t nfree;
    uint64_t next_id;
    int64_t wake_ns; /* when the sleeping thread wakes by itself (INT64_MAX: only when told) */
    bool stop;
    pthread_t thread;
    pthread_t running_thread; /* the timer thread, to tell callers on it apart */
    const void *running_owner;
    bool running;
    char name[32];
};

/* ------------------------------------------------------------------ heap and id table */

static bool before(const task_t *x, const task_t *y)
{
    return x->due_ns < y->due_ns || (x->due_ns == y->due_ns && x->id < y->id);
}

static void heap_set(weft__timer_t *t, size_t i, task_t *k)
{
    t->heap[i] = k;
    k->heap_idx = i;
}

static void sift_up(weft__timer_t *t, size_t i)
{
    task_t *k = t->heap[i];
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!before(k, t->heap[p])) {
            break;
        }
        heap_set(t, i, t->heap[p]);
        i = p;
    }
    heap_set(t, i, k);
}

static void sift_down(weft__timer_t *t, size_t i)
{
    task_t *k = t->heap[i];
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= t->n) {
            break;
        }
        if (c + 1 < t->n && before(t->heap[c + 1], t->heap[c])) {
            c++;
        }
        if (!before(t->heap[c], k)) {
            break;
        }
        heap_set(t, i, t->heap[c]);
        i = c;
    }
    heap_set(t, i, k);
}

static void heap_remove(weft__timer_t *t, task_t *k)
{
    size_t i = k->heap_idx;
    task_t *last = t->heap[--t->n];
    if (i < t->n) {
        heap_set(t, i, last);
        if (i > 0 && before(last, t->heap[(i - 1) / 2])) {
            sift_up(t, i);
        } else {
            sift_down(t, i);
        }
    }
}

static size_t id_slot(const weft__timer_t *t, uint64_t id)
{
    return (size_t)((id * 0x9E3779B97F4A7C15ull) >> 32) & (t->nids - 1);
}

static void id_insert(weft__timer_t *t, task_t *k)
{
    size_t s = id_slot(t, k->id);
    k->hnext = t->ids[s];
    t->ids[s] = k;
}

static task_t *id_take(weft__timer_t *t, uint64_t id)
{
    for (task_t **pp = &t->ids[id_slot(t, id)]; *pp != NULL; pp = &(*pp)->hnext) {
        if ((*pp)->id == id) {
            task_t *k = *pp;
            *pp = k->hnext;
            k->hnext = NULL;
            return k;
        }
    }
    return NULL;
}

/* Makes room for one more task. Called with t->mu held. */
static bool grow_locked(weft__timer_t *t)
{
    if (t->n == t->cap) {
        size_t cap = t->cap == 0 ? 64 : 2 * t->cap;
        task_t **h = weft_alloc(cap * sizeof(*h));
        if (h == NULL) {
            return false;
        }
        if (t->n > 0) {
            memcpy(h, t->heap, t->n * sizeof(*h));
        }
        weft_free(t->heap);
        t->heap = h;
        t->cap = cap;
    }
    if (t->n + 1 > 2 * t->nids) {
        size_t nids = 2 * t->nids;
        task_t **ids = weft_calloc(nids, sizeof(*ids));
        if (ids != NULL) {
            task_t **old = t->ids;
            size_t nold = t->nids;
            t->ids = ids;
            t->nids = nids;
            for (size_t i = 0; i < nold; i++) {
                while (old[i] != NULL) {
                    task_t *k = old[i];
                    old[i] = k->hnext;
                    id_insert(t, k);
                }
            }
            weft_free(old);
        } /* else: longer chains, still correct */
    }
    return true;
}

static task_t *task_get_locked(weft__timer_t *t)
{
    task_t *k = t->free_list;
    if (k != NULL) {
        t->free_list = k->hnext;
        t->nfree--;
        return k;
    }
    return weft_alloc(sizeof(*k));
}

static void task_put_locked(weft__timer_t *t, task_t *k)
{
    if (t->nfree < FREE_KEEP) {
        k->hnext = t->free_list;
        t->free_list = k;
        t->nfree++;
    } else {
        weft_free(k);
    }
}

/* ------------------------------------------------------------------ the thread */

static void abs_time(struct timespec *ts, int64_t due_ns)
{
    /* The condition variable uses CLOCK_MONOTONIC, the clock of weft__now_ns. */
    ts->tv_sec = due_ns / 1000000000LL;
    ts->tv_nsec = due_ns % 1000000000LL;
}

static void *timer_main(void *arg)
{
    weft__timer_t *t = arg;

    pthread_mutex_lock(&t->mu);
    while (!t->stop) {
        if (t->n == 0) {
            t->wake_ns = INT64_MAX;
            pthread_cond_wait(&t->cv, &t->mu);
            continue;
        }
        task_t *k = t->heap[0];
        int64_t now = weft__now_ns();
        if (k->due_ns > now) {
            struct timespec ts;
            t->wake_ns = k->due_ns;
            abs_time(&ts, k->due_ns);
            pthread_cond_timedwait(&t->cv, &t->mu, &ts);
            continue;
        }
        heap_remove(t, k);
        (void)id_take(t, k->id);
        t->running = true;
        t->running_owner = k->owner;
        pthread_mutex_unlock(&t->mu);
        k->run(k->arg, k->data);
        pthread_mutex_lock(&t->mu);
        t->running = false;
        t->running_owner = NULL;
        task_put_locked(t, k);
        pthread_cond_broadcast(&t->idle_cv);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

/* ------------------------------------------------------------------ API */

weft_status_t weft__timer_create(const char *name, weft__timer_t **t_p)
{
    weft__timer_t *t = weft_calloc(1, sizeof(*t));
    pthread_condattr_t ca;

    if (t == NULL || (t->ids = weft_calloc(64, sizeof(*t->ids))) == NULL) {
        weft_free(t);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "timer: no memory");
    }
    t->nids = 64;
    t->next_id = 1;
    t->wake_ns = INT64_MAX;
    snprintf(t->name, sizeof(t->name), "%s", name != NULL ? name : "weft-timer");
    pthread_mutex_init(&t->mu, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&t->cv, &ca);
    pthread_cond_init(&t->idle_cv, &ca);
    pthread_condattr_destroy(&ca);
    if (pthread_create(&t->thread, NULL, timer_main, t) != 0) {
        pthread_mutex_destroy(&t->mu);
        pthread_cond_destroy(&t->cv);
        pthread_cond_destroy(&t->idle_cv);
        weft_free(t->ids);
        weft_free(t);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "timer: cannot start its thread");
    }
    t->running_thread = t->thread;
    *t_p = t;
    return WEFT_OK;
}

void weft__timer_free(weft__timer_t *t)
{
    if (t == NULL) {
        return;
    }
    pthread_mutex_lock(&t->mu);
    t->stop = true;
    pthread_cond_signal(&t->cv);
    pthread_mutex_unlock(&t->mu);
    pthread_join(t->thread, NULL);
    /* Tasks that never ran are dropped, earliest first. */
    while (t->n > 0) {
        task_t *k = t->heap[0];
        heap_remove(t, k);
        if (k->drop != NULL) {
            k->drop(k->arg, k->data);
        }
        weft_free(k);
    }
    while (t->free_list != NULL) {
        task_t *k = t->free_list;
        t->free_list = k->hnext;
        weft_free(k);
    }
    weft_free(t->heap);
    weft_free(t->ids);
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    pthread_cond_destroy(&t->idle_cv);
    weft_free(t);
}

uint64_t weft__timer_add(weft__timer_t *t, int64_t due_ns, weft__timer_cb_t run,
                         weft__timer_cb_t drop, void *arg, uint64_t data, const void *owner)
{
    pthread_mutex_lock(&t->mu);
    task_t *k = t->stop || !grow_locked(t) ? NULL : task_get_locked(t);
    if (k == NULL) {
        bool stopped = t->stop;
        pthread_mutex_unlock(&t->mu);
        if (!stopped) {
            WEFT_ERROR("%s: no memory for a task", t->name);
        }
        if (drop != NULL) {
            drop(arg, data);
        }
        return 0;
    }
    k->due_ns = due_ns;
    k->id = t->next_id++;
    k->run = run;
    k->drop = drop;
    k->arg = arg;
    k->data = data;
    k->owner = owner;
    k->hnext = NULL;
    heap_set(t, t->n, k);
    t->n++;
    sift_up(t, k->heap_idx);
    id_insert(t, k);
    uint64_t id = k->id;
    /* Wake the thread only if it would sleep past this task. */
    if (due_ns < t->wake_ns) {
        t->wake_ns = due_ns;
        pthread_cond_signal(&t->cv);
    }
    pthread_mutex_unlock(&t->mu);
    return id;
}

bool weft__timer_cancel(weft__timer_t *t, uint64_t id)
{
    if (id == 0) {
        return false;
    }
    pthread_mutex_lock(&t->mu);
    task_t *k = id_take(t, id);
    if (k != NULL) {
        heap_remove(t, k);
        task_put_locked(t, k);
    }
    pthread_mutex_unlock(&t->mu);
    return k != NULL;
}

void weft__timer_cancel_owner(weft__timer_t *t, const void *owner)
{
    task_t *dropped = NULL;

    pthread_mutex_lock(&t->mu);
    for (size_t i = 0; i < t->n;) {
        task_t *k = t->heap[i];
        if (k->owner != owner) {
            i++;
            continue;
        }
        heap_remove(t, k); /* another task moves into slot i: look at it next */
        (void)id_take(t, k->id);
        k->hnext = dropped;
        dropped = k;
    }
    /* A task of the owner running now finishes first (unless this is that task). */
    while (t->running && t->running_owner == owner &&
           !pthread_equal(pthread_self(), t->running_thread)) {
        pthread_cond_wait(&t->idle_cv, &t->mu);
    }
    pthread_mutex_unlock(&t->mu);
    /* Dropped in the order they would have run. */
    task_t *ordered = NULL;
    while (dropped != NULL) {
        task_t *k = dropped;
        dropped = k->hnext;
        task_t **pp = &ordered;
        while (*pp != NULL && before(*pp, k)) {
            pp = &(*pp)->hnext;
        }
        k->hnext = *pp;
        *pp = k;
    }
    while (ordered != NULL) {
        task_t *k = ordered;
        ordered = k->hnext;
        if (k->drop != NULL) {
            k->drop(k->arg, k->data);
        }
        weft_free(k);
    }
}

size_t weft__timer_pending(weft__timer_t *t)
{
    pthread_mutex_lock(&t->mu);
    size_t n = t->n;
    pthread_mutex_unlock(&t->mu);
    return n;
}
