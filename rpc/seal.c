/* Sealed records: how a direct connection's bytes travel once its TLS handshake is done
 * (docs/protocol.md section 7.7, docs/security.md).
 *
 * The handshake (certificates, identities, key exchange) is TLS 1.3 through OpenSSL. The records
 * after it are weft's own, as QUIC's packet protection and kernel TLS are their own: AES-128-GCM
 * under keys from the session's exporter (RFC 8446 section 7.5), so that a record can be
 * decrypted where its bytes land, in the caller's memory, instead of in OpenSSL's buffer and
 * copied out; and a record can be 1 MiB, not TLS's 16 KiB (measured: 256 KiB records gave 2.2-2.5
 * GB/s at 16 MiB, 1 MiB 2.7-3.2, 4 MiB 2.7-2.8). A direct connection carries frames one way only
 * (the connecting rank writes, the accepting rank reads), so one key serves it.
 *
 * A record: u32 little-endian L (1..WEFT__SEAL_MAX), L bytes of ciphertext, a 16-byte tag. Its
 * nonce is the epoch's IV with the record's number in the epoch (big-endian) XORed into its last
 * 8 bytes; L is authenticated by the tag (GCM covers the ciphertext's length). A record that
 * fails its tag, comes out of order or twice, or announces a length out of range ends the
 * connection. An epoch's keys come from the exporter's secret: key = HMAC-SHA256(secret,
 * "weft seal key" | epoch (u64 BE) | 0x01)[0..16), iv likewise with "weft seal iv" (HKDF-Expand's
 * first block); an epoch ends once it holds 2^24 records or 2^34 bytes, the same rule on
 * both ends, far inside AES-GCM's limits. */
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/ssl.h>

#include "internal.h"

#define SEAL_HDR      4u
#define SEAL_TAG      16u
#define SEAL_KEY      16u
#define SEAL_IV       12u
#define SEAL_SECRET   32u
#define EPOCH_RECORDS ((uint64_t)1 << 24)
#define EPOCH_BYTES   ((uint64_t)1 << 34)
#define RAW_CAP       ((size_t)16 << 10) /* ciphertext read ahead of need (small records) */
#define DIRECT_MIN    ((size_t)4 << 10)  /* reads this large decrypt in the caller's memory */
#define OUT_SMALL     ((size_t)64 << 10) /* a writer's record buffer until a frame needs more */

static const char SEAL_LABEL[] = "EXPORTER-weft-direct-seal";

struct weft__seal {
    bool writer;
    EVP_CIPHER_CTX *cx;
    uint8_t secret[SEAL_SECRET];
    uint8_t iv[SEAL_IV];
    uint64_t epoch, seq, epoch_bytes; /* the epoch, the records and bytes sealed in it */
    uint64_t epoch_limit;             /* bytes per epoch (EPOCH_BYTES, smaller in tests) */
    int *lowat;                       /* the socket's SO_RCVLOWAT, cached (the reader's) */
    bool failed;                      /* writer: a record went wrong; nothing more is written */
    /* writer: the record being sealed, at out + SEAL_HDR, used bytes of it */
    uint8_t *out;
    size_t out_cap, used;
    /* reader: ciphertext read ahead, and one record's plaintext served out */
    uint8_t *raw;
    size_t raw_off, raw_len;
    uint8_t *plain;
    size_t plain_cap, plain_off, plain_len;
    char why[160]; /* why the stream ended: a bad record (broken), or this rank's own failure */
    bool broken;   /* ... the peer's bytes were at fault */
};

/* ------------------------------------------------------------ keys */

/* The epoch's key and IV into the context (HKDF-Expand's first block of the secret). */
static bool epoch_keys(weft__seal_t *s)
{
    uint8_t msg[32], mac[EVP_MAX_MD_SIZE], key[SEAL_KEY];
    unsigned mlen = 0;
    static const char *const names[2] = {"weft seal key", "weft seal iv"};
    for (int i = 0; i < 2; i++) {
        size_t n = strlen(names[i]);
        memcpy(msg, names[i], n);
        for (int b = 0; b < 8; b++) {
            msg[n + (size_t)b] = (uint8_t)(s->epoch >> (56 - 8 * b));
        }
        msg[n + 8] = 1;
        if (HMAC(EVP_sha256(), s->secret, SEAL_SECRET, msg, n + 9, mac, &mlen) == NULL) {
            OPENSSL_cleanse(key, sizeof(key));
            OPENSSL_cleanse(mac, sizeof(mac));
            return false;
        }
        memcpy(i == 0 ? key : s->iv, mac, i == 0 ? SEAL_KEY : SEAL_IV);
    }
    bool ok = (s->writer ? EVP_EncryptInit_ex(s->cx, NULL, NULL, key, NULL)
                         : EVP_DecryptInit_ex(s->cx, NULL, NULL, key, NULL)) == 1;
    OPENSSL_cleanse(key, sizeof(key));
    OPENSSL_cleanse(mac, sizeof(mac));
    s->seq = 0;
    s->epoch_bytes = 0;
    return ok;
}

