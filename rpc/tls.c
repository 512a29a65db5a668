/* TLS with client certificates on every connection (docs/security.md).
 *
 * The job's CA signs every rank's certificate. A certificate names its rank by a subjectAltName
 * DNS entry "weft-rank-<r>", and its worker name by a common name other than that. Both sides of
 * every connection verify the other's chain against the CA and its identity:
 *   - gRPC (the join, the streams): the server requires and verifies a client certificate and
 *     checks it against the rank (and name) the Hello claims (weft__tls_call_id, then
 *     weft__hello_check); the client checks the server's against "weft-rank-<peer>" (gRPC's
 *     target name override).
 *   - the direct connections: OpenSSL on the socket (weft__tls_connect, weft__tls_accept), the
 *     same checks on both sides, before the direct handshake.
 * The files are watched: a change is loaded at the next handshake (gRPC's certificate config
 * fetcher on the server side; new channel credentials and SSL contexts for later connections),
 * and a change that does not load (a half-written file) keeps the previous set.
 * A join whose connection fails is diagnosed with a handshake of OpenSSL's own
 * (weft__tls_diagnose), so the user reads why: another CA, an expired certificate, no client
 * certificate, a plaintext rank on one side. */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include <grpc/grpc_security.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include "internal.h"

#define TLS_MAX_FILE  (1u << 20) /* a PEM file larger than this is refused */
#define RANK_PREFIX   "weft-rank-"
#define TSI_FRAME     (1 << 20) /* gRPC's protected frame: larger frames, fewer passes */
#define PROBE_READ_MS 300       /* how long a probe waits for the server's verdict on its cert */

typedef struct {
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime;
} file_stamp_t;

/* One loaded set of files: the PEM texts and the contexts made from them. */
typedef struct {
    char *ca_pem, *cert_pem, *key_pem;
    SSL_CTX *server, *client; /* direct connections (and probes) */
    file_stamp_t stamp[3];
    uint64_t generation;
} tls_set_t;

struct weft__tls {
    char *path[3]; /* CA, certificate, key */
    pthread_mutex_t mu;
    tls_set_t cur;
    uint64_t served; /* the generation gRPC's server was given last */
    bool warned;     /* a change that did not load was reported */
    /* The files as they were when they last failed to load: not read again until they change
     * (each handshake, an unauthenticated one too, would re-read and re-check them). */
    file_stamp_t bad[3];
    bool bad_set;
    int rank;
    char name[WEFT__MAX_NAME + 1];
};

/* ------------------------------------------------------------ files and certificates */

static bool stamp_of(const char *path, file_stamp_t *s)
{
    struct stat st;
    if (stat(path, &st) != 0) {
        return false;
    }
    s->dev = st.st_dev;
    s->ino = st.st_ino;
    s->size = st.st_size;
    s->mtime = st.st_mtim;
    return true;
}

static bool stamp_equal(const file_stamp_t *x, const file_stamp_t *y)
{
    return x->dev == y->dev && x->ino == y->ino && x->size == y->size &&
           x->mtime.tv_sec == y->mtime.tv_sec && x->mtime.tv_nsec == y->mtime.tv_nsec;
}

static char *read_file(const char *what, const char *path, char *why, size_t n)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        snprintf(why, n, "cannot open the TLS %s file '%s': %s", what, path, strerror(errno));
        return NULL;
    }
    char *buf = weft_alloc(TLS_MAX_FILE + 1);
    size_t len = buf != NULL ? fread(buf, 1, TLS_MAX_FILE + 1, f) : 0;
    bool err = ferror(f) != 0;
    fclose(f);
    if (buf == NULL || err || len == 0 || len > TLS_MAX_FILE) {
        snprintf(why, n, "the TLS %s file '%s' is %s", what, path,
                 buf == NULL ? "not readable (no memory)"
                 : err       ? "not readable"
                 : len == 0  ? "empty"
                             : "larger than 1 MiB");
        weft_free(buf);
        return NULL;
    }
    buf[len] = '\0';
    return buf;
}

static const char *ssl_error_text(char *buf, size_t n)
{
    unsigned long e = ERR_peek_last_error();
    if (e == 0) {
        snprintf(buf, n, "no OpenSSL error");
    } else {
        ERR_error_string_n(e, buf, n);
    }
    ERR_clear_error();
    return buf;
}

