"""`mmrl new KIND NAME`: each template is a working plugin whose generated test passes (against
mmrl.testing's contract checks; the agent loop's on a real vLLM engine), run as a user would,
with pytest in the folder the files were written to."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mmrl.cli import main
from mmrl.scaffold import KINDS, new_plugin


@pytest.mark.slow
def test_every_kind_passes_its_own_generated_test(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "plugins"
    for kind in KINDS:
        assert main(["new", kind, f"my_{kind}", "--dir", str(out)]) == 0
        printed = capsys.readouterr().out
        assert f"test_my_{kind}.py" in printed and "use it in a config" in printed
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "."],
                         cwd=out, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert f"{2 * len(KINDS) - 1} passed" in run.stdout  # two tests per kind, one for the agent loop


def test_new_refuses_bad_names_and_existing_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    made = new_plugin("reward", "bright_side", tmp_path)
    assert f"name: {made.plugin.resolve()}:bright_side" in made.usage  # outside the working dir: absolute
    assert made.plugin.read_text().count('@register("reward", "bright_side")') == 1
    assert main(["new", "reward", "bright_side", "--dir", str(tmp_path)]) == 2
    assert "already exist" in capsys.readouterr().err
    assert main(["new", "reward", "bright_side", "--dir", str(tmp_path), "--force"]) == 0
    for bad in ("Bright", "2fast", "class", "my-reward"):
        with pytest.raises(ValueError, match="lower-case Python identifier"):
            new_plugin("reward", bad, tmp_path)
