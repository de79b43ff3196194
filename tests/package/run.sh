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
"$tmp/prefix/bin/headroom" --version
echo "installed package found and used"
