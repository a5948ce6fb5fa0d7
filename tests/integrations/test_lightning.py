"""Lightning CheckpointIO plugin: Lightning's contract kept in real Trainer runs.

Checked against Lightning's own IO where the contract is "what Lightning does": the file
names ``ModelCheckpoint`` produces (``-vN`` versioning by existence, ``save_last``,
``save_top_k=-1``), and the checkpoint ``ckpt_path="last"`` resumes from after a SIGKILL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

L = pytest.importorskip("lightning")

import mithril_async.integrations.lightning as ml  # noqa: E402
import mithril_async.integrations.lightning_files as lf  # noqa: E402
import mithril_async.integrations.lightning_writes as lw  # noqa: E402
from mithril_async.errors import (  # noqa: E402
    ConfigError,
    InvalidFormat,
    SaveFailed,
    UnsupportedStateType,
)
from mithril_async.integrations.lightning import (  # noqa: E402
    RESERVED_MAGIC,
    MithrilCheckpointIO,
    load_checkpoint_file,
    load_from_checkpoint,
)
from tests.integrations._lightning_train import Tiny, loader, trainer  # noqa: E402

HERE = Path(__file__).parent


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mithril-lightning-write"]


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Hold every background encode until the test sets the event (no sleeps, no timing)."""
    release = threading.Event()
    original = lw.encode_checkpoint

    def held(*args: Any, **kwargs: Any) -> bytes:
        if threading.current_thread() is not threading.main_thread():
            assert release.wait(60), "gate never released"
        return original(*args, **kwargs)

    monkeypatch.setattr(lw, "encode_checkpoint", held)
    yield release
    release.set()


def test_fit_saves_compressed_files_and_resumes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    io = MithrilCheckpointIO(compression_level=3)
    model = Tiny()
    trainer(tmp_path / "ckpt", io, max_steps=4, every_n_train_steps=2,
            save_top_k=-1).fit(model, loader())
    files = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert [f.name for f in files] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    assert all(f.read_bytes()[:4] == b"MCKP" for f in files)
    ck = io.load_checkpoint(files[-1])
    assert ck["global_step"] == 4 and ck["hyper_parameters"]["width"] == 32
    for k, v in model.state_dict().items():
        assert torch.equal(ck["state_dict"][k], v)
    t2 = trainer(tmp_path / "r", MithrilCheckpointIO(), max_steps=6, every_n_train_steps=2)
    t2.fit(Tiny(), loader(), ckpt_path=str(files[-1]))
    assert t2.global_step == 6


@pytest.mark.parametrize("mode", ["lightning", "sync", "async"])
def test_fixed_filename_versions_like_lightning_io(tmp_path: Path, mode: str) -> None:
    """save_top_k=-1 with a fixed filename over 4 epochs: ckpt, ckpt-v1..v3 and last.ckpt,
    every file on disk when its save returns (the next save's name depends on it)."""
    io = None if mode == "lightning" else MithrilCheckpointIO(asynchronous=mode == "async")
    folder = tmp_path / "ckpt"
    t = trainer(folder, io, max_epochs=4, filename="fixed", save_top_k=-1, save_last=True,
                monitor="epoch", mode="max")
    torch.manual_seed(0)
    t.fit(Tiny(), loader(16))
    assert _names(folder) == ["fixed-v1.ckpt", "fixed-v2.ckpt", "fixed-v3.ckpt", "fixed.ckpt",
                              "last.ckpt"]
    assert not _writer_threads()  # teardown at the end of fit joined the write
    last = MithrilCheckpointIO.load(folder / "last.ckpt") if io else torch.load(
        folder / "last.ckpt", weights_only=False)
    assert last["global_step"] == 8 and last["epoch"] == 3
    # resume from "last" with the same plugin: continues at step 8, names keep versioning
    t2 = trainer(folder, None if io is None else MithrilCheckpointIO(), max_epochs=5,
                 filename="fixed", save_top_k=-1, save_last=True, monitor="epoch", mode="max")
    t2.fit(Tiny(), loader(16), ckpt_path="last")
    assert t2.global_step == 10
    assert "fixed-v4.ckpt" in _names(folder) and len(_names(folder)) == 6


