/* Order-0 rANS coder for byte planes ("RANS" plane format v1, see docs/FORMAT.md).
 *
 * Why: the exponent planes of float weights are skewed but have no long repeats. LZ coders
 * (zstd) lose ratio there, Huffman wastes up to ~2 % on such peaked distributions (integer
 * code lengths), and zlib's Huffman-only deflate runs at ~100 MB/s.  rANS codes within ~0.1 %
 * of the order-0 entropy; per block of 2^block_log symbols it keeps its own frequency table so
 * it follows local statistics.  Eight interleaved states with separate streams let the CPU
 * overlap the dependency chains.  The encoder estimates the coded size from the histogram first and gives up
 * (returns 0) when coding would not get under the caller's limit, so an incompressible plane
 * costs one histogram pass.  The decoder validates everything: tables (sum, no zero
 * frequency), stream bounds, final states, exact stream consumption.
 *
 * The rANS core follows Fabian Giesen's public-domain rans64.h: 64-bit states in
 * [2^31, 2^63), 32-bit renormalisation (at most one word per symbol, rarely: a predictable
 * branch), reciprocal-multiply encoder.
 *
 * Plane layout: u8 format (=1) | u8 scale_bits (=12) | u8 block_log (=18) | u8 0 | u32 n |
 *   per block: u8[32] bitmap of used symbols | u16 freq per used symbol (ascending symbol) |
 *              u64 state[8] (decoder's initial states) | u32 stream length[8] (bytes, x4) |
 *              stream 0 | ... | stream 7      (little-endian 32-bit words)
 * Symbol i of a block is coded by state i & 7 into its own stream, so the decoder's eight
 * dependency chains (state and input pointer) are independent.
 */
#include "rans.h"

#include <math.h>
#include <string.h>

#define SCALE 12
#define M (1u << SCALE)
#define RANS_L (1ull << 31) /* states live in [2^31, 2^63); renormalise 32 bits at a time */
#define NS 8
#define BLOCK_LOG 18
#define HDR 8

static void put_le32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24);
}
static uint32_t get_le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* little-endian hosts only (the codec refuses big-endian ones) */
static inline uint32_t load_le16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

void mr_histogram(const uint8_t *src, size_t n, uint32_t *hist) {
    uint32_t h[4][256];
    size_t i = 0;
    memset(h, 0, sizeof(h));
    for (; i + 4 <= n; i += 4) {
        h[0][src[i]]++; h[1][src[i + 1]]++; h[2][src[i + 2]]++; h[3][src[i + 3]]++;
    }
    for (; i < n; i++) h[0][src[i]]++;
    for (i = 0; i < 256; i++) hist[i] = h[0][i] + h[1][i] + h[2][i] + h[3][i];
}

/* Scale a histogram to frequencies summing to M, every used symbol >= 1. */
static void normalize(const uint32_t *hist, size_t total, uint32_t *freq) {
    int i, used = 0, maxi = 0;
    int64_t sum = 0;
    for (i = 0; i < 256; i++) {
        freq[i] = 0;
        if (hist[i]) {
            uint64_t f = ((uint64_t)hist[i] * M + total / 2) / total;
            freq[i] = f ? (uint32_t)f : 1;
            sum += freq[i];
            used++;
            if (hist[i] > hist[maxi]) maxi = i;
        }
    }
    if (!used) return;
    if (sum != (int64_t)M) {
        int64_t d = (int64_t)M - sum;
        if ((int64_t)freq[maxi] + d >= 1) {
            freq[maxi] = (uint32_t)((int64_t)freq[maxi] + d);
        } else { /* pathological: take from every symbol that can spare it */
            while (d < 0) {
                for (i = 0; i < 256 && d < 0; i++)
                    if (freq[i] > 1) { freq[i]--; d++; }
            }
        }
    }
}

typedef struct { uint64_t x_max, rcp_freq; uint32_t bias, cmpl_freq, rcp_shift; } esym_t;

