#include "core/data/shards.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <sstream>
#include <stdexcept>

#include "core/os/interrupt.h"
#include "core/os/output_file.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "llm.c token shards are little-endian; this reader maps them as they are"
#endif

namespace headroom {

namespace {

std::string errno_str() {
  return std::strerror(errno);
}

// Closes a file descriptor when it goes out of scope.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

// Opens a shard for reading and returns its size; throws ConfigError naming it otherwise.
int open_shard(const std::string& path, uint64_t* size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw ConfigError(path + ": cannot open: " + errno_str());
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const std::string why = errno_str();
    ::close(fd);
    throw ConfigError(path + ": cannot stat: " + why);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw ConfigError(path + ": not a regular file (expected an llm.c token shard)");
  }
  *size = uint64_t(st.st_size);
  return fd;
}

// Reads up to n bytes at offset; returns how many were read.
size_t pread_full(int fd, void* buf, size_t n, uint64_t offset, const std::string& path) {
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, static_cast<char*>(buf) + done, n - done, off_t(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw ConfigError(path + ": read failed: " + errno_str());
    if (r == 0) break;
    done += size_t(r);
  }
  return done;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Fisher-Yates with mt19937_64 (fully specified by the standard, unlike std::shuffle and the
// distributions): the same permutation on every platform.
template <typename I>
void permute(std::vector<I>& v, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = v.size(); i > 1; --i) {
    const size_t j = size_t(rng() % uint64_t(i));
    std::swap(v[i - 1], v[j]);
  }
}

std::string join(const std::vector<uint64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i)
    s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

// The shards of one run, cut into windows as llm.c's DataLoader does.
class ShardSource final : public DataSource {
 public:
  ShardSource(std::string pattern, std::vector<ShardInfo> shards, int B, int T, int vocab_size,
              int rank, int world, bool shuffle, uint64_t seed)
      : pattern_(std::move(pattern)),
        shards_(std::move(shards)),
        B_(B),
        T_(T),
        vocab_(vocab_size),
        rank_(rank),
        world_(world),
        shuffle_(shuffle),
        seed_(seed) {
    for (const ShardInfo& s : shards_)
      total_tokens_ += s.count;
    order_ = shard_order(0);
  }
  ~ShardSource() override { unmap(); }
  ShardSource(const ShardSource&) = delete;
  ShardSource& operator=(const ShardSource&) = delete;

  void next(int32_t* inputs, int32_t* targets, int B, int T) override {
    if (B != B_ || T != T_)
      throw std::invalid_argument("shard source made for B=" + std::to_string(B_) +
                                  ", T=" + std::to_string(T_) +
                                  " asked for B=" + std::to_string(B) + ", T=" + std::to_string(T));
    if (sample_ >= batches(order_[shard_])) advance();
    const size_t file = order_[shard_];
    map(file);
    const uint64_t batch = shuffle_ ? batch_order_[sample_] : sample_;
    const uint64_t bt = uint64_t(B_) * uint64_t(T_);
    const uint64_t pos = batch * uint64_t(world_) * bt + uint64_t(rank_) * bt;
    const uint16_t* tokens = tokens_ + shards_[file].first + pos;
    for (uint64_t i = 0; i <= bt; ++i) {
      const int32_t t = tokens[i];
      if (t >= vocab_)
        throw ConfigError(shards_[file].path + ": token " + std::to_string(t) + " at offset " +
                          std::to_string(shards_[file].first + pos + i) +
                          " is >= model.vocab_size " + std::to_string(vocab_));
      if (i < bt) inputs[i] = t;
      if (i > 0) targets[i - 1] = t;
    }
    ++sample_;
  }

  std::string describe() const override {
    std::string s = "llm.c token shards '" + pattern_ + "': " + std::to_string(shards_.size()) +
                    (shards_.size() == 1 ? " shard, " : " shards, ") +
                    std::to_string(total_tokens_) + " tokens";
    if (shuffle_) s += ", shuffled (seed " + std::to_string(seed_) + ")";
    if (world_ > 1) s += ", rank " + std::to_string(rank_) + " of " + std::to_string(world_);
    return s;
  }

  // Text: "shards v1 bt=.. world=.. shuffle=.. seed=.. epoch=.. shard=.. sample=.. order=a,b,..
  // tokens=n0,n1,..". The permutations follow from seed and epoch, so they need no rng state.
  std::string state() const override {
    std::vector<uint64_t> order(order_.begin(), order_.end()), tokens;
    for (const ShardInfo& s : shards_)
      tokens.push_back(s.count);
    std::ostringstream os;
    os << "shards v1 bt=" << uint64_t(B_) * uint64_t(T_) << " world=" << world_
       << " shuffle=" << (shuffle_ ? 1 : 0) << " seed=" << seed_ << " epoch=" << epoch_
       << " shard=" << shard_ << " sample=" << sample_ << " order=" << join(order)
       << " tokens=" << join(tokens);
    return os.str();
  }

  void restore(const std::string& state) override {
    const std::string bad = "the snapshot's data position is not an llm.c shard source's";
    std::istringstream is(state);
    std::string kind, version;
    is >> kind >> version;
    if (!is || kind != "shards") throw ConfigError(bad);
    if (version != "v1")
      throw ConfigError("the snapshot's shard position has format '" + version +
                        "' (this reader knows v1)");
    uint64_t bt = 0, world = 0, shuffle = 0, seed = 0, epoch = 0, shard = 0, sample = 0;
    std::vector<uint64_t> order, tokens;
    const struct {
      const char* key;
      uint64_t* value;
    } fields[] = {{"bt", &bt},       {"world", &world}, {"shuffle", &shuffle}, {"seed", &seed},
                  {"epoch", &epoch}, {"shard", &shard}, {"sample", &sample}};
    for (const auto& f : fields)
      if (!read_field(is, f.key, f.value)) throw ConfigError(bad + " (no " + f.key + ")");
    if (!read_list(is, "order", &order) || !read_list(is, "tokens", &tokens))
      throw ConfigError(bad + " (no order or token counts)");

    std::vector<uint64_t> mine;
    for (const ShardInfo& s : shards_)
      mine.push_back(s.count);
    if (tokens != mine)
      throw ConfigError("the snapshot's data position belongs to " + std::to_string(tokens.size()) +
                        " shards of " + summary(tokens) + " tokens, but data.pattern '" + pattern_ +
                        "' matches " + std::to_string(mine.size()) + " shards of " + summary(mine) +
                        " tokens: not the same data");
    if ((shuffle != 0) != shuffle_ || (shuffle_ && seed != seed_))
      throw ConfigError("the snapshot's data position was taken with data.shuffle = " +
                        std::string(shuffle ? "true" : "false") +
                        (shuffle ? ", data.seed = " + std::to_string(seed) : "") +
                        "; this run has data.shuffle = " + (shuffle_ ? "true" : "false") +
                        (shuffle_ ? ", data.seed = " + std::to_string(seed_) : ""));
    std::vector<bool> seen(shards_.size(), false);
    bool permutation = order.size() == shards_.size();
    for (size_t i = 0; permutation && i < order.size(); ++i) {
      permutation = order[i] < shards_.size() && !seen[order[i]];
      if (permutation) seen[order[i]] = true;
    }
    // The position in the snapshot's own global batches (world * bt tokens each).
    if (!permutation || shard >= shards_.size() || bt == 0 || world == 0 ||
        bt > ~uint64_t(0) / world || sample > (shards_[order[shard]].count - 1) / (world * bt))
      throw ConfigError(bad + " (its shard order or position is out of range)");
    sample = map_sample(sample, world, bt, shards_[order[shard]].path);
    epoch_ = epoch;
    shard_ = size_t(shard);
    sample_ = sample;
    order_.assign(order.begin(), order.end());
    batch_order_key_ = kNone;  // recomputed for the restored epoch and shard
  }

 private:
  static constexpr uint64_t kNone = ~uint64_t(0);

  // The snapshot's position, global batch `sample` of `world` ranks x `bt` tokens in the current
  // shard (`file`), as a global batch of this run (world_ x B_*T_ tokens): the same token
  // position, so that a snapshot resumes at another world size or micro-batch. Shuffled, the
  // batch order is a permutation of the shard's global batches, whose count depends on their
  // size: only the same size maps. ConfigError saying what would be valid otherwise.
  uint64_t map_sample(uint64_t sample, uint64_t world, uint64_t bt, const std::string& file) const {
    const uint64_t my_bt = uint64_t(B_) * uint64_t(T_), mine = uint64_t(world_) * my_bt;
    const uint64_t theirs = world * bt;
    if (theirs == mine) return sample;
    const std::string was = std::to_string(world) + " rank" + (world == 1 ? "" : "s") + " x " +
                            std::to_string(bt) +
                            " tokens (micro_batch * seq_len) = " + std::to_string(theirs);
    const std::string is =
        std::to_string(world_) + " x " + std::to_string(my_bt) + " = " + std::to_string(mine);
    // This run's micro_batch that would give the snapshot's global batch, if one does.
    const uint64_t per_rank = uint64_t(world_) * uint64_t(T_);
    const std::string at_this_world = std::to_string(world_) + " rank" + (world_ == 1 ? "" : "s");
    if (shuffle_)
      throw ConfigError(
          "the snapshot's data position was taken with data.shuffle = true over global batches "
          "of " +
          was + " tokens; this run's are " + is +
          ": a shuffled batch order depends on the global batch, so it must stay " +
          std::to_string(theirs) + " tokens (" +
          (theirs % per_rank == 0
               ? "micro_batch = " + std::to_string(theirs / per_rank) + " at " + at_this_world
               : "no micro_batch gives that at " + at_this_world + " and seq_len " +
                     std::to_string(T_)) +
          ")");
    const uint64_t token = sample * theirs;
    if (token % mine != 0)
      throw ConfigError(
          "the snapshot's data position, token " + std::to_string(token) + " of " + file +
          " (global batch " + std::to_string(sample) + " of " + was +
          " tokens), is no multiple of this run's global batch of " + is +
          " tokens, so no batch of this run starts there; valid: a world size * "
          "micro_batch * seq_len that divides " +
          std::to_string(token) + ", such as the snapshot's " + std::to_string(theirs) +
          (theirs % per_rank == 0 ? " (micro_batch = " + std::to_string(theirs / per_rank) +
                                        " at " + at_this_world + ")"
                                  : std::string()));
    return token / mine;
  }

  static bool read_field(std::istream& is, const std::string& key, uint64_t* value) {
    std::string word;
    if (!(is >> word) || word.rfind(key + "=", 0) != 0) return false;
    const std::string v = word.substr(key.size() + 1);
    if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos) return false;
    try {
      *value = std::stoull(v);
    } catch (const std::exception&) {
      return false;
    }
    return true;
  }

  static bool read_list(std::istream& is, const std::string& key, std::vector<uint64_t>* values) {
    std::string word;
    if (!(is >> word) || word.rfind(key + "=", 0) != 0) return false;
    std::istringstream items(word.substr(key.size() + 1));
    std::string item;
    while (std::getline(items, item, ',')) {
      if (item.empty() || item.find_first_not_of("0123456789") != std::string::npos) return false;
      try {
        values->push_back(std::stoull(item));
      } catch (const std::exception&) {
        return false;
      }
    }
    return true;
  }

  static std::string summary(const std::vector<uint64_t>& tokens) {
    if (tokens.size() <= 4) return "(" + join(tokens) + ")";
    uint64_t total = 0;
    for (uint64_t t : tokens)
      total += t;
    return std::to_string(total);
  }

  // Global batches in shard `file` (llm.c: shard_num_samples).
  uint64_t batches(size_t file) const {
    return (shards_[file].count - 1) / (uint64_t(world_) * uint64_t(B_) * uint64_t(T_));
  }

  std::vector<size_t> shard_order(uint64_t epoch) const {
    std::vector<size_t> order(shards_.size());
    for (size_t i = 0; i < order.size(); ++i)
      order[i] = i;
    if (shuffle_) permute(order, epoch_seed(epoch));
    return order;
  }

  uint64_t epoch_seed(uint64_t epoch) const { return splitmix64(seed_ ^ splitmix64(epoch)); }

  // Moves to the next shard, and after the last to the first of a new epoch (llm.c:
  // dataloader_advance_ and dataloader_reset).
  void advance() {
    sample_ = 0;
    if (++shard_ == shards_.size()) {
      shard_ = 0;
      ++epoch_;
      order_ = shard_order(epoch_);
    }
  }

  // Maps shard `file` (unmapping the previous one) and prepares its batch order.
  void map(size_t file) {
    if (mapped_file_ != file) {
      unmap();
      const ShardInfo& s = shards_[file];
      uint64_t size = 0;
      Fd fd(open_shard(s.path, &size));
      const uint64_t expected = kShardHeaderBytes + 2 * s.tokens;
      if (size != expected)
        throw ConfigError(s.path + ": changed since it was validated: it has " +
                          std::to_string(size) + " bytes, expected " + std::to_string(expected));
      void* p = ::mmap(nullptr, size_t(size), PROT_READ, MAP_SHARED, fd.fd, 0);
      if (p == MAP_FAILED) throw ConfigError(s.path + ": cannot mmap: " + errno_str());
      map_ = p;
      map_size_ = size_t(size);
      mapped_file_ = file;
      ::madvise(map_, map_size_, shuffle_ ? MADV_RANDOM : MADV_SEQUENTIAL);
      const auto* bytes = static_cast<const uint8_t*>(map_);
      if (parse_shard_header(bytes, map_size_, size, s.path) != s.tokens)
        throw ConfigError(s.path + ": changed since it was validated: its header no longer says " +
                          std::to_string(s.tokens) + " tokens");
      tokens_ = reinterpret_cast<const uint16_t*>(bytes + kShardHeaderBytes);
    }
    if (shuffle_) {
      // One key per (epoch, file): the batch order of a shard is redrawn every epoch.
      const uint64_t key = splitmix64(epoch_seed(epoch_) ^ splitmix64(file + 1));
      if (batch_order_key_ != key || batch_order_file_ != file) {
        batch_order_.resize(batches(file));
        for (size_t i = 0; i < batch_order_.size(); ++i)
          batch_order_[i] = uint32_t(i);
        permute(batch_order_, key);
        batch_order_key_ = key;
        batch_order_file_ = file;
      }
    }
  }

  void unmap() {
    if (map_) ::munmap(map_, map_size_);
    map_ = nullptr;
    map_size_ = 0;
    tokens_ = nullptr;
    mapped_file_ = kNone;
  }

  std::string pattern_;
  std::vector<ShardInfo> shards_;
  uint64_t total_tokens_ = 0;
  int B_, T_, vocab_, rank_, world_;
  bool shuffle_;
  uint64_t seed_;

  // The position: epoch, index into order_, global batch index into the shard's batch order.
  uint64_t epoch_ = 0;
  size_t shard_ = 0;
  uint64_t sample_ = 0;
  std::vector<size_t> order_;  // this epoch's shard order

  // The mapped shard and its batch order (shuffle only).
  void* map_ = nullptr;
  size_t map_size_ = 0;
  const uint16_t* tokens_ = nullptr;
  size_t mapped_file_ = kNone;
  std::vector<uint32_t> batch_order_;
  uint64_t batch_order_key_ = kNone;
  size_t batch_order_file_ = kNone;
};

// Writes a shard header for `tokens` tokens of a tokenizer of `vocab` ids.
void header_bytes(uint64_t tokens, uint32_t vocab, uint8_t out[kShardHeaderBytes]) {
  int32_t header[256] = {};
  header[0] = kShardMagic;
  header[1] = kShardVersion;
  header[2] = int32_t(tokens);
  header[kShardVocabInt] = int32_t(vocab);
  std::memcpy(out, header, kShardHeaderBytes);
}

}  // namespace

