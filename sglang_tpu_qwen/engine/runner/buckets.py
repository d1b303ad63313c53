"""The fixed set of step shapes the server compiles (issue 12, point 1).

A model step runs on host arrays padded to one `StepBucket`: `batch` rows (all DP ranks together, rank
r owning rows [r*B/dp, (r+1)*B/dp)), `tokens` new tokens per row, and a page table `pages` columns wide.
The set is enumerated once from the server flags; the server compiles every bucket before it reports
ready (ModelRunner.precompile) and the deviceless planner lowers the same buckets. A step that fits no
bucket is never compiled on the fly: the scheduler caps it (fewer rows, shorter chunks) with
`BucketSet.extend_bucket` / `decode_bucket`, and the rest runs in the next step.

The enumeration (per DP rank):

- batch sizes: 1 and the powers of two from 4 up to next_pow2(ceil(max_running_requests / dp)), or
  --precompile-bs-paddings. No 2: a step of 2 rows runs in the 4-row bucket; a decode step (forward and
  greedy sampling) of 1 to 16 rows costs the same on the 2-core CPU (9-14 ms, the embedded model) and is
  bound by the weights' bytes on a TPU, and each batch size costs a forward, two sampling, a penalty-table
  and a keep-sampled program (and head-rows programs);
- extend tokens per row: powers of four from 16, and next_pow2(chunked_prefill_size) itself, or
  --precompile-token-paddings (default chunk 512: 16, 64, 256, 512). A chunk pads to at most 4x its
  length: extend time grows about linearly with the padded tokens (1.6 ms for 16 tokens, 22 ms for 512 on
  the CPU, embedded model) but each size costs one or two forward programs, ~2.5 s of startup each on the
  2-core CPU. For each size, two extend buckets: the smallest batch size and the largest b with
  b * t <= the extend budget next_pow2(chunked_prefill_size) (a prefill chunk is at most
  chunked_prefill_size tokens per rank);
- decode: every batch size with one token;
- pages: ONE width, ceil(min(context_length, KV tokens per rank) / page_size). The page-table width is not
  a compiled dimension: the reference attention walks the keys in blocks up to the longest context of
  the batch (model/attention.py) and the Pallas kernel by each row's own length, so a wide table costs
  only its host-to-device copy (B * pages * 4 bytes). Measured on the 2-core CPU (B=32 decode, 4 heads,
  head dim 64, 201-token contexts): 3.5 ms per layer at 16 columns and at 2048 columns; the previous
  gather-everything reference took 17 ms at 32 columns and 1.9 s at 2048.

Sampling programs depend on the batch only (`sample_batches`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sglang_tpu_qwen.args.server_args import MIN_PREFILL_CHUNK
from sglang_tpu_qwen.utils.shapes import next_pow2

# Smallest extend bucket: shorter chunks pad to it (one program for all short prompts); also the least a DP
# rank's share of --chunked-prefill-size may be (ServerArgs checks it).
MIN_EXTEND_TOKENS = MIN_PREFILL_CHUNK

Mode = Literal["extend", "decode"]




@dataclass(frozen=True, order=True)
class StepBucket:
    """Shape of one compiled model step.

    Attributes:
      mode: "extend" (prefill chunks, `tokens` >= 1 new tokens per row) or "decode" (tokens == 1).
      batch: B, rows of all DP ranks together (a multiple of dp).
      tokens: T, new-token columns per row.
      pages: P, page-table columns per row.
    """

    mode: Mode
    batch: int
    tokens: int
    pages: int


@dataclass(frozen=True)
class BucketSet:
    """The enumerated buckets of one server configuration.

    Attributes:
      dp: data-parallel attention ranks; `batch_sizes` are rows per rank, a bucket's batch is b * dp.
      batch_sizes: ascending rows per rank (decode and sampling use all of them).
      token_sizes: ascending extend tokens per row.
      extend_budget: max b * t of an extend bucket (tokens per rank per step, padding included).
      pages: the page-table width of every bucket.
    """

    dp: int
    batch_sizes: tuple[int, ...]
    token_sizes: tuple[int, ...]
    extend_budget: int
    pages: int

    @classmethod
    def build(
        cls, *, max_running_requests: int, chunked_prefill_size: int, context_length: int, kv_tokens: int,
        page_size: int, dp: int = 1, bs_paddings: list[int] | None = None,
        token_paddings: list[int] | None = None,
    ) -> BucketSet:
        """Enumerate from the server flags (see the module docstring).

        Args:
          max_running_requests: over all ranks; chunked_prefill_size: prefill tokens per rank per step;
          context_length: max prompt + output tokens; kv_tokens: KV tokens one rank holds (a request never
          has more); page_size: tokens per page; dp: --dp-size.
          bs_paddings / token_paddings: --precompile-bs-paddings / --precompile-token-paddings overrides.
        Raises:
          ValueError: an override has a non-positive entry, or its largest batch size is below the running
            requests of one rank (a decode step of all of them must fit one bucket).
        """
        batch = decode_batch_sizes(max_running_requests, dp, bs_paddings)
        budget = next_pow2(chunked_prefill_size)
        if token_paddings:
            tokens = tuple(sorted(set(token_paddings)))
            if tokens[0] <= 0:
                raise ValueError(f"--precompile-token-paddings must be positive, got {list(token_paddings)}")
            budget = max(budget, tokens[0])
            tokens = tuple(t for t in tokens if t <= budget and t > 1) or (max(2, tokens[-1]),)
        else:
            top = max(MIN_EXTEND_TOKENS, budget)
            tokens = tuple(sorted({top} | {t for t in (MIN_EXTEND_TOKENS << 2 * i for i in range(top.bit_length()))
                                           if t < top}))
            budget = max(budget, MIN_EXTEND_TOKENS)
        pages = -(-min(context_length, kv_tokens) // page_size)
        return cls(dp=dp, batch_sizes=batch, token_sizes=tokens, extend_budget=budget, pages=pages)

    # ---- enumeration ---------------------------------------------------------------------------
    def extend_batches(self, tokens: int) -> tuple[int, ...]:
        """Rows per rank of the extend buckets with `tokens` columns: the smallest batch size (one prompt
        alone) and the largest with b * tokens <= extend_budget (a full prefill step), nothing between.
        A step of a few rows pads to the full one; the intermediate sizes cost a program each (a quarter of
        the startup compile time at the default flags) for steps that are rare under load."""
        fits = [b for b in self.batch_sizes if b * tokens <= self.extend_budget]
        return tuple(sorted({self.batch_sizes[0], fits[-1]})) if fits else self.batch_sizes[:1]

    def step_buckets(self) -> list[StepBucket]:
        """Every forward bucket: decode ones (small to large), then extend ones."""
        out = [StepBucket("decode", b * self.dp, 1, self.pages) for b in self.batch_sizes]
        for t in self.token_sizes:
            out += [StepBucket("extend", b * self.dp, t, self.pages) for b in self.extend_batches(t)]
        return out

    def sample_batches(self) -> list[int]:
        """Global batch sizes B of the sampling programs (one per batch size)."""
        return [b * self.dp for b in self.batch_sizes]

    @property
    def samples_finishing_rows_only(self) -> bool:
        """Whether an extend step samples only the rows that finish their prompt, laid out first, in the
        smallest sampling batch holding them (ScheduleBatch.build). One DP rank only: with several, each
        rank's rows are its own block of the batch, so the finishing rows are not one leading block."""
        return self.dp == 1

    def head_rows_pairs(self) -> list[tuple[int, int]]:
        """(extend batch B, sampling batch b < B) pairs of the programs that take an extend step's first b
        rows for sampling (ModelRunner.sample); none unless `samples_finishing_rows_only`."""
        if not self.samples_finishing_rows_only:
            return []
        extend = sorted({bk.batch for bk in self.step_buckets() if bk.mode == "extend"})
        return [(big, b) for big in extend for b in self.sample_batches() if b < big]

    @property
    def max_decode_rows(self) -> int:
        """Most rows per rank in one decode step."""
        return self.batch_sizes[-1]

    @property
    def max_extend_rows(self) -> int:
        """Most rows per rank in one extend step."""
        return self.extend_batches(self.token_sizes[0])[-1]

    # ---- mapping a step to its bucket ----------------------------------------------------------
    def decode_bucket(self, rows_per_rank: int) -> StepBucket:
        """The smallest decode bucket holding `rows_per_rank` rows on every rank.

        Raises ValueError above max_decode_rows (the scheduler never builds such a step).
        """
        for b in self.batch_sizes:
            if b >= rows_per_rank:
                return StepBucket("decode", b * self.dp, 1, self.pages)
        raise ValueError(f"a decode step of {rows_per_rank} rows per rank exceeds the largest bucket "
                         f"({self.max_decode_rows})")

    def extend_bucket(self, rows_per_rank: int, longest: int) -> tuple[StepBucket, int]:
        """The bucket of an extend step and the token cap it imposes.

        Args:
          rows_per_rank: rows on the fullest rank (<= max_extend_rows).
          longest: the most new tokens any row wants this step.
        Returns:
          (bucket, cap): every row takes at most `cap` <= bucket.tokens tokens; cap < longest means the
          step is split (the rest of those chunks runs next step). The bucket is the smallest with room
          for the rows that holds `longest` tokens, else the widest one for that many rows.
        Raises:
          ValueError: rows_per_rank > max_extend_rows.
        """
        if rows_per_rank > self.max_extend_rows:
            raise ValueError(f"an extend step of {rows_per_rank} rows per rank exceeds the largest bucket "
                             f"({self.max_extend_rows})")
        best: tuple[int, int] | None = None
        for t in self.token_sizes:
            rows = [b for b in self.extend_batches(t) if b >= rows_per_rank]
            if not rows:
                continue
            best = (rows[0], t)
            if t >= longest:
                break
        assert best is not None  # rows_per_rank <= max_extend_rows: the smallest token size has room
        b, t = best
        return StepBucket("extend", b * self.dp, t, self.pages), min(longest, t)


