/* All planes of one chunk coded in one call with the GIL released (see chunkenc.h).
 *
 * Why: codec/entropy.py's encode_plane decides per plane in Python (constant check, sampled
 * entropy, rANS with a limit, a Huffman-only deflate try for small planes, raw copies) and
 * codec/chunk.py hashes in Python.  Each step is a C call, but the Python between them holds
 * the GIL: on a state of many small tensors that Python is most of the work, so a second codec
 * thread added almost nothing.  This file is the same decision procedure in C, byte for byte:
 * the rANS coder is rans.c's, and the two coders that live in other libraries (XXH3-64 of
 * python-xxhash, Huffman-only deflate of python-zlib-ng) are called through function pointers
 * the Python side resolves from those very extension modules (mc_set_env), so the bytes are
 * produced by the same code as before.  The zstd try of a low-entropy plane uses the zstd of
 * python-zstandard's cffi backend (the same bundled zstd release as its C backend, checked by
 * version; set up as ZstdCompressor(level, write_checksum=False) sets up its context) when
 * it was bound (mc_set_zstd); otherwise such a plane is left to Python (MC_PLANE_PYTHON).
 */
#include "chunkenc.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "rans.h"

/* plane methods, as codec/entropy.py's PlaneMethod numbers them */
#define PM_RAW 0
#define PM_ZSTD 1
#define PM_HUFF 2
#define PM_CONST 3
#define PM_RANS32 5

#define SAMPLE 16384     /* entropy._SAMPLE */
#define SMALL_PLANE 16384 /* entropy._SMALL_PLANE: planes this small also try deflate */
#define HUFF_SCRATCH (SMALL_PLANE + SMALL_PLANE / 4 + 4096)

/* zlib-ng's native stream (zlib-ng.h, 2.x); zng_deflateInit2_ checks its size */
typedef struct {
    const uint8_t *next_in;
    uint32_t avail_in;
    size_t total_in;
    uint8_t *next_out;
    uint32_t avail_out;
    size_t total_out;
    const char *msg;
    void *state;
    void *zalloc;
    void *zfree;
    void *opaque;
    int data_type;
    uint32_t adler;
    unsigned long reserved;
} zng_stream_t;

typedef uint64_t (*xxh3_fn)(const void *, size_t);
typedef int32_t (*zinit_fn)(zng_stream_t *, int32_t, int32_t, int32_t, int32_t, int32_t,
                            const char *, int32_t);
typedef int32_t (*zdeflate_fn)(zng_stream_t *, int32_t);
typedef int32_t (*zreset_fn)(zng_stream_t *);
typedef int32_t (*zend_fn)(zng_stream_t *);

static xxh3_fn g_xxh3;
static zinit_fn g_zinit;
static zdeflate_fn g_zdeflate;
static zreset_fn g_zreset;
static zend_fn g_zend;
static char g_zver[32];

typedef void *(*zs_create_fn)(void);
typedef size_t (*zs_free_fn)(void *);
typedef size_t (*zs_setp_fn)(void *, int, int);
typedef size_t (*zs_compress2_fn)(void *, void *, size_t, const void *, size_t);
typedef unsigned (*zs_iserr_fn)(size_t);
static zs_create_fn g_zs_create;
static zs_free_fn g_zs_free;
static zs_setp_fn g_zs_setp;
static zs_compress2_fn g_zs_compress2;
static zs_iserr_fn g_zs_iserr;

/* per thread: a deflate stream set up once (deflateReset between planes gives the bytes a
 * fresh compressobj gives) and its output buffer; freed when the thread exits */
typedef struct {
    zng_stream_t strm;
    int ready;
    void *zcctx; /* zstd context and the level it is set to */
    int zlevel;
    uint8_t out[HUFF_SCRATCH];
} huff_tls;

static pthread_key_t g_key;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_key_ok;

static void huff_free(void *p) {
    huff_tls *t = (huff_tls *)p;
    if (t->ready && g_zend) g_zend(&t->strm);
    if (t->zcctx && g_zs_free) g_zs_free(t->zcctx);
    free(t);
}

static void key_init(void) { g_key_ok = pthread_key_create(&g_key, huff_free) == 0; }

static huff_tls *huff_state(void) {
    huff_tls *t;
    pthread_once(&g_once, key_init);
    if (!g_key_ok) return NULL;
    t = (huff_tls *)pthread_getspecific(g_key);
    if (t) return t;
    t = (huff_tls *)calloc(1, sizeof(huff_tls));
    if (!t) return NULL;
    /* compressobj(1, DEFLATED, -15, 9, Z_HUFFMAN_ONLY), as entropy._huff */
    if (g_zinit(&t->strm, 1, 8, -15, 9, 2, g_zver, (int32_t)sizeof(zng_stream_t)) != 0) {
        free(t);
        return NULL;
    }
    t->ready = 1;
    if (pthread_setspecific(g_key, t) != 0) {
        huff_free(t);
        return NULL;
    }
    return t;
}

