"""ExCP-style lossy deltas: prune + quantise residuals of weights and Adam moments jointly.

Why: consecutive checkpoints differ by a few optimizer steps, and most of that difference does
not matter for where training goes next. ExCP (Li et al., ICML 2024) keeps only the important
part of the weight residual, prunes the optimizer moments *with the same mask* (joint
shrinking: a weight whose update is dropped needs no fresh momentum either), and quantises what
is left. We follow that shape with three choices made for a checkpoint manager:

* **Closed loop.** Every residual is taken against the previous *reconstruction* (what a reader
  will have), not the previous true state, so errors do not accumulate along the chain; the
  encoder runs the decoder's own update rule to track that reconstruction.
* **Fisher-weighted pruning.** Weight residuals are ranked by ``|Δw| * sqrt(v)`` (``v`` =
  Adam's second moment, a diagonal Fisher estimate): dropping ``Δw_i`` costs about
  ``v_i * Δw_i²`` in loss. The top ``density`` fraction is kept; one bitmap per parameter group
  (weight + exp_avg, and exp_avg_sq unless ``v_log``) is stored once.
* **Per-moment reference.** exp_avg forgets quickly (β1 = 0.9), so its residual against the last
  reconstruction can be larger than the value itself; it is coded against whichever of
  {previous reconstruction, zero} leaves the smaller residual.
* **exp_avg_sq in the log domain** (``v_log``, default). Adam divides by ``sqrt(v)``, so what
  matters is v's *relative* error, and v drifts densely (every entry decays/grows every step),
  which a sparse mask cannot follow. So v is coded as ``log2 v`` residuals: a dense per-row
  (dim 0) median shift (fp16, one per row) plus a sparse top-``v_density`` correction with its
  own mask, which keeps v's relative error and the resumed loss close deep into a chain
  (measured: docs/FORMAT.md, HPΔKV section). ``v_log=False`` gives
  the plain ExCP joint linear rule. exp_avg_sq always stays ``>= 0``.

**Keyframes** start every chain (every ``keyframe_every`` checkpoints). By default they are
lossless. ``keyframe_mode="quantized"`` quantises them too, because with lossless keyframes the
keyframe dominates a chain's size (a delta is far smaller: docs/BENCHMARKS.md): weights and
exp_avg at ``keyframe_bits`` / ``keyframe_moment_bits`` per value (uniform per block), and
exp_avg_sq as ``log2 v`` at ``keyframe_moment_bits`` over its non-zero entries (its relative
error is what Adam feels; zeros stay exactly zero). Such a keyframe reuses the delta record
shape (``ref="zero"``, a mask of the coded entries), so the byte format is unchanged.

**Error bounds** (optional): ``error_rel`` bounds ``|x̂ - x| <= error_rel * max|x|`` for every
weight and exp_avg entry, ``v_error_rel`` bounds exp_avg_sq's elementwise relative error (log
domain only). They hold for keyframes and deltas alike: a delta adds every entry whose residual
exceeds the bound to the kept set (density is then a floor, not a cap) and quantises kept
values with an enforced :class:`ErrorBound`.

Tensors the user marked exact, non-float tensors, tensors without a role and small tensors are
always stored losslessly — lossy is never applied to them. The checkpoint says
``has_quantization`` in :meth:`LossyCheckpoint.manifest_fields`.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import zstandard

from mithril_async.errors import InvalidFormat, MissingPrevious
from mithril_async.lossy.lossless import decode_lossless, encode_lossless, inflate_exact
from mithril_async.lossy.quant import ErrorBound, QuantizedTensor, dequantize, quantize

Role = Literal["param", "exp_avg", "exp_avg_sq"]
_LOSSY_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

__all__ = [
    "LossyCheckpoint",
    "LossyDeltaConfig",
    "LossyDeltaDecoder",
    "LossyDeltaEncoder",
    "Role",
    "TensorRecord",
    "decode_chain",
]


@dataclass(frozen=True)
class LossyDeltaConfig:
    """Knobs of the lossy delta tier (all recorded in the manifest)."""

    density: float = 0.05  # fraction of each parameter's residual entries kept
    bits: int = 4  # width of kept weight residual values
    moment_bits: int | None = None  # width for exp_avg / exp_avg_sq (default: ``bits``)
    block_size: int = 256  # quantiser block over the kept values
    keyframe_every: int = 10  # every Nth checkpoint is a lossless keyframe
    joint: bool = True  # exp_avg reuses the weight's mask (ExCP joint shrinking)
    v_log: bool = True  # exp_avg_sq: log2-domain residual with its own mask (see module doc)
    v_density: float | None = None  # fraction of exp_avg_sq entries kept (default: density)
    fisher_weighted: bool = True  # rank weight residuals by |Δw|·sqrt(v)
    min_numel: int = 1024  # smaller tensors are stored losslessly
    exact: tuple[str, ...] = ()  # names / glob patterns never stored lossily
    level: int = 3  # zstd level for masks, codes and lossless parts
    keyframe_mode: str = "lossless"  # or "quantized" (see module doc)
    keyframe_bits: int = 8  # quantised keyframes: width of weight values
    keyframe_moment_bits: int = 6  # quantised keyframes: width of exp_avg and log2(exp_avg_sq)
    error_rel: float | None = None  # weights / exp_avg: |x̂ - x| <= error_rel * max|x|
    v_error_rel: float | None = None  # exp_avg_sq (v_log): |v̂ - v| <= v_error_rel * v

    def __post_init__(self) -> None:
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density}")
        if self.v_density is not None and not 0.0 < self.v_density <= 1.0:
            raise ValueError(f"v_density must be in (0, 1], got {self.v_density}")
        if self.keyframe_every < 1:
            raise ValueError(f"keyframe_every must be >= 1, got {self.keyframe_every}")
        for b in (self.bits, self.moment_bits, self.keyframe_bits, self.keyframe_moment_bits):
            if b is not None and not 2 <= b <= 8:
                raise ValueError(f"bits must be in 2..8, got {b}")
        if self.keyframe_mode not in ("lossless", "quantized"):
            raise ValueError(f"keyframe_mode must be lossless|quantized, got {self.keyframe_mode}")
        for name in ("error_rel", "v_error_rel"):
            e = getattr(self, name)
            if e is not None and not 0.0 < e < 1.0:
                raise ValueError(f"{name} must be in (0, 1), got {e}")

    def is_exact(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pat) for pat in self.exact)


@dataclass
class TensorRecord:
    """How one tensor of one checkpoint is stored."""

    kind: Literal["lossless", "delta"]
    shape: tuple[int, ...]
    dtype: torch.dtype
    blob: bytes = b""  # lossless payload
    ref: Literal["prev", "zero"] = "prev"
    domain: Literal["linear", "log2"] = "linear"
    row_shift: torch.Tensor | None = None  # log2 domain: per-row (dim 0) shift, applied densely
    mask_key: str = ""  # which entry of ``LossyCheckpoint.masks`` selects the kept entries
    values: QuantizedTensor | None = None

    @property
    def nbytes(self) -> int:
        shift = 0 if self.row_shift is None else 2 * self.row_shift.numel()
        return len(self.blob) + (self.values.nbytes if self.values is not None else 0) + 16 + shift


@dataclass
class LossyCheckpoint:
    """One encoded checkpoint of a chain (``index`` counts from the chain's first keyframe)."""

    index: int
    keyframe: bool
    config: LossyDeltaConfig
    records: dict[str, TensorRecord] = field(default_factory=dict)
    masks: dict[str, tuple[int, bytes]] = field(default_factory=dict)  # key -> (kept, zstd bitmap)
    raw_bytes: int = 0

    @property
    def nbytes(self) -> int:
        """Estimated stored size (payloads + small fixed overheads); the exact size is
        ``len(mithril_async.lossy.serial.checkpoint_to_bytes(ckpt))``."""
        return sum(r.nbytes for r in self.records.values()) + sum(
            len(b) + 8 for _, b in self.masks.values())

    @property
    def ratio(self) -> float:
        return self.raw_bytes / max(self.nbytes, 1)

    def manifest_fields(self) -> dict[str, Any]:
        """What the manifest must record: the opt-in flag and exactly how data was made."""
        lossy = [n for n, r in self.records.items() if r.kind == "delta"]
        return {
            "has_quantization": bool(lossy),
            "lossy": {"codec": "excp_delta", "version": 1, "keyframe": self.keyframe,
                      "index": self.index, "config": asdict(self.config), "tensors": lossy},
        }


def _pack_mask(idx: torch.Tensor, n: int, level: int) -> bytes:
    bitmap = np.zeros(n, dtype=bool)
    bitmap[idx.numpy()] = True
    return zstandard.ZstdCompressor(level=level).compress(np.packbits(bitmap).tobytes())


def _unpack_mask(kept: int, blob: bytes, n: int) -> torch.Tensor:
    raw = inflate_exact(blob, (n + 7) // 8, "lossy delta mask")
    idx = np.flatnonzero(np.unpackbits(np.frombuffer(raw, np.uint8))[:n])
    if idx.size != kept:
        raise InvalidFormat(f"lossy delta mask selects {idx.size} entries, header says {kept}")
    return torch.from_numpy(idx.astype(np.int64))


_LOG_FLOOR = 1e-30
#: share of an error bound given to the quantiser; the rest absorbs float32 rounding of the
#: reconstruction (``ref + value``, ``exp2``) that the quantiser cannot see
_SLACK = 0.9


def _log2(x: torch.Tensor) -> torch.Tensor:
    return torch.log2(x.clamp(min=0.0) + _LOG_FLOOR)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0] if t.dim() > 1 else 1, -1)


