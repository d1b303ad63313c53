"""The routed experts' SwiGLU FFN in one Pallas TPU kernel (kernel.py): prefill steps' dense experts
(kernels/moe_backend.py)."""
