#!/usr/bin/env bash
# The end-to-end benchmarks of tollgate, in one command: see docs/benchmarks.md.
#
#   benches/run.sh            # memory per key, then ROUNDS interleaved rounds of every mode
#   benches/run.sh --micro    # the same, then the criterion micro benchmarks
#   benches/run.sh --summary DIR   # the tables again, from the raw runs of an earlier run
#
# Settings (environment): ROUNDS (5), DURATION seconds per run (7), WARMUP seconds (1),
# CONNS wrk connections (64), MODES (all), SERVER_CPU (0), LOAD_CPU (1), REDIS_CPU (0),
# QUIET_PCT (20) and QUIET_MAX (30): see quiet() below, OUT directory for the raw results (a new
# one under /tmp), SERVER_OLD a second bench-server binary that modes named old-<mode> run (an
# A/B of two builds in the same rounds). Only 127.0.0.1 is ever contacted.
#
# Per run: a fresh bench-server pinned to SERVER_CPU, wrk pinned to LOAD_CPU, a warm-up, then
# wrk --latency for DURATION; requests/s and p99 from wrk, server CPU per request from the
# /proc/<pid>/stat utime+stime delta over the measured run divided by the requests, Redis
# commands per request from INFO commandstats (reset after the warm-up), and the reads Redis made
# from its clients per request (INFO stats' total_reads_processed: below 1 when calls share one
# read). The tollgate-cluster-* modes run against a 3-master Redis Cluster that this script
# starts on loopback, all pinned to REDIS_CPU like the standalone server; their Redis figures
# are summed over the masters. Each mode is reported
# as its median and min-max over the rounds, and as the median (min-max) of its ratio to bare
# axum measured in the same round.
set -euo pipefail

ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-7}
WARMUP=${WARMUP:-1}
CONNS=${CONNS:-64}
SERVER_CPU=${SERVER_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}
REDIS_CPU=${REDIS_CPU:-0}
ALL_MODES="bare tollgate-mem-allow tollgate-mem-deny governor-allow governor-deny tollgate-redis-allow tollgate-redis-spread tollgate-redis-allow3 tollgate-redis-flood tollgate-redis-flood-window tollgate-redis-lease-hot naive-incr tollgate-cluster-allow tollgate-cluster-spread tollgate-cluster-allow3"
MODES=${MODES:-$ALL_MODES}
MICRO=0
[[ ${1:-} == --micro ]] && MICRO=1

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
TCK=$(getconf CLK_TCK)

say() { printf '%s\n' "$*" >&2; }

