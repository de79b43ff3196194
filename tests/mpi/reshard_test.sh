#!/usr/bin/env bash
# Resharding on resume: a snapshot taken at one world size (sharded by zero1/zero2 or not) resumes
# at another (zero3's parameter shards too), on the CPU backend with the tiny model of zero_test.sh (CI has 2 cores).
#
#   reshard_test.sh HEADROOM COMPARE PLUGIN_DIR MPIEXEC
#
# Every global batch is the same 4 sequences (ranks x micro_batch x grad_accum = 4), so a resumed
# run is held against the unbroken run at its new world size: losses within 1e-6 relative, and
# weights no farther from it than two 1-rank runs that sum the same gradients in other orders are
# from each other. Every mpirun runs under `timeout`: a hang fails.
set -euo pipefail
headroom=$1 compare=$2 mpiexec=$4
work=$(mktemp -d "${TMPDIR:-/tmp}/headroom_reshard.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"
mpirun() { timeout 120 "$mpiexec" --allow-run-as-root --oversubscribe "$@"; }
fail() { echo "FAIL: $*" >&2; exit 1; }

# zero_test.sh's model: no block splits evenly over 2 or 4 ranks (the last rank holds padding).
cat > base.toml <<'TOML'
[model]
n_layer = 2
n_head = 2
n_embd = 10
seq_len = 7
vocab_size = 31

[train]
steps = 6
micro_batch = 1
optimizer = "adamw"
lr = 0.01
seed = 5

[data]
kind = "synthetic"
workers = 0
TOML
# cfg.toml with zero STAGE.
with_zero() { cp base.toml "$2"; printf '\n[[plugins]]\nname = "zero%s"\n' "$1" >> "$2"; }
with_zero 1 z1.toml
with_zero 2 z2.toml
with_zero 3 z3.toml
printf 'param_persistence_threshold = 100\n' >> z3.toml  # the embedding and blocks sharded
ga() { echo "--set train.grad_accum=$1"; }
snap3() { echo "--set snapshot.every=3 --set snapshot.dir=$1"; }
# The steps after 3 of a metrics file, without the timings.
after3() { tail -n 3 "$1" > "$2"; }
"$headroom" train base.toml -q --set train.steps=1 --set train.lr=1e-30 --save-weights init.safetensors
# The references for the weights: the same global batches, summed in two other orders.
"$headroom" train base.toml -q --set train.micro_batch=4 --save-weights mb.safetensors
"$headroom" train base.toml -q $(ga 4) --save-weights ga.safetensors

# check NAME RESUMED UNBROKEN: RESUMED.jsonl (steps 4-6) and .safetensors against UNBROKEN's.
check() {
  after3 "$3.jsonl" "$3.after3.jsonl"
  "$compare" losses "$2.jsonl" "$3.after3.jsonl" 1e-6 || fail "$1: losses"
  "$compare" within "$2.safetensors" "$3.safetensors" mb.safetensors ga.safetensors ||
    fail "$1: weights"
}
# resume NAME RANKS OUT CONFIG ARGS...: resumes from at3 and checks the resharding line.
resume() {
  local name=$1 n=$2 out=$3
  shift 3
  local log
  if [ "$n" = 1 ]; then
    log=$("$headroom" train "$@" --resume at3 --metrics "$out.jsonl" --save-weights "$out.safetensors")
  else
    log=$(mpirun -np "$n" "$headroom" train "$@" --resume at3 --metrics "$out.jsonl" \
      --save-weights "$out.safetensors")
  fi
  grep -q "resumed from at3/step_000000000003.hrsnap (step 3), resharded from $expect_from to $n" \
    <<<"$log" || fail "$name: no resharding line in: $log"
}
take3() { rm -rf at3 && mkdir at3 && cp "$1"/step_000000000003.* at3/; }

# zero2 on 4 ranks (grad_accum 1) and on 2 (grad_accum 2), snapshots at step 3: each rank's part
# holds its shards.
mpirun -np 4 "$headroom" train z2.toml -q $(snap3 s4) --metrics u4.jsonl --save-weights u4.safetensors
mpirun -np 2 "$headroom" train z2.toml -q $(ga 2) $(snap3 s2) --metrics u2.jsonl \
  --save-weights u2.safetensors
# 2 -> 4 ranks (sharded 2 -> sharded 4).
take3 s2
expect_from="2 ranks"
resume "zero2 2 -> 4" 4 r4 z2.toml
check "zero2 2 -> 4" r4 u4
take3 s4
expect_from="4 ranks"
# 4 -> 2 ranks with grad_accum 2 (sharded 4 -> sharded 2).
resume "zero2 4 -> 2" 2 r2 z2.toml $(ga 2)
check "zero2 4 -> 2" r2 u2
# 4 -> 1 rank with grad_accum 4 (zero2 on one rank is unsharded: sharded 4 -> whole).
"$headroom" train z2.toml -q $(ga 4) --metrics u1.jsonl --save-weights u1.safetensors
resume "zero2 4 -> 1" 1 r1 z2.toml $(ga 4)
check "zero2 4 -> 1" r1 u1

# zero3 from 4 ranks: to 2 ranks (grad_accum 2) and to 1 (grad_accum 4, where zero3 shards
# nothing but the optimizer state), against unbroken zero3 runs there.
mpirun -np 4 "$headroom" train z3.toml -q $(snap3 s34) >/dev/null
take3 s34
expect_from="4 ranks"
mpirun -np 2 "$headroom" train z3.toml -q $(ga 2) --metrics u32.jsonl --save-weights u32.safetensors
resume "zero3 4 -> 2" 2 r32 z3.toml $(ga 2)
check "zero3 4 -> 2" r32 u32
"$headroom" train z3.toml -q $(ga 4) --metrics u31.jsonl --save-weights u31.safetensors
resume "zero3 4 -> 1" 1 r31 z3.toml $(ga 4)
check "zero3 4 -> 1" r31 u31

# Plain data parallelism on 2 ranks, resumed on 1 rank.
mpirun -np 2 "$headroom" train base.toml -q $(ga 2) $(snap3 p2) >/dev/null
take3 p2
expect_from="2 ranks"
"$headroom" train base.toml -q $(ga 4) --metrics up1.jsonl --save-weights up1.safetensors
resume "plain 2 -> 1" 1 rp1 base.toml $(ga 4)
check "plain 2 -> 1" rp1 up1

# One rank, resumed on 2 ranks with zero1 (whole -> sharded).
"$headroom" train base.toml -q $(ga 4) $(snap3 p1) >/dev/null
take3 p1
expect_from="1 rank"
mpirun -np 2 "$headroom" train z1.toml -q $(ga 2) --metrics uz1.jsonl --save-weights uz1.safetensors
resume "1 -> zero1 2" 2 rz1 z1.toml $(ga 2)
check "1 -> zero1 2" rz1 uz1

# A rank part missing, and no complete snapshot before it: the snapshot is skipped naming the part
# (resume falls back to the newest complete one, tests/mpi/zero_test.sh), none is left, every
# rank refuses (exit 2), and nothing is written.
take3 s4
rm at3/step_000000000003.rank2.data
for n in 1 2; do
  rm -rf out && mkdir out
  set +e
  if [ $n = 1 ]; then
    log=$("$headroom" train z2.toml -q $(ga 4) --resume at3 $(snap3 out/snaps) \
      --metrics out/m.jsonl --save-weights out/w.safetensors 2>&1)
  else
    log=$(mpirun -np 2 "$headroom" train z2.toml -q $(ga 2) --resume at3 $(snap3 out/snaps) \
      --metrics out/m.jsonl --save-weights out/w.safetensors 2>&1)
  fi
  rc=$?
  set -e
  [ $rc = 2 ] || fail "missing part, $n rank(s): exit $rc, expected 2: $log"
  grep -q "skipping snapshot at3/step_000000000003.hrsnap: incomplete: rank 2's part at3/step_000000000003.rank2.data cannot be opened" \
    <<<"$log" || fail "missing part, $n rank(s): $log"
  grep -q -- "--resume at3: no complete snapshot in it" <<<"$log" || fail "missing part, $n rank(s): $log"
  [ ! -e out/w.safetensors ] && [ ! -s out/m.jsonl ] && [ -z "$(ls -A out/snaps 2>/dev/null)" ] ||
    fail "missing part, $n rank(s): something was written: $(ls -R out)"
done
echo "reshard_test: ok"
