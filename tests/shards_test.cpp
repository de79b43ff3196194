// llm.c token shards: validation errors, the llm.c window sequence, rank strides, shuffling, exact
// resume, tokens past 4 GiB, and `headroom shard`'s writer.
#include "core/data/shards.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;

// Writes a shard by hand: a header (magic, version, count) and the tokens, then `extra` bytes.
std::string write_shard(const std::string& path, const std::vector<uint16_t>& tokens,
                        int32_t magic = kShardMagic, int32_t version = 1, int64_t count = -1,
                        size_t extra = 0) {
  int32_t header[256] = {};
  header[0] = magic;
  header[1] = version;
  header[2] = int32_t(count < 0 ? int64_t(tokens.size()) : count);
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header), sizeof header);
  out.write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(2 * tokens.size()));
  const std::string pad(extra, '\0');
  out.write(pad.data(), std::streamsize(pad.size()));
  return path;
}

// Tokens first, first+1, ... (mod 60000): every window of a shard is recognisable.
std::vector<uint16_t> ramp(size_t n, uint32_t first) {
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = uint16_t((first + i) % 60000);
  return v;
}

DataConfig shard_config(const std::string& pattern, bool shuffle = false, uint64_t seed = 1) {
  DataConfig d;
  d.kind = "shards";
  d.pattern = pattern;
  d.shuffle = shuffle;
  d.seed = seed;
  return d;
}

struct Batch {
  std::vector<int32_t> inputs, targets;
  bool operator==(const Batch& o) const { return inputs == o.inputs && targets == o.targets; }
};

Batch next_batch(DataSource& src, int B, int T) {
  Batch b;
  b.inputs.resize(size_t(B) * T);
  b.targets.resize(size_t(B) * T);
  src.next(b.inputs.data(), b.targets.data(), B, T);
  return b;
}

std::vector<Batch> batches(DataSource& src, int B, int T, int n) {
  std::vector<Batch> v;
  for (int i = 0; i < n; ++i)
    v.push_back(next_batch(src, B, T));
  return v;
}

// The batch llm.c's DataLoader yields from B*T+1 tokens at `pos` of `tokens`.
Batch window(const std::vector<uint16_t>& tokens, size_t pos, size_t bt) {
  Batch b;
  for (size_t i = 0; i < bt; ++i) {
    b.inputs.push_back(tokens[pos + i]);
    b.targets.push_back(tokens[pos + i + 1]);
  }
  return b;
}

// llm.c's unshuffled DataLoader: shard by shard, floor((n-1)/(world*B*T)) batches each, rank r at
// batch * world*B*T + r*B*T, wrapping to the first shard.
std::vector<Batch> llmc_sequence(const std::vector<std::vector<uint16_t>>& shards, size_t bt,
                                 size_t rank, size_t world, int n) {
  std::vector<Batch> v;
  size_t shard = 0, sample = 0;
  while (int(v.size()) < n) {
    const size_t samples = (shards[shard].size() - 1) / (world * bt);
    if (sample >= samples) {
      shard = (shard + 1) % shards.size();
      sample = 0;
      continue;
    }
    v.push_back(window(shards[shard], sample * world * bt + rank * bt, bt));
    ++sample;
  }
  return v;
}

// Three shards of 100, 57 and 80 tokens.
struct ThreeShards {
  std::string dir = test::temp_dir();
  std::vector<std::vector<uint16_t>> tokens = {ramp(100, 0), ramp(57, 1000), ramp(80, 2000)};
  ThreeShards() {
    for (size_t i = 0; i < tokens.size(); ++i)
      write_shard(dir + "/train_00000" + std::to_string(i) + ".bin", tokens[i]);
    // Not matched by the pattern: must not be read.
    write_shard(dir + "/val_000000.bin", ramp(100, 5000));
  }
  ~ThreeShards() { fs::remove_all(dir); }
  std::string pattern() const { return dir + "/train_*.bin"; }
};

