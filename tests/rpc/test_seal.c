/* Sealed records (rpc/seal.c, docs/protocol.md section 7.7): the records a direct connection
 * carries under TLS once its handshake is done. White-box, over socket pairs: frames of every
 * size and every way of reading them come back whole across epochs; a record changed in any
 * byte, replayed, reordered, sealed under another key, of a length out of range, or cut short
 * ends the stream with the reason, and nothing of it is taken for data. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../../rpc/internal.h"

static const uint8_t SECRET[32] = {1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16,
                                   17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32};

static uint8_t byte_at(uint64_t i)
{
    uint64_t x = i * 0x9E3779B97F4A7C15ull;
    return (uint8_t)(x >> 56);
}

/* ------------------------------------------------------------ every size, every read */

#define N_FRAMES 14
static const size_t FRAME_SIZES[N_FRAMES] = {1,
                                             3,
                                             100,
                                             4095,
                                             4096,
                                             65535,
                                             65536,
                                             WEFT__SEAL_MAX - 1,
                                             WEFT__SEAL_MAX,
                                             WEFT__SEAL_MAX + 1,
                                             3 * WEFT__SEAL_MAX + 17,
                                             7,
                                             200000,
                                             12};

typedef struct {
    int fd;
    uint64_t epoch_bytes;
    bool ok;
} writer_t;

/* Writes the frames, each in pieces of varied sizes, ending a record after most of them (the
 * others share their last record with the next frame). */
static void *writer_main(void *arg)
{
    writer_t *w = arg;
    weft__seal_t *s = weft__seal_new(SECRET, true, w->epoch_bytes, NULL);
    uint64_t pos = 0;
    w->ok = s != NULL;
    for (int f = 0; w->ok && f < N_FRAMES; f++) {
        size_t n = FRAME_SIZES[f];
        uint8_t *buf = malloc(n);
        for (size_t i = 0; i < n; i++) {
            buf[i] = byte_at(pos + i);
        }
        size_t off = 0, piece = 1;
        while (w->ok && off < n) {
            size_t k = n - off < piece ? n - off : piece;
            w->ok = weft__seal_write(s, w->fd, buf + off, k);
            off += k;
            piece = piece * 7 + 3;
        }
        pos += n;
        free(buf);
        if (f % 4 != 1) {
            w->ok = w->ok && weft__seal_flush(s, w->fd);
        }
    }
    w->ok = w->ok && weft__seal_flush(s, w->fd);
    weft__seal_free(s);
    shutdown(w->fd, SHUT_WR);
    return NULL;
}

/* Reads the stream back in reads of the given sizes (0: a frame at a time). */
static void round_trip(uint64_t epoch_bytes, const size_t *reads, size_t n_reads)
{
    int sv[2];
    cr_assert_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    writer_t w = {sv[0], epoch_bytes, false};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, writer_main, &w), 0);

    int lowat = 1;
    weft__seal_t *r = weft__seal_new(SECRET, false, epoch_bytes, &lowat);
    cr_assert_not_null(r);
    uint64_t total = 0;
    for (int f = 0; f < N_FRAMES; f++) {
        total += FRAME_SIZES[f];
    }
    uint8_t *buf = malloc(4 * WEFT__SEAL_MAX);
    uint64_t pos = 0;
    for (size_t i = 0; pos < total; i++) {
        size_t want = reads[i % n_reads];
        if (want == 0) {
            uint64_t edge = 0;
            for (int f = 0; f < N_FRAMES && edge <= pos; f++) {
                edge += FRAME_SIZES[f];
            }
            want = (size_t)(edge - pos);
        }
        want = want < total - pos ? want : (size_t)(total - pos);
        cr_assert(weft__seal_read(r, sv[1], buf, want), "read of %zu at %llu: %s", want,
                  (unsigned long long)pos, weft__seal_why(r));
        size_t bad = want;
        for (size_t k = 0; k < want && bad == want; k++) {
            bad = buf[k] == byte_at(pos + k) ? want : k;
        }
        cr_assert_eq(bad, want, "byte %llu differs", (unsigned long long)(pos + bad));
        pos += want;
    }
    cr_assert_not(weft__seal_pending(r), "bytes left over after the last frame");
    cr_assert_not(weft__seal_read(r, sv[1], buf, 1), "a byte after the end");
    pthread_join(th, NULL);
    cr_assert(w.ok, "the writer failed");
    free(buf);
    weft__seal_free(r);
    close(sv[0]);
    close(sv[1]);
}

Test(seal, frames_come_back_whole_read_a_frame_at_a_time)
{
    size_t reads[] = {0};
    round_trip(0, reads, 1);
}

