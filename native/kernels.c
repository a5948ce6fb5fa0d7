/*
 * mithril_async native byte-transform kernels: byte grouping, XOR deltas and
 * ZipNN-style exponent planes.  See kernels.h for the layouts.
 *
 * Structure: a portable scalar path, then the same SIMD algorithm compiled
 * twice (SSE2 on 16-byte vectors, AVX2 on 32-byte vectors) by including this
 * file into itself with different vector macros (MK_SIMD_PASS).  The AVX2
 * code loads/stores each 256-bit register as two 128-bit halves that sit half
 * a block apart, so every in-lane unpack/pack produces contiguous output and
 * no cross-lane permutes are needed.  AVX2 functions carry
 * __attribute__((target("avx2"))), so the file builds with plain -O3 and the
 * path is chosen at run time with __builtin_cpu_supports.
 */
#ifndef MK_SIMD_PASS

#define _POSIX_C_SOURCE 199309L
#include "kernels.h"

#include <string.h>
#include <time.h>

#define MK_XF_NONE 0
#define MK_XF_BF16 MK_KIND_BF16
#define MK_XF_FP32 MK_KIND_FP32

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define MK_HAVE_X86 1
#include <immintrin.h>
#else
#define MK_HAVE_X86 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define MK_INLINE static inline __attribute__((always_inline))
#else
#define MK_INLINE static inline
#endif

/* ------------------------------------------------------------------ */
/* element transforms (little-endian element values)                  */
/* ------------------------------------------------------------------ */

/* bf16 S EEEEEEEE MMMMMMM -> byte0 = exponent, byte1 = S MMMMMMM */
MK_INLINE uint16_t bf16_fwd(uint16_t v) {
    return (uint16_t)(((v >> 7) & 0x00FFu) | (v & 0x8000u) | ((v << 8) & 0x7F00u));
}
MK_INLINE uint16_t bf16_inv(uint16_t t) {
    return (uint16_t)((t & 0x8000u) | ((t & 0x00FFu) << 7) | ((t >> 8) & 0x007Fu));
}
/* fp32 -> byte0 = exponent, byte1 = S + top 7 mantissa bits, byte2 = mantissa byte 1,
 * byte3 = mantissa byte 0 */
MK_INLINE uint32_t fp32_fwd(uint32_t v) {
    return ((v >> 23) & 0xFFu) | ((v >> 16) & 0x8000u) | ((v >> 8) & 0x7F00u) |
           ((v << 8) & 0xFF0000u) | (v << 24);
}
MK_INLINE uint32_t fp32_inv(uint32_t t) {
    return ((t << 16) & 0x80000000u) | ((t << 23) & 0x7F800000u) | ((t << 8) & 0x7F0000u) |
           ((t >> 8) & 0xFF00u) | (t >> 24);
}

/* ------------------------------------------------------------------ */
/* scalar path (also finishes the elements a SIMD loop leaves over)   */
/* ------------------------------------------------------------------ */

MK_INLINE void load_elem(uint8_t *e, const uint8_t *src, const uint8_t *base, size_t off, int w) {
    int k;
    for (k = 0; k < w; k++) e[k] = (uint8_t)(src[off + k] ^ (base ? base[off + k] : 0));
}

MK_INLINE void xf_fwd(uint8_t *e, int xf) {
    if (xf == MK_XF_BF16) {
        uint16_t t = bf16_fwd((uint16_t)(e[0] | (e[1] << 8)));
        e[0] = (uint8_t)t;
        e[1] = (uint8_t)(t >> 8);
    } else if (xf == MK_XF_FP32) {
        uint32_t v = (uint32_t)e[0] | ((uint32_t)e[1] << 8) | ((uint32_t)e[2] << 16) |
                     ((uint32_t)e[3] << 24);
        uint32_t t = fp32_fwd(v);
        e[0] = (uint8_t)t;
        e[1] = (uint8_t)(t >> 8);
        e[2] = (uint8_t)(t >> 16);
        e[3] = (uint8_t)(t >> 24);
    }
}

MK_INLINE void xf_inv(uint8_t *e, int xf) {
    if (xf == MK_XF_BF16) {
        uint16_t v = bf16_inv((uint16_t)(e[0] | (e[1] << 8)));
        e[0] = (uint8_t)v;
        e[1] = (uint8_t)(v >> 8);
    } else if (xf == MK_XF_FP32) {
        uint32_t t = (uint32_t)e[0] | ((uint32_t)e[1] << 8) | ((uint32_t)e[2] << 16) |
                     ((uint32_t)e[3] << 24);
        uint32_t v = fp32_inv(t);
        e[0] = (uint8_t)v;
        e[1] = (uint8_t)(v >> 8);
        e[2] = (uint8_t)(v >> 16);
        e[3] = (uint8_t)(v >> 24);
    }
}

/* ------------------------------------------------------------------ */
/* non-finite elements (see kernels.h: MK_NF_*)                       */
/* ------------------------------------------------------------------ */

typedef struct {
    int width;
    int has_inf;
    uint64_t mask, want; /* a candidate: (bits & mask) == want */
    uint64_t mag;        /* every bit but the sign */
} nf_fmt;

static const nf_fmt NF_FORMATS[MK_NF_FORMATS] = {
    [MK_NF_NONE] = {0, 0, 0, 0, 0},
    [MK_NF_FP16] = {2, 1, 0x7c00u, 0x7c00u, 0x7fffu},
    [MK_NF_BF16] = {2, 1, 0x7f80u, 0x7f80u, 0x7fffu},
    [MK_NF_FP32] = {4, 1, 0x7f800000u, 0x7f800000u, 0x7fffffffu},
    [MK_NF_FP64] = {8, 1, 0x7ff0000000000000u, 0x7ff0000000000000u, 0x7fffffffffffffffu},
    [MK_NF_E5M2] = {1, 1, 0x7cu, 0x7cu, 0x7fu},
    [MK_NF_E4M3] = {1, 1, 0x78u, 0x78u, 0x7fu},
    [MK_NF_E3M4] = {1, 1, 0x70u, 0x70u, 0x7fu},
    [MK_NF_E4M3FN] = {1, 0, 0x7fu, 0x7fu, 0x7fu},
    [MK_NF_FNUZ] = {1, 0, 0xffu, 0x80u, 0xffu},
    [MK_NF_E8M0] = {1, 0, 0xffu, 0xffu, 0xffu},
};

/* the format of code nf; NULL for MK_NF_NONE and for codes that are none */
static const nf_fmt *nf_format(int nf) {
    return nf > MK_NF_NONE && nf < MK_NF_FORMATS ? &NF_FORMATS[nf] : NULL;
}

