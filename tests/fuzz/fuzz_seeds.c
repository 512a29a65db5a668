/* Writes the seed corpora of the harnesses: well-formed inputs (and a few near misses) of every
 * kind each harness takes, so that the fuzzer starts past the first checks. Deterministic: the
 * same files every run. Usage: fuzz_seeds DIR (writes DIR/<harness>/<name>). */
#include <errno.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "../../rpc/internal.h"
#include "collectives.pb-c.h"
#include "dist_autograd.pb-c.h"
#include "fuzz.h"
#include "ps.pb-c.h"
#include "rref.pb-c.h"

#define CAP 65536

static const char *root;

static void put(const char *harness, const char *name, const void *bytes, size_t len)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", root, harness);
    if (mkdir(path, 0755) != 0 && errno != EEXIST) {
        perror(path);
        exit(1);
    }
    snprintf(path, sizeof(path), "%s/%s/%s", root, harness, name);
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(bytes, 1, len, f) != len || fclose(f) != 0) {
        perror(path);
        exit(1);
    }
}

static void check(weft_status_t st)
{
    if (st != WEFT_OK) {
        fprintf(stderr, "fuzz_seeds: %s\n", weft_last_error());
        exit(1);
    }
}

/* ---- frames */

typedef struct {
    uint8_t b[CAP];
    size_t n;
} buf_t;

static void frame(buf_t *o, Weft__V1__Envelope *e, const void *body, size_t blen)
{
    size_t n = weft__v1__envelope__get_packed_size(e);
    uint8_t *p = o->b + o->n;
    p[0] = (uint8_t)n;
    p[1] = (uint8_t)(n >> 8);
    p[2] = (uint8_t)(n >> 16);
    p[3] = (uint8_t)(n >> 24);
    weft__v1__envelope__pack(e, p + 4);
    if (blen > 0) {
        memcpy(p + 4 + n, body, blen);
    }
    o->n += 4 + n + blen;
}

/* A frame carrying value @p v (payload, then tensors) and @p refs. */
static void value_frame(buf_t *o, Weft__V1__Envelope *e, const weft_value_t *v)
{
    Weft__V1__TensorMeta tm[3], *tmp[3];
    uint8_t body[CAP / 2];
    size_t blen = 0, plen = 0;
    const void *pl = v != NULL ? weft_value_payload(v, &plen) : NULL;
    size_t nt = v != NULL ? weft_value_num_tensors(v) : 0;

    if (plen > 0) {
        memcpy(body, pl, plen);
    }
    blen = plen;
    for (size_t i = 0; i < nt; i++) {
        weft_tensor_t *t = weft_value_tensor(v, i);
        weft__v1__tensor_meta__init(&tm[i]);
        tm[i].dtype = (Weft__V1__DType)weft_tensor_dtype(t);
        tm[i].n_shape = (size_t)weft_tensor_ndim(t);
        tm[i].shape = (int64_t *)weft_tensor_shape(t);
        tm[i].nbytes = weft_tensor_nbytes(t);
        tmp[i] = &tm[i];
        memcpy(body + blen, weft_tensor_data(t), tm[i].nbytes);
        blen += tm[i].nbytes;
    }
    e->payload_bytes = plen;
    e->n_tensors = nt;
    e->tensors = tmp;
    frame(o, e, body, blen);
    e->n_tensors = 0;
    e->tensors = NULL;
}

static weft_tensor_t *f32(int64_t n)
{
    weft_tensor_t *t;
    check(weft_tensor_create(WEFT_F32, 1, &n, &t));
    float *p = weft_tensor_data(t);
    for (int64_t i = 0; i < n; i++) {
        p[i] = 0.5f * (float)(i + 1);
    }
    return t;
}

static weft_value_t *str_value(const char *s, int ntensors)
{
    weft_value_t *v;
    check(weft_value_create(&v));
    if (s != NULL) {
        check(weft_value_set_string(v, s));
    }
    for (int i = 0; i < ntensors; i++) {
        check(weft_value_push_tensor(v, f32(4)));
    }
    return v;
}

