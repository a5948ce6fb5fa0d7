"""Export a version to Hugging Face's format: what ``save_pretrained`` writes, from a run.

    result = export_hf("runs/my-run", "out/hf", version="latest", max_shard_size="5GB",
                       dtype="bfloat16")
    model = AutoModel.from_pretrained("out/hf")

The output folder holds the item's tensors as ``model.safetensors`` when they fit one file of
``max_shard_size``, else as ``model-0000k-of-0000N.safetensors`` plus
``model.safetensors.index.json`` (``metadata.total_size``, ``metadata.total_parameters``,
``weight_map``): the names, the split and the index are those of ``transformers``'
``save_pretrained`` (``huggingface_hub.split_torch_state_dict_into_shards``: tensors in
state-dict order, a new file when the next tensor would pass the limit, a tensor larger than
the limit alone in its own file; sizes in decimal units, "5GB" = 5e9 bytes). Beside them go
the ``config.json``, generation config and tokenizer files the run recorded
(:mod:`~mithril_async.export.hf_files`), with ``config.json``'s ``dtype`` set to ``dtype``
when the export casts.

A multi-rank sharded version (FSDP2 / DTensor, ``ShardedModel``) is consolidated into full
tensors one output file at a time (:mod:`~mithril_async.export.tensors`): memory stays at
about one output file (in the saved dtype) plus the restore's in-flight budget, not the
model. ``dtype`` casts floating-point tensors on the way (integer and bool tensors keep
theirs, as ``from_pretrained(dtype=...)`` does). Everything read is verified as a restore
verifies it; the recorded files are checked before anything is written.

Writing: into a fresh folder beside the output folder, every file atomically (temp file,
fsync, rename; the weight files, the index, the tokenizer and generation files, then
``config.json``), and only once it is complete does it take the output folder's name
(:mod:`~mithril_async.export.replace`: an atomic exchange on Linux). So the output folder
always holds a whole export or none, and an export that fails (a damaged block found in its
third file) leaves it exactly as it was: empty or missing, or, with ``force``, the previous
export, intact. A folder that is not empty is refused (:class:`OutputExists`) unless
``force``; then the export replaces it, keeping the folder's other files (a README: carried
over as hard links) but none of the previous weight files (as ``save_pretrained`` removes
those it does not rewrite). Replacing needs room for both exports at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mithril_async.catalog import RunCatalog, open_catalog
from mithril_async.codec.safetensors_io import SAFETENSORS_CODES, safetensors_header
from mithril_async.config import CheckpointingConfig
from mithril_async.errors import (
    ConfigError,
    OutputExists,
    UnsupportedDtype,
    UnsupportedStateType,
)
from mithril_async.export.hf_files import is_weights_file, read_hf_files
from mithril_async.export.replace import discard, new_sibling, swap_in
from mithril_async.export.tensors import TensorSpec, open_item_tensors
from mithril_async.pipeline.loop import run_to_completion
from mithril_async.restore.reader import DEFAULT_INFLIGHT_MIB, VersionReader
from mithril_async.storage.atomic import atomic_file, atomic_write

#: torch dtypes safetensors holds -> their safetensors codes
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    getattr(torch, name): code for name, code in SAFETENSORS_CODES.items()}

__all__ = ["INDEX_NAME", "WEIGHTS_NAME", "ExportResult", "OutputExists", "export_hf",
           "export_hf_async", "export_on_close", "parse_size", "plan_shards", "shard_names"]

log = logging.getLogger("mithril_async")

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
#: what ``save_pretrained`` puts in every safetensors file's metadata
_METADATA = {"format": "pt"}
#: size units of ``max_shard_size``: Hugging Face's decimal ones, and binary ones
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


@dataclass
class ExportResult:
    """What an export wrote."""

    out_dir: str
    run_id: str
    version_id: str
    step: int
    item: str
    #: the dtype floating-point tensors were cast to (None: as saved)
    dtype: str | None
    #: the weight files, in order
    shards: list[str]
    tensors: int
    #: bytes of tensor data written (the index's ``metadata.total_size``)
    total_size: int
    #: the recorded Hugging Face files copied beside the weights
    copied: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_size(value: int | str) -> int:
    """Bytes of a ``max_shard_size``: an int, or digits with a unit as Hugging Face writes
    them ("5GB" = 5e9 bytes, also KB, MB, TB; "KiB", "MiB", "GiB", "TiB" are binary; no
    unit: bytes); :class:`ConfigError` naming the value otherwise."""
    if isinstance(value, bool):
        raise ConfigError(f"max_shard_size: {value!r} is not a size")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(str(value))
        unit = m.group(2).upper() if m else ""
        if m is None or unit not in (*_UNITS, ""):
            raise ConfigError(f"max_shard_size: {value!r} is not a size (use e.g. '5GB', "
                              "'500MB', '2GiB' or a number of bytes)")
        n = int(float(m.group(1)) * _UNITS[unit or "B"])
    if n <= 0:
        raise ConfigError(f"max_shard_size: {value!r} must be more than 0 bytes")
    return n


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """The floating-point dtype to cast to ("bfloat16", "float16", "float32", ...)."""
    if value is None or isinstance(value, torch.dtype):
        dt = value
    else:
        dt = getattr(torch, str(value).removeprefix("torch."), None)
    if dt is not None and (not isinstance(dt, torch.dtype) or not dt.is_floating_point
                           or dt not in SAFETENSORS_DTYPES):
        dt = None
        if value is not None:
            raise ConfigError(f"dtype: {value!r} is not a floating-point dtype safetensors "
                              "holds (use e.g. 'bfloat16', 'float16' or 'float32')")
    return dt


def plan_shards(sizes: Sequence[tuple[str, int]], max_size: int) -> list[list[str]]:
    """The names of each output file, exactly as ``huggingface_hub`` splits a state dict:
    in order, a new file when the next tensor would pass ``max_size``, and a tensor larger
    than ``max_size`` in a file of its own (added when it is met)."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes:
        if size > max_size:
            shards.append([name])
            continue
        if current_size + size > max_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    return shards


