/* nn modules (Linear, MLP, Embedding, EmbeddingBag, Conv2d, BatchNorm2d, ResNet BasicBlock), named
 * parameter lists. */
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "graph.h"

#include <weft/autograd.h>
#include <weft/nn.h>
#include <weft/ops.h>

/* ---- parameter lists ------------------------------------------------------------------------- */

typedef struct {
    char *name;
    weft_tensor_t *t; /* a reference held by the list */
} param_entry_t;

struct weft_param_list {
    param_entry_t *items;
    int n;
    int cap;
};

weft_status_t weft_param_list_create(weft_param_list_t **list_p)
{
    weft_param_list_t *list;

    if (list_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "param_list: NULL output");
    }
    list = weft_calloc(1, sizeof *list);
    if (list == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "param_list: no memory");
    }
    *list_p = list;
    return WEFT_OK;
}

void weft_param_list_free(weft_param_list_t *list)
{
    if (list == NULL) {
        return;
    }
    for (int i = 0; i < list->n; i++) {
        weft_free(list->items[i].name);
        weft_tensor_release(list->items[i].t);
    }
    weft_free(list->items);
    weft_free(list);
}

static weft_status_t reserve(weft_param_list_t *list, int more)
{
    param_entry_t *items;
    int cap;

    if (list->n + more <= list->cap) {
        return WEFT_OK;
    }
    cap = list->cap == 0 ? 8 : list->cap;
    while (cap < list->n + more) {
        cap *= 2;
    }
    items = weft_realloc(list->items, (size_t)cap * sizeof *items);
    if (items == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "param_list: no memory for %d parameters", cap);
    }
    list->items = items;
    list->cap = cap;
    return WEFT_OK;
}

weft_tensor_t *weft_param_list_find(const weft_param_list_t *list, const char *name)
{
    if (list == NULL || name == NULL) {
        return NULL;
    }
    for (int i = 0; i < list->n; i++) {
        if (strcmp(list->items[i].name, name) == 0) {
            return list->items[i].t;
        }
    }
    return NULL;
}

/* Appends with a name already made (takes ownership of @p name on success). */
static weft_status_t add_owned(weft_param_list_t *list, char *name, weft_tensor_t *param)
{
    if (weft_param_list_find(list, name) != NULL) {
        return weft__set_error(WEFT_ERR_ALREADY_EXISTS, "param_list: '%s' is already in the list",
                               name);
    }
    WEFT_CHECK(reserve(list, 1));
    list->items[list->n].name = name;
    list->items[list->n].t = weft_tensor_retain(param);
    list->n++;
    return WEFT_OK;
}

weft_status_t weft_param_list_add(weft_param_list_t *list, const char *name, weft_tensor_t *param)
{
    weft_status_t st;
    char *copy;

    if (list == NULL || name == NULL || param == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "param_list_add: NULL argument");
    }
    copy = weft_strdup(name);
    if (copy == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "param_list_add: no memory");
    }
    st = add_owned(list, copy, param);
    if (st != WEFT_OK) {
        weft_free(copy);
    }
    return st;
}

weft_status_t weft_param_list_extend(weft_param_list_t *list, const char *prefix,
                                     const weft_param_list_t *other)
{
    weft_status_t st = WEFT_OK;
    int n0;

    if (list == NULL || other == NULL || list == other) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "param_list_extend: NULL or the same list");
    }
    n0 = list->n;
    WEFT_CHECK(reserve(list, other->n));
    for (int i = 0; i < other->n; i++) {
        const char *name = other->items[i].name;
        char *full = prefix != NULL && prefix[0] != '\0' ? weft__strfmt("%s.%s", prefix, name)
                                                         : weft_strdup(name);

        if (full == NULL) {
            st = weft__set_error(WEFT_ERR_NO_MEMORY, "param_list_extend: no memory");
            goto err_undo;
        }
        st = add_owned(list, full, other->items[i].t);
        if (st != WEFT_OK) {
            weft_free(full);
            goto err_undo;
        }
    }
    return WEFT_OK;

err_undo:
    while (list->n > n0) {
        list->n--;
        weft_free(list->items[list->n].name);
        weft_tensor_release(list->items[list->n].t);
    }
    return st;
}

int weft_param_list_size(const weft_param_list_t *list)
{
    return list == NULL ? 0 : list->n;
}

weft_tensor_t *weft_param_list_get(const weft_param_list_t *list, int i)
{
    if (list == NULL || i < 0 || i >= list->n) {
        return NULL;
    }
    return list->items[i].t;
}

const char *weft_param_list_name(const weft_param_list_t *list, int i)
{
    if (list == NULL || i < 0 || i >= list->n) {
        return NULL;
    }
    return list->items[i].name;
}

int64_t weft_param_list_numel(const weft_param_list_t *list)
{
    int64_t n = 0;

    for (int i = 0; i < weft_param_list_size(list); i++) {
        n += weft_tensor_numel(list->items[i].t);
    }
    return n;
}

void weft_param_list_zero_grad(const weft_param_list_t *list)
{
    for (int i = 0; i < weft_param_list_size(list); i++) {
        weft_tensor_grad_clear(list->items[i].t);
    }
}

