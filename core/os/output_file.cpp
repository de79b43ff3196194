#include "core/os/output_file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include "core/config/config.h"

namespace headroom {

namespace fs = std::filesystem;

namespace {

std::string folder_of(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

// Test hook: HEADROOM_TEST_WRITE_DELAY_MS slows every AtomicFile write down (4 KiB, then a pause),
// so that a test can signal or kill the process while a file is half written.
long write_delay_ms() {
  static const long ms = [] {
    const char* v = std::getenv("HEADROOM_TEST_WRITE_DELAY_MS");
    return v ? std::atol(v) : 0L;
  }();
  return ms;
}

// Writes all `bytes` at `offset` (or at the file position when offset < 0); false with errno set
// on failure.
bool write_fully(int fd, const void* data, size_t bytes, int64_t offset, long delay_ms) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    const size_t chunk = delay_ms > 0 ? std::min<size_t>(bytes, 4096) : bytes;
    const ssize_t n = offset < 0 ? ::write(fd, p, chunk) : ::pwrite(fd, p, chunk, offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += n;
    bytes -= size_t(n);
    if (offset >= 0) offset += n;
    if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
  }
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

AtomicFile::AtomicFile(std::string path, std::string what)
    : path_(std::move(path)), what_(std::move(what)) {
  // A target that is not a regular file (/dev/null, a pipe, /dev/stdout) is written in place:
  // renaming over it would replace the device or the pipe with a file.
  struct stat st {};
  if (::stat(path_.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    if (S_ISDIR(st.st_mode)) {
      errno = EISDIR;
      fail("cannot write it");
    }
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd_ < 0) fail("cannot open for writing");
    return;
  }
  const fs::path p(path_);
  tmp_ = (p.parent_path() / ("." + p.filename().string() + ".tmp")).string();
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("cannot create " + tmp_);
}

AtomicFile::~AtomicFile() {
  if (fd_ < 0) return;
  ::close(fd_);
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
}

void AtomicFile::fail(const std::string& doing) const {
  throw OutputError(what_ + " " + path_ + ": " + doing + ": " + std::strerror(errno));
}

void AtomicFile::write(const void* data, size_t bytes) {
  if (!write_fully(fd_, data, bytes, -1, write_delay_ms())) fail("write failed");
}

void AtomicFile::write_at(uint64_t offset, const void* data, size_t bytes) {
  if (!write_fully(fd_, data, bytes, int64_t(offset), 0)) fail("write failed");
}

void AtomicFile::commit() {
  if (tmp_.empty()) {  // written in place: nothing to sync or rename
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail("close failed");
    return;
  }
  if (::fsync(fd_) != 0) fail("fsync failed");
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp_.c_str());
    errno = err;
    fail("close failed");
  }
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp_.c_str());
    errno = err;
    fail("cannot rename " + tmp_ + " to it");
  }
  // The rename is durable once the folder is synced. Some file systems refuse to sync a folder;
  // the file is complete either way.
  const int dfd = ::open(folder_of(path_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

// ---------------------------------------------------------------------------------------------

AppendFile::AppendFile(std::string path, std::string what)
    : path_(std::move(path)), what_(std::move(what)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("cannot open for writing");
  struct stat st {};
  regular_ = ::fstat(fd_, &st) == 0 && S_ISREG(st.st_mode);
}

AppendFile::~AppendFile() {
  if (fd_ < 0) return;
  if (!write_fully(fd_, buffer_.data(), buffer_.size(), -1, 0)) cut_to_whole_records();
  ::close(fd_);
}

void AppendFile::cut_to_whole_records() {
  // A write the disk took part of: the file ends on the last whole one again. (A device or a
  // pipe keeps what it took; there is nothing to cut.)
  if (regular_ && ::ftruncate(fd_, off_t(whole_bytes_)) == 0)
    ::lseek(fd_, off_t(whole_bytes_), SEEK_SET);
}

void AppendFile::fail(const std::string& doing) {
  const int err = errno;
  if (fd_ >= 0) cut_to_whole_records();
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;  // nothing more is written after a failure
  buffer_.clear();
  throw OutputError(what_ + " " + path_ + ": " + doing + ": " + std::strerror(err));
}

void AppendFile::write(std::string_view text) {
  if (fd_ < 0) throw OutputError(what_ + " " + path_ + ": written to after it was closed");
  buffer_.append(text);
  if (buffer_.size() >= (1u << 16)) flush();
}

void AppendFile::flush() {
  if (fd_ < 0 || buffer_.empty()) return;
  if (!write_fully(fd_, buffer_.data(), buffer_.size(), -1, 0)) fail("write failed");
  whole_bytes_ += buffer_.size();
  buffer_.clear();
}

void AppendFile::close() {
  if (fd_ < 0) return;
  flush();
  // fsync fails with EINVAL on files that cannot be synced (/dev/null, a pipe): nothing is lost.
  if (::fsync(fd_) != 0 && errno != EINVAL && errno != EROFS) fail("fsync failed");
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    fd_ = -1;
    throw OutputError(what_ + " " + path_ + ": close failed: " + std::strerror(errno));
  }
}

// ---------------------------------------------------------------------------------------------

namespace {

// The lock file of an output: ".NAME.lock" beside it; "" for one that is not a regular file or
// folder (a device, a pipe) or has no name (the root).
std::string lock_file_of(const std::string& path) {
  std::error_code ec;
  fs::path p = fs::absolute(fs::path(path), ec).lexically_normal();
  if (ec) return "";
  if (!p.has_filename()) p = p.parent_path();  // "dir/" -> "dir"
  if (!p.has_filename() || p == p.root_path()) return "";
  const fs::file_status st = fs::status(p, ec);
  if (fs::exists(st) && !fs::is_regular_file(st) && !fs::is_directory(st)) return "";
  return (p.parent_path() / ("." + p.filename().string() + ".lock")).string();
}

// The pid a lock file holds ("" when it holds none yet).
std::string pid_in(int fd) {
  char buf[32] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  std::string s = n > 0 ? std::string(buf, size_t(n)) : std::string();
  while (!s.empty() && (s.back() == '\n' || s.back() == ' '))
    s.pop_back();
  return s.find_first_not_of("0123456789") == std::string::npos ? s : std::string();
}

}  // namespace

OutputLock::OutputLock(const std::string& path, const std::string& what) {
  const std::string lock = lock_file_of(path);
  if (lock.empty()) return;
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    // A folder that takes no lock file (checked writable before, so rare: a read-only place for
    // /dev-like outputs) leaves the output unlocked rather than the run refused.
    if (fd < 0) return;
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      const std::string pid = pid_in(fd);
      ::close(fd);
      if (err != EWOULDBLOCK) return;  // the file system has no locks (some network ones)
      const bool self = pid == std::to_string(::getpid());
      throw ConfigError(what + " " + path + ": " +
                        (self ? std::string("this run writes it already, as another of its "
                                            "outputs; give each output its own path")
                              : "another headroom run (pid " + (pid.empty() ? "unknown" : pid) +
                                    ") is writing it (it holds " + lock +
                                    "); wait for that run to end, or give this one another path"));
    }
    // The holder before us may have removed the file between our open and our lock: the lock
    // counts only on the file the path names now.
    struct stat mine {
    }, named{};
    if (::fstat(fd, &mine) != 0 || ::stat(lock.c_str(), &named) != 0 ||
        mine.st_ino != named.st_ino || mine.st_dev != named.st_dev) {
      ::close(fd);
      continue;
    }
    // Without the pid written the lock holds all the same; a second run then says "pid unknown".
    const std::string pid = std::to_string(::getpid()) + "\n";
    if (::ftruncate(fd, 0) == 0) {
      const ssize_t n = ::pwrite(fd, pid.data(), pid.size(), 0);
      (void)n;
    }
    lock_ = lock;
    fd_ = fd;
    return;
  }
}

