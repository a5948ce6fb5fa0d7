"""Plain numpy reference implementation of every byte-transform kernel: the oracle.

The native kernels (``mithril_async._kernels``, faced by :mod:`mithril_async.codec.kernels`) are
tested against these functions, and :mod:`~mithril_async.codec.kernels` falls back to them when
the extension cannot be imported.  They favour obviousness over speed and allocate freely.

Layouts (``n = len(src) // w`` elements, ``t = len(src) % w`` tail bytes):

* ``group(src, w)``: plane ``k`` (bytes ``[k*n, (k+1)*n)``) holds byte ``k`` of every element,
  ``out[k*n + i] = src[i*w + k]``; the ``t`` tail bytes are copied verbatim to the end.
* ``exp_group(src, "bf16")``: 2 planes ``[exponent, sign|mantissa7]`` where the bf16 element
  ``S EEEEEEEE MMMMMMM`` gives exponent byte ``EEEEEEEE`` and ``S MMMMMMM``.
* ``exp_group(src, "fp32")``: 4 planes ``[exponent, sign|top-7-mantissa, mantissa byte 1,
  mantissa byte 0]`` (mantissa bytes in descending significance).
* ``exp_group(src, "fp16")``: plain 2-byte grouping (the 5-bit exponent does not fill a byte).
* A ``base`` is always XORed in the original element layout:
  ``xor_group(a, base, w) == group(a ^ base, w)`` and
  ``ungroup_xor(g, base, w) == ungroup(g, w) ^ base``.
* ``count_nonfinite(src, code)``: the NaN and Inf elements of ``src`` in the float format
  ``code`` (:data:`NONFINITE_FORMATS`), from the bits alone: an element is a candidate when
  ``bits & mask == want``; a candidate is an Inf when its format has Inf and its bits
  without the sign are ``mask`` (exponent all ones, mantissa zero), else a NaN.  The native
  transforms count the same way while they transform (``tally=``).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

U8 = npt.NDArray[np.uint8]

#: element widths with SIMD kernels
WIDTHS: tuple[int, ...] = (2, 4, 8)
#: largest element width group/ungroup accept (matches MK_MAX_WIDTH in native/kernels.h)
MAX_WIDTH = 16
#: exponent-plane kinds and their element width in bytes
KIND_WIDTHS: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
#: what each plane of ``exp_group`` holds, in order (the tail follows the last plane)
KIND_PLANES: dict[str, tuple[str, ...]] = {
    "bf16": ("exponent", "sign_mantissa"),
    "fp16": ("byte0", "byte1"),
    "fp32": ("exponent", "sign_mantissa_hi", "mantissa_mid", "mantissa_lo"),
}


#: NaN/Inf formats (native/kernels.h MK_NF_*): code -> (element width, mask, want, has Inf)
NONFINITE_SPECS: dict[int, tuple[int, int, int, bool]] = {
    1: (2, 0x7C00, 0x7C00, True),  # float16
    2: (2, 0x7F80, 0x7F80, True),  # bfloat16
    3: (4, 0x7F800000, 0x7F800000, True),  # float32
    4: (8, 0x7FF0000000000000, 0x7FF0000000000000, True),  # float64
    5: (1, 0x7C, 0x7C, True),  # float8_e5m2
    6: (1, 0x78, 0x78, True),  # float8_e4m3 (IEEE-like)
    7: (1, 0x70, 0x70, True),  # float8_e3m4
    8: (1, 0x7F, 0x7F, False),  # float8_e4m3fn: NaN = S1111111, no Inf
    9: (1, 0xFF, 0x80, False),  # *fnuz: NaN = 0x80 only, no Inf
    10: (1, 0xFF, 0xFF, False),  # float8_e8m0fnu: NaN = 0xff, no sign, no Inf
}
#: the NaN/Inf format of every dtype that has NaN or Inf, by stable dtype name
#: (float4_e2m1fn_x2 has neither). A complex dtype is counted as its real and imaginary
#: components, each in its component's float format (complex64: two float32), so an element
#: with a NaN real part and an Inf imaginary part counts one NaN and one Inf
NONFINITE_FORMATS: dict[str, int] = {
    "float16": 1, "bfloat16": 2, "float32": 3, "float64": 4, "float8_e5m2": 5,
    "float8_e4m3": 6, "float8_e3m4": 7, "float8_e4m3fn": 8, "float8_e4m3fnuz": 9,
    "float8_e5m2fnuz": 9, "float8_e4m3b11fnuz": 9, "float8_e8m0fnu": 10,
    "complex32": 1, "complex64": 3, "complex128": 4,
}


def _u8(x: object) -> U8:
    """View any C-contiguous buffer as a flat uint8 array (no copy)."""
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise ValueError("kernel input must be C-contiguous")
        return x.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(x).cast("B"), dtype=np.uint8)  # type: ignore[arg-type]


def element_width(kind_or_width: str | int) -> int:
    """Element width in bytes of a grouping width (1..16) or an exponent kind.

    Widths 2, 4 and 8 (:data:`WIDTHS`) have SIMD kernels; other widths (odd-sized or complex
    dtypes) still work on a portable loop so the codec never has to special-case a dtype.
    """
    if isinstance(kind_or_width, str):
        if kind_or_width not in KIND_WIDTHS:
            raise ValueError(
                f"unknown exponent kind {kind_or_width!r}; expected one of {sorted(KIND_WIDTHS)}"
            )
        return KIND_WIDTHS[kind_or_width]
    if isinstance(kind_or_width, bool) or not 1 <= int(kind_or_width) <= MAX_WIDTH:
        raise ValueError(
            f"unsupported element width {kind_or_width!r}; expected 1..{MAX_WIDTH} "
            "(2, 4 and 8 are vectorised)"
        )
    return int(kind_or_width)


def plane_sizes(kind_or_width: str | int, nbytes: int) -> tuple[int, ...]:
    """Sizes of the planes of a grouped buffer: ``w`` planes of ``n`` bytes, then the tail.

    The result always has ``w + 1`` entries (the last is the tail, possibly 0) and sums to
    ``nbytes``, so callers can slice planes without knowing the layout rules.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    w = element_width(kind_or_width)
    n, tail = divmod(nbytes, w)
    return (n,) * w + (tail,)


