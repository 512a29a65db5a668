/*
 * Several hosts, as network namespaces on this machine (tests/tools/multinode.sh): two nodes of
 * two ranks each, started by weftrun --nnodes in each namespace, run tests/tools/multinode_rank.c
 * (rendezvous, RPC both ways, 2 MiB on the direct connections, an all_reduce by the ring,
 * shutdown); a rank advertising a loopback address to the other host is refused at rendezvous;
 * WEFT_SOCKET_IFNAME picks an interface's address or is refused clearly.
 *
 * The namespaces are made as root (ip netns, names from this process's id, deleted by the script
 * on every exit), or, where that is refused, in a user namespace of the test's own (unshare
 * --user --map-root-user --net --mount); where neither works (or iproute2 is missing) the tests
 * that need them skip, saying why. Every run has a deadline: each weftrun's --timeout, and the
 * script's and each program's in run_capture.
 * MULTINODE_SH, MULTINODE_RANK and WEFTRUN name the script, the rank program and the launcher.
 */
#include <criterion/criterion.h>

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "certs.h"
#include "run.h"

#define TOKEN "0123456789abcdef0123456789abcdef"
/* weftrun --timeout of each node, and the deadline of the whole script (namespaces included). */
#define NODE_TIMEOUT_S "90"
#define DEADLINE_S     150.0
#define PROBE_S        20.0

/* ---- the machine --------------------------------------------------------- */

/* The full path of program @p name, from PATH or the sbin folders (not in a user's PATH). */
static bool find_program(const char *name, char *buf, size_t n)
{
    const char *path = getenv("PATH");
    char dirs[4096];

    snprintf(dirs, sizeof(dirs), "%s:/usr/sbin:/sbin:/usr/bin:/bin", path != NULL ? path : "");
    for (char *save = NULL, *d = strtok_r(dirs, ":", &save); d != NULL;
         d = strtok_r(NULL, ":", &save)) {
        if (d[0] == '/' && (size_t)snprintf(buf, n, "%s/%s", d, name) < n &&
            access(buf, X_OK) == 0) {
            return true;
        }
    }
    return false;
}

/* Where the namespaces are made: directly (root), or in a user namespace of our own (unshare
 * --user --map-root-user --net --mount: root in it). */
typedef enum { AS_ROOT, IN_USERNS } ns_mode_t;

typedef struct {
    char ip[512], unshare[512];
    ns_mode_t modes[2]; /* to try, in order */
    int nmodes;
} machine_t;

/* @p s without its trailing white space, into @p buf. */
static const char *trimmed(const char *s, char *buf, size_t n)
{
    snprintf(buf, n, "%s", s);
    for (size_t len = strlen(buf); len > 0 && strchr(" \n\t", buf[len - 1]) != NULL; len--) {
        buf[len - 1] = '\0';
    }
    return buf;
}

/* How namespaces can be made here; skips the test when they cannot be. */
static void machine_or_skip(machine_t *m)
{
    char why[512];

    memset(m, 0, sizeof(*m));
    if (!find_program("ip", m->ip, sizeof(m->ip))) {
        cr_skip_test("skipped: iproute2's ip is not installed (the cross-host tests make network "
                     "namespaces with it)");
    }
    if (!find_program("unshare", m->unshare, sizeof(m->unshare))) {
        cr_skip_test("skipped: util-linux's unshare is not installed");
    }
    if (geteuid() == 0) {
        m->modes[m->nmodes++] = AS_ROOT;
    }
    const char *argv[] = {m->unshare, "--user", "--map-root-user", "--net", "--mount",
                          "true",     NULL};
    run_opts_t o = {.argv = argv, .deadline_s = PROBE_S};
    run_result_t r;
    run_capture(&o, &r);
    trimmed(r.err, why, sizeof(why));
    if (r.code == 0) {
        m->modes[m->nmodes++] = IN_USERNS;
    }
    run_result_free(&r);
    if (m->nmodes == 0) {
        cr_skip_test("skipped: network namespaces cannot be made here: not root, and no user "
                     "namespace (unshare --user --map-root-user --net --mount: %s)",
                     why);
    }
}

