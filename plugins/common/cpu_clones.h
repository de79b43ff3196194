// HR_PLUGIN_CPU_CLONES: a CPU kernel of a plugin compiled for x86-64-v4 (AVX-512), v3 (AVX2,
// FMA) and the baseline, the loader picking one at start-up, as the host's element-wise kernels
// are (kernels/cpu/parallel.h, which a plugin may not include). A plugin that uses it compiles
// with -ffp-contract=off and without -ffast-math, so every clone computes the same bits. Not in
// the sanitizer builds, where ifuncs and instrumentation mix badly (an instrumented resolver runs
// before the sanitizer's runtime is up), nor with other compilers: the baseline alone there.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define HR_PLUGIN_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HR_PLUGIN_CPU_CLONES
#endif
