/* A raw peer that speaks (or mis-speaks) weft's wire protocol with plain gRPC and plain TCP,
 * written from docs/protocol.md: conformance checks of the refusal paths. */
#ifndef WEFT_TEST_RAWPEER_H
#define WEFT_TEST_RAWPEER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <weft/weft.h>

#include "wire.pb-c.h"

/* ---- streams, step by step */

typedef struct rawpeer rawpeer_t;
/* An answer (or any frame) the raw peer received. */
typedef struct {
    int kind;
    uint64_t request_id;
    int status; /* RESPONSE / HELLO_ACK status; 1000 + gRPC status if the stream ended instead */
    char why[512];
    uint8_t payload[256];
    size_t payload_len;
} rawpeer_reply_t;

/* Opens a stream to @p address and reads the server's CHALLENGE (10 s at most). NULL when the
 * connection failed; rawpeer_challenge is NULL when no challenge came. */
rawpeer_t *rawpeer_open(const char *address);
const uint8_t *rawpeer_challenge(const rawpeer_t *p);
/* The server's rank, from its challenge (-1 if none came). */
int rawpeer_server_rank(const rawpeer_t *p);
/* Sends a Hello (@p version, @p rank, @p world, @p token) whose proof is signed with the key of
 * agent @p as (which must be of @p rank to be accepted; NULL: a proof of zeros), and reads the
 * HELLO_ACK: its status, or 1000 + the gRPC status if the stream ended without one. */
int rawpeer_say_hello(rawpeer_t *p, uint32_t version, int rank, int world, const char *token,
                      weft_agent_t *as, char *why, size_t why_len);
/* One gRPC message of these bytes, as they are. 0 on success. */
int rawpeer_send_bytes(rawpeer_t *p, const void *bytes, size_t len);
/* Writes one frame (u32 LE envelope length, envelope, @p body) at @p out; returns its length
 * (0 if it does not fit in @p cap). */
size_t rawpeer_frame(uint8_t *out, size_t cap, const Weft__V1__Envelope *env, const void *body,
                     size_t body_len);
/* Receives one gRPC message and reads every frame in it into @p replies (at most @p max);
 * returns how many (0: the stream ended or nothing came within @p timeout_ms). */
int rawpeer_recv(rawpeer_t *p, rawpeer_reply_t *replies, int max, int timeout_ms);
/* Receives until the answers to @p n requests (by their ids) are in @p replies[i] for ids[i]; 0
 * when all came within @p timeout_ms. Other frames are ignored. */
int rawpeer_answers(rawpeer_t *p, const uint64_t *ids, size_t n, rawpeer_reply_t *replies,
                    int timeout_ms);
/* Half-closes and waits for the server to end the stream: its gRPC status (details in @p why). */
int rawpeer_close(rawpeer_t *p, char *why, size_t why_len);
/* Waits (@p timeout_ms) for the server to end the stream without half-closing: its gRPC status,
 * or -1 if it did not end in time. */
int rawpeer_wait_end(rawpeer_t *p, int timeout_ms, char *why, size_t why_len);
void rawpeer_free(rawpeer_t *p);

/* ---- streams, in one call */

/* Opens a stream, answers the challenge with a Hello (proof signed by @p as, NULL: none) and
 * returns the HELLO_ACK status (0 = accepted), or 1000 + gRPC status if the stream ended without
 * one; then half-closes. The error text goes to @p why. */
int rawpeer_hello(const char *address, uint32_t version, int rank, int world, const char *token,
                  weft_agent_t *as, char *why, size_t why_len);
/* Sends a Join to the rendezvous master with @p version; returns the WorldMap status (or 1000 +
 * gRPC status). */
int rawpeer_join(const char *address, uint32_t version, int rank, int world, const char *token,
                 char *why, size_t why_len);
/* The same, announcing @p my_address as the joiner's (gRPC) address; waits up to 30 s for the
 * world to form. */
int rawpeer_join_at(const char *address, uint32_t version, int rank, int world, const char *token,
                    const char *my_address, char *why, size_t why_len);

/* A gRPC server on 127.0.0.1 (port 0) that takes every call and never says anything on it: a
 * peer that accepted a stream and then went silent. */
