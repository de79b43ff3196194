#!/usr/bin/env bash
# The closed form's bytes by category for a Llama preset under each remedy (docs/results/llama.md):
# `headroom plan` on the preset at seq_len 2048 (llama-3.2-1b, llama-3.1-8b), micro_batch 1.
# zero's rows run `plan` as 8 ranks under mpirun (the plan is closed form only: nothing of the
# model is allocated). Usage: bench/llama/plan_table.sh PRESET [BUILD_DIR]
set -euo pipefail
preset=$1
bin=${2:-build}/bin/headroom
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
plugin() { printf '[[plugins]]\nname = "%s"\n%s\n' "$1" "${2:-}"; }
remedies=(
  "none|"
  "amp bf16 (18 bytes/param)|$(plugin amp)"
  "amp, master_weights = false, state_dtype = bf16 (8)|$(plugin amp 'master_weights = false
state_dtype = "bf16"')"
  "checkpoint every|$(plugin checkpoint)"
  "amp + checkpoint|$(plugin amp)
$(plugin checkpoint)"
  "adam8bit + amp + checkpoint|$(plugin amp)
$(plugin checkpoint)
$(plugin adam8bit)"
  "adafactor + amp + checkpoint|$(plugin amp)
$(plugin checkpoint)
$(plugin adafactor)"
)
printf '| remedy | parameters | gradients | optimizer | activations | workspace | total |\n'
printf '| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n'
row() {
  local name=$1 out=$2
  printf '| %s |' "$name"
  for c in parameters gradients optimizer activations workspace total; do
    printf ' %s |' "$(awk -v c="$c" '$1 == c { $1 = ""; sub(/^ +/, ""); print; exit }' <<<"$out")"
  done
  printf '\n'
}
for r in "${remedies[@]}"; do
  name=${r%%|*}
  printf '[model]\npreset = "%s"\nseq_len = 2048\n[train]\nmicro_batch = 1\n%s\n' "$preset" \
    "${r#*|}" >"$dir/run.toml"
  row "$name" "$("$bin" plan "$dir/run.toml" 2>&1 || true)"
done
for z in zero1 zero2 zero3; do
  printf '[model]\npreset = "%s"\nseq_len = 2048\n[train]\nmicro_batch = 1\n%s\n%s\n%s\n' \
    "$preset" "$(plugin amp)" "$(plugin checkpoint)" "$(plugin $z)" >"$dir/run.toml"
  all=$(mpirun --allow-run-as-root --oversubscribe -np 8 "$bin" plan "$dir/run.toml" 2>&1 || true)
  out=$(awk '/^estimated peak of rank 0 / { on = 1 } on { print } on && $1 == "total" { exit }' <<<"$all")
  row "amp + checkpoint + $z, 8 ranks (a rank)" "$out"
done
