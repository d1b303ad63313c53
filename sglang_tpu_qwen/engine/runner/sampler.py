"""Token sampling and logprobs on device: grammar masks, penalties, logit bias, bans, temperature, top-k,
top-p, min-p, per-request seeds.

Everything here is jit-traced with FIXED shapes: every per-row setting is an array, so the server compiles
two sampling programs per batch size (engine/runner/model_runner.py: greedy, sample) and nothing else.
Full-vocabulary work a batch does not need (penalties, grammar mask, top-k / top-p / min-p, logprobs) is
skipped at run time by `lax.cond` on a feature flag computed by the host (`Features`), not by a different
program. Fixed bounds (requests beyond them are refused with a 400 before they enter a batch,
engine/engine.py):

- TOP_K_BOUND: top-k up to this uses `vocab_top_k(., TOP_K_BOUND)`; a larger top_k (SGLang allows any) falls
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
VOCAB_BLOCK = 128  # vocabulary ids per block of vocab_top_k's first reduction
_TOP_P_SEARCH_STEPS = 32


def unused_row_bytes(vocab_size: int) -> int:
    """Device bytes per row of a sampling program's "unused" inputs (StepExecutor.unused_inputs, kept resident
    per batch size): the [V] int32 penalty table row, the grammar bitmask, logit-bias and ban ids, and nine
    4-byte per-row scalars of RowParams. Logical bytes: a TPU pads small arrays to its (8, 128) tiles (the 1-
    and 4-row tables, the 304-wide bias columns), a few MB in all, which the runtime headroom covers."""
    return 4 * (vocab_size + -(-vocab_size // 32) + 2 * LOGIT_BIAS_WIDTH + BAN_WIDTH + 9)


class Features(NamedTuple):
    """Scalar bool flags of one step, computed on the host: which optional work any row needs."""

    grammar: jax.Array
    penalty: jax.Array
    bias: jax.Array  # some row has a logit_bias
    top_k: jax.Array
    top_k_large: jax.Array  # some row has top_k > TOP_K_BOUND
    top_p: jax.Array
    min_p: jax.Array
    logprobs: jax.Array  # some row wants logprobs (the general program computes them only then)


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
    """Log-probabilities of chosen tokens and of the `num_top` most likely ones (prompt logprobs): the
    target's raw logit minus :func:`raw_logprob_top`'s logsumexp, as the sample program computes a sampled
    token's, so a token scored in the prompt and sampled in the output reports one value.

    Args:
      logits: [N, V] float32 raw logits (before temperature or penalties, as SGLang reports them).
      target_ids: [N] int32 token whose logprob is wanted.
      num_top: static count of top alternatives (0 gives empty [N, 0] arrays).
    Returns:
      (logprob [N] float32, at most 0; top_logprobs [N, num_top] float32, top_ids [N, num_top] int32).
    """
    logits = logits.astype(jnp.float32)
    lse, top_vals, top_ids = raw_logprob_top(logits, num_top)
    chosen = jnp.take_along_axis(logits, target_ids[:, None].astype(jnp.int32), axis=-1)[:, 0]
    # min: a near-certain token's logit and the logsumexp round differently (~1e-7 above 0 otherwise).
    return jnp.minimum(chosen - lse, 0.0), top_vals, top_ids


def raw_logprob_top(logits: jax.Array, num_top: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The log-normaliser of raw logits and their `num_top` most likely tokens, for a caller that gets the
    chosen token's logit elsewhere (logprob = logit - lse) and must not keep the [N, V] logits alive.

    Args:
      logits: [N, V] float32 raw logits (before temperature or penalties, as SGLang reports them).
      num_top: static count of top alternatives (0 gives empty [N, 0] arrays).
    Returns:
      (lse [N] float32 logsumexp, top_logprobs [N, num_top] float32, top_ids [N, num_top] int32).
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    if num_top == 0:
        n = logits.shape[0]
        return lse, jnp.zeros((n, 0), jnp.float32), jnp.zeros((n, 0), jnp.int32)
    top_vals, top_ids = vocab_top_k(logits, num_top)
    return lse, top_vals - lse[:, None], top_ids


# ---- penalty table (SGLang's penalizer state, rebuilt per step from the host's token lists) ----------
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


def penalty_update(table: jax.Array, seen: jax.Array, output: jax.Array) -> jax.Array:
    """penalty_count(penalty_mark(table, seen), output): one program for both (seen, output: [B, C]).

    The seen bit is set, not or-ed: feed every seen chunk (output all -1) before any output chunk (seen
    all -1). Returns [B, V] int32."""
    return penalty_count(penalty_mark(table, seen), output)


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


def _bias_and_bans(x: jax.Array, p: RowParams) -> jax.Array:
    """Logit bias added, banned ids set to NEG_INF: scatters of at most LOGIT_BIAS_WIDTH / BAN_WIDTH ids per
    row (-1 padding is dropped), cheap enough to run in every step. x [B, V] float32 -> [B, V]."""
    b, v = x.shape
    rows = jnp.arange(b)[:, None]
    x = x.at[rows, jnp.where(p.bias_ids >= 0, p.bias_ids, v)].add(p.bias_vals, mode="drop")
    return x.at[rows, jnp.where(p.ban_ids >= 0, p.ban_ids, v)].set(NEG_INF, mode="drop")


def process_logits(logits: jax.Array, p: RowParams, f: Features) -> jax.Array:
    """Penalties, logit bias, bans, then the grammar mask.

    logits: [B, V] float32 raw. Returns [B, V] float32. The penalty table and the grammar bitmask are full
    [B, V] passes, skipped at run time by `lax.cond` when no row uses them. Bans win over a grammar only
    where the grammar allows another id: the host drops a row's bans otherwise
    (engine/schedule_batch.sampling_batch).
    """
    x = jax.lax.cond(
        f.penalty, lambda x: apply_penalties(x, p.penalty_table, p.repetition, p.frequency, p.presence),
        lambda x: x, logits)
    x = _bias_and_bans(x, p)
    return jax.lax.cond(f.grammar, lambda x: apply_token_bitmask(x, p.bitmask)[0], lambda x: x, x)


def _top_p_floor(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """Smallest probability kept by nucleus sampling (Holtzman et al. 2020), per row.

    Usually the threshold is among a row's TOP_K_BOUND largest probabilities (their mass reaches top_p: a
    sharp distribution, or any row after a top-k cut of at most TOP_K_BOUND): the sorted-cumsum definition
    over those (`vocab_top_k`, one pass over the vocabulary). Rows with top_p >= 1 keep everything (floor
    0). Only when some row's threshold lies deeper does the step bisect (`_top_p_bisect`, 32 passes over
    [B, V]: 42 vs 15 ms at 8 rows on the 2-core CPU). Both keep every probability >= the threshold (ties
    included). probs: [B, V] float32, rows summing to 1; top_p: [B]. Returns [B] float32.
    """
    vals = vocab_top_k(probs, min(TOP_K_BOUND, probs.shape[-1]))[0]  # [B, K] descending
    last = jnp.sum(jnp.cumsum(vals, axis=-1) < top_p[:, None], axis=-1)  # rank of the last kept value
    found = (last < vals.shape[-1]) | (top_p >= 1.0)
    fast = jnp.where(top_p >= 1.0, 0.0,
                     jnp.take_along_axis(vals, jnp.minimum(last, vals.shape[-1] - 1)[:, None], axis=-1)[:, 0])
    return jax.lax.cond(jnp.all(found), lambda: fast,
                        lambda: jnp.where(found, fast, _top_p_bisect(probs, top_p)))


def _top_p_bisect(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """`_top_p_floor` by bisection on the threshold t with mass(t) = sum(p[p >= t]) >= top_p: no sort of the
    whole vocabulary (248k entries); the kept set equals the sorted-cumsum definition up to ties and float32
    resolution. probs: [B, V] float32; top_p: [B]. Returns [B] float32.
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
    kth = vocab_top_k(scaled, TOP_K_BOUND)[0]
    idx = jnp.clip(top_k - 1, 0, TOP_K_BOUND - 1)
    cut = jnp.take_along_axis(kth, idx[:, None], axis=-1)[:, 0]
    cut = jax.lax.cond(large, lambda: jnp.where(top_k > TOP_K_BOUND, _kth_value_bisect(scaled, top_k), cut),
                       lambda: cut)
    return jnp.where((top_k[:, None] > 0) & (scaled < cut[:, None]), NEG_INF, scaled)


