#include "core/run/snapshot.h"

#include "core/comm/comm.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "core/comm/comm.h"
#include "core/config/config.h"
#include "core/os/output_file.h"

namespace headroom {

namespace fs = std::filesystem;

namespace {

constexpr char kMagic[8] = {'H', 'R', 'S', 'N', 'A', 'P', '0', '2'};
constexpr char kMagicPrefix[6] = {'H', 'R', 'S', 'N', 'A', 'P'};
constexpr const char* kSuffix = ".hrsnap";
constexpr const char* kPrefix = "step_";
constexpr size_t kStepDigits = 12;
constexpr uint64_t kHeaderFnvBasis = kChecksumBasis;

uint64_t fnv1a(const uint8_t* p, size_t n, uint64_t h) {
  return checksum_bytes(p, n, h);
}

void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i)
    p[i] = uint8_t(v >> (8 * i));
}

uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i)
    v |= uint64_t(p[i]) << (8 * i);
  return v;
}

std::string step_name(int64_t step) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s%0*lld%s", kPrefix, int(kStepDigits),
                static_cast<long long>(step), kSuffix);
  return buf;
}

// The step N of a file named step_<N>.hrsnap (N all digits), or -1.
int64_t step_of_name(const std::string& name) {
  const size_t prefix = std::strlen(kPrefix), suffix = std::strlen(kSuffix);
  if (name.size() <= prefix + suffix || name.compare(0, prefix, kPrefix) != 0 ||
      name.compare(name.size() - suffix, suffix, kSuffix) != 0)
    return -1;
  const std::string digits = name.substr(prefix, name.size() - prefix - suffix);
  if (digits.size() > 18 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return -1;
  return std::stoll(digits);
}

constexpr const char* kRankSuffix = ".data";

// step_<N>.rank<r>.data
std::string rank_part_name(int64_t step, int rank) {
  std::string n = step_name(step);
  return n.substr(0, n.size() - std::strlen(kSuffix)) + ".rank" + std::to_string(rank) +
         kRankSuffix;
}

// The step N of a rank part's name step_<N>.rank<r>.data, or -1.
int64_t step_of_rank_part(const std::string& name) {
  const size_t at = name.find(".rank");
  const size_t suffix = std::strlen(kRankSuffix);
  if (at == std::string::npos || name.size() <= at + 5 + suffix ||
      name.compare(name.size() - suffix, suffix, kRankSuffix) != 0)
    return -1;
  const std::string r = name.substr(at + 5, name.size() - at - 5 - suffix);
  if (r.empty() || r.size() > 9 ||
      !std::all_of(r.begin(), r.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return -1;
  return step_of_name(name.substr(0, at) + kSuffix);
}

bool is_leftover_temporary(const std::string& name) {
  // AtomicFile's temporary for step_<N>.hrsnap is .step_<N>.hrsnap.tmp.
  const std::string tmp = ".tmp";
  return name.size() > 1 + tmp.size() && name[0] == '.' &&
         name.compare(name.size() - tmp.size(), tmp.size(), tmp) == 0 &&
         (step_of_name(name.substr(1, name.size() - 1 - tmp.size())) >= 0 ||
          step_of_rank_part(name.substr(1, name.size() - 1 - tmp.size())) >= 0);
}

// Snapshots in dir, newest first.
std::vector<fs::path> snapshots_in(const std::string& dir) {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const int64_t step = step_of_name(e.path().filename().string());
    if (step >= 0) found.push_back({step, e.path()});
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second > b.second;
  });
  std::vector<fs::path> out;
  for (auto& f : found)
    out.push_back(std::move(f.second));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Reading the manifest

class Reader {
 public:
  Reader(const uint8_t* data, size_t size, const std::string& name)
      : data_(data), size_(size), name_(name) {}

  SnapshotData parse() {
    check_header();
    const nlohmann::json m = parse_manifest();
    return decode(m);
  }

 private:
  ConfigError bad(const std::string& what) const {
    return ConfigError("snapshot " + name_ + ": " + what);
  }

  void check_header() {
    if (size_ >= 8 && std::memcmp(data_, kMagic, 8) != 0 &&
        std::memcmp(data_, kMagicPrefix, sizeof kMagicPrefix) == 0) {
      const std::string format(reinterpret_cast<const char*>(data_) + 6, 2);
      const std::string printable =
          std::all_of(format.begin(), format.end(), [](char c) { return c >= '0' && c <= '9'; })
              ? format
              : "unknown";
      if (format == "01")
        throw bad(
            "written by an older headroom (format 01, whose checksum does not cover the "
            "manifest); this headroom reads format 02 only. Resume it with the headroom that "
            "wrote it, or start the run again without --resume");
      throw bad("format " + printable + " is not one this headroom reads (it reads 02)");
    }
    if (size_ < 8 || std::memcmp(data_, kMagic, 8) != 0)
      throw bad("not a headroom snapshot (bad magic; expected \"HRSNAP02\")");
    if (size_ < kSnapshotHeaderBytes)
      throw bad("truncated: " + std::to_string(size_) + " bytes, shorter than the " +
                std::to_string(kSnapshotHeaderBytes) + "-byte header");
    manifest_len_ = get_u64(data_ + 8);
    const uint64_t after_header = size_ - kSnapshotHeaderBytes;
    if (manifest_len_ > after_header)
      throw bad("truncated: the manifest is " + std::to_string(manifest_len_) +
                " bytes but the file holds " + std::to_string(after_header) + " after the header");
    payload_at_ = kSnapshotHeaderBytes + manifest_len_;
    payload_size_ = size_ - payload_at_;
    if (get_u64(data_ + 16) != snapshot_checksum(data_, size_)) {
      // Say "cut short" when the manifest still tells the payload's size.
      try {
        const auto m = nlohmann::json::parse(data_ + kSnapshotHeaderBytes, data_ + payload_at_);
        const auto it = m.find("payload_bytes");
        if (it != m.end() && it->is_number_unsigned() && it->get<uint64_t>() > payload_size_)
          throw bad("truncated: the payload holds " + std::to_string(payload_size_) + " of its " +
                    std::to_string(it->get<uint64_t>()) + " bytes (was the write cut off?)");
      } catch (const nlohmann::json::exception&) {
      }
      throw bad("checksum mismatch: the file is damaged or was edited");
    }
  }

  nlohmann::json parse_manifest() const {
    // nlohmann keeps the last of duplicate keys silently; refuse them instead, so that what is
    // read is what a reader of the JSON sees.
    std::vector<std::set<std::string>> keys;
    const auto callback = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
      using E = nlohmann::json::parse_event_t;
      if (event == E::object_start) {
        keys.emplace_back();
      } else if (event == E::object_end) {
        if (!keys.empty()) keys.pop_back();
      } else if (event == E::key && !keys.empty()) {
        const std::string key = parsed.get<std::string>();
        if (!keys.back().insert(key).second)
          throw bad("bad manifest: the key '" + key + "' appears twice in one object");
      }
      return true;
    };
    try {
      return nlohmann::json::parse(data_ + kSnapshotHeaderBytes, data_ + payload_at_, callback);
    } catch (const nlohmann::json::exception& e) {
      throw bad(std::string("bad manifest: ") + e.what());
    }
  }

  const nlohmann::json& key(const nlohmann::json& object, const char* k,
                            const std::string& where) const {
    const auto it = object.find(k);
    if (it == object.end()) throw bad("the manifest" + where + " has no '" + k + "'");
    return *it;
  }

  void only_keys(const nlohmann::json& object, const std::vector<std::string>& valid,
                 const std::string& where) const {
    for (const auto& item : object.items())
      if (std::find(valid.begin(), valid.end(), item.key()) == valid.end()) {
        std::string list;
        for (const std::string& v : valid)
          list += (list.empty() ? "" : ", ") + v;
        throw bad("unknown manifest key '" + item.key() + "'" + where + "; valid: " + list);
      }
  }

  int64_t integer(const nlohmann::json& v, const std::string& what) const {
    if (v.is_number_integer() && !v.is_number_unsigned()) return v.get<int64_t>();
    if (v.is_number_unsigned() && v.get<uint64_t>() <= uint64_t(INT64_MAX))
      return int64_t(v.get<uint64_t>());
    throw bad(what + " is " + describe(v) + ", not an integer in range");
  }

  uint64_t count(const nlohmann::json& v, const std::string& what) const {
    if (v.is_number_unsigned()) return v.get<uint64_t>();
    throw bad(what + " is " + describe(v) + ", not a byte count (an integer >= 0)");
  }

  std::string string(const nlohmann::json& v, const std::string& what, bool non_empty) const {
    if (!v.is_string()) throw bad(what + " is " + describe(v) + ", not a string");
    std::string s = v.get<std::string>();
    if (non_empty && s.empty()) throw bad(what + " is empty");
    return s;
  }

  static std::string describe(const nlohmann::json& v) {
    if (v.is_number() || v.is_boolean() || v.is_null()) {
      std::string s = v.dump();
      return s.size() > 40 ? s.substr(0, 40) + "..." : s;
    }
    const std::string type = v.type_name();
    return (type[0] == 'a' || type[0] == 'o' ? "an " : "a ") + type;
  }

  // One list of entries; `at` is where the next entry must start in the payload.
  void take(const nlohmann::json& list, const char* list_name, const std::string& kind,
            std::map<std::string, std::vector<uint8_t>>& out, uint64_t payload, uint64_t* at) {
    if (!list.is_array())
      throw bad(std::string("'") + list_name + "' is " + describe(list) + ", not an array");
    for (size_t i = 0; i < list.size(); ++i) {
      const nlohmann::json& e = list[i];
      const std::string where = std::string(" (") + list_name + " entry " + std::to_string(i) + ")";
      if (!e.is_object())
        throw bad(std::string(list_name) + " entry " + std::to_string(i) + " is " + describe(e) +
                  ", not an object");
      only_keys(e, {"name", "offset", "bytes"}, where);
      const std::string name = string(key(e, "name", where), kind + " name" + where, true);
      const std::string what = kind + " '" + name + "'";
      const uint64_t off = count(key(e, "offset", where), "the offset of " + what);
      const uint64_t n = count(key(e, "bytes", where), "the size of " + what);
      if (off > payload || n > payload - off)
        throw bad(what + " (" + std::to_string(n) + " bytes at offset " + std::to_string(off) +
                  ") lies outside the " + std::to_string(payload) + "-byte payload");
      if (off < *at)
        throw bad(what + " at offset " + std::to_string(off) +
                  " overlaps the entry before it, which ends at " + std::to_string(*at));
      if (off > *at)
        throw bad(what + " at offset " + std::to_string(off) +
                  " leaves a gap after the entry before it, which ends at " + std::to_string(*at));
      if (out.count(name)) throw bad(what + " appears twice");
      const uint8_t* p = data_ + payload_at_ + off;
      out.emplace(name, std::vector<uint8_t>(p, p + n));
      *at = off + n;
    }
  }

  SnapshotData decode(const nlohmann::json& m) {
    if (!m.is_object()) throw bad("the manifest is " + describe(m) + ", not a JSON object");
    only_keys(m,
              {"step", "skipped_steps", "data_state", "model", "optimizer", "tensors", "plugins",
               "payload_bytes", "best_val_loss", "best_val_step", "frozen_base"},
              "");
    SnapshotData d;
    const uint64_t payload = count(key(m, "payload_bytes", ""), "payload_bytes");
    if (payload != payload_size_)
      throw bad(payload < payload_size_
                    ? "the payload is " + std::to_string(payload_size_) +
                          " bytes but the manifest says " + std::to_string(payload)
                    : "truncated: the payload holds " + std::to_string(payload_size_) + " of its " +
                          std::to_string(payload) + " bytes");
    d.step = integer(key(m, "step", ""), "step");
    if (d.step < 1) throw bad("step " + std::to_string(d.step) + " is out of range (>= 1)");
    d.skipped_steps = integer(key(m, "skipped_steps", ""), "skipped_steps");
    if (d.skipped_steps < 0 || d.skipped_steps > d.step)
      throw bad("skipped_steps " + std::to_string(d.skipped_steps) +
                " is out of range (0 to the step, " + std::to_string(d.step) + ")");
    if (m.contains("best_val_loss") || m.contains("best_val_step")) {
      const nlohmann::json& v = key(m, "best_val_loss", "");
      if (!v.is_number() || !std::isfinite(v.get<double>()))
        throw bad("best_val_loss is " + describe(v) + ", not a finite number");
      d.best_val_loss = v.get<double>();
      d.best_val_step = integer(key(m, "best_val_step", ""), "best_val_step");
      if (d.best_val_step < 1 || d.best_val_step > d.step)
        throw bad("best_val_step " + std::to_string(d.best_val_step) +
                  " is out of range (1 to the step, " + std::to_string(d.step) + ")");
    }
    d.data_state = string(key(m, "data_state", ""), "data_state", false);
    d.model = string(key(m, "model", ""), "model", true);
    d.optimizer = string(key(m, "optimizer", ""), "optimizer", true);
    if (m.contains("frozen_base")) {
      const nlohmann::json& b = m["frozen_base"];
      const std::string where = "'s frozen_base";
      if (!b.is_object()) throw bad("frozen_base is " + describe(b) + ", not a JSON object");
      only_keys(b, {"init_from", "seed", "checksum", "tensors"}, where);
      SnapshotData::FrozenBase f;
      f.init_from = string(key(b, "init_from", where), "frozen_base.init_from", false);
      f.seed = count(key(b, "seed", where), "frozen_base.seed");
      const std::string sum = string(key(b, "checksum", where), "frozen_base.checksum", true);
      if (sum.size() != 16 || sum.find_first_not_of("0123456789abcdef") != std::string::npos)
        throw bad("frozen_base.checksum \"" + sum.substr(0, 40) + "\" is not 16 hex digits");
      f.checksum = std::stoull(sum, nullptr, 16);
      f.tensors = count(key(b, "tensors", where), "frozen_base.tensors");
      if (f.tensors == 0) throw bad("frozen_base.tensors is 0: a frozen base has a tensor");
      d.frozen_base = f;
    }
    uint64_t at = 0;
    take(key(m, "tensors", ""), "tensors", "tensor", d.tensors, payload, &at);
    take(key(m, "plugins", ""), "plugins", "plugin state", d.plugins, payload, &at);
    if (at != payload)
      throw bad("the entries cover " + std::to_string(at) + " of the " + std::to_string(payload) +
                " payload bytes");
    return d;
  }

  const uint8_t* data_;
  size_t size_;
  const std::string& name_;
  uint64_t manifest_len_ = 0, payload_at_ = 0, payload_size_ = 0;
};

}  // namespace

