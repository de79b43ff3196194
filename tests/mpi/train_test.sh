#!/usr/bin/env bash
# Data-parallel training across ranks, on the CPU backend with a tiny model (CI has 2 cores).
#
#   train_test.sh PART HEADROOM COMPARE PLUGIN_DIR MPIEXEC
#
# PART: equivalence | buckets | resume | failure | reducer | frozen | offload. Every mpirun runs under `timeout`: a hang fails.
set -euo pipefail
part=$1 headroom=$2 compare=$3 plugins=$4 mpiexec=$5
work=$(mktemp -d "${TMPDIR:-/tmp}/headroom_mpi_train.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"
mpirun() { timeout 120 "$mpiexec" --allow-run-as-root --oversubscribe "$@"; }
# For the failures: mpirun must not kill rank 0 when rank 1 exits non-zero, so that what rank 0
# says is its own finding (the communicator's), not the launcher's. Each rank's output goes to
# out.RANK and its exit code to code.RANK (ranks' lines would interleave on one stream).
cat > each_rank.sh <<'SH'
#!/usr/bin/env bash
r=${OMPI_COMM_WORLD_RANK:?}
"$@" > "out.$r" 2>&1
echo $? > "code.$r"
SH
chmod +x each_rank.sh
ranks_run() {
  rm -f out.* code.*
  mpirun --mca orte_abort_on_non_zero_status 0 -np 2 ./each_rank.sh "$@" || true
  [ -f code.0 ] && [ -f code.1 ] || fail "a rank recorded no exit code"
  cat out.0 out.1
}
fail() { echo "FAIL: $*" >&2; exit 1; }
# The recorder test plugin's table, one events file per rank ($work/events.rankR); extra keys
# (e.g. "alloc_events = true") follow as arguments, one a line.
recorder_table() {
  printf '\n[[plugins]]\nname = "rec_a"\npath = "%s"\nout = "%s"\nper_rank = true\n' \
    "$plugins/rec_a.so" "$work/events"
  for line in "$@"; do printf '%s\n' "$line"; done
}

cat > cfg.toml <<TOML
[model]
n_layer = 2
n_head = 2
n_embd = 16
seq_len = 16
vocab_size = 64

[train]
steps = 20
micro_batch = 2
optimizer = "adamw"
lr = 0.01
seed = 3

[data]
kind = "synthetic"
workers = 0

[distributed]
bucket_size = "4KiB"
TOML
# The weights before any update: one step at lr 1e-30 changes no float32 weight.
"$headroom" train cfg.toml -q --set train.steps=1 --set train.lr=1e-30 --save-weights init.safetensors

case $part in
equivalence)
  # 2 ranks x micro_batch 2 against 1 rank x micro_batch 4 and 1 rank x micro_batch 2 x grad_accum 2.
  mpirun -np 2 "$headroom" train cfg.toml -q --metrics r2.jsonl --save-weights r2.safetensors
  "$headroom" train cfg.toml -q --set train.micro_batch=4 --metrics mb.jsonl \
    --save-weights mb.safetensors
  "$headroom" train cfg.toml -q --set train.grad_accum=2 --metrics ga.jsonl \
    --save-weights ga.safetensors
  # AdamW's m / sqrt(v) amplifies the last bits of near-zero gradients, so two 1-rank runs that
  # sum the same gradients in another order (mb, ga) already differ by ~1e-4 of the update after
  # 20 steps: the ranks' weights must be no farther from either than they are from each other.
  # With SGD the update is linear in the gradient, and 1e-6 of its size holds.
  for ref in mb ga; do
    "$compare" losses r2.jsonl $ref.jsonl 1e-6 || fail "2 ranks against $ref: losses"
    "$compare" within r2.safetensors $ref.safetensors mb.safetensors ga.safetensors ||
      fail "2 ranks against $ref: weights"
  done
  sgd=(--set 'train.optimizer="sgd"' --set train.lr=0.1)
  mpirun -np 2 "$headroom" train cfg.toml -q "${sgd[@]}" --metrics sr2.jsonl \
    --save-weights sr2.safetensors
  "$headroom" train cfg.toml -q "${sgd[@]}" --set train.micro_batch=4 --metrics smb.jsonl \
    --save-weights smb.safetensors
  "$headroom" train cfg.toml -q "${sgd[@]}" --set train.grad_accum=2 --metrics sga.jsonl \
    --save-weights sga.safetensors
  for ref in smb sga; do
    "$compare" losses sr2.jsonl $ref.jsonl 1e-6 || fail "2 ranks against $ref (SGD): losses"
    "$compare" weights sr2.safetensors $ref.safetensors init.safetensors 1e-6 ||
      fail "2 ranks against $ref (SGD): weights"
  done
  # 4 ranks x micro_batch 1 x grad_accum 2 against 1 rank x micro_batch 4 x grad_accum 2 and
  # 1 rank x micro_batch 1 x grad_accum 8.
  mpirun -np 4 "$headroom" train cfg.toml -q --set train.micro_batch=1 --set train.grad_accum=2 \
    --metrics r4.jsonl --save-weights r4.safetensors
  "$headroom" train cfg.toml -q --set train.micro_batch=4 --set train.grad_accum=2 \
    --metrics mb4.jsonl --save-weights mb4.safetensors
  "$headroom" train cfg.toml -q --set train.micro_batch=1 --set train.grad_accum=8 \
    --metrics ga8.jsonl --save-weights ga8.safetensors
  for ref in mb4 ga8; do
    "$compare" losses r4.jsonl $ref.jsonl 1e-6 || fail "4 ranks against $ref: losses"
    "$compare" within r4.safetensors $ref.safetensors mb4.safetensors ga8.safetensors ||
      fail "4 ranks against $ref: weights"
  done
  # The metrics carry every rank's peak; rank 0 alone wrote them.
  grep -q '"mem_peak_bytes_by_rank":\[[0-9]*,[0-9]*,[0-9]*,[0-9]*\]' r4.jsonl ||
    fail "no mem_peak_bytes_by_rank of 4 ranks in the metrics"
  ! grep -q mem_peak_bytes_by_rank mb4.jsonl || fail "a 1-rank run has mem_peak_bytes_by_rank"
  ;;
