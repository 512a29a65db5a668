/* A raw peer of weft's wire protocol, written from docs/protocol.md with plain gRPC and TCP. */
#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "rawpeer.h"

/* The agent's own signing (rpc/hello.c; linked from the static library): a raw peer proves a rank
 * only with that rank's key, so only an agent's own process can prove it. */
weft_status_t weft__hello_sign(weft_agent_t *a, char tp, const uint8_t *challenge, int server_rank,
                               uint8_t *sig);

#define DIRECT_MAGIC   0x42544657u
#define DIRECT_VERSION 3u

struct rawpeer {
    grpc_channel *ch;
    grpc_completion_queue *cq;
    grpc_call *call;
    grpc_metadata_array md, trailing;
    grpc_status_code code;
    grpc_slice details;
    bool ended;
    uint8_t challenge[32];
    bool has_challenge;
    int server_rank;
    /* frames received but not yet handed out */
    rawpeer_reply_t queued[64];
    int nqueued;
};

static void put_u32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static uint32_t get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
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

/* Runs a batch and waits for it (@p ms at most); false if it did not complete. */
static bool run_batch_ms(grpc_call *call, grpc_completion_queue *cq, grpc_op *ops, size_t n, int ms)
{
    int tag;
    if (grpc_call_start_batch(call, ops, n, &tag, NULL) != GRPC_CALL_OK) {
        return false;
    }
    grpc_event ev = grpc_completion_queue_pluck(
        cq, &tag,
        gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(ms, GPR_TIMESPAN)), NULL);
    if (ev.type != GRPC_OP_COMPLETE) {
        /* Not done in time: cancel, then wait for the batch to come back (it must, before the
         * buffers it points at go away). */
        grpc_call_cancel(call, NULL);
        grpc_completion_queue_pluck(cq, &tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        return false;
    }
    return true;
}

size_t rawpeer_frame(uint8_t *out, size_t cap, const Weft__V1__Envelope *env, const void *body,
                     size_t body_len)
{
    size_t n = weft__v1__envelope__get_packed_size(env);
    if (4 + n + body_len > cap) {
        return 0;
    }
    put_u32(out, (uint32_t)n);
    weft__v1__envelope__pack(env, out + 4);
    if (body_len > 0) {
        memcpy(out + 4 + n, body, body_len);
    }
    return 4 + n + body_len;
}

int rawpeer_send_bytes(rawpeer_t *p, const void *bytes, size_t len)
{
    grpc_slice s = grpc_slice_from_copied_buffer(bytes, len);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_SEND_MESSAGE;
    op.data.send_message.send_message = bb;
    bool ok = run_batch_ms(p->call, p->cq, &op, 1, 10000);
    grpc_byte_buffer_destroy(bb);
    return ok ? 0 : -1;
}

static int send_env(rawpeer_t *p, const Weft__V1__Envelope *env, const void *body, size_t blen)
{
    size_t cap = weft__v1__envelope__get_packed_size(env) + 4 + blen;
    uint8_t *buf = malloc(cap);
    size_t n = rawpeer_frame(buf, cap, env, body, blen);
    int r = rawpeer_send_bytes(p, buf, n);
    free(buf);
    return r;
}

