"""ModelRunner: the weights, the device state and the compiled programs of one engine, composed.

The jobs live in their own modules: the sizes (engine/runner/sizing.py, a frozen `RunnerSizing`), the device
buffers and their operations (engine/runner/device_state.py, `DeviceState`), the fixed program set
(engine/runner/programs.py, `ProgramTable`: build, lower, compile) and the steps (engine/runner/step_executor.py,
`StepExecutor`: forward, sample, penalties, prompt logprobs). `precompile()` compiles the whole set before the
server reports ready (from the persistent compilation cache when it can, engine/runner/compilation.py).

One constructor serves the server and the planner: `ModelRunner(config, args, params, placement)`, reached
through `ModelRunner.from_checkpoint` (the server: weights read into their shardings) or `ModelRunner.abstract`
(tools/plan/: ShapeDtypeStructs with their shardings, nothing read or allocated). Both compute the same
sizes, buckets and programs from the same config and flags. The ServerArgs must have their device-dependent
defaults resolved first (sizing.resolve_device_defaults); the runner never changes them.

A checkpoint with a vision tower also gets its `vision_encoder` (engine/runner/vision_setup.py), on the same
devices: its memory is taken out of the budget before the KV / GDN split and its buckets are precompiled with
the rest. The planner's runner has none: it plans the text model (tools/plan/ says so in its report).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_qwen.args.server_args import ServerArgs
from sglang_tpu_qwen.engine.runner import compilation, greedy_screen, memory_accounting
from sglang_tpu_qwen.engine.runner.buckets import BucketSet, StepBucket
from sglang_tpu_qwen.engine.runner.device_state import DeviceState, Placement
from sglang_tpu_qwen.engine.runner.memory_split import MIN_KV_PAGES
from sglang_tpu_qwen.engine.runner.program_memory import ProgramMemory, measure, probe_temporaries
from sglang_tpu_qwen.engine.runner.programs import ProgramTable, SampleKind
from sglang_tpu_qwen.engine.runner.sizing import RunnerSizing, resolve_dtype, resolve_kv_dtype
from sglang_tpu_qwen.engine.runner.step_executor import (
    SampleOutput,
    SamplingBatch,
    StepExecutor,
    StepOutput,
)
from sglang_tpu_qwen.engine.runner.token_map import load_token_map
from sglang_tpu_qwen.engine.runner.vision_encoder import VisionEncoder
from sglang_tpu_qwen.engine.runner.vision_setup import build_vision_encoder, vision_info
from sglang_tpu_qwen.engine.runner.weight_loading import load_weights
from sglang_tpu_qwen.kernels.dispatch import resolve_backends
from sglang_tpu_qwen.model.config import Qwen35MoeConfig, load_config
from sglang_tpu_qwen.model.forward import lm_head_weight
from sglang_tpu_qwen.model.forward_batch import ForwardBatch
from sglang_tpu_qwen.model.param_layout import param_specs
from sglang_tpu_qwen.quant.fp8 import fp8_specs

logger = logging.getLogger(__name__)

__all__ = ["ModelRunner", "SamplingBatch", "SampleOutput", "StepOutput"]


class ModelRunner:
    """Weights, KV pages and GDN slots on device, and the compiled forward / sampling programs.

    Public parts: `config`, `dtype` (compute), `kv_dtype` (the KV pages: --kv-cache-dtype), `params`, `placement`
    (`layout`: the mesh or None), `sizing` (pages, slots, context), `buckets`, `backends`, `state` (the device
    buffers and their slot / KV operations; `cache` reads its cache), `memory_usage` (per device, for
    /get_server_info), `observers` (benchmark hooks), `vision_encoder` (the checkpoint's VisionEncoder, on the
    same devices; None for a text-only checkpoint).
    """

    def __init__(self, config: Qwen35MoeConfig, args: ServerArgs, params: dict[str, Any],
                 placement: Placement, device_memory_bytes: int | None = None, *,
                 vision_encoder: VisionEncoder | None = None, probe_temporaries: bool = True) -> None:
        """Build the runner on `params` placed per `placement`: arrays (the server's weights, already in their
        shardings) or ShapeDtypeStructs carrying their shardings (the planner's; then the cache is abstract
        too and nothing is allocated). `device_memory_bytes`: each device's memory limit where the devices
        report none (the planner's deviceless TPUs); default the devices' own. `vision_encoder`: the
        checkpoint's vision tower, built on `placement`'s devices (its memory_bytes() comes out of the budget).
        `probe_temporaries`: on a device with a memory limit, compile the largest programs on a minimal pool
        first and leave their temporaries room (program_memory.py); the planner's runner skips it (it reads
        every program's analysis itself).

        Raises:
            ValueError: `params` mixes arrays and ShapeDtypeStructs; bad --dtype or kernel backend flags;
                --chunked-prefill-size unresolved; too little device memory for the KV pool, or pools the
                device cannot hold beside the weights and the temporaries (memory_split.py);
                bucket overrides that do not fit (engine/runner/buckets.py).
        """
        compilation.install_counter()
        self.config, self.placement, self.layout = config, placement, placement.layout
        self.dtype = resolve_dtype(args.dtype, placement.platform)
        self.kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, self.dtype)
        kinds = {isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)}
        if len(kinds) != 1:
            raise ValueError("params must be all arrays or all ShapeDtypeStructs")
        self.is_abstract = kinds == {True}
        self.params = _with_greedy_screen(params, config, self.is_abstract)
        if self.layout is not None:
            logger.info("mesh %s: attention dp=%d over %s, experts ep=%d, MoE combine %s",
                        dict(self.layout.mesh.shape), args.dp_size, "+".join(self.layout.batch_axes), args.ep_size,
                        args.moe_combine)
        # GDN slots and KV pages share what the weights leave (engine/runner/memory_split.py).
        weight_bytes = memory_accounting.bytes_per_device(self.params)
        self.vision_encoder = vision_encoder
        vision_bytes = vision_encoder.memory_bytes() if vision_encoder is not None else 0
        # The backends first: their pool layouts size a KV page and a GDN slot.
        self.backends = resolve_backends(args.attention_backend, args.gdn_backend, platform=placement.platform,
                                         config=config, moe=args.moe_runner_backend,
                                         sampling=args.sampling_backend)
        sizing = RunnerSizing.build(config, args, self.kv_dtype, weight_bytes, device_limit=device_memory_bytes,
                                    vision_bytes=vision_bytes, backends=self.backends)
        self.spec_steps = args.speculative_steps  # speculative decoding: draft tokens per row (MTP layer)
        if self.spec_steps and "mtp" not in self.params:
            raise ValueError("speculative decoding needs the MTP layer's parameters (params['mtp'])")
        # --speculative-token-map: the ids the drafts choose among (None: the whole vocabulary).
        self.draft_vocab = (load_token_map(args.speculative_token_map, config.vocab_size)
                            if self.spec_steps and args.speculative_token_map else None)
        self.buckets: BucketSet = sizing.bucket_set()
        # On a device with a memory limit the pools leave room for the largest program's temporaries, read
        # from XLA's analysis of those programs compiled on a minimal pool (engine/runner/program_memory.py).
        self.probe: ProgramMemory | None = None
        if sizing.split.device_limit and probe_temporaries:
            self.probe = self._probe_temporaries(sizing, args.moe_combine)
            sizing = RunnerSizing.build(config, args, self.kv_dtype, weight_bytes, device_limit=device_memory_bytes,
                                        vision_bytes=vision_bytes, temporaries=self.probe.temp_bytes,
                                        backends=self.backends)
            sizing.split.check_fits()
        self.sizing = sizing
        self.state = DeviceState(config, sizing, placement, self.kv_dtype, abstract_only=self.is_abstract,
                                 backends=self.backends)
        self.memory_usage: list[dict[str, Any]] = [] if self.is_abstract else memory_accounting.memory_usage(
            self.params, self.state.cache, sizing.kv_tokens, vision_bytes)
        logger.info("KV pool: %d pages x %d tokens, %s; GDN slots: %d running + %d snapshots%s, state %s (%.2f "
                    "MiB per slot)", sizing.num_pages - 1, sizing.page_size, self.kv_dtype.name,
                    sizing.num_running_slots - 1, sizing.num_snapshot_slots,
                    f" (each of {sizing.dp} DP ranks)" if sizing.dp > 1 else "",
                    sizing.state_dtype.name, sizing.units.gdn_per_slot / 2**20)
        (logger.warning if sizing.split.over_budget else logger.info)("%s", sizing.split.describe())
        logger.info("kernels: attention %s (KV pool %s), gdn %s, moe %s%s", self.backends.attention.name,
                    self.backends.attention.layout.name, self.backends.gdn.name, self.backends.moe.name,
                    " (Pallas interpret mode)" if self.backends.interpret else "")
        self.program_memory: ProgramMemory | None = None  # every compiled program's, read after precompile
        self.programs = ProgramTable(config, self.params, self.state, self.buckets, self.backends, args.moe_combine,
                                     self.dtype, spec_steps=self.spec_steps, draft_vocab=self.draft_vocab)
        self.executor = StepExecutor(self.programs, self.state)
        self.observers = self.executor.observers
        # Unresolved (None: a runner built without the Engine, e.g. the planner's) counts as off.
        self._host_snapshot_tier = (args.gdn_snapshot_host_gb or 0) > 0

    @property
    def draft_vocab_size(self) -> int | None:
        """Token ids the MTP drafts choose among (--speculative-token-map), or None for the whole vocabulary."""
        return None if self.draft_vocab is None else int(self.draft_vocab.size)

    @classmethod
    def from_checkpoint(cls, model_path: str, args: ServerArgs, devices: list[Any] | None = None) -> ModelRunner:
        """The server's runner: the persistent compilation cache configured (--compilation-cache-dir), the
        checkpoint at `model_path` loaded straight into its shardings (engine/runner/weight_loading.py).

        `devices`: where weights and cache live (the mesh's devices with --dp-size/--ep-size > 1, else the
        first one); default all devices / the default device. The vision tower, if the checkpoint has one, is
        loaded on the same devices (engine/runner/vision_setup.py). Raises CheckpointError for a bad
        checkpoint, and as `__init__`.
        """
        compilation.configure_persistent_cache(args.compilation_cache_dir)
        config = load_config(model_path)
        placement = Placement.for_devices(args, devices)
        dtype = resolve_dtype(args.dtype, placement.platform)
        params = load_weights(model_path, config, dtype, args, placement.layout, placement.device)
        vision = build_vision_encoder(model_path, args, placement, dtype)
        return cls(config, args, params, placement, vision_encoder=vision)

    @classmethod
    def abstract(cls, config: Qwen35MoeConfig, args: ServerArgs, devices: list[Any] | None = None, *,
                 platform: str | None = None, fp8_block: tuple[int, int] | None = None,
                 device_memory_bytes: int | None = None, probe_temporaries: bool = False) -> ModelRunner:
        """The planner's runner: the server's runner for `config` and `args` on abstract weights
        (ShapeDtypeStructs with the shardings the server would load them into), for `devices` (e.g. a
        deviceless TPU topology's) and `platform` (its kernels and --dtype auto; default the JAX backend).
        `fp8_block`: block-FP8 weights with that [in, out] block. `device_memory_bytes`: each device's memory
        (deviceless devices report none); without it the pools are sized as on a device without a limit.
        `probe_temporaries`: size the pools after the largest programs' temporaries as the server does (off by
        default: the planner reads every program's analysis itself).
        """
        placement = Placement.for_devices(args, devices, platform)
        specs = param_specs(config, resolve_dtype(args.dtype, placement.platform), mtp=args.speculative_steps > 0)
        if fp8_block is not None:
            specs = fp8_specs(specs, fp8_block)
        params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), specs,
                              placement.param_shardings(specs))
        return cls(config, args, params, placement, device_memory_bytes, probe_temporaries=probe_temporaries)

    def _probe_temporaries(self, sizing: RunnerSizing, moe_combine: str) -> ProgramMemory:
        """The largest temporaries of the set's largest programs (per kind), compiled on a minimal pool
        (memory_split.MIN_KV_PAGES pages, the running slots) with the buckets `sizing` gives."""
        small = dataclasses.replace(sizing, num_pages=min(sizing.num_pages, MIN_KV_PAGES + 1), num_snapshot_slots=0)
        state = DeviceState(self.config, small, self.placement, self.kv_dtype, abstract_only=True,
                            backends=self.backends)
        table = ProgramTable(self.config, self.params, state, self.buckets, self.backends, moe_combine, self.dtype,
                             spec_steps=self.spec_steps, draft_vocab=self.draft_vocab)
        return probe_temporaries(table.lower, table.keys())

    # ---- programs ------------------------------------------------------------------------------
    def program_keys(self) -> list[tuple]:
        """Every program of the fixed set (engine/runner/programs.py)."""
        return self.programs.keys()

    def lower_forward(self, bucket: StepBucket) -> jax.stages.Lowered:
        """The forward program of `bucket`, lowered from abstract arguments (ProgramTable.lower_forward)."""
        return self.programs.lower_forward(bucket)

    def lower_sample(self, kind: SampleKind, batch: int) -> jax.stages.Lowered:
        """Sampling program `kind` for `batch` rows, lowered (ProgramTable.lower_sample)."""
        return self.programs.lower_sample(kind, batch)

    def precompile(self, progress: bool = True) -> dict[str, Any]:
        """Compile (or load from the persistent cache) every program of the fixed set, run each once, then the
        GDN slot copies the prefix cache uses, then the vision encoder's buckets (if any); afterwards a
        compilation is logged as an error.

        Returns {"programs", "from_cache", "compiled", "seconds"}. Shows a tqdm bar when `progress`.
        """
        start = time.perf_counter()
        hits0, comps0 = compilation.cache_hits(), compilation.jit_compilations()
        with compilation.precompiling():
            bar_programs = self.programs.compile_missing(progress)
            for b in self.programs.sample_batches():
                self.executor.unused_inputs(b)
            self.executor.warm_up()
            if self.sizing.num_snapshot_slots > 0:  # after a step program ran (device_state.precompile_slot_copies)
                self.state.precompile_slot_copies(self.buckets.max_decode_rows, self._host_snapshot_tier)
            vision_programs = self.vision_encoder.precompile() if self.vision_encoder is not None else 0
        stats = {"programs": compilation.jit_compilations() - comps0,
                 "from_cache": compilation.cache_hits() - hits0,
                 "seconds": time.perf_counter() - start}
        stats["compiled"] = stats["programs"] - stats["from_cache"]
        # The bar counts the step and sampling programs; the small input and GDN slot-copy programs follow it.
        b = self.buckets
        logger.info("precompiled %d programs in %.1f s (%d from the persistent cache %s, %d compiled; %d step and "
                    "sampling programs, %d vision buckets, %d input and slot-copy programs): %d forward buckets %s, "
                    "sampling batch sizes %s", stats["programs"], stats["seconds"], stats["from_cache"],
                    jax.config.jax_compilation_cache_dir or "(off)", stats["compiled"], bar_programs, vision_programs,
                    stats["programs"] - bar_programs - vision_programs, len(b.step_buckets()),
                    f"(batch {list(b.batch_sizes)} x dp {b.dp}, extend tokens {list(b.token_sizes)} for one row or "
                    f"the most rows within {b.extend_budget} tokens, page table {b.pages} columns)",
                    b.sample_batches())
        pools = max(memory_accounting.bytes_per_device(self.state.cache).values(), default=0)  # per device
        self.program_memory = measure(self.programs.compiled_items(), pool_bytes=pools)
        stats["program_memory"] = self.program_memory.as_dict()
        logger.info("%s", self.program_memory.describe())
        split = self.sizing.split
        if split.device_limit and split.device_bytes - split.temporaries + self.program_memory.temp_bytes \
                > split.device_limit:
            raise RuntimeError(f"{self.program_memory.largest} needs {self.program_memory.temp_bytes / 2**30:.2f} GiB "
                               f"of temporaries, more than the {split.temporaries / 2**30:.2f} GiB the memory split "
                               "reserved and the device holds beside the pools; lower --mem-fraction-static or "
                               "--max-total-tokens")
        self.programs.ready = True
        compilation.arm()
        return stats

    def vision_info(self) -> dict[str, Any] | None:
        """The vision encoder's memory, buckets and counters for /get_server_info; None without one."""
        return vision_info(self.vision_encoder)

    def close(self, free_device_memory: bool = True) -> None:
        """The engine shuts down: stop treating compilations as errors on its behalf and, with
        `free_device_memory` (the scheduler thread has stopped: no step reads them), delete the pools, the
        weights and the executor's resident sampling inputs now rather than when the garbage collector reaches
        the engine (a second engine in the same process, as a benchmark starts one per configuration,
        otherwise found the first one's pools still allocated: an out-of-memory on a v5e). Smaller arrays (the
        last step's outputs, the carry, a vision encoder's) are left to the collector. The runner serves no
        step afterwards."""
        if self.programs.ready:
            self.programs.ready = False
            compilation.disarm()
        if free_device_memory and not self.is_abstract:
            for leaf in jax.tree.leaves((self.state.cache, self.params, self.executor.resident_arrays())):
                if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                    leaf.delete()

    # ---- steps (engine/runner/step_executor.py) --------------------------------------------------
    @property
    def cache(self) -> Any:
        """The device cache (DeviceState.cache): replaced by every step and slot operation, read it anew."""
        return self.state.cache

    def forward(self, batch: ForwardBatch) -> StepOutput:
        """Run one step on host arrays padded to a bucket; returns device arrays (StepExecutor.forward)."""
        return self.executor.forward(batch)

    def sample(self, step: StepOutput, batch: SamplingBatch) -> SampleOutput:
        """Sample one token per row of `batch` from step.last, without waiting (StepExecutor.sample)."""
        return self.executor.sample(step, batch)

    def keep_sampled(self, out: SampleOutput) -> None:
        """Keep out.tokens on the device for the next forward's token_src rows (StepExecutor.keep_sampled)."""
        self.executor.keep_sampled(out)

    def verify(self, batch: ForwardBatch) -> StepOutput:
        """Speculative decoding: the target over each row's last token and drafts (StepExecutor.verify)."""
        return self.executor.verify(batch)

    def sample_verify(self, step: StepOutput, batch: SamplingBatch) -> SampleOutput | None:
        """Sample a verify step's positions, or None when its commit samples them (StepExecutor.sample_verify)."""
        return self.executor.sample_verify(step, batch)

    def commit(self, step: StepOutput, batch: ForwardBatch, sampled: SampleOutput | None,
               snapshots: np.ndarray) -> jax.Array:
        """Accept a verify step's tokens on the device (sampling them when `sampled` is None), commit the GDN
        states over them and draft the next tokens; returns the device ``accepted`` array
        (StepExecutor.commit, spec_programs.split_accepted)."""
        return self.executor.commit(step, batch, sampled, snapshots)

    def draft(self, step: StepOutput, batch: ForwardBatch) -> jax.Array:
        """Draft tokens [B, k] from the MTP layer over a step's positions (StepExecutor.draft)."""
        return self.executor.draft(step, batch)

    def logprobs_at(self, step: StepOutput, rows: np.ndarray, cols: np.ndarray, targets: np.ndarray,
                    num_top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Prompt logprobs at step.hidden[rows, cols] (StepExecutor.logprobs_at)."""
        return self.executor.logprobs_at(step, rows, cols, targets, num_top)

    @contextlib.contextmanager
    def side_steps(self) -> Iterator[None]:
        """Steps run outside serving on an idle runner (a benchmark's replay): no observer sees them, and the
        sampled ids kept on the device for the next serving step (and speculative decoding's carry) are put
        back afterwards."""
        kept, carry = self.state.prev_tokens, self.state.spec_carry
        try:
            with self.observers.paused():
                yield
        finally:
            self.state.prev_tokens, self.state.spec_carry = kept, carry


def _with_greedy_screen(params: dict[str, Any], config: Qwen35MoeConfig, abstract_only: bool) -> dict[str, Any]:
    """`params` plus `lm_head_screen` when the lm_head is float32: greedy steps read a bfloat16 screen of it
    (engine/runner/greedy_screen.py), placed as the lm_head."""
    head = lm_head_weight(params, config)
    if head.dtype != jnp.float32:
        return params
    if abstract_only:
        shapes = jax.eval_shape(greedy_screen.greedy_screen, head)
        screen = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=head.sharding), shapes)
    else:
        screen = jax.jit(greedy_screen.greedy_screen)(head)
    return {**params, "lm_head_screen": screen}
