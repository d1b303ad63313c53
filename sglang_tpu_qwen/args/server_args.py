"""ServerArgs: every launch option in one dataclass; the argparse parser is built from it.

Flag names mirror SGLang's `python -m sglang.launch_server` (`--model-path`, `--page-size`, ...): a
field `page_size` becomes `--page-size`. Unknown flags are rejected by argparse with a clear message.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from sglang_tpu_qwen.utils.host_allocator import TPU_DEVICE_FILES, accelerator_device_files, cpu_only_host

logger = logging.getLogger(__name__)

# Fewest prompt tokens a DP rank's prefill step may be bounded to: the smallest compiled extend size
# (engine/runner/buckets.py MIN_EXTEND_TOKENS is this value); a smaller budget would pad every step to it.
MIN_PREFILL_CHUNK = 16
# --page-size defaults: the Pallas attention kernel's on a TPU (the fastest page measured on v5e: 64 streamed decode
# KV at 490 GB/s against 316 for 256, docs/performance.md; a multiple of every dtype's sublane tile), and 16
# elsewhere (the jnp reference, prefix-cache granularity on small CPU runs).
TPU_PAGE_SIZE, DEFAULT_PAGE_SIZE = 64, 16


def default_page_size(attention_backend: str) -> int:
    """--page-size's default for ``--attention-backend``: :data:`TPU_PAGE_SIZE` where the Pallas kernel runs on a
    TPU (``auto`` or ``pallas`` on a host with a TPU device file that JAX_PLATFORMS does not send to the CPU),
    else :data:`DEFAULT_PAGE_SIZE`. Decided without initialising JAX (flags are parsed before it starts)."""
    tpu = not cpu_only_host() and bool(accelerator_device_files(TPU_DEVICE_FILES))
    return TPU_PAGE_SIZE if tpu and attention_backend in ("auto", "pallas") else DEFAULT_PAGE_SIZE
# --kv-cache-dtype choices: SGLang's names for what is implemented (SGLang also has fp8_e5m2 and fp4_e2m1).
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3")
# Images a request may carry without --limit-mm-data-per-request (SGLang has no limit by default; a bound keeps
# one request from making the server decode an unbounded number of images).
DEFAULT_IMAGES_PER_REQUEST = 32
# --speculative-algorithm values served: SGLang's NEXTN and EAGLE both draft with the checkpoint's MTP layer here.
SPECULATIVE_ALGORITHMS = ("NEXTN", "EAGLE")


@dataclass
class ServerArgs:
    """Launch options of the server and the in-process Engine.

    Memory sizes are in tokens (KV) or requests (GDN slots); 0 or None means "derive a default".
    """

    model_path: str | None = field(
        default=None, metadata={"help": "HF model directory; default: the embedded tiny Qwen3.5-MoE."}
    )
    tokenizer_path: str | None = field(default=None, metadata={"help": "Tokenizer dir (default: model path)."})
    served_model_name: str | None = field(default=None, metadata={"help": "Model name in the OpenAI API."})
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP host."})
    port: int = field(default=30000, metadata={"help": "HTTP port."})
    api_key: str | None = field(default=None, metadata={"help": "Require 'Authorization: Bearer KEY'."})
    log_level: str = field(default="info", metadata={"help": "Python log level."})
    enable_metrics: bool = field(
        default=False, metadata={"help": "Expose Prometheus /metrics (unauthenticated, also with --api-key)."})
    log_requests: bool = field(default=False, metadata={
        "help": "Log metadata, inputs, outputs of all requests (verbosity: --log-requests-level). Off: the "
                "server logs no prompt or output text."})
    log_requests_level: int = field(default=2, metadata={
        "help": "0: metadata (no sampling parameters). 1: metadata and sampling parameters. 2: metadata, "
                "sampling parameters and partial input/output. 3: every input/output."})
    profile_dir: str | None = field(default=None, metadata={
        "help": "Where /start_profile writes jax.profiler traces (default: $SGLANG_TORCH_PROFILER_DIR, else a "
                "fresh temp dir)."})
    dtype: str = field(
        default="auto",
        metadata={"help": "Compute dtype: auto (float32 on CPU, bfloat16 on TPU/GPU), float32, bfloat16."},
    )
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "KV cache storage dtype (SGLang's flag): auto (the compute dtype), bf16 / bfloat16, or fp8_e4m3 "
                "(float8_e4m3fn pages, 2x the tokens per byte, scaled by the checkpoint's per-layer k_scale / "
                "v_scale, else 1.0)."})
    quantization: str | None = field(default=None, metadata={
        "help": "fp8: quantise a bf16 checkpoint's linear weights to 128x128-block FP8 on load (block-FP8 "
                "checkpoints stay FP8 without it)."})
    weights_manifest: str | None = field(default=None, metadata={
        "help": "JSON file name -> sha256 (tools.weights_manifest writes one): refuse to start on a missing, "
                "extra or mismatching weight file, checked while loading."})
    context_length: int | None = field(default=None, metadata={"help": "Max prompt + output tokens."})
    tp_size: int = field(default=1, metadata={"help": "Tensor-parallel size."})
    dp_size: int = field(default=1, metadata={"help": "Data-parallel (attention) size."})
    ep_size: int = field(default=1, metadata={"help": "Expert-parallel size."})
    page_size: int | None = field(default=None, metadata={
        "help": "Tokens per KV page. Default: 64 where the Pallas attention kernel runs on a TPU (--attention-backend "
                "auto or pallas on a host with a TPU; the fastest measured on v5e, docs/performance.md), else 16."})
    chunked_prefill_size: int | None = field(default=None, metadata={
        "help": "Max prompt tokens per prefill step over all DP ranks; each rank prefills its 1/--dp-size share "
                "(SGLang's rule under DP attention), at least 16 tokens. Default by device memory as SGLang: 8192 "
                "on a 60-160 GB device (an Ironwood TensorCore has 96 GiB), 16384 above, 4096 / 2048 below; 512 "
                "on CPU. Chunking cannot be turned off (every step runs in a compiled bucket)."})
    max_running_requests: int = field(default=32, metadata={
        "help": "Max requests running at once, over all DP ranks."})
    max_total_tokens: int | None = field(default=None, metadata={"help": "KV pool size in tokens."})
    max_prefill_tokens: int = field(default=16384, metadata={
        "help": "Max prompt tokens per prefill step of a DP rank (with --chunked-prefill-size's share, the smaller "
                "bounds the step). Default 16384, SGLang's."})
    mem_fraction_static: float = field(
        default=0.8, metadata={"help": "Fraction of device memory for weights + KV pool (accelerators)."}
    )
    random_seed: int = field(default=0, metadata={"help": "Seed for sampling without a per-request seed."})
    stream_interval: int = field(default=1, metadata={"help": "Decode steps between streamed chunks."})
    skip_server_warmup: bool = field(default=False, metadata={"help": "Skip the warm-up request at start."})
    # Compiled programs (engine/runner/buckets.py, engine/runner/compilation.py).
    disable_precompile: bool = field(default=False, metadata={
        "help": "Do not compile every step bucket and sampling program at startup; compile each on first use."})
    precompile_bs_paddings: list[int] | None = field(default=None, metadata={
        "help": "Batch sizes (rows per DP rank) of the compiled buckets (default: 1 and the powers of two from 4 up "
                "to --max-running-requests per rank); the largest must hold every running request of a rank."})
    precompile_token_paddings: list[int] | None = field(default=None, metadata={
        "help": "New tokens per row of the compiled extend buckets (default: powers of four from 16, and "
                "a DP rank's share of --chunked-prefill-size rounded up to a power of two)."})
    compilation_cache_dir: str | None = field(default=None, metadata={
        "help": "JAX persistent compilation cache directory (default ~/.cache/sglang_tpu_qwen/jax_cache; "
                "'none' turns it off)."})
    watchdog_timeout: float = field(default=300.0, metadata={
        "help": "Seconds a step may run before /health reports the server unhealthy (SGLang's flag; <= 0: off)."})
    incremental_streaming_output: bool = field(default=False, metadata={
        "help": "Streamed /generate chunks carry only the new text, ids and logprobs (SGLang's flag)."})
    # Prefix cache (radix tree over KV pages + GDN state snapshots).
    disable_radix_cache: bool = field(default=False, metadata={"help": "Turn the prefix cache off."})
    schedule_policy: str = field(default="lpm", metadata={"help": "lpm (longest prefix match) or fcfs."})
    disable_overlap_schedule: bool = field(default=False, metadata={
        "help": "Run each step synchronously: by default the host builds step N+1 while step N runs on the "
                "device (finish checks and streaming then apply one step late)."})
    mamba_full_memory_ratio: float = field(default=0.9, metadata={
        "help": "GDN state pool : KV pool bytes (SGLang's flag, its default 0.9). Per DP rank, the state slots "
                "(running requests first, then the prefix cache's snapshots) get r / (1 + r) of the memory left "
                "after the weights (device limit x --mem-fraction-static - weights), the KV pages the rest; "
                "with --max-total-tokens on a device, the state slots get what is left after the KV pool; without "
                "a device memory limit (CPU), r times the KV pool's bytes. Must be > 0."})
    max_mamba_cache_size: int | None = field(default=None, metadata={
        "help": "GDN state slots over all DP ranks, running requests included (SGLang's flag): replaces the "
                "--mamba-full-memory-ratio share; the rest beyond the running requests are snapshot slots. At "
                "least --max-running-requests."})
    max_gdn_snapshots: int | None = field(default=None, metadata={
        "help": "GDN state snapshot slots of the prefix cache per DP rank: overrides --mamba-full-memory-ratio "
                "and --max-mamba-cache-size (default: as many as the ratio's share holds beyond the running "
                "requests)."})
    mamba_ssm_dtype: str | None = field(default=None, metadata={
        "help": "Storage dtype of the GDN (Mamba-style) recurrent and conv state in running slots, snapshots, "
                "the host tier and the PD wire: float32 or bfloat16 (SGLang's flag). Default: the checkpoint "
                "config's mamba_ssm_dtype, float32 when absent. The kernels compute in float32 either way."})
    gdn_snapshot_host_gb: float | None = field(default=None, metadata={
        "help": "Host memory (GiB) that GDN snapshots evicted from the device may move to (the host tier); 0: off. "
                "Default: 25% of the host memory available at start, at most 128 GiB (memory/host_budget.py): a "
                "cap on what is stored, not an allocation; a demotion that would leave under 10% of the host's "
                "memory available is refused."})
    debug_nan_fill_freed_slots: bool = field(
        default=False, metadata={"help": "Fill freed GDN slots with NaN so a stale read fails loudly."}
    )
    # Speculative decoding with the checkpoint's MTP layer (SGLang's flags; engine/scheduler/speculative.py).
    speculative_algorithm: str | None = field(default=None, metadata={
        "help": "NEXTN (or EAGLE, SGLang's other name for it with this model): draft with the checkpoint's "
                "multi-token-prediction layer (mtp.*) and verify every draft in one target step. Other SGLang "
                "algorithms (EAGLE3, STANDALONE, NGRAM) are refused."})
    speculative_num_steps: int | None = field(default=None, metadata={
        "help": "Draft tokens per request per step: the MTP layer run recursively this many times (default 3)."})
    speculative_eagle_topk: int | None = field(default=None, metadata={
        "help": "Draft candidates per step; only 1 (a chain, no tree) is implemented (default 1)."})
    speculative_num_draft_tokens: int | None = field(default=None, metadata={
        "help": "Tokens per request in a verify step: with top-k 1 always --speculative-num-steps + 1 (SGLang "
                "adjusts another value the same way, with a warning)."})
    speculative_token_map: str | None = field(default=None, metadata={
        "help": "Hot token ids the MTP drafts choose among (SGLang's FR-Spec map: a .pt file as SGLang loads it, or "
                "a .json list / .npy array of ids): each draft pass reads their lm_head rows, not the whole "
                "vocabulary. Verification scores the whole vocabulary, so outputs do not change "
                "(engine/runner/token_map.py)."})
    speculative_draft_policy: str = field(default="adaptive", metadata={
        "help": "adaptive (ours): a decode step verifies drafts only while the drafts' expected accepted tokens "
                "pay for the verify step's measured cost over a plain decode step (engine/scheduler/"
                "speculative.py); always: every decode step verifies."})
    # Kernels.
    attention_backend: str = field(default="auto", metadata={"help": "auto, pallas or reference."})
    gdn_backend: str = field(default="auto", metadata={
        "help": "auto, pallas, reference, or xla-chunked (the fused kernel for decode, the chunked form of prefill "
                "as batched XLA products: a candidate for the TPU's prefill)."})
    moe_runner_backend: str = field(default="auto", metadata={
        "help": "SGLang's flag with our kernels: auto (pallas on a TPU, else reference), pallas (the Pallas "
                "block-FP8 grouped matmul, kernels/fp8_matmul) or reference (FP8 weights dequantised in XLA, then "
                "ragged_dot). Runs the routed experts and every block-FP8 linear layer; dense weights use "
                "ragged_dot / XLA's matmul under both."})
    sampling_backend: str = field(default="auto", metadata={
        "help": "SGLang's flag with our kernels: auto (pallas on a TPU, else reference), pallas (greedy rows' "
                "tokens from a Pallas kernel that reads the bfloat16 lm_head once and writes no logits, "
                "kernels/greedy_head) or reference (XLA's product and argmax). Sampling with temperature, "
                "penalties, grammars or logprobs runs in XLA under both."})
    # Constrained decoding (sglang_tpu_qwen/grammar).
    grammar_backend: str = field(
        default="xgrammar", metadata={"help": "xgrammar, llguidance or none (constrained requests get a 400)."}
    )
    constrained_json_disable_any_whitespace: bool = field(
        default=False, metadata={"help": "JSON Schema output without free whitespace between tokens."}
    )
    constrained_json_whitespace_pattern: str | None = field(default=None, metadata={
        "help": "Regex of the whitespace JSON Schema output may hold between tokens (SGLang's flag; default "
                "grammar/whitespace.py DEFAULT_JSON_WHITESPACE: a run of at most 8 spaces, newlines or tabs)."})
    # OpenAI chat output parsers (sglang_tpu_qwen/parsers).
    reasoning_parser: str | None = field(
        default=None, metadata={"help": "Split reasoning into reasoning_content: qwen3 (Qwen3 / Qwen3.5)."}
    )
    tool_call_parser: str | None = field(
        default=None, metadata={"help": "Parse tool calls into tool_calls: qwen3_coder (Qwen3.5 XML format)."}
    )
    # Image inputs (sglang_tpu_qwen/multimodal): where images may come from and how large they may be.
    allowed_local_media_path: str | None = field(default=None, metadata={
        "help": "Directory whose files requests may name as images (an absolute path or a file:// URL), as vLLM's "
                "flag; symlinks are resolved before the check. Default: no local files."})
    allowed_media_domains: list[str] | None = field(default=None, metadata={
        "help": "Host names whose http(s) image URLs the server fetches (SGLang's and vLLM's flag); redirects are "
                "not followed. Default: none, every remote URL is a 400."})
    media_url_max_file_size_mb: float = field(default=64.0, metadata={
        "help": "Largest encoded image, in MiB, from any source: a data: URL or base64 string, a local file or a "
                "fetched URL (SGLang's flag and default)."})
    limit_mm_data_per_request: dict[str, int] | None = field(default=None, metadata={
        "help": "Most inputs per request by modality, JSON (SGLang's flag), e.g. '{\"image\": 4}'; only \"image\" "
                "is served. Default: {\"image\": 32}."})
    max_image_pixels: int = field(default=2**25, metadata={
        "help": "Largest decoded image, width x height, checked from the image header before any pixel is "
                "decoded (Pillow's MAX_IMAGE_PIXELS idea); larger images are a 400. Default 2^25 = 33554432 "
                "(an 8K UHD frame)."})
    # The vision tower (engine/runner/vision_encoder.py): its encoder cache and its largest compiled bucket.
    mm_embedding_cache_size_mb: float | None = field(default=None, metadata={
        "help": "Encoder cache: MiB of image embeddings kept on each device by image content, so a repeated image "
                "skips the vision tower (sglang-jax's flag; SGLang sizes it with SGLANG_VLM_CACHE_SIZE_MB, read "
                "here when the flag is absent). Default 512; 0 turns the cache off. Counted before the KV pool."})
    mm_max_patches: int | None = field(default=None, metadata={
        "help": "Patches of the vision tower's largest compiled bucket, rounded up to a power of two: the largest "
                "image after resizing. Images are resized to at most this many patches (fewer than the "
                "checkpoint's preprocessor allows, if it allows more). Default: the preprocessor's largest image, "
                "at most 16384 patches (4 Mpx at 16-pixel patches)."})
    # Parallelism.
    moe_combine: str = field(default="hierarchical", metadata={"help": "MoE reduce-scatter: flat or hierarchical."})
    nnodes: int = field(default=1, metadata={"help": "Number of hosts (JAX processes)."})
    node_rank: int = field(default=0, metadata={
        "help": "This host's rank. Only 0: multi-host serving is not implemented yet."})
    dist_init_addr: str | None = field(default=None, metadata={
        "help": "host:port of the rank-0 coordinator. Refused: multi-host serving is not implemented yet."})
    # Prefill/decode disaggregation (sglang_tpu_qwen/disagg).
    disaggregation_mode: str = field(default="null", metadata={
        "help": "null, prefill, decode, or colocated-split (a prefill and a decode engine on two device groups "
                "of this process, each with its own HTTP port)."})
    disaggregation_bootstrap_port: int = field(
        default=8998, metadata={"help": "Prefill server: port the decode servers fetch request state from."})
    disaggregation_transfer_backend: str = field(default="auto", metadata={
        "help": "auto (inprocess for colocated-split, else tcp), tcp, or inprocess (colocated-split only)."})
    disaggregation_timeout: float = field(default=300.0, metadata={
        "help": "Prefill: seconds unfetched state is kept, and a fetch waits for its request to arrive; decode: "
                "seconds of silence from a prefill server before a waiting request fails."})
    disaggregation_decode_port: int | None = field(
        default=None, metadata={"help": "colocated-split: HTTP port of the decode engine (default --port + 1)."})
    disaggregation_prefill_devices: int | None = field(default=None, metadata={
        "help": "colocated-split: devices of the prefill engine, the first N (default half); decode gets the rest."})

    def __post_init__(self) -> None:
        if self.page_size is None:
            self.page_size = default_page_size(self.attention_backend)
        if self.page_size <= 0:
            raise ValueError(f"--page-size must be positive, got {self.page_size}")
        for name in ("tp_size", "dp_size", "ep_size", "max_running_requests", "max_prefill_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size <= 0:
            raise ValueError(f"--chunked-prefill-size must be positive, got {self.chunked_prefill_size}: chunked "
                             "prefill cannot be turned off here (every prefill step runs in a compiled bucket)")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size // self.dp_size < MIN_PREFILL_CHUNK:
            raise ValueError(f"--chunked-prefill-size {self.chunked_prefill_size} is split over the {self.dp_size} "
                             f"DP ranks: each rank needs at least {MIN_PREFILL_CHUNK} prompt tokens per step, so "
                             f"at least {MIN_PREFILL_CHUNK * self.dp_size}")
        choices = {"schedule_policy": ("lpm", "fcfs"), "attention_backend": ("auto", "pallas", "reference"),
                   "gdn_backend": ("auto", "pallas", "reference", "xla-chunked"),
                   "moe_runner_backend": ("auto", "pallas", "reference"),
                   "sampling_backend": ("auto", "pallas", "reference"), "moe_combine": ("flat", "hierarchical"),
                   "grammar_backend": ("xgrammar", "llguidance", "none"),
                   "kv_cache_dtype": KV_CACHE_DTYPES, "speculative_draft_policy": ("adaptive", "always")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}")
        if self.kv_cache_dtype.startswith("fp8"):
            self._check_fp8_page_size()
        if self.log_requests_level not in (0, 1, 2, 3):
            raise ValueError(f"--log-requests-level must be one of 0, 1, 2, 3, got {self.log_requests_level}")
        if self.mamba_ssm_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"--mamba-ssm-dtype must be float32 or bfloat16, got {self.mamba_ssm_dtype!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"--quantization must be fp8 (or absent), got {self.quantization!r}")
        for name in ("precompile_bs_paddings", "precompile_token_paddings"):
            values = getattr(self, name)
            if values is not None and (not values or any(not isinstance(v, int) or v <= 0 for v in values)):
                raise ValueError(f"--{name.replace('_', '-')} must be positive integers, got {values}")
        if self.gdn_snapshot_host_gb is not None and not self.gdn_snapshot_host_gb >= 0:
            raise ValueError(f"--gdn-snapshot-host-gb must be >= 0 (0: no host tier), got {self.gdn_snapshot_host_gb}")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"--mem-fraction-static must be in (0, 1], got {self.mem_fraction_static}")
        self._check_state_budget()
        self._check_media()
        from sglang_tpu_qwen.parsers.chat_output import REASONING_PARSERS, TOOL_CALL_PARSERS

        for name, allowed in (("reasoning_parser", REASONING_PARSERS), ("tool_call_parser", TOOL_CALL_PARSERS)):
            if getattr(self, name) is not None and getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}")
        self._check_disaggregation()
        self._check_multihost()
        self._check_speculative()

    def _check_speculative(self) -> None:
        """Resolve the speculative flags as SGLang does for a model with an MTP layer, and refuse what is not
        implemented. Raises ValueError naming the flag."""
        flags = {"--speculative-num-steps": self.speculative_num_steps,
                 "--speculative-eagle-topk": self.speculative_eagle_topk,
                 "--speculative-num-draft-tokens": self.speculative_num_draft_tokens,
                 "--speculative-token-map": self.speculative_token_map}
        if self.speculative_algorithm is None:
            given = [f for f, v in flags.items() if v is not None]
            if given:
                raise ValueError(f"{', '.join(given)} given without --speculative-algorithm")
            return
        algo = self.speculative_algorithm.upper()
        if algo in ("EAGLE3", "STANDALONE", "NGRAM"):
            raise ValueError(f"--speculative-algorithm {self.speculative_algorithm} is not implemented: this "
                             "runtime drafts with the checkpoint's MTP layer (NEXTN, or EAGLE)")
        if algo not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"--speculative-algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}, got "
                             f"{self.speculative_algorithm!r}")
        self.speculative_algorithm = algo
        if self.speculative_num_steps is None:
            self.speculative_num_steps = 3
        if self.speculative_eagle_topk is None:
            self.speculative_eagle_topk = 1
        if self.speculative_num_steps < 1:
            raise ValueError(f"--speculative-num-steps must be >= 1, got {self.speculative_num_steps}")
        if self.speculative_eagle_topk != 1:
            raise ValueError(f"--speculative-eagle-topk {self.speculative_eagle_topk} is not implemented: drafts "
                             "are a chain (top-k 1), not a tree")
        chain = self.speculative_num_steps + 1
        if self.speculative_num_draft_tokens is not None and self.speculative_num_draft_tokens != chain:
            logger.warning("--speculative-num-draft-tokens %d is adjusted to --speculative-num-steps + 1 = %d "
                           "with --speculative-eagle-topk 1 (as SGLang does)", self.speculative_num_draft_tokens,
                           chain)
        self.speculative_num_draft_tokens = chain

    def _check_fp8_page_size(self) -> None:
        """The attention backend's KV pool layout may pack FP8 tokens into rows (the token-major layout stores
        up to 4 per 32-bit TPU sublane row, kernels/ragged_paged_attention/token_major.py): the page size must
        be a multiple of what the layout asks. Raises ValueError naming both flags."""
        import jax.numpy as jnp  # here: parsing flags does not import JAX

        from sglang_tpu_qwen.kernels.dispatch import page_multiple

        multiple = page_multiple(self.attention_backend, jnp.float8_e4m3fn)
        if self.page_size % multiple:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} needs a --page-size that is a multiple of "
                             f"{multiple} (FP8 pages pack up to {multiple} tokens per TPU sublane row), got "
                             f"{self.page_size}")

    def _check_state_budget(self) -> None:
        """Refuse GDN state budgets that mean nothing (engine/runner/memory_split.py uses them). Raises ValueError."""
        if not self.mamba_full_memory_ratio > 0:
            raise ValueError(f"--mamba-full-memory-ratio must be > 0 (GDN state bytes : KV bytes), got "
                             f"{self.mamba_full_memory_ratio}")
        if self.max_mamba_cache_size is not None and self.max_mamba_cache_size < self.max_running_requests:
            raise ValueError(f"--max-mamba-cache-size {self.max_mamba_cache_size} must hold at least the "
                             f"{self.max_running_requests} running requests (--max-running-requests): it counts "
                             "their GDN slots too")
        if self.max_gdn_snapshots is not None and self.max_gdn_snapshots < 0:
            raise ValueError(f"--max-gdn-snapshots must be >= 0, got {self.max_gdn_snapshots}")
        if self.max_gdn_snapshots is not None and self.max_mamba_cache_size is not None:
            raise ValueError("give --max-gdn-snapshots or --max-mamba-cache-size, not both: each sets the GDN "
                             "snapshot slots")
        if self.max_total_tokens is not None and self.max_total_tokens < 0:
            raise ValueError(f"--max-total-tokens must be positive, got {self.max_total_tokens}")

    def _check_media(self) -> None:
        """Refuse image-input limits that mean nothing (sglang_tpu_qwen/multimodal reads them). Raises ValueError."""
        if not self.media_url_max_file_size_mb > 0:
            raise ValueError(f"--media-url-max-file-size-mb must be > 0, got {self.media_url_max_file_size_mb}")
        if self.max_image_pixels <= 0:
            raise ValueError(f"--max-image-pixels must be positive, got {self.max_image_pixels}")
        limits = self.limit_mm_data_per_request
        if limits is not None:
            if not isinstance(limits, dict):
                raise ValueError(f"--limit-mm-data-per-request must be a JSON object, got {limits!r}")
            for key, value in limits.items():
                if key not in ("image", "video", "audio"):
                    raise ValueError(f"--limit-mm-data-per-request: unknown modality {key!r} (image, video, audio)")
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"--limit-mm-data-per-request: {key} must be an integer >= 0, got {value!r}")
                if key != "image" and value > 0:
                    raise ValueError(f"--limit-mm-data-per-request: {key} inputs are not served (images only)")
        if self.mm_embedding_cache_size_mb is not None and not self.mm_embedding_cache_size_mb >= 0:
            raise ValueError(f"--mm-embedding-cache-size-mb must be >= 0 (0: no encoder cache), got "
                             f"{self.mm_embedding_cache_size_mb}")
        if self.mm_max_patches is not None and self.mm_max_patches <= 0:
            raise ValueError(f"--mm-max-patches must be positive, got {self.mm_max_patches}")
        if self.allowed_local_media_path is not None:
            import os

            if not os.path.isdir(self.allowed_local_media_path):
                raise ValueError(f"--allowed-local-media-path {self.allowed_local_media_path!r} is not a directory")

    @property
    def speculative_steps(self) -> int:
        """Draft tokens per request per step: --speculative-num-steps when speculative decoding is on, else 0."""
        return (self.speculative_num_steps or 0) if self.speculative_algorithm else 0

    @property
    def max_images_per_request(self) -> int:
        """Images one request may carry: --limit-mm-data-per-request's "image", else DEFAULT_IMAGES_PER_REQUEST."""
        limits = self.limit_mm_data_per_request or {}
        return int(limits.get("image", DEFAULT_IMAGES_PER_REQUEST))

    def _check_multihost(self) -> None:
        """Refuse the multi-host flags nothing reads yet, so a multi-host launch fails at start, not later.

        --nnodes > 1 is refused by the Engine (engine/engine.py); --node-rank and --dist-init-addr only mean
        something there, and silently accepting them would let a second host start as an unrelated server.
        Raises ValueError naming the flag.
        """
        given = {"--node-rank": self.node_rank != 0, "--dist-init-addr": self.dist_init_addr is not None}
        for flag, present in given.items():
            if present:
                raise ValueError(f"{flag} is not supported: multi-host serving is not implemented yet "
                                 "(parallel/multihost.py holds the mesh side; the scheduler is single-host)")

    def resolve_chunked_prefill_size(self, backend: str, device_bytes: int | None) -> None:
        """Fill in --chunked-prefill-size's default when the devices are known, as SGLang does at start.

        Args:
            backend: the JAX backend, "cpu", "tpu" or "gpu". CPU: 512 (XLA:CPU compiles and runs an 8192-token
                step slowly, and the embedded model needs no more).
            device_bytes: one device's memory (its ``bytes_limit``), None when unknown. Accelerators take
                SGLang's table (srt/arg_groups/memory_hook.py): under 20 GB 2048, under 60 GB 4096, under
                160 GB 8192, else 16384; unknown memory 8192.
        """
        if self.chunked_prefill_size is not None:
            return
        if backend == "cpu":
            size = 512
        elif device_bytes is None:
            size = 8192
        else:
            gib = device_bytes / 2**30
            size = 2048 if gib < 20 else 4096 if gib < 60 else 8192 if gib < 160 else 16384
        self.chunked_prefill_size = max(size, MIN_PREFILL_CHUNK * self.dp_size)

    @property
    def chunked_prefill_per_rank(self) -> int:
        """Prompt tokens one DP rank prefills per step: --chunked-prefill-size // --dp-size (SGLang divides it
        so under DP attention; every --dp-size here is DP attention). Raises ValueError before
        resolve_chunked_prefill_size."""
        if self.chunked_prefill_size is None:
            raise ValueError("--chunked-prefill-size is not resolved yet (resolve_chunked_prefill_size)")
        return self.chunked_prefill_size // self.dp_size

    def _check_disaggregation(self) -> None:
        modes = ("null", "prefill", "decode", "colocated-split")
        if self.disaggregation_mode not in modes:
            raise ValueError(f"--disaggregation-mode must be one of {', '.join(modes)}")
        if self.disaggregation_transfer_backend not in ("auto", "tcp", "inprocess"):
            raise ValueError("--disaggregation-transfer-backend must be one of auto, tcp, inprocess")
        if not 0 <= self.disaggregation_bootstrap_port <= 65535:
            raise ValueError(f"--disaggregation-bootstrap-port must be a TCP port (0-65535), got "
                             f"{self.disaggregation_bootstrap_port}")
        if self.disaggregation_timeout <= 0:
            raise ValueError(f"--disaggregation-timeout must be positive, got {self.disaggregation_timeout}")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one `--flag-name` per field; booleans become store_true switches."""
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse reads % as a format directive
            hint = hints[f.name]
            if hint is bool:
                parser.add_argument(flag, action="store_true", default=f.default, help=help_text)
                continue
            if "list[int]" in str(hint):
                parser.add_argument(flag, type=int, nargs="+", default=f.default, help=help_text)
                continue
            if "list[str]" in str(hint):
                parser.add_argument(flag, type=str, nargs="+", default=f.default, help=help_text)
                continue
            if "dict[" in str(hint):  # a JSON object, as SGLang's json.loads-typed flags
                parser.add_argument(flag, type=_json_object, default=f.default, help=help_text)
                continue
            py_type = _scalar_type(hint)
            parser.add_argument(flag, type=py_type, default=f.default, help=help_text)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        """Build ServerArgs from a namespace produced by a parser that `add_cli_args` filled."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        """Build from keyword arguments (the Engine API); an unknown name raises TypeError naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)


def _json_object(text: str) -> dict[str, Any]:
    """argparse type of a JSON-object flag; raises ArgumentTypeError (a usage error) on anything else."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _scalar_type(hint: Any) -> type:
    """The concrete type of `int | None`-style hints, for argparse."""
    for candidate in (int, float, str):
        if hint is candidate or candidate in getattr(hint, "__args__", ()):
            return candidate
    return str


def prepare_server_args(argv: list[str] | None = None) -> ServerArgs:
    """Parse command-line flags (SGLang names) into ServerArgs; exits with code 2 on an unknown flag or bad value."""
    parser = argparse.ArgumentParser(
        prog="python -m sglang_tpu_qwen.launch_server",
        description="SGLang-compatible server for Qwen3.5-MoE in JAX.",
        allow_abbrev=False,
    )
    ServerArgs.add_cli_args(parser)
    try:
        return ServerArgs.from_cli_args(parser.parse_args(argv))
    except ValueError as e:  # a bad value: usage message and exit code 2, like an unknown flag
        parser.error(str(e))
