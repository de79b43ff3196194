#!/usr/bin/env bash
# LoRA on quantized frozen bases (QLoRA; docs/results/lora.md), every run through `headroom train`:
#   1. a fine-tune: a small GPT-2 (4 layers, n_embd 128, seq_len 128, bytes as tokens) trained
#      PRE_STEPS (default 300) steps on one text, saved, and fine-tuned STEPS (default 200) steps
#      on another with lora (r 8, every linear module) on each base — f32, bf16, int8, nf4, nf4
#      with double quantization — from the same init and data: the mean loss of the last 20
#      steps against the bf16 base's, and the mean step time;
#   2. gpt2-350m's shapes (seq_len SEQ, default 128; micro_batch 1; random weights), 2 steps each
#      on the CPU backend: the tracker's peak and the bytes by category at it (the memory
#      report's "at peak" column) of full training and of lora on each base, and the time of the
#      second step.
#
#   bench/lora_quant.sh [BUILD]          (default build/; writes nothing but a temporary folder)
#   LORA_PARTS=1 bench/lora_quant.sh     runs only part 1 (any of 12)
#
# The texts are Debian's license texts (/usr/share/common-licenses), the same on every bookworm
# machine: GPL-3 and LGPL-2.1 to pre-train, Apache-2.0, MPL-1.1 and GFDL-1.3 to fine-tune.
set -euo pipefail
build=$(cd "${1:-build}" && pwd)
parts=${LORA_PARTS:-12}
pre_steps=${PRE_STEPS:-300}
steps=${STEPS:-200}
seq=${SEQ:-128}
headroom=$build/bin/headroom
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

bases=(
  "f32|"
  "bf16|base_dtype = \"bf16\""
  "int8|base_dtype = \"int8\""
  "nf4|base_dtype = \"nf4\""
  "nf4, double_quant|base_dtype = \"nf4\"
double_quant = true"
)
lora_table() {
  printf '[[plugins]]\nname = "lora"\nr = 8\nalpha = 16.0\n'
  printf 'target_modules = ["c_attn", "c_proj", "c_fc"]\n%s\n' "$1"
}
summary() {  # metrics file -> "first step's loss|mean loss of the last 20 steps|mean step_ms after the first"
  python3 - "$1" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
last = [r["loss"] for r in rows[-20:]]
ms = [r["step_ms"] for r in rows[1:]] or [rows[0]["step_ms"]]
print(f"{rows[0]['loss']:.4f}|{sum(last) / len(last):.4f}|{sum(ms) / len(ms):.1f}")
PY
}

if [[ $parts == *1* ]]; then
  licenses=/usr/share/common-licenses
  cat "$licenses/GPL-3" "$licenses/LGPL-2.1" > "$work/pre.txt"
  cat "$licenses/Apache-2.0" "$licenses/MPL-1.1" "$licenses/GFDL-1.3" > "$work/ft.txt"
  model='[model]
n_layer = 4
n_head = 4
n_embd = 128
seq_len = 128
vocab_size = 256'
  cat > "$work/pre.toml" <<TOML
$model
[train]
steps = $pre_steps
micro_batch = 8
lr = 1e-3
warmup_steps = 20
lr_schedule = "cosine"
min_lr = 1e-4
grad_clip = 1.0
[data]
kind = "text"
path = "pre.txt"
TOML
  "$headroom" train "$work/pre.toml" -q --save-weights "$work/base.safetensors"
  echo "## 1. fine-tune: pre-trained $pre_steps steps on GPL-3 + LGPL-2.1 ($(wc -c < "$work/pre.txt")"
  echo "bytes), then lora r 8 on Apache-2.0 + MPL-1.1 + GFDL-1.3 ($(wc -c < "$work/ft.txt") bytes),"
  echo "$steps steps, micro_batch 8, lr 1e-3 cosine to 1e-4, clip 1.0"
  echo
  echo "| base | loss, step 1 | loss, mean of the last 20 steps | vs bf16 base | step (ms) |"
  echo "|---|---:|---:|---:|---:|"
  declare -A first loss ms
  i=0
  for b in "${bases[@]}"; do
    name=${b%%|*}
    cfg="$work/ft$i.toml"
    cat > "$cfg" <<TOML
$model
[train]
steps = $steps
micro_batch = 8
lr = 1e-3
warmup_steps = 10
lr_schedule = "cosine"
min_lr = 1e-4
grad_clip = 1.0
init_from = "base.safetensors"
[data]
kind = "text"
path = "ft.txt"
$(lora_table "${b#*|}")
TOML
    "$headroom" train "$cfg" -q --metrics "$work/ft$i.jsonl"
    s=$(summary "$work/ft$i.jsonl")
    first[$name]=${s%%|*}
    s=${s#*|}
    loss[$name]=${s%%|*}
    ms[$name]=${s#*|}
    i=$((i + 1))
  done
  for b in "${bases[@]}"; do
    name=${b%%|*}
    ratio=$(python3 -c "print(f'{${loss[$name]} / ${loss[bf16]}:.4f}')")
    echo "| $name | ${first[$name]} | ${loss[$name]} | $ratio | ${ms[$name]} |"
  done
  echo
fi

if [[ $parts == *2* ]]; then
  echo "## 2. gpt2-350m shapes, seq_len $seq, micro_batch 1, 2 steps (bytes at the tracker's peak)"
  echo
  echo "| run | parameters | gradients | optimizer | activations | workspace | peak | step 2 (s) |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|"
  runs=("full training (AdamW)|NONE" "${bases[@]/#/lora, }")
  i=0
  for r in "${runs[@]}"; do
    name=${r%%|*}
    tables=${r#*|}
    cfg="$work/m$i.toml"
    {
      printf '[model]\npreset = "gpt2-350m"\nseq_len = %s\n' "$seq"
      printf '[train]\nsteps = 2\nmicro_batch = 1\n[data]\nkind = "synthetic"\n'
      if [ "$tables" != NONE ]; then lora_table "$tables"; fi
    } > "$cfg"
    "$headroom" train "$cfg" --metrics "$work/m$i.jsonl" > "$work/m$i.txt" 2>&1
    python3 - "$work/m$i.jsonl" "$work/m$i.txt" "$name" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
# The memory report's "at peak" column: the bytes by category at the moment of the peak.
at = {}
lines = open(sys.argv[2]).read().splitlines()
start = next(i for i, l in enumerate(lines) if l.strip().startswith("category"))
for l in lines[start + 1:start + 9]:
    f = l.split()
    at[f[0]] = f"{f[1]} {f[2]}"
cells = [at[c] for c in ("parameters", "gradients", "optimizer", "activations", "workspace")]
peak = next(l for l in lines if l.startswith("memory report")).split("peak ")[1].split(",")[0]
print(f"| {sys.argv[3]} | " + " | ".join(cells) +
      f" | {peak} | {rows[-1]['step_ms'] / 1000:.2f} |")
PY
    i=$((i + 1))
  done
  echo
fi
