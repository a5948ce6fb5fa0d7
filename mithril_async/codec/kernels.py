"""Python face of the native byte-transform kernels (byte grouping, XOR deltas, exponent planes).

Why a native core: these transforms touch every byte of every checkpoint, twice per save and
once per restore, so they must run near memory bandwidth and off the GIL (the pipeline runs them
in a thread pool).  The C99 kernels in ``native/`` are compiled in cffi API mode when the package
installs (``mithril_async._kernels``); cffi releases the GIL around every call.  The SIMD level
(AVX2 / SSE2 / scalar) is detected at run time; ``MITHRIL_KERNELS=scalar|sse2|avx2|numpy`` or
:func:`set_backend` forces a lower one (tests check every level against the oracle).

If the extension cannot be imported this module still works, on the numpy oracle
(:mod:`mithril_async.codec.kernels_ref`), and warns loudly; :data:`BACKEND` says which path runs.

Every function takes 1-D C-contiguous uint8 arrays (any C-contiguous buffer is viewed as bytes
without a copy) and an optional ``out=``: a writable buffer of exactly the output length that is
filled and returned as a uint8 view (a new array is allocated when ``out`` is None).  Layouts and
plane order are documented in :mod:`~mithril_async.codec.kernels_ref`; :func:`plane_sizes` gives
plane boundaries.
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from mithril_async.codec import kernels_ref as _ref
from mithril_async.codec.kernel_args import as_bytes, exp_kind, out_buffer, same_len
from mithril_async.codec.kernels_ref import (
    KIND_PLANES,
    KIND_WIDTHS,
    MAX_WIDTH,
    NONFINITE_FORMATS,
    NONFINITE_SPECS,
    U8,
    WIDTHS,
    element_width,
    plane_sizes,
)

_log = logging.getLogger(__name__)

#: native SIMD levels, lowest first (values match MK_LEVEL_* in native/kernels.h)
LEVELS: tuple[str, ...] = ("scalar", "sse2", "avx2")
#: exponent kinds as the native kernels number them (MK_KIND_* in native/kernels.h)
KIND_CODES: dict[str, int] = {"bf16": 1, "fp32": 2}

_ffi: Any = None
_lib: Any = None
_native_error: str | None = None
try:
    _ext = importlib.import_module("mithril_async._kernels")
    _ffi, _lib = _ext.ffi, _ext.lib
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    _native_error = f"{type(exc).__name__}: {exc}"

#: the backend in use: "native-avx2", "native-sse2", "native-scalar" or "numpy (...)"
BACKEND: str = ""
_use_native = False


def native_available() -> bool:
    """Whether the compiled extension imported (independent of a forced numpy backend)."""
    return _lib is not None


def available_backends() -> tuple[str, ...]:
    """Backend names usable on this machine, lowest first (``numpy`` always works)."""
    if _lib is None:
        return ("numpy",)
    top = int(_lib.mk_detect_level())
    return ("numpy", *LEVELS[: top + 1])


def set_backend(name: str | None = None) -> str:
    """Force a backend (``numpy``, ``scalar``, ``sse2``, ``avx2``; None = best) and return BACKEND.

    A level above what the CPU supports is clamped to the best available one with a warning,
    so a config written on an AVX2 machine still runs elsewhere.  Process-global: meant for tests
    and benchmarks, not for switching while other threads run kernels.
    """
    global BACKEND, _use_native
    if name is not None and name not in ("numpy", *LEVELS):
        raise ValueError(f"unknown kernel backend {name!r}; expected numpy, scalar, sse2 or avx2")
    if name == "numpy" or _lib is None:
        _use_native = False
        if _lib is None:
            BACKEND = f"numpy (native extension unavailable: {_native_error})"
        else:
            BACKEND = "numpy (forced)"
        return BACKEND
    want = len(LEVELS) - 1 if name is None else LEVELS.index(name)
    got = int(_lib.mk_set_level(want))
    if got < want:
        msg = f"kernel backend {name!r} not supported by this CPU; using {LEVELS[got]!r}"
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        _log.warning(msg)
    _use_native = True
    BACKEND = f"native-{LEVELS[got]}"
    return BACKEND


def _init_backend() -> None:
    forced = os.environ.get("MITHRIL_KERNELS", "").strip().lower() or None
    try:
        set_backend(forced)
    except ValueError as exc:
        warnings.warn(f"ignoring MITHRIL_KERNELS: {exc}", RuntimeWarning, stacklevel=2)
        _log.warning("ignoring MITHRIL_KERNELS: %s", exc)
        set_backend(None)
    if not _use_native:
        msg = f"mithril_async byte kernels run on the slow numpy path: {BACKEND}"
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        _log.warning(msg)
    else:
        _log.debug("mithril_async byte kernels: %s", BACKEND)


_init_backend()


# ---------------------------------------------------------------------------------------------
# argument handling (the checks: kernel_args.py)


def _p(a: U8) -> Any:
    return _ffi.from_buffer("uint8_t[]", a)


def _pw(a: U8) -> Any:
    return _ffi.from_buffer("uint8_t[]", a, require_writable=True)


class NonFiniteTally:
    """The NaN and Inf elements counted by the kernels given ``tally=`` (in the same pass
    over the bytes as their transform), for one float format: the dtype's, see
    :meth:`of`. Counts add up over calls (one tally per tensor chunk, or per tensor)."""

    __slots__ = ("_ptr", "code", "counts", "width")

    def __init__(self, code: int) -> None:
        if code not in NONFINITE_SPECS:
            raise ValueError(f"unknown non-finite format {code!r}")
        self.code = code
        self.width = NONFINITE_SPECS[code][0]
        self.counts = np.zeros(2, np.uint64)  # NaNs, Infs: the native kernels add into it
        self._ptr: Any = None

    @classmethod
    def of(cls, dtype_name: str) -> NonFiniteTally | None:
        """A tally for ``dtype_name`` (a stable dtype name), None for a dtype without NaN or
        Inf (integers, bool, float4). A complex dtype's tally counts its components (its
        elements are pairs of the component's float format)."""
        code = NONFINITE_FORMATS.get(dtype_name)
        return None if code is None else cls(code)

    @property
    def nan(self) -> int:
        return int(self.counts[0])

    @property
    def inf(self) -> int:
        return int(self.counts[1])

    def add(self, nan: int, inf: int) -> None:
        self.counts += np.array([nan, inf], np.uint64)

    def fits(self, width: int, what: str) -> None:
        """Refuse (ValueError) a transform of another element width than the format's."""
        if width != self.width:
            raise ValueError(f"{what}: a tally of {self.width}-byte elements cannot count "
                             f"{width}-byte ones")

    def pointer(self) -> Any:
        """The native ``uint64_t[2]`` the kernels add into."""
        if self._ptr is None:
            self._ptr = _ffi.from_buffer("uint64_t[]", self.counts, require_writable=True)
        return self._ptr

    def __repr__(self) -> str:
        return f"NonFiniteTally(code={self.code}, nan={self.nan}, inf={self.inf})"