uint64_t parse_shard_header(const uint8_t* data, size_t size, uint64_t file_size,
                            const std::string& file) {
  if (size < kShardHeaderBytes || file_size < kShardHeaderBytes)
    throw ConfigError(file + ": truncated: " + std::to_string(std::min<uint64_t>(size, file_size)) +
                      " bytes, shorter than the 1024-byte header of an llm.c token shard");
  int32_t magic, version;
  uint32_t count;
  std::memcpy(&magic, data, 4);
  std::memcpy(&version, data + 4, 4);
  std::memcpy(&count, data + 8, 4);
  if (magic != kShardMagic)
    throw ConfigError(file + ": bad magic " + std::to_string(magic) + " (expected " +
                      std::to_string(kShardMagic) + ": an llm.c token shard)");
  if (version != kShardVersion)
    throw ConfigError(file + ": version " + std::to_string(version) +
                      " (this reader knows version 1: uint16 tokens)");
  const uint64_t expected = kShardHeaderBytes + 2 * uint64_t(count);
  const std::string says = "header says " + std::to_string(count) + " tokens (" +
                           std::to_string(expected) + " bytes) but the file has " +
                           std::to_string(file_size) + " bytes";
  if (file_size < expected) throw ConfigError(file + ": truncated: " + says);
  if (file_size > expected)
    throw ConfigError(file + ": token count mismatch: " + says + " (" +
                      std::to_string(file_size - expected) + " bytes too many)");
  return count;
}

