#include "core/model/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/os/output_file.h"
#include "kernels/common/dtype.h"

// The format is little-endian; the writer copies floats as they lie in memory and the reader
// decodes bytes with memcpy, which is only right on a little-endian host.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors I/O assumes little-endian");

namespace headroom {
namespace {

using nlohmann::json;

// The reference implementation refuses headers above 100 MB; so do we, so that a corrupt length
// cannot make us allocate gigabytes before the JSON is even looked at.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// A valid header nests three deep (object -> tensor object -> shape array). Anything much deeper is
// hostile, and refusing it early bounds the parser's memory.
constexpr int kMaxJsonDepth = 8;

uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i)
    v = (v << 8) | p[i];
  return v;
}

// Bytes per element of a safetensors dtype name; 0 for a dtype we cannot read.
uint64_t readable_dtype_size(const std::string& dtype) {
  if (dtype == "F32") return dtype_size(Dtype::kF32);
  if (dtype == "BF16") return dtype_size(Dtype::kBF16);
  if (dtype == "F16") return dtype_size(Dtype::kF16);
  return 0;
}

// model.h's is_adapter_param, here too: this file links without model.cpp (its fuzz target).
bool is_lora_param(const std::string& name) {
  return ends_with(name, ".lora_A.weight") || ends_with(name, ".lora_B.weight");
}

// Hugging Face's GPT-2 uses Conv1D (a Linear with a transposed weight) for these four, so their
// weights are stored (in, out) where ours are (out, in).
bool is_conv1d_weight(const std::string& name) {
  return ends_with(name, ".attn.c_attn.weight") || ends_with(name, ".attn.c_proj.weight") ||
         ends_with(name, ".mlp.c_fc.weight") || ends_with(name, ".mlp.c_proj.weight");
}

std::vector<int64_t> hf_shape(const Param<float>& p) {
  if (is_conv1d_weight(p.name) && p.shape.size() == 2) return {p.shape[1], p.shape[0]};
  return p.shape;
}

// h.N.attn.bias and h.N.attn.masked_bias: the causal-mask buffers older transformers versions saved
// with the weights. They are constants, not parameters.
bool is_mask_buffer(const std::string& name) {
  if (name.compare(0, 2, "h.") != 0) return false;
  size_t i = 2;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9')
    ++i;
  if (i == 2) return false;
  const std::string rest = name.substr(i);
  return rest == ".attn.bias" || rest == ".attn.masked_bias";
}

// Every parameter, walking the layers rather than calling Gpt::params() so that this file needs
// nothing from model.cpp: the fuzz target links the header parser without the rest of the core.
std::vector<Param<float>*> model_params(const Gpt<float>& model) {
  std::vector<Param<float>*> out;
  for (const auto& layer : model.layers())
    for (const auto& p : layer->params())
      out.push_back(p.get());
  return out;
}

std::string errno_str() {
  return std::strerror(errno);
}

// A file descriptor that closes itself.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  // Closes now, reporting the error that a deferred write may only surface here.
  int close() {
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

// Reads exactly `bytes` at `offset`; false if the file ends first (it shrank after we sized it).
bool pread_all(int fd, void* dst, uint64_t bytes, uint64_t offset, const std::string& file) {
  auto* p = static_cast<uint8_t*>(dst);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, p, std::min<uint64_t>(bytes, 1u << 30), off_t(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw ConfigError(file + ": read failed: " + errno_str());
    }
    if (n == 0) return false;
    p += n;
    bytes -= uint64_t(n);
    offset += uint64_t(n);
  }
  return true;
}

// Decodes `numel` elements from src into dst, row-major in the file's layout. With `transpose` the
// file holds a (rows, cols) matrix and dst receives its (cols, rows) transpose.
template <class Element>
void decode_as(const uint8_t* src, uint64_t numel, float* dst, bool transpose, uint64_t rows,
               uint64_t cols, Element element) {
  if (!transpose) {
    for (uint64_t k = 0; k < numel; ++k)
      dst[k] = element(src, k);
    return;
  }
  for (uint64_t r = 0; r < rows; ++r)
    for (uint64_t c = 0; c < cols; ++c)
      dst[c * rows + r] = element(src, r * cols + c);
}

