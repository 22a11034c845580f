#!/usr/bin/env bash
# A soak under faults: two replicas of examples/llm_chat on one Redis, under wrk load, and one
# fault after another. Checks, per phase, that nothing is lost: see docs/reliability.md.
#
#   benches/soak.sh           # phases of PHASE seconds (default 40)
#   benches/soak.sh --short   # phases of 5 s (10 s on the cluster): under 60 s once built
#
# First pass, standalone Redis: no fault, then Redis paused with SIGSTOP for 2 s, killed and
# restarted empty, FLUSHALL, and a relay that holds its replies back 100 ms (past the 50 ms
# deadline) for 2 s. Second pass, a Redis Cluster of 3 masters with a replica each: a master
# killed (SIGKILL), its replica promoted by the cluster.
#
# Exits non-zero when a promise is broken in any phase:
#   - the replies that say they were not limited ("limited":false) must equal the rise of
#     tollgate_bypass_total{limit="chat-per-shop"} over both replicas;
#   - no shop may be admitted (limited, "limited":true) more than its quota allows over the
#     phase: 30 (the burst) + one per 2 s of the phase, and 30 more in a phase where Redis lost
#     its state;
#   - no 503 (the limit is fail-open), no other status, no socket error;
#   - limiting resumes on both replicas within RESUME_MAX_MS (default 5000; 15000 for the
#     cluster, whose failover alone takes its node timeout, 2 s, and an election) of the
#     fault's end.
#
# Settings (environment): PHASE seconds, RESUME_MAX_MS, THREADS wrk connections per replica (3),
# MANY other shops (200), OUT directory for logs (a new one under /tmp). Traffic: half the
# requests from one shop that floods, a fifth from a hot shop, the rest from MANY shops.
# Redis is reached through benches' soak-relay, which can hold its replies back. Only
# 127.0.0.1 is ever contacted.
set -euo pipefail

SHORT=0
[[ ${1:-} == --short ]] && SHORT=1
PHASE=${PHASE:-$(( SHORT ? 5 : 40 ))}
CLUSTER_PHASE=${CLUSTER_PHASE:-$(( SHORT ? 10 : 40 ))}
RESUME_MAX_MS=${RESUME_MAX_MS:-5000}
THREADS=${THREADS:-3}
export MANY=${MANY:-200}
# llm_chat's limit: 30 a minute per shop, GCRA (burst 30, one more every 2 s).
BURST=30
REFILL_SECS=2

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
# shellcheck source=benches/common.sh
source "$ROOT/benches/common.sh"
say() { printf '%s\n' "$*" >&2; }
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

command -v wrk >/dev/null || { say "soak.sh needs wrk (apt-get install wrk)"; exit 2; }
command -v redis-server >/dev/null || { say "soak.sh needs redis-server"; exit 2; }

say "building llm_chat and soak-relay (release)..."
(cd "$ROOT" && cargo build --quiet --release --example llm_chat \
  && cargo build --quiet --release -p tollgate-bench --bin soak-relay)

