#!/usr/bin/env bash
# ZeRO stages 1, 2 and 3 (the zero plugins) against data parallelism (DDP, core's buckets)
# on the CPU backend, side by side in one run, on gpt2-124m's shapes (n_layer 12, n_head 12,
# n_embd 768, vocab 50257) with a short sequence (seq_len 64) and one sequence a rank a step:
#   1. each rank's tracker bytes by category (parameters, gradients, optimizer, communication)
#      against the closed forms, from the recorder test plugin's ALLOC/FREE events;
#   2. the bytes each rank sends a step (TCP over loopback) against the collectives' theory;
#   3. the median step time of each stage against DDP at the same world size.
#
#   4. zero2's two ways to accumulate micro-steps: peak gradient bytes and bytes sent.
#
#   bench/zero.sh [BUILD]      (default build/; writes nothing but a temporary folder)
#   ZERO_BENCH_PARTS=4 bench/zero.sh build     runs only section 4 (any of 1234)
#
# World sizes 1, 2 and 4; every rank runs OpenBLAS on one thread. The bytes are what the loopback
# interface carries with Open MPI's TCP transport forced (--mca btl self,tcp), per step: the
# difference between a long and a short run over the difference in their steps (as
# bench/distributed.sh), so that start-up traffic cancels out. zero3 runs with its defaults
# (prefetch_layers 1, param_persistence_threshold 100000: the head's LayerNorm stays whole).
set -euo pipefail
build=$(cd "${1:-build}" && pwd)
parts=${ZERO_BENCH_PARTS:-1234}  # which sections to run (all by default)
repo=$(cd "$(dirname "$0")/.." && pwd)
headroom=$build/bin/headroom
rec=$build/tests/plugins/rec_a.so
[ -f "$rec" ] || { echo "zero.sh: $rec is missing (build the tests)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
export OPENBLAS_NUM_THREADS=1
mpirun() { command mpirun --allow-run-as-root --oversubscribe -x OPENBLAS_NUM_THREADS "$@"; }

steps=5        # timing runs: medians over steps 2..5 (step 1 warms up)
short=2 long=4 # bytes runs: (long - short) steps of traffic
C=768 V=50257 T=64 L=12

cat > base.toml <<TOML
# gpt2-124m shapes, seq_len $T, micro_batch 1, AdamW, synthetic data.
[model]
n_layer = $L
n_head = 12
n_embd = $C
seq_len = $T
vocab_size = $V
[train]
steps = $steps
micro_batch = 1
optimizer = "adamw"
lr = 1e-4
[data]
kind = "synthetic"
TOML
cfg() {  # cfg KIND FILE: KIND is ddp, zero1, zero2 or zero3
  cp base.toml "$2"
  [ "$1" = ddp ] || printf '\n[[plugins]]\nname = "%s"\n' "$1" >> "$2"
}
launch() {  # launch N ARGS...: one rank without mpirun, else mpirun -np N
  local n=$1; shift
  if [ "$n" = 1 ]; then "$headroom" "$@"; else mpirun -np "$n" "$headroom" "$@"; fi
}
median() {  # median FILE FIELD over steps 2..
  python3 - "$1" "$2" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][1:]
print(statistics.median(r[sys.argv[2]] for r in rows))
PY
}
tally() {  # tally EVENTS CATEGORY -> "live_at_end peak_from_train_begin at_step_ends"
  awk -v c="$2" -v from=TRAIN_BEGIN -v at=STEP_END -f "$repo/tests/mpi/tally.awk" "$1"
}
closed() {  # closed KIND N RANK -> "params grads grads_peak_bound optimizer comm psi psi_p params_peak_bound gathers"
  python3 - "$@" "$C" "$V" "$T" "$L" <<'PY'
import sys
kind, N, r = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
C, V, T, L = map(int, sys.argv[4:8])
layers = [V * C + T * C] + [12 * C * C + 13 * C] * L + [2 * C]   # embedding, blocks, head
psi = sum(layers)
padded = [-(-n // N) * N for n in layers]
psi_p = sum(padded)
shard = [p // N for p in padded]
mine = [max(0, min(n, (r + 1) * s) - r * s) for n, s in zip(layers, shard)]
sharded = [kind == "zero3" and N > 1 and n >= 100000 for n in layers]
gathers = 0                                   # parameter elements all-gathered a micro-step
if kind == "ddp":
    params, grads, opt = 4 * psi, 4 * psi, 8 * psi
    bound = grads
    comm = 4 * psi if N > 1 else 0            # the all-reduce buckets (none at one rank)
else:
    params = sum(4 * (s if sh else p) for p, s, sh in zip(padded, shard, sharded))
    opt = 8 * sum(mine)                       # AdamW m and v over this rank's real elements
    comm = 0
    if kind == "zero1" or N == 1:             # zero2 and zero3 on one rank partition as zero1
        grads = 4 * psi_p
        bound = grads
    else:
        grads = 4 * sum(shard)                # the gradient shards
        bound = grads + 4 * (padded[0] + 2 * max(padded[1:]))  # + layer 0's and two layers' full
    # zero3's window (prefetch_layers 1): every sharded layer gathered for its forward and its
    # backward, and the embedding once more for the head, which reads its tied wte.
    gathers = sum(2 * p for p, sh in zip(padded, sharded) if sh) + (padded[0] if sharded[0] else 0)
pbound = params + 2 * 4 * max([p for p, sh in zip(padded, sharded) if sh], default=0)
print(params, grads, bound, opt, comm, psi, psi_p, pbound, gathers)
PY
}
ratio() { python3 -c "import sys; a, b = int(sys.argv[1]), int(sys.argv[2]); print('%.4f' % (a / b) if b else ('-' if a == 0 else 'inf'))" "$1" "$2"; }

read -r _ _ _ _ _ psi _ < <(closed ddp 1 0)
echo "gpt2-124m shapes at seq_len $T: Ψ = $psi parameters ($((4 * psi)) fp32 bytes); $T tokens a rank a step"

lo_tx() { awk '/^ *lo:/ {print $10}' /proc/net/dev; }
sent() {  # sent N STEPS [ARGS...] -> bytes all ranks sent over loopback
  local before after n=$1 k=$2
  shift 2
  before=$(lo_tx)
  mpirun --mca btl self,tcp --mca btl_tcp_if_include lo -np "$n" "$headroom" train cfg.toml -q \
    --set train.steps="$k" "$@" >/dev/null
  after=$(lo_tx)
  echo $((after - before))
}

if [[ $parts == *1* ]]; then
# 1. Bytes by category, from the recorder's ALLOC/FREE events of a 2-step run: live at the end
#    (and, for the gradients, the peak), every rank against its closed form.
echo
echo "| config | N | category | measured, rank 0 (end) | formula | ratio | ranks equal to formula |"
echo "|---|---:|---|---:|---:|---:|---:|"
for kind in ddp zero1 zero2 zero3; do
  for n in 1 2 4; do
    cfg "$kind" mem.toml
    printf '\n[[plugins]]\nname = "rec_a"\npath = "%s"\nout = "%s"\nper_rank = %s\nalloc_events = true\n' \
      "$rec" "$work/events" "$([ "$n" = 1 ] && echo false || echo true)" >> mem.toml
    rm -f events events.rank*
    launch "$n" train mem.toml -q --set train.steps=2
    [ "$n" = 1 ] && mv events events.rank0
    # per category: rank 0's measured, the formula, and how many ranks match exactly
    declare -A m0=() f0=() ok=()
    for what in params pends ppeak grads gpeak opt comm; do ok[$what]=0; done
    for ((r = 0; r < n; r++)); do
      read -r fp fg fb fo fc _ psi_p fpb _ < <(closed "$kind" "$n" "$r")
      read -r p ppeak pends < <(tally events.rank$r 0)
      read -r g gpeak _ < <(tally events.rank$r 1)
      read -r o _ < <(tally events.rank$r 2)
      read -r c _ < <(tally events.rank$r 6)
      if [ "$r" = 0 ]; then
        m0=([params]=$p [pends]=$pends [ppeak]=$ppeak [grads]=$g [gpeak]=$gpeak [opt]=$o [comm]=$c)
        f0=([params]=$fp [pends]=$fp [ppeak]=$fpb [grads]=$fg [gpeak]=$fb [opt]=$fo [comm]=$fc)
      fi
      [ "$p" = "$fp" ] && ok[params]=$((ok[params] + 1))
      [ "$pends" = "$fp" ] && ok[pends]=$((ok[pends] + 1))
      [ "$ppeak" -le "$fpb" ] && ok[ppeak]=$((ok[ppeak] + 1))
      [ "$g" = "$fg" ] && ok[grads]=$((ok[grads] + 1))
      [ "$gpeak" -le "$fb" ] && ok[gpeak]=$((ok[gpeak] + 1))
      [ "$o" = "$fo" ] && ok[opt]=$((ok[opt] + 1))
      [ "$c" = "$fc" ] && ok[comm]=$((ok[comm] + 1))
    done
    for what in params pends ppeak grads gpeak opt comm; do
      case $what in
        params) label="parameters" ;;
        pends) [ "$kind" = zero3 ] || continue; label="parameters at every STEP_END" ;;
        ppeak) [ "$kind" = zero3 ] || continue; label="parameters, peak (≤ bound)" ;;
        grads) label="gradients" ;;
        gpeak) [ "$kind" = zero2 ] || [ "$kind" = zero3 ] || continue; label="gradients, peak (≤ bound)" ;;
        opt) label="optimizer" ;;
        comm) label="communication" ;;
      esac
      printf '| %s | %d | %s | %d | %d | %s | %d/%d |\n' "$kind" "$n" "$label" "${m0[$what]}" \
        "${f0[$what]}" "$(ratio "${m0[$what]}" "${f0[$what]}")" "${ok[$what]}" "$n"
    done
  done
