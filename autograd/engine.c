/*
 * The autograd engine: per-tensor metadata, graph nodes, and backward.
 *
 * Ownership: a tensor made by a recorded op holds its node (grad_fn); a node holds the nodes and
 * leaves its inputs came from, and data-only aliases of what it saved. Nothing points back up
 * the graph, so there are no cycles and releasing the last output frees the graph.
 *
 * Backward counts, for each node reachable from the roots, how many edges of the graph lead into
 * it; a node runs when all of them have delivered, later-created nodes first (as torch does, so
 * parameters' gradients complete in reverse order of use, which is what bucketed reducers want).
 * A leaf's gradients are summed per backward and accumulated once, then its hooks fire.
 *
 * A node's step (its backward, later its resume callback) may instead wait on a future
 * (weft__ag_wait): the node is parked with the future and the gradients of its outputs, and the
 * engine runs the other ready nodes. Between nodes it resumes the parked nodes whose futures have
 * completed; when nothing is ready it sleeps on their futures (weft_future_wait_any, never past
 * the earliest wait's deadline). Resuming always happens here, on the thread that called
 * backward; the engine registers no callback on a future, so whatever thread completes it only
 * wakes this one, and a future completing after a failed backward touches nothing of it. The
 * engine uses core only (futures, the clock): distributed autograd builds its send and receive
 * nodes on this in a library above rpc and rref.
 */
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "graph.h"

typedef struct {
    int id;
    weft_grad_hook_cb_t cb;
    void *arg;
} hook_t;

typedef struct {
    int requires_grad;
    weft__ag_node_t *grad_fn; /* strong; NULL for a leaf */
    int out_index;
    weft_tensor_t *grad;    /* dense gradient of a leaf */
    weft_tensor_t *sp_idx;  /* sparse gradient: indices [nnz] */
    weft_tensor_t *sp_rows; /* and rows [nnz, ...] */
    hook_t *hooks;
    int n_hooks;
    int next_hook_id;
    /* Guards grad, sp_idx, sp_rows and hooks: graphs that share a leaf may run backward on
     * different threads at once (each keeps its own per-leaf bookkeeping in its run_t). */
    pthread_mutex_t mu;
} meta_t;

static _Thread_local int grad_off;
static atomic_llong node_seq;
static atomic_ullong run_seq;

/* ---- metadata -------------------------------------------------------------------------------- */

static void meta_free(void *p)
{
    meta_t *m = p;

    if (m->grad_fn != NULL) {
        weft__ag_node_unref(m->grad_fn);
    }
    weft_tensor_release(m->grad);
    weft_tensor_release(m->sp_idx);
    weft_tensor_release(m->sp_rows);
    weft_free(m->hooks);
    pthread_mutex_destroy(&m->mu);
    weft_free(m);
}

static meta_t *meta_of(const weft_tensor_t *t)
{
    return t == NULL ? NULL : weft__tensor_ag(t);
}

static weft_status_t meta_get(weft_tensor_t *t, meta_t **m_p)
{
    meta_t *m = weft__tensor_ag(t);

    if (m == NULL) {
        m = weft_calloc(1, sizeof(*m));
        if (m == NULL) {
            return weft__set_error(WEFT_ERR_NO_MEMORY, "autograd: out of memory for metadata");
        }
        pthread_mutex_init(&m->mu, NULL);
        weft__tensor_set_ag(t, m, meta_free);
    }
    *m_p = m;
    return WEFT_OK;
}

int weft_grad_enabled(void)
{
    return !grad_off;
}

int weft_grad_set_enabled(int enabled)
{
    int prev = !grad_off;

    grad_off = !enabled;
    return prev;
}

weft_status_t weft_tensor_set_requires_grad(weft_tensor_t *t, int requires_grad)
{
    meta_t *m;

    if (t == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "requires_grad: tensor is NULL");
    }
    m = meta_of(t);
    if (m != NULL && m->grad_fn != NULL) {
        return weft__set_error(WEFT_ERR_INVALID_STATE,
                               "requires_grad: only leaves can be marked; this tensor was made by "
                               "%s (detach it first)",
                               m->grad_fn->name);
    }
    if (!requires_grad) {
        if (m != NULL) {
            m->requires_grad = 0;
        }
        return WEFT_OK;
    }
    if (!weft__op_is_float(weft_tensor_dtype(t))) {
        return weft__set_error(WEFT_ERR_DTYPE,
                               "requires_grad: only f32 and f64 tensors can require gradients "
                               "(got %s)",
                               weft_dtype_name(weft_tensor_dtype(t)));
    }
    WEFT_CHECK(meta_get(t, &m));
    m->requires_grad = 1;
    return WEFT_OK;
}

int weft_tensor_requires_grad(const weft_tensor_t *t)
{
    meta_t *m = meta_of(t);

    return m != NULL && m->requires_grad;
}

int weft_tensor_is_leaf(const weft_tensor_t *t)
{
    meta_t *m = meta_of(t);

    return m == NULL || m->grad_fn == NULL;
}

const char *weft_tensor_grad_fn_name(const weft_tensor_t *t)
{
    meta_t *m = meta_of(t);

    return m == NULL || m->grad_fn == NULL ? NULL : m->grad_fn->name;
}

weft_tensor_t *weft_tensor_grad(const weft_tensor_t *t)
{
    meta_t *m = meta_of(t);

    return m == NULL ? NULL : m->grad;
}

weft_status_t weft_tensor_sparse_grad(const weft_tensor_t *t, weft_tensor_t **indices_p,
                                      weft_tensor_t **rows_p)
{
    meta_t *m = meta_of(t);

    if (m == NULL || m->sp_idx == NULL) {
        return weft__set_error(WEFT_ERR_NOT_FOUND,
                               "sparse_grad: the tensor has no sparse gradient");
    }
    if (indices_p != NULL) {
        *indices_p = m->sp_idx;
    }
    if (rows_p != NULL) {
        *rows_p = m->sp_rows;
    }
    return WEFT_OK;
}

int weft_tensor_has_sparse_grad(const weft_tensor_t *t)
{
    meta_t *m = meta_of(t);

    return m != NULL && m->sp_idx != NULL;
}

void weft_tensor_grad_clear(weft_tensor_t *t)
{
    meta_t *m = meta_of(t);

    if (m == NULL) {
        return;
    }
    pthread_mutex_lock(&m->mu);
    weft_tensor_release(m->grad);
    weft_tensor_release(m->sp_idx);
    weft_tensor_release(m->sp_rows);
    m->grad = NULL;
    m->sp_idx = NULL;
    m->sp_rows = NULL;
    pthread_mutex_unlock(&m->mu);
}

static int same_shape(int nd_a, const int64_t *a, int nd_b, const int64_t *b)
{
    if (nd_a != nd_b) {
        return 0;
    }
    for (int i = 0; i < nd_a; i++) {
        if (a[i] != b[i]) {
            return 0;
        }
    }
    return 1;
}

static weft_status_t check_like(const char *what, const weft_tensor_t *t, const weft_tensor_t *g)
{
    if (weft_tensor_dtype(g) != weft_tensor_dtype(t)) {
        return weft__set_error(WEFT_ERR_DTYPE, "%s: gradient is %s, tensor is %s", what,
                               weft_dtype_name(weft_tensor_dtype(g)),
                               weft_dtype_name(weft_tensor_dtype(t)));
    }
    if (!same_shape(weft_tensor_ndim(g), weft_tensor_shape(g), weft_tensor_ndim(t),
                    weft_tensor_shape(t))) {
        return weft__set_error(WEFT_ERR_SHAPE, "%s: gradient has shape %s, tensor has shape %s",
                               what, weft__tensor_shape_str(g).s, weft__tensor_shape_str(t).s);
    }
    return WEFT_OK;
}

