/* Raw gRPC C core (1.51) bidi streaming with the generic API: what the transport under weft
 * costs by itself, hand-driven with one completion queue per process and one long-lived stream.
 *
 * The client sends messages on the stream (zero-copy: grpc_slice_new over one prefaulted
 * buffer); the server echoes each message (pingpong, async: it sends back the received byte
 * buffer itself) or, in stream mode, walks the slices of each received message without copying
 * (grpc_byte_buffer_reader_next) and replies one 1-byte message. gRPC allows one send op in flight
 * per call, so each side pipelines: the next send starts as soon as the previous one completes,
 * while at most WINDOW messages are unanswered. Message limits are raised to -1 on both ends.
 * The binary forks the server process first, before either side calls grpc_init.
 *
 *   baseline_grpc pingpong SIZE ITERS | stream SIZE COUNT [WINDOW] | async N [INFLIGHT [SIZE]]
 *
 * Prints {"system":"raw_grpc_bidi","metric":...,"value":...} lines (see bench_common.h). */
#include "bench_common.h"

#include <stdatomic.h>
#include <sys/wait.h>
#include <unistd.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/time.h>

#define METHOD "/weft.bench.Bench/Stream"
#define QUEUE  8192 /* server replies waiting for the send slot; > any window */

enum {
    TAG_NEW_CALL = 1,
    TAG_SEND_MD,
    TAG_RECV_MD,
    TAG_RECV,
    TAG_SEND,
    TAG_CLOSE,
    TAG_STATUS,
    TAG_SHUTDOWN,
};

#define TAG(t) ((void *)(uintptr_t)(t))

static atomic_size_t slices_destroyed;

static void die(const char *what)
{
    fprintf(stderr, "baseline_grpc[%d]: %s\n", (int)getpid(), what);
    exit(1);
}

static void *alloc_prefaulted(size_t len, int byte)
{
    void *p = malloc(len);
    if (p == NULL) {
        die("out of memory");
    }
    memset(p, byte, len);
    return p;
}

static void start_batch(grpc_call *call, const grpc_op *ops, size_t n, int tag)
{
    grpc_call_error e = grpc_call_start_batch(call, ops, n, TAG(tag), NULL);
    if (e != GRPC_CALL_OK) {
        fprintf(stderr, "baseline_grpc: start_batch(tag %d): error %d\n", tag, (int)e);
        exit(1);
    }
}

static int next_tag(grpc_completion_queue *cq, int *ok_p)
{
    grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type != GRPC_OP_COMPLETE) {
        die("completion queue shut down unexpectedly");
    }
    *ok_p = ev.success;
    return (int)(uintptr_t)ev.tag;
}

static void drain_cq(grpc_completion_queue *cq)
{
    grpc_completion_queue_shutdown(cq);
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) {
            break;
        }
    }
    grpc_completion_queue_destroy(cq);
}

static void set_unlimited_args(grpc_arg *a, grpc_channel_args *args)
{
    a[0].type = GRPC_ARG_INTEGER;
    a[0].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    a[0].value.integer = -1;
    a[1].type = GRPC_ARG_INTEGER;
    a[1].key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    a[1].value.integer = -1;
    args->num_args = 2;
    args->args = a;
}

static void send_message(grpc_call *call, grpc_byte_buffer *bb)
{
    grpc_op op = {0};
    op.op = GRPC_OP_SEND_MESSAGE;
    op.data.send_message.send_message = bb;
    start_batch(call, &op, 1, TAG_SEND);
}

static void recv_message(grpc_call *call, grpc_byte_buffer **bb_p)
{
    grpc_op op = {0};
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = bb_p;
    start_batch(call, &op, 1, TAG_RECV);
}

/* ------------------------------------------------------------------ server */

/* Walks the slices of @p bb without copying them; returns the byte count. */
static size_t consume_slices(grpc_byte_buffer *bb)
{
    grpc_byte_buffer_reader r;
    grpc_slice s;
    size_t n = 0;
    volatile unsigned char sink = 0;
    if (!grpc_byte_buffer_reader_init(&r, bb)) {
        die("byte buffer reader");
    }
    while (grpc_byte_buffer_reader_next(&r, &s)) {
        size_t len = GRPC_SLICE_LENGTH(s);
        if (len > 0) {
            sink ^= GRPC_SLICE_START_PTR(s)[len - 1];
        }
        n += len;
        grpc_slice_unref(s);
    }
    grpc_byte_buffer_reader_destroy(&r);
    (void)sink;
    return n;
}

