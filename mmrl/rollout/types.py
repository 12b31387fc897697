"""What rollout produces, and the settings one request is sampled with."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

# Seed spacing between the trajectories of one step: more than any group size, so no two
# trajectories share a seed (a trajectory's group member j draws with seed + j).
SEED_STRIDE = 4096
# Seed spacing between the engine requests of one trajectory (turns, template holes, proxy calls):
# a multiple of SEED_STRIDE and another prime than `continued`'s, so no call's seed is another
# trajectory's or a resubmission's.
CALL_SEED_STRIDE = 7907 * SEED_STRIDE


@dataclass
class SamplingConfig:
    """Sampling settings of a rollout, shared by the rollout engines and the trainer's logprob
    recompute: the trainer must apply the same temperature and token bans to compare logprobs
    with vLLM. `seed` is the step's seed (None: the engine's own RNG)."""

    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    forbidden_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    greedy: bool = False
    # Generate max_new_tokens every time (benchmarks with set lengths; tests that need a long generation).
    ignore_eos: bool = False

    def for_trajectory(self, slot: int, member: int, key: str = "") -> "RequestSampling":
        """The settings of group member `member` of the step's prompt `slot`: seed + slot *
        SEED_STRIDE + member, the same draws vLLM gives an n-sample request seeded seed + slot *
        SEED_STRIDE, whichever engine or worker runs it and whatever runs beside it."""
        seed = None if self.seed is None else self.seed + slot * SEED_STRIDE + member
        return RequestSampling(max_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                               forbidden_token_ids=list(self.forbidden_token_ids), seed=seed, greedy=self.greedy,
                               ignore_eos=self.ignore_eos, request_key=f"{key or slot}.{member}")


@dataclass
class RequestSampling:
    """How one engine request is sampled (one response). An agent loop may change any field for
    a later turn (e.g. `max_tokens`, `stop`) with `dataclasses.replace`."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    forbidden_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    greedy: bool = False
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    # Names the trajectory in engine request ids (abort, logs); the router sticks a key to one engine.
    request_key: str = ""

    def for_call(self, call: int) -> "RequestSampling":
        """The settings for a trajectory's `call`-th engine request (0 = the first, unchanged): its
        own seed. A seeded engine request draws from a generator seeded afresh, so calls sharing
        a seed would draw the same numbers for their first tokens: a later turn's choice would
        follow the first turn's instead of the policy's distribution that its logprobs describe."""
        if self.seed is None or call == 0:
            return self
        return replace(self, seed=self.seed + call * CALL_SEED_STRIDE)

    def continued(self, done_tokens: int, attempt: int) -> "RequestSampling":
        """The settings to resubmit a request aborted after `done_tokens` tokens: the rest of the
        token budget, and a different seed (a replayed seed would redraw the first tokens' numbers)."""
        seed = None if self.seed is None else self.seed + attempt * 7919 * SEED_STRIDE
        return replace(self, max_tokens=self.max_tokens - done_tokens, seed=seed)


@dataclass
class Completion:
    """One sampled response, as the engine returns it."""

    token_ids: list[int]
    logprobs: list[float]  # behaviour logprobs of the sampled tokens
    text: str
    finish_reason: str | None
    token_versions: list[int] = field(default_factory=list)  # the weight version that sampled each token
    # MoE models: (len(token_ids), MoE layers, top-k) int16, the experts each layer routed the
    # forward that sampled each token to (routing replay, rollout/routing_capture.py); else None
    routed_experts: Any = None


def join_routing(parts: list[tuple[Any, int]]) -> Any:
    """One (sum n, layers, k) record from (record or None, n tokens) pieces, -1 rows where a
    piece has none (tokens a loop inserted, an engine that recorded nothing); None if no piece has one."""
    import numpy as np

    shape = next((r.shape[1:] for r, _ in parts if r is not None), None)
    if shape is None:
        return None
    return np.concatenate([r if r is not None else np.full((n, *shape), -1, dtype=np.int16) for r, n in parts])


@dataclass
class Trajectory:
    """One response to one prompt, with what the trainer and the logs need.

    For a multi-turn trajectory `response_ids` holds every token after the prompt (model turns,
    tool outputs, templates); `loss_mask` is 1 on the tokens the policy sampled, and
    `behaviour_logprobs` / `token_versions` are only meaningful there (0 / -1 elsewhere)."""

    prompt_index: int  # index of the prompt in the step's batch (the group id)
    response_ids: list[int]
    behaviour_logprobs: list[float]
    loss_mask: list[int]  # 1 for tokens the policy generated and is trained on
    text: str
    finish_reason: str | None
    weight_version: int  # the OLDEST weight version among the sampled tokens (staleness is measured from it)
    token_versions: list[int] = field(default_factory=list)
    # MoE models: (len(response_ids), MoE layers, top-k), -1 rows on tokens the policy did not
    # sample (see Completion.routed_experts); the trainer replays it (algorithm.routing_replay)
    routed_experts: Any = None
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    # Multi-turn loops: the turns as the rewards see them, the tools' final state, counters
    # (turns, tool calls, errors) that become step metrics.
    transcript: list[dict[str, Any]] = field(default_factory=list)
    tool_state: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    # Media that entered after the prompt (a tool's image), in the engine's format; the rollout
    # worker turns them into `response_inputs` and drops them before the trajectory travels.
    new_media: dict[str, list[Any]] = field(default_factory=dict)
    # Reference to the trainer inputs of the response when it holds media (`ResponseInputs`).
    response_inputs: Any = None
    # A loop whose first request was not the sample's prompt (an OpenAI-client agent with its
    # own system prompt) sets its engine prompt here; the worker turns it into `prompt_ref`,
    # which the trainer uses instead of the group's prompt.
    own_prompt: dict[str, Any] | None = None
    prompt_ref: Any = None


@dataclass
class ResponseInputs:
    """The trainer side of a response that contains media (a tool returned an image): the
    positions of its tokens (vision blocks expanded) and the vision tensors of its media only.
    Kept in the rollout worker's object store; the trainer ranks fetch it."""

    positions_AT: Any
    mm_inputs: dict[str, Any]