int mk_nf_width(int nf) {
    return nf == MK_NF_NONE ? 0 : nf_format(nf) ? nf_format(nf)->width : -1;
}

MK_INLINE void nf_elem(const uint8_t *p, int w, const nf_fmt *f, uint64_t *c) {
    uint64_t v = 0;
    memcpy(&v, p, (size_t)w); /* little-endian element bits */
    if ((v & f->mask) == f->want) {
        if (f->has_inf && (v & f->mag) == f->mask) c[1]++;
        else c[0]++;
    }
}

MK_INLINE void nf_scan_w(const uint8_t *p, size_t n, int w, const nf_fmt *f, uint64_t *c) {
    size_t i;
    for (i = 0; i < n; i++) nf_elem(p + i * (size_t)w, w, f, c);
}

/* The n elements at p one by one: a SIMD loop's block that holds a candidate, or the
 * elements no SIMD loop covered. */
static void nf_scan(const uint8_t *p, size_t n, const nf_fmt *f, uint64_t *c) {
    switch (f->width) {
        case 1: nf_scan_w(p, n, 1, f, c); break;
        case 2: nf_scan_w(p, n, 2, f, c); break;
        case 4: nf_scan_w(p, n, 4, f, c); break;
        default: nf_scan_w(p, n, 8, f, c); break;
    }
}

/* x repeated over 64 bits as w-byte lanes */
static uint64_t nf_rep(uint64_t x, int w) {
    uint64_t out = x;
    int k;
    for (k = w; k < 8; k += w) out |= x << (8 * k);
    return out;
}

/* The 64-bit lanes the SIMD loops compare with: 8-byte elements are compared as 32-bit
 * halves, and the low half's want is all ones where its mask is zero, so only the high half
 * (sign and exponent) can match. */
static void nf_lanes(const nf_fmt *f, uint64_t *mask, uint64_t *want) {
    *mask = nf_rep(f->mask, f->width);
    *want = nf_rep(f->want, f->width) | (f->width == 8 ? 0xffffffffu : 0);
}

/* elements [i0, n) of a grouping with plane stride n (f: also count src's non-finite ones) */
MK_INLINE void group_range_w(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t n,
                             size_t i0, int w, int xf, const nf_fmt *f, uint64_t *c) {
    size_t i;
    int k;
    for (i = i0; i < n; i++) {
        uint8_t e[8];
        if (f) nf_elem(src + i * (size_t)w, w, f, c);
        load_elem(e, src, base, i * (size_t)w, w);
        xf_fwd(e, xf);
        for (k = 0; k < w; k++) dst[(size_t)k * n + i] = e[k];
    }
}

MK_INLINE void ungroup_range_w(const uint8_t *const *pl, const uint8_t *base, uint8_t *dst,
                               size_t i0, size_t n, int w, int xf) {
    size_t i;
    int k;
    for (i = i0; i < n; i++) {
        uint8_t e[8];
        const size_t off = i * (size_t)w;
        for (k = 0; k < w; k++) e[k] = pl[k][i];
        xf_inv(e, xf);
        for (k = 0; k < w; k++) dst[off + k] = (uint8_t)(e[k] ^ (base ? base[off + k] : 0));
    }
}

/* constant-width instantiations so the compiler unrolls the byte loops */
static void group_range(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t n,
                        size_t i0, int w, int xf, const nf_fmt *f, uint64_t *c) {
    switch (w) {
        case 2:
            if (xf == MK_XF_BF16) group_range_w(src, base, dst, n, i0, 2, MK_XF_BF16, f, c);
            else group_range_w(src, base, dst, n, i0, 2, MK_XF_NONE, f, c);
            break;
        case 4:
            if (xf == MK_XF_FP32) group_range_w(src, base, dst, n, i0, 4, MK_XF_FP32, f, c);
            else group_range_w(src, base, dst, n, i0, 4, MK_XF_NONE, f, c);
            break;
        default: group_range_w(src, base, dst, n, i0, 8, MK_XF_NONE, f, c); break;
    }
}

static void ungroup_range(const uint8_t *const *pl, const uint8_t *base, uint8_t *dst,
                          size_t n, size_t i0, int w, int xf) {
    switch (w) {
        case 2:
            if (xf == MK_XF_BF16) ungroup_range_w(pl, base, dst, i0, n, 2, MK_XF_BF16);
            else ungroup_range_w(pl, base, dst, i0, n, 2, MK_XF_NONE);
            break;
        case 4:
            if (xf == MK_XF_FP32) ungroup_range_w(pl, base, dst, i0, n, 4, MK_XF_FP32);
            else ungroup_range_w(pl, base, dst, i0, n, 4, MK_XF_NONE);
            break;
        default: ungroup_range_w(pl, base, dst, i0, n, 8, MK_XF_NONE); break;
    }
}

static void xor_scalar(const uint8_t *a, const uint8_t *b, uint8_t *dst, size_t len) {
    size_t i;
    for (i = 0; i < len; i++) dst[i] = (uint8_t)(a[i] ^ b[i]);
}

static void copy_tail(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len) {
    if (base) xor_scalar(src, base, dst, len);
    else if (len) memmove(dst, src, len);
}

/* ------------------------------------------------------------------ */
/* SIMD passes                                                         */
/* ------------------------------------------------------------------ */
#if MK_HAVE_X86

