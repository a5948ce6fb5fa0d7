"""Generate the golden MCKP files of this directory (run once per format version).

``python -m tests.golden.make_golden`` writes the missing ``vN_*.mckp`` of today's version N
(between them every plane method: raw, constant, zstd, rANS and Huffman-only deflate, every
transform, and a delta; ``v1_*`` were written by version 1, ``v2_*`` by version 2);
``tests/codec/test_golden.py`` regenerates the same tensors with :func:`expected` and checks
that today's reader decodes every golden file to them bit for bit, so a future reader that
cannot read old checkpoints fails CI.  Never regenerate an existing version's files: add new
ones next to them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from mithril_async.codec import CodecParams, compress_state_dict, rans

HERE = Path(__file__).resolve().parent


def _weights(seed: int, n: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(n).astype(np.float32)
                            * 0.02)


def version_of(name: str) -> int:
    """The MCKP version golden file ``name`` was written with (its ``vN_`` prefix)."""
    return int(name.split("_", 1)[0][1:])


def expected(name: str) -> dict[str, torch.Tensor]:
    """The state dict stored in golden file ``name`` (deterministic, no torch RNG)."""
    name = "v1_" + name.split("_", 1)[1]  # every version stores the same tensors
    if name in ("v1_dtypes", "v1_zstd_nogroup", "v1_deflate"):
        rng = np.random.default_rng(1)
        return {
            "w.f32": _weights(2, 300).reshape(20, 15),
            "w.bf16": _weights(3, 256).bfloat16(),
            "w.f16": _weights(4, 100).half(),
            "w.f64": _weights(5, 40).double(),
            "ids.i64": torch.arange(50, dtype=torch.int64) * 3 - 7,
            "mask.bool": torch.from_numpy(rng.integers(0, 2, 33).astype(np.bool_)),
            "q.u8": torch.from_numpy(rng.integers(0, 256, 64, dtype=np.uint8)),
            "f8": _weights(6, 64).to(torch.float8_e4m3fn),
            "c64": torch.complex(_weights(7, 10), _weights(8, 10)),
            "scalar": torch.tensor(1.5),
            "empty": torch.empty(0, 3),
            "bf16.as.f32": _weights(9, 128).bfloat16().float(),
        }
    if name in ("v1_rans", "v1_rans32"):  # planes big enough for the rANS coder, few values
        rng = np.random.default_rng(13)
        sign = np.where(rng.random(17000) < 0.5, -1.0, 1.0)
        v = sign * 2.0 ** -rng.geometric(0.4, 17000) * (1 + rng.integers(0, 2, 17000) / 2)
        return {"w.bf16": torch.from_numpy(v.astype(np.float32)).bfloat16()}
    base = {"w": _weights(10, 512), "b": _weights(11, 64).bfloat16(), "n": torch.tensor(7)}
    if name == "v1_base":
        return base
    if name == "v1_delta":
        return {"w": base["w"] + _weights(12, 512) * 1e-3, "b": (base["b"].float() * 1.01)
                .bfloat16(), "n": torch.tensor(8), "extra": torch.ones(2, 2)}
    raise KeyError(name)


#: v1_rans holds plane method 4 (RANS, written before RANS32 existed), v1_rans32 method 5.
#: Version 2 (XXH3-64 chunk hashes) has the same files but v2_rans (nothing writes method 4).
NAMES = ["v1_dtypes", "v1_zstd_nogroup", "v1_deflate", "v1_rans", "v1_rans32", "v1_base",
         "v1_delta", "v2_dtypes", "v2_zstd_nogroup", "v2_deflate", "v2_rans32", "v2_base",
         "v2_delta"]


def build(name: str) -> bytes:
    """Encode golden file ``name`` with the parameters it was made with (today's writer: only
    for files of today's version)."""
    tag, name = name.split("_", 1)[0], "v1_" + name.split("_", 1)[1]
    if name == "v1_deflate":  # as written where the native rANS coder is not built
        saved = rans.NATIVE
        rans.NATIVE = False
        try:
            return compress_state_dict(expected(name), chunk_bytes=512, step=3,
                                       metadata={"golden": f"{tag}_deflate"})
        finally:
            rans.NATIVE = saved
    if name == "v1_zstd_nogroup":
        p = CodecParams(byte_grouping=False, entropy="zstd", chunk_bytes=256)
        return compress_state_dict(expected(name), params=p, step=1,
                                   metadata={"golden": f"{tag}_zstd_nogroup"})
    prev = expected("v1_base") if name == "v1_delta" else None
    chunk = 1 << 20 if name in ("v1_rans", "v1_rans32") else 512
    return compress_state_dict(expected(name), previous=prev, chunk_bytes=chunk, step=2,
                               metadata={"golden": f"{tag}_{name.split('_', 1)[1]}"})


def main() -> int:
    from mithril_async.codec.container import VERSION

    for name in NAMES:
        if version_of(name) != VERSION:
            continue
        path = HERE / f"{name}.mckp"
        if path.exists() and "--force" not in sys.argv:
            print(f"{path.name} exists; not overwritten")
            continue
        path.write_bytes(build(name))
        print(f"wrote {path.name} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
