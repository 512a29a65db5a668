/*
 * The engine with nodes that wait on futures (weft__ag_wait), as distributed autograd's nodes do:
 * a node's backward sends its gradient to a "peer" thread and waits; the peer answers (completes
 * the future) from its own thread, following a script whose every step first waits, with a
 * deadline, for what the engine must have done by then (requests made, nodes resumed, the engine
 * asleep, other nodes run). Nothing here sleeps for a fixed time, and every wait has a deadline.
 */
#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

#include <criterion/criterion.h>

#include "../core/counting_alloc.h"
#include "graph.h"

#include <weft/weft.h>

#define WAIT_MS      10000 /* the engine's wait bound in these tests, and the peer's waits */
#define MAX_REQUESTS 32    /* requests one test may make */

static double *D(weft_tensor_t *t)
{
    return weft_tensor_data(t);
}

static weft_tensor_t *vec(int64_t n, const double *v, int rg)
{
    weft_tensor_t *t = NULL;

    cr_assert_eq(weft_tensor_empty(WEFT_F64, 1, &n, &t), WEFT_OK);
    memcpy(D(t), v, (size_t)n * sizeof(double));
    if (rg) {
        cr_assert_eq(weft_tensor_set_requires_grad(t, 1), WEFT_OK);
    }
    return t;
}

/* Intermediate tensors of a test's graphs, released at its end (the graph needs only its root). */
static weft_tensor_t *kept[64];
static int n_kept;

static weft_tensor_t *K(weft_tensor_t *t)
{
    cr_assert_lt(n_kept, 64);
    kept[n_kept++] = t;
    return t;
}

static void release_kept(void)
{
    while (n_kept > 0) {
        weft_tensor_release(kept[--n_kept]);
    }
}

/* Every test ends here: nothing it allocated through weft may be left (LSan does not see into
 * criterion's test processes; the counting allocator does). */
static void board_reset(void);

static void test_end(void)
{
    board_reset();
    release_kept();
    check_balanced();
}

TestSuite(resume, .init = use_counting, .timeout = 60);

/* Bitwise equality of two f64 gradients. */
static void assert_same_grad(weft_tensor_t *a, weft_tensor_t *b)
{
    cr_assert_not_null(a);
    cr_assert_not_null(b);
    cr_assert_eq(weft_tensor_numel(a), weft_tensor_numel(b));
    for (int64_t i = 0; i < weft_tensor_numel(a); i++) {
        cr_assert_eq(D(a)[i], D(b)[i], "element %lld: %g, synchronous %g", (long long)i, D(a)[i],
                     D(b)[i]);
    }
}

/* ---- the board: what the engine's thread and the peer's thread see of each other ------------- */

typedef struct {
    weft_future_t *f; /* the answer */
    weft_tensor_t *g; /* the gradient sent, or NULL */
    double c;         /* the peer answers c * g */
} request_t;

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv; /* CLOCK_MONOTONIC; broadcast on every change */
    pthread_t engine;  /* the thread that runs backward */
    request_t req[MAX_REQUESTS];
    int made;     /* requests made by backward steps, in order */
    int resumed;  /* resume callbacks run */
    int sleeps;   /* times the engine's thread went to sleep on futures */
    int sync_run; /* backward of the synchronous ops run */
    int waiting_max;
    int off_thread;  /* resume callbacks that ran off the engine's thread */
    int bad_arg;     /* resume callbacks that got another arg than was given */
    int answered;    /* requests the peer answered */
    int peer_failed; /* 1 + the script step whose wait ran out, or 0 */
    int peer_bad;    /* answers the peer could not make */
    int hook_calls;  /* grad hook calls on the leaf */
} B = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void block_hook(int entering, void *arg)
{
    (void)arg;
    if (entering) {
        pthread_mutex_lock(&B.mu);
        B.sleeps++;
        pthread_cond_broadcast(&B.cv);
        pthread_mutex_unlock(&B.mu);
    }
}

/* Empties the board, makes the calling thread the engine's, and counts its sleeps on futures. */
static void board_reset(void)
{
    static int cv_ready;
    pthread_condattr_t attr;

    if (!cv_ready) {
        pthread_condattr_init(&attr);
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
        pthread_cond_init(&B.cv, &attr);
        pthread_condattr_destroy(&attr);
        cv_ready = 1;
    }
    pthread_mutex_lock(&B.mu);
    for (int i = 0; i < B.made; i++) {
        weft_future_release(B.req[i].f);
        weft_tensor_release(B.req[i].g);
    }
    memset(B.req, 0, sizeof(B.req));
    B.made = B.resumed = B.sleeps = B.sync_run = B.waiting_max = 0;
    B.off_thread = B.bad_arg = B.answered = B.peer_failed = B.peer_bad = B.hook_calls = 0;
    B.engine = pthread_self();
    pthread_mutex_unlock(&B.mu);
    weft__set_block_hook(block_hook, NULL);
}

static void board_bump(int *counter)
{
    pthread_mutex_lock(&B.mu);
    (*counter)++;
    pthread_cond_broadcast(&B.cv);
    pthread_mutex_unlock(&B.mu);
}

/* A request for the peer: answer @p f with c * g (the board keeps references to both). */
static void board_request(weft_future_t *f, weft_tensor_t *g, double c)
{
    pthread_mutex_lock(&B.mu);
    cr_assert_lt(B.made, MAX_REQUESTS);
    B.req[B.made].f = weft_future_retain(f);
    B.req[B.made].g = weft_tensor_retain(g);
    B.req[B.made].c = c;
    B.made++;
    if (B.made - B.resumed > B.waiting_max) {
        B.waiting_max = B.made - B.resumed;
    }
    pthread_cond_broadcast(&B.cv);
    pthread_mutex_unlock(&B.mu);
}

