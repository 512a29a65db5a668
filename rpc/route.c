/* The one route and the one delivery of the agent. Every frame this rank sends (a request, an
 * answer, a module's one-way message) is encoded, checked against the receiver's limit and handed
 * to a transport by weft__route; every frame it receives, from any transport, is dispatched on its
 * kind by weft__deliver. The transports are entries of a table (send, usable, cut, stop): the
 * gRPC stream, the direct connection and the shared-memory ring (a GPU transport later). */
#include "internal.h"

/* ------------------------------------------------------------------ messages */

void weft__outmsg_free(weft__outmsg_t *m, weft_status_t fail_status, const char *why)
{
    if (m == NULL) {
        return;
    }
    if (m->bb != NULL) {
        grpc_byte_buffer_destroy(m->bb);
    }
    /* Freed with a failure status: the message never left this process. */
    weft__refs_out_free(m->refs, fail_status == WEFT_OK);
    if (m->sent != NULL) {
        if (fail_status == WEFT_OK) {
            weft_future_complete(m->sent, WEFT_OK, NULL, NULL);
        } else {
            weft_future_complete(m->sent, fail_status, why, NULL);
        }
        weft_future_release(m->sent);
    }
    if (m->reply_via != NULL) {
        weft__stream_unref(m->reply_via);
    }
    weft_free(m->fin_text);
    weft_free(m);
}

/* ------------------------------------------------------------------ the route */

/* Which transport the frame takes (the rule in internal.h and docs/protocol.md section 4). */
static weft__tp_id_t choose(weft_agent_t *a, const weft__frame_t *fr, const weft__outmsg_t *m)
{
    const weft__transport_t *direct = a->transports[WEFT__TP_DIRECT];
    const weft__transport_t *shm = a->transports[WEFT__TP_SHM];
    bool large = false;

    if (fr->kind == WEFT__V1__KIND__KIND_RESPONSE && fr->reply_to != NULL) {
        /* An answer goes back the way its request came: a ring's request by the ring back. */
        if (fr->reply_to->tp == WEFT__TP_SHM && shm != NULL && shm->usable(a, fr->to)) {
            return WEFT__TP_SHM;
        }
    } else if (shm != NULL && shm->usable(a, fr->to)) {
        /* A rank of this host: every call and message, in order, through its ring. */
        return WEFT__TP_SHM;
    }

    switch (fr->kind) {
    case WEFT__V1__KIND__KIND_REQUEST:
        /* With TLS, every request without references: gRPC's record protection costs a 64-byte
         * round trip ~13 us on the stream, OpenSSL on the direct connection ~1 (63 against
         * 38-43 us p50, bench/RESULTS.md "TLS"). A request with references stays on the stream,
         * whose receiver orders their decoding. A small one goes direct only once the connection
         * is open (else it takes the stream while the connection opens in the background): it
         * never waits behind a connect, which a silent port would hold for the handshake's
         * deadline. */
        large = m->nbytes >= WEFT__DIRECT_MIN ||
                (a->tls != NULL && m->refs == NULL && weft__direct_ready(a, fr->to));
        break;
    case WEFT__V1__KIND__KIND_RESPONSE:
        /* An answer to a request that came direct goes direct too, once this rank's own
         * connection there is open (a small one never waits behind its connect, as a request):
         * a bulk transfer's round trips stay off the stream. */
        large = m->nbytes >= WEFT__DIRECT_MIN ||
                (fr->reply_to != NULL && fr->reply_to->tp == WEFT__TP_DIRECT &&
                 weft__direct_ready(a, fr->to));
        break;
    case WEFT__V1__KIND__KIND_ONEWAY:
        /* Only unordered messages: the stream keeps a channel's order; and without references,
         * whose decoding the stream's receiver orders. */
        large = (fr->flags & WEFT_SEND_UNORDERED) != 0 && m->nbytes >= WEFT__DIRECT_MIN_UNORDERED &&
                m->refs == NULL;
        break;
    default:
        break;
    }
    if (large && direct != NULL && direct->usable(a, fr->to)) {
        return WEFT__TP_DIRECT;
    }
    return WEFT__TP_STREAM;
}

