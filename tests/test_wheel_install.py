"""The package as a user installs it: build the wheel, install it into a fresh venv, and run the
CLI from a folder outside the repository. The plugins live in the repository's top-level
processors/, rewards/ and data/ folders, mapped to mmrl.plugins.* by setup.py; a layout change
that leaves them out of the wheel would only show here (an editable install reads the folders
in place).

The fresh venv gets mmrl from the wheel alone; its third-party dependencies (torch, vLLM, ...)
are this environment's, reached through a path file, because installing them again would take
minutes and test pip, not mmrl. The editable install's own path hook is not read from there
(Python runs .pth files only in site directories), which the test checks: mmrl must import from
the venv."""
from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, timeout: int = 600) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(cwd), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the fresh venv, a working folder outside the repository)."""
    root = tmp_path_factory.mktemp("wheel")
    # built from a copy: setuptools leaves build/ in the source folder, and a stale build/ from
    # an older layout would put files in the wheel that the sources no longer have
    source = root / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "work", "runs", "build", "results", "__pycache__", "*.egg-info", ".pytest_cache"))
    built = root / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(built), str(source)],
         cwd=root)
    wheel = next(built.glob("mmrl-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for member in ["mmrl/plugins/processors/qwen_vl.py", "mmrl/plugins/rewards/grounding.py",
                   "mmrl/plugins/data/recipes/colors.py", "mmrl/plugins/data/convert.py",
                   "mmrl/profiling/report.schema.json"]:
        assert member in names, f"{member} is missing from {wheel.name}"
    assert not any(n.split("/")[0] in {"data", "rewards", "processors"} for n in names), \
        "no top-level package named data, rewards or processors may be installed"

    env_dir = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], cwd=root)
    python = env_dir / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)], cwd=root)
    work = root / "elsewhere"
    work.mkdir()
    shutil.copy(REPO / "configs" / "colors_demo.yaml", work / "colors_demo.yaml")
    return env_dir, work


def test_the_installed_wheel_imports_from_the_venv(venv: tuple[Path, Path]) -> None:
    env_dir, work = venv
    where = _run([str(env_dir / "bin" / "python"), "-c",
                  "import mmrl, mmrl.plugins.rewards as r; print(mmrl.__file__); print(r.__file__)"], cwd=work)
    for line in where.split():
        assert line.startswith(str(env_dir)), f"imported from outside the venv: {line}"


def test_the_cli_works_from_outside_the_repository(venv: tuple[Path, Path]) -> None:
    env_dir, work = venv
    mmrl = str(env_dir / "bin" / "mmrl")
    listing = _run([mmrl, "plugins", "list"], cwd=work)
    for name in ["qwen_vl", "llava", "grounding_iou", "shape_colour", "colors", "gui_click"]:
        assert name in listing, name
    _run([mmrl, "tiny-model", "--arch", "qwen2_5_vl", "--out", "model"], cwd=work)
    _run([mmrl, "data", "build", "colors", "--out", "shards", "train_size=32", "heldout_size=8", "shard_size=16"],
         cwd=work)
    assert sorted(p.name for p in (work / "shards").glob("*.tar")) == [
        "heldout-000000.tar", "train-000000.tar", "train-000001.tar"]
    plan = _run([mmrl, "train", "colors_demo.yaml", "model.path=model", "data.train_shards=shards/train-{000000..000001}.tar",
                 "data.heldout_shards=shards/heldout-000000.tar", "--dry-run"], cwd=work)
    assert "model:" in plan and "shards/train-{000000..000001}.tar" in plan


def test_a_checkout_on_sys_path_finds_the_plugin_folders_in_place(venv: tuple[Path, Path]) -> None:
    """A script that puts the repository on sys.path instead of installing it (as the TRL
    comparison does from its own venv) imports the plugins from the top-level folders."""
    env_dir, work = venv
    where = _run([str(env_dir / "bin" / "python"), "-c",
                  f"import sys; sys.path.insert(0, {str(REPO)!r}); import mmrl.plugins.rewards.colour as c; "
                  "import mmrl.plugins.processors.llava as p; print(c.__file__, p.__file__)"], cwd=work)
    assert where.split() == [str(REPO / "rewards" / "colour.py"), str(REPO / "processors" / "llava.py")]
