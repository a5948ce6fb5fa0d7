"""A streaming (sans-IO) safetensors writer, for blobs stored without compression.

The safetensors layout is: u64 little-endian header length, a JSON header mapping each tensor
name to ``{dtype, shape, data_offsets}`` (plus ``__metadata__`` of string values), then the raw
bytes. Offsets are known from shapes alone, so the header can be emitted first and the tensor
bytes streamed after it; the file is readable by ``safetensors.safe_open``.
"""

from __future__ import annotations

import json
import struct

import torch

from mithril_async.errors import UnsupportedDtype

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}


def safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The header bytes (length prefix + JSON, padded to 8 bytes) for ``tensors`` in order."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        code = SAFETENSORS_DTYPES.get(t.dtype)
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
