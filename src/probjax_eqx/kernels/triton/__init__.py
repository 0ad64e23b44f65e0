"""Pallas Triton kernels (run on the CPU with `interpret=True`)."""
