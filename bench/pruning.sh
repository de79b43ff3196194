#!/usr/bin/env bash
# The pruning plugin on a text corpus (modes mlp, heads, unstructured), every variant against the unpruned run side by side in one
# run of this script (docs/results/pruning.md): a small model (4 layers, n_embd 128, seq_len 128,
# bytes as tokens) trained STEPS (default 400) steps from the same init and data, pruned on the
# cubic schedule from step STEPS/5 to STEPS/2 every STEPS/20 steps. For each variant:
#  - the final loss: the mean of the last 20 steps' losses;
#  - the peak bytes of a step of the model as it ends: its weights (--save-weights) trained 2
#    more steps from `init_from` (a pruned file builds the pruned model; mode "unstructured" adds
#    its masks, which that run does not have: its row counts them from the pruned run's report);
#  - the step time of the last STEPS/4 steps (all after the last pruning step) against the
#    unpruned run's same steps.
#
#   bench/pruning.sh [BUILD]        (default build/; writes nothing but a temporary folder)
#
# The corpus is Debian's license texts (/usr/share/common-licenses: GPL-3, LGPL-2.1, MPL-1.1,
# Apache-2.0, GFDL-1.3; ~140 KB of English), as bench/model_state.sh uses.
set -euo pipefail
# One BLAS thread: step times on a shared 2-core machine are steadier, and the ratios are what counts.
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
build=$(cd "${1:-build}" && pwd)
steps=${STEPS:-400}
headroom=$build/bin/headroom
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

licenses=/usr/share/common-licenses
cat "$licenses/GPL-3" "$licenses/LGPL-2.1" "$licenses/MPL-1.1" "$licenses/Apache-2.0" \
  "$licenses/GFDL-1.3" > "$work/corpus.txt"
cat > "$work/small.toml" <<TOML
[model]
n_layer = 4
n_head = 4
n_embd = 128
seq_len = 128
vocab_size = 256
[train]
steps = $steps
micro_batch = 8
lr = 1e-3
warmup_steps = 20
lr_schedule = "cosine"
min_lr = 1e-4
grad_clip = 1.0
log_every = 100
[data]
kind = "text"
path = "corpus.txt"
TOML
start=$((steps / 5))
end=$((steps / 2))
every=$((steps / 20))
prune() {  # mode, final sparsity, importance
  printf '[[plugins]]\nname = "pruning"\nmode = "%s"\nfinal_sparsity = %s\nstart_step = %d\nend_step = %d\nevery = %d\nimportance = "%s"\n' \
    "$1" "$2" "$start" "$end" "$every" "$3"
}
variants=(
  "unpruned|0|"
  "mlp, magnitude|0.25|$(prune mlp 0.25 magnitude)"
  "mlp, magnitude|0.5|$(prune mlp 0.5 magnitude)"
  "mlp, taylor|0.5|$(prune mlp 0.5 taylor)"
  "mlp, magnitude|0.75|$(prune mlp 0.75 magnitude)"
  "heads, magnitude|0.5|$(prune heads 0.5 magnitude)"
  "unstructured|0.5|$(prune unstructured 0.5 magnitude)"
)
echo "text corpus ($(wc -c < "$work/corpus.txt") bytes), 4 layers, n_embd 128, seq_len 128,"
echo "micro_batch 8, $steps steps, lr 1e-3 cosine to 1e-4; pruning at steps $start..$end every $every"
echo
echo "| variant | sparsity | final loss | vs unpruned | parameters | peak bytes of a step after | vs unpruned | step time after (ms) | vs unpruned |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
base_loss="" base_peak="" base_ms=""
i=0
for v in "${variants[@]}"; do
  name=${v%%|*}
  rest=${v#*|}
  sparsity=${rest%%|*}
  tables=${rest#*|}
  cfg="$work/v$i.toml"
  cp "$work/small.toml" "$cfg"
  [ -n "$tables" ] && printf '\n%s\n' "$tables" >> "$cfg"
  "$headroom" train "$cfg" -q --metrics "$work/m$i.jsonl" --save-weights "$work/w$i.safetensors" \
    > "$work/log$i.txt" 2>&1 ||
    { echo "| $name | $sparsity | failed: $(tail -1 "$work/log$i.txt") |"; i=$((i + 1)); continue; }
  # The model as it ends, trained 2 steps: its peak.
  cp "$work/small.toml" "$work/after$i.toml"
  sed -i "s/^steps = .*/steps = 2/; s/^warmup_steps = .*/warmup_steps = 1/" "$work/after$i.toml"
  sed -i "/^\[train\]/a init_from = \"w$i.safetensors\"" "$work/after$i.toml"
  "$headroom" train "$work/after$i.toml" -q --metrics "$work/a$i.jsonl" > "$work/alog$i.txt" 2>&1
  read -r loss ms peak nparams < <(python3 - "$work/m$i.jsonl" "$work/a$i.jsonl" "$work/w$i.safetensors" "$steps" <<'PY'
import json, struct, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
after = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
steps = int(sys.argv[4])
last = [r["loss"] for r in rows[-20:]]
tail = [r["step_ms"] for r in rows if r["step"] > steps - steps // 4]
with open(sys.argv[3], "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
params = 0
for k, t in header.items():
    if k == "__metadata__":
        continue
    p = 1
    for d in t["shape"]:
        p *= d
    params += p
print(f"{sum(last) / len(last):.4f} {sum(tail) / len(tail):.2f} {after[-1]['mem_peak_bytes']} {params}")
PY
)
  # Unstructured: the masks (a byte a block weight) are part of its model; init_from has none.
  if [[ $name == unstructured* ]]; then
    masks=$(grep -o 'the masks add [0-9]*' "$work/log$i.txt" | grep -o '[0-9]*$' || echo 0)
    peak=$((peak + masks))
  fi
  [ -z "$base_loss" ] && { base_loss=$loss; base_peak=$peak; base_ms=$ms; }
  r_loss=$(python3 -c "print(f'{$loss / $base_loss:.3f}')")
  r_peak=$(python3 -c "print(f'{$peak / $base_peak:.3f}')")
  r_ms=$(python3 -c "print(f'{$ms / $base_ms:.2f}')")
  echo "| $name | $sparsity | $loss | $r_loss | $nparams | $peak | $r_peak | $ms | $r_ms |"
  i=$((i + 1))
done
