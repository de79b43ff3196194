// What a run without one of the interfaces answers (run_interfaces.h says it for each).
#include "core/plugin_host/run_interfaces.h"

namespace headroom {

namespace {

class NoModel final : public ModelAccess {
 public:
  Gpt<float>* built_model() override { return nullptr; }
};

class NoComm final : public CommAccess {
 public:
  Communicator* plugin_communicator() override { return nullptr; }
};

class NoSteps final : public StepControl {
 public:
  void veto_step(const std::string&, const std::string&) override {}
  void request_retry(const std::string&, const std::string&) override {}
  const StepState& step_state() const override { return state_; }

 private:
  StepState state_;
};

class NoPrecision final : public PrecisionChoice {
 public:
  void set_compute_dtype(const std::string&, Dtype) override {}
  void set_precision(const std::string&, const Precision&) override {}
  void set_loss_scale(const std::string&, double) override {}
  const Precision& precision() const override { return precision_; }
  double loss_scale() const override { return 1.0; }

 private:
  Precision precision_;
};

class NoSharding final : public ShardChoice {
 public:
  void set_partition(const std::string& plugin, uint32_t) override {
    throw std::logic_error(plugin + ": this run has no model to shard");
  }
  void set_persist_below(const std::string& plugin, uint64_t) override {
    throw std::logic_error(plugin + ": this run has no model to shard");
  }
  Sharding* sharding() override { return nullptr; }
};

class NoBatch final : public BatchControl {
 public:
  int configured_micro_batch() const override { return 1; }
  int configured_grad_accum() const override { return 1; }
  int next_micro_batch() const override { return 1; }
  void restart_step(const std::string& plugin, int, const std::string&) override {
    throw std::logic_error(plugin + ": this run has no steps to restart");
  }
  void set_micro_batch(const std::string& plugin, int, const std::string&) override {
    throw std::logic_error(plugin + ": this run has no steps to size");
  }
};

class NoAdapters final : public AdapterChoice {
 public:
  void add_lora(const std::string&, const LoraSpec&) override {}
  void set_base(const std::string&, QuantKind, bool) override {}
};

class NoResize final : public ModelResize {
 public:
  void resize_mlp(const std::string& plugin, int, const std::vector<uint32_t>&) override {
    throw ResizeRefused(plugin + ": this run has no model to resize");
  }
  void resize_heads(const std::string& plugin, int, const std::vector<uint32_t>&) override {
    throw ResizeRefused(plugin + ": this run has no model to resize");
  }
};

class NoPlace final : public PlaceChoice {
 public:
  void set_optimizer_place(const std::string& plugin, bool) override {
    throw std::logic_error(plugin + ": this run has no optimizer to place");
  }
  void set_optimizer_files(const std::string& plugin, const std::string&, uint32_t) override {
    throw std::logic_error(plugin + ": this run has no optimizer to place");
  }
  bool optimizer_on_host() const override { return false; }
  const std::string& optimizer_dir() const override {
    static const std::string none;
    return none;
  }
  uint32_t optimizer_direct_io() const override { return 0; }
  void set_activation_place(const std::string& plugin, bool) override {
    throw std::logic_error(plugin + ": this run has no activations to place");
  }
  bool activations_on_host() const override { return false; }
  void set_parameter_place(const std::string& plugin, bool) override {
    throw std::logic_error(plugin + ": this run has no parameters to place");
  }
  bool parameters_on_host() const override { return false; }
  void set_parameter_files(const std::string& plugin, const std::string&, uint32_t) override {
    throw std::logic_error(plugin + ": this run has no parameters to place");
  }
  const std::string& parameter_dir() const override { return optimizer_dir(); }
  uint32_t parameter_direct_io() const override { return 0; }
  void set_host_page_locked(const std::string& plugin, bool) override {
    throw std::logic_error(plugin + ": this run has no host place");
  }
  bool host_page_locked() const override { return true; }
};

}  // namespace

RunInterfaces with_defaults(const RunInterfaces& run) {
  if (!run.device) throw std::invalid_argument("a run for the plugin host needs a device");
  static NoModel no_model;
  static NoComm no_comm;
  static NoSteps no_steps;
  static NoPrecision no_precision;
  static NoSharding no_sharding;
  static NoBatch no_batch;
  static NoResize no_resize;
  static NoPlace no_place;
  static NoAdapters no_adapters;
  RunInterfaces r = run;
  if (!r.model) r.model = &no_model;
  if (!r.comm) r.comm = &no_comm;
  if (!r.step) r.step = &no_steps;
  if (!r.precision) r.precision = &no_precision;
  if (!r.shard) r.shard = &no_sharding;
  if (!r.batch) r.batch = &no_batch;
  if (!r.resize) r.resize = &no_resize;
  if (!r.place) r.place = &no_place;
  if (!r.adapters) r.adapters = &no_adapters;
  return r;
}

}  // namespace headroom
