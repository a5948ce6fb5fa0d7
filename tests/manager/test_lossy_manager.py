"""The lossy tier ([checkpointing.lossy]) through a real CheckpointManager on a tmp dir."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from mithril_async import (
    CheckpointManager,
    ChecksumMismatch,
    Config,
    ConfigError,
    MissingPrevious,
    parse_config,
)
from mithril_async.catalog import open_catalog
from mithril_async.restore.reader import read_version
from mithril_async.storage.memory import MemoryStore
from tests.manager.conftest import make_state, state_equal, train_step

ConfigFactory = Callable[..., Config]
ERR, V_ERR = 0.02, 0.25
LOSSY = f"""[checkpointing.lossy]
enabled = true
density = 0.05
keyframe_every = 4
keyframe = "quantized"
error_rel = {ERR}
v_error_rel = {V_ERR}
exact = ["model/emb.*"]
"""
#: tensors of TinyNet that are coded lossily with LOSSY (>= 1024 elements, not exact)
LOSSY_PARAMS = {"mlp.0.weight": 1, "mlp.2.weight": 3}  # name -> optimizer state index


def _manifest(tmp_path: Path, vid: str) -> dict[str, Any]:
    return json.loads((tmp_path / "runs" / "run1" / "versions" / vid / "manifest.json")
                      .read_text())


def _save(cfg: Config, n: int, store: Any = None, process: str | None = None
          ) -> tuple[list[dict[str, Any]], Any]:
    """Train and save ``n`` versions; return the true states and the live objects
    (``process``: where the saves must run)."""
    model, opt, batcher = make_state()
    snaps = []
    kw = {"store": store} if store is not None else {}
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}, **kw) as m:
        assert process is None or m.process == process
        for step in range(1, n + 1):
            train_step(model, opt, batcher)
            before = {"model": copy.deepcopy(model.state_dict()),
                      "opt": copy.deepcopy(opt.state_dict())}
            m.save_nowait(step).result()
            # a save never mutates the user's tensors
            assert state_equal(before["model"], model.state_dict())
            assert state_equal(before["opt"], opt.state_dict())
            snaps.append(before)
    return snaps, (model, opt)


def _check_bounds(truth: dict[str, Any], model: torch.nn.Module,
                  opt: torch.optim.Optimizer) -> None:
    """Lossy tensors within the configured bounds (and really lossy); the rest bit-exact."""
    got_m, got_o = model.state_dict(), opt.state_dict()
    lossy_seen = False
    for name, t in truth["model"].items():
        if name in LOSSY_PARAMS:
            err = float((got_m[name] - t).abs().max())
            assert err <= ERR * float(t.abs().max()), name
            lossy_seen |= err > 0
        else:  # exact-marked (emb), small (biases, norm) tensors: bit for bit
            assert torch.equal(got_m[name], t), name
    for idx, st in truth["opt"]["state"].items():
        name = next((n for n, i in LOSSY_PARAMS.items() if i == idx), None)
        for key, t in st.items():
            g = got_o["state"][idx][key]
            if name is None or key == "step":
                assert torch.equal(g, t), (idx, key)
            elif key == "exp_avg":
                assert float((g - t).abs().max()) <= ERR * float(t.abs().max())
            else:  # exp_avg_sq: elementwise relative bound
                assert float(((g - t).abs() / t.clamp(min=1e-30)).max()) <= V_ERR
    assert lossy_seen  # the lossy tier was really applied


@pytest.mark.parametrize("process", ["inline", "worker"])
def test_lossy_versions_restore_within_bounds(make_config: ConfigFactory,
                                              make_worker_config: ConfigFactory,
                                              tmp_path: Path, process: str) -> None:
    """Encoded in the training process or by the checkpoint worker, the same chain."""
    cfg = (make_worker_config if process == "worker" else make_config)(LOSSY)
    snaps, (model, opt) = _save(cfg, 6, process=process)
    mans = [_manifest(tmp_path, f"v{i:06d}") for i in range(1, 7)]
    assert all(m["has_quantization"] is True for m in mans)
    assert [m["lossy"]["keyframe"] for m in mans] == [True, False, False, False, True, False]
    bases = [(m["lossy"]["shards"][0]["base"] or {}).get("version_id") for m in mans]
    assert bases == [None, "v000001", "v000002", "v000003", None, "v000005"]
    assert mans[0]["lossy"]["params"]["keyframe_mode"] == "quantized"
    assert mans[0]["resume"]["exact"] is False
    assert "optimizer/state/1/exp_avg_sq" in mans[1]["lossy"]["quantized"]
    assert not any("emb" in n for n in mans[1]["lossy"]["tensors"])
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        for step in (6, 3, 1, 5):  # latest, mid-chain delta, quantised keyframes
            assert m.restore_sync(step) == step
            _check_bounds(snaps[step - 1], model, opt)
    # the manager-free reader (CLI restore) decodes the same chain
    _, trees, _ = asyncio_run(read_version(open_catalog(tmp_path / "runs", "run1"), 3))
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        m.restore_sync(3)
    assert state_equal(trees["model"], model.state_dict())


def asyncio_run(coro: Any) -> Any:
    import asyncio

    return asyncio.run(coro)


def test_lossless_keyframes_are_bit_exact(make_config: ConfigFactory, tmp_path: Path) -> None:
    cfg = make_config(LOSSY.replace('"quantized"', '"lossless"'))
    snaps, (model, opt) = _save(cfg, 2)
    assert "has_quantization" not in _manifest(tmp_path, "v000001")  # nothing quantised
    assert _manifest(tmp_path, "v000002")["has_quantization"] is True
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        m.restore_sync(1)
        assert state_equal(snaps[0]["model"], model.state_dict())
        assert state_equal(snaps[0]["opt"], opt.state_dict())
        m.restore_sync(2)
        _check_bounds(snaps[1], model, opt)


def test_disabled_lossy_is_the_lossless_path(make_config: ConfigFactory, tmp_path: Path) -> None:
    cfg = make_config("[checkpointing.lossy]\nenabled = false\ndensity = 0.01\n")
    snaps, (model, opt) = _save(cfg, 2)
    man = _manifest(tmp_path, "v000002")
    assert "has_quantization" not in man and "lossy" not in man
    assert not list((tmp_path / "runs").rglob("*.mldc"))
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        m.restore_sync(1)
    assert state_equal(snaps[0]["model"], model.state_dict())
    assert state_equal(snaps[0]["opt"], opt.state_dict())


def test_lossy_with_nothing_eligible_says_so_once(make_config: ConfigFactory, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A model without named_parameters() has no roles: saves stay lossless, with a warning."""

    class Plain:
        def __init__(self) -> None:
            self.sd = {"w": torch.randn(64, 64)}

        def state_dict(self) -> dict[str, torch.Tensor]:
            return self.sd

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.sd = dict(sd)

    cfg = make_config(LOSSY)
    plain = Plain()
    with caplog.at_level("WARNING", logger="mithril_async"), \
            CheckpointManager(cfg, {"model": plain}) as m:
        for step in (1, 2):
            m.save_nowait(step).result()
    warned = [r for r in caplog.records if "no tensor of rank 0 qualifies" in r.getMessage()]
    assert len(warned) == 1
    assert "has_quantization" not in _manifest(tmp_path, "v000002")