void decode(const uint8_t* src, const std::string& dtype, uint64_t numel, float* dst,
            bool transpose, uint64_t rows, uint64_t cols) {
  // The dtype is chosen once per tensor, not per element: GPT-2's embedding alone is 38M of them.
  const auto u16 = [](const uint8_t* p, uint64_t k) {
    uint16_t h;
    std::memcpy(&h, p + 2 * k, 2);
    return h;
  };
  if (dtype == "F32") {
    decode_as(src, numel, dst, transpose, rows, cols, [](const uint8_t* p, uint64_t k) {
      float v;
      std::memcpy(&v, p + 4 * k, 4);
      return v;
    });
  } else if (dtype == "BF16") {
    decode_as(src, numel, dst, transpose, rows, cols,
              [&](const uint8_t* p, uint64_t k) { return bf16_to_float(u16(p, k)); });
  } else {
    decode_as(src, numel, dst, transpose, rows, cols,
              [&](const uint8_t* p, uint64_t k) { return f16_to_float(u16(p, k)); });
  }
}

}  // namespace

std::string json_quoted(const std::string& s) {
  return json(s).dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::vector<SafetensorsEntry> parse_safetensors_header(
    const uint8_t* data, size_t size, uint64_t file_size, const std::string& file,
    std::map<std::string, std::string>* metadata) {
  const std::string where = file + ": ";
  // Never trust `size` beyond the file itself.
  const uint64_t avail = std::min<uint64_t>(size, file_size);
  if (file_size < 8)
    throw ConfigError(where + "is " + std::to_string(file_size) +
                      " bytes, too short for a safetensors file (it starts with an 8-byte header "
                      "length)");
  if (avail < 8)
    throw ConfigError(where + "only " + std::to_string(avail) +
                      " bytes were read, too few for the 8-byte header length");
  const uint64_t n = read_le64(data);
  if (n > kMaxHeaderBytes)
    throw ConfigError(where + "header length " + std::to_string(n) + " is over the limit of " +
                      std::to_string(kMaxHeaderBytes) +
                      " bytes: not a safetensors file, or a corrupt one");
  if (n > file_size - 8)
    throw ConfigError(where + "header length " + std::to_string(n) +
                      " runs past the end of the file (" + std::to_string(file_size) +
                      " bytes): the file is truncated or not a safetensors file");
  if (n > avail - 8)
    throw ConfigError(where + "only " + std::to_string(avail) +
                      " bytes were read, but the header needs " + std::to_string(8 + n));

  json j;
  std::set<std::string> names;
  // The callback bounds the nesting and catches a name given twice, which nlohmann would otherwise
  // resolve silently by keeping the last one.
  const json::parser_callback_t check = [&](int depth, json::parse_event_t event, json& parsed) {
    if ((event == json::parse_event_t::object_start || event == json::parse_event_t::array_start) &&
        depth >= kMaxJsonDepth)
      throw ConfigError(where + "header JSON nests deeper than " + std::to_string(kMaxJsonDepth) +
                        " levels; a safetensors header nests 3");
    if (event == json::parse_event_t::key && depth == 1 &&
        !names.insert(parsed.get<std::string>()).second)
      throw ConfigError(where + "tensor " + json_quoted(parsed.get<std::string>()) +
                        " appears twice in the header");
    return true;
  };
  try {
    j = json::parse(data + 8, data + 8 + n, check);
  } catch (const json::exception& e) {
    throw ConfigError(where + "header is not valid JSON: " + e.what());
  }
  if (!j.is_object())
    throw ConfigError(where + "header is not a JSON object of tensors but a JSON " + j.type_name());

  const uint64_t data_size = file_size - 8 - n;
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, v] : j.items()) {
    const std::string what = where + "tensor " + json_quoted(name) + ": ";
    if (name == "__metadata__") {
      if (!v.is_object())
        throw ConfigError(where + "__metadata__ is a JSON " + v.type_name() +
                          ", not an object of strings");
      for (const auto& [key, value] : v.items()) {
        if (!value.is_string())
          throw ConfigError(where + "__metadata__ value " + json_quoted(key) + " is a JSON " +
                            value.type_name() + ", not a string");
        if (metadata) (*metadata)[key] = value.get<std::string>();
      }
      continue;
    }
    if (!v.is_object())
      throw ConfigError(what + "is a JSON " + std::string(v.type_name()) +
                        ", not an object with dtype, shape and data_offsets");
    SafetensorsEntry e;
    e.name = name;

    const auto dtype = v.find("dtype");
    if (dtype == v.end()) throw ConfigError(what + "has no dtype");
    if (!dtype->is_string())
      throw ConfigError(what + "dtype is a JSON " + dtype->type_name() + ", not a string");
    e.dtype = dtype->get<std::string>();
    const uint64_t esize = readable_dtype_size(e.dtype);
    if (esize == 0)
      throw ConfigError(what + "dtype " + json_quoted(e.dtype) +
                        " is not supported (valid: F32, BF16, F16)");

    const auto shape = v.find("shape");
    if (shape == v.end()) throw ConfigError(what + "has no shape");
    if (!shape->is_array())
      throw ConfigError(what + "shape is a JSON " + shape->type_name() +
                        ", not an array of integers");
    uint64_t numel = 1;
    bool overflow = false;
    for (const json& d : *shape) {
      if (!d.is_number_integer())
        throw ConfigError(what + "shape " + d.dump() + " is not an integer dimension");
      if (!d.is_number_unsigned())
        throw ConfigError(what + "shape has a negative dimension " + d.dump());
      const uint64_t dim = d.get<uint64_t>();
      if (dim > uint64_t(INT64_MAX))
        throw ConfigError(what + "shape dimension " + d.dump() + " is too large");
      e.shape.push_back(int64_t(dim));
      overflow = overflow || __builtin_mul_overflow(numel, dim, &numel);
    }
    uint64_t bytes = 0;
    overflow = overflow || __builtin_mul_overflow(numel, esize, &bytes);

    const auto offsets = v.find("data_offsets");
    if (offsets == v.end()) throw ConfigError(what + "has no data_offsets");
    if (!offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
        !(*offsets)[1].is_number_unsigned())
      throw ConfigError(what + "data_offsets " + offsets->dump() +
                        " is not a pair of non-negative integers [begin, end]");
    e.begin = (*offsets)[0].get<uint64_t>();
    e.end = (*offsets)[1].get<uint64_t>();
    const std::string range =
        "data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + "]";
    if (e.begin > e.end) throw ConfigError(what + range + " end before they begin");
    if (e.end > data_size)
      throw ConfigError(what + range + " lie outside the data section, which holds " +
                        std::to_string(data_size) + " bytes");
    if (overflow || bytes != e.end - e.begin)
      throw ConfigError(what + "shape " + shape_str(e.shape) + " of " + e.dtype + " needs " +
                        (overflow ? std::string("more than 2^64") : std::to_string(bytes)) +
                        " bytes, but " + range + " span " + std::to_string(e.end - e.begin));
    entries.push_back(std::move(e));
  }

  // Two tensors sharing bytes would alias each other's weights; the format forbids it.
  std::vector<const SafetensorsEntry*> by_offset;
  for (const SafetensorsEntry& e : entries)
    by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const SafetensorsEntry& a = *by_offset[i - 1];
    const SafetensorsEntry& b = *by_offset[i];
    if (b.begin < a.end)
      throw ConfigError(where + "tensors " + json_quoted(a.name) + " [" + std::to_string(a.begin) +
                        ", " + std::to_string(a.end) + "] and " + json_quoted(b.name) + " [" +
                        std::to_string(b.begin) + ", " + std::to_string(b.end) + "] overlap");
  }
  return entries;  // sorted by name: nlohmann's object is a std::map
}

