#!/usr/bin/env bash
# Checks what deploy/ ships: the alert rules load and pass their tests, every expression of
# the dashboards parses, every alert's runbook link names a section of docs/operations.md, and
# every metric the rules and the dashboards name is one tollgate exports (a test takes a
# scrape of examples/llm_chat and compares). Needs promtool (Debian's `prometheus` package)
# and python3.
set -euo pipefail
cd "$(dirname "$0")/.."

promtool check rules deploy/prometheus/*rules.yml
promtool test rules deploy/prometheus/*test*.yml

# Every alert has a test where it fires and one where it must not.
python3 - deploy/prometheus/*rules.yml -- deploy/prometheus/*test*.yml <<'EOF'
import re, sys

split = sys.argv.index("--")
alerts = set()
for path in sys.argv[1:split]:
    with open(path) as f:
        alerts |= set(re.findall(r"^\s*- alert: (\w+)", f.read(), re.M))
fires, quiet = set(), set()
for path in sys.argv[split + 1:]:
    with open(path) as f:
        text = f.read()
    for name, expected in re.findall(r"alertname: (\w+)\n\s*exp_alerts:(.*)", text):
        (quiet if expected.strip() == "[]" else fires).add(name)
bad = [(a, w) for a in sorted(alerts) for w, seen in (("fires", fires), ("does not fire", quiet)) if a not in seen]
for alert, what in bad:
    print("no test where %s %s" % (alert, what))
if bad or not alerts:
    sys.exit(1)
print("alerts: %d, each tested firing and not firing" % len(alerts))
EOF

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Each dashboard expression as a recording rule, so that `promtool check rules` parses it.
# Grafana's variables are replaced by values of their kind first.
python3 - "$tmp/dashboards.rules.yml" deploy/grafana/*.json <<'EOF'
import json, re, sys

out, paths = sys.argv[1], sys.argv[2:]
rules = []

def exprs(node):
    if isinstance(node, dict):
        if isinstance(node.get("expr"), str):
            yield node["expr"]
        for v in node.values():
            yield from exprs(v)
    elif isinstance(node, list):
        for v in node:
            yield from exprs(v)

for path in paths:
    with open(path) as f:
        dashboard = json.load(f)
    for i, expr in enumerate(exprs(dashboard)):
        expr = re.sub(r"\$__(rate_interval|interval|range)", "5m", expr)
        expr = re.sub(r"\$\{?[A-Za-z_]+\}?", ".*", expr)
        rules.append({"record": "dashboard:expr_%d" % len(rules), "expr": expr})
    if not rules:
        sys.exit("%s: no expression found" % path)

with open(out, "w") as f:
    json.dump({"groups": [{"name": "dashboards", "rules": rules}]}, f, indent=1)
print("dashboard expressions: %d" % len(rules))
EOF
promtool check rules "$tmp/dashboards.rules.yml"

# Every runbook link of the rules is docs/operations.md#<a heading of that page>.
python3 - deploy/prometheus/*rules.yml <<'EOF'
import re, sys

with open("docs/operations.md") as f:
    headings = set()
    for line in f:
        m = re.match(r"#+ (.*)", line)
        if m:
            # GitHub's anchors: lower case, punctuation dropped, spaces to hyphens.
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            headings.add(slug)
bad = 0
links = 0
for path in sys.argv[1:]:
    with open(path) as f:
        for n, line in enumerate(f, 1):
            m = re.search(r"runbook_url: \"(.*)\"", line)
            if not m:
                continue
            links += 1
            page, _, anchor = m.group(1).partition("#")
            if page != "docs/operations.md" or anchor not in headings:
                print("%s:%d: %s is no section of docs/operations.md" % (path, n, m.group(1)))
                bad += 1
if bad or not links:
    sys.exit(1)
print("runbook links: %d, each a section of docs/operations.md" % links)
EOF

# The metric names, against a scrape of examples/llm_chat (starts its own redis-server).
cargo test -q -p tollgate-suite --test monitoring
