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

/* Decoding one chunk in one call (GIL released): the XXH3 and the ungroup of planes that
 * need not lie back to back (mk_ungroup_planes of mithril_async._kernels), by address.
 * 0 when both are set. */
int mc_set_decoder(uintptr_t xxh3, uintptr_t ungroup_planes);
int mc_decoder_ready(void);

#define MC_DEC_MAX_WIDTH 16
#define MC_DEC_ARGS (-1)      /* not bound, or planes that do not fit the transform/payload */
#define MC_DEC_PAYLOAD (-2)   /* the payload's hash is not want[0] (got[0]) */
#define MC_DEC_BAD_PLANE (-3) /* plane *bad's stored length does not fit its method */
#define MC_DEC_RANS (-4)      /* plane *bad is a corrupt rANS plane (got[0]: its code) */
#define MC_DEC_METHOD (-5)    /* plane *bad has a method decoded elsewhere (Python) */
#define MC_DEC_RAW (-6)       /* the decoded bytes' hash is not want[1] (got[1]) */
/* Decodes the chunk whose nplanes stored planes (methods[i], lens[i] bytes each) lie back to
 * back in payload (plen bytes) into dst (raw_size bytes), as codec/chunk.py's decode_chunk:
 * the payload's XXH3 checked first (check_payload), RAW planes read where they lie, CONST
 * planes filled and RANS32 planes decoded into scratch (>= raw_size bytes; kind < 0: into dst),
 * the chunk rebuilt by mk_ungroup_planes (width; kind 0: plain grouping, else an exponent
 * kind; kind < 0: the identity transform, one plane, no base), XORing base (or NULL), then
 * the XXH3 of dst checked.  0, or one of MC_DEC_*: dst may then hold anything. */
int mc_decode_chunk(const uint8_t *payload, size_t plen, const uint8_t *methods,
                    const uint64_t *lens, int nplanes, int width, int kind,
                    const uint8_t *base, uint8_t *scratch, size_t scap, uint8_t *dst,
                    size_t raw_size, const uint64_t *want, int check_payload, uint64_t *got,
                    int *bad);
#endif
