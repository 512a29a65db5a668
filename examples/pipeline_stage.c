/* What pipeline_train and pipeline_ddp share (pipeline_stage.h). */
#include "pipeline_stage.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* ------------------------------------------------------------------ a stage on its rank */

void pipe_stage_free(pipe_stage_t *s)
{
    weft_optimizer_free(s->opt);
    weft_param_list_free(s->params);
    weft_nn_linear_free(s->fc2);
    weft_nn_linear_free(s->fc1);
    weft_nn_conv2d_free(s->conv2);
    weft_nn_conv2d_free(s->conv1);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

weft_status_t pipe_stage_create(int k, uint64_t seed, pipe_stage_t **s_p)
{
    weft_nn_conv2d_config_t cc = WEFT_NN_CONV2D_DEFAULTS;
    pipe_stage_t *s;
    weft_rng_t rng;
    weft_status_t st;

    if (k != 1 && k != 2) {
        return WEFT_ERR_INVALID_ARG;
    }
    s = calloc(1, sizeof(*s));
    if (s == NULL) {
        return WEFT_ERR_NO_MEMORY;
    }
    pthread_mutex_init(&s->mu, NULL);
    s->k = k;
    weft_rng_init(&rng, seed, (uint64_t)k);
    st = weft_param_list_create(&s->params);
    if (st == WEFT_OK && s->k == 1) {
        cc.padding[0] = cc.padding[1] = 1;
        st = weft_nn_conv2d_create(1, 32, (const int64_t[]){3, 3}, &cc, &rng, &s->conv1);
        if (st == WEFT_OK) {
            st = weft_nn_conv2d_create(32, 64, (const int64_t[]){3, 3}, &cc, &rng, &s->conv2);
        }
        if (st == WEFT_OK) {
            st = weft_param_list_extend(s->params, "0", weft_nn_conv2d_params(s->conv1));
        }
        if (st == WEFT_OK) {
            st = weft_param_list_extend(s->params, "3", weft_nn_conv2d_params(s->conv2));
        }
    } else if (st == WEFT_OK) {
        st = weft_nn_linear_create(PIPE_STAGE2_IN, 128, 1, WEFT_F32, &rng, &s->fc1);
        if (st == WEFT_OK) {
            st = weft_nn_linear_create(128, PIPE_CLASSES, 1, WEFT_F32, &rng, &s->fc2);
        }
        if (st == WEFT_OK) {
            st = weft_param_list_extend(s->params, "1", weft_nn_linear_params(s->fc1));
        }
        if (st == WEFT_OK) {
            st = weft_param_list_extend(s->params, "3", weft_nn_linear_params(s->fc2));
        }
    }
    if (st != WEFT_OK) {
        pipe_stage_free(s);
        return st;
    }
    *s_p = s;
    return WEFT_OK;
}

/* Stage 1's layers on x [m, 784] or [m, 1, 28, 28]; stage 2's on x [m, 64, 7, 7]. Called with
 * s->mu held. */
static weft_status_t stage_layers_locked(pipe_stage_t *s, weft_tensor_t *x, weft_tensor_t **y_p)
{
    const int64_t m = weft_tensor_shape(x)[0];
    weft_tensor_t *t[8] = {NULL};
    weft_status_t st;
    int i = 0;

    if (s->k == 1) {
        st =
            weft_op_reshape(x, 4, (const int64_t[]){m, 1, PIPE_IMAGE_SIDE, PIPE_IMAGE_SIDE}, &t[i]);
        if (st == WEFT_OK) {
            st = weft_nn_conv2d_forward(s->conv1, t[i], &t[i + 1]);
            i++;
        }
        if (st == WEFT_OK) {
            st = weft_op_relu(t[i], &t[i + 1]);
            i++;
        }
        if (st == WEFT_OK) {
            st = weft_op_max_pool2d(t[i], (const int64_t[]){2, 2}, NULL, NULL, &t[i + 1]);
            i++;
        }
        if (st == WEFT_OK) {
            st = weft_nn_conv2d_forward(s->conv2, t[i], &t[i + 1]);
            i++;
        }
        if (st == WEFT_OK) {
            st = weft_op_relu(t[i], &t[i + 1]);
            i++;
        }
        if (st == WEFT_OK) {
            st = weft_op_max_pool2d(t[i], (const int64_t[]){2, 2}, NULL, NULL, y_p);
        }
    } else {
        st = weft_op_flatten(x, 1, -1, &t[i]);
        if (st == WEFT_OK) {
            st = weft_nn_linear_forward(s->fc1, t[i], &t[i + 1]);
            i++;
        }
        if (st == WEFT_OK) {
            st = weft_op_relu(t[i], &t[i + 1]);
            i++;
        }
        if (st == WEFT_OK) {
            st = weft_nn_linear_forward(s->fc2, t[i], y_p);
        }
    }
    for (int j = 0; j < 8; j++) {
        weft_tensor_release(t[j]);
    }
    return st;
}

/* ------------------------------------------------------------------ the stage rank's pool */

struct pipe_task {
    struct pipe_task *next;
    pipe_task_fn_t fn;
    pipe_stage_t *s;
    weft_call_t *call;
};

static void *pool_main(void *arg)
{
    pipe_pool_t *pool = arg;

    pthread_mutex_lock(&pool->mu);
    for (;;) {
        while (pool->head == NULL && !pool->stop) {
            pthread_cond_wait(&pool->cv, &pool->mu);
        }
        if (pool->head == NULL) {
            break;
        }
        pipe_task_t *t = pool->head;
        pool->head = t->next;
        if (pool->head == NULL) {
            pool->tail = NULL;
        }
        pthread_mutex_unlock(&pool->mu);
        t->fn(pool, t->s, t->call);
        free(t);
        pthread_mutex_lock(&pool->mu);
    }
    pthread_mutex_unlock(&pool->mu);
    return NULL;
}

int pipe_pool_start(const char *prog, pipe_pool_t *pool, weft_agent_t *a)
{
    memset(pool, 0, sizeof(*pool));
    pool->a = a;
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->cv, NULL);
    for (int i = 0; i < PIPE_STAGE_THREADS; i++) {
        if (pthread_create(&pool->threads[i], NULL, pool_main, pool) != 0) {
            fprintf(stderr, "%s: cannot start the stage's threads\n", prog);
            return -1;
        }
        pool->n_threads++;
    }
    return 0;
}

