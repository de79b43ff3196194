#include "core/os/output_file.h"

#include <fcntl.h>
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
