#!/usr/bin/env bash
# The CPU kernels on 3 OpenMP threads under ThreadSanitizer (tests/tsan/omp_kernels.cpp): built
# with clang and LLVM's libomp, whose Archer tool makes OpenMP's synchronisation visible to TSan
# (the pass's GCC build cannot: libgomp is not instrumented, so it runs one thread). First a planted
# race must be reported, then the kernels must run clean. Exit 77 (skipped) without clang++ or
# libarcher (clang's libomp-dev).
# Usage: tests/tsan/omp_kernels.sh SOURCE_DIR WORK_DIR
set -uo pipefail
src=$1 work=$2
cxx=$(command -v clang++ || true)
archer=""
for d in /usr/lib/llvm-*/lib; do
  [ -e "$d/libarcher.so" ] && [ -e "$d/libomp.so" ] && archer=$d
done
if [ -z "$cxx" ] || [ -z "$archer" ]; then
  echo "skipped: no clang++ with libomp and libarcher (clang's libomp-dev) to build the kernels with"
  exit 77
fi
mkdir -p "$work"
bin="$work/omp_kernels"
# OpenBLAS for the GEMMs (one thread of its own: OPENBLAS_NUM_THREADS below); oneDNN would bring
# GCC's libgomp into the process beside libomp.
"$cxx" -std=c++17 -O1 -g -fsanitize=thread -fopenmp=libomp -DHEADROOM_GEMM_OPENBLAS \
  -I"$src" -isystem /usr/include/x86_64-linux-gnu/openblas-pthread \
  "$src/tests/tsan/omp_kernels.cpp" -o "$bin" -L"$archer" -Wl,-rpath,"$archer" -lopenblas ||
  { echo "FAIL: omp_kernels.cpp did not build"; exit 1; }
# ignore_noninstrumented_modules: libomp's own accesses (not instrumented) are not reported, as
# Archer asks; everything compiled here is.
run() {
  env -u TSAN_OPTIONS OMP_NUM_THREADS=3 OPENBLAS_NUM_THREADS=1 \
    OMP_TOOL_LIBRARIES="$archer/libarcher.so" ARCHER_OPTIONS=verbose=1 \
    TSAN_OPTIONS="ignore_noninstrumented_modules=1:halt_on_error=1:exitcode=66" "$bin" "$@" 2>&1
}
out=$(run --plant)
rc=$?
if [ $rc -ne 66 ] || ! grep -q "ThreadSanitizer: data race" <<<"$out"; then
  printf '%s\n' "$out"
  echo "FAIL: the planted race was not reported (exit $rc): the check would not see one"
  exit 1
fi
echo "the planted race is reported, as it must be"
out=$(run)
rc=$?
printf '%s\n' "$out"
[ $rc -eq 0 ] || { echo "FAIL: ThreadSanitizer reported the kernels (exit $rc)"; exit 1; }
grep -q "Archer detected OpenMP application with TSan" <<<"$out" ||
  { echo "FAIL: Archer did not say it was loaded: TSan had no view of OpenMP's synchronisation"; exit 1; }
echo "the kernels ran clean on 3 threads"
