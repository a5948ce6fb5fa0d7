/* Order-0 rANS coders for byte planes: "RANS" plane format v1 (plane method 4) and v2
 * ("RANS32", method 5), see docs/FORMAT.md.  New planes are written as v2; v1 stays readable.
 *
 * Why: the exponent planes of float weights are skewed but have no long repeats. LZ coders
 * (zstd) lose ratio there, Huffman wastes up to ~2 % on such peaked distributions (integer
 * code lengths), and zlib's Huffman-only deflate runs at ~100 MB/s.  rANS codes within ~0.1 %
 * of the order-0 entropy; per block of 2^block_log symbols it keeps its own frequency table so
 * it follows local statistics.  The encoders estimate the coded size from the histogram first
 * and give up (return 0) when coding would not get under the caller's limit, so an
 * incompressible plane costs one histogram pass.  The decoders validate everything: tables
 * (sum, no zero frequency), stream bounds, final states, exact stream consumption.
 *
 * v1: eight interleaved 64-bit states in [2^31, 2^63), each with its own stream of 32-bit
 * words (Fabian Giesen's public-domain rans64.h: at most one word per symbol, reciprocal-
 * multiply encoder).  Plane layout: u8 format (=1) | u8 scale_bits (=12) | u8 block_log (=18) |
 * u8 0 | u32 n | per block: u8[32] bitmap of used symbols | u16 freq per used symbol
 * (ascending symbol) | u64 state[8] (decoder's initial states) | u32 stream length[8] (bytes,
 * x4) | stream 0 | ... | stream 7 (little-endian 32-bit words).  Symbol i of a block is coded
 * by state i & 7 into its own stream, so the decoder's eight dependency chains are
 * independent.  Its per-lane streams need a gather per refill, so v1 stays scalar.
 *
 * v2 (layout at mr2_encode): 32 interleaved 32-bit states sharing one stream of 16-bit words
 * in decode order, so an AVX2 decoder holds 8 states per register, looks slots up with one
 * gather and refills a register from consecutive words with a permute (Ryg's rans_word_sse
 * scheme); the AVX2 encoder mirrors it (compress-store of the leaving words, float division
 * corrected to the exact quotient) and writes the same bytes as the scalar one.  With AVX-512
 * (F+BW+VL+VBMI, chosen at run time) the encoder codes two blocks at once (one block's 32
 * lanes are a latency-bound chain) and looks the symbols up with byte permutes; same bytes
 * again.  Same tables, ratio within ~0.05 % of v1.
 *
 * Renormalisation is branch-free in the hot loops (cmov through asm on x86-64: a branch there
 * mispredicts every dozen symbols or so), and the AVX2 path is chosen at run time
 * (__builtin_cpu_supports), so one binary runs on any x86-64 CPU.
 */
#include "rans.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define SCALE 12
#define M (1u << SCALE)
#define RANS_L (1ull << 31) /* states live in [2^31, 2^63); renormalise 32 bits at a time */
#define NS 8
#define BLOCK_LOG 18
#define HDR 8

#if defined(__GNUC__) && defined(__x86_64__) && !defined(RANS_PORTABLE)
#define MR_HAVE_X86 1
#else
#define MR_HAVE_X86 0
#endif

/* SIMD level: -1 unknown, 0 scalar, 1 AVX2, 2 AVX-512 (F+BW+VL+VBMI; the v2 encoder only)
 * (detected once; mr_set_level caps it for tests) */
static int g_level = -1;

