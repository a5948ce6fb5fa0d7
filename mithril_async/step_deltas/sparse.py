"""Sparse per-step deltas: the diff of one optimizer step and its on-disk form.

Why new values and not differences
    A delta is taken between two snapshots *in the recorder's dtype* (a cast of the live
    weights). ``new - old`` is not exactly invertible in floating point (``old + (new - old)``
    can round to something other than ``new``), so a delta stores, at every index whose cast
    **bits** differ, the ``values`` (new) and the ``old`` values. Reconstruction is then an
    exact scatter of ``values``; ``old`` makes the delta reversible and lets the analysis
    compute update norms and net multi-step changes exactly without the base weights.
    Comparing bits (not ``!=`` on floats) means ``-0.0 -> +0.0`` and NaN payload changes count
    as changes, so the scatter really is bitwise exact.

On-disk form (one blob per step, ``delta_<step:06d>.mckp``)
    A flat tensor dict: ``<layer>.indices`` (flat row-major positions, ascending; int32 when
    the layer has fewer than 2**31 elements, else int64), ``<layer>.values``, ``<layer>.old``
    and ``<layer>.shape`` (int64), plus ``__delta__.step`` and ``__delta__.version``. Only
    changed layers appear. The dict is encoded losslessly as one MCKP blob
    (``mithril_async.codec.compress_state_dict``: byte grouping + zstd + xxh64 checksums).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, overload

import torch

from mithril_async.codec import compress_state_dict, decompress_state_dict
from mithril_async.errors import InvalidFormat, UnknownFormatVersion, UnsupportedDtype

#: version of the per-step tensor-dict layout (``__delta__.version``)
DELTA_FORMAT_VERSION = 1
_META = "__delta__"
_FIELDS = ("indices", "values", "old", "shape")
#: blobs smaller than this are (de)compressed single-threaded
_PARALLEL_BYTES = 32 << 20

#: integer views used to compare floats bitwise
_BITS_VIEW: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def bits_view(dtype: torch.dtype) -> torch.dtype:
    """The same-width integer dtype used to compare ``dtype`` values bit for bit."""
    try:
        return _BITS_VIEW[dtype]
    except KeyError:
        raise UnsupportedDtype(
            f"sparse deltas support bfloat16, float16, float32, float64; got {dtype}"
        ) from None


@dataclass
class SparseLayerDelta:
    """The change of one tensor over one recorded step, in COO form (flat indices)."""

    shape: tuple[int, ...]
    indices: torch.Tensor  # ascending flat positions (int64; int32 while being recorded)
    values: torch.Tensor  # new values at ``indices`` (recorder dtype)
    old: torch.Tensor  # previous values at ``indices`` (recorder dtype)

    @property
    def nnz(self) -> int:
        return int(self.indices.numel())

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    def update(self) -> torch.Tensor:
        """``values - old`` in float64 (for norms and analysis; not used to reconstruct)."""
        return self.values.to(torch.float64) - self.old.to(torch.float64)

    def to_dense_delta(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense update ``new - old`` with this layer's shape (zeros where unchanged)."""
        out = torch.zeros(self.numel, dtype=dtype)
        out[self.indices] = self.update().to(dtype)
        return out.reshape(self.shape)

    def apply_(self, target: torch.Tensor) -> torch.Tensor:
        """Scatter the new values into ``target`` (contiguous, same dtype) in place."""
        flat = target.view(-1)
        flat[self.indices.to(flat.device)] = self.values.to(flat.device, flat.dtype)
        return target


