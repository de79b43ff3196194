// Records the allocation trace of a real training run whose sequence length changes every step,
// and picks the memory_limit it is meant to be replayed under: tests/data/varlen.trace.
//
//   build/bin/record_trace --out tests/data/varlen.trace
//       --defrag-config tests/data/varlen-defrag.toml      (one line, from the source tree)
//
// The run: a small GPT-2 (Gpt<float>, 3 layers, n_embd 32, 8 heads, context 1024) on random
// tokens, forward and backward of batches whose T cycles through --seq-lens (640, 64, 1024, 128,
// 512, 256: documents of different lengths), with AdamW (core/optim/optim.h) and an
// AllocTraceRecorder on the device. The next batch is loaded onto the device while the current one
// computes (at the head's forward), as the trainer's prefetching loader does.
//
// By default the optimizer steps in backward: each layer's AdamW runs as soon as that layer's
// gradients are final (the memory-saving "optimizer in backward" of torchtune and LOMO). That is
// what makes this trace fragment, and why: first-fit placement is close to perfect for the
// loop's stack-like lifetimes (activations freed in the reverse of their allocation order), but
// here the first step allocates each layer's AdamW state in the middle of backward, in the hole
// the layer above has just freed. The state lives for the rest of the run, at heights set by the
// first step's T = 640; a later T = 1024 step needs (T, T) attention buffers larger than any of
// the gaps between those blocks, although the gaps add up to more than enough bytes. (PyTorch's
// lazily allocated .grad tensors pin memory the same way.) With --optimizer after-accumulation the
// step runs after every --grad-accum micro-steps and a first-fit allocator fits the trace almost
// without waste.
//
// The memory_limit in the header: the middle of the highest run of limits (1 MiB grid, from the
// peak live bytes up) under which replaying with the default allocator fails although the bytes
// it asked for were free in total (the CPU arena's first-fit placement) and, with
// --defrag-config, that config's allocator plugin completes. The middle, so that either allocator
// can change a little without flipping the test that asserts both. The scan is the replay itself
// (core/report/alloc_trace.h): it sees exactly what `headroom replay` and the tests will.

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/device/device.h"
#include "core/model/model.h"
#include "core/optim/optim.h"
#include "core/report/alloc_trace.h"

namespace {

using namespace headroom;

// Sets the tracker's phase as the trainer does, so the trace names each record's phase.
class Phases final : public LayerEvents {
 public:
  Phases(Device& device, const Gpt<float>& model) : device_(device), model_(model) {}
  std::function<void(int layer)> on_forward;  // called at each forward_begin, after the phase
  std::function<void(int layer)> on_backward_end;

  void set(Phase::Kind kind, int layer = -1) {
    Phase p;
    p.kind = kind;
    p.layer = layer;
    if (layer >= 0) p.layer_name = model_.layers()[layer]->name();
    p.step = step;
    p.micro_step = micro_step;
    device_.tracker().set_phase(p);
  }
  void forward_begin(int layer) override {
    set(Phase::Kind::kForward, layer);
    if (on_forward) on_forward(layer);
  }
  void forward_end(int) override {}
  void backward_begin(int layer) override { set(Phase::Kind::kBackward, layer); }
  void backward_end(int layer) override {
    if (on_backward_end) on_backward_end(layer);
  }

  int64_t step = 0;
  int micro_step = 0;

 private:
  Device& device_;
  const Gpt<float>& model_;
};

struct DeviceBatch {
  Buffer tokens, targets;
  int T = 0;
};

DeviceBatch load_batch(Device& device, int B, int T, int vocab, std::mt19937& rng) {
  DeviceBatch b;
  b.T = T;
  const uint64_t n = uint64_t(B) * T;
  b.tokens = Buffer(device, n * sizeof(int32_t), Category::kData, "inputs (B, T)");
  b.targets = Buffer(device, n * sizeof(int32_t), Category::kData, "targets (B, T)");
  std::uniform_int_distribution<int32_t> tok(0, vocab - 1);
  for (uint64_t i = 0; i < n; ++i) {
    b.tokens.as<int32_t>()[i] = tok(rng);
    b.targets.as<int32_t>()[i] = tok(rng);
  }
  return b;
}

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    out.push_back(std::stoi(item));
  return out;
}

