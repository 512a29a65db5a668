/* dist_autograd internals. Not installed.
 *
 *   context.c    the module: contexts (table, ids, known workers, release, TTL, peer loss,
 *                shutdown), the call hooks that record send and receive functions, the control
 *                messages (finish, fail, release) passed from worker to worker
 *   backward.c   the distributed backward (FAST): one engine run per worker and pass, send and
 *                receive functions' backward, the gradients in the context, runner threads
 *   optimizer.c  the distributed optimizer
 *
 * Locks: d->mu (the table) before c->mu (one context); neither is held while calling rpc, the
 * engine or completing a future. */
#ifndef WEFT_DIST_AUTOGRAD_INTERNAL_H
#define WEFT_DIST_AUTOGRAD_INTERNAL_H

#if defined(WEFT_BUILDING) && !defined(WEFT_IN_DIST_AUTOGRAD)
#error "dist_autograd/internal.h is internal to dist_autograd"
#endif

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include <weft/autograd.h>
#include <weft/dist_autograd.h>
#include <weft/module.h>
#include <weft/rpc.h>
#include <weft/rref.h>

#include "../core/internal.h"
#include "dist_autograd.pb-c.h"
#include "weft_pb.h"

#define DIST_FN_GRAD    "__weft.dist.grad"
#define DIST_FN_CONTROL "__weft.dist.control"
#define DIST_FN_OPTIM   "__weft.dist.optim"

typedef struct dist dist_t;
typedef struct dctx dctx_t;
typedef struct drun drun_t;

/* A send function: one recorded frame of this worker whose marked tensors need gradients back. */
typedef struct dsend {
    _Atomic long refs;
    uint64_t msg; /* its id (this rank << 48 | counter), in the frame's envelope */
    int peer;     /* where the frame went */
    bool reply;   /* an answer (else a request's arguments) */
    char *fn;
    int n;                /* marked tensors: the node's inputs, in order */
    weft_dtype_t *dtype;  /* each input's dtype and element count, to check gradients against */
    int64_t *numel;
    bool dead;            /* its frame will get no gradient (not sent, or its call failed) */
    weft_ag_node_t *node; /* held by the context's list, not by this record */
    /* the current pass (under the context's lock) */
    uint32_t pass;
    weft_future_t *arrived; /* completed with the gradients, or failed */
    bool got;
} dsend_t;

/* A receive function's state: the frame it received and where its gradients go. */
typedef struct {
    dist_t *d;
    uint64_t ctx;
    int peer;     /* the sender */
    uint64_t msg; /* the sender's send function */
    bool reply;
    int n;
    char *fn;
} drecv_t;

typedef struct {
    weft_tensor_t *leaf; /* retained */
    weft_tensor_t *grad; /* the sum, owned */
} dgrad_t;

typedef struct {
    int worker, peer;
    bool reply;
    uint64_t msg;
    char *fn;
} dunused_t;

/* One worker's part of one backward pass of a context: one engine run. */
struct drun {
    _Atomic long refs;
    dctx_t *c; /* retained */
    uint32_t pass;
    bool root;
    int root_rank;
    int64_t deadline_ns;
    bool accumulate_grad, retain_graph;
    /* under c->mu */
    bool engaged;        /* has work or answers outstanding (the root always) */
    weft_call_t *parent; /* the gradient call that engaged it: answered once it is idle */
    int unacked;         /* gradients this worker sent, not answered yet */
    int resumed;         /* send functions resumed (the others still wait in the engine) */
    int delivered;       /* gradients delivered to its send functions, not taken yet */
    bool remote_pending; /* an answer said some worker still has send functions waiting */
    bool unused_fired;   /* the root failed its waiting send functions as unused */
    bool stopping;       /* FINISH or FAIL came: waiting send functions were failed */
    bool ended;          /* the engine returned */
    weft_status_t status;
    char *error;
    weft_future_t *done; /* completes when the engine returned */
    /* gradients for the parent's send functions, to go with the answer to it */
    uint64_t *defer_msg;
    uint32_t *defer_count;
    size_t n_defer;
    weft_value_t *defer_body;
    dunused_t *unused; /* the root's send functions that never got a gradient */
    size_t n_unused;
    weft_ag_node_t **nodes; /* the send functions it started with (retained) */
    dsend_t **sends;        /* and their records (retained) */
    int n_sends;
};

