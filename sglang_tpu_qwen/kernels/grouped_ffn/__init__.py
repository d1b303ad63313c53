"""The routed experts' SwiGLU FFN in one Pallas TPU kernel (kernel.py): prefill steps' dense experts
(kernels/moe_backend.py)."""

# Name scope of the kernel's pallas_call, here so that the planner's HLO reader (tools/hlo_traffic.py) names it
# without importing Pallas: it charges the call's declared flops at the chip's measured rate for its rows per
# expert (tools/plan/chips.py).
SCOPE = "grouped_ffn"
