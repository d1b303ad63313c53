"""The parameter pytree's shapes (`param_specs`) and the HF checkpoint table that maps onto it.

One table (`hf_table`) says, for every HF tensor of a Qwen3.5 (MoE or dense) or Qwen3-Next text model, its
shape and where it
lands in the pytree; loading (model/weights.py) and saving (model/checkpoint_writer.py) both read it. HF
names and shapes follow the reference model, transformers ``models/qwen3_5_moe/modeling_qwen3_5_moe.py``:
linear weights are ``[out, in]`` (we store ``[in, out]``), ``conv1d.weight`` is ``[conv_dim, 1, K]``, fused
experts are ``experts.gate_up_proj [E, 2I, H]`` (gate rows first) and ``experts.down_proj [E, H, I]``;
released checkpoints store experts one by one (``experts.{e}.gate_proj.weight [I, H]`` ...), which
transformers fuses on load (its ``conversion_mapping.py``, ``qwen2_moe`` rules). Dense layers hold
``mlp.gate_proj / up_proj / down_proj`` (``Qwen3_5MLP``). Qwen3-Next (``modeling_qwen3_next.py``) stores
the GDN input projections fused and grouped per key head: ``in_proj_qkvz [Hk * (2dk + 2r*dv), H]`` with
rows ``[q_g, k_g, v_g, z_g]`` for each key head ``g`` (``r = Hv / Hk`` value heads per key head), and
``in_proj_ba [Hk * 2r, H]`` with rows ``[b_g, a_g]``; the loader regroups them into our split leaves.

FP8 KV cache scales: checkpoints quantised with KV scales (ModelOpt, compressed-tensors, Quark) store one
float32 per attention layer for K and one for V, named (vLLM's ``maybe_remap_kv_scale_name`` accepts the same
three) ``self_attn.k_scale``, ``self_attn.k_proj.k_scale`` or ``self_attn.attn.k_scale`` (and ``v_``); shape
``[]`` or ``[1]``. They become the float32 scalar leaves ``attn.k_scale`` / ``attn.v_scale`` when present.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.stacking import stack_params

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Prefixes of the conditional-generation and the causal-LM layouts; the first that matches wins.
_PREFIXES = ("model.language_model.", "model.")
# Prefixes of the multi-token-prediction layer's tensors (the release stores them top level, ``mtp.``).
MTP_PREFIXES = ("mtp.", "model.mtp.", "model.language_model.mtp.")
# Parts of multimodal / multi-token-prediction releases that the text decoder does not use (the MTP layer is
# loaded only when asked for: ``canonical_name(name, mtp=True)``).
SKIPPED_PREFIXES = (*MTP_PREFIXES, "model.visual.", "visual.")

LeafPath = tuple[str | int, ...]


@dataclasses.dataclass(frozen=True)
class HfSpec:
    """One HF tensor. ``layout`` says how it maps onto the leaf at ``path``:

    same: identical; t: 2-D transpose; conv: [C, 1, K] -> [C, K]; scalar: [] or [1] -> [] (KV cache scales);
    expert_t: leaf[expert] = tensor.T; fused_gate_up: [E, 2I, H] -> w_gate, w_up [E, H, I];
    fused_down: [E, H, I] -> [E, I, H]; qkvz: Qwen3-Next's [Hk * (2dk + 2r*dv), H] -> in_proj_qkv,
    in_proj_z; ba: [Hk * 2r, H] -> in_proj_b, in_proj_a (``groups``: the row widths of one key head's
    group, in order, e.g. ``(dk, dk, r*dv, r*dv)``; see :func:`split_grouped`).
    """

    path: LeafPath
    hf_shape: tuple[int, ...]
    layout: str
    expert: int | None = None
    groups: tuple[int, ...] = ()

    def parts(self) -> list[tuple[str | None, LeafPath]]:
        """``(part, leaf)`` for each leaf this tensor fills: ``w_gate`` and ``w_up`` for a fused gate_up,
        ``in_proj_qkv`` / ``in_proj_z`` for a qkvz, ``in_proj_b`` / ``in_proj_a`` for a ba; else
        ``[(None, path)]``."""
        names = _PARTS.get(self.layout)
        if names is None:
            return [(None, self.path)]
        return [(part, (*self.path, leaf)) for part, leaf in names]

    def targets(self) -> list[LeafPath]:
        """The leaves this tensor fills (see :meth:`parts`)."""
        return [leaf for _, leaf in self.parts()]


# Layouts whose one HF tensor fills several leaves: (part name, leaf name under ``path``).
_PARTS = {
    "fused_gate_up": (("gate", "w_gate"), ("up", "w_up")),
    "qkvz": (("qkv", "in_proj_qkv"), ("z", "in_proj_z")),
    "ba": (("b", "in_proj_b"), ("a", "in_proj_a")),
}


def split_grouped(x: Any, groups: tuple[int, ...], part: str, xp: Any) -> Any:
    """One part of a Qwen3-Next fused GDN projection, in HF ``[out, in]`` layout.

    ``x`` is ``[Hk * sum(groups), H]``: for each key head, rows of widths ``groups``. For a qkvz
    (``groups = (dk, dk, r*dv, r*dv)``) part ``"qkv"`` is ``[q of every head; k ...; v ...]`` and ``"z"`` the
    z rows; for a ba (``groups = (r, r)``) ``"b"`` / ``"a"``. Key head ``g``'s value rows become value heads
    ``g*r .. g*r + r - 1``, as HF's ``fix_query_key_value_ordering`` orders them. ``xp``: numpy or jax.numpy.
    """
    x = x.reshape(-1, sum(groups), x.shape[-1])
    bounds = [0]
    for w in groups:
        bounds.append(bounds[-1] + w)
    pieces = [x[:, a:b].reshape(-1, x.shape[-1]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if part == "qkv":
        return xp.concatenate(pieces[:3], axis=0)
    return pieces[{"z": 3, "b": 0, "a": 1}[part]]


def param_specs(config: Qwen35MoeConfig, dtype: Any = jnp.bfloat16, *, stacked: bool = True,
                kv_scales: bool = False, mtp: bool = False) -> dict[str, Any]:
    """Shapes and dtypes of the parameter pytree (docs/internals.md) as ``jax.ShapeDtypeStruct`` leaves.

    ``dtype`` is the compute dtype of every leaf except ``A_log``, which stays float32. ``stacked``: the
    layers in the scanned layout of model/stacking.py (what ``forward_step`` takes); False gives one
    dict per layer (the loader's and the checkpoint table's view). ``kv_scales``: the attention layers also
    hold the checkpoint's FP8 KV cache scales ``k_scale`` / ``v_scale`` (float32 scalars). ``mtp``: the
    multi-token-prediction layer as ``params["mtp"]`` (model/mtp.py). Useful for ahead-of-time compilation.
    """
    c = config
    h = c.hidden_size

    def s(*shape: int, dt: Any = dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dt))

    layers = [_layer_specs(c, s, kind, mlp_kind, kv_scales)
              for kind, mlp_kind in zip(c.layer_types, c.mlp_types, strict=True)]
    params: dict[str, Any] = {"embed": s(c.vocab_size, h), "final_norm": s(h), "layers": layers}
    if not c.tie_word_embeddings:
        params["lm_head"] = s(c.vocab_size, h)
    if mtp:
        params["mtp"] = {
            "fc": s(2 * h, h), "pre_fc_norm_embedding": s(h), "pre_fc_norm_hidden": s(h), "norm": s(h),
            "layer": _layer_specs(c, s, "full_attention", c.mtp_mlp_type, kv_scales),
        }  # fmt: skip
    return stack_params(params, config) if stacked else params


def _layer_specs(c: Qwen35MoeConfig, s: Any, kind: str, mlp_kind: str, kv_scales: bool) -> dict[str, Any]:
    """One decoder layer's leaves (``s(*shape, dt=)`` makes a leaf): the mixer of ``kind``, the MLP of
    ``mlp_kind``."""
    h, e, i, i_s = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    nq, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    hv, dv, k = c.linear_num_value_heads, c.linear_value_head_dim, c.linear_conv_kernel_dim
    layer: dict[str, Any] = {"input_norm": s(h), "post_attn_norm": s(h)}
    if kind == "full_attention":
        layer["attn"] = {
            "q_proj": s(h, nq * hd * 2), "k_proj": s(h, nkv * hd), "v_proj": s(h, nkv * hd),
            "o_proj": s(nq * hd, h), "q_norm": s(hd), "k_norm": s(hd),
        }  # fmt: skip
        if kv_scales:
            layer["attn"].update(k_scale=s(dt=jnp.float32), v_scale=s(dt=jnp.float32))
    else:
        layer["gdn"] = {
            "in_proj_qkv": s(h, c.gdn_conv_dim), "in_proj_z": s(h, hv * dv),
            "in_proj_b": s(h, hv), "in_proj_a": s(h, hv), "conv1d": s(c.gdn_conv_dim, k),
            "dt_bias": s(hv), "A_log": s(hv, dt=jnp.float32), "norm": s(dv), "out_proj": s(hv * dv, h),
        }  # fmt: skip
    if mlp_kind == "moe":
        layer["moe"] = {
            "router": s(h, e), "w_gate": s(e, h, i), "w_up": s(e, h, i), "w_down": s(e, i, h),
            "shared_gate": s(h, i_s), "shared_up": s(h, i_s), "shared_down": s(i_s, h),
            "shared_expert_gate": s(h, 1),
        }  # fmt: skip
    else:
        layer["mlp"] = {"gate_proj": s(h, c.intermediate_size), "up_proj": s(h, c.intermediate_size),
                        "down_proj": s(c.intermediate_size, h)}
    return layer


def leaf_at(tree: Any, path: LeafPath) -> Any:
    """The node of a (nested dict / list) pytree at ``path``, e.g. ``("layers", 3, "moe", "w_gate")``."""
    for p in path:
        tree = tree[p]
    return tree


def _hf_shape(layout: str, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
    if layout == "same":
        return leaf_shape
    if layout == "t":
        return leaf_shape[::-1]
    if layout == "conv":
        return (leaf_shape[0], 1, leaf_shape[1])
    if layout == "expert_t":
        return leaf_shape[1:][::-1]
    if layout == "fused_gate_up":  # leaf is w_gate [E, H, I]
        return (leaf_shape[0], 2 * leaf_shape[2], leaf_shape[1])
    if layout == "fused_down":
        return (leaf_shape[0], leaf_shape[2], leaf_shape[1])
    if layout in ("qkvz", "ba", "scalar"):  # not from one leaf's shape: see hf_table (scalar: [] or [1])
        return ()
    raise AssertionError(layout)


_ATTN = {"q_proj": "t", "k_proj": "t", "v_proj": "t", "o_proj": "t", "q_norm": "same", "k_norm": "same"}
_GDN = {
    "in_proj_qkv": "t", "in_proj_z": "t", "in_proj_b": "t", "in_proj_a": "t", "conv1d": "conv",
    "dt_bias": "same", "A_log": "same", "norm": "same", "out_proj": "t",
}  # fmt: skip
# HF tensor name (after "layers.{i}.mlp.") -> our MOE leaf; all [out, in] -> [in, out].
_MOE_DENSE = {
    "gate.weight": "router", "shared_expert.gate_proj.weight": "shared_gate",
    "shared_expert.up_proj.weight": "shared_up", "shared_expert.down_proj.weight": "shared_down",
    "shared_expert_gate.weight": "shared_expert_gate",
}  # fmt: skip
_PER_EXPERT = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
_DENSE_MLP = ("gate_proj", "up_proj", "down_proj")  # HF "layers.{i}.mlp.{name}.weight" -> our same-named leaf


def hf_table(config: Qwen35MoeConfig, fused_layers: frozenset[int] = frozenset(),
             kv_scales: bool = False, *, mtp: bool = False, mtp_fused: bool = False) -> dict[str, HfSpec]:
    """Every HF tensor name (prefix removed) of the text model -> its `HfSpec`, in checkpoint order.

    Layers in ``fused_layers`` store their experts fused, the others per expert. ``kv_scales``: every attention
    layer also has ``self_attn.k_scale`` / ``self_attn.v_scale`` (the names :func:`kv_scale_name` gives).
    ``mtp``: the MTP layer's tensors too, named ``mtp.*`` as the release stores them (SGLang's and vLLM's
    ``qwen3_5_mtp`` loaders): ``mtp.fc.weight [H, 2H]`` over ``[norm(embedding), norm(hidden)]``,
    ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm`` and one full-attention decoder
    layer ``mtp.layers.0.*`` (experts fused when ``mtp_fused``).
    """
    shapes = param_specs(config, stacked=False, kv_scales=kv_scales, mtp=mtp)
    table: dict[str, HfSpec] = {}

    def add(name: str, path: LeafPath, layout: str, expert: int | None = None) -> None:
        table[name] = HfSpec(path, _hf_shape(layout, leaf_at(shapes, path).shape), layout, expert)

    add("embed_tokens.weight", ("embed",), "same")
    for li, kind in enumerate(config.layer_types):
        _add_layer(table, add, shapes, config, f"layers.{li}.", ("layers", li), kind, config.mlp_types[li],
                   li in fused_layers, kv_scales)
    add("norm.weight", ("final_norm",), "same")
    if not config.tie_word_embeddings:
        add("lm_head.weight", ("lm_head",), "same")
    if mtp:
        add("mtp.fc.weight", ("mtp", "fc"), "t")
        for leaf in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            add(f"mtp.{leaf}.weight", ("mtp", leaf), "same")
        _add_layer(table, add, shapes, config, "mtp.layers.0.", ("mtp", "layer"), "full_attention",
                   config.mtp_mlp_type, mtp_fused, kv_scales)
    return table


def _add_layer(table: dict[str, HfSpec], add: Any, shapes: Any, config: Qwen35MoeConfig, pre: str, lp: LeafPath,
               kind: str, mlp_kind: str, fused: bool, kv_scales: bool) -> None:
    """One decoder layer's HF tensors (names under ``pre``) onto the leaves under ``lp``."""
    add(pre + "input_layernorm.weight", (*lp, "input_norm"), "same")
    add(pre + "post_attention_layernorm.weight", (*lp, "post_attn_norm"), "same")
    if kind == "full_attention":
        for leaf, layout in _ATTN.items():
            add(f"{pre}self_attn.{leaf}.weight", (*lp, "attn", leaf), layout)
        if kv_scales:
            for leaf in ("k_scale", "v_scale"):
                add(f"{pre}self_attn.{leaf}", (*lp, "attn", leaf), "scalar")
    elif config.gdn_fused_projections:
        _add_fused_gdn(table, add, config, pre, (*lp, "gdn"))
    else:
        for leaf, layout in _GDN.items():
            suffix = "" if leaf in ("dt_bias", "A_log") else ".weight"
            add(f"{pre}linear_attn.{leaf}{suffix}", (*lp, "gdn", leaf), layout)
    if mlp_kind == "dense":
        for leaf in _DENSE_MLP:
            add(f"{pre}mlp.{leaf}.weight", (*lp, "mlp", leaf), "t")
        return
    mp = (*lp, "moe")
    for hf, leaf in _MOE_DENSE.items():
        add(f"{pre}mlp.{hf}", (*mp, leaf), "t")
    if fused:
        gate_shape = leaf_at(shapes, (*mp, "w_gate")).shape
        table[f"{pre}mlp.experts.gate_up_proj"] = HfSpec(mp, _hf_shape("fused_gate_up", gate_shape), "fused_gate_up")
        add(f"{pre}mlp.experts.down_proj", (*mp, "w_down"), "fused_down")
    else:
        for e in range(config.num_experts):
            for hf, leaf in _PER_EXPERT.items():
                add(f"{pre}mlp.experts.{e}.{hf}.weight", (*mp, leaf), "expert_t", e)


