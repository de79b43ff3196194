#!/usr/bin/env bash
# The third example plugin, examples/plugins/early_stopping (ABI 1.6), end to end from the installed
# package: build it with find_package(headroom), train on text whose validation tail ('x' / 'y')
# the training data never has, so that the validation loss soon stops improving; check that the
# run stops with exit code 7 and the plugin's message right after the evaluation that used up its
# patience, that each evaluation the plugin saw (EVAL_END) carried the metrics' val_loss, and that
# the snapshot written at the stop resumes to the weights of an unbroken run, bitwise.
# KEEP=1 keeps the temporary folder.
source "$(dirname "$0")/common.sh"

build_example early_stopping

# 900 bytes of 'a'..'m', then 100 of 'x' / 'y': val_fraction 0.1 holds out exactly the latter.
awk 'BEGIN { for (i = 0; i < 900; i++) printf "%c", 97 + i % 13;
             for (i = 0; i < 100; i++) printf "%s", (i % 2 ? "x" : "y") }' >"$tmp/data.txt"

# config FILE SNAPSHOT_DIR PATIENCE EVALS_FILE
config() {
  {
    printf '[model]\nn_layer = 1\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 256\n\n'
    printf '[train]\nsteps = 200\nmicro_batch = 1\nlr = 1e-2\nlr_schedule = "constant"\nwarmup_steps = 0\n'
    printf 'eval_every = 2\neval_batches = 2\n\n'
    printf '[data]\nkind = "text"\npath = "%s"\nval_fraction = 0.1\n\n' "$tmp/data.txt"
    printf '[snapshot]\nevery = 50\ndir = "%s"\n\n' "$2"
    printf '[[plugins]]\nname = "early_stopping"\npath = "%s"\npatience = %s\nfile = "%s"\n' \
      "$so" "$3" "$4"
  } >"$1"
}

# --- Stopped by the plugin ------------------------------------------------------------------------
config "$tmp/stop.toml" "$tmp/snaps" 3 "$tmp/evals.txt"
set +e
"$headroom" train "$tmp/stop.toml" --metrics "$tmp/stop.jsonl" >"$tmp/stop.log" 2>&1
rc=$?
set -e
[ "$rc" -eq 7 ] || { cat "$tmp/stop.log"; fail "the stopped run exited $rc, expected 7"; }
line=$(grep "stopped by plugin 'early_stopping' after step " "$tmp/stop.log") ||
  { cat "$tmp/stop.log"; fail "no message naming the plugin"; }
stop=$(sed -E "s/.*after step ([0-9]+) of 200.*/\1/" <<<"$line")
grep -q "the validation loss has not improved on .* for 3 evaluations; snapshot .*written (resume with --resume $tmp/snaps)" <<<"$line" ||
  fail "the message lacks the plugin's reason or the snapshot: $line"
[ "$stop" -lt 200 ] || fail "the run did not stop early: $line"
# The plugin's last evaluation is the stop's step, with its patience used up; the metrics have
# every step up to it and none after, and the snapshot of that step is there.
read -r last_step _ _ last_bad < <(tail -n 1 "$tmp/evals.txt")
[ "$last_step" = "$stop" ] && [ "$last_bad" = 3 ] ||
  fail "the last evaluation ($(tail -n 1 "$tmp/evals.txt")) is not the stop's (step $stop, bad 3)"
[ "$(wc -l <"$tmp/stop.jsonl")" -eq "$stop" ] || fail "the metrics do not have exactly $stop rows"
test -f "$tmp/snaps/$(printf 'step_%012d.hrsnap' "$stop")" || fail "no snapshot of step $stop"
# Every EVAL_END loss is the val_loss of its step's metrics row (numerically equal doubles).
awk 'NR == FNR {
       if (match($0, /"val_loss":[^,}]+/)) {
         v = substr($0, RSTART + 11, RLENGTH - 11)
         match($0, /"step":[0-9]+/)
         val[substr($0, RSTART + 7, RLENGTH - 7)] = v
       }
       next
     }
     { n++; if (!($1 in val) || val[$1] + 0 != $2 + 0) { print "step " $1 ": " $2 " vs " val[$1]; bad = 1 } }
     END { if (n == 0 || bad) exit 1 }' "$tmp/stop.jsonl" "$tmp/evals.txt" ||
  fail "the plugin's evaluation losses are not the metrics' val_loss"

# --- Resumed from the stop, with more patience: the unbroken run's weights, bitwise -------------
config "$tmp/resume.toml" "$tmp/snaps" 1000 "$tmp/evals_resumed.txt"
"$headroom" train -q "$tmp/resume.toml" --resume "$tmp/snaps" --save-weights "$tmp/resumed.safetensors" \
  >"$tmp/resumed.log" 2>&1 || { cat "$tmp/resumed.log"; fail "the resumed run"; }
config "$tmp/whole.toml" "$tmp/snaps_whole" 1000 "$tmp/evals_whole.txt"
"$headroom" train -q "$tmp/whole.toml" --save-weights "$tmp/whole.safetensors" \
  >"$tmp/whole.log" 2>&1 || { cat "$tmp/whole.log"; fail "the unbroken run"; }
cmp "$tmp/whole.safetensors" "$tmp/resumed.safetensors" ||
  fail "the run resumed from the stop's snapshot differs from the unbroken run"

echo "early_stopping stopped the run after step $stop (exit 7); resumed, it matches the unbroken run"
