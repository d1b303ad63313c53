"""Deviceless AOT plan: compile the server's own step programs of the full model for a TPU topology.

``python -m sglang_tpu_qwen.tools.plan --model-config qwen3.5-397b-a17b --topology tpu7x:2x2x1 --dp 8 --ep 8
--max-running-requests 64 --context-length 9216 --fp8 [--json out.json]``

With ``libtpu`` installed and no TPU present, ``jax.experimental.topologies`` describes the topology. The
planner builds the server's ``ModelRunner`` (engine/runner/model_runner.py) on abstract weights (shapes, dtypes
and shardings: nothing is read or allocated), with the server's kernel choice for a TPU (Pallas
attention, fused GDN, the FP8 grouped matmul) and its bucket enumeration (engine/runner/buckets.py), and
compiles the same jitted programs the server compiles: the forward program of the decode bucket of
every running request and of the largest prefill bucket, and the sampling program of that batch.
Reported per device: argument / temporary / output bytes of each step, HLO bytes accessed (summed per
instruction, tools/hlo_traffic.py; Pallas kernels declare their own traffic) against the minimum the step
must move, flops,
roofline time and tokens per second per chip, and the three largest XLA byte movers outside the kernels
(tools/hlo_traffic.py), the places to cut excess bytes. The steps are then composed into the two serving
workloads of the public Ironwood figures (module constant ``WORKLOADS``).

Step shapes: decode = every running request (``max_running_requests``, split over the DP ranks) adds one
token at the full context length; prefill = each DP rank prefills one fresh sequence of
its share of ``--chunked-prefill-size`` (the server's flag, and its default for the topology's device
memory: 8192 tokens per step for a 96 GiB Ironwood TensorCore, 1024 per rank at dp 8). The KV pool holds
``max_running_requests * context_length`` tokens; GDN slots are the server's (one per running request
plus its default prefix-cache snapshots, plus each rank's trash slot).
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

from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.parallel import sharding
from sglang_tpu_qwen.tools import hlo_traffic

# Qwen3.5-397B-A17B text model, from its public config (HF reference). The shared
# expert width (1024) is the released config's value.
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


# The public Ironwood serving figures (Qwen3.5-397B-A17B FP8 on 4 chips, 64 concurrent requests): total
# (input + output) tokens per second per chip as measured, and the roofline they were compared with.
WORKLOADS = (
    {"name": "1k in / 8k out", "input": 1024, "output": 8192, "published_tok_s_chip": 677,
     "published_roofline_tok_s_chip": 978},
    {"name": "8k in / 1k out", "input": 8192, "output": 1024, "published_tok_s_chip": 3707,
     "published_roofline_tok_s_chip": 5170},
)  # fmt: skip
CONCURRENCY = 64


def abstract_runner(config: Qwen35MoeConfig, args: Any, devices: Any, *, fp8: bool, block: tuple[int, int],
                    platform: str = "tpu") -> Any:
    """The server's ``ModelRunner`` for ``config`` and ``args`` (device-dependent defaults already resolved) on
    abstract parameters and cache (ShapeDtypeStructs carrying their shardings on the mesh of ``devices``), with
    the kernels the server picks on ``platform``: ``ModelRunner.abstract``, the constructor the server's
    runner goes through too. Its programs are the server's (``lower_forward`` / ``lower_sample``); nothing is
    read or allocated. ``fp8``: block-FP8 weights with ``block`` ([in, out])."""
    from sglang_tpu_qwen.engine.runner.model_runner import ModelRunner

    return ModelRunner.abstract(config, args, devices, platform=platform, fp8_block=block if fp8 else None)


def _cost(compiled: Any) -> dict[str, float]:
    ca = compiled.cost_analysis()
    if isinstance(ca, list):  # older jax returns one dict per program
        ca = ca[0]
    return {"flops": float(ca.get("flops", 0.0)), "bytes_accessed": float(ca.get("bytes accessed", 0.0))}


def _memory(compiled: Any) -> dict[str, int]:
    mem = compiled.memory_analysis()
    out = {"arguments": int(mem.argument_size_in_bytes), "temp": int(mem.temp_size_in_bytes),
           "output": int(mem.output_size_in_bytes), "alias": int(mem.alias_size_in_bytes)}
    out["total"] = out["arguments"] + out["temp"] + out["output"] - out["alias"]
    return out


def traffic(compiled: Any, n: int = 3) -> tuple[float, float, list[dict[str, Any]]]:
    """``(HLO bytes, kernel bytes, top excess)`` of a compiled program from its per-instruction traffic
    (tools/hlo_traffic.py: loop bodies times their trip counts, Pallas kernels at their declared traffic).
    XLA's own total counts a custom call inside a loop once, not once per trip (measured: a 4-layer scan
    over the FP8 kernel reports a quarter of the kernel's bytes), so the planner sums per instruction.
    Top excess: the ``n`` largest byte movers outside the kernels; the weights, KV and GDN state a step
    must read go through the kernels (the replicated dense leaves through the dots using them), so what
    else moves many bytes is the excess to cut."""
    ops = hlo_traffic.program_traffic(compiled.as_text())
    kernels = sum(o.total for o in ops if o.opcode == "custom-call")
    rest = sorted((o for o in ops if o.opcode != "custom-call"), key=lambda o: -o.total)
    top = [{"op": o.name, "opcode": o.opcode, "source": o.op_name[-120:], "bytes": o.total, "count": o.count}
           for o in rest[:n]]
    return sum(o.total for o in ops), kernels, top


def compose_workloads(report: dict[str, Any], chip: ChipPeaks, config: Qwen35MoeConfig,
                      kv_per_token: int) -> list[dict[str, Any]]:
    """Total (input + output) tok/s/chip of each of ``WORKLOADS`` at ``CONCURRENCY`` requests, from the
    compiled decode and prefill steps: the requests' prompts go through prefill steps (each DP rank one
    chunk of ``prefill_tokens_per_rank`` per step), then ``output`` decode steps run all requests at the
    average context ``input + output / 2``. A decode step's bytes are the compiled step's with its KV
    read rescaled from the compiled context to that average (compiled bytes, and the minimum bytes for
    the roofline); flops likewise through the attention term of :func:`analytic_flops_per_token`. Empty
    unless the plan's steps are at ``CONCURRENCY`` running requests (a decode step of another batch size
    would charge the workload's requests for rows they do not have)."""
    dec, pre = report["steps"].get("decode"), report["steps"].get("prefill")
    if not dec or not pre or "error" in dec or "error" in pre or report["max_running_requests"] != CONCURRENCY:
        return []
    dp, chips = report["dp"], report["chips"]
    bw = chip.hbm_bytes_per_s / chip.devices_per_chip
    peak = chip.bf16_flops_per_s / chip.devices_per_chip
    rows_dev = CONCURRENCY / report["devices"]
    out = []
    for w in WORKLOADS:
        ctx = w["input"] + w["output"] / 2
        kv_delta = rows_dev * (ctx - dec["context"]) * kv_per_token
        flops_dec = rows_dev * analytic_flops_per_token(config, int(ctx)) + rows_dev * 2 * config.hidden_size * (
            config.vocab_size)
        t_dec = max((dec["bytes_accessed"] + kv_delta) / bw, flops_dec / peak)
        t_dec_roof = max((dec["min_bytes"] + kv_delta) / bw, flops_dec / peak)
        prefill_steps = math.ceil(CONCURRENCY * w["input"] / (dp * report["prefill_tokens_per_rank"]))
        t_pre = prefill_steps * pre["compiled_time_s"]
        t_pre_roof = prefill_steps * pre["roofline_s"]
        tokens = CONCURRENCY * (w["input"] + w["output"])
        t = t_pre + w["output"] * t_dec
        t_roof = t_pre_roof + w["output"] * t_dec_roof
        out.append({**w, "prefill_steps": prefill_steps, "decode_steps": w["output"],
                    "decode_step_s": t_dec, "prefill_step_s": pre["compiled_time_s"],
                    "tok_s_chip": tokens / t / chips, "roofline_tok_s_chip": tokens / t_roof / chips})
    return out


