#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "rawpeer.h"
#include "wire.pb-c.h"

static grpc_byte_buffer *frame(const Weft__V1__Envelope *env)
{
    size_t n = weft__v1__envelope__get_packed_size(env);
    grpc_slice s = grpc_slice_malloc(4 + n);
    uint8_t *p = GRPC_SLICE_START_PTR(s);
    p[0] = (uint8_t)n;
    p[1] = (uint8_t)(n >> 8);
    p[2] = (uint8_t)(n >> 16);
    p[3] = (uint8_t)(n >> 24);
    weft__v1__envelope__pack(env, p + 4);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

static size_t flatten(grpc_byte_buffer *bb, uint8_t *out, size_t cap)
{
    grpc_byte_buffer_reader r;
    grpc_slice s;
    size_t n = 0;
    grpc_byte_buffer_reader_init(&r, bb);
    while (grpc_byte_buffer_reader_next(&r, &s)) {
        size_t k = GRPC_SLICE_LENGTH(s);
        if (n + k <= cap) {
            memcpy(out + n, GRPC_SLICE_START_PTR(s), k);
        }
        n += k;
        grpc_slice_unref(s);
    }
    grpc_byte_buffer_reader_destroy(&r);
    return n;
}

static void run_batch(grpc_call *call, grpc_completion_queue *cq, grpc_op *ops, size_t n)
{
    int tag;
    if (grpc_call_start_batch(call, ops, n, &tag, NULL) == GRPC_CALL_OK) {
        grpc_completion_queue_pluck(
            cq, &tag,
            gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_seconds(10, GPR_TIMESPAN)),
            NULL);
    }
}

/* Drains and destroys @p cq, then the channel, and drops this call's grpc_init. */
static void teardown(grpc_completion_queue *cq, grpc_channel *ch)
{
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
    grpc_channel_destroy(ch);
    grpc_shutdown();
}

int rawpeer_hello(const char *address, uint32_t version, int rank, int world, const char *token,
                  int garbage, char *why, size_t why_len)
{
    int result = -1;
    grpc_init();
    grpc_channel_credentials *creds = grpc_insecure_credentials_create();
    grpc_channel *ch = grpc_channel_create(address, creds, NULL);
    grpc_channel_credentials_release(creds);
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    grpc_call *call = grpc_channel_create_call(
        ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
        grpc_slice_from_static_string("/weft.v1.Agent/Stream"), NULL,
        gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_seconds(15, GPR_TIMESPAN)), NULL);
    Weft__V1__Hello h = WEFT__V1__HELLO__INIT;
    Weft__V1__Envelope env = WEFT__V1__ENVELOPE__INIT;
    h.protocol_version = version;
    h.name = "rawpeer";
    h.rank = rank;
    h.world_size = world;
    h.address = "127.0.0.1:1";
    h.auth_token.data = (uint8_t *)token;
    h.auth_token.len = strlen(token);
    env.kind = WEFT__V1__KIND__KIND_HELLO;
    env.hello = &h;
    env.src_rank = rank;
    grpc_byte_buffer *bb = frame(&env);
    grpc_byte_buffer *reply = NULL;
    grpc_metadata_array md, trailing;
    grpc_metadata_array_init(&md);
    grpc_metadata_array_init(&trailing);
    grpc_status_code code = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    grpc_op ops[4];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = bb;
    ops[2].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[2].data.recv_initial_metadata.recv_initial_metadata = &md;
    ops[3].op = GRPC_OP_RECV_MESSAGE;
    ops[3].data.recv_message.recv_message = &reply;
    run_batch(call, cq, ops, 4);
    int got_ack = 0;
    if (reply != NULL) {
        uint8_t buf[4096];
        size_t n = flatten(reply, buf, sizeof(buf));
        grpc_byte_buffer_destroy(reply);
        reply = NULL;
        size_t elen = (size_t)buf[0] | ((size_t)buf[1] << 8) | ((size_t)buf[2] << 16);
        Weft__V1__Envelope *ack =
            n >= 4 + elen ? weft__v1__envelope__unpack(NULL, elen, buf + 4) : NULL;
        if (ack != NULL) {
            got_ack = 1;
            result = ack->status;
            snprintf(why, why_len, "%s", ack->error != NULL ? ack->error : "");
            weft__v1__envelope__free_unpacked(ack, NULL);
        }
    }
    if (garbage && result == 0) {
        /* A well-framed gRPC message that is not a weft message. */
        grpc_slice junk = grpc_slice_from_static_string("\xff\xff\xff\x7fthis is not weft");
        grpc_byte_buffer *jb = grpc_raw_byte_buffer_create(&junk, 1);
        memset(ops, 0, sizeof(ops));
        ops[0].op = GRPC_OP_SEND_MESSAGE;
        ops[0].data.send_message.send_message = jb;
        run_batch(call, cq, ops, 1);
        grpc_byte_buffer_destroy(jb);
    }
    memset(ops, 0, sizeof(ops));
    if (garbage || result != 0) {
        ops[0].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
        ops[0].data.recv_status_on_client.trailing_metadata = &trailing;
        ops[0].data.recv_status_on_client.status = &code;
        ops[0].data.recv_status_on_client.status_details = &details;
        run_batch(call, cq, ops, 1);
        if (garbage || !got_ack) {
            char *d = grpc_slice_to_c_string(details);
            snprintf(why, why_len, "%s", d);
            gpr_free(d);
            result = 1000 + (int)code;
        }
    }
    grpc_call_cancel(call, NULL);
    grpc_call_unref(call);
    grpc_byte_buffer_destroy(bb);
    grpc_metadata_array_destroy(&md);
    grpc_metadata_array_destroy(&trailing);
    grpc_slice_unref(details);
    teardown(cq, ch);
    return result;
}

