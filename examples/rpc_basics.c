/*
 * rpc_basics: synchronous, asynchronous and nested calls between three ranks,
 * with tensors, and remote errors caught and printed.
 *
 *   weftrun -n 3 build/examples/rpc_basics
 *
 * Every rank registers the same functions, then joins the world. Rank 0 (the
 * driver) calls the others; worker1 and worker2 only serve. All ranks end with
 * the collective weft_agent_shutdown, which returns once no call is in flight
 * anywhere, so the servers need no "done" message.
 *
 * Exit status: 0 on success, 2 when started with fewer than 3 ranks, 1 on any
 * unexpected failure (with a message on stderr).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <weft/weft.h>

#define SHUTDOWN_TIMEOUT_MS 30000
#define CALL_TIMEOUT_MS     10000

/* ------------------------------------------------------------- helpers */

/* A 1-D f32 tensor holding @p n values; NULL when out of memory. */
static weft_tensor_t *tensor_of(const float *x, int64_t n)
{
    weft_tensor_t *t;

    if (weft_tensor_empty(WEFT_F32, 1, &n, &t) != WEFT_OK) {
        return NULL;
    }
    memcpy(weft_tensor_data(t), x, (size_t)n * sizeof(float));
    return t;
}

/* A value holding tensors [x...] and [y...] (n each); NULL when out of memory. */
static weft_value_t *pair_of(const float *x, const float *y, int64_t n)
{
    weft_value_t *v;
    weft_tensor_t *tx = tensor_of(x, n);
    weft_tensor_t *ty = tensor_of(y, n);

    if (tx == NULL || ty == NULL || weft_value_create(&v) != WEFT_OK) {
        weft_tensor_release(tx);
        weft_tensor_release(ty);
        return NULL;
    }
    /* add_tensor takes the value's own reference; ours is dropped below. */
    if (weft_value_add_tensor(v, tx) != WEFT_OK || weft_value_add_tensor(v, ty) != WEFT_OK) {
        weft_value_free(v);
        v = NULL;
    }
    weft_tensor_release(tx);
    weft_tensor_release(ty);
    return v;
}

/* "[11, 22, 33]" */
static const char *format_tensor(const weft_tensor_t *t, char *buf, size_t cap)
{
    const float *p = weft_tensor_data(t);
    size_t used = 0;

    used += (size_t)snprintf(buf, cap, "[");
    for (int64_t i = 0; i < weft_tensor_numel(t) && used < cap; i++) {
        used += (size_t)snprintf(buf + used, cap - used, "%s%g", i > 0 ? ", " : "", (double)p[i]);
    }
    if (used < cap) {
        snprintf(buf + used, cap - used, "]");
    }
    return buf;
}

/*
 * Checks that @p v holds one f32 tensor equal to want[n], then prints
 * "<what> -> [...]". Returns 0, or 1 after a message on stderr.
 */
static int show_result(const char *what, const weft_value_t *v, const float *want, int64_t n)
{
    char buf[256];
    weft_tensor_t *t = v != NULL ? weft_value_tensor(v, 0) : NULL;

    if (t == NULL || weft_tensor_dtype(t) != WEFT_F32 || weft_tensor_numel(t) != n) {
        fprintf(stderr, "rpc_basics: %s: expected one f32 tensor of %lld elements\n", what,
                (long long)n);
        return 1;
    }
    if (memcmp(weft_tensor_data(t), want, (size_t)n * sizeof(float)) != 0) {
        fprintf(stderr, "rpc_basics: %s: wrong result %s\n", what,
                format_tensor(t, buf, sizeof(buf)));
        return 1;
    }
    printf("%s -> %s\n", what, format_tensor(t, buf, sizeof(buf)));
    return 0;
}

/* --------------------------------------------------- registered functions */

/*
 * Checks that the call's arguments are two f32 tensors of one shape; on
 * failure it fails the call and returns -1.
 */
