"""The pydantic models of the ``[checkpointing]`` table and of each table nested in it, with the
checks their keys need (host memory, signal names, the default of ``pipeline.process``).

Unknown keys inside ``[checkpointing]`` are errors. A field's ``#:`` comment is its
documentation: the configuration reference (``tools/config_reference.py``) renders it with
the field's type, default and bounds. Loading a file is :mod:`mithril_async.config`.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mithril_async.errors import ConfigError
from mithril_async.tiers.config import TiersConfig


def no_blank(v: list[str], what: str) -> list[str]:
    """A list of names or patterns in which an empty one is surely a mistake."""
    if any(not x.strip() for x in v):
        raise ValueError(f"{what} must not be empty strings")
    return v


class StrictTable(BaseModel):
    """A table of ``[checkpointing]``: unknown keys are errors, assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class CompressionConfig(StrictTable):
    """How blobs are encoded (``[checkpointing.compression]``)."""

    enabled: bool = True
    level: int = Field(3, ge=-7, le=22, description="zstd level")
    byte_grouping: bool = True
    chunk_mib: float = Field(4.0, gt=0, le=1024, description="chunk size compressed in parallel")
    #: blobs smaller than 32 chunks use chunks of 1/32 of the blob (at least 1 MiB): each codec
    #: thread's scratch and the encoded chunks in flight scale with the chunk size, which for a
    #: small state is a visible fraction of it (42 MB MiniLM: peak 1.7x -> 1.3x the state)
    auto_chunk: bool = True
    threads: int | None = Field(None, ge=1, le=256, description="codec threads; None = all cores")
    delta: bool = False
    keyframe_interval: int = Field(8, ge=1, le=10_000)
    #: what a delta version is XORed against: the previous version (smallest deltas, a restore
    #: reads up to keyframe_interval blobs) or the chain's keyframe (a restore reads at most
    #: 2 blobs; deltas grow with the distance to the keyframe)
    delta_base: Literal["previous", "keyframe"] = "previous"
    #: store tensors unchanged since the previous version once (None: on when delta is on)
    dedup: bool | None = None
    #: in a delta version, a tensor is XORed against its base only if that is estimated to
    #: save this fraction of its full encoding, else stored in full (a delta that does not pay
    #: still makes a restore decode its base). None: 0.0 for delta_base = "previous" (smallest
    #: bytes), 0.1 for "keyframe" (AdamW moments then go in full: restores read ~1.3 blobs)
    delta_min_gain: float | None = Field(None, ge=0.0, lt=1.0)

    @property
    def effective_delta_min_gain(self) -> float:
        if self.delta_min_gain is not None:
            return self.delta_min_gain
        return 0.1 if self.delta_base == "keyframe" else 0.0


class PipelineConfig(StrictTable):
    """Background pipeline bounds (``[checkpointing.pipeline]``)."""

    max_inflight_mib: int = Field(256, ge=8, description="encoded bytes in flight per save")
    on_busy: Literal["wait", "skip", "error"] = "wait"
    #: "blocking": save() returns once every tensor is copied. "overlapped": tensors that only
    #: ``optimizer.step()`` changes (the optimizers' parameters and state) are copied by a
    #: background thread while the loop computes; the next ``step()`` waits for that copy
    #: (save/overlap.py). Any other in-place change meanwhile fails the save (SnapshotTorn).
    snapshot: Literal["blocking", "overlapped"] = "blocking"
    #: added to the nice value of the background threads (event loop, codec, file writes; not
    #: the overlapped copy, which a step may wait on): when training and checkpoint both want
    #: the cores, training gets them, and a save takes longer. Pays when saves are rare next
    #: to their cost; with saves close together the next save() waits for the slower one.
    #: 0 (default) keeps the priority of the training process.
    background_nice: int = Field(0, ge=0, le=19)
    #: temp files / multipart uploads older than this are a killed writer's, removed at start
    #: (younger ones may belong to another live writer of the same run and are left alone)
    orphan_age_s: float = Field(600.0, ge=0)
    #: an unfinished version's claim is abandoned once its heartbeat (renewed by the live
    #: writer every min(30 s, claim_stale_s / 4)) is older than this; only then may another
    #: process (start-up cleanup, ``mithril gc``) remove it (claims.py: CLAIM_STALE_S)
    claim_stale_s: float = Field(300.0, gt=0)
    #: a hard cap on the host memory the pipeline holds at any moment (staging buffers, the
    #: encode window, write buffers, delta bases), in MiB. None (default): unlimited, today's
    #: path (staging buffers of the whole state, 2x with delta chains). A state whose staged
    #: path would not fit streams through a ring of reused chunk buffers instead (each chunk
    #: encoded and written before its buffer is reused), as keyframes (save/snapshot.py).
    #: At least :func:`min_host_memory` (six chunks + 4 MiB: 28 MiB with chunk_mib = 4).
    host_memory_mib: int | None = Field(None, ge=1)
    #: where a save's background part runs: "worker", a checkpoint process of its own per
    #: training process (mithril_async/worker/: encoding, writes, commit and retention leave
    #: the training process, which keeps only the snapshot, staged in shared memory), or
    #: "inline", threads of the training process. Saves of a configuration a worker cannot
    #: serve (a store/coordinator/retention object passed to the manager, a platform
    #: without memfd_create) run inline when
    #: "worker" is only the default (the manager logs why and says so in
    #: ``manager.process``), and are refused with a ConfigError when the key says "worker"
    #: (worker_required). The default is "worker" (a busy training thread and
    #: the save do not slow each other through the GIL: docs/BENCHMARKS.md); the
    #: environment variable ``MITHRIL_PROCESS`` changes the default only
    process: Literal["worker", "inline"] = Field(default_factory=lambda: default_process())

    @property
    def worker_required(self) -> bool:
        """``process = "worker"`` was set in the configuration itself (the key present, or
        assigned), not taken from the default or ``MITHRIL_PROCESS``: then a configuration
        a worker cannot serve is refused instead of run inline (see ``process``)."""
        return self.process == "worker" and "process" in self.model_fields_set