/* Huffman-only raw deflate of src into the thread's buffer; its length, or -1 */
static int64_t huff(const uint8_t *src, size_t n, const uint8_t **out) {
    huff_tls *t = huff_state();
    if (!t || n > SMALL_PLANE || g_zreset(&t->strm) != 0) return -1;
    t->strm.next_in = src;
    t->strm.avail_in = (uint32_t)n;
    t->strm.next_out = t->out;
    t->strm.avail_out = HUFF_SCRATCH;
    if (g_zdeflate(&t->strm, 4 /* Z_FINISH */) != 1 /* Z_STREAM_END */) return -1;
    *out = t->out;
    return (int64_t)(HUFF_SCRATCH - t->strm.avail_out);
}

int mc_set_env(uintptr_t xxh3, uintptr_t zinit, uintptr_t zdeflate, uintptr_t zreset,
               uintptr_t zend, const char *zversion) {
    zng_stream_t probe;
    if (!xxh3 || !zinit || !zdeflate || !zreset || !zend || !zversion ||
        strlen(zversion) >= sizeof(g_zver))
        return -1;
    g_xxh3 = (xxh3_fn)xxh3;
    g_zinit = (zinit_fn)zinit;
    g_zdeflate = (zdeflate_fn)zdeflate;
    g_zreset = (zreset_fn)zreset;
    g_zend = (zend_fn)zend;
    strcpy(g_zver, zversion);
    /* the library must accept our stream layout (it checks the size) */
    memset(&probe, 0, sizeof(probe));
    if (g_zinit(&probe, 1, 8, -15, 9, 2, g_zver, (int32_t)sizeof(zng_stream_t)) != 0) {
        g_xxh3 = NULL;
        return -2;
    }
    g_zend(&probe);
    return 0;
}

int mc_ready(void) { return g_xxh3 != NULL; }

int mc_set_zstd(uintptr_t create, uintptr_t free_, uintptr_t setp, uintptr_t compress2,
                uintptr_t iserr) {
    if (!create || !free_ || !setp || !compress2 || !iserr) { /* unbind: Python codes zstd */
        g_zs_compress2 = NULL;
        return -1;
    }
    g_zs_create = (zs_create_fn)create;
    g_zs_free = (zs_free_fn)free_;
    g_zs_setp = (zs_setp_fn)setp;
    g_zs_compress2 = (zs_compress2_fn)compress2;
    g_zs_iserr = (zs_iserr_fn)iserr;
    return 0;
}

/* zstd frame of src (ZstdCompressor(level, write_checksum=False).compress) into dst; its
 * length, 0 when it does not fit in cap, -1 on error */
static int64_t zstd(const uint8_t *src, size_t n, int level, uint8_t *dst, size_t cap) {
    huff_tls *t = huff_state();
    size_t r;
    if (!t) return -1;
    if (!t->zcctx) {
        t->zcctx = g_zs_create();
        if (!t->zcctx) return -1;
        t->zlevel = level + 1000; /* not yet set */
    }
    if (t->zlevel != level) {
        /* ZSTD_c_compressionLevel; checksum off and content size on are zstd's defaults */
        if (g_zs_iserr(g_zs_setp(t->zcctx, 100, level))) return -1;
        t->zlevel = level;
    }
    r = g_zs_compress2(t->zcctx, dst, cap, src, n);
    if (g_zs_iserr(r)) return 0; /* dstSize_tooSmall: not shorter than the plane */
    return (int64_t)r;
}

size_t mc_arena_cap(const uint64_t *sizes, int nplanes) {
    /* the rANS coder's workspace for the largest plane, then room for a zstd try of it */
    size_t rans = 1, big = 0, i;
    for (i = 0; i < (size_t)nplanes; i++) {
        size_t c = mr2_encode_cap(sizes[i], sizes[i]);
        if (c > rans) rans = c;
        if (sizes[i] > big) big = sizes[i];
    }
    return rans + big;
}

static int is_const(const uint8_t *p, size_t n) {
    size_t i;
    uint8_t v = p[0];
    if (n < 2 || p[n - 1] != v || p[n / 2] != v) return 0;
    for (i = 1; i < n; i++)
        if (p[i] != v) return 0;
    return 1;
}