static int two_f32(weft_call_t *call, weft_tensor_t **x_p, weft_tensor_t **y_p)
{
    const weft_value_t *args = weft_call_args(call);
    weft_tensor_t *x = weft_value_tensor(args, 0);
    weft_tensor_t *y = weft_value_tensor(args, 1);

    if (weft_value_num_tensors(args) != 2 || weft_tensor_dtype(x) != WEFT_F32 ||
        weft_tensor_dtype(y) != WEFT_F32 || weft_tensor_numel(x) != weft_tensor_numel(y)) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "%s wants two f32 tensors of one size",
                       weft_call_function(call));
        return -1;
    }
    *x_p = x;
    *y_p = y;
    return 0;
}

typedef float (*binary_op_t)(float x, float y);

static float op_add(float x, float y)
{
    return x + y;
}

static float op_divide(float x, float y)
{
    return x / y;
}

/* Replies with op(x, y) element by element, in a new tensor. */
static void reply_binary(weft_call_t *call, weft_tensor_t *x, weft_tensor_t *y, binary_op_t op)
{
    weft_tensor_t *r;
    weft_value_t *v;
    weft_status_t st;

    st = weft_tensor_empty(WEFT_F32, weft_tensor_ndim(x), weft_tensor_shape(x), &r);
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "no memory for the result");
        return;
    }
    const float *px = weft_tensor_data(x);
    const float *py = weft_tensor_data(y);
    float *pr = weft_tensor_data(r);
    for (int64_t i = 0; i < weft_tensor_numel(r); i++) {
        pr[i] = op(px[i], py[i]);
    }
    st = weft_value_create(&v);
    if (st == WEFT_OK) {
        st = weft_value_push_tensor(v, r); /* takes our reference on success */
        if (st != WEFT_OK) {
            weft_value_free(v);
        }
    }
    if (st != WEFT_OK) {
        weft_tensor_release(r);
        weft_call_fail(call, st, "no memory for the result");
        return;
    }
    weft_call_reply(call, v);
}

/* add(x, y) -> x + y */
static void fn_add(weft_call_t *call, void *arg)
{
    weft_tensor_t *x, *y;

    (void)arg;
    if (two_f32(call, &x, &y) == 0) {
        reply_binary(call, x, y, op_add);
    }
}

/* divide(x, y) -> x / y; fails with WEFT_ERR_INVALID_ARG when y has a zero. */
static void fn_divide(weft_call_t *call, void *arg)
{
    weft_tensor_t *x, *y;

    (void)arg;
    if (two_f32(call, &x, &y) != 0) {
        return;
    }
    const float *py = weft_tensor_data(y);
    for (int64_t i = 0; i < weft_tensor_numel(y); i++) {
        if (py[i] == 0.0f) {
            weft_call_fail(call, WEFT_ERR_INVALID_ARG, "division by zero (divisor element %lld)",
                           (long long)i);
            return;
        }
    }
    reply_binary(call, x, y, op_divide);
}

/* square(x) -> x * x, computed in place in the arguments, which become the result. */
static void fn_square(weft_call_t *call, void *arg)
{
    weft_value_t *v = weft_call_take_args(call);
    weft_tensor_t *x = weft_value_tensor(v, 0);

    (void)arg;
    if (x == NULL || weft_tensor_dtype(x) != WEFT_F32) {
        weft_value_free(v);
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "square wants one f32 tensor");
        return;
    }
    float *p = weft_tensor_data(x);
    for (int64_t i = 0; i < weft_tensor_numel(x); i++) {
        p[i] *= p[i];
    }
    weft_call_reply(call, v);
}

/*
 * relay(x, y; payload: worker name) -> add(x, y) computed on that worker.
 * The handler never blocks: it starts the nested call and hands its future to
 * weft_call_reply_future, which finishes this call when the nested one does.
 */
