/* What the example programs share (common.h). */
#include "common.h"

#include <errno.h>
#include <getopt.h>
#include <malloc.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

/*
 * A training step allocates the same large buffers (activations, gradients, a batch's rows)
 * and frees them again. glibc serves buffers from 128 KiB up with fresh mmaps and gives freed
 * heap tops back to the system, so every step faulted its pages in anew (hybrid_train: 3-4% of
 * the time in page faults, 113-118k -> 126k samples/s with these two settings). Every example
 * keeps freed memory for reuse instead, as allocators tuned for such loops do; the peak
 * resident size grows a little (hybrid_train's largest rank: 119 -> 128 MiB).
 */
__attribute__((constructor)) static void ex_keep_freed_memory(void)
{
    (void)mallopt(M_MMAP_THRESHOLD, 256 << 20);
    (void)mallopt(M_TRIM_THRESHOLD, 512 << 20);
}

#define MAX_OPTS 64
#define OPT_BASE 256 /* getopt_long's value of row i: OPT_BASE + i, clear of '?' and 'h' */
#define MAX_SIZE (1 << 16)

/* ------------------------------------------------------------------ options */

int ex_parse_int(const char *s, int64_t min, int64_t max, int64_t *v_p)
{
    char *end = NULL;
    long long v;

    errno = 0;
    v = strtoll(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < min || v > max) {
        return -1;
    }
    *v_p = (int64_t)v;
    return 0;
}

int ex_parse_double(const char *s, double min, double max, double *v_p)
{
    char *end = NULL;
    double v;

    errno = 0;
    v = strtod(s, &end);
    if (errno != 0 || end == s || *end != '\0' || !isfinite(v) || v < min || v > max) {
        return -1;
    }
    *v_p = v;
    return 0;
}

static int parse_sizes(const char *s, ex_sizes_t *sizes_p)
{
    ex_sizes_t sizes = {0};
    char buf[256];
    char *save = NULL;

    if (strlen(s) >= sizeof(buf)) {
        return -1;
    }
    strcpy(buf, s);
    for (char *tok = strtok_r(buf, ",", &save); tok != NULL; tok = strtok_r(NULL, ",", &save)) {
        if (sizes.n == EX_MAX_LAYERS - 1 ||
            ex_parse_int(tok, 1, MAX_SIZE, &sizes.v[sizes.n]) != 0) {
            return -1;
        }
        sizes.n++;
    }
    if (sizes.n == 0) {
        return -1;
    }
    *sizes_p = sizes;
    return 0;
}

static int parse_mode(const char *s, weft_ps_consistency_t *mode_p)
{
    if (strcmp(s, "sync") == 0) {
        *mode_p = WEFT_PS_SYNC;
    } else if (strcmp(s, "async") == 0) {
        *mode_p = WEFT_PS_ASYNC;
    } else if (strcmp(s, "bounded") == 0) {
        *mode_p = WEFT_PS_BOUNDED;
    } else {
        return -1;
    }
    return 0;
}

/* Stores @p arg as @p o says. @return 0, or -1 for a bad value (nothing set). */
static int opt_set(const ex_opt_t *o, const char *arg)
{
    int64_t iv = 0;

    switch (o->kind) {
    case EX_OPT_FLAG:
        *(int *)o->dst = 1;
        return 0;
    case EX_OPT_INT:
    case EX_OPT_I64:
    case EX_OPT_U64:
        if (ex_parse_int(arg, o->min, o->max, &iv) != 0) {
            return -1;
        }
        if (o->kind == EX_OPT_INT) {
            *(int *)o->dst = (int)iv;
        } else if (o->kind == EX_OPT_I64) {
            *(int64_t *)o->dst = iv;
        } else {
            *(uint64_t *)o->dst = (uint64_t)iv;
        }
        return 0;
    case EX_OPT_DOUBLE:
        return ex_parse_double(arg, o->fmin, o->fmax, o->dst);
    case EX_OPT_STR:
        *(const char **)o->dst = arg;
        return 0;
    case EX_OPT_SIZES:
        return parse_sizes(arg, o->dst);
    case EX_OPT_MODE:
        return parse_mode(arg, o->dst);
    }
    return -1;
}