std::vector<std::vector<float>> download_params(const Gpt<float>& model, const MasterAccess& access,
                                                bool keep) {
  std::vector<std::vector<float>> out;
  Backend& ops = model.device().backend();
  for (size_t l = 0; l < model.layers().size(); ++l) {
    const auto read = [&] {
      for (const auto& p : model.layers()[l]->params()) {
        out.emplace_back(keep ? p->numel : 0);
        if (keep) ops.download(out.back().data(), p->master().value, 4 * p->numel);
      }
    };
    if (access) {
      access(int(l), read);
    } else {
      read();
    }
  }
  return out;
}

void save_safetensors(const std::string& path, const Gpt<float>& model,
                      const std::vector<std::vector<float>>* host, const TensorPieces& pieces) {
  // Every tensor of the file: a piece of a parameter (rows of it), with the parameter's index in
  // model order (`host`). By name, as the reference writer orders them.
  struct Out {
    TensorPiece piece;
    const Param<float>* param;
    size_t index;
  };
  std::vector<Out> order;
  {
    size_t i = 0;
    for (const Param<float>* p : model_params(model)) {
      const int64_t rows = p->shape[0];
      for (TensorPiece& pc :
           pieces ? pieces(p->name, rows) : std::vector<TensorPiece>{{p->name, 0, rows}})
        order.push_back({std::move(pc), p, i});
      ++i;
    }
    if (host && host->size() != i)
      throw std::logic_error("save_safetensors: " + std::to_string(host->size()) +
                             " host tensors for " + std::to_string(i) + " parameters");
  }
  std::sort(order.begin(), order.end(),
            [&](const Out& a, const Out& b) { return a.piece.name < b.piece.name; });

  // The reference writer's layout: metadata first, then each tensor as dtype, shape, offsets.
  nlohmann::ordered_json header;
  header["__metadata__"]["format"] = "pt";
  header["__metadata__"]["producer"] = "headroom";
  // A pruned model's widths (headroom.resize/1), for readers that build the model first: the
  // shapes say the same.
  if (model.config().pruned())
    header["__metadata__"]["mlp_hidden"] = mlp_hidden_str(model.config());
  if (model.config().heads_pruned())
    header["__metadata__"]["attn_heads"] = attn_heads_str(model.config());
  // The model's shape, which the tensors do not all say (n_head): `headroom sample` builds the
  // model from a weights file alone with it.
  const ModelConfig& mc = model.config();
  header["__metadata__"]["n_layer"] = std::to_string(mc.n_layer);
  header["__metadata__"]["n_head"] = std::to_string(mc.n_head);
  header["__metadata__"]["n_embd"] = std::to_string(mc.n_embd);
  header["__metadata__"]["seq_len"] = std::to_string(mc.seq_len);
  header["__metadata__"]["vocab_size"] = std::to_string(mc.vocab_size);
  uint64_t offset = 0;
  for (const Out& o : order) {
    const Param<float>& p = *o.param;
    const uint64_t bytes = 4 * (p.numel / uint64_t(p.shape[0])) * uint64_t(o.piece.rows);
    std::vector<int64_t> shape = p.shape;
    shape[0] = o.piece.rows;
    if (is_conv1d_weight(p.name) && shape.size() == 2) std::swap(shape[0], shape[1]);
    nlohmann::ordered_json& t = header[o.piece.name];
    t["dtype"] = "F32";
    t["shape"] = shape;
    t["data_offsets"] = {offset, offset + bytes};
    offset += bytes;
  }
  std::string text = header.dump();
  // Padding to 8 keeps the data section 8-byte aligned for readers that map it, as the reference
  // implementation does.
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t prefix[8];
  for (int i = 0; i < 8; ++i)
    prefix[i] = uint8_t(uint64_t(text.size()) >> (8 * i));

  // Beside the target, renamed over it: a crash leaves the old file or the new one, never a
  // half-written one under the real name.
  AtomicFile out(path, "weights");
  out.write(prefix, 8);
  out.write(text);
  std::vector<float> t, buf;
  const Param<float>* downloaded = nullptr;  // buf holds its values
  for (const Out& o : order) {
    const Param<float>* p = o.param;
    const float* src;
    if (host) {
      src = (*host)[o.index].data();
    } else {
      if (downloaded != p) {
        buf.resize(p->numel);
        model.device().backend().download(buf.data(), p->master().value, 4 * p->numel);
        downloaded = p;
      }
      src = buf.data();
    }
    const uint64_t cols = p->numel / uint64_t(p->shape[0]);
    const uint64_t rows = uint64_t(o.piece.rows);
    src += uint64_t(o.piece.row) * cols;
    if (is_conv1d_weight(p->name)) {
      t.resize(rows * cols);
      for (uint64_t r = 0; r < rows; ++r)
        for (uint64_t c = 0; c < cols; ++c)
          t[c * rows + r] = src[r * cols + c];
      src = t.data();
    }
    out.write(src, 4 * rows * cols);
  }
  out.commit();
}

