// <immintrin.h> for the plugins' AVX-512 and AVX2 loops (each chosen at run time), without GCC 12's
// false warnings: its AVX-512 intrinsics read an uninitialized "undefined" vector
// (_mm512_undefined_*) that -Wuninitialized flags where they are inlined (GCC bug 105593, fixed
// in 13). Nothing on other targets.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#if !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif
