#!/usr/bin/env bash
# Compiles every whole program (a ```rust block with `fn main`) in README.md against this
# workspace's crates, as the root package's examples see them, and runs those that do not
# serve. The README's shorter fragments are not programs and are not compiled here.
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-target}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The rlib of each of the root package's direct dependencies, as built for the examples.
cargo build -p tollgate-suite --examples --quiet --message-format=json >"$work/build.json"
cargo metadata --format-version 1 --quiet >"$work/metadata.json"

python3 - "$work" "$target" <<'PY'
import json, os, re, subprocess, sys

work, target = sys.argv[1], sys.argv[2]
rlibs = {}
for line in open(os.path.join(work, "build.json")):
    msg = json.loads(line)
    if msg.get("reason") == "compiler-artifact":
        for f in msg["filenames"]:
            if f.endswith(".rlib"):
                rlibs[msg["package_id"]] = f
meta = json.load(open(os.path.join(work, "metadata.json")))
root = next(p for p in meta["packages"] if p["name"] == "tollgate-suite")["id"]
node = next(n for n in meta["resolve"]["nodes"] if n["id"] == root)
externs = []
for dep in node["deps"]:
    if any(k["kind"] is None for k in dep["dep_kinds"]) and dep["pkg"] in rlibs:
        externs += ["--extern", f"{dep['name']}={rlibs[dep['pkg']]}"]

text = open("README.md").read()
blocks = [(text.count("\n", 0, m.start()) + 2, m.group(1))
          for m in re.finditer(r"^```rust\n(.*?)^```", text, re.S | re.M)]
programs = [(line, code) for line, code in blocks if re.search(r"^\s*(async )?fn main\(", code, re.M)]
if not programs:
    sys.exit("readme-snippets: README.md has no ```rust block with `fn main`")
failed = 0
for line, code in programs:
    src = os.path.join(work, f"readme_{line}.rs")
    exe = os.path.join(work, f"readme_{line}")
    open(src, "w").write(code)
    built = subprocess.run(
        ["rustc", "--edition", "2021", "--crate-type", "bin", "--crate-name", f"readme_{line}",
         "-D", "warnings", "-C", "debuginfo=0", "-L", f"dependency={target}/debug/deps",
         *externs, "-o", exe, src],
        capture_output=True, text=True)
    if built.returncode != 0:
        print(f"README.md:{line}: the program does not compile:\n{built.stderr}")
        failed += 1
        continue
    if "serve(" in code:
        print(f"README.md:{line}: compiles (a server: not run)")
        continue
    ran = subprocess.run([exe], capture_output=True, text=True, timeout=30)
    if ran.returncode != 0:
        print(f"README.md:{line}: exit {ran.returncode}:\n{ran.stdout}{ran.stderr}")
        failed += 1
    else:
        print(f"README.md:{line}: compiles and runs")
sys.exit(1 if failed else 0)
PY
