/*
 * collectives internals: per-agent context, mailbox, groups, operations. Not installed.
 *
 * The files call each other one way only, each using the ones below it (never above):
 *
 *   group.c       process groups, the public calls, the group's worker, submitting operations
 *   ops.c         the operation runner (coll__run) and the operations' lifecycle
 *   all_reduce.c  all_reduce algorithms over the connections: direct and ring
 *   cma.c         all_reduce, broadcast, all_gather, reduce_scatter and all_to_all by
 *                 cross-memory reads between ranks of one host
 *   basic.c       the algorithm of every other collective
 *   reduce.c      every reduction, through the reduce ops of the tensors' device; working
 *                 buffers in the accumulation dtype, and the end of reductions
 *   context.c     the per-agent context (the module): channel, mailbox, pieces, slots where
 *                 pieces land (reduced with the slot's reduce ops), aborts, lost ranks,
 *                 point-to-point delivery and deadlines
 *
 * The declarations below follow that order, from the bottom up.
 */
#ifndef WEFT_COLLECTIVES_INTERNAL_H
#define WEFT_COLLECTIVES_INTERNAL_H

#if defined(WEFT_BUILDING) && !defined(WEFT_IN_COLLECTIVES)
#error                                                                                             \
    "collectives/internal.h is internal to collectives: other modules use its public or module API"
#endif

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include <weft/collectives.h>
#include <weft/module.h>

#include "../core/internal.h"
#include "collectives.pb-c.h"

#define COLL_VERSION 1

/* A received message waiting to be matched. */
typedef struct coll_msg {
    struct coll_msg *next;
    Weft__V1__CollHeader *hdr; /* owned */
    weft_value_t *value;       /* owned; its tensor 0 is the data, if any */
    int src_world;             /* the world rank it came from (hdr->src only claims one) */
} coll_msg_t;

/* The reduction kernels of an operation's tensors: their device and its entry in the reduce
 * ops table (weft_reduce_ops_for, looked up when the operation is issued). */
typedef struct coll_kern {
    const weft_reduce_ops_t *ops;
    weft_device_t device;
} coll_kern_t;

/* A posted point-to-point receive. */
typedef struct coll_precv {
    struct coll_precv *next;
    uint32_t group;
    int src; /* group rank or WEFT_ANY_SOURCE */
    int tag;
    weft_tensor_t *dst; /* reference held until completion */
    weft_future_t *f;
    struct coll_group *g;
    uint64_t id;    /* what its deadline task looks it up by (never its address) */
    uint64_t timer; /* that task on the agent's timer (weft_agent_timer_add) */
} coll_precv_t;

typedef struct coll_abort {
    struct coll_abort *next;
    uint32_t group;
    uint64_t seq;
    weft_status_t status; /* what the operation fails with everywhere */
    char *why;
} coll_abort_t;

/* A destination posted for one expected piece: the direct connection's reader
 * receives its bytes straight into it (or reduces them into it as they arrive). */
typedef struct coll_slot {
    struct coll_slot *next;
    struct coll_group *g;
    const struct coll_desc *d; /* the operation's view, checked before bytes land */
    uint32_t step;
    int src; /* group rank */
    uint8_t *dst;
    size_t count;
    weft_dtype_t dtype;
    const coll_kern_t *kern; /* reduced into dst with it and rop; NULL: copied */
    weft_reduce_op_t rop;
    _Atomic int state; /* COLL_SLOT_* */
} coll_slot_t;

enum { COLL_SLOT_IDLE, COLL_SLOT_POSTED, COLL_SLOT_CLAIMED, COLL_SLOT_LANDED, COLL_SLOT_FAILED };