@pytest.mark.parametrize(("line", "key"), [
    ("density = 0", "checkpointing.lossy.density"),
    ("bits = 9", "checkpointing.lossy.bits"),
    ('keyframe = "zip"', "checkpointing.lossy.keyframe"),
    ('exact = [""]', "checkpointing.lossy.exact"),
    ("error_rel = 1.5", "checkpointing.lossy.error_rel"),
    ("keyframe_every = 0", "checkpointing.lossy.keyframe_every"),
    ("dnesity = 0.1", "checkpointing.lossy.dnesity"),
])
def test_bad_lossy_config_names_the_key(line: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_config(f"[checkpointing.lossy]\nenabled = true\n{line}\n")


def test_retention_keeps_the_chain_a_kept_lossy_version_needs(make_config: ConfigFactory
                                                              ) -> None:
    cfg = make_config(LOSSY, keep_last=1)
    _, (model, opt) = _save(cfg, 6)
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        assert m.all_steps() == [5, 6]  # v6 is a delta on keyframe v5; v1..v4 are gone
        assert m.restore_sync("latest") == 6


def test_failed_lossy_save_does_not_become_a_base(make_config: ConfigFactory) -> None:
    class Flaky(MemoryStore):
        fail = False

        async def put_if_absent(self, key: str, data: Any) -> None:
            if self.fail and key.endswith("manifest.json"):
                raise OSError(28, "no space (injected)")
            await super().put_if_absent(key, data)

    store = Flaky()
    cfg = make_config(LOSSY)
    model, opt, batcher = make_state()
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}, store=store) as m:
        for step in (1, 2, 3):
            train_step(model, opt, batcher)
            store.fail = step == 2
            if step == 2:
                with pytest.raises(Exception, match="injected"):
                    m.save_nowait(step).result()
                store.fail = False
                with pytest.raises(Exception, match="injected"):
                    m.check_for_errors()
                continue
            m.save_nowait(step).result()
        truth = {"model": copy.deepcopy(model.state_dict()),
                 "opt": copy.deepcopy(opt.state_dict())}
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}, store=store) as m:
        assert m.all_steps() == [1, 3]
        m.restore_sync(3)  # a delta on v1 (the failed save's encoding was rolled back)
    _check_bounds(truth, model, opt)


