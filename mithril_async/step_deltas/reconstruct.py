"""Reconstruct weights at a recorded step from a base snapshot and the sparse deltas.

Exactness: the base is cast to the recorder dtype (the same deterministic cast the recorder
made of the live weights when it started), then every delta up to ``target_step`` scatters its
stored *new* values. No float arithmetic is involved, so the result is bitwise equal to the
recorder's snapshot at that step, i.e. to ``param.to(dtype)`` right after that step's
``record``. Only steps that were recorded (or the declared ``base_step``) can be targets:
between two recorded steps the weights were never observed.

Every file is read from inside the recording: the names ``metadata.json`` lists are store keys
(the recorder wrote them through a Store), held to the same rules (:func:`check_key`: no
``..``, no absolute paths), and no file or folder is followed through a symlink, so a copied
or downloaded recording cannot make reconstruction or ``mithril analyze`` read elsewhere.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch

from mithril_async.errors import (
    InvalidFormat,
    MissingPrevious,
    ShapeMismatch,
    UnknownFormatVersion,
    UnsafeKey,
    VersionNotFound,
)
from mithril_async.step_deltas.meta import METADATA_FORMAT, METADATA_KEY, METADATA_VERSION
from mithril_async.step_deltas.sparse import SparseLayerDelta, decode_delta, decode_tensors
from mithril_async.storage.base import check_key

_DTYPES = {str(d): d for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64)}


def read_member(delta_dir: str | os.PathLike[str], name: object, what: str) -> bytes:
    """The bytes of file ``name`` of the recording in ``delta_dir``, confined to it.

    ``name`` comes from ``metadata.json``: it must be a valid store key (else
    :class:`UnsafeKey`), its folder must resolve inside ``delta_dir`` and the file must not be
    a symlink (:class:`UnsafeKey`); a missing file is ``FileNotFoundError``. ``what`` names
    the file in errors."""
    root = os.path.realpath(delta_dir)
    try:
        key = check_key(cast(str, name))  # whatever JSON held: check_key refuses non-strings
    except UnsafeKey as err:
        raise UnsafeKey(f"{root}/{METADATA_KEY}: {what} {name!r} is not a path inside the "
                        f"recording ({err})") from None
    path = os.path.join(root, key)
    folder = os.path.realpath(os.path.dirname(path))
    if folder != root and not folder.startswith(root + os.sep):
        raise UnsafeKey(f"{what} {path} lies in a folder that resolves outside {root}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UnsafeKey(f"{what} {path} is a symlink, refused") from None
        raise
    with open(fd, "rb") as f:
        return f.read()


def read_metadata(delta_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Load and check ``metadata.json`` of a delta directory."""
    path = os.path.join(os.fspath(delta_dir), METADATA_KEY)
    try:
        meta: dict[str, Any] = json.loads(read_member(delta_dir, METADATA_KEY, "metadata"))
    except FileNotFoundError:
        raise VersionNotFound(f"no sparse-delta recording in {delta_dir}: {path} missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidFormat(f"{path} is not valid JSON: {e}") from e
    if not isinstance(meta, dict):
        raise InvalidFormat(f"{path} is not a JSON object")
    fmt = meta.get("format", METADATA_FORMAT)  # files of the first format carry no format key
    if fmt != METADATA_FORMAT:
        raise InvalidFormat(f"{path}: format {fmt!r} is not {METADATA_FORMAT!r}")
    version = meta.get("format_version", METADATA_VERSION)
    if version != METADATA_VERSION:
        raise UnknownFormatVersion(f"{path}: metadata version {version} is not known")
    if "checkpoints" not in meta or "dtype" not in meta:
        raise InvalidFormat(f"{path} lacks 'checkpoints' or 'dtype'")
    return meta


def metadata_dtype(meta: Mapping[str, Any]) -> torch.dtype:
    try:
        return _DTYPES[str(meta["dtype"])]
    except KeyError:
        raise InvalidFormat(f"unknown recorder dtype {meta.get('dtype')!r}") from None


def iter_deltas(
    delta_dir: str | os.PathLike[str],
    until: int | None = None,
    meta: Mapping[str, Any] | None = None,
) -> Iterator[tuple[int, dict[str, SparseLayerDelta]]]:
    """Yield ``(step, layers)`` for every recorded delta (up to ``until``), in step order."""
    meta = read_metadata(delta_dir) if meta is None else meta
    entries = sorted(meta["checkpoints"], key=lambda e: int(e["step"]))
    for e in entries:
        step = int(e["step"])
        if until is not None and step > until:
            return
        path = os.path.join(os.fspath(delta_dir), str(e["path"]))
        try:
            blob = read_member(delta_dir, e["path"], f"delta of step {step}")
        except FileNotFoundError:
            raise MissingPrevious(f"delta for step {step} listed in metadata is missing: "
                                  f"{path}") from None
        file_step, layers = decode_delta(blob, path)
        if file_step != step:
            raise InvalidFormat(f"{path} holds step {file_step}, metadata says {step}")
        yield step, layers


def load_base(
    delta_dir: str | os.PathLike[str], meta: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """The starting snapshot the recorder wrote (``base.*``)."""
    key = meta.get("base")
    if not key:
        raise MissingPrevious(
            f"{delta_dir} has no stored base snapshot; pass base_weights explicitly"
        )
    path = os.path.join(os.fspath(delta_dir), str(key))
    try:
        blob = read_member(delta_dir, key, "base snapshot")
    except FileNotFoundError:
        raise MissingPrevious(f"base snapshot {path} named in metadata is missing") from None
    return decode_tensors(blob, path)


def _check_target(meta: Mapping[str, Any], target_step: int, delta_dir: object) -> None:
    steps = [int(e["step"]) for e in meta["checkpoints"]]
    if target_step in steps or target_step == meta.get("base_step"):
        return
    span = f"{min(steps)}..{max(steps)} ({len(steps)} steps)" if steps else "none"
    raise VersionNotFound(
        f"step {target_step} was not recorded in {delta_dir}; recorded steps: {span}"
    )


def reconstruct_weights_at_step(
    base_weights: Mapping[str, torch.Tensor] | None,
    delta_dir: str | os.PathLike[str],
    target_step: int,
) -> dict[str, torch.Tensor]:
    """Weights at ``target_step``, bitwise equal to the model's in the recorder dtype.

    ``base_weights`` are the weights when the recorder was created (any float dtype; they
    are cast to the recorder dtype); ``None`` uses the base snapshot stored in ``delta_dir``.
    Tensors of ``base_weights`` that the recording does not track are returned as copies.
    """
    meta = read_metadata(delta_dir)
    dtype = metadata_dtype(meta)
    _check_target(meta, target_step, delta_dir)
    base = load_base(delta_dir, meta) if base_weights is None else base_weights
    layers_meta: Mapping[str, Any] = meta.get("layers", {})
    out: dict[str, torch.Tensor] = {}
    for name, t in base.items():
        t = t.detach()
        if name in layers_meta or (not layers_meta and t.is_floating_point()):
            out[name] = t.to(device="cpu", dtype=dtype, copy=True).contiguous()
        else:
            out[name] = t.to("cpu", copy=True)
    for name, info in layers_meta.items():
        if name not in out:
            raise MissingPrevious(f"base weights lack tracked tensor {name!r}")
        if list(out[name].shape) != list(info["shape"]):
            raise ShapeMismatch(
                f"base tensor {name!r} has shape {list(out[name].shape)}, "
                f"recording says {list(info['shape'])}"
            )
    for step, layers in iter_deltas(delta_dir, until=target_step, meta=meta):
        for name, d in layers.items():
            target = out.get(name)
            if target is None:
                raise MissingPrevious(f"base weights lack {name!r} changed at step {step}")
            if tuple(target.shape) != d.shape:
                raise ShapeMismatch(
                    f"{name!r}: base shape {tuple(target.shape)} != delta shape {d.shape}"
                    f" at step {step}"
                )
            d.apply_(target)
    return out