int ex_parse_opts(const char *prog, int argc, char **argv, const ex_opt_t *opts, size_t n,
                  void (*usage)(FILE *out))
{
    struct option longopts[MAX_OPTS + 2];
    int c;

    if (n > MAX_OPTS) {
        fprintf(stderr, "%s: %zu options, at most %d\n", prog, n, MAX_OPTS);
        return EX_EXIT_USAGE;
    }
    for (size_t i = 0; i < n; i++) {
        longopts[i].name = opts[i].name;
        longopts[i].has_arg = opts[i].kind == EX_OPT_FLAG ? no_argument : required_argument;
        longopts[i].flag = NULL;
        longopts[i].val = OPT_BASE + (int)i;
    }
    longopts[n] = (struct option){"help", no_argument, NULL, 'h'};
    longopts[n + 1] = (struct option){NULL, 0, NULL, 0};

    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        const ex_opt_t *o;

        if (c == 'h') {
            usage(stdout);
            return 1;
        }
        if (c < OPT_BASE || c >= OPT_BASE + (int)n) {
            usage(stderr); /* getopt_long said what is wrong */
            return EX_EXIT_USAGE;
        }
        o = &opts[c - OPT_BASE];
        if (opt_set(o, optarg) != 0) {
            fprintf(stderr, "%s: bad value '%s' for --%s\n", prog, optarg, o->name);
            usage(stderr);
            return EX_EXIT_USAGE;
        }
        if (o->given != NULL) {
            *o->given = 1;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "%s: unexpected argument '%s'\n", prog, argv[optind]);
        usage(stderr);
        return EX_EXIT_USAGE;
    }
    return 0;
}

const char *ex_mode_name(weft_ps_consistency_t mode)
{
    return mode == WEFT_PS_SYNC ? "sync" : mode == WEFT_PS_ASYNC ? "async" : "bounded";
}

/* ------------------------------------------------------------------ running */

