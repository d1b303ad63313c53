"""Deviceless AOT plan: compile one decode step and one prefill step of the full model for a TPU topology.

``python -m sglang_tpu_qwen.plan --model-config qwen3.5-397b-a17b --topology tpu7x:2x2x1 --dp 8 --ep 8
--max-running-requests 64 --context-length 9216 --fp8 [--json out.json]``

With ``libtpu`` installed and no TPU present, ``jax.experimental.topologies`` describes the topology; the
step (all layers, real dims, scan over layer periods, DP attention + expert-parallel MoE in one
``shard_map``) is lowered from abstract ``ShapeDtypeStruct`` inputs carrying their real shardings and
compiled. Reported per device: weights, KV pool, GDN slots, compiled temp memory, total vs HBM; per step:
compiled flops and bytes accessed (XLA cost analysis of the per-device program), the minimum bytes the
step must move, their ratio, and roofline time / tokens per second per chip from the chip's peaks.

Step shapes: decode = every running request (``max_running_requests``, split over the DP ranks) adds one
token at the full context length; prefill = each DP rank prefills one fresh sequence of
``--prefill-tokens`` tokens. The KV pool holds ``max_running_requests * context_length`` tokens and there
is one GDN slot per running request, plus each rank's trash page and slot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.forward import compute_logits, forward_step
from sglang_tpu_qwen.model.weights import param_specs
from sglang_tpu_qwen.parallel import sharding
from sglang_tpu_qwen.parallel.fp8 import fp8_specs
from sglang_tpu_qwen.parallel.mesh import make_layout
from sglang_tpu_qwen.parallel.sharded_forward import make_sharded_forward

# Qwen3.5-397B-A17B text model, from DESIGN.md section 2 (public config / HF reference). The shared
# expert width (1024) is not in DESIGN.md; it is the released config's value.
QWEN35_397B_A17B: dict[str, Any] = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320, "hidden_size": 4096, "num_hidden_layers": 60, "full_attention_interval": 4,
    "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "linear_num_key_heads": 16, "linear_num_value_heads": 64, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 1024,
    "shared_expert_intermediate_size": 1024, "norm_topk_prob": True, "tie_word_embeddings": False,
    "max_position_embeddings": 262144, "eos_token_id": 248046, "torch_dtype": "bfloat16",
}  # fmt: skip
BUILTIN_CONFIGS = {"qwen3.5-397b-a17b": QWEN35_397B_A17B}


@dataclasses.dataclass(frozen=True)
class ChipPeaks:
    """Per-chip peak figures and where they come from."""

    name: str
    devices_per_chip: int
    hbm_bytes: float
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    fp8_flops_per_s: float
    source: str


CHIPS = {
    "tpu7x": ChipPeaks(
        name="TPU7x (Ironwood)", devices_per_chip=2, hbm_bytes=192 * 2**30, hbm_bytes_per_s=7380e9,
        bf16_flops_per_s=2307e12, fp8_flops_per_s=4614e12,
        source="Google Cloud TPU7x docs (docs.cloud.google.com/tpu/docs/tpu7x): per chip 2307 TFLOP/s BF16, "
               "4614 TFLOP/s FP8, 192 GiB HBM, 7380 GB/s HBM, 2 TensorCores",
    ),
}  # fmt: skip


def _nbytes(tree: Any) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _is_expert(path: tuple[Any, ...]) -> bool:
    return bool(sharding._key_names(path) & sharding.EXPERT_LEAVES)


def weight_bytes_per_device(specs: Any, ep: int) -> tuple[int, int]:
    """``(replicated bytes, expert bytes)`` held by one device (expert stacks split ``ep`` ways)."""
    rep = exp = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(specs):
        n = math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
        if _is_expert(path):
            exp += n // ep
        else:
            rep += n
    return rep, exp


def analytic_flops_per_token(config: Qwen35MoeConfig, context: int) -> float:
    """Matmul flops (2 per multiply-add) of one token through the model at ``context`` visible keys,
    counting the k routed experts, the shared expert, all projections and attention scores / values;
    not the lm_head (counted per row by the caller). A cross-check of XLA's cost analysis."""
    c = config
    h, hd = c.hidden_size, c.head_dim
    attn = 2 * h * (c.num_attention_heads * hd * 2 + 2 * c.num_key_value_heads * hd)
    attn += 2 * c.num_attention_heads * hd * h + 2 * 2 * c.num_attention_heads * hd * context
    hv, dv, dk = c.linear_num_value_heads, c.linear_value_head_dim, c.linear_key_head_dim
    gdn = 2 * h * (c.gdn_conv_dim + hv * dv + 2 * hv) + 2 * hv * dv * h + 2 * 2 * hv * dk * dv
    moe = 2 * h * c.num_experts + c.num_experts_per_tok * 6 * h * c.moe_intermediate_size
    moe += 6 * h * c.shared_expert_intermediate_size
    return float(c.num_attn_layers * attn + c.num_gdn_layers * gdn + c.num_hidden_layers * moe)