ShardInfo validate_shard(const std::string& path, uint64_t min_tokens) {
  uint64_t size = 0;
  Fd fd(open_shard(path, &size));
  uint8_t header[kShardHeaderBytes];
  const size_t got = pread_full(fd.fd, header, sizeof header, 0, path);
  ShardInfo info;
  info.path = path;
  info.tokens = parse_shard_header(header, got, size, path);
  info.count = info.tokens;
  int32_t vocab = 0;
  std::memcpy(&vocab, header + 4 * kShardVocabInt, 4);
  info.vocab_size = vocab > 0 ? uint32_t(vocab) : 0;
  if (info.tokens < min_tokens)
    throw ConfigError(path + ": holds " + std::to_string(info.tokens) +
                      " tokens, fewer than one micro-batch needs (micro_batch * seq_len + 1 = " +
                      std::to_string(min_tokens) + ")");
  return info;
}

std::vector<uint16_t> read_tokens(const std::string& path, uint64_t offset, size_t n) {
  uint64_t size = 0;
  Fd fd(open_shard(path, &size));
  std::vector<uint16_t> tokens(n);
  const uint64_t at = kShardHeaderBytes + 2 * offset;
  if (pread_full(fd.fd, tokens.data(), 2 * n, at, path) != 2 * n)
    throw ConfigError(path + ": has " + std::to_string(size) + " bytes, too few for " +
                      std::to_string(n) + " tokens at offset " + std::to_string(offset));
  return tokens;
}

