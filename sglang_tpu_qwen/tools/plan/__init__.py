"""Deviceless AOT plan: compile the server's own step programs of the full model for a TPU topology.

``python -m sglang_tpu_qwen.tools.plan --model-config qwen3.5-397b-a17b --topology tpu7x:2x2x1 --dp 8 --ep 8
--max-running-requests 64 --context-length 9216 --fp8 [--json out.json]``

With ``libtpu`` installed and no TPU present, ``jax.experimental.topologies`` describes the topology. The
planner builds the server's ``ModelRunner`` on abstract weights and compiles the same jitted programs the
server compiles (the decode bucket of every running request, the largest prefill bucket, greedy sampling).
Modules, one concept each:
- ``build``: compile the steps and assemble the report; ``programs``: memory, cost and per-instruction
  traffic of one compiled program; ``flops``: the analytic flop count;
- ``chips``: peak figures and the ICI model (each figure sourced or an assumption with a range);
- ``routing``: the slowest device's expert traffic under uniform and Zipf routing (analytic + Monte-Carlo);
- ``collectives``: the compiled HLO's collectives over the ICI, overlapped or exposed;
- ``compose``: the published workloads in total and decode-only output tok/s/chip;
- ``calibration``: the published figures, predicted vs measured; ``report``: tables; ``cli``: the command;
- ``models``: built-in model configs (``load_model_config``);
- ``capacity``: concurrent and idle long sessions per host at each cache dtype (arithmetic, no compile;
  ``python -m sglang_tpu_qwen.tools.plan.capacity``);
- ``kernel_schedule``: the fused GDN kernel's static LLO schedule, bundles and unit utilisation
  (``python -m sglang_tpu_qwen.tools.plan.kernel_schedule``).
"""

from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.tools.plan.build import abstract_runner, plan
from sglang_tpu_qwen.tools.plan.calibration import CONCURRENCY, WORKLOADS, calibrate
from sglang_tpu_qwen.tools.plan.chips import CHIPS, ChipPeaks
from sglang_tpu_qwen.tools.plan.cli import main
from sglang_tpu_qwen.tools.plan.compose import compose_workloads, step_time
from sglang_tpu_qwen.tools.plan.flops import analytic_flops_per_token
from sglang_tpu_qwen.tools.plan.models import BUILTIN_CONFIGS, load_model_config
from sglang_tpu_qwen.tools.plan.report import format_report

__all__ = [
    "BUILTIN_CONFIGS", "CHIPS", "CONCURRENCY", "WORKLOADS", "ChipPeaks", "Qwen35MoeConfig", "abstract_runner",
    "analytic_flops_per_token", "calibrate", "compose_workloads", "format_report", "load_model_config", "main", "plan",
    "step_time",
]  # fmt: skip
