// headroom.offload/1 (headroom/ext/offload.h): where the built-in optimizer keeps its state, and
// the host ledger's statistics.
#include "core/plugin_host/services.h"
#include "headroom/ext/offload.h"

namespace headroom {
namespace services {

constexpr Rule kSetOptimizerPlace = {HR_EXT_OFFLOAD " set_optimizer_place", kAnyone, When::kCreate,
                                     kNotAllowed};
// A place setter's call: `place` the device or the host, then `choose` (a PlaceChoice setter,
// whose refusals become the plugin's error, prefixed with `fn`).
static hr_status choose_place(hr_host* h, const char* fn, uint32_t place,
                              void (PlaceChoice::*choose)(const std::string&, bool)) {
  LoadedPlugin& p = plugin(h);
  if (place != HR_PLACE_DEVICE && place != HR_PLACE_HOST) {
    p.error = std::string(fn) + ": place " + std::to_string(place) +
              " is none of HR_PLACE_DEVICE (0) and HR_PLACE_HOST (1)";
    return HR_ERROR_INVALID;
  }
  try {
    (run(h).place->*choose)(p.entry.name, place == HR_PLACE_HOST);
    return HR_OK;
  } catch (const std::exception& e) {
    p.error = std::string(fn) + ": " + e.what();
    return HR_ERROR_INVALID;
  }
}

static hr_status set_optimizer_place(hr_host* h, uint32_t place) {
  return choose_place(h, "set_optimizer_place", place, &PlaceChoice::set_optimizer_place);
}

constexpr Rule kOptimizerPlace = {HR_EXT_OFFLOAD " optimizer_place", kAnyone, When::kAnyTime,
                                  kNotAllowed};
static uint32_t optimizer_place(hr_host* h) {
  const PlaceChoice& place = *run(h).place;
  if (!place.optimizer_dir().empty()) return HR_PLACE_NVME;
  return place.optimizer_on_host() ? HR_PLACE_HOST : HR_PLACE_DEVICE;
}

// The folder is checked when the optimizer is made (core/run/state_file.h: before step 1, a
// ConfigError naming the plugin); here only what the call itself says.
constexpr Rule kSetOptimizerFiles = {HR_EXT_OFFLOAD " set_optimizer_files", kAnyone, When::kCreate,
                                     kNotAllowed};
// A files setter's call: a folder and a direct_io value, then `choose` (a PlaceChoice setter).
static hr_status choose_files(hr_host* h, const char* fn, const char* dir, uint32_t direct_io,
                              void (PlaceChoice::*choose)(const std::string&, const std::string&,
                                                          uint32_t)) {
  LoadedPlugin& p = plugin(h);
  if (!dir || !*dir) {
    p.error = std::string(fn) + ": no folder given";
    return HR_ERROR_INVALID;
  }
  if (direct_io != HR_DIRECT_IO_AUTO && direct_io != HR_DIRECT_IO_ON &&
      direct_io != HR_DIRECT_IO_OFF) {
    p.error = std::string(fn) + ": direct_io " + std::to_string(direct_io) +
              " is none of HR_DIRECT_IO_AUTO (0), HR_DIRECT_IO_ON (1) and HR_DIRECT_IO_OFF (2)";
    return HR_ERROR_INVALID;
  }
  try {
    (run(h).place->*choose)(p.entry.name, dir, direct_io);
    return HR_OK;
  } catch (const std::exception& e) {
    p.error = std::string(fn) + ": " + e.what();
    return HR_ERROR_INVALID;
  }
}

static hr_status set_optimizer_files(hr_host* h, const char* dir, uint32_t direct_io) {
  return choose_files(h, "set_optimizer_files", dir, direct_io, &PlaceChoice::set_optimizer_files);
}

constexpr Rule kHostMemoryStats = {HR_EXT_OFFLOAD " host_memory_stats", kAnyone, When::kAnyTime,
                                   kNotAllowed};
static hr_status host_memory_stats(hr_host* h, hr_memory_stats* out) {
  const Device* host = run(h).device->host_place();
  if (!host) {
    plugin(h).error = "host_memory_stats: this run has no host place";
    return HR_ERROR_UNSUPPORTED;
  }
  return place_memory_stats(h, *host, out);
}

constexpr Rule kSetActivationPlace = {HR_EXT_OFFLOAD " set_activation_place", kAnyone,
                                      When::kCreate, kNotAllowed};
static hr_status set_activation_place(hr_host* h, uint32_t place) {
  return choose_place(h, "set_activation_place", place, &PlaceChoice::set_activation_place);
}

constexpr Rule kSetHostPageLocked = {HR_EXT_OFFLOAD " set_host_page_locked", kAnyone, When::kCreate,
                                     kNotAllowed};
static hr_status set_host_page_locked(hr_host* h, int32_t page_locked) {
  LoadedPlugin& p = plugin(h);
  try {
    run(h).place->set_host_page_locked(p.entry.name, page_locked != 0);
    return HR_OK;
  } catch (const std::exception& e) {
    p.error = std::string("set_host_page_locked: ") + e.what();
    return HR_ERROR_INVALID;
  }
}

constexpr Rule kSetParameterPlace = {HR_EXT_OFFLOAD " set_parameter_place", kAnyone, When::kCreate,
                                     kNotAllowed};
static hr_status set_parameter_place(hr_host* h, uint32_t place) {
  return choose_place(h, "set_parameter_place", place, &PlaceChoice::set_parameter_place);
}

// As the optimizer's files: the folder is checked when the Sharding is made (before step 1).
constexpr Rule kSetParameterFiles = {HR_EXT_OFFLOAD " set_parameter_files", kAnyone, When::kCreate,
                                     kNotAllowed};
static hr_status set_parameter_files(hr_host* h, const char* dir, uint32_t direct_io) {
  return choose_files(h, "set_parameter_files", dir, direct_io, &PlaceChoice::set_parameter_files);
}

extern const hr_ext_offload kOffloadExtension;
const hr_ext_offload kOffloadExtension = {sizeof(hr_ext_offload),
                                          0,
                                          checked<kSetOptimizerPlace, set_optimizer_place>,
                                          checked<kOptimizerPlace, optimizer_place>,
                                          checked<kHostMemoryStats, host_memory_stats>,
                                          checked<kSetOptimizerFiles, set_optimizer_files>,
                                          checked<kSetActivationPlace, set_activation_place>,
                                          checked<kSetHostPageLocked, set_host_page_locked>,
                                          checked<kSetParameterPlace, set_parameter_place>,
                                          checked<kSetParameterFiles, set_parameter_files>};

}  // namespace services
}  // namespace headroom