def natural_key(name: str) -> list[tuple[int, str] | tuple[int, str, int] | tuple[int, int]]:
    """The order ``save_pretrained`` gives a loaded model's tensors (``transformers``'
    ``dot_natural_key``): '.'-separated parts, numbers numerically before words, a word's
    trailing number numerically."""
    parts: list[tuple[int, str] | tuple[int, str, int] | tuple[int, int]] = []
    for part in name.split("."):
        if part.isascii() and part.isdigit():
            parts.append((0, int(part)))
            continue
        text = part.rstrip("0123456789")
        digits = part[len(text):]
        parts.append((1, text, int(digits)) if digits else (1, text))
    return parts


#: safetensors' order of dtypes inside a file (its writer lays tensors out by dtype, widest
#: first, then by name): the files are then byte for byte what ``save_pretrained`` writes
_FILE_ORDER = {code: i for i, code in enumerate(
    ("U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E4M3",
     "F8_E5M2", "I8", "U8", "BOOL"))}


def file_order(tensors: Sequence[tuple[str, torch.dtype]]) -> list[str]:
    """The names of one file's ``(name, exported dtype)`` in safetensors' layout order."""
    return [n for n, _ in sorted(tensors, key=lambda nd: (_FILE_ORDER[SAFETENSORS_DTYPES[
        nd[1]]], nd[0]))]


