/* Order-0 rANS coder for byte planes (RANS plane format v1); see rans.c. */
#ifndef MITHRIL_RANS_H
#define MITHRIL_RANS_H
#include <stddef.h>
#include <stdint.h>

void mr_histogram(const uint8_t *src, size_t n, uint32_t *hist);
/* order-0 entropy (bits/byte) of an evenly strided sample of at most ~max_sample bytes */
double mr_sample_entropy(const uint8_t *src, size_t n, size_t max_sample);
size_t mr_encode_bound(size_t n);
/* >0: encoded size; 0: would not get under limit (store raw); <0: error. */
int64_t mr_encode(const uint8_t *src, size_t n, uint8_t *dst, size_t cap, size_t limit);
/* 0 on success (exactly n bytes written); <0 when src is not a valid n-symbol RANS plane. */
int mr_decode(const uint8_t *src, size_t len, uint8_t *dst, size_t n);
/* RANS plane format v2: 32 interleaved 32-bit states, one 16-bit word stream (AVX2 decoder) */
size_t mr2_encode_bound(size_t n);
/* the dst capacity mr2_encode needs when it may give up at limit bytes (<= the bound) */
size_t mr2_encode_cap(size_t n, size_t limit);
int64_t mr2_encode(const uint8_t *src, size_t n, uint8_t *dst, size_t cap, size_t limit);
int mr2_decode(const uint8_t *src, size_t len, uint8_t *dst, size_t n);
/* SIMD level: 0 scalar, 1 AVX2, 2 AVX-512 (the v2 encoder; decoders use AVX2 there);
 * <0 or above what the CPU has: the best. */
int mr_set_level(int level);
#endif