TEST(ShardsTest, WriteTextShardsRoundTrip) {
  const std::string dir = test::temp_dir();
  std::string text;
  for (int i = 0; i < 1000; ++i)
    text += char(i * 7 % 256);
  const std::string file = test::write_file(dir, "corpus.txt", text);
  const auto paths = write_text_shards(file, dir + "/out", 300);
  ASSERT_EQ(paths.size(), 4u);
  EXPECT_EQ(paths[0], dir + "/out/shard_000000.bin");
  EXPECT_EQ(paths[3], dir + "/out/shard_000003.bin");
  const uint64_t counts[] = {300, 300, 300, 100};
  size_t at = 0;
  for (size_t i = 0; i < paths.size(); ++i) {
    const ShardInfo info = validate_shard(paths[i], 1);
    EXPECT_EQ(info.tokens, counts[i]);
    EXPECT_EQ(fs::file_size(paths[i]), 1024 + 2 * counts[i]);
    const auto tokens = read_tokens(paths[i], 0, size_t(counts[i]));
    for (size_t j = 0; j < tokens.size(); ++j, ++at)
      ASSERT_EQ(tokens[j], uint8_t(text[at])) << paths[i] << " token " << j;
  }
  EXPECT_EQ(at, text.size());
  // No temporary files are left behind.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir + "/out"), fs::directory_iterator()), 4);

  // The shards read back as the text's bytes, llm.c windows over them.
  DataConfig d = shard_config(dir + "/out/shard_*.bin");
  auto src = make_shard_source(d, 2, 8, 256);
  const Batch b = next_batch(*src, 2, 8);
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(b.inputs[i], uint8_t(text[i]));
    EXPECT_EQ(b.targets[i], uint8_t(text[i + 1]));
  }
  EXPECT_TRUE(test::contains(src->describe(), "4 shards, 1000 tokens")) << src->describe();
  fs::remove_all(dir);
}

TEST(ShardsTest, WriteTextShardsErrors) {
  const std::string dir = test::temp_dir();
  std::string msg = test::error_of([&] { write_text_shards(dir + "/missing.txt", dir + "/out"); });
  EXPECT_TRUE(test::contains(msg, dir + "/missing.txt: cannot open")) << msg;
  const std::string file = test::write_file(dir, "a.txt", "hello");
  test::write_file(dir, "blocker", "x");
  msg = test::error_of([&] { write_text_shards(file, dir + "/blocker/out"); });
  EXPECT_TRUE(test::contains(msg, dir + "/blocker/out: cannot create directory")) << msg;
  const std::string empty = test::write_file(dir, "empty.txt", "");
  msg = test::error_of([&] { write_text_shards(empty, dir + "/out"); });
  EXPECT_TRUE(test::contains(msg, "empty")) << msg;
  msg = test::error_of([&] { write_text_shards(file, dir + "/out", 0); });
  EXPECT_TRUE(test::contains(msg, "tokens per shard")) << msg;
  fs::remove_all(dir);
}

TEST(ShardsTest, BadMagic) {
  const std::string dir = test::temp_dir();
  const std::string p = write_shard(dir + "/s.bin", ramp(100, 0), 12345);
  const std::string msg = test::error_of([&] { validate_shard(p, 17); });
  EXPECT_TRUE(test::contains(msg, p + ": bad magic 12345 (expected 20240520")) << msg;
  fs::remove_all(dir);
}

TEST(ShardsTest, WrongVersion) {
  const std::string dir = test::temp_dir();
  const std::string p = write_shard(dir + "/s.bin", ramp(100, 0), kShardMagic, 2);
  const std::string msg = test::error_of([&] { validate_shard(p, 17); });
  EXPECT_TRUE(test::contains(msg, p + ": version 2 (this reader knows version 1")) << msg;
  fs::remove_all(dir);
}

TEST(ShardsTest, Truncated) {
  const std::string dir = test::temp_dir();
  // The header says 100 tokens; the file holds 60.
  const std::string p = write_shard(dir + "/s.bin", ramp(60, 0), kShardMagic, 1, 100);
  std::string msg = test::error_of([&] { validate_shard(p, 17); });
  EXPECT_TRUE(test::contains(
      msg, p + ": truncated: header says 100 tokens (1224 bytes) but the file " + "has 1144 bytes"))
      << msg;
  // Shorter than the header itself.
  const std::string q = test::write_file(dir, "short.bin", "abc");
  msg = test::error_of([&] { validate_shard(q, 17); });
  EXPECT_TRUE(test::contains(msg, q + ": truncated: 3 bytes")) << msg;
  fs::remove_all(dir);
}

