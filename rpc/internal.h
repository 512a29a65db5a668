/* rpc internals. Not installed.
 *
 * The parts:
 *   agent.c      options, the gRPC server and its threads, peers, peer loss, create/join/free
 *   call.c       the registry, incoming calls and their answers, outgoing calls (pending table,
 *                deadlines on the agent's timer), the user's call and send functions
 *   module.c     the module kit: descriptors, channel delivery, timer and message helpers
 *   shutdown.c   collective shutdown
 *   rendezvous.c the Join exchange and the world map
 *   route.c      THE ROUTE (weft__route: every outgoing frame is encoded, limit-checked and handed
 *                to a transport here) and THE DELIVERY (weft__deliver: every received frame, from
 *                any transport, is dispatched on its kind here); the transport table
 *   stream.c     transport: long-lived gRPC streams
 *   direct.c     transport: direct TCP connections for large frames
 *   shm.c        transport: shared-memory rings between the ranks of one host (every frame)
 *   hello.c      identities, the Hello and its one check
 *   seal.c       the direct connections' records under TLS (sealed with the session's keys)
 *   tls.c        TLS: this rank's certificate files (watched), gRPC's credentials, the direct
 *                connections' sessions, certificate identities, the join's diagnosis
 *   refs.c       references inside values
 *   wire.c       the frame codec and reader; exact sends and receives on a socket
 *   bulk.c       the bulk queue (large messages read out off the transport threads)
 * Who calls whom: agent, call, module, shutdown and rendezvous send through the route; the route
 * reaches the transports only through the table (a->transports[]); the transports use hello,
 * refs, wire and bulk, and reach back up only through the route's entry points (weft__deliver for
 * what they receive, weft__route_fallback for what they cannot carry, weft__outmsg_free).
 * Transports never call each other. */
#ifndef WEFT_RPC_INTERNAL_H
#define WEFT_RPC_INTERNAL_H

#if defined(WEFT_BUILDING) && !defined(WEFT_IN_RPC)
#error "rpc/internal.h is internal to rpc: other modules use its public or module API"
#endif

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/support/alloc.h>

#include <weft/module.h>
#include <weft/rpc.h>

#include "../core/internal.h"
#include "weft_pb.h"
#include "wire.pb-c.h"

#define WEFT__METHOD_STREAM  "/weft.v1.Agent/Stream"
#define WEFT__METHOD_JOIN    "/weft.v1.Agent/Join"
#define WEFT__MAX_ENVELOPE   (16u << 20)
#define WEFT__MAX_NAME       255
#define WEFT__MAX_TENSORS    65536
#define WEFT__SHUTDOWN_FN    "__weft.shutdown"
#define WEFT__MAX_TIMEOUT_MS (1000LL * 3600 * 24 * 30) /* deadlines are clamped to 30 days */
#define WEFT__MAX_MESSAGE    ((uint64_t)UINT32_MAX)    /* a gRPC message length is 32 bits */

/* Functions of weft's own modules ("__weft." prefix): not user traffic. */
static inline bool weft__fn_internal(const char *fn)
{
    return strncmp(fn, "__weft.", 7) == 0;
}

/* Every completion-queue tag is one of these; the poller calls cb(op, ok). */
typedef struct weft__op {
    void (*cb)(struct weft__op *op, int ok);
} weft__op_t;

typedef struct weft__stream weft__stream_t;

/* Little-endian u32 of the handshakes and framing. */
static inline void weft__put_u32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static inline uint32_t weft__get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* ------------------------------------------------------------------ wire (wire.c) */

/* Sends all @p n bytes on a socket, through EINTR (MSG_NOSIGNAL: a peer gone is a failure, not
 * SIGPIPE); false when the connection broke. */
bool weft__send_all(int fd, const void *buf, size_t n);
/* Receives exactly @p n bytes from a socket, through EINTR; false when it ended or broke. A
 * reader blocked in recv is woken for every segment that arrives (64 KiB on loopback), and those
 * wake-ups cost more than the copying: so reads of WEFT__LOWAT_MIN and more wait in poll until
 * WEFT__LOWAT_MAX bytes (or all that is left, which must come) are there, then take what is
 * there. (A blocking recv cannot be given a low-water mark: it sleeps with part of it copied,
 * and the kernel wakes it only when the mark is reached again, which the tail may never do.)
 * Smaller reads set the mark back to 1 first. @p lowat: the socket's SO_RCVLOWAT, cached. */
#define WEFT__LOWAT_MIN ((size_t)64 << 10)
#define WEFT__LOWAT_MAX ((size_t)256 << 10)
bool weft__recv_exact(int fd, void *buf, size_t n, int *lowat);
void weft__set_lowat(int fd, int *cache, int v);

/* An encoded message ready to send. */
typedef struct weft__outmsg {
    struct weft__outmsg *next;
    grpc_byte_buffer *bb; /* NULL: "finish the stream" marker */
    size_t nbytes;
    weft_future_t *sent;       /* optional: completes when handed to the transport */
    bool user_request;         /* a user REQUEST (counted in requests_sent) */
    grpc_status_code fin_code; /* finish marker on a server stream: the status to send */
    char *fin_text;
    struct weft__refs_out *refs; /* its encoded references (refs.c): freed with it, "unsent"
                                    when it is freed with a failure status */
    weft__stream_t *reply_via;   /* a RESPONSE: the stream its request came on (held), taken if a
                                    direct connection cannot carry it after all */
} weft__outmsg_t;

