#include "core/run/run_choices.h"

#include <cmath>
#include <stdexcept>

#include "core/shard/sharding.h"

namespace headroom {

void RunChoices::set_compute_dtype(const std::string& plugin, Dtype dtype) {
  if (frozen_)
    throw std::logic_error(plugin +
                           ": the compute dtype can only be chosen while the plugin is "
                           "created, before the model is built");
  if (dtype != Dtype::kF32 && dtype != Dtype::kBF16 && dtype != Dtype::kF16)
    throw std::invalid_argument(plugin + ": compute dtype " + dtype_name(dtype) +
                                " is not one of f32, bf16, f16");
  if (precision_.compute != Dtype::kF32 && precision_.compute != dtype)
    throw std::logic_error(plugin + ": the compute dtype is already " +
                           dtype_name(precision_.compute) + " (set by " + compute_dtype_by_ +
                           "); two plugins cannot both choose it");
  precision_.compute = dtype;
  compute_dtype_by_ = plugin;
}

void RunChoices::set_precision(const std::string& plugin, const Precision& p) {
  if (frozen_)
    throw std::logic_error(plugin +
                           ": the model state's layout can only be chosen while the plugin is "
                           "created, before the model is built");
  Precision q = p;
  q.compute = precision_.compute;
  const std::string why = precision_problem(q);
  if (!why.empty()) throw std::invalid_argument(plugin + ": " + why);
  precision_ = q;
  precision_by_ = plugin;
}

void RunChoices::set_partition(const std::string& plugin, uint32_t what) {
  if (frozen_)
    throw std::logic_error(plugin +
                           ": what is sharded can only be chosen while the plugin is created");
  if (shard_what_ != 0)
    throw std::logic_error(plugin + ": the model state is sharded already, by " + shard_plugin_ +
                           "; two plugins cannot both shard it");
  if (!is_zero_stage(what))
    throw std::invalid_argument(plugin + ": sharding " + std::to_string(what) +
                                " is no ZeRO stage");
  shard_what_ = what;
  shard_plugin_ = plugin;
}

void RunChoices::add_lora(const std::string& plugin, const LoraSpec& spec) {
  if (frozen_)
    throw std::logic_error(plugin +
                           ": adapters can only be added while the plugin is created, before the "
                           "model is built");
  check_lora(model_, spec);
  if (!lora_by_.empty() && lora_by_ != plugin)
    throw std::logic_error(plugin + ": the adapters are " + lora_by_ +
                           "'s; two plugins cannot both add them");
  lora_.push_back(spec);
  lora_by_ = plugin;
}

void RunChoices::set_base(const std::string& plugin, QuantKind kind, bool double_quant) {
  if (frozen_)
    throw std::logic_error(plugin +
                           ": the base's storage is chosen while the plugin is created, before "
                           "the model is built");
  if (lora_by_ != plugin)
    throw std::logic_error(plugin +
                           ": the base's storage is chosen by the plugin that adds the adapters, "
                           "after it added them (a run without adapters trains its weights)");
  if (base_set_) throw std::logic_error(plugin + ": the base's storage is chosen once");
  base_ = kind;
  double_quant_ = double_quant;
  base_set_ = true;
}

void RunChoices::set_persist_below(const std::string& plugin, uint64_t elements) {
  if (frozen_ || plugin != shard_plugin_ || !(shard_what_ & kShardParameters))
    throw std::logic_error(plugin +
                           ": the persistence threshold is set while the plugin is created, "
                           "after it partitioned the parameters");
  shard_persist_below_ = elements;
}

void RunChoices::set_loss_scale(const std::string& plugin, double scale) {
  if (!(scale > 0) || !std::isfinite(scale))
    throw std::invalid_argument(plugin + ": loss scale " + std::to_string(scale) +
                                " must be finite and > 0");
  loss_scale_ = scale;
}

}  // namespace headroom