/* weft_msg_pack of @p hdr with a body of @p ntensors f32[4] tensors and payload @p s. */
static weft_value_t *msg(const ProtobufCMessage *hdr, const char *s, int ntensors)
{
    weft_value_t *body = str_value(s, ntensors), *m;
    check(weft_msg_pack(hdr, body, &m));
    weft_value_free(body);
    return m;
}

/* ---- module harness inputs (fuzz_value's format) */

static void put_value(const char *harness, const char *name, uint8_t sel, weft_value_t *v)
{
    static uint8_t out[CAP];
    size_t n = fuzz_value_bytes(sel, v, out, sizeof(out));
    if (n == 0) {
        fprintf(stderr, "fuzz_seeds: %s/%s does not fit\n", harness, name);
        exit(1);
    }
    put(harness, name, out, n);
    weft_value_free(v);
}

static Weft__V1__RRefId rid(int worker, uint64_t local)
{
    Weft__V1__RRefId id = WEFT__V1__RREF_ID__INIT;
    id.worker = worker;
    id.local = local;
    return id;
}

static void rref_seeds(void)
{
    Weft__V1__RRefId r = rid(1, 100), f = rid(1, 101), tgt = rid(1, 200);
    Weft__V1__RRefCall c = WEFT__V1__RREF_CALL__INIT;
    c.rref_id = &r;
    c.fork_id = &f;
    c.create = WEFT__V1__RREF_CREATE_KIND__RREF_CREATE_FUNCTION;
    c.name = "fuzz.fn";
    put_value("rref", "remote_function", 0, msg(&c.base, "args", 1));
    c.eager_max = 65536;
    put_value("rref", "remote_function_eager", 0, msg(&c.base, "args", 1));
    c.eager_max = 0;
    c.create = WEFT__V1__RREF_CREATE_KIND__RREF_CREATE_OBJECT;
    c.name = "fuzz.T";
    c.type = "fuzz.T";
    put_value("rref", "remote_object", 0, msg(&c.base, NULL, 0));
    c.create = WEFT__V1__RREF_CREATE_KIND__RREF_CREATE_METHOD;
    c.name = "fuzz.m";
    c.type = "";
    c.target = &tgt;
    put_value("rref", "remote_method", 0, msg(&c.base, "x", 0));
    Weft__V1__RRefCall g = WEFT__V1__RREF_CALL__INIT;
    g.rref_id = &r;
    put_value("rref", "fetch", 1, msg(&g.base, NULL, 0));
    g.name = "fuzz.m";
    put_value("rref", "method", 2, msg(&g.base, "y", 1));

    Weft__V1__RRefControl k = WEFT__V1__RREF_CONTROL__INIT;
    static const Weft__V1__RRefMsgKind kinds[] = {
        WEFT__V1__RREF_MSG_KIND__RREF_FORK_REQUEST, WEFT__V1__RREF_MSG_KIND__RREF_CHILD_ACCEPT,
        WEFT__V1__RREF_MSG_KIND__RREF_USER_DELETE, WEFT__V1__RREF_MSG_KIND__RREF_ACK};
    for (int i = 0; i < 4; i++) {
        char name[32];
        k.kind = kinds[i];
        k.msg_id = (uint64_t)i + 1;
        k.rref_id = &r;
        k.fork_id = &f;
        k.status = i == 3 ? WEFT_ERR_PENDING : 0;
        snprintf(name, sizeof(name), "control_%d", (int)kinds[i]);
        weft_value_t *v;
        check(weft_value_create(&v));
        size_t n = weft__v1__rref_control__get_packed_size(&k);
        uint8_t b[256];
        weft__v1__rref_control__pack(&k, b);
        check(weft_value_set_payload(v, b, n));
        put_value("rref", name, 3, v);
    }
}

