"""How much memory each device of a run needs: the estimate `mmrl train --dry-run` prints, and
the refusal of a plan that cannot fit, before minutes go into starting engines and ranks.

Parameter counts are exact: the model is built from its config.json on the `meta` device (no
weights read or allocated), so a hub model needs only its config (a local folder works offline).
Everything else is an estimate from the config, per device, assuming the split placement mmrl
uses today (engines and trainer ranks on separate devices):

trainer rank (ZeRO-3 over N = trainer.world_size ranks; P params, P_t of them trainable, b = 2
bytes in bfloat16, 4 in float32):
  weights       P x b / N (+ LoRA adapters); the KL reference, when loaded, is another P x b / N
  optimizer     P_t x 12 / N in bfloat16 (fp32 master copy + Adam m and v); P_t x 8 / N in float32
                (DeepSpeed 0.19 uses an fp32 model's own partition as the master copy)
  gradients     P_t x b / N, + in bfloat16 the fp32 copy of one optimizer sub-group (at most
                zero_optimization.sub_group_size elements) made at the step
  ZeRO-3 buffers  the largest single tensor gathered whole (the embedding) + prefetch and reduce buckets
  activations   tokens x layers x (8 h + 4 I) x b without checkpointing: per token and decoder
                layer autograd keeps about eight hidden-sized tensors (norm inputs and outputs,
                q, attention output, residuals) and four intermediate-sized ones (the MLP's gate,
                up, activation and product), assuming a fused attention kernel (no seq^2 term).
                A generous rule: for I = 4h it gives 48 h bytes per token and layer at 16 bit
                where Korthikanti et al. 2022 count 34 h (GeLU MLP; SwiGLU keeps more, and the
                fp32 norm statistics are not free). With gradient checkpointing only each layer's input is
                kept (tokens x layers x h x b) plus one layer's full set during its recompute.
                The vision tower, when trained, adds the same per patch and block (patches =
                prompt tokens x merge^2, as if every prompt token were an image token: an upper bound)
  logits        response tokens x vocab x (b + 16): the kept logits, and the fp32 log-softmax
                and probabilities autograd keeps for the logprobs and the entropy, with their
                gradients in the backward (trainer/batch.py::sampling_logprobs)
  runtime       CUDA context, NCCL buffers and allocator slack: 1.5 GiB, a rule of thumb
tokens per micro-batch = micro_batch_size x (max_prompt_tokens + max_new_tokens), capped by
trainer.max_tokens_per_micro_batch (a sequence longer than the cap is a micro-batch alone).

rollout engine (per device; tp = tensor_parallel_size x pipeline_parallel_size, the devices the
model is split over; data_parallel_size copies of that each take a share of the prompts):
  weights       P x b / tp
  KV cache      on CUDA with known memory: what gpu_memory_utilization x memory leaves after the
                weights and the runtime reserve (vLLM sizes it so); otherwise what the rollout
                needs, sequences in flight x tokens each x per-token bytes (layers x 2 x kv heads x
                head dim x dtype bytes) / tp; on CPU: VLLM_CPU_KVCACHE_SPACE GiB
  runtime       non-torch memory, CUDA graphs and the profiled activations of the largest batch
                (vision encoder included): 2 GiB, a rule of thumb for a 7B model

colocated (cluster.colocate: engine i on trainer rank i's GPU), per shared GPU, the peak of three phases:
  train         the rank's terms above + the sleeping engine's residue (vLLM sleep level 1 moves
                its weights to host memory and frees its KV cache; the CUDA context and memory
                outside vLLM's sleep pool stay: 1 GiB, a rule of thumb)
  weight sync   the rank's hold + the engine's weights and runtime (woken first) + the sync's
                buffers (object_store: the whole model staged; collective / cuda_ipc: ~2 buckets)
  rollout       the rank's hold + the engine's budget, gpu_memory_utilization x memory (weights,
                KV cache, runtime)
  The rank's hold between updates is its whole update peak: PyTorch's caching allocator keeps
  the freed activation and logit blocks and the ranks neither empty nor offload them yet, so the
  plan counts them (and says how much emptying them would give back). The default
  gpu_memory_utilization (rollout.engine_args unset or null) is what the hold leaves, less a 2%
  margin: 1 - hold / memory - 0.02, rounded down to 0.01.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from mmrl.config.load import ConfigError
from mmrl.config.schema import Config
from mmrl.controller.placement import colocated

GIB = 2**30
TRAINER_RUNTIME_GIB = 1.5
ENGINE_RUNTIME_GIB = 2.0
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
VLLM_DEFAULT_MAX_NUM_SEQS = 256
DS_DEFAULT_SUB_GROUP_SIZE = 1e9
ENGINE_ASLEEP_GIB = 1.0  # what a colocated engine keeps on its GPU while asleep (rule of thumb)
COLOCATE_MARGIN = 0.02  # of the GPU's memory, left free by the derived gpu_memory_utilization
RELEASABLE = ("activations", "logits")  # trainer terms an emptied allocator cache would give back

# What to change when a term is the biggest one on a device that does not fit.
FIXES = {
    "weights": "more trainer ranks (trainer.world_size): ZeRO-3 shards the weights over them",
    "reference": "more trainer ranks, or LoRA (trainer.lora.enabled=true: the reference is the base model, no copy)",
    "optimizer": "more trainer ranks (trainer.world_size), trainer.freeze_vision_tower=true, or LoRA "
                 "(trainer.lora.enabled=true): only trainable parameters hold optimizer state",
    "gradients": "more trainer ranks (trainer.world_size), trainer.freeze_vision_tower=true, or LoRA",
    "zero3_buffers": "smaller trainer.deepspeed.zero_optimization buckets, or more memory per device",
    "activations": "trainer.gradient_checkpointing=true, or a smaller trainer.micro_batch_size / "
                   "trainer.max_tokens_per_micro_batch",
    "logits": "a smaller trainer.micro_batch_size / trainer.max_tokens_per_micro_batch, or a smaller "
              "rollout.max_new_tokens",
    "runtime": "a device with more memory",
    "engine_weights": "rollout.engine_args.tensor_parallel_size=2 (or more), or a higher "
                      "rollout.engine_args.gpu_memory_utilization",
    "kv_cache": "a lower rollout.engine_args.gpu_memory_utilization or max_model_len",
    "trainer_hold": "fewer bytes per trainer rank (more ranks, LoRA, a frozen tower, gradient checkpointing, a "
                    "smaller micro-batch), or cluster.colocate=false",
    "engine_asleep": "a device with more memory, or cluster.colocate=false",
    "sync_buffers": "weight_sync.transport=collective (about two buckets staged instead of the whole model) or a "
                    "smaller weight_sync.bucket_mb",
}


class MemoryPlanError(ConfigError):
    pass


@dataclass
class ModelShape:
    """What the estimate needs to know about the model, read from its config alone."""

    model_class: str
    params: int
    tower_params: int
    projector_params: int
    largest_tensor: int
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    kv_heads: int
    head_dim: int
    vision_width: int
    vision_depth: int
    vision_intermediate: int
    patches_per_token: int
    lora_params: dict[str, int] = field(default_factory=dict)  # adapters by part: tower, projector, text


def read_model_shape(path: str, trust_remote_code: bool = False, lora_targets: list[str] | None = None,
                     lora_rank: int = 8) -> ModelShape:
    """Exact parameter counts from the model built on the meta device (config.json only)."""
    import torch

    from mmrl.trainer.model_setup import find_vision_parts, model_skeleton

    model = model_skeleton(path, trust_remote_code)
    config = model.config
    parts = find_vision_parts(model)
    named = list(model.named_parameters())
    text, vision = config.get_text_config(), config.vision_config
    width = getattr(vision, "embed_dim", None) or vision.hidden_size  # Qwen2-VL: hidden_size is the merger's output
    merge = getattr(vision, "spatial_merge_size", None) or round(1 / getattr(config, "downsample_ratio", 1.0))
    lora: dict[str, int] = {"tower": 0, "projector": 0, "text": 0}
    for name, module in model.named_modules():  # peft's rule for a list of names: a suffix match
        if lora_targets and isinstance(module, torch.nn.Linear) and \
                any(name == t or name.endswith("." + t) for t in lora_targets):
            part = "projector" if parts.is_projector(name) else "tower" if parts.is_tower(name) else "text"
            lora[part] += lora_rank * (module.in_features + module.out_features)
    heads = text.num_attention_heads
    return ModelShape(
        model_class=type(model).__name__, params=sum(p.numel() for _, p in named),
        tower_params=sum(p.numel() for n, p in named if parts.is_tower(n)),
        projector_params=sum(p.numel() for n, p in named if parts.is_projector(n)),
        largest_tensor=max(p.numel() for _, p in named), hidden=text.hidden_size, layers=text.num_hidden_layers,
        intermediate=text.intermediate_size, vocab=text.vocab_size,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        vision_width=width, vision_depth=getattr(vision, "depth", None) or vision.num_hidden_layers,
        vision_intermediate=getattr(vision, "intermediate_size", None) or int(width * getattr(vision, "mlp_ratio", 4)),
        patches_per_token=int(merge) ** 2, lora_params=lora)


@dataclass
class Term:
    key: str  # a FIXES key
    label: str
    bytes: float
    detail: str = ""


@dataclass
class DeviceLoad:
    """One kind of process and what each instance holds on its device."""

    role: str
    count: int
    terms: list[Term]
    capacity_bytes: float | None = None  # None: no fit check
    capacity_detail: str = ""
    notes: list[str] = field(default_factory=list)
    # colocated: each phase's terms (name, terms); `terms` is then the peak phase's
    phases: list[tuple[str, list[Term]]] = field(default_factory=list)
    hint: str = ""  # added to a refusal (colocated: the gpu_memory_utilization that fits)

    @property
    def total(self) -> float:
        return sum(t.bytes for t in self.terms)

    @property
    def biggest(self) -> Term:
        return max(self.terms, key=lambda t: t.bytes)


@dataclass
class MemoryPlan:
    device: str
    memory_gib: float | None
    shape: ModelShape
    trainable: int
    loads: list[DeviceLoad]
    devices_needed: int


def _bytes_of(dtype: str) -> int:
    return 4 if str(dtype) in ("float32", "float", "fp32") else 2


def micro_batch_tokens(cfg: Config) -> tuple[int, int]:
    """(tokens, response tokens) of the largest micro-batch the plan can make."""
    longest = cfg.processor.max_prompt_tokens + cfg.rollout.max_new_tokens
    tokens = cfg.trainer.micro_batch_size * longest
    if cfg.trainer.max_tokens_per_micro_batch:
        tokens = min(tokens, max(cfg.trainer.max_tokens_per_micro_batch, longest))
    return tokens, tokens * cfg.rollout.max_new_tokens // longest


def trainable_params(cfg: Config, shape: ModelShape) -> int:
    t = cfg.trainer
    if t.lora.enabled:  # adapters only; those inside a frozen part are frozen with it
        lora = shape.lora_params
        return lora["text"] + (0 if t.freeze_vision_tower else lora["tower"]) + \
            (0 if t.freeze_projector else lora["projector"])
    return shape.params - (shape.tower_params if t.freeze_vision_tower else 0) - \
        (shape.projector_params if t.freeze_projector else 0)


def _layer_activations(tokens: float, width: int, inter: int, depth: int, b: int, checkpointing: bool) -> float:
    per_layer = tokens * (8 * width + 4 * inter) * b
    return tokens * width * depth * b + per_layer if checkpointing else per_layer * depth


def trainer_load(cfg: Config, shape: ModelShape, device: str) -> DeviceLoad:
    from mmrl.controller.learn import needs_reference
    from mmrl.trainer.deepspeed_config import build_deepspeed_config

    t, n, b = cfg.trainer, cfg.trainer.world_size, _bytes_of(cfg.model.dtype.value)
    zero = build_deepspeed_config(grad_clip=t.grad_clip, bf16=b == 2, user=t.deepspeed)["zero_optimization"]
    trainable = trainable_params(cfg, shape)
    adapters = sum(shape.lora_params.values()) if t.lora.enabled else 0
    offloaded = str((zero.get("offload_optimizer") or {}).get("device", "none")) in ("cpu", "nvme")
    terms = [Term("weights", "weights", (shape.params + adapters) * b / n,
                  f"{_b(shape.params + adapters)} params x {b} B / {n} ranks")]
    if needs_reference(cfg) and not t.lora.enabled:
        terms.append(Term("reference", "KL reference", shape.params * b / n, "a frozen ZeRO-3 copy"))
    state = 12 if b == 2 else 8
    terms.append(Term("optimizer", "optimizer state", 0 if offloaded else trainable * state / n,
                      "offloaded to the host" if offloaded else
                      f"{_b(trainable)} trainable x {state} B / {n} ranks"
                      + (" (fp32 master + Adam m, v)" if b == 2 else " (Adam m, v)")))
    fp32_copy = 0 if b == 4 or offloaded else 4 * min(trainable / n, zero.get("sub_group_size", DS_DEFAULT_SUB_GROUP_SIZE))
    terms.append(Term("gradients", "gradients", trainable * b / n + fp32_copy,
                      f"{_b(trainable)} x {b} B / {n} ranks" + (" + fp32 copy at the step" if fp32_copy else "")))
    buckets = zero.get("stage3_prefetch_bucket_size", 0) + zero.get("reduce_bucket_size", 0)
    terms.append(Term("zero3_buffers", "ZeRO-3 buffers", (shape.largest_tensor + buckets) * b,
                      f"largest tensor {_b(shape.largest_tensor)} gathered whole + buckets"))
    tokens, response = micro_batch_tokens(cfg)
    acts = _layer_activations(tokens, shape.hidden, shape.intermediate, shape.layers, b, t.gradient_checkpointing)
    detail = f"{tokens:,} tokens/micro-batch" + (", checkpointed" if t.gradient_checkpointing else "")
    if not t.freeze_vision_tower and (not t.lora.enabled or shape.lora_params["tower"]):  # a backward through it
        patches = (tokens - response) * shape.patches_per_token
        acts += _layer_activations(patches, shape.vision_width, shape.vision_intermediate, shape.vision_depth, b,
                                   t.gradient_checkpointing)
        detail += f"; vision tower trained: up to {patches:,} patches"
    terms.append(Term("activations", "activations", acts, detail))
    terms.append(Term("logits", "logits", response * shape.vocab * (b + 16),
                      f"{response:,} response tokens x {shape.vocab:,} vocab x {b + 16} B"))
    if device == "cuda":
        terms.append(Term("runtime", "runtime", TRAINER_RUNTIME_GIB * GIB, "CUDA context, NCCL, allocator (rule of thumb)"))
    return DeviceLoad("trainer rank", n, terms)


def engine_load(cfg: Config, shape: ModelShape, device: str, memory: float | None,
                util: float | None = None) -> DeviceLoad:
    """One engine's device; `util` overrides its gpu_memory_utilization (colocation's default)."""
    from mmrl.rollout.engine import DEFAULT_ENGINE_ARGS

    args = {**DEFAULT_ENGINE_ARGS, **{k: v for k, v in cfg.rollout.engine_args.items() if v is not None}}
    from mmrl.controller.placement import engine_devices

    tp, devices = engine_devices(args)  # tp: the model's split (tensor x pipeline); devices: x data parallel
    replicas = devices // tp
    b = _bytes_of(args.get("dtype", cfg.model.dtype.value))
    kv_b = 1 if str(args.get("kv_cache_dtype", "auto")).startswith("fp8") else b
    per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * kv_b / tp
    weights = shape.params * b / tp
    seq_tokens = min(int(args["max_model_len"]), cfg.processor.max_prompt_tokens + cfg.rollout.max_new_tokens)
    in_flight = min(int(args.get("max_num_seqs", VLLM_DEFAULT_MAX_NUM_SEQS)), cfg.rollout.max_requests_per_engine,
                    math.ceil(cfg.rollout.prompts_per_step / cfg.rollout.num_engines / replicas) * cfg.rollout.group_size)
    needed = in_flight * seq_tokens * per_token
    terms = [Term("engine_weights", "weights", weights, f"{_b(shape.params)} params x {b} B / tp {tp}")]
    notes: list[str] = []
    capacity = None
    if device == "cpu":
        space = float(cfg.rollout.engine_env.get("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", 1)))
        terms.append(Term("kv_cache", "KV cache", space * GIB, "VLLM_CPU_KVCACHE_SPACE"))
    else:
        terms.append(Term("runtime", "runtime", ENGINE_RUNTIME_GIB * GIB, "CUDA graphs, profiled activations (rule of thumb)"))
        if memory is None:
            terms.insert(1, Term("kv_cache", "KV cache", needed,
                                 f"{in_flight} sequences x {seq_tokens:,} tokens x {per_token / 1024:.1f} KiB"))
        else:
            util = float(util if util is not None else
                         args.get("gpu_memory_utilization", VLLM_DEFAULT_GPU_MEMORY_UTILIZATION))
            capacity = util * memory  # vLLM's budget: the KV cache fills what the rest leaves of it
            left = capacity - weights - ENGINE_RUNTIME_GIB * GIB
            one_sequence = seq_tokens * per_token  # vLLM refuses to start with less
            terms.insert(1, Term("kv_cache", "KV cache", max(left, one_sequence),
                                 f"gpu_memory_utilization {util:g}: {max(left, 0) / per_token:,.0f} tokens "
                                 f"of {per_token / 1024:.1f} KiB"))
            if one_sequence <= left < needed:
                notes.append(f"the KV cache holds {left / one_sequence:.0f} of the {in_flight} sequences in flight "
                             f"at full length; the others wait until space frees")
    role = "rollout engine" + (f" (per device of its {tp})" if tp > 1 else "") \
        + (f" (each of {replicas} data-parallel copies)" if replicas > 1 else "")
    load = DeviceLoad(role, cfg.rollout.num_engines * devices, terms, capacity, notes=notes)
    if capacity is not None:
        load.capacity_detail = f" (gpu_memory_utilization x {memory / GIB:g} GiB)"
    return load


def trainer_hold(trainer: DeviceLoad) -> float:
    """What a colocated rank keeps on its GPU between updates: its update peak less the
    activations and logits, whose cached blocks it gives back after each update
    (TrainerSpec.release_cache_after_update)."""
    return trainer.total - sum(t.bytes for t in trainer.terms if t.key in RELEASABLE)


def colocated_gpu_memory_utilization(trainer: DeviceLoad, memory: float) -> float:
    """What a colocated engine may take of a GPU whose trainer rank holds `trainer_hold` bytes
    between updates: 1 - hold / memory - COLOCATE_MARGIN, rounded down to 0.01 (0 when nothing
    is left)."""
    return max(0.0, math.floor((1.0 - trainer_hold(trainer) / memory - COLOCATE_MARGIN) * 100) / 100)


def _sync_buffers(cfg: Config, shape: ModelShape) -> Term:
    """What the weight sync adds on a colocated GPU: the engine's staging and the rank's gathered bucket."""
    b = _bytes_of(cfg.model.dtype.value)
    bucket = cfg.weight_sync.bucket_mb * 2**20
    transport = cfg.weight_sync.transport.value
    if transport == "auto":  # weight_sync/transport.py on CUDA: cuda_ipc when every engine is on rank 0's GPU
        transport = "cuda_ipc" if cfg.rollout.num_engines == 1 else "collective"
    if transport == "object_store":
        return Term("sync_buffers", "sync buffers", shape.params * b + bucket,
                    "object_store: the engine stages the whole model, + the rank's gathered bucket")
    return Term("sync_buffers", "sync buffers", 3 * bucket,
                f"{transport}: ~2 buckets staged in the engine + the rank's gathered bucket")


def colocated_load(cfg: Config, shape: ModelShape, trainer: DeviceLoad, engine: DeviceLoad,
                   memory: float | None) -> DeviceLoad:
    """A GPU shared by trainer rank i and engine i: its phases, and its peak as `terms`."""
    hold = Term("trainer_hold", "trainer rank", trainer_hold(trainer),
                "its shards, optimizer state and gradients (activations and logits given back after the update)")
    by_key = {t.key: Term(t.key, t.label if t.key == "kv_cache" else "engine " + t.label, t.bytes, t.detail)
              for t in engine.terms}
    phases = [
        ("train (engine asleep)", trainer.terms + [Term("engine_asleep", "engine asleep", ENGINE_ASLEEP_GIB * GIB,
                                                        "CUDA context, memory outside vLLM's sleep pool")]),
        ("weight sync (engine weights awake)", [hold, by_key["engine_weights"], by_key["runtime"],
                                                _sync_buffers(cfg, shape)]),
        ("rollout (engine awake)", [hold] + [by_key[t.key] for t in engine.terms]),
    ]
    peak = max(phases, key=lambda ph: sum(t.bytes for t in ph[1]))
    load = DeviceLoad(f"GPU shared by a trainer rank and an engine (colocated, peak: {peak[0].split(' (')[0]})",
                      cfg.rollout.num_engines, peak[1], memory, " (the whole GPU)", phases=phases,
                      notes=list(engine.notes))
    released = trainer.total - trainer_hold(trainer)
    load.notes.append(f"the rank empties its CUDA cache after each update: its activations and logits "
                      f"({_size(released)}) are the engine's during the weight sync and the rollout")
    load.notes.append(f"each sleeping engine keeps its weights in host memory: {_size(by_key['engine_weights'].bytes)} "
                      f"of pinned RAM per engine")
    if engine.capacity_bytes is not None and memory:
        most = colocated_gpu_memory_utilization(trainer, memory)
        load.notes.append(f"engine budget: gpu_memory_utilization {engine.capacity_bytes / memory:.2f} x "
                          f"{memory / GIB:g} GiB; the most that leaves the rank its hold is {most:.2f}")
        load.hint = (f" (colocated: rollout.engine_args.gpu_memory_utilization at most {most:.2f}, or null to "
                     f"derive it)")
    return load


def device_memory_gib(cfg: Config, device: str) -> float | None:
    """cluster.gpu_memory_gb, else what torch.cuda reports here; None when neither is known."""
    if cfg.cluster.gpu_memory_gb is not None:
        return float(cfg.cluster.gpu_memory_gb)
    if device != "cuda":
        return None
    from mmrl.utils.env import cuda_available

    if not cuda_available():
        return None
    import torch

    return torch.cuda.get_device_properties(0).total_memory / GIB


def memory_plan(cfg: Config, device: str, memory_gib: float | None = None, shape: ModelShape | None = None) -> MemoryPlan:
    """Per-device loads for `cfg` on `device` (cuda or cpu), checked against `memory_gib` per
    device on CUDA when it is known."""
    lora = cfg.trainer.lora
    shape = shape or read_model_shape(cfg.model.path, cfg.model.trust_remote_code,
                                      list(lora.target_modules) if lora.enabled else None, lora.rank)
    memory = memory_gib * GIB if memory_gib is not None and device == "cuda" else None
    trainer = trainer_load(cfg, shape, device)
    trainer.capacity_bytes = memory
    loads = [trainer]
    engines = 0
    if colocated(cfg, device):  # engine i on rank i's GPU: the shared GPUs, then any rank alone
        util = cfg.rollout.engine_args.get("gpu_memory_utilization")
        if util is None and memory is not None:
            util = colocated_gpu_memory_utilization(trainer, memory)
        engine = engine_load(cfg, shape, device, memory, util)
        trainer.count -= cfg.rollout.num_engines
        trainer.role = "trainer rank (a GPU of its own: more ranks than engines)"
        loads = [colocated_load(cfg, shape, trainer, engine, memory)] + ([trainer] if trainer.count else [])
    elif cfg.rollout.backend.value == "vllm":
        engine = engine_load(cfg, shape, device, memory)
        loads.insert(0, engine)
        engines = engine.count
    return MemoryPlan(device, memory_gib if device == "cuda" else None, shape, trainable_params(cfg, shape),
                      loads, engines + cfg.trainer.world_size)


def _b(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1024:.2f} KiB"


def format_memory_plan(plan: MemoryPlan) -> str:
    s = plan.shape
    if plan.device == "cpu":
        where = "per process (engines and ranks share the host's memory; no fit check on cpu)"
    else:
        where = ("colocated placement: engine i shares trainer rank i's GPU and sleeps while the rank trains; "
                 if any(load.phases for load in plan.loads) else
                 "split placement: engines and trainer ranks on separate devices; ") + (
            f"{plan.memory_gib:g} GiB per device" if plan.memory_gib is not None else
            "memory per device unknown: set cluster.gpu_memory_gb to check the fit")
    lines = [where,
             f"model {s.model_class}: {_b(s.params)} parameters (vision tower {_b(s.tower_params)}, projector "
             f"{_b(s.projector_params)}, text {_b(s.params - s.tower_params - s.projector_params)}); "
             f"trainable {_b(plan.trainable)}"]
    if plan.device == "cuda":
        lines.append(f"devices needed: {plan.devices_needed}")
    for load in plan.loads:
        lines.append(f"{load.role}, each of {load.count}:")
        for name, terms in load.phases:
            lines.append(f"  phase {name}: {_size(sum(t.bytes for t in terms))}")
            lines += [f"    {t.label:<16} {_size(t.bytes):>11}  {t.detail}" for t in terms]
        for t in [] if load.phases else load.terms:
            lines.append(f"  {t.label:<16} {_size(t.bytes):>11}  {t.detail}")
        verdict = ""
        if load.capacity_bytes is not None:
            fits = "fits" if load.total <= load.capacity_bytes else "DOES NOT FIT"
            verdict = f"  of {_size(load.capacity_bytes)}{load.capacity_detail}: {fits}"
        lines.append(f"  {'peak' if load.phases else 'total':<16} {_size(load.total):>11}{verdict}")
        lines += [f"  note: {n}" for n in load.notes]
    return "\n".join(lines)


def check_memory_plan(plan: MemoryPlan) -> None:
    """Raise MemoryPlanError naming the biggest term and its fix for each load that does not fit."""
    problems = []
    for load in plan.loads:
        if load.capacity_bytes is None or load.total <= load.capacity_bytes:
            continue
        big = load.biggest
        problems.append(f"each {load.role} needs {_size(load.total)} of {_size(load.capacity_bytes)}; the biggest "
                        f"term is {big.label} ({_size(big.bytes)}): try {FIXES[big.key]}{load.hint}")
    if problems:
        raise MemoryPlanError("The memory plan does not fit: " + "; ".join(problems) +
                              ". (Estimates: docs/training.md, Large models. To plan for another device size, "
                              "set cluster.gpu_memory_gb.)")


def describe_memory_plan(cfg: Config, device: str) -> tuple[str, MemoryPlan | None]:
    """The printed plan, or why there is none. A model that cannot be planned is no error for a
    dry run: offline, a hub id without a local copy has no config to read, and a remote-code
    family may not build on the meta device or name its parts as expected."""
    try:
        plan = memory_plan(cfg, device, device_memory_gib(cfg, device))
    except (OSError, ValueError, AttributeError, KeyError) as e:
        reason = str(e).splitlines()[0] if str(e) else ""
        return f"no memory plan: could not plan for the model {cfg.model.path!r} ({type(e).__name__}: {reason})", None
    return format_memory_plan(plan), plan