void pipe_pool_stop(pipe_pool_t *pool)
{
    pthread_mutex_lock(&pool->mu);
    pool->stop = 1;
    pthread_cond_broadcast(&pool->cv);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 0; i < pool->n_threads; i++) {
        pthread_join(pool->threads[i], NULL);
    }
    pthread_cond_destroy(&pool->cv);
    pthread_mutex_destroy(&pool->mu);
}

void pipe_pool_queue(pipe_pool_t *pool, pipe_task_fn_t fn, pipe_stage_t *s, weft_call_t *call)
{
    pipe_task_t *t = calloc(1, sizeof(*t));

    if (t == NULL) {
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "stage %d: no memory for a task", s->k);
        return;
    }
    t->fn = fn;
    t->s = s;
    t->call = call;
    pthread_mutex_lock(&pool->mu);
    if (pool->tail != NULL) {
        pool->tail->next = t;
    } else {
        pool->head = t;
    }
    pool->tail = t;
    pthread_cond_signal(&pool->cv);
    pthread_mutex_unlock(&pool->mu);
}

void pipe_stage_forward_run(pipe_pool_t *pool, pipe_stage_t *s, weft_call_t *call)
{
    weft_rref_t *in = weft_value_rref(weft_call_args(call), 0); /* borrowed */
    const uint64_t ctx = weft_call_context(call);
    weft_value_t *xv = NULL;
    weft_value_t *res = NULL;
    weft_tensor_t *x;
    weft_tensor_t *y = NULL;
    uint64_t prev_ctx = 0;
    weft_status_t st;
    int prev;

    if (in == NULL) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "stage %d: forward wants an RRef", s->k);
        return;
    }
    st = weft_dist_context_enter(pool->a, ctx, &prev_ctx);
    if (st == WEFT_OK) {
        st = weft_rref_to_here(in, ex_call_time_left_ms(call), &xv);
        (void)weft_dist_context_enter(pool->a, prev_ctx, NULL);
    }
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "stage %d: to_here of its input: %s", s->k, weft_last_error());
        return;
    }
    x = weft_value_tensor(xv, 0);
    if (x == NULL || weft_tensor_dtype(x) != WEFT_F32 || weft_tensor_ndim(x) < 2 ||
        weft_tensor_shape(x)[0] < 1 ||
        weft_tensor_numel(x) !=
            weft_tensor_shape(x)[0] *
                (s->k == 1 ? PIPE_IMAGE_SIDE * PIPE_IMAGE_SIDE : PIPE_STAGE2_IN)) {
        weft_value_free(xv);
        weft_call_fail(call, WEFT_ERR_SHAPE, "stage %d: the input has the wrong shape", s->k);
        return;
    }
    prev = weft_grad_set_enabled(ctx != 0);
    pthread_mutex_lock(&s->mu);
    st = stage_layers_locked(s, x, &y);
    s->forwards++;
    s->recorded += ctx != 0;
    pthread_mutex_unlock(&s->mu);
    weft_grad_set_enabled(prev);
    weft_value_free(xv);
    if (st == WEFT_OK) {
        st = weft_value_create(&res);
    }
    if (st == WEFT_OK) {
        st = weft_value_push_tensor(res, y);
    }
    if (st != WEFT_OK) {
        weft_tensor_release(y);
        weft_value_free(res);
        weft_call_fail(call, st, "stage %d: forward: %s", s->k, weft_last_error());
        return;
    }
    /* The answer records its send function in the call's context, from any thread. */
    weft_call_reply(call, res);
}

