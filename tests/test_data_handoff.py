"""Worker -> main hand-off (mmrl/data/handoff.py): pixels through a shared-memory ring, pixel-exact,
slots freed, the pickle fallback when no slot is free or a chunk is too big, and no ring file left
behind by a real multi-worker epoch."""
from __future__ import annotations

import glob
import multiprocessing
import os
import pickle

import numpy as np
import pytest
from PIL import Image

from mmrl.data.handoff import PixelRing, RingChunk, _shm_dir, pack, pixel_nbytes, remove_orphan_rings, unpack
from mmrl.plugins.data.recipes.colors import build
from mmrl.data.sample import Sample, Video
from mmrl.data.stream import ShardStream


def _sample(seed: int, size: tuple[int, int] = (37, 23)) -> Sample:
    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(2)]
    frames = rng.integers(0, 256, (4, 6, 10, 3), dtype=np.uint8)
    video = Video(frames=frames, fps=2.0, frame_indices=[0, 1, 2, 3], source_fps=4.0, total_num_frames=8)
    return Sample(key=f"k{seed}", messages=[], images=images, videos=[video])


def _pixels(sample: Sample) -> list[np.ndarray]:
    return [np.asarray(im) for im in sample.images] + [np.asarray(v.frames) for v in sample.videos]


@pytest.fixture
def rings():
    made = []

    def make(**kw):
        ring = PixelRing.create(multiprocessing.get_context("fork"), **kw)
        made.append(ring)
        return ring, PixelRing(ring.handle)  # the main side and the worker side of one file

    yield make
    for ring in made:
        ring.close(unlink=True)


def test_round_trip_is_pixel_exact_and_frees_the_slot(rings) -> None:
    main, worker = rings(slots=2, slot_bytes=1 << 20)
    originals = [_sample(i) for i in range(3)]
    expected = [_pixels(s) for s in originals]
    chunk = [originals[0], (originals[1], {"key": "k1"}), originals[2]]  # a profiling pair travels too
    assert sum(pixel_nbytes(x) for x in chunk) == 3 * (2 * 37 * 23 * 3 + 4 * 6 * 10 * 3)
    packed = pack(chunk, worker)
    assert isinstance(packed, RingChunk) and packed.slot == 0
    wire = pickle.loads(pickle.dumps(packed))  # what crosses the pipe: placeholders, not pixels
    assert len(pickle.dumps(packed)) < 2 * 37 * 23 * 3
    items = unpack(wire, main)
    got = [items[0], items[1][0], items[2]]
    for sample, want in zip(got, expected):
        assert all(g.dtype == np.uint8 and np.array_equal(g, w) for g, w in zip(_pixels(sample), want))
        assert all(im.mode == "RGB" and im.size == (37, 23) for im in sample.images)
    # the slot was released: two more chunks fit without waiting, the third is pickled instead
    assert isinstance(pack([_sample(5)], worker), RingChunk)
    assert isinstance(pack([_sample(6)], worker), RingChunk)
    assert isinstance(pack([_sample(7)], worker), list)


def test_chunks_too_big_for_a_slot_or_without_pixels_are_pickled(rings) -> None:
    _, worker = rings(slots=2, slot_bytes=4096)
    big = _sample(0, size=(64, 64))
    assert pack([big], worker) == [big] and isinstance(big.images[0], Image.Image)
    assert pack(["not a sample"], worker) == ["not a sample"]
    assert pack([_sample(1)], None)[0].images[0].size == (37, 23)  # no ring (in-process path)


def test_multi_worker_epoch_matches_in_process_and_cleans_up(tmp_path) -> None:
    info = build(str(tmp_path), train_size=300, heldout_size=4, shard_size=50, seed=3, image_format="jpg")
    shards = os.path.join(tmp_path, info["shards"]["train"])
    before = set(glob.glob(os.path.join(_shm_dir(), "mmrl-ring-*")))
    direct = {s.key: np.asarray(s.images[0]) for s in ShardStream(shards, epochs=1, num_workers=0)}
    via_workers = {s.key: np.asarray(s.images[0]) for s in ShardStream(shards, epochs=2, num_workers=2)}
    assert direct.keys() == via_workers.keys() and len(direct) == 300
    assert all(np.array_equal(direct[k], via_workers[k]) for k in direct)
    assert set(glob.glob(os.path.join(_shm_dir(), "mmrl-ring-*"))) == before  # every epoch's rings unlinked


def test_rings_of_killed_processes_are_removed(tmp_path) -> None:
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = os.path.join(_shm_dir(), f"mmrl-ring-{int(dead.stdout)}-feedface0000")
    mine = os.path.join(_shm_dir(), f"mmrl-ring-{os.getpid()}-feedface0001")
    for path in (orphan, mine):
        open(path, "wb").close()
    try:
        assert remove_orphan_rings() >= 1
        assert not os.path.exists(orphan) and os.path.exists(mine)  # a live process keeps its rings
    finally:
        for path in (orphan, mine):
            if os.path.exists(path):
                os.unlink(path)