weft_status_t weft__route(weft_agent_t *a, const weft__frame_t *fr, weft__path_t *path_p)
{
    weft_status_t st;
    weft__outmsg_t *m = NULL;
    weft__refs_out_t *refs = NULL;
    Weft__V1__Envelope env = WEFT__V1__ENVELOPE__INIT;
    weft_call_autograd_t ag = {0};

    if (path_p != NULL) {
        path_p->handed = false;
        path_p->stream = NULL;
    }
    env.kind = fr->kind;
    env.src_rank = a->rank;
    env.request_id = fr->request_id;
    switch (fr->kind) {
    case WEFT__V1__KIND__KIND_REQUEST:
        env.function = (char *)fr->function;
        env.timeout_ms = fr->timeout_ms;
        break;
    case WEFT__V1__KIND__KIND_RESPONSE:
        env.status = fr->status;
        env.error = (char *)(fr->error != NULL ? fr->error : "");
        break;
    case WEFT__V1__KIND__KIND_ONEWAY:
        env.channel = fr->channel;
        break;
    default:
        st = weft__set_error(WEFT_ERR_INVALID_ARG, "rpc: the route carries calls, answers and "
                                                   "messages only");
        goto err_release_sent;
    }
    /* A failed answer carries no value. */
    const weft_value_t *v =
        fr->kind == WEFT__V1__KIND__KIND_RESPONSE && fr->status != WEFT_OK ? NULL : fr->value;
    ag.context = fr->ag_context;
    if (fr->ag_message_p != NULL) {
        *fr->ag_message_p = 0;
    }
    if (ag.context != 0 && fr->kind != WEFT__V1__KIND__KIND_ONEWAY &&
        (fr->kind == WEFT__V1__KIND__KIND_REQUEST || fr->status == WEFT_OK) &&
        atomic_load(&a->has_call_hooks)) {
        /* Distributed autograd records the frame (a send function) before it is encoded. */
        st = a->call_hooks.on_send(a->call_hooks.arg, fr->to, fr->function,
                                   fr->kind == WEFT__V1__KIND__KIND_RESPONSE, v, &ag);
        if (st != WEFT_OK) {
            weft_free(ag.grads);
            ag.message = 0;
            goto err_release_sent;
        }
        env.autograd_context = ag.context;
        env.autograd_message = ag.message;
        env.n_autograd_grads = ag.n_grads;
        env.autograd_grads = ag.grads;
    }
    st = weft__refs_encode(a, fr->to, v, &env, &refs);
    if (st != WEFT_OK) {
        weft_free(ag.grads);
        goto err_release_sent;
    }
    st = weft__wire_encode(&env, v, &m);
    weft_free(ag.grads);
    if (st != WEFT_OK) {
        weft__refs_out_free(refs, false);
        goto err_release_sent;
    }
    if (fr->ag_message_p != NULL) {
        *fr->ag_message_p = ag.message;
    }
    m->refs = refs; /* from here on, freeing @p m unsent runs the codecs' unsent */
    m->sent = fr->sent;
    m->user_request = fr->user_request;
    uint64_t limit = a->peers[fr->to].max_message_bytes;
    if (limit > 0 && m->nbytes > limit) {
        char why[512];
        const char *who = a->peers[fr->to].name != NULL ? a->peers[fr->to].name : "the receiver";
        if (fr->kind == WEFT__V1__KIND__KIND_REQUEST) {
            snprintf(why, sizeof(why),
                     "rpc: call to '%s' is %zu bytes, over %s's limit of %llu "
                     "bytes",
                     fr->function, m->nbytes, who, (unsigned long long)limit);
        } else if (fr->kind == WEFT__V1__KIND__KIND_RESPONSE) {
            snprintf(why, sizeof(why),
                     "result of '%s' on %s is %zu bytes, over the caller's "
                     "limit of %llu bytes",
                     fr->function != NULL ? fr->function : "?", a->name, m->nbytes,
                     (unsigned long long)limit);
        } else {
            snprintf(why, sizeof(why),
                     "agent_send: message is %zu bytes, over %s's limit of %llu "
                     "bytes",
                     m->nbytes, who, (unsigned long long)limit);
        }
        weft__outmsg_free(m, WEFT_ERR_TOO_LARGE, why);
        if (ag.message != 0) {
            weft__call_ag_dead(a, ag.context, ag.message);
        }
        return weft__set_error(WEFT_ERR_TOO_LARGE, "%s", why);
    }
    weft__tp_id_t tp = choose(a, fr, m);
    weft__stream_t *via = NULL;
    if (fr->kind == WEFT__V1__KIND__KIND_RESPONSE && fr->reply_to != NULL &&
        fr->reply_to->stream != NULL) {
        via = fr->reply_to->stream;
        if (tp != WEFT__TP_STREAM) {
            /* Kept in case the direct connection or ring cannot carry it after all. */
            weft__stream_ref(via);
            m->reply_via = via;
        }
    }
    if (tp == WEFT__TP_DIRECT) {
        /* The peer's stream stays open while frames go direct: its keepalive watches the peer
         * (a ring's connection opens it once, shm.c). */
        weft__stream_t *s;
        if (weft__peer_stream(a, fr->to, &s) == WEFT_OK) {
            weft__stream_unref(s);
        }
    }
    if (path_p != NULL) {
        path_p->tp = tp;
        path_p->handed = true;
    }
    return a->transports[tp]->send(a, fr->to, via, m, fr->flags, path_p);

err_release_sent:
    if (ag.message != 0) {
        weft_status_t keep = st;
        char text[WEFT__ERROR_MAX];
        snprintf(text, sizeof(text), "%s", weft_last_error());
        weft__call_ag_dead(a, ag.context, ag.message);
        weft__set_error(keep, "%s", text);
    }
    if (fr->sent != NULL) {
        weft_future_release(fr->sent);
    }
    return st;
}

