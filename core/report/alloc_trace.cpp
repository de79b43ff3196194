#include "core/report/alloc_trace.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <istream>
#include <set>
#include <stdexcept>

#include "core/plugin_host/plugin_host.h"

#ifndef HEADROOM_VERSION
#define HEADROOM_VERSION "unknown"
#endif

namespace headroom {

namespace {

constexpr const char* kMagic = "headroom-alloc-trace";
constexpr int kFormat = 1;

bool parse_u64(const std::string& s, uint64_t* out) {
  if (s.empty()) return false;
  const char* end = s.data() + s.size();
  auto [p, ec] = std::from_chars(s.data(), end, *out);
  return ec == std::errc() && p == end;
}

bool parse_category(const std::string& s, Category* out) {
  for (int i = 0; i < kNumCategories; ++i)
    if (s == category_name(category_at(i))) {
      *out = category_at(i);
      return true;
    }
  return false;
}

std::string valid_categories() {
  std::string v;
  for (int i = 0; i < kNumCategories; ++i)
    v += (i ? ", " : "") + std::string(category_name(category_at(i)));
  return v;
}

std::vector<std::string> split(const std::string& line) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i <= line.size()) {
    const size_t j = std::min(line.find(' ', i), line.size());
    out.push_back(line.substr(i, j - i));
    i = j + 1;
  }
  return out;
}

}  // namespace

const char* headroom_version() {
  return HEADROOM_VERSION;
}

uint64_t AllocTrace::num_allocs() const {
  return uint64_t(std::count_if(records.begin(), records.end(), [](const TraceRecord& r) {
    return r.op == TraceRecord::Op::kAlloc;
  }));
}

uint64_t AllocTrace::num_frees() const {
  return records.size() - num_allocs();
}

// ---------------------------------------------------------------------------------------------
// Reading

AllocTrace read_alloc_trace(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw ConfigError(path +
                      ": is a folder, not an allocation trace file (give the file that "
                      "train --record-allocs wrote)");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(path + ": cannot open the allocation trace: " + std::strerror(errno));
  return parse_alloc_trace(in, path);
}

