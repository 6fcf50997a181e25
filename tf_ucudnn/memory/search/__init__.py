"""The memory decision: which tensors to swap or recompute, and where micro-batches start."""
