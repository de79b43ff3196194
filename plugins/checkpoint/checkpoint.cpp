// checkpoint: activation recomputation. A transformer block's saved tensors are most of a run's
// activation memory; a block that drops them after its forward keeps only its output (the next
// block's input), and the host runs its forward again in backward, just before the block's own
// backward. The policy — which blocks drop — is this plugin's; the mechanism is the host's
// drop_activations service (ABI 1.3).
//
//   [[plugins]]
//   name = "checkpoint"
//   policy = "sqrt"      # "every" (the default) | "every_n" | "sqrt" | "selective" | "budget"
//   n = 4                # every_n: keep every n-th block
//   budget = "256MiB"    # budget: the activation peak to stay under
//
// Blocks are numbered b = 0 .. L-1 (layer b + 1 of the host; layer 0 is the embedding, L + 1 the
// head, neither of which can drop anything).
//  - every:   every block drops; backward recomputes each.
//  - every_n: block b keeps its activations when b % n == n - 1 (the last block of each run of n,
//             so with L a multiple of n the last block, whose backward comes first, is kept), every
//             other block drops. n = 1 keeps everything.
//  - sqrt:    every_n with n = ceil(sqrt(L)) (Chen et al. 2016).
//  - budget:  drop the fewest blocks such that the activation peak stays under the budget. The
//             bound used is what the run can hold at once: the embedding's and the head's saved
//             bytes, each kept block's, each dropped block's output, and one dropped block being
//             recomputed (its full saved bytes). The bytes are those each layer registered, read
//             at its FORWARD_END (layer_activation: numel × dtype size). The first micro-step
//             measures them while dropping every block (the smallest peak there is, so it stays
//             under any feasible budget); the plan holds from its head's FORWARD_END on. A budget
//             that even dropping every block cannot meet stops the run with a message naming the
//             budget and the smallest achievable peak.
//  - selective: every block drops only its cheap tensors (HR_DROP_CHEAP: the attention output
//             and what the attention keeps besides it) and keeps its GEMM outputs and its
//             LayerNorm statistics; backward recomputes those without re-running a GEMM
//             (Korthikanti et al. 2022, llm.c's recompute levels). It saves less than every (a
//             block keeps qkv, res1, fc and out: 9·N·C floats) but costs only the attention's
//             forward. A block no longer keeps its LayerNorm or GELU outputs at all (backward
//             computes them again whatever the policy), so what selective drops is the
//             attention's: with the tiled attention (the default, [model] attention) its output
//             and (B, NH, T) row log-sum-exp, N·C floats and a little; with the naive attention
//             also the (B, NH, T, T) probabilities, then the biggest saving at long sequences.
//
// Recomputation runs the same kernels on the same inputs: on the CPU the recomputed tensors, and
// so the gradients, are bitwise those of a run without this plugin.
//
// Training thread only (FORWARD_END); no locking. Only hr_plugin_entry is exported; no C++
// exception crosses the C ABI.
#include <headroom/ext/estimate.h>
#include <headroom/plugin.h>

#include "common/hook_guard.h"
#include "common/offer_estimate.h"
#include "common/offer_reads.h"
#include "common/units.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>
#include <vector>

namespace {

enum class Policy { kEvery, kEveryN, kSqrt, kSelective, kBudget };

using headroom_units::dtype_size;
using headroom_units::format_bytes_exact;

class Checkpoint {
 public:
  Checkpoint(const hr_host_services* s, Policy policy, int64_t n, uint64_t budget)
      : s_(s), policy_(policy), n_(n), budget_(budget) {}
  const hr_host_services* services() const { return s_; }
  Policy policy() const { return policy_; }
  int64_t n() const { return n_; }
  uint64_t budget() const { return budget_; }