/* Receives one gRPC message; parses every frame of it into p->queued. False if none came. */
static bool recv_message(rawpeer_t *p, int timeout_ms)
{
    static uint8_t buf[1 << 20];
    grpc_byte_buffer *bb = NULL;
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &bb;
    if (!run_batch_ms(p->call, p->cq, &op, 1, timeout_ms) || bb == NULL) {
        if (bb != NULL) {
            grpc_byte_buffer_destroy(bb);
        }
        return false;
    }
    size_t n = flatten(bb, buf, sizeof(buf));
    grpc_byte_buffer_destroy(bb);
    if (n > sizeof(buf)) {
        return false;
    }
    /* A message carries one or more frames: read them all. */
    size_t off = 0;
    while (off + 4 <= n && p->nqueued < 64) {
        size_t elen = get_u32(buf + off);
        if (off + 4 + elen > n) {
            break;
        }
        Weft__V1__Envelope *env = weft__v1__envelope__unpack(NULL, elen, buf + off + 4);
        if (env == NULL) {
            break;
        }
        size_t body = env->payload_bytes;
        for (size_t i = 0; i < env->n_tensors; i++) {
            body += env->tensors[i]->nbytes;
        }
        rawpeer_reply_t *r = &p->queued[p->nqueued++];
        memset(r, 0, sizeof(*r));
        r->kind = env->kind;
        r->request_id = env->request_id;
        r->status = env->status;
        snprintf(r->why, sizeof(r->why), "%s", env->error != NULL ? env->error : "");
        size_t pl = env->payload_bytes;
        size_t avail = n - off - 4 - elen;
        pl = pl < avail ? pl : avail;
        r->payload_len = pl < sizeof(r->payload) ? pl : sizeof(r->payload);
        memcpy(r->payload, buf + off + 4 + elen, r->payload_len);
        if (env->kind == WEFT__V1__KIND__KIND_CHALLENGE && env->challenge.len == 32) {
            memcpy(p->challenge, env->challenge.data, 32);
            p->has_challenge = true;
            p->server_rank = env->src_rank;
            p->nqueued--; /* not an answer */
        }
        weft__v1__envelope__free_unpacked(env, NULL);
        off += 4 + elen + body;
    }
    return true;
}

rawpeer_t *rawpeer_open(const char *address)
{
    rawpeer_t *p = calloc(1, sizeof(*p));
    grpc_init();
    grpc_channel_credentials *creds = grpc_insecure_credentials_create();
    p->ch = grpc_channel_create(address, creds, NULL);
    grpc_channel_credentials_release(creds);
    p->cq = grpc_completion_queue_create_for_pluck(NULL);
    p->call = grpc_channel_create_call(
        p->ch, NULL, GRPC_PROPAGATE_DEFAULTS, p->cq,
        grpc_slice_from_static_string("/weft.v1.Agent/Stream"), NULL,
        gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_seconds(60, GPR_TIMESPAN)), NULL);
    grpc_metadata_array_init(&p->md);
    grpc_metadata_array_init(&p->trailing);
    p->details = grpc_empty_slice();
    p->server_rank = -1;
    grpc_op ops[2];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[1].data.recv_initial_metadata.recv_initial_metadata = &p->md;
    if (!run_batch_ms(p->call, p->cq, ops, 2, 10000)) {
        return p; /* rawpeer_challenge says none came */
    }
    (void)recv_message(p, 10000); /* the challenge */
    return p;
}

const uint8_t *rawpeer_challenge(const rawpeer_t *p)
{
    return p->has_challenge ? p->challenge : NULL;
}

int rawpeer_server_rank(const rawpeer_t *p)
{
    return p->server_rank;
}

int rawpeer_wait_end(rawpeer_t *p, int timeout_ms, char *why, size_t why_len)
{
    if (!p->ended) {
        grpc_op op;
        memset(&op, 0, sizeof(op));
        op.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
        op.data.recv_status_on_client.trailing_metadata = &p->trailing;
        op.data.recv_status_on_client.status = &p->code;
        op.data.recv_status_on_client.status_details = &p->details;
        /* Messages still in flight are drained first: the status follows them. */
        int64_t end = (int64_t)time(NULL) + timeout_ms / 1000 + 1;
        while (recv_message(p, timeout_ms) && (int64_t)time(NULL) <= end) {
            p->nqueued = 0;
        }
        if (!run_batch_ms(p->call, p->cq, &op, 1, timeout_ms)) {
            return -1;
        }
        p->ended = true;
    }
    if (why != NULL) {
        char *d = grpc_slice_to_c_string(p->details);
        snprintf(why, why_len, "%s", d);
        gpr_free(d);
    }
    return (int)p->code;
}

