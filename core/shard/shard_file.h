// The NVMe tier of offloaded parameters (headroom.offload/1 set_parameter_files, ZeRO-Infinity's
// offload_param "nvme"): the shards a sharded layer's gathering reads and nothing else writes
// between updates — its compute copy's (amp), its frozen weights', a quantized base's bytes —
// rest in one file per rank instead of the host ledger. The fp32 master and gradient shards,
// which the host optimizer updates in place, stay in the host ledger (core/shard/sharding.h).
//
// The file, dir/headroom-<pid>-<n>-rank<R>.params, holds one slot a layer (each part page-aligned,
// so O_DIRECT can take it), allocated on the disk as the model places each layer: a disk too small
// fails there, before step 1 (OutputError, exit 4). It is removed when the ShardFile goes (the
// end of the run, or any exit that unwinds).
//
// Every transfer goes through two host staging buffers (host ledger, category parameters), each as
// large as the largest slot plus a page for its alignment, with io_uring (core/os/direct_file.h):
// a gathering starts reading a layer's slot into a free one (start_read) and the layer's first
// use waits for it (wait) before uploading the rank's ranges from it, so the read of the
// layers zero3 prefetches runs while the ones before them compute; an update casts each layer's
// new compute shard into one and starts writing it back while the next is cast into the other.
//
// Training thread only.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "core/device/device.h"
#include "core/os/direct_file.h"

namespace headroom {

// The host staging a ShardFile holds for slots whose parts are `parts` bytes each (the largest
// slot's parts): two buffers, each the parts rounded up to a page and a page for the alignment.
// The closed form's (core/report/advice.cpp).
uint64_t shard_file_staging_bytes(const std::vector<uint64_t>& parts);

class ShardFile {
 public:
  // Checks `dir` (ConfigError: check_state_dir's message after `who`); opens nothing yet. `log`:
  // where the one line that says O_DIRECT is not used goes (kAuto on a file system without it).
  ShardFile(Device& host, const std::string& dir, DirectIo mode, int rank, const std::string& who,
            std::ostream* log);
  ShardFile(const ShardFile&) = delete;
  ShardFile& operator=(const ShardFile&) = delete;
  ~ShardFile();  // waits for the reads in flight (an error path's), then removes the file

  static constexpr int kStagings = 2;

  const std::string& path() const { return path_; }
  bool direct() const { return direct_; }
  uint64_t file_bytes() const { return file_bytes_; }

  // A new slot of parts of these sizes in bytes, its blocks allocated now (OutputError when the
  // disk cannot hold them); the stagings grow to hold it. Its number.
  size_t add_slot(const std::vector<uint64_t>& parts);
  // Part `part` of `slot` in staging buffer `b` (page-aligned): where a read puts it and a write
  // takes it from.
  void* staged(int b, size_t slot, size_t part);
  // The whole slot (or its part `part`) from the file into staging `b`, or part `part` from the
  // staging into the file, started: in flight until wait(b). One transfer a buffer at a time
  // (std::logic_error otherwise). Nothing moves in a dry run (plan --measure).
  void start_read(int b, size_t slot);
  void start_read(int b, size_t slot, size_t part);
  void start_write(int b, size_t slot, size_t part);
  void wait(int b);

 private:
  struct Slot {
    uint64_t offset;                  // in the file
    std::vector<uint64_t> parts, at;  // each part's bytes and its offset in the slot (pages)
  };
  // Starts moving parts first..last of `slot` from or to staging `b`.
  void start(int b, bool write, size_t slot, size_t first, size_t last);
  // The requests that move parts first..last of `slot` from or to staging `b`, into `batch`.
  void add_ops(DirectFile::Batch& batch, bool write, int b, size_t slot, size_t first,
               size_t last) const;

  Device& host_;
  bool direct_ = false;  // before path_, whose initialiser sets it
  std::string path_;
  std::unique_ptr<DirectFile> file_;  // made at the first slot
  std::vector<Slot> slots_;
  uint64_t file_bytes_ = 0, staging_bytes_ = 0;
  Buffer staging_[kStagings];
  unsigned char* aligned_[kStagings] = {nullptr, nullptr};
  DirectFile::Batch io_[kStagings];  // start_read's or start_write's, in flight until wait
  bool in_flight_[kStagings] = {false, false};
};

}  // namespace headroom
