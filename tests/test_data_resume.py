"""The exact resume cursor: stop after k samples, rebuild the stream from `state_dict()`, and the
concatenation equals the uninterrupted run -- same keys, same order -- for num_workers 0, 1, 2
with a shuffle buffer, across an epoch boundary, with bad samples, resampling and node splits."""
from __future__ import annotations

import json

import pytest
from _data_media import image_bytes, js, write_tar

import mmrl.data.stream as stream_mod
from mmrl.data.stream import ShardStream

SHARD_SIZES = [7, 11, 5, 13, 9]  # uneven, so streams end at different times
N_GOOD = sum(SHARD_SIZES)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    png = image_bytes(size=(8, 8))
    urls, i = [], 0
    for s, size in enumerate(SHARD_SIZES):
        samples = []
        for _ in range(size):
            members = {"json": js(prompt=f"p{i}", answer=i)}
            if i % 3 == 0:
                members["png"] = png
            samples.append((f"s{i:03d}", members))
            i += 1
        if s == 1:  # a bad sample in the middle of one shard
            samples.insert(4, ("broken", {"json": b"{not json"}))
        urls.append(write_tar(out / f"r-{s:06d}.tar", samples))
    return urls


def keys(stream: ShardStream, n: int | None = None) -> list[str]:
    if n is None:
        return [s.key for s in stream]
    return [s.key for s in stream.take(n)]


CONFIGS = {
    "w0": dict(num_workers=0, shuffle_buffer=6),
    "w1": dict(num_workers=1, shuffle_buffer=6),
    "w2": dict(num_workers=2, shuffle_buffer=6),
    "w2-resample": dict(num_workers=2, shuffle_buffer=4, resample=True),
    "w2-rank1of2": dict(num_workers=2, shuffle_buffer=3, rank=1, world_size=2),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_resume_continues_exactly(shards, name):
    kw = dict(CONFIGS[name], seed=3, epochs=2)
    uninterrupted = ShardStream(shards, **kw)
    full = keys(uninterrupted)
    per_epoch = len(full) // 2
    if "rank" not in kw and not kw.get("resample"):
        assert sorted(full[:per_epoch]) == sorted(full[per_epoch:]) and per_epoch == N_GOOD
    assert full[:per_epoch] != full[per_epoch:]  # epochs are reshuffled
    for k in (5, per_epoch, per_epoch + 3):  # mid-epoch, exactly at the boundary, in epoch 2
        first = ShardStream(shards, **kw)
        head = keys(first, k)
        state = json.loads(json.dumps(first.state_dict()))  # it must survive a checkpoint file
        first.close()
        resumed = ShardStream(shards, **kw, resume=state)
        tail = keys(resumed)
        assert head + tail == full, f"k={k}"
        assert resumed.delivered == len(full)
        assert resumed.bad_counts == uninterrupted.bad_counts  # counted once, across the restart


def test_resume_skips_before_decoding(shards, monkeypatch):
    """Samples delivered before the restart are dropped as raw bytes, never decoded again."""
    kw = dict(num_workers=0, shuffle_buffer=6, seed=1, epochs=1)
    decoded = []
    real = stream_mod.decode_sample
    monkeypatch.setattr(stream_mod, "decode_sample", lambda raw, options: decoded.append(raw["__key__"])
                        or real(raw, options))
    first = ShardStream(shards, **kw)
    head = keys(first, 20)
    state = first.state_dict()
    first.close()
    decoded.clear()
    tail = keys(ShardStream(shards, **kw, resume=state))
    assert len(head) + len(tail) == N_GOOD
    assert set(decoded) - {"broken"} == set(tail) and len(decoded) <= len(tail) + 1


def test_state_carries_counts_and_rejects_another_layout(shards, tmp_path):
    kw = dict(num_workers=0, shuffle_buffer=6, seed=1)  # endless
    stream = ShardStream(shards, **kw)
    assert stream.state_dict()["epoch"] == 0 and stream.state_dict()["consumed"] == [0]
    stream.take(2 * N_GOOD + 4)
    state = stream.state_dict()
    stream.close()
    assert state["epoch"] == 2 and state["delivered"] == 2 * N_GOOD + 4
    assert state["quarantine"]["counts"] == {"bad_json": 2}  # one bad sample per epoch
    # num_workers 0 and 1 are the same single stream; 2 is a different order
    same = ShardStream(shards, **dict(kw, num_workers=1), resume=state)
    assert same.bad_counts == {"bad_json": 2} and same.delivered == 2 * N_GOOD + 4
    for change in (dict(num_workers=2), dict(seed=2), dict(shuffle_buffer=7)):
        with pytest.raises(ValueError, match="resume state does not fit") as e:
            ShardStream(shards, **dict(kw, **change), resume=state)
        layout_key = {"num_workers": "streams"}.get(next(iter(change)), next(iter(change)))
        assert f"{layout_key}: state" in str(e.value)
    with pytest.raises(ValueError, match="resume state does not fit"):
        ShardStream(shards[:4], **kw, resume=state)
    # load_state_dict on a live stream restarts take() from the state
    stream = ShardStream(shards, **kw)
    ref = keys(ShardStream(shards, **kw, resume=state), 5)
    stream.take(3)
    stream.load_state_dict(state)
    assert keys(stream, 5) == ref
    stream.close()
