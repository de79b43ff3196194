// The NVMe tier's file (headroom.offload/1's HR_PLACE_NVME): the built-in optimizer's state kept
// in one file per process instead of memory, streamed through two host buffers at each update.
//
// Its layout, and the host bytes it holds, are core/optim/state_layout.h's.
//
// The file, dir/headroom-<pid>-<n>-rank<R>.optstate (n: the
// process's count of such files, 0 for its first), is made and preallocated whole (posix_fallocate)
// when it is opened, before step 1: a disk too small for it fails there (OutputError, exit 4), not
// half way through an update. It is removed when the StateFile is destroyed: at the end of the run
// and on every exit that unwinds (an error, a stop request).
//
// stream() is the update, piece by piece (state_layout.h: kStateChunk elements of a segment, or
// the whole segment when the update rounds stochastically): with two staging buffers A and B
// (the largest piece's state each, host ledger, category optimizer) it reads piece 0 into A, then
// for each piece p submits, as one io_uring chain, the write of piece p-1 from the other buffer
// followed by the read of piece p+1 into it, and updates piece p in this buffer meanwhile; the
// write of the last piece ends it. The update waits on I/O only when the disk is slower than it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "core/device/device.h"
#include "core/optim/state_layout.h"
#include "core/os/direct_file.h"

namespace headroom {

class StateFile {
 public:
  // Checks `dir` (ConfigError: check_state_dir's message after `who`); opens nothing yet. `log`:
  // where the one line that says O_DIRECT is not used goes (kAuto on a file system without it).
  StateFile(Device& host, const std::string& dir, DirectIo mode, int rank, const std::string& who,
            std::ostream* log);
  ~StateFile();
  StateFile(const StateFile&) = delete;
  StateFile& operator=(const StateFile&) = delete;

  // Makes the file for segments of `numels` (zeroed state, as make_state's), preallocated, and
  // the two staging buffers; `chunked`: pieces of kStateChunk elements (f32 updates), else whole
  // segments. OutputError (exit 4) when the disk cannot hold it, naming the file and the bytes;
  // OutOfMemory past the host's wall. Once only.
  void open(const std::vector<uint64_t>& numels, int tensors, Dtype dtype, bool chunked);
  bool is_open() const { return file_ != nullptr; }
  const std::string& path() const { return path_; }
  bool direct() const { return direct_; }
  uint64_t file_bytes() const { return file_bytes_; }

  // What a pass moves: the update reads and writes back each segment; kRead and kWrite one
  // direction alone (bench/bench_state_file measures each against fio).
  enum class Pass { kReadWrite, kRead, kWrite };
  // Calls update(k, first, n, state) for every piece in order — segment k's elements [first,
  // first + n) — with its state tensors' range in a staging buffer (`state[j]`: tensor j's
  // element `first`), double-buffered as above. OutputError on an I/O error (naming the
  // file, the OS's reason); what the update computed before it is lost with the step, never the
  // snapshots.
  using Update = std::function<void(size_t k, uint64_t first, uint64_t n, void* const* state)>;
  void stream(const Update& update, Pass pass = Pass::kReadWrite);
  // The state for a snapshot: pointers into a shared mapping of the file (segment k's tensor j at
  // [k * tensors + j]), read and written through the page cache, outside the host ledger (file
  // pages the kernel can drop). Valid until the next stream() or the destructor, which sync the
  // mapping to the file first.
  std::vector<void*> map();

 private:
  void unmap();
  struct Piece {
    size_t k;
    uint64_t first, n;
  };
  void add_ops(DirectFile::Batch& batch, bool write, const Piece& p, unsigned char* buffer) const;
  // Tensor j of segment k at base + j * (its bytes rounded up): the file's slots and a piece's
  // staging alike, `numel` elements each.
  void state_pointers(unsigned char* base, uint64_t numel, void** out) const;

  Device& host_;
  bool direct_ = false;  // before path_, whose initialiser sets it
  std::string path_;
  std::unique_ptr<DirectFile> file_;
  std::vector<uint64_t> numels_, offsets_;  // per segment: elements, its slot's file offset
  std::vector<Piece> pieces_;
  int tensors_ = 0;
  Dtype dtype_ = Dtype::kF32;
  uint64_t file_bytes_ = 0, chunk_ = 0;
  Buffer staging_[2];
  unsigned char* aligned_[2] = {nullptr, nullptr};
  void* mapping_ = nullptr;
};

}  // namespace headroom
