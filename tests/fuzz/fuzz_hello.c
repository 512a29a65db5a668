/* The Hello and its one check (rpc/hello.c: weft__hello_check), docs/protocol.md sections 3, 7.1,
 * 7.2 and 7.7: the bytes of a Hello as a Join, a stream's HELLO or a direct connection's handshake
 * carries them, unpacked and checked against a joined rank 0 of a world of 3 with a token. Its
 * world map holds keys made from fixed seeds, so that the committed seeds carry proofs that verify
 * (over a challenge of zeros) and the fuzzer mutates from accepted Hellos. Pure decoder: the
 * agent is a struct, nothing runs.
 *
 * Input: u8 kind (mod 3: Join, stream, direct) | the Hello's bytes. */
#include <openssl/evp.h>
#include <stdlib.h>

#include "../../rpc/internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define WORLD 3

static weft_agent_t agent;
static weft__peer_t peers[WORLD];
static const uint8_t challenge[WEFT__CHALLENGE_BYTES];

/* The key of rank @p r: the Ed25519 key whose 32-byte seed is r repeated (fuzz_seeds.c signs with
 * the same). */
static EVP_PKEY *rank_key(int r)
{
    uint8_t seed[32];
    memset(seed, r + 1, sizeof(seed));
    return EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, NULL, seed, sizeof(seed));
}

static void setup(void)
{
    agent.rank = 0;
    agent.world_size = WORLD;
    agent.name = "fuzz0";
    agent.auth_token = "fuzz-token";
    atomic_store(&agent.state, WEFT__AGENT_JOINED);
    agent.peers = peers;
    for (int r = 0; r < WORLD; r++) {
        EVP_PKEY *k = rank_key(r);
        size_t n = WEFT__ID_KEY_BYTES;
        if (k == NULL || EVP_PKEY_get_raw_public_key(k, peers[r].identity_key, &n) <= 0) {
            abort();
        }
        peers[r].rank = r;
        peers[r].name = r == 0 ? "fuzz0" : r == 1 ? "worker1" : "worker2";
        peers[r].has_key = true;
        EVP_PKEY_free(k);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static bool ready;
    char why[512];

    if (!ready) {
        setup();
        ready = true;
    }
    if (size < 1) {
        return 0;
    }
    weft__hello_kind_t kind = (weft__hello_kind_t)(data[0] % 3);
    Weft__V1__Hello *h = weft__v1__hello__unpack(&weft__pb_allocator, size - 1, data + 1);
    weft__tls_id_t tls = {.tls = false, .rank = -1}; /* a plaintext connection */
    weft_status_t st = weft__hello_check(&agent, h, kind, challenge, weft__now_ns() + 1000000000,
                                         &tls, why, sizeof(why));
    if (st == WEFT_OK) {
        /* Accepted: what the callers rely on. */
        if (h == NULL || h->protocol_version != WEFT_PROTOCOL_VERSION || h->world_size != WORLD ||
            h->rank < (kind == WEFT__HELLO_JOIN ? 1 : 0) || h->rank >= WORLD ||
            (kind == WEFT__HELLO_JOIN &&
             (h->name == NULL || h->name[0] == '\0' || strlen(h->name) > WEFT__MAX_NAME ||
              h->identity_key.len != WEFT__ID_KEY_BYTES))) {
            fprintf(stderr, "fuzz_hello: accepted a Hello that breaks a rule\n");
            abort();
        }
    } else if (why[0] == '\0') {
        fprintf(stderr, "fuzz_hello: a refusal (%d) without a reason\n", (int)st);
        abort();
    }
    if (h != NULL) {
        weft__v1__hello__free_unpacked(h, &weft__pb_allocator);
    }
    return 0;
}
