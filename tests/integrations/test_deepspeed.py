"""DeepSpeed checkpoint engine: compressed files, commit as the durability point.

DeepSpeed is not part of the shared dev environment (see docs/integrations/deepspeed.md); this runs
where it is installed (e.g. ``PYTHONPATH=<dir with deepspeed> pytest tests/integrations``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
)

from mithril_async.errors import SaveFailed
from mithril_async.integrations.deepspeed import MithrilCheckpointEngine


class Scaler:  # stands in for DeepSpeed's loss scaler objects
    def __init__(self) -> None:
        self.cur_scale = 1024.0


def test_save_commit_load(tmp_path: Path) -> None:
    eng = MithrilCheckpointEngine()
    info = CheckpointCommitInfo(tag="global_step2", save_dir=str(tmp_path), save_latest=True)
    eng.create(info)
    eng.makedirs(str(tmp_path / "global_step2"), exist_ok=True)
    w = torch.randn(64, 64)
    model = {"module": {"w": w, "w_view": w[:8]}, "ds_version": "0.19.8", "global_steps": 2,
             "param_shapes": [{"w": torch.Size([64, 64])}]}
    optim = {"optimizer_state_dict": {"loss_scaler": Scaler(), "state": {0: {"m": w * 2}}}}
    eng.save(model, str(tmp_path / "global_step2" / "mp_rank_00_model_states.pt"))
    eng.save(optim, str(tmp_path / "global_step2" / "zero_pp_rank_0_optim_states.pt"))
    assert eng.commit(info) is True
    back = eng.load(str(tmp_path / "global_step2" / "mp_rank_00_model_states.pt"))
    assert torch.equal(back["module"]["w"], w) and torch.equal(back["module"]["w_view"], w[:8])
    assert back["param_shapes"][0]["w"] == torch.Size([64, 64])
    ob = eng.load(str(tmp_path / "global_step2" / "zero_pp_rank_0_optim_states.pt"))
    assert ob["optimizer_state_dict"]["loss_scaler"].cur_scale == 1024.0
    assert torch.equal(ob["optimizer_state_dict"]["state"][0]["m"], w * 2)
    (tmp_path / "afile").write_text("")
    eng.save(model, str(tmp_path / "afile" / "x.pt"))  # a file where a folder should be
    with pytest.raises(SaveFailed, match=r"x\.pt"):
        eng.commit(info)
    eng.cleanup()


_E2E = """
import os, sys, tempfile, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1",
                  LOCAL_RANK="0")
import deepspeed
import deepspeed.comm.torch
from mithril_async.integrations.deepspeed import MithrilCheckpointEngine
# DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce op with g++ at init
# (~30 s on a fresh machine, once per cache): one rank never uses it, and the checkpoint
# engine under test has nothing to do with it.
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # (the package's
# own attribute 'torch' is the torch module)
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
eng, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
    config={"train_micro_batch_size_per_gpu": 4,
            "zero_optimization": {"stage": int(sys.argv[1])}})
eng.checkpoint_engine = MithrilCheckpointEngine()
x = torch.randn(4, 16)
def step():
    loss = eng(x).pow(2).mean(); eng.backward(loss); eng.step()
for _ in range(3): step()
d = tempfile.mkdtemp()
eng.save_checkpoint(d, tag="t3")
ref = {k: v.clone() for k, v in eng.module.state_dict().items()}
files = os.listdir(os.path.join(d, "t3"))
assert all(open(os.path.join(d, "t3", f), "rb").read(4) == b"MCKP" for f in files), files
step(); step()
eng.load_checkpoint(d)
assert all(torch.equal(v, ref[k]) for k, v in eng.module.state_dict().items())
assert eng.global_steps == 3
print("OK", sorted(files))
"""


@pytest.mark.parametrize("stage", [0, 1])
def test_deepspeed_engine_end_to_end(tmp_path: Path, stage: int) -> None:
    import os
    import subprocess
    import sys

    script = tmp_path / "e2e.py"
    script.write_text(_E2E)
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    p = subprocess.run([sys.executable, str(script), str(stage), str(29600 + stage)],
                       capture_output=True, text=True, timeout=280, env=env)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