weft_status_t weft_tensor_set_grad(weft_tensor_t *t, weft_tensor_t *grad)
{
    meta_t *m;

    if (t == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "set_grad: tensor is NULL");
    }
    if (grad != NULL) {
        WEFT_CHECK(check_like("set_grad", t, grad));
    }
    if (meta_of(t) != NULL && meta_of(t)->grad_fn != NULL) {
        return weft__set_error(WEFT_ERR_INVALID_STATE,
                               "set_grad: only leaves hold gradients; this tensor was made by %s",
                               meta_of(t)->grad_fn->name);
    }
    if (grad == NULL && meta_of(t) == NULL) {
        return WEFT_OK;
    }
    WEFT_CHECK(meta_get(t, &m));
    weft_tensor_retain(grad);
    pthread_mutex_lock(&m->mu);
    weft_tensor_release(m->grad);
    m->grad = grad;
    pthread_mutex_unlock(&m->mu);
    return WEFT_OK;
}

weft_status_t weft_tensor_detach(weft_tensor_t *t, weft_tensor_t **out_p)
{
    if (t == NULL || out_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "detach: NULL argument");
    }
    return weft_tensor_view(t, weft_tensor_ndim(t), weft_tensor_shape(t), out_p);
}

weft_status_t weft_tensor_add_grad_hook(weft_tensor_t *param, weft_grad_hook_cb_t cb, void *arg,
                                        int *id_p)
{
    meta_t *m = meta_of(param);
    hook_t *hooks;

    if (param == NULL || cb == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "add_grad_hook: NULL argument");
    }
    if (m == NULL || !m->requires_grad || m->grad_fn != NULL) {
        return weft__set_error(WEFT_ERR_INVALID_STATE,
                               "add_grad_hook: hooks go on leaves that require gradients");
    }
    pthread_mutex_lock(&m->mu);
    hooks = weft_realloc(m->hooks, (size_t)(m->n_hooks + 1) * sizeof(*hooks));
    if (hooks == NULL) {
        pthread_mutex_unlock(&m->mu);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "add_grad_hook: out of memory");
    }
    m->hooks = hooks;
    m->hooks[m->n_hooks].id = ++m->next_hook_id;
    m->hooks[m->n_hooks].cb = cb;
    m->hooks[m->n_hooks].arg = arg;
    m->n_hooks++;
    if (id_p != NULL) {
        *id_p = m->next_hook_id;
    }
    pthread_mutex_unlock(&m->mu);
    return WEFT_OK;
}

weft_status_t weft_tensor_remove_grad_hook(weft_tensor_t *param, int id)
{
    meta_t *m = meta_of(param);

    if (m == NULL) {
        return weft__set_error(WEFT_ERR_NOT_FOUND, "remove_grad_hook: no hook with id %d", id);
    }
    pthread_mutex_lock(&m->mu);
    for (int i = 0; i < m->n_hooks; i++) {
        if (m->hooks[i].id == id) {
            memmove(&m->hooks[i], &m->hooks[i + 1], (size_t)(m->n_hooks - 1 - i) * sizeof(hook_t));
            m->n_hooks--;
            pthread_mutex_unlock(&m->mu);
            return WEFT_OK;
        }
    }
    pthread_mutex_unlock(&m->mu);
    return weft__set_error(WEFT_ERR_NOT_FOUND, "remove_grad_hook: no hook with id %d", id);
}

/* ---- nodes ----------------------------------------------------------------------------------- */

int weft__ag_should_record(int n, weft_tensor_t *const *inputs)
{
    if (grad_off) {
        return 0;
    }
    for (int i = 0; i < n; i++) {
        if (weft_tensor_requires_grad(inputs[i])) {
            return 1;
        }
    }
    return 0;
}

weft_status_t weft__ag_node_new(const char *name, weft__ag_backward_cb_t backward, int n_in,
                                weft_tensor_t *const *inputs, weft__ag_node_t **node_p)
{
    weft__ag_node_t *n;

    if (n_in < 0 || backward == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "autograd: bad node for %s", name);
    }
    n = weft_calloc(1, sizeof(*n));
    if (n == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "autograd: out of memory for a node");
    }
    n->next = n->edges_inline;
    if (n_in > WEFT__AG_MAX_IN) {
        n->next = weft_calloc((size_t)n_in, sizeof(*n->next));
        if (n->next == NULL) {
            weft_free(n);
            return weft__set_error(WEFT_ERR_NO_MEMORY, "autograd: out of memory for a node");
        }
    }
    atomic_init((_Atomic long *)&n->refs, 1);
    n->name = name;
    n->backward = backward;
    n->n_in = n_in;
    n->seq = atomic_fetch_add_explicit(&node_seq, 1, memory_order_relaxed);
    for (int i = 0; i < n_in; i++) {
        weft_tensor_t *t = inputs[i];
        meta_t *m = meta_of(t);

        if (t != NULL && i < WEFT__AG_MAX_IN) {
            n->in_ndim[i] = weft_tensor_ndim(t);
            memcpy(n->in_shape[i], weft_tensor_shape(t), sizeof(n->in_shape[i]));
            n->in_dtype[i] = weft_tensor_dtype(t);
        }
        if (m == NULL || !m->requires_grad) {
            continue;
        }
        if (m->grad_fn != NULL) {
            weft__ag_node_ref(m->grad_fn);
            n->next[i].node = m->grad_fn;
            n->next[i].out_index = m->out_index;
        } else {
            n->next[i].leaf = weft_tensor_retain(t);
        }
    }
    *node_p = n;
    return WEFT_OK;
}

weft_status_t weft__ag_save(weft__ag_node_t *n, weft_tensor_t *t)
{
    weft_tensor_t *alias = NULL;

    if (n->n_saved == WEFT__AG_MAX_SAVED) {
        return weft__set_error(WEFT_ERR_INVALID_STATE, "autograd: %s saves too many tensors",
                               n->name);
    }
    if (t != NULL && !weft__op_is_float(weft_tensor_dtype(t))) {
        /* Indices and labels are copied: backward indexes memory with them, and the caller may
         * refill its batch buffers before calling it. */
        WEFT_CHECK(weft_tensor_clone(t, &alias));
    } else if (t != NULL) {
        WEFT_CHECK(weft_tensor_view(t, weft_tensor_ndim(t), weft_tensor_shape(t), &alias));
    }
    n->saved[n->n_saved++] = alias;
    return WEFT_OK;
}

weft_status_t weft__ag_attach(weft__ag_node_t *n, int n_out, weft_tensor_t *const *outputs)
{
    if (n_out < 1) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "autograd: %s has no outputs", n->name);
    }
    if (n_out > WEFT__AG_MAX_IN) {
        size_t extra = (size_t)(n_out - WEFT__AG_MAX_IN);

        n->out_ndim_ext = weft_calloc(extra, sizeof(*n->out_ndim_ext));
        n->out_shape_ext = weft_calloc(extra, sizeof(*n->out_shape_ext));
        if (n->out_ndim_ext == NULL || n->out_shape_ext == NULL) {
            return weft__set_error(WEFT_ERR_NO_MEMORY, "autograd: out of memory for a node");
        }
    }
    for (int k = 0; k < n_out; k++) {
        meta_t *m;

        if (meta_of(outputs[k]) != NULL && meta_of(outputs[k])->grad_fn != NULL) {
            return weft__set_error(WEFT_ERR_INVALID_STATE, "autograd: output already has a node");
        }
        WEFT_CHECK(meta_get(outputs[k], &m));
        weft__ag_node_ref(n);
        m->grad_fn = n;
        m->out_index = k;
        m->requires_grad = 1;
        if (k < WEFT__AG_MAX_IN) {
            n->out_ndim[k] = weft_tensor_ndim(outputs[k]);
            memcpy(n->out_shape[k], weft_tensor_shape(outputs[k]), sizeof(n->out_shape[k]));
            n->out_dtype[k] = weft_tensor_dtype(outputs[k]);
        } else {
            n->out_ndim_ext[k - WEFT__AG_MAX_IN] = weft_tensor_ndim(outputs[k]);
            memcpy(n->out_shape_ext[k - WEFT__AG_MAX_IN], weft_tensor_shape(outputs[k]),
                   sizeof(n->out_shape_ext[0]));
        }
    }
    n->n_out = n_out;
    return WEFT_OK;
}

