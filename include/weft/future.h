/* Futures: every asynchronous weft operation returns one. */
#ifndef WEFT_FUTURE_H
#define WEFT_FUTURE_H

#include <weft/api.h>

#include <stddef.h>
#include <stdint.h>

#include <weft/value.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct weft_future weft_future_t;

/** Fires once when the future completes; runs on the completing thread. */
typedef void (*weft_future_cb_t)(weft_future_t *f, void *arg);

/** Creates a pending future with one reference. Caller releases with weft_future_release. */
WEFT_API weft_status_t weft_future_create(weft_future_t **f_p);
WEFT_API weft_future_t *weft_future_retain(weft_future_t *f);
WEFT_API void weft_future_release(weft_future_t *f);

/**
 * Completes the future once: later completions are ignored (and their value
 * freed). Takes ownership of @p value (may be NULL). @p text may be NULL.
 * Wakes waiters and runs callbacks. Returns 1 if this call completed it.
 * Thread-safe.
 */
WEFT_API int weft_future_complete(weft_future_t *f, weft_status_t status, const char *text,
                                  weft_value_t *value);
/** As weft_future_complete with printf-style text. */
WEFT_API int weft_future_fail(weft_future_t *f, weft_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/**
 * Waits until the future completes or @p timeout_ms passes. As everywhere in weft, a timeout of 0
 * means the default: for a wait, until the future completes (every future a weft operation
 * returns completes by that operation's own deadline); < 0 means no limit as well. To look
 * without waiting, use weft_future_done. Thread-safe.
 * @return the future's status, or WEFT_ERR_TIMEOUT if still pending (the
 * future stays valid and may complete later).
 */
WEFT_API weft_status_t weft_future_wait(weft_future_t *f, int64_t timeout_ms);
/** 1 if completed. */
WEFT_API int weft_future_done(const weft_future_t *f);
/** The status, or WEFT_ERR_PENDING while pending. */
WEFT_API weft_status_t weft_future_status(const weft_future_t *f);
/** The error text ("" on success or while pending). Borrowed, valid while @p f lives. */
WEFT_API const char *weft_future_error(const weft_future_t *f);
/** Borrowed result value (NULL if none or pending); valid while @p f lives. */
WEFT_API weft_value_t *weft_future_value(const weft_future_t *f);
/**
 * Moves the result value out (NULL if none).
 * @return WEFT_ERR_PENDING while pending; else the future's status.
 */
WEFT_API weft_status_t weft_future_take_value(weft_future_t *f, weft_value_t **v_p);

/**
 * Adds a callback that fires exactly once when the future completes, at once
 * on this thread if it already has. Callbacks fire in the order added.
 */
WEFT_API weft_status_t weft_future_then(weft_future_t *f, weft_future_cb_t cb, void *arg);

/**
 * Waits for all @p n futures (total time @p timeout_ms; 0: until all complete). Returns WEFT_OK
 * if all succeeded, the first failing one's status otherwise, WEFT_ERR_TIMEOUT if some are still
 * pending when time runs out. Thread-safe.
 */
WEFT_API weft_status_t weft_future_wait_all(weft_future_t *const *futs, size_t n,
                                            int64_t timeout_ms);
/** Waits until any of @p n completes (0: without limit); its index goes to @p index_p.
 * WEFT_ERR_TIMEOUT if none did in time. Thread-safe. */
WEFT_API weft_status_t weft_future_wait_any(weft_future_t *const *futs, size_t n,
                                            int64_t timeout_ms, size_t *index_p);

#ifdef __cplusplus
}
#endif
#endif
