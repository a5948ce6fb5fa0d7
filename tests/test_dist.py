"""The release artefacts: ``make dist`` builds an sdist and a manylinux ``cp311-abi3`` wheel
(from that sdist) that installs into a fresh virtual environment without a compiler and works
there, from a directory outside the checkout, in both save processes; the version is
single-sourced; the ``s3`` extra is named when aioboto3 is missing.

The fresh venv gets torch and the other dependencies from the running interpreter's
site-packages through a ``.pth`` file (nothing is downloaded); only the wheel is installed
into it, ``--no-deps --no-index``.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

import mithril_async
from mithril_async import cli

ROOT = Path(__file__).resolve().parents[1]
#: name-version-python-abi-platform.whl (no build tag)
WHEEL = re.compile(
    r"^mithril_async-(?P<version>[^-]+)-(?P<python>[^-]+)-(?P<abi>[^-]+)-(?P<platform>[^-]+)\.whl$"
)


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment without this checkout on the path or the suite's save-process default."""
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and not k.startswith("MITHRIL_")}
    env.update(extra)
    return env


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, (
        f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
        f"stderr:\n{proc.stderr[-4000:]}")
    return proc.stdout


def test_version_single_sourced() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", mithril_async.__version__)
    assert f"## [{mithril_async.__version__}]" in (ROOT / "CHANGELOG.md").read_text()


def test_cli_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mithril {mithril_async.__version__}"


def test_s3_without_aioboto3_names_the_extra(tmp_path: Path) -> None:
    # None in sys.modules makes `import aioboto3` raise ImportError, as when it is not installed
    code = (
        "import sys; sys.modules['aioboto3'] = None\n"
        "from mithril_async import open_store\n"
        "try:\n"
        "    open_store('s3://bucket/prefix')\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        "else:\n"
        "    raise SystemExit('no ImportError')\n"
    )
    out = _run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ), timeout=120)
    assert "mithril_async[s3]" in out and "aioboto3" in out


@pytest.mark.slow
def test_wheel_installs_and_works_without_compiler(tmp_path: Path) -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    dist = tmp_path / "dist"
    _run(["make", "-s", "dist", f"PYTHON={sys.executable}", f"DIST={dist}"],
         cwd=ROOT, env=_clean_env(), timeout=600)

    sdists = list(dist.glob("*.tar.gz"))
    wheels = list(dist.glob("*.whl"))
    assert [p.name for p in sdists] == [f"mithril_async-{mithril_async.__version__}.tar.gz"]
    assert len(wheels) == 1, wheels
    tags = WHEEL.match(wheels[0].name)
    assert tags is not None, wheels[0].name
    assert tags["version"] == mithril_async.__version__
    assert (tags["python"], tags["abi"]) == ("cp311", "abi3")
    assert re.fullmatch(r"manylinux_\d+_\d+_(x86_64|aarch64)", tags["platform"]), tags["platform"]

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                        cwd=tmp_path, env=_clean_env(), timeout=60).strip())
    # torch and the other dependencies: the running interpreter's, after the venv's own
    (purelib / "_deps_from_host.pth").write_text(
        "".join(f"{p}\n" for p in site.getsitepackages()))

    # No compiler on PATH and CC/CXX that fail: installing the wheel must not build anything.
    no_tools = tmp_path / "empty-bin"
    no_tools.mkdir()
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps",
          "--no-index", "--no-cache-dir", "--disable-pip-version-check", str(wheels[0])],
         cwd=tmp_path, env=_clean_env(PATH=str(no_tools), CC="/bin/false", CXX="/bin/false"),
         timeout=300)

    work = tmp_path / "elsewhere"
    work.mkdir()
    out = _run([str(py), str(ROOT / "tests" / "dist_smoke.py"), str(work / "runs")],
               cwd=work, env=_clean_env(), timeout=300)
    installed = re.search(r"^mithril_async (\S+) from (.+)$", out, re.M)
    assert installed is not None, out
    assert installed[1] == mithril_async.__version__
    assert Path(installed[2]).is_relative_to(purelib), installed[2]
    assert "ok inline" in out and "ok worker" in out

    version = _run([str(env_dir / "bin" / "mithril"), "--version"],
                   cwd=work, env=_clean_env(), timeout=120)
    assert version.strip() == f"mithril {mithril_async.__version__}"