/* The identity a certificate names. */
void weft__tls_id_of_x509(void *x509, weft__tls_id_t *id)
{
    X509 *x = x509;
    memset(id, 0, sizeof(*id));
    id->tls = true;
    id->rank = -1;
    GENERAL_NAMES *gens = X509_get_ext_d2i(x, NID_subject_alt_name, NULL, NULL);
    for (int i = 0; gens != NULL && i < sk_GENERAL_NAME_num(gens); i++) {
        const GENERAL_NAME *g = sk_GENERAL_NAME_value(gens, i);
        if (g->type != GEN_DNS) {
            continue;
        }
        const char *s = (const char *)ASN1_STRING_get0_data(g->d.dNSName);
        int len = ASN1_STRING_length(g->d.dNSName);
        size_t pl = strlen(RANK_PREFIX);
        if (len <= (int)pl || len > (int)pl + 7 || strncmp(s, RANK_PREFIX, pl) != 0) {
            continue;
        }
        int r = 0;
        bool digits = true;
        for (int k = (int)pl; k < len; k++) {
            digits = digits && s[k] >= '0' && s[k] <= '9';
            r = r * 10 + (s[k] - '0');
        }
        if (!digits) {
            continue;
        }
        /* A certificate naming two ranks names none. */
        id->rank = id->rank == -1 || id->rank == r ? r : -2;
    }
    GENERAL_NAMES_free(gens);
    if (id->rank < -1) {
        id->rank = -2;
    }
    char cn[WEFT__MAX_NAME + 2];
    int k = X509_NAME_get_text_by_NID(X509_get_subject_name(x), NID_commonName, cn, sizeof(cn));
    if (k > WEFT__MAX_NAME) {
        /* Longer than any name: cut short it could equal another's; it names nobody. */
        id->rank = -2;
    } else if (k > 0 && strncmp(cn, RANK_PREFIX, strlen(RANK_PREFIX)) != 0) {
        memcpy(id->name, cn, (size_t)k + 1 <= sizeof(id->name) ? (size_t)k + 1 : 0);
    }
}

/* Reads every certificate of a PEM text. */
static STACK_OF(X509) * pem_certs(const char *pem)
{
    BIO *b = BIO_new_mem_buf(pem, -1);
    STACK_OF(X509) *sk = sk_X509_new_null();
    X509 *x;
    while (b != NULL && sk != NULL && (x = PEM_read_bio_X509(b, NULL, NULL, NULL)) != NULL) {
        if (sk_X509_push(sk, x) == 0) {
            X509_free(x);
            break;
        }
    }
    ERR_clear_error(); /* the end of the text reads as an error */
    BIO_free(b);
    return sk;
}

static void date_text(const ASN1_TIME *t, char *buf, size_t n)
{
    BIO *b = BIO_new(BIO_s_mem());
    buf[0] = '\0';
    if (b != NULL && ASN1_TIME_print(b, t) == 1) {
        int k = BIO_read(b, buf, (int)n - 1);
        buf[k > 0 ? k : 0] = '\0';
    }
    BIO_free(b);
}

/* Makes the direct connections' context of one side from a set's texts. */
static SSL_CTX *make_ctx(bool server, STACK_OF(X509) * ca, STACK_OF(X509) * chain, EVP_PKEY *key)
{
    SSL_CTX *ctx = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
    if (ctx == NULL) {
        return NULL;
    }
    bool ok = SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION) == 1 &&
              SSL_CTX_set_ciphersuites(ctx, "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:"
                                            "TLS_CHACHA20_POLY1305_SHA256") == 1 &&
              SSL_CTX_use_certificate(ctx, sk_X509_value(chain, 0)) == 1 &&
              SSL_CTX_use_PrivateKey(ctx, key) == 1;
    for (int i = 1; ok && i < sk_X509_num(chain); i++) {
        ok = SSL_CTX_add1_chain_cert(ctx, sk_X509_value(chain, i)) == 1;
    }
    X509_STORE *store = SSL_CTX_get_cert_store(ctx);
    for (int i = 0; ok && i < sk_X509_num(ca); i++) {
        ok = X509_STORE_add_cert(store, sk_X509_value(ca, i)) == 1;
    }
    if (!ok) {
        SSL_CTX_free(ctx);
        return NULL;
    }
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | (server ? SSL_VERIFY_FAIL_IF_NO_PEER_CERT : 0),
                       NULL);
    SSL_CTX_set_mode(ctx, SSL_MODE_AUTO_RETRY);
    if (server) {
        SSL_CTX_set_num_tickets(ctx, 0); /* the client never reads after the handshake */
        SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
    }
    return ctx;
}

static void set_free(tls_set_t *s)
{
    weft_free(s->ca_pem);
    weft_free(s->cert_pem);
    weft_free(s->key_pem);
    SSL_CTX_free(s->server);
    SSL_CTX_free(s->client);
    memset(s, 0, sizeof(*s));
}

/*
 * Loads and checks a set: the CA, this rank's certificate (valid now, signed by the CA, naming
 * this rank and, if it binds one, this worker's name) and its key (the certificate's).
 * WEFT_ERR_AUTH or WEFT_ERR_INVALID_ARG with the reason in @p why.
 */
