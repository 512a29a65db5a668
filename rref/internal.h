/* rref internals: the per-agent context, owner and user references, control messages. Timed
 * work (retries, delayed sends, deadlines) runs on the agent's timer, owned by the context. Not
 * installed. docs/rref.md describes the protocol. */
#ifndef WEFT_RREF_INTERNAL_H
#define WEFT_RREF_INTERNAL_H

#if defined(WEFT_BUILDING) && !defined(WEFT_IN_RREF)
#error "rref/internal.h is internal to rref: other modules use its public or module API"
#endif

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include <weft/rref.h>
#include <weft/module.h>
#include <weft/rpc.h>

#include "../core/internal.h"
#include "rref.pb-c.h"
#include "weft_pb.h"

/* RPC functions every agent with the module registers (user traffic: counted by shutdown). */
#define RREF_FN_REMOTE "weft.rref.remote"
#define RREF_FN_FETCH  "weft.rref.fetch"
#define RREF_FN_METHOD "weft.rref.method"

#define RREF_MAX_NAME       255
#define RREF_OWNER_BUCKETS  1024
#define RREF_FREED_RING     4096   /* ids of freed owner entries remembered */
#define RREF_ORPHAN_MAX     65536  /* deletes of unknown references remembered */
#define RREF_ORPHAN_TTL_MS  600000 /* ... for this long */
#define RREF_RETRY_FIRST_MS 1000   /* a control message without ACK is sent again after */
#define RREF_RETRY_MAX_MS   5000
#define RREF_BACKOFF_MS     5 /* first wait after an ACK "not known yet" */
#define RREF_BACKOFF_MAX_MS 200
#define RREF_EAGER_MARGIN   4096 /* room left in a message for the frame around such a value */
#define RREF_MAX_TIMEOUT_MS (1000LL * 3600 * 24 * 30) /* deadlines are clamped to 30 days */

typedef struct rref_ctx rref_ctx_t;

typedef enum {
    RREF_OWNER = 1,
    RREF_USER = 2,
} rref_role_t;

/* A registered object type. */
typedef struct rref_type {
    struct rref_type *next;
    char *name;
    weft_rref_ctor_cb_t ctor;
    weft_rref_dtor_cb_t dtor;
    weft_rref_method_t *methods; /* names copied */
    int n_methods;
    void *arg;
} rref_type_t;

/* A fork known to an owner, with the rank that holds it. */
typedef struct {
    weft_rref_id_t fork;
    int holder;
} rref_fork_t;

/*
 * One local reference: an owner entry (the value lives here) or a user reference (one fork).
 * refs counts local handles: the program's, those of values that contain it, and the module's
 * holds (a pending confirmation, a pending child, an operation in flight). Every field is guarded
 * by ctx->mu, except the value and object of an owner, which are written once before `ready`
 * completes and read after.
 */
struct weft_rref {
    rref_ctx_t *ctx;
    rref_role_t role;
    weft_rref_id_t id;
    int owner;
    char *type;       /* object type name; NULL for a value */
    char *created_by; /* function, type or method that created it */
    int64_t refs;
    struct weft_rref *next, *prev; /* the users list, or an owner bucket's chain */
    /* Completes when usable. User: with the creation's outcome (remote) or the confirmation's
     * (forks). Owner: when the value is set (or its creation failed). */
    weft_future_t *ready;

    /* user */
    weft_rref_id_t fork;
    int parent;
    bool confirmed;    /* the owner knows this fork */
    bool maybe_known;  /* the creating call failed after it may have reached the owner */
    bool created_here; /* made by this worker's remote(): uses may overtake the creation's answer */
    bool pending;      /* a confirmation (fork request or creation) is in flight */
    bool owner_lost;
    bool eager_asked;           /* remote() asked for a small value in the creation's answer */
    bool forked;                /* a fork of it was sent: later uses fetch what the owner holds */
    weft_value_t *eager;        /* the value of the creation's answer, while the answer settles */
    int64_t create_deadline_ms; /* remote(): the creating call's deadline */
    bool detached;              /* reported as a leak and released at shutdown */
    bool listed;                /* in ctx->users */