void pipe_stage_forward(void *obj, weft_call_t *call, void *type_arg)
{
    pipe_pool_queue(type_arg, pipe_stage_forward_run, obj, call);
}

/* ------------------------------------------------------------------ the master's pipelines */

/* Sends micro-batch @p x through pipeline @p p: x_rref here, y_rref = stage 1's forward kept on
 * its rank, then stage 2's forward of y_rref, whose answer completes *f_p (timeouts 0: the
 * agent's call timeout). */
static weft_status_t micro_start(const pipe_lines_t *l, int p, weft_tensor_t *x,
                                 weft_future_t **f_p)
{
    weft_value_t *xv = NULL;
    weft_value_t *args = NULL;
    weft_rref_t *x_rref = NULL;
    weft_rref_t *y_rref = NULL;
    weft_status_t st;

    st = weft_value_create(&xv);
    if (st == WEFT_OK) {
        st = weft_value_add_tensor(xv, x);
    }
    if (st == WEFT_OK) {
        st = weft_rref_create(l->a, xv, &x_rref); /* takes xv */
    }
    if (st != WEFT_OK) {
        weft_value_free(xv);
        return st;
    }
    st = weft_value_create(&args);
    if (st == WEFT_OK) {
        st = weft_value_add_rref(args, x_rref);
    }
    if (st == WEFT_OK) {
        st = weft_rref_remote_method(l->first[p], "forward", args, 0, &y_rref);
    }
    weft_value_free(args);
    args = NULL;
    /* The call holds what it needs: the fork of x_rref keeps the value alive on this owner. */
    weft_rref_release(x_rref);
    if (st == WEFT_OK) {
        st = weft_value_create(&args);
    }
    if (st == WEFT_OK) {
        st = weft_value_add_rref(args, y_rref);
    }
    if (st == WEFT_OK) {
        st = weft_rref_rpc_async(l->second[p], "forward", args, 0, f_p);
    }
    weft_value_free(args);
    weft_rref_release(y_rref);
    return st;
}

