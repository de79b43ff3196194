#!/usr/bin/env bash
# What one 24 GiB and one 80 GiB device trains with each offload tier (docs/results/offload.md,
# "What a 24 GiB and an 80 GiB device train"): `headroom plan` (dry, closed forms: nothing of the
# model is allocated) on a preset at micro_batch 1, for the optimizer on the device ("none"), in
# host memory ("host") and on the NVMe tier ("nvme", nvme_path a temporary folder: plan checks
# that it exists and is writable), and each of the two with the parameter shards in host memory too
# ("host + parameters", "nvme + parameters": zero3 at its defaults and parameters = "host", on one
# rank), and with the NVMe tier for both ("nvme + parameters nvme": parameters = "nvme"), with and
# without amp and checkpoint. Prints one markdown row a
# combination: the device's peak and the host ledger's, and whether the device peak fits each wall.
# Usage: bench/offload_plan_table.sh PRESET SEQ_LEN [BUILD_DIR]
set -euo pipefail
preset=$1
seq_len=$2
bin=${3:-build}/bin/headroom
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
plugin() { printf '[[plugins]]\nname = "%s"\n%s\n' "$1" "${2:-}"; }
printf '| %s, seq_len %s | offload | device peak | host ledger | 24 GiB | 80 GiB |\n' "$preset" \
  "$seq_len"
printf '| --- | --- | ---: | ---: | --- | --- |\n'
for extras in "fp32|" "amp|$(plugin amp)" "checkpoint|$(plugin checkpoint)" \
  "amp + checkpoint|$(plugin amp)
$(plugin checkpoint)" "amp (bf16 weights and state, no masters) + checkpoint|$(plugin amp 'master_weights = false
state_dtype = "bf16"')
$(plugin checkpoint)"; do
  for tier in none host nvme "host + parameters" "nvme + parameters" "nvme + parameters nvme"; do
    case $tier in
    nvme*) table=$(plugin offload "optimizer = \"nvme\"
nvme_path = \"$dir\"") ;;
    *) table=$(plugin offload "optimizer = \"${tier%% *}\"") ;;
    esac
    case $tier in
    *parameters) table="$(plugin zero3)
$table
parameters = \"host\"" ;;
    *"parameters nvme") table="$(plugin zero3)
$table
parameters = \"nvme\"" ;;
    esac
    fits=()
    dev="" host=""
    for limit in 24GiB 80GiB; do
      printf '[model]\npreset = "%s"\nseq_len = %s\n[train]\nmicro_batch = 1\n[device]\nkind = "cuda"\nmemory_limit = "%s"\n%s\n%s\n' \
        "$preset" "$seq_len" "$limit" "${extras#*|}" "$table" >"$dir/run.toml"
      rc=0
      out=$("$bin" plan "$dir/run.toml" 2>&1) || rc=$?
      dev=$(awk '$1 == "total" { $1 = ""; sub(/^ +/, ""); print; exit }' <<<"$out")
      host=$(awk '/estimated host memory/ { on = 1 } on && $1 == "total" { $1 = ""; sub(/^ +/, ""); print; exit }' <<<"$out")
      if [ $rc = 2 ]; then
        fits+=("refused (exit 2)")
        dev="—"
      elif grep -q "^fits memory_limit" <<<"$out"; then fits+=(fits); else fits+=("does not fit"); fi
    done
    printf '| %s | %s | %s | %s | %s | %s |\n' "${extras%%|*}" "$tier" "$dev" "${host:-0}" \
      "${fits[0]}" "${fits[1]}"
  done
done