/* Starts the next record: a new epoch first when this one is spent; the record's nonce. */
static bool record_begin(weft__seal_t *s)
{
    if (s->seq >= EPOCH_RECORDS || s->epoch_bytes >= s->epoch_limit) {
        s->epoch++;
        if (!epoch_keys(s)) {
            return false;
        }
    }
    uint8_t nonce[SEAL_IV];
    memcpy(nonce, s->iv, SEAL_IV);
    for (int b = 0; b < 8; b++) {
        nonce[4 + b] ^= (uint8_t)(s->seq >> (56 - 8 * b));
    }
    return (s->writer ? EVP_EncryptInit_ex(s->cx, NULL, NULL, NULL, nonce)
                      : EVP_DecryptInit_ex(s->cx, NULL, NULL, NULL, nonce)) == 1;
}

weft__seal_t *weft__seal_new(const uint8_t secret[32], bool writer, uint64_t epoch_bytes,
                             int *lowat)
{
    weft__seal_t *s = weft_calloc(1, sizeof(*s));
    if (s == NULL) {
        return NULL;
    }
    s->writer = writer;
    s->lowat = lowat;
    s->epoch_limit = epoch_bytes > 0 ? epoch_bytes : EPOCH_BYTES;
    memcpy(s->secret, secret, SEAL_SECRET);
    s->cx = EVP_CIPHER_CTX_new();
    bool ok = s->cx != NULL &&
              (writer ? EVP_EncryptInit_ex(s->cx, EVP_aes_128_gcm(), NULL, NULL, NULL)
                      : EVP_DecryptInit_ex(s->cx, EVP_aes_128_gcm(), NULL, NULL, NULL)) == 1 &&
              epoch_keys(s);
    if (!ok) {
        weft__seal_free(s);
        return NULL;
    }
    return s;
}

weft__seal_t *weft__seal_of_tls(void *ssl_p, bool writer, int *lowat, char *why, size_t n)
{
    SSL *ssl = ssl_p;
    uint8_t secret[SEAL_SECRET];
    if (SSL_version(ssl) != TLS1_3_VERSION) {
        /* The exporter's keys are sound with TLS 1.3 alone (1.2's need the extended master
         * secret); weft's own peers always speak 1.3. */
        snprintf(why, n, "the direct connection's TLS session is %s, not TLS 1.3",
                 SSL_get_version(ssl));
        return NULL;
    }
    if (SSL_has_pending(ssl)) {
        /* The peer wrote before the handshake's answer let it: those bytes are TLS's. */
        snprintf(why, n, "the peer sent records before the handshake ended");
        return NULL;
    }
    if (SSL_export_keying_material(ssl, secret, sizeof(secret), SEAL_LABEL, sizeof(SEAL_LABEL) - 1,
                                   NULL, 0, 0) != 1) {
        snprintf(why, n, "the TLS session gives no keying material");
        return NULL;
    }
    /* WEFT_SEAL_EPOCH_BYTES: tests make epochs end soon (every rank must agree). */
    uint64_t epoch = (uint64_t)weft__cfg_int(WEFT__CFG_SEAL_EPOCH_BYTES);
    weft__seal_t *s = weft__seal_new(secret, writer, epoch, lowat);
    OPENSSL_cleanse(secret, sizeof(secret));
    if (s == NULL) {
        snprintf(why, n, "no memory for the connection's keys");
    }
    return s;
}

void weft__seal_free(weft__seal_t *s)
{
    if (s == NULL) {
        return;
    }
    EVP_CIPHER_CTX_free(s->cx);
    OPENSSL_cleanse(s->secret, sizeof(s->secret));
    OPENSSL_cleanse(s->iv, sizeof(s->iv));
    weft_free(s->out);
    weft_free(s->raw);
    weft_free(s->plain);
    weft_free(s);
}

