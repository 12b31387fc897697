"""Typed config: merging, overrides, and errors that name the key path and the fix."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from mmrl.cli import main
from mmrl.config import ConfigError, load_config
from mmrl.config.schema import Config, LossAgg

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "configs" / "colors_demo.yaml")


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_demo_config_loads_with_overrides() -> None:
    cfg = load_config(DEMO, ["rollout.group_size=4", "trainer.lr=3e-4", "algorithm.loss_agg=seq_mean_token_mean",
                             "trainer.deepspeed.bf16.enabled=true"], check_files=False)
    assert isinstance(cfg, Config)
    assert cfg.rollout.group_size == 4 and cfg.trainer.lr == pytest.approx(3e-4)
    assert cfg.algorithm.loss_agg is LossAgg.seq_mean_token_mean
    assert cfg.trainer.deepspeed == {"bf16": {"enabled": True}}  # native DeepSpeed JSON passes through
    assert cfg.run.output_dir == "runs/colors-demo"  # interpolation resolved
    assert [r.name for r in cfg.rewards] == ["shape_colour", "first_word_in"]


@pytest.mark.parametrize("override, key, hint", [
    ("rollout.groupsize=4", "rollout.groupsize", "Did you mean 'rollout.group_size'?"),
    ("trainr.lr=1", "trainr", "Did you mean 'trainer'?"),
    ("algorithm.clip=0.3", "algorithm.clip", "clip_low, clip_high"),
])
def test_unknown_key_names_path_and_allowed(override: str, key: str, hint: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, [override], check_files=False)
    assert f"'{key}'" in str(err.value) and hint in str(err.value)


def test_wrong_type_and_bad_enum() -> None:
    with pytest.raises(ConfigError, match=r"'rollout.group_size'.*could not be converted to Integer"):
        load_config(DEMO, ["rollout.group_size=many"], check_files=False)
    with pytest.raises(ConfigError, match=r"'model.dtype'.*float32, bfloat16"):
        load_config(DEMO, ["model.dtype=fp16"], check_files=False)
    with pytest.raises(ConfigError, match=r"'rollout.group_size'.*at least 2"):
        load_config(DEMO, ["rollout.group_size=1"], check_files=False)


def test_unknown_key_inside_reward_list_has_index(tmp_path: Path) -> None:
    path = _write(tmp_path, """
        rewards:
          - name: answer_match
          - nmae: shape_colour
    """)
    with pytest.raises(ConfigError, match=r"'rewards\[1\]\.nmae'.*Did you mean 'rewards\[1\]\.name'"):
        load_config(path, check_files=False)


def test_a_reward_listed_twice_needs_the_alias_the_message_suggests(tmp_path: Path) -> None:
    import dataclasses

    from mmrl.rewards.base import RewardSet

    twice = """
        rewards:
          - name: answer_match
          - name: answer_match
            weight: 0.5
            args: {first_word: true}
    """
    with pytest.raises(ConfigError, match=r"'rewards\[1\]'.*'answer_match' is listed twice.*alias: answer_match_2"):
        load_config(_write(tmp_path, twice), check_files=False)
    cfg = load_config(_write(tmp_path, twice + "        alias: answer_match_2\n"), check_files=False)
    assert cfg.rewards[1].alias == "answer_match_2"
    # the entries as the controller hands them to the reward pool
    rewards = RewardSet([dataclasses.asdict(r) for r in cfg.rewards])
    assert [e["label"] for e in rewards.entries] == ["answer_match", "answer_match_2"]


def test_missing_config_file() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("no/such/config.yaml")


def test_missing_shards_and_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"'data.train_shards'.*mmrl data build colors"):
        load_config(DEMO, [f"model.path={tiny_model_dir}", f"data.train_shards={tmp_path}/none-{{000..001}}.tar"])
    with pytest.raises(ConfigError, match=r"'model.path'.*mmrl tiny-model"):
        load_config(DEMO, [f"model.path={tmp_path}/no-model"])
    # a command that reads no shards (mmrl serve, serve-rollout) checks the model only: on a clean
    # machine the defaults' shards (work/data/colors) do not exist
    missing = [f"data.train_shards={tmp_path}/none-{{000..001}}.tar", f"data.heldout_shards={tmp_path}/none.tar"]
    assert load_config(DEMO, [f"model.path={tiny_model_dir}", *missing], check_data=False).model.path == str(tiny_model_dir)
    with pytest.raises(ConfigError, match=r"'model.path'"):
        load_config(DEMO, [f"model.path={tmp_path}/no-model", *missing], check_data=False)


def test_reward_plugin_path_that_does_not_import(tmp_path: Path) -> None:
    broken = tmp_path / "my_rewards.py"
    broken.write_text("import not_a_real_module_xyz\n\ndef good(response, **_):\n    return 1.0\n")
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.name.*importing .*my_rewards.py failed.*ModuleNotFoundError"):
        load_config(DEMO, [f"rewards=[{{name: '{broken}:good'}}]"], check_files=False)
    with pytest.raises(ConfigError, match=r"unknown reward plugin 'no_such_reward'.*Registered reward plugins"):
        load_config(DEMO, ["rewards=[{name: no_such_reward}]"], check_files=False)
    with pytest.raises(ConfigError, match=r"module 'nopkg_xyz.rewards' does not import"):
        load_config(DEMO, ["rewards=[{name: 'nopkg_xyz.rewards:fn'}]"], check_files=False)


def test_cli_reports_config_errors_as_one_paragraph(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", DEMO, "rollout.groupsize=4", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmrl: error: Unknown config key 'rollout.groupsize'")
    assert "Traceback" not in err and "\n\n" not in err.strip()


def test_dry_run_prints_config_and_placement(capsys: pytest.CaptureFixture[str], tiny_model_dir: Path,
                                             colors_dir: Path) -> None:
    rc = main(["train", DEMO, f"model.path={tiny_model_dir}",
               f"data.train_shards={colors_dir}/train-{{000000..000001}}.tar",
               f"data.heldout_shards={colors_dir}/heldout-000000.tar", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "group_size: 16" in out and "# placement (device: cpu)" in out
    assert "rollout/0" in out and "trainer/0" in out and "trainer/1" in out
    assert "DeepSpeed ZeRO-3 rank 1/2 (gloo)" in out


def test_algorithm_and_stability_keys_are_checked(tmp_path) -> None:
    import pytest

    from mmrl.config.load import ConfigError, load_config

    def check(*overrides: str) -> str:
        with pytest.raises(ConfigError) as e:
            load_config(None, list(overrides), check_files=False, check_plugins=False)
        return str(e.value)

    assert "algorithm.kl.estimator" in check("algorithm.kl.estimator=k4")
    assert "algorithm.ppo_epochs" in check("algorithm.ppo_epochs=0")
    assert "threshold_low" in check("algorithm.rollout_correction.threshold_low=3.0")
    assert "checkpoint.every_steps" in check("stability.enabled=true", "checkpoint.every_steps=0")
    assert "mis" in check("algorithm.rollout_correction.mode=bogus")  # the allowed values are listed
    cfg = load_config(None, ["algorithm.kl.estimator=k3+", "algorithm.kl.placement=reward"], check_files=False,
                      check_plugins=False)
    assert cfg.algorithm.kl.placement.value == "reward"


def test_vllm_lora_without_the_vllm_sampler_is_refused_at_load() -> None:
    """`mmrl serve` must not start engines for a config it cannot serve: the cross-key check is
    the config's, before anything starts."""
    with pytest.raises(ConfigError, match=r"'serve.vllm_lora'.*serve.sampler=vllm"):
        load_config(DEMO, ["serve.vllm_lora=true", "serve.sampler=trainer"], check_files=False)
    assert load_config(DEMO, ["serve.vllm_lora=true"], check_files=False).serve.vllm_lora


