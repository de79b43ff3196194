// What plugins choose for the run while they are created, before the model is built — the compute
// dtype and the model state's layout around it (amp), and what is sharded across ranks (the zero
// plugins) — and the loss scale they set at any time. The trainer builds the model from these.
#pragma once

#include <cstdint>
#include <string>

#include "core/model/model.h"
#include "core/plugin_host/run_interfaces.h"
#include "core/shard/sharding.h"

namespace headroom {

class RunChoices final : public PrecisionChoice, public ShardChoice, public AdapterChoice {
 public:
  // The model the run builds, which add_lora's targets must name modules of.
  explicit RunChoices(const ModelConfig& model) : model_(model) {}

  // The model is built (with `sharding`, the mechanism, when something is sharded; else null):
  // from now on the choices are fixed.
  void freeze(Sharding* sharding) {
    frozen_ = true;
    sharding_ = sharding;
  }

  // std::logic_error after freeze() or when another plugin chose another dtype;
  // std::invalid_argument for a dtype that is not f32, bf16 or f16.
  void set_compute_dtype(const std::string& plugin, Dtype dtype) override;
  // The state layout around the compute dtype: std::invalid_argument naming what
  // precision_problem() finds, std::logic_error after freeze().
  void set_precision(const std::string& plugin, const Precision& p) override;
  // What is sharded (kShard* bits): std::logic_error after freeze() or when another plugin chose
  // already, std::invalid_argument for bits that are no ZeRO stage.
  void set_partition(const std::string& plugin, uint32_t what) override;
  // With parameters sharded, layers under `elements` keep them whole: from the sharding plugin
  // before freeze() only (std::logic_error otherwise).
  void set_persist_below(const std::string& plugin, uint64_t elements) override;
  // The factor the loss gradient is multiplied by from the next step on (std::invalid_argument
  // unless finite and > 0).
  void set_loss_scale(const std::string& plugin, double scale) override;
  Sharding* sharding() override { return sharding_; }
  void add_lora(const std::string& plugin, const LoraSpec& spec) override;
  // std::logic_error after freeze(), twice, or from a plugin that added no adapters.
  void set_base(const std::string& plugin, QuantKind kind, bool double_quant) override;
  QuantKind base() const { return base_; }
  bool double_quant() const { return double_quant_; }
  // The adapters plugins added, in order, and the plugin that added them ("" when none).
  const std::vector<LoraSpec>& lora() const { return lora_; }
  const std::string& lora_by() const { return lora_by_; }

  const Precision& precision() const override { return precision_; }
  // The plugin that chose the layout, for messages; "" when none did.
  const std::string& precision_by() const { return precision_by_; }
  uint32_t shard_what() const { return shard_what_; }
  uint64_t shard_persist_below() const { return shard_persist_below_; }
  const std::string& shard_plugin() const { return shard_plugin_; }
  double loss_scale() const override { return loss_scale_; }

 private:
  bool frozen_ = false;
  Sharding* sharding_ = nullptr;
  Precision precision_;
  std::string compute_dtype_by_, precision_by_;
  uint32_t shard_what_ = 0;
  uint64_t shard_persist_below_ = 0;
  std::string shard_plugin_;
  double loss_scale_ = 1.0;
  ModelConfig model_;
  std::vector<LoraSpec> lora_;
  std::string lora_by_;
  QuantKind base_ = QuantKind::kNone;
  bool double_quant_ = false, base_set_ = false;
};

}  // namespace headroom
