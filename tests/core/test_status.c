/* core: status table, last error, allocator, strings, logging, clock. */
#include <criterion/criterion.h>

#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "counting_alloc.h"
#include "internal.h"

static const int all_values[] = {
#define VALUE(name, value, text) value,
    WEFT_STATUS_MAP(VALUE)
#undef VALUE
};
static const char *const all_names[] = {
#define NAME(name, value, text) "WEFT_" #name,
    WEFT_STATUS_MAP(NAME)
#undef NAME
};
static const char *const all_texts[] = {
#define TEXT(name, value, text) text,
    WEFT_STATUS_MAP(TEXT)
#undef TEXT
};
#define NSTATUS (sizeof(all_values) / sizeof(all_values[0]))

Test(status, table_strings_and_names_are_distinct)
{
    cr_assert_eq(WEFT_OK, 0);
    for (size_t i = 0; i < NSTATUS; i++) {
        weft_status_t si = (weft_status_t)all_values[i];

        cr_assert_str_eq(weft_strerror(si), all_texts[i]);
        cr_assert_str_eq(weft_status_name(si), all_names[i]);
        cr_assert(weft_status_valid(all_values[i]));
        cr_assert_str_neq(weft_strerror(si), "unknown status");
        for (size_t j = i + 1; j < NSTATUS; j++) {
            weft_status_t sj = (weft_status_t)all_values[j];

            cr_assert_neq(all_values[i], all_values[j]);
            cr_assert_str_neq(weft_strerror(si), weft_strerror(sj), "%s and %s share a text",
                              all_names[i], all_names[j]);
            cr_assert_str_neq(weft_status_name(si), weft_status_name(sj));
        }
    }
    cr_assert_str_eq(weft_status_name(WEFT_ERR_PEER_LOST), "WEFT_ERR_PEER_LOST");
    cr_assert_str_eq(weft_strerror(WEFT_ERR_PEER_LOST), "peer lost");
}

Test(status, unknown_values)
{
    const int unknown[] = {1, 7, -14, -19, -28, -41, -59, -62, -79, -82, -1000, 12345};

    for (size_t i = 0; i < sizeof(unknown) / sizeof(unknown[0]); i++) {
        cr_assert_str_eq(weft_strerror((weft_status_t)unknown[i]), "unknown status");
        cr_assert_not(weft_status_valid(unknown[i]), "%d", unknown[i]);
        cr_assert_str_eq(weft_status_name((weft_status_t)unknown[i]), "WEFT_UNKNOWN_STATUS");
    }
}

Test(status, status_groups)
{
    for (size_t i = 0; i < NSTATUS; i++) {
        cr_assert_leq(all_values[i], 0);
        cr_assert_geq(all_values[i], -89);
    }
    cr_assert(WEFT_ERR_PEER_LOST <= -20 && WEFT_ERR_PEER_LOST >= -39);
    cr_assert(WEFT_ERR_REMOTE <= -40 && WEFT_ERR_REMOTE >= -59);
    cr_assert(WEFT_ERR_TIMEOUT <= -60 && WEFT_ERR_TIMEOUT >= -69);
    cr_assert(WEFT_ERR_CUDA <= -80 && WEFT_ERR_CUDA >= -89);
}

Test(status, last_error_records_and_clears)
{
    cr_assert_not_null(weft_last_error());
    cr_assert_str_eq(weft_last_error(), "");
    cr_assert_eq(weft__set_error(WEFT_ERR_SHAPE, "bad %s %d", "dim", 3), WEFT_ERR_SHAPE);
    cr_assert_str_eq(weft_last_error(), "bad dim 3");
    /* The arguments may point into the current text. */
    weft__set_error(WEFT_ERR_REMOTE, "outer: %s", weft_last_error());
    cr_assert_str_eq(weft_last_error(), "outer: bad dim 3");
    weft__clear_error();
    cr_assert_str_eq(weft_last_error(), "");
}

