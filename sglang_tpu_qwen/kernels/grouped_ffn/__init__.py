"""The routed experts' SwiGLU FFN in one Pallas TPU kernel (kernel.py), a prefill candidate."""
