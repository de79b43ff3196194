// offload: ZeRO-Offload's policy (Ren et al. 2021) over the host's places (headroom.offload/1):
// which of the model state lives in host memory, or on an NVMe disk, instead of the device's.
//
//   [[plugins]]
//   name = "offload"
//   optimizer = "host"     # "host": the built-in optimizer's state ([train] optimizer: AdamW's
//                          # moments, SGD's momentum) and an f32 copy of the weights it updates
//                          # (with amp: its f32 masters, which leave the device)
//                          # live in the host ledger ([host] memory_limit); the gradients are
//                          # copied there, the update runs there on the CPU backend's kernels
//                          # (multithreaded, vectorised: the same ones as the CPU device's), and
//                          # the new weights go back to the device on the copy stream. "nvme":
//                          # the same, with the optimizer's state in a file under nvme_path
//                          # (ZeRO-Infinity's NVMe tier), streamed through two host buffers at
//                          # each update with io_uring, 1 Mi elements at a time. "none": everything
//                          stays on the device # (the plugin changes nothing)
//   nvme_path = "/mnt/nvme"  # either "nvme", required: an existing writable folder (relative: to
//                          # the working folder). Not `path`: a plugin table's `path` is where
//                          # its library is
//   direct_io = "auto"     # "nvme" only: "auto" O_DIRECT where the file system allows it (else
//                          # buffered, one log line says so), true (a file system that refuses
//                          # it — ramfs, tmpfs before Linux 6.6 — is an error), false
//   pin_memory = true      # the host place is page-locked on CUDA (copies by DMA); false: plain
//                          # pageable memory (CUDA stages each copy; nothing page-locked taken).
//                          # The CPU backend's host place is plain memory either way
//   parameters = "none"    # "host": ZeRO-Infinity's offload_param, with zero3 listed too (it
//                          # chooses which layers are sharded and when they are gathered): each
//                          # sharded layer's parameter and gradient shards rest in host memory,
//                          # the device holding a layer only from its gathering (prefetch_layers
//                          # ahead) to its release, on one rank as on many. Needs optimizer =
//                          # "host" or "nvme". "nvme": the same, with the shards the layers read
//                          # (amp's bf16/fp16 copy, frozen and quantized weights) in a file under
//                          # nvme_path, read at each gathering and written after each update; the
//                          # fp32 master and gradient shards stay in host memory
//   activations = false    # true: each layer's output (the block outputs checkpointing keeps)
//                          # waits in host memory between the next layer's forward and backward,
//                          # back on the device one layer ahead of its use
//
// The policy is the choice at create(); the host makes the optimizer, moves the bytes, keeps the
// ledgers and the file (core/run/state_file.h). The folder is checked here, so that a bad one
// names its key.
//
// Training thread only; no locking. Only hr_plugin_entry is exported; no C++ exception crosses
// the C ABI.
#include <headroom/ext/estimate.h>
#include <headroom/ext/offload.h>
#include <headroom/plugin.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "common/hook_guard.h"
#include "common/offer_estimate.h"