static void coll_seeds(void)
{
    Weft__V1__CollHeader h = WEFT__V1__COLL_HEADER__INIT;
    h.version = 1;
    h.src = 1;
    h.count = 4;
    h.seq = 1;
    for (int op = 0; op <= 9; op++) {
        char name[32];
        h.op = (Weft__V1__CollOp)op;
        h.seq = op == 0 ? 0 : 1;
        h.root = op == 9 ? 4 : 0;
        snprintf(name, sizeof(name), "data_op%d", op);
        put_value("collectives", name, 0, msg(&h.base, NULL, op == 1 ? 0 : 1));
    }
    h.kind = WEFT__V1__COLL_KIND__COLL_ABORT;
    h.op = WEFT__V1__COLL_OP__COLL_OP_ALL_REDUCE;
    h.tag = WEFT_ERR_TIMEOUT;
    h.error = "rank 1 gave up";
    put_value("collectives", "abort", 0, msg(&h.base, NULL, 0));
}

static void ps_seeds(void)
{
    int64_t shape[] = {8};
    int32_t servers[] = {0}, workers[] = {1};
    double hyper[] = {0.1};
    uint32_t chunks[] = {0, 1};
    uint64_t steps[] = {1};
    Weft__V1__PsTableSpec s = WEFT__V1__PS_TABLE_SPEC__INIT;
    s.name = "t";
    s.kind = WEFT__V1__PS_KIND__PS_DENSE;
    s.n_shape = 1;
    s.shape = shape;
    s.init = WEFT__V1__PS_INIT__PS_ZEROS;
    s.optimizer = WEFT__V1__PS_OPTIMIZER__PS_SGD;
    s.n_hyper = 1;
    s.hyper = hyper;
    s.consistency = WEFT__V1__PS_CONSISTENCY__PS_ASYNC;
    s.chunk_bytes = 16;
    s.n_servers = 1;
    s.servers = servers;
    s.n_workers = 1;
    s.workers = workers;
    Weft__V1__PsRequest r = WEFT__V1__PS_REQUEST__INIT;
    r.op = WEFT__V1__PS_OP__PS_CREATE;
    r.table_name = "t";
    r.spec = &s;
    put_value("ps", "create_dense", 0, msg(&r.base, NULL, 0));
    s.kind = WEFT__V1__PS_KIND__PS_SPARSE;
    s.n_shape = 0;
    s.dim = 4;
    s.name = "e";
    s.consistency = WEFT__V1__PS_CONSISTENCY__PS_BOUNDED;
    s.staleness = 2;
    s.optimizer = WEFT__V1__PS_OPTIMIZER__PS_ADAGRAD;
    put_value("ps", "create_sparse", 0, msg(&r.base, NULL, 0));
    r.spec = NULL;
    r.op = WEFT__V1__PS_OP__PS_PUSH;
    r.seq = 1;
    r.n_chunks = 2;
    r.chunks = chunks;
    put_value("ps", "push", 0, msg(&r.base, NULL, 2));
    r.op = WEFT__V1__PS_OP__PS_PULL;
    r.pushes = 1;
    put_value("ps", "pull", 0, msg(&r.base, NULL, 0));
    r.op = WEFT__V1__PS_OP__PS_PUSH_PULL;
    r.seq = 2;
    put_value("ps", "push_pull", 0, msg(&r.base, NULL, 2));
    r.n_chunks = 0;
    r.chunks = NULL;
    r.table = 1;
    r.op = WEFT__V1__PS_OP__PS_PUSH;
    {
        weft_value_t *body, *m;
        weft_tensor_t *ids;
        int64_t n = 2;
        check(weft_value_create(&body));
        check(weft_tensor_create(WEFT_I64, 1, &n, &ids));
        ((int64_t *)weft_tensor_data(ids))[1] = 7;
        check(weft_value_push_tensor(body, ids));
        int64_t rows[] = {2, 4};
        weft_tensor_t *g;
        check(weft_tensor_create(WEFT_F32, 2, rows, &g));
        check(weft_value_push_tensor(body, g));
        check(weft_msg_pack(&r.base, body, &m));
        weft_value_free(body);
        put_value("ps", "push_rows", 0, m);
    }
    r.table = 0;
    r.op = WEFT__V1__PS_OP__PS_CLOCK;
    r.clock = 1;
    r.n_step_pushes = 1;
    r.step_pushes = steps;
    put_value("ps", "clock", 0, msg(&r.base, NULL, 0));
    r.n_step_pushes = 0;
    r.step_pushes = NULL;
    r.op = WEFT__V1__PS_OP__PS_STATS;
    put_value("ps", "stats", 0, msg(&r.base, NULL, 0));
    r.op = WEFT__V1__PS_OP__PS_SAVE;
    r.dir = "ckpt";
    r.version = 1;
    put_value("ps", "save", 0, msg(&r.base, NULL, 0));
    r.op = WEFT__V1__PS_OP__PS_LOAD;
    put_value("ps", "load", 0, msg(&r.base, NULL, 0));
    r.dir = "";
    r.op = WEFT__V1__PS_OP__PS_FINISH;
    put_value("ps", "finish", 0, msg(&r.base, NULL, 0));
}

