/* References in messages: the registry of reference codecs (a module's, weft/module.h), the
 * encoding of a value's references into an envelope and their decoding on receipt, the objects a
 * rank sends to itself (kept in a table, never encoded), and the wait of a request for the
 * objects of its arguments to be ready. The agent knows nothing of what the objects are. */
#include <stdio.h>
#include <string.h>

#include "internal.h"

#define NKINDS       16 /* kinds 1..15 */
#define SELF_BUCKETS 64

typedef struct {
    weft_ref_codec_t codec;
    void *state;
    _Atomic bool set; /* written once, after codec and state */
} slot_t;

/* An object this rank sent to itself: kept here, retained, until the receiving side takes it. */
typedef struct self_ref {
    struct self_ref *next;
    uint64_t token;
    const weft_value_ref_type_t *type;
    void *obj;
} self_ref_t;

struct weft__refs {
    pthread_mutex_t mu; /* registration and the self table */
    slot_t slots[NKINDS];
    self_ref_t *self[SELF_BUCKETS];
    uint64_t next_token;
};

typedef struct {
    const weft_value_ref_type_t *type;
    void *obj; /* retained while the record lives (for unsent); NULL for a self token */
    void *bytes;
    size_t len;
    uint64_t token;
    uint8_t tok[8];
} out_ref_t;

struct weft__refs_out {
    weft_agent_t *a;
    int to;
    bool self;
    size_t n; /* references encoded (or kept) so far */
    out_ref_t *refs;
    Weft__V1__Ref *pb;
    Weft__V1__Ref **pbp;
};

static struct weft__refs *refs_get(weft_agent_t *a)
{
    return atomic_load(&a->refs);
}

/* The registry, made on first use. NULL when out of memory. */
static struct weft__refs *refs_make(weft_agent_t *a)
{
    struct weft__refs *r = refs_get(a);
    struct weft__refs *expected = NULL;

    if (r != NULL) {
        return r;
    }
    r = weft_calloc(1, sizeof(*r));
    if (r == NULL) {
        return NULL;
    }
    pthread_mutex_init(&r->mu, NULL);
    r->next_token = 1;
    if (!atomic_compare_exchange_strong(&a->refs, &expected, r)) {
        pthread_mutex_destroy(&r->mu);
        weft_free(r);
        return expected;
    }
    return r;
}

static const slot_t *codec_for(weft_agent_t *a, uint32_t kind)
{
    struct weft__refs *r = refs_get(a);

    if (r == NULL || kind < 1 || kind >= NKINDS || !atomic_load(&r->slots[kind].set)) {
        return NULL;
    }
    return &r->slots[kind];
}

weft_status_t weft__refs_check_codec(weft_agent_t *a, const weft_ref_codec_t *codec)
{
    if (codec->encode == NULL || codec->decode == NULL || codec->type == NULL ||
        codec->type->retain == NULL || codec->type->release == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "module: a codec needs encode, decode and a "
                                                     "type with retain and release");
    }
    uint32_t kind = codec->type->kind;
    if (kind < 1 || kind >= NKINDS) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "module: codec kind %u out of 1..%d", kind,
                               NKINDS - 1);
    }
    if (codec_for(a, kind) != NULL) {
        return weft__set_error(WEFT_ERR_ALREADY_EXISTS, "module: kind %u has a codec already",
                               kind);
    }
    if (refs_make(a) == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "module: no memory for a codec");
    }
    return WEFT_OK;
}

void weft__refs_register(weft_agent_t *a, const weft_ref_codec_t *codec, void *state)
{
    struct weft__refs *r = refs_get(a); /* made by weft__refs_check_codec */
    slot_t *s = &r->slots[codec->type->kind];

    pthread_mutex_lock(&r->mu);
    s->codec = *codec;
    s->state = state;
    atomic_store(&s->set, true);
    pthread_mutex_unlock(&r->mu);
}

/* ------------------------------------------------------------ the self table */

static size_t self_bucket(uint64_t token)
{
    return (size_t)((token * 0x9E3779B97F4A7C15ull) >> 58) % SELF_BUCKETS;
}

