#!/usr/bin/env bash
# Checks that the Rust version the published crates claim (`rust-version`, set once in the
# workspace) is at least the highest `rust-version` among the packages they depend on, as
# Cargo.lock pins them. Exits 1 naming the packages that need more, and how to fix it.
#
# What counts: the normal dependencies (not dev, not build), direct and transitive, of
# tollgate-engine, tollgate, tollgate-redis and tollgate-cli, with every feature on and on every
# target platform: what some user of some feature on some platform compiles. Examples, tests
# and benchmarks are not counted (they may need more; they are not published).
set -euo pipefail
cd "$(dirname "$0")/.."

cargo metadata --format-version 1 --all-features --quiet | python3 -c '
import collections, json, sys

PUBLISHED = ["tollgate-engine", "tollgate", "tollgate-redis", "tollgate-cli"]

def version(text):
    parts = [int(p) for p in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))

def shown(v):
    return ".".join(map(str, v[:2] if v[2] == 0 else v))

meta = json.load(sys.stdin)
packages = {p["id"]: p for p in meta["packages"]}
nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
members = {packages[i]["name"]: i for i in meta["workspace_members"]}

missing = [name for name in PUBLISHED if name not in members]
if missing:
    sys.exit("msrv-check: not in the workspace: " + ", ".join(missing))

# Each package reached, with the shortest path to it (breadth first).
paths = {}
stack = collections.deque((members[name], [name]) for name in PUBLISHED)
while stack:
    pkg, path = stack.popleft()
    if pkg in paths:
        continue
    paths[pkg] = path
    for dep in nodes[pkg]["deps"]:
        if any(kind["kind"] is None for kind in dep["dep_kinds"]):
            stack.append((dep["pkg"], path + [packages[dep["pkg"]]["name"]]))

# The published crates are what claims, not what needs.
deps = [p for p in paths if p not in members.values() and packages[p].get("rust_version")]
needed = max((version(packages[p]["rust_version"]) for p in deps), default=(0, 0, 0))
highest = sorted(
    " > ".join(paths[p]) + " " + packages[p]["version"]
    for p in deps
    if version(packages[p]["rust_version"]) == needed
)

failed = False
for name in PUBLISHED:
    claimed = packages[members[name]].get("rust_version")
    if claimed is None:
        print(f"msrv-check: {name} has no rust-version; add `rust-version.workspace = true` to its Cargo.toml")
        failed = True
    elif version(claimed) < needed:
        print(f"msrv-check: {name} claims rust-version {claimed}, but its dependencies need {shown(needed)}")
        failed = True
if failed:
    print(f"msrv-check: needing {shown(needed)}:")
    for line in highest:
        print("  " + line)
    print(f"msrv-check: set rust-version = \"{shown(needed)}\" in [workspace.package] of Cargo.toml")
    sys.exit(1)
print(f"msrv-check: ok, rust-version {shown(needed)} needed by {len(highest)} of {len(paths) - len(PUBLISHED)} dependencies, e.g. {highest[0]}")
'