def test_routing_replay_is_checked_against_the_backend_and_the_model(tmp_path) -> None:
    import json

    import pytest

    from mmrl.config.load import ConfigError, load_config

    def load(*overrides: str, check_files: bool = False):
        return load_config(None, list(overrides), check_files=check_files, check_plugins=False)

    assert load().algorithm.routing_replay.value == "off"
    with pytest.raises(ConfigError, match="rollout"):  # the allowed values are listed
        load("algorithm.routing_replay=always")
    with pytest.raises(ConfigError, match="rollout.backend=trainer"):
        load("algorithm.routing_replay=rollout", "rollout.backend=trainer")
    from mmrl.config.load import _check_routing_replay

    dense, moe = tmp_path / "dense", tmp_path / "moe"
    for folder, text in ((dense, {"hidden_size": 128}), (moe, {"num_experts": 4, "num_experts_per_tok": 2})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_vl_moe", "text_config": text}))
    with pytest.raises(ConfigError, match="not a mixture-of-experts"):
        _check_routing_replay(load("algorithm.routing_replay=rollout", f"model.path={dense}"), check_files=True)
    _check_routing_replay(load("algorithm.routing_replay=rollout", f"model.path={moe}"), check_files=True)


def test_a_yaml_bool_given_for_an_enum_key_is_the_member_it_spells(tmp_path) -> None:
    """YAML 1.1 reads a bare `off` as False: `algorithm.routing_replay=off` (documented) must still
    load, from the command line and from a file; a bool that spells no member is still refused."""
    import pytest

    from mmrl.config.load import ConfigError, load_config

    on_cli = load_config(None, ["algorithm.routing_replay=off"], check_files=False, check_plugins=False)
    assert on_cli.algorithm.routing_replay.value == "off"
    config = tmp_path / "c.yaml"
    config.write_text("algorithm:\n  routing_replay: off\n")
    assert load_config(str(config), [], check_files=False, check_plugins=False).algorithm.routing_replay.value == "off"
    with pytest.raises(ConfigError, match="routing_replay"):  # True would be `on`, which is no member
        load_config(None, ["algorithm.routing_replay=on"], check_files=False, check_plugins=False)
    # interpolations are left for OmegaConf to resolve
    config.write_text("run:\n  name: off-run\nalgorithm:\n  routing_replay: ${oc.env:MMRL_TEST_REPLAY,rollout}\n")
    assert load_config(str(config), [], check_files=False, check_plugins=False).algorithm.routing_replay.value == "rollout"
