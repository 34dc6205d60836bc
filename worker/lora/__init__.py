"""Multi-LoRA serving in the worker: adapter loading, the slot pool, the batched delta."""
