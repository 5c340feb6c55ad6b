"""Triton kernels with pure-PyTorch references. Triton is imported lazily (only when a kernel runs)."""
