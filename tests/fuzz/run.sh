#!/usr/bin/env bash
# Builds every tests/fuzz/*_fuzz.cpp as a libFuzzer binary with AddressSanitizer and
# UndefinedBehaviorSanitizer, and runs each for SECONDS (default 20).
#
#   tests/fuzz/run.sh [SECONDS]
#
# A target names the core sources it links (files, or patterns such as core/plugin_host/*.cpp) in
# a line at its top:
#   // fuzz-sources: core/model/safetensors.cpp core/config/config.cpp
# and, if those need libraries beyond toml++, the pkg-config packages that provide them, and any
# other compiler flags (words, no shell quoting: -DNAME="x" defines NAME as the literal "x"):
#   // fuzz-pkgs: openblas
#   // fuzz-flags: -DHEADROOM_BUILD_PLUGIN_DIR="/nonexistent"
# It is seeded from tests/fuzz/corpus/NAME/ (NAME = the file name without _fuzz.cpp) and, if there is
# one, the libFuzzer dictionary tests/fuzz/NAME.dict. The corpus folder is only read; what the run
# discovers goes to a scratch folder. A crash leaves the input that caused it in that folder, whose
# path is printed, and the script exits non-zero.
#
# Every source is compiled once into an object at each level it is needed (a source two targets
# link is shared: every object gets all the targets' package and extra flags), HEADROOM_FUZZ_JOBS
# (default: the cores) at a time, through ccache when there is one; then each target is linked
# and run. alloc_trace alone links 30 core sources.
#
# Needs clang++ (Debian: clang, or clang-14 for clang++-14) and the sanitizer and libFuzzer runtimes
# (libclang-rt-14-dev). Without them it exits 77. HEADROOM_FUZZ_CXX picks another compiler.
set -euo pipefail

seconds="${1:-20}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"

cxx="${HEADROOM_FUZZ_CXX:-}"
if [ -z "$cxx" ]; then
  for c in clang++ clang++-14; do
    if command -v "$c" >/dev/null 2>&1; then
      cxx="$c"
      break
    fi
  done
fi
if [ -z "$cxx" ]; then
  echo "fuzz: no clang++ or clang++-14 on PATH; install the Debian packages clang libclang-rt-14-dev" >&2
  exit 77
fi

work="$(mktemp -d /tmp/headroom-fuzz.XXXXXX)"
keep=0
cleanup() { [ "$keep" = 1 ] || rm -rf "$work"; }
trap cleanup EXIT

# The same flags as the libheadroom build for its dependencies (toml++ is compiled, not header-only).
dep_cflags="$(pkg-config --cflags tomlplusplus nlohmann_json 2>/dev/null || true)"
dep_libs="$(pkg-config --libs tomlplusplus 2>/dev/null || true)"
cxxflags=(-std=c++17 -g1 -O1 -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined
          -fno-sanitize-recover=all -I"$root" -I"$root/plugin_api/include" -pthread)
# The objects: instrumented as the targets are, without libFuzzer's main; the optimisation level
# is per object (below). The builds were most of this script's time: -O0 compiles
# core/model/model.cpp in 26 s where -O1 takes 70 (2 loaded cores, 2026-12-04), but an input runs
# up to 10 times slower through code built at -O0, so the code under test stays at -O1.
objflags=(-std=c++17 -g1 -fno-omit-frame-pointer -fsanitize=fuzzer-no-link,address,undefined
          -fno-sanitize-recover=all -I"$root" -I"$root/plugin_api/include" -pthread)
jobs="${HEADROOM_FUZZ_JOBS:-$(nproc 2>/dev/null || echo 2)}"
launcher=()
command -v ccache >/dev/null 2>&1 && launcher=(ccache)

# A clang without the libFuzzer runtime fails at link time with a cryptic message; say which
# package it needs instead.
printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' \
  >"$work/probe.cpp"
if ! "$cxx" "${cxxflags[@]}" "$work/probe.cpp" -o "$work/probe" >"$work/probe.log" 2>&1; then
  cat "$work/probe.log" >&2
  echo "fuzz: $cxx cannot link a libFuzzer target: it needs clang and its libFuzzer and sanitizer" \
    "runtimes (Debian: clang libclang-rt-14-dev)" >&2
  exit 77
fi

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"

