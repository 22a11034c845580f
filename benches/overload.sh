#!/usr/bin/env bash
# The overload benchmark: a server of known capacity behind each system in turn (no limiter,
# a static concurrency limit, tower-acc's Gradient2, tollgate), each a fresh server, under
# open-loop load (20% critical, 50% default, 30% batch) through the phases steady 0.5x C,
# 3x C, 10x C, after-10x 0.5x C, slow-dep (the handler's dependency twice as slow) 0.8x C,
# after-slow 0.5x C. Prints a table per system and phase, the limiters' CPU per request, and
# ends with two lines: tower-acc's, then tollgate's (`overload: ...`). See docs/benchmarks.md,
# "Overload".
#
#   benches/overload.sh              # about 2.5 minutes once built
#   PHASE_SECS=2 benches/overload.sh # a quick look
#   ROUNDS=3 benches/overload.sh     # every system 3 times, then each figure's median
#
# Settings (environment): MIX (spike: above 0.5x C the extra load is default and batch, critical
# stays at 0.1x C; fixed: 20/50/30 at every load, where 10x C holds twice C of critical alone), ROUNDS (1), PHASE_SECS (5) per phase, WARMUP_SECS (2) at 0.5x C before the
# first, WORKERS (8) and SERVICE_US (20000): the capacity C = WORKERS / SERVICE (400 req/s),
# TIMEOUT_MS (1000) the client's deadline, SYSTEMS ("none static tower-acc tollgate"; none
# always runs, first), SERVER_CPU (0) and LOAD_CPU (1) the CPUs the server and the load
# generator are pinned to (empty: not pinned), SERVER_THREADS (1) and LOAD_THREADS (1) their
# tokio worker threads, QUIET_PCT (20) and QUIET_MAX (5): before each system, wait up to
# QUIET_MAX seconds until the rest of the machine uses under QUIET_PCT% of a CPU, NICE (0) the
# niceness both run at (below 0 needs root: the load is light but wants the CPU on time).
# Only 127.0.0.1 is ever contacted.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
export SERVER_CPU=${SERVER_CPU-0}
LOAD_CPU=${LOAD_CPU-1}
NICE=${NICE:-0}

echo "building overload (release)" >&2
(cd "$ROOT" && cargo build --release -q -p tollgate-bench --bin overload)

# One socket per request in flight at 10x C, on both sides (about 4,000 each at the defaults).
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

run=("$TARGET/release/overload")
if [[ -n $LOAD_CPU ]] && command -v taskset >/dev/null; then
    run=(taskset -c "$LOAD_CPU" "${run[@]}")
fi
if [[ -z $SERVER_CPU ]] || ! command -v taskset >/dev/null; then
    export SERVER_CPU=
fi
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo -), $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
exec nice -n "$NICE" "${run[@]}"
