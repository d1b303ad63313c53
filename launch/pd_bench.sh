#!/usr/bin/env bash
# bench_serving on 8 emulated CPU devices: one colocated server vs prefill/decode disaggregation
# (--disaggregation-mode colocated-split, prefill on devices 0-3, decode on 4-7, behind the smg router),
# same workload (a mix of long and short prompts and generations, Poisson arrivals). Each side first runs a
# short warm-up pass (its XLA compilations), then the measured pass. Results: $OUT/{colocated,pd}.txt|json.
# Needs the test extra in .venv (smg): `.venv/bin/python -m pip install -e '.[test]'`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
export XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_cpu_use_xnnpack=false --xla_cpu_enable_concurrency_optimized_scheduler=false"
SRV=(--max-running-requests 8 --context-length 2048 --chunked-prefill-size 256 --log-level info)
BENCH=(--dataset-name random --random-input-len 768 --random-output-len 192 --random-range-ratio 0.1
       --request-rate 1 --disable-tqdm)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM
wait_ready() { until grep -q "fired up and ready" "$1"; do sleep 1; done; }
bench() {  # name port
  .venv/bin/python -m sglang_tpu_qwen.bench_serving --port "$2" "${BENCH[@]}" --num-prompts 8 --seed 9 >"$OUT/$1_warm.txt"
  .venv/bin/python -m sglang_tpu_qwen.bench_serving --port "$2" "${BENCH[@]}" --num-prompts 24 --seed 3 \
    --output-file "$OUT/$1.json" | tee "$OUT/$1.txt"
}

echo "== colocated: one server (logs and results in $OUT)"
.venv/bin/python -m sglang_tpu_qwen.launch_server --port 32000 "${SRV[@]}" >"$OUT/colocated.log" 2>&1 &
pids=($!)
wait_ready "$OUT/colocated.log"
bench colocated 32000
cleanup

echo "== PD: colocated-split 4/4 behind smg"
.venv/bin/python -m sglang_tpu_qwen.launch_server --port 32100 "${SRV[@]}" --disaggregation-mode colocated-split \
  --disaggregation-prefill-devices 4 --disaggregation-decode-port 32101 --disaggregation-bootstrap-port 32102 \
  >"$OUT/split.log" 2>&1 &
pids=($!)
wait_ready "$OUT/split.log"
.venv/bin/smg launch --pd-disaggregation --prefill http://127.0.0.1:32100 32102 --decode http://127.0.0.1:32101 \
  --host 127.0.0.1 --port 32110 --log-level warn >"$OUT/router.log" 2>&1 &
pids+=($!)
until curl -sf http://127.0.0.1:32110/generate -H 'Content-Type: application/json' \
      -d '{"text": "hi", "sampling_params": {"max_new_tokens": 1}}' >/dev/null; do sleep 1; done
bench pd 32110
