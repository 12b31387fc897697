"""The memory plan `mmrl train --dry-run` prints (mmrl/controller/memory_plan.py): exact parameter
counts from the config alone, the per-device terms against hand-computed values, ZeRO-3 sharding,
frozen/LoRA trainable counts, the refusal of a plan that cannot fit, and the 7B example configs
planned for 80 GB GPUs that are not here, from a local config.json (no weights, no network)."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from mmrl.cli import main
from mmrl.config import load_config
from mmrl.controller.memory_plan import (GIB, MemoryPlanError, check_memory_plan, format_memory_plan, memory_plan,
                                         read_model_shape)

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "configs" / "colors_demo.yaml")

# Qwen2.5-VL-7B-Instruct's published config.json (hyperparameters only: the plan reads no weights)
QWEN2_5_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
    "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 128000, "max_window_layers": 28,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "sliding_window": 32768, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
                      "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
                      "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                      "tokens_per_second": 2, "hidden_act": "silu"},
}


@pytest.fixture(scope="module")
def qwen7b_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2_5_vl_7b")
    (folder / "config.json").write_text(json.dumps(QWEN2_5_VL_7B))
    return folder


def _tiny_cfg(model_dir: Path, *overrides: str):
    return load_config(DEMO, [f"model.path={model_dir}", "model.dtype=bfloat16", "trainer.world_size=2",
                              "trainer.micro_batch_size=4", "processor.max_prompt_tokens=60",
                              "rollout.max_new_tokens=4", *overrides], check_files=False)


def _terms(load) -> dict[str, float]:
    return {t.key: t.bytes for t in load.terms}


def test_parameter_counts_are_exact_from_the_config_alone(tiny_model_dir: Path, qwen7b_dir: Path) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    tiny = read_model_shape(str(tiny_model_dir))
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)
    assert tiny.params == sum(p.numel() for p in model.parameters()) == 642_816
    assert tiny.tower_params == sum(p.numel() for n, p in model.named_parameters()
                                    if ".visual." in n and ".merger." not in n) == 116_928
    assert tiny.projector_params == sum(p.numel() for n, p in model.named_parameters() if ".merger." in n)
    assert tiny.largest_tensor == max(p.numel() for p in model.parameters()) == 75_264  # the patch embedding
    big = read_model_shape(str(qwen7b_dir))  # the meta device: no 16 GB of weights allocated
    assert big.params == 8_292_166_656 and big.tower_params == 631_975_680 and big.projector_params == 44_574_464
    assert big.largest_tensor == 152064 * 3584  # embedding (and lm_head: not tied)
    assert (big.kv_heads, big.head_dim, big.patches_per_token) == (4, 128, 4)
    assert torch.empty(0).device.type == "cpu"  # building on meta left the default device alone


def test_tiny_plan_against_hand_computed_values(tiny_model_dir: Path) -> None:
    """Tiny Qwen2.5-VL: P = 642,816 params (tower 116,928), hidden 128, 2 layers, MLP 256, vocab
    512, 1 KV head of 64; vision width 64, depth 1, MLP 128, merge 2x2. bf16 (b = 2), 2 ranks,
    micro-batch 4 x (60 + 4) = 256 tokens, 4 x 4 = 16 of them response tokens."""
    plan = memory_plan(_tiny_cfg(tiny_model_dir), "cuda", memory_gib=10.0)
    engine, trainer = plan.loads
    assert plan.trainable == 642_816 and plan.devices_needed == 1 + 2
    assert _terms(trainer) == {
        "weights": 642_816 * 2 / 2,
        "optimizer": 642_816 * 12 / 2,                                 # fp32 master + Adam m, v
        "gradients": 642_816 * 2 / 2 + 4 * 642_816 / 2,                # bf16 partition + fp32 copy at the step
        "zero3_buffers": (75_264 + 10_000_000 + 10_000_000) * 2,       # largest tensor + prefetch + reduce buckets
        "activations": 256 * (8 * 128 + 4 * 256) * 2 * 2              # text: tokens x (8h + 4I) x b x layers
                       + (256 - 16) * 4 * (8 * 64 + 4 * 128) * 2 * 1,  # vision: 960 patches x (8w + 4I) x b x depth
        "logits": 16 * 512 * (2 + 16),
        "runtime": 1.5 * GIB,
    }
    kv_per_token = 2 * 2 * 1 * 64 * 2  # layers x (k, v) x kv heads x head dim x 2 B = 512 B
    assert _terms(engine) == {"engine_weights": 642_816 * 2,
                              "kv_cache": 0.9 * 10 * GIB - 642_816 * 2 - 2 * GIB,  # vLLM's default 0.9 of 10 GiB
                              "runtime": 2 * GIB}
    assert engine.total == pytest.approx(0.9 * 10 * GIB) and trainer.total < 10 * GIB
    check_memory_plan(plan)  # fits

    unknown = memory_plan(_tiny_cfg(tiny_model_dir), "cuda", memory_gib=None)
    # no memory figure: the KV the rollout needs: 256 sequences in flight (16 prompts x 16, under
    # max_num_seqs 256) x 64 tokens each (under max_model_len 512)
    assert _terms(unknown.loads[0])["kv_cache"] == 256 * 64 * kv_per_token
    assert all(load.capacity_bytes is None for load in unknown.loads)
    checkpointed = memory_plan(_tiny_cfg(tiny_model_dir, "trainer.gradient_checkpointing=true"), "cuda", 10.0)
    # each layer's input (tokens x h x layers x b) + one layer recomputed; the tower likewise
    assert _terms(checkpointed.loads[1])["activations"] == (256 * 128 * 2 * 2 + 256 * 2048 * 2) + \
        (960 * 64 * 1 * 2 + 960 * 1024 * 2)


def test_zero3_halves_the_per_rank_state_from_one_to_two_ranks(tiny_model_dir: Path) -> None:
    one, two = (_terms(memory_plan(_tiny_cfg(tiny_model_dir, f"trainer.world_size={n}"), "cuda", 10.0).loads[1])
                for n in (1, 2))
    for key in ("weights", "optimizer"):
        assert two[key] == one[key] / 2
    assert two["activations"] == one["activations"]  # a micro-batch is per rank whatever the world size


def test_frozen_tower_and_lora_shrink_the_trainable_terms(tiny_model_dir: Path) -> None:
    """Frozen tower: its parameters leave the optimizer and gradient terms (and its activations go).
    LoRA: the plan counts exactly the adapters the trainer rank trains (peft on the real model,
    then freeze_vision: adapters inside a frozen tower are frozen too)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from mmrl.trainer.model_setup import freeze_vision

    full = memory_plan(_tiny_cfg(tiny_model_dir), "cuda", 10.0)
    frozen = memory_plan(_tiny_cfg(tiny_model_dir, "trainer.freeze_vision_tower=true"), "cuda", 10.0)
    assert frozen.trainable == full.trainable - 116_928
    assert _terms(frozen.loads[1])["optimizer"] == (642_816 - 116_928) * 12 / 2
    assert _terms(frozen.loads[1])["activations"] == 256 * 2048 * 2 * 2  # the text model's only
    lora_args = ["trainer.lora.enabled=true", "trainer.lora.rank=4", "trainer.lora.target_modules=[q_proj,v_proj,qkv]"]
    for freeze in (False, True):
        plan = memory_plan(_tiny_cfg(tiny_model_dir, *lora_args, f"trainer.freeze_vision_tower={freeze}"), "cuda", 10.0)
        model = get_peft_model(AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.bfloat16),
                               LoraConfig(r=4, target_modules=["q_proj", "v_proj", "qkv"]))
        freeze_vision(model, tower=freeze, projector=False)
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert plan.trainable == trained < frozen.trainable
        assert _terms(plan.loads[1])["optimizer"] == trained * 12 / 2
    assert plan.trainable < memory_plan(_tiny_cfg(tiny_model_dir, *lora_args), "cuda", 10.0).trainable