uint64_t checksum_bytes(const uint8_t* p, size_t n, uint64_t h) {
  for (size_t i = 0; i < n; ++i)
    h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

uint64_t snapshot_checksum(const uint8_t* data, size_t size) {
  if (size < kSnapshotHeaderBytes) return 0;
  return fnv1a(data + kSnapshotHeaderBytes, size - kSnapshotHeaderBytes,
               fnv1a(data, 16, kHeaderFnvBasis));
}

SnapshotData parse_snapshot(const uint8_t* data, size_t size, const std::string& name) {
  return Reader(data, size, name).parse();
}

// ---------------------------------------------------------------------------------------------
// Writing

namespace {

std::string checksum_hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// `d` in format 02 at `path`, through AtomicFile (`what` names it in errors).
void write_container(const std::string& path, const SnapshotData& d, const char* what) {
  // Manifest: where each tensor and plugin state sits in the payload.
  nlohmann::json m;
  m["step"] = d.step;
  m["skipped_steps"] = d.skipped_steps;
  if (d.best_val_step > 0) {
    m["best_val_loss"] = d.best_val_loss;
    m["best_val_step"] = d.best_val_step;
  }
  m["data_state"] = d.data_state;
  m["model"] = d.model;
  m["optimizer"] = d.optimizer;
  if (d.frozen_base)
    m["frozen_base"] = {{"init_from", d.frozen_base->init_from},
                        {"seed", d.frozen_base->seed},
                        {"checksum", checksum_hex(d.frozen_base->checksum)},
                        {"tensors", d.frozen_base->tensors}};
  uint64_t offset = 0;
  auto place = [&](const std::map<std::string, std::vector<uint8_t>>& items) {
    nlohmann::json list = nlohmann::json::array();
    for (const auto& [name, bytes] : items) {
      list.push_back({{"name", name}, {"offset", offset}, {"bytes", bytes.size()}});
      offset += bytes.size();
    }
    return list;
  };
  m["tensors"] = place(d.tensors);
  m["plugins"] = place(d.plugins);
  m["payload_bytes"] = offset;
  const std::string manifest = m.dump();

  uint8_t header[kSnapshotHeaderBytes];
  std::memcpy(header, kMagic, 8);
  put_u64(header + 8, manifest.size());
  uint64_t checksum = fnv1a(header, 16, kHeaderFnvBasis);
  checksum = fnv1a(reinterpret_cast<const uint8_t*>(manifest.data()), manifest.size(), checksum);
  for (const auto* items : {&d.tensors, &d.plugins})
    for (const auto& [name, bytes] : *items)
      checksum = fnv1a(bytes.data(), bytes.size(), checksum);
  put_u64(header + 16, checksum);

  // Destroyed without commit() (a write failed), the temporary goes and nothing else changes.
  AtomicFile out(path, what);
  out.write(header, sizeof header);
  out.write(manifest);
  for (const auto* items : {&d.tensors, &d.plugins})
    for (const auto& [name, bytes] : *items)
      out.write(bytes.data(), bytes.size());
  out.commit();
}

}  // namespace

std::string write_snapshot(const std::string& dir, const SnapshotData& d, int keep) {
  if (d.step < 1 || d.skipped_steps < 0 || d.skipped_steps > d.step)
    throw std::invalid_argument("write_snapshot: step " + std::to_string(d.step) +
                                ", skipped_steps " + std::to_string(d.skipped_steps) +
                                " out of range");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw OutputError("snapshot " + dir + ": cannot create the folder: " + ec.message());
  const std::string final_path = (fs::path(dir) / step_name(d.step)).string();
  write_container(final_path, d, "snapshot");

  const std::vector<fs::path> all = snapshots_in(dir);
  std::vector<int64_t> pruned;
  for (size_t i = size_t(std::max(keep, 1)); i < all.size(); ++i) {
    fs::remove(all[i], ec);
    fs::remove(fs::path(all[i]).replace_extension(".safetensors"), ec);  // save_weights' copy
    pruned.push_back(step_of_name(all[i].filename().string()));
  }
  // The ranks' parts of the pruned snapshots, and parts older than the oldest kept snapshot whose
  // snapshot was never written (a run that stopped between the parts and the file).
  const int64_t oldest_kept =
      all.empty()
          ? 0
          : step_of_name(
                all[std::min(all.size(), size_t(std::max(keep, 1))) - 1].filename().string());
  if (!pruned.empty()) {
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const int64_t step = step_of_rank_part(e.path().filename().string());
      if (step >= 0 && step < oldest_kept) fs::remove(e.path(), ec);
    }
  }
  // Temporaries of writes a killed run never finished.
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (is_leftover_temporary(e.path().filename().string())) fs::remove(e.path(), ec);
  return final_path;
}