int64_t mc_encode_planes(const uint8_t *raw, size_t raw_size, uint8_t *planes,
                         const uint64_t *sizes, int nplanes, double raw_bits,
                         double huff_min_bits, double min_gain, int level, uint8_t *arena,
                         size_t cap, uint8_t *dst, uint8_t *methods, uint64_t *lens,
                         uint64_t *hashes) {
    /* stored plane i goes to dst + off, off <= the start of plane i (no stored plane is longer
     * than its plane), once plane i has been read: the planes compact in place */
    size_t off = 0, src = 0, rcap, zoff;
    int i, deferred = 0;
    if (!g_xxh3 || nplanes < 0 || cap < mc_arena_cap(sizes, nplanes) || dst > planes) return -1;
    zoff = 1;
    for (i = 0; i < nplanes; i++) {
        size_t c = mr2_encode_cap(sizes[i], sizes[i]);
        if (c > zoff) zoff = c;
    }
    rcap = zoff; /* arena: [0, rcap) rANS workspace, [zoff, cap) a zstd try */
    hashes[0] = g_xxh3(raw, raw_size);
    for (i = 0; i < nplanes; i++) {
        uint8_t *p = planes + src;
        const uint8_t *from = p;
        size_t n = sizes[i], limit, stored = n;
        int method = PM_RAW;
        double h;
        src += n;
        if (n == 0) {
            methods[i] = PM_RAW;
            lens[i] = 0;
            continue;
        }
        if (is_const(p, n)) {
            dst[off] = p[0];
            methods[i] = PM_CONST;
            lens[i] = 1;
            off += 1;
            continue;
        }
        h = mr_sample_entropy(p, n, SAMPLE);
        limit = n - (size_t)((double)n * min_gain);
        if (h < huff_min_bits) { /* runs (XOR deltas): zstd first, as entropy.encode_plane */
            int64_t zn;
            if (!g_zs_compress2) { /* no zstd here: Python codes this plane (left in place) */
                if (dst + off != p) memmove(dst + off, p, n);
                methods[i] = MC_PLANE_PYTHON;
                lens[i] = n;
                off += n;
                deferred = 1;
                continue;
            }
            zn = zstd(p, n, level, arena + zoff, n);
            if (zn < 0) return -4;
            if (zn > 0 && (size_t)zn < limit) {
                method = PM_ZSTD;
                stored = limit = (size_t)zn;
                from = arena + zoff;
            }
        }
        if (h < raw_bits) {
            int64_t got = mr2_encode(p, n, arena, rcap, limit);
            if (got < 0) return -2;
            if (got > 0) {
                method = PM_RANS32;
                stored = limit = (size_t)got;
                from = arena;
            }
        }
        if (n <= SMALL_PLANE) {
            const uint8_t *z = NULL;
            int64_t zn = huff(p, n, &z);
            if (zn < 0) return -3;
            if ((size_t)zn < limit) {
                method = PM_HUFF;
                stored = (size_t)zn;
                from = z;
            }
        }
        if (dst + off != from) memmove(dst + off, from, stored);
        methods[i] = (uint8_t)method;
        lens[i] = stored;
        off += stored;
    }
    /* the payload hash covers the stored planes in order; Python hashes when it splices */
    hashes[1] = deferred ? 0 : g_xxh3(dst, off);
    return (int64_t)off;
}

size_t mc_batch_cap(const uint64_t *sizes, const int32_t *nplanes, size_t nchunks) {
    size_t c, k = 0;
    for (c = 0; c < nchunks; c++) k += (size_t)nplanes[c];
    return mc_arena_cap(sizes, (int)k);
}

int64_t mc_encode_batch(size_t nchunks, const uintptr_t *raws, const uint64_t *raw_sizes,
                        uint8_t *planes, const uint64_t *sizes, const int32_t *nplanes,
                        double raw_bits, double huff_min_bits, double min_gain, int level,
                        uint8_t *arena, size_t cap, uint8_t *methods, uint64_t *lens,
                        uint64_t *hashes, uint64_t *stored) {
    /* each chunk's stored planes follow the previous chunk's, compacted towards the start of
     * `planes` (again never ahead of what is still to be read) */
    size_t c, p = 0, src = 0, off = 0;
    if (cap < mc_batch_cap(sizes, nplanes, nchunks)) return -1;
    for (c = 0; c < nchunks; c++) {
        int k = nplanes[c], i;
        int64_t got = mc_encode_planes((const uint8_t *)raws[c], raw_sizes[c], planes + src,
                                       sizes + p, k, raw_bits, huff_min_bits, min_gain, level,
                                       arena, cap, planes + off, methods + p, lens + p,
                                       hashes + 2 * c);
        if (got < 0) return got;
        for (i = 0; i < k; i++) src += sizes[p + i];
        stored[c] = (uint64_t)got;
        off += (size_t)got;
        p += (size_t)k;
    }
    return (int64_t)off;
}

