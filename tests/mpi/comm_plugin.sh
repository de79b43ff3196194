#!/usr/bin/env bash
# headroom.comm/1 on 2 ranks: the C test plugin comm_probe (tests/abi/plugins/comm_probe.c) calls
# every function of the extension from TRAIN_BEGIN, STEP_END and an ALLOC hook of a tiny training
# run under mpirun, and each rank's record must be exactly what 2 ranks give.
#
#   comm_plugin.sh HEADROOM PLUGIN_DIR MPIEXEC
set -euo pipefail
headroom=$1 plugins=$2 mpiexec=$3
work=$(mktemp -d "${TMPDIR:-/tmp}/headroom_comm_plugin.XXXXXX")
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
steps = 2
micro_batch = 1
grad_accum = 2

[[plugins]]
name = "comm_probe"
out = "$work/probe"
TOML

# A hang fails (timeout); so does any rank's failure (mpirun's exit status).
status=0
HEADROOM_PLUGIN_PATH=$plugins timeout 120 "$mpiexec" --allow-run-as-root --oversubscribe -np 2 \
  "$headroom" train cfg.toml -q > run.log 2>&1 || status=$?
[ "$status" -eq 0 ] || { cat run.log >&2; fail "mpirun -np 2 headroom train exited $status"; }

# Rank r's record, without its ALLOC line (where it falls depends on the allocations), and that
# line on its own.
for rank in 0 1; do
  f=probe.rank$rank.txt
  [ -s "$f" ] || fail "rank $rank wrote no $f"
  if [ "$rank" -eq 0 ]; then
    rs_sum="1 3" rs_avg="0.5 1.5"  # block 0: (0 + i + 0) + (0 + i + 1)
  else
    rs_sum="21 23" rs_avg="10.5 11.5"  # block 1: (10 + i + 0) + (10 + i + 1)
  fi
  cat > want.txt <<WANT
create ext=1 size=1 rank=$rank local_rank=$rank world=2
info TRAIN_BEGIN rank=$rank local_rank=$rank world=2 stream_null=1 same_stream=1
all_reduce f32 sum 3 3 3
all_reduce f32 average 1.5 1.5 1.5
all_reduce bf16 sum 3 3 3
all_reduce f16 average 1.5 1.5 1.5
reduce_scatter sum $rs_sum
reduce_scatter average $rs_avg
all_gather 1 10 2 20
broadcast root=1 2 2 2
barrier post=0 wait=0 wait_null=0
invalid dtype=5 op=5 root=5 neg_root=5 out=5
step_end step=1 sum=3 barrier=0
step_end step=2 sum=6 barrier=0
WANT
  grep -v '^alloc ' "$f" > got.txt || true
  diff -u want.txt got.txt >&2 || fail "rank $rank: $f differs from what 2 ranks give"
  want_alloc="alloc rank=$rank world=2 all_reduce=7 reduce_scatter=7 all_gather=7 broadcast=7 barrier=7 wait=7"
  [ "$(grep '^alloc ' "$f")" = "$want_alloc" ] ||
    fail "rank $rank: ALLOC line: got '$(grep '^alloc ' "$f" || true)', want '$want_alloc'"
done
[ ! -e probe.rank2.txt ] || fail "a third rank's record"
echo "comm_plugin: both ranks saw what 2 ranks give"
