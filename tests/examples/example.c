/* The examples under weftrun for their tests (example.h). */
#include <criterion/criterion.h>

#include "example.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#define MAX_ARGS         64
#define DEFAULT_DATA_DIR "/usr/share/datasets/fashion-mnist"

void example_run(result_t *r, const example_t *ex, const char *const *args)
{
    static const char *const keep[] = {"WEFT_DATA_DIR=", "WEFT_LOG=", NULL};
    const char *argv[MAX_ARGS + 1];
    int n = 0;

    argv[n++] = path_from_env("WEFTRUN");
    argv[n++] = "-n";
    argv[n++] = ex->ranks;
    if (ex->servers != NULL) {
        argv[n++] = "--servers";
        argv[n++] = ex->servers;
    }
    argv[n++] = path_from_env(ex->prog_env);
    for (; args != NULL && *args != NULL; args++) {
        cr_assert(n < MAX_ARGS, "too many arguments");
        argv[n++] = *args;
    }
    argv[n] = NULL;
    run_opts_t o = {.argv = argv,
                    .keep = keep,
                    .deadline_s = ex->deadline_s > 0 ? ex->deadline_s : EXAMPLE_DEADLINE_S,
                    .sig = ex->sig,
                    .sig_when = ex->sig_when,
                    .sig_when_count = ex->sig_when_count > 0 ? ex->sig_when_count : 1};
    run_capture(&o, r);
}

bool example_have_fashion_mnist(void)
{
    const char *dir = getenv("WEFT_DATA_DIR");
    char path[4096];
    struct stat sb;

    snprintf(path, sizeof(path), "%s/train-images-idx3-ubyte.gz",
             dir != NULL && *dir != '\0' ? dir : DEFAULT_DATA_DIR);
    return stat(path, &sb) == 0;
}

void example_tmp_dir(char *dir, size_t n, const char *what)
{
    snprintf(dir, n, "/tmp/weft_example_%s_XXXXXX", what);
    cr_assert(mkdtemp(dir) != NULL, "mkdtemp %s", dir);
}

void example_remove_dir(const char *dir)
{
    char cmd[512];

    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
}

void example_resumed_at(const result_t *r, const char *lead, const char *dir, long long v[4])
{
    char want[512];
    const char *line;

    snprintf(want, sizeof(want), "%sresumed at step ", lead);
    line = find_line(r->out, want, true);
    cr_assert(line != NULL, "no line %s\nstdout:\n%s\nstderr:\n%s", want, r->out, r->err);
    snprintf(want, sizeof(want),
             "%sresumed at step %%lld from %s: continuing with epoch %%lld, step %%lld of %%lld",
             lead, dir);
    cr_assert(sscanf(line, want, &v[0], &v[1], &v[2], &v[3]) == 4, "%.300s", line);
}

void example_assert_lines(const result_t *r, const char *const *want)
{
    for (; *want != NULL; want++) {
        cr_assert(find_line(r->out, *want, false) != NULL,
                  "missing line: %s\nstdout:\n%s\nstderr:\n%s", *want, r->out, r->err);
    }
}