/* Keeps @p obj (retained) for a message to this rank; its token goes to @p token_p. */
static weft_status_t self_put(struct weft__refs *r, const weft_value_ref_type_t *type, void *obj,
                              uint64_t *token_p)
{
    self_ref_t *e = weft_alloc(sizeof(*e));

    if (e == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rpc: no memory for a reference");
    }
    type->retain(obj);
    e->type = type;
    e->obj = obj;
    pthread_mutex_lock(&r->mu);
    e->token = r->next_token++;
    size_t b = self_bucket(e->token);
    e->next = r->self[b];
    r->self[b] = e;
    pthread_mutex_unlock(&r->mu);
    *token_p = e->token;
    return WEFT_OK;
}

/* Takes the entry of @p token out of the table (NULL if it is not there). */
static self_ref_t *self_take(struct weft__refs *r, uint64_t token)
{
    self_ref_t *e = NULL;

    if (r == NULL) {
        return NULL;
    }
    pthread_mutex_lock(&r->mu);
    for (self_ref_t **pp = &r->self[self_bucket(token)]; *pp != NULL; pp = &(*pp)->next) {
        if ((*pp)->token == token) {
            e = *pp;
            *pp = e->next;
            break;
        }
    }
    pthread_mutex_unlock(&r->mu);
    return e;
}

static void put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) {
        p[i] = (uint8_t)(v >> (8 * i));
    }
}

static uint64_t get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) {
        v |= (uint64_t)p[i] << (8 * i);
    }
    return v;
}

/* The text a codec left for its error @p st, or the status's own. */
static const char *codec_text(weft_status_t st)
{
    const char *t = weft_last_error();
    return t[0] != '\0' ? t : weft_strerror(st);
}

/* ------------------------------------------------------------------ sending */

void weft__refs_out_free(weft__refs_out_t *o, bool sent)
{
    if (o == NULL) {
        return;
    }
    for (size_t i = 0; i < o->n; i++) {
        out_ref_t *x = &o->refs[i];
        if (o->self) {
            /* Taken already when the message arrived; otherwise drop it now. */
            self_ref_t *e = sent ? NULL : self_take(refs_get(o->a), x->token);
            if (e != NULL) {
                e->type->release(e->obj);
                weft_free(e);
            }
            continue;
        }
        if (!sent) {
            const slot_t *s = codec_for(o->a, x->type->kind);
            if (s != NULL && s->codec.unsent != NULL) {
                s->codec.unsent(s->state, o->a, o->to, x->obj, x->bytes, x->len);
            }
        }
        weft_free(x->bytes);
        x->type->release(x->obj);
    }
    weft_free(o->refs);
    weft_free(o->pb);
    weft_free(o->pbp);
    weft_free(o);
}

/* Fails an encoding: unsent for what was encoded, then the error (whose text the codecs'
 * callbacks might have replaced meanwhile). */
static weft_status_t encode_fail(weft__refs_out_t *o, weft_status_t st)
{
    char why[WEFT__ERROR_MAX];

    snprintf(why, sizeof(why), "%s", weft_last_error());
    weft__refs_out_free(o, false);
    return weft__set_error(st, "%s", why);
}

