"""Render the configuration reference from the pydantic models of :mod:`mithril_async.config`.

The docs site's "Configuration reference" page is this module's output, made at build time
by the mkdocs hook (tools/mkdocs_hooks.py), so it cannot drift from the code: every key of
``[checkpointing]`` and of each nested table, with its type, default, bounds and description.
A field's description is its pydantic ``description`` and the ``#:`` comment written above
it in the model's source (the convention of mithril_async/config_models.py).

``python tools/config_reference.py`` prints the page.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

_FIELD = re.compile(r"^(\s+)([A-Za-z_]\w*)\s*:")
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"),
           ("min_length", "length >="), ("max_length", "length <="))


def field_comments(model: type[BaseModel]) -> dict[str, str]:
    """The ``#:`` comment block right above each field of ``model``'s own source."""
    lines = inspect.getsource(model).splitlines()
    out: dict[str, str] = {}
    pending: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        match = _FIELD.match(line)
        if match and match[2] in model.model_fields and pending:
            out[match[2]] = re.sub(r"(\w)- (\w)", r"\1-\2", " ".join(pending))
        pending = []
    return out


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a).replace("'", '"') for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is type(None):
        return "None"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "table"
    return getattr(tp, "__name__", str(tp))


def _nested_model(tp: Any) -> type[BaseModel] | None:
    """The model of a sub-table field (``Model`` or ``Model | None``), else None."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                return arg
    return None


def _toml(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, BaseModel):
        return "(table)"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def default_of(info: FieldInfo) -> str:
    """The default as TOML would spell it; ``required`` where there is none."""
    if info.default is not PydanticUndefined:
        return _toml(info.default)
    if info.default_factory is not None:
        # the documented default, not one the environment (MITHRIL_PROCESS) chose
        saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("MITHRIL_")}
        try:
            return _toml(info.default_factory())  # type: ignore[call-arg]
        finally:
            os.environ.update(saved)
    return "required"


def _bounds(info: FieldInfo) -> str:
    found = []
    for meta in info.metadata:
        for attr, sign in _BOUNDS:
            value = getattr(meta, attr, None)
            if value is not None:
                found.append(f"{sign} {value}")
    return ", ".join(found)


def tables(model: type[BaseModel], name: str) -> Iterator[tuple[str, type[BaseModel]]]:
    """``(table name, model)`` of ``model`` and every sub-table below it, depth first."""
    yield name, model
    for key, info in model.model_fields.items():
        sub = _nested_model(info.annotation)
        if sub is not None:
            yield from tables(sub, f"{name}.{key}")


def keys(model: type[BaseModel], name: str) -> list[str]:
    """Every dotted key the reference documents (sub-tables are keys too)."""
    return [f"{table}.{key}" for table, m in tables(model, name) for key in m.model_fields]


def _cell(text: str) -> str:
    """One table cell: reST literals as Markdown code, ``<`` and ``|`` escaped."""
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    return text.replace("<", "&lt;").replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """The whole reference page, Markdown."""
    from mithril_async.config import CheckpointingConfig

    out = [
        "# Configuration reference",
        "",
        "Generated from the pydantic models of `mithril_async/config_models.py` when the site "
        "is built (`tools/config_reference.py`): every key of the `[checkpointing]` tables "
        "with its type, default and bounds. An unknown key or a value out of bounds raises "
        "`ConfigError` naming it. A worked example of a whole file is in the "
        "[configuration guide](../CONFIG.md).",
        "",
    ]
    for table, model in tables(CheckpointingConfig, "checkpointing"):
        comments = field_comments(model)
        doc = _cell(inspect.cleandoc(model.__doc__ or "").split("\n\n")[0])
        out += [f"## `[{table}]`", "", doc, "",
                "| key | type | default | description |", "|---|---|---|---|"]
        for key, info in model.model_fields.items():
            desc = " ".join(p for p in (info.description, comments.get(key)) if p)
            bounds = _bounds(info)
            if bounds:
                desc = f"{desc} ({bounds})" if desc else f"({bounds})"
            sub = _nested_model(info.annotation)
            if sub is not None:
                desc = f"{desc} See [`[{table}.{key}]`](#{table}{key}).".strip()
            type_name = _type_name(info.annotation).replace("|", "\\|")
            out.append(f"| `{key}` | `{type_name}` | `{default_of(info)}` | "
                       f"{_cell(desc) or '-'} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())
