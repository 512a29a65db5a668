/* Configuration: every WEFT_* environment variable is declared once, with its type, default and
 * doc, and read once per process at its first use (values set later are not seen). Options passed
 * in code (weft_agent_opts_t, weft_pg_set_timeout, ...) override the environment. */
#ifndef WEFT_CONFIG_H
#define WEFT_CONFIG_H

#include <weft/api.h>

#include <stdint.h>
#include <stdio.h>

#include <weft/status.h>

#ifdef __cplusplus
extern "C" {
#endif

/**
 * Prints every WEFT_* variable: its value in effect (from the environment, or the default), where
 * it came from, its type, range or choices, default and what it does. A secret (the job token) is
 * shown as set or unset, never its value. @p out NULL: stdout. Thread-safe.
 */
WEFT_API void weft_config_print(FILE *out);

/**
 * The value in effect of the string variable @p name (e.g. "WEFT_DATA_DIR"): borrowed, valid for
 * the life of the process, "" when unset without a default. NULL for an unknown name, a number,
 * or a secret. Thread-safe.
 */
WEFT_API const char *weft_config_str(const char *name);

/**
 * The value in effect of the integer or boolean variable @p name into @p value_p.
 * @return WEFT_ERR_NOT_FOUND (no such variable), WEFT_ERR_INVALID_ARG (not a number). Thread-safe.
 */
WEFT_API weft_status_t weft_config_int(const char *name, int64_t *value_p);

#ifdef __cplusplus
}
#endif
#endif