static weft_status_t set_load(weft__tls_t *t, tls_set_t *s, char *why, size_t n)
{
    static const char *const what[3] = {"CA", "certificate", "key"};
    weft_status_t st = WEFT_ERR_AUTH;
    STACK_OF(X509) *ca = NULL, *chain = NULL;
    EVP_PKEY *key = NULL;
    X509_STORE *store = NULL;
    X509_STORE_CTX *vc = NULL;
    char e[256];

    memset(s, 0, sizeof(*s));
    for (int i = 0; i < 3; i++) {
        if (!stamp_of(t->path[i], &s->stamp[i])) {
            snprintf(why, n, "cannot open the TLS %s file '%s': %s", what[i], t->path[i],
                     strerror(errno));
            return WEFT_ERR_INVALID_ARG;
        }
    }
    s->ca_pem = read_file("CA", t->path[0], why, n);
    s->cert_pem = s->ca_pem != NULL ? read_file("certificate", t->path[1], why, n) : NULL;
    s->key_pem = s->cert_pem != NULL ? read_file("key", t->path[2], why, n) : NULL;
    if (s->key_pem == NULL) {
        st = WEFT_ERR_INVALID_ARG;
        goto out;
    }
    ca = pem_certs(s->ca_pem);
    chain = pem_certs(s->cert_pem);
    if (ca == NULL || sk_X509_num(ca) == 0) {
        snprintf(why, n, "the TLS CA file '%s' holds no PEM certificate", t->path[0]);
        goto out;
    }
    if (chain == NULL || sk_X509_num(chain) == 0) {
        snprintf(why, n, "the TLS certificate file '%s' holds no PEM certificate", t->path[1]);
        goto out;
    }
    BIO *b = BIO_new_mem_buf(s->key_pem, -1);
    key = b != NULL ? PEM_read_bio_PrivateKey(b, NULL, NULL, NULL) : NULL;
    BIO_free(b);
    if (key == NULL) {
        snprintf(why, n, "the TLS key file '%s' holds no PEM private key (%s)", t->path[2],
                 ssl_error_text(e, sizeof(e)));
        goto out;
    }
    X509 *leaf = sk_X509_value(chain, 0);
    if (X509_check_private_key(leaf, key) != 1) {
        ERR_clear_error();
        snprintf(why, n, "the TLS key '%s' is not the key of the certificate '%s'", t->path[2],
                 t->path[1]);
        goto out;
    }
    char date[64];
    if (X509_cmp_current_time(X509_get0_notAfter(leaf)) <= 0) {
        date_text(X509_get0_notAfter(leaf), date, sizeof(date));
        snprintf(why, n, "this rank's TLS certificate '%s' expired on %s", t->path[1], date);
        goto out;
    }
    if (X509_cmp_current_time(X509_get0_notBefore(leaf)) >= 0) {
        date_text(X509_get0_notBefore(leaf), date, sizeof(date));
        snprintf(why, n, "this rank's TLS certificate '%s' is not valid before %s", t->path[1],
                 date);
        goto out;
    }
    store = X509_STORE_new();
    vc = X509_STORE_CTX_new();
    bool ok = store != NULL && vc != NULL;
    for (int i = 0; ok && i < sk_X509_num(ca); i++) {
        ok = X509_STORE_add_cert(store, sk_X509_value(ca, i)) == 1;
    }
    if (!ok || X509_STORE_CTX_init(vc, store, leaf, chain) != 1) {
        snprintf(why, n, "TLS: cannot set up a certificate check (no memory)");
        st = WEFT_ERR_NO_MEMORY;
        goto out;
    }
    if (X509_verify_cert(vc) != 1) {
        snprintf(why, n, "this rank's TLS certificate '%s' is not signed by the CA in '%s' (%s)",
                 t->path[1], t->path[0],
                 X509_verify_cert_error_string(X509_STORE_CTX_get_error(vc)));
        ERR_clear_error();
        goto out;
    }
    weft__tls_id_t id;
    weft__tls_id_of_x509(leaf, &id);
    if (id.rank != t->rank) {
        snprintf(why, n,
                 "this rank's TLS certificate '%s' does not name rank %d (it needs the "
                 "subjectAltName DNS:" RANK_PREFIX "%d%s)",
                 t->path[1], t->rank, t->rank,
                 id.rank == -2   ? "; it names several ranks"
                 : id.rank >= 0 ? "; it names another rank"
                                : "");
        goto out;
    }
    if (id.name[0] != '\0' && strcmp(id.name, t->name) != 0) {
        snprintf(why, n,
                 "this rank's TLS certificate '%s' binds the worker name '%s', but this worker is "
                 "'%s'",
                 t->path[1], id.name, t->name);
        goto out;
    }
    s->server = make_ctx(true, ca, chain, key);
    s->client = make_ctx(false, ca, chain, key);
    if (s->server == NULL || s->client == NULL) {
        snprintf(why, n, "TLS: cannot make an SSL context (%s)", ssl_error_text(e, sizeof(e)));
        goto out;
    }
    st = WEFT_OK;
out:
    X509_STORE_CTX_free(vc);
    X509_STORE_free(store);
    sk_X509_pop_free(ca, X509_free);
    sk_X509_pop_free(chain, X509_free);
    EVP_PKEY_free(key);
    if (st != WEFT_OK) {
        set_free(s);
    }
    return st;
}

/* Loads the files again if one changed since they were read; the new set replaces the old one
 * only when it loads and checks. Called with t->mu held. */
