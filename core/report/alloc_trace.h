// Allocation traces: every device allocation and free of a run, written as it happens, and their
// replay against a fresh device with the default allocator or an allocator plugin.
//
// A trace answers "would this run have fitted with another allocator?" without running the model:
// the sizes, order and categories of a run's buffers are what an allocator sees, so replaying them
// reproduces its peak, its fragmentation and its first failure exactly, thousands of times faster.
//
// File format (text, one record per line, fields separated by single spaces; version 1):
//
//   headroom-alloc-trace 1 memory_limit=<bytes> device=<kind> version=<headroom version...>
//   # a comment: any line starting with '#' (the recorder notes out-of-memory failures this way)
//   P <phase>                               the loop phase of the records that follow, e.g.
//                                           "backward of layer 3 (block 2), step 5, micro-step 1"
//   A <seq> <id> <bytes> <category> <stream>   an allocation
//   F <seq> <id> <bytes> <category> <stream>   a free of allocation <id> (bytes and category repeat
//                                              the allocation's, so a reader can check them)
//   E <records> <allocs> <frees>               the end: written when the recorder closes
//
// - The header is the first line. memory_limit is the run's [device] memory_limit (0 = none):
//   what a replay uses unless told otherwise. The version is the rest of the line (it may hold
//   spaces).
// - seq counts A and F records from 0 in file order; id numbers allocations from 1 in the order
//   they were made (the n-th A record has id n). A free names an id that is live at that point.
// - bytes is at most 2^48 (256 TiB), more than any device holds; 0 is a valid request. The
//   header's memory_limit is bounded the same way.
// - category is a category_name() ("parameters", "activations", ...); stream is the device stream
//   the buffer belongs to. A device allocates every buffer on its compute stream, written 0.
//   Replay keeps it in the records and allocates on the device's compute stream.
// - The E line makes truncation visible: a file without it (or with records after it, or with a
//   last line that has no newline) is refused. The recorder writes it in close(); records after
//   close() are not recorded.
// - Buffers still live at the end (a run that stopped, or one that never frees its parameters)
//   simply have no F record.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/config/config.h"
#include "core/device/device.h"
#include "core/device/memory.h"
#include "core/os/output_file.h"

namespace headroom {

struct TraceRecord {
  enum class Op : uint8_t { kAlloc, kFree };
  Op op = Op::kAlloc;
  uint64_t seq = 0;
  uint64_t id = 0;
  uint64_t bytes = 0;
  Category category = Category::kWorkspace;
  uint32_t stream = 0;
  uint32_t phase = 0;  // index into AllocTrace::phases
  int line = 0;        // where the record was in its file, for messages
};

struct AllocTrace {
  std::string file;  // where it was read from, for messages
  int format = 1;
  uint64_t memory_limit = 0;
  std::string device = "cpu";
  std::string version;              // the headroom that wrote it
  std::vector<std::string> phases;  // "" at index 0 for records before any P line
  std::vector<TraceRecord> records;

  uint64_t num_allocs() const;
  uint64_t num_frees() const;
};

// The headroom version a recorder writes into the header ("0.1.0").
const char* headroom_version();

// The largest allocation (and memory_limit) a trace may hold: 2^48 bytes, 256 TiB, more than any
// device has. A larger one cannot have been recorded: the file is refused.
constexpr uint64_t kMaxTraceBytes = kMaxDeviceBytes;

// Reads and checks a trace. Any malformed line — an unknown record type, a bad number or category,
// a number out of range, a seq or id out of order, a free of an id that is not live or that
// disagrees with its allocation, a missing or misplaced E line — is a ConfigError "FILE:LINE: what
// is wrong". A folder, or a file that cannot be read, is a ConfigError "FILE: why".
AllocTrace read_alloc_trace(const std::string& path);
// The same from text; `name` stands for the file in messages.
AllocTrace parse_alloc_trace(std::istream& in, const std::string& name);

// Writes every allocation and free of the device it observes, with the tracker's phase, as the
// format above, through an AppendFile. Register it on the device before the first allocation (ids
// of buffers allocated earlier are unknown to it: their frees are skipped).
//
// Errors: the observer calls (on_alloc, on_free, on_oom) never throw — a free runs in destructors
// and a plugin's allocation would swallow the error. The first write failure is kept, nothing more
// is written, and comment(), flush() and close() throw it: OutputError "--record-allocs PATH:
// write failed: No space left on device". Call flush() now and then (once a step) to hear of a
// full disk early, and close() at the end.
class AllocTraceRecorder final : public AllocationObserver {
 public:
  // Writes to `path`: ConfigError when its folder does not exist or it is a folder
  // (check_output_path), OutputError when it cannot be created. `memory_limit` is the value the
  // header records: the device's own limit, or the one a trace is meant to be replayed under.
  AllocTraceRecorder(const std::string& path, const Device& device, uint64_t memory_limit);
  // If close() was not called: writes the E line and closes, best effort and silently (a
  // destructor cannot report; a trace with a write failure gets no E line and is refused).
  ~AllocTraceRecorder() override;
  AllocTraceRecorder(const AllocTraceRecorder&) = delete;
  AllocTraceRecorder& operator=(const AllocTraceRecorder&) = delete;