TEST(ShardsTest, CountMismatch) {
  const std::string dir = test::temp_dir();
  // The header says 50 tokens; the file holds 100.
  const std::string p = write_shard(dir + "/s.bin", ramp(100, 0), kShardMagic, 1, 50);
  std::string msg = test::error_of([&] { validate_shard(p, 17); });
  EXPECT_TRUE(
      test::contains(msg, p + ": token count mismatch: header says 50 tokens (1124 bytes) but " +
                              "the file has 1224 bytes"))
      << msg;
  // An odd trailing byte.
  const std::string q = write_shard(dir + "/odd.bin", ramp(100, 0), kShardMagic, 1, -1, 1);
  msg = test::error_of([&] { validate_shard(q, 17); });
  EXPECT_TRUE(test::contains(msg, q + ": token count mismatch")) << msg;
  fs::remove_all(dir);
}

TEST(ShardsTest, FewerTokensThanOneBatch) {
  const std::string dir = test::temp_dir();
  write_shard(dir + "/a.bin", ramp(100, 0));
  const std::string p = write_shard(dir + "/b.bin", ramp(16, 0));
  // Validated at start: the source names the short shard.
  std::string msg =
      test::error_of([&] { make_shard_source(shard_config(dir + "/*.bin"), 2, 8, 256); });
  EXPECT_TRUE(test::contains(msg, p + ": holds 16 tokens, fewer than one micro-batch needs "
                                      "(micro_batch * seq_len + 1 = 17)"))
      << msg;
  // With 4 ranks every shard must hold one batch of all of them.
  write_shard(p, ramp(40, 0));
  msg = test::error_of([&] { make_shard_source(shard_config(dir + "/*.bin"), 2, 8, 256, 0, 4); });
  EXPECT_TRUE(test::contains(msg, p + ": holds 40 tokens, fewer than one batch of 4 ranks needs"))
      << msg;
  fs::remove_all(dir);
}

TEST(ShardsTest, BadShardAmongGoodOnesNamed) {
  const std::string dir = test::temp_dir();
  write_shard(dir + "/a.bin", ramp(100, 0));
  const std::string p = write_shard(dir + "/b.bin", ramp(100, 0), 7);
  write_shard(dir + "/c.bin", ramp(100, 0));
  const std::string msg =
      test::error_of([&] { make_shard_source(shard_config(dir + "/*.bin"), 2, 8, 256); });
  EXPECT_TRUE(test::contains(msg, p + ": bad magic 7")) << msg;
  fs::remove_all(dir);
}

TEST(ShardsTest, GlobMatchingNothing) {
  const std::string dir = test::temp_dir();
  DataConfig d = shard_config(dir + "/train_*.bin");
  d.path_pos = SourcePos{"run.toml", 7, 11};
  const std::string msg = test::error_of([&] { make_shard_source(d, 2, 8, 256); });
  EXPECT_TRUE(test::contains(
      msg, "run.toml:7:11: data.pattern '" + dir + "/train_*.bin' matches no " + "files"))
      << msg;
  fs::remove_all(dir);
}

TEST(ShardsTest, ConsecutiveWindowsFollowLlmc) {
  ThreeShards s;
  const int B = 2, T = 8;  // bt = 16: 6, 3 and 4 batches per shard
  auto src = make_shard_source(shard_config(s.pattern()), B, T, 60000);
  const auto got = batches(*src, B, T, 30);  // two epochs and then some
  EXPECT_EQ(got, llmc_sequence(s.tokens, 16, 0, 1, 30));
  // Spelled out: inputs and targets shift by one, windows advance by B*T, the 7th batch is the
  // second shard's first, the 14th is the first shard's first again.
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(got[0].inputs[i], i);
    EXPECT_EQ(got[0].targets[i], i + 1);
    EXPECT_EQ(got[1].inputs[i], 16 + i);
    EXPECT_EQ(got[5].targets[i], 80 + i + 1);
    EXPECT_EQ(got[6].inputs[i], 1000 + i);
    EXPECT_EQ(got[9].inputs[i], 2000 + i);
    EXPECT_EQ(got[13].inputs[i], i);
  }
}