def default_process() -> Literal["worker", "inline"]:
    """The default of ``[checkpointing.pipeline] process``: "worker", or what the environment
    variable ``MITHRIL_PROCESS`` says ("worker" / "inline"; e.g. for a platform or a test
    suite where starting a process per manager is unwanted). A key in the configuration
    always wins; any other value of the variable is refused, never ignored."""
    value = os.environ.get("MITHRIL_PROCESS", "").strip().lower()
    if value in ("", "worker"):
        return "worker"
    if value == "inline":
        return "inline"
    raise ConfigError(f"MITHRIL_PROCESS={value!r}: expected 'worker' or 'inline'")


def min_host_memory(chunk_mib: float) -> int:
    """The smallest ``host_memory_mib`` (bytes) a save can run in: one staging slot of a chunk;
    one codec thread's own buffers (two chunks and 2 MiB); two chunks for a chunk in flight
    (its encoding, then the encoded block until written); one for a blob's first bytes while
    its version number is agreed; 2 MiB of write buffers and blob header."""
    return 6 * max(1, int(chunk_mib * (1 << 20))) + (4 << 20)


def check_host_memory(comp: CompressionConfig, pipe: PipelineConfig) -> None:
    """:class:`ConfigError` when ``host_memory_mib`` is below :func:`min_host_memory`."""
    if pipe.host_memory_mib is None:
        return
    need = min_host_memory(comp.chunk_mib)
    if pipe.host_memory_mib << 20 < need:
        raise ConfigError(
            f"checkpointing.pipeline.host_memory_mib = {pipe.host_memory_mib} is below the "
            f"minimum of {-(-need >> 20)} MiB: six chunks of compression.chunk_mib = "
            f"{comp.chunk_mib} (a staging slot, a codec thread's buffers, a chunk in flight, "
            "a blob's first bytes) plus 4 MiB; raise it or lower chunk_mib")


#: signals ``save_on_signals`` refuses, and why
REFUSED_SIGNALS = {
    **dict.fromkeys(("SIGKILL", "SIGSTOP"), "it cannot be caught"),
    **dict.fromkeys(("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGTRAP", "SIGSYS"),
                    "it reports a fault of this process, not a request to stop"),
    **dict.fromkeys(("SIGCHLD", "SIGCONT", "SIGURG", "SIGWINCH", "SIGTSTP", "SIGTTIN",
                     "SIGTTOU"), "it does not end a process by default"),
}


def check_signal_names(names: list[str]) -> list[str]:
    """``names`` if each is a signal this platform has (``"SIGTERM"``, as ``signal.Signals``
    spells it), given once, that ends a process by default and can be caught."""
    known = {s.name for s in signal.Signals}
    for name in names:
        if name not in known:
            raise ValueError(f"{name!r} is not a signal name of this platform (use names such "
                             "as \"SIGTERM\", \"SIGUSR1\")")
        if name in REFUSED_SIGNALS:
            raise ValueError(f"{name} cannot become a save: {REFUSED_SIGNALS[name]}")
    if len(set(names)) != len(names):
        raise ValueError(f"a signal is named twice in {names}")
    return names