bool weft__seal_failed(const weft__seal_t *s)
{
    return s->why[0] != '\0';
}

bool weft__seal_broken(const weft__seal_t *s)
{
    return s->broken;
}

const char *weft__seal_why(const weft__seal_t *s)
{
    return s->why[0] != '\0' ? s->why : "the connection ended";
}

/* ------------------------------------------------------------ writing */

/* Ends the record being sealed and sends it. A failure leaves the writer failed: a record
 * half sent (or half sealed) cannot be followed by another. */
static bool record_send(weft__seal_t *s, int fd)
{
    if (s->used == 0) {
        return true;
    }
    int k = 0;
    uint8_t *tag = s->out + SEAL_HDR + s->used;
    bool ok = EVP_EncryptFinal_ex(s->cx, tag, &k) == 1 &&
              EVP_CIPHER_CTX_ctrl(s->cx, EVP_CTRL_GCM_GET_TAG, SEAL_TAG, tag) == 1;
    weft__put_u32(s->out, (uint32_t)s->used);
    size_t n = SEAL_HDR + s->used + SEAL_TAG;
    s->seq++; /* the nonce is spent whatever happens next */
    s->epoch_bytes += s->used;
    s->used = 0;
    ok = ok && weft__send_all(fd, s->out, n);
    s->failed = !ok;
    return ok;
}

bool weft__seal_flush(weft__seal_t *s, int fd)
{
    if (s->failed) {
        return false;
    }
    bool ok = record_send(s, fd);
    if (s->out_cap > OUT_SMALL) {
        /* A large frame's megabyte is not kept while the connection idles (one per peer). */
        weft_free(s->out);
        s->out = NULL;
        s->out_cap = 0;
    }
    return ok;
}

bool weft__seal_write(weft__seal_t *s, int fd, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    if (s->failed) {
        return false;
    }
    while (n > 0) {
        if (s->used == 0 && !record_begin(s)) {
            s->failed = true;
            return false;
        }
        if (s->used + n > s->out_cap && s->out_cap < WEFT__SEAL_MAX) {
            /* Small frames only need a small record; a large one grows it for the frame. Without
             * the memory, records stay as large as the buffer is. */
            size_t cap = s->used + n <= OUT_SMALL ? OUT_SMALL : WEFT__SEAL_MAX;
            uint8_t *q = weft_realloc(s->out, SEAL_HDR + cap + SEAL_TAG);
            if (q != NULL) {
                s->out = q;
                s->out_cap = cap;
            } else if (s->out_cap == 0) {
                s->failed = true;
                return false;
            }
        }
        size_t k = s->out_cap - s->used;
        k = n < k ? n : k;
        int outl = 0;
        /* Encrypted from where the bytes are into the record: no copy of them before. */
        if (k > 0 &&
            (EVP_EncryptUpdate(s->cx, s->out + SEAL_HDR + s->used, &outl, p, (int)k) != 1 ||
             (size_t)outl != k)) {
            s->failed = true;
            return false;
        }
        s->used += k;
        p += k;
        n -= k;
        if (s->used == s->out_cap && n > 0 && !record_send(s, fd)) {
            return false;
        }
    }
    return true;
}

/* ------------------------------------------------------------ reading */

/* At least @p need bytes of ciphertext read ahead; up to RAW_CAP when @p ahead (what is there
 * is taken, a small record's bytes in one call), else exactly what is needed. */
static bool raw_fill(weft__seal_t *s, int fd, size_t need, bool ahead)
{
    if (s->raw_len - s->raw_off >= need) {
        return true;
    }
    if (s->raw == NULL) {
        s->raw = weft_alloc(RAW_CAP);
        if (s->raw == NULL) {
            return false;
        }
    }
    if (s->raw_off > 0) {
        memmove(s->raw, s->raw + s->raw_off, s->raw_len - s->raw_off);
        s->raw_len -= s->raw_off;
        s->raw_off = 0;
    }
    if (!ahead) {
        if (!weft__recv_exact(fd, s->raw + s->raw_len, need - s->raw_len, s->lowat)) {
            return false;
        }
        s->raw_len = need;
        return true;
    }
    weft__set_lowat(fd, s->lowat, 1);
    while (s->raw_len < need) {
        ssize_t k = recv(fd, s->raw + s->raw_len, RAW_CAP - s->raw_len, 0);
        if (k < 0 && errno == EINTR) {
            continue;
        }
        if (k <= 0) {
            return false;
        }
        s->raw_len += (size_t)k;
    }
    return true;
}

