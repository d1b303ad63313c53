"""bench/spec_decode.py's corpus and training: a seeded, structured language, and a few training steps that
lower both losses and write a checkpoint our loader reads with its MTP layer (the benchmark itself is not run:
it trains for minutes and starts four or more engines)."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from sglang_tpu_qwen.bench.spec_decode import VOCAB, PhraseCorpus, _parse_batch, train_checkpoint  # noqa: E402
from sglang_tpu_qwen.model.config import load_config  # noqa: E402
from sglang_tpu_qwen.model.weights import load_params  # noqa: E402


def test_corpus_is_seeded_and_follows_its_chain() -> None:
    a, b = PhraseCorpus(3, noise=0.0), PhraseCorpus(3, noise=0.0)
    assert all(np.array_equal(x, y) for x, y in zip(a.phrases, b.phrases, strict=True))
    x = a.sample(16, 80, np.random.default_rng(1))
    np.testing.assert_array_equal(x, b.sample(16, 80, np.random.default_rng(1)))
    assert x.shape == (16, 80) and x.min() >= 1 and x.max() < VOCAB
    # Without noise every bigram is inside a phrase or joins a phrase's end to a successor's start.
    allowed = {(int(p[i]), int(p[i + 1])) for p in a.phrases for i in range(len(p) - 1)}
    allowed |= {(int(a.phrases[i][-1]), int(a.phrases[j][0])) for i in range(len(a.phrases))
                for j in a.successors[i]}
    assert all((int(s[i]), int(s[i + 1])) in allowed for s in x for i in range(len(s) - 1))
    noisy = PhraseCorpus(3, noise=0.5).sample(16, 80, np.random.default_rng(1))
    assert (noisy != x).mean() > 0.3


def test_batch_flag() -> None:
    assert _parse_batch("32") == (32, None) and _parse_batch("1@4") == (1, 4)
    with pytest.raises(ValueError):
        _parse_batch("8@4")


def test_training_lowers_losses_and_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    trained = train_checkpoint(tmp_path / "ckpt", PhraseCorpus(0), train_steps=40, mtp_steps=40, batch=8,
                               seq_len=32, hidden=64, seed=0, threads=1)
    s = trained.stats
    assert s["main_final_loss"] < s["main_first_loss"] - 1.0
    assert s["mtp_final_loss"] < s["mtp_first_loss"] - 1.0
    config = load_config(trained.path)
    assert config.mtp_num_hidden_layers == 1 and config.vocab_size == VOCAB
    params = load_params(trained.path, config, jnp.float32, mtp=True)
    assert "mtp" in params
