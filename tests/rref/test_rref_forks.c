/*
 * Property tests of the rref module's reference counting: random fork trees over 4 to 8 ranks
 * with random release orders, under the test-only fault injector (control messages delayed,
 * reordered and duplicated), and with a user killed mid-tree.
 *
 * Every rank computes the same plan from a fixed seed. Rank 0 owns every value. For each value
 * the plan is a random tree of holders: the root creates the reference (the owner itself with
 * weft_rref_create, or another rank with weft_rref_remote / weft_rref_remote_object), and every
 * other node is a holder on a random rank (the owner and the sender's own rank included) that
 * receives the reference from its parent inside the arguments of a "hold" call; some holders
 * answer with the reference inside the result too, which makes one more holder on the parent's
 * rank. Each rank serves the holders it gets in one thread: it uses the reference (to_here, or a
 * method call for objects) and checks the value, forwards it to its children, and releases the
 * references it holds in a random order at random times. Just before releasing, a holder tells
 * the owner ("releasing"), so the owner knows at every moment which holders may still use a value.
 *
 * The properties:
 *  - every value is freed exactly once, and never while a holder has not released it: checked
 *    on the owner by the release callback of the value's wrapped tensor (weft_rref_create) or the
 *    destructor of the object (weft_rref_remote_object). A function's result (weft_rref_remote)
 *    is a copy the test cannot mark: for those the checks are the uses below and the counts;
 *  - every function and constructor ran exactly once (duplicated control messages included);
 *  - every holder can use the reference when it gets it and again just before releasing it;
 *  - weft_rref_debug_info's counts come back to zero on every rank (users, pending users and
 *    children, forks; owners on the owner), with one deleted owner per value.
 * With a user killed (SIGKILL) mid-tree while it holds references, the owner still frees every
 * value once the failure is detected, and its counts come back to zero.
 *
 * Every wait has a deadline. The seeds are fixed; each run prints its plan's size on stderr.
 */
#include <criterion/criterion.h>

#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ranks.h"

#define MAX_WORLD   8
#define MAX_VALUES  8
#define MAX_NODES   14
#define MAX_HOLDERS (2 * MAX_NODES)
#define NUMEL       16
#define CALL_MS     20000
#define LOOP_MS     40000
#define SETTLE_MS   20000
#define OWNER       0

/* ------------------------------------------------------------------ the plan */

typedef enum {
    CREATE_OWNER,  /* the owner: weft_rref_create */
    CREATE_REMOTE, /* the root rank: weft_rref_remote(OWNER, "make") */
    CREATE_OBJECT, /* the root rank: weft_rref_remote_object(OWNER, "cell") */
} create_t;

typedef struct {
    int parent; /* -1: the root */
    int rank;   /* where the holder lives */
    int echo;   /* the "hold" call's result carries the reference back to the parent's rank */
} node_t;

typedef struct {
    create_t how;
    int n_nodes;
    node_t nodes[MAX_NODES];
} value_plan_t;

typedef struct {
    uint32_t seed;
    int world;
    int n_values;
    int victim; /* -1: none; else this rank dies (SIGKILL) holding its references */
    value_plan_t v[MAX_VALUES];
} plan_t;

/* Holders of a value: node j is holder j; the echo of node j is holder MAX_NODES + j. */
static int holder_rank(const value_plan_t *vp, int h)
{
    if (h < MAX_NODES) {
        return vp->nodes[h].rank;
    }
    return vp->nodes[vp->nodes[h - MAX_NODES].parent].rank;
}

static uint32_t rnd(uint64_t *s)
{
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(*s >> 33);
}