double ex_now(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void ex_fail(const char *prog, const char *what, weft_status_t st)
{
    fprintf(stderr, "%s: %s: %s: %s\n", prog, what, weft_status_name(st), weft_last_error());
}

int ex_wait_all(const char *prog, weft_future_t **fs, int n, const char *what)
{
    weft_status_t st = n > 0 ? weft_future_wait_all(fs, (size_t)n, 0) : WEFT_OK;
    int rc = 0;

    for (int i = 0; i < n; i++) {
        weft_status_t fst = weft_future_status(fs[i]);

        if (rc == 0 && fst != WEFT_OK) {
            fprintf(stderr, "%s: %s: %s: %s\n", prog, what, weft_status_name(fst),
                    weft_future_error(fs[i]));
            rc = -1;
        }
        weft_future_release(fs[i]);
    }
    if (st != WEFT_OK && rc == 0) {
        fprintf(stderr, "%s: %s: %s\n", prog, what, weft_status_name(st));
        rc = -1;
    }
    return rc;
}

int ex_ps_start(const char *prog, weft_agent_t **a_p, weft_ps_t **ps_p)
{
    weft_agent_opts_t opts;
    weft_ps_opts_t ps_opts;
    weft_agent_t *a = NULL;
    weft_ps_t *ps = NULL;
    weft_status_t st;

    weft_agent_opts_init(&opts);
    opts.handler_threads = 2; /* a server answers pushes while pulls wait for a step */
    st = weft_agent_create(&opts, &a);
    if (st == WEFT_OK) {
        /* Before the join: the servers' function must exist when the first request comes. */
        weft_ps_opts_init(&ps_opts); /* roles from WEFT_PS_SERVERS (weftrun --servers) */
        st = weft_ps_create(a, &ps_opts, &ps);
    }
    if (st == WEFT_OK) {
        st = weft_agent_join(a);
    }
    if (st != WEFT_OK) {
        ex_fail(prog, "cannot start the parameter server", st);
        weft_agent_free(a);
        return -1;
    }
    *a_p = a;
    *ps_p = ps;
    return 0;
}

int ex_ps_workers_group(const char *prog, weft_agent_t *a, weft_ps_t *ps, weft_pg_t **wpg_p)
{
    int world = weft_agent_world_size(a);
    int64_t one = 1;
    int64_t nworld = world;
    int *ranks = calloc((size_t)world, sizeof(*ranks));
    weft_pg_t *pg = NULL;
    weft_tensor_t *in = NULL;
    weft_tensor_t *out = NULL;
    int n = 0;
    weft_status_t st;

    if (ranks == NULL) {
        fprintf(stderr, "%s: the workers' group: out of memory\n", prog);
        return -1;
    }
    st = weft_pg_world(a, &pg);
    if (st == WEFT_OK) {
        st = weft_tensor_create(WEFT_I32, 1, &one, &in);
    }
    if (st == WEFT_OK) {
        st = weft_tensor_create(WEFT_I32, 1, &nworld, &out);
    }
    if (st == WEFT_OK) {
        ((int32_t *)weft_tensor_data(in))[0] = weft_ps_worker_index(ps);
        st = weft_coll_all_gather(pg, in, out, NULL);
    }
    for (int r = 0; st == WEFT_OK && r < world; r++) {
        int32_t w = ((int32_t *)weft_tensor_data(out))[r];

        if (w >= 0 && w < world) {
            ranks[w] = r;
            n++;
        }
    }
    if (st == WEFT_OK && (size_t)n != weft_ps_num_workers(ps)) {
        fprintf(stderr, "%s: %d ranks say they work, the parameter server has %zu workers\n", prog,
                n, weft_ps_num_workers(ps));
        st = WEFT_ERR_INVALID_STATE;
    }
    if (st == WEFT_OK) {
        st = weft_pg_new(a, ranks, n, wpg_p);
    }
    weft_tensor_release(in);
    weft_tensor_release(out);
    weft_pg_free(pg);
    free(ranks);
    if (st != WEFT_OK) {
        ex_fail(prog, "the workers' group", st);
        return -1;
    }
    return 0;
}

int ex_ps_end_step(const char *prog, weft_ps_t *ps, weft_future_t **fs, int n)
{
    weft_status_t st;

    if (ex_wait_all(prog, fs, n, "push") != 0) {
        return -1;
    }
    st = weft_ps_clock(ps, 0);
    if (st != WEFT_OK) {
        ex_fail(prog, "clock", st);
        return -1;
    }
    return 0;
}

int ex_ps_finish(const char *prog, weft_ps_t *ps, int rc)
{
    weft_status_t st = weft_ps_finish(ps, 0);

    if (st != WEFT_OK) {
        ex_fail(prog, "finish", st);
        return rc != 0 ? rc : 1;
    }
    return rc;
}

int ex_agent_shutdown(const char *prog, weft_agent_t *a, int rc)
{
    weft_status_t st = weft_agent_shutdown(a, EX_SHUTDOWN_TIMEOUT_MS);

    if (st != WEFT_OK) {
        ex_fail(prog, "shutdown", st);
        return rc != 0 ? rc : 1;
    }
    return rc;
}

int64_t ex_call_time_left_ms(const weft_call_t *call)
{
    int64_t left = weft_call_time_left_ms(call);
    return left > 0 ? left : 1;
}

void ex_reply_payload(weft_call_t *call, const void *p, size_t len)
{
    weft_value_t *res = NULL;

    if (weft_value_create(&res) != WEFT_OK || weft_value_set_payload(res, p, len) != WEFT_OK) {
        weft_value_free(res);
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "no memory");
        return;
    }
    weft_call_reply(call, res);
}

/* ------------------------------------------------------------------ the end of a run */

void ex_wait_done_fn(weft_call_t *call, void *arg)
{
    ex_done_t *d = arg;

    pthread_mutex_lock(&d->mu);
    if (!d->done && d->n < EX_MAX_WAITERS) {
        d->calls[d->n++] = call; /* answered by ex_done_announce */
        pthread_mutex_unlock(&d->mu);
        return;
    }
    int done = d->done;
    pthread_mutex_unlock(&d->mu);
    if (done) {
        weft_call_reply(call, NULL);
    } else {
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "too many wait_done calls");
    }
}

