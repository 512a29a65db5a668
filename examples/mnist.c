/* IDX reader: http://yann.lecun.com/exdb/mnist/ describes the format. Every
 * field is checked, so a wrong, corrupt or truncated file is reported rather
 * than trained on. */
#include "mnist.h"

#include "common.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <zlib.h>

#include <weft/random.h>

/* Fashion-MNIST pixel mean and standard deviation (after scaling to [0, 1]). */
#define MNIST_PIXEL_MEAN 0.2860f
#define MNIST_PIXEL_STD  0.3530f

#define IDX_MAGIC_U8_1D 0x00000801u /* unsigned bytes, one dimension (labels) */
#define IDX_MAGIC_U8_3D 0x00000803u /* unsigned bytes, three dimensions (images) */
#define MAX_COUNT       10000000
#define MAX_SIDE        1024
#define READ_CHUNK      (1u << 24)

static weft_status_t say(char *err, size_t cap, weft_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static weft_status_t say(char *err, size_t cap, weft_status_t st, const char *fmt, ...)
{
    va_list ap;

    if (err != NULL && cap > 0) {
        va_start(ap, fmt);
        vsnprintf(err, cap, fmt, ap);
        va_end(ap);
    }
    return st;
}

/* Finds DIR/NAME.gz, else DIR/NAME; the path goes to @p path. */
static weft_status_t find_file(const char *dir, const char *name, char *path, size_t cap, char *err,
                               size_t err_cap)
{
    struct stat sb;

    snprintf(path, cap, "%s/%s.gz", dir, name);
    if (stat(path, &sb) == 0 && S_ISREG(sb.st_mode)) {
        return WEFT_OK;
    }
    snprintf(path, cap, "%s/%s", dir, name);
    if (stat(path, &sb) == 0 && S_ISREG(sb.st_mode)) {
        return WEFT_OK;
    }
    return say(err, err_cap, WEFT_ERR_NOT_FOUND, "%s/%s.gz: no such file (nor %s/%s)", dir, name,
               dir, name);
}

/* Reads exactly @p len bytes; WEFT_ERR_IO when the stream ends early or is corrupt. */
static weft_status_t read_exact(gzFile gz, const char *path, void *buf, size_t len, char *err,
                                size_t err_cap)
{
    uint8_t *p = buf;
    size_t done = 0;

    while (done < len) {
        size_t want = len - done < READ_CHUNK ? len - done : READ_CHUNK;
        int n = gzread(gz, p + done, (unsigned)want);
        if (n < 0) {
            int zerr;
            const char *msg = gzerror(gz, &zerr);
            size_t plen = strlen(path);
            /* zlib may put the path in front of its message already. */
            if (strncmp(msg, path, plen) == 0 && strncmp(msg + plen, ": ", 2) == 0) {
                msg += plen + 2;
            }
            return say(err, err_cap, WEFT_ERR_IO, "%s: corrupt: %s", path, msg);
        }
        if (n == 0) {
            return say(err, err_cap, WEFT_ERR_IO,
                       "%s: truncated: ends after %zu of %zu expected bytes", path, done, len);
        }
        done += (size_t)n;
    }
    return WEFT_OK;
}

static uint32_t be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

/*
 * Reads one IDX file of unsigned bytes with @p ndim dimensions (1 or 3).
 * dims[] gets the sizes; *data_p the bytes (caller frees with free).
 */
static weft_status_t read_idx(const char *dir, const char *name, int ndim, uint32_t *dims,
                              uint8_t **data_p, char *err, size_t err_cap)
{
    char path[4096];
    uint8_t header[16];
    uint32_t magic = ndim == 1 ? IDX_MAGIC_U8_1D : IDX_MAGIC_U8_3D;
    size_t header_len = 4 + 4 * (size_t)ndim;
    size_t len = 1;
    uint8_t *data;
    uint8_t extra;
    gzFile gz;
    weft_status_t st;

    st = find_file(dir, name, path, sizeof(path), err, err_cap);
    if (st != WEFT_OK) {
        return st;
    }
    errno = 0;
    gz = gzopen(path, "rb");
    if (gz == NULL) {
        return say(err, err_cap, WEFT_ERR_IO, "%s: cannot open: %s", path,
                   errno != 0 ? strerror(errno) : "out of memory");
    }
    st = read_exact(gz, path, header, header_len, err, err_cap);
    if (st != WEFT_OK) {
        goto err_close;
    }
    if (be32(header) != magic) {
        st = say(err, err_cap, WEFT_ERR_IO, "%s: bad magic number 0x%08x (expected 0x%08x)", path,
                 be32(header), magic);
        goto err_close;
    }
    for (int i = 0; i < ndim; i++) {
        dims[i] = be32(header + 4 + 4 * i);
        uint32_t max = i == 0 ? MAX_COUNT : MAX_SIDE;
        if (dims[i] == 0 || dims[i] > max) {
            st = say(err, err_cap, WEFT_ERR_IO, "%s: implausible size %u in dimension %d", path,
                     dims[i], i);
            goto err_close;
        }
        len *= dims[i];
    }
    data = malloc(len);
    if (data == NULL) {
        st = say(err, err_cap, WEFT_ERR_NO_MEMORY, "%s: cannot allocate %zu bytes", path, len);
        goto err_close;
    }
    st = read_exact(gz, path, data, len, err, err_cap);
    if (st != WEFT_OK) {
        goto err_free_data;
    }
    if (gzread(gz, &extra, 1) != 0) {
        st = say(err, err_cap, WEFT_ERR_IO,
                 "%s: corrupt: data after the %zu bytes the header gives", path, len);
        goto err_free_data;
    }
    gzclose(gz);
    *data_p = data;
    return WEFT_OK;

err_free_data:
    free(data);
err_close:
    gzclose(gz);
    return st;
}

weft_status_t mnist_load(const char *dir, const char *prefix, mnist_set_t *set_p, char *err,
                         size_t err_cap)
{
    char images_name[256];
    char labels_name[256];
    uint32_t idims[3];
    uint32_t ldims[1];
    uint8_t *pixels;
    uint8_t *labels;
    weft_status_t st;

    snprintf(images_name, sizeof(images_name), "%s-images-idx3-ubyte", prefix);
    snprintf(labels_name, sizeof(labels_name), "%s-labels-idx1-ubyte", prefix);
    st = read_idx(dir, images_name, 3, idims, &pixels, err, err_cap);
    if (st != WEFT_OK) {
        return st;
    }
    st = read_idx(dir, labels_name, 1, ldims, &labels, err, err_cap);
    if (st != WEFT_OK) {
        goto err_free_pixels;
    }
    if (idims[0] != ldims[0]) {
        st = say(err, err_cap, WEFT_ERR_IO, "%s/%s: %u images but %u labels", dir, prefix, idims[0],
                 ldims[0]);
        goto err_free_labels;
    }
    for (uint32_t i = 0; i < ldims[0]; i++) {
        if (labels[i] >= MNIST_CLASSES) {
            st = say(err, err_cap, WEFT_ERR_IO, "%s/%s: label %u of sample %u is not 0..%d", dir,
                     labels_name, labels[i], i, MNIST_CLASSES - 1);
            goto err_free_labels;
        }
    }
    set_p->count = idims[0];
    set_p->rows = (int)idims[1];
    set_p->cols = (int)idims[2];
    set_p->pixels = pixels;
    set_p->labels = labels;
    return WEFT_OK;

err_free_labels:
    free(labels);
err_free_pixels:
    free(pixels);
    return st;
}

void mnist_free(mnist_set_t *set)
{
    if (set == NULL) {
        return;
    }
    free(set->pixels);
    free(set->labels);
    memset(set, 0, sizeof(*set));
}

int mnist_load_splits(const char *prog, const char *dir, mnist_set_t *train_p, mnist_set_t *test_p)
{
    char err[512];
    weft_status_t st;

    st = mnist_load(dir, "train", train_p, err, sizeof(err));
    if (st == WEFT_OK) {
        st = mnist_load(dir, "t10k", test_p, err, sizeof(err));
        if (st != WEFT_OK) {
            mnist_free(train_p);
        }
    }
    if (st == WEFT_OK && (train_p->rows != test_p->rows || train_p->cols != test_p->cols)) {
        snprintf(err, sizeof(err), "%s: training images are %dx%d, test images %dx%d", dir,
                 train_p->rows, train_p->cols, test_p->rows, test_p->cols);
        mnist_free(train_p);
        mnist_free(test_p);
        st = WEFT_ERR_IO;
    }
    if (st != WEFT_OK) {
        fprintf(stderr,
                "%s: cannot load Fashion-MNIST: %s\n"
                "%s: install the Debian package dataset-fashion-mnist, or point "
                "--data DIR or WEFT_DATA_DIR at the IDX files\n",
                prog, err, prog);
        return -1;
    }
    return 0;
}

const char *mnist_default_dir(void)
{
    const char *env = weft_config_str("WEFT_DATA_DIR"); /* its default is MNIST_DEFAULT_DIR */

    return env != NULL && *env != '\0' ? env : MNIST_DEFAULT_DIR;
}

weft_status_t mnist_batch(const mnist_set_t *set, const int64_t *idx, int64_t k,
                          weft_tensor_t **x_p, weft_tensor_t **y_p)
{
    const int64_t d = (int64_t)set->rows * set->cols;
    int64_t xs[2] = {k, d};
    weft_tensor_t *x = NULL;
    weft_tensor_t *y = NULL;
    weft_status_t st;

    st = weft_tensor_empty(WEFT_F32, 2, xs, &x);
    if (st == WEFT_OK) {
        st = weft_tensor_empty(WEFT_I64, 1, &k, &y);
    }
    if (st != WEFT_OK) {
        weft_tensor_release(x);
        return st;
    }
    for (int64_t i = 0; i < k; i++) {
        const uint8_t *px = set->pixels + idx[i] * d;
        float *row = (float *)weft_tensor_data(x) + i * d;

        for (int64_t j = 0; j < d; j++) {
            row[j] = ((float)px[j] * (1.0f / 255.0f) - MNIST_PIXEL_MEAN) * (1.0f / MNIST_PIXEL_STD);
        }
        ((int64_t *)weft_tensor_data(y))[i] = set->labels[idx[i]];
    }
    *x_p = x;
    *y_p = y;
    return WEFT_OK;
}

weft_status_t mnist_loss_backward(const mnist_set_t *set, weft_nn_mlp_t *mlp, const int64_t *idx,
                                  int64_t k, weft_ddp_t *ddp, double *loss_p)
{
    weft_tensor_t *x = NULL;
    weft_tensor_t *y = NULL;
    weft_tensor_t *logits = NULL;
    weft_tensor_t *loss = NULL;
    weft_status_t st;

    st = mnist_batch(set, idx, k, &x, &y);
    if (st == WEFT_OK) {
        st = weft_nn_mlp_forward(mlp, x, &logits);
    }
    if (st == WEFT_OK) {
        st = weft_op_cross_entropy(logits, y, WEFT_REDUCTION_MEAN, &loss);
    }
    if (st == WEFT_OK) {
        st = ddp != NULL ? weft_ddp_backward(ddp, loss, NULL) : weft_backward(loss, NULL, 0);
    }
    if (st == WEFT_OK) {
        *loss_p = ((const float *)weft_tensor_data(loss))[0];
    }
    weft_tensor_release(loss);
    weft_tensor_release(logits);
    weft_tensor_release(x);
    weft_tensor_release(y);
    return st;
}

void mnist_epoch_shard(uint64_t seed, int epoch, int64_t n, int part, int parts, int64_t *perm,
                       int64_t *shard, int64_t shard_n)
{
    ex_epoch_perm(seed, epoch, n, perm);
    for (int64_t i = 0; i < shard_n; i++) {
        shard[i] = perm[(part + i * parts) % n];
    }
}

weft_status_t mnist_accuracy(const mnist_set_t *set, weft_nn_mlp_t *mlp, int part, int parts,
                             weft_pg_t *pg, double *acc_p)
{
    const int64_t chunk = 1000;
    int64_t n = set->count;
    int64_t *idx = malloc((size_t)chunk * sizeof(*idx));
    int64_t one = 1;
    weft_tensor_t *counts = NULL;
    int64_t correct = 0;
    weft_status_t st = WEFT_OK;
    int prev = weft_grad_set_enabled(0);

    if (idx == NULL) {
        weft_grad_set_enabled(prev);
        return WEFT_ERR_NO_MEMORY;
    }
    for (int64_t start = part; st == WEFT_OK && start < n; start += chunk * parts) {
        int64_t k = 0;
        weft_tensor_t *x = NULL;
        weft_tensor_t *y = NULL;
        weft_tensor_t *logits = NULL;
        weft_tensor_t *pred = NULL;

        for (int64_t i = start; i < n && k < chunk; i += parts) {
            idx[k++] = i;
        }
        st = mnist_batch(set, idx, k, &x, &y);
        if (st == WEFT_OK) {
            st = weft_nn_mlp_forward(mlp, x, &logits);
        }
        if (st == WEFT_OK) {
            st = weft_op_argmax(logits, 1, 0, &pred);
        }
        for (int64_t i = 0; st == WEFT_OK && i < k; i++) {
            correct +=
                ((int64_t *)weft_tensor_data(pred))[i] == ((int64_t *)weft_tensor_data(y))[i];
        }
        weft_tensor_release(pred);
        weft_tensor_release(logits);
        weft_tensor_release(x);
        weft_tensor_release(y);
    }
    weft_grad_set_enabled(prev);
    free(idx);
    if (st == WEFT_OK) {
        st = weft_tensor_create(WEFT_I64, 1, &one, &counts);
    }
    if (st == WEFT_OK) {
        ((int64_t *)weft_tensor_data(counts))[0] = correct;
        st = weft_coll_all_reduce(pg, counts, WEFT_SUM, NULL);
    }
    if (st != WEFT_OK) {
        weft_tensor_release(counts);
        return st;
    }
    *acc_p = (double)((int64_t *)weft_tensor_data(counts))[0] / (double)n;
    weft_tensor_release(counts);
    return WEFT_OK;
}

/* ------------------------------------------------- data-parallel examples */

int mnist_dp_main(const char *prog, const char *dir, int threads, int64_t limit, int rows, int cols,
                  mnist_train_cb_t train, void *arg)
{
    mnist_set_t train_set = {0};
    mnist_set_t test_set = {0};
    weft_agent_opts_t opts;
    weft_agent_t *a = NULL;
    mnist_job_t job;
    weft_status_t st;
    int rc;

    weft_op_set_threads(threads);
    /* Data first: a missing or corrupt file ends the run before any rank waits for it. */
    if (mnist_load_splits(prog, dir, &train_set, &test_set) != 0) {
        return EX_EXIT_USAGE;
    }
    if (rows > 0 && (train_set.rows != rows || train_set.cols != cols)) {
        fprintf(stderr, "%s: the images are %dx%d, the model wants %dx%d\n", prog, train_set.rows,
                train_set.cols, rows, cols);
        rc = EX_EXIT_USAGE;
        goto out;
    }

    weft_agent_opts_init(&opts);
    st = weft_agent_create(&opts, &a);
    if (st == WEFT_OK) {
        st = weft_agent_join(a);
    }
    if (st != WEFT_OK) {
        ex_fail(prog, "cannot start the agent", st);
        rc = 1;
        goto out;
    }
    memset(&job, 0, sizeof(job));
    job.a = a;
    job.rank = weft_agent_rank(a);
    job.world = weft_agent_world_size(a);
    job.train = &train_set;
    job.test = &test_set;
    job.used = limit > 0 && limit < train_set.count ? limit : train_set.count;
    st = weft_pg_world(a, &job.pg);
    if (st != WEFT_OK) {
        ex_fail(prog, "world group", st);
        rc = 1;
        goto out_shutdown;
    }
    rc = train(&job, arg);
    weft_pg_free(job.pg);

out_shutdown:
    rc = ex_agent_shutdown(prog, a, rc);
out:
    weft_agent_free(a);
    mnist_free(&train_set);
    mnist_free(&test_set);
    return rc;
}

int mnist_shard_init(const char *prog, const mnist_job_t *job, uint64_t seed, mnist_shard_t *sh)
{
    memset(sh, 0, sizeof(*sh));
    sh->seed = seed;
    sh->used = job->used;
    sh->part = job->rank;
    sh->parts = job->world;
    sh->n = (job->used + job->world - 1) / job->world;
    sh->perm = malloc((size_t)job->used * sizeof(*sh->perm));
    sh->idx = malloc((size_t)sh->n * sizeof(*sh->idx));
    if (sh->perm == NULL || sh->idx == NULL) {
        fprintf(stderr, "%s: out of memory\n", prog);
        mnist_shard_free(sh);
        return -1;
    }
    return 0;
}

void mnist_shard_epoch(mnist_shard_t *sh, int epoch)
{
    mnist_epoch_shard(sh->seed, epoch, sh->used, sh->part, sh->parts, sh->perm, sh->idx, sh->n);
}

void mnist_shard_free(mnist_shard_t *sh)
{
    free(sh->perm);
    free(sh->idx);
    memset(sh, 0, sizeof(*sh));
}
