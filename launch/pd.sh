#!/usr/bin/env bash
# Prefill/decode disaggregation on loopback: one prefill server, one decode server and the `smg` PD router,
# all serving the embedded tiny Qwen3.5-MoE (installs into ./.venv with the test extra, which pins smg).
#   prefill  http://127.0.0.1:30100  (bootstrap port 8998: the decode server fetches KV + GDN state there)
#   decode   http://127.0.0.1:30200
#   router   http://127.0.0.1:30000  <- send requests here
# Extra flags go to both servers, e.g. `bash launch/pd.sh --model-path /path/to/Qwen3.5`. Ctrl-C stops all.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q -e '.[test]'

HOST=127.0.0.1 PREFILL_PORT=${PREFILL_PORT:-30100} DECODE_PORT=${DECODE_PORT:-30200} ROUTER_PORT=${ROUTER_PORT:-30000}
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998}
LOGS=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

.venv/bin/python -m sglang_tpu_qwen.launch_server --host $HOST --port "$PREFILL_PORT" \
  --disaggregation-mode prefill --disaggregation-bootstrap-port "$BOOTSTRAP_PORT" "$@" >"$LOGS/prefill.log" 2>&1 &
pids+=($!)
.venv/bin/python -m sglang_tpu_qwen.launch_server --host $HOST --port "$DECODE_PORT" \
  --disaggregation-mode decode "$@" >"$LOGS/decode.log" 2>&1 &
pids+=($!)
echo "logs in $LOGS; waiting for both servers..."
for log in "$LOGS/prefill.log" "$LOGS/decode.log"; do
  until grep -q "The server is fired up and ready to roll!" "$log"; do
    kill -0 "${pids[@]}" 2>/dev/null || { echo "a server exited:"; tail -20 "$LOGS"/*.log; exit 1; }
    sleep 1
  done
done
.venv/bin/smg launch --pd-disaggregation --prefill "http://$HOST:$PREFILL_PORT" "$BOOTSTRAP_PORT" \
  --decode "http://$HOST:$DECODE_PORT" --host $HOST --port "$ROUTER_PORT" --log-level warn >"$LOGS/router.log" 2>&1 &
pids+=($!)
until curl -sf "http://$HOST:$ROUTER_PORT/generate" -H 'Content-Type: application/json' \
      -d '{"text": "hi", "sampling_params": {"max_new_tokens": 1}}' >/dev/null; do
  kill -0 "${pids[@]}" 2>/dev/null || { echo "a process exited:"; tail -20 "$LOGS"/*.log; exit 1; }
  sleep 1
done
MODEL=$(curl -s "http://$HOST:$DECODE_PORT/v1/models" | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
cat <<EOF
PD deployment ready: router http://$HOST:$ROUTER_PORT (prefill :$PREFILL_PORT, decode :$DECODE_PORT). Try:

curl -s http://$HOST:$ROUTER_PORT/generate -H 'Content-Type: application/json' \\
  -d '{"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 16}}'

curl -s http://$HOST:$ROUTER_PORT/v1/chat/completions -H 'Content-Type: application/json' \\
  -d '{"model": "$MODEL", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}'

Ctrl-C stops the router and both servers.
EOF
wait
