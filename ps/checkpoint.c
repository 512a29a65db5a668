/* Checkpoints: a consistent cut of every table, one file per table and server plus a MANIFEST.
 *
 * weft_ps_save: every worker sends SAVE (its clock and its pushes so far per table) to every
 * server. A server gathers all of them, then a thread of its own waits for the fence (every push
 * the workers announced is applied; SYNC: the step is applied), writes each table's shard to
 * "<name>.s<server>.v<version>[.r<k>].bin.tmp" (the first such name no file has), renames it to
 * ".bin" and answers with the files, their row counts and CRC32C. The first worker then writes
 * MANIFEST.tmp and renames it to MANIFEST, and removes the shard files it does not name: until
 * that rename the previous MANIFEST and its files are whole. The other workers' answers wait on
 * each server until the first worker's COMMIT says the MANIFEST is written (or why not): a save
 * returns OK only once the checkpoint exists, and fails with PEER_LOST if the first worker is
 * lost before it commits. weft_ps_load: every worker sends LOAD; each server reads the MANIFEST
 * and every file of its tables, checks their CRC32C, and keeps the chunks and rows it holds under
 * today's map.
 *
 * A shard file, little-endian: "WEFTPSS1", u32 format (1), u32 kind, u32 dtype, u32 n_state,
 * i64 elements per record (dense: the chunk's length varies: see the record), u64 records, then
 * per record: u64 id (chunk index or row id), i64 elements, i64 optimizer steps, the value
 * (elements x dtype size), the state (n_state x elements x 4); then u64 admission counters and
 * (u64 id, u64 count) each. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define FILE_MAGIC "WEFTPSS1"
#define MANIFEST   "MANIFEST"

/* ------------------------------------------------------------------ CRC32C */

static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) {
            c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        }
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        for (int t = 1; t < 8; t++) {
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
        }
    }
}

static uint32_t crc32c(uint32_t crc, const void *data, size_t n)
{
    const uint8_t *p = data;
    pthread_once(&crc_once, crc_init);
    crc = ~crc;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        v ^= crc;
        crc = crc_table[7][v & 0xff] ^ crc_table[6][(v >> 8) & 0xff] ^
              crc_table[5][(v >> 16) & 0xff] ^ crc_table[4][(v >> 24) & 0xff] ^
              crc_table[3][(v >> 32) & 0xff] ^ crc_table[2][(v >> 40) & 0xff] ^
              crc_table[1][(v >> 48) & 0xff] ^ crc_table[0][v >> 56];
        p += 8;
        n -= 8;
    }
    while (n-- > 0) {
        crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xff];
    }
    return ~crc;
}

/* ------------------------------------------------------------------ writing */

typedef struct {
    FILE *f;
    uint32_t crc;
    uint64_t bytes;
    bool ok;
} wfile_t;

static void put(wfile_t *w, const void *p, size_t n)
{
    if (w->ok && n > 0 && fwrite(p, 1, n, w->f) != n) {
        w->ok = false;
    }
    w->crc = crc32c(w->crc, p, n);
    w->bytes += n;
}

static void put_u32(wfile_t *w, uint32_t v)
{
    put(w, &v, sizeof(v));
}

static void put_u64(wfile_t *w, uint64_t v)
{
    put(w, &v, sizeof(v));
}

static void put_cell(wfile_t *w, const ps_layout_t *l, const ps_cell_t *c)
{
    size_t n = (size_t)c->n;
    put_u64(w, c->id);
    put_u64(w, (uint64_t)n);
    put_u64(w, (uint64_t)c->step);
    put(w, c->vdata, n * weft_dtype_size(c->dtype));
    for (int i = 0; i < l->n_state; i++) {
        put(w, c->sdata[i], n * sizeof(float));
    }
}

/* Writes this server's shard of @p t; fills @p sf. */
static void count_row(ps_cell_t *c, void *arg)
{
    (void)c;
    (*(uint64_t *)arg)++;
}

typedef struct {
    wfile_t *w;
    const ps_layout_t *l;
} put_row_t;

static void put_row(ps_cell_t *c, void *arg)
{
    put_row_t *pr = arg;
    put_cell(pr->w, pr->l, c);
}