/* Per-agent state (weft_agent_module on WEFT_CHANNEL_COLLECTIVES). */
typedef struct coll_ctx {
    weft_agent_t *agent;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* a message, an abort or a loss arrived */
    coll_msg_t *msgs;
    coll_precv_t *precvs;
    coll_abort_t *aborts;
    coll_slot_t *slots; /* posted destinations */
    bool *lost;         /* by world rank */
    char **why;         /* by world rank */
    uint32_t next_group;
    struct coll_group *world; /* the world group, shared by every handle to it */
    int world_refs;
    struct coll_group *groups; /* the member groups alive, by gnext */
    uint64_t next_precv;       /* the last posted receive's id */
} coll_ctx_t;

typedef enum {
    OP_BARRIER = WEFT__V1__COLL_OP__COLL_OP_BARRIER,
    OP_BROADCAST = WEFT__V1__COLL_OP__COLL_OP_BROADCAST,
    OP_ALL_REDUCE = WEFT__V1__COLL_OP__COLL_OP_ALL_REDUCE,
    OP_REDUCE = WEFT__V1__COLL_OP__COLL_OP_REDUCE,
    OP_GATHER = WEFT__V1__COLL_OP__COLL_OP_GATHER,
    OP_SCATTER = WEFT__V1__COLL_OP__COLL_OP_SCATTER,
    OP_ALL_GATHER = WEFT__V1__COLL_OP__COLL_OP_ALL_GATHER,
    OP_REDUCE_SCATTER = WEFT__V1__COLL_OP__COLL_OP_REDUCE_SCATTER,
    OP_ALL_TO_ALL = WEFT__V1__COLL_OP__COLL_OP_ALL_TO_ALL,
} coll_kind_t;

/* Kinds index per-kind arrays (0, the wire's P2P, is not an operation of the table). */
#define COLL_KINDS (OP_ALL_TO_ALL + 1)

/* Where a group's algorithm of an operation kind comes from (weft_pg_describe says). */
typedef enum {
    COLL_FROM_DEFAULT, /* chosen by size */
    COLL_FROM_ENV,     /* WEFT_COLL_ALGO, read when the group was created */
    COLL_FROM_CALL,    /* weft_pg_set_algorithm */
} coll_from_t;

/* One queued collective operation. */
typedef struct coll_op {
    struct coll_op *next;
    coll_kind_t kind;
    uint64_t seq;
    weft_tensor_t *t;                /* in place, or the input (reference held; may be NULL) */
    weft_tensor_t *out;              /* the output (reference held; may be NULL) */
    weft_tensor_t **outs;            /* all_gather into a list: size entries (references held) */
    int64_t *in_splits, *out_splits; /* all_to_all, size entries each (owned) */
    int root;
    weft_reduce_op_t rop;
    weft_future_t *f;
    int64_t deadline_ns; /* the group's timeout from the call that issued it */
    int algo;            /* the group's algorithm when it was issued (-1: by size) */
    coll_kern_t kern;    /* reducing operations: the kernels of their tensors' device */
    weft_coll_ready_fn_t ready; /* staged operations: run before the tensor is used (or NULL) */
    void *ready_arg;
} coll_op_t;

/*
 * What a rank shows the members that read its memory (cma.c): they read it, never write it.
 * The epoch word comes first: the board's address is the word's. Its other words are set
 * before the epoch word and stay while it holds the operation's value; check, a hash of them
 * and of the epoch, tells a reader that it read them whole.
 */
typedef struct coll_cma_board {
    _Atomic uint64_t epoch; /* while an operation's reads run: its epoch; 0 between */
    _Atomic uint64_t done;  /* seq + 1 of the last operation where this rank reduced its chunk */
    _Atomic uint64_t fin;   /* ... where it finished reading the others */
    uint64_t mode;          /* how the operation of the epoch signals: CMA_MODE_* (cma.c) */
    uint64_t addr, bytes;   /* the region the others read */
    uint64_t hello, nhello; /* its HELLO words, in this process */
    uint64_t hash;          /* the view of the operation: the group's member list, */
    uint64_t kind, seq, dtype, rop, root, count; /* ... and the coll_desc_t */
    uint64_t check;
    /* Set once, when the group settled on reading (never changed after, and outside the
     * check): the address of this rank's oneshot area (cma.c), 0 before. */
    uint64_t small;
} coll_cma_board_t;