buckets)
  # first_launch EVENTS STEP: whether the step's first bucket (in its micro-step 2) launched
  # "before" or "after" layer 0's BACKWARD_END, or "none".
  first_launch() {
    local launch end
    launch=$(grep -n "BUCKET_LAUNCH step=$2 micro=2 " "$1" | head -1 | cut -d: -f1)
    end=$(grep -n "BACKWARD_END step=$2 micro=2 layer=0" "$1" | cut -d: -f1)
    if [ -z "$launch" ] || [ -z "$end" ]; then echo none
    elif [ "$launch" -lt "$end" ]; then echo before
    else echo after; fi
  }
  recorder_table "alloc_events = true" >> cfg.toml
  mpirun -np 2 "$headroom" train cfg.toml -q --set train.grad_accum=2 --set train.steps=3
  closed=$("$compare" bytes init.safetensors)  # 4 bytes per parameter: the buckets' closed form
  for r in 0 1; do
    f=events.rank$r
    [ -s "$f" ] || fail "no events recorded by rank $r"
    n=$(grep -c "BUCKET_LAUNCH step=1 " "$f" || true)
    [ "$n" -ge 3 ] || fail "rank $r: $n buckets in step 1; expected several"
    [ "$(grep -c "BUCKET_DONE step=1 " "$f")" = "$n" ] || fail "rank $r: launches and waits differ"
    ! grep -q "BUCKET_LAUNCH step=[0-9]* micro=1 " "$f" || fail "rank $r: a launch before the last micro-step"
    # In every step's last micro-step, a bucket starts before layer 0's backward ends, and every
    # wait comes before GRADS_READY.
    for s in 1 2 3; do
      last_done=$(grep -n "BUCKET_DONE step=$s " "$f" | tail -1 | cut -d: -f1)
      grads=$(grep -n "GRADS_READY step=$s " "$f" | cut -d: -f1)
      [ "$(first_launch "$f" $s)" = before ] ||
        fail "rank $r step $s: no bucket launched before BACKWARD_END of layer 0"
      [ "$last_done" -lt "$grads" ] || fail "rank $r step $s: a bucket waited for after GRADS_READY"
    done
    # Bytes: the tracker's communication allocations (category 6) are the buckets, and they are
    # the closed form; the launches of a step cover them exactly.
    comm=$(awk '/ ALLOC / && /category=6/ { sub("bytes=", "", $(NF-1)); s += $(NF-1) } END { print s + 0 }' "$f")
    [ "$comm" = "$closed" ] || fail "rank $r: communication bytes $comm, closed form $closed"
    launched=$(awk '/BUCKET_LAUNCH step=1 / { sub("bytes=", "", $NF); s += $NF } END { print s + 0 }' "$f")
    [ "$launched" = "$closed" ] || fail "rank $r: step 1 launched $launched bytes, closed form $closed"
  done
  # overlap = false: every bucket starts after the whole backward (after layer 0's BACKWARD_END).
  rm -f events*
  mpirun -np 2 "$headroom" train cfg.toml -q --set train.grad_accum=2 --set train.steps=1 \
    --set distributed.overlap=false
  for r in 0 1; do
    [ "$(first_launch events.rank$r 1)" = after ] ||
      fail "rank $r, overlap = false: a bucket launched before the backward was done"
  done
  # amp bf16: the model adds each layer's compute gradients into the fp32 masters as its backward
  # ends, so the buckets overlap the backward as they do in fp32.
  rm -f events*
  printf '\n[[plugins]]\nname = "amp"\ndtype = "bf16"\n' >> cfg.toml
  mpirun -np 2 "$headroom" train cfg.toml -q --set train.grad_accum=2 --set train.steps=1
  for r in 0 1; do
    [ "$(first_launch events.rank$r 1)" = before ] ||
      fail "rank $r, amp bf16: no bucket launched before BACKWARD_END of layer 0"
  done
  # One rank: no buckets, no bucket events, no communication bytes.
  rm -f events*
  sed -i 's/per_rank = true/per_rank = false/' cfg.toml
  "$headroom" train cfg.toml -q --set train.grad_accum=2 --set train.steps=2
  ! grep -q BUCKET events || fail "a 1-rank run fired bucket events"
  ! grep -q "category=6" events || fail "a 1-rank run allocated communication bytes"
  ;;
