"""The processor contract (base.py): one call per sample gives the vLLM input and the trainer input.

The model-family adapters are plugins in the repository's top-level `processors/` folder
(imported as `mmrl.plugins.processors`); `build_processor` picks one by name or by the model's
model_type.
"""
from mmrl.processors.base import ProcessedPrompt, PromptRef, build_processor, process_sample

__all__ = ["ProcessedPrompt", "PromptRef", "build_processor", "process_sample"]
