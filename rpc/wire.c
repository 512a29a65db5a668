/* Wire codec: [u32 LE envelope length][Envelope][payload][tensor buffers...]
 * as one gRPC message whose tensor parts are zero-copy slices. */
#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>

#include <grpc/byte_buffer_reader.h>
#include <grpc/slice.h>

#include "internal.h"

/* Messages whose bytes all fit here are sent as one copied slice: for small
 * messages a copy is cheaper than a slice per tensor. */
#define SMALL_MESSAGE 16384

static void tensor_slice_release(void *user_data)
{
    weft_tensor_release(user_data);
}

typedef struct {
    size_t n;
    size_t cap;
    Weft__V1__TensorMeta *metas;
    Weft__V1__TensorMeta **ptrs;
} metas_t;

static weft_status_t fill_metas(Weft__V1__Envelope *env, const weft_value_t *v, metas_t *m)
{
    size_t n = v == NULL ? 0 : weft_value_num_tensors(v);

    m->n = n;
    m->metas = NULL;
    m->ptrs = NULL;
    if (n == 0) {
        return WEFT_OK;
    }
    m->metas = weft_calloc(n, sizeof(*m->metas));
    m->ptrs = weft_calloc(n, sizeof(*m->ptrs));
    if (m->metas == NULL || m->ptrs == NULL) {
        weft_free(m->metas);
        weft_free(m->ptrs);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "wire: no memory for %zu tensor headers", n);
    }
    for (size_t i = 0; i < n; i++) {
        weft_tensor_t *t = weft_value_tensor(v, i);
        weft_device_t dev = weft_tensor_device(t);
        Weft__V1__TensorMeta *tm = &m->metas[i];

        if (dev.type != WEFT_DEVICE_CPU) {
            weft_free(m->metas);
            weft_free(m->ptrs);
            return weft__set_error(WEFT_ERR_UNSUPPORTED,
                                   "wire: tensor %zu is on a CUDA device; copy it to the CPU first",
                                   i);
        }
        weft__v1__tensor_meta__init(tm);
        tm->dtype = (Weft__V1__DType)weft_tensor_dtype(t);
        tm->n_shape = (size_t)weft_tensor_ndim(t);
        tm->shape = (int64_t *)weft_tensor_shape(t);
        tm->nbytes = weft_tensor_nbytes(t);
        tm->device_type = (int32_t)dev.type;
        tm->device_index = dev.index;
        m->ptrs[i] = tm;
    }
    env->n_tensors = n;
    env->tensors = m->ptrs;
    return WEFT_OK;
}

