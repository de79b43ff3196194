#!/usr/bin/env bash
# docs/results/planner.md: `plan --measure` against the full run (bench/planner.cpp), and the
# search on examples/demo.toml with its measured ratios. Build first:
#   cmake --build build -j2 --target bench_planner headroom_host test_plugin_per_block
# Usage: bench/planner.sh [--only NAME]   (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
# One thread: on a machine shared with other work, idle OpenMP threads spinning against the load
# make step times erratic (a tiny step 0.03 s one run, 1.8 s the next); one thread times steadily.
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
echo "date: $(date -u +%Y-%m-%d), machine: $(lscpu | grep 'Model name' | sed 's/ *Model name: *//'), $(nproc --all) cores"
echo "command: bench/planner.sh $*"
echo
build/bin/bench_planner --test-plugins "$PWD/build/tests/plugins" "$@"
if [ $# -eq 0 ]; then
  echo
  echo '```'
  /usr/bin/time -f "search wall time: %e s" build/bin/headroom plan examples/demo.toml --measure \
    --search --write /tmp/planner-demo-best.toml
  echo '```'
fi