static void dist_seeds(void)
{
    uint64_t ctx = ((uint64_t)1 << 48) | 1;
    Weft__V1__DistGrad g = WEFT__V1__DIST_GRAD__INIT;
    g.context = ctx;
    g.message = 1;
    g.pass = 1;
    g.root = 1;
    g.time_left_ms = 1000;
    put_value("dist_autograd", "grad", 0, msg(&g.base, NULL, 1));
    g.context = 1;
    put_value("dist_autograd", "grad_local", 0, msg(&g.base, NULL, 2));
    Weft__V1__DistControl c = WEFT__V1__DIST_CONTROL__INIT;
    c.context = ctx;
    c.pass = 1;
    c.kind = WEFT__V1__DIST_CONTROL_KIND__DIST_FINISH;
    put_value("dist_autograd", "control_finish", 1, msg(&c.base, NULL, 0));
    c.kind = WEFT__V1__DIST_CONTROL_KIND__DIST_FAIL;
    c.status = WEFT_ERR_TIMEOUT;
    c.error = "gave up";
    put_value("dist_autograd", "control_fail", 1, msg(&c.base, NULL, 0));
    c.kind = WEFT__V1__DIST_CONTROL_KIND__DIST_RELEASE;
    put_value("dist_autograd", "control_release", 1, msg(&c.base, NULL, 0));
    Weft__V1__DistOptim o = WEFT__V1__DIST_OPTIM__INIT;
    o.op = WEFT__V1__DIST_OPTIM_OP__DIST_OPTIM_CREATE;
    o.lr = 0.1;
    o.beta1 = 0.9;
    o.beta2 = 0.999;
    o.eps = 1e-8;
    put_value("dist_autograd", "optim_create", 2, msg(&o.base, NULL, 0));
    o.op = WEFT__V1__DIST_OPTIM_OP__DIST_OPTIM_STEP;
    o.id = 1;
    o.context = ctx;
    put_value("dist_autograd", "optim_step", 2, msg(&o.base, NULL, 0));
    o.op = WEFT__V1__DIST_OPTIM_OP__DIST_OPTIM_FREE;
    put_value("dist_autograd", "optim_free", 2, msg(&o.base, NULL, 0));
}

/* ---- Hello, Join */

static EVP_PKEY *rank_key(int r)
{
    uint8_t seed[32];
    memset(seed, r + 1, sizeof(seed));
    return EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, NULL, seed, sizeof(seed));
}

static size_t hello_bytes(const Weft__V1__Hello *h, uint8_t *out)
{
    weft__v1__hello__pack(h, out);
    return weft__v1__hello__get_packed_size(h);
}

