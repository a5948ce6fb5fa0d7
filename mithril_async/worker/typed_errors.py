"""Errors as they cross between a training process and its checkpoint worker.

A failure on one side is raised on the other as the same class where it is one of the
library's (:mod:`mithril_async.errors`) or a builtin exception, with its message, ``errno``
and the details the library's errors carry (a checksum's place and values, the NaN/Inf
counts): a caller catches what it would catch inline. Only the class name travels, looked up
in those two places, never an arbitrary class; anything else is a :class:`RemoteError`
naming it.
"""

from __future__ import annotations

import builtins
from typing import Any

from mithril_async import errors

__all__ = ["RemoteError", "error_doc", "error_of"]


class RemoteError(errors.MithrilError, RuntimeError):
    """A call failed in the other process with an error of no class known here; ``kind``
    names its exception type there."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


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
    builtin exception (else a :class:`RemoteError` naming it)."""
    kind, message = str(doc.get("kind")), str(doc.get("message"))
    cls = getattr(errors, kind, None) or getattr(builtins, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return RemoteError(kind, message)
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