static void plan_make(plan_t *p, uint32_t seed, int world, int n_values, int victim)
{
    uint64_t s = (uint64_t)seed * 0x9E3779B97F4A7C15ULL + 1;

    memset(p, 0, sizeof(*p));
    p->seed = seed;
    p->world = world;
    p->n_values = n_values;
    p->victim = victim;
    for (int k = 0; k < n_values; k++) {
        value_plan_t *vp = &p->v[k];

        vp->how = (create_t)((k + seed) % 3);
        vp->n_nodes = 4 + (int)(rnd(&s) % (MAX_NODES - 3));
        vp->nodes[0].parent = -1;
        vp->nodes[0].rank = vp->how == CREATE_OWNER ? OWNER : (int)(rnd(&s) % (uint32_t)world);
        for (int j = 1; j < vp->n_nodes; j++) {
            vp->nodes[j].parent = (int)(rnd(&s) % (uint32_t)j);
            vp->nodes[j].rank = (int)(rnd(&s) % (uint32_t)world);
            vp->nodes[j].echo = rnd(&s) % 4 == 0;
        }
    }
}

/* The holders rank @p rank gets over the whole plan. */
static int plan_expected(const plan_t *p, int rank)
{
    int n = 0;

    for (int k = 0; k < p->n_values; k++) {
        const value_plan_t *vp = &p->v[k];

        for (int j = 0; j < vp->n_nodes; j++) {
            n += vp->nodes[j].rank == rank;
            n += vp->nodes[j].echo && vp->nodes[vp->nodes[j].parent].rank == rank;
        }
    }
    return n;
}

/* The holders of value @p k that release it (all but the victim's). */
static int plan_releasers(const plan_t *p, int k)
{
    const value_plan_t *vp = &p->v[k];
    int n = 0;

    for (int j = 0; j < vp->n_nodes; j++) {
        n += holder_rank(vp, j) != p->victim;
        if (vp->nodes[j].echo) {
            n += holder_rank(vp, MAX_NODES + j) != p->victim;
        }
    }
    return n;
}

/* ------------------------------------------------- per-process (per-rank) state */

typedef struct task {
    struct task *next;
    int k;
    int h;
    weft_rref_t *r; /* one handle, ours */
} task_t;

static struct {
    const plan_t *plan;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    task_t *head;
    task_t *tail;
    /* On the owner. */
    float data[MAX_VALUES][NUMEL];
    int released[MAX_VALUES];                 /* "releasing" notices received */
    int released_by[MAX_VALUES][MAX_HOLDERS]; /* per holder: exactly one expected */
    int freed[MAX_VALUES];                    /* tensor release callbacks / destructor calls */
    int freed_early[MAX_VALUES];              /* of which while a holder had not released */
    int made[MAX_VALUES];                     /* values / objects constructed */
    weft_call_t *done[MAX_WORLD];
    int n_done;
} g = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void queue_push(int k, int h, weft_rref_t *r)
{
    task_t *t = calloc(1, sizeof(*t));

    if (t == NULL) {
        abort();
    }
    t->k = k;
    t->h = h;
    t->r = r;
    pthread_mutex_lock(&g.mu);
    if (g.tail != NULL) {
        g.tail->next = t;
    } else {
        g.head = t;
    }
    g.tail = t;
    pthread_cond_broadcast(&g.cv);
    pthread_mutex_unlock(&g.mu);
}

/* The next task, waiting up to @p ms; NULL if none came. */
static task_t *queue_pop(int64_t ms)
{
    struct timespec ts;
    task_t *t;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    ts.tv_sec += (time_t)(ms / 1000) + ts.tv_nsec / 1000000000L;
    ts.tv_nsec %= 1000000000L;
    pthread_mutex_lock(&g.mu);
    while (g.head == NULL) {
        if (pthread_cond_timedwait(&g.cv, &g.mu, &ts) != 0) {
            break;
        }
    }
    t = g.head;
    if (t != NULL) {
        g.head = t->next;
        if (g.head == NULL) {
            g.tail = NULL;
        }
    }
    pthread_mutex_unlock(&g.mu);
    return t;
}

