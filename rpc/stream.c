/* Long-lived bidirectional streams between peers. A rank opens one client
 * stream to each peer it calls: requests and one-way messages go out on it,
 * responses come back on it. The peer serves the other end (a server stream).
 * Each stream has a send queue (gRPC allows one send op in flight per call)
 * and one receive op that is re-posted after every message. */
#include <string.h>

#include <grpc/grpc_security.h>
#include <grpc/support/time.h>

#include "internal.h"

#define container_of(p, type, member) ((type *)((char *)(p)-offsetof(type, member)))

struct weft__stream {
    weft_agent_t *agent;
    weft__stream_t *next_all;
    weft__stream_t *prev_all;
    bool client;
    _Atomic int peer; /* rank; -1 until the server stream's Hello */
    grpc_call *call;
    pthread_mutex_t mu;
    _Atomic int refs;

    /* send side */
    weft__outmsg_t *qh, *qt;
    weft__outmsg_t *inflight; /* a chain: several frames may go out as one gRPC message */
    grpc_byte_buffer *merged; /* the coalesced buffer of the chain, if any */
    bool sending;
    int corked; /* dispatch loops holding the sends: the answers they make leave together */
    bool md_sent;
    bool finishing;
    bool dead;
    weft_status_t dead_status;
    char *dead_why;
    weft__op_t send_op;

    /* receive side */
    weft__op_t recv_op;
    grpc_byte_buffer *recv_bb;
    bool hello_ok;
    uint64_t peer_max; /* the peer's message limit, from its Hello */
    uint64_t received; /* messages received (numbering; one receive at a time) */
    uint64_t framed;   /* messages whose frames have been read, in order */
    pthread_cond_t turn_cv;

    /* end of call */
    weft__op_t end_op;
    weft__op_t md_op;
    grpc_metadata_array md_in;
    grpc_metadata_array trailing;
    grpc_status_code status;
    grpc_slice details;
    int cancelled;
};

static void recv_done(weft__op_t *op, int ok);
static void send_done(weft__op_t *op, int ok);

/* The stream whose sends this thread holds while it runs the requests of one message. */
static _Thread_local weft__stream_t *tl_corked;

/* Coalescing: frames under this size queued behind a send are merged. */
#define COALESCE_BYTES  (256u << 10)
#define COALESCE_FRAMES 128
/* Messages at least this large are read out on the bulk thread. */
#define BULK_BYTES (1u << 20)

int weft__stream_peer(const weft__stream_t *s)
{
    return atomic_load(&s->peer);
}

uint64_t weft__stream_peer_max(const weft__stream_t *s)
{
    return s->peer_max;
}

void weft__stream_ref(weft__stream_t *s)
{
    atomic_fetch_add(&s->refs, 1);
}

static void stream_destroy(weft__stream_t *s)
{
    weft__agent_track_stream(s->agent, s, false);
    if (s->call != NULL) {
        grpc_call_unref(s->call);
    }
    grpc_metadata_array_destroy(&s->md_in);
    grpc_metadata_array_destroy(&s->trailing);
    grpc_slice_unref(s->details);
    if (s->recv_bb != NULL) {
        grpc_byte_buffer_destroy(s->recv_bb);
    }
    weft_free(s->dead_why);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->turn_cv);
    weft_free(s);
}

void weft__stream_unref(weft__stream_t *s)
{
    if (atomic_fetch_sub(&s->refs, 1) == 1) {
        stream_destroy(s);
    }
}

static weft__stream_t *stream_new(weft_agent_t *a, bool client, grpc_call *call)
{
    weft__stream_t *s = weft_calloc(1, sizeof(*s));

    if (s == NULL) {
        return NULL;
    }
    s->agent = a;
    s->client = client;
    atomic_init(&s->peer, -1);
    s->call = call;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->turn_cv, NULL);
    atomic_init(&s->refs, 0);
    s->send_op.cb = send_done;
    s->recv_op.cb = recv_done;
    grpc_metadata_array_init(&s->md_in);
    grpc_metadata_array_init(&s->trailing);
    s->details = grpc_empty_slice();
    weft__agent_track_stream(a, s, true);
    return s;
}

/* Takes the queue out of a dead stream; the caller fails each message outside the lock. */
static weft__outmsg_t *mark_dead_locked(weft__stream_t *s, weft_status_t st, const char *why)
{
    weft__outmsg_t *q = s->qh;

    if (!s->dead) {
        s->dead = true;
        s->dead_status = st;
        s->dead_why = weft_strdup(why);
    }
    s->qh = s->qt = NULL;
    return q;
}

