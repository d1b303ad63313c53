"""Write a weights manifest: ``python -m sglang_tpu_qwen.tools.weights_manifest DIR > manifest.json``.

The manifest is a JSON object, file name -> sha256 hex digest, of every regular file directly in DIR
(hidden files excluded), the form a release publishes. ``launch_server --weights-manifest manifest.json``
checks the weights against it while loading (model/weights_manifest.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sglang_tpu_qwen.model.weights_manifest import sha256_file


def build_manifest(model_dir: Path) -> dict[str, str]:
    """``{name: sha256}`` of the regular, non-hidden files of ``model_dir``, sorted by name."""
    return {p.name: sha256_file(p) for p in sorted(model_dir.iterdir()) if p.is_file() and not p.name.startswith(".")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    a = ap.parse_args(argv)
    if not a.model_dir.is_dir():
        ap.error(f"{a.model_dir} is not a directory")
    json.dump(build_manifest(a.model_dir), sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
