"""Token sampling and logprobs on device: penalties, temperature, top-k, top-p, min-p, per-request seeds.

Everything here is jit-traced; the few static flags (all rows greedy, penalties on, number of top
logprobs) keep the common paths free of work they do not need.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30
_TOP_P_SEARCH_STEPS = 32


def token_logprobs(
    logits: jax.Array, target_ids: jax.Array, num_top: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities of chosen tokens and of the `num_top` most likely ones.

    Args:
      logits: [N, V] float32 raw logits (before temperature or penalties, as SGLang reports them).
      target_ids: [N] int32 token whose logprob is wanted.
      num_top: static count of top alternatives (0 gives empty [N, 0] arrays).
    Returns:
      (logprob [N] float32, top_logprobs [N, num_top] float32, top_ids [N, num_top] int32).
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, target_ids[:, None].astype(jnp.int32), axis=-1)[:, 0]
    if num_top == 0:
        n = logits.shape[0]
        return chosen, jnp.zeros((n, 0), jnp.float32), jnp.zeros((n, 0), jnp.int32)
    top_vals, top_ids = jax.lax.top_k(logp, num_top)
    return chosen, top_vals, top_ids.astype(jnp.int32)


def apply_penalties(
    logits: jax.Array,
    seen_ids: jax.Array,
    output_ids: jax.Array,
    repetition: jax.Array,
    frequency: jax.Array,
    presence: jax.Array,
) -> jax.Array:
    """Repetition (CTRL, Keskar et al. 2019; HF's rule), frequency and presence (OpenAI) penalties.

    Args:
      logits: [B, V] float32.
      seen_ids: [B, L] int32 prompt + output ids, -1 padded (repetition penalty scope).
      output_ids: [B, Lo] int32 output ids, -1 padded (frequency/presence scope).
      repetition, frequency, presence: [B] float32 (1.0, 0.0, 0.0 leave a row unchanged).
    Returns: [B, V] float32.
    """
    b, v = logits.shape
    rows = jnp.arange(b)[:, None]
    seen = jnp.zeros((b, v), jnp.bool_).at[rows, jnp.where(seen_ids >= 0, seen_ids, v)].set(True, mode="drop")
    counts = jnp.zeros((b, v), jnp.float32).at[rows, jnp.where(output_ids >= 0, output_ids, v)].add(
        1.0, mode="drop"
    )
    rep = repetition[:, None]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalised, logits)
    logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    return logits


def _top_p_floor(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """Smallest probability kept by nucleus sampling (Holtzman et al. 2020), per row.

    Bisection on the threshold t with mass(t) = sum(p[p >= t]) >= top_p avoids sorting the whole
    vocabulary (248k entries) every step; the kept set equals the sorted-cumsum definition up to ties.
    probs: [B, V] float32; top_p: [B]. Returns [B] float32.
    """

    def body(_, lo_hi):
        lo, hi = lo_hi
        mid = 0.5 * (lo + hi)
        mass = jnp.sum(jnp.where(probs >= mid[:, None], probs, 0.0), axis=-1)
        ok = mass >= top_p
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo = jnp.zeros(probs.shape[0], jnp.float32)
    hi = jnp.max(probs, axis=-1)
    lo, _ = jax.lax.fori_loop(0, _TOP_P_SEARCH_STEPS, body, (lo, hi))
    return lo


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    min_p: jax.Array,
    seeds: jax.Array,
    steps: jax.Array,
    *,
    all_greedy: bool,
    max_top_k: int,
    use_top_p: bool,
    use_min_p: bool,
) -> jax.Array:
    """Pick the next token per row.

    Args:
      logits: [B, V] float32, penalties already applied.
      temperature: [B] float32; 0 means greedy (argmax).
      top_p: [B] float32 in (0, 1]; top_k: [B] int32 (<= 0: off); min_p: [B] float32.
      seeds: [B] uint32 per-request seed; steps: [B] int32 output position, folded into the key so a
        seeded request samples the same tokens whatever batch it runs in.
      all_greedy: static; skip the sampling work.
      max_top_k: static bucket >= every active top_k (0 when no row uses top-k).
      use_top_p, use_min_p: static; whether any row has top_p < 1 / min_p > 0.
    Returns: [B] int32 token ids.
    """
    # top_k(., 1) rather than argmax: XLA:CPU's variadic argmax reduce is ~1.5x slower over 248k ids.
    greedy_ids = jax.lax.top_k(logits, 1)[1][:, 0].astype(jnp.int32)
    if all_greedy:
        return greedy_ids
    is_greedy = temperature <= 0.0
    scaled = logits / jnp.where(is_greedy, 1.0, temperature)[:, None]
    if max_top_k > 0:
        kth = jax.lax.top_k(scaled, max_top_k)[0]
        idx = jnp.clip(top_k - 1, 0, max_top_k - 1)
        cut = jnp.take_along_axis(kth, idx[:, None], axis=-1)
        scaled = jnp.where((top_k[:, None] > 0) & (scaled < cut), NEG_INF, scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    if use_top_p:
        probs = jnp.where(probs >= _top_p_floor(probs, top_p)[:, None], probs, 0.0)
    if use_min_p:
        probs = jnp.where(probs >= (min_p * jnp.max(probs, axis=-1))[:, None], probs, 0.0)
    # Inverse-CDF sampling: one uniform per row instead of V Gumbel draws (random bits dominate on CPU).
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.PRNGKey(s), t))(seeds, steps)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    cdf = jnp.cumsum(probs, axis=-1)
    target = u * cdf[:, -1]
    sampled = jnp.sum(cdf <= target[:, None], axis=-1).astype(jnp.int32)
    # Never land on a zero-probability id (u * total can equal the total in float rounding).
    sampled = jnp.minimum(sampled, jnp.argmax(jnp.where(probs > 0, jnp.arange(probs.shape[-1]), -1), axis=-1))
    return jnp.where(is_greedy, greedy_ids, sampled.astype(jnp.int32))


def unpack_token_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """[B, ceil(V/32)] int32 token bitmask (bit t % 32 of word t // 32 = token t) -> [B, V] bool allowed."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # arithmetic shift: bit 31 of a negative word reads as 1 too
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(jnp.bool_)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Grammar mask: tokens a row's bitmask disallows get NEG_INF.

    Args:
      logits: [B, V] float32.
      bitmask: [B, ceil(V/32)] int32 (grammar/bitmask.py layout; all ones for unconstrained rows).
    Returns: (masked logits [B, V] float32, allowed [B, V] bool).
    """
    allowed = unpack_token_bitmask(bitmask, logits.shape[-1])
    return jnp.where(allowed, logits, NEG_INF), allowed