void record(const std::string& path, const ModelConfig& m, int B, int grad_accum, int64_t steps,
            const std::vector<int>& Ts, int prefetch_layer, bool in_backward) {
  DeviceConfig dc;  // no limit
  std::unique_ptr<Device> device = Device::create(dc);
  // Declared after the device and before the model: destroyed after the model, so the trace ends
  // with the frees of the parameters, gradients and optimizer state.
  AllocTraceRecorder recorder(path, *device, 0);
  device->add_observer(&recorder);
  Phase setup;
  device->tracker().set_phase(setup);
  Gpt<float> model(m, *device, 1);
  Phases phases(*device, model);
  TrainConfig tc;
  tc.optimizer = "adamw";
  tc.lr = 1e-3;
  tc.warmup_steps = 0;
  tc.steps = steps;
  std::unique_ptr<Optimizer> optimizer = make_optimizer(tc, *device);
  const std::vector<Param<float>*> params = model.params();
  // Optimizer in backward: one AdamW per layer, stepped when the layer's gradients are final.
  std::vector<std::unique_ptr<Optimizer>> layer_optimizers;
  int64_t current_step = 0;
  if (in_backward) {
    for (size_t l = 0; l < model.layers().size(); ++l)
      layer_optimizers.push_back(make_optimizer(tc, *device));
    phases.on_backward_end = [&](int layer) {
      std::vector<Param<float>*> ps;
      for (const auto& p : model.layers()[layer]->params())
        ps.push_back(p.get());
      if (!ps.empty())
        layer_optimizers[layer]->step(whole_params(ps), learning_rate(tc, current_step - 1),
                                      current_step);
    };
  }
  std::mt19937 rng(1);

  size_t next_t = 0;
  phases.step = 1;
  phases.micro_step = 1;
  phases.set(Phase::Kind::kData);
  DeviceBatch current = load_batch(*device, B, Ts[next_t++ % Ts.size()], m.vocab_size, rng);
  DeviceBatch next;
  // The prefetch: the next micro-step's batch arrives during this one's forward.
  phases.on_forward = [&](int layer) {
    if (layer == prefetch_layer)
      next = load_batch(*device, B, Ts[next_t++ % Ts.size()], m.vocab_size, rng);
  };
  for (int64_t step = 1; step <= steps; ++step) {
    phases.step = step;
    current_step = step;
    model.zero_grad();
    for (int a = 1; a <= grad_accum; ++a) {
      phases.micro_step = a;
      Batch batch;
      batch.tokens = current.tokens.as<int32_t>();
      batch.targets = current.targets.as<int32_t>();
      batch.B = B;
      batch.T = current.T;
      batch.dloss = 1.0 / (double(B) * current.T * grad_accum);
      model.forward(batch, &phases);
      model.backward(batch, &phases);
      phases.set(Phase::Kind::kData);
      current = std::move(next);  // frees this micro-step's batch
    }
    if (in_backward) continue;
    phases.micro_step = 0;
    phases.set(Phase::Kind::kOptimizer);
    clip_grad_norm(device->backend(), params, 1.0);
    optimizer->step(whole_params(params), learning_rate(tc, step - 1), step);
  }
  phases.set(Phase::Kind::kDone);
  current = DeviceBatch();
}