/* The parameters share one float dtype, and @p flat is a 1-D CPU tensor of it and their count. */
static weft_status_t flat_check(const char *fn, const weft_param_list_t *list,
                                const weft_tensor_t *flat)
{
    weft_dtype_t dt;
    int64_t numel;

    if (list == NULL || flat == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: NULL argument", fn);
    }
    dt = weft_tensor_dtype(flat);
    if (dt != WEFT_F32 && dt != WEFT_F64) {
        return weft__set_error(WEFT_ERR_DTYPE, "%s: the flat tensor is %s; needs f32 or f64", fn,
                               weft_dtype_name(dt));
    }
    if (weft_tensor_device(flat).type != WEFT_DEVICE_CPU) {
        return weft__set_error(WEFT_ERR_UNSUPPORTED, "%s: only CPU tensors", fn);
    }
    for (int i = 0; i < list->n; i++) {
        weft_tensor_t *p = list->items[i].t;

        if (weft_tensor_dtype(p) != dt) {
            return weft__set_error(WEFT_ERR_DTYPE, "%s: '%s' is %s, the flat tensor %s", fn,
                                   list->items[i].name, weft_dtype_name(weft_tensor_dtype(p)),
                                   weft_dtype_name(dt));
        }
        if (weft_tensor_device(p).type != WEFT_DEVICE_CPU) {
            return weft__set_error(WEFT_ERR_UNSUPPORTED, "%s: '%s' is not a CPU tensor", fn,
                                   list->items[i].name);
        }
    }
    numel = weft_param_list_numel(list);
    if (weft_tensor_ndim(flat) != 1 || weft_tensor_shape(flat)[0] != numel) {
        return weft__set_error(WEFT_ERR_SHAPE,
                               "%s: the flat tensor needs shape [%" PRId64 "] (one dim, %d "
                               "parameters)",
                               fn, numel, list->n);
    }
    return WEFT_OK;
}

weft_status_t weft_param_list_pack(const weft_param_list_t *list, weft_tensor_t *flat)
{
    char *dst;

    WEFT_CHECK(flat_check("param_list_pack", list, flat));
    dst = weft_tensor_data(flat);
    for (int i = 0; i < list->n; i++) {
        size_t nb = weft_tensor_nbytes(list->items[i].t);

        if (nb > 0) {
            memcpy(dst, weft_tensor_data(list->items[i].t), nb);
        }
        dst += nb;
    }
    return WEFT_OK;
}

weft_status_t weft_param_list_unpack(const weft_param_list_t *list, const weft_tensor_t *flat)
{
    const char *src;

    WEFT_CHECK(flat_check("param_list_unpack", list, flat));
    src = weft_tensor_data(flat);
    for (int i = 0; i < list->n; i++) {
        size_t nb = weft_tensor_nbytes(list->items[i].t);

        if (nb > 0) {
            memcpy(weft_tensor_data(list->items[i].t), src, nb);
        }
        src += nb;
    }
    return WEFT_OK;
}

static int has_sparse_grad(const weft_tensor_t *t, weft_tensor_t **idx_p, weft_tensor_t **rows_p)
{
    return weft_tensor_has_sparse_grad(t) && weft_tensor_sparse_grad(t, idx_p, rows_p) == WEFT_OK;
}

/* A sparse gradient that fits its parameter: i64 indices in range, rows of its row size. */
static weft_status_t sparse_check(const char *fn, const char *name, const weft_tensor_t *p,
                                  const weft_tensor_t *idx, const weft_tensor_t *rows, int64_t *d_p)
{
    int64_t nrows = weft_tensor_ndim(p) > 0 ? weft_tensor_shape(p)[0] : 0;
    int64_t nnz = weft_tensor_numel(idx);
    int64_t d = nrows > 0 ? weft_tensor_numel(p) / nrows : 0;
    const int64_t *ix = weft_tensor_data(idx);

    if (weft_tensor_dtype(idx) != WEFT_I64 || weft_tensor_dtype(rows) != weft_tensor_dtype(p) ||
        weft_tensor_numel(rows) != nnz * d) {
        return weft__set_error(WEFT_ERR_INVALID_STATE,
                               "%s: the sparse gradient of '%s' is malformed", fn, name);
    }
    for (int64_t k = 0; k < nnz; k++) {
        if (ix[k] < 0 || ix[k] >= nrows) {
            return weft__set_error(WEFT_ERR_INVALID_STATE,
                                   "%s: the sparse gradient of '%s' names row %" PRId64
                                   " of %" PRId64,
                                   fn, name, ix[k], nrows);
        }
    }
    *d_p = d;
    return WEFT_OK;
}

weft_status_t weft_param_list_pack_grads(const weft_param_list_t *list, weft_tensor_t *flat)
{
    static const char fn[] = "param_list_pack_grads";
    char *dst;

    WEFT_CHECK(flat_check(fn, list, flat));
    for (int i = 0; i < list->n; i++) {
        weft_tensor_t *idx;
        weft_tensor_t *rows;
        int64_t d;

        if (has_sparse_grad(list->items[i].t, &idx, &rows)) {
            WEFT_CHECK(sparse_check(fn, list->items[i].name, list->items[i].t, idx, rows, &d));
        }
    }
    dst = weft_tensor_data(flat);
    for (int i = 0; i < list->n; i++) {
        weft_tensor_t *p = list->items[i].t;
        weft_tensor_t *g = weft_tensor_grad(p);
        size_t nb = weft_tensor_nbytes(p);
        weft_tensor_t *idx;
        weft_tensor_t *rows;

        if (nb == 0) {
            continue;
        }
        if (g != NULL) {
            memcpy(dst, weft_tensor_data(g), nb);
        } else {
            memset(dst, 0, nb);
        }
        if (has_sparse_grad(p, &idx, &rows)) {
            weft__op_scatter_add_rows(weft_tensor_dtype(rows), dst, weft_tensor_data(rows),
                                      weft_tensor_data(idx), weft_tensor_numel(idx),
                                      weft_tensor_numel(p) / weft_tensor_shape(p)[0]);
        }
        dst += nb;
    }
    return WEFT_OK;
}

