#!/usr/bin/env bash
# N data-parallel replicas of the server on this machine behind the `smg` router (cache-aware routing:
# a request goes to the replica whose prefix cache holds the longest part of it, so a conversation stays
# on its replica and its earlier turns are not prefilled again).
#   bash launch/replicas.sh 2                          # 2 replicas of the embedded tiny model
#   bash launch/replicas.sh 4 --model-path /path/to/Qwen3.5 --tp-size 1 ...   # extra flags go to every replica
# Replicas listen on $BASE_PORT+1 .. $BASE_PORT+N (default 30001..), the router on $ROUTER_PORT (30000);
# POLICY=round_robin (or any smg policy) to compare. Ctrl-C stops all. cache_aware runs with the settings of
# launch/smg_cache_aware.args (why there, and in docs/performance.md "Replicas behind smg"); the tests use the
# same file.
# Devices: with accelerators each replica gets its own share (DEVICES_PER_REPLICA, default all / N):
#   NVIDIA GPUs: CUDA_VISIBLE_DEVICES; TPU chips (/dev/accel*, /dev/vfio): TPU_VISIBLE_CHIPS with one process
#   per chip group (TPU_PROCESS_BOUNDS=1,1,1, own TPU_PROCESS_PORT; TPU_CHIPS_PER_PROCESS_BOUNDS defaults to
#   1,1,1 for one chip, otherwise set it for your topology, e.g. 1,2,1 or 2,2,1).
# Without accelerators each replica is its own process on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:?usage: launch/replicas.sh N [server flags...]}
shift
[ "$N" -ge 1 ] || { echo "N must be >= 1" >&2; exit 2; }
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q -e '.[test]'  # the test extra pins smg

HOST=127.0.0.1 BASE_PORT=${BASE_PORT:-30000} ROUTER_PORT=${ROUTER_PORT:-30000} POLICY=${POLICY:-cache_aware}
LOGS=$(mktemp -d)
pids=()
cleanup() { [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

# Which accelerator, and how many devices.
KIND=cpu TOTAL=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  KIND=gpu TOTAL=$(nvidia-smi -L | wc -l)
elif compgen -G "/dev/accel*" >/dev/null; then
  KIND=tpu TOTAL=$(compgen -G "/dev/accel*" | wc -l)
elif [ -d /dev/vfio ] && compgen -G "/dev/vfio/[0-9]*" >/dev/null; then
  KIND=tpu TOTAL=$(compgen -G "/dev/vfio/[0-9]*" | wc -l)
fi
PER=${DEVICES_PER_REPLICA:-$(( TOTAL > 0 ? TOTAL / N : 0 ))}
if [ "$KIND" != cpu ] && [ "$PER" -lt 1 ]; then
  echo "$TOTAL $KIND devices cannot give $N replicas one each" >&2; exit 2
fi

urls=()
for i in $(seq 1 "$N"); do
  port=$((BASE_PORT + i))
  [ "$port" -ne "$ROUTER_PORT" ] || { echo "replica port $port collides with ROUTER_PORT" >&2; exit 2; }
  first=$(( (i - 1) * PER ))
  devs=$(seq -s, "$first" $(( first + PER - 1 )) 2>/dev/null || true)
  env=()
  case $KIND in
    gpu) env=(CUDA_VISIBLE_DEVICES="$devs") ;;
    tpu) env=(TPU_VISIBLE_CHIPS="$devs" TPU_PROCESS_BOUNDS=1,1,1 TPU_PROCESS_PORT=$((8476 + i))
              TPU_CHIPS_PER_PROCESS_BOUNDS="${TPU_CHIPS_PER_PROCESS_BOUNDS:-1,1,1}") ;;
  esac
  echo "replica $i: port $port, ${KIND}${devs:+ devices $devs}"
  env "${env[@]}" .venv/bin/python -m sglang_tpu_qwen.launch_server --host $HOST --port "$port" --enable-metrics \
    "$@" >"$LOGS/replica$i.log" 2>&1 &
  pids+=($!)
  urls+=("http://$HOST:$port")
done
echo "logs in $LOGS; waiting for $N replicas..."
for i in $(seq 1 "$N"); do
  until grep -q "The server is fired up and ready to roll!" "$LOGS/replica$i.log"; do
    kill -0 "${pids[@]}" 2>/dev/null || { echo "a replica exited:"; tail -20 "$LOGS"/*.log; exit 1; }
    sleep 1
  done
done
policy_args=()
[ "$POLICY" != cache_aware ] || mapfile -t policy_args < <(sed 's/#.*//' launch/smg_cache_aware.args | xargs -n1)
.venv/bin/smg launch --worker-urls "${urls[@]}" --policy "$POLICY" "${policy_args[@]}" --host $HOST --port "$ROUTER_PORT" \
  --prometheus-host $HOST --prometheus-port "${ROUTER_METRICS_PORT:-29000}" --log-level warn >"$LOGS/router.log" 2>&1 &
pids+=($!)
until curl -sf "http://$HOST:$ROUTER_PORT/generate" -H 'Content-Type: application/json' \
      -d '{"text": "hi", "sampling_params": {"max_new_tokens": 1}}' >/dev/null; do
  kill -0 "${pids[@]}" 2>/dev/null || { echo "a process exited:"; tail -20 "$LOGS"/*.log; exit 1; }
  sleep 1
done
MODEL=$(curl -s "${urls[0]}/v1/models" | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
targets=$(printf '%s ' "${urls[@]#http://}")
cat <<EOF
$N replicas behind smg ($POLICY): router http://$HOST:$ROUTER_PORT, replicas ${urls[*]}. Try:

curl -s http://$HOST:$ROUTER_PORT/generate -H 'Content-Type: application/json' \\
  -d '{"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 16}}'

curl -s http://$HOST:$ROUTER_PORT/v1/chat/completions -H 'Content-Type: application/json' \\
  -d '{"model": "$MODEL", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}'

.venv/bin/python -m sglang_tpu_qwen.bench_serving --port $ROUTER_PORT --dataset-name multi-turn --max-concurrency 4

Dashboard over all replicas: bash launch/monitoring.sh ${targets% }
Ctrl-C stops the router and the replicas.
EOF
wait