/* ------------------------------------------------------------------ decoding one chunk */

typedef int (*ungroup_fn)(const uintptr_t *, const uint8_t *, const uint8_t *, uint8_t *,
                          size_t, int, int);
static xxh3_fn g_dec_xxh3;
static ungroup_fn g_ungroup;

int mc_set_decoder(uintptr_t xxh3, uintptr_t ungroup_planes) {
    g_dec_xxh3 = (xxh3_fn)xxh3;
    g_ungroup = (ungroup_fn)ungroup_planes;
    return g_dec_xxh3 && g_ungroup ? 0 : -1;
}

int mc_decoder_ready(void) { return g_dec_xxh3 != NULL && g_ungroup != NULL; }

/* plane i's decoded bytes: where it lies in the payload (RAW) or decoded into out;
 * 0, or MC_DEC_BAD_PLANE / MC_DEC_RANS / MC_DEC_METHOD */
static int decode_plane(const uint8_t *stored, size_t len, int method, size_t n, uint8_t *out,
                        const uint8_t **at, uint64_t *code) {
    switch (method) {
        case PM_RAW:
            if (len != n) return MC_DEC_BAD_PLANE;
            *at = stored;
            return 0;
        case PM_CONST:
            if (len != 1) return MC_DEC_BAD_PLANE;
            memset(out, stored[0], n);
            *at = out;
            return 0;
        case PM_RANS32: {
            int rc = mr2_decode(stored, len, out, n); /* refuses n == 0 */
            if (rc != 0) {
                *code = (uint64_t)(int64_t)rc;
                return MC_DEC_RANS;
            }
            *at = out;
            return 0;
        }
        default: return MC_DEC_METHOD;
    }
}

int mc_decode_chunk(const uint8_t *payload, size_t plen, const uint8_t *methods,
                    const uint64_t *lens, int nplanes, int width, int kind,
                    const uint8_t *base, uint8_t *scratch, size_t scap, uint8_t *dst,
                    size_t raw_size, const uint64_t *want, int check_payload, uint64_t *got,
                    int *bad) {
    uintptr_t pl[MC_DEC_MAX_WIDTH + 1];
    size_t n, soff = 0, doff = 0;
    int i, rc, planes;
    *bad = -1;
    if (!g_dec_xxh3 || !g_ungroup || width < 1 || width > MC_DEC_MAX_WIDTH || nplanes < 1)
        return MC_DEC_ARGS;
    /* the transform's planes: kind < 0 one (the bytes themselves), else width planes of
     * raw_size / width bytes, then a tail plane when there is a remainder */
    planes = kind < 0 ? 1 : width;
    n = kind < 0 ? raw_size : raw_size / (size_t)width;
    if (nplanes != planes + (kind >= 0 && raw_size % (size_t)width ? 1 : 0)) return MC_DEC_ARGS;
    if (scap < raw_size || (kind < 0 && base)) return MC_DEC_ARGS;
    for (i = 0; i < nplanes; i++) {
        if (lens[i] > plen - soff) return MC_DEC_ARGS;
        soff += lens[i];
    }
    if (soff != plen) return MC_DEC_ARGS;
    if (check_payload) {
        got[0] = g_dec_xxh3(payload, plen);
        if (got[0] != want[0]) return MC_DEC_PAYLOAD;
    }
    soff = 0;
    for (i = 0; i < nplanes; i++) {
        size_t sz = i < planes ? n : raw_size - n * (size_t)width;
        /* identity: decode straight into dst; planes: into the scratch at the plane's place */
        uint8_t *out = kind < 0 ? dst : scratch + doff;
        const uint8_t *at = NULL;
        rc = decode_plane(payload + soff, lens[i], methods[i], sz, out, &at, &got[0]);
        if (rc != 0) {
            *bad = i;
            return rc;
        }
        if (kind < 0 && at != dst && sz) memcpy(dst, at, sz);
        pl[i] = (uintptr_t)at;
        soff += lens[i];
        doff += sz;
    }
    if (kind >= 0) {
        const uint8_t *tail = nplanes > planes ? (const uint8_t *)pl[planes] : scratch;
        if (g_ungroup(pl, tail, base, dst, raw_size, width, kind) != 0) return MC_DEC_ARGS;
    }
    got[1] = g_dec_xxh3(dst, raw_size);
    return got[1] == want[1] ? 0 : MC_DEC_RAW;
}