# --- the summary (of $RESULTS) -----------------------------------------------------------------
summary() {
    awk -F'\t' -v flood="${FLOOD_LIMIT:-0}" '
    function sort(a, n,   i, j, t) { for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j > 0 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t } }
    function med(a, n) { sort(a, n); return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2 }
    function stat(key, fmt,   n, i, a) { n = cnt[key]; for (i = 1; i <= n; i++) a[i] = val[key, i]
        return n ? sprintf(fmt " (" fmt "-" fmt ")", med(a, n), a[1], a[n]) : "-" }
    function add(key, v) { val[key, ++cnt[key]] = v }
    NR == 1 { next }
    { mode[$2] = 1; rps[$1, $2] = $4; p99[$1, $2] = $5; cpu[$1, $2] = $6; rounds[$1] = 1
      add($2 ":rps", $4); add($2 ":p99", $5); add($2 ":cpu", $6)
      add($2 ":calls", $8); add($2 ":cmds", $9); add($2 ":rcpu", $10); add($2 ":other", $11)
      add($2 ":reads", $13)
      add($2 ":refused", $3 ? $7 / $3 : 0)
      if ($2 ~ /flood/ && flood > 0 && $4 > 0) add($2 ":x", $4 / flood)
      if (!($2 in order)) { order[$2] = ++modes; name[modes] = $2 } }
    END {
        for (r in rounds) for (m in mode) if ((r, "bare") in rps && (r, m) in rps) {
            add(m ":rrps", rps[r, m] / rps[r, "bare"]); add(m ":rp99", p99[r, m] / p99[r, "bare"])
            add(m ":rcpu_", cpu[r, m] / cpu[r, "bare"]) }
        printf "\n== end to end: median (min-max) over %d rounds; ratios to bare axum in the same round ==\n", length(rounds)
        printf "%-23s | %-26s | %-22s | %-26s | %-20s | %-20s | %-20s | %s\n", "mode", "req/s", "x bare", "p99 ms", "x bare", "server CPU us/req", "x bare", "refused"
        for (i = 1; i <= modes; i++) { m = name[i]
            printf "%-23s | %-26s | %-22s | %-26s | %-20s | %-20s | %-20s | %s\n", m,
                stat(m ":rps", "%.0f"), stat(m ":rrps", "%.3f"), stat(m ":p99", "%.2f"), stat(m ":rp99", "%.2f"),
                stat(m ":cpu", "%.2f"), stat(m ":rcpu_", "%.3f"), stat(m ":refused", "%.4f") }
        printf "\n== Redis per request: median (min-max) over %d rounds ==\n", length(rounds)
        printf "%-23s | %-28s | %-28s | %-22s | %-22s | %s\n", "mode", "script/commands sent", "all commands (in scripts too)", "redis CPU us/req", "redis reads/req", "load x limit"
        for (i = 1; i <= modes; i++) { m = name[i]; if (m !~ /redis|naive|cluster/) continue
            printf "%-23s | %-28s | %-28s | %-22s | %-22s | %s\n", m, stat(m ":calls", "%.4f"), stat(m ":cmds", "%.4f"),
                stat(m ":rcpu", "%.2f"), stat(m ":reads", "%.4f"), (m ~ /flood/ ? stat(m ":x", "%.0f") : "-") }
        printf "\nother load on the machine during the runs (%% of one CPU, neither server, wrk nor redis): %s\n", stat("bare:other", "%.1f")
        for (i = 1; i <= modes; i++) { m = name[i]; printf "  %-23s %s\n", m, stat(m ":other", "%.1f") }
    }' "$RESULTS"
}
if [[ ${1:-} == --summary ]]; then # benches/run.sh --summary DIR: the tables of an earlier run
    RESULTS=${2:?usage: run.sh --summary DIR}/runs.tsv
    FLOOD_LIMIT=$(cat "$2/flood-limit.txt" 2>/dev/null || echo 0)
    summary
    exit
fi

need() {
    command -v "$1" >/dev/null && return
    say "installing $2 (apt-get)"
    if [[ $(id -u) == 0 ]]; then apt-get install -y -qq "$2" >/dev/null; else sudo apt-get install -y -qq "$2" >/dev/null; fi
}
OUT=${OUT:-$(mktemp -d /tmp/tollgate-bench.XXXXXX)}
mkdir -p "$OUT"
RESULTS=$OUT/runs.tsv

need wrk wrk
need curl curl
uses_redis=0
[[ $MODES == *redis* || $MODES == *naive* ]] && uses_redis=1
uses_cluster=0
[[ $MODES == *cluster* ]] && uses_cluster=1
if ((uses_redis || uses_cluster)); then need redis-server redis-server; need redis-cli redis-tools; fi

say "building bench-server and mem-per-key (release)"
(cd "$ROOT" && cargo build --release -q -p tollgate-bench --bins)
SERVER=$TARGET/release/bench-server
MEM=$TARGET/release/mem-per-key

# shellcheck source=common.sh
source "$ROOT/benches/common.sh"

ticks() { # utime + stime of a process, in clock ticks
    local s
    s=$(cat "/proc/$1/stat") || { echo 0; return; }
    s=${s##*) }
    awk '{print $12 + $13}' <<<"$s"
}

busy() { # all CPUs' busy time so far, in clock ticks
    awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat
}

children_ticks() { # CPU time of this shell's finished children (wrk), in clock ticks
    # `times` must run in this shell, not in a command substitution's subshell.
    times >"$OUT/times.txt"
    tail -1 "$OUT/times.txt" | awk -v tck="$TCK" '{
        n = split($0, f, " "); s = 0
        for (i = 1; i <= n; i++) { split(f[i], ms, "m"); s += ms[1] * 60 + substr(ms[2], 1, length(ms[2]) - 1) }
        printf "%d\n", s * tck + 0.5 }'
}

