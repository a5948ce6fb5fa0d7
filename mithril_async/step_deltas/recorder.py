"""SparseDeltaRecorder: record only the changed parameters after every optimizer step.

What runs where
    :meth:`SparseDeltaRecorder.record` runs on the training thread and does only the diff:
    cast the live weights to the recorder dtype, compare bitwise with the previous snapshot
    (kept in that dtype on the parameter's device), gather the changed positions and their new
    and old values, update the snapshot and copy the small COO result to host memory. Encoding
    and the durable write happen on a :class:`~mithril_async.pipeline.loop.BackgroundLoop`
    through an async :class:`~mithril_async.storage.base.Store`; encoding of step ``n+1``
    overlaps the write of step ``n`` while the order of writes (and of ``metadata.json``
    entries) stays the order of ``record`` calls.

Memory bound and back-pressure
    At most ``max_pending`` deltas and ``max_pending_bytes`` of COO data are in flight (one
    delta is always admitted, however large). When writes fall behind, ``record`` waits for
    room (reported as ``blocked_seconds``) instead of queueing without bound. Indices are
    kept as int32 for tensors under 2**31 elements: a dense step (AdamW's first steps change
    nearly everything) costs 8 bytes per changed bf16 parameter instead of 12.

Failures
    A failed background write makes the recorder *failed*: every later delta would be relative
    to a snapshot that includes the lost step, so nothing more is written, the next
    ``record``/``flush``/``close`` raises :class:`~mithril_async.errors.SaveFailed` (cause
    attached), and ``metadata.json`` never lists a step whose file is not durable (the delta
    is written first, the metadata after it).

``metadata.json`` is rewritten atomically after deltas land (coalesced
when several are queued) and on :meth:`close`; see
:func:`~mithril_async.step_deltas.meta.build_metadata`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from mithril_async.errors import SaveFailed, StepAlreadyExists
from mithril_async.pipeline.loop import BackgroundLoop
from mithril_async.step_deltas.meta import (
    BASE_KEY_STEM,
    EXT,
    METADATA_KEY,
    StepSummary,
    build_metadata,
    delta_key,
)
from mithril_async.step_deltas.sparse import (
    SparseLayerDelta,
    bits_view,
    diff_tensor,
    encode_delta,
    tensors_to_bytes,
)


class _PutStore(Protocol):
    """The part of the Store protocol the recorder needs."""

    async def put(self, key: str, data: bytes | memoryview) -> None: ...
    async def exists(self, key: str) -> bool: ...
    async def close(self) -> None: ...


def _default_store(delta_dir: str | os.PathLike[str]) -> _PutStore:
    from mithril_async.storage.local import LocalStore

    store: _PutStore = LocalStore(os.fspath(delta_dir))
    return store


def _named_tensors(
    source: torch.nn.Module | Mapping[str, torch.Tensor], include_frozen: bool
) -> list[tuple[str, torch.Tensor]]:
    if isinstance(source, torch.nn.Module):
        items: Iterable[tuple[str, torch.Tensor]] = source.named_parameters()
    else:
        items = source.items()
    out = []
    for name, t in items:
        if not t.is_floating_point():
            continue
        if not include_frozen and not t.requires_grad:
            continue
        out.append((name, t))
    return out


class SparseDeltaRecorder:
    """Records sparse per-step deltas of a model's parameters into ``delta_dir``.

    ``model`` is a module (its ``named_parameters()``) or a name -> tensor mapping whose
    tensors are updated in place. ``dtype`` is the recorder dtype: deltas are exact in it.
    Frozen parameters are tracked too (they simply never change) unless
    ``include_frozen=False``. ``save_base`` writes the starting snapshot as ``base.*`` so
    :func:`~mithril_async.step_deltas.reconstruct.reconstruct_weights_at_step` needs no other input.
    """

    def __init__(
        self,
        model: torch.nn.Module | Mapping[str, torch.Tensor],
        delta_dir: str | os.PathLike[str],
        dtype: torch.dtype = torch.bfloat16,
        *,
        store: _PutStore | None = None,
        loop: BackgroundLoop | None = None,
        max_pending: int = 4,
        max_pending_bytes: int = 1 << 30,
        save_base: bool = True,
        include_frozen: bool = True,
        base_step: int | None = None,
        overwrite: bool = False,
    ) -> None:
        bits_view(dtype)  # refuse unsupported dtypes early
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.delta_dir = os.fspath(delta_dir)
        self.dtype = dtype
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self._own_store = store is None
        self._store: _PutStore = store if store is not None else _default_store(delta_dir)
        self._own_loop = loop is None
        self._loop = loop if loop is not None else BackgroundLoop("mithril-delta")
        self._params = _named_tensors(model, include_frozen)
        self._snap: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, t in self._params:
                self._snap[name] = t.detach().to(dtype=dtype, copy=True).contiguous()
        self.total_params = sum(s.numel() for s in self._snap.values())
        self._ext = EXT
        self._layers_meta = {
            name: {"shape": list(s.shape), "numel": s.numel()} for name, s in self._snap.items()
        }
        self._base_key = f"{BASE_KEY_STEM}{self._ext}" if save_base else None
        self.base_step = base_step

        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._pending_bytes = 0
        self._pending: set[Future[None]] = set()
        self._queued = 0
        self._error: BaseException | None = None
        self._error_reported = False
        self._closed = False
        self._last_step: int | None = None
        self._entries: list[dict[str, Any]] = []  # touched only on the loop thread
        self._meta_written = -1
        self._encode_lock: asyncio.Lock | None = None
        self._write_lock: asyncio.Lock | None = None
        self.blocked_seconds = 0.0
        self.last_record_seconds = 0.0

        if not overwrite and self._loop.run(self._store.exists(METADATA_KEY)):
            self._shutdown()
            raise StepAlreadyExists(
                f"{self.delta_dir} already holds a sparse-delta recording ({METADATA_KEY});"
                " pass overwrite=True or use a new directory"
            )
        base = (
            {n: s.detach().to("cpu", copy=True) for n, s in self._snap.items()}
            if save_base
            else None
        )
        base_bytes = sum(t.numel() * t.element_size() for t in (base or {}).values())
        self._submit(self._write_start(base), base_bytes)

    # --- public API ----------------------------------------------------------------------

    def record(self, step: int) -> StepSummary:
        """Diff the live weights against the previous snapshot and queue the sparse delta.

        Call after every ``optimizer.step()`` with strictly increasing ``step``. Returns once
        the diff is taken (the optimizer may step right after); blocks only for back-pressure.
        """
        self._check_usable()
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"steps must increase: got {step} after {self._last_step}")
        t0 = time.perf_counter()
        layers: dict[str, SparseLayerDelta] = {}
        nonzero = nbytes = 0
        sq: list[torch.Tensor] = []
        with torch.no_grad():
            for name, live in self._params:
                prev = self._snap[name]
                new = live.detach().to(device=prev.device, dtype=self.dtype)
                idx = diff_tensor(prev, new)
                if idx.numel() == 0:
                    continue
                flat_new = new.reshape(-1)
                new_vals = flat_new[idx]
                old_vals = prev.view(-1)[idx]
                prev.view(-1).index_copy_(0, idx, new_vals)
                sq.append((new_vals.double() - old_vals.double()).square().sum())
                if prev.numel() < 2**31:
                    idx = idx.to(torch.int32)
                d = SparseLayerDelta(
                    shape=tuple(prev.shape),
                    indices=idx.to("cpu"),
                    values=new_vals.to("cpu"),
                    old=old_vals.to("cpu"),
                )
                layers[name] = d
                nonzero += d.nnz
                nbytes += sum(t.numel() * t.element_size() for t in (d.indices, d.values, d.old))
        l2 = float(torch.stack([x.cpu() for x in sq]).sum()) ** 0.5 if sq else 0.0
        t1 = time.perf_counter()
        summary = StepSummary(
            step=step,
            path=delta_key(step, self._ext),
            timestamp=time.time(),
            nonzero=nonzero,
            total_params=self.total_params,
            changed_layers=len(layers),
            update_l2=l2,
            diff_seconds=t1 - t0,
            blocked_seconds=0.0,
        )
        self._last_step = step
        blocked = self._submit(self._write_step(summary, layers), nbytes)
        self.blocked_seconds += blocked
        self.last_record_seconds = time.perf_counter() - t0
        return dataclasses.replace(summary, blocked_seconds=blocked)

    def flush(self) -> None:
        """Wait until every queued delta and ``metadata.json`` are durable; raise on failure."""
        self._wait_pending()
        if not self._closed:
            try:
                self._loop.run(self._write_metadata_if_stale())
            except BaseException as e:
                self._set_error(e)
        self._raise_error()

    def close(self) -> None:
        """Flush, write the final ``metadata.json`` and release the loop/store (idempotent).

        Raises :class:`SaveFailed` if a background write failed and it was not yet reported.
        """
        if self._closed:
            return
        try:
            self._wait_pending()
            self._loop.run(self._write_metadata_if_stale())
        except BaseException as e:  # a failed final metadata write is a failure too
            self._set_error(e)
        finally:
            self._closed = True
            self._shutdown()
        if self._error is not None and not self._error_reported:
            self._raise_error()

    @property
    def failed(self) -> bool:
        return self._error is not None

    @property
    def steps_recorded(self) -> int:
        return len(self._entries)

    def __enter__(self) -> SparseDeltaRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals -----------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError(f"SparseDeltaRecorder for {self.delta_dir} is closed")
        if self._error is not None:
            self._error_reported = True
            raise SaveFailed(
                f"a background sparse-delta write to {self.delta_dir} failed; the recording"
                " stops at the last durable step"
            ) from self._error

    def _raise_error(self) -> None:
        if self._error is not None:
            self._error_reported = True
            raise SaveFailed(
                f"a background sparse-delta write to {self.delta_dir} failed"
            ) from self._error

    def _set_error(self, e: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = e

    def _full(self, nbytes: int) -> bool:
        if self._queued == 0:
            return False
        over = self._pending_bytes + nbytes > self.max_pending_bytes
        return self._queued >= self.max_pending or over

    def _submit(self, coro: Any, nbytes: int) -> float:
        """Queue ``coro`` once there is room for ``nbytes``; return seconds spent waiting."""
        t0 = time.perf_counter()
        with self._room:
            while self._full(nbytes):
                self._room.wait()
            self._queued += 1
            self._pending_bytes += nbytes
        blocked = time.perf_counter() - t0
        try:
            fut = self._loop.submit(coro)
        except BaseException:
            self._release(nbytes)
            raise
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(lambda f: self._on_done(f, nbytes))
        return blocked

    def _release(self, nbytes: int) -> None:
        with self._room:
            self._queued -= 1
            self._pending_bytes -= nbytes
            self._room.notify_all()

    def _on_done(self, fut: Future[None], nbytes: int) -> None:
        with self._lock:
            self._pending.discard(fut)
        self._release(nbytes)
        if fut.cancelled():
            self._set_error(RuntimeError("sparse-delta write was cancelled"))
            return
        err = fut.exception()
        if err is not None:
            self._set_error(err)

    def _wait_pending(self) -> None:
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                return
            for f in pending:
                try:
                    f.result()
                except BaseException as e:  # recorded by _on_done as well
                    self._set_error(e)

    def _locks(self) -> tuple[asyncio.Lock, asyncio.Lock]:
        # created lazily on the loop thread so they bind to the background loop
        if self._encode_lock is None or self._write_lock is None:
            self._encode_lock, self._write_lock = asyncio.Lock(), asyncio.Lock()
        return self._encode_lock, self._write_lock

    async def _write_start(self, base: dict[str, torch.Tensor] | None) -> None:
        try:
            enc, wr = self._locks()
            async with enc:
                blob = None if base is None else await asyncio.to_thread(tensors_to_bytes, base)
                await wr.acquire()
            try:
                if blob is not None and self._base_key is not None:
                    await self._store.put(self._base_key, blob)
                await self._write_metadata()
            finally:
                wr.release()
        except BaseException as e:
            self._set_error(e)
            raise

    async def _write_step(self, summary: StepSummary, layers: dict[str, SparseLayerDelta]) -> None:
        # The error is recorded here, before the locks are released, so that a queued later
        # step can never be written after a failed one (its delta would skip the lost step).
        try:
            enc, wr = self._locks()
            async with enc:
                if self._error is not None:
                    return  # the chain is broken; write nothing after a failed step
                blob = await asyncio.to_thread(encode_delta, summary.step, layers)
                del layers
                await wr.acquire()
            try:
                if self._error is not None:
                    return
                await self._store.put(summary.path, blob)
                self._entries.append(summary.entry(len(blob)))
                with self._lock:
                    others_queued = self._queued > 1
                if not others_queued:
                    await self._write_metadata()
            finally:
                wr.release()
        except BaseException as e:
            self._set_error(e)
            raise

    async def _write_metadata_if_stale(self) -> None:
        """Bring ``metadata.json`` up to date with every durable delta (also after a failure:
        the steps before the failed one form an intact chain and stay usable)."""
        _, wr = self._locks()
        async with wr:
            if self._meta_written != len(self._entries):
                await self._write_metadata()

    async def _write_metadata(self) -> None:
        meta = build_metadata(
            dtype=self.dtype,
            total_params=self.total_params,
            encoding="mckp",
            base=self._base_key,
            base_step=self.base_step,
            layers=self._layers_meta,
            checkpoints=self._entries,
        )
        data = json.dumps(meta, indent=1).encode()
        await self._store.put(METADATA_KEY, data)
        self._meta_written = len(self._entries)

    def _shutdown(self) -> None:
        try:
            if self._own_store:
                self._loop.run(self._store.close())
        finally:
            if self._own_loop:
                self._loop.close()
