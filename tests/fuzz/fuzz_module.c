/* The messages of weft's modules as their handlers receive them, through real calls and one-way
 * messages from rank 1 to rank 0 (the world of fuzz.h): the header (each module's protobuf message
 * after weft_msg_pack's u32 length) and body (payload, tensors) come from the input, and everything
 * the handlers do with them after unpacking is what is fuzzed. Built once per module, by
 * FUZZ_MODULE:
 *   1 rref          weft.rref.remote, weft.rref.fetch, weft.rref.method (RRefCall), channel 1
 *                   (RRefControl): rref/remote.c, rref/fork.c, rref/proto.c
 *   2 collectives   channel 2 (CollHeader and the piece's tensor): collectives/context.c
 *   3 ps            __weft.ps (PsRequest and its tensors): ps/server.c, ps/store.c
 *   4 dist_autograd __weft.dist.grad (DistGrad), __weft.dist.control (DistControl),
 *                   __weft.dist.optim (DistOptim): dist_autograd/
 * A one-way message is followed by fuzz_flush, so that the input is handled before the next one.
 *
 * Input: fuzz_value's format (fuzz.h); the selector picks the function or channel. */
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "fuzz.h"
#include "ps.pb-c.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

typedef struct {
    const char *fn;   /* a function, or NULL: */
    uint32_t channel; /* a one-way message on this channel */
} target_t;

#if FUZZ_MODULE == 1
static const target_t targets[] = {
    {"weft.rref.remote", 0}, {"weft.rref.fetch", 0}, {"weft.rref.method", 0}, {NULL, 1}};
#elif FUZZ_MODULE == 2
static const target_t targets[] = {{NULL, 2}};
#elif FUZZ_MODULE == 3
static const target_t targets[] = {{"__weft.ps", 0}};
#elif FUZZ_MODULE == 4
static const target_t targets[] = {
    {"__weft.dist.grad", 0}, {"__weft.dist.control", 0}, {"__weft.dist.optim", 0}};
#else
#error "FUZZ_MODULE: 1 rref, 2 collectives, 3 ps, 4 dist_autograd"
#endif

#if FUZZ_MODULE == 3
/* PS_SAVE and PS_LOAD name a directory the server writes or reads: every fuzzed one is replaced by
 * a temporary directory of the run's, removed at exit. */
static char ckpt_dir[] = "/tmp/weft-fuzz-ps-XXXXXX";

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

static void remove_ckpt_dir(void)
{
    (void)nftw(ckpt_dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static weft_value_t *confine_dir(weft_value_t *v)
{
    static bool made;
    struct ProtobufCMessage *m = NULL;
    weft_value_t *body = NULL, *out = NULL;

    if (!made) {
        if (mkdtemp(ckpt_dir) == NULL) {
            abort();
        }
        atexit(remove_ckpt_dir);
        made = true;
    }
    if (weft_msg_unpack(v, &weft__v1__ps_request__descriptor, &m, NULL) != WEFT_OK) {
        return v; /* the server cannot read it either */
    }
    Weft__V1__PsRequest *r = (Weft__V1__PsRequest *)m;
    if (r->op != WEFT__V1__PS_OP__PS_SAVE && r->op != WEFT__V1__PS_OP__PS_LOAD) {
        weft_msg_header_free(m);
        return v; /* as it came: only these two read dir */
    }
    char *dir = r->dir;
    r->dir = ckpt_dir;
    if (weft_msg_body(v, &body) == WEFT_OK && weft_msg_pack(m, body, &out) == WEFT_OK) {
        weft_value_free(v);
        v = out;
    }
    r->dir = dir;
    weft_value_free(body);
    weft_msg_header_free(m);
    return v;
}
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int verbose = -1;
    const fuzz_world_t *w = fuzz_world();
    uint8_t sel = 0;

    if (verbose < 0) {
        verbose = getenv("WEFT_FUZZ_VERBOSE") != NULL; /* each call's outcome, on stderr */
    }
    weft_value_t *v = fuzz_value(data, size, &sel);

    if (v == NULL) {
        return 0;
    }
#if FUZZ_MODULE == 3
    v = confine_dir(v);
#endif
    const target_t *t = &targets[sel % (sizeof(targets) / sizeof(targets[0]))];
    if (t->fn != NULL) {
        weft_value_t *r = NULL;
        weft_status_t st = weft_rpc_sync(w->sender, 0, t->fn, v, FUZZ_CALL_MS, &r);
        /* -7 is an answer too: rref creates with the function the header names. */
        if (st == WEFT_ERR_PEER_LOST || st == WEFT_ERR_SHUTDOWN) {
            fprintf(stderr, "fuzz_module: %s: the world broke: %s (%s)\n", t->fn, weft_strerror(st),
                    weft_last_error());
            abort();
        }
        if (verbose) {
            fprintf(stderr, "fuzz_module: %s: %s (%s)\n", t->fn, weft_strerror(st),
                    st != WEFT_OK ? weft_last_error() : "");
        }
        weft_value_free(r);
    } else {
        weft_status_t st = weft_agent_send(w->sender, 0, t->channel, v, NULL);
        if (st != WEFT_OK && st != WEFT_ERR_INVALID_ARG) {
            fprintf(stderr, "fuzz_module: channel %u: %s (%s)\n", t->channel, weft_strerror(st),
                    weft_last_error());
            abort();
        }
        if (verbose) {
            fprintf(stderr, "fuzz_module: channel %u: %s\n", t->channel, weft_strerror(st));
        }
        fuzz_flush();
    }
    weft_value_free(v);
    return 0;
}