static weft_status_t write_shard(ps_stable_t *t, const char *dir, uint64_t version, bool die,
                                 Weft__V1__PsShardFile *sf, char *why, size_t n)
{
    const ps_layout_t *l = &t->l;
    char name[PS_NAME_MAX + 64], tmp[4096], fin[4096];
    /* A name no file has: a second save at the same clock (an ASYNC table saved with no clock in
     * between) must not rename over the files the current MANIFEST names before the new one is
     * written. */
    for (unsigned k = 0;; k++) {
        if (k == 0) {
            snprintf(name, sizeof(name), "%s.s%u.v%llu.bin", l->name, t->me,
                     (unsigned long long)version);
        } else {
            snprintf(name, sizeof(name), "%s.s%u.v%llu.r%u.bin", l->name, t->me,
                     (unsigned long long)version, k);
        }
        snprintf(fin, sizeof(fin), "%s/%s", dir, name);
        if (access(fin, F_OK) != 0) {
            break;
        }
    }
    snprintf(tmp, sizeof(tmp), "%s/%s.tmp", dir, name);
    wfile_t w = {fopen(tmp, "wb"), 0, 0, true};
    if (w.f == NULL) {
        snprintf(why, n, "ps: cannot write %.300s: %s", tmp, strerror(errno));
        return WEFT_ERR_IO;
    }
    /* Every stripe held while the shard is written (t->mu is): the counts in the header are the
     * records that follow, and a pull or push from another thread of a worker meanwhile (one
     * that makes a row, or replaces a dense chunk's value) waits for the file. */
    for (int i = 0; i < PS_STRIPES; i++) {
        pthread_mutex_lock(&t->stripes[i].mu);
    }
    uint64_t records = 0;
    if (l->spec.kind == WEFT_PS_DENSE) {
        for (uint32_t c = 0; c < l->n_chunks; c++) {
            records += t->chunks[c] != NULL ? 1 : 0;
        }
    } else if (t->direct != NULL) {
        weft__ps_rows_each(t, count_row, &records);
    } else {
        for (int i = 0; i < PS_STRIPES; i++) {
            records += t->stripes[i].rows.n;
        }
    }
    put(&w, FILE_MAGIC, 8);
    put_u32(&w, 1);
    put_u32(&w, (uint32_t)l->spec.kind);
    put_u32(&w, (uint32_t)l->spec.dtype);
    put_u32(&w, (uint32_t)l->n_state);
    put_u64(&w, (uint64_t)(l->spec.kind == WEFT_PS_DENSE ? l->chunk_elems : l->spec.dim));
    put_u64(&w, records);
    uint64_t admits = 0;
    if (l->spec.kind == WEFT_PS_DENSE) {
        for (uint32_t c = 0; c < l->n_chunks; c++) {
            if (t->chunks[c] != NULL) {
                put_cell(&w, l, t->chunks[c]);
            }
        }
    } else {
        put_row_t pr = {&w, l};
        weft__ps_rows_each(t, put_row, &pr);
        for (int i = 0; i < PS_STRIPES; i++) {
            admits += t->stripes[i].admit.n;
        }
    }
    if (die) {
        /* A server killed half-way through a save: the files of the tables before are written,
         * this one stays a .tmp, the MANIFEST old. */
        fflush(w.f);
        _exit(9);
    }
    put_u64(&w, admits);
    for (int i = 0; i < PS_STRIPES && admits > 0; i++) {
        ps_stripe_t *s = &t->stripes[i];
        size_t pos = 0;
        uint64_t key;
        void *val;
        while (weft__ps_map_next(&s->admit, &pos, &key, &val)) {
            put_u64(&w, key);
            put_u64(&w, (uint64_t)(uintptr_t)val);
        }
    }
    for (int i = PS_STRIPES - 1; i >= 0; i--) {
        pthread_mutex_unlock(&t->stripes[i].mu);
    }
    bool ok = w.ok && fflush(w.f) == 0 && fsync(fileno(w.f)) == 0;
    ok = fclose(w.f) == 0 && ok;
    if (!ok || rename(tmp, fin) != 0) {
        snprintf(why, n, "ps: writing %.300s failed: %s", fin, strerror(errno));
        unlink(tmp);
        return WEFT_ERR_IO;
    }
    sf->file = weft_strdup(name);
    sf->table = l->id;
    sf->server = (int32_t)t->me;
    sf->rows = records;
    sf->bytes = w.bytes;
    sf->crc32c = w.crc;
    if (sf->file == NULL) {
        snprintf(why, n, "ps: no memory");
        return WEFT_ERR_NO_MEMORY;
    }
    return WEFT_OK;
}

/* ------------------------------------------------------------------ reading */

typedef struct {
    const uint8_t *p, *end;
    bool ok;
} rbuf_t;

static void get(rbuf_t *r, void *dst, size_t n)
{
    if (!r->ok || (size_t)(r->end - r->p) < n) {
        r->ok = false;
        memset(dst, 0, n);
        return;
    }
    memcpy(dst, r->p, n);
    r->p += n;
}

static uint64_t get_u64(rbuf_t *r)
{
    uint64_t v;
    get(r, &v, sizeof(v));
    return v;
}

static uint32_t get_u32(rbuf_t *r)
{
    uint32_t v;
    get(r, &v, sizeof(v));
    return v;
}

static weft_status_t read_file(const char *path, uint8_t **buf_p, size_t *len_p, char *why,
                               size_t n)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        snprintf(why, n, "ps: cannot read %.300s: %s", path, strerror(errno));
        return errno == ENOENT ? WEFT_ERR_NOT_FOUND : WEFT_ERR_IO;
    }
    struct stat stt;
    if (fstat(fileno(f), &stt) != 0) {
        fclose(f);
        snprintf(why, n, "ps: cannot stat %.300s: %s", path, strerror(errno));
        return WEFT_ERR_IO;
    }
    size_t len = (size_t)stt.st_size;
    uint8_t *buf = weft_alloc(len == 0 ? 1 : len);
    if (buf == NULL) {
        fclose(f);
        snprintf(why, n, "ps: no memory for %.300s (%zu bytes)", path, len);
        return WEFT_ERR_NO_MEMORY;
    }
    if (fread(buf, 1, len, f) != len) {
        fclose(f);
        weft_free(buf);
        snprintf(why, n, "ps: reading %.300s failed", path);
        return WEFT_ERR_IO;
    }
    fclose(f);
    *buf_p = buf;
    *len_p = len;
    return WEFT_OK;
}

static weft_status_t read_manifest(const char *dir, Weft__V1__PsManifest **m_p, char *why, size_t n)
{
    char path[4096];
    uint8_t *buf;
    size_t len;
    snprintf(path, sizeof(path), "%s/%s", dir, MANIFEST);
    weft_status_t st = read_file(path, &buf, &len, why, n);
    if (st != WEFT_OK) {
        return st;
    }
    Weft__V1__PsManifest *m = weft__v1__ps_manifest__unpack(&weft__pb_allocator, len, buf);
    weft_free(buf);
    if (m == NULL || m->format != 1) {
        if (m != NULL) {
            weft__v1__ps_manifest__free_unpacked(m, &weft__pb_allocator);
        }
        snprintf(why, n, "ps: %.300s is not a checkpoint manifest of format 1", path);
        return WEFT_ERR_PROTOCOL;
    }
    *m_p = m;
    return WEFT_OK;
}