/* Encodes env + value (tensor bytes as zero-copy slices that hold tensor
 * references). Fills env->payload_bytes and env->tensors itself. */
weft_status_t weft__wire_encode(Weft__V1__Envelope *env, const weft_value_t *v,
                                weft__outmsg_t **msg_p);
void weft__outmsg_free(weft__outmsg_t *m, weft_status_t fail_status, const char *why);

/*
 * The checks of a frame's envelope, for every transport: the tensor headers (dtype, dims, shape
 * against nbytes), their count, the message limit. *body_p gets the body length the envelope
 * declares (payload_bytes plus every tensor's nbytes, as declared). Returns WEFT_OK, or the
 * refusal (WEFT_ERR_PROTOCOL, WEFT_ERR_TOO_LARGE) with its text; then *framed_p says whether the
 * declared body length can be trusted to find the next frame (false when the sizes overflow).
 */
weft_status_t weft__frame_check(const Weft__V1__Envelope *env, size_t elen, uint64_t max_bytes,
                                uint64_t *body_p, bool *framed_p);

/* A gRPC message carries one or more frames: [u32 LE envelope length]
 * [Envelope][payload][tensor bytes...]. The reader walks them in order. */
typedef struct {
    grpc_byte_buffer_reader r;
    grpc_slice cur;
    size_t off;
    bool has;
} cursor_t;

typedef struct {
    cursor_t c;
    size_t total;
    size_t left;
    uint64_t body_left; /* of the frame whose envelope was read last and accepted */
} weft__reader_t;

weft_status_t weft__reader_init(weft__reader_t *r, grpc_byte_buffer *bb);
void weft__reader_destroy(weft__reader_t *r);
bool weft__reader_more(const weft__reader_t *r);
/*
 * Reads the next frame's envelope. Three outcomes (docs/protocol.md section 5):
 *  - WEFT_OK, *env_p set: the frame's body follows (weft__reader_body or weft__reader_skip_body).
 *  - a refusal, *env_p set: the frame is refused for the status's reason (bad tensor headers, over
 *    the limit); its declared body was skipped (the next frame starts after it). The caller
 *    answers its request id and frees the envelope.
 *  - a refusal, *env_p NULL: the rest of the message cannot be framed (a length past its end, an
 *    envelope that does not decode, sizes that overflow); the rest is dropped (no more frames).
 */
weft_status_t weft__reader_envelope(weft__reader_t *r, uint64_t max_bytes,
                                    Weft__V1__Envelope **env_p);
/* Copies the frame's payload and tensors into a new value (one copy); a ONEWAY frame's
 * references go in as they came (weft__refs_keep_raw). On failure the body is skipped. */
weft_status_t weft__reader_body(weft__reader_t *r, const Weft__V1__Envelope *env,
                                weft_value_t **v_p);
void weft__reader_skip_body(weft__reader_t *r);
/* Packs a standalone protobuf message into a byte buffer (Hello / WorldMap). */
grpc_byte_buffer *weft__wire_pack(const ProtobufCMessage *m);
/* Copies a whole byte buffer into one allocation (small control messages). */
weft_status_t weft__wire_flatten(grpc_byte_buffer *bb, size_t max, uint8_t **buf_p, size_t *len_p);
/* grpc status -> weft status, once, at the boundary. */
weft_status_t weft__grpc_status(grpc_status_code code);

/* ------------------------------------------------------------------ route and delivery */

/* The transports, by index in the agent's table. */
typedef enum {
    WEFT__TP_STREAM = 0,
    WEFT__TP_DIRECT = 1,
    WEFT__TP_SHM = 2,
    WEFT__TP_COUNT
} weft__tp_id_t;

/* Where a received frame came from; a REQUEST's answer goes back by it. */
typedef struct {
    weft__tp_id_t tp;
    int peer;               /* the rank the connection proved (its Hello or its handshake) */
    weft__stream_t *stream; /* the stream it came on (NULL: direct); borrowed */
    bool client;            /* a stream this rank opened (it carries answers to its requests) */
} weft__origin_t;

/* A frame to send through the route. */
typedef struct {
    Weft__V1__Kind kind; /* REQUEST, RESPONSE or ONEWAY */
    int to;
    const weft_value_t *value;      /* borrowed: tensors referenced, payload copied */
    const char *function;           /* REQUEST (a RESPONSE's too, for its error texts) */
    uint64_t request_id;            /* REQUEST, RESPONSE */
    int64_t timeout_ms;             /* REQUEST: time left at sending */
    weft_status_t status;           /* RESPONSE */
    const char *error;              /* RESPONSE with a status */
    uint32_t channel;               /* ONEWAY */
    uint32_t flags;                 /* ONEWAY: WEFT_SEND_* */
    const weft__origin_t *reply_to; /* RESPONSE: where its request came from */
    weft_future_t *sent;            /* ONEWAY: completes once handed over (taken by the route) */
    bool user_request;              /* counted by shutdown */
    uint64_t ag_context;            /* REQUEST, RESPONSE: distributed autograd's context, or 0 */
    uint64_t *ag_message_p;         /* REQUEST: gets the send function on_send recorded, or 0 */
} weft__frame_t;