void weft__ag_node_ref(weft__ag_node_t *n)
{
    atomic_fetch_add_explicit((_Atomic long *)&n->refs, 1, memory_order_relaxed);
}

static void release_saved(weft__ag_node_t *n)
{
    for (int i = 0; i < n->n_saved; i++) {
        weft_tensor_release(n->saved[i]);
        n->saved[i] = NULL;
    }
    if (n->ctx != NULL && n->ctx_free != NULL) {
        n->ctx_free(n->ctx);
    }
    n->ctx = NULL;
}

void weft__ag_node_unref(weft__ag_node_t *first)
{
    /* Iterative, so that freeing a long chain does not recurse once per node. */
    weft__ag_node_t **stack = NULL;
    size_t depth = 0;
    size_t cap = 0;
    weft__ag_node_t *n = first;

    while (n != NULL) {
        if (atomic_fetch_sub_explicit((_Atomic long *)&n->refs, 1, memory_order_acq_rel) == 1) {
            release_saved(n);
            for (int i = 0; i < n->n_in; i++) {
                weft_tensor_release(n->next[i].leaf);
                if (n->next[i].node == NULL) {
                    continue;
                }
                if (depth == cap) {
                    size_t ncap = cap == 0 ? 16 : cap * 2;
                    weft__ag_node_t **s = weft_realloc(stack, ncap * sizeof(*s));

                    if (s == NULL) {
                        /* Out of memory: recurse for this one rather than leak it. */
                        weft__ag_node_unref(n->next[i].node);
                        continue;
                    }
                    stack = s;
                    cap = ncap;
                }
                stack[depth++] = n->next[i].node;
            }
            if (n->buf != NULL) {
                for (int k = 0; k < n->n_out; k++) {
                    weft_tensor_release(n->buf[k]);
                }
                weft_free(n->buf);
            }
            if (n->next != n->edges_inline) {
                weft_free(n->next);
            }
            weft_free(n->out_ndim_ext);
            weft_free(n->out_shape_ext);
            weft_free(n);
        }
        n = depth > 0 ? stack[--depth] : NULL;
    }
    weft_free(stack);
}

int weft__ag_needs_grad(const weft__ag_node_t *n, int i)
{
    return i >= 0 && i < n->n_in && (n->next[i].node != NULL || n->next[i].leaf != NULL);
}

/* ---- backward -------------------------------------------------------------------------------- */

/* A sparse gradient a running step hands over (weft__ag_grad_sparse). */
typedef struct {
    int input;
    weft_tensor_t *idx;
    weft_tensor_t *rows;
} sparse_t;

/* One step of a node (its backward, or a resume callback) as it runs: what it hands over besides
 * grad_in. On the stack of the engine's thread; cur_step points at it while the callback runs. */
typedef struct {
    weft__ag_node_t *node;
    sparse_t *items; /* weft__ag_grad_sparse */
    int n;
    int cap;
    weft_future_t *wait_f; /* weft__ag_wait: strong reference, or NULL */
    weft__ag_resume_cb_t resume;
    void *resume_arg;
} step_t;

static _Thread_local step_t *cur_step;

weft_status_t weft__ag_grad_sparse(weft__ag_node_t *n, int i, weft_tensor_t *indices,
                                   weft_tensor_t *rows)
{
    step_t *l = cur_step;

    if (l == NULL || l->node != n || i < 0 || i >= n->n_in) {
        return weft__set_error(WEFT_ERR_INVALID_STATE,
                               "autograd: sparse gradient outside the backward of its node");
    }
    if (weft_tensor_dtype(indices) != WEFT_I64 || weft_tensor_ndim(indices) != 1 ||
        weft_tensor_ndim(rows) < 1 || weft_tensor_shape(rows)[0] != weft_tensor_shape(indices)[0]) {
        return weft__set_error(WEFT_ERR_SHAPE,
                               "autograd: a sparse gradient needs i64 indices [nnz] and rows "
                               "[nnz, ...]");
    }
    if (l->n == l->cap) {
        int ncap = l->cap == 0 ? 4 : l->cap * 2;
        sparse_t *s = weft_realloc(l->items, (size_t)ncap * sizeof(*s));

        if (s == NULL) {
            return weft__set_error(WEFT_ERR_NO_MEMORY, "autograd: out of memory");
        }
        l->items = s;
        l->cap = ncap;
    }
    l->items[l->n].input = i;
    l->items[l->n].idx = weft_tensor_retain(indices);
    l->items[l->n].rows = weft_tensor_retain(rows);
    l->n++;
    return WEFT_OK;
}

weft_status_t weft__ag_wait(weft__ag_node_t *n, weft_future_t *f, weft__ag_resume_cb_t resume,
                            void *arg)
{
    step_t *l = cur_step;

    if (n == NULL || f == NULL || resume == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "autograd: wait needs a node, a future and a "
                                                     "resume callback");
    }
    if (l == NULL || l->node != n) {
        return weft__set_error(WEFT_ERR_INVALID_STATE,
                               "autograd: %s waits outside its backward or resume callback",
                               n->name);
    }
    if (l->wait_f != NULL) {
        return weft__set_error(WEFT_ERR_INVALID_STATE,
                               "autograd: %s waits twice in one step (wait again from resume)",
                               n->name);
    }
    l->wait_f = weft_future_retain(f);
    l->resume = resume;
    l->resume_arg = arg;
    return WEFT__AG_WAITING;
}

/* Adds @p g (a new reference, consumed) into *slot (summing in place when it may). */
static weft_status_t accumulate(weft_tensor_t **slot, weft_tensor_t *g)
{
    weft_tensor_t *sum = NULL;
    weft_status_t status;

    if (*slot == NULL) {
        *slot = g;
        return WEFT_OK;
    }
    if (weft__tensor_exclusive(*slot)) {
        status = weft__op_add_inplace(*slot, g);
        weft_tensor_release(g);
        return status;
    }
    if (weft__tensor_exclusive(g)) {
        status = weft__op_add_inplace(g, *slot);
        if (status != WEFT_OK) {
            weft_tensor_release(g);
            return status;
        }
        weft_tensor_release(*slot);
        *slot = g;
        return WEFT_OK;
    }
    status = weft__op_add_same(*slot, g, &sum);
    weft_tensor_release(g);
    if (status != WEFT_OK) {
        return status;
    }
    weft_tensor_release(*slot);
    *slot = sum;
    return WEFT_OK;
}

/* Scatter-adds sparse rows into a dense zero tensor of (ndim, shape). */
static weft_status_t densify(const sparse_t *s, weft_dtype_t dt, int ndim, const int64_t *shape,
                             weft_tensor_t **out_p)
{
    weft_tensor_t *d = NULL;
    int64_t rows;
    int64_t width;
    const int64_t *idx;

    if (ndim < 1 || weft_tensor_dtype(s->rows) != dt ||
        weft_tensor_numel(s->rows) !=
            weft_tensor_shape(s->idx)[0] *
                (shape[0] == 0 ? 0 : weft_shape_numel(ndim, shape) / shape[0])) {
        return weft__set_error(WEFT_ERR_SHAPE, "autograd: sparse rows do not match the input");
    }
    WEFT_CHECK(weft__op_zeros(dt, ndim, shape, &d));
    rows = weft_tensor_shape(s->idx)[0];
    width = shape[0] == 0 ? 0 : weft_tensor_numel(d) / shape[0];
    idx = weft_tensor_data(s->idx);
    for (int64_t r = 0; r < rows; r++) {
        if (idx[r] < 0 || idx[r] >= shape[0]) {
            weft_tensor_release(d);
            return weft__set_error(WEFT_ERR_INVALID_ARG, "autograd: sparse index %lld out of range",
                                   (long long)idx[r]);
        }
    }
    weft__op_scatter_add_rows(dt, weft_tensor_data(d), weft_tensor_data(s->rows), idx, rows, width);
    *out_p = d;
    return WEFT_OK;
}

