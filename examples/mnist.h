/* A reader for the IDX files of MNIST and Fashion-MNIST (gzip or plain). */
#ifndef WEFT_EXAMPLES_MNIST_H
#define WEFT_EXAMPLES_MNIST_H

#include <stddef.h>
#include <stdint.h>

#include <weft/status.h>

/** Number of classes the labels may take (0..9). */
#define MNIST_CLASSES 10

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

/** Parses a whole decimal integer in [min, max] into *v_p; -1 (nothing set) otherwise. */
int parse_int_arg(const char *s, int64_t min, int64_t max, int64_t *v_p);
/** Parses a whole number in [min, max] into *v_p; -1 (nothing set) otherwise. */
int parse_double_arg(const char *s, double min, double max, double *v_p);

/** Frees what mnist_load filled in; leaves @p set empty. */
void mnist_free(mnist_set_t *set);

#endif
