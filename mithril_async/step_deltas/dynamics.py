"""Multi-step set arithmetic over sparse deltas, one layer at a time (numpy, no sorting).

Why layer-major with dense scratch arrays
    Net K-step change, cumulative change, mask overlap and reuse all need, per position, "was
    it touched", "value before the first touch" and "value after the last touch". Sorting and
    merging COO arrays (``np.unique``/``np.intersect1d``) costs O(n log n) per window and pair
    and is far too slow for real models; dense per-layer scratch arrays (masks, bit arrays
    and counters of the layer's size) make every pass O(changed positions): K-step windows
    slide (add the entering step, remove the leaving one) instead of being recomputed, so all
    windows of one K cost two passes over the deltas. Memory is ~16 bytes per parameter of the
    *largest layer* (for 4-byte values).

Values are compared as raw bits (``old``/``new`` are integer views), as the recorder does.
The all-pairs mask-overlap matrix costs ``steps x changed positions``; above ``budget``
lookups it is estimated on a fixed pseudo-random subset of positions (a multiplicative hash of
the flat index, the same subset for every step, so intersections stay consistent).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

#: per layer and step: (indices int64 ascending, old bits, new bits)
Pieces = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass
class Totals:
    """Counts summed over layers; indices are positions in the list of recorded steps."""

    num_steps: int
    k_windows: dict[int, list[int]]  # k -> window start positions
    overlap_pos: list[int]
    cum_net: np.ndarray = field(init=False)
    cum_union: np.ndarray = field(init=False)
    jac_inter: np.ndarray = field(init=False)  # |mask_{t-1} & mask_t|
    k_net: dict[int, np.ndarray] = field(init=False)
    k_union: dict[int, np.ndarray] = field(init=False)
    ov_inter: np.ndarray = field(init=False)
    ov_size: np.ndarray = field(init=False)  # sampled |mask_t| of the overlap steps
    reuse: np.ndarray = field(init=False)  # reuse[n] = positions changed in exactly n steps
    overlap_fraction: float = 1.0

    def __post_init__(self) -> None:
        s = self.num_steps
        self.cum_net = np.zeros(s, np.int64)
        self.cum_union = np.zeros(s, np.int64)
        self.jac_inter = np.zeros(s, np.int64)
        self.k_net = {k: np.zeros(len(w), np.int64) for k, w in self.k_windows.items()}
        self.k_union = {k: np.zeros(len(w), np.int64) for k, w in self.k_windows.items()}
        p = len(self.overlap_pos)
        self.ov_inter = np.zeros((p, p), np.int64)
        self.ov_size = np.zeros(p, np.int64)
        self.reuse = np.zeros(s + 1, np.int64)


def overlap_fraction(sizes: Sequence[int], budget: float) -> float:
    """Fraction of positions to sample so the overlap matrix costs about ``budget``."""
    cost = float(len(sizes)) * float(sum(sizes))
    return 1.0 if cost <= budget else max(budget / cost, 1e-6)


def _sample(idx: np.ndarray, frac: float) -> np.ndarray:
    if frac >= 1.0:
        return idx
    h = (idx.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
    return idx[h < np.uint64(int(frac * (1 << 24)))]


def accumulate_layer(tot: Totals, numel: int, by_pos: dict[int, Pieces]) -> None:
    """Add one layer's contribution (``by_pos``: step position -> pieces) to ``tot``."""
    if not by_pos:
        return
    bits = next(iter(by_pos.values()))[1].dtype
    touched = np.zeros(numel, bool)
    first_old = np.zeros(numel, bits)
    last_new = np.zeros(numel, bits)
    order = sorted(by_pos)

    # cumulative: incremental net/union counts, carried forward between touches
    d_net = np.zeros(tot.num_steps, np.int64)
    d_union = np.zeros(tot.num_steps, np.int64)
    counts = np.zeros(numel, np.int32)
    for t in order:
        idx, old, new = by_pos[t]
        was = touched[idx]
        before = int(np.count_nonzero(was & (first_old[idx] != last_new[idx])))
        newly = ~was
        first_old[idx[newly]] = old[newly]
        touched[idx] = True
        last_new[idx] = new
        after = int(np.count_nonzero(first_old[idx] != last_new[idx]))
        d_net[t] = after - before
        d_union[t] = int(np.count_nonzero(newly))
        counts[idx] += 1
    tot.cum_net += np.cumsum(d_net)
    tot.cum_union += np.cumsum(d_union)
    hist = np.bincount(counts, minlength=tot.num_steps + 1)
    tot.reuse[1:] += hist[1 : tot.num_steps + 1]
    touched[:] = False
    del counts

    # consecutive-step Jaccard intersections (exact)
    for t in order:
        prev = by_pos.get(t - 1)
        if prev is None:
            continue
        touched[prev[0]] = True
        tot.jac_inter[t] += int(np.count_nonzero(touched[by_pos[t][0]]))
        touched[prev[0]] = False

    # K-step windows, sliding: first_old now holds every touched position's value before
    # its first touch, i.e. the base; two replays of the steps (``lead`` = state after the
    # window's last step, ``lag`` = state before its first) differ exactly at the positions
    # with a net change, and ``cnt`` counts touches inside the window for the union.
    for k, starts in tot.k_windows.items():
        if k == 1:  # one step: no replay needed
            for w, i in enumerate(starts):
                p = by_pos.get(i)
                if p is not None:
                    tot.k_net[k][w] += int(np.count_nonzero(p[1] != p[2]))
                    tot.k_union[k][w] += int(p[0].size)
            continue
        _slide(tot, k, starts, by_pos, first_old)
    del first_old, last_new

    # all-pairs overlap of the selected steps (sampled positions above the budget)
    sub = [_sample(by_pos[t][0], tot.overlap_fraction) if t in by_pos else None
           for t in tot.overlap_pos]  # fmt: skip
    for a, ia in enumerate(sub):
        if ia is None:
            continue
        tot.ov_size[a] += ia.size
        touched[ia] = True
        for b, ib in enumerate(sub):
            if ib is not None:
                tot.ov_inter[a, b] += int(np.count_nonzero(touched[ib]))
        touched[ia] = False


def _slide(
    tot: Totals, k: int, starts: Sequence[int], by_pos: dict[int, Pieces], base: np.ndarray
) -> None:
    """Net/union counts of the windows ``[i, i + k)`` in O(changed positions) per step."""
    lead, lag = base.copy(), base.copy()
    cnt = np.zeros(base.size, np.int32)
    lead_at = lag_at = -1
    mism = union = 0
    for w, i in enumerate(starts):
        while lead_at < i + k - 1:
            lead_at += 1
            p = by_pos.get(lead_at)
            if p is not None:
                idx, new = p[0], p[2]
                mism -= int(np.count_nonzero(lead[idx] != lag[idx]))
                lead[idx] = new
                mism += int(np.count_nonzero(lead[idx] != lag[idx]))
                c = cnt[idx]
                union += int(np.count_nonzero(c == 0))
                cnt[idx] = c + 1
        while lag_at < i - 1:
            lag_at += 1
            p = by_pos.get(lag_at)
            if p is not None:
                idx, new = p[0], p[2]
                mism -= int(np.count_nonzero(lead[idx] != lag[idx]))
                lag[idx] = new
                mism += int(np.count_nonzero(lead[idx] != lag[idx]))
                c = cnt[idx] - 1
                cnt[idx] = c
                union -= int(np.count_nonzero(c == 0))
        tot.k_net[k][w] += mism
        tot.k_union[k][w] += union