namespace {

struct Offload {
  bool optimizer_on_host = true;
  bool nvme = false;
  bool activations = false;      // the layers' outputs on the host between forward and backward
  bool parameters = false;       // the sharded layers' shards on the host
  bool parameters_nvme = false;  // ... their compute, frozen and quantized shards in a file
  bool pin_memory = true;
  std::string nvme_path;  // "nvme": the folder, for the estimate's TOML
};

// A string key (unset: `*value` stays, its default).
hr_status read_string(const hr_host_services* s, const char* key, std::string* value) {
  char buf[4096];
  std::snprintf(buf, sizeof buf, "%s", value->c_str());
  const hr_status st = s->config_string(s->host, key, buf, sizeof buf);
  if (st != HR_OK) return st;
  *value = buf;
  return HR_OK;
}

// The file systems that refuse O_DIRECT by name (linux/magic.h); others by their magic number.
std::string file_system_name(const std::string& dir) {
  struct statfs fs;
  if (statfs(dir.c_str(), &fs) != 0) return "an unknown file system";
  switch ((unsigned long)fs.f_type) {
    case 0x01021994:
      return "tmpfs";
    case 0x858458f6:
      return "ramfs";
    case 0x794c7630:
      return "overlayfs";
    default: {
      char hex[48];
      std::snprintf(hex, sizeof hex, "a file system of magic 0x%lx", (unsigned long)fs.f_type);
      return hex;
    }
  }
}

// What is wrong with `dir` as the NVMe tier's folder under `direct_io`, or "" (core checks it
// again when it makes the file; here, so that the message names the key). *refuses_direct: the
// folder is fine but its file system refuses O_DIRECT.
std::string check_folder(const std::string& dir, uint32_t direct_io, bool* refuses_direct) {
  *refuses_direct = false;
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) return "\"" + dir + "\": " + std::strerror(errno);
  if (!S_ISDIR(st.st_mode)) return "\"" + dir + "\" is not a folder";
  std::string probe = dir + "/.headroom-probe-XXXXXX";
  const int fd = mkstemp(&probe[0]);
  if (fd < 0) return "\"" + dir + "\" is not writable: " + std::strerror(errno);
  close(fd);
  std::string problem;
  if (direct_io == HR_DIRECT_IO_ON) {
    const int d = open(probe.c_str(), O_RDWR | O_DIRECT);
    if (d >= 0) {
      close(d);
    } else {
      const int err = errno;
      problem = "true, but \"" + dir + "\" is on " + file_system_name(dir) +
                ", which refuses O_DIRECT (" + std::strerror(err) +
                "); valid there: \"auto\" (buffered I/O) or false";
      *refuses_direct = true;
    }
  }
  unlink(probe.c_str());
  return problem;
}

// direct_io: "auto", true or false.
hr_status read_direct_io(const hr_host_services* s, uint32_t* out) {
  // Either type: config_bool takes a boolean or no key; then config_string refuses a boolean
  // (the key is there) and takes no key (the default, "auto").
  int32_t on = 0;
  if (s->config_bool(s->host, "direct_io", &on) == HR_OK) {
    std::string unset = "auto";
    if (read_string(s, "direct_io", &unset) != HR_OK)
      *out = on ? HR_DIRECT_IO_ON : HR_DIRECT_IO_OFF;
    return HR_OK;
  }
  std::string mode = "auto";
  if (read_string(s, "direct_io", &mode) != HR_OK || mode != "auto")
    return s->config_error(s->host, "direct_io",
                           "valid: \"auto\" (O_DIRECT where the file system allows it), true, "
                           "false");
  *out = HR_DIRECT_IO_AUTO;
  return HR_OK;
}

