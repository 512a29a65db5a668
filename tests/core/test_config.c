/* core: the configuration table (values, defaults, aliases, validation, read once, printing). */
#include <criterion/criterion.h>
#include <criterion/redirect.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <weft/config.h>

#include "internal.h"

/* Each Test() runs in a process of its own: the first use of a variable reads it. */

Test(config, defaults_when_unset)
{
    unsetenv("WEFT_RPC_TIMEOUT_MS");
    unsetenv("WEFT_COLL_ALGO");
    unsetenv("WEFT_DIRECT");
    cr_assert_eq(weft__cfg_int(WEFT__CFG_RPC_TIMEOUT_MS), 60000);
    cr_assert_str_eq(weft__cfg_str(WEFT__CFG_COLL_ALGO), "auto");
    cr_assert(weft__cfg_bool(WEFT__CFG_DIRECT));
    cr_assert_not(weft__cfg_is_set(WEFT__CFG_RPC_TIMEOUT_MS));
}

Test(config, values_from_the_environment)
{
    setenv("WEFT_RPC_TIMEOUT_MS", "1234", 1);
    setenv("WEFT_COLL_ALGO", "ring", 1);
    setenv("WEFT_DIRECT", "off", 1);
    cr_assert_eq(weft__cfg_int(WEFT__CFG_RPC_TIMEOUT_MS), 1234);
    cr_assert(weft__cfg_is_set(WEFT__CFG_RPC_TIMEOUT_MS));
    cr_assert_str_eq(weft__cfg_str(WEFT__CFG_COLL_ALGO), "ring");
    cr_assert_not(weft__cfg_bool(WEFT__CFG_DIRECT));
    int64_t v = 0;
    cr_assert_eq(weft_config_int("WEFT_RPC_TIMEOUT_MS", &v), WEFT_OK);
    cr_assert_eq(v, 1234);
    cr_assert_str_eq(weft_config_str("WEFT_COLL_ALGO"), "ring");
}

Test(config, read_once)
{
    setenv("WEFT_PEER_TIMEOUT_MS", "3000", 1);
    cr_assert_eq(weft__cfg_int(WEFT__CFG_PEER_TIMEOUT_MS), 3000);
    setenv("WEFT_PEER_TIMEOUT_MS", "4000", 1);
    cr_assert_eq(weft__cfg_int(WEFT__CFG_PEER_TIMEOUT_MS), 3000, "a later change is not seen");
}

Test(config, aliases_in_order)
{
    unsetenv("WEFT_RANK");
    setenv("SLURM_PROCID", "5", 1);
    setenv("RANK", "3", 1);
    cr_assert_eq(weft__cfg_int(WEFT__CFG_RANK), 3, "RANK comes before SLURM_PROCID");
    unsetenv("WEFT_WORLD_SIZE");
    unsetenv("WORLD_SIZE");
    setenv("SLURM_NTASKS", "8", 1);
    cr_assert_eq(weft__cfg_int(WEFT__CFG_WORLD_SIZE), 8);
}

Test(config, the_weft_name_wins_over_aliases)
{
    setenv("WEFT_MASTER_PORT", "29500", 1);
    setenv("MASTER_PORT", "1", 1);
    cr_assert_eq(weft__cfg_int(WEFT__CFG_MASTER_PORT), 29500);
}

Test(config, invalid_values_fall_back_to_the_default, .init = cr_redirect_stderr)
{
    setenv("WEFT_RPC_TIMEOUT_MS", "12x", 1);
    setenv("WEFT_PEER_TIMEOUT_MS", "10", 1); /* below its minimum of 200 */
    setenv("WEFT_COLL_ALGO", "tree", 1);
    setenv("WEFT_DIRECT", "maybe", 1);
    cr_assert_eq(weft__cfg_int(WEFT__CFG_RPC_TIMEOUT_MS), 60000);
    cr_assert_eq(weft__cfg_int(WEFT__CFG_PEER_TIMEOUT_MS), 2000);
    cr_assert_str_eq(weft__cfg_str(WEFT__CFG_COLL_ALGO), "auto");
    cr_assert(weft__cfg_bool(WEFT__CFG_DIRECT));
    cr_assert_not(weft__cfg_is_set(WEFT__CFG_COLL_ALGO));
    fflush(stderr);
    cr_assert_stderr_eq_str(
        "[weft] warning: ignoring WEFT_RPC_TIMEOUT_MS=12x: not an integer in "
        "1..9223372036854775807; "
        "using the default 60000\n"
        "[weft] warning: ignoring WEFT_PEER_TIMEOUT_MS=10: not an integer in "
        "200..9223372036854775807; using the default 2000\n"
        "[weft] warning: ignoring WEFT_COLL_ALGO=tree: not one of auto|direct|ring|cma|oneshot; using the "
        "default auto\n"
        "[weft] warning: ignoring WEFT_DIRECT=maybe: not 0 or 1; using the default 1\n");
}

Test(config, unknown_names_and_types)
{
    int64_t v = 7;
    cr_assert_eq(weft_config_int("WEFT_NO_SUCH_THING", &v), WEFT_ERR_NOT_FOUND);
    cr_assert_eq(weft_config_int("WEFT_COLL_ALGO", &v), WEFT_ERR_INVALID_ARG);
    cr_assert_eq(v, 7);
    cr_assert_null(weft_config_str("WEFT_NO_SUCH_THING"));
    cr_assert_null(weft_config_str("WEFT_RPC_TIMEOUT_MS"));
    cr_assert_null(weft_config_str("WEFT_AUTH_TOKEN"), "a secret is never handed out by name");
}

Test(config, print_lists_every_variable_and_hides_the_secret)
{
    setenv("WEFT_AUTH_TOKEN", "s3cr3t-value", 1);
    setenv("WEFT_COLL_ALGO", "cma", 1);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    cr_assert_not_null(f);
    weft_config_print(f);
    fclose(f);
    cr_assert_null(strstr(buf, "s3cr3t-value"));
    cr_assert_not_null(strstr(buf, "WEFT_AUTH_TOKEN"));
    cr_assert_not_null(strstr(buf, "(set, hidden)"));
    cr_assert_not_null(strstr(buf, "WEFT_COLL_ALGO               = cma"));
    cr_assert_not_null(strstr(buf, "(from WEFT_COLL_ALGO)"));
    for (int i = 0; i < WEFT__CFG_COUNT; i++) {
        cr_assert_not_null(strstr(buf, weft__cfg_name((weft__cfg_id_t)i)), "%s is not printed",
                           weft__cfg_name((weft__cfg_id_t)i));
    }
    free(buf);
}