/* rans64.h's reciprocal setup: q = floor(x / freq) via a 64x64->128 multiply */
static void esym_init(esym_t *s, uint32_t start, uint32_t freq) {
    s->x_max = ((RANS_L >> SCALE) << 32) * freq;
    s->cmpl_freq = M - freq;
    if (freq < 2) {
        s->rcp_freq = ~0ull; s->rcp_shift = 0; s->bias = start + M - 1;
    } else {
        uint32_t shift = 0;
        uint64_t x0, x1, t0, t1;
        while (freq > (1u << shift)) shift++;
        x0 = freq - 1; x1 = 1ull << (shift + 31);
        t1 = x1 / freq; x0 += (x1 % freq) << 32; t0 = x0 / freq;
        s->rcp_freq = t0 + (t1 << 32);
        s->rcp_shift = shift - 1;
        s->bias = start;
    }
}

static inline uint64_t mulhi64(uint64_t a, uint64_t b) {
    return (uint64_t)(((unsigned __int128)a * b) >> 64);
}

/* Renormalisation: at most one 32-bit word leaves per symbol. */
static inline void enc_put(uint64_t *r, uint8_t **pp, const esym_t *s) {
    uint64_t x = *r, q;
    if (x >= s->x_max) { /* rare: a word leaves every ~32 bits of output */
        uint32_t w = (uint32_t)x;
        *pp -= 4;
        memcpy(*pp, &w, 4);
        x >>= 32;
    }
    q = mulhi64(x, s->rcp_freq) >> s->rcp_shift;
    *r = x + s->bias + q * s->cmpl_freq;
}

static size_t nblocks(size_t n) { return (n + ((size_t)1 << BLOCK_LOG) - 1) >> BLOCK_LOG; }

#define BLK_FIXED (32 + 8 * NS + 4 * NS)

size_t mr_encode_bound(size_t n) {
    /* front: finished blocks; tail: 4 backward stream regions of the block being coded */
    return HDR + nblocks(n) * (BLK_FIXED + 512 + 64 * NS) + 5 * n + 256;
}

static void block_table(const uint8_t *s, size_t len, uint32_t *hist, uint32_t *freq) {
    mr_histogram(s, len, hist);
    normalize(hist, len, freq);
}