weft_status_t weft__wire_encode(Weft__V1__Envelope *env, const weft_value_t *v,
                                weft__outmsg_t **msg_p)
{
    weft_status_t status;
    metas_t metas;
    size_t plen = 0;
    const void *payload = v == NULL ? NULL : weft_value_payload(v, &plen);
    size_t tbytes = v == NULL ? 0 : weft__value_tensors_nbytes(v);
    size_t ntensors = v == NULL ? 0 : weft_value_num_tensors(v);
    grpc_slice *slices = NULL;
    size_t nslices = 0;
    weft__outmsg_t *m;

    env->payload_bytes = plen;
    if (ntensors > WEFT__MAX_TENSORS) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "wire: %zu tensors in one message (max %d)",
                               ntensors, WEFT__MAX_TENSORS);
    }
    WEFT_CHECK(fill_metas(env, v, &metas));

    size_t elen = weft__v1__envelope__get_packed_size(env);
    if (elen > WEFT__MAX_ENVELOPE) {
        weft_free(metas.metas);
        weft_free(metas.ptrs);
        env->n_tensors = 0;
        env->tensors = NULL;
        return weft__set_error(WEFT_ERR_TOO_LARGE, "wire: envelope of %zu bytes (max %u)", elen,
                               WEFT__MAX_ENVELOPE);
    }
    size_t head = 4 + elen + plen;
    bool small = head + tbytes <= SMALL_MESSAGE;

    m = weft_calloc(1, sizeof(*m));
    slices = weft_calloc(1 + ntensors, sizeof(*slices));
    if (m == NULL || slices == NULL) {
        status = weft__set_error(WEFT_ERR_NO_MEMORY, "wire: no memory for a message");
        goto err_free;
    }

    grpc_slice hs = grpc_slice_malloc(small ? head + tbytes : head);
    uint8_t *p = GRPC_SLICE_START_PTR(hs);
    p[0] = (uint8_t)(elen & 0xff);
    p[1] = (uint8_t)((elen >> 8) & 0xff);
    p[2] = (uint8_t)((elen >> 16) & 0xff);
    p[3] = (uint8_t)((elen >> 24) & 0xff);
    weft__v1__envelope__pack(env, p + 4);
    if (plen > 0) {
        memcpy(p + 4 + elen, payload, plen);
    }
    /* A small slice may be inlined in the struct itself: store it after the writes. */
    if (small) {
        uint8_t *q = p + head;
        for (size_t i = 0; i < ntensors; i++) {
            weft_tensor_t *t = weft_value_tensor(v, i);
            size_t nb = weft_tensor_nbytes(t);
            if (nb > 0) {
                memcpy(q, weft_tensor_data(t), nb);
                q += nb;
            }
        }
        slices[nslices++] = hs;
    } else {
        slices[nslices++] = hs;
        for (size_t i = 0; i < ntensors; i++) {
            weft_tensor_t *t = weft_value_tensor(v, i);
            size_t nb = weft_tensor_nbytes(t);
            if (nb == 0) {
                continue;
            }
            weft_tensor_retain(t);
            slices[nslices++] =
                grpc_slice_new_with_user_data(weft_tensor_data(t), nb, tensor_slice_release, t);
        }
    }
    m->bb = grpc_raw_byte_buffer_create(slices, nslices);
    for (size_t i = 0; i < nslices; i++) {
        grpc_slice_unref(slices[i]);
    }
    m->nbytes = head + tbytes;
    weft_free(slices);
    weft_free(metas.metas);
    weft_free(metas.ptrs);
    env->n_tensors = 0;
    env->tensors = NULL;
    *msg_p = m;
    return WEFT_OK;

err_free:
    weft_free(slices);
    weft_free(m);
    weft_free(metas.metas);
    weft_free(metas.ptrs);
    env->n_tensors = 0;
    env->tensors = NULL;
    return status;
}

static bool cursor_init(cursor_t *c, grpc_byte_buffer *bb)
{
    c->has = false;
    c->off = 0;
    return grpc_byte_buffer_reader_init(&c->r, bb) != 0;
}

static void cursor_destroy(cursor_t *c)
{
    if (c->has) {
        grpc_slice_unref(c->cur);
    }
    grpc_byte_buffer_reader_destroy(&c->r);
}

/* Copies @p n bytes out (dst may be NULL to skip); false if the buffer ends first. */
static bool cursor_read(cursor_t *c, void *dst, size_t n)
{
    uint8_t *d = dst;

    while (n > 0) {
        if (!c->has || c->off == GRPC_SLICE_LENGTH(c->cur)) {
            if (c->has) {
                grpc_slice_unref(c->cur);
                c->has = false;
            }
            if (grpc_byte_buffer_reader_next(&c->r, &c->cur) == 0) {
                return false;
            }
            c->has = true;
            c->off = 0;
            continue;
        }
        size_t avail = GRPC_SLICE_LENGTH(c->cur) - c->off;
        size_t k = avail < n ? avail : n;
        if (d != NULL) {
            memcpy(d, GRPC_SLICE_START_PTR(c->cur) + c->off, k);
            d += k;
        }
        c->off += k;
        n -= k;
    }
    return true;
}

static weft_status_t check_meta(const Weft__V1__TensorMeta *tm, size_t i, uint64_t *nbytes_p)
{
    if (!weft_dtype_valid((int)tm->dtype)) {
        return weft__set_error(WEFT_ERR_PROTOCOL, "wire: tensor %zu has unknown dtype %d", i,
                               (int)tm->dtype);
    }
    if (tm->n_shape > WEFT_MAX_DIMS) {
        return weft__set_error(WEFT_ERR_PROTOCOL, "wire: tensor %zu has %zu dims (max %d)", i,
                               tm->n_shape, WEFT_MAX_DIMS);
    }
    int64_t numel = weft_shape_numel((int)tm->n_shape, tm->shape);
    if (numel < 0) {
        return weft__set_error(WEFT_ERR_PROTOCOL, "wire: tensor %zu has a bad shape", i);
    }
    uint64_t es = weft_dtype_size((weft_dtype_t)tm->dtype);
    if ((uint64_t)numel > UINT64_MAX / es || (uint64_t)numel * es != tm->nbytes) {
        return weft__set_error(
            WEFT_ERR_PROTOCOL, "wire: tensor %zu says %llu bytes but its shape holds %lld x %llu",
            i, (unsigned long long)tm->nbytes, (long long)numel, (unsigned long long)es);
    }
    *nbytes_p = tm->nbytes;
    return WEFT_OK;
}

