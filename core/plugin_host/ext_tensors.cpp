// headroom.tensors/1 (headroom/ext/tensors.h): parameters by their Hugging Face names, small
// device-to-host reads, host-to-device writes, reductions.
#include <cmath>
#include <limits>
#include <vector>

#include "core/plugin_host/services.h"
#include "headroom/ext/tensors.h"

namespace headroom {
namespace services {

constexpr Rule kFindParam = {HR_EXT_TENSORS " find_param", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status find_param(hr_host* h, const char* name, hr_tensor* out, int32_t* layer_out,
                            int32_t* index_out) {
  LoadedPlugin& p = plugin(h);
  if (!name || !out) {
    p.error = "find_param: name and out must not be NULL";
    return HR_ERROR_INVALID;
  }
  Gpt<float>* m = run(h).model->built_model();
  if (!m) {
    p.error = std::string("find_param(\"") + name + "\"): the model is not built yet";
    return HR_ERROR_INVALID;
  }
  for (size_t l = 0; l < m->layers().size(); ++l) {
    const auto& params = m->layers()[l]->params();
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i]->name != name) continue;
      if (layer_out) *layer_out = int32_t(l);
      if (index_out) *index_out = int32_t(i);
      return layer_param(h, int32_t(l), int32_t(i), out);
    }
  }
  p.error = std::string("find_param: the model has no parameter \"") + name +
            "\" (Hugging Face GPT-2 names: \"wte.weight\", \"h.0.attn.c_attn.weight\", ...)";
  return HR_ERROR_INVALID;
}

constexpr Rule kRead = {HR_EXT_TENSORS " read", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status read(hr_host* h, void* dst, const void* src, uint64_t bytes) {
  LoadedPlugin& p = plugin(h);
  if (bytes > HR_READ_MAX_BYTES) {
    p.error = "read: " + std::to_string(bytes) + " bytes is more than HR_READ_MAX_BYTES (" +
              std::to_string(HR_READ_MAX_BYTES) + "): read() is for scalars and small buffers";
    return HR_ERROR_INVALID;
  }
  if (bytes == 0) return HR_OK;
  if (!dst || !src) {
    p.error = "read: dst and src must not be NULL";
    return HR_ERROR_INVALID;
  }
  return guarded(h, [&] { run(h).device->backend().download(dst, src, bytes); });
}

constexpr Rule kWrite = {HR_EXT_TENSORS " write", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status write(hr_host* h, void* dst, const void* src, uint64_t bytes) {
  if (bytes == 0) return HR_OK;
  if (!dst || !src) {
    plugin(h).error = "write: dst and src must not be NULL";
    return HR_ERROR_INVALID;
  }
  return guarded(h, [&] {
    Backend& ops = run(h).device->backend();
    ops.upload(dst, src, bytes);
    ops.synchronize();  // done when it returns: `src` is the plugin's to reuse
  });
}

// One element of `dtype` at `b`, widened to double.
static double element(uint32_t dtype, const unsigned char* b) {
  switch (dtype) {
    case HR_DTYPE_F32: {
      float f;
      std::memcpy(&f, b, 4);
      return f;
    }
    case HR_DTYPE_F64: {
      double d;
      std::memcpy(&d, b, 8);
      return d;
    }
    case HR_DTYPE_I32: {
      int32_t i;
      std::memcpy(&i, b, 4);
      return i;
    }
    case HR_DTYPE_BF16: {
      uint16_t u;
      std::memcpy(&u, b, 2);
      const uint32_t bits = uint32_t(u) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    default: {  // HR_DTYPE_F16
      uint16_t u;
      std::memcpy(&u, b, 2);
      const int exp = (u >> 10) & 0x1F, mant = u & 0x3FF;
      const double sign = (u & 0x8000) ? -1.0 : 1.0;
      if (exp == 0) return sign * std::ldexp(double(mant), -24);
      if (exp == 31)
        return mant ? std::numeric_limits<double>::quiet_NaN()
                    : sign * std::numeric_limits<double>::infinity();
      return sign * std::ldexp(double(mant | 0x400), exp - 25);
    }
  }
}

constexpr Rule kReduce = {HR_EXT_TENSORS " reduce", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status reduce(hr_host* h, const void* x, uint32_t dtype, uint64_t n, uint32_t op,
                        double* out) {
  LoadedPlugin& p = plugin(h);
  if (!out) {
    p.error = "reduce: out must not be NULL";
    return HR_ERROR_INVALID;
  }
  if (op > HR_REDUCE_SUM_SQUARES) {
    p.error = "reduce: op " + std::to_string(op) +
              " is not HR_REDUCE_SUM, _MAX, _MAX_ABS or _SUM_SQUARES";
    return HR_ERROR_INVALID;
  }
  if (dtype > HR_DTYPE_I32) {
    p.error = "reduce: dtype " + std::to_string(dtype) + " is not an hr_dtype";
    return HR_ERROR_INVALID;
  }
  const bool sums = op == HR_REDUCE_SUM || op == HR_REDUCE_SUM_SQUARES;
  if (n == 0) {
    *out = sums ? 0.0 : -std::numeric_limits<double>::infinity();
    return HR_OK;
  }
  if (!x) {
    p.error = "reduce: x must not be NULL";
    return HR_ERROR_INVALID;
  }
  // The sum of squares of a float tensor is the backend's own reduction, on the device; the
  // rest reads the elements back a bounded chunk at a time and reduces on the host.
  if (op == HR_REDUCE_SUM_SQUARES &&
      (dtype == HR_DTYPE_F32 || dtype == HR_DTYPE_BF16 || dtype == HR_DTYPE_F16))
    return guarded(h, [&] { *out = run(h).device->backend().sum_squares(Dtype(dtype), x, n); });
  const uint64_t size = dtype_size(Dtype(dtype));
  return guarded(h, [&] {
    constexpr uint64_t kChunkBytes = uint64_t(1) << 20;
    std::vector<unsigned char> chunk(kChunkBytes);
    const uint64_t per_chunk = kChunkBytes / size;
    double acc = sums ? 0.0 : -std::numeric_limits<double>::infinity();
    bool nan = false;
    Backend& ops = run(h).device->backend();
    for (uint64_t at = 0; at < n; at += per_chunk) {
      const uint64_t k = std::min(per_chunk, n - at);
      ops.download(chunk.data(), static_cast<const unsigned char*>(x) + at * size, k * size);
      for (uint64_t i = 0; i < k; ++i) {
        const double v = element(dtype, chunk.data() + i * size);
        switch (op) {
          case HR_REDUCE_SUM:
            acc += v;
            break;
          case HR_REDUCE_SUM_SQUARES:
            acc += v * v;
            break;
          case HR_REDUCE_MAX:
            nan |= std::isnan(v);
            acc = std::max(acc, v);
            break;
          default:
            nan |= std::isnan(v);
            acc = std::max(acc, std::fabs(v));
            break;
        }
      }
    }
    *out = nan ? std::numeric_limits<double>::quiet_NaN() : acc;
  });
}

extern const hr_ext_tensors kTensorsExtension;
const hr_ext_tensors kTensorsExtension = {sizeof(hr_ext_tensors),          0,
                                          checked<kFindParam, find_param>, checked<kRead, read>,
                                          checked<kReduce, reduce>,        checked<kWrite, write>};

}  // namespace services
}  // namespace headroom