int64_t mr_encode(const uint8_t *src, size_t n, uint8_t *dst, size_t cap, size_t limit) {
    size_t nb = nblocks(n), b, off = HDR;
    double est = 0.0;
    if (n == 0 || n > 0xFFFFFFFFu || cap < mr_encode_bound(n)) return -1;
    /* pass 1: exact tables, estimated size; bail out early when it cannot pay */
    for (b = 0; b < nb; b++) {
        size_t len = (b + 1 < nb) ? ((size_t)1 << BLOCK_LOG) : n - (b << BLOCK_LOG);
        uint32_t hist[256], freq[256];
        int i, used = 0;
        block_table(src + (b << BLOCK_LOG), len, hist, freq);
        for (i = 0; i < 256; i++)
            if (hist[i]) { used++; est += (double)hist[i] * (SCALE - log2((double)freq[i])); }
        est += 8.0 * (BLK_FIXED + 2 * used);
    }
    if (HDR + est / 8.0 + 16 >= (double)limit) return 0;
    dst[0] = 1; dst[1] = SCALE; dst[2] = BLOCK_LOG; dst[3] = 0;
    put_le32(dst + 4, (uint32_t)n);
    for (b = 0; b < nb; b++) {
        const uint8_t *s = src + (b << BLOCK_LOG);
        size_t len = (b + 1 < nb) ? ((size_t)1 << BLOCK_LOG) : n - (b << BLOCK_LOG);
        uint32_t hist[256], freq[256], start = 0;
        uint64_t st[NS];
        esym_t es[256];
        uint8_t *bitmap = dst + off, *p[NS], *e[NS], *hdr;
        size_t i, k, region = 4 * (len / NS + 2) + 16, slen[NS];
        block_table(s, len, hist, freq);
        memset(bitmap, 0, 32);
        off += 32;
        for (i = 0; i < 256; i++) {
            if (freq[i]) {
                bitmap[i >> 3] |= (uint8_t)(1u << (i & 7));
                dst[off] = (uint8_t)freq[i]; dst[off + 1] = (uint8_t)(freq[i] >> 8);
                off += 2;
                esym_init(&es[i], start, freq[i]);
                start += freq[i];
            }
        }
        hdr = dst + off;
        off += 12 * NS;
        /* NS backward regions at the tail of dst, one per state */
        if (off + NS * region + 8 > cap) return -1;
        for (k = 0; k < NS; k++) { e[k] = dst + cap - k * region; p[k] = e[k]; st[k] = RANS_L; }
        i = len;
        while (i % NS) { i--; enc_put(&st[i % NS], &p[i % NS], &es[s[i]]); }
        for (; i >= NS; i -= NS) {
            enc_put(&st[7], &p[7], &es[s[i - 1]]);
            enc_put(&st[6], &p[6], &es[s[i - 2]]);
            enc_put(&st[5], &p[5], &es[s[i - 3]]);
            enc_put(&st[4], &p[4], &es[s[i - 4]]);
            enc_put(&st[3], &p[3], &es[s[i - 5]]);
            enc_put(&st[2], &p[2], &es[s[i - 6]]);
            enc_put(&st[1], &p[1], &es[s[i - 7]]);
            enc_put(&st[0], &p[0], &es[s[i - 8]]);
        }
        for (k = 0; k < NS; k++) {
            slen[k] = (size_t)(e[k] - p[k]);
            put_le32(hdr + 8 * k, (uint32_t)st[k]);
            put_le32(hdr + 8 * k + 4, (uint32_t)(st[k] >> 32));
            put_le32(hdr + 8 * NS + 4 * k, (uint32_t)slen[k]);
        }
        for (k = 0; k < NS; k++) {
            if (p[k] - 4 < dst + off + slen[k]) return -1; /* cannot happen (bound) */
            memmove(dst + off, p[k], slen[k]);
            off += slen[k];
        }
        if (off >= limit) return 0;
    }
    return (int64_t)off;
}

