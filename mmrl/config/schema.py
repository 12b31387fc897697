"""The typed run configuration: one dataclass per stage of the data flow.

YAML files and `key=value` overrides are merged onto these dataclasses by `mmrl.config.load`;
unknown keys and wrong types fail there, before anything starts. Engine-native options pass
through untouched: `rollout.engine_args` goes to `vllm.LLM(...)`, `trainer.deepspeed` is merged
into the DeepSpeed JSON config.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional


class Device(str, Enum):
    auto = "auto"   # cuda when torch sees a GPU, else cpu
    cpu = "cpu"
    cuda = "cuda"


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class LossAgg(str, Enum):
    token_mean = "token_mean"
    seq_mean_token_sum = "seq_mean_token_sum"
    seq_mean_token_mean = "seq_mean_token_mean"
    seq_mean_token_sum_norm = "seq_mean_token_sum_norm"


@dataclass
class RunConfig:
    name: str = "run"
    output_dir: str = "runs/${run.name}"
    seed: int = 0
    max_steps: int = 200
    # Stop early once wall time (seconds, from the first step) passes this; null = no limit. A
    # resumed run continues the same clock: raise the limit to resume a run it stopped.
    time_limit_s: Optional[float] = None
    # Stop early once held-out accuracy reaches this; null = never.
    stop_at_heldout_accuracy: Optional[float] = None
    # A trainer rank that dies (its process killed, OOM, a lost node): the run tears its actors
    # down and restarts from the newest complete checkpoint (what rerunning the command does; no
    # checkpoint yet: from the start), at most this many times per `mmrl train`; after that it
    # stops (exit 75) naming the rank and the command that resumes. 0 = stop at the first.
    max_restarts: int = 2


class PlacementStrategy(str, Enum):
    """How a Ray placement group lays out its bundles (Ray's names)."""
    PACK = "PACK"                    # as few nodes as possible
    SPREAD = "SPREAD"                # across nodes, as evenly as possible
    STRICT_PACK = "STRICT_PACK"      # all on one node
    STRICT_SPREAD = "STRICT_SPREAD"  # each bundle on a different node


@dataclass
class ClusterConfig:
    device: Device = Device.auto
    # Ray: null starts a local Ray instance; "auto" or "ray://host:port" joins a cluster.
    ray_address: Optional[str] = None
    # CPUs Ray may schedule on a local instance (null = all cores).
    num_cpus: Optional[int] = None
    # Per-actor resource requests. Rollout and training alternate in synchronous mode, so on a
    # small CPU box they may share cores; on GPU each actor takes one device.
    rollout_cpus_per_engine: float = 1.0
    trainer_cpus_per_rank: float = 0.5
    # Memory of one accelerator in GiB, for the memory plan `mmrl train --dry-run` prints
    # (mmrl/controller/memory_plan.py): a plan that does not fit is refused. null = ask torch.cuda
    # on this machine; with no GPU here the plan is printed without a fit check.
    gpu_memory_gb: Optional[float] = None
    # Where each role's actors run. Roles: rollout (the engines), rollout_worker, reward, trainer
    # (the names `mmrl train --dry-run` prints). role_resources: extra Ray resources each actor
    # of the role asks for, e.g. {rollout: {engine_node: 0.01}} pins the engines to nodes started
    # with `ray start --resources='{"engine_node": 1}'` (CPU and GPU have their own keys above).
    role_resources: dict[str, dict[str, float]] = field(default_factory=dict)
    # role_labels: node labels the role's actors must run on (exact values), e.g.
    # {trainer: {pool: train}} with `ray start --labels=pool=train`.
    role_labels: dict[str, dict[str, str]] = field(default_factory=dict)
    # null: each actor is scheduled on its own (Ray's default). PACK, SPREAD, STRICT_PACK or
    # STRICT_SPREAD: one placement group is reserved before any actor starts, with a bundle per
    # engine and per trainer rank and one per worker role (the reward and rollout workers are
    # started, and restarted, from one option set); actors that ask for nothing are left out.
    placement_strategy: Optional[PlacementStrategy] = None
    # false: split mode (engines and trainer ranks on separate GPUs). true: colocated (CUDA, sync
    # rollout, vLLM backend): engine i shares trainer rank i's GPU (one placement-group bundle,
    # PACK unless placement_strategy says otherwise) and sleeps (vLLM sleep mode, level 1) while
    # the ranks train. Its gpu_memory_utilization, unless rollout.engine_args sets it, leaves the
    # trainer rank its memory-plan share (mmrl/controller/colocate.py).
    colocate: bool = False


@dataclass
class ModelConfig:
    # A local HF folder or a hub id; the same code path for the tiny demo model and real ones.
    path: str = "work/tiny-vlm"
    dtype: DType = DType.float32
    trust_remote_code: bool = False


@dataclass
class DecodeConfig:
    """Media decoding in the loader workers (mmrl.data.decode.DecodeOptions)."""

    pixel_limit: int = 64_000_000  # decompression-bomb guard, per image or frame
    fps: float = 2.0  # video frames sampled per second (ignored when num_frames is set)
    num_frames: Optional[int] = None
    min_frames: int = 4
    max_frames: int = 32
    max_pixels: Optional[int] = 602_112  # downscale frames while decoding (Qwen-VL's per-frame budget)
    decoders: list[str] = field(default_factory=lambda: ["decord", "torchcodec", "pyav"])
    timeout_s: float = 30.0  # per video and decoder: decord can hang on some files


@dataclass
class DataConfig:
    train_shards: str = "work/data/colors/train-{000000..000003}.tar"
    heldout_shards: Optional[str] = "work/data/colors/heldout-000000.tar"
    shuffle_buffer: int = 256
    num_workers: int = 1
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    # Bad samples are skipped, counted by reason and listed in RUN_DIR/quarantine.jsonl; the run
    # stops when their share passes max_bad_ratio (checked after min_samples_for_ratio samples).
    max_bad_ratio: Optional[float] = 0.05
    min_samples_for_ratio: int = 1000


@dataclass
class ProcessorConfig:
    # A registered processor name, "auto" (pick by the model's config.model_type), or module:attr.
    name: str = "auto"
    # Pixel budget per image, passed to the HF image processor; null = the model folder's default.
    min_pixels: Optional[int] = None
    max_pixels: Optional[int] = None
    max_prompt_tokens: int = 1024


class PartialRollout(str, Enum):
    # at a weight update, in-flight requests are frozen and continue under the new weights
    keep = "keep"
    # ... or aborted and resubmitted with the tokens they have as a prefix
    abort = "abort"
    # ... or the update waits until they finish (no new request starts meanwhile): every
    # trajectory is sampled by one weight version; the update waits for the longest one
    wait = "wait"


class RolloutBackend(str, Enum):
    # vLLM engines (rollout.num_engines AsyncLLM actors); weights are pushed after each update
    vllm = "vllm"
    # the trainer's own model and numerics samples (rollout/trainer_engine.py): no inference
    # engine, no weight sync, no rollout/trainer mismatch by construction; slow; sync mode only
    trainer = "trainer"


class RolloutMode(str, Enum):
    # rollout, then update, then weight sync, strictly in turn
    sync = "sync"
    # generation goes on while the trainer trains (controller/async_rollout.py)
    async_ = "async"


@dataclass
class RolloutConfig:
    # Per-trajectory agent loop (rollout/agent_loops.py): a registered name, module:attr or file.py:attr.
    agent_loop: str = "single_turn"
    # Passed to the agent loop as ctx.args.
    agent_loop_args: dict[str, Any] = field(default_factory=dict)
    # What samples: vLLM engines or the trainer itself (see RolloutBackend).
    backend: RolloutBackend = RolloutBackend.vllm
    num_engines: int = 1
    mode: RolloutMode = RolloutMode.sync
    # async: a group whose oldest token is more than this many weight versions behind the
    # trainer is dropped (async/dropped_stale_groups).
    max_staleness: int = 1
    # async: groups drawn but not yet trained on (in flight, being scored, buffered); null =
    # prompts_per_step * (max_staleness + 1).
    max_buffered_groups: Optional[int] = None
    # Rollout-worker actors (asyncio) that run the processor and the agent loops.
    num_workers: int = 1
    # Back-pressure: requests one router keeps in flight on one engine (more wait their turn).
    max_requests_per_engine: int = 256
    # A rollout engine or rollout worker that dies (killed, OOM, a crash in vLLM) is replaced and
    # its unfinished work redone, at most this many times per kind and `mmrl train`; one more
    # death stops the run, naming the actor and how to resume. 0 = stop at the first.
    max_actor_restarts: int = 3
    # What a weight update does to requests in flight (see PartialRollout).
    partial: PartialRollout = PartialRollout.keep
    # true: a weight update drops the KV cache, frozen requests recompute their prefix under the
    # new weights (their later tokens are exactly the new policy's); false: keep the old KV
    # (faster; the mismatch it causes shows in mismatch/* and the correction covers it).
    recompute_kv: bool = True
    prompts_per_step: int = 32
    group_size: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    # Vision special tokens (<|image_pad|> ...) sampled in a response break the training forward;
    # forbid them at sampling time and mask them identically in the trainer.
    forbid_vision_tokens: bool = True
    # Seed every step's sampling from (run.seed, step): rollouts are then reproducible, and a
    # resumed run samples what the uninterrupted one would have. false = the engine's own RNG.
    seed_per_step: bool = True
    # Passed verbatim to vLLM's engine arguments (e.g. enforce_eager, max_model_len, gpu_memory_utilization).
    engine_args: dict[str, Any] = field(default_factory=dict)
    # Extra environment for the engine process (e.g. VLLM_CPU_KVCACHE_SPACE).
    engine_env: dict[str, str] = field(default_factory=dict)


@dataclass
class RewardEntry:
    # A registered reward name, "module:function" or "path/to/file.py:function".
    name: str = "answer_match"
    weight: float = 1.0
    args: dict[str, Any] = field(default_factory=dict)
    # The metric prefix (reward/<alias>/...); needed when one reward is listed twice, e.g. with
    # different args. None = the reward's own name.
    alias: Optional[str] = None


class OnRewardError(str, Enum):
    zero = "zero"  # the failing reward scores 0 for that response; the other rewards still count
    drop_group = "drop_group"  # the prompt's whole group is left out of this step's update
    stop = "stop"  # raise: the run stops with the reward, sample key and traceback


@dataclass
class RewardExecutionConfig:
    """Rewards run in Ray worker processes; each call has a timeout and failures are isolated."""

    num_workers: int = 1
    timeout_s: float = 30.0
    on_error: OnRewardError = OnRewardError.zero
    # Ray resources per reward worker. Model rewards on a GPU (clip_score with device=cuda,
    # vlm_judge's vLLM engine) need num_gpus > 0; a fraction lets workers share one GPU.
    num_cpus: float = 0.0
    num_gpus: float = 0.0


class KLPlacement(str, Enum):
    loss = "loss"      # coef * KL(pi || ref) added to the loss, aggregated like the policy loss (GRPO)
    reward = "reward"  # coef * sum_t KL subtracted from each response's reward (PPO/InstructGPT)


@dataclass
class KLConfig:
    """KL to a frozen reference policy (the starting weights). coef 0 = off: no reference is loaded."""

    coef: float = 0.0
    # k1 | k2 | k3 (low-variance, >= 0); a "+" suffix (k1+, k3+) keeps the value, uses k2's gradient.
    estimator: str = "k3"
    placement: KLPlacement = KLPlacement.loss


class CorrectionMode(str, Enum):
    none = "none"
    tis = "tis"  # truncated importance sampling: weight min(pi_old / mu, threshold), detached
    mis = "mis"  # masked importance sampling: drop tokens/sequences whose ratio leaves [threshold_low, threshold]
    rs = "rs"  # rejection only: the same mask as mis, kept tokens weighted 1


class CorrectionLevel(str, Enum):
    token = "token"
    sequence = "sequence"      # product of the token ratios
    geometric = "geometric"    # geometric mean of the token ratios (length-invariant)


@dataclass
class RolloutCorrectionConfig:
    """Rollout-training mismatch correction between the sampler (vLLM, mu) and the trainer's
    recompute with the same weights (pi_old): TIS (Yao, Liu et al., "Your efficient RL framework
    secretly brings you off-policy RL training", 2025), MIS (Liu, Li et al., "When speed kills
    stability", 2025). Modes and metrics: docs/training.md, Algorithms."""

    mode: CorrectionMode = CorrectionMode.none
    level: CorrectionLevel = CorrectionLevel.token
    threshold: float = 2.0
    threshold_low: Optional[float] = None


@dataclass
class DynamicSamplingConfig:
    """DAPO dynamic sampling: groups whose rewards are all equal carry no signal; drop them and
    roll out more prompts until the step has rollout.prompts_per_step informative groups."""

    enabled: bool = False
    max_rounds: int = 4  # rollout rounds per step at most; then train on what was kept


class ScheduleKind(str, Enum):
    constant = "constant"
    linear = "linear"  # the start value until start_step, then a straight line to the end value over `steps`
    cosine = "cosine"  # the same along a half cosine


@dataclass
class EntropyScheduleConfig:
    """How the entropy bonus fades once learning is done (mmrl/algorithms/entropy.py says why)."""

    kind: ScheduleKind = ScheduleKind.constant
    start_step: int = 0
    steps: int = 0
    end_coef: float = 0.0


class RoutingReplay(str, Enum):
    # MoE models (trainer/routing_replay.py): the engine records the experts it routed every
    # sampled token to; "rollout" (R3) makes the trainer's forwards use them, gate weights from
    # the trainer's own router; "off" routes on the trainer and only measures the agreement.
    off = "off"
    rollout = "rollout"


class OldLogprobs(str, Enum):
    # recompute pi_old on the trainer when it differs from the policy the update starts from:
    # several updates per batch. In an async run pi_old is the proximal policy of the decoupled
    # objective (PPO clips pi/pi_prox, the rollout correction weighs pi_prox/mu); with one update
    # per batch pi_prox IS the current policy, taken from the update's own forward (no pass).
    auto = "auto"
    recompute = "recompute"  # always (one extra no-grad pass per step)
    # never: the engines' behaviour logprobs mu are pi_old (the ratio is pi/mu, clipped; the
    # rollout correction then has nothing to weigh). Saves the pass; coupled PPO on stale data.
    behaviour = "behaviour"


@dataclass
class AlgorithmConfig:
    advantage: str = "grpo"
    advantage_args: dict[str, Any] = field(default_factory=dict)
    policy_loss: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    # Extra keyword arguments for the policy loss (e.g. dual_clip_c: 3.0).
    policy_loss_args: dict[str, Any] = field(default_factory=dict)
    loss_agg: LossAgg = LossAgg.token_mean
    # Entropy bonus: a tiny random policy collapses onto one answer without it (docs/training.md).
    entropy_coef: float = 0.0
    entropy_schedule: EntropyScheduleConfig = field(default_factory=EntropyScheduleConfig)
    # Optimizer updates per rollout batch = ppo_epochs x mini_batches. Above 1, pi_old is
    # recomputed once before the first update (the "logprob" span).
    ppo_epochs: int = 1
    mini_batches: int = 1
    # What the PPO ratio divides by (see OldLogprobs).
    old_logprobs: OldLogprobs = OldLogprobs.auto
    kl: KLConfig = field(default_factory=KLConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    routing_replay: RoutingReplay = RoutingReplay.off


@dataclass
class LoraConfig:
    """LoRA adapters through peft; the rollout engines always receive merged weights."""

    enabled: bool = False
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class LRScheduleConfig:
    """trainer.lr x a factor: linear warm-up over `warmup_steps`, then (linear/cosine) from 1 to
    `end_factor` over `steps` steps after `start_step`. The guard's lr_scale multiplies on top."""

    kind: ScheduleKind = ScheduleKind.constant
    warmup_steps: int = 0
    start_step: int = 0
    steps: int = 0
    end_factor: float = 1.0


@dataclass
class TrainerConfig:
    world_size: int = 2
    lr: float = 1e-6
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    # Sequences per forward/backward on one rank (an upper bound when the token budget is set).
    micro_batch_size: int = 64
    # Token budget per micro-batch: rows x padded length (prompt tokens, vision tokens included,
    # plus response tokens), or the tokens themselves with padding_free. null = split by
    # micro_batch_size only.
    max_tokens_per_micro_batch: Optional[int] = None
    # Lay a micro-batch's sequences end to end in one row, without padding, each with its own
    # positions (mmrl/trainer/batch.py::collate_packed). Same logprobs and gradients as the padded
    # rows (tests/test_padding_free.py). It removes the padding but, with PyTorch SDPA attention
    # (CPU), attends over the whole row under a block mask: on ~2,000-token micro-batches with 25%
    # padding it was slower than the padded rows here (benchmarks/trainer_bound.py), so it is off
    # by default; it pays where padding dominates and rows stay short.
    padding_free: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Large models (mmrl/trainer/model_setup.py, docs/training.md "Large models"). The vision
    # encoder gets requires_grad=False before DeepSpeed wraps the model: no gradients, no optimizer
    # state, unchanged weights (still sent to the engines by the weight sync). The projector that
    # maps its features into the text model (Qwen's merger, LLaVA/InternVL's multi_modal_projector)
    # keeps training unless freeze_projector is set too.
    freeze_vision_tower: bool = False
    freeze_projector: bool = False
    # Recompute each decoder layer's activations in the backward instead of keeping them
    # (transformers' gradient checkpointing, use_reentrant=False): the same gradients for about one
    # more forward of compute; the vision tower too when it is trained.
    gradient_checkpointing: bool = False
    # Merged over mmrl's ZeRO-3 defaults (mmrl.trainer.deepspeed_config).
    deepspeed: dict[str, Any] = field(default_factory=dict)


@dataclass
class CheckpointConfig:
    """Exact checkpoints in RUN_DIR/checkpoints/step_N: DeepSpeed model + optimizer state, the data
    cursor, RNG states, weight version and step. Rerunning the same command resumes from the latest."""

    every_steps: int = 0  # 0 = no periodic checkpoints (the stability guard needs them)
    keep_last: int = 2
    resume: bool = True


@dataclass
class StabilityConfig:
    """Collapse guard: watches per-step metrics; when a rule holds for `patience` steps it rolls
    back to the last checkpoint saved before the trouble began and applies the remedy.
    A threshold of null switches its rule off."""

    enabled: bool = False
    warmup_steps: int = 10  # no verdicts before this step
    window: int = 5  # steps averaged for the reward rule
    patience: int = 2
    reward_drop: Optional[float] = 0.3  # window-mean reward this far below its best window mean
    # eval/heldout_accuracy this far below its best; the alarm stands until the next evaluation
    heldout_drop: Optional[float] = None
    min_entropy: Optional[float] = None
    max_entropy: Optional[float] = None
    max_kl: Optional[float] = None
    max_clip_fraction: Optional[float] = None
    max_grad_norm: Optional[float] = None
    max_mismatch: Optional[float] = None  # mismatch/mean_abs_logprob_diff
    # remedy after a rollback
    lr_scale: float = 0.5  # multiply the learning rate
    skip_batches: bool = True  # continue with fresh data instead of replaying the batches since the checkpoint
    max_rollbacks: int = 3  # then stop the run with the report


class WeightTransport(str, Enum):
    # object_store on CPU; on CUDA collective, or cuda_ipc when every engine shares trainer rank
    # 0's GPU (mmrl/weight_sync/transport.py says why)
    auto = "auto"
    # each bucket serialised (safetensors) into Ray's object store; an engine stages every bucket,
    # then loads them all at once: it holds a second full copy of the weights while it stages
    object_store = "object_store"
    # a process group between trainer rank 0 and the engines' vLLM workers (gloo on CPU, NCCL on
    # CUDA between distinct GPUs): rank 0 broadcasts each bucket, every engine loads it at once
    collective = "collective"
    # CUDA only, engines on trainer rank 0's GPU: each bucket shared as a CUDA IPC handle
    cuda_ipc = "cuda_ipc"


@dataclass
class WeightSyncConfig:
    # Parameters are gathered from ZeRO-3 shards and sent in buckets of about this size.
    bucket_mb: float = 64.0
    # How the buckets reach the engines (see WeightTransport; docs/training.md "Weight sync").
    transport: WeightTransport = WeightTransport.auto
    # collective: how long a member waits for the others (joining the group, each broadcast).
    timeout_s: float = 600.0


@dataclass
class EvalConfig:
    every_steps: int = 5
    # Held-out prompts per evaluation (null = all of heldout_shards).
    num_prompts: Optional[int] = None
    # The reward whose "score" >= threshold counts as correct (greedy decoding).
    threshold: float = 1.0


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    progress_bar: bool = True
    # Print a metrics line to the console every k steps (0 = only the progress bar).
    console_every: int = 10
    # Write the first `rollouts_per_step` groups of every k-th step (steps 1, 1+k, ...) to
    # RUN_DIR/rollouts/ (controller/rollout_log.py; `mmrl report` renders rollouts.html). 0 = off.
    rollouts_every: int = 10
    rollouts_per_step: int = 4


class ServeSampler(str, Enum):
    vllm = "vllm"
    trainer = "trainer"


class ServeTrainer(str, Enum):
    local = "local"
    deepspeed = "deepspeed"


@dataclass
class ServeConfig:
    """`mmrl serve CONFIG`: a Tinker-API server (docs/service.md). The model is `model.path`; API
    keys come from MMRL_API_KEYS and/or `api_keys_file`."""

    host: str = "127.0.0.1"
    port: int = 8000
    # The name clients pass as base_model (get_server_capabilities lists it); null = model.path.
    model_name: Optional[str] = None
    # Checkpoints and, by default, the SQLite database live here.
    store_dir: str = "runs/serve"
    # Any SQLAlchemy URL (e.g. postgresql://...); null = sqlite:///<store_dir>/serve.db
    db_url: Optional[str] = None
    api_keys_file: Optional[str] = None
    # vllm: mmrl's rollout engine with each checkpoint merged in place; trainer: transformers
    # sampling in the server process (no vLLM; for tests and debugging).
    sampler: ServeSampler = ServeSampler.vllm
    # With sampler=vllm: each sampling checkpoint is a vLLM LoRA adapter in the one engine instead of
    # merged into its weights, so different clients' checkpoints sample concurrently with no weight
    # switch (add_lora ~2.5 ms at save vs ~15-21 ms per merge switch). The cost: on CPU an adapter
    # halves the tiny model's sampling speed (benchmarks/results/vllm_lora_probe.json). Ranks up to
    # max_lora_rank. A checkpoint with an lm_head adapter (the SDK's default train_unembed) is merged
    # in place instead and samples alone: vLLM 0.32 cannot serve lm_head adapters (docs/service.md).
    vllm_lora: bool = False
    # Where each training client's LoRA trains. local: a peft model in the server process.
    # deepspeed: trainer.world_size DeepSpeed ZeRO-3 ranks per client (Ray actors, set up like `mmrl
    # train`'s; trainer.deepspeed and cluster.device apply), for models that do not fit one process.
    trainer: ServeTrainer = ServeTrainer.local
    max_lora_rank: int = 64
    # LoRA alpha; null = the rank each client asks for (scaling 1).
    lora_alpha: Optional[float] = None
    # Adapters on the vision projector's linear layers too (the Tinker API has no such field: the
    # server's choice, for every client).
    lora_projector: bool = False
    # Adapters on the vision tower's linear layers too (server-wide, like lora_projector); false =
    # the tower stays frozen. Its base weights never train either way.
    lora_vision: bool = False
    # Live training models per API key (more is a 429 naming this key); null = unlimited.
    quota_max_models: Optional[int] = None
    # Tokens each API key may sample in any 60 s (num_samples x max_tokens at admission); null = unlimited.
    quota_sampled_tokens_per_minute: Optional[int] = None


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    processor: ProcessorConfig = field(default_factory=ProcessorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rewards: list[RewardEntry] = field(default_factory=lambda: [RewardEntry()])
    reward_execution: RewardExecutionConfig = field(default_factory=RewardExecutionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
