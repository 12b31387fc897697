"""From trajectories to tensors for the training forward, in one of two layouts.

Padded (`collate`): prompts are LEFT-padded and responses RIGHT-padded, so every row's response
starts at the same column P. The model then only projects the hidden states of the response
columns to vocabulary logits (`logits_to_keep`), which keeps the logits tensor at (B, T, V)
instead of (B, P+T, V).

Positions have A axes, as the family's processor adapter made them: (A, P) per prompt, A = 3
for multi-axis rotary positions (M-RoPE), 1 for plain positions; the model gets (A, B, L), or
(B, L) when A = 1. Nothing here knows a model family.

Padding-free (`collate_packed`, trainer.padding_free): the sequences are laid end to end in one
row, no pad token anywhere. Each keeps its own positions, and the text position inside the
sequence (restarting at 0) tells the model where sequences begin, so that attention never
crosses from one sequence into another (transformers' packed-sequence masks): with A > 1 it is
an extra leading row, (A+1, 1, L), transformers' convention for multi-axis positions; with
A = 1 the plain positions restart by themselves.
Only the response tokens' logits are computed, (1, N, V) with N the micro-batch's response tokens;
`MicroBatch.response_logprobs` puts them back in (B, T) for the loss.
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
    positions_AP: torch.Tensor
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
    # A response holding media (a tool's image): its own positions and vision tensors, sent by
    # reference (`response_ref`, a `ResponseInputs`) and filled on the rank by `resolve_prompts`.
    # Without them response token t sits at next_position + t.
    response_ref: Any = None
    response_positions_AT: torch.Tensor | None = None
    response_mm_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    # MoE models: the engine's routed experts per response token, (T, MoE layers, k), -1 where
    # none (`Trajectory.routed_experts`); replayed or compared by trainer/routing_replay.py
    routed_experts: Any = None

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
                    loss_mask: list[int], advantage: float = 0.0, response_ref: Any = None,
                    routed_experts: Any = None) -> "TrainSequence":
        if isinstance(prompt, PromptRef):  # positions and ids arrive with resolve_prompts
            return cls(prompt_ids=[], positions_AP=torch.zeros((0, 0), dtype=torch.long), next_position=0,
                       mm_inputs={}, response_ids=response_ids, behaviour_logprobs=behaviour_logprobs,
                       loss_mask=loss_mask, advantage=advantage, prompt_ref=prompt, response_ref=response_ref,
                       routed_experts=routed_experts)
        return cls(prompt_ids=prompt.prompt_ids, positions_AP=prompt.positions_AP,
                   next_position=prompt.next_position, mm_inputs=prompt.mm_inputs, response_ids=response_ids,
                   behaviour_logprobs=behaviour_logprobs, loss_mask=loss_mask, advantage=advantage,
                   response_ref=response_ref, routed_experts=routed_experts)


def resolve_prompts(seqs: Sequence[TrainSequence]) -> None:
    """Fetch the prompts sent by reference (one fetch per distinct prompt: a group's sequences
    share it) and fill their fields; on the trainer rank, before the forward."""
    import ray

    responses = [s for s in seqs if s.response_ref is not None and s.response_positions_AT is None]
    for s, inputs in zip(responses, ray.get([s.response_ref for s in responses]) if responses else []):
        s.response_positions_AT, s.response_mm_inputs = inputs.positions_AT, inputs.mm_inputs
    pending = [s for s in seqs if s.prompt_ref is not None and not s.prompt_ids]
    if not pending:
        return

    refs: dict[Any, Any] = {}
    for s in pending:
        refs.setdefault(s.prompt_ref.ref, None)  # type: ignore[union-attr]
    for ref, prompt in zip(refs, ray.get(list(refs))):
        refs[ref] = prompt
    for s in pending:
        p = refs[s.prompt_ref.ref]  # type: ignore[union-attr]
        s.prompt_ids, s.positions_AP, s.next_position, s.mm_inputs = \
            p.prompt_ids, p.positions_AP, p.next_position, p.mm_inputs


@dataclass
class MicroBatch:
    input_ids_BL: torch.Tensor
    attention_mask_BL: torch.Tensor | None  # None in the packed layout: its positions mark the starts
    position_ids_ABL: torch.Tensor  # A position axes (plus the text row when packed with A > 1)
    mm_inputs: dict[str, torch.Tensor]
    response_ids_BT: torch.Tensor
    mask_BT: torch.Tensor
    behaviour_logprobs_BT: torch.Tensor
    old_logprobs_BT: torch.Tensor | None
    ref_logprobs_BT: torch.Tensor | None
    advantages_B: torch.Tensor
    logits_to_keep: torch.Tensor  # columns whose logits predict the response tokens
    # Padding-free layout only: the response tokens in row order (1, N), and where each sits in
    # (B, T). None in the padded layout, whose logits are already (B, T, V).
    packed_response_ids_1N: torch.Tensor | None = None
    response_present_BT: torch.Tensor | None = None

    def model_inputs(self) -> dict[str, torch.Tensor]:
        mask = {} if self.attention_mask_BL is None else {"attention_mask": self.attention_mask_BL}
        return {"input_ids": self.input_ids_BL, **mask, "position_ids": model_positions(self.position_ids_ABL),
                "logits_to_keep": self.logits_to_keep, "use_cache": False, **self.mm_inputs}  # type: ignore[dict-item]

    def response_logprobs(self, logits: torch.Tensor, temperature: float,
                          forbidden_token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs_BT, entropy_BT) of the response tokens from the model's kept logits, in
        either layout; zeros where a row has no response token."""
        if self.packed_response_ids_1N is None:
            return sampling_logprobs(logits, self.response_ids_BT, temperature, forbidden_token_ids)
        logprobs_1N, entropy_1N = sampling_logprobs(logits, self.packed_response_ids_1N, temperature,
                                                    forbidden_token_ids)
        present = self.response_present_BT
        zeros = torch.zeros(present.shape, dtype=logprobs_1N.dtype, device=logprobs_1N.device)  # type: ignore[union-attr]
        return zeros.masked_scatter(present, logprobs_1N[0]), zeros.masked_scatter(present, entropy_1N[0])