/* all_reduce by one round of reads (cma.c, "oneshot"): up to this many bytes per member. */
#define COLL_ONESHOT_MAX_BYTES (64u << 10)

/* Shared state of a group; handles point at it. */
typedef struct coll_group {
    coll_ctx_t *ctx;
    uint32_t id;
    uint64_t hash;
    int size;
    int rank;   /* -1: not a member */
    int *world; /* group rank -> world rank */
    _Atomic int64_t timeout_ms;
    /* Read once, when the group was created (the configuration table, core/config_vars.h):
     * WEFT_COLL_TIMEOUT_MS (the timeout weft_pg_set_timeout(0) goes back to) and
     * WEFT_COLL_CMA (whether this rank lets the members read its memory). */
    int64_t default_timeout_ms;
    bool cma_allowed;
    /* The algorithm of each operation kind: an index in the table (ops.c), or -1 to choose
     * by size; and where that comes from. Under mu. env_algo: WEFT_COLL_ALGO's choice,
     * which weft_pg_set_algorithm(NULL) goes back to. */
    int algo[COLL_KINDS];
    coll_from_t algo_from[COLL_KINDS];
    int env_algo[COLL_KINDS];
    /* the worker */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    coll_op_t *qh, *qt;
    uint64_t next_seq;
    bool stop;
    bool started;
    bool busy; /* an operation is running (on the worker or on a caller's thread) */
    pthread_t thread;
    /* Finished operations (under ctx->mu): every seq below done_below, and those in
     * done_extra (finished out of order: refused calls). Pieces and aborts of a finished
     * operation are dropped, those arriving later too. */
    uint64_t done_below;
    uint64_t *done_extra;
    size_t ndone_extra, done_cap;
    struct coll_group *gnext; /* ctx->groups */
    /* cma.c: whether the members read each other's memory (0 not settled yet, 1 yes,
     * -1 no: the other algorithms); what the members read of ours while an operation runs;
     * once settled (1), each member's process and the address of its board, by group rank. */
    int cma_state;
    coll_cma_board_t cma_board;
    uint64_t cma_last_epoch; /* the epoch this rank's board showed last (0: never) */
    int *cma_pids;
    uint64_t *cma_boards;
    /* oneshot (cma.c), once settled: this rank's area (a word saying which operations it
     * finished, two slots the members read, by the parity of an operation's seq, then two
     * scratch buffers); each member's area, learned from its board (0: not yet); what this
     * rank knows each member finished (seq + 1: every operation below it); the operation
     * (seq + 1) each of our slots last held. */
    uint8_t *cma_small;
    uint64_t *cma_smalls;
    uint64_t *cma_small_fin;
    uint64_t cma_small_last[2];
    uint64_t cma_small_entered; /* seq + 1 of the last oneshot operation this rank entered */
} coll_group_t;

/* The sender's view of an operation, carried by every message of it. */
typedef struct coll_desc {
    coll_kind_t kind;
    uint64_t seq;
    weft_dtype_t dtype;
    weft_reduce_op_t rop;
    int root;
    uint64_t count;
} coll_desc_t;

struct weft_pg {
    coll_group_t *g;
};

/* What an algorithm works on. */
typedef struct coll_args {
    coll_op_t *op;        /* the operation: tensors, root, reduce op, split lists */
    const coll_desc_t *d; /* its view, carried by every piece */
    /* all_reduce: the buffer reduced in place, in the accumulation dtype (f32 for f16 and
     * bf16), @p count elements; the runner finishes it into the tensor. */
    uint8_t *work;
    size_t count;
    weft_dtype_t wt;
} coll_args_t;