weft_status_t weft__frame_check(const Weft__V1__Envelope *env, size_t elen, uint64_t max_bytes,
                                uint64_t *body_p, bool *framed_p)
{
    /* The declared body first, from the raw nbytes fields: it says where the next frame starts
     * even when the headers are refused. */
    uint64_t body = env->payload_bytes;
    bool framed = true;
    for (size_t i = 0; i < env->n_tensors; i++) {
        uint64_t nb = env->tensors[i]->nbytes;
        if (body + nb < body) {
            framed = false;
            break;
        }
        body += nb;
    }
    *framed_p = framed;
    *body_p = framed ? body : 0;
    if (!framed) {
        return weft__set_error(WEFT_ERR_PROTOCOL, "wire: the frame's sizes overflow");
    }
    /* The limit before the headers: a frame over it is not skipped (a reader would swallow
     * whatever follows it as its body), whatever else is wrong with it. */
    if (max_bytes > 0 &&
        (4 + (uint64_t)elen + body < body || 4 + (uint64_t)elen + body > max_bytes)) {
        return weft__set_error(
            WEFT_ERR_TOO_LARGE, "wire: message of %llu bytes exceeds the limit of %llu bytes",
            (unsigned long long)(4 + elen + body), (unsigned long long)max_bytes);
    }
    if (env->n_tensors > WEFT__MAX_TENSORS) {
        return weft__set_error(WEFT_ERR_PROTOCOL, "wire: %zu tensors (max %d)", env->n_tensors,
                               WEFT__MAX_TENSORS);
    }
    for (size_t i = 0; i < env->n_tensors; i++) {
        uint64_t nb = 0;
        WEFT_CHECK(check_meta(env->tensors[i], i, &nb));
    }
    return WEFT_OK;
}

weft_status_t weft__reader_init(weft__reader_t *r, grpc_byte_buffer *bb)
{
    r->total = grpc_byte_buffer_length(bb);
    r->left = r->total;
    if (!cursor_init(&r->c, bb)) {
        return weft__set_error(WEFT_ERR_PROTOCOL, "wire: unreadable message");
    }
    return WEFT_OK;
}

void weft__reader_destroy(weft__reader_t *r)
{
    cursor_destroy(&r->c);
}

bool weft__reader_more(const weft__reader_t *r)
{
    return r->left > 0;
}

static bool reader_read(weft__reader_t *r, void *dst, size_t n)
{
    if (n > r->left || !cursor_read(&r->c, dst, n)) {
        return false;
    }
    r->left -= n;
    return true;
}

/* Drops what is left of the message: it cannot be framed. */
static void reader_drop_rest(weft__reader_t *r)
{
    (void)cursor_read(&r->c, NULL, r->left);
    r->left = 0;
    r->body_left = 0;
}

