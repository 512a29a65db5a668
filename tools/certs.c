/* Certificates for a weft job with OpenSSL's API (no shelling out). See certs.h. */
#include "certs.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

static int fail(char *why, size_t n, const char *what)
{
    char e[256] = "";
    unsigned long code = ERR_peek_last_error();
    if (code != 0) {
        ERR_error_string_n(code, e, sizeof(e));
    }
    ERR_clear_error();
    snprintf(why, n, "%s%s%s", what, e[0] != '\0' ? ": " : "", e);
    return -1;
}

static char *bio_text(BIO *b)
{
    char *data;
    long len = BIO_get_mem_data(b, &data);
    char *s = malloc((size_t)len + 1);
    if (s != NULL) {
        memcpy(s, data, (size_t)len);
        s[len] = '\0';
    }
    return s;
}

static int to_pem(X509 *x, EVP_PKEY *k, weft_certs_pem_t *out)
{
    BIO *bc = BIO_new(BIO_s_mem());
    BIO *bk = BIO_new(BIO_s_mem());
    int rc = -1;
    if (bc != NULL && bk != NULL && PEM_write_bio_X509(bc, x) == 1 &&
        PEM_write_bio_PrivateKey(bk, k, NULL, NULL, 0, NULL, NULL) == 1) {
        out->cert = bio_text(bc);
        out->key = bio_text(bk);
        rc = out->cert != NULL && out->key != NULL ? 0 : -1;
    }
    BIO_free(bc);
    BIO_free(bk);
    return rc;
}

static int add_ext(X509 *x, X509 *issuer, int nid, const char *value)
{
    X509V3_CTX ctx;
    X509V3_set_ctx_nodb(&ctx);
    X509V3_set_ctx(&ctx, issuer, x, NULL, NULL, 0);
    X509_EXTENSION *e = X509V3_EXT_conf_nid(NULL, &ctx, nid, value);
    int ok = e != NULL && X509_add_ext(x, e, -1) == 1;
    X509_EXTENSION_free(e);
    return ok ? 0 : -1;
}

/* The common part: a key, the subject, serial and validity. */
static X509 *new_cert(const weft_certs_spec_t *spec, EVP_PKEY **key_p)
{
    EVP_PKEY *key = EVP_EC_gen("P-256");
    X509 *x = X509_new();
    uint8_t serial[16];
    BIGNUM *bn = NULL;
    bool ok = key != NULL && x != NULL && RAND_bytes(serial, sizeof(serial)) == 1;
    if (ok) {
        serial[0] &= 0x7f; /* positive */
        bn = BN_bin2bn(serial, sizeof(serial), NULL);
        ok = bn != NULL && BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(x)) != NULL &&
             X509_set_version(x, 2) == 1 &&
             X509_gmtime_adj(X509_getm_notBefore(x), spec->not_before_s) != NULL &&
             X509_gmtime_adj(X509_getm_notAfter(x), spec->not_after_s) != NULL &&
             X509_set_pubkey(x, key) == 1 &&
             X509_NAME_add_entry_by_txt(X509_get_subject_name(x), "CN", MBSTRING_UTF8,
                                        (const unsigned char *)spec->common_name, -1, -1,
                                        0) == 1;
    }
    BN_free(bn);
    if (!ok) {
        X509_free(x);
        EVP_PKEY_free(key);
        return NULL;
    }
    *key_p = key;
    return x;
}

int weft_certs_make_ca(const weft_certs_spec_t *spec, weft_certs_pem_t *out, char *why, size_t n)
{
    EVP_PKEY *key = NULL;
    memset(out, 0, sizeof(*out));
    X509 *x = new_cert(spec, &key);
    int rc = -1;
    if (x == NULL) {
        return fail(why, n, "cannot make a CA certificate");
    }
    if (X509_set_issuer_name(x, X509_get_subject_name(x)) != 1 ||
        add_ext(x, x, NID_basic_constraints, "critical,CA:TRUE") != 0 ||
        add_ext(x, x, NID_key_usage, "critical,keyCertSign,cRLSign") != 0 ||
        add_ext(x, x, NID_subject_key_identifier, "hash") != 0 ||
        X509_sign(x, key, EVP_sha256()) == 0 || to_pem(x, key, out) != 0) {
        rc = fail(why, n, "cannot sign the CA certificate");
        weft_certs_pem_free(out);
    } else {
        rc = 0;
    }
    X509_free(x);
    EVP_PKEY_free(key);
    return rc;
}

