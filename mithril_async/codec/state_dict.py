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

import bisect
import os
import threading
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import cffi
import numpy as np
import torch
import xxhash

from mithril_async.codec.chunk import (
    BATCH_CHUNK_BYTES,
    CodecParams,
    EncodedChunk,
    decode_chunk,
    encode_chunk,
    encode_chunks,
)
from mithril_async.codec.container import BlockRef, MckpInfo, MckpWriter, TensorEntry
from mithril_async.codec.container_read import block_from_bytes, parse_blob
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
    params: CodecParams | None = None, progress: Callable[[int], None] | None = None,
) -> bytes:
    """Compress a flat ``{name: tensor | ndarray}`` mapping into one MCKP blob (lossless).

    ``previous``: tensors present in both with the same dtype and shape are XOR-delta coded
    against it (the blob records each base's xxh64, so decoding against the wrong base fails
    loudly).  Inputs are never mutated.  ``params`` overrides level/byte_grouping/chunk_bytes.
    ``progress(n)``: called with each chunk's raw byte count once its block is in the blob (on
    whichever thread appends it; the calls add up to the state's raw bytes).

    How the threads are used (what the calling thread does alone caps the speed-up of more
    cores): each tensor's chunks go to the pool as soon as that tensor is looked at,
    so coding starts with the first one while this thread looks at the rest and makes the
    header; each finished block is appended to the blob (block header, index entry, the
    running whole-blob hash) in order by whichever pool thread finishes the chunk that is
    next in line (:class:`_Coder`), not by this thread after it; the blob is then copied
    together by every thread at once, each into its own range of the result
    (:func:`_gather`), instead of one ``b"".join`` on this thread.
    """
    p = params or CodecParams(level=level, byte_grouping=byte_grouping, chunk_bytes=chunk_bytes)
    entries: list[TensorEntry] = []
    views: list[tuple[U8, U8 | None, str]] = []

    def chunk(ti: int, ci: int) -> tuple[U8, str, U8 | None]:
        raw, base, dname = views[ti]
        off, ln = entries[ti].chunks[ci]
        return raw[off:off + ln], dname, None if base is None else base[off:off + ln]

    def work(job: list[tuple[int, int]]) -> Any:
        if len(job) == 1:
            return [encode_chunk(*chunk(*job[0]), p)]
        return encode_chunks([chunk(ti, ci) for ti, ci in job], p)

    parts: list[Any] = []
    writer: MckpWriter | None = None

    def sink(job: list[tuple[int, int]], encs: list[EncodedChunk]) -> None:
        assert writer is not None
        for (ti, ci), enc in zip(job, encs, strict=True):
            parts.extend(writer.add_parts(ti, ci, enc))
            if progress is not None:
                progress(entries[ti].chunks[ci][1])

    n = default_threads() if threads is None else max(1, threads)
    coder = _Coder(work, sink, n)
    try:
        # small chunks travel in batches (one pool task, one native call each: encode_chunks)
        job: list[tuple[int, int]] = []
        batch_bytes = 0
        for name, value in state_dict.items():
            ti = len(entries)
            entry, view = _tensor_entry(name, value, previous, p)
            entries.append(entry)
            views.append(view)
            for ci, (_, ln) in enumerate(entries[ti].chunks):
                if job and (ln > BATCH_CHUNK_BYTES
                            or batch_bytes + ln > 16 * BATCH_CHUNK_BYTES):
                    coder.submit(job)
                    job = []
                    batch_bytes = 0
                job.append((ti, ci))
                batch_bytes += ln if ln <= BATCH_CHUNK_BYTES else 16 * BATCH_CHUNK_BYTES
        coder.submit(job)
        writer = MckpWriter(entries, params=p, previous_checkpoint_hash=previous_checkpoint_hash,
                            training_step=step, metadata=metadata)
        parts.append(writer.begin())
        coder.run()  # every block appended, in order
        parts.append(writer.finish())
        return _gather(parts, writer.size, coder.pool, n)
    finally:
        coder.close()



def _tensor_entry(name: str, value: Tensorish, previous: Mapping[str, Tensorish] | None,
                  p: CodecParams) -> tuple[TensorEntry, tuple[U8, U8 | None, str]]:
    """One tensor's index entry and ``(bytes, delta base's bytes or None, dtype name)``: the
    base is ``previous[name]`` where it has the same dtype and shape."""
    raw, dname, shape = tensor_bytes(value, where=name)
    base: U8 | None = None
    if previous is not None and name in previous:
        b, bname, bshape = tensor_bytes(previous[name], where=f"previous {name}")
        if bname == dname and bshape == shape and b.size:
            base = b
    extra = {"numpy": True} if isinstance(value, np.ndarray) else None
    entry = TensorEntry.make(name, dname, shape, p.chunk_bytes,
                             xxhash.xxh64_intdigest(base.data) if base is not None else None,
                             extra)
    return entry, (raw, base, dname)