/* Called on the owner when value @p k is freed (tensor release callback or destructor). */
static void value_freed(int k)
{
    pthread_mutex_lock(&g.mu);
    g.freed[k]++;
    if (g.released[k] < plan_releasers(g.plan, k)) {
        g.freed_early[k]++;
        fprintf(stderr, "owner: value %d freed while %d of its holders had not released it\n", k,
                plan_releasers(g.plan, k) - g.released[k]);
    }
    pthread_mutex_unlock(&g.mu);
}

static void tensor_freed_cb(void *data, void *arg)
{
    (void)data;
    value_freed((int)(intptr_t)arg);
}

/* ------------------------------------------------------------------ payloads */

typedef struct {
    int32_t k;
    int32_t h;
} ids_t;

static weft_value_t *value_of_ids(int k, int h)
{
    ids_t ids = {k, h};
    weft_value_t *v;

    if (weft_value_create(&v) != WEFT_OK) {
        return NULL;
    }
    if (weft_value_set_payload(v, &ids, sizeof(ids)) != WEFT_OK) {
        weft_value_free(v);
        return NULL;
    }
    return v;
}

static int ids_of(const weft_value_t *v, ids_t *ids)
{
    size_t len = 0;
    const void *p = v != NULL ? weft_value_payload(v, &len) : NULL;

    if (p == NULL || len != sizeof(*ids)) {
        return -1;
    }
    memcpy(ids, p, sizeof(*ids));
    return ids->k >= 0 && ids->k < g.plan->n_values && ids->h >= 0 && ids->h < MAX_HOLDERS ? 0 : -1;
}

/*
 * Value k on the owner: the text "value-k" and a tensor of k*100+i. With @p marked the tensor wraps
 * g.data[k] and its release marks the value's free. The result of a function (weft_rref_remote)
 * reaches the owner's entry through an RPC call to itself, which copies it: that one is not
 * marked (its tensor is released when the call's answer is sent).
 */
static weft_value_t *make_value(int k, int marked)
{
    int64_t n = NUMEL;
    weft_tensor_t *t = NULL;
    weft_value_t *v = NULL;
    weft_status_t st;
    char text[32];

    for (int i = 0; i < NUMEL; i++) {
        g.data[k][i] = (float)(k * 100 + i);
    }
    snprintf(text, sizeof(text), "value-%d", k);
    if (marked) {
        st = weft_tensor_wrap(WEFT_F32, 1, &n, g.data[k], sizeof(g.data[k]), WEFT_CPU,
                              tensor_freed_cb, (void *)(intptr_t)k, &t);
    } else {
        st = weft_tensor_empty(WEFT_F32, 1, &n, &t);
        if (st == WEFT_OK) {
            memcpy(weft_tensor_data(t), g.data[k], sizeof(g.data[k]));
        }
    }
    if (st != WEFT_OK) {
        return NULL;
    }
    if (weft_value_create(&v) != WEFT_OK || weft_value_set_string(v, text) != WEFT_OK ||
        weft_value_push_tensor(v, t) != WEFT_OK) {
        weft_value_free(v);
        weft_tensor_release(t);
        return NULL;
    }
    pthread_mutex_lock(&g.mu);
    g.made[k]++;
    pthread_mutex_unlock(&g.mu);
    return v;
}

