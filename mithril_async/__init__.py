"""mithril_async: fast, small and safe asynchronous checkpointing for PyTorch training.

The public API, re-exported; see README.md for a tour.
"""

from mithril_async.codec import compress_state_dict, decompress_state_dict
from mithril_async.compressor import Compressor
from mithril_async.config import Config, load_config, parse_config
from mithril_async.distributed import DistCoordinator
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
from mithril_async.manager import CheckpointManager, RestoreResult, ResumeReport
from mithril_async.pipeline.results import SaveHandle, SaveResult
from mithril_async.retention import KeepAny, KeepBestN, KeepEveryNSteps, KeepLastN, Policy
from mithril_async.state import TensorDict
from mithril_async.storage import open_store
from mithril_async.storage.base import BlobWriter, Store

__version__ = "0.1.0"

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
