"""The proxy's exact-prefix bookkeeping on its own (rollout/proxy.py::TrajectoryRecord): what the
trainer keeps when a request does not extend the recorded tokens and cannot be spliced. The
engine path (splice, real engine and trainer) is tests/test_parity.py::test_an_openai_client_agent_..."""
from mmrl.rollout.proxy import TrajectoryRecord


def _record() -> TrajectoryRecord:
    rec = TrajectoryRecord(prompt_ids=[1, 2, 3])
    rec._append([10, 11], 1, [-0.5, -0.6], [0, 0])   # the model's first answer
    rec._append([20], 0)                              # a tool turn
    return rec


def test_a_rewritten_history_keeps_the_common_prefix_and_continues_with_what_the_engine_sees() -> None:
    rec = _record()
    rec.rebase([1, 2, 3, 10, 99, 98], [])
    assert rec.prompt_ids == [1, 2, 3]
    assert rec.response_ids == [10, 99, 98] and rec.loss_mask == [1, 0, 0]
    assert rec.logprobs == [-0.5, 0.0, 0.0] and rec.versions == [0, -1, -1] and rec.drift_flagged == 1


def test_a_new_first_prompt_starts_the_record_over() -> None:
    rec = _record()
    rec.rebase([1, 7, 8], ["img"])
    assert rec.prompt_ids == [1, 7, 8] and rec.prompt_images == ["img"]
    assert rec.response_ids == rec.loss_mask == rec.logprobs == rec.versions == []