static void hello_seeds(void)
{
    static const uint8_t challenge[WEFT__CHALLENGE_BYTES];
    uint8_t key[32], sig[64], b[1024];
    weft_agent_t as;
    size_t n = sizeof(key);
    Weft__V1__Hello h = WEFT__V1__HELLO__INIT;

    memset(&as, 0, sizeof(as));
    as.rank = 1;
    as.world_size = 3;
    as.id_key = rank_key(1);
    if (as.id_key == NULL || EVP_PKEY_get_raw_public_key(as.id_key, key, &n) <= 0) {
        exit(1);
    }
    h.protocol_version = WEFT_PROTOCOL_VERSION;
    h.name = "worker1";
    h.rank = 1;
    h.address = "127.0.0.1:5001";
    h.world_size = 3;
    h.auth_token.data = (uint8_t *)"fuzz-token";
    h.auth_token.len = 10;
    h.max_message_bytes = 1 << 20;
    h.direct_address = "127.0.0.1:5002";
    h.identity_key.data = key;
    h.identity_key.len = 32;
    b[0] = 0;
    put("hello", "join", b, 1 + hello_bytes(&h, b + 1));
    for (int k = 1; k <= 2; k++) {
        check(weft__hello_sign(&as, k == 1 ? 'S' : 'D', challenge, 0, sig));
        h.proof.data = sig;
        h.proof.len = sizeof(sig);
        b[0] = (uint8_t)k;
        put("hello", k == 1 ? "stream" : "direct", b, 1 + hello_bytes(&h, b + 1));
    }
    h.proof.len = 0;
    h.protocol_version = 2;
    b[0] = 1;
    put("hello", "old_version", b, 1 + hello_bytes(&h, b + 1));
    EVP_PKEY_free(as.id_key);

    /* Join bodies for fuzz_join's master: a world of 8, the same token. */
    h.protocol_version = WEFT_PROTOCOL_VERSION;
    h.world_size = 8;
    put("join", "valid", b, hello_bytes(&h, b));
    h.rank = 3;
    h.name = "worker3";
    put("join", "valid_rank3", b, hello_bytes(&h, b));
    h.auth_token.len = 4;
    put("join", "wrong_token", b, hello_bytes(&h, b));
    h.auth_token.len = 10;
    h.identity_key.len = 31;
    put("join", "short_key", b, hello_bytes(&h, b));
    h.identity_key.len = 32;
    h.world_size = 4;
    put("join", "other_world", b, hello_bytes(&h, b));
    h.world_size = 8;
    h.name = "";
    put("join", "no_name", b, hello_bytes(&h, b));
    put("join", "garbage", "\x0a\xff\xff\xff\x0f", 5);
}

/* ---- Stream and direct frames */