TEST(ShardsTest, RanksReadDisjointStrides) {
  ThreeShards s;
  const int B = 1, T = 8, world = 2;  // each global batch: 16 tokens, rank 1 the second half
  auto r0 = make_shard_source(shard_config(s.pattern()), B, T, 60000, 0, world);
  auto r1 = make_shard_source(shard_config(s.pattern()), B, T, 60000, 1, world);
  const auto a = batches(*r0, B, T, 20), b = batches(*r1, B, T, 20);
  EXPECT_EQ(a, llmc_sequence(s.tokens, 8, 0, 2, 20));
  EXPECT_EQ(b, llmc_sequence(s.tokens, 8, 1, 2, 20));
  // Together one batch of the ranks is 16 consecutive tokens, and no window repeats within a pass.
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(a[0].inputs[i], i);
    EXPECT_EQ(b[0].inputs[i], 8 + i);
    EXPECT_EQ(a[1].inputs[i], 16 + i);
    EXPECT_EQ(b[1].inputs[i], 24 + i);
  }
  std::set<int32_t> starts;
  for (int i = 0; i < 13; ++i) {  // 6 + 3 + 4 global batches in an epoch
    EXPECT_TRUE(starts.insert(a[i].inputs[0]).second);
    EXPECT_TRUE(starts.insert(b[i].inputs[0]).second);
  }
  EXPECT_EQ(r0->state(), r1->state());  // the position is global
}

// The window starts one epoch of a source visits, by shard.
std::multiset<int32_t> epoch_starts(const std::vector<Batch>& v, size_t from, size_t n) {
  std::multiset<int32_t> s;
  for (size_t i = from; i < from + n; ++i)
    s.insert(v[i].inputs[0]);
  return s;
}

TEST(ShardsTest, ShuffleIsDeterministicAndAPermutation) {
  ThreeShards s;
  const int B = 2, T = 8, n = 13 * 3;  // three epochs of 13 batches
  auto plain = make_shard_source(shard_config(s.pattern()), B, T, 60000);
  auto a = make_shard_source(shard_config(s.pattern(), true, 42), B, T, 60000);
  auto b = make_shard_source(shard_config(s.pattern(), true, 42), B, T, 60000);
  auto c = make_shard_source(shard_config(s.pattern(), true, 43), B, T, 60000);
  const auto vp = batches(*plain, B, T, n), va = batches(*a, B, T, n), vb = batches(*b, B, T, n),
             vc = batches(*c, B, T, n);
  EXPECT_EQ(va, vb);
  EXPECT_NE(va, vp);
  EXPECT_NE(va, vc);
  // Each epoch visits every llm.c window exactly once, whole shard by whole shard.
  for (int e = 0; e < 3; ++e) {
    EXPECT_EQ(epoch_starts(va, 13 * e, 13), epoch_starts(vp, 0, 13)) << "epoch " << e;
    for (size_t i = 13 * e; i < size_t(13 * e + 13); ++i) {
      const int32_t start = va[i].inputs[0];
      const auto& shard = s.tokens[start / 1000];
      EXPECT_EQ(va[i], window(shard, size_t(start % 1000), 16));
    }
  }
  // The epochs differ from one another.
  EXPECT_NE(std::vector<Batch>(va.begin(), va.begin() + 13),
            std::vector<Batch>(va.begin() + 13, va.begin() + 26));
  EXPECT_TRUE(test::contains(a->describe(), "shuffled (seed 42)")) << a->describe();

  // Shuffled ranks stay disjoint: the same permutation, each its own stride.
  auto r0 = make_shard_source(shard_config(s.pattern(), true, 42), 1, 8, 60000, 0, 2);
  auto r1 = make_shard_source(shard_config(s.pattern(), true, 42), 1, 8, 60000, 1, 2);
  for (int i = 0; i < 13; ++i) {
    const Batch x = next_batch(*r0, 1, 8), y = next_batch(*r1, 1, 8);
    EXPECT_EQ(y.inputs[0], x.inputs[0] + 8);
  }
}

TEST(ShardsTest, StateRestoreContinuesBitwise) {
  ThreeShards s;
  const int B = 2, T = 8;
  for (bool shuffle : {false, true}) {
    auto a = make_shard_source(shard_config(s.pattern(), shuffle, 9), B, T, 60000);
    batches(*a, B, T, 17);  // into the second epoch, mid-shard
    const std::string state = a->state();
    const auto want = batches(*a, B, T, 40);
    auto b = make_shard_source(shard_config(s.pattern(), shuffle, 9), B, T, 60000);
    batches(*b, B, T, 3);  // anywhere: restore replaces the position
    b->restore(state);
    EXPECT_EQ(b->state(), state);
    EXPECT_EQ(batches(*b, B, T, 40), want) << "shuffle " << shuffle;
  }
}