reducer)
  # A plugin with the gradient-reduction role averages the gradients itself (headroom.comm/1):
  # core's buckets are off — no communication bytes, no bucket events — and the run trains as
  # core's own data parallelism does, bitwise (each gradient element is the same (a + b) / 2).
  mpirun -np 2 "$headroom" train cfg.toml -q --metrics core.jsonl --save-weights core.safetensors
  cat > reducer.toml <<TOML
$(cat cfg.toml)

[[plugins]]
name = "grad_reducer"
path = "$plugins/grad_reducer.so"
$(recorder_table "alloc_events = true")
TOML
  mpirun -np 2 "$headroom" train reducer.toml -q --metrics plugin.jsonl \
    --save-weights plugin.safetensors
  cmp core.safetensors plugin.safetensors || fail "the plugin's reduction trained otherwise than core's"
  "$compare" losses plugin.jsonl core.jsonl 0 || fail "the plugin's reduction: other losses"
  for r in 0 1; do
    ! grep -q BUCKET "$work/events.rank$r" || fail "rank $r: bucket events with the role taken"
    ! grep -q "category=6" "$work/events.rank$r" || fail "rank $r: communication bytes with the role taken"
  done
  # At one rank the plugin's averages change nothing: plain training.
  "$headroom" train reducer.toml -q --set train.steps=2 >/dev/null || fail "the plugin at world size 1"
  ;;