def test_damaged_or_missing_chain_link_is_an_error(make_config: ConfigFactory,
                                                   tmp_path: Path) -> None:
    cfg = make_config(LOSSY)
    _, (model, opt) = _save(cfg, 3)
    blob = tmp_path / "runs" / "run1" / "versions" / "v000002" / "lossy_rank0000.mldc"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x40
    blob.write_bytes(bytes(data))
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        with pytest.raises(ChecksumMismatch):
            m.restore_sync(3)
        blob.unlink()
        with pytest.raises(MissingPrevious):
            m.restore_sync(3)
        assert m.restore_sync(3, fallback=True) == 1  # the newest version that verifies


_NEXT = torch.randint(0, 64, (64, 4), generator=torch.Generator().manual_seed(3))


def _batch(step: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """A Markov-chain task (4 likely successors per token): the loss stays near log 4."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 64, (n, 16), generator=g)
    return x, _NEXT[x, torch.randint(0, 4, x.shape, generator=g)]


def _loss(model: torch.nn.Module, step: int, n: int = 16) -> torch.Tensor:
    x, y = _batch(step, n)
    return torch.nn.functional.cross_entropy(model(x).reshape(-1, 64), y.reshape(-1))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, start: int, stop: int,
           m: CheckpointManager | None = None) -> None:
    for step in range(start, stop):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
        if m is not None and (step + 1) % 2 == 0:
            m.save_nowait(step + 1)


def test_training_resumed_from_lossy_checkpoint_stays_close(make_config: ConfigFactory
                                                            ) -> None:
    steps, resume_at = 60, 14
    cfg = make_config(LOSSY.replace("error_rel = 0.02", "error_rel = 0.05"))
    model, opt, _ = make_state()
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        _train(model, opt, 0, resume_at, m)
        m.wait()
    at_resume = model.mlp[0].weight.detach().clone()
    _train(model, opt, resume_at, steps)
    with torch.no_grad():
        base = float(_loss(model, -1, 256))
    model2, opt2, _ = make_state(seed=1)  # different init: everything comes back
    _train(model2, opt2, 0, 1)  # materialise AdamW state to load into
    with CheckpointManager(cfg, {"model": model2, "optimizer": opt2}) as m:
        assert m.restore_sync("latest") == resume_at  # a delta in the middle of its chain
    lossy_err = float((model2.mlp[0].weight.detach() - at_resume).abs().max())
    assert 0 < lossy_err <= 0.05 * float(at_resume.abs().max())  # resumed from lossy state
    _train(model2, opt2, resume_at, steps)
    with torch.no_grad():
        resumed = float(_loss(model2, -1, 256))
    assert base < 3.5  # it learned something (log 64 = 4.16)
    print(f"lossy resume: base {base:.4f} resumed {resumed:.4f}")
    assert abs(resumed - base) / base < 0.01, (base, resumed)


def test_verify_checks_lossy_blobs_and_names_a_damaged_one(make_config: ConfigFactory,
                                                          tmp_path: Path) -> None:
    """``mithril verify`` reads lossy versions through the same reader: clean run OK, one
    flipped byte of a lossy blob is named (exit 3)."""
    from mithril_async.cli import main

    _save(make_config(LOSSY), 3)
    run = tmp_path / "runs" / "run1"
    assert main(["verify", str(run), "--quiet"]) == 0
    blob = next((run / "versions" / "v000002").glob("lossy*"))
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    assert main(["verify", str(run), "--quiet"]) == 3
