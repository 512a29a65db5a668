/* Optimizer objects: the kernels of <weft/optim.h> applied to a parameter list's gradients. */
#include <inttypes.h>
#include <stdint.h>
#include <string.h>

#include "../core/internal.h"

#include <weft/autograd.h>
#include <weft/nn.h>
#include <weft/optim.h>

typedef enum {
    KIND_SGD,
    KIND_ADAGRAD,
    KIND_ADAM,
    KIND_ADAMW,
} kind_t;

#define MAX_STATE 3

typedef struct {
    weft_tensor_t *param; /* a reference */
    char *name;
    weft_tensor_t *state[MAX_STATE]; /* NULL where the rule keeps no such state */
    int64_t steps;
} slot_t;

struct weft_optimizer {
    kind_t kind;
    weft_optim_sgd_config_t sgd;
    weft_optim_adagrad_config_t adagrad;
    weft_optim_adam_config_t adam;
    int n;
    slot_t *slots;
};

static const char *kind_name(kind_t kind)
{
    switch (kind) {
    case KIND_SGD:
        return "sgd";
    case KIND_ADAGRAD:
        return "adagrad";
    case KIND_ADAM:
        return "adam";
    case KIND_ADAMW:
        return "adamw";
    }
    return "optimizer";
}

/* The state tensors of each rule, by index into slot_t.state. */
static const char *const sgd_states[MAX_STATE] = {"momentum_buffer", NULL, NULL};
static const char *const adagrad_states[MAX_STATE] = {"sum", NULL, NULL};
static const char *const adam_states[MAX_STATE] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};

static const char *const *state_names(kind_t kind)
{
    switch (kind) {
    case KIND_SGD:
        return sgd_states;
    case KIND_ADAGRAD:
        return adagrad_states;
    case KIND_ADAM:
    case KIND_ADAMW:
        break;
    }
    return adam_states;
}

/* Which state tensors this optimizer keeps. */
static int state_used(const weft_optimizer_t *opt, int k)
{
    switch (opt->kind) {
    case KIND_SGD:
        return k == 0 && opt->sgd.momentum != 0;
    case KIND_ADAGRAD:
        return k == 0;
    case KIND_ADAM:
    case KIND_ADAMW:
        return k < 2 || opt->adam.amsgrad;
    }
    return 0;
}

void weft_optimizer_free(weft_optimizer_t *opt)
{
    if (opt == NULL) {
        return;
    }
    for (int i = 0; i < opt->n; i++) {
        weft_tensor_release(opt->slots[i].param);
        weft_free(opt->slots[i].name);
        for (int k = 0; k < MAX_STATE; k++) {
            weft_tensor_release(opt->slots[i].state[k]);
        }
    }
    weft_free(opt->slots);
    weft_free(opt);
}

/* Takes the parameters of @p params and makes their state; the config is already set. */
static weft_status_t optimizer_init(weft_optimizer_t *opt, const weft_param_list_t *params)
{
    const char *fn = kind_name(opt->kind);
    int n = weft_param_list_size(params);

    for (int i = 0; i < n; i++) {
        weft_tensor_t *p = weft_param_list_get(params, i);
        weft_dtype_t dt = weft_tensor_dtype(p);

        if (dt != WEFT_F32 && dt != WEFT_F64) {
            return weft__set_error(WEFT_ERR_DTYPE, "%s: parameter '%s' is %s; needs f32 or f64", fn,
                                   weft_param_list_name(params, i), weft_dtype_name(dt));
        }
        if (weft_tensor_device(p).type != WEFT_DEVICE_CPU) {
            return weft__set_error(WEFT_ERR_UNSUPPORTED, "%s: parameter '%s' is not on the CPU", fn,
                                   weft_param_list_name(params, i));
        }
        for (int j = 0; j < i; j++) {
            if (weft_param_list_get(params, j) == p) {
                return weft__set_error(
                    WEFT_ERR_INVALID_ARG, "%s: parameter '%s' appears twice (also as '%s')", fn,
                    weft_param_list_name(params, i), weft_param_list_name(params, j));
            }
        }
    }
    if (n > 0) {
        opt->slots = weft_calloc((size_t)n, sizeof *opt->slots);
        if (opt->slots == NULL) {
            return weft__set_error(WEFT_ERR_NO_MEMORY, "%s: no memory for %d parameters", fn, n);
        }
    }
    for (int i = 0; i < n; i++) {
        slot_t *s = &opt->slots[i];
        weft_tensor_t *p = weft_param_list_get(params, i);

        s->param = weft_tensor_retain(p);
        opt->n++;
        s->name = weft_strdup(weft_param_list_name(params, i));
        if (s->name == NULL) {
            return weft__set_error(WEFT_ERR_NO_MEMORY, "%s: no memory", fn);
        }
        for (int k = 0; k < MAX_STATE; k++) {
            if (state_used(opt, k)) {
                WEFT_CHECK(weft_tensor_create(weft_tensor_dtype(p), weft_tensor_ndim(p),
                                              weft_tensor_shape(p), &s->state[k]));
            }
        }
        if (opt->kind == KIND_ADAGRAD) {
            WEFT_CHECK(weft_tensor_fill(s->state[0], opt->adagrad.initial_accumulator_value));
        }
    }
    return WEFT_OK;
}

