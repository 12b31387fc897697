"""What rollout produces."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingConfig:
    """Sampling settings shared by the rollout engines and the trainer's logprob recompute: the
    trainer must apply the same temperature and token bans to compare logprobs with vLLM."""

    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    forbidden_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    greedy: bool = False

    def for_requests_from(self, first: int) -> "SamplingConfig":
        """The settings for a generate call whose first request is the step's request `first`:
        a seeded step gives every request of the step its own seed, however the requests are
        split into calls and engines (RolloutEngine.generate adds the position in the call)."""
        if self.seed is None or first == 0:
            return self
        from dataclasses import replace

        from mmrl.rollout.engine import SEED_STRIDE

        return replace(self, seed=self.seed + first * SEED_STRIDE)


@dataclass
class Completion:
    """One sampled response, as the engine returns it."""

    token_ids: list[int]
    logprobs: list[float]  # behaviour logprobs of the sampled tokens
    text: str
    finish_reason: str | None


@dataclass
class Trajectory:
    """One response to one prompt, with what the trainer and the logs need."""

    prompt_index: int  # index of the prompt in the step's batch (the group id)
    response_ids: list[int]
    behaviour_logprobs: list[float]
    loss_mask: list[int]  # 1 for tokens the policy generated and is trained on
    text: str
    finish_reason: str | None
    weight_version: int
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
