"""Controller: the training loop (loop.py), placement (placement.py), evaluation and metrics."""