/*
 * An algorithm: an entry of the table in ops.c. When a group chooses by size, the entries
 * of the operation's kind that apply to its size (bytes per member, in the accumulation
 * dtype) compete and the highest score runs; a group may also force one (WEFT_COLL_ALGO,
 * weft_pg_set_algorithm).
 */
typedef struct coll_algo {
    const char *name; /* "ring" */
    coll_kind_t kind;
    int score;
    /* It applies from this many bytes in @p g (NULL: from 0). */
    size_t (*min_bytes)(const coll_group_t *g);
    /* When it may decline (weft_pg_describe prints it; NULL: it never does). */
    const char *declines;
    /*
     * Runs it on the group's worker. Sets *declined_p (false on entry) when the members
     * agreed, having changed nothing, that it cannot run here: the runner then runs the
     * choice by size among the other entries of the kind, as every member does.
     */
    weft_status_t (*run)(coll_group_t *g, const coll_args_t *a, int64_t deadline, bool *declined_p);
    /* It applies up to this many bytes in @p g (NULL: any size). */
    size_t (*max_bytes)(const coll_group_t *g);
} coll_algo_t;

/* ------------------------------------------------------------ context.c */

weft_status_t coll__ctx(weft_agent_t *a, coll_ctx_t **ctx_p);
/* Adds @p g to the groups whose late pieces are dropped; coll__ctx_drop_group removes it. */
void coll__ctx_add_group(coll_ctx_t *ctx, coll_group_t *g);
/* Fails the posted receives of a group that is going away (its operations are over), and
 * drops its pieces and aborts. */
void coll__ctx_drop_group(coll_ctx_t *ctx, coll_group_t *g);
const char *coll__kind_name(coll_kind_t k);

/* Sends one piece of an operation to group rank @p dst. @p data may be NULL;
 * its bytes are sent without copying: *released_p (if not NULL) completes when
 * the transport no longer reads them. */
weft_status_t coll__send(coll_group_t *g, const coll_desc_t *d, uint32_t step, int dst, void *data,
                         size_t count, weft_dtype_t dtype, weft_future_t **released_p);
/* Waits for the piece (@p step) of operation @p d from group rank @p src. Checks
 * the sender's view against ours (a mismatch aborts the operation everywhere).
 * The message is the caller's: free with coll__msg_free. */
weft_status_t coll__recv(coll_group_t *g, const coll_desc_t *d, uint32_t step, int src,
                         int64_t deadline_ns, coll_msg_t **m_p);
void coll__msg_free(coll_msg_t *m);
/* Whether operation @p d can go on waiting here without a piece: WEFT_OK, or what it fails
 * with (an abort, a piece showing a differing view, a lost member, its deadline), as
 * coll__recv would. For waits that poll something else than the mailbox. */
weft_status_t coll__check(coll_group_t *g, const coll_desc_t *d, int64_t deadline_ns);
/* Checks group rank @p src's view @p theirs (and its member list's @p hash) of operation @p d
 * as coll__recv checks a piece's; a difference aborts the operation everywhere
 * (WEFT_ERR_MISMATCH). */
weft_status_t coll__check_view(coll_group_t *g, const coll_desc_t *d, const coll_desc_t *theirs,
                               uint64_t hash, int src);
/* The data tensor of a received message (NULL if none). */
weft_tensor_t *coll__msg_tensor(const coll_msg_t *m);
/* Copies a received piece into @p dst after checking its size and dtype. */
weft_status_t coll__take_piece(coll_msg_t *m, void *dst, size_t count, weft_dtype_t dtype, int src);
/* Waits until the transport has let go of the sent pieces @p rel (releasing them), past
 * the deadline if need be (a late one makes it WEFT_ERR_TIMEOUT). */
weft_status_t coll__wait_released(weft_future_t **rel, size_t n, int64_t deadline_ns);
/* Posts @p s (the caller's, zeroed or ended) as the destination of piece @p step from
 * group rank @p src: @p count elements of @p dtype at @p dst, copied, or reduced into it
 * with @p rop by @p kern's kernels (when not NULL). @p d and @p kern must outlive the slot.
 * A piece that lands there comes to coll__recv without its tensor, and coll__slot_landed
 * says so. */