weft_status_t weft_param_list_unpack_grads(const weft_param_list_t *list, const weft_tensor_t *flat)
{
    const char *src;

    WEFT_CHECK(flat_check("param_list_unpack_grads", list, flat));
    src = weft_tensor_data(flat);
    for (int i = 0; i < list->n; i++) {
        weft_tensor_t *p = list->items[i].t;
        weft_tensor_t *g = weft_tensor_grad(p);
        size_t nb = weft_tensor_nbytes(p);

        if (g == NULL || has_sparse_grad(p, NULL, NULL)) {
            weft_status_t st;

            WEFT_CHECK(weft_tensor_empty(weft_tensor_dtype(p), weft_tensor_ndim(p),
                                         weft_tensor_shape(p), &g));
            if (nb > 0) {
                memcpy(weft_tensor_data(g), src, nb);
            }
            weft_tensor_grad_clear(p);
            st = weft_tensor_set_grad(p, g);
            weft_tensor_release(g);
            WEFT_CHECK(st);
        } else if (nb > 0) {
            memcpy(weft_tensor_data(g), src, nb);
        }
        src += nb;
    }
    return WEFT_OK;
}

/* ---- activations ----------------------------------------------------------------------------- */

weft_status_t weft_nn_activation(weft_nn_activation_t act, weft_tensor_t *x, weft_tensor_t **y_p)
{
    if (x == NULL || y_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "activation: NULL argument");
    }
    switch (act) {
    case WEFT_NN_ACT_NONE:
        *y_p = weft_tensor_retain(x);
        return WEFT_OK;
    case WEFT_NN_ACT_RELU:
        return weft_op_relu(x, y_p);
    case WEFT_NN_ACT_TANH:
        return weft_op_tanh(x, y_p);
    case WEFT_NN_ACT_SIGMOID:
        return weft_op_sigmoid(x, y_p);
    case WEFT_NN_ACT_GELU:
        return weft_op_gelu(x, y_p);
    }
    return weft__set_error(WEFT_ERR_INVALID_ARG, "activation: unknown activation %d", (int)act);
}

static int activation_valid(weft_nn_activation_t act)
{
    return act >= WEFT_NN_ACT_NONE && act <= WEFT_NN_ACT_GELU;
}

/* ---- parameters of modules ------------------------------------------------------------------- */

static weft_status_t module_args(const char *fn, int64_t a, int64_t b, weft_dtype_t dtype,
                                 const weft_rng_t *rng, const void *out_p)
{
    if (rng == NULL || out_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: NULL rng or output", fn);
    }
    if (a < 0 || b < 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: negative size (%" PRId64 ", %" PRId64 ")",
                               fn, a, b);
    }
    if (dtype != WEFT_F32 && dtype != WEFT_F64) {
        return weft__set_error(WEFT_ERR_DTYPE, "%s: parameters are f32 or f64, not %s", fn,
                               weft_dtype_name(dtype));
    }
    return WEFT_OK;
}

/* A zero-filled leaf parameter that requires gradients. */
static weft_status_t param_new(weft_dtype_t dtype, int ndim, const int64_t *shape,
                               weft_tensor_t **t_p)
{
    weft_tensor_t *t;
    weft_status_t st;

    WEFT_CHECK(weft_tensor_create(dtype, ndim, shape, &t));
    st = weft_tensor_set_requires_grad(t, 1);
    if (st != WEFT_OK) {
        weft_tensor_release(t);
        return st;
    }
    *t_p = t;
    return WEFT_OK;
}

/* ---- Linear ---------------------------------------------------------------------------------- */

struct weft_nn_linear {
    weft_tensor_t *weight;
    weft_tensor_t *bias; /* NULL without */
    weft_param_list_t *params;
};

weft_status_t weft_nn_linear_create(int64_t in_features, int64_t out_features, int bias,
                                    weft_dtype_t dtype, weft_rng_t *rng, weft_nn_linear_t **lin_p)
{
    weft_status_t st;
    weft_nn_linear_t *lin;
    double bound = in_features > 0 ? 1.0 / sqrt((double)in_features) : 0.0;

    WEFT_CHECK(module_args("linear", in_features, out_features, dtype, rng, lin_p));
    lin = weft_calloc(1, sizeof *lin);
    if (lin == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "linear: no memory");
    }
    WEFT_CHECK_GOTO(param_new(dtype, 2, (const int64_t[]){out_features, in_features}, &lin->weight),
                    st, err_free);
    /* torch.nn.Linear.reset_parameters: kaiming_uniform_(a=sqrt(5)), then the bias */
    WEFT_CHECK_GOTO(weft_init_kaiming_uniform(lin->weight, sqrt(5.0), rng), st, err_free);
    if (bias) {
        WEFT_CHECK_GOTO(param_new(dtype, 1, &out_features, &lin->bias), st, err_free);
        WEFT_CHECK_GOTO(weft_tensor_fill_uniform(lin->bias, -bound, bound, rng), st, err_free);
    }
    WEFT_CHECK_GOTO(weft_param_list_create(&lin->params), st, err_free);
    WEFT_CHECK_GOTO(weft_param_list_add(lin->params, "weight", lin->weight), st, err_free);
    if (bias) {
        WEFT_CHECK_GOTO(weft_param_list_add(lin->params, "bias", lin->bias), st, err_free);
    }
    *lin_p = lin;
    return WEFT_OK;

err_free:
    weft_nn_linear_free(lin);
    return st;
}

void weft_nn_linear_free(weft_nn_linear_t *lin)
{
    if (lin == NULL) {
        return;
    }
    weft_param_list_free(lin->params);
    weft_tensor_release(lin->weight);
    weft_tensor_release(lin->bias);
    weft_free(lin);
}

weft_status_t weft_nn_linear_forward(weft_nn_linear_t *lin, weft_tensor_t *x, weft_tensor_t **y_p)
{
    if (lin == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "linear_forward: NULL layer");
    }
    return weft_op_linear(x, lin->weight, lin->bias, y_p);
}