int rawpeer_say_hello(rawpeer_t *p, uint32_t version, int rank, int world, const char *token,
                      weft_agent_t *as, char *why, size_t why_len)
{
    uint8_t sig[64] = {0};
    uint8_t key[32] = {0};
    Weft__V1__Hello h = WEFT__V1__HELLO__INIT;
    Weft__V1__Envelope env = WEFT__V1__ENVELOPE__INIT;

    if (as != NULL && p->has_challenge) {
        (void)weft__hello_sign(as, 'S', p->challenge, p->server_rank, sig);
    }
    h.protocol_version = version;
    h.name = "rawpeer";
    h.rank = rank;
    h.world_size = world;
    h.address = "127.0.0.1:1";
    h.auth_token.data = (uint8_t *)token;
    h.auth_token.len = strlen(token);
    h.identity_key.data = key;
    h.identity_key.len = sizeof(key);
    h.proof.data = sig;
    h.proof.len = sizeof(sig);
    env.kind = WEFT__V1__KIND__KIND_HELLO;
    env.hello = &h;
    env.src_rank = rank;
    if (send_env(p, &env, NULL, 0) != 0) {
        snprintf(why, why_len, "could not send the Hello");
        return 1000 + GRPC_STATUS_UNAVAILABLE;
    }
    rawpeer_reply_t r;
    for (;;) {
        if (rawpeer_recv(p, &r, 1, 10000) != 1) {
            int code = rawpeer_wait_end(p, 10000, why, why_len);
            return 1000 + (code < 0 ? GRPC_STATUS_DEADLINE_EXCEEDED : code);
        }
        if (r.kind == WEFT__V1__KIND__KIND_HELLO_ACK) {
            snprintf(why, why_len, "%s", r.why);
            return r.status;
        }
    }
}

int rawpeer_recv(rawpeer_t *p, rawpeer_reply_t *replies, int max, int timeout_ms)
{
    if (p->nqueued == 0 && !recv_message(p, timeout_ms)) {
        return 0;
    }
    int k = p->nqueued < max ? p->nqueued : max;
    memcpy(replies, p->queued, (size_t)k * sizeof(*replies));
    memmove(p->queued, p->queued + k, (size_t)(p->nqueued - k) * sizeof(*replies));
    p->nqueued -= k;
    return k;
}

int rawpeer_answers(rawpeer_t *p, const uint64_t *ids, size_t n, rawpeer_reply_t *replies,
                    int timeout_ms)
{
    size_t got = 0;
    bool *have = calloc(n + 1, sizeof(bool));
    while (got < n) {
        rawpeer_reply_t r;
        if (rawpeer_recv(p, &r, 1, timeout_ms) != 1) {
            free(have);
            return -1;
        }
        if (r.kind != WEFT__V1__KIND__KIND_RESPONSE) {
            continue;
        }
        for (size_t i = 0; i < n; i++) {
            if (!have[i] && ids[i] == r.request_id) {
                replies[i] = r;
                have[i] = true;
                got++;
                break;
            }
        }
    }
    free(have);
    return 0;
}

int rawpeer_close(rawpeer_t *p, char *why, size_t why_len)
{
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    (void)run_batch_ms(p->call, p->cq, &op, 1, 10000);
    return rawpeer_wait_end(p, 10000, why, why_len);
}

