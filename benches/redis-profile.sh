#!/usr/bin/env bash
# Where Redis spends its CPU under a benches/run.sh load, per request and per function, kernel
# included: the whole machine is sampled with `perf record -e cpu-clock` while run.sh's
# measured wrk run goes on, and the samples of the redis-server processes are divided by the
# requests served meanwhile.
#
#   benches/redis-profile.sh        # tollgate-redis-spread against tollgate-cluster-spread
#
# Per mode it prints Redis' nanoseconds per request by library (the server, the allocator, libc,
# the kernel, the vDSO); then, per function, both modes' nanoseconds per request and their
# difference, largest difference first (a function the first mode never ran shows 0 there).
# Sampling counts what the CPU ran: a handful of samples make a small function's figure, so
# compare the totals, and functions of some tens of nanoseconds, not the last digit.
#
# Settings: MODES (two run.sh modes: the base first), DURATION of the wrk run in seconds (14),
# PERF_DELAY seconds into it before sampling (3), PERF_SECONDS sampled (6), FREQ samples a
# second per CPU (1999), TOP functions shown (30), and run.sh's own settings (pinning, CONNS).
# Needs `perf` (Debian's linux-perf) with kernel sampling allowed. Only 127.0.0.1 is contacted.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
MODES=${MODES:-tollgate-redis-spread tollgate-cluster-spread}
DURATION=${DURATION:-14}
PERF_DELAY=${PERF_DELAY:-3}
PERF_SECONDS=${PERF_SECONDS:-6}
FREQ=${FREQ:-1999}
TOP=${TOP:-30}
OUT=$(mktemp -d /tmp/tollgate-redis-profile.XXXXXX)
trap 'rm -rf "$OUT"' EXIT

command -v perf >/dev/null || apt-get install -y -qq linux-perf >/dev/null

# One mode: run.sh in the background, perf over the middle of its measured run; then the
# Redis samples per (library, function) as nanoseconds per request, in $OUT/<mode>.tsv.
profile() {
    local mode=$1
    (cd "$ROOT" && MODES="$mode" ROUNDS=1 DURATION="$DURATION" benches/run.sh \
        >"$OUT/$mode.run" 2>&1) &
    local run=$!
    local i
    for ((i = 0; i < 1200; i++)); do
        pgrep -f "wrk.*--latency" >/dev/null && break
        sleep 0.1
    done
    sleep "$PERF_DELAY"
    perf record -q -a -e cpu-clock -F "$FREQ" -o "$OUT/$mode.data" -- sleep "$PERF_SECONDS" \
        >/dev/null 2>&1
    wait "$run"
    local rps
    rps=$(awk -v m="$mode" '$1 == "round" && $3 == m {print $4}' "$OUT/$mode.run")
    [[ -n $rps ]] || { echo "no run of $mode: see $OUT/$mode.run" >&2; cat "$OUT/$mode.run" >&2; exit 1; }
    echo "$mode: $rps requests/s" >&2
    perf report -i "$OUT/$mode.data" --stdio --no-children --comm redis-server \
        --sort dso,sym -F sample,dso,sym -g none 2>/dev/null |
        awk -v rps="$rps" -v secs="$PERF_SECONDS" -v freq="$FREQ" '
            /^#/ || NF < 3 { next }
            { lib = $2; $1 = $1; sym = $0; sub(/^[0-9]+ [^ ]+ \[.\] /, "", sym)
              printf "%s\t%s\t%.1f\n", lib, sym, $1 / freq / (rps * secs) * 1e9 }' \
        >"$OUT/$mode.tsv"
}

read -r -a modes <<<"$MODES"
for mode in "${modes[@]}"; do
    profile "$mode"
done

for mode in "${modes[@]}"; do
    echo
    echo "== $mode: Redis ns per request by library =="
    awk -F'\t' '{s[$1] += $3; t += $3} END {for (l in s) printf "%8.0f  %s\n", s[l], l; printf "%8.0f  all\n", t}' \
        "$OUT/$mode.tsv" | sort -rn
done

if ((${#modes[@]} == 2)); then
    echo
    echo "== Redis ns per request by function: ${modes[0]}, ${modes[1]}, difference =="
    awk -F'\t' -v top="$TOP" '
        NR == FNR { a[$1 "\t" $2] += $3; next }
        { b[$1 "\t" $2] += $3 }
        END { for (k in b) d[k] = b[k] - a[k]; for (k in a) if (!(k in b)) d[k] = -a[k]
              for (k in d) printf "%8.1f %8.1f %8.1f  %s\n", a[k], b[k], d[k], k }' \
        "$OUT/${modes[0]}.tsv" "$OUT/${modes[1]}.tsv" | sort -k3,3 -rn | head -n "$TOP"
fi