weft_tensor_t *weft_nn_linear_weight(const weft_nn_linear_t *lin)
{
    return lin == NULL ? NULL : lin->weight;
}

weft_tensor_t *weft_nn_linear_bias(const weft_nn_linear_t *lin)
{
    return lin == NULL ? NULL : lin->bias;
}

const weft_param_list_t *weft_nn_linear_params(const weft_nn_linear_t *lin)
{
    return lin == NULL ? NULL : lin->params;
}

/* ---- MLP ------------------------------------------------------------------------------------- */

struct weft_nn_mlp {
    weft_nn_mlp_config_t cfg;
    int n_layers;
    weft_nn_linear_t **layers;
    weft_param_list_t *params;
};

weft_status_t weft_nn_mlp_create(int n_sizes, const int64_t *sizes, const weft_nn_mlp_config_t *cfg,
                                 weft_rng_t *rng, weft_nn_mlp_t **mlp_p)
{
    static const weft_nn_mlp_config_t defaults = WEFT_NN_MLP_DEFAULTS;
    weft_status_t st;
    weft_nn_mlp_t *mlp;

    if (sizes == NULL || n_sizes < 2) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "mlp: needs at least 2 layer sizes, got %d",
                               sizes == NULL ? 0 : n_sizes);
    }
    if (cfg == NULL) {
        cfg = &defaults;
    }
    if (!activation_valid(cfg->activation) || !activation_valid(cfg->output_activation)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "mlp: unknown activation (%d, %d)",
                               (int)cfg->activation, (int)cfg->output_activation);
    }
    for (int i = 0; i < n_sizes; i++) {
        WEFT_CHECK(module_args("mlp", sizes[i], 0, cfg->dtype, rng, mlp_p));
    }
    mlp = weft_calloc(1, sizeof *mlp);
    if (mlp == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "mlp: no memory");
    }
    mlp->cfg = *cfg;
    mlp->layers = weft_calloc((size_t)n_sizes - 1, sizeof *mlp->layers);
    if (mlp->layers == NULL) {
        st = weft__set_error(WEFT_ERR_NO_MEMORY, "mlp: no memory");
        goto err_free;
    }
    WEFT_CHECK_GOTO(weft_param_list_create(&mlp->params), st, err_free);
    for (int i = 0; i < n_sizes - 1; i++) {
        char prefix[32];

        WEFT_CHECK_GOTO(weft_nn_linear_create(sizes[i], sizes[i + 1], cfg->bias, cfg->dtype, rng,
                                              &mlp->layers[i]),
                        st, err_free);
        mlp->n_layers++;
        snprintf(prefix, sizeof prefix, "fc%d", i + 1);
        WEFT_CHECK_GOTO(weft_param_list_extend(mlp->params, prefix, mlp->layers[i]->params), st,
                        err_free);
    }
    *mlp_p = mlp;
    return WEFT_OK;

err_free:
    weft_nn_mlp_free(mlp);
    return st;
}

void weft_nn_mlp_free(weft_nn_mlp_t *mlp)
{
    if (mlp == NULL) {
        return;
    }
    for (int i = 0; i < mlp->n_layers; i++) {
        weft_nn_linear_free(mlp->layers[i]);
    }
    weft_free(mlp->layers);
    weft_param_list_free(mlp->params);
    weft_free(mlp);
}

weft_status_t weft_nn_mlp_forward(weft_nn_mlp_t *mlp, weft_tensor_t *x, weft_tensor_t **y_p)
{
    weft_tensor_t *h;

    if (mlp == NULL || x == NULL || y_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "mlp_forward: NULL argument");
    }
    h = weft_tensor_retain(x);
    for (int i = 0; i < mlp->n_layers; i++) {
        weft_nn_activation_t act =
            i + 1 < mlp->n_layers ? mlp->cfg.activation : mlp->cfg.output_activation;
        weft_tensor_t *z;
        weft_status_t st = weft_nn_linear_forward(mlp->layers[i], h, &z);

        weft_tensor_release(h);
        if (st != WEFT_OK) {
            return st;
        }
        st = weft_nn_activation(act, z, &h);
        weft_tensor_release(z);
        if (st != WEFT_OK) {
            return st;
        }
    }
    *y_p = h;
    return WEFT_OK;
}

int weft_nn_mlp_num_layers(const weft_nn_mlp_t *mlp)
{
    return mlp == NULL ? 0 : mlp->n_layers;
}

weft_nn_linear_t *weft_nn_mlp_layer(const weft_nn_mlp_t *mlp, int i)
{
    if (mlp == NULL || i < 0 || i >= mlp->n_layers) {
        return NULL;
    }
    return mlp->layers[i];
}

const weft_param_list_t *weft_nn_mlp_params(const weft_nn_mlp_t *mlp)
{
    return mlp == NULL ? NULL : mlp->params;
}

/* ---- Embedding and EmbeddingBag -------------------------------------------------------------- */

/* A [num, dim] table initialised normal(0, 1) (torch.nn.Embedding.reset_parameters), and its
 * list. */
static weft_status_t table_new(const char *fn, int64_t num, int64_t dim, weft_dtype_t dtype,
                               weft_rng_t *rng, const void *out_p, weft_tensor_t **weight_p,
                               weft_param_list_t **params_p)
{
    weft_status_t st;
    weft_tensor_t *w;
    weft_param_list_t *params = NULL;

    WEFT_CHECK(module_args(fn, num, dim, dtype, rng, out_p));
    WEFT_CHECK(param_new(dtype, 2, (const int64_t[]){num, dim}, &w));
    WEFT_CHECK_GOTO(weft_tensor_fill_normal(w, 0.0, 1.0, rng), st, err_release);
    WEFT_CHECK_GOTO(weft_param_list_create(&params), st, err_release);
    WEFT_CHECK_GOTO(weft_param_list_add(params, "weight", w), st, err_free_list);
    *weight_p = w;
    *params_p = params;
    return WEFT_OK;

err_free_list:
    weft_param_list_free(params);
err_release:
    weft_tensor_release(w);
    return st;
}

