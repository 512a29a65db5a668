/* A fixed-size thread pool with a FIFO queue. */
#ifndef WEFT_POOL_H
#define WEFT_POOL_H

#include <weft/api.h>

#include <stddef.h>

#include <weft/status.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct weft_pool weft_pool_t;
typedef void (*weft_task_cb_t)(void *arg);

/** Starts @p nthreads (>= 1) worker threads. Caller frees with weft_pool_destroy. */
WEFT_API weft_status_t weft_pool_create(int nthreads, weft_pool_t **pool_p);
/** Queues fn(arg). Thread-safe. WEFT_ERR_SHUTDOWN once destroy has begun. */
WEFT_API weft_status_t weft_pool_submit(weft_pool_t *pool, weft_task_cb_t fn, void *arg);
/** Runs every queued task, then joins the threads and frees the pool. */
WEFT_API void weft_pool_destroy(weft_pool_t *pool);

#ifdef __cplusplus
}
#endif
#endif
