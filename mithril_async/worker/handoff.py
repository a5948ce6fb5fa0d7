"""What crosses the control channel, as plain JSON: a snapshot's hand-off, a save's result,
errors, the run's configuration.

A staged tensor travels as its place in the shared staging memory (segment, offset), dtype and
shape; skeletons, RNG documents and data-loader states are JSON already; results and rank
reports are dataclasses and pydantic models. Errors keep their type where it is one of the
library's (:mod:`mithril_async.errors`) or a builtin, and their ``errno``, so a failure in
the worker is raised in the trainer as the same error it is inline.
"""

from __future__ import annotations

import builtins
import dataclasses
from typing import TYPE_CHECKING, Any

from mithril_async import errors
from mithril_async.codec.dtypes import DTYPES
from mithril_async.config import Config
from mithril_async.manifest import PieceMeta
from mithril_async.pipeline.results import SaveResult
from mithril_async.worker.shm import BufferAt

if TYPE_CHECKING:
    import torch

__all__ = ["config_doc", "config_of", "error_doc", "error_of", "pieces_doc", "pieces_of",
           "result_doc", "update_result", "tensor_doc"]


def config_doc(config: Config) -> dict[str, Any]:
    return {"data": config.model_dump(mode="json"), "source": config.source_toml}


def config_of(doc: dict[str, Any]) -> Config:
    cfg = Config.model_validate(doc["data"])
    cfg.source_toml = doc.get("source")
    return cfg


def tensor_doc(name: str, t: torch.Tensor, at: BufferAt | None) -> list[Any]:
    """``[name, dtype, shape, segment, offset]`` (segment -1: an empty tensor)."""
    seg, off = (at.segment, at.offset) if at is not None else (-1, 0)
    return [name, str(t.dtype).removeprefix("torch."), list(t.shape), seg, off]


def tensor_of(doc: list[Any]) -> tuple[str, str, tuple[int, ...], BufferAt | None]:
    """``(name, dtype name, shape, place)`` of a :func:`tensor_doc` (None: empty)."""
    name, dtype, shape, seg, off = doc
    if str(dtype) not in DTYPES:
        raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
    at = None if int(seg) < 0 else BufferAt(int(seg), int(off))
    return str(name), str(dtype), tuple(int(x) for x in shape), at


def pieces_doc(pieces: dict[str, dict[str, PieceMeta]]) -> dict[str, Any]:
    """The pieces with how each arose from its mesh (``split``, which manifests never hold:
    the worker's part needs it to store the pieces as a shared piece layout)."""
    return {item: {n: {**p.model_dump(mode="json"),
                       "split": None if p.split is None else p.split.model_dump(mode="json")}
                   for n, p in ps.items()}
            for item, ps in pieces.items()}


def pieces_of(doc: dict[str, Any]) -> dict[str, dict[str, PieceMeta]]:
    return {item: {n: PieceMeta.model_validate(p) for n, p in ps.items()}
            for item, ps in doc.items()}


#: what the worker's result tells the trainer's SaveResult
_RESULT_FIELDS = ("status", "version_id", "total_s", "bytes_in", "bytes_out", "error",
                  "host_peak_bytes", "nonfinite", "held")


def result_doc(res: SaveResult) -> dict[str, Any]:
    d = dataclasses.asdict(res)
    return {k: d[k] for k in _RESULT_FIELDS}


def update_result(res: SaveResult, doc: dict[str, Any]) -> None:
    for k in _RESULT_FIELDS:
        if k in doc:
            setattr(res, k, doc[k])
    if "nonfinite" in doc:  # JSON made the (NaNs, Infs) pairs lists
        res.nonfinite = {name: (int(c[0]), int(c[1])) for name, c in doc["nonfinite"].items()}


def _details(cls: type[BaseException]) -> tuple[str, ...]:
    """The attributes of the library's errors that carry more than the message (all plain
    JSON), kept across the channel."""
    if issubclass(cls, errors.ChecksumMismatch):
        return ("where", "expected", "actual")
    if issubclass(cls, errors.NonFiniteState):
        return ("tensors",)  # name -> (NaNs, Infs)
    return ()


def error_doc(err: BaseException) -> dict[str, Any]:
    return {"kind": type(err).__name__, "message": str(err),
            "errno": getattr(err, "errno", None),
            "details": {name: getattr(err, name) for name in _details(type(err))}}


def error_of(doc: dict[str, Any]) -> BaseException:
    """The error a peer reported, as the same class where it is the library's or a
    builtin exception (else a :class:`~mithril_async.errors.MithrilError` naming it)."""
    kind, message = str(doc.get("kind")), str(doc.get("message"))
    cls = getattr(errors, kind, None) or getattr(builtins, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return errors.MithrilError(f"{kind}: {message}")
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    if doc.get("errno") is not None and isinstance(err, OSError):
        err.errno = int(doc["errno"])
    details = doc.get("details")
    details = details if isinstance(details, dict) else {}
    for name in _details(cls):
        value = details.get(name)
        if name == "tensors":  # JSON made the (NaNs, Infs) pairs lists
            value = {str(k): (v[0], v[1]) for k, v in (
                value.items() if isinstance(value, dict) else ())
                if isinstance(v, list | tuple) and len(v) == 2
                and all(type(n) is int for n in v)}
        setattr(err, name, value)
    return err
