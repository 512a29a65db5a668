/* Identities and the Hello. Each agent makes an Ed25519 key pair when it is created; its public
 * key travels in its Join Hello and, through rank 0, in the world map. A connection (a stream or a
 * direct connection) claims a rank in its Hello and proves it by signing the server's random
 * challenge with that rank's key; the server checks the signature with the key the world map
 * holds for the rank. The job's token admits a process to the rendezvous; the key binds each
 * connection to one rank, so that holding the token is not enough to speak for another rank
 * (docs/protocol.md section 3). Every Hello, of a Join, a stream or a direct connection, is checked
 * by weft__hello_check. */
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>

#include "internal.h"

#define TRANSCRIPT_TAG "weft connect v2" /* 15 bytes, then the fields below */

weft_status_t weft__identity_create(weft_agent_t *a)
{
    EVP_PKEY *key = NULL;
    EVP_PKEY_CTX *ctx = EVP_PKEY_CTX_new_id(EVP_PKEY_ED25519, NULL);
    size_t len = WEFT__ID_KEY_BYTES;

    if (ctx == NULL || EVP_PKEY_keygen_init(ctx) <= 0 || EVP_PKEY_keygen(ctx, &key) <= 0 ||
        EVP_PKEY_get_raw_public_key(key, a->id_pub, &len) <= 0 || len != WEFT__ID_KEY_BYTES) {
        EVP_PKEY_CTX_free(ctx);
        EVP_PKEY_free(key);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "agent: cannot make an identity key (OpenSSL)");
    }
    EVP_PKEY_CTX_free(ctx);
    a->id_key = key;
    return WEFT_OK;
}

void weft__identity_free(weft_agent_t *a)
{
    EVP_PKEY_free(a->id_key);
    a->id_key = NULL;
}

void weft__hello_fill(weft_agent_t *a, Weft__V1__Hello *h)
{
    h->protocol_version = WEFT_PROTOCOL_VERSION;
    h->name = a->name;
    h->rank = a->rank;
    h->address = a->address;
    h->world_size = a->world_size;
    h->auth_token.data = (uint8_t *)a->auth_token;
    h->auth_token.len = strlen(a->auth_token);
    h->max_message_bytes = a->max_message_bytes;
    h->direct_address = (char *)weft__direct_address(a);
    h->shm_address = (char *)weft__shm_address(a);
    h->identity_key.data = a->id_pub;
    h->identity_key.len = WEFT__ID_KEY_BYTES;
}

/* The signed bytes: tag, transport, challenge, client rank, server rank, world size. */
static size_t transcript(uint8_t *buf, char tp, const uint8_t *challenge, int client, int server,
                         int world)
{
    size_t n = sizeof(TRANSCRIPT_TAG) - 1;
    memcpy(buf, TRANSCRIPT_TAG, n);
    buf[n++] = (uint8_t)tp;
    memcpy(buf + n, challenge, WEFT__CHALLENGE_BYTES);
    n += WEFT__CHALLENGE_BYTES;
    weft__put_u32(buf + n, (uint32_t)client);
    weft__put_u32(buf + n + 4, (uint32_t)server);
    weft__put_u32(buf + n + 8, (uint32_t)world);
    return n + 12;
}

weft_status_t weft__hello_sign(weft_agent_t *a, char tp, const uint8_t *challenge, int server_rank,
                               uint8_t sig[WEFT__ID_SIG_BYTES])
{
    uint8_t msg[64 + WEFT__CHALLENGE_BYTES];
    size_t n = transcript(msg, tp, challenge, a->rank, server_rank, a->world_size);
    size_t siglen = WEFT__ID_SIG_BYTES;
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    bool ok = md != NULL && EVP_DigestSignInit(md, NULL, NULL, NULL, a->id_key) > 0 &&
              EVP_DigestSign(md, sig, &siglen, msg, n) > 0 && siglen == WEFT__ID_SIG_BYTES;
    EVP_MD_CTX_free(md);
    if (!ok) {
        return weft__set_error(WEFT_ERR_AUTH, "rpc: could not sign the connection's challenge");
    }
    return WEFT_OK;
}

static bool verify(const uint8_t *pub, const uint8_t *msg, size_t n, const uint8_t *sig,
                   size_t siglen)
{
    if (siglen != WEFT__ID_SIG_BYTES) {
        return false;
    }
    EVP_PKEY *key = EVP_PKEY_new_raw_public_key(EVP_PKEY_ED25519, NULL, pub, WEFT__ID_KEY_BYTES);
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    bool ok = key != NULL && md != NULL && EVP_DigestVerifyInit(md, NULL, NULL, NULL, key) > 0 &&
              EVP_DigestVerify(md, sig, siglen, msg, n) == 1;
    EVP_MD_CTX_free(md);
    EVP_PKEY_free(key);
    return ok;
}