def _apply(ref: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, role: Role,
           domain: str, row_shift: torch.Tensor | None = None) -> torch.Tensor:
    """The one reconstruction rule (float32), shared by encoder and decoder."""
    out = ref.reshape(-1).clone()
    if row_shift is not None:
        shift = row_shift.to(torch.float32)[:, None]
        out = (torch.exp2(_log2(_rows(ref)) + shift) - _LOG_FLOOR).reshape(-1)
    if domain == "log2":
        out[idx] = torch.exp2(_log2(out[idx]) + values.to(torch.float32)) - _LOG_FLOOR
    else:
        out[idx] += values.to(torch.float32)
    if role == "exp_avg_sq":
        out.clamp_(min=0.0)
    return out.reshape(ref.shape)


class _Chain:
    """Reconstruction state shared by encoder and decoder: float32 copies, last index."""

    def __init__(self) -> None:
        self.recon: dict[str, torch.Tensor] = {}
        self.index = -1

    def apply(self, ckpt: LossyCheckpoint, roles: Mapping[str, tuple[str, Role]]) -> None:
        if not ckpt.keyframe and (not self.recon or ckpt.index != self.index + 1):
            raise MissingPrevious(
                f"lossy delta {ckpt.index} needs checkpoint {ckpt.index - 1} of its chain, "
                f"have {self.index if self.recon else 'none'}")
        new: dict[str, torch.Tensor] = {}
        for name, rec in ckpt.records.items():
            if rec.kind == "lossless":
                new[name] = decode_lossless(rec.blob, rec.shape, rec.dtype)
                continue
            prev = self.recon.get(name)
            if rec.ref == "zero" and rec.row_shift is None:  # quantised keyframe / fresh moment
                prev = torch.zeros(rec.shape, dtype=torch.float32)
            if prev is None or tuple(prev.shape) != rec.shape:
                raise MissingPrevious(f"lossy delta for {name} has no matching previous tensor")
            if rec.values is None or rec.mask_key not in ckpt.masks:
                raise InvalidFormat(f"lossy delta record for {name} lacks values or mask")
            kept, blob = ckpt.masks[rec.mask_key]
            idx = _unpack_mask(kept, blob, math.prod(rec.shape))
            vals = dequantize(rec.values)
            if vals.numel() != idx.numel():
                raise InvalidFormat(f"{name}: {vals.numel()} values for {idx.numel()} entries")
            prev = prev.to(torch.float32)
            if rec.row_shift is not None and rec.row_shift.numel() != _rows(prev).shape[0]:
                raise InvalidFormat(f"{name}: {rec.row_shift.numel()} row shifts for "
                                    f"{_rows(prev).shape[0]} rows")
            ref = prev if rec.ref == "prev" else torch.zeros_like(prev)
            new[name] = _apply(ref, idx, vals, roles.get(name, ("", "param"))[1], rec.domain,
                               rec.row_shift)
        self.recon = new
        self.index = ckpt.index

    def state(self, records: Mapping[str, TensorRecord]) -> dict[str, torch.Tensor]:
        return {n: self.recon[n].to(records[n].dtype) for n in records}