def _finish(result: U8, out: object | None) -> U8:
    if out is None:
        return result
    o = _u8(out)
    if o.size != result.size:
        raise ValueError(f"out has {o.size} bytes, expected {result.size}")
    o[...] = result
    return o


def _xor_base(src: U8, base: object | None) -> U8:
    if base is None:
        return src
    b = _u8(base)
    if b.size != src.size:
        raise ValueError(f"base has {b.size} bytes, expected {src.size}")
    return np.bitwise_xor(src, b)


def group(src: object, width: int, out: object | None = None) -> U8:
    """Byte grouping: plane k holds byte k of every element; tail copied verbatim."""
    s = _u8(src)
    w = element_width(width)
    n = s.size // w
    body = s[: n * w].reshape(n, w).T.reshape(-1)
    return _finish(np.concatenate([body, s[n * w :]]), out)


def ungroup(src: object, width: int, out: object | None = None) -> U8:
    """Inverse of :func:`group`."""
    s = _u8(src)
    w = element_width(width)
    n = s.size // w
    body = s[: n * w].reshape(w, n).T.reshape(-1)
    return _finish(np.concatenate([body, s[n * w :]]), out)


def copy(src: object, out: object | None = None) -> U8:
    """The identity transform (oracle of the native streaming copy)."""
    return _finish(_u8(src).copy(), out)


def xor(a: object, b: object, out: object | None = None) -> U8:
    """Bytewise XOR of two equally long buffers."""
    x = _u8(a)
    return _finish(_xor_base(x, b), out)


def xor_group(a: object, base: object, width: int, out: object | None = None) -> U8:
    """``group(a ^ base, width)``: an XOR delta against a base, then byte grouping."""
    return group(_xor_base(_u8(a), base), width, out)


def ungroup_xor(src: object, base: object, width: int, out: object | None = None) -> U8:
    """``ungroup(src, width) ^ base``: inverse of :func:`xor_group`."""
    return _finish(_xor_base(ungroup(src, width), base), out)


def exp_group(src: object, kind: str, base: object | None = None, out: object | None = None) -> U8:
    """Exponent/sign rearrangement + grouping of ``src ^ base`` (see the module docstring)."""
    s = _xor_base(_u8(src), base)
    w = element_width(kind)
    n = s.size // w
    tail = s[n * w :]
    if kind == "fp16":
        return group(s, 2, out)
    if kind == "bf16":
        v = s[: n * w].view("<u2").astype(np.uint32)
        planes = [(v >> 7) & 0xFF, ((v >> 8) & 0x80) | (v & 0x7F)]
    else:
        v = s[: n * w].view("<u4").astype(np.uint64)
        planes = [
            (v >> 23) & 0xFF,
            ((v >> 24) & 0x80) | ((v >> 16) & 0x7F),
            (v >> 8) & 0xFF,
            v & 0xFF,
        ]
    return _finish(np.concatenate([p.astype(np.uint8) for p in planes] + [tail]), out)


def exp_ungroup(
    src: object, kind: str, base: object | None = None, out: object | None = None
) -> U8:
    """Inverse of :func:`exp_group`: ``exp_ungroup(exp_group(a, k, b), k, b) == a``."""
    s = _u8(src)
    w = element_width(kind)
    n = s.size // w
    tail = s[n * w :]
    if kind == "fp16":
        return _finish(_xor_base(ungroup(s, 2), base), out)
    p = [s[k * n : (k + 1) * n].astype(np.uint64) for k in range(w)]
    if kind == "bf16":
        exp, sm = p
        v = ((sm & 0x80) << 8) | (exp << 7) | (sm & 0x7F)
        body = v.astype("<u2").view(np.uint8)
    else:
        exp, sm, m1, m0 = p
        v = ((sm & 0x80) << 24) | (exp << 23) | ((sm & 0x7F) << 16) | (m1 << 8) | m0
        body = v.astype("<u4").view(np.uint8)
    return _finish(_xor_base(np.concatenate([body, tail]), base), out)


def count_nonfinite(src: object, code: int) -> tuple[int, int]:
    """``(NaNs, Infs)`` among the whole elements of format ``code`` in ``src`` (a partial
    element at the end is not looked at)."""
    width, mask, want, has_inf = NONFINITE_SPECS[code]
    s = _u8(src)
    n = s.size // width
    bits = s[: n * width].view(f"<u{width}")
    cand = (bits & np.array(mask, bits.dtype)) == np.array(want, bits.dtype)
    inf = 0
    if has_inf:
        mag = np.array((1 << (8 * width - 1)) - 1, bits.dtype)
        inf = int(np.count_nonzero(cand & ((bits & mag) == np.array(mask, bits.dtype))))
    return int(np.count_nonzero(cand)) - inf, inf


__all__ = [
    "KIND_PLANES",
    "KIND_WIDTHS",
    "MAX_WIDTH",
    "NONFINITE_FORMATS",
    "NONFINITE_SPECS",
    "WIDTHS",
    "copy",
    "count_nonfinite",
    "element_width",
    "exp_group",
    "exp_ungroup",
    "group",
    "plane_sizes",
    "ungroup",
    "ungroup_xor",
    "xor",
    "xor_group",
]
