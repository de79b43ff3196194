// For in-tree plugins written in C++: declaring what the hooks read, headroom.reads/1
// (headroom/ext/reads.h), and one descriptor get_extension that offers several extensions.
//
//   headroom_plugin::offer_all<headroom_plugin::offer_estimate<estimate>,
//                              headroom_plugin::offer_reads<HR_EVENT_BIT(HR_EVENT_GRADS_READY)>>
#pragma once

#include <cstdint>
#include <cstring>

#include "headroom/ext/reads.h"
#include "headroom/plugin.h"

namespace headroom_plugin {

template <uint64_t Gradients>
inline constexpr hr_ext_reads kReadsExtension = {sizeof(hr_ext_reads), 0, Gradients};

// get_extension offering headroom.reads/1 alone: `Gradients` are the HR_EVENT_BIT()s of the events
// whose hooks read or write the parameters' gradients (0: none).
template <uint64_t Gradients>
const void* offer_reads(const char* id) {
  return id && std::strcmp(id, HR_EXT_READS) == 0 ? &kReadsExtension<Gradients> : nullptr;
}

using OfferFn = const void* (*)(const char* id);

// get_extension from several: the table the first of `Offers` that has one for `id` returns.
template <OfferFn... Offers>
const void* offer_all(const char* id) {
  const void* table = nullptr;
  ((table = table ? table : Offers(id)), ...);
  return table;
}

}  // namespace headroom_plugin