def test_a_plan_that_cannot_fit_is_refused_with_the_biggest_term_and_the_fix(qwen7b_dir: Path) -> None:
    base = [f"model.path={qwen7b_dir}", "model.dtype=bfloat16", "trainer.world_size=4",
            "trainer.freeze_vision_tower=true", "trainer.micro_batch_size=8", "trainer.max_tokens_per_micro_batch=8192",
            "processor.max_prompt_tokens=2048", "rollout.max_new_tokens=2048", "rollout.engine_args.max_model_len=4096"]
    ok = memory_plan(load_config(DEMO, base + ["trainer.gradient_checkpointing=true"], check_files=False), "cuda", 80.0)
    check_memory_plan(ok)
    plan = memory_plan(load_config(DEMO, base, check_files=False), "cuda", 80.0)
    assert plan.loads[1].biggest.key == "activations"
    with pytest.raises(MemoryPlanError, match=r"trainer rank needs .* of 80.00 GiB; the biggest term is activations "
                                              r".*gradient_checkpointing=true"):
        check_memory_plan(plan)
    assert "DOES NOT FIT" in format_memory_plan(plan)
    # a 16 GiB device cannot hold an engine's 15.4 GiB of bf16 weights plus its runtime
    small = memory_plan(load_config(DEMO, base + ["trainer.gradient_checkpointing=true", "trainer.world_size=64"],
                                    check_files=False), "cuda", 16.0)
    with pytest.raises(MemoryPlanError, match=r"rollout engine needs .*biggest term is weights .*tensor_parallel_size"):
        check_memory_plan(small)
    split = memory_plan(load_config(DEMO, base + ["trainer.gradient_checkpointing=true", "trainer.world_size=64",
                                                  "rollout.engine_args.tensor_parallel_size=2"], check_files=False),
                        "cuda", 16.0)
    assert _terms(split.loads[0])["engine_weights"] == 8_292_166_656 * 2 / 2
    assert split.devices_needed == 1 * 2 + 64