static void fail_queue(weft__outmsg_t *q, weft_status_t st, const char *why)
{
    while (q != NULL) {
        weft__outmsg_t *next = q->next;
        weft_free(q->fin_text);
        weft__outmsg_free(q, st, why);
        q = next;
    }
}

static void stream_dead(weft__stream_t *s, weft_status_t st, const char *why)
{
    pthread_mutex_lock(&s->mu);
    weft__outmsg_t *q = mark_dead_locked(s, st, why);
    pthread_mutex_unlock(&s->mu);
    fail_queue(q, st, why);
}

/* Starts the next queued send. Called with s->mu held. Returns messages to
 * fail (after unlocking) if gRPC refused the send and the stream is dead. */
static weft__outmsg_t *start_next_locked(weft__stream_t *s)
{
    grpc_op ops[3];
    size_t n = 0;
    weft__outmsg_t *m = s->qh;
    grpc_slice details = grpc_empty_slice();

    if (m == NULL || s->dead) {
        s->sending = false;
        return NULL;
    }
    s->qh = m->next;
    if (s->qh == NULL) {
        s->qt = NULL;
    }
    m->next = NULL;
    grpc_byte_buffer *send_bb = m->bb;
    /* Small frames queued behind a send in flight go out together as one gRPC
     * message: one send op and one receive completion for all of them. */
    if (m->bb != NULL && m->nbytes < COALESCE_BYTES && s->qh != NULL && s->qh->bb != NULL &&
        s->qh->nbytes < COALESCE_BYTES) {
        weft__outmsg_t *tail = m;
        size_t total = m->nbytes;
        size_t nslices = m->bb->data.raw.slice_buffer.count;
        int count = 1;
        while (s->qh != NULL && s->qh->bb != NULL && total + s->qh->nbytes <= COALESCE_BYTES &&
               count < COALESCE_FRAMES) {
            weft__outmsg_t *n = s->qh;
            s->qh = n->next;
            n->next = NULL;
            tail->next = n;
            tail = n;
            total += n->nbytes;
            nslices += n->bb->data.raw.slice_buffer.count;
            count++;
        }
        if (s->qh == NULL) {
            s->qt = NULL;
        }
        grpc_slice stack[64];
        grpc_slice *sl = nslices <= 64 ? stack : weft_alloc(nslices * sizeof(grpc_slice));
        if (sl != NULL) {
            size_t k = 0;
            for (weft__outmsg_t *x = m; x != NULL; x = x->next) {
                grpc_slice_buffer *sb = &x->bb->data.raw.slice_buffer;
                for (size_t i = 0; i < sb->count; i++) {
                    sl[k++] = sb->slices[i];
                }
            }
            s->merged = grpc_raw_byte_buffer_create(sl, k);
            send_bb = s->merged;
            if (sl != stack) {
                weft_free(sl);
            }
        } else {
            /* No memory to merge: send the first alone, put the rest back. */
            tail->next = s->qh;
            s->qh = m->next;
            if (s->qt == NULL) {
                s->qt = tail;
            }
            m->next = NULL;
        }
    }
    memset(ops, 0, sizeof(ops));
    if (!s->client && !s->md_sent) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        n++;
        s->md_sent = true;
    }
    if (m->bb != NULL) {
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = send_bb;
        n++;
    } else if (s->client) {
        ops[n].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
        n++;
    } else {
        details = grpc_slice_from_copied_string(m->fin_text != NULL ? m->fin_text : "");
        ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        ops[n].data.send_status_from_server.status = m->fin_code;
        ops[n].data.send_status_from_server.status_details = &details;
        n++;
    }
    s->sending = true;
    s->inflight = m;
    weft__stream_ref(s);
    grpc_call_error e = grpc_call_start_batch(s->call, ops, n, &s->send_op, NULL);
    grpc_slice_unref(details);
    if (e == GRPC_CALL_OK) {
        return NULL;
    }
    WEFT_WARN("stream to rank %d: gRPC refused a send (%d)", weft__stream_peer(s), (int)e);
    s->inflight = NULL;
    s->sending = false;
    if (s->merged != NULL) {
        grpc_byte_buffer_destroy(s->merged);
        s->merged = NULL;
    }
    atomic_fetch_sub(&s->refs, 1); /* never the last: the caller holds one */
    weft__outmsg_t *last = m;
    while (last->next != NULL) {
        last = last->next;
    }
    last->next = s->qh;
    s->qh = m;
    if (s->qt == NULL) {
        s->qt = last;
    }
    return mark_dead_locked(s, WEFT_ERR_TRANSPORT, "gRPC refused a send");
}