void ex_done_announce(ex_done_t *d)
{
    weft_call_t *calls[EX_MAX_WAITERS];
    int n;

    pthread_mutex_lock(&d->mu);
    d->done = 1;
    n = d->n;
    memcpy(calls, d->calls, (size_t)n * sizeof(calls[0]));
    d->n = 0;
    pthread_mutex_unlock(&d->mu);
    for (int i = 0; i < n; i++) {
        weft_call_reply(calls[i], NULL);
    }
}

int ex_wait_done(const char *prog, weft_agent_t *a, int first, int last, const char *what)
{
    weft_future_t *fs[EX_MAX_WAITERS];
    int n = 0;

    for (int r = first; r <= last && n < EX_MAX_WAITERS; r++) {
        weft_status_t st = weft_rpc_async(a, r, "wait_done", NULL, EX_SERVE_TIMEOUT_MS, &fs[n]);
        if (st != WEFT_OK) {
            ex_fail(prog, "wait_done", st);
            (void)ex_wait_all(prog, fs, n, what);
            return -1;
        }
        n++;
    }
    return ex_wait_all(prog, fs, n, what);
}

/* ------------------------------------------------------------------ training */

double ex_rel_diff(double a, double b)
{
    double scale = fabs(a) > fabs(b) ? fabs(a) : fabs(b);
    return scale > 0 ? fabs(a - b) / scale : 0.0;
}

void ex_progress(int epoch, int epochs, int64_t step, int64_t steps, double loss, double rate,
                 int tty)
{
    char bar[31];
    int fill = (int)(30 * (step + 1) / steps);

    for (int i = 0; i < 30; i++) {
        bar[i] = i < fill ? '#' : '.';
    }
    bar[30] = '\0';
    printf("%sepoch %d/%d [%s] %lld/%lld loss %.4f %.0f samples/s%s", tty ? "\r" : "", epoch + 1,
           epochs, bar, (long long)(step + 1), (long long)steps, loss, rate, tty ? "" : "\n");
    fflush(stdout);
}

void ex_epoch_perm(uint64_t seed, int epoch, int64_t n, int64_t *perm)
{
    weft_rng_t rng;

    weft_rng_init(&rng, seed, 1000 + (uint64_t)epoch);
    for (int64_t i = 0; i < n; i++) {
        perm[i] = i;
    }
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)weft_rng_below(&rng, (uint64_t)i + 1);
        int64_t t = perm[i];

        perm[i] = perm[j];
        perm[j] = t;
    }
}

uint64_t ex_fnv1a(uint64_t h, const void *p, size_t n)
{
    const unsigned char *c = p;

    for (size_t i = 0; i < n; i++) {
        h = (h ^ c[i]) * 0x100000001b3ULL;
    }
    return h;
}

int ex_params_identical(const char *prog, weft_pg_t *pg, const weft_param_list_t *params,
                        int *same_p, uint64_t *hash_p)
{
    int64_t n = weft_param_list_numel(params);
    int64_t one = 1;
    weft_tensor_t *mine = NULL;
    weft_tensor_t *copy = NULL;
    weft_tensor_t *flag = NULL;
    weft_status_t st;

    st = weft_tensor_empty(WEFT_F32, 1, &n, &mine);
    if (st == WEFT_OK) {
        st = weft_param_list_pack(params, mine);
    }
    if (st == WEFT_OK) {
        st = weft_tensor_clone(mine, &copy);
    }
    if (st == WEFT_OK) {
        st = weft_coll_broadcast(pg, copy, 0, NULL);
    }
    if (st == WEFT_OK) {
        st = weft_tensor_create(WEFT_I32, 1, &one, &flag);
    }
    if (st == WEFT_OK) {
        ((int32_t *)weft_tensor_data(flag))[0] =
            memcmp(weft_tensor_data(copy), weft_tensor_data(mine), weft_tensor_nbytes(copy)) == 0;
        st = weft_coll_all_reduce(pg, flag, WEFT_MIN, NULL);
    }
    if (st == WEFT_OK) {
        *same_p = ((int32_t *)weft_tensor_data(flag))[0];
        *hash_p = ex_fnv1a(EX_FNV1A_BASIS, weft_tensor_data(mine), weft_tensor_nbytes(mine));
    }
    weft_tensor_release(mine);
    weft_tensor_release(copy);
    weft_tensor_release(flag);
    if (st != WEFT_OK) {
        ex_fail(prog, "parameter check", st);
        return -1;
    }
    return 0;
}

