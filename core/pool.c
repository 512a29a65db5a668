/* A fixed-size thread pool with a FIFO queue; destroy drains the queue, then joins. */
#include <pthread.h>
#include <string.h>

#include "internal.h"

#define POOL_MAX_THREADS 1024

typedef struct task {
    weft_task_cb_t fn;
    void *arg;
    struct task *next;
} task_t;

struct weft_pool {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    task_t *head; /* under mu */
    task_t *tail;
    int shutting_down; /* under mu */
    int nthreads;
    pthread_t *threads;
};

static void *worker_main(void *arg)
{
    weft_pool_t *pool = arg;

    pthread_setname_np(pthread_self(), "weft-pool");
    for (;;) {
        task_t *task;

        pthread_mutex_lock(&pool->mu);
        while (pool->head == NULL && !pool->shutting_down) {
            pthread_cond_wait(&pool->cv, &pool->mu);
        }
        task = pool->head;
        if (task == NULL) {
            /* Shutting down and nothing left to run. */
            pthread_mutex_unlock(&pool->mu);
            break;
        }
        pool->head = task->next;
        if (pool->head == NULL) {
            pool->tail = NULL;
        }
        pthread_mutex_unlock(&pool->mu);
        task->fn(task->arg);
        weft_free(task);
    }
    return NULL;
}

/* Stops and joins the first @p started threads. */
static void stop_threads(weft_pool_t *pool, int started)
{
    pthread_mutex_lock(&pool->mu);
    pool->shutting_down = 1;
    pthread_cond_broadcast(&pool->cv);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 0; i < started; i++) {
        pthread_join(pool->threads[i], NULL);
    }
}

weft_status_t weft_pool_create(int nthreads, weft_pool_t **pool_p)
{
    weft_status_t status;
    weft_pool_t *pool;
    int started = 0;
    int rc;

    if (pool_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "pool: pool_p is NULL");
    }
    if (nthreads < 1 || nthreads > POOL_MAX_THREADS) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "pool: %d threads (must be 1..%d)", nthreads,
                               POOL_MAX_THREADS);
    }
    pool = weft_calloc(1, sizeof(*pool));
    if (pool == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "pool: out of memory");
    }
    pool->threads = weft_calloc((size_t)nthreads, sizeof(pool->threads[0]));
    if (pool->threads == NULL) {
        status =
            weft__set_error(WEFT_ERR_NO_MEMORY, "pool: out of memory for %d threads", nthreads);
        goto err_free_pool;
    }
    rc = pthread_mutex_init(&pool->mu, NULL);
    if (rc != 0) {
        status = weft__set_error(WEFT_ERR_NO_MEMORY, "pool: pthread_mutex_init failed: %s",
                                 strerror(rc));
        goto err_free_threads;
    }
    rc = pthread_cond_init(&pool->cv, NULL);
    if (rc != 0) {
        status =
            weft__set_error(WEFT_ERR_NO_MEMORY, "pool: pthread_cond_init failed: %s", strerror(rc));
        goto err_destroy_mutex;
    }
    pool->nthreads = nthreads;
    for (started = 0; started < nthreads; started++) {
        rc = pthread_create(&pool->threads[started], NULL, worker_main, pool);
        if (rc != 0) {
            status = weft__set_error(WEFT_ERR_NO_MEMORY, "pool: cannot start thread %d of %d: %s",
                                     started, nthreads, strerror(rc));
            goto err_stop_threads;
        }
    }
    *pool_p = pool;
    return WEFT_OK;

err_stop_threads:
    stop_threads(pool, started);
    pthread_cond_destroy(&pool->cv);
err_destroy_mutex:
    pthread_mutex_destroy(&pool->mu);
err_free_threads:
    weft_free(pool->threads);
err_free_pool:
    weft_free(pool);
    return status;
}

weft_status_t weft_pool_submit(weft_pool_t *pool, weft_task_cb_t fn, void *arg)
{
    task_t *task;

    if (pool == NULL || fn == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "pool: NULL pool or task");
    }
    task = weft_alloc(sizeof(*task));
    if (task == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "pool: out of memory for a task");
    }
    task->fn = fn;
    task->arg = arg;
    task->next = NULL;
    pthread_mutex_lock(&pool->mu);
    if (pool->shutting_down) {
        pthread_mutex_unlock(&pool->mu);
        weft_free(task);
        return weft__set_error(WEFT_ERR_SHUTDOWN, "pool: submit after destroy began");
    }
    if (pool->tail == NULL) {
        pool->head = task;
    } else {
        pool->tail->next = task;
    }
    pool->tail = task;
    pthread_cond_signal(&pool->cv);
    pthread_mutex_unlock(&pool->mu);
    return WEFT_OK;
}

void weft_pool_destroy(weft_pool_t *pool)
{
    if (pool == NULL) {
        return;
    }
    /* Workers keep taking tasks until the queue is empty, then exit. */
    stop_threads(pool, pool->nthreads);
    pthread_cond_destroy(&pool->cv);
    pthread_mutex_destroy(&pool->mu);
    weft_free(pool->threads);
    weft_free(pool);
}
