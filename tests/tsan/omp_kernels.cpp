// The CPU kernels of a training step (kernels/cpu/*.h) on 3 OpenMP threads, for the thread
// sanitizer pass (tests/tsan/omp_kernels.sh). The pass's GCC build runs one OpenMP thread: GCC's
// libgomp is not instrumented, so ThreadSanitizer cannot see a parallel region's fork, barrier and
// join there and would report every parallel loop. This program is built with clang and LLVM's
// libomp instead, whose Archer tool tells ThreadSanitizer of them: what it reports is a race
// between the kernels' own threads (two threads writing one element, a reduction sharing a
// partial sum, a scratch buffer shared by two (batch, head) pairs).
//
//   omp_kernels           every kernel, twice, above the sizes at which the loops split
//   omp_kernels --plant   a loop whose threads all add into one float: must be reported
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_tiled.h"
#include "kernels/cpu/crossentropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/residual.h"

using namespace headroom;

namespace {

std::mt19937 rng(1);

std::vector<float> randn(size_t n) {
  std::normal_distribution<float> nd(0.0f, 0.1f);
  std::vector<float> v(n);
  for (float& x : v)
    x = nd(rng);
  return v;
}

// The race the check must see: every thread adds into `sum` unguarded.
float planted_race(const std::vector<float>& x) {
  float sum = 0.0f;
#pragma omp parallel for num_threads(3)
  for (int64_t i = 0; i < int64_t(x.size()); ++i)
    sum += x[size_t(i)];
  return sum;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--plant") == 0) {
    std::printf("planted: %g\n", double(planted_race(randn(1 << 16))));
    return 0;
  }
  // N·C = 16384 = kParallelMin and the attention's B·NH·T² above it: every loop splits.
  const int B = 4, T = 64, C = 64, NH = 4, V = 300, N = B * T;
  cpu::set_threads(3);
  for (int rep = 0; rep < 2; ++rep) {
    const std::vector<float> x = randn(size_t(N) * C), w = randn(C), b = randn(C),
                             dy = randn(size_t(N) * C);
    std::vector<float> ln(size_t(N) * C), mean(N), rstd(N), dx(size_t(N) * C), dw(C), db(C);
    cpu::layernorm_forward(ln.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    cpu::layernorm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(),
                            mean.data(), rstd.data(), N, C);
    std::vector<float> g(size_t(N) * C), dg(size_t(N) * C), r(size_t(N) * C);
    cpu::gelu_forward(g.data(), x.data(), size_t(N) * C);
    cpu::gelu_backward(dg.data(), x.data(), dy.data(), size_t(N) * C);
    cpu::residual_forward(r.data(), x.data(), dy.data(), size_t(N) * C);

    // Repeated tokens: the embedding's scatter adds into shared rows.
    std::vector<int32_t> tokens(N), targets(N);
    for (int i = 0; i < N; ++i) {
      tokens[size_t(i)] = (i * 7) % 13;
      targets[size_t(i)] = (i * 5) % V;
    }
    std::vector<float> logits = randn(size_t(N) * V), losses(N);
    cpu::crossentropy_forward_backward(logits.data(), losses.data(), targets.data(), N, V,
                                       1.0f / N);
    const std::vector<float> wte = randn(size_t(V) * C), wpe = randn(size_t(T) * C);
    std::vector<float> emb(size_t(N) * C), dwte(size_t(V) * C), dwpe(size_t(T) * C);
    cpu::embedding_forward(emb.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
    cpu::embedding_backward(dwte.data(), dwpe.data(), dy.data(), tokens.data(), B, T, C);

    const std::vector<float> W = randn(size_t(4 * C) * C), bias = randn(4 * C),
                             dout = randn(size_t(N) * 4 * C);
    std::vector<float> out(size_t(N) * 4 * C), dinp(size_t(N) * C), dW(size_t(4 * C) * C),
        dbias(4 * C);
    cpu::matmul_forward(out.data(), x.data(), W.data(), bias.data(), N, C, 4 * C);
    cpu::matmul_backward(dinp.data(), dW.data(), dbias.data(), dout.data(), x.data(), W.data(), N,
                         C, 4 * C);

    // Both attentions; tiles of 16 rows so that the tiled one walks many tiles at T = 64.
    const std::vector<float> qkv = randn(size_t(N) * 3 * C);
    std::vector<float> ao(size_t(N) * C), lse(size_t(B) * NH * T), dqkv(size_t(N) * 3 * C);
    cpu::attention_tiled_forward(ao.data(), lse.data(), qkv.data(), B, T, C, NH, 16);
    cpu::attention_tiled_backward(dqkv.data(), dy.data(), qkv.data(), ao.data(), lse.data(), B, T,
                                  C, NH, 16);
    std::vector<float> att(size_t(B) * NH * T * T), scratch(size_t(T) * T);
    cpu::attention_forward(ao.data(), att.data(), qkv.data(), B, T, C, NH);
    cpu::attention_backward(dqkv.data(), scratch.data(), dy.data(), qkv.data(), att.data(), B, T, C,
                            NH);

    std::vector<float> p = randn(size_t(N) * C), m(size_t(N) * C), v(size_t(N) * C),
                       mom(size_t(N) * C);
    cpu::adamw_update(p.data(), dy.data(), m.data(), v.data(), p.size(), 1e-3f, 0.9f, 0.95f, 1e-8f,
                      0.1f, 1);
    cpu::sgd_update(p.data(), dy.data(), mom.data(), p.size(), 1e-3f, 0.9f, 0.0f);
    cpu::scale_inplace(p.data(), p.size(), 0.5f);
    std::printf("round %d: loss[0] %g, dqkv[5] %g, dW[3] %g, p[0] %g\n", rep, double(losses[0]),
                double(dqkv[5]), double(dW[3]), double(p[0]));
  }
  return 0;
}
