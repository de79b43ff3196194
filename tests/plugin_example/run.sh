#!/usr/bin/env bash
# The example third-party plugin end to end, as its author would use it: cmake --install headroom to
# a temporary prefix, build examples/plugins/memory_csv against it with find_package(headroom), train
# a tiny model with the INSTALLED host and the plugin listed in the config, and check the CSV it
# wrote. Also: the plugin exports only hr_plugin_entry; `every` works; the host finds it without a
# path (HEADROOM_PLUGIN_PATH, then installed into <prefix>/lib/headroom/plugins) and lists it in
# `headroom plugins`; its errors reach the user with the right exit code.
# KEEP=1 keeps the temporary folder for a look after a failure.
source "$(dirname "$0")/common.sh"

# --- Install, then build the plugin outside the tree; it exports hr_plugin_entry only ----------
build_example memory_csv

# --- Train with it ------------------------------------------------------------------------------
# config FILE [extra plugin keys...]: a tiny model, 3 steps, memory_csv from $plugin_path (when
# set: the built .so; when empty, the host searches for memory_csv.so).
plugin_path=$so
config() {
  local out=$1
  shift
  {
    printf '[model]\nn_layer = 1\nn_head = 1\nn_embd = 8\nseq_len = 4\nvocab_size = 16\n\n'
    printf '[train]\nsteps = 3\nmicro_batch = 1\n\n'
    printf '[[plugins]]\nname = "memory_csv"\n'
    [ -z "$plugin_path" ] || printf 'path = "%s"\n' "$plugin_path"
    local kv
    for kv in "$@"; do printf '%s\n' "$kv"; done
  } >"$out"
}

header=step,allocs,frees,bytes_allocated,bytes_freed,live_bytes,peak_bytes,parameters,gradients,optimizer,activations,workspace,data,communication

config "$tmp/train.toml" "file = \"$tmp/mem.csv\""
rc=0
"$headroom" train "$tmp/train.toml" >"$tmp/train.log" 2>&1 || rc=$?
[ "$rc" -eq 0 ] || { cat "$tmp/train.log"; fail "headroom train exited $rc"; }
test -f "$tmp/mem.csv" || { cat "$tmp/train.log"; fail "no CSV written"; }
[ "$(head -n 1 "$tmp/mem.csv")" = "$header" ] || { cat "$tmp/mem.csv"; fail "wrong CSV header"; }
rows=$(tail -n +2 "$tmp/mem.csv" | wc -l)
[ "$rows" -eq 3 ] || { cat "$tmp/mem.csv"; fail "$rows data rows, expected 3"; }
# Per row: the step (1, 2, 3), 14 columns, live_bytes > 0, peak >= live, and the live bytes by
# category adding up to live_bytes. The first row: allocations were counted.
tail -n +2 "$tmp/mem.csv" | awk -F, '
  NF != 14 { printf "row %d: %d columns\n", NR, NF; bad = 1 }
  $1 != NR { printf "row %d: step %s\n", NR, $1; bad = 1 }
  NR == 1 && !($2 > 0) { printf "row 1: allocs %s, expected > 0\n", $2; bad = 1 }
  !($6 > 0) { printf "row %d: live_bytes %s, expected > 0\n", NR, $6; bad = 1 }
  $7 < $6 { printf "row %d: peak_bytes %s < live_bytes %s\n", NR, $7, $6; bad = 1 }
  { s = 0; for (i = 8; i <= 14; ++i) s += $i
    if (s != $6) { printf "row %d: categories add up to %d, live_bytes %s\n", NR, s, $6; bad = 1 } }
  END { exit bad }' || { cat "$tmp/mem.csv"; fail "CSV rows"; }

# every = 2: one row, for step 2.
config "$tmp/every.toml" "file = \"$tmp/every.csv\"" "every = 2"
rc=0
"$headroom" train "$tmp/every.toml" >"$tmp/every.log" 2>&1 || rc=$?
[ "$rc" -eq 0 ] || { cat "$tmp/every.log"; fail "every = 2: headroom train exited $rc"; }
[ "$(tail -n +2 "$tmp/every.csv" | cut -d, -f1 | tr '\n' ' ')" = "2 " ] || {
  cat "$tmp/every.csv"
  fail "every = 2: expected one row, for step 2"
}

# --- Found without a path: on HEADROOM_PLUGIN_PATH, and installed next to the host -------------
plugin_path=
config "$tmp/search.toml" "file = \"$tmp/search.csv\""
HEADROOM_PLUGIN_PATH=$tmp/build "$headroom" train -q "$tmp/search.toml" >"$tmp/search.log" 2>&1 ||
  { cat "$tmp/search.log"; fail "HEADROOM_PLUGIN_PATH: headroom train failed"; }
[ "$(tail -n +2 "$tmp/search.csv" | wc -l)" -eq 3 ] || fail "HEADROOM_PLUGIN_PATH: no CSV rows"
HEADROOM_PLUGIN_PATH=$tmp/build "$headroom" plugins >"$tmp/plugins.log" 2>&1 ||
  { cat "$tmp/plugins.log"; fail "headroom plugins failed"; }
if ! grep -q "^memory_csv 1.0.0 " "$tmp/plugins.log" ||
  ! grep -q "events: STEP_END,ALLOC,FREE" "$tmp/plugins.log"; then
  cat "$tmp/plugins.log"
  fail "headroom plugins does not list memory_csv 1.0.0 with its events"
fi
cmake --install "$tmp/build" --prefix "$tmp/prefix" >/dev/null
ls "$tmp"/prefix/lib*/headroom/plugins/memory_csv.so >/dev/null 2>&1 || fail "cmake --install put no plugin in lib/headroom/plugins"
rm -f "$tmp/search.csv"
"$headroom" train -q "$tmp/search.toml" >"$tmp/installed.log" 2>&1 ||
  { cat "$tmp/installed.log"; fail "installed plugin: headroom train failed"; }
[ "$(tail -n +2 "$tmp/search.csv" | wc -l)" -eq 3 ] || fail "installed plugin: no CSV rows"
plugin_path=$so

# --- Its errors reach the user ------------------------------------------------------------------
# expect_error NAME CODE PATTERN [plugin keys...]: train exits CODE and says PATTERN.
expect_error() {
  local name=$1 code=$2 pattern=$3
  shift 3
  config "$tmp/$name.toml" "$@"
  rc=0
  "$headroom" train "$tmp/$name.toml" >"$tmp/$name.log" 2>&1 || rc=$?
  [ "$rc" -eq "$code" ] || { cat "$tmp/$name.log"; fail "$name: exit $rc, expected $code"; }
  grep -q -- "$pattern" "$tmp/$name.log" || { cat "$tmp/$name.log"; fail "$name: no '$pattern' in the output"; }
  grep -q memory_csv "$tmp/$name.log" || { cat "$tmp/$name.log"; fail "$name: the plugin is not named"; }
}
expect_error missing_file 2 "file"
expect_error every_zero 2 "must be >= 1" "file = \"$tmp/x.csv\"" "every = 0"
expect_error unknown_key 2 "evry" "file = \"$tmp/x.csv\"" "evry = 2"
expect_error unopenable 2 "No such file or directory" "file = \"$tmp/no/such/dir/x.csv\""

echo "memory_csv built against the installed package, loaded by the installed host, wrote its CSV"