def _tally_ref(src: U8, tally: NonFiniteTally | None) -> None:
    """The numpy path's count of ``src`` into ``tally`` (a pass of its own)."""
    if tally is not None:
        tally.add(*_ref.count_nonfinite(src, tally.code))


def _checked(rc: int, what: str) -> None:
    if rc != 0:  # arguments are validated first: this is a binding out of step with the C
        raise RuntimeError(f"{what}: the native kernel refused its arguments ({rc})")


# ---------------------------------------------------------------------------------------------
# kernels


def group(src: object, width: int, out: object | None = None, *,
          tally: NonFiniteTally | None = None) -> U8:
    """Byte grouping: ``out[k*n + i] = src[i*width + k]``; the tail is copied verbatim.
    ``tally``: also count the NaN/Inf elements of ``src`` (same pass)."""
    s = as_bytes(src, "src")
    w = element_width(width)
    o = out_buffer(out, s.size, (s,))
    if tally is not None:
        tally.fits(w, "group")
    if _use_native:
        if tally is None:
            _lib.mk_group(_p(s), _ffi.NULL, _pw(o), s.size, w)
        else:
            _checked(_lib.mk_group_count(_p(s), _ffi.NULL, _pw(o), s.size, w, 0, tally.code,
                                         tally.pointer()), "group")
        return o
    _tally_ref(s, tally)
    return _ref.group(s, w, o)


