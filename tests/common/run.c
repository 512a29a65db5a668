#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "run.h"
#include "wait.h"

#define MAX_ENV 512

extern char **environ;

static double now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

const char *run_path_from_env(const char *name)
{
    const char *p = getenv(name);

    cr_assert(p != NULL && *p != '\0', "%s must name the built program", name);
    return p;
}

/* Rank variables of an outer launcher must not leak into the run. */
static bool scrubbed(const char *entry, const char *const *keep)
{
    static const char *const prefixes[] = {"SLURM_", "OMPI_", "PMI_", "WEFT_"};
    static const char *const exact[] = {"MASTER_ADDR", "MASTER_PORT", "RANK",
                                        "WORLD_SIZE",  "LOCAL_RANK",  "LOCAL_WORLD_SIZE"};
    size_t name_len = strcspn(entry, "=");

    for (size_t i = 0; keep != NULL && keep[i] != NULL; i++) {
        if (strncmp(entry, keep[i], strlen(keep[i])) == 0) {
            return false;
        }
    }
    for (size_t i = 0; i < sizeof(prefixes) / sizeof(prefixes[0]); i++) {
        if (strncmp(entry, prefixes[i], strlen(prefixes[i])) == 0) {
            return true;
        }
    }
    for (size_t i = 0; i < sizeof(exact) / sizeof(exact[0]); i++) {
        if (strlen(exact[i]) == name_len && strncmp(entry, exact[i], name_len) == 0) {
            return true;
        }
    }
    return false;
}

/* How many times @p want occurs in @p text. */
static int occurrences(const char *text, const char *want)
{
    int n = 0;

    for (const char *at = strstr(text, want); at != NULL; at = strstr(at + 1, want)) {
        n++;
    }
    return n;
}

static void append(char **buf, size_t *len, const char *data, size_t n)
{
    *buf = realloc(*buf, *len + n + 1);
    cr_assert(*buf != NULL);
    memcpy(*buf + *len, data, n);
    *len += n;
    (*buf)[*len] = '\0';
}

void run_capture(const run_opts_t *o, run_result_t *r)
{
    const char *envp[MAX_ENV];
    int out_pipe[2], err_pipe[2];
    int nenv = 0, status = 0;
    bool sent = false;

    memset(r, 0, sizeof(*r));
    append(&r->out, &r->out_len, "", 0);
    append(&r->err, &r->err_len, "", 0);
    for (char **e = environ; *e != NULL && nenv < MAX_ENV - 1; e++) {
        if (!scrubbed(*e, o->keep)) {
            envp[nenv++] = *e;
        }
    }
    for (size_t i = 0; o->env != NULL && o->env[i] != NULL && nenv < MAX_ENV - 1; i++) {
        envp[nenv++] = o->env[i];
    }
    envp[nenv] = NULL;

    cr_assert(pipe2(out_pipe, O_CLOEXEC) == 0);
    cr_assert(pipe2(err_pipe, O_CLOEXEC) == 0);
    double start = now_s(), deadline = start + o->deadline_s;
    r->pid = fork();
    cr_assert(r->pid >= 0);
    if (r->pid == 0) {
        int null_fd = open("/dev/null", O_RDONLY);
        dup2(null_fd, STDIN_FILENO);
        dup2(out_pipe[1], STDOUT_FILENO);
        dup2(err_pipe[1], STDERR_FILENO);
        execve(o->argv[0], (char *const *)o->argv, (char *const *)envp);
        _exit(126);
    }
    close(out_pipe[1]);
    close(err_pipe[1]);

    struct pollfd pfds[2] = {{.fd = out_pipe[0], .events = POLLIN},
                             {.fd = err_pipe[0], .events = POLLIN}};
    int open_fds = 2;
    while (open_fds > 0 && now_s() < deadline) {
        double wait = deadline - now_s();
        if (o->sig != 0 && !sent && occurrences(r->out, o->sig_when) >= o->sig_when_count) {
            kill(r->pid, o->sig);
            sent = true;
        }
        if (poll(pfds, 2, (int)(wait * 1000) + 1) < 0) {
            cr_assert(errno == EINTR);
            continue;
        }
        for (int i = 0; i < 2; i++) {
            char buf[65536];
            if (pfds[i].fd < 0 || pfds[i].revents == 0) {
                continue;
            }
            ssize_t n = read(pfds[i].fd, buf, sizeof(buf));
            if (n > 0) {
                if (i == 0) {
                    append(&r->out, &r->out_len, buf, (size_t)n);
                } else {
                    append(&r->err, &r->err_len, buf, (size_t)n);
                }
            } else if (n == 0 || errno != EINTR) {
                close(pfds[i].fd);
                pfds[i].fd = -1;
                open_fds--;
            }
        }
    }
    for (int i = 0; i < 2; i++) {
        if (pfds[i].fd >= 0) {
            close(pfds[i].fd);
        }
    }
    for (;;) {
        if (waitpid(r->pid, &status, WNOHANG) == r->pid) {
            break;
        }
        if (now_s() >= deadline) {
            /* weftrun passes SIGTERM on to its ranks and stops them: it has a second for it. */
            bool exited;
            kill(r->pid, SIGTERM);
            WAIT_UNTIL(exited, waitpid(r->pid, &status, WNOHANG) == r->pid, 1000);
            if (!exited) {
                kill(r->pid, SIGKILL);
                waitpid(r->pid, &status, 0);
            }
            r->code = -1;
            r->elapsed = now_s() - start;
            cr_assert_fail("%s did not finish within %g s\nstdout:\n%s\nstderr:\n%s", o->argv[0],
                           o->deadline_s, r->out, r->err);
            return;
        }
        usleep(10000);
    }
    r->elapsed = now_s() - start;
    r->code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void run_result_free(run_result_t *r)
{
    free(r->out);
    free(r->err);
    r->out = r->err = NULL;
}

const char *run_find_line(const char *text, const char *want, bool prefix)
{
    size_t want_len = strlen(want);
    const char *line = text;

    while (*line != '\0') {
        size_t len = strcspn(line, "\n");
        if ((prefix ? len >= want_len : len == want_len) && strncmp(line, want, want_len) == 0) {
            return line;
        }
        line += len + (line[len] == '\n' ? 1 : 0);
    }
    return NULL;
}
