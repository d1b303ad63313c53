"""Fused conv1d + Gated DeltaNet: Pallas kernel (kernel.py) and reference (reference.py)."""
