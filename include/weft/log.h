/* Leveled logging that names the rank: WEFT_LOG=debug|info|warn|error|off. */
#ifndef WEFT_LOG_H
#define WEFT_LOG_H

#include <weft/api.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    WEFT_LOG_DEBUG = 0,
    WEFT_LOG_INFO = 1,
    WEFT_LOG_WARN = 2,
    WEFT_LOG_ERROR = 3,
    WEFT_LOG_OFF = 4,
} weft_log_level_t;

/** Sets the threshold; by default read once from WEFT_LOG (warn if unset). Thread-safe. */
WEFT_API void weft_log_set_level(weft_log_level_t level);
WEFT_API weft_log_level_t weft_log_level(void);

/** Sets the rank and name printed in each line ("[weft rank 2 worker2] ..."). Thread-safe. */
WEFT_API void weft_log_set_rank(int rank, const char *name);

/** Writes one line to stderr if @p level passes the threshold. Thread-safe. */
WEFT_API void weft_log(weft_log_level_t level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define WEFT_LOG_AT(lvl, ...)                                                                      \
    do {                                                                                           \
        if ((lvl) >= weft_log_level()) {                                                           \
            weft_log((lvl), __FILE__, __LINE__, __VA_ARGS__);                                      \
        }                                                                                          \
    } while (0)
#define WEFT_DEBUG(...) WEFT_LOG_AT(WEFT_LOG_DEBUG, __VA_ARGS__)
#define WEFT_INFO(...)  WEFT_LOG_AT(WEFT_LOG_INFO, __VA_ARGS__)
#define WEFT_WARN(...)  WEFT_LOG_AT(WEFT_LOG_WARN, __VA_ARGS__)
#define WEFT_ERROR(...) WEFT_LOG_AT(WEFT_LOG_ERROR, __VA_ARGS__)

#ifdef __cplusplus
}
#endif
#endif
