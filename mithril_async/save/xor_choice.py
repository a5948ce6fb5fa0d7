"""Per-tensor choice in a delta version: XOR against the base, or store the tensor in full.

Why: an XOR delta only pays when the base predicts the tensor. Weights move little between
steps (their sign/exponent planes barely change, so the delta's planes code small), but Adam's
moments are rewritten every step: a step-to-step XOR of fp32 ``exp_avg`` saves little, and one
against a keyframe several steps back can be *larger* than the tensor itself
(docs/BENCHMARKS.md, bench_delta). A delta that does not pay still costs a restore the decode
of its base, so storing such tensors in full makes versions both smaller and cheaper to
restore: a blob with no delta tensor reads no base at all.

The choice is an estimate made before encoding, on a strided sample of at most
:data:`SAMPLE_ELEMENTS` elements: the sample is put through the chunk coder's byte transform
once plain and once XORed with the base's sample, and each plane costs its order-0 entropy
(capped at 8 bits a byte: the coder stores near-random planes raw). That is what the float
coder reaches (rANS on skewed planes, raw on random ones); for sparse XOR planes zstd does
better still, so the estimate errs towards storing in full, never towards a delta that grows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mithril_async.codec.chunk import CodecParams, choose_transform, plane_sizes, transform_bytes
from mithril_async.codec.entropy import sample_entropy

__all__ = ["SAMPLE_ELEMENTS", "TINY_BYTES", "delta_pays", "estimated_bytes"]

U8 = np.ndarray[Any, np.dtype[np.uint8]]

#: elements sampled per tensor (evenly strided) to estimate both encodings
SAMPLE_ELEMENTS = 32768
#: tensors smaller than this are stored in full in delta versions: the saving is a few bytes,
#: the dependency on the base (a whole blob to decode at restore) is not
TINY_BYTES = 4096

def _sample(raw: U8, itemsize: int) -> U8:
    """At most ``SAMPLE_ELEMENTS`` whole elements of ``raw``, evenly strided, contiguous."""
    n = raw.size // itemsize
    if n <= SAMPLE_ELEMENTS:
        return raw[:n * itemsize]
    step = n // SAMPLE_ELEMENTS
    rows = raw[:n * itemsize].reshape(n, itemsize)[::step][:SAMPLE_ELEMENTS]
    return np.ascontiguousarray(rows).reshape(-1)


def estimated_bytes(sample: U8, dtype_name: str, base: U8 | None, params: CodecParams) -> float:
    """Order-0 estimate of the stored size of ``sample`` (XORed with ``base`` when given)."""
    transform, width, _ = choose_transform(dtype_name, sample.size, params)
    planes = transform_bytes(sample, transform, width, base)
    total, off = 0.0, 0
    for n in plane_sizes(transform, width, planes.size):
        total += min(8.0, sample_entropy(planes[off:off + n])) * n / 8
        off += n
    return total


def delta_pays(raw: U8, base: U8, dtype_name: str, itemsize: int, params: CodecParams,
               min_gain: float) -> bool:
    """Whether XOR-coding ``raw`` against ``base`` is estimated to save at least ``min_gain``
    of the tensor's full encoding (``raw``/``base``: the two tensors' bytes, same layout).

    Tensors under :data:`TINY_BYTES` never pay. Non-float tensors (integers, bools: coded with
    zstd, whose LZ matches an order-0 estimate cannot see) keep the delta.
    """
    if raw.size < TINY_BYTES:
        return False
    _, _, mode = choose_transform(dtype_name, raw.size, params)
    if mode != "float":
        return True
    s, b = _sample(raw, itemsize), _sample(base, itemsize)
    full = estimated_bytes(s, dtype_name, None, params)
    delta = estimated_bytes(s, dtype_name, b, params)
    return delta <= (1.0 - min_gain) * full