bool weft__secret_equal(const void *x, size_t xlen, const void *y, size_t ylen)
{
    /* The time depends on the lengths only, never on where the bytes differ. */
    const uint8_t *p = x, *q = y;
    size_t n = xlen > ylen ? xlen : ylen;
    uint8_t diff = (uint8_t)(xlen != ylen);
    for (size_t i = 0; i < n; i++) {
        uint8_t b1 = i < xlen ? p[i] : 0;
        uint8_t b2 = i < ylen ? q[i] : 0;
        diff |= (uint8_t)(b1 ^ b2);
    }
    return diff == 0;
}

weft_status_t weft__random_bytes(uint8_t *buf, size_t n)
{
    if (RAND_bytes(buf, (int)n) != 1) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rpc: no random bytes (OpenSSL)");
    }
    return WEFT_OK;
}

weft_status_t weft__hello_check(weft_agent_t *a, const Weft__V1__Hello *h, weft__hello_kind_t kind,
                                const uint8_t *challenge, int64_t deadline_ns,
                                const weft__tls_id_t *tls, char *why, size_t n)
{
    if (h == NULL) {
        snprintf(why, n, "the first message is not a Hello");
        return WEFT_ERR_PROTOCOL;
    }
    if (h->protocol_version != WEFT_PROTOCOL_VERSION) {
        snprintf(why, n, "rank %d speaks protocol version %u; %s speaks version %d", h->rank,
                 h->protocol_version, a->name, WEFT_PROTOCOL_VERSION);
        return WEFT_ERR_VERSION;
    }
    if (a->auth_token[0] != '\0' && !weft__secret_equal(h->auth_token.data, h->auth_token.len,
                                                        a->auth_token, strlen(a->auth_token))) {
        snprintf(why, n, "rank %d presented the wrong authentication token", h->rank);
        return WEFT_ERR_AUTH;
    }
    if (h->world_size != a->world_size) {
        snprintf(why, n, "rank %d expects a world of %d, %s is in one of %d", h->rank,
                 h->world_size, a->name, a->world_size);
        return WEFT_ERR_MISMATCH;
    }
    int lo = kind == WEFT__HELLO_JOIN ? 1 : 0;
    if (h->rank < lo || h->rank >= a->world_size) {
        snprintf(why, n, "rank %d is out of range %d..%d", h->rank, lo, a->world_size - 1);
        return WEFT_ERR_INVALID_ARG;
    }
    if (kind == WEFT__HELLO_JOIN) {
        if (h->name == NULL || h->name[0] == '\0' || strlen(h->name) > WEFT__MAX_NAME ||
            h->address == NULL || h->address[0] == '\0') {
            snprintf(why, n, "rank %d sent no name or no address", h->rank);
            return WEFT_ERR_PROTOCOL;
        }
        weft_status_t st = weft__tls_check_id(a, tls, h->rank, h->name, why, n);
        if (st != WEFT_OK) {
            return st;
        }
        if (h->identity_key.len != WEFT__ID_KEY_BYTES) {
            snprintf(why, n,
                     "rank %d sent an identity key of %zu bytes (an Ed25519 public key "
                     "has %d)",
                     h->rank, h->identity_key.len, WEFT__ID_KEY_BYTES);
            return WEFT_ERR_PROTOCOL;
        }
        return WEFT_OK;
    }
    /* A connection: its rank is proven with the key the world map holds for it. */
    if (weft__agent_wait_joined_until(a, deadline_ns) != WEFT_OK) {
        snprintf(why, n, "%s has not joined a world: %s", a->name, weft_last_error());
        return WEFT_ERR_INVALID_STATE;
    }
    weft__peer_t *p = &a->peers[h->rank];
    /* A shared-memory connection has no certificate: the key (which the join's TLS vouched for)
     * proves the rank. */
    weft_status_t st =
        kind == WEFT__HELLO_SHM ? WEFT_OK : weft__tls_check_id(a, tls, h->rank, p->name, why, n);
    if (st != WEFT_OK) {
        return st;
    }
    uint8_t msg[64 + WEFT__CHALLENGE_BYTES];
    char tp = kind == WEFT__HELLO_STREAM ? 'S' : kind == WEFT__HELLO_SHM ? 'M' : 'D';
    size_t len = transcript(msg, tp, challenge, h->rank,
                            a->rank, a->world_size);
    if (!p->has_key || !verify(p->identity_key, msg, len, h->proof.data, h->proof.len)) {
        snprintf(why, n,
                 "the connection claiming rank %d did not prove it (its proof does not "
                 "verify with that rank's key)",
                 h->rank);
        return WEFT_ERR_AUTH;
    }
    return WEFT_OK;
}