resume)
  snap="$work/snaps"
  mpirun -np 2 "$headroom" train cfg.toml -q --set snapshot.every=10 --set "snapshot.dir=$snap" \
    --metrics full.jsonl --save-weights full.safetensors
  [ -f "$snap/step_000000000010.hrsnap" ] || fail "no snapshot at step 10"
  for r in 0 1; do
    [ -f "$snap/step_000000000010.rank$r.data" ] || fail "no rank $r part of step 10"
  done
  mkdir at10
  cp "$snap"/step_000000000010.* at10/
  mpirun -np 2 "$headroom" train cfg.toml -q --resume at10 --metrics resumed.jsonl \
    --save-weights resumed.safetensors
  cmp full.safetensors resumed.safetensors || fail "resumed weights differ from the unbroken run's"
  tail -n 10 full.jsonl | sed 's/"step_ms[^,]*,//; s/"tokens_per_s[^,]*,//; s/"data_wait_ms[^,]*,//' > a
  sed 's/"step_ms[^,]*,//; s/"tokens_per_s[^,]*,//; s/"data_wait_ms[^,]*,//' resumed.jsonl > b
  "$compare" losses b a 0 || fail "resumed losses differ"
  # At another world size it is resharded (reshard_test.sh holds such runs to the unbroken ones).
  out=$("$headroom" train cfg.toml --resume at10 --set train.micro_batch=4 2>&1) ||
    fail "resume at 1 rank: $out"
  grep -q "resharded from 2 ranks to 1" <<<"$out" || fail "resume at 1 rank: $out"
  # A part missing: the snapshot is refused by every rank.
  rm at10/step_000000000010.rank1.data
  set +e
  out=$(mpirun -np 2 "$headroom" train cfg.toml -q --resume at10 2>&1); rc=$?
  set -e
  [ $rc != 0 ] || fail "resume without rank 1's part succeeded"
  grep -q "rank 1's part" <<<"$out" || fail "missing part: $out"
  ;;
