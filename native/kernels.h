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

/* Non-finite values (the save's NaN/Inf guard), per float format: an element is a candidate
 * when (bits & mask) == want; a candidate is an Inf when its format has one and its bits
 * without the sign equal mask (exponent all ones, mantissa zero), else a NaN.  Which dtype
 * has which format: mithril_async.codec.kernels_ref.NONFINITE_FORMATS. */
#define MK_NF_NONE 0   /* nothing counted (integers, formats without NaN or Inf) */
#define MK_NF_FP16 1
#define MK_NF_BF16 2
#define MK_NF_FP32 3
#define MK_NF_FP64 4
#define MK_NF_E5M2 5   /* float8_e5m2: IEEE-like, exponent bits 0x7c */
#define MK_NF_E4M3 6   /* float8_e4m3 (ml_dtypes): IEEE-like, exponent bits 0x78 */
#define MK_NF_E3M4 7   /* float8_e3m4 (ml_dtypes): IEEE-like, exponent bits 0x70 */
#define MK_NF_E4M3FN 8 /* float8_e4m3fn: no Inf; NaN = S1111111 */
#define MK_NF_FNUZ 9   /* float8_e4m3fnuz, e5m2fnuz, e4m3b11fnuz: no Inf; NaN = 0x80 only */
#define MK_NF_E8M0 10  /* float8_e8m0fnu: no sign, no Inf; NaN = 0xff */
#define MK_NF_FORMATS 11

/* The element width of format nf (0 for MK_NF_NONE), -1 for a code that is none. */
int mk_nf_width(int nf);
/* counts[0] += the NaNs, counts[1] += the Infs among the len / width whole elements of
 * format nf at src (a partial element at the end is not looked at).  0, or -1 for bad nf. */
int mk_count_nonfinite(const uint8_t *src, size_t len, int nf, uint64_t *counts);
/* The encoder's transforms, counting into counts (as mk_count_nonfinite) the non-finite
 * elements of src, its own values, never their XOR with base, in the same pass over it:
 * mk_group_count is mk_group (kind 0) or mk_exp_group (an exponent kind of that width);
 * mk_copy_count is the identity transform (dst = src, or src ^ base when base is given).
 * nf MK_NF_NONE counts nothing; a format whose width is not the transform's is refused (-1). */
int mk_group_count(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int width,
                   int kind, int nf, uint64_t *counts);
int mk_copy_count(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int nf,
                  uint64_t *counts);

/* Busy-waits ns nanoseconds; exported only so tests can prove the GIL is released. */
void mk_spin_ns(uint64_t ns);

#endif
