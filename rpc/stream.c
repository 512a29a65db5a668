/* The stream transport: long-lived bidirectional gRPC streams between peers. A rank opens one
 * client stream to each peer it calls: its requests and one-way messages go out on it, the
 * answers come back on it. The peer serves the other end (a server stream). Each stream has a
 * send queue (gRPC allows one send op in flight per call) and one receive op, re-posted after
 * every message.
 *
 * Opening (docs/protocol.md section 3): the server sends a CHALLENGE (32 random bytes) as soon as
 * it accepts the call; the client answers with its Hello, which proves its rank by signing the
 * challenge; the server checks it (weft__hello_check), accepts at most one proven stream per rank,
 * answers HELLO_ACK, and closes a stream that sends no Hello within the handshake timeout. The
 * client queues its requests meanwhile; they leave right behind the Hello.
 *
 * Everything received after the Hello goes to weft__deliver. */
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <grpc/grpc_security.h>
#include <grpc/support/time.h>

#include "internal.h"

#define container_of(p, type, member) ((type *)((char *)(p)-offsetof(type, member)))

struct weft__stream {
    weft_agent_t *agent;
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
    bool held;  /* client: nothing leaves before the Hello (it answers the server's challenge) */
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
    bool hello_ok;   /* server: the Hello was accepted; client: HELLO_ACK came */
    bool challenged; /* client: the challenge came and the Hello is queued */
    /* The handshake was decided (under mu): its deadline passed, or (server) the Hello came, or
     * (client) its answer came; whichever is first, the other does nothing. */
    bool hs_over;
    int64_t hs_deadline_ns;                   /* the handshake's deadline */
    uint8_t challenge[WEFT__CHALLENGE_BYTES]; /* server */
    _Atomic uint64_t hello_timer;             /* the handshake deadline's task */
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
    bool was_proven; /* server: it spoke for its rank until its client's end of it closed */
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

void weft__stream_ref(weft__stream_t *s)
{
    atomic_fetch_add(&s->refs, 1);
}

static void stream_destroy(weft__stream_t *s)
{
    weft__agent_track_stream(s->agent, false);
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
    weft__agent_track_stream(a, true);
    return s;
}

/* ------------------------------------------------------------------ sending */

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

