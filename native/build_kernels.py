"""cffi (API mode) build of the native byte-transform kernels -> ``mithril_async._kernels``.

Used by ``setup.py`` (``cffi_modules``) so ``pip install`` compiles the kernels; it can also be
run directly (``python native/build_kernels.py``) to build the module in place for development.
The C sources are plain C99 compiled with -O3 only: SIMD paths carry their own
``target("avx2")`` attributes and are chosen at run time, so one binary runs on any x86-64 CPU.
"""

from __future__ import annotations

import os
import sys

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))

sys.path.insert(0, _HERE)  # run by cffi's setuptools hook as a file, not a module
from headers import declarations  # noqa: E402

#: what cffi binds: the declarations of the header(s), never a copy of them
CDEF = declarations(os.path.join(_HERE, "kernels.h"))


def _compile_args() -> list[str]:
    if sys.platform == "win32":
        return ["/O2"]
    return ["-O3", "-std=c99"]


def make_builder(absolute_paths: bool = False) -> FFI:
    """The cffi builder; setuptools wants project-relative source paths, ``compile()`` absolute."""

    def path(p: str) -> str:
        return p if absolute_paths else os.path.relpath(p)

    builder = FFI()
    builder.cdef(CDEF)
    builder.set_source(
        "mithril_async._kernels",
        '#include "kernels.h"',
        sources=[path(os.path.join(_HERE, "kernels.c"))],
        include_dirs=[path(_HERE)],
        depends=[path(os.path.join(_HERE, "kernels.h"))],
        extra_compile_args=_compile_args(),
    )
    return builder


ffibuilder = make_builder()

if __name__ == "__main__":
    # In-place development build: compiles under build/ and copies the module into the package.
    import shutil

    root = os.path.dirname(_HERE)
    tmp = os.path.join(root, "build", "cffi")
    built = make_builder(absolute_paths=True).compile(tmpdir=tmp, verbose=True)
    # cffi modules use the limited API; use the name setuptools gives them so a later pip build
    # replaces this file instead of being shadowed by it.
    dest = os.path.join(root, "mithril_async", "_kernels.abi3.so")
    tmp_dest = dest + ".tmp"
    shutil.copy(built, tmp_dest)
    os.replace(tmp_dest, dest)  # atomic: processes that loaded the old file keep its inode
    print(dest)