static void refresh_locked(weft__tls_t *t)
{
    file_stamp_t now[3];
    bool same = true, known_bad = t->bad_set, readable = true;
    for (int i = 0; i < 3; i++) {
        readable = stamp_of(t->path[i], &now[i]) && readable;
        same = same && readable && stamp_equal(&now[i], &t->cur.stamp[i]);
        known_bad = known_bad && readable && stamp_equal(&now[i], &t->bad[i]);
    }
    if (same || known_bad) {
        return;
    }
    tls_set_t next;
    char why[512];
    if (set_load(t, &next, why, sizeof(why)) != WEFT_OK) {
        if (!t->warned) {
            WEFT_WARN("TLS files changed but do not load (%s); keeping the previous ones", why);
            t->warned = true;
        }
        if (readable) {
            memcpy(t->bad, now, sizeof(t->bad));
            t->bad_set = true;
        }
        return;
    }
    t->bad_set = false;
    next.generation = t->cur.generation + 1;
    set_free(&t->cur);
    t->cur = next;
    t->warned = false;
    WEFT_INFO("TLS: loaded the changed certificate files (generation %llu)",
              (unsigned long long)t->cur.generation);
}

/* ------------------------------------------------------------ the agent's set */

weft_status_t weft__tls_create(weft_agent_t *a, const char *ca, const char *cert, const char *key)
{
    char why[768];

    a->tls = NULL;
    if (ca == NULL || ca[0] == '\0') {
        if ((cert != NULL && cert[0] != '\0') || (key != NULL && key[0] != '\0')) {
            return weft__set_error(WEFT_ERR_INVALID_ARG,
                                   "agent: a TLS certificate or key was given without a CA "
                                   "(opts.tls_ca_file or WEFT_TLS_CA): TLS needs all three");
        }
        return WEFT_OK;
    }
    if (cert == NULL || cert[0] == '\0' || key == NULL || key[0] == '\0') {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "agent: TLS is on (a CA was given) but this rank has no %s "
                               "(opts.tls_%s_file or WEFT_TLS_%s): every rank needs its own",
                               cert == NULL || cert[0] == '\0' ? "certificate" : "key",
                               cert == NULL || cert[0] == '\0' ? "cert" : "key",
                               cert == NULL || cert[0] == '\0' ? "CERT" : "KEY");
    }
    weft__tls_t *t = weft_calloc(1, sizeof(*t));
    if (t == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "agent: no memory for TLS");
    }
    pthread_mutex_init(&t->mu, NULL);
    t->rank = a->rank;
    snprintf(t->name, sizeof(t->name), "%s", a->name);
    t->path[0] = weft_strdup(ca);
    t->path[1] = weft_strdup(cert);
    t->path[2] = weft_strdup(key);
    weft_status_t st;
    if (t->path[0] == NULL || t->path[1] == NULL || t->path[2] == NULL) {
        st = WEFT_ERR_NO_MEMORY;
        snprintf(why, sizeof(why), "no memory");
    } else {
        st = set_load(t, &t->cur, why, sizeof(why));
    }
    if (st != WEFT_OK) {
        a->tls = t;
        weft__tls_free(a);
        return weft__set_error(st, "agent: %s", why);
    }
    t->cur.generation = 1;
    a->tls = t;
    return WEFT_OK;
}

void weft__tls_free(weft_agent_t *a)
{
    weft__tls_t *t = a->tls;
    if (t == NULL) {
        return;
    }
    set_free(&t->cur);
    for (int i = 0; i < 3; i++) {
        weft_free(t->path[i]);
    }
    pthread_mutex_destroy(&t->mu);
    weft_free(t);
    a->tls = NULL;
}

/* gRPC's server asks at every handshake whether the files changed. */
static grpc_ssl_certificate_config_reload_status fetch_config(
    void *arg, grpc_ssl_server_certificate_config **config)
{
    weft__tls_t *t = arg;
    pthread_mutex_lock(&t->mu);
    refresh_locked(t);
    if (t->served == t->cur.generation) {
        pthread_mutex_unlock(&t->mu);
        return GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_UNCHANGED;
    }
    grpc_ssl_pem_key_cert_pair pair = {t->cur.key_pem, t->cur.cert_pem};
    *config = grpc_ssl_server_certificate_config_create(t->cur.ca_pem, &pair, 1);
    if (*config != NULL) {
        t->served = t->cur.generation; /* else the next handshake asks again */
    }
    pthread_mutex_unlock(&t->mu);
    return *config != NULL ? GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_NEW
                           : GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_FAIL;
}

grpc_server_credentials *weft__tls_server_credentials(weft_agent_t *a)
{
    if (a->tls == NULL) {
        return grpc_insecure_server_credentials_create();
    }
    grpc_ssl_server_credentials_options *o =
        grpc_ssl_server_credentials_create_options_using_config_fetcher(
            GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY, fetch_config, a->tls);
    return o != NULL ? grpc_ssl_server_credentials_create_with_options(o) : NULL;
}
/* gRPC's check of the server a channel reaches, after its own (CA, then the target name, which
 * accepts a certificate that names this rank among others, or names it only in its common
 * name): the certificate must name the rank in @p userdata, and no other (the rule the
 * accepting side and the Hello apply). 0 accepts. */
static int names_rank(const char *target_name, const char *peer_pem, void *userdata)
{
    (void)target_name;
    int want = (int)(intptr_t)userdata;
    BIO *b = peer_pem != NULL ? BIO_new_mem_buf(peer_pem, -1) : NULL;
    X509 *x = b != NULL ? PEM_read_bio_X509(b, NULL, NULL, NULL) : NULL;
    weft__tls_id_t id = {0};
    id.rank = -1;
    if (x != NULL) {
        weft__tls_id_of_x509(x, &id);
        X509_free(x);
    }
    BIO_free(b);
    ERR_clear_error();
    if (id.rank != want) {
        WEFT_WARN("TLS: the server reached as rank %d presented a certificate that names %s",
                  want, id.rank == -2 ? "several ranks" : "another rank or none");
        return 1;
    }
    return 0;
}

