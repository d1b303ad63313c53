"""VisionEncoder: the vision tower served: images -> text-model embeddings, from a fixed set of compiled programs.

Programs: one per bucket of patch rows (powers of two up to ``max_patches``); an ``encode`` call packs the
images it must run, in order, into calls of at most the largest bucket and runs each in the smallest bucket
that holds it. Everything grid-dependent (position-table taps, rotary positions, attention segments) is
computed on the host (model/vision/grid.py), so a program depends only on its bucket and ``precompile()``
compiles the whole set before the server is ready; nothing compiles while serving.

Placement: the tower's weights are replicated on every device of the mesh (or on the one device); every
device runs each call whole, so an image embedding is on every device, where the text model's step needs it.
(The released tower is ~0.4 B parameters, ~0.8 GB in bf16.)

Encoder cache: embeddings by ``ImageItem.content_hash``, least recently used first out, under a byte cap;
a hit returns the same array object and runs nothing. An image is encoded once per call however often it
appears.

Splitting a call's output per image goes through the host (one device -> host copy of the call's rows, one
host -> device copy per image): slicing a device array eagerly would compile a program per (offset, length).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_qwen.engine.runner import compilation
from sglang_tpu_qwen.model.vision.config import VisionConfig, load_vision_config
from sglang_tpu_qwen.model.vision.grid import TowerInputs, num_patches, tower_inputs
from sglang_tpu_qwen.model.vision.tower import activation_rows_bytes, vision_tower
from sglang_tpu_qwen.model.vision.weights import load_vision_params, vision_param_bytes
from sglang_tpu_qwen.parallel.mesh import Layout

logger = logging.getLogger(__name__)

# Largest call by default: 16384 patches = a 2048 x 2048 image at 16-pixel patches (4 Mpx); the released
# processor allows 16 Mpx, whose attention would need 4x the rows. A larger --max-pixels needs a larger bucket.
DEFAULT_MAX_PATCHES = 16384
SMALLEST_BUCKET = 64
DEFAULT_CACHE_BYTES = 512 * 2**20


def patch_buckets(max_patches: int, smallest: int = SMALLEST_BUCKET) -> tuple[int, ...]:
    """Powers of two from ``min(smallest, next_pow2(max_patches))`` to ``next_pow2(max_patches)`` (powers of
    two keep every bucket a multiple of the merge unit and of the attention tile)."""
    top = 1 << max(max_patches - 1, 1).bit_length()
    size = min(smallest, top)
    out = []
    while size <= top:
        out.append(size)
        size *= 2
    return tuple(out)


def _max_patches_of(model_dir: Path, config: VisionConfig) -> int | None:
    """Patches of the largest image the checkpoint's preprocessor_config.json lets through, if it says."""
    try:
        pre = json.loads((model_dir / "preprocessor_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    pixels = (pre.get("size") or {}).get("longest_edge") or pre.get("max_pixels")
    return int(pixels) // (config.patch_size**2) if pixels else None


class ImageItem(Protocol):
    """What the encoder reads of an image: engine/io/multimodal.py's ``ImageItem`` (engine/io sits above the
    runner in the import layers, so the runner names the fields it needs instead of importing the class)."""

    @property
    def grid_thw(self) -> tuple[int, int, int]: ...
    @property
    def content_hash(self) -> int: ...
    @property
    def pixel_values(self) -> np.ndarray: ...
    @property
    def merge_size(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...


@dataclasses.dataclass
class EncoderStats:
    """Counters since start: images asked for, cache hits, images run through the tower, tower calls."""

    images: int = 0
    cache_hits: int = 0
    encoded: int = 0
    calls: int = 0


class VisionEncoder:
    """The vision tower on the devices, its compiled buckets and its encoder cache.

    Public: ``config`` (VisionConfig), ``dtype`` (compute), ``params``, ``buckets`` (patch rows per program),
    ``cache_bytes`` (the cap), ``stats``.
    """

    def __init__(self, config: VisionConfig, params: dict[str, Any], *, sharding: jax.sharding.Sharding,
                 buckets: tuple[int, ...], cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        """Serve ``params`` (placed with ``sharding``, model/vision/weights.py) in programs of ``buckets`` patch
        rows (each a multiple of ``config.merge_unit``), caching up to ``cache_bytes`` of embeddings.

        Raises:
            ValueError: no bucket, a bucket not a multiple of the merge unit, or a negative cache cap.
        """
        if not buckets or any(b <= 0 or b % config.merge_unit for b in buckets):
            raise ValueError(f"buckets {buckets!r} must be positive multiples of {config.merge_unit} patches")
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
        self.config, self.params, self.sharding = config, params, sharding
        self.dtype = jnp.dtype(params["pos_embed"].dtype)
        self.buckets = tuple(sorted(set(buckets)))
        self.cache_bytes = cache_bytes
        self.stats = EncoderStats()
        self._cache: collections.OrderedDict[int, jax.Array] = collections.OrderedDict()
        self._cached_bytes = 0
        self._compiled: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._jit = jax.jit(vision_tower, static_argnums=3, out_shardings=sharding)

    @classmethod
    def from_checkpoint(cls, model_path: str, dtype: Any, *, layout: Layout | None = None, device: Any = None,
                        max_patches: int | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES,
                        keep_fp8: bool = False) -> VisionEncoder | None:
        """The encoder of the checkpoint at ``model_path``, or None when it has no vision tower (text-only).

        Weights in ``dtype`` (the text model's compute dtype), replicated over ``layout``'s mesh, else on
        ``device`` (default: the first device). ``max_patches``: the largest image in patch rows (default:
        the preprocessor's ``longest_edge`` pixels, at most ``DEFAULT_MAX_PATCHES``).

        Raises:
            CheckpointError: bad or missing ``model.visual.*`` tensors. ValueError: a bad ``vision_config``.
        """
        config = load_vision_config(model_path)
        if config is None:
            return None
        if layout is not None:
            sharding: jax.sharding.Sharding = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec())
        else:
            sharding = jax.sharding.SingleDeviceSharding(device if device is not None else jax.devices()[0])
        t0 = time.perf_counter()
        params = load_vision_params(model_path, config, dtype, keep_fp8=keep_fp8, sharding=sharding)
        if max_patches is None:
            max_patches = min(_max_patches_of(Path(model_path), config) or DEFAULT_MAX_PATCHES, DEFAULT_MAX_PATCHES)
        enc = cls(config, params, sharding=sharding, buckets=patch_buckets(max_patches), cache_bytes=cache_bytes)
        logger.info("vision tower: %d blocks x %d wide, %.1f MB of weights (%s) loaded in %.1f s; buckets %s patch "
                    "rows; encoder cache %.0f MiB", config.depth, config.hidden_size,
                    vision_param_bytes(params) / 1e6, enc.dtype.name, time.perf_counter() - t0, list(enc.buckets),
                    cache_bytes / 2**20)
        return enc

    # ---- programs ----------------------------------------------------------------------------------
    @property
    def max_patches(self) -> int:
        """Patch rows of the largest bucket: the most one image (and one call) may have."""
        return self.buckets[-1]

    def _abstract_args(self, rows: int) -> tuple[Any, Any]:
        sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=self.sharding)  # noqa: E731
        inputs = TowerInputs(pos_index=sds((rows, 4), jnp.int32), pos_weight=sds((rows, 4), jnp.float32),
                             rope_hw=sds((rows, 2), jnp.int32), segment=sds((rows,), jnp.int32))
        return sds((rows, self.config.patch_dim), jnp.float32), inputs

    def _program(self, rows: int) -> Any:
        prog = self._compiled.get(rows)
        if prog is None:
            pixels, inputs = self._abstract_args(rows)
            prog = self._compiled[rows] = self._jit.lower(self.params, pixels, inputs, self.config).compile()
        return prog

    def precompile(self) -> int:
        """Compile (or load from the persistent cache) the program of every bucket; returns how many. Counted as
        an engine start's compilations (engine/runner/compilation.py), never as a late compile."""
        compilation.install_counter()
        with self._lock, compilation.precompiling():
            for rows in self.buckets:
                self._program(rows)
        return len(self.buckets)

    @property
    def precompiled(self) -> bool:
        """Whether every bucket's program is compiled (``precompile()`` ran, or every size was met)."""
        return all(rows in self._compiled for rows in self.buckets)

    def memory_bytes(self) -> int:
        """Device bytes the encoder may hold on each device: its weights, the cache cap, and the largest bucket's
        inputs, outputs and temporaries (the compiled program's own figures once precompiled, else an
        estimate from model/vision/tower.py)."""
        return sum(self.memory_parts().values())

    def memory_parts(self) -> dict[str, int]:
        """``memory_bytes`` by part, bytes per device: ``weights``, ``cache_cap`` and ``activations`` (the largest
        bucket's inputs, outputs and temporaries)."""
        rows = self.max_patches
        io = rows * (self.config.patch_dim * 4 + 4 * 4 + 4 * 4 + 2 * 4 + 4) \
            + rows // self.config.merge_unit * self.config.out_hidden_size * self.dtype.itemsize
        temp = None
        prog = self._compiled.get(rows)
        if prog is not None:
            try:
                temp = int(prog.memory_analysis().temp_size_in_bytes)
            except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
                temp = None
        if temp is None:
            temp = activation_rows_bytes(rows, self.config, self.dtype)
        return {"weights": vision_param_bytes(self.params), "cache_cap": self.cache_bytes, "activations": io + temp}

    # ---- encoding ----------------------------------------------------------------------------------
    def _check(self, item: ImageItem) -> None:
        n = num_patches(item.grid_thw)
        if item.merge_size != self.config.spatial_merge_size:
            raise ValueError(f"image merge_size {item.merge_size} != the tower's {self.config.spatial_merge_size}")
        if item.pixel_values.shape != (n, self.config.patch_dim):
            raise ValueError(f"image pixel_values {item.pixel_values.shape}: expected ({n}, {self.config.patch_dim}) "
                             f"for grid {item.grid_thw}")
        if n > self.max_patches:
            raise ValueError(f"image of {n} patches exceeds the encoder's largest bucket ({self.max_patches} patches)")

    def _run(self, items: list[ImageItem]) -> list[jax.Array]:
        """One tower call over ``items`` (their patches fit the largest bucket): each image's rows, on the devices."""
        total = sum(num_patches(i.grid_thw) for i in items)
        rows = next(b for b in self.buckets if b >= total)
        pixels = np.zeros((rows, self.config.patch_dim), np.float32)
        np.concatenate([i.pixel_values for i in items], out=pixels[:total])
        inputs = tower_inputs([i.grid_thw for i in items], self.config, rows)
        out = self._program(rows)(self.params, jax.device_put(pixels, self.sharding),
                                  jax.device_put(inputs, self.sharding))
        host = np.asarray(out.addressable_shards[0].data)
        self.stats.calls += 1
        result, start = [], 0
        for item in items:
            result.append(jax.device_put(host[start:start + item.num_tokens], self.sharding))
            start += item.num_tokens
        return result

    def encode(self, items: list[ImageItem]) -> list[jax.Array]:
        """Embeddings of ``items``: one ``[item.num_tokens, out_hidden_size]`` array in the compute dtype per
        item, in order (HF ``Qwen3_5VisionModel(...).pooler_output`` rows of that image).

        Cached images are not run again (the cached array itself is returned); the rest run in as few tower
        calls as the largest bucket allows, then enter the cache.

        Raises:
            ValueError: an item whose ``pixel_values`` do not match its grid and the tower's patch size, whose
                merge size differs from the tower's, or with more patches than the largest bucket.
        """
        with self._lock:
            for item in items:
                self._check(item)
            self.stats.images += len(items)
            found: dict[int, jax.Array] = {}
            todo: list[ImageItem] = []
            for item in items:
                h = item.content_hash
                if h in found or any(t.content_hash == h for t in todo):
                    continue
                hit = self._cache.get(h)
                if hit is not None:
                    self._cache.move_to_end(h)
                    self.stats.cache_hits += 1
                    found[h] = hit
                else:
                    todo.append(item)
            call: list[ImageItem] = []
            for item in [*todo, None]:
                if item is None or (call and sum(num_patches(i.grid_thw) for i in call)
                                    + num_patches(item.grid_thw) > self.max_patches):
                    if call:
                        for done, emb in zip(call, self._run(call), strict=True):
                            found[done.content_hash] = emb
                            self._insert(done.content_hash, emb)
                    call = []
                if item is not None:
                    call.append(item)
            self.stats.encoded += len(todo)
            return [found[i.content_hash] for i in items]

    def _insert(self, key: int, emb: jax.Array) -> None:
        size = int(emb.size) * emb.dtype.itemsize
        if size > self.cache_bytes:
            return
        self._cache[key] = emb
        self._cached_bytes += size
        while self._cached_bytes > self.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= int(old.size) * old.dtype.itemsize

    @property
    def cached_bytes(self) -> int:
        """Bytes of embeddings in the encoder cache now (at most ``cache_bytes``)."""
        return self._cached_bytes

    def clear_cache(self) -> None:
        """Drop every cached embedding (e.g. /flush_cache)."""
        with self._lock:
            self._cache.clear()
            self._cached_bytes = 0
