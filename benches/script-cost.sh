#!/usr/bin/env bash
# Instructions Redis spends per request in tollgate's check script, counted by valgrind's
# callgrind on redis-server: merged calls of a fixed size (`script-cost`, default 100 calls of
# 16 requests), so that a change to the script or to what the client sends it compares on the
# same work.
#
#   benches/script-cost.sh [MODE...]    # default: one distinct three (see script-cost.rs)
#
# Each mode runs once to load the script and warm Redis, then once counted. Redis' own start
# and the counting client's connections are outside the count. Only 127.0.0.1 is contacted.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
CALLS=${CALLS:-100}
PER_CALL=${PER_CALL:-16}
MODES=("$@")
((${#MODES[@]})) || MODES=(one distinct three)

for tool in valgrind:valgrind redis-server:redis-server; do
    command -v "${tool%%:*}" >/dev/null || apt-get install -y -qq "${tool#*:}" >/dev/null
done
(cd "$ROOT" && cargo build --release -q -p tollgate-bench --example script-cost)

# shellcheck source=common.sh
source "$ROOT/benches/common.sh"

OUT=$(mktemp -d /tmp/tollgate-script-cost.XXXXXX)
pid=
trap '[[ -n $pid ]] && kill "$pid" 2>/dev/null; rm -rf "$OUT"' EXIT
printf '%-10s %10s %8s %16s\n' mode requests calls instr/request
for mode in "${MODES[@]}"; do
    port=$(free_port)
    valgrind --tool=callgrind --callgrind-out-file="$OUT/redis.%p.out" redis-server \
        --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$OUT" \
        --logfile "$OUT/redis.log" 2>"$OUT/valgrind.log" &
    pid=$!
    for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.2; done
    url="redis://127.0.0.1:$port/"
    "$TARGET/release/examples/script-cost" --redis "$url" --mode "$mode" --calls 10 --per-call "$PER_CALL" >/dev/null
    callgrind_control --zero "$pid" >/dev/null 2>&1
    read -r _ requests _ calls < <("$TARGET/release/examples/script-cost" --redis "$url" --mode "$mode" \
        --calls "$CALLS" --per-call "$PER_CALL")
    callgrind_control --dump "$pid" >/dev/null 2>&1
    kill "$pid"; wait "$pid" 2>/dev/null || true
    instr=$(callgrind_annotate --auto=no "$OUT/redis.$pid.out.1" 2>/dev/null |
        awk '/PROGRAM TOTALS/{gsub(",", "", $1); print $1; exit}')
    printf '%-10s %10d %8d %16d\n' "$mode" "$requests" "$calls" $((instr / requests))
    rm -f "$OUT"/redis.*.out*
    pid=
done