/* SSE2: baseline on x86-64, 16 elements per block */
#define MK_SIMD_PASS 1
#define MK_TARGET
#define FN(name) name##_sse2
#define V __m128i
#define NLANES 1
#define LOADV(p) _mm_loadu_si128((const __m128i *)(const void *)(p))
#define STOREV(p, v) _mm_storeu_si128((__m128i *)(void *)(p), (v))
#define STREAMV(p, v) _mm_stream_si128((__m128i *)(void *)(p), (v))
#define LOADSPLIT(p, half) LOADV(p)
#define STORESPLIT(p, v, half) STOREV(p, v)
#define VAND _mm_and_si128
#define VOR _mm_or_si128
#define VXOR _mm_xor_si128
#define ADD8 _mm_add_epi8
#define SET8 _mm_set1_epi8
#define SET16 _mm_set1_epi16
#define SRLI16 _mm_srli_epi16
#define SLLI16 _mm_slli_epi16
#define PACKUS16 _mm_packus_epi16
#define UNLO8 _mm_unpacklo_epi8
#define UNHI8 _mm_unpackhi_epi8
#define UNLO16 _mm_unpacklo_epi16
#define UNHI16 _mm_unpackhi_epi16
#define UNLO32 _mm_unpacklo_epi32
#define UNHI32 _mm_unpackhi_epi32
#define CMPEQ8 _mm_cmpeq_epi8
#define CMPEQ16 _mm_cmpeq_epi16
#define CMPEQ32 _mm_cmpeq_epi32
#define MOVEMASK _mm_movemask_epi8
#define SET64(x) _mm_set1_epi64x((long long)(x))
#include "kernels.c"
#undef MK_SIMD_PASS
#undef MK_TARGET
#undef FN
#undef V
#undef NLANES
#undef LOADV
#undef STOREV
#undef STREAMV
#undef LOADSPLIT
#undef STORESPLIT
#undef VAND
#undef VOR
#undef VXOR
#undef ADD8
#undef SET8
#undef SET16
#undef SRLI16
#undef SLLI16
#undef PACKUS16
#undef UNLO8
#undef UNHI8
#undef UNLO16
#undef UNHI16
#undef UNLO32
#undef UNHI32
#undef CMPEQ8
#undef CMPEQ16
#undef CMPEQ32
#undef MOVEMASK
#undef SET64

/* AVX2: 32 elements per block; each register = two 128-bit halves half a block apart */
#define MK_SIMD_PASS 2
#define MK_TARGET __attribute__((target("avx2")))
#define FN(name) name##_avx2
#define V __m256i
#define NLANES 2
#define LOADV(p) _mm256_loadu_si256((const __m256i *)(const void *)(p))
#define STOREV(p, v) _mm256_storeu_si256((__m256i *)(void *)(p), (v))
#define STREAMV(p, v) _mm256_stream_si256((__m256i *)(void *)(p), (v))
#define LOADSPLIT(p, half)                                                                   \
    _mm256_inserti128_si256(                                                                 \
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)(p))),         \
        _mm_loadu_si128((const __m128i *)(const void *)((p) + (half))), 1)
#define STORESPLIT(p, v, half)                                                               \
    do {                                                                                     \
        _mm_storeu_si128((__m128i *)(void *)(p), _mm256_castsi256_si128(v));                 \
        _mm_storeu_si128((__m128i *)(void *)((p) + (half)), _mm256_extracti128_si256(v, 1)); \
    } while (0)
#define VAND _mm256_and_si256
#define VOR _mm256_or_si256
#define VXOR _mm256_xor_si256
#define ADD8 _mm256_add_epi8
#define SET8 _mm256_set1_epi8
#define SET16 _mm256_set1_epi16
#define SRLI16 _mm256_srli_epi16
#define SLLI16 _mm256_slli_epi16
#define PACKUS16 _mm256_packus_epi16
#define UNLO8 _mm256_unpacklo_epi8
#define UNHI8 _mm256_unpackhi_epi8
#define UNLO16 _mm256_unpacklo_epi16
#define UNHI16 _mm256_unpackhi_epi16
#define UNLO32 _mm256_unpacklo_epi32
#define UNHI32 _mm256_unpackhi_epi32
#define CMPEQ8 _mm256_cmpeq_epi8
#define CMPEQ16 _mm256_cmpeq_epi16
#define CMPEQ32 _mm256_cmpeq_epi32
#define MOVEMASK _mm256_movemask_epi8
#define SET64(x) _mm256_set1_epi64x((long long)(x))
#include "kernels.c"
#undef MK_SIMD_PASS

#endif /* MK_HAVE_X86 */

/* ------------------------------------------------------------------ */
/* dispatch                                                            */
/* ------------------------------------------------------------------ */

static int g_detected = -1;
static int g_level = -1;

int mk_detect_level(void) {
    if (g_detected < 0) {
        int lvl = MK_LEVEL_SCALAR;
#if MK_HAVE_X86
        __builtin_cpu_init();
        lvl = MK_LEVEL_SSE2; /* baseline on x86-64 */
        if (__builtin_cpu_supports("avx2")) lvl = MK_LEVEL_AVX2;
#endif
        g_detected = lvl;
    }
    return g_detected;
}

int mk_get_level(void) {
    if (g_level < 0) g_level = mk_detect_level();
    return g_level;
}

int mk_set_level(int level) {
    int top = mk_detect_level();
    if (level < 0 || level > top) level = top;
    g_level = level;
    return g_level;
}

/* Streaming (non-temporal) copy for staging snapshots: the destination is written without
 * first being read into the cache (no read-for-ownership), which made 48 MiB-1 GiB copies
 * into warm buffers ~1.7x faster than memcpy on this machine.  The SIMD bodies are the
 * template's FN(copy_stream); the Stager calls this only for tensors of >= 1 MiB (smaller
 * destinations fit the cache and copy_ is as fast). */
void mk_copy_stream(const uint8_t *src, uint8_t *dst, size_t len) {
    size_t done = 0;
#if MK_HAVE_X86
    switch (mk_get_level()) {
        case MK_LEVEL_AVX2: done = copy_stream_avx2(src, dst, len); break;
        case MK_LEVEL_SSE2: done = copy_stream_sse2(src, dst, len); break;
        default: break;
    }
#endif
    if (len > done) memcpy(dst + done, src + done, len - done);
}

/* The Stager's whole snapshot in one call: dst[i] = src[i] for n (pointer, length) jobs, the
 * ones of >= stream_min bytes with mk_copy_stream, the rest with memcpy (small destinations fit
 * the cache).  One call instead of one per tensor: the per-call Python cost (views, checks,
 * dispatch: ~10-40 us a tensor) was half the stall of a 104-tensor, 42 MB state. */
void mk_copy_batch(const uintptr_t *src, const uintptr_t *dst, const size_t *len, size_t n,
                   size_t stream_min) {
    for (size_t i = 0; i < n; i++) {
        if (len[i] >= stream_min)
            mk_copy_stream((const uint8_t *)src[i], (uint8_t *)dst[i], len[i]);
        else if (len[i])
            memcpy((void *)dst[i], (const void *)src[i], len[i]);
    }
}

void mk_xor(const uint8_t *a, const uint8_t *b, uint8_t *dst, size_t len) {
    size_t done = 0;
#if MK_HAVE_X86
    switch (mk_get_level()) {
        case MK_LEVEL_AVX2: done = xor_avx2(a, b, dst, len); break;
        case MK_LEVEL_SSE2: done = xor_sse2(a, b, dst, len); break;
        default: break;
    }
#endif
    xor_scalar(a + done, b + done, dst + done, len - done);
}

