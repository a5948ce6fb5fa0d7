"""Safetensors headers, sans IO: written for blobs stored without compression, and parsed
(checked) for reading them back.

The safetensors layout is: u64 little-endian header length, a JSON header mapping each tensor
name to ``{dtype, shape, data_offsets}`` (plus ``__metadata__`` of string values), then the raw
bytes. Offsets are known from shapes alone, so the header can be emitted first and the tensor
bytes streamed after it; the file is readable by ``safetensors.safe_open``.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from typing import TYPE_CHECKING, Any, NamedTuple

from mithril_async.codec.dtypes import dtype_info, dtype_name
from mithril_async.errors import InvalidFormat, UnsupportedDtype

if TYPE_CHECKING:
    import torch

    from mithril_async.codec.dtypes import RawTensor

#: the codec's dtype names -> safetensors dtype codes (the dtypes safetensors holds)
SAFETENSORS_CODES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "uint16": "U16", "uint32": "U32", "uint64": "U64",
}


def safetensors_header(tensors: dict[str, torch.Tensor] | dict[str, RawTensor],
                       metadata: dict[str, str]) -> bytes:
    """The header bytes (length prefix + JSON, padded to 8 bytes) for ``tensors`` in order."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        code = SAFETENSORS_CODES.get(dtype_name(t, where=f"tensor {name!r}"))
        if code is None:
            raise UnsupportedDtype(
                f"tensor {name!r}: dtype {t.dtype} cannot be stored uncompressed as safetensors; "
                "enable [checkpointing.compression]"
            )
        n = t.numel() * t.element_size()
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


#: safetensors dtype codes -> the codec's dtype names (torch's, without ``torch.``)
DTYPE_NAMES = {code: name for name, code in SAFETENSORS_CODES.items()}
#: the largest header a reader accepts
MAX_HEADER = 64 << 20


class Entry(NamedTuple):
    """One tensor of a safetensors file: its place in the data area is ``[begin, end)``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def header_length(prefix: bytes, size: int, where: str) -> int:
    """The JSON header's length from a file's first 8 bytes, checked to fit a file of
    ``size`` bytes and :data:`MAX_HEADER`."""
    hlen = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    if not 0 <= hlen <= min(size - 8, MAX_HEADER):
        raise InvalidFormat(f"{where}: safetensors header length {hlen} does not fit")
    return hlen


def parse_header(raw: bytes, data_len: int, where: str) -> tuple[list[Entry], dict[str, Any]]:
    """The tensors of a safetensors header (sorted by place), each checked (known dtype, size
    = elements x width, inside a data area of ``data_len`` bytes, no two overlapping), and its
    ``__metadata__``."""
    try:
        header = json.loads(raw)
    except ValueError as err:
        raise InvalidFormat(f"{where}: safetensors header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise InvalidFormat(f"{where}: safetensors header is not a JSON object")
    out = []
    for name, e in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPE_NAMES[e["dtype"]]
            shape = tuple(int(x) for x in e["shape"])
            b, end = (int(x) for x in e["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise InvalidFormat(f"{where}: malformed safetensors entry {name!r} ({err})") from None
        width = dtype_info(dtype).itemsize
        if any(x < 0 for x in shape) or not 0 <= b <= end <= data_len \
                or end - b != width * math.prod(shape):
            raise InvalidFormat(f"{where}: safetensors entry {name!r} does not fit its data")
        out.append(Entry(name, dtype, shape, b, end))
    out.sort(key=lambda x: x.begin)
    for e1, e2 in itertools.pairwise(out):
        if e2.begin < e1.end:
            raise InvalidFormat(f"{where}: safetensors entries {e1.name!r} and {e2.name!r} "
                                "overlap")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise InvalidFormat(f"{where}: safetensors __metadata__ is not a JSON object")
    return out, meta