static void fn_relay(weft_call_t *call, void *arg)
{
    const weft_value_t *args = weft_call_args(call);
    weft_agent_t *a = weft_call_agent(call);
    int64_t left = weft_call_time_left_ms(call);
    char next[256];
    const char *payload;
    size_t len;
    weft_value_t *fwd;
    weft_future_t *f;
    weft_status_t st;

    (void)arg;
    payload = weft_value_payload(args, &len);
    if (payload == NULL || len == 0 || len >= sizeof(next)) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "relay wants the next worker's name");
        return;
    }
    if (left <= 0) {
        weft_call_fail(call, WEFT_ERR_TIMEOUT, "the caller's deadline has passed");
        return;
    }
    memcpy(next, payload, len);
    next[len] = '\0';

    st = weft_value_create(&fwd);
    for (size_t i = 0; st == WEFT_OK && i < weft_value_num_tensors(args); i++) {
        st = weft_value_add_tensor(fwd, weft_value_tensor(args, i));
    }
    if (st == WEFT_OK) {
        /* The nested call gets what is left of our caller's deadline. */
        st = weft_rpc_async_to(a, next, "add", fwd, left, &f);
    }
    weft_value_free(fwd); /* the call holds its own tensor references */
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "relay to %s: %s", next, weft_last_error());
        return;
    }
    weft_call_reply_future(call, f);
}

/* echo(anything) -> the same value */
static void fn_echo(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, weft_call_take_args(call));
}

static const struct {
    const char *name;
    weft_rpc_handler_cb_t fn;
} functions[] = {
    {"add", fn_add},     {"divide", fn_divide}, {"square", fn_square},
    {"relay", fn_relay}, {"echo", fn_echo},
};

/* ------------------------------------------------------------ the driver */

/* rpc_sync: add on worker1. */
static int demo_sync(weft_agent_t *a)
{
    const float x[] = {1, 2, 3}, y[] = {10, 20, 30}, want[] = {11, 22, 33};
    weft_value_t *args = pair_of(x, y, 3);
    weft_value_t *res = NULL;
    weft_status_t st;
    int rc;

    if (args == NULL) {
        fprintf(stderr, "rpc_basics: out of memory\n");
        return 1;
    }
    st = weft_rpc_sync_to(a, "worker1", "add", args, CALL_TIMEOUT_MS, &res);
    weft_value_free(args);
    if (st != WEFT_OK) {
        fprintf(stderr, "rpc_basics: add on worker1: %s: %s\n", weft_status_name(st),
                weft_last_error());
        return 1;
    }
    rc = show_result("rpc_sync add on worker1", res, want, 3);
    weft_value_free(res);
    return rc;
}

/* rpc_async: square on worker1 and worker2 at once, then wait for both. */
static int demo_async(weft_agent_t *a)
{
    static const char *const to[2] = {"worker1", "worker2"};
    const float x[2][3] = {{1, 2, 3}, {4, 5, 6}};
    const float want[2][3] = {{1, 4, 9}, {16, 25, 36}};
    weft_future_t *fs[2] = {NULL, NULL};
    weft_status_t st = WEFT_OK;
    int rc = 0;

    for (int i = 0; i < 2 && st == WEFT_OK; i++) {
        weft_value_t *args;
        weft_tensor_t *t = tensor_of(x[i], 3);

        st = t != NULL ? weft_value_create(&args) : WEFT_ERR_NO_MEMORY;
        if (st == WEFT_OK) {
            st = weft_value_push_tensor(args, t);
            if (st == WEFT_OK) {
                t = NULL;
                st = weft_rpc_async_to(a, to[i], "square", args, CALL_TIMEOUT_MS, &fs[i]);
            }
            weft_value_free(args);
        }
        /* The call holds its own reference to the tensor while it is sent. */
        weft_tensor_release(t);
        if (st != WEFT_OK) {
            fprintf(stderr, "rpc_basics: square on %s: %s: %s\n", to[i], weft_status_name(st),
                    weft_last_error());
            rc = 1;
        }
    }
    if (rc == 0) {
        st = weft_future_wait_all(fs, 2, CALL_TIMEOUT_MS);
    }
    for (int i = 0; i < 2; i++) {
        char what[64];

        if (fs[i] == NULL) {
            continue;
        }
        if (rc == 0 && weft_future_status(fs[i]) != WEFT_OK) {
            fprintf(stderr, "rpc_basics: square on %s: %s: %s\n", to[i],
                    weft_status_name(weft_future_status(fs[i])), weft_future_error(fs[i]));
            rc = 1;
        }
        if (rc == 0) {
            snprintf(what, sizeof(what), "rpc_async square on %s", to[i]);
            rc = show_result(what, weft_future_value(fs[i]), want[i], 3);
        }
        weft_future_release(fs[i]);
    }
    if (rc == 0 && st != WEFT_OK) {
        fprintf(stderr, "rpc_basics: waiting for square: %s\n", weft_status_name(st));
        rc = 1;
    }
    return rc;
}