/* Inside a resume callback: counts it and checks that it runs on the engine's thread. */
static void board_resumed(void)
{
    pthread_mutex_lock(&B.mu);
    B.resumed++;
    if (!pthread_equal(pthread_self(), B.engine)) {
        B.off_thread++;
    }
    pthread_cond_broadcast(&B.cv);
    pthread_mutex_unlock(&B.mu);
}

/* Answers a request with a value holding c * g (no tensor when g is NULL); 1 when it did. Any
 * thread (no assertions: the peer's thread uses it). */
static int answer_ok(const request_t *rq)
{
    weft_value_t *v = NULL;
    weft_tensor_t *t = NULL;

    if (weft_value_create(&v) != WEFT_OK) {
        return 0;
    }
    if (rq->g != NULL) {
        if (weft_tensor_clone(rq->g, &t) != WEFT_OK) {
            weft_value_free(v);
            return 0;
        }
        for (int64_t i = 0; i < weft_tensor_numel(t); i++) {
            D(t)[i] *= rq->c;
        }
        if (weft_value_push_tensor(v, t) != WEFT_OK) {
            weft_tensor_release(t);
            weft_value_free(v);
            return 0;
        }
    }
    return weft_future_complete(rq->f, WEFT_OK, NULL, v);
}

/* ---- the peer: a thread that answers requests by a script ----------------------------------- */

typedef struct {
    int req;              /* which request, in the order made */
    int made;             /* first wait until at least this many were made, */
    int resumed;          /* this many resume callbacks ran, */
    int sleeps;           /* the engine went to sleep this many times, */
    int sync_run;         /* and this many synchronous backward callbacks ran */
    weft_status_t status; /* WEFT_OK: answer c * g; else fail the future with text */
    const char *text;
} step_t;

typedef struct {
    const step_t *steps;
    int n;
    pthread_t th;
} peer_t;

static int step_ready(const step_t *s)
{
    return B.made >= s->made && B.made > s->req && B.resumed >= s->resumed &&
           B.sleeps >= s->sleeps && B.sync_run >= s->sync_run;
}

static void *peer_main(void *arg)
{
    peer_t *p = arg;

    for (int i = 0; i < p->n; i++) {
        const step_t *s = &p->steps[i];
        struct timespec dl;
        request_t rq;

        clock_gettime(CLOCK_MONOTONIC, &dl);
        dl.tv_sec += WAIT_MS / 1000;
        pthread_mutex_lock(&B.mu);
        while (!step_ready(s)) {
            if (pthread_cond_timedwait(&B.cv, &B.mu, &dl) == ETIMEDOUT && !step_ready(s)) {
                B.peer_failed = i + 1;
                pthread_cond_broadcast(&B.cv);
                pthread_mutex_unlock(&B.mu);
                return NULL;
            }
        }
        rq = B.req[s->req];
        pthread_mutex_unlock(&B.mu);
        if (s->status == WEFT_OK ? !answer_ok(&rq)
                                 : !weft_future_fail(rq.f, s->status, "%s", s->text)) {
            board_bump(&B.peer_bad);
        }
        board_bump(&B.answered);
    }
    return NULL;
}

static void peer_start(peer_t *p, const step_t *steps, int n)
{
    p->steps = steps;
    p->n = n;
    cr_assert_eq(pthread_create(&p->th, NULL, peer_main, p), 0);
}

/* Joins the peer (its waits are bounded, and so is this) and checks that its script ran out. */
static void peer_join(peer_t *p)
{
    struct timespec dl;

    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += 2 * WAIT_MS / 1000;
    cr_assert_eq(pthread_timedjoin_np(p->th, NULL, &dl), 0, "the peer did not finish");
    cr_assert_eq(B.peer_failed, 0,
                 "the peer's step %d waited in vain (made %d, resumed %d, "
                 "sleeps %d, sync %d)",
                 B.peer_failed, B.made, B.resumed, B.sleeps, B.sync_run);
    cr_assert_eq(B.peer_bad, 0, "the peer could not answer");
}

static weft_status_t backward_bounded(weft_tensor_t *root, weft_tensor_t *grad, bool retain)
{
    weft_backward_opts_t o;

    weft_backward_opts_init(&o);
    o.retain_graph = retain;
    o.wait_timeout_ms = WAIT_MS;
    return weft_backward_run(1, &root, &grad, &o);
}

/* ---- operations ----------------------------------------------------------------------------- */

/* y = c * x, synchronous. */
static weft_status_t scale_bw(weft__ag_node_t *n, weft_tensor_t *const *go, weft_tensor_t **gi)
{
    WEFT_CHECK(weft_tensor_clone(go[0], &gi[0]));
    for (int64_t i = 0; i < weft_tensor_numel(gi[0]); i++) {
        D(gi[0])[i] *= n->dargs[0];
    }
    board_bump(&B.sync_run);
    return WEFT_OK;
}

static weft_tensor_t *scale(weft_tensor_t *x, double c)
{
    weft_tensor_t *y = NULL;
    weft__ag_node_t *n;

    cr_assert_eq(weft_tensor_clone(x, &y), WEFT_OK);
    for (int64_t i = 0; i < weft_tensor_numel(y); i++) {
        D(y)[i] *= c;
    }
    cr_assert_eq(weft__ag_node_new("ScaleBackward", scale_bw, 1, &x, &n), WEFT_OK);
    n->dargs[0] = c;
    cr_assert_eq(weft__ag_attach(n, 1, &y), WEFT_OK);
    weft__ag_node_unref(n);
    return y;
}

/*
 * y = c1 * c2 * ... * x, with the gradient computed by the peer: backward sends grad_out with c1
 * and waits; each resume takes the peer's answer and either sends it on with the next factor and
 * waits again, or gives it as the input's gradient. iargs: [0] rounds, [1] rounds done, [2] fail
 * in the last resume. Saves x (unused) so that backward without retain_graph frees something.
 */
static weft_status_t remote_resume(weft__ag_node_t *n, weft_future_t *f, void *arg,
                                   weft_tensor_t *const *go, weft_tensor_t **gi);

