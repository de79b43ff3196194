#!/usr/bin/env bash
# The second example plugin, examples/plugins/loss_spike_guard, end to end from the installed
# package: build it with find_package(headroom), train on a text file whose bytes are "ab" repeated
# except for a stretch of noise that steps 25 and 26 (and only they) read, and check that the
# guard vetoes exactly those two steps; then stop at step 30 and resume from its snapshot: the
# final weights match the uninterrupted run's bitwise (the guard's state is in the snapshot,
# through headroom.state/1). Also: the installed `headroom plugins` lists each plugin once.
# KEEP=1 keeps the temporary folder.
source "$(dirname "$0")/common.sh"

build_example loss_spike_guard

# --- The installed host lists every plugin once (it does not also search the build tree) -------
"$headroom" plugins >"$tmp/plugins.log" 2>&1 || { cat "$tmp/plugins.log"; fail "headroom plugins"; }
dups=$(grep -E '^[a-z0-9_]+ [0-9]+\.[0-9]+\.[0-9]+ ' "$tmp/plugins.log" | awk '{print $1}' | sort | uniq -d)
[ -z "$dups" ] || { cat "$tmp/plugins.log"; fail "the installed headroom plugins lists twice: $dups"; }
grep -qE '^amp |^checkpoint |^defrag_allocator ' "$tmp/plugins.log" ||
  { cat "$tmp/plugins.log"; fail "the installed headroom plugins lists none of the installed plugins"; }

# --- The data: 16 bytes a step (micro_batch 1, seq_len 16); steps 25 and 26 read noise ----------
{
  for _ in $(seq 192); do printf 'ab'; done        # steps 1..24: bytes 0..383
  printf 'a'                                        # byte 384: the last target of step 24
  printf 'Qz7#Kp2@Xw9!Lm4$Rt8%%Vy1^Nc6&Jd3'        # bytes 385..415: steps 25 and 26
  for _ in $(seq 130); do printf 'ab'; done        # from byte 416: steps 27..
} >"$tmp/data.txt"

config() {
  {
    printf '[model]\nn_layer = 1\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 256\n\n'
    printf '[train]\nsteps = 40\nmicro_batch = 1\nlr = 1e-2\nlr_schedule = "constant"\nwarmup_steps = 0\n\n'
    printf '[data]\nkind = "text"\npath = "%s"\n\n' "$tmp/data.txt"
    printf '[snapshot]\nevery = 10\ndir = "%s"\n\n' "$2"
    printf '[[plugins]]\nname = "loss_spike_guard"\npath = "%s"\nfactor = 3.0\nwarmup_steps = 10\nfile = "%s"\n' \
      "$so" "$3"
  } >"$1"
}

config "$tmp/full.toml" "$tmp/snaps_full" "$tmp/full_vetoes.txt"
"$headroom" train "$tmp/full.toml" --metrics "$tmp/full.jsonl" --save-weights "$tmp/full.safetensors" \
  >"$tmp/full.log" 2>&1 || { cat "$tmp/full.log"; fail "the uninterrupted run"; }
skipped=$(grep -o '"skipped":true' "$tmp/full.jsonl" | wc -l)
vetoed=$(cut -d' ' -f1 "$tmp/full_vetoes.txt" | tr '\n' ' ')
[ "$vetoed" = "25 26 " ] || { cat "$tmp/full.log"; fail "the guard vetoed steps '$vetoed', expected '25 26 '"; }
[ "$skipped" -eq 2 ] || fail "the metrics say $skipped skipped steps, expected 2"
grep -q 'update skipped by loss_spike_guard: loss spike' "$tmp/full.log" || { cat "$tmp/full.log"; fail "no veto in the log"; }
grep -q 'lr 0.01, 16 tokens' "$tmp/full.log" || { cat "$tmp/full.log"; fail "the veto's log line lacks headroom.step/1's lr and tokens"; }

# --- Stopped at step 30, resumed to 40: the same weights, bitwise -----------------------------
config "$tmp/part.toml" "$tmp/snaps_part" "$tmp/part_vetoes.txt"
"$headroom" train -q "$tmp/part.toml" --set train.steps=30 >"$tmp/part.log" 2>&1 ||
  { cat "$tmp/part.log"; fail "the first half"; }
"$headroom" train -q "$tmp/part.toml" --resume "$tmp/snaps_part" --save-weights "$tmp/resumed.safetensors" \
  >"$tmp/resumed.log" 2>&1 || { cat "$tmp/resumed.log"; fail "the resumed half"; }
cmp "$tmp/full.safetensors" "$tmp/resumed.safetensors" ||
  fail "the resumed run's weights differ from the uninterrupted run's"
[ "$(cut -d' ' -f1 "$tmp/part_vetoes.txt" | tr '\n' ' ')" = "25 26 " ] || fail "the stopped-and-resumed run vetoed other steps"

echo "loss_spike_guard vetoed exactly steps 25 and 26; the resumed run matches the uninterrupted one"
