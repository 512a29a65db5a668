/* Runs a program for a test: output captured, a deadline, launcher variables
 * of the outer environment scrubbed. */
#ifndef WEFT_TEST_RUN_H
#define WEFT_TEST_RUN_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

typedef struct {
    int code;  /* exit status, or 128 + signal */
    char *out; /* stdout, NUL-terminated */
    size_t out_len;
    char *err; /* stderr, NUL-terminated */
    size_t err_len;
    double elapsed; /* seconds */
    pid_t pid;
} run_result_t;

typedef struct {
    const char *const *argv; /* NULL-terminated; argv[0] is the program's path */
    const char *const *env;  /* extra "NAME=VALUE" entries, NULL-terminated, or NULL */
    const char *const *keep; /* "NAME=" prefixes kept although launcher-like, or NULL */
    double deadline_s;       /* killed (SIGTERM, then SIGKILL) and the test failed after it */
    /* If sig is not 0, it is sent to the program once its stdout holds sig_when_count
     * occurrences of sig_when: an event, not a delay. */
    int sig;
    const char *sig_when;
    int sig_when_count;
} run_opts_t;

/* Runs the program; fails the test (criterion) when it outlives the deadline. */
void run_capture(const run_opts_t *o, run_result_t *r);
void run_result_free(run_result_t *r);
/* The path a test's environment variable names (fails the test if unset). */
const char *run_path_from_env(const char *name);
/* The first line of @p text equal to @p want (or starting with it if @p prefix); NULL if none. */
const char *run_find_line(const char *text, const char *want, bool prefix);

#endif