static weft_status_t remote_send(weft__ag_node_t *n, weft_tensor_t *g)
{
    weft_future_t *f = NULL;
    weft_status_t st;

    WEFT_CHECK(weft_future_create(&f));
    board_request(f, g, n->dargs[n->iargs[1]]);
    st = weft__ag_wait(n, f, remote_resume, n);
    weft_future_release(f);
    return st;
}

static weft_status_t remote_bw(weft__ag_node_t *n, weft_tensor_t *const *go, weft_tensor_t **gi)
{
    (void)gi;
    n->iargs[1] = 0;
    return remote_send(n, go[0]);
}

static weft_status_t remote_resume(weft__ag_node_t *n, weft_future_t *f, void *arg,
                                   weft_tensor_t *const *go, weft_tensor_t **gi)
{
    weft_value_t *v = NULL;
    weft_tensor_t *t;
    weft_status_t st;

    (void)go;
    board_resumed();
    if (arg != n) {
        board_bump(&B.bad_arg);
    }
    cr_assert_eq(weft_future_status(f), WEFT_OK, "resume is called for completed futures only");
    WEFT_CHECK(weft_future_take_value(f, &v));
    t = weft_tensor_retain(weft_value_tensor(v, 0));
    weft_value_free(v);
    if (++n->iargs[1] < n->iargs[0]) {
        st = remote_send(n, t);
        weft_tensor_release(t);
        return st;
    }
    if (n->iargs[2]) {
        weft_tensor_release(t);
        return weft__set_error(WEFT_ERR_SHAPE, "the peer's answer has 3 elements, not 2");
    }
    gi[0] = t;
    return WEFT_OK;
}

static weft_tensor_t *remote(weft_tensor_t *x, int rounds, const double *c, int fail)
{
    weft_tensor_t *y = NULL;
    weft__ag_node_t *n;

    cr_assert_eq(weft_tensor_clone(x, &y), WEFT_OK);
    for (int r = 0; r < rounds; r++) {
        for (int64_t i = 0; i < weft_tensor_numel(y); i++) {
            D(y)[i] *= c[r];
        }
    }
    cr_assert_eq(weft__ag_node_new("RemoteScaleBackward", remote_bw, 1, &x, &n), WEFT_OK);
    for (int r = 0; r < rounds; r++) {
        n->dargs[r] = c[r];
    }
    n->iargs[0] = rounds;
    n->iargs[2] = fail;
    cr_assert_eq(weft__ag_save(n, x), WEFT_OK);
    cr_assert_eq(weft__ag_attach(n, 1, &y), WEFT_OK);
    weft__ag_node_unref(n);
    return y;
}

static weft_tensor_t *remote1(weft_tensor_t *x, double c)
{
    return remote(x, 1, &c, 0);
}

/* z = x * y elementwise; saves both. */
static weft_status_t mul_bw(weft__ag_node_t *n, weft_tensor_t *const *go, weft_tensor_t **gi)
{
    for (int k = 0; k < 2; k++) {
        if (!weft__ag_needs_grad(n, k)) {
            continue;
        }
        WEFT_CHECK(weft_tensor_clone(go[0], &gi[k]));
        for (int64_t i = 0; i < weft_tensor_numel(gi[k]); i++) {
            D(gi[k])[i] *= D(n->saved[1 - k])[i];
        }
    }
    board_bump(&B.sync_run);
    return WEFT_OK;
}

static weft_tensor_t *mul(weft_tensor_t *x, weft_tensor_t *y)
{
    weft_tensor_t *in[2] = {x, y};
    weft_tensor_t *z = NULL;
    weft__ag_node_t *n;

    cr_assert_eq(weft_tensor_clone(x, &z), WEFT_OK);
    for (int64_t i = 0; i < weft_tensor_numel(z); i++) {
        D(z)[i] *= D(y)[i];
    }
    cr_assert_eq(weft__ag_node_new("MulBackward", mul_bw, 2, in, &n), WEFT_OK);
    cr_assert_eq(weft__ag_save(n, x), WEFT_OK);
    cr_assert_eq(weft__ag_save(n, y), WEFT_OK);
    cr_assert_eq(weft__ag_attach(n, 1, &z), WEFT_OK);
    weft__ag_node_unref(n);
    return z;
}

/* z = x + y (same shapes). */
static weft_status_t add_bw(weft__ag_node_t *n, weft_tensor_t *const *go, weft_tensor_t **gi)
{
    for (int k = 0; k < 2; k++) {
        if (weft__ag_needs_grad(n, k)) {
            WEFT_CHECK(weft_tensor_clone(go[0], &gi[k]));
        }
    }
    board_bump(&B.sync_run);
    return WEFT_OK;
}

static weft_tensor_t *add(weft_tensor_t *x, weft_tensor_t *y)
{
    weft_tensor_t *in[2] = {x, y};
    weft_tensor_t *z = NULL;
    weft__ag_node_t *n;

    cr_assert_eq(weft_tensor_clone(x, &z), WEFT_OK);
    for (int64_t i = 0; i < weft_tensor_numel(z); i++) {
        D(z)[i] += D(y)[i];
    }
    cr_assert_eq(weft__ag_node_new("AddBackward", add_bw, 2, in, &n), WEFT_OK);
    cr_assert_eq(weft__ag_attach(n, 1, &z), WEFT_OK);
    weft__ag_node_unref(n);
    return z;
}

/* The sum of all elements, [1]. */
static weft_status_t sum_bw(weft__ag_node_t *n, weft_tensor_t *const *go, weft_tensor_t **gi)
{
    WEFT_CHECK(weft_tensor_empty(WEFT_F64, n->in_ndim[0], n->in_shape[0], &gi[0]));
    for (int64_t i = 0; i < weft_tensor_numel(gi[0]); i++) {
        D(gi[0])[i] = D(go[0])[0];
    }
    board_bump(&B.sync_run);
    return WEFT_OK;
}