def _add_fused_gdn(table: dict[str, HfSpec], add: Any, config: Qwen35MoeConfig, pre: str, gp: LeafPath) -> None:
    """Qwen3-Next's GDN tensors: the fused ``in_proj_qkvz`` / ``in_proj_ba`` and the rest as in Qwen3.5."""
    c = config
    r = c.linear_num_value_heads // c.linear_num_key_heads
    dk, dv, hk, h = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_num_key_heads, c.hidden_size
    qkvz = (dk, dk, r * dv, r * dv)
    table[f"{pre}linear_attn.in_proj_qkvz.weight"] = HfSpec(gp, (hk * sum(qkvz), h), "qkvz", groups=qkvz)
    table[f"{pre}linear_attn.in_proj_ba.weight"] = HfSpec(gp, (hk * 2 * r, h), "ba", groups=(r, r))
    for leaf, layout in _GDN.items():
        if leaf in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
            continue
        suffix = "" if leaf in ("dt_bias", "A_log") else ".weight"
        add(f"{pre}linear_attn.{leaf}{suffix}", (*gp, leaf), layout)


def canonical_name(name: str, mtp: bool = False) -> str | None:
    """HF checkpoint name -> table name (prefix removed); None for tensors the text model skips. ``mtp``: the
    MTP layer's tensors are kept, as ``mtp.*`` whatever their prefix."""
    if mtp:
        for prefix in MTP_PREFIXES:
            if name.startswith(prefix):
                return "mtp." + name[len(prefix):]
    if name.startswith(SKIPPED_PREFIXES):
        return None
    if name == "lm_head.weight":
        return name
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name  # bare text-model names load as they are; any other prefix is reported as unexpected


# The spellings of an attention layer's FP8 KV cache scale (module docstring) -> "self_attn.{k,v}_scale".
_KV_SCALE = re.compile(r"^((?:mtp\.)?layers\.\d+\.self_attn)\.(?:([kv])_proj\.|attn\.)?([kv])_scale$")


def kv_scale_name(canon: str) -> str | None:
    """``layers.{i}.self_attn.k_scale`` (or ``v_``) for any accepted spelling of a KV cache scale (a table
    name, prefix removed), else None. ``k_proj.v_scale`` and the like are not scales of this layer: None."""
    m = _KV_SCALE.match(canon)
    if m is None or (m.group(2) is not None and m.group(2) != m.group(3)):
        return None
    return f"{m.group(1)}.{m.group(3)}_scale"