hr_status create(const hr_host_services* s, void** instance) {
  const hr_ext_offload* offload = nullptr;
  if (HR_HAS_FIELD(s, hr_host_services, get_extension))
    offload = static_cast<const hr_ext_offload*>(s->get_extension(s->host, HR_EXT_OFFLOAD));
  if (!offload) {
    s->set_error(s->host, "needs a host with headroom.offload/1 (ABI 1.8)");
    return HR_ERROR_VERSION;
  }
  std::string optimizer = "host", parameters = "none", nvme_path;
  hr_status st = read_string(s, "optimizer", &optimizer);
  if (st != HR_OK) return st;
  if (optimizer != "none" && optimizer != "host" && optimizer != "nvme")
    return s->config_error(
        s->host, "optimizer",
        ("\"" + optimizer + "\" is not a place; valid: \"none\", \"host\", \"nvme\"").c_str());
  if (optimizer == "nvme" && !HR_HAS_FIELD(offload, hr_ext_offload, set_optimizer_files))
    return s->config_error(s->host, "optimizer",
                           "\"nvme\" needs a host whose headroom.offload/1 has "
                           "set_optimizer_files; valid here: \"none\", \"host\"");
  st = read_string(s, "parameters", &parameters);
  if (st != HR_OK) return st;
  if (parameters != "none" && parameters != "host" && parameters != "nvme")
    return s->config_error(
        s->host, "parameters",
        ("\"" + parameters + "\" is not a place; valid: \"none\", \"host\", \"nvme\"").c_str());
  if (parameters != "none" && optimizer == "none")
    return s->config_error(s->host, "parameters",
                           ("\"" + parameters +
                            "\" needs the optimizer off the device too (it updates the parameter "
                            "shards in host memory): optimizer = \"host\" or \"nvme\"")
                               .c_str());
  if (parameters == "host" && !HR_HAS_FIELD(offload, hr_ext_offload, set_parameter_place))
    return s->config_error(s->host, "parameters",
                           "\"host\" needs a host whose headroom.offload/1 has "
                           "set_parameter_place; valid here: \"none\"");
  if (parameters == "nvme" && !HR_HAS_FIELD(offload, hr_ext_offload, set_parameter_files))
    return s->config_error(s->host, "parameters",
                           "\"nvme\" needs a host whose headroom.offload/1 has "
                           "set_parameter_files; valid here: \"none\", \"host\"");
  st = read_string(s, "nvme_path", &nvme_path);
  if (st != HR_OK) return st;
  uint32_t direct_io = HR_DIRECT_IO_AUTO;
  st = read_direct_io(s, &direct_io);
  if (st != HR_OK) return st;
  const bool on_disk = optimizer == "nvme" || parameters == "nvme";
  if (on_disk) {
    if (nvme_path.empty())
      return s->config_error(s->host, optimizer == "nvme" ? "optimizer" : "parameters",
                             "\"nvme\" needs nvme_path: the folder for the state file (an "
                             "existing, writable folder on the NVMe disk)");
    bool refuses_direct = false;
    const std::string problem = check_folder(nvme_path, direct_io, &refuses_direct);
    if (!problem.empty())
      return s->config_error(
          s->host, refuses_direct ? "direct_io" : "nvme_path",
          (problem + (refuses_direct ? "" : "; valid: an existing, writable folder")).c_str());
  } else if (!nvme_path.empty()) {
    return s->config_error(s->host, "nvme_path",
                           ("is for optimizer = \"nvme\" or parameters = \"nvme\"; this table "
                            "has optimizer = \"" +
                            optimizer + "\", parameters = \"" + parameters + "\"")
                               .c_str());
  }
  int32_t pin_memory = 1;
  st = s->config_bool(s->host, "pin_memory", &pin_memory);
  if (st != HR_OK) return st;
  if (!pin_memory && !HR_HAS_FIELD(offload, hr_ext_offload, set_host_page_locked))
    return s->config_error(s->host, "pin_memory",
                           "false needs a host whose headroom.offload/1 has "
                           "set_host_page_locked; valid here: true");
  int32_t activations = 0;
  st = s->config_bool(s->host, "activations", &activations);
  if (st != HR_OK) return st;
  if (activations && !HR_HAS_FIELD(offload, hr_ext_offload, set_activation_place))
    return s->config_error(s->host, "activations",
                           "true needs a host whose headroom.offload/1 has set_activation_place; "
                           "valid here: false");
  if (activations) {
    st = offload->set_activation_place(s->host, HR_PLACE_HOST);
    if (st != HR_OK) return st;
  }
  if (!pin_memory) {
    st = offload->set_host_page_locked(s->host, 0);
    if (st != HR_OK) return st;
  }
  if (parameters == "host") {
    st = offload->set_parameter_place(s->host, HR_PLACE_HOST);
    if (st != HR_OK) return st;
  } else if (parameters == "nvme") {
    st = offload->set_parameter_files(s->host, nvme_path.c_str(), direct_io);
    if (st != HR_OK) return st;
  }
  if (optimizer == "host") {
    st = offload->set_optimizer_place(s->host, HR_PLACE_HOST);
    if (st != HR_OK) return st;  // the host's message stands
  } else if (optimizer == "nvme") {
    st = offload->set_optimizer_files(s->host, nvme_path.c_str(), direct_io);
    if (st != HR_OK) return st;
  }
  Offload* o = new Offload;
  o->optimizer_on_host = optimizer != "none";
  o->nvme = optimizer == "nvme";
  o->nvme_path = nvme_path;
  o->activations = activations != 0;
  o->parameters = parameters != "none";
  o->parameters_nvme = parameters == "nvme";
  o->pin_memory = pin_memory != 0;
  *instance = o;
  return HR_OK;
}