/* Any other width 1..MK_MAX_WIDTH (odd dtypes, complex128): portable, not vectorised. */
static void group_generic(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t n,
                          size_t w) {
    size_t i, k;
    for (k = 0; k < w; k++)
        for (i = 0; i < n; i++) {
            const size_t e = i * w + k;
            dst[k * n + i] = (uint8_t)(src[e] ^ (base ? base[e] : 0));
        }
}

static void ungroup_generic(const uint8_t *const *pl, const uint8_t *base, uint8_t *dst,
                            size_t n, size_t w) {
    size_t i, k;
    for (k = 0; k < w; k++) {
        const uint8_t *p = pl[k];
        for (i = 0; i < n; i++) {
            const size_t e = i * w + k;
            dst[e] = (uint8_t)(p[i] ^ (base ? base[e] : 0));
        }
    }
}

/* f (NULL: none): also count the non-finite elements of src into c (f's width is w) */
static int group_any(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int w,
                     int xf, const nf_fmt *f, uint64_t *c) {
    size_t n, done = 0;
    if (w < 1 || w > MK_MAX_WIDTH || (f && f->width != w)) return -1;
    n = len / (size_t)w;
    if (w != 2 && w != 4 && w != 8) {
        if (f) nf_scan(src, n, f, c); /* width 1 (the codec groups no float by 1) */
        group_generic(src, base, dst, n, (size_t)w);
    } else {
#if MK_HAVE_X86
        switch (mk_get_level()) {
            case MK_LEVEL_AVX2: done = group_simd_avx2(src, base, dst, n, w, xf, f, c); break;
            case MK_LEVEL_SSE2: done = group_simd_sse2(src, base, dst, n, w, xf, f, c); break;
            default: break;
        }
#endif
        group_range(src, base, dst, n, done, w, xf, f, c);
    }
    copy_tail(src + n * (size_t)w, base ? base + n * (size_t)w : NULL, dst + n * (size_t)w,
              len - n * (size_t)w);
    return 0;
}

/* The inverse, reading plane k from pl[k] (n = len / w bytes each) and the len % w tail
 * bytes from tail: the planes need not lie back to back (mk_ungroup_planes). */
static int ungroup_any(const uint8_t *const *pl, const uint8_t *tail, const uint8_t *base,
                       uint8_t *dst, size_t len, int w, int xf) {
    size_t n, done = 0;
    if (w < 1 || w > MK_MAX_WIDTH) return -1;
    n = len / (size_t)w;
    if (w != 2 && w != 4 && w != 8) {
        ungroup_generic(pl, base, dst, n, (size_t)w);
    } else {
#if MK_HAVE_X86
        switch (mk_get_level()) {
            case MK_LEVEL_AVX2: done = ungroup_simd_avx2(pl, base, dst, n, w, xf); break;
            case MK_LEVEL_SSE2: done = ungroup_simd_sse2(pl, base, dst, n, w, xf); break;
            default: break;
        }
#endif
        ungroup_range(pl, base, dst, n, done, w, xf);
    }
    copy_tail(tail, base ? base + n * (size_t)w : NULL, dst + n * (size_t)w,
              len - n * (size_t)w);
    return 0;
}

/* ungroup_any over one grouped buffer: plane k at src + k * n, the tail after the last */
static int ungroup_buf(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int w,
                       int xf) {
    const uint8_t *pl[MK_MAX_WIDTH];
    size_t n;
    int k;
    if (w < 1 || w > MK_MAX_WIDTH) return -1;
    n = len / (size_t)w;
    for (k = 0; k < w; k++) pl[k] = src + (size_t)k * n;
    return ungroup_any(pl, src + n * (size_t)w, base, dst, len, w, xf);
}

int mk_group(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int width) {
    return group_any(src, base, dst, len, width, MK_XF_NONE, NULL, NULL);
}

int mk_ungroup(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int width) {
    return ungroup_buf(src, base, dst, len, width, MK_XF_NONE);
}

static int kind_width(int kind) {
    return kind == MK_KIND_BF16 ? 2 : kind == MK_KIND_FP32 ? 4 : -1;
}

int mk_exp_group(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int kind) {
    return group_any(src, base, dst, len, kind_width(kind), kind, NULL, NULL);
}

int mk_exp_ungroup(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int kind) {
    return ungroup_buf(src, base, dst, len, kind_width(kind), kind);
}

int mk_ungroup_planes(const uintptr_t *planes, const uint8_t *tail, const uint8_t *base,
                      uint8_t *dst, size_t len, int width, int kind) {
    const uint8_t *pl[MK_MAX_WIDTH];
    int k;
    if (kind != 0 && kind_width(kind) != width) return -1;
    if (width < 1 || width > MK_MAX_WIDTH) return -1;
    for (k = 0; k < width; k++) pl[k] = (const uint8_t *)planes[k];
    return ungroup_any(pl, tail, base, dst, len, width, kind);
}

int mk_group_count(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int width,
                   int kind, int nf, uint64_t *counts) {
    const nf_fmt *f = nf_format(nf);
    if ((nf != MK_NF_NONE && !f) || (kind != 0 && kind_width(kind) != width)) return -1;
    return group_any(src, base, dst, len, width, kind, f, counts);
}

/* Blocks of this many bytes are counted, then copied, so the copy reads them from L1 when
 * no SIMD loop did both at once (the scalar level, and what the SIMD loops leave over). */
#define MK_NF_BLOCK 4096

/* dst = src (or src ^ base; dst NULL: no copy), counting f's elements of src */
static void copy_count_any(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len,
                           const nf_fmt *f, uint64_t *c) {
    size_t done = 0, at, n;
#if MK_HAVE_X86
    switch (mk_get_level()) {
        case MK_LEVEL_AVX2: done = copy_count_avx2(src, base, dst, len, f, c); break;
        case MK_LEVEL_SSE2: done = copy_count_sse2(src, base, dst, len, f, c); break;
        default: break;
    }
#endif
    for (at = done; at < len; at += n) {
        n = len - at < MK_NF_BLOCK ? len - at : MK_NF_BLOCK;
        nf_scan(src + at, n / (size_t)f->width, f, c);
        if (dst) copy_tail(src + at, base ? base + at : NULL, dst + at, n);
    }
}

int mk_count_nonfinite(const uint8_t *src, size_t len, int nf, uint64_t *counts) {
    const nf_fmt *f = nf_format(nf);
    if (nf == MK_NF_NONE) return 0;
    if (!f) return -1;
    copy_count_any(src, NULL, NULL, len - len % (size_t)f->width, f, counts);
    return 0;
}

