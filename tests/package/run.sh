#!/usr/bin/env bash
# cmake --install to a temporary prefix, then build tests/package against it with find_package.
set -euo pipefail
build=$1
src=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
test -x "$tmp/prefix/bin/headroom"
test -f "$tmp/prefix/include/headroom/plugin.h"
cmake -S "$src" -B "$tmp/build" -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/build" >/dev/null
out=$("$tmp/build/consumer_host")
[ "$out" = "64.00 MiB" ] || { echo "consumer_host printed '$out'"; exit 1; }
version=$("$tmp/prefix/bin/headroom" --version)
echo "$version"
# A CUDA build installs its backend's library beside libheadroom, and the installed host finds it:
# asking for "cuda" on a machine without a GPU then says no device is present, not that the
# library is missing (core/device/cuda_module.h).
if [[ $version == *"CUDA toolkit: ON"* ]]; then
  lib=$(dirname "$(find "$tmp/prefix" -name libheadroom.so | head -1)")
  test -f "$lib/libheadroom_cuda.so" || { echo "libheadroom_cuda.so is not installed in $lib"; exit 1; }
  printf '[model]\nn_layer = 1\nn_head = 1\nn_embd = 8\nseq_len = 4\nvocab_size = 16\n[data]\nkind = "synthetic"\n[device]\nkind = "cuda"\n' > "$tmp/cuda.toml"
  set +e
  out=$("$tmp/prefix/bin/headroom" train "$tmp/cuda.toml" --set train.steps=1 2>&1)
  rc=$?
  set -e
  if [ $rc -ne 0 ]; then
    [[ $out == *"libheadroom_cuda.so"* ]] && { echo "the installed host does not load its CUDA library: $out"; exit 1; }
    echo "installed host without a GPU: $out"
  fi
fi
echo "installed package found and used"