/* Whether the peer of @p ssl presented a certificate that names rank @p peer and no other; else
 * @p why says what it names. */
static bool names_peer(SSL *ssl, int peer, char *why, size_t n)
{
    X509 *x = SSL_get1_peer_certificate(ssl);
    weft__tls_id_t id = {0};
    id.rank = -1;
    if (x != NULL) {
        weft__tls_id_of_x509(x, &id);
        X509_free(x);
    }
    if (id.rank == peer) {
        return true;
    }
    if (id.rank == -2) {
        snprintf(why, n, "the certificate presented for rank %d names several ranks", peer);
    } else if (id.rank >= 0) {
        snprintf(why, n, "the certificate presented for rank %d names rank %d", peer, id.rank);
    } else {
        snprintf(why, n,
                 "the certificate presented for rank %d names no rank (no subjectAltName "
                 "DNS:" RANK_PREFIX "%d; a common name alone does not count)",
                 peer, peer);
    }
    return false;
}


grpc_channel *weft__channel_create(weft_agent_t *a, const char *target, int peer)
{
    if (a->tls == NULL) {
        grpc_channel_credentials *creds = grpc_insecure_credentials_create();
        grpc_channel *ch = grpc_channel_create(target, creds, a->chan_args);
        grpc_channel_credentials_release(creds);
        return ch;
    }
    weft__tls_t *t = a->tls;
    pthread_mutex_lock(&t->mu);
    refresh_locked(t);
    grpc_ssl_pem_key_cert_pair pair = {t->cur.key_pem, t->cur.cert_pem};
    grpc_ssl_verify_peer_options verify = {names_rank, (void *)(intptr_t)peer, NULL};
    grpc_channel_credentials *creds = grpc_ssl_credentials_create_ex(t->cur.ca_pem, &pair,
                                                                     &verify, NULL);
    pthread_mutex_unlock(&t->mu);
    if (creds == NULL) {
        return NULL;
    }
    /* The server must prove the rank this rank means to reach. */
    char host[32];
    snprintf(host, sizeof(host), RANK_PREFIX "%d", peer);
    grpc_arg v[24];
    size_t n = a->chan_args->num_args;
    if (n > 22) {
        n = 22;
    }
    memcpy(v, a->chan_args->args, n * sizeof(v[0]));
    v[n].type = GRPC_ARG_STRING;
    v[n].key = (char *)GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
    v[n].value.string = host;
    n++;
    grpc_channel_args args = {n, v};
    grpc_channel *ch = grpc_channel_create(target, creds, &args);
    grpc_channel_credentials_release(creds);
    return ch;
}

void weft__tls_grpc_args(const weft_agent_t *a, grpc_arg *args, size_t *n_p)
{
    if (a->tls == NULL) {
        return;
    }
    args[*n_p].type = GRPC_ARG_INTEGER;
    args[*n_p].key = (char *)GRPC_ARG_TSI_MAX_FRAME_SIZE;
    args[*n_p].value.integer = TSI_FRAME;
    (*n_p)++;
}

void weft__tls_call_id(grpc_call *call, weft__tls_id_t *id)
{
    memset(id, 0, sizeof(*id));
    id->rank = -1;
    grpc_auth_context *ctx = grpc_call_auth_context(call);
    if (ctx == NULL) {
        return;
    }
    if (grpc_auth_context_peer_is_authenticated(ctx)) {
        grpc_auth_property_iterator it =
            grpc_auth_context_find_properties_by_name(ctx, GRPC_X509_PEM_CERT_PROPERTY_NAME);
        const grpc_auth_property *p = grpc_auth_property_iterator_next(&it);
        if (p != NULL) {
            BIO *b = BIO_new_mem_buf(p->value, (int)p->value_length);
            X509 *x = b != NULL ? PEM_read_bio_X509(b, NULL, NULL, NULL) : NULL;
            BIO_free(b);
            if (x != NULL) {
                weft__tls_id_of_x509(x, id);
                X509_free(x);
            }
            ERR_clear_error();
        }
    }
    grpc_auth_context_release(ctx);
}

weft_status_t weft__tls_check_id(const weft_agent_t *a, const weft__tls_id_t *id, int rank,
                                 const char *name, char *why, size_t n)
{
    if (a->tls == NULL) {
        return WEFT_OK;
    }
    if (id == NULL || !id->tls) {
        snprintf(why, n, "the connection claiming rank %d presented no verified TLS certificate",
                 rank);
        return WEFT_ERR_AUTH;
    }
    if (id->rank != rank) {
        if (id->rank >= 0) {
            snprintf(why, n,
                     "the connection claiming rank %d presented the certificate of rank %d: a "
                     "rank cannot join or connect as another",
                     rank, id->rank);
        } else {
            snprintf(why, n,
                     "the connection claiming rank %d presented a certificate that names %s "
                     "(it needs the subjectAltName DNS:" RANK_PREFIX "%d)",
                     rank, id->rank == -2 ? "several ranks" : "no rank", rank);
        }
        return WEFT_ERR_AUTH;
    }
    if (name != NULL && id->name[0] != '\0' && strcmp(id->name, name) != 0) {
        snprintf(why, n,
                 "the connection claiming rank %d as '%s' presented a certificate bound to the "
                 "worker name '%s'",
                 rank, name, id->name);
        return WEFT_ERR_AUTH;
    }
    return WEFT_OK;
}