int mk_copy_count(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int nf,
                  uint64_t *counts) {
    const nf_fmt *f = nf_format(nf);
    size_t whole;
    if (nf != MK_NF_NONE && !f) return -1;
    if (!f) {
        if (base) mk_xor(src, base, dst, len);
        else if (len) memmove(dst, src, len);
        return 0;
    }
    whole = len - len % (size_t)f->width; /* a partial element is copied, not counted */
    copy_count_any(src, base, dst, whole, f, counts);
    copy_tail(src + whole, base ? base + whole : NULL, dst + whole, len - whole);
    return 0;
}

void mk_spin_ns(uint64_t ns) {
    struct timespec t0, t;
    uint64_t el = 0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (el < ns) {
        clock_gettime(CLOCK_MONOTONIC, &t);
        el = (uint64_t)(t.tv_sec - t0.tv_sec) * 1000000000u + (uint64_t)(t.tv_nsec - t0.tv_nsec);
    }
}

#else /* ========================= MK_SIMD_PASS body ========================= */

/* Elements per block: 16 per 128-bit lane. */
#define EPB (16 * NLANES)

/* Load vector j of a block of width w (lane 1 half a block = 16*w bytes later). */
#define LD(p, j, w) LOADSPLIT((p) + 16 * (j), 16 * (w))
#define ST(p, j, w, v) STORESPLIT((p) + 16 * (j), (v), 16 * (w))

/* Exponent rearrangement on byte planes (cheaper than on elements: 2 planes, ~6 ops).
 * lo = byte "E MMMMMMM", hi = byte "S EEEEEEE" of the same elements (bf16 bytes 0/1,
 * fp32 bytes 2/3).  exp = EEEEEEEE, sm = S MMMMMMM. */
#define EXP_FWD(lo, hi, exp, sm)                                                              \
    do {                                                                                      \
        exp = VOR(ADD8((hi), (hi)), VAND(SRLI16((lo), 7), SET8(0x01)));                       \
        sm = VOR(VAND((hi), SET8((char)0x80)), VAND((lo), SET8(0x7F)));                       \
    } while (0)
#define EXP_INV(exp, sm, lo, hi)                                                              \
    do {                                                                                      \
        hi = VOR(VAND((sm), SET8((char)0x80)), VAND(SRLI16((exp), 1), SET8(0x7F)));           \
        lo = VOR(VAND(SLLI16((exp), 7), SET8((char)0x80)), VAND((sm), SET8(0x7F)));           \
    } while (0)

/* split bytes of (a, b) into the even bytes and the odd bytes (per 128-bit lane) */
#define DEINT(a, b, ev, od)                                                     \
    do {                                                                        \
        const V m_ = SET16(0x00FF);                                             \
        ev = PACKUS16(VAND((a), m_), VAND((b), m_));                            \
        od = PACKUS16(SRLI16((a), 8), SRLI16((b), 8));                          \
    } while (0)

/* Non-finite candidates among the w-byte lanes of v (raw element bits): all ones where
 * (bits & m) == want (m, want: nf_lanes, as vectors). */
MK_TARGET MK_INLINE V FN(nf_hit)(V v, V m, V want, int w) {
    const V x = VAND(v, m);
    return w == 1 ? CMPEQ8(x, want) : w == 2 ? CMPEQ16(x, want) : CMPEQ32(x, want);
}

/* the vectors nf_hit compares with, for format f (zero vectors when f is NULL) */
MK_TARGET MK_INLINE void FN(nf_vecs)(const nf_fmt *f, V *m, V *want) {
    uint64_t mm = 0, ww = 0;
    if (f) nf_lanes(f, &mm, &ww);
    *m = SET64(mm);
    *want = SET64(ww);
}

/* A block of EPB elements at s whose raw vectors v[0..nv) hold a candidate is counted one
 * element at a time (rare: finite state never gets here). */
#define NF_BLOCK(chk, v, nv, w, s)                                                            \
    do {                                                                                      \
        if (chk) {                                                                            \
            V h_ = FN(nf_hit)((v)[0], nm, nw, (w));                                           \
            int j_;                                                                           \
            for (j_ = 1; j_ < (nv); j_++) h_ = VOR(h_, FN(nf_hit)((v)[j_], nm, nw, (w)));     \
            if (MOVEMASK(h_)) nf_scan((s), EPB, f, c);                                        \
        }                                                                                     \
    } while (0)

MK_TARGET MK_INLINE size_t FN(group2_i)(const uint8_t *src, const uint8_t *base, uint8_t *dst,
                                   size_t n, int xf, int chk, const nf_fmt *f, uint64_t *c) {
    size_t i;
    V nm, nw;
    FN(nf_vecs)(chk ? f : NULL, &nm, &nw);
    for (i = 0; i + EPB <= n; i += EPB) {
        const uint8_t *s = src + 2 * i;
        V v0 = LD(s, 0, 2), v1 = LD(s, 1, 2), e, o;
        {
            const V raw[2] = {v0, v1};
            NF_BLOCK(chk, raw, 2, 2, s);
        }
        if (base) {
            const uint8_t *b = base + 2 * i;
            v0 = VXOR(v0, LD(b, 0, 2));
            v1 = VXOR(v1, LD(b, 1, 2));
        }
#if MK_SIMD_PASS == 2
        {   /* per lane: qword 0 = even bytes, qword 1 = odd bytes */
            const V sh = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0,
                                          2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
            v0 = _mm256_shuffle_epi8(v0, sh);
            v1 = _mm256_shuffle_epi8(v1, sh);
            e = _mm256_unpacklo_epi64(v0, v1);
            o = _mm256_unpackhi_epi64(v0, v1);
        }
#else
        DEINT(v0, v1, e, o);
#endif
        if (xf == MK_XF_BF16) {
            V x, m;
            EXP_FWD(e, o, x, m);
            e = x;
            o = m;
        }
        STOREV(dst + i, e);
        STOREV(dst + n + i, o);
    }
    return i;
}