weft_status_t weft__stream_send(weft__stream_t *s, weft__outmsg_t *m)
{
    pthread_mutex_lock(&s->mu);
    if (s->dead || s->finishing) {
        weft_status_t st = s->dead ? s->dead_status : WEFT_ERR_SHUTDOWN;
        char *why = weft_strdup(s->dead_why != NULL ? s->dead_why : "stream is closing");
        pthread_mutex_unlock(&s->mu);
        weft_free(m->fin_text);
        weft__outmsg_free(m, st, why);
        weft_status_t ret = weft__set_error(st, "%s", why != NULL ? why : "stream closed");
        weft_free(why);
        return ret;
    }
    if (m->bb == NULL) {
        s->finishing = true;
    }
    if (s->qt == NULL) {
        s->qh = s->qt = m;
    } else {
        s->qt->next = m;
        s->qt = m;
    }
    weft__outmsg_t *failed = NULL;
    if (!s->sending && s->corked == 0) {
        failed = start_next_locked(s);
    }
    pthread_mutex_unlock(&s->mu);
    if (failed != NULL) {
        fail_queue(failed, WEFT_ERR_TRANSPORT, "gRPC refused a send");
        return weft__set_error(WEFT_ERR_TRANSPORT, "rpc: gRPC refused a send");
    }
    return WEFT_OK;
}

/* Holds the sends of @p s until weft__stream_uncork_current, on this thread. */
static void cork(weft__stream_t *s)
{
    pthread_mutex_lock(&s->mu);
    s->corked++;
    pthread_mutex_unlock(&s->mu);
    weft__stream_ref(s);
    tl_corked = s;
}

void weft__stream_uncork_current(void)
{
    weft__stream_t *s = tl_corked;
    weft__outmsg_t *failed = NULL;

    if (s == NULL) {
        return;
    }
    tl_corked = NULL;
    pthread_mutex_lock(&s->mu);
    s->corked--;
    if (s->corked == 0 && !s->sending) {
        failed = start_next_locked(s);
    }
    pthread_mutex_unlock(&s->mu);
    fail_queue(failed, WEFT_ERR_TRANSPORT, "gRPC refused a send");
    weft__stream_unref(s);
}

static void send_done(weft__op_t *op, int ok)
{
    weft__stream_t *s = container_of(op, weft__stream_t, send_op);
    weft__outmsg_t *q = NULL;

    pthread_mutex_lock(&s->mu);
    weft__outmsg_t *m = s->inflight;
    grpc_byte_buffer *merged = s->merged;
    s->inflight = NULL;
    s->merged = NULL;
    s->sending = false;
    if (!ok) {
        q = mark_dead_locked(s, WEFT_ERR_PEER_LOST, "connection broke while sending");
    } else if (s->corked == 0) {
        q = start_next_locked(s);
    }
    weft_status_t st = s->dead ? s->dead_status : WEFT_OK;
    pthread_mutex_unlock(&s->mu);
    if (merged != NULL) {
        grpc_byte_buffer_destroy(merged);
    }
    fail_queue(m, ok ? WEFT_OK : st, "connection broke while sending");
    fail_queue(q, st, "connection broke while sending");
    weft__stream_unref(s);
}

static bool post_recv(weft__stream_t *s)
{
    grpc_op op;

    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &s->recv_bb;
    weft__stream_ref(s);
    if (grpc_call_start_batch(s->call, &op, 1, &s->recv_op, NULL) != GRPC_CALL_OK) {
        weft__stream_unref(s);
        return false;
    }
    return true;
}

/* Sends a control envelope (HELLO, HELLO_ACK) with no body. */
static weft_status_t send_envelope(weft__stream_t *s, Weft__V1__Envelope *env)
{
    weft__outmsg_t *m;

    WEFT_CHECK(weft__wire_encode(env, NULL, &m));
    return weft__stream_send(s, m);
}

/* Server: ends the stream with a gRPC status after what is queued. */
static void finish(weft__stream_t *s, grpc_status_code code, const char *text)
{
    weft__outmsg_t *m = weft_calloc(1, sizeof(*m));

    if (m == NULL) {
        grpc_call_cancel(s->call, NULL);
        return;
    }
    m->fin_code = code;
    m->fin_text = weft_strdup(text);
    (void)weft__stream_send(s, m);
}

