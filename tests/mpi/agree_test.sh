#!/usr/bin/env bash
# Ranks that disagree (core/run/rank_agreement.h): launched with different --set values or flags,
# every rank exits 2 at start naming the first key that differs and what each rank has for it,
# instead of hanging (train.steps), aborting inside MPI (model.n_embd) or training on with the
# weights of both (train.lr). What may differ per rank (device.threads, data.workers) still runs.
#
#   agree_test.sh HEADROOM MPIEXEC
#
# Every mpirun runs under `timeout`: a hang fails.
set -euo pipefail
headroom=$1 mpiexec=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/headroom_agree.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"
fail() { echo "FAIL: $*" >&2; exit 1; }
# Each rank's output to out.RANK, its exit code to code.RANK; mpirun must not kill a rank when
# another exits non-zero, so that each one's own words are seen.
cat > each_rank.sh <<'SH'
#!/usr/bin/env bash
r=${OMPI_COMM_WORLD_RANK:?}
"$@" > "out.$r" 2>&1
echo $? > "code.$r"
SH
chmod +x each_rank.sh
cat > cfg.toml <<'TOML'
[model]
n_layer = 1
n_head = 2
n_embd = 64
seq_len = 16
vocab_size = 64

[train]
steps = 3
micro_batch = 2
lr = 0.001

[data]
kind = "synthetic"
TOML
cp cfg.toml amp.toml
printf '\n[[plugins]]\nname = "amp"\ndtype = "bf16"\n' >> amp.toml
# ranks "ARGS OF RANK 0" "ARGS OF RANK 1" ...: one rank each, MPMD (mpirun -np 1 A : -np 1 B).
ranks() {
  rm -f out.* code.*
  local spec=() first=1
  for args in "$@"; do
    [ $first = 1 ] || spec+=(":")
    first=0
    # shellcheck disable=SC2206
    spec+=(-np 1 ./each_rank.sh "$headroom" train $args)
  done
  timeout 120 "$mpiexec" --allow-run-as-root --oversubscribe \
    --mca orte_abort_on_non_zero_status 0 "${spec[@]}" || true
  for r in $(seq 0 $(($# - 1))); do
    [ -f "code.$r" ] || fail "rank $r recorded no exit code (a hang ended by timeout?)"
  done
}
# expect_refused N TEXT: every one of N ranks exited 2 and said TEXT.
expect_refused() {
  for r in $(seq 0 $(($1 - 1))); do
    [ "$(cat code.$r)" = 2 ] || { cat out.*; fail "rank $r exited $(cat code.$r), expected 2"; }
    grep -qF -- "$2" "out.$r" || { cat "out.$r"; fail "rank $r did not say: $2"; }
  done
}

ranks "cfg.toml -q --set train.steps=3" "cfg.toml -q --set train.steps=5"
expect_refused 2 "the ranks disagree: rank 1 resolved another run than rank 0's: the first key that differs is train.steps: rank 0 has 3, rank 1 has 5"
ranks "cfg.toml -q --set model.n_embd=64" "cfg.toml -q --set model.n_embd=128"
expect_refused 2 "the first key that differs is model.n_embd: rank 0 has 64, rank 1 has 128"
ranks "cfg.toml -q" "cfg.toml -q --set train.lr=0.002"
expect_refused 2 "the first key that differs is train.lr: rank 0 has 0.001, rank 1 has 0.002"
ranks "amp.toml -q" "amp.toml -q --set plugins.amp.dtype=\"fp16\""
expect_refused 2 "the first key that differs is plugins.amp.dtype: rank 0 has 'bf16', rank 1 has 'fp16'"
ranks "amp.toml -q" "cfg.toml -q"
expect_refused 2 "the first key that differs is plugins.amp.dtype: rank 0 has 'bf16', rank 1 has no such key"
ranks "cfg.toml -q --save-weights w.safetensors" "cfg.toml -q"
expect_refused 2 "the first key that differs is --save-weights: rank 0 has yes, rank 1 has no"
# Three ranks, the last one off.
ranks "cfg.toml -q" "cfg.toml -q" "cfg.toml -q --set train.seed=7"
expect_refused 3 "the ranks disagree: rank 2 resolved another run than rank 0's: the first key that differs is train.seed: rank 0 has 1, rank 2 has 7"
# What may differ per rank runs.
ranks "cfg.toml -q --set device.threads=1" "cfg.toml -q --set data.workers=2 --set data.prefetch=3"
for r in 0 1; do
  [ "$(cat code.$r)" = 0 ] || { cat "out.$r"; fail "rank $r exited $(cat code.$r) with only per-rank keys differing"; }
done
echo "PASS: agree"
