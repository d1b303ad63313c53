"""ForwardBatch: one step's batch as the model sees it (SGLang's ``forward_batch_info.py``).

The scheduler lays a step out in batch rows (``ScheduleBatch``, engine/scheduler/schedule_batch.py) and
hands the runner a ``ForwardBatch`` of host (numpy) arrays; the runner sends it to the device as one packed
array and rebuilds it inside the compiled program, where the same class (now of traced arrays) goes into
``forward_step``, through the mesh's ``shard_map`` and into every layer. It is a registered pytree: its
arrays are leaves, its mode is static.

Row layout: B rows (padding rows included, all-zero: page 0 / slot 0 are the trash targets), T token
columns; with DP attention rank r owns rows ``[r*B/dp, (r+1)*B/dp)``.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp


class ForwardMode(enum.Enum):
    """What a step feeds: prompt chunks (EXTEND), one token per request (DECODE), a decoding request's last
    token and its draft tokens (TARGET_VERIFY, speculative decoding: the GDN state is not written, see
    model/forward.py), or nothing (IDLE)."""

    EXTEND = "extend"
    DECODE = "decode"
    TARGET_VERIFY = "target_verify"
    IDLE = "idle"

    @property
    def is_decode(self) -> bool:
        """One token per request (T == 1)."""
        return self is ForwardMode.DECODE

    @property
    def is_extend(self) -> bool:
        """Prompt chunks (T >= 1 new tokens per row)."""
        return self is ForwardMode.EXTEND

    @property
    def is_verify(self) -> bool:
        """Draft tokens checked by the target (T = 1 + drafts; the GDN state is kept, not advanced)."""
        return self is ForwardMode.TARGET_VERIFY


@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    """The arrays of one model step (host numpy arrays before the runner, traced arrays inside a program).

    Attributes:
        mode: static; DECODE steps have T == 1 and run the recurrent GDN form, EXTEND steps the chunked one.
        input_ids: ``[B, T]`` int32 new tokens per row, left-aligned, 0-padded.
        prefix_lens: ``[B]`` int32 tokens already in the cache; 0 means the row's GDN state starts at zero.
        extend_lens: ``[B]`` int32 new tokens per row (0 on padding rows).
        page_table: ``[B, P]`` int32 KV pages covering positions ``[0, prefix_len + extend_len)``; rest 0.
        slot_ids: ``[B]`` int32 GDN state slot per row (0 on padding rows).
        token_src: ``[B]`` int32 or None (host side only; overlap scheduling): where >= 0, row b's first token
            is row ``token_src[b]`` of the previous step's sampled ids, kept on the device. The runner
            resolves it before the model runs; the model never reads it.
        rope_deltas: ``[B]`` int32 or None (vision-language models): the rotary position of token t is
            ``prefix_len + t + rope_delta`` in all three M-RoPE streams (text after an image, decode;
            model/mrope.py). None: the position itself (every text-only model).
        mrope_positions: ``[B, T, 3]`` int32 or None: explicit (time, height, width) rotary positions of every
            token (a step whose chunk holds image tokens); overrides ``rope_deltas``.
        image_embeds: ``[B, T, H]`` compute dtype or None: the vision tower's output for the image pad tokens
            of the step (rows of other tokens are ignored); the pad tokens' embeddings are replaced by it
            (HF ``masked_scatter`` of ``get_placeholder_mask``). Present with ``mrope_positions``.
    """

    mode: ForwardMode
    input_ids: Any
    prefix_lens: Any
    extend_lens: Any
    page_table: Any
    slot_ids: Any
    token_src: Any = None
    rope_deltas: Any = None
    mrope_positions: Any = None
    image_embeds: Any = None

    @classmethod
    def of(cls, input_ids: Any, prefix_lens: Any, extend_lens: Any, page_table: Any, slot_ids: Any,
           token_src: Any = None) -> ForwardBatch:
        """The batch of these arrays, its mode from its shape: DECODE when ``T == 1``, else EXTEND."""
        mode = ForwardMode.DECODE if input_ids.shape[1] == 1 else ForwardMode.EXTEND
        return cls(mode, input_ids, prefix_lens, extend_lens, page_table, slot_ids, token_src)

    @property
    def batch_size(self) -> int:
        """B: rows, padding rows included."""
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        """T: token columns per row."""
        return self.input_ids.shape[1]

    # Derived per-token views (traced: XLA computes each once per program).
    @property
    def positions(self) -> jax.Array:
        """``[B, T]`` int32 absolute position of each new token."""
        return self.prefix_lens[:, None] + jnp.arange(self.num_tokens, dtype=jnp.int32)[None, :]

    @property
    def valid(self) -> jax.Array:
        """``[B, T]`` bool: the token is real (not padding)."""
        return jnp.arange(self.num_tokens, dtype=jnp.int32)[None, :] < self.extend_lens[:, None]

    @property
    def kv_lens(self) -> jax.Array:
        """``[B]`` int32 tokens in the cache once this step has written its own."""
        return self.prefix_lens + self.extend_lens

    @property
    def fresh(self) -> jax.Array:
        """``[B]`` bool: the row's GDN state starts at zero (no prefix)."""
        return self.prefix_lens == 0


jax.tree_util.register_dataclass(
    ForwardBatch,
    data_fields=["input_ids", "prefix_lens", "extend_lens", "page_table", "slot_ids", "token_src", "rope_deltas",
                 "mrope_positions", "image_embeds"],
    meta_fields=["mode"],
)