int ex_mlp_sizes(const ex_sizes_t *hidden, int64_t in, int64_t out, int64_t *sizes)
{
    sizes[0] = in;
    for (int l = 0; l < hidden->n; l++) {
        sizes[l + 1] = hidden->v[l];
    }
    sizes[hidden->n + 1] = out;
    return hidden->n + 2;
}

int ex_ps_table_create(const char *prog, weft_ps_t *ps, const weft_ps_table_spec_t *spec,
                       weft_ps_table_t **t_p)
{
    weft_status_t st = weft_ps_table_create(ps, spec, 0, t_p);

    if (st != WEFT_OK) {
        fprintf(stderr, "%s: table %s: %s: %s\n", prog, spec->name, weft_status_name(st),
                weft_last_error());
        return -1;
    }
    return 0;
}

void ex_print_mlp(int n_sizes, const int64_t *sizes)
{
    printf("MLP %lld", (long long)sizes[0]);
    for (int l = 1; l < n_sizes; l++) {
        printf("-%lld", (long long)sizes[l]);
    }
}

void ex_linear_name(int i, char *name, size_t cap)
{
    snprintf(name, cap, "fc%d.%s", i / 2 + 1, i % 2 == 0 ? "weight" : "bias");
}

void ex_ps_linear_spec(const int64_t *sizes, int i, const char *table, weft_ps_table_spec_t *spec)
{
    int l = i / 2;
    double bound = 1.0 / sqrt((double)sizes[l]);

    weft_ps_table_spec_init(spec, table, WEFT_PS_DENSE);
    if (i % 2 == 0) {
        spec->ndim = 2;
        spec->shape[0] = sizes[l + 1];
        spec->shape[1] = sizes[l];
    } else {
        spec->ndim = 1;
        spec->shape[0] = sizes[l + 1];
    }
    spec->init = WEFT_PS_UNIFORM; /* torch's nn.Linear: uniform(+-1/sqrt(fan_in)) */
    spec->init_a = -bound;
    spec->init_b = bound;
}

weft_status_t ex_mlp_for_tables(const char *prog, int n_sizes, const int64_t *sizes, uint64_t seed,
                                weft_nn_mlp_t **mlp_p)
{
    const weft_param_list_t *params;
    weft_nn_mlp_t *mlp = NULL;
    weft_rng_t rng;
    weft_status_t st;
    int n;

    weft_rng_init(&rng, seed, 0);
    st = weft_nn_mlp_create(n_sizes, sizes, NULL, &rng, &mlp);
    if (st != WEFT_OK) {
        return st;
    }
    params = weft_nn_mlp_params(mlp);
    n = weft_param_list_size(params);
    if (n != 2 * (n_sizes - 1)) {
        fprintf(stderr, "%s: the MLP has %d parameters, the tables are %d\n", prog, n,
                2 * (n_sizes - 1));
        weft_nn_mlp_free(mlp);
        return WEFT_ERR_INVALID_STATE;
    }
    for (int i = 0; i < n; i++) {
        char name[32];

        ex_linear_name(i, name, sizeof(name));
        if (strcmp(weft_param_list_name(params, i), name) != 0) {
            fprintf(stderr, "%s: parameter %d is %s, its table %s\n", prog, i,
                    weft_param_list_name(params, i), name);
            weft_nn_mlp_free(mlp);
            return WEFT_ERR_INVALID_STATE;
        }
    }
    *mlp_p = mlp;
    return WEFT_OK;
}