MK_TARGET MK_INLINE size_t FN(group4_i)(const uint8_t *src, const uint8_t *base, uint8_t *dst,
                                   size_t n, int xf, int chk, const nf_fmt *f, uint64_t *c) {
    size_t i;
    V nm, nw;
    FN(nf_vecs)(chk ? f : NULL, &nm, &nw);
    for (i = 0; i + EPB <= n; i += EPB) {
        const uint8_t *s = src + 4 * i;
        V v0 = LD(s, 0, 4), v1 = LD(s, 1, 4), v2 = LD(s, 2, 4), v3 = LD(s, 3, 4);
        V e01, o01, e23, o23, p0, p1, p2, p3;
        {
            const V raw[4] = {v0, v1, v2, v3};
            NF_BLOCK(chk, raw, 4, 4, s);
        }
        if (base) {
            const uint8_t *b = base + 4 * i;
            v0 = VXOR(v0, LD(b, 0, 4));
            v1 = VXOR(v1, LD(b, 1, 4));
            v2 = VXOR(v2, LD(b, 2, 4));
            v3 = VXOR(v3, LD(b, 3, 4));
        }
#if MK_SIMD_PASS == 2
        {   /* per lane: dword k = byte k of 4 elements; then 32/64-bit unpacks */
            const V sh = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0,
                                          4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
            v0 = _mm256_shuffle_epi8(v0, sh);
            v1 = _mm256_shuffle_epi8(v1, sh);
            v2 = _mm256_shuffle_epi8(v2, sh);
            v3 = _mm256_shuffle_epi8(v3, sh);
            e01 = UNLO32(v0, v1); /* bytes 0 | 1 of elements 0..7 */
            o01 = UNHI32(v0, v1); /* bytes 2 | 3 */
            e23 = UNLO32(v2, v3);
            o23 = UNHI32(v2, v3);
            p0 = _mm256_unpacklo_epi64(e01, e23);
            p1 = _mm256_unpackhi_epi64(e01, e23);
            p2 = _mm256_unpacklo_epi64(o01, o23);
            p3 = _mm256_unpackhi_epi64(o01, o23);
        }
#else
        DEINT(v0, v1, e01, o01); /* bytes 0,2 / 1,3 of elements 0..7 */
        DEINT(v2, v3, e23, o23);
        DEINT(e01, e23, p0, p2);
        DEINT(o01, o23, p1, p3);
#endif
        if (xf == MK_XF_FP32) { /* planes [exp, sm, byte1, byte0] */
            V x, m;
            EXP_FWD(p2, p3, x, m);
            p3 = p0;
            p2 = p1;
            p0 = x;
            p1 = m;
        }
        STOREV(dst + i, p0);
        STOREV(dst + n + i, p1);
        STOREV(dst + 2 * n + i, p2);
        STOREV(dst + 3 * n + i, p3);
    }
    return i;
}

MK_TARGET MK_INLINE void FN(group8_blk)(const uint8_t *src, const uint8_t *base, uint8_t *dst,
                                        size_t n, size_t i, int chk, V nm, V nw,
                                        const nf_fmt *f, uint64_t *c) {
    {
        const uint8_t *s = src + 8 * i;
        V v[8], e[4], o[4], ee0, eo0, oe0, oo0, ee1, eo1, oe1, oo1, p[8];
        int j;
        for (j = 0; j < 8; j++) v[j] = LD(s, j, 8);
        NF_BLOCK(chk, v, 8, 8, s);
        if (base) {
            const uint8_t *b = base + 8 * i;
            for (j = 0; j < 8; j++) v[j] = VXOR(v[j], LD(b, j, 8));
        }
#if MK_SIMD_PASS == 2
        {   /* per lane: word k = byte k of 2 elements; then 16/32/64-bit unpacks */
            const V sh = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15, 0,
                                          8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
            V lo[4], hi[4], c[4], d[4];
            for (j = 0; j < 8; j++) v[j] = _mm256_shuffle_epi8(v[j], sh);
            for (j = 0; j < 4; j++) {
                lo[j] = UNLO16(v[2 * j], v[2 * j + 1]); /* dword k = byte k, k<4, 4 elements */
                hi[j] = UNHI16(v[2 * j], v[2 * j + 1]); /* dword k-4 = byte k, k>=4 */
            }
            c[0] = UNLO32(lo[0], lo[1]); /* qwords: bytes 0 | 1 of elements 0..7 */
            c[1] = UNHI32(lo[0], lo[1]); /* bytes 2 | 3 */
            c[2] = UNLO32(hi[0], hi[1]); /* bytes 4 | 5 */
            c[3] = UNHI32(hi[0], hi[1]); /* bytes 6 | 7 */
            d[0] = UNLO32(lo[2], lo[3]); /* same for elements 8..15 */
            d[1] = UNHI32(lo[2], lo[3]);
            d[2] = UNLO32(hi[2], hi[3]);
            d[3] = UNHI32(hi[2], hi[3]);
            for (j = 0; j < 4; j++) {
                p[2 * j] = _mm256_unpacklo_epi64(c[j], d[j]);
                p[2 * j + 1] = _mm256_unpackhi_epi64(c[j], d[j]);
            }
            (void)e; (void)o; (void)ee0; (void)eo0; (void)oe0; (void)oo0;
            (void)ee1; (void)eo1; (void)oe1; (void)oo1;
        }
#else
        for (j = 0; j < 4; j++) DEINT(v[2 * j], v[2 * j + 1], e[j], o[j]);
        DEINT(e[0], e[1], ee0, eo0); /* bytes 0,4 / 2,6 of elements 0..7 */
        DEINT(e[2], e[3], ee1, eo1);
        DEINT(o[0], o[1], oe0, oo0); /* bytes 1,5 / 3,7 */
        DEINT(o[2], o[3], oe1, oo1);
        DEINT(ee0, ee1, p[0], p[4]);
        DEINT(eo0, eo1, p[2], p[6]);
        DEINT(oe0, oe1, p[1], p[5]);
        DEINT(oo0, oo1, p[3], p[7]);
#endif
        for (j = 0; j < 8; j++) STOREV(dst + (size_t)j * n + i, p[j]);
    }
}

/* With power-of-two chunk sizes the 8 plane pointers are 4 KiB-aliased and writing them
 * directly runs at half speed while the data is cache-resident, so full tiles are grouped
 * into a small stack buffer with a padded plane stride and then copied out one plane at a
 * time (an L1-resident copy).  Measured (noisily) on an AMD EPYC with AVX2: roughly 1.5-2x
 * faster for aliased 1-4 MiB buffers but 2-3x slower on a 64 MiB DRAM-bound one, hence the
 * size cap. */
