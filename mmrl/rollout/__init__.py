"""Rollout: vLLM engines in Ray actors (engine.py) driven by agent-loop plugins (agent_loops.py)."""
from mmrl.rollout.types import Completion, SamplingConfig, Trajectory

__all__ = ["Completion", "SamplingConfig", "Trajectory"]
