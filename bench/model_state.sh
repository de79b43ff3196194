#!/usr/bin/env bash
# The model state's layouts and the lighter optimizers, against fp32 AdamW, side by side in one run
# (docs/results/model-state.md):
#   1. bytes and step time on gpt2-124m (seq_len 256, micro_batch 4): bench_plugins --suite
#      model-state, every variant through the real trainer in one process, 1 warm-up step and
#      MEASURED (default 2) measured steps each;
#   2. convergence on a text corpus: a small model (4 layers, n_embd 128, seq_len 128, bytes as
#      tokens) trained STEPS (default 400) steps in every mode from the same init and data, and
#      the mean loss of its last 20 steps against fp32 AdamW's.
#
#   bench/model_state.sh [BUILD]         (default build/; writes nothing but a temporary folder)
#   MODEL_STATE_PARTS=2 bench/model_state.sh   runs only section 2 (any of 12)
#
# The corpus is Debian's license texts (/usr/share/common-licenses: GPL-3, LGPL-2.1, MPL-1.1,
# Apache-2.0, GFDL-1.3; ~140 KB of English), the same on every bookworm machine.
set -euo pipefail
build=$(cd "${1:-build}" && pwd)
parts=${MODEL_STATE_PARTS:-12}
measured=${MEASURED:-2}
steps=${STEPS:-400}
repo=$(cd "$(dirname "$0")/.." && pwd)
headroom=$build/bin/headroom
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ $parts == *1* ]]; then
  echo "## 1. gpt2-124m, seq_len 256, micro_batch 4 (bench_plugins --suite model-state)"
  echo
  "$build/bin/bench_plugins" "$repo/bench/gpt2-124m.toml" --suite model-state \
    --set model.seq_len=256 --set train.micro_batch=4 --steps "$measured" --warmup 1
  echo
fi

if [[ $parts == *2* ]]; then
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
  amp='[[plugins]]
name = "amp"'
  variants=(
    "fp32 AdamW (no plugins)|"
    "amp bf16, grad_dtype fp32|$amp"
    "amp bf16, grad_dtype bf16|$amp
grad_dtype = \"bf16\""
    "amp, master_weights = false|$amp
master_weights = false"
    "amp, master_weights = false, state_dtype bf16|$amp
master_weights = false
state_dtype = \"bf16\""
    "adafactor (relative_step)|[[plugins]]
name = \"adafactor\""
    "adafactor, relative_step = false, scale_parameter = false (lr 1e-3 schedule)|[[plugins]]
name = \"adafactor\"
relative_step = false
scale_parameter = false"
    "adam8bit|[[plugins]]
name = \"adam8bit\""
    "amp grad bf16 + adam8bit|$amp
grad_dtype = \"bf16\"
[[plugins]]
name = \"adam8bit\""
    "amp no masters + adam8bit|$amp
master_weights = false
[[plugins]]
name = \"adam8bit\""
    "amp no masters + adafactor|$amp
master_weights = false
[[plugins]]
name = \"adafactor\""
  )
  echo "## 2. convergence: text corpus ($(wc -c < "$work/corpus.txt") bytes), 4 layers, n_embd 128,"
  echo "seq_len 128, micro_batch 8, $steps steps, lr 1e-3 cosine to 1e-4, clip 1.0"
  echo
  echo "| mode | loss, mean of the last 20 steps | vs fp32 AdamW |"
  echo "|---|---:|---:|"
  base=""
  i=0
  for v in "${variants[@]}"; do
    name=${v%%|*}
    tables=${v#*|}
    cfg="$work/v$i.toml"
    cp "$work/small.toml" "$cfg"
    [ -n "$tables" ] && printf '\n%s\n' "$tables" >> "$cfg"
    "$headroom" train "$cfg" -q --metrics "$work/m$i.jsonl" > "$work/log$i.txt" 2>&1 ||
      { echo "| $name | failed: $(tail -1 "$work/log$i.txt") | |"; i=$((i + 1)); continue; }
    loss=$(python3 - "$work/m$i.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
last = [r["loss"] for r in rows[-20:]]
print(f"{sum(last) / len(last):.4f}")
PY
)
    [ -z "$base" ] && base=$loss
    ratio=$(python3 -c "print(f'{$loss / $base:.3f}')")
    echo "| $name | $loss | $ratio |"
    i=$((i + 1))
  done
fi