/* ------------------------------------------------------------ direct connections */

/* Socket timeouts for the blocking handshake: what is left of @p deadline_ns (0: none). */
static void set_timeouts(int fd, int64_t deadline_ns)
{
    struct timeval tv = {0, 0};
    if (deadline_ns != 0) {
        int64_t left_us = (deadline_ns - weft__now_ns()) / 1000;
        if (left_us < 1000) {
            left_us = 1000;
        }
        tv.tv_sec = left_us / 1000000;
        tv.tv_usec = left_us % 1000000;
    }
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

bool weft__tls_read_until(void *ssl_p, int fd, void *buf, size_t n, int64_t deadline_ns)
{
    SSL *ssl = ssl_p;
    uint8_t *p = buf;
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
        return false;
    }
    bool ok = true;
    while (n > 0) {
        int k = SSL_read(ssl, p, n > (1u << 30) ? (1 << 30) : (int)n);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        int e = SSL_get_error(ssl, k);
        int64_t left_ms = (deadline_ns - weft__now_ns()) / 1000000;
        if ((e != SSL_ERROR_WANT_READ && e != SSL_ERROR_WANT_WRITE) || left_ms <= 0) {
            ok = false;
            break;
        }
        struct pollfd pfd = {fd, e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, 0};
        if (poll(&pfd, 1, (int)(left_ms < 1000 ? left_ms : 1000)) < 0 && errno != EINTR) {
            ok = false;
            break;
        }
    }
    int saved = errno;
    (void)fcntl(fd, F_SETFL, flags);
    errno = saved;
    return ok;
}

/* The TLS handshake within one deadline however slowly the bytes come: non-blocking, waiting in
 * poll for what is left of it. 1, or what SSL_accept / SSL_connect returned. */
static int handshake(SSL *ssl, int fd, bool server, int64_t deadline_ns)
{
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
        return -1;
    }
    int r;
    for (;;) {
        r = server ? SSL_accept(ssl) : SSL_connect(ssl);
        if (r == 1) {
            break;
        }
        int e = SSL_get_error(ssl, r);
        if (e != SSL_ERROR_WANT_READ && e != SSL_ERROR_WANT_WRITE) {
            break;
        }
        int64_t left_ms = (deadline_ns - weft__now_ns()) / 1000000;
        if (left_ms <= 0) {
            errno = ETIMEDOUT;
            r = -1;
            break;
        }
        struct pollfd pfd = {fd, e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, 0};
        if (poll(&pfd, 1, (int)(left_ms < 1000 ? left_ms : 1000)) < 0 && errno != EINTR) {
            r = -1;
            break;
        }
    }
    int saved = errno;
    (void)fcntl(fd, F_SETFL, flags);
    errno = saved;
    return r;
}

static SSL *ssl_new(weft__tls_t *t, bool server, int fd)
{
    pthread_mutex_lock(&t->mu);
    refresh_locked(t);
    SSL *ssl = SSL_new(server ? t->cur.server : t->cur.client);
    pthread_mutex_unlock(&t->mu);
    if (ssl != NULL && SSL_set_fd(ssl, fd) != 1) {
        SSL_free(ssl);
        ssl = NULL;
    }
    return ssl;
}

/* Why a handshake failed, in words. */
static void handshake_why(SSL *ssl, int r, char *why, size_t n)
{
    char e[256];
    long v = SSL_get_verify_result(ssl);
    int err = SSL_get_error(ssl, r);
    if (v != X509_V_OK) {
        snprintf(why, n, "the peer's certificate does not verify: %s",
                 X509_verify_cert_error_string(v));
        ERR_clear_error();
    } else if (err == SSL_ERROR_SYSCALL && ERR_peek_last_error() == 0) {
        snprintf(why, n, "the connection closed or timed out during the TLS handshake");
    } else {
        snprintf(why, n, "TLS handshake failed: %s", ssl_error_text(e, sizeof(e)));
    }
}

void *weft__tls_connect(weft_agent_t *a, int fd, int peer, int64_t deadline_ns, char *why,
                        size_t n)
{
    SSL *ssl = ssl_new(a->tls, false, fd);
    char host[32];
    snprintf(host, sizeof(host), RANK_PREFIX "%d", peer);
    if (ssl == NULL || SSL_set1_host(ssl, host) != 1) {
        snprintf(why, n, "TLS: no memory for a connection");
        SSL_free(ssl);
        return NULL;
    }
    set_timeouts(fd, deadline_ns);
    int r = handshake(ssl, fd, false, deadline_ns);
    if (r != 1) {
        handshake_why(ssl, r, why, n);
        SSL_free(ssl);
        return NULL;
    }
    /* SSL_set1_host accepts a certificate that names this rank among others, or only in its
     * common name: the peer's must name exactly the rank this one means to reach. */
    if (!names_peer(ssl, peer, why, n)) {
        SSL_free(ssl);
        return NULL;
    }
    return ssl;
}

