"""weight_sync.transport=collective: trainer rank 0 broadcasts each bucket over a gloo group to the
engines' vLLM workers, which load it at once (no staged copy of the model).

The fast tests check the pieces (bucket wire format, the group, transport choice, config refusal).
The slow ones use the real thing: 2 ZeRO-3 ranks and 2 vLLM CPU engines (fp32, image prompts).
After a training step, engine 0 is synced through the object store and engine 1 through the
collective: the same weights land (checksums) and the same tokens and logprobs come out; then
both engines through one group, with the trainer's logprobs as the reference; then an update
while a request is frozen mid-generation (partial=keep).
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from mmrl.config import load_config
from mmrl.config.load import ConfigError
from mmrl.weight_sync import transport
from mmrl.weight_sync.group import WeightGroup, open_store
from mmrl.weight_sync.packing import ALIGN, BucketHeader, pack_bucket, plan_bucket, unpack_bucket

REPO = Path(__file__).resolve().parents[1]


# ---- fast: the pieces ----------------------------------------------------------------------------
def test_a_bucket_round_trips_through_its_flat_buffer_and_header() -> None:
    tensors = {"a.weight": torch.randn(3, 5), "b.bias": torch.randn(7).to(torch.bfloat16),
               "c.scale": torch.tensor(2.5, dtype=torch.float64), "d.mask": torch.tensor([True, False, True]),
               "e.ids": torch.arange(6, dtype=torch.int64).reshape(2, 3)[:, 1:]}  # non-contiguous
    header, flat = pack_bucket(tensors)
    assert flat.dtype == torch.uint8 and header.nbytes == flat.numel()
    assert all(m.offset % ALIGN == 0 for m in header.tensors)
    again = BucketHeader.from_json(header.to_json())  # what the engine receives by RPC
    assert again == header
    out = dict(unpack_bucket(again, flat.clone()))
    assert list(out) == list(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape and torch.equal(out[name], t), name
    assert plan_bucket(tensors) == header  # the plan alone (no data) agrees with the packed buffer
    with pytest.raises(ValueError, match="header says"):
        unpack_bucket(header, flat[:-1])


def test_the_weight_group_broadcasts_beside_an_existing_default_group() -> None:
    """Three members (threads here; processes in a run) form the group on rank 0's store and
    receive rank 0's buffer, while this process has a default process group (as a trainer rank
    and a vLLM worker have): that group stays the default and still works afterwards."""
    import torch.distributed as dist

    # an earlier test in this process may have left a default group; otherwise make one (1 rank)
    made_here = not dist.is_initialized()
    if made_here:
        default_store = open_store("127.0.0.1", timeout_s=600)
        dist.init_process_group("gloo", store=default_store, rank=0, world_size=1)
    default = dist.group.WORLD
    try:
        store = open_store("127.0.0.1", timeout_s=600)  # hang guards only: a busy machine may be slow
        header, payload = pack_bucket({"w": torch.randn(1000), "b": torch.arange(10)})
        received: dict[int, dict[str, torch.Tensor]] = {}

        def member(rank: int) -> None:
            group = WeightGroup.join("127.0.0.1", store.port, rank, 3, "gloo", 600, "t1")
            buf = torch.empty(header.nbytes, dtype=torch.uint8)
            group.broadcast(buf)
            received[rank] = dict(unpack_bucket(header, buf))
            group.close()

        threads = [threading.Thread(target=member, args=(r,)) for r in (1, 2)]
        for t in threads:
            t.start()
        root = WeightGroup(store, 0, 3, "gloo", 600, "t1")
        root.broadcast(payload)
        for t in threads:
            t.join()
        root.close()
        sent = dict(unpack_bucket(header, payload))
        assert sorted(received) == [1, 2]
        assert all(torch.equal(received[r][k], sent[k]) for r in received for k in sent)
        # the default group is untouched: the same object, still usable
        assert dist.is_initialized() and dist.group.WORLD is default
        if made_here:
            ones = torch.ones(3)
            dist.all_reduce(ones)
            assert torch.equal(ones, torch.ones(3))
    finally:
        if made_here:
            dist.destroy_process_group()


def test_transport_choice_by_device_and_gpu_sharing() -> None:
    assert transport.resolve("auto", "cpu") == ("object_store", None)  # the CPU path keeps today's transport
    assert transport.resolve("collective", "cpu") == ("collective", "gloo")
    assert transport.resolve("object_store", "cuda", [["g1"]], "g0") == ("object_store", None)
    assert transport.resolve("auto", "cuda", [["g1"], ["g2"]], "g0") == ("collective", "nccl")
    assert transport.resolve("auto", "cuda", [["g0"], ["g0"]], "g0") == ("cuda_ipc", None)
    # NCCL cannot hold two ranks on one GPU: a colocated engine makes the group gloo
    assert transport.resolve("collective", "cuda", [["g0"], ["g1"]], "g0") == ("collective", "gloo")
    with pytest.raises(ValueError, match=r"engine\(s\) \[1\] are not on trainer rank 0's GPU"):
        transport.resolve("cuda_ipc", "cuda", [["g0"], ["g1"]], "g0")
    with pytest.raises(ValueError, match="needs CUDA"):
        transport.resolve("cuda_ipc", "cpu")


def test_cuda_ipc_is_refused_at_config_load_without_cuda() -> None:
    base = str(REPO / "configs" / "colors_demo.yaml")
    with pytest.raises(ConfigError, match=r"weight_sync.transport.*needs CUDA.*device is cpu"):
        load_config(base, ["cluster.device=cpu", "weight_sync.transport=cuda_ipc"], check_files=False,
                    check_plugins=False)
    cfg = load_config(base, ["cluster.device=cpu", "weight_sync.transport=collective"], check_files=False,
                      check_plugins=False)
    assert cfg.weight_sync.transport.value == "collective"
    with pytest.raises(ConfigError, match="Allowed values: auto, object_store, collective, cuda_ipc"):
        load_config(base, ["weight_sync.transport=nccl"], check_files=False, check_plugins=False)


def test_cuda_ipc_rebuild_arguments_take_the_receivers_device_index() -> None:
    """The handle's device index is the sender's numbering; the receiver rebuilds on its own index
    of the same GPU. The argument is found by name in this torch's rebuild_cuda_tensor."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from mmrl.weight_sync.cuda_ipc import _with_device

    n = len(__import__("inspect").signature(rebuild_cuda_tensor).parameters)
    args = tuple(f"arg{i}" for i in range(n))
    out = _with_device(rebuild_cuda_tensor, args, 3)
    assert out[6] == 3 and out[:6] + out[7:] == args[:6] + args[7:]