def test_async_save_reserves_the_path_and_readers_wait(tmp_path: Path,
                                                       gate: threading.Event) -> None:
    io = MithrilCheckpointIO(asynchronous=True)
    path = tmp_path / "a.ckpt"
    w = torch.arange(10.0)
    io.save_checkpoint({"w": w, "step": 3}, path)
    w.add_(1)  # training goes on: the snapshot was taken before save_checkpoint returned
    assert path.read_bytes().startswith(RESERVED_MAGIC)  # exists at once: versioning sees it
    with pytest.raises(Exception, match="mithril_async: an unfinished checkpoint"):
        torch.load(path)  # a clear message, no unpickling of anything
    got: dict[str, Any] = {}
    reader = threading.Thread(target=lambda: got.update(load_checkpoint_file(path)))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive() and not got  # blocked on the writer's lock, not reading junk
    gate.set()
    io.teardown()
    reader.join(60)
    assert torch.equal(got["w"], torch.arange(10.0)) and got["step"] == 3
    assert not _writer_threads() and _names(tmp_path) == ["a.ckpt"]


def test_async_snapshot_copies_every_mutable_leaf(tmp_path: Path,
                                                  gate: threading.Event) -> None:
    """Whatever the training loop changes after save_checkpoint returns (numpy arrays and
    views of them, arrays in nested containers, tensors) stays out of the file; immutable
    leaves keep their type (torch.Size)."""
    io = MithrilCheckpointIO(asynchronous=True)
    path = tmp_path / "a.ckpt"
    arr, w = np.arange(6, dtype=np.float32), torch.arange(4.0)
    ck = {"np": arr, "view": arr[::2], "loops": {"state": [np.zeros(3, np.int64)]}, "w": w,
          "shape": torch.Size([2, 3]), "n": np.int64(5), "t": (1, "x")}
    io.save_checkpoint(ck, path)
    arr += 100  # training goes on while the write is held
    ck["loops"]["state"][0][:] = 7  # type: ignore[index]
    w.add_(1)
    gate.set()
    io.wait()
    back = io.load_checkpoint(path)
    assert np.array_equal(back["np"], np.arange(6, dtype=np.float32))
    assert np.array_equal(back["view"], np.arange(6, dtype=np.float32)[::2])
    assert np.array_equal(back["loops"]["state"][0], np.zeros(3, np.int64))
    assert torch.equal(back["w"], torch.arange(4.0))
    assert type(back["shape"]) is torch.Size and back["shape"] == (2, 3)
    assert back["n"] == 5 and back["t"] == (1, "x")


