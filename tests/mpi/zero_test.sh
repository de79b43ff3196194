#!/usr/bin/env bash
# zero1, zero2 and zero3 across ranks, on the CPU backend with tiny models (CI has 2 cores).
#
#   zero_test.sh PART HEADROOM COMPARE PLUGIN_DIR MPIEXEC
#
# PART: bytes | equivalence | resume | advice | demo | errors | llama. Every mpirun runs under `timeout`: a hang
# fails.
set -euo pipefail
part=$1 headroom=$2 compare=$3 plugins=$4 mpiexec=$5
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/headroom_zero.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"
mpirun() { timeout 120 "$mpiexec" --allow-run-as-root --oversubscribe "$@"; }
fail() { echo "FAIL: $*" >&2; exit 1; }

# n_embd 10 with vocab 31 and seq_len 7: the embedding has 380 elements, each block 1330 and the
# head 20, so a block does not split evenly over 2 or 4 ranks (its last rank holds padding).
cat > base.toml <<'TOML'
[model]
n_layer = 2
n_head = 2
n_embd = 10
seq_len = 7
vocab_size = 31

[train]
steps = 20
micro_batch = 2
optimizer = "adamw"
lr = 0.01
seed = 5

[data]
kind = "synthetic"
workers = 0
TOML
# cfg.toml with zero STAGE (and more lines appended by the caller). zero3 keeps only the head (20
# elements) whole: the embedding and the blocks have their parameters sharded.
with_zero() {
  cp base.toml "$2"
  printf '\n[[plugins]]\nname = "zero%s"\n' "$1" >> "$2"
  if [ "$1" = 3 ]; then printf 'param_persistence_threshold = 100\n' >> "$2"; fi
}
"$headroom" train base.toml -q --set train.steps=1 --set train.lr=1e-30 --save-weights init.safetensors

