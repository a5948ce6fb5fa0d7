"""What crosses the control channel, as plain JSON: a snapshot's hand-off, a save's result,
errors, the run's configuration.

A staged tensor travels as its place in the shared staging memory (segment, offset), dtype and
shape; skeletons, RNG documents and data-loader states are JSON already; results and rank
reports are dataclasses and pydantic models. Errors keep their type where it is one of the
library's (:mod:`mithril_async.errors`) or a builtin, and their ``errno``, so a failure in
the worker is raised in the trainer as the same error it is inline.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from mithril_async.codec.dtypes import DTYPES
from mithril_async.config import Config
from mithril_async.manifest import PieceMeta
from mithril_async.save.results import SaveResult
from mithril_async.worker.shm import BufferAt
from mithril_async.worker.typed_errors import error_doc, error_of

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