std::string ranks_data_state(int world_size) {
  return "ranks " + std::to_string(world_size);
}

int snapshot_world_size(const std::string& data_state) {
  const std::string p = "ranks ";
  if (data_state.compare(0, p.size(), p) != 0) return 1;
  const std::string n = data_state.substr(p.size());
  if (n.empty() || n.size() > 9 ||
      !std::all_of(n.begin(), n.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return 1;
  return std::stoi(n);
}

std::string snapshot_file(const std::string& dir, int64_t step) {
  return (fs::path(dir) / step_name(step)).string();
}

namespace {
// What a rank part's "model" field holds: whose part it is.
std::string rank_part_owner(int rank, int world_size) {
  return "rank " + std::to_string(rank) + " of " + std::to_string(world_size);
}
}  // namespace

void write_rank_part(const std::string& dir, int64_t step, int rank, int world_size,
                     const std::string& data_state,
                     const std::map<std::string, std::vector<uint8_t>>& tensors) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw OutputError("snapshot " + dir + ": cannot create the folder: " + ec.message());
  SnapshotData d;
  d.step = step;
  d.data_state = data_state;
  d.model = rank_part_owner(rank, world_size);
  d.optimizer = "-";
  d.tensors = tensors;
  write_container((fs::path(dir) / rank_part_name(step, rank)).string(), d, "snapshot rank part");
}

std::string rank_part_file(const std::string& dir, int64_t step, int rank) {
  return (fs::path(dir) / rank_part_name(step, rank)).string();
}

RankPart read_rank_part(const std::string& dir, int64_t step, int rank, int world_size) {
  const std::string file = rank_part_file(dir, step, rank);
  auto bad = [&](const std::string& what) {
    return ConfigError("rank " + std::to_string(rank) + "'s part " + file + " " + what);
  };
  std::ifstream in(file, std::ios::binary);
  if (!in) throw bad("cannot be opened: " + std::string(std::strerror(errno)));
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  SnapshotData d;
  try {
    d = parse_snapshot(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), file);
  } catch (const ConfigError& e) {
    throw bad(std::string("is damaged: ") + e.what());
  }
  if (d.step != step || d.model != rank_part_owner(rank, world_size))
    throw bad("is of step " + std::to_string(d.step) + ", " + d.model + "; expected step " +
              std::to_string(step) + ", " + rank_part_owner(rank, world_size));
  return {d.data_state, std::move(d.tensors)};
}

