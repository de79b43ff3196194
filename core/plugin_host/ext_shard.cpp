// headroom.shard/1 (headroom/ext/shard.h): ZeRO's mechanism (core/shard/) for a plugin's policy:
// what is partitioned, each layer's layout, reducing, gathering and releasing.
#include <cstddef>
#include <exception>

#include "core/plugin_host/services.h"
#include "headroom/ext/shard.h"

namespace headroom {
namespace services {

constexpr Rule kShardPartition = {HR_EXT_SHARD " partition", kAnyone, When::kCreate, kNotAllowed};
static hr_status shard_partition(hr_host* h, uint32_t what) {
  LoadedPlugin& p = plugin(h);
  try {
    if (!is_zero_stage(what))
      throw std::invalid_argument("what = " + std::to_string(what) +
                                  " is no ZeRO stage (valid: HR_SHARD_OPTIMIZER; with "
                                  "HR_SHARD_GRADIENTS; with both and HR_SHARD_PARAMETERS)");
    if (!(p.desc.roles & HR_ROLE_GRADIENT_REDUCTION))
      throw std::invalid_argument("plugin '" + p.entry.name +
                                  "' must take the gradient-reduction role to shard");
    if (HostServices::host(h).provides_optimizer())
      throw std::invalid_argument(
          "an optimizer-role plugin keeps its own state, which cannot be partitioned; use the "
          "built-in train.optimizer with a zero plugin");
    run(h).shard->set_partition(p.entry.name, what);
    return HR_OK;
  } catch (const std::exception& e) {
    p.error = std::string(HR_EXT_SHARD " partition: ") + e.what();
    return HR_ERROR_INVALID;
  }
}

constexpr Rule kShardLayout = {HR_EXT_SHARD " layout", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status shard_layout(hr_host* h, int32_t layer, hr_shard_layout* out) {
  LoadedPlugin& p = plugin(h);
  Gpt<float>* m = run(h).model->built_model();
  if (!out || !m || layer < 0 || layer >= int32_t(m->layers().size())) {
    p.error = std::string(HR_EXT_SHARD " layout: ") +
              (!out ? "out must not be NULL"
               : !m ? "the model is not built yet"
                    : "layer " + std::to_string(layer) + " does not exist");
    return HR_ERROR_INVALID;
  }
  const FlatStorage& f = m->layers()[size_t(layer)]->flat();
  Sharding* sh = run(h).shard->sharding();
  hr_shard_layout l;
  std::memset(&l, 0, sizeof l);
  l.struct_size = sizeof l;
  l.what = sh ? sh->what() : 0;
  l.rank = comm(h).rank();
  l.world_size = comm(h).world_size();
  l.numel = f.numel;
  l.padded = f.padded;
  l.shard = sh ? sh->shard_numel(layer) : f.padded;
  l.begin = sh ? sh->shard_begin(layer) : 0;
  l.whole = sh ? (sh->whole(layer) ? 1 : 0) : 1;
  l.tied = m->tied_layer(layer);
  write_sized(out, l, offsetof(hr_shard_layout, struct_size) + sizeof(uint32_t));
  return HR_OK;
}

// The mechanism's calls: its errors as HR_ERROR with their message.
template <class F>
static hr_status sharded(hr_host* h, const char* fn, F&& f) {
  LoadedPlugin& p = plugin(h);
  Sharding* sh = run(h).shard->sharding();
  if (!sh) {
    p.error = std::string(HR_EXT_SHARD " ") + fn + ": nothing is sharded (partition first)";
    return HR_ERROR;
  }
  try {
    f(*sh);
    return HR_OK;
  } catch (const OutOfMemory& e) {
    p.run_failure = std::current_exception();
    p.error = std::string(HR_EXT_SHARD " ") + fn + ": " + e.what();
    return HR_ERROR_OUT_OF_MEMORY;
  } catch (const PeerFailed& e) {
    p.run_failure = std::current_exception();
    p.error = std::string(HR_EXT_SHARD " ") + fn + ": " + e.what();
    return HR_ERROR;
  } catch (const std::exception& e) {
    p.error = std::string(HR_EXT_SHARD " ") + fn + ": " + e.what();
    return HR_ERROR;
  }
}

constexpr Rule kShardReduceGradients = {HR_EXT_SHARD " reduce_gradients", kAnyone,
                                        When::kNotInAllocation, kNotAllowed};
static hr_status shard_reduce_gradients(hr_host* h, int32_t layer) {
  return sharded(h, "reduce_gradients", [&](Sharding& s) { s.reduce_gradients(layer); });
}

constexpr Rule kShardGatherParameters = {HR_EXT_SHARD " gather_parameters", kAnyone,
                                         When::kNotInAllocation, kNotAllowed};
static hr_status shard_gather_parameters(hr_host* h, int32_t layer) {
  return sharded(h, "gather_parameters", [&](Sharding& s) { s.gather_parameters(layer); });
}

constexpr Rule kShardPersistBelow = {HR_EXT_SHARD " persist_below", kAnyone, When::kCreate,
                                     kNotAllowed};
static hr_status shard_persist_below(hr_host* h, uint64_t elements) {
  LoadedPlugin& p = plugin(h);
  try {
    run(h).shard->set_persist_below(p.entry.name, elements);
    return HR_OK;
  } catch (const std::exception& e) {
    p.error = std::string(HR_EXT_SHARD " persist_below: ") + e.what();
    return HR_ERROR_INVALID;
  }
}

constexpr Rule kShardReleaseParameters = {HR_EXT_SHARD " release_parameters", kAnyone,
                                          When::kNotInAllocation, kNotAllowed};
static hr_status shard_release_parameters(hr_host* h, int32_t layer) {
  Sharding* sh = run(h).shard->sharding();
  if (sh && (layer < 0 || layer >= int32_t(run(h).model->built_model()->layers().size()) ||
             sh->whole(layer))) {
    plugin(h).error = std::string(HR_EXT_SHARD " release_parameters: layer ") +
                      std::to_string(layer) +
                      (layer < 0 || layer >= int32_t(run(h).model->built_model()->layers().size())
                           ? " does not exist"
                           : " keeps its parameters whole (nothing sharded to release)");
    return HR_ERROR_INVALID;
  }
  return sharded(h, "release_parameters", [&](Sharding& s) { s.release_parameters(layer); });
}

constexpr Rule kShardWait = {HR_EXT_SHARD " wait", kAnyone, When::kNotInAllocation, kNotAllowed};
static hr_status shard_wait(hr_host* h) {
  return sharded(h, "wait", [&](Sharding& s) { s.wait(); });
}

constexpr Rule kShardGradientRange = {HR_EXT_SHARD " gradient_range", kAnyone, When::kAnyTime,
                                      kNotAllowed};
static hr_status shard_gradient_range(hr_host* h, int32_t layer, hr_tensor* out) {
  LoadedPlugin& p = plugin(h);
  Sharding* sh = run(h).shard->sharding();
  if (!out || !sh || layer < 0 || layer >= int32_t(run(h).model->built_model()->layers().size())) {
    p.error = std::string(HR_EXT_SHARD " gradient_range: ") +
              (!out  ? "out must not be NULL"
               : !sh ? "nothing is sharded"
                     : "layer " + std::to_string(layer) + " does not exist");
    return HR_ERROR_INVALID;
  }
  const uint64_t n = sh->shard_numel(layer);
  // Named as its layer (a name that outlives the call).
  hr_tensor t = f32_view(run(h).model->built_model()->layers()[size_t(layer)]->name(), {int64_t(n)},
                         n, sh->gradient_range(layer));
  t.data = t.grad = sh->gradient_range(layer);
  write_sized(out, t);
  return HR_OK;
}

extern const hr_ext_shard kShardExtension;
const hr_ext_shard kShardExtension = {sizeof(hr_ext_shard),
                                      0,
                                      checked<kShardPartition, shard_partition>,
                                      checked<kShardLayout, shard_layout>,
                                      checked<kShardReduceGradients, shard_reduce_gradients>,
                                      checked<kShardGatherParameters, shard_gather_parameters>,
                                      checked<kShardWait, shard_wait>,
                                      checked<kShardGradientRange, shard_gradient_range>,
                                      checked<kShardPersistBelow, shard_persist_below>,
                                      checked<kShardReleaseParameters, shard_release_parameters>};

}  // namespace services
}  // namespace headroom
