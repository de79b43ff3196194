# Sourced by the out-of-tree example tests: $1 is headroom's build folder. Sets root, tmp (removed
# at exit unless KEEP=1), fail(); installs headroom to $tmp/prefix (headroom: its host); and
# build_example NAME builds examples/plugins/NAME against that install with find_package(headroom),
# setting so to the plugin's file and checking that it exports hr_plugin_entry and nothing else.
set -euo pipefail
build=$1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
tmp=$(mktemp -d)
trap '[ -n "${KEEP:-}" ] || rm -rf "$tmp"' EXIT
fail() {
  echo "FAIL: $*" >&2
  exit 1
}

cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
headroom=$tmp/prefix/bin/headroom
test -x "$headroom" || fail "no $headroom after cmake --install"

build_example() {
  local name=$1
  cmake -S "$root/examples/plugins/$name" -B "$tmp/build" -DCMAKE_PREFIX_PATH="$tmp/prefix" \
    >"$tmp/configure.log" 2>&1 || { cat "$tmp/configure.log"; fail "configuring $name"; }
  cmake --build "$tmp/build" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; fail "building $name"; }
  so=$tmp/build/$name.so
  test -f "$so" || fail "the build made no $so"
  local exports
  exports=$(nm -D --defined-only "$so" | awk '{print $NF}')
  [ "$exports" = "hr_plugin_entry" ] ||
    fail "$name.so exports '${exports//$'\n'/ }', not only hr_plugin_entry"
}
