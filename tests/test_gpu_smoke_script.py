"""scripts/gpu_smoke.sh (the CUDA path's real run) parses, and refuses clearly where there is no GPU.
Its GPU part cannot run here; what it checks is described in the script itself."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_smoke.sh"
BASH = shutil.which("bash") or "/bin/bash"


def test_the_gpu_smoke_script_is_valid_bash() -> None:
    proc = subprocess.run([BASH, "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_without_nvidia_smi_it_refuses_before_doing_anything(tmp_path: Path) -> None:
    # an empty PATH: no nvidia-smi (and no pip, python or ray it could start by mistake)
    proc = subprocess.run([BASH, str(SCRIPT)], capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": str(tmp_path), "HOME": str(tmp_path)}, timeout=30)
    assert proc.returncode == 2
    assert "no NVIDIA GPU here (nvidia-smi not found)" in proc.stderr
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []  # nothing set up, nothing written