case $part in
bytes)
  # Every rank's tracker, by category, at the end of a run (what stays: parameters, gradients,
  # optimizer state) against the closed forms, for N = 1, 2, 4, each stage, fp32 and amp bf16.
  # The recorder plugin logs every ALLOC and FREE with its category; the peak of the full
  # gradients (zero2) is bounded too.
  closed() {  # closed STAGE N RANK AMP -> "params grads optimizer grads_peak_bound params_peak_bound"
    python3 - "$@" <<'PY'
import sys
stage, N, r, amp = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
C, V, T, L = 10, 31, 7, 2
layers = [V * C + T * C] + [12 * C * C + 13 * C] * L + [2 * C]   # embedding, blocks, head
padded = [-(-n // N) * N for n in layers]
shard = [p // N for p in padded]
es = 2 if amp else 0                                              # the compute copies' bytes
sharded = [stage == 3 and N > 1 and n >= 100 for n in layers]    # param_persistence_threshold
# Whole: the masters (fp32), or with amp the compute copy and this rank's range of the masters
# (they are optimizer state then); sharded (zero3): this rank's range of both.
params = sum((4 + es) * s if sh else (es * p + 4 * s if amp else 4 * p)
             for p, s, sh in zip(padded, shard, sharded))
# zero3 gathers into the dtype the layers read (the compute copy's with amp); prefetch_layers 1:
# at most two computations' layers at once, each reading one sharded layer (the head is whole).
gathered = (es if amp else 4) * max([p for p, sh in zip(padded, sharded) if sh], default=0)
# zero3's runs snapshot every step: with amp (the fp32 masters sharded, also over one rank) each
# layer's full masters are gathered for it in turn, one at a time.
snapshot = 4 * max(padded) if stage == 3 and amp else 0
params_bound = params + max(2 * gathered, snapshot)
mine = [max(0, min(n, (r + 1) * s) - r * s) for n, s in zip(layers, shard)]
opt = sum(8 * m for m in mine)                                    # AdamW m and v
if stage == 1 or N == 1:                                          # zero2 on one rank is zero1
    grads = sum(4 * p for p in padded)                            # fp32, accumulated
    # plus, during a backward with amp: that layer's and the tied wte's bf16 gradients
    bound = grads + es * (padded[0] + max(padded[1:]))
else:
    grads = sum(4 * s for s in shard)                             # the gradient shards
    # plus, during a backward: layer 0's full gradients (the tied wte) and two adjacent layers'
    bound = grads + (4 + es) * (padded[0] + 2 * max(padded[1:]))
print(params, grads, opt, bound, params_bound)
PY
  }
  tally() {  # tally EVENTS CATEGORY -> "live_at_end peak_from_train_begin live_at_step_ends"
    awk -v c="$2" -v from=TRAIN_BEGIN -v at=STEP_END -f "$here/tally.awk" "$1"
  }
  for amp in 0 1; do
    for stage in 1 2 3; do
      with_zero $stage cfg.toml
      [ $amp = 1 ] && printf '\n[[plugins]]\nname = "amp"\ndtype = "bf16"\n' >> cfg.toml
      printf '\n[[plugins]]\nname = "rec_a"\npath = "%s"\nout = "%s"\nper_rank = true\nalloc_events = true\n' \
        "$plugins/rec_a.so" "$work/events" >> cfg.toml
      for n in 1 2 4; do
        rm -rf events events.rank* snaps
        # zero3 snapshots every step: the full masters are gathered one layer at a time for them,
        # within the same bound.
        snap=()
        [ $stage = 3 ] && snap=(--set snapshot.every=1 --set snapshot.dir=snaps)
        if [ $n = 1 ]; then
          sed 's/per_rank = true/per_rank = false/' cfg.toml > one.toml
          "$headroom" train one.toml -q --set train.steps=2 "${snap[@]}"
          mv events events.rank0
        else
          mpirun -np $n "$headroom" train cfg.toml -q --set train.steps=2 "${snap[@]}"
        fi
        for ((r = 0; r < n; r++)); do
          read -r params grads opt bound pbound < <(closed $stage $n $r $amp)
          what="zero$stage amp=$amp N=$n rank $r"
          read -r p ppeak pends < <(tally events.rank$r 0)
          read -r g gpeak _ < <(tally events.rank$r 1)
          read -r o _ < <(tally events.rank$r 2)
          [ "$p" = "$params" ] || fail "$what: parameters $p bytes, closed form $params"
          [ "$g" = "$grads" ] || fail "$what: gradients $g bytes, closed form $grads"
          [ "$o" = "$opt" ] || fail "$what: optimizer $o bytes, closed form $opt"
          [ "$gpeak" -le "$bound" ] || fail "$what: gradients peaked at $gpeak > $bound bytes"
          # Memory fully re-partitioned after every step: at each STEP_END only the shards and
          # the whole layers; in between, at most two gathered layers on top (zero3).
          [ "$pends" = "$params" ] ||
            fail "$what: parameters at the STEP_ENDs $pends bytes, closed form $params"
          [ "$ppeak" -le "$pbound" ] || fail "$what: parameters peaked at $ppeak > $pbound bytes"
          if [ $stage = 3 ] && [ $n -gt 1 ]; then
            [ "$ppeak" -gt "$params" ] || fail "$what: zero3 never gathered a layer"
          fi
        done
      done
    done
  done
  ;;
equivalence)
  # Against the data-parallel run (core's buckets) of the same config: 2 ranks, and 4 ranks with
  # grad_accum 2. Where the sums are the same sums, bitwise; zero2's DeepSpeed-style reduction of
  # every micro-step adds the ranks' averages micro-step by micro-step instead of reducing their
  # sum once, which rounds differently: losses within 1e-6 relative, and the weights no farther
  # from the DDP run's than two 1-rank runs that sum in other orders are from each other.
  # stages_bitwise N REF: every stage on N ranks ends where REF (.jsonl, .safetensors) ends.
  stages_bitwise() {
    for stage in 1 2 3; do
      with_zero $stage z.toml
      mpirun -np "$1" "$headroom" train z.toml -q --metrics z.jsonl --save-weights z.safetensors
      "$compare" losses z.jsonl "$2.jsonl" 0 || fail "zero$stage, $1 ranks: losses"
      "$compare" weights z.safetensors "$2.safetensors" init.safetensors 0 ||
        fail "zero$stage, $1 ranks: weights (the padding must never reach them)"
    done
  }
  mpirun -np 2 "$headroom" train base.toml -q --metrics d2.jsonl --save-weights d2.safetensors
  stages_bitwise 2 d2
  # With checkpoint (every block recomputed) and defrag_allocator as well: still bitwise.
  printf '\n[[plugins]]\nname = "checkpoint"\npolicy = "every"\n\n[[plugins]]\nname = "defrag_allocator"\n' \
    > cd.part
  for stage in 1 2 3; do
    with_zero $stage z.toml
    cat cd.part >> z.toml
    mpirun -np 2 "$headroom" train z.toml -q --metrics z.jsonl --save-weights z.safetensors
    "$compare" weights z.safetensors d2.safetensors init.safetensors 0 ||
      fail "zero$stage + checkpoint + defrag_allocator, 2 ranks: weights"
  done
  # zero3 without prefetching, and with every layer sharded (the head too, tied to layer 0).
  with_zero 3 z.toml
  mpirun -np 2 "$headroom" train z.toml -q --set plugins.zero3.prefetch_layers=0 \
    --set plugins.zero3.param_persistence_threshold=0 --save-weights z.safetensors
  "$compare" weights z.safetensors d2.safetensors init.safetensors 0 ||
    fail "zero3, prefetch_layers 0, every layer sharded: weights"
  # amp bf16: the sums are the data-parallel run's, so bitwise too.
  printf '\n[[plugins]]\nname = "amp"\ndtype = "bf16"\n' > bf16.part
  cat base.toml bf16.part > db.toml
  mpirun -np 2 "$headroom" train db.toml -q --metrics db.jsonl --save-weights db.safetensors
  with_zero 3 z.toml
  cat bf16.part >> z.toml
  mpirun -np 2 "$headroom" train z.toml -q --metrics z.jsonl --save-weights z.safetensors
  "$compare" losses z.jsonl db.jsonl 0 || fail "zero3 + amp bf16, 2 ranks: losses"
  "$compare" weights z.safetensors db.safetensors init.safetensors 0 ||
    fail "zero3 + amp bf16, 2 ranks: weights"
  # 4 ranks, one micro-step a step: every stage's sums are the data-parallel run's, bitwise.
  mpirun -np 4 "$headroom" train base.toml -q --metrics d41.jsonl --save-weights d41.safetensors
  stages_bitwise 4 d41
  ga=(--set train.micro_batch=1 --set train.grad_accum=2)
  mpirun -np 4 "$headroom" train base.toml -q "${ga[@]}" --metrics d4.jsonl \
    --save-weights d4.safetensors
  with_zero 1 z.toml
  mpirun -np 4 "$headroom" train z.toml -q "${ga[@]}" --metrics z.jsonl --save-weights z.safetensors
  "$compare" losses z.jsonl d4.jsonl 0 || fail "zero1, 4 ranks: losses"
  "$compare" weights z.safetensors d4.safetensors init.safetensors 0 || fail "zero1, 4 ranks: weights"
  "$headroom" train base.toml -q --set train.micro_batch=8 --save-weights mb.safetensors
  "$headroom" train base.toml -q --set train.micro_batch=1 --set train.grad_accum=8 \
    --save-weights ga.safetensors
  for stage in 2 3; do
    with_zero $stage z.toml
    mpirun -np 4 "$headroom" train z.toml -q "${ga[@]}" \
      --set plugins.zero$stage.reduce_every_micro_step=false --metrics z.jsonl --save-weights z.safetensors
    "$compare" losses z.jsonl d4.jsonl 0 || fail "zero$stage (local accumulation), 4 ranks: losses"
    "$compare" weights z.safetensors d4.safetensors init.safetensors 0 ||
      fail "zero$stage (local accumulation), 4 ranks: weights"
    mpirun -np 4 "$headroom" train z.toml -q "${ga[@]}" --metrics z.jsonl --save-weights z.safetensors
    "$compare" losses z.jsonl d4.jsonl 1e-6 || fail "zero$stage, 4 ranks: losses"
    "$compare" within z.safetensors d4.safetensors mb.safetensors ga.safetensors ||
      fail "zero$stage, 4 ranks: weights"
  done
  # amp fp16 with a loss scale that overflows at first: the ranks agree to skip the same steps as
  # the data-parallel run, and end bitwise where it ends.
  printf '\n[[plugins]]\nname = "amp"\ndtype = "fp16"\ninit_scale = 1e30\nhysteresis = 1\n' > amp.part
  cat base.toml amp.part > da.toml
  mpirun -np 2 "$headroom" train da.toml -q --metrics da.jsonl --save-weights da.safetensors
  grep -q '"skipped_steps":[1-9]' da.jsonl || fail "amp fp16 at init_scale 1e30 skipped no step"
  with_zero 2 z.toml
  cat amp.part >> z.toml
  mpirun -np 2 "$headroom" train z.toml -q --metrics z.jsonl --save-weights z.safetensors
  "$compare" losses z.jsonl da.jsonl 0 || fail "zero2 + amp fp16: losses"
  [ "$(grep -o '"skipped_steps":[0-9]*' z.jsonl | tail -1)" = \
    "$(grep -o '"skipped_steps":[0-9]*' da.jsonl | tail -1)" ] || fail "zero2 + amp fp16: skips"
  "$compare" weights z.safetensors da.safetensors init.safetensors 0 || fail "zero2 + amp fp16: weights"
  # zero3 with a scale that overflows for some steps, not all: the same skips, bitwise.
  scale=(--set plugins.amp.init_scale=1e8)
  mpirun -np 2 "$headroom" train da.toml -q "${scale[@]}" --metrics da.jsonl --save-weights da.safetensors
  with_zero 3 z.toml
  cat amp.part >> z.toml
  mpirun -np 2 "$headroom" train z.toml -q "${scale[@]}" --metrics z.jsonl --save-weights z.safetensors
  skips=$(grep -o '"skipped_steps":[0-9]*' da.jsonl | tail -1)
  [ "$skips" != '"skipped_steps":0' ] && [ "$skips" != '"skipped_steps":20' ] ||
    fail "amp fp16 at init_scale 1e8: $skips (some steps, not all, should skip)"
  [ "$(grep -o '"skipped_steps":[0-9]*' z.jsonl | tail -1)" = "$skips" ] || fail "zero3 + amp fp16: skips"
  "$compare" weights z.safetensors da.safetensors init.safetensors 0 || fail "zero3 + amp fp16: weights"
  ;;
resume)
  # A zero2 run snapshotted at step 10 (each rank's optimizer shards in its part) and resumed
  # matches the unbroken run bitwise. Resumed without the zero plugin (resharded: sharded -> whole
  # on the same 2 ranks), it continues as the data-parallel run, still bitwise; another optimizer
  # is refused, saying why. (Other world sizes: reshard_test.sh.)
  with_zero 2 z.toml
  mpirun -np 2 "$headroom" train z.toml -q --set snapshot.every=10 --set snapshot.dir=snaps \
    --save-weights full.safetensors
  mkdir at10
  cp snaps/step_000000000010.* at10/
  mpirun -np 2 "$headroom" train z.toml -q --resume at10 --save-weights resumed.safetensors
  cmp full.safetensors resumed.safetensors || fail "resumed weights differ from the unbroken run's"
  out=$(mpirun -np 2 "$headroom" train base.toml --resume at10 --save-weights plain.safetensors)
  grep -q "resumed from at10/step_000000000010.hrsnap (step 10), resharded from 2 ranks to 2" \
    <<<"$out" || fail "resume without zero2: $out"
  cmp full.safetensors plain.safetensors || fail "resumed without zero2: weights differ"
  # zero3 with amp bf16: every rank's parameter shards, gathered whole into the snapshot and cut
  # again on load.
  with_zero 3 z3.toml
  printf '\n[[plugins]]\nname = "amp"\ndtype = "bf16"\n' >> z3.toml
  mpirun -np 2 "$headroom" train z3.toml -q --set snapshot.every=10 --set snapshot.dir=snaps3 \
    --save-weights full3.safetensors
  mkdir at10z3
  cp snaps3/step_000000000010.* at10z3/
  mpirun -np 2 "$headroom" train z3.toml -q --resume at10z3 --save-weights resumed3.safetensors
  cmp full3.safetensors resumed3.safetensors || fail "zero3 + amp: resumed weights differ"
  # A rank's part missing, or cut short: the resume falls back to the newest complete snapshot,
  # saying which it skipped and why, and continues from there as the unbroken run does, bitwise.
  mpirun -np 2 "$headroom" train z3.toml -q --set train.steps=15 --set snapshot.every=5 \
    --set snapshot.keep=5 --set snapshot.dir=snaps3b
  mpirun -np 2 "$headroom" train z3.toml -q --set train.steps=20 --save-weights unbroken20.safetensors
  rm -rf fb && cp -r snaps3b fb && rm fb/step_000000000015.rank1.data
  out=$(mpirun -np 2 "$headroom" train z3.toml --set train.steps=20 --resume fb \
    --save-weights fb.safetensors 2>&1) || fail "resume past a missing part: $out"
  grep -q "headroom: warning: skipping snapshot fb/step_000000000015.hrsnap: incomplete: rank 1's part fb/step_000000000015.rank1.data cannot be opened" <<<"$out" ||
    fail "no line says which snapshot was skipped and why: $out"
  [ "$(grep -c "warning: skipping" <<<"$out")" = 1 ] || fail "the warning is rank 0's alone: $out"
  grep -q "resumed from fb/step_000000000010.hrsnap (step 10)" <<<"$out" || fail "not from step 10: $out"
  cmp unbroken20.safetensors fb.safetensors || fail "resumed past a missing part: weights differ"
  head -c 100 snaps3b/step_000000000010.rank0.data > fb/step_000000000010.rank0.data
  out=$(mpirun -np 2 "$headroom" train z3.toml --set train.steps=20 --resume fb \
    --save-weights fb5.safetensors 2>&1) || fail "resume past a truncated part: $out"
  grep -q "skipping snapshot fb/step_000000000010.hrsnap: incomplete: rank 0's part fb/step_000000000010.rank0.data is damaged" <<<"$out" ||
    fail "the truncated part is not named: $out"
  grep -q "resumed from fb/step_000000000005.hrsnap (step 5)" <<<"$out" || fail "not from step 5: $out"
  cmp unbroken20.safetensors fb5.safetensors || fail "resumed past a truncated part: weights differ"
  set +e
  out=$(mpirun -np 2 "$headroom" train z.toml -q --resume at10 --set train.optimizer=sgd 2>&1); rc=$?
  set -e
  [ $rc != 0 ] && grep -q "optimizer adamw sharded over 2 ranks, this config uses sgd" <<<"$out" ||
    fail "resume with sgd: exit $rc: $out"
  ;;
advice)
  # One rank out of memory where the model state does not fit but would on more ranks: the report
  # names zero2 on 4 ranks (at 4 a rank needs 4.47 MiB, under 4.60) and how to
  # launch it; its table appended and launched as printed, every rank trains within the limit.
  # (zero1 fits only on 8.)
  cat > adv.toml <<'TOML'
