"""Load a run config: YAML file + dotted `key=value` overrides -> a validated `Config`.

Everything that can be checked without starting processes is checked here, so that a typo in a
key, a wrong type, a bad enum value, a missing file or a reward that does not import stops the
run in the first second with a message that names the key path and the fix.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import typing
from enum import Enum
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from mmrl.config.schema import Config, RewardEntry


class ConfigError(ValueError):
    """The configuration is wrong; the message names the key path and how to fix it."""


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unwrap(tp: Any) -> Any:
    """Optional[X] -> X; list[X] -> X (for walking into list items)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _unwrap(args[0]) if len(args) == 1 else tp
    if origin is list:
        return _unwrap(typing.get_args(tp)[0])
    return tp


def _schema_at(path: Sequence[str]) -> Any:
    """The dataclass (or type) that the dotted path points into."""
    tp: Any = Config
    for part in path:
        if not dataclasses.is_dataclass(tp):
            return None
        if re.fullmatch(r"\d+", part):
            continue
        tp = _unwrap(_field_types(tp).get(part))
    return tp


def _describe_allowed(tp: Any) -> str:
    if dataclasses.is_dataclass(tp):
        return "allowed keys: " + ", ".join(f.name for f in dataclasses.fields(tp))
    if isinstance(tp, type) and issubclass(tp, Enum):
        return "allowed values: " + ", ".join(m.value for m in tp)
    return f"expected type: {getattr(tp, '__name__', tp)}"


def _explain(exc: OmegaConfBaseException, where: str, prefix: str = "") -> ConfigError:
    key = prefix + (getattr(exc, "full_key", None) or "?")
    parts = [p for p in re.split(r"[.\[\]]+", key) if p]
    msg = str(exc).split("\n")[0]
    if isinstance(exc, ConfigKeyError):
        parent = _schema_at(parts[:-1])
        allowed = [f.name for f in dataclasses.fields(parent)] if dataclasses.is_dataclass(parent) else []
        close = difflib.get_close_matches(parts[-1], allowed, n=1)
        parent_key = key[:len(key) - len(parts[-1])].rstrip(".")
        hint = f" Did you mean '{key[:len(key) - len(parts[-1])]}{close[0]}'?" if close else ""
        return ConfigError(
            f"Unknown config key '{key}' ({where}).{hint} Under '{parent_key or '<top level>'}' the "
            f"{_describe_allowed(parent)}. Engine-native options go under rollout.engine_args (vLLM) or "
            f"trainer.deepspeed (DeepSpeed JSON).")
    if isinstance(exc, ValidationError):
        return ConfigError(f"Bad value for config key '{key}' ({where}): {msg}. "
                           f"{_describe_allowed(_schema_at(parts)).capitalize()}.")
    return ConfigError(f"Config error at '{key}' ({where}): {msg}")


def _merge_rewards(base: DictConfig, layer: DictConfig, where: str) -> None:
    """Rewards are a list of entries; validate each against RewardEntry so errors carry an index."""
    if "rewards" not in layer:
        return
    raw = layer.pop("rewards")
    if not isinstance(raw, ListConfig):
        raise ConfigError(f"Config key 'rewards' ({where}) must be a list of entries like "
                          f"[{{name: answer_match, weight: 1.0}}], got {OmegaConf.to_yaml(raw).strip()!r}.")
    entries = []
    for i, item in enumerate(raw):
        if isinstance(item, str):  # shorthand: rewards: [answer_match]
            item = OmegaConf.create({"name": item})
        try:
            entries.append(OmegaConf.merge(OmegaConf.structured(RewardEntry), item))
        except OmegaConfBaseException as e:
            raise _explain(e, where, prefix=f"rewards[{i}].") from None
    base.rewards = entries


# YAML 1.1 (which OmegaConf reads) turns a bare off/on/yes/no/true/false into a bool, so
# `algorithm.routing_replay=off` would reach the schema as False. For an enum key, a bool means
# the member spelled that way.
_BOOL_SPELLINGS = {False: ("off", "no", "false"), True: ("on", "yes", "true")}


def _bools_to_enum_members(node: Any, tp: Any) -> None:
    """In a loaded layer, replace a bool given for an enum key by the enum member it spells."""
    if not dataclasses.is_dataclass(tp) or not isinstance(node, DictConfig):
        return
    fields = _field_types(tp)
    for key in list(node.keys()):
        field = _unwrap(fields.get(str(key)))
        if field is None or OmegaConf.is_interpolation(node, str(key)):
            continue
        value = node[key]
        if isinstance(field, type) and issubclass(field, Enum) and isinstance(value, bool):
            names = {m.value for m in field}
            spelled = next((s for s in _BOOL_SPELLINGS[value] if s in names), None)
            if spelled is not None:
                node[key] = spelled
        elif dataclasses.is_dataclass(field):
            _bools_to_enum_members(value, field)


