"""The Orbax integration's files read as untrusted input: the index of every blob is checked,
the pieces of each param must cover it exactly once, damage names the parameter and file.

No JAX: these are the layout and blob modules alone, on hand-made blobs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from mithril_async.codec.state_dict import compress_state_dict
from mithril_async.errors import ChecksumMismatch, ConfigError, InvalidFormat
from mithril_async.integrations.orbax.blobs import SavedItem, local_folder, write_blob
from mithril_async.integrations.orbax.layout import (
    INDEX_KEY,
    ParamRecord,
    Piece,
    blob_name,
    is_blob_name,
    piece_tensor_name,
)

W = (np.arange(32, dtype=np.float32).reshape(8, 4) / 7).astype(ml_dtypes.bfloat16)
TOP, BOTTOM = ((0, 4), (0, 4)), ((4, 8), (0, 4))


def _half(folder: Path, process: int, box: Any, *, shape: tuple[int, ...] = (8, 4)) -> str:
    """Process ``process``'s blob holding ``box`` of param ``w``."""
    part = W[box[0][0]:box[0][1]]
    tensor = piece_tensor_name("w", box)
    rec = ParamRecord("w", "jax", shape, "bfloat16", None, None, [Piece("", tensor, box)])
    return write_blob(str(folder), process, {tensor: part}, [rec.index_entry()], level=3,
                      threads=1)


def _raw_blob(folder: Path, tensors: dict[str, Any], index: Any) -> None:
    blob = compress_state_dict(tensors, metadata={INDEX_KEY: index}, threads=1)
    (folder / blob_name(0)).write_bytes(blob)


def _entry(**over: Any) -> dict[str, Any]:
    e = ParamRecord("w", "jax", (8, 4), "bfloat16", None, None,
                    [Piece("", piece_tensor_name("w", TOP), TOP)]).index_entry()
    e.update(over)
    return e


def test_pieces_of_every_process_are_merged_and_read_back(tmp_path: Path) -> None:
    _half(tmp_path, 0, TOP)
    _half(tmp_path, 1, BOTTOM)
    with SavedItem(str(tmp_path)) as item:
        rec = item.records["w"]
        assert rec.shape == (8, 4) and sorted(p.box for p in rec.pieces) == [TOP, BOTTOM]
        got = item.read([("w", p) for p in rec.pieces], threads=2)
    parts = {p.box: a for p, a in got.items()}
    assert np.array_equal(np.concatenate([parts[TOP], parts[BOTTOM]]).view(np.uint16),
                          W.view(np.uint16))
    assert SavedItem.open(str(tmp_path / "nothing")) is None
    (tmp_path / "empty").mkdir()
    assert SavedItem.open(str(tmp_path / "empty")) is None


def test_a_missing_blob_or_overlapping_pieces_are_refused(tmp_path: Path) -> None:
    _half(tmp_path, 0, TOP)
    with pytest.raises(InvalidFormat, match=r"hold 16 of its 32 elements"):
        SavedItem(str(tmp_path))
    _half(tmp_path, 1, TOP)
    with pytest.raises(InvalidFormat, match="overlap"):
        SavedItem(str(tmp_path))


@pytest.mark.parametrize(("index", "match"), [
    ({"layout": 99, "params": []}, "layout 99"),
    ({"layout": 1, "params": {}}, "params is not a list"),
    ({"layout": 1, "params": [_entry(kind="torch")]}, "unknown kind"),
    ({"layout": 1, "params": [_entry(dtype="float128")]}, "unknown dtype"),
    ({"layout": 1, "params": [_entry(shape=[8, -4])]}, "non-negative integers"),
    ({"layout": 1, "params": [_entry(pieces=[{"tensor": "w[0:4,0:4]", "box": [[0, 4]]}])]},
     "wrong rank"),
    ({"layout": 1, "params": [_entry(pieces=[{"tensor": "w[0:4,0:4]",
                                              "box": [[0, 4], [0, 9]]}])]}, "not inside"),
    ({"layout": 1, "params": [_entry(pieces=[{"tensor": "other", "box": [[0, 4], [0, 4]]}])]},
     "is not in the blob"),
    ({"layout": 1, "params": [_entry(dtype="float16")]}, "the index says float16"),
    ({"layout": 1, "params": [_entry(sharding=3)]}, "not a string"),
])
def test_a_malformed_index_is_invalid_format_naming_the_file(tmp_path: Path, index: Any,
                                                             match: str) -> None:
    _raw_blob(tmp_path, {piece_tensor_name("w", TOP): W[:4]}, index)
    with pytest.raises(InvalidFormat, match=match) as e:
        SavedItem(str(tmp_path))
    assert str(tmp_path) in str(e.value)


def test_blobs_that_disagree_about_a_param_are_refused(tmp_path: Path) -> None:
    _half(tmp_path, 0, TOP)
    _half(tmp_path, 1, BOTTOM, shape=(8, 5))
    with pytest.raises(InvalidFormat, match="described differently"):
        SavedItem(str(tmp_path))


def test_damage_names_the_parameter_and_the_file(tmp_path: Path) -> None:
    name = _half(tmp_path, 0, TOP)
    _half(tmp_path, 1, BOTTOM)
    path = tmp_path / name
    data = bytearray(path.read_bytes())
    with SavedItem(str(tmp_path)) as item:
        blob = item.blobs[name]
        ref = blob.info.index[(0, 0)]
        pieces = [("w", p) for p in item.records["w"].pieces]
    data[ref.offset + ref.length - 1] ^= 1  # the block's last payload byte
    path.write_bytes(bytes(data))
    with SavedItem(str(tmp_path)) as item, pytest.raises(ChecksumMismatch) as e:
        item.read(pieces, threads=1)
    assert "parameter 'w'" in str(e.value) and str(path) in str(e.value)
    data[20] ^= 1  # the header: the blob does not even open
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match=str(path)):
        SavedItem(str(tmp_path))


def test_names_and_folders() -> None:
    assert is_blob_name(blob_name(3)) and blob_name(3).startswith("mithril-p00003-")
    assert not is_blob_name(".tmp-" + blob_name(0)) and not is_blob_name("mithril-p0-x.mckp")
    assert blob_name(0) != blob_name(0)
    with pytest.raises(ConfigError, match="gs://bucket/ckpt"):
        local_folder("gs://bucket/ckpt")
