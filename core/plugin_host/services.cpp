// What the host's service files share (services.h): the check of a call against its rule, and the
// helpers several tables use.
#include "core/plugin_host/services.h"

namespace headroom {
namespace services {

namespace {

std::string roles_words(uint32_t roles) {
  return describe_roles(roles) + " role";
}

// "only from FORWARD_END of that layer", for the messages.
std::string rule_words(const Rule& r) {
  std::string s;
  if (r.roles) s = "the " + roles_words(r.roles) + " only";
  std::string when;
  switch (r.when) {
    case When::kAnyTime:
      break;
    case When::kCreate:
      when = "from create() only";
      break;
    case When::kForwardEndOfLayer:
      when = "from FORWARD_END of the layer it names only";
      break;
    case When::kNotInAllocation:
      when = "not from ALLOC, FREE or OOM hooks or the allocator role's hooks";
      break;
    case When::kOom:
      when = "from the OOM hook only";
      break;
    case When::kStepBoundary:
      when = "from TRAIN_BEGIN, STEP_BEGIN or STEP_END only";
      break;
    case When::kBetweenSteps:
      when = "from STEP_END or TRAIN_BEGIN only";
      break;
  }
  if (!when.empty()) s += (s.empty() ? "" : ", ") + when;
  return s.empty() ? "any plugin, any time" : s;
}

}  // namespace

bool in_allocation(hr_host* h) {
  const LoadedPlugin& p = *h->plugin;
  const int ev = HostServices::current_event(h);
  return p.in_allocator_hook > 0 ||
         (!p.creating &&
          (ev == int(Event::kAlloc) || ev == int(Event::kFree) || ev == int(Event::kOom)));
}

bool allowed(hr_host* h, const Rule& rule, int32_t layer) {
  LoadedPlugin& p = *h->plugin;
  const int ev = HostServices::current_event(h), ev_layer = HostServices::current_layer(h);
  std::string why;
  if ((p.desc.roles & rule.roles) != rule.roles) {
    why = "plugin '" + p.entry.name + "' does not provide the " + roles_words(rule.roles) +
          " (its descriptor's roles: " + describe_roles(p.desc.roles) + ")";
  } else {
    const std::string from =
        p.creating ? std::string("create()")
        : ev >= 0  ? std::string(event_name(Event(ev))) +
                        (ev_layer >= 0 ? " of layer " + std::to_string(ev_layer) : std::string())
                  : std::string("outside any event");
    switch (rule.when) {
      case When::kAnyTime:
        break;
      case When::kCreate:
        if (!p.creating) why = "plugin '" + p.entry.name + "' called it from " + from;
        break;
      case When::kForwardEndOfLayer:
        if (p.creating || ev != int(Event::kForwardEnd) || ev_layer != layer)
          why = "plugin '" + p.entry.name + "' called it for layer " + std::to_string(layer) +
                " from " + from;
        break;
      case When::kNotInAllocation:
        if (p.in_allocator_hook > 0)
          why = "plugin '" + p.entry.name + "' called it from its allocator hooks";
        else if (in_allocation(h))
          why = "plugin '" + p.entry.name + "' called it from " + from;
        break;
      case When::kOom:
        if (p.creating || ev != int(Event::kOom))
          why = "plugin '" + p.entry.name + "' called it from " + from;
        break;
      case When::kStepBoundary:
        if (p.creating || (ev != int(Event::kTrainBegin) && ev != int(Event::kStepBegin) &&
                           ev != int(Event::kStepEnd)))
          why = "plugin '" + p.entry.name + "' called it from " + from;
        break;
      case When::kBetweenSteps:
        if (p.creating || (ev != int(Event::kStepEnd) && ev != int(Event::kTrainBegin)))
          why = "plugin '" + p.entry.name + "' called it from " + from;
        break;
    }
  }
  if (why.empty()) return true;
  p.error = std::string(rule.function) + ": not allowed: " + rule_words(rule) + "; " + why;
  return false;
}

Communicator& comm(hr_host* h) {
  if (Communicator* c = run(h).comm->plugin_communicator()) return *c;
  std::unique_ptr<Communicator>& self = HostServices::self_comm(h);
  if (!self) self = make_local_communicator(*run(h).device);
  return *self;
}

Layer<float>* layer(hr_host* h, int32_t index) {
  Gpt<float>* m = run(h).model->built_model();
  if (!m || index < 0 || index >= int32_t(m->layers().size())) {
    plugin(h).error = "layer " + std::to_string(index) + " does not exist" +
                      (m ? " (the model has " + std::to_string(m->layers().size()) + ")"
                         : " (the model is not built yet)");
    return nullptr;
  }
  return m->layers()[index].get();
}

hr_tensor f32_view(const std::string& name, const std::vector<int64_t>& shape, uint64_t numel,
                   void* data) {
  hr_tensor t;
  std::memset(&t, 0, sizeof t);
  t.struct_size = sizeof t;
  t.dtype = HR_DTYPE_F32;
  t.name = name.c_str();
  t.ndim = int32_t(std::min<size_t>(shape.size(), HR_MAX_DIMS));
  for (int32_t d = 0; d < t.ndim; ++d)
    t.shape[d] = shape[d];
  t.numel = numel;
  t.data = data;
  return t;
}

}  // namespace services

std::string key_where(const LoadedPlugin& p, const std::string& key) {
  auto it = p.entry.key_pos.find(key);
  const std::string pos = it != p.entry.key_pos.end() ? it->second.str() : p.entry.pos.str();
  return pos + ": plugins." + p.entry.name + "." + key;
}

}  // namespace headroom
