/* core: values (tensor list + payload). */
#include <criterion/criterion.h>

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "counting_alloc.h"
#include "internal.h"

/* n_alloc, n_free, counting, use_counting, check_balanced */

static atomic_int released;

static void on_release(void *data, void *arg)
{
    (void)data;
    (void)arg;
    atomic_fetch_add(&released, 1);
}

static weft_tensor_t *wrapped(void *buf, size_t nbytes)
{
    const int64_t shape[] = {(int64_t)nbytes};
    weft_tensor_t *t = NULL;

    cr_assert_eq(weft_tensor_wrap(WEFT_U8, 1, shape, buf, nbytes, WEFT_CPU, on_release, NULL, &t),
                 WEFT_OK);
    return t;
}

TestSuite(value, .init = use_counting, .timeout = 30);

Test(value, empty)
{
    weft_value_t *v = NULL;
    size_t len = 99;

    cr_assert_eq(weft_value_create(&v), WEFT_OK);
    cr_assert_eq(weft_value_num_tensors(v), 0);
    cr_assert_null(weft_value_tensor(v, 0));
    cr_assert_null(weft_value_payload(v, &len));
    cr_assert_eq(len, 0);
    cr_assert_eq(weft__value_tensors_nbytes(v), 0);
    cr_assert_eq(weft__value_tensors_nbytes(NULL), 0);
    weft_value_free(v);
    weft_value_free(NULL);
    check_balanced();
}

Test(value, add_tensor_keeps_its_own_reference)
{
    static uint8_t buf[8];
    weft_tensor_t *t = wrapped(buf, sizeof(buf));
    weft_value_t *v = NULL;

    cr_assert_eq(weft_value_create(&v), WEFT_OK);
    cr_assert_eq(weft_value_add_tensor(v, t), WEFT_OK);
    cr_assert_eq(weft_value_tensor(v, 0), t);
    weft_tensor_release(t);
    cr_assert_eq(atomic_load(&released), 0);
    cr_assert_eq(weft_value_tensor(v, 0), t);
    weft_value_free(v);
    cr_assert_eq(atomic_load(&released), 1);
    check_balanced();
}

Test(value, push_tensor_takes_the_reference)
{
    static uint8_t a[4];
    static uint8_t b[12];
    weft_value_t *v = NULL;

    cr_assert_eq(weft_value_create(&v), WEFT_OK);
    cr_assert_eq(weft_value_push_tensor(v, wrapped(a, sizeof(a))), WEFT_OK);
    cr_assert_eq(weft_value_push_tensor(v, wrapped(b, sizeof(b))), WEFT_OK);
    cr_assert_eq(weft_value_num_tensors(v), 2);
    cr_assert_eq(weft_tensor_data(weft_value_tensor(v, 1)), b);
    cr_assert_eq(weft__value_tensors_nbytes(v), 16);
    cr_assert_null(weft_value_tensor(v, 2));
    cr_assert_eq(weft_value_push_tensor(v, NULL), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(weft_value_add_tensor(NULL, weft_value_tensor(v, 0)), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(atomic_load(&released), 0);
    weft_value_free(v);
    cr_assert_eq(atomic_load(&released), 2);
    check_balanced();
}

Test(value, many_tensors_grow_the_list)
{
    weft_value_t *v = NULL;
    const int64_t shape[] = {3};

    cr_assert_eq(weft_value_create(&v), WEFT_OK);
    for (int i = 0; i < 1000; i++) {
        weft_tensor_t *t = NULL;

        cr_assert_eq(weft_tensor_create(WEFT_I64, 1, shape, &t), WEFT_OK);
        ((int64_t *)weft_tensor_data(t))[0] = i;
        cr_assert_eq(weft_value_push_tensor(v, t), WEFT_OK);
    }
    cr_assert_eq(weft_value_num_tensors(v), 1000);
    for (size_t i = 0; i < 1000; i++) {
        cr_assert_eq(((int64_t *)weft_tensor_data(weft_value_tensor(v, i)))[0], (int64_t)i);
    }
    cr_assert_eq(weft__value_tensors_nbytes(v), 1000 * 24);
    weft_value_free(v);
    check_balanced();
}

Test(value, payload_copy_string_take)
{
    weft_value_t *v = NULL;
    const char bytes[] = {1, 2, 0, 4};
    const void *p;
    char *owned;
    size_t len = 0;

    cr_assert_eq(weft_value_create(&v), WEFT_OK);
    cr_assert_eq(weft_value_set_payload(v, bytes, sizeof(bytes)), WEFT_OK);
    p = weft_value_payload(v, &len);
    cr_assert_eq(len, 4);
    cr_assert_neq(p, bytes);
    cr_assert_eq(memcmp(p, bytes, 4), 0);

    cr_assert_eq(weft_value_set_string(v, "hello"), WEFT_OK);
    p = weft_value_payload(v, &len);
    cr_assert_eq(len, 5);
    cr_assert_eq(memcmp(p, "hello", 5), 0);

    /* Setting from its own payload is safe. */
    cr_assert_eq(weft_value_set_payload(v, (const char *)p + 1, 3), WEFT_OK);
    p = weft_value_payload(v, &len);
    cr_assert_eq(len, 3);
    cr_assert_eq(memcmp(p, "ell", 3), 0);

    owned = weft_strdup("taken");
    cr_assert_eq(weft_value_take_payload(v, owned, 5), WEFT_OK);
    cr_assert_eq(weft_value_payload(v, &len), owned);
    cr_assert_eq(len, 5);

    cr_assert_eq(weft_value_set_payload(v, NULL, 0), WEFT_OK);
    cr_assert_null(weft_value_payload(v, &len));
    cr_assert_eq(len, 0);
    cr_assert_eq(weft_value_set_string(v, ""), WEFT_OK);
    cr_assert_null(weft_value_payload(v, NULL));

    cr_assert_eq(weft_value_take_payload(v, weft_alloc(0), 0), WEFT_OK);
    cr_assert_null(weft_value_payload(v, &len));

    cr_assert_eq(weft_value_set_payload(v, NULL, 3), WEFT_ERR_INVALID_ARG);
    cr_assert_str_neq(weft_last_error(), "");
    cr_assert_eq(weft_value_set_string(v, NULL), WEFT_ERR_INVALID_ARG);
    weft_value_free(v);
    check_balanced();
}
