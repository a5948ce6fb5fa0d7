"""Whole state dicts <-> one MCKP blob, chunks coded in parallel on a thread pool.

This is the synchronous, in-memory face of the codec (the ``compress``/``decompress``
pair).  The async manager drives the same pieces itself (``encode_chunk`` on its own pool,
``MckpWriter`` streaming to a store); this module shows the intended composition.

Numpy inputs: decompression returns torch tensors for every entry unless ``as_numpy=True`` is
given, in which case entries that were numpy arrays come back as numpy arrays (the header
records ``{"numpy": true}`` per such tensor).  Dtypes numpy lacks (bfloat16, float8) are
always torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import xxhash

from mithril_async.codec.chunk import (
    BATCH_CHUNK_BYTES,
    CodecParams,
    decode_chunk,
    encode_chunk,
    encode_chunks,
)
from mithril_async.codec.container import (
    BlockRef,
    MckpInfo,
    MckpWriter,
    TensorEntry,
    block_from_bytes,
    parse_blob,
)
from mithril_async.codec.dtypes import dtype_info, tensor_bytes, tensor_from_bytes
from mithril_async.errors import MissingPrevious

__all__ = ["compress_state_dict", "decode_tensors", "decompress_state_dict", "default_threads",
           "read_info"]

U8 = np.ndarray[Any, np.dtype[np.uint8]]
Tensorish = torch.Tensor | np.ndarray[Any, Any]


def default_threads() -> int:
    """Worker threads for chunk coding: the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def _map(fn: Any, items: list[Any], threads: int | None) -> list[Any]:
    out: list[Any] = []
    _each(fn, items, threads, out.append)
    return out


def _each(fn: Any, items: list[Any], threads: int | None, sink: Any) -> None:
    """``sink(fn(item))`` for every item, in order, with ``fn`` on up to ``threads`` threads.

    ``sink`` runs on the calling thread while later items are still being worked on, so
    assembling the output overlaps with the coding.
    """
    n = default_threads() if threads is None else max(1, threads)
    if n == 1 or len(items) <= 1:
        for i in items:
            sink(fn(i))
        return
    with ThreadPoolExecutor(max_workers=min(n, len(items))) as ex:
        for result in ex.map(fn, items):
            sink(result)


def compress_state_dict(
    state_dict: Mapping[str, Tensorish], *, previous: Mapping[str, Tensorish] | None = None,
    level: int = 3, byte_grouping: bool = True, threads: int | None = None,
    chunk_bytes: int = CodecParams.chunk_bytes, step: int | None = None,
    metadata: dict[str, Any] | None = None, previous_checkpoint_hash: str | None = None,
    params: CodecParams | None = None,
) -> bytes:
    """Compress a flat ``{name: tensor | ndarray}`` mapping into one MCKP blob (lossless).

    ``previous``: tensors present in both with the same dtype and shape are XOR-delta coded
    against it (the blob records each base's xxh64, so decoding against the wrong base fails
    loudly).  Inputs are never mutated.  ``params`` overrides level/byte_grouping/chunk_bytes.
    """
    p = params or CodecParams(level=level, byte_grouping=byte_grouping, chunk_bytes=chunk_bytes)
    entries: list[TensorEntry] = []
    views: list[tuple[U8, U8 | None, str]] = []
    for name, value in state_dict.items():
        raw, dname, shape = tensor_bytes(value, where=name)
        base: U8 | None = None
        if previous is not None and name in previous:
            b, bname, bshape = tensor_bytes(previous[name], where=f"previous {name}")
            if bname == dname and bshape == shape and b.size:
                base = b
        extra = {"numpy": True} if isinstance(value, np.ndarray) else None
        entries.append(TensorEntry.make(
            name, dname, shape, p.chunk_bytes,
            xxhash.xxh64_intdigest(base.data) if base is not None else None, extra))
        views.append((raw, base, dname))
    writer = MckpWriter(entries, params=p, previous_checkpoint_hash=previous_checkpoint_hash,
                        training_step=step, metadata=metadata)
    # small chunks travel in batches (one pool task, one native call each: encode_chunks)
    jobs: list[list[tuple[int, int]]] = []
    batch_bytes = BATCH_CHUNK_BYTES
    for ti, e in enumerate(entries):
        for ci, (_, ln) in enumerate(e.chunks):
            if ln > BATCH_CHUNK_BYTES or not jobs or batch_bytes + ln > 16 * BATCH_CHUNK_BYTES:
                jobs.append([])
                batch_bytes = 0
            jobs[-1].append((ti, ci))
            batch_bytes += ln if ln <= BATCH_CHUNK_BYTES else 16 * BATCH_CHUNK_BYTES

    def chunk(ti: int, ci: int) -> tuple[U8, str, U8 | None]:
        raw, base, dname = views[ti]
        off, ln = entries[ti].chunks[ci]
        return raw[off:off + ln], dname, None if base is None else base[off:off + ln]

    def work(job: list[tuple[int, int]]) -> Any:
        if len(job) == 1:
            return [encode_chunk(*chunk(*job[0]), p)]
        return encode_chunks([chunk(ti, ci) for ti, ci in job], p)

    parts: list[Any] = [writer.begin()]
    order = iter([j for job in jobs for j in job])

    def add(encs: Any) -> None:
        for enc in encs:
            ti, ci = next(order)
            parts.extend(writer.add_parts(ti, ci, enc))

    _each(work, jobs, threads, add)
    parts.append(writer.finish())
    return b"".join(parts)