/* The way a frame went: a request's answer is accepted only back this way. */
typedef struct {
    weft__tp_id_t tp;
    weft__stream_t *stream; /* the client stream (WEFT__TP_STREAM); compared, not held */
    bool handed;            /* it reached a transport (a failure after is the transport's) */
} weft__path_t;

/* A transport: an entry of the agent's table. */
typedef struct {
    const char *name;
    /* Hands @p m to the peer (takes it either way: a failure frees it with the status). @p via: the
     * stream a RESPONSE goes back on (stream transport; NULL: this rank's stream to the peer). */
    weft_status_t (*send)(weft_agent_t *a, int peer, weft__stream_t *via, weft__outmsg_t *m,
                          uint32_t flags, weft__path_t *path_p);
    /* Whether it can carry frames to @p peer now (cheap). */
    bool (*usable)(weft_agent_t *a, int peer);
    /* @p peer is lost: nothing more goes to it this way; a reader blocked on it returns. */
    void (*cut)(weft_agent_t *a, int peer);
    /* Stops its threads and closes its connections (weft_agent_free). */
    void (*stop)(weft_agent_t *a);
} weft__transport_t;

extern const weft__transport_t weft__stream_transport;
extern const weft__transport_t weft__direct_transport;
extern const weft__transport_t weft__shm_transport;

/*
 * THE ROUTE: builds the envelope of @p fr, encodes its references and value, checks the
 * receiver's limit and gives it to a transport, by one rule (docs/protocol.md section 4):
 *   - a REQUEST or RESPONSE of WEFT__DIRECT_MIN bytes or more, an unordered ONEWAY of
 *     WEFT__DIRECT_MIN_UNORDERED or more without references, and every answer to a request that
 *     came on a direct connection take the direct connection, when the pair has one;
 *   - every other RESPONSE goes back on the stream its request came on;
 *   - everything else takes this rank's stream to the peer.
 * @p path_p (may be NULL) gets the way it went. A status means nothing was handed over (the
 * references' unsent ran): WEFT_ERR_TOO_LARGE (over the receiver's limit), a codec's status,
 * WEFT_ERR_PEER_LOST, WEFT_ERR_SHUTDOWN.
 */
weft_status_t weft__route(weft_agent_t *a, const weft__frame_t *fr, weft__path_t *path_p);
/* A message a direct connection could not carry after all (no connection to the peer): takes the
 * stream instead (a RESPONSE the one its request came on). Takes @p m. */
void weft__route_fallback(weft_agent_t *a, int peer, weft__outmsg_t *m);
/*
 * THE DELIVERY: every frame received on any transport, from the rank @p o proved. @p st is
 * WEFT_OK with the frame's body in @p v (may be NULL: none), or the refusal of the frame
 * (weft__reader_envelope, no body; weft_last_error() has its text). Dispatches on the kind:
 * REQUEST -> the call (or its refusal answered), RESPONSE -> the pending call (accepted only from
 * the rank and way it was sent), ONEWAY -> its module. Takes @p env and @p v.
 */
void weft__deliver(weft_agent_t *a, const weft__origin_t *o, Weft__V1__Envelope *env,
                   weft_value_t *v, weft_status_t st);

/* ------------------------------------------------------------------ TLS (tls.c) */

typedef struct weft__tls weft__tls_t;
/* What the certificate a connection presented says about its owner. */
typedef struct {
    bool tls;                      /* a verified certificate came with the connection */
    int rank;                      /* the rank it names (DNS:weft-rank-<r>); -1 none, -2 several */
    char name[WEFT__MAX_NAME + 1]; /* the worker name it binds (its common name); "": none */
} weft__tls_id_t;
/* Loads and checks this rank's TLS files (all NULL or empty: TLS off, a->tls stays NULL). */
weft_status_t weft__tls_create(weft_agent_t *a, const char *ca, const char *cert, const char *key);
void weft__tls_free(weft_agent_t *a);
/* The server's credentials (TLS: client certificates required, files watched) or plaintext. */
grpc_server_credentials *weft__tls_server_credentials(weft_agent_t *a);
/* A channel to rank @p peer at @p target, with TLS when it is on (the server must prove @p peer). */
grpc_channel *weft__channel_create(weft_agent_t *a, const char *target, int peer);
/* TLS's own gRPC arguments (appended at *n_p). */
void weft__tls_grpc_args(const weft_agent_t *a, grpc_arg *args, size_t *n_p);
/* The identity of a server call's client certificate (id->tls false: none). */
void weft__tls_call_id(grpc_call *call, weft__tls_id_t *id);
void weft__tls_id_of_x509(void *x509, weft__tls_id_t *id);
/* With TLS on: the certificate @p id must name @p rank (and @p name if it binds one). */
weft_status_t weft__tls_check_id(const weft_agent_t *a, const weft__tls_id_t *id, int rank,
                                 const char *name, char *why, size_t n);
