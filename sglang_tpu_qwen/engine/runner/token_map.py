"""The draft vocabulary of ``--speculative-token-map`` (SGLang's flag; FR-Spec, Zhao et al., "FR-Spec:
Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling", 2025).

The MTP drafts choose among these "hot" token ids only: each draft pass reads their rows of the lm_head instead
of the whole vocabulary (the three draft passes of a verify cycle read the lm_head three times, ~1 GB each at
Qwen3.5's 248k vocabulary). The verify step still scores the whole vocabulary, so outputs do not change; a
token outside the map is never drafted, which only lowers the accept length where it would have been.

SGLang loads the file with ``torch.load`` (a 1-D tensor or list of ids); this reads that format when torch is
installed, and a JSON list of ids or a ``.npy`` array without it.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np


def load_token_map(path: str, vocab_size: int) -> np.ndarray:
    """The hot token ids in ``path`` as a sorted, duplicate-free ``[N]`` int32 array.

    Args:
        path: a ``.pt`` / ``.pth`` file (``torch.load``: a 1-D tensor or list of ints, SGLang's format), a
            ``.json`` list of ints, or a ``.npy`` array.
        vocab_size: the model's vocabulary; every id must be in ``[0, vocab_size)``.

    Raises:
        ValueError: the file is missing or unreadable, of another suffix, not a flat list of integer ids, empty,
            or holds an id outside the vocabulary (the message names the flag and the file).
    """
    p = Path(path)
    where = f"--speculative-token-map {path}"
    if not p.is_file():
        raise ValueError(f"{where}: no such file")
    suffix = p.suffix.lower()
    if suffix not in (".pt", ".pth", ".json", ".npy"):
        raise ValueError(f"{where}: expected a .pt, .json or .npy file")
    if suffix in (".pt", ".pth"):
        try:
            import torch
        except ImportError as e:
            raise ValueError(f"{where}: reading a .pt map needs torch; give a .json list or a .npy array") from e
    try:
        if suffix == ".json":
            ids = np.asarray(json.loads(p.read_text()))
        elif suffix == ".npy":
            ids = np.load(p, allow_pickle=False)
        else:
            raw = torch.load(p, weights_only=True)
            ids = np.asarray(raw.tolist() if hasattr(raw, "tolist") else raw)
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{where}: unreadable ({type(e).__name__}: {e})") from e
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{where}: expected a non-empty flat list of integer token ids, got shape {ids.shape} "
                         f"of {ids.dtype}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"{where}: token ids must lie in [0, {vocab_size}), got [{ids.min()}, {ids.max()}]")
    return np.unique(ids).astype(np.int32)

