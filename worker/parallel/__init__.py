"""Tensor and pipeline parallelism: one engine replica over several worker processes."""