def vocab_blocks(x: jax.Array, fill: float, block: int = VOCAB_BLOCK) -> jax.Array:
    """[..., V] -> [..., ceil(V / block), block]: the last axis padded with `fill` and split into blocks of
    `block` ids (block j holds ids [j * block, (j + 1) * block))."""
    pad = -x.shape[-1] % block
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=fill)
    return x.reshape(*x.shape[:-1], -1, block)


def vocab_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` over the last axis (values descending, lowest id first on ties), in two short passes.

    The k largest values lie in the k blocks (of VOCAB_BLOCK ids) with the largest block maxima, ties to
    the lower block: a block ranked after them holds no value that ranks before all of theirs. So the max
    of each block, top-k over those, then top-k over the k * VOCAB_BLOCK gathered candidates (in id
    order, so ties keep the lowest id). XLA:CPU's top-k over 248k ids costs ~10x a plain max reduce; on
    TPU both are HBM-bound.

    x: [B, V] float32; k: static, <= V. Returns (values [B, k] float32, ids [B, k] int32).
    """
    b, v = x.shape
    if -(-v // VOCAB_BLOCK) <= k:
        vals, ids = jax.lax.top_k(x, k)
        return vals, ids.astype(jnp.int32)
    blocks = vocab_blocks(x, -jnp.inf)
    chosen = jnp.sort(jax.lax.top_k(jnp.max(blocks, axis=-1), k)[1], axis=-1)
    candidates = jnp.take_along_axis(blocks, chosen[:, :, None], axis=1).reshape(b, k * VOCAB_BLOCK)
    vals, pos = jax.lax.top_k(candidates, k)
    block = jnp.take_along_axis(chosen, pos // VOCAB_BLOCK, axis=1)
    return vals, (block * VOCAB_BLOCK + pos % VOCAB_BLOCK).astype(jnp.int32)


def greedy_ids(logits: jax.Array) -> jax.Array:
    """Argmax per row, lowest id on ties. logits [B, V] float32 -> [B] int32.

    One variadic reduce (`jnp.argmax` keeps the first maximum): on a TPU it reads the logits once, where
    `vocab_top_k`'s [B, V / 128, 128] blocks cost two relayout copies and a second pass (0.56 ms of a 9.7 ms
    decode step at 64 rows of the 35B-shaped checkpoint on the v5e)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


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
        # Greedy rows take no nucleus (top_p 1): a flat one of theirs would only force the slow path.
        f.top_p, lambda q: jnp.where(q >= _top_p_floor(q, jnp.where(is_greedy, 1.0, p.top_p))[:, None], q, 0.0),
        lambda q: q, probs)
    probs = jax.lax.cond(
        f.min_p, lambda q: jnp.where(q >= (p.min_p * jnp.max(q, axis=-1))[:, None], q, 0.0), lambda q: q, probs)
    # Inverse-CDF sampling: one uniform per row instead of V Gumbel draws (random bits dominate on CPU).
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.PRNGKey(s), t))(p.seeds, p.steps)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    return jnp.where(is_greedy, greedy, _inverse_cdf(probs, u))


def _inverse_cdf(probs: jax.Array, u: jax.Array) -> jax.Array:
    """The id where each row's cumulative probability passes u * total. probs [B, V] >= 0 float32 (not
    necessarily normalised), u [B] in [0, 1). Returns [B] int32, never a zero-probability id.

    Two levels, as vocab_top_k: the cumulative mass of VOCAB_BLOCK-wide blocks picks the block, a cumsum
    inside that block picks the id (a cumsum over all V ids is a slow reduce-window on XLA:CPU).
    """
    blocks = vocab_blocks(probs, 0.0)
    mass = jnp.sum(blocks, axis=-1)
    block_cdf = jnp.cumsum(mass, axis=-1)
    target = u * block_cdf[:, -1]
    positions = jnp.arange(mass.shape[1])
    # Never land on a zero-mass block or id: u * total can round up to the total.
    last_block = jnp.max(jnp.where(mass > 0, positions, 0), axis=-1)
    block = jnp.minimum(jnp.sum(block_cdf <= target[:, None], axis=-1), last_block)
    before = jnp.where(block > 0, jnp.take_along_axis(block_cdf, jnp.maximum(block - 1, 0)[:, None], 1)[:, 0], 0.0)
    inside = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]
    offsets = jnp.arange(VOCAB_BLOCK)
    last_id = jnp.max(jnp.where(inside > 0, offsets, 0), axis=-1)
    within = jnp.sum(jnp.cumsum(inside, axis=-1) <= (target - before)[:, None], axis=-1)
    return (block * VOCAB_BLOCK + jnp.minimum(within, last_id)).astype(jnp.int32)