AllocTrace parse_alloc_trace(std::istream& in, const std::string& name) {
  AllocTrace t;
  t.file = name;
  t.phases.push_back("");
  int lineno = 0;
  auto fail = [&](const std::string& what) {
    return ConfigError(name + ":" + std::to_string(lineno) + ": " + what);
  };

  struct Live {
    uint64_t bytes;
    Category category;
  };
  std::unordered_map<uint64_t, Live> live;
  bool header = false, ended = false;
  const std::string max_bytes = std::to_string(kMaxTraceBytes);
  uint64_t allocs = 0, frees = 0;
  std::string line;
  while (std::getline(in, line)) {
    ++lineno;
    // getline stops at end of file without a newline only when the writer was cut off.
    if (in.eof())
      throw fail("truncated: the last line has no newline (was the recording cut off?)");
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!header) {
      const std::vector<std::string> f = split(line);
      if (f.size() < 2 || f[0] != kMagic)
        throw fail("not an allocation trace: the first line must start with '" +
                   std::string(kMagic) + " " + std::to_string(kFormat) + "'");
      uint64_t format = 0;
      if (!parse_u64(f[1], &format) || format != uint64_t(kFormat))
        throw fail("trace format '" + f[1] + "' is not one this headroom reads (" +
                   std::to_string(kFormat) + ")");
      std::set<std::string> seen;
      size_t at = f[0].size() + 1 + f[1].size() + 1;  // where f[i] starts in the line
      for (size_t i = 2; i < f.size(); at += f[i].size() + 1, ++i) {
        const size_t eq = f[i].find('=');
        const std::string key = f[i].substr(0, eq),
                          value = eq == std::string::npos ? "" : f[i].substr(eq + 1);
        if (eq == std::string::npos) throw fail("header field '" + f[i] + "' is not key=value");
        if (!seen.insert(key).second) throw fail("header field '" + key + "' appears twice");
        if (key == "memory_limit") {
          if (!parse_u64(value, &t.memory_limit))
            throw fail("memory_limit '" + value + "' is not a byte count");
          if (t.memory_limit > kMaxTraceBytes)
            throw fail("memory_limit " + value + " is out of range: at most " + max_bytes +
                       " bytes (256 TiB)");
        } else if (key == "device") {
          if (value.empty()) throw fail("header field device= is empty");
          t.device = value;
        } else if (key == "version") {
          // The rest of the line: a version string may hold spaces.
          t.version = line.substr(at + 8);
          break;
        } else {
          throw fail("unknown header field '" + key + "'; valid: memory_limit, device, version");
        }
      }
      header = true;
      continue;
    }
    if (line.empty() || line[0] == '#') continue;
    if (ended) throw fail("a record after the end line (E)");
    const char op = line[0];
    if (line.size() < 2 || line[1] != ' ') throw fail("bad record '" + line + "'");
    if (op == 'P') {
      t.phases.push_back(line.substr(2));
      continue;
    }
    const std::vector<std::string> f = split(line);
    if (op == 'E') {
      uint64_t n[3];
      if (f.size() != 4 || !parse_u64(f[1], &n[0]) || !parse_u64(f[2], &n[1]) ||
          !parse_u64(f[3], &n[2]))
        throw fail("bad end line '" + line + "'; expected 'E <records> <allocs> <frees>'");
      if (n[0] != t.records.size() || n[1] != allocs || n[2] != frees)
        throw fail("the end line counts " + f[1] + " records (" + f[2] + " allocations, " + f[3] +
                   " frees) but the file holds " + std::to_string(t.records.size()) + " (" +
                   std::to_string(allocs) + ", " + std::to_string(frees) + ")");
      ended = true;
      continue;
    }
    if (op != 'A' && op != 'F')
      throw fail("unknown record type '" + std::string(1, op) + "'; valid: P, A, F, E");
    TraceRecord r;
    r.op = op == 'A' ? TraceRecord::Op::kAlloc : TraceRecord::Op::kFree;
    r.line = lineno;
    r.phase = uint32_t(t.phases.size() - 1);
    uint64_t stream = 0;
    if (f.size() != 6 || !parse_u64(f[1], &r.seq) || !parse_u64(f[2], &r.id) ||
        !parse_u64(f[3], &r.bytes) || !parse_u64(f[5], &stream))
      throw fail("bad record '" + line + "'; expected '" + std::string(1, op) +
                 " <seq> <id> <bytes> <category> <stream>'");
    if (!parse_category(f[4], &r.category))
      throw fail("unknown category '" + f[4] + "'; valid: " + valid_categories());
    if (stream > UINT32_MAX) throw fail("stream " + f[5] + " is out of range");
    r.stream = uint32_t(stream);
    if (r.seq != t.records.size())
      throw fail("seq " + f[1] + " out of order: expected " + std::to_string(t.records.size()));
    if (r.bytes > kMaxTraceBytes)
      throw fail(std::string(r.op == TraceRecord::Op::kAlloc ? "an allocation" : "a free") +
                 " of " + f[3] + " bytes is out of range: no device holds more than " + max_bytes +
                 " bytes (256 TiB), so no run can have recorded it");
    if (r.op == TraceRecord::Op::kAlloc) {
      if (r.id == 0) throw fail("allocation id 0: ids start at 1");
      if (r.id != allocs + 1)
        throw fail("allocation id " + f[2] + " out of order: expected " +
                   std::to_string(allocs + 1) + " (the n-th allocation has id n)");
      live.emplace(r.id, Live{r.bytes, r.category});
      ++allocs;
    } else {
      const auto it = live.find(r.id);
      if (it == live.end()) throw fail("free of id " + f[2] + ", which is not live");
      if (it->second.bytes != r.bytes || it->second.category != r.category)
        throw fail("free of id " + f[2] + " as " + f[3] + " bytes of " + f[4] +
                   "; it was allocated as " + std::to_string(it->second.bytes) + " bytes of " +
                   category_name(it->second.category));
      live.erase(it);
      ++frees;
    }
    t.records.push_back(r);
  }
  if (in.bad()) throw fail(std::string("read failed: ") + std::strerror(errno));
  if (!header) {
    lineno = 1;
    throw fail("empty file: not an allocation trace");
  }
  if (!ended)
    throw fail("truncated: no end line (E) after the last record (was the recording cut off?)");
  return t;
}