static weft_tensor_t *sum(weft_tensor_t *x)
{
    int64_t one = 1;
    weft_tensor_t *s = NULL;
    weft__ag_node_t *n;

    cr_assert_eq(weft_tensor_create(WEFT_F64, 1, &one, &s), WEFT_OK);
    for (int64_t i = 0; i < weft_tensor_numel(x); i++) {
        D(s)[0] += D(x)[i];
    }
    cr_assert_eq(weft__ag_node_new("SumBackward", sum_bw, 1, &x, &n), WEFT_OK);
    cr_assert_eq(weft__ag_attach(n, 1, &s), WEFT_OK);
    weft__ag_node_unref(n);
    return s;
}

static weft_status_t count_hook(weft_tensor_t *param, weft_tensor_t *grad, void *arg)
{
    (void)param;
    (void)grad;
    (void)arg;
    B.hook_calls++;
    return WEFT_OK;
}

/* ---- tests ---------------------------------------------------------------------------------- */

Test(resume, a_waiting_node_resumes_on_the_engines_thread_with_the_synchronous_gradient)
{
    const step_t script[] = {{.req = 0, .made = 1, .sleeps = 1}};
    weft_tensor_t *x = vec(3, (double[]){1, 2, 3}, 1);
    weft_tensor_t *y = remote1(x, 3);
    weft_tensor_t *s = sum(K(mul(y, x))); /* 3 x^2 */
    weft_tensor_t *x2 = vec(3, (double[]){1, 2, 3}, 1);
    weft_tensor_t *s2 = sum(K(mul(K(scale(x2, 3)), x2)));
    peer_t peer;

    cr_assert_str_eq(weft_tensor_grad_fn_name(y), "RemoteScaleBackward");
    board_reset();
    peer_start(&peer, script, 1);
    cr_assert_eq(backward_bounded(s, NULL, false), WEFT_OK, "%s", weft_last_error());
    peer_join(&peer);
    cr_assert_eq(B.made, 1);
    cr_assert_eq(B.resumed, 1);
    cr_assert_eq(B.off_thread, 0, "resume must run on the engine's thread");
    cr_assert_eq(B.bad_arg, 0);
    cr_assert_geq(B.sleeps, 1, "the engine slept on the future until the peer answered");
    cr_assert_eq(weft_backward(s2, NULL, 0), WEFT_OK, "%s", weft_last_error());
    assert_same_grad(weft_tensor_grad(x), weft_tensor_grad(x2));
    cr_assert_eq(D(weft_tensor_grad(x))[2], 18.0);
    /* Without retain_graph the graph is freed: a second backward says so. */
    cr_assert_eq(weft_backward(s, NULL, 0), WEFT_ERR_INVALID_STATE);
    weft_tensor_release(s);
    weft_tensor_release(s2);
    weft_tensor_release(y);
    weft_tensor_release(x);
    weft_tensor_release(x2);
    test_end();
}

/* Two nodes wait at once; the peer answers them in the order @p first, then the other. */
static void two_waiting_nodes(int first)
{
    const step_t script[] = {
        {.req = first, .made = 2, .sleeps = 1},
        {.req = 1 - first, .made = 2, .resumed = 1},
    };
    weft_tensor_t *x = vec(2, (double[]){1.5, -2}, 1);
    weft_tensor_t *a = remote1(x, 2);
    weft_tensor_t *b = remote1(x, 5);
    weft_tensor_t *c = mul(a, b); /* 10 x^2 */
    weft_tensor_t *g = vec(2, (double[]){1, 0.5}, 0);
    weft_tensor_t *x2 = vec(2, (double[]){1.5, -2}, 1);
    weft_tensor_t *c2 = mul(K(scale(x2, 2)), K(scale(x2, 5)));
    peer_t peer;

    cr_assert_eq(weft_tensor_add_grad_hook(x, count_hook, NULL, NULL), WEFT_OK);
    board_reset();
    peer_start(&peer, script, 2);
    cr_assert_eq(backward_bounded(c, g, false), WEFT_OK, "%s", weft_last_error());
    peer_join(&peer);
    cr_assert_eq(B.waiting_max, 2, "both nodes waited at once");
    cr_assert_eq(B.resumed, 2);
    cr_assert_eq(B.off_thread, 0);
    cr_assert_eq(B.hook_calls, 1, "the leaf's hook fires once, after both gradients are in");
    cr_assert_eq(weft_backward(c2, g, 0), WEFT_OK, "%s", weft_last_error());
    assert_same_grad(weft_tensor_grad(x), weft_tensor_grad(x2));
    cr_assert_eq(D(weft_tensor_grad(x))[0], 30.0);
    cr_assert_eq(D(weft_tensor_grad(x))[1], -20.0);
    weft_tensor_release(c);
    weft_tensor_release(c2);
    weft_tensor_release(b);
    weft_tensor_release(a);
    weft_tensor_release(g);
    weft_tensor_release(x);
    weft_tensor_release(x2);
    test_end();
}

Test(resume, two_waiting_nodes_answered_in_the_order_they_waited)
{
    two_waiting_nodes(0);
}

Test(resume, two_waiting_nodes_answered_in_the_other_order)
{
    two_waiting_nodes(1);
}

