/*
 * Rank program for tests/tools/test_weftrun.c. The rank comes from WEFT_RANK.
 *
 *   child env                  print the rank variables as NAME=VALUE, and PID=
 *   child lines N              print "out R i" on stdout and "err R i" on stderr
 *                              for i < N, then "tail R" without a newline
 *   child long BYTES           print one line of BYTES letters ('a' + R), then "after R"
 *   child exit R K SEC         rank R exits K after 0.2 s; the others sleep SEC
 *   child segv R SEC           rank R dies of SIGSEGV after 0.2 s; the others sleep SEC
 *   child stubborn R K SEC     rank R exits K after 0.3 s; the others ignore SIGTERM
 *                              and sleep SEC
 *   child orphan R K           rank R starts a grandchild that sleeps 60 s, prints
 *                              "GRANDCHILD pid", and exits K; the others sleep 60 s
 *   child sleep SEC            print "sleeping", then sleep SEC
 */

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

static const char *const rank_vars[] = {
    "WEFT_RANK",      "WEFT_WORLD_SIZE",  "WEFT_LOCAL_RANK",  "WEFT_LOCAL_WORLD_SIZE",
    "WEFT_NODE_RANK", "WEFT_MASTER_ADDR", "WEFT_MASTER_PORT", "WEFT_AUTH_TOKEN",
    "RANK",           "WORLD_SIZE",       "LOCAL_RANK",       "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",    "MASTER_PORT",
};

/* Sleep the whole time, even when signals that do not kill us come in. The sleeps are the ranks'
 * scenario (a rank that stays until weftrun stops it, or fails a moment in); what the tests
 * check never depends on their length. */
static void sleep_s(double sec)
{
    struct timespec ts;

    ts.tv_sec = (time_t)sec;
    ts.tv_nsec = (long)((sec - (double)ts.tv_sec) * 1e9);
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static int arg_int(int argc, char **argv, int i)
{
    if (i >= argc) {
        fprintf(stderr, "child: missing argument %d\n", i);
        exit(100);
    }
    return atoi(argv[i]);
}

int main(int argc, char **argv)
{
    const char *rank_s = getenv("WEFT_RANK");
    const char *mode = argc > 1 ? argv[1] : "";
    int rank = rank_s != NULL ? atoi(rank_s) : -1;

    if (strcmp(mode, "env") == 0) {
        for (size_t i = 0; i < sizeof(rank_vars) / sizeof(rank_vars[0]); i++) {
            const char *v = getenv(rank_vars[i]);
            printf("%s=%s\n", rank_vars[i], v != NULL ? v : "<unset>");
        }
        printf("PID=%d\n", (int)getpid());
        return 0;
    }
    if (strcmp(mode, "lines") == 0) {
        int n = arg_int(argc, argv, 2);
        for (int i = 0; i < n; i++) {
            printf("out %d %d\n", rank, i);
            fprintf(stderr, "err %d %d\n", rank, i);
        }
        printf("tail %d", rank);
        return 0;
    }
    if (strcmp(mode, "long") == 0) {
        int n = arg_int(argc, argv, 2);
        for (int i = 0; i < n; i++) {
            putchar('a' + rank);
        }
        printf("\nafter %d\n", rank);
        return 0;
    }
    if (strcmp(mode, "exit") == 0 || strcmp(mode, "segv") == 0 || strcmp(mode, "stubborn") == 0) {
        int victim = arg_int(argc, argv, 2);
        int code = strcmp(mode, "segv") == 0 ? 0 : arg_int(argc, argv, 3);
        int sec = arg_int(argc, argv, strcmp(mode, "segv") == 0 ? 3 : 4);

        if (rank != victim) {
            if (strcmp(mode, "stubborn") == 0) {
                signal(SIGTERM, SIG_IGN);
            }
            sleep_s(sec);
            return 0;
        }
        if (strcmp(mode, "segv") == 0) {
            struct rlimit no_core = {0, 0};
            setrlimit(RLIMIT_CORE, &no_core);
            sleep_s(0.2);
            signal(SIGSEGV, SIG_DFL);
            raise(SIGSEGV);
            return 99;
        }
        sleep_s(strcmp(mode, "stubborn") == 0 ? 0.3 : 0.2);
        return code;
    }
    if (strcmp(mode, "orphan") == 0) {
        int victim = arg_int(argc, argv, 2);
        int code = arg_int(argc, argv, 3);
        pid_t pid;

        if (rank != victim) {
            sleep_s(60);
            return 0;
        }
        fflush(stdout);
        pid = fork();
        if (pid < 0) {
            perror("fork");
            return 98;
        }
        if (pid == 0) {
            sleep_s(60);
            _exit(0);
        }
        printf("GRANDCHILD %d\n", (int)pid);
        fflush(stdout);
        sleep_s(0.2);
        return code;
    }
    if (strcmp(mode, "sleep") == 0) {
        printf("sleeping\n");
        fflush(stdout);
        sleep_s(arg_int(argc, argv, 2));
        return 0;
    }
    fprintf(stderr, "child: unknown mode '%s'\n", mode);
    return 100;
}