std::vector<SafetensorsEntry> read_safetensors_header(
    const std::string& path, std::map<std::string, std::string>* metadata) {
  const std::string where = path + ": ";
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw ConfigError(where + "cannot open: " + errno_str());
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw ConfigError(where + "cannot stat: " + errno_str());
  if (!S_ISREG(st.st_mode)) throw ConfigError(where + "is not a regular file");
  const uint64_t file_size = uint64_t(st.st_size);
  std::vector<uint8_t> head(std::min<uint64_t>(file_size, 8));
  if (!pread_all(fd.get(), head.data(), head.size(), 0, path))
    throw ConfigError(where + "the file got shorter while it was being read");
  if (head.size() == 8) {
    const uint64_t n = read_le64(head.data());
    if (n <= kMaxHeaderBytes && n <= file_size - 8) {
      head.resize(8 + n);
      if (!pread_all(fd.get(), head.data() + 8, n, 8, path))
        throw ConfigError(where + "the file got shorter while it was being read");
    }
  }
  return parse_safetensors_header(head.data(), head.size(), file_size, path, metadata);
}

void read_safetensors_tensor(const std::string& path, const SafetensorsEntry& e, float* dst,
                             bool transpose) {
  const std::string where = path + ": ";
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw ConfigError(where + "cannot open: " + errno_str());
  uint8_t head[8];
  if (!pread_all(fd.get(), head, 8, 0, path))
    throw ConfigError(where + "the file got shorter while it was being read");
  // The entry was checked against the file's size when its header was read; a file that has
  // shrunk since reads short and is reported.
  const uint64_t data_start = 8 + read_le64(head);
  if (e.end < e.begin || data_start > kMaxHeaderBytes + 8)
    throw ConfigError(where + "tensor " + json_quoted(e.name) + ": not an entry of this file");
  std::vector<uint8_t> raw(e.end - e.begin);
  if (!pread_all(fd.get(), raw.data(), raw.size(), data_start + e.begin, path))
    throw ConfigError(where + "the file got shorter while it was being read");
  uint64_t numel = 1;
  for (int64_t d : e.shape)
    numel *= uint64_t(d);
  if (numel * readable_dtype_size(e.dtype) != raw.size())
    throw ConfigError(where + "tensor " + json_quoted(e.name) +
                      ": its bytes do not match its shape");
  const bool t = transpose && e.shape.size() == 2;
  decode(raw.data(), e.dtype, numel, dst, t, t ? uint64_t(e.shape[0]) : 0,
         t ? uint64_t(e.shape[1]) : 0);
}

