"""Trainer: DeepSpeed ZeRO-3 ranks in Ray actors (worker.py) consuming token batches (batch.py)."""
