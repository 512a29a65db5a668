/* Status strings and names (from WEFT_STATUS_MAP) and the thread's last error text. */
#include <stdio.h>
#include <string.h>

#include "internal.h"

static _Thread_local char last_error[WEFT__ERROR_MAX];

const char *weft_strerror(weft_status_t status)
{
    switch ((int)status) {
#define STATUS_TEXT(name, value, text)                                                             \
    case value:                                                                                    \
        return text;
        WEFT_STATUS_MAP(STATUS_TEXT)
#undef STATUS_TEXT
    default:
        return "unknown status";
    }
}

const char *weft_status_name(weft_status_t status)
{
    switch ((int)status) {
#define STATUS_NAME(name, value, text)                                                             \
    case value:                                                                                    \
        return "WEFT_" #name;
        WEFT_STATUS_MAP(STATUS_NAME)
#undef STATUS_NAME
    default:
        return "WEFT_UNKNOWN_STATUS";
    }
}

int weft_status_valid(int v)
{
    switch (v) {
#define STATUS_CASE(name, value, text) case value:
        WEFT_STATUS_MAP(STATUS_CASE)
#undef STATUS_CASE
        return 1;
    default:
        return 0;
    }
}

const char *weft_last_error(void)
{
    return last_error;
}

weft_status_t weft__set_error_v(weft_status_t status, const char *fmt, va_list ap)
{
    /* Format aside first: the arguments may point into last_error itself. */
    char buf[WEFT__ERROR_MAX];

    if (fmt == NULL) {
        buf[0] = '\0';
    } else if (vsnprintf(buf, sizeof(buf), fmt, ap) < 0) {
        snprintf(buf, sizeof(buf), "%s", weft_strerror(status));
    }
    memcpy(last_error, buf, sizeof(buf));
    return status;
}

weft_status_t weft__set_error(weft_status_t status, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    weft__set_error_v(status, fmt, ap);
    va_end(ap);
    return status;
}

void weft__clear_error(void)
{
    last_error[0] = '\0';
}
