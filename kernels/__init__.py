"""Attention and KV-cache kernels: PyTorch references, a fast CPU path, Triton for GPUs."""