def copy(src: object, out: object | None = None, *,
         tally: NonFiniteTally | None = None) -> U8:
    """``out[:] = src`` (the identity transform into the codec's scratch); ``tally``: also
    count the NaN/Inf elements of ``src`` (same pass). ``out`` must not overlap ``src``."""
    s = as_bytes(src, "src")
    o = out_buffer(out, s.size, (s,))
    if _use_native:
        if tally is None:
            _lib.mk_copy_count(_p(s), _ffi.NULL, _pw(o), s.size, 0, _ffi.NULL)
        else:
            _checked(_lib.mk_copy_count(_p(s), _ffi.NULL, _pw(o), s.size, tally.code,
                                        tally.pointer()), "copy")
        return o
    _tally_ref(s, tally)
    return _ref.copy(s, o)


def count_nonfinite_after(src: object, tally: NonFiniteTally,
                          first: Callable[[memoryview], object],
                          run_bytes: int = 256 << 10) -> NonFiniteTally:
    """For each run of ``run_bytes`` of ``src`` (whole elements): ``first(run)`` (a hash's
    ``update``), then count the run's NaN/Inf elements into ``tally`` while it is still in
    the cache, so the count does not read memory again; returns ``tally``."""
    s = as_bytes(src, "src")
    step = max(tally.width, run_bytes - run_bytes % tally.width)
    mv = memoryview(s.data).cast("B")
    if not _use_native:
        for off in range(0, s.size, step):
            first(mv[off:off + step])
            _tally_ref(s[off:off + step], tally)
        return tally
    base, ptr, code = _p(s), tally.pointer(), tally.code
    for off in range(0, s.size, step):
        n = min(step, s.size - off)
        first(mv[off:off + n])
        _lib.mk_count_nonfinite(base + off, n, code, ptr)  # one cheap call per run
    return tally


def count_nonfinite(src: object, tally: NonFiniteTally) -> NonFiniteTally:
    """Count the NaN/Inf elements of ``src`` into ``tally`` (for bytes no transform reads:
    an uncompressed blob, the lossy tier's input); returns ``tally``."""
    s = as_bytes(src, "src")
    if _use_native:
        _checked(_lib.mk_count_nonfinite(_p(s), s.size, tally.code, tally.pointer()),
                 "count_nonfinite")
    else:
        _tally_ref(s, tally)
    return tally


def ungroup(src: object, width: int, out: object | None = None) -> U8:
    """Inverse of :func:`group`."""
    s = as_bytes(src, "src")
    w = element_width(width)
    o = out_buffer(out, s.size, (s,))
    if _use_native:
        _lib.mk_ungroup(_p(s), _ffi.NULL, _pw(o), s.size, w)
        return o
    return _ref.ungroup(s, w, o)


def copy_stream(src: object, out: object) -> U8:
    """``out[:] = src`` with non-temporal stores (the Stager's snapshot copy).

    Writing the destination without reading it into the cache first makes big copies into
    warm, reused staging buffers faster than ``memcpy`` (bench_kernels.py); the numpy path
    copies normally.  ``out`` must not overlap ``src``.
    """
    s = as_bytes(src, "src")
    o = out_buffer(out, s.size, (s,))
    if _use_native:
        _lib.mk_copy_stream(_p(s), _pw(o), s.size)
        return o
    return _ref.copy(s, o)