  hr_status on_forward_end(int32_t layer) {
    const int32_t num_layers = s_->num_layers(s_->host);
    if (num_layers < 2) return HR_OK;
    if (!planned_) plan(num_layers);
    const bool is_block = layer >= 1 && layer <= num_layers - 2;
    const bool measuring = policy_ == Policy::kBudget && !budget_planned_;
    if (measuring) full_[size_t(layer)] = saved_bytes(layer);
    if (is_block && (measuring || drop_[size_t(layer)])) {
      const uint32_t what = policy_ == Policy::kSelective ? HR_DROP_CHEAP : HR_DROP_ALL;
      const hr_status st = s_->drop_activations(s_->host, layer, what);
      if (st != HR_OK) return st;  // the host's message stands
    }
    if (measuring) {
      kept_[size_t(layer)] = saved_bytes(layer);
      if (layer == num_layers - 1) return plan_budget(num_layers);
    }
    return HR_OK;
  }

 private:
  // The bytes layer `layer` holds now, as it registered them.
  uint64_t saved_bytes(int32_t layer) const {
    uint64_t total = 0;
    const int32_t count = s_->layer_num_activations(s_->host, layer);
    for (int32_t i = 0; i < count; ++i) {
      hr_tensor t;
      std::memset(&t, 0, sizeof t);
      t.struct_size = sizeof t;
      if (s_->layer_activation(s_->host, layer, i, &t) != HR_OK) continue;
      total += t.numel * dtype_size(t.dtype);
    }
    return total;
  }

  // The fixed policies' plan; budget's starts measuring.
  void plan(int32_t num_layers) {
    planned_ = true;
    const int64_t L = num_layers - 2;
    drop_.assign(size_t(num_layers), false);
    full_.assign(size_t(num_layers), 0);
    kept_.assign(size_t(num_layers), 0);
    int64_t n = 1;
    switch (policy_) {
      case Policy::kEvery:
      case Policy::kSelective:
        for (int64_t b = 0; b < L; ++b)
          drop_[size_t(b + 1)] = true;
        return;
      case Policy::kEveryN:
        n = n_;
        break;
      case Policy::kSqrt:
        n = static_cast<int64_t>(std::ceil(std::sqrt(double(L))));
        break;
      case Policy::kBudget:
        return;
    }
    if (n < 1) n = 1;
    for (int64_t b = 0; b < L; ++b)
      drop_[size_t(b + 1)] = b % n != n - 1;
  }

  // Peak bound for a set of dropped blocks (see the header comment).
  uint64_t bound(int32_t num_layers, const std::vector<bool>& drop) const {
    uint64_t total = full_[0] + full_[size_t(num_layers - 1)], recompute = 0;
    for (int32_t l = 1; l <= num_layers - 2; ++l) {
      if (drop[size_t(l)]) {
        total += kept_[size_t(l)];
        recompute = std::max(recompute, full_[size_t(l)]);
      } else {
        total += full_[size_t(l)];
      }
    }
    return total + recompute;
  }

  // After the first micro-step's head: the fewest drops that meet the budget. Blocks that save
  // the most by dropping go first (all blocks of GPT-2 save the same; then the earliest, whose
  // activations live longest).
  hr_status plan_budget(int32_t num_layers) {
    budget_planned_ = true;
    std::vector<int32_t> order;
    for (int32_t l = 1; l <= num_layers - 2; ++l)
      order.push_back(l);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return full_[size_t(a)] - kept_[size_t(a)] > full_[size_t(b)] - kept_[size_t(b)];
    });
    std::vector<bool> drop(size_t(num_layers), false);
    uint64_t peak = bound(num_layers, drop);
    size_t k = 0;
    while (peak > budget_ && k < order.size()) {
      drop[size_t(order[k++])] = true;
      peak = bound(num_layers, drop);
    }
    if (peak > budget_) {
      const std::string m =
          "budget " + format_bytes_exact(budget_) +
          " cannot be met: even with every block recomputed the activation peak is " +
          format_bytes_exact(peak) + " (the embedding's and the head's activations, " +
          std::to_string(num_layers - 2) +
          " block outputs and one recomputed block); raise the budget to at least that, or "
          "shrink micro_batch or seq_len";
      s_->set_error(s_->host, m.c_str());
      return HR_ERROR;
    }
    drop_ = drop;
    char line[256];
    std::snprintf(line, sizeof line,
                  "budget plan: %zu of %d blocks recomputed, activation peak at most %" PRIu64
                  " bytes (budget %" PRIu64 ")",
                  k, num_layers - 2, peak, budget_);
    s_->log(s_->host, HR_LOG_INFO, line);
    return HR_OK;
  }

  const hr_host_services* s_;
  Policy policy_;
  int64_t n_;
  uint64_t budget_;
  bool planned_ = false;
  bool budget_planned_ = false;
  std::vector<bool> drop_;      // by layer index
  std::vector<uint64_t> full_;  // bytes a layer saved in forward
  std::vector<uint64_t> kept_;  // bytes a dropped block keeps (its output)
};

