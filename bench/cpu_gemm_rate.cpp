// fp32 GEMM rate of the CPU libraries headroom can use, on the GEMM shapes of a GPT-2 step
// (docs/results/cpu.md): what picks the CPU backend's default GEMM library.
//
//   build/bin/bench_cpu_gemm_rate [--tokens N] [--n-embd C] [--vocab V] [--threads T]
//                                 [--rounds R] [--json FILE]
//
// Libraries, all in one process and interleaved shape by shape over R rounds (medians taken), so
// the other jobs on a shared machine weigh on each alike:
//   - OpenBLAS (cblas_sgemm) with the core its start-up picked (Debian's 0.3.21 takes its SSE3
//     "Prescott" kernels on CPUs newer than it knows), and, for reference, with the SkylakeX
//     core forced through its dynamic-arch entry points (what OPENBLAS_CORETYPE=SkylakeX does);
//   - BLIS (bli_sgemm), whose start-up picks a sub-configuration from the CPU's features;
//   - oneDNN (dnnl_sgemm), which JIT-compiles for the ISA it finds (PyTorch's CPU library).
// Shapes: each linear layer's forward (N,OC) = (N,C)·(OC,C)^T and both backward GEMMs, dinp
// (N,C) = (N,OC)·(OC,C) and dweight (OC,C) = (N,OC)^T·(N,C), issued exactly as
// kernels/cpu/matmul.h issues them. Every result is checked against a float64 dot product at
// sampled entries, so a rate never comes from a GEMM that computed something else.

#include <blis.h>  // declares the CBLAS interface too; the symbol resolves to OpenBLAS's (linked first)
#include <dnnl.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

// OpenBLAS's own functions.
extern "C" {
void openblas_set_num_threads(int);
char* openblas_get_corename(void);
// OpenBLAS's dynamic-arch start-up (driver/others/dynamic.c): exported, undocumented. The bench
// uses them to time the SkylakeX core beside the default one in the same process.
void gotoblas_dynamic_init(void);
void gotoblas_dynamic_quit(void);
}

