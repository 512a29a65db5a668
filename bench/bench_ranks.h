/* How the weft benchmark programs that need several ranks start them (bench/rref.c,
 * bench/dist_autograd.c): forked processes on loopback, rank 0 first, which binds a free master
 * port and hands it back through a pipe, then the others. Rank 0 measures; the others wait for
 * its end (EOF on a second pipe) before the collective shutdown, so that no shutdown overlaps the
 * measurement. */
#ifndef WEFT_BENCH_RANKS_H
#define WEFT_BENCH_RANKS_H

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

/* Rank 0's body: writes its port to @p port_fd (bench_ranks_port), measures, closes @p done_fd.
 * Returns its exit code. */
typedef int (*bench_rank0_cb_t)(void *arg, int port_fd, int done_fd);
/* Another rank's body: joins at @p port, waits for bench_ranks_wait_done(@p done_fd). */
typedef int (*bench_rank_cb_t)(void *arg, int rank, int port, int done_fd);

/* Rank 0: tells the parent its master port. 0 on success. */
static inline int bench_ranks_port(int port_fd, int port)
{
    int ok = write(port_fd, &port, sizeof(port)) == (ssize_t)sizeof(port);
    close(port_fd);
    return ok ? 0 : -1;
}

/* Another rank: waits until rank 0 has measured (EOF on @p done_fd). */
static inline void bench_ranks_wait_done(int done_fd)
{
    char c;
    while (read(done_fd, &c, 1) < 0 && errno == EINTR) {
    }
    close(done_fd);
}

/*
 * Runs @p world ranks and reaps them. @p killed (or -1) is a rank the measurement kills on
 * purpose: its end is not judged. Returns 0 when every other rank exited 0.
 */
static inline int bench_ranks_run(const char *prog, int world, bench_rank0_cb_t rank0,
                                  bench_rank_cb_t rank, void *arg, int killed)
{
    int port_pipe[2], done_pipe[2];
    pid_t pids[64];
    int port = 0, started = 0, bad = 0;

    if (world < 1 || world > 64 || pipe(port_pipe) != 0 || pipe(done_pipe) != 0) {
        perror(prog);
        return 1;
    }
    fflush(stdout);
    pids[0] = fork();
    if (pids[0] < 0) {
        perror("fork");
        return 1;
    }
    if (pids[0] == 0) {
        close(port_pipe[0]);
        close(done_pipe[0]);
        exit(rank0(arg, port_pipe[1], done_pipe[1]));
    }
    started = 1;
    close(port_pipe[1]);
    close(done_pipe[1]);
    if (read(port_pipe[0], &port, sizeof(port)) != (ssize_t)sizeof(port)) {
        fprintf(stderr, "%s: rank 0 did not start\n", prog);
        world = 1; /* start no other */
        bad = 1;
    }
    close(port_pipe[0]);
    for (int r = 1; r < world; r++) {
        pids[r] = fork();
        if (pids[r] < 0) {
            perror("fork");
            break;
        }
        if (pids[r] == 0) {
            exit(rank(arg, r, port, done_pipe[0]));
        }
        started++;
    }
    close(done_pipe[0]);
    if (started < world) {
        bad = 1;
        for (int r = 0; r < started; r++) {
            kill(pids[r], SIGTERM);
        }
    }
    for (int r = 0; r < started; r++) {
        int st = 0;
        if (waitpid(pids[r], &st, 0) != pids[r] ||
            (r != killed && (!WIFEXITED(st) || WEXITSTATUS(st) != 0))) {
            fprintf(stderr, "%s: rank %d exited abnormally (status %d)\n", prog, r, st);
            bad = 1;
        }
    }
    return bad;
}

#endif
