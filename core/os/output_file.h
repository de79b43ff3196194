// Every file headroom writes goes through one of two writers, so that no output can fail silently
// or be left half written:
//
// - AtomicFile: a file that appears whole or not at all (weights, snapshots, the timeline,
//   shards). Bytes go to a temporary beside the target; commit() syncs it, renames it over the
//   target and syncs the folder. Destroyed without commit(), the temporary is removed and the
//   target is untouched. A target that exists and is not a regular file (/dev/null, a pipe) is
//   written in place instead.
// - AppendFile: a file written as the run goes (metrics, the allocation trace), one whole record
//   (whole lines) per write(). Every write is checked; flush() and close() report what the OS
//   said, and a write the disk took only part of is cut off again (the file is truncated back to
//   the records written before it), so the file always ends on a whole record.
//
// Both throw OutputError naming the file, what it is for and the OS's reason ("No space left on
// device"). The host turns it into exit code 4.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace headroom {

class OutputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class AtomicFile {
 public:
  // `what` names the output in messages: "--save-weights", "snapshot", ...
  AtomicFile(std::string path, std::string what);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t bytes);
  void write(std::string_view text) { write(text.data(), text.size()); }
  // Overwrites bytes already written (a header whose count is known only at the end).
  void write_at(uint64_t offset, const void* data, size_t bytes);
  // Syncs, renames over the target, syncs the folder. After it, the file is the target's.
  void commit();

  const std::string& path() const { return path_; }

 private:
  [[noreturn]] void fail(const std::string& doing) const;

  std::string path_, what_;
  std::string tmp_;  // "" when written in place
  int fd_ = -1;
};

class AppendFile {
 public:
  // Creates (truncates) `path`.
  AppendFile(std::string path, std::string what);
  // Closes; a failure to close here goes unreported: call close() to hear of it.
  ~AppendFile();
  AppendFile(const AppendFile&) = delete;
  AppendFile& operator=(const AppendFile&) = delete;

  // One whole record. Buffered; a full buffer is written at once.
  void write(std::string_view text);
  // Hands everything buffered to the OS.
  void flush();
  // flush(), fsync and close; the file is complete after it.
  void close();
  bool is_open() const { return fd_ >= 0; }

 private:
  [[noreturn]] void fail(const std::string& doing);
  // Truncates the file to whole_bytes_ after a failed write.
  void cut_to_whole_records();

  std::string path_, what_;
  std::string buffer_;
  int fd_ = -1;
  bool regular_ = false;      // a regular file (one that can be truncated)
  uint64_t whole_bytes_ = 0;  // the file's bytes: whole records, every one written in full
};

// One run per output. A run holds an advisory lock (flock) on every output it owns for its whole
// life: a lock file beside the output, ".NAME.lock" in the output's folder (beside a folder for a
// folder output: a snapshot dir), holding the holder's pid. A second run that would write the same
// file or folder is refused before it writes a byte (its outputs truncated, its snapshots pruning
// the other's), naming the holder. An output that is not a regular file or folder (/dev/null, a
// pipe) is not locked: nothing there can be lost. The lock file is removed when the lock goes; one
// a killed run left behind is taken over (the kernel released its lock).
class OutputLock {
 public:
  // ConfigError "WHAT PATH: another headroom run (pid N) is writing it ..." when another run (or
  // another output of this one) holds it.
  OutputLock(const std::string& path, const std::string& what);
  ~OutputLock();
  OutputLock(OutputLock&& other) noexcept;
  OutputLock& operator=(OutputLock&& other) noexcept;
  OutputLock(const OutputLock&) = delete;
  OutputLock& operator=(const OutputLock&) = delete;

  // The lock file; "" when the output is not locked (not a regular file or folder).
  const std::string& lock_path() const { return lock_; }

 private:
  void release() noexcept;
  std::string lock_;
  int fd_ = -1;
};

// Checks, before any work is done, that `path` can be created: its folder exists and is a folder,
// and `path` is not a folder. Throws ConfigError "WHAT PATH: why" otherwise. Creates nothing.
void check_output_path(const std::string& path, const std::string& what);

// Creates `dir` (and its parents) now, so that a folder that cannot be made fails before step 1.
// Throws ConfigError "WHAT DIR: why".
void make_output_dir(const std::string& dir, const std::string& what);

}  // namespace headroom