def diff_tensor(prev: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat positions where ``new`` differs bitwise from ``prev`` (same shape and dtype)."""
    view = bits_view(prev.dtype)
    mask = prev.reshape(-1).view(view) != new.reshape(-1).view(view)
    return mask.nonzero().squeeze(1)


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def delta_to_tensors(step: int, layers: Mapping[str, SparseLayerDelta]) -> dict[str, torch.Tensor]:
    """The flat tensor dict of one delta (see the module docstring)."""
    out: dict[str, torch.Tensor] = {
        f"{_META}.step": torch.tensor([step], dtype=torch.int64),
        f"{_META}.version": torch.tensor([DELTA_FORMAT_VERSION], dtype=torch.int64),
    }
    for name, d in layers.items():
        out[f"{name}.indices"] = d.indices.to(_index_dtype(d.numel)).contiguous()
        out[f"{name}.values"] = d.values.contiguous()
        out[f"{name}.old"] = d.old.contiguous()
        out[f"{name}.shape"] = torch.tensor(list(d.shape), dtype=torch.int64)
    return out


def tensors_to_delta(
    tensors: Mapping[str, torch.Tensor], where: str = "<blob>"
) -> tuple[int, dict[str, SparseLayerDelta]]:
    """Inverse of :func:`delta_to_tensors`; ``where`` names the source in errors."""
    try:
        version = int(tensors[f"{_META}.version"][0])
        step = int(tensors[f"{_META}.step"][0])
    except KeyError:
        raise InvalidFormat(f"{where} is not a sparse delta (no {_META} entries)") from None
    if version != DELTA_FORMAT_VERSION:
        raise UnknownFormatVersion(f"{where}: sparse delta version {version} is not known")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if key.startswith(_META + "."):
            continue
        name, _, field = key.rpartition(".")
        if field not in _FIELDS or not name:
            raise InvalidFormat(f"{where}: unexpected entry {key!r}")
        parts.setdefault(name, {})[field] = t
    layers: dict[str, SparseLayerDelta] = {}
    for name, p in parts.items():
        missing = [f for f in _FIELDS if f not in p]
        if missing:
            raise InvalidFormat(f"{where}: layer {name!r} lacks {missing}")
        d = SparseLayerDelta(
            shape=tuple(int(s) for s in p["shape"].tolist()),
            indices=p["indices"].to(torch.int64),
            values=p["values"],
            old=p["old"],
        )
        if not (d.indices.numel() == d.values.numel() == d.old.numel()):
            raise InvalidFormat(f"{where}: layer {name!r} has mismatched COO lengths")
        if d.nnz and (int(d.indices.min()) < 0 or int(d.indices.max()) >= d.numel):
            raise InvalidFormat(f"{where}: layer {name!r} has indices outside shape {d.shape}")
        layers[name] = d
    return step, layers


# --- encoding -------------------------------------------------------------------------------


def encode_tensors(tensors: Mapping[str, torch.Tensor], step: int | None = None) -> bytes:
    """Losslessly encode a flat tensor dict as one MCKP blob (``mithril_async.codec``).

    Small dicts (typical sparse deltas) are encoded on the calling thread: a thread pool per
    call costs more than the work itself.
    """
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    threads = 1 if nbytes < _PARALLEL_BYTES else None
    data = {k: v.contiguous() for k, v in tensors.items()}
    return compress_state_dict(data, step=step, threads=threads)


def decode_tensors(blob: bytes, where: str = "<blob>") -> dict[str, torch.Tensor]:
    """Inverse of :func:`encode_tensors`; the codec verifies checksums."""
    try:
        out = decompress_state_dict(blob, threads=1 if len(blob) < _PARALLEL_BYTES else None)
    except InvalidFormat:
        raise
    except Exception as e:  # the codec's own failures, named with the file
        raise InvalidFormat(f"{where}: not a readable MCKP blob: {e}") from e
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


def encode_delta(step: int, layers: Mapping[str, SparseLayerDelta]) -> bytes:
    return encode_tensors(delta_to_tensors(step, layers), step=step)


def decode_delta(blob: bytes, where: str = "<blob>") -> tuple[int, dict[str, SparseLayerDelta]]:
    return tensors_to_delta(decode_tensors(blob, where), where)


def read_delta_file(path: str | os.PathLike[str]) -> tuple[int, dict[str, SparseLayerDelta]]:
    """Read and decode one delta file; returns ``(step, layers)``."""
    with open(path, "rb") as f:
        blob = f.read()
    return decode_delta(blob, os.fspath(path))


@overload
def load_sparse_delta(
    path: str | os.PathLike[str], dense: Literal[True] = ...
) -> dict[str, torch.Tensor]: ...
@overload
def load_sparse_delta(
    path: str | os.PathLike[str], dense: Literal[False]
) -> dict[str, SparseLayerDelta]: ...
def load_sparse_delta(
    path: str | os.PathLike[str], dense: bool = True
) -> dict[str, torch.Tensor] | dict[str, SparseLayerDelta]:
    """Load one delta file (the recorder's public API): layer -> dense float32 update ``new - old``.

    With ``dense=False`` the COO pieces come back as :class:`SparseLayerDelta` (indices, new
    values, old values, shape), which is what exact reconstruction uses. The dense update is
    for inspection: it is zero exactly where the layer did not change, except for the rare
    bit-level changes whose float difference is zero (``-0.0`` vs ``0.0``) or NaN.
    """
    _, layers = read_delta_file(path)
    if not dense:
        return layers
    return {name: d.to_dense_delta() for name, d in layers.items()}


def tensors_to_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """Encode a full (dense) snapshot, e.g. the base weights; same encoding as deltas."""
    return encode_tensors({k: v.contiguous() for k, v in tensors.items()})