hr_status create(const hr_host_services* s, void** instance) {
  if (!HR_HAS_FIELD(s, hr_host_services, drop_activations) || !s->drop_activations) {
    s->set_error(s->host, "checkpoint needs plugin ABI 1.3 (drop_activations); this host is older");
    return HR_ERROR_UNSUPPORTED;
  }
  char policy[32] = "every";
  int64_t n = -1;
  uint64_t budget = 0;
  bool has_budget = false;
  hr_status st = s->config_string(s->host, "policy", policy, sizeof policy);
  if (st == HR_ERROR_INVALID)
    return s->config_error(s->host, "policy",
                           "must be \"every\", \"every_n\", \"sqrt\", \"selective\" or "
                           "\"budget\"");
  if (st == HR_OK) st = s->config_int(s->host, "n", &n);
  if (st == HR_OK) {
    uint64_t b = ~uint64_t(0);
    st = s->config_size(s->host, "budget", &b);
    has_budget = b != ~uint64_t(0);
    if (has_budget) budget = b;
  }
  if (st != HR_OK) return st;

  Policy p;
  const std::string name = policy;
  if (name == "every") {
    p = Policy::kEvery;
  } else if (name == "every_n") {
    p = Policy::kEveryN;
  } else if (name == "sqrt") {
    p = Policy::kSqrt;
  } else if (name == "budget") {
    p = Policy::kBudget;
  } else if (name == "selective") {
    p = Policy::kSelective;
  } else {
    return s->config_error(s->host, "policy",
                           ("must be \"every\", \"every_n\", \"sqrt\", \"selective\" or "
                            "\"budget\"; got \"" +
                            name + "\"")
                               .c_str());
  }
  if (p == Policy::kEveryN && n == -1)
    return s->config_error(s->host, "policy", "\"every_n\" needs n (keep every n-th block)");
  if (n != -1 && p != Policy::kEveryN)
    return s->config_error(s->host, "n", "applies to policy = \"every_n\" only");
  if (p == Policy::kEveryN && n < 1)
    return s->config_error(s->host, "n",
                           ("must be a positive integer; got " + std::to_string(n)).c_str());
  if (p == Policy::kBudget && !has_budget)
    return s->config_error(s->host, "policy", "\"budget\" needs budget = \"<size>\" (\"256MiB\")");
  if (has_budget && p != Policy::kBudget)
    return s->config_error(s->host, "budget", "applies to policy = \"budget\" only");
  if (p == Policy::kBudget && budget == 0)
    return s->config_error(s->host, "budget", "must be above zero");
  *instance = new Checkpoint(s, p, n, budget);
  return HR_OK;
}

hr_status create_hook(const hr_host_services* s, void** instance) {
  return headroom_plugin::guarded(s, "starting", [&] { return create(s, instance); });
}

void destroy(void* instance) {
  delete static_cast<Checkpoint*>(instance);
}

hr_status on_event(void* instance, const hr_event_info* info) {
  if (info->event != HR_EVENT_FORWARD_END) return HR_OK;
  Checkpoint* c = static_cast<Checkpoint*>(instance);
  return headroom_plugin::guarded(c->services(), "planning which blocks to drop",
                                  [&] { return c->on_forward_end(info->layer); });
}

// headroom.estimate/1. The policy is this plugin's, so the estimate is too: it sets which blocks
// drop (plan()'s rule, layer b + 1 for block b) and core's closed form has the bytes.
int64_t sqrt_n(int64_t L) {
  return static_cast<int64_t>(std::ceil(std::sqrt(double(L))));  // as plan() computes it
}