struct weft_nn_embedding {
    weft_tensor_t *weight;
    int sparse;
    weft_param_list_t *params;
};

weft_status_t weft_nn_embedding_create(int64_t num_embeddings, int64_t dim, int sparse,
                                       weft_dtype_t dtype, weft_rng_t *rng,
                                       weft_nn_embedding_t **emb_p)
{
    weft_nn_embedding_t *emb = weft_calloc(1, sizeof *emb);
    weft_status_t st;

    if (emb == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "embedding: no memory");
    }
    st = table_new("embedding", num_embeddings, dim, dtype, rng, emb_p, &emb->weight, &emb->params);
    if (st != WEFT_OK) {
        weft_free(emb);
        return st;
    }
    emb->sparse = sparse != 0;
    *emb_p = emb;
    return WEFT_OK;
}

void weft_nn_embedding_free(weft_nn_embedding_t *emb)
{
    if (emb == NULL) {
        return;
    }
    weft_param_list_free(emb->params);
    weft_tensor_release(emb->weight);
    weft_free(emb);
}

weft_status_t weft_nn_embedding_forward(weft_nn_embedding_t *emb, weft_tensor_t *indices,
                                        weft_tensor_t **y_p)
{
    if (emb == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "embedding_forward: NULL module");
    }
    return weft_op_embedding(emb->weight, indices, emb->sparse, y_p);
}

weft_tensor_t *weft_nn_embedding_weight(const weft_nn_embedding_t *emb)
{
    return emb == NULL ? NULL : emb->weight;
}

const weft_param_list_t *weft_nn_embedding_params(const weft_nn_embedding_t *emb)
{
    return emb == NULL ? NULL : emb->params;
}

struct weft_nn_embedding_bag {
    weft_tensor_t *weight;
    weft_bag_mode_t mode;
    int sparse;
    weft_param_list_t *params;
};

weft_status_t weft_nn_embedding_bag_create(int64_t num_embeddings, int64_t dim,
                                           weft_bag_mode_t mode, int sparse, weft_dtype_t dtype,
                                           weft_rng_t *rng, weft_nn_embedding_bag_t **bag_p)
{
    weft_nn_embedding_bag_t *bag;
    weft_status_t st;

    if (mode != WEFT_BAG_SUM && mode != WEFT_BAG_MEAN) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "embedding_bag: unknown mode %d", (int)mode);
    }
    bag = weft_calloc(1, sizeof *bag);
    if (bag == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "embedding_bag: no memory");
    }
    st = table_new("embedding_bag", num_embeddings, dim, dtype, rng, bag_p, &bag->weight,
                   &bag->params);
    if (st != WEFT_OK) {
        weft_free(bag);
        return st;
    }
    bag->mode = mode;
    bag->sparse = sparse != 0;
    *bag_p = bag;
    return WEFT_OK;
}

void weft_nn_embedding_bag_free(weft_nn_embedding_bag_t *bag)
{
    if (bag == NULL) {
        return;
    }
    weft_param_list_free(bag->params);
    weft_tensor_release(bag->weight);
    weft_free(bag);
}

weft_status_t weft_nn_embedding_bag_forward(weft_nn_embedding_bag_t *bag, weft_tensor_t *indices,
                                            weft_tensor_t *offsets, weft_tensor_t **y_p)
{
    if (bag == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "embedding_bag_forward: NULL module");
    }
    return weft_op_embedding_bag(bag->weight, indices, offsets, bag->mode, bag->sparse, y_p);
}

weft_tensor_t *weft_nn_embedding_bag_weight(const weft_nn_embedding_bag_t *bag)
{
    return bag == NULL ? NULL : bag->weight;
}

const weft_param_list_t *weft_nn_embedding_bag_params(const weft_nn_embedding_bag_t *bag)
{
    return bag == NULL ? NULL : bag->params;
}

/* ---- Conv2d ---------------------------------------------------------------------------------- */

struct weft_nn_conv2d {
    weft_nn_conv2d_config_t cfg;
    weft_tensor_t *weight;
    weft_tensor_t *bias; /* NULL without */
    weft_param_list_t *params;
};

static weft_status_t conv2d_config_check(int64_t in, int64_t out, const int64_t *kernel,
                                         const weft_nn_conv2d_config_t *cfg)
{
    static const char fn[] = "conv2d";

    if (in < 1 || out < 1) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "%s: channels (%" PRId64 " in, %" PRId64 " out) must be >= 1", fn,
                               in, out);
    }
    if (kernel[0] < 1 || kernel[1] < 1) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "%s: kernel {%" PRId64 ", %" PRId64 "} must be >= 1", fn, kernel[0],
                               kernel[1]);
    }
    if (cfg->stride[0] < 1 || cfg->stride[1] < 1 || cfg->dilation[0] < 1 || cfg->dilation[1] < 1 ||
        cfg->padding[0] < 0 || cfg->padding[1] < 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "%s: stride {%" PRId64 ", %" PRId64 "} and dilation {%" PRId64
                               ", %" PRId64 "} must be >= 1, padding {%" PRId64 ", %" PRId64
                               "} >= 0",
                               fn, cfg->stride[0], cfg->stride[1], cfg->dilation[0],
                               cfg->dilation[1], cfg->padding[0], cfg->padding[1]);
    }
    if (cfg->groups < 1 || in % cfg->groups != 0 || out % cfg->groups != 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "%s: groups = %" PRId64
                               " must be >= 1 and divide the channels (%" PRId64 " in, %" PRId64
                               " out)",
                               fn, cfg->groups, in, out);
    }
    return WEFT_OK;
}