Test(seal, frames_come_back_whole_in_reads_of_any_size)
{
    size_t reads[] = {4, 1, 4096, 13, 3 * WEFT__SEAL_MAX, 65536, 2, WEFT__SEAL_MAX + 5, 999};
    round_trip(0, reads, sizeof(reads) / sizeof(reads[0]));
}

Test(seal, frames_come_back_whole_across_many_epochs)
{
    /* An epoch of 100000 bytes: the key changes every few records, on both sides alike. */
    size_t reads[] = {0, 4, 70000, 1};
    round_trip(100000, reads, sizeof(reads) / sizeof(reads[0]));
}

/* ------------------------------------------------------------ records tampered with */

typedef struct {
    uint8_t *p;
    size_t n;
} bytes_t;

/* The records of @p n_frames frames of @p size bytes each (one record each), sealed under
 * @p secret, as they travel. */
static bytes_t sealed(const uint8_t *secret, int n_frames, size_t size, uint64_t epoch_bytes)
{
    int sv[2];
    cr_assert_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    weft__seal_t *s = weft__seal_new(secret, true, epoch_bytes, NULL);
    cr_assert_not_null(s);
    uint8_t *buf = malloc(size);
    for (int f = 0; f < n_frames; f++) {
        for (size_t i = 0; i < size; i++) {
            buf[i] = byte_at((uint64_t)f * size + i);
        }
        cr_assert(weft__seal_write(s, sv[0], buf, size) && weft__seal_flush(s, sv[0]));
    }
    free(buf);
    weft__seal_free(s);
    close(sv[0]);
    bytes_t b = {malloc((size + 20) * (size_t)n_frames + 1), 0};
    ssize_t k;
    while ((k = read(sv[1], b.p + b.n, (size + 20) * (size_t)n_frames + 1 - b.n)) > 0) {
        b.n += (size_t)k;
    }
    close(sv[1]);
    cr_assert_eq(b.n, (size + 20) * (size_t)n_frames);
    return b;
}

/* Feeds @p n bytes to a reader and reads @p frames frames of @p size bytes: how many came whole
 * before the first failure, with the reason in @p why. */
static int feed(const uint8_t *p, size_t n, int frames, size_t size, uint64_t epoch_bytes,
                char *why, size_t why_n)
{
    int sv[2];
    cr_assert_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    cr_assert_eq(write(sv[0], p, n), (ssize_t)n);
    close(sv[0]);
    int lowat = 1;
    weft__seal_t *r = weft__seal_new(SECRET, false, epoch_bytes, &lowat);
    uint8_t *buf = malloc(size);
    int whole = 0;
    why[0] = '\0';
    for (int f = 0; f < frames; f++) {
        if (!weft__seal_read(r, sv[1], buf, size)) {
            snprintf(why, why_n, "%s", weft__seal_why(r));
            break;
        }
        for (size_t i = 0; i < size; i++) {
            cr_assert_eq(buf[i], byte_at((uint64_t)f * size + i), "frame %d byte %zu", f, i);
        }
        whole++;
    }
    free(buf);
    weft__seal_free(r);
    close(sv[1]);
    return whole;
}

Test(seal, a_change_to_any_byte_of_a_record_ends_the_stream)
{
    /* Small records (read through the reader's buffer) and large ones (decrypted in place). */
    const size_t sizes[] = {40, 8192};
    for (int z = 0; z < 2; z++) {
        size_t size = sizes[z], rec = size + 20;
        bytes_t b = sealed(SECRET, 2, size, 0);
        char why[200];
        cr_assert_eq(feed(b.p, b.n, 2, size, 0, why, sizeof(why)), 2, "untouched: %s", why);
        /* Every byte of the second record: its length, its ciphertext, its tag. */
        for (size_t at = rec; at < 2 * rec; at += at < rec + 8 || at >= 2 * rec - 20 ? 1 : 97) {
            b.p[at] ^= 0x10;
            int whole = feed(b.p, b.n, 2, size, 0, why, sizeof(why));
            b.p[at] ^= 0x10;
            cr_assert_eq(whole, 1, "a change at byte %zu of a %zu-byte stream was taken", at, b.n);
            cr_assert(why[0] != '\0');
        }
        free(b.p);
    }
}