[model]
n_layer = 4
n_head = 4
n_embd = 96
seq_len = 16
vocab_size = 256

[train]
steps = 2
micro_batch = 1
optimizer = "adamw"

[device]
memory_limit = 4823449

[data]
kind = "synthetic"
workers = 0
TOML
  set +e
  out=$("$headroom" train adv.toml -q 2>&1); rc=$?
  set -e
  [ $rc = 3 ] || fail "one rank: exit $rc, not out of memory: $out"
  grep -q "^  - zero2: ZeRO stage 2 on 4 ranks: gradients and optimizer state sharded$" <<<"$out" ||
    fail "the advice names no zero2 on 4 ranks: $out"
  grep -q "^  - zero1: ZeRO stage 1 on 8 ranks: optimizer state sharded$" <<<"$out" ||
    fail "the advice names no zero1 on 8 ranks: $out"
  # zero2's remedy as printed: the table to append and the launch line.
  remedy=$(awk '/^  - /{on = index($0, "  - zero2:") == 1} on' <<<"$out")
  table=$(awk '/^    append to the config:/{t = 1; next} /^    [^ ]/{t = 0} t {sub(/^      /, ""); print}' <<<"$remedy")
  launch=$(awk '/^    launch on 4 ranks /{getline; sub(/^ +/, ""); print}' <<<"$remedy")
  [ "$table" = $'[[plugins]]\nname = "zero2"' ] || fail "zero2's table: $table"
  [ "$launch" = "mpirun -np 4 headroom train adv.toml" ] || fail "zero2's launch line: $launch"
  printf '\n%s\n' "$table" >> adv.toml
  read -r -a argv <<<"$launch"
  [ "${argv[0]} ${argv[1]} ${argv[2]} ${argv[3]}" = "mpirun -np 4 headroom" ] || fail "$launch"
  mpirun -np 4 "$headroom" "${argv[@]:4}" -q || fail "zero2 on 4 ranks as advised did not train"
  ;;
