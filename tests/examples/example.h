/*
 * The examples under weftrun, run by their tests as a user would run them (tests/examples/):
 * the launcher is WEFTRUN, each example's path is in its own variable (PS_TRAIN, DP_TRAIN, ...),
 * and the assertions on what they print.
 */
#ifndef WEFT_TEST_EXAMPLE_H
#define WEFT_TEST_EXAMPLE_H

#include <stdbool.h>
#include <stddef.h>
#include <string.h>

#include "run.h"

/** A run's deadline unless an example_t says otherwise: killed after it, and the test fails. */
#define EXAMPLE_DEADLINE_S 60.0

typedef run_result_t result_t;

#define result_free   run_result_free
#define find_line     run_find_line
#define path_from_env run_path_from_env

/** How to launch one example. */
typedef struct {
    const char *ranks;    /**< weftrun -n */
    const char *servers;  /**< weftrun --servers, or NULL */
    const char *prog_env; /**< the environment variable that names the example's path */
    double deadline_s;    /**< 0: EXAMPLE_DEADLINE_S */
    /* If sig is not 0, it is sent to weftrun once its stdout holds sig_when_count (0: 1)
     * occurrences of sig_when: an event, not a delay. */
    int sig;
    const char *sig_when;
    int sig_when_count;
} example_t;

/**
 * Runs `WEFTRUN -n RANKS [--servers S] EXAMPLE ARGS...` with @p args (NULL-terminated, or NULL)
 * and captures its output into @p r (caller frees with result_free). Of the outer environment's
 * launcher variables, WEFT_DATA_DIR and WEFT_LOG are kept.
 */
void example_run(result_t *r, const example_t *ex, const char *const *args);

/** example_run with the example's arguments listed: example_run_with(&r, &ex, "--epochs", "1"). */
#define example_run_with(r, ex, ...)                                                               \
    do {                                                                                           \
        const char *const args_[] = {__VA_ARGS__, NULL};                                           \
        example_run((r), (ex), args_);                                                             \
    } while (0)

/** Whether Fashion-MNIST is installed ($WEFT_DATA_DIR, else Debian's dataset-fashion-mnist). */
bool example_have_fashion_mnist(void);

#define SKIP_WITHOUT_FASHION_MNIST()                                                               \
    do {                                                                                           \
        if (!example_have_fashion_mnist()) {                                                       \
            cr_skip_test("Fashion-MNIST is not installed (package dataset-fashion-mnist)");        \
        }                                                                                          \
    } while (0)

/** A new directory /tmp/weft_example_WHAT_XXXXXX into @p dir (@p n bytes). */
void example_tmp_dir(char *dir, size_t n, const char *what);
/** Removes @p dir and everything in it. */
void example_remove_dir(const char *dir);

/**
 * The numbers of the line "@p lead resumed at step S from @p dir: continuing with epoch E, step
 * P of N" (ps_train's and hybrid_train's after --resume) into @p v (S, E, P, N); fails the test
 * if stdout has no such line.
 */
void example_resumed_at(const result_t *r, const char *lead, const char *dir, long long v[4]);

/** Fails the test unless every line of @p want (NULL-terminated) is a whole line of stdout. */
void example_assert_lines(const result_t *r, const char *const *want);

#define assert_exit(r, want)                                                                       \
    cr_assert_eq((r)->code, (want), "exit %d\nstdout:\n%s\nstderr:\n%s", (r)->code, (r)->out,      \
                 (r)->err)

#define assert_stderr_has(r, want)                                                                 \
    cr_assert(strstr((r)->err, (want)) != NULL, "stderr lacks: %s\nstderr:\n%s", (want), (r)->err)

#define assert_line(r, want)                                                                       \
    cr_assert(find_line((r)->out, (want), false) != NULL,                                          \
              "missing line: %s\nstdout:\n%s\nstderr:\n%s", (want), (r)->out, (r)->err)

#define assert_line_prefix(r, want)                                                                \
    cr_assert(find_line((r)->out, (want), true) != NULL,                                           \
              "missing line starting with: %s\nstdout:\n%s\nstderr:\n%s", (want), (r)->out,        \
              (r)->err)

#endif
