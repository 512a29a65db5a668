/*
 * interop_rank: ranks 0 and 2 of tests/interop's world of three, whose rank 1 is the Python peer
 * (weft_peer.py, driven by py_rank.py). This program serves "add", "echo" and "fail", calls the
 * Python rank's "py.double", "py.echo", "py.fail" and a function it does not have, trades NOTES
 * one-way messages with it on the channel of a module of its own, and ends with the collective
 * shutdown.
 *
 * Exit status: 0 when every check held, 1 otherwise (each failed check on stderr).
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <weft/module.h>
#include <weft/weft.h>

#define PY_RANK     1
#define PY_NAME     "py1"
#define CHANNEL     64
#define NOTES       200 /* one-way messages each side sends the other */
#define CALL_MS     20000
#define WAIT_MS     30000
#define SHUTDOWN_MS 30000
#define BIG_BYTES   (2 << 20) /* over the 1 MiB of a direct frame: the Python rank has none */

static int my_rank;
static int failures;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "[rank %d] FAIL line %d: ", my_rank, __LINE__);                        \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

/* ------------------------------------------------------------------ handlers */

/* Sums the elements of x and y (same dtype and size; wrapping for integers) into x. */
static int add_into(weft_tensor_t *x, const weft_tensor_t *y)
{
    int64_t n = weft_tensor_numel(x);
    void *xd = weft_tensor_data(x);
    const void *yd = weft_tensor_data(y);

    for (int64_t i = 0; i < n; i++) {
        switch (weft_tensor_dtype(x)) {
        case WEFT_F32:
            ((float *)xd)[i] += ((const float *)yd)[i];
            break;
        case WEFT_F64:
            ((double *)xd)[i] += ((const double *)yd)[i];
            break;
        case WEFT_I32:
            ((uint32_t *)xd)[i] += ((const uint32_t *)yd)[i];
            break;
        case WEFT_I64:
            ((uint64_t *)xd)[i] += ((const uint64_t *)yd)[i];
            break;
        default:
            return -1;
        }
    }
    return 0;
}

/* add(x, y) -> x + y, with the arguments' payload. */
static void add(weft_call_t *call, void *arg)
{
    weft_value_t *v = weft_call_take_args(call);
    weft_tensor_t *x = weft_value_tensor(v, 0);
    weft_tensor_t *y = weft_value_tensor(v, 1);
    weft_value_t *r;
    size_t len;
    const void *p = weft_value_payload(v, &len);

    (void)arg;
    if (weft_value_num_tensors(v) != 2 || weft_tensor_dtype(x) != weft_tensor_dtype(y) ||
        weft_tensor_numel(x) != weft_tensor_numel(y) || add_into(x, y) != 0) {
        weft_value_free(v);
        weft_call_fail(call, WEFT_ERR_SHAPE, "add takes two tensors of one size, f32/f64/i32/i64");
        return;
    }
    if (weft_value_create(&r) != WEFT_OK || weft_value_add_tensor(r, x) != WEFT_OK ||
        weft_value_set_payload(r, p, len) != WEFT_OK) {
        weft_value_free(r);
        weft_value_free(v);
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "add: out of memory");
        return;
    }
    weft_value_free(v);
    weft_call_reply(call, r);
}

static void echo(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, weft_call_take_args(call));
}

/* Fails with WEFT_ERR_SHAPE and a text quoting the payload. */
static void fail(weft_call_t *call, void *arg)
{
    size_t len;
    const char *p = weft_value_payload(weft_call_args(call), &len);

    (void)arg;
    weft_call_fail(call, WEFT_ERR_SHAPE, "fail was asked to fail: %.*s", (int)len, p ? p : "");
}

/* ------------------------------------------------------------------ the module: notes in order */

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int notes; /* from the Python rank, in order */
    int bad;   /* malformed or out of order */
} notes_t;

static weft_status_t notes_create(weft_agent_t *a, void **state_p)
{
    notes_t *s = weft_calloc(1, sizeof(*s));
    pthread_condattr_t ca;

    (void)a;
    if (s == NULL) {
        return WEFT_ERR_NO_MEMORY;
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->cv, &ca);
    pthread_condattr_destroy(&ca);
    *state_p = s;
    return WEFT_OK;
}

static void notes_destroy(void *state)
{
    notes_t *s = state;

    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    weft_free(s);
}