/* Reads one shard file of @p t and keeps what this server holds now. */
static weft_status_t load_file(ps_stable_t *t, const char *dir, const Weft__V1__PsShardFile *sf,
                               char *why, size_t n)
{
    const ps_layout_t *l = &t->l;
    char path[4096];
    uint8_t *buf;
    size_t len;
    snprintf(path, sizeof(path), "%s/%s", dir, sf->file);
    weft_status_t st = read_file(path, &buf, &len, why, n);
    if (st != WEFT_OK) {
        return st;
    }
    if (len != sf->bytes || crc32c(0, buf, len) != sf->crc32c) {
        weft_free(buf);
        snprintf(why, n,
                 "ps: %.300s does not match the manifest (%zu bytes, CRC32C mismatch or "
                 "%llu bytes expected)",
                 path, len, (unsigned long long)sf->bytes);
        return WEFT_ERR_PROTOCOL;
    }
    rbuf_t r = {buf, buf + len, true};
    char magic[8];
    get(&r, magic, 8);
    uint32_t format = get_u32(&r), kind = get_u32(&r), dtype = get_u32(&r), nstate = get_u32(&r);
    (void)get_u64(&r);
    uint64_t records = get_u64(&r);
    if (!r.ok || memcmp(magic, FILE_MAGIC, 8) != 0 || format != 1 ||
        kind != (uint32_t)l->spec.kind || dtype != (uint32_t)l->spec.dtype ||
        nstate != (uint32_t)l->n_state) {
        weft_free(buf);
        snprintf(why, n, "ps: %.300s is not a shard of table '%s' as created", path, l->name);
        return WEFT_ERR_MISMATCH;
    }
    size_t esz = weft_dtype_size(l->spec.dtype);
    for (uint64_t k = 0; k < records && r.ok && st == WEFT_OK; k++) {
        uint64_t id = get_u64(&r);
        int64_t elems = (int64_t)get_u64(&r), step = (int64_t)get_u64(&r);
        size_t need = (size_t)elems * (esz + (size_t)nstate * 4);
        if (!r.ok || elems < 0 || (size_t)(r.end - r.p) < need) {
            r.ok = false;
            break;
        }
        bool mine;
        ps_cell_t *c = NULL;
        if (l->spec.kind == WEFT_PS_DENSE) {
            mine = id < l->n_chunks && l->owner[id] == t->me &&
                   elems == weft__ps_chunk_len(l, (uint32_t)id);
            if (id >= l->n_chunks || elems != weft__ps_chunk_len(l, (uint32_t)id)) {
                r.ok = false;
                break;
            }
            c = mine ? t->chunks[id] : NULL;
        } else {
            mine = weft__ps_id_server(id, l->n_servers) == t->me;
            if (elems != l->spec.dim || (l->spec.id_bound != 0 && id >= l->spec.id_bound)) {
                r.ok = false;
                break;
            }
            if (mine) {
                st = weft__ps_cell_new(l, id, elems, &c);
                if (st == WEFT_OK) {
                    ps_stripe_t *s = &t->stripes[weft__ps_id_stripe(id)];
                    ps_cell_t *dup = weft__ps_row_del(t, s, id);
                    if (dup != NULL) { /* an id twice in the files: the later record stands */
                        weft__ps_cell_free(dup);
                        atomic_fetch_sub(&t->n_rows, 1);
                    }
                    st = weft__ps_row_put(t, s, id, c);
                    if (st != WEFT_OK) {
                        weft__ps_cell_free(c);
                        c = NULL;
                    } else {
                        atomic_fetch_add(&t->n_rows, 1);
                    }
                }
            }
        }
        if (c != NULL && (st = weft__ps_cell_own(c)) != WEFT_OK) {
            break;
        }
        if (c != NULL) {
            get(&r, c->vdata, (size_t)elems * esz);
            for (uint32_t i = 0; i < nstate; i++) {
                get(&r, c->sdata[i], (size_t)elems * 4);
            }
            c->step = step;
        } else {
            r.p += need;
        }
    }
    uint64_t admits = r.ok && st == WEFT_OK ? get_u64(&r) : 0;
    for (uint64_t k = 0; k < admits && r.ok && st == WEFT_OK; k++) {
        uint64_t id = get_u64(&r), count = get_u64(&r);
        if (r.ok && count > 0 && weft__ps_id_server(id, l->n_servers) == t->me) {
            st = weft__ps_map_put(&t->stripes[weft__ps_id_stripe(id)].admit, id,
                                  (void *)(uintptr_t)count);
        }
    }
    weft_free(buf);
    if (st != WEFT_OK) {
        snprintf(why, n, "ps: loading %.300s: %s", path, weft_last_error());
        return st;
    }
    if (!r.ok || r.p != r.end) {
        snprintf(why, n, "ps: %.300s is truncated or malformed", path);
        return WEFT_ERR_PROTOCOL;
    }
    return WEFT_OK;
}

/* ------------------------------------------------------------------ the server's job */

typedef struct {
    ps_server_t *srv;
    Weft__V1__PsRequest **reqs; /* per worker */
    weft_call_t **calls;        /* per worker */
} job_t;

/* Whether every push the workers announced is applied (and, SYNC, their step). */
static bool fence_reached(ps_server_t *srv, Weft__V1__PsRequest **reqs, uint32_t n_tables)
{
    uint32_t nw = srv->ps->n_workers;
    for (uint32_t i = 0; i < n_tables; i++) {
        ps_stable_t *t = srv->tables[i];
        bool ok = true;
        pthread_mutex_lock(&t->mu);
        for (uint32_t w = 0; w < nw && ok; w++) {
            uint64_t want = i < reqs[w]->n_step_pushes ? reqs[w]->step_pushes[i] : 0;
            ok = t->recv[w] >= want;
            if (t->l.spec.consistency == WEFT_PS_SYNC) {
                ok = ok && t->cur_step >= reqs[w]->clock;
            }
        }
        pthread_mutex_unlock(&t->mu);
        if (!ok) {
            return false;
        }
    }
    return true;
}