  // Adds a '#' comment line (a note for the reader, e.g. the command that made the trace).
  // Throws OutputError for a write that failed, now or before.
  void comment(const std::string& text);
  // Hands what is written so far to the OS. Throws OutputError for a write that failed, now or
  // before. Does nothing after close().
  void flush();
  // Writes the E line, flushes, fsyncs and closes: the trace is complete. Throws OutputError for
  // a write that failed, now or before (the file then has no E line). Allocations and frees after
  // it are not recorded; a second close() does nothing.
  void close();

  uint64_t records() const { return seq_; }

  void on_alloc(const void* ptr, uint64_t bytes, Category category,
                const std::string& what) override;
  void on_free(const void* ptr, uint64_t bytes, Category category) override;
  void on_oom(const OomReport& report) override;

 private:
  void write_phase();
  // Buffers `text`; after a failure (kept in error_) or close(), does nothing. Never throws.
  void put(const std::string& text);
  void put_comment(const std::string& text);
  // Throws the kept failure, if any.
  void check() const;

  std::string path_;
  AppendFile out_;
  std::string error_;  // the first write failure's message
  bool closed_ = false;
  const Device& device_;
  std::string phase_;  // the last P line written
  bool phase_written_ = false;
  uint64_t seq_ = 0, next_id_ = 1, allocs_ = 0, frees_ = 0;
  std::unordered_map<const void*, uint64_t> ids_;
};

// The first request a replay could not serve.
struct ReplayFailure {
  uint64_t seq = 0;
  uint64_t id = 0;
  uint64_t requested = 0;
  Category category = Category::kWorkspace;
  std::string phase;
  uint64_t live = 0;      // bytes the trace had live just before (the tracker's count)
  uint64_t reserved = 0;  // bytes the allocator held from the backend then
  uint64_t free = 0;      // memory_limit - reserved: what was free in total
  // The largest contiguous free block of the backend, and (with an allocator plugin that keeps
  // statistics) the largest request the plugin could have served from its own pools.
  uint64_t largest_free = 0;
  uint64_t allocator_largest_free = 0;
};

struct ReplayResult {
  std::string allocator = "default";  // or the allocator plugin's name
  uint64_t memory_limit = 0;
  uint64_t allocations = 0;  // served
  uint64_t frees = 0;
  uint64_t peak_live = 0;  // the tracker's peak: the trace's own, allocator-independent
  // Bytes the allocator held from the backend at their highest (the allocator plugin's
  // reserved, else the backend's used; the live bytes when the backend keeps no count), and
  // the live bytes at that moment.
  uint64_t peak_reserved = 0;
  uint64_t live_at_peak_reserved = 0;
  // Reserved-but-unused at the peak over reserved at the peak.
  double fragmentation = 0.0;
  bool failed = false;
  ReplayFailure failure;
  double seconds = 0.0;  // the timed replays: allocation and free calls only (0: not timed)
  double allocs_per_s = 0.0;

  // The report `headroom replay` prints.
  std::string str() const;
};

struct ReplayOptions {
  // Time the replay (allocs_per_s): extra passes without the measuring calls, repeated until they
  // add up to min_timed_seconds. Off for callers that only want the figures (a limit scan).
  bool timed = true;
  double min_timed_seconds = 0.05;
};

// Replays the trace on a fresh device made from config.device — with the trace's memory_limit
// when config.device.memory_limit is 0 — and the allocator plugin config.plugins lists, if any
// (other plugins are created too but see no events). Stops at the first failed allocation. Runs
// once measuring (peak reserved, fragmentation) and then timed without the measuring calls, so
// allocs_per_s is the allocator's own speed. Buffers live at the end are freed.
// Throws ConfigError / PluginFailure as the plugin host does.
ReplayResult replay_alloc_trace(const AllocTrace& trace, const Config& config,
                                const ReplayOptions& options = {});

}  // namespace headroom
