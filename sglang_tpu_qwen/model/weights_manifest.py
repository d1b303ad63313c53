"""Weight integrity: a manifest (file name -> sha256, as a release lists them) checked against a model dir.

The loader (model/weights.py) hashes every safetensors file from the bytes it reads for loading, so a
check costs no second read; :func:`check_file_set` runs first (missing or extra files, before anything
is loaded) and :func:`verify_digests` last. ``python -m sglang_tpu_qwen.tools.weights_manifest DIR``
writes a manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from sglang_tpu_qwen.model.safetensors_file import CheckpointError

_CHUNK = 1 << 22
# Files whose presence must be declared: the weights and the index that names them.
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")


def read_manifest(path: str | os.PathLike[str]) -> dict[str, str]:
    """``{file name: sha256 hex}`` from a JSON object. Raises CheckpointError if it is not one."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"weights manifest {path}: cannot read it as JSON ({e})") from None
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in data.items()
    ):
        raise CheckpointError(f"weights manifest {path}: expected a JSON object of file name -> sha256 hex digest")
    return {k: v.lower() for k, v in data.items()}


def sha256_file(path: Path) -> str:
    """Hex sha256 of a whole file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def weight_files(model_dir: Path) -> list[str]:
    """Names of the safetensors files and index of ``model_dir`` (the files a manifest must cover)."""
    return sorted(p.name for p in model_dir.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))


def check_file_set(model_dir: Path, manifest: Mapping[str, str]) -> None:
    """Every manifest file exists, and every weight file of ``model_dir`` is in the manifest.

    Raises:
        CheckpointError: naming the missing or the extra file.
    """
    for name in sorted(manifest):
        if not (model_dir / name).is_file():
            raise CheckpointError(f"weights manifest: file {name} is missing from {model_dir}")
    for name in weight_files(model_dir):
        if name not in manifest:
            raise CheckpointError(f"weights manifest: file {name} in {model_dir} is not in the manifest (extra file)")


def verify_digests(model_dir: Path, manifest: Mapping[str, str], digests: Mapping[str, str]) -> None:
    """Compare ``digests`` (computed while loading) and, for manifest files the loader did not read
    (config, tokenizer, index), their sha256 now, with the manifest.

    Raises:
        CheckpointError: naming the first file whose sha256 differs.
    """
    for name in sorted(manifest):
        got = digests.get(name) or sha256_file(model_dir / name)
        if got != manifest[name]:
            raise CheckpointError(f"weights manifest: sha256 of {name} is {got}, the manifest says {manifest[name]}")