static inline uint32_t load_le32u(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

#define DEC_STEP(k)                                                                      \
    do {                                                                                 \
        uint64_t x_ = x##k;                                                              \
        uint32_t e_ = dt[x_ & (M - 1)];                                                  \
        x_ = (uint64_t)((e_ >> 20) + 1) * (x_ >> SCALE) + ((e_ >> 8) & 0xFFF);           \
        out[i + k] = (uint8_t)e_;                                                        \
        if (x_ < RANS_L) { x_ = (x_ << 32) | load_le32u(p##k); p##k += 4; }              \
        x##k = x_;                                                                       \
    } while (0)

int mr_decode(const uint8_t *src, size_t len, uint8_t *dst, size_t n) {
    size_t nb, b, off = HDR;
    if (len < HDR || src[0] != 1 || src[1] != SCALE || src[2] != BLOCK_LOG || src[3]) return -1;
    if (get_le32(src + 4) != n || n == 0) return -2;
    nb = nblocks(n);
    for (b = 0; b < nb; b++) {
        size_t blen = (b + 1 < nb) ? ((size_t)1 << BLOCK_LOG) : n - (b << BLOCK_LOG);
        uint8_t *out = dst + (b << BLOCK_LOG);
        uint32_t freq[256], start[256], sum = 0;
        uint64_t st[NS], x0, x1, x2, x3, x4, x5, x6, x7;
        uint32_t dt[M]; /* per slot: sym | (slot - start) << 8 | (freq - 1) << 20 */
        const uint8_t *ps[NS], *pe[NS], *p0, *p1, *p2, *p3, *p4, *p5, *p6, *p7, *fp;
        size_t i, k, slen[NS], total = 0;
        if (off + 32 > len) return -3;
        fp = src + off + 32;
        for (i = 0; i < 256; i++) {
            freq[i] = 0;
            if (src[off + (i >> 3)] & (1u << (i & 7))) {
                if ((size_t)(fp - src) + 2 > len) return -3;
                freq[i] = (uint32_t)fp[0] | ((uint32_t)fp[1] << 8);
                fp += 2;
                if (freq[i] == 0 || freq[i] > M) return -4;
                start[i] = sum;
                sum += freq[i];
                if (sum > M) return -4;
            }
        }
        if (sum != M) return -4;
        off = (size_t)(fp - src);
        for (i = 0; i < 256; i++) {
            uint32_t j;
            for (j = 0; j < freq[i]; j++) dt[start[i] + j] = (uint32_t)i | (j << 8) | ((freq[i] - 1) << 20);
        }
        if (off + 12 * NS > len) return -3;
        for (k = 0; k < NS; k++) {
            st[k] = get_le32(src + off + 8 * k) | ((uint64_t)get_le32(src + off + 8 * k + 4) << 32);
            slen[k] = get_le32(src + off + 8 * NS + 4 * k);
            if (st[k] < RANS_L || st[k] >= (RANS_L << 32)) return -5;
            if (slen[k] > len || (slen[k] & 3)) return -3;
            total += slen[k];
        }
        off += 12 * NS;
        if (total > len - off) return -3;
        for (k = 0; k < NS; k++) { ps[k] = src + off; off += slen[k]; pe[k] = src + off; }
        x0 = st[0]; x1 = st[1]; x2 = st[2]; x3 = st[3]; x4 = st[4]; x5 = st[5]; x6 = st[6]; x7 = st[7];
        p0 = ps[0]; p1 = ps[1]; p2 = ps[2]; p3 = ps[3]; p4 = ps[4]; p5 = ps[5]; p6 = ps[6]; p7 = ps[7];
        i = 0;
        /* fast path: a round reads <= 2 bytes per stream, so `safe` rounds need no checks */
        for (;;) {
            size_t safe = (blen - i) / NS, r;
            const uint8_t *pp[NS] = {p0, p1, p2, p3, p4, p5, p6, p7};
            for (k = 0; k < NS; k++) {
                size_t room = (size_t)(pe[k] - pp[k]) / 4;
                if (room < safe) safe = room;
            }
            if (safe == 0) break;
            for (r = 0; r < safe; r++, i += NS) {
                DEC_STEP(0); DEC_STEP(1); DEC_STEP(2); DEC_STEP(3);
                DEC_STEP(4); DEC_STEP(5); DEC_STEP(6); DEC_STEP(7);
            }
        }
        st[0] = x0; st[1] = x1; st[2] = x2; st[3] = x3; st[4] = x4; st[5] = x5; st[6] = x6; st[7] = x7;
        ps[0] = p0; ps[1] = p1; ps[2] = p2; ps[3] = p3; ps[4] = p4; ps[5] = p5; ps[6] = p6; ps[7] = p7;
        for (; i < blen; i++) {
            size_t q = i % NS;
            uint64_t x = st[q];
            uint32_t e = dt[x & (M - 1)];
            x = (uint64_t)((e >> 20) + 1) * (x >> SCALE) + ((e >> 8) & 0xFFF);
            out[i] = (uint8_t)e;
            if (x < RANS_L) {
                if (pe[q] - ps[q] < 4) return -6;
                x = (x << 32) | load_le32u(ps[q]);
                ps[q] += 4;
            }
            st[q] = x;
        }
        for (k = 0; k < NS; k++)
            if (ps[k] != pe[k] || st[k] != RANS_L) return -7;
    }
    if (off != len) return -9;
    return 0;
}
