"""cuDNN routes through JAX."""
