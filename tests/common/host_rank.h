/* What the rank programs of the multi-host tests (tests/tools/multinode_rank.c,
 * tests/netns/netns_rank.c) share: their functions and small helpers. Header only: those
 * programs link weft alone, not the criterion harness. */
#ifndef WEFT_TEST_HOST_RANK_H
#define WEFT_TEST_HOST_RANK_H

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include <weft/weft.h>

/* whoami() -> this worker's name */
static inline void fn_whoami(weft_call_t *call, void *arg)
{
    weft_value_t *v;

    (void)arg;
    if (weft_value_create(&v) != WEFT_OK) {
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "no memory");
        return;
    }
    weft_value_set_string(v, weft_agent_name(weft_call_agent(call)));
    weft_call_reply(call, v);
}

/* echo(anything) -> the same value */
static inline void fn_echo(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, weft_call_take_args(call));
}

/* An integer from the environment, -1 when unset. */
static inline int env_int(const char *name)
{
    const char *s = getenv(name);
    return s != NULL ? atoi(s) : -1;
}

/* Whether @p address is "@p host:<port>". */
static inline bool at_host(const char *address, const char *host)
{
    size_t n = strlen(host);
    return address != NULL && strncmp(address, host, n) == 0 && address[n] == ':' &&
           atoi(address + n + 1) > 0;
}

#endif