static weft_status_t do_save(ps_server_t *srv, Weft__V1__PsRequest **reqs, uint32_t n_tables,
                             Weft__V1__PsReply *rep, char *why, size_t n)
{
    const char *dir = reqs[0]->dir;
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        snprintf(why, n, "ps: cannot make %.300s: %s", dir, strerror(errno));
        return WEFT_ERR_IO;
    }
    srv->saves++; /* only this thread saves */
    /* The fence: every push announced by the workers is applied. Workers wait in their save. */
    int64_t deadline = weft__now_ns() + (int64_t)600 * 1000000000;
    while (!fence_reached(srv, reqs, n_tables)) {
        if (weft__now_ns() > deadline) {
            snprintf(why, n, "ps: the pushes before the checkpoint never all arrived");
            return WEFT_ERR_TIMEOUT;
        }
        /* A lost worker's pushes and steps will never all be applied. */
        pthread_mutex_lock(&srv->mu);
        if (srv->lost_why[0] != '\0') {
            snprintf(why, n, "ps: the checkpoint cannot complete: %s", srv->lost_why);
            pthread_mutex_unlock(&srv->mu);
            return WEFT_ERR_PEER_LOST;
        }
        pthread_mutex_unlock(&srv->mu);
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
    rep->files = weft_calloc(n_tables + 1, sizeof(*rep->files));
    if (rep->files == NULL) {
        snprintf(why, n, "ps: no memory");
        return WEFT_ERR_NO_MEMORY;
    }
    for (uint32_t i = 0; i < n_tables; i++) {
        Weft__V1__PsShardFile *sf = weft_calloc(1, sizeof(*sf));
        if (sf == NULL) {
            snprintf(why, n, "ps: no memory");
            return WEFT_ERR_NO_MEMORY;
        }
        weft__v1__ps_shard_file__init(sf);
        rep->files[rep->n_files++] = sf;
        ps_stable_t *t = srv->tables[i];
        pthread_mutex_lock(&t->mu);
        bool die = i + 1 == n_tables &&
                   weft__cfg_int(WEFT__CFG_PS_FAULT_SAVE_EXIT) == srv->saves; /* test hook */
        weft_status_t st = write_shard(t, dir, reqs[0]->version, die, sf, why, n);
        pthread_mutex_unlock(&t->mu);
        if (st != WEFT_OK) {
            return st;
        }
    }
    return WEFT_OK;
}

static weft_status_t do_load(ps_server_t *srv, Weft__V1__PsRequest **reqs, uint32_t n_tables,
                             Weft__V1__PsReply *rep, char *why, size_t n)
{
    Weft__V1__PsManifest *m = NULL;
    weft_status_t st = read_manifest(reqs[0]->dir, &m, why, n);
    if (st != WEFT_OK) {
        return st;
    }
    rep->clock = m->clock;
    for (uint32_t i = 0; i < n_tables && st == WEFT_OK; i++) {
        ps_stable_t *t = srv->tables[i];
        int64_t mid = -1;
        for (size_t k = 0; k < m->n_tables; k++) {
            if (strcmp(m->tables[k]->name, t->l.name) == 0) {
                mid = (int64_t)k;
            }
        }
        pthread_mutex_lock(&t->mu);
        if (mid >= 0) { /* a table the checkpoint does not have keeps its values */
            weft__ps_stable_drop_rows(t);
            for (size_t k = 0; k < m->n_files && st == WEFT_OK; k++) {
                if (m->files[k]->table == (uint32_t)mid) {
                    st = load_file(t, reqs[0]->dir, m->files[k], why, n);
                }
            }
        }
        /* The workers resume at the checkpoint's clock, in every table (one the checkpoint does
         * not have too: its SYNC steps and BOUNDED pulls follow the workers' clocks); what they
         * send from now is counted. */
        for (uint32_t w = 0; w < t->l.n_workers; w++) {
            t->clock[w] = m->clock;
            t->ann[w] = t->recv[w];
        }
        t->cur_step = m->clock;
        pthread_mutex_unlock(&t->mu);
    }
    weft__v1__ps_manifest__free_unpacked(m, &weft__pb_allocator);
    return st;
}

static void fail_held(ps_server_t *srv, weft_call_t **held, weft_status_t st, const char *text);

static void *job_run(void *arg)
{
    job_t *job = arg;
    ps_server_t *srv = job->srv;
    uint32_t nw = srv->ps->n_workers;
    Weft__V1__PsReply rep = WEFT__V1__PS_REPLY__INIT;
    char why[512] = "";
    pthread_mutex_lock(&srv->mu);
    uint32_t n_tables = srv->n_tables;
    pthread_mutex_unlock(&srv->mu);
    weft_status_t st = job->reqs[0]->op == WEFT__V1__PS_OP__PS_SAVE
                           ? do_save(srv, job->reqs, n_tables, &rep, why, sizeof(why))
                           : do_load(srv, job->reqs, n_tables, &rep, why, sizeof(why));
    /* Over before anyone hears so: a worker answered first may ask for the next checkpoint at
     * once (its start joins this thread, which takes srv->mu no more after this). Worker 0
     * gets a save's files and writes the MANIFEST; the others hear once it has (its COMMIT),
     * unless it is gone, or its COMMIT came already. */
    bool hold = st == WEFT_OK && job->reqs[0]->op == WEFT__V1__PS_OP__PS_SAVE && nw > 1;
    weft_status_t others = WEFT_OK; /* hold == false: a failure for workers 1.. */
    char others_why[700] = "";
    weft_call_t **stale = NULL;
    pthread_mutex_lock(&srv->mu);
    srv->ckpt_running = false;
    if (hold) {
        uint64_t version = job->reqs[0]->version;
        if (srv->finished[0]) {
            hold = false;
            others = srv->lost_why[0] != '\0' ? WEFT_ERR_PEER_LOST : WEFT_ERR_INVALID_STATE;
            snprintf(others_why, sizeof(others_why),
                     "ps: worker 0 (rank %d), which writes the checkpoint's MANIFEST, %s before "
                     "it did: the checkpoint may not exist",
                     srv->ps->workers[0], srv->lost_why[0] != '\0' ? "was lost" : "finished");
        } else if (srv->commit_seen && srv->commit_version == version) {
            hold = false;
            others = srv->commit_status;
            snprintf(others_why, sizeof(others_why), "%s", srv->commit_text);
            srv->commit_seen = false;
        } else {
            stale = srv->held_calls; /* an older save worker 0 never committed */
            srv->held_calls = job->calls;
            srv->held_version = version;
        }
    }
    pthread_mutex_unlock(&srv->mu);
    fail_held(srv, stale, WEFT_ERR_CANCELLED,
              "ps: a later checkpoint started before worker 0 committed this one");
    for (uint32_t w = 0; w < nw; w++) {
        weft_value_t *v = NULL;
        if (hold && w > 0) {
            weft__v1__ps_request__free_unpacked(job->reqs[w], &weft__pb_allocator);
            continue;
        }
        if (w > 0 && others != WEFT_OK) {
            weft_call_fail(job->calls[w], others, "%s", others_why);
        } else if (st == WEFT_OK && weft_msg_pack(&rep.base, NULL, &v) == WEFT_OK) {
            weft_call_reply(job->calls[w], v);
        } else {
            weft_call_fail(job->calls[w], st == WEFT_OK ? WEFT_ERR_NO_MEMORY : st, "%s",
                           st == WEFT_OK ? "ps: no memory" : why);
        }
        weft__v1__ps_request__free_unpacked(job->reqs[w], &weft__pb_allocator);
    }
    for (size_t i = 0; i < rep.n_files; i++) {
        weft_free(rep.files[i]->file);
        weft_free(rep.files[i]);
    }
    weft_free(rep.files);
    weft_free(job->reqs);
    if (!hold) {
        weft_free(job->calls);
    }
    weft_free(job);
    return NULL;
}

