/* Waiting in tests: for an event or a counter, with a deadline; never for a length of time.
 * A test that must see something happen (or not happen) waits for the condition that proves it,
 * polled every millisecond, and fails with a clear message when the deadline passes first.
 * Header only: the core tests use it without the multi-rank harness. */
#ifndef WEFT_TEST_WAIT_H
#define WEFT_TEST_WAIT_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

/* Milliseconds of the monotonic clock. */
static inline int64_t now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* One polling step of a wait: gives the core away for about a millisecond. */
static inline void wait_step(void)
{
    struct timespec ts = {0, 1000000};

    nanosleep(&ts, NULL);
}

/* Evaluates @p cond, a step apart, until it holds or @p timeout_ms have passed; sets @p held (a
 * bool) to whether it held. */
#define WAIT_UNTIL(held, cond, timeout_ms)                                                         \
    do {                                                                                           \
        int64_t wait_until_ = now_ms() + (int64_t)(timeout_ms);                                    \
        for (;;) {                                                                                 \
            if (cond) {                                                                            \
                (held) = true;                                                                     \
                break;                                                                             \
            }                                                                                      \
            if (now_ms() > wait_until_) {                                                          \
                (held) = false;                                                                    \
                break;                                                                             \
            }                                                                                      \
            wait_step();                                                                           \
        }                                                                                          \
    } while (0)

/* Inside a rank's body (a function returning the rank's exit code): waits until @p cond holds;
 * fails the rank with the message if @p timeout_ms pass first. */
#define RANK_WAIT(cond, timeout_ms, ...)                                                           \
    do {                                                                                           \
        bool rank_wait_held_;                                                                      \
        WAIT_UNTIL(rank_wait_held_, cond, timeout_ms);                                             \
        if (!rank_wait_held_) {                                                                    \
            fprintf(stderr,                                                                        \
                    "rank wait failed at %s:%d: %s did not hold within %lld ms: ", __FILE__,       \
                    __LINE__, #cond, (long long)(timeout_ms));                                     \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

/* In a criterion test: waits until @p cond holds; fails the test with the message if
 * @p timeout_ms pass first. */
#define TEST_WAIT(cond, timeout_ms, ...)                                                           \
    do {                                                                                           \
        bool test_wait_held_;                                                                      \
        WAIT_UNTIL(test_wait_held_, cond, timeout_ms);                                             \
        if (!test_wait_held_) {                                                                    \
            char test_wait_why_[512];                                                              \
            snprintf(test_wait_why_, sizeof(test_wait_why_), __VA_ARGS__);                         \
            cr_assert_fail("%s did not hold within %lld ms: %s", #cond, (long long)(timeout_ms),   \
                           test_wait_why_);                                                        \
        }                                                                                          \
    } while (0)

#endif
