"""Safetensors files in and out: any ``.safetensors`` -> MCKP blob, and tensors -> ``.safetensors``.

Why a module of its own: Hugging Face checkpoints arrive as safetensors, and users want them
back as safetensors (``safe_open`` readable) after a compressed round trip. The MCKP blob keeps
the file's tensor order and its ``__metadata__`` strings (under :data:`ST_METADATA_KEY`), so
``decompress`` reproduces an equivalent file: same names, dtypes, shapes, bytes and metadata.
Files are written atomically (:mod:`mithril_async.storage.atomic`: temp file in the same
folder, fsync, rename, folder fsync) so a crash never leaves a half-written output where the
real one should be.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mithril_async.codec.chunk import CodecParams
from mithril_async.codec.state_dict import compress_state_dict, decompress_state_dict, read_info
from mithril_async.errors import InvalidFormat, UnsupportedStateType
from mithril_async.storage.atomic import atomic_file

__all__ = [
    "ST_METADATA_KEY",
    "FileResult",
    "atomic_output",
    "compress_file",
    "decompress_file",
    "flatten_tensors",
    "read_safetensors",
    "write_safetensors",
]

#: MCKP metadata key holding the source file's ``__metadata__`` (a str -> str mapping)
ST_METADATA_KEY = "safetensors.metadata"
#: a file is written in slices of this many bytes, each reported to ``progress``
WRITE_SLICE = 16 << 20

#: ``progress(n)``: n more bytes done (see each function for which bytes)
Progress = Callable[[int], None]


@dataclass(frozen=True)
class FileResult:
    """What a file conversion did (sizes in bytes)."""

    src: str
    dst: str
    tensors: int
    raw_bytes: int
    out_bytes: int

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.out_bytes if self.out_bytes else 0.0


#: a temp file next to the output, fsynced and renamed over it (and the folder fsynced) when
#: the ``with`` block ends normally; removed, leaving the output as it was, on an exception
atomic_output = atomic_file


def read_safetensors(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor],
                                                           dict[str, str]]:
    """All tensors of a safetensors file (file order) and its ``__metadata__``."""
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
    except FileNotFoundError:
        raise
    except Exception as err:
        raise InvalidFormat(f"{path}: not a readable safetensors file ({err})") from None
    return tensors, meta


def write_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str],
                      metadata: Mapping[str, str] | None = None, *,
                      progress: Progress | None = None) -> int:
    """Write ``tensors`` as a safetensors file (atomically); return its size in bytes.
    ``progress``: the tensor bytes written (the data area, not the header), slice by slice;
    they add up to the tensors' bytes."""
    import safetensors.torch

    # shared or non-contiguous storage is refused by safetensors: give each tensor its own
    clean = {k: v.detach().cpu().contiguous().clone() if _shares(v) else
             v.detach().cpu().contiguous() for k, v in tensors.items()}
    data = safetensors.torch.save(clean, metadata=dict(metadata) if metadata else None)
    view = memoryview(data)
    head = 8 + int.from_bytes(data[:8], "little")  # the length prefix and the JSON header
    with atomic_output(path) as f:
        f.write(view[:head])
        for i in range(head, len(data), WRITE_SLICE):
            n = f.write(view[i:i + WRITE_SLICE])
            if progress is not None:
                progress(n)
    return len(data)


