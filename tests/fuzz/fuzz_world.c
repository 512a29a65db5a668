/* The world of the live harnesses and the value format of the module harnesses (fuzz.h). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"

static fuzz_world_t world;
static pthread_once_t world_once = PTHREAD_ONCE_INIT;

static void flush_handler(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, NULL);
}

/* rref's registered function, type and method, so that fuzzed creations and method calls reach
 * the code behind the name checks. */
static void echo_handler(weft_call_t *call, void *arg)
{
    (void)arg;
    weft_call_reply(call, weft_call_take_args(call));
}

static weft_status_t obj_ctor(const weft_value_t *args, void *type_arg, void **obj_p)
{
    (void)args;
    (void)type_arg;
    *obj_p = malloc(1);
    return *obj_p != NULL ? WEFT_OK : WEFT_ERR_NO_MEMORY;
}

static void obj_dtor(void *obj, void *type_arg)
{
    (void)type_arg;
    free(obj);
}

static void obj_method(void *obj, weft_call_t *call, void *type_arg)
{
    (void)obj;
    (void)type_arg;
    weft_call_reply(call, weft_call_take_args(call));
}

static void fail(const char *what, weft_status_t st)
{
    fprintf(stderr, "fuzz world: %s: %s (%s)\n", what, weft_strerror(st), weft_last_error());
    abort();
}

static weft_agent_t *make(int rank, int port, bool modules)
{
    weft_agent_opts_t o;
    weft_agent_t *a;
    static const weft_rref_method_t methods[] = {{"fuzz.m", obj_method}};
    int servers[] = {0}, workers[] = {1};
    weft_ps_opts_t po;
    weft_ps_t *ps;
    weft_status_t st;

    weft_agent_opts_init(&o);
    o.rank = rank;
    o.world_size = 3;
    o.master_addr = "127.0.0.1";
    o.master_port = port;
    o.auth_token = "";
    o.rendezvous_timeout_ms = 20000;
    if ((st = weft_agent_create(&o, &a)) != WEFT_OK) {
        fail("agent", st);
    }
    if (!modules) {
        return a;
    }
    weft_ps_opts_init(&po);
    po.servers = servers;
    po.n_servers = 1;
    po.workers = workers;
    po.n_workers = 1;
    if ((st = weft_rpc_register(a, "fuzz.flush", flush_handler, NULL)) != WEFT_OK ||
        (st = weft_rpc_register(a, "fuzz.fn", echo_handler, NULL)) != WEFT_OK ||
        (st = weft_rref_init(a)) != WEFT_OK ||
        (st = weft_rref_register_type(a, "fuzz.T", obj_ctor, obj_dtor, methods, 1, NULL)) !=
            WEFT_OK ||
        (st = weft_ps_create(a, &po, &ps)) != WEFT_OK || (st = weft_dist_init(a)) != WEFT_OK) {
        fail("modules", st);
    }
    return a;
}

static void *join_main(void *arg)
{
    weft_status_t st = weft_agent_join(arg);
    if (st != WEFT_OK) {
        fail("join", st);
    }
    return NULL;
}

/* At exit, before OpenSSL's own exit handler (registered earlier, so run later) takes its locks
 * away from threads that still use them: the agents stop first, and what they leave behind is a
 * leak LeakSanitizer reports. */
static void world_stop(void)
{
    weft_pg_free(world.pg);
    weft_agent_free(world.raw);
    weft_agent_free(world.sender);
    weft_agent_free(world.target);
}

static void world_start(void)
{
    pthread_t t[2];
    weft_status_t st;

    /* The harnesses speak for rank 2 on raw streams and direct connections: its agent opens no
     * shared-memory ring (nor the stream beside it) of its own. */
    setenv("WEFT_SHM", "0", 1);
    if (getenv("WEFT_LOG") == NULL) {
        weft_log_set_level(WEFT_LOG_OFF); /* refusals are logged: millions of lines */
    }
    world.target = make(0, 0, true);
    world.sender = make(1, weft_agent_port(world.target), true);
    world.raw = make(2, weft_agent_port(world.target), false);
    if (pthread_create(&t[0], NULL, join_main, world.target) != 0 ||
        pthread_create(&t[1], NULL, join_main, world.sender) != 0) {
        abort();
    }
    join_main(world.raw);
    pthread_join(t[0], NULL);
    pthread_join(t[1], NULL);
    if ((st = weft_pg_world(world.target, &world.pg)) != WEFT_OK) {
        fail("process group", st);
    }
    atexit(world_stop);
}