def copy_batch(jobs: list[tuple[int, int, int]], stream_min: int = 1 << 20) -> None:
    """Copy ``nbytes`` from ``src`` to ``dst`` for every ``(src, dst, nbytes)`` address triple,
    in one native call (the GIL released once for the whole list).

    The Stager's snapshot: one call instead of one :func:`copy_stream`/``copy_`` per tensor
    (their per-call cost dominated the stall of states with many small tensors).  Copies of
    ``stream_min`` bytes or more use non-temporal stores, smaller ones ``memcpy``.  The
    addresses are raw: the caller keeps both buffers alive and guarantees each job's ranges are
    valid and do not overlap (the Stager copies tensors into its own buffers).
    """
    n = len(jobs)
    if not n:
        return
    for i, job in enumerate(jobs):
        if len(job) != 3 or min(job) < 0:
            raise ValueError(f"copy_batch: job {i} is not a (src, dst, nbytes) triple of "
                             f"non-negative ints: {job!r}")
    src, dst, ln = np.ascontiguousarray(np.array(jobs, dtype=np.uint64).T)  # 3 columns
    copy_arrays(src, dst, ln, stream_min)


def copy_arrays(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
                stream_min: int = 1 << 20) -> None:
    """:func:`copy_batch` of jobs given as three equal-length uint64 arrays (addresses and
    byte counts): for many runs (a resharded restore copies one per row of a column-sharded
    tensor) without a Python tuple per job."""
    src, dst, nbytes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (src, dst, nbytes))
    n = src.size
    if dst.size != n or nbytes.size != n:
        raise ValueError(f"copy_arrays: {src.size} sources, {dst.size} destinations, "
                         f"{nbytes.size} lengths")
    if not n:
        return
    if _use_native:
        _lib.mk_copy_batch(_ffi.cast("uintptr_t *", src.ctypes.data),
                           _ffi.cast("uintptr_t *", dst.ctypes.data),
                           _ffi.cast("size_t *", nbytes.ctypes.data), n, stream_min)
        return
    import ctypes

    for s_addr, d_addr, nb in zip(src.tolist(), dst.tolist(), nbytes.tolist(), strict=True):
        ctypes.memmove(d_addr, s_addr, nb)


def xor(a: object, b: object, out: object | None = None, *,
        tally: NonFiniteTally | None = None) -> U8:
    """Bytewise ``a ^ b``; ``out`` may be ``a`` or ``b`` itself (in-place). ``tally``: also
    count the NaN/Inf elements of ``a`` (its own values, not the XOR; same pass)."""
    x, y = as_bytes(a, "a"), as_bytes(b, "b")
    same_len(x, y, "b")
    o = out_buffer(out, x.size, (x, y), alias_ok=(x, y))
    if _use_native:
        if tally is None:
            _lib.mk_xor(_p(x), _p(y), _pw(o), x.size)
        else:
            _checked(_lib.mk_copy_count(_p(x), _p(y), _pw(o), x.size, tally.code,
                                        tally.pointer()), "xor")
        return o
    _tally_ref(x, tally)
    return _ref.xor(x, y, o)


def xor_group(a: object, base: object, width: int, out: object | None = None, *,
              tally: NonFiniteTally | None = None) -> U8:
    """Fused ``group(a ^ base, width)``: the XOR delta never materialises in memory.
    ``tally``: also count the NaN/Inf elements of ``a`` (not of the XOR; same pass)."""
    x, b = as_bytes(a, "a"), as_bytes(base, "base")
    same_len(x, b, "base")
    w = element_width(width)
    o = out_buffer(out, x.size, (x, b))
    if tally is not None:
        tally.fits(w, "xor_group")
    if _use_native:
        if tally is None:
            _lib.mk_group(_p(x), _p(b), _pw(o), x.size, w)
        else:
            _checked(_lib.mk_group_count(_p(x), _p(b), _pw(o), x.size, w, 0, tally.code,
                                         tally.pointer()), "xor_group")
        return o
    _tally_ref(x, tally)
    return _ref.xor_group(x, b, w, o)


def ungroup_xor(src: object, base: object, width: int, out: object | None = None) -> U8:
    """Fused ``ungroup(src, width) ^ base`` (inverse of :func:`xor_group`); ``out`` may be base."""
    s, b = as_bytes(src, "src"), as_bytes(base, "base")
    same_len(s, b, "base")
    w = element_width(width)
    o = out_buffer(out, s.size, (s, b), alias_ok=(b,))
    if _use_native:
        _lib.mk_ungroup(_p(s), _p(b), _pw(o), s.size, w)
        return o
    return _ref.ungroup_xor(s, b, w, o)


