"""Batched ragged paged attention: Pallas kernel (kernel.py), reference (reference.py), block sizes."""