def test_async_save_refuses_what_it_cannot_snapshot(tmp_path: Path) -> None:
    """A numpy array of Python objects cannot be copied safely: refused at the call, naming
    it; with pickle_fallback it is pickled at the call, so later changes stay out too."""
    cells = np.array([{"a": 1}, None], dtype=object)
    ck = {"loops": {"cells": cells}, "w": torch.ones(2)}
    with pytest.raises(UnsupportedStateType, match=r"numpy array of Python objects.*loops/cells"):
        MithrilCheckpointIO(asynchronous=True).save_checkpoint(ck, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()
    io = MithrilCheckpointIO(asynchronous=True, pickle_fallback=True)
    io.save_checkpoint(ck, tmp_path / "b.ckpt")
    cells[0]["a"] = 2
    io.wait()
    assert io.load_checkpoint(tmp_path / "b.ckpt")["loops"]["cells"][0] == {"a": 1}


def test_async_overwrite_keeps_previous_until_renamed(tmp_path: Path,
                                                      gate: threading.Event) -> None:
    path = tmp_path / "last.ckpt"
    ml.save_checkpoint_file({"step": 1, "w": torch.zeros(4)}, path)
    io = MithrilCheckpointIO(asynchronous=True)
    io.save_checkpoint({"step": 2, "w": torch.ones(4)}, path)
    assert load_checkpoint_file(path)["step"] == 1  # complete old content, never a hole
    gate.set()
    assert io.load_checkpoint(path)["step"] == 2  # our own load joins the pending write
    io.teardown()


def test_remove_of_in_flight_file_never_resurrects_it(tmp_path: Path,
                                                      gate: threading.Event) -> None:
    io = MithrilCheckpointIO(asynchronous=True)
    path = tmp_path / "epoch=0.ckpt"
    io.save_checkpoint({"w": torch.ones(3)}, path)
    done = threading.Event()

    def remove() -> None:
        io.remove_checkpoint(path)
        done.set()

    remover = threading.Thread(target=remove)
    remover.start()
    gate.set()
    remover.join(60)
    assert done.is_set() and not path.exists() and _names(tmp_path) == []
    io.teardown()
    assert not path.exists() and not _writer_threads()


_EXIT_CHILD = """
import sys, torch
import mithril_async.integrations.lightning as ml
import mithril_async.integrations.lightning_writes as lw
encode = lw.encode_checkpoint
def full_disk(checkpoint, **kwargs):  # fails the write of the checkpoint marked "fail"
    if "fail" in checkpoint:
        raise OSError(28, "No space left on device")
    return encode(checkpoint, **kwargs)
lw.encode_checkpoint = full_disk
ml.MithrilCheckpointIO(asynchronous=True).save_checkpoint({"fail": 1}, sys.argv[2])
ml.MithrilCheckpointIO(asynchronous=True).save_checkpoint(
    {"w": torch.arange(1 << 20, dtype=torch.float32)}, sys.argv[1])
"""


def test_pending_writes_finish_or_are_reported_at_process_exit(tmp_path: Path) -> None:
    """Saving outside fit and exiting without teardown/wait: a write still completes, and a
    failed one (no later call to raise it) is reported on stderr at ERROR level."""
    path, failed = tmp_path / "exit.ckpt", tmp_path / "failed.ckpt"
    env = {**os.environ, "PYTHONPATH": str(HERE.parent.parent)}
    proc = subprocess.run([sys.executable, "-c", _EXIT_CHILD, str(path), str(failed)], env=env,
                          capture_output=True, text=True, check=True, timeout=300)
    assert torch.equal(load_checkpoint_file(path)["w"],
                       torch.arange(1 << 20, dtype=torch.float32))
    assert _names(tmp_path) == ["exit.ckpt"]  # the failed write left no reservation
    assert re.search(r"background checkpoint write to \S*failed\.ckpt failed: .*No space",
                     proc.stderr), proc.stderr


def test_teardown_raises_a_failed_write_unless_another_error_propagates(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """The end of fit raises a failed write; Lightning's handler of a failed fit also calls
    teardown, and there the training error stays the one raised (the write's is logged)."""
    def boom(*_: Any, **__: Any) -> bytes:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lw, "encode_checkpoint", boom)
    io = MithrilCheckpointIO(asynchronous=True)
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "a.ckpt")
    with pytest.raises(SaveFailed, match=r"a\.ckpt.*No space"):
        io.teardown()
    caplog.set_level(logging.ERROR, logger="mithril_async")
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "b.ckpt")
    with pytest.raises(ZeroDivisionError):
        try:
            1 / 0  # noqa: B018  # the training step's error
        except ZeroDivisionError:
            io.teardown()
            raise
    assert any(r.levelno == logging.ERROR and "b.ckpt" in r.getMessage()
               and "No space" in r.getMessage() for r in caplog.records), caplog.records
    assert io._pending is None and not _writer_threads()


def test_failed_background_write_is_raised_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: Any, **__: Any) -> bytes:
        raise OSError(28, "No space left on device")

    io = MithrilCheckpointIO(asynchronous=True)
    path = tmp_path / "x.ckpt"
    monkeypatch.setattr(lw, "encode_checkpoint", boom)
    io.save_checkpoint({"w": torch.ones(3)}, path)
    with pytest.raises(SaveFailed, match=r"x\.ckpt.*No space"):
        io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "next.ckpt")
    assert not path.exists()  # its reservation was removed with the failed write
    monkeypatch.undo()
    io.save_checkpoint({"w": torch.ones(3), "meta": {"a": (1, 2.5)}}, tmp_path / "ok.ckpt")
    back = io.load_checkpoint(tmp_path / "ok.ckpt")
    assert torch.equal(back["w"], torch.ones(3)) and back["meta"] == {"a": (1, 2.5)}
    io.teardown()