frozen)
  # Frozen parameters across ranks: [train] freeze and the lora plugin's base are never reduced;
  # replicated by data parallelism, zero1 and zero2, sharded with their layers by zero3 (every
  # layer here: param_persistence_threshold = 0; the frozen embedding has nothing else). Data
  # parallel equals one rank of the whole batch; zero1, zero2 and zero3 equal data parallel
  # bitwise; a LoRA run with zero2 and amp resumes bitwise, and its adapter is saved from the
  # gathered masters; a QLoRA run (nf4 base) with zero3 equals its data-parallel run, merged
  # weights included, and resumes bitwise.
  strip() { sed 's/"step_ms[^,]*,//; s/"tokens_per_s[^,]*,//; s/"data_wait_ms[^,]*,//; s/"comm_wait_ms[^,]*,//' "$@"; }
  cp cfg.toml fz.toml
  sed -i 's/^seed = 3$/seed = 3\nfreeze = ["wte.weight", "h.0.*"]/' fz.toml
  grep -q '^freeze' fz.toml || fail "fz.toml has no freeze"
  mpirun -np 2 "$headroom" train fz.toml -q --metrics dp.jsonl --save-weights dp.safetensors
  "$headroom" train fz.toml -q --set train.micro_batch=4 --metrics mb.jsonl --save-weights mb.safetensors
  "$headroom" train fz.toml -q --set train.grad_accum=2 --metrics ga.jsonl --save-weights ga.safetensors
  "$compare" losses dp.jsonl mb.jsonl 1e-6 || fail "frozen, 2 ranks against 1: losses"
  "$compare" within dp.safetensors mb.safetensors mb.safetensors ga.safetensors ||
    fail "frozen, 2 ranks against 1: weights"
  for z in 1 2 3; do
    cp fz.toml z$z.toml
    printf '\n[[plugins]]\nname = "zero%s"\n' $z >> z$z.toml
    [ $z != 3 ] || printf 'param_persistence_threshold = 0\n' >> z$z.toml
    mpirun -np 2 "$headroom" train z$z.toml -q --metrics z$z.jsonl --save-weights z$z.safetensors
    "$compare" losses z$z.jsonl dp.jsonl 0 || fail "frozen with zero$z: losses"
    cmp z$z.safetensors dp.safetensors || fail "frozen with zero$z: weights differ from data parallel's"
  done
  lora() {  # lora FILE EXTRA-PLUGIN...
    sed '/^\[distributed\]/,$d' cfg.toml > "$1"
    printf '[[plugins]]\nname = "lora"\nr = 2\ntarget_modules = ["c_attn", "c_fc"]\n[[plugins]]\nname = "amp"\n' >> "$1"
    for p in "${@:2}"; do printf '[[plugins]]\nname = "%s"\n' "$p" >> "$1"; done
  }
  lora la.toml
  lora lz.toml zero2
  printf '[snapshot]\ndir = "snaps"\nevery = 10\n' >> lz.toml
  mpirun -np 2 "$headroom" train la.toml -q --metrics la.jsonl --save-weights la/
  mpirun -np 2 "$headroom" train lz.toml -q --metrics lz.jsonl --save-weights lz/
  "$compare" losses lz.jsonl la.jsonl 0 || fail "lora with zero2 and amp: losses"
  cmp la/adapter_model.safetensors lz/adapter_model.safetensors ||
    fail "lora with zero2: the adapter differs from data parallel's"
  mkdir at10
  cp snaps/step_000000000010.* at10/
  mpirun -np 2 "$headroom" train lz.toml -q --resume at10 --metrics resumed.jsonl --save-weights resumed/
  tail -n 10 lz.jsonl | strip > a
  strip resumed.jsonl > b
  "$compare" losses b a 0 || fail "lora with zero2 and amp: resumed losses differ"
  cmp lz/adapter_model.safetensors resumed/adapter_model.safetensors ||
    fail "lora with zero2 and amp: the resumed adapter differs"
  # QLoRA: the nf4 base (double-quantized absmaxes) sharded by zero3, its bytes gathered around
  # each layer; the same losses, adapter and merged weights as data parallel's, and a resume.
  lora ql.toml
  sed -i 's/^target_modules = .*/&\nbase_dtype = "nf4"\ndouble_quant = true/' ql.toml
  grep -q '^base_dtype = "nf4"' ql.toml || fail 'ql.toml has no base_dtype'
  cp ql.toml qz.toml
  printf '[[plugins]]\nname = "zero3"\nparam_persistence_threshold = 0\n[snapshot]\ndir = "qsnaps"\nevery = 10\n' >> qz.toml
  mpirun -np 2 "$headroom" train ql.toml -q --metrics ql.jsonl --save-weights ql.safetensors --merge
  mpirun -np 2 "$headroom" train qz.toml -q --metrics qz.jsonl --save-weights qz.safetensors --merge
  "$compare" losses qz.jsonl ql.jsonl 0 || fail "qlora with zero3: losses"
  cmp ql.safetensors qz.safetensors || fail "qlora with zero3: the merged weights differ"
  mkdir qat10
  cp qsnaps/step_000000000010.* qat10/
  mpirun -np 2 "$headroom" train qz.toml -q --resume qat10 --metrics qresumed.jsonl --save-weights qresumed.safetensors --merge
  tail -n 10 qz.jsonl | strip > a
  strip qresumed.jsonl > b
  "$compare" losses b a 0 || fail "qlora with zero3: resumed losses differ"
  cmp qz.safetensors qresumed.safetensors || fail "qlora with zero3: the resumed weights differ"
  # Loaded into the shards: init_from a base (the merged weights above) writes each rank's range
  # of the quantized bytes; the same losses and weights as data parallel's load.
  for f in ql qz; do
    sed "s/^seed = 3$/seed = 3\ninit_from = \"ql.safetensors\"/" $f.toml | sed '/^\[snapshot\]/,/^every/d' > ${f}i.toml
    grep -q '^init_from' ${f}i.toml || fail "${f}i.toml has no init_from"
    mpirun -np 2 "$headroom" train ${f}i.toml -q --set train.steps=4 --metrics ${f}i.jsonl --save-weights ${f}i.safetensors --merge
  done
  "$compare" losses qzi.jsonl qli.jsonl 0 || fail "qlora with zero3 from init_from: losses"
  cmp qli.safetensors qzi.safetensors || fail "qlora with zero3 from init_from: the merged weights differ"
  echo "frozen: data parallel, zero1/2/3, a LoRA resume and QLoRA with zero3 (seeded, resumed, loaded) across 2 ranks as one rank's"
  ;;