OUT=${OUT:-$(mktemp -d /tmp/tollgate-soak.XXXXXX)}
mkdir -p "$OUT"
REDIS_PORT=$(free_port)
RELAY_PORT=$(free_port)
PORT_A=$(free_port)
PORT_B=$(free_port)
PIDS=()
declare -A CLUSTER_PIDS=()
cleanup() {
  local pid
  for pid in "${PIDS[@]}" ${REDIS_PID:-}; do kill -CONT "$pid" 2>/dev/null || true; kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

start_redis() {
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
    --daemonize no --logfile "$OUT/redis.log" &
  REDIS_PID=$!
  until redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1; do sleep 0.01; done
}

REPLICA_PIDS=()
# start_replicas VAR=VALUE...: both llm_chat replicas, with that environment.
start_replicas() {
  local port
  REPLICA_PIDS=()
  for port in "$PORT_A" "$PORT_B"; do
    env "$@" PORT="$port" "$TARGET/release/examples/llm_chat" >>"$OUT/llm_chat-$port.log" 2>&1 &
    PIDS+=($!)
    REPLICA_PIDS+=($!)
  done
  for port in "$PORT_A" "$PORT_B"; do
    until curl -sf "http://127.0.0.1:$port/metrics" >/dev/null; do sleep 0.05; done
  done
}
stop_replicas() {
  local pid
  for pid in "${REPLICA_PIDS[@]}"; do kill "$pid"; wait "$pid" 2>/dev/null || true; done
}

start_redis
"$TARGET/release/soak-relay" "$RELAY_PORT" "$REDIS_PORT" "$OUT/delay" 100 &
PIDS+=($!)
start_replicas REDIS_URL="redis://127.0.0.1:$RELAY_PORT/"

# The sum over both replicas of the series of $1 whose labels hold $2.
metric() {
  local port
  for port in "$PORT_A" "$PORT_B"; do curl -s "http://127.0.0.1:$port/metrics"; done \
    | { grep "^$1{" || true; } | { grep -F "$2" || true; } \
    | awk '{ s += $NF } END { printf "%d\n", s }'
}

chat() { # port shop -> the reply's body, or the status when it is not 200
  curl -s -o - -w '\n%{http_code}' -X POST -H "x-shop-domain: $2" "http://127.0.0.1:$1/api/chat"
}

PROBE=0
PROBE_BYPASSES=0
RESUMED_MS=-
# Sends requests of new shops to each replica in turn until it says it limited them; sets
# RESUMED_MS (from $1, the fault's end) and counts the probes' own bypasses.
wait_limiting() {
  local since=$1 port reply
  for port in "$PORT_A" "$PORT_B"; do
    while :; do
      PROBE=$((PROBE + 1))
      PROBES=$((PROBES + 1))
      reply=$(chat "$port" "probe-$PROBE.soak")
      if [[ $reply == *'"limited":true'* ]]; then break; fi
      [[ $reply == *'"limited":false'* ]] && PROBE_BYPASSES=$((PROBE_BYPASSES + 1))
      if (( $(now_ms) - since > RESUME_MAX_MS )); then RESUMED_MS=never; return; fi
      sleep 0.02
    done
  done
  RESUMED_MS=$(( $(now_ms) - since ))
}

# Watches tollgate_bypass_total on both replicas until it has not risen for a second; sets
# RESUMED_MS to the time of its last rise after $1, the fault's end. For the cluster, where a
# probe of a new shop may land on a master that never failed.
wait_quiet() {
  local since=$1 last=$1 seen now
  seen=$(metric tollgate_bypass_total 'limit="chat-per-shop"')
  while :; do
    sleep 0.1
    now=$(metric tollgate_bypass_total 'limit="chat-per-shop"')
    (( now != seen )) && { seen=$now; last=$(now_ms); }
    (( $(now_ms) - last >= 1000 )) && break
    if (( $(now_ms) - since > RESUME_MAX_MS )); then RESUMED_MS=never; return; fi
  done
  RESUMED_MS=$(( last - since ))
}

fault_none() { :; }
fault_pause() { kill -STOP "$REDIS_PID"; sleep 2; kill -CONT "$REDIS_PID"; }
fault_restart() { kill -KILL "$REDIS_PID"; wait "$REDIS_PID" 2>/dev/null || true; start_redis; }
fault_flushall() { redis-cli -p "$REDIS_PORT" FLUSHALL >/dev/null; }
fault_delay() { touch "$OUT/delay"; sleep 2; rm -f "$OUT/delay"; }
fault_master() { kill -KILL "$KILLED_MASTER_PID"; wait "$KILLED_MASTER_PID" 2>/dev/null || true; }

FAILED=0
ROWS=()
# phase NAME LOST: wrk on both replicas for PHASE s, the fault NAME 1 s in. LOST=1 when the
# fault loses Redis' state (the quota may be admitted once more).
phase() {
  local name=$1 lost=$2 seconds=${3:-$PHASE} before after decided_before decided wrk_pids=() port
  before=$(metric tollgate_bypass_total 'limit="chat-per-shop"')
  decided_before=$(metric tollgate_decisions_total 'limit="chat-per-shop"')
  PROBE_BYPASSES=0
  PROBES=0
  RESUMED_MS=-
  for port in "$PORT_A" "$PORT_B"; do
    wrk -t"$THREADS" -c"$THREADS" -d"${seconds}s" --timeout 5s -s "$ROOT/benches/soak/traffic.lua" \
      "http://127.0.0.1:$port/api/chat" >"$OUT/$name-$port.wrk" 2>&1 &
    wrk_pids+=($!)
  done
  sleep 1
  "fault_$name"
  case $name in
    none) ;;
    master) wait_quiet "$(now_ms)" ;;
    *) wait_limiting "$(now_ms)" ;;
  esac
  wait "${wrk_pids[@]}"
  sleep 0.2
  after=$(metric tollgate_bypass_total 'limit="chat-per-shop"')
  decided=$(metric tollgate_decisions_total 'limit="chat-per-shop"')
  local files=("$OUT/$name-$PORT_A.wrk" "$OUT/$name-$PORT_B.wrk")
  total() { awk -v k="$1" '$1 == "total" && $2 == k { s += $3 } END { printf "%d\n", s }' "${files[@]}"; }
  local requests bypassed unavailable other errors slowest_us bound over unseen
  requests=$(total requests)
  # Requests the replicas decided whose replies nobody read: wrk stops at its duration with
  # up to one request a connection in flight. A bypass among them is counted by the server
  # and not by wrk, so the two bypass counts may differ by at most these.
  unseen=$(( decided - decided_before - requests - PROBES ))
  bypassed=$(( $(total bypassed) + PROBE_BYPASSES ))
  unavailable=$(total unavailable)
  other=$(total other)
  errors=$(total socket_errors)
  slowest_us=$(awk '$1 == "total" && $2 == "max_latency_us" && $3 > m { m = $3 } END { printf "%d\n", m }' "${files[@]}")
  bound=$(( BURST + (seconds + 2) / REFILL_SECS + 1 + lost * BURST ))
  # Admissions over the bound, summed over the shops (both replicas' counts added first).
  over=$(awk -v b="$bound" '$1 == "shop" { n[$2] += $3 } END { for (s in n) if (n[s] > b) o += n[s] - b; printf "%d\n", o }' "${files[@]}")
  local hot flood
  hot=$(awk '$1 == "shop" && $2 == "hot.soak" { s += $3 } END { printf "%d\n", s }' "${files[@]}")
  flood=$(awk '$1 == "shop" && $2 == "flood.soak" { s += $3 } END { printf "%d\n", s }' "${files[@]}")
  local verdict=ok
  if (( unseen < 0 || after - before < bypassed || after - before > bypassed + unseen )); then
    verdict="BYPASSES DIFFER"
  fi
  if (( over > 0 )); then verdict="OVER THE LIMIT"; fi
  if (( unavailable > 0 || other > 0 || errors > 0 )); then verdict="ERRORS"; fi
  if [[ $RESUMED_MS == never ]]; then verdict="DID NOT RESUME"; fi
  [[ $verdict == ok ]] || FAILED=1
  ROWS+=("| $name | $requests | $(awk -v u="$slowest_us" 'BEGIN { printf "%.1f", u / 1000 }') | $((after - before)) | $bypassed ($unseen unseen) | $hot / $flood (≤ $bound) | $over | $unavailable | $RESUMED_MS | $verdict |")
  say "phase $name: $verdict"
}

