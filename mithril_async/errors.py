"""Every typed error mithril_async raises.

All errors derive from :class:`MithrilError` and also from the builtin a caller would
naturally catch (``ValueError`` for bad data, ``FileNotFoundError`` for something missing,
``FileExistsError`` for something that must not be overwritten, ``OSError`` for storage).
Messages always name the file, key, tensor, block or rank involved.
"""

from __future__ import annotations


class MithrilError(Exception):
    """Base class of every error raised by mithril_async."""


class InvalidFormat(MithrilError, ValueError):
    """Bytes that are not a valid blob/manifest/config of a version we can read."""


class UnknownFormatVersion(InvalidFormat):
    """A versioned format whose version this reader does not know."""


class ChecksumMismatch(InvalidFormat):
    """Stored data whose checksum does not match; never returned to the caller."""

    def __init__(self, where: str, expected: int | str, actual: int | str) -> None:
        self.where = where
        self.expected = expected
        self.actual = actual
        super().__init__(f"checksum mismatch in {where}: expected {expected}, got {actual}")


class MissingPrevious(MithrilError, FileNotFoundError):
    """A delta needs a base (previous checkpoint) that is absent or is not the right one."""


class UnsupportedDtype(MithrilError, TypeError):
    """A dtype without a fixed width (or otherwise unknown) was given to the codec."""


class ShapeMismatch(MithrilError, ValueError):
    """A tensor's shape differs from what a manifest, base or target says it must be."""


class CompressionError(MithrilError):
    """The entropy coder or a transform failed."""


class ConfigError(MithrilError, ValueError):
    """Invalid configuration; the message names the offending key."""


class StorageError(MithrilError, OSError):
    """A store operation failed (after retries where applicable)."""


class KeyNotFound(StorageError, FileNotFoundError):
    """A key that does not exist in a store."""


class KeyExists(StorageError, FileExistsError):
    """A conditional write found the key already present."""


class PreconditionFailed(StorageError):
    """A compare-and-swap write lost against another writer (ETag changed)."""


class UnsafeKey(InvalidFormat):
    """A key that is absolute, contains ``..`` or otherwise escapes the store root."""


class StepAlreadyExists(MithrilError, FileExistsError):
    """A save for a step (or version) that is already committed; nothing is overwritten."""


class VersionNotFound(MithrilError, FileNotFoundError):
    """A restore target (alias, version id, step, manifest key) that does not resolve."""


class SaveInProgress(MithrilError, RuntimeError):
    """A save was requested while another is in flight and the config says to refuse."""


class SaveFailed(MithrilError, RuntimeError):
    """A background save failed; ``__cause__`` carries the original error."""


class DistributedError(MithrilError, RuntimeError):
    """A multi-rank save or restore failed on some rank; the message names the rank."""


class WorkerExited(MithrilError, RuntimeError):
    """The checkpoint worker process died while it ran a save; the message says how it ended
    (exit status or signal). That save failed; the next one starts a new worker."""


__all__ = [
    "ChecksumMismatch",
    "CompressionError",
    "ConfigError",
    "DistributedError",
    "InvalidFormat",
    "KeyExists",
    "KeyNotFound",
    "MissingPrevious",
    "MithrilError",
    "PreconditionFailed",
    "SaveFailed",
    "SaveInProgress",
    "ShapeMismatch",
    "StepAlreadyExists",
    "StorageError",
    "UnknownFormatVersion",
    "UnsafeKey",
    "UnsupportedDtype",
    "VersionNotFound",
    "WorkerExited",
]


class UnsupportedStateType(MithrilError, TypeError):
    """A value inside a state dict that cannot be stored without pickle (named by path)."""


__all__ += ["UnsupportedStateType"]


class ErrorBoundExceeded(MithrilError, ValueError):
    """A lossy codec cannot keep a tensor within the user's error bound (non-finite values
    included: no finite bound covers them); the message names the tensor/block and both errors."""


__all__ += ["ErrorBoundExceeded"]


class SnapshotTorn(MithrilError, RuntimeError):
    """An overlapped snapshot's source tensor changed in place before its background copy
    finished (a change that did not go through a guarded ``optimizer.step()``); the save is
    dropped rather than written torn. The message names the tensors."""


__all__ += ["SnapshotTorn"]


class LockTimeout(StorageError, TimeoutError):
    """A store lock stayed held by someone else for longer than the configured bound; the
    message names the lock file (another process, or a user who can open it, holds it)."""


__all__ += ["LockTimeout"]


class ClaimLost(StorageError):
    """A save's version claim stopped being its own before the commit (removed or replaced by
    another process that judged it abandoned), or a blob it wrote is gone or has the wrong
    size: nothing is published. The message names the claim or blob."""


__all__ += ["ClaimLost"]


class HostMemoryExceeded(MithrilError, MemoryError):
    """A save would need more host memory than ``[checkpointing.pipeline] host_memory_mib``
    allows for something it cannot split (a huge non-tensor value, a tensor that must be
    copied whole, the lossy tier's reconstruction); nothing is published. The message names
    the value and both sizes."""


__all__ += ["HostMemoryExceeded"]


class RestoreIncomplete(MithrilError, RuntimeError):
    """A restore failed after it had begun writing into the live tensors: the live state is
    partially overwritten (some tensors hold the version's values, others their old ones) and
    must not be trained on; restore again (another version) or restart. ``__cause__`` is the
    error that stopped it. A restore that fails before writing raises that error itself (the
    live state untouched). The message names the version and what was written."""

    partially_overwritten = True


__all__ += ["RestoreIncomplete"]


class NonFiniteState(MithrilError, ValueError):
    """A save found NaN or Inf in floating tensors that ``nonfinite_allow`` does not allow,
    under ``[checkpointing] nonfinite = "fail"``: nothing was committed. The message names
    each item, tensor and its counts; ``tensors`` maps ``"<item>/<tensor>"`` to ``(NaNs,
    Infs)``."""

    tensors: dict[str, tuple[int, int]] = {}  # noqa: RUF012 - replaced per instance

    def __init__(self, message: str, tensors: dict[str, tuple[int, int]] | None = None) -> None:
        super().__init__(message)
        self.tensors = dict(tensors or {})


__all__ += ["NonFiniteState"]


class OutputExists(MithrilError, FileExistsError):
    """An output folder (an export's) is not empty or is a file, and ``force`` was not
    given: nothing was written."""


__all__ += ["OutputExists"]


class TrainerExited(MithrilError, RuntimeError):
    """Raised in a checkpoint worker: its training process went away before the snapshot it
    handed over was complete (an overlapped copy still running), so that save is abandoned
    and nothing of it is published."""
