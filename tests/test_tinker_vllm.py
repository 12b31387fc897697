"""`mmrl serve` with the vLLM sampler (mmrl's rollout engine; checkpoints merged in place through
the weight sync), driven by the official `tinker` SDK."""
from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from _tinker_server import image_input, sample_and_score, serve_in_thread, service_client  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    # adapters on the vision tower and projector too: the image prompt below then checks that vLLM
    # gets their merged deltas under its own names
    yield from serve_in_thread(tiny_model_dir, tmp_path_factory.mktemp("serve-vllm"), sampler="vllm",
                               extra=("rollout.engine_env.VLLM_CPU_KVCACHE_SPACE=1", "serve.lora_projector=true",
                                      "serve.lora_vision=true"))


def test_train_then_sample_with_vllm(server, tiny_model_dir):
    service = service_client(server)
    tc = service.create_lora_training_client(base_model="tiny-vlm", rank=8, seed=0).result()
    ids = tc.get_tokenizer().encode("the red square is red and the blue circle is blue")
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(ids[1:], dtype=np.int64)})
    losses = []
    for _ in range(3):
        fb = tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2))
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < losses[0]
    # one step on an image datum: the vision adapters' deltas leave zero
    pre, image, post, full_img = image_input(tc.get_tokenizer(), tiny_model_dir)
    chunks = [types.EncodedTextChunk(tokens=pre), image, types.EncodedTextChunk(tokens=post[:-1])]
    tc.forward_backward([types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs={
        "target_tokens": np.array(full_img[1:], dtype=np.int64)})], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()

    base = service.create_sampling_client(base_model="tiny-vlm").result()
    prompt = types.ModelInput.from_ints(ids[:4])
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    before = base.sample(prompt, 1, greedy).result().sequences[0]

    sampler = tc.save_weights_and_get_sampling_client().result()
    res = sampler.sample(prompt, num_samples=3,
                         sampling_params=types.SamplingParams(max_tokens=8, seed=3, top_k=50, top_p=0.95)).result()
    assert len(res.sequences) == 3
    for seq in res.sequences:
        assert len(seq.logprobs) == len(seq.tokens) >= 1 and seq.stop_reason in ("stop", "length")
    # the trained weights are what vLLM samples: its logprobs of a sequence equal the trainer's
    seq = res.sequences[0]
    full = ids[:4] + seq.tokens
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    np.testing.assert_allclose(scored[4:], seq.logprobs, atol=2e-3)
    check = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(full[1:], dtype=np.int64)})
    trainer_lp = tc.forward([check], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(trainer_lp, np.array(scored[1:], dtype=np.float32), atol=2e-3)
    # and the base model is restored for base-model sampling
    after = base.sample(prompt, 1, greedy).result().sequences[0]
    assert after.tokens == before.tokens

    # an image prompt: vLLM gets one pad + the image and expands it; logprobs over the expanded prompt
    chunks = [types.EncodedTextChunk(tokens=pre), image, types.EncodedTextChunk(tokens=post)]
    seq, scored = sample_and_score(sampler, chunks, seed=0)
    assert len(scored) == len(full_img) + len(seq.tokens)
    np.testing.assert_allclose(scored[len(full_img):], seq.logprobs, atol=2e-3)
    tail = [types.EncodedTextChunk(tokens=seq.tokens[:-1])] if len(seq.tokens) > 1 else []
    img_datum = types.Datum(model_input=types.ModelInput(chunks=chunks + tail),
                            loss_fn_inputs={"target_tokens": np.array((full_img + seq.tokens)[1:], dtype=np.int64)})
    trainer_img = tc.forward([img_datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(trainer_img[len(full_img) - 1:], seq.logprobs, atol=2e-3)
