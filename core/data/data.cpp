#include "core/data/data.h"

#include "core/data/shards.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>
#include <sstream>

namespace headroom {

namespace {

double uniform01(std::mt19937_64& rng) {
  return double(rng() >> 11) * 0x1.0p-53;
}

// data.val_fraction of a text of `size` bytes: its last floor(fraction · size) bytes.
size_t held_out_bytes(size_t size, const DataConfig& data) {
  return size_t(std::floor(double(size) * data.val_fraction));
}

// What a data.val_fraction too large (training side) or too small (validation side) leaves of a
// text of `total` bytes: "a.toml:9:16: data.val_fraction = 0.9999 (99.99%) of data.path 'x'
// (12001 bytes) leaves 1 byte for training, fewer than one micro-batch needs (...); choose a
// smaller fraction".
std::string fraction_leaves(const DataConfig& data, size_t total, size_t left, bool validation,
                            size_t need, int world) {
  char pct[64];
  std::snprintf(pct, sizeof pct, "%g (%g%%)", data.val_fraction, data.val_fraction * 100.0);
  const std::string pos = data.val_pos.str();
  return (pos.empty() ? "" : pos + ": ") + "data.val_fraction = " + pct + " of data.path '" +
         data.path + "' (" + std::to_string(total) + " bytes) leaves " + std::to_string(left) +
         (left == 1 ? " byte" : " bytes") + " for " + (validation ? "validation" : "training") +
         ", fewer than one micro-batch needs (" + (world > 1 ? "world size * " : "") +
         "micro_batch * seq_len + 1 = " + std::to_string(need) + "); choose a " +
         (validation ? "larger" : "smaller") + " fraction";
}

// A continuous stream from the chain, cut into llm.c-style windows.
class SyntheticSource final : public DataSource {
 public:
  // `stream` 0 is the training stream; the validation stream (1) samples the same chain with
  // another seed.
  SyntheticSource(int vocab, int branching, uint64_t seed, int rank, int world, uint64_t stream = 0)
      : chain_(vocab, branching, seed),
        rng_(seed ^ 0x9e3779b97f4a7c15ull ^ (stream * 0xd1b54a32d192ed03ull)),
        last_(chain_.start()),
        rank_(size_t(rank)),
        world_(size_t(world)) {}

  void next(int32_t* inputs, int32_t* targets, int B, int T) override {
    const size_t n = size_t(B) * T;
    // The stream continues where the previous batch ended: its last target is this first input.
    // Every rank draws the whole global batch (world · B·T tokens) and keeps its own rows: rank r
    // the r-th B·T of them, so the state stays the same on every rank.
    int32_t token = last_;
    const size_t begin = rank_ * n, end = begin + n;
    for (size_t i = 0; i < world_ * n; ++i) {
      const int32_t input = token;
      token = chain_.sample(token, rng_);
      if (i >= begin && i < end) {
        inputs[i - begin] = input;
        targets[i - begin] = token;
      }
    }
    last_ = token;
  }
  std::string describe() const override {
    char buf[160];
    std::snprintf(buf, sizeof buf, "synthetic Markov source, entropy rate %.4f nats/token",
                  chain_.entropy_rate());
    return buf;
  }
  double entropy() const override { return chain_.entropy_rate(); }
  std::string state() const override {
    std::ostringstream os;
    os << "synthetic " << last_ << ' ' << rng_;
    return os.str();
  }
  void restore(const std::string& state) override {
    std::istringstream is(state);
    std::string kind;
    int32_t last = -1;
    is >> kind >> last >> rng_;
    if (!is || kind != "synthetic" || last < 0 || last >= chain_.vocab_size())
      throw ConfigError("the snapshot's data position is not a synthetic source's of vocab_size " +
                        std::to_string(chain_.vocab_size()));
    last_ = last;
  }

 private:
  MarkovChain chain_;
  std::mt19937_64 rng_;
  int32_t last_;
  size_t rank_, world_;
};

// The bytes of a text file, vocab 256, consecutive windows wrapping to the start.
class TextSource final : public DataSource {
 public:
  TextSource(std::string path, std::vector<uint8_t> bytes, int rank, int world)
      : path_(std::move(path)),
        bytes_(std::move(bytes)),
        rank_(size_t(rank)),
        world_(size_t(world)) {}

