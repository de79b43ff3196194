#!/usr/bin/env bash
# scripts/check-layout passes on this tree, and fails — naming the file and line — on copies of it
# with a room including one above it, with a plugin including a core header, and with a file
# outside every room.
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
check=$src/scripts/check-layout
"$check" "$src"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
expect_failure() {  # label, expected message part
  local out
  if out=$("$check" "$tmp/tree" 2>&1); then
    echo "FAIL: check-layout passed a tree with $1" >&2
    exit 1
  fi
  if [[ $out != *"$2"* ]]; then
    echo "FAIL: for $1, check-layout said: $out (expected: $2)" >&2
    exit 1
  fi
  echo "ok: $1 -> $out"
}
fresh() {
  rm -rf "$tmp/tree"
  mkdir -p "$tmp/tree"
  cp -r "$src/core" "$src/kernels" "$src/plugins" "$tmp/tree/"
}

fresh
echo '#include "core/run/trainer.h"' >> "$tmp/tree/core/model/model.h"
expect_failure "model/ including run/" "core/model/model.h:"

fresh
echo '#include "core/device/device.h"' >> "$tmp/tree/plugins/amp/amp.cpp"
expect_failure "a plugin including a core header" "plugins/amp/amp.cpp:"

fresh
echo '#include "plugins/common/bf16.h"' >> "$tmp/tree/core/optim/optim.cpp"
expect_failure "core including a plugin header" "core/optim/optim.cpp:"

fresh
echo '#include "core/config/config.h"' > "$tmp/tree/core/loose.cpp"
expect_failure "a file outside every room" "core/loose.cpp: a file directly in core/"