/* Direct connections: the TLS handshake on a connected socket, within @p deadline_ns; an SSL *,
 * or NULL with the reason in @p why. The acceptor gets the client's identity in @p id. */
void *weft__tls_connect(weft_agent_t *a, int fd, int peer, int64_t deadline_ns, char *why,
                        size_t n);
void *weft__tls_accept(weft_agent_t *a, int fd, int64_t deadline_ns, weft__tls_id_t *id,
                       char *why, size_t n);
/* Clears the handshake's socket timeouts. */
void weft__tls_after_handshake(int fd);
/* Sealed records (seal.c): a direct connection's frames once its TLS handshake is done, sealed
 * with AES-128-GCM under keys from the session's exporter, decrypted where they land. One way:
 * the connecting rank writes, the accepting rank reads. */
#define WEFT__SEAL_MAX ((size_t)1 << 20) /* a record's most plaintext */
typedef struct weft__seal weft__seal_t;
/* From a 32-byte secret; @p epoch_bytes: bytes per key (0: the protocol's 2^34; tests set
 * less); @p lowat: the socket's cached SO_RCVLOWAT (the reader sets it). */
weft__seal_t *weft__seal_new(const uint8_t secret[32], bool writer, uint64_t epoch_bytes,
                             int *lowat);
/* From a TLS 1.3 session whose handshake is done and whose peer waits for weft's answer (no
 * TLS bytes of it unread); NULL with the reason in @p why. WEFT_SEAL_EPOCH_BYTES (tests) sets
 * the bytes per key. */
weft__seal_t *weft__seal_of_tls(void *ssl, bool writer, int *lowat, char *why, size_t n);
void weft__seal_free(weft__seal_t *s);
/* Seals @p n bytes into the current record (sent each time it is full). After a failure the
 * writer fails every call (a record cut short cannot be followed). */
bool weft__seal_write(weft__seal_t *s, int fd, const void *buf, size_t n);
/* Ends the current record and sends it (a frame's end; a large frame's buffer is let go). */
bool weft__seal_flush(weft__seal_t *s, int fd);
/* Reads exactly @p n bytes of plaintext; false when the connection ended or a record was bad
 * (weft__seal_why says which). Reads of 4 KiB and more decrypt whole records in @p buf. */
bool weft__seal_read(weft__seal_t *s, int fd, void *buf, size_t n);
/* Whether bytes of the stream are read ahead (a poll of the socket would not see them). */
bool weft__seal_pending(const weft__seal_t *s);
/* Whether reading failed for a reason of its own (not an end of the connection): a bad record
 * (broken: the peer's bytes were at fault) or this rank's failure (no memory); and why. */
bool weft__seal_failed(const weft__seal_t *s);
bool weft__seal_broken(const weft__seal_t *s);
const char *weft__seal_why(const weft__seal_t *s);
/* Reads exactly @p n bytes from TLS session @p ssl on @p fd by @p deadline_ns, however slowly
 * they come (non-blocking, waiting in poll; a record trickled in a byte at a time cannot hold
 * it past the deadline). */
bool weft__tls_read_until(void *ssl, int fd, void *buf, size_t n, int64_t deadline_ns);
/* OpenSSL writes with write(2), so a peer gone raises SIGPIPE: a thread that may write through
 * it blocks SIGPIPE for the time (begin/end: a SIGPIPE it caused is taken back) or for good
 * (weft's own threads). */
typedef struct {
    sigset_t old;
    bool pending; /* one was pending before: not ours to take */
} weft__nopipe_t;
void weft__nopipe_begin(weft__nopipe_t *np);
void weft__nopipe_end(weft__nopipe_t *np, bool failed);
void weft__nopipe_thread(void);
/* Why a connection to rank @p peer at @p address fails at the TLS level, found by a handshake
 * of its own: WEFT_OK when it finds nothing (or cannot tell), else WEFT_ERR_AUTH (a certificate
 * refused either way, expired, not naming the rank) or WEFT_ERR_PROTOCOL (TLS on one side only),
 * with the text set. */
weft_status_t weft__tls_diagnose(weft_agent_t *a, const char *address, int peer,
                                 int64_t deadline_ns);
/* Whether frames to @p peer can go on its direct connection at once (it is open); when not,
 * the connection is opened in the background (unless its last try failed too recently). */
bool weft__direct_ready(weft_agent_t *a, int peer);

/* ------------------------------------------------------------------ peers and identities */

#define WEFT__ID_KEY_BYTES    32 /* Ed25519 public key */
#define WEFT__ID_SIG_BYTES    64 /* Ed25519 signature */
#define WEFT__CHALLENGE_BYTES 32

typedef struct weft__peer {
    int rank;
    char *name;
    char *address;
    uint64_t max_message_bytes;
    char *direct_address; /* its listener for large frames; "" if none */
    char *shm_address;    /* its shared-memory listener; "" if none */
    uint8_t identity_key[WEFT__ID_KEY_BYTES];
    bool has_key;
    pthread_mutex_t mu;
    grpc_channel *channel;         /* created on first use */
    weft__stream_t *stream;        /* our client stream to this peer */
    weft__stream_t *server_stream; /* its stream to us, once its Hello proved it (one at a time) */
    bool lost;
    char *lost_why;
} weft__peer_t;