int weft_certs_make_leaf(const weft_certs_pem_t *ca, const weft_certs_spec_t *spec,
                         weft_certs_pem_t *out, char *why, size_t n)
{
    memset(out, 0, sizeof(*out));
    BIO *bc = BIO_new_mem_buf(ca->cert, -1);
    BIO *bk = BIO_new_mem_buf(ca->key, -1);
    X509 *cax = bc != NULL ? PEM_read_bio_X509(bc, NULL, NULL, NULL) : NULL;
    EVP_PKEY *cak = bk != NULL ? PEM_read_bio_PrivateKey(bk, NULL, NULL, NULL) : NULL;
    BIO_free(bc);
    BIO_free(bk);
    EVP_PKEY *key = NULL;
    X509 *x = cax != NULL && cak != NULL ? new_cert(spec, &key) : NULL;
    int rc = -1;
    if (x == NULL) {
        rc = fail(why, n, cax == NULL || cak == NULL ? "the CA's certificate or key does not read"
                                                     : "cannot make a certificate");
        goto out;
    }
    char san[64];
    snprintf(san, sizeof(san), "DNS:weft-rank-%d", spec->rank);
    if (X509_set_issuer_name(x, X509_get_subject_name(cax)) != 1 ||
        add_ext(x, cax, NID_basic_constraints, "critical,CA:FALSE") != 0 ||
        add_ext(x, cax, NID_key_usage, "critical,digitalSignature,keyEncipherment") != 0 ||
        add_ext(x, cax, NID_ext_key_usage, "serverAuth,clientAuth") != 0 ||
        add_ext(x, cax, NID_authority_key_identifier, "keyid:always") != 0 ||
        (spec->rank >= 0 && add_ext(x, cax, NID_subject_alt_name, san) != 0) ||
        X509_sign(x, cak, EVP_sha256()) == 0 || to_pem(x, key, out) != 0) {
        rc = fail(why, n, "cannot sign a rank's certificate");
        weft_certs_pem_free(out);
    } else {
        rc = 0;
    }
out:
    X509_free(x);
    X509_free(cax);
    EVP_PKEY_free(key);
    EVP_PKEY_free(cak);
    return rc;
}

static int write_text(const char *dir, const char *name, const char *text, mode_t mode, char *why,
                      size_t n)
{
    char path[4096], tmp[4200];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    snprintf(tmp, sizeof(tmp), "%s.tmp%ld", path, (long)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
    if (fd < 0) {
        snprintf(why, n, "cannot write %s: %s", tmp, strerror(errno));
        return -1;
    }
    size_t len = strlen(text), off = 0;
    while (off < len) {
        ssize_t k = write(fd, text + off, len - off);
        if (k < 0 && errno == EINTR) {
            continue;
        }
        if (k <= 0) {
            snprintf(why, n, "cannot write %s: %s", tmp, strerror(errno));
            close(fd);
            unlink(tmp);
            return -1;
        }
        off += (size_t)k;
    }
    if (fsync(fd) != 0 || close(fd) != 0 || rename(tmp, path) != 0) {
        snprintf(why, n, "cannot write %s: %s", path, strerror(errno));
        unlink(tmp);
        return -1;
    }
    return 0;
}

int weft_certs_write(const char *dir, const char *stem, const weft_certs_pem_t *p, bool with_key,
                     char *why, size_t n)
{
    char name[512];
    snprintf(name, sizeof(name), "%s.pem", stem);
    if (write_text(dir, name, p->cert, 0644, why, n) != 0) {
        return -1;
    }
    snprintf(name, sizeof(name), "%s.key", stem);
    return with_key ? write_text(dir, name, p->key, 0600, why, n) : 0;
}

static char *slurp(const char *path, char *why, size_t n)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        snprintf(why, n, "cannot open %s: %s", path, strerror(errno));
        return NULL;
    }
    char *buf = malloc((1 << 20) + 1);
    size_t len = buf != NULL ? fread(buf, 1, 1 << 20, f) : 0;
    fclose(f);
    if (buf == NULL || len == 0) {
        snprintf(why, n, "cannot read %s", path);
        free(buf);
        return NULL;
    }
    buf[len] = '\0';
    return buf;
}

int weft_certs_read(const char *cert_path, const char *key_path, weft_certs_pem_t *out, char *why,
                    size_t n)
{
    memset(out, 0, sizeof(*out));
    out->cert = slurp(cert_path, why, n);
    out->key = out->cert != NULL ? slurp(key_path, why, n) : NULL;
    if (out->key == NULL) {
        weft_certs_pem_free(out);
        return -1;
    }
    return 0;
}

void weft_certs_pem_free(weft_certs_pem_t *p)
{
    free(p->cert);
    free(p->key);
    p->cert = p->key = NULL;
}