/* Takes the held SAVE calls (NULL: none); then answers or fails them (free the array). */
static weft_call_t **take_held(ps_server_t *srv, uint64_t *version_p)
{
    pthread_mutex_lock(&srv->mu);
    weft_call_t **held = srv->held_calls;
    srv->held_calls = NULL;
    if (version_p != NULL) {
        *version_p = srv->held_version;
    }
    pthread_mutex_unlock(&srv->mu);
    return held;
}

static void fail_held(ps_server_t *srv, weft_call_t **held, weft_status_t st, const char *text)
{
    for (uint32_t w = 1; held != NULL && w < srv->ps->n_workers; w++) {
        weft_call_fail(held[w], st, "%s", text);
    }
    weft_free(held);
}

void weft__ps_server_commit(ps_server_t *srv, weft_call_t *call, Weft__V1__PsRequest *req)
{
    weft_ps_t *ps = srv->ps;
    int caller = weft_call_caller_rank(call);
    if (ps->n_workers == 0 || caller != ps->workers[0] || req->worker != 0) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG,
                       "ps: a checkpoint's commit from rank %d, which is not worker 0", caller);
        weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
        return;
    }
    bool failed = req->error != NULL && req->error[0] != '\0';
    weft_status_t st = !failed                                               ? WEFT_OK
                       : req->status < 0 && weft_status_valid(req->status) ? (weft_status_t)req->status
                                                                             : WEFT_ERR_IO;
    char text[640] = "";
    if (failed) {
        snprintf(text, sizeof(text), "ps: checkpoint %llu was not written (worker 0: %s)",
                 (unsigned long long)req->version, req->error);
    }
    weft_call_t **held = NULL, **stale = NULL;
    pthread_mutex_lock(&srv->mu);
    if (srv->held_calls != NULL && srv->held_version == req->version) {
        held = srv->held_calls;
        srv->held_calls = NULL;
    } else {
        if (srv->held_calls != NULL && srv->held_version < req->version) {
            stale = srv->held_calls; /* an older save worker 0 never committed */
            srv->held_calls = NULL;
        }
        /* Its save's calls are not held yet (still being written here): they hear it then. */
        srv->commit_seen = true;
        srv->commit_version = req->version;
        srv->commit_status = (int32_t)st;
        snprintf(srv->commit_text, sizeof(srv->commit_text), "%s", text);
    }
    pthread_mutex_unlock(&srv->mu);
    fail_held(srv, stale, WEFT_ERR_CANCELLED,
              "ps: a later checkpoint was committed before this one");
    if (failed) {
        fail_held(srv, held, st, text);
    } else {
        Weft__V1__PsReply rep = WEFT__V1__PS_REPLY__INIT;
        for (uint32_t w = 1; held != NULL && w < ps->n_workers; w++) {
            weft_value_t *v = NULL;
            if (weft_msg_pack(&rep.base, NULL, &v) == WEFT_OK) {
                weft_call_reply(held[w], v);
            } else {
                weft_call_fail(held[w], WEFT_ERR_NO_MEMORY, "ps: no memory");
            }
        }
        weft_free(held);
    }
    weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
    weft_call_reply(call, NULL);
}

/* Fails the gathered requests @p reqs / @p calls (taken, freed) with @p st and @p text. */
static void fail_gathered(uint32_t nw, Weft__V1__PsRequest **reqs, weft_call_t **calls,
                          weft_status_t st, const char *text)
{
    for (uint32_t k = 0; reqs != NULL && k < nw; k++) {
        if (reqs[k] != NULL) {
            weft_call_fail(calls[k], st, "%s", text);
            weft__v1__ps_request__free_unpacked(reqs[k], &weft__pb_allocator);
        }
    }
    weft_free(reqs);
    weft_free(calls);
}

void weft__ps_server_checkpoint_lost(ps_server_t *srv, int w, int rank, const char *why)
{
    uint32_t nw = srv->ps->n_workers;
    char text[512];

    if (w == 0) {
        weft_call_t **held = take_held(srv, NULL);
        if (held != NULL) {
            snprintf(text, sizeof(text),
                     "ps: worker 0 (rank %d), which writes the checkpoint's MANIFEST, was lost "
                     "before it did (%s): the checkpoint may not exist",
                     rank, why);
            fail_held(srv, held, WEFT_ERR_PEER_LOST, text);
        }
    }

    pthread_mutex_lock(&srv->mu);
    Weft__V1__PsRequest **reqs = srv->ckpt_reqs;
    weft_call_t **calls = srv->ckpt_calls;
    if (reqs == NULL || calls == NULL || srv->ckpt_arrived == 0) {
        pthread_mutex_unlock(&srv->mu); /* nothing gathered */
        return;
    }
    srv->ckpt_reqs = NULL;
    srv->ckpt_calls = NULL;
    srv->ckpt_arrived = 0;
    pthread_mutex_unlock(&srv->mu);
    snprintf(text, sizeof(text),
             "ps: the checkpoint cannot complete: worker %d (rank %d) was lost: %s", w, rank, why);
    fail_gathered(nw, reqs, calls, WEFT_ERR_PEER_LOST, text);
}

