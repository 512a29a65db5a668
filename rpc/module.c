/* The module kit (weft/module.h): modules registered by descriptor, the delivery of one-way
 * messages to them (kept until the module exists), their landing, peer-loss and shutdown hooks,
 * the agent's timer lent to them, and header + body messages. */
#include <string.h>

#include "internal.h"

/* ------------------------------------------------------------------ registry */

weft__module_t *weft__module_at(weft_agent_t *a, uint32_t channel)
{
    if (channel < 1 || channel > WEFT_CHANNEL_MAX) {
        return NULL;
    }
    return atomic_load_explicit(&a->by_channel[channel], memory_order_acquire);
}

static weft_status_t check_desc(const weft_module_desc_t *d)
{
    if (d->create == NULL || d->channel < 1 || d->channel > WEFT_CHANNEL_MAX) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "module %s: a create callback and a channel in 1..%d are needed "
                               "(got %u)",
                               d->name != NULL ? d->name : "?", WEFT_CHANNEL_MAX, d->channel);
    }
    return WEFT_OK;
}

weft_status_t weft_agent_module(weft_agent_t *a, const weft_module_desc_t *desc, void **state_p)
{
    weft_status_t st;

    if (a == NULL || desc == NULL || state_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "agent_module: NULL argument");
    }
    WEFT_CHECK(check_desc(desc));
    weft__module_t *m = weft__module_at(a, desc->channel);
    if (m != NULL && m->orig == desc) {
        *state_p = m->state; /* the usual case: created already, no lock */
        return WEFT_OK;
    }
    pthread_mutex_lock(&a->module_mu);
    m = weft__module_at(a, desc->channel);
    if (m != NULL) {
        bool same = m->orig == desc;
        pthread_mutex_unlock(&a->module_mu);
        if (!same) {
            return weft__set_error(WEFT_ERR_ALREADY_EXISTS,
                                   "agent_module: channel %u belongs to module %s", desc->channel,
                                   m->desc.name != NULL ? m->desc.name : "?");
        }
        *state_p = m->state;
        return WEFT_OK;
    }
    if (atomic_load(&a->state) >= WEFT__AGENT_CLOSING) {
        pthread_mutex_unlock(&a->module_mu);
        return weft__set_error(WEFT_ERR_SHUTDOWN, "agent_module: the agent is closing");
    }
    if (desc->codec != NULL) {
        WEFT_CHECK_GOTO(weft__refs_check_codec(a, desc->codec), st, err_unlock);
    }
    m = weft_calloc(1, sizeof(*m));
    if (m == NULL) {
        st = weft__set_error(WEFT_ERR_NO_MEMORY, "agent_module: no memory");
        goto err_unlock;
    }
    m->desc = *desc;
    m->orig = desc;
    if (desc->codec != NULL) {
        m->codec = *desc->codec;
        m->desc.codec = &m->codec;
    }
    void *state = NULL;
    st = desc->create(a, &state);
    if (st != WEFT_OK) {
        weft_free(m);
        goto err_unlock;
    }
    m->state = state;
    if (desc->codec != NULL) {
        weft__refs_register(a, &m->codec, state);
    }
    /* Creation order: shutdown asks them in it, free destroys in reverse. */
    if (a->modules_tail == NULL) {
        a->modules = m;
    } else {
        atomic_store(&a->modules_tail->next, m);
    }
    a->modules_tail = m;
    /* Messages that came first are delivered now, in the order they came; deliveries racing with
     * this wait on chan_mu, so they come after. */
    pthread_mutex_lock(&a->chan_mu);
    weft__early_t **pp = &a->early_head;
    a->early_tail = NULL;
    while (*pp != NULL) {
        weft__early_t *e = *pp;
        if (e->channel == desc->channel) {
            *pp = e->next;
            a->nearly--;
            if (desc->on_message != NULL) {
                desc->on_message(state, e->src, e->v);
            } else {
                weft_value_free(e->v);
            }
            weft_free(e);
        } else {
            a->early_tail = e;
            pp = &e->next;
        }
    }
    atomic_store_explicit(&a->by_channel[desc->channel], m, memory_order_release);
    pthread_mutex_unlock(&a->chan_mu);
    pthread_mutex_unlock(&a->module_mu);
    *state_p = state;
    return WEFT_OK;

err_unlock:
    pthread_mutex_unlock(&a->module_mu);
    return st;
}