namespace {

// 0.1 -> "10%"
std::string percent(double fraction) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g%%", fraction * 100.0);
  return buf;
}

// The validated shards of `pattern`, sorted. `key` names the config key in messages.
// The tokenizer data.tokenizer names is checked against the model and the shards' headers.
std::vector<ShardInfo> find_shards(const std::string& pattern, const SourcePos& at, const char* key,
                                   const DataConfig& data, int B, int T, int vocab_size,
                                   int world) {
  const std::string pos = at.str();
  const std::string where = (pos.empty() ? "" : pos + ": ") + key + " '" + pattern + "'";
  glob_t g;
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> paths;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i)
      paths.push_back(g.gl_pathv[i]);
  ::globfree(&g);
  if (rc == GLOB_NOMATCH || (rc == 0 && paths.empty()))
    throw ConfigError(where + " matches no files (expected llm.c token shards, e.g. " +
                      "data/train_*.bin)");
  if (rc != 0) throw ConfigError(where + ": glob failed (a directory could not be read)");

  // The tokenizer the config says wrote the shards: its ids must fit the model, and the shards
  // that record a vocab size must have been written by a tokenizer of that size.
  int tokenizer_vocab = 0;
  const std::string tokenizer_at = data.tokenizer_pos.str() + ": data.tokenizer";
  if (!data.tokenizer.empty()) {
    try {
      tokenizer_vocab = load_tokenizer(data.tokenizer)->vocab_size();
    } catch (const ConfigError& e) {
      throw ConfigError(tokenizer_at + ": " + e.what());
    }
    if (tokenizer_vocab > vocab_size)
      throw ConfigError(tokenizer_at + " has vocab_size " + std::to_string(tokenizer_vocab) +
                        ", but model.vocab_size is " + std::to_string(vocab_size) +
                        ": set model.vocab_size >= " + std::to_string(tokenizer_vocab));
  }
  const uint64_t bt = uint64_t(B) * uint64_t(T);
  std::vector<ShardInfo> shards;
  for (const std::string& p : paths) {
    shards.push_back(validate_shard(p, bt + 1));
    if (tokenizer_vocab > 0 && shards.back().vocab_size != 0 &&
        shards.back().vocab_size != uint32_t(tokenizer_vocab))
      throw ConfigError(tokenizer_at + " has vocab_size " + std::to_string(tokenizer_vocab) +
                        ", but " + p + " was written by a tokenizer of vocab_size " +
                        std::to_string(shards.back().vocab_size) +
                        " (its header): not the same tokenizer");
    if (shards.back().vocab_size > uint32_t(vocab_size))
      throw ConfigError(where + ": " + p + " was written by a tokenizer of vocab_size " +
                        std::to_string(shards.back().vocab_size) +
                        " (its header), but model.vocab_size is " + std::to_string(vocab_size) +
                        ": its tokens would fall outside the embedding; set model.vocab_size >= " +
                        std::to_string(shards.back().vocab_size));
    const uint64_t need = uint64_t(world) * bt + 1;
    if (world > 1 && shards.back().tokens < need)
      throw ConfigError(
          p + ": holds " + std::to_string(shards.back().tokens) +
          " tokens, fewer than one batch of " + std::to_string(world) +
          " ranks needs (ranks * micro_batch * seq_len + 1 = " + std::to_string(need) + ")");
  }
  return shards;
}

