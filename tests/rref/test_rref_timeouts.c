/* RRef deadlines: control messages and timeouts of 0 follow the agent's default call timeout
 * (weft_agent_call_timeout_ms, set here through opts.default_timeout_ms); negative timeouts are
 * refused. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ranks.h"

/* ------------------------------------------------- control messages' deadline */

/*
 * Rank 2 is a peer that speaks the reference codec (kind 1) without the rref module: its codec
 * sends rank 0 a fork of reference (1,5), owned by rank 1, as a fork from user 2. Rank 0 asks the
 * owner (FORK_REQUEST); rank 1 has no rref module and never acknowledges. The request carrying
 * the fork then fails when rank 0's control message passes its deadline, which is the agent's
 * default call timeout (1000 ms here), not 60 s nor the call's own 20 s.
 */
static const uint8_t fake_fork[] = {
    0x0a, 0x04, 0x08, 0x01, 0x10, 0x05, /* rref_id {worker 1, local 5} */
    0x12, 0x04, 0x08, 0x02, 0x10, 0x07, /* fork_id {worker 2, local 7} */
    0x18, 0x01,                         /* owner 1 */
    0x20, 0x02,                         /* parent 2 (the sender) */
    0x32, 0x04, 'f',  'a',  'k',  'e',  /* created_by "fake" */
};

static void fake_retain(void *obj)
{
    (void)obj;
}

static void fake_release(void *obj)
{
    (void)obj;
}

static const weft_value_ref_type_t fake_type = {WEFT_REF_KIND_RREF, fake_retain, fake_release};

static weft_status_t fake_encode(void *state, weft_agent_t *a, int to, void *obj, void **bytes_p,
                                 size_t *len_p)
{
    (void)state;
    (void)a;
    (void)to;
    (void)obj;
    void *b = weft_alloc(sizeof(fake_fork));
    if (b == NULL) {
        return WEFT_ERR_NO_MEMORY;
    }
    memcpy(b, fake_fork, sizeof(fake_fork));
    *bytes_p = b;
    *len_p = sizeof(fake_fork);
    return WEFT_OK;
}

static weft_status_t fake_decode(void *state, weft_agent_t *a, int src, const void *bytes,
                                 size_t len, void **obj_p, weft_future_t **ready_p)
{
    (void)state;
    (void)a;
    (void)src;
    (void)bytes;
    (void)len;
    (void)obj_p;
    (void)ready_p;
    return WEFT_ERR_PROTOCOL;
}

static const weft_ref_codec_t fake_codec = {fake_encode, NULL, fake_decode, &fake_type};

static int g_fake_state;

static weft_status_t fake_create(weft_agent_t *a, void **state_p)
{
    (void)a;
    *state_p = &g_fake_state;
    return WEFT_OK;
}

static const weft_module_desc_t fake_module = {
    .name = "fake_rref",
    .channel = 64,
    .create = fake_create,
    .codec = &fake_codec,
};

static void fn_take(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, NULL);
}

static void setup_ctl(weft_agent_t *a, int rank, void *arg)
{
    (void)arg;
    void *state;
    if (rank == 0) {
        if (weft_rref_init(a) != WEFT_OK ||
            weft_rpc_register(a, "take", fn_take, NULL) != WEFT_OK) {
            abort();
        }
    } else if (rank == 2 && weft_agent_module(a, &fake_module, &state) != WEFT_OK) {
        abort();
    }
    /* rank 1: no rref module, so the owner never acknowledges */
}

static int body_ctl_deadline(weft_agent_t *a, int rank, int world, void *arg)
{
    (void)world;
    (void)arg;
    if (rank != 2) {
        return 0;
    }
    RANK_CHECK(weft_agent_call_timeout_ms(a) == 1000, "default timeout %lld",
               (long long)weft_agent_call_timeout_ms(a));
    weft_value_t *v;
    weft_value_create(&v);
    int dummy = 0;
    RANK_CHECK(weft_value_add_ref(v, &fake_type, &dummy) == WEFT_OK, "add_ref");
    int64_t t0 = now_ms();
    weft_status_t st = weft_rpc_sync(a, 0, "take", v, 20000, NULL);
    int64_t took = now_ms() - t0;
    weft_value_free(v);
    RANK_CHECK(st == WEFT_ERR_TIMEOUT, "the fork's confirmation timed out: %s: %s",
               weft_strerror(st), weft_last_error());
    RANK_CHECK(strstr(weft_last_error(), "not acknowledged within 1000 ms") != NULL, "text: %s",
               weft_last_error());
    RANK_CHECK(took >= 900 && took < 3000, "failed at the default deadline: after %lld ms",
               (long long)took);
    return 0;
}

Test(rref_timeouts, control_messages_follow_the_agents_default_timeout, .timeout = 60)
{
    ranks_opts_t o;
    int codes[3];
    unsetenv("WEFT_RPC_TIMEOUT_MS");
    ranks_opts_init(&o, 3, body_ctl_deadline);
    o.setup = setup_ctl;
    o.call_timeout_ms = 1000;
    cr_assert_eq(ranks_run(&o, codes), 0);
}
