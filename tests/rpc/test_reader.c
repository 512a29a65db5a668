/* The frame reader (rpc/wire.c), white-box, byte by byte: where the next frame starts after each
 * kind of refusal (docs/protocol.md section 5), the real reason of each refusal, and bytes of a
 * refused frame never taken for frames. Also run under valgrind (tests/rpc/meson.build), which
 * catches reads of uninitialised memory. */
#include <criterion/criterion.h>
#include <string.h>

#include "../../rpc/internal.h"

static uint8_t buf[65536];
static size_t len;

static void put(const Weft__V1__Envelope *env, const void *body, size_t blen)
{
    size_t n = weft__v1__envelope__get_packed_size(env);
    buf[len] = (uint8_t)n;
    buf[len + 1] = (uint8_t)(n >> 8);
    buf[len + 2] = (uint8_t)(n >> 16);
    buf[len + 3] = (uint8_t)(n >> 24);
    weft__v1__envelope__pack(env, buf + len + 4);
    if (blen > 0) {
        memcpy(buf + len + 4 + n, body, blen);
    }
    len += 4 + n + blen;
}

static void put_request(uint64_t id, const char *payload)
{
    Weft__V1__Envelope e = WEFT__V1__ENVELOPE__INIT;
    e.kind = WEFT__V1__KIND__KIND_REQUEST;
    e.request_id = id;
    e.function = "f";
    e.payload_bytes = payload != NULL ? strlen(payload) : 0;
    put(&e, payload, e.payload_bytes);
}

/* A frame with one tensor header: @p dtype, shape [2], @p nbytes declared; its body is @p body
 * (payload) then @p tbytes of tensor. */
static void put_tensor_frame(uint64_t id, int dtype, uint64_t nbytes, const void *body, size_t blen,
                             size_t tbytes)
{
    Weft__V1__Envelope e = WEFT__V1__ENVELOPE__INIT;
    Weft__V1__TensorMeta tm = WEFT__V1__TENSOR_META__INIT;
    Weft__V1__TensorMeta *tmp = &tm;
    int64_t shape[1] = {2};
    uint8_t b[4096] = {0};
    e.kind = WEFT__V1__KIND__KIND_REQUEST;
    e.request_id = id;
    e.function = "f";
    e.payload_bytes = blen;
    tm.dtype = (Weft__V1__DType)dtype;
    tm.n_shape = 1;
    tm.shape = shape;
    tm.nbytes = nbytes;
    e.n_tensors = 1;
    e.tensors = &tmp;
    if (blen > 0) {
        memcpy(b, body, blen);
    }
    put(&e, b, blen + tbytes);
}

/* Reads every frame of buf[0..len): ids of the frames accepted (body read) into @p ok, of those
 * refused into @p bad, and the text of the first refusal. */
typedef struct {
    uint64_t ok[16], bad[16];
    int nok, nbad, nlost;
    weft_status_t first_st;
    char first_why[512];
} seen_t;

static void read_all(uint64_t limit, seen_t *s)
{
    weft__reader_t r;
    grpc_slice sl = grpc_slice_from_copied_buffer((const char *)buf, len);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&sl, 1);
    grpc_slice_unref(sl);
    memset(s, 0, sizeof(*s));
    cr_assert_eq(weft__reader_init(&r, bb), WEFT_OK);
    while (weft__reader_more(&r)) {
        Weft__V1__Envelope *env = NULL;
        weft_status_t st = weft__reader_envelope(&r, limit, &env);
        if (st != WEFT_OK && s->first_st == WEFT_OK) {
            s->first_st = st;
            snprintf(s->first_why, sizeof(s->first_why), "%s", weft_last_error());
        }
        if (env == NULL) {
            s->nlost++;
            cr_assert_not(weft__reader_more(&r), "the rest of the message is dropped");
            break;
        }
        if (st == WEFT_OK) {
            weft_value_t *v = NULL;
            cr_assert_eq(weft__reader_body(&r, env, &v), WEFT_OK, "%s", weft_last_error());
            weft_value_free(v);
            s->ok[s->nok++] = env->request_id;
        } else {
            s->bad[s->nbad++] = env->request_id;
        }
        weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
    }
    weft__reader_destroy(&r);
    grpc_byte_buffer_destroy(bb);
}

Test(reader, a_refused_first_frame_says_why_and_the_next_frame_is_read)
{
    seen_t s;
    len = 0;
    put_tensor_frame(1, 99, 8, "ab", 2, 8); /* unknown dtype */
    put_request(2, "hi");
    read_all(0, &s);
    cr_assert_eq(s.first_st, WEFT_ERR_PROTOCOL);
    cr_assert(strstr(s.first_why, "unknown dtype 99") != NULL, "text: %s", s.first_why);
    cr_assert_eq(s.nbad, 1);
    cr_assert_eq(s.bad[0], 1);
    cr_assert_eq(s.nok, 1);
    cr_assert_eq(s.ok[0], 2);
}