/* Appends rows to a leaf's sparse gradient. */
static weft_status_t sparse_append(weft_tensor_t *leaf, meta_t *m, const sparse_t *s)
{
    weft_tensor_t *idx = NULL;
    weft_tensor_t *rows = NULL;
    int64_t shape[WEFT_MAX_DIMS];
    int64_t n0;
    int64_t n1 = weft_tensor_shape(s->idx)[0];
    size_t row_bytes;
    weft_status_t status;

    if (weft_tensor_dtype(s->rows) != weft_tensor_dtype(leaf) ||
        weft_tensor_ndim(s->rows) != weft_tensor_ndim(leaf)) {
        return weft__set_error(WEFT_ERR_SHAPE, "autograd: sparse rows do not match the leaf");
    }
    if (m->sp_idx == NULL) {
        /* Private copies unless nothing else can see them: the rows may be a view of the
         * gradient the caller passed to backward, the indices of the caller's batch. */
        if (weft__tensor_exclusive(s->idx)) {
            idx = weft_tensor_retain(s->idx);
        } else {
            WEFT_CHECK(weft_tensor_clone(s->idx, &idx));
        }
        if (weft__tensor_exclusive(s->rows)) {
            rows = weft_tensor_retain(s->rows);
        } else if ((status = weft_tensor_clone(s->rows, &rows)) != WEFT_OK) {
            weft_tensor_release(idx);
            return status;
        }
        m->sp_idx = idx;
        m->sp_rows = rows;
        return WEFT_OK;
    }
    n0 = weft_tensor_shape(m->sp_idx)[0];
    row_bytes = n1 == 0 ? 0 : weft_tensor_nbytes(s->rows) / (size_t)n1;
    if (n0 > 0) {
        row_bytes = weft_tensor_nbytes(m->sp_rows) / (size_t)n0;
    }
    shape[0] = n0 + n1;
    WEFT_CHECK(weft_tensor_empty(WEFT_I64, 1, shape, &idx));
    memcpy(shape + 1, weft_tensor_shape(s->rows) + 1,
           (size_t)(weft_tensor_ndim(s->rows) - 1) * sizeof(int64_t));
    WEFT_CHECK_GOTO(
        weft_tensor_empty(weft_tensor_dtype(leaf), weft_tensor_ndim(s->rows), shape, &rows), status,
        err_free_idx);
    memcpy(weft_tensor_data(idx), weft_tensor_data(m->sp_idx), (size_t)n0 * sizeof(int64_t));
    memcpy((int64_t *)weft_tensor_data(idx) + n0, weft_tensor_data(s->idx),
           (size_t)n1 * sizeof(int64_t));
    memcpy(weft_tensor_data(rows), weft_tensor_data(m->sp_rows), (size_t)n0 * row_bytes);
    memcpy((char *)weft_tensor_data(rows) + (size_t)n0 * row_bytes, weft_tensor_data(s->rows),
           (size_t)n1 * row_bytes);
    weft_tensor_release(m->sp_idx);
    weft_tensor_release(m->sp_rows);
    m->sp_idx = idx;
    m->sp_rows = rows;
    return WEFT_OK;

err_free_idx:
    weft_tensor_release(idx);
    return status;
}

/* One leaf's part in one backward: edges still to deliver and the gradient summed so far. */
typedef struct {
    weft_tensor_t *leaf; /* borrowed from the edges */
    int pending;
    weft_tensor_t *grad;
} leaf_state_t;

/* A node whose step waits on a future: what resuming it needs, and until when it may wait. */
typedef struct {
    weft__ag_node_t *node;
    weft_future_t *f; /* strong */
    weft__ag_resume_cb_t resume;
    void *arg;
    weft_tensor_t **gout; /* node->n_out gradients its backward got (owned), for the resume */
    int64_t deadline_ns;
} wait_t;

typedef struct {
    uint64_t run;
    int retain;
    weft__ag_node_t **nodes; /* every node of the graph, for cleanup */
    size_t n_nodes;
    size_t cap_nodes;
    weft__ag_node_t **heap; /* ready nodes, max-heap by seq */
    size_t n_heap;
    leaf_state_t *leaves; /* every leaf of the graph, with this backward's bookkeeping */
    size_t n_leaves;
    size_t cap_leaves;
    size_t *slots; /* open-addressing index into leaves (entry + 1; 0 = empty) */
    size_t n_slots;
    /* Nodes waiting on a future (weft__ag_wait), in the order they began to wait; wait_futs[i] is
     * waits[i].f, laid out for weft_future_wait_any. Empty unless some node waits. */
    wait_t *waits;
    weft_future_t **wait_futs;
    size_t n_waits;
    size_t cap_waits;
    int64_t wait_ns; /* how long one wait may last */
    const weft_backward_opts_t *o; /* leaf_fn, leaf_also_grad */
} run_t;

static weft_status_t push_ptr(void ***arr, size_t *n, size_t *cap, void *p)
{
    if (*n == *cap) {
        size_t ncap = *cap == 0 ? 32 : *cap * 2;
        void **a = weft_realloc(*arr, ncap * sizeof(void *));

        if (a == NULL) {
            return weft__set_error(WEFT_ERR_NO_MEMORY, "backward: out of memory");
        }
        *arr = a;
        *cap = ncap;
    }
    (*arr)[(*n)++] = p;
    return WEFT_OK;
}

static void heap_push(run_t *r, weft__ag_node_t *n)
{
    size_t i = r->n_heap++;

    r->heap[i] = n;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (r->heap[p]->seq >= r->heap[i]->seq) {
            break;
        }
        weft__ag_node_t *t = r->heap[p];
        r->heap[p] = r->heap[i];
        r->heap[i] = t;
        i = p;
    }
}

static weft__ag_node_t *heap_pop(run_t *r)
{
    weft__ag_node_t *top = r->heap[0];
    size_t i = 0;

    r->heap[0] = r->heap[--r->n_heap];
    for (;;) {
        size_t l = 2 * i + 1;
        size_t best = i;
        if (l < r->n_heap && r->heap[l]->seq > r->heap[best]->seq) {
            best = l;
        }
        if (l + 1 < r->n_heap && r->heap[l + 1]->seq > r->heap[best]->seq) {
            best = l + 1;
        }
        if (best == i) {
            break;
        }
        weft__ag_node_t *t = r->heap[best];
        r->heap[best] = r->heap[i];
        r->heap[i] = t;
        i = best;
    }
    return top;
}

static size_t slot_of(const void *p, size_t n_slots)
{
    uint64_t h = (uint64_t)(uintptr_t)p * 0x9e3779b97f4a7c15ULL;

    return (size_t)(h >> 20) & (n_slots - 1);
}

/* The bookkeeping of @p leaf in this backward, NULL if it has none. */
static leaf_state_t *leaf_state(const run_t *r, const weft_tensor_t *leaf)
{
    if (r->n_slots == 0) {
        return NULL;
    }
    for (size_t i = slot_of(leaf, r->n_slots);; i = (i + 1) & (r->n_slots - 1)) {
        if (r->slots[i] == 0) {
            return NULL;
        }
        if (r->leaves[r->slots[i] - 1].leaf == leaf) {
            return &r->leaves[r->slots[i] - 1];
        }
    }
}