void rawpeer_free(rawpeer_t *p)
{
    if (p == NULL) {
        return;
    }
    grpc_call_cancel(p->call, NULL);
    if (!p->ended) {
        (void)rawpeer_wait_end(p, 10000, NULL, 0);
    }
    grpc_call_unref(p->call);
    grpc_metadata_array_destroy(&p->md);
    grpc_metadata_array_destroy(&p->trailing);
    grpc_slice_unref(p->details);
    grpc_completion_queue_shutdown(p->cq);
    while (
        grpc_completion_queue_pluck(p->cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
        GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(p->cq);
    grpc_channel_destroy(p->ch);
    grpc_shutdown();
    free(p);
}

int rawpeer_hello(const char *address, uint32_t version, int rank, int world, const char *token,
                  weft_agent_t *as, char *why, size_t why_len)
{
    rawpeer_t *p = rawpeer_open(address);
    int result;
    if (rawpeer_challenge(p) == NULL) {
        snprintf(why, why_len, "no challenge came");
        result = 1000 + GRPC_STATUS_UNAVAILABLE;
    } else {
        result = rawpeer_say_hello(p, version, rank, world, token, as, why, why_len);
    }
    if (result == 0) {
        (void)rawpeer_close(p, NULL, 0);
    }
    rawpeer_free(p);
    return result;
}

int rawpeer_join(const char *address, uint32_t version, int rank, int world, const char *token,
                 char *why, size_t why_len)
{
    return rawpeer_join_at(address, version, rank, world, token, "127.0.0.1:1", why, why_len);
}

int rawpeer_join_at(const char *address, uint32_t version, int rank, int world, const char *token,
                    const char *my_address, char *why, size_t why_len)
{
    int result = -1;
    uint8_t key[32] = {0};
    grpc_init();
    grpc_channel_credentials *creds = grpc_insecure_credentials_create();
    grpc_channel *ch = grpc_channel_create(address, creds, NULL);
    grpc_channel_credentials_release(creds);
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    grpc_call *call = grpc_channel_create_call(
        ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq, grpc_slice_from_static_string("/weft.v1.Agent/Join"),
        NULL, gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_seconds(30, GPR_TIMESPAN)),
        NULL);
    Weft__V1__Hello h = WEFT__V1__HELLO__INIT;
    h.protocol_version = version;
    h.name = "rawjoiner";
    h.rank = rank;
    h.world_size = world;
    h.address = (char *)my_address;
    h.auth_token.data = (uint8_t *)token;
    h.auth_token.len = strlen(token);
    h.identity_key.data = key;
    h.identity_key.len = sizeof(key);
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
    (void)run_batch_ms(call, cq, ops, 6, 30000);
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
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
    grpc_channel_destroy(ch);
    grpc_shutdown();
    return result;
}

int rawpeer_frames(const char *address, int rank, int world, const char *token, weft_agent_t *as,
                   const rawpeer_frame_t *frames, size_t n, rawpeer_reply_t *replies)
{
    char why[512];
    rawpeer_t *p = rawpeer_open(address);
    int result =
        rawpeer_challenge(p) == NULL
            ? 1000 + GRPC_STATUS_UNAVAILABLE
            : rawpeer_say_hello(p, WEFT_PROTOCOL_VERSION, rank, world, token, as, why, sizeof(why));
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
        (void)send_env(p, &e, f->payload, f->payload_len);
        if (f->fn == NULL) {
            continue;
        }
        uint64_t id = i + 1;
        memset(&replies[i], 0, sizeof(replies[i]));
        if (rawpeer_answers(p, &id, 1, &replies[i], 10000) != 0) {
            replies[i].status = 1000 + GRPC_STATUS_DEADLINE_EXCEEDED;
        }
    }
    /* A graceful end (half-close), so that the server does not count this rank lost. */
    if (result == 0) {
        (void)rawpeer_close(p, NULL, 0);
    }
    rawpeer_free(p);
    return result;
}

/* ---------------------------------------------------------------- plain TCP */

static int tcp_connect(const char *address)
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
    return fd;
}

int rawpeer_garbage_tcp(const char *address, size_t n)
{
    int fd = tcp_connect(address);
    if (fd < 0) {
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

/* Milliseconds since @p t0 (CLOCK_MONOTONIC). */
static long ms_since(const struct timespec *t0)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (t.tv_sec - t0->tv_sec) * 1000 + (t.tv_nsec - t0->tv_nsec) / 1000000;
}

/* Reads @p n bytes within @p ms. A signal (libFuzzer's timer, a profiler's) interrupting the
 * wait or the read is not the peer's doing: both go on until the deadline. */
static bool read_ms(int fd, void *buf, size_t n, int ms)
{
    uint8_t *p = buf;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (n > 0) {
        long left = ms - ms_since(&t0);
        if (left <= 0) {
            return false;
        }
        struct pollfd pfd = {fd, POLLIN, 0};
        int r = poll(&pfd, 1, (int)left);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            return false;
        }
        ssize_t k = recv(fd, p, n, 0);
        if (k < 0 && errno == EINTR) {
            continue;
        }
        if (k <= 0) {
            return false;
        }
        p += k;
        n -= (size_t)k;
    }
    return true;
}

int rawpeer_direct_open(const char *address, uint8_t challenge[32])
{
    int fd = tcp_connect(address);
    uint8_t hdr[40];
    if (fd < 0) {
        return -1;
    }
    if (!read_ms(fd, hdr, sizeof(hdr), 10000) || get_u32(hdr) != DIRECT_MAGIC ||
        get_u32(hdr + 4) != DIRECT_VERSION) {
        close(fd);
        return -1;
    }
    memcpy(challenge, hdr + 8, 32);
    return fd;
}

