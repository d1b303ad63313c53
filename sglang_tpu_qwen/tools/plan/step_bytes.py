"""The least bytes a step must move on one device: the planner's HBM roofline, part by part.

One account for the planner (``build.plan``: a step's ``min_bytes``, which its compiled bytes are held against)
and for the benchmarks that set a measured step beside that roofline (bench/decode_step.py). Both read the sizes
off a ``ModelRunner`` with :func:`runner_bytes` (the planner's abstract runner or the server's loaded one: the same
constructor, the same leaves) and split a step with :func:`step_min_bytes`. Per device, for one DP rank's rows:

- ``lm_head``: the output projection, read once (the embedding matrix when the embeddings are tied);
- ``dense``: every other replicated weight: attention and GDN projections, the shared expert, dense MLPs, the
  routers, the norms. Not the embedding matrix (only the step's rows of it are read) and not the MTP layer (the
  draft program's);
- ``embedding_rows``: the embedding rows of the step's tokens;
- ``experts``: the local experts some token of the step routes to, expected under uniform routing: each token
  picks ``k`` of ``E`` experts, so one expert serves some of ``t`` tokens with chance ``1 - (1 - k / E) ** t``;
  all MoE layers' weights of each such expert;
- ``kv_read`` / ``kv_write``: each row's visible context read and its new tokens written, every attention layer,
  at the pool's dtype (the backend's pool layout says what a token takes);
- ``gdn_recurrent`` / ``gdn_conv``: each row's recurrent and conv states at their stored dtype (the backend's state
  layout), written by a fresh prefill, read and written by a decode step; a verify step reads them, its commit
  reads and writes them again and writes the decode snapshot of the rows whose accepted run reaches a page
  boundary (accept length / page size of them);
- ``draft`` (verify only): what the MTP draft program moves (:func:`draft_min_bytes`).

Bytes only: the flops side of the roofline is ``flops.py``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.tools.plan import programs

STEP_STATE_PASSES = {"prefill": 1, "decode": 2, "verify": 3}  # state reads + writes per row of a step
PARTS = ("lm_head", "dense", "embedding_rows", "experts", "kv_read", "kv_write", "gdn_recurrent", "gdn_conv",
         "draft")


@dataclasses.dataclass(frozen=True)
class RunnerBytes:
    """Sizes of one device's share of a runner, in bytes (see the module docstring for what each part covers).

    ``replicated`` / ``experts``: the weights one device holds outside / inside the expert stacks (experts split
    ``ep`` ways), the MTP layer apart in ``mtp_replicated`` / ``mtp_experts``; ``embed`` the embedding matrix,
    ``lm_head`` the output projection (``embed`` again when tied), ``dense`` the rest of ``replicated``;
    ``local_experts`` experts per device and ``per_expert`` one of them over all its layers; ``kv_per_token`` one
    token's K and V over all attention layers; ``conv_per_slot`` / ``rec_per_slot`` one request's GDN states over
    all GDN layers; ``token_embedding`` one embedding row."""

    replicated: int
    experts: int
    embed: int
    lm_head: int
    dense: int
    mtp_replicated: int
    mtp_experts: int
    local_experts: int
    per_expert: float
    kv_per_token: int
    conv_per_slot: int
    rec_per_slot: int
    token_embedding: int
    num_experts: int
    top_k: int

    @property
    def state_per_slot(self) -> int:
        return self.conv_per_slot + self.rec_per_slot

    def active(self, tokens: float) -> float:
        """The chance that one expert serves some of ``tokens`` tokens under uniform routing (0 without experts)."""
        if not self.num_experts:
            return 0.0
        return 1.0 - (1.0 - self.top_k / self.num_experts) ** tokens

    def experts_touched(self, tokens: float) -> float:
        """Local experts per MoE layer that some of ``tokens`` tokens route to, expected: ``E * active``."""
        return self.local_experts * self.active(tokens)


def runner_bytes(runner: Any, ep: int = 1) -> RunnerBytes:
    """The sizes of ``runner`` (a ``ModelRunner``, abstract or loaded) per device, experts split ``ep`` ways.

    The bfloat16 screen of a float32 lm_head (``lm_head_screen``, the CPU's greedy shortcut) is neither the lm_head
    nor a dense weight: it is left out of both."""
    c: Qwen35MoeConfig = runner.config
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), runner.params)
    mtp = specs.pop("mtp", None)
    screen = specs.get("lm_head_screen")
    rep, exp = programs.weight_bytes_per_device(specs, ep)
    mtp_rep, mtp_exp = programs.weight_bytes_per_device(mtp, ep) if mtp is not None else (0, 0)
    embed = programs.nbytes(specs["embed"])
    lm_head = programs.nbytes(specs["lm_head"]) if "lm_head" in specs else embed
    untied_head = lm_head if "lm_head" in specs else 0
    dense = rep - embed - untied_head - (programs.nbytes(screen) if screen is not None else 0)
    conv_shape, rec_shape = runner.backends.gdn.state_layout.slot_shapes(runner.cache["conv"], runner.cache["rec"])
    conv_b = programs.nbytes(jax.ShapeDtypeStruct(conv_shape, runner.cache["conv"].dtype))
    rec_b = programs.nbytes(jax.ShapeDtypeStruct(rec_shape, runner.cache["rec"].dtype))
    kv_per_token = 2 * c.num_attn_layers * runner.backends.attention.layout.token_bytes(
        c.num_key_value_heads, c.head_dim, runner.kv_dtype)
    e_local = c.num_experts // ep if c.num_experts else 0
    return RunnerBytes(
        replicated=rep, experts=exp, embed=embed, lm_head=lm_head, dense=dense, mtp_replicated=mtp_rep,
        mtp_experts=mtp_exp, local_experts=e_local, per_expert=exp / e_local if e_local else 0.0,
        kv_per_token=kv_per_token, conv_per_slot=conv_b, rec_per_slot=rec_b,
        token_embedding=c.hidden_size * runner.dtype.itemsize, num_experts=c.num_experts or 0,
        top_k=c.num_experts_per_tok if c.num_experts else 0)


def snapshot_fraction(accept_length: float, page_size: int) -> float:
    """The share of a verify step's rows that take a decode snapshot: those whose accepted run reaches a page
    boundary, ``accept_length / page_size`` of them (at most all)."""
    return min(1.0, accept_length / page_size)


def step_min_bytes(rb: RunnerBytes, step: str, *, rows_rank: int, tokens: int, prefix: int, tokens_step: int,
                   page_size: int = 1, accept_length: float | None = None,
                   draft: Callable[[], float] | None = None) -> dict[str, float]:
    """The least bytes of one step on one device, by part (:data:`PARTS`; the module docstring says what each
    covers); their sum is the step's HBM roofline bytes.

    ``step``: "prefill", "decode" or "verify"; ``rows_rank``: the rank's rows; ``tokens``: new tokens per row
    (fed tokens of a verify step); ``prefix``: cached tokens before them; ``tokens_step``: the step's tokens over
    all DP ranks (the EP group routes all of them); ``page_size`` and ``accept_length``: a verify step's snapshot
    writes; ``draft``: the verify step's draft bytes (:func:`draft_min_bytes` bound to the step), else 0.

    Raises:
        ValueError: an unknown ``step``, or a verify step without ``accept_length``.
    """
    if step not in STEP_STATE_PASSES:
        raise ValueError(f"unknown step {step!r}; known: {', '.join(STEP_STATE_PASSES)}")
    passes = float(STEP_STATE_PASSES[step])
    if step == "verify":
        if accept_length is None:
            raise ValueError("a verify step's bytes need its accept length")
        passes += snapshot_fraction(accept_length, page_size)
    return {
        "lm_head": float(rb.lm_head),
        "dense": float(rb.dense),
        "embedding_rows": float(rows_rank * tokens * rb.token_embedding),
        "experts": rb.per_expert * rb.experts_touched(tokens_step),
        "kv_read": float(rows_rank * (prefix + tokens) * rb.kv_per_token),
        "kv_write": float(rows_rank * tokens * rb.kv_per_token),
        "gdn_recurrent": rows_rank * rb.rec_per_slot * passes,
        "gdn_conv": rows_rank * rb.conv_per_slot * passes,
        "draft": draft() if step == "verify" and draft is not None else 0.0,
    }


def program_min_bytes(rb: RunnerBytes, step: str, parts: dict[str, float], *, rows_rank: int, page_size: int = 1,
                      accept_length: float | None = None) -> dict[str, float]:
    """A step's least bytes (``parts``, :func:`step_min_bytes` of the same step and rows) split by the program
    that moves them, in dispatch order; the values sum to the parts' sum.

    "decode" / "prefill": ``forward`` (everything but the lm_head) and ``sample`` (the lm_head: the sampling
    program's product). "verify": ``verify`` (the target forward: its weights, experts, KV, embedding rows and
    one read of the GDN states) and ``commit`` (engine/runner/spec_programs.py: the greedy lm_head over the
    positions, the GDN states read and written again with the decode snapshots at ``accept_length /
    page_size`` of the rows, and the drafts, :func:`draft_min_bytes`).

    Raises:
        ValueError: an unknown ``step``, or a verify step without ``accept_length``."""
    if step not in STEP_STATE_PASSES:
        raise ValueError(f"unknown step {step!r}; known: {', '.join(STEP_STATE_PASSES)}")
    total = sum(parts.values())
    if step != "verify":
        return {"forward": total - parts["lm_head"], "sample": parts["lm_head"]}
    if accept_length is None:
        raise ValueError("a verify step's bytes need its accept length")
    commit = rows_rank * rb.state_per_slot * (2.0 + snapshot_fraction(accept_length, page_size))
    return {"verify": total - parts["lm_head"] - parts["draft"] - commit,
            "commit": parts["lm_head"] + commit + parts["draft"]}


def draft_min_bytes(c: Qwen35MoeConfig, rb: RunnerBytes, n_spec: int, rows: int, rows_rank: int,
                    prefix: int, draft_vocab: int | None = None) -> float:
    """Bytes the draft program must move per device: the MTP layer runs N - 1 times in a row (first over the N
    verified positions of each row, then once per further draft), each time reading its replicated weights, the
    share of its local experts its tokens route to and the lm_head (the rows of ``draft_vocab`` ids of it with
    --speculative-token-map), and reading the context's and writing the fed tokens' KV of its one attention
    layer."""
    kv_layer = rb.kv_per_token / max(c.num_attn_layers, 1)
    head = rb.lm_head * (min(draft_vocab, c.vocab_size) / c.vocab_size if draft_vocab else 1.0)
    total = 0.0
    for i in range(n_spec - 1):
        fed = n_spec if i == 0 else 1
        total += (rb.mtp_replicated + head + rb.mtp_experts * rb.active(rows * fed)
                  + rows_rank * (prefix + n_spec + i + fed) * kv_layer)
    return total