#define MK_TILE 1024
#define MK_TILE_MAX_N ((size_t)1 << 20) /* elements: 8 MiB of input */
#define MK_TSTRIDE (MK_TILE + 96)
MK_TARGET MK_INLINE size_t FN(group8_i)(const uint8_t *src, const uint8_t *base, uint8_t *dst,
                                        size_t n, int chk, const nf_fmt *f, uint64_t *c) {
    size_t i = 0, t;
    int k;
    V nm, nw;
    FN(nf_vecs)(chk ? f : NULL, &nm, &nw);
    if (n >= 2 * MK_TILE && n <= MK_TILE_MAX_N && ((n & 4095) < 128 || (n & 4095) > 4096 - 128)) {
        uint8_t tmp[8 * MK_TSTRIDE];
        for (; i + MK_TILE <= n; i += MK_TILE) {
            const uint8_t *s = src + 8 * i, *b = base ? base + 8 * i : NULL;
            for (t = 0; t < MK_TILE; t += EPB)
                FN(group8_blk)(s, b, tmp, MK_TSTRIDE, t, chk, nm, nw, f, c);
            for (k = 0; k < 8; k++) {
                const uint8_t *from = tmp + (size_t)k * MK_TSTRIDE;
                uint8_t *to = dst + (size_t)k * n + i;
                for (t = 0; t < MK_TILE; t += 4 * sizeof(V)) {
                    V x0 = LOADV(from + t), x1 = LOADV(from + t + sizeof(V));
                    V x2 = LOADV(from + t + 2 * sizeof(V)), x3 = LOADV(from + t + 3 * sizeof(V));
                    STOREV(to + t, x0);
                    STOREV(to + t + sizeof(V), x1);
                    STOREV(to + t + 2 * sizeof(V), x2);
                    STOREV(to + t + 3 * sizeof(V), x3);
                }
            }
        }
    }
    for (; i + EPB <= n; i += EPB) FN(group8_blk)(src, base, dst, n, i, chk, nm, nw, f, c);
    return i;
}
#undef MK_TILE
#undef MK_TSTRIDE
#undef MK_TILE_MAX_N

MK_TARGET MK_INLINE size_t FN(ungroup2_i)(const uint8_t *const *pl, const uint8_t *base,
                                          uint8_t *dst, size_t n, int xf) {
    const uint8_t *s0 = pl[0], *s1 = pl[1];
    size_t i;
    for (i = 0; i + EPB <= n; i += EPB) {
        uint8_t *d = dst + 2 * i;
        V p0 = LOADV(s0 + i), p1 = LOADV(s1 + i), o0, o1;
        if (xf == MK_XF_BF16) {
            V x = p0, m = p1;
            EXP_INV(x, m, p0, p1);
        }
        o0 = UNLO8(p0, p1);
        o1 = UNHI8(p0, p1);
        if (base) {
            const uint8_t *b = base + 2 * i;
            o0 = VXOR(o0, LD(b, 0, 2));
            o1 = VXOR(o1, LD(b, 1, 2));
        }
        ST(d, 0, 2, o0);
        ST(d, 1, 2, o1);
    }
    return i;
}

MK_TARGET MK_INLINE size_t FN(ungroup4_i)(const uint8_t *const *pl, const uint8_t *base,
                                          uint8_t *dst, size_t n, int xf) {
    const uint8_t *s0 = pl[0], *s1 = pl[1], *s2 = pl[2], *s3 = pl[3];
    size_t i;
    for (i = 0; i + EPB <= n; i += EPB) {
        uint8_t *d = dst + 4 * i;
        V p0 = LOADV(s0 + i), p1 = LOADV(s1 + i);
        V p2 = LOADV(s2 + i), p3 = LOADV(s3 + i);
        V a, b, c, e, o[4];
        int j;
        if (xf == MK_XF_FP32) { /* planes [exp, sm, byte1, byte0] -> bytes 0..3 */
            V x = p0, m = p1;
            p0 = p3;
            p1 = p2;
            EXP_INV(x, m, p2, p3);
        }
        a = UNLO8(p0, p1);
        b = UNHI8(p0, p1);
        c = UNLO8(p2, p3);
        e = UNHI8(p2, p3);
        o[0] = UNLO16(a, c);
        o[1] = UNHI16(a, c);
        o[2] = UNLO16(b, e);
        o[3] = UNHI16(b, e);
        if (base)
            for (j = 0; j < 4; j++) o[j] = VXOR(o[j], LD(base + 4 * i, j, 4));
        for (j = 0; j < 4; j++) ST(d, j, 4, o[j]);
    }
    return i;
}

MK_TARGET MK_INLINE size_t FN(ungroup8_i)(const uint8_t *const *pl, const uint8_t *base,
                                          uint8_t *dst, size_t n) {
    const uint8_t *s[8];
    size_t i;
    int j;
    for (j = 0; j < 8; j++) s[j] = pl[j];
    for (i = 0; i + EPB <= n; i += EPB) {
        uint8_t *d = dst + 8 * i;
        V p[8], a[4], b[4], c[4], e[4], o[8];
        for (j = 0; j < 8; j++) p[j] = LOADV(s[j] + i);
        for (j = 0; j < 4; j++) {
            a[j] = UNLO8(p[2 * j], p[2 * j + 1]); /* elements 0..7, bytes 2j,2j+1 */
            b[j] = UNHI8(p[2 * j], p[2 * j + 1]); /* elements 8..15 */
        }
        c[0] = UNLO16(a[0], a[1]); /* elements 0..3, bytes 0..3 */
        c[1] = UNHI16(a[0], a[1]);
        c[2] = UNLO16(b[0], b[1]);
        c[3] = UNHI16(b[0], b[1]);
        e[0] = UNLO16(a[2], a[3]); /* elements 0..3, bytes 4..7 */
        e[1] = UNHI16(a[2], a[3]);
        e[2] = UNLO16(b[2], b[3]);
        e[3] = UNHI16(b[2], b[3]);
        for (j = 0; j < 4; j++) {
            o[2 * j] = UNLO32(c[j], e[j]);
            o[2 * j + 1] = UNHI32(c[j], e[j]);
        }
        if (base)
            for (j = 0; j < 8; j++) o[j] = VXOR(o[j], LD(base + 8 * i, j, 8));
        for (j = 0; j < 8; j++) ST(d, j, 8, o[j]);
    }
    return i;
}

/* Instantiate each width with constant (base?, transform?, counting?) so the inner loops
 * carry no branches and the compiler keeps everything in registers. */
#define BASE_AND_COUNT(call)                                                                  \
    (base ? (f ? call(base, 1, f) : call(base, 0, NULL))                                      \
          : (f ? call(NULL, 1, f) : call(NULL, 0, NULL)))