class RestoreConfig(StrictTable):
    """How restores verify what they write into the live state (``[checkpointing.restore]``).

    ``verify = "block"`` (default): one read of each blob; every block's header and payload
    hash (and the blob's header, index and trailer hashes) checked before a byte of it is
    decoded into a live tensor, its decoded bytes' hash after. A damaged block found after
    others were written raises ``RestoreIncomplete`` (the live state partially overwritten;
    ``restore(fallback=True)`` then restores an older version over all of it). Uncompressed
    (safetensors) blobs carry one whole-file hash only, so they are still verified whole
    before the first write. ``"whole"``: every blob verified whole before the first write,
    then read again and decoded: a damaged version leaves the live state untouched, at the
    price of a second read (and, over S3, decoding into fresh tensors: memory = the state).
    """

    verify: Literal["block", "whole"] = "block"


class RemoteConfig(StrictTable):
    """S3-compatible remote (``[checkpointing.remote]``)."""

    bucket: str = Field(min_length=3, max_length=63)
    prefix: str = ""
    endpoint_url: str | None = None
    region_name: str | None = None
    part_mib: int = Field(8, ge=5, le=5 * 1024)
    max_concurrency: int = Field(8, ge=1, le=64)
    max_attempts: int = Field(5, ge=1, le=20)
    mode: Literal["mirror", "remote_only"] = "mirror"


class LossyConfig(StrictTable):
    """Opt-in lossy tier (``[checkpointing.lossy]``): ExCP-style lossy deltas of weights and
    Adam moments (mithril_async/lossy/excp.py), one MLDC blob per version and rank.

    Only float tensors with a role (a model parameter, or its optimizer ``exp_avg`` /
    ``exp_avg_sq``) of at least ``min_numel`` elements are coded lossily; everything else —
    buffers, step counters, non-float and small tensors, and names matching ``exact`` — stays
    in the lossless blobs, bit for bit.
    """

    enabled: bool = False
    density: float = Field(0.05, gt=0, le=1, description="fraction of residual entries kept")
    v_density: float | None = Field(None, gt=0, le=1, description="exp_avg_sq; None = density")
    bits: int = Field(4, ge=2, le=8, description="width of kept weight residuals")
    moment_bits: int | None = Field(None, ge=2, le=8, description="moments; None = bits")
    block_size: int = Field(256, ge=8, le=1 << 20)
    keyframe_every: int = Field(10, ge=1, le=10_000, description="versions per lossy chain")
    joint: bool = True
    v_log: bool = True
    fisher_weighted: bool = True
    min_numel: int = Field(1024, ge=1)
    level: int = Field(3, ge=1, le=22, description="zstd level of masks and lossless parts")
    keyframe: Literal["lossless", "quantized"] = "lossless"
    keyframe_bits: int = Field(8, ge=2, le=8, description="quantized keyframes: weights")
    keyframe_moment_bits: int = Field(6, ge=2, le=8, description="quantized keyframes: moments")
    #: weights and exp_avg: |x̂ - x| <= error_rel * max|x| per tensor (None: unbounded)
    error_rel: float | None = Field(None, gt=0, lt=1)
    #: exp_avg_sq (v_log): |v̂ - v| <= v_error_rel * v elementwise (None: unbounded)
    v_error_rel: float | None = Field(None, gt=0, lt=1)
    #: glob patterns of "<item>/<tensor>" names (e.g. "model/head.*") never stored lossily
    exact: list[str] = Field(default_factory=list)

    @field_validator("exact")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        return no_blank(v, "exact patterns")

    @model_validator(mode="after")
    def _v_bound_needs_log(self) -> LossyConfig:
        if self.v_error_rel is not None and not self.v_log:
            raise ValueError("v_error_rel needs v_log = true (it is a log-domain bound)")
        return self