std::string plugin_optimizer_signature(const std::string& plugin) {
  return "plugin '" + plugin + "'";
}

bool is_plugin_optimizer(const std::string& signature) {
  return signature == "plugin" || signature.rfind("plugin '", 0) == 0;
}

std::string optimizer_plugin_of(const std::string& signature) {
  const std::string head = "plugin '";
  if (signature.rfind(head, 0) != 0 || signature.size() <= head.size() + 1 ||
      signature.back() != '\'')
    return "";
  return signature.substr(head.size(), signature.size() - head.size() - 1);
}

bool same_optimizer(const std::string& theirs, const std::string& ours) {
  const std::string a = optimizer_layout(theirs).optimizer, b = optimizer_layout(ours).optimizer;
  return a == b || (a == "plugin" && is_plugin_optimizer(b));
}

std::string optimizer_mismatch(const SnapshotData& d, const std::string& ours,
                               const std::string& our_plugin,
                               const std::vector<std::string>& loaded) {
  const std::string theirs_base = optimizer_layout(d.optimizer).optimizer;
  std::string theirs = d.optimizer, their_plugins;
  const bool theirs_plugin = is_plugin_optimizer(theirs_base);
  if (theirs_plugin && !optimizer_plugin_of(theirs_base).empty()) {
    their_plugins = "'" + optimizer_plugin_of(theirs_base) + "'";
    theirs = "the optimizer of plugin " + their_plugins;
  } else if (theirs_plugin) {
    // An old snapshot: the plugin states it holds that this run lacks.
    for (const auto& [name, bytes] : d.plugins)
      if (std::find(loaded.begin(), loaded.end(), name) == loaded.end())
        their_plugins += (their_plugins.empty() ? "'" : ", '") + name + "'";
    theirs = their_plugins.empty()
                 ? std::string("optimizer of a plugin")
                 : "optimizer of plugin " + their_plugins + " (whose state it holds)";
  } else {
    theirs = "optimizer " + theirs;
  }
  const std::string mine =
      our_plugin.empty() ? ours : "the optimizer of plugin '" + our_plugin + "'";
  std::string fix;
  if (!our_plugin.empty() && theirs_plugin && !optimizer_plugin_of(theirs_base).empty())
    fix = "list " + their_plugins + " in [[plugins]] instead of '" + our_plugin + "' to resume it";
  else if (!our_plugin.empty())
    fix = "resume it without plugin '" + our_plugin + "'";
  else if (theirs_plugin)
    fix = "list " + (their_plugins.empty() ? std::string("its optimizer plugin") : their_plugins) +
          " in [[plugins]] again to resume it";
  else
    fix = "set train.optimizer = \"" + theirs_base + "\" to resume it";
  return "was made with " + theirs + ", this config uses " + mine + " (" + fix +
         ", or start afresh without --resume)";
}