    if (m == NULL || s->dead || s->held) {
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

/* Queues @p m (at the head with @p first). Takes it either way. */
static weft_status_t enqueue(weft__stream_t *s, weft__outmsg_t *m, bool first)
{
    pthread_mutex_lock(&s->mu);
    if (s->dead || s->finishing) {
        weft_status_t st = s->dead ? s->dead_status : WEFT_ERR_SHUTDOWN;
        char *why = weft_strdup(s->dead_why != NULL ? s->dead_why : "stream is closing");
        pthread_mutex_unlock(&s->mu);
        weft__outmsg_free(m, st, why);
        weft_status_t ret = weft__set_error(st, "%s", why != NULL ? why : "stream closed");
        weft_free(why);
        return ret;
    }
    if (m->bb == NULL) {
        s->finishing = true;
    }
    if (first) {
        m->next = s->qh;
        s->qh = m;
        if (s->qt == NULL) {
            s->qt = m;
        }
    } else if (s->qt == NULL) {
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

weft_status_t weft__stream_send(weft__stream_t *s, weft__outmsg_t *m)
{
    return enqueue(s, m, false);
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

/* Sends a control envelope (CHALLENGE, HELLO, HELLO_ACK) with no body; at the queue's head with
 * @p first. */
static weft_status_t send_envelope(weft__stream_t *s, Weft__V1__Envelope *env, bool first)
{
    weft__outmsg_t *m;

    WEFT_CHECK(weft__wire_encode(env, NULL, &m));
    return enqueue(s, m, first);
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

/* ------------------------------------------------------------------ opening */

/* Claims the handshake's outcome: true for the first of the deadline and the handshake's end. */
static bool hs_claim(weft__stream_t *s)
{
    pthread_mutex_lock(&s->mu);
    bool first = !s->hs_over;
    s->hs_over = true;
    pthread_mutex_unlock(&s->mu);
    return first;
}

/* A client stream whose handshake did not complete: its peer is lost, with why. */
static void client_hs_lost(weft__stream_t *s, bool diagnose)
{
    weft_agent_t *a = s->agent;
    int peer = weft__stream_peer(s);
    weft_status_t st = WEFT_ERR_PEER_LOST;
    char why[1024];
    int n = snprintf(why, sizeof(why),
                     "%s (rank %d) did not complete the stream's handshake within %lld ms",
                     a->peers[peer].name != NULL ? a->peers[peer].name : "?", peer,
                     (long long)(2 * a->handshake_timeout_ms));
    if (diagnose && a->peers[peer].address != NULL && !weft__agent_closing(a)) {
        /* With TLS, gRPC tells nothing of a refused handshake (its channel just keeps trying):
         * handshakes of our own say why, as the join's do: a verdict counts when two of them
         * 300 ms apart agree (a peer shedding connections may look refusing once). They block
         * this bulk worker for up to ~5 s: the queue is told (another worker takes its work). */
        weft__blocking(1);
        char first[512] = "";
        weft_status_t v = weft__tls_diagnose(a, a->peers[peer].address, peer,
                                             weft__now_ns() + 2000 * 1000000LL);
        if (v != WEFT_OK) {
            snprintf(first, sizeof(first), "%s", weft_last_error());
            struct timespec ts = {0, 300 * 1000000L};
            nanosleep(&ts, NULL);
            if (weft__tls_diagnose(a, a->peers[peer].address, peer,
                                   weft__now_ns() + 2000 * 1000000LL) != v) {
                v = WEFT_OK;
            }
        }
        weft__blocking(0);
        if (v != WEFT_OK && n > 0 && (size_t)n < sizeof(why)) {
            st = v;
            snprintf(why + n, sizeof(why) - (size_t)n, ": %s", first);
        }
    }
    stream_dead(s, st, why);
    if (!weft__agent_closing(a)) {
        weft__agent_peer_lost(a, peer, st, why);
    }
    grpc_call_cancel_with_status(s->call, GRPC_STATUS_DEADLINE_EXCEEDED, why, NULL);
}

static void client_hs_lost_run(void *arg)
{
    weft__stream_t *s = arg;
    client_hs_lost(s, true);
    weft__stream_unref(s);
}

/* The handshake deadline passed (a task on the agent's timer holding a reference). Server: no
 * Hello came, the stream is closed. Client: no answer to the Hello came (or no challenge), the
 * peer cannot be spoken to: it is lost (with TLS, after a diagnosing handshake of up to 2 s on
 * the bulk queue, not on the timer's thread). */
static void hello_deadline(void *arg, uint64_t data)
{
    weft__stream_t *s = arg;
    weft_agent_t *a = s->agent;
    (void)data;

    if (hs_claim(s)) {
        char why[256];
        if (s->client) {
            if (a->tls != NULL && a->bulk != NULL && !weft__agent_closing(a)) {
                weft__stream_ref(s);
                if (weft__bulk_submit(a->bulk, client_hs_lost_run, s) == WEFT_OK) {
                    weft__stream_unref(s); /* the timer's reference */
                    return;
                }
                weft__stream_unref(s);
            }
            client_hs_lost(s, false);
        } else {
            snprintf(why, sizeof(why), "no Hello within %lld ms of the stream's start",
                     (long long)a->handshake_timeout_ms);
            WEFT_WARN("closed a stream: %s", why);
            grpc_call_cancel_with_status(s->call, GRPC_STATUS_UNAUTHENTICATED, why, NULL);
        }
    }
    weft__stream_unref(s);
}

static void hello_deadline_drop(void *arg, uint64_t data)
{
    (void)data;
    weft__stream_unref(arg);
}

/* Takes the handshake deadline back (the handshake ended, or the stream did). */
static void hello_timer_cancel(weft__stream_t *s)
{
    uint64_t id = atomic_exchange(&s->hello_timer, 0);
    if (id != 0 && weft__timer_cancel(s->agent->timer, id)) {
        weft__stream_unref(s); /* the task's reference */
    }
}

static bool server_unregister(weft__stream_t *s);

/* The Hello that opens a server stream; true if accepted. */
static bool server_hello(weft__stream_t *s, weft_status_t st, Weft__V1__Envelope *env)
{
    weft_agent_t *a = s->agent;
    char why[512];
    Weft__V1__Envelope ack = WEFT__V1__ENVELOPE__INIT;

    if (!hs_claim(s)) {
        return false; /* the deadline passed first: the stream is being closed */
    }
    hello_timer_cancel(s);
    if (st == WEFT_OK && env->kind == WEFT__V1__KIND__KIND_HELLO) {
        weft__tls_id_t tls;
        weft__tls_call_id(s->call, &tls);
        st = weft__hello_check(a, env->hello, WEFT__HELLO_STREAM, s->challenge, s->hs_deadline_ns,
                               &tls, why, sizeof(why));
    } else if (st == WEFT_OK) {
        st = WEFT_ERR_PROTOCOL;
        snprintf(why, sizeof(why), "the first message of a stream must be a Hello");
    } else {
        snprintf(why, sizeof(why), "%s", weft_last_error());
    }
    if (st == WEFT_OK) {
        /* One proven stream per rank: a second one is refused, never believed. */
        weft__peer_t *p = &a->peers[env->hello->rank];
        pthread_mutex_lock(&p->mu);
        if (p->server_stream != NULL) {
            st = WEFT_ERR_ALREADY_EXISTS;
            snprintf(why, sizeof(why), "rank %d has a stream to %s already", env->hello->rank,
                     a->name);
        } else {
            /* Its rank first: server_unregister finds the stream by it. */
            atomic_store(&s->peer, env->hello->rank);
            p->server_stream = s;
        }
        pthread_mutex_unlock(&p->mu);
        if (st == WEFT_OK) {
            pthread_mutex_lock(&s->mu);
            bool dead = s->dead;
            pthread_mutex_unlock(&s->mu);
            if (dead) {
                /* The stream ended while the Hello was checked (server_end ran, or runs, after
                 * its death was marked): it never speaks for the rank. */
                (void)server_unregister(s);
                return false;
            }
        }
    }
    ack.kind = WEFT__V1__KIND__KIND_HELLO_ACK;
    ack.src_rank = a->rank;
    ack.status = st;
    if (st != WEFT_OK) {
        WEFT_WARN("refused a connection: %s", why);
        ack.error = why;
        (void)send_envelope(s, &ack, false);
        finish(s,
               st == WEFT_ERR_AUTH ? GRPC_STATUS_UNAUTHENTICATED : GRPC_STATUS_FAILED_PRECONDITION,
               why);
        return false;
    }
    pthread_mutex_lock(&s->mu);
    s->hello_ok = true;
    pthread_mutex_unlock(&s->mu);
    (void)send_envelope(s, &ack, false);
    return true;
}

/* Client: the server's challenge came; the Hello that answers it leaves first, then the queue. */
static weft_status_t client_challenge(weft__stream_t *s, const Weft__V1__Envelope *env)
{
    weft_agent_t *a = s->agent;
    int peer = weft__stream_peer(s);
    uint8_t sig[WEFT__ID_SIG_BYTES];

    if (s->challenged) {
        return weft__set_error(WEFT_ERR_PROTOCOL, "rank %d sent a second challenge", peer);
    }
    if (env->challenge.len != WEFT__CHALLENGE_BYTES) {
        return weft__set_error(WEFT_ERR_PROTOCOL, "rank %d sent a challenge of %zu bytes (%d)",
                               peer, env->challenge.len, WEFT__CHALLENGE_BYTES);
    }
    WEFT_CHECK(weft__hello_sign(a, 'S', env->challenge.data, peer, sig));
    Weft__V1__Hello hello = WEFT__V1__HELLO__INIT;
    Weft__V1__Envelope h = WEFT__V1__ENVELOPE__INIT;
    weft__hello_fill(a, &hello);
    hello.proof.data = sig;
    hello.proof.len = sizeof(sig);
    h.kind = WEFT__V1__KIND__KIND_HELLO;
    h.src_rank = a->rank;
    h.hello = &hello;
    s->challenged = true;
    weft_status_t st = send_envelope(s, &h, true);
    if (st != WEFT_OK) {
        return st;
    }
    weft__outmsg_t *failed = NULL;
    pthread_mutex_lock(&s->mu);
    s->held = false;
    if (!s->sending && s->corked == 0) {
        failed = start_next_locked(s);
    }
    pthread_mutex_unlock(&s->mu);
    fail_queue(failed, WEFT_ERR_TRANSPORT, "gRPC refused a send");
    return WEFT_OK;
}

/* ------------------------------------------------------------------ receiving */

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

typedef struct {
    Weft__V1__Envelope *env;
    weft_value_t *v;
    weft_status_t st;
    char *why; /* a refused frame's text, for when it is delivered */
} frame_t;

/* Client: a HELLO_ACK. False when it refused us (the stream is dead, the peer lost). */
static bool client_ack(weft__stream_t *s, const Weft__V1__Envelope *env)
{
    weft_agent_t *a = s->agent;
    int peer = weft__stream_peer(s);

    if (!hs_claim(s)) {
        return false; /* too late: the deadline declared the stream dead */
    }
    hello_timer_cancel(s);
    if (env->status == 0) {
        s->hello_ok = true;
        return true;
    }
    char why[640];
    snprintf(why, sizeof(why), "rank %d refused the connection: %s", peer,
             env->error != NULL ? env->error : "");
    weft_status_t est =
        weft_status_valid(env->status) ? (weft_status_t)env->status : WEFT_ERR_PROTOCOL;
    stream_dead(s, est, why);
    if (!weft__agent_closing(a)) {
        weft__agent_peer_lost(a, peer, est, why);
    }
    return false;
}

/*
 * One gRPC message: its frames in order. On a server stream the Hello comes first; one-way
 * messages are delivered in turn (a channel's order), requests and answers after it, their
 * answers held to leave together. On a client stream: the challenge, the Hello's answer, then
 * answers. A frame the reader refuses goes to the delivery with its status (its body skipped);
 * an unframeable rest of the message is dropped (docs/protocol.md section 5).
 */
static void read_message(weft__stream_t *s, grpc_byte_buffer *bb, uint64_t seq, bool first)
{
    weft_agent_t *a = s->agent;
    weft__reader_t r;
    frame_t local[16];
    frame_t *frames = local;
    size_t n = 0, cap = 16;
    bool broken = false;
    bool hello_first = first;

    if (!s->client) {
        turn_wait(s, seq);
    }
    if (weft__reader_init(&r, bb) != WEFT_OK) {
        WEFT_WARN("rank %d sent an unreadable gRPC message; dropped", weft__stream_peer(s));
        grpc_byte_buffer_destroy(bb);
        if (!s->client) {
            turn_done(s);
        }
        if (!s->client && !s->hello_ok) {
            finish(s, GRPC_STATUS_INVALID_ARGUMENT, "unreadable message");
        } else if (first && !post_recv(s)) {
            stream_dead(s, WEFT_ERR_PEER_LOST, "stream ended");
        }
        return;
    }
    weft__origin_t o = {WEFT__TP_STREAM, weft__stream_peer(s), s, s->client};
    while (weft__reader_more(&r)) {
        Weft__V1__Envelope *env = NULL;
        weft_value_t *v = NULL;
        weft_status_t st = weft__reader_envelope(&r, a->max_message_bytes, &env);
        if (env == NULL) {
            WEFT_WARN("rank %d sent a message that cannot be framed (%s); the rest of it is "
                      "dropped",
                      o.peer, weft_last_error());
            if (!s->hello_ok && !s->client) {
                finish(s, GRPC_STATUS_INVALID_ARGUMENT, weft_last_error());
                broken = true;
            }
            break;
        }
        if (!s->client && !s->hello_ok) {
            /* The first frame of a server stream: the Hello. */
            bool ok = server_hello(s, st, env);
            weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
            if (!ok) {
                broken = true;
                break;
            }
            if (st == WEFT_OK) {
                weft__reader_skip_body(&r);
            }
            o.peer = weft__stream_peer(s);
            continue;
        }
        if (s->client && (env->kind == WEFT__V1__KIND__KIND_CHALLENGE ||
                          env->kind == WEFT__V1__KIND__KIND_HELLO_ACK)) {
            if (st == WEFT_OK) {
                weft__reader_skip_body(&r);
            }
            bool ok = st == WEFT_OK;
            if (ok && env->kind == WEFT__V1__KIND__KIND_CHALLENGE) {
                st = client_challenge(s, env);
                ok = st == WEFT_OK;
                if (!ok) {
                    char why[640];
                    snprintf(why, sizeof(why), "could not answer rank %d's challenge: %s", o.peer,
                             weft_last_error());
                    stream_dead(s, st, why);
                    if (!weft__agent_closing(a)) {
                        weft__agent_peer_lost(a, o.peer, st, why);
                    }
                }
            } else if (ok) {
                ok = client_ack(s, env);
            } else {
                char why[640];
                snprintf(why, sizeof(why), "rank %d's answer to the Hello is unreadable: %s",
                         o.peer, weft_last_error());
                stream_dead(s, st, why);
                if (!weft__agent_closing(a)) {
                    weft__agent_peer_lost(a, o.peer, st, why);
                }
            }
            weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
            if (!ok) {
                broken = true;
                break;
            }
            continue;
        }
        if (s->client && !s->challenged) {
            WEFT_WARN("rank %d sent a frame of kind %d before its challenge; ignored", o.peer,
                      (int)env->kind);
            if (st == WEFT_OK) {
                weft__reader_skip_body(&r);
            }
            weft__v1__envelope__free_unpacked(env, &weft__pb_allocator);
            continue;
        }
        if (st == WEFT_OK && (env->kind != WEFT__V1__KIND__KIND_RESPONSE || env->status == 0)) {
            st = weft__reader_body(&r, env, &v);
        } else if (st == WEFT_OK) {
            weft__reader_skip_body(&r);
        }
        if (env->kind == WEFT__V1__KIND__KIND_ONEWAY && !s->client) {
            /* In turn: the channel's order. */
            if (st != WEFT_OK) {
                weft__set_error(st, "%s", weft_last_error());
            }
            weft__deliver(a, &o, env, v, st);
            continue;
        }
        if (n == cap) {
            frame_t *bigger = weft_alloc(2 * cap * sizeof(*bigger));
            if (bigger == NULL) {
                weft__set_error(WEFT_ERR_NO_MEMORY, "no memory for the frames of a message");
                weft_value_free(v);
                weft__deliver(a, &o, env, NULL, WEFT_ERR_NO_MEMORY);
                continue;
            }
            memcpy(bigger, frames, n * sizeof(*bigger));
            if (frames != local) {
                weft_free(frames);
            }
            frames = bigger;
            cap *= 2;
        }
        frames[n].env = env;
        frames[n].v = v;
        frames[n].st = st;
        frames[n].why = st != WEFT_OK ? weft__strfmt("%s", weft_last_error()) : NULL;
        n++;
    }
    weft__reader_destroy(&r);
    grpc_byte_buffer_destroy(bb);
    if (!s->client) {
        turn_done(s);
    }
    if (hello_first && !broken && !post_recv(s)) {
        stream_dead(s, WEFT_ERR_PEER_LOST, "stream ended");
    }
    /* The answers to the requests of one message leave together, as one message (a
     * handler that blocks in a weft wait lets them go first: see the agent's block hook). */
    bool held = n > 1 && !s->client && tl_corked == NULL;
    if (held) {
        cork(s);
    }
    for (size_t i = 0; i < n; i++) {
        if (frames[i].st != WEFT_OK) {
            weft__set_error(frames[i].st, "%s", frames[i].why != NULL ? frames[i].why : "refused");
            weft_free(frames[i].why);
            weft__deliver(a, &o, frames[i].env, frames[i].v, frames[i].st);
        } else {
            weft__deliver(a, &o, frames[i].env, frames[i].v, WEFT_OK);
        }
    }
    if (held) {
        weft__stream_uncork_current();
    }
    if (frames != local) {
        weft_free(frames);
    }
}

typedef struct {
    weft__stream_t *s;
    grpc_byte_buffer *bb;
    uint64_t seq;
} bulk_task_t;

static void bulk_run(void *arg)
{
    bulk_task_t *t = arg;

    read_message(t->s, t->bb, t->seq, false);
    weft__stream_unref(t->s);
    weft_free(t);
}

/* Server: the stream stops speaking for its peer (it ends); true if it did until now. Its rank
 * is set before it is registered (both under the peer's lock), so a stream without a rank was
 * never registered. */
static bool server_unregister(weft__stream_t *s)
{
    int peer = s->client ? -1 : weft__stream_peer(s);
    bool was = false;

    if (peer < 0) {
        return false;
    }
    weft__peer_t *p = &s->agent->peers[peer];
    pthread_mutex_lock(&p->mu);
    if (p->server_stream == s) {
        p->server_stream = NULL;
        was = true;
    }
    pthread_mutex_unlock(&p->mu);
    return was;
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
            /* The client half-closed: the stream no longer speaks for it (a new one may come at
             * once), and our side finishes once our sends are out. */
            s->was_proven = server_unregister(s);
            finish(s, GRPC_STATUS_OK, "");
        }
        weft__stream_unref(s);
        return;
    }
    /* Only one receive is outstanding at a time: messages are numbered in order. */
    uint64_t seq = s->received++;
    /* Until the handshake is done (server: the Hello; client: the challenge), one message at a
     * time: the next receive is posted once it is read. */
    bool first = s->client ? !s->challenged : !s->hello_ok;
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
    read_message(s, bb, seq, first);
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
    hello_timer_cancel(s);
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
    if ((st == WEFT_ERR_PROTOCOL || st == WEFT_ERR_AUTH) && s->dead) {
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
    hello_timer_cancel(s);
    stream_dead(s, WEFT_ERR_PEER_LOST, "stream from the peer ended");
    /* Only the peer's proven stream speaks for it: losing any other stream (one that never
     * proved a rank, a refused second one, one its peer closed) never evicts the rank. */
    /* (A peer that dies shows as its end of the stream closing, then as the call cancelled.) */
    bool proven = server_unregister(s) || s->was_proven;
    if (proven && s->cancelled && !weft__agent_closing(a)) {
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
    /* A stream that does not send its Hello within the handshake timeout is closed. The task is
     * queued before the end of the call can be seen, so that server_end always finds it. */
    weft__stream_ref(s); /* the end of the call's */
    s->hs_deadline_ns = weft__now_ns() + a->handshake_timeout_ms * 1000000;
    weft__stream_ref(s); /* the handshake deadline's (dropped by the timer if it cannot queue) */
    atomic_store(&s->hello_timer, weft__timer_add(a->timer, s->hs_deadline_ns, hello_deadline,
                                                  hello_deadline_drop, s, 0, NULL));
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &s->cancelled;
    if (grpc_call_start_batch(call, &op, 1, &s->end_op, NULL) != GRPC_CALL_OK) {
        hello_timer_cancel(s);
        weft__stream_unref(s);
        return;
    }
    /* The challenge first: the client's Hello signs it. */
    Weft__V1__Envelope ch = WEFT__V1__ENVELOPE__INIT;
    ch.kind = WEFT__V1__KIND__KIND_CHALLENGE;
    ch.src_rank = a->rank;
    ch.challenge.data = s->challenge;
    ch.challenge.len = sizeof(s->challenge);
    if (weft__random_bytes(s->challenge, sizeof(s->challenge)) != WEFT_OK ||
        send_envelope(s, &ch, false) != WEFT_OK || !post_recv(s)) {
        grpc_call_cancel(call, NULL);
    }
}

/* Whether a TCP connect to @p address is refused (nothing listens: the peer is gone), tried for
 * at most @p timeout_ms; false when it connects, or no answer comes in time (a lost SYN). */
static bool connect_refused(const char *address, int timeout_ms)
{
    char host[300];
    snprintf(host, sizeof(host), "%s", address);
    char *colon = strrchr(host, ':');
    if (colon == NULL) {
        return false;
    }
    *colon = '\0';
    char *h = host;
    if (h[0] == '[') {
        h++;
        h[strcspn(h, "]")] = '\0';
    }
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(h, colon + 1, &hints, &res) != 0) {
        return false;
    }
    bool refused = false;
    int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd >= 0) {
        int r = connect(fd, res->ai_addr, res->ai_addrlen);
        if (r != 0 && errno == EINPROGRESS) {
            struct pollfd pfd = {fd, POLLOUT, 0};
            int err = 0;
            socklen_t len = sizeof(err);
            if (poll(&pfd, 1, timeout_ms) == 1 &&
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0) {
                refused = err == ECONNREFUSED;
            }
        } else if (r != 0) {
            refused = errno == ECONNREFUSED;
        }
        close(fd);
    }
    freeaddrinfo(res);
    return refused;
}

static weft_status_t stream_open(weft_agent_t *a, weft__peer_t *p, weft__stream_t **s_p)
{
    grpc_op ops[2];
    weft__stream_t *s;

    if (p->channel == NULL) {
        p->channel = weft__channel_create(a, p->address, p->rank);
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
    s->held = true;            /* until the challenge is answered */
    s->md_op.cb = client_md;
    s->end_op.cb = client_end;
    /* The server answers the Hello within its handshake timeout of accepting the stream; the
     * client waits twice that from opening it (connecting comes first). No answer by then: the
     * peer cannot be spoken to, and is lost. */
    s->hs_deadline_ns = weft__now_ns() + 2 * a->handshake_timeout_ms * 1000000;
    weft__stream_ref(s); /* the handshake deadline's (dropped by the timer if it cannot queue) */
    atomic_store(&s->hello_timer, weft__timer_add(a->timer, s->hs_deadline_ns, hello_deadline,
                                                  hello_deadline_drop, s, 0, NULL));

    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    /* A failed connect is tried again (gRPC's backoff) until the handshake deadline above: gRPC
     * bounds a connect by TCP_USER_TIMEOUT (the keepalive timeout, half the peer timeout), which
     * one lost SYN outlasts (its retransmission comes after 1 s); failing the stream then would
     * lose the peer for good (found in tests/netns, syn_loss). But a peer whose port refuses
     * connections is gone: its stream fails at once, and the peer with it, as it always did. */
    if (!connect_refused(p->address, 200)) {
        ops[0].flags = GRPC_INITIAL_METADATA_WAIT_FOR_READY;
    }
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
    if (e1 != GRPC_CALL_OK || e2 != GRPC_CALL_OK || !post_recv(s)) {
        (void)hs_claim(s);
        hello_timer_cancel(s);
        grpc_call_cancel(call, NULL);
        weft__stream_unref(s);
        return weft__set_error(WEFT_ERR_TRANSPORT, "rpc: gRPC refused to start a stream to %s",
                               p->address);
    }
    *s_p = s;
    return WEFT_OK;
}

weft_status_t weft__peer_stream(weft_agent_t *a, int to, weft__stream_t **s_p)
{
    weft_status_t st = WEFT_OK;
    weft__peer_t *p = &a->peers[to];

    if (atomic_load(&a->state) >= WEFT__AGENT_CLOSED) {
        /* The queue is shut down: no stream can be opened any more. */
        return weft__set_error(WEFT_ERR_SHUTDOWN, "rpc: the agent is closed");
    }
    pthread_mutex_lock(&p->mu);
    if (p->lost) {
        st = weft__set_error(WEFT_ERR_PEER_LOST, "%s (rank %d) was lost: %s", p->name, to,
                             p->lost_why != NULL ? p->lost_why : "");
    } else if (p->stream == NULL) {
        st = stream_open(a, p, &p->stream);
    }
    if (st == WEFT_OK) {
        weft__stream_ref(p->stream);
        *s_p = p->stream;
    }
    pthread_mutex_unlock(&p->mu);
    return st;
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

/* ------------------------------------------------------------------ the transport's entry */

static weft_status_t tp_send(weft_agent_t *a, int peer, weft__stream_t *via, weft__outmsg_t *m,
                             uint32_t flags, weft__path_t *path_p)
{
    (void)flags;
    if (via != NULL) {
        /* An answer goes back on the stream its request came on. */
        return weft__stream_send(via, m);
    }
    weft__stream_t *s;
    weft_status_t st = weft__peer_stream(a, peer, &s);
    if (st != WEFT_OK) {
        char why[WEFT__ERROR_MAX];
        snprintf(why, sizeof(why), "%s", weft_last_error());
        weft__outmsg_free(m, st, why);
        return weft__set_error(st, "%s", why);
    }
    if (path_p != NULL) {
        path_p->stream = s;
    }
    st = weft__stream_send(s, m);
    weft__stream_unref(s);
    return st;
}

static bool tp_usable(weft_agent_t *a, int peer)
{
    weft__peer_t *p = &a->peers[peer];
    pthread_mutex_lock(&p->mu);
    bool ok = !p->lost;
    pthread_mutex_unlock(&p->mu);
    return ok;
}

static void tp_cut(weft_agent_t *a, int peer)
{
    /* The stream ends by itself (its peer is gone); pending calls were failed by the agent. */
    (void)a;
    (void)peer;
}

static void tp_stop(weft_agent_t *a)
{
    for (int i = 0; a->peers != NULL && i < a->world_size; i++) {
        weft__peer_t *p = &a->peers[i];
        pthread_mutex_lock(&p->mu);
        weft__stream_t *s = p->stream;
        p->stream = NULL;
        pthread_mutex_unlock(&p->mu);
        if (s != NULL) {
            weft__stream_cancel(s);
            weft__stream_unref(s);
        }
    }
}

const weft__transport_t weft__stream_transport = {
    .name = "its gRPC stream",
    .send = tp_send,
    .usable = tp_usable,
    .cut = tp_cut,
    .stop = tp_stop,
};

bool weft__stream_wait_handshake(weft__stream_t *s, int64_t deadline_ns, _Atomic bool *stop)
{
    for (;;) {
        pthread_mutex_lock(&s->mu);
        bool over = s->hs_over || s->dead;
        bool ok = s->hello_ok && !s->dead;
        pthread_mutex_unlock(&s->mu);
        if (over || weft__now_ns() >= deadline_ns || (stop != NULL && atomic_load(stop))) {
            return ok;
        }
        struct timespec ms = {0, 1000000}; /* a handshake takes about one round trip */
        nanosleep(&ms, NULL);
    }
}
