"""Pydantic models of the TOML configuration, :func:`load_config`, and what a run records.

Only the ``[checkpointing]`` table belongs to us; other tables of a training TOML (model,
data, ...) are kept untouched in ``Config.extra`` so one file can drive a whole run. Unknown
keys inside ``[checkpointing]`` are errors, and every error names the dotted key at fault.

A run records its configuration (``runs/<id>/config/train.toml`` and ``config.json``), and
runs are copied to buckets and shared: :func:`recorded_config` keeps ``[checkpointing]`` plus
the tables ``record_config`` names (other tables often hold API keys and database URLs) and
redacts every value whose key looks secret, and URL passwords, wherever they are.

The models are :mod:`mithril_async.config_models`, what a run records
:mod:`mithril_async.config_record`; this module loads and validates a configuration and
re-exports both, so ``mithril_async.config`` stays the one place to import from.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from mithril_async.config_models import (
    REFUSED_SIGNALS,
    CheckpointingConfig,
    CompressionConfig,
    Config,
    LossyConfig,
    PipelineConfig,
    RemoteConfig,
    RestoreConfig,
    check_host_memory,
    check_signal_names,
    default_process,
    min_host_memory,
)
from mithril_async.config_record import (
    REDACTED,
    SECRET_WORDS,
    is_secret_key,
    recorded_config,
    redact,
    to_toml,
)
from mithril_async.errors import ConfigError
from mithril_async.tiers.config import TiersConfig

__all__ = [
    "REDACTED",
    "REFUSED_SIGNALS",
    "SECRET_WORDS",
    "CheckpointingConfig",
    "CompressionConfig",
    "Config",
    "LossyConfig",
    "PipelineConfig",
    "RemoteConfig",
    "RestoreConfig",
    "TiersConfig",
    "check_host_memory",
    "check_signal_names",
    "config_from_dict",
    "default_process",
    "is_secret_key",
    "load_config",
    "min_host_memory",
    "parse_config",
    "recorded_config",
    "redact",
    "to_toml",
    "with_absolute_paths",
]


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().absolute())


def with_absolute_paths(config: Config) -> Config:
    """``config`` with every local path of ``[checkpointing]`` made absolute against the
    working directory of now (``~`` expanded): ``runs_path``, ``tiers.local`` (placeholders
    kept) and a folder given as ``export_hf_on_close``.

    A manager resolves them once, when it is created, so that a script that changes
    directory afterwards still saves, exports and finds its versions where the manager was
    created, and a checkpoint worker (a process started later, in whatever directory the
    trainer is in then) uses the same folders. ``config`` itself is left as it is: a copy is
    returned when anything had to change."""
    ck = config.checkpointing
    remote_only = ck.remote is not None and ck.remote.mode == "remote_only"
    # remote_only: runs_path only names the bucket's runs prefix (its last component)
    runs = ck.runs_path if remote_only else _absolute(ck.runs_path)
    local = None if ck.tiers is None else _absolute(ck.tiers.local)
    export = ck.export_hf_on_close
    export = _absolute(export) if isinstance(export, str) else export
    if (runs, local, export) == (ck.runs_path, None if ck.tiers is None else ck.tiers.local,
                                 ck.export_hf_on_close):
        return config
    out = config.model_copy(deep=True)
    out.source_toml = config.source_toml
    cko = out.checkpointing
    cko.runs_path, cko.export_hf_on_close = runs, export
    if cko.tiers is not None and local is not None:
        cko.tiers.local = local
    return out


def _format_errors(err: ValidationError, where: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        lines.append(f"{key}: {e['msg']}")
    return f"invalid configuration in {where}: " + "; ".join(lines)


def config_from_dict(data: dict[str, Any], *, where: str = "<dict>", source: str | None = None
                     ) -> Config:
    """Validate a parsed TOML/JSON mapping; :class:`ConfigError` names each bad key."""
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, where)) from None
    cfg.source_toml = source
    return cfg


def load_config(path: str | Path) -> Config:
    """Load and validate a TOML file (see configs/ for examples)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"invalid TOML in {p}: {err}") from None
    return config_from_dict(data, where=str(p), source=text)


def parse_config(text: str, *, where: str = "<string>") -> Config:
    """Validate TOML text."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"invalid TOML in {where}: {err}") from None
    return config_from_dict(data, where=where, source=text)