weft_status_t weft__reader_envelope(weft__reader_t *r, uint64_t max_bytes,
                                    Weft__V1__Envelope **env_p)
{
    weft_status_t status;
    uint8_t lenb[4];
    uint8_t stackbuf[512];
    uint8_t *ebuf = stackbuf;
    Weft__V1__Envelope *env;

    *env_p = NULL;
    r->body_left = 0;
    if (!reader_read(r, lenb, 4)) {
        status = weft__set_error(WEFT_ERR_PROTOCOL, "wire: frame header cut short (%zu bytes left)",
                                 r->left);
        reader_drop_rest(r);
        return status;
    }
    size_t elen = (size_t)lenb[0] | ((size_t)lenb[1] << 8) | ((size_t)lenb[2] << 16) |
                  ((size_t)lenb[3] << 24);
    if (elen > WEFT__MAX_ENVELOPE || elen > r->left) {
        status = weft__set_error(WEFT_ERR_PROTOCOL,
                                 "wire: envelope length %zu does not fit the %zu bytes left", elen,
                                 r->left);
        reader_drop_rest(r);
        return status;
    }
    if (elen > sizeof(stackbuf)) {
        ebuf = weft_alloc(elen);
        if (ebuf == NULL) {
            status = weft__set_error(WEFT_ERR_NO_MEMORY, "wire: no memory for an envelope");
            reader_drop_rest(r);
            return status;
        }
    }
    if (!reader_read(r, ebuf, elen)) {
        status = weft__set_error(WEFT_ERR_PROTOCOL, "wire: truncated envelope");
        reader_drop_rest(r);
        goto out_free_buf;
    }
    env = weft__v1__envelope__unpack(&weft__pb_allocator, elen, ebuf);
    if (env == NULL) {
        status = weft__set_error(WEFT_ERR_PROTOCOL, "wire: envelope does not decode");
        reader_drop_rest(r);
        goto out_free_buf;
    }
    uint64_t body = 0;
    bool framed = true;
    status = weft__frame_check(env, elen, max_bytes, &body, &framed);
    if (framed && body > r->left) {
        if (status == WEFT_OK) {
            status = weft__set_error(WEFT_ERR_PROTOCOL,
                                     "wire: envelope announces %llu body bytes, %zu are left",
                                     (unsigned long long)body, r->left);
        }
        framed = false;
    }
    if (!framed) {
        /* Where the next frame starts is unknown: nothing more of this message is read (its
         * payload or tensor bytes are never taken for frames). */
        weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
        reader_drop_rest(r);
        goto out_free_buf;
    }
    *env_p = env;
    if (status != WEFT_OK) {
        /* Refused: skip exactly its declared body; the next frame starts after it. */
        bool ok = reader_read(r, NULL, (size_t)body);
        (void)ok; /* it fits: checked above */
        goto out_free_buf;
    }
    r->body_left = body;
out_free_buf:
    if (ebuf != stackbuf) {
        weft_free(ebuf);
    }
    return status;
}

void weft__reader_skip_body(weft__reader_t *r)
{
    uint64_t n = r->body_left;

    r->body_left = 0;
    if (!reader_read(r, NULL, (size_t)n)) {
        reader_drop_rest(r); /* cannot happen: the body was checked to fit */
    }
}

weft_status_t weft__reader_body(weft__reader_t *r, const Weft__V1__Envelope *env,
                                weft_value_t **v_p)
{
    weft_status_t status;
    weft_value_t *v;

    WEFT_CHECK(weft_value_create(&v));
    if (env->payload_bytes > 0) {
        void *pl = weft_alloc(env->payload_bytes);
        if (pl == NULL) {
            status = weft__set_error(WEFT_ERR_NO_MEMORY, "wire: no memory for a %llu-byte payload",
                                     (unsigned long long)env->payload_bytes);
            goto err_free_value;
        }
        if (!reader_read(r, pl, env->payload_bytes)) {
            weft_free(pl);
            status = weft__set_error(WEFT_ERR_PROTOCOL, "wire: truncated payload");
            goto err_free_value;
        }
        r->body_left -= env->payload_bytes;
        status = weft_value_take_payload(v, pl, env->payload_bytes);
        if (status != WEFT_OK) {
            weft_free(pl);
            goto err_free_value;
        }
    }
    for (size_t i = 0; i < env->n_tensors; i++) {
        const Weft__V1__TensorMeta *tm = env->tensors[i];
        weft_tensor_t *t;
        WEFT_CHECK_GOTO(weft_tensor_empty((weft_dtype_t)tm->dtype, (int)tm->n_shape, tm->shape, &t),
                        status, err_free_value);
        if (!reader_read(r, weft_tensor_data(t), tm->nbytes)) {
            weft_tensor_release(t);
            status = weft__set_error(WEFT_ERR_PROTOCOL, "wire: truncated tensor %zu", i);
            goto err_free_value;
        }
        r->body_left -= tm->nbytes;
        status = weft_value_push_tensor(v, t);
        if (status != WEFT_OK) {
            weft_tensor_release(t);
            goto err_free_value;
        }
    }
    if (env->kind == WEFT__V1__KIND__KIND_ONEWAY && env->n_refs > 0) {
        /* Decoded at delivery (weft__channel_deliver), where the agent and sender are known;
         * a REQUEST's or RESPONSE's are decoded from the envelope in call.c. */
        WEFT_CHECK_GOTO(weft__refs_keep_raw(env, v), status, err_free_value);
    }
    *v_p = v;
    return WEFT_OK;

err_free_value:
    weft_value_free(v);
    weft__reader_skip_body(r);
    return status;
}

