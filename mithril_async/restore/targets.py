"""Where a restore writes: which live tensors it may decode straight into, how (a byte view,
through the staging ring, by copy runs of a shard), and when loading may be skipped.

A restore decodes a version straight into the tensors a state object's ``state_dict()``
returns, which for a plain module are views of its live parameters and buffers. A state
dict may also hold copies: a module converting dtypes in ``_save_to_state_dict``, a
state-dict hook returning new tensors, FSDP's gathered full state dict. Bytes decoded into a
copy never reach the live state, so a tensor is a target only when its storage is proven to
be one of the object's live storages (:func:`live_targets`); the others are decoded into
fresh tensors and reach the object through ``load_state_dict``. A module's
``load_state_dict`` is skipped only when everything it would load was decoded into its live
tensors and nothing of its would run on load (:func:`loaded_in_place`).

A live tensor of the saved dtype and shape, contiguous on the CPU, takes decoded bytes
straight into its memory (:func:`inplace_view`). One of another dtype or on a CUDA device
(contiguous) is staged (:class:`StagingRing`): each block decoded into one of a few reused
chunk buffers (pinned for CUDA) and copied from there into its span, converting the dtype.
A shard restored from saved pieces takes the byte runs the overlap arithmetic gives
(:class:`CopyRuns`). Tensors written behind torch's back have their autograd version counter
bumped (:func:`mark_written`), as ``copy_`` would.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mithril_async.codec.container import BlockRef, MckpInfo
from mithril_async.codec.dtypes import dtype_info
from mithril_async.codec.kernels import copy_arrays
from mithril_async.device import CudaCopier
from mithril_async.errors import ShapeMismatch
from mithril_async.memory.ring import SlotRing
from mithril_async.plain_state import PlainEntry
from mithril_async.state import TensorDict

__all__ = ["CopyRuns", "StagingRing", "check_shapes", "copier_for", "inplace_view",
           "live_storages", "live_targets", "loaded_in_place", "mark_written", "stageable"]

#: the load methods a module may have without running anything of its own on load: torch's
_LOAD_METHODS = ("load_state_dict", "_load_from_state_dict", "set_extra_state")


def _storage_ptr(t: Any) -> int:
    """The address of ``t``'s storage (0: none we can write through, or not a plain tensor)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type == "meta":
        return 0
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


