"""What a run records of its configuration (``runs/<id>/config/train.toml`` and
``config.json``). Runs are copied to buckets and shared, so :func:`recorded_config` keeps
``[checkpointing]`` plus the tables ``record_config`` names (other tables often hold API keys and
database URLs) and redacts every value whose key looks secret, and URL passwords, wherever they
are; :func:`to_toml` writes the kept tables back as TOML.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import tomllib
from typing import Any

from mithril_async.config_models import Config
from mithril_async.errors import ConfigError

#: a key with one of these as a word (``hf_token``, ``apiKey``, ``aws_secret_access_key``; not
#: ``keyframe`` nor ``tokenizer``), or a word ending in one of :data:`_SECRET_ENDINGS`
#: (``authtoken``), has its value redacted in what a run records
SECRET_WORDS = ("token", "key", "keys", "secret", "secrets", "password", "passwd",
                "credential", "credentials")
_SECRET_ENDINGS = ("token", "secret", "password", "passwd", "apikey", "accesskey",
                   "secretkey", "privatekey")
REDACTED = "<redacted>"
_URL_PASSWORD = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@]*):[^/\s@]*@")


def is_secret_key(name: str) -> bool:
    """Whether a config key looks like it holds a secret (any word of it, any case)."""
    words = re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower())
    return any(w in SECRET_WORDS or w.endswith(_SECRET_ENDINGS) for w in words)


def redact(value: Any) -> Any:
    """``value`` with every secret-looking key's value and every URL password replaced by
    :data:`REDACTED`, in nested tables and lists alike."""
    if isinstance(value, dict):
        return {k: REDACTED if is_secret_key(str(k)) and value[k] is not None
                else redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return _URL_PASSWORD.sub(rf"\1:{REDACTED}@", value)
    return value


def recorded_config(config: Config) -> tuple[bytes, bytes]:
    """``(train.toml, config.json)`` as a run records them: ``[checkpointing]`` and the tables
    ``checkpointing.record_config`` names, secret-looking values redacted.

    The TOML is the user's own text (comments included) when nothing had to be left out or
    redacted, else the kept tables written anew. The JSON holds the validated
    ``[checkpointing]`` with every default filled in, plus the recorded tables.
    """
    names = [n for n in config.checkpointing.record_config if n != "checkpointing"]
    extra = config.extra
    if config.source_toml is not None:
        source: dict[str, Any] = tomllib.loads(config.source_toml)
    else:
        source = {"checkpointing": config.checkpointing.model_dump(mode="json",
                                                                   exclude_none=True),
                  **extra}
    kept = redact({k: v for k, v in source.items() if k == "checkpointing" or k in names})
    if config.source_toml is not None and kept == source:
        toml = config.source_toml
    else:
        toml = ("# recorded by mithril_async: [checkpointing] and the tables "
                "checkpointing.record_config names; secret-looking values redacted\n"
                + to_toml(kept))
    doc = redact({"checkpointing": config.checkpointing.model_dump(mode="json"),
                  **{n: extra[n] for n in names}})
    return toml.encode(), json.dumps(doc, indent=2, default=str).encode()


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_str(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_key(k: Any) -> str:
    k = str(k)
    return k if _BARE_KEY.match(k) else _toml_str(k)


def _toml_value(v: Any, where: str) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, (datetime.date, datetime.time)):
        return v.isoformat()
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x, where) for x in v if x is not None) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x, f'{where}.{k}')}"
                               for k, x in v.items() if x is not None) + "}"
    raise ConfigError(f"{where}: a {type(v).__name__} cannot be written as TOML")


def to_toml(tables: dict[str, Any]) -> str:
    """TOML text of a parsed-TOML-like mapping (``tomllib.loads`` gives it back; ``None``
    values, which TOML cannot hold, are left out). Python has a TOML reader but no writer."""
    lines: list[str] = []

    def table(d: dict[str, Any], path: list[str]) -> None:
        scalars = [(k, v) for k, v in d.items() if not isinstance(v, dict) and v is not None]
        subs = [(k, v) for k, v in d.items() if isinstance(v, dict)]
        if path and (scalars or not subs):
            lines.append(f"[{'.'.join(_toml_key(p) for p in path)}]")
        lines.extend(f"{_toml_key(k)} = {_toml_value(v, '.'.join([*path, str(k)]))}"
                     for k, v in scalars)
        for k, v in subs:
            table(v, [*path, str(k)])

    table(tables, [])
    return "\n".join(lines) + "\n"