static void server_main(const bench_args_t *b, int port_fd)
{
    grpc_init();
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    grpc_arg a[2];
    grpc_channel_args args;
    set_unlimited_args(a, &args);
    grpc_server *server = grpc_server_create(&args, NULL);
    grpc_server_register_completion_queue(server, cq, NULL);
    grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
    int port = grpc_server_add_http2_port(server, "127.0.0.1:0", creds);
    grpc_server_credentials_release(creds);
    if (port == 0) {
        die("could not bind a port");
    }
    grpc_server_start(server);
    if (write(port_fd, &port, sizeof(port)) != (ssize_t)sizeof(port)) {
        die("write port");
    }
    close(port_fd);

    grpc_call *call = NULL;
    grpc_call_details details;
    grpc_metadata_array req_md;
    grpc_call_details_init(&details);
    grpc_metadata_array_init(&req_md);
    if (grpc_server_request_call(server, &call, &details, &req_md, cq, cq, TAG(TAG_NEW_CALL)) !=
        GRPC_CALL_OK) {
        die("request_call");
    }

    grpc_byte_buffer **queue = calloc(QUEUE, sizeof(*queue)); /* replies waiting to be sent */
    if (queue == NULL) {
        die("out of memory");
    }
    size_t q_head = 0;
    size_t q_tail = 0;
    grpc_byte_buffer *rbuf = NULL;
    grpc_byte_buffer *sending = NULL;
    int cancelled = 0;
    int client_done = 0;
    int status_sent = 0;
    int status_started = 0;
    int closed = 0;
    grpc_slice ack = grpc_slice_from_static_string("a");

    while (!(status_sent && closed)) {
        int ok;
        int tag = next_tag(cq, &ok);
        switch (tag) {
        case TAG_NEW_CALL: {
            if (!ok) {
                die("request_call failed");
            }
            grpc_op op = {0};
            op.op = GRPC_OP_SEND_INITIAL_METADATA;
            start_batch(call, &op, 1, TAG_SEND_MD);
            memset(&op, 0, sizeof(op));
            op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
            op.data.recv_close_on_server.cancelled = &cancelled;
            start_batch(call, &op, 1, TAG_CLOSE);
            recv_message(call, &rbuf);
            break;
        }
        case TAG_SEND_MD:
            break;
        case TAG_RECV:
            if (!ok || rbuf == NULL) { /* the client half-closed */
                client_done = 1;
                break;
            }
            if (b->mode == BENCH_STREAM) {
                if (consume_slices(rbuf) != b->size) {
                    die("message of the wrong size");
                }
                grpc_byte_buffer_destroy(rbuf);
                queue[q_tail++ % QUEUE] = grpc_raw_byte_buffer_create(&ack, 1);
            } else {
                queue[q_tail++ % QUEUE] = rbuf; /* echo the received slices themselves */
            }
            if (q_tail - q_head > QUEUE) {
                die("reply queue overflow");
            }
            rbuf = NULL;
            recv_message(call, &rbuf);
            break;
        case TAG_SEND:
            if (!ok) {
                die("send failed");
            }
            grpc_byte_buffer_destroy(sending);
            sending = NULL;
            break;
        case TAG_CLOSE:
            closed = 1;
            break;
        case TAG_STATUS:
            status_sent = 1;
            break;
        default:
            die("unexpected tag");
        }
        if (sending == NULL && q_head != q_tail) {
            sending = queue[q_head++ % QUEUE];
            send_message(call, sending);
        }
        if (client_done && sending == NULL && q_head == q_tail && !status_started) {
            grpc_op op = {0};
            op.op = GRPC_OP_SEND_STATUS_FROM_SERVER;
            op.data.send_status_from_server.status = GRPC_STATUS_OK;
            start_batch(call, &op, 1, TAG_STATUS);
            status_started = 1;
        }
    }

    grpc_server_shutdown_and_notify(server, cq, TAG(TAG_SHUTDOWN));
    grpc_server_cancel_all_calls(server);
    for (;;) {
        int ok;
        if (next_tag(cq, &ok) == TAG_SHUTDOWN) {
            break;
        }
    }
    grpc_call_unref(call);
    grpc_server_destroy(server);
    drain_cq(cq);
    grpc_call_details_destroy(&details);
    grpc_metadata_array_destroy(&req_md);
    free(queue);
    grpc_shutdown();
}

/* ------------------------------------------------------------------ client */

static void on_slice_destroyed(void *p)
{
    (void)p;
    atomic_fetch_add(&slices_destroyed, 1);
}