class _Coder:
    """Runs ``work(job)`` for each submitted job and ``sink(job, result)`` for each, in
    submission order.

    With one thread (or a single job) both run on the calling thread, in :meth:`run`.  Else
    the jobs go to a pool of ``threads`` threads as they are submitted (from the second job
    on), and the in-order sink runs on whichever pool thread finishes the job that is next
    in line, which then sinks every later job already finished (one thread at a time holds
    that duty: ``_draining``).  Why: the sink (appending blocks to the blob: headers, index,
    the whole-blob hash) is in order by nature; run on the calling thread it is a third
    thread competing for the cores, and whatever it has not caught up with when the last
    chunk is coded is left to do alone.  :meth:`run` opens the sink (until then finished jobs
    wait: the blob's header must come first) and returns when every job is sunk.
    """

    def __init__(self, work: Callable[[list[tuple[int, int]]], Any],
                 sink: Callable[[list[tuple[int, int]], Any], None], threads: int) -> None:
        self.work = work
        self.sink = sink
        self.threads = threads
        self.pool: ThreadPoolExecutor | None = None
        self._held: list[list[tuple[int, int]]] = []  # not yet on the pool
        self._futures: list[Future[None]] = []
        self._lock = threading.Lock()
        self._done: dict[int, tuple[list[tuple[int, int]], Any]] = {}  # finished, not sunk
        self._next = 0  # the job to sink next
        self._open = False  # whether the sink may run
        self._draining = False  # whether a thread is sinking now

    def submit(self, job: list[tuple[int, int]]) -> None:
        if not job:
            return
        self._held.append(job)
        if self.threads > 1 and (self.pool is not None or len(self._held) > 1):
            if self.pool is None:
                self.pool = ThreadPoolExecutor(max_workers=self.threads)
            for j in self._held:
                self._futures.append(self.pool.submit(self._task, len(self._futures), j))
            self._held.clear()

    def _task(self, k: int, job: list[tuple[int, int]]) -> None:
        result = self.work(job)
        with self._lock:
            self._done[k] = (job, result)
            if self._draining or not self._open:
                return  # the thread sinking now sees it before it stops
            self._draining = True
        self._drain()

    def _drain(self) -> None:
        """Sink finished jobs in order until the next one is not finished (this thread holds
        the sink duty; a failure closes the sink, and the error comes out of :meth:`run`)."""
        while True:
            with self._lock:
                item = self._done.pop(self._next, None)
                if item is None:
                    self._draining = False
                    return
                self._next += 1
            try:
                self.sink(*item)
            except BaseException:
                with self._lock:
                    self._open = self._draining = False
                raise

    def run(self) -> None:
        if self.pool is None:  # one thread (or a single job): all of it here, lazily
            for job in self._held:
                self.sink(job, self.work(job))
            return
        with self._lock:
            self._open = True
            start = not self._draining
            self._draining = True
        if start:
            self._drain()  # what finished while the header was being made
        for f in self._futures:  # a job's thread sinks what it can before its future is done
            f.result()
        if self._next != len(self._futures):  # pragma: no cover - a broken invariant
            raise RuntimeError(f"{len(self._futures) - self._next} coded chunks never sunk")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


#: 2 MiB: results this big are backed by transparent huge pages where the kernel has them
_HUGE = 1 << 21


