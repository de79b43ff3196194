#include "core/report/advice.h"

#include <algorithm>
#include <cstdio>

#include <toml++/toml.h>

#include "core/model/model.h"

namespace headroom {

namespace {

uint64_t& at(ByCategory& b, Category c) {
  return b[static_cast<int>(c)];
}

// checkpoint's sqrt policy keeps every n-th block, n = ceil(sqrt(L)).
int sqrt_keep_every(int n_layer) {
  int n = 1;
  while (n * n < n_layer)
    ++n;
  return n;
}

}  // namespace

uint64_t PeakEstimate::total() const {
  uint64_t t = 0;
  for (uint64_t b : at_peak)
    t += b;
  return t;
}

Strategy strategy_of(const Config& config) {
  Strategy s;
  for (const PluginEntry& p : config.plugins) {
    // The plugins' own keys, as the plugins read them; a value they would refuse stops the run
    // before any estimate matters, so anything unexpected here just counts as the default.
    toml::table t;
    try {
      t = toml::parse(p.toml);
    } catch (const toml::parse_error&) {
    }
    if (p.name == "amp") {
      s.compute = t["dtype"].value_or(std::string("bf16")) == "fp16" ? Dtype::kF16 : Dtype::kBF16;
    } else if (p.name == "checkpoint") {
      const std::string policy = t["policy"].value_or(std::string("every"));
      if (policy == "every") {
        s.keep_every = 0;
      } else if (policy == "every_n") {
        s.keep_every = int(t["n"].value_or(int64_t(1)));
      } else if (policy == "sqrt") {
        s.keep_every = sqrt_keep_every(config.model.n_layer);
      }
      // selective and budget: estimated as no recomputation, an upper bound.
    }
  }
  return s;
}

PeakEstimate estimate_peak(const Config& config, int micro_batch, const Strategy& s) {
  const ModelConfig& m = config.model;
  const uint64_t B = uint64_t(micro_batch), T = uint64_t(m.seq_len), C = uint64_t(m.n_embd);
  const uint64_t V = uint64_t(m.vocab_size), L = uint64_t(m.n_layer), N = B * T;
  const uint64_t NH = uint64_t(m.n_head);
  const uint64_t params = gpt_num_params(m);
  // es: the compute dtype's element size (activations, compute copies); statistics and masters
  // are fp32.
  const uint64_t es = dtype_size(s.compute), kF32 = 4;
  const bool copies = s.compute != Dtype::kF32;
  PeakEstimate e;
  at(e.at_peak, Category::kParameters) = kF32 * params + (copies ? es * params : 0);
  at(e.at_peak, Category::kGradients) = kF32 * params + (copies ? es * params : 0);
  const TrainConfig& t = config.train;
  const uint64_t states = t.optimizer == "adamw" ? 2 : (t.momentum > 0 ? 1 : 0);
  at(e.at_peak, Category::kOptimizer) = kF32 * states * params;
  at(e.at_peak, Category::kData) = 2 * sizeof(int32_t) * N;  // inputs and targets

  // What the layers save in forward (model.cpp): the embedding's output, each block's tensors,
  // the head's ln_f, its statistics, the logits and the per-token losses.
  const uint64_t full = gpt_block_activation_bytes(m, micro_batch, m.seq_len, s.compute);
  const uint64_t out = es * N * C;  // a block's output; the embedding's
  const uint64_t head = es * (N * C + N * V) + kF32 * (2 * N + N);
  // Backward holds two (B, T, C) gradient buffers throughout, and each layer its own scratch:
  // the head dln_f (B, T, C); a block two (B, T, 4C), two (B, T, C) and the attention scratch —
  // (T, T) on the CPU, (NH, T, T) on CUDA (Backend::attention_scratch_numel).
  const uint64_t scratch = config.device.kind == "cuda" ? NH * T * T : T * T;
  const uint64_t dres = 2 * es * N * C;
  const uint64_t head_ws = dres + es * N * C;
  const uint64_t block_ws = dres + es * (8 * N * C + 2 * N * C + scratch);

  // Recomputation: dropped blocks keep only their output. The peak is then at the head's backward
  // (every kept activation plus the head's) or at the recompute of the topmost dropped block (its
  // full activations and a block's backward scratch); counting every kept block at both moments
  // makes this an upper bound for every_n and sqrt, and exact for every. Without it, every block
  // is kept, and the last block's backward is the other candidate.
  const uint64_t kept = s.keep_every < 0   ? L
                        : s.keep_every > 0 ? std::min(L, L / uint64_t(s.keep_every))
                                           : 0;
  const uint64_t dropped = L - kept;
  const uint64_t base = out + kept * full;  // the embedding's output and the kept blocks
  const uint64_t act_head = base + dropped * out + head;
  const uint64_t act_other = dropped > 0 ? base + (dropped - 1) * out + full : L > 0 ? base : 0;
  const bool head_wins = L == 0 || act_head + head_ws >= act_other + block_ws;
  at(e.at_peak, Category::kActivations) = head_wins ? act_head : act_other;
  at(e.at_peak, Category::kWorkspace) = head_wins ? head_ws : block_ws;
  return e;
}

std::vector<Remedy> suggest_remedies(const Config& config, uint64_t limit, uint64_t requested,
                                     uint64_t free_bytes, uint64_t largest_free,
                                     const std::vector<std::string>& available_plugins) {
  std::vector<Remedy> out;
  const int B = config.train.micro_batch, A = config.train.grad_accum;
  const Strategy current = strategy_of(config);
  const PeakEstimate now = estimate_peak(config, B, current);
  auto remedy = [&](std::string what, std::string toml, const PeakEstimate& e) {
    Remedy r;
    r.what = std::move(what);
    r.toml = std::move(toml);
    for (int i = 0; i < kNumCategories; ++i) {
      r.saves[i] = now.at_peak[i] > e.at_peak[i] ? now.at_peak[i] - e.at_peak[i] : 0;
      r.costs[i] = e.at_peak[i] > now.at_peak[i] ? e.at_peak[i] - now.at_peak[i] : 0;
    }
    r.peak_after = e.total();
    r.fits = !limit || e.total() <= limit;
    return r;
  };

  // Smaller micro-batches, the same effective batch: the largest divisor of B that fits.
  for (int b = B / 2; b >= 1; --b) {
    if (B % b != 0) continue;
    const PeakEstimate e = estimate_peak(config, b, current);
    if (limit && e.total() > limit && b > 1) continue;
    out.push_back(remedy("micro_batch " + std::to_string(b) + " x grad_accum " +
                             std::to_string(A * (B / b)) + " (the same " + std::to_string(B * A) +
                             " sequences per step)",
                         "[train]\nmicro_batch = " + std::to_string(b) +
                             "\ngrad_accum = " + std::to_string(A * (B / b)),
                         e));
    break;
  }

  auto available = [&](const char* name) {
    return std::find(available_plugins.begin(), available_plugins.end(), name) !=
           available_plugins.end();
  };
  auto configured = [&](const char* name) {
    return std::any_of(config.plugins.begin(), config.plugins.end(),
                       [&](const PluginEntry& p) { return p.name == name; });
  };
  const bool can_checkpoint =
      available("checkpoint") && !configured("checkpoint") && config.model.n_layer >= 2;
  const bool can_amp = available("amp") && !configured("amp");

  // Activation recomputation: sqrt(L) keeps every ceil(sqrt(L))-th block and recomputes less;
  // every saves the most.
  Strategy ckpt = current;
  std::string ckpt_toml;
  if (can_checkpoint) {
    ckpt.keep_every = sqrt_keep_every(config.model.n_layer);
    const char* policy = "sqrt";
    if (limit && estimate_peak(config, B, ckpt).total() > limit) {
      ckpt.keep_every = 0;
      policy = "every";
    }
    ckpt_toml = std::string("[[plugins]]\nname = \"checkpoint\"\npolicy = \"") + policy + "\"";
    out.push_back(
        remedy(std::string("checkpoint (activation recomputation, policy ") + policy + ")",
               ckpt_toml, estimate_peak(config, B, ckpt)));
  }

  // Mixed precision: bf16 activations and compute copies beside the fp32 masters.
  Strategy amp = current;
  amp.compute = Dtype::kBF16;
  const std::string amp_toml = "[[plugins]]\nname = \"amp\"\ndtype = \"bf16\"";
  if (can_amp)
    out.push_back(remedy("amp (bf16 activations and compute weights, fp32 master weights)",
                         amp_toml, estimate_peak(config, B, amp)));

  // Both, when neither alone fits.
  if (can_amp && can_checkpoint && limit && estimate_peak(config, B, ckpt).total() > limit &&
      estimate_peak(config, B, amp).total() > limit) {
    Strategy both = ckpt;
    both.compute = Dtype::kBF16;
    out.push_back(remedy("amp + checkpoint together", amp_toml + "\n" + ckpt_toml,
                         estimate_peak(config, B, both)));
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
    // "activations 1.00 MiB, workspace 2.00 MiB": the categories with bytes.
    auto by_category = [](const ByCategory& bytes) {
      std::string list;
      for (int i = 0; i < kNumCategories; ++i) {
        if (!bytes[i]) continue;
        list += std::string(list.empty() ? "" : ", ") + category_name(category_at(i)) + " " +
                format_bytes(bytes[i]);
      }
      return list;
    };
    const std::string saved = by_category(r.saves), cost = by_category(r.costs);
    if (!saved.empty()) s += "    saves about " + saved + " at the peak\n";
    if (!cost.empty()) s += "    costs about " + cost + " more\n";
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