/* ---- the two nodes ------------------------------------------------------- */

typedef struct {
    char *out[2], *err[2]; /* each node's weftrun: stdout, stderr */
    int status[2];         /* ... and its exit status */
} nodes_t;

static char *slurp(const char *dir, const char *name)
{
    char path[600];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s missing", path);
    char *buf = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&buf, &len);
    char chunk[65536];
    size_t n;
    while ((n = fread(chunk, 1, sizeof(chunk), f)) > 0) {
        fwrite(chunk, 1, n, mem);
    }
    fclose(f);
    fclose(mem);
    unlink(path);
    return buf;
}

/* Removes the script's output folder @p dir and what is left in it. */
static void remove_outputs(const char *dir)
{
    static const char *const names[] = {"node0.out", "node0.err", "node0.status",
                                        "node1.out", "node1.err", "node1.status"};
    char path[600];

    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
        unlink(path);
    }
    rmdir(dir);
}

/* One try of run_nodes in @p mode: 77 when the namespaces cannot be made that way (why in
 * @p why), else 0 with @p nodes filled. */
/* More weftrun options for both nodes (WEFTRUN_ARGS of multinode.sh). */
static char g_weftrun_args[1400];

static int try_nodes(const machine_t *m, ns_mode_t mode, char tag, const char *env0,
                     const char *env1, nodes_t *nodes, char *why, size_t why_n)
{
    char dir[] = "/tmp/weft-multinode-XXXXXX";
    char names[16], e_ip[600], e_unshare[600], e_weftrun[600], e_env0[300], e_env1[300];
    char e_args[1500];
    const char *argv[16];
    int n = 0;

    /* Unique across the suite's parallel runs (plain and sanitized): this process's id. */
    snprintf(names, sizeof(names), "%d%c", (int)getpid(), tag);
    snprintf(e_ip, sizeof(e_ip), "IP=%s", m->ip);
    snprintf(e_unshare, sizeof(e_unshare), "UNSHARE=%s", m->unshare);
    snprintf(e_weftrun, sizeof(e_weftrun), "WEFTRUN=%s", run_path_from_env("WEFTRUN"));
    snprintf(e_env0, sizeof(e_env0), "NODE0_ENV=%s", env0);
    snprintf(e_env1, sizeof(e_env1), "NODE1_ENV=%s", env1);
    snprintf(e_args, sizeof(e_args), "WEFTRUN_ARGS=%s", g_weftrun_args);
    const char *env[] = {e_args,
                         e_ip,
                         e_unshare,
                         e_weftrun,
                         e_env0,
                         e_env1,
                         "NODE_TIMEOUT=" NODE_TIMEOUT_S,
                         "WEFT_AUTH_TOKEN=" TOKEN,
                         mode == IN_USERNS ? "PRIVATE_RUN=1" : "PRIVATE_RUN=0",
                         NULL};
    if (mode == IN_USERNS) {
        argv[n++] = m->unshare;
        argv[n++] = "--user";
        argv[n++] = "--map-root-user";
        argv[n++] = "--net";
        argv[n++] = "--mount";
    }
    argv[n++] = "/bin/sh";
    argv[n++] = run_path_from_env("MULTINODE_SH");
    argv[n++] = names;
    argv[n++] = dir;
    argv[n++] = "2";
    argv[n++] = run_path_from_env("MULTINODE_RANK");
    argv[n++] = "10.99.0.1";
    argv[n++] = "10.99.0.2";
    argv[n] = NULL;
    cr_assert_not_null(mkdtemp(dir)); /* argv holds it */
    run_opts_t o = {.argv = argv, .env = env, .deadline_s = DEADLINE_S};
    run_result_t r;
    run_capture(&o, &r);
    if (r.code != 0) {
        remove_outputs(dir);
    }
    if (r.code == 77) {
        trimmed(r.err, why, why_n);
        run_result_free(&r);
        return 77;
    }
    cr_assert_eq(r.code, 0, "multinode.sh exited %d\nstderr:\n%s", r.code, r.err);
    run_result_free(&r);
    for (int k = 0; k < 2; k++) {
        char name[32];
        snprintf(name, sizeof(name), "node%d.out", k);
        nodes->out[k] = slurp(dir, name);
        snprintf(name, sizeof(name), "node%d.err", k);
        nodes->err[k] = slurp(dir, name);
        snprintf(name, sizeof(name), "node%d.status", k);
        char *status = slurp(dir, name);
        nodes->status[k] = atoi(status);
        free(status);
    }
    remove_outputs(dir);
    return 0;
}