// The middle of the highest run of limits on a 1 MiB grid at which the default allocator fails
// with enough bytes free (and, given a config, its allocator plugin completes); 0 when there is
// none. Prints what each limit does, as runs of equal outcomes.
uint64_t scan_limit(const AllocTrace& trace, uint64_t peak_live, const std::string& defrag_config) {
  const uint64_t MiB = uint64_t(1) << 20;
  Config with_plugin;
  if (!defrag_config.empty()) with_plugin = load_config(defrag_config);
  uint64_t best_lo = 0, best_hi = 0, run_start = 0;
  std::string run_what;
  auto close_run = [&](uint64_t end) {
    if (!run_what.empty())
      std::printf("  limit %6.1f .. %6.1f MiB: %s\n", double(run_start) / double(MiB),
                  double(end) / double(MiB), run_what.c_str());
  };
  const uint64_t first = (peak_live + MiB - 1) / MiB * MiB, last = 2 * peak_live;
  for (uint64_t limit = first; limit <= last; limit += MiB) {
    Config plain;
    plain.device.memory_limit = limit;
    const ReplayResult r = replay_alloc_trace(trace, plain, ReplayOptions{false, 0});
    const bool fragmented = r.failed && r.failure.requested <= r.failure.free &&
                            r.failure.largest_free < r.failure.requested;
    std::string what = !r.failed    ? "default completes"
                       : fragmented ? "default fails with enough bytes free"
                                    : "default fails (not enough bytes free)";
    bool plugin_ok = true;
    if (fragmented && !defrag_config.empty()) {
      with_plugin.device.memory_limit = limit;
      plugin_ok = !replay_alloc_trace(trace, with_plugin, ReplayOptions{false, 0}).failed;
      what += plugin_ok ? ", plugin completes" : ", plugin fails";
    }
    if (what != run_what) {
      close_run(limit - MiB);
      run_start = limit;
      run_what = what;
    }
    if (fragmented && plugin_ok) {
      if (best_hi + MiB != limit) best_lo = limit;  // a new run
      best_hi = limit;
    }
  }
  close_run(last / MiB * MiB);
  return best_hi ? (best_lo + best_hi) / 2 / MiB * MiB : 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"record the allocation trace of a variable-sequence-length run (tests/data)"};
  std::string out = "tests/data/varlen.trace", defrag_config, seq_lens = "640,64,1024,128,512,256";
  std::string optimizer = "in-backward";
  ModelConfig m;
  m.n_layer = 3;
  m.n_head = 8;
  m.n_embd = 32;
  m.seq_len = 1024;
  m.vocab_size = 256;
  int B = 1, grad_accum = 1, prefetch_layer = -1;
  int64_t steps = 12;
  uint64_t limit = 0;
  std::string limit_text;
  app.add_option("--out", out, "the trace file to write");
  app.add_option("--seq-lens", seq_lens, "the sequence lengths micro-steps cycle through");
  app.add_option("--n-layer", m.n_layer);
  app.add_option("--n-head", m.n_head);
  app.add_option("--n-embd", m.n_embd);
  app.add_option("--seq-len", m.seq_len, "the model's context (>= every --seq-lens entry)");
  app.add_option("--vocab-size", m.vocab_size);
  app.add_option("--micro-batch", B);
  app.add_option("--grad-accum", grad_accum, "micro-steps per optimizer step");
  app.add_option("--steps", steps, "optimizer steps");
  app.add_option("--prefetch-layer", prefetch_layer,
                 "the layer whose forward the next batch is loaded at (default: the head)");
  app.add_option("--optimizer", optimizer,
                 "in-backward: each layer's AdamW steps when its backward is done (needs "
                 "--grad-accum 1); after-accumulation: one step after --grad-accum micro-steps")
      ->check(CLI::IsMember({"in-backward", "after-accumulation"}));
  app.add_option("--memory-limit", limit_text, "write this limit instead of scanning for one");
  app.add_option("--defrag-config", defrag_config,
                 "a config whose [[plugins]] allocator must complete the replay under the limit");
  CLI11_PARSE(app, argc, argv);

  if (prefetch_layer < 0) prefetch_layer = m.n_layer + 1;
  try {
    const std::vector<int> Ts = parse_list(seq_lens);
    for (int T : Ts)
      if (T < 1 || T > m.seq_len)
        throw ConfigError("--seq-lens: " + std::to_string(T) + " is not within 1.." +
                          std::to_string(m.seq_len));
    if (!limit_text.empty()) limit = parse_size(limit_text, "--memory-limit");

    // 1. The run, on a device without a limit (the recording must not fail), to a scratch file.
    const std::string scratch = out + ".recording";
    const bool in_backward = optimizer == "in-backward";
    if (in_backward && grad_accum != 1)
      throw ConfigError("--optimizer in-backward needs --grad-accum 1");
    if (prefetch_layer < 0 || prefetch_layer > m.n_layer + 1)
      throw ConfigError("--prefetch-layer: " + std::to_string(prefetch_layer) +
                        " is not a layer (0 .. " + std::to_string(m.n_layer + 1) + ")");
    record(scratch, m, B, grad_accum, steps, Ts, prefetch_layer, in_backward);
    const AllocTrace trace = read_alloc_trace(scratch);
    std::printf("recorded %zu records (%llu allocations) over %lld steps of %d micro-steps\n",
                trace.records.size(), static_cast<unsigned long long>(trace.num_allocs()),
                static_cast<long long>(steps), grad_accum);

    // 2. The limit.
    Config plain;
    const ReplayResult unlimited = replay_alloc_trace(trace, plain, ReplayOptions{false, 0});
    std::printf("peak live %s (%llu bytes)\n", format_bytes(unlimited.peak_live).c_str(),
                static_cast<unsigned long long>(unlimited.peak_live));
    if (limit == 0) limit = scan_limit(trace, unlimited.peak_live, defrag_config);
    if (limit == 0) {
      std::fprintf(stderr,
                   "record_trace: no limit on the scan's grid makes the default allocator fail "
                   "with enough bytes free%s; choose --memory-limit yourself\n",
                   defrag_config.empty() ? "" : " while the plugin completes");
      return 1;
    }

    // 3. The trace: header with the limit, the command that made it, the records.
    std::ifstream in(scratch, std::ios::binary);
    std::string header;
    std::getline(in, header);
    const size_t at = header.find("memory_limit=");
    header.replace(at, header.find(' ', at) - at, "memory_limit=" + std::to_string(limit));
    std::ofstream o(out, std::ios::trunc | std::ios::binary);
    o << header << '\n';
    o << "# Recorded by build/bin/record_trace (bench/record_trace.cpp); regenerate with:\n#  ";
    o << " build/bin/record_trace";
    for (int i = 1; i < argc; ++i)
      o << ' ' << argv[i];
    o << "\n# GPT-2 n_layer=" << m.n_layer << " n_head=" << m.n_head << " n_embd=" << m.n_embd
      << " vocab_size=" << m.vocab_size << ", micro_batch " << B << ", seq lens " << seq_lens
      << " (one per micro-step), AdamW "
      << (in_backward ? "per layer in backward"
                      : "after every " + std::to_string(grad_accum) + " micro-steps")
      << ", " << steps << " steps; peak live " << unlimited.peak_live << " bytes\n";
    o << in.rdbuf();
    o.close();
    std::remove(scratch.c_str());
    if (!o) throw ConfigError(out + ": write failed");
    std::printf("memory_limit %s (%llu bytes): %s\n", format_bytes(limit).c_str(),
                static_cast<unsigned long long>(limit), out.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "record_trace: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