Test(resume, the_engine_runs_ready_nodes_while_one_waits)
{
    /* The peer answers only after the synchronous branch ran: an engine that blocked on the
     * waiting node would never get there (and the peer's wait would run out). */
    const step_t script[] = {{.req = 0, .made = 1, .sync_run = 3}};
    weft_tensor_t *x = vec(2, (double[]){3, 4}, 1);
    weft_tensor_t *b = scale(x, 5);   /* made first: runs after the remote node */
    weft_tensor_t *a = remote1(x, 2); /* made later: runs (and waits) first */
    weft_tensor_t *s = sum(K(mul(a, b)));
    weft_tensor_t *x2 = vec(2, (double[]){3, 4}, 1);
    weft_tensor_t *b2 = scale(x2, 5);
    weft_tensor_t *s2 = sum(K(mul(K(scale(x2, 2)), b2)));
    peer_t peer;

    board_reset();
    peer_start(&peer, script, 1);
    cr_assert_eq(backward_bounded(s, NULL, false), WEFT_OK, "%s", weft_last_error());
    peer_join(&peer);
    cr_assert_eq(B.sync_run, 3, "sum, mul and scale ran");
    cr_assert_eq(weft_backward(s2, NULL, 0), WEFT_OK, "%s", weft_last_error());
    assert_same_grad(weft_tensor_grad(x), weft_tensor_grad(x2));
    weft_tensor_release(s);
    weft_tensor_release(s2);
    weft_tensor_release(a);
    weft_tensor_release(b);
    weft_tensor_release(b2);
    weft_tensor_release(x);
    weft_tensor_release(x2);
    test_end();
}

Test(resume, a_node_waits_twice_in_a_row)
{
    const step_t script[] = {
        {.req = 0, .made = 1, .sleeps = 1},
        {.req = 1, .made = 2, .resumed = 1, .sleeps = 2},
    };
    weft_tensor_t *x = vec(2, (double[]){1, -3}, 1);
    weft_tensor_t *y = remote(x, 2, (double[]){2, 3}, 0);
    weft_tensor_t *g = vec(2, (double[]){1, 2}, 0);
    weft_tensor_t *x2 = vec(2, (double[]){1, -3}, 1);
    weft_tensor_t *y2 = scale(K(scale(x2, 2)), 3);
    peer_t peer;

    board_reset();
    peer_start(&peer, script, 2);
    cr_assert_eq(backward_bounded(y, g, true), WEFT_OK, "%s", weft_last_error());
    peer_join(&peer);
    cr_assert_eq(B.made, 2);
    cr_assert_eq(B.resumed, 2);
    cr_assert_eq(B.waiting_max, 1);
    cr_assert_eq(B.off_thread, 0);
    cr_assert_eq(weft_backward(y2, g, 0), WEFT_OK, "%s", weft_last_error());
    assert_same_grad(weft_tensor_grad(x), weft_tensor_grad(x2));
    cr_assert_eq(D(weft_tensor_grad(x))[1], 12.0);

    /* retain_graph kept the waiting node's state: the same graph runs again and accumulates. */
    board_reset();
    peer_start(&peer, script, 2);
    cr_assert_eq(backward_bounded(y, g, false), WEFT_OK, "%s", weft_last_error());
    peer_join(&peer);
    cr_assert_eq(D(weft_tensor_grad(x))[1], 24.0);
    /* Now it is freed, once its last resume finished. */
    cr_assert_eq(backward_bounded(y, g, false), WEFT_ERR_INVALID_STATE);
    cr_assert(strstr(weft_last_error(), "RemoteScaleBackward") != NULL, "%s", weft_last_error());
    weft_tensor_release(g);
    weft_tensor_release(y);
    weft_tensor_release(y2);
    weft_tensor_release(x);
    weft_tensor_release(x2);
    test_end();
}

Test(resume, many_nodes_answered_in_a_shuffled_order)
{
    enum { N = 20 };
    const int order[N] = {7, 19, 0, 3, 12, 18, 1, 5, 16, 9, 2, 14, 11, 6, 17, 4, 10, 15, 8, 13};
    step_t script[N];
    weft_tensor_t *x = vec(3, (double[]){1, 2, -1}, 1);
    weft_tensor_t *x2 = vec(3, (double[]){1, 2, -1}, 1);
    weft_tensor_t *acc = NULL;
    weft_tensor_t *acc2 = NULL;
    weft_tensor_t *s;
    weft_tensor_t *s2;
    peer_t peer;

    for (int i = 0; i < N; i++) {
        weft_tensor_t *y = remote1(x, i + 1);
        weft_tensor_t *y2 = scale(x2, i + 1);

        if (acc == NULL) {
            acc = y;
            acc2 = y2;
        } else {
            weft_tensor_t *t = add(acc, y);
            weft_tensor_t *t2 = add(acc2, y2);

            weft_tensor_release(acc);
            weft_tensor_release(acc2);
            weft_tensor_release(y);
            weft_tensor_release(y2);
            acc = t;
            acc2 = t2;
        }
        /* Answer in a fixed shuffle, each after the previous answer was taken in. */
        script[i] = (step_t){.req = order[i], .made = N, .resumed = i};
    }
    s = sum(acc);
    s2 = sum(acc2);
    cr_assert_eq(weft_tensor_add_grad_hook(x, count_hook, NULL, NULL), WEFT_OK);
    board_reset();
    peer_start(&peer, script, N);
    cr_assert_eq(backward_bounded(s, NULL, false), WEFT_OK, "%s", weft_last_error());
    peer_join(&peer);
    cr_assert_eq(B.waiting_max, N, "every remote node waited at once");
    cr_assert_eq(B.resumed, N);
    cr_assert_eq(B.off_thread, 0);
    cr_assert_eq(B.hook_calls, 1);
    cr_assert_eq(weft_backward(s2, NULL, 0), WEFT_OK, "%s", weft_last_error());
    assert_same_grad(weft_tensor_grad(x), weft_tensor_grad(x2));
    cr_assert_eq(D(weft_tensor_grad(x))[0], N * (N + 1) / 2.0);
    weft_tensor_release(s);
    weft_tensor_release(s2);
    weft_tensor_release(acc);
    weft_tensor_release(acc2);
    weft_tensor_release(x);
    weft_tensor_release(x2);
    test_end();
}

