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
    InvalidFormat,
    KeyExists,
    KeyNotFound,
    MissingPrevious,
    MithrilError,
    NonFiniteState,
    PreconditionFailed,
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
)
from mithril_async.manager import CheckpointManager
from mithril_async.pipeline.results import SaveHandle, SaveResult
from mithril_async.retention import KeepAny, KeepBestN, KeepEveryNSteps, KeepLastN, Policy
from mithril_async.state import TensorDict

__version__ = "0.1.0"

__all__ = [
    "CheckpointManager",
    "Compressor",
    "DistCoordinator",
    "ChecksumMismatch",
    "ClaimLost",
    "CompressionError",
    "Config",
    "ConfigError",
    "DistributedError",
    "ErrorBoundExceeded",
    "InvalidFormat",
    "KeepAny",
    "KeepBestN",
    "KeepEveryNSteps",
    "KeepLastN",
    "KeyExists",
    "KeyNotFound",
    "MissingPrevious",
    "MithrilError",
    "NonFiniteState",
    "Policy",
    "PreconditionFailed",
    "SaveFailed",
    "SaveHandle",
    "SaveInProgress",
    "SaveResult",
    "ShapeMismatch",
    "SnapshotTorn",
    "StepAlreadyExists",
    "StorageError",
    "TensorDict",
    "UnknownFormatVersion",
    "UnsafeKey",
    "UnsupportedDtype",
    "UnsupportedStateType",
    "VersionNotFound",
    "__version__",
    "compress_state_dict",
    "decompress_state_dict",
    "load_config",
    "parse_config",
]
