"""The C declarations of a header, for a cffi ``cdef``: the headers stay the one place a
native function's signature is written (``build_kernels.py`` and ``build_rans.py`` used to
repeat them by hand, and drift between the two would only show as a crash).

Comments and preprocessor lines (include guards, includes, ``#define`` constants) are
dropped; what is left must be plain declarations cffi's parser accepts.
"""

from __future__ import annotations

import re

_BLOCK_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_LINE_COMMENT = re.compile(r"//[^\n]*")


def declarations(*paths: str) -> str:
    """The declarations of the headers at ``paths``, in order, as one ``cdef`` text."""
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = _LINE_COMMENT.sub("", _BLOCK_COMMENT.sub("", f.read()))
        out.extend(line for line in text.splitlines()
                   if line.strip() and not line.lstrip().startswith("#"))
    return "\n".join(out) + "\n"
