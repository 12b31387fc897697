"""How decoded samples cross from a loader worker to the main process.

Whatever a DataLoader worker yields is pickled, written to a pipe, read back and unpickled. For
pixels that is the expensive part, and the main process pays for it on the cores the workers
decode on: a 224x224 RGB image is 150 kB; pickling it through the pipe cost about a third of
its JPEG decode. So:

  images  each worker owns a ring of a few slots in a shared-memory file (created per epoch by
          the main process). A worker copies a chunk's pixels into its next free slot in PIL's own
          4-bytes-per-pixel layout (read through Pillow's Arrow export: no packing to RGB), and
          sends only sizes and offsets; the main process copies each image out of the slot (the
          one copy a PIL image needs) and frees the slot. A counting semaphore per ring says how
          many slots are free: no worker ever waits for one -- with none free, or a chunk too
          large for a slot, the chunk is pickled as before.
  videos  frames go as torch tensors, which torch moves through shared memory (one segment per
          video; a video's decode costs far more than making the segment), and stay numpy views
          in the main process.

benchmarks/data_pipeline.py measures the result against the decode-only bound.
"""
from __future__ import annotations

import glob
import mmap
import os
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from mmrl.data.sample import Sample

RING_SLOTS = 4  # a worker has at most ~prefetch_factor chunks in flight
SLOT_BYTES = 64 << 20  # virtual size: only pages that pixels touch take memory
_ALIGN = 64

try:
    import pyarrow as _ARROW
except ImportError:  # pragma: no cover - pyarrow is a dependency; the copy path still works
    _ARROW = None


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def remove_orphan_rings() -> int:
    """Delete ring files whose creating process is gone (it was killed before its clean-up ran)."""
    removed = 0
    for path in glob.glob(os.path.join(_shm_dir(), "mmrl-ring-*-*")):
        pid = os.path.basename(path).split("-")[2]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            os.unlink(path)
            removed += 1
        except OSError:  # another user's file, or already gone
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


@dataclass
class RingHandle:
    """What a worker needs to open its ring (picklable into DataLoader workers at start-up)."""

    path: str
    slots: int
    slot_bytes: int
    free: Any  # multiprocessing Semaphore: free slots


class PixelRing:
    """One worker's slots; the same file mapped in the worker and in the main process."""

    def __init__(self, handle: RingHandle, create: bool = False):
        self.handle = handle
        size = handle.slots * handle.slot_bytes
        fd = os.open(handle.path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)  # sparse: costs nothing until written
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.flat = np.frombuffer(self._map, dtype=np.uint8)
        self.next_slot = 0

    @classmethod
    def create(cls, context: Any, slots: int = RING_SLOTS, slot_bytes: int = SLOT_BYTES) -> "PixelRing":
        remove_orphan_rings()
        path = os.path.join(_shm_dir(), f"mmrl-ring-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        return cls(RingHandle(path, slots, slot_bytes, context.Semaphore(slots)), create=True)

    def slot(self, index: int) -> np.ndarray:
        start = index * self.handle.slot_bytes
        return self.flat[start:start + self.handle.slot_bytes]

    def close(self, unlink: bool = False) -> None:
        del self.flat
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass
        if unlink:
            try:
                os.unlink(self.handle.path)
            except FileNotFoundError:
                pass


class _RingImage:
    """Placeholder for an RGB image at [offset, offset + w*h*4) of the chunk's slot (RGBX layout)."""

    __slots__ = ("size", "offset")

    def __init__(self, size: tuple[int, int], offset: int):
        self.size, self.offset = size, offset


class RingChunk:
    """A chunk whose images wait in slot `slot` of the sending worker's ring."""

    __slots__ = ("items", "slot")

    def __init__(self, items: list[Any], slot: int):
        self.items, self.slot = items, slot


def _rgbx(image: Image.Image) -> np.ndarray:
    """An RGB image's pixels as PIL holds them, 4 bytes per pixel (R, G, B, padding): a view of the
    image's own memory through Pillow's Arrow export (no copy, no packing to 3 bytes), or a copy
    in the same layout where the export is unavailable (older Pillow, an image in several blocks)."""
    if _ARROW is not None and hasattr(image, "__arrow_c_array__"):
        try:
            return _ARROW.array(image).values.to_numpy(zero_copy_only=True)
        except (ValueError, TypeError, _ARROW.ArrowException):
            pass
    return np.frombuffer(image.tobytes("raw", "RGBX"), dtype=np.uint8)


def _sample_of(item: Any) -> Any:
    return item[0] if type(item) is tuple else item  # profiling sends (item, timings) pairs


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def pixel_nbytes(item: Any) -> int:
    """Bytes of decoded pixels an item carries (images as RGB, video frames)."""
    sample = _sample_of(item)
    if not isinstance(sample, Sample):
        return 0
    return sum(im.width * im.height * 3 for im in sample.images) + sum(v.frames.nbytes for v in sample.videos)


def pack(chunk: list[Any], ring: PixelRing | None) -> RingChunk | list[Any]:
    """In the worker: video frames to torch tensors; images into the ring's next slot when one is
    free and the chunk fits, else they are pickled with the chunk."""
    images: list[tuple[Sample, int]] = []
    total = 0
    for item in chunk:
        sample = _sample_of(item)
        if not isinstance(sample, Sample):
            continue
        if sample.videos:
            import torch
            for video in sample.videos:
                video.frames = torch.from_numpy(np.ascontiguousarray(video.frames))
        for i, image in enumerate(sample.images):
            if image.mode == "RGB":  # decode_sample converts everything to RGB; anything else pickles
                images.append((sample, i))
                total += _aligned(image.width * image.height * 4)
    if ring is None or not images or total > ring.handle.slot_bytes or not ring.handle.free.acquire(False):
        return chunk
    index = ring.next_slot
    ring.next_slot = (index + 1) % ring.handle.slots  # slots are freed in the order they were sent
    slot, offset = ring.slot(index), 0
    for sample, i in images:
        image = sample.images[i]
        pixels = _rgbx(image)
        slot[offset:offset + pixels.size] = pixels
        sample.images[i] = _RingImage(image.size, offset)
        offset += _aligned(pixels.size)
    return RingChunk(chunk, index)


def unpack(packed: RingChunk | list[Any], ring: PixelRing | None) -> list[Any]:
    """In the main process: the chunk's items with real images and numpy frames again; the
    chunk's slot is free afterwards."""
    items = packed.items if isinstance(packed, RingChunk) else packed
    slot = ring.slot(packed.slot) if isinstance(packed, RingChunk) and ring is not None else None
    for item in items:
        sample = _sample_of(item)
        if not isinstance(sample, Sample):
            continue
        for video in sample.videos:
            if not hasattr(video.frames, "__array_interface__"):
                video.frames = video.frames.numpy()
        if slot is None:
            continue
        for i, image in enumerate(sample.images):
            if isinstance(image, _RingImage):
                w, h = image.size
                rebuilt = Image.new("RGB", (w, h), None)  # no fill: every pixel is written next
                rebuilt.frombytes(memoryview(slot[image.offset:image.offset + w * h * 4]), "raw", "RGBX")
                sample.images[i] = rebuilt
    if slot is not None:
        ring.handle.free.release()
    return items