// ---------------------------------------------------------------------------------------------
// Recording

namespace {

const std::string& checked_output(const std::string& path) {
  check_output_path(path, "--record-allocs");
  return path;
}

}  // namespace

AllocTraceRecorder::AllocTraceRecorder(const std::string& path, const Device& device,
                                       uint64_t memory_limit)
    : path_(checked_output(path)), out_(path, "--record-allocs"), device_(device) {
  put(std::string(kMagic) + ' ' + std::to_string(kFormat) +
      " memory_limit=" + std::to_string(memory_limit) + " device=" + device.kind() +
      " version=headroom " + headroom_version() + '\n');
}

AllocTraceRecorder::~AllocTraceRecorder() {
  try {
    close();
  } catch (const std::exception&) {
    // Silent: call close() to hear of it. The file has no E line, so it is refused when read.
  }
}

void AllocTraceRecorder::put(const std::string& text) {
  if (closed_ || !error_.empty()) return;
  try {
    out_.write(text);
  } catch (const OutputError& e) {
    error_ = e.what();
  }
}

void AllocTraceRecorder::check() const {
  if (!error_.empty()) throw OutputError(error_);
}

void AllocTraceRecorder::put_comment(const std::string& text) {
  size_t i = 0;
  // One '#' line per line of text, so a note can never be read as a record.
  while (i <= text.size()) {
    const size_t j = std::min(text.find('\n', i), text.size());
    put("# " + text.substr(i, j - i) + '\n');
    i = j + 1;
  }
}

void AllocTraceRecorder::comment(const std::string& text) {
  put_comment(text);
  check();
}

void AllocTraceRecorder::flush() {
  check();
  if (closed_) return;
  try {
    out_.flush();
  } catch (const OutputError& e) {
    error_ = e.what();
    throw;
  }
}

void AllocTraceRecorder::close() {
  if (closed_) return;
  char line[96];
  std::snprintf(line, sizeof line, "E %" PRIu64 " %" PRIu64 " %" PRIu64 "\n", seq_, allocs_,
                frees_);
  put(line);
  closed_ = true;
  ids_.clear();
  if (error_.empty()) {
    try {
      out_.close();
    } catch (const OutputError& e) {
      error_ = e.what();
    }
  }
  check();
}

void AllocTraceRecorder::write_phase() {
  // Only when the phase changes: the phase string is most of a record's size otherwise.
  std::string p = device_.tracker().phase().str();
  if (phase_written_ && p == phase_) return;
  put("P " + p + '\n');
  phase_ = std::move(p);
  phase_written_ = true;
}

void AllocTraceRecorder::on_alloc(const void* ptr, uint64_t bytes, Category category,
                                  const std::string&) {
  if (closed_) return;
  write_phase();
  const uint64_t id = next_id_++;
  ids_[ptr] = id;
  char line[128];
  std::snprintf(line, sizeof line, "A %" PRIu64 " %" PRIu64 " %" PRIu64 " %s 0\n", seq_++, id,
                bytes, category_name(category));
  put(line);
  ++allocs_;
}

void AllocTraceRecorder::on_free(const void* ptr, uint64_t bytes, Category category) {
  if (closed_) return;
  const auto it = ids_.find(ptr);
  if (it == ids_.end()) return;  // allocated before the recorder was registered
  write_phase();
  char line[128];
  std::snprintf(line, sizeof line, "F %" PRIu64 " %" PRIu64 " %" PRIu64 " %s 0\n", seq_++,
                it->second, bytes, category_name(category));
  put(line);
  ids_.erase(it);
  ++frees_;
}

void AllocTraceRecorder::on_oom(const OomReport& report) {
  if (closed_) return;
  write_phase();
  put_comment("out of memory: " + std::to_string(report.requested) + " bytes of " +
              category_name(report.category) + " (" + report.what + ") with " +
              std::to_string(report.live_total) + " bytes live");
}