void weft__ps_server_checkpoint(ps_server_t *srv, weft_call_t *call, Weft__V1__PsRequest *req)
{
    weft_ps_t *ps = srv->ps;
    int caller = weft_call_caller_rank(call);
    uint32_t nw = ps->n_workers;
    int w = req->worker;
    if (w < 0 || (uint32_t)w >= nw || ps->workers[w] != caller || req->dir == NULL ||
        req->dir[0] == '\0') {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG,
                       "ps: a checkpoint request from rank %d that is not worker %d, or without "
                       "a directory",
                       caller, w);
        weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
        return;
    }
    pthread_mutex_lock(&srv->mu);
    if (srv->ckpt_reqs == NULL) {
        srv->ckpt_reqs = weft_calloc(nw, sizeof(*srv->ckpt_reqs));
        srv->ckpt_calls = weft_calloc(nw, sizeof(*srv->ckpt_calls));
    }
    const char *busy = NULL;
    int gone = -1; /* a worker that will never send its request: lost, or finished */
    for (uint32_t k = 0; srv->ckpt_reqs != NULL && k < nw; k++) {
        if ((int)k != w && srv->ckpt_reqs[k] == NULL && srv->finished[k]) {
            gone = (int)k;
        }
    }
    if (srv->ckpt_reqs == NULL || srv->ckpt_calls == NULL) {
        busy = "ps: no memory";
    } else if (gone >= 0) {
        char text[512];
        snprintf(text, sizeof(text), "ps: the checkpoint cannot complete: worker %d (rank %d) %s",
                 gone, ps->workers[gone],
                 srv->lost_why[0] != '\0' ? srv->lost_why : "has finished");
        weft_status_t st = srv->lost_why[0] != '\0' ? WEFT_ERR_PEER_LOST : WEFT_ERR_INVALID_STATE;
        Weft__V1__PsRequest **reqs = srv->ckpt_reqs;
        weft_call_t **calls = srv->ckpt_calls;
        srv->ckpt_reqs = NULL;
        srv->ckpt_calls = NULL;
        srv->ckpt_arrived = 0;
        pthread_mutex_unlock(&srv->mu);
        fail_gathered(nw, reqs, calls, st, text);
        weft_call_fail(call, st, "%s", text);
        weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
        return;
    } else if (srv->ckpt_running) {
        busy = "ps: a checkpoint is still being written or read";
    } else if (srv->ckpt_reqs[w] != NULL) {
        busy = "ps: this worker asked for a checkpoint twice";
    } else {
        for (uint32_t k = 0; k < nw; k++) {
            Weft__V1__PsRequest *o = srv->ckpt_reqs[k];
            if (o != NULL &&
                (o->op != req->op || strcmp(o->dir, req->dir) != 0 || o->clock != req->clock)) {
                busy = "ps: workers asked for different checkpoints (operation, directory or "
                       "clock)";
            }
        }
    }
    if (busy != NULL) {
        pthread_mutex_unlock(&srv->mu);
        weft_call_fail(call, busy[4] == 'n' ? WEFT_ERR_NO_MEMORY : WEFT_ERR_MISMATCH, "%s", busy);
        weft__v1__ps_request__free_unpacked(req, &weft__pb_allocator);
        return;
    }
    srv->ckpt_reqs[w] = req;
    srv->ckpt_calls[w] = call;
    if (++srv->ckpt_arrived < nw) {
        pthread_mutex_unlock(&srv->mu);
        return;
    }
    job_t *job = weft_calloc(1, sizeof(*job));
    if (job == NULL) {
        pthread_mutex_unlock(&srv->mu);
        return; /* the workers' calls time out; nothing was written */
    }
    job->srv = srv;
    job->reqs = srv->ckpt_reqs;
    job->calls = srv->ckpt_calls;
    srv->ckpt_reqs = NULL;
    srv->ckpt_calls = NULL;
    srv->ckpt_arrived = 0;
    srv->ckpt_running = true;
    if (srv->ckpt_joinable) {
        pthread_join(srv->ckpt_thread, NULL);
        srv->ckpt_joinable = false;
    }
    if (pthread_create(&srv->ckpt_thread, NULL, job_run, job) == 0) {
        srv->ckpt_joinable = true;
        pthread_mutex_unlock(&srv->mu);
        return;
    }
    srv->ckpt_running = false;
    pthread_mutex_unlock(&srv->mu);
    for (uint32_t k = 0; k < nw; k++) {
        weft_call_fail(job->calls[k], WEFT_ERR_NO_MEMORY, "ps: no thread for the checkpoint");
        weft__v1__ps_request__free_unpacked(job->reqs[k], &weft__pb_allocator);
    }
    weft_free(job->reqs);
    weft_free(job->calls);
    weft_free(job);
}

void weft__ps_server_checkpoint_free(ps_server_t *srv)
{
    pthread_mutex_lock(&srv->mu);
    bool join = srv->ckpt_joinable;
    srv->ckpt_joinable = false;
    pthread_mutex_unlock(&srv->mu);
    if (join) {
        pthread_join(srv->ckpt_thread, NULL);
    }
    fail_held(srv, take_held(srv, NULL), WEFT_ERR_SHUTDOWN, "ps: the server is closing");
    for (uint32_t w = 0; srv->ckpt_reqs != NULL && w < srv->ps->n_workers; w++) {
        if (srv->ckpt_reqs[w] != NULL) {
            weft_call_fail(srv->ckpt_calls[w], WEFT_ERR_SHUTDOWN, "ps: the server is closing");
            weft__v1__ps_request__free_unpacked(srv->ckpt_reqs[w], &weft__pb_allocator);
        }
    }
    weft_free(srv->ckpt_reqs);
    weft_free(srv->ckpt_calls);
    srv->ckpt_reqs = NULL;
    srv->ckpt_calls = NULL;
}

/* ------------------------------------------------------------------ the workers' side */

