/* The direct connection's acceptor (rpc/direct.c: handshake_in, read_frame and the readers behind
 * it), docs/protocol.md section 7.7: a plain TCP connection to rank 0's direct listener, which
 * sends its challenge first. Then either the input is the handshake itself (magic, version, Hello
 * length, Hello), or a proper handshake proving rank 2 comes first and the input is the frames
 * that follow. The harness half-closes and waits until the target has closed the connection.
 * Live: the world of fuzz.h.
 *
 * Input: u8 mode (even: handshake bytes; odd: frames after an accepted handshake) | the bytes. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../../rpc/internal.h"
#include "../common/rawpeer.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Why the target would not talk: whether it holds rank 2 lost (white-box, rpc/internal.h). */
static void explain(void)
{
    weft__peer_t *p = &fuzz_world()->target->peers[2];
    pthread_mutex_lock(&p->mu);
    fprintf(stderr, "fuzz_direct: the target holds rank 2 %s%s\n", p->lost ? "lost: " : "alive",
            p->lost && p->lost_why != NULL ? p->lost_why : "");
    pthread_mutex_unlock(&p->mu);
}

/* Connects to the listener and reads its challenge (magic, version, 32 bytes); the socket. A
 * connection the target drops before its challenge is a finding. Thousands of connections a second
 * from one port range may run out of local ports (TIME_WAIT): such a connect is tried again. */
static int direct_open(const char *address, uint8_t challenge[32])
{
    char host[64];
    const char *colon = strrchr(address, ':');
    struct sockaddr_in sa;
    uint8_t hdr[40];
    size_t got = 0;
    int fd = -1;

    if (colon == NULL || (size_t)(colon - address) >= sizeof(host)) {
        abort();
    }
    memcpy(host, address, (size_t)(colon - address));
    host[colon - address] = '\0';
    memset(&sa, 0, sizeof(sa));
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)atoi(colon + 1));
    inet_pton(AF_INET, host, &sa.sin_addr);
    for (int tries = 0;; tries++) {
        fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0) {
            break;
        }
        int err = errno;
        if (fd >= 0) {
            close(fd);
        }
        if ((err != EADDRNOTAVAIL && err != EINTR) || tries == FUZZ_WAIT_MS) {
            fprintf(stderr, "fuzz_direct: cannot connect to %s: %s\n", address, strerror(err));
            explain();
            abort();
        }
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (got < sizeof(hdr)) {
        /* libFuzzer's -timeout timer interrupts system calls with SIGALRM: an interrupted wait
         * or read goes on (until the deadline), it is not the target's doing (F3,
         * docs/fuzzing.md) */
        clock_gettime(CLOCK_MONOTONIC, &now);
        long left = FUZZ_WAIT_MS - ((now.tv_sec - t0.tv_sec) * 1000 +
                                    (now.tv_nsec - t0.tv_nsec) / 1000000);
        struct pollfd pfd = {fd, POLLIN, 0};
        ssize_t k = -1;
        errno = ETIMEDOUT;
        int r = left > 0 ? poll(&pfd, 1, (int)left) : 0;
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r == 1) {
            k = recv(fd, hdr + got, sizeof(hdr) - got, 0);
            if (k < 0 && errno == EINTR) {
                continue;
            }
        }
        if (k <= 0) {
            fprintf(stderr, "fuzz_direct: %s took the connection but sent no challenge (%s)\n",
                    address, k == 0 ? "closed" : strerror(errno));
            explain();
            abort();
        }
        got += (size_t)k;
    }
    memcpy(challenge, hdr + 8, 32);
    return fd;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const fuzz_world_t *w = fuzz_world();
    const char *addr = weft_agent_worker_direct_address(w->target, 0);
    uint8_t challenge[32];
    char why[512];

    if (size < 1) {
        return 0;
    }
    int fd = direct_open(addr, challenge);
    if ((data[0] & 1) != 0) {
        int st = rawpeer_direct_hello(fd, challenge, 0, 2, 3, "", w->raw, why, sizeof(why));
        if (st != 0) {
            fprintf(stderr, "fuzz_direct: the target refused the handshake: %d %s\n", st, why);
            explain();
            abort();
        }
    }
    /* The target may close before it has read everything (a refusal): a failed write is fine. */
    (void)rawpeer_write(fd, data + 1, size - 1);
    shutdown(fd, SHUT_WR);
    if (!rawpeer_closed_within(fd, FUZZ_WAIT_MS)) {
        fprintf(stderr, "fuzz_direct: the target kept the connection open after its end\n");
        explain();
        abort();
    }
    close(fd);
    return 0;
}
