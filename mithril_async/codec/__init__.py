"""Lossless tensor codec and the MCKP blob format.

What the manager calls (all synchronous, thread-safe, GIL-free in their hot loops):

* :func:`tensor_bytes` / :func:`tensor_from_bytes`: tensor <-> zero-copy uint8 view.
* :func:`chunk_spans`, :func:`encode_chunk`, :func:`decode_chunk` with :class:`CodecParams`:
  one chunk at a time on a thread pool (XOR delta + byte planes + zstd/Huffman + xxh64).
* :class:`MckpWriter` (sans-IO, streaming: ``begin``/``add``/``finish`` return bytes to
  append, ``size``/``xxh64``) and the readers :func:`parse_blob`, :class:`MckpRangeReader`,
  :class:`AsyncMckpRangeReader`, :func:`block_from_bytes`.
* :func:`compress_state_dict` / :func:`decompress_state_dict`: the whole thing in memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mithril_async.codec import rans
from mithril_async.codec.chunk import (
    ChunkMeta,
    CodecParams,
    EncodedChunk,
    chunk_spans,
    decode_chunk,
    encode_chunk,
)
from mithril_async.codec.container import BlockRef, MckpInfo, MckpWriter, TensorEntry
from mithril_async.codec.container_read import (
    AsyncMckpRangeReader,
    MckpRangeReader,
    block_from_bytes,
    parse_blob,
)
from mithril_async.codec.dtypes import (
    DTYPES,
    dtype_info,
    dtype_name,
    tensor_bytes,
    tensor_from_bytes,
)

if TYPE_CHECKING:
    from mithril_async.codec.state_dict import (
        compress_state_dict,
        decompress_state_dict,
        default_threads,
        read_info,
    )

#: imported on first use: the whole-state functions build torch tensors, the rest of the
#: codec works on bytes (the checkpoint worker imports it without torch)
_STATE_DICT_NAMES = frozenset({"compress_state_dict", "decompress_state_dict",
                               "default_threads", "read_info"})

__all__ = [
    "DTYPES",
    "AsyncMckpRangeReader",
    "BlockRef",
    "ChunkMeta",
    "CodecParams",
    "EncodedChunk",
    "MckpInfo",
    "MckpRangeReader",
    "MckpWriter",
    "TensorEntry",
    "block_from_bytes",
    "chunk_spans",
    "compress_state_dict",
    "decode_chunk",
    "decompress_state_dict",
    "default_threads",
    "dtype_info",
    "dtype_name",
    "encode_chunk",
    "parse_blob",
    "rans",
    "read_info",
    "tensor_bytes",
    "tensor_from_bytes",
]


def __getattr__(name: str) -> Any:
    if name not in _STATE_DICT_NAMES:
        raise AttributeError(f"module 'mithril_async.codec' has no attribute {name!r}")
    from mithril_async.codec import state_dict

    value = getattr(state_dict, name)
    globals()[name] = value
    return value