Test(status, last_error_is_truncated_not_overflowed)
{
    char big[3000];

    memset(big, 'x', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    weft__set_error(WEFT_ERR_IO, "%s", big);
    cr_assert_eq(strlen(weft_last_error()), WEFT__ERROR_MAX - 1);
}

static void *other_thread_error(void *arg)
{
    char *seen = arg;

    snprintf(seen, 64, "%s", weft_last_error());
    weft__set_error(WEFT_ERR_IO, "from the other thread");
    return NULL;
}

Test(status, last_error_is_thread_local)
{
    char seen[64] = "unset";
    pthread_t th;

    weft__set_error(WEFT_ERR_IO, "mine");
    cr_assert_eq(pthread_create(&th, NULL, other_thread_error, seen), 0);
    pthread_join(th, NULL);
    cr_assert_str_eq(seen, "");
    cr_assert_str_eq(weft_last_error(), "mine");
}

/* ---- allocator ---- */

/* n_alloc, n_free, counting, use_counting, check_balanced */

Test(alloc, zero_size_gives_unique_pointers)
{
    void *a = weft_alloc(0);
    void *b = weft_alloc(0);

    cr_assert_not_null(a);
    cr_assert_not_null(b);
    cr_assert_neq(a, b);
    weft_free(a);
    weft_free(b);
    weft_free(NULL);
}

Test(alloc, calloc_zeroes_and_checks_overflow)
{
    unsigned char *p = weft_calloc(16, 8);

    cr_assert_not_null(p);
    for (int i = 0; i < 128; i++) {
        cr_assert_eq(p[i], 0);
    }
    weft_free(p);
    cr_assert_null(weft_calloc(SIZE_MAX / 2, 3));
    cr_assert_null(weft_calloc((size_t)1 << 33, (size_t)1 << 33));
}

Test(alloc, realloc_grows_and_keeps_bytes)
{
    char *p = weft_realloc(NULL, 4);

    cr_assert_not_null(p);
    memcpy(p, "abc", 4);
    p = weft_realloc(p, 1 << 20);
    cr_assert_not_null(p);
    cr_assert_str_eq(p, "abc");
    weft_free(p);
}

Test(alloc, strdup_and_strfmt)
{
    char *s = weft_strdup("hello");
    char *f = weft__strfmt("%s-%d-%05.1f", "x", 42, 3.14159);

    cr_assert_str_eq(s, "hello");
    cr_assert_null(weft_strdup(NULL));
    cr_assert_str_eq(f, "x-42-003.1");
    weft_free(s);
    weft_free(f);
}

Test(alloc, replacement_counts_every_call)
{
    void *a;
    char *s;

    weft_set_allocator(&counting);
    a = weft_alloc(10);
    s = weft_strdup("abc");
    a = weft_realloc(a, 100);
    cr_assert_eq(atomic_load(&n_alloc), 2);
    weft_free(a);
    weft_free(s);
    cr_assert_eq(atomic_load(&n_free), 2);
    weft_set_allocator(NULL);
    a = weft_alloc(1);
    weft_free(a);
    cr_assert_eq(atomic_load(&n_alloc), 2);
    cr_assert_eq(atomic_load(&n_free), 2);
}

Test(alloc, incomplete_allocator_falls_back_to_libc)
{
    weft_allocator_t half = {count_malloc, NULL, count_free, NULL};
    void *a;

    weft_set_allocator(&half);
    a = weft_alloc(8);
    weft_free(a);
    cr_assert_eq(atomic_load(&n_alloc), 0);
    weft_set_allocator(NULL);
}

/* ---- logging ---- */

/* Runs the logging calls of @p fn with stderr going to a pipe; returns what was written. */
static void capture_stderr(void (*fn)(void), char *out, size_t cap)
{
    int fds[2];
    int saved;
    ssize_t n;

    cr_assert_eq(pipe(fds), 0);
    saved = dup(STDERR_FILENO);
    cr_assert_geq(saved, 0);
    cr_assert_geq(dup2(fds[1], STDERR_FILENO), 0);
    fn();
    cr_assert_geq(dup2(saved, STDERR_FILENO), 0);
    close(saved);
    close(fds[1]);
    n = read(fds[0], out, cap - 1);
    out[n < 0 ? 0 : n] = '\0';
    close(fds[0]);
}

static void log_warn_and_debug(void)
{
    WEFT_WARN("hello %d", 7);
    WEFT_DEBUG("hidden");
}

Test(log, line_format_without_rank)
{
    char buf[4096];
    int hh, mm, ss, ms, line;
    char file[64];
    char text[64];

    weft_log_set_level(WEFT_LOG_WARN);
    cr_assert_eq(weft_log_level(), WEFT_LOG_WARN);
    capture_stderr(log_warn_and_debug, buf, sizeof(buf));
    cr_assert_eq(sscanf(buf, "[weft %d:%d:%d.%d W rank ? %63[^:]:%d] %63[^\n]", &hh, &mm, &ss, &ms,
                        file, &line, text),
                 7, "line: %s", buf);
    cr_assert_str_eq(file, "test_status.c");
    cr_assert_str_eq(text, "hello 7");
    cr_assert(ms >= 0 && ms < 1000);
    /* Exactly one line: the debug one is filtered. */
    cr_assert_eq(strchr(buf, '\n'), buf + strlen(buf) - 1, "output: %s", buf);
}

static void log_error_line(void)
{
    weft_log(WEFT_LOG_ERROR, "/some/dir/agent.c", 123, "boom");
}

Test(log, line_format_with_rank)
{
    char buf[4096];
    char *p;

    weft_log_set_rank(2, "worker2");
    capture_stderr(log_error_line, buf, sizeof(buf));
    p = strstr(buf, " E rank 2 worker2 agent.c:123] boom\n");
    cr_assert_not_null(p, "line: %s", buf);
    cr_assert_eq(strncmp(buf, "[weft ", 6), 0);
}

static void log_long_line(void)
{
    char big[10000];

    memset(big, 'y', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    WEFT_ERROR("%s", big);
}

Test(log, long_line_is_cut_and_ends_in_newline)
{
    char buf[16384];
    size_t len;

    capture_stderr(log_long_line, buf, sizeof(buf));
    len = strlen(buf);
    cr_assert_leq(len, 4096);
    cr_assert_eq(buf[len - 1], '\n');
    cr_assert_eq(strncmp(buf + len - 4, "...", 3), 0);
}

static void log_nothing_when_off(void)
{
    weft_log_set_level(WEFT_LOG_OFF);
    WEFT_ERROR("never");
    weft_log(WEFT_LOG_ERROR, __FILE__, __LINE__, "never either");
    weft_log_set_level(WEFT_LOG_DEBUG);
    WEFT_DEBUG("shown");
}

Test(log, level_threshold)
{
    char buf[4096];

    capture_stderr(log_nothing_when_off, buf, sizeof(buf));
    cr_assert_null(strstr(buf, "never"), "output: %s", buf);
    cr_assert_not_null(strstr(buf, " D rank ? test_status.c:"), "output: %s", buf);
    cr_assert_not_null(strstr(buf, "] shown\n"));
}

/* ---- clock ---- */

Test(clock, monotonic)
{
    int64_t a = weft__now_ns();
    int64_t b;

    /* The input: the clock must move across a sleep of at least 2 ms (not a wait for an event). */
    usleep(2000);
    b = weft__now_ns();
    cr_assert_gt(a, 0);
    cr_assert_geq(b - a, 1000000);
    cr_assert_leq(weft__now_ms() - b / 1000000, 1000);
}
