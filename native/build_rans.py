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

sys.path.insert(0, _HERE)  # run by cffi's setuptools hook as a file, not a module
from headers import declarations  # noqa: E402

#: what cffi binds: the declarations of the header(s), never a copy of them
CDEF = declarations(os.path.join(_HERE, "rans.h"), os.path.join(_HERE, "chunkenc.h"))


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