// data.val_fraction: the shards cut where the held-out tail begins; `tail` picks which side.
// Pieces shorter than one global batch (world · B·T + 1 tokens) are dropped.
std::vector<ShardInfo> split_shards(const std::vector<ShardInfo>& shards, const DataConfig& data,
                                    bool tail, int B, int T, int world) {
  uint64_t total = 0;
  for (const ShardInfo& s : shards)
    total += s.tokens;
  const uint64_t held = uint64_t(std::floor(double(total) * data.val_fraction));
  const uint64_t cut = total - held;  // tokens before the cut are trained on
  const uint64_t need = uint64_t(world) * uint64_t(B) * uint64_t(T) + 1;
  std::vector<ShardInfo> out;
  uint64_t at = 0;  // the first token of shard s, counted over all shards
  for (ShardInfo s : shards) {
    const uint64_t begin = at, end = at + s.tokens;
    at = end;
    const uint64_t lo = tail ? std::max(begin, cut) : begin;
    const uint64_t hi = tail ? end : std::min(end, cut);
    if (hi <= lo || hi - lo < need) continue;
    s.first = lo - begin;
    s.count = hi - lo;
    out.push_back(s);
  }
  if (out.empty()) {
    const std::string pos = data.val_pos.str();
    throw ConfigError(
        (pos.empty() ? "" : pos + ": ") + "data.val_fraction = " + percent(data.val_fraction) +
        " of data.pattern '" + data.pattern + "' (" + std::to_string(total) + " tokens) leaves " +
        (tail ? std::to_string(held) + " tokens for validation"
              : std::to_string(cut) + " tokens for training") +
        ", fewer than one batch needs in any shard (world size * micro_batch * "
        "seq_len + 1 = " +
        std::to_string(need) + "); choose a " + (tail ? "larger" : "smaller") + " fraction");
  }
  return out;
}

}  // namespace

