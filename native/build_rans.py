"""cffi (API mode) build of the rANS plane coders -> ``mithril_async._rans``.

It also compiles ``chunkenc.c``: every plane of a float chunk coded in one call (rANS, and the
XXH3 / zlib-ng / zstd of the Python modules, by address), so that a chunk's coding runs with
the GIL released from start to end (``codec/rans.py``: ``encode_planes``, ``encode_batch``).

Listed in ``setup.py``'s ``cffi_modules`` next to the kernels so ``pip install`` compiles it;
``python native/build_rans.py`` builds it in place for development.  Without it the codec
still works: it writes Huffman-only deflate planes instead, and decodes RANS planes with a
slow pure-numpy decoder (``mithril_async/codec/rans.py``), so every blob stays readable.
The AVX2 decoder of format v2 is compiled with a ``target("avx2")`` attribute and chosen at
run time, so plain ``-O3`` builds run on any x86-64 CPU.

Replacing ``_rans.abi3.so`` under running processes crashes them: build to a temporary file and
rename it over the old one (a rename keeps their mapping on the old inode); this script does.
"""

from __future__ import annotations

import os
import sys

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))

CDEF = """
void mr_histogram(const uint8_t *src, size_t n, uint32_t *hist);
double mr_sample_entropy(const uint8_t *src, size_t n, size_t max_sample);
size_t mr_encode_bound(size_t n);
int64_t mr_encode(const uint8_t *src, size_t n, uint8_t *dst, size_t cap, size_t limit);
int mr_decode(const uint8_t *src, size_t len, uint8_t *dst, size_t n);
size_t mr2_encode_bound(size_t n);
size_t mr2_encode_cap(size_t n, size_t limit);
int64_t mr2_encode(const uint8_t *src, size_t n, uint8_t *dst, size_t cap, size_t limit);
int mr2_decode(const uint8_t *src, size_t len, uint8_t *dst, size_t n);
int mr_set_level(int level);
int mc_set_env(uintptr_t xxh3, uintptr_t zinit, uintptr_t zdeflate, uintptr_t zreset,
               uintptr_t zend, const char *zversion);
int mc_ready(void);
int mc_set_zstd(uintptr_t create, uintptr_t free_, uintptr_t setp, uintptr_t compress2,
                uintptr_t iserr);
size_t mc_arena_cap(const uint64_t *sizes, int nplanes);
int64_t mc_encode_planes(const uint8_t *raw, size_t raw_size, uint8_t *planes,
                         const uint64_t *sizes, int nplanes, double raw_bits,
                         double huff_min_bits, double min_gain, int level, uint8_t *arena,
                         size_t cap, uint8_t *dst, uint8_t *methods, uint64_t *lens,
                         uint64_t *hashes);
int mc_set_decoder(uintptr_t xxh3, uintptr_t ungroup_planes);
int mc_decoder_ready(void);
int mc_decode_chunk(const uint8_t *payload, size_t plen, const uint8_t *methods,
                    const uint64_t *lens, int nplanes, int width, int kind,
                    const uint8_t *base, uint8_t *scratch, size_t scap, uint8_t *dst,
                    size_t raw_size, const uint64_t *want, int check_payload, uint64_t *got,
                    int *bad);
size_t mc_batch_cap(const uint64_t *sizes, const int32_t *nplanes, size_t nchunks);
int64_t mc_encode_batch(size_t nchunks, const uintptr_t *raws, const uint64_t *raw_sizes,
                        uint8_t *planes, const uint64_t *sizes, const int32_t *nplanes,
                        double raw_bits, double huff_min_bits, double min_gain, int level,
                        uint8_t *arena, size_t cap, uint8_t *methods, uint64_t *lens,
                        uint64_t *hashes, uint64_t *stored);
"""


def make_builder(absolute_paths: bool = False) -> FFI:
    """The cffi builder; setuptools wants project-relative source paths, ``compile()`` absolute."""

    def path(p: str) -> str:
        return p if absolute_paths else os.path.relpath(p)

    builder = FFI()
    builder.cdef(CDEF)
    builder.set_source(
        "mithril_async._rans",
        '#include "rans.h"\n#include "chunkenc.h"',
        sources=[path(os.path.join(_HERE, "rans.c")), path(os.path.join(_HERE, "chunkenc.c"))],
        include_dirs=[path(_HERE)],
        depends=[path(os.path.join(_HERE, "rans.h")), path(os.path.join(_HERE, "chunkenc.h"))],
        libraries=[] if sys.platform == "win32" else ["m", "pthread"],
        extra_compile_args=["/O2"] if sys.platform == "win32" else ["-O3", "-std=c99"],
    )
    return builder


ffibuilder = make_builder()

if __name__ == "__main__":
    import shutil

    root = os.path.dirname(_HERE)
    tmp = os.path.join(root, "build", "cffi-rans")
    built = make_builder(absolute_paths=True).compile(tmpdir=tmp, verbose=False)
    dest = os.path.join(root, "mithril_async", "_rans.abi3.so")
    tmp_dest = dest + ".tmp"
    shutil.copy(built, tmp_dest)
    os.replace(tmp_dest, dest)  # atomic: processes that loaded the old file keep its inode
    print(dest)
