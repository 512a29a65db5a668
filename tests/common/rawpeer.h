/* A raw peer that speaks (or mis-speaks) weft's wire protocol with plain gRPC:
 * conformance checks of the refusal paths. */
#ifndef WEFT_TEST_RAWPEER_H
#define WEFT_TEST_RAWPEER_H

#include <stdint.h>

/* Opens a stream to @p address, sends a Hello with @p version, @p rank,
 * @p world and @p token, reads the answer. Returns the HELLO_ACK status
 * (0 = accepted), or 1000 + gRPC status if the stream ended without one.
 * The error text goes to @p why. If @p garbage, sends junk after an accepted
 * Hello and returns the gRPC status the server ends the stream with (+1000). */
int rawpeer_hello(const char *address, uint32_t version, int rank, int world, const char *token,
                  int garbage, char *why, size_t why_len);
/* Sends a Join to the rendezvous master with @p version; returns the WorldMap
 * status (or 1000 + gRPC status). */
int rawpeer_join(const char *address, uint32_t version, int rank, int world, const char *token,
                 char *why, size_t why_len);
/* A reference as a raw peer sends it (Envelope.refs). */
typedef struct {
    uint32_t kind;
    const void *data;
    size_t len;
} rawpeer_ref_t;
/* A frame a raw peer sends after its Hello: a REQUEST for @p fn, or a ONEWAY on @p channel
 * when @p fn is NULL; with @p payload and @p refs. */
typedef struct {
    const char *fn;
    uint32_t channel;
    const void *payload;
    size_t payload_len;
    const rawpeer_ref_t *refs;
    size_t nrefs;
} rawpeer_frame_t;
/* The answer to a REQUEST frame. */
typedef struct {
    int status; /* RESPONSE status, or 1000 + gRPC status if none came */
    char why[512];
    uint8_t payload[256];
    size_t payload_len;
} rawpeer_reply_t;
/* Opens a stream to @p address with an accepted Hello (as @p rank of @p world, @p token), sends
 * the @p n frames in order, one gRPC message each, waiting for the RESPONSE of each REQUEST
 * (into replies[i]; 10 s at most each), then half-closes and waits for the server to end the
 * stream. Returns the HELLO_ACK status (0 = accepted; then the frames were sent). */
int rawpeer_frames(const char *address, int rank, int world, const char *token,
                   const rawpeer_frame_t *frames, size_t n, rawpeer_reply_t *replies);
/* Connects with TCP and writes @p n random bytes, then closes. 0 on success. */
int rawpeer_garbage_tcp(const char *address, size_t n);

#endif
