// offload: ZeRO-Offload's policy (Ren et al. 2021) over the host's places (headroom.offload/1):
// which of the model state lives in host memory instead of the device's.
//
//   [[plugins]]
//   name = "offload"
//   optimizer = "host"     # "host": the built-in optimizer's state ([train] optimizer: AdamW's
//                          # moments, SGD's momentum) and an f32 copy of the weights it updates
//                          # live in the host ledger ([host] memory_limit); the gradients are
//                          # copied there, the update runs there on the CPU backend's kernels
//                          # (multithreaded, vectorised: the same ones as the CPU device's), and
//                          # the new weights go back to the device on the copy stream. "none":
//                          # everything stays on the device (the plugin changes nothing)
//   parameters = "none"    # only "none" so far ("host" and "nvme" are later steps)
//   activations = false    # only false so far
//
// The NVMe tier (optimizer = "nvme") is not built yet: refused with the key's place. The policy
// is the choice at create(); the host makes the optimizer, moves the bytes and keeps the ledgers.
//
// Training thread only; no locking. Only hr_plugin_entry is exported; no C++ exception crosses
// the C ABI.
#include <headroom/ext/estimate.h>
#include <headroom/ext/offload.h>
#include <headroom/plugin.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "common/hook_guard.h"
#include "common/offer_estimate.h"

namespace {

struct Offload {
  bool optimizer_on_host = true;
};

// A string key (unset: `*value` stays, its default).
hr_status read_string(const hr_host_services* s, const char* key, std::string* value) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s", value->c_str());
  const hr_status st = s->config_string(s->host, key, buf, sizeof buf);
  if (st != HR_OK) return st;
  *value = buf;
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
  std::string optimizer = "host", parameters = "none";
  hr_status st = read_string(s, "optimizer", &optimizer);
  if (st != HR_OK) return st;
  if (optimizer == "nvme")
    return s->config_error(s->host, "optimizer",
                           "\"nvme\" (the NVMe tier) is not built yet; valid: \"none\", \"host\"");
  if (optimizer != "none" && optimizer != "host")
    return s->config_error(
        s->host, "optimizer",
        ("\"" + optimizer + "\" is not a place; valid: \"none\", \"host\"").c_str());
  st = read_string(s, "parameters", &parameters);
  if (st != HR_OK) return st;
  if (parameters != "none")
    return s->config_error(
        s->host, "parameters",
        ("\"" + parameters +
         "\": offloading the parameters is not built yet (\"host\" and \"nvme\" are later steps); "
         "valid: \"none\"")
            .c_str());
  int32_t activations = 0;
  st = s->config_bool(s->host, "activations", &activations);
  if (st != HR_OK) return st;
  if (activations)
    return s->config_error(s->host, "activations",
                           "true: offloading checkpointed activations is not built yet; valid: "
                           "false");
  if (optimizer == "host") {
    st = offload->set_optimizer_place(s->host, HR_PLACE_HOST);
    if (st != HR_OK) return st;  // the host's message stands
  }
  Offload* o = new Offload;
  o->optimizer_on_host = optimizer == "host";
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
  if (o->optimizer_on_host && builtin) r->after->optimizer_place = HR_PLACE_HOST;
  const hr_status st = q->peak(q->context, r->after, r->bytes);
  if (st != HR_OK) return st;
  // No measurement of the step time with the update on the host yet: counted as unchanged.
  r->step_time_factor = 1;
  std::snprintf(r->what, sizeof r->what, "%s",
                !o->optimizer_on_host ? "nothing offloaded (optimizer = \"none\")"
                : builtin ? "optimizer state and f32 weights in host memory, update on the host"
                          : "nothing offloaded (an optimizer-role plugin keeps its own state)");
  std::snprintf(r->toml, sizeof r->toml, "optimizer = \"%s\"\n",
                o->optimizer_on_host ? "host" : "none");
  return HR_OK;
}

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
    headroom_plugin::offer_estimate<estimate>,
};

}  // namespace

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
