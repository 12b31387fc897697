"""Samples -> processed prompts, with every per-sample failure quarantined.

The processor runs in the rollout workers (rollout/workers.py) on samples the loader workers
already checked (decoding and the processor's declared `media_limits`). Whatever it still
refuses or fails on -- `PromptRejected`, or any other exception a real processor raises on an
odd input -- costs that sample only: `processors.process_sample` turns it into a `BadSample`; the driver's
`SampleBatches.record_failure` writes it to the quarantine report with its key, shard and the
error text, counts it in `data/bad_samples` and against `data.max_bad_ratio`, and the slot is
refilled from the stream. A processor that fails on every sample it has seen is the
configuration, not the data: after `MAX_FAILURES_BEFORE_FIRST_SUCCESS` such samples the run
stops with `ProcessorFailing`.
"""
from __future__ import annotations

from typing import Any, Iterator

from mmrl.data.quarantine import BadSample
from mmrl.data.sample import Sample

MAX_FAILURES_BEFORE_FIRST_SUCCESS = 16


class ProcessorFailing(RuntimeError):
    """The processor failed on each of the first samples of a run and never succeeded."""


class SampleBatches:
    """Batches of samples from the training stream, and the ledger of the ones the processor
    refused: `batches()` gives `size` samples, `batches.refill()` one more for a refused slot."""

    def __init__(self, stream: Any, size: int, processor_name: str = "", model_path: str = ""):
        self.stream, self.size = stream, size
        self.processor_name, self.model_path = processor_name, model_path
        self.rejected: set[str] = set()
        self._it: Iterator[Sample] | None = None
        self._succeeded = False
        self._failures_before_success: list[BadSample] = []

    def __call__(self) -> list[Sample]:
        return [self.refill() for _ in range(self.size)]

    def refill(self) -> Sample:
        if self._it is None:
            self._it = iter(self.stream)
        return next(self._it)

    def record_success(self) -> None:
        self._succeeded = True

    def record_failure(self, bad: BadSample) -> None:
        """Quarantine a sample the processor refused (it was delivered as good: not counted twice)."""
        self.rejected.add(bad.key)
        self.stream.quarantine.record_bad(bad, already_counted=True)
        if self._succeeded:
            return
        self._failures_before_success.append(bad)
        if len(self._failures_before_success) >= MAX_FAILURES_BEFORE_FIRST_SUCCESS:
            first = self._failures_before_success[0]
            raise ProcessorFailing(
                f"the processor ({self.processor_name} for model {self.model_path or '?'}) failed on each of "
                f"the first {len(self._failures_before_success)} samples and on none succeeded, so the cause is "
                f"the model or processor configuration rather than the data. First failure ({first.reason}) "
                f"on sample {first.key!r}: {first.detail}. Check model.path, processor.name and the "
                f"processor.* settings (e.g. processor.max_prompt_tokens).")

    def rewind(self, cursor: dict[str, Any]) -> None:
        """Continue from a checkpoint's cursor (replay the batches since it)."""
        self.stream.load_state_dict(cursor)
        self._it = None