weft_status_t weft_nn_conv2d_create(int64_t in_channels, int64_t out_channels,
                                    const int64_t *kernel, const weft_nn_conv2d_config_t *cfg,
                                    weft_rng_t *rng, weft_nn_conv2d_t **conv_p)
{
    static const weft_nn_conv2d_config_t defaults = WEFT_NN_CONV2D_DEFAULTS;
    weft_nn_conv2d_t *conv;
    weft_status_t st;
    int64_t fan_in;
    double bound;

    if (kernel == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "conv2d: NULL kernel");
    }
    if (cfg == NULL) {
        cfg = &defaults;
    }
    WEFT_CHECK(module_args("conv2d", in_channels, out_channels, cfg->dtype, rng, conv_p));
    WEFT_CHECK(conv2d_config_check(in_channels, out_channels, kernel, cfg));
    conv = weft_calloc(1, sizeof *conv);
    if (conv == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "conv2d: no memory");
    }
    conv->cfg = *cfg;
    fan_in = in_channels / cfg->groups * kernel[0] * kernel[1];
    bound = 1.0 / sqrt((double)fan_in);
    WEFT_CHECK_GOTO(
        param_new(cfg->dtype, 4,
                  (const int64_t[]){out_channels, in_channels / cfg->groups, kernel[0], kernel[1]},
                  &conv->weight),
        st, err_free);
    /* torch.nn.Conv2d.reset_parameters: kaiming_uniform_(a=sqrt(5)), then the bias */
    WEFT_CHECK_GOTO(weft_init_kaiming_uniform(conv->weight, sqrt(5.0), rng), st, err_free);
    if (cfg->bias) {
        WEFT_CHECK_GOTO(param_new(cfg->dtype, 1, &out_channels, &conv->bias), st, err_free);
        WEFT_CHECK_GOTO(weft_tensor_fill_uniform(conv->bias, -bound, bound, rng), st, err_free);
    }
    WEFT_CHECK_GOTO(weft_param_list_create(&conv->params), st, err_free);
    WEFT_CHECK_GOTO(weft_param_list_add(conv->params, "weight", conv->weight), st, err_free);
    if (cfg->bias) {
        WEFT_CHECK_GOTO(weft_param_list_add(conv->params, "bias", conv->bias), st, err_free);
    }
    *conv_p = conv;
    return WEFT_OK;

err_free:
    weft_nn_conv2d_free(conv);
    return st;
}

void weft_nn_conv2d_free(weft_nn_conv2d_t *conv)
{
    if (conv == NULL) {
        return;
    }
    weft_param_list_free(conv->params);
    weft_tensor_release(conv->weight);
    weft_tensor_release(conv->bias);
    weft_free(conv);
}

weft_status_t weft_nn_conv2d_forward(weft_nn_conv2d_t *conv, weft_tensor_t *x, weft_tensor_t **y_p)
{
    if (conv == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "conv2d_forward: NULL layer");
    }
    return weft_op_conv2d(x, conv->weight, conv->bias, conv->cfg.stride, conv->cfg.padding,
                          conv->cfg.dilation, conv->cfg.groups, y_p);
}

weft_tensor_t *weft_nn_conv2d_weight(const weft_nn_conv2d_t *conv)
{
    return conv == NULL ? NULL : conv->weight;
}

weft_tensor_t *weft_nn_conv2d_bias(const weft_nn_conv2d_t *conv)
{
    return conv == NULL ? NULL : conv->bias;
}

const weft_param_list_t *weft_nn_conv2d_params(const weft_nn_conv2d_t *conv)
{
    return conv == NULL ? NULL : conv->params;
}

/* ---- BatchNorm2d ----------------------------------------------------------------------------- */

struct weft_nn_batch_norm2d {
    double eps;
    double momentum;
    int training;
    weft_tensor_t *weight;
    weft_tensor_t *bias;
    weft_tensor_t *running_mean;
    weft_tensor_t *running_var;
    weft_param_list_t *params;
    weft_param_list_t *buffers;
};

weft_status_t weft_nn_batch_norm2d_create(int64_t num_features, double eps, double momentum,
                                          weft_dtype_t dtype, weft_nn_batch_norm2d_t **bn_p)
{
    static const char fn[] = "batch_norm2d";
    weft_nn_batch_norm2d_t *bn;
    weft_status_t st;

    if (bn_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: NULL output", fn);
    }
    if (num_features < 1) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "%s: num_features = %" PRId64 " must be >= 1",
                               fn, num_features);
    }
    if (!(eps > 0) || !(momentum >= 0 && momentum <= 1)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "%s: eps = %g must be > 0 and momentum = %g in [0, 1]", fn, eps,
                               momentum);
    }
    if (dtype != WEFT_F32 && dtype != WEFT_F64) {
        return weft__set_error(WEFT_ERR_DTYPE, "%s: parameters are f32 or f64, not %s", fn,
                               weft_dtype_name(dtype));
    }
    bn = weft_calloc(1, sizeof *bn);
    if (bn == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "%s: no memory", fn);
    }
    bn->eps = eps;
    bn->momentum = momentum;
    bn->training = 1;
    WEFT_CHECK_GOTO(param_new(dtype, 1, &num_features, &bn->weight), st, err_free);
    WEFT_CHECK_GOTO(weft_tensor_fill(bn->weight, 1.0), st, err_free);
    WEFT_CHECK_GOTO(param_new(dtype, 1, &num_features, &bn->bias), st, err_free);
    WEFT_CHECK_GOTO(weft_tensor_create(dtype, 1, &num_features, &bn->running_mean), st, err_free);
    WEFT_CHECK_GOTO(weft_tensor_create(dtype, 1, &num_features, &bn->running_var), st, err_free);
    WEFT_CHECK_GOTO(weft_tensor_fill(bn->running_var, 1.0), st, err_free);
    WEFT_CHECK_GOTO(weft_param_list_create(&bn->params), st, err_free);
    WEFT_CHECK_GOTO(weft_param_list_add(bn->params, "weight", bn->weight), st, err_free);
    WEFT_CHECK_GOTO(weft_param_list_add(bn->params, "bias", bn->bias), st, err_free);
    WEFT_CHECK_GOTO(weft_param_list_create(&bn->buffers), st, err_free);
    WEFT_CHECK_GOTO(weft_param_list_add(bn->buffers, "running_mean", bn->running_mean), st,
                    err_free);
    WEFT_CHECK_GOTO(weft_param_list_add(bn->buffers, "running_var", bn->running_var), st, err_free);
    *bn_p = bn;
    return WEFT_OK;

