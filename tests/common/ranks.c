#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ranks.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
/* Ranks leave with _exit, which skips LeakSanitizer's exit check: run it here. */
static int rank_exit_code(int code)
{
    if (__lsan_do_recoverable_leak_check() != 0 && code == 0) {
        return 94;
    }
    return code;
}
#else
static int rank_exit_code(int code)
{
    return code;
}
#endif

void ranks_opts_init(ranks_opts_t *o, int world, rank_main_cb_t body)
{
    memset(o, 0, sizeof(*o));
    o->world = world;
    o->deadline_ms = 60000;
    o->body = body;
    o->skip_rank = -1;
    o->no_direct_rank = -1;
}

weft_value_t *value_of_string(const char *s)
{
    weft_value_t *v;
    if (weft_value_create(&v) != WEFT_OK) {
        return NULL;
    }
    weft_value_set_string(v, s);
    return v;
}

weft_tensor_t *tensor_f32_range(int64_t n, float start)
{
    weft_tensor_t *t;
    if (weft_tensor_empty(WEFT_F32, 1, &n, &t) != WEFT_OK) {
        return NULL;
    }
    float *p = weft_tensor_data(t);
    for (int64_t i = 0; i < n; i++) {
        p[i] = start + (float)i;
    }
    return t;
}

static int rank_process(const ranks_opts_t *o, int rank, int port, int port_fd)
{
    weft_agent_opts_t ao;
    weft_agent_t *a;

    if (rank == o->no_direct_rank) {
        setenv("WEFT_DIRECT", "0", 1);
    }
    if (rank < 8 && o->rank_env[rank] != NULL) {
        /* Several settings separated by spaces; putenv keeps the copy (the process ends). */
        char *env = strdup(o->rank_env[rank]), *save = NULL;
        for (char *kv = strtok_r(env, " ", &save); kv != NULL; kv = strtok_r(NULL, " ", &save)) {
            putenv(kv);
        }
    }
    weft_agent_opts_init(&ao);
    ao.rank = rank;
    ao.world_size = o->world;
    ao.master_addr = "127.0.0.1";
    ao.master_port = port;
    ao.handler_threads = o->handler_threads;
    ao.peer_timeout_ms = o->peer_timeout_ms;
    ao.default_timeout_ms = o->call_timeout_ms;
    ao.rendezvous_timeout_ms = o->rendezvous_timeout_ms > 0 ? o->rendezvous_timeout_ms : 20000;
    ao.max_message_bytes = (int64_t)o->max_message_bytes;
    if (rank == 1 && o->max_message_bytes_rank1 > 0) {
        ao.max_message_bytes = (int64_t)o->max_message_bytes_rank1;
    }
    ao.auth_token = o->auth_token;
    char ca[1024], cert[1024], key[1024];
    if (o->tls_dir != NULL) {
        snprintf(cert, sizeof(cert), "%s/rank%d.pem", o->tls_dir, rank);
        snprintf(key, sizeof(key), "%s/rank%d.key", o->tls_dir, rank);
        snprintf(ca, sizeof(ca), "%s/ca%d.pem", o->tls_dir, rank);
        if (access(ca, R_OK) != 0) {
            snprintf(ca, sizeof(ca), "%s/ca.pem", o->tls_dir);
        }
        if (access(cert, R_OK) == 0) {
            ao.tls_ca_file = ca;
            ao.tls_cert_file = cert;
            ao.tls_key_file = key;
        }
    }
    weft_status_t st = weft_agent_create(&ao, &a);
    if (st != WEFT_OK) {
        fprintf(stderr, "rank %d: create: %s: %s\n", rank, weft_strerror(st), weft_last_error());
        return 90;
    }
    if (port_fd >= 0) {
        int p = weft_agent_port(a);
        if (write(port_fd, &p, sizeof(p)) != sizeof(p)) {
            return 91;
        }
        close(port_fd);
    }
    if (o->setup != NULL) {
        o->setup(a, rank, o->arg);
    }
    st = weft_agent_join(a);
    if (st != WEFT_OK) {
        char why[1024];
        snprintf(why, sizeof(why), "%s", weft_last_error());
        weft_agent_free(a);
        if (o->join_failed == NULL) {
            fprintf(stderr, "rank %d: join: %s: %s\n", rank, weft_strerror(st), why);
            return 92;
        }
        return o->join_failed(rank, st, why, o->arg);
    }
    int code = o->body(a, rank, o->world, o->arg);
    if (!o->no_shutdown) {
        st = weft_agent_shutdown(a, 30000);
        if (st != WEFT_OK && code == 0) {
            fprintf(stderr, "rank %d: shutdown: %s: %s\n", rank, weft_strerror(st),
                    weft_last_error());
            code = 93;
        }
    }
    weft_agent_free(a);
    return code;
}

int ranks_run(const ranks_opts_t *o, int *codes)
{
    pid_t pids[64];
    int fds[2];
    int port = 0;
    int n = o->world;

    if (n < 1 || n > 64 || pipe(fds) != 0) {
        return -1;
    }
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < n; r++) {
        pids[r] = -1;
        codes[r] = -1;
    }
    /* Rank 0 first: it binds the master port and tells us which. */
    if (o->skip_rank != 0) {
        pids[0] = fork();
        if (pids[0] == 0) {
            close(fds[0]);
            _exit(rank_exit_code(rank_process(o, 0, 0, fds[1])));
        }
        close(fds[1]);
        if (read(fds[0], &port, sizeof(port)) != sizeof(port)) {
            port = 0;
        }
        close(fds[0]);
    } else {
        close(fds[0]);
        close(fds[1]);
        port = 1; /* nobody listens on a privileged port here */
    }
    for (int r = 1; r < n; r++) {
        if (r == o->skip_rank) {
            continue;
        }
        pids[r] = fork();
        if (pids[r] == 0) {
            _exit(rank_exit_code(rank_process(o, r, port, -1)));
        }
    }
    int64_t deadline = now_ms() + o->deadline_ms;
    int alive = 0;
    for (int r = 0; r < n; r++) {
        alive += pids[r] > 0 ? 1 : 0;
    }
    while (alive > 0) {
        int status;
        pid_t p = waitpid(-1, &status, WNOHANG);
        if (p > 0) {
            for (int r = 0; r < n; r++) {
                if (pids[r] == p) {
                    codes[r] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
                    pids[r] = -1;
                    alive--;
                }
            }
            continue;
        }
        if (now_ms() > deadline) {
            for (int r = 0; r < n; r++) {
                if (pids[r] > 0) {
                    fprintf(stderr, "ranks_run: rank %d still running at the deadline: killed\n",
                            r);
                    kill(pids[r], SIGKILL);
                    waitpid(pids[r], NULL, 0);
                    codes[r] = -1;
                }
            }
            break;
        }
        usleep(2000);
    }
    int bad = 0;
    for (int r = 0; r < n; r++) {
        if (r != o->skip_rank && codes[r] != 0) {
            fprintf(stderr, "ranks_run: rank %d exited with %d\n", r, codes[r]);
            bad = 1;
        }
    }
    return bad;
}