Test(resume, a_failed_future_fails_backward_and_abandons_the_other_wait)
{
    /* Request 0 is b's (b runs first); it fails while a's stays pending. */
    const step_t failing[] = {{.req = 0,
                               .made = 2,
                               .sleeps = 1,
                               .status = WEFT_ERR_PEER_LOST,
                               .text = "worker1 is gone"}};
    const step_t both[] = {{.req = 0, .made = 2, .sleeps = 1}, {.req = 1, .made = 2}};
    weft_tensor_t *x = vec(2, (double[]){1, 2}, 1);
    weft_tensor_t *a = remote1(x, 2);
    weft_tensor_t *b = remote1(x, 5);
    weft_tensor_t *s = sum(K(mul(a, b)));
    weft_future_t *late;
    peer_t peer;

    cr_assert_eq(weft_tensor_add_grad_hook(x, count_hook, NULL, NULL), WEFT_OK);
    board_reset();
    peer_start(&peer, failing, 1);
    cr_assert_eq(backward_bounded(s, NULL, true), WEFT_ERR_PEER_LOST);
    cr_assert(strstr(weft_last_error(), "RemoteScaleBackward") != NULL, "%s", weft_last_error());
    cr_assert(strstr(weft_last_error(), "worker1 is gone") != NULL, "%s", weft_last_error());
    peer_join(&peer);
    cr_assert_eq(B.resumed, 0, "resume is not called for a failed future");
    cr_assert_null(weft_tensor_grad(x), "a failed backward gives no gradient");
    cr_assert_eq(B.hook_calls, 0);
    /* The abandoned wait's future completes after backward returned: the engine is not in it
     * any more (ASan would see a use after free). */
    late = weft_future_retain(B.req[1].f);
    cr_assert(answer_ok(&B.req[1]));
    cr_assert_eq(weft_future_status(late), WEFT_OK);
    weft_future_release(late);

    /* With retain_graph the graph is whole after the failed backward: it runs again. */
    board_reset();
    peer_start(&peer, both, 2);
    cr_assert_eq(backward_bounded(s, NULL, false), WEFT_OK, "%s", weft_last_error());
    peer_join(&peer);
    cr_assert_eq(D(weft_tensor_grad(x))[1], 40.0);
    cr_assert_eq(B.hook_calls, 1);
    weft_tensor_release(s);
    weft_tensor_release(b);
    weft_tensor_release(a);
    weft_tensor_release(x);
    test_end();
}

Test(resume, a_failing_resume_fails_backward_naming_the_node)
{
    const step_t script[] = {{.req = 0, .made = 1}, {.req = 1, .made = 2, .resumed = 1}};
    weft_tensor_t *x = vec(2, (double[]){1, 2}, 1);
    weft_tensor_t *y = remote(x, 2, (double[]){2, 3}, 1);
    weft_tensor_t *s = sum(y);

    peer_t peer;

    board_reset();
    peer_start(&peer, script, 2);
    cr_assert_eq(backward_bounded(s, NULL, false), WEFT_ERR_SHAPE);
    cr_assert(strstr(weft_last_error(), "resuming RemoteScaleBackward") != NULL, "%s",
              weft_last_error());
    cr_assert(strstr(weft_last_error(), "3 elements, not 2") != NULL, "%s", weft_last_error());
    peer_join(&peer);
    cr_assert_eq(B.resumed, 2);
    cr_assert_null(weft_tensor_grad(x));
    weft_tensor_release(s);
    weft_tensor_release(y);
    weft_tensor_release(x);
    test_end();
}

Test(resume, a_wait_is_bounded_by_wait_timeout_ms)
{
    weft_tensor_t *x = vec(2, (double[]){1, 2}, 1);
    weft_tensor_t *y = remote1(x, 2);
    weft_tensor_t *s = sum(y);
    weft_backward_opts_t o;
    int64_t t0;
    int64_t took;

    board_reset();
    weft_backward_opts_init(&o);
    o.wait_timeout_ms = 100; /* nobody answers */
    t0 = weft__now_ms();
    cr_assert_eq(weft_backward_run(1, &s, NULL, &o), WEFT_ERR_TIMEOUT);
    took = weft__now_ms() - t0;
    cr_assert(strstr(weft_last_error(), "RemoteScaleBackward") != NULL, "%s", weft_last_error());
    cr_assert(strstr(weft_last_error(), "wait_timeout_ms") != NULL, "%s", weft_last_error());
    cr_assert_geq(took, 100, "gave up after %lld ms", (long long)took);
    cr_assert_lt(took, WAIT_MS, "gave up after %lld ms", (long long)took);
    cr_assert_leq(B.sleeps, 3, "the engine sleeps until the deadline, it does not poll (%d sleeps)",
                  B.sleeps);
    cr_assert_null(weft_tensor_grad(x));
    /* The answer comes late, into nothing. */
    cr_assert(answer_ok(&B.req[0]));
    weft_tensor_release(s);
    weft_tensor_release(y);
    weft_tensor_release(x);
    test_end();
}

/* A backward that answers its own request before waiting: nothing to sleep for. */
static weft_status_t ready_bw(weft__ag_node_t *n, weft_tensor_t *const *go, weft_tensor_t **gi)
{
    weft_status_t st;

    (void)gi;
    n->iargs[1] = 0;
    st = remote_send(n, go[0]);
    if (!answer_ok(&B.req[B.made - 1])) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ready: could not answer");
    }
    return st;
}