static weft_status_t ckpt_all(weft_ps_t *ps, Weft__V1__PsOp op, const char *dir, int64_t timeout_ms,
                              Weft__V1__PsReply **reps)
{
    uint32_t ns = ps->n_servers;
    Weft__V1__PsRequest r = WEFT__V1__PS_REQUEST__INIT;
    uint64_t *counts = weft_calloc(PS_MAX_TABLES, sizeof(*counts));
    weft_value_t **vals = weft_calloc(ns, sizeof(*vals));
    weft_status_t st = WEFT_OK;
    if (counts == NULL || vals == NULL) {
        weft_free(counts);
        weft_free(vals);
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory");
    }
    r.op = op;
    r.worker = ps->worker_index;
    r.clock = atomic_load(&ps->clock);
    r.version = (uint64_t)r.clock;
    r.dir = (char *)dir;
    r.table_name = "";
    r.step_pushes = counts;
    st = weft__ps_all_servers(ps, &r, weft__ps_counts_request, timeout_ms, vals, false);
    for (uint32_t s = 0; s < ns; s++) {
        if (st == WEFT_OK && reps != NULL) {
            st = weft__ps_reply_unpack(vals[s], &reps[s]);
        }
        weft_value_free(vals[s]);
    }
    weft_free(vals);
    weft_free(counts);
    return st;
}

/* Whether @p p starts with decimal digits; *end_p after them. */
static bool digits(const char *p, const char **end_p)
{
    const char *q = p;
    while (*q >= '0' && *q <= '9') {
        q++;
    }
    *end_p = q;
    return q != p;
}

/* Whether @p f is a shard file of one of @p ps's tables, as write_shard names them:
 * "<table>.s<N>.v<N>[.r<N>].bin", or that with ".tmp" after it. */
static bool shard_name(const weft_ps_t *ps, const char *f)
{
    for (uint32_t i = 0; i < atomic_load(&ps->n_tables); i++) {
        const char *name = ps->tables[i]->l.name, *p;
        size_t k = strlen(name);
        if (strncmp(f, name, k) != 0 || strncmp(f + k, ".s", 2) != 0 || !digits(f + k + 2, &p) ||
            strncmp(p, ".v", 2) != 0 || !digits(p + 2, &p)) {
            continue;
        }
        if (strncmp(p, ".r", 2) == 0 && !digits(p + 2, &p)) {
            continue;
        }
        if (strcmp(p, ".bin") == 0 || strcmp(p, ".bin.tmp") == 0) {
            return true;
        }
    }
    return false;
}

/* Removes the shard files of this job's tables that the MANIFEST just written does not name:
 * earlier checkpoints' and saves' that did not finish. Other files are left alone. */
static void remove_unlisted(const weft_ps_t *ps, const char *dir,
                            Weft__V1__PsShardFile *const *files, size_t nf)
{
    DIR *d = opendir(dir);
    if (d == NULL) {
        return;
    }
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        bool gone = shard_name(ps, e->d_name);
        for (size_t k = 0; gone && k < nf; k++) {
            if (strcmp(files[k]->file, e->d_name) == 0) {
                gone = false; /* the checkpoint's own */
            }
        }
        if (gone) {
            char path[4096];
            snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
            unlink(path);
        }
    }
    closedir(d);
}

/* Sends the COMMIT @p r to every server, whatever an earlier send returned (a lost server must
 * not keep the others from hearing it), and waits for them. The first failure, or WEFT_OK. */
static weft_status_t commit_all(weft_ps_t *ps, Weft__V1__PsRequest *r, int64_t timeout_ms)
{
    uint32_t ns = ps->n_servers;
    weft_future_t **fs = weft_calloc(ns, sizeof(*fs));
    weft_status_t st = WEFT_OK;
    char why[512] = "";
    if (fs == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory");
    }
    for (uint32_t s = 0; s < ns; s++) {
        weft_status_t cs = weft__ps_call(ps, s, r, NULL, 0, timeout_ms, &fs[s]);
        if (cs != WEFT_OK && st == WEFT_OK) {
            st = cs;
            snprintf(why, sizeof(why), "%s", weft_last_error());
        }
    }
    for (uint32_t s = 0; s < ns; s++) {
        if (fs[s] == NULL) {
            continue;
        }
        weft_future_wait(fs[s], 0);
        weft_status_t fst = weft_future_status(fs[s]);
        if (fst != WEFT_OK && st == WEFT_OK) {
            st = fst;
            snprintf(why, sizeof(why), "ps: server %u (rank %d): %s", s, ps->servers[s],
                     weft_future_error(fs[s]));
        }
        weft_future_release(fs[s]);
    }
    weft_free(fs);
    return st == WEFT_OK ? WEFT_OK : weft__set_error(st, "%s", why);
}

