/* The module kit: how a module above the RPC layer (rref, collectives, the parameter server,
 * distributed autograd, a module of your own) plugs into an agent. A module registers one
 * descriptor; the agent then creates its per-agent state once, delivers the one-way messages of its
 * channel, asks it where large message data lands, tells it about lost peers and about shutdown,
 * carries its references inside values, runs its timed tasks on the agent's one timer thread, and
 * frees it last. Programs that only call functions need rpc.h, not this header. */
#ifndef WEFT_MODULE_H
#define WEFT_MODULE_H

#include <weft/api.h>

/* Layering (docs/architecture.md): only rpc and the modules above it may include this. */
#if defined(WEFT_BUILDING) && !defined(WEFT_SEES_RPC)
#error "weft/module.h is above the module being built: dependencies point downward only"
#endif

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <weft/future.h>
#include <weft/rpc.h>
#include <weft/value.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ channels */

/**
 * Each module speaks on a channel of its own: one-way messages over the agent's connections,
 * ordered per peer. Ids 1..63 are weft's modules' (WEFT_CHANNEL_*); 64..WEFT_CHANNEL_MAX are free.
 */
enum {
    WEFT_CHANNEL_RREF = 1,
    WEFT_CHANNEL_COLLECTIVES = 2,
    WEFT_CHANNEL_PS = 3,
    WEFT_CHANNEL_AUTOGRAD = 4,
    WEFT_CHANNEL_MAX = 1023,
};

/**
 * Where the data of an incoming one-way message lands (see weft_module_desc_t.lander). With
 * @p sink NULL its bytes are received straight into @p dst; otherwise they are received into a
 * small buffer of the transport's and handed to @p sink piece by piece (@p off: their offset in
 * the data). @p done then runs once, with true when every byte landed (the message follows, to
 * on_message, without its tensor), false when the connection broke (no message follows).
 */
typedef struct {
    void *dst;
    void (*sink)(void *arg, size_t off, const void *bytes, size_t n);
    void (*done)(void *arg, bool landed);
    void *arg;
} weft_landing_t;

/*
 * Reference codecs: how the objects of a kind (weft_value_add_ref) cross the wire inside the
 * arguments and results of calls and inside one-way messages. The rref module has the codec of
 * WEFT_REF_KIND_RREF; the agent knows nothing about what it carries. @p state is the module's.
 */
typedef struct {
    /**
     * Encodes @p obj for a message to @p to_rank, while the message is built on the sending
     * thread (the caller of weft_rpc_async/weft_agent_send, or of weft_call_reply for a result;
     * it may record that the object is being sent, e.g. a fork). Never called for the calling
     * rank itself. *bytes_p (at most 4096 bytes) is allocated with weft_alloc; the agent frees
     * it. An error fails the send (the caller sees the status; a result is answered with it):
     * then unsent runs for the objects encoded before.
     */
    weft_status_t (*encode)(void *state, weft_agent_t *a, int to_rank, void *obj, void **bytes_p,
                            size_t *len_p);
    /**
     * The message that carried @p obj, encoded as @p bytes for @p to_rank, was not sent after
     * all (the send failed before the message left this process: an error returned by the send,
     * a message over the receiver's limit, a later reference that failed to encode, a peer lost
     * or a connection that broke before the message was handed to it): undo what encode
     * recorded. Called once per encoded object of such a message, on the sending thread or on a
     * transport thread; must not block. May be NULL.
     */
    void (*unsent)(void *state, weft_agent_t *a, int to_rank, void *obj, const void *bytes,
                   size_t len);
    /**
     * Decodes an object that came from @p src_rank (never the calling rank itself), on a
     * transport thread; must not block. *obj_p gets one reference. *ready_p is NULL when the
     * object is usable at once, or a future (the codec's reference, released by the agent) that
     * completes when it is: a request's handler runs only once every object of its arguments is
     * ready, and a failed future fails the request with its status and text (the objects of a
     * response or a one-way message are delivered without waiting). An error fails the request
     * (or the call whose response it was; a one-way message is dropped) with that status; the
     * message's other references are still decoded, then released.
     */
    weft_status_t (*decode)(void *state, weft_agent_t *a, int src_rank, const void *bytes,
                            size_t len, void **obj_p, weft_future_t **ready_p);
    /** retain/release of the decoded objects; type->kind is the codec's kind (1..15). */
    const weft_value_ref_type_t *type;
} weft_ref_codec_t;

