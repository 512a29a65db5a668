/* TLS for the weft benchmark programs (bench/rpc.c, bench/tls.c): a job CA and a certificate per
 * rank in a private directory, made before the ranks are forked (tools/certs.c), and the agent
 * options that use them. */
#ifndef WEFT_BENCH_TLS_H
#define WEFT_BENCH_TLS_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <weft/weft.h>

#include "certs.h"

typedef struct {
    char dir[64]; /* "" when TLS is off */
    char ca[128], cert[64][128], key[64][128];
    int world;
} bench_tls_t;

/* Makes the files for @p world ranks. 0, or -1 (printed). */
static inline int bench_tls_make(bench_tls_t *t, int world)
{
    char why[512];
    weft_certs_pem_t ca;
    snprintf(t->dir, sizeof(t->dir), "/tmp/weft-bench-tls-XXXXXX");
    t->world = world;
    if (world > 64 || mkdtemp(t->dir) == NULL) {
        perror("bench_tls: mkdtemp");
        return -1;
    }
    weft_certs_spec_t spec = {"weft bench CA", -1, -300, 24L * 3600};
    if (weft_certs_make_ca(&spec, &ca, why, sizeof(why)) != 0 ||
        weft_certs_write(t->dir, "ca", &ca, false, why, sizeof(why)) != 0) {
        fprintf(stderr, "bench_tls: %s\n", why);
        return -1;
    }
    snprintf(t->ca, sizeof(t->ca), "%s/ca.pem", t->dir);
    for (int r = 0; r < world; r++) {
        char cn[32], stem[32];
        snprintf(cn, sizeof(cn), "weft-rank-%d", r);
        snprintf(stem, sizeof(stem), "rank%d", r);
        weft_certs_spec_t leaf_spec = {cn, r, -300, 24L * 3600};
        weft_certs_pem_t leaf;
        if (weft_certs_make_leaf(&ca, &leaf_spec, &leaf, why, sizeof(why)) != 0 ||
            weft_certs_write(t->dir, stem, &leaf, true, why, sizeof(why)) != 0) {
            fprintf(stderr, "bench_tls: %s\n", why);
            weft_certs_pem_free(&ca);
            return -1;
        }
        weft_certs_pem_free(&leaf);
        snprintf(t->cert[r], sizeof(t->cert[r]), "%s/rank%d.pem", t->dir, r);
        snprintf(t->key[r], sizeof(t->key[r]), "%s/rank%d.key", t->dir, r);
    }
    weft_certs_pem_free(&ca);
    return 0;
}

/* Rank @p rank's options use the files (TLS off: nothing changes). */
static inline void bench_tls_opts(const bench_tls_t *t, weft_agent_opts_t *o, int rank)
{
    if (t->dir[0] != '\0') {
        o->tls_ca_file = t->ca;
        o->tls_cert_file = t->cert[rank];
        o->tls_key_file = t->key[rank];
    }
}

static inline void bench_tls_remove(bench_tls_t *t)
{
    if (t->dir[0] == '\0') {
        return;
    }
    for (int r = 0; r < t->world; r++) {
        unlink(t->cert[r]);
        unlink(t->key[r]);
    }
    unlink(t->ca);
    rmdir(t->dir);
    t->dir[0] = '\0';
}

#endif