class CheckpointingConfig(StrictTable):
    """The ``[checkpointing]`` table (runs, aliases, retention, plus compression,
    pipeline, remote, restore and lossy)."""

    runs_path: str = "runs"
    #: the run saves go to and restores read; None: the runs folder's current run, continued
    #: when it exists (a restarted job resumes), else a new run that becomes the current one
    #: (mithril_async/current_run.py)
    run_id: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
        description="None = the runs folder's current run (resumed), or a new one")
    #: start a new run even though the runs folder has a current one (it becomes the current
    #: run; the earlier run is kept as it was). Only without run_id
    new_run: bool = False
    ckpting_save_iter: int = Field(1000, ge=1)
    resume_optimizer: bool = True
    best_metric_name: str | None = None
    best_mode: Literal["min", "max"] = "min"
    keep_last: int | None = Field(None, ge=1)
    keep_best: int | None = Field(None, ge=1)
    keep_every_n_steps: int | None = Field(None, ge=1)
    compression: CompressionConfig = Field(default_factory=lambda: CompressionConfig())
    pipeline: PipelineConfig = Field(default_factory=lambda: PipelineConfig())
    remote: RemoteConfig | None = None
    restore: RestoreConfig = Field(default_factory=lambda: RestoreConfig())
    lossy: LossyConfig = Field(default_factory=lambda: LossyConfig())
    #: NaN / Inf in a floating or complex tensor (counted as the encoder reads it; a complex
    #: element's parts each count): "hold" commits the version (nothing is lost) but
    #: ``latest`` and ``best`` never move to it and a warning names the tensors; "fail"
    #: fails the save with NonFiniteState (nothing committed); "allow" only
    #: records the counts (the manifest's blobs, ``nonfinite``)
    nonfinite: Literal["hold", "fail", "allow"] = "hold"
    #: "<item>/<tensor>" globs (fnmatch, case-sensitive) of tensors whose NaN / Inf are
    #: legitimate (an attention mask's -inf, ``"model/*attn_mask*"``): counted, never held
    nonfinite_allow: list[str] = Field(default_factory=list)
    #: signals that become a save (mithril_async/preemption.py): the handler records one, the
    #: next ``should_save()`` returns True, and once that save is durable the signal takes
    #: its previous effect. Empty by default: a library does not change how a process reacts
    #: to signals unless asked (``["SIGTERM"]`` is what SLURM and Kubernetes send before
    #: their SIGKILL; SLURM's ``--signal=USR1@90`` sends SIGUSR1)
    save_on_signals: list[str] = Field(default_factory=list)
    #: after the save a signal asked for is durable, deliver the signal with its previous
    #: disposition (the process ends as it would have); false: ``manager.preempted`` becomes
    #: True and the loop decides
    exit_after_signal_save: bool = True
    #: seconds after a signal within which a save must be asked for (a ``save()`` call);
    #: past them the signal is delivered anyway (a loop that never asks is not kept alive).
    #: Below the 30 s SLURM (KillWait) and Kubernetes (terminationGracePeriodSeconds) leave
    #: before their SIGKILL, so a save asked for late still has time to finish
    signal_grace_s: float = Field(20.0, gt=0, le=86_400)
    #: [checkpointing.tiers]: saves commit on a node-local folder, are copied to peer nodes
    #: and uploaded to [checkpointing.remote] in the background; restores take each file from
    #: the fastest tier holding it (mithril_async/tiers/); None: off
    tiers: TiersConfig | None = None
    #: other top-level tables of the TOML recorded with the run (runs/<id>/config/), secret-
    #: looking values redacted; by default only [checkpointing] is (other tables hold secrets)
    record_config: list[str] = Field(default_factory=list)
    #: when the manager closes (cleanly, rank 0, after it committed a version), export the
    #: run's latest version to Hugging Face's format (mithril_async/export/hf.py): true into
    #: <runs_path>/<run_id>/export/hf, a string into that folder; either replaces the
    #: previous export there
    export_hf_on_close: bool | str = False

    @field_validator("record_config")
    @classmethod
    def _table_names(cls, v: list[str]) -> list[str]:
        return no_blank(v, "table names")

    @field_validator("nonfinite_allow")
    @classmethod
    def _allow_globs(cls, v: list[str]) -> list[str]:
        return no_blank(v, "nonfinite_allow patterns")

    @field_validator("export_hf_on_close")
    @classmethod
    def _export_folder(cls, v: bool | str) -> bool | str:
        if isinstance(v, str) and not v.strip():
            raise ValueError("must be true, false or a folder, not an empty string")
        return v

    @model_validator(mode="after")
    def _new_run_without_run_id(self) -> CheckpointingConfig:
        if self.new_run and self.run_id is not None:
            raise ValueError(f"new_run = true starts a run with a fresh id, but run_id = "
                             f"{self.run_id!r} names one: set one of the two")
        return self

    @model_validator(mode="after")
    def _budget_fits_a_chunk(self) -> CheckpointingConfig:
        try:
            check_host_memory(self.compression, self.pipeline)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        return self

    @field_validator("runs_path")
    @classmethod
    def _runs_path_not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("runs_path must not be empty")
        return v

    @field_validator("save_on_signals")
    @classmethod
    def _signal_names(cls, v: list[str]) -> list[str]:
        return check_signal_names(v)


class Config(BaseModel):
    """A whole configuration: ``checkpointing`` plus any other tables, kept verbatim."""

    model_config = ConfigDict(extra="allow")

    checkpointing: CheckpointingConfig = Field(default_factory=lambda: CheckpointingConfig())
    #: the TOML text this config was loaded from (saved into runs/<id>/config/train.toml)
    source_toml: str | None = Field(default=None, exclude=True)

    @property
    def extra(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @model_validator(mode="after")
    def _recorded_tables_exist(self) -> Config:
        missing = [n for n in self.checkpointing.record_config
                   if n != "checkpointing" and n not in (self.model_extra or {})]
        if missing:  # a typo would silently record nothing
            raise ValueError(f"checkpointing.record_config names {missing}, which the "
                             "configuration does not have")
        return self
