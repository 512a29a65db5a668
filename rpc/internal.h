/* rpc internals: agent, streams, wire codec. Not installed. */
#ifndef WEFT_RPC_INTERNAL_H
#define WEFT_RPC_INTERNAL_H

#if defined(WEFT_BUILDING) && !defined(WEFT_IN_RPC)
#error "rpc/internal.h is internal to rpc: other modules use its public or module API"
#endif

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/support/alloc.h>
#include <stdio.h>
#include <string.h>

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

/* ------------------------------------------------------------------ wire */

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
} weft__outmsg_t;

/* A decoded message. */
typedef struct {
    Weft__V1__Envelope *env;
    weft_value_t *value; /* NULL until weft__wire_decode_body */
} weft__inmsg_t;


/* Encodes env + value (tensor bytes as zero-copy slices that hold tensor
 * references). Fills env->payload_bytes and env->tensors itself. */
weft_status_t weft__wire_encode(Weft__V1__Envelope *env, const weft_value_t *v,
                                weft__outmsg_t **msg_p);
void weft__outmsg_free(weft__outmsg_t *m, weft_status_t fail_status, const char *why);

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
    uint64_t body_left; /* of the frame whose envelope was read last */
} weft__reader_t;

weft_status_t weft__reader_init(weft__reader_t *r, grpc_byte_buffer *bb);
void weft__reader_destroy(weft__reader_t *r);
bool weft__reader_more(const weft__reader_t *r);
/* Reads and validates the next frame's envelope. On an error found after the
 * envelope decoded, *env_p is still set (the caller answers its request id
 * and frees it); when *env_p is NULL the rest of the message cannot be framed. */
weft_status_t weft__reader_envelope(weft__reader_t *r, uint64_t max_bytes,
                                    Weft__V1__Envelope **env_p);
/* Copies the frame's payload and tensors into a new value (one copy); a ONEWAY frame's
 * references go in as they came (weft__refs_keep_raw). */
weft_status_t weft__reader_body(weft__reader_t *r, const Weft__V1__Envelope *env,
                                weft_value_t **v_p);
weft_status_t weft__reader_skip_body(weft__reader_t *r);
/* Validates a frame's tensor headers; the body length goes to @p body_p. */
weft_status_t weft__wire_check_frame(const Weft__V1__Envelope *env, uint64_t *body_p);
/* Packs a standalone protobuf message into a byte buffer (Hello / WorldMap). */
grpc_byte_buffer *weft__wire_pack(const ProtobufCMessage *m);
/* Copies a whole byte buffer into one allocation (small control messages). */
weft_status_t weft__wire_flatten(grpc_byte_buffer *bb, size_t max, uint8_t **buf_p, size_t *len_p);
/* grpc status -> weft status, once, at the boundary. */
weft_status_t weft__grpc_status(grpc_status_code code);

/* ---------------------------------------------------------------- streams */

typedef struct weft__stream weft__stream_t;

typedef struct weft__peer {
    int rank;
    char *name;
    char *address;
    uint64_t max_message_bytes;
    char *direct_address; /* its listener for large frames; "" if none */
    pthread_mutex_t mu;
    grpc_channel *channel;  /* created on first use */
    weft__stream_t *stream; /* our client stream to this peer */
    bool lost;
    char *lost_why;
} weft__peer_t;

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
    int64_t deadline_ns;
    weft_future_t *f;
    char *fn;
    bool internal;
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
    int64_t rendezvous_timeout_ms, default_timeout_ms, peer_timeout_ms;
    int handler_threads;
    uint64_t max_message_bytes;
    int port;

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

    /* copies large received messages out while the transport thread reads on */
    struct weft__bulk *bulk;
    /* direct TCP connections for large frames */
    struct weft__direct *direct;

    /* pollers */
    pthread_mutex_t threads_mu;
    pthread_t pollers[WEFT__MAX_POLLERS];
    int npollers;
    _Atomic int blocked;
    _Atomic int64_t next_sweep_ns;
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
    /* the timer service: call deadlines and every module's timed tasks */
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

    /* streams: every live stream, for closing */
    pthread_mutex_t streams_mu;
    pthread_cond_t streams_cv;
    weft__stream_t *streams;
    int nstreams;

    /* rendezvous (rank 0) */
    weft__join_t *join;

    /* shutdown barrier (rank 0) */
    pthread_mutex_t sd_mu;
    struct weft__sd_state *sd;

    /* reference codecs and references sent to this rank itself (refs.c); made on first use */
    _Atomic(struct weft__refs *) refs;
};

