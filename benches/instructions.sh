#!/usr/bin/env bash
# Instructions per request of the bench server, counted by valgrind's callgrind: a figure that
# other work on the machine cannot skew, to explain (not replace) the timings of run.sh.
#
#   benches/instructions.sh [MODE...]    # default: the in-memory modes and bare
#   DURATION=5 benches/instructions.sh bare tollgate-mem-allow tollgate-redis-lease-hot
#
# Counts user-space instructions only (the kernel's TCP work is not in them) between a warm-up
# and the end of a DURATION-second wrk run at CONNS connections (8 unless set), divided by the
# requests. With KEEP=1 the callgrind files stay in OUT for callgrind_annotate. Builds the
# server with line tables (in CARGO_TARGET_DIR, default target/) so that the profile names
# functions. With SERVER=PATH it measures that bench-server binary instead, unbuilt (a copy kept
# while the tree changes).
# Only 127.0.0.1 is ever contacted.
set -euo pipefail

DURATION=${DURATION:-10}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
OUT=${OUT:-$(mktemp -d /tmp/tollgate-instr.XXXXXX)}
mkdir -p "$OUT"
MODES=("$@")
((${#MODES[@]})) || MODES=(bare tollgate-mem-allow tollgate-mem-allow-lean tollgate-mem-deny governor-allow governor-deny)

for tool in valgrind:valgrind wrk:wrk curl:curl; do
    command -v "${tool%%:*}" >/dev/null || apt-get install -y -qq "${tool#*:}" >/dev/null
done
if [[ -z ${SERVER:-} ]]; then
    (cd "$ROOT" && CARGO_PROFILE_RELEASE_DEBUG=line-tables-only cargo build --release -q -p tollgate-bench --bin bench-server)
    SERVER=$TARGET/release/bench-server
fi

# shellcheck source=common.sh
source "$ROOT/benches/common.sh"

if [[ " ${MODES[*]} " == *redis* || " ${MODES[*]} " == *naive* ]]; then
    REDIS_PORT=$(free_port)
    redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no --dir "$OUT" \
        --logfile "$OUT/redis.log" &
    REDIS_PID=$!
    trap 'kill $REDIS_PID 2>/dev/null || true' EXIT
    for _ in $(seq 50); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
fi

printf '%-26s %10s %14s\n' mode requests instr/request
for mode in "${MODES[@]}"; do
    port=$(free_port)
    valgrind --tool=callgrind --callgrind-out-file="$OUT/$mode.%p.out" "$SERVER" --mode "$mode" \
        --port "$port" --redis "redis://127.0.0.1:${REDIS_PORT:-6379}/" --flood-limit 100 \
        >"$OUT/$mode.log" 2>&1 &
    pid=$!
    for _ in $(seq 200); do curl -s -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.1; done
    wrk -t1 -c"${CONNS:-8}" -d2s "http://127.0.0.1:$port/" >/dev/null
    callgrind_control --zero "$pid" >/dev/null 2>&1
    wrk -t1 -c"${CONNS:-8}" -d"${DURATION}s" "http://127.0.0.1:$port/" >"$OUT/$mode.wrk"
    callgrind_control --dump "$pid" >/dev/null 2>&1
    kill "$pid"; wait "$pid" 2>/dev/null || true
    requests=$(awk '/ requests in /{print $1}' "$OUT/$mode.wrk")
    instr=$(callgrind_annotate --auto=no "$OUT/$mode.$pid.out.1" 2>/dev/null |
        awk '/PROGRAM TOTALS/{gsub(",", "", $1); print $1; exit}')
    printf '%-26s %10d %14d\n' "$mode" "$requests" $((instr / requests))
    [[ ${KEEP:-0} == 1 ]] || rm -f "$OUT/$mode".*.out*
done
