"""Bytes of a :class:`LossyCheckpoint`: the "MLDC" v1 container (lossy delta checkpoint).

Why a container of its own: a lossy delta is many small parts (masks, per-block bit widths,
mins, scales, codes, row shifts, lossless blobs); storing them as one blob keeps a checkpoint one
object in the store, and its length is the honest size the benchmarks report.

Layout (little-endian)::

    0  4  magic b"MLDC"
    4  1  version (1)
    5  1  flags (bit 0: keyframe; others 0)
    6  2  reserved (0)
    8  4  header length H (bytes of zstd-compressed JSON)
    12 H  header: zstd(JSON{index, raw_bytes, config, masks, records})
    .. .  data: every byte range named in the header as [offset, length] into this region
    -8 8  xxh64 of every preceding byte (checked before anything else is parsed)

The reader checks magic, version, the trailing xxh64 (a flipped byte anywhere raises
:class:`ChecksumMismatch`), flags, that every range lies inside the data region, dtype
names against an allow-list, and array lengths against block counts; anything else raises
:class:`InvalidFormat` / :class:`UnknownFormatVersion`.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard

from mithril_async.errors import ChecksumMismatch, InvalidFormat, UnknownFormatVersion
from mithril_async.lossy.excp import LossyCheckpoint, LossyDeltaConfig, TensorRecord
from mithril_async.lossy.quant import QuantizedTensor

MAGIC = b"MLDC"
VERSION = 1
_MAX_HEADER = 64 << 20
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}

__all__ = ["checkpoint_from_bytes", "checkpoint_to_bytes"]


class _Writer:
    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, data: bytes) -> list[int]:
        self.parts.append(data)
        self.size += len(data)
        return [self.size - len(data), len(data)]


def _dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def checkpoint_to_bytes(ckpt: LossyCheckpoint, level: int = 3) -> bytes:
    """Serialise one lossy checkpoint (lossless records included) into an MLDC v1 blob."""
    w = _Writer()
    masks = {k: [kept, *w.add(blob)] for k, (kept, blob) in ckpt.masks.items()}
    records: dict[str, Any] = {}
    for name, rec in ckpt.records.items():
        r: dict[str, Any] = {"kind": rec.kind, "shape": list(rec.shape),
                             "dtype": _dname(rec.dtype), "ref": rec.ref, "domain": rec.domain,
                             "mask_key": rec.mask_key, "blob": w.add(rec.blob)}
        if rec.row_shift is not None:
            r["row_shift"] = w.add(rec.row_shift.to(torch.float16).numpy().astype("<f2").tobytes())
        if rec.values is not None:
            q = rec.values
            r["values"] = {"shape": list(q.shape), "dtype": _dname(q.dtype),
                           "block_size": q.block_size, "bits": w.add(q.bits.tobytes()),
                           "mins": w.add(q.mins.astype("<f4").tobytes()),
                           "scales": w.add(q.scales.astype("<f4").tobytes()),
                           "payload": w.add(q.payload), "max_abs_error": q.max_abs_error,
                           "bound": None if math.isinf(q.bound) else q.bound}
        records[name] = r
    header = {"index": ckpt.index, "raw_bytes": ckpt.raw_bytes, "config": asdict(ckpt.config),
              "masks": masks, "records": records}
    hz = zstandard.ZstdCompressor(level=level).compress(json.dumps(header).encode())
    fixed = MAGIC + struct.pack("<BBHI", VERSION, int(ckpt.keyframe), 0, len(hz))
    body = fixed + hz + b"".join(w.parts)
    return body + struct.pack("<Q", xxhash.xxh64_intdigest(body))


def _range(data: memoryview, spec: Any, what: str) -> bytes:
    if (not isinstance(spec, list) or len(spec) != 2
            or not all(isinstance(v, int) and v >= 0 for v in spec)
            or spec[0] + spec[1] > len(data)):
        raise InvalidFormat(f"MLDC range for {what} is invalid: {spec!r}")
    return bytes(data[spec[0] : spec[0] + spec[1]])


def _dtype(name: Any, what: str) -> torch.dtype:
    if name not in _DTYPES:
        raise InvalidFormat(f"MLDC dtype {name!r} of {what} is not allowed")
    return _DTYPES[name]


def _shape(spec: Any, what: str) -> tuple[int, ...]:
    if not isinstance(spec, list) or not all(isinstance(d, int) and d >= 0 for d in spec):
        raise InvalidFormat(f"MLDC shape of {what} is invalid: {spec!r}")
    return tuple(spec)


def _quantized(v: dict[str, Any], data: memoryview, name: str) -> QuantizedTensor:
    shape, block = _shape(v["shape"], name), v["block_size"]
    if not isinstance(block, int) or block < 1:
        raise InvalidFormat(f"MLDC block size of {name} is invalid")
    nblocks = -(-math.prod(shape) // block)
    bits = np.frombuffer(_range(data, v["bits"], name), dtype=np.uint8).copy()
    mins = np.frombuffer(_range(data, v["mins"], name), dtype="<f4").astype(np.float32)
    scales = np.frombuffer(_range(data, v["scales"], name), dtype="<f4").astype(np.float32)
    if not len(bits) == len(mins) == len(scales) == nblocks:
        raise InvalidFormat(f"MLDC block records of {name} do not match its shape")
    bound = v["bound"]
    return QuantizedTensor(shape, _dtype(v["dtype"], name), block, bits, mins, scales,
                           _range(data, v["payload"], name), float(v["max_abs_error"]),
                           math.inf if bound is None else float(bound))


def checkpoint_from_bytes(blob: bytes) -> LossyCheckpoint:
    """Parse an MLDC v1 blob back into a :class:`LossyCheckpoint` (validated, never trusted)."""
    view = memoryview(blob)
    if len(view) < 20 or bytes(view[:4]) != MAGIC:
        raise InvalidFormat("not an MLDC lossy delta checkpoint (magic or length)")
    version, flags, reserved, hlen = struct.unpack_from("<BBHI", view, 4)
    if version != VERSION:
        raise UnknownFormatVersion(f"MLDC version {version} is not known (reader knows 1)")
    (want,) = struct.unpack_from("<Q", view, len(view) - 8)
    got = xxhash.xxh64_intdigest(view[:-8])
    if got != want:
        raise ChecksumMismatch("MLDC lossy delta checkpoint (xxh64)", want, got)
    view = view[:-8]
    if flags & ~1 or reserved or hlen > min(_MAX_HEADER, len(view) - 12):
        raise InvalidFormat("MLDC flags/reserved/header length are invalid")
    try:
        raw = zstandard.ZstdDecompressor().decompress(bytes(view[12 : 12 + hlen]),
                                                      max_output_size=_MAX_HEADER)
        header = json.loads(raw)
        data = view[12 + hlen :]
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                  for k, v in header["config"].items()}
        config = LossyDeltaConfig(**fields)
        ckpt = LossyCheckpoint(index=int(header["index"]), keyframe=bool(flags & 1),
                               config=config, raw_bytes=int(header["raw_bytes"]))
        for key, (kept, off, size) in header["masks"].items():
            ckpt.masks[key] = (int(kept), _range(data, [off, size], f"mask {key}"))
        for name, r in header["records"].items():
            rec = TensorRecord(r["kind"], _shape(r["shape"], name), _dtype(r["dtype"], name),
                               blob=_range(data, r["blob"], name), ref=r["ref"],
                               mask_key=r["mask_key"], domain=r["domain"])
            if rec.kind not in ("lossless", "delta") or rec.ref not in ("prev", "zero") or \
                    rec.domain not in ("linear", "log2"):
                raise InvalidFormat(f"MLDC record of {name} has unknown kind/ref/domain")
            if "row_shift" in r:
                shift = np.frombuffer(_range(data, r["row_shift"], name), dtype="<f2")
                rec.row_shift = torch.from_numpy(shift.astype(np.float16))
            if "values" in r:
                rec.values = _quantized(r["values"], data, name)
            ckpt.records[name] = rec
    except InvalidFormat:
        raise
    except (zstandard.ZstdError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidFormat(f"MLDC header is malformed: {exc!r}") from exc
    return ckpt
