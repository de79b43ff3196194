// GEMM rate through cuBLASLt: the ceiling that MFU is measured against (docs/results/gpu.md).
//
//   build/bin/bench_gemm_rate [--tokens N] [--n-embd C] [--vocab V] [--json FILE]
//
// Times bf16 GEMMs (bf16 in and out, fp32 accumulate: what an amp run's matmuls are) on square
// sizes and on the shapes of one GPT-2 micro-step of N tokens (the four block matmuls and the LM
// head), plus fp32 (no TF32, as headroom's fp32 path runs) and TF32 at 4096^3 for reference.
// The datasheet's rate is a lead; MFU is taken against what this measures on the same card.
//
// Method (docs: .library/device/METHOD.md): inputs are random (never zeros: zeros run faster),
// rotated among several sets so that repeats do not run from L2; each shape is warmed up, then
// timed with CUDA events over batches of launches (a small GEMM is shorter than the launch gap
// otherwise), median of the batches. Every result is checked against a float64 dot product on the
// host at sampled entries, so a rate never comes from a GEMM that computed something else.

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cuda/check.h"

#define LT_CHECK(call)                                                                    \
  do {                                                                                    \
    const cublasStatus_t st_ = (call);                                                    \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                     \
      throw std::runtime_error(std::string(#call) + ": " + cublasLtGetStatusString(st_) + \
                               " (line " + std::to_string(__LINE__) + ")");               \
  } while (0)

namespace {

enum class Kind { kBf16, kFp32, kTf32 };

const char* kind_name(Kind k) {
  return k == Kind::kBf16 ? "bf16" : k == Kind::kFp32 ? "fp32" : "tf32";
}

struct Shape {
  std::string name;
  int m, n, k;  // column-major D (m,n) = op(A) (m,k) · B (k,n); A is a row-major weight (m,k)
  Kind kind;
};

struct Result {
  Shape shape;
  double median_ms = 0, tflops = 0, rel_err = 0;
  bool ok = false;
  std::string error;
};

uint64_t rng_state = 0x9E3779B97F4A7C15ull;
// Uniform in [-1, 1): xorshift64*, fast enough for a few hundred million values.
float next_uniform() {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  const uint64_t r = rng_state * 0x2545F4914F6CDD1Dull;
  return float(double(r >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

uint16_t to_bf16(float f) {  // round to nearest even; no NaN in [-1, 1)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Host copy of one matrix in its storage type, kept as float for the reference.
struct HostMatrix {
  std::vector<float> values;  // what the device holds, widened
  std::vector<uint8_t> bytes;
};

HostMatrix random_matrix(size_t n, Kind kind) {
  HostMatrix h;
  h.values.resize(n);
  const size_t elem = kind == Kind::kBf16 ? 2 : 4;
  h.bytes.resize(n * elem);
  for (size_t i = 0; i < n; ++i) {
    const float f = next_uniform();
    if (kind == Kind::kBf16) {
      const uint16_t b = to_bf16(f);
      std::memcpy(h.bytes.data() + 2 * i, &b, 2);
      h.values[i] = from_bf16(b);
    } else {
      std::memcpy(h.bytes.data() + 4 * i, &f, 4);
      h.values[i] = f;
    }
  }
  return h;
}

Result measure(cublasLtHandle_t lt, void* workspace, size_t workspace_bytes, const Shape& s) {
  Result res;
  res.shape = s;
  const cudaDataType_t dt = s.kind == Kind::kBf16 ? CUDA_R_16BF : CUDA_R_32F;
  const cublasComputeType_t ct =
      s.kind == Kind::kTf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const size_t elem = s.kind == Kind::kBf16 ? 2 : 4;
  const size_t a_n = size_t(s.m) * s.k, b_n = size_t(s.k) * s.n, d_n = size_t(s.m) * s.n;
  const size_t set_bytes = (a_n + b_n + d_n) * elem;
  // Enough input sets that one pass over them is several times H200's 60 MB of L2.
  const size_t l2ish = size_t(256) << 20;
  const int sets = int(std::clamp<size_t>((l2ish + set_bytes - 1) / set_bytes, 1, 8));

  std::vector<void*> A(sets, nullptr), B(sets, nullptr), D(sets, nullptr);
  HostMatrix ha, hb;  // set 0's inputs, for the check
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  try {
    for (int i = 0; i < sets; ++i) {
      CUDA_CHECK(cudaMalloc(&A[i], a_n * elem));
      CUDA_CHECK(cudaMalloc(&B[i], b_n * elem));
      CUDA_CHECK(cudaMalloc(&D[i], d_n * elem));
      HostMatrix a = random_matrix(a_n, s.kind), b = random_matrix(b_n, s.kind);
      CUDA_CHECK(cudaMemcpy(A[i], a.bytes.data(), a.bytes.size(), cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemcpy(B[i], b.bytes.data(), b.bytes.size(), cudaMemcpyHostToDevice));
      // Poison: all bits set is NaN in bf16 and fp32, so an unwritten output fails the check.
      CUDA_CHECK(cudaMemset(D[i], 0xFF, d_n * elem));
      if (i == 0) {
        ha = std::move(a);
        hb = std::move(b);
      }
    }
    // A is a row-major (m,k) weight: column-major (k,m), used transposed, as headroom's
    // matmul_forward issues it.
    LT_CHECK(cublasLtMatmulDescCreate(&op, ct, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    LT_CHECK(cublasLtMatrixLayoutCreate(&la, dt, s.k, s.m, s.k));
    LT_CHECK(cublasLtMatrixLayoutCreate(&lb, dt, s.k, s.n, s.k));
    LT_CHECK(cublasLtMatrixLayoutCreate(&ld, dt, s.m, s.n, s.m));
    LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                  &workspace_bytes, sizeof(workspace_bytes)));
    cublasLtMatmulHeuristicResult_t heur{};
    int found = 0;
    LT_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 1, &heur, &found));
    if (found == 0) throw std::runtime_error("cublasLtMatmulAlgoGetHeuristic found no algorithm");

    const float alpha = 1.0f, beta = 0.0f;
    auto launch = [&](int i) {
      LT_CHECK(cublasLtMatmul(lt, op, &alpha, A[i], la, B[i], lb, &beta, D[i], ld, D[i], ld,
                              &heur.algo, workspace, workspace_bytes, nullptr));
    };
    // The check first: set 0's output from its first launch.
    launch(0);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint8_t> dbytes(d_n * elem);
    CUDA_CHECK(cudaMemcpy(dbytes.data(), D[0], dbytes.size(), cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    bool finite = true;
    for (int t = 0; t < 64; ++t) {
      const size_t r = size_t((double(next_uniform()) * 0.5 + 0.5) * s.m) % size_t(s.m);
      const size_t c = size_t((double(next_uniform()) * 0.5 + 0.5) * s.n) % size_t(s.n);
      double ref = 0;
      for (int kk = 0; kk < s.k; ++kk)
        ref += double(ha.values[r * s.k + kk]) * double(hb.values[c * s.k + kk]);
      const size_t di = c * size_t(s.m) + r;  // column-major D
      double got;
      if (s.kind == Kind::kBf16) {
        uint16_t h;
        std::memcpy(&h, dbytes.data() + 2 * di, 2);
        got = from_bf16(h);
      } else {
        float f;
        std::memcpy(&f, dbytes.data() + 4 * di, 4);
        got = f;
      }
      if (!std::isfinite(got)) finite = false;
      num += (got - ref) * (got - ref);
      den += ref * ref;
    }
    res.rel_err = finite ? std::sqrt(num / std::max(den, 1e-300)) : INFINITY;
    // bf16 output rounding alone is ~2e-3; TF32 operands ~3e-4 on sums like these; fp32 far less
    // (METHOD.md's bands, with room for a split-K order of summation).
    const double tol = s.kind == Kind::kBf16 ? 1e-2 : s.kind == Kind::kTf32 ? 5e-3 : 1e-4;
    res.ok = finite && res.rel_err < tol;
    if (!res.ok) {
      char buf[128];
      std::snprintf(buf, sizeof buf, "check failed: relative error %.3g (tolerance %.0e)",
                    res.rel_err, tol);
      res.error = buf;
    }

    // Batches of launches long enough (>= ~2 ms) that the event resolution and launch gaps
    // don't count; the first batch sizes them.
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    const double flop = 2.0 * s.m * double(s.n) * s.k;
    for (int w = 0; w < 3 * sets; ++w)
      launch(w % sets);
    CUDA_CHECK(cudaEventRecord(e0));
    for (int w = 0; w < sets; ++w)
      launch(w % sets);
    CUDA_CHECK(cudaEventRecord(e1));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float probe_ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&probe_ms, e0, e1));
    const double per_launch = std::max(1e-4, double(probe_ms) / sets);
    const int per_batch = int(std::clamp(2.0 / per_launch, 1.0, 2000.0));
    std::vector<double> times;
    for (int b = 0; b < 15; ++b) {
      CUDA_CHECK(cudaEventRecord(e0));
      for (int i = 0; i < per_batch; ++i)
        launch(i % sets);
      CUDA_CHECK(cudaEventRecord(e1));
      CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      times.push_back(double(ms) / per_batch);
    }
    CUDA_CHECK(cudaGetLastError());
    std::sort(times.begin(), times.end());
    res.median_ms = times[times.size() / 2];
    res.tflops = flop / (res.median_ms * 1e-3) / 1e12;
  } catch (const std::exception& e) {
    res.ok = false;
    res.error = e.what();
  }
  if (e0) (void)cudaEventDestroy(e0);
  if (e1) (void)cudaEventDestroy(e1);
  if (pref) (void)cublasLtMatmulPreferenceDestroy(pref);
  if (ld) (void)cublasLtMatrixLayoutDestroy(ld);
  if (lb) (void)cublasLtMatrixLayoutDestroy(lb);
  if (la) (void)cublasLtMatrixLayoutDestroy(la);
  if (op) (void)cublasLtMatmulDescDestroy(op);
  for (int i = 0; i < sets; ++i) {
    if (A[i]) (void)cudaFree(A[i]);
    if (B[i]) (void)cudaFree(B[i]);
    if (D[i]) (void)cudaFree(D[i]);
  }
  return res;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      o += ' ';
    } else {
      o += c;
    }
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cuBLASLt GEMM rate (bf16, fp32, tf32): the ceiling for MFU"};
  int tokens = 8192, n_embd = 768, vocab = 50257;
  std::string json;
  app.add_option("--tokens", tokens, "rows of the model's GEMMs: micro_batch * seq_len")
      ->check(CLI::PositiveNumber);
  app.add_option("--n-embd", n_embd, "model width C")->check(CLI::PositiveNumber);
  app.add_option("--vocab", vocab, "vocabulary size V (the LM head's width)")
      ->check(CLI::PositiveNumber);
  app.add_option("--json", json, "also write the results to FILE (one JSON object)");
  CLI11_PARSE(app, argc, argv);

  std::vector<Shape> shapes = {
      {"square 4096", 4096, 4096, 4096, Kind::kBf16},
      {"square 8192", 8192, 8192, 8192, Kind::kBf16},
      {"qkv (3C x C)", 3 * n_embd, tokens, n_embd, Kind::kBf16},
      {"attn proj (C x C)", n_embd, tokens, n_embd, Kind::kBf16},
      {"fc (4C x C)", 4 * n_embd, tokens, n_embd, Kind::kBf16},
      {"fc proj (C x 4C)", n_embd, tokens, 4 * n_embd, Kind::kBf16},
      {"lm head (V x C)", vocab, tokens, n_embd, Kind::kBf16},
      // llm.c pads the vocabulary to a multiple of 128; this row says what that would buy.
      {"lm head, V padded to 128", (vocab + 127) / 128 * 128, tokens, n_embd, Kind::kBf16},
      {"square 4096", 4096, 4096, 4096, Kind::kFp32},
      {"square 4096", 4096, 4096, 4096, Kind::kTf32},
  };

  int device = 0;
  cudaDeviceProp prop{};
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  const size_t workspace_bytes = size_t(32) << 20;  // headroom's CudaContext default
  std::vector<Result> results;
  try {
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    LT_CHECK(cublasLtCreate(&lt));
    CUDA_CHECK(cudaMalloc(&workspace, workspace_bytes));
    std::printf("device: %s (%d SMs), cuBLASLt %zu\n", prop.name, prop.multiProcessorCount,
                cublasLtGetVersion());
    std::printf("%-26s %5s %6s %6s %6s %10s %9s %9s\n", "shape", "type", "m", "n", "k", "ms",
                "TFLOP/s", "rel err");
    for (const Shape& s : shapes) {
      const Result r = measure(lt, workspace, workspace_bytes, s);
      results.push_back(r);
      std::printf("%-26s %5s %6d %6d %6d %10.4f %9.1f %9.2e%s%s\n", s.name.c_str(),
                  kind_name(s.kind), s.m, s.n, s.k, r.median_ms, r.tflops, r.rel_err,
                  r.ok ? "" : "  FAILED: ", r.error.c_str());
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gemm_rate: %s\n", e.what());
    if (workspace) (void)cudaFree(workspace);
    if (lt) (void)cublasLtDestroy(lt);
    return 1;
  }
  if (workspace) (void)cudaFree(workspace);
  if (lt) (void)cublasLtDestroy(lt);

  bool all_ok = true;
  for (const Result& r : results)
    all_ok = all_ok && r.ok;
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "bench_gemm_rate: cannot write %s\n", json.c_str());
      return 1;
    }
    std::fprintf(f, "{\"device\": \"%s\", \"sms\": %d, \"cublaslt_version\": %zu,\n",
                 json_escape(prop.name).c_str(), prop.multiProcessorCount, cublasLtGetVersion());
    // The ceiling MFU is taken against: the best bf16 square GEMM that passed its check.
    double peak = 0;
    for (const Result& r : results)
      if (r.ok && r.shape.kind == Kind::kBf16 && r.shape.name.rfind("square", 0) == 0)
        peak = std::max(peak, r.tflops);
    std::fprintf(f, " \"bf16_peak_tflops\": %.3f,\n \"results\": [\n", peak);
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      std::fprintf(f,
                   "  {\"name\": \"%s\", \"dtype\": \"%s\", \"m\": %d, \"n\": %d, \"k\": %d, "
                   "\"median_ms\": %.6f, \"tflops\": %.3f, \"rel_err\": %.3e, \"ok\": %s, "
                   "\"error\": \"%s\"}%s\n",
                   json_escape(r.shape.name).c_str(), kind_name(r.shape.kind), r.shape.m, r.shape.n,
                   r.shape.k, r.median_ms, r.tflops, std::isfinite(r.rel_err) ? r.rel_err : 1e300,
                   r.ok ? "true" : "false", json_escape(r.error).c_str(),
                   i + 1 < results.size() ? "," : "");
    }
    std::fprintf(f, " ]}\n");
    std::fclose(f);
  }
  return all_ok ? 0 : 1;
}
