/* Multi-rank test harness: forks ranks as processes on 127.0.0.1 with port 0. */
#ifndef WEFT_TEST_RANKS_H
#define WEFT_TEST_RANKS_H

#include <stdio.h>

#include <weft/weft.h>

#include "wait.h"

/* A rank's body; returns its exit code (0 = pass). */
typedef int (*rank_main_cb_t)(weft_agent_t *a, int rank, int world, void *arg);
/* Called in each rank after weft_agent_create, before join (register functions here). */
typedef void (*rank_setup_cb_t)(weft_agent_t *a, int rank, void *arg);

typedef struct {
    int world;
    int64_t deadline_ms;     /* whole run; ranks still alive then are killed (default 60000) */
    int handler_threads;     /* 0: default */
    int64_t peer_timeout_ms; /* 0: default */
    int64_t call_timeout_ms; /* 0: default */
    int64_t rendezvous_timeout_ms;
    uint64_t max_message_bytes;
    uint64_t max_message_bytes_rank1; /* rank 1's own limit, if set */
    const char *auth_token;
    /* TLS: rank r uses <tls_dir>/ca<r>.pem (else <tls_dir>/ca.pem), <tls_dir>/rank<r>.pem and
     * <tls_dir>/rank<r>.key; a rank whose rank<r>.pem is missing runs plaintext. NULL: none. */
    const char *tls_dir;
    int no_direct_rank; /* this rank runs with WEFT_DIRECT=0 (-1: none) */
    /* rank r's process gets rank_env[r] ("NAME=VALUE", several separated by spaces) before its
     * agent is made (NULL: none) */
    const char *rank_env[8];
    rank_setup_cb_t setup;
    rank_main_cb_t body;
    void *arg;
    int skip_rank;   /* -1: none; this rank is never started (rendezvous tests) */
    int no_shutdown; /* 1: free the agent without the collective shutdown */
    /* Called instead of body when join fails; returns the rank's exit code. */
    int (*join_failed)(int rank, weft_status_t st, const char *why, void *arg);
} ranks_opts_t;

void ranks_opts_init(ranks_opts_t *o, int world, rank_main_cb_t body);

/* Runs the world; returns 0 if every rank exited 0; fills codes[world] (exit
 * code, or 128+signal; -1 killed at the deadline). */
int ranks_run(const ranks_opts_t *o, int *codes);

/* Inside a rank: fail the rank with a message. */
#define RANK_CHECK(cond, ...)                                                                      \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "rank check failed at %s:%d: %s: ", __FILE__, __LINE__, #cond);        \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

/* Helpers */
weft_value_t *value_of_string(const char *s);
weft_tensor_t *tensor_f32_range(int64_t n, float start);

#endif