# ---- slow: real trainer ranks and vLLM engines -----------------------------------------------------
BUCKET_MB = 0.25


@pytest.fixture(scope="module")
def runtime(tiny_model_dir: Path, colors_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from _engine import demo_runtime

    with demo_runtime(tiny_model_dir, colors_dir, tmp_path_factory.mktemp("collective_run"),
                      # two engines and two ranks in the 2 CPUs a 2-core machine's Ray offers
                      "rollout.num_engines=2", "cluster.rollout_cpus_per_engine=0.5",
                      "trainer.lr=0.02", "rollout.max_new_tokens=8",
                      f"weight_sync.bucket_mb={BUCKET_MB}", "weight_sync.transport=collective") as rt:
        yield rt


def _train_one_step(rt, samples: list, seed: int) -> None:
    """A real update with random advantages: the trainer's weights move, the engines' do not."""
    from mmrl.controller.learn import make_sequences
    from mmrl.controller.rollout import run_rollout
    from mmrl.rollout.types import SamplingConfig
    from mmrl.trainer.plan import plan_updates

    sampling = SamplingConfig(n=4, max_new_tokens=4, forbidden_token_ids=rt.sampling.forbidden_token_ids)
    rollout = run_rollout(rt.workers, samples, sampling)
    seqs = make_sequences(rollout.prompts, rollout.groups)
    for seq, adv in zip(seqs, torch.randn(len(seqs), generator=torch.Generator().manual_seed(seed)).tolist()):
        seq.advantage = adv
    stats = ray.get([t.train_step.remote(x) for t, x in
                     zip(rt.trainers, plan_updates(seqs, world_size=len(rt.trainers), micro_batch_size=64))])
    assert stats[0]["grad_norms"][0] > 0


def _sync(rt, engines: list, kind: str) -> dict:
    rt.weight_version += 1
    return ray.get([t.sync_weights.remote(engines, rt.weight_version, BUCKET_MB, kind, 120.0)
                    for t in rt.trainers], timeout=600)[0]


def _bucket_sizes(model_dir: Path) -> list[int]:
    """The bytes of each bucket the trainer sends (the same units and bucketing, on a plain model)."""
    from transformers import AutoModelForImageTextToText

    from mmrl.weight_sync.gather import buckets, weight_units

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    # each tensor padded to ALIGN in the flat buffer, as pack_bucket lays it out
    return [sum(-(-u.nbytes // ALIGN) * ALIGN for u in b) for b in buckets(weight_units(model), BUCKET_MB)]


def _trainer_diffs(rt, prompt, token_ids: list[int], logprobs: list[float]) -> np.ndarray:
    """|trainer logprob - engine logprob| per token (the same sequence on every rank: each rank
    takes part in the ZeRO-3 forward)."""
    from mmrl.trainer.batch import TrainSequence

    seq = TrainSequence.from_prompt(prompt, token_ids, logprobs, [1] * len(token_ids))
    trainer = ray.get([t.compute_logprobs.remote([[seq]]) for t in rt.trainers])[0][0]
    return np.abs(np.asarray(trainer) - np.asarray(logprobs))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_collective_sync_lands_the_same_weights_as_the_object_store(runtime, colors_samples: list,
                                                                     tiny_model_dir: Path) -> None:
    from mmrl.rollout.types import RequestSampling

    rt = runtime
    engine_os, engine_coll = rt.engines
    _train_one_step(rt, colors_samples[:4], seed=0)
    old = ray.get([e.weights_checksum.remote() for e in rt.engines])
    assert old[0] == old[1]

    t0 = time.perf_counter()
    by_store = _sync(rt, [engine_os], "object_store")
    store_s = time.perf_counter() - t0
    rt.weight_version -= 1  # the same weights, the same version, through the other transport
    t0 = time.perf_counter()
    by_group = _sync(rt, [engine_coll], "collective")
    group_s = time.perf_counter() - t0

    new = ray.get([e.weights_checksum.remote() for e in rt.engines])
    assert new[0] != old[0], "the trained weights reached the engine"
    assert new[1] == new[0], "the collective delivered exactly what the object store did"
    assert ray.get([e.get_weight_version.remote() for e in rt.engines]) == [rt.weight_version] * 2

    # the same prompt and seed on both engines: the same tokens, the same logprobs
    prompt = rt.processor(colors_samples[7])
    sampling = RequestSampling(max_tokens=8, seed=5, forbidden_token_ids=rt.sampling.forbidden_token_ids)
    a, b = ray.get([e.generate.remote(prompt.vllm_input, sampling) for e in rt.engines])
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
    assert _trainer_diffs(rt, prompt, b.token_ids, b.logprobs).max() <= 1e-4

    # Memory: the collective engine staged nothing (the object store's staging list stayed empty)
    # and never held more than a bucket plus the part of the previous one a straddling layer keeps.
    sizes = _bucket_sizes(tiny_model_dir)
    total, largest = sum(sizes), max(sizes)
    peak = by_group["engine_peak_staged_mb"] * 2**20
    assert by_group["buckets"] == len(sizes) >= 4
    assert by_group["engine_staged_tensors"] == 0
    assert 0 < peak <= 2 * largest and peak < total / 2, (peak, largest, total)
    print(f"sync of {total / 2**20:.2f} MB in {len(sizes)} buckets: object_store {store_s:.3f} s "
          f"(engine apply {by_store['apply_s']:.3f} s, staged {total / 2**20:.2f} MB), collective {group_s:.3f} s "
          f"(engine pause {by_group['apply_s']:.3f} s, peak staged {peak / 2**20:.3f} MB, largest bucket "
          f"{largest / 2**20:.3f} MB)")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_one_group_updates_every_engine_and_matches_the_trainer(runtime, colors_samples: list) -> None:
    from mmrl.controller.learn import make_sequences
    from mmrl.controller.rollout import run_rollout
    from mmrl.rollout.types import SamplingConfig
    from mmrl.trainer.plan import plan_forward_only

    rt = runtime
    _train_one_step(rt, colors_samples[8:12], seed=1)
    before = ray.get([e.weights_checksum.remote() for e in rt.engines])
    t0 = time.perf_counter()
    first = rt.push_weights()  # the runtime's own path: weight_sync.transport=collective from the config
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = rt.push_weights()  # the group is kept: no new rendezvous
    again_s = time.perf_counter() - t0
    after = ray.get([e.weights_checksum.remote() for e in rt.engines])
    assert after[0] == after[1] and after[0] != before[0]
    assert first["engine_staged_tensors"] == again["engine_staged_tensors"] == 0

    sampling = SamplingConfig(n=4, max_new_tokens=8, temperature=1.0, forbidden_token_ids=rt.sampling.forbidden_token_ids)
    rollout = run_rollout(rt.workers, colors_samples[:8], sampling)
    assert all(set(t.token_versions) == {rt.weight_version} for g in rollout.groups for t in g)
    seqs = make_sequences(rollout.prompts, rollout.groups)
    chunks, order = plan_forward_only(seqs, world_size=len(rt.trainers), micro_batch_size=8)
    per_rank = ray.get([tr.compute_logprobs.remote(c) for tr, c in zip(rt.trainers, chunks)])
    trainer = {i: lp for idx, rank in zip(order, per_rank) for i, lp in zip(idx, rank)}
    diffs = np.concatenate([np.abs(np.asarray(trainer[i]) - np.asarray(s.behaviour_logprobs)) for i, s in enumerate(seqs)])
    assert diffs.size >= 8 * 4 and diffs.mean() <= 1e-4, diffs.mean()
    # the reload session's "Failed to load weights" lines for modules without checkpoint weights
    # (rotary tables) are dropped as in apply_weights (mmrl/rollout/vllm_logs.py)
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    assert not any("Failed to load weights" in f.read_text(errors="replace")
                   for f in logs.glob("worker-*") if f.suffix in (".out", ".err"))
    print(f"collective to 2 engines: first sync {first_s:.3f} s (group formed), next {again_s:.3f} s; "
          f"parity mean|d| {diffs.mean():.2e}")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_frozen_request_continues_under_the_new_weights(runtime, colors_samples: list) -> None:
    """partial=keep, recompute_kv=True: the update pauses the engine with the request in flight;
    after the collective sync its later tokens carry the new version and match the new weights."""
    from mmrl.rollout.types import RequestSampling

    rt = runtime
    engine = rt.engines[1]
    ray.get([e.configure.remote(partial="keep", recompute_kv=True) for e in rt.engines])
    _train_one_step(rt, colors_samples[12:16], seed=2)
    prompt = rt.processor(colors_samples[20])
    long = RequestSampling(max_tokens=200, ignore_eos=True, seed=11, forbidden_token_ids=rt.sampling.forbidden_token_ids)
    ref = engine.generate.remote(prompt.vllm_input, long)
    deadline = time.monotonic() + 600  # a bound against a hang, not a timing condition
    while not any(n >= 8 for n in ray.get(engine.progress.remote()).values()):
        assert time.monotonic() < deadline, "the engine generated nothing"
        time.sleep(0.01)
    ray.get(engine.pause.remote())  # frozen mid-generation; the sync's own pause keeps it so
    old_version = rt.weight_version
    result = _sync(rt, rt.engines, "collective")
    completion = ray.get(ref, timeout=600)
    assert result["engine_staged_tensors"] == 0
    versions = np.asarray(completion.token_versions)
    assert len(completion.token_ids) == 200 and set(versions.tolist()) == {old_version, rt.weight_version}
    new = versions == rt.weight_version
    diffs = _trainer_diffs(rt, prompt, completion.token_ids, completion.logprobs)
    assert diffs[new].max() <= 1e-4, diffs[new].max()
    assert diffs[~new].mean() > 1e-2, "control: tokens before the update are the old policy's"
