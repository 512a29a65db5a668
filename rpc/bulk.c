/* The bulk queue: large received messages are read out (one copy) and served
 * here, so that the transport thread goes back to the socket meanwhile. Like
 * the transport threads, a worker that blocks in a weft wait (a handler making
 * a nested call) gets a replacement, so queued work never waits behind it. */
#include "internal.h"

#define BULK_MAX_WORKERS 64

typedef struct bulk_item {
    struct bulk_item *next;
    void (*fn)(void *arg);
    void *arg;
} bulk_item_t;

struct weft__bulk {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bulk_item_t *head, *tail;
    pthread_t threads[BULK_MAX_WORKERS];
    int nthreads;
    int idle;    /* workers waiting for work */
    int blocked; /* workers blocked in a weft wait */
    bool stop;
};

static void *worker_main(void *arg);

/* Called with b->mu held. */
static void spawn_locked(weft__bulk_t *b)
{
    if (b->nthreads < BULK_MAX_WORKERS &&
        pthread_create(&b->threads[b->nthreads], NULL, worker_main, b) == 0) {
        b->nthreads++;
    }
}

static void block_hook(int entering, void *arg)
{
    weft__bulk_t *b = arg;

    pthread_mutex_lock(&b->mu);
    if (entering) {
        b->blocked++;
        if (b->idle == 0 && b->head != NULL && !b->stop) {
            spawn_locked(b);
        }
    } else {
        b->blocked--;
    }
    pthread_mutex_unlock(&b->mu);
}

static void *worker_main(void *arg)
{
    weft__bulk_t *b = arg;

    weft__set_block_hook(block_hook, b);
    pthread_mutex_lock(&b->mu);
    for (;;) {
        while (b->head == NULL && !b->stop) {
            b->idle++;
            pthread_cond_wait(&b->cv, &b->mu);
            b->idle--;
        }
        if (b->head == NULL) {
            break;
        }
        bulk_item_t *it = b->head;
        b->head = it->next;
        if (b->head == NULL) {
            b->tail = NULL;
        }
        /* Work is waiting and every other worker is busy or blocked: keep one more. */
        if (b->head != NULL && b->idle == 0 && b->blocked > 0) {
            spawn_locked(b);
        }
        pthread_mutex_unlock(&b->mu);
        it->fn(it->arg);
        weft_free(it);
        pthread_mutex_lock(&b->mu);
    }
    pthread_mutex_unlock(&b->mu);
    weft__set_block_hook(NULL, NULL);
    return NULL;
}

weft_status_t weft__bulk_create(weft__bulk_t **b_p)
{
    weft__bulk_t *b = weft_calloc(1, sizeof(*b));

    if (b == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "bulk: no memory");
    }
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->cv, NULL);
    pthread_mutex_lock(&b->mu);
    spawn_locked(b);
    pthread_mutex_unlock(&b->mu);
    if (b->nthreads == 0) {
        pthread_mutex_destroy(&b->mu);
        pthread_cond_destroy(&b->cv);
        weft_free(b);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "bulk: cannot start a thread");
    }
    *b_p = b;
    return WEFT_OK;
}

weft_status_t weft__bulk_submit(weft__bulk_t *b, void (*fn)(void *arg), void *arg)
{
    bulk_item_t *it = weft_alloc(sizeof(*it));

    if (it == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "bulk: no memory");
    }
    it->next = NULL;
    it->fn = fn;
    it->arg = arg;
    pthread_mutex_lock(&b->mu);
    if (b->stop) {
        pthread_mutex_unlock(&b->mu);
        weft_free(it);
        return weft__set_error(WEFT_ERR_SHUTDOWN, "bulk: stopped");
    }
    if (b->tail == NULL) {
        b->head = b->tail = it;
    } else {
        b->tail->next = it;
        b->tail = it;
    }
    if (b->idle == 0 && b->blocked > 0) {
        spawn_locked(b);
    }
    pthread_cond_signal(&b->cv);
    pthread_mutex_unlock(&b->mu);
    return WEFT_OK;
}

void weft__bulk_destroy(weft__bulk_t *b)
{
    if (b == NULL) {
        return;
    }
    pthread_mutex_lock(&b->mu);
    b->stop = true;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    /* Workers finish what is queued, then exit; threads started meanwhile are joined too. */
    for (int i = 0;; i++) {
        pthread_mutex_lock(&b->mu);
        int n = b->nthreads;
        pthread_mutex_unlock(&b->mu);
        if (i >= n) {
            break;
        }
        pthread_join(b->threads[i], NULL);
    }
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv);
    weft_free(b);
}