/**
 * A module, described once (usually a static const). Every callback but create is optional
 * (NULL) and gets the state that create made. Callbacks that run on a transport thread must not
 * block: they hand long work to a thread or a future of their own.
 */
typedef struct {
    /** Names the module in logs and errors ("rref"). */
    const char *name;
    /** Its channel, 1..WEFT_CHANNEL_MAX, one module per channel and agent. */
    uint32_t channel;
    /**
     * Makes the module's state for @p a, on the first weft_agent_module call for this channel,
     * once, under the agent's module lock (it may call weft_rpc_register and the functions of
     * this header, but not weft_agent_module for its own channel). An error leaves nothing
     * registered; the next weft_agent_module call tries again.
     */
    weft_status_t (*create)(weft_agent_t *a, void **state_p);
    /**
     * Frees the state at weft_agent_free, after the transport is closed (no callback of this
     * descriptor runs any more) and every timer task the state owns is dropped; modules are
     * freed in the reverse order of their creation.
     */
    void (*destroy)(void *state);
    /**
     * A one-way message on the channel from @p src_rank; takes ownership of @p msg. Runs on a
     * transport thread, in the order the peer sent (unordered sends excepted). From a rank of
     * this host (a shared-memory ring) a callback that blocks in a weft wait hands the ring to
     * another thread first, so the next message may start before it returns: a module that
     * needs its messages strictly one after another does not wait in this callback. Messages that
     * arrive before the module exists on this rank are kept (up to 65536) and delivered, in
     * order, right after create. NULL: messages on the channel are dropped.
     */
    void (*on_message)(void *state, int src_rank, weft_value_t *msg);
    /**
     * Asked, on a transport thread, where the one tensor of a one-way message on a direct
     * connection should land, before its bytes are read: @p payload (borrowed, @p len bytes) is
     * the message's payload, @p dtype and @p numel the tensor's. Fills @p landing_p and returns
     * true to take the bytes, or returns false (the message then arrives as usual, with a fresh
     * tensor). Must not block.
     */
    bool (*lander)(void *state, int src_rank, const void *payload, size_t len, weft_dtype_t dtype,
                   int64_t numel, weft_landing_t *landing_p);
    /**
     * @p rank was lost (once per rank; never for ranks that left in shutdown). Runs on the thread
     * that noticed (a transport thread, or the timer's); must not block.
     */
    void (*on_peer_lost)(void *state, int rank, const char *why);
    /**
     * Called by weft_agent_shutdown on the calling thread before the ranks agree to stop (the RPC
     * layer still works): the module settles its state (rref waits until every reference is
     * confirmed and deleted). @p deadline_ms is the shutdown's deadline on CLOCK_MONOTONIC in
     * milliseconds. Modules are asked in the order they were created (one created meanwhile is
     * asked too). A non-OK status is logged and shutdown goes on.
     */
    weft_status_t (*on_shutdown)(void *state, int64_t deadline_ms);
    /** The codec of the references this module puts in values (NULL: none). Copied. */
    const weft_ref_codec_t *codec;
} weft_module_desc_t;

/**
 * Distributed autograd's marks on one call or answer (Envelope fields 14-16, docs/protocol.md
 * section 8): the sender's context, its send function for the frame, and which of the value's
 * tensors carry gradients.
 */
typedef struct {
    uint64_t context; /**< the context (0: none) */
    uint64_t message; /**< the sender's send function for this frame (0: none) */
    uint32_t *grads;  /**< tensor indices; on_send allocates them with weft_alloc, rpc frees them */
    size_t n_grads;
} weft_call_autograd_t;

/**
 * Hooks of the module that records calls for distributed autograd (one per agent). rpc calls
 * on_send for every request made while the calling thread is in a context
 * (weft_rpc_thread_context; a module's own calls, under "__weft.", carry none, but for rref's)
 * and every answer to a request that came with one, before the frame is
 * encoded: it fills @p ag (context already set) or fails the send with its status. rpc calls
 * on_recv for every request or answer that came with a context, before the handler runs or the
 * caller's future completes, with the value (NULL: none) whose tensors it may attach nodes to; a
 * failure fails the call with its status. Handlers run with the request's context as their
 * thread's, and the answer carries it, from whatever thread it is given.
 */