done

fi

if [[ $parts == *2* ]]; then
# 2. Bytes each rank sends a step over loopback (TCP forced) against theory.
echo
# theory: ring all-reduce 2(N-1)/N x 4Ψ (DDP); reduce-scatter + all-gather 2(N-1)/N x 4Ψp (zero).
# libnbc: what Open MPI 4.1's libnbc schedules for the non-blocking collectives used here.
# MPI_Ireduce_scatter_block is a binomial reduce of the whole buffer to rank 0, then a linear
# scatter: (N-1) x 4Ψp + (N-1)/N x 4Ψp sent over all ranks; MPI_Iallgather sends (N-1)/N x 4Ψp a
# rank. A rank on average: 4Ψp (N-1)(2N+1)/N^2. DDP's MPI_Iallreduce of large buckets is a ring.
# zero3 replaces the one all-gather of the updated parameters by its window's gathers: (N-1)/N x 4
# bytes x G, G the elements gathered a step (every sharded layer twice, the embedding three times:
# ~2.31Ψ here), so its theory is (N-1)/N x 4(Ψp + G), about 1.66x DDP's on these shapes (1.5x when
# nothing is tied: the paper's figure).
echo "| config | N | bytes sent a rank a step (TCP, loopback) | theory | ratio | libnbc's algorithms | ratio |"
echo "|---|---:|---:|---:|---:|---:|---:|"
for n in 2 4; do
  for kind in ddp zero1 zero2 zero3; do
    cfg "$kind" cfg.toml
    s=$(sent "$n" "$short")
    l=$(sent "$n" "$long")
    per_rank_step=$(( (l - s) / (long - short) / n ))
    read -r _ _ _ _ _ psi psi_p _ gathers < <(closed "$kind" "$n" 0)
    if [ "$kind" = ddp ]; then
      theory=$(( 2 * (n - 1) * 4 * psi / n ))           # ring all-reduce of the gradients
    elif [ "$kind" = zero3 ]; then
      theory=$(( (n - 1) * 4 * (psi_p + gathers) / n )) # reduce-scatter + the window's gathers
    else
      theory=$(( 2 * (n - 1) * 4 * psi_p / n ))         # reduce-scatter + all-gather
    fi
    nbc=$theory
    if [ "$kind" = zero3 ]; then
      nbc=$(( 4 * psi_p * (n - 1) * (n + 1) / (n * n) + (n - 1) * 4 * gathers / n ))
    elif [ "$kind" != ddp ]; then
      nbc=$(( 4 * psi_p * (n - 1) * (2 * n + 1) / (n * n) ))
    fi
    printf '| %s | %d | %d | %d | %s | %d | %s |\n' "$kind" "$n" "$per_rank_step" "$theory" \
      "$(ratio "$per_rank_step" "$theory")" "$nbc" "$(ratio "$per_rank_step" "$nbc")"
  done
