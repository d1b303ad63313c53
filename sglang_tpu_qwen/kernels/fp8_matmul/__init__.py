"""Grouped matmul over block-FP8 weights: Pallas kernel (kernel.py) and jnp reference (reference.py)."""
