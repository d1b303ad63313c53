#!/usr/bin/env bash
# Prometheus + Grafana with the sglang-tpu-qwen dashboard, against servers started with --enable-metrics.
#   bash launch/monitoring.sh                                  # scrape 127.0.0.1:30000
#   bash launch/monitoring.sh 127.0.0.1:30001 127.0.0.1:30002  # several servers (e.g. launch/replicas.sh)
# Prometheus: http://127.0.0.1:${PROM_PORT:-9090}   Grafana: http://127.0.0.1:${GRAFANA_PORT:-3000}
# (dashboard "sglang-tpu-qwen", anonymous viewer access; admin/admin to edit). Ctrl-C stops both.
# Uses `prometheus` and `grafana` (or `grafana-server`) from PATH when installed (Debian: apt-get install
# prometheus; Grafana: its own packages), otherwise Docker with the prom/prometheus and grafana/grafana images
# (RUNTIME=docker forces that). Data lives in a temp dir (WORK=... to keep it).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PROM_PORT=${PROM_PORT:-9090}
GRAFANA_PORT=${GRAFANA_PORT:-3000}
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(127.0.0.1:30000)
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK/provisioning/datasources" "$WORK/provisioning/dashboards" "$WORK/prometheus-data" "$WORK/grafana-data"

# The scrape config: launch/monitoring/prometheus.yml with these targets.
quoted=$(printf '"%s", ' "${TARGETS[@]}")
sed "s|targets: \[.*\]|targets: [${quoted%, }]|" launch/monitoring/prometheus.yml >"$WORK/prometheus.yml"
cp launch/monitoring/grafana/provisioning/datasource.yml "$WORK/provisioning/datasources/"
cp launch/monitoring/grafana/provisioning/dashboards.yml "$WORK/provisioning/dashboards/"
export PROMETHEUS_URL="http://127.0.0.1:$PROM_PORT"  # read by the provisioning files (Grafana expands ${VAR})
export GF_SERVER_HTTP_PORT=$GRAFANA_PORT GF_AUTH_ANONYMOUS_ENABLED=true GF_AUTH_ANONYMOUS_ORG_ROLE=Viewer
export GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH=/dashboards/sglang-tpu-qwen.json

pids=()
cleanup() {
  [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true
  if [ "${RUNTIME:-}" = docker ]; then docker rm -f sglang-tpu-qwen-prometheus sglang-tpu-qwen-grafana >/dev/null 2>&1 || true; fi
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

grafana_bin() { command -v grafana || command -v grafana-server || true; }
if [ -z "${RUNTIME:-}" ]; then
  if command -v prometheus >/dev/null && [ -n "$(grafana_bin)" ]; then RUNTIME=binaries
  elif command -v docker >/dev/null; then RUNTIME=docker
  else echo "need prometheus and grafana on PATH, or docker" >&2; exit 1; fi
fi

if [ "$RUNTIME" = binaries ]; then
  export DASHBOARDS_DIR=$ROOT/launch/monitoring/grafana GF_PATHS_PROVISIONING=$WORK/provisioning GF_PATHS_DATA=$WORK/grafana-data
  export GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH=$DASHBOARDS_DIR/sglang-tpu-qwen.json
  ! command -v promtool >/dev/null || promtool check config "$WORK/prometheus.yml" >/dev/null
  prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/prometheus-data" \
    --web.listen-address="127.0.0.1:$PROM_PORT" >"$WORK/prometheus.log" 2>&1 &
  pids+=($!)
  gbin=$(grafana_bin)
  # The home path holds Grafana's conf/ and public/: /usr/share/grafana for the distro packages, else the
  # directory above bin/ of an unpacked release.
  home=${GRAFANA_HOME:-$([ -d /usr/share/grafana ] && echo /usr/share/grafana || dirname "$(dirname "$(readlink -f "$gbin")")")}
  if [ "$(basename "$gbin")" = grafana ]; then
    grafana server --homepath "$home" >"$WORK/grafana.log" 2>&1 &
  else
    grafana-server --homepath "$home" >"$WORK/grafana.log" 2>&1 &
  fi
  pids+=($!)
else
  export DASHBOARDS_DIR=/dashboards
  docker run --rm --name sglang-tpu-qwen-prometheus --network host -v "$WORK/prometheus.yml:/etc/prometheus/prometheus.yml:ro" \
    prom/prometheus --config.file=/etc/prometheus/prometheus.yml --web.listen-address="127.0.0.1:$PROM_PORT" \
    >"$WORK/prometheus.log" 2>&1 &
  pids+=($!)
  docker run --rm --name sglang-tpu-qwen-grafana --network host -e PROMETHEUS_URL -e DASHBOARDS_DIR -e GF_SERVER_HTTP_PORT \
    -e GF_AUTH_ANONYMOUS_ENABLED -e GF_AUTH_ANONYMOUS_ORG_ROLE -e GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH \
    -v "$WORK/provisioning:/etc/grafana/provisioning:ro" -v "$ROOT/launch/monitoring/grafana:/dashboards:ro" \
    grafana/grafana >"$WORK/grafana.log" 2>&1 &
  pids+=($!)
fi

echo "logs and data in $WORK ($RUNTIME); waiting for Prometheus and Grafana..."
for url in "http://127.0.0.1:$PROM_PORT/-/ready" "http://127.0.0.1:$GRAFANA_PORT/api/health"; do
  until curl -sf "$url" >/dev/null; do
    kill -0 "${pids[@]}" 2>/dev/null || { echo "a process exited:"; tail -20 "$WORK"/*.log; exit 1; }
    sleep 1
  done
done
cat <<EOF
Scraping ${TARGETS[*]} every 5 s.
  Grafana dashboard: http://127.0.0.1:$GRAFANA_PORT/d/sglang-tpu-qwen
  Prometheus:        http://127.0.0.1:$PROM_PORT/targets
Servers need --enable-metrics (e.g. bash launch/serve.sh --enable-metrics). Ctrl-C stops both.
EOF
wait
