"""Model-family processor adapters (installed as `mmrl.plugins.processors`).

One file per family: a `ProcessorAdapter` subclass registered with @register("processor", NAME)
that lists the model_type values it serves in `model_types` (processor.name "auto" picks it by
them). The contract every adapter meets is in mmrl/processors/base.py; `mmrl new processor NAME`
writes a starting point with its contract test.
"""
from mmrl.plugins.processors import internvl, llava, qwen_vl  # noqa: F401  (register the adapters)
