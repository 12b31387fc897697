"""`mmrl serve` driven by the official `tinker` SDK (pinned: tinker==0.38.0, the `test` extra).

The server runs in a thread of this process with the transformers sampler (`serve.sampler=trainer`):
real LoRA training, no vLLM (tests/test_tinker_vllm.py runs the vLLM sampler)."""
from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from _tinker_server import KEY_A, KEY_B, image_input, sample_and_score, serve_in_thread, service_client  # noqa: E402

PROMPT = "the red square is red and the blue circle is blue"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    yield from serve_in_thread(tiny_model_dir, tmp_path_factory.mktemp("serve"), sampler="trainer")


@pytest.fixture(scope="module")
def trained(server):
    """A training client after 4 cross-entropy steps on one fixed datum, and its losses."""
    tc = service_client(server).create_lora_training_client(base_model="tiny-vlm", rank=4, seed=0).result()
    ids = tc.get_tokenizer().encode(PROMPT)
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(ids[1:], dtype=np.int64),
                                        "weights": np.ones(len(ids) - 1, dtype=np.float32)})
    losses = []
    for _ in range(4):
        fb = tc.forward_backward([datum], "cross_entropy")  # queued back to back with the optim step
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8,
                                             weight_decay=0.01, grad_clip_norm=10.0))
        out = fb.result()
        assert opt.result().metrics["grad_norm"] > 0
        losses.append(out.metrics["loss:sum"])
        logprobs = out.loss_fn_outputs[0]["logprobs"].to_numpy()
        assert logprobs.shape == (len(ids) - 1,)
        assert np.isclose(-logprobs.sum(), out.metrics["loss:sum"], rtol=1e-4)
    return tc, ids, datum, losses


def test_cross_entropy_steps_lower_the_loss(trained):
    _, _, _, losses = trained
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def test_forward_only_matches_forward_backward_logprobs(trained):
    tc, ids, datum, _ = trained
    fwd = tc.forward([datum], "cross_entropy").result()
    assert fwd.loss_fn_outputs[0]["logprobs"].to_numpy().shape == (len(ids) - 1,)


def test_importance_sampling_and_ppo_losses_run(trained):
    tc, ids, _, _ = trained
    n = len(ids) - 1
    rl = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                     loss_fn_inputs={"target_tokens": np.array(ids[1:], dtype=np.int64),
                                     "logprobs": np.full(n, -5.0, dtype=np.float32),
                                     "advantages": np.linspace(-1, 1, n).astype(np.float32)})
    adv = np.linspace(-1, 1, n)
    for loss, config in (("importance_sampling", None), ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
                         ("cispo", None)):
        out = tc.forward_backward([rl], loss, config).result()
        ratio = np.exp(out.loss_fn_outputs[0]["logprobs"].to_numpy().astype(np.float64) + 5.0)
        if loss == "importance_sampling":
            want = -(ratio * adv).sum()
        elif loss == "ppo":
            want = -np.minimum(ratio * adv, np.clip(ratio, 0.9, 1.1) * adv).sum()
        else:  # cispo: -sum(sg(clip(ratio)) * logp * A), default thresholds 0.8 / 1.2
            want = -(np.clip(ratio, 0.8, 1.2) * (np.log(ratio) - 5.0) * adv).sum()
        assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-5), loss
    tc.optim_step(types.AdamParams(learning_rate=0.0)).result()  # drop those gradients unchanged


def test_sampled_logprobs_match_compute_logprobs(trained):
    tc, ids, _, _ = trained
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(ids[:4])
    res = sampler.sample(prompt, num_samples=3, sampling_params=types.SamplingParams(max_tokens=6, seed=7)).result()
    assert len(res.sequences) == 3
    for seq in res.sequences:
        assert 1 <= len(seq.tokens) <= 6 and len(seq.logprobs) == len(seq.tokens)
        assert seq.stop_reason in ("length", "stop")
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(ids[:4] + seq.tokens)).result()
        assert scored[0] is None and len(scored) == 4 + len(seq.tokens)
        np.testing.assert_allclose(scored[4:], seq.logprobs, atol=1e-4)
    again = sampler.sample(prompt, num_samples=3, sampling_params=types.SamplingParams(max_tokens=6, seed=7)).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in res.sequences]  # seeded


