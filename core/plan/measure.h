// `headroom plan --measure`: the config's own setup (device, allocator, plugins) run dry for two
// optimizer steps: the config itself when the host can hold it (exact), else cheap variants of it
// (micro_batch 1 and 2 x blocks 1 and 2, the same seq_len, vocab and width), each category's bytes
// at the peak fitted as
//   v(b, L) = v11 + (b-1)·Δb + (L-1)·ΔL + (b-1)(L-1)·Δ×      (4 coefficients from the 2×2 grid)
// (blocks k and 2k instead of 1 and 2 when the check point shows a policy repeating over blocks)
// and extrapolated to the config; a third point checks the fit. Whatever the plugins do, they do
// it in the variants: the planner never needs to know one.
#pragma once

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/device/memory.h"

namespace headroom {

// How a variant runs: dry (the default of the prediction: every allocation, free and copy of the
// run, no arithmetic — core/device/dry_backend.h; the bytes are the same, the cost is setup and
// memory traffic) or computing (for step times).
enum class Arithmetic { kDry, kCompute };

// One dry run of a variant.
struct VariantRun {
  int micro_batch = 0, n_layer = 0;
  bool ran = false;
  std::string refused;    // why it did not run (the closed form says it would not fit, or OOM)
  ByCategory at_peak{};   // live bytes by category at the highest total
  uint64_t peak = 0;      // that total
  uint64_t reserved = 0;  // the most the allocator (or backend) held: reserved bytes
  Phase peak_phase;       // where the peak was
  // The live bytes by category after every allocation, in the order made (the first: the highest
  // point of the setup before the run's first event), and the phase each was made in (an index
  // into `phases`). The micro-batch fit fits each allocation's point on its own: the peak can
  // move to another allocation as the micro-batch grows (zero2's gradients reduced at micro_batch
  // 1, a larger batch's activations at 8), and a maximum of points is not affine even where every
  // point is.
  std::vector<ByCategory> after_alloc;
  std::vector<uint32_t> alloc_phase;
  std::vector<Phase> phases;
  uint64_t step1_peak = 0, step1_reserved = 0;  // the same at the end of step 1
  // The host ledger (docs/design.md "Places": the offloaded optimizer's copies and state) at its
  // own peak, by category, and that peak; 0 when nothing lives on the host place.
  ByCategory host_at_peak{};
  uint64_t host_peak = 0;
  double step_ms = 0;  // the fastest step's wall time (with Arithmetic::kCompute only)
  double wall_ms = 0;  // the whole dry run (setup included)
};

struct Measured {
  // How the prediction was made. kDirect: the config itself ran dry (micro_batch and blocks as
  // configured), and the prediction is its measurement, exact for any policy. kMicroBatch: the
  // configured blocks at micro_batch 1 and 2, each allocation's point fitted over the micro-batch
  // on its own and the highest taken (checked at 3): exact for any policy of the blocks. kBlocks:
  // the grid over micro_batch and blocks below, exact for what is affine in the blocks.
  // `why_extrapolated` says why it is not kDirect (the host cannot hold the config, or its
  // memory_limit refused it).
  enum class Method { kDirect, kMicroBatch, kBlocks };
  Method method = Method::kBlocks;
  std::string why_extrapolated;
  std::vector<VariantRun> runs;  // every dry run, in the order made
  int steps = 2;  // of each variant but the first: 1 when the first's second step added nothing
  // The blocks of the grid the prediction comes from: 1 and 2, or k and 2k when the check point
  // showed a policy that repeats over blocks (the first k whose check holds within 0.1%).
  std::array<int, 2> grid_blocks{1, 2};
  int check_b = 0, check_l = 0;  // the check point (0: none, the config is on the grid)
  VariantRun check_run;          // its dry run
  ByCategory by_category{};      // predicted at the config's peak
  uint64_t peak = 0;             // their sum
  uint64_t reserved = 0;         // predicted reserved bytes (>= peak)
  uint64_t fragmentation = 0;    // reserved - peak
  std::string phase;             // of the peak, named for the full model
  // The host ledger's peak by category, measured as the device's is (the same runs, the same
  // fit), and its sum: what `plan` prints as the host's closed form, measured.
  ByCategory host_by_category{};
  uint64_t host_peak = 0;
  // The check point: measured peak and reserved against the fit's.
  int64_t check_peak_error = 0, check_reserved_error = 0;
  double wall_ms = 0;  // all dry runs together
};

// Thrown when even the smallest variant cannot run (the message says why) or when one of the
// grid's does not fit the memory_limit.
class PlanRefused : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The config cut to `n_layer` blocks and `micro_batch`, two steps, grad_accum at most 2 (or
// `grad_accum` when > 0), nothing written (no snapshots, no metrics, no validation).
Config variant_of(const Config& config, int micro_batch, int n_layer, int grad_accum = 0,
                  int steps = 2);

// One dry run. Refused (ran = false) before it allocates when the closed form of the variant does
// not fit memory_limit; an out-of-memory failure during it is refused too, with its report.
VariantRun run_variant(const Config& config, int micro_batch, int n_layer, int grad_accum = 0,
                       int steps = 2, Arithmetic arithmetic = Arithmetic::kDry);

// The config's step time in ms at its own micro_batch, from short computing runs on 2 blocks (every
// candidate of a search alike, so that their ratios compare like with like): a micro-step's time
// and the optimizer's, from runs of 1 and 2 micro-steps a step (the fastest of 3 steps each), as
// grad_accum · micro + optimizer. 0 when none can run.
double measure_step_ms(const Config& config);

// What a dry run may take of the host: what it has available now (core/os/host_memory.h).
constexpr uint64_t kHostAvailable = UINT64_MAX;

// The prediction for `config`, every run made as `arithmetic` says (dry by default: the bytes do
// not depend on it). When the config itself fits `host_bytes` (its closed form and a quarter more,
// for what plugins hold that the closed form does not know; the CPU device's memory is the
// host's) and its memory_limit, it runs itself, dry: exact whatever a policy does with the number
// of blocks (checkpoint's sqrt is not affine in them). A dry run on the CPU device with the
// host's memory (kHostAvailable) always runs the config itself: its buffers commit no memory.
// Otherwise, or when that run is refused: the 2×2 grid, the fit, the check point. host_bytes 0
// always extrapolates. Throws PlanRefused.
Measured measure(const Config& config, Arithmetic arithmetic = Arithmetic::kDry,
                 uint64_t host_bytes = kHostAvailable);

// What `plan --measure` prints.
std::string format_measured(const Config& config, const Measured& m);
// The same as one JSON object: peak_bytes, by_category, reserved_bytes, fragmentation, phase,
// check, dry_run_s, dry_run_steps.
std::string measured_json(const Measured& m, bool pretty = false);

}  // namespace headroom