int rawpeer_write(int fd, const void *bytes, size_t len)
{
    const uint8_t *p = bytes;
    while (len > 0) {
        ssize_t k = send(fd, p, len, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) {
            continue; /* a signal, not the peer */
        }
        if (k <= 0) {
            return -1;
        }
        p += k;
        len -= (size_t)k;
    }
    return 0;
}

int rawpeer_direct_hello(int fd, const uint8_t challenge[32], int server_rank, int rank, int world,
                         const char *token, weft_agent_t *as, char *why, size_t why_len)
{
    uint8_t sig[64] = {0};
    uint8_t key[32] = {0};
    if (as != NULL) {
        (void)weft__hello_sign(as, 'D', challenge, server_rank, sig);
    }
    Weft__V1__Hello h = WEFT__V1__HELLO__INIT;
    h.protocol_version = WEFT_PROTOCOL_VERSION;
    h.name = "rawpeer";
    h.rank = rank;
    h.world_size = world;
    h.address = "127.0.0.1:1";
    h.auth_token.data = (uint8_t *)token;
    h.auth_token.len = strlen(token);
    h.identity_key.data = key;
    h.identity_key.len = sizeof(key);
    h.proof.data = sig;
    h.proof.len = sizeof(sig);
    size_t n = weft__v1__hello__get_packed_size(&h);
    uint8_t *buf = malloc(12 + n);
    put_u32(buf, DIRECT_MAGIC);
    put_u32(buf + 4, DIRECT_VERSION);
    put_u32(buf + 8, (uint32_t)n);
    weft__v1__hello__pack(&h, buf + 12);
    int w = rawpeer_write(fd, buf, 12 + n);
    free(buf);
    uint8_t ans[8];
    if (w != 0 || !read_ms(fd, ans, sizeof(ans), 10000)) {
        snprintf(why, why_len, "the connection ended before the answer");
        return 1000;
    }
    uint32_t tlen = get_u32(ans + 4);
    char text[512] = "";
    size_t k = tlen < sizeof(text) - 1 ? tlen : sizeof(text) - 1;
    if (k > 0 && read_ms(fd, text, k, 10000)) {
        text[k] = '\0';
    }
    snprintf(why, why_len, "%s", text);
    return (int)(int32_t)get_u32(ans);
}

bool rawpeer_closed_within(int fd, int ms)
{
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        long el = (t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000;
        if (el >= ms) {
            return false;
        }
        struct pollfd pfd = {fd, POLLIN, 0};
        if (poll(&pfd, 1, (int)(ms - el)) <= 0) {
            continue;
        }
        uint8_t buf[4096];
        ssize_t k = recv(fd, buf, sizeof(buf), 0);
        if (k == 0 || (k < 0 && errno != EINTR && errno != EAGAIN)) {
            return true;
        }
    }
}

/* ---- a silent server */

struct rawpeer_silent {
    grpc_server *server;
    grpc_completion_queue *cq;
    pthread_t thread;
    char address[64];
    grpc_call *pending; /* the call being requested */
    grpc_call_details details;
    grpc_metadata_array md;
    grpc_call *calls[64]; /* taken, never answered */
    _Atomic int ncalls;
    int shutdown_tag;
    bool requested; /* a request for a call is outstanding */
};

static void silent_request(rawpeer_silent_t *s)
{
    grpc_call_details_init(&s->details);
    grpc_metadata_array_init(&s->md);
    s->pending = NULL;
    s->requested = grpc_server_request_call(s->server, &s->pending, &s->details, &s->md, s->cq,
                                            s->cq, s) == GRPC_CALL_OK;
}

static void *silent_main(void *arg)
{
    rawpeer_silent_t *s = arg;
    bool stopping = false;
    /* Until the server has shut down and the last request for a call came back. */
    while (!stopping || s->requested) {
        grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) {
            break;
        }
        if (ev.tag == &s->shutdown_tag) {
            stopping = true;
            continue;
        }
        if (ev.tag != s) {
            continue;
        }
        s->requested = false;
        grpc_call_details_destroy(&s->details);
        grpc_metadata_array_destroy(&s->md);
        if (!ev.success) {
            continue; /* the server is shutting down: no more requests */
        }
        int n = atomic_load(&s->ncalls);
        if (n < 64) {
            s->calls[n] = s->pending;
            atomic_store(&s->ncalls, n + 1);
        } else {
            grpc_call_unref(s->pending);
        }
        silent_request(s);
    }
    return NULL;
}

