#include "core/run/resizer.h"

#include <utility>

#include "core/run/host_optimizer.h"

namespace headroom {

void Resizer::attach(Gpt<float>& model, Optimizer& optimizer, std::vector<OptSegment>& segments,
                     std::string fixed) {
  model_ = &model;
  optimizer_ = &optimizer;
  segments_ = &segments;
  fixed_ = std::move(fixed);
}

void Resizer::resize_mlp(const std::string& plugin, int layer, const std::vector<uint32_t>& keep) {
  resize(plugin, [&] { return model_->resize_mlp(layer, keep); });
}

void Resizer::resize_heads(const std::string& plugin, int layer,
                           const std::vector<uint32_t>& keep) {
  resize(plugin, [&] { return model_->resize_heads(layer, keep); });
}

void Resizer::resize(const std::string& plugin,
                     const std::function<std::vector<ParamResize>()>& resize) {
  if (!model_) throw ResizeRefused(plugin + ": the model is not built yet");
  // The shards, the gradient buckets and the resharding of snapshots cut every layer at fixed
  // sizes: resizing runs on one rank without a zero plugin so far.
  if (!fixed_.empty())
    throw ResizeRefused("the model can be resized only on one rank without a zero plugin so far (" +
                        fixed_ + ")");
  if (!optimizer_->can_resize()) {
    const auto* host = dynamic_cast<const HostOptimizer*>(optimizer_);
    throw ResizeRefused(host && host->state_in_file()
                            ? "the optimizer's state is in a file (offload's optimizer = "
                              "\"nvme\"), laid out at fixed sizes: resizing with it is not built "
                              "yet"
                        : host && host->masters_on_host()
                            ? "the f32 masters are in host memory (offload with amp's masters): "
                              "resizing them there is not built yet"
                            : "the optimizer-role plugin cannot resize its state (its "
                              "hr_optimizer_hooks has no resize)");
  }
  const std::vector<ParamResize> changes = resize();
  *segments_ = whole_params(model_->trainable_params());
  optimizer_->resize(*segments_, changes);
  config_.model.mlp_hidden = model_->config().mlp_hidden;
  config_.model.attn_heads = model_->config().attn_heads;
}

}  // namespace headroom