/* A one-way message kept until its channel is registered (at most WEFT__EARLY_MAX). */
#define WEFT__EARLY_MAX 65536
typedef struct weft__early {
    struct weft__early *next;
    uint32_t channel;
    int src;
    weft_value_t *v;
} weft__early_t;
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

/* agent.c */
void weft__agent_request_more(weft_agent_t *a);
bool weft__agent_closing(const weft_agent_t *a);
void weft__agent_peer_lost(weft_agent_t *a, int rank, weft_status_t st, const char *why);
void weft__agent_track_stream(weft_agent_t *a, weft__stream_t *s, bool add);
void weft__agent_channel_args(weft_agent_t *a, bool server, grpc_channel_args *out,
                              grpc_arg *store);

/* stream.c */
weft_status_t weft__stream_open(weft_agent_t *a, weft__peer_t *p, weft__stream_t **s_p);
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
int weft__stream_peer(const weft__stream_t *s);
uint64_t weft__stream_peer_max(const weft__stream_t *s);

/* bulk.c */
typedef struct weft__bulk weft__bulk_t;
weft_status_t weft__bulk_create(weft__bulk_t **b_p);
weft_status_t weft__bulk_submit(weft__bulk_t *b, void (*fn)(void *arg), void *arg);
/* Runs what is queued, then stops and frees the workers. */
void weft__bulk_destroy(weft__bulk_t *b);

/* direct.c */
#define WEFT__DIRECT_MIN ((size_t)1 << 20) /* frames this large take a direct connection */
#define WEFT__DIRECT_MIN_UNORDERED                                                                 \
    ((size_t)256 << 10) /* unordered one-way frames: from this size */
typedef struct weft__direct weft__direct_t;
/* Listens for direct connections; on failure large frames simply take the stream. */
weft_status_t weft__direct_create(weft_agent_t *a, const char *bind_host, const char *adv_host);
const char *weft__direct_address(const weft_agent_t *a);
bool weft__direct_usable(weft_agent_t *a, int peer, size_t nbytes);
/* Whether @p peer can be reached directly at all (frames of any size). */
bool weft__direct_available(weft_agent_t *a, int peer);
/* Queues @p m (takes it) for the peer's direct connection. */
weft_status_t weft__direct_send(weft_agent_t *a, int peer, weft__outmsg_t *m);
/* The same; with @p write_here, a connection that is open and idle is written from the
 * calling thread (which may block until the bytes are in the socket). */
weft_status_t weft__direct_send_ex(weft_agent_t *a, int peer, weft__outmsg_t *m, bool write_here);
/* Stops the threads and closes the sockets (first thing at free); the state stays
 * readable until weft__direct_destroy, after the last thread that may look at it. */
void weft__direct_stop(weft_agent_t *a);
void weft__direct_destroy(weft_agent_t *a);
/* The peer is lost: nothing more is sent to it directly. */
void weft__direct_cut(weft_agent_t *a, int peer);

/* call.c */
/* Takes ownership of @p env and @p args. */
void weft__call_dispatch(weft_agent_t *a, weft__stream_t *s, Weft__V1__Envelope *env,
                         weft_value_t *args);
/* The same for a request that came without a stream (direct): @p peer is the caller. */
void weft__call_dispatch_from(weft_agent_t *a, weft__stream_t *s, int peer, Weft__V1__Envelope *env,
                              weft_value_t *args);
void weft__call_response(weft_agent_t *a, int peer, Weft__V1__Envelope *env, weft_value_t *v);
void weft__pending_fail_peer(weft_agent_t *a, int rank, weft_status_t st, const char *why);
void weft__pending_sweep(weft_agent_t *a);
void weft__pending_fail_id(weft_agent_t *a, int peer, uint64_t id, weft_status_t st,
                           const char *why);
void weft__pending_fail_all(weft_agent_t *a, weft_status_t st, const char *why);
weft_status_t weft__rpc_async(weft_agent_t *a, int to, const char *fn, const weft_value_t *args,
                              int64_t timeout_ms, bool internal, weft_future_t **f_p);
weft_status_t weft__peer_stream(weft_agent_t *a, int to, weft__stream_t **s_p);

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