Test(reader, a_frame_hidden_in_a_refused_frames_payload_is_not_read)
{
    seen_t s;
    uint8_t hidden[256];
    /* The hidden request, framed, becomes the payload of a refused frame (nbytes against its
     * shape), whose tensor bytes hold a second hidden one. */
    len = 0;
    put_request(66, "hidden");
    memcpy(hidden, buf, len);
    size_t hn = len;
    len = 0;
    Weft__V1__Envelope e = WEFT__V1__ENVELOPE__INIT;
    Weft__V1__TensorMeta tm = WEFT__V1__TENSOR_META__INIT;
    Weft__V1__TensorMeta *tmp = &tm;
    int64_t shape[1] = {2};
    uint8_t body[1024];
    e.kind = WEFT__V1__KIND__KIND_REQUEST;
    e.request_id = 1;
    e.function = "f";
    e.payload_bytes = hn;
    tm.dtype = WEFT__V1__DTYPE__DTYPE_F32;
    tm.n_shape = 1;
    tm.shape = shape;
    tm.nbytes = hn; /* 2 x f32 is 8: refused */
    e.n_tensors = 1;
    e.tensors = &tmp;
    memcpy(body, hidden, hn);
    memcpy(body + hn, hidden, hn);
    put(&e, body, 2 * hn);
    put_request(3, "after");
    read_all(0, &s);
    cr_assert_eq(s.nbad, 1);
    cr_assert_eq(s.bad[0], 1);
    cr_assert(strstr(s.first_why, "says") != NULL, "text: %s", s.first_why);
    cr_assert_eq(s.nok, 1, "%d frames read (66 is hidden)", s.nok);
    cr_assert_eq(s.ok[0], 3);
}

Test(reader, good_refused_good_in_one_message)
{
    seen_t s;
    len = 0;
    put_request(1, "one");
    put_tensor_frame(2, 0, 12, "xyz", 3, 12); /* f32 [2] is 8 bytes, not 12 */
    put_request(3, "three");
    read_all(0, &s);
    cr_assert_eq(s.nok, 2);
    cr_assert_eq(s.ok[0], 1);
    cr_assert_eq(s.ok[1], 3);
    cr_assert_eq(s.nbad, 1);
    cr_assert_eq(s.nlost, 0);
}

Test(reader, over_the_limit_is_refused_and_skipped)
{
    seen_t s;
    len = 0;
    put_tensor_frame(1, 0, 8, NULL, 0, 8);
    char big[2000];
    memset(big, 'x', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    put_request(2, big);
    put_request(3, "small");
    read_all(1024, &s);
    cr_assert_eq(s.nbad, 1);
    cr_assert_eq(s.bad[0], 2);
    cr_assert_eq(s.first_st, WEFT_ERR_TOO_LARGE);
    cr_assert(strstr(s.first_why, "exceeds the limit of 1024") != NULL, "%s", s.first_why);
    cr_assert_eq(s.nok, 2);
}

Test(reader, a_body_past_the_end_drops_the_rest)
{
    seen_t s;
    len = 0;
    put_request(1, "one");
    Weft__V1__Envelope e = WEFT__V1__ENVELOPE__INIT;
    e.kind = WEFT__V1__KIND__KIND_REQUEST;
    e.request_id = 2;
    e.function = "f";
    e.payload_bytes = 100000; /* far past the end */
    put(&e, "short", 5);
    read_all(0, &s);
    cr_assert_eq(s.nok, 1);
    cr_assert_eq(s.nlost, 1);
    cr_assert(strstr(s.first_why, "100000 body bytes") != NULL, "%s", s.first_why);
}

Test(reader, sizes_that_overflow_drop_the_rest)
{
    seen_t s;
    len = 0;
    Weft__V1__Envelope e = WEFT__V1__ENVELOPE__INIT;
    Weft__V1__TensorMeta tm[2] = {WEFT__V1__TENSOR_META__INIT, WEFT__V1__TENSOR_META__INIT};
    Weft__V1__TensorMeta *tmp[2] = {&tm[0], &tm[1]};
    e.kind = WEFT__V1__KIND__KIND_REQUEST;
    e.request_id = 1;
    e.function = "f";
    tm[0].nbytes = UINT64_MAX - 4;
    tm[1].nbytes = 16;
    e.n_tensors = 2;
    e.tensors = tmp;
    put(&e, NULL, 0);
    put_request(2, "x");
    read_all(0, &s);
    cr_assert_eq(s.nok, 0);
    cr_assert_eq(s.nlost, 1);
    cr_assert(strstr(s.first_why, "overflow") != NULL, "%s", s.first_why);
}

Test(reader, garbage_envelope_lengths)
{
    seen_t s;
    len = 0;
    put_request(1, "one");
    memcpy(buf + len, "\xff\xff\xff\x7fjunk", 8);
    len += 8;
    read_all(0, &s);
    cr_assert_eq(s.nok, 1);
    cr_assert_eq(s.nlost, 1);
    cr_assert(strstr(s.first_why, "does not fit") != NULL, "%s", s.first_why);
    len = 3; /* not even a length */
    read_all(0, &s);
    cr_assert_eq(s.nlost, 1);
    cr_assert(strstr(s.first_why, "cut short") != NULL, "%s", s.first_why);
}
