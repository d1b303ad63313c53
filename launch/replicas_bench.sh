#!/usr/bin/env bash
# bench_serving multi-turn against 2 replicas behind smg: round_robin vs cache_aware with
# launch/smg_cache_aware.args (what launch/replicas.sh uses; CA_EXTRA adds router flags, e.g.
# "--balance-abs-threshold 4"), same workload, each from empty prefix caches. Each policy first runs a short
# warm-up pass, then the measured pass. Reports prefill tokens computed and TTFT; results in
# $OUT/{cache_aware,round_robin}.txt|json.
# Needs the test extra in .venv (smg): `.venv/bin/python -m pip install -e '.[test]'`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
# Default server flags; SRV_EXTRA adds more, e.g. "--max-gdn-snapshots 64". BENCH_EXTRA overrides the workload,
# e.g. "--mt-num-sessions 32 --max-concurrency 16".
SRV=(--log-level info ${SRV_EXTRA:-})
mapfile -t CA_ARGS < <(sed 's/#.*//' launch/smg_cache_aware.args | xargs -n1)
WORKLOAD=(--dataset-name multi-turn --mt-num-sessions 8 --mt-num-turns 6 --mt-system-prompt-len 256
          --mt-turn-input-len 64 --mt-turn-output-len 32 --max-concurrency 4 --disable-tqdm ${BENCH_EXTRA:-})
pids=()
cleanup() { [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM
for i in 1 2; do
  .venv/bin/python -m sglang_tpu_qwen.launch_server --port $((32200 + i)) "${SRV[@]}" >"$OUT/replica$i.log" 2>&1 &
  pids+=($!)
done
for i in 1 2; do until grep -q "fired up and ready" "$OUT/replica$i.log"; do sleep 1; done; done
flush() { for i in 1 2; do curl -sf -X POST "http://127.0.0.1:$((32200 + i))/flush_cache" >/dev/null; done; }
for run in round_robin cache_aware; do
  policy=$run extra=()
  # shellcheck disable=SC2206  # CA_EXTRA: whitespace-separated flags
  [ "$run" != cache_aware ] || extra=("${CA_ARGS[@]}" ${CA_EXTRA:-})
  echo "== $run (logs and results in $OUT)"
  .venv/bin/smg launch --worker-urls http://127.0.0.1:32201 http://127.0.0.1:32202 --policy $policy "${extra[@]}" \
    --host 127.0.0.1 --port 32210 --prometheus-host 127.0.0.1 --prometheus-port 32211 --log-level warn \
    >"$OUT/router_$run.log" 2>&1 &
  router=$!
  until curl -sf http://127.0.0.1:32210/generate -H 'Content-Type: application/json' \
        -d '{"text": "hi", "sampling_params": {"max_new_tokens": 1}}' >/dev/null; do sleep 1; done
  flush
  .venv/bin/python -m sglang_tpu_qwen.bench_serving --port 32210 "${WORKLOAD[@]}" --mt-num-sessions 2 --seed 9 \
    >"$OUT/${run}_warm.txt"
  flush
  .venv/bin/python -m sglang_tpu_qwen.bench_serving --port 32210 "${WORKLOAD[@]}" --seed 1 \
    --output-file "$OUT/$run.json" | tee "$OUT/$run.txt"
  kill $router; wait $router 2>/dev/null || true
done
