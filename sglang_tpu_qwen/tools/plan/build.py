"""Compile the server's step programs for a TPU topology (deviceless) and build the planner's report."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Any

import jax

from sglang_tpu_qwen.engine.runner import compilation
from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.tools.plan import collectives, programs, routing, step_bytes
from sglang_tpu_qwen.tools.plan.calibration import calibrate
from sglang_tpu_qwen.tools.plan.chips import CHIPS
from sglang_tpu_qwen.tools.plan.compose import compose_workloads
from sglang_tpu_qwen.tools.plan.flops import chunk_flops, expert_pair_flops, lm_head_flops

_TOPOLOGY_LOCK = threading.Lock()
MC_TRIALS = {"decode": 400, "verify": 100, "prefill": 4}  # Monte-Carlo layer steps per distribution (fixed seed)


def abstract_runner(config: Qwen35MoeConfig, args: Any, devices: Any, *, fp8: bool, block: tuple[int, int],
                    platform: str = "tpu", device_memory_bytes: int | None = None) -> Any:
    """The server's ``ModelRunner`` for ``config`` and ``args`` (device-dependent defaults already resolved) on
    abstract parameters and cache (ShapeDtypeStructs carrying their shardings on the mesh of ``devices``), with
    the kernels the server picks on ``platform``: ``ModelRunner.abstract``, the constructor the server's
    runner goes through too. ``fp8``: block-FP8 weights with ``block`` ([in, out]). ``device_memory_bytes``: each
    device's HBM, which the server's memory rule splits (deviceless devices report none)."""
    from sglang_tpu_qwen.engine.runner.model_runner import ModelRunner

    return ModelRunner.abstract(config, args, devices, platform=platform, fp8_block=block if fp8 else None,
                                device_memory_bytes=device_memory_bytes)


def topology_devices(topology: str) -> list[Any]:
    """The compile-only devices of a deviceless TPU ``topology`` (``"tpu7x:2x2x1"``, ``"v5e:1x1"``). A slice smaller
    than libtpu's default host (2x2x1 chips) is described as a host of its own size: ``v5e:1x1`` is one chip.

    Raises:
        RuntimeError / JaxRuntimeError: libtpu is missing or does not know the topology.
    """
    from jax.experimental import topologies

    shape = [int(v) for v in topology.split(":")[1].split("x")]
    kwargs: dict[str, Any] = {}
    if math.prod(shape) < 4:  # libtpu's default chips_per_host_bounds is 2x2x1
        kwargs["chips_per_host_bounds"] = tuple(shape + [1] * (3 - len(shape)))
    with _TOPOLOGY_LOCK:  # the first call loads libtpu's plugin: two threads at once both try, one fails
        return list(topologies.get_topology_desc(platform="tpu", topology_name=topology, **kwargs).devices)


def moe_extra(config: Qwen35MoeConfig, ep: int, tokens: int, per_expert_bytes: float, name: str) -> dict[str, Any]:
    """Per routing distribution, the bytes and flops the slowest device (and the mean device) adds over the
    compiled step of ``tokens`` tokens (all DP ranks'), whose FP8 MoE kernels declare the uniform-routing mean
    (routing.kernel_expected_experts) and whose flops count ``k`` pairs per token. ``per_expert_bytes``: one
    local expert's weights over all layers (bytes scale with it); flops are summed over the MoE layers (every
    layer here). ``name``: the step ("decode" / "prefill"), which sets the Monte-Carlo trials."""
    c = config
    out: dict[str, Any] = {}
    if not c.num_experts:  # a dense model: no expert-parallel layer, nothing to add
        zero = {"slowest_bytes": 0.0, "mean_bytes": 0.0, "slowest_flops": 0.0}
        return {d.name: {"distribution": d.label, "tokens": tokens, **zero} for d in routing.DISTRIBUTIONS}
    declared = routing.kernel_expected_experts(c.num_experts, c.num_experts_per_tok, ep, tokens)
    layers = c.num_hidden_layers
    for dist in routing.DISTRIBUTIONS:
        a = routing.expert_load(c.num_experts, c.num_experts_per_tok, ep, tokens, dist)
        mc = routing.monte_carlo(c.num_experts, c.num_experts_per_tok, ep, tokens, dist, trials=MC_TRIALS[name])
        mean_pairs = tokens * c.num_experts_per_tok / ep
        out[dist.name] = {
            "distribution": dist.label, "tokens": tokens, "kernel_declared_experts": declared, "analytic": a,
            "monte_carlo": {**mc, "trials": MC_TRIALS[name], "seed": 0},
            "slowest_bytes": (a["max_experts"] - declared) * per_expert_bytes,
            "mean_bytes": (a["mean_experts"] - declared) * per_expert_bytes,
            "slowest_flops": layers * (a["max_pairs"] - mean_pairs) * expert_pair_flops(c),
        }
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
    kv_cache_dtype: str = "auto",
    mamba_ssm_dtype: str | None = None,
    speculative_num_draft_tokens: int = 0,
    speculative_accept_length: float | None = None,
    max_total_tokens: int | None = None,
    speculative_token_map: str | None = None,
) -> dict[str, Any]:
    """Compile the server's decode and prefill programs and return the report (JSON-able dict; see
    docs/parallelism.md#the-planner for its fields). ``kv_cache_dtype``: the server's --kv-cache-dtype (the KV
    pool keeps its tokens, ``rows_per_rank * context_length``, so FP8 pages halve its bytes).

    ``speculative_num_draft_tokens`` N > 0: the server's MTP speculative decoding (NEXTN, top-k 1, N - 1 draft
    steps) on a runner that holds the MTP layer; the decode bucket's served verify, commit and draft programs
    (and the sampling program of its B * N positions) are compiled as one "verify" step, and the workloads are
    composed with it at ``speculative_accept_length`` tokens per request per verify step (SGLang's accept
    length), beside ``workloads_without_speculation``; ``speculative_token_map``: the server's
    --speculative-token-map (the drafts read only its rows of the lm_head).

    ``max_total_tokens``: the server's --max-total-tokens, each DP rank's KV pool in tokens (default: every row at
    ``context_length``). A benchmark that plans beside a running engine passes the engine's pool: XLA lays out a
    small pool differently (one that fits the chip's VMEM is staged through it between the attention calls).

    Raises:
        ValueError: unknown chip family, or sizes that do not divide (requests or experts vs dp / ep), or
            speculation without an accept length in [1, N].
    """
    from sglang_tpu_qwen.args.server_args import ServerArgs

    family = topology.split(":")[0]
    if family not in CHIPS:
        raise ValueError(f"no peak figures for {family!r}; known: {sorted(CHIPS)}")
    chip = CHIPS[family]
    topo_devices = topology_devices(topology)
    if max_running_requests % dp:
        raise ValueError(f"--max-running-requests {max_running_requests} is not a multiple of dp={dp}")
    rows_per_rank = max_running_requests // dp
    n_spec = speculative_num_draft_tokens
    if n_spec and not (speculative_accept_length is not None and 1.0 <= speculative_accept_length <= n_spec):
        raise ValueError(f"--speculative-accept-length must be in [1, {n_spec}] with --speculative-num-draft-tokens "
                         f"{n_spec}, got {speculative_accept_length}")
    spec_flags: dict[str, Any] = dict(speculative_algorithm="NEXTN", speculative_num_steps=n_spec - 1,
                                      speculative_eagle_topk=1, speculative_num_draft_tokens=n_spec,
                                      speculative_token_map=speculative_token_map) if n_spec else {}
    args = ServerArgs(dp_size=dp, ep_size=ep, max_running_requests=max_running_requests,
                      context_length=context_length, page_size=page_size, chunked_prefill_size=chunked_prefill_size,
                      max_total_tokens=max_total_tokens or rows_per_rank * context_length, moe_combine=combine,
                      max_gdn_snapshots=max_gdn_snapshots, kv_cache_dtype=kv_cache_dtype,
                      mamba_ssm_dtype=mamba_ssm_dtype, **spec_flags)
    hbm_dev = chip.hbm_bytes / chip.devices_per_chip
    bw = chip.hbm_bytes_per_s / chip.devices_per_chip
    peak = chip.bf16_flops_per_s / chip.devices_per_chip
    args.resolve_chunked_prefill_size("tpu", int(hbm_dev))  # the server's default for the device memory
    # The server's memory rule on the chip's HBM: KV is the planned context of every row (--max-total-tokens),
    # the GDN snapshot slots get what --mem-fraction-static leaves after it (engine/runner/memory_split.py).
    runner = abstract_runner(config, args, topo_devices, fp8=fp8, block=block, device_memory_bytes=int(hbm_dev))
    c = config
    # Without dp or ep (one device) the runner has no mesh: it places everything on the first device.
    mesh_devices = list(runner.layout.mesh.devices.flat) if runner.layout is not None else topo_devices[:1]
    n_dev = len(mesh_devices)
    chip_of = [tuple(d.coords) for d in mesh_devices]
    # The weights, KV and state sizes every step's least bytes are counted from (step_bytes.py); the MTP
    # layer's weights apart: the draft program reads them.
    rb = step_bytes.runner_bytes(runner, ep)
    rep_w, exp_w, mtp_rep, mtp_exp = rb.replicated, rb.experts, rb.mtp_replicated, rb.mtp_experts
    kv_dev = programs.nbytes({k: runner.cache[k] for k in ("k", "v")}) // dp
    gdn_dev = programs.nbytes({k: runner.cache[k] for k in ("conv", "rec")}) // dp
    kv_per_token = rb.kv_per_token
    per_expert = rb.per_expert

    buckets = {
        "decode": runner.buckets.decode_bucket(rows_per_rank),
        "prefill": runner.buckets.extend_bucket(1, args.chunked_prefill_per_rank)[0],
    }
    buckets["verify"] = buckets["decode"]
    if n_spec and "decode" in steps and "verify" not in steps:
        steps = (*steps, "verify")
    report: dict[str, Any] = {
        "model": {"layers": c.num_hidden_layers, "experts": c.num_experts, "top_k": c.num_experts_per_tok,
                  "hidden": c.hidden_size, "fp8": fp8, "fp8_block": list(block)},
        "topology": topology, "devices": n_dev, "chips": n_dev // chip.devices_per_chip, "dp": dp, "ep": ep,
        "moe_combine": combine, "max_running_requests": max_running_requests, "context_length": context_length,
        "page_size": page_size, "kv_cache_dtype": runner.kv_dtype.name,
        "chunked_prefill_size": args.chunked_prefill_size,
        "mamba_ssm_dtype": runner.sizing.state_dtype.name,
        "prefill_tokens_per_rank": args.chunked_prefill_per_rank,
        "kernels": {"attention": runner.backends.attention.name, "gdn": runner.backends.gdn.name,
                    "fp8_matmul": runner.backends.moe.name if fp8 else None},
        "chip": dataclasses.asdict(chip),
        "routing": {d.name: {"label": d.label, "zipf_s": d.s, "placement_seed": routing.PLACEMENT_SEED}
                    for d in routing.DISTRIBUTIONS},
        "speculative": {"num_draft_tokens": n_spec, "accept_length": speculative_accept_length,
                        "mtp_weights_replicated": mtp_rep, "mtp_weights_experts": mtp_exp} if n_spec else None,
        "memory_per_device": {"weights_replicated": rep_w, "weights_experts": exp_w, "kv_pool": kv_dev,
                              "gdn_slots": gdn_dev, "hbm": hbm_dev,
                              "gdn_running_slots": runner.sizing.num_running_slots - 1,
                              "gdn_snapshot_slots": runner.sizing.num_snapshot_slots,
                              "split": runner.sizing.split.as_dict(),
                              # The abstract runner has no vision tower: the server takes the encoder's
                              # memory_bytes() out of the budget first, so its pools are that much smaller.
                              "vision_tower": "not counted (text model only)"},
        "steps": {},
    }  # fmt: skip
    worst_total = 0.0
    for name in steps:
        bucket = buckets[name]
        t0 = time.perf_counter()
        try:
            with compilation.persistent_cache_off():
                fwd, *others = _compile_step(runner, name, bucket, n_spec)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            # The TPU compiler refuses programs that do not fit in HBM: that is the answer, not a failure.
            report["steps"][name] = {"memory": {"fits": False}, "error": str(e).splitlines()[0]}
            worst_total = float("inf")
            continue
        compile_s = time.perf_counter() - t0
        mem = programs.memory(fwd)
        mem_others = [programs.memory(p) for p in others]
        cost, other_costs = programs.cost(fwd), [programs.cost(p) for p in others]
        cost_s = {k: sum(oc[k] for oc in other_costs) for k in ("flops", "bytes_accessed")}
        worst_total = max(worst_total, mem["total"], *(m["total"] for m in mem_others))
        rows, tokens = bucket.batch, (n_spec if name == "verify" else bucket.tokens)
        prefix = 0 if name == "prefill" else context_length - 1
        rows_rank = rows // dp
        tokens_step = rows * tokens
        parts = step_bytes.step_min_bytes(
            rb, name, rows_rank=rows_rank, tokens=tokens, prefix=prefix, tokens_step=tokens_step,
            page_size=page_size, accept_length=speculative_accept_length,
            draft=lambda: step_bytes.draft_min_bytes(c, rb, n_spec, rows, rows_rank, prefix,  # noqa: B023
                                                     draft_vocab=runner.draft_vocab_size))
        min_bytes = sum(parts.values())
        # The verify forward alone: without the draft program and the commit's second pass over the state.
        forward_min = min_bytes - parts["draft"] - (rows_rank * rb.state_per_slot * 2 if name == "verify" else 0)
        fwd_text, other_texts = fwd.as_text(), [p.as_text() for p in others]
        # jax.lax.ragged_dot reads only the experts with rows: the uniform-routing mean, as the FP8 kernel declares.
        touched = (routing.kernel_expected_experts(c.num_experts, c.num_experts_per_tok, ep, tokens_step)
                   / (c.num_experts // ep)) if c.num_experts else 1.0
        inplace = chip.inplace_stream_fraction
        # The commit's snapshot copy declares every row's state; it moves the rows that take a snapshot, as many
        # as the roofline counts (accept length / page size of them).
        charged = ({programs.SNAPSHOT_COPY: 2 * rows_rank * rb.state_per_slot
                    * step_bytes.snapshot_fraction(speculative_accept_length, page_size)}
                   if name == "verify" else None)
        rates = {"gdn_recurrent_flops_per_s": chip.gdn_recurrent_flops_per_s,
                 "gdn_chunked_flops_per_s": chip.gdn_chunked_flops_per_s,
                 "ragged_dot_mxu_fraction": chip.ragged_dot_mxu_fraction if chip.ragged_dot_mxu_points else None,
                 "grouped_ffn_mxu_fraction": chip.grouped_ffn_mxu_fraction}  # 1.0 (the peak) where unmeasured
        tr_f = programs.traffic(fwd_text, bw, peak, ragged_dot_fraction=touched, inplace_stream_fraction=inplace,
                                **rates)
        tr_o = [programs.traffic(t, bw, peak, 1, ragged_dot_fraction=touched, inplace_stream_fraction=inplace,
                                 custom_call_bytes=charged, **rates) for t in other_texts]
        tr_s = {k: sum(t[k] for t in tr_o) for k in ("bytes", "kernel_bytes", "serial_s", "declared_flops")}
        tr_s["top_excess"] = [e for t in tr_o for e in t["top_excess"]]
        bytes_accessed = tr_f["bytes"] + tr_s["bytes"]
        # Each row's new tokens at their mean visible context; lm_head for each row's last token.
        flops_model = rows_rank * (chunk_flops(c, tokens, prefix) + lm_head_flops(c))
        flops = max(cost["flops"] + cost_s["flops"], flops_model)
        t_mem, t_flops = min_bytes / bw, flops / peak
        t_roof = max(t_mem, t_flops)
        t_compiled = max(bytes_accessed / bw, t_flops)
        # Flops no kernel declares (XLA's dots, attention at its real context) run after the kernels.
        serial = tr_f["serial_s"] + tr_s["serial_s"] + max(0.0, flops - tr_f["declared_flops"]
                                                           - tr_s["declared_flops"]) / peak
        # Each program alone: its least bytes, its instructions one after another and the flops XLA counts in
        # it beyond what its kernels declare, at the peak (the step's serial time sums these, with the step's
        # analytic flops where they exceed XLA's).
        p_min = step_bytes.program_min_bytes(rb, name, parts, rows_rank=rows_rank, page_size=page_size,
                                             accept_length=speculative_accept_length)
        per_program: list[dict[str, Any]] = []
        for label, tr, pc in zip(_program_names(name), [tr_f, *tr_o], [cost, *other_costs], strict=True):
            flops_s = max(0.0, pc["flops"] - tr["declared_flops"]) / peak
            entry = {"program": label, "hlo_bytes": tr["bytes"], "min_bytes": p_min.get(label, 0.0),
                     "bytes_s": tr["serial_s"], "flops_s": flops_s, "serial_s": tr["serial_s"] + flops_s,
                     "top_excess": tr["top_excess"][:3]}
            if per_program and per_program[-1]["program"] == label:  # the commit's greedy branch, below
                last = per_program[-1]
                entry = {**{k: last[k] + entry[k] for k in ("hlo_bytes", "bytes_s", "flops_s", "serial_s")},
                         "program": label, "min_bytes": last["min_bytes"],
                         "top_excess": last["top_excess"] + entry["top_excess"]}
                per_program[-1] = entry
            else:
                per_program.append(entry)
        moe = moe_extra(c, ep, tokens_step, per_expert, name)
        coll = collectives.charge([fwd_text, *other_texts], chip_of, chip)
        step: dict[str, Any] = {
            "bucket": dataclasses.asdict(bucket), "rows": rows, "new_tokens_per_row": tokens,
            "context": prefix + tokens, "compile_s": round(compile_s, 1),
            "memory": {**mem, "fits": max(mem["total"], *(m["total"] for m in mem_others)) <= hbm_dev,
                       **({"commit_program": mem_others[0]} if name == "verify" else
                          {"sample_program": mem_others[-1]})},
            "flops": flops, "xla_flops": cost["flops"] + cost_s["flops"], "analytic_flops": flops_model,
            "bytes_accessed": bytes_accessed, "bytes_forward": tr_f["bytes"], "bytes_sample": tr_s["bytes"],
            "bytes_kernels": tr_f["kernel_bytes"] + tr_s["kernel_bytes"],
            "xla_cost_analysis_bytes": cost["bytes_accessed"] + cost_s["bytes_accessed"], "min_bytes": min_bytes,
            "min_bytes_parts": parts,
            "bytes_ratio": bytes_accessed / min_bytes,
            # The forward program alone (a verify step's target forward: its bytes against its own minimum).
            "forward_bytes_ratio": tr_f["bytes"] / forward_min,
            "roofline_s": t_roof, "roofline_bound": "memory" if t_mem >= t_flops else "compute",
            "roofline_tokens_per_s_per_chip": tokens_step / report["chips"] / t_roof,
            "compiled_time_s": t_compiled,
            "compiled_tokens_per_s_per_chip": tokens_step / report["chips"] / t_compiled,
            "serial_s": serial, "serial_extra_s": max(0.0, serial - t_compiled),
            "moe_extra": moe, "collective_s": coll,
            "top_excess": tr_f["top_excess"] + tr_s["top_excess"], "programs": per_program,
        }  # fmt: skip
        # Before collectives: the instructions one after another; the mean device at the distribution's mean
        # experts, the slowest at its expected maximum experts and pairs.
        step["mean_device_s"] = {d: serial + m["mean_bytes"] / bw for d, m in moe.items()}
        step["slowest_device_s"] = {d: serial + m["slowest_bytes"] / bw + m["slowest_flops"] / peak
                                    for d, m in moe.items()}
        step["planned_s"] = {d: step["slowest_device_s"][d] + coll["exposed"] for d in moe}
        step["planned_tokens_per_s_per_chip"] = tokens_step / report["chips"] / step["planned_s"]["uniform"]
        report["steps"][name] = step
    report["fits"] = worst_total <= hbm_dev
    report["memory"] = {"fits": report["fits"], "worst_total_per_device": worst_total, "hbm_per_device": hbm_dev}
    plain = compose_workloads(report, chip, c, kv_per_token)
    if n_spec:
        report["workloads_without_speculation"] = plain
        report["workloads"] = compose_workloads(report, chip, c, kv_per_token, decode_step="verify",
                                                tokens_per_step=speculative_accept_length)
    else:
        report["workloads"] = plain
    # The published measurements ran without speculation: calibrate against the plan without it.
    report["calibration"] = calibrate(plain, report)
    return report


def _program_names(name: str) -> list[str]:
    """The programs of step ``name`` in :func:`_compile_step`'s order (step_bytes.program_min_bytes's keys; a
    name twice is one served program planned in two parts)."""
    return ["verify", "commit", "commit"] if name == "verify" else ["forward", "sample"]


def _compile_step(runner: Any, name: str, bucket: Any, n_spec: int) -> list[Any]:
    """The compiled programs of step ``name``: the forward first, then the rest the step runs (the sampling
    program; for "verify" the commit program of the server's greedy verify step, then the greedy sampling
    program of its positions: the commit samples in a ``lax.cond`` branch, and the HLO traffic count takes a
    conditional's cheapest branch, so the same greedy function compiled alone stands for that branch)."""
    if name != "verify":
        return [runner.lower_forward(bucket).compile(), runner.lower_sample("greedy", bucket.batch).compile()]
    b = bucket.batch
    return ([runner.programs.lower(k).compile() for k in [("verify", b), ("commit", b)]]
            + [runner.lower_sample("greedy", b * n_spec).compile()])
