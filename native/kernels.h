/*
 * mithril_async native byte-transform kernels.
 *
 * Every kernel writes into a caller-provided buffer (no allocation, no copy of
 * the input) and handles any length: the len % width tail bytes are copied
 * (XORed with the base when one is given) verbatim to the end of the output.
 *
 * Layout of a grouped buffer of len bytes and element width w, n = len / w:
 *   out[k*n + i] = elem_i.byte_k   for k in [0, w), i in [0, n)
 *   out[w*n ..]  = tail bytes      (len % w of them)
 *
 * "base" arguments may be NULL; when given they are XORed in the ORIGINAL
 * (interleaved) element layout, so group(a, base) == group(a ^ base) and
 * ungroup(g, base) == ungroup(g) ^ base.
 *
 * Exponent kinds (ZipNN-style sign/exponent rearrangement):
 *   MK_KIND_BF16: planes [exponent(8 bits), sign|mantissa(7 bits)]
 *   MK_KIND_FP32: planes [exponent, sign|top-7-mantissa, mantissa byte 1, mantissa byte 0]
 *
 * SIMD level (0 scalar, 1 SSE2, 2 AVX2) is detected at run time; mk_set_level may
 * force a lower level (used by tests to check every path against the oracle).
 */
#ifndef MITHRIL_KERNELS_H
#define MITHRIL_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#define MK_LEVEL_SCALAR 0
#define MK_LEVEL_SSE2 1
#define MK_LEVEL_AVX2 2

/* group/ungroup accept widths 1..MK_MAX_WIDTH; 2, 4 and 8 have SIMD paths */
#define MK_MAX_WIDTH 16

#define MK_KIND_BF16 1
#define MK_KIND_FP32 2

int mk_detect_level(void);
int mk_get_level(void);
int mk_set_level(int level);

void mk_xor(const uint8_t *a, const uint8_t *b, uint8_t *dst, size_t len);
/* dst = src (no overlap) with non-temporal stores where the CPU has them */
void mk_copy_stream(const uint8_t *src, uint8_t *dst, size_t len);
/* n copies dst[i] = src[i] (len[i] bytes each, no overlaps); >= stream_min: streaming */
void mk_copy_batch(const uintptr_t *src, const uintptr_t *dst, const size_t *len, size_t n,
                   size_t stream_min);
int mk_group(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int width);
int mk_ungroup(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int width);
int mk_exp_group(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int kind);
int mk_exp_ungroup(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int kind);
/* The inverse from planes that need not lie back to back (a chunk's stored planes, some
 * read where they lie, some decoded elsewhere): plane k at planes[k] (len / width bytes
 * each), the len % width tail bytes at tail; kind 0 (plain grouping) or an exponent kind
 * (then width is its width).  Same result as mk_ungroup / mk_exp_ungroup. */
int mk_ungroup_planes(const uintptr_t *planes, const uint8_t *tail, const uint8_t *base,
                      uint8_t *dst, size_t len, int width, int kind);

/* Busy-waits ns nanoseconds; exported only so tests can prove the GIL is released. */
void mk_spin_ns(uint64_t ns);

#endif