say "soak: phases of ${PHASE}s; logs in $OUT"
phase none 0
phase pause 0
phase restart 1
phase flushall 1
phase delay 0
memory_first=()
for pid in "${REPLICA_PIDS[@]}"; do memory_first+=("$(ps -o rss= -p "$pid" | tr -d ' ')"); done

# --- second pass: a Redis Cluster, 3 masters with a replica each ---------------------------
stop_replicas
kill "$REDIS_PID"; wait "$REDIS_PID" 2>/dev/null || true; REDIS_PID=
CLUSTER_PORTS=()
SEEDS=()
for i in 1 2 3 4 5 6; do
  port=$(free_port)
  # The bus port, port + 10000, must be free too.
  while (exec 3<>"/dev/tcp/127.0.0.1/$((port + 10000))") 2>/dev/null || (( port + 10000 > 65535 )); do port=$(free_port); done
  mkdir -p "$OUT/cluster-$port"
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no \
    --cluster-enabled yes --cluster-node-timeout 2000 --cluster-config-file nodes.conf \
    --dir "$OUT/cluster-$port" --logfile "$OUT/cluster-$port/redis.log" &
  PIDS+=($!)
  CLUSTER_PORTS+=("$port")
  CLUSTER_PIDS[$port]=$!
  SEEDS+=("redis://127.0.0.1:$port/")
done
for port in "${CLUSTER_PORTS[@]}"; do
  until redis-cli -p "$port" ping >/dev/null 2>&1; do sleep 0.01; done
done
redis-cli --cluster create $(printf '127.0.0.1:%s ' "${CLUSTER_PORTS[@]}") --cluster-replicas 1 \
  --cluster-yes >"$OUT/cluster-create.log" 2>&1
for port in "${CLUSTER_PORTS[@]}"; do
  until redis-cli -p "$port" cluster info 2>/dev/null | grep -q 'cluster_state:ok'; do sleep 0.05; done
done
# Every replica in sync before a master dies.
for port in "${CLUSTER_PORTS[@]}"; do
  role=$(redis-cli -p "$port" role)
  if [[ ${role%%$'\n'*} == slave ]]; then
    until redis-cli -p "$port" info replication | grep -q 'master_link_status:up'; do sleep 0.05; done
  fi
done
for port in "${CLUSTER_PORTS[@]}"; do
  role=$(redis-cli -p "$port" role)
  if [[ ${role%%$'\n'*} == master ]]; then KILLED_MASTER_PID=${CLUSTER_PIDS[$port]}; break; fi
done
start_replicas REDIS_CLUSTER="$(IFS=,; echo "${SEEDS[*]}")"
say "cluster: ${CLUSTER_PORTS[*]}; killing the master with pid $KILLED_MASTER_PID"
# A master that dies may take writes its replica had not yet copied: counted as state lost.
RESUME_MAX_MS=${CLUSTER_RESUME_MAX_MS:-15000} phase master 1 "$CLUSTER_PHASE"

echo
echo "| phase | requests | slowest (ms) | tollgate_bypass_total | replies not limited | admitted hot / flood shop | over the limit | 503 | limiting resumed after (ms) | |"
echo "|---|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
echo
for i in 0 1; do
  echo "replica $((i + 1)) memory at the end: ${memory_first[$i]} KiB RSS (standalone pass)," \
    "$(ps -o rss= -p "${REPLICA_PIDS[$i]}" | tr -d ' ') KiB RSS (cluster pass)"
done
exit "$FAILED"
