"""mmrl: multimodal RL post-training.

The package layout follows the data flow:
data -> processors -> rollout -> rewards -> algorithms -> trainer -> weight_sync -> controller.
"""

__version__ = "0.1.0"