// ---------------------------------------------------------------------------------------------
// Replay

namespace {

double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

// One replay on a fresh device and allocator. `slots` maps each record to a dense index of the
// live-buffer table, so the timed loop does no hashing of its own.
struct Pass {
  const AllocTrace& trace;
  const Config& config;
  const std::vector<uint32_t>& slots;
  uint32_t num_slots;

  ReplayResult run(bool measure) const {
    DeviceConfig dc = config.device;
    if (dc.memory_limit == 0) dc.memory_limit = trace.memory_limit;
    ReplayResult r;
    r.memory_limit = dc.memory_limit;
    // The device outlives the plugin host, which hands the allocator back to it on destruction.
    std::unique_ptr<Device> device = Device::create(dc);
    std::unique_ptr<PluginHost> host;
    if (!config.plugins.empty()) {
      host = std::make_unique<PluginHost>(config);
      host->create(modeless_run(*device));  // a replay has a device and no model
      r.allocator.clear();
      for (const PluginEntry& e : config.plugins)
        r.allocator += (r.allocator.empty() ? "" : ", ") + e.name;
    }
    auto reserved_now = [&]() -> uint64_t {
      hr_allocator_stats s;
      if (host && host->allocator_stats(&s)) return s.reserved;
      const Device::BackendStats b = device->backend_stats();
      // A backend without accounting (plain malloc) holds exactly what is live.
      return b.capacity || b.used ? b.used : device->tracker().live_total();
    };

    std::vector<void*> ptrs(num_slots, nullptr);
    const std::string what = "replayed allocation";
    const double t0 = now_s();
    size_t i = 0;
    bool failed = false;
    try {
      for (; i < trace.records.size(); ++i) {
        const TraceRecord& rec = trace.records[i];
        if (rec.op == TraceRecord::Op::kAlloc) {
          // More than the whole memory cannot fit, whatever the allocator answers: the request
          // fails without reaching it (as a device would refuse it).
          if (dc.memory_limit > 0 && rec.bytes > dc.memory_limit) {
            failed = true;
            break;
          }
          ptrs[slots[i]] = device->allocate(rec.bytes, rec.category, what);
          ++r.allocations;
          if (measure) {
            const uint64_t reserved = reserved_now();
            if (reserved > r.peak_reserved) {
              r.peak_reserved = reserved;
              r.live_at_peak_reserved = device->tracker().live_total();
            }
          }
        } else {
          device->free(ptrs[slots[i]]);
          ptrs[slots[i]] = nullptr;
          ++r.frees;
        }
      }
    } catch (const OutOfMemory&) {
      failed = true;
    }
    if (failed) {
      r.seconds = now_s() - t0;
      const TraceRecord& rec = trace.records[i];
      r.failed = true;
      ReplayFailure& f = r.failure;
      f.seq = rec.seq;
      f.id = rec.id;
      f.requested = rec.bytes;
      f.category = rec.category;
      f.phase = trace.phases[rec.phase];
      f.live = device->tracker().live_total();
      f.reserved = reserved_now();
      f.free = dc.memory_limit > f.reserved ? dc.memory_limit - f.reserved : 0;
      const Device::BackendStats b = device->backend_stats();
      f.largest_free = b.capacity || b.used ? b.largest_free : f.free;
      hr_allocator_stats s;
      if (host && host->allocator_stats(&s)) f.allocator_largest_free = s.largest_free_block;
    }
    if (!r.failed) r.seconds = now_s() - t0;
    r.peak_live = device->tracker().peak_total();
    if (r.peak_reserved > 0)
      r.fragmentation =
          double(r.peak_reserved - std::min(r.peak_reserved, r.live_at_peak_reserved)) /
          double(r.peak_reserved);
    for (void* p : ptrs)
      if (p) device->free(p);
    host.reset();
    return r;
  }
};

}  // namespace

