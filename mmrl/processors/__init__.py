"""Model-family adapters: one processor call per sample gives the vLLM input and the trainer input.

Built-ins register on import; `build_processor` picks one by name or by the model's model_type.
"""
from mmrl.processors.base import ProcessedPrompt, PromptRef, build_processor, process_sample
from mmrl.processors import llava, qwen_vl  # noqa: F401  (register "llava", "qwen_vl")

__all__ = ["ProcessedPrompt", "PromptRef", "build_processor", "process_sample"]