  void next(int32_t* inputs, int32_t* targets, int B, int T) override {
    // The global batch is the next world · B·T bytes (wrapping to the start when they do not all
    // fit); rank r reads the r-th B·T of them. pos_ is the global position, the same on every rank.
    const size_t n = size_t(B) * T;
    if (pos_ + world_ * n + 1 > bytes_.size()) pos_ = 0;
    const size_t at = pos_ + rank_ * n;
    for (size_t i = 0; i < n; ++i) {
      inputs[i] = bytes_[at + i];
      targets[i] = bytes_[at + i + 1];
    }
    pos_ += world_ * n;
  }
  std::string describe() const override {
    return "text '" + path_ + "', " + std::to_string(bytes_.size()) + " bytes (vocab 256)";
  }
  std::string state() const override {
    return "text " + std::to_string(bytes_.size()) + " " + std::to_string(pos_);
  }
  void restore(const std::string& state) override {
    std::istringstream is(state);
    std::string kind;
    size_t size = 0, pos = 0;
    is >> kind >> size >> pos;
    if (!is || kind != "text" || size != bytes_.size() || pos > bytes_.size())
      throw ConfigError("the snapshot's data position does not fit '" + path_ + "' (" +
                        std::to_string(bytes_.size()) + " bytes)");
    pos_ = pos;
  }

 private:
  std::string path_;
  std::vector<uint8_t> bytes_;
  size_t rank_, world_;
  size_t pos_ = 0;
};

// The bytes of the text file `path`; `where` names it in errors ("FILE:L:C: data.path 'x'"). A
// directory, a file that cannot be opened or read, and an empty file are ConfigErrors.
std::vector<uint8_t> read_text_file(const std::string& path, const std::string& where) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw ConfigError(where + ": cannot open the text file: " + std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    throw ConfigError(where + ": cannot stat the text file: " + std::strerror(errno));
  }
  if (S_ISDIR(st.st_mode)) {
    throw ConfigError(where + " is a directory, not a text file; data.kind = \"text\" trains on " +
                      "the bytes of one file (for many files, write them as shards with " +
                      "`headroom shard` and use data.kind = \"shards\")");
  }
  std::vector<uint8_t> bytes;
  if (S_ISREG(st.st_mode)) bytes.reserve(size_t(st.st_size));
  uint8_t buf[1 << 16];
  for (;;) {
    const ssize_t r = ::read(fd, buf, sizeof buf);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw ConfigError(where + ": cannot read the text file: " + std::strerror(errno));
    if (r == 0) break;
    bytes.insert(bytes.end(), buf, buf + r);
  }
  if (bytes.empty()) throw ConfigError(where + ": the text file is empty (0 bytes)");
  return bytes;
}

// "FILE:L:C: " where a data key was set, or "" when the config does not say (a DataConfig made in
// code).
std::string pos_prefix(const SourcePos& pos) {
  const std::string p = pos.str();
  return p.empty() ? "" : p + ": ";
}

}  // namespace

MarkovChain::MarkovChain(int vocab_size, int branching, uint64_t seed)
    : vocab_(vocab_size), k_(std::min(branching, vocab_size)) {
  std::mt19937_64 rng(seed);
  next_.resize(size_t(vocab_) * k_);
  prob_.resize(size_t(vocab_) * k_);
  for (int i = 0; i < vocab_; ++i) {
    std::set<int32_t> chosen;
    while (int(chosen.size()) < k_)
      chosen.insert(int32_t(rng() % uint64_t(vocab_)));
    double total = 0.0;
    int j = 0;
    for (int32_t s : chosen) {
      next_[size_t(i) * k_ + j] = s;
      // Exponential weights: the normalised row is a Dirichlet(1) sample.
      const double w = -std::log(1.0 - uniform01(rng));
      prob_[size_t(i) * k_ + j] = w;
      total += w;
      ++j;
    }
    for (j = 0; j < k_; ++j)
      prob_[size_t(i) * k_ + j] /= total;
  }
  start_ = int32_t(rng() % uint64_t(vocab_));
}

double MarkovChain::entropy_rate() const {
  std::call_once(entropy_once_, [this] { entropy_rate_ = compute_entropy_rate(); });
  return entropy_rate_;
}

double MarkovChain::compute_entropy_rate() const {
  // The long-run distribution of a stream started at start_: Cesaro average of the distribution
  // over time (correct even for a periodic or reducible chain).
  std::vector<double> p(vocab_, 0.0), q(vocab_), avg(vocab_, 0.0);
  p[start_] = 1.0;
  const int burn_in = 500, averaged = 1500;
  for (int it = 0; it < burn_in + averaged; ++it) {
    std::fill(q.begin(), q.end(), 0.0);
    for (int i = 0; i < vocab_; ++i) {
      if (p[i] == 0.0) continue;
      for (int j = 0; j < k_; ++j)
        q[next_[size_t(i) * k_ + j]] += p[i] * prob_[size_t(i) * k_ + j];
    }
    p.swap(q);
    if (it >= burn_in)
      for (int i = 0; i < vocab_; ++i)
        avg[i] += p[i] / averaged;
  }
  double rate = 0.0;
  for (int i = 0; i < vocab_; ++i) {
    double h = 0.0;
    for (int j = 0; j < k_; ++j) {
      const double pj = prob_[size_t(i) * k_ + j];
      if (pj > 0) h -= pj * std::log(pj);
    }
    rate += avg[i] * h;
  }
  return rate;
}