done

fi

if [[ $parts == *3* ]]; then
# 3. Step time: median step_ms over steps 2..$steps, default transports.
echo
echo "| N | DDP step (median) | zero1 step | zero1 / DDP | zero2 step | zero2 / DDP | zero3 step | zero3 / DDP |"
echo "|---:|---:|---:|---:|---:|---:|---:|---:|"
for n in 1 2 4; do
  declare -A ms=()
  for kind in ddp zero1 zero2 zero3; do
    cfg "$kind" cfg.toml
    launch "$n" train cfg.toml -q --metrics "$kind.jsonl"
    ms[$kind]=$(median "$kind.jsonl" step_ms)
  done
  row="| $n | $(printf '%.0f' "${ms[ddp]}") ms"
  for kind in zero1 zero2 zero3; do
    row+=" | $(printf '%.0f' "${ms[$kind]}") ms | $(python3 -c "print('%.3f' % (${ms[$kind]} / ${ms[ddp]}))")"
  done
  echo "$row |"
done
fi

# 4. zero2's two ways to accumulate micro-steps (grad_accum 4, N = 2): reduce every micro-step
#    into the shards (DeepSpeed's) or accumulate the full gradients locally and reduce once. The
#    gradient bytes' peak from the recorder, the bytes sent a step as in 2.
if [[ $parts == *4* ]]; then
  echo
  echo "| zero2, N = 2, grad_accum 4 | gradients peak, rank 0 | gradients at the end | sent a rank a step | libnbc's algorithms | ratio |"
  echo "|---|---:|---:|---:|---:|---:|"
  A=4 n=2
  read -r _ _ _ _ _ psi psi_p _ _ < <(closed zero2 "$n" 0)
  for every in true false; do
    cfg zero2 cfg.toml
    printf 'reduce_every_micro_step = %s\n' "$every" >> cfg.toml
    cp cfg.toml mem.toml
    printf '\n[[plugins]]\nname = "rec_a"\npath = "%s"\nout = "%s"\nper_rank = true\nalloc_events = true\n' \
      "$rec" "$work/events" >> mem.toml
    rm -f events events.rank*
    mpirun -np "$n" "$headroom" train mem.toml -q --set train.steps=2 --set train.grad_accum=$A
    read -r g gpeak _ < <(tally events.rank0 1)
    s=$(sent "$n" "$short" --set train.grad_accum=$A)
    l=$(sent "$n" "$long" --set train.grad_accum=$A)
    per_rank_step=$(( (l - s) / (long - short) / n ))
    # libnbc: a reduce-scatter (binomial reduce + scatter) per reduction, one all-gather.
    rs=$(( 4 * psi_p * (n - 1) * (n + 1) / (n * n) ))
    ag=$(( 4 * psi_p * (n - 1) / n ))
    reductions=$([ "$every" = true ] && echo $A || echo 1)
    nbc=$(( reductions * rs + ag ))
    printf '| reduce_every_micro_step = %s | %d | %d | %d | %d | %s |\n' "$every" "$gpeak" "$g" \
      "$per_rank_step" "$nbc" "$(ratio "$per_rank_step" "$nbc")"
  done
fi