@dataclasses.dataclass(frozen=True)
class StepShape:
    """Global batch of one step: ``rows`` sequences of ``tokens`` new tokens after ``prefix`` cached ones."""

    name: str
    rows: int
    tokens: int
    prefix: int
    pages_per_row: int


def _abstract(shape: tuple[int, ...], dtype: Any, s: NamedSharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=s)


def compile_step(
    config: Qwen35MoeConfig, layout: Any, params_abs: Any, cache_abs: Any, step: StepShape, combine: str
) -> Any:
    """Lower + compile one step (forward + logits of each row's last token) from abstract inputs."""
    fwd = make_sharded_forward(layout, config, params_abs, combine=combine, forward=forward_step)
    cfg = config

    def step_fn(params: Any, cache: Any, tokens: Any, prefix: Any, new: Any, pt: Any, slots: Any) -> Any:
        hidden, cache = fwd(params, cache, tokens, prefix, new, pt, slots)
        return compute_logits(params, hidden[:, -1], config=cfg), cache

    b = NamedSharding(layout.mesh, sharding.batch_pspec(layout))
    args = (
        _abstract((step.rows, step.tokens), jnp.int32, b),
        _abstract((step.rows,), jnp.int32, b),
        _abstract((step.rows,), jnp.int32, b),
        _abstract((step.rows, step.pages_per_row), jnp.int32, b),
        _abstract((step.rows,), jnp.int32, b),
    )
    jitted = jax.jit(step_fn, donate_argnums=(1,))
    return jitted.lower(params_abs, cache_abs, *args).compile()


def _cost(compiled: Any) -> dict[str, float]:
    ca = compiled.cost_analysis()
    if isinstance(ca, list):  # older jax returns one dict per program
        ca = ca[0]
    return {"flops": float(ca.get("flops", 0.0)), "bytes_accessed": float(ca.get("bytes accessed", 0.0))}