void load_safetensors(const std::string& path, Gpt<float>& model, const MasterAccess& access,
                      const MasterAccess& frozen_access) {
  const std::string where = path + ": ";
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw ConfigError(where + "cannot open: " + errno_str());
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw ConfigError(where + "cannot stat: " + errno_str());
  if (!S_ISREG(st.st_mode)) throw ConfigError(where + "is not a regular file");
  const uint64_t file_size = uint64_t(st.st_size);
  const auto truncated = [&] {
    return ConfigError(where + "the file got shorter while it was being read");
  };

  // Read the length, then the header only if the length is plausible; the parser reports it if not.
  std::vector<uint8_t> head(std::min<uint64_t>(file_size, 8));
  if (!pread_all(fd.get(), head.data(), head.size(), 0, path)) throw truncated();
  if (head.size() == 8) {
    const uint64_t n = read_le64(head.data());
    if (n <= kMaxHeaderBytes && n <= file_size - 8) {
      head.resize(8 + n);
      if (!pread_all(fd.get(), head.data() + 8, n, 8, path)) throw truncated();
    }
  }
  const std::vector<SafetensorsEntry> entries =
      parse_safetensors_header(head.data(), head.size(), file_size, path);
  const uint64_t data_start = head.size();

  // Match every tensor to a parameter before writing any, so a bad file leaves the model as it was.
  std::map<std::string, Param<float>*> params;
  for (Param<float>* p : model_params(model))
    params[p->name] = p;
  std::map<std::string, const SafetensorsEntry*> found;
  const SafetensorsEntry* lm_head = nullptr;
  for (const SafetensorsEntry& e : entries) {
    const std::string prefix = "transformer.";
    const std::string name =
        e.name.compare(0, prefix.size(), prefix) == 0 ? e.name.substr(prefix.size()) : e.name;
    if (is_mask_buffer(name)) continue;
    if (name == "lm_head.weight") {
      lm_head = &e;
      continue;
    }
    const auto it = params.find(name);
    if (it == params.end())
      throw ConfigError(where + "tensor " + json_quoted(e.name) +
                        " is not a parameter of this model (" + "GPT-2 with n_layer " +
                        std::to_string(model.config().n_layer) + ")");
    const auto [at, fresh] = found.emplace(name, &e);
    if (!fresh)
      throw ConfigError(where + "tensors " + json_quoted(at->second->name) + " and " +
                        json_quoted(e.name) + " both hold parameter " + name);
    const std::vector<int64_t> expected = hf_shape(*it->second);
    if (e.shape != expected)
      throw ConfigError(where + "tensor " + json_quoted(e.name) + " has shape " +
                        shape_str(e.shape) + ", expected " + shape_str(expected) +
                        " (Hugging Face GPT-2 layout)");
  }
  size_t missing = 0;
  std::string first_missing;
  // LoRA adapters a file does not hold (a base model's) keep their init.
  for (const auto& [name, p] : params)
    if (!found.count(name) && !is_lora_param(name) && missing++ == 0) first_missing = name;
  if (missing > 0)
    throw ConfigError(where + "missing tensor " + first_missing +
                      (missing > 1 ? " (and " + std::to_string(missing - 1) + " more)" : ""));

  std::vector<uint8_t> raw;
  const auto read_floats = [&](const SafetensorsEntry& e, float* dst, bool transpose) {
    raw.resize(e.end - e.begin);
    if (!pread_all(fd.get(), raw.data(), raw.size(), data_start + e.begin, path)) throw truncated();
    uint64_t numel = 1;
    for (int64_t d : e.shape)
      numel *= uint64_t(d);
    const bool t = transpose && e.shape.size() == 2;
    decode(raw.data(), e.dtype, numel, dst, t, t ? uint64_t(e.shape[0]) : 0,
           t ? uint64_t(e.shape[1]) : 0);
  };

  // headroom's head is tied to the token embedding; a checkpoint whose lm_head differs would load
  // as a different model, so it is refused rather than dropped.
  if (lm_head) {
    const SafetensorsEntry& wte = *found.at("wte.weight");
    if (lm_head->shape != wte.shape)
      throw ConfigError(where + "tensor " + json_quoted(lm_head->name) + " has shape " +
                        shape_str(lm_head->shape) + ", expected " + shape_str(wte.shape) +
                        " (tied to wte.weight)");
    std::vector<float> a(params.at("wte.weight")->numel), b(a.size());
    read_floats(*lm_head, a.data(), false);
    read_floats(wte, b.data(), false);
    if (std::memcmp(a.data(), b.data(), 4 * a.size()) != 0)
      throw ConfigError(where + "tensor " + json_quoted(lm_head->name) +
                        " differs from wte.weight, but headroom ties the output head to the token "
                        "embedding: an untied checkpoint cannot be loaded");
  }

  // Decoded on the host, then uploaded layer by layer (inside `access`: sharded masters are made
  // whole for it); the compute copies (amp) follow the new masters.
  std::map<const Param<float>*, std::vector<float>> host;
  for (const auto& [name, e] : found) {
    const Param<float>* p = params.at(name);
    std::vector<float>& v = host[p];
    v.resize(p->numel);
    read_floats(*e, v.data(), is_conv1d_weight(name));
  }
  upload_params(model, host, access, frozen_access);  // an adapter the file lacks keeps its init
}

