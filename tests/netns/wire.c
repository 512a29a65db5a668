/*
 * The cable between two network namespaces, in user space: a delay, a loss rate and a
 * partition switch, for tests/netns where the kernel has no netem (sch_netem).
 *
 *   netns_wire NETNS_A IF_A NETNS_B IF_B DELAY_MS LOSS_PERCENT SEED [MODE]
 *
 * Makes a TUN device IF_A in the network namespace NETNS_A (a path: /run/netns/NAME) and IF_B
 * in NETNS_B, then carries every IP packet one's stack sends out of its device into the other's:
 * each held DELAY_MS (a constant delay keeps their order), a share LOSS_PERCENT of them dropped
 * (a seeded xorshift, the same choices for the same packets). The namespaces' stacks see a
 * point-to-point link: the caller gives the devices their addresses and brings them up.
 * MODE "spare-handshakes": the loss spares TCP's SYN and SYN-ACK packets (it hits the
 * connections' data and acknowledgements only). MODE "first-syn": no random loss; instead the
 * first SYN sent to each address and port is dropped, once (TCP or the client sends it again).
 *
 * Prints "ready" once both devices exist. SIGUSR1 cuts the wire (every packet dropped, both
 * ways: a partition, silent as a pulled cable), SIGUSR2 mends it. SIGTERM or SIGINT end it: it
 * prints one line per direction, "a->b forwarded N dropped M", and exits 0; the devices go with
 * it. It also ends when its parent dies (PR_SET_PDEATHSIG), so it never outlives the test.
 * Exits 77 when the devices cannot be made (why on stderr), 1 on other errors.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <linux/if.h>
#include <linux/if_tun.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>

#define SLOTS     8192 /* packets held per direction: a router's queue; more are dropped */
#define SLOT_SIZE 2048 /* the devices' MTU is 1500 */

typedef struct {
    int64_t due_ns;
    uint32_t len;
    uint8_t data[SLOT_SIZE];
} slot_t;

/* One direction: packets read from @p from, written to @p to after the delay. */
typedef struct {
    int from, to;
    slot_t *q;
    size_t head, count;
    uint64_t forwarded, dropped;
} dir_t;

static volatile sig_atomic_t cut, stop;

static enum { ALL, SPARE_HANDSHAKES, FIRST_SYN } mode;

/* The destinations (IPv4 address and TCP port) whose first SYN was dropped (FIRST_SYN). */
#define SEEN_MAX 4096
static uint64_t seen[SEEN_MAX];
static size_t nseen;

static void on_signal(int sig)
{
    if (sig == SIGUSR1) {
        cut = 1;
    } else if (sig == SIGUSR2) {
        cut = 0;
    } else {
        stop = 1;
    }
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static uint64_t rng_state;
static uint32_t loss_threshold; /* a packet is lost when the next number is below it */

static uint32_t rng_next(void)
{
    uint64_t x = rng_state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    rng_state = x;
    return (uint32_t)((x * 0x2545F4914F6CDD1Dull) >> 32);
}

/* A TUN device named @p name in the network namespace at @p ns_path; -1 (why on stderr). */
static int tun_in(const char *ns_path, const char *name, int home)
{
    int ns = open(ns_path, O_RDONLY | O_CLOEXEC);
    if (ns < 0) {
        fprintf(stderr, "netns_wire: open %s: %s\n", ns_path, strerror(errno));
        return -1;
    }
    if (setns(ns, CLONE_NEWNET) != 0) {
        fprintf(stderr, "netns_wire: setns %s: %s\n", ns_path, strerror(errno));
        close(ns);
        return -1;
    }
    close(ns);
    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        fprintf(stderr, "netns_wire: open /dev/net/tun: %s\n", strerror(errno));
    } else {
        struct ifreq ifr;
        memset(&ifr, 0, sizeof(ifr));
        ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
        snprintf(ifr.ifr_name, sizeof(ifr.ifr_name), "%s", name);
        if (ioctl(fd, TUNSETIFF, &ifr) != 0) {
            fprintf(stderr, "netns_wire: TUNSETIFF %s: %s\n", name, strerror(errno));
            close(fd);
            fd = -1;
        }
    }
    if (setns(home, CLONE_NEWNET) != 0) {
        fprintf(stderr, "netns_wire: setns back: %s\n", strerror(errno));
        exit(1);
    }
    return fd;
}

/* Whether the IPv4 packet @p p is a TCP SYN (or SYN-ACK); its destination to @p dst_p. */
static bool tcp_syn(const uint8_t *p, size_t n, uint64_t *dst_p)
{
    if (n < 20 || (p[0] >> 4) != 4 || p[9] != 6 /* TCP */) {
        return false;
    }
    size_t ihl = (size_t)(p[0] & 15) * 4;
    if (n < ihl + 14 || (p[ihl + 13] & 0x02) == 0) {
        return false;
    }
    *dst_p = (uint64_t)p[16] << 40 | (uint64_t)p[17] << 32 | (uint64_t)p[18] << 24 |
             (uint64_t)p[19] << 16 | (uint64_t)p[ihl + 2] << 8 | p[ihl + 3];
    return true;
}

/* Whether the packet @p p goes (not the partition: the loss). */
static bool lost(const uint8_t *p, size_t n)
{
    uint64_t dst;
    bool syn = tcp_syn(p, n, &dst);

    if (mode == FIRST_SYN) {
        if (!syn || (p[(p[0] & 15) * 4 + 13] & 0x10) != 0 /* a SYN-ACK */) {
            return false;
        }
        for (size_t i = 0; i < nseen; i++) {
            if (seen[i] == dst) {
                return false;
            }
        }
        if (nseen < SEEN_MAX) {
            seen[nseen++] = dst;
        }
        return true;
    }
    return rng_next() < loss_threshold && !(mode == SPARE_HANDSHAKES && syn);
}