/*
 * Runs multinode_rank on two nodes of two ranks (multinode.sh), with @p env0 / @p env1
 * ("NAME=VALUE ...", may be "") for node 0's / node 1's weftrun. @p tag: one letter, this test's.
 * Skips the test when no way of making the namespaces works.
 */
static void run_nodes(const machine_t *m, char tag, const char *env0, const char *env1,
                      nodes_t *nodes)
{
    char why[2][512] = {"", ""};

    for (int i = 0; i < m->nmodes; i++) {
        if (try_nodes(m, m->modes[i], tag, env0, env1, nodes, why[i], sizeof(why[i])) == 0) {
            return;
        }
    }
    cr_skip_test("skipped: %s%s%s", why[0], m->nmodes > 1 ? "; in a user namespace: " : "", why[1]);
}

static void nodes_free(nodes_t *nodes)
{
    for (int k = 0; k < 2; k++) {
        free(nodes->out[k]);
        free(nodes->err[k]);
    }
}

/* ---- a job across two hosts ---------------------------------------------- */

static void expect_job_ran(const nodes_t *nodes)
{
    for (int k = 0; k < 2; k++) {
        cr_expect_eq(nodes->status[k], 0, "node %d: weftrun exited %d\nstdout:\n%s\nstderr:\n%s", k,
                     nodes->status[k], nodes->out[k], nodes->err[k]);
        cr_expect_null(strstr(nodes->err[k], "large frames take the stream"),
                       "node %d: a direct connection failed:\n%s", k, nodes->err[k]);
        for (int local = 0; local < 2; local++) {
            int rank = 2 * k + local;
            char want[64];
            snprintf(want, sizeof(want), "[rank %d] MULTINODE OK rank %d", rank, rank);
            cr_expect_not_null(run_find_line(nodes->out[k], want, false),
                               "node %d: '%s' missing\nstdout:\n%s\nstderr:\n%s", k, want,
                               nodes->out[k], nodes->err[k]);
            snprintf(want, sizeof(want), "[rank %d] all_reduce of 4 MiB by the ring", rank);
            cr_expect_not_null(run_find_line(nodes->out[k], want, false), "node %d: '%s' missing",
                               k, want);
        }
    }
}

/* The setup with the defaults: every rank advertises its interface toward the master. */
Test(multinode, two_nodes_by_default, .timeout = 200)
{
    machine_t m;
    nodes_t nodes;

    machine_or_skip(&m);
    run_nodes(&m, 'd', "", "", &nodes);
    expect_job_ran(&nodes);
    nodes_free(&nodes);
}

/* WEFT_SOCKET_IFNAME on node 1 names its end of the veth pair. */
Test(multinode, two_nodes_by_interface, .timeout = 200)
{
    machine_t m;
    nodes_t nodes;
    char env1[64];

    machine_or_skip(&m);
    snprintf(env1, sizeof(env1), "WEFT_SOCKET_IFNAME=wv%dib", (int)getpid());
    run_nodes(&m, 'i', "", env1, &nodes);
    expect_job_ran(&nodes);
    nodes_free(&nodes);
}