// ---------------------------------------------------------------------------------------------
// Resharding

OptimizerLayout optimizer_layout(const std::string& signature) {
  const std::string mid = " sharded over ", tail = " ranks";
  OptimizerLayout l{signature, 0};
  const size_t at = signature.rfind(mid);
  if (at == std::string::npos || signature.size() < at + mid.size() + tail.size() ||
      signature.compare(signature.size() - tail.size(), tail.size(), tail) != 0)
    return l;
  const std::string n =
      signature.substr(at + mid.size(), signature.size() - tail.size() - at - mid.size());
  if (n.empty() || n.size() > 9 ||
      !std::all_of(n.begin(), n.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return l;
  l.optimizer = signature.substr(0, at);
  l.sharded_over = std::stoi(n);
  return l;
}

namespace {

// A decimal number of at most 18 digits.
bool parse_count(const std::string& s, uint64_t* out) {
  if (s.empty() || s.size() > 18 ||
      !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return false;
  *out = std::stoull(s);
  return true;
}

std::string range_str(uint64_t a, uint64_t b) {
  return "[" + std::to_string(a) + ":" + std::to_string(b) + ")";
}

}  // namespace

bool parse_state_name(const std::string& name, StateName* out) {
  StateName n;
  const size_t space = name.find(' ');
  if (space == 0 || space == std::string::npos) return false;
  n.param = name.substr(0, space);
  std::string rest = name.substr(space + 1);
  if (!rest.empty() && rest[0] == '[') {
    const size_t colon = rest.find(':'), close = rest.find(')');
    if (colon == std::string::npos || close == std::string::npos || colon > close ||
        rest.size() < close + 2 || rest[close + 1] != ' ' ||
        !parse_count(rest.substr(1, colon - 1), &n.begin) ||
        !parse_count(rest.substr(colon + 1, close - colon - 1), &n.end) || n.begin >= n.end)
      return false;
    n.whole = false;
    rest = rest.substr(close + 2);
  }
  if (rest.empty() || rest[0] == ' ' || rest[0] == '[') return false;
  n.kind = rest;
  *out = std::move(n);
  return true;
}

StateResharder::StateResharder(std::map<std::string, uint64_t> params)
    : params_(std::move(params)) {}

void StateResharder::want(const std::string& name, uint64_t numel) {
  StateName at;
  if (!parse_state_name(name, &at) || !params_.count(at.param))
    throw std::invalid_argument("StateResharder: '" + name +
                                "' is no optimizer state of a parameter");
  if (at.whole) at.end = params_.at(at.param);
  if (at.end > params_.at(at.param) || at.end - at.begin != numel || by_name_.count(name))
    throw std::invalid_argument("StateResharder: '" + name + "' of " + std::to_string(numel) +
                                " elements does not fit its parameter, or is wanted twice");
  by_name_[name] = wanted_.size();
  by_param_kind_[{at.param, at.kind}].push_back(wanted_.size());
  wanted_.push_back({name, at, std::vector<uint8_t>(numel * sizeof(float)), {}});
}

void StateResharder::take(const std::string& name, const std::vector<uint8_t>& bytes,
                          const std::string& file) {
  StateName at;
  if (!parse_state_name(name, &at) || !params_.count(at.param))
    throw ConfigError(file + ": tensor '" + name +
                      "' is neither a parameter of this model nor optimizer state of one");
  const uint64_t numel = params_.at(at.param);
  if (at.whole) at.end = numel;
  if (at.end > numel)
    throw ConfigError(file + ": tensor '" + name + "' covers elements " +
                      range_str(at.begin, at.end) + " of '" + at.param + "', which has " +
                      std::to_string(numel));
  if (bytes.size() != (at.end - at.begin) * sizeof(float))
    throw ConfigError(file + ": tensor '" + name + "' has " + std::to_string(bytes.size()) +
                      " bytes; its " + std::to_string(at.end - at.begin) + " elements are " +
                      std::to_string((at.end - at.begin) * sizeof(float)));
  const auto it = by_param_kind_.find({at.param, at.kind});
  if (it == by_param_kind_.end()) return;
  for (const size_t i : it->second) {
    Wanted& w = wanted_[i];
    const uint64_t a = std::max(at.begin, w.at.begin), b = std::min(at.end, w.at.end);
    if (a >= b) continue;
    std::memcpy(w.bytes.data() + (a - w.at.begin) * sizeof(float),
                bytes.data() + (a - at.begin) * sizeof(float), (b - a) * sizeof(float));
    w.given.push_back({a, b});
  }
}

void StateResharder::check(const std::string& what) const {
  for (const Wanted& w : wanted_) {
    std::vector<std::pair<uint64_t, uint64_t>> given = w.given;
    std::sort(given.begin(), given.end());
    uint64_t at = w.at.begin;
    const std::string of = " of '" + w.at.param + "' (" + w.at.kind + ")";
    for (const auto& [a, b] : given) {
      if (a < at)
        throw ConfigError(what + " has optimizer state for elements " +
                          range_str(a, std::min(at, b)) + of + " twice");
      if (a > at)
        throw ConfigError(what + " has no optimizer state for elements " + range_str(at, a) + of);
      at = b;
    }
    if (at < w.at.end)
      throw ConfigError(what + " has no optimizer state for elements " + range_str(at, w.at.end) +
                        of);
  }
}

const std::vector<uint8_t>& StateResharder::bytes(const std::string& name) const {
  return wanted_.at(by_name_.at(name)).bytes;
}

// ---------------------------------------------------------------------------------------------
// Reading

SnapshotData read_snapshot(const std::string& file) {
  auto bad = [&](const std::string& what) { return ConfigError("snapshot " + file + ": " + what); };
  std::error_code ec;
  if (fs::is_directory(file, ec)) throw bad("is a folder, not a snapshot file");
  std::ifstream in(file, std::ios::binary);
  if (!in) throw bad(std::string("cannot open: ") + std::strerror(errno));
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                                   std::istreambuf_iterator<char>());
  if (in.bad()) throw bad(std::string("read failed: ") + std::strerror(errno));
  SnapshotData d = parse_snapshot(bytes.data(), bytes.size(), file);
  const int64_t named = step_of_name(fs::path(file).filename().string());
  if (named >= 0 && named != d.step)
    throw bad("holds step " + std::to_string(d.step) + " but its name says step " +
              std::to_string(named) + " (was it renamed?)");
  return d;
}

SnapshotData read_newest_snapshot(const std::string& dir, std::string* path) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw ConfigError("--resume " + dir + ": not a folder of snapshots");
  for (const fs::path& p : snapshots_in(dir)) {
    try {
      SnapshotData d = read_snapshot(p.string());
      // A snapshot of W ranks is complete with every rank's part, each whole (rank 0 writes the
      // replicated file after all of them, but a part can go missing or be cut short later).
      const int world = snapshot_world_size(d.data_state);
      for (int q = 0; world > 1 && q < world; ++q) {
        try {
          read_rank_part(dir, d.step, q, world);
        } catch (const ConfigError& e) {
          throw ConfigError("snapshot " + p.string() + ": incomplete: " + e.what());
        }
      }
      if (path) *path = p.string();
      return d;
    } catch (const ConfigError& e) {
      // Every rank reads the same folder and skips alike; rank 0 says so.
      if (rank_info().rank == 0)
        std::fprintf(stderr, "headroom: warning: skipping %s; trying the one before it\n",
                     e.what());
    }
  }
  throw ConfigError("--resume " + dir + ": no complete snapshot in it (files step_*.hrsnap)");
}

}  // namespace headroom