demo)
  # examples/zero-demo.toml: out of memory on one rank, with advice naming zero3 on 4 ranks and
  # the launch line; trains on 4 ranks within its memory_limit; without its [[plugins]] table the
  # plan names every stage with its ranks.
  demo=$here/../../examples/zero-demo.toml
  set +e
  out=$("$headroom" train "$demo" -q --set train.steps=3 2>&1); rc=$?
  set -e
  [ $rc = 3 ] || fail "zero-demo on one rank: exit $rc, not out of memory: $out"
  grep -q "^  - zero3: ZeRO stage 3 on 4 ranks: parameters, gradients and optimizer state sharded" \
    <<<"$out" && grep -q "^      mpirun -np 4 headroom train $demo$" <<<"$out" ||
    fail "zero-demo's advice names no zero3 on 4 ranks: $out"
  out=$(mpirun -np 4 "$headroom" train "$demo" --set train.steps=3 2>&1) ||
    fail "zero-demo on 4 ranks did not train: $out"
  grep -q "rank 0: memory report: peak 23.87 MiB of memory_limit 32.00 MiB" <<<"$out" ||
    fail "zero-demo on 4 ranks: $out"
  sed '/^\[\[plugins\]\]/,$d' "$demo" > nozero.toml
  out=$("$headroom" plan nozero.toml 2>&1) || true
  for want in "zero1: ZeRO stage 1 on 4 ranks" "zero2: ZeRO stage 2 on 4 ranks" \
    "zero3: ZeRO stage 3 on 4 ranks"; do
    grep -q "^  - $want" <<<"$out" || fail "zero-demo without zero3: the plan names no $want: $out"
  done
  ;;
