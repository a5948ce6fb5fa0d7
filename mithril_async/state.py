"""State trees: the Stateful protocol, flattening to (skeleton, tensors), RNG capture/restore.

A state dict (model, optimizer, scheduler...) is a tree of dicts/lists/tuples whose leaves are
tensors or plain values. We store tensors in binary blobs and everything else as a JSON
*skeleton* with typed tags, so restore rebuilds the exact tree (int dict keys of optimizer state,
tuples of betas, NaN floats, dtypes) without pickle: loading a checkpoint never runs code.
"""

from __future__ import annotations

import base64
import math
import random
from collections.abc import Container
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from mithril_async.errors import InvalidFormat, UnsupportedStateType

#: the dtypes a skeleton's ``{"dt": name}`` may name: torch's dtype objects by the name the
#: writer gives them (``str(dtype)`` without ``torch.``). A lookup of any attribute of torch
#: would hand a hostile skeleton functions such as ``torch.load``.
TORCH_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
#: numpy scalar kinds a skeleton's ``{"np": dtype}`` may name (what the writer stores: bool,
#: integers, floats, complex); others (``V``oid, ``O``bject, strings) could allocate at will
_NUMPY_KINDS = "biufc"


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()`` (models, optimizers, schedulers)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class TensorDict:
    """A plain ``{name: tensor}`` dict as a :class:`Stateful`.

    Saved as is; restored in place (``copy_`` into the same tensors), so code holding those
    tensors sees the restored values.  For weights, buffers or statistics that live outside a
    module.
    """

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, value in state_dict.items():
            self.tensors[name].copy_(value)


@runtime_checkable
class JsonStateful(Protocol):
    """A data loader / batcher whose position is small JSON (``get_state``/``set_state``).

    The state may carry ``"exact": False`` to say replay from it is best-effort only.
    """

    def get_state(self) -> dict[str, Any]: ...

    def set_state(self, state: dict[str, Any]) -> Any: ...


def _enc_key(k: Any, path: str) -> Any:
    if isinstance(k, (str, int, bool)) or k is None:
        return k
    if isinstance(k, float):
        return _enc_scalar(k)
    if isinstance(k, tuple):
        return {"U": [_enc_key(x, path) for x in k]}
    raise UnsupportedStateType(f"dict key of type {type(k).__name__} at {path!r}")


def _enc_scalar(x: float) -> Any:
    return x if math.isfinite(x) else {"f": repr(x)}


def unique_name(path: str, taken: Container[str]) -> str:
    """The stored name of a tensor at ``path``: the path itself (``.`` for the root), with
    ``#2``, ``#3``, ... when a tensor already took it (two leaves can share a path, e.g. a
    dict key ``"a/b"`` beside a nested ``a`` -> ``b``). One rule for :func:`flatten_state` and
    whatever must name leaves as it does (the shard metadata of a save)."""
    name = path or "."
    n = 1
    while name in taken:
        n += 1
        name = f"{path}#{n}"
    return name


