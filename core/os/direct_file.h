// A file of the NVMe tier (headroom.offload/1's HR_PLACE_NVME): made by this process, read and
// written in whole pages through io_uring, with O_DIRECT where the file system takes it, and
// removed again when the object goes (the end of the run, or any exit that unwinds).
//
// What lives in it is its user's: the optimizer's state (core/run/state_file.h) or the parameter
// shards of offloaded layers (core/shard/shard_file.h). Requests go in batches: a batch's requests
// run in order (each linked to the next), several batches may be in flight at once, and wait()
// returns when one batch is done whole; a request the kernel moved only part of is finished with
// plain pread/pwrite. An I/O error is an OutputError (exit 4) naming the file, the offset and the
// OS's reason; a full disk says that the snapshots written so far are intact.
//
// Training thread only.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

namespace headroom {

enum class DirectIo { kAuto, kOn, kOff };

// The unit of every request's length and offset, and of the buffers' alignment: O_DIRECT needs
// the file system's block, which is at most a page on the file systems that take it.
constexpr uint64_t kDirectPage = 4096;
inline uint64_t round_to_pages(uint64_t bytes) {
  return (bytes + kDirectPage - 1) / kDirectPage * kDirectPage;
}

// The name of the file system `dir` is on ("tmpfs", "ext4", "xfs", ..., else its magic number).
std::string file_system_name(const std::string& dir);
// Whether `dir` can hold a tier file: "" when it can, else what is wrong ("no such folder",
// "not writable: Permission denied", "... is on ramfs, which refuses O_DIRECT ..."). *direct:
// whether O_DIRECT will be used (kAuto: where the file system takes it). Probes with a small file
// it removes again.
std::string check_state_dir(const std::string& dir, DirectIo mode, bool* direct);

// A tier file's name, its folder checked: ConfigError (check_state_dir's message after `who`)
// when `dir` cannot hold it; with kAuto on a file system without O_DIRECT one line on `log` says
// that `what` in `dir` is read and written buffered. The name is
// dir/headroom-<pid>-<n>-rank<R>.<ext>: the pid, as two runs may share the folder, and n this
// process's count of tier files, as one process may hold two trainers (tests do). *direct:
// whether O_DIRECT is to be used.
std::string tier_file_path(const std::string& dir, DirectIo mode, int rank, const std::string& ext,
                           const std::string& what, const std::string& who, std::ostream* log,
                           bool* direct);

class DirectFile {
 public:
  struct Batch;
  // One request: `bytes` (whole pages) at file offset `offset` (a page's) from or to `data`
  // (page-aligned).
  struct Op {
    bool write;
    unsigned char* data;
    uint64_t bytes, offset;
    int64_t result = 0;      // the completion's: bytes moved, or -errno
    Batch* batch = nullptr;  // set by submit()
  };
  // Requests run in order; in flight from submit() to wait().
  struct Batch {
    std::vector<Op> ops;
    size_t in_flight = 0;
  };

  // Creates `path` (it must not exist); `what` names the file in messages ("optimizer state
  // file"). `ring_entries`: the most requests in flight at once. OutputError when it cannot.
  DirectFile(const std::string& path, bool direct, const std::string& what, unsigned ring_entries);
  ~DirectFile();  // closes and removes the file; waits for nothing (wait for every batch first)
  DirectFile(const DirectFile&) = delete;
  DirectFile& operator=(const DirectFile&) = delete;

  const std::string& path() const { return path_; }
  bool direct() const { return direct_; }
  int fd() const { return fd_; }
  // Gives [offset, offset + bytes) its blocks now (posix_fallocate): a disk that cannot hold
  // them fails here, OutputError naming the file and the bytes. `dry` (plan --measure): only the
  // size, no blocks.
  void allocate(uint64_t offset, uint64_t bytes, bool dry);

  // The batch's requests, in order; the batch must stay where it is until wait() returns.
  void submit(Batch& batch);
  // Until every request of `batch` completed (reaping others' completions on the way); throws
  // OutputError for one that failed.
  void wait(Batch& batch);

 private:
  struct Ring;
  // A completion (an io_uring_cqe) recorded in its request and batch, and seen.
  void reaped(void* completion);
  std::string path_, what_;
  bool direct_ = false;
  int fd_ = -1;
  std::unique_ptr<Ring> ring_;
  unsigned ring_entries_ = 0, in_ring_ = 0;  // requests submitted and not reaped
};

}  // namespace headroom