std::unique_ptr<DataSource> make_shard_source(const DataConfig& data, int B, int T, int vocab_size,
                                              int rank, int world) {
  if (B < 1 || T < 1 || vocab_size < 1 || world < 1 || rank < 0 || rank >= world)
    throw std::invalid_argument("make_shard_source: bad B, T, vocab_size, rank or world");
  std::vector<ShardInfo> shards =
      find_shards(data.pattern, data.path_pos, "data.pattern", data, B, T, vocab_size, world);
  if (data.val_fraction > 0) shards = split_shards(shards, data, false, B, T, world);
  return std::make_unique<ShardSource>(data.pattern, std::move(shards), B, T, vocab_size, rank,
                                       world, data.shuffle, data.seed);
}

std::unique_ptr<DataSource> make_shard_validation_source(const DataConfig& data, int B, int T,
                                                         int vocab_size, int rank, int world) {
  if (B < 1 || T < 1 || vocab_size < 1 || world < 1 || rank < 0 || rank >= world)
    throw std::invalid_argument(
        "make_shard_validation_source: bad B, T, vocab_size, rank or world");
  std::vector<ShardInfo> shards;
  std::string name;
  if (!data.val_pattern.empty()) {
    shards = find_shards(data.val_pattern, data.val_pos, "data.val_pattern", data, B, T, vocab_size,
                         world);
    name = data.val_pattern;
  } else {
    shards = split_shards(
        find_shards(data.pattern, data.path_pos, "data.pattern", data, B, T, vocab_size, world),
        data, true, B, T, world);
    name = data.pattern + " (the last " + percent(data.val_fraction) + ")";
  }
  return std::make_unique<ShardSource>(name, std::move(shards), B, T, vocab_size, rank, world,
                                       false, 0);
}

