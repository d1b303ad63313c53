"""The expert-by-expert SwiGLU FFN kernel (kernels/grouped_ffn) in Pallas interpret mode against its reference, the
model's form (three ``jax.lax.ragged_dot`` products): float32 within 1e-5 of the
largest output (both at ``HIGHEST``, summation orders differ), bfloat16 within 2^-6 of it (one bf16 rounding of
the products and activation where the orders differ); every row a group covers, the rest undefined. Interpreted
with DMAs run only when waited on, VMEM uninitialised as NaN and the race detector on: a tile read before its
copy was waited on, or a write that lands after a later one, shows as wrong rows or a race."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter  # the race detector's state
from jax.experimental.pallas import tpu as pltpu

from sglang_tpu_qwen.kernels.grouped_ffn.kernel import grouped_ffn
from sglang_tpu_qwen.kernels.grouped_ffn.reference import grouped_ffn_reference

H, I = 256, 128  # noqa: E741 - the FFN's intermediate size, as the model names it

# name -> group sizes: untouched experts between touched ones; an expert whose rows end in the array's clamped
# last tile after another's (its tile starts before its rows); one expert over several tiles; fewer rows than a
# tile; rows past the groups.
CASES = {
    "gaps": ([0, 40, 0, 0, 77, 3, 0, 24], 144),
    "clamped_tail": ([50, 0, 20, 0, 0, 0, 3, 7], 80),
    "one_expert": ([0, 0, 0, 300, 0, 0, 0, 0], 300),
    "short": ([0, 5, 0, 0, 0, 2, 0, 0], 7),
    "padding_rows": ([16, 0, 16, 0, 0, 0, 0, 16], 64),
    "no_rows": ([0] * 8, 40),
}
STRICT = pltpu.InterpretParams(dma_execution_mode="on_wait", detect_races=True, uninitialized_memory="nan")


# bf16 also at a tile of one sublane tile (16 rows, the decode candidate): the rows kept before an expert's first
# then fill the whole tile.
@pytest.mark.parametrize(("case", "dtype", "tm"), [(c, jnp.float32, 32) for c in CASES]
                         + [(c, jnp.bfloat16, tm) for c in ("gaps", "clamped_tail") for tm in (32, 16)])
def test_grouped_ffn_matches_ragged_dot(case: str, dtype, tm: int) -> None:
    sizes, rows = CASES[case]
    rng = np.random.default_rng(len(case))
    e = len(sizes)
    x = jnp.asarray(rng.standard_normal((rows, H)), dtype)
    wg, wu = (jnp.asarray(rng.standard_normal((e, H, I)) / np.sqrt(H), dtype) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((e, I, H)) / np.sqrt(I), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    covered = sum(sizes)
    got = np.asarray(grouped_ffn(x, wg, wu, wd, gs, tm=tm, interpret=STRICT).astype(jnp.float32))[:covered]
    assert interpreter.races is not None and not interpreter.races.races_found
    want = np.asarray(grouped_ffn_reference(x, wg, wu, wd, gs).astype(jnp.float32))[:covered]
    assert got.shape == want.shape
    tol = 1e-5 if dtype == jnp.float32 else 2.0**-6
    if covered:
        assert np.isfinite(got).all() and np.abs(got - want).max() <= tol * np.abs(want).max()


def test_grouped_ffn_rejects_mismatched_stacks() -> None:
    x = jnp.zeros((32, H), jnp.float32)
    w = jnp.zeros((4, H, I), jnp.float32)
    down = jnp.zeros((4, I, H), jnp.float32)
    gs = jnp.zeros((4,), jnp.int32)
    for bad in ((x, w, w, w), (x, w, w.astype(jnp.bfloat16), down), (x[:, :200], w[:, :200], w[:, :200],
                                                                      down[..., :200])):
        with pytest.raises(ValueError, match="grouped_ffn"):
            grouped_ffn(*bad, gs, interpret=True)
