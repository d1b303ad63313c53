"""Token sampling and logprobs on device: grammar masks, penalties, logit bias, bans, temperature, top-k,
top-p, min-p, per-request seeds.

Everything here is jit-traced with FIXED shapes: every per-row setting is an array, so the server compiles
three sampling programs per batch size (engine/model_runner.py: greedy, sample, logprobs) and nothing
else. Work a batch does not need is skipped at run time by `lax.cond` on a feature flag computed by the
host (`Features`), not by a different program. Fixed bounds (requests beyond them are refused with a 400
before they enter a batch, engine/engine.py):

- TOP_K_BOUND: top-k up to this uses `lax.top_k(., TOP_K_BOUND)`; a larger top_k (SGLang allows any) falls
  back to a bisection on the k-th value (exact up to ties), only in steps that have such a row.
- TOP_LOGPROBS_MAX: alternatives per position (`top_logprobs_num`); OpenAI's chat API caps it at 20 too.
- LOGIT_BIAS_MAX: entries of one request's `logit_bias` (OpenAI documents no number; 300 is what the
  OpenAI API accepts in practice and more than any tokenizer-level use needs).
- BAN_WIDTH: ids masked out before min_new_tokens (stop_token_ids and EOS).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

NEG_INF = -1e30
TOP_K_BOUND = 64
TOP_LOGPROBS_MAX = 20
LOGIT_BIAS_MAX = 300
LOGIT_BIAS_WIDTH = 304  # LOGIT_BIAS_MAX padded to a multiple of 16
BAN_WIDTH = 256
PENALTY_CHUNK = 1024  # ids per call of the penalty-table programs
GREEDY_VOCAB_BLOCK = 8192  # vocabulary rows per block of the fused lm_head + argmax
_TOP_P_SEARCH_STEPS = 32


class Features(NamedTuple):
    """Scalar bool flags of one step, computed on the host: which optional work any row needs."""

    grammar: jax.Array
    penalty: jax.Array
    bias: jax.Array  # logit_bias or bans present
    top_k: jax.Array
    top_k_large: jax.Array  # some row has top_k > TOP_K_BOUND
    top_p: jax.Array
    min_p: jax.Array


class RowParams(NamedTuple):
    """Per-row sampling inputs of one step; B rows (padding rows included). Fixed shapes per B.

    temperature [B] f32 (0: greedy); top_p [B] f32 in (0, 1]; top_k [B] i32 (<= 0 off); min_p [B] f32;
    seeds [B] u32; steps [B] i32 (output position, folded into the row's key); repetition, frequency,
    presence [B] f32; penalty_table [B, V] i32 (2 * output count + seen bit, see penalty_mark/count; zeros
    when unused); bias_ids [B, LOGIT_BIAS_WIDTH] i32 (-1 padded) and bias_vals [B, LOGIT_BIAS_WIDTH] f32;
    ban_ids [B, BAN_WIDTH] i32 (-1 padded); bitmask [B, ceil(V/32)] i32 (grammar/bitmask.py layout, all
    ones when unconstrained).
    """

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    min_p: jax.Array
    seeds: jax.Array
    steps: jax.Array
    repetition: jax.Array
    frequency: jax.Array
    presence: jax.Array
    penalty_table: jax.Array
    bias_ids: jax.Array
    bias_vals: jax.Array
    ban_ids: jax.Array
    bitmask: jax.Array


def token_logprobs(
    logits: jax.Array, target_ids: jax.Array, num_top: int = TOP_LOGPROBS_MAX
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


# ---- penalty table (SGLang's penalizer state, rebuilt per step from the host's token lists) ----------
def penalty_zeros(batch: int, vocab: int) -> jax.Array:
    """An empty [batch, vocab] int32 penalty table (jit with static batch/vocab)."""
    return jnp.zeros((batch, vocab), jnp.int32)


def penalty_mark(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Set the seen bit of ids [B, C] (-1 padded): prompt and output tokens (repetition penalty scope).

    Call before penalty_count on a zero table. Returns [B, V] int32."""
    v = table.shape[1]
    rows = jnp.arange(table.shape[0])[:, None]
    return table.at[rows, jnp.where(ids >= 0, ids, v)].set(1, mode="drop")


def penalty_count(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Add 2 per occurrence of output ids [B, C] (-1 padded) (frequency / presence scope). Returns [B, V]."""
    v = table.shape[1]
    rows = jnp.arange(table.shape[0])[:, None]
    return table.at[rows, jnp.where(ids >= 0, ids, v)].add(2, mode="drop")


def apply_penalties(
    logits: jax.Array, table: jax.Array, repetition: jax.Array, frequency: jax.Array, presence: jax.Array
) -> jax.Array:
    """Repetition (CTRL, Keskar et al. 2019; HF's rule), frequency and presence (OpenAI) penalties.

    Args:
      logits: [B, V] float32.
      table: [B, V] int32, bit 0 = token seen in prompt or output, table >> 1 = count in the output.
      repetition, frequency, presence: [B] float32 (1.0, 0.0, 0.0 leave a row unchanged).
    Returns: [B, V] float32.
    """
    seen = (table & 1) > 0
    counts = (table >> 1).astype(jnp.float32)
    rep = repetition[:, None]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalised, logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


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


def process_logits(logits: jax.Array, p: RowParams, f: Features) -> jax.Array:
    """Grammar mask, penalties, logit bias, then bans; each step skipped at run time when no row uses it.

    logits: [B, V] float32 raw. Returns [B, V] float32. Where a row's grammar allows only banned ids (EOS
    before min_new_tokens) the grammar wins: the bans of that row are dropped.
    """
    b, v = logits.shape
    rows = jnp.arange(b)[:, None]
    masked = jax.lax.cond(f.grammar, lambda x: apply_token_bitmask(x, p.bitmask)[0], lambda x: x, logits)
    masked = jax.lax.cond(
        f.penalty, lambda x: apply_penalties(x, p.penalty_table, p.repetition, p.frequency, p.presence),
        lambda x: x, masked)

    def bias_and_bans(x: jax.Array) -> jax.Array:
        biased = x.at[rows, jnp.where(p.bias_ids >= 0, p.bias_ids, v)].add(p.bias_vals, mode="drop")
        banned = biased.at[rows, jnp.where(p.ban_ids >= 0, p.ban_ids, v)].set(NEG_INF, mode="drop")

        def grammar_wins() -> jax.Array:  # only a grammar can leave a row nothing but banned ids
            allowed = unpack_token_bitmask(p.bitmask, v)
            keeps_one = jnp.any(allowed & (banned > NEG_INF), axis=-1, keepdims=True)
            return jnp.where(keeps_one, banned, biased)

        return jax.lax.cond(f.grammar, grammar_wins, lambda: banned)

    return jax.lax.cond(f.bias, bias_and_bans, lambda x: x, masked)


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


def _kth_value_bisect(x: jax.Array, k: jax.Array) -> jax.Array:
    """Per row, the largest t with count(x >= t) >= k (the k-th largest value up to float resolution).

    x: [B, V] float32 with finite entries >= NEG_INF; k: [B] int32 >= 1. Returns [B] float32. Bisection on
    the value (64 halvings of the row's range), for top_k beyond TOP_K_BOUND.
    """
    lo = jnp.min(x, axis=-1)
    hi = jnp.max(x, axis=-1)

    def body(_, lo_hi):
        lo, hi = lo_hi
        mid = 0.5 * (lo + hi)
        ok = jnp.sum(x >= mid[:, None], axis=-1) >= k
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 64, body, (lo, hi))
    return lo


def _top_k_cut(scaled: jax.Array, top_k: jax.Array, large: jax.Array) -> jax.Array:
    """Mask everything below each row's k-th largest value (rows with top_k <= 0 untouched). [B, V]."""
    kth = jax.lax.top_k(scaled, TOP_K_BOUND)[0]
    idx = jnp.clip(top_k - 1, 0, TOP_K_BOUND - 1)
    cut = jnp.take_along_axis(kth, idx[:, None], axis=-1)[:, 0]
    cut = jax.lax.cond(large, lambda: jnp.where(top_k > TOP_K_BOUND, _kth_value_bisect(scaled, top_k), cut),
                       lambda: cut)
    return jnp.where((top_k[:, None] > 0) & (scaled < cut[:, None]), NEG_INF, scaled)


def greedy_ids(logits: jax.Array) -> jax.Array:
    """Argmax per row (lowest id on ties). logits [B, V] -> [B] int32."""
    # top_k(., 1) rather than argmax: XLA:CPU's variadic argmax reduce is ~1.5x slower over 248k ids.
    return jax.lax.top_k(logits, 1)[1][:, 0].astype(jnp.int32)


def fused_greedy(hidden: jax.Array, weight: jax.Array, block: int = GREEDY_VOCAB_BLOCK) -> jax.Array:
    """Argmax of hidden @ weight.T per row without materialising the [B, V] logits.

    hidden: [B, H]; weight: [V, H] (lm_head, HF layout). Blocks of `block` vocabulary rows (the last one
    overlaps the previous so every block has the same shape); a later block wins only when strictly
    larger, so ties resolve to the lowest id as in greedy_ids. Returns [B] int32.
    """
    v = weight.shape[0]
    block = min(block, v)
    n = -(-v // block)
    b = hidden.shape[0]

    def body(i, best):
        val, idx = best
        start = jnp.minimum(i * block, v - block)
        w = jax.lax.dynamic_slice_in_dim(weight, start, block, axis=0)
        logits = jnp.einsum("nh,vh->nv", hidden, w, preferred_element_type=jnp.float32)
        top_val, top_idx = jax.lax.top_k(logits, 1)
        better = top_val[:, 0] > val
        return jnp.where(better, top_val[:, 0], val), jnp.where(better, top_idx[:, 0].astype(jnp.int32) + start, idx)

    init = (jnp.full((b,), -jnp.inf, jnp.float32), jnp.zeros((b,), jnp.int32))
    return jax.lax.fori_loop(0, n, body, init)[1]


def sample(logits: jax.Array, p: RowParams, f: Features) -> jax.Array:
    """Pick the next token per row from processed logits.

    Args:
      logits: [B, V] float32 (process_logits applied).
      p: temperature (0: greedy row), top_k, top_p, min_p, seeds and steps are read; the seed and the
        output position are folded into the key, so a seeded request samples the same tokens whatever
        batch it runs in.
      f: top_k / top_k_large / top_p / min_p flags skip unused filters.
    Returns: [B] int32 token ids.
    """
    greedy = greedy_ids(logits)
    is_greedy = p.temperature <= 0.0
    scaled = logits / jnp.where(is_greedy, 1.0, p.temperature)[:, None]
    scaled = jax.lax.cond(f.top_k, lambda x: _top_k_cut(x, p.top_k, f.top_k_large), lambda x: x, scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    probs = jax.lax.cond(
        f.top_p, lambda q: jnp.where(q >= _top_p_floor(q, p.top_p)[:, None], q, 0.0), lambda q: q, probs)
    probs = jax.lax.cond(
        f.min_p, lambda q: jnp.where(q >= (p.min_p * jnp.max(q, axis=-1))[:, None], q, 0.0), lambda q: q, probs)
    # Inverse-CDF sampling: one uniform per row instead of V Gumbel draws (random bits dominate on CPU).
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.PRNGKey(s), t))(p.seeds, p.steps)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    cdf = jnp.cumsum(probs, axis=-1)
    target = u * cdf[:, -1]
    sampled = jnp.sum(cdf <= target[:, None], axis=-1).astype(jnp.int32)
    # Never land on a zero-probability id (u * total can equal the total in float rounding).
    sampled = jnp.minimum(sampled, jnp.argmax(jnp.where(probs > 0, jnp.arange(probs.shape[-1]), -1), axis=-1))
    return jnp.where(is_greedy, greedy, sampled.astype(jnp.int32))