std::vector<std::string> write_text_shards(const std::string& text_file, const std::string& out_dir,
                                           uint64_t tokens_per_shard, const Tokenizer* tokenizer) {
  if (tokens_per_shard < 1 || tokens_per_shard > uint64_t(INT32_MAX))
    throw ConfigError("tokens per shard must be 1.." + std::to_string(INT32_MAX) + ", not " +
                      std::to_string(tokens_per_shard));
  const uint32_t vocab = tokenizer ? uint32_t(tokenizer->vocab_size()) : 256;
  if (vocab > 65536)
    throw ConfigError(tokenizer->describe() + ": " + std::to_string(vocab) +
                      " tokens do not fit llm.c's uint16 shards (at most 65536)");
  std::FILE* in = std::fopen(text_file.c_str(), "rb");
  if (!in) throw ConfigError(text_file + ": cannot open: " + errno_str());
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> in_guard(in, &std::fclose);
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) throw ConfigError(out_dir + ": cannot create directory: " + ec.message());
  // Shards left from an earlier run would match the same glob and be trained on with these.
  for (const auto& e : std::filesystem::directory_iterator(out_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("shard_", 0) == 0 && e.path().extension() == ".bin")
      throw ConfigError(out_dir + ": already holds shards (" + name +
                        "); remove them or choose an empty folder, so that old and new shards " +
                        "are not mixed");
  }

  std::vector<std::string> paths;
  // The shard being written: complete under its name once its header holds the count, or gone.
  std::unique_ptr<AtomicFile> out;
  uint64_t in_shard = 0;
  auto finish = [&]() {
    uint8_t header[kShardHeaderBytes];
    header_bytes(in_shard, vocab, header);
    out->write_at(0, header, sizeof header);
    out->commit();
    paths.push_back(out->path());
    out.reset();
  };
  // Appends n tokens, starting a new shard whenever one is full.
  auto put = [&](const uint16_t* tokens, size_t n) {
    size_t done = 0;
    while (done < n) {
      if (!out) {
        // A safe point: a stop request (interrupt.h) drops the whole set, as a failure does.
        if (const int sig = stop_signal())
          throw Interrupted(sig, "shard: stopped by " + signal_name(sig) +
                                     "; the shards it had written are removed");
        char name[32];
        std::snprintf(name, sizeof name, "shard_%06zu.bin", paths.size());
        out = std::make_unique<AtomicFile>(out_dir + "/" + name, "shard");
        uint8_t header[kShardHeaderBytes];
        header_bytes(0, vocab, header);  // the count is filled in by finish()
        out->write(header, sizeof header);
        in_shard = 0;
      }
      const size_t take = size_t(std::min<uint64_t>(n - done, tokens_per_shard - in_shard));
      out->write(tokens + done, 2 * take);
      done += take;
      in_shard += take;
      if (in_shard == tokens_per_shard) finish();
    }
  };

  try {
    std::vector<uint8_t> bytes(1 << 20);
    std::vector<uint16_t> tokens(bytes.size());
    std::string text;  // with a tokenizer: the whole file, which it encodes at once
    for (;;) {
      const size_t n = std::fread(bytes.data(), 1, bytes.size(), in);
      if (n == 0 && std::ferror(in)) throw ConfigError(text_file + ": read failed: " + errno_str());
      if (n == 0) break;
      if (tokenizer) {
        text.append(reinterpret_cast<const char*>(bytes.data()), n);
        continue;
      }
      for (size_t i = 0; i < n; ++i)
        tokens[i] = bytes[i];
      put(tokens.data(), n);
    }
    if (tokenizer) {
      const std::vector<int32_t> ids = tokenizer->encode(text);
      text.clear();
      for (size_t at = 0; at < ids.size(); at += tokens.size()) {
        const size_t n = std::min(tokens.size(), ids.size() - at);
        for (size_t i = 0; i < n; ++i)
          tokens[i] = uint16_t(ids[at + i]);  // < vocab <= 65536
        put(tokens.data(), n);
      }
    }
    if (out) finish();
  } catch (...) {
    // A set of shards is written whole or not at all: a later run would refuse the folder, or
    // train on part of the text.
    out.reset();
    for (const std::string& p : paths)
      std::remove(p.c_str());
    throw;
  }
  if (paths.empty()) throw ConfigError(text_file + ": is empty: no tokens to write");
  return paths;
}

}  // namespace headroom