/* 0 when @p v is value k (a copy from to_here, or a "get" result: text only). */
static int check_value(const weft_value_t *v, int k, int with_tensor)
{
    char want[32];
    size_t len = 0;
    const char *p = weft_value_payload(v, &len);

    snprintf(want, sizeof(want), "value-%d", k);
    if (p == NULL || len != strlen(want) || memcmp(p, want, len) != 0) {
        return -1;
    }
    if (!with_tensor) {
        return 0;
    }
    weft_tensor_t *t = weft_value_tensor(v, 0);
    if (t == NULL || weft_tensor_dtype(t) != WEFT_F32 || weft_tensor_numel(t) != NUMEL) {
        return -1;
    }
    const float *x = weft_tensor_data(t);
    for (int i = 0; i < NUMEL; i++) {
        if (x[i] != (float)(k * 100 + i)) {
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------- functions and types */

/* make(k) on the owner -> value k */
static void fn_make(weft_call_t *call, void *arg)
{
    ids_t ids;
    weft_value_t *v;

    (void)arg;
    if (ids_of(weft_call_args(call), &ids) != 0 || (v = make_value(ids.k, 0)) == NULL) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "make: bad arguments or no memory");
        return;
    }
    weft_call_reply(call, v);
}

/* hold(k, h; the reference): holder h of value k is this rank's. Answers with the reference
 * when the plan says so (an echo: one more holder on the caller's rank). */
static void fn_hold(weft_call_t *call, void *arg)
{
    const weft_value_t *args = weft_call_args(call);
    weft_rref_t *r = weft_value_rref(args, 0);
    weft_value_t *res = NULL;
    ids_t ids;

    (void)arg;
    if (r == NULL || ids_of(args, &ids) != 0 || ids.h >= g.plan->v[ids.k].n_nodes) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "hold: bad arguments");
        return;
    }
    queue_push(ids.k, ids.h, weft_rref_retain(r));
    if (g.plan->v[ids.k].nodes[ids.h].echo) {
        res = value_of_ids(ids.k, MAX_NODES + ids.h);
        if (res == NULL || weft_value_add_rref(res, r) != WEFT_OK) {
            weft_value_free(res);
            weft_call_fail(call, WEFT_ERR_NO_MEMORY, "hold: cannot answer with the reference");
            return;
        }
    }
    weft_call_reply(call, res);
}

/* releasing(k, h) on the owner: holder h of value k is about to release its reference. */
static void fn_releasing(weft_call_t *call, void *arg)
{
    ids_t ids;

    (void)arg;
    if (ids_of(weft_call_args(call), &ids) != 0) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "releasing: bad arguments");
        return;
    }
    pthread_mutex_lock(&g.mu);
    g.released[ids.k]++;
    g.released_by[ids.k][ids.h]++;
    pthread_mutex_unlock(&g.mu);
    weft_call_reply(call, NULL);
}

/* done() on the owner: answered once the owner has checked everything (a barrier). */
static void fn_done(weft_call_t *call, void *arg)
{
    (void)arg;
    pthread_mutex_lock(&g.mu);
    if (g.n_done < MAX_WORLD) {
        g.done[g.n_done++] = call;
        call = NULL;
    }
    pthread_cond_broadcast(&g.cv);
    pthread_mutex_unlock(&g.mu);
    if (call != NULL) {
        weft_call_fail(call, WEFT_ERR_INVALID_STATE, "too many done calls");
    }
}

typedef struct {
    int k;
} cell_t;

static weft_status_t cell_ctor(const weft_value_t *args, void *type_arg, void **obj_p)
{
    ids_t ids;
    cell_t *c;

    (void)type_arg;
    if (ids_of(args, &ids) != 0) {
        return WEFT_ERR_INVALID_ARG;
    }
    c = calloc(1, sizeof(*c));
    if (c == NULL) {
        return WEFT_ERR_NO_MEMORY;
    }
    c->k = ids.k;
    pthread_mutex_lock(&g.mu);
    g.made[ids.k]++;
    pthread_mutex_unlock(&g.mu);
    *obj_p = c;
    return WEFT_OK;
}

static void cell_dtor(void *obj, void *type_arg)
{
    cell_t *c = obj;

    (void)type_arg;
    value_freed(c->k);
    free(c);
}

/* get() -> "value-k" */
static void cell_get(void *obj, weft_call_t *call, void *type_arg)
{
    cell_t *c = obj;
    char text[32];

    (void)type_arg;
    snprintf(text, sizeof(text), "value-%d", c->k);
    weft_value_t *v = value_of_string(text);
    if (v == NULL) {
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "get: no memory");
        return;
    }
    weft_call_reply(call, v);
}

