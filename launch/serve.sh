#!/usr/bin/env bash
# Install into ./.venv (when it is new or pyproject.toml changed) and serve the embedded tiny Qwen3.5-MoE on
# http://127.0.0.1:30000. Extra flags go to the server, e.g. `bash launch/serve.sh --port 8000 --model-path
# /path/to/Qwen3.5`.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
# pip checks every dependency on each run (~6 s here): only when the project's requirements may have changed.
if [ ! -f .venv/.serve-installed ] || [ pyproject.toml -nt .venv/.serve-installed ]; then
  .venv/bin/python -m pip install -q -e .
  touch .venv/.serve-installed
fi
exec .venv/bin/python -m sglang_tpu_qwen.launch_server "$@"
