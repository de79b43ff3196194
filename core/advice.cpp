#include "core/advice.h"

#include <algorithm>
#include <cstdio>

#include "core/model.h"

namespace headroom {

namespace {

constexpr uint64_t kF32 = 4;

uint64_t& at(ByCategory& b, Category c) {
  return b[static_cast<int>(c)];
}

}  // namespace

uint64_t PeakEstimate::total() const {
  uint64_t t = 0;
  for (uint64_t b : at_peak)
    t += b;
  return t;
}

PeakEstimate estimate_peak(const Config& config, int micro_batch) {
  const ModelConfig& m = config.model;
  const uint64_t B = uint64_t(micro_batch), T = uint64_t(m.seq_len), C = uint64_t(m.n_embd);
  const uint64_t V = uint64_t(m.vocab_size), L = uint64_t(m.n_layer), N = B * T;
  const uint64_t params = gpt_num_params(m);
  PeakEstimate e;
  at(e.at_peak, Category::kParameters) = kF32 * params;
  at(e.at_peak, Category::kGradients) = kF32 * params;
  const TrainConfig& t = config.train;
  const uint64_t states = t.optimizer == "adamw" ? 2 : (t.momentum > 0 ? 1 : 0);
  at(e.at_peak, Category::kOptimizer) = kF32 * states * params;
  at(e.at_peak, Category::kData) = 2 * sizeof(int32_t) * N;  // inputs and targets

  // What the layers save in forward (model.cpp): the embedding's output, each block's tensors,
  // the head's ln_f, its statistics, the logits and the per-token losses.
  const uint64_t block = gpt_block_activation_bytes(m, micro_batch, m.seq_len, Dtype::kF32);
  const uint64_t head = kF32 * (N * C + 2 * N + N * V + N);
  const uint64_t all = kF32 * N * C + L * block + head;
  // Backward holds two (B, T, C) gradient buffers throughout, and each layer its own scratch:
  // the head dln_f (B, T, C); a block two (B, T, 4C), two (B, T, C) and one (T, T).
  const uint64_t dres = 2 * kF32 * N * C;
  const uint64_t head_ws = dres + kF32 * N * C;
  const uint64_t block_ws = dres + kF32 * (8 * N * C + 2 * N * C + T * T);
  // At the head's backward every activation is live; at the last block's, all but the head's.
  const uint64_t at_head = all + head_ws, at_block = all - head + block_ws;
  at(e.at_peak, Category::kActivations) = at_head >= at_block || L == 0 ? all : all - head;
  at(e.at_peak, Category::kWorkspace) = at_head >= at_block || L == 0 ? head_ws : block_ws;
  return e;
}

std::vector<Remedy> suggest_remedies(const Config& config, uint64_t limit, uint64_t requested,
                                     uint64_t free_bytes, uint64_t largest_free,
                                     const std::vector<std::string>& available_plugins) {
  std::vector<Remedy> out;
  const int B = config.train.micro_batch, A = config.train.grad_accum;
  const PeakEstimate now = estimate_peak(config, B);

  // Smaller micro-batches, the same effective batch: the largest divisor of B that fits.
  for (int b = B / 2; b >= 1; --b) {
    if (B % b != 0) continue;
    const PeakEstimate e = estimate_peak(config, b);
    if (limit && e.total() > limit && b > 1) continue;
    Remedy r;
    r.what = "micro_batch " + std::to_string(b) + " x grad_accum " + std::to_string(A * (B / b)) +
             " (the same " + std::to_string(B * A) + " sequences per step)";
    r.toml = "[train]\nmicro_batch = " + std::to_string(b) +
             "\ngrad_accum = " + std::to_string(A * (B / b));
    for (int i = 0; i < kNumCategories; ++i)
      r.saves[i] = now.at_peak[i] > e.at_peak[i] ? now.at_peak[i] - e.at_peak[i] : 0;
    r.peak_after = e.total();
    r.fits = !limit || e.total() <= limit;
    out.push_back(r);
    break;
  }

  // Activation recomputation: dropped blocks keep only their output. The peak is then at the
  // head's backward (every kept activation plus the head's) or at the recompute of the topmost
  // dropped block (its full activations and a block's backward scratch); counting every kept
  // block at both moments makes this an upper bound for sqrt, and exact for every.
  auto checkpoint_remedy = [&](const char* policy, int keep_every) {
    const ModelConfig& m = config.model;
    const uint64_t N = uint64_t(B) * m.seq_len, C = uint64_t(m.n_embd), L = uint64_t(m.n_layer);
    const uint64_t T = uint64_t(m.seq_len);
    const uint64_t full = gpt_block_activation_bytes(m, B, m.seq_len, Dtype::kF32);
    const uint64_t out = kF32 * N * C, head = kF32 * (N * C + 2 * N + N * m.vocab_size + N);
    const uint64_t dres = 2 * kF32 * N * C, head_ws = dres + kF32 * N * C;
    const uint64_t block_ws = dres + kF32 * (8 * N * C + 2 * N * C + T * T);
    const uint64_t kept = keep_every > 0 ? L / uint64_t(keep_every) : 0, dropped = L - kept;
    const uint64_t base = out + kept * full;  // the embedding's output and the kept blocks
    const uint64_t at_head = base + dropped * out + head + head_ws;
    const uint64_t at_recompute = base + (dropped - 1) * out + full + block_ws;
    const uint64_t act =
        at_head >= at_recompute ? base + dropped * out + head : base + (dropped - 1) * out + full;
    const uint64_t ws = at_head >= at_recompute ? head_ws : block_ws;
    const int ia = static_cast<int>(Category::kActivations);
    const int iw = static_cast<int>(Category::kWorkspace);
    Remedy r;
    r.what = std::string("checkpoint (activation recomputation, policy ") + policy + ")";
    r.toml = std::string("[[plugins]]\nname = \"checkpoint\"\npolicy = \"") + policy + "\"";
    r.saves[ia] = now.at_peak[ia] > act ? now.at_peak[ia] - act : 0;
    r.saves[iw] = now.at_peak[iw] > ws ? now.at_peak[iw] - ws : 0;
    const uint64_t after =
        now.total() - r.saves[ia] - r.saves[iw] + (ws > now.at_peak[iw] ? ws - now.at_peak[iw] : 0);
    r.peak_after = after;
    r.fits = !limit || after <= limit;
    return r;
  };

  auto available = [&](const char* name) {
    return std::find(available_plugins.begin(), available_plugins.end(), name) !=
           available_plugins.end();
  };
  if (available("checkpoint") && config.model.n_layer >= 2) {
    // sqrt(L) keeps every ceil(sqrt(L))-th block and recomputes less; every saves the most.
    int n = 1;
    while (n * n < config.model.n_layer)
      ++n;
    const Remedy sqrt_r = checkpoint_remedy("sqrt", n);
    out.push_back(sqrt_r.fits ? sqrt_r : checkpoint_remedy("every", 0));
  }

  // Enough bytes free, no hole big enough: fragmentation, which an allocator with expandable
  // segments removes (it maps pages wherever they are free).
  if (available("defrag_allocator") && requested <= free_bytes && largest_free < requested) {
    Remedy r;
    r.what = "defrag_allocator: the request fits the " + format_bytes(free_bytes) +
             " free, but the largest free block is " + format_bytes(largest_free);
    r.toml = "[[plugins]]\nname = \"defrag_allocator\"";
    r.unstranded = free_bytes - largest_free;
    r.fits = true;
    out.push_back(r);
  }
  return out;
}

std::string format_remedies(const std::vector<Remedy>& remedies) {
  if (remedies.empty()) return "";
  std::string s = "what would make it fit:\n";
  for (const Remedy& r : remedies) {
    s += "  - " + r.what + (r.fits ? "" : " (still over the limit by the estimate)") + "\n";
    if (r.peak_after) s += "    peak about " + format_bytes(r.peak_after) + "\n";
    std::string saved;
    for (int i = 0; i < kNumCategories; ++i) {
      if (!r.saves[i]) continue;
      saved += std::string(saved.empty() ? "" : ", ") + category_name(category_at(i)) + " " +
               format_bytes(r.saves[i]);
    }
    if (!saved.empty()) s += "    saves about " + saved + " at the peak\n";
    if (r.unstranded)
      s += "    makes usable " + format_bytes(r.unstranded) +
           " of free memory now in holes too small for the request\n";
    s += "    in the config:\n";
    size_t start = 0;
    while (start <= r.toml.size()) {
      const size_t end = r.toml.find('\n', start);
      s += "      " + r.toml.substr(start, end - start) + "\n";
      if (end == std::string::npos) break;
      start = end + 1;
    }
  }
  return s;
}

}  // namespace headroom
