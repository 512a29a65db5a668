/* RPC basics across ranks: sync and async calls, tensors, errors, names. */
#include <criterion/criterion.h>
#include <string.h>

#include "ranks.h"

static void echo(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, weft_call_take_args(call));
}

/* Adds 1 to every f32 element of the first tensor. */
static void add_one(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_value_t *v = weft_call_take_args(call);
    weft_tensor_t *t = weft_value_tensor(v, 0);
    if (t == NULL || weft_tensor_dtype(t) != WEFT_F32) {
        weft_value_free(v);
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "add_one wants one f32 tensor");
        return;
    }
    float *p = weft_tensor_data(t);
    for (int64_t i = 0; i < weft_tensor_numel(t); i++) {
        p[i] += 1.0f;
    }
    weft_call_reply(call, v);
}

static void fail_always(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_fail(call, WEFT_ERR_INVALID_ARG, "division by zero");
}

static void setup(weft_agent_t *a, int rank, void *arg)
{
    (void)rank;
    (void)arg;
    weft_rpc_register(a, "echo", echo, NULL);
    weft_rpc_register(a, "add_one", add_one, NULL);
    weft_rpc_register(a, "fail", fail_always, NULL);
}

static int body_sync(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    int to = (rank + 1) % world;
    weft_value_t *args = value_of_string("hello");
    weft_tensor_t *t = tensor_f32_range(1000, (float)rank);
    weft_value_add_tensor(args, t);
    weft_value_t *res = NULL;
    weft_status_t st = weft_rpc_sync(a, to, "add_one", args, 10000, &res);
    RANK_CHECK(st == WEFT_OK, "%s: %s", weft_strerror(st), weft_last_error());
    RANK_CHECK(weft_value_num_tensors(res) == 1, "tensors %zu", weft_value_num_tensors(res));
    const float *p = weft_tensor_data(weft_value_tensor(res, 0));
    for (int i = 0; i < 1000; i++) {
        RANK_CHECK(p[i] == (float)rank + (float)i + 1.0f, "element %d is %f", i, p[i]);
    }
    size_t len;
    const char *pl = weft_value_payload(res, &len);
    RANK_CHECK(len == 5 && memcmp(pl, "hello", 5) == 0, "payload");
    /* The caller's tensor is untouched. */
    RANK_CHECK(((float *)weft_tensor_data(t))[0] == (float)rank, "caller tensor changed");
    weft_value_free(res);

    /* By name, and to ourselves. */
    char name[32];
    snprintf(name, sizeof(name), "worker%d", to);
    RANK_CHECK(strcmp(weft_agent_worker_name(a, to), name) == 0, "name %s",
               weft_agent_worker_name(a, to));
    st = weft_rpc_sync_to(a, name, "echo", args, 0, &res);
    RANK_CHECK(st == WEFT_OK, "by name: %s", weft_last_error());
    weft_value_free(res);
    st = weft_rpc_sync(a, rank, "echo", args, 0, &res);
    RANK_CHECK(st == WEFT_OK, "to self: %s", weft_last_error());
    RANK_CHECK(weft_tensor_equal(weft_value_tensor(res, 0), t), "self echo differs");
    weft_value_free(res);
    weft_tensor_release(t);
    weft_value_free(args);
    return 0;
}

Test(rpc_basic, sync_calls_with_tensors, .timeout = 60)
{
    ranks_opts_t o;
    int codes[3];
    ranks_opts_init(&o, 3, body_sync);
    o.setup = setup;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

static int body_errors(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    (void)world;
    if (rank != 0) {
        return 0;
    }
    weft_value_t *res = NULL;
    weft_status_t st = weft_rpc_sync(a, 1, "fail", NULL, 5000, &res);
    RANK_CHECK(st == WEFT_ERR_INVALID_ARG, "remote error status %d", st);
    RANK_CHECK(strstr(weft_last_error(), "division by zero") != NULL, "text: %s",
               weft_last_error());
    RANK_CHECK(strstr(weft_last_error(), "worker1") != NULL, "names worker: %s", weft_last_error());
    st = weft_rpc_sync(a, 1, "no_such_fn", NULL, 5000, &res);
    RANK_CHECK(st == WEFT_ERR_NO_SUCH_FUNCTION, "unknown fn status %d", st);
    RANK_CHECK(strstr(weft_last_error(), "no_such_fn") != NULL, "names fn: %s", weft_last_error());
    st = weft_rpc_sync_to(a, "nobody", "echo", NULL, 5000, &res);
    RANK_CHECK(st == WEFT_ERR_NOT_FOUND, "unknown worker %d", st);
    st = weft_rpc_sync(a, 7, "echo", NULL, 5000, &res);
    RANK_CHECK(st == WEFT_ERR_INVALID_ARG, "bad rank %d", st);
    /* The agent keeps working after errors. */
    st = weft_rpc_sync(a, 1, "echo", NULL, 5000, &res);
    RANK_CHECK(st == WEFT_OK, "after errors: %s", weft_last_error());
    weft_value_free(res);
    return 0;
}

Test(rpc_basic, remote_error_and_unknown_function, .timeout = 60)
{
    ranks_opts_t o;
    int codes[2];
    ranks_opts_init(&o, 2, body_errors);
    o.setup = setup;
    cr_assert_eq(ranks_run(&o, codes), 0);
}

/* weft_rpc_call_local: the handler runs in-process and its reply value comes back itself. */
static int body_local(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)arg;
    (void)world;
    if (rank != 0) {
        return 0;
    }
    weft_value_t *args = value_of_string("local");
    weft_tensor_t *t = tensor_f32_range(10, 1.0f);
    weft_value_add_tensor(args, t);
    weft_future_t *f = NULL;
    weft_status_t st = weft_rpc_call_local(a, "add_one", args, 5000, &f);
    RANK_CHECK(st == WEFT_OK, "%s", weft_last_error());
    RANK_CHECK(weft_future_wait(f, 5000) == WEFT_OK, "%s", weft_future_error(f));
    weft_value_t *res = NULL;
    RANK_CHECK(weft_future_take_value(f, &res) == WEFT_OK, "no value");
    RANK_CHECK(weft_value_tensor(res, 0) == t, "the reply is the handler's value, not a copy");
    RANK_CHECK(((float *)weft_tensor_data(t))[0] == 2.0f, "the handler saw the caller's tensor");
    weft_value_free(res);
    weft_future_release(f);

    st = weft_rpc_call_local(a, "fail", value_of_string("x"), 5000, &f);
    RANK_CHECK(st == WEFT_OK, "%s", weft_last_error());
    RANK_CHECK(weft_future_wait(f, 5000) == WEFT_ERR_INVALID_ARG, "failure passes through");
    RANK_CHECK(strstr(weft_future_error(f), "division by zero") != NULL, "%s",
               weft_future_error(f));
    weft_future_release(f);

    args = value_of_string("y");
    st = weft_rpc_call_local(a, "no_such_fn", args, 5000, &f);
    RANK_CHECK(st == WEFT_ERR_NO_SUCH_FUNCTION, "unknown function: %d", st);
    weft_value_free(args); /* still the caller's */
    weft_tensor_release(t);
    return 0;
}

Test(rpc_basic, local_calls_pass_values_through, .timeout = 60)
{
    ranks_opts_t o;
    int codes[1];
    ranks_opts_init(&o, 1, body_local);
    o.setup = setup;
    cr_assert_eq(ranks_run(&o, codes), 0);
}
