/* A reader for the IDX files of MNIST and Fashion-MNIST (gzip or plain). */
#ifndef WEFT_EXAMPLES_MNIST_H
#define WEFT_EXAMPLES_MNIST_H

#include <stddef.h>
#include <stdint.h>

#include <weft/status.h>
#include <weft/collectives.h>
#include <weft/ddp.h>
#include <weft/autograd.h>
#include <weft/nn.h>
#include <weft/ops.h>
#include <weft/rpc.h>
#include <weft/tensor.h>

/** Number of classes the labels may take (0..9). */
#define MNIST_CLASSES 10
/** Where Debian's dataset-fashion-mnist puts the IDX files: --data's default. */
#define MNIST_DEFAULT_DIR "/usr/share/datasets/fashion-mnist"

/** One split: @c count images of @c rows x @c cols bytes and their labels. */
typedef struct {
    int64_t count;
    int rows;
    int cols;
    uint8_t *pixels; /**< count * rows * cols bytes, image after image, row-major */
    uint8_t *labels; /**< count labels, each < MNIST_CLASSES */
} mnist_set_t;

/**
 * Loads DIR/PREFIX-images-idx3-ubyte[.gz] and DIR/PREFIX-labels-idx1-ubyte[.gz]
 * (PREFIX is "train" or "t10k"), checking the magic numbers, that the counts
 * agree, that no file is truncated or has trailing bytes, and every label.
 * @param[out] set_p filled on success; caller frees with mnist_free.
 * @param[out] err a one-line reason on failure (@p err_cap bytes).
 * @return WEFT_ERR_NOT_FOUND (a file is missing), WEFT_ERR_IO (unreadable,
 *         corrupt or truncated), WEFT_ERR_NO_MEMORY.
 */
weft_status_t mnist_load(const char *dir, const char *prefix, mnist_set_t *set_p, char *err,
                         size_t err_cap);

/**
 * Loads the training ("train") and test ("t10k") splits of @p dir and checks that their images
 * have the same size. On failure prints "PROG: cannot load Fashion-MNIST: <reason>" and how to
 * get the data on stderr, and leaves both sets empty.
 * @return 0, or -1 after the message.
 */
int mnist_load_splits(const char *prog, const char *dir, mnist_set_t *train_p, mnist_set_t *test_p);

/** The data directory without --data: $WEFT_DATA_DIR if set, else MNIST_DEFAULT_DIR. */
const char *mnist_default_dir(void);

/** Frees what mnist_load filled in; leaves @p set empty. */
void mnist_free(mnist_set_t *set);

/* Images [k, rows*cols] (scaled to [0, 1], then normalised with Fashion-MNIST's mean and standard
 * deviation) and labels [k] (i64) of samples idx[0..k) of @p set. Caller releases both. */
weft_status_t mnist_batch(const mnist_set_t *set, const int64_t *idx, int64_t k,
                          weft_tensor_t **x_p, weft_tensor_t **y_p);

/* One training step's forward and backward: the mean cross-entropy of @p mlp on samples idx[0..k)
 * of @p set, its gradient accumulated into the parameters' gradients (the caller zeroes them
 * first; with @p ddp, backward through the DDP reducer, which averages them over its group), its
 * value into @p loss_p. The step's graph is released. */
weft_status_t mnist_loss_backward(const mnist_set_t *set, weft_nn_mlp_t *mlp, const int64_t *idx,
                                  int64_t k, weft_ddp_t *ddp, double *loss_p);

/* Epoch @p epoch's samples for part @p part of @p parts (torch's DistributedSampler): a
 * permutation of 0..n-1 drawn from @p seed and the epoch (into @p perm, n entries), then the
 * positions part, part + parts, ... wrapping around to pad: @p shard gets @p shard_n samples. */
void mnist_epoch_shard(uint64_t seed, int epoch, int64_t n, int part, int parts, int64_t *perm,
                       int64_t *shard, int64_t shard_n);

/* Test accuracy of @p mlp on @p set over a group: part @p part of @p parts scores images part,
 * part + parts, ... (no gradients recorded), the counts are summed over @p pg (whose ranks are the
 * parts), and @p acc_p gets the fraction right of all the set's images. */
weft_status_t mnist_accuracy(const mnist_set_t *set, weft_nn_mlp_t *mlp, int part, int parts,
                             weft_pg_t *pg, double *acc_p);

/* ------------------------------------------------- data-parallel examples */

/** What every rank of a data-parallel example (dp_train, cnn_train) trains with. */
typedef struct {
    weft_agent_t *a;
    weft_pg_t *pg; /**< the world group */
    int rank;
    int world;
    const mnist_set_t *train;
    const mnist_set_t *test;
    int64_t used; /**< training samples: the first min(--limit, all) */
} mnist_job_t;

/** An example's training on @p job (@p arg: its configuration); returns the exit status. */
typedef int (*mnist_train_cb_t)(const mnist_job_t *job, void *arg);

/**
 * The rest of a data-parallel example's main() once its options are parsed: @p threads BLAS
 * threads; both splits of @p dir loaded first, so that missing or corrupt data ends the run
 * before any rank waits for another, and (when @p rows > 0) their images checked to be @p rows x
 * @p cols; the agent created and joined; the world group; @p train(job, @p arg); the shutdown.
 * @p limit caps the training samples used (0: all).
 * @return the exit status: @p train's; EX_EXIT_USAGE for data that cannot be read or has the
 *         wrong size; 1 if the agent, the group or the shutdown failed (after a message).
 */
int mnist_dp_main(const char *prog, const char *dir, int threads, int64_t limit, int rows, int cols,
                  mnist_train_cb_t train, void *arg);

/**
 * One rank's share of each epoch's samples (mnist_epoch_shard): @c idx has @c n entries,
 * ceil(used / world).
 */
typedef struct {
    uint64_t seed;
    int64_t used;
    int part;
    int parts;
    int64_t n;
    int64_t *perm; /**< used entries */
    int64_t *idx;  /**< n entries: this epoch's samples for this rank */
} mnist_shard_t;

/**
 * Sets up @p sh for @p job's rank, shuffles drawn from @p seed.
 * @return 0, or -1 after "PROG: out of memory" (@p sh left empty; mnist_shard_free is safe).
 */
int mnist_shard_init(const char *prog, const mnist_job_t *job, uint64_t seed, mnist_shard_t *sh);

/** Fills @c sh->idx with epoch @p epoch's samples. */
void mnist_shard_epoch(mnist_shard_t *sh, int epoch);

/** Frees what mnist_shard_init allocated; leaves @p sh empty. */
void mnist_shard_free(mnist_shard_t *sh);

#endif