static const weft_rref_method_t cell_methods[] = {{"get", cell_get}};

static void setup(weft_agent_t *a, int rank, void *arg)
{
    (void)rank;
    g.plan = arg;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&g.cv, &ca);
    pthread_condattr_destroy(&ca);
    if (weft_rref_init(a) != WEFT_OK || weft_rpc_register(a, "make", fn_make, NULL) != WEFT_OK ||
        weft_rpc_register(a, "hold", fn_hold, NULL) != WEFT_OK ||
        weft_rpc_register(a, "releasing", fn_releasing, NULL) != WEFT_OK ||
        weft_rpc_register(a, "done", fn_done, NULL) != WEFT_OK ||
        weft_rref_register_type(a, "cell", cell_ctor, cell_dtor, cell_methods, 1, NULL) !=
            WEFT_OK) {
        fprintf(stderr, "rank %d: setup: %s\n", rank, weft_last_error());
        abort();
    }
}

/* ---------------------------------------------------------------- the holders */

/* The count @p key of @p json; -1 if absent. */
static long json_count(const char *json, const char *key)
{
    char pat[64];
    const char *at;

    snprintf(pat, sizeof(pat), "\"%s\":", key);
    at = strstr(json, pat);
    return at != NULL ? strtol(at + strlen(pat), NULL, 10) : -1;
}

static const char *const zero_keys[] = {"owners",           "users", "pending_users",
                                        "pending_children", "forks", NULL};

/* Waits until this rank's counts are all zero; 0, or -1 with @p json_p the last counts. */
static int wait_counts_zero(weft_agent_t *a, int64_t ms, char *last, size_t cap)
{
    int64_t deadline = now_ms() + ms;

    for (;;) {
        char *json = NULL;
        int zero = 1;

        if (weft_rref_debug_info(a, &json) != WEFT_OK) {
            snprintf(last, cap, "weft_rref_debug_info: %s", weft_last_error());
            return -1;
        }
        for (const char *const *k = zero_keys; *k != NULL; k++) {
            zero &= json_count(json, *k) == 0;
        }
        snprintf(last, cap, "%s", json);
        weft_free(json);
        if (zero) {
            return 0;
        }
        if (now_ms() > deadline) {
            return -1;
        }
        usleep(2000);
    }
}

/* Uses the reference of task @p t: 0 when it gives value t->k. */
static int use_ref(const task_t *t)
{
    const value_plan_t *vp = &g.plan->v[t->k];
    weft_value_t *v = NULL;
    weft_status_t st;
    int rc;

    if (weft_rref_owner(t->r) != OWNER) {
        fprintf(stderr, "value %d holder %d: owner %d\n", t->k, t->h, weft_rref_owner(t->r));
        return -1;
    }
    if (vp->how == CREATE_OBJECT) {
        st = weft_rref_rpc_sync(t->r, "get", NULL, CALL_MS, &v);
    } else {
        st = weft_rref_to_here(t->r, CALL_MS, &v);
    }
    if (st != WEFT_OK) {
        fprintf(stderr, "value %d holder %d: %s: %s: %s\n", t->k, t->h,
                vp->how == CREATE_OBJECT ? "get" : "to_here", weft_strerror(st), weft_last_error());
        return -1;
    }
    rc = check_value(v, t->k, vp->how != CREATE_OBJECT);
    if (rc != 0) {
        fprintf(stderr, "value %d holder %d: wrong value\n", t->k, t->h);
    }
    weft_value_free(v);
    return rc;
}