/* Note i from the Python rank: payload "note <i>", an i64 tensor {i, 1}. */
static void notes_on_message(void *state, int src_rank, weft_value_t *msg)
{
    notes_t *s = state;
    char want[32];
    size_t len;
    const void *p = weft_value_payload(msg, &len);
    const weft_tensor_t *t = weft_value_tensor(msg, 0);

    pthread_mutex_lock(&s->mu);
    snprintf(want, sizeof(want), "note %d", s->notes);
    if (src_rank != PY_RANK || len != strlen(want) || memcmp(p, want, len) != 0 || t == NULL ||
        weft_tensor_dtype(t) != WEFT_I64 || weft_tensor_numel(t) != 2 ||
        ((const int64_t *)weft_tensor_data(t))[0] != s->notes ||
        ((const int64_t *)weft_tensor_data(t))[1] != PY_RANK) {
        fprintf(stderr, "[rank %d] note %d from rank %d is not \"%s\" with {%d, 1}\n", my_rank,
                s->notes, src_rank, want, s->notes);
        s->bad++;
    }
    s->notes++;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    weft_value_free(msg);
}

static const weft_module_desc_t notes_module = {
    .name = "interop",
    .channel = CHANNEL,
    .create = notes_create,
    .destroy = notes_destroy,
    .on_message = notes_on_message,
};

/* Waits until @p n notes came (or WAIT_MS passed); returns how many came, *bad_p how many of them
 * were wrong. */
static int notes_wait(notes_t *s, int n, int *bad_p)
{
    struct timespec until;
    int got;

    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += WAIT_MS / 1000;
    pthread_mutex_lock(&s->mu);
    while (s->notes < n && pthread_cond_timedwait(&s->cv, &s->mu, &until) == 0) {
    }
    got = s->notes;
    *bad_p = s->bad;
    pthread_mutex_unlock(&s->mu);
    return got;
}

/* ------------------------------------------------------------------ calling the Python rank */

static weft_tensor_t *tensor_of(weft_dtype_t dtype, int ndim, const int64_t *shape,
                                const void *data)
{
    weft_tensor_t *t;

    if (weft_tensor_empty(dtype, ndim, shape, &t) != WEFT_OK) {
        return NULL;
    }
    if (data != NULL) {
        memcpy(weft_tensor_data(t), data, weft_tensor_nbytes(t));
    } else {
        unsigned char *b = weft_tensor_data(t);
        for (size_t i = 0; i < weft_tensor_nbytes(t); i++) {
            b[i] = (unsigned char)(i * 131 + (size_t)dtype * 7 + (size_t)my_rank);
        }
    }
    return t;
}

/* py.double doubles an f64 tensor: bit-exact in IEEE arithmetic, so compared bitwise. */
static void check_double(weft_agent_t *a)
{
    const double x[] = {1.5, -2.25, 1e300, 5e-324, -0.0, 3.0e-310, 0.1, 1.0 / 3.0};
    int64_t n = sizeof(x) / sizeof(x[0]);
    double want[sizeof(x) / sizeof(x[0])];
    weft_value_t *args, *res = NULL;
    weft_status_t st;
    size_t len;
    const void *p;

    for (int64_t i = 0; i < n; i++) {
        want[i] = x[i] * 2;
    }
    weft_value_create(&args);
    weft_value_push_tensor(args, tensor_of(WEFT_F64, 1, &n, x));
    weft_value_set_string(args, "twice");
    st = weft_rpc_sync_to(a, PY_NAME, "py.double", args, CALL_MS, &res);
    CHECK(st == WEFT_OK, "py.double: %s: %s", weft_status_name(st), weft_last_error());
    if (st == WEFT_OK) {
        const weft_tensor_t *t = weft_value_tensor(res, 0);
        p = weft_value_payload(res, &len);
        CHECK(t != NULL && weft_tensor_dtype(t) == WEFT_F64 && weft_tensor_numel(t) == n &&
                  memcmp(weft_tensor_data(t), want, sizeof(want)) == 0,
              "py.double: the result is not 2x, bit for bit");
        CHECK(len == 5 && memcmp(p, "twice", 5) == 0, "py.double: payload not echoed");
    }
    weft_value_free(res);
    weft_value_free(args);
}