void coll__slot_post(coll_group_t *g, const coll_desc_t *d, coll_slot_t *s, uint32_t step, int src,
                     void *dst, size_t count, weft_dtype_t dtype, const coll_kern_t *kern,
                     weft_reduce_op_t rop);
/* Whether the piece of @p s landed in place (call after coll__recv returned it). */
bool coll__slot_landed(const coll_slot_t *s);
/* Withdraws @p s, waiting while a transport thread writes into it. No-op if not posted. */
void coll__slot_end(coll_group_t *g, coll_slot_t *s);
/* Tells every member that operation @p seq failed here: they fail it too, with @p st. */
void coll__abort(coll_group_t *g, uint64_t seq, weft_status_t st, const char *why);
/* Marks operation @p seq finished on this rank: drops its pieces nobody took and its
 * aborts, and those that arrive later. */
void coll__seq_done(coll_group_t *g, uint64_t seq);

/* Point to point (delivery happens in the channel callback). */
weft_status_t coll__p2p_send(coll_group_t *g, const weft_tensor_t *t, int dst, int tag,
                             weft_future_t **f_p);
weft_status_t coll__p2p_recv(coll_group_t *g, weft_tensor_t *t, int src, int tag,
                             weft_future_t **f_p);

/* White-box counters for tests: the pieces and aborts held in the mailbox for operations of
 * @p pg's group that this rank has issued (pieces of later ones may come early), and the
 * sent pieces (of every group) whose bytes the transport still holds. */
size_t coll__mailbox_count(const weft_pg_t *pg);
long coll__held_pieces(void);
/* Received pieces that landed in place (coll__slot_post), in this process. */
long coll__landed_pieces(void);
/* Deadline tasks of posted receives queued on the agent's timer (not yet run, cancelled or
 * dropped), and the receives they failed, in this process. */
long coll__recv_deadlines_armed(void);
long coll__recv_deadlines_fired(void);

/* ------------------------------------------------------------ reduce.c */

/* Every reduction of the collectives goes through these: the kernels of the operation's
 * device (@p k), with the arithmetic of weft_reduce_into, weft_reduce_to, ... */
void coll__reduce_into(const coll_kern_t *k, void *dst, const void *src, size_t n,
                       weft_dtype_t dtype, weft_reduce_op_t op);
void coll__reduce_to(const coll_kern_t *k, void *dst, const void *a, const void *b, size_t n,
                     weft_dtype_t dtype, weft_reduce_op_t op);
/* A working copy of @p t's @p count elements in the accumulation dtype *wt_p (f32 for
 * f16/bf16: *owned_p, a host buffer freed by the caller), or t's data itself (*owned_p
 * NULL). */
weft_status_t coll__widen(const coll_kern_t *k, const weft_tensor_t *t, size_t count,
                          weft_dtype_t *wt_p, uint8_t **work_p, float **owned_p);
/* Completes a reduction of @p size contributions accumulated in @p acc (in @p wt) and writes
 * its @p count elements into @p t, in t's dtype, rounding f16/bf16 once. @p acc may be t's
 * data; it is modified. */
void coll__finish(const coll_kern_t *k, weft_tensor_t *t, uint8_t *acc, size_t count,
                  weft_dtype_t wt, weft_reduce_op_t rop, int size);

/* ------------------------------------------------------------ basic.c */

/* The algorithm of each collective other than all_reduce (entries of the table). */
weft_status_t coll__barrier(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                            bool *declined_p);
weft_status_t coll__broadcast(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                              bool *declined_p);
weft_status_t coll__reduce(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                           bool *declined_p);
weft_status_t coll__gather(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                           bool *declined_p);
weft_status_t coll__scatter(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                            bool *declined_p);
weft_status_t coll__all_gather(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                               bool *declined_p);
weft_status_t coll__reduce_scatter(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                                   bool *declined_p);
weft_status_t coll__all_to_all(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                               bool *declined_p);
/* Checks every pair of all_to_all's split lists @p all (n rows of 2n: each member's
 * in_splits, then its out_splits): what s sends r is what r expects from s. */