/* The same job with TLS on every connection, the certificates signed by one CA given to both
 * nodes' weftrun --tls. */
Test(multinode, two_nodes_over_tls, .timeout = 200)
{
    machine_t m;
    nodes_t nodes;
    char dir[] = "/tmp/weft-multinode-ca-XXXXXX", why[512], ca[600], key[600];

    machine_or_skip(&m);
    cr_assert_not_null(mkdtemp(dir));
    weft_certs_spec_t spec = {"multinode test CA", -1, -60, 24L * 3600};
    weft_certs_pem_t pem;
    cr_assert_eq(weft_certs_make_ca(&spec, &pem, why, sizeof(why)), 0, "%s", why);
    cr_assert_eq(weft_certs_write(dir, "ca", &pem, true, why, sizeof(why)), 0, "%s", why);
    weft_certs_pem_free(&pem);
    snprintf(ca, sizeof(ca), "%s/ca.pem", dir);
    snprintf(key, sizeof(key), "%s/ca.key", dir);
    snprintf(g_weftrun_args, sizeof(g_weftrun_args), "--tls --tls-ca %s --tls-ca-key %s", ca, key);
    run_nodes(&m, 't', "", "", &nodes);
    g_weftrun_args[0] = '\0';
    unlink(ca);
    unlink(key);
    rmdir(dir);
    expect_job_ran(&nodes);
    for (int rank = 0; rank < 4; rank++) {
        char want[64];
        snprintf(want, sizeof(want), "[rank %d] MULTINODE TLS rank %d", rank, rank);
        cr_expect_not_null(run_find_line(nodes.out[rank / 2], want, false), "'%s' missing", want);
    }
    nodes_free(&nodes);
}

/* ---- the rendezvous refusal ---------------------------------------------- */

/* Every rank's join failed with WEFT_ERR_RENDEZVOUS and a text containing each of @p parts. */
static void expect_refused(const nodes_t *nodes, const char *const *parts)
{
    for (int k = 0; k < 2; k++) {
        cr_expect_eq(nodes->status[k], 3, "node %d: weftrun exited %d\nstdout:\n%s\nstderr:\n%s", k,
                     nodes->status[k], nodes->out[k], nodes->err[k]);
        for (int local = 0; local < 2; local++) {
            int rank = 2 * k + local;
            char want[64];
            snprintf(want, sizeof(want), "[rank %d] JOIN FAILED WEFT_ERR_RENDEZVOUS: ", rank);
            const char *line = run_find_line(nodes->out[k], want, true);
            cr_assert_not_null(line, "node %d: '%s' missing\nstdout:\n%s\nstderr:\n%s", k, want,
                               nodes->out[k], nodes->err[k]);
            size_t len = strcspn(line, "\n");
            for (size_t i = 0; parts[i] != NULL; i++) {
                cr_expect(memmem(line, len, parts[i], strlen(parts[i])) != NULL,
                          "rank %d: '%s' missing in: %.*s", rank, parts[i], (int)len, line);
            }
        }
    }
}

/* Node 1 forces a loopback address: the ranks of node 0 could not reach its ranks. */
Test(multinode, loopback_on_another_host_is_refused, .timeout = 200)
{
    static const char *const parts[] = {
        "rank 2 (worker2) advertises 127.0.0.1:",
        "a loopback address, but it runs on another host than rank 0 (its join came from "
        "10.99.0.2)",
        "set WEFT_LISTEN_HOST or WEFT_SOCKET_IFNAME on its node",
        "(2 ranks advertise loopback addresses: 2, 3)", NULL};
    machine_t m;
    nodes_t nodes;

    machine_or_skip(&m);
    run_nodes(&m, 'l', "", "WEFT_LISTEN_HOST=127.0.0.1", &nodes);
    expect_refused(&nodes, parts);
    nodes_free(&nodes);
}

/* Node 0 forces a loopback address (rank 0 is reached at the master address all the same): the
 * ranks of node 1 could not reach rank 1. */
