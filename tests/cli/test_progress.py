"""Progress bars of the long commands: on a terminal only, driven by the work's real bytes.

The terminal tests run the installed ``mithril`` script with its stderr on a pseudo-terminal
(``os.openpty``) and its stdout on a pipe, and compare what it printed with the same command
run where stderr is no terminal (in-process ``main``, its streams captured). The byte counts
behind each bar are checked exactly, in process: what the work reports adds up to the total
the command gives its bar.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import re
import shutil
import struct
import subprocess
import sys
import termios
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mithril_async.cli import main
from mithril_async.commands import _common
from mithril_async.commands._common import ProgressBar, locate
from tests.cli.conftest import MITHRIL, Runs, make_runs

REPO = Path(__file__).resolve().parents[2]


@dataclass
class TermResult:
    rc: int
    out: str  # stdout (a pipe)
    tty: str  # everything the terminal (stderr) received


def on_terminal(*args: str | Path, size: tuple[int, int] | None = (40, 120)) -> TermResult:
    """Run the console script with stderr on a new pseudo-terminal of ``size`` (rows, columns;
    None: one that reports no size) and stdout on a pipe."""
    master, slave = os.openpty()
    if size is not None:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", *size, 0, 0))
    got = bytearray()

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: no one holds the terminal's other end any more
                return
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        p = subprocess.run([str(MITHRIL), *map(str, args)], stdout=subprocess.PIPE,
                           stderr=slave, stdin=subprocess.DEVNULL, text=True, timeout=120)
    finally:
        os.close(slave)
        reader.join(timeout=60)
        os.close(master)
    assert not reader.is_alive()
    return TermResult(p.returncode, p.stdout, got.decode("utf-8", "replace"))


def finished_bar(tty: str, label: str) -> str:
    """The last drawing of the bar ``label`` that reached 100% with its count equal to its
    total (``1.47M/1.47M``); fails if there is none."""
    done = [m.group(0) for m in re.finditer(
        rf"{re.escape(label)}: 100%\|[^|]*\| (\S+)/(\S+) \[[^]]*B/s\]", tty)
        if m.group(1) == m.group(2)]
    assert done, f"no finished {label!r} bar in {tty!r}"
    return done[-1]


@dataclass
class Case:
    """One command: its arguments (``{W}``: the work folder), the bars it draws, and a hook
    that puts the work folder back as it was before each run."""

    args: list[str]
    bars: list[str]


def _cases() -> dict[str, Case]:
    return {
        "verify": Case(["verify", "{W}/runs"], ["verify"]),
        "restore": Case(["restore", "{W}/runs/run1", "--item", "all", "--to",
                         "{W}/out.safetensors", "--force"], ["read", "write out.safetensors"]),
        "compress": Case(["compress", "{W}/model.safetensors", "-o", "{W}/model.mckp"],
                         ["compress"]),
        "decompress": Case(["decompress", "{W}/model.mckp", "-o", "{W}/back.safetensors",
                            "--force"], ["decompress"]),
        "gc": Case(["gc", "{W}/runs", "--keep-last", "1"], ["gc run1"]),
        "export": Case(["export", "{W}/runs/run1", "--hf", "{W}/hf", "--max-shard-size",
                        "40KB", "--force"], ["export"]),
    }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A runs folder of three versions, a safetensors file and its .mckp, never changed."""
    base = tmp_path_factory.mktemp("pristine")
    runs = make_runs(base)
    save_file({k: v.contiguous() for k, v in runs.model.state_dict().items()},
              str(base / "model.safetensors"))
    assert main(["compress", str(base / "model.safetensors"), "--quiet"]) == 0
    return base


def _fresh(pristine: Path, work: Path) -> None:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(pristine, work)