/* hello.c */
/* This rank's identity: an Ed25519 key pair made at agent creation. */
weft_status_t weft__identity_create(weft_agent_t *a);
void weft__identity_free(weft_agent_t *a);
/* Fills a Hello for a Join, a stream or a direct connection (borrowed strings). */
void weft__hello_fill(weft_agent_t *a, Weft__V1__Hello *h);
/* Signs the connection's transcript (docs/protocol.md section 3): @p tp 'S' (stream) or 'D'
 * (direct), the server's @p challenge, this rank and @p server_rank. */
weft_status_t weft__hello_sign(weft_agent_t *a, char tp, const uint8_t *challenge, int server_rank,
                               uint8_t sig[WEFT__ID_SIG_BYTES]);
typedef enum {
    WEFT__HELLO_JOIN,   /* to rank 0, to join the world (no challenge) */
    WEFT__HELLO_STREAM, /* opening a stream: proves its rank over @p challenge */
    WEFT__HELLO_DIRECT, /* opening a direct connection: the same */
    WEFT__HELLO_SHM,    /* opening a shared-memory ring: the same (no certificate to check) */
} weft__hello_kind_t;
/*
 * THE HELLO CHECK, for a Join, a stream and a direct connection: protocol version, the job's
 * token (compared in constant time), world size, rank range, and (connections) the proof of the
 * claimed rank with its key from the world map; with TLS on, the certificate @p tls of the
 * connection must name the claimed rank (and name: weft__tls_check_id). A connection that
 * arrives before this rank's own join finished waits for it, until @p deadline_ns (its handshake
 * deadline; unused for a Join). The refusal's text goes to @p why.
 * WEFT_ERR_VERSION, WEFT_ERR_AUTH, WEFT_ERR_MISMATCH, WEFT_ERR_INVALID_ARG, WEFT_ERR_PROTOCOL,
 * WEFT_ERR_INVALID_STATE.
 */
weft_status_t weft__hello_check(weft_agent_t *a, const Weft__V1__Hello *h, weft__hello_kind_t kind,
                                const uint8_t *challenge, int64_t deadline_ns,
                                const weft__tls_id_t *tls, char *why, size_t n);
/* Constant-time comparison of two secrets (length included). */
bool weft__secret_equal(const void *x, size_t xlen, const void *y, size_t ylen);
/* Cryptographically random bytes. */
weft_status_t weft__random_bytes(uint8_t *buf, size_t n);

/* ------------------------------------------------------------------ agent */

typedef struct weft__fn {
    char *name;
    weft_rpc_handler_cb_t cb;
    void *arg;
    struct weft__fn *next;
} weft__fn_t;

typedef struct weft__pending {
    uint64_t id;
    int peer;
    uint64_t timer_id; /* its deadline on the agent's timer */
    weft_future_t *f;
    char *fn;
    bool internal;
    weft__path_t path; /* the way the request went: its answer comes back this way */
    /* weft_rpc_async_into: where the result's tensors may land, and the landing's state */
    weft_rpc_into_t *into;
    size_t n_into;
    bool landing;         /* a reader is writing the answer into @into right now, or landed */
    bool landed;          /* ... it is written: its delivery (weft__call_response) comes next */
    bool expired;         /* its deadline passed while landing: it finishes when the reader is done */
    weft_status_t held;   /* a failure that came while landing (a lost peer), or WEFT_OK */
    uint64_t ag_context, ag_message; /* distributed autograd's send function of the request */
    char *held_why;
    struct weft__pending *next;
} weft__pending_t;

#define WEFT__PENDING_BUCKETS 1024
#define WEFT__MAX_POLLERS     64

typedef enum {
    WEFT__AGENT_CREATED = 0,
    WEFT__AGENT_JOINED,
    WEFT__AGENT_SHUTTING_DOWN, /* barrier in progress: user calls refused */
    WEFT__AGENT_CLOSING,       /* streams closing: peer loss is expected */
    WEFT__AGENT_CLOSED,
} weft__agent_state_t;

/* A module registered with weft_agent_module (module.c). */
typedef struct weft__module {
    weft_module_desc_t desc; /* a copy; desc.codec points at codec */
    const weft_module_desc_t *orig;
    weft_ref_codec_t codec;
    void *state;
    _Atomic(struct weft__module *) next; /* creation order */
} weft__module_t;

typedef struct weft__join weft__join_t;

struct weft_agent {
    /* identity and options */
    int rank, world_size;
    char *name;
    char *master_addr;
    int master_port;
    char *listen_host;
    char *address; /* host:port others reach us at */
    char *auth_token;
    int64_t rendezvous_timeout_ms, default_timeout_ms, peer_timeout_ms, handshake_timeout_ms;
    int handler_threads;
    uint64_t max_message_bytes;
    int port;
    bool direct_enabled;
    weft__tls_t *tls; /* NULL: plaintext */
    /* the Ed25519 key pair (hello.c) */
    void *id_key; /* EVP_PKEY */
    uint8_t id_pub[WEFT__ID_KEY_BYTES];