def _shares(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() != t.numel() * t.element_size()


def flatten_tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a state tree as ``{"a.b.0": tensor}`` (a flat state dict unchanged).

    Non-tensor leaves are dropped (safetensors holds tensors only); callers that need them
    write ``.pt`` instead.
    """
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, torch.Tensor):
        if not prefix:
            raise UnsupportedStateType("a bare tensor needs a name to be stored")
        out[prefix] = tree
    elif isinstance(tree, Mapping):
        for k, v in tree.items():
            out.update(flatten_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(flatten_tensors(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def compress_file(src: str | os.PathLike[str], dst: str | os.PathLike[str] | None = None, *,
                  level: int = 3, threads: int | None = None,
                  progress: Progress | None = None) -> FileResult:
    """Compress a ``.safetensors`` (or a ``.pt`` holding a state dict) into an MCKP blob.
    ``progress``: the raw tensor bytes compressed, chunk by chunk (they add up to
    ``raw_bytes``)."""
    src_p = Path(src)
    if not src_p.is_file():
        raise FileNotFoundError(f"no such file: {src_p}")
    if src_p.suffix == ".safetensors":
        tensors, meta = read_safetensors(src_p)
    else:
        obj = torch.load(src_p, map_location="cpu", weights_only=True)
        tensors, meta = flatten_tensors(obj), {}
    dst_p = Path(dst) if dst is not None else src_p.with_suffix(".mckp")
    blob = compress_state_dict(tensors, params=CodecParams(level=level), threads=threads,
                               metadata={ST_METADATA_KEY: meta}, progress=progress)
    with atomic_output(dst_p) as f:
        f.write(blob)
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    return FileResult(str(src_p), str(dst_p), len(tensors), raw, len(blob))


def decompress_file(src: str | os.PathLike[str], dst: str | os.PathLike[str] | None = None, *,
                    threads: int | None = None, progress: Progress | None = None) -> FileResult:
    """Decode an MCKP blob into ``dst`` (``.safetensors``, the default, or ``.pt``).
    ``progress``: the raw bytes decoded, chunk by chunk, then for ``.safetensors`` the tensor
    bytes written (:func:`write_output`): twice the blob's raw bytes in all (once for
    ``.pt``)."""
    src_p = Path(src)
    blob = src_p.read_bytes()
    info = read_info(blob)
    tensors = decompress_state_dict(blob, threads=threads, progress=progress)
    dst_p = Path(dst) if dst is not None else src_p.with_suffix(".safetensors")
    meta = info.metadata.get(ST_METADATA_KEY) or {}
    if not isinstance(meta, dict):
        raise InvalidFormat(f"{src_p}: malformed {ST_METADATA_KEY}")
    size = write_output(tensors, dst_p, {str(k): str(v) for k, v in meta.items()},
                        progress=progress)
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    return FileResult(str(src_p), str(dst_p), len(tensors), raw, size)


def write_output(tree: Any, dst: str | os.PathLike[str],
                 metadata: Mapping[str, str] | None = None, *,
                 progress: Progress | None = None) -> int:
    """Write a state tree as ``.safetensors`` (tensors only) or ``.pt``; return bytes written.
    ``progress``: as :func:`write_safetensors` (``torch.save`` of a ``.pt`` reports nothing)."""
    dst_p = Path(dst)
    if dst_p.suffix == ".safetensors":
        return write_safetensors(flatten_tensors(tree), dst_p, metadata, progress=progress)
    if dst_p.suffix in (".pt", ".pth", ".bin"):
        with atomic_output(dst_p) as f:
            torch.save(tree, f)
        return dst_p.stat().st_size
    raise InvalidFormat(f"{dst_p}: output must end in .safetensors or .pt")


def describe_safetensors(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Header of a safetensors file (names, dtypes, shapes, sizes) without loading tensors."""
    p = Path(path)
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InvalidFormat(f"{p}: too short for a safetensors file")
        n = int.from_bytes(head, "little")
        if n > 100 << 20 or n > p.stat().st_size - 8:
            raise InvalidFormat(f"{p}: implausible safetensors header length {n}")
        try:
            header = json.loads(f.read(n))
        except ValueError as err:
            raise InvalidFormat(f"{p}: safetensors header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise InvalidFormat(f"{p}: safetensors header is not an object")
    meta = header.pop("__metadata__", {}) or {}
    tensors = [{"name": k, "dtype": v.get("dtype"), "shape": v.get("shape"),
                "bytes": v["data_offsets"][1] - v["data_offsets"][0]}
               for k, v in header.items() if isinstance(v, dict) and "data_offsets" in v]
    return {"file": str(p), "format": "safetensors", "bytes": p.stat().st_size,
            "metadata": meta, "tensors": tensors}