def _geo3k_shards(tmp_path: Path) -> Path:
    """Shards made the way the 7B configs' headers say: `mmrl data convert --from parquet` on a
    Geometry3K-layout parquet (images, problem with <image>, answer)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (64, 48), "white").save(png, format="PNG")
    rows = [{"images": [{"bytes": png.getvalue(), "path": None}],
             "problem": "<image>Find x. Choices: A:1 B:2 C:3 D:4", "answer": str(i % 4 + 1)} for i in range(3)]
    src = tmp_path / "hf" / "train-00000-of-00001.parquet"
    src.parent.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), src)
    out = tmp_path / "geo3k"
    for split in ("train", "test"):
        assert main(["data", "convert", "--from", "parquet", "--src", str(src), "--out", str(out),
                     "--split", split, "--shard-size-mb", "8"]) == 0
    return out


@pytest.mark.parametrize("name, ranks, engines, gpu_gb", [("qwen2_5_vl_7b_geo3k_1x8", 4, 4, 80),
                                                          ("qwen2_5_vl_7b_geo3k_2x8", 8, 8, 40)])
def test_dry_run_of_the_7b_configs_plans_for_80gb_gpus(name: str, ranks: int, engines: int, gpu_gb: int,
                                                       qwen7b_dir: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """No GPU and no network here: cluster.device=cuda plans for GPUs that are absent, and the
    model's config.json comes from a local folder with the 7B hyperparameters. Without gradient
    checkpointing the plan is refused on `gpu_gb` GPUs (1x8: at 80 GB already; 2x8's 8 ranks
    leave room for the ~45 GiB of activations at 80 GB, not at 40)."""
    shards = _geo3k_shards(tmp_path)
    capsys.readouterr()
    overrides = [f"model.path={qwen7b_dir}", f"data.train_shards={shards}/train-000000.tar",
                 f"data.heldout_shards={shards}/test-000000.tar"]
    config = str(REPO / "configs" / f"{name}.yaml")
    assert main(["train", config, *overrides, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# placement (device: cuda)" in out and f"DeepSpeed ZeRO-3 rank {ranks - 1}/{ranks} (nccl)" in out
    plan = out[out.index("# memory plan"):]
    assert "8.29 B parameters (vision tower 0.63 B" in plan and "trainable 7.66 B" in plan
    assert f"devices needed: {ranks + engines}" in plan and "80 GiB per device" in plan
    assert plan.count(": fits") == 2 and "DOES NOT FIT" not in plan
    assert "8,192 tokens/micro-batch, checkpointed" in plan
    # the same plan without checkpointing is refused: printed, then the error and a non-zero exit
    assert main(["train", config, *overrides, "trainer.gradient_checkpointing=false", f"cluster.gpu_memory_gb={gpu_gb}",
                 "--dry-run"]) == 2
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())  # the CLI wraps its message
    assert "DOES NOT FIT" in captured.out
    assert "the biggest term is activations" in err and "trainer.gradient_checkpointing=true" in err


def test_dry_run_of_the_demo_prints_a_cpu_plan(tiny_model_dir: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """On CPU the plan is per process and nothing is refused (the host's memory is shared)."""
    shards = _geo3k_shards(tmp_path)
    capsys.readouterr()
    assert main(["train", DEMO, f"model.path={tiny_model_dir}", f"data.train_shards={shards}/train-000000.tar",
                 f"data.heldout_shards={shards}/test-000000.tar", "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = out[out.index("# memory plan (device: cpu"):]
    assert "no fit check on cpu" in plan and "0.64 M parameters" in plan
    assert "KV cache" in plan and "VLLM_CPU_KVCACHE_SPACE" in plan and "fits" not in plan