/* @p n bytes of the stream into @p p: those read ahead first, the rest straight from the
 * socket. */
static bool take(weft__seal_t *s, int fd, uint8_t *p, size_t n)
{
    size_t have = s->raw_len - s->raw_off;
    size_t k = have < n ? have : n;
    memcpy(p, s->raw + s->raw_off, k);
    s->raw_off += k;
    return weft__recv_exact(fd, p + k, n - k, s->lowat);
}

/* Reads the next record's ciphertext and tag into @p dst (at least its length, which the caller
 * checked) and decrypts it there. @p more: the caller needs bytes after this record, so the next
 * record's header is certain to come. */
static bool record_read(weft__seal_t *s, int fd, uint8_t *dst, size_t len, bool more)
{
    uint8_t tag[SEAL_TAG];
    int outl = 0;
    s->raw_off += SEAL_HDR;
    if (!record_begin(s) || !take(s, fd, dst, len)) {
        return false;
    }
    /* The tag, and the next record's header when it is certain to come; more read ahead only
     * when no large read follows (its bytes would be copied out of the read-ahead). */
    if (!raw_fill(s, fd, SEAL_TAG + (more ? SEAL_HDR : 0), !more)) {
        return false;
    }
    memcpy(tag, s->raw + s->raw_off, SEAL_TAG);
    s->raw_off += SEAL_TAG;
    if (EVP_DecryptUpdate(s->cx, dst, &outl, dst, (int)len) != 1 || (size_t)outl != len ||
        EVP_CIPHER_CTX_ctrl(s->cx, EVP_CTRL_GCM_SET_TAG, SEAL_TAG, tag) != 1 ||
        EVP_DecryptFinal_ex(s->cx, dst + len, &outl) != 1) {
        OPENSSL_cleanse(dst, len); /* nothing of a forged record stays, even unused */
        s->broken = true;
        snprintf(s->why, sizeof(s->why),
                 "a sealed record (epoch %llu, record %llu, %zu bytes) failed its check",
                 (unsigned long long)s->epoch, (unsigned long long)s->seq, len);
        return false;
    }
    s->seq++;
    s->epoch_bytes += len;
    return true;
}

bool weft__seal_read(weft__seal_t *s, int fd, void *buf, size_t n)
{
    uint8_t *p = buf;
    while (n > 0) {
        if (s->plain_off < s->plain_len) {
            size_t k = s->plain_len - s->plain_off;
            k = k < n ? k : n;
            memcpy(p, s->plain + s->plain_off, k);
            s->plain_off += k;
            p += k;
            n -= k;
            if (s->plain_off == s->plain_len && s->plain_cap > OUT_SMALL) {
                /* A large record's buffer is not kept while the connection idles. */
                weft_free(s->plain);
                s->plain = NULL;
                s->plain_cap = s->plain_off = s->plain_len = 0;
            }
            continue;
        }
        if (!raw_fill(s, fd, SEAL_HDR, n < WEFT__LOWAT_MIN)) {
            return false;
        }
        size_t len = weft__get_u32(s->raw + s->raw_off);
        if (len == 0 || len > WEFT__SEAL_MAX) {
            s->broken = true;
            snprintf(s->why, sizeof(s->why), "a sealed record of %zu bytes (1 to %u)", len,
                     (unsigned)WEFT__SEAL_MAX);
            return false;
        }
        if (len <= n && n >= DIRECT_MIN) {
            /* Decrypted where it lands. */
            if (!record_read(s, fd, p, len, n > len)) {
                return false;
            }
            p += len;
            n -= len;
            continue;
        }
        if (s->plain_cap < len) {
            size_t cap = len < 4096 ? 4096 : len;
            uint8_t *q = weft_realloc(s->plain, cap);
            if (q == NULL) {
                snprintf(s->why, sizeof(s->why), "no memory for a %zu-byte record", len);
                return false;
            }
            s->plain = q;
            s->plain_cap = cap;
        }
        s->plain_off = s->plain_len = 0;
        if (!record_read(s, fd, s->plain, len, len < n)) {
            return false;
        }
        s->plain_len = len;
    }
    return true;
}

bool weft__seal_pending(const weft__seal_t *s)
{
    return s->plain_off < s->plain_len || s->raw_off < s->raw_len;
}