offload)
  # The offload plugin across ranks: with data parallelism and with zero1, zero2 and zero3 the
  # optimizer on the host (and its state on the NVMe tier) updates each rank's parameters or
  # shards bitwise as on the device, with amp, checkpoint and LoRA too; a zero2 + amp run resumes bitwise; the
  # host ledger is the closed form to the byte on every rank (plan --measure). Each rank's state
  # file is gone at the end.
  mkdir -p nvme
  with_offload() {  # with_offload FILE TIER: FILE.toml with the offload table, as FILE-TIER.toml
    cp "$1.toml" "$1-$2.toml"
    if [ "$2" = nvme ]; then
      printf '\n[[plugins]]\nname = "offload"\noptimizer = "nvme"\nnvme_path = "%s"\n' "$work/nvme" >> "$1-$2.toml"
    else
      printf '\n[[plugins]]\nname = "offload"\noptimizer = "host"\n' >> "$1-$2.toml"
    fi
  }
  plugins_toml() {  # plugins_toml FILE PLUGIN...: cfg.toml with those plugins, as FILE.toml
    cp cfg.toml "$1.toml"
    for p in "${@:2}"; do printf '\n[[plugins]]\nname = "%s"\n' "$p" >> "$1.toml"; done
  }
  plugins_toml dp
  plugins_toml z1 zero1
  plugins_toml z2 zero2
  plugins_toml z3 zero3
  plugins_toml az2 amp zero2
  plugins_toml az3 amp zero3
  plugins_toml acz2 amp checkpoint zero2
  sed '/^\[distributed\]/,$d' cfg.toml > lz2.toml
  printf '[[plugins]]\nname = "lora"\nr = 2\ntarget_modules = ["c_attn", "c_fc"]\n[[plugins]]\nname = "amp"\n[[plugins]]\nname = "zero2"\n' >> lz2.toml
  for f in dp z1 z2 z3 az2 az3 acz2 lz2; do
    mpirun -np 2 "$headroom" train $f.toml -q --set train.steps=6 --metrics $f.jsonl --save-weights $f.out
    for tier in host nvme; do
      with_offload $f $tier
      mpirun -np 2 "$headroom" train $f-$tier.toml -q --set train.steps=6 --metrics $f-$tier.jsonl \
        --save-weights $f-$tier.out
      "$compare" losses $f-$tier.jsonl $f.jsonl 0 || fail "$f with the optimizer on the $tier: losses"
      cmp $f.out $f-$tier.out || fail "$f with the optimizer on the $tier: weights differ"
      [ -z "$(ls nvme)" ] || fail "$f on the $tier: state files left in nvme/: $(ls nvme)"
      mpirun -np 2 "$headroom" plan $f-$tier.toml --measure > plan.$f-$tier 2>&1 ||
        fail "$f on the $tier: plan --measure failed: $(cat plan.$f-$tier)"
      [ "$(grep -c 'measured - closed form: 0 bytes' plan.$f-$tier)" = 2 ] ||
        fail "$f on the $tier: the host ledger is not the closed form on both ranks: $(cat plan.$f-$tier)"
    done
  done
  # Resume: a snapshot at step 3 of 6, amp + zero2 with the optimizer on the host.
  cp az2-host.toml r.toml
  printf '[snapshot]\ndir = "snaps"\nevery = 3\n' >> r.toml
  mpirun -np 2 "$headroom" train r.toml -q --set train.steps=6 --save-weights whole.out
  mkdir at3
  cp snaps/step_000000000003.* at3/
  mpirun -np 2 "$headroom" train r.toml -q --set train.steps=6 --resume at3 --save-weights resumed.out
  cmp whole.out resumed.out || fail "amp + zero2 + offload: the resumed run's weights differ"
  # The layers' outputs on the host too (activations = true) with amp, checkpoint and zero2 or
  # zero3 (every layer sharded): the same losses and weights, and the host ledger the closed form.
  plugins_toml acz3 amp checkpoint zero3
  printf 'param_persistence_threshold = 0\n' >> acz3.toml
  for f in acz2 acz3; do
    [ -f $f.out ] || mpirun -np 2 "$headroom" train $f.toml -q --set train.steps=6 --metrics $f.jsonl --save-weights $f.out
    with_offload $f host
    printf 'activations = true\n' >> $f-host.toml
    mpirun -np 2 "$headroom" train $f-host.toml -q --set train.steps=6 --metrics $f-act.jsonl --save-weights $f-act.out
    "$compare" losses $f-act.jsonl $f.jsonl 0 || fail "$f with activations on the host: losses"
    cmp $f.out $f-act.out || fail "$f with activations on the host: weights differ"
    mpirun -np 2 "$headroom" plan $f-host.toml --measure > plan.$f-act 2>&1 ||
      fail "$f with activations on the host: plan --measure failed: $(cat plan.$f-act)"
    [ "$(grep -c 'measured - closed form: 0 bytes' plan.$f-act)" = 2 ] ||
      fail "$f with activations on the host: the host ledger is not the closed form: $(cat plan.$f-act)"
  done
  # The parameter shards on the host too (parameters = "host", ZeRO-Infinity's offload_param)
  # with zero3 sharding every layer, fp32 and amp + checkpoint, the optimizer on the host and on
  # the NVMe tier: the same losses and weights as zero3 on the device, both ledgers the closed
  # form on both ranks; and amp + checkpoint resumed from step 3 bitwise.
  plugins_toml z3all zero3
  printf 'param_persistence_threshold = 0\n' >> z3all.toml
  mpirun -np 2 "$headroom" train z3all.toml -q --set train.steps=6 --metrics z3all.jsonl --save-weights z3all.out
  for f in z3all acz3; do
    for tier in host nvme; do
      with_offload $f $tier
      printf 'parameters = "host"\n' >> $f-$tier.toml
      mpirun -np 2 "$headroom" train $f-$tier.toml -q --set train.steps=6 --metrics $f-par.jsonl \
        --save-weights $f-par.out
      "$compare" losses $f-par.jsonl $f.jsonl 0 || fail "$f with the parameters on the host ($tier): losses"
      cmp $f.out $f-par.out || fail "$f with the parameters on the host ($tier): weights differ"
      [ -z "$(ls nvme)" ] || fail "$f, parameters on the host ($tier): state files left: $(ls nvme)"
      mpirun -np 2 "$headroom" plan $f-$tier.toml --measure > plan.$f-par 2>&1 ||
        fail "$f with the parameters on the host: plan --measure failed: $(cat plan.$f-par)"
      [ "$(grep -c 'measured - closed form: 0 bytes' plan.$f-par)" = 2 ] ||
        fail "$f with the parameters on the host: the host ledger is not the closed form: $(cat plan.$f-par)"
    done
  done
  # Their NVMe tier (parameters = "nvme"): amp's bf16 shards in a file per rank, read at each
  # gathering: the same losses and weights, the host ledger the closed form on both ranks.
  with_offload acz3 nvme
  printf 'parameters = "nvme"\n' >> acz3-nvme.toml
  mpirun -np 2 "$headroom" train acz3-nvme.toml -q --set train.steps=6 --metrics acz3-pf.jsonl \
    --save-weights acz3-pf.out
  "$compare" losses acz3-pf.jsonl acz3.jsonl 0 || fail "acz3 with the parameter shards in files: losses"
  cmp acz3.out acz3-pf.out || fail "acz3 with the parameter shards in files: weights differ"
  [ -z "$(ls nvme)" ] || fail "acz3, parameter shards in files: files left: $(ls nvme)"
  mpirun -np 2 "$headroom" plan acz3-nvme.toml --measure > plan.acz3-pf 2>&1 ||
    fail "acz3 with the parameter shards in files: plan --measure failed: $(cat plan.acz3-pf)"
  [ "$(grep -c 'measured - closed form: 0 bytes' plan.acz3-pf)" = 2 ] ||
    fail "acz3 with the parameter shards in files: the host ledger is not the closed form: $(cat plan.acz3-pf)"
  cp acz3-host.toml rp.toml
  printf '[snapshot]\ndir = "psnaps"\nevery = 3\n' >> rp.toml
  mpirun -np 2 "$headroom" train rp.toml -q --set train.steps=6 --save-weights pwhole.out
  mkdir pat3
  cp psnaps/step_000000000003.* pat3/
  mpirun -np 2 "$headroom" train rp.toml -q --set train.steps=6 --resume pat3 --save-weights presumed.out
  cmp pwhole.out presumed.out || fail "amp + zero3 + parameters on the host: the resumed run's weights differ"
  cmp acz3.out pwhole.out || fail "amp + zero3 + parameters on the host: not the run on the device"
  echo "offload: data parallel, zero1/2/3, amp and LoRA across 2 ranks, host and NVMe, activations, parameters (host and NVMe), bitwise"
  ;;
