/* core internals shared by weft modules. Not installed. */
#ifndef WEFT_CORE_INTERNAL_H
#define WEFT_CORE_INTERNAL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <weft/alloc.h>
#include <weft/future.h>
#include <weft/log.h>
#include <weft/optim.h>
#include <weft/pool.h>
#include <weft/random.h>
#include <weft/reduce.h>
#include <weft/status.h>
#include <weft/tensor.h>
#include <weft/value.h>

/* ---- errors ---------------------------------------------------------------------------------- */

/** Longest detail text kept for weft_last_error(), NUL included; longer texts are truncated. */
#define WEFT__ERROR_MAX 1024

/**
 * Records detail text for weft_last_error() (thread-local, printf-style) and returns @p status.
 * The arguments may point into the current weft_last_error() text.
 */
weft_status_t weft__set_error(weft_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/** As weft__set_error with a va_list. */
weft_status_t weft__set_error_v(weft_status_t status, const char *fmt, va_list ap)
    __attribute__((format(printf, 2, 0)));
/** Empties this thread's weft_last_error() text. */
void weft__clear_error(void);

/* Checks (NCCL checks.h style): pass a non-OK status up, or jump to a cleanup label. */
#define WEFT_CHECK(expr)                                                                           \
    do {                                                                                           \
        weft_status_t st__ = (expr);                                                               \
        if (st__ != WEFT_OK) {                                                                     \
            return st__;                                                                           \
        }                                                                                          \
    } while (0)
#define WEFT_CHECK_GOTO(expr, st, label)                                                           \
    do {                                                                                           \
        (st) = (expr);                                                                             \
        if ((st) != WEFT_OK) {                                                                     \
            goto label;                                                                            \
        }                                                                                          \
    } while (0)

/* ---- time ------------------------------------------------------------------------------------ */

/** Monotonic clock (CLOCK_MONOTONIC). */
int64_t weft__now_ns(void);
int64_t weft__now_ms(void);

/* ---- configuration (core/config.c; the table is core/config_vars.h) ------------------------- */

#include "config_vars.h"

typedef enum {
#define WEFT__CFG_ID_(id, ...) WEFT__CFG_##id,
    WEFT__CONFIG_VARS(WEFT__CFG_ID_)
#undef WEFT__CFG_ID_
        WEFT__CFG_COUNT
} weft__cfg_id_t;

/* The value in effect: read from the environment (or an alias) at the first use in this process,
 * validated (an invalid value is reported once and the default used), then the same for the life
 * of the process. Thread-safe. */
int64_t weft__cfg_int(weft__cfg_id_t id); /* INT and BOOL variables */
bool weft__cfg_bool(weft__cfg_id_t id);
const char *weft__cfg_str(weft__cfg_id_t id); /* STR, CHOICE, SECRET; never NULL */
/* Whether the environment set it (the variable or an alias), rather than the default. */
bool weft__cfg_is_set(weft__cfg_id_t id);
const char *weft__cfg_name(weft__cfg_id_t id);

/* ---- the timer service (core/timer.c) -------------------------------------------------------- */

/*
 * One thread that runs tasks at their due time (CLOCK_MONOTONIC ns, as weft__now_ns). The agent
 * owns one and lends it to every module (weft_agent_timer_add in weft/module.h): call deadlines,
 * retries, receive deadlines. Tasks run one at a time on the timer's thread and must not block.
 */
typedef struct weft__timer weft__timer_t;
/** A task: @p arg and @p data are what was given to weft__timer_add. */
typedef void (*weft__timer_cb_t)(void *arg, uint64_t data);
weft_status_t weft__timer_create(const char *name, weft__timer_t **t_p);
/** Stops the thread (a running task finishes first); tasks not run yet are dropped. */
void weft__timer_free(weft__timer_t *t);
/**
 * Runs @p run(arg, data) at @p due_ns (at once if past). @p drop(arg, data) (may be NULL) runs
 * instead if the task will never run (its owner was cancelled, the timer freed, or no memory).
 * @p owner groups tasks for weft__timer_cancel_owner (may be NULL). Returns the task's id (> 0),
 * or 0 when it could not be queued (drop has run). Any thread.
 */
uint64_t weft__timer_add(weft__timer_t *t, int64_t due_ns, weft__timer_cb_t run,
                         weft__timer_cb_t drop, void *arg, uint64_t data, const void *owner);
/** Takes task @p id out before it runs: true (neither run nor drop will be called); false when it
 * has run, is running, or is unknown. Any thread. */
bool weft__timer_cancel(weft__timer_t *t, uint64_t id);
/** Drops every task of @p owner (their drop runs, in due order) and waits until no task of it is
 * running, unless the caller is that task. Afterwards none of its tasks runs. */
void weft__timer_cancel_owner(weft__timer_t *t, const void *owner);
/** Tasks queued (tests). */
size_t weft__timer_pending(weft__timer_t *t);

/* ---- strings --------------------------------------------------------------------------------- */

/** printf into a fresh string; caller frees with weft_free. NULL when out of memory.
 * weft__vstrfmt consumes @p ap (as vsnprintf does). */
char *weft__strfmt(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
char *weft__vstrfmt(const char *fmt, va_list ap) __attribute__((format(printf, 1, 0)));

/* ---- futures --------------------------------------------------------------------------------- */

/*
 * Thread-local blocking hook: the rpc layer marks its transport threads with it, so that when such
 * a thread is about to block in weft_future_wait/wait_all/wait_any, the hook is called with
 * entering=1 (and entering=0 after it wakes). It is not called when the wait does not sleep (the
 * future is already done, completes while spinning, or timeout_ms is 0). No future lock is held
 * while it runs.
 */
typedef void (*weft__block_hook_cb_t)(int entering, void *arg);
/** Sets (cb != NULL) or clears (cb == NULL) the hook of the calling thread only. */
void weft__set_block_hook(weft__block_hook_cb_t cb, void *arg);
/** The calling thread's hook (*cb_p NULL: none), to be set again after a change. */
void weft__get_block_hook(weft__block_hook_cb_t *cb_p, void **arg_p);
/** A wait of weft's own that is not a future (a module's condition variable) is about to sleep
 * (@p entering 1) or woke up (0): the thread's hook hears of it as of a future's wait. */
void weft__blocking(int entering);

/* ---- tensors and values ---------------------------------------------------------------------- */

/*
 * Tensors whose storage is allocated but not touched (the receiver copies into them):
 * weft_tensor_empty. Storage is 64-byte aligned.
 */
#define WEFT__TENSOR_ALIGN 64

/**
 * Validates a dtype and shape (as read from the wire, say) and computes the element count and
 * byte size. Records an error text ("tensor: dim 3 has negative size -2") on failure.
 * @param[out] numel_p, nbytes_p may be NULL; set only on success.
 * @return WEFT_ERR_INVALID_ARG for a bad dtype, ndim, negative size or overflow.
 */
weft_status_t weft__tensor_shape_check(int dtype, int ndim, const int64_t *shape, int64_t *numel_p,
                                       size_t *nbytes_p);

/*
 * The autograd slot of a tensor: metadata owned by the autograd module (requires_grad, grad,
 * grad_fn, hooks), freed with @p ag_free when the tensor object is freed. Views and clones start
 * with an empty slot. Not synchronised: set it before the tensor is shared between threads.
 */
void *weft__tensor_ag(const weft_tensor_t *t);
/** Replaces the slot (the previous metadata, if any, is not freed). */
void weft__tensor_set_ag(weft_tensor_t *t, void *ag, void (*ag_free)(void *ag));
/**
 * Whether another reference than the caller's one may read @p t's bytes: another reference to the
 * tensor, or a view sharing its storage (e.g. a message being sent). A writer that must not be
 * seen half-way copies first (copy on write).
 */
bool weft__tensor_shared(const weft_tensor_t *t);

/*
 * The optimizer kernels of <weft/optim.h> on raw f32 arrays of @p n elements, with the same
 * arithmetic as the tensor entry points but no checks: the caller checked the configuration once
 * (weft_optim_*_config_check) and owns distinct arrays. For modules that update many small
 * parameters (a parameter server's rows) without a tensor per update.
 */
void weft__optim_sgd_f32(const weft_optim_sgd_config_t *cfg, float *param, const float *grad,
                         float *momentum_buf, size_t n, int64_t step);
void weft__optim_adagrad_f32(const weft_optim_adagrad_config_t *cfg, float *param,
                             const float *grad, float *sum, size_t n, int64_t step);
/* @p decoupled: AdamW. @p max_exp_avg_sq: with amsgrad only. */
void weft__optim_adam_f32(const weft_optim_adam_config_t *cfg, int decoupled, float *param,
                          const float *grad, float *exp_avg, float *exp_avg_sq,
                          float *max_exp_avg_sq, size_t n, int64_t step);

/*
 * A tensor that grows as its bytes arrive (a receiver that must not take memory for bytes that
 * were only announced). Begin gets a buffer of @p first bytes (or of the whole tensor when the
 * large-block cache holds a block of its size: memory the process holds already) at *data_p,
 * *cap_p its size; grow_to enlarges it to @p cap bytes (at most the tensor's), keeping the
 * @p filled bytes received so far (the buffer may move: *data_p); end makes the tensor (every byte
 * must have been written), whose block goes back to the cache like any other; abort frees it all.
 */
typedef struct weft__tgrow weft__tgrow_t;
weft_status_t weft__tensor_grow_begin(weft_dtype_t dtype, int ndim, const int64_t *shape,
                                      size_t first, weft__tgrow_t **g_p, uint8_t **data_p,
                                      size_t *cap_p);
weft_status_t weft__tensor_grow_to(weft__tgrow_t *g, size_t cap, size_t filled, uint8_t **data_p);
weft_status_t weft__tensor_grow_end(weft__tgrow_t *g, weft_tensor_t **t_p);
void weft__tensor_grow_abort(weft__tgrow_t *g);

/**
 * True when the caller holds the only reference to @p t and to its (owned) storage: nothing else
 * can see a write to it. The autograd engine uses it to sum gradients in place.
 */
int weft__tensor_exclusive(const weft_tensor_t *t);

/** Sum of the byte sizes of the value's tensors (0 for NULL). */
size_t weft__value_tensors_nbytes(const weft_value_t *v);

/**
 * weft_value_add_ref that takes over the caller's reference to @p obj on success (no retain);
 * caller keeps it on failure. WEFT_ERR_INVALID_ARG, WEFT_ERR_NO_MEMORY.
 */
weft_status_t weft__value_push_ref(weft_value_t *v, const weft_value_ref_type_t *type, void *obj);
/** Borrowed object of reference @p i and its type (@p type_p); NULL when out of range. */
void *weft__value_ref_at(const weft_value_t *v, size_t i, const weft_value_ref_type_t **type_p);
/** Replaces reference @p i (in range) by @p obj of @p type, taking over the caller's reference to
 * @p obj; the old object is released. */
void weft__value_replace_ref(weft_value_t *v, size_t i, const weft_value_ref_type_t *type,
                             void *obj);

#endif
