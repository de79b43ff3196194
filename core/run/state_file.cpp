#include "core/run/state_file.h"

#include <fcntl.h>
#include <liburing.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "core/config/config.h"
#include "core/os/output_file.h"

namespace headroom {

namespace {

uint64_t round_up(uint64_t n, uint64_t to) {
  return (n + to - 1) / to * to;
}

std::string os_reason(int err) {
  return std::strerror(err);
}

// A tensor's range is at most kMaxRequests requests; a chain is a piece's writes and the next
// one's reads (up to kMaxTensors tensors each), one chain in flight at a time.
constexpr unsigned kMaxRequests = 32, kMaxTensors = 4;
constexpr unsigned kRingEntries = 2 * kMaxTensors * kMaxRequests;
// The smallest I/O: below it the per-request cost shows (fio's rates at 1 MiB blocks are the
// disk's).
constexpr uint64_t kMinChunk = uint64_t(1) << 20;

}  // namespace

std::string file_system_name(const std::string& dir) {
  struct statfs s;
  if (statfs(dir.c_str(), &s) != 0) return "unknown";
  switch (static_cast<unsigned long>(s.f_type)) {
    case TMPFS_MAGIC:
      return "tmpfs";
    case EXT4_SUPER_MAGIC:
      return "ext4";  // ext2 and ext3 share it
    case XFS_SUPER_MAGIC:
      return "xfs";
    case BTRFS_SUPER_MAGIC:
      return "btrfs";
    case OVERLAYFS_SUPER_MAGIC:
      return "overlayfs";
    case NFS_SUPER_MAGIC:
      return "nfs";
    case RAMFS_MAGIC:
      return "ramfs";  // no O_DIRECT; tmpfs has it from Linux 6.6
    default: {
      char hex[32];
      std::snprintf(hex, sizeof hex, "0x%lx", static_cast<unsigned long>(s.f_type));
      return std::string("file system magic ") + hex;
    }
  }
}

std::string check_state_dir(const std::string& dir, DirectIo mode, bool* direct) {
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) return "\"" + dir + "\": " + os_reason(errno);
  if (!S_ISDIR(st.st_mode)) return "\"" + dir + "\" is not a folder";
  // A probe file: what open() says is what the real file will meet.
  std::string probe = dir + "/.headroom-probe-XXXXXX";
  const int fd = mkstemp(probe.data());
  if (fd < 0) return "\"" + dir + "\" is not writable: " + os_reason(errno);
  close(fd);
  *direct = false;
  std::string problem;
  if (mode != DirectIo::kOff) {
    const int d = open(probe.c_str(), O_RDWR | O_DIRECT);
    if (d >= 0) {
      close(d);
      *direct = true;
    } else if (mode == DirectIo::kOn) {
      problem = "\"" + dir + "\" is on " + file_system_name(dir) + ", which refuses O_DIRECT (" +
                os_reason(errno) + "); valid there: \"auto\" (buffered I/O) or false";
    }
  }
  unlink(probe.c_str());
  return problem;
}

struct StateFile::Ring {
  io_uring ring;
  explicit Ring(const std::string& path) {
    const int r = io_uring_queue_init(kRingEntries, &ring, 0);
    if (r < 0)
      throw OutputError("optimizer state file " + path + ": io_uring_queue_init: " + os_reason(-r));
  }
  ~Ring() { io_uring_queue_exit(&ring); }
};

// One request of a chain: `bytes` at file offset `offset` from or to `data`.
struct StateFile::Op {
  bool write;
  unsigned char* data;
  uint64_t bytes, offset;
  int64_t result = 0;  // the completion's: bytes moved, or -errno
};

StateFile::StateFile(Device& host, const std::string& dir, DirectIo mode, int rank,
                     const std::string& who, std::ostream* log)
    : host_(host), dir_(dir) {
  const std::string problem = check_state_dir(dir, mode, &direct_);
  if (!problem.empty()) throw ConfigError(who + problem);
  if (mode == DirectIo::kAuto && !direct_ && log)
    *log << "offload: the optimizer state file in " << dir
         << " is read and written buffered: " << file_system_name(dir) << " refuses O_DIRECT\n";
  // The pid and a count of this process's files: two runs may share the folder, and one process
  // may hold two trainers (tests do).
  static std::atomic<int> made{0};
  path_ = dir + "/headroom-" + std::to_string(getpid()) + "-" + std::to_string(made++) + "-rank" +
          std::to_string(rank) + ".optstate";
}

StateFile::~StateFile() {
  try {
    unmap();
  } catch (const std::exception&) {  // the file goes next: nothing of it is kept
  }
  ring_.reset();
  if (fd_ >= 0) {
    close(fd_);
    unlink(path_.c_str());
  }
}

