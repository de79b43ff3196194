#!/usr/bin/env bash
# headroom.step/1 stop_run on 2 ranks: the early_stop test plugin asks on rank 1 alone, at the
# STEP_END of step 2. Every rank stops after that same step with exit 7: rank 1 naming its plugin
# and reason, rank 0 naming the plugin and the rank that asked; the snapshot of step 2 is whole on
# both ranks, and --resume goes on to the last step.
#
#   stop_test.sh HEADROOM PLUGIN_DIR MPIEXEC
set -euo pipefail
headroom=$1 plugins=$2 mpiexec=$3
work=$(mktemp -d "${TMPDIR:-/tmp}/headroom_stop.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"
fail() { echo "FAIL: $*" >&2; exit 1; }

cat > cfg.toml <<TOML
[model]
n_layer = 1
n_head = 1
n_embd = 8
seq_len = 4
vocab_size = 16

[train]
steps = 4
micro_batch = 1

[snapshot]
every = 1
dir = "$work/snaps"

[[plugins]]
name = "early_stop"
out = "$work/stop"
stop_at_step = 2
only_rank = 1
TOML

launch() {
  HEADROOM_PLUGIN_PATH=$plugins timeout 120 "$mpiexec" --allow-run-as-root --oversubscribe -np 2 \
    "$headroom" train cfg.toml "$@"
}
status=0
launch > run.log 2>&1 || status=$?
[ "$status" -eq 7 ] || { cat run.log >&2; fail "mpirun -np 2 exited $status, not 7"; }
grep -q "rank 1: .*stopped by plugin 'early_stop' after step 2 of 4: asked at the STEP_END of stop_at_step" run.log ||
  grep -q "stopped by plugin 'early_stop' after step 2 of 4: asked at the STEP_END of stop_at_step" run.log ||
  { cat run.log >&2; fail "rank 1 does not name its plugin and reason"; }
grep -q "stopped by plugin 'early_stop' of rank 1 after step 2 of 4 (its reason is in rank 1's output)" run.log ||
  { cat run.log >&2; fail "rank 0 does not name the plugin and the rank that asked"; }
[ -e snaps/step_000000000002.hrsnap ] || { ls -R snaps >&2; fail "no snapshot of step 2"; }
[ ! -e snaps/step_000000000003.hrsnap ] || fail "a snapshot past the stop"

status=0
launch --resume snaps > resume.log 2>&1 || status=$?
[ "$status" -eq 0 ] || { cat resume.log >&2; fail "the resume exited $status"; }
grep -q "step      4/4" resume.log || { cat resume.log >&2; fail "the resume did not reach step 4"; }
echo "PASS: every rank stopped after step 2 with exit 7, naming the plugin; the resume ran to step 4"
