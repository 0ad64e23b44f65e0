"""Pallas Mosaic GPU kernels for Hopper (wgmma, TMA), written with `plgpu.kernel`."""
