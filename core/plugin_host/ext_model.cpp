// headroom.model/1 (headroom/ext/model.h): the model's architecture and shape.
#include <cstddef>

#include "core/plugin_host/services.h"
#include "headroom/ext/model.h"

namespace headroom {
namespace services {

constexpr Rule kShape = {HR_EXT_MODEL " shape", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status shape(hr_host* h, hr_model_shape* out) {
  const Gpt<float>* m = run(h).model->built_model();
  if (!out || !m) {
    plugin(h).error =
        std::string(HR_EXT_MODEL " shape: ") +
        (!out ? "out must not be NULL" : "the model is not built yet (it is from TRAIN_BEGIN on)");
    return HR_ERROR_INVALID;
  }
  const ModelConfig& c = m->config();
  hr_model_shape s;
  std::memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  s.architecture = "gpt2";  // the one model core builds
  s.n_layer = c.n_layer;
  s.n_head = c.n_head;
  s.n_embd = c.n_embd;
  s.vocab_size = c.vocab_size;
  s.seq_len = c.seq_len;
  s.num_layers = int32_t(m->layers().size());
  write_sized(out, s, offsetof(hr_model_shape, struct_size) + sizeof(uint32_t));
  return HR_OK;
}

extern const hr_ext_model kModelExtension;
const hr_ext_model kModelExtension = {sizeof(hr_ext_model), 0, checked<kShape, shape>};

}  // namespace services
}  // namespace headroom