void *weft__tls_accept(weft_agent_t *a, int fd, int64_t deadline_ns, weft__tls_id_t *id,
                       char *why, size_t n)
{
    SSL *ssl = ssl_new(a->tls, true, fd);
    if (ssl == NULL) {
        snprintf(why, n, "TLS: no memory for a connection");
        return NULL;
    }
    set_timeouts(fd, deadline_ns);
    int r = handshake(ssl, fd, true, deadline_ns);
    if (r != 1) {
        handshake_why(ssl, r, why, n);
        SSL_free(ssl);
        return NULL;
    }
    X509 *x = SSL_get1_peer_certificate(ssl);
    if (x == NULL) {
        snprintf(why, n, "the peer presented no certificate");
        SSL_free(ssl);
        return NULL;
    }
    weft__tls_id_of_x509(x, id);
    X509_free(x);
    return ssl;
}

void weft__tls_after_handshake(int fd)
{
    set_timeouts(fd, 0);
}

/* ------------------------------------------------------------ SIGPIPE */

void weft__nopipe_begin(weft__nopipe_t *np)
{
    sigset_t pipe, pend;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, &np->old);
    np->pending = sigpending(&pend) == 0 && sigismember(&pend, SIGPIPE) == 1;
}

void weft__nopipe_end(weft__nopipe_t *np, bool failed)
{
    if (failed && !np->pending) {
        sigset_t pipe;
        sigemptyset(&pipe);
        sigaddset(&pipe, SIGPIPE);
        struct timespec zero = {0, 0};
        while (sigtimedwait(&pipe, NULL, &zero) < 0 && errno == EINTR) {
        }
    }
    pthread_sigmask(SIG_SETMASK, &np->old, NULL);
}

void weft__nopipe_thread(void)
{
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, NULL);
}

/* ------------------------------------------------------------ diagnosis */

static int probe_connect(const char *address, int64_t deadline_ns)
{
    char host[300];
    snprintf(host, sizeof(host), "%s", address);
    char *colon = strrchr(host, ':');
    if (colon == NULL) {
        return -1;
    }
    *colon = '\0';
    char *h = host;
    if (h[0] == '[') {
        h++;
        char *end = strchr(h, ']');
        if (end != NULL) {
            *end = '\0';
        }
    }
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(h, colon + 1, &hints, &res) != 0) {
        return -1;
    }
    int fd = -1;
    for (struct addrinfo *ai = res; ai != NULL && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            continue;
        }
        set_timeouts(fd, deadline_ns);
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    return fd;
}

/* The reason of the last OpenSSL error (0: none). */
static int last_reason(void)
{
    unsigned long e = ERR_peek_last_error();
    return e == 0 ? 0 : ERR_GET_REASON(e);
}

/* What an alert the server sent says about this rank's certificate. */
static const char *alert_text(int reason)
{
    switch (reason) {
    case SSL_R_TLSV13_ALERT_CERTIFICATE_REQUIRED:
        return "it requires a client certificate and got none";
    case SSL_R_TLSV1_ALERT_UNKNOWN_CA:
        return "it does not know the CA that signed this rank's certificate (another job's CA?)";
    case SSL_R_SSLV3_ALERT_CERTIFICATE_EXPIRED:
        return "it says this rank's certificate has expired";
    case SSL_R_SSLV3_ALERT_BAD_CERTIFICATE:
    case SSL_R_SSLV3_ALERT_UNSUPPORTED_CERTIFICATE:
    case SSL_R_SSLV3_ALERT_CERTIFICATE_UNKNOWN:
    case SSL_R_TLSV1_ALERT_DECRYPT_ERROR:
        return "it refused this rank's certificate";
    case SSL_R_SSLV3_ALERT_CERTIFICATE_REVOKED:
        return "it says this rank's certificate was revoked";
    default:
        return NULL;
    }
}