def test_async_io_wrapper_leaves_no_thread_or_pending_write(tmp_path: Path) -> None:
    """Lightning's AsyncCheckpointIO never calls the wrapped IO's teardown: our IO then
    writes on the wrapper's thread, which the wrapper's own teardown joins."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    inner = MithrilCheckpointIO(asynchronous=True)
    folder = tmp_path / "ckpt"
    torch.manual_seed(0)
    trainer(folder, AsyncCheckpointIO(inner), max_steps=6, every_n_train_steps=2,
            save_top_k=-1, save_last=True).fit(Tiny(), loader())
    assert inner._pending is None and not _writer_threads()
    names = _names(folder)
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt",
                     "last.ckpt"]
    assert all((folder / n).read_bytes()[:4] == b"MCKP" for n in names)
    assert inner.load_checkpoint(folder / "last.ckpt")["global_step"] == 6


def test_storage_options(tmp_path: Path) -> None:
    io = MithrilCheckpointIO(compression_level=3)
    ck = {"w": torch.zeros(4096), "n": 1}
    io.save_checkpoint(ck, tmp_path / "a.ckpt", storage_options={"compression_level": 19,
                                                                  "fsync": False})
    io.save_checkpoint(ck, tmp_path / "b.ckpt", storage_options={"asynchronous": True})
    io.wait()
    assert io.load_checkpoint(tmp_path / "a.ckpt")["n"] == 1
    assert torch.equal(io.load_checkpoint(tmp_path / "b.ckpt")["w"], torch.zeros(4096))
    with pytest.raises(ConfigError, match=r"unknown key.*bucket.*compression_level"):
        io.save_checkpoint(ck, tmp_path / "c.ckpt", storage_options={"bucket": "s3://x"})
    with pytest.raises(ConfigError, match=r"'fsync'.*bool.*str"):
        io.save_checkpoint(ck, tmp_path / "c.ckpt", storage_options={"fsync": "no"})
    with pytest.raises(ConfigError, match="level 99"):
        io.save_checkpoint(ck, tmp_path / "c.ckpt", storage_options={"compression_level": 99})
    with pytest.raises(ConfigError, match="must be a dict"):
        io.save_checkpoint(ck, tmp_path / "c.ckpt", storage_options=["fsync"])
    assert not (tmp_path / "c.ckpt").exists()
    # through the Trainer's own entry point
    t = trainer(tmp_path / "t", io, max_steps=1)
    t.fit(Tiny(), loader())
    t.save_checkpoint(tmp_path / "t.ckpt", storage_options={"compression_level": 1})
    assert io.load_checkpoint(tmp_path / "t.ckpt")["global_step"] == 1


def test_loading_for_inference(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Tiny(width=16)
    folder = tmp_path / "ckpt"
    trainer(folder, MithrilCheckpointIO(), max_steps=2, every_n_train_steps=2).fit(
        model, loader())
    path = folder / "epoch=0-step=2.ckpt"
    ck = MithrilCheckpointIO.load(path, map_location="cpu")
    assert ck["global_step"] == 2 and ck["hyper_parameters"] == {"width": 16}
    back = load_from_checkpoint(Tiny, path)
    assert isinstance(back, Tiny) and back.hparams["width"] == 16
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)
    # Lightning's own entry point is restored after the helper, and still reads torch.save
    with pytest.raises(Exception, match=r"Weights only load failed|Unsupported operand"):
        Tiny.load_from_checkpoint(path)
    plain = tmp_path / "plain.ckpt"
    torch.save(ck, plain)
    assert load_from_checkpoint(Tiny, plain).hparams["width"] == 16


def test_pickle_fallback_is_opt_in(tmp_path: Path) -> None:
    from mithril_async.errors import UnsupportedStateType

    ck = {"state_dict": {"w": torch.arange(6.0)}, "hyper_parameters": {"obj": Opaque(3)},
          "path": Path("/x")}
    strict = MithrilCheckpointIO()
    with pytest.raises(UnsupportedStateType):
        strict.save_checkpoint(ck, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()
    for mode in (False, True):
        io = MithrilCheckpointIO(pickle_fallback=True, asynchronous=mode)
        io.save_checkpoint(ck, tmp_path / "a.ckpt")
        back = io.load_checkpoint(tmp_path / "a.ckpt")
        assert back["hyper_parameters"]["obj"].v == 3 and back["path"] == Path("/x")
        assert torch.equal(back["state_dict"]["w"], torch.arange(6.0))
        with pytest.raises(InvalidFormat, match="allow_pickle"):
            strict.load_checkpoint(tmp_path / "a.ckpt")
        io.teardown()


class Opaque:
    def __init__(self, v: int) -> None:
        self.v = v


def test_cleanup_removes_only_dead_writers_files(tmp_path: Path) -> None:
    """A temp file or reservation is removed only when no process holds its lock."""
    live_fd, live_tmp = lf.locked_temp(str(tmp_path / "live.ckpt"))
    dead_fd, dead_tmp = lf.locked_temp(str(tmp_path / "dead.ckpt"))
    os.close(dead_fd)  # its writer is gone: the kernel dropped the lock
    res_fd = lf.reserve(str(tmp_path / "reserved.ckpt"), durable=False)
    assert res_fd is not None
    (tmp_path / "dead-res.ckpt").write_bytes(RESERVED_MAGIC + b"{}")  # nobody holds it
    (tmp_path / ".tmp-other.123.deadbeef").write_bytes(b"x")  # not ours: never touched
    removed = ml.cleanup_folder(tmp_path)
    assert sorted(Path(p).name for p in removed) == sorted(["dead-res.ckpt",
                                                             Path(dead_tmp).name])
    assert Path(live_tmp).exists() and (tmp_path / "reserved.ckpt").exists()
    assert (tmp_path / ".tmp-other.123.deadbeef").exists()
    os.close(live_fd)
    os.close(res_fd)
    # a reader of a dead writer's reservation is told so (and not made to wait)
    (tmp_path / "again.ckpt").write_bytes(RESERVED_MAGIC + b'{"pid": 1}')
    with pytest.raises(InvalidFormat, match=r"again\.ckpt.*writer died.*holds no data"):
        load_checkpoint_file(tmp_path / "again.ckpt")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_mid_write_then_resume_from_last(tmp_path: Path, mode: str) -> None:
    """A real child process is killed half-way through writing the step-6 checkpoint: the
    folder holds what Lightning's IO leaves (last.ckpt of step 4, no step-6 file after the
    next start), resuming from "last" gives step 4, the leftovers go, and the resumed run
    writes the same names as an uninterrupted run (no -v1)."""
    folder, marker = tmp_path / "ckpt", tmp_path / "stalled"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent.parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, str(HERE / "_lightning_train.py"), str(folder),
                              mode, str(marker)], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    try:
        while not marker.exists():
            if child.poll() is not None:
                err = child.stderr.read().decode() if child.stderr else ""
                pytest.fail(f"child ended early: {err[-2000:]}")
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
        if child.stderr:
            child.stderr.close()
    left = _names(folder)
    assert any(n.startswith(".tmp-epoch=0-step=6.ckpt") for n in left)
    assert ("epoch=0-step=6.ckpt" in left) == (mode == "async")  # the reservation
    t = trainer(folder, MithrilCheckpointIO(), max_steps=8, every_n_train_steps=2,
                save_top_k=-1, save_last=True)
    seen: list[int] = []

    class Resumed(L.Callback):  # type: ignore[name-defined]
        def on_load_checkpoint(self, trainer: Any, module: Any, ck: dict[str, Any]) -> None:
            seen.append(ck["global_step"])

    t.callbacks.append(Resumed())  # type: ignore[attr-defined]
    t.fit(Tiny(), loader(), ckpt_path="last")
    assert seen == [4] and t.global_step == 8
    assert _names(folder) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt",
                              "epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]
    assert load_checkpoint_file(folder / "epoch=0-step=6.ckpt")["global_step"] == 6