    _Atomic int state;
    _Atomic bool joining;     /* weft_agent_join in progress */
    weft_future_t *join_done; /* completes when the join ends, either way */
    bool shut_down;           /* weft_agent_shutdown ran */

    /* gRPC */
    grpc_completion_queue *cq;
    grpc_server *server;
    grpc_channel_args *chan_args; /* points at chan_args_s */
    grpc_channel_args chan_args_s, server_args_s;
    grpc_arg chan_arg_v[16], server_arg_v[16];

    /* the transports (route.c), by weft__tp_id_t */
    const weft__transport_t *transports[WEFT__TP_COUNT];
    /* copies large received messages out while the transport thread reads on */
    struct weft__bulk *bulk;
    /* direct TCP connections for large frames */
    struct weft__direct *direct;
    /* shared-memory rings to the ranks of this host (shm.c) */
    struct weft__shm *shm;

    /* pollers */
    pthread_mutex_t threads_mu;
    pthread_t pollers[WEFT__MAX_POLLERS];
    int npollers;
    _Atomic int blocked;
    _Atomic int server_requests; /* outstanding grpc_server_request_call */

    /* world */
    weft__peer_t *peers; /* world_size entries after join */

    /* the function registry */
    pthread_rwlock_t reg_mu;
    weft__fn_t *fns;
    /* modules (module.c): by channel, and in creation order */
    pthread_mutex_t module_mu;
    _Atomic(weft__module_t *) by_channel[WEFT_CHANNEL_MAX + 1];
    weft__module_t *modules, *modules_tail;
    /* one-way messages that came before their channel's module exists */
    pthread_mutex_t chan_mu;
    struct weft__early *early_head, *early_tail;
    int nearly;
    /* the timer service: call deadlines, handshake deadlines and every module's timed tasks */
    weft__timer_t *timer;

    /* outgoing calls */
    pthread_mutex_t pend_mu;
    pthread_cond_t pend_cv;
    weft__pending_t *pending[WEFT__PENDING_BUCKETS];
    size_t npending;
    _Atomic uint64_t next_request_id;

    /* counters for shutdown's termination detection (user traffic only) */
    _Atomic uint64_t requests_sent, requests_received;
    _Atomic int64_t calls_in_progress; /* incoming user calls not yet replied */
    _Atomic int64_t pending_user;      /* outgoing user calls not yet answered */
    pthread_cond_t passive_cv;         /* signalled (under pend_mu) when either reaches 0 */

    /* streams: every live stream, for closing */
    pthread_mutex_t streams_mu;
    pthread_cond_t streams_cv;
    int nstreams;

    /* rendezvous (rank 0) */
    weft__join_t *join;

    /* shutdown barrier (rank 0) */
    pthread_mutex_t sd_mu;
    struct weft__sd_state *sd;

    /* distributed autograd's hooks (weft_agent_set_call_hooks) */
    weft_call_hooks_t call_hooks;
    _Atomic bool has_call_hooks;
    _Atomic bool call_hooks_claimed;

    /* reference codecs and references sent to this rank itself (refs.c); made on first use */
    _Atomic(struct weft__refs *) refs;
};

/* A one-way message kept until its channel's module exists (at most WEFT__EARLY_MAX). */
#define WEFT__EARLY_MAX 65536
typedef struct weft__early {
    struct weft__early *next;
    uint32_t channel;
    int src;
    weft_value_t *v;
} weft__early_t;

/* agent.c */
/* Whether @p address ("host:port", "[v6]:port" or a bare host) is a loopback address (127/8, ::1,
 * "localhost"); a host name is not judged. */
bool weft__address_loopback(const char *address);
void weft__agent_request_more(weft_agent_t *a);
bool weft__agent_closing(const weft_agent_t *a);
void weft__agent_peer_lost(weft_agent_t *a, int rank, weft_status_t st, const char *why);
void weft__agent_track_stream(weft_agent_t *a, bool add);
void weft__agent_channel_args(weft_agent_t *a, bool server, grpc_channel_args *out,
                              grpc_arg *store);
/* Waits (bounded by the rendezvous timeout) for a join under way to end: WEFT_OK when the agent
 * is joined (or past it), else WEFT_ERR_INVALID_STATE with a text. Any thread. */
weft_status_t weft__agent_wait_joined(weft_agent_t *a);
/* The same, giving up at @p deadline_ns (a connection's handshake deadline). */
weft_status_t weft__agent_wait_joined_until(weft_agent_t *a, int64_t deadline_ns);
/* A user call finished on either side: wakes shutdown's wait for passivity. */
void weft__agent_passive_check(weft_agent_t *a);

/* module.c */
/* Delivers a one-way message to its channel's module, or keeps it until the module exists. */
void weft__channel_deliver(weft_agent_t *a, uint32_t channel, int src, weft_value_t *v);
/* The module on @p channel (NULL: none yet, or out of range). Any thread, no lock. */
weft__module_t *weft__module_at(weft_agent_t *a, uint32_t channel);
/* Every module hears of a lost peer, in creation order. */
void weft__modules_peer_lost(weft_agent_t *a, int rank, const char *why);
/* Every module's on_shutdown, in creation order, on the calling thread. */
void weft__modules_shutdown(weft_agent_t *a, int64_t deadline_ms);
/* Drops the modules' timer tasks and destroys them, last created first (transport closed). */
void weft__modules_free(weft_agent_t *a);