static void run_client(grpc_call *call, grpc_completion_queue *cq, const bench_args_t *b,
                       const char *msg, uint64_t *rtt_ns, uint64_t *elapsed_ns)
{
    grpc_metadata_array md;
    grpc_metadata_array_init(&md);
    grpc_op op = {0};
    op.op = GRPC_OP_SEND_INITIAL_METADATA;
    start_batch(call, &op, 1, TAG_SEND_MD);
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_INITIAL_METADATA;
    op.data.recv_initial_metadata.recv_initial_metadata = &md;
    start_batch(call, &op, 1, TAG_RECV_MD);
    grpc_byte_buffer *rbuf = NULL;
    recv_message(call, &rbuf);

    size_t total = b->warmup + b->count;
    size_t target = b->warmup;
    size_t sent = 0;
    size_t recvd = 0;
    uint64_t t0 = 0;
    uint64_t t_send = 0;
    grpc_byte_buffer *sending = NULL;
    int pending = 2; /* the metadata batches */
    while (recvd < total || sending != NULL || pending > 0) {
        if (recvd == target && target < total) { /* warm-up drained */
            target = total;
            t0 = bench_now_ns();
        }
        if (sending == NULL && sent < target && sent - recvd < b->window) {
            grpc_slice s = grpc_slice_new((void *)msg, b->size, on_slice_destroyed);
            sending = grpc_raw_byte_buffer_create(&s, 1);
            grpc_slice_unref(s);
            t_send = bench_now_ns();
            send_message(call, sending);
            sent++;
        }
        int ok;
        int tag = next_tag(cq, &ok);
        switch (tag) {
        case TAG_SEND_MD:
        case TAG_RECV_MD:
            pending--;
            break;
        case TAG_SEND:
            if (!ok) {
                die("send failed");
            }
            grpc_byte_buffer_destroy(sending);
            sending = NULL;
            break;
        case TAG_RECV:
            if (!ok || rbuf == NULL) {
                die("stream ended early");
            }
            if (b->mode == BENCH_PINGPONG && recvd >= b->warmup) {
                rtt_ns[recvd - b->warmup] = bench_now_ns() - t_send;
            }
            if (b->mode != BENCH_STREAM && consume_slices(rbuf) != b->size) {
                die("reply of the wrong size");
            }
            grpc_byte_buffer_destroy(rbuf);
            rbuf = NULL;
            recvd++;
            if (recvd == total) {
                *elapsed_ns = bench_now_ns() - t0;
            }
            recv_message(call, &rbuf); /* the last one completes with the status */
            break;
        default:
            die("unexpected tag");
        }
    }

    /* Half-close and collect the status; the outstanding receive completes empty. */
    grpc_status_code status = GRPC_STATUS_UNKNOWN;
    grpc_slice details;
    grpc_metadata_array trailing;
    grpc_metadata_array_init(&trailing);
    grpc_op ops[2];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[1].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[1].data.recv_status_on_client.trailing_metadata = &trailing;
    ops[1].data.recv_status_on_client.status = &status;
    ops[1].data.recv_status_on_client.status_details = &details;
    start_batch(call, ops, 2, TAG_STATUS);
    int got_status = 0;
    int got_recv = 0;
    while (!got_status || !got_recv) {
        int ok;
        int tag = next_tag(cq, &ok);
        if (tag == TAG_STATUS) {
            got_status = 1;
        } else if (tag == TAG_RECV) {
            if (rbuf != NULL) {
                die("unexpected message after the last reply");
            }
            got_recv = 1;
        }
    }
    if (status != GRPC_STATUS_OK) {
        fprintf(stderr, "baseline_grpc: stream ended with status %d\n", (int)status);
        exit(1);
    }
    grpc_slice_unref(details);
    grpc_metadata_array_destroy(&trailing);
    grpc_metadata_array_destroy(&md);
}

int main(int argc, char **argv)
{
    bench_args_t b;
    if (bench_parse_args(argc, argv, &b) != 0) {
        return 2;
    }
    int pfd[2];
    if (pipe(pfd) != 0) {
        die("pipe");
    }
    pid_t pid = fork(); /* before grpc_init on either side */
    if (pid < 0) {
        die("fork");
    }
    if (pid == 0) {
        close(pfd[0]);
        server_main(&b, pfd[1]);
        _exit(0);
    }
    close(pfd[1]);
    int port = 0;
    if (read(pfd[0], &port, sizeof(port)) != (ssize_t)sizeof(port)) {
        fprintf(stderr, "baseline_grpc: server did not start\n");
        waitpid(pid, NULL, 0);
        return 1;
    }
    close(pfd[0]);

    char *msg = alloc_prefaulted(b.size, 1);
    uint64_t *rtt = calloc(b.mode == BENCH_PINGPONG ? b.count : 1, sizeof(*rtt));
    if (rtt == NULL) {
        die("out of memory");
    }
    uint64_t elapsed = 0;

    grpc_init();
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    grpc_arg a[2];
    grpc_channel_args args;
    set_unlimited_args(a, &args);
    char target[64];
    snprintf(target, sizeof(target), "127.0.0.1:%d", port);
    grpc_channel_credentials *creds = grpc_insecure_credentials_create();
    grpc_channel *channel = grpc_channel_create(target, creds, &args);
    grpc_channel_credentials_release(creds);
    grpc_call *call = grpc_channel_create_call(channel, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                               grpc_slice_from_static_string(METHOD), NULL,
                                               gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (call == NULL) {
        die("create_call");
    }
    run_client(call, cq, &b, msg, rtt, &elapsed);
    grpc_call_unref(call);
    grpc_channel_destroy(channel);
    drain_cq(cq);
    grpc_shutdown();

    int st = 0;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "baseline_grpc: server exited abnormally (status %d)\n", st);
        return 1;
    }
    /* The transport may drop the last slice references only while it winds down. */
    for (int i = 0; i < 1000 && atomic_load(&slices_destroyed) < b.warmup + b.count; i++) {
        usleep(1000);
    }
    if (atomic_load(&slices_destroyed) == b.warmup + b.count) {
        free(msg);
    }
    bench_report("raw_grpc_bidi", &b, rtt, elapsed);
    free(rtt);
    return 0;
}