err_free:
    weft_nn_batch_norm2d_free(bn);
    return st;
}

void weft_nn_batch_norm2d_free(weft_nn_batch_norm2d_t *bn)
{
    if (bn == NULL) {
        return;
    }
    weft_param_list_free(bn->buffers);
    weft_param_list_free(bn->params);
    weft_tensor_release(bn->weight);
    weft_tensor_release(bn->bias);
    weft_tensor_release(bn->running_mean);
    weft_tensor_release(bn->running_var);
    weft_free(bn);
}

void weft_nn_batch_norm2d_set_training(weft_nn_batch_norm2d_t *bn, int training)
{
    if (bn != NULL) {
        bn->training = training != 0;
    }
}

int weft_nn_batch_norm2d_training(const weft_nn_batch_norm2d_t *bn)
{
    return bn != NULL && bn->training;
}

weft_status_t weft_nn_batch_norm2d_forward(weft_nn_batch_norm2d_t *bn, weft_tensor_t *x,
                                           weft_tensor_t **y_p)
{
    if (bn == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "batch_norm2d_forward: NULL layer");
    }
    return weft_op_batch_norm2d(x, bn->weight, bn->bias, bn->running_mean, bn->running_var,
                                bn->training, bn->momentum, bn->eps, y_p);
}

weft_tensor_t *weft_nn_batch_norm2d_weight(const weft_nn_batch_norm2d_t *bn)
{
    return bn == NULL ? NULL : bn->weight;
}

weft_tensor_t *weft_nn_batch_norm2d_bias(const weft_nn_batch_norm2d_t *bn)
{
    return bn == NULL ? NULL : bn->bias;
}

weft_tensor_t *weft_nn_batch_norm2d_running_mean(const weft_nn_batch_norm2d_t *bn)
{
    return bn == NULL ? NULL : bn->running_mean;
}

weft_tensor_t *weft_nn_batch_norm2d_running_var(const weft_nn_batch_norm2d_t *bn)
{
    return bn == NULL ? NULL : bn->running_var;
}

const weft_param_list_t *weft_nn_batch_norm2d_params(const weft_nn_batch_norm2d_t *bn)
{
    return bn == NULL ? NULL : bn->params;
}

const weft_param_list_t *weft_nn_batch_norm2d_buffers(const weft_nn_batch_norm2d_t *bn)
{
    return bn == NULL ? NULL : bn->buffers;
}

/* ---- ResNet BasicBlock ----------------------------------------------------------------------- */

struct weft_nn_basic_block {
    int training;
    weft_nn_conv2d_t *conv1;
    weft_nn_batch_norm2d_t *bn1;
    weft_nn_conv2d_t *conv2;
    weft_nn_batch_norm2d_t *bn2;
    weft_nn_conv2d_t *down_conv; /* NULL: the identity shortcut */
    weft_nn_batch_norm2d_t *down_bn;
    weft_param_list_t *params;
    weft_param_list_t *buffers;
};

/* torchvision's conv3x3 / conv1x1: no bias, padding k / 2. */
static weft_status_t block_conv(int64_t in, int64_t out, int64_t k, int64_t stride,
                                weft_dtype_t dtype, weft_rng_t *rng, weft_nn_conv2d_t **conv_p)
{
    weft_nn_conv2d_config_t cfg = WEFT_NN_CONV2D_DEFAULTS;

    cfg.stride[0] = cfg.stride[1] = stride;
    cfg.padding[0] = cfg.padding[1] = k / 2;
    cfg.bias = 0;
    cfg.dtype = dtype;
    return weft_nn_conv2d_create(in, out, (const int64_t[]){k, k}, &cfg, rng, conv_p);
}

/* Appends a conv's and a batch norm's parameters and the batch norm's buffers under their names
 * (conv_name.weight, bn_name.weight, bn_name.bias; bn_name.running_mean, ...). */
static weft_status_t block_add(weft_nn_basic_block_t *b, const char *conv_name,
                               const weft_nn_conv2d_t *conv, const char *bn_name,
                               const weft_nn_batch_norm2d_t *bn)
{
    WEFT_CHECK(weft_param_list_extend(b->params, conv_name, conv->params));
    WEFT_CHECK(weft_param_list_extend(b->params, bn_name, bn->params));
    return weft_param_list_extend(b->buffers, bn_name, bn->buffers);
}