static int mr_detect(void) {
#if MR_HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi"))
        return 2;
    return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

int mr_set_level(int level) {
    int top = mr_detect();
    g_level = (level < 0 || level > top) ? top : level;
    return g_level;
}

#if MR_HAVE_X86
static int mr_use_avx2(void) {
    if (g_level < 0) g_level = mr_detect();
    return g_level >= 1;
}
static int mr_use_avx512(void) {
    if (g_level < 0) g_level = mr_detect();
    return g_level >= 2;
}
#endif

#if MR_HAVE_X86
#include <immintrin.h>
#endif

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

static void hist_scalar(const uint8_t *src, size_t n, uint32_t *hist) {
    uint32_t h[4][256];
    size_t i = 0;
    memset(h, 0, sizeof(h));
    for (; i + 8 <= n; i += 8) { /* 4 sub-histograms: consecutive equal bytes do not stall */
        uint64_t v;
        memcpy(&v, src + i, 8);
        h[0][v & 255]++; h[1][(v >> 8) & 255]++; h[2][(v >> 16) & 255]++; h[3][(v >> 24) & 255]++;
        h[0][(v >> 32) & 255]++; h[1][(v >> 40) & 255]++; h[2][(v >> 48) & 255]++; h[3][v >> 56]++;
    }
    for (; i < n; i++) h[0][src[i]]++;
    for (i = 0; i < 256; i++) hist[i] = h[0][i] + h[1][i] + h[2][i] + h[3][i];
}

#if MR_HAVE_X86
#define HIST_TOP 16
/* Exponent planes put almost all their bytes on a handful of values (MiniLM bf16: the 16 most
 * frequent hold >= 99.8 % of every block).  Those 16 are counted 64 bytes at a time (compare
 * to a mask, popcount); the rare other bytes one by one from the complement mask.  Picked from
 * a 2048-byte sample; below 90 % coverage the scalar histogram is used (returns 0).  ~30 %
 * faster than the scalar one on exponent planes; exact either way. */
__attribute__((target("avx512f,avx512bw,popcnt"))) static int hist_top_avx512(
    const uint8_t *src, size_t n, uint32_t *hist) {
    uint32_t s[256];
    uint8_t top[HIST_TOP], used[256];
    uint64_t cnt[HIST_TOP];
    __m512i v[HIST_TOP];
    size_t i, stride, m = 0, cov = 0;
    int k, j;
    if (n < 8192) return 0;
    memset(s, 0, sizeof(s));
    memset(used, 0, sizeof(used));
    stride = n / 2048;
    for (i = 0; i < n; i += stride, m++) s[src[i]]++;
    for (k = 0; k < HIST_TOP; k++) { /* the 16 most frequent in the sample, all distinct */
        int best = -1;
        for (j = 0; j < 256; j++)
            if (!used[j] && (best < 0 || s[j] > s[best])) best = j;
        top[k] = (uint8_t)best;
        used[best] = 1;
        cov += s[best];
    }
    if (cov * 10 < m * 9) return 0;
    for (k = 0; k < HIST_TOP; k++) {
        v[k] = _mm512_set1_epi8((char)top[k]);
        cnt[k] = 0;
    }
    memset(hist, 0, 256 * sizeof(uint32_t));
    for (i = 0; i + 64 <= n; i += 64) {
        __m512i x = _mm512_loadu_si512((const void *)(src + i));
        __mmask64 any = 0;
        for (k = 0; k < HIST_TOP; k++) {
            __mmask64 e = _mm512_cmpeq_epi8_mask(x, v[k]);
            cnt[k] += (uint64_t)_mm_popcnt_u64((uint64_t)e);
            any |= e;
        }
        for (any = ~any; any; any &= any - 1) hist[src[i + (size_t)__builtin_ctzll(any)]]++;
    }
    for (; i < n; i++) hist[src[i]]++;
    for (k = 0; k < HIST_TOP; k++) hist[top[k]] += (uint32_t)cnt[k];
    return 1;
}
#endif

void mr_histogram(const uint8_t *src, size_t n, uint32_t *hist) {
#if MR_HAVE_X86
    if (mr_use_avx512() && hist_top_avx512(src, n, hist)) return;
#endif
    hist_scalar(src, n, hist);
}

/* Order-0 entropy (bits/byte) of every stride-th byte, stride = n / max_sample (1 when
 * n <= max_sample): the same sample and formula as entropy.sample_entropy's numpy fallback,
 * without its per-call overhead (the codec asks once per plane). */
double mr_sample_entropy(const uint8_t *src, size_t n, size_t max_sample) {
    uint32_t h[256];
    size_t stride, m = 0, i;
    double sum = 0.0;
    if (n == 0) return 0.0;
    if (n <= max_sample || max_sample == 0) {
        mr_histogram(src, n, h);
        m = n;
    } else {
        stride = n / max_sample;
        memset(h, 0, sizeof(h));
        for (i = 0; i < n; i += stride, m++) h[src[i]]++;
    }
    for (i = 0; i < 256; i++)
        if (h[i]) sum += (double)h[i] * log2((double)h[i]);
    return log2((double)m) - sum / (double)m;
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

/* Renormalisation: at most one 32-bit word leaves per symbol.  Branch-free: the low word is
 * always stored below the stream pointer and the pointer only moves when it really leaves
 * (a branch here mispredicts about once every 12 symbols).  The store stays inside the
 * stream's region: the region keeps >= 4 spare bytes below the lowest word (see region). */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(RANS_PORTABLE)
/* cmov through asm: gcc turns the C form back into a branch or a setcc/shift chain */
#define ENC_STEP(k, sym)                                                                 \
    do {                                                                                 \
        const esym_t *s_ = &es[sym];                                                     \
        uint64_t x_ = x##k, y_ = x_ >> 32, q_;                                           \
        uint8_t *n_ = p##k - 4;                                                          \
        uint32_t w_ = (uint32_t)x_;                                                      \
        memcpy(n_, &w_, 4);                                                              \
        __asm__("cmp %[xm], %[x]\n\tcmovae %[y], %[x]\n\tcmovae %[n], %[p]"              \
                : [x] "+&r"(x_), [p] "+&r"(p##k)                                         \
                : [y] "r"(y_), [n] "r"(n_), [xm] "m"(s_->x_max) : "cc");                 \
        q_ = mulhi64(x_, s_->rcp_freq) >> s_->rcp_shift;                                 \
        x##k = x_ + s_->bias + q_ * s_->cmpl_freq;                                       \
    } while (0)
#else
#define ENC_STEP(k, sym)                                                                 \
    do {                                                                                 \
        const esym_t *s_ = &es[sym];                                                     \
        uint64_t x_ = x##k, c_ = x_ >= s_->x_max, q_;                                    \
        uint32_t w_ = (uint32_t)x_;                                                      \
        memcpy(p##k - 4, &w_, 4);                                                        \
        p##k -= c_ << 2;                                                                 \
        x_ >>= (c_ << 5);                                                                \
        q_ = mulhi64(x_, s_->rcp_freq) >> s_->rcp_shift;                                 \
        x##k = x_ + s_->bias + q_ * s_->cmpl_freq;                                       \
    } while (0)
#endif

static inline void enc_one(uint64_t *r, uint8_t **pp, const esym_t *es) {
    uint64_t x0 = *r;
    uint8_t *p0 = *pp;
    ENC_STEP(0, 0);
    *r = x0; *pp = p0;
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
    uint16_t *ftab; /* pass 1's normalised tables, reused by pass 2 */
    if (n == 0 || n > 0xFFFFFFFFu || cap < mr_encode_bound(n)) return -1;
    ftab = (uint16_t *)malloc(nb * 256 * sizeof(uint16_t));
    if (!ftab) return -1;
    /* pass 1: exact tables, estimated size; bail out early when it cannot pay */
    for (b = 0; b < nb; b++) {
        size_t len = (b + 1 < nb) ? ((size_t)1 << BLOCK_LOG) : n - (b << BLOCK_LOG);
        uint32_t hist[256], freq[256];
        int i, used = 0;
        block_table(src + (b << BLOCK_LOG), len, hist, freq);
        for (i = 0; i < 256; i++) {
            ftab[b * 256 + i] = (uint16_t)freq[i]; /* <= M - 1 unless a lone symbol (M) */
            if (hist[i]) { used++; est += (double)hist[i] * (SCALE - log2((double)freq[i])); }
        }
        est += 8.0 * (BLK_FIXED + 2 * used);
    }
    if (HDR + est / 8.0 + 16 >= (double)limit) { free(ftab); return 0; }
    dst[0] = 1; dst[1] = SCALE; dst[2] = BLOCK_LOG; dst[3] = 0;
    put_le32(dst + 4, (uint32_t)n);
    for (b = 0; b < nb; b++) {
        const uint8_t *s = src + (b << BLOCK_LOG);
        size_t len = (b + 1 < nb) ? ((size_t)1 << BLOCK_LOG) : n - (b << BLOCK_LOG);
        uint32_t start = 0;
        uint64_t st[NS], x0, x1, x2, x3, x4, x5, x6, x7;
        esym_t es[256];
        const uint16_t *freq = ftab + b * 256;
        uint8_t *bitmap = dst + off, *p[NS], *e[NS], *hdr, *p0, *p1, *p2, *p3, *p4, *p5, *p6, *p7;
        /* words per state <= ceil(len / NS) (one per symbol at most) + 1 flush; +16 spare */
        size_t i, k, region = 4 * (len / NS + 2) + 16, slen[NS];
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
        if (off + NS * region + 8 > cap) { free(ftab); return -1; }
        for (k = 0; k < NS; k++) { e[k] = dst + cap - k * region; p[k] = e[k]; st[k] = RANS_L; }
        i = len;
        while (i % NS) { /* the tail symbols (len not a multiple of NS), one state each */
            size_t q = --i % NS;
            enc_one(&st[q], &p[q], &es[s[i]]);
        }
        x0 = st[0]; x1 = st[1]; x2 = st[2]; x3 = st[3]; x4 = st[4]; x5 = st[5]; x6 = st[6]; x7 = st[7];
        p0 = p[0]; p1 = p[1]; p2 = p[2]; p3 = p[3]; p4 = p[4]; p5 = p[5]; p6 = p[6]; p7 = p[7];
        for (; i >= NS; i -= NS) {
            const uint8_t *sp = s + i - NS;
            ENC_STEP(7, sp[7]); ENC_STEP(6, sp[6]); ENC_STEP(5, sp[5]); ENC_STEP(4, sp[4]);
            ENC_STEP(3, sp[3]); ENC_STEP(2, sp[2]); ENC_STEP(1, sp[1]); ENC_STEP(0, sp[0]);
        }
        st[0] = x0; st[1] = x1; st[2] = x2; st[3] = x3; st[4] = x4; st[5] = x5; st[6] = x6; st[7] = x7;
        p[0] = p0; p[1] = p1; p[2] = p2; p[3] = p3; p[4] = p4; p[5] = p5; p[6] = p6; p[7] = p7;
        for (k = 0; k < NS; k++) {
            slen[k] = (size_t)(e[k] - p[k]);
            put_le32(hdr + 8 * k, (uint32_t)st[k]);
            put_le32(hdr + 8 * k + 4, (uint32_t)(st[k] >> 32));
            put_le32(hdr + 8 * NS + 4 * k, (uint32_t)slen[k]);
        }
        for (k = 0; k < NS; k++) {
            if (p[k] - 4 < dst + off + slen[k]) { free(ftab); return -1; } /* cannot happen (bound) */
            memmove(dst + off, p[k], slen[k]);
            off += slen[k];
        }
        if (off >= limit) { free(ftab); return 0; }
    }
    free(ftab);
    return (int64_t)off;
}

static inline uint32_t load_le32u(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* One decode step of state k.  Branch-free refill: the next word of stream k is always
 * loaded (the fast loop guarantees one is there) and only kept when the state fell below
 * RANS_L; a branch here mispredicts about once every 12 symbols. */
/* One decode step of state k: slot -> (freq, slot - start, symbol) from three flat tables
 * (loads are cheaper than unpacking a packed entry), then the refill.  The refill is
 * branch-free: the next word of stream k is always loaded (the fast loop guarantees one is
 * there) and a cmov keeps it only when the state fell below RANS_L; a branch here
 * mispredicts about once every 12 symbols.  gcc turns the C form into a branch, hence the
 * asm on x86-64. */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(RANS_PORTABLE)
#define DEC_REFILL(k)                                                                    \
    __asm__("cmp %[L], %[x]\n\tcmovb %[y], %[x]\n\tcmovb %[q], %[p]"                     \
            : [x] "+&r"(x_), [p] "+&r"(p##k) : [y] "r"(y_), [q] "r"(q_), [L] "r"(RANS_L) \
            : "cc")
#else
#define DEC_REFILL(k)                                                                    \
    if (x_ < RANS_L) { x_ = y_; p##k = q_; }
#endif
#define DEC_STEP(k)                                                                      \
    do {                                                                                 \
        uint64_t x_ = x##k, y_;                                                          \
        size_t s_ = x_ & (M - 1);                                                        \
        const uint8_t *q_ = p##k + 4;                                                    \
        x_ = (uint64_t)fq[s_] * (x_ >> SCALE) + bs[s_];                                  \
        out[i + k] = sy[s_];                                                             \
        y_ = (x_ << 32) | load_le32u(p##k);                                              \
        DEC_REFILL(k);                                                                   \
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
        uint16_t fq[M], bs[M]; /* per slot: freq, slot - start */
        uint8_t sy[M];         /* per slot: symbol */
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
            for (j = 0; j < freq[i]; j++) {
                fq[start[i] + j] = (uint16_t)freq[i]; /* <= M: fits */
                bs[start[i] + j] = (uint16_t)j;
                sy[start[i] + j] = (uint8_t)i;
            }
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
        /* fast path: a round reads <= 1 word per stream, so `safe` rounds need no checks */
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
            size_t s = x & (M - 1);
            x = (uint64_t)fq[s] * (x >> SCALE) + bs[s];
            out[i] = sy[s];
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

/* ------------------------------------------------------------------------------------------
 * RANS plane format v2 ("RANS32", plane method 5): 32 interleaved 32-bit states sharing ONE
 * stream of 16-bit words, so a SIMD decoder keeps 8 states per AVX2 register and refills a
 * whole register from consecutive words (no per-lane stream pointers, no gather for input).
 *
 * Plane layout: u8 format (=2) | u8 scale_bits (=12) | u8 block_log (=18) | u8 lanes (=32) |
 *   u32 n | per block: u8[32] bitmap of used symbols | u16 freq per used symbol |
 *   u32 state[32] (decoder's initial states) | u32 stream length (bytes, even) | u16 words
 * Symbol i of a block is coded by state i & 31.  States live in [2^16, 2^32); after each
 * symbol a state below 2^16 takes the next word: x = x << 16 | word.  The decoder reads the
 * words in symbol order (lane order within a round of 32), the encoder writes them backwards.
 * ------------------------------------------------------------------------------------------ */
#define V2_LANES 32
#define V2_L (1u << 16)
#define V2_BLK_FIXED (32 + 4 * V2_LANES + 4)

size_t mr2_encode_bound(size_t n) {
    /* front: finished blocks; tail: the backward stream of the block being coded */
    /* finished blocks take <= their tables + 2 bytes per symbol (one 16-bit word at most per
     * symbol); the block being coded streams down from the end into what is left of that */
    return HDR + nblocks(n) * (V2_BLK_FIXED + 512) + 2 * n + 64 * V2_LANES + 256;
}

size_t mr2_encode_cap(size_t n, size_t limit) {
    /* the coder gives up once the finished blocks reach limit, so it never needs more than
     * limit + one block's table and stream */
    size_t bound = mr2_encode_bound(n);
    size_t alt = limit + HDR + V2_BLK_FIXED + 512 + 2 * ((size_t)1 << BLOCK_LOG) + 64 * V2_LANES
                 + 256;
    return limit < bound && alt < bound ? alt : bound;
}

/* one symbol into state j: branch-free renormalisation (the low word is always stored, the
 * pointer only moves when it really leaves), then the reciprocal-multiply step */
#if MR_HAVE_X86
#define V2_ENC(j, sym)                                                                   \
    do {                                                                                 \
        const esym_t *sy_ = &es[sym];                                                    \
        uint64_t x_ = st[j], y_ = x_ >> 16, q_;                                          \
        uint8_t *n_ = p - 2;                                                             \
        uint16_t w_ = (uint16_t)x_;                                                      \
        memcpy(n_, &w_, 2);                                                              \
        __asm__("cmp %[xm], %[x]\n\tcmovae %[y], %[x]\n\tcmovae %[n], %[p]"              \
                : [x] "+&r"(x_), [p] "+&r"(p)                                            \
                : [y] "r"(y_), [n] "r"(n_), [xm] "m"(sy_->x_max) : "cc");                \
        q_ = mulhi64(x_, sy_->rcp_freq) >> sy_->rcp_shift;                               \
        st[j] = x_ + sy_->bias + q_ * sy_->cmpl_freq;                                    \
    } while (0)
#else
#define V2_ENC(j, sym)                                                                   \
    do {                                                                                 \
        const esym_t *sy_ = &es[sym];                                                    \
        uint64_t x_ = st[j], q_;                                                         \
        if (x_ >= sy_->x_max) {                                                          \
            uint16_t w_ = (uint16_t)x_;                                                  \
            p -= 2;                                                                      \
            memcpy(p, &w_, 2);                                                           \
            x_ >>= 16;                                                                   \
        }                                                                                \
        q_ = mulhi64(x_, sy_->rcp_freq) >> sy_->rcp_shift;                               \
        st[j] = x_ + sy_->bias + q_ * sy_->cmpl_freq;                                    \
    } while (0)
#endif

#if MR_HAVE_X86
/* AVX2 encoder: rounds of 32 symbols, ending at sp (= s + i), states st[32], stream pointer
 * *pp (writes go down; <= 16 bytes below the lowest word may be scribbled on).  Same
 * arithmetic as V2_ENC, so the same bytes: q = floor(x / freq) (float division, corrected
 * exactly), x' = x + start + q * (M - freq).
 * ent[i] = sym_tab[s[i]] = freq | start << 16 for the block's symbols, looked up by a scalar
 * pass before: an AVX2 gather per 8 symbols is microcoded and slow on AMD Zen, and the lookup
 * pass plus plain vector loads took MiniLM bf16's 22 MB of exponent planes from 42 to 36 ms
 * on this EPYC.  clut[m]: the set lanes of m, ascending, at the top. */
__attribute__((target("avx2"))) static void v2_encode_avx2(
    const uint32_t *ent, size_t rounds, uint64_t *st, uint8_t **pp, const uint32_t *clut) {
    uint8_t *p = *pp;
    __m256i x[4];
    const __m256i f13 = _mm256_set1_epi32(0x1FFF), m16 = _mm256_set1_epi32(0xFFFF);
    const __m256i mM = _mm256_set1_epi32(M);
    const __m256 two16 = _mm256_set1_ps(65536.0f);
    const __m256i zero = _mm256_setzero_si256(), one = _mm256_set1_epi32(1);
    int v, k;
    for (v = 0; v < 4; v++) {
        uint32_t t[8];
        for (k = 0; k < 8; k++) t[k] = (uint32_t)st[8 * v + k];
        x[v] = _mm256_loadu_si256((const __m256i *)(const void *)t);
    }
    while (rounds--) {
        const uint32_t *ep = ent + rounds * V2_LANES;
        for (v = 4; v-- > 0;) {
            __m256i e = _mm256_loadu_si256((const __m256i *)(const void *)(ep + 8 * v));
            __m256i f = _mm256_and_si256(e, f13), start = _mm256_srli_epi32(e, 16);
            /* renormalise when x >= freq << 20, i.e. (x >> 20) >= freq (freq = M: never) */
            __m256i keep = _mm256_cmpgt_epi32(f, _mm256_srli_epi32(x[v], 20));
            unsigned bits = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(keep)) ^ 0xFFu;
            __m256i w, q, r;
            __m256 xf;
            /* branch-free: the 16-byte store happens even when no lane renormalises */
            w = _mm256_and_si256(x[v], m16);
            w = _mm256_permutevar8x32_epi32(
                w, _mm256_loadu_si256((const __m256i *)(const void *)(clut + 8 * bits)));
            w = _mm256_permute4x64_epi64(_mm256_packus_epi32(w, w), 0x08);
            _mm_storeu_si128((__m128i *)(void *)(p - 16), _mm256_castsi256_si128(w));
            p -= 2 * (size_t)__builtin_popcount(bits);
            x[v] = _mm256_blendv_epi8(_mm256_srli_epi32(x[v], 16), x[v], keep);
            /* q = floor(x / f): a float estimate lands within 1 of it (q < 2^20 after
             * renormalisation; x converted as two exact 16-bit halves, relative error
             * < 2^-22), then one exact correction step each way */
            xf = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(x[v], 16)), two16),
                               _mm256_cvtepi32_ps(_mm256_and_si256(x[v], m16)));
            q = _mm256_cvttps_epi32(_mm256_div_ps(xf, _mm256_cvtepi32_ps(f)));
            r = _mm256_sub_epi32(x[v], _mm256_mullo_epi32(q, f)); /* x - q*f, exact mod 2^32 */
            q = _mm256_add_epi32(q, _mm256_cmpgt_epi32(zero, r));  /* r < 0: q - 1 */
            r = _mm256_add_epi32(r, _mm256_and_si256(_mm256_cmpgt_epi32(zero, r), f));
            q = _mm256_sub_epi32(q, _mm256_cmpgt_epi32(r, _mm256_sub_epi32(f, one))); /* r >= f */
            x[v] = _mm256_add_epi32(_mm256_add_epi32(x[v], start),
                                    _mm256_mullo_epi32(q, _mm256_sub_epi32(mM, f)));
        }
    }
    for (v = 0; v < 4; v++) {
        uint32_t t[8];
        _mm256_storeu_si256((__m256i *)(void *)t, x[v]);
        for (k = 0; k < 8; k++) st[8 * v + k] = t[k];
    }
    *pp = p;
}
/* ent[k] = sym_tab[s[k]] for k < n: 64 symbols at a time through the
 * bytes of the table (four 256-byte tables, looked up with VBMI two-register byte permutes,
 * then interleaved back into 32-bit entries).  A gather per 16 symbols took as long as the
 * whole encoding loop on Zen 4. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi"))) static void v2_lookup_avx512(
    const uint8_t *s, size_t n, const uint32_t *sym_tab, uint32_t *ent) {
    uint8_t tb[4][256];
    __m512i t[4][4];
    size_t k, whole = n & ~(size_t)63;
    int b, j;
    for (j = 0; j < 256; j++)
        for (b = 0; b < 4; b++) tb[b][j] = (uint8_t)(sym_tab[j] >> (8 * b));
    for (b = 0; b < 4; b++)
        for (j = 0; j < 4; j++) t[b][j] = _mm512_loadu_si512((const void *)(tb[b] + 64 * j));
    for (k = 0; k < whole; k += 64) {
        __m512i idx = _mm512_loadu_si512((const void *)(s + k)), by[4], u0, u1, u2, u3;
        __m512i e0, e1, e2, e3, a, c, d, f;
        __mmask64 high = _mm512_movepi8_mask(idx);
        for (b = 0; b < 4; b++)
            by[b] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(t[b][0], idx, t[b][1]),
                                           _mm512_permutex2var_epi8(t[b][2], idx, t[b][3]));
        u0 = _mm512_unpacklo_epi8(by[0], by[1]);
        u1 = _mm512_unpackhi_epi8(by[0], by[1]);
        u2 = _mm512_unpacklo_epi8(by[2], by[3]);
        u3 = _mm512_unpackhi_epi8(by[2], by[3]);
        e0 = _mm512_unpacklo_epi16(u0, u2); /* per 128-bit lane L: symbols 16L + 0..3 */
        e1 = _mm512_unpackhi_epi16(u0, u2); /* 16L + 4..7 */
        e2 = _mm512_unpacklo_epi16(u1, u3); /* 16L + 8..11 */
        e3 = _mm512_unpackhi_epi16(u1, u3); /* 16L + 12..15 */
        a = _mm512_shuffle_i32x4(e0, e1, 0x44);
        c = _mm512_shuffle_i32x4(e2, e3, 0x44);
        d = _mm512_shuffle_i32x4(e0, e1, 0xEE);
        f = _mm512_shuffle_i32x4(e2, e3, 0xEE);
        _mm512_storeu_si512((void *)(ent + k), _mm512_shuffle_i32x4(a, c, 0x88));
        _mm512_storeu_si512((void *)(ent + k + 16), _mm512_shuffle_i32x4(a, c, 0xDD));
        _mm512_storeu_si512((void *)(ent + k + 32), _mm512_shuffle_i32x4(d, f, 0x88));
        _mm512_storeu_si512((void *)(ent + k + 48), _mm512_shuffle_i32x4(d, f, 0xDD));
    }
    for (; k < n; k++) ent[k] = sym_tab[s[k]];
}

/* One round of 16 lanes of the AVX-512 encoder: the AVX2 one's arithmetic (same bytes as
 * V2_ENC), with the leaving words packed by a compress and stored under a word mask (nothing
 * below them is scribbled on), and q = floor(x / f) from a float reciprocal (rcp14 and one
 * Newton step, ~2^-23; x converted exactly-rounded as unsigned) corrected by one exact step
 * each way. */
__attribute__((always_inline, target("avx512f,avx512bw,avx512vl"))) static inline __m512i
v2_step_avx512(__m512i x, __m512i e, uint8_t **pp) {
    const __m512i f = _mm512_and_si512(e, _mm512_set1_epi32(0x1FFF));
    const __m512i start = _mm512_srli_epi32(e, 16), one = _mm512_set1_epi32(1);
    /* renormalise when (x >> 20) >= freq */
    __mmask16 out = _mm512_cmpge_epu32_mask(_mm512_srli_epi32(x, 20), f), neg, big;
    unsigned cnt = (unsigned)__builtin_popcount((unsigned)out);
    __m512 ff = _mm512_cvtepi32_ps(f), rf = _mm512_rcp14_ps(ff);
    __m512i q, r;
    *pp -= 2 * (size_t)cnt;
    _mm256_mask_storeu_epi16((void *)*pp, (__mmask16)((1u << cnt) - 1u),
                             _mm512_cvtepi32_epi16(_mm512_maskz_compress_epi32(out, x)));
    x = _mm512_mask_srli_epi32(x, out, x, 16);
    rf = _mm512_mul_ps(rf, _mm512_fnmadd_ps(ff, rf, _mm512_set1_ps(2.0f)));
    q = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_cvtepu32_ps(x), rf));
    r = _mm512_sub_epi32(x, _mm512_mullo_epi32(q, f));
    neg = _mm512_cmplt_epi32_mask(r, _mm512_setzero_si512());
    q = _mm512_mask_sub_epi32(q, neg, q, one);
    r = _mm512_mask_add_epi32(r, neg, r, f);
    big = _mm512_cmpge_epi32_mask(r, f);
    q = _mm512_mask_add_epi32(q, big, q, one);
    return _mm512_add_epi32(_mm512_add_epi32(x, start),
                            _mm512_mullo_epi32(q, _mm512_sub_epi32(_mm512_set1_epi32(M), f)));
}

/* AVX-512 encoder of g (1 or 2) blocks of the same length at once: block j's entries ent[j],
 * states st[j], stream pointer pp[j].  One block is a chain of 32 lanes (two registers) whose
 * latency bounds the loop; two independent blocks interleaved keep twice as many in flight
 * (MiniLM bf16's 22.7 MB of exponent planes: 11.4 -> ~6 ms for the loop on Zen 4; the
 * whole coder with histogram and lookup 28 -> 18 ms against the AVX2 one). */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void v2_encode_avx512(
    const uint32_t *const *ent, size_t rounds, uint64_t *const *st, uint8_t **pp, int g) {
    __m512i x[4];
    uint8_t *p[2];
    int v, k, j;
    for (j = 0; j < g; j++) {
        p[j] = pp[j];
        for (v = 0; v < 2; v++) {
            uint32_t t[16];
            for (k = 0; k < 16; k++) t[k] = (uint32_t)st[j][16 * v + k];
            x[2 * j + v] = _mm512_loadu_si512((const void *)t);
        }
    }
    if (g == 2) {
        while (rounds--) {
            const uint32_t *e0 = ent[0] + rounds * V2_LANES, *e1 = ent[1] + rounds * V2_LANES;
            x[1] = v2_step_avx512(x[1], _mm512_loadu_si512((const void *)(e0 + 16)), &p[0]);
            x[3] = v2_step_avx512(x[3], _mm512_loadu_si512((const void *)(e1 + 16)), &p[1]);
            x[0] = v2_step_avx512(x[0], _mm512_loadu_si512((const void *)e0), &p[0]);
            x[2] = v2_step_avx512(x[2], _mm512_loadu_si512((const void *)e1), &p[1]);
        }
    } else {
        while (rounds--) {
            const uint32_t *e0 = ent[0] + rounds * V2_LANES;
            x[1] = v2_step_avx512(x[1], _mm512_loadu_si512((const void *)(e0 + 16)), &p[0]);
            x[0] = v2_step_avx512(x[0], _mm512_loadu_si512((const void *)e0), &p[0]);
        }
    }
    for (j = 0; j < g; j++) {
        pp[j] = p[j];
        for (v = 0; v < 2; v++) {
            uint32_t t[16];
            _mm512_storeu_si512((void *)t, x[2 * j + v]);
            for (k = 0; k < 16; k++) st[j][16 * v + k] = t[k];
        }
    }
}
#endif

#define BLK ((size_t)1 << BLOCK_LOG)
/* scratch for one block's backward stream: <= one word per symbol, 16 spare bytes below */
#define V2_REGION (2 * BLK + 64)

/* Scalar steps for symbols from-1 down to to (symbol k on lane k & 31): a block's partial last
 * round, and whatever no SIMD path took */
static void v2_enc_scalar(const uint8_t *s, size_t from, size_t to, uint64_t *st, uint8_t **pp,
                          const esym_t *es) {
    uint8_t *p = *pp;
    size_t k;
    for (k = from; k-- > to;) V2_ENC(k & (V2_LANES - 1), s[k]);
    *pp = p;
}

/* A block's coder tables from its normalised frequencies: es for the scalar steps, sym_tab
 * (freq | start << 16) for the SIMD ones. */
static void v2_tables(const uint16_t *freq, esym_t *es, uint32_t *sym_tab) {
    uint32_t start = 0;
    int i;
    for (i = 0; i < 256; i++) {
        sym_tab[i] = 0;
        if (freq[i]) {
            esym_init(&es[i], start, freq[i]);
            sym_tab[i] = freq[i] | (start << 16);
            /* renormalise while x >= x_max = ((L >> SCALE) << 16) * freq: one word at most */
            es[i].x_max = ((uint64_t)(V2_L >> SCALE) << 16) * freq[i];
            start += freq[i];
        }
    }
}

/* A block's table as stored: bitmap of used symbols, then their u16 frequencies */
static void v2_put_table(const uint16_t *freq, uint8_t *dst, size_t *off) {
    uint8_t *bitmap = dst + *off;
    size_t o = *off + 32;
    int i;
    memset(bitmap, 0, 32);
    for (i = 0; i < 256; i++) {
        if (freq[i]) {
            bitmap[i >> 3] |= (uint8_t)(1u << (i & 7));
            dst[o] = (uint8_t)freq[i]; dst[o + 1] = (uint8_t)(freq[i] >> 8);
            o += 2;
        }
    }
    *off = o;
}

int64_t mr2_encode(const uint8_t *src, size_t n, uint8_t *dst, size_t cap, size_t limit) {
    size_t nb = nblocks(n), b, off = HDR;
    double est = 0.0;
    uint16_t *ftab;
    uint32_t *ent = NULL; /* the SIMD paths' per-symbol table entries of one or two blocks */
    uint8_t *pairbuf = NULL; /* AVX-512: the backward streams of a pair of blocks */
#if MR_HAVE_X86
    int avx2 = mr_use_avx2(), avx512 = mr_use_avx512();
    uint32_t clut[256 * 8];
    if (avx2 && !avx512) {
        unsigned m, j;
        for (m = 0; m < 256; m++) {
            unsigned c = 8 - (unsigned)__builtin_popcount(m);
            for (j = 0; j < 8; j++) clut[8 * m + j] = 0;
            for (j = 0; j < 8; j++)
                if (m & (1u << j)) clut[8 * m + c++] = j;
        }
    }
#else
    const int avx2 = 0, avx512 = 0;
    (void)avx2;
#endif
    if (n == 0 || n > 0xFFFFFFFFu || cap < mr2_encode_cap(n, limit)) return -1;
    ftab = (uint16_t *)malloc(nb * 256 * sizeof(uint16_t));
    if (!ftab) return -1;
    for (b = 0; b < nb; b++) {
        size_t len = (b + 1 < nb) ? ((size_t)1 << BLOCK_LOG) : n - (b << BLOCK_LOG);
        uint32_t hist[256], freq[256];
        int i, used = 0;
        block_table(src + (b << BLOCK_LOG), len, hist, freq);
        for (i = 0; i < 256; i++) {
            ftab[b * 256 + i] = (uint16_t)freq[i];
            if (hist[i]) { used++; est += (double)hist[i] * (SCALE - log2((double)freq[i])); }
        }
        est += 8.0 * (V2_BLK_FIXED + 2 * used);
    }
    if (HDR + est / 8.0 + 16 >= (double)limit) { free(ftab); free(ent); return 0; }
#if MR_HAVE_X86
    if (avx2 || avx512) {
        /* AVX-512 with two or more blocks: entries and scratch streams of a pair of blocks */
        int two = avx512 && nb > 1;
        ent = (uint32_t *)malloc(sizeof(uint32_t) * (two ? 2 * BLK : (n < BLK ? n : BLK)));
        if (two) pairbuf = (uint8_t *)malloc(2 * V2_REGION);
        if (!ent || (two && !pairbuf)) { free(ftab); free(ent); free(pairbuf); return -1; }
    }
#endif
    dst[0] = 2; dst[1] = SCALE; dst[2] = BLOCK_LOG; dst[3] = V2_LANES;
    put_le32(dst + 4, (uint32_t)n);
    for (b = 0; b < nb;) {
        /* AVX-512: two whole blocks at a time (their streams in scratch, then moved) */
        int pair = avx512 && pairbuf && b + 1 < nb && (b + 2 < nb || !(n & (BLK - 1)));
        int g = pair ? 2 : 1, j;
        uint32_t sym_tab[2][256];
        uint64_t st[2][V2_LANES];
        esym_t es[256];
        uint8_t *hdr[2], *e[2], *p[2];
        size_t len[2], i, k, slen;
        for (j = 0; j < g; j++) {
            len[j] = (b + j + 1 < nb) ? BLK : n - ((b + j) << BLOCK_LOG);
            for (k = 0; k < V2_LANES; k++) st[j][k] = V2_L;
        }
        if (pair) {
#if MR_HAVE_X86
            const uint32_t *ents[2] = {ent, ent + BLK};
            uint64_t *sts[2] = {st[0], st[1]};
            for (j = 0; j < 2; j++) {
                v2_tables(ftab + (b + j) * 256, es, sym_tab[j]);
                e[j] = p[j] = pairbuf + (j + 1) * V2_REGION;
                v2_lookup_avx512(src + ((b + j) << BLOCK_LOG), BLK, sym_tab[j], ent + j * BLK);
            }
            v2_encode_avx512(ents, BLK / V2_LANES, sts, p, 2);
#endif
        } else {
            const uint8_t *sb = src + (b << BLOCK_LOG);
            v2_tables(ftab + b * 256, es, sym_tab[0]);
            e[0] = p[0] = dst + cap;
            /* the stream grows down from the end of dst; <= 1 word per symbol, 2 spare bytes;
             * it must stay clear of the block's table and header written before it moves */
            if (off + 32 + 512 + 4 * V2_LANES + 4 + 2 * len[0] + 32 > cap) {
                free(ftab); free(ent); free(pairbuf); return -1;
            }
            i = len[0] & ~(size_t)(V2_LANES - 1);
            v2_enc_scalar(sb, len[0], i, st[0], &p[0], es);
#if MR_HAVE_X86
            if (avx512) {
                const uint32_t *ents[1] = {ent};
                uint64_t *sts[1] = {st[0]};
                v2_lookup_avx512(sb, i, sym_tab[0], ent);
                v2_encode_avx512(ents, i / V2_LANES, sts, p, 1);
                i = 0;
            } else if (avx2) {
                for (k = 0; k < i; k++) ent[k] = sym_tab[0][sb[k]];
                v2_encode_avx2(ent, i / V2_LANES, st[0], &p[0], clut);
                i = 0;
            }
#endif
            v2_enc_scalar(sb, i, 0, st[0], &p[0], es); /* whole rounds, lanes 31..0 */
        }
        for (j = 0; j < g; j++) { /* table, header, stream of each block, in order */
            v2_put_table(ftab + (b + j) * 256, dst, &off);
            hdr[j] = dst + off;
            off += 4 * V2_LANES + 4;
            slen = (size_t)(e[j] - p[j]);
            for (k = 0; k < V2_LANES; k++) put_le32(hdr[j] + 4 * k, (uint32_t)st[j][k]);
            put_le32(hdr[j] + 4 * V2_LANES, (uint32_t)slen);
            /* cannot happen (bound): the front would run into the stream still to move */
            if (off + slen > cap || (!pair && p[j] - 16 < dst + off + slen)) {
                free(ftab); free(ent); free(pairbuf); return -1;
            }
            memmove(dst + off, p[j], slen);
            off += slen;
            if (off >= limit) { free(ftab); free(ent); free(pairbuf); return 0; }
        }
        b += (size_t)g;
    }
    free(ftab);
    free(ent);
    free(pairbuf);
    return (int64_t)off;
}

#if MR_HAVE_X86
/* AVX2 rounds of 32 symbols; returns the symbols decoded (a multiple of 32).  Needs a full
 * 64 bytes of stream left at the start of each round: a round reads <= 32 words, each of the
 * four refills loads 16 bytes from the current position. */
__attribute__((target("avx2"))) static size_t v2_rounds_avx2(
    const uint32_t *dt, uint32_t *st, const uint8_t **pp, const uint8_t *pe, uint8_t *out,
    size_t blen, const uint32_t *lut) {
    const uint8_t *p = *pp;
    size_t i = 0;
    const __m256i m12 = _mm256_set1_epi32(M - 1), mfff = _mm256_set1_epi32(0xFFF);
    const __m256i one = _mm256_set1_epi32(1), mff = _mm256_set1_epi32(0xFF);
    const __m256i zero = _mm256_setzero_si256(), perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i x[4];
    int v;
    for (v = 0; v < 4; v++) x[v] = _mm256_loadu_si256((const __m256i *)(const void *)(st + 8 * v));
    while (i + V2_LANES <= blen && pe - p >= 64) {
        __m256i sy[4], a, c;
        for (v = 0; v < 4; v++) {
            __m256i e = _mm256_i32gather_epi32((const int *)dt, _mm256_and_si256(x[v], m12), 4);
            __m256i f = _mm256_add_epi32(_mm256_srli_epi32(e, 20), one);
            __m256i bias = _mm256_and_si256(_mm256_srli_epi32(e, 8), mfff);
            x[v] = _mm256_add_epi32(_mm256_mullo_epi32(f, _mm256_srli_epi32(x[v], SCALE)), bias);
            sy[v] = _mm256_and_si256(e, mff);
        }
        a = _mm256_packus_epi32(sy[0], sy[1]);
        c = _mm256_packus_epi32(sy[2], sy[3]);
        a = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(a, c), perm);
        _mm256_storeu_si256((__m256i *)(void *)(out + i), a);
        for (v = 0; v < 4; v++) {
            __m256i need = _mm256_cmpeq_epi32(_mm256_srli_epi32(x[v], 16), zero);
            unsigned bits = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(need));
            __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)p));
            w = _mm256_permutevar8x32_epi32(
                w, _mm256_loadu_si256((const __m256i *)(const void *)(lut + 8 * bits)));
            x[v] = _mm256_blendv_epi8(x[v], _mm256_or_si256(_mm256_slli_epi32(x[v], 16), w), need);
            p += 2 * (size_t)__builtin_popcount(bits);
        }
        i += V2_LANES;
    }
    for (v = 0; v < 4; v++) _mm256_storeu_si256((__m256i *)(void *)(st + 8 * v), x[v]);
    *pp = p;
    return i;
}
#endif

