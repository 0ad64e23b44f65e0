"""Kernel families, grouped by backend: reference/, triton/, mosaic/, cudnn/."""