def collate(seqs: Sequence[TrainSequence], pad_id: int, padding_free: bool = False) -> MicroBatch:
    """The micro-batch's tensors: padded rows, or one packed row with `padding_free`."""
    if padding_free:
        return collate_packed(seqs, pad_id)
    B = len(seqs)
    P = max(len(s.prompt_ids) for s in seqs)
    T = max(max(len(s.response_ids) for s in seqs), 1)
    L = P + T
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention = torch.zeros((B, L), dtype=torch.long)
    positions = torch.zeros((position_axes(seqs), B, L), dtype=torch.long)
    for i, s in enumerate(seqs):
        n_p, n_r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, P - n_p:P] = torch.tensor(s.prompt_ids)
        attention[i, P - n_p:P + n_r] = 1
        positions[:, i, P - n_p:P] = s.positions_AP
        own = _response_positions(s)
        positions[:, i, P:P + n_r] = own
        # the right padding continues the positions (its tokens are masked out)
        last = int(own.max()) if n_r else s.next_position - 1
        positions[:, i, P + n_r:] = last + 1 + torch.arange(T - n_r)
        if n_r:
            input_ids[i, P:P + n_r] = torch.tensor(s.response_ids)
    response, mask, behaviour = _response_rows(seqs, T, pad_id)
    old = _padded([s.old_logprobs for s in seqs], T)
    ref = _padded([s.ref_logprobs for s in seqs], T)
    mm_inputs = _media(seqs)
    return MicroBatch(input_ids_BL=input_ids, attention_mask_BL=attention, position_ids_ABL=positions,
                      mm_inputs=mm_inputs, response_ids_BT=response, mask_BT=mask,
                      behaviour_logprobs_BT=behaviour, old_logprobs_BT=old, ref_logprobs_BT=ref,
                      advantages_B=torch.tensor([s.advantage for s in seqs], dtype=torch.float32),
                      logits_to_keep=torch.arange(P - 1, P + T - 1))