def shard_names(n: int) -> list[str]:
    """The weight files of an export in ``n`` files."""
    if n == 1:
        return [WEIGHTS_NAME]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _check_out_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise OutputExists(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise OutputExists(f"{out} exists and is not empty (use force=True / --force to "
                           "replace the export in it)")


def _out_dtype(saved: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The exported dtype of a tensor saved as ``saved``: ``dtype`` for floating point."""
    return dtype if dtype is not None and saved.is_floating_point else saved


def _out_size(spec: TensorSpec, dtype: torch.dtype | None) -> int:
    return spec.numel * _out_dtype(spec.dtype, dtype).itemsize


def write_shard(path: Path, tensors: Sequence[tuple[str, torch.Tensor]],
                dtype: torch.dtype | None) -> int:
    """Write ``tensors`` (name, tensor) as one safetensors file, atomically, casting one
    tensor at a time; the bytes of tensor data written."""
    meta = {name: torch.empty(t.shape, dtype=_out_dtype(t.dtype, dtype), device="meta")
            for name, t in tensors}
    header = safetensors_header(meta, dict(_METADATA))
    written = 0
    with atomic_file(path) as f:
        f.write(header)
        for _name, t in tensors:
            out = t.to(_out_dtype(t.dtype, dtype)).contiguous()
            if out.numel():
                f.write(out.reshape(-1).view(torch.uint8).numpy().data)
                written += out.numel() * out.element_size()
    return written


def _config_json(data: bytes, dtype: torch.dtype | None) -> bytes:
    """The recorded ``config.json``, its ``dtype`` set to the export's when it casts."""
    if dtype is None:
        return data
    try:
        doc = json.loads(data)
    except ValueError as err:
        raise ConfigError(f"the recorded config.json is not JSON ({err})") from None
    if not isinstance(doc, dict):
        raise ConfigError("the recorded config.json is not a JSON object")
    name = str(dtype).removeprefix("torch.")
    doc["dtype"] = name
    if "torch_dtype" in doc:
        doc["torch_dtype"] = name
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


async def export_hf_async(catalog: RunCatalog, out_dir: str | os.PathLike[str], *,
                          version: str | int = "latest", item: str = "model",
                          max_shard_size: int | str = "5GB",
                          dtype: str | torch.dtype | None = None, force: bool = False,
                          pool: Executor | None = None,
                          inflight_mib: float = DEFAULT_INFLIGHT_MIB,
                          on_progress: Callable[[int, int], None] | None = None
                          ) -> ExportResult:
    """Export ``item`` of ``version`` of the run of ``catalog`` into ``out_dir`` (module
    docstring). ``pool``: the codec threads that decode (None: a pool of the export's own);
    ``inflight_mib``: the bytes the reads may hold in flight; ``on_progress(done, total)``:
    bytes of tensor data written so far, after each file."""
    limit = parse_size(max_shard_size)
    cast = parse_dtype(dtype)
    out = Path(out_dir).expanduser()
    _check_out_dir(out, force)
    loop = asyncio.get_running_loop()
    with VersionReader(catalog, pool=pool, inflight_mib=inflight_mib) as reader:
        m = await catalog.read_manifest(await catalog.resolve(version))
        tensors = await open_item_tensors(reader, m, item)
        if not tensors.specs:
            raise UnsupportedStateType(f"{m.version_id}: {item} holds no tensors to export")
        for s in tensors.specs:
            if s.dtype not in SAFETENSORS_DTYPES:
                raise UnsupportedDtype(f"{m.version_id}: tensor {s.name!r} is {s.dtype}, which "
                                       "safetensors cannot hold")
        extra = await read_hf_files(catalog) if item == "model" else {}
        if item == "model" and "config.json" not in extra:
            log.warning("run %s recorded no config.json: the export holds the weights only "
                        "(from_pretrained needs a config.json beside them)",
                        catalog.layout.run_id)
        specs_in_order = sorted(tensors.specs, key=lambda s: natural_key(s.name))
        sizes = {s.name: _out_size(s, cast) for s in specs_in_order}
        groups = plan_shards(list(sizes.items()), limit)
        names = shard_names(len(groups))
        total = sum(sizes.values())
        by_name = {s.name: s for s in tensors.specs}
        target = out.resolve()  # a symlink to a folder: that folder is replaced
        # the replacement is written beside the folder, which it replaces once complete
        work = await loop.run_in_executor(None, new_sibling, target, lambda name: not (
            is_weights_file(name) or name in extra))
        try:
            done = 0
            for fname, group in zip(names, groups, strict=True):
                specs = [by_name[n] for n in file_order(
                    [(n, _out_dtype(by_name[n].dtype, cast)) for n in group])]
                got = await tensors.read(specs)
                pairs = [(s.name, got[s.stored]) for s in specs]
                del got
                done += await loop.run_in_executor(None, write_shard, work / fname, pairs,
                                                   cast)
                del pairs
                if on_progress is not None:
                    on_progress(done, total)
            numel = sum(s.numel for s in tensors.specs)
            await loop.run_in_executor(None, _finish, work, names, groups, total, numel,
                                       extra, cast)
            await loop.run_in_executor(None, swap_in, work, target)
        except BaseException:  # the previous folder (if any) stays as it was
            discard(work)
            raise
    return ExportResult(str(out), catalog.layout.run_id, m.version_id, m.step, item,
                        None if cast is None else str(cast).removeprefix("torch."), names,
                        len(sizes), total, sorted(extra))


def _finish(out: Path, names: list[str], groups: list[list[str]], total_size: int,
            total_numel: int, extra: Mapping[str, bytes], cast: torch.dtype | None) -> None:
    """The index, the recorded files, ``config.json`` (the weight files are written)."""
    if len(names) > 1:
        weight_map = {n: fname for fname, group in zip(names, groups, strict=True)
                      for n in group}
        # total_parameters: the elements of the exported tensors (save_pretrained counts
        # the model's parameters, the same for a state dict without persistent buffers)
        index = {"metadata": {"total_parameters": total_numel, "total_size": total_size},
                 "weight_map": weight_map}
        atomic_write(out / INDEX_NAME,
                     (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
    for name, data in sorted(extra.items()):
        if name != "config.json":
            atomic_write(out / name, data)
    if "config.json" in extra:
        atomic_write(out / "config.json", _config_json(extra["config.json"], cast))


def export_hf(run: RunCatalog | str | os.PathLike[str], out_dir: str | os.PathLike[str],
              **kw: Any) -> ExportResult:
    """:func:`export_hf_async` from synchronous code: ``run`` is a run folder
    (``runs/<run_id>``) on local disk or a :class:`~mithril_async.catalog.RunCatalog`."""
    if isinstance(run, RunCatalog):
        catalog = run
    else:
        folder = Path(run).expanduser().absolute()
        catalog = open_catalog(folder.parent, folder.name)
    return run_to_completion(export_hf_async(catalog, out_dir, **kw))


def close_export_dir(cfg: CheckpointingConfig, run_id: str) -> Path | None:
    """Where ``[checkpointing] export_hf_on_close`` exports (None: it is off): true means
    ``<runs_path>/<run_id>/export/hf``, a string is the folder itself."""
    where = cfg.export_hf_on_close
    if where is False:
        return None
    if where is True:
        return Path(cfg.runs_path).expanduser().absolute() / run_id / "export" / "hf"
    return Path(where).expanduser().absolute()


def export_on_close(cfg: CheckpointingConfig, catalog: RunCatalog,
                    run: Callable[[Coroutine[Any, Any, ExportResult]], ExportResult],
                    rank: int, committed: bool, pool: Executor | None = None
                    ) -> BaseException | None:
    """The manager's export when it closes (``export_hf_on_close``): rank 0, when this
    manager committed a version, exports the run's ``latest`` into :func:`close_export_dir`
    (replacing an earlier export there), through ``run`` (the manager's loop). Returns the
    error (logged here) for the manager to raise once it has released everything."""
    out = close_export_dir(cfg, catalog.layout.run_id)
    if out is None or rank != 0 or not committed:
        return None
    try:
        res = run(export_hf_async(catalog, out, force=True, pool=pool,
                                  inflight_mib=cfg.pipeline.max_inflight_mib))
    except Exception as err:
        log.error("export of run %s to %s when the manager closed failed: %r",
                  catalog.layout.run_id, out, err)
        return err
    log.info("exported %s (step %d) of run %s to %s: %d file(s), %d bytes", res.version_id,
             res.step, res.run_id, out, len(res.shards), res.total_size)
    return None