static weft_status_t check_hello(weft_agent_t *a, const Weft__V1__Hello *h, char *why, size_t n)
{
    if (h == NULL) {
        snprintf(why, n, "first message is not a Hello");
        return WEFT_ERR_PROTOCOL;
    }
    if (h->protocol_version != WEFT_PROTOCOL_VERSION) {
        snprintf(why, n, "protocol version %u is not supported by %s (speaks version %d)",
                 h->protocol_version, a->name, WEFT_PROTOCOL_VERSION);
        return WEFT_ERR_VERSION;
    }
    if (strcmp(a->auth_token, "") != 0 &&
        (h->auth_token.len != strlen(a->auth_token) ||
         memcmp(h->auth_token.data, a->auth_token, h->auth_token.len) != 0)) {
        snprintf(why, n, "authentication token of rank %d does not match", h->rank);
        return WEFT_ERR_AUTH;
    }
    if (h->world_size != a->world_size) {
        snprintf(why, n, "rank %d expects a world of %d, this one has %d", h->rank, h->world_size,
                 a->world_size);
        return WEFT_ERR_MISMATCH;
    }
    if (h->rank < 0 || h->rank >= a->world_size) {
        snprintf(why, n, "rank %d is out of range 0..%d", h->rank, a->world_size - 1);
        return WEFT_ERR_INVALID_ARG;
    }
    return WEFT_OK;
}

/* The Hello that opens a server stream; true if accepted. */
static bool server_hello(weft__stream_t *s, weft_status_t st, Weft__V1__Envelope *env)
{
    weft_agent_t *a = s->agent;
    char why[512];
    Weft__V1__Envelope ack = WEFT__V1__ENVELOPE__INIT;

    if (st == WEFT_OK && env->kind == WEFT__V1__KIND__KIND_HELLO) {
        st = check_hello(a, env->hello, why, sizeof(why));
    } else if (st == WEFT_OK) {
        st = WEFT_ERR_PROTOCOL;
        snprintf(why, sizeof(why), "first message of a stream must be a Hello");
    } else {
        snprintf(why, sizeof(why), "%s", weft_last_error());
    }
    ack.kind = WEFT__V1__KIND__KIND_HELLO_ACK;
    ack.src_rank = a->rank;
    ack.status = st;
    if (st != WEFT_OK) {
        WEFT_WARN("refused a connection: %s", why);
        ack.error = why;
        (void)send_envelope(s, &ack);
        finish(s,
               st == WEFT_ERR_AUTH ? GRPC_STATUS_UNAUTHENTICATED : GRPC_STATUS_FAILED_PRECONDITION,
               why);
        return false;
    }
    s->peer_max = env->hello->max_message_bytes;
    atomic_store(&s->peer, env->hello->rank);
    s->hello_ok = true;
    (void)send_envelope(s, &ack);
    return true;
}

/* Waits until the messages before @p seq on this stream have been framed, so
 * that one-way messages reach their channels in the order they were sent. */
static void turn_wait(weft__stream_t *s, uint64_t seq)
{
    pthread_mutex_lock(&s->mu);
    while (s->framed != seq) {
        pthread_cond_wait(&s->turn_cv, &s->mu);
    }
    pthread_mutex_unlock(&s->mu);
}

static void turn_done(weft__stream_t *s)
{
    pthread_mutex_lock(&s->mu);
    s->framed++;
    pthread_cond_broadcast(&s->turn_cv);
    pthread_mutex_unlock(&s->mu);
}

static void answer_refused(weft__stream_t *s, const Weft__V1__Envelope *env, weft_status_t st)
{
    Weft__V1__Envelope resp = WEFT__V1__ENVELOPE__INIT;
    char why[600];

    /* The sender counted it: count it as received, or shutdown never settles. */
    if (env->function == NULL || !weft__fn_internal(env->function)) {
        atomic_fetch_add(&s->agent->requests_received, 1);
    }
    snprintf(why, sizeof(why), "%s (on %s)", weft_last_error(), s->agent->name);
    resp.kind = WEFT__V1__KIND__KIND_RESPONSE;
    resp.request_id = env->request_id;
    resp.src_rank = s->agent->rank;
    resp.status = st;
    resp.error = why;
    (void)send_envelope(s, &resp);
}

