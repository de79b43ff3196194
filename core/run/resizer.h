// headroom.resize/1 on the running model: a block keeps some of its MLP units or attention heads,
// with every slot of the parameters it shrinks and the optimizer's state (structured pruning).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/model/model.h"
#include "core/optim/optim.h"
#include "core/plugin_host/run_interfaces.h"

namespace headroom {

class Resizer final : public ModelResize {
 public:
  // `config`: the run's, whose model widths follow every resize (snapshots record them).
  explicit Resizer(Config& config) : config_(config) {}
  // The model is built. `fixed`: why this run cannot resize ("this run has 2 rank(s) and shards
  // with 'zero1'"), empty where it can. `segments`: what the optimizer updates, made anew.
  void attach(Gpt<float>& model, Optimizer& optimizer, std::vector<OptSegment>& segments,
              std::string fixed);

  // Keeps the hidden units `keep` of block `layer`'s MLP (Gpt::resize_mlp), or its attention
  // heads (Gpt::resize_heads). std::invalid_argument for a bad layer or list, ResizeRefused for a
  // run that cannot resize (nothing changed), OutOfMemory.
  void resize_mlp(const std::string& plugin, int layer, const std::vector<uint32_t>& keep) override;
  void resize_heads(const std::string& plugin, int layer,
                    const std::vector<uint32_t>& keep) override;

 private:
  // What both share: the checks, then `resize` (the model's), then the optimizer's segments and
  // state.
  void resize(const std::string& plugin, const std::function<std::vector<ParamResize>()>& resize);

  Config& config_;
  Gpt<float>* model_ = nullptr;
  Optimizer* optimizer_ = nullptr;
  std::vector<OptSegment>* segments_ = nullptr;
  std::string fixed_;
};

}  // namespace headroom