// headroom.estimate/1: the optimizer's place; core's closed form knows what that puts where (the
// host ledger's bytes it computes itself). No proposal when not configured.
hr_status estimate(void* instance, const hr_estimate_query* q, hr_estimate_result* r) {
  const Offload* o = static_cast<const Offload*>(instance);
  if (!o) return HR_ERROR_UNSUPPORTED;
  if (!HR_HAS_FIELD(r->after, hr_mechanisms, optimizer_place)) return HR_ERROR_UNSUPPORTED;
  const bool builtin = r->after->optimizer_bytes == HR_OPTIMIZER_BYTES_BUILTIN;
  if (o->optimizer_on_host && builtin)
    r->after->optimizer_place = o->nvme ? HR_PLACE_NVME : HR_PLACE_HOST;
  if (o->activations) r->after->activation_place = HR_PLACE_HOST;
  if (o->parameters) r->after->parameter_place = o->parameters_nvme ? HR_PLACE_NVME : HR_PLACE_HOST;
  const hr_status st = q->peak(q->context, r->after, r->bytes);
  if (st != HR_OK) return st;
  // No measurement of the step time with the update on the host yet: counted as unchanged.
  r->step_time_factor = 1;
  const char* optimizer =
      !o->optimizer_on_host ? (o->activations ? "" : "nothing offloaded (optimizer = \"none\")")
      : builtin && o->nvme
          ? "optimizer state in a file on the NVMe disk, f32 weights in host memory, update on "
            "the host"
      : builtin ? "optimizer state and f32 weights in host memory, update on the host"
                : "the optimizer's state stays (an optimizer-role plugin keeps its own)";
  std::string what = optimizer;
  if (o->parameters)
    what += o->parameters_nvme ? "; parameter shards in a file on the NVMe disk, master and "
                                 "gradient shards in host memory"
                               : "; parameter and gradient shards in host memory";
  if (o->activations)
    what += std::string(what.empty() ? "" : "; ") +
            "layer outputs in host memory between forward and backward";
  std::snprintf(r->what, sizeof r->what, "%s", what.c_str());
  std::string toml = std::string("optimizer = \"") +
                     (o->nvme                ? "nvme"
                      : o->optimizer_on_host ? "host"
                                             : "none") +
                     "\"\n";
  if (o->parameters)
    toml += std::string("parameters = \"") + (o->parameters_nvme ? "nvme" : "host") + "\"\n";
  if (o->nvme || o->parameters_nvme) toml += "nvme_path = \"" + o->nvme_path + "\"\n";
  if (o->activations) toml += "activations = true\n";
  if (!o->pin_memory) toml += "pin_memory = false\n";
  std::snprintf(r->toml, sizeof r->toml, "%s", toml.c_str());
  return HR_OK;
}

// What `plan --measure --search` tries (hr_ext_estimate.modes). Not "nvme": its table needs
// nvme_path, a folder on the disk the state would live on, which no search can pick. The
// parameters need zero3 too: alone the mode is refused, and the search pairs it with zero3's.
constexpr hr_estimate_mode kModes[] = {
    headroom_plugin::mode("optimizer host", "optimizer = \"host\""),
    headroom_plugin::mode("optimizer and parameters host",
                          "optimizer = \"host\"\nparameters = \"host\""),
};

hr_status create_hook(const hr_host_services* s, void** instance) {
  return headroom_plugin::guarded(s, "starting", [&] { return create(s, instance); });
}

void destroy(void* instance) {
  delete static_cast<Offload*>(instance);
}

hr_status on_event(void*, const hr_event_info*) {
  return HR_OK;
}

// Constant-initialized: loading the library runs no code before hr_plugin_entry.
const hr_plugin_descriptor kDescriptor = {
    sizeof(hr_plugin_descriptor),
    HR_ABI_VERSION,
    "offload",
    "1.0.0",
    "ZeRO-Offload: the optimizer's state and f32 weights in host memory, its update on the host",
    0,  // no events: the host moves the bytes
    0,  // no role: the built-in optimizer runs, on the host place
    0,  // reserved0
    create_hook,
    destroy,
    on_event,
    nullptr,  // allocator
    nullptr,  // optimizer
    nullptr,  // save_state: nothing of its own (the host snapshots the optimizer's state)
    nullptr,  // load_state
    headroom_plugin::offer_estimate_modes<estimate, kModes>,
};

}  // namespace

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