typedef struct {
    weft_status_t (*on_send)(void *arg, int to, const char *fn, bool reply, const weft_value_t *v,
                             weft_call_autograd_t *ag);
    weft_status_t (*on_recv)(void *arg, int from, const char *fn, bool reply,
                             const weft_call_autograd_t *ag, weft_value_t *v);
    /**
     * A frame on_send marked (@p message of @p context) will get no gradient: it was not sent
     * after all, or its call failed (an error answer, a deadline, a lost peer). Any thread.
     */
    void (*on_dead)(void *arg, uint64_t context, uint64_t message);
    void *arg;
} weft_call_hooks_t;

/**
 * Sets @p a's call hooks (once; before the agent joins, so that no call is missed).
 * @return WEFT_ERR_INVALID_ARG, WEFT_ERR_ALREADY_EXISTS.
 */
WEFT_API weft_status_t weft_agent_set_call_hooks(weft_agent_t *a, const weft_call_hooks_t *hooks);
/** The calling thread's distributed autograd context (0: none); calls made now carry it. */
WEFT_API uint64_t weft_rpc_thread_context(void);
/** Sets the calling thread's context (0: none) and returns the one it had. */
WEFT_API uint64_t weft_rpc_set_thread_context(uint64_t context);
/** The context a call came with (0: none); its handler runs with it as its thread's. */
WEFT_API uint64_t weft_call_context(const weft_call_t *call);

/**
 * The state of the module @p desc on @p a, created on first use (see create) and freed with the
 * agent. Later calls with the same descriptor return the same state. Create a module with a codec
 * before weft_agent_join: a peer's message may carry its references as soon as the world forms,
 * and a reference of a kind without a codec is refused. Thread-safe.
 * @return WEFT_ERR_INVALID_ARG (no create, a channel out of range, a codec without encode, decode
 *         or type, or of a kind out of 1..15), WEFT_ERR_ALREADY_EXISTS (another module has the
 *         channel or the codec's kind), WEFT_ERR_SHUTDOWN (the agent is closed), or create's
 *         status.
 */
WEFT_API weft_status_t weft_agent_module(weft_agent_t *a, const weft_module_desc_t *desc,
                                         void **state_p);

/**
 * Sends @p msg to @p to_rank's module on @p channel; borrowed as in weft_rpc_async (tensor bytes
 * are sent without copying: do not modify them until @p sent_p completes). Messages to one peer
 * arrive in the order sent. If @p sent_p is not NULL it gets a future that completes once the
 * message has been handed to the transport (or failed: WEFT_ERR_PEER_LOST, ...). Thread-safe.
 * @return WEFT_ERR_INVALID_ARG, WEFT_ERR_TOO_LARGE (over the receiver's limit), WEFT_ERR_SHUTDOWN,
 *         WEFT_ERR_PEER_LOST, a codec's status; then nothing was sent and no future is made.
 */
WEFT_API weft_status_t weft_agent_send(weft_agent_t *a, int to_rank, uint32_t channel,
                                       const weft_value_t *msg, weft_future_t **sent_p);

/** The message may overtake, or be overtaken by, other messages to the same peer. */
#define WEFT_SEND_UNORDERED 1u
/**
 * The calling thread may write the message itself when its connection is idle (saving a hand-off
 * to the transport's thread): the call may then block until the bytes are in the socket. With
 * WEFT_SEND_UNORDERED only.
 */
#define WEFT_SEND_INLINE 2u
/**
 * weft_agent_send with @p flags. An unordered message of 256 KiB or more may travel on the direct
 * connection to the peer (received straight into its tensors, or where the module's lander says);
 * use it for messages the receiver matches by their contents, not by arrival order. Thread-safe.
 */
WEFT_API weft_status_t weft_agent_send_flags(weft_agent_t *a, int to_rank, uint32_t channel,
                                             const weft_value_t *msg, uint32_t flags,
                                             weft_future_t **sent_p);