int rawpeer_join(const char *address, uint32_t version, int rank, int world, const char *token,
                 char *why, size_t why_len)
{
    int result = -1;
    grpc_init();
    grpc_channel_credentials *creds = grpc_insecure_credentials_create();
    grpc_channel *ch = grpc_channel_create(address, creds, NULL);
    grpc_channel_credentials_release(creds);
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    grpc_call *call = grpc_channel_create_call(
        ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq, grpc_slice_from_static_string("/weft.v1.Agent/Join"),
        NULL, gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_seconds(15, GPR_TIMESPAN)),
        NULL);
    Weft__V1__Hello h = WEFT__V1__HELLO__INIT;
    h.protocol_version = version;
    h.name = "rawjoiner";
    h.rank = rank;
    h.world_size = world;
    h.address = "127.0.0.1:1";
    h.auth_token.data = (uint8_t *)token;
    h.auth_token.len = strlen(token);
    size_t n = weft__v1__hello__get_packed_size(&h);
    grpc_slice s = grpc_slice_malloc(n);
    weft__v1__hello__pack(&h, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    grpc_byte_buffer *reply = NULL;
    grpc_metadata_array md, trailing;
    grpc_metadata_array_init(&md);
    grpc_metadata_array_init(&trailing);
    grpc_status_code code = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    grpc_op ops[6];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &reply;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trailing;
    ops[5].data.recv_status_on_client.status = &code;
    ops[5].data.recv_status_on_client.status_details = &details;
    run_batch(call, cq, ops, 6);
    if (reply != NULL) {
        uint8_t buf[8192];
        size_t len = flatten(reply, buf, sizeof(buf));
        Weft__V1__WorldMap *map = weft__v1__world_map__unpack(NULL, len, buf);
        if (map != NULL) {
            result = map->status;
            snprintf(why, why_len, "%s", map->error != NULL ? map->error : "");
            weft__v1__world_map__free_unpacked(map, NULL);
        }
        grpc_byte_buffer_destroy(reply);
    } else {
        result = 1000 + (int)code;
    }
    grpc_call_unref(call);
    grpc_byte_buffer_destroy(bb);
    grpc_metadata_array_destroy(&md);
    grpc_metadata_array_destroy(&trailing);
    grpc_slice_unref(details);
    teardown(cq, ch);
    return result;
}