# --- machine ------------------------------------------------------------------------------
{
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "cpus: $(nproc) x $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
    echo "kernel: $(uname -r)"
    echo "rustc: $(rustc --version)"
    echo "wrk: $(wrk --version 2>&1 | head -1)"
    ((uses_redis || uses_cluster)) && echo "redis: $(redis-server --version)"
    echo "settings: ROUNDS=$ROUNDS DURATION=${DURATION}s WARMUP=${WARMUP}s CONNS=$CONNS server on cpu $SERVER_CPU, wrk on cpu $LOAD_CPU, redis on cpu $REDIS_CPU"
} | tee "$OUT/machine.txt" >&2

# --- memory per key -----------------------------------------------------------------------
say ""
say "== memory per tracked key (1M keys, RSS delta) =="
for which in tollgate tollgate-window governor; do
    "$MEM" "$which" 1000000
done | tee "$OUT/memory.txt"

# --- redis ----------------------------------------------------------------------------------
REDIS_PID=
CLUSTER_PIDS=()
CLUSTER_PORTS=()
cleanup() {
    [[ -n ${SERVER_PID:-} ]] && kill "$SERVER_PID" 2>/dev/null || true
    [[ -n $REDIS_PID ]] && kill "$REDIS_PID" 2>/dev/null || true
    for pid in "${CLUSTER_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
if ((uses_redis)); then
    REDIS_PORT=$(free_port)
    taskset -c "$REDIS_CPU" redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" \
        --appendonly no --dir "$OUT" --logfile "$OUT/redis.log" &
    REDIS_PID=$!
    for _ in $(seq 50); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
    REDIS_URL="redis://127.0.0.1:$REDIS_PORT/"
    say "redis-server pid $REDIS_PID on $REDIS_URL"
fi
rcli() { redis-cli -p "$REDIS_PORT" "$@"; }

# A Redis Cluster of 3 masters (no replicas), each a redis-server pinned to REDIS_CPU.
if ((uses_cluster)); then
    for _ in 1 2 3; do
        while :; do # the cluster bus listens on the port + 10000
            port=$(free_port)
            (exec 3<>"/dev/tcp/127.0.0.1/$((port + 10000))") 2>/dev/null || break
        done
        mkdir -p "$OUT/cluster-$port"
        taskset -c "$REDIS_CPU" redis-server --port "$port" --bind 127.0.0.1 --save "" \
            --appendonly no --dir "$OUT/cluster-$port" --logfile "$OUT/cluster-$port/redis.log" \
            --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 5000 &
        CLUSTER_PIDS+=($!)
        CLUSTER_PORTS+=("$port")
        for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
    done
    redis-cli --cluster create "${CLUSTER_PORTS[@]/#/127.0.0.1:}" --cluster-replicas 0 \
        --cluster-yes >"$OUT/cluster-create.log"
    cluster_up 100 0.1 "${CLUSTER_PORTS[@]}"
    CLUSTER_URLS=$(cluster_urls "${CLUSTER_PORTS[@]}")
    sleep 1 # every node must see the same slot owners before the first client asks
    say "redis cluster pids ${CLUSTER_PIDS[*]} on ports ${CLUSTER_PORTS[*]}"
fi
# What a run measures Redis by: the standalone server, or every master of the cluster.
redis_ports() { if [[ $1 == *cluster* ]]; then echo "${CLUSTER_PORTS[@]}"; else echo "$REDIS_PORT"; fi; }
redis_pids() { if [[ $1 == *cluster* ]]; then echo "${CLUSTER_PIDS[@]}"; else echo "$REDIS_PID"; fi; }
each_redis() { # each_redis MODE ARGS...: redis-cli ARGS on every server of the mode
    local mode=$1 port
    shift
    for port in $(redis_ports "$mode"); do redis-cli -p "$port" "$@"; done
}
redis_ticks() { # summed over the servers of a mode
    local t=0 pid
    for pid in $(redis_pids "$1"); do t=$((t + $(ticks "$pid"))); done
    echo "$t"
}

# Other work on the machine (builds, tests) skews every figure: before each run, wait until it
# stays under QUIET_PCT % of one CPU for a second, at most QUIET_MAX seconds.
QUIET_PCT=${QUIET_PCT:-20}
QUIET_MAX=${QUIET_MAX:-30}
quiet() {
    local waited=0 b0 b1
    while :; do
        b0=$(busy); sleep 1; b1=$(busy)
        (( (b1 - b0) * 100 / TCK < QUIET_PCT )) && return
        if ((++waited >= QUIET_MAX)); then
            say "  (the machine is still busy: $(( (b1 - b0) * 100 / TCK ))% of a CPU; going on)"
            return
        fi
    done
}

# --- one run ------------------------------------------------------------------------------
# run_one ROUND MODE [DURATION]: appends a line to $RESULTS.
run_one() {
    local round=$1 mode=$2 dur=${3:-$DURATION} port redis_mode=0
    port=$(free_port)
    [[ $mode == *redis* || $mode == *naive* || $mode == *cluster* ]] && redis_mode=1
    ((redis_mode)) && each_redis "$mode" flushall >/dev/null
    quiet
    # A mode named old-<mode> runs <mode> on the SERVER_OLD binary: two builds in one run.
    local bin=$SERVER real=$mode
    [[ $mode == old-* ]] && bin=${SERVER_OLD:?old- modes need SERVER_OLD} && real=${mode#old-}
    taskset -c "$SERVER_CPU" "$bin" --mode "$real" --port "$port" \
        --redis "${REDIS_URL:-redis://127.0.0.1:6379/}" --flood-limit "${FLOOD_LIMIT:-100}" \
        ${CLUSTER_URLS:+--cluster "$CLUSTER_URLS"} \
        2>>"$OUT/server.log" &
    SERVER_PID=$!
    for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.05; done
    taskset -c "$LOAD_CPU" wrk -t1 -c"$CONNS" -d"${WARMUP}s" "http://127.0.0.1:$port/" >/dev/null
    ((redis_mode)) && each_redis "$mode" config resetstat >/dev/null

    local s0 r0 b0 w0 s1 r1 b1 w1
    s0=$(ticks "$SERVER_PID"); r0=$( ((redis_mode)) && redis_ticks "$mode" || echo 0)
    b0=$(busy); children_ticks >"$OUT/w0"; w0=$(<"$OUT/w0")
    taskset -c "$LOAD_CPU" wrk -t1 -c"$CONNS" -d"${dur}s" --latency "http://127.0.0.1:$port/" >"$OUT/wrk.txt"
    s1=$(ticks "$SERVER_PID"); r1=$( ((redis_mode)) && redis_ticks "$mode" || echo 0)
    b1=$(busy); children_ticks >"$OUT/w1"; w1=$(<"$OUT/w1")
    local stats="" reads=0
    if ((redis_mode)); then
        # Summed over the servers: one name=calls per command.
        stats=$(each_redis "$mode" info commandstats | tr -d '\r' | grep '^cmdstat_' |
            awk -F'[:=,]' '{c[$1] += $3} END {for (n in c) printf "%s:calls=%d ", n, c[n]}' || true)
        reads=$(each_redis "$mode" info stats | tr -d '\r' |
            awk -F: '/^total_reads_processed:/ {s += $2} END {print s + 0}')
    fi
    kill "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=

    # requests, req/s, p99 (ms), non-2xx, commandstats -> one line
    awk -v round="$round" -v mode="$mode" -v tck="$TCK" -v dur="$dur" \
        -v server=$((s1 - s0)) -v redis=$((r1 - r0)) -v busy=$((b1 - b0)) -v wrk=$((w1 - w0)) \
        -v stats="$stats" -v reads="$reads" '
        / requests in / { requests = $1 }
        /^Requests\/sec:/ { rps = $2 }
        / 99% / { v = $2; unit = v; sub(/[0-9.]+/, "", unit); sub(/[a-z]+$/, "", v)
                  p99 = v * (unit == "us" ? 0.001 : unit == "s" ? 1000 : 1) }
        /Non-2xx or 3xx responses:/ { non2xx = $5 }
        END {
            n = split(stats, parts, " "); all = 0; top = 0; scripts = 0; detail = ""
            for (i = 1; i <= n; i++) {
                name = parts[i]; sub(/^cmdstat_/, "", name); sub(/:.*/, "", name)
                calls = match(parts[i], /:calls=[0-9]+/) ? substr(parts[i], RSTART + 7, RLENGTH - 7) : 0
                if (name ~ /^(info|config)/) continue
                all += calls
                if (name ~ /^(eval|fcall|script)/) scripts += calls
                detail = detail name "=" calls ","
            }
            # With scripts, the data commands run inside them: what the app sends is the
            # script calls. Without, every command is sent by the app.
            top = scripts > 0 ? scripts : all
            other = busy - server - redis - wrk; if (other < 0) other = 0
            printf "%s\t%s\t%d\t%.0f\t%.3f\t%.3f\t%d\t%.4f\t%.4f\t%.3f\t%.1f\t%s\t%.4f\n",
                round, mode, requests, rps, p99,
                server * 1e6 / tck / requests, non2xx + 0,
                top / requests, all / requests, redis * 1e6 / tck / requests,
                100 * other / tck / dur, (detail == "" ? "-" : detail), reads / requests
        }' "$OUT/wrk.txt" >>"$RESULTS"
    tail -1 "$RESULTS" | awk -F'\t' '{printf "  round %s %-24s %8d req/s  p99 %7.2f ms  cpu %6.2f us/req  non2xx %d  redis %s cmd/req  other load %s%%\n", $1, $2, $4, $5, $6, $7, $8, $11}' >&2
}

# --- the rounds -----------------------------------------------------------------------------
printf 'round\tmode\trequests\trps\tp99_ms\tcpu_us_per_req\tnon2xx\tredis_calls_per_req\tredis_cmds_per_req\tredis_cpu_us_per_req\tother_load_pct\tcommands\tredis_reads_per_req\n' >"$RESULTS"
if [[ $MODES == *flood* ]]; then
    # A flood at 100x the limit: measure what one client sends when it is refused, set the
    # limit to a hundredth of that, and once more (a higher limit means more calls to Redis,
    # so fewer requests).
    FLOOD_LIMIT=100
    for _ in 1 2; do
        run_one 0 tollgate-redis-flood 3
        FLOOD_LIMIT=$(tail -1 "$RESULTS" | awk -F'\t' '{l = int($4 / 100); print (l < 1 ? 1 : l)}')
        sed -i '$d' "$RESULTS"
    done
    say "flood limit: $FLOOD_LIMIT per second per IP"
    echo "$FLOOD_LIMIT" >"$OUT/flood-limit.txt"
fi
read -r -a modes <<<"$MODES"
for ((round = 1; round <= ROUNDS; round++)); do
    say ""
    say "== round $round of $ROUNDS =="
    # Rotate the order every round so that no mode always runs first or last.
    for ((i = 0; i < ${#modes[@]}; i++)); do
        run_one "$round" "${modes[(i + round - 1) % ${#modes[@]}]}"
    done
done

summary | tee "$OUT/summary.txt"
say ""
say "raw runs: $RESULTS"

if ((MICRO)); then
    say ""
    say "== micro benchmarks (criterion) =="
    (cd "$ROOT" && cargo bench -q -p tollgate-bench --bench memory) 2>&1 | tee "$OUT/micro.txt"
fi