weft_status_t weft_ps_save(weft_ps_t *ps, const char *dir, int64_t timeout_ms)
{
    if (ps == NULL || dir == NULL || dir[0] == '\0' || timeout_ms < 0 || strlen(dir) > 3000) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: a checkpoint needs a directory");
    }
    if (ps->worker_index < 0) {
        return weft__set_error(WEFT_ERR_INVALID_STATE, "ps: rank %d is not a worker", ps->rank);
    }
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        return weft__set_error(WEFT_ERR_IO, "ps: cannot make %s: %s", dir, strerror(errno));
    }
    uint32_t ns = ps->n_servers, n_tables = atomic_load(&ps->n_tables);
    Weft__V1__PsReply **reps = weft_calloc(ns, sizeof(*reps));
    if (reps == NULL) {
        return weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory");
    }
    weft_status_t st = ckpt_all(ps, WEFT__V1__PS_OP__PS_SAVE, dir, timeout_ms, reps);
    if (st == WEFT_OK && ps->worker_index == 0 &&
        weft__cfg_int(WEFT__CFG_PS_FAULT_COMMIT_EXIT) == atomic_load(&ps->clock)) {
        _exit(8); /* test hook: the servers have written their files, the MANIFEST never comes */
    }
    if (st == WEFT_OK && ps->worker_index == 0) {
        /* The manifest, last. */
        Weft__V1__PsManifest m = WEFT__V1__PS_MANIFEST__INIT;
        Weft__V1__PsTableSpec *specs = weft_calloc(n_tables + 1, sizeof(*specs));
        Weft__V1__PsTableSpec **sp = weft_calloc(n_tables + 1, sizeof(*sp));
        size_t nf = 0;
        for (uint32_t s = 0; s < ns; s++) {
            nf += reps[s]->n_files;
        }
        Weft__V1__PsShardFile **files = weft_calloc(nf + 1, sizeof(*files));
        if (specs == NULL || sp == NULL || files == NULL) {
            st = weft__set_error(WEFT_ERR_NO_MEMORY, "ps: no memory");
        }
        uint32_t made = 0;
        for (uint32_t i = 0; i < n_tables && st == WEFT_OK; i++) {
            st = weft__ps_spec_to_pb(&ps->tables[i]->l, ps->servers, ps->workers, &specs[i]);
            sp[i] = &specs[i];
            made = i + 1;
        }
        nf = 0;
        for (uint32_t s = 0; s < ns && st == WEFT_OK; s++) {
            for (size_t k = 0; k < reps[s]->n_files; k++) {
                files[nf++] = reps[s]->files[k];
            }
        }
        if (st == WEFT_OK) {
            m.format = 1;
            m.clock = atomic_load(&ps->clock);
            m.version = (uint64_t)m.clock;
            m.n_tables = n_tables;
            m.tables = sp;
            m.n_files = nf;
            m.files = files;
            m.hash = "fibonacci64";
            size_t len = weft__v1__ps_manifest__get_packed_size(&m);
            uint8_t *buf = weft_alloc(len + 1);
            char tmp[4096], fin[4096];
            snprintf(tmp, sizeof(tmp), "%s/%s.tmp", dir, MANIFEST);
            snprintf(fin, sizeof(fin), "%s/%s", dir, MANIFEST);
            FILE *f = buf != NULL ? fopen(tmp, "wb") : NULL;
            if (f == NULL) {
                st = weft__set_error(WEFT_ERR_IO, "ps: cannot write %s: %s", tmp,
                                     buf == NULL ? "no memory" : strerror(errno));
            } else {
                weft__v1__ps_manifest__pack(&m, buf);
                bool ok = fwrite(buf, 1, len, f) == len && fflush(f) == 0 && fsync(fileno(f)) == 0;
                ok = fclose(f) == 0 && ok;
                if (!ok || rename(tmp, fin) != 0) {
                    st = weft__set_error(WEFT_ERR_IO, "ps: writing %s failed: %s", fin,
                                         strerror(errno));
                } else {
                    remove_unlisted(ps, dir, files, nf);
                }
            }
            weft_free(buf);
        }
        for (uint32_t i = 0; i < made; i++) {
            weft__ps_spec_pb_free(&specs[i]);
        }
        weft_free(specs);
        weft_free(sp);
        weft_free(files);
    }
    if (ps->worker_index == 0 && ps->n_workers > 1) {
        /* The others' saves return now: OK, or why the MANIFEST is not there (sent whatever
         * failed, so that no server holds their answers until the deadline). */
        char why[512] = "", err[600] = "";
        if (st != WEFT_OK) {
            snprintf(why, sizeof(why), "%s", weft_last_error());
            snprintf(err, sizeof(err), "%s: %s", weft_strerror(st), why);
        }
        Weft__V1__PsRequest r = WEFT__V1__PS_REQUEST__INIT;
        r.op = WEFT__V1__PS_OP__PS_COMMIT;
        r.worker = 0;
        r.clock = atomic_load(&ps->clock);
        r.version = (uint64_t)r.clock;
        r.dir = (char *)dir;
        r.table_name = "";
        r.error = err;
        r.status = (int32_t)st;
        weft_status_t cst = commit_all(ps, &r, timeout_ms);
        if (st == WEFT_OK) {
            st = cst;
        } else {
            weft__set_error(st, "%s", why); /* this worker's own failure, not the commit's */
        }
    }
    for (uint32_t s = 0; s < ns; s++) {
        if (reps[s] != NULL) {
            weft__v1__ps_reply__free_unpacked(reps[s], &weft__pb_allocator);
        }
    }
    weft_free(reps);
    return st;
}

weft_status_t weft_ps_load(weft_ps_t *ps, const char *dir, int64_t timeout_ms)
{
    char why[512];
    if (ps == NULL || dir == NULL || dir[0] == '\0' || timeout_ms < 0 || strlen(dir) > 3000) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "ps: a checkpoint needs a directory");
    }
    if (ps->worker_index < 0) {
        return weft__set_error(WEFT_ERR_INVALID_STATE, "ps: rank %d is not a worker", ps->rank);
    }
    Weft__V1__PsManifest *m = NULL;
    weft_status_t st = read_manifest(dir, &m, why, sizeof(why));
    if (st != WEFT_OK) {
        return weft__set_error(st, "%s", why);
    }
    /* Every table of the checkpoint must exist here as it was made, but for the servers. */
    for (size_t k = 0; k < m->n_tables && st == WEFT_OK; k++) {
        Weft__V1__PsTableSpec *saved = m->tables[k];
        weft_ps_table_t *t = weft_ps_table(ps, saved->name);
        if (t == NULL) {
            st = weft__set_error(WEFT_ERR_MISMATCH,
                                 "ps: the checkpoint in %s has table '%s', "
                                 "which was not created",
                                 dir, saved->name);
            break;
        }
        Weft__V1__PsTableSpec now;
        st = weft__ps_spec_to_pb(&t->l, ps->servers, ps->workers, &now);
        if (st != WEFT_OK) {
            break;
        }
        /* Servers, workers and the shard map may differ: the checkpoint re-shards. */
        Weft__V1__PsTableSpec a = *saved, b = now;
        a.n_servers = b.n_servers = 0;
        a.n_workers = b.n_workers = 0;
        a.map_hash = b.map_hash = 0;
        const char *f = weft__ps_spec_diff(&a, &b, why, sizeof(why));
        if (f != NULL) {
            st = weft__set_error(WEFT_ERR_MISMATCH,
                                 "ps: table '%s' differs from the checkpoint's in %s "
                                 "(checkpoint vs created: %s)",
                                 saved->name, f, why);
        }
        weft__ps_spec_pb_free(&now);
    }
    int64_t clock = m->clock;
    weft__v1__ps_manifest__free_unpacked(m, &weft__pb_allocator);
    if (st != WEFT_OK) {
        return st;
    }
    st = ckpt_all(ps, WEFT__V1__PS_OP__PS_LOAD, dir, timeout_ms, NULL);
    if (st == WEFT_OK) {
        atomic_store(&ps->clock, clock);
    }
    return st;
}