def load_config(path: str | None, overrides: Sequence[str] = (), *, check_files: bool = True,
                check_plugins: bool = True, check_data: bool = True) -> Config:
    """Merge schema defaults <- YAML file <- overrides; validate; return a typed Config.
    check_data=False: the model folder is checked but not the shards (a command that reads none,
    such as `mmrl serve`)."""
    merged = OmegaConf.structured(Config)
    layers: list[tuple[DictConfig, str]] = []
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"Config file '{path}' does not exist. Pass a YAML file, e.g. "
                              f"`mmrl train configs/colors_demo.yaml`.")
        loaded = OmegaConf.load(path)
        if not isinstance(loaded, DictConfig):
            raise ConfigError(f"Config file '{path}' must hold a mapping at the top level.")
        layers.append((loaded, f"in {path}"))
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"Override {bad[0]!r} is not of the form key=value (e.g. rollout.group_size=8).")
    if overrides:
        try:
            layers.append((OmegaConf.from_dotlist(list(overrides)), "from the command line"))
        except OmegaConfBaseException as e:
            raise ConfigError(f"Could not parse overrides {list(overrides)}: {e}") from None
    for layer, where in layers:
        _bools_to_enum_members(layer, Config)
        _merge_rewards(merged, layer, where)
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            raise _explain(e, where) from None
    try:
        OmegaConf.resolve(merged)
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise _explain(e, "while resolving interpolations") from None
    validate(cfg, check_files=check_files, check_plugins=check_plugins, check_data=check_data)
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _check_positive(cfg: Config) -> None:
    checks = {
        "rollout.prompts_per_step": cfg.rollout.prompts_per_step >= 1,
        "rollout.group_size": cfg.rollout.group_size >= 2,
        "rollout.max_new_tokens": cfg.rollout.max_new_tokens >= 1,
        "rollout.num_engines": cfg.rollout.num_engines >= 1,
        "rollout.num_workers": cfg.rollout.num_workers >= 1,
        "rollout.max_requests_per_engine": cfg.rollout.max_requests_per_engine >= 1,
        "rollout.temperature": cfg.rollout.temperature > 0,
        "trainer.world_size": cfg.trainer.world_size >= 1,
        "trainer.micro_batch_size": cfg.trainer.micro_batch_size >= 1,
        "trainer.lr": cfg.trainer.lr > 0,
        "eval.every_steps": cfg.eval.every_steps >= 0,
        "weight_sync.bucket_mb": cfg.weight_sync.bucket_mb > 0,
        "weight_sync.timeout_s": cfg.weight_sync.timeout_s > 0,
        "algorithm.ppo_epochs": cfg.algorithm.ppo_epochs >= 1,
        "algorithm.mini_batches": cfg.algorithm.mini_batches >= 1,
        "algorithm.dynamic_sampling.max_rounds": cfg.algorithm.dynamic_sampling.max_rounds >= 1,
        "algorithm.rollout_correction.threshold": cfg.algorithm.rollout_correction.threshold > 0,
        "trainer.max_tokens_per_micro_batch": (cfg.trainer.max_tokens_per_micro_batch or 1) >= 1,
        "trainer.lora.rank": cfg.trainer.lora.rank >= 1,
        "checkpoint.every_steps": cfg.checkpoint.every_steps >= 0,
        "run.max_restarts": cfg.run.max_restarts >= 0,
        "rollout.max_actor_restarts": cfg.rollout.max_actor_restarts >= 0,
        "algorithm.entropy_schedule.steps": cfg.algorithm.entropy_schedule.steps >= 0,
        "algorithm.entropy_schedule.start_step": cfg.algorithm.entropy_schedule.start_step >= 0,
        "trainer.lr_schedule.steps": cfg.trainer.lr_schedule.steps >= 0,
        "trainer.lr_schedule.warmup_steps": cfg.trainer.lr_schedule.warmup_steps >= 0,
        "trainer.lr_schedule.end_factor": cfg.trainer.lr_schedule.end_factor >= 0,
        "stability.window": cfg.stability.window >= 1,
        "stability.patience": cfg.stability.patience >= 1,
        "stability.lr_scale": cfg.stability.lr_scale > 0,
        "serve.quota_max_models": cfg.serve.quota_max_models is None or cfg.serve.quota_max_models >= 1,
        "serve.quota_sampled_tokens_per_minute": (cfg.serve.quota_sampled_tokens_per_minute is None
                                                  or cfg.serve.quota_sampled_tokens_per_minute >= 1),
    }
    for key, ok in checks.items():
        if not ok:
            value: Any = cfg
            for part in key.split("."):
                value = getattr(value, part)
            raise ConfigError(f"Bad value for config key '{key}': {value!r}. "
                              f"It must be positive (group_size at least 2: advantages compare a group).")
    from mmrl.algorithms.kl import KL_KINDS

    if cfg.algorithm.kl.estimator not in KL_KINDS:
        raise ConfigError(f"Bad value for config key 'algorithm.kl.estimator': {cfg.algorithm.kl.estimator!r}. "
                          f"Allowed: k1, k2, k3 (verl names: kl, mse, low_var_kl; and abs), each optionally with "
                          f"'+' (e.g. k3+: k3's value, k2's gradient).")
    low = cfg.algorithm.rollout_correction.threshold_low
    if low is not None and not 0 <= low < cfg.algorithm.rollout_correction.threshold:
        raise ConfigError(f"Bad value for config key 'algorithm.rollout_correction.threshold_low': {low!r}. It must "
                          f"be >= 0 and below rollout_correction.threshold ({cfg.algorithm.rollout_correction.threshold}).")
    if cfg.stability.enabled and not cfg.checkpoint.every_steps:
        raise ConfigError("Config key 'stability.enabled' is true but 'checkpoint.every_steps' is 0: the guard rolls "
                          "back to a checkpoint. Set checkpoint.every_steps (e.g. 25) or stability.enabled=false.")
    if cfg.serve.vllm_lora and cfg.serve.sampler.value != "vllm":
        raise ConfigError("Config key 'serve.vllm_lora' is true with serve.sampler=trainer: LoRA adapters are "
                          "vLLM's. Set serve.sampler=vllm, or serve.vllm_lora=false.")
    if cfg.rollout.backend.value == "trainer" and cfg.rollout.mode.value != "sync":
        raise ConfigError("Config key 'rollout.backend' is 'trainer' with rollout.mode=async: the trainer cannot "
                          "sample while it trains. Use rollout.mode=sync with the trainer backend, or "
                          "rollout.backend=vllm for async rollout.")
    if cfg.rollout.max_staleness < 0:
        raise ConfigError(f"Bad value for config key 'rollout.max_staleness': {cfg.rollout.max_staleness}. It counts "
                          f"weight versions: 0 (on-policy) or more.")
    buffered = cfg.rollout.max_buffered_groups
    if buffered is not None and buffered < cfg.rollout.prompts_per_step:
        raise ConfigError(f"Bad value for config key 'rollout.max_buffered_groups': {buffered}. A step takes "
                          f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} groups from the buffer: give at "
                          f"least that many, or null for prompts_per_step * (max_staleness + 1).")
    if len(cfg.trainer.betas) != 2:
        raise ConfigError(f"Bad value for config key 'trainer.betas': {cfg.trainer.betas}; give two numbers, "
                          f"e.g. [0.9, 0.999].")