weft_status_t weft__refs_encode(weft_agent_t *a, int to, const weft_value_t *v,
                                Weft__V1__Envelope *env, weft__refs_out_t **out_p)
{
    size_t n = weft_value_num_refs(v);
    weft__refs_out_t *o;

    *out_p = NULL;
    env->n_refs = 0;
    env->refs = NULL;
    if (n == 0) {
        return WEFT_OK;
    }
    if (n > WEFT__MAX_REFS) {
        return weft__set_error(WEFT_ERR_TOO_LARGE, "rpc: %zu references in one message (max %d)", n,
                               WEFT__MAX_REFS);
    }
    o = weft_calloc(1, sizeof(*o));
    if (o == NULL || (o->refs = weft_calloc(n, sizeof(*o->refs))) == NULL ||
        (o->pb = weft_calloc(n, sizeof(*o->pb))) == NULL ||
        (o->pbp = weft_calloc(n, sizeof(*o->pbp))) == NULL) {
        if (o != NULL) {
            weft_free(o->refs);
            weft_free(o->pb);
        }
        weft_free(o);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rpc: no memory for %zu references", n);
    }
    o->a = a;
    o->to = to;
    o->self = to == a->rank;
    for (size_t i = 0; i < n; i++) {
        const weft_value_ref_type_t *type = NULL;
        void *obj = weft__value_ref_at(v, i, &type);
        const slot_t *s = codec_for(a, type->kind);
        out_ref_t *x = &o->refs[i];

        if (s == NULL) {
            weft__set_error(WEFT_ERR_UNSUPPORTED,
                            "rpc: reference %zu is of kind %u, which has no codec registered", i,
                            type->kind);
            return encode_fail(o, WEFT_ERR_UNSUPPORTED);
        }
        x->type = type;
        if (o->self) {
            weft_status_t st = self_put(refs_get(a), type, obj, &x->token);
            if (st != WEFT_OK) {
                return encode_fail(o, st);
            }
            put_u64(x->tok, x->token);
            o->n++;
        } else {
            void *bytes = NULL;
            size_t len = 0;
            weft__clear_error();
            weft_status_t st = s->codec.encode(s->state, a, to, obj, &bytes, &len);
            if (st != WEFT_OK) {
                weft__set_error(st, "rpc: reference %zu (kind %u) for rank %d: %s", i, type->kind,
                                to, codec_text(st));
                return encode_fail(o, st);
            }
            type->retain(obj);
            x->obj = obj;
            x->bytes = bytes;
            x->len = len;
            o->n++; /* encoded: unsent from here on */
            if (len > WEFT__MAX_REF_BYTES || (bytes == NULL && len > 0)) {
                weft__set_error(WEFT_ERR_TOO_LARGE,
                                "rpc: reference %zu (kind %u) encodes to %zu bytes (max %d)", i,
                                type->kind, len, WEFT__MAX_REF_BYTES);
                return encode_fail(o, WEFT_ERR_TOO_LARGE);
            }
        }
        Weft__V1__Ref *pb = &o->pb[i];
        weft__v1__ref__init(pb);
        pb->kind = type->kind;
        pb->data.data = o->self ? x->tok : x->bytes;
        pb->data.len = o->self ? sizeof(x->tok) : x->len;
        o->pbp[i] = pb;
    }
    env->n_refs = n;
    env->refs = o->pbp;
    *out_p = o;
    return WEFT_OK;
}

/* ---------------------------------------------------------------- receiving */

/* Decodes one reference from @p src into an object (one reference) of *type_p, and its future
 * (NULL: ready). */
static weft_status_t decode_one(weft_agent_t *a, int src, size_t i, uint32_t kind,
                                const uint8_t *data, size_t len,
                                const weft_value_ref_type_t **type_p, void **obj_p,
                                weft_future_t **ready_p)
{
    const slot_t *s = codec_for(a, kind);

    *ready_p = NULL;
    if (s == NULL) {
        return weft__set_error(WEFT_ERR_PROTOCOL,
                               "rpc: reference %zu from rank %d is of kind %u, which has no codec "
                               "on %s",
                               i, src, kind, a->name);
    }
    if (len > WEFT__MAX_REF_BYTES) {
        return weft__set_error(WEFT_ERR_PROTOCOL,
                               "rpc: reference %zu (kind %u) from rank %d has %zu bytes (max %d)",
                               i, kind, src, len, WEFT__MAX_REF_BYTES);
    }
    if (src == a->rank) {
        /* From this rank itself: the object that was kept for it. */
        self_ref_t *e = len == 8 ? self_take(refs_get(a), get_u64(data)) : NULL;
        if (e == NULL) {
            return weft__set_error(WEFT_ERR_PROTOCOL,
                                   "rpc: reference %zu (kind %u) sent by this rank to itself is "
                                   "not one it kept",
                                   i, kind);
        }
        if (e->type->kind != kind) {
            e->type->release(e->obj);
            weft_free(e);
            return weft__set_error(WEFT_ERR_PROTOCOL,
                                   "rpc: reference %zu sent by this rank to itself changed kind",
                                   i);
        }
        *type_p = e->type;
        *obj_p = e->obj;
        weft_free(e);
        return WEFT_OK;
    }
    void *obj = NULL;
    weft_future_t *f = NULL;
    weft__clear_error();
    weft_status_t st = s->codec.decode(s->state, a, src, data, len, &obj, &f);
    if (st == WEFT_OK && obj == NULL) {
        weft_future_release(f);
        st = weft__set_error(WEFT_ERR_INVALID_STATE, "the codec decoded no object");
    }
    if (st != WEFT_OK) {
        return weft__set_error(st, "rpc: reference %zu (kind %u) from rank %d: %s", i, kind, src,
                               codec_text(st));
    }
    *type_p = s->codec.type;
    *obj_p = obj;
    *ready_p = f;
    return WEFT_OK;
}