/* Allocates an empty optimizer of @p kind (the caller copies the config in, then finishes it). */
static weft_status_t optimizer_new(kind_t kind, const weft_param_list_t *params,
                                   weft_optimizer_t **opt_p, weft_optimizer_t **opt_out)
{
    weft_optimizer_t *opt;

    if (params == NULL || opt_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: NULL parameter list or output",
                               kind_name(kind));
    }
    opt = weft_calloc(1, sizeof *opt);
    if (opt == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "%s: no memory", kind_name(kind));
    }
    opt->kind = kind;
    *opt_out = opt;
    return WEFT_OK;
}

static weft_status_t optimizer_finish(weft_optimizer_t *opt, const weft_param_list_t *params,
                                      weft_optimizer_t **opt_p)
{
    weft_status_t st = optimizer_init(opt, params);

    if (st != WEFT_OK) {
        weft_optimizer_free(opt);
        return st;
    }
    *opt_p = opt;
    return WEFT_OK;
}

weft_status_t weft_optimizer_sgd_create(const weft_param_list_t *params,
                                        const weft_optim_sgd_config_t *cfg,
                                        weft_optimizer_t **opt_p)
{
    weft_optimizer_t *opt;

    WEFT_CHECK(weft_optim_sgd_config_check(cfg));
    WEFT_CHECK(optimizer_new(KIND_SGD, params, opt_p, &opt));
    opt->sgd = *cfg;
    return optimizer_finish(opt, params, opt_p);
}

weft_status_t weft_optimizer_adagrad_create(const weft_param_list_t *params,
                                            const weft_optim_adagrad_config_t *cfg,
                                            weft_optimizer_t **opt_p)
{
    weft_optimizer_t *opt;

    WEFT_CHECK(weft_optim_adagrad_config_check(cfg));
    WEFT_CHECK(optimizer_new(KIND_ADAGRAD, params, opt_p, &opt));
    opt->adagrad = *cfg;
    return optimizer_finish(opt, params, opt_p);
}

weft_status_t weft_optimizer_adam_create(const weft_param_list_t *params,
                                         const weft_optim_adam_config_t *cfg,
                                         weft_optimizer_t **opt_p)
{
    weft_optimizer_t *opt;

    WEFT_CHECK(weft_optim_adam_config_check(cfg));
    WEFT_CHECK(optimizer_new(KIND_ADAM, params, opt_p, &opt));
    opt->adam = *cfg;
    return optimizer_finish(opt, params, opt_p);
}

weft_status_t weft_optimizer_adamw_create(const weft_param_list_t *params,
                                          const weft_optim_adam_config_t *cfg,
                                          weft_optimizer_t **opt_p)
{
    weft_optimizer_t *opt;

    WEFT_CHECK(weft_optim_adam_config_check(cfg));
    WEFT_CHECK(optimizer_new(KIND_ADAMW, params, opt_p, &opt));
    opt->adam = *cfg;
    return optimizer_finish(opt, params, opt_p);
}

