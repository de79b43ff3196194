// What plugins reach of a training run beyond the services' own state, by topic: one small
// interface each, implemented by whatever part of the run owns the topic (the trainer today; a
// replay or a config check implements fewer). PluginHost::create takes them as one RunInterfaces,
// in which a null pointer means "this run has none": the services then answer as a run without it
// does (each interface says how), so a run implements only what it has.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/comm/comm.h"
#include "core/device/device.h"
#include "core/events/step_state.h"
#include "core/model/model.h"
#include "core/shard/sharding.h"

namespace headroom {

// A resize (headroom.resize/1) this run cannot do: sharded, on several ranks, or an optimizer
// that cannot resize its state. Nothing was changed.
class ResizeRefused : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Every `plugin` argument below is the calling plugin's name, for the messages, which start with
// it.

// The model, once built. None: the run has no model (every model service answers "not built").
class ModelAccess {
 public:
  virtual ~ModelAccess() = default;
  virtual Gpt<float>* built_model() = 0;  // nullptr until the model is built
};

// The run's communicator, for headroom.comm/1 and the services table's rank and world_size.
// None, or nullptr from it: a single process (the plugins see rank 0 of 1, their collectives
// local). A run launched on several ranks must return its own. Asked at every call: a run may
// let its communicator go before its plugins (they still see rank 0 of 1 then).
class CommAccess {
 public:
  virtual ~CommAccess() = default;
  virtual Communicator* plugin_communicator() = 0;
};

// The step's course: headroom.step/1's state, the services table's veto_step and request_retry.
// None: vetoes and retries change nothing, and the state is StepState{}.
class StepControl {
 public:
  virtual ~StepControl() = default;
  virtual void veto_step(const std::string& plugin, const std::string& reason) = 0;
  virtual void request_retry(const std::string& plugin, const std::string& reason) = 0;
  // headroom.step/1's stop_run: the run stops cleanly before its next step (ext/step.h). A run
  // without steps has nothing to stop.
  virtual void request_stop(const std::string& plugin, const std::string& reason) {
    (void)plugin;
    (void)reason;
  }
  // Where the current step stands (core/events/step_state.h); before the first, StepState{}.
  virtual const StepState& step_state() const = 0;
};

// headroom.precision/1's choices (and the 1.4 table's set_compute_dtype, set_loss_scale) and what
// its getters answer. None: the choices change nothing (a run without a model to compute), and
// the getters answer f32 and a loss scale of 1.
class PrecisionChoice {
 public:
  virtual ~PrecisionChoice() = default;
  // The dtype the model computes in; only before the model is built (std::logic_error after, or
  // when another plugin chose another; std::invalid_argument for a dtype that is not f32, bf16 or
  // f16).
  virtual void set_compute_dtype(const std::string& plugin, Dtype dtype) = 0;
  // The state layout around the compute dtype (headroom.precision/1's appended setters): only
  // before the model is built, after set_compute_dtype; std::invalid_argument naming what
  // precision_problem() finds, std::logic_error after the model is built.
  virtual void set_precision(const std::string& plugin, const Precision& p) = 0;
  // The factor the loss gradient is multiplied by from the next step on (std::invalid_argument
  // unless finite and > 0).
  virtual void set_loss_scale(const std::string& plugin, double scale) = 0;
  // The compute dtype and the model state's layout around it, as chosen so far.
  virtual const Precision& precision() const = 0;
  // The loss scale the next STEP_BEGIN makes the step's (StepState::loss_scale is the step's).
  virtual double loss_scale() const = 0;
};

// headroom.shard/1's choices and its mechanism. None: the setters throw std::logic_error ("this
// run has no model to shard") and nothing is sharded.
class ShardChoice {
 public:
  virtual ~ShardChoice() = default;
  // What the run shards (kShard* bits), from `plugin`'s create() only: std::logic_error after, or
  // when another plugin chose already; std::invalid_argument for bits that are no ZeRO stage. A
  // run that cannot shard says so with std::logic_error.
  virtual void set_partition(const std::string& plugin, uint32_t what) = 0;
  // persist_below: from create() only, after set_partition with parameters sharded
  // (std::logic_error otherwise).
  virtual void set_persist_below(const std::string& plugin, uint64_t elements) = 0;
  // The mechanism, once the model is built with something sharded; else nullptr.
  virtual Sharding* sharding() = 0;
};

// headroom.adapters/1's choices: the low-rank adapters plugins add beside the model's GEMMs
// (LoRA), the base frozen with them. None: they change nothing (a run without a model to adapt).
class AdapterChoice {
 public:
  virtual ~AdapterChoice() = default;
  // Only before the model is built (std::logic_error after); std::invalid_argument for a rank
  // below 1, an alpha that is not finite and > 0, or a target that names no module of the run's
  // model.
  virtual void add_lora(const std::string& plugin, const LoraSpec& spec) = 0;
  // How the frozen base's linear weights are stored (Tuning::base): once, by the plugin that adds
  // the adapters, before the model is built (std::logic_error otherwise); std::invalid_argument
  // for a quantized kind on a model that is not f32 ([model] dtype).
  virtual void set_base(const std::string& plugin, QuantKind kind, bool double_quant) = 0;
};

// headroom.batch/1: the steps' micro-batch (the step's restarts and memory are its StepState's).
// None: the micro-batch is 1 of 1, and restart_step and set_micro_batch throw std::logic_error
// ("this run has no steps to restart" / "to size").
class BatchControl {
 public:
  virtual ~BatchControl() = default;
  // [train] micro_batch and grad_accum.
  virtual int configured_micro_batch() const = 0;
  virtual int configured_grad_accum() const = 0;
  // The micro-batch the steps run at from the next micro-step 1 on: one a plugin asked for, else
  // the current one.
  virtual int next_micro_batch() const = 0;
  // From the OOM event: the step runs again from its first micro-step at `micro_batch` once the
  // failed allocation has unwound (std::invalid_argument for a micro-batch that does not divide
  // [train] micro_batch or is above the current one; std::logic_error where steps cannot be
  // restarted).
  virtual void restart_step(const std::string& plugin, int micro_batch,
                            const std::string& reason) = 0;
  // From TRAIN_BEGIN, STEP_BEGIN (this step) or STEP_END (the next step): the micro-batch
  // (std::invalid_argument for one that does not divide [train] micro_batch).
  virtual void set_micro_batch(const std::string& plugin, int micro_batch,
                               const std::string& reason) = 0;
};

// headroom.resize/1's changes to the model. None: ResizeRefused ("this run has no model to
// resize").
class ModelResize {
 public:
  virtual ~ModelResize() = default;
  // Keeps the hidden units `keep` of block `layer`'s MLP (Gpt::resize_mlp) with every slot and the
  // optimizer's state. std::invalid_argument for a bad layer or list, ResizeRefused for a run that
  // cannot resize, OutOfMemory.
  virtual void resize_mlp(const std::string& plugin, int layer,
                          const std::vector<uint32_t>& keep) = 0;
  // The same for the block's attention heads (Gpt::resize_heads).
  virtual void resize_heads(const std::string& plugin, int layer,
                            const std::vector<uint32_t>& keep) = 0;
};

// headroom.offload/1's choice: where the built-in optimizer keeps its state and the f32 weights
// it updates. None: set_optimizer_place throws std::logic_error ("this run has no optimizer to
// place") and the place is the device's.
class PlaceChoice {
 public:
  virtual ~PlaceChoice() = default;
  // From `plugin`'s create() only: std::logic_error after the optimizer is made, or when another
  // plugin chose already.
  virtual void set_optimizer_place(const std::string& plugin, bool host) = 0;
  // The NVMe tier: the host place with the optimizer's state in files under `dir` (core/run/
  // state_file.h); `direct_io` HR_DIRECT_IO_AUTO, _ON or _OFF. The same rules as above.
  virtual void set_optimizer_files(const std::string& plugin, const std::string& dir,
                                   uint32_t direct_io) = 0;
  virtual bool optimizer_on_host() const = 0;            // true for the NVMe tier too
  virtual const std::string& optimizer_dir() const = 0;  // "" unless the NVMe tier
  virtual uint32_t optimizer_direct_io() const = 0;
  // Where the layers' outputs wait between forward and backward (Gpt::set_activation_place), and
  // whether the host place is page-locked: the same rules.
  virtual void set_activation_place(const std::string& plugin, bool host) = 0;
  virtual bool activations_on_host() const = 0;
  // Where a sharded layer's shards rest (core/shard/sharding.h: offloaded parameters).
  virtual void set_parameter_place(const std::string& plugin, bool host) = 0;
  virtual bool parameters_on_host() const = 0;  // true for their NVMe tier too
  // Their NVMe tier: the host place with the parameter shards in files under `dir`
  // (core/shard/shard_file.h). The same rules.
  virtual void set_parameter_files(const std::string& plugin, const std::string& dir,
                                   uint32_t direct_io) = 0;
  virtual const std::string& parameter_dir() const = 0;  // "" unless their NVMe tier
  virtual uint32_t parameter_direct_io() const = 0;
  virtual void set_host_page_locked(const std::string& plugin, bool page_locked) = 0;
  virtual bool host_page_locked() const = 0;
};

// The record a PlaceChoice keeps: who chose, and what.
class PlaceRecord final : public PlaceChoice {
 public:
  void set_optimizer_place(const std::string& plugin, bool host) override {
    choose(plugin, "the optimizer's place");
    host_ = host;
    dir_.clear();
  }
  void set_optimizer_files(const std::string& plugin, const std::string& dir,
                           uint32_t direct_io) override {
    if (dir.empty()) throw std::invalid_argument(plugin + ": the NVMe tier needs a folder");
    set_optimizer_place(plugin, true);
    dir_ = dir;
    direct_io_ = direct_io;
  }
  bool optimizer_on_host() const override { return host_; }
  const std::string& optimizer_dir() const override { return dir_; }
  uint32_t optimizer_direct_io() const override { return direct_io_; }
  void set_activation_place(const std::string& plugin, bool host) override {
    choose(plugin, "the activations' place");
    activations_host_ = host;
  }
  bool activations_on_host() const override { return activations_host_; }
  void set_parameter_place(const std::string& plugin, bool host) override {
    choose(plugin, "the parameters' place");
    parameters_host_ = host;
    parameter_dir_.clear();
  }
  bool parameters_on_host() const override { return parameters_host_; }
  void set_parameter_files(const std::string& plugin, const std::string& dir,
                           uint32_t direct_io) override {
    if (dir.empty()) throw std::invalid_argument(plugin + ": the NVMe tier needs a folder");
    set_parameter_place(plugin, true);
    parameter_dir_ = dir;
    parameter_direct_io_ = direct_io;
  }
  const std::string& parameter_dir() const override { return parameter_dir_; }
  uint32_t parameter_direct_io() const override { return parameter_direct_io_; }
  void set_host_page_locked(const std::string& plugin, bool page_locked) override {
    choose(plugin, "the host place's memory");
    page_locked_ = page_locked;
  }
  bool host_page_locked() const override { return page_locked_; }
  const std::string& chosen_by() const { return by_; }  // "" when no plugin chose
  void freeze() { frozen_ = true; }

