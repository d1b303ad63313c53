#!/usr/bin/env bash
# Download the runtime wheels of requirements/tpu-wheels.txt (Python 3.11, x86_64 Linux) into .whl-tpu/, for a
# TPU machine that has JAX and libtpu but no package index. There (appending: the machine's JAX stays first):
#   pip install --no-index --no-deps --target /tmp/site .whl-tpu/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site:.
# .whl-tpu/ is git-excluded (.git/info/exclude); the script adds it there if missing. Extra arguments go to pip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .whl-tpu
exclude=$(git rev-parse --git-path info/exclude 2>/dev/null || true)
if [ -n "$exclude" ] && ! grep -qxF '/.whl-tpu/' "$exclude" 2>/dev/null; then
  mkdir -p "$(dirname "$exclude")" && echo '/.whl-tpu/' >> "$exclude"
fi
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_31_x86_64 any; do
  platforms+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp "${platforms[@]}" \
  -d .whl-tpu -r requirements/tpu-wheels.txt "$@"
du -sh .whl-tpu