int ex_peak_rss(const char *prog, weft_pg_t *pg, double *max_p, double *sum_p)
{
    struct rusage ru;
    int64_t one = 1;
    weft_tensor_t *mx = NULL;
    weft_tensor_t *sum = NULL;
    weft_status_t st;

    getrusage(RUSAGE_SELF, &ru);
    st = weft_tensor_create(WEFT_F64, 1, &one, &mx);
    if (st == WEFT_OK) {
        ((double *)weft_tensor_data(mx))[0] = (double)ru.ru_maxrss / 1024.0;
        st = weft_tensor_clone(mx, &sum);
    }
    if (st == WEFT_OK) {
        st = weft_coll_all_reduce(pg, mx, WEFT_MAX, NULL);
    }
    if (st == WEFT_OK && sum_p != NULL) {
        st = weft_coll_all_reduce(pg, sum, WEFT_SUM, NULL);
    }
    if (st == WEFT_OK) {
        *max_p = ((double *)weft_tensor_data(mx))[0];
        if (sum_p != NULL) {
            *sum_p = ((double *)weft_tensor_data(sum))[0];
        }
    }
    weft_tensor_release(mx);
    weft_tensor_release(sum);
    if (st != WEFT_OK) {
        ex_fail(prog, "peak memory", st);
        return -1;
    }
    return 0;
}

void ex_json_num(const char *name, double v, const char *fmt)
{
    printf(",\"%s\":", name);
    if (isfinite(v)) {
        printf(fmt, v);
    } else {
        printf("null");
    }
}

void ex_print_params_check(int same, int world, uint64_t hash)
{
    printf("parameters %s on all %d ranks (fnv1a64 %016llx)\n", same ? "bit-identical" : "DIFFER",
           world, (unsigned long long)hash);
}

/* ------------------------------------------------------------------ training loop */

void ex_loop_init(ex_loop_t *l, int rank, int world, int epochs, int64_t steps, int eval_every)
{
    memset(l, 0, sizeof(*l));
    l->rank = rank;
    l->world = world;
    l->epochs = epochs;
    l->steps = steps;
    l->eval_every = eval_every;
    l->tty = isatty(STDOUT_FILENO);
}

void ex_loop_epoch_begin(ex_loop_t *l)
{
    l->t_epoch = 0;
    l->loss_sum = 0;
    l->loss_n = 0;
}

void ex_loop_add_ddp(ex_loop_t *l, weft_ddp_t *ddp)
{
    weft_ddp_stats_t ds;

    weft_ddp_stats(ddp, &ds);
    l->comm_us += ds.comm_us;
    l->exposed_us += ds.exposed_us;
}

int ex_loop_step_end(ex_loop_t *l, int epoch, int64_t s, int64_t k, double loss, double t0)
{
    const int64_t every = l->steps / 10 > 0 ? l->steps / 10 : 1;

    l->t_epoch += ex_now() - t0;
    l->loss_sum += loss;
    l->loss_n++;
    l->samples += k * l->world;
    l->step_total++;
    if (l->rank == 0 && (l->tty || (s + 1) % every == 0 || s + 1 == l->steps)) {
        ex_progress(epoch, l->epochs, s, l->steps, l->loss_sum / (double)l->loss_n,
                    (double)l->samples / (l->train_time + l->t_epoch), l->tty);
    }
    return (l->eval_every > 0 && l->step_total % l->eval_every == 0) || s + 1 == l->steps;
}

void ex_loop_eval_line(const ex_loop_t *l, int64_t s, double acc)
{
    if (l->rank == 0 && s + 1 < l->steps) {
        printf("%sstep %lld: test accuracy %.2f%%\n", l->tty ? "\n" : "", (long long)l->step_total,
               100.0 * acc);
    }
}

void ex_loop_epoch_end(ex_loop_t *l, int epoch, double acc)
{
    l->train_time += l->t_epoch;
    l->loss_avg = l->loss_n > 0 ? l->loss_sum / (double)l->loss_n : 0;
    l->epochs_run = epoch + 1;
    if (l->rank == 0) {
        printf("%sepoch %d: train loss %.4f, test accuracy %.2f%%, %.1f s, %.0f samples/s\n",
               l->tty ? "\n" : "", epoch + 1, l->loss_avg, 100.0 * acc, l->t_epoch,
               ex_loop_rate(l));
    }
}

double ex_loop_rate(const ex_loop_t *l)
{
    return l->train_time > 0 ? (double)l->samples / l->train_time : 0.0;
}

double ex_loop_step_ms(const ex_loop_t *l)
{
    return l->step_total > 0 ? 1e3 * l->train_time / (double)l->step_total : 0.0;
}
