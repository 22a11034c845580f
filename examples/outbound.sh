#!/usr/bin/env bash
# The outbound example's contract: a provider that takes PROVIDER_RPS=10 requests a second,
# two app replicas sharing one redis-server, 30 calls sent at once to each replica. All 60
# clients get 200, the provider counts 60 requests and refuses none, and it takes 4.5 to 9
# seconds (at 10 a second, at most one burst of 10 at once). Exits 1 when any of it fails.
#
# Run from anywhere: examples/outbound.sh (builds the example with cargo first; honours
# CARGO_TARGET_DIR). Needs redis-server, curl and python3 (to find free ports).
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --quiet --example outbound
bin="${CARGO_TARGET_DIR:-target}/debug/examples/outbound"

work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Waits until something answers HTTP at $1 (any status), for at most 10 s.
wait_http() {
    for _ in $(seq 1 100); do
        if curl -s -o /dev/null "$1"; then return 0; fi
        sleep 0.1
    done
    echo "nothing listens on port $1" >&2
    exit 1
}

redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
    --dir "$work" >"$work/redis.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do
    if redis-cli -p "$redis_port" ping >/dev/null 2>&1; then break; fi
    sleep 0.1
done

export PROVIDER_RPS=10
export REDIS_URL="redis://127.0.0.1:$redis_port"
provider_port=$(free_port)
PROVIDER_PORT=$provider_port "$bin" provider 2>"$work/provider.log" &
pids+=($!)
wait_http "http://127.0.0.1:$provider_port/stats"  # /stats is not counted

export PROVIDER_URL="http://127.0.0.1:$provider_port"
app_ports=("$(free_port)" "$(free_port)")
for port in "${app_ports[@]}"; do
    PORT=$port "$bin" app 2>"$work/app-$port.log" &
    pids+=($!)
done
for port in "${app_ports[@]}"; do wait_http "http://127.0.0.1:$port/"; done

start=$(date +%s.%N)
clients=()
for _ in $(seq 1 30); do
    for port in "${app_ports[@]}"; do
        curl -s -o /dev/null -w '%{http_code}\n' -X POST -H 'content-type: application/json' \
            -d '{"message":"hello"}' "http://127.0.0.1:$port/api/chat" >>"$work/statuses" &
        clients+=($!)
    done
done
wait "${clients[@]}"
end=$(date +%s.%N)

stats=$(curl -s "http://127.0.0.1:$provider_port/stats")
elapsed=$(python3 -c "print(f'{$end - $start:.2f}')")
echo "statuses: $(sort "$work/statuses" | uniq -c | awk '{printf "%s x%s ", $2, $1}')"
echo "provider: $stats"
echo "elapsed:  ${elapsed} s"

ok=1
[ "$(grep -c '^200$' "$work/statuses")" = 60 ] || { echo "FAIL: not every client got 200" >&2; ok=0; }
[ "$stats" = '{"requests":60,"refused":0}' ] || { echo "FAIL: the provider's stats" >&2; ok=0; }
python3 -c "import sys; sys.exit(0 if 4.5 <= $elapsed <= 9 else 1)" \
    || { echo "FAIL: not between 4.5 and 9 seconds" >&2; ok=0; }
# OUTBOUND_LOGS=<dir> keeps every process's log there.
if [ -n "${OUTBOUND_LOGS:-}" ]; then mkdir -p "$OUTBOUND_LOGS" && cp "$work"/*.log "$OUTBOUND_LOGS"/; fi
if [ "$ok" = 1 ]; then echo "contract: OK"; exit 0; fi
for log in "$work"/*.log; do echo "--- $log" >&2; tail -n 20 "$log" >&2; done
exit 1
