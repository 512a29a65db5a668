/* The frame reader of a Stream message (rpc/wire.c: weft__reader_*, weft__frame_check),
 * docs/protocol.md sections 5 and 6: the bytes of one gRPC message, cut into up to three slices
 * (gRPC hands a message over in slices of any size), read frame by frame as stream.c reads them.
 * Pure decoder: no agent.
 *
 * Input: u8 limit (0: none, else the receiver's max_message_bytes = 64 x it) | u8 cut 1 | u8 cut 2
 * | the message. Bodies of accepted frames are read into values (odd limit byte) or skipped. */
#include <stdlib.h>

#include "../../rpc/internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "fuzz_frames: %s does not hold (%s:%d): %s\n", #cond, __FILE__,        \
                    __LINE__, weft_last_error());                                                  \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 3) {
        return 0;
    }
    uint64_t limit = (uint64_t)data[0] * 64;
    bool read_bodies = (data[0] & 1) != 0;
    const uint8_t *msg = data + 3;
    size_t len = size - 3;
    size_t c1 = len == 0 ? 0 : data[1] % (len + 1);
    size_t c2 = len == 0 ? 0 : data[2] % (len + 1);
    if (c1 > c2) {
        size_t t = c1;
        c1 = c2;
        c2 = t;
    }
    grpc_slice sl[3] = {
        grpc_slice_from_copied_buffer((const char *)msg, c1),
        grpc_slice_from_copied_buffer((const char *)msg + c1, c2 - c1),
        grpc_slice_from_copied_buffer((const char *)msg + c2, len - c2),
    };
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(sl, 3);
    for (int i = 0; i < 3; i++) {
        grpc_slice_unref(sl[i]);
    }

    weft__reader_t r;
    CHECK(weft__reader_init(&r, bb) == WEFT_OK);
    while (weft__reader_more(&r)) {
        Weft__V1__Envelope *env = NULL;
        size_t before = r.left;
        weft_status_t st = weft__reader_envelope(&r, limit, &env);
        if (env == NULL) {
            /* The rest cannot be framed: dropped, nothing more is read. */
            CHECK(st != WEFT_OK);
            CHECK(!weft__reader_more(&r));
            break;
        }
        CHECK(r.left < before); /* every frame read moves on */
        if (st == WEFT_OK) {
            uint64_t body = r.body_left;
            CHECK(body <= r.left);
            if (read_bodies) {
                weft_value_t *v = NULL;
                st = weft__reader_body(&r, env, &v);
                CHECK(st == WEFT_OK);
                size_t plen = 0;
                (void)weft_value_payload(v, &plen);
                CHECK(plen == env->payload_bytes);
                CHECK(weft_value_num_tensors(v) == env->n_tensors);
                weft_value_free(v);
            } else {
                weft__reader_skip_body(&r);
            }
            CHECK(r.body_left == 0);
            CHECK(before - r.left >= 4 + body); /* its length, envelope and body */
        } else {
            CHECK(st == WEFT_ERR_PROTOCOL || st == WEFT_ERR_TOO_LARGE);
        }
        weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
    }
    CHECK(r.left == 0);
    weft__reader_destroy(&r);
    grpc_byte_buffer_destroy(bb);
    return 0;
}