Test(resume, a_future_done_before_the_wait_resumes_without_sleeping)
{
    weft_tensor_t *x = vec(2, (double[]){1, 2}, 1);
    weft_tensor_t *y = NULL;
    weft_tensor_t *s;
    weft__ag_node_t *n;

    /* The remote node's resume, with a backward that answers its own request at once. */
    cr_assert_eq(weft__ag_node_new("ReadyBackward", ready_bw, 1, &x, &n), WEFT_OK);
    n->dargs[0] = 4;
    n->iargs[0] = 1;
    cr_assert_eq(weft_tensor_clone(x, &y), WEFT_OK);
    cr_assert_eq(weft__ag_attach(n, 1, &y), WEFT_OK);
    weft__ag_node_unref(n);
    s = sum(y);
    board_reset();
    cr_assert_eq(backward_bounded(s, NULL, false), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(B.resumed, 1);
    cr_assert_eq(B.sleeps, 0, "the engine slept although the future was done");
    cr_assert_eq(D(weft_tensor_grad(x))[0], 4.0);
    weft_tensor_release(s);
    weft_tensor_release(y);
    weft_tensor_release(x);
    test_end();
}

/* Rows of a [V, 2] table, whose gradient comes back sparse from a resume. */
static weft_status_t rows_resume(weft__ag_node_t *n, weft_future_t *f, void *arg,
                                 weft_tensor_t *const *go, weft_tensor_t **gi)
{
    (void)f;
    (void)arg;
    (void)gi;
    board_resumed();
    return weft__ag_grad_sparse(n, 0, n->saved[0], go[0]);
}

static weft_status_t rows_bw(weft__ag_node_t *n, weft_tensor_t *const *go, weft_tensor_t **gi)
{
    weft_future_t *f = NULL;
    weft_status_t st;

    (void)gi;
    if (n->iargs[0] == 0) {
        return weft__ag_grad_sparse(n, 0, n->saved[0], go[0]);
    }
    WEFT_CHECK(weft_future_create(&f));
    board_request(f, NULL, 0);
    st = weft__ag_wait(n, f, rows_resume, NULL);
    weft_future_release(f);
    return st;
}

static weft_tensor_t *rows(weft_tensor_t *table, int64_t k, const int64_t *ix, int waits)
{
    int64_t shape[2] = {k, 2};
    weft_tensor_t *idx = NULL;
    weft_tensor_t *out = NULL;
    weft__ag_node_t *n;

    cr_assert_eq(weft_tensor_empty(WEFT_I64, 1, &k, &idx), WEFT_OK);
    memcpy(weft_tensor_data(idx), ix, (size_t)k * sizeof(int64_t));
    cr_assert_eq(weft_tensor_empty(WEFT_F64, 2, shape, &out), WEFT_OK);
    for (int64_t r = 0; r < k; r++) {
        D(out)[2 * r] = D(table)[2 * ix[r]];
        D(out)[2 * r + 1] = D(table)[2 * ix[r] + 1];
    }
    cr_assert_eq(weft__ag_node_new("RowsBackward", rows_bw, 1, &table, &n), WEFT_OK);
    n->iargs[0] = waits;
    cr_assert_eq(weft__ag_save(n, idx), WEFT_OK);
    cr_assert_eq(weft__ag_attach(n, 1, &out), WEFT_OK);
    weft__ag_node_unref(n);
    weft_tensor_release(idx);
    return out;
}

Test(resume, a_resume_gives_a_sparse_gradient)
{
    const step_t script[] = {{.req = 0, .made = 1, .sleeps = 1}};
    int64_t shape[2] = {4, 2};
    weft_tensor_t *t[2];
    weft_tensor_t *s[2];
    weft_tensor_t *r[2];
    weft_tensor_t *idx[2];
    weft_tensor_t *val[2];
    peer_t peer;

    for (int k = 0; k < 2; k++) {
        cr_assert_eq(weft_tensor_empty(WEFT_F64, 2, shape, &t[k]), WEFT_OK);
        for (int i = 0; i < 8; i++) {
            D(t[k])[i] = i + 1;
        }
        cr_assert_eq(weft_tensor_set_requires_grad(t[k], 1), WEFT_OK);
        r[k] = rows(t[k], 3, (int64_t[]){2, 0, 2}, k == 0);
        s[k] = sum(K(mul(r[k], r[k])));
    }
    board_reset();
    peer_start(&peer, script, 1);
    cr_assert_eq(backward_bounded(s[0], NULL, false), WEFT_OK, "%s", weft_last_error());
    peer_join(&peer);
    cr_assert_eq(B.resumed, 1);
    cr_assert_eq(weft_backward(s[1], NULL, 0), WEFT_OK, "%s", weft_last_error());
    for (int k = 0; k < 2; k++) {
        cr_assert_null(weft_tensor_grad(t[k]));
        cr_assert_eq(weft_tensor_sparse_grad(t[k], &idx[k], &val[k]), WEFT_OK);
    }
    cr_assert_eq(memcmp(weft_tensor_data(idx[0]), weft_tensor_data(idx[1]), 3 * sizeof(int64_t)),
                 0);
    assert_same_grad(val[0], val[1]);
    for (int k = 0; k < 2; k++) {
        weft_tensor_release(s[k]);
        weft_tensor_release(r[k]);
        weft_tensor_release(t[k]);
    }
    test_end();
}

/* Misuses of weft__ag_wait, chosen by iargs[0]. */
enum { BAD_OK_AFTER_WAIT, BAD_GRAD_AND_WAIT, BAD_FAIL_AFTER_WAIT, BAD_WAIT_TWICE };

static weft_status_t identity_resume(weft__ag_node_t *n, weft_future_t *f, void *arg,
                                     weft_tensor_t *const *go, weft_tensor_t **gi)
{
    (void)n;
    (void)f;
    (void)arg;
    board_resumed();
    return weft_tensor_clone(go[0], &gi[0]);
}

static weft_status_t second_wait;

static weft_status_t bad_bw(weft__ag_node_t *n, weft_tensor_t *const *go, weft_tensor_t **gi)
{
    weft_future_t *f = NULL;
    weft_future_t *f2 = NULL;
    weft_status_t st;

    WEFT_CHECK(weft_future_create(&f));
    weft_future_complete(f, WEFT_OK, NULL, NULL);
    st = weft__ag_wait(n, f, identity_resume, NULL);
    weft_future_release(f);
    switch (n->iargs[0]) {
    case BAD_OK_AFTER_WAIT:
        return WEFT_OK;
    case BAD_GRAD_AND_WAIT:
        WEFT_CHECK(weft_tensor_clone(go[0], &gi[0]));
        return st;
    case BAD_FAIL_AFTER_WAIT:
        return weft__set_error(WEFT_ERR_IO, "bad: the transfer failed");
    default:
        WEFT_CHECK(weft_future_create(&f2));
        second_wait = weft__ag_wait(n, f2, identity_resume, NULL);
        weft_future_release(f2);
        return st;
    }
}

static weft_status_t plain_pending_bw(weft__ag_node_t *n, weft_tensor_t *const *go,
                                      weft_tensor_t **gi)
{
    (void)n;
    (void)go;
    (void)gi;
    return weft__set_error(WEFT_ERR_PENDING, "plain: the transfer is not done");
}

static weft_tensor_t *bad(weft_tensor_t *x, const char *name, weft__ag_backward_cb_t bw, int mode)
{
    weft_tensor_t *y = NULL;
    weft__ag_node_t *n;

    cr_assert_eq(weft_tensor_clone(x, &y), WEFT_OK);
    cr_assert_eq(weft__ag_node_new(name, bw, 1, &x, &n), WEFT_OK);
    n->iargs[0] = mode;
    cr_assert_eq(weft__ag_attach(n, 1, &y), WEFT_OK);
    weft__ag_node_unref(n);
    return y;
}

Test(resume, misuses_of_wait_are_errors_that_name_the_node)
{
    weft_tensor_t *x = vec(2, (double[]){1, 2}, 1);
    weft_tensor_t *g = vec(2, (double[]){1, 1}, 0);
    weft_future_t *f = NULL;
    weft__ag_node_t *n;
    weft_tensor_t *y;

    board_reset();
    /* Outside a step of the node. */
    cr_assert_eq(weft_future_create(&f), WEFT_OK);
    cr_assert_eq(weft__ag_node_new("LoneBackward", bad_bw, 1, &x, &n), WEFT_OK);
    cr_assert_eq(weft__ag_wait(n, f, identity_resume, NULL), WEFT_ERR_INVALID_STATE);
    cr_assert(strstr(weft_last_error(), "LoneBackward") != NULL, "%s", weft_last_error());
    cr_assert_eq(weft__ag_wait(n, NULL, identity_resume, NULL), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(weft__ag_wait(n, f, NULL, NULL), WEFT_ERR_INVALID_ARG);
    weft__ag_node_unref(n);
    weft_future_release(f);

    y = bad(x, "OkAfterWaitBackward", bad_bw, BAD_OK_AFTER_WAIT);
    cr_assert_eq(weft_backward(y, g, 0), WEFT_ERR_INVALID_STATE);
    cr_assert(strstr(weft_last_error(), "OkAfterWaitBackward") != NULL, "%s", weft_last_error());
    weft_tensor_release(y);

    y = bad(x, "GradAndWaitBackward", bad_bw, BAD_GRAD_AND_WAIT);
    cr_assert_eq(weft_backward(y, g, 0), WEFT_ERR_INVALID_STATE);
    cr_assert(strstr(weft_last_error(), "GradAndWaitBackward gave gradients") != NULL, "%s",
              weft_last_error());
    weft_tensor_release(y);

    /* A step's own error wins over a wait it recorded (whose future is dropped); WEFT_ERR_PENDING
     * without a wait is an error like any other, not a wait. */
    y = bad(x, "FailAfterWaitBackward", bad_bw, BAD_FAIL_AFTER_WAIT);
    cr_assert_eq(weft_backward(y, g, 0), WEFT_ERR_IO);
    cr_assert(strstr(weft_last_error(), "bad: the transfer failed") != NULL, "%s",
              weft_last_error());
    weft_tensor_release(y);
    y = bad(x, "PlainPendingBackward", plain_pending_bw, 0);
    cr_assert_eq(weft_backward(y, g, 0), WEFT_ERR_PENDING);
    cr_assert(strstr(weft_last_error(), "plain: the transfer") != NULL, "%s", weft_last_error());
    weft_tensor_release(y);
    cr_assert_null(weft_tensor_grad(x));
    cr_assert_eq(B.resumed, 0);

    /* A second wait in one step is refused; the first one stands. */
    y = bad(x, "TwiceBackward", bad_bw, BAD_WAIT_TWICE);
    cr_assert_eq(weft_backward(y, g, 0), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(second_wait, WEFT_ERR_INVALID_STATE);
    cr_assert_eq(B.resumed, 1);
    cr_assert_eq(D(weft_tensor_grad(x))[1], 1.0);
    weft_tensor_release(y);
    weft_tensor_release(g);
    weft_tensor_release(x);
    test_end();
}

Test(resume, backward_options)
{
    weft_backward_opts_t o;
    weft_tensor_t *x = vec(2, (double[]){1, 2}, 1);
    weft_tensor_t *y = scale(x, 2);
    weft_tensor_t *g = vec(2, (double[]){1, 1}, 0);

    memset(&o, 0x5a, sizeof(o));
    weft_backward_opts_init(&o);
    cr_assert_eq(o.retain_graph, false);
    cr_assert_eq(o.wait_timeout_ms, 0);
    o.wait_timeout_ms = -1;
    cr_assert_eq(weft_backward_run(1, &y, &g, &o), WEFT_ERR_INVALID_ARG);
    cr_assert(strstr(weft_last_error(), "wait_timeout_ms") != NULL, "%s", weft_last_error());
    cr_assert_eq(weft_backward_run(0, &y, &g, NULL), WEFT_ERR_INVALID_ARG);
    cr_assert_null(weft_tensor_grad(x));
    cr_assert_eq(weft_backward_run(1, &y, &g, NULL), WEFT_OK, "%s", weft_last_error());
    cr_assert_eq(D(weft_tensor_grad(x))[1], 2.0);
    weft_tensor_release(g);
    weft_tensor_release(y);
    weft_tensor_release(x);
    test_end();
}