int mr2_decode(const uint8_t *src, size_t len, uint8_t *dst, size_t n) {
    size_t nb, b, off = HDR;
    uint32_t lut[256 * 8];
#if MR_HAVE_X86
    int avx2 = mr_use_avx2();
#endif
    if (len < HDR || src[0] != 2 || src[1] != SCALE || src[2] != BLOCK_LOG || src[3] != V2_LANES)
        return -1;
    if (get_le32(src + 4) != n || n == 0) return -2;
    nb = nblocks(n);
#if MR_HAVE_X86
    if (avx2) {
        unsigned m, j;
        for (m = 0; m < 256; m++) {
            unsigned c = 0;
            for (j = 0; j < 8; j++) { lut[8 * m + j] = c; if (m & (1u << j)) c++; }
        }
    }
#else
    (void)lut;
#endif
    for (b = 0; b < nb; b++) {
        size_t blen = (b + 1 < nb) ? ((size_t)1 << BLOCK_LOG) : n - (b << BLOCK_LOG);
        uint8_t *out = dst + (b << BLOCK_LOG);
        uint32_t freq[256], start[256], sum = 0, st[V2_LANES];
        uint32_t dt[M]; /* per slot: sym | (slot - start) << 8 | (freq - 1) << 20 */
        const uint8_t *p, *pe, *fp;
        size_t i, k, slen;
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
        if (off + 4 * V2_LANES + 4 > len) return -3;
        for (k = 0; k < V2_LANES; k++) {
            st[k] = get_le32(src + off + 4 * k);
            if (st[k] < V2_L) return -5;
        }
        slen = get_le32(src + off + 4 * V2_LANES);
        off += 4 * V2_LANES + 4;
        if (slen > len - off || (slen & 1)) return -3;
        p = src + off;
        off += slen;
        pe = src + off;
        i = 0;
#if MR_HAVE_X86
        if (avx2) i = v2_rounds_avx2(dt, st, &p, pe, out, blen, lut);
#endif
        for (; i < blen; i++) {
            uint32_t x = st[i & (V2_LANES - 1)], e = dt[x & (M - 1)];
            x = ((e >> 20) + 1) * (x >> SCALE) + ((e >> 8) & 0xFFF);
            out[i] = (uint8_t)e;
            if (x < V2_L) {
                if (pe - p < 2) return -6;
                x = (x << 16) | load_le16(p);
                p += 2;
            }
            st[i & (V2_LANES - 1)] = x;
        }
        if (p != pe) return -7;
        for (k = 0; k < V2_LANES; k++)
            if (st[k] != V2_L) return -7;
    }
    if (off != len) return -9;
    return 0;
}
