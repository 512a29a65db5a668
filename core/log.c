/* Leveled logging to stderr, one write() per line; and the monotonic clock. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

/* Longest line written, newline included; longer texts are cut and end in "...". */
#define LINE_MAX_BYTES 4096
#define NAME_MAX_BYTES 64

static pthread_once_t level_once = PTHREAD_ONCE_INIT;
static atomic_int level = WEFT_LOG_WARN;

static pthread_mutex_t rank_mu = PTHREAD_MUTEX_INITIALIZER;
static int rank_set;
static int rank_value;
static char rank_name[NAME_MAX_BYTES];

static const char level_letters[] = {'D', 'I', 'W', 'E', 'O'};

static void level_init(void)
{
    /* Validated by the configuration table (an unknown word is reported there: warn). */
    const char *s = weft__cfg_str(WEFT__CFG_LOG);
    int lvl = WEFT_LOG_WARN;

    if (strcasecmp(s, "debug") == 0) {
        lvl = WEFT_LOG_DEBUG;
    } else if (strcasecmp(s, "info") == 0) {
        lvl = WEFT_LOG_INFO;
    } else if (strcasecmp(s, "error") == 0) {
        lvl = WEFT_LOG_ERROR;
    } else if (strcasecmp(s, "off") == 0 || strcasecmp(s, "none") == 0) {
        lvl = WEFT_LOG_OFF;
    }
    atomic_store(&level, lvl);
}

void weft_log_set_level(weft_log_level_t lvl)
{
    pthread_once(&level_once, level_init);
    if ((int)lvl < WEFT_LOG_DEBUG) {
        lvl = WEFT_LOG_DEBUG;
    }
    if ((int)lvl > WEFT_LOG_OFF) {
        lvl = WEFT_LOG_OFF;
    }
    atomic_store(&level, (int)lvl);
}

weft_log_level_t weft_log_level(void)
{
    pthread_once(&level_once, level_init);
    return (weft_log_level_t)atomic_load_explicit(&level, memory_order_relaxed);
}

void weft_log_set_rank(int rank, const char *name)
{
    pthread_mutex_lock(&rank_mu);
    rank_set = 1;
    rank_value = rank;
    snprintf(rank_name, sizeof(rank_name), "%s", name == NULL ? "" : name);
    pthread_mutex_unlock(&rank_mu);
}

static const char *base_name(const char *path)
{
    const char *slash;

    if (path == NULL) {
        return "?";
    }
    slash = strrchr(path, '/');
    return slash == NULL ? path : slash + 1;
}

/* Adds snprintf's result @p n to @p len, clamping at @p cap - 1 and noting a cut line. */
static size_t advance(size_t len, size_t cap, int n, int *cut)
{
    if (n < 0) {
        return len;
    }
    if ((size_t)n >= cap - len) {
        *cut = 1;
        return cap - 1;
    }
    return len + (size_t)n;
}

static void vlog(weft_log_level_t lvl, const char *file, int line, const char *fmt, va_list ap)
{
    char buf[LINE_MAX_BYTES];
    const size_t cap = sizeof(buf) - 1; /* room for the newline */
    char who[NAME_MAX_BYTES + 32];
    struct timeval tv;
    struct tm tm;
    size_t len = 0;
    size_t off = 0;
    int cut = 0;
    int saved_errno = errno;

    pthread_mutex_lock(&rank_mu);
    if (!rank_set) {
        snprintf(who, sizeof(who), "rank ?");
    } else if (rank_name[0] == '\0') {
        snprintf(who, sizeof(who), "rank %d", rank_value);
    } else {
        snprintf(who, sizeof(who), "rank %d %s", rank_value, rank_name);
    }
    pthread_mutex_unlock(&rank_mu);

    gettimeofday(&tv, NULL);
    localtime_r(&tv.tv_sec, &tm);
    len = advance(len, cap,
                  snprintf(buf, cap, "[weft %02d:%02d:%02d.%03d %c %s %s:%d] ", tm.tm_hour,
                           tm.tm_min, tm.tm_sec, (int)(tv.tv_usec / 1000), level_letters[lvl], who,
                           base_name(file), line),
                  &cut);
    len = advance(len, cap, vsnprintf(buf + len, cap - len, fmt, ap), &cut);
    if (cut && len >= 3) {
        memcpy(buf + len - 3, "...", 3);
    }
    buf[len++] = '\n';

    /* One write per line so that lines from threads and processes do not interleave. */
    while (off < len) {
        ssize_t n = write(STDERR_FILENO, buf + off, len - off);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            break;
        }
        off += (size_t)n;
    }
    errno = saved_errno;
}

void weft_log(weft_log_level_t lvl, const char *file, int line, const char *fmt, ...)
{
    va_list ap;

    if ((int)lvl < WEFT_LOG_DEBUG || (int)lvl >= WEFT_LOG_OFF || lvl < weft_log_level()) {
        return;
    }
    va_start(ap, fmt);
    vlog(lvl, file, line, fmt, ap);
    va_end(ap);
}

int64_t weft__now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int64_t weft__now_ms(void)
{
    return weft__now_ns() / 1000000;
}