namespace {

enum class Lib { kOpenBlasDefault, kOpenBlasSkx, kBlis, kOneDnn };
constexpr Lib kLibs[] = {Lib::kOpenBlasDefault, Lib::kOpenBlasSkx, Lib::kBlis, Lib::kOneDnn};
const char* lib_name(Lib l) {
  switch (l) {
    case Lib::kOpenBlasDefault:
      return "openblas";
    case Lib::kOpenBlasSkx:
      return "openblas-skx";
    case Lib::kBlis:
      return "blis";
    case Lib::kOneDnn:
      return "onednn";
  }
  return "?";
}

std::string openblas_core = "?";
void openblas_select(bool skx) {
  static int current = -1;
  if (current == int(skx)) return;
  if (skx)
    setenv("OPENBLAS_CORETYPE", "SkylakeX", 1);
  else
    unsetenv("OPENBLAS_CORETYPE");
  gotoblas_dynamic_quit();
  gotoblas_dynamic_init();
  current = int(skx);
}

struct Shape {
  std::string name;
  bool ta, tb;
  int m, n, k;
};

// Row-major C (M,N) = op(A)·op(B), beta 0.
void run(Lib lib, const Shape& s, const float* A, const float* B, float* C) {
  const int lda = s.ta ? s.m : s.k, ldb = s.tb ? s.k : s.n, ldc = s.n;
  switch (lib) {
    case Lib::kOpenBlasDefault:
    case Lib::kOpenBlasSkx:
      openblas_select(lib == Lib::kOpenBlasSkx);
      cblas_sgemm(CblasRowMajor, s.ta ? CblasTrans : CblasNoTrans, s.tb ? CblasTrans : CblasNoTrans,
                  s.m, s.n, s.k, 1.0f, A, lda, B, ldb, 0.0f, C, ldc);
      break;
    case Lib::kBlis: {
      float one = 1.0f, zero = 0.0f;
      bli_sgemm(s.ta ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE,
                s.tb ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE, s.m, s.n, s.k, &one,
                const_cast<float*>(A), lda, 1, const_cast<float*>(B), ldb, 1, &zero, C, ldc, 1);
      break;
    }
    case Lib::kOneDnn:
      if (dnnl_sgemm(s.ta ? 'T' : 'N', s.tb ? 'T' : 'N', s.m, s.n, s.k, 1.0f, A, lda, B, ldb, 0.0f,
                     C, ldc) != dnnl_success) {
        std::fprintf(stderr, "dnnl_sgemm failed\n");
        std::exit(1);
      }
      break;
  }
}

uint64_t rng_state = 0x9E3779B97F4A7C15ull;
float next_uniform() {  // xorshift64*, in [-1, 1)
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return float(double((rng_state * 0x2545F4914F6CDD1Dull) >> 11) * (2.0 / 9007199254740992.0) -
               1.0);
}

double check(const Shape& s, const std::vector<float>& A, const std::vector<float>& B,
             const std::vector<float>& C) {
  const int lda = s.ta ? s.m : s.k, ldb = s.tb ? s.k : s.n;
  double num = 0, den = 0;
  for (int t = 0; t < 32; ++t) {
    const int r = int((next_uniform() * 0.5 + 0.5) * s.m) % s.m;
    const int c = int((next_uniform() * 0.5 + 0.5) * s.n) % s.n;
    double ref = 0;
    for (int kk = 0; kk < s.k; ++kk) {
      const double a = s.ta ? A[size_t(kk) * lda + r] : A[size_t(r) * lda + kk];
      const double b = s.tb ? B[size_t(c) * ldb + kk] : B[size_t(kk) * ldb + c];
      ref += a * b;
    }
    const double got = C[size_t(r) * s.n + c];
    if (!std::isfinite(got)) return INFINITY;
    num += (got - ref) * (got - ref);
    den += ref * ref;
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fp32 GEMM rate of OpenBLAS, BLIS and oneDNN on GPT-2's GEMM shapes"};
  int tokens = 1024, n_embd = 768, vocab = 50257, threads = 0, rounds = 3;
  std::string json;
  app.add_option("--tokens", tokens, "rows of the model's GEMMs: micro_batch * seq_len")
      ->check(CLI::PositiveNumber);
  app.add_option("--n-embd", n_embd, "model width C")->check(CLI::PositiveNumber);
  app.add_option("--vocab", vocab, "vocabulary size V (the LM head's width)")
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "threads for every library (default: all cores)");
  app.add_option("--rounds", rounds, "interleaved rounds; the medians are reported")
      ->check(CLI::PositiveNumber);
  app.add_option("--json", json, "also write the results to FILE");
  CLI11_PARSE(app, argc, argv);
  if (threads <= 0) threads = omp_get_num_procs();
  openblas_set_num_threads(threads);
  bli_thread_set_num_threads(threads);
  omp_set_num_threads(threads);  // oneDNN's OpenMP runtime

  const int N = tokens, C = n_embd;
  struct Linear {
    const char* name;
    int in, out;
  };
  const Linear linears[] = {{"qkv", C, 3 * C},
                            {"attn proj", C, C},
                            {"fc", C, 4 * C},
                            {"fc proj", 4 * C, C},
                            {"lm head", C, vocab}};
  std::vector<Shape> shapes;
  for (const Linear& l : linears) {
    shapes.push_back({std::string(l.name) + " fwd", false, true, N, l.out, l.in});
    shapes.push_back({std::string(l.name) + " dinp", false, false, N, l.in, l.out});
    shapes.push_back({std::string(l.name) + " dweight", true, false, l.out, l.in, N});
  }

  openblas_select(false);
  const std::string core_default = openblas_get_corename();
  openblas_select(true);
  const std::string core_skx = openblas_get_corename();
  const dnnl_version_t* dv = dnnl_version();
  std::printf(
      "threads %d; openblas core %s (forced: %s); blis %s, arch %s; onednn %d.%d.%d, "
      "isa %d\n",
      threads, core_default.c_str(), core_skx.c_str(), bli_info_get_version_str(),
      bli_arch_string(bli_arch_query_id()), dv->major, dv->minor, dv->patch,
      int(dnnl_get_effective_cpu_isa()));

  const int nl = int(std::size(kLibs));
  // seconds[shape][lib][round]
  std::vector<std::vector<std::vector<double>>> secs(shapes.size(),
                                                     std::vector<std::vector<double>>(nl));
  std::vector<std::vector<double>> err(shapes.size(), std::vector<double>(nl, 0));
  for (int round = 0; round < rounds; ++round) {
    for (size_t si = 0; si < shapes.size(); ++si) {
      const Shape& s = shapes[si];
      std::vector<float> A(size_t(s.m) * s.k), B(size_t(s.k) * s.n), Cm(size_t(s.m) * s.n);
      for (float& x : A)
        x = next_uniform();
      for (float& x : B)
        x = next_uniform();
      const double flop = 2.0 * s.m * double(s.n) * s.k;
      for (int li = 0; li < nl; ++li) {
        const Lib lib = kLibs[(li + round) % nl];  // rotate who goes first
        std::fill(Cm.begin(), Cm.end(), NAN);
        run(lib, s, A.data(), B.data(), Cm.data());  // warm-up, and the check
        if (round == 0) err[si][size_t(lib)] = check(s, A, B, Cm);
        // Repeat to at least 0.3 s.
        int reps = 0;
        const auto t0 = std::chrono::steady_clock::now();
        double el = 0;
        do {
          run(lib, s, A.data(), B.data(), Cm.data());
          ++reps;
          el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        } while (el < 0.3 && reps < 1000);
        secs[si][size_t(lib)].push_back(el / reps);
        (void)flop;
      }
    }
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("%-18s %6s %6s %6s", "shape (GFLOP/s)", "m", "n", "k");
  for (Lib l : kLibs)
    std::printf(" %13s", lib_name(l));
  std::printf("\n");
  std::vector<double> total(nl, 0);
  double total_flop = 0;
  bool ok = true;
  for (size_t si = 0; si < shapes.size(); ++si) {
    const Shape& s = shapes[si];
    const double flop = 2.0 * s.m * double(s.n) * s.k;
    total_flop += flop;
    std::printf("%-18s %6d %6d %6d", s.name.c_str(), s.m, s.n, s.k);
    for (int li = 0; li < nl; ++li) {
      const double t = median(secs[si][li]);
      total[li] += t;
      const bool good = err[si][li] < 1e-4;
      ok = ok && good;
      std::printf(" %12.1f%s", flop / t / 1e9, good ? " " : "!");
    }
    std::printf("\n");
  }
  std::printf("%-39s", "all shapes, one step's share");
  for (int li = 0; li < nl; ++li)
    std::printf(" %12.1f ", total_flop / total[li] / 1e9);
  std::printf("\n");
  if (!ok) std::printf("! = failed its check (relative error >= 1e-4)\n");
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (!f) return 1;
    std::fprintf(f, "{\"threads\": %d, \"openblas_core\": \"%s\", \"blis_arch\": \"%s\",\n",
                 threads, core_default.c_str(), bli_arch_string(bli_arch_query_id()));
    std::fprintf(f, " \"gflops_all_shapes\": {");
    for (int li = 0; li < nl; ++li)
      std::fprintf(f, "%s\"%s\": %.2f", li ? ", " : "", lib_name(kLibs[li]),
                   total_flop / total[li] / 1e9);
    std::fprintf(f, "}}\n");
    std::fclose(f);
  }
  return ok ? 0 : 1;
}