/* The first error of a walk over references (the walk goes on: every reference is offered to
 * its codec, so that what its sender recorded is settled by the release that follows). */
typedef struct {
    weft_status_t st;
    char text[WEFT__ERROR_MAX];
} first_error_t;

static void note_error(first_error_t *e, weft_status_t st)
{
    if (e->st == WEFT_OK) {
        e->st = st;
        snprintf(e->text, sizeof(e->text), "%s", weft_last_error());
    }
}

static void release_futures(weft_future_t **futs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        weft_future_release(futs[i]);
    }
    weft_free(futs);
}

weft_status_t weft__refs_decode(weft_agent_t *a, int src, const Weft__V1__Envelope *env,
                                weft_value_t *v, weft_future_t ***ready_p, size_t *nready_p)
{
    size_t n = env->n_refs;
    weft_future_t **futs = NULL;
    size_t nf = 0;
    first_error_t err = {WEFT_OK, ""};

    *ready_p = NULL;
    *nready_p = 0;
    if (n == 0) {
        return WEFT_OK;
    }
    if (n > WEFT__MAX_REFS) {
        return weft__set_error(WEFT_ERR_PROTOCOL,
                               "rpc: message from rank %d has %zu references (max %d)", src, n,
                               WEFT__MAX_REFS);
    }
    futs = weft_calloc(n, sizeof(*futs));
    if (futs == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "rpc: no memory for %zu references", n);
    }
    for (size_t i = 0; i < n; i++) {
        const Weft__V1__Ref *ref = env->refs[i];
        const weft_value_ref_type_t *type = NULL;
        void *obj = NULL;
        weft_future_t *f = NULL;
        weft_status_t st =
            decode_one(a, src, i, ref->kind, ref->data.data, ref->data.len, &type, &obj, &f);
        if (st == WEFT_OK && weft__value_push_ref(v, type, obj) != WEFT_OK) {
            type->release(obj);
            weft_future_release(f);
            f = NULL;
            st = weft__set_error(WEFT_ERR_NO_MEMORY, "rpc: no memory for a reference");
        }
        if (st != WEFT_OK) {
            note_error(&err, st);
        } else if (f != NULL) {
            futs[nf++] = f;
        }
    }
    if (err.st != WEFT_OK) {
        release_futures(futs, nf);
        return weft__set_error(err.st, "%s", err.text);
    }
    if (nf == 0) {
        weft_free(futs);
        return WEFT_OK;
    }
    *ready_p = futs;
    *nready_p = nf;
    return WEFT_OK;
}

/* A reference as it came in a ONEWAY frame, until weft__refs_decode_raw. */
typedef struct {
    _Atomic int refs;
    uint32_t kind;
    size_t len;
    uint8_t data[];
} raw_t;

static void raw_retain(void *obj)
{
    atomic_fetch_add(&((raw_t *)obj)->refs, 1);
}

static void raw_release(void *obj)
{
    raw_t *r = obj;
    if (atomic_fetch_sub(&r->refs, 1) == 1) {
        weft_free(r);
    }
}

static const weft_value_ref_type_t raw_type = {0, raw_retain, raw_release};

weft_status_t weft__refs_keep_raw(const Weft__V1__Envelope *env, weft_value_t *v)
{
    if (env->n_refs > WEFT__MAX_REFS) {
        return weft__set_error(WEFT_ERR_PROTOCOL, "rpc: message with %zu references (max %d)",
                               env->n_refs, WEFT__MAX_REFS);
    }
    for (size_t i = 0; i < env->n_refs; i++) {
        const Weft__V1__Ref *ref = env->refs[i];
        if (ref->data.len > WEFT__MAX_REF_BYTES) {
            return weft__set_error(WEFT_ERR_PROTOCOL,
                                   "rpc: reference %zu (kind %u) has %zu bytes (max %d)", i,
                                   ref->kind, ref->data.len, WEFT__MAX_REF_BYTES);
        }
        raw_t *r = weft_alloc(sizeof(*r) + ref->data.len);
        if (r == NULL) {
            return weft__set_error(WEFT_ERR_NO_MEMORY, "rpc: no memory for a reference");
        }
        atomic_init(&r->refs, 1);
        r->kind = ref->kind;
        r->len = ref->data.len;
        if (r->len > 0) {
            memcpy(r->data, ref->data.data, r->len);
        }
        if (weft__value_push_ref(v, &raw_type, r) != WEFT_OK) {
            weft_free(r);
            return weft__set_error(WEFT_ERR_NO_MEMORY, "rpc: no memory for a reference");
        }
    }
    return WEFT_OK;
}