TEST(ShardsTest, RestoreRejectsOtherData) {
  ThreeShards s;
  auto a = make_shard_source(shard_config(s.pattern()), 2, 8, 60000);
  next_batch(*a, 2, 8);
  const std::string state = a->state();

  // Other shards: the validation pattern matches the 100-token val shard only.
  auto other = make_shard_source(shard_config(s.dir + "/val_*.bin"), 2, 8, 60000);
  std::string msg = test::error_of([&] { other->restore(state); });
  EXPECT_TRUE(test::contains(msg, "belongs to 3 shards of (100,57,80) tokens")) << msg;
  EXPECT_TRUE(test::contains(msg, "matches 1 shards of (100) tokens")) << msg;

  // A batch shape whose batches do not start where the snapshot's position is (token 16 of the
  // first shard; batches of 3 * 8 tokens), another shuffle, garbage.
  auto wide = make_shard_source(shard_config(s.pattern()), 1, 8, 60000, 0, 3);
  msg = test::error_of([&] { wide->restore(state); });
  EXPECT_TRUE(test::contains(msg, "token 16 of " + s.dir + "/train_000000.bin")) << msg;
  EXPECT_TRUE(test::contains(msg, "1 rank x 16 tokens (micro_batch * seq_len) = 16")) << msg;
  EXPECT_TRUE(test::contains(msg, "global batch of 3 x 8 = 24 tokens")) << msg;
  EXPECT_TRUE(test::contains(msg, "that divides 16, such as the snapshot's 16")) << msg;
  auto shuffled = make_shard_source(shard_config(s.pattern(), true), 2, 8, 60000);
  msg = test::error_of([&] { shuffled->restore(state); });
  EXPECT_TRUE(test::contains(msg, "data.shuffle = false")) << msg;
  msg = test::error_of([&] { a->restore("text 100 5"); });
  EXPECT_TRUE(test::contains(msg, "not an llm.c shard source's")) << msg;
  std::string out_of_range = state;
  out_of_range.replace(out_of_range.find("sample=1"), 8, "sample=99");
  msg = test::error_of([&] { a->restore(out_of_range); });
  EXPECT_TRUE(test::contains(msg, "out of range")) << msg;
}

// A position taken at one world size and micro-batch moves to another at the same token, when a
// global batch of the new one starts there: the ranks then read what llm.c's loader at the new
// shape reads from that token on (here to the end of the shard and on through the next ones).
TEST(ShardsTest, RestoreAtAnotherWorldSizeKeepsTheTokenPosition) {
  ThreeShards s;
  const int T = 8;
  // 4 ranks x B 1: 2 global batches of 32 tokens (into the first shard: token 64).
  std::vector<std::unique_ptr<DataSource>> four;
  for (int r = 0; r < 4; ++r) {
    four.push_back(make_shard_source(shard_config(s.pattern()), 1, T, 60000, r, 4));
    batches(*four.back(), 1, T, 2);
  }
  const std::string state = four[0]->state();
  for (int r = 1; r < 4; ++r)
    EXPECT_EQ(four[size_t(r)]->state(), state);
  // At 2 ranks x B 1 (16-token global batches), 1 rank x B 2, and 1 rank x B 4: batch 4, 4, 2.
  for (const auto& [world, B] : {std::pair<int, int>{2, 1}, {1, 2}, {1, 4}}) {
    for (int r = 0; r < world; ++r) {
      auto src = make_shard_source(shard_config(s.pattern()), B, T, 60000, r, world);
      src->restore(state);
      const size_t bt = size_t(B) * T, global = bt * size_t(world);
      auto want = llmc_sequence(s.tokens, bt, size_t(r), size_t(world), 12);
      want.erase(want.begin(), want.begin() + long(64 / global));
      want.resize(6);
      EXPECT_EQ(batches(*src, B, T, 6), want) << world << " ranks x B " << B << ", rank " << r;
    }
  }
  // At 3 ranks x B 1: 64 is no multiple of 24, so the position is refused, saying what would do.
  auto three = make_shard_source(shard_config(s.pattern()), 1, T, 60000, 0, 3);
  std::string msg = test::error_of([&] { three->restore(state); });
  EXPECT_TRUE(test::contains(msg, "token 64 of")) << msg;
  EXPECT_TRUE(test::contains(msg, "is no multiple of this run's global batch of 3 x 8 = 24 tokens"))
      << msg;
  EXPECT_TRUE(test::contains(msg, "that divides 64, such as the snapshot's 32")) << msg;

  // Shuffled, the batch order is a permutation of the shard's global batches: only the same
  // global batch maps (4 x 1 = 2 x 2 ranks x micro_batch), and another is refused naming it.
  auto a = make_shard_source(shard_config(s.pattern(), true, 7), 1, T, 60000, 1, 4);
  batches(*a, 1, T, 3);
  const std::string sstate = a->state();
  const auto want = batches(*a, 1, T, 5);  // rank 1 of 4: the second 8 tokens of each batch
  auto b0 = make_shard_source(shard_config(s.pattern(), true, 7), 2, T, 60000, 0, 2);
  b0->restore(sstate);
  for (const Batch& w : want) {
    const Batch got = next_batch(*b0, 2, T);  // rank 0 of 2, B 2: the first 16 tokens
    EXPECT_EQ(std::vector<int32_t>(got.inputs.begin() + T, got.inputs.end()), w.inputs);
  }
  auto c = make_shard_source(shard_config(s.pattern(), true, 7), 1, T, 60000, 0, 2);
  msg = test::error_of([&] { c->restore(sstate); });
  EXPECT_TRUE(test::contains(msg,
                             "data.shuffle = true over global batches of 4 ranks x 8 tokens "
                             "(micro_batch * seq_len) = 32 tokens; this run's are 2 x 8 = 16"))
      << msg;
  EXPECT_TRUE(test::contains(msg, "(micro_batch = 2 at 2 ranks)")) << msg;
}