def read_info(blob: bytes | bytearray | memoryview, *, verify: bool = True) -> MckpInfo:
    """Header and index of a blob (validated; see :func:`~.container.parse_blob`)."""
    return parse_blob(blob, verify=verify)


def _base_for(info: MckpInfo, ti: int, previous: Mapping[str, Tensorish] | None) -> U8 | None:
    t = info.tensors[ti]
    if t.base_xxh64 is None:
        return None
    if previous is None or t.name not in previous:
        raise MissingPrevious(f"tensor {t.name!r} is a delta against a previous checkpoint "
                              "that was not given")
    b, bname, bshape = tensor_bytes(previous[t.name], where=f"previous {t.name}")
    if bname != t.dtype or bshape != t.shape or xxhash.xxh64_intdigest(b.data) != t.base_xxh64:
        raise MissingPrevious(f"tensor {t.name!r}: the given previous tensor is not the base "
                              "it was delta-coded against (dtype, shape or xxh64 differ)")
    return b


def decompress_state_dict(
    blob: bytes | bytearray | memoryview, *, previous: Mapping[str, Tensorish] | None = None,
    threads: int | None = None, as_numpy: bool = False, verify: bool = True,
    only: Collection[str] | None = None,
) -> dict[str, Any]:
    """Decode a blob made by :func:`compress_state_dict` into ``{name: torch.Tensor}``.

    ``only``: decode just these tensors (names the blob lacks are ignored); a delta chain's
    restore asks a base for the tensors its deltas need, not the whole base.

    Raises ``MissingPrevious`` (naming the tensor) when a delta's base is absent or wrong,
    ``ChecksumMismatch``/``InvalidFormat`` (naming the block) on any corruption.

    ``verify``: check the whole-blob xxh64 first (a flip anywhere is a ``ChecksumMismatch``
    before any decoding); pass ``False`` only after checking a hash of the whole blob yourself
    (the manager checks the manifest's).  Block payloads are not hashed again either way (the
    whole-blob hash covers them); every decoded chunk is still checked against its raw xxh64,
    and the decoders reject malformed planes, so no setting returns wrong bytes.
    """
    info = parse_blob(blob, verify=verify)
    mv = memoryview(blob).cast("B")
    return decode_tensors(info, lambda r: mv[r.offset:r.offset + r.length], previous=previous,
                          threads=threads, as_numpy=as_numpy, only=only, verify_payload=False)


def decode_tensors(
    info: MckpInfo, block_bytes: Callable[[BlockRef], bytes | memoryview], *,
    previous: Mapping[str, Tensorish] | None = None, threads: int | None = None,
    as_numpy: bool = False, only: Collection[str] | None = None, verify_payload: bool = True,
) -> dict[str, Any]:
    """Decode the tensors of a parsed blob whose blocks ``block_bytes(ref)`` supplies.

    The core of :func:`decompress_state_dict`, for readers that hold only some of a blob's
    bytes (ranged reads of the blocks ``only`` needs); ``verify_payload`` checks each block's
    payload hash (needed when no hash over the whole blob was checked).
    """
    wanted = [only is None or t.name in only for t in info.tensors]
    bases = [_base_for(info, ti, previous) if wanted[ti] else None
             for ti in range(len(info.tensors))]
    outs = [np.empty(t.nbytes if wanted[ti] else 0, np.uint8)
            for ti, t in enumerate(info.tensors)]
    jobs = sorted((r for r in info.index.values() if wanted[r.tensor]), key=lambda r: r.offset)

    def work(ref: Any) -> None:
        meta, payload = block_from_bytes(block_bytes(ref), ref, info,
                                         verify_payload=verify_payload)
        off, ln = info.tensors[ref.tensor].chunks[ref.chunk]
        base = bases[ref.tensor]
        decode_chunk(payload, meta, None if base is None else base[off:off + ln],
                     outs[ref.tensor][off:off + ln],
                     where=info.block_name(ref.tensor, ref.chunk), verify_payload=False)

    _map(work, jobs, threads)
    result: dict[str, Any] = {}
    for t, buf, want in zip(info.tensors, outs, wanted, strict=True):
        if not want:
            continue
        ndt = dtype_info(t.dtype).numpy_dtype
        if as_numpy and t.extra.get("numpy") and ndt is not None:
            result[t.name] = buf.view(ndt).reshape(t.shape)
        else:
            result[t.name] = tensor_from_bytes(buf, t.dtype, t.shape, where=t.name)
    return result