grpc_byte_buffer *weft__wire_pack(const ProtobufCMessage *m)
{
    size_t n = protobuf_c_message_get_packed_size(m);
    grpc_slice s = grpc_slice_malloc(n);
    protobuf_c_message_pack(m, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

weft_status_t weft__wire_flatten(grpc_byte_buffer *bb, size_t max, uint8_t **buf_p, size_t *len_p)
{
    cursor_t c;
    size_t n = grpc_byte_buffer_length(bb);

    if (n > max) {
        return weft__set_error(WEFT_ERR_TOO_LARGE, "wire: control message of %zu bytes (max %zu)",
                               n, max);
    }
    uint8_t *buf = weft_alloc(n == 0 ? 1 : n);
    if (buf == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "wire: no memory");
    }
    if (!cursor_init(&c, bb)) {
        weft_free(buf);
        return weft__set_error(WEFT_ERR_PROTOCOL, "wire: unreadable message");
    }
    bool ok = cursor_read(&c, buf, n);
    cursor_destroy(&c);
    if (!ok) {
        weft_free(buf);
        return weft__set_error(WEFT_ERR_PROTOCOL, "wire: truncated message");
    }
    *buf_p = buf;
    *len_p = n;
    return WEFT_OK;
}

weft_status_t weft__grpc_status(grpc_status_code code)
{
    switch (code) {
    case GRPC_STATUS_OK:
        return WEFT_OK;
    case GRPC_STATUS_DEADLINE_EXCEEDED:
        return WEFT_ERR_TIMEOUT;
    case GRPC_STATUS_CANCELLED:
        return WEFT_ERR_CANCELLED;
    case GRPC_STATUS_UNAVAILABLE:
        return WEFT_ERR_PEER_LOST;
    case GRPC_STATUS_RESOURCE_EXHAUSTED:
        return WEFT_ERR_TOO_LARGE;
    case GRPC_STATUS_UNAUTHENTICATED:
    case GRPC_STATUS_PERMISSION_DENIED:
        return WEFT_ERR_AUTH;
    case GRPC_STATUS_INVALID_ARGUMENT:
    case GRPC_STATUS_FAILED_PRECONDITION:
        return WEFT_ERR_PROTOCOL;
    case GRPC_STATUS_UNIMPLEMENTED:
        return WEFT_ERR_UNSUPPORTED;
    default:
        return WEFT_ERR_TRANSPORT;
    }
}

/* ------------------------------------------------------------------ sockets */

bool weft__send_all(int fd, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    while (n > 0) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
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

void weft__set_lowat(int fd, int *cache, int v)
{
    if (*cache != v && setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof(v)) == 0) {
        *cache = v;
    }
}

bool weft__recv_exact(int fd, void *buf, size_t n, int *lowat)
{
    uint8_t *p = buf;
    while (n > 0) {
        ssize_t k;
        if (n < WEFT__LOWAT_MIN) {
            weft__set_lowat(fd, lowat, 1);
            k = recv(fd, p, n, MSG_WAITALL);
            if (k < 0 && errno == EINTR) {
                continue;
            }
        } else {
            weft__set_lowat(fd, lowat, (int)(n < WEFT__LOWAT_MAX ? n : WEFT__LOWAT_MAX));
            k = recv(fd, p, n, MSG_DONTWAIT);
            if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
                struct pollfd pfd = {fd, POLLIN, 0};
                if (poll(&pfd, 1, -1) < 0 && errno != EINTR) {
                    return false;
                }
                continue;
            }
        }
        if (k <= 0) {
            return false;
        }
        p += k;
        n -= (size_t)k;
    }
    return true;
}
