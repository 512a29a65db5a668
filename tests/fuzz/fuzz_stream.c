/* A Stream's frames as the target receives them (rpc/stream.c reading, rpc/route.c delivering,
 * rpc/call.c serving, rpc/refs.c decoding references, and whatever a frame reaches: functions,
 * channels, the modules' reference codecs), docs/protocol.md sections 5 to 7: a raw peer opens a
 * stream to rank 0, proves rank 2 (signed with that agent's key), sends the input as one
 * gRPC message, then a REQUEST for "fuzz.flush" in a message of its own, and waits for its answer:
 * the stream must still serve whatever came before. Live: the world of fuzz.h.
 *
 * Input: the bytes of one gRPC message (frames). */
#include <stdio.h>
#include <stdlib.h>

#include "../common/rawpeer.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FLUSH_ID 0x7fffffffffff0001ull

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const fuzz_world_t *w = fuzz_world();
    const char *addr = weft_agent_worker_address(w->target, 0);
    char why[512];
    uint8_t flush[128];

    rawpeer_t *p = rawpeer_open(addr);
    if (rawpeer_challenge(p) == NULL) {
        fprintf(stderr, "fuzz_stream: no challenge from %s\n", addr);
        abort();
    }
    int st = rawpeer_say_hello(p, WEFT_PROTOCOL_VERSION, 2, 3, "", w->raw, why, sizeof(why));
    if (st != 0) {
        fprintf(stderr, "fuzz_stream: the target refused the Hello: %d %s\n", st, why);
        abort();
    }
    if (rawpeer_send_bytes(p, data, size) != 0) {
        fprintf(stderr, "fuzz_stream: the fuzzed message could not be sent\n");
        abort();
    }
    Weft__V1__Envelope e = WEFT__V1__ENVELOPE__INIT;
    e.kind = WEFT__V1__KIND__KIND_REQUEST;
    e.request_id = FLUSH_ID;
    e.function = "fuzz.flush";
    e.timeout_ms = FUZZ_WAIT_MS;
    e.src_rank = 2;
    size_t n = rawpeer_frame(flush, sizeof(flush), &e, NULL, 0);
    uint64_t id = FLUSH_ID;
    rawpeer_reply_t r;
    if (rawpeer_send_bytes(p, flush, n) != 0 || rawpeer_answers(p, &id, 1, &r, FUZZ_WAIT_MS) != 0) {
        fprintf(stderr, "fuzz_stream: the stream stopped serving after the fuzzed message\n");
        abort();
    }
    (void)rawpeer_close(p, why, sizeof(why));
    rawpeer_free(p);
    return 0;
}
