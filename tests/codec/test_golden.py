"""Today's reader still decodes the golden MCKP files of every earlier format version."""

from __future__ import annotations

import pytest

from mithril_async.codec import decompress_state_dict, rans, read_info
from tests.codec._helpers import same_bits
from tests.golden.make_golden import HERE, NAMES, expected


@pytest.mark.parametrize("name", NAMES)
def test_golden_file_decodes_bitwise(name: str) -> None:
    blob = (HERE / f"{name}.mckp").read_bytes()
    info = read_info(blob)
    assert info.version == 1 and info.metadata == {"golden": name}
    prev = expected("v1_base") if name == "v1_delta" else None
    out = decompress_state_dict(blob, previous=prev)
    want = expected(name)
    assert list(out) == list(want)
    for k, v in want.items():
        assert same_bits(out[k], v), f"{name}: {k}"


def test_golden_rans_file_decodes_without_the_native_coder(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rans, "NATIVE", False)  # the pure-Python reference decoder
    out = decompress_state_dict((HERE / "v1_rans.mckp").read_bytes())
    assert all(same_bits(out[k], v) for k, v in expected("v1_rans").items())