weft_status_t weft__refs_decode_raw(weft_agent_t *a, int src, weft_value_t *v)
{
    first_error_t err = {WEFT_OK, ""};
    size_t n = weft_value_num_refs(v);

    for (size_t i = 0; i < n; i++) {
        const weft_value_ref_type_t *type = NULL;
        raw_t *r = weft__value_ref_at(v, i, &type);
        if (type != &raw_type) {
            continue;
        }
        void *obj = NULL;
        weft_future_t *f = NULL;
        weft_status_t st = decode_one(a, src, i, r->kind, r->data, r->len, &type, &obj, &f);
        if (st != WEFT_OK) {
            note_error(&err, st);
            continue;
        }
        /* One-way messages keep their order: the object is delivered, ready or not. */
        weft_future_release(f);
        weft__value_replace_ref(v, i, type, obj);
    }
    if (err.st != WEFT_OK) {
        return weft__set_error(err.st, "%s", err.text);
    }
    return WEFT_OK;
}

/* ------------------------------------------------------- waiting for objects */

typedef struct {
    _Atomic size_t left;
    pthread_mutex_t mu;
    weft_status_t st;
    char *text;
    weft__refs_ready_cb_t cb;
    void *arg;
} waiter_t;

/* One future is done (@p st, @p text); the last one runs the callback. */
static void waiter_count(waiter_t *w, weft_status_t st, const char *text)
{
    if (st != WEFT_OK) {
        pthread_mutex_lock(&w->mu);
        if (w->st == WEFT_OK) {
            w->st = st;
            w->text = weft_strdup(text != NULL ? text : "");
        }
        pthread_mutex_unlock(&w->mu);
    }
    if (atomic_fetch_sub(&w->left, 1) != 1) {
        return;
    }
    w->cb(w->st, w->text != NULL ? w->text : weft_strerror(w->st), w->arg);
    pthread_mutex_destroy(&w->mu);
    weft_free(w->text);
    weft_free(w);
}

static void waiter_done(weft_future_t *f, void *arg)
{
    weft_status_t st = weft_future_status(f);
    char text[WEFT__ERROR_MAX];

    snprintf(text, sizeof(text), "%s",
             st != WEFT_OK && weft_future_error(f)[0] == '\0' ? weft_strerror(st)
                                                              : weft_future_error(f));
    weft_future_release(f);
    waiter_count(arg, st, text);
}

void weft__refs_when_ready(weft_future_t **futs, size_t n, weft__refs_ready_cb_t cb, void *arg)
{
    waiter_t *w = weft_calloc(1, sizeof(*w));

    if (w == NULL) {
        release_futures(futs, n);
        cb(WEFT_ERR_NO_MEMORY, "rpc: no memory to wait for the references' objects", arg);
        return;
    }
    atomic_init(&w->left, n);
    pthread_mutex_init(&w->mu, NULL);
    w->cb = cb;
    w->arg = arg;
    /* @p w may be gone once the last callback is in: touch only the array from then on. */
    for (size_t i = 0; i < n; i++) {
        if (weft_future_then(futs[i], waiter_done, w) != WEFT_OK) {
            weft_future_release(futs[i]);
            waiter_count(w, WEFT_ERR_NO_MEMORY, "rpc: no memory to wait for a reference's object");
        }
    }
    weft_free(futs);
}

void weft__refs_free(weft_agent_t *a)
{
    struct weft__refs *r = atomic_exchange(&a->refs, NULL);

    if (r == NULL) {
        return;
    }
    size_t left = 0;
    for (size_t b = 0; b < SELF_BUCKETS; b++) {
        while (r->self[b] != NULL) {
            self_ref_t *e = r->self[b];
            r->self[b] = e->next;
            e->type->release(e->obj);
            weft_free(e);
            left++;
        }
    }
    if (left > 0) {
        WEFT_DEBUG("%zu references sent by this rank to itself never arrived; released", left);
    }
    pthread_mutex_destroy(&r->mu);
    weft_free(r);
}