def step_buckets(
    max_running_requests: int, chunked_prefill_size: int, context_length: int, kv_tokens: int, page_size: int,
    dp: int = 1, bs_paddings: list[int] | None = None, token_paddings: list[int] | None = None,
) -> list[StepBucket]:
    """All forward buckets of a configuration (BucketSet.build(...).step_buckets())."""
    return BucketSet.build(
        max_running_requests=max_running_requests, chunked_prefill_size=chunked_prefill_size,
        context_length=context_length, kv_tokens=kv_tokens, page_size=page_size, dp=dp,
        bs_paddings=bs_paddings, token_paddings=token_paddings).step_buckets()


def decode_batch_sizes(max_running_requests: int, dp: int, bs_paddings: list[int] | None = None) -> tuple[int, ...]:
    """Rows per DP rank of the decode buckets (and the sampling programs): 1 and the powers of two from 4 up to
    next_pow2(ceil(max_running_requests / dp)), or --precompile-bs-paddings.

    Raises:
        ValueError: an override has a non-positive entry, or its largest size is below the running requests
            of one rank."""
    per_rank = -(-max_running_requests // dp)
    if bs_paddings:
        batch = tuple(sorted(set(bs_paddings)))
        if batch[0] <= 0:
            raise ValueError(f"--precompile-bs-paddings must be positive, got {list(bs_paddings)}")
        if batch[-1] < per_rank:
            raise ValueError(f"--precompile-bs-paddings: the largest size ({batch[-1]}) must be at least the "
                             f"running requests per DP rank ({per_rank})")
        return batch
    top = next_pow2(per_rank)
    return tuple(sorted({1, top} | {1 << i for i in range(2, top.bit_length())}))