/* Sends the reference of task @p t to the children of its node; queues the echoes. */
static int forward(weft_agent_t *a, const task_t *t)
{
    const value_plan_t *vp = &g.plan->v[t->k];
    weft_future_t *fs[MAX_NODES];
    int child[MAX_NODES];
    int n = 0;
    int rc = 0;

    if (t->h >= MAX_NODES) {
        return 0; /* echoes have no children */
    }
    for (int j = 1; j < vp->n_nodes; j++) {
        if (vp->nodes[j].parent != t->h) {
            continue;
        }
        weft_value_t *args = value_of_ids(t->k, j);
        weft_status_t st = args != NULL ? weft_value_add_rref(args, t->r) : WEFT_ERR_NO_MEMORY;
        if (st == WEFT_OK) {
            st = weft_rpc_async(a, vp->nodes[j].rank, "hold", args, CALL_MS, &fs[n]);
        }
        weft_value_free(args);
        if (st != WEFT_OK) {
            fprintf(stderr, "value %d: hold to rank %d: %s: %s\n", t->k, vp->nodes[j].rank,
                    weft_strerror(st), weft_last_error());
            rc = -1;
            continue;
        }
        child[n++] = j;
    }
    for (int i = 0; i < n; i++) {
        weft_status_t st = weft_future_wait(fs[i], CALL_MS);

        if (st != WEFT_OK) {
            fprintf(stderr, "value %d: hold of node %d: %s: %s\n", t->k, child[i],
                    weft_strerror(st), weft_future_error(fs[i]));
            rc = -1;
        } else if (vp->nodes[child[i]].echo) {
            weft_rref_t *back = weft_value_rref(weft_future_value(fs[i]), 0);
            ids_t ids;

            if (back == NULL || ids_of(weft_future_value(fs[i]), &ids) != 0 ||
                ids.h != MAX_NODES + child[i]) {
                fprintf(stderr, "value %d: node %d answered without the reference\n", t->k,
                        child[i]);
                rc = -1;
            } else {
                queue_push(t->k, ids.h, weft_rref_retain(back));
            }
        }
        weft_future_release(fs[i]);
    }
    return rc;
}

/* Uses the reference once more, tells the owner, then drops the handle. */
static int release_ref(weft_agent_t *a, task_t *t)
{
    int rc = use_ref(t);
    weft_value_t *args = value_of_ids(t->k, t->h);
    weft_status_t st = args != NULL ? weft_rpc_sync(a, OWNER, "releasing", args, CALL_MS, NULL)
                                    : WEFT_ERR_NO_MEMORY;

    weft_value_free(args);
    weft_rref_release(t->r);
    free(t);
    if (st != WEFT_OK) {
        fprintf(stderr, "releasing: %s: %s\n", weft_strerror(st), weft_last_error());
        return -1;
    }
    return rc;
}

/* Creates the roots of this rank's values; queues them. */
static int create_roots(weft_agent_t *a, int rank)
{
    for (int k = 0; k < g.plan->n_values; k++) {
        const value_plan_t *vp = &g.plan->v[k];
        weft_rref_t *r = NULL;
        weft_status_t st;

        if (vp->nodes[0].rank != rank) {
            continue;
        }
        if (vp->how == CREATE_OWNER) {
            weft_value_t *v = make_value(k, 1);

            st = v != NULL ? weft_rref_create(a, v, &r) : WEFT_ERR_NO_MEMORY;
            if (st != WEFT_OK) {
                weft_value_free(v);
            }
        } else {
            weft_value_t *args = value_of_ids(k, 0);

            st = args == NULL ? WEFT_ERR_NO_MEMORY
                 : vp->how == CREATE_REMOTE
                     ? weft_rref_remote(a, OWNER, "make", args, CALL_MS, &r)
                     : weft_rref_remote_object(a, OWNER, "cell", args, CALL_MS, &r);
            weft_value_free(args);
        }
        if (st != WEFT_OK) {
            fprintf(stderr, "value %d: create: %s: %s\n", k, weft_strerror(st), weft_last_error());
            return -1;
        }
        queue_push(k, 0, r);
    }
    return 0;
}

/*
 * Serves this rank's holders: uses and forwards each as it comes, and releases the held ones in
 * a random order (one at a time, by chance while others arrive, always when none is waiting).
 * The victim, once it has served all of its holders, dies holding them.
 */