TEST(ShardsTest, TokenAboveVocabNamesShardAndOffset) {
  const std::string dir = test::temp_dir();
  std::vector<uint16_t> tokens = ramp(100, 0);
  tokens[37] = 50300;
  const std::string p = write_shard(dir + "/s.bin", tokens);
  auto src = make_shard_source(shard_config(p), 2, 8, 50257);
  next_batch(*src, 2, 8);  // tokens 0..16
  next_batch(*src, 2, 8);  // tokens 16..32
  const std::string msg = test::error_of([&] { next_batch(*src, 2, 8); });
  EXPECT_EQ(msg, p + ": token 50300 at offset 37 is >= model.vocab_size 50257");
  fs::remove_all(dir);
}

// A sparse shard of 2^31 - 1 tokens (a file over 4 GiB): the last batch lies past 4 GiB.
TEST(ShardsTest, ShardOver4GiB) {
  const std::string dir = test::temp_dir();
  const std::string path = dir + "/big.bin";
  struct Cleanup {
    std::string dir;
    ~Cleanup() { fs::remove_all(dir); }
  } cleanup{dir};

  const uint64_t count = (uint64_t(1) << 31) - 1;
  const uint64_t size = 1024 + 2 * count;
  ASSERT_GT(size, uint64_t(4) << 30);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, off_t(size)), 0);
  int32_t header[256] = {};
  header[0] = kShardMagic;
  header[1] = 1;
  header[2] = int32_t(count);
  ASSERT_EQ(::pwrite(fd, header, sizeof header, 0), ssize_t(sizeof header));
  // B*T = 16: floor((count - 1) / 16) = 134217727 batches; the last starts at token 2147483616,
  // byte 1024 + 2 * 2147483616 = 4294968256, past 4 GiB.
  const int B = 2, T = 8;
  const uint64_t last = 134217726, pos = last * 16;
  const uint64_t byte = 1024 + 2 * pos;
  ASSERT_GT(byte, uint64_t(4) << 30);
  const std::vector<uint16_t> far = ramp(17, 1000), near = ramp(17, 7);
  ASSERT_EQ(::pwrite(fd, far.data(), 34, off_t(byte)), 34);
  ASSERT_EQ(::pwrite(fd, near.data(), 34, 1024), 34);
  ::close(fd);

  EXPECT_EQ(validate_shard(path, 17).tokens, count);
  EXPECT_EQ(read_tokens(path, pos, 17), far);

  auto src = make_shard_source(shard_config(path), B, T, 50257);
  std::string state = src->state();
  state.replace(state.find("sample=0"), 8, "sample=" + std::to_string(last));
  src->restore(state);
  const Batch b = next_batch(*src, B, T);
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(b.inputs[i], 1000 + i);
    EXPECT_EQ(b.targets[i], 1001 + i);
  }
  // That was the last batch: the next wraps to the start of the shard.
  EXPECT_EQ(next_batch(*src, B, T), window(near, 0, 16));

  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_LT(uint64_t(st.st_blocks) * 512, uint64_t(1) << 20) << "the test file must stay sparse";
}

}  // namespace
}  // namespace headroom