void weft__route_fallback(weft_agent_t *a, int peer, weft__outmsg_t *m)
{
    weft__stream_t *via = m->reply_via;
    m->reply_via = NULL;
    (void)a->transports[WEFT__TP_STREAM]->send(a, peer, via, m, 0, NULL);
    if (via != NULL) {
        weft__stream_unref(via);
    }
}

/* ------------------------------------------------------------------ the delivery */

void weft__deliver(weft_agent_t *a, const weft__origin_t *o, Weft__V1__Envelope *env,
                   weft_value_t *v, weft_status_t st)
{
    switch (env->kind) {
    case WEFT__V1__KIND__KIND_REQUEST:
        if (o->client) {
            /* Requests come on the streams peers open to us, or direct. */
            WEFT_WARN("rank %d sent a request on a stream this rank opened; ignored", o->peer);
            break;
        }
        if (st != WEFT_OK) {
            weft__call_refuse(a, o, env, st);
            break;
        }
        weft__call_dispatch(a, o, env, v);
        return;
    case WEFT__V1__KIND__KIND_RESPONSE:
        weft__call_response(a, o, env, v, st);
        return;
    case WEFT__V1__KIND__KIND_ONEWAY:
        if (o->client) {
            WEFT_WARN("rank %d sent a one-way message on a stream this rank opened; ignored",
                      o->peer);
            break;
        }
        if (st != WEFT_OK || env->channel < 1 || env->channel > WEFT_CHANNEL_MAX) {
            WEFT_WARN("dropped a message on channel %u from rank %d: %s", env->channel, o->peer,
                      st != WEFT_OK ? weft_last_error() : "no such channel");
            break;
        }
        weft__channel_deliver(a, env->channel, o->peer, v);
        v = NULL;
        break;
    default:
        WEFT_WARN("rank %d sent a frame of kind %d over %s; ignored", o->peer, (int)env->kind,
                  a->transports[o->tp]->name);
        break;
    }
    weft_value_free(v);
    weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
}
