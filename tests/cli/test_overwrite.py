"""Issue 19.12: the commands that write a file never replace one silently; ``--force`` does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mithril_async.cli import main


@pytest.fixture
def mckp(tmp_path: Path) -> Path:
    src = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(12.0).reshape(3, 4)}, str(src))
    assert main(["compress", str(src), "-o", str(tmp_path / "x.mckp")]) == 0
    src.unlink()
    return tmp_path / "x.mckp"


@pytest.mark.parametrize("explicit_out", [False, True])
def test_decompress_refuses_to_overwrite_without_force(mckp: Path, explicit_out: bool,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    out = mckp.with_suffix(".safetensors")  # the default output
    out.write_bytes(b"the user's own file")
    args = ["decompress", str(mckp), *(["-o", str(out)] if explicit_out else [])]
    assert main(args) == 1
    assert "exists (use --force" in capsys.readouterr().err
    assert out.read_bytes() == b"the user's own file"
    assert main([*args, "--force"]) == 0
    assert torch.equal(load_file(str(out))["w"], torch.arange(12.0).reshape(3, 4))