/* Waits for micro-batch @p i of pipeline @p p (future @p *f, released and cleared) into
 * @p out_p; on a failure says so on stderr. @return 0, or -1 after the message. */
static int micro_finish(const pipe_lines_t *l, weft_future_t **f, int p, int i,
                        weft_tensor_t **out_p)
{
    weft_status_t st = weft_future_wait(*f, 0);
    weft_value_t *v = NULL;
    weft_tensor_t *z;
    char where[64];
    int rc = -1;

    if (l->named) {
        snprintf(where, sizeof(where), "pipeline %c, micro-batch %d", 'A' + p, i);
    } else {
        snprintf(where, sizeof(where), "micro-batch %d", i);
    }
    if (st != WEFT_OK) {
        fprintf(stderr, "%s: %s: %s: %s\n", l->prog, where, weft_status_name(st),
                weft_future_error(*f));
        goto out;
    }
    (void)weft_future_take_value(*f, &v);
    z = weft_value_tensor(v, 0);
    if (z == NULL || weft_tensor_ndim(z) != 2 || weft_tensor_shape(z)[1] != PIPE_CLASSES) {
        fprintf(stderr, "%s: %s: stage 2 answered the wrong shape\n", l->prog, where);
        goto out;
    }
    *out_p = weft_tensor_retain(z);
    rc = 0;

out:
    weft_value_free(v);
    weft_future_release(*f);
    *f = NULL;
    return rc;
}

int pipe_forward(const pipe_lines_t *l, weft_tensor_t *x, int splits, weft_tensor_t **out_p)
{
    const int64_t b = weft_tensor_shape(x)[0];
    const int window = splits;
    int64_t sizes[PIPE_MAX_LINES * PIPE_MAX_SPLITS];
    weft_tensor_t *parts[PIPE_MAX_LINES * PIPE_MAX_SPLITS] = {NULL};
    weft_tensor_t *outs[PIPE_MAX_LINES * PIPE_MAX_SPLITS] = {NULL};
    weft_future_t *fs[PIPE_MAX_LINES * PIPE_MAX_SPLITS] = {NULL};
    int first[PIPE_MAX_LINES] = {0}, count[PIPE_MAX_LINES] = {0};
    int started[PIPE_MAX_LINES] = {0}, done[PIPE_MAX_LINES] = {0};
    int total = 0, finished = 0;
    weft_status_t st;
    int rc = -1;

    for (int p = 0; p < l->n; p++) {
        const int64_t share = b / l->n + (p < b % l->n ? 1 : 0);
        const int n = (int64_t)splits < share ? splits : (int)share;

        first[p] = total;
        count[p] = n;
        for (int i = 0; i < n; i++) {
            sizes[total++] = share / n + (i < share % n ? 1 : 0);
        }
    }
    st = weft_op_split(x, total, sizes, 0, parts);
    if (st != WEFT_OK) {
        ex_fail(l->prog, "split", st);
        return -1;
    }
    while (finished < total) {
        int progressed = 0;
        int next = -1;

        /* Micro-batch i of A, then of B, then i + 1 of A ...: the pipelines fill together. */
        for (int p = 0; p < l->n; p++) {
            if (started[p] < count[p] && started[p] - done[p] < window) {
                const int j = first[p] + started[p];
                st = micro_start(l, p, parts[j], &fs[j]);
                if (st != WEFT_OK) {
                    ex_fail(l->prog, "micro-batch", st);
                    goto out;
                }
                started[p]++;
                progressed = 1;
            }
        }
        if (progressed) {
            continue;
        }
        /* Nothing may start: wait for the oldest micro-batch of the pipeline least far along. */
        for (int p = 0; p < l->n; p++) {
            if (done[p] < started[p] && (next < 0 || done[p] < done[next])) {
                next = p;
            }
        }
        if (micro_finish(l, &fs[first[next] + done[next]], next, done[next],
                         &outs[first[next] + done[next]]) != 0) {
            goto out;
        }
        done[next]++;
        finished++;
    }
    st = weft_op_concat(total, outs, 0, out_p);
    if (st != WEFT_OK) {
        ex_fail(l->prog, "concat", st);
        goto out;
    }
    rc = 0;

out:
    /* After a failure, the micro-batches still in flight end before their inputs go. */
    for (int i = 0; i < total; i++) {
        if (fs[i] != NULL) {
            (void)weft_future_wait(fs[i], 0);
            weft_future_release(fs[i]);
        }
        weft_tensor_release(parts[i]);
        weft_tensor_release(outs[i]);
    }
    return rc;
}

