"""The Hugging Face files beside the weights (``config.json``, ``generation_config.json``,
tokenizer / processor files), recorded into a run and read back, verified, by an export.

A run records its own configuration under ``runs/<id>/config/`` (``train.toml`` and the
``config.json`` of ``[checkpointing]``); the model's Hugging Face files go one level down, in
``config/hf/<file name>``, so they never meet the run's own ``config.json``. Each recording
writes the files first and then ``config/hf_files.json`` (every file's size and xxh64), and a
reader trusts only what that index lists, each file checked against it: a damaged or swapped
file is :class:`~mithril_async.errors.ChecksumMismatch`, never copied into an export.

The files are what ``save_pretrained`` would write beside the weights: the model's config
with ``dtype`` and ``architectures`` set as ``PreTrainedModel.save_pretrained`` sets them
(the live config is not changed), the generation config of a model that generates, and
whatever ``save_pretrained`` of the tokenizer or processor writes (flat files only).
:func:`record_hf_files` records them through a manager (rank 0; the Trainer callback does it
when it creates its manager); :func:`read_hf_files` reads them for an export.
"""

from __future__ import annotations

import copy
import json
import re
import tempfile
from pathlib import Path
from typing import Any, Protocol

import xxhash

from mithril_async.catalog import RunCatalog
from mithril_async.errors import ChecksumMismatch, InvalidFormat, KeyNotFound
from mithril_async.layout import RunLayout
from mithril_async.pipeline.loop import BackgroundLoop
from mithril_async.storage.base import Store

__all__ = ["HF_DIR", "HF_INDEX", "collect_hf_files", "is_weights_file", "read_hf_files",
           "record_hf_files", "write_hf_files"]

#: the folder of a run's ``config/`` holding the Hugging Face files
HF_DIR = "hf"
#: the index of the recorded files in ``config/``, written after them
HF_INDEX = "hf_files.json"
_INDEX_VERSION = 1
#: a file name that stays inside the folder it is written to
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$")
_WEIGHTS = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")


def is_weights_file(name: str) -> bool:
    """Whether ``name`` is one of the weight files an export writes (never a recorded one)."""
    return _WEIGHTS.fullmatch(name) is not None


def _plain(name: str) -> bool:
    return _PLAIN_NAME.fullmatch(name) is not None and ".." not in name


class RunWriter(Protocol):
    """What recording needs of a :class:`~mithril_async.manager.CheckpointManager`."""

    @property
    def store(self) -> Store: ...

    @property
    def layout(self) -> RunLayout: ...

    @property
    def rank(self) -> int: ...

    @property
    def loop(self) -> BackgroundLoop: ...


def collect_hf_files(model: Any, processing_class: Any | None = None) -> dict[str, bytes]:
    """The files ``save_pretrained`` writes beside the weights of ``model`` (a
    ``PreTrainedModel``) and of ``processing_class`` (a tokenizer or processor), by name."""
    with tempfile.TemporaryDirectory(prefix="mithril-hf-") as tmp:
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config = copy.deepcopy(config)  # the live model's config stays as it is
            dtype = getattr(model, "dtype", None)
            if dtype is not None:
                config.dtype = str(dtype).removeprefix("torch.")
            config.architectures = [type(model).__name__.removeprefix("FSDP")]
            config.save_pretrained(tmp)
        can_generate = getattr(model, "can_generate", None)
        generation = getattr(model, "generation_config", None)
        if generation is not None and callable(can_generate) and can_generate():
            generation.save_pretrained(tmp)
        if processing_class is not None and hasattr(processing_class, "save_pretrained"):
            processing_class.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir())
                if p.is_file() and _plain(p.name) and not is_weights_file(p.name)}


async def write_hf_files(store: Store, layout: RunLayout, files: dict[str, bytes]) -> None:
    """Record ``files`` into the run: each under ``config/hf/``, then the index."""
    index: dict[str, Any] = {"schema_version": _INDEX_VERSION, "files": {}}
    for name, data in sorted(files.items()):
        if not _plain(name) or is_weights_file(name):
            raise InvalidFormat(f"cannot record {name!r} with the run's Hugging Face files "
                                "(a plain file name other than the weights' is needed)")
        await store.put(layout.config_key(f"{HF_DIR}/{name}"), data)
        index["files"][name] = {"bytes": len(data), "xxh64": xxhash.xxh64_hexdigest(data)}
    await store.put(layout.config_key(HF_INDEX),
                    json.dumps(index, indent=1, sort_keys=True).encode() + b"\n")


def record_hf_files(manager: RunWriter, model: Any, processing_class: Any | None = None
                    ) -> list[str]:
    """Record ``model``'s config (and generation config) and ``processing_class``'s files
    into ``manager``'s run, for exports (:func:`mithril_async.export.export_hf`); the names
    recorded. Only rank 0 records (others return ``[]``)."""
    if manager.rank != 0:
        return []
    files = collect_hf_files(model, processing_class)
    manager.loop.run(write_hf_files(manager.store, manager.layout, files))
    return sorted(files)


async def read_hf_files(catalog: RunCatalog) -> dict[str, bytes]:
    """The Hugging Face files recorded in the run (empty if none), each checked against
    the index: its size before it is read, its xxh64 after."""
    layout = catalog.layout
    index_key = layout.config_key(HF_INDEX)
    try:
        raw = await catalog.get_metadata(index_key)
    except KeyNotFound:
        return {}
    try:
        doc = json.loads(raw)
        version, entries = doc["schema_version"], doc["files"]
        listed = {str(n): (int(e["bytes"]), str(e["xxh64"])) for n, e in entries.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise InvalidFormat(f"{index_key}: not an index of Hugging Face files ({err})") from None
    if version != _INDEX_VERSION:
        raise InvalidFormat(f"{index_key}: schema_version {version!r} is not one this reader "
                            f"knows ({_INDEX_VERSION})")
    out: dict[str, bytes] = {}
    for name, (size, digest) in sorted(listed.items()):
        key = layout.config_key(f"{HF_DIR}/{name}")
        if not _plain(name) or is_weights_file(name):
            raise InvalidFormat(f"{index_key}: lists {name!r}, not a plain file name")
        got = await catalog.store.size(key)
        if got != size:
            raise InvalidFormat(f"{key}: {got} bytes, {index_key} says {size}")
        data = await catalog.get_metadata(key)
        actual = xxhash.xxh64_hexdigest(data)
        if len(data) != size or actual != digest:
            raise ChecksumMismatch(key, digest, actual)
        out[name] = data
    return out