typedef struct rawpeer_silent rawpeer_silent_t;
rawpeer_silent_t *rawpeer_silent_start(void);
const char *rawpeer_silent_address(const rawpeer_silent_t *s);
/* Calls it has taken so far. */
int rawpeer_silent_calls(rawpeer_silent_t *s);
/* Cancels its calls and stops it. */
void rawpeer_silent_stop(rawpeer_silent_t *s);
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
/* Opens a stream with an accepted Hello (as @p rank of @p world, @p token, proven by @p as), sends
 * the @p n frames in order, one gRPC message each (request ids 1..n), waiting for the RESPONSE of
 * each REQUEST (into replies[i]; 10 s at most each), then half-closes and waits for the server to
 * end the stream. Returns the HELLO_ACK status (0 = accepted; then the frames were sent). */
int rawpeer_frames(const char *address, int rank, int world, const char *token, weft_agent_t *as,
                   const rawpeer_frame_t *frames, size_t n, rawpeer_reply_t *replies);

/* ---- plain TCP */

/* Connects with TCP and writes @p n random bytes, then closes. 0 on success. */
int rawpeer_garbage_tcp(const char *address, size_t n);
/* Connects to a direct listener and reads its challenge; the socket, or -1. */
int rawpeer_direct_open(const char *address, uint8_t challenge[32]);
/* Sends a direct connection's Hello (proof signed by @p as for a server of rank @p server_rank;
 * NULL: none) and reads the answer: its status (text in @p why), or 1000 if the connection
 * ended first. */
int rawpeer_direct_hello(int fd, const uint8_t challenge[32], int server_rank, int rank, int world,
                         const char *token, weft_agent_t *as, char *why, size_t why_len);
/* Writes @p len bytes; 0 on success. */
int rawpeer_write(int fd, const void *bytes, size_t len);

/* ---- shared-memory listeners (rpc/shm.c) */

/* Connects to the shared-memory listener named @p name and reads its challenge; the socket, or
 * -1. */
int rawpeer_shm_open(const char *name, uint8_t challenge[32]);
/* What rawpeer_shm_hello hands over with its Hello. */
typedef enum {
    RAWPEER_RING_NONE,     /* no memory */
    RAWPEER_RING_GOOD,     /* a sealed memfd with a new ring's header */
    RAWPEER_RING_UNSEALED, /* a memfd that may shrink */
    RAWPEER_RING_BAD_HEAD, /* sealed, but its header is not a ring's */
} rawpeer_ring_t;
/* Sends a ring's handshake: @p magic and @p version, a Hello claiming @p rank (proof signed by
 * @p as for a listener of rank @p server_rank; NULL: none) and @p ring; reads the answer: its
 * status (text in @p why), or 1000 if the connection ended first. */
int rawpeer_shm_hello(int fd, uint32_t magic, uint32_t version, const uint8_t challenge[32],
                      int server_rank, int rank, int world, const char *token, weft_agent_t *as,
                      rawpeer_ring_t ring, char *why, size_t why_len);
/* A ring a raw writer opened (rawpeer_shm_ring): its memory (64 KiB of bytes after the 4096-byte
 * header) and the socket that keeps it. */
typedef struct {
    uint8_t *mem;
    int fd;
    uint64_t head;
} rawpeer_shm_t;
/* Opens a good ring to the listener @p name as rank @p rank (proof signed by @p as), confirming
 * the answer as a rank does; 0 on success, else the refusal's status (text in @p why). */
int rawpeer_shm_ring(const char *name, int server_rank, int rank, int world, const char *token,
                     weft_agent_t *as, rawpeer_shm_t *r, char *why, size_t why_len);
/* Writes @p n bytes at the ring's head and publishes them (the reader is woken). */
void rawpeer_shm_write(rawpeer_shm_t *r, const void *bytes, size_t n);
/* Publishes @p head as the writer's position, whatever it is. */
void rawpeer_shm_set_head(rawpeer_shm_t *r, uint64_t head);
void rawpeer_shm_close(rawpeer_shm_t *r);
/* Whether the peer closed the connection within @p ms (reads and drops what comes). */
bool rawpeer_closed_within(int fd, int ms);

#endif