int rawpeer_garbage_tcp(const char *address, size_t n)
{
    char host[256];
    snprintf(host, sizeof(host), "%s", address);
    char *colon = strrchr(host, ':');
    if (colon == NULL) {
        return -1;
    }
    *colon = '\0';
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof(sa));
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)atoi(colon + 1));
    inet_pton(AF_INET, host, &sa.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        if (fd >= 0) {
            close(fd);
        }
        return -1;
    }
    uint8_t buf[1024];
    unsigned x = 12345;
    size_t sent = 0;
    while (sent < n) {
        for (size_t i = 0; i < sizeof(buf); i++) {
            x = x * 1103515245u + 12345u;
            buf[i] = (uint8_t)(x >> 16);
        }
        ssize_t k = send(fd, buf, sizeof(buf) < n - sent ? sizeof(buf) : n - sent, MSG_NOSIGNAL);
        if (k <= 0) {
            break;
        }
        sent += (size_t)k;
    }
    close(fd);
    return 0;
}

/* A frame: the envelope, then the payload (no tensors). */
static grpc_byte_buffer *frame_body(const Weft__V1__Envelope *env, const void *payload, size_t plen)
{
    size_t n = weft__v1__envelope__get_packed_size(env);
    grpc_slice s = grpc_slice_malloc(4 + n + plen);
    uint8_t *p = GRPC_SLICE_START_PTR(s);
    p[0] = (uint8_t)n;
    p[1] = (uint8_t)(n >> 8);
    p[2] = (uint8_t)(n >> 16);
    p[3] = (uint8_t)(n >> 24);
    weft__v1__envelope__pack(env, p + 4);
    if (plen > 0) {
        memcpy(p + 4 + n, payload, plen);
    }
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

/* Receives one message and decodes its envelope (and payload, into @p reply if not NULL). */
static Weft__V1__Envelope *recv_envelope(grpc_call *call, grpc_completion_queue *cq,
                                         rawpeer_reply_t *reply)
{
    static uint8_t buf[1 << 16];
    grpc_byte_buffer *bb = NULL;
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &bb;
    run_batch(call, cq, &op, 1);
    if (bb == NULL) {
        return NULL;
    }
    size_t n = flatten(bb, buf, sizeof(buf));
    grpc_byte_buffer_destroy(bb);
    if (n < 4 || n > sizeof(buf)) {
        return NULL;
    }
    size_t elen = (size_t)buf[0] | ((size_t)buf[1] << 8) | ((size_t)buf[2] << 16);
    if (4 + elen > n) {
        return NULL;
    }
    Weft__V1__Envelope *env = weft__v1__envelope__unpack(NULL, elen, buf + 4);
    if (env != NULL && reply != NULL) {
        size_t plen = n - 4 - elen;
        reply->payload_len = plen < sizeof(reply->payload) ? plen : sizeof(reply->payload);
        memcpy(reply->payload, buf + 4 + elen, reply->payload_len);
    }
    return env;
}

int rawpeer_frames(const char *address, int rank, int world, const char *token,
                   const rawpeer_frame_t *frames, size_t n, rawpeer_reply_t *replies)
{
    int result = -1;
    grpc_init();
    grpc_channel_credentials *creds = grpc_insecure_credentials_create();
    grpc_channel *ch = grpc_channel_create(address, creds, NULL);
    grpc_channel_credentials_release(creds);
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    grpc_call *call = grpc_channel_create_call(
        ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
        grpc_slice_from_static_string("/weft.v1.Agent/Stream"), NULL,
        gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_seconds(60, GPR_TIMESPAN)), NULL);
    Weft__V1__Hello h = WEFT__V1__HELLO__INIT;
    Weft__V1__Envelope env = WEFT__V1__ENVELOPE__INIT;
    h.protocol_version = 1;
    h.name = "rawpeer";
    h.rank = rank;
    h.world_size = world;
    h.address = "127.0.0.1:1";
    h.auth_token.data = (uint8_t *)token;
    h.auth_token.len = strlen(token);
    env.kind = WEFT__V1__KIND__KIND_HELLO;
    env.hello = &h;
    env.src_rank = rank;
    grpc_byte_buffer *bb = frame(&env);
    grpc_metadata_array md, trailing;
    grpc_metadata_array_init(&md);
    grpc_metadata_array_init(&trailing);
    grpc_status_code code = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    grpc_op ops[3];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = bb;
    ops[2].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[2].data.recv_initial_metadata.recv_initial_metadata = &md;
    run_batch(call, cq, ops, 3);
    grpc_byte_buffer_destroy(bb);
    Weft__V1__Envelope *ack = recv_envelope(call, cq, NULL);
    if (ack != NULL) {
        result = ack->status;
        weft__v1__envelope__free_unpacked(ack, NULL);
    }
    for (size_t i = 0; result == 0 && i < n; i++) {
        const rawpeer_frame_t *f = &frames[i];
        Weft__V1__Envelope e = WEFT__V1__ENVELOPE__INIT;
        Weft__V1__Ref refs[16];
        Weft__V1__Ref *refp[16];
        size_t nr = f->nrefs < 16 ? f->nrefs : 16;
        for (size_t k = 0; k < nr; k++) {
            weft__v1__ref__init(&refs[k]);
            refs[k].kind = f->refs[k].kind;
            refs[k].data.data = (uint8_t *)f->refs[k].data;
            refs[k].data.len = f->refs[k].len;
            refp[k] = &refs[k];
        }
        e.kind = f->fn != NULL ? WEFT__V1__KIND__KIND_REQUEST : WEFT__V1__KIND__KIND_ONEWAY;
        e.request_id = i + 1;
        e.function = (char *)(f->fn != NULL ? f->fn : "");
        e.channel = f->channel;
        e.timeout_ms = 10000;
        e.src_rank = rank;
        e.payload_bytes = f->payload_len;
        e.n_refs = nr;
        e.refs = refp;
        grpc_byte_buffer *fb = frame_body(&e, f->payload, f->payload_len);
        memset(ops, 0, sizeof(ops));
        ops[0].op = GRPC_OP_SEND_MESSAGE;
        ops[0].data.send_message.send_message = fb;
        run_batch(call, cq, ops, 1);
        grpc_byte_buffer_destroy(fb);
        if (f->fn == NULL) {
            continue;
        }
        rawpeer_reply_t *r = &replies[i];
        memset(r, 0, sizeof(*r));
        r->status = 1000 + GRPC_STATUS_UNKNOWN;
        Weft__V1__Envelope *resp = recv_envelope(call, cq, r);
        if (resp != NULL) {
            r->status = resp->status;
            snprintf(r->why, sizeof(r->why), "%s", resp->error != NULL ? resp->error : "");
            weft__v1__envelope__free_unpacked(resp, NULL);
        }
    }
    /* A graceful end (half-close), so that the server does not count this rank lost. */
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[1].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[1].data.recv_status_on_client.trailing_metadata = &trailing;
    ops[1].data.recv_status_on_client.status = &code;
    ops[1].data.recv_status_on_client.status_details = &details;
    run_batch(call, cq, ops, 2);
    grpc_call_unref(call);
    grpc_metadata_array_destroy(&md);
    grpc_metadata_array_destroy(&trailing);
    grpc_slice_unref(details);
    teardown(cq, ch);
    return result;
}
