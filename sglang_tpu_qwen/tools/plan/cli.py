"""``python -m sglang_tpu_qwen.tools.plan``: argument parsing, printing, the JSON file."""

from __future__ import annotations

import argparse
import json
from typing import Any

from sglang_tpu_qwen.args.server_args import KV_CACHE_DTYPES
from sglang_tpu_qwen.tools.plan.build import plan
from sglang_tpu_qwen.tools.plan.models import load_model_config
from sglang_tpu_qwen.tools.plan.report import format_report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, plan, print the table and the report as one JSON line; return the report."""
    ap = argparse.ArgumentParser(prog="python -m sglang_tpu_qwen.tools.plan",
                                 description="Deviceless AOT plan of the server's step programs for a TPU topology")
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
                    help="server flag: GDN prefix-cache snapshot slots per DP rank (default: what the server's memory "
                         "rule leaves after the weights, KV and running slots, engine/runner/memory_split.py)")
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                    help="server flag: KV page dtype (auto: the compute dtype, bfloat16 on TPU; fp8_e4m3 halves "
                         "the pool's bytes per token)")
    ap.add_argument("--mamba-ssm-dtype", choices=("float32", "bfloat16"), default=None,
                    help="server flag: GDN state storage dtype (default: the model config's mamba_ssm_dtype)")
    ap.add_argument("--speculative-num-draft-tokens", type=int, default=0,
                    help="server flag: MTP speculative decoding (NEXTN, top-k 1) with this many tokens per request "
                         "in a verify step; the verify, commit and draft programs are compiled as the 'verify' step")
    ap.add_argument("--speculative-accept-length", type=float, default=None,
                    help="tokens a request gains per verify step (SGLang's accept length, e.g. 3.2) to compose the "
                         "workloads with; required with --speculative-num-draft-tokens")
    ap.add_argument("--speculative-token-map", default=None,
                    help="server flag: the hot token ids the drafts choose among (a .pt, .json or .npy file); the "
                         "draft passes read only their lm_head rows")
    ap.add_argument("--json", help="also write the report here")
    a = ap.parse_args(argv)
    hf_block = [int(x) for x in a.fp8_block.split(",")]
    block = (hf_block[1], hf_block[0])  # HF [out, in] blocks; our matrices are [in, out]
    report = plan(
        load_model_config(a.model_config), a.topology, a.dp, a.ep, a.max_running_requests, a.context_length,
        fp8=a.fp8, block=block, page_size=a.page_size, chunked_prefill_size=a.chunked_prefill_size,
        combine=a.moe_combine, steps=tuple(x for x in a.steps.split(",") if x), max_gdn_snapshots=a.max_gdn_snapshots,
        kv_cache_dtype=a.kv_cache_dtype,
        mamba_ssm_dtype=a.mamba_ssm_dtype, speculative_num_draft_tokens=a.speculative_num_draft_tokens,
        speculative_accept_length=a.speculative_accept_length, speculative_token_map=a.speculative_token_map,
    )
    print(format_report(report))
    print(json.dumps(report))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return report