int32_t MarkovChain::sample(int32_t from, std::mt19937_64& rng) const {
  const double u = uniform01(rng);
  double c = 0.0;
  const double* p = probabilities(from);
  for (int j = 0; j < k_ - 1; ++j) {
    c += p[j];
    if (u < c) return successors(from)[j];
  }
  return successors(from)[k_ - 1];
}

std::unique_ptr<DataSource> make_validation_source(const DataConfig& data, const ModelConfig& model,
                                                   int B, int T, int rank, int world) {
  if (data.kind == "synthetic")
    return std::make_unique<SyntheticSource>(model.vocab_size, data.branching, data.seed, rank,
                                             world, 1);
  const size_t need = size_t(world) * B * T + 1;
  if (data.kind == "text") {
    std::string where, path;
    std::vector<uint8_t> bytes;
    if (!data.val_path.empty()) {
      where = pos_prefix(data.val_pos) + "data.val_path '" + data.val_path + "'";
      path = data.val_path;
      bytes = read_text_file(data.val_path, where);
    } else if (data.val_fraction > 0) {
      where = pos_prefix(data.val_pos) + "data.val_fraction of data.path '" + data.path + "'";
      path = data.path + " (held-out tail)";
      bytes =
          read_text_file(data.path, pos_prefix(data.path_pos) + "data.path '" + data.path + "'");
      const size_t total = bytes.size(), held = held_out_bytes(total, data);
      if (held < need) throw ConfigError(fraction_leaves(data, total, held, true, need, world));
      bytes.erase(bytes.begin(), bytes.end() - ptrdiff_t(held));
    } else {
      return nullptr;
    }
    if (bytes.size() < need)
      throw ConfigError(where + ": the validation text has " + std::to_string(bytes.size()) +
                        " bytes, fewer than one micro-batch needs (world size * micro_batch * "
                        "seq_len + 1 = " +
                        std::to_string(need) + ")");
    return std::make_unique<TextSource>(path, std::move(bytes), rank, world);
  }
  if (data.kind == "shards" && (!data.val_pattern.empty() || data.val_fraction > 0))
    return make_shard_validation_source(data, B, T, model.vocab_size, rank, world);
  return nullptr;
}

std::unique_ptr<DataSource> make_data_source(const DataConfig& data, const ModelConfig& model,
                                             int B, int T, int rank, int world) {
  if (data.kind == "synthetic")
    return std::make_unique<SyntheticSource>(model.vocab_size, data.branching, data.seed, rank,
                                             world);
  if (data.kind == "text") {
    const std::string where = pos_prefix(data.path_pos) + "data.path '" + data.path + "'";
    // parse_config already refuses this; a DataConfig made in code may not have been through it.
    if (model.vocab_size < 256)
      throw ConfigError(where + ": text data is bytes (vocab 256) but model.vocab_size is " +
                        std::to_string(model.vocab_size) + "; set model.vocab_size >= 256");
    std::vector<uint8_t> bytes = read_text_file(data.path, where);
    const size_t need = size_t(world) * B * T + 1;
    if (data.val_fraction > 0) {
      const size_t total = bytes.size(), left = total - held_out_bytes(total, data);
      if (left < need && total >= need)
        throw ConfigError(fraction_leaves(data, total, left, false, need, world));
      bytes.resize(left);
    }
    if (bytes.size() < need) {
      if (world == 1)
        throw ConfigError(where + ": has " + std::to_string(bytes.size()) +
                          " bytes, fewer than one micro-batch needs (micro_batch * seq_len + 1 = " +
                          std::to_string(need) + ")");
      throw ConfigError(where + ": has " + std::to_string(bytes.size()) +
                        " bytes, fewer than one micro-batch of every rank needs (world size * " +
                        "micro_batch * seq_len + 1 = " + std::to_string(need) + ")");
    }
    return std::make_unique<TextSource>(data.path, std::move(bytes), rank, world);
  }
  if (data.kind == "shards") {
    // Errors about the pattern itself already name it and its line; errors about one shard name
    // only the shard, so they get the pattern's line in front.
    const std::string where = pos_prefix(data.path_pos) + "data.pattern '" + data.pattern + "'";
    try {
      return make_shard_source(data, B, T, model.vocab_size, rank, world);
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      if (what.compare(0, where.size(), where) == 0) throw;
      throw ConfigError(where + ": " + what);
    }
  }
  throw ConfigError("data.kind = \"" + data.kind +
                    "\": valid kinds are \"synthetic\", \"text\", \"shards\"");
}

}  // namespace headroom