static weft_status_t leaf_index_grow(run_t *r)
{
    size_t n = r->n_slots == 0 ? 64 : r->n_slots * 2;
    size_t *slots = weft_calloc(n, sizeof(*slots));

    if (slots == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "backward: out of memory");
    }
    for (size_t e = 0; e < r->n_leaves; e++) {
        size_t i = slot_of(r->leaves[e].leaf, n);
        while (slots[i] != 0) {
            i = (i + 1) & (n - 1);
        }
        slots[i] = e + 1;
    }
    weft_free(r->slots);
    r->slots = slots;
    r->n_slots = n;
    return WEFT_OK;
}

static weft_status_t visit_leaf(run_t *r, weft_tensor_t *leaf)
{
    leaf_state_t *st = leaf_state(r, leaf);

    if (st == NULL) {
        if (r->n_leaves == r->cap_leaves) {
            size_t ncap = r->cap_leaves == 0 ? 16 : r->cap_leaves * 2;
            leaf_state_t *a = weft_realloc(r->leaves, ncap * sizeof(*a));

            if (a == NULL) {
                return weft__set_error(WEFT_ERR_NO_MEMORY, "backward: out of memory");
            }
            r->leaves = a;
            r->cap_leaves = ncap;
        }
        if (2 * (r->n_leaves + 1) > r->n_slots) {
            WEFT_CHECK(leaf_index_grow(r));
        }
        st = &r->leaves[r->n_leaves];
        st->leaf = leaf;
        st->pending = 0;
        st->grad = NULL;
        {
            size_t i = slot_of(leaf, r->n_slots);
            while (r->slots[i] != 0) {
                i = (i + 1) & (r->n_slots - 1);
            }
            r->slots[i] = ++r->n_leaves;
        }
    }
    st->pending++;
    return WEFT_OK;
}

/* Finds every node and leaf reachable from the roots and counts the edges into each. */
static weft_status_t discover(run_t *r, int n_roots, weft__ag_node_t **roots)
{
    size_t scan = r->n_nodes;

    for (int i = 0; i < n_roots; i++) {
        if (roots[i] != NULL && roots[i]->run != r->run) {
            roots[i]->run = r->run;
            roots[i]->deps = 0;
            WEFT_CHECK(push_ptr((void ***)&r->nodes, &r->n_nodes, &r->cap_nodes, roots[i]));
        }
    }
    for (; scan < r->n_nodes; scan++) {
        weft__ag_node_t *n = r->nodes[scan];

        if (n->freed) {
            return weft__set_error(WEFT_ERR_INVALID_STATE,
                                   "backward: %s was freed by an earlier backward; pass "
                                   "retain_graph to go through a graph twice",
                                   n->name);
        }
        for (int i = 0; i < n->n_in; i++) {
            weft__ag_node_t *next = n->next[i].node;

            if (n->next[i].leaf != NULL) {
                WEFT_CHECK(visit_leaf(r, n->next[i].leaf));
            }
            if (next == NULL) {
                continue;
            }
            if (next->run != r->run) {
                next->run = r->run;
                next->deps = 0;
                WEFT_CHECK(push_ptr((void ***)&r->nodes, &r->n_nodes, &r->cap_nodes, next));
            }
            next->deps++;
        }
    }
    return WEFT_OK;
}

/* Zeros for an output that received no gradient. */
static weft_status_t out_zeros(weft__ag_node_t *n, int k, weft_tensor_t **out_p)
{
    if (k < WEFT__AG_MAX_IN) {
        return weft__op_zeros(n->out_dtype[k], n->out_ndim[k], n->out_shape[k], out_p);
    }
    return weft__op_zeros(n->out_dtype[0], n->out_ndim_ext[k - WEFT__AG_MAX_IN],
                          n->out_shape_ext[k - WEFT__AG_MAX_IN], out_p);
}

/* Adds this backward's gradient @p g (consumed; may be NULL) into the leaf's, then runs its hooks.
 */
static weft_status_t leaf_done(weft_tensor_t *leaf, meta_t *m, weft_tensor_t *g)
{
    hook_t hooks_inline[4];
    hook_t *hooks = hooks_inline;
    weft_tensor_t *grad;
    weft_status_t status = WEFT_OK;
    int n_hooks;

    pthread_mutex_lock(&m->mu);
    if (g != NULL && m->requires_grad) {
        if (m->grad == NULL) {
            if (!weft__tensor_exclusive(g)) {
                weft_tensor_t *c = NULL;

                status = weft_tensor_clone(g, &c);
                weft_tensor_release(g);
                g = c;
            }
            if (status == WEFT_OK) {
                m->grad = g;
                g = NULL;
            }
        } else {
            status = weft__op_add_inplace(m->grad, g);
        }
    }
    weft_tensor_release(g);
    /* Hooks run unlocked, from a snapshot: one may remove itself or add another. */
    n_hooks = m->n_hooks;
    if (status == WEFT_OK && n_hooks > (int)(sizeof(hooks_inline) / sizeof(hooks_inline[0]))) {
        hooks = weft_alloc((size_t)n_hooks * sizeof(*hooks));
        if (hooks == NULL) {
            status = weft__set_error(WEFT_ERR_NO_MEMORY, "backward: out of memory");
        }
    }
    if (status == WEFT_OK && n_hooks > 0) {
        memcpy(hooks, m->hooks, (size_t)n_hooks * sizeof(*hooks));
    }
    grad = weft_tensor_retain(m->grad);
    pthread_mutex_unlock(&m->mu);
    for (int h = 0; status == WEFT_OK && h < n_hooks; h++) {
        status = hooks[h].cb(leaf, grad, hooks[h].arg);
    }
    weft_tensor_release(grad);
    if (hooks != hooks_inline) {
        weft_free(hooks);
    }
    return status;
}

/* A leaf's gradient of this backward is complete: to the backward's leaf_fn, or into the leaf. */
static weft_status_t leaf_give(run_t *r, weft_tensor_t *leaf, weft_tensor_t *g)
{
    if (r->o->leaf_fn != NULL) {
        weft_status_t status = WEFT_OK;

        if (g != NULL) {
            status = r->o->leaf_fn(r->o->leaf_arg, leaf, g, NULL, NULL);
        }
        if (status != WEFT_OK || !r->o->leaf_also_grad) {
            weft_tensor_release(g);
            return status;
        }
    }
    return leaf_done(leaf, meta_of(leaf), g);
}

/* Delivers gradient @p g (consumed) of an input along edge @p e. */
static weft_status_t deliver(run_t *r, weft__ag_edge_t *e, weft_tensor_t *g)
{
    if (e->leaf != NULL) {
        leaf_state_t *st = leaf_state(r, e->leaf);

        if (g != NULL) {
            WEFT_CHECK(accumulate(&st->grad, g));
        }
        if (--st->pending == 0) {
            g = st->grad;
            st->grad = NULL;
            return leaf_give(r, e->leaf, g);
        }
        return WEFT_OK;
    }
    if (e->node != NULL) {
        weft__ag_node_t *next = e->node;

        if (g != NULL) {
            if (next->buf == NULL) {
                next->buf = weft_calloc((size_t)next->n_out, sizeof(*next->buf));
                if (next->buf == NULL) {
                    weft_tensor_release(g);
                    return weft__set_error(WEFT_ERR_NO_MEMORY, "backward: out of memory");
                }
            }
            WEFT_CHECK(accumulate(&next->buf[e->out_index], g));
        }
        if (--next->deps == 0) {
            heap_push(r, next);
        }
        return WEFT_OK;
    }
    weft_tensor_release(g);
    return WEFT_OK;
}

/* Releases what a wait holds (its future and the gradients kept for the resume). */
static void wait_clear(const weft__ag_node_t *n, wait_t *w)
{
    weft_future_release(w->f);
    for (int k = 0; k < n->n_out; k++) {
        weft_tensor_release(w->gout[k]);
    }
    weft_free(w->gout);
}