rawpeer_silent_t *rawpeer_silent_start(void)
{
    rawpeer_silent_t *s = calloc(1, sizeof(*s));
    grpc_init();
    s->cq = grpc_completion_queue_create_for_next(NULL);
    s->server = grpc_server_create(NULL, NULL);
    grpc_server_register_completion_queue(s->server, s->cq, NULL);
    grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
    int port = grpc_server_add_http2_port(s->server, "127.0.0.1:0", creds);
    grpc_server_credentials_release(creds);
    snprintf(s->address, sizeof(s->address), "127.0.0.1:%d", port);
    grpc_server_start(s->server);
    silent_request(s);
    pthread_create(&s->thread, NULL, silent_main, s);
    return s;
}

const char *rawpeer_silent_address(const rawpeer_silent_t *s)
{
    return s->address;
}

int rawpeer_silent_calls(rawpeer_silent_t *s)
{
    return atomic_load(&s->ncalls);
}

void rawpeer_silent_stop(rawpeer_silent_t *s)
{
    grpc_server_shutdown_and_notify(s->server, s->cq, &s->shutdown_tag);
    grpc_server_cancel_all_calls(s->server);
    pthread_join(s->thread, NULL);
    for (int i = 0; i < atomic_load(&s->ncalls); i++) {
        grpc_call_unref(s->calls[i]);
    }
    grpc_server_destroy(s->server);
    grpc_completion_queue_shutdown(s->cq);
    while (grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(s->cq);
    grpc_shutdown();
    free(s);
}

/* ------------------------------------------------------------ shared-memory listeners */

#define SHM_MAGIC 0x4d544657u

int rawpeer_shm_open(const char *name, uint8_t challenge[32])
{
    struct sockaddr_un sa;
    size_t n = strlen(name);
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    if (n > sizeof(sa.sun_path) - 1) {
        return -1;
    }
    memcpy(sa.sun_path + 1, name, n);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa,
                          (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n)) != 0) {
        if (fd >= 0) {
            close(fd);
        }
        return -1;
    }
    uint8_t hdr[8 + 32];
    if (!read_ms(fd, hdr, sizeof(hdr), 10000) || get_u32(hdr) != SHM_MAGIC) {
        close(fd);
        return -1;
    }
    memcpy(challenge, hdr + 8, 32);
    return fd;
}

static uint8_t *last_ring_mem; /* the mapping of the last good ring made (rawpeer_shm_ring) */

/* A ring's memory as rawpeer_shm_hello hands it over; -1 for none. */
static int shm_ring_fd(rawpeer_ring_t ring)
{
    size_t len = 4096 + (64u << 10);
    if (ring == RAWPEER_RING_NONE) {
        return -1;
    }
    int fd = memfd_create("rawpeer-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || ftruncate(fd, (off_t)len) != 0) {
        return fd;
    }
    uint8_t *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p != MAP_FAILED) {
        put_u32(p, ring == RAWPEER_RING_BAD_HEAD ? 0x12345678u : SHM_MAGIC);
        put_u32(p + 4, 1);
        uint64_t cap = 64u << 10;
        memcpy(p + 8, &cap, sizeof(cap));
        if (last_ring_mem != NULL) {
            munmap(last_ring_mem, len);
        }
        last_ring_mem = p; /* kept: rawpeer_shm_ring writes through it */
    }
    if (ring != RAWPEER_RING_UNSEALED) {
        (void)fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
    }
    return fd;
}

