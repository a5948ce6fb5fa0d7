"""Exports of a run's versions to other frameworks' formats.

:func:`export_hf` writes a version as ``save_pretrained`` would (sharded safetensors, their
index, and the ``config.json`` / tokenizer files the run recorded with
:func:`record_hf_files`): :mod:`mithril_async.export.hf`.
"""

from mithril_async.export.hf import (
    ExportResult,
    OutputExists,
    export_hf,
    export_hf_async,
    parse_size,
)
from mithril_async.export.hf_files import read_hf_files, record_hf_files

__all__ = ["ExportResult", "OutputExists", "export_hf", "export_hf_async", "parse_size",
           "read_hf_files", "record_hf_files"]