/* relay on worker1, which calls add on worker2. */
static int demo_nested(weft_agent_t *a)
{
    const float x[] = {1, 2, 3}, y[] = {100, 200, 300}, want[] = {101, 202, 303};
    weft_value_t *args = pair_of(x, y, 3);
    weft_value_t *res = NULL;
    weft_status_t st;
    int rc;

    if (args == NULL || weft_value_set_string(args, "worker2") != WEFT_OK) {
        weft_value_free(args);
        fprintf(stderr, "rpc_basics: out of memory\n");
        return 1;
    }
    st = weft_rpc_sync_to(a, "worker1", "relay", args, CALL_TIMEOUT_MS, &res);
    weft_value_free(args);
    if (st != WEFT_OK) {
        fprintf(stderr, "rpc_basics: relay on worker1: %s: %s\n", weft_status_name(st),
                weft_last_error());
        return 1;
    }
    rc = show_result("nested 0->1->2", res, want, 3);
    weft_value_free(res);
    return rc;
}

/* divide on worker2: first a good one, then by zero, which fails remotely. */
static int demo_remote_error(weft_agent_t *a)
{
    const float x[] = {10, 20, 30}, good[] = {2, 4, 5}, bad[] = {2, 0, 5}, want[] = {5, 5, 6};
    weft_value_t *args;
    weft_value_t *res = NULL;
    weft_status_t st;
    int rc;

    args = pair_of(x, good, 3);
    if (args == NULL) {
        fprintf(stderr, "rpc_basics: out of memory\n");
        return 1;
    }
    st = weft_rpc_sync_to(a, "worker2", "divide", args, CALL_TIMEOUT_MS, &res);
    weft_value_free(args);
    if (st != WEFT_OK) {
        fprintf(stderr, "rpc_basics: divide on worker2: %s: %s\n", weft_status_name(st),
                weft_last_error());
        return 1;
    }
    rc = show_result("rpc_sync divide on worker2", res, want, 3);
    weft_value_free(res);
    if (rc != 0) {
        return rc;
    }

    args = pair_of(x, bad, 3);
    if (args == NULL) {
        fprintf(stderr, "rpc_basics: out of memory\n");
        return 1;
    }
    res = NULL;
    st = weft_rpc_sync_to(a, "worker2", "divide", args, CALL_TIMEOUT_MS, &res);
    weft_value_free(args);
    if (st != WEFT_ERR_INVALID_ARG) {
        fprintf(stderr,
                "rpc_basics: divide by zero on worker2 gave %s (%s), not WEFT_ERR_INVALID_ARG\n",
                weft_status_name(st), weft_last_error());
        weft_value_free(res);
        return 1;
    }
    /* The remote handler's status comes back as is; its text is in weft_last_error(). */
    printf("remote error caught: %s: %s\n", weft_status_name(st), weft_last_error());
    return 0;
}

/* A function nobody registered, called asynchronously: the future carries the error. */
static int demo_unknown_function(weft_agent_t *a)
{
    weft_future_t *f;
    weft_status_t st;

    st = weft_rpc_async_to(a, "worker1", "no_such_function", NULL, CALL_TIMEOUT_MS, &f);
    if (st != WEFT_OK) {
        fprintf(stderr, "rpc_basics: calling no_such_function: %s: %s\n", weft_status_name(st),
                weft_last_error());
        return 1;
    }
    st = weft_future_wait(f, CALL_TIMEOUT_MS);
    if (st != WEFT_ERR_NO_SUCH_FUNCTION) {
        fprintf(stderr, "rpc_basics: no_such_function gave %s (%s)\n", weft_status_name(st),
                weft_future_error(f));
        weft_future_release(f);
        return 1;
    }
    printf("unknown function caught: %s: %s\n", weft_status_name(st), weft_future_error(f));
    weft_future_release(f);
    return 0;
}