#define G2X(b, k, ff) FN(group2_i)(src, b, dst, n, MK_XF_BF16, k, ff, c)
#define G2N(b, k, ff) FN(group2_i)(src, b, dst, n, MK_XF_NONE, k, ff, c)
#define G4X(b, k, ff) FN(group4_i)(src, b, dst, n, MK_XF_FP32, k, ff, c)
#define G4N(b, k, ff) FN(group4_i)(src, b, dst, n, MK_XF_NONE, k, ff, c)
#define G8N(b, k, ff) FN(group8_i)(src, b, dst, n, k, ff, c)
MK_TARGET static size_t FN(group_simd)(const uint8_t *src, const uint8_t *base, uint8_t *dst,
                                       size_t n, int w, int xf, const nf_fmt *f, uint64_t *c) {
    switch (w) {
        case 2: return xf ? BASE_AND_COUNT(G2X) : BASE_AND_COUNT(G2N);
        case 4: return xf ? BASE_AND_COUNT(G4X) : BASE_AND_COUNT(G4N);
        default: return BASE_AND_COUNT(G8N);
    }
}
#undef G2X
#undef G2N
#undef G4X
#undef G4N
#undef G8N

MK_TARGET static size_t FN(ungroup_simd)(const uint8_t *const *pl, const uint8_t *base,
                                         uint8_t *dst, size_t n, int w, int xf) {
    switch (w) {
        case 2:
            if (base) return xf ? FN(ungroup2_i)(pl, base, dst, n, MK_XF_BF16)
                                : FN(ungroup2_i)(pl, base, dst, n, MK_XF_NONE);
            return xf ? FN(ungroup2_i)(pl, NULL, dst, n, MK_XF_BF16)
                      : FN(ungroup2_i)(pl, NULL, dst, n, MK_XF_NONE);
        case 4:
            if (base) return xf ? FN(ungroup4_i)(pl, base, dst, n, MK_XF_FP32)
                                : FN(ungroup4_i)(pl, base, dst, n, MK_XF_NONE);
            return xf ? FN(ungroup4_i)(pl, NULL, dst, n, MK_XF_FP32)
                      : FN(ungroup4_i)(pl, NULL, dst, n, MK_XF_NONE);
        default:
            return base ? FN(ungroup8_i)(pl, base, dst, n) : FN(ungroup8_i)(pl, NULL, dst, n);
    }
}

MK_TARGET static size_t FN(xor)(const uint8_t *a, const uint8_t *b, uint8_t *dst, size_t len) {
    const size_t vb = 16 * NLANES;
    size_t i = 0;
    for (; i + 4 * vb <= len; i += 4 * vb) {
        V x0 = VXOR(LOADV(a + i), LOADV(b + i));
        V x1 = VXOR(LOADV(a + i + vb), LOADV(b + i + vb));
        V x2 = VXOR(LOADV(a + i + 2 * vb), LOADV(b + i + 2 * vb));
        V x3 = VXOR(LOADV(a + i + 3 * vb), LOADV(b + i + 3 * vb));
        STOREV(dst + i, x0);
        STOREV(dst + i + vb, x1);
        STOREV(dst + i + 2 * vb, x2);
        STOREV(dst + i + 3 * vb, x3);
    }
    for (; i + vb <= len; i += vb) STOREV(dst + i, VXOR(LOADV(a + i), LOADV(b + i)));
    return i;
}

/* The identity transform with counting: blocks of 4 vectors of src checked for non-finite
 * candidates (w-byte elements: the blocks start at element boundaries), then copied
 * (mode 1), XORed with base (mode 2) or left (mode 0: counting only); returns the bytes
 * done (the caller does the rest). */
MK_TARGET MK_INLINE size_t FN(copy_count_i)(const uint8_t *src, const uint8_t *base,
                                            uint8_t *dst, size_t len, int w, int mode,
                                            const nf_fmt *f, uint64_t *c) {
    const size_t vb = 16 * NLANES, step = 4 * vb;
    size_t i;
    V nm, nw;
    FN(nf_vecs)(f, &nm, &nw);
    for (i = 0; i + step <= len; i += step) {
        V x[4];
        int j;
        for (j = 0; j < 4; j++) x[j] = LOADV(src + i + (size_t)j * vb);
        {
            V h = VOR(VOR(FN(nf_hit)(x[0], nm, nw, w), FN(nf_hit)(x[1], nm, nw, w)),
                      VOR(FN(nf_hit)(x[2], nm, nw, w), FN(nf_hit)(x[3], nm, nw, w)));
            if (MOVEMASK(h)) nf_scan(src + i, step / (size_t)w, f, c);
        }
        if (mode == 2)
            for (j = 0; j < 4; j++) x[j] = VXOR(x[j], LOADV(base + i + (size_t)j * vb));
        if (mode)
            for (j = 0; j < 4; j++) STOREV(dst + i + (size_t)j * vb, x[j]);
    }
    return i;
}

#define CC_MODES(w)                                                                           \
    (!dst ? FN(copy_count_i)(src, NULL, NULL, len, w, 0, f, c)                                \
          : base ? FN(copy_count_i)(src, base, dst, len, w, 2, f, c)                          \
                 : FN(copy_count_i)(src, NULL, dst, len, w, 1, f, c))
MK_TARGET static size_t FN(copy_count)(const uint8_t *src, const uint8_t *base, uint8_t *dst,
                                       size_t len, const nf_fmt *f, uint64_t *c) {
    switch (f->width) {
        case 1: return CC_MODES(1);
        case 2: return CC_MODES(2);
        case 4: return CC_MODES(4);
        default: return CC_MODES(8);
    }
}
#undef CC_MODES

/* Non-temporal copy: a plain copy up to the vector boundary of dst, then aligned streaming
 * stores of 4 vectors per step; returns the bytes done (the caller copies the tail). */
MK_TARGET static size_t FN(copy_stream)(const uint8_t *src, uint8_t *dst, size_t len) {
    const size_t vb = 16 * NLANES;
    size_t i = (vb - ((uintptr_t)dst & (vb - 1))) & (vb - 1);
    if (i > len) return 0;
    memcpy(dst, src, i);
    for (; i + 4 * vb <= len; i += 4 * vb) {
        V x0 = LOADV(src + i), x1 = LOADV(src + i + vb);
        V x2 = LOADV(src + i + 2 * vb), x3 = LOADV(src + i + 3 * vb);
        STREAMV(dst + i, x0);
        STREAMV(dst + i + vb, x1);
        STREAMV(dst + i + 2 * vb, x2);
        STREAMV(dst + i + 3 * vb, x3);
    }
    _mm_sfence();
    return i;
}

#undef BASE_AND_COUNT
#undef NF_BLOCK
#undef EPB
#undef LD
#undef ST
#undef DEINT
#undef EXP_FWD
#undef EXP_INV

#endif /* MK_SIMD_PASS */
