"""kernels/greedy_head in Pallas interpret mode and --sampling-backend: the kernel's ids are jnp.argmax's (ties
to the lowest id, a NaN first, a vocabulary that is no multiple of the block, rows that are no multiple of 8), and
the backend sends bfloat16 operands to it and float32 ones to XLA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_qwen.kernels.dispatch import resolve_backends
from sglang_tpu_qwen.kernels.greedy_head.kernel import block_vocab, greedy_lm_head
from sglang_tpu_qwen.kernels.sampling_backend import SamplingBackend


def _operands(rows: int, vocab: int, hidden: int = 128, seed: int = 1) -> tuple[jax.Array, jax.Array]:
    key = jax.random.key(seed)
    weight = jax.random.normal(key, (vocab, hidden), jnp.float32).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.fold_in(key, 1), (rows, hidden), jnp.float32).astype(jnp.bfloat16)
    return x, weight


def _logits(x: jax.Array, weight: jax.Array) -> np.ndarray:
    return np.asarray(jnp.einsum("nh,vh->nv", x, weight, preferred_element_type=jnp.float32,
                                 precision=jax.lax.Precision.HIGHEST))


def test_ids_are_argmax_with_lowest_id_on_ties() -> None:
    x, weight = _operands(8, 512)
    # Row 0's best vocabulary row copied to ids 300 (block 2) and 7 (block 0): equal logits; the lowest id wins.
    best = int(np.argmax(_logits(x, weight)[0]))
    weight = weight.at[300].set(weight[best]).at[7].set(weight[best])
    ids = np.asarray(greedy_lm_head(x, weight, tv=128, interpret=True))
    np.testing.assert_array_equal(ids, _logits(x, weight).argmax(axis=1))
    assert ids[0] == min(best, 7)


@pytest.mark.parametrize("rows, vocab, tv", [(3, 300, 128), (13, 1000, 256), (1, 200, None)])
def test_ragged_vocabulary_and_rows(rows: int, vocab: int, tv: int | None) -> None:
    """The last block runs past the vocabulary (its stale rows must not win) and the rows are padded to 8."""
    x, weight = _operands(rows, vocab, seed=rows)
    # The largest logits of row 0 in the last block's valid part: the kernel must look there too.
    weight = weight.at[vocab - 1].set(x[0] * 4)
    ids = np.asarray(greedy_lm_head(x, weight, tv=tv, interpret=True))
    assert ids.shape == (rows,) and ids.dtype == np.int32
    np.testing.assert_array_equal(ids, _logits(x, weight).argmax(axis=1))
    assert ids[0] == vocab - 1


def test_nan_row_takes_its_first_nan_like_argmax() -> None:
    x, weight = _operands(8, 384)
    weight = weight.at[200].set(jnp.nan).at[300].set(jnp.nan)
    ids = np.asarray(greedy_lm_head(x, weight, tv=128, interpret=True))
    np.testing.assert_array_equal(ids, np.asarray(jnp.argmax(jnp.asarray(_logits(x, weight)), axis=1)))
    assert (ids == 200).all()


def test_block_vocab_and_bad_blocks() -> None:
    row_35b, row_397b = 2048 * 2, 4096 * 2  # bytes a vocabulary row of the bf16 lm_heads
    assert block_vocab(64, 248320, row_35b) == 1280 and block_vocab(128, 248320, row_35b) == 1280
    assert block_vocab(256, 248320, row_35b) == 2560 and block_vocab(256, 248320, row_397b) == 1280
    assert block_vocab(1024, 248320, row_35b) == 256 and block_vocab(512, 248320, row_35b) == 640
    assert block_vocab(8, 1000, row_35b) == 1000  # a vocabulary under one block is one block of any size
    x, weight = _operands(8, 300)
    with pytest.raises(ValueError, match="multiple of 128"):
        greedy_lm_head(x, weight, tv=100, interpret=True)
    with pytest.raises(ValueError, match="differ"):
        greedy_lm_head(x.astype(jnp.float32), weight, interpret=True)


def test_backend_sends_bfloat16_to_the_kernel_and_float32_to_xla() -> None:
    x, weight = _operands(5, 640)
    kernel = SamplingBackend("pallas", interpret=True)
    assert kernel.uses_kernel(x, weight)
    assert not kernel.uses_kernel(x.astype(jnp.float32), weight.astype(jnp.float32))
    assert not SamplingBackend("reference").uses_kernel(x, weight)
    expected = _logits(x, weight).argmax(axis=1)
    for backend in (kernel, SamplingBackend("reference")):
        np.testing.assert_array_equal(np.asarray(backend.greedy_ids(x, weight)), expected)
        np.testing.assert_array_equal(np.asarray(backend.greedy_ids(x.astype(jnp.float32),
                                                                    weight.astype(jnp.float32))), expected)
    # The bfloat16 program holds the kernel's pallas_call; the reference and a float32 lm_head hold none.
    assert "pallas_call" in str(jax.make_jaxpr(kernel.greedy_ids)(x, weight))
    assert "pallas_call" not in str(jax.make_jaxpr(SamplingBackend("reference").greedy_ids)(x, weight))
    assert "pallas_call" not in str(jax.make_jaxpr(kernel.greedy_ids)(x.astype(jnp.float32),
                                                                     weight.astype(jnp.float32)))


def test_flag_resolves_per_platform() -> None:
    assert resolve_backends(platform="tpu").sampling == SamplingBackend("pallas")
    assert resolve_backends(platform="cpu").sampling == SamplingBackend("reference")
    got = resolve_backends("reference", "reference", platform="cpu", sampling="pallas")
    assert got.sampling == SamplingBackend("pallas", interpret=True) and got.interpret
    assert resolve_backends(platform="tpu", sampling="reference").sampling == SamplingBackend("reference")
    with pytest.raises(ValueError, match="--sampling-backend"):
        resolve_backends(platform="cpu", sampling="flashinfer")