int pipe_evaluate(const pipe_lines_t *l, const mnist_set_t *test, int64_t n, int64_t batch,
                  int splits, double *acc_p)
{
    const int64_t b = batch;
    int64_t *idx = malloc((size_t)b * sizeof(*idx));
    int64_t correct = 0;
    weft_status_t st = WEFT_OK;
    int prev = weft_grad_set_enabled(0);
    int rc = -1;

    if (idx == NULL) {
        fprintf(stderr, "%s: out of memory\n", l->prog);
        goto out;
    }
    for (int64_t start = 0; start < n; start += b) {
        int64_t k = n - start < b ? n - start : b;
        weft_tensor_t *x = NULL;
        weft_tensor_t *y = NULL;
        weft_tensor_t *out = NULL;
        weft_tensor_t *pred = NULL;
        int bad = 0;

        for (int64_t i = 0; i < k; i++) {
            idx[i] = start + i;
        }
        st = mnist_batch(test, idx, k, &x, &y);
        if (st != WEFT_OK) {
            ex_fail(l->prog, "test batch", st);
            goto out;
        }
        bad = pipe_forward(l, x, splits, &out) != 0;
        if (!bad) {
            st = weft_op_argmax(out, 1, 0, &pred);
            if (st != WEFT_OK) {
                ex_fail(l->prog, "argmax", st);
                bad = 1;
            }
        }
        for (int64_t i = 0; !bad && i < k; i++) {
            correct += ((const int64_t *)weft_tensor_data(pred))[i] ==
                       ((const int64_t *)weft_tensor_data(y))[i];
        }
        weft_tensor_release(pred);
        weft_tensor_release(out);
        weft_tensor_release(x);
        weft_tensor_release(y);
        if (bad) {
            goto out;
        }
    }
    *acc_p = n > 0 ? (double)correct / (double)n : 0.0;
    rc = 0;

out:
    weft_grad_set_enabled(prev);
    free(idx);
    return rc;
}

int pipe_random_batches(const char *prog, uint64_t seed, int nb, int64_t b, weft_tensor_t **xs,
                        weft_tensor_t **ys)
{
    const int64_t xshape[4] = {b, 1, PIPE_IMAGE_SIDE, PIPE_IMAGE_SIDE};
    const int64_t yshape[1] = {b};
    weft_rng_t rng;
    weft_status_t st = WEFT_OK;

    /* Inputs N(0, 1), labels uniform in [0, 10). */
    weft_rng_init(&rng, seed, 77);
    for (int i = 0; st == WEFT_OK && i < nb; i++) {
        st = weft_tensor_create(WEFT_F32, 4, xshape, &xs[i]);
        if (st == WEFT_OK) {
            st = weft_tensor_fill_normal(xs[i], 0.0, 1.0, &rng);
        }
        if (st == WEFT_OK) {
            st = weft_tensor_create(WEFT_I64, 1, yshape, &ys[i]);
        }
        for (int64_t j = 0; st == WEFT_OK && j < b; j++) {
            ((int64_t *)weft_tensor_data(ys[i]))[j] = (int64_t)weft_rng_below(&rng, PIPE_CLASSES);
        }
    }
    if (st != WEFT_OK) {
        ex_fail(prog, "random batches", st);
        return -1;
    }
    return 0;
}
