"""`mmrl serve` with `serve.vllm_lora: true` (mmrl/serve/lora_sampler.py), driven by the official
`tinker` SDK: two clients' checkpoints as vLLM LoRA adapters in one engine (vision tower and
projector adapters included: an image prompt checks them), a third client's lm_head checkpoint
(the SDK's default train_unembed=True) through the merged fallback, and the base model, all
requested at once; each answer is the logprobs of the model it asked for."""
from __future__ import annotations

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from _tinker_server import image_input, running_server, service_client  # noqa: E402

pytestmark = pytest.mark.slow

ATOL = 2e-3  # vLLM vs the trainer's forward, as in test_tinker_vllm.py
MIN_EFFECT = 0.05  # trained adapters move logprobs by more than this; otherwise the parity is vacuous


def _config(max_lora_rank: int) -> tuple[str, ...]:
    return ("rollout.engine_env.VLLM_CPU_KVCACHE_SPACE=1", "serve.vllm_lora=true",
            f"serve.max_lora_rank={max_lora_rank}", "serve.lora_projector=true", "serve.lora_vision=true")


def _datum(chunks: list, targets: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput(chunks=chunks),
                       loss_fn_inputs={"target_tokens": np.array(targets, dtype=np.int64)})


def _train(tc, text: str, image_chunks: list, image_ids: list[int]) -> None:
    ids = tc.get_tokenizer().encode(text)
    text_datum = _datum([types.EncodedTextChunk(tokens=ids[:-1])], ids[1:])
    img_datum = _datum(image_chunks, image_ids[1:])  # moves the vision adapters too
    for _ in range(2):
        tc.forward_backward([text_datum, img_datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()


def _trainer_logprobs(tc, chunks: list, ids: list[int]) -> np.ndarray:
    """The trainer's logprobs of ids[1:] (chunks: the model input of ids[:-1])."""
    out = tc.forward([_datum(chunks, ids[1:])], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


@torch.no_grad()
def _base_logprobs(model_dir, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).view(-1, 1)).squeeze(-1).numpy()


def _concurrent_checks(url: str, store_dir, tiny_model_dir) -> tuple[str, list[int], np.ndarray]:
    """Three clients' checkpoints and the base model sampled at once; (client 0's checkpoint path,
    a prompt, its logprobs there) for the restart check."""
    service = service_client(url)
    # clients 0 and 1: adapters vLLM serves; client 2 (the SDK default) trains lm_head too
    tcs = [service.create_lora_training_client(base_model="tiny-vlm", rank=8, seed=s, train_unembed=s == 2).result()
           for s in (0, 1, 2)]
    tok = tcs[0].get_tokenizer()
    pre, image, post, full_img = image_input(tok, tiny_model_dir)
    img_prompt = [types.EncodedTextChunk(tokens=pre), image, types.EncodedTextChunk(tokens=post)]
    train_img = [types.EncodedTextChunk(tokens=pre), image, types.EncodedTextChunk(tokens=post[:-1])]
    _train(tcs[0], "the red square is red and the blue circle is blue", train_img, full_img)
    _train(tcs[1], "green leaves and yellow sand under a grey sky", train_img, full_img)
    _train(tcs[2], "one two three four five six seven", train_img, full_img)
    paths = [tc.save_weights_for_sampler(f"client{i}").result().path for i, tc in enumerate(tcs)]
    samplers = [service.create_sampling_client(model_path=p) for p in paths]
    saved = list((store_dir / "checkpoints").glob("*/sampler_weights/*"))
    assert sorted(p.is_dir() and (p / "adapter_config.json").is_file() for p in saved) == [False, True, True], saved
    base = service.create_sampling_client(base_model="tiny-vlm").result()

    text = tok.encode("the colour of the sea is")
    params = types.SamplingParams(max_tokens=6, seed=5, temperature=1.0)
    # every request submitted before any result is read: the engine runs them side by side
    # (adapter and base requests in the same batches), with no switch between them
    pending = []
    for _ in range(2):
        for who, s in (("base", base), (0, samplers[0]), (2, samplers[2]), (1, samplers[1])):
            pending.append((who, "text", s.sample(types.ModelInput.from_ints(text), 2, params)))
            pending.append((who, "score", s.compute_logprobs(types.ModelInput.from_ints(text))))
        for who in (0, 1, 2):
            pending.append((who, "image", samplers[who].sample(types.ModelInput(chunks=img_prompt), 1, params)))
    results = [(who, kind, f.result()) for who, kind, f in pending]

    base_prompt = _base_logprobs(tiny_model_dir, text)
    prompt_lp: dict = {}
    for who, kind, res in results:
        if kind == "score":  # compute_logprobs of the prompt: [None, logprob of text[1] ...]
            prompt_lp.setdefault(who, []).append(np.array(res[1:], dtype=np.float32))
    for who, lps in prompt_lp.items():
        expected = base_prompt if who == "base" else _trainer_logprobs(
            tcs[who], [types.EncodedTextChunk(tokens=text[:-1])], text)
        for lp in lps:
            np.testing.assert_allclose(lp, expected, atol=ATOL, err_msg=f"prompt logprobs of {who}")
    # the adapters act, and differently: otherwise the checks above could not tell them apart
    for a, b in (("base", 0), ("base", 1), ("base", 2), (0, 1), (0, 2), (1, 2)):
        effect = np.abs(prompt_lp[a][0] - prompt_lp[b][0]).max()
        assert effect > MIN_EFFECT, f"samplers {a} and {b} give the same prompt logprobs ({effect:.2e})"

    # each sampled sequence: its logprobs are its own model's (the trainer's, or the base model's)
    checked = set()
    for who, kind, res in results:
        if kind == "score":
            continue
        for seq in res.sequences:
            assert len(seq.tokens) == len(seq.logprobs) >= 1
            if kind == "text":
                ids = text + seq.tokens
                expected = (_base_logprobs(tiny_model_dir, ids) if who == "base" else _trainer_logprobs(
                    tcs[who], [types.EncodedTextChunk(tokens=ids[:-1])], ids))
            else:
                ids = full_img + seq.tokens
                tail = [types.EncodedTextChunk(tokens=seq.tokens[:-1])] if len(seq.tokens) > 1 else []
                expected = _trainer_logprobs(tcs[who], img_prompt + tail, ids)
            np.testing.assert_allclose(seq.logprobs, expected[-len(seq.tokens):], atol=ATOL,
                                       err_msg=f"sampled logprobs of {who} ({kind})")
            checked.add((who, kind))
    assert checked == {("base", "text"), *((w, k) for w in (0, 1, 2) for k in ("text", "image"))}
    return paths[0], text, prompt_lp[0][0]


def test_vllm_lora_sampler(tiny_model_dir, tmp_path):
    store_dir = tmp_path / "store"
    with running_server(tiny_model_dir, store_dir, sampler="vllm", extra=_config(16)) as url:
        path, text, logprobs = _concurrent_checks(url, store_dir, tiny_model_dir)
        big = service_client(url).create_lora_training_client(base_model="tiny-vlm", rank=16, seed=3,
                                                              train_unembed=False).result()
        big_path = big.save_weights_for_sampler("big").result().path
    # a restart with a smaller max_lora_rank: client 0's adapter is loaded again on first use and
    # gives the same logprobs; the rank-16 one is refused by vLLM's add_lora, which is the
    # client's error naming the checkpoint (sent inside a request it would kill the engine), and
    # the engine keeps serving
    with running_server(tiny_model_dir, store_dir, sampler="vllm", extra=_config(8)) as url:
        service = service_client(url)
        again = service.create_sampling_client(model_path=path).compute_logprobs(
            types.ModelInput.from_ints(text)).result()
        np.testing.assert_allclose(np.array(again[1:], dtype=np.float32), logprobs, atol=1e-5)
        with pytest.raises(tinker.RequestFailedError, match=rf"checkpoint '{big_path}'.*vLLM cannot load it"):
            service.create_sampling_client(model_path=big_path).sample(
                types.ModelInput.from_ints(text), 1, types.SamplingParams(max_tokens=2)).result()
        base = service.create_sampling_client(base_model="tiny-vlm").compute_logprobs(
            types.ModelInput.from_ints(text)).result()
        np.testing.assert_allclose(np.array(base[1:], dtype=np.float32), _base_logprobs(tiny_model_dir, text),
                                   atol=ATOL)