Test(multinode, loopback_on_the_master_host_is_refused, .timeout = 200)
{
    static const char *const parts[] = {
        "rank 1 (worker1) advertises 127.0.0.1:",
        "a loopback address, but rank 2 runs on another host (its "
        "join came from 10.99.0.2)",
        "set WEFT_LISTEN_HOST or WEFT_SOCKET_IFNAME on rank 1's node", NULL};
    machine_t m;
    nodes_t nodes;

    machine_or_skip(&m);
    run_nodes(&m, 'm', "WEFT_LISTEN_HOST=127.0.0.1", "", &nodes);
    expect_refused(&nodes, parts);
    nodes_free(&nodes);
}

/* ---- WEFT_SOCKET_IFNAME refused ------------------------------------------ */

/* multinode_rank --create under @p prefix (argv words before it, may be none) with
 * WEFT_SOCKET_IFNAME=@p ifname: the agent's creation as a rank 1 of 2 would. */
static void create_with_ifname(const char *const *prefix, const char *ifname, run_result_t *r)
{
    const char *argv[16];
    char e_ifname[128];
    int n = 0;

    for (size_t i = 0; prefix != NULL && prefix[i] != NULL; i++) {
        argv[n++] = prefix[i];
    }
    argv[n++] = run_path_from_env("MULTINODE_RANK");
    argv[n++] = "--create";
    argv[n] = NULL;
    snprintf(e_ifname, sizeof(e_ifname), "WEFT_SOCKET_IFNAME=%s", ifname);
    const char *env[] = {e_ifname,
                         "WEFT_RANK=1",
                         "WEFT_WORLD_SIZE=2",
                         "WEFT_MASTER_ADDR=10.99.0.1",
                         "WEFT_MASTER_PORT=29500",
                         NULL};
    run_opts_t o = {.argv = argv, .env = env, .deadline_s = PROBE_S};
    run_capture(&o, r);
}

Test(multinode, unknown_interface_is_refused, .timeout = 60)
{
    run_result_t r;

    create_with_ifname(NULL, "weftnosuch0", &r);
    cr_expect_eq(r.code, 4, "exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.out, r.err);
    cr_expect_not_null(run_find_line(r.out,
                                     "CREATE FAILED WEFT_ERR_INVALID_ARG: agent: "
                                     "WEFT_SOCKET_IFNAME=weftnosuch0: no such interface "
                                     "(interfaces with an IPv4 address: ",
                                     true),
                       "stdout:\n%s", r.out);
    run_result_free(&r);
}

/* In a new network namespace the loopback interface is down, without an address. */
Test(multinode, interface_without_address_is_refused, .timeout = 60)
{
    machine_t m;
    run_result_t r;
    char why[2][512] = {"", ""};

    machine_or_skip(&m);
    for (int i = 0; i < m.nmodes; i++) {
        const char *root[] = {m.unshare, "--net", NULL};
        const char *user[] = {m.unshare, "--user", "--map-root-user", "--net", NULL};
        create_with_ifname(m.modes[i] == IN_USERNS ? user : root, "lo", &r);
        if (strstr(r.out, "CREATE") == NULL) { /* unshare failed: no namespace this way */
            trimmed(r.err, why[i], sizeof(why[i]));
            run_result_free(&r);
            continue;
        }
        cr_expect_eq(r.code, 4, "exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.out, r.err);
        cr_expect_not_null(run_find_line(r.out,
                                         "CREATE FAILED WEFT_ERR_INVALID_ARG: agent: "
                                         "WEFT_SOCKET_IFNAME=lo: the interface has no IPv4 "
                                         "address (interfaces with an IPv4 address: none)",
                                         false),
                           "stdout:\n%s", r.out);
        run_result_free(&r);
        return;
    }
    cr_skip_test("skipped: %s%s%s", why[0], m.nmodes > 1 ? "; in a user namespace: " : "", why[1]);
}