failure)
  recorder_table >> cfg.toml
  # Rank 1 throws (its plugin fails at step 3): it exits 1, rank 0 stops naming rank 1 (exit 6).
  ranks_run "$headroom" train cfg.toml -q --set plugins.rec_a.fail_event=\"BACKWARD_END\" \
    --set plugins.rec_a.fail_step=3 --set plugins.rec_a.fail_rank=1
  [ "$(cat code.1)" = 1 ] || fail "a failing rank 1 exited $(cat code.1), expected 1"
  [ "$(cat code.0)" = 6 ] || fail "rank 0 exited $(cat code.0) after rank 1 failed, expected 6"
  grep -q "rank 0: stopping: rank 1 failed: .*deliberate failure" out.0 ||
    fail "rank 0 did not name rank 1 and its error"
  # Rank 1 runs out of memory (its plugin holds 100 KiB there; the limit is the same on both):
  # rank 1 prints its report (exit 3), rank 0 says rank 1 ran out of memory (exit 6).
  rm -f events*
  ranks_run "$headroom" train cfg.toml -q --set device.memory_limit=\"300KiB\" \
    --set plugins.rec_a.hog_rank=1 --set plugins.rec_a.hog_bytes=102400
  [ "$(cat code.1)" = 3 ] || fail "rank 1 out of memory exited $(cat code.1), expected 3"
  [ "$(cat code.0)" = 6 ] || fail "rank 0 exited $(cat code.0) after rank 1's OOM, expected 6"
  grep -q "headroom: rank 1: out of memory" out.1 || fail "rank 1 printed no OOM report"
  grep -q "rank 0: stopping: rank 1 ran out of memory" out.0 ||
    fail "rank 0 did not say rank 1 ran out of memory"
  # Rank 1 killed with SIGKILL mid-run, twice. kill_rank1 waits for rank 1's step 3, then kills
  # the headroom process of rank 1 that runs in this test's folder (ctest runs others beside it).
  kill_rank1() {
    local victim="" pid
    for _ in $(seq 1 300); do
      for pid in $(pgrep -f "$headroom train cfg.toml" || true); do
        [ "$(readlink /proc/$pid/cwd 2>/dev/null)" = "$work" ] || continue
        if tr '\0' '\n' < /proc/$pid/environ 2>/dev/null | grep -qx OMPI_COMM_WORLD_RANK=1; then
          victim=$pid
        fi
      done
      [ -n "$victim" ] && [ -s events.rank1 ] && grep -q "STEP_END step=3 " events.rank1 && break
      sleep 0.1
    done
    [ -n "$victim" ] || fail "rank 1's process not found"
    kill -KILL "$victim"
  }
  # First as users launch: mpirun notices the death and stops the job. Everything ends within
  # 60 s, and rank 1 is named: by mpirun, and (when mpirun's SIGKILL, 1 s after its SIGTERM,
  # leaves it the time) by rank 0, naming the rank its wait still lacks.
  rm -f events*
  "$mpiexec" --allow-run-as-root --oversubscribe -np 2 "$headroom" train cfg.toml -q \
    --set train.steps=100000000 > killed.txt 2>&1 &
  launcher=$!
  kill_rank1 || { kill $launcher; exit 1; }
  set +e
  timeout 60 tail --pid=$launcher -f /dev/null; waited=$?
  set -e
  [ $waited = 0 ] || { kill $launcher; fail "rank 0 still running 60 s after rank 1 was killed"; }
  set +e
  wait $launcher; rc=$?
  set -e
  cat killed.txt
  [ $rc != 0 ] || fail "the run with rank 1 killed exited 0"
  grep -q "rank 1" killed.txt || fail "nothing named rank 1"
  # Then with mpirun's --enable-recovery, which lets the others run on: rank 0 finds rank 1 gone by
  # itself (its wait ends after [distributed] timeout_s), says so and exits 6.
  rm -f events* out.* code.*
  SECONDS=0
  mpirun --enable-recovery -np 2 ./each_rank.sh "$headroom" train cfg.toml -q \
    --set train.steps=100000000 --set distributed.timeout_s=5 > recovery.txt 2>&1 &
  launcher=$!
  kill_rank1 || { kill $launcher; exit 1; }
  killed_at=$SECONDS
  set +e
  wait $launcher
  set -e
  cat out.0
  [ "$(cat code.0)" = 6 ] || fail "rank 0 exited $(cat code.0) after rank 1 died, expected 6"
  grep -q "rank 0: stopping: .*not done after 5 s .*rank 1 has not said it waits" out.0 ||
    fail "rank 0 did not name rank 1 as the rank that never came"
  [ $((SECONDS - killed_at)) -lt 60 ] || fail "rank 0 took $((SECONDS - killed_at)) s to stop"
  ;;
*)
  fail "unknown part $part"
  ;;
esac
echo "PASS: $part"
