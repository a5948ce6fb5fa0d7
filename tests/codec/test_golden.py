"""Today's reader still decodes the golden MCKP files of every earlier format version."""

from __future__ import annotations

import pytest

from mithril_async.codec import decompress_state_dict, rans, read_info
from mithril_async.codec.container_read import block_from_bytes
from mithril_async.codec.entropy import PlaneMethod
from tests.codec._helpers import same_bits
from tests.golden.make_golden import HERE, NAMES, expected, version_of


@pytest.mark.parametrize("name", NAMES)
def test_golden_file_decodes_bitwise(name: str) -> None:
    blob = (HERE / f"{name}.mckp").read_bytes()
    info = read_info(blob)
    assert info.version == version_of(name) and info.metadata == {"golden": name}
    prev = expected("v1_base") if name.endswith("_delta") else None
    out = decompress_state_dict(blob, previous=prev)
    want = expected(name)
    assert list(out) == list(want)
    for k, v in want.items():
        assert same_bits(out[k], v), f"{name}: {k}"


def _plane_methods(blob: bytes) -> set[int]:
    info = read_info(blob)
    return {m for ref in info.index.values()
            for m, _ in block_from_bytes(blob[ref.offset:ref.offset + ref.length], ref,
                                         info)[0].planes}


@pytest.mark.parametrize(("name", "method"), [("v1_rans", PlaneMethod.RANS),
                                              ("v1_rans32", PlaneMethod.RANS32),
                                              ("v2_rans32", PlaneMethod.RANS32)])
def test_golden_rans_files_decode_without_the_native_coder(
        monkeypatch: pytest.MonkeyPatch, name: str, method: PlaneMethod) -> None:
    blob = (HERE / f"{name}.mckp").read_bytes()
    assert method in _plane_methods(blob)  # the file really exercises this rANS layout
    monkeypatch.setattr(rans, "NATIVE", False)  # the pure-Python reference decoders
    out = decompress_state_dict(blob)
    assert all(same_bits(out[k], v) for k, v in expected(name).items())