weft_status_t weft_nn_basic_block_create(int64_t in_channels, int64_t out_channels, int64_t stride,
                                         weft_dtype_t dtype, weft_rng_t *rng,
                                         weft_nn_basic_block_t **block_p)
{
    static const char fn[] = "basic_block";
    weft_nn_basic_block_t *b;
    weft_status_t st;

    WEFT_CHECK(module_args(fn, in_channels, out_channels, dtype, rng, block_p));
    if (in_channels < 1 || out_channels < 1 || stride < 1) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "%s: channels (%" PRId64 " in, %" PRId64 " out) and stride %" PRId64
                               " must be >= 1",
                               fn, in_channels, out_channels, stride);
    }
    b = weft_calloc(1, sizeof *b);
    if (b == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "%s: no memory", fn);
    }
    b->training = 1;
    WEFT_CHECK_GOTO(block_conv(in_channels, out_channels, 3, stride, dtype, rng, &b->conv1), st,
                    err_free);
    WEFT_CHECK_GOTO(weft_nn_batch_norm2d_create(out_channels, 1e-5, 0.1, dtype, &b->bn1), st,
                    err_free);
    WEFT_CHECK_GOTO(block_conv(out_channels, out_channels, 3, 1, dtype, rng, &b->conv2), st,
                    err_free);
    WEFT_CHECK_GOTO(weft_nn_batch_norm2d_create(out_channels, 1e-5, 0.1, dtype, &b->bn2), st,
                    err_free);
    if (stride != 1 || in_channels != out_channels) {
        WEFT_CHECK_GOTO(block_conv(in_channels, out_channels, 1, stride, dtype, rng, &b->down_conv),
                        st, err_free);
        WEFT_CHECK_GOTO(weft_nn_batch_norm2d_create(out_channels, 1e-5, 0.1, dtype, &b->down_bn),
                        st, err_free);
    }
    WEFT_CHECK_GOTO(weft_param_list_create(&b->params), st, err_free);
    WEFT_CHECK_GOTO(weft_param_list_create(&b->buffers), st, err_free);
    WEFT_CHECK_GOTO(block_add(b, "conv1", b->conv1, "bn1", b->bn1), st, err_free);
    WEFT_CHECK_GOTO(block_add(b, "conv2", b->conv2, "bn2", b->bn2), st, err_free);
    if (b->down_conv != NULL) {
        WEFT_CHECK_GOTO(block_add(b, "downsample.0", b->down_conv, "downsample.1", b->down_bn), st,
                        err_free);
    }
    *block_p = b;
    return WEFT_OK;

err_free:
    weft_nn_basic_block_free(b);
    return st;
}

void weft_nn_basic_block_free(weft_nn_basic_block_t *block)
{
    if (block == NULL) {
        return;
    }
    weft_param_list_free(block->buffers);
    weft_param_list_free(block->params);
    weft_nn_batch_norm2d_free(block->down_bn);
    weft_nn_conv2d_free(block->down_conv);
    weft_nn_batch_norm2d_free(block->bn2);
    weft_nn_conv2d_free(block->conv2);
    weft_nn_batch_norm2d_free(block->bn1);
    weft_nn_conv2d_free(block->conv1);
    weft_free(block);
}

/* bn(conv(x)) into *y_p, the intermediate released. */
static weft_status_t conv_bn(weft_nn_conv2d_t *conv, weft_nn_batch_norm2d_t *bn, weft_tensor_t *x,
                             weft_tensor_t **y_p)
{
    weft_tensor_t *h = NULL;
    weft_status_t st = weft_nn_conv2d_forward(conv, x, &h);

    if (st == WEFT_OK) {
        st = weft_nn_batch_norm2d_forward(bn, h, y_p);
    }
    weft_tensor_release(h);
    return st;
}

weft_status_t weft_nn_basic_block_forward(weft_nn_basic_block_t *block, weft_tensor_t *x,
                                          weft_tensor_t **y_p)
{
    weft_tensor_t *h = NULL;
    weft_tensor_t *r = NULL;
    weft_tensor_t *body = NULL;
    weft_tensor_t *shortcut = NULL;
    weft_tensor_t *sum = NULL;
    weft_status_t st;

    if (block == NULL || x == NULL || y_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "basic_block_forward: NULL argument");
    }
    st = conv_bn(block->conv1, block->bn1, x, &h);
    if (st == WEFT_OK) {
        st = weft_op_relu(h, &r);
    }
    if (st == WEFT_OK) {
        st = conv_bn(block->conv2, block->bn2, r, &body);
    }
    if (st == WEFT_OK) {
        if (block->down_conv != NULL) {
            st = conv_bn(block->down_conv, block->down_bn, x, &shortcut);
        } else {
            shortcut = weft_tensor_retain(x);
        }
    }
    if (st == WEFT_OK) {
        st = weft_op_add(body, shortcut, &sum);
    }
    if (st == WEFT_OK) {
        st = weft_op_relu(sum, y_p);
    }
    weft_tensor_release(sum);
    weft_tensor_release(shortcut);
    weft_tensor_release(body);
    weft_tensor_release(r);
    weft_tensor_release(h);
    return st;
}

void weft_nn_basic_block_set_training(weft_nn_basic_block_t *block, int training)
{
    if (block == NULL) {
        return;
    }
    block->training = training != 0;
    weft_nn_batch_norm2d_set_training(block->bn1, training);
    weft_nn_batch_norm2d_set_training(block->bn2, training);
    weft_nn_batch_norm2d_set_training(block->down_bn, training);
}

int weft_nn_basic_block_training(const weft_nn_basic_block_t *block)
{
    return block != NULL && block->training;
}

int weft_nn_basic_block_has_downsample(const weft_nn_basic_block_t *block)
{
    return block != NULL && block->down_conv != NULL;
}

const weft_param_list_t *weft_nn_basic_block_params(const weft_nn_basic_block_t *block)
{
    return block == NULL ? NULL : block->params;
}

const weft_param_list_t *weft_nn_basic_block_buffers(const weft_nn_basic_block_t *block)
{
    return block == NULL ? NULL : block->buffers;
}