errors)
  # Two zero plugins: a config error naming both. A zero plugin with an optimizer-role plugin: the
  # optimizer's state is its own and cannot be partitioned.
  with_zero 1 z.toml
  printf '\n[[plugins]]\nname = "zero2"\n' >> z.toml
  set +e
  out=$("$headroom" train z.toml -q 2>&1); rc=$?
  set -e
  [ $rc = 2 ] && grep -q "both 'zero1' .* and 'zero2' provide the gradient.reduction role" <<<"$out" ||
    fail "two zero plugins: exit $rc: $out"
  with_zero 2 z.toml
  printf '\n[[plugins]]\nname = "plain_sgd"\npath = "%s"\n' "$plugins/plain_sgd.so" >> z.toml
  set +e
  out=$("$headroom" train z.toml -q 2>&1); rc=$?
  set -e
  [ $rc != 0 ] && grep -q "optimizer-role plugin keeps its own state" <<<"$out" ||
    fail "zero2 with an optimizer plugin: exit $rc: $out"
  # A sharding plugin that forgets its policy (tests/abi/plugins/lazy_shard.c): the host's checks
  # stop the run (exit 1) naming it, the layers and the service it should have called.
  lazy() {
    cp base.toml z.toml
    printf '\n[[plugins]]\nname = "lazy_shard"\npath = "%s"\n' "$plugins/lazy_shard.so" >> z.toml
    set +e
    out=$("$headroom" train z.toml -q --set train.steps=2 "$@" 2>&1); rc=$?
    set -e
  }
  lazy
  [ $rc = 1 ] && grep -q "plugin 'lazy_shard' .* did not reduce layer(s) 0, 1, 2, 3 before GRADS_READY" <<<"$out" ||
    fail "a plugin that never reduces: exit $rc: $out"
  lazy --set plugins.lazy_shard.reduce=true
  [ $rc = 1 ] && grep -q "did not gather layer(s) 0, 1, 2, 3 after the update, by STEP_END" <<<"$out" ||
    fail "a plugin that never gathers: exit $rc: $out"
  lazy --set plugins.lazy_shard.reduce=true --set train.grad_accum=2
  [ $rc = 1 ] && grep -q "reduced once, in the step's last micro-step (this is micro-step 1 of 2)" <<<"$out" ||
    fail "an unsharded reduction before the last micro-step: exit $rc: $out"
  # Parameters sharded (zero3's bits): one never gathered before its forward, and gathered ones
  # left at the end of a step, on 2 ranks. Each rank's check fails alike, but a rank still waiting
  # in a collective when its peer's notice comes stops with 6 instead (docs/guide/exit-codes.md), and
  # mpirun exits with the code of whichever rank ends first: 1 or 6, with some rank's own message.
  lazy_np2() {
    cp base.toml z.toml
    printf '\n[[plugins]]\nname = "lazy_shard"\npath = "%s"\nparameters = "%s"\n' \
      "$plugins/lazy_shard.so" "$1" >> z.toml
    set +e
    out=$(mpirun -np 2 "$headroom" train z.toml -q --set train.steps=2 2>&1); rc=$?
    set -e
  }
  # own TEXT: some rank said TEXT of its own failure, not only of a peer's ("stopping: rank N ...").
  own() { grep -v "stopping: rank" <<<"$out" | grep -q "$1"; }
  lazy_np2 never_gather
  { [ $rc = 1 ] || [ $rc = 6 ]; } &&
    own "plugin 'lazy_shard' shards the parameters but did not gather layer 0's before layer 0's forward" ||
    fail "a plugin that never gathers parameters: exit $rc: $out"
  lazy_np2 never_release
  { [ $rc = 1 ] || [ $rc = 6 ]; } && own "left layer(s) 0, 1, 2, 3 gathered at the end of STEP_END" ||
    fail "a plugin that never releases parameters: exit $rc: $out"
  # Out of memory inside zero3's gathers on some of 3 ranks (the last rank holds less: its
  # ranges have the padding), with collectives of the others in flight: every rank ends (no
  # hang), as out of memory (3) or stopped by a peer's failure (6), and nothing crashes on the way
  # out (an abandoned collective's buffers outlive the communicator that still progresses it).
  # [distributed] timeout_s beyond mpirun's 120 s: no rank may wait out a collective the others
  # gave up (the failed rank's exit once waited for its own gathers in flight, 60 s).
  with_zero 3 z.toml
  for limit in 53600 56000 57000; do
    set +e
    out=$(mpirun -np 3 "$headroom" train z.toml -q --set train.steps=2 \
      --set device.memory_limit=$limit --set distributed.timeout_s=600 2>&1); rc=$?
    set -e
    { [ $rc = 3 ] || [ $rc = 6 ]; } && grep -q "out of memory: " <<<"$out" &&
      ! grep -qi "segmentation\|signal 11\|signal 6 " <<<"$out" ||
      fail "zero3 out of memory on 3 ranks at memory_limit $limit: exit $rc: $out"
  done
  set +e
  out=$("$headroom" train z.toml -q --set plugins.zero3.prefetch_layers=-1 2>&1); rc=$?
  set -e
  [ $rc = 2 ] && grep -q "plugins.zero3.prefetch_layers: must be 0 to 64" <<<"$out" ||
    fail "zero3 prefetch_layers = -1: exit $rc: $out"
  ;;