weft_status_t coll__all_to_all_pairs(const coll_group_t *g, const coll_desc_t *dv,
                                     const int64_t *all);

/* ------------------------------------------------------------ cma.c */

/* Collectives by reading the other members' memory (one host). *declined_p: the members
 * agreed not to (a member cannot read another, or does not let them: WEFT_COLL_CMA=0 when
 * its group was created); nothing happened. all_reduce: the raw reduction of a->work, the
 * same on every rank. */
weft_status_t coll__all_reduce_cma(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                                   bool *declined_p);
weft_status_t coll__broadcast_cma(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                                  bool *declined_p);
weft_status_t coll__all_gather_cma(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                                   bool *declined_p);
weft_status_t coll__reduce_scatter_cma(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                                       bool *declined_p);
weft_status_t coll__all_to_all_cma(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                                   bool *declined_p);
/* all_reduce of at most COLL_ONESHOT_MAX_BYTES in one round: each rank shows its buffer in a
 * slot of its own and reads every other member's, then reduces them all in rank order. A
 * group that has not settled on reading settles with this operation (coll__all_reduce_cma's
 * messages), or every member declines. */
weft_status_t coll__all_reduce_oneshot(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                                       bool *declined_p);
/* Before @p g goes: waits until every member is done with this rank's last oneshot slot (it
 * finished that operation, failed or not; it is gone; or the group's timeout passed). */
void coll__oneshot_drain(coll_group_t *g);
/* Before the group's memory goes: waits (the group's timeout at most; members lost or gone
 * are not waited for) until no member is still in the last operation that showed this rank's
 * board, which it may still read. */
void coll__cma_drain(coll_group_t *g);
/* This rank finished operation @p seq of @p g, of any kind (its oneshot word says so: a member
 * waiting to rewrite a slot waits for it). On the thread that ran it, in seq order. */
void coll__oneshot_finished(coll_group_t *g, uint64_t seq);
/* The operations of this process, of every kind, that ran by cross-memory reads (tests). */
long coll__cma_ops(void);

/* ------------------------------------------------------------ all_reduce.c */

/* The raw reduction (the runner finishes it) of a->work, the same on every rank. */
weft_status_t coll__all_reduce_direct(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                                      bool *declined_p);
weft_status_t coll__all_reduce_ring(coll_group_t *g, const coll_args_t *a, int64_t deadline,
                                    bool *declined_p);

/* ------------------------------------------------------------ ops.c */

/* Runs @p op, completes its future and frees it. */
void coll__run(coll_group_t *g, coll_op_t *op);
void coll__op_free(coll_op_t *op, int size);
/* The table entry of @p kind named @p name, or -1. */
int coll__algo_find(coll_kind_t kind, const char *name);
/* Appends to @p buf (@p n bytes, at *len_p, which grows by what the whole text needs, as
 * snprintf counts) one line per operation kind saying how @p g chooses its algorithm, with
 * the sizes from which each applies. Called with g->mu held. */
void coll__algo_describe(const coll_group_t *g, char *buf, size_t n, size_t *len_p);
/* Appends the names of @p kind's algorithms ("direct, ring, cma") as coll__algo_describe
 * appends. */
void coll__algo_names(coll_kind_t kind, char *buf, size_t n, size_t *len_p);
/* snprintf at buf + *len_p (when it fits in @p n) and *len_p += what the text needs. */
void coll__appendf(char *buf, size_t n, size_t *len_p, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* The operations of @p kind that algorithm @p name ran in this process (tests). */
long coll__algo_runs(coll_kind_t kind, const char *name);

#endif