def exp_group(src: object, kind: str, base: object | None = None, out: object | None = None,
              *, tally: NonFiniteTally | None = None) -> U8:
    """Exponent-plane grouping of ``src ^ base`` for ``kind`` in bf16/fp32 (fp16: plain group).

    The exponent byte of a float compresses well while the sign bit is noise, so splitting them
    into separate planes (ZipNN) helps zstd.  ``base`` is XORed in the original element layout.
    ``tally``: also count the NaN/Inf elements of ``src`` (not of the XOR; same pass).
    """
    s = as_bytes(src, "src")
    k = exp_kind(kind)
    b = None if base is None else as_bytes(base, "base")
    if b is not None:
        same_len(s, b, "base")
    o = out_buffer(out, s.size, (s,) if b is None else (s, b))
    if tally is not None:
        tally.fits(KIND_WIDTHS[k], "exp_group")
    if _use_native:
        pb = _ffi.NULL if b is None else _p(b)
        code = 0 if k == "fp16" else KIND_CODES[k]
        if tally is not None:
            _checked(_lib.mk_group_count(_p(s), pb, _pw(o), s.size, KIND_WIDTHS[k], code,
                                         tally.code, tally.pointer()), "exp_group")
        elif k == "fp16":
            _lib.mk_group(_p(s), pb, _pw(o), s.size, 2)
        else:
            _lib.mk_exp_group(_p(s), pb, _pw(o), s.size, KIND_CODES[k])
        return o
    _tally_ref(s, tally)
    return _ref.exp_group(s, k, b, o)


def exp_ungroup(
    src: object, kind: str, base: object | None = None, out: object | None = None
) -> U8:
    """Inverse of :func:`exp_group`: ``exp_ungroup(exp_group(a, k, b), k, b) == a``."""
    s = as_bytes(src, "src")
    k = exp_kind(kind)
    b = None if base is None else as_bytes(base, "base")
    if b is not None:
        same_len(s, b, "base")
    o = out_buffer(out, s.size, (s,) if b is None else (s, b), alias_ok=() if b is None else (b,))
    if _use_native:
        pb = _ffi.NULL if b is None else _p(b)
        if k == "fp16":
            _lib.mk_ungroup(_p(s), pb, _pw(o), s.size, 2)
        else:
            _lib.mk_exp_ungroup(_p(s), pb, _pw(o), s.size, KIND_CODES[k])
        return o
    return _ref.exp_ungroup(s, k, b, o)


def native_in_use() -> bool:
    """Whether the kernels run natively (not the numpy reference, e.g. forced by a test)."""
    return _use_native


def ungroup_planes_address() -> int:
    """The address of ``mk_ungroup_planes`` (planes that need not lie back to back), for the
    native chunk decoder of ``mithril_async._rans``; 0 without the extension."""
    if _lib is None or not hasattr(_lib, "mk_ungroup_planes"):
        return 0
    return int(_ffi.cast("uintptr_t", _ffi.addressof(_lib, "mk_ungroup_planes")))


def spin_ns(ns: int) -> None:
    """Busy-wait ``ns`` nanoseconds inside C (tests use it to prove the GIL is released)."""
    if _lib is None:
        raise RuntimeError(f"native kernels unavailable: {_native_error}")
    _lib.mk_spin_ns(ns)


__all__ = [
    "BACKEND",
    "KIND_CODES",
    "KIND_PLANES",
    "KIND_WIDTHS",
    "LEVELS",
    "MAX_WIDTH",
    "NONFINITE_FORMATS",
    "WIDTHS",
    "NonFiniteTally",
    "available_backends",
    "copy",
    "copy_arrays",
    "copy_batch",
    "copy_stream",
    "count_nonfinite",
    "count_nonfinite_after",
    "element_width",
    "exp_group",
    "exp_ungroup",
    "native_in_use",
    "group",
    "native_available",
    "plane_sizes",
    "set_backend",
    "spin_ns",
    "ungroup_planes_address",
    "ungroup",
    "ungroup_xor",
    "xor",
    "xor_group",
]