/* Whether this optimizer can take a sparse gradient for slot @p s; records why not. */
static weft_status_t sparse_allowed(const weft_optimizer_t *opt, const slot_t *s)
{
    const char *fn = kind_name(opt->kind);

    switch (opt->kind) {
    case KIND_SGD:
        if (opt->sgd.momentum != 0 || opt->sgd.weight_decay != 0) {
            return weft__set_error(WEFT_ERR_UNSUPPORTED,
                                   "sgd: parameter '%s' has a sparse gradient; sparse gradients "
                                   "take no momentum and no weight decay (momentum %g, "
                                   "weight_decay %g)",
                                   s->name, opt->sgd.momentum, opt->sgd.weight_decay);
        }
        return WEFT_OK;
    case KIND_ADAGRAD:
        if (opt->adagrad.weight_decay != 0) {
            return weft__set_error(WEFT_ERR_UNSUPPORTED,
                                   "adagrad: parameter '%s' has a sparse gradient; weight_decay "
                                   "%g is not compatible with sparse gradients",
                                   s->name, opt->adagrad.weight_decay);
        }
        return WEFT_OK;
    case KIND_ADAM:
    case KIND_ADAMW:
        break;
    }
    return weft__set_error(WEFT_ERR_UNSUPPORTED,
                           "%s: parameter '%s' has a sparse gradient; %s does not support sparse "
                           "gradients",
                           fn, s->name, fn);
}

static weft_status_t apply_dense(const weft_optimizer_t *opt, slot_t *s, weft_tensor_t *grad,
                                 int64_t step)
{
    switch (opt->kind) {
    case KIND_SGD:
        return weft_optim_sgd_step(&opt->sgd, s->param, grad, s->state[0], step);
    case KIND_ADAGRAD:
        return weft_optim_adagrad_step(&opt->adagrad, s->param, grad, s->state[0], step);
    case KIND_ADAM:
        return weft_optim_adam_step(&opt->adam, s->param, grad, s->state[0], s->state[1],
                                    s->state[2], step);
    case KIND_ADAMW:
        return weft_optim_adamw_step(&opt->adam, s->param, grad, s->state[0], s->state[1],
                                     s->state[2], step);
    }
    return WEFT_ERR_INVALID_STATE;
}

static weft_status_t apply_sparse(const weft_optimizer_t *opt, slot_t *s, weft_tensor_t *idx,
                                  weft_tensor_t *rows, int64_t step)
{
    if (opt->kind == KIND_SGD) {
        return weft_optim_sgd_sparse_step(&opt->sgd, s->param, idx, rows);
    }
    return weft_optim_adagrad_sparse_step(&opt->adagrad, s->param, idx, rows, s->state[0], step);
}

/*
 * What the kernels would refuse, checked for one parameter before any is updated, so that a
 * failing step changes nothing: the gradient's dtype, shape and storage; sparse indices in range.
 */
static weft_status_t precheck(const weft_optimizer_t *opt, const slot_t *s, int sparse)
{
    const char *fn = kind_name(opt->kind);
    weft_tensor_t *p = s->param;
    weft_tensor_t *g = weft_tensor_grad(p);
    weft_tensor_t *idx = NULL;
    weft_tensor_t *rows = NULL;

    if (!sparse) {
        if (g == NULL) {
            return WEFT_OK;
        }
        if (weft_tensor_dtype(g) != weft_tensor_dtype(p)) {
            return weft__set_error(WEFT_ERR_DTYPE, "%s: parameter '%s' is %s, its gradient %s", fn,
                                   s->name, weft_dtype_name(weft_tensor_dtype(p)),
                                   weft_dtype_name(weft_tensor_dtype(g)));
        }
        if (weft_tensor_numel(g) != weft_tensor_numel(p) ||
            weft_tensor_ndim(g) != weft_tensor_ndim(p) ||
            memcmp(weft_tensor_shape(g), weft_tensor_shape(p),
                   (size_t)weft_tensor_ndim(p) * sizeof(int64_t)) != 0) {
            return weft__set_error(WEFT_ERR_SHAPE,
                                   "%s: the gradient of parameter '%s' has another shape", fn,
                                   s->name);
        }
        if (weft_tensor_numel(p) > 0 && weft_tensor_data(g) == weft_tensor_data(p)) {
            return weft__set_error(WEFT_ERR_INVALID_ARG,
                                   "%s: parameter '%s' and its gradient share storage", fn,
                                   s->name);
        }
        return WEFT_OK;
    }
    if (weft_tensor_sparse_grad(p, &idx, &rows) != WEFT_OK) {
        return WEFT_OK;
    }
    if (weft_tensor_dtype(idx) != WEFT_I64 || weft_tensor_ndim(idx) != 1 ||
        weft_tensor_dtype(rows) != weft_tensor_dtype(p) || weft_tensor_ndim(p) < 1 ||
        weft_tensor_ndim(rows) != weft_tensor_ndim(p) ||
        weft_tensor_shape(rows)[0] != weft_tensor_shape(idx)[0] ||
        memcmp(weft_tensor_shape(rows) + 1, weft_tensor_shape(p) + 1,
               (size_t)(weft_tensor_ndim(p) - 1) * sizeof(int64_t)) != 0) {
        return weft__set_error(WEFT_ERR_SHAPE,
                               "%s: the sparse gradient of parameter '%s' does not match it", fn,
                               s->name);
    }
    for (int64_t k = 0; k < weft_tensor_numel(idx); k++) {
        int64_t i = ((const int64_t *)weft_tensor_data(idx))[k];
        if (i < 0 || i >= weft_tensor_shape(p)[0]) {
            return weft__set_error(WEFT_ERR_INVALID_ARG,
                                   "%s: parameter '%s': sparse gradient index %lld at %lld is out "
                                   "of range [0, %lld)",
                                   fn, s->name, (long long)i, (long long)k,
                                   (long long)weft_tensor_shape(p)[0]);
        }
    }
    return WEFT_OK;
}