/* Room for one more wait. */
static weft_status_t waits_reserve(run_t *r)
{
    size_t ncap = r->cap_waits == 0 ? 4 : r->cap_waits * 2;
    wait_t *waits;
    weft_future_t **futs;

    if (r->n_waits < r->cap_waits) {
        return WEFT_OK;
    }
    waits = weft_realloc(r->waits, ncap * sizeof(*waits));
    if (waits == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "backward: out of memory");
    }
    r->waits = waits;
    futs = weft_realloc(r->wait_futs, ncap * sizeof(*futs));
    if (futs == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "backward: out of memory");
    }
    r->wait_futs = futs;
    r->cap_waits = ncap;
    return WEFT_OK;
}

/*
 * The step of @p n recorded a wait in @p st and returned @p status: checks that it returned
 * WEFT__AG_WAITING and gave no gradients, then parks the node with its future, its resume
 * callback and @p gout (moved out: each entry is set to NULL). Consumes st->wait_f.
 */
static weft_status_t park(run_t *r, weft__ag_node_t *n, step_t *st, weft_status_t status,
                          weft_tensor_t **gout, weft_tensor_t *const *gin)
{
    wait_t *w;
    int64_t now;
    int gave = st->n > 0;

    for (int i = 0; i < n->n_in && !gave; i++) {
        gave = gin[i] != NULL;
    }
    if (status == WEFT_OK) {
        status = weft__set_error(WEFT_ERR_INVALID_STATE,
                                 "backward: %s waited on a future but returned WEFT_OK; return "
                                 "what weft__ag_wait returned",
                                 n->name);
        goto err_drop_wait;
    }
    if (status != WEFT__AG_WAITING) {
        goto err_drop_wait; /* the step's own error */
    }
    if (gave) {
        status = weft__set_error(WEFT_ERR_INVALID_STATE,
                                 "backward: %s gave gradients and waited on a future; only the "
                                 "step that finishes (its last resume) gives gradients",
                                 n->name);
        goto err_drop_wait;
    }
    WEFT_CHECK_GOTO(waits_reserve(r), status, err_drop_wait);
    w = &r->waits[r->n_waits];
    w->gout = weft_calloc((size_t)n->n_out, sizeof(*w->gout));
    if (w->gout == NULL) {
        status = weft__set_error(WEFT_ERR_NO_MEMORY, "backward: out of memory");
        goto err_drop_wait;
    }
    for (int k = 0; k < n->n_out; k++) {
        w->gout[k] = gout[k];
        gout[k] = NULL;
    }
    now = weft__now_ns();
    w->node = n;
    w->f = st->wait_f;
    w->resume = st->resume;
    w->arg = st->resume_arg;
    w->deadline_ns = now > INT64_MAX - r->wait_ns ? INT64_MAX : now + r->wait_ns;
    st->wait_f = NULL;
    r->wait_futs[r->n_waits++] = w->f;
    return WEFT_OK;

err_drop_wait:
    weft_future_release(st->wait_f);
    st->wait_f = NULL;
    return status;
}

/*
 * Runs one step of @p n with the gradients of its outputs @p gout: its backward (@p w NULL) or
 * the resume callback of wait @p w. A step that finishes delivers the node's input gradients; a
 * step that waits parks the node (taking gout's entries). The caller releases what is left in
 * gout.
 */
static weft_status_t node_step(run_t *r, weft__ag_node_t *n, weft_tensor_t **gout, const wait_t *w)
{
    weft_tensor_t *gin_inline[WEFT__AG_MAX_IN] = {0};
    weft_tensor_t **gin = gin_inline;
    step_t sp = {.node = n};
    step_t *prev_sp = cur_step;
    weft_status_t status = WEFT_OK;
    int prev_mode;

    if (n->n_in > WEFT__AG_MAX_IN) {
        gin = weft_calloc((size_t)n->n_in, sizeof(*gin));
        if (gin == NULL) {
            return weft__set_error(WEFT_ERR_NO_MEMORY, "backward: out of memory");
        }
    }

    prev_mode = weft_grad_set_enabled(0);
    cur_step = &sp;
    if (w == NULL) {
        status = n->backward(n, gout, gin);
    } else {
        status = w->resume(n, w->f, w->arg, gout, gin);
    }
    cur_step = prev_sp;
    weft_grad_set_enabled(prev_mode);
    if (sp.wait_f != NULL) {
        status = park(r, n, &sp, status, gout, gin);
        goto out;
    }
    if (status != WEFT_OK) {
        if (w != NULL) {
            status =
                weft__set_error(status, "backward: resuming %s: %s", n->name, weft_last_error());
        }
        goto out;
    }
    for (int i = 0; i < n->n_in; i++) {
        if (gin[i] != NULL && !weft__ag_needs_grad(n, i)) {
            weft_tensor_release(gin[i]);
            gin[i] = NULL;
        }
        if (gin[i] != NULL && i < WEFT__AG_MAX_IN &&
            (weft_tensor_dtype(gin[i]) != n->in_dtype[i] ||
             !same_shape(weft_tensor_ndim(gin[i]), weft_tensor_shape(gin[i]), n->in_ndim[i],
                         n->in_shape[i]))) {
            status =
                weft__set_error(WEFT_ERR_SHAPE,
                                "backward: %s gave input %d a %s gradient of shape %s for a %s "
                                "input of shape %s",
                                n->name, i, weft_dtype_name(weft_tensor_dtype(gin[i])),
                                weft__tensor_shape_str(gin[i]).s, weft_dtype_name(n->in_dtype[i]),
                                weft__shape_str(n->in_ndim[i], n->in_shape[i]).s);
            goto out;
        }
    }
    /* Sparse gradients: kept sparse for a leaf, densified for a node. */
    for (int s = 0; s < sp.n; s++) {
        weft__ag_edge_t *e = &n->next[sp.items[s].input];
        int i = sp.items[s].input;

        if (e->leaf != NULL) {
            meta_t *lm = meta_of(e->leaf);

            if (r->o->leaf_fn != NULL) {
                status = r->o->leaf_fn(r->o->leaf_arg, e->leaf, NULL, sp.items[s].idx,
                                       sp.items[s].rows);
                if (status != WEFT_OK) {
                    goto out;
                }
                if (!r->o->leaf_also_grad) {
                    continue;
                }
            }
            pthread_mutex_lock(&lm->mu);
            status = sparse_append(e->leaf, lm, &sp.items[s]);
            pthread_mutex_unlock(&lm->mu);
            if (status != WEFT_OK) {
                goto out;
            }
        } else if (e->node != NULL && i < WEFT__AG_MAX_IN) {
            weft_tensor_t *d = NULL;

            WEFT_CHECK_GOTO(
                densify(&sp.items[s], n->in_dtype[i], n->in_ndim[i], n->in_shape[i], &d), status,
                out);
            if (gin[i] == NULL) {
                gin[i] = d;
            } else {
                WEFT_CHECK_GOTO(accumulate(&gin[i], d), status, out);
            }
        }
    }
    if (!r->retain) {
        if (n->n_saved > 0 || n->ctx != NULL) {
            n->freed = 1;
        }
        release_saved(n);
    }
    for (int i = 0; i < n->n_in; i++) {
        weft_tensor_t *g = gin[i];

        gin[i] = NULL;
        if (n->next[i].node == NULL && n->next[i].leaf == NULL) {
            weft_tensor_release(g);
            continue;
        }
        WEFT_CHECK_GOTO(deliver(r, &n->next[i], g), status, out);
    }

out:
    for (int s = 0; s < sp.n; s++) {
        weft_tensor_release(sp.items[s].idx);
        weft_tensor_release(sp.items[s].rows);
    }
    weft_free(sp.items);
    for (int i = 0; i < n->n_in; i++) {
        weft_tensor_release(gin[i]);
    }
    if (gin != gin_inline) {
        weft_free(gin);
    }
    return status;
}

