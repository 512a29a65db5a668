/* The sealed records of a direct connection under TLS (rpc/seal.c: weft__seal_read and its
 * readers), docs/protocol.md section 7.7: the bytes a rank reads from a direct connection once
 * its TLS handshake is done. Pure decoder: no agent; the stream goes through a socket pair.
 *
 * Input: u8 mode | u8 flip_hi | u8 flip_lo | u8 read_size_seed | the rest.
 *   mode bit 0 clear: the rest is the stream itself (lengths, ciphertext and tags as given): the
 *     reader must end it (it cannot forge a tag) without taking any of it for data;
 *   mode bit 0 set: the rest is plaintext, cut into frames at each 0xff byte and sealed by a real
 *     writer (mode bit 1: one record per frame, else records shared across frames), with an epoch
 *     of (mode >> 2) * 64 bytes (0: the protocol's); then, when mode bit 7 is set, one bit of the
 *     sealed stream at (flip_hi, flip_lo) modulo its length is flipped. The reader reads it back in
 *     reads of sizes drawn from read_size_seed: whatever a read returns must be the plaintext, and
 *     an untouched stream must come back whole. */
#include <pthread.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../../rpc/internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "fuzz_seal: %s does not hold (%s:%d)\n", #cond, __FILE__, __LINE__);   \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

static const uint8_t SECRET[32] = {7, 7, 7, 7, 1, 2, 3, 4, 7, 7, 7, 7, 5, 6, 7, 8,
                                   7, 7, 7, 7, 9, 9, 9, 9, 7, 7, 7, 7, 0, 0, 0, 1};

/* A socket's other end, read to its end on a thread of its own (a writer of many small records
 * would fill the socket's buffer long before the bytes' count does). */
typedef struct {
    int fd;
    uint8_t *p;
    size_t n;
} drain_t;

static void *drain_main(void *arg)
{
    drain_t *d = arg;
    size_t cap = 4096;
    d->p = malloc(cap);
    CHECK(d->p != NULL);
    for (;;) {
        if (d->n == cap) {
            cap *= 2;
            d->p = realloc(d->p, cap);
            CHECK(d->p != NULL);
        }
        ssize_t k = read(d->fd, d->p + d->n, cap - d->n);
        if (k <= 0) {
            break;
        }
        d->n += (size_t)k;
    }
    return NULL;
}

/* Writes a stream into a socket on a thread of its own, then closes it (a reader that gives
 * up early closes its end, and the write fails). */
typedef struct {
    int fd;
    const uint8_t *p;
    size_t n;
} feed_t;

static void *feed_main(void *arg)
{
    feed_t *f = arg;
    size_t off = 0;
    while (off < f->n) {
        ssize_t k = send(f->fd, f->p + off, f->n - off, MSG_NOSIGNAL);
        if (k <= 0) {
            break;
        }
        off += (size_t)k;
    }
    close(f->fd);
    return NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 4) {
        return 0;
    }
    uint8_t mode = data[0];
    size_t flip = ((size_t)data[1] << 8) | data[2];
    uint32_t seed = data[3] * 2654435761u + 1;
    const uint8_t *rest = data + 4;
    size_t len = size - 4;
    uint64_t epoch = (uint64_t)(mode >> 2 & 0x1f) * 64;

    uint8_t *stream = NULL;
    size_t slen = 0;
    bool sealed = (mode & 1) != 0, flipped = false;
    if (sealed) {
        int sv[2];
        CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
        drain_t d = {sv[1], NULL, 0};
        pthread_t th;
        CHECK(pthread_create(&th, NULL, drain_main, &d) == 0);
        weft__seal_t *w = weft__seal_new(SECRET, true, epoch, NULL);
        CHECK(w != NULL);
        size_t start = 0;
        for (size_t i = 0; i <= len; i++) {
            if (i == len || rest[i] == 0xff) {
                CHECK(weft__seal_write(w, sv[0], rest + start, i - start));
                if ((mode & 2) != 0) {
                    CHECK(weft__seal_flush(w, sv[0]));
                }
                start = i;
            }
        }
        CHECK(weft__seal_flush(w, sv[0]));
        weft__seal_free(w);
        close(sv[0]);
        pthread_join(th, NULL);
        close(sv[1]);
        stream = d.p;
        slen = d.n;
        if ((mode & 0x80) != 0 && slen > 0) {
            stream[flip % slen] ^= (uint8_t)(1u << (data[3] & 7));
            flipped = true;
        }
    } else {
        stream = malloc(len + 1);
        CHECK(stream != NULL);
        memcpy(stream, rest, len);
        slen = len;
    }

    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    feed_t f = {sv[0], stream, slen};
    pthread_t feeder;
    CHECK(pthread_create(&feeder, NULL, feed_main, &f) == 0);

    int lowat = 1;
    weft__seal_t *r = weft__seal_new(SECRET, false, epoch, &lowat);
    CHECK(r != NULL);
    size_t want_total = sealed ? len : 0, pos = 0;
    uint8_t *buf = malloc(len + 1);
    CHECK(buf != NULL);
    bool ok = true;
    while (ok && pos < len) {
        seed = seed * 1103515245u + 12345u;
        size_t n = (size_t)(seed >> 16) % 9000 + 1;
        n = n < len - pos ? n : len - pos;
        ok = weft__seal_read(r, sv[1], buf, n);
        if (ok) {
            /* Whatever comes out is what was sealed: never bytes of a forged or broken record. */
            CHECK(sealed);
            CHECK(memcmp(buf, rest + pos, n) == 0);
            pos += n;
        }
    }
    if (sealed && !flipped) {
        CHECK(pos == want_total);
    }
    /* A changed bit anywhere in the stream is found before the last byte is handed out. */
    CHECK(!(flipped && len > 0 && pos == len));
    free(buf);
    weft__seal_free(r);
    close(sv[1]);
    pthread_join(feeder, NULL);
    free(stream);
    return 0;
}
