/* The rendezvous master's side of a Join (rpc/rendezvous.c: the Hello's decoding, check_join and
 * the answer), docs/protocol.md section 7.1: rank 0 of a world of 8 with a token waits in its
 * join; each input is the body of one Join call, answered with a refusal (a WorldMap with a
 * status), or held (an accepted joiner) until the call's short deadline cancels it and frees the
 * slot again. The world never forms: it would take 7 joiners held at once, and one is held at a
 * time. Live: an agent of its own.
 *
 * Input: the Join's body (a Hello, as bytes). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>

#include <weft/weft.h>

#include "wire.pb-c.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define HOLD_MS 50 /* an accepted joiner's call is cancelled after this */

static weft_agent_t *master;
static grpc_channel *channel;

static void *join_main(void *arg)
{
    (void)weft_agent_join(arg);
    return NULL;
}

static void start(void)
{
    weft_agent_opts_t o;
    pthread_t t;
    char target[64];

    if (getenv("WEFT_LOG") == NULL) {
        weft_log_set_level(WEFT_LOG_OFF);
    }
    weft_agent_opts_init(&o);
    o.rank = 0;
    o.world_size = 8;
    o.master_addr = "127.0.0.1";
    o.master_port = 0;
    o.auth_token = "fuzz-token";
    o.rendezvous_timeout_ms = 1000LL * 3600 * 24; /* never, for a fuzzing run */
    if (weft_agent_create(&o, &master) != WEFT_OK ||
        pthread_create(&t, NULL, join_main, master) != 0) {
        fprintf(stderr, "fuzz_join: no master: %s\n", weft_last_error());
        abort();
    }
    pthread_detach(t);
    snprintf(target, sizeof(target), "127.0.0.1:%d", weft_agent_port(master));
    grpc_channel_credentials *creds = grpc_insecure_credentials_create();
    channel = grpc_channel_create(target, creds, NULL);
    grpc_channel_credentials_release(creds);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    grpc_op ops[6];
    grpc_metadata_array md, trailing;
    grpc_byte_buffer *reply = NULL;
    grpc_status_code code = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();

    pthread_once(&once, start);
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    gpr_timespec dl =
        gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(HOLD_MS, GPR_TIMESPAN));
    grpc_call *call = grpc_channel_create_call(channel, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                               grpc_slice_from_static_string("/weft.v1.Agent/Join"),
                                               NULL, dl, NULL);
    grpc_slice s = grpc_slice_from_copied_buffer((const char *)data, size);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    grpc_metadata_array_init(&md);
    grpc_metadata_array_init(&trailing);
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].flags = GRPC_INITIAL_METADATA_WAIT_FOR_READY;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &reply;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trailing;
    ops[5].data.recv_status_on_client.status = &code;
    ops[5].data.recv_status_on_client.status_details = &details;
    if (grpc_call_start_batch(call, ops, 6, &ops, NULL) != GRPC_CALL_OK) {
        abort();
    }
    /* The call's deadline ends it: this returns within HOLD_MS and a little. */
    grpc_event ev = grpc_completion_queue_pluck(
        cq, &ops, gpr_time_add(dl, gpr_time_from_millis(10000, GPR_TIMESPAN)), NULL);
    if (ev.type != GRPC_OP_COMPLETE) {
        fprintf(stderr, "fuzz_join: the Join call did not end\n");
        abort();
    }
    if (code == GRPC_STATUS_OK) {
        /* Answered: the refusal, a WorldMap with a status (the world cannot form). */
        grpc_byte_buffer_reader r;
        Weft__V1__WorldMap *map = NULL;
        if (reply != NULL && grpc_byte_buffer_reader_init(&r, reply)) {
            grpc_slice all = grpc_byte_buffer_reader_readall(&r);
            map = weft__v1__world_map__unpack(NULL, GRPC_SLICE_LENGTH(all),
                                              GRPC_SLICE_START_PTR(all));
            grpc_slice_unref(all);
            grpc_byte_buffer_reader_destroy(&r);
        }
        if (map == NULL || map->status == 0 || map->n_workers != 0) {
            fprintf(stderr, "fuzz_join: a Join that was not refused was answered\n");
            abort();
        }
        weft__v1__world_map__free_unpacked(map, NULL);
    } else if (code != GRPC_STATUS_DEADLINE_EXCEEDED) {
        fprintf(stderr, "fuzz_join: the Join ended with gRPC status %d\n", (int)code);
        abort();
    }
    if (reply != NULL) {
        grpc_byte_buffer_destroy(reply);
    }
    grpc_byte_buffer_destroy(bb);
    grpc_metadata_array_destroy(&md);
    grpc_metadata_array_destroy(&trailing);
    grpc_slice_unref(details);
    grpc_call_unref(call);
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
    return 0;
}