static void deliver_oneway(weft__stream_t *s, Weft__V1__Envelope *env, weft_value_t *v,
                           weft_status_t st)
{
    weft_agent_t *a = s->agent;
    uint32_t ch = env->channel;

    if (st != WEFT_OK || ch < 1 || ch > WEFT_CHANNEL_MAX) {
        WEFT_WARN("dropped a message on channel %u from rank %d: %s", ch, weft__stream_peer(s),
                  st != WEFT_OK ? weft_last_error() : "no such channel");
        weft_value_free(v);
        return;
    }
    weft__channel_deliver(a, ch, weft__stream_peer(s), v);
}

typedef struct {
    Weft__V1__Envelope *env;
    weft_value_t *args;
} req_t;

/* A gRPC message on a server stream: a Hello first, then requests and one-way frames. */
static void server_message(weft__stream_t *s, grpc_byte_buffer *bb, uint64_t seq, bool first)
{
    weft_agent_t *a = s->agent;
    weft__reader_t r;
    req_t local[16];
    req_t *reqs = local;
    size_t nreq = 0, cap = 16;
    bool broken = false;

    if (weft__reader_init(&r, bb) != WEFT_OK) {
        grpc_byte_buffer_destroy(bb);
        finish(s, GRPC_STATUS_INVALID_ARGUMENT, "unreadable message");
        turn_wait(s, seq); /* keep the turns moving for the messages after it */
        turn_done(s);
        return;
    }
    bool hello_first = first;
    turn_wait(s, seq);
    while (weft__reader_more(&r)) {
        Weft__V1__Envelope *env = NULL;
        weft_value_t *args = NULL;
        weft_status_t st = weft__reader_envelope(&r, a->max_message_bytes, &env);
        if (env == NULL) {
            /* Not even an envelope: this peer does not speak weft; end its stream. */
            WEFT_WARN("rank %d sent an unreadable message (%s); closing its stream",
                      weft__stream_peer(s), weft_last_error());
            finish(s, GRPC_STATUS_INVALID_ARGUMENT, weft_last_error());
            broken = true;
            break;
        }
        if (!s->hello_ok) {
            bool ok = server_hello(s, st, env);
            weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
            if (!ok) {
                broken = true;
                break;
            }
            if (weft__reader_skip_body(&r) != WEFT_OK) {
                broken = true;
                break;
            }
            continue;
        }
        if (env->kind == WEFT__V1__KIND__KIND_ONEWAY) {
            weft_value_t *v = NULL;
            if (st == WEFT_OK) {
                st = weft__reader_body(&r, env, &v);
            } else {
                (void)weft__reader_skip_body(&r);
            }
            deliver_oneway(s, env, v, st);
            weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
            continue;
        }
        if (env->kind == WEFT__V1__KIND__KIND_RESPONSE) {
            /* The answer to a request we sent on a direct connection. */
            weft_value_t *v = NULL;
            if (st == WEFT_OK && env->status == 0) {
                st = weft__reader_body(&r, env, &v);
            } else {
                (void)weft__reader_skip_body(&r);
            }
            if (st != WEFT_OK) {
                weft__pending_fail_id(a, weft__stream_peer(s), env->request_id, st,
                                      weft_last_error());
                weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
                continue;
            }
            /* Completed after the turn, with the requests: callbacks may take time. */
            args = v;
            goto keep;
        }
        if (env->kind != WEFT__V1__KIND__KIND_REQUEST) {
            WEFT_WARN("rank %d sent a frame of kind %d on its request stream; ignored",
                      weft__stream_peer(s), (int)env->kind);
            (void)weft__reader_skip_body(&r);
            weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
            continue;
        }
        if (st == WEFT_OK) {
            st = weft__reader_body(&r, env, &args);
        } else {
            (void)weft__reader_skip_body(&r);
        }
        if (st != WEFT_OK) {
            /* A request we cannot accept: answer it with the reason. */
            answer_refused(s, env, st);
            weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
            continue;
        }
    keep:
        if (nreq == cap) {
            req_t *bigger = weft_alloc(2 * cap * sizeof(*bigger));
            if (bigger == NULL) {
                weft_value_free(args);
                weft__set_error(WEFT_ERR_NO_MEMORY, "no memory");
                if (env->kind == WEFT__V1__KIND__KIND_RESPONSE) {
                    weft__pending_fail_id(a, weft__stream_peer(s), env->request_id,
                                          WEFT_ERR_NO_MEMORY, "no memory for a response");
                } else {
                    answer_refused(s, env, WEFT_ERR_NO_MEMORY);
                }
                weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
                continue;
            }
            memcpy(bigger, reqs, nreq * sizeof(*bigger));
            if (reqs != local) {
                weft_free(reqs);
            }
            reqs = bigger;
            cap *= 2;
        }
        reqs[nreq].env = env;
        reqs[nreq].args = args;
        nreq++;
    }
    weft__reader_destroy(&r);
    grpc_byte_buffer_destroy(bb);
    turn_done(s);
    if (hello_first && !broken && !post_recv(s)) {
        stream_dead(s, WEFT_ERR_PEER_LOST, "stream ended");
    }
    /* The answers to the requests of one message leave together, as one message (a
     * handler that blocks in a weft wait lets them go first: see the agent's block hook). */
    bool held = nreq > 1 && tl_corked == NULL;
    if (held) {
        cork(s);
    }
    for (size_t i = 0; i < nreq; i++) {
        if (reqs[i].env->kind == WEFT__V1__KIND__KIND_RESPONSE) {
            weft__call_response(a, weft__stream_peer(s), reqs[i].env, reqs[i].args);
        } else {
            weft__call_dispatch(a, s, reqs[i].env, reqs[i].args);
        }
    }
    if (held) {
        weft__stream_uncork_current();
    }
    if (reqs != local) {
        weft_free(reqs);
    }
}