/**
 * Delivers on this thread the one-way messages for @p channel's module that have arrived whole
 * on this rank's shared-memory rings and come next in them (a ring's order is kept: it stops at
 * a frame for anything else, or one not all there yet). A module whose thread polls for its own
 * messages calls it while it spins: the messages then reach it without a thread hand-off. Never
 * blocks; runs nothing but @p channel's module (its on_message or lander, which must not block).
 * Returns how many it delivered (0: none, or no rings). Thread-safe.
 */
WEFT_API size_t weft_agent_poll_channel(weft_agent_t *a, uint32_t channel);

/* ------------------------------------------------------------------ the timer */

/** A timed task; @p arg and @p data are what was given to weft_agent_timer_add. */
typedef void (*weft_timer_cb_t)(void *arg, uint64_t data);

/**
 * Runs @p run(@p arg, @p data) on the agent's timer thread after @p delay_us (<= 0: as soon as it
 * can). One thread serves every module of the agent: a task must not block. @p drop (may be NULL)
 * runs instead when the task will never run: @p owner was cancelled (a module's state is its
 * owner: its tasks are dropped before its destroy), or the agent was freed. Thread-safe.
 * @return the task's id (> 0) for weft_agent_timer_cancel, or 0 when it could not be queued
 *         (@p drop has run).
 */
WEFT_API uint64_t weft_agent_timer_add(weft_agent_t *a, int64_t delay_us, weft_timer_cb_t run,
                                       weft_timer_cb_t drop, void *arg, uint64_t data,
                                       const void *owner);
/**
 * Takes task @p id out before it runs: true when it did (neither run nor drop will be called),
 * false when the task has run, is running or is unknown. Thread-safe.
 */
WEFT_API bool weft_agent_timer_cancel(weft_agent_t *a, uint64_t id);
/**
 * Drops every task of @p owner (their drop runs) and waits until none of them is running (unless
 * called from that task). Afterwards no task of @p owner runs. Thread-safe.
 */
WEFT_API void weft_agent_timer_cancel_owner(weft_agent_t *a, const void *owner);

/* ------------------------------------------------------------------ header + body messages */

struct ProtobufCMessage;
struct ProtobufCMessageDescriptor;

/**
 * A module message: a protobuf header (the module's own message type) and a body (payload,
 * tensors and references of a value), framed as payload = [u32 LE header length][header][body
 * payload], tensors and references = the body's. Packs @p hdr and @p body (borrowed; NULL: no
 * body) into a new value @p msg_p (tensors shared, references retained, payload copied). Caller
 * frees it with weft_value_free. Thread-safe.
 * @return WEFT_ERR_NO_MEMORY, WEFT_ERR_TOO_LARGE (a header over 16 MiB).
 */
WEFT_API weft_status_t weft_msg_pack(const struct ProtobufCMessage *hdr, const weft_value_t *body,
                                     weft_value_t **msg_p);
/**
 * Unpacks the header of a message made by weft_msg_pack, as @p desc's type, into @p hdr_p (free
 * with weft_msg_header_free); @p body_off_p (may be NULL) gets the offset of the body's payload in
 * the message's payload. Thread-safe.
 * @return WEFT_ERR_PROTOCOL (no frame, a length past the payload, a header that does not decode).
 */
WEFT_API weft_status_t weft_msg_unpack(const weft_value_t *msg,
                                       const struct ProtobufCMessageDescriptor *desc,
                                       struct ProtobufCMessage **hdr_p, size_t *body_off_p);
/** The same from a message's raw payload (a lander sees only the payload). */
WEFT_API weft_status_t weft_msg_unpack_payload(const void *payload, size_t len,
                                               const struct ProtobufCMessageDescriptor *desc,
                                               struct ProtobufCMessage **hdr_p, size_t *body_off_p);
/** Frees a header from weft_msg_unpack. NULL is a no-op. */
WEFT_API void weft_msg_header_free(struct ProtobufCMessage *hdr);
/**
 * The body of a message as a value of its own: the payload after the header (copied), the
 * message's tensors (shared) and references (retained). Caller frees it with weft_value_free.
 * @return WEFT_ERR_PROTOCOL (not a framed message), WEFT_ERR_NO_MEMORY.
 */
WEFT_API weft_status_t weft_msg_body(const weft_value_t *msg, weft_value_t **body_p);

#ifdef __cplusplus
}
#endif
#endif