ReplayResult replay_alloc_trace(const AllocTrace& trace, const Config& config,
                                const ReplayOptions& options) {
  std::vector<uint32_t> slots(trace.records.size());
  std::unordered_map<uint64_t, uint32_t> slot_of_id;
  std::vector<uint32_t> free_slots;
  uint32_t num_slots = 0;
  for (size_t i = 0; i < trace.records.size(); ++i) {
    const TraceRecord& rec = trace.records[i];
    if (rec.op == TraceRecord::Op::kAlloc) {
      uint32_t s;
      if (free_slots.empty()) {
        s = num_slots++;
      } else {
        s = free_slots.back();
        free_slots.pop_back();
      }
      slot_of_id[rec.id] = s;
      slots[i] = s;
    } else {
      const auto it = slot_of_id.find(rec.id);
      if (it == slot_of_id.end())
        throw ConfigError(trace.file + ":" + std::to_string(rec.line) + ": free of id " +
                          std::to_string(rec.id) + ", which is not live");
      slots[i] = it->second;
      free_slots.push_back(it->second);
      slot_of_id.erase(it);
    }
  }
  const Pass pass{trace, config, slots, num_slots};
  ReplayResult result = pass.run(true);
  if (!options.timed) {
    result.seconds = 0;  // the measuring pass's time is not the allocator's
    return result;
  }
  // The timed passes: no statistics calls. Repeated until the timing is long enough to trust.
  double seconds = 0.0;
  uint64_t allocations = 0;
  for (int rep = 0; rep < 1000 && (rep == 0 || seconds < options.min_timed_seconds); ++rep) {
    const ReplayResult timed = pass.run(false);
    seconds += timed.seconds;
    allocations += timed.allocations;
  }
  result.seconds = seconds;
  result.allocs_per_s = seconds > 0 ? double(allocations) / seconds : 0.0;
  return result;
}

std::string ReplayResult::str() const {
  std::string s;
  char line[320];
  auto add = [&](const char* label, const std::string& value) {
    std::snprintf(line, sizeof line, "  %-22s %s\n", label, value.c_str());
    s += line;
  };
  add("allocator", allocator);
  add("memory_limit", memory_limit ? format_bytes(memory_limit) : "none");
  add("allocations", std::to_string(allocations) + " (frees " + std::to_string(frees) + ")");
  add("peak live", format_bytes(peak_live) + " (" + std::to_string(peak_live) + " bytes)");
  add("peak reserved",
      format_bytes(peak_reserved) + " (" + std::to_string(peak_reserved) + " bytes)");
  std::snprintf(
      line, sizeof line, "%.2f%% (%s reserved but unused at the peak)", 100.0 * fragmentation,
      format_bytes(peak_reserved - std::min(peak_reserved, live_at_peak_reserved)).c_str());
  add("fragmentation", line);
  if (seconds > 0) {
    std::snprintf(line, sizeof line, "%.3g allocations/s (the replay's own calls, %.3g s)",
                  allocs_per_s, seconds);
    add("speed", line);
  }
  if (failed) {
    const ReplayFailure& f = failure;
    s += "  FAILED at seq " + std::to_string(f.seq) + " (id " + std::to_string(f.id) +
         "): " + format_bytes(f.requested) + " (" + std::to_string(f.requested) + " bytes) of " +
         category_name(f.category) + (f.phase.empty() ? "" : ", in " + f.phase) + "\n";
    add("  live", format_bytes(f.live));
    add("  reserved", format_bytes(f.reserved));
    add("  free", format_bytes(f.free) + " (" + std::to_string(f.free) + " bytes)");
    add("  largest free block",
        format_bytes(f.largest_free) + " (" + std::to_string(f.largest_free) + " bytes)");
    if (f.allocator_largest_free)
      add("  allocator's largest", format_bytes(f.allocator_largest_free));
    if (f.free > 0) {
      std::snprintf(line, sizeof line, "%.1f%% of the free bytes",
                    100.0 * (1.0 - double(std::min(f.largest_free, f.free)) / double(f.free)));
      add("  outside that block", line);
    }
    if (f.requested <= f.free && f.largest_free < f.requested)
      s += "  enough bytes were free, but in pieces: the free space is fragmented\n";
  }
  return s;
}

}  // namespace headroom