weft_status_t weft__tls_diagnose(weft_agent_t *a, const char *address, int peer,
                                 int64_t deadline_ns)
{
    weft_status_t st = WEFT_OK;
    int fd = probe_connect(address, deadline_ns);
    if (fd < 0) {
        return WEFT_OK; /* nothing listens yet: not a TLS matter */
    }
    weft__nopipe_t np;
    weft__nopipe_begin(&np);
    SSL_CTX *plain = NULL;
    SSL *ssl = NULL;
    if (a->tls == NULL) {
        /* Does the other side speak TLS? Then this plaintext rank cannot reach it. */
        plain = SSL_CTX_new(TLS_client_method());
        ssl = plain != NULL ? SSL_new(plain) : NULL;
        if (ssl != NULL && SSL_set_fd(ssl, fd) == 1) {
            SSL_set_verify(ssl, SSL_VERIFY_NONE, NULL);
            int r = SSL_connect(ssl);
            X509 *x = SSL_get0_peer_certificate(ssl);
            if (r == 1 || x != NULL || alert_text(last_reason()) != NULL) {
                st = weft__set_error(
                    WEFT_ERR_PROTOCOL,
                    "rpc: rank %d at %s speaks TLS, and this rank has TLS off: give every rank "
                    "the job's CA, its certificate and key (WEFT_TLS_CA, WEFT_TLS_CERT, "
                    "WEFT_TLS_KEY, or weftrun --tls)",
                    peer, address);
            }
        }
        ERR_clear_error();
        goto out;
    }
    char host[32];
    snprintf(host, sizeof(host), RANK_PREFIX "%d", peer);
    ssl = ssl_new(a->tls, false, fd);
    /* As gRPC's own client: it offers "h2", and a gRPC server closes a connection that does not
     * (which must not read as a refusal). */
    if (ssl == NULL || SSL_set1_host(ssl, host) != 1 ||
        SSL_set_alpn_protos(ssl, (const unsigned char *)"\x02h2", 3) != 0) {
        goto out;
    }
    int r = SSL_connect(ssl);
    int err_no = errno;
    char idwhy[200];
    if (r == 1 && !names_peer(ssl, peer, idwhy, sizeof(idwhy))) {
        st = weft__set_error(WEFT_ERR_AUTH, "rpc: %s at %s: it is not the rank this one means to "
                                            "reach",
                             idwhy, address);
        goto out;
    }
    if (r == 1) {
        /* TLS 1.3: the server judges this rank's certificate after the client's last flight;
         * its verdict, if it refuses, is an alert or a close before any data. The HTTP/2
         * preface and an empty SETTINGS frame make a server that accepts answer with its own
         * SETTINGS: data back is the acceptance. */
        static const char preface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                                      "\x00\x00\x00\x04\x00\x00\x00\x00\x00";
        (void)SSL_write(ssl, preface, (int)sizeof(preface) - 1);
        struct pollfd pfd = {fd, POLLIN, 0};
        if (poll(&pfd, 1, PROBE_READ_MS) == 1) {
            char b;
            r = SSL_read(ssl, &b, 1);
            int reason = r <= 0 ? last_reason() : 0;
            const char *t = alert_text(reason);
            if (t == NULL && r <= 0 &&
                (reason == SSL_R_UNEXPECTED_EOF_WHILE_READING ||
                 SSL_get_error(ssl, r) == SSL_ERROR_ZERO_RETURN ||
                 SSL_get_error(ssl, r) == SSL_ERROR_SYSCALL)) {
                /* gRPC closes without sending its alert: a server that hangs up right after
                 * the handshake, before any data, refused this rank's certificate. */
                t = "it closed the connection right after the handshake (this rank's certificate "
                    "is not one it accepts: another job's CA, expired, or no client "
                    "certificate)";
            }
            if (t != NULL) {
                st = weft__set_error(WEFT_ERR_AUTH,
                                     "rpc: rank %d at %s refused this rank's TLS certificate: %s",
                                     peer, address, t);
            }
        }
        ERR_clear_error();
        goto out;
    }
    long v = SSL_get_verify_result(ssl);
    int reason = last_reason();
    const char *t = alert_text(reason);
    if (reason == 0 && (err_no == EAGAIN || err_no == EWOULDBLOCK || err_no == EINTR)) {
        /* The probe ran out of time: no verdict. */
    } else if (v == X509_V_ERR_CERT_HAS_EXPIRED) {
        X509 *x = SSL_get0_peer_certificate(ssl);
        char date[64] = "?";
        if (x != NULL) {
            date_text(X509_get0_notAfter(x), date, sizeof(date));
        }
        st = weft__set_error(WEFT_ERR_AUTH,
                             "rpc: rank %d at %s presented a TLS certificate that expired on %s",
                             peer, address, date);
    } else if (v == X509_V_ERR_HOSTNAME_MISMATCH) {
        st = weft__set_error(WEFT_ERR_AUTH,
                             "rpc: the TLS certificate presented at %s does not name rank %d (no "
                             "subjectAltName DNS:%s): it is not the rank this one means to reach",
                             address, peer, host);
    } else if (v != X509_V_OK) {
        st = weft__set_error(WEFT_ERR_AUTH,
                             "rpc: rank %d at %s presented a TLS certificate that this job's CA "
                             "does not verify (%s): another job's CA?",
                             peer, address, X509_verify_cert_error_string(v));
    } else if (t != NULL) {
        st = weft__set_error(WEFT_ERR_AUTH,
                             "rpc: rank %d at %s refused this rank's TLS certificate: %s", peer,
                             address, t);
    } else if (reason == SSL_R_WRONG_VERSION_NUMBER || reason == SSL_R_PACKET_LENGTH_TOO_LONG ||
               reason == SSL_R_UNEXPECTED_EOF_WHILE_READING ||
               (reason == 0 && SSL_get_error(ssl, r) == SSL_ERROR_SYSCALL)) {
        st = weft__set_error(WEFT_ERR_PROTOCOL,
                             "rpc: rank %d at %s does not speak TLS (a rank with TLS off?), and "
                             "this rank has TLS on: every rank of a job needs the same setting",
                             peer, address);
    }
    ERR_clear_error();
out:
    SSL_free(ssl);
    SSL_CTX_free(plain);
    close(fd);
    weft__nopipe_end(&np, true);
    return st;
}