def _looks_local(path: str) -> bool:
    """A missing path that is clearly meant as a local folder (not a hub id 'org/name')."""
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        return True
    return os.path.isdir(path.split("/")[0])  # 'work/tiny-vlm' when ./work exists


def check_named_files(cfg: Config, data: bool = True) -> None:
    """The model folder and (data=True) the shards the config names exist (a hub id passes unless
    offline)."""
    from mmrl.data.stream import ShardNotFoundError, expand_urls

    model = cfg.model.path
    if not os.path.isdir(model) and (_looks_local(model) or os.environ.get("HF_HUB_OFFLINE") == "1"):
        raise ConfigError(
            f"Config key 'model.path': model folder '{model}' does not exist. Build the tiny demo model "
            f"with `mmrl tiny-model --arch qwen2_5_vl --out {model}`, or point model.path at a Hugging "
            f"Face model folder or hub id.")
    for key in ("train_shards", "heldout_shards") if data else ():
        spec = getattr(cfg.data, key)
        if spec is None:
            continue
        try:
            expand_urls(spec)
        except ShardNotFoundError as e:
            raise ConfigError(f"Config key 'data.{key}': {e}") from None


def _check_plugins(cfg: Config) -> None:
    from mmrl import registry

    wanted = [("advantage", "algorithm.advantage", cfg.algorithm.advantage),
              ("policy_loss", "algorithm.policy_loss", cfg.algorithm.policy_loss),
              ("agent_loop", "rollout.agent_loop", cfg.rollout.agent_loop)]
    if cfg.processor.name != "auto":
        wanted.append(("processor", "processor.name", cfg.processor.name))
    wanted += [("reward", f"rewards[{i}].name", r.name) for i, r in enumerate(cfg.rewards)]
    for kind, key, spec in wanted:
        try:
            registry.resolve(kind, spec)
        except registry.PluginError as e:
            raise ConfigError(f"Config key '{key}': {e}") from None