/* A gRPC message on a client stream: the Hello's answer, then responses. */
static void client_message(weft__stream_t *s, grpc_byte_buffer *bb, bool first)
{
    weft_agent_t *a = s->agent;
    weft__reader_t r;
    int peer = weft__stream_peer(s);

    if (weft__reader_init(&r, bb) != WEFT_OK) {
        grpc_byte_buffer_destroy(bb);
        grpc_call_cancel_with_status(s->call, GRPC_STATUS_INVALID_ARGUMENT, "unreadable message",
                                     NULL);
        return;
    }
    bool broken = false;
    while (weft__reader_more(&r)) {
        Weft__V1__Envelope *env = NULL;
        weft_status_t st = weft__reader_envelope(&r, a->max_message_bytes, &env);
        if (env == NULL) {
            WEFT_WARN("rank %d sent an unreadable response (%s); closing the stream", peer,
                      weft_last_error());
            grpc_call_cancel_with_status(s->call, GRPC_STATUS_INVALID_ARGUMENT,
                                         "unreadable message", NULL);
            broken = true;
            break;
        }
        if (env->kind == WEFT__V1__KIND__KIND_HELLO_ACK) {
            (void)weft__reader_skip_body(&r);
            if (env->status != 0) {
                char why[640];
                snprintf(why, sizeof(why), "rank %d refused the connection: %s", peer,
                         env->error != NULL ? env->error : "");
                weft_status_t est =
                    weft_status_valid(env->status) ? (weft_status_t)env->status : WEFT_ERR_PROTOCOL;
                stream_dead(s, est, why);
                weft__agent_peer_lost(a, peer, est, why);
                broken = true;
            } else {
                s->hello_ok = true;
            }
            weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
            if (broken) {
                break;
            }
            continue;
        }
        weft_value_t *v = NULL;
        if (env->kind != WEFT__V1__KIND__KIND_RESPONSE) {
            WEFT_WARN("rank %d sent a frame of kind %d on a response stream; ignored", peer,
                      (int)env->kind);
            (void)weft__reader_skip_body(&r);
            weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
            continue;
        }
        if (st == WEFT_OK && env->status == 0) {
            st = weft__reader_body(&r, env, &v);
        } else {
            (void)weft__reader_skip_body(&r);
        }
        if (st != WEFT_OK) {
            char why[600];
            snprintf(why, sizeof(why), "response from rank %d could not be read: %s", peer,
                     weft_last_error());
            WEFT_WARN("%s", why);
            weft__pending_fail_id(a, peer, env->request_id, st, why);
            weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
            continue;
        }
        weft__call_response(a, peer, env, v);
    }
    weft__reader_destroy(&r);
    grpc_byte_buffer_destroy(bb);
    if (first && !broken && !post_recv(s)) {
        stream_dead(s, WEFT_ERR_PEER_LOST, "stream ended");
    }
}

typedef struct {
    weft__stream_t *s;
    grpc_byte_buffer *bb;
    uint64_t seq;
} bulk_task_t;

static void process_message(weft__stream_t *s, grpc_byte_buffer *bb, uint64_t seq, bool first)
{
    if (s->client) {
        client_message(s, bb, first);
    } else {
        server_message(s, bb, seq, first);
    }
}

static void bulk_run(void *arg)
{
    bulk_task_t *t = arg;

    process_message(t->s, t->bb, t->seq, false);
    weft__stream_unref(t->s);
    weft_free(t);
}