def _reference(args: list[str], pristine: Path, work: Path,
               capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``args`` run in process, stderr not a terminal."""
    _fresh(pristine, work)
    capsys.readouterr()
    rc = main(args)
    got = capsys.readouterr()
    return rc, got.out, got.err


@pytest.mark.parametrize("name", list(_cases()))
def test_a_terminal_shows_the_bar_beside_the_same_output(
        name: str, pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real script on a terminal draws each bar to 100%, and prints on stdout exactly
    what it prints where stderr is no terminal (and there, nothing on stderr)."""
    case = _cases()[name]
    work = tmp_path / "w"
    args = [a.replace("{W}", str(work)) for a in case.args]
    rc, out, err = _reference(args, pristine, work, capsys)
    assert (rc, err) == (0, "")
    assert out
    _fresh(pristine, work)
    # verify's terminal reports no size, as some CI runners' do: tqdm alone would print
    # nothing there (0 columns); it gets 80
    shown = on_terminal(*args, size=None if name == "verify" else (40, 120))
    assert shown.rc == 0, shown.tty
    assert shown.out == out
    for label in case.bars:
        line = finished_bar(shown.tty, label)
        assert name != "verify" or len(line) <= 80


def test_json_on_a_terminal_prints_nothing_there(pristine: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The real script with --json: the terminal gets nothing, stdout the same JSON."""
    args = ["verify", str(tmp_path / "w" / "runs"), "--json"]
    rc, out, err = _reference(args, pristine, tmp_path / "w", capsys)
    assert (rc, err) == (0, "")
    _fresh(pristine, tmp_path / "w")
    assert on_terminal(*args) == TermResult(0, out, "")


@pytest.mark.parametrize("name", list(_cases()))
def test_json_and_quiet_print_the_same_on_a_terminal(
        name: str, pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        terminal_stderr: Callable[[], str]) -> None:
    """In process, stderr on a pseudo-terminal: --json and --quiet print exactly what they
    print with no terminal, and nothing reaches the terminal."""
    work = tmp_path / "w"
    args = [a.replace("{W}", str(work)) for a in _cases()[name].args]
    for flag in ("--json", "--quiet"):
        rc, out, err = _reference([*args, flag], pristine, work, capsys)
        assert (rc, err) == (0, ""), terminal_stderr()  # stderr is the terminal here
        assert bool(out) == (flag == "--json")
        _fresh(pristine, work)
        assert terminal_stderr() == ""
        assert main([*args, flag]) == 0
        assert capsys.readouterr().out == out
        assert terminal_stderr() == "", flag


def test_damage_is_reported_after_a_partial_bar(pristine: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str],
                                                terminal_stderr: Callable[[], str]) -> None:
    work = tmp_path / "w"
    _fresh(pristine, work)
    blob = work / "runs" / "run1" / "versions" / "v000003" / "model.mckp"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    assert terminal_stderr() == ""
    assert main(["verify", str(work / "runs")]) == 3
    tty = terminal_stderr()
    assert "verify:" in tty and not re.search(r"verify: 100%", tty)  # stopped short
    # the message comes after the bar's last line, on a line of its own
    assert re.search(r"\n(\r)?DAMAGED \S*v000003/model.mckp", tty), tty
    assert capsys.readouterr().out == ""


# --- the bar itself: redrawn at a bounded rate, whatever the work reports ----------------


@pytest.fixture
def terminal_stderr(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], str]]:
    """sys.stderr on a pseudo-terminal (in process), from the first call of the function
    this yields (pytest's capture replaces sys.stderr again between a fixture and its test);
    that function returns what the terminal has received so far. A thread drains the
    terminal all along, so a bar drawing too often fails an assertion instead of blocking on
    a full terminal; each call waits for a marker it writes to know it has seen everything."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    stream = open(slave, "w", encoding="utf-8", closefd=True)  # noqa: SIM115
    got = bytearray()
    seen = threading.Condition()

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:
                chunk = b""
            with seen:
                got.extend(chunk)
                seen.notify_all()
            if not chunk:
                return

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    marks = iter(range(1 << 30))

    def received() -> str:
        if sys.stderr is not stream:
            monkeypatch.setattr(sys, "stderr", stream)
        mark = f"<mark {next(marks)}>".encode()
        stream.write(mark.decode())
        stream.flush()
        with seen:
            assert seen.wait_for(lambda: mark in got, timeout=60)
            got[:] = got.replace(mark, b"")
            return got.decode("utf-8", "replace")

    yield received
    monkeypatch.undo()
    stream.close()
    reader.join(timeout=60)
    os.close(master)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_redraws_are_bounded_by_time_not_by_calls(terminal_stderr: Callable[[], str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert terminal_stderr() == ""
    clock = Clock()
    monkeypatch.setattr(_common.time, "monotonic", clock)
    bar = ProgressBar("work", 100_000)
    assert bar.enabled and bar.callback is not None
    drawn = terminal_stderr().count("\r")
    for _ in range(10_000):  # a chunk reported 10,000 times within one interval
        bar.advance(1)
    assert terminal_stderr().count("\r") == drawn  # counted, not drawn
    clock.now += _common.PROGRESS_INTERVAL_S
    bar.advance(1)
    assert terminal_stderr().count("\r") == drawn + 1
    assert "9.77k/97.7k" in terminal_stderr()  # 10,001 bytes of 100,000, in KiB
    bar.update_to(100_000)  # cumulative reports (export's on_progress(done, total))
    bar.close()  # the rest is drawn when the bar closes
    assert "work: 100%" in terminal_stderr() and "97.7k/97.7k" in terminal_stderr()
    bar.advance(5)  # after close: nothing
    bar.stage("next", 10)  # a closed bar starts no stage
    assert "next" not in terminal_stderr()


def test_stages_and_a_total_learnt_late(terminal_stderr: Callable[[], str]) -> None:
    assert terminal_stderr() == ""
    with ProgressBar("read") as bar:
        bar.update_to(0, 2048)
        bar.advance(2048)
        bar.stage("write out.safetensors", 1024)
        bar.advance(1024)
    tty = terminal_stderr()
    assert finished_bar(tty, "read") and finished_bar(tty, "write out.safetensors")
    assert tty.index("read: 100%") < tty.index("write out.safetensors: 100%")


def test_json_or_quiet_or_nothing_to_count_disable_it(terminal_stderr: Callable[[], str]) -> None:
    assert terminal_stderr() == ""
    for flags in ({"json": True, "quiet": False}, {"json": False, "quiet": True}):
        bar = _common.progress_bar(argparse.Namespace(**flags), "x", 10)
        assert not bar.enabled and bar.callback is None
        bar.advance(10)
        bar.close()
    assert _common.progress_bar(argparse.Namespace(), "x", 0).callback is None  # nothing to count
    assert terminal_stderr() == ""


def test_a_pipe_disables_it(capsys: pytest.CaptureFixture[str]) -> None:
    bar = ProgressBar("x", 10)
    assert not bar.enabled and bar.callback is None
    bar.close()
    assert capsys.readouterr().err == ""


# --- the byte counts behind the bars are the work's own, adding up to each total -----------


class Counter:
    def __init__(self) -> None:
        self.total = 0
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self._lock:  # reported from the codec threads
            self.total += n
            self.calls += 1


@pytest.mark.parametrize("delta", [False, True])
def test_verify_and_restore_count_every_raw_byte_once(tmp_path: Path, delta: bool,
                                                      terminal_stderr: Callable[[], str]
                                                      ) -> None:
    """Delta bases decoded along the way are not counted: only the blobs asked for."""
    from mithril_async.commands.restore import read_tree
    from mithril_async.restore.reader import VersionReader

    runs = make_runs(tmp_path, delta=delta)
    target = locate(str(runs.run))
    cat = target.catalog("run1")

    async def check() -> list[tuple[int, int]]:
        out = []
        for m in await cat.versions():
            for ref in m.blobs():
                seen = Counter()
                with VersionReader(cat, progress=seen) as reader:
                    await reader.check_blob(ref)
                out.append((seen.total, ref.raw_bytes))
        return out

    for got, want in asyncio.run(check()):
        assert got == want
    assert terminal_stderr() == ""
    with ProgressBar("read") as bar:  # what mithril restore gives read_tree on a terminal
        asyncio.run(read_tree(target, None, "all", bar))
        m = asyncio.run(cat.versions())[-1]
        assert bar.done == bar.total == sum(b.raw_bytes for b in m.blobs()) > 0


def test_file_conversions_count_every_byte(tmp_path: Path) -> None:
    from mithril_async.integrations.safetensors_file import compress_file, decompress_file

    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(300, 257, generator=g), "b": torch.arange(999),
               "h": torch.randn(64, generator=g).to(torch.bfloat16)}
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    save_file(tensors, str(tmp_path / "m.safetensors"))
    seen = Counter()
    compress_file(tmp_path / "m.safetensors", tmp_path / "m.mckp", progress=seen, threads=2)
    assert seen.total == raw
    args = argparse.Namespace(json=False, quiet=False)
    for out, times in (("back.safetensors", 2), ("back.pt", 1)):
        seen = Counter()
        decompress_file(tmp_path / "m.mckp", tmp_path / out, progress=seen)
        assert seen.total == raw * times
        # the total the command gives its bar is the same (read from the header alone)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_common, "shows_progress", lambda _args: True)
            assert _common.decompress_total(args, tmp_path / "m.mckp", tmp_path / out) \
                == raw * times
    assert _common.decompress_total(args, tmp_path / "m.safetensors",
                                    tmp_path / "x.safetensors") is None  # not shown


def test_gc_counts_what_it_planned(tmp_path: Path) -> None:
    from mithril_async.commands.gc import apply_run, plan_run

    runs: Runs = make_runs(tmp_path)
    (runs.run / "versions" / "v000002" / "stray.bin").write_bytes(b"x" * 1000)
    args = argparse.Namespace(keep_last=1, keep_best=None, metric=None, mode="min",
                              keep_every=None, claim_stale=60.0, orphan_age=600.0)
    target = locate(str(runs.root))

    async def go() -> tuple[int, int]:
        plan = await plan_run(target, "run1", args)
        planned = sum(i["bytes"] for i in plan)
        seen = Counter()
        await apply_run(target, "run1", plan, args, seen)
        return planned, seen.total

    planned, counted = asyncio.run(go())
    assert planned == counted > 1000


def test_export_can_report_cumulative_bytes(terminal_stderr: Callable[[], str]) -> None:
    """The form ``export_hf(on_progress=bar.update_to)`` takes: (done, total) after each file."""
    assert terminal_stderr() == ""
    bar = ProgressBar("export")
    for done in (100, 300, 600):
        bar.update_to(done, 600)
    bar.close()
    assert finished_bar(terminal_stderr(), "export")
