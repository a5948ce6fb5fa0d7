"""The peer-suite runners (benchmarks/suites/run_*_suite.sh) take the peer project's repository
as an argument and stop with a message naming what is missing before they install or run
anything."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUITES = ROOT / "benchmarks" / "suites"
RUNNERS = {"run_orbax_suite.sh": "google/orbax",
           "run_lightning_suite.sh": "Lightning-AI/pytorch-lightning",
           "run_dcp_suite.sh": "pytorch/pytorch",
           "run_torchtitan_suite.sh": "pytorch/torchtitan"}


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


def _git_repo(path: Path, tag: str) -> Path:
    def git(*a: str) -> None:
        subprocess.run(["git", "-C", str(path), *a], check=True, capture_output=True)
    path.mkdir()
    git("init", "-q")
    (path / "f.txt").write_text("x")
    git("add", "f.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    git("tag", tag)
    return path


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_a_runner_without_its_repository_names_it(runner: str, tmp_path: Path) -> None:
    peer = RUNNERS[runner]
    none = _run(str(SUITES / runner))
    assert none.returncode == 2 and f"no {peer} repository given" in none.stderr
    missing = tmp_path / "nowhere"
    gone = _run(str(SUITES / runner), str(missing))
    assert gone.returncode == 2 and str(missing) in gone.stderr and peer in gone.stderr
    plain = tmp_path / "plain"
    plain.mkdir()
    not_git = _run(str(SUITES / runner), str(plain))
    assert not_git.returncode == 2 and "is not a git checkout" in not_git.stderr


@pytest.mark.parametrize("runner", ["run_orbax_suite.sh", "run_dcp_suite.sh"])
def test_a_ref_the_repository_lacks_is_named(runner: str, tmp_path: Path) -> None:
    repo = _git_repo(tmp_path / "peer", "v1")
    out = _run(str(SUITES / runner), str(repo), "no-such-ref")
    assert out.returncode == 2 and "no commit named no-such-ref" in out.stderr


def test_the_resolver_takes_a_checkout_or_a_bare_git_directory(tmp_path: Path) -> None:
    repo = _git_repo(tmp_path / "peer", "v1")
    bare = tmp_path / "bare.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(repo), str(bare)], check=True)
    for path, want in ((repo, repo / ".git"), (bare, bare)):
        got = _run("-c", f'. {SUITES / "_peer_repo.sh"} && peer_git_dir a/b "{path}" v1')
        assert got.returncode == 0, got.stderr
        assert Path(got.stdout.strip()).resolve() == want.resolve()


def test_the_torchtitan_runner_names_its_ref_and_mode(tmp_path: Path) -> None:
    """Its ref is TORCHTITAN_REF (default: the revision docs/suites/torchtitan.md reports)."""
    repo = _git_repo(tmp_path / "peer", "v1")
    runner = str(SUITES / "run_torchtitan_suite.sh")
    out = _run(runner, str(repo))
    assert out.returncode == 2 and "no commit named 2e92be1c4" in out.stderr
    other = subprocess.run(["bash", runner, str(repo), "sideways"], cwd=ROOT, text=True,
                           capture_output=True, timeout=60, stdin=subprocess.DEVNULL,
                           env={"PATH": "/usr/bin:/bin", "TORCHTITAN_REF": "v1",
                                "WORK": str(tmp_path / "work")})
    assert other.returncode == 2 and "mode must be dcp or mithril" in other.stderr
    tagged = subprocess.run(["bash", runner, str(repo), "mithril"], cwd=ROOT, text=True,
                            capture_output=True, timeout=60, stdin=subprocess.DEVNULL,
                            env={"PATH": "/usr/bin:/bin", "TORCHTITAN_REF": "v1",
                                 "WORK": str(tmp_path / "work")})
    assert tagged.returncode == 2 and "no tests/unit_tests/test_checkpoint.py" in tagged.stderr