weft_status_t weft_optimizer_step(weft_optimizer_t *opt)
{
    if (opt == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "optimizer_step: NULL optimizer");
    }
    /* Check every parameter's gradient before updating any. */
    for (int i = 0; i < opt->n; i++) {
        slot_t *s = &opt->slots[i];
        int sparse = weft_tensor_has_sparse_grad(s->param);

        if (sparse && weft_tensor_grad(s->param) != NULL) {
            return weft__set_error(WEFT_ERR_UNSUPPORTED,
                                   "%s: parameter '%s' has both a dense and a sparse gradient",
                                   kind_name(opt->kind), s->name);
        }
        if (sparse) {
            WEFT_CHECK(sparse_allowed(opt, s));
        }
        WEFT_CHECK(precheck(opt, s, sparse));
    }
    for (int i = 0; i < opt->n; i++) {
        slot_t *s = &opt->slots[i];
        weft_tensor_t *grad = weft_tensor_grad(s->param);
        weft_tensor_t *idx;
        weft_tensor_t *rows;

        if (grad != NULL) {
            WEFT_CHECK(apply_dense(opt, s, grad, s->steps + 1));
        } else if (weft_tensor_has_sparse_grad(s->param) &&
                   weft_tensor_sparse_grad(s->param, &idx, &rows) == WEFT_OK) {
            WEFT_CHECK(apply_sparse(opt, s, idx, rows, s->steps + 1));
        } else {
            continue;
        }
        s->steps++;
    }
    return WEFT_OK;
}

void weft_optimizer_zero_grad(weft_optimizer_t *opt)
{
    if (opt == NULL) {
        return;
    }
    for (int i = 0; i < opt->n; i++) {
        weft_tensor_grad_clear(opt->slots[i].param);
    }
}

double weft_optimizer_lr(const weft_optimizer_t *opt)
{
    if (opt == NULL) {
        return 0.0;
    }
    switch (opt->kind) {
    case KIND_SGD:
        return opt->sgd.lr;
    case KIND_ADAGRAD:
        return opt->adagrad.lr;
    case KIND_ADAM:
    case KIND_ADAMW:
        break;
    }
    return opt->adam.lr;
}

weft_status_t weft_optimizer_set_lr(weft_optimizer_t *opt, double lr)
{
    if (opt == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "optimizer_set_lr: NULL optimizer");
    }
    if (!(lr >= 0)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: invalid lr %g (needs lr >= 0)",
                               kind_name(opt->kind), lr);
    }
    switch (opt->kind) {
    case KIND_SGD:
        opt->sgd.lr = lr;
        break;
    case KIND_ADAGRAD:
        opt->adagrad.lr = lr;
        break;
    case KIND_ADAM:
    case KIND_ADAMW:
        opt->adam.lr = lr;
        break;
    }
    return WEFT_OK;
}

int weft_optimizer_num_params(const weft_optimizer_t *opt)
{
    return opt == NULL ? 0 : opt->n;
}

int64_t weft_optimizer_param_steps(const weft_optimizer_t *opt, int i)
{
    if (opt == NULL || i < 0 || i >= opt->n) {
        return -1;
    }
    return opt->slots[i].steps;
}

weft_tensor_t *weft_optimizer_state(const weft_optimizer_t *opt, int i, const char *name)
{
    const char *const *names;

    if (opt == NULL || name == NULL || i < 0 || i >= opt->n) {
        return NULL;
    }
    names = state_names(opt->kind);
    for (int k = 0; k < MAX_STATE; k++) {
        if (names[k] != NULL && strcmp(names[k], name) == 0) {
            return opt->slots[i].state[k];
        }
    }
    return NULL;
}
