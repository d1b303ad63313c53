#!/usr/bin/env bash
# The TPU benchmarks of docs/performance.md in one command, for a TPU machine with JAX and libtpu but no package
# index (the wheels of launch/tpu_wheels.sh in .whl-tpu/, installed into /tmp/site and appended to PYTHONPATH so
# the machine's JAX stays first). Usage:
#   bash launch/tpu_bench.sh STEP[:SECONDS] ...      e.g.  bash launch/tpu_bench.sh suite:500 decode:250 mtp:300
# Each step writes $OUT/STEP.txt (its stdout and stderr) under a time limit (default 600 s); $OUT/times.txt lists
# each step's exit status and wall time. Steps run one after another in fresh processes: one holds the chip at a
# time. JAX's persistent compilation cache (/tmp/jaxcache) is shared between them. The engine benchmarks run with
# --disable-precompile: they compile the programs they replay before timing them (0 compilations in the timed
# windows, printed), where precompiling every bucket took a cold MTP engine past 5 minutes.
#   suite        the TPU suite (tests/tpu)            kernels      bench.kernels: attention and GDN per batch mix
#                                                     kernelsgdn   bench.kernels: GDN decode, verify, prefill steps
#   suitekernels the suite's kernel tests              suitemodel   its engine and speculative tests (the suite
#                                                                   in two calls of under 10 minutes each)
#   decode       decode step at 8 and 256 rows         decode64     decode step at 64 rows
#   decodeprof   256-row decode step with a profile    mtp          MTP cycle at 1, 8, 64 rows (the issue's flags)
#   mtpmap       the MTP cycle with a 31,040-id draft vocabulary (every 8th id: the cycle's cost depends on the
#                map's size, not its ids; the accept length is the random MTP layer's 1.0 either way)
#   mtpprof      64-row MTP cycle with a profile       prefill      prefill 64 x 512 and 8 x 4,096
#   prefillprof  64 x 512 prefill with a profile       spec         bench.spec_decode (trained tiny model)
#   moeprefill   bench.grouped_matmul at a 2,048-token prefill step: ragged_dot (packed) against megablox and
#                the project's expert-by-expert kernel (kernels/grouped_ffn)
#   prefill8k    prefill 64 x 512 and 8 x 4,096 with --chunked-prefill-size 8192
#   moe35b       bench.grouped_matmul at every 35B-A3B case (decode 8 / 64 / 256 rows, prefill 2,048 to 32,768)
#   mxuchain     bench.mxu_chain: a dependent product's time by size and independent chains (the GDN chunk form)
#   lmhead       bench.lm_head: the greedy lm_head by weight layout ([V, H] served, [H, V]) and a Pallas kernel
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
if [ -d .whl-tpu ]; then
  python -m pip install -q --no-index --no-deps --target /tmp/site .whl-tpu/*.whl >"$OUT/setup.txt" 2>&1
fi
export PYTHONPATH=${PYTHONPATH:-}:/tmp/site:$PWD
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxcache}
REPLAY=(--no-plan --disable-precompile)  # the engine benchmarks' flags: the chip runs no planner
SPEC=(--speculative-algorithm NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1
      --speculative-num-draft-tokens 4)
step_cmd() {
  case $1 in
    suite) echo python -m pytest -q -p no:cacheprovider tests/tpu ;;
    suitekernels) echo python -m pytest -q -p no:cacheprovider tests/tpu/test_kernels_on_chip.py ;;
    suitemodel) echo python -m pytest -q -p no:cacheprovider tests/tpu/test_engine_on_chip.py \
                  tests/tpu/test_speculative_on_chip.py ;;
    kernels) echo python -m sglang_tpu_qwen.bench.kernels --sections mixes ;;
    kernelsgdn) echo python -m sglang_tpu_qwen.bench.kernels --sections gdn-decode,gdn-verify,gdn-prefill ;;
    decode) echo python -m sglang_tpu_qwen.bench.decode_step --rows 8,256 "${REPLAY[@]}" ;;
    decode64) echo python -m sglang_tpu_qwen.bench.decode_step --rows 64 "${REPLAY[@]}" ;;
    decodeprof) echo python -m sglang_tpu_qwen.bench.decode_step --rows 256 "${REPLAY[@]}" --profile /tmp/prof_decode \
                  --profile-rows 256 ;;
    mtp) echo python -m sglang_tpu_qwen.bench.decode_step --rows 1,8,64 "${REPLAY[@]}" "${SPEC[@]}" ;;
    mtpmap) python -c "import json; print(json.dumps(list(range(0, 248320, 8))))" >/tmp/token_map.json
            echo python -m sglang_tpu_qwen.bench.decode_step --rows 1,8,64 "${REPLAY[@]}" "${SPEC[@]}" \
              --speculative-token-map /tmp/token_map.json ;;
    mtpprof) echo python -m sglang_tpu_qwen.bench.decode_step --rows 64 "${REPLAY[@]}" "${SPEC[@]}" \
               --profile /tmp/prof_mtp --profile-rows 64 ;;
    prefill) echo python -m sglang_tpu_qwen.bench.prefill_step "${REPLAY[@]}" ;;
    prefillprof) echo python -m sglang_tpu_qwen.bench.prefill_step "${REPLAY[@]}" --shapes 64x512 \
                   --profile /tmp/prof_prefill ;;
    moeprefill) echo python -m sglang_tpu_qwen.bench.grouped_matmul --only 2048 ;;
    moe35b) echo python -m sglang_tpu_qwen.bench.grouped_matmul --only 35B-A3B ;;
    prefill8k) echo python -m sglang_tpu_qwen.bench.prefill_step "${REPLAY[@]}" --chunked-prefill-size 8192 ;;
    mxuchain) echo python -m sglang_tpu_qwen.bench.mxu_chain ;;
    lmhead) echo python -m sglang_tpu_qwen.bench.lm_head ;;
    spec) echo python -m sglang_tpu_qwen.bench.spec_decode --output-json "$OUT/spec.json" ;;
    *) return 1 ;;
  esac
}
for arg in "$@"; do
  name=${arg%%:*}
  limit=600
  [ "$arg" != "$name" ] && limit=${arg#*:}
  if ! cmd=$(step_cmd "$name"); then
    echo "unknown step: $name" | tee -a "$OUT/times.txt"
    continue
  fi
  start=$(date +%s)
  # shellcheck disable=SC2086  # the command is a word list built above
  timeout "$limit" $cmd >"$OUT/$name.txt" 2>&1
  echo "$name rc=$? $(($(date +%s) - start)) s" | tee -a "$OUT/times.txt"
  grep -E '^\|' "$OUT/$name.txt" | head -n 12
done