shopt -s nullglob
targets=("$here"/*_fuzz.cpp)
if [ ${#targets[@]} -eq 0 ]; then
  echo "fuzz: no tests/fuzz/*_fuzz.cpp" >&2
  exit 1
fi

# Every object is compiled with the union of the targets' packages' flags and extra flags, so that
# a source two targets link (config.cpp, output_file.cpp, ...) is one object at each level.
all_pkgs="" all_flags=""
for src in "${targets[@]}"; do
  pkgs_line="$(grep -m1 '^// fuzz-pkgs:' "$src" || true)"
  [ -z "$pkgs_line" ] || all_pkgs+=" ${pkgs_line#// fuzz-pkgs:}"
  flags_line="$(grep -m1 '^// fuzz-flags:' "$src" || true)"
  [ -z "$flags_line" ] || all_flags+=" ${flags_line#// fuzz-flags:}"
done
pkg_cflags="" pkg_libs=""
if [ -n "$all_pkgs" ]; then
  # shellcheck disable=SC2086  # a word list of package names
  if ! pkg_cflags="$(pkg-config --cflags $all_pkgs)" || ! pkg_libs="$(pkg-config --libs $all_pkgs)"; then
    echo "fuzz: the targets need the pkg-config packages$all_pkgs" >&2
    exit 1
  fi
fi

# Then every target's compile lines (one per object not planned yet), and all of them at once.
mkdir -p "$work/obj"
: >"$work/compiles"
declare -A planned=()
declare -A target_objs=()
for src in "${targets[@]}"; do
  name="$(basename "$src" _fuzz.cpp)"
  sources_line="$(grep -m1 '^// fuzz-sources:' "$src" || true)"
  if [ -z "$sources_line" ]; then
    echo "fuzz: $src has no '// fuzz-sources: core/...' line naming the sources it links" >&2
    exit 1
  fi
  # Each word a file or a pattern under the root (core/plugin_host/*.cpp: every file of a room, so
  # that a file added there needs no edit here).
  sources=()
  read -ra words <<<"${sources_line#// fuzz-sources:}"
  for word in "${words[@]}"; do
    matched=0
    for s in "$root"/$word; do
      [ -f "$s" ] || continue
      sources+=("$s")
      matched=1
    done
    [ "$matched" = 1 ] || { echo "fuzz: $src lists $word, which matches no file" >&2; exit 1; }
  done

  # An object per (source, level): the same source at the same level is compiled once.
  objs=()
  # The target and the first source it names (the code under test) at -O1, as fast as the
  # sanitizers allow; the rest at -O0.
  for s in "$src" "${sources[@]}"; do
    opt=-O0
    [ "$s" = "$src" ] || [ "$s" = "${sources[0]}" ] && opt=-O1
    rel="${s#"$root"/}"
    obj="$work/obj/${rel//\//_}$opt.o"
    objs+=("$obj")
    [ -n "${planned[$obj]:-}" ] && continue
    planned[$obj]=1
    # Five NUL-terminated words an object: its path, the source, the level and the flags' words.
    printf '%s\0%s\0%s\0%s\0%s\0' "$obj" "$s" "$opt" "$pkg_cflags $dep_cflags" "$all_flags" \
      >>"$work/compiles"
  done
  target_objs[$name]="${objs[*]}"
done

# compile OBJ SRC OPT CFLAGS EXTRA: one object (the flags are word lists, unquoted on purpose).
compile_one() {
  # shellcheck disable=SC2086
  if ! "${launcher[@]}" "$cxx" "${objflags[@]}" "$3" $4 $5 -c "$2" -o "$1" 2>"$1.log"; then
    cat "$1.log" >&2
    echo "fuzz: compiling $2 failed" >&2
    return 1
  fi
}
export -f compile_one
# The arrays travel to xargs' shells as words (the root's path has no spaces: see the -I flags).
export cxx OBJFLAGS="${objflags[*]}" LAUNCHER="${launcher[*]}"
echo "fuzz: compiling $(( $(tr -cd '\0' <"$work/compiles" | wc -c) / 5 )) objects, $jobs at a time"
xargs -0 -n 5 -P "$jobs" bash -c '
  read -ra objflags <<<"$OBJFLAGS"; read -ra launcher <<<"$LAUNCHER"
  compile_one "$@"' _ <"$work/compiles" \
  || { echo "fuzz: a build failed" >&2; exit 1; }

failed=()
for src in "${targets[@]}"; do
  name="$(basename "$src" _fuzz.cpp)"
  bin="$work/${name}_fuzz"
  echo "fuzz: linking $name"
  # shellcheck disable=SC2086  # the objects and libraries are word lists
  "$cxx" "${cxxflags[@]}" ${target_objs[$name]} -o "$bin" $dep_libs $pkg_libs -ldl

  corpus="$work/corpus-$name"
  mkdir -p "$corpus"
  args=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
        -artifact_prefix="$work/$name-")
  [ -f "$here/$name.dict" ] && args+=(-dict="$here/$name.dict")
  seeds=()
  [ -d "$here/corpus/$name" ] && seeds+=("$here/corpus/$name")

  echo "fuzz: running $name for ${seconds}s"
  if ! "$bin" "${args[@]}" "$corpus" "${seeds[@]}" >"$work/$name.log" 2>&1; then
    tail -n 60 "$work/$name.log" >&2
    echo "fuzz: $name FAILED; the input that broke it is in $work/$name-*" >&2
    failed+=("$name")
    keep=1
  else
    grep -E 'stat::number_of_executed_units|Done [0-9]+ runs' "$work/$name.log" | tail -n 2
  fi
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: failed: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz: ${#targets[@]} target(s) ran ${seconds}s each without a finding"