/* A bytes payload sent to worker2 and echoed back. */
static int demo_payload(weft_agent_t *a)
{
    static const char text[] = "hello from worker0";
    weft_value_t *args;
    weft_value_t *res = NULL;
    const char *back;
    size_t len;
    weft_status_t st;

    if (weft_value_create(&args) != WEFT_OK) {
        fprintf(stderr, "rpc_basics: out of memory\n");
        return 1;
    }
    if (weft_value_set_payload(args, text, strlen(text)) != WEFT_OK) {
        weft_value_free(args);
        fprintf(stderr, "rpc_basics: out of memory\n");
        return 1;
    }
    st = weft_rpc_sync_to(a, "worker2", "echo", args, CALL_TIMEOUT_MS, &res);
    weft_value_free(args);
    if (st != WEFT_OK) {
        fprintf(stderr, "rpc_basics: echo on worker2: %s: %s\n", weft_status_name(st),
                weft_last_error());
        return 1;
    }
    back = weft_value_payload(res, &len);
    if (back == NULL || len != strlen(text) || memcmp(back, text, len) != 0) {
        fprintf(stderr, "rpc_basics: echo on worker2 returned another payload (%zu bytes)\n", len);
        weft_value_free(res);
        return 1;
    }
    printf("payload round trip via worker2: \"%.*s\" (%zu bytes)\n", (int)len, back, len);
    weft_value_free(res);
    return 0;
}

static int drive(weft_agent_t *a)
{
    int (*const steps[])(weft_agent_t *) = {
        demo_sync, demo_async, demo_nested, demo_remote_error, demo_unknown_function, demo_payload};

    for (size_t i = 0; i < sizeof(steps) / sizeof(steps[0]); i++) {
        if (steps[i](a) != 0) {
            return 1;
        }
    }
    return 0;
}

int main(void)
{
    weft_agent_opts_t opts;
    weft_agent_t *a;
    weft_status_t st;
    int rc = 0;

    setvbuf(stdout, NULL, _IOLBF, 0);
    weft_agent_opts_init(&opts);
    st = weft_agent_create(&opts, &a);
    if (st != WEFT_OK) {
        fprintf(stderr, "rpc_basics: cannot start the agent: %s: %s\n", weft_status_name(st),
                weft_last_error());
        return 1;
    }
    if (weft_agent_world_size(a) < 3) {
        fprintf(stderr, "rpc_basics: needs 3 ranks or more (weftrun -n 3 %s), got %d\n",
                "rpc_basics", weft_agent_world_size(a));
        weft_agent_free(a);
        return 2;
    }
    /* Functions are registered before join, so none is missing when calls arrive. */
    for (size_t i = 0; i < sizeof(functions) / sizeof(functions[0]); i++) {
        st = weft_rpc_register(a, functions[i].name, functions[i].fn, NULL);
        if (st != WEFT_OK) {
            fprintf(stderr, "rpc_basics: register %s: %s\n", functions[i].name, weft_last_error());
            weft_agent_free(a);
            return 1;
        }
    }
    st = weft_agent_join(a);
    if (st != WEFT_OK) {
        fprintf(stderr, "rpc_basics: join: %s: %s\n", weft_status_name(st), weft_last_error());
        weft_agent_free(a);
        return 1;
    }
    printf("%s joined (rank %d of %d)\n", weft_agent_name(a), weft_agent_rank(a),
           weft_agent_world_size(a));

    if (weft_agent_rank(a) == 0) {
        rc = drive(a);
    }

    st = weft_agent_shutdown(a, SHUTDOWN_TIMEOUT_MS);
    if (st != WEFT_OK) {
        fprintf(stderr, "rpc_basics: shutdown: %s: %s\n", weft_status_name(st), weft_last_error());
        rc = 1;
    }
    weft_agent_free(a);
    if (rc == 0) {
        printf("done\n");
    }
    return rc;
}