def plan(
    config: Qwen35MoeConfig,
    topology: str,
    dp: int,
    ep: int,
    max_running_requests: int,
    context_length: int,
    *,
    fp8: bool = False,
    block: tuple[int, int] = (128, 128),
    page_size: int = 64,
    chunked_prefill_size: int | None = None,
    combine: str = "hierarchical",
    steps: tuple[str, ...] = ("decode", "prefill"),
    max_gdn_snapshots: int | None = None,
) -> dict[str, Any]:
    """Compile the server's decode and prefill programs and return the report (JSON-able dict, see the
    module docstring).

    Raises:
        ValueError: unknown chip family, or sizes that do not divide (requests or experts vs dp / ep).
    """
    from jax.experimental import topologies

    from sglang_tpu_qwen.args.server_args import ServerArgs

    family = topology.split(":")[0]
    if family not in CHIPS:
        raise ValueError(f"no peak figures for {family!r}; known: {sorted(CHIPS)}")
    chip = CHIPS[family]
    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    if max_running_requests % dp:
        raise ValueError(f"--max-running-requests {max_running_requests} is not a multiple of dp={dp}")
    rows_per_rank = max_running_requests // dp
    args = ServerArgs(dp_size=dp, ep_size=ep, max_running_requests=max_running_requests,
                      context_length=context_length, page_size=page_size, chunked_prefill_size=chunked_prefill_size,
                      max_total_tokens=rows_per_rank * context_length, moe_combine=combine,
                      max_gdn_snapshots=max_gdn_snapshots)
    hbm_dev = chip.hbm_bytes / chip.devices_per_chip
    args.resolve_chunked_prefill_size("tpu", int(hbm_dev))  # the server's default for the device memory
    runner = abstract_runner(config, args, topo.devices, fp8=fp8, block=block)
    c = config
    n_dev = runner.layout.mesh.devices.size
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), runner.params)
    rep_w, exp_w = weight_bytes_per_device(specs, ep)
    kv_dev = _nbytes({k: runner.cache[k] for k in ("k", "v")}) // dp
    gdn_dev = _nbytes({k: runner.cache[k] for k in ("conv", "rec")}) // dp
    kv_per_token = 2 * c.num_attn_layers * c.num_key_value_heads * c.head_dim * runner.dtype.itemsize
    state_per_req = _nbytes({k: runner.cache[k] for k in ("conv", "rec")}) // (dp * runner.sizing.num_slots)
    # Read once per step on each device: the replicated weights but the embedding (only the rows of the
    # step's tokens), and each local expert if any token of the step picks it (uniform routing: a token
    # picks a given expert with probability k / E).
    embed_b = c.vocab_size * c.hidden_size * runner.dtype.itemsize
    e_local = c.num_experts // ep
    per_expert = exp_w / e_local

    buckets = {
        "decode": runner.buckets.decode_bucket(rows_per_rank),
        "prefill": runner.buckets.extend_bucket(1, args.chunked_prefill_per_rank)[0],
    }
    report: dict[str, Any] = {
        "model": {"layers": c.num_hidden_layers, "experts": c.num_experts, "top_k": c.num_experts_per_tok,
                  "hidden": c.hidden_size, "fp8": fp8, "fp8_block": list(block)},
        "topology": topology, "devices": n_dev, "chips": n_dev // chip.devices_per_chip, "dp": dp, "ep": ep,
        "moe_combine": combine, "max_running_requests": max_running_requests, "context_length": context_length,
        "page_size": page_size, "chunked_prefill_size": args.chunked_prefill_size,
        "prefill_tokens_per_rank": args.chunked_prefill_per_rank,
        "kernels": {"attention": runner.backends.attention, "gdn": runner.backends.gdn,
                    "fp8_matmul": "pallas" if fp8 else None},
        "chip": dataclasses.asdict(chip),
        "memory_per_device": {"weights_replicated": rep_w, "weights_experts": exp_w, "kv_pool": kv_dev,
                              "gdn_slots": gdn_dev, "hbm": hbm_dev},
        "steps": {},
    }  # fmt: skip
    worst_total = 0.0
    for name in steps:
        bucket = buckets[name]
        t0 = time.perf_counter()
        try:
            fwd = runner.lower_forward(bucket).compile()
            smp = runner.lower_sample("greedy", bucket.batch).compile()
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            # The TPU compiler refuses programs that do not fit in HBM: that is the answer, not a failure.
            report["steps"][name] = {"memory": {"fits": False}, "error": str(e).splitlines()[0]}
            worst_total = math.inf
            continue
        compile_s = time.perf_counter() - t0
        mem = _memory(fwd)
        mem_s = _memory(smp)
        cost, cost_s = _cost(fwd), _cost(smp)
        worst_total = max(worst_total, mem["total"], mem_s["total"])
        rows, tokens = bucket.batch, bucket.tokens
        prefix = context_length - 1 if name == "decode" else 0
        rows_dev = rows // dp
        tokens_step = rows * tokens
        p_active = 1.0 - (1.0 - c.num_experts_per_tok / c.num_experts) ** tokens_step
        kv_read = rows_dev * (prefix + tokens) * kv_per_token
        kv_write = rows_dev * tokens * kv_per_token
        state_rw = rows_dev * state_per_req * (2 if prefix > 0 else 1)  # fresh prefill only writes
        min_bytes = (rep_w - embed_b + rows_dev * tokens * c.hidden_size * runner.dtype.itemsize
                     + per_expert * e_local * p_active + kv_read + kv_write + state_rw)
        hlo_f, kern_f, top_f = traffic(fwd)
        hlo_s, kern_s, top_s = traffic(smp, 1)
        bytes_accessed = hlo_f + hlo_s
        flops = cost["flops"] + cost_s["flops"]
        t_mem = min_bytes / (chip.hbm_bytes_per_s / chip.devices_per_chip)
        # Average visible context over the new tokens of a row; lm_head for each row's last token.
        ctx = prefix + (tokens + 1) / 2
        flops_model = rows_dev * (tokens * analytic_flops_per_token(c, int(ctx)) + 2 * c.hidden_size * c.vocab_size)
        t_flops = max(flops, flops_model) / (chip.bf16_flops_per_s / chip.devices_per_chip)
        t_roof = max(t_mem, t_flops)
        t_compiled = max(bytes_accessed / (chip.hbm_bytes_per_s / chip.devices_per_chip), t_flops)
        tokens_per_chip = tokens_step / (n_dev // chip.devices_per_chip)
        report["steps"][name] = {
            "bucket": dataclasses.asdict(bucket), "rows": rows, "new_tokens_per_row": tokens,
            "context": prefix + tokens, "compile_s": round(compile_s, 1),
            "memory": {**mem, "fits": mem["total"] <= hbm_dev, "sample_program": mem_s},
            "flops": flops, "analytic_flops": flops_model,
            "bytes_accessed": bytes_accessed, "bytes_forward": hlo_f, "bytes_sample": hlo_s,
            "bytes_kernels": kern_f + kern_s, "xla_cost_analysis_bytes": cost["bytes_accessed"] + cost_s[
                "bytes_accessed"], "min_bytes": min_bytes,
            "bytes_ratio": bytes_accessed / min_bytes,
            "roofline_s": t_roof, "roofline_bound": "memory" if t_mem >= t_flops else "compute",
            "roofline_tokens_per_s_per_chip": tokens_per_chip / t_roof,
            "compiled_time_s": t_compiled,
            "compiled_tokens_per_s_per_chip": tokens_per_chip / t_compiled,
            "top_excess": top_f + top_s,
        }  # fmt: skip
    report["fits"] = worst_total <= hbm_dev
    report["memory"] = {"fits": report["fits"], "worst_total_per_device": worst_total, "hbm_per_device": hbm_dev}
    report["workloads"] = compose_workloads(report, chip, c, kv_per_token)
    return report


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def format_report(r: dict[str, Any]) -> str:
    """Human-readable table of :func:`plan`'s report."""
    m = r["memory_per_device"]
    lines = [
        f"{r['topology']}: {r['devices']} devices on {r['chips']} chips, dp={r['dp']} ep={r['ep']} "
        f"combine={r['moe_combine']} fp8={r['model']['fp8']}, {r['max_running_requests']} running requests x "
        f"{r['context_length']} tokens; kernels {r['kernels']}",
        f"per device: weights {_gib(m['weights_replicated'] + m['weights_experts'])} "
        f"(replicated {_gib(m['weights_replicated'])}, experts {_gib(m['weights_experts'])}), "
        f"KV pool {_gib(m['kv_pool'])}, GDN slots {_gib(m['gdn_slots'])}, HBM {_gib(m['hbm'])}",
        "| step | bucket | args / temp / out per device | fits | GFLOP/device (XLA / model) | HLO bytes | min bytes "
        "| ratio | roofline ms | tok/s/chip (roofline) | tok/s/chip (HLO bytes) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in r["steps"].items():
        mm = s["memory"]
        if "error" in s:
            lines.append(f"| {name} | does not fit: {s['error']} |")
            continue
        b = s["bucket"]
        lines.append(
            f"| {name} | {b['batch']} x {b['tokens']} | {_gib(mm['arguments'])} / {_gib(mm['temp'])} / "
            f"{_gib(mm['output'])} | {mm['fits']} | "
            f"{s['flops'] / 1e9:.0f} / {s['analytic_flops'] / 1e9:.0f} | "
            f"{_gib(s['bytes_accessed'])} | {_gib(s['min_bytes'])} | {s['bytes_ratio']:.2f} | "
            f"{s['roofline_s'] * 1e3:.2f} ({s['roofline_bound']}) | {s['roofline_tokens_per_s_per_chip']:.0f} | "
            f"{s['compiled_tokens_per_s_per_chip']:.0f} |"
        )
    for name, s in r["steps"].items():
        for i, e in enumerate(s.get("top_excess", [])):
            lines.append(f"{name} excess #{i + 1}: {_gib(e['bytes'])} {e['opcode']} {e['op']} x{e['count']} "
                         f"({e['source']})")
    for w in r.get("workloads", []):
        lines.append(
            f"workload {w['name']} x {CONCURRENCY}: {w['tok_s_chip']:.0f} total tok/s/chip (HLO bytes), "
            f"{w['roofline_tok_s_chip']:.0f} roofline; published {w['published_tok_s_chip']} measured, "
            f"{w['published_roofline_tok_s_chip']} roofline")
    lines.append(f"peaks: {r['chip']['source']}")
    return "\n".join(lines)


def load_model_config(name_or_path: str) -> Qwen35MoeConfig:
    """A built-in name (``qwen3.5-397b-a17b``) or a HF ``config.json`` path."""
    if name_or_path.lower() in BUILTIN_CONFIGS:
        return Qwen35MoeConfig.from_hf_dict(BUILTIN_CONFIGS[name_or_path.lower()])
    with open(name_or_path, encoding="utf-8") as f:
        return Qwen35MoeConfig.from_hf_dict(json.load(f))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m sglang_tpu_qwen.tools.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--model-config", default="qwen3.5-397b-a17b", help="config.json path or built-in name")
    ap.add_argument("--topology", default="tpu7x:2x2x1")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--context-length", type=int, default=9216)
    ap.add_argument("--chunked-prefill-size", type=int, default=None,
                    help="server flag: prompt tokens per prefill step over all DP ranks (default: the server's for "
                         "the device memory, 8192 on tpu7x)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--moe-combine", choices=("flat", "hierarchical"), default="hierarchical")
    ap.add_argument("--fp8", action="store_true", help="block-FP8 weights (dequantised per tile in the matmuls)")
    ap.add_argument("--fp8-block", default="128,128", help="quantization_config.weight_block_size (HF [out, in])")
    ap.add_argument("--steps", default="decode,prefill", help="comma-separated: decode, prefill")
    ap.add_argument("--max-gdn-snapshots", type=int, default=None,
                    help="server flag: GDN prefix-cache snapshot slots per DP rank (default 2 per running request)")
    ap.add_argument("--json", help="also write the report here")
    a = ap.parse_args(argv)
    hf_block = [int(x) for x in a.fp8_block.split(",")]
    block = (hf_block[1], hf_block[0])  # HF [out, in] blocks; our matrices are [in, out]
    report = plan(
        load_model_config(a.model_config), a.topology, a.dp, a.ep, a.max_running_requests, a.context_length,
        fp8=a.fp8, block=block, page_size=a.page_size, chunked_prefill_size=a.chunked_prefill_size,
        combine=a.moe_combine, steps=tuple(x for x in a.steps.split(",") if x), max_gdn_snapshots=a.max_gdn_snapshots,
    )
    print(format_report(report))
    print(json.dumps(report))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