def test_named_checkpoint_sampled_by_path(trained, server):
    tc, ids, _, _ = trained
    path = tc.save_weights_for_sampler("step4").result().path
    assert path.startswith("tinker://") and path.endswith("/sampler_weights/step4")
    sampler = service_client(server).create_sampling_client(model_path=path).result()
    res = sampler.sample(types.ModelInput.from_ints(ids[:3]), 1,
                         types.SamplingParams(max_tokens=3, temperature=0.0)).result()
    assert len(res.sequences[0].tokens) >= 1
    # another key cannot sample this key's checkpoint
    other = service_client(server, KEY_B)
    with pytest.raises(Exception, match="model_path"):
        other.create_sampling_client(model_path=path).result().sample(
            types.ModelInput.from_ints(ids[:3]), 1, types.SamplingParams(max_tokens=2)).result()


def test_unknown_loss_is_a_4xx_naming_the_field(trained):
    tc, _, datum, _ = trained
    with pytest.raises(Exception, match="loss_fn") as err:
        tc.forward_backward([datum], "stable_reinforce").result()
    assert "loss_fn 'stable_reinforce' is not supported" in str(err.value)


def test_unknown_model_is_a_4xx_naming_the_field(server):
    with pytest.raises(Exception, match="base_model"):
        service_client(server).create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()


def test_wrong_api_key_is_refused(server):
    with pytest.raises(tinker.AuthenticationError, match="API key"):
        service_client(server, "tml-not-a-key").create_lora_training_client(base_model="tiny-vlm", rank=4).result()


def test_server_capabilities_name_the_model(server):
    caps = tinker.RestClient(base_url=server, api_key=KEY_A).get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == ["tiny-vlm"]


def test_image_chunks_train_and_sample(trained, server, tiny_model_dir):
    tc, _, _, _ = trained
    tok = tc.get_tokenizer()
    pre, image, post, full = image_input(tok, tiny_model_dir)
    model_input = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=pre), image,
                                           types.EncodedTextChunk(tokens=post[:-1])])
    assert model_input.length == len(full) - 1
    weights = np.zeros(len(full) - 1, dtype=np.float32)
    weights[-len(post) + 1:] = 1.0  # the text after the image
    datum = types.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": np.array(full[1:], dtype=np.int64),
                                                                 "weights": weights})
    out = tc.forward_backward([datum], "cross_entropy").result()
    assert out.loss_fn_outputs[0]["logprobs"].to_numpy().shape == (len(full) - 1,)
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt_chunks = [types.EncodedTextChunk(tokens=pre), image, types.EncodedTextChunk(tokens=post)]
    seq, scored = sample_and_score(sampler, prompt_chunks, seed=1)
    assert len(scored) == len(full) + len(seq.tokens)
    np.testing.assert_allclose(scored[len(full):], seq.logprobs, atol=1e-4)


def test_wrong_expected_tokens_names_the_image_and_both_counts(trained, tiny_model_dir):
    tc, _, _, _ = trained
    pre, image, post, full = image_input(tc.get_tokenizer(), tiny_model_dir, expected_delta=3)
    datum = types.Datum(model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=pre), image,
                                                             types.EncodedTextChunk(tokens=post[:-1])]),
                        loss_fn_inputs={"target_tokens": np.zeros(len(full) + 2, dtype=np.int64)})
    n = image.expected_tokens - 3
    with pytest.raises(Exception, match=rf"chunks\[1\].*expected_tokens={n + 3} but this image is {n} tokens"):
        tc.forward_backward([datum], "cross_entropy").result()


