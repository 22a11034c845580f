#!/usr/bin/env bash
# Instructions a Redis Cluster master spends per request on tollgate's merged calls, against a
# standalone server given calls of the same size: valgrind's callgrind on one master of a
# 3-master cluster (the other two run natively), and on a standalone server.
#
#   benches/cluster-cost.sh [PER_CALL...]    # default: 12 48 96 requests a round
#
# Each round is `script-cost --mode distinct`: PER_CALL requests, each one GCRA check on a key
# never seen before, all queued before the first call goes out, so a cluster node's call
# carries the round's requests whose keys it serves (about a third). Per size it prints, for
# the counted master: its requests (the `SET`s its scripts ran, one per admitted request), its
# calls, requests per call and instructions per request; then a standalone server's
# instructions per request for calls of the master's size rounded. Then each server's
# instructions per second while idle (its crons, and the cluster bus), over IDLE seconds (10).
#
# With NATIVE=1 nothing runs under valgrind: the same table gives each server's CPU time per
# request (user and system, from /proc/<pid>/stat), kernel included, which callgrind does not
# count; use more rounds (CALLS=3000), since the clock ticks are 10 ms.
#
# Settings: CALLS rounds (100), IDLE seconds (10), REDIS_SERVER (redis-server: a build with
# symbols names the functions; KEEP=1 keeps the callgrind files in OUT for
# callgrind_annotate), NATIVE (0). Only 127.0.0.1 is contacted.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
CALLS=${CALLS:-100}
IDLE=${IDLE:-10}
REDIS_SERVER=${REDIS_SERVER:-redis-server}
NATIVE=${NATIVE:-0}
TCK=$(getconf CLK_TCK)
SIZES=("$@")
((${#SIZES[@]})) || SIZES=(12 48 96)

for tool in valgrind:valgrind redis-server:redis-server redis-cli:redis-tools; do
    command -v "${tool%%:*}" >/dev/null || apt-get install -y -qq "${tool#*:}" >/dev/null
done
(cd "$ROOT" && cargo build --release -q -p tollgate-bench --example script-cost)
COST=$TARGET/release/examples/script-cost

# shellcheck source=common.sh
source "$ROOT/benches/common.sh"

OUT=${OUT:-$(mktemp -d /tmp/tollgate-cluster-cost.XXXXXX)}
mkdir -p "$OUT"
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    [[ ${KEEP:-0} == 1 ]] || rm -rf "$OUT"
}
trap cleanup EXIT

cluster_port() { # a free port whose cluster bus port (+10000) is free too
    local p
    while :; do
        p=$(free_port)
        ((p < 55000)) && ! (exec 3<>"/dev/tcp/127.0.0.1/$((p + 10000))") 2>/dev/null && break
    done
    echo "$p"
}

# start NAME PORT CALLGRIND(0|1) [redis-server options...]: its pid in $STARTED
start() {
    local name=$1 port=$2 counted=$3
    shift 3
    mkdir -p "$OUT/$name"
    local cmd=("$REDIS_SERVER" --port "$port" --bind 127.0.0.1 --save "" --appendonly no
        --dir "$OUT/$name" --logfile "$OUT/$name/redis.log" "$@")
    if ((counted && !NATIVE)); then
        valgrind --tool=callgrind --callgrind-out-file="$OUT/$name/cg.%p.out" "${cmd[@]}" \
            2>"$OUT/$name/valgrind.log" &
    else
        "${cmd[@]}" &
    fi
    STARTED=$!
    PIDS+=("$STARTED")
    for _ in $(seq 150); do redis-cli -p "$port" ping >/dev/null 2>&1 && return; sleep 0.2; done
    echo "$name did not start" >&2
    exit 1
}

stat_of() { # stat_of PORT COMMAND: the calls INFO commandstats counted
    redis-cli -p "$1" info commandstats | tr -d '\r' |
        awk -F'[:=,]' -v c="cmdstat_$2" '$1 == c {print $3; found = 1} END {if (!found) print 0}'
}

ticks() { # user and system time of a process, in clock ticks
    local s
    s=$(cat "/proc/$1/stat")
    s=${s##*) }
    awk '{print $12, $13}' <<<"$s"
}

# counted PID PORT CMD...: runs CMD between a zero and a dump of PID's counts; prints
# "instructions sets evalsha seconds" (NATIVE: "user-ns system-ns sets evalsha seconds")
counted() {
    local pid=$1 port=$2
    shift 2
    if ((NATIVE)); then
        local u0 s0 u1 s1 t0 t1
        redis-cli -p "$port" config resetstat >/dev/null
        read -r u0 s0 < <(ticks "$pid")
        t0=$(date +%s.%N)
        "$@" >/dev/null
        t1=$(date +%s.%N)
        read -r u1 s1 < <(ticks "$pid")
        echo "$(((u1 - u0) * 1000000000 / TCK)) $(((s1 - s0) * 1000000000 / TCK))" \
            "$(stat_of "$port" set) $(stat_of "$port" evalsha) $(bc -l <<<"$t1 - $t0")"
        return
    fi
    redis-cli -p "$port" config resetstat >/dev/null
    callgrind_control --zero "$pid" >/dev/null 2>&1
    local t0 t1
    t0=$(date +%s.%N)
    "$@" >/dev/null
    t1=$(date +%s.%N)
    callgrind_control --dump "$pid" >/dev/null 2>&1
    local file
    file=$(ls -t "$OUT"/*/cg."$pid".out.* | head -1)
    local instr
    instr=$(callgrind_annotate --auto=no "$file" 2>/dev/null |
        awk '/PROGRAM TOTALS/{gsub(",", "", $1); print $1; exit}')
    echo "$instr $(stat_of "$port" set) $(stat_of "$port" evalsha) $(bc -l <<<"$t1 - $t0")"
}

idle() { # idle PID PORT: instructions per second over IDLE seconds with nothing sent
    local r
    r=$(counted "$1" "$2" sleep "$IDLE")
    echo $(($(cut -d' ' -f1 <<<"$r") / IDLE))
}

# row LABEL INSTR SETS CALLS SECONDS IDLE_PER_SECOND: one line of the table, the instructions
# per request also net of what the server spends idle over the run's seconds
row() {
    if ((NATIVE)); then # LABEL USER-NS SYSTEM-NS SETS CALLS SECONDS
        printf '%-24s %9d %6d %9.2f %14.2f %12.2f\n' "$1" "$4" "$5" "$(bc -l <<<"$4 / $5")" \
            "$(bc -l <<<"$2 / $4 / 1000")" "$(bc -l <<<"$3 / $4 / 1000")"
        return
    fi
    printf '%-24s %9d %6d %9.2f %14d %12.0f\n' "$1" "$3" "$4" "$(bc -l <<<"$3 / $4")" \
        $(($2 / $3)) "$(bc -l <<<"($2 - $6 * $5) / $3")"
}

# --- the cluster: the first master counted ------------------------------------------------
PORTS=()
for i in 0 1 2; do
    port=$(cluster_port)
    PORTS+=("$port")
    start "node$i" "$port" $((i == 0)) --cluster-enabled yes --cluster-config-file nodes.conf \
        --cluster-node-timeout 60000
    [[ $i == 0 ]] && NODE_PID=$STARTED
done
redis-cli --cluster create "${PORTS[@]/#/127.0.0.1:}" --cluster-replicas 0 --cluster-yes \
    >"$OUT/create.log"
cluster_up 300 0.2 "${PORTS[@]}"
URLS=$(cluster_urls "${PORTS[@]}")

if ((NATIVE)); then
    printf '%-24s %9s %6s %9s %14s %12s\n' server requests calls req/call "user us/req" "sys us/req"
else
    CLUSTER_IDLE=$(idle "$NODE_PID" "${PORTS[0]}")
    printf '%-24s %9s %6s %9s %14s %12s\n' server requests calls req/call instr/request "net of idle"
fi
declare -A SIZE_OF
from=10000000
for per in "${SIZES[@]}"; do
    "$COST" --cluster "$URLS" --mode distinct --calls 10 --per-call "$per" --from "$from" >/dev/null
    from=$((from + 10000000))
    read -r -a got < <(counted "$NODE_PID" "${PORTS[0]}" \
        "$COST" --cluster "$URLS" --mode distinct --calls "$CALLS" --per-call "$per" --from "$from")
    from=$((from + 10000000))
    sets=${got[-3]} calls=${got[-2]}
    SIZE_OF[$per]=$(((sets + calls / 2) / calls))
    row "cluster, $per a round" "${got[@]}" "${CLUSTER_IDLE:-0}"
done

# --- a standalone server, calls of the cluster master's sizes ------------------------------
port=$(free_port)
start standalone "$port" 1
STANDALONE_PID=$STARTED
url="redis://127.0.0.1:$port/"
((NATIVE)) || STANDALONE_IDLE=$(idle "$STANDALONE_PID" "$port")
for per in "${SIZES[@]}"; do
    size=${SIZE_OF[$per]}
    "$COST" --redis "$url" --mode distinct --calls 10 --per-call "$size" --from "$from" >/dev/null
    from=$((from + 10000000))
    read -r -a got < <(counted "$STANDALONE_PID" "$port" \
        "$COST" --redis "$url" --mode distinct --calls "$CALLS" --per-call "$size" --from "$from")
    from=$((from + 10000000))
    row "standalone, $size a call" "${got[@]}" "${STANDALONE_IDLE:-0}"
done
((NATIVE)) && exit 0
printf '\nidle instructions per second: cluster master %d, standalone %d\n' \
    "$CLUSTER_IDLE" "$STANDALONE_IDLE"