const fuzz_world_t *fuzz_world(void)
{
    pthread_once(&world_once, world_start);
    return &world;
}

void fuzz_flush(void)
{
    weft_value_t *r = NULL;
    weft_status_t st = weft_rpc_sync(fuzz_world()->sender, 0, "fuzz.flush", NULL, FUZZ_WAIT_MS, &r);
    if (st != WEFT_OK) {
        fail("the target did not answer fuzz.flush", st);
    }
    weft_value_free(r);
}

weft_value_t *fuzz_value(const uint8_t *data, size_t size, uint8_t *sel_p)
{
    weft_value_t *v;
    size_t off = 2;
    int n;
    struct {
        int dtype, ndim;
        int64_t shape[2];
    } spec[3];

    if (size < 2) {
        return NULL;
    }
    n = data[1] & 3;
    for (int i = 0; i < n; i++) {
        if (off + 2 > size) {
            return NULL;
        }
        spec[i].dtype = data[off] % 9;
        spec[i].ndim = data[off + 1] % 3;
        off += 2;
        for (int d = 0; d < spec[i].ndim; d++) {
            if (off >= size) {
                return NULL;
            }
            spec[i].shape[d] = data[off++] % 9;
        }
    }
    if (off + 2 > size) {
        return NULL;
    }
    size_t plen = (size_t)data[off] | ((size_t)data[off + 1] << 8);
    off += 2;
    if (plen > size - off) {
        plen = size - off;
    }
    if (weft_value_create(&v) != WEFT_OK) {
        abort();
    }
    if (plen > 0 && weft_value_set_payload(v, data + off, plen) != WEFT_OK) {
        abort();
    }
    off += plen;
    const uint8_t *pool = data + off;
    size_t npool = size - off, at = 0;
    for (int i = 0; i < n; i++) {
        weft_tensor_t *t;
        if (weft_tensor_create((weft_dtype_t)spec[i].dtype, spec[i].ndim, spec[i].shape, &t) !=
            WEFT_OK) {
            abort();
        }
        uint8_t *p = weft_tensor_data(t);
        size_t nb = weft_tensor_nbytes(t);
        for (size_t k = 0; k < nb && npool > 0; k++) {
            p[k] = pool[at];
            at = at + 1 == npool ? 0 : at + 1;
        }
        if (weft_value_push_tensor(v, t) != WEFT_OK) {
            abort();
        }
    }
    *sel_p = data[0];
    return v;
}

size_t fuzz_value_bytes(uint8_t sel, const weft_value_t *v, uint8_t *out, size_t cap)
{
    size_t n = weft_value_num_tensors(v), plen = 0, off = 2;
    const uint8_t *pl = weft_value_payload(v, &plen);

    if (n > 3 || plen > 0xffff || cap < 4) {
        return 0;
    }
    out[0] = sel;
    out[1] = (uint8_t)n;
    for (size_t i = 0; i < n; i++) {
        weft_tensor_t *t = weft_value_tensor(v, i);
        int nd = weft_tensor_ndim(t);
        const int64_t *sh = weft_tensor_shape(t);
        if (nd > 2 || off + 2 + (size_t)nd > cap) {
            return 0;
        }
        out[off++] = (uint8_t)weft_tensor_dtype(t);
        out[off++] = (uint8_t)nd;
        for (int d = 0; d < nd; d++) {
            if (sh[d] > 8) {
                return 0;
            }
            out[off++] = (uint8_t)sh[d];
        }
    }
    if (off + 2 + plen > cap) {
        return 0;
    }
    out[off++] = (uint8_t)plen;
    out[off++] = (uint8_t)(plen >> 8);
    if (plen > 0) {
        memcpy(out + off, pl, plen);
    }
    off += plen;
    /* The tensors' bytes, one after the other (the pool is cycled: this is exact). */
    for (size_t i = 0; i < n; i++) {
        weft_tensor_t *t = weft_value_tensor(v, i);
        size_t nb = weft_tensor_nbytes(t);
        if (off + nb > cap) {
            return 0;
        }
        memcpy(out + off, weft_tensor_data(t), nb);
        off += nb;
    }
    return off;
}