def test_datums_batched_in_one_forward_score_as_each_alone(trained, tiny_model_dir):
    """Datums of different lengths, with and without an image, share training forwards (right-padded
    rows, vision inputs in row order): each scores exactly as it does alone, and a datum with a bad
    input refuses the whole call before any gradient accumulates."""
    tc, ids, text_datum, _ = trained
    pre, image, post, full = image_input(tc.get_tokenizer(), tiny_model_dir)
    image_datum = types.Datum(
        model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=pre), image,
                                             types.EncodedTextChunk(tokens=post[:-1])]),
        loss_fn_inputs={"target_tokens": np.array(full[1:], dtype=np.int64)})
    short = types.Datum(model_input=types.ModelInput.from_ints(ids[:3]),
                        loss_fn_inputs={"target_tokens": np.array(ids[1:4], dtype=np.int64)})
    data = [text_datum, image_datum, short, image_datum]
    together = tc.forward(data, "cross_entropy").result().loss_fn_outputs
    for datum, out in zip(data, together):
        alone = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]
        np.testing.assert_allclose(out["logprobs"].to_numpy(), alone["logprobs"].to_numpy(), atol=2e-5)
    def rl(n_advantages: int) -> types.Datum:
        return types.Datum(model_input=short.model_input, loss_fn_inputs={
            "target_tokens": np.array(ids[1:4], dtype=np.int64), "logprobs": np.zeros(3, dtype=np.float32),
            "advantages": np.ones(n_advantages, dtype=np.float32)})
    before = tc.forward([short], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    with pytest.raises(Exception, match=r"data\[1\]\.loss_fn_inputs\.advantages has 2 values"):
        tc.forward_backward([rl(3), rl(2)], "importance_sampling").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # no gradient from the refused call: no change
    after = tc.forward([short], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("option, module", [("serve.lora_projector=true", "merger"),
                                            ("serve.lora_vision=true", "blocks.")])
def test_vision_adapters_train_and_their_sampler_sees_them(tiny_model_dir, tmp_path, option, module):
    """`serve.lora_projector=true` / `serve.lora_vision=true`: adapters on the vision projector / the
    vision tower's blocks as well; they train on an image datum (their B matrices leave zero), and a
    sampler of the saved weights scores as the trainer."""
    from safetensors.torch import load_file

    server = serve_in_thread(tiny_model_dir, tmp_path, sampler="trainer", extra=(option,))
    url = next(server)
    try:
        # the SDK wants one of attn/mlp/unembed: unembed only (lm_head), beside the projector's
        tc = service_client(url).create_lora_training_client(base_model="tiny-vlm", rank=4, seed=0, train_attn=False,
                                                             train_mlp=False, train_unembed=True).result()
        pre, image, post, full = image_input(tc.get_tokenizer(), tiny_model_dir)
        chunks = [types.EncodedTextChunk(tokens=pre), image, types.EncodedTextChunk(tokens=post[:-1])]
        datum = types.Datum(model_input=types.ModelInput(chunks=chunks),
                            loss_fn_inputs={"target_tokens": np.array(full[1:], dtype=np.int64)})
        for _ in range(2):
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        tc.save_state("projector").result()
        (adapter_file,) = tmp_path.glob("checkpoints/*/weights/projector.*/adapter.safetensors")
        vision_b = {k: v for k, v in load_file(adapter_file).items() if "visual" in k and module in k and "lora_B" in k}
        assert vision_b and all(v.abs().max() > 0 for v in vision_b.values()), list(vision_b)
        trained = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        sampler = tc.save_weights_and_get_sampling_client().result()
        scored = sampler.compute_logprobs(types.ModelInput(
            chunks=[types.EncodedTextChunk(tokens=pre), image, types.EncodedTextChunk(tokens=post)])).result()
        np.testing.assert_allclose(scored[1:], trained, atol=1e-4)
    finally:
        server.close()


def test_close_ends_the_session_and_only_its_key_can(server):
    """`ServiceClient.close()` finishes the session on the server (POST /sessions/{id}/finish); another
    key's finish of it is a 404."""
    import httpx

    client = service_client(server)
    client.create_lora_training_client(base_model="tiny-vlm", rank=4, seed=0).result()
    assert client.close("success").result(timeout=60) is None
    sid = httpx.post(f"{server}/api/v1/create_session", headers={"X-API-Key": KEY_A}, json={}).json()["session_id"]
    other = httpx.post(f"{server}/api/v1/sessions/{sid}/finish", headers={"X-API-Key": KEY_B}, json={})
    assert other.status_code == 404 and "session_id" in other.text
    assert httpx.post(f"{server}/api/v1/sessions/{sid}/finish", headers={"X-API-Key": KEY_A}, json={}).status_code == 200
