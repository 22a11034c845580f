#!/usr/bin/env bash
# Every test of the workspace, on a fresh machine: installs redis-server and redis-cli from
# Debian's packages when they are missing (with sudo when not root), then runs
# `cargo test --workspace` (the Redis and Redis Cluster tests start their own servers on free
# loopback ports; the TLS ones with certificates they make) and the layer's test without axum,
# and the Redis backend's unit tests without its `tls` feature. Extra arguments go to
# `cargo test`. The last line sums up the run: `tests: N passed, M failed`.
#
# With Redis installed, `cargo test --workspace` alone is the inner loop.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need+=(redis-tools)
if [ ${#need[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "scripts/test.sh: install ${need[*]} (redis-server and redis-cli on the PATH), then run again" >&2
    exit 1
  fi
  sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  echo "installing: ${need[*]}"
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# Every step runs, even after one fails; the output also goes to a log, from which the last
# line sums up the whole run, as CI's does.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
failed=0
step() {
  "$@" ${extra[@]+"${extra[@]}"} 2>&1 | tee -a "$log" || failed=1
}
extra=("$@")

# The workspace build has tollgate-redis's `tls` feature on (the examples need it), so its
# TLS tests run here.
step cargo test --workspace
# The layer in front of a plain tower service, built without axum.
step cargo test -p tollgate --no-default-features --test no_axum
# What a build without the `tls` feature says of a `rediss://` URL.
step cargo test -p tollgate-redis --lib

# One closing line: the tests passed and failed, and whether a step failed without a test
# failing (a build that broke).
awk -v failed="$failed" '
  /^test result:/ { p += $4; f += $6 }
  END {
    printf "tests: %d passed, %d failed", p, f
    if (failed && f == 0) printf " (a step failed: see above)"
    printf "\n"
  }' "$log"
exit "$failed"
