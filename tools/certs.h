/* Certificates for a weft job, made with OpenSSL's API: a job CA and one certificate per rank
 * (docs/security.md). Used by `weftrun --tls` and by the tests. Not part of libweft. */
#ifndef WEFT_TOOLS_CERTS_H
#define WEFT_TOOLS_CERTS_H

#include <stdbool.h>
#include <stddef.h>

/* A certificate and its private key, PEM text (free with weft_certs_pem_free). */
typedef struct {
    char *cert;
    char *key;
} weft_certs_pem_t;

/* What to make. Times are seconds from now (negative: in the past). */
typedef struct {
    const char *common_name; /* the subject's CN */
    int rank;                /* >= 0: the subjectAltName DNS:weft-rank-<rank>; -1: none */
    long not_before_s;       /* e.g. -60 */
    long not_after_s;        /* e.g. 30 days */
} weft_certs_spec_t;

/* A self-signed CA. 0, or -1 with the reason in @p why. */
int weft_certs_make_ca(const weft_certs_spec_t *spec, weft_certs_pem_t *out, char *why,
                       size_t n);
/* A leaf certificate signed by @p ca (EC P-256 key, for client and server use). */
int weft_certs_make_leaf(const weft_certs_pem_t *ca, const weft_certs_spec_t *spec,
                         weft_certs_pem_t *out, char *why, size_t n);
/* Writes <dir>/<stem>.pem (mode 0644) and, if @p with_key, <dir>/<stem>.key (0600), each
 * through a temporary file renamed into place (a reader never sees half a file). */
int weft_certs_write(const char *dir, const char *stem, const weft_certs_pem_t *p, bool with_key,
                     char *why, size_t n);
/* Reads a PEM certificate and key from files (an existing CA). */
int weft_certs_read(const char *cert_path, const char *key_path, weft_certs_pem_t *out, char *why,
                    size_t n);
void weft_certs_pem_free(weft_certs_pem_t *p);

#endif