def flatten_state(tree: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``tree`` into a JSON-able skeleton and a flat ``{path: tensor}`` dict.

    Tensor paths are '/'-joined keys (stable across saves of the same structure).
    numpy arrays are stored as tensors and come back as numpy arrays.
    """
    tensors: dict[str, torch.Tensor] = {}
    def enc(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            if x.is_sparse or x.layout != torch.strided:
                raise UnsupportedStateType(f"non-strided tensor at {path!r} ({x.layout})")
            name = unique_name(path, tensors)
            tensors[name] = x.detach()
            return {"T": name}
        if isinstance(x, np.ndarray):
            name = unique_name(path, tensors)
            tensors[name] = torch.from_numpy(np.ascontiguousarray(x))
            return {"N": name}
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return x
        if isinstance(x, float):
            return _enc_scalar(x)
        if isinstance(x, (np.integer, np.floating, np.bool_)):
            return {"np": str(x.dtype), "v": enc(x.item(), path)}
        if isinstance(x, dict):
            return {"D": [[_enc_key(k, path), enc(v, f"{path}/{k}" if path else str(k))]
                          for k, v in x.items()]}
        if isinstance(x, torch.Size):
            return {"S": list(x)}
        if isinstance(x, tuple):
            return {"U": [enc(v, f"{path}/{i}") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return {"L": [enc(v, f"{path}/{i}") for i, v in enumerate(x)]}
        if isinstance(x, torch.dtype):
            return {"dt": str(x).removeprefix("torch.")}
        if isinstance(x, torch.device):
            return {"dev": str(x)}
        if isinstance(x, bytes):
            return {"B": base64.b64encode(x).decode("ascii")}
        raise UnsupportedStateType(
            f"cannot store a {type(x).__module__}.{type(x).__qualname__} at {path!r} "
            "(only tensors, numpy arrays, containers and plain scalars; no pickle)"
        )

    return enc(tree, ""), tensors


def _dec_key(k: Any) -> Any:
    if isinstance(k, dict):
        if "U" in k:
            return tuple(_dec_key(x) for x in k["U"])
        if "f" in k:
            return float(k["f"])
    return k


def unflatten_state(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`flatten_state`; ``KeyError`` names a tensor the skeleton lacks."""

    def dec(x: Any) -> Any:
        if not isinstance(x, dict):
            return x
        if "T" in x:
            return tensors[x["T"]]
        if "N" in x:
            return tensors[x["N"]].numpy()
        if "D" in x:
            return {_dec_key(k): dec(v) for k, v in x["D"]}
        if "L" in x:
            return [dec(v) for v in x["L"]]
        if "U" in x:
            return tuple(dec(v) for v in x["U"])
        if "S" in x:
            return torch.Size(x["S"])
        if "f" in x:
            return float(x["f"])
        if "np" in x:
            return _numpy_scalar_type(x["np"])(dec(x["v"]))
        if "dt" in x:
            dt = TORCH_DTYPES.get(x["dt"]) if isinstance(x["dt"], str) else None
            if dt is None:
                raise InvalidFormat(f"state skeleton names an unknown torch dtype {x['dt']!r}")
            return dt
        if "dev" in x:
            return torch.device(x["dev"])
        if "B" in x:
            return base64.b64decode(x["B"])
        raise ValueError(f"unknown skeleton node {sorted(x)}")

    return dec(skeleton)


def _numpy_scalar_type(name: Any) -> Any:
    """The numpy scalar type a skeleton names, if it is one the writer can have stored."""
    try:
        dt = np.dtype(name) if isinstance(name, str) else None
    except TypeError:
        dt = None
    if dt is None or dt.kind not in _NUMPY_KINDS:
        raise InvalidFormat(f"state skeleton names an unsupported numpy scalar type {name!r}")
    return dt.type


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def decode_rng_state(text: str) -> torch.Tensor:
    """A torch/CUDA generator state (uint8 tensor) from its base64 form in :func:`capture_rng`.

    Public for readers that hand the states to another loader (the Hugging Face checkpoint
    writer) instead of :func:`restore_rng`.
    """
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def capture_rng() -> dict[str, Any]:
    """The RNG state of python, numpy, torch (and every CUDA device), as JSON."""
    py = random.getstate()
    np_state: Any = np.random.get_state()
    out: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng` captured (CUDA only when present on both sides)."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npst = state["numpy"]
    np.random.set_state((npst[0], np.asarray(npst[1], dtype=np.uint32), *npst[2:]))
    torch.set_rng_state(decode_rng_state(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([decode_rng_state(s) for s in state["cuda"]])


# ------------------------------------------------------------ restores on another world size
#: keys of a data-loader state that count positions (DistributedSampler-style): each rank
#: has consumed that many samples of its 1/world share of the data
POSITION_KEYS = ("position", "index", "samples_seen", "num_samples_seen", "consumed")


def default_on_reshard(states_by_rank: dict[int, Any], new_rank: int,
                       new_world: int) -> Any:
    """The default mapping of saved per-rank data-loader states to a rank of a new world.

    ``DistributedSampler``-style positions (:data:`POSITION_KEYS`, an int on every saved rank)
    mean each of the old ranks consumed that many samples of its share; together they consumed
    the sum, so each new rank starts at ``sum // new_world`` of its (new) share: no sample is
    seen twice in the epoch, at most ``new_world - 1`` are skipped. Everything else is taken
    from the saved rank of the same number (rank 0's when it did not exist), and the state is
    marked ``"exact": False``: replay is best-effort. Pass ``on_reshard=`` to ``restore()``
    for loaders whose state means something else.
    """
    if not states_by_rank:
        return None
    ranks = sorted(states_by_rank)
    base = states_by_rank[new_rank if new_rank in states_by_rank else ranks[0]]
    if not isinstance(base, dict):
        return base
    out = dict(base)
    for key in POSITION_KEYS:
        vals = [states_by_rank[r].get(key) if isinstance(states_by_rank[r], dict) else None
                for r in ranks]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
            out[key] = sum(vals) // new_world  # type: ignore[arg-type]
    out["exact"] = False
    return out


def reseed_rng(saved: dict[str, Any], new_rank: int) -> int:
    """Seed python, numpy and torch for a rank that did not exist when the version was saved,
    deterministically: the seed is the XXH64 of the lowest saved rank's torch generator state
    and the new rank's number, so a restart of the same reshard draws the same numbers and two
    new ranks never share a stream. Returns the seed."""
    import xxhash

    seed = xxhash.xxh64_intdigest(f"{saved['torch']}/{new_rank}".encode()) & ((1 << 63) - 1)
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    torch.manual_seed(seed)
    return seed