static void recv_done(weft__op_t *op, int ok)
{
    weft__stream_t *s = container_of(op, weft__stream_t, recv_op);
    grpc_byte_buffer *bb = s->recv_bb;

    s->recv_bb = NULL;
    if (!ok || bb == NULL) {
        /* The other side closed or the call failed; end_op tells why. */
        if (bb != NULL) {
            grpc_byte_buffer_destroy(bb);
        }
        if (!s->client && ok) {
            /* The client half-closed: finish our side once our sends are out. */
            finish(s, GRPC_STATUS_OK, "");
        }
        weft__stream_unref(s);
        return;
    }
    /* Only one receive is outstanding at a time: messages are numbered in order. */
    uint64_t seq = s->received++;
    bool first = !s->hello_ok;
    if (!first) {
        /* Receive the next message while this one is read and served. */
        if (!post_recv(s)) {
            stream_dead(s, WEFT_ERR_PEER_LOST, "stream ended");
        }
        /* Large messages are copied out on the bulk thread, so that this
         * transport thread goes back to reading the socket meanwhile. */
        if (grpc_byte_buffer_length(bb) >= BULK_BYTES && s->agent->bulk != NULL) {
            bulk_task_t *t = weft_alloc(sizeof(*t));
            if (t != NULL) {
                t->s = s;
                t->bb = bb;
                t->seq = seq;
                if (weft__bulk_submit(s->agent->bulk, bulk_run, t) == WEFT_OK) {
                    return; /* the task keeps the receive's reference */
                }
                weft_free(t);
            }
        }
    }
    process_message(s, bb, seq, first);
    weft__stream_unref(s);
}

/* Client: the call ended (RECV_STATUS_ON_CLIENT). */
static void client_end(weft__op_t *op, int ok)
{
    weft__stream_t *s = container_of(op, weft__stream_t, end_op);
    weft_agent_t *a = s->agent;
    int peer = weft__stream_peer(s);
    char why[512];
    char *det = grpc_slice_to_c_string(s->details);

    (void)ok;
    if (s->status == GRPC_STATUS_OK) {
        snprintf(why, sizeof(why), "connection to %s (rank %d) was closed by the peer",
                 a->peers[peer].name != NULL ? a->peers[peer].name : "?", peer);
    } else {
        snprintf(why, sizeof(why), "connection to %s (rank %d) lost: %s (gRPC status %d)",
                 a->peers[peer].name != NULL ? a->peers[peer].name : "?", peer, det,
                 (int)s->status);
    }
    gpr_free(det);
    weft_status_t st = weft__grpc_status(s->status);
    if (st == WEFT_OK || st == WEFT_ERR_CANCELLED || st == WEFT_ERR_TRANSPORT) {
        st = WEFT_ERR_PEER_LOST;
    }
    if (st == WEFT_ERR_PROTOCOL && s->dead) {
        st = s->dead_status;
    }
    stream_dead(s, st, why);
    if (!weft__agent_closing(a)) {
        weft__agent_peer_lost(a, peer, st, why);
    }
    weft__stream_unref(s);
}

static void client_md(weft__op_t *op, int ok)
{
    weft__stream_t *s = container_of(op, weft__stream_t, md_op);

    (void)ok;
    weft__stream_unref(s);
}

/* Server: the call is over (RECV_CLOSE_ON_SERVER). */
static void server_end(weft__op_t *op, int ok)
{
    weft__stream_t *s = container_of(op, weft__stream_t, end_op);
    weft_agent_t *a = s->agent;
    int peer = weft__stream_peer(s);

    (void)ok;
    stream_dead(s, WEFT_ERR_PEER_LOST, "stream from the peer ended");
    if (s->cancelled && peer >= 0 && !weft__agent_closing(a)) {
        char why[256];
        snprintf(why, sizeof(why), "stream from %s (rank %d) was cut off",
                 a->peers[peer].name != NULL ? a->peers[peer].name : "?", peer);
        weft__agent_peer_lost(a, peer, WEFT_ERR_PEER_LOST, why);
    }
    weft__stream_unref(s);
}

void weft__stream_accept(weft_agent_t *a, grpc_call *call)
{
    grpc_op op;
    weft__stream_t *s = stream_new(a, false, call);

    if (s == NULL) {
        grpc_call_cancel(call, NULL);
        grpc_call_unref(call);
        return;
    }
    s->end_op.cb = server_end;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &s->cancelled;
    weft__stream_ref(s);
    if (grpc_call_start_batch(call, &op, 1, &s->end_op, NULL) != GRPC_CALL_OK) {
        weft__stream_unref(s);
        return;
    }
    if (!post_recv(s)) {
        grpc_call_cancel(call, NULL);
    }
}