void weft__channel_deliver(weft_agent_t *a, uint32_t channel, int src, weft_value_t *v)
{
    /* References come as the frame carried them: decode them now (a ONEWAY's objects are not
     * awaited, which keeps the channel's order). */
    if (weft_value_num_refs(v) > 0 && weft__refs_decode_raw(a, src, v) != WEFT_OK) {
        WEFT_WARN("dropped a message on channel %u from rank %d: %s", channel, src,
                  weft_last_error());
        weft_value_free(v);
        return;
    }
    weft__module_t *m = weft__module_at(a, channel);
    if (m == NULL) {
        pthread_mutex_lock(&a->chan_mu);
        m = weft__module_at(a, channel);
        if (m == NULL) {
            weft__early_t *e = a->nearly < WEFT__EARLY_MAX ? weft_alloc(sizeof(*e)) : NULL;
            if (e == NULL) {
                pthread_mutex_unlock(&a->chan_mu);
                WEFT_WARN("dropped a message on channel %u from rank %d: no module has it here "
                          "and %d messages wait already",
                          channel, src, WEFT__EARLY_MAX);
                weft_value_free(v);
                return;
            }
            e->next = NULL;
            e->channel = channel;
            e->src = src;
            e->v = v;
            if (a->early_tail == NULL) {
                a->early_head = a->early_tail = e;
            } else {
                a->early_tail->next = e;
                a->early_tail = e;
            }
            a->nearly++;
            pthread_mutex_unlock(&a->chan_mu);
            return;
        }
        pthread_mutex_unlock(&a->chan_mu);
    }
    if (m->desc.on_message == NULL) {
        weft_value_free(v);
        return;
    }
    m->desc.on_message(m->state, src, v);
}

void weft__modules_peer_lost(weft_agent_t *a, int rank, const char *why)
{
    /* The list only grows while the agent lives: walked without the lock (a module created
     * meanwhile may or may not hear of this loss; it sees the rank lost when it sends). */
    for (weft__module_t *m = a->modules; m != NULL; m = atomic_load(&m->next)) {
        if (m->desc.on_peer_lost != NULL) {
            m->desc.on_peer_lost(m->state, rank, why);
        }
    }
}

void weft__modules_shutdown(weft_agent_t *a, int64_t deadline_ms)
{
    for (weft__module_t *m = a->modules; m != NULL; m = atomic_load(&m->next)) {
        if (m->desc.on_shutdown == NULL) {
            continue;
        }
        weft__clear_error();
        weft_status_t st = m->desc.on_shutdown(m->state, deadline_ms);
        if (st != WEFT_OK) {
            WEFT_WARN("shutdown: module %s did not settle (%s): %s; shutting down anyway",
                      m->desc.name != NULL ? m->desc.name : "?", weft_strerror(st),
                      weft_last_error());
        }
    }
}

void weft__modules_free(weft_agent_t *a)
{
    /* In reverse order of creation: a module created later may use an earlier one. */
    size_t n = 0;
    for (weft__module_t *m = a->modules; m != NULL; m = atomic_load(&m->next)) {
        n++;
    }
    while (n > 0) {
        weft__module_t *m = a->modules;
        for (size_t i = 1; i < n; i++) {
            m = atomic_load(&m->next);
        }
        if (a->timer != NULL) {
            weft__timer_cancel_owner(a->timer, m->state);
        }
        if (m->desc.destroy != NULL) {
            m->desc.destroy(m->state);
        }
        atomic_store(&a->by_channel[m->desc.channel], NULL);
        n--;
    }
    while (a->modules != NULL) {
        weft__module_t *m = a->modules;
        a->modules = atomic_load(&m->next);
        weft_free(m);
    }
    a->modules_tail = NULL;
    while (a->early_head != NULL) {
        weft__early_t *e = a->early_head;
        a->early_head = e->next;
        weft_value_free(e->v);
        weft_free(e);
    }
}

/* ------------------------------------------------------------------ the timer */

uint64_t weft_agent_timer_add(weft_agent_t *a, int64_t delay_us, weft_timer_cb_t run,
                              weft_timer_cb_t drop, void *arg, uint64_t data, const void *owner)
{
    if (a == NULL || run == NULL || a->timer == NULL) {
        if (drop != NULL) {
            drop(arg, data);
        }
        return 0;
    }
    int64_t now = weft__now_ns();
    int64_t due = delay_us <= 0                         ? now
                  : delay_us > (INT64_MAX - now) / 1000 ? INT64_MAX
                                                        : now + delay_us * 1000;
    return weft__timer_add(a->timer, due, run, drop, arg, data, owner);
}

bool weft_agent_timer_cancel(weft_agent_t *a, uint64_t id)
{
    return a != NULL && a->timer != NULL && weft__timer_cancel(a->timer, id);
}

void weft_agent_timer_cancel_owner(weft_agent_t *a, const void *owner)
{
    if (a != NULL && a->timer != NULL) {
        weft__timer_cancel_owner(a->timer, owner);
    }
}

/* ------------------------------------------------------------------ header + body messages */

#define MSG_MAX_HEADER (16u << 20)

