"""From trajectories to padded tensors for the training forward.

Layout of a micro-batch: prompts are LEFT-padded and responses RIGHT-padded, so every row's
response starts at the same column P. The model then only projects the hidden states of the
response columns to vocabulary logits (`logits_to_keep`), which keeps the logits tensor at
(B, T, V) instead of (B, P+T, V).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from mmrl.algorithms.losses import entropy_from_logprobs
from mmrl.processors.base import ProcessedPrompt, PromptRef


@dataclass
class TrainSequence:
    """One prompt + one response, with everything the loss needs. Small and picklable: it is
    what crosses the process boundary from the controller to a trainer rank. A prompt sent by
    reference (`prompt_ref`) has empty prompt fields until `resolve_prompts` fills them on the rank."""

    prompt_ids: list[int]
    position_ids_3P: torch.Tensor
    next_position: int
    mm_inputs: dict[str, torch.Tensor]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    loss_mask: list[int]
    advantage: float = 0.0
    # Filled by the logprob pass when needed: pi_old before the first update (several updates per
    # batch) and the reference policy (KL). None = not computed.
    old_logprobs: list[float] | None = None
    ref_logprobs: list[float] | None = None
    extras: dict[str, float] = field(default_factory=dict)
    prompt_ref: PromptRef | None = None
    uid: int = -1  # names the sequence to the trainer ranks (logprobs they keep for it)

    @property
    def prompt_length(self) -> int:
        """Prompt tokens (vision placeholder tokens included), known before the prompt is resolved."""
        return self.prompt_ref.num_tokens if self.prompt_ref is not None else len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Rows of the forward: prompt + response."""
        return self.prompt_length + len(self.response_ids)

    @classmethod
    def from_prompt(cls, prompt: ProcessedPrompt | PromptRef, response_ids: list[int], behaviour_logprobs: list[float],
                    loss_mask: list[int], advantage: float = 0.0) -> "TrainSequence":
        if isinstance(prompt, PromptRef):
            return cls(prompt_ids=[], position_ids_3P=torch.zeros((3, 0), dtype=torch.long), next_position=0,
                       mm_inputs={}, response_ids=response_ids, behaviour_logprobs=behaviour_logprobs,
                       loss_mask=loss_mask, advantage=advantage, prompt_ref=prompt)
        return cls(prompt_ids=prompt.prompt_ids, position_ids_3P=prompt.position_ids_3P,
                   next_position=prompt.next_position, mm_inputs=prompt.mm_inputs, response_ids=response_ids,
                   behaviour_logprobs=behaviour_logprobs, loss_mask=loss_mask, advantage=advantage)


def resolve_prompts(seqs: Sequence[TrainSequence]) -> None:
    """Fetch the prompts sent by reference (one fetch per distinct prompt: a group's sequences
    share it) and fill their fields; on the trainer rank, before the forward."""
    pending = [s for s in seqs if s.prompt_ref is not None and not s.prompt_ids]
    if not pending:
        return
    import ray

    refs: dict[Any, Any] = {}
    for s in pending:
        refs.setdefault(s.prompt_ref.ref, None)  # type: ignore[union-attr]
    for ref, prompt in zip(refs, ray.get(list(refs))):
        refs[ref] = prompt
    for s in pending:
        p = refs[s.prompt_ref.ref]  # type: ignore[union-attr]
        s.prompt_ids, s.position_ids_3P, s.next_position, s.mm_inputs = \
            p.prompt_ids, p.position_ids_3P, p.next_position, p.mm_inputs


@dataclass
class MicroBatch:
    input_ids_BL: torch.Tensor
    attention_mask_BL: torch.Tensor
    position_ids_3BL: torch.Tensor
    mm_inputs: dict[str, torch.Tensor]
    response_ids_BT: torch.Tensor
    mask_BT: torch.Tensor
    behaviour_logprobs_BT: torch.Tensor
    old_logprobs_BT: torch.Tensor | None
    ref_logprobs_BT: torch.Tensor | None
    advantages_B: torch.Tensor
    logits_to_keep: torch.Tensor  # columns whose logits predict the response tokens

    def model_inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids_BL, "attention_mask": self.attention_mask_BL,
                "position_ids": self.position_ids_3BL, "logits_to_keep": self.logits_to_keep,
                "use_cache": False, **self.mm_inputs}  # type: ignore[dict-item]


def collate(seqs: Sequence[TrainSequence], pad_id: int) -> MicroBatch:
    B = len(seqs)
    P = max(len(s.prompt_ids) for s in seqs)
    T = max(max(len(s.response_ids) for s in seqs), 1)
    L = P + T
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention = torch.zeros((B, L), dtype=torch.long)
    positions = torch.zeros((3, B, L), dtype=torch.long)
    response = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    behaviour = torch.zeros((B, T), dtype=torch.float32)
    for i, s in enumerate(seqs):
        n_p, n_r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, P - n_p:P] = torch.tensor(s.prompt_ids)
        attention[i, P - n_p:P + n_r] = 1
        positions[:, i, P - n_p:P] = s.position_ids_3P
        # response tokens continue the text positions after the prompt's largest position
        positions[:, i, P:] = s.next_position + torch.arange(T)
        if n_r:
            input_ids[i, P:P + n_r] = torch.tensor(s.response_ids)
            response[i, :n_r] = torch.tensor(s.response_ids)
            mask[i, :n_r] = torch.tensor(s.loss_mask, dtype=torch.float32)
            behaviour[i, :n_r] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
    old = _padded([s.old_logprobs for s in seqs], T)
    ref = _padded([s.ref_logprobs for s in seqs], T)
    mm_keys = sorted({k for s in seqs for k in s.mm_inputs})
    mm_inputs = {k: torch.cat([s.mm_inputs[k] for s in seqs if k in s.mm_inputs]) for k in mm_keys}
    return MicroBatch(input_ids_BL=input_ids, attention_mask_BL=attention, position_ids_3BL=positions,
                      mm_inputs=mm_inputs, response_ids_BT=response, mask_BT=mask,
                      behaviour_logprobs_BT=behaviour, old_logprobs_BT=old, ref_logprobs_BT=ref,
                      advantages_B=torch.tensor([s.advantage for s in seqs], dtype=torch.float32),
                      logits_to_keep=torch.arange(P - 1, P + T - 1))


def _padded(rows: list[list[float] | None], T: int) -> torch.Tensor | None:
    """(B, T) from per-sequence lists, or None when no sequence has them. A micro-batch mixes
    sequences with and without only as fillers (all-masked), whose values never count."""
    if all(r is None for r in rows):
        return None
    out = torch.zeros((len(rows), T), dtype=torch.float32)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def sampling_logprobs(logits_BTV: torch.Tensor, response_ids_BT: torch.Tensor, temperature: float,
                      forbidden_token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the response tokens and the entropy, under the distribution vLLM sampled from:
    logit bias of -100 on forbidden tokens (vLLM clamps bias to +-100), then temperature."""
    logits = logits_BTV.float()
    if forbidden_token_ids:
        bias = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
        bias[list(forbidden_token_ids)] = -100.0
        logits = logits + bias
    logits = logits / temperature
    logp_BTV = torch.log_softmax(logits, dim=-1)
    logprobs_BT = logp_BTV.gather(-1, response_ids_BT.unsqueeze(-1)).squeeze(-1)
    return logprobs_BT, entropy_from_logprobs(logp_BTV)