// The drops of a fixed policy (plan()): every and selective drop every block (selective only its
// cheap tensors); every_n (and sqrt, n = ceil(sqrt(L))) drops block b unless b % n == n - 1. A
// kept block's entry is left as the plugins before this one set it.
void set_drops(Policy p, int64_t n, hr_mechanisms* m) {
  const int64_t L = int64_t(m->num_layers) - 2;
  if (p == Policy::kSqrt) n = sqrt_n(L);
  if (n < 1) n = 1;
  for (int64_t b = 0; b < L; ++b) {
    uint8_t& d = m->drop[b + 1];
    if (p == Policy::kEvery) {
      d = HR_DROP_ALL;
    } else if (p == Policy::kSelective) {
      if (d != HR_DROP_ALL) d = HR_DROP_CHEAP;  // CHEAP after ALL changes nothing
    } else if (b % n != n - 1) {
      d = HR_DROP_ALL;
    }
  }
}

// Step time over no plugins: docs/results/plugins.md, "Results", rows "checkpoint every" (1.179),
// "checkpoint sqrt" (1.147) and "checkpoint selective" (0.955: no GEMM re-run, within the noise of
// 1). every_n and budget re-run the forward of the blocks they drop: every's overhead times the
// share of blocks dropped (sqrt's 9 of 12 blocks, 1.147 against 1 + 0.18 × 0.75 = 1.135, agrees).
double step_time(Policy p, const hr_mechanisms* m) {
  if (p == Policy::kEvery) return 1.18;
  if (p == Policy::kSqrt) return 1.15;
  if (p == Policy::kSelective) return 1.0;
  const int64_t L = int64_t(m->num_layers) - 2;
  int64_t dropped = 0;
  for (int64_t b = 0; b < L; ++b)
    dropped += m->drop[b + 1] == HR_DROP_ALL;
  return L > 0 ? 1.0 + 0.18 * double(dropped) / double(L) : 1.0;
}

uint64_t total_of(const uint64_t* bytes) {
  uint64_t t = 0;
  for (int i = 0; i < HR_MEM_CATEGORY_COUNT_V1; ++i)
    t += bytes[i];
  return t;
}