Test(seal, a_replayed_reordered_or_dropped_record_ends_the_stream)
{
    size_t size = 5000, rec = size + 20;
    bytes_t b = sealed(SECRET, 3, size, 0);
    uint8_t *p = malloc(3 * rec);
    char why[200];

    /* 0 1 1: the replay fails. */
    memcpy(p, b.p, 2 * rec);
    memcpy(p + 2 * rec, b.p + rec, rec);
    cr_assert_eq(feed(p, 3 * rec, 3, size, 0, why, sizeof(why)), 2);
    cr_assert(strstr(why, "failed its check") != NULL, "why: %s", why);
    /* 1 0 2: the first is out of its place. */
    memcpy(p, b.p + rec, rec);
    memcpy(p + rec, b.p, rec);
    memcpy(p + 2 * rec, b.p + 2 * rec, rec);
    cr_assert_eq(feed(p, 3 * rec, 3, size, 0, why, sizeof(why)), 0);
    cr_assert(strstr(why, "epoch 0, record 0") != NULL, "why: %s", why);
    /* 0 2: one dropped. */
    memcpy(p, b.p, rec);
    memcpy(p + rec, b.p + 2 * rec, rec);
    cr_assert_eq(feed(p, 2 * rec, 3, size, 0, why, sizeof(why)), 1);
    cr_assert(strstr(why, "epoch 0, record 1") != NULL, "why: %s", why);
    free(p);
    free(b.p);
}

Test(seal, a_record_of_another_key_or_epoch_ends_the_stream)
{
    size_t size = 3000, rec = size + 20;
    uint8_t other[32];
    memcpy(other, SECRET, 32);
    other[31] ^= 1;
    bytes_t b = sealed(other, 1, size, 0);
    char why[200];
    cr_assert_eq(feed(b.p, b.n, 1, size, 0, why, sizeof(why)), 0);
    cr_assert(strstr(why, "failed its check") != NULL, "why: %s", why);
    free(b.p);

    /* Epochs of 6000 bytes: records 0 and 1 in epoch 0, 2 and 3 in epoch 1. Record 0 put in
     * record 2's place (the first of epoch 1, whose number in its epoch is 0 too) fails: the
     * key changed. */
    b = sealed(SECRET, 4, size, 6000);
    cr_assert_eq(feed(b.p, b.n, 4, size, 6000, why, sizeof(why)), 4, "untouched: %s", why);
    memcpy(b.p + 2 * rec, b.p, rec);
    cr_assert_eq(feed(b.p, b.n, 4, size, 6000, why, sizeof(why)), 2);
    cr_assert(strstr(why, "epoch 1, record 0") != NULL, "why: %s", why);
    free(b.p);
}

Test(seal, lengths_out_of_range_and_a_cut_record_end_the_stream)
{
    size_t size = 100;
    bytes_t b = sealed(SECRET, 1, size, 0);
    char why[200];
    uint8_t *p = malloc(b.n + 16);

    memcpy(p, b.p, b.n);
    weft__put_u32(p, 0);
    cr_assert_eq(feed(p, b.n, 1, size, 0, why, sizeof(why)), 0);
    cr_assert(strstr(why, "a sealed record of 0 bytes") != NULL, "why: %s", why);
    weft__put_u32(p, (uint32_t)WEFT__SEAL_MAX + 1);
    cr_assert_eq(feed(p, b.n, 1, size, 0, why, sizeof(why)), 0);
    cr_assert(strstr(why, "a sealed record of 1048577 bytes") != NULL, "why: %s", why);
    /* A length larger than what follows: the stream ends before the record does. */
    weft__put_u32(p, (uint32_t)size + 8);
    cr_assert_eq(feed(p, b.n, 1, size, 0, why, sizeof(why)), 0);
    /* Cut short anywhere. */
    for (size_t cut = 0; cut < b.n; cut += 7) {
        cr_assert_eq(feed(b.p, cut, 1, size, 0, why, sizeof(why)), 0, "cut at %zu", cut);
    }
    free(p);
    free(b.p);
}

/* A writer whose send failed (the peer went) fails every later call too, large or small: a record
 * cut short is never followed by another on the same stream. */
Test(seal, a_writer_that_failed_writes_nothing_more)
{
    int sv[2];
    cr_assert_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    close(sv[1]);
    weft__seal_t *w = weft__seal_new(SECRET, true, 0, NULL);
    uint8_t *buf = calloc(1, 2 * WEFT__SEAL_MAX);
    cr_assert(weft__seal_write(w, sv[0], buf, 100), "sealing alone sends nothing");
    cr_assert_not(weft__seal_flush(w, sv[0]), "a send to a closed peer");
    cr_assert_not(weft__seal_write(w, sv[0], buf, 10));
    cr_assert_not(weft__seal_write(w, sv[0], buf, 2 * WEFT__SEAL_MAX));
    cr_assert_not(weft__seal_flush(w, sv[0]));
    free(buf);
    weft__seal_free(w);
    close(sv[0]);
}
