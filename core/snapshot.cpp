#include "core/snapshot.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <thread>

#include "core/config.h"

namespace headroom {

namespace fs = std::filesystem;

namespace {

constexpr char kMagic[8] = {'H', 'R', 'S', 'N', 'A', 'P', '0', '1'};
constexpr const char* kSuffix = ".hrsnap";

// FNV-1a over the payload: catches a file cut short or damaged, which rename alone cannot
// rule out on every filesystem after a crash.
uint64_t fnv1a(const uint8_t* p, size_t n, uint64_t h = 1469598103934665603ull) {
  for (size_t i = 0; i < n; ++i)
    h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

std::string step_name(int64_t step) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "step_%012lld%s", static_cast<long long>(step), kSuffix);
  return buf;
}

[[noreturn]] void fail(const std::string& what) {
  throw std::runtime_error("snapshot: " + what + ": " + std::strerror(errno));
}

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  // Test hook: HEADROOM_SNAPSHOT_WRITE_DELAY_MS slows writing down so that a test can kill the
  // process while a snapshot is half written.
  static const long delay_ms = [] {
    const char* v = std::getenv("HEADROOM_SNAPSHOT_WRITE_DELAY_MS");
    return v ? std::atol(v) : 0L;
  }();
  const uint8_t* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const size_t chunk = delay_ms > 0 ? std::min<size_t>(n, 4096) : n;
    const ssize_t w = ::write(fd, p, chunk);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("writing " + path);
    }
    p += w;
    n -= size_t(w);
    if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
  }
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) fail("opening " + dir);
  if (::fsync(fd) != 0) {
    ::close(fd);
    fail("syncing " + dir);
  }
  ::close(fd);
}

// Snapshots in dir, newest first.
std::vector<fs::path> snapshots_in(const std::string& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) == 0 && e.path().extension() == kSuffix) out.push_back(e.path());
  }
  std::sort(out.rbegin(), out.rend());  // zero-padded step numbers sort as numbers
  return out;
}

}  // namespace

std::string write_snapshot(const std::string& dir, const SnapshotData& d, int keep) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw std::runtime_error("snapshot: cannot create " + dir + ": " + ec.message());

  // Manifest: where each tensor and plugin state sits in the payload.
  nlohmann::json m;
  m["step"] = d.step;
  m["skipped_steps"] = d.skipped_steps;
  m["data_state"] = d.data_state;
  m["model"] = d.model;
  m["optimizer"] = d.optimizer;
  uint64_t offset = 0, checksum = 1469598103934665603ull;
  auto place = [&](const std::map<std::string, std::vector<uint8_t>>& items) {
    nlohmann::json list = nlohmann::json::array();
    for (const auto& [name, bytes] : items) {
      list.push_back({{"name", name}, {"offset", offset}, {"bytes", bytes.size()}});
      offset += bytes.size();
      checksum = fnv1a(bytes.data(), bytes.size(), checksum);
    }
    return list;
  };
  m["tensors"] = place(d.tensors);
  m["plugins"] = place(d.plugins);
  m["payload_bytes"] = offset;
  m["checksum"] = checksum;
  const std::string manifest = m.dump();
  const uint64_t manifest_len = manifest.size();

  const std::string final_path = (fs::path(dir) / step_name(d.step)).string();
  const std::string tmp_path = (fs::path(dir) / ("." + step_name(d.step) + ".tmp")).string();
  const int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("creating " + tmp_path);
  try {
    write_all(fd, kMagic, sizeof kMagic, tmp_path);
    write_all(fd, &manifest_len, sizeof manifest_len, tmp_path);
    write_all(fd, manifest.data(), manifest.size(), tmp_path);
    for (const auto* items : {&d.tensors, &d.plugins})
      for (const auto& [name, bytes] : *items)
        write_all(fd, bytes.data(), bytes.size(), tmp_path);
    if (::fsync(fd) != 0) fail("syncing " + tmp_path);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp_path.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp_path.c_str(), final_path.c_str()) != 0) fail("renaming " + tmp_path);
  fsync_dir(dir);

  const std::vector<fs::path> all = snapshots_in(dir);
  for (size_t i = size_t(std::max(keep, 1)); i < all.size(); ++i) {
    fs::remove(all[i], ec);
    fs::remove(fs::path(all[i]).replace_extension(".safetensors"), ec);  // save_weights' copy
  }
  return final_path;
}

SnapshotData read_snapshot(const std::string& file) {
  auto bad = [&](const std::string& what) { return ConfigError("snapshot " + file + ": " + what); };
  std::ifstream in(file, std::ios::binary);
  if (!in) throw bad(std::string("cannot open: ") + std::strerror(errno));
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                                   std::istreambuf_iterator<char>());
  if (bytes.size() < 16 || std::memcmp(bytes.data(), kMagic, 8) != 0)
    throw bad("not a headroom snapshot (bad magic)");
  uint64_t manifest_len = 0;
  std::memcpy(&manifest_len, bytes.data() + 8, 8);
  if (manifest_len > bytes.size() - 16) throw bad("truncated manifest");
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(bytes.begin() + 16, bytes.begin() + 16 + long(manifest_len));
  } catch (const std::exception& e) {
    throw bad(std::string("bad manifest: ") + e.what());
  }
  const uint64_t payload_at = 16 + manifest_len;
  SnapshotData d;
  try {
    const uint64_t payload = m.at("payload_bytes").get<uint64_t>();
    if (payload != bytes.size() - payload_at)
      throw bad("truncated: " + std::to_string(bytes.size() - payload_at) + " of " +
                std::to_string(payload) + " payload bytes");
    if (fnv1a(bytes.data() + payload_at, payload) != m.at("checksum").get<uint64_t>())
      throw bad("checksum mismatch: the file is damaged");
    d.step = m.at("step").get<int64_t>();
    d.skipped_steps = m.at("skipped_steps").get<int64_t>();
    d.data_state = m.at("data_state").get<std::string>();
    d.model = m.at("model").get<std::string>();
    d.optimizer = m.at("optimizer").get<std::string>();
    auto take = [&](const nlohmann::json& list, std::map<std::string, std::vector<uint8_t>>& out) {
      for (const auto& e : list) {
        const uint64_t off = e.at("offset").get<uint64_t>(), n = e.at("bytes").get<uint64_t>();
        if (off > payload || n > payload - off) throw bad("an entry lies outside the payload");
        const uint8_t* p = bytes.data() + payload_at + off;
        out[e.at("name").get<std::string>()] = std::vector<uint8_t>(p, p + n);
      }
    };
    take(m.at("tensors"), d.tensors);
    take(m.at("plugins"), d.plugins);
  } catch (const nlohmann::json::exception& e) {
    throw bad(std::string("bad manifest: ") + e.what());
  }
  return d;
}

SnapshotData read_newest_snapshot(const std::string& dir, std::string* path) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw ConfigError("--resume " + dir + ": not a folder of snapshots");
  for (const fs::path& p : snapshots_in(dir)) {
    try {
      SnapshotData d = read_snapshot(p.string());
      if (path) *path = p.string();
      return d;
    } catch (const ConfigError& e) {
      std::fprintf(stderr, "headroom: skipping %s\n", e.what());
    }
  }
  throw ConfigError("--resume " + dir + ": no complete snapshot in it (files step_*.hrsnap)");
}

}  // namespace headroom