    /* owner */
    weft_value_t *value;
    void *obj;
    const rref_type_t *rtype;
    rref_fork_t *forks;
    size_t nforks, capforks;
    weft_rref_id_t *tombs; /* deleted forks: a late duplicate FORK_REQUEST does not revive one */
    size_t ntombs, captombs;
    bool in_map;
    /* A placeholder: a call carrying the reference home overtook its creation (they run on
     * different handler threads); the creation fills it, or it expires (rref__placeholder_*). */
    bool awaiting_creation;
};

/* A fork sent by a user and not yet accepted by its receiver (G2: its parent stays alive). */
typedef struct rref_child {
    struct rref_child *next;
    weft_rref_id_t fork;
    int holder;
    weft_rref_t *parent; /* held */
} rref_child_t;

/* A delete that came for a reference this owner does not know (yet): its creation may come. */
typedef struct rref_orphan {
    struct rref_orphan *next;
    weft_rref_id_t id, fork;
    int64_t at_ms;
} rref_orphan_t;

typedef void (*rref_ctl_done_cb_t)(rref_ctx_t *ctx, weft_status_t st, const char *why, void *arg);

/* A control message in flight, until its ACK. */
typedef struct rref_ctl {
    struct rref_ctl *next;
    uint64_t msg_id;
    uint64_t gen;  /* the armed retry task (its data): only that one may act */
    uint64_t task; /* its id on the agent's timer, cancelled when the message settles */
    Weft__V1__RRefMsgKind kind;
    int to;
    weft_rref_id_t id, fork;
    int64_t deadline_ms;
    int64_t retry_ms, backoff_ms;
    rref_ctl_done_cb_t done;
    void *arg;
} rref_ctl_t;

struct rref_ctx {
    weft_agent_t *a;
    int rank, world;
    _Atomic int64_t nrefs; /* the module's, plus one per reference struct */
    _Atomic uint64_t next_local;
    int64_t ctl_timeout_ms; /* the agent's default call timeout: control messages, timeouts of 0 */

    pthread_mutex_t mu;
    pthread_cond_t settle_cv; /* shutdown's wait: a count of wait_settled went down */
    int settle_waiters;
    bool dead; /* the agent is being freed: no more messages */
    rref_type_t *types;
    weft_rref_t *owners[RREF_OWNER_BUCKETS];
    size_t nowners, nforks;
    uint64_t deleted_owners;
    weft_rref_t *users;
    size_t nusers;
    rref_child_t *children;
    size_t nchildren;
    rref_ctl_t *ctls;
    size_t nctls;
    uint64_t next_msg;
    uint64_t next_gen; /* retry tasks armed */
    weft_rref_id_t freed[RREF_FREED_RING];
    size_t nfreed, freed_next;
    rref_orphan_t *orphans;
    size_t norphans;
    uint64_t leaks;
    bool *lost;
    int64_t eager_max; /* remote(): values up to this size come with the creation's answer */
    _Atomic uint64_t fetches_served, values_sent_with_creation; /* as owner (debug info) */

    /* fault injection (tests): WEFT_RREF_FAULT_DELAY_US, WEFT_RREF_FAULT_DUP */
    int64_t fault_delay_us;
    bool fault_dup;
    _Atomic uint64_t rng;
};

/* context.c */
weft_status_t rref__ctx(weft_agent_t *a, rref_ctx_t **ctx_p);
void rref__ctx_ref(rref_ctx_t *ctx);
void rref__ctx_unref(rref_ctx_t *ctx);
weft_rref_id_t rref__new_id(rref_ctx_t *ctx);
/* Timed work goes on the agent's timer with the context as its owner:
 *   weft_agent_timer_add(ctx->a, delay_us, run, drop, arg, data, ctx)
 * The kit drops the context's tasks before the module's destroy (and the agent's timer drops
 * what is left when it stops): a task that holds something (an operation, a future, a value)
 * releases it in its drop. Tasks are only added while the context is not dead (ctx->a is gone
 * after its destroy). */
/* A random delay in 0..fault_delay_us (0 without fault injection). */
int64_t rref__fault_delay(rref_ctx_t *ctx);
const rref_type_t *rref__type_find(rref_ctx_t *ctx, const char *name);
/* Wakes shutdown's wait after a control message, a pending child or a pending user reference
 * settled (ctx->mu held). */
void rref__settle_signal_locked(rref_ctx_t *ctx);
const char *rref__worker_name(rref_ctx_t *ctx, int rank);