 private:
  // One plugin chooses the places, from its create() (before the model and the optimizer exist).
  void choose(const std::string& plugin, const std::string& what) {
    if (frozen_)
      throw std::logic_error(plugin + ": the run is built already; " + what +
                             " is chosen from create()");
    if (!by_.empty() && by_ != plugin)
      throw std::logic_error(plugin + ": " + what + " was chosen already, by " + by_ +
                             "; two plugins cannot both choose the places");
    by_ = plugin;
  }
  bool host_ = false, frozen_ = false, activations_host_ = false, parameters_host_ = false,
       page_locked_ = true;
  std::string by_, dir_, parameter_dir_;
  uint32_t direct_io_ = 0, parameter_direct_io_ = 0;
};

// One run as the plugin host sees it. Every pointer must outlive the plugin host; null: the run
// has none (above).
struct RunInterfaces {
  Device* device = nullptr;  // required: what the plugins allocate from and compute on
  ModelAccess* model = nullptr;
  CommAccess* comm = nullptr;
  StepControl* step = nullptr;
  PrecisionChoice* precision = nullptr;
  ShardChoice* shard = nullptr;
  BatchControl* batch = nullptr;
  ModelResize* resize = nullptr;
  PlaceChoice* place = nullptr;
  AdapterChoice* adapters = nullptr;
  // The plugins are created only to be checked or asked for estimates (validate_plugins,
  // `headroom plan`, the advice), often many times and at one rank whatever the run's: their
  // debug and info lines are not the run's and are not printed.
  bool checking_only = false;
};

// A run with a device and nothing else — replaying an allocation trace, testing an allocator:
// vetoes, retries and precision choices (amp's) change nothing in it.
inline RunInterfaces modeless_run(Device& device) {
  RunInterfaces run;
  run.device = &device;
  return run;
}

// `run` with each interface it has none of replaced by one that answers as the comments above
// say (stateless, shared): what the plugin host keeps, so that no service asks for null. Throws
// std::invalid_argument without a device.
RunInterfaces with_defaults(const RunInterfaces& run);

}  // namespace headroom