void upload_params(Gpt<float>& model, const std::map<const Param<float>*, std::vector<float>>& host,
                   const MasterAccess& access, const MasterAccess& frozen_access) {
  Backend& ops = model.device().backend();
  for (size_t l = 0; l < model.layers().size(); ++l) {
    Layer<float>& layer = *model.layers()[l];
    // Frozen weights go where the init writes them (Layer::write_init): a bounded chunk at a time
    // into their compute copy, or quantized on the host into their bytes; never through the
    // layer's f32 values made whole (the 1.96 GiB of a Llama-3.1-8B's frozen LM head).
    bool trainable = false, frozen = false;
    for (const auto& p : layer.params())
      (p->frozen ? frozen : trainable) |= host.count(p.get()) > 0;
    const auto write_frozen = [&] {
      for (const auto& p : layer.params()) {
        if (!p->frozen || !host.count(p.get())) continue;
        const float* from = host.at(p.get()).data();
        layer.write_init(*p, [&from](float* to, uint64_t n) {
          std::memcpy(to, from, n * sizeof(float));
          from += n;
        });
      }
    };
    if (frozen && frozen_access) {
      frozen_access(int(l), write_frozen);
    } else if (frozen) {
      write_frozen();
    }
    if (!trainable) continue;
    const auto write = [&] {
      for (const auto& p : layer.params())
        if (!p->frozen && host.count(p.get()))
          ops.upload(p->master().value, host.at(p.get()).data(), 4 * p->numel);
      ops.synchronize();
    };
    if (access) {
      access(int(l), write);
    } else {
      write();
    }
  }
  model.sync_compute_params();
}

