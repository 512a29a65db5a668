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
/* Connects with TCP and writes @p n random bytes, then closes. 0 on success. */
int rawpeer_garbage_tcp(const char *address, size_t n);

#endif