/* Runs a ready node: gathers the gradients of its outputs, then its backward. */
static weft_status_t run_node(run_t *r, weft__ag_node_t *n)
{
    weft_tensor_t *gout_inline[WEFT__AG_MAX_IN] = {0};
    weft_tensor_t **gout = gout_inline;
    weft_status_t status = WEFT_OK;

    if (n->n_out > WEFT__AG_MAX_IN) {
        gout = weft_calloc((size_t)n->n_out, sizeof(*gout));
        if (gout == NULL) {
            return weft__set_error(WEFT_ERR_NO_MEMORY, "backward: out of memory");
        }
    }
    for (int k = 0; k < n->n_out; k++) {
        if (n->buf != NULL && n->buf[k] != NULL) {
            gout[k] = n->buf[k];
            n->buf[k] = NULL;
        } else {
            WEFT_CHECK_GOTO(out_zeros(n, k, &gout[k]), status, out);
        }
    }
    weft_free(n->buf);
    n->buf = NULL;
    status = node_step(r, n, gout, NULL);

out:
    for (int k = 0; k < n->n_out; k++) {
        weft_tensor_release(gout[k]);
    }
    if (gout != gout_inline) {
        weft_free(gout);
    }
    return status;
}

/*
 * Resumes, on this (the engine's) thread, the waiting nodes whose futures have completed: those
 * waiting when called, in the order they began to wait. A node that waits again goes to the back.
 */
static weft_status_t resume_ready(run_t *r)
{
    size_t n_scan = r->n_waits;
    size_t i = 0;

    while (i < n_scan) {
        wait_t w;
        weft_status_t status;

        if (!weft_future_done(r->wait_futs[i])) {
            i++;
            continue;
        }
        w = r->waits[i];
        memmove(&r->waits[i], &r->waits[i + 1], (r->n_waits - i - 1) * sizeof(*r->waits));
        memmove(&r->wait_futs[i], &r->wait_futs[i + 1],
                (r->n_waits - i - 1) * sizeof(*r->wait_futs));
        r->n_waits--;
        n_scan--;
        if (weft_future_status(w.f) != WEFT_OK) {
            status = weft__set_error(weft_future_status(w.f),
                                     "backward: %s waited on a future that failed: %s",
                                     w.node->name, weft_future_error(w.f));
        } else {
            status = node_step(r, w.node, w.gout, &w);
        }
        wait_clear(w.node, &w);
        if (status != WEFT_OK) {
            return status;
        }
    }
    return WEFT_OK;
}

/*
 * Nothing is ready to run and some nodes wait: sleeps until one of their futures completes. A
 * wait that outlives its bound (the backward's wait_timeout_ms from when the node began to wait)
 * fails the backward; the engine never sleeps past the earliest such deadline.
 */
static weft_status_t sleep_until_resumable(run_t *r)
{
    for (;;) {
        const wait_t *first = &r->waits[0];
        int64_t now = weft__now_ns();
        int64_t left;
        weft_status_t status;
        size_t index;

        for (size_t i = 1; i < r->n_waits; i++) {
            if (r->waits[i].deadline_ns < first->deadline_ns) {
                first = &r->waits[i];
            }
        }
        if (weft_future_done(first->f)) {
            return WEFT_OK;
        }
        if (now >= first->deadline_ns) {
            return weft__set_error(WEFT_ERR_TIMEOUT,
                                   "backward: %s waited %lld ms on a future that did not complete "
                                   "(the backward's wait_timeout_ms)",
                                   first->node->name, (long long)(r->wait_ns / 1000000));
        }
        left = first->deadline_ns - now;
        status = weft_future_wait_any(r->wait_futs, r->n_waits,
                                      left / 1000000 + (left % 1000000 != 0), &index);
        if (status != WEFT_ERR_TIMEOUT) {
            return status;
        }
    }
}

static weft_status_t ones_like(const weft_tensor_t *t, weft_tensor_t **out_p)
{
    weft_tensor_t *o = NULL;

    WEFT_CHECK(
        weft_tensor_empty(weft_tensor_dtype(t), weft_tensor_ndim(t), weft_tensor_shape(t), &o));
    if (weft_tensor_dtype(t) == WEFT_F32) {
        for (int64_t i = 0; i < weft_tensor_numel(o); i++) {
            ((float *)weft_tensor_data(o))[i] = 1.0f;
        }
    } else {
        for (int64_t i = 0; i < weft_tensor_numel(o); i++) {
            ((double *)weft_tensor_data(o))[i] = 1.0;
        }
    }
    *out_p = o;
    return WEFT_OK;
}

static int cmp_ptr(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t) * (void *const *)a;
    uintptr_t y = (uintptr_t) * (void *const *)b;

    return x < y ? -1 : x > y;
}

void weft_backward_opts_init(weft_backward_opts_t *opts)
{
    if (opts != NULL) {
        memset(opts, 0, sizeof(*opts));
    }
}