namespace {

// Each block's tensor "h.<b>.<tail>" (a "transformer." prefix allowed), by block.
std::map<int, const SafetensorsEntry*> block_tensors(const std::vector<SafetensorsEntry>& entries,
                                                     const std::string& tail, int n_layer) {
  std::map<int, const SafetensorsEntry*> out;
  for (const SafetensorsEntry& e : entries) {
    const std::string prefix = "transformer.";
    const std::string name =
        e.name.compare(0, prefix.size(), prefix) == 0 ? e.name.substr(prefix.size()) : e.name;
    if (name.size() <= 2 + tail.size() || name.compare(0, 2, "h.") != 0 ||
        name.compare(name.size() - tail.size(), tail.size(), tail) != 0)
      continue;
    const std::string num = name.substr(2, name.size() - 2 - tail.size());
    if (num.empty() || num.size() > 6 || num.find_first_not_of("0123456789") != std::string::npos)
      continue;
    const int b = std::stoi(num);
    if (b < n_layer) out[b] = &e;
  }
  return out;
}

}  // namespace

std::vector<int> safetensors_mlp_widths(const std::string& path, const ModelConfig& m) {
  // A Hugging Face folder's blocks all have its config.json's widths.
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return {};
  // Block b's c_fc weight is (C, H) in the Hugging Face layout: H is its width. Anything else is
  // for load_safetensors to refuse, naming the tensor.
  std::vector<int> widths(size_t(std::max(0, m.n_layer)), 4 * m.n_embd);
  bool pruned = false;
  const std::vector<SafetensorsEntry> entries = read_safetensors_header(path);
  for (const auto& [b, e] : block_tensors(entries, ".mlp.c_fc.weight", m.n_layer)) {
    if (e->shape.size() != 2 || e->shape[0] != m.n_embd || e->shape[1] < 1 ||
        e->shape[1] > int64_t(4) * m.n_embd)
      continue;
    widths[size_t(b)] = int(e->shape[1]);
    pruned |= e->shape[1] != int64_t(4) * m.n_embd;
  }
  return pruned ? widths : std::vector<int>{};
}

std::vector<int> safetensors_attn_heads(const std::string& path, const ModelConfig& m) {
  // A Hugging Face folder's blocks all have its config.json's widths.
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return {};
  // Block b's c_attn weight is (C, 3·A) in the Hugging Face layout, A = heads · (C / n_head).
  if (m.n_head < 1 || m.n_embd % m.n_head != 0) return {};
  const int64_t hs = m.n_embd / m.n_head;
  std::vector<int> heads(size_t(std::max(0, m.n_layer)), m.n_head);
  bool pruned = false;
  const std::vector<SafetensorsEntry> entries = read_safetensors_header(path);
  for (const auto& [b, e] : block_tensors(entries, ".attn.c_attn.weight", m.n_layer)) {
    if (e->shape.size() != 2 || e->shape[0] != m.n_embd || e->shape[1] % (3 * hs) != 0 ||
        e->shape[1] < 3 * hs || e->shape[1] > 3 * int64_t(m.n_embd))
      continue;
    heads[size_t(b)] = int(e->shape[1] / (3 * hs));
    pruned |= heads[size_t(b)] != m.n_head;
  }
  return pruned ? heads : std::vector<int>{};
}

std::string attn_heads_str(const ModelConfig& m) {
  std::string s;
  for (int b = 0; b < m.n_layer; ++b)
    s += (b ? "," : "") + std::to_string(m.heads(b));
  return s;
}

std::string mlp_hidden_str(const ModelConfig& m) {
  std::string s;
  for (int b = 0; b < m.n_layer; ++b)
    s += (b ? "," : "") + std::to_string(m.mlp_width(b));
  return s;
}

}  // namespace headroom