void StateFile::open(const std::vector<uint64_t>& numels, int tensors, Dtype dtype, bool chunked) {
  if (fd_ >= 0) throw std::logic_error("the optimizer state file is open already");
  if (tensors < 0 || tensors > int(kMaxTensors))
    throw std::logic_error("optimizer state: 0 to 4 tensors a segment");
  numels_ = numels;
  tensors_ = tensors;
  dtype_ = dtype;
  offsets_.clear();
  pieces_.clear();
  file_bytes_ = 0;
  for (size_t k = 0; k < numels.size(); ++k) {
    offsets_.push_back(file_bytes_);
    file_bytes_ += state_slot_bytes(numels[k], tensors, dtype);
    const uint64_t step = state_piece_numel(numels[k], chunked);
    for (uint64_t first = 0; first < numels[k]; first += step)
      pieces_.push_back({k, first, std::min(step, numels[k] - first)});
  }
  const uint64_t largest = state_file_host_bytes(numels, tensors, dtype, chunked) / 2;
  // At most kMaxRequests requests a tensor's range, none smaller than kMinChunk.
  const uint64_t range =
      largest > kStatePage ? (largest - kStatePage) / uint64_t(std::max(tensors, 1)) : 0;
  chunk_ = std::max(kMinChunk, round_up((range + kMaxRequests - 1) / kMaxRequests, kStatePage));
  const int fd =
      ::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | (direct_ ? O_DIRECT : 0), 0600);
  if (fd < 0)
    throw OutputError("optimizer state file " + path_ + ": cannot create it: " + os_reason(errno));
  fd_ = fd;  // from here on the destructor removes it
  if (file_bytes_ > 0 && host_.dry()) {
    // A dry run (plan --measure) moves no state: the file has its size and no blocks, so that
    // measuring an 8B model's plan does not write 60 GB.
    if (::ftruncate(fd_, off_t(file_bytes_)) != 0)
      throw OutputError("optimizer state file " + path_ + ": cannot size it: " + os_reason(errno));
  } else if (file_bytes_ > 0) {
    // Every block now: a disk that cannot hold the state says so before step 1. posix_fallocate
    // returns the error (it does not set errno); the blocks it allocates read as zeros.
    const int r = posix_fallocate(fd_, 0, off_t(file_bytes_));
    if (r != 0)
      throw OutputError("optimizer state file " + path_ + ": cannot hold its " +
                        format_bytes(file_bytes_) + " on " + file_system_name(dir_) + ": " +
                        os_reason(r));
  }
  ring_ = std::make_unique<Ring>(path_);
  for (int b = 0; b < 2 && largest > 0; ++b) {
    staging_[b] = Buffer(host_, largest, Category::kOptimizer,
                         "optimizer state staging " + std::to_string(b) + " (NVMe tier)");
    const uintptr_t p = reinterpret_cast<uintptr_t>(staging_[b].as<void>());
    aligned_[b] = reinterpret_cast<unsigned char*>(round_up(p, kStatePage));
  }
}

void StateFile::state_pointers(unsigned char* base, uint64_t numel, void** out) const {
  const uint64_t tensor = round_up(numel * dtype_size(dtype_), kStatePage);
  for (int j = 0; j < tensors_; ++j)
    out[j] = base + uint64_t(j) * tensor;
}

// Piece p's requests: of each tensor j, the range [first, first + n) of its slot in the file, to
// or from tensor j's place in the staging buffer; rounded up to whole pages (first is a multiple
// of kStateChunk, so a page too; the slot is padded to a page, so the last piece's rounding stays
// in it).
void StateFile::add_ops(std::vector<Op>& ops, bool write, const Piece& p,
                        unsigned char* buffer) const {
  const uint64_t elem = dtype_size(dtype_);
  const uint64_t in_file = round_up(numels_[p.k] * elem, kStatePage);
  const uint64_t in_buffer = round_up(p.n * elem, kStatePage);
  for (int j = 0; j < tensors_; ++j) {
    const uint64_t file_at = offsets_[p.k] + uint64_t(j) * in_file + p.first * elem;
    unsigned char* data = buffer + uint64_t(j) * in_buffer;
    for (uint64_t at = 0; at < in_buffer; at += chunk_)
      ops.push_back({write, data + at, std::min(chunk_, in_buffer - at), file_at + at});
  }
}

// A chain in order (each request linked to the next: a segment's write-back before the next read
// into the same buffer), submitted; finish() waits for it whole.
void StateFile::submit(std::vector<Op>& ops) {
  if (ops.empty()) return;
  io_uring& ring = ring_->ring;
  for (size_t i = 0; i < ops.size(); ++i) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    if (!sqe) throw std::logic_error("optimizer state file: a chain longer than the ring");
    if (ops[i].write)
      io_uring_prep_write(sqe, fd_, ops[i].data, unsigned(ops[i].bytes), ops[i].offset);
    else
      io_uring_prep_read(sqe, fd_, ops[i].data, unsigned(ops[i].bytes), ops[i].offset);
    io_uring_sqe_set_data64(sqe, i);
    if (i + 1 < ops.size()) sqe->flags |= IOSQE_IO_LINK;
  }
  const int r = io_uring_submit(&ring);
  if (r < 0)
    throw OutputError("optimizer state file " + path_ + ": io_uring_submit: " + os_reason(-r));
  in_flight_ = ops.size();
}