def _live_tensors(obj: Any) -> Iterable[Any]:
    if isinstance(obj, torch.nn.Module):
        return itertools.chain(obj.parameters(), obj.buffers())
    if isinstance(obj, torch.optim.Optimizer):
        return (v for s in obj.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    if isinstance(obj, TensorDict):
        return obj.tensors.values()
    if isinstance(obj, PlainEntry):
        return obj.tensors()
    return ()


def live_storages(obj: Any) -> frozenset[int]:
    """Storage addresses holding ``obj``'s live state: a module's parameters and buffers, an
    optimizer's state tensors, a :class:`TensorDict`'s or a plain entry's tensors; none for
    anything else (its state dict cannot be proven to be its state)."""
    return frozenset(p for t in _live_tensors(obj) if (p := _storage_ptr(t)))


def live_targets(obj: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of ``tensors`` (what ``obj.state_dict()`` gave, by stored name) that share
    storage with ``obj``'s live state, so that writing into them writes the state itself."""
    live = live_storages(obj)
    return {name: t for name, t in tensors.items() if _storage_ptr(t) in live}


def _torch_load_methods(module: torch.nn.Module) -> bool:
    cls = type(module)
    return all(getattr(cls, name).__module__.startswith("torch.nn.")
               for name in _LOAD_METHODS)


def _no_load_hooks(module: torch.nn.Module) -> bool:
    return not (module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks
                or module._state_dict_hooks or module._state_dict_pre_hooks)


def loaded_in_place(module: torch.nn.Module, tree: Any) -> bool:
    """Whether ``module.load_state_dict(tree)`` would change nothing: every entry of its
    state dict is a tensor, ``tree`` holds exactly those names, each a view of the very same
    bytes of a live parameter or buffer (so a restore decoded it in place), and no submodule
    runs code of its own on load (load hooks, state-dict hooks, load methods that are not
    torch's). Anything less and the caller loads."""
    if not isinstance(tree, dict):
        return False
    if not all(_no_load_hooks(m) and _torch_load_methods(m) for m in module.modules()):
        return False
    current = module.state_dict()
    if set(current) != set(tree):
        return False
    live = live_storages(module)
    for name, now in current.items():
        got = tree[name]
        if not (isinstance(now, torch.Tensor) and isinstance(got, torch.Tensor)):
            return False
        if (_storage_ptr(got) not in live or got.data_ptr() != now.data_ptr()
                or got.dtype != now.dtype or got.shape != now.shape
                or got.stride() != now.stride()):
            return False
    return True


def check_shapes(key: str, live: Mapping[str, torch.Tensor],
                 saved: Iterable[tuple[str, tuple[int, ...]]]) -> None:
    """Every saved tensor the live state also has must have its shape there."""
    for name, shape in saved:
        t = live.get(name)
        if t is not None and tuple(t.shape) != tuple(shape):
            raise ShapeMismatch(f"{key}: tensor {name!r} is {list(t.shape)} here but was saved "
                                f"as {list(shape)}; nothing was written")


def mark_written(tensors: Iterable[torch.Tensor]) -> None:
    """Bump the autograd version counter of tensors written behind torch's back (as
    ``copy_`` would), so a graph that saved one of them for backward refuses to use it."""
    from torch.autograd.graph import increment_version

    for t in tensors:
        if t.numel():
            increment_version(t)


def inplace_view(t: torch.Tensor, dtype: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """The live tensor's bytes as a writable uint8 view when a chunk may be decoded straight
    into them (CPU, contiguous, same dtype and shape, no lazy conj/neg bit); None otherwise."""
    if (t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous()
            or tuple(t.shape) != shape or str(t.dtype).removeprefix("torch.") != dtype
            or t.is_conj() or t.is_neg() or t.is_quantized or t.is_nested or t.numel() == 0):
        return None
    try:
        view: np.ndarray = t.detach().reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError):
        return None
    return view if view.flags.writeable else None


def stageable(t: torch.Tensor, dtype: str, shape: tuple[int, ...]) -> bool:
    """Whether a live tensor that cannot take decoded bytes in place takes them through the
    staging ring: dense, contiguous, of the saved shape, on the CPU or a CUDA device, of a
    dtype torch can convert the saved one to (the saved dtype known to torch)."""
    info = dtype_info(dtype)
    return (info.torch_dtype is not None and t.layout == torch.strided and t.is_contiguous()
            and tuple(t.shape) == tuple(shape) and t.device.type in ("cpu", "cuda")
            and not (t.is_conj() or t.is_neg() or t.is_quantized or t.is_nested)
            and t.numel() > 0)


class HostCopier:
    """Copies a staged chunk into its span of a CPU live tensor (converting its dtype)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)


def copier_for(device: torch.device) -> HostCopier | CudaCopier:
    """The copier for live tensors on ``device``: the one device copier
    (:class:`~mithril_async.device.CudaCopier`, a side stream ordered after the work queued
    when the restore began) for CUDA, a plain copy for the CPU (tests stand in for the CUDA
    one)."""
    return CudaCopier(device) if device.type == "cuda" else HostCopier()


class StagingRing:
    """A few reused host buffers of one chunk each through which the blocks of staged
    tensors reach their live tensors (:func:`stageable`): a block's buffer is leased before
    its decode is submitted (at most ``slots`` at a time, so at most ``slots`` chunks of
    memory) and given back once its copy into the live tensor is complete. Pinned when a
    target is on a CUDA device."""

    def __init__(self, info: MckpInfo, targets: Mapping[int, torch.Tensor], slot_bytes: int,
                 slots: int) -> None:
        self.info, self.targets = info, targets
        pin = any(t.device.type == "cuda" for t in targets.values()) \
            and torch.cuda.is_available()
        self.ring = SlotRing(max(1, slots), slot_bytes, pin=pin)
        self.copiers = {d: copier_for(d) for d in {t.device for t in targets.values()}}
        #: the most buffers leased at once (for tests: the bound)
        self.peak = 0
        self._held = 0
        self._lock = threading.Lock()

    def wants(self, b: BlockRef) -> bool:
        return b.tensor in self.targets

    async def lease(self) -> Any:
        lease = await self.ring.acquire()
        with self._lock:
            self._held += 1
            self.peak = max(self.peak, self._held)
        return lease

    def release(self, lease: Any) -> None:
        with self._lock:
            self._held -= 1
        lease.release()

    def finish(self, b: BlockRef, lease: Any) -> None:
        """Copy block ``b``'s decoded bytes (in leased buffer ``lease``) into its span of
        the live tensor."""
        t = self.info.tensors[b.tensor]
        off, ln = t.chunks[b.chunk]
        info = dtype_info(t.dtype)
        target = self.targets[b.tensor].detach()  # a leaf that requires grad takes it too
        src = lease.tensor[:ln].view(info.torch_dtype)
        dst = target.view(-1)[off // info.itemsize:(off + ln) // info.itemsize]
        self.copiers[target.device].copy(dst, src)


@dataclass
class CopyRuns:
    """The copy runs of one tensor from one saved piece into a live local shard:
    ``(src, dst, nbytes)`` byte offsets in the piece and in the shard (sorted by ``src``,
    never overlapping, from :func:`~mithril_async.restore.reshard.copy_runs`), and the
    shard's bytes."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    live: np.ndarray  # uint8 view of the live local shard
    ends: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.ends = self.src + self.nbytes

    @classmethod
    def of(cls, runs: np.ndarray, live: torch.Tensor) -> CopyRuns:
        view = live.reshape(-1).view(torch.uint8).numpy() if live.numel() else \
            np.empty(0, np.uint8)
        return cls(runs[:, 0].copy(), runs[:, 1].copy(), runs[:, 2].copy(), view)

    @property
    def span(self) -> tuple[int, int]:
        """The bytes of the piece the runs lie in."""
        return int(self.src.min()), int(self.ends.max())

    def inside_one(self, lo: int, n: int) -> np.ndarray | None:
        """The live shard's bytes for piece bytes ``[lo, lo + n)`` when they lie inside one
        run (a chunk decoded straight into the live shard); None otherwise."""
        i = int(np.searchsorted(self.src, lo, side="right")) - 1
        if i < 0 or lo + n > int(self.ends[i]):
            return None
        at = int(self.dst[i] + lo - self.src[i])
        out: np.ndarray = self.live[at:at + n]
        return out

    def copy_from(self, lo: int, data: np.ndarray) -> None:
        """Copy the runs' parts that lie in piece bytes ``[lo, lo + len(data))`` from
        ``data`` into the live shard (one native batched copy, GIL released)."""
        hi = lo + data.size
        a = int(np.searchsorted(self.ends, lo, side="right"))
        b = int(np.searchsorted(self.src, hi, side="left"))
        if a >= b:
            return
        s, d, n = self.src[a:b], self.dst[a:b], self.nbytes[a:b]
        start = np.maximum(s, lo)
        count = np.minimum(s + n, hi) - start
        keep = count > 0
        base_src, base_dst = data.ctypes.data, self.live.ctypes.data
        copy_arrays((base_src + start - lo)[keep].astype(np.uint64),
                    (base_dst + d + start - s)[keep].astype(np.uint64),
                    count[keep].astype(np.uint64))
