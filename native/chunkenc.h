/* One chunk's planes coded in one call, GIL released (mithril_async._rans; see chunkenc.c). */
#ifndef MITHRIL_CHUNKENC_H
#define MITHRIL_CHUNKENC_H
#include <stddef.h>
#include <stdint.h>

/* methods[i] of a plane left to the caller (its zstd try lives in python-zstandard) */
#define MC_PLANE_PYTHON 255

/* The coders of other extension modules, by address: XXH3_64bits (python-xxhash) and
 * zng_deflateInit2_ / zng_deflate / zng_deflateReset / zng_deflateEnd (python-zlib-ng, whose
 * version string zversion is).  0 when usable; <0: mc_encode_planes refuses to run. */
int mc_set_env(uintptr_t xxh3, uintptr_t zinit, uintptr_t zdeflate, uintptr_t zreset,
               uintptr_t zend, const char *zversion);
int mc_ready(void);
/* ZSTD_createCCtx / freeCCtx / CCtx_setParameter / compress2 / isError of the zstd release
 * python-zstandard uses: low-entropy planes then get their zstd try here, not in Python
 * (a zero address unbinds it: -1, and they go back to Python) */
int mc_set_zstd(uintptr_t create, uintptr_t free_, uintptr_t setp, uintptr_t compress2,
                uintptr_t iserr);
/* bytes of workspace (arena: rANS coder, zstd try) mc_encode_planes needs for these planes */
size_t mc_arena_cap(const uint64_t *sizes, int nplanes);
/* Codes the nplanes consecutive planes at `planes` (sizes[i] bytes each) as
 * entropy.encode_plane(mode="float") does, the stored planes back to back from dst, which
 * may be planes itself or lie before it (the planes are overwritten: no stored plane is longer
 * than its plane, so it compacts in place).  Per plane its method and stored length
 * (MC_PLANE_PYTHON: not coded, the plane itself kept in its place in the output).  hashes[0]:
 * XXH3-64 of the raw_size bytes at raw; hashes[1]: of the stored bytes (0 when a plane was
 * left over).  Returns the stored bytes written, or <0 on error. */
int64_t mc_encode_planes(const uint8_t *raw, size_t raw_size, uint8_t *planes,
                         const uint64_t *sizes, int nplanes, double raw_bits,
                         double huff_min_bits, double min_gain, int level, uint8_t *arena,
                         size_t cap, uint8_t *dst, uint8_t *methods, uint64_t *lens,
                         uint64_t *hashes);
/* Many chunks in one call (a batch of small ones): chunk c's raw bytes at raws[c], its
 * nplanes[c] planes next in `planes` (sizes flattened over chunks), its stored planes next
 * from the start of `planes`, compacted in place (stored[c] bytes); methods and lens flattened
 * like sizes, hashes[2c] and hashes[2c + 1] as mc_encode_planes's.  Returns the stored bytes
 * of all chunks, <0 on error. */
size_t mc_batch_cap(const uint64_t *sizes, const int32_t *nplanes, size_t nchunks);
int64_t mc_encode_batch(size_t nchunks, const uintptr_t *raws, const uint64_t *raw_sizes,
                        uint8_t *planes, const uint64_t *sizes, const int32_t *nplanes,
                        double raw_bits, double huff_min_bits, double min_gain, int level,
                        uint8_t *arena, size_t cap, uint8_t *methods, uint64_t *lens,
                        uint64_t *hashes, uint64_t *stored);
#endif