static int serve_holders(weft_agent_t *a, int rank)
{
    task_t *held[MAX_VALUES * MAX_HOLDERS];
    int n_held = 0;
    int expected = plan_expected(g.plan, rank);
    int served = 0;
    int rc = 0;
    int64_t deadline = now_ms() + LOOP_MS;
    uint64_t s = (uint64_t)g.plan->seed * 1000003u + (uint64_t)rank * 7919u + 17u;

    if (create_roots(a, rank) != 0) {
        rc = -1;
    }
    while (served < expected || n_held > 0) {
        if (rank == g.plan->victim && served == expected) {
            fprintf(stderr, "rank %d: killing itself holding %d references\n", rank, n_held);
            raise(SIGKILL);
        }
        if (now_ms() > deadline) {
            fprintf(stderr, "rank %d: served %d of %d holders, %d held at the deadline\n", rank,
                    served, expected, n_held);
            return -1;
        }
        task_t *t = served < expected ? queue_pop(1 + rnd(&s) % 3) : NULL;
        if (t != NULL) {
            if (use_ref(t) != 0 || forward(a, t) != 0) {
                rc = -1;
            }
            held[n_held++] = t;
            served++;
        }
        if (n_held > 0 && rank != g.plan->victim && (t == NULL || rnd(&s) % 3 == 0)) {
            int i = (int)(rnd(&s) % (uint32_t)n_held);

            if (release_ref(a, held[i]) != 0) {
                rc = -1;
            }
            held[i] = held[--n_held];
        }
    }
    return rc;
}

/* The owner's checks once every live rank is done. */
static int owner_check(weft_agent_t *a)
{
    const plan_t *p = g.plan;
    char counts[512];
    int rc = 0;

    if (wait_counts_zero(a, SETTLE_MS, counts, sizeof(counts)) != 0) {
        fprintf(stderr, "owner: counts not back to zero: %s\n", counts);
        rc = -1;
    }
    if (json_count(counts, "deleted_owners") != p->n_values) {
        fprintf(stderr, "owner: %d values, deleted owners: %s\n", p->n_values, counts);
        rc = -1;
    }
    pthread_mutex_lock(&g.mu);
    for (int k = 0; k < p->n_values; k++) {
        const value_plan_t *vp = &p->v[k];

        int want_freed = vp->how == CREATE_REMOTE ? 0 : 1; /* see make_value */

        if (g.made[k] != 1 || g.freed[k] != want_freed || g.freed_early[k] != 0 ||
            g.released[k] != plan_releasers(p, k)) {
            fprintf(stderr,
                    "owner: value %d (kind %d): made %d, freed %d (%d early), %d of %d "
                    "released\n",
                    k, (int)vp->how, g.made[k], g.freed[k], g.freed_early[k], g.released[k],
                    plan_releasers(p, k));
            rc = -1;
        }
        for (int h = 0; h < MAX_HOLDERS; h++) {
            if (g.released_by[k][h] > 1) {
                fprintf(stderr, "owner: value %d holder %d released %d times\n", k, h,
                        g.released_by[k][h]);
                rc = -1;
            }
        }
    }
    pthread_mutex_unlock(&g.mu);
    return rc;
}

