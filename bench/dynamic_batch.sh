#!/usr/bin/env bash
# dynamic_batch, shown on examples/dynamic-batch.toml (docs/results/dynamic-batch.md):
#   1. the file as written (micro_batch 16 x grad_accum 2 under a 56 MiB wall): without the
#      plugin, exit 3; with it, the micro-batch of every step, and the losses against a run
#      configured at 8 x 4 from the start (no wall, no plugin);
#   2. a mid-run squeeze: the wall at 78 MiB (16 fits), the `pressure` test plugin takes 10 MiB
#      at step 6 and 8 MiB more at step 7 (16 no longer fits) and gives both back at step 14;
#      dynamic_batch reactive (headroom_fraction = 0) and proactive (0.05), grow_after = 4, the
#      micro-batch of every step side by side, and the losses against the fixed 16 x 2 run.
#
#   bench/dynamic_batch.sh [BUILD]   (default build/; needs the test plugins: -DHEADROOM_TESTS=ON)
set -euo pipefail
build=$(cd "${1:-build}" && pwd)
repo=$(cd "$(dirname "$0")/.." && pwd)
headroom=$build/bin/headroom
pressure=$build/tests/plugins/pressure.so
[[ -f $pressure ]] || { echo "no $pressure: configure with -DHEADROOM_TESTS=ON and build test_plugin_pressure" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
example=$repo/examples/dynamic-batch.toml
# The example without its [[plugins]] table, with a second [[plugins]] table appended, or both.
sed '/^\[\[plugins\]\]/,$d' "$example" > "$work/bare.toml"
cat "$work/bare.toml" > "$work/squeeze.toml"
cat >> "$work/squeeze.toml" <<TOML
[[plugins]]
name = "pressure"
path = "$pressure"
at_step = 6
bytes = 10485760       # 10 MiB
more_bytes = 8388608   # 8 MiB more at step 7
release_at = 14

[[plugins]]
name = "dynamic_batch"
grow_after = 4
TOML

table() {  # metrics files as columns: step, then micro_batch x grad_accum (restarts) of each
  python3 - "$@" <<'PY'
import json, sys
runs = [[json.loads(l) for l in open(f)] for f in sys.argv[1:]]
for rows in zip(*runs):
    cells = ["%d" % rows[0]["step"]]
    for r in rows:
        cells.append("%d x %d%s" % (r["micro_batch"], r["grad_accum"],
                                    " (%d restart%s)" % (r["restarts"], "" if r["restarts"] == 1 else "s")
                                    if r["restarts"] else ""))
    print("| " + " | ".join(cells) + " |")
PY
}
maxrel() {  # the largest relative difference of the losses of two metrics files
  python3 - "$1" "$2" <<'PY'
import json, sys
a = [json.loads(l)["loss"] for l in open(sys.argv[1])]
b = [json.loads(l)["loss"] for l in open(sys.argv[2])]
assert len(a) == len(b)
print("%.2e" % max(abs(x - y) / abs(y) for x, y in zip(a, b)))
PY
}

echo "## 1. examples/dynamic-batch.toml (16 x 2 under 56 MiB)"
echo
set +e
"$headroom" train "$work/bare.toml" -q > "$work/bare.out" 2>&1
code=$?
set -e
echo "without the plugin: exit $code; $(grep -m1 'out of memory' "$work/bare.out")"
"$headroom" train "$example" --metrics "$work/a.jsonl" > "$work/a.out" 2>&1
grep -E '^step +[0-9]+: ' "$work/a.out" | sed 's/^/    /'
"$headroom" train "$work/bare.toml" -q --set device.memory_limit=0 --set train.micro_batch=8 \
  --set train.grad_accum=4 --metrics "$work/a8.jsonl" > /dev/null
echo
echo "| step | micro_batch x grad_accum |"
echo "| ---: | --- |"
table "$work/a.jsonl"
echo
echo "largest relative loss difference against 8 x 4 from the start: $(maxrel "$work/a.jsonl" "$work/a8.jsonl")"
echo
echo "## 2. mid-run squeeze (16 x 2 under 78 MiB; 10 MiB taken at step 6, 8 MiB more at 7, both back at 14)"
echo
"$headroom" train "$work/squeeze.toml" --set device.memory_limit=78MiB \
  --set plugins.dynamic_batch.headroom_fraction=0 --metrics "$work/r.jsonl" > "$work/r.out" 2>&1
"$headroom" train "$work/squeeze.toml" --set device.memory_limit=78MiB \
  --set plugins.dynamic_batch.headroom_fraction=0.05 --metrics "$work/p.jsonl" > "$work/p.out" 2>&1
"$headroom" train "$work/bare.toml" -q --set device.memory_limit=0 --metrics "$work/f.jsonl" > /dev/null
echo "reactive (headroom_fraction = 0):"
grep -E '^step +[0-9]+: ' "$work/r.out" | sed 's/^/    /'
echo "proactive (headroom_fraction = 0.05):"
grep -E '^step +[0-9]+: ' "$work/p.out" | sed 's/^/    /'
echo
echo "| step | reactive | proactive |"
echo "| ---: | --- | --- |"
table "$work/r.jsonl" "$work/p.jsonl"
echo
echo "largest relative loss difference against 16 x 2 throughout: reactive $(maxrel "$work/r.jsonl" "$work/f.jsonl"), proactive $(maxrel "$work/p.jsonl" "$work/f.jsonl")"