def _new_bytes(n: int) -> tuple[bytes, U8] | None:
    """A new ``bytes`` object of ``n`` (not yet written) bytes and a writable view of them, or
    None where the C API is out of reach (not CPython).

    Why: the blob is returned as ``bytes``, and ``b"".join`` of its parts is one serial copy
    after all coding is done, most of it the page faults of the fresh output (several times
    a copy into touched memory, and a large share of a one-thread compress of fp32
    weights).  Filling a new object lets every thread copy its
    own range at once, and the object's memory is asked for huge pages (as numpy asks for its
    large arrays: one fault per 2 MiB instead of per 4 KiB).  This is how C code builds a
    bytes object: ``PyBytes_FromStringAndSize(NULL, n)``, then writing through
    ``PyBytes_AsString``, which the C API documents as allowed for an object just made that
    way; nothing else sees it until it is returned, filled.
    """
    if _BYTES_API is None or n <= 0:
        return None
    new, at, madvise = _BYTES_API
    out = new(None, n)
    addr = at(out)
    if madvise is not None and n >= 2 * _HUGE:
        lo, hi = -(-addr // _HUGE) * _HUGE, (addr + n) // _HUGE * _HUGE
        madvise(lo, hi - lo, 14)  # MADV_HUGEPAGE; a kernel without THP refuses: no matter
    view = np.frombuffer(_ffi.buffer(_ffi.cast("char *", addr), n), np.uint8)
    return out, view


def _bytes_api() -> tuple[Any, Any, Any] | None:
    try:
        import ctypes
        import sys

        api = ctypes.pythonapi  # the running interpreter's C API, called with the GIL held
        new = api.PyBytes_FromStringAndSize
        new.restype, new.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)
        at = api.PyBytes_AsString
        at.restype, at.argtypes = ctypes.c_void_p, (ctypes.py_object,)
        madvise = None
        if sys.platform.startswith("linux"):
            madvise = ctypes.CDLL(None).madvise
            madvise.restype = ctypes.c_int
            madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (ImportError, AttributeError, OSError):  # pragma: no cover - not CPython
        return None
    return new, at, madvise


_BYTES_API = _bytes_api()
_ffi = cffi.FFI()


def _copy_parts(dst: U8, parts: list[Any], starts: list[int], lo: int, hi: int) -> None:
    """Bytes ``[lo, hi)`` of the concatenation of ``parts`` (part ``i`` at ``starts[i]``) into
    ``dst[lo:hi]`` (numpy copies release the GIL).  A part wholly inside the range is then
    dropped from ``parts`` (set to None): the coders' buffers are freed by the threads that
    copy them, not all at once by the calling thread afterwards."""
    i = bisect.bisect_right(starts, lo) - 1
    while i < len(parts) and starts[i] < hi:
        s = starts[i]
        part = np.frombuffer(parts[i], np.uint8)
        a, b = max(lo, s), min(hi, s + part.size)
        if b > a:
            dst[a:b] = part[a - s:b - s]
        if s >= lo and s + part.size <= hi:
            del part
            parts[i] = None
        i += 1


def _gather(parts: list[Any], total: int, pool: ThreadPoolExecutor | None, n: int) -> bytes:
    """``b"".join(parts)`` (``total`` bytes), copied by ``n`` threads (the calling one and
    ``pool``'s), each into its own range of the result; ``parts`` is emptied on the way (each
    part dropped once copied)."""
    made = _new_bytes(total)
    if made is None:
        return b"".join(parts)
    if pool is None:
        n = 1
    out, dst = made
    starts: list[int] = []
    pos = 0
    for part in parts:
        starts.append(pos)
        pos += memoryview(part).nbytes
    if pos != total:  # pragma: no cover - the writer counted what it emitted
        raise AssertionError(f"blob parts hold {pos} bytes, the writer counted {total}")
    cuts = [total * k // n for k in range(n + 1)]
    futs = [pool.submit(_copy_parts, dst, parts, starts, cuts[k], cuts[k + 1])
            for k in range(1, n)] if pool is not None else []
    try:
        _copy_parts(dst, parts, starts, cuts[0], cuts[1] if futs else total)
    finally:  # no thread may still write into ``out`` once this returns or raises
        wait(futs)
    for f in futs:
        f.result()
    del dst
    return out


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
    only: Collection[str] | None = None, progress: Callable[[int], None] | None = None,
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
    ``progress``: as :func:`decode_tensors`.
    """
    info = parse_blob(blob, verify=verify)
    mv = memoryview(blob).cast("B")
    return decode_tensors(info, lambda r: mv[r.offset:r.offset + r.length], previous=previous,
                          threads=threads, as_numpy=as_numpy, only=only, verify_payload=False,
                          progress=progress)


def decode_tensors(
    info: MckpInfo, block_bytes: Callable[[BlockRef], bytes | memoryview], *,
    previous: Mapping[str, Tensorish] | None = None, threads: int | None = None,
    as_numpy: bool = False, only: Collection[str] | None = None, verify_payload: bool = True,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Decode the tensors of a parsed blob whose blocks ``block_bytes(ref)`` supplies.

    The core of :func:`decompress_state_dict`, for readers that hold only some of a blob's
    bytes (ranged reads of the blocks ``only`` needs); ``verify_payload`` checks each block's
    payload hash (needed when no hash over the whole blob was checked). ``progress(n)``:
    called with each decoded chunk's raw byte count, on the decoding threads (the calls add up
    to the raw bytes of the tensors decoded).
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
        if progress is not None:
            progress(ln)

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
