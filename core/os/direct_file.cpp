#include "core/os/direct_file.h"

#include <fcntl.h>
#include <liburing.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "core/config/config.h"
#include "core/os/output_file.h"

namespace headroom {

namespace {

std::string os_reason(int err) {
  return std::strerror(err);
}

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

std::string tier_file_path(const std::string& dir, DirectIo mode, int rank, const std::string& ext,
                           const std::string& what, const std::string& who, std::ostream* log,
                           bool* direct) {
  const std::string problem = check_state_dir(dir, mode, direct);
  if (!problem.empty()) throw ConfigError(who + problem);
  if (mode == DirectIo::kAuto && !*direct && log)
    *log << "offload: the " << what << " in " << dir
         << " is read and written buffered: " << file_system_name(dir) << " refuses O_DIRECT\n";
  static std::atomic<int> made{0};
  return dir + "/headroom-" + std::to_string(getpid()) + "-" + std::to_string(made++) + "-rank" +
         std::to_string(rank) + "." + ext;
}

struct DirectFile::Ring {
  io_uring ring;
  Ring(unsigned entries, const std::string& name) {
    const int r = io_uring_queue_init(entries, &ring, 0);
    if (r < 0) throw OutputError(name + ": io_uring_queue_init: " + os_reason(-r));
  }
  ~Ring() { io_uring_queue_exit(&ring); }
};

DirectFile::DirectFile(const std::string& path, bool direct, const std::string& what,
                       unsigned ring_entries)
    : path_(path), what_(what), direct_(direct), ring_entries_(ring_entries) {
  const int fd =
      ::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | (direct_ ? O_DIRECT : 0), 0600);
  if (fd < 0) throw OutputError(what_ + " " + path_ + ": cannot create it: " + os_reason(errno));
  fd_ = fd;  // from here on the destructor removes it
  try {
    ring_ = std::make_unique<Ring>(ring_entries, what_ + " " + path_);
  } catch (...) {
    close(fd_);
    unlink(path_.c_str());
    throw;
  }
}

DirectFile::~DirectFile() {
  ring_.reset();
  close(fd_);
  unlink(path_.c_str());
}

void DirectFile::allocate(uint64_t offset, uint64_t bytes, bool dry) {
  if (bytes == 0) return;
  if (dry) {
    // A dry run (plan --measure) moves nothing: the file has its size and no blocks, so that
    // measuring an 8B model's plan does not write tens of GB.
    struct stat st;
    if (fstat(fd_, &st) == 0 && uint64_t(st.st_size) >= offset + bytes) return;
    if (::ftruncate(fd_, off_t(offset + bytes)) != 0)
      throw OutputError(what_ + " " + path_ + ": cannot size it: " + os_reason(errno));
    return;
  }
  // posix_fallocate returns the error (it does not set errno); the blocks it allocates read as
  // zeros.
  const int r = posix_fallocate(fd_, off_t(offset), off_t(bytes));
  if (r != 0)
    throw OutputError(what_ + " " + path_ + ": cannot hold its " + format_bytes(offset + bytes) +
                      " on " + file_system_name(path_.substr(0, path_.rfind('/'))) + ": " +
                      os_reason(r));
}

void DirectFile::reaped(void* completion) {
  io_uring_cqe* cqe = static_cast<io_uring_cqe*>(completion);
  Op* op = static_cast<Op*>(io_uring_cqe_get_data(cqe));
  op->result = cqe->res;
  --op->batch->in_flight;
  --in_ring_;
  io_uring_cqe_seen(&ring_->ring, cqe);
}

void DirectFile::submit(Batch& batch) {
  if (batch.in_flight != 0) throw std::logic_error(what_ + ": a batch submitted twice");
  if (batch.ops.empty()) return;
  if (batch.ops.size() > ring_entries_)
    throw std::logic_error(what_ + ": a batch longer than the ring");
  io_uring& ring = ring_->ring;
  // Room for the whole chain: reap what others left (their batches record it) until it fits.
  while (in_ring_ + batch.ops.size() > ring_entries_) {
    io_uring_cqe* cqe = nullptr;
    const int r = io_uring_wait_cqe(&ring, &cqe);
    if (r == -EINTR) continue;
    if (r < 0) throw OutputError(what_ + " " + path_ + ": io_uring_wait_cqe: " + os_reason(-r));
    reaped(cqe);
  }
  for (size_t i = 0; i < batch.ops.size(); ++i) {
    const Op& op = batch.ops[i];
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    if (!sqe) throw std::logic_error(what_ + ": no room in the ring's submission queue");
    if (op.write)
      io_uring_prep_write(sqe, fd_, op.data, unsigned(op.bytes), op.offset);
    else
      io_uring_prep_read(sqe, fd_, op.data, unsigned(op.bytes), op.offset);
    batch.ops[i].batch = &batch;
    io_uring_sqe_set_data(sqe, &batch.ops[i]);
    if (i + 1 < batch.ops.size()) sqe->flags |= IOSQE_IO_LINK;
  }
  const int r = io_uring_submit(&ring);
  if (r < 0) throw OutputError(what_ + " " + path_ + ": io_uring_submit: " + os_reason(-r));
  batch.in_flight = batch.ops.size();
  in_ring_ += batch.ops.size();
}

void DirectFile::wait(Batch& batch) {
  io_uring& ring = ring_->ring;
  while (batch.in_flight > 0) {
    io_uring_cqe* cqe = nullptr;
    const int r = io_uring_wait_cqe(&ring, &cqe);
    if (r == -EINTR) continue;
    if (r < 0) throw OutputError(what_ + " " + path_ + ": io_uring_wait_cqe: " + os_reason(-r));
    reaped(cqe);
  }
  // A request the kernel moved only part of (or cancelled, after a short one before it) is
  // finished with plain pread/pwrite, in order.
  for (Op& op : batch.ops) {
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
        op.result = n == 0 ? -EIO : -errno;  // the file is allocated: no end before its size
        failed = true;
      } else {
        moved += uint64_t(n);
      }
    }
    if (failed)
      throw OutputError(what_ + " " + path_ + ": " + (op.write ? "writing " : "reading ") +
                        format_bytes(op.bytes) + " at offset " + std::to_string(op.offset) + ": " +
                        os_reason(int(-op.result)) +
                        (op.result == -ENOSPC
                             ? " (the disk is full; the snapshots written so far are intact)"
                             : ""));
    op.result = int64_t(op.bytes);
  }
}

}  // namespace headroom