OutputLock::~OutputLock() {
  release();
}

OutputLock::OutputLock(OutputLock&& other) noexcept
    : lock_(std::move(other.lock_)), fd_(other.fd_) {
  other.fd_ = -1;
  other.lock_.clear();
}

OutputLock& OutputLock::operator=(OutputLock&& other) noexcept {
  if (this != &other) {
    release();
    lock_ = std::move(other.lock_);
    fd_ = other.fd_;
    other.fd_ = -1;
    other.lock_.clear();
  }
  return *this;
}

void OutputLock::release() noexcept {
  if (fd_ < 0) return;
  // Removed while still held: a run that opened it meanwhile finds it gone and makes its own.
  ::unlink(lock_.c_str());
  ::close(fd_);
  fd_ = -1;
  lock_.clear();
}

void check_output_path(const std::string& path, const std::string& what) {
  auto bad = [&](const std::string& why) { return ConfigError(what + " " + path + ": " + why); };
  if (path.empty()) throw bad("the path is empty");
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw bad("is a folder; give a file name");
  const std::string dir = folder_of(path);
  const fs::file_status st = fs::status(dir, ec);
  if (!fs::exists(st))
    throw bad("its folder " + dir + " does not exist; create it first (mkdir -p " + dir + ")");
  if (!fs::is_directory(st)) throw bad(dir + " is not a folder");
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw bad("its folder " + dir + " is not writable: " + std::strerror(errno));
}

void make_output_dir(const std::string& dir, const std::string& what) {
  auto bad = [&](const std::string& why) { return ConfigError(what + " " + dir + ": " + why); };
  if (dir.empty()) throw bad("the path is empty");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    // Name the part of the path that is in the way: "a/b" where a is a file.
    for (fs::path p = fs::path(dir); !p.empty() && p != p.root_path(); p = p.parent_path()) {
      std::error_code e2;
      if (fs::exists(p, e2) && !fs::is_directory(p, e2))
        throw bad("cannot create it: " + p.string() + " is a file, not a folder");
    }
    throw bad("cannot create it: " + ec.message());
  }
  if (!fs::is_directory(dir, ec)) throw bad("is a file, not a folder");
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw bad("is not writable: " + std::string(std::strerror(errno)));
}

}  // namespace headroom
