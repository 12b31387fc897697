"""Samples -> processed prompts for a run, with every per-sample failure quarantined.

The processor runs in the driver on samples the loader workers already checked (decoding and the
processor's declared `media_limits`). Whatever it still refuses or fails on -- `PromptRejected`,
or any other exception a real processor raises on an odd input -- costs that sample only: it is
written to the quarantine report with its key, shard and the error text, counted in
`data/bad_samples` and against `data.max_bad_ratio`, and the batch is refilled from the stream.
A processor that fails on every sample it has seen is the configuration, not the data: after
`MAX_FAILURES_BEFORE_FIRST_SUCCESS` such samples the run stops with `ProcessorFailing`.
"""
from __future__ import annotations

import logging
from typing import Any, Iterator

from mmrl.data.quarantine import BadSample, QuarantineLedger
from mmrl.data.sample import Sample
from mmrl.processors.base import ProcessedPrompt, PromptRejected

logger = logging.getLogger(__name__)

Pair = tuple[Sample, ProcessedPrompt]
MAX_FAILURES_BEFORE_FIRST_SUCCESS = 16


class ProcessorFailing(RuntimeError):
    """The processor failed on each of the first samples of a run and never succeeded."""


def process_samples(processor: Any, samples: list[Sample], rejected: set[str],
                    ledger: QuarantineLedger | None = None) -> tuple[list[Pair], list[BadSample]]:
    """Process samples one by one. Returns the (sample, prompt) pairs that succeeded and the failures
    as `BadSample`s (reason `prompt_rejected` or `processor_error`); each failure's key goes into
    `rejected` and, with a ledger (the training stream's), into the quarantine report."""
    pairs: list[Pair] = []
    failures: list[BadSample] = []
    for sample in samples:
        try:
            pairs.append((sample, processor(sample)))
        except Exception as e:  # noqa: BLE001 -- any per-sample failure costs that sample only
            if isinstance(e, PromptRejected):
                bad = BadSample("prompt_rejected", sample.key, sample.source, str(e))
            else:
                bad = BadSample("processor_error", sample.key, sample.source, f"{type(e).__name__}: {e}")
            failures.append(bad)
            rejected.add(sample.key)
            if ledger is not None:  # the sample was delivered as good: do not count it as read twice
                ledger.record_bad(bad, already_counted=True)
            else:
                logger.warning("skipping sample %r (%s): %s", bad.key, bad.reason, bad.detail)
    return pairs, failures


class PromptBatches:
    """Full batches of processed prompts from the training stream: a sample the processor refuses
    is quarantined and replaced by the next one, so every step gets `size` prompts."""

    def __init__(self, stream: Any, processor: Any, size: int):
        self.stream, self.processor, self.size = stream, processor, size
        self.rejected: set[str] = set()
        self._it: Iterator[Sample] | None = None
        self._succeeded = False
        self._failures_before_success: list[BadSample] = []

    def __call__(self) -> list[Pair]:
        if self._it is None:
            self._it = iter(self.stream)
        pairs: list[Pair] = []
        while len(pairs) < self.size:
            samples = [next(self._it) for _ in range(self.size - len(pairs))]
            new, failures = process_samples(self.processor, samples, self.rejected, self.stream.quarantine)
            pairs += new
            self._check_not_systematic(bool(new), failures)
        return pairs

    def _check_not_systematic(self, any_success: bool, failures: list[BadSample]) -> None:
        self._succeeded = self._succeeded or any_success
        if self._succeeded:
            return
        self._failures_before_success += failures
        if len(self._failures_before_success) >= MAX_FAILURES_BEFORE_FIRST_SUCCESS:
            first = self._failures_before_success[0]
            raise ProcessorFailing(
                f"the processor ({type(self.processor).__name__} for model "
                f"{getattr(self.processor, 'model_path', '?')}) failed on each of the first "
                f"{len(self._failures_before_success)} samples and on none succeeded, so the cause is "
                f"the model or processor configuration rather than the data. First failure ({first.reason}) "
                f"on sample {first.key!r}: {first.detail}. Check model.path, processor.name and the "
                f"processor.* settings (e.g. processor.max_prompt_tokens).")

    def rewind(self, cursor: dict[str, Any]) -> None:
        """Continue from a checkpoint's cursor (replay the batches since it)."""
        self.stream.load_state_dict(cursor)
        self._it = None
