"""How much a model runner holds: KV pages, GDN slots, context and prefill sizes (a plain frozen object).

`RunnerSizing.build` computes it from the model config, the server flags and the memory the weights leave on
the fullest device, split between GDN slots and KV pages by engine/runner/memory_split.py's rule (SGLang's
--mamba-full-memory-ratio). The server and the planner both get theirs there (ModelRunner.__init__). Server
flags whose defaults depend on the devices (--chunked-prefill-size) are resolved before, once, by
`resolve_device_defaults`; nothing here changes a ServerArgs.

Per DP rank: page 0 and slot 0 are the rank's trash targets; slots [1, R] hold running requests and
(R, R + S] the prefix cache's GDN snapshots. Rank r's global ids start at r * num_pages / r * num_slots.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.args.server_args import ServerArgs
from sglang_tpu_qwen.engine.runner import memory_accounting, memory_split, sampler
from sglang_tpu_qwen.engine.runner.buckets import BucketSet, decode_batch_sizes
from sglang_tpu_qwen.engine.runner.memory_accounting import CacheUnits
from sglang_tpu_qwen.engine.runner.memory_split import MemorySplit
from sglang_tpu_qwen.kernels.dispatch import KernelBackends
from sglang_tpu_qwen.model.config import Qwen35MoeConfig

logger = logging.getLogger(__name__)

# --mamba-ssm-dtype choices (SGLang's flag; SGLang also takes float16, which no Qwen3.5 release asks for).
STATE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_state_dtype(flag: str | None, config: Qwen35MoeConfig) -> jnp.dtype:
    """Storage dtype of the GDN state (conv and recurrent, running and snapshot slots, host tier, PD wire):
    --mamba-ssm-dtype, else the checkpoint config's `mamba_ssm_dtype` (absent: float32), as SGLang reads it.

    The kernels compute in float32 whatever this is: they upcast on load and round on store.
    Raises ValueError for a dtype outside float32 / bfloat16 (from the flag or the checkpoint)."""
    name = flag if flag is not None else config.mamba_ssm_dtype
    if name not in STATE_DTYPES:
        source = "--mamba-ssm-dtype" if flag is not None else "the checkpoint's mamba_ssm_dtype"
        raise ValueError(f"{source} must be one of {', '.join(STATE_DTYPES)}; got {name!r}")
    return jnp.dtype(STATE_DTYPES[name])


def resolve_dtype(name: str, platform: str | None = None) -> jnp.dtype:
    """Compute dtype from --dtype; `auto` is float32 on CPU (XLA:CPU bf16 matmuls are slow) else bfloat16.

    platform: the JAX platform the programs are compiled for (default `jax.default_backend()`).
    Raises ValueError for an unknown name."""
    if name == "auto":
        return jnp.dtype(jnp.float32 if (platform or jax.default_backend()) == "cpu" else jnp.bfloat16)
    table = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
    if name not in table:
        raise ValueError(f"--dtype must be one of auto, {', '.join(table)}; got {name!r}")
    return jnp.dtype(table[name])


def resolve_kv_dtype(name: str, compute_dtype: Any) -> jnp.dtype:
    """KV cache dtype from --kv-cache-dtype (SGLang's names): auto is the compute dtype, bf16 / bfloat16
    bfloat16, fp8_e4m3 float8_e4m3fn (scaled pages, kernels/ragged_paged_attention/kv_quant.py).
    Raises ValueError for another name."""
    table = {"auto": compute_dtype, "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "fp8_e4m3": jnp.float8_e4m3fn}
    if name not in table:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(table)}; got {name!r}")
    return jnp.dtype(table[name])


def resolve_device_defaults(args: ServerArgs, devices: list[Any] | None = None) -> None:
    """Fill in the flag defaults that depend on the devices (--chunked-prefill-size, from the first device's
    memory), as SGLang does at start. Called once, before the runner is built (Engine); a value already set
    is kept, so a second call changes nothing."""
    first = (devices or jax.devices())[0]
    args.resolve_chunked_prefill_size(jax.default_backend(), memory_accounting.device_memory_limit(first))
    if args.dp_size > 1:
        logger.info("--chunked-prefill-size %d is split over the %d DP ranks: %d prompt tokens per rank per step",
                    args.chunked_prefill_size, args.dp_size, args.chunked_prefill_per_rank)


@dataclass(frozen=True)
class RunnerSizing:
    """Pages, slots and step sizes of one runner (every count is per DP rank unless it says otherwise).

    Attributes:
        dp: data-parallel attention ranks (--dp-size).
        page_size: tokens per KV page.
        max_running_requests: over all ranks (--max-running-requests).
        max_running_per_rank: ceil(max_running_requests / dp).
        num_snapshot_slots: GDN snapshot slots of the prefix cache (0 without it or without GDN layers).
        num_pages: KV pages including the trash page 0.
        context_length: longest prompt + output, tokens.
        chunked_prefill_per_rank: prompt tokens one rank prefills per step.
        bs_paddings, token_paddings: --precompile-bs-paddings / --precompile-token-paddings (None: default).
        units: bytes of one KV page and one GDN slot at the cache dtypes.
        split: how the memory was split and by which rule (engine/runner/memory_split.py).
        state_dtype: storage dtype of the GDN conv and recurrent state (resolve_state_dtype).
        mtp_layers: MTP layers whose KV the pages also hold (1 with speculative decoding, else 0;
            model/mtp.py), counted in ``units``.
    """

    dp: int
    page_size: int
    max_running_requests: int
    max_running_per_rank: int
    num_snapshot_slots: int
    num_pages: int
    context_length: int
    chunked_prefill_per_rank: int
    bs_paddings: tuple[int, ...] | None
    token_paddings: tuple[int, ...] | None
    units: CacheUnits
    split: MemorySplit
    state_dtype: Any = jnp.dtype(jnp.float32)
    mtp_layers: int = 0

    @property
    def num_running_slots(self) -> int:
        """Slots [0, R]: the trash slot and one per running request."""
        return self.max_running_per_rank + 1

    @property
    def num_slots(self) -> int:
        """Running slots (trash included) + snapshot slots."""
        return self.num_running_slots + self.num_snapshot_slots

    @property
    def kv_tokens(self) -> int:
        """Usable KV tokens (the trash page excluded)."""
        return (self.num_pages - 1) * self.page_size

    def page_base(self, rank: int) -> int:
        """Global id of DP rank `rank`'s trash page; its usable pages are the next num_pages - 1 ids."""
        return rank * self.num_pages

    def slot_base(self, rank: int) -> int:
        """Global id of DP rank `rank`'s trash slot; running slots follow, then snapshot slots."""
        return rank * self.num_slots

    def bucket_set(self) -> BucketSet:
        """The compiled step shapes for this pool (engine/runner/buckets.py); raises as BucketSet.build."""
        return BucketSet.build(
            max_running_requests=self.max_running_requests, chunked_prefill_size=self.chunked_prefill_per_rank,
            context_length=self.context_length, kv_tokens=self.kv_tokens, page_size=self.page_size, dp=self.dp,
            bs_paddings=list(self.bs_paddings) if self.bs_paddings else None,
            token_paddings=list(self.token_paddings) if self.token_paddings else None)

    @classmethod
    def build(cls, config: Qwen35MoeConfig, args: ServerArgs, dtype: Any, weight_bytes: dict[Any, int] | None, *,
              device_limit: int | None = None, vision_bytes: int = 0, temporaries: int = 0,
              backends: KernelBackends | None = None) -> RunnerSizing:
        """Sizes from the config and flags; GDN slots and KV pages split the memory the weights (and, on a
        device with a limit, the vision encoder and the sampling programs' resident inputs:
        :func:`sampling_input_bytes`) leave on the fullest device by engine/runner/memory_split.py's rule
        (--mamba-full-memory-ratio, --max-mamba-cache-size, --max-gdn-snapshots, --max-total-tokens,
        --mem-fraction-static).

        Args:
            dtype: the KV cache dtype (resolve_kv_dtype: --kv-cache-dtype, auto = the compute dtype); an FP8
                pool holds twice the tokens of a bfloat16 one in the same bytes.
            weight_bytes: device -> weight bytes on it (memory_accounting.bytes_per_device, which also counts
                ShapeDtypeStructs); None: no weights to count (a runner without a device limit).
            device_limit: the memory limit of each device; default: the fullest device's own (its
                ``bytes_limit``; None on XLA:CPU). The planner passes its chip's HBM for deviceless devices.
            vision_bytes: the vision encoder's bytes on each device (VisionEncoder.memory_bytes), taken out of
                the budget before the split; 0 without a vision tower (the planner's runner has none).
            temporaries: the largest step program's temporaries per device, reserved beside the pools
                (engine/runner/program_memory.py; 0: none read).
            backends: the kernel backends, whose pool layouts size a page and a slot; None: the defaults.
        Raises:
            ValueError: --chunked-prefill-size unresolved (resolve_device_defaults), a device limit without
                weight bytes, too little device memory (memory_split.split_memory), or a state dtype outside
                float32 / bfloat16 (resolve_state_dtype).
        """
        dp = args.dp_size
        per_rank = -(-args.max_running_requests // dp)
        state_dtype = resolve_state_dtype(args.mamba_ssm_dtype, config)
        mtp_layers = 1 if args.speculative_steps else 0
        backends = backends or KernelBackends()
        units = memory_accounting.cache_units(config, args.page_size, dtype, state_dtype, mtp_layers,
                                              kv_layout=backends.attention.layout,
                                              state_layout=backends.gdn.state_layout)
        weights = 0
        if weight_bytes:
            device = max(weight_bytes, key=weight_bytes.__getitem__)
            weights = weight_bytes[device]
            if device_limit is None:
                device_limit = memory_accounting.device_memory_limit(device)
        elif device_limit:
            raise ValueError("a device memory limit needs the weights' bytes per device to split the rest")
        split = memory_split.split_memory(
            sampling_bytes=sampling_input_bytes(config.vocab_size, args) if device_limit else 0,
            page_bytes=units.kv_per_page, slot_bytes=units.gdn_per_slot if config.num_gdn_layers else 0,
            page_size=args.page_size, running_slots=per_rank, device_limit=device_limit, weight_bytes=weights,
            mem_fraction_static=args.mem_fraction_static, ratio=args.mamba_full_memory_ratio,
            max_total_tokens=args.max_total_tokens,
            max_mamba_cache_size=None if args.max_mamba_cache_size is None else args.max_mamba_cache_size // dp,
            max_snapshots=args.max_gdn_snapshots, snapshots=not args.disable_radix_cache, vision_bytes=vision_bytes,
            temporaries=temporaries)
        return cls(
            dp=dp, page_size=args.page_size, max_running_requests=args.max_running_requests,
            max_running_per_rank=per_rank, num_snapshot_slots=split.snapshot_slots, num_pages=split.num_pages,
            context_length=args.context_length or config.max_position_embeddings,
            chunked_prefill_per_rank=args.chunked_prefill_per_rank,
            bs_paddings=tuple(args.precompile_bs_paddings) if args.precompile_bs_paddings else None,
            token_paddings=tuple(args.precompile_token_paddings) if args.precompile_token_paddings else None,
            units=units, split=split, state_dtype=state_dtype, mtp_layers=mtp_layers)


def sampling_input_bytes(vocab_size: int, args: ServerArgs) -> int:
    """Bytes per device of the sampling programs' resident "unused" inputs (StepExecutor.unused_inputs): one
    set per sampling batch size, the decode buckets' rows and, with speculative decoding, the verify steps'
    rows x (k + 1) positions; a DP rank's rows live on its device. Raises ValueError as decode_batch_sizes."""
    batch = decode_batch_sizes(args.max_running_requests, args.dp_size,
                               list(args.precompile_bs_paddings) if args.precompile_bs_paddings else None)
    rows = set(batch)
    if args.speculative_steps:
        rows |= {b * (args.speculative_steps + 1) for b in batch}
    return sum(rows) * sampler.unused_row_bytes(vocab_size)
