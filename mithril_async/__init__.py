"""mithril_async: fast, small and safe asynchronous checkpointing for PyTorch training.

The public API, re-exported; see README.md for a tour.

The errors are imported here; every other name is imported on first use (PEP 562), so a
process that needs only part of the library (the checkpoint worker, which encodes bytes from
shared memory, or the ``mithril`` command) does not pay for the rest (torch above all).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mithril_async.errors import (
    ChecksumMismatch,
    ClaimLost,
    CompressionError,
    ConfigError,
    DistributedError,
    ErrorBoundExceeded,
    HostMemoryExceeded,
    InvalidFormat,
    KeyExists,
    KeyNotFound,
    LockTimeout,
    MissingPrevious,
    MithrilError,
    NonFiniteState,
    OutputExists,
    PreconditionFailed,
    RestoreIncomplete,
    SaveFailed,
    SaveInProgress,
    ShapeMismatch,
    SnapshotTorn,
    StepAlreadyExists,
    StorageError,
    UnknownFormatVersion,
    UnsafeKey,
    UnsupportedDtype,
    UnsupportedStateType,
    VersionNotFound,
    WorkerExited,
)

if TYPE_CHECKING:
    from mithril_async.codec import (
        compress_state_dict,
        decompress_state_dict,
    )
    from mithril_async.compressor import Compressor
    from mithril_async.config import (
        Config,
        load_config,
        parse_config,
    )
    from mithril_async.distributed import DistCoordinator
    from mithril_async.manager import CheckpointManager
    from mithril_async.restore.apply import RestoreResult, ResumeReport
    from mithril_async.retention import (
        KeepAny,
        KeepBestN,
        KeepEveryNSteps,
        KeepLastN,
        Policy,
    )
    from mithril_async.save.results import (
        SaveHandle,
        SaveResult,
    )
    from mithril_async.state import TensorDict
    from mithril_async.storage import open_store
    from mithril_async.storage.base import (
        BlobWriter,
        Store,
    )

__version__ = "0.1.0"

#: every public name imported on first use, and the module that defines it
_LAZY: dict[str, str] = {
    "BlobWriter": "mithril_async.storage.base",
    "CheckpointManager": "mithril_async.manager",
    "Compressor": "mithril_async.compressor",
    "Config": "mithril_async.config",
    "DistCoordinator": "mithril_async.distributed",
    "KeepAny": "mithril_async.retention",
    "KeepBestN": "mithril_async.retention",
    "KeepEveryNSteps": "mithril_async.retention",
    "KeepLastN": "mithril_async.retention",
    "Policy": "mithril_async.retention",
    "RestoreResult": "mithril_async.restore.apply",
    "ResumeReport": "mithril_async.restore.apply",
    "SaveHandle": "mithril_async.save.results",
    "SaveResult": "mithril_async.save.results",
    "Store": "mithril_async.storage.base",
    "TensorDict": "mithril_async.state",
    "compress_state_dict": "mithril_async.codec",
    "decompress_state_dict": "mithril_async.codec",
    "load_config": "mithril_async.config",
    "open_store": "mithril_async.storage",
    "parse_config": "mithril_async.config",
}


__all__ = [
    "BlobWriter",
    "CheckpointManager",
    "ChecksumMismatch",
    "ClaimLost",
    "CompressionError",
    "Compressor",
    "Config",
    "ConfigError",
    "DistCoordinator",
    "DistributedError",
    "ErrorBoundExceeded",
    "HostMemoryExceeded",
    "InvalidFormat",
    "KeepAny",
    "KeepBestN",
    "KeepEveryNSteps",
    "KeepLastN",
    "KeyExists",
    "KeyNotFound",
    "LockTimeout",
    "MissingPrevious",
    "MithrilError",
    "NonFiniteState",
    "OutputExists",
    "Policy",
    "PreconditionFailed",
    "RestoreIncomplete",
    "RestoreResult",
    "ResumeReport",
    "SaveFailed",
    "SaveHandle",
    "SaveInProgress",
    "SaveResult",
    "ShapeMismatch",
    "SnapshotTorn",
    "StepAlreadyExists",
    "StorageError",
    "Store",
    "TensorDict",
    "UnknownFormatVersion",
    "UnsafeKey",
    "UnsupportedDtype",
    "UnsupportedStateType",
    "VersionNotFound",
    "WorkerExited",
    "compress_state_dict",
    "decompress_state_dict",
    "load_config",
    "open_store",
    "parse_config",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mithril_async' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