def _check_reward_labels(cfg: Config) -> None:
    from mmrl.rewards.base import reward_label

    seen: dict[str, int] = {}
    for i, r in enumerate(cfg.rewards):
        label = r.alias or reward_label(r.name)
        if label in seen:
            raise ConfigError(f"Config key 'rewards[{i}]': reward '{label}' is listed twice (also rewards[{seen[label]}]); "
                              f"give one an alias so their metrics stay apart, e.g. {{name: {r.name}, alias: {label}_2}}.")
        seen[label] = i


def _check_placement(cfg: Config) -> None:
    """cluster.role_resources / role_labels name known roles, custom resources and plain labels."""
    from mmrl.controller.placement import PLACED_ROLES

    cl = cfg.cluster
    for key, per_role in (("role_resources", cl.role_resources), ("role_labels", cl.role_labels)):
        for role, wanted in per_role.items():
            if role not in PLACED_ROLES:
                close = difflib.get_close_matches(role, PLACED_ROLES, n=1)
                raise ConfigError(f"Config key 'cluster.{key}.{role}': unknown role '{role}'."
                                  + (f" Did you mean '{close[0]}'?" if close else "")
                                  + f" Roles: {', '.join(PLACED_ROLES)} (rollout = the engines; the driver runs "
                                    f"where `mmrl train` runs).")
            for name, value in wanted.items():
                where = f"cluster.{key}.{role}.{name}"
                if key == "role_resources" and name in ("CPU", "GPU", "memory", "object_store_memory"):
                    raise ConfigError(f"Config key '{where}': {name} is not a custom resource. CPUs have their own "
                                      f"keys (cluster.rollout_cpus_per_engine, cluster.trainer_cpus_per_rank, "
                                      f"reward_execution.num_cpus); GPUs follow cluster.device.")
                if key == "role_resources" and value <= 0:
                    raise ConfigError(f"Bad value for config key '{where}': {value!r}. It must be positive "
                                      f"(e.g. 0.01: a share of a node's {name} marks it without filling it).")
                if key == "role_labels" and (not value or value.startswith("!") or value.startswith("in(")):
                    raise ConfigError(f"Bad value for config key '{where}': {value!r}. Give the label's exact "
                                      f"value, e.g. {name}: train (matched as is).")
    if (cl.role_resources or cl.role_labels) and not cl.ray_address:
        raise ConfigError("Config keys 'cluster.role_resources' / 'cluster.role_labels' place actors on nodes that "
                          "offer those resources or labels, which the local Ray instance mmrl starts does not: set "
                          "cluster.ray_address to a cluster started with `ray start --resources=... --labels=...`.")


def _check_weight_sync(cfg: Config) -> None:
    """A transport the run's device cannot carry (cuda_ipc without CUDA) fails here, not at the
    first sync."""
    from mmrl.utils.env import resolve_device
    from mmrl.weight_sync.transport import config_problem

    problem = config_problem(cfg.weight_sync.transport.value, resolve_device(cfg.cluster.device.value))
    if problem:
        raise ConfigError(f"Config key 'weight_sync.transport': {problem}")