// Every completion of the chain in flight; then a request the kernel moved only part of (or
// cancelled, after a short one before it) is finished with plain pread/pwrite, in order.
void StateFile::finish(std::vector<Op>& ops) {
  io_uring& ring = ring_->ring;
  while (in_flight_ > 0) {
    io_uring_cqe* cqe = nullptr;
    const int r = io_uring_wait_cqe(&ring, &cqe);
    if (r == -EINTR) continue;
    if (r < 0)
      throw OutputError("optimizer state file " + path_ + ": io_uring_wait_cqe: " + os_reason(-r));
    ops.at(io_uring_cqe_get_data64(cqe)).result = cqe->res;
    io_uring_cqe_seen(&ring, cqe);
    --in_flight_;
  }
  for (Op& op : ops) {
    if (op.result == int64_t(op.bytes)) continue;
    uint64_t moved = op.result > 0 ? uint64_t(op.result) : 0;
    bool failed =
        op.result < 0 && op.result != -ECANCELED && op.result != -EAGAIN && op.result != -EINTR;
    while (!failed && moved < op.bytes) {
      const ssize_t n =
          op.write ? pwrite(fd_, op.data + moved, op.bytes - moved, off_t(op.offset + moved))
                   : pread(fd_, op.data + moved, op.bytes - moved, off_t(op.offset + moved));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        op.result = n == 0 ? -EIO : -errno;  // the file is preallocated: no end before its size
        failed = true;
      } else {
        moved += uint64_t(n);
      }
    }
    if (failed)
      throw OutputError(
          "optimizer state file " + path_ + ": " + (op.write ? "writing " : "reading ") +
          format_bytes(op.bytes) + " at offset " + std::to_string(op.offset) + ": " +
          os_reason(int(-op.result)) +
          (op.result == -ENOSPC ? " (the disk is full; the snapshots written so far are intact)"
                                : ""));
  }
}

void StateFile::stream(const Update& update, Pass pass) {
  if (fd_ < 0) throw std::logic_error("the optimizer state file is not open");
  unmap();
  const size_t n = pieces_.size();
  const bool reads = pass != Pass::kWrite, writes = pass != Pass::kRead;
  std::vector<Op> ops;
  if (reads && n > 0) {
    add_ops(ops, false, pieces_[0], aligned_[0]);
    submit(ops);
    finish(ops);
  }
  void* state[kMaxTensors];
  for (size_t p = 0; p < n; ++p) {
    unsigned char* other = aligned_[(p + 1) % 2];
    // In flight while piece p is updated: piece p-1's write-back from the other buffer, then
    // piece p+1's read into it.
    ops.clear();
    if (writes && p >= 1) add_ops(ops, true, pieces_[p - 1], other);
    if (reads && p + 1 < n) add_ops(ops, false, pieces_[p + 1], other);
    submit(ops);
    const Piece& piece = pieces_[p];
    state_pointers(aligned_[p % 2], piece.n, state);
    try {
      update(piece.k, piece.first, piece.n, state);
    } catch (...) {
      // The kernel must be done with the buffers before anything frees them.
      try {
        finish(ops);
      } catch (const std::exception&) {  // the update's error is the one to report
      }
      throw;
    }
    finish(ops);
  }
  if (writes && n > 0) {
    ops.clear();
    add_ops(ops, true, pieces_[n - 1], aligned_[(n - 1) % 2]);
    submit(ops);
    finish(ops);
  }
}

std::vector<void*> StateFile::map() {
  if (fd_ < 0) throw std::logic_error("the optimizer state file is not open");
  if (!mapping_ && file_bytes_ > 0) {
    void* p = mmap(nullptr, file_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED)
      throw OutputError("optimizer state file " + path_ + ": mmap: " + os_reason(errno));
    mapping_ = p;
  }
  std::vector<void*> out(numels_.size() * size_t(tensors_));
  for (size_t k = 0; k < numels_.size(); ++k)
    state_pointers(static_cast<unsigned char*>(mapping_) + offsets_[k], numels_[k],
                   out.data() + k * size_t(tensors_));
  return out;
}

void StateFile::unmap() {
  if (!mapping_) return;
  // What a resume wrote into the mapping reaches the file before O_DIRECT reads it.
  const int r = msync(mapping_, file_bytes_, MS_SYNC);
  const int err = errno;
  munmap(mapping_, file_bytes_);
  mapping_ = nullptr;
  if (r != 0) throw OutputError("optimizer state file " + path_ + ": msync: " + os_reason(err));
}

}  // namespace headroom