/* stream.c */
/* This rank's client stream to @p to, opened on first use (a reference for the caller). */
weft_status_t weft__peer_stream(weft_agent_t *a, int to, weft__stream_t **s_p);
void weft__stream_accept(weft_agent_t *a, grpc_call *call);
/* Queues a message; takes ownership of @p m (freed with a failure if the stream is dead). */
weft_status_t weft__stream_send(weft__stream_t *s, weft__outmsg_t *m);
void weft__stream_ref(weft__stream_t *s);
void weft__stream_unref(weft__stream_t *s);
void weft__stream_close(weft__stream_t *s); /* client: half-close; server: finish OK */
/* Lets go of the answers this thread holds while it runs the requests of one received
 * message (they leave together once all have run). No-op if it holds none. */
void weft__stream_uncork_current(void);
void weft__stream_cancel(weft__stream_t *s);
/* Client: waits until the stream's handshake is over (true: accepted), @p deadline_ns passes or
 * *@p stop (may be NULL) is set. */
bool weft__stream_wait_handshake(weft__stream_t *s, int64_t deadline_ns, _Atomic bool *stop);
int weft__stream_peer(const weft__stream_t *s);

/* bulk.c */
typedef struct weft__bulk weft__bulk_t;
weft_status_t weft__bulk_create(weft__bulk_t **b_p);
weft_status_t weft__bulk_submit(weft__bulk_t *b, void (*fn)(void *arg), void *arg);
/* Runs what is queued, then stops and frees the workers. */
void weft__bulk_destroy(weft__bulk_t *b);

/* direct.c */
#define WEFT__DIRECT_MIN ((size_t)64 << 10) /* frames this large take a direct connection (the crossover measured: a 64 KiB round trip 82-92 us direct, 95-105 on the stream) */
#define WEFT__DIRECT_MIN_UNORDERED                                                                 \
    ((size_t)256 << 10) /* unordered one-way frames: from this size */
typedef struct weft__direct weft__direct_t;
/* Listens for direct connections; on failure large frames simply take the stream. */
weft_status_t weft__direct_create(weft_agent_t *a, const char *bind_host, const char *adv_host);
const char *weft__direct_address(const weft_agent_t *a);
/* Frees the state (after weft__direct_transport.stop and the last thread that may look at it). */
void weft__direct_destroy(weft_agent_t *a);

/* shm.c */
typedef struct weft__shm weft__shm_t;
/* Listens for shared-memory connections of ranks on this host (WEFT_SHM=1); on failure frames take
 * the other transports. */
weft_status_t weft__shm_create(weft_agent_t *a);
/* The name this rank's listener advertises ("" none). */
const char *weft__shm_address(const weft_agent_t *a);
/* Frees the state (after weft__shm_transport.stop and the last thread that may look at it). */
void weft__shm_destroy(weft_agent_t *a);
/* Starts opening the rings to every rank of this host (after the join): frames sent meanwhile
 * wait, in order, for their ring. */
void weft__shm_open_all(weft_agent_t *a);
/* @p peer is lost (@p st, @p why): when it has a ring to this rank, the ring's reader reads what
 * was written to it until now, then declares the loss itself (true); false: declare it now. */
bool weft__shm_defer_loss(weft_agent_t *a, int peer, weft_status_t st, const char *why);

/* call.c */
/* A request from @p o's peer: runs its handler (takes @p env and @p args). */
void weft__call_dispatch(weft_agent_t *a, const weft__origin_t *o, Weft__V1__Envelope *env,
                         weft_value_t *args);
/* Answers a request that could not be accepted (@p st, text from weft_last_error()). */
void weft__call_refuse(weft_agent_t *a, const weft__origin_t *o, const Weft__V1__Envelope *env,
                       weft_status_t st);
/* A response from @p o's peer (takes @p env and @p v; @p st: the frame was refused). */
void weft__call_response(weft_agent_t *a, const weft__origin_t *o, Weft__V1__Envelope *env,
                         weft_value_t *v, weft_status_t st);
void weft__pending_fail_peer(weft_agent_t *a, int rank, weft_status_t st, const char *why);
void weft__pending_fail_all(weft_agent_t *a, weft_status_t st, const char *why);
weft_status_t weft__rpc_async(weft_agent_t *a, int to, const char *fn, const weft_value_t *args,
                              int64_t timeout_ms, bool internal, weft_future_t **f_p);
/* A direct reader about to receive the answer to call @p id from @p peer: true when the call
 * asked for its result to land (weft_rpc_async_into); *into_p (free with weft_free) and *n_p
 * then say where, and the call is claimed (it neither times out nor fails while the bytes are
 * written) until weft__pending_unclaim. */
bool weft__pending_claim(weft_agent_t *a, uint64_t id, int peer, int tp, weft_rpc_into_t **into_p,
                         size_t *n_p);