static void frames_seeds(void)
{
    static buf_t o;

    /* docs/protocol.md's worked example, a REQUEST of 42 bytes */
    static const uint8_t example[] = {
        0x18, 0x00, 0x00, 0x00, 0x08, 0x03, 0x10, 0x01, 0x1a, 0x03, 0x61, 0x64, 0x64, 0x28,
        0xe0, 0xd4, 0x03, 0x40, 0x02, 0x4a, 0x05, 0x12, 0x01, 0x03, 0x18, 0x0c, 0x58, 0x01,
        0x68, 0x69, 0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0x40, 0x00, 0x00, 0x40, 0x40};
    Weft__V1__Envelope e = WEFT__V1__ENVELOPE__INIT;
    Weft__V1__RRefId r = rid(0, 5), f = rid(1, 6);
    Weft__V1__RRefFork fk = WEFT__V1__RREF_FORK__INIT;
    uint8_t fkb[256];
    Weft__V1__Ref ref = WEFT__V1__REF__INIT, *refp = &ref;
    weft_value_t *v = str_value("hi", 1);

    fk.rref_id = &r;
    fk.fork_id = &f;
    fk.owner = 0;
    fk.parent = 1;
    ref.kind = 1;
    ref.data.data = fkb;
    ref.data.len = weft__v1__rref_fork__pack(&fk, fkb);

    /* one message of several frames: each kind, a REQUEST with a reference, a refused frame */
    o.n = 0;
    e.kind = WEFT__V1__KIND__KIND_REQUEST;
    e.request_id = 1;
    e.function = "fuzz.fn";
    e.timeout_ms = 1000;
    e.src_rank = 1;
    value_frame(&o, &e, v);
    e.request_id = 2;
    e.n_refs = 1;
    e.refs = &refp;
    value_frame(&o, &e, v);
    e.n_refs = 0;
    e.refs = NULL;
    e.kind = WEFT__V1__KIND__KIND_ONEWAY;
    e.request_id = 0;
    e.function = NULL;
    e.timeout_ms = 0;
    e.channel = 64;
    value_frame(&o, &e, v);
    e.kind = WEFT__V1__KIND__KIND_RESPONSE;
    e.channel = 0;
    e.request_id = 77;
    e.status = WEFT_ERR_REMOTE;
    e.error = "no";
    value_frame(&o, &e, NULL);
    e.error = NULL;
    e.status = 0;
    buf_t mixed = o;

    /* a ONEWAY collectives piece: its payload (CollHeader) and one tensor, as a lander sees it */
    o.n = 0;
    Weft__V1__CollHeader ch = WEFT__V1__COLL_HEADER__INIT;
    ch.version = 1;
    ch.op = WEFT__V1__COLL_OP__COLL_OP_ALL_REDUCE;
    ch.seq = 1;
    ch.src = 1;
    ch.count = 4;
    weft_value_t *piece = msg(&ch.base, NULL, 1);
    memset(&e, 0, sizeof(e));
    weft__v1__envelope__init(&e);
    e.kind = WEFT__V1__KIND__KIND_ONEWAY;
    e.channel = WEFT_CHANNEL_COLLECTIVES;
    e.src_rank = 1;
    value_frame(&o, &e, piece);
    buf_t coll = o;
    weft_value_free(piece);

    /* a refused frame (dtype 99) followed by an accepted one */
    o.n = 0;
    weft__v1__envelope__init(&e);
    Weft__V1__TensorMeta tm = WEFT__V1__TENSOR_META__INIT, *tmp = &tm;
    int64_t shape[] = {2};
    tm.dtype = 99;
    tm.n_shape = 1;
    tm.shape = shape;
    tm.nbytes = 8;
    e.kind = WEFT__V1__KIND__KIND_REQUEST;
    e.request_id = 3;
    e.function = "fuzz.fn";
    e.timeout_ms = 1000;
    e.n_tensors = 1;
    e.tensors = &tmp;
    frame(&o, &e, "\0\0\0\0\0\0\0\0", 8);
    e.n_tensors = 0;
    e.tensors = NULL;
    e.request_id = 4;
    value_frame(&o, &e, v);
    buf_t refused = o;

    /* the frame reader: [limit][cut][cut] before the message */
    static uint8_t b[CAP + 3];
    const struct {
        const char *name;
        const buf_t *m;
        const uint8_t *raw;
        size_t rawn;
    } msgs[] = {{"example", NULL, example, sizeof(example)},
                {"mixed", &mixed, NULL, 0},
                {"collectives_piece", &coll, NULL, 0},
                {"refused_then_ok", &refused, NULL, 0}};
    for (size_t i = 0; i < sizeof(msgs) / sizeof(msgs[0]); i++) {
        const uint8_t *m = msgs[i].m != NULL ? msgs[i].m->b : msgs[i].raw;
        size_t n = msgs[i].m != NULL ? msgs[i].m->n : msgs[i].rawn;
        char name[64];
        /* no limit, bodies skipped, one slice | a limit of 640, bodies read, cut in three */
        b[0] = 0;
        b[1] = 0;
        b[2] = 0;
        memcpy(b + 3, m, n);
        snprintf(name, sizeof(name), "%s_skip", msgs[i].name);
        put("frames", name, b, n + 3);
        b[0] = 11;
        b[1] = 5;
        b[2] = 47;
        snprintf(name, sizeof(name), "%s_read", msgs[i].name);
        put("frames", name, b, n + 3);
        put("stream", msgs[i].name, m, n);
        b[0] = 1; /* direct: after an accepted handshake */
        memcpy(b + 1, m, n);
        put("direct", msgs[i].name, b, n + 1);
    }

    /* direct handshakes (mode 0): well formed with a proof of zeros, a bad magic, cut short */
    uint8_t key[32] = {0}, sig[64] = {0};
    Weft__V1__Hello h = WEFT__V1__HELLO__INIT;
    h.protocol_version = WEFT_PROTOCOL_VERSION;
    h.name = "rawpeer";
    h.rank = 2;
    h.world_size = 3;
    h.address = "127.0.0.1:1";
    h.identity_key.data = key;
    h.identity_key.len = 32;
    h.proof.data = sig;
    h.proof.len = 64;
    size_t hn = weft__v1__hello__get_packed_size(&h);
    b[0] = 0;
    b[1] = 0x57; /* "WFTB" */
    b[2] = 0x46;
    b[3] = 0x54;
    b[4] = 0x42;
    b[5] = 2;
    b[6] = b[7] = b[8] = 0;
    b[9] = (uint8_t)hn;
    b[10] = (uint8_t)(hn >> 8);
    b[11] = b[12] = 0;
    weft__v1__hello__pack(&h, b + 13);
    put("direct", "handshake", b, 13 + hn);
    put("direct", "handshake_cut", b, 13 + hn / 2);
    b[1] = 0x58;
    put("direct", "handshake_bad_magic", b, 13 + hn);
    weft_value_free(v);
}