llama)
  # Every stage on a Llama (RMSNorm, rotary embeddings, SwiGLU; GQA: 4 heads over 2 KV heads; an
  # untied head) on 3 ranks: the embedding's and the head's 496 elements do not split evenly (the
  # last rank holds padding). One micro-step a step, so every stage's sums are the data-parallel
  # run's: losses and weights bitwise, alone, with checkpoint and defrag_allocator, and with amp
  # bf16; zero3 with every layer sharded too. A zero2 and a zero3 + amp snapshot resume bitwise on
  # the same ranks, and resharded onto 1 rank they continue as the unbroken 1-rank run does.
  cat > llama.toml <<'TOML'
[model]
arch = "llama"
n_layer = 2
n_head = 4
n_kv_head = 2
n_embd = 16
intermediate_size = 20
seq_len = 7
vocab_size = 31
tie_embeddings = false

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
  "$headroom" train llama.toml -q --set train.steps=1 --set train.lr=1e-30 \
    --save-weights linit/
  # lzero STAGE FILE [PART]: llama.toml with zero STAGE and PART's lines.
  lzero() {
    cp llama.toml "$2"
    printf '\n[[plugins]]\nname = "zero%s"\n' "$1" >> "$2"
    if [ "$1" = 3 ]; then printf 'param_persistence_threshold = 100\n' >> "$2"; fi
    if [ -n "${3:-}" ]; then cat "$3" >> "$2"; fi
  }
  same() {  # same WHAT RUN REF: RUN's losses and weights bitwise REF's
    "$compare" losses "$2.jsonl" "$3.jsonl" 0 || fail "llama, $1: losses"
    "$compare" weights "$2/model.safetensors" "$3/model.safetensors" linit/model.safetensors 0 ||
      fail "llama, $1: weights"
  }
  printf '\n[[plugins]]\nname = "checkpoint"\npolicy = "every"\n\n[[plugins]]\nname = "defrag_allocator"\n' \
    > lcd.part
  printf '\n[[plugins]]\nname = "amp"\ndtype = "bf16"\n' > lbf16.part
  mpirun -np 3 "$headroom" train llama.toml -q --metrics ld.jsonl --save-weights ld/
  cat llama.toml lbf16.part > ldb.toml
  mpirun -np 3 "$headroom" train ldb.toml -q --metrics ldb.jsonl --save-weights ldb/
  for stage in 1 2 3; do
    lzero $stage lz.toml
    mpirun -np 3 "$headroom" train lz.toml -q --metrics lz.jsonl --save-weights lz/
    same "zero$stage, 3 ranks" lz ld
    lzero $stage lz.toml lcd.part
    mpirun -np 3 "$headroom" train lz.toml -q --metrics lz.jsonl --save-weights lz/
    same "zero$stage + checkpoint + defrag_allocator, 3 ranks" lz ld
    lzero $stage lz.toml lbf16.part
    mpirun -np 3 "$headroom" train lz.toml -q --metrics lz.jsonl --save-weights lz/
    same "zero$stage + amp bf16, 3 ranks" lz ldb
  done
  lzero 3 lz.toml
  mpirun -np 3 "$headroom" train lz.toml -q --set plugins.zero3.param_persistence_threshold=0 \
    --metrics lz.jsonl --save-weights lz/
  same "zero3, every layer sharded (the head too)" lz ld
  # Resume on the same ranks, bitwise; resharded 3 -> 1 (grad_accum 3: the same global batch)
  # against the unbroken 1-rank run, within the distance of two 1-rank runs that sum the same
  # gradients in other orders.
  "$headroom" train llama.toml -q --set train.micro_batch=3 --save-weights lmb/
  "$headroom" train llama.toml -q --set train.grad_accum=3 --save-weights lga/
  for z in "2 none" "3 lbf16.part"; do
    read -r stage extra <<<"$z"
    [ "$extra" = none ] && extra=""
    lzero "$stage" lr.toml "$extra"
    rm -rf lsnaps lat3
    mpirun -np 3 "$headroom" train lr.toml -q --set snapshot.every=3 --set snapshot.dir=lsnaps \
      --save-weights lfull/
    mkdir lat3
    cp lsnaps/step_000000000003.* lat3/
    mpirun -np 3 "$headroom" train lr.toml -q --resume lat3 --save-weights lres/
    cmp lfull/model.safetensors lres/model.safetensors || fail "llama, zero$stage $extra: resumed weights differ"
    "$headroom" train lr.toml -q --set train.grad_accum=3 --metrics lu1.jsonl \
      --save-weights lu1/
    out=$("$headroom" train lr.toml --set train.grad_accum=3 --resume lat3 --metrics lr1.jsonl \
      --save-weights lr1/)
    grep -q "resumed from lat3/step_000000000003.hrsnap (step 3), resharded from 3 ranks to 1" \
      <<<"$out" || fail "llama, zero$stage $extra 3 -> 1: no resharding line in: $out"
    tail -n 3 lu1.jsonl > lu1.after3.jsonl
    if [ -z "$extra" ]; then
      "$compare" losses lr1.jsonl lu1.after3.jsonl 1e-6 || fail "llama, zero$stage 3 -> 1: losses"
      "$compare" within lr1/model.safetensors lu1/model.safetensors lmb/model.safetensors \
        lga/model.safetensors || fail "llama, zero$stage 3 -> 1: weights"
    else
      # amp bf16: the bf16 gradients of 3 ranks summed differ from one rank's fp32 accumulation
      # of the same 3 micro-steps by more than fp32 orders do (the unbroken 3-rank run ends 2e-3
      # from the 1-rank one, 10 times two 1-rank runs' distance): losses within 1e-4, and the
      # weights no farther from the unbroken 1-rank run than the unbroken 3-rank run is.
      "$compare" losses lr1.jsonl lu1.after3.jsonl 1e-4 || fail "llama, zero$stage $extra 3 -> 1: losses"
      "$compare" within lr1/model.safetensors lu1/model.safetensors lfull/model.safetensors \
        lu1/model.safetensors || fail "llama, zero$stage $extra 3 -> 1: weights"
    fi
  done
  ;;
*)
  fail "unknown part $part"
  ;;
esac
echo "zero_test $part: ok"