def _check_colocate(cfg: Config) -> None:
    """cluster.colocate needs what vLLM's sleep mode needs (CUDA) and a step in which the engines
    are idle while the ranks train (sync rollout on vLLM engines), one engine per trainer GPU."""
    from mmrl.utils.env import resolve_device

    if not cfg.cluster.colocate:
        return
    ro = cfg.rollout
    # vLLM 0.32: ModelConfig refuses enable_sleep_mode unless Platform.is_sleep_mode_available()
    # (vllm/config/model.py; vllm/platforms/interface.py: CUDA, ROCm and XPU only), and the CPU
    # worker's sleep()/wake_up() only log "sleep mode is not supported on CPU" (v1/worker/cpu_worker.py).
    if resolve_device(cfg.cluster.device.value) != "cuda":
        raise ConfigError(f"Config key 'cluster.colocate' is true but this run's device is "
                          f"{resolve_device(cfg.cluster.device.value)} (cluster.device={cfg.cluster.device.value}): "
                          f"colocation rests on vLLM's sleep mode, which needs CUDA. Set cluster.colocate=false "
                          f"on CPU, or cluster.device=cuda on a GPU machine.")
    if ro.backend.value == "trainer":
        raise ConfigError("Config key 'cluster.colocate' is true with rollout.backend=trainer: the trainer ranks "
                          "already sample on their own GPUs, there is no engine to colocate. Set "
                          "cluster.colocate=false, or rollout.backend=vllm.")
    if ro.mode.value != "sync":
        raise ConfigError("Config key 'cluster.colocate' is true with rollout.mode=async: async generation runs "
                          "beside training, so the engines cannot sleep while the ranks train. Use "
                          "rollout.mode=sync with colocation, or cluster.colocate=false for async rollout.")
    args = ro.engine_args
    from mmrl.controller.placement import engine_devices

    _, gpus = engine_devices(args)
    if gpus != 1:
        raise ConfigError(f"Config key 'cluster.colocate' is true with rollout.engine_args tensor_parallel_size x "
                          f"pipeline_parallel_size x data_parallel_size = {gpus}: colocation places one single-GPU engine beside each "
                          f"trainer rank. Use tensor_parallel_size=1 (and rollout.num_engines up to "
                          f"trainer.world_size), or cluster.colocate=false.")
    if ro.num_engines > cfg.trainer.world_size:
        raise ConfigError(f"Config key 'rollout.num_engines' is {ro.num_engines} with cluster.colocate=true and "
                          f"trainer.world_size={cfg.trainer.world_size}: each engine shares one trainer rank's GPU. "
                          f"Set rollout.num_engines <= {cfg.trainer.world_size}.")
    labels = cfg.cluster.role_labels
    if labels.get("rollout", {}) != labels.get("trainer", {}):
        raise ConfigError(f"Config keys 'cluster.role_labels.rollout' ({labels.get('rollout', {})}) and "
                          f"'cluster.role_labels.trainer' ({labels.get('trainer', {})}) differ with "
                          f"cluster.colocate=true: an engine and its trainer rank share one bundle on one node. "
                          f"Give both roles the same labels.")
    if args.get("enable_sleep_mode") is False:
        raise ConfigError("Config key 'rollout.engine_args.enable_sleep_mode' is false with cluster.colocate=true: "
                          "a colocated engine must sleep while the ranks train. Remove it (colocation sets it).")
    util = args.get("gpu_memory_utilization")
    if util is not None and not 0 < float(util) < 1:
        raise ConfigError(f"Bad value for config key 'rollout.engine_args.gpu_memory_utilization': {util!r} with "
                          f"cluster.colocate=true: the engine shares its GPU, give a fraction below 1, or null to "
                          f"derive it from the memory plan.")


def _check_routing_replay(cfg: Config, check_files: bool) -> None:
    if cfg.algorithm.routing_replay.value != "rollout":
        return
    if cfg.rollout.backend.value == "trainer":
        raise ConfigError("Config key 'algorithm.routing_replay' is 'rollout' with rollout.backend=trainer: routing "
                          "replay replays the vLLM engine's routing, which the trainer sampler has none of. Use "
                          "rollout.backend=vllm, or algorithm.routing_replay=off.")
    config = Path(cfg.model.path) / "config.json"
    if check_files and config.is_file():
        data = json.loads(config.read_text())
        text = data.get("text_config", data)
        if not (text.get("num_experts") or text.get("num_local_experts")):
            raise ConfigError(f"Config key 'algorithm.routing_replay' is 'rollout' but model.path={cfg.model.path} "
                              f"is not a mixture-of-experts model (model_type {data.get('model_type')!r}): there is "
                              f"no routing to replay. Set algorithm.routing_replay=off.")


def validate(cfg: Config, *, check_files: bool = True, check_plugins: bool = True, check_data: bool = True) -> None:
    _check_positive(cfg)
    _check_routing_replay(cfg, check_files)
    _check_weight_sync(cfg)
    _check_placement(cfg)
    _check_colocate(cfg)
    if not cfg.rewards:
        raise ConfigError("Config key 'rewards' is empty: give at least one reward, e.g. "
                          "rewards: [{name: answer_match}].")
    _check_reward_labels(cfg)
    if check_files:
        check_named_files(cfg, data=check_data)
    if check_plugins:
        _check_plugins(cfg)