/* The reader is done writing: @p delivered, the frame goes on to the delivery (which answers the
 * call; until then it stays claimed, so that weft_rpc_withdraw_into cannot return true for a
 * result that wraps the caller's memory); otherwise (the connection broke) a deadline or failure
 * that came meanwhile finishes it. */
void weft__pending_unclaim(weft_agent_t *a, uint64_t id, bool delivered);
/* A call's timeout argument: > 0 as given (at most 30 days), 0 the agent's default; negative is
 * WEFT_ERR_INVALID_ARG. */
weft_status_t weft__call_timeout(const weft_agent_t *a, int64_t timeout_ms, int64_t *ms_p);

/* The thread's distributed autograd context (call.c). */
extern _Thread_local uint64_t weft__thread_ag_context;
/* Tells distributed autograd that a recorded frame gets no gradient (call.c). */
void weft__call_ag_dead(weft_agent_t *a, uint64_t context, uint64_t message);
/* Runs the autograd hook on a received request or answer with a context (call.c). */
weft_status_t weft__call_ag_recv(weft_agent_t *a, const Weft__V1__Envelope *env, int from,
                                 const char *fn, bool reply, weft_value_t **v_p);

/* rendezvous.c */
void weft__join_init(weft_agent_t *a);
void weft__join_accept(weft_agent_t *a, grpc_call *call);
weft_status_t weft__rendezvous(weft_agent_t *a);
void weft__join_free(weft_agent_t *a);

/* shutdown.c */
/* Rank 0's count of live ranks forgets @p rank. */
void weft__shutdown_peer_lost(weft_agent_t *a, int rank);
weft_status_t weft__shutdown_barrier(weft_agent_t *a, int64_t deadline_ns);
void weft__shutdown_register(weft_agent_t *a);
void weft__shutdown_free(weft_agent_t *a);

/* refs.c: the codecs of modules (module.c checks, then registers, under module_mu) */
weft_status_t weft__refs_check_codec(weft_agent_t *a, const weft_ref_codec_t *codec);
void weft__refs_register(weft_agent_t *a, const weft_ref_codec_t *codec, void *state);
/* refs.c: references (weft_value_add_ref) in messages. To another rank each travels as
 * Envelope.refs[i] = {kind, codec's encode(obj)}; to this rank itself as {kind, 8-byte token} of
 * the object kept, retained, in a table of the agent until the receiving side takes it. */
#define WEFT__MAX_REFS      4096 /* references in one message */
#define WEFT__MAX_REF_BYTES 4096 /* bytes of one encoded reference */
typedef struct weft__refs_out weft__refs_out_t;
/* Encodes the references of @p v (may be NULL) for a message to @p to into @p env (its refs
 * point into *out_p, NULL when there are none, until the record is freed). On failure nothing is
 * left (unsent ran for what was encoded). WEFT_ERR_UNSUPPORTED (a kind without a codec),
 * WEFT_ERR_TOO_LARGE (too many, or an encoding over WEFT__MAX_REF_BYTES), a codec's status. */
weft_status_t weft__refs_encode(weft_agent_t *a, int to, const weft_value_t *v,
                                Weft__V1__Envelope *env, weft__refs_out_t **out_p);
/* Frees the record of a message that was sent (@p sent) or was not (then codecs' unsent run and
 * objects kept for this rank are dropped). NULL is a no-op. Any thread. */
void weft__refs_out_free(weft__refs_out_t *o, bool sent);
/* Decodes the references of a received REQUEST or RESPONSE (@p env) from @p src into @p v.
 * Futures of objects not ready yet go to *ready_p (an array; the caller releases each future and
 * frees the array), their count to *nready_p. On failure (WEFT_ERR_PROTOCOL: unknown kind, bad
 * data, over the bounds; a codec's status) every reference was still offered to its codec, the
 * decoded objects are in @p v (the caller frees it) and no future is returned. */
weft_status_t weft__refs_decode(weft_agent_t *a, int src, const Weft__V1__Envelope *env,
                                weft_value_t *v, weft_future_t ***ready_p, size_t *nready_p);
/* ONEWAY frames on a stream: weft__reader_body keeps the frame's references in the value as they
 * came (weft__refs_keep_raw); weft__channel_deliver decodes them (weft__refs_decode_raw: futures
 * are released, not awaited, so that the channel's order holds). */
weft_status_t weft__refs_keep_raw(const Weft__V1__Envelope *env, weft_value_t *v);
weft_status_t weft__refs_decode_raw(weft_agent_t *a, int src, weft_value_t *v);
/* Calls @p cb once every future of @p futs (n > 0; takes their references and the array) has
 * completed: WEFT_OK, or the status and text of the first that failed. Runs on the thread that
 * completes the last one (at once on this thread if all have). */
typedef void (*weft__refs_ready_cb_t)(weft_status_t st, const char *text, void *arg);
void weft__refs_when_ready(weft_future_t **futs, size_t n, weft__refs_ready_cb_t cb, void *arg);
/* Drops the codecs and the objects still kept for this rank (at weft_agent_free, transport gone).
 */
void weft__refs_free(weft_agent_t *a);

#endif