weft_status_t weft_backward_run(size_t n, weft_tensor_t *const *roots, weft_tensor_t *const *grads,
                                const weft_backward_opts_t *opts)
{
    weft_backward_opts_t o;
    run_t r = {0};
    weft__ag_node_t **root_nodes = NULL;
    weft_tensor_t **root_grads = NULL;
    weft__ag_node_t **root_extra = NULL;
    size_t n_extra = 0;
    weft_status_t status = WEFT_OK;
    int n_roots;

    weft_backward_opts_init(&o);
    if (opts != NULL) {
        o = *opts;
    }
    if (n + o.n_root_nodes < 1 || n > INT_MAX / 2 || o.n_root_nodes > INT_MAX / 2 ||
        (n > 0 && roots == NULL) || (o.n_root_nodes > 0 && o.root_nodes == NULL)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "backward: no roots");
    }
    if (o.wait_timeout_ms < 0) {
        return weft__set_error(WEFT_ERR_INVALID_ARG,
                               "backward: wait_timeout_ms is %lld (0 for the default)",
                               (long long)o.wait_timeout_ms);
    }
    n_roots = (int)n;
    r.o = &o;
    r.retain = o.retain_graph;
    if (o.wait_timeout_ms == 0) {
        o.wait_timeout_ms = WEFT_BACKWARD_WAIT_TIMEOUT_MS;
    }
    r.wait_ns = o.wait_timeout_ms > INT64_MAX / 1000000 ? INT64_MAX : o.wait_timeout_ms * 1000000;
    root_nodes = weft_calloc((size_t)n_roots + o.n_root_nodes, sizeof(*root_nodes));
    root_grads = weft_calloc((size_t)n_roots + 1, sizeof(*root_grads));
    if (root_nodes == NULL || root_grads == NULL) {
        status = weft__set_error(WEFT_ERR_NO_MEMORY, "backward: out of memory");
        goto out;
    }
    for (int i = 0; i < n_roots; i++) {
        weft_tensor_t *root = roots[i];
        weft_tensor_t *g = grads == NULL ? NULL : grads[i];
        meta_t *m = meta_of(root);

        if (root == NULL || m == NULL || !m->requires_grad) {
            status = weft__set_error(WEFT_ERR_INVALID_ARG,
                                     "backward: root %d does not require gradients", i);
            goto out;
        }
        if (g == NULL) {
            if (weft_tensor_numel(root) != 1) {
                status = weft__set_error(WEFT_ERR_INVALID_ARG,
                                         "backward: a gradient is needed for a root of %lld "
                                         "elements (NULL means 1 only for a scalar)",
                                         (long long)weft_tensor_numel(root));
                goto out;
            }
            WEFT_CHECK_GOTO(ones_like(root, &root_grads[i]), status, out);
        } else {
            WEFT_CHECK_GOTO(check_like("backward", root, g), status, out);
            root_grads[i] = weft_tensor_retain(g);
        }
        root_nodes[i] = m->grad_fn;
    }

    for (size_t i = 0; i < o.n_root_nodes; i++) {
        if (o.root_nodes[i] == NULL) {
            status = weft__set_error(WEFT_ERR_INVALID_ARG, "backward: root node %zu is NULL", i);
            goto out;
        }
        root_nodes[n_roots + (int)i] = o.root_nodes[i];
    }

    r.run = atomic_fetch_add_explicit(&run_seq, 1, memory_order_relaxed) + 1;
    WEFT_CHECK_GOTO(discover(&r, n_roots + (int)o.n_root_nodes, root_nodes), status, out);
    /* Leaves that are roots themselves. */
    for (int i = 0; i < n_roots; i++) {
        if (root_nodes[i] == NULL) {
            WEFT_CHECK_GOTO(visit_leaf(&r, roots[i]), status, out);
        }
    }
    r.heap = weft_calloc(r.n_nodes + 1, sizeof(*r.heap));
    if (r.heap == NULL) {
        status = weft__set_error(WEFT_ERR_NO_MEMORY, "backward: out of memory");
        goto out;
    }
    /* Root gradients enter as if delivered along an edge (count them all first, so that a
     * node that is the grad_fn of two roots runs once). Root nodes (given once each, however
     * often they are listed) count one more, balanced below. */
    for (int i = 0; i < n_roots; i++) {
        if (root_nodes[i] != NULL) {
            root_nodes[i]->deps++; /* balanced by deliver() */
        }
    }
    if (o.n_root_nodes > 0) {
        root_extra = weft_calloc(o.n_root_nodes, sizeof(*root_extra));
        if (root_extra == NULL) {
            status = weft__set_error(WEFT_ERR_NO_MEMORY, "backward: out of memory");
            goto out;
        }
        memcpy(root_extra, o.root_nodes, o.n_root_nodes * sizeof(*root_extra));
        qsort(root_extra, o.n_root_nodes, sizeof(*root_extra), cmp_ptr);
        for (size_t i = 0; i < o.n_root_nodes; i++) {
            if (i == 0 || root_extra[i] != root_extra[i - 1]) {
                root_extra[n_extra++] = root_extra[i];
                root_extra[n_extra - 1]->deps++;
            }
        }
    }
    for (int i = 0; i < n_roots; i++) {
        weft__ag_edge_t e = {0};
        weft_tensor_t *g = root_grads[i];

        root_grads[i] = NULL;
        if (root_nodes[i] != NULL) {
            e.node = root_nodes[i];
            e.out_index = meta_of(roots[i])->out_index;
        } else {
            e.leaf = roots[i];
        }
        WEFT_CHECK_GOTO(deliver(&r, &e, g), status, out);
    }
    /* Root nodes start without a gradient, once whatever else leads to them has run. */
    for (size_t i = 0; i < n_extra; i++) {
        weft__ag_edge_t e = {.node = root_extra[i]};

        WEFT_CHECK_GOTO(deliver(&r, &e, NULL), status, out);
    }
    /* Run ready nodes, later-created first; resume waiting nodes as their futures complete, and
     * sleep on those futures only when nothing else is ready. */
    for (;;) {
        while (r.n_heap > 0) {
            WEFT_CHECK_GOTO(run_node(&r, heap_pop(&r)), status, out);
            if (r.n_waits > 0) {
                WEFT_CHECK_GOTO(resume_ready(&r), status, out);
            }
        }
        if (r.n_waits == 0) {
            break;
        }
        if (o.idle_fn != NULL) {
            o.idle_fn(o.idle_arg, r.n_waits);
        }
        WEFT_CHECK_GOTO(sleep_until_resumable(&r), status, out);
        WEFT_CHECK_GOTO(resume_ready(&r), status, out);
    }

out:
    /* Waits still pending are abandoned: their futures may complete later, into nothing of ours
     * (the engine registered no callback on them; it only drops its references). */
    for (size_t i = 0; i < r.n_waits; i++) {
        wait_clear(r.waits[i].node, &r.waits[i]);
    }
    weft_free(r.waits);
    weft_free(r.wait_futs);
    /* On failure, drop what is half-summed so that the next backward starts clean. */
    for (size_t i = 0; i < r.n_nodes; i++) {
        weft__ag_node_t *n = r.nodes[i];
        if (n->buf != NULL) {
            for (int k = 0; k < n->n_out; k++) {
                weft_tensor_release(n->buf[k]);
            }
            weft_free(n->buf);
            n->buf = NULL;
        }
        n->run = 0;
    }
    for (size_t i = 0; i < r.n_leaves; i++) {
        weft_tensor_release(r.leaves[i].grad);
    }
    weft_free(r.slots);
    if (root_grads != NULL) {
        for (int i = 0; i < n_roots; i++) {
            weft_tensor_release(root_grads[i]);
        }
    }
    weft_free(root_grads);
    weft_free(root_nodes);
    weft_free(root_extra);
    weft_free(r.nodes);
    weft_free(r.heap);
    weft_free(r.leaves);
    return status;
}

weft_status_t weft_backward_many(int n_roots, weft_tensor_t *const *roots,
                                 weft_tensor_t *const *grads, int retain_graph)
{
    weft_backward_opts_t opts;

    if (n_roots < 1) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "backward: no roots");
    }
    weft_backward_opts_init(&opts);
    opts.retain_graph = retain_graph != 0;
    return weft_backward_run((size_t)n_roots, roots, grads, &opts);
}

weft_status_t weft_backward(weft_tensor_t *root, weft_tensor_t *grad, int retain_graph)
{
    return weft_backward_many(1, &root, &grad, retain_graph);
}

/* ---- nodes of one's own (include/weft/autograd.h) -------------------------------------------- */

int weft_ag_should_record(int n, weft_tensor_t *const *inputs)
{
    return n > 0 && inputs != NULL && weft__ag_should_record(n, inputs);
}

weft_status_t weft_ag_node_create(const char *name, weft_ag_backward_cb_t backward, int n_in,
                                  weft_tensor_t *const *inputs, void *ctx,
                                  void (*ctx_free)(void *ctx), weft_ag_node_t **node_p)
{
    weft__ag_node_t *n = NULL;

    if (name == NULL || node_p == NULL || (n_in > 0 && inputs == NULL)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "autograd: node_create: NULL argument");
    }
    WEFT_CHECK(weft__ag_node_new(name, backward, n_in, inputs, &n));
    n->ctx = ctx;
    n->ctx_free = ctx_free;
    *node_p = n;
    return WEFT_OK;
}

weft_status_t weft_ag_node_attach(weft_ag_node_t *n, int n_out, weft_tensor_t *const *outputs)
{
    if (n == NULL || n_out < 0 || (n_out > 0 && outputs == NULL)) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "autograd: node_attach: bad arguments");
    }
    if (n_out == 0) {
        n->n_out = 0;
        return WEFT_OK;
    }
    return weft__ag_attach(n, n_out, outputs);
}

void *weft_ag_node_ctx(const weft_ag_node_t *n)
{
    return n == NULL ? NULL : n->ctx;
}

int weft_ag_node_needs_grad(const weft_ag_node_t *n, int i)
{
    return n != NULL && weft__ag_needs_grad(n, i);
}

weft_ag_node_t *weft_ag_node_retain(weft_ag_node_t *n)
{
    if (n != NULL) {
        weft__ag_node_ref(n);
    }
    return n;
}

void weft_ag_node_release(weft_ag_node_t *n)
{
    if (n != NULL) {
        weft__ag_node_unref(n);
    }
}

weft_status_t weft_ag_wait(weft_ag_node_t *n, weft_future_t *f, weft_ag_resume_cb_t resume,
                           void *arg)
{
    return weft__ag_wait(n, f, resume, arg);
}