/* Reads what @p d's source device has, queueing or dropping each packet. */
static void take(dir_t *d, int64_t delay_ns)
{
    for (;;) {
        slot_t *s = &d->q[(d->head + d->count) % SLOTS];
        uint8_t scratch[SLOT_SIZE];
        bool full = d->count == SLOTS;
        ssize_t n = read(d->from, full ? scratch : s->data, SLOT_SIZE);
        if (n <= 0) {
            return; /* EAGAIN: nothing more now */
        }
        if (full || cut || lost(full ? scratch : s->data, (size_t)n)) {
            d->dropped++;
            continue;
        }
        s->len = (uint32_t)n;
        s->due_ns = now_ns() + delay_ns;
        d->count++;
    }
}

/* Writes @p d's packets whose time has come; returns the time until the next one's (ns), or -1. */
static int64_t give(dir_t *d)
{
    int64_t now = now_ns();
    while (d->count > 0) {
        slot_t *s = &d->q[d->head];
        if (s->due_ns > now) {
            return s->due_ns - now;
        }
        if (cut || write(d->to, s->data, s->len) != (ssize_t)s->len) {
            d->dropped++;
        } else {
            d->forwarded++;
        }
        d->head = (d->head + 1) % SLOTS;
        d->count--;
    }
    return -1;
}

int main(int argc, char **argv)
{
    if (argc != 8 && argc != 9) {
        fprintf(stderr, "usage: netns_wire NETNS_A IF_A NETNS_B IF_B DELAY_MS LOSS_PERCENT SEED "
                        "[spare-handshakes|first-syn]\n");
        return 1;
    }
    if (argc == 9) {
        if (strcmp(argv[8], "spare-handshakes") == 0) {
            mode = SPARE_HANDSHAKES;
        } else if (strcmp(argv[8], "first-syn") == 0) {
            mode = FIRST_SYN;
        } else {
            fprintf(stderr, "netns_wire: unknown mode '%s'\n", argv[8]);
            return 1;
        }
    }
    int64_t delay_ns = (int64_t)(atof(argv[5]) * 1e6);
    double loss_pct = atof(argv[6]);
    loss_threshold = loss_pct <= 0     ? 0
                     : loss_pct >= 100 ? UINT32_MAX
                                       : (uint32_t)(loss_pct / 100.0 * 4294967296.0);
    rng_state = strtoull(argv[7], NULL, 0) | 1;

    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR1, &sa, NULL);
    sigaction(SIGUSR2, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    /* The signals come only inside ppoll, which they end: none is missed between a check of
     * the flags and the wait. */
    sigset_t block, open_mask;
    sigemptyset(&block);
    sigaddset(&block, SIGUSR1);
    sigaddset(&block, SIGUSR2);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGINT);
    sigprocmask(SIG_BLOCK, &block, &open_mask);
    if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0 || getppid() == 1) {
        return 1;
    }

    int home = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
    if (home < 0) {
        fprintf(stderr, "netns_wire: open /proc/self/ns/net: %s\n", strerror(errno));
        return 77;
    }
    int a = tun_in(argv[1], argv[2], home);
    int b = a < 0 ? -1 : tun_in(argv[3], argv[4], home);
    if (a < 0 || b < 0) {
        return 77;
    }
    dir_t dirs[2] = {{.from = a, .to = b}, {.from = b, .to = a}};
    dirs[0].q = malloc(sizeof(slot_t) * SLOTS);
    dirs[1].q = malloc(sizeof(slot_t) * SLOTS);
    if (dirs[0].q == NULL || dirs[1].q == NULL) {
        fprintf(stderr, "netns_wire: no memory\n");
        return 1;
    }
    printf("ready\n");
    fflush(stdout);

    bool cut_said = false;
    while (!stop) {
        if (cut && !cut_said) {
            /* The cut is in effect from here: the driver waits for this line before it tells the
             * ranks (a packet that came before is still delivered or dropped as it was). */
            printf("cut\n");
            fflush(stdout);
            cut_said = true;
        }
        int64_t wait_ns = -1;
        for (int i = 0; i < 2; i++) {
            int64_t w = give(&dirs[i]);
            if (w >= 0 && (wait_ns < 0 || w < wait_ns)) {
                wait_ns = w;
            }
        }
        struct pollfd p[2] = {{.fd = a, .events = POLLIN}, {.fd = b, .events = POLLIN}};
        struct timespec ts = {.tv_sec = wait_ns / 1000000000, .tv_nsec = wait_ns % 1000000000};
        int n = ppoll(p, 2, wait_ns >= 0 ? &ts : NULL, &open_mask);
        if (n < 0 && errno != EINTR) {
            fprintf(stderr, "netns_wire: ppoll: %s\n", strerror(errno));
            return 1;
        }
        for (int i = 0; i < 2 && n > 0; i++) {
            if (p[i].revents & POLLIN) {
                take(&dirs[i], delay_ns);
            }
        }
    }
    printf("a->b forwarded %" PRIu64 " dropped %" PRIu64 "\n", dirs[0].forwarded, dirs[0].dropped);
    printf("b->a forwarded %" PRIu64 " dropped %" PRIu64 "\n", dirs[1].forwarded, dirs[1].dropped);
    fflush(stdout);
    free(dirs[0].q);
    free(dirs[1].q);
    close(a);
    close(b);
    return 0;
}
