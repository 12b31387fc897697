"""The Tinker losses `mmrl serve` implements beyond PPO: GSPO (token variant) and DRO, checked on
their gradients directly, then through the official SDK (values on the real trainer), and
`forward_backward_custom`, which the SDK runs as a forward pass plus a cross-entropy backward
weighted by the custom loss's gradient."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mmrl.serve.losses import GSPO_THRESHOLDS, LOSSES, LossInputError, check_loss_name, dro, gspo

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from _tinker_server import serve_in_thread, service_client  # noqa: E402

PROMPT = "the red square is red and the blue circle is blue"


def _grad(loss_fn, logp: torch.Tensor, inputs: dict, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    logp = logp.clone().requires_grad_(True)
    loss_T = loss_fn(logp, inputs, config, "data[0]")
    loss_T.sum().backward()
    return loss_T.detach(), logp.grad


def test_gspo_every_token_carries_the_sequence_ratio_with_its_own_gradient() -> None:
    logp = torch.tensor([-9.0, -1.0, -2.0, -0.5])  # token 0: a prompt token, not in the ratio
    sampler = torch.tensor([0.0, -1.2, -1.9, -0.7])
    adv = torch.tensor([0.0, 1.0, 1.0, -0.5])
    wide = {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    loss_T, grad = _grad(gspo, logp, {"logprobs": sampler, "advantages": adv}, wide)
    s = torch.exp((logp[1:] - sampler[1:]).mean())  # the geometric mean over the sampled tokens
    assert torch.allclose(loss_T, -s * adv, atol=1e-6)
    assert torch.allclose(grad, -s * adv, atol=1e-6)  # d/dlogp_t of s_t * A_t is s * A_t
    # an explicit mask wins over the default (non-zero advantages): token 3 leaves the ratio
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0])
    loss_T, _ = _grad(gspo, logp, {"logprobs": sampler, "advantages": adv, "sequence_ratio_mask": mask}, wide)
    assert torch.allclose(loss_T, -torch.exp((logp[1:3] - sampler[1:3]).mean()) * adv, atol=1e-6)


def test_gspo_clips_whole_sequences_at_the_papers_range_by_default() -> None:
    sampler = torch.tensor([-1.0, -1.0, -1.0])
    adv = torch.ones(3)
    # s = e^0.001 is above 1 + 4e-4: a positive advantage is clipped, no gradient for any token
    loss_T, grad = _grad(gspo, sampler + 0.001, {"logprobs": sampler, "advantages": adv}, {})
    assert torch.allclose(loss_T, -torch.full((3,), GSPO_THRESHOLDS[1]), atol=1e-6)
    assert torch.count_nonzero(grad) == 0
    # the same sequence with a negative advantage keeps its gradient (min picks the unclipped side)
    _, grad = _grad(gspo, sampler + 0.001, {"logprobs": sampler, "advantages": -adv}, {})
    assert torch.allclose(grad, torch.full((3,), float(np.exp(0.001))), atol=1e-6)


def test_per_token_thresholds_in_the_inputs_win_over_the_config() -> None:
    sampler = torch.zeros(2)
    logp = torch.log(torch.tensor([1.5, 1.5]))  # ratio 1.5 on both tokens
    inputs = {"logprobs": sampler, "advantages": torch.ones(2),
              "clip_low_threshold": torch.tensor([0.8, 0.8]), "clip_high_threshold": torch.tensor([1.2, 2.0])}
    loss_T, _ = _grad(LOSSES["ppo"], logp, inputs, {"clip_high_threshold": 1.1})
    assert torch.allclose(loss_T, torch.tensor([-1.2, -1.5]), atol=1e-6)


def test_dro_gradient_pulls_towards_the_sampler_by_beta() -> None:
    logp = torch.tensor([-1.0, -2.0, -0.5])
    sampler = torch.tensor([-1.5, -1.0, -0.5])
    adv = torch.tensor([1.0, -1.0, 0.5])
    loss_T, grad = _grad(dro, logp, {"logprobs": sampler, "advantages": adv}, {"beta": 0.2})
    assert torch.allclose(loss_T, -(logp * adv - 0.1 * (logp - sampler) ** 2), atol=1e-6)
    assert torch.allclose(grad, -(adv - 0.2 * (logp - sampler)), atol=1e-6)
    with pytest.raises(LossInputError, match="beta"):
        dro(logp, {"logprobs": sampler, "advantages": adv}, {"beta": -1.0}, "data[0]")


def test_losses_not_served_say_why() -> None:
    with pytest.raises(LossInputError, match="record_stability_info"):
        check_loss_name("stable_reinforce")
    with pytest.raises(LossInputError, match="forward_backward_custom"):
        check_loss_name("custom")
    with pytest.raises(LossInputError, match="'no_such_loss' is not supported; supported: cross_entropy"):
        check_loss_name("no_such_loss")


# ---- through the SDK, on the real trainer -------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    yield from serve_in_thread(tiny_model_dir, tmp_path_factory.mktemp("serve-losses"), sampler="trainer")


def _rl_datum(ids: list[int]) -> tuple[types.Datum, np.ndarray]:
    n = len(ids) - 1
    adv = np.linspace(-0.5, 1, n).astype(np.float32)  # not symmetric: a constant ratio cannot cancel out
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(ids[1:], dtype=np.int64),
                                       "logprobs": np.full(n, -5.0, dtype=np.float32), "advantages": adv}), adv


def test_gspo_and_dro_through_the_sdk(server):
    tc = service_client(server).create_lora_training_client(base_model="tiny-vlm", rank=4, seed=0).result()
    datum, adv = _rl_datum(tc.get_tokenizer().encode(PROMPT))
    out = tc.forward_backward([datum], "gspo", {"clip_low_threshold": 0.0, "clip_high_threshold": 1e9}).result()
    logp = out.loss_fn_outputs[0]["logprobs"].to_numpy().astype(np.float64)
    in_ratio = adv != 0
    s = np.exp((logp[in_ratio] + 5.0).mean())
    assert out.metrics["loss:sum"] == pytest.approx(-(s * adv).sum(), rel=1e-4, abs=1e-5)
    out = tc.forward_backward([datum], "dro", {"beta": 0.1}).result()
    want = -(logp * adv - 0.05 * (logp + 5.0) ** 2).sum()
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-5)
    with pytest.raises(Exception, match="record_stability_info"):
        tc.forward_backward([datum], "stable_reinforce").result()
    tc.optim_step(types.AdamParams(learning_rate=0.0)).result()  # drop those gradients unchanged


def test_forward_backward_custom_trains_like_the_equivalent_builtin_loss(server):
    """A custom loss -Σ A·log p, through `forward_backward_custom`, moves the weights exactly as
    cross_entropy with weights A does: two clients from the same seed end up identical."""
    client = service_client(server)
    custom = client.create_lora_training_client(base_model="tiny-vlm", rank=4, seed=7).result()
    builtin = client.create_lora_training_client(base_model="tiny-vlm", rank=4, seed=7).result()
    ids = custom.get_tokenizer().encode(PROMPT)
    weights = np.linspace(-0.5, 1.0, len(ids) - 1).astype(np.float32)
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(ids[1:], dtype=np.int64)})
    weighted = types.Datum(model_input=datum.model_input,
                           loss_fn_inputs={"target_tokens": np.array(ids[1:], dtype=np.int64), "weights": weights})

    def weighted_nll(data, logprobs_list):
        loss = -(torch.tensor(weights) * logprobs_list[0]).sum()
        return loss, {"custom_metric": 1.0}

    adam = types.AdamParams(learning_rate=5e-2)
    for _ in range(2):
        out = custom.forward_backward_custom([datum], weighted_nll).result()
        custom.optim_step(adam).result()
        ref = builtin.forward_backward([weighted], "cross_entropy").result()
        builtin.optim_step(adam).result()
        assert out.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-5, abs=1e-5)
        assert out.metrics["custom_metric"] == 1.0
    after_custom = custom.forward([weighted], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    after_builtin = builtin.forward([weighted], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    before = client.create_lora_training_client(base_model="tiny-vlm", rank=4, seed=7).result().forward(
        [weighted], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.abs(after_custom - before).max() > 1e-3  # the steps moved the model
    np.testing.assert_allclose(after_custom, after_builtin, atol=1e-5)