static int body(weft_agent_t *a, int rank, int world, void *arg)
{
    const plan_t *p = arg;
    char counts[512];
    int rc;

    (void)world;
    rc = serve_holders(a, rank);
    if (rank != OWNER) {
        /* This rank's own counts first, then the barrier the owner answers after its checks. */
        if (wait_counts_zero(a, SETTLE_MS, counts, sizeof(counts)) != 0) {
            fprintf(stderr, "rank %d: counts not back to zero: %s\n", rank, counts);
            rc = -1;
        }
        weft_status_t st = weft_rpc_sync(a, OWNER, "done", NULL, LOOP_MS, NULL);
        RANK_CHECK(st == WEFT_OK, "done: %s: %s", weft_strerror(st), weft_last_error());
        return rc == 0 ? 0 : 1;
    }
    int live = p->world - 1 - (p->victim > 0 ? 1 : 0);
    int64_t deadline = now_ms() + LOOP_MS;
    pthread_mutex_lock(&g.mu);
    while (g.n_done < live && now_ms() < deadline) {
        pthread_mutex_unlock(&g.mu);
        usleep(2000);
        pthread_mutex_lock(&g.mu);
    }
    int n_done = g.n_done;
    pthread_mutex_unlock(&g.mu);
    if (n_done < live) {
        fprintf(stderr, "owner: %d of %d ranks done at the deadline\n", n_done, live);
        rc = -1;
    } else if (owner_check(a) != 0) {
        rc = -1;
    }
    for (int i = 0; i < n_done; i++) {
        if (rc == 0) {
            weft_call_reply(g.done[i], NULL);
        } else {
            weft_call_fail(g.done[i], WEFT_ERR_MISMATCH, "the owner's checks failed");
        }
    }
    return rc == 0 ? 0 : 1;
}

/* ------------------------------------------------------------------ the tests */

/* Runs one plan under the fault injector (if @p faults); checks every rank's exit. */
static void run_plan(uint32_t seed, int world, int n_values, int victim, int faults)
{
    static plan_t plan;
    ranks_opts_t o;
    int codes[MAX_WORLD];
    int holders = 0;

    plan_make(&plan, seed, world, n_values, victim);
    for (int k = 0; k < n_values; k++) {
        for (int j = 0; j < plan.v[k].n_nodes; j++) {
            holders += 1 + plan.v[k].nodes[j].echo;
        }
    }
    fprintf(stderr, "seed %u: %d ranks, %d values, %d holders%s%s\n", seed, world, n_values,
            holders, faults ? ", faults injected" : "", victim > 0 ? ", a user killed" : "");
    if (faults) {
        setenv("WEFT_RREF_FAULT_DELAY_US", "2000", 1);
        setenv("WEFT_RREF_FAULT_DUP", "1", 1);
    } else {
        unsetenv("WEFT_RREF_FAULT_DELAY_US");
        unsetenv("WEFT_RREF_FAULT_DUP");
    }
    ranks_opts_init(&o, world, body);
    o.setup = setup;
    o.arg = &plan;
    o.deadline_ms = 55000;
    o.call_timeout_ms = CALL_MS;
    o.peer_timeout_ms = 1000;
    ranks_run(&o, codes);
    unsetenv("WEFT_RREF_FAULT_DELAY_US");
    unsetenv("WEFT_RREF_FAULT_DUP");
    for (int r = 0; r < world; r++) {
        int want = r == victim ? 128 + SIGKILL : 0;

        cr_assert_eq(codes[r], want, "seed %u: rank %d exited with %d, not %d", seed, r, codes[r],
                     want);
    }
}

Test(rref_forks, random_trees_without_faults, .timeout = 90)
{
    run_plan(1, 4, 6, -1, 0);
    run_plan(6, 7, 8, -1, 0);
}

Test(rref_forks, random_trees_under_faults_4_to_8_ranks, .timeout = 150)
{
    static const struct {
        uint32_t seed;
        int world;
        int values;
    } runs[] = {{2, 4, 6}, {3, 5, 6}, {4, 6, 6}, {5, 8, 6}, {7, 4, 8}, {8, 6, 8}, {9, 8, 8}};

    for (size_t i = 0; i < sizeof(runs) / sizeof(runs[0]); i++) {
        run_plan(runs[i].seed, runs[i].world, runs[i].values, -1, 1);
    }
}

/* The victim dies once it has used and forwarded every reference it gets, holding them all. */
Test(rref_forks, killed_user_mid_tree, .timeout = 120)
{
    run_plan(11, 5, 6, 3, 1);
    run_plan(12, 4, 4, 2, 1);
    run_plan(13, 6, 8, 5, 1);
}