/* proto.c: encoding of ids, control messages */
void rref__id_to_pb(weft_rref_id_t id, Weft__V1__RRefId *pb);
/* False when @p pb is missing or names no rank of the world. */
bool rref__id_from_pb(const rref_ctx_t *ctx, const Weft__V1__RRefId *pb, weft_rref_id_t *id_p);
bool rref__id_eq(weft_rref_id_t x, weft_rref_id_t y);
/* Sends a control request (FORK_REQUEST, CHILD_ACCEPT, USER_DELETE), retried until its ACK;
 * @p done runs once with the ACK's status (or the failure), without ctx->mu. */
void rref__ctl_send(rref_ctx_t *ctx, Weft__V1__RRefMsgKind kind, int to, weft_rref_id_t id,
                    weft_rref_id_t fork, rref_ctl_done_cb_t done, void *arg);
/* The channel's receiver. */
void rref__on_message(void *state, int src, weft_value_t *msg);
/* Fails (with @p st) and takes out every control message to @p rank (-1: all). */
void rref__ctl_fail_rank(rref_ctx_t *ctx, int rank, weft_status_t st, const char *why);

/* fork.c: references, forks, the codec, owner and parent bookkeeping */
extern const weft_value_ref_type_t rref__ref_type;
extern const weft_ref_codec_t rref__codec;
/* A new reference struct with one handle (ctx->mu not held). */
weft_rref_t *rref__alloc(rref_ctx_t *ctx, rref_role_t role, weft_rref_id_t id, int owner,
                         const char *type, const char *created_by);
/* Frees a struct whose refs reached 0 and that is in no list. */
void rref__free(weft_rref_t *r);
/* Owner entries by id (ctx->mu held). */
weft_rref_t *rref__owner_find_locked(rref_ctx_t *ctx, weft_rref_id_t id);
void rref__owner_insert_locked(rref_ctx_t *ctx, weft_rref_t *e);
bool rref__owner_add_fork_locked(rref_ctx_t *ctx, weft_rref_t *e, weft_rref_id_t fork, int holder);
/* True when @p e is to be freed now (taken out of the map): the caller frees it after unlocking. */
bool rref__owner_maybe_free_locked(rref_ctx_t *ctx, weft_rref_t *e);
void rref__user_insert_locked(rref_ctx_t *ctx, weft_rref_t *u);
/* Sets the outcome of an owner's creation and completes its ready future. */
void rref__owner_set(weft_rref_t *e, weft_status_t st, const char *text, weft_value_t *value,
                     void *obj);
/* A user reference's confirmation or creation ended: @p st OK confirms it. Drops the hold of the
 * pending confirmation. */
void rref__user_settle(weft_rref_t *u, bool confirmed, bool maybe_known, weft_status_t st,
                       const char *text);
/* Control requests arriving at an owner or a parent: the ACK's status. */
weft_status_t rref__on_fork_request(rref_ctx_t *ctx, int src, weft_rref_id_t id,
                                    weft_rref_id_t fork, char *why, size_t why_len);
weft_status_t rref__on_child_accept(rref_ctx_t *ctx, int src, weft_rref_id_t fork);
weft_status_t rref__on_user_delete(rref_ctx_t *ctx, int src, weft_rref_id_t id,
                                   weft_rref_id_t fork);
/* A rank is lost: owners drop its forks, parents its pending children, users of its references
 * fail. */
void rref__on_peer_lost(void *state, int rank, const char *why);
/* Remembers a delete of a reference this owner does not know (ctx->mu held); true if @p id,fork
 * was deleted before its creation arrived (and forgets it). */
void rref__orphan_add_locked(rref_ctx_t *ctx, weft_rref_id_t id, weft_rref_id_t fork);
bool rref__orphan_take_locked(rref_ctx_t *ctx, weft_rref_id_t id, weft_rref_id_t fork);
bool rref__freed_locked(const rref_ctx_t *ctx, weft_rref_id_t id);

/* remote.c: creation, use, the RPC handlers */
void rref__handle_remote(weft_call_t *call, void *arg);
void rref__handle_fetch(weft_call_t *call, void *arg);
void rref__handle_method(weft_call_t *call, void *arg);
/* A copy of @p v: shared tensors, copied payload, retained references. */
weft_status_t rref__value_copy(const weft_value_t *v, weft_value_t **copy_p);

#endif