/* ---- sealed records (fuzz_seal.c: mode | flip_hi | flip_lo | read seed | the rest) */

static void seal_seeds(void)
{
    uint8_t b[6000];
    size_t n;

    /* Sealed: frames cut at 0xff, sharing records; a large one read in place. */
    n = 0;
    memcpy(b, "\x01\x00\x00\x05hello\xffworld\xff", 16);
    n = 16;
    for (int i = 0; i < 5000; i++) {
        b[n++] = (uint8_t)(i % 251);
    }
    put("seal", "sealed_shared_records", b, n);
    /* One record per frame. */
    b[0] = 0x03;
    put("seal", "sealed_record_per_frame", b, n);
    /* Epochs of 64 bytes: many key changes. */
    n = 4;
    memcpy(b, "\x07\x00\x00\x09", 4);
    for (int i = 0; i < 1000; i++) {
        b[n++] = i % 30 == 29 ? 0xff : (uint8_t)('a' + i % 26);
    }
    put("seal", "sealed_epochs_of_64", b, n);
    /* One bit flipped: in the ciphertext of the first record. */
    b[0] = 0x81;
    b[1] = 0;
    b[2] = 0x24;
    put("seal", "sealed_flipped", b, 200);
    /* Raw: a record's shape with a tag the reader cannot accept, and lengths out of range. */
    n = 4;
    memcpy(b, "\x00\x00\x00\x01", 4);
    weft__put_u32(b + n, 40);
    n += 4;
    memset(b + n, 0x5a, 56);
    n += 56;
    put("seal", "raw_record", b, n);
    weft__put_u32(b + 4, 0);
    put("seal", "raw_length_0", b, n);
    weft__put_u32(b + 4, (uint32_t)WEFT__SEAL_MAX + 1);
    put("seal", "raw_length_over", b, n);
    weft__put_u32(b + 4, 9000);
    put("seal", "raw_record_cut", b, n);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    root = argv[1];
    if (mkdir(root, 0755) != 0 && errno != EEXIST) {
        perror(root);
        return 1;
    }
    frames_seeds();
    hello_seeds();
    seal_seeds();
    rref_seeds();
    coll_seeds();
    ps_seeds();
    dist_seeds();
    return 0;
}