/* Appends @p src's tensors (shared) and references (retained) to @p dst. */
static weft_status_t share_parts(weft_value_t *dst, const weft_value_t *src)
{
    for (size_t i = 0; i < weft_value_num_tensors(src); i++) {
        WEFT_CHECK(weft_value_add_tensor(dst, weft_value_tensor(src, i)));
    }
    for (size_t i = 0; i < weft_value_num_refs(src); i++) {
        const weft_value_ref_type_t *type;
        void *obj = weft__value_ref_at(src, i, &type);
        WEFT_CHECK(weft_value_add_ref(dst, type, obj));
    }
    return WEFT_OK;
}

weft_status_t weft_msg_pack(const ProtobufCMessage *hdr, const weft_value_t *body,
                            weft_value_t **msg_p)
{
    weft_status_t st;
    weft_value_t *v;
    size_t blen = 0;
    const void *bp = body != NULL ? weft_value_payload(body, &blen) : NULL;

    if (hdr == NULL || msg_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "msg_pack: NULL argument");
    }
    size_t hlen = protobuf_c_message_get_packed_size(hdr);
    if (hlen > MSG_MAX_HEADER) {
        return weft__set_error(WEFT_ERR_TOO_LARGE, "msg_pack: a header of %zu bytes (max %u)", hlen,
                               MSG_MAX_HEADER);
    }
    uint8_t *buf = weft_alloc(4 + hlen + blen);
    if (buf == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "msg_pack: no memory");
    }
    buf[0] = (uint8_t)hlen;
    buf[1] = (uint8_t)(hlen >> 8);
    buf[2] = (uint8_t)(hlen >> 16);
    buf[3] = (uint8_t)(hlen >> 24);
    protobuf_c_message_pack(hdr, buf + 4);
    if (blen > 0) {
        memcpy(buf + 4 + hlen, bp, blen);
    }
    st = weft_value_create(&v);
    if (st != WEFT_OK) {
        weft_free(buf);
        return st;
    }
    st = weft_value_take_payload(v, buf, 4 + hlen + blen);
    if (st != WEFT_OK) {
        weft_free(buf);
        goto err_free_value;
    }
    if (body != NULL) {
        WEFT_CHECK_GOTO(share_parts(v, body), st, err_free_value);
    }
    *msg_p = v;
    return WEFT_OK;

err_free_value:
    weft_value_free(v);
    return st;
}

weft_status_t weft_msg_unpack_payload(const void *payload, size_t len,
                                      const ProtobufCMessageDescriptor *desc,
                                      ProtobufCMessage **hdr_p, size_t *body_off_p)
{
    const uint8_t *p = payload;

    if (desc == NULL || hdr_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "msg_unpack: NULL argument");
    }
    if (p == NULL || len < 4) {
        return weft__set_error(WEFT_ERR_PROTOCOL, "msg_unpack: a %s message has no header frame",
                               desc->short_name);
    }
    size_t hlen = weft__get_u32(p);
    if (hlen > len - 4) {
        return weft__set_error(WEFT_ERR_PROTOCOL,
                               "msg_unpack: header of %zu bytes in a payload of %zu", hlen, len);
    }
    ProtobufCMessage *m = protobuf_c_message_unpack(desc, &weft__pb_allocator, hlen, p + 4);
    if (m == NULL) {
        return weft__set_error(WEFT_ERR_PROTOCOL, "msg_unpack: the %s header does not decode",
                               desc->short_name);
    }
    *hdr_p = m;
    if (body_off_p != NULL) {
        *body_off_p = 4 + hlen;
    }
    return WEFT_OK;
}

weft_status_t weft_msg_unpack(const weft_value_t *msg, const ProtobufCMessageDescriptor *desc,
                              ProtobufCMessage **hdr_p, size_t *body_off_p)
{
    size_t len = 0;
    const void *p = msg != NULL ? weft_value_payload(msg, &len) : NULL;
    return weft_msg_unpack_payload(p, len, desc, hdr_p, body_off_p);
}

void weft_msg_header_free(ProtobufCMessage *hdr)
{
    if (hdr != NULL) {
        protobuf_c_message_free_unpacked(hdr, &weft__pb_allocator);
    }
}

weft_status_t weft_msg_body(const weft_value_t *msg, weft_value_t **body_p)
{
    weft_status_t st;
    size_t len = 0;
    const uint8_t *p = msg != NULL ? weft_value_payload(msg, &len) : NULL;
    weft_value_t *v;

    if (body_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "msg_body: NULL argument");
    }
    if (p == NULL || len < 4 || weft__get_u32(p) > len - 4) {
        return weft__set_error(WEFT_ERR_PROTOCOL, "msg_body: not a framed module message");
    }
    size_t off = 4 + (size_t)weft__get_u32(p);
    WEFT_CHECK(weft_value_create(&v));
    if (len > off) {
        WEFT_CHECK_GOTO(weft_value_set_payload(v, p + off, len - off), st, err_free_value);
    }
    WEFT_CHECK_GOTO(share_parts(v, msg), st, err_free_value);
    *body_p = v;
    return WEFT_OK;

err_free_value:
    weft_value_free(v);
    return st;
}