weft_status_t weft__stream_open(weft_agent_t *a, weft__peer_t *p, weft__stream_t **s_p)
{
    grpc_op ops[2];
    weft__stream_t *s;

    if (p->channel == NULL) {
        grpc_channel_credentials *creds = grpc_insecure_credentials_create();
        p->channel = grpc_channel_create(p->address, creds, a->chan_args);
        grpc_channel_credentials_release(creds);
        if (p->channel == NULL) {
            return weft__set_error(WEFT_ERR_TRANSPORT, "rpc: cannot create a channel to %s",
                                   p->address);
        }
    }
    grpc_slice method = grpc_slice_from_static_string(WEFT__METHOD_STREAM);
    grpc_call *call =
        grpc_channel_create_call(p->channel, NULL, GRPC_PROPAGATE_DEFAULTS, a->cq, method, NULL,
                                 gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (call == NULL) {
        return weft__set_error(WEFT_ERR_TRANSPORT, "rpc: cannot open a stream to %s", p->address);
    }
    s = stream_new(a, true, call);
    if (s == NULL) {
        grpc_call_unref(call);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rpc: no memory for a stream");
    }
    atomic_store(&s->peer, p->rank);
    atomic_store(&s->refs, 1); /* the peer's reference */
    s->md_op.cb = client_md;
    s->end_op.cb = client_end;

    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[1].data.recv_initial_metadata.recv_initial_metadata = &s->md_in;
    weft__stream_ref(s);
    grpc_call_error e1 = grpc_call_start_batch(call, ops, 2, &s->md_op, NULL);
    if (e1 != GRPC_CALL_OK) {
        weft__stream_unref(s);
    }
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[0].data.recv_status_on_client.trailing_metadata = &s->trailing;
    ops[0].data.recv_status_on_client.status = &s->status;
    ops[0].data.recv_status_on_client.status_details = &s->details;
    weft__stream_ref(s);
    grpc_call_error e2 = grpc_call_start_batch(call, ops, 1, &s->end_op, NULL);
    if (e2 != GRPC_CALL_OK) {
        weft__stream_unref(s);
    }
    if (e1 != GRPC_CALL_OK || e2 != GRPC_CALL_OK) {
        grpc_call_cancel(call, NULL);
        weft__stream_unref(s);
        return weft__set_error(WEFT_ERR_TRANSPORT, "rpc: gRPC refused to start a stream to %s",
                               p->address);
    }

    Weft__V1__Hello hello = WEFT__V1__HELLO__INIT;
    Weft__V1__Envelope env = WEFT__V1__ENVELOPE__INIT;
    hello.protocol_version = WEFT_PROTOCOL_VERSION;
    hello.name = a->name;
    hello.rank = a->rank;
    hello.address = a->address;
    hello.world_size = a->world_size;
    hello.auth_token.data = (uint8_t *)a->auth_token;
    hello.auth_token.len = strlen(a->auth_token);
    hello.max_message_bytes = a->max_message_bytes;
    hello.direct_address = (char *)weft__direct_address(a);
    env.kind = WEFT__V1__KIND__KIND_HELLO;
    env.src_rank = a->rank;
    env.hello = &hello;
    (void)send_envelope(s, &env);
    /* The first receive waits for the Hello's answer; requests may follow the Hello at once. */
    weft__stream_ref(s);
    grpc_op rop;
    memset(&rop, 0, sizeof(rop));
    rop.op = GRPC_OP_RECV_MESSAGE;
    rop.data.recv_message.recv_message = &s->recv_bb;
    if (grpc_call_start_batch(call, &rop, 1, &s->recv_op, NULL) != GRPC_CALL_OK) {
        weft__stream_unref(s);
    }
    *s_p = s;
    return WEFT_OK;
}

void weft__stream_close(weft__stream_t *s)
{
    if (s->client) {
        weft__outmsg_t *m = weft_calloc(1, sizeof(*m));
        if (m != NULL) {
            (void)weft__stream_send(s, m);
        }
    } else {
        finish(s, GRPC_STATUS_OK, "");
    }
}

void weft__stream_cancel(weft__stream_t *s)
{
    grpc_call_cancel_with_status(s->call, GRPC_STATUS_UNAVAILABLE, "weft agent closed", NULL);
}
