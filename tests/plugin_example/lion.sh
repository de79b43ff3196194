#!/usr/bin/env bash
# The fourth example plugin, examples/plugins/lion (ABI 1.7, headroom.ops/1), end to end from the
# installed package: build it with find_package(headroom), train with it, and check that the loss
# falls and that every step's host_syncs (the metrics') equal the built-in AdamW run's: the Lion
# update runs on the device and adds no host wait. KEEP=1 keeps the temporary folder.
source "$(dirname "$0")/common.sh"

build_example lion

# config FILE [PLUGIN TABLE]
config() {
  {
    printf '[model]\nn_layer = 2\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 64\n\n'
    printf '[train]\nsteps = 30\nmicro_batch = 2\nlr = 1e-3\nwarmup_steps = 2\n\n'
    printf '%s' "${2:-}"
  } >"$1"
}

config "$tmp/lion.toml" "$(printf '[[plugins]]\nname = "lion"\npath = "%s"\nbeta1 = 0.9\nbeta2 = 0.99\nweight_decay = 0.1\n' "$so")"
"$headroom" train -q "$tmp/lion.toml" --metrics "$tmp/lion.jsonl" >"$tmp/lion.log" 2>&1 ||
  { cat "$tmp/lion.log"; fail "training with lion"; }
config "$tmp/adamw.toml"
"$headroom" train -q "$tmp/adamw.toml" --metrics "$tmp/adamw.jsonl" >"$tmp/adamw.log" 2>&1 ||
  { cat "$tmp/adamw.log"; fail "training with the built-in AdamW"; }

field() { # field NAME FILE: the NAME of every row, one a line
  sed -E "s/.*\"$1\":([^,}]+).*/\1/" "$2"
}
[ "$(wc -l <"$tmp/lion.jsonl")" -eq 30 ] || fail "lion's run does not have 30 metrics rows"
first=$(field loss "$tmp/lion.jsonl" | head -n 1)
last=$(field loss "$tmp/lion.jsonl" | tail -n 1)
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.1) }' ||
  fail "lion's loss did not fall: $first -> $last"
cmp <(field host_syncs "$tmp/lion.jsonl") <(field host_syncs "$tmp/adamw.jsonl") ||
  fail "lion's host_syncs per step differ from the built-in AdamW's: $(field host_syncs "$tmp/lion.jsonl" | tr '\n' ' ') vs $(field host_syncs "$tmp/adamw.jsonl" | tr '\n' ' ')"

echo "lion trained on the device: loss $first -> $last, host syncs a step $(field host_syncs "$tmp/lion.jsonl" | sort -u | tr '\n' ' ')(the built-in AdamW's)"