class LossyDeltaEncoder:
    """Encodes successive training states into a chain of lossy checkpoints.

    ``roles`` maps a tensor name to ``(group, role)``: e.g. ``"w" -> ("w", "param")``,
    ``"opt.w.exp_avg" -> ("w", "exp_avg")``. Tensors without a role are stored losslessly.
    """

    def __init__(self, config: LossyDeltaConfig | None = None) -> None:
        self.config = config or LossyDeltaConfig()
        self._chain = _Chain()
        self._count = 0

    def mark(self) -> tuple[dict[str, torch.Tensor], int, int]:
        """The encoder's position, for :meth:`rollback` if the checkpoint is never stored.

        Why: every delta is coded against the previous *reconstruction*; a checkpoint a
        caller failed to commit must not become the base of the next one. Cheap: ``encode``
        replaces the reconstruction dict, it never mutates it."""
        return self._chain.recon, self._chain.index, self._count

    def rollback(self, mark: tuple[dict[str, torch.Tensor], int, int]) -> None:
        self._chain.recon, self._chain.index, self._count = mark

    def reset(self) -> None:
        """Forget the chain: the next checkpoint is a keyframe."""
        self._chain = _Chain()
        self._count = 0

    @property
    def reconstruction(self) -> dict[str, torch.Tensor]:
        """What a reader decodes for the last encoded checkpoint (float32 copies)."""
        return self._chain.recon

    def _lossy_ok(self, name: str, t: torch.Tensor, roles: Mapping[str, tuple[str, Role]]) -> bool:
        c = self.config
        return (name in roles and t.dtype in _LOSSY_DTYPES and t.numel() >= c.min_numel
                and not c.is_exact(name))

    def encode(self, state: Mapping[str, torch.Tensor],
               roles: Mapping[str, tuple[str, Role]]) -> LossyCheckpoint:
        c = self.config
        prev = self._chain.recon
        keyframe = (self._count % c.keyframe_every == 0 or set(prev) != set(state) or any(
            tuple(prev[n].shape) != tuple(t.shape) for n, t in state.items()))
        index = 0 if keyframe else self._chain.index + 1
        ckpt = LossyCheckpoint(index=index, keyframe=keyframe, config=c,
                               raw_bytes=sum(t.numel() * t.element_size() for t in state.values()))
        groups: dict[str, dict[Role, str]] = {}
        quantized_kf = keyframe and c.keyframe_mode == "quantized"
        for name, t in state.items():
            if (keyframe and not quantized_kf) or not self._lossy_ok(name, t, roles):
                ckpt.records[name] = TensorRecord("lossless", tuple(t.shape), t.dtype,
                                                  blob=encode_lossless(t, c.level))
            else:
                group, role = roles[name]
                groups.setdefault(group, {})[role] = name
        for group, members in groups.items():
            if quantized_kf:
                self._encode_keyframe_group(ckpt, group, members, state)
            else:
                self._encode_group(ckpt, group, members, state)
        self._chain.apply(ckpt, roles)
        self._count += 1
        return ckpt

    def _encode_group(self, ckpt: LossyCheckpoint, group: str, members: dict[Role, str],
                      state: Mapping[str, torch.Tensor]) -> None:
        c = self.config
        deltas: dict[Role, tuple[torch.Tensor, Literal["prev", "zero"]]] = {}
        log_v = c.v_log and "exp_avg_sq" in members
        row_shifts: dict[str, torch.Tensor] = {}
        for role, name in members.items():
            x = state[name].detach().to("cpu", torch.float32)
            prev = self._chain.recon[name].to(torch.float32)
            if role == "exp_avg_sq" and log_v:
                r = _rows(_log2(x) - _log2(prev))
                shift = r.median(dim=1).values.to(torch.float16)
                row_shifts[name] = shift
                deltas[role] = ((r - shift.to(torch.float32)[:, None]).reshape(x.shape), "prev")
                continue
            d_prev = x - prev
            if role != "param" and float(x.pow(2).sum()) < float(d_prev.pow(2).sum()):
                deltas[role] = (x, "zero")
            else:
                deltas[role] = (d_prev, "prev")
        masks: dict[Role, torch.Tensor] = {}
        limits = {role: self._limit(role, state[members[role]], log_v) for role in deltas}
        owner: dict[Role, Role] = {}
        for role in deltas:
            own = role == "param" or "param" not in deltas or not c.joint or (
                role == "exp_avg_sq" and log_v)
            owner[role] = role if own else "param"
        for role, (delta, _) in deltas.items():
            if owner[role] != role:
                continue
            score = delta.reshape(-1).abs()
            if role == "param" and c.fisher_weighted and "exp_avg_sq" in members:
                v = state[members["exp_avg_sq"]].detach().to("cpu", torch.float32).reshape(-1)
                score = score * v.clamp(min=0).sqrt()
            density = c.v_density if role == "exp_avg_sq" and c.v_density else c.density
            k = max(1, math.ceil(density * score.numel()))
            keep = torch.zeros(score.numel(), dtype=torch.bool)
            keep[torch.topk(score, k, sorted=False).indices] = True
            # an error bound turns every residual it would not tolerate into a kept entry
            for member, (mdelta, _) in deltas.items():
                lim = limits[member]
                if owner[member] == role and lim is not None:
                    keep |= mdelta.reshape(-1).abs() > _SLACK * lim
            masks[role] = torch.nonzero(keep).reshape(-1)
        for role, (delta, ref) in deltas.items():
            key_role = owner[role]
            idx = masks[key_role]
            key = f"{group}/{key_role}"
            if key not in ckpt.masks:
                ckpt.masks[key] = (idx.numel(), _pack_mask(idx, delta.numel(), c.level))
            bits = c.bits if role == "param" else (c.moment_bits or c.bits)
            name = members[role]
            lim = limits[role]
            values = quantize(delta.reshape(-1)[idx], bits=bits, block_size=c.block_size,
                              bound=None if lim is None else ErrorBound(max_abs=_SLACK * lim),
                              name=name)
            t = state[name]
            domain: Literal["linear", "log2"] = (
                "log2" if role == "exp_avg_sq" and log_v else "linear")
            ckpt.records[name] = TensorRecord("delta", tuple(t.shape), t.dtype, ref=ref,
                                              mask_key=key, values=values, domain=domain,
                                              row_shift=row_shifts.get(name))


    def _limit(self, role: Role, t: torch.Tensor, log_v: bool) -> float | None:
        """The error a residual of ``t`` may be left with (None: no bound configured).

        exp_avg_sq in the log domain: ``log2(1 + v_error_rel)`` (a relative bound on v);
        otherwise ``error_rel * max|t|`` (the :class:`ErrorBound` ``rel`` convention)."""
        c = self.config
        if role == "exp_avg_sq" and log_v:
            return None if c.v_error_rel is None else math.log2(1.0 + c.v_error_rel)
        if c.error_rel is None:
            return None
        return c.error_rel * float(t.detach().abs().max()) if t.numel() else 0.0

    def _encode_keyframe_group(self, ckpt: LossyCheckpoint, group: str,
                               members: dict[Role, str], state: Mapping[str, torch.Tensor]
                               ) -> None:
        """A quantised keyframe: every entry coded against zero (see module doc)."""
        c = self.config
        log_v = c.v_log and "exp_avg_sq" in members
        for role, name in members.items():
            t = state[name]
            x = t.detach().to("cpu", torch.float32).reshape(-1)
            domain: Literal["linear", "log2"] = "linear"
            if role == "exp_avg_sq" and log_v:
                idx = torch.nonzero(x > 0).reshape(-1)  # zeros stay exactly zero
                vals = _log2(x[idx]) - _log2(torch.zeros(1))
                key, domain = f"{group}/{role}", "log2"
            else:
                idx = torch.arange(x.numel())
                vals = x
                key = f"{group}/all"
            if key not in ckpt.masks:
                ckpt.masks[key] = (idx.numel(), _pack_mask(idx, x.numel(), c.level))
            lim = self._limit(role, t, log_v)
            bits = c.keyframe_bits if role == "param" else c.keyframe_moment_bits
            values = quantize(vals, bits=bits, block_size=c.block_size,
                              bound=None if lim is None else ErrorBound(max_abs=_SLACK * lim),
                              name=name)
            ckpt.records[name] = TensorRecord("delta", tuple(t.shape), t.dtype, ref="zero",
                                              mask_key=key, values=values, domain=domain)


class LossyDeltaDecoder:
    """Replays a chain (keyframe first, then deltas in order) into full states."""

    def __init__(self) -> None:
        self._chain = _Chain()

    def decode(self, ckpt: LossyCheckpoint,
               roles: Mapping[str, tuple[str, Role]]) -> dict[str, torch.Tensor]:
        self._chain.apply(ckpt, roles)
        return self._chain.state(ckpt.records)


def decode_chain(chain: Iterable[LossyCheckpoint],
                 roles: Mapping[str, tuple[str, Role]]) -> dict[str, torch.Tensor]:
    """The state after the last checkpoint of ``chain`` (which must start at a keyframe)."""
    dec = LossyDeltaDecoder()
    out: dict[str, torch.Tensor] = {}
    for ckpt in chain:
        out = dec.decode(ckpt, roles)
    if not out:
        raise MissingPrevious("empty lossy chain: no keyframe to decode from")
    return out