def position_axes(seqs: Sequence[Any]) -> int:
    """A, the number of position axes of these prompts (one family per run: all agree)."""
    axes = {int(s.positions_AP.shape[0]) for s in seqs}
    if len(axes) != 1:
        raise ValueError(f"prompts with different numbers of position axes in one batch: {sorted(axes)}")
    return axes.pop()


def model_positions(position_ids_ABL: torch.Tensor) -> torch.Tensor:
    """What the model's forward takes: (A, B, L), or (B, L) for plain positions (A = 1)."""
    return position_ids_ABL[0] if position_ids_ABL.shape[0] == 1 else position_ids_ABL


def _response_positions(s: TrainSequence) -> torch.Tensor:
    """(A, n_r): a response's own positions when it holds media, else the text positions that
    continue after the prompt's largest position."""
    n_r = len(s.response_ids)
    if s.response_positions_AT is not None and n_r:
        return s.response_positions_AT
    return (s.next_position + torch.arange(n_r)).expand(s.positions_AP.shape[0], n_r)


def _response_rows(seqs: Sequence[TrainSequence], T: int,
                   pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(response_ids_BT, mask_BT, behaviour_logprobs_BT), right-padded to T."""
    B = len(seqs)
    response = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    behaviour = torch.zeros((B, T), dtype=torch.float32)
    for i, s in enumerate(seqs):
        n_r = len(s.response_ids)
        if n_r:
            response[i, :n_r] = torch.tensor(s.response_ids)
            mask[i, :n_r] = torch.tensor(s.loss_mask, dtype=torch.float32)
            behaviour[i, :n_r] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
    return response, mask, behaviour


def _media(seqs: Sequence[TrainSequence]) -> dict[str, torch.Tensor]:
    """Per sequence: the prompt's media, then the response's (the order their tokens appear in)."""
    rows_mm = [(s.mm_inputs, s.response_mm_inputs) for s in seqs]
    mm_keys = sorted({k for a, b in rows_mm for k in (*a, *b)})
    return {k: torch.cat([part[k] for a, b in rows_mm for part in (a, b) if k in part]) for k in mm_keys}


def collate_packed(seqs: Sequence[TrainSequence], pad_id: int = 0) -> MicroBatch:
    """All sequences end to end in one row (trainer.padding_free): no pad token, each sequence
    with its own positions plus (A > 1) a restarting text-position row that keeps attention inside it."""
    T = max(max(len(s.response_ids) for s in seqs), 1)
    text_row = position_axes(seqs) > 1
    ids, positions, keep, packed = [], [], [], []
    start = 0
    for s in seqs:
        n_p, n_r = len(s.prompt_ids), len(s.response_ids)
        ids += [*s.prompt_ids, *s.response_ids]
        own = torch.cat([s.positions_AP, _response_positions(s)], dim=1)
        positions.append(torch.cat([torch.arange(n_p + n_r).unsqueeze(0), own]) if text_row else own)
        keep += range(start + n_p - 1, start + n_p + n_r - 1)  # the logits that predict the response
        packed += s.response_ids
        start += n_p + n_r
    response, mask, behaviour = _response_rows(seqs, T, pad_id)  # (B, T) for the loss
    lengths = torch.tensor([len(s.response_ids) for s in seqs])
    return MicroBatch(input_ids_BL=torch.tensor([ids]), attention_mask_BL=None,
                      position_ids_ABL=torch.cat(positions, dim=1).unsqueeze(1), mm_inputs=_media(seqs),
                      response_ids_BT=response, mask_BT=mask, behaviour_logprobs_BT=behaviour,
                      old_logprobs_BT=_padded([s.old_logprobs for s in seqs], T),
                      ref_logprobs_BT=_padded([s.ref_logprobs for s in seqs], T),
                      advantages_B=torch.tensor([s.advantage for s in seqs], dtype=torch.float32),
                      logits_to_keep=torch.tensor(keep, dtype=torch.long),
                      packed_response_ids_1N=torch.tensor([packed], dtype=torch.long),
                      response_present_BT=torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1))


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