struct dctx {
    _Atomic long refs;
    dist_t *d;
    uint64_t id;
    int origin;
    pthread_mutex_t mu;
    int *known;
    size_t n_known, cap_known;
    dsend_t **sends; /* each with its node retained (dsend_t.node) */
    size_t n_sends, cap_sends;
    dgrad_t *grads;
    size_t n_grads, cap_grads;
    int64_t touched_ns;
    bool in_table;
    drun_t *run;    /* the latest run (retained), NULL before the first */
    uint32_t pass;  /* the latest pass */
    uint32_t finished_pass, failed_pass;
    dctx_t *next; /* table chain */
};

typedef struct dtask {
    struct dtask *next;
    void (*fn)(void *arg);
    void *arg;
} dtask_t;

struct dist {
    weft_agent_t *a;
    int rank, world;
    char *name;
    pthread_mutex_t mu;
    dctx_t **buckets;
    size_t nbuckets, n;
    _Atomic uint64_t next_ctx, next_msg;
    int64_t ttl_ms;
    int64_t call_timeout_ms;
    /* runner threads for other workers' backward passes (elastic: one more when none is idle) */
    pthread_mutex_t run_mu;
    pthread_cond_t run_cv, run_idle_cv;
    dtask_t *tasks, *tasks_tail;
    int idle, live;
    bool stopping;
    /* the distributed optimizer's local optimizers on this worker (optimizer.c) */
    pthread_mutex_t opt_mu;
    pthread_mutex_t step_mu; /* one step at a time on this owner: optimizers may share parameters */
    struct dopt *opts;
    _Atomic uint64_t next_opt;
};

/* context.c */
weft_status_t dist__get(weft_agent_t *a, dist_t **d_p);
dctx_t *dist__find(dist_t *d, uint64_t id); /* retained, or NULL */
void dist__ctx_unref(dctx_t *c);
void dist__known_add_locked(dctx_t *c, int rank);
void dist__send_unref(dsend_t *s);
void dist__recv_free(void *p);
char *dist__name_of(dist_t *d, int rank, char *buf, size_t n);
void dist__run_task(dist_t *d, void (*fn)(void *arg), void *arg);
/* Passes a control message on to the workers @p c knows but @p except: the future completes with
 * a value packing the merged DistControlReply (its own part @p local merged in). */
weft_status_t dist__propagate(dist_t *d, dctx_t *c, const Weft__V1__DistControl *msg, int except,
                              const Weft__V1__DistControlReply *local, weft_future_t *local_done,
                              weft_future_t **f_p);

/* backward.c */
weft_status_t dist__send_backward(weft_ag_node_t *n, weft_tensor_t *const *grad_out,
                                  weft_tensor_t **grad_in);
weft_status_t dist__recv_backward(weft_ag_node_t *n, weft_tensor_t *const *grad_out,
                                  weft_tensor_t **grad_in);
void dist__handle_grad(weft_call_t *call, void *arg);
void dist__run_unref(drun_t *r);
/* FINISH or FAIL arrived for @p c's pass: fails its waiting send functions (@p finish: as unused,
 * listed into @p out). Called with c->mu held. Returns the run (retained) or NULL. */
drun_t *dist__run_stop_locked(dctx_t *c, uint32_t pass, bool finish, weft_status_t st,
                              const char *why, dunused_t **out, size_t *n_out,
                              weft_future_t ***fail_p, size_t *n_fail);
void dist__fail_futures(weft_future_t **f, size_t n, weft_status_t st, const char *why);
void dist__grads_free_locked(dctx_t *c);

/* optimizer.c */
void dist__handle_optim(weft_call_t *call, void *arg);
void dist__opts_free(dist_t *d);

#endif