int rawpeer_shm_hello(int fd, uint32_t magic, uint32_t version, const uint8_t challenge[32],
                      int server_rank, int rank, int world, const char *token, weft_agent_t *as,
                      rawpeer_ring_t ring, char *why, size_t why_len)
{
    uint8_t sig[64] = {0};
    uint8_t key[32] = {0};
    if (as != NULL) {
        (void)weft__hello_sign(as, 'M', challenge, server_rank, sig);
    }
    Weft__V1__Hello h = WEFT__V1__HELLO__INIT;
    h.protocol_version = WEFT_PROTOCOL_VERSION;
    h.name = "rawpeer";
    h.rank = rank;
    h.world_size = world;
    h.address = "127.0.0.1:1";
    h.auth_token.data = (uint8_t *)token;
    h.auth_token.len = strlen(token);
    h.identity_key.data = key;
    h.identity_key.len = sizeof(key);
    h.proof.data = sig;
    h.proof.len = sizeof(sig);
    size_t n = weft__v1__hello__get_packed_size(&h);
    uint8_t *buf = malloc(12 + n);
    put_u32(buf, magic);
    put_u32(buf + 4, version);
    put_u32(buf + 8, (uint32_t)n);
    weft__v1__hello__pack(&h, buf + 12);
    int memfd = shm_ring_fd(ring);
    struct iovec iov = {buf, 12};
    union {
        struct cmsghdr h;
        char b[CMSG_SPACE(sizeof(int))];
    } ctl;
    memset(&ctl, 0, sizeof(ctl));
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (memfd >= 0) {
        mh.msg_control = ctl.b;
        mh.msg_controllen = sizeof(ctl.b);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &memfd, sizeof(int));
    }
    ssize_t k = sendmsg(fd, &mh, MSG_NOSIGNAL);
    if (k == 12) {
        /* A listener that refuses the header answers before it reads the Hello: the write may
         * fail, the answer is still there to read. */
        (void)rawpeer_write(fd, buf + 12, n);
    }
    free(buf);
    if (memfd >= 0) {
        close(memfd);
    }
    uint8_t ans[8];
    if (k != 12 || !read_ms(fd, ans, sizeof(ans), 10000)) {
        snprintf(why, why_len, "the connection ended before the answer");
        return 1000;
    }
    uint32_t tlen = get_u32(ans + 4);
    char text[512] = "";
    size_t tk = tlen < sizeof(text) - 1 ? tlen : sizeof(text) - 1;
    if (tk > 0 && read_ms(fd, text, tk, 10000)) {
        text[tk] = '\0';
    }
    snprintf(why, why_len, "%s", text);
    return (int)(int32_t)get_u32(ans);
}

int rawpeer_shm_ring(const char *name, int server_rank, int rank, int world, const char *token,
                     weft_agent_t *as, rawpeer_shm_t *r, char *why, size_t why_len)
{
    uint8_t ch[32];
    memset(r, 0, sizeof(*r));
    r->fd = rawpeer_shm_open(name, ch);
    if (r->fd < 0) {
        snprintf(why, why_len, "cannot reach %s", name);
        return 1000;
    }
    last_ring_mem = NULL;
    int st = rawpeer_shm_hello(r->fd, SHM_MAGIC, 1, ch, server_rank, rank, world, token, as,
                               RAWPEER_RING_GOOD, why, why_len);
    r->mem = last_ring_mem;
    last_ring_mem = NULL;
    if (st == 0) {
        uint8_t ack = 1;
        st = rawpeer_write(r->fd, &ack, 1) == 0 ? 0 : 1000;
    }
    return st;
}

void rawpeer_shm_write(rawpeer_shm_t *r, const void *bytes, size_t n)
{
    const uint64_t cap = 64u << 10;
    uint8_t *data = r->mem + 4096;
    for (size_t i = 0; i < n; i++) {
        data[(r->head + i) & (cap - 1)] = ((const uint8_t *)bytes)[i];
    }
    rawpeer_shm_set_head(r, r->head + n);
}

void rawpeer_shm_set_head(rawpeer_shm_t *r, uint64_t head)
{
    r->head = head;
    __atomic_store_n((uint64_t *)(r->mem + 64), head, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint32_t *sleeping = (uint32_t *)(r->mem + 128);
    if (__atomic_load_n(sleeping, __ATOMIC_RELAXED) != 0) {
        __atomic_store_n(sleeping, 0, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, sleeping, FUTEX_WAKE, 1 << 30, NULL, NULL, 0);
    }
}

void rawpeer_shm_close(rawpeer_shm_t *r)
{
    if (r->mem != NULL) {
        munmap(r->mem, 4096 + (64u << 10));
    }
    if (r->fd >= 0) {
        close(r->fd);
    }
    memset(r, 0, sizeof(*r));
    r->fd = -1;
}