/* py.echo of every dtype (a scalar, an empty tensor, a large one) and a payload: bit-exact. */
static void check_echo(weft_agent_t *a)
{
    const int64_t shapes[][2] = {{3, 5}, {2, 1}, {7, 0}, {1, 9}};
    const int64_t big[] = {BIG_BYTES / 1024, 1024};
    unsigned char payload[1000];
    weft_value_t *args, *res = NULL;
    weft_status_t st;
    size_t len;
    const void *p;

    for (size_t i = 0; i < sizeof(payload); i++) {
        payload[i] = (unsigned char)(i ^ 0x5a);
    }
    weft_value_create(&args);
    for (int d = 0; d < WEFT_DTYPE_COUNT; d++) {
        weft_value_push_tensor(args, tensor_of((weft_dtype_t)d, 2, shapes[d % 4], NULL));
    }
    weft_value_push_tensor(args, tensor_of(WEFT_F32, 0, NULL, NULL));
    weft_value_push_tensor(args, tensor_of(WEFT_U8, 2, big, NULL));
    weft_value_set_payload(args, payload, sizeof(payload));
    st = weft_rpc_sync(a, PY_RANK, "py.echo", args, CALL_MS, &res);
    CHECK(st == WEFT_OK, "py.echo: %s: %s", weft_status_name(st), weft_last_error());
    if (st == WEFT_OK) {
        CHECK(weft_value_num_tensors(res) == weft_value_num_tensors(args),
              "py.echo: %zu tensors back, %zu sent", weft_value_num_tensors(res),
              weft_value_num_tensors(args));
        for (size_t i = 0; i < weft_value_num_tensors(args) && i < weft_value_num_tensors(res);
             i++) {
            CHECK(weft_tensor_equal(weft_value_tensor(args, i), weft_value_tensor(res, i)),
                  "py.echo: tensor %zu differs", i);
        }
        p = weft_value_payload(res, &len);
        CHECK(len == sizeof(payload) && memcmp(p, payload, len) == 0, "py.echo: payload differs");
    }
    weft_value_free(res);
    weft_value_free(args);
}

/* A Python handler's error, and a function the Python rank does not have. */
static void check_errors(weft_agent_t *a)
{
    weft_value_t *args;
    weft_status_t st;

    weft_value_create(&args);
    weft_value_set_string(args, "because");
    st = weft_rpc_sync(a, PY_RANK, "py.fail", args, CALL_MS, NULL);
    CHECK(st == WEFT_ERR_SHAPE, "py.fail: %s, not WEFT_ERR_SHAPE", weft_status_name(st));
    CHECK(strstr(weft_last_error(), "py.fail refused: because") != NULL,
          "py.fail: the text is \"%s\"", weft_last_error());
    st = weft_rpc_sync(a, PY_RANK, "py.nope", args, CALL_MS, NULL);
    CHECK(st == WEFT_ERR_NO_SUCH_FUNCTION, "py.nope: %s, not WEFT_ERR_NO_SUCH_FUNCTION",
          weft_status_name(st));
    weft_value_free(args);
}

/* NOTES one-way messages to the Python rank, back to back: "note <i> from <rank>", {i, rank}. */
static void send_notes(weft_agent_t *a)
{
    for (int64_t i = 0; i < NOTES; i++) {
        const int64_t two = 2, data[2] = {i, my_rank};
        char text[48];
        weft_value_t *msg;
        weft_status_t st;

        snprintf(text, sizeof(text), "note %lld from %d", (long long)i, my_rank);
        weft_value_create(&msg);
        weft_value_push_tensor(msg, tensor_of(WEFT_I64, 1, &two, data));
        weft_value_set_string(msg, text);
        st = weft_agent_send(a, PY_RANK, CHANNEL, msg, NULL);
        CHECK(st == WEFT_OK, "note %lld: %s", (long long)i, weft_status_name(st));
        weft_value_free(msg);
    }
}

int main(void)
{
    weft_agent_opts_t o;
    weft_agent_t *a;
    notes_t *notes;
    weft_status_t st;
    int got, bad;

    weft_agent_opts_init(&o);
    if (weft_agent_create(&o, &a) != WEFT_OK) {
        fprintf(stderr, "agent: %s\n", weft_last_error());
        return 1;
    }
    my_rank = weft_agent_rank(a);
    if (weft_rpc_register(a, "add", add, NULL) != WEFT_OK ||
        weft_rpc_register(a, "echo", echo, NULL) != WEFT_OK ||
        weft_rpc_register(a, "fail", fail, NULL) != WEFT_OK ||
        weft_agent_module(a, &notes_module, (void **)&notes) != WEFT_OK ||
        weft_agent_join(a) != WEFT_OK) {
        fprintf(stderr, "[rank %d] setup: %s\n", my_rank, weft_last_error());
        weft_agent_free(a);
        return 1;
    }
    CHECK(strcmp(weft_agent_worker_name(a, PY_RANK), PY_NAME) == 0, "rank 1 is named %s",
          weft_agent_worker_name(a, PY_RANK));
    CHECK(strcmp(weft_agent_worker_direct_address(a, PY_RANK), "") == 0,
          "the Python rank announces a direct listener");

    check_double(a);
    check_echo(a);
    check_errors(a);
    send_notes(a);
    got = notes_wait(notes, NOTES, &bad);
    CHECK(got == NOTES && bad == 0, "%d of %d notes from the Python rank, %d bad", got, NOTES, bad);

    st = weft_agent_shutdown(a, SHUTDOWN_MS);
    CHECK(st == WEFT_OK, "shutdown: %s: %s", weft_status_name(st), weft_last_error());
    weft_agent_free(a);
    printf("[rank %d] %s\n", my_rank, failures == 0 ? "all checks passed" : "FAILED");
    return failures == 0 ? 0 : 1;
}