hr_status estimate(void* instance, const hr_estimate_query* q, hr_estimate_result* r) {
  if (!q || !r || !r->after || !r->after->drop || !q->peak || !q->model) return HR_ERROR_INVALID;
  hr_mechanisms* m = r->after;
  const int64_t L = int64_t(m->num_layers) - 2;
  const Checkpoint* c = static_cast<const Checkpoint*>(instance);
  if (!c && L < 1) return HR_ERROR_UNSUPPORTED;  // no block to drop
  const std::vector<uint8_t> before(m->drop, m->drop + m->num_layers);
  Policy p = c ? c->policy() : Policy::kSqrt;
  const int64_t n = c ? c->n() : 0;
  std::string extra;
  hr_status st = HR_OK;
  if (p == Policy::kBudget) {
    // plan_budget(): the fewest blocks, the earliest first (every block saves the same), such that
    // its bound stays under the budget: every held byte plus one block recomputed. Here the closed
    // form's activations at the peak plus what one block saves by dropping (the peak of all kept
    // less the peak with block 1 dropped) stand in for it; that is a block's output short of the
    // bound, so the run may drop a block more than this (a lower peak) or find a budget this
    // estimate meets unmeetable (its message says so, at the first step).
    const uint64_t budget = c->budget();
    uint64_t saves = 0;  // one block's activations less its output
    if (L >= 2) {
      uint64_t kept[HR_MEM_CATEGORY_COUNT_V1], one[HR_MEM_CATEGORY_COUNT_V1];
      st = q->peak(q->context, m, kept);
      if (st != HR_OK) return st;
      const uint8_t first = m->drop[1];
      m->drop[1] = HR_DROP_ALL;
      st = q->peak(q->context, m, one);
      m->drop[1] = first;
      if (st != HR_OK) return st;
      if (kept[HR_MEM_ACTIVATIONS] > one[HR_MEM_ACTIVATIONS])
        saves = kept[HR_MEM_ACTIVATIONS] - one[HR_MEM_ACTIVATIONS];
    }
    int64_t k = 0;
    for (;; ++k) {
      for (int64_t l = 0; l < int64_t(m->num_layers); ++l)
        m->drop[l] = l >= 1 && l <= k ? HR_DROP_ALL : before[size_t(l)];
      st = q->peak(q->context, m, r->bytes);
      if (st != HR_OK) return st;
      if (r->bytes[HR_MEM_ACTIVATIONS] + (k > 0 ? saves : 0) <= budget || k == L) break;
    }
    if (r->bytes[HR_MEM_ACTIVATIONS] + (k > 0 ? saves : 0) > budget)
      extra = "; the budget cannot be met, the run stops at its first step";
    std::snprintf(r->what, sizeof r->what,
                  "activation recomputation, policy budget: %lld of %lld blocks recomputed%s",
                  static_cast<long long>(k), static_cast<long long>(L), extra.c_str());
    std::snprintf(r->toml, sizeof r->toml, "policy = \"budget\"\nbudget = %llu",
                  static_cast<unsigned long long>(budget));
    r->step_time_factor = step_time(p, m);
    return HR_OK;
  }
  set_drops(p, n, m);
  st = q->peak(q->context, m, r->bytes);
  if (st != HR_OK) return st;
  if (!c && q->model->memory_limit && total_of(r->bytes) > q->model->memory_limit) {
    // sqrt does not fit: propose every, which saves the most.
    p = Policy::kEvery;
    std::copy(before.begin(), before.end(), m->drop);
    set_drops(p, 0, m);
    st = q->peak(q->context, m, r->bytes);
    if (st != HR_OK) return st;
  }
  static const char* const kNames[] = {"every", "every_n", "sqrt", "selective", "budget"};
  const char* name = kNames[int(p)];
  if (p == Policy::kEveryN) {
    std::snprintf(r->what, sizeof r->what,
                  "activation recomputation, policy every_n: every %lld-th block keeps its "
                  "activations",
                  static_cast<long long>(n));
    std::snprintf(r->toml, sizeof r->toml, "policy = \"every_n\"\nn = %lld",
                  static_cast<long long>(n));
  } else {
    std::snprintf(r->what, sizeof r->what, "activation recomputation, policy %s", name);
    std::snprintf(r->toml, sizeof r->toml, "policy = \"%s\"", name);
  }
  r->step_time_factor = step_time(p, m);
  return HR_OK;
}

// Constant-initialized: loading the library runs no code before hr_plugin_entry.
// The policies `plan --measure --search` tries (budget's needs a size: its proposal has one).
constexpr hr_estimate_mode kModes[] = {
    headroom_plugin::mode("policy every", "policy = \"every\""),
    headroom_plugin::mode("policy selective", "policy = \"selective\""),
    headroom_plugin::mode("policy every_n, n = 2", "policy = \"every_n\"\nn = 2"),
    headroom_plugin::mode("policy sqrt", "policy = \"sqrt\""),
};

const hr_plugin_descriptor kDescriptor = {
    sizeof(hr_plugin_descriptor),
    HR_ABI_VERSION,
    "checkpoint",
    "1.0.0",
    "activation recomputation: blocks drop their activations in forward and recompute them in "
    "backward (every, every_n, sqrt, selective, budget)",
    HR_EVENT_BIT(HR_EVENT_FORWARD_END),
    0,  // roles
    0,  // reserved0
    create_hook,
    destroy,
    on_event,
    nullptr,  // allocator
    nullptr,  // optimizer
    nullptr,  // save_state: the plan is rebuilt from the config and the first micro-step
    nullptr,  // load_state
    // FORWARD_END drops activations: no hook touches the gradients.
    headroom_plugin::offer_all<headroom_plugin::offer_estimate_modes<estimate, kModes>,
                               headroom_plugin::offer_reads<0>>,
};

}  // namespace

// hr_negotiate refuses another major version; the host's message names both versions.
HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
