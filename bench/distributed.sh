#!/usr/bin/env bash
# Data parallelism on the CPU backend, side by side in one run: tokens/s at 1, 2 and 4 ranks, the
# bytes each rank sends per step against the ring all-reduce's 2(N-1)/N x gradient bytes, and the
# share of the gradient all-reduce that overlap hides behind the backward.
#
#   bench/distributed.sh [BUILD]      (default build/; writes nothing but a temporary folder)
#
# Every rank runs OpenBLAS on one thread (OPENBLAS_NUM_THREADS=1), so that ranks are the only
# parallelism being compared. The bytes are what the loopback interface carries with Open MPI's
# TCP transport forced (--mca btl self,tcp), per step: the difference between a long and a short
# run over the difference in their steps, so that start-up traffic cancels out.
set -euo pipefail
build=$(cd "${1:-build}" && pwd)
headroom=$build/bin/headroom
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
export OPENBLAS_NUM_THREADS=1
mpirun() { command mpirun --allow-run-as-root --oversubscribe -x OPENBLAS_NUM_THREADS "$@"; }

cat > tiny.toml <<'TOML'
# gpt2-tiny: 4 blocks, n_embd 128, seq_len 128, byte vocabulary; 4 sequences a rank a step.
[model]
n_layer = 4
n_head = 4
n_embd = 128
seq_len = 128
vocab_size = 256
[train]
steps = 30
micro_batch = 4
optimizer = "adamw"
lr = 1e-3
[data]
kind = "synthetic"
[distributed]
bucket_size = "256KiB"
TOML

# median of a metrics field over steps 3.. (the first two warm up)
median() {  # FILE FIELD
  python3 - "$1" "$2" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][2:]
print(statistics.median(r[sys.argv[2]] for r in rows))
PY
}
params=$("$headroom" train tiny.toml -q --set train.steps=1 --metrics p.jsonl >/dev/null 2>&1;
         python3 -c "import json;print(json.loads(open('p.jsonl').readline())['mem_peak_by_category']['parameters']//4)")
grad_bytes=$((params * 4))

echo "gpt2-tiny: $params parameters, $grad_bytes gradient bytes a step; 4 x 128 tokens a rank a step"
echo
echo "| ranks | step time (median) | tokens/s (all ranks) | vs 1 rank | comm wait, overlap on | comm wait, overlap off | hidden |"
echo "|---:|---:|---:|---:|---:|---:|---:|"
base=""
for n in 1 2 4; do
  if [ "$n" = 1 ]; then run=("$headroom"); else run=(mpirun -np "$n" "$headroom"); fi
  "${run[@]}" train tiny.toml -q --metrics on.jsonl
  "${run[@]}" train tiny.toml -q --metrics off.jsonl --set distributed.overlap=false
  ms=$(median on.jsonl step_ms)
  tps=$(python3 -c "print(round($n * 4 * 128 / ($ms / 1000.0)))")
  [ -z "$base" ] && base=$tps
  on=$(median on.jsonl comm_wait_ms)
  off=$(median off.jsonl comm_wait_ms)
  hidden=$(python3 -c "print('-' if $n == 1 or $off <= 0 else '%.2f' % max(0.0, 1 - $on / $off))")
  printf '| %d | %.1f ms | %d | %.2f | %.2f ms | %.2f ms | %s |\n' "$n" "$ms" "$tps" \
    "$(python3 -c "print($tps / $base)")" "$on" "$off" "$hidden"
done

echo
echo "| ranks | bytes sent a rank a step (TCP, loopback) | ring all-reduce 2(N-1)/N x $grad_bytes | ratio |"
echo "|---:|---:|---:|---:|"
lo_tx() { awk '/^ *lo:/ {print $10}' /proc/net/dev; }
for n in 2 4; do
  sent() {  # STEPS -> bytes all ranks sent over loopback
    local before after
    before=$(lo_tx)
    mpirun --mca btl self,tcp --mca btl_tcp_if_include lo -np "$n" "$headroom" train tiny.toml -q \
      --set train.steps="$1" >/dev/null
    after=$(lo_tx)
    echo $((after - before))
  }
  short=$(sent 2)
  long=$(sent 12)
  per_rank_step=$(( (long - short) / 10 / n ))
  ring=$(( 2 * (n - 1) * grad_bytes / n ))
  printf '| %d | %d | %d | %.2f |\n' "$n" "$per_rank_step" "$ring" \
    "$(python3 -c "print($per_rank_step / $ring)")"
done

# A timeline of one step's last micro-step on rank 0 (2 ranks): each layer's backward and each
# bucket's launch and wait, in milliseconds from the step's start. The recorder test plugin
# (tests/abi/plugins/recorder.c, built with the tests) writes the events with their times.
rec=$build/tests/plugins/rec_a.so
if [ -f "$rec" ]; then
  cat > timeline.toml <<TOML
$(cat tiny.toml)

[[plugins]]
name = "rec_a"
path = "$rec"
out = "$work/events"
per_rank = true
times = true
TOML
  mpirun -np 2 "$headroom" train timeline.toml -q --set train.steps=6 --set train.grad_accum=2
  echo
  echo "Step 6, micro-step 2, rank 0 (ms from STEP_BEGIN; bytes of each bucket):"
  echo
  echo '```'
  awk '
    / STEP_BEGIN step=6 / { for (i = 1; i <= NF; i++) if ($i ~ /^t=/) t0 = substr($i, 3); on = 1 }
    on && (/micro=2/ || / GRADS_READY / || / BUCKET_DONE /) && (/BACKWARD_END/ || /BUCKET_/ || / GRADS_READY /) {
      t = ""; b = ""
      for (i = 1; i <= NF; i++) { if ($i ~ /^t=/) t = substr($i, 3); if ($i ~ /^bytes=/) b = $i }
      printf "%8.2f  %-13s %s%s\n", t - t0, $2, $5, (b == "" ? "" : " " b)
    }
    / GRADS_READY step=6 / { on = 0 }
  ' "$work/events.rank0"
  echo '```'
fi
