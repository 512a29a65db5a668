/* weft status codes: one X-macro table generates the enum and the strings. */
#ifndef WEFT_STATUS_H
#define WEFT_STATUS_H

#include <weft/api.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * X(name, value, text). Grouped by what is broken:
 *   0        success
 *   -1..-19  argument / state (the caller's input or the object's state)
 *   -20..-39 peer / transport (connections, protocol, rendezvous)
 *   -40..-59 remote handler (the function that ran on another worker)
 *   -60..-69 time (deadlines, cancellation)
 *   -80..-89 CUDA
 */
#define WEFT_STATUS_MAP(X)                                                                         \
    X(OK, 0, "success")                                                                            \
    X(ERR_INVALID_ARG, -1, "invalid argument")                                                     \
    X(ERR_NO_MEMORY, -2, "out of memory")                                                          \
    X(ERR_INVALID_STATE, -3, "invalid state")                                                      \
    X(ERR_SHAPE, -4, "shape mismatch")                                                             \
    X(ERR_DTYPE, -5, "unsupported or mismatched dtype")                                            \
    X(ERR_NOT_FOUND, -6, "not found")                                                              \
    X(ERR_NO_SUCH_FUNCTION, -7, "no such function")                                                \
    X(ERR_ALREADY_EXISTS, -8, "already exists")                                                    \
    X(ERR_UNSUPPORTED, -9, "unsupported")                                                          \
    X(ERR_TOO_LARGE, -10, "message too large")                                                     \
    X(ERR_MISMATCH, -11, "ranks disagree on the operation")                                        \
    X(ERR_PENDING, -12, "not completed yet")                                                       \
    X(ERR_IO, -13, "input/output error")                                                           \
    X(ERR_TRANSPORT, -20, "transport error")                                                       \
    X(ERR_PEER_LOST, -21, "peer lost")                                                             \
    X(ERR_PROTOCOL, -22, "malformed message")                                                      \
    X(ERR_VERSION, -23, "protocol version mismatch")                                               \
    X(ERR_RENDEZVOUS, -24, "rendezvous failed")                                                    \
    X(ERR_SHUTDOWN, -25, "agent is shut down")                                                     \
    X(ERR_AUTH, -26, "authentication failed")                                                      \
    X(ERR_OWNER_LOST, -27, "owner of the remote reference lost")                                   \
    X(ERR_REMOTE, -40, "remote handler failed")                                                    \
    X(ERR_TIMEOUT, -60, "timed out")                                                               \
    X(ERR_CANCELLED, -61, "cancelled")                                                             \
    X(ERR_CUDA, -80, "CUDA error")                                                                 \
    X(ERR_NO_DEVICE, -81, "no CUDA device")

typedef enum {
#define WEFT_STATUS_ENUM_(name, value, text) WEFT_##name = value,
    WEFT_STATUS_MAP(WEFT_STATUS_ENUM_)
#undef WEFT_STATUS_ENUM_
} weft_status_t;

/**
 * Short constant text for a status ("peer lost"); "unknown status" for a value
 * outside the table. Thread-safe.
 */
WEFT_API const char *weft_strerror(weft_status_t status);

/** The name of a status ("WEFT_ERR_PEER_LOST"). Thread-safe. */
WEFT_API const char *weft_status_name(weft_status_t status);

/** True when @p v is a value of the table. */
WEFT_API int weft_status_valid(int v);

/**
 * Detail text of the last error this thread recorded (the function that first
 * decided an error records it). Borrowed; valid until this thread's next weft
 * call that records an error. Never NULL ("" when none).
 */
WEFT_API const char *weft_last_error(void);

#ifdef __cplusplus
}
#endif
#endif
