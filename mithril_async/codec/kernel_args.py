"""How the byte kernels take their arguments: flat uint8 views, and an ``out=`` checked.

Every kernel (:mod:`mithril_async.codec.kernels`) takes C-contiguous buffers viewed as bytes
without a copy, and an optional ``out=`` that must be writable, exactly the output's length,
and must not overlap an input (the transposing kernels would read bytes they already wrote):
each is refused with a ValueError naming the argument before any native code runs.
"""

from __future__ import annotations

import numpy as np

from mithril_async.codec.kernels_ref import KIND_WIDTHS, U8

__all__ = ["as_bytes", "exp_kind", "out_buffer", "same_len"]


def as_bytes(x: object, name: str) -> U8:
    """View an input as flat uint8 without copying; refuse non-contiguous arrays."""
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
        return x.reshape(-1).view(np.uint8)
    try:
        return np.frombuffer(x, dtype=np.uint8)  # type: ignore[call-overload]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a C-contiguous buffer: {exc}") from exc


def out_buffer(
    out: object | None, nbytes: int, inputs: tuple[U8, ...], alias_ok: tuple[U8, ...] = ()
) -> U8:
    """Allocate or validate ``out``: writable, exactly ``nbytes``, not overlapping the inputs.

    Overlap would make the transposing kernels read bytes they already overwrote; only exact
    aliasing of an input that is read at the same offset it is written (``alias_ok``) is safe.
    """
    if out is None:
        return np.empty(nbytes, dtype=np.uint8)
    o = as_bytes(out, "out")
    if not o.flags.writeable:
        raise ValueError("out must be writable")
    if o.size != nbytes:
        raise ValueError(f"out has {o.size} bytes, expected exactly {nbytes}")
    for arr in inputs:
        if arr.size and np.may_share_memory(o, arr):
            exact = any(
                a is arr and a.ctypes.data == o.ctypes.data and a.size == o.size for a in alias_ok
            )
            if not exact:
                raise ValueError("out must not overlap the inputs of this kernel")
    return o


def same_len(a: U8, b: U8, what: str) -> None:
    """Refuse a second input (or output) of another length than the first."""
    if a.size != b.size:
        raise ValueError(f"{what} has {b.size} bytes, expected {a.size} (same as the input)")


def exp_kind(kind: str) -> str:
    """``kind``, if the exponent kernels know it."""
    if kind not in KIND_WIDTHS:
        raise ValueError(f"unknown exponent kind {kind!r}; expected one of {sorted(KIND_WIDTHS)}")
    return kind