def plan(
    config: Qwen35MoeConfig,
    topology: str,
    dp: int,
    ep: int,
    max_running_requests: int,
    context_length: int,
    *,
    fp8: bool = False,
    page_size: int = 64,
    prefill_tokens: int = 4096,
    combine: str = "hierarchical",
    kv_dtype: Any = jnp.bfloat16,
    steps: tuple[str, ...] = ("decode", "prefill"),
) -> dict[str, Any]:
    """Compile the decode and prefill steps and return the report (JSON-able dict, see module docstring).

    Raises:
        ValueError: unknown chip family, or sizes that do not divide (requests or experts vs dp / ep).
    """
    from jax.experimental import topologies

    family = topology.split(":")[0]
    if family not in CHIPS:
        raise ValueError(f"no peak figures for {family!r}; known: {sorted(CHIPS)}")
    chip = CHIPS[family]
    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    layout = make_layout(dp, ep, devices=topo.devices)
    if max_running_requests % dp:
        raise ValueError(f"--max-running-requests {max_running_requests} is not a multiple of dp={dp}")
    rows_per_rank = max_running_requests // dp
    pages_per_row = -(-context_length // page_size)
    pages_per_rank = rows_per_rank * pages_per_row + 1  # + the rank's trash page 0
    slots_per_rank = rows_per_rank + 1

    dense = param_specs(config, jnp.bfloat16)
    specs = fp8_specs(dense) if fp8 else dense
    stacked = specs  # param_specs is in the scanned layout (model/stacking.py)
    pspecs = sharding.param_pspecs(stacked, layout)
    params_abs = jax.tree.map(
        lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(layout.mesh, p)),
        stacked, pspecs,
    )
    c = config
    cache_shapes = {
        "k": ((c.num_attn_layers, dp * pages_per_rank, page_size, c.num_key_value_heads, c.head_dim), kv_dtype),
        "v": ((c.num_attn_layers, dp * pages_per_rank, page_size, c.num_key_value_heads, c.head_dim), kv_dtype),
        "conv": ((c.num_gdn_layers, dp * slots_per_rank, c.gdn_conv_dim, c.linear_conv_kernel_dim - 1), jnp.float32),
        "rec": ((c.num_gdn_layers, dp * slots_per_rank, c.linear_num_value_heads, c.linear_key_head_dim,
                 c.linear_value_head_dim), jnp.float32),
    }  # fmt: skip
    cshard = sharding.shardings(sharding.cache_pspecs(layout), layout)
    cache_abs = {k: _abstract(s, dt, cshard[k]) for k, (s, dt) in cache_shapes.items()}

    n_dev = layout.mesh.devices.size
    rep_w, exp_w = weight_bytes_per_device(specs, ep)
    kv_dev = _nbytes({k: cache_abs[k] for k in ("k", "v")}) // dp
    gdn_dev = _nbytes({k: cache_abs[k] for k in ("conv", "rec")}) // dp
    kv_per_token = 2 * c.num_attn_layers * c.num_key_value_heads * c.head_dim * jnp.dtype(kv_dtype).itemsize
    state_per_req = _nbytes({k: cache_abs[k] for k in ("conv", "rec")}) // (dp * slots_per_rank)
    hbm_dev = chip.hbm_bytes / chip.devices_per_chip

    # Experts one device reads in a step: each of its E/ep experts is read if any of the step's tokens
    # picks it; with uniform routing P(picked by one token) = k / E.
    e_local = c.num_experts // ep
    per_expert = exp_w / e_local

    shapes = {
        "decode": StepShape("decode", max_running_requests, 1, context_length - 1, pages_per_row),
        "prefill": StepShape("prefill", dp, prefill_tokens, 0, -(-prefill_tokens // page_size)),
    }
    report: dict[str, Any] = {
        "model": {"layers": c.num_hidden_layers, "experts": c.num_experts, "top_k": c.num_experts_per_tok,
                  "hidden": c.hidden_size, "fp8": fp8},
        "topology": topology, "devices": n_dev, "chips": n_dev // chip.devices_per_chip, "dp": dp, "ep": ep,
        "moe_combine": combine, "max_running_requests": max_running_requests, "context_length": context_length,
        "page_size": page_size, "prefill_tokens_per_rank": prefill_tokens,
        "chip": dataclasses.asdict(chip),
        "memory_per_device": {"weights_replicated": rep_w, "weights_experts": exp_w, "kv_pool": kv_dev,
                              "gdn_slots": gdn_dev, "hbm": hbm_dev},
        "steps": {},
    }  # fmt: skip
    worst_total = 0.0
    for step in (shapes[name] for name in steps):
        t0 = time.perf_counter()
        try:
            compiled = compile_step(config, layout, params_abs, cache_abs, step, combine)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            # The TPU compiler refuses programs that do not fit in HBM: that is the answer, not a failure.
            report["steps"][step.name] = {"memory": {"fits": False}, "error": str(e).splitlines()[0]}
            worst_total = math.inf
            continue
        compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        cost = _cost(compiled)
        temp = int(mem.temp_size_in_bytes)
        args_b = int(mem.argument_size_in_bytes)
        total = args_b + temp + int(mem.output_size_in_bytes) - int(mem.alias_size_in_bytes)
        worst_total = max(worst_total, total)

        rows_dev = step.rows // dp
        tokens_step = step.rows * step.tokens
        p_active = 1.0 - (1.0 - c.num_experts_per_tok / c.num_experts) ** tokens_step
        kv_read = rows_dev * (step.prefix + step.tokens) * kv_per_token
        kv_write = rows_dev * step.tokens * kv_per_token
        state_rw = rows_dev * state_per_req * (2 if step.prefix > 0 else 1)  # fresh prefill only writes
        min_bytes = rep_w + per_expert * e_local * p_active + kv_read + kv_write + state_rw
        t_mem = min_bytes / (chip.hbm_bytes_per_s / chip.devices_per_chip)
        # Average visible context over the new tokens of a row; lm_head for each row's last token.
        ctx = step.prefix + (step.tokens + 1) / 2
        flops_model = rows_dev * (
            step.tokens * analytic_flops_per_token(c, int(ctx)) + 2 * c.hidden_size * c.vocab_size
        )
        t_flops = max(cost["flops"], flops_model) / (chip.bf16_flops_per_s / chip.devices_per_chip)
        t_roof = max(t_mem, t_flops)
        t_compiled = max(cost["bytes_accessed"] / (chip.hbm_bytes_per_s / chip.devices_per_chip), t_flops)
        tokens_per_chip = tokens_step / (n_dev // chip.devices_per_chip)
        report["steps"][step.name] = {
            "rows": step.rows, "new_tokens_per_row": step.tokens, "context": step.prefix + step.tokens,
            "compile_s": round(compile_s, 1),
            "memory": {"arguments": args_b, "temp": temp, "output": int(mem.output_size_in_bytes),
                       "alias": int(mem.alias_size_in_bytes), "total": total, "fits": total <= hbm_dev},
            "flops": cost["flops"], "analytic_flops": flops_model,
            "bytes_accessed": cost["bytes_accessed"], "min_bytes": min_bytes,
            "bytes_ratio": cost["bytes_accessed"] / min_bytes,
            "roofline_s": t_roof, "roofline_bound": "memory" if t_mem >= t_flops else "compute",
            "roofline_tokens_per_s_per_chip": tokens_per_chip / t_roof,
            "compiled_bytes_time_s": t_compiled,
            "compiled_tokens_per_s_per_chip": tokens_per_chip / t_compiled,
        }  # fmt: skip
    report["fits"] = worst_total <= hbm_dev
    return report


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def format_report(r: dict[str, Any]) -> str:
    """Human-readable table of :func:`plan`'s report."""
    m = r["memory_per_device"]
    lines = [
        f"{r['topology']}: {r['devices']} devices on {r['chips']} chips, dp={r['dp']} ep={r['ep']} "
        f"combine={r['moe_combine']} fp8={r['model']['fp8']}, {r['max_running_requests']} running requests x "
        f"{r['context_length']} tokens",
        f"per device: weights {_gib(m['weights_replicated'] + m['weights_experts'])} "
        f"(replicated {_gib(m['weights_replicated'])}, experts {_gib(m['weights_experts'])}), "
        f"KV pool {_gib(m['kv_pool'])}, GDN slots {_gib(m['gdn_slots'])}, HBM {_gib(m['hbm'])}",
        "| step | temp | total/device | fits | GFLOP/device (XLA / model) | compiled bytes | min bytes | ratio "
        "| roofline ms | tok/s/chip (roofline) | tok/s/chip (compiled bytes) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in r["steps"].items():
        mm = s["memory"]
        if "error" in s:
            lines.append(f"| {name} | does not fit: {s['error']} |")
            continue
        lines.append(
            f"| {name} | {_gib(mm['temp'])} | {_gib(mm['total'])} | {mm['fits']} | "
            f"{s['flops'] / 1e9:.0f} / {s['analytic_flops'] / 1e9:.0f} | "
            f"{_gib(s['bytes_accessed'])} | {_gib(s['min_bytes'])} | {s['bytes_ratio']:.2f} | "
            f"{s['roofline_s'] * 1e3:.2f} ({s['roofline_bound']}) | {s['roofline_tokens_per_s_per_chip']:.0f} | "
            f"{s['compiled_tokens_per_s_per_chip']:.0f} |"
        )
    lines.append(f"peaks: {r['chip']['source']}")
    return "\n".join(lines)


def load_model_config(name_or_path: str) -> Qwen35MoeConfig:
    """A built-in name (``qwen3.5-397b-a17b``) or a HF ``config.json`` path."""
    if name_or_path.lower() in BUILTIN_CONFIGS:
        return Qwen35MoeConfig.from_hf_dict(BUILTIN_CONFIGS[name_or_path.lower()])
    with open(name_or_path, encoding="utf-8") as f:
        return Qwen35MoeConfig.from_hf_dict(json.load(f))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m sglang_tpu_qwen.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--model-config", default="qwen3.5-397b-a17b", help="config.json path or built-in name")
    ap.add_argument("--topology", default="tpu7x:2x2x1")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--context-length", type=int, default=9216)
    ap.add_argument("--prefill-tokens", type=int, default=4096, help="tokens one DP rank prefills per step")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--moe-combine", choices=("flat", "hierarchical"), default="hierarchical")
    ap.add_argument("--fp8", action="store_true", help="block-FP8 weights (dequantised before each matmul)")
    ap.add_argument("--steps", default="decode,prefill", help="comma-separated: decode, prefill")
    ap.add_argument("--json", help="also write the report here")
    a = ap.parse_args(argv)
    report = plan(
        load_model_config(a.model_config), a.topology, a.dp, a.ep, a.max_running_requests, a.context_length,
        fp8=a.fp8, page_size=a.page_size, prefill_tokens=a.prefill_tokens, combine=a.moe_combine,
        steps=tuple(x for x in a.steps.split(",") if x),
    )
    print(format_report(report))
    print(json.dumps(report))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
