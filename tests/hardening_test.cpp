// The second hostile round (issues 32 and 38): input that used to be taken for something else, or
// to crash, or to lose data with exit 0. Each case ends in a message naming the file, key or flag
// and its documented exit code (README.md, "Exit codes"), with nothing written half. The cases
// across ranks are in tests/mpi/agree_test.sh; docs/results/robustness.md lists them all.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/data/bpe_tokenizer.h"
#include "core/model/generate.h"
#include "core/model/safetensors.h"
#include "core/os/interrupt.h"
#include "core/os/output_file.h"
#include "core/run/rank_agreement.h"
#include "core/run/snapshot.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;
using test::contains;
using test::run_headroom;
using test::write_file;

const char* kText =
    "[model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nseq_len = 16\nvocab_size = 512\n"
    "[train]\nsteps = 2\nmicro_batch = 2\n[data]\nkind = \"text\"\npath = \"t.txt\"\n";

struct Hardening : ::testing::Test {
  std::string dir = test::temp_dir();
  std::string text_config() {
    std::string text;
    for (int i = 0; i < 500; ++i)
      text += "hello world ";
    write_file(dir, "t.txt", text);  // 6000 bytes
    return write_file(dir, "a.toml", kText);
  }
};

// --- numbers out of range and numeric flags -----------------------------------------------------

// A number TOML cannot hold was taken as a bare word ("expected a number, got string").
TEST_F(Hardening, SetOfANumberOutOfRangeNamesTheKeyAndSaysOutOfRange) {
  const std::string cfg = text_config();
  for (const std::string set : {"train.lr=1e400", "train.steps=99999999999999999999"}) {
    const auto r = run_headroom("check " + cfg + " --set " + set);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    const std::string key = set.substr(0, set.find('='));
    const std::string value = set.substr(set.find('=') + 1);
    EXPECT_TRUE(contains(r.output, "--set " + set + ": " + key + ": " + value + " is out of range"))
        << r.output;
    EXPECT_FALSE(contains(r.output, "got string")) << r.output;
  }
  // A word is still a string.
  EXPECT_TRUE(
      contains(test::error_of([] { parse_config("[train]\n", "x.toml", {"train.lr=fast"}); }),
               "expected a number, got string"));
}

// sample's flags are checked as the config's numbers are: a NaN temperature drew the least likely
// token every time.
TEST_F(Hardening, SampleRefusesANonFiniteTemperatureNamingTheFlag) {
  const std::string cfg = text_config();
  for (const std::string t : {"nan", "inf", "-1", "1e400", "2x"}) {
    const auto r = run_headroom("sample " + cfg + " --prompt hi --tokens 2 --temperature " + t);
    EXPECT_EQ(r.exit_code, 2) << t << ": " << r.output;
    EXPECT_TRUE(contains(r.output, "--temperature: ")) << r.output;
    EXPECT_TRUE(contains(r.output, "a finite number from 0 to 100")) << r.output;
  }
  const auto seed = run_headroom("sample " + cfg + " --prompt hi --tokens 2 --seed -1");
  EXPECT_EQ(seed.exit_code, 2) << seed.output;
  EXPECT_TRUE(contains(seed.output, "--seed")) << seed.output;
  const auto ok = run_headroom("sample " + cfg + " --prompt hi --tokens 2 --temperature 0.5");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  // The library refuses it too, for hosts that embed it.
  SampleParams p;
  p.temperature = NAN;
  std::mt19937_64 rng(1);
  const Config c = test::config_from(
      "[model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nseq_len = 16\nvocab_size = 64\n");
  std::unique_ptr<Device> device = Device::create(c.device);
  Gpt<float> model(c.model, *device, 1);
  EXPECT_THROW(generate(model, {1, 2}, 2, p), std::invalid_argument);
}

// Every numeric flag of every command, given NaN, an infinity, a negative, a number past any range
// and a whole number past 2^64: exit 2 naming the flag, before any work (a --seed of 10^23 was
// wrapped and taken, exit 0).
TEST_F(Hardening, EveryNumericFlagRefusesNonFiniteAndOutOfRangeValuesNamingTheFlag) {
  const std::string cfg = text_config();
  const std::string trace = dir + "/a.trace";
  ASSERT_EQ(run_headroom("train -q " + cfg + " --record-allocs " + trace).exit_code, 0);
  const std::string text = dir + "/t.txt", out = dir + "/shards";
  const std::string sample = "sample " + cfg + " --prompt hi ";
  struct Flag {
    std::string command, flag, prefix;  // prefix: what the value is glued to ("" or a unit)
  } flags[] = {
      {"train " + cfg, "--timeline-step", ""},
      {"plan " + cfg + " --measure --search", "--deadline", ""},
      {"plan " + cfg + " --measure --search", "--budget", "MiB"},
      {"shard " + text + " " + out, "--tokens-per-shard", ""},
      {"replay " + trace, "--memory-limit", "MiB"},
      {sample, "--tokens", ""},
      {sample + "--tokens 2", "--temperature", ""},
      {sample + "--tokens 2", "--top-k", ""},
      {sample + "--tokens 2", "--seed", ""},
  };
  for (const Flag& f : flags) {
    for (const std::string v : {"nan", "inf", "-1", "1e400", "99999999999999999999999"}) {
      const std::string value = f.prefix.empty() || v == "nan" || v == "inf" ? v : v + f.prefix;
      const auto r = run_headroom(f.command + " " + f.flag + " " + value);
      EXPECT_EQ(r.exit_code, 2) << f.flag << " " << value << ": " << r.output;
      EXPECT_TRUE(contains(r.output, f.flag)) << f.flag << " " << value << ": " << r.output;
    }
  }
  // A seed is any whole number that fits 64 bits, and only that.
  const auto big = run_headroom(sample + "--tokens 2 --seed 18446744073709551615");
  EXPECT_EQ(big.exit_code, 0) << big.output;
  const auto past = run_headroom(sample + "--tokens 2 --seed 18446744073709551616");
  EXPECT_TRUE(contains(past.output,
                       "--seed: must be a whole number from 0 to "
                       "18446744073709551615, got 18446744073709551616 (out of "
                       "range)"))
      << past.output;
  EXPECT_TRUE(contains(run_headroom(sample + "--tokens 2 --seed 1.5").output,
                       "--seed: must be a whole number from 0 to 18446744073709551615, got '1.5'"));
}

// --- validation data ----------------------------------------------------------------------------

TEST_F(Hardening, ValFractionThatLeavesTooLittleSaysWhatItLeavesAndWhichWay) {
  const std::string cfg = text_config();
  const auto big =
      run_headroom("check " + cfg + " --set data.val_fraction=0.9999 --set train.eval_every=1");
  EXPECT_EQ(big.exit_code, 2) << big.output;
  EXPECT_TRUE(contains(big.output, "data.val_fraction = 0.9999 (99.99%) of data.path"))
      << big.output;
  EXPECT_TRUE(contains(big.output, "(6000 bytes) leaves 1 byte for training")) << big.output;
  EXPECT_TRUE(contains(big.output, "choose a smaller fraction")) << big.output;
  const auto small =
      run_headroom("train -q " + cfg + " --set data.val_fraction=0.001 --set train.eval_every=1");
  EXPECT_EQ(small.exit_code, 2) << small.output;
  EXPECT_TRUE(contains(small.output, "leaves 6 bytes for validation")) << small.output;
  EXPECT_TRUE(contains(small.output, "choose a larger fraction")) << small.output;
}

// check opens what train opens before step 1: the validation file too.
TEST_F(Hardening, CheckRefusesAMissingValPathAsTrainDoes) {
  const std::string cfg = text_config();
  const std::string sets =
      " --set 'data.val_path=\"" + dir + "/none.txt\"' --set train.eval_every=1";
  const auto check = run_headroom("check " + cfg + sets);
  const auto train = run_headroom("train -q " + cfg + sets);
  EXPECT_EQ(check.exit_code, 2) << check.output;
  EXPECT_EQ(train.exit_code, 2) << train.output;
  for (const auto* r : {&check, &train})
    EXPECT_TRUE(contains(r->output, "data.val_path '" + dir + "/none.txt': cannot open"))
        << r->output;
}

// --- tokenizer files ----------------------------------------------------------------------------

// GPT-2's bytes_to_unicode: each byte's character in the vocabulary's strings, as UTF-8.
std::string byte_char(int b) {
  const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
  int cp = b;
  if (!printable) {
    cp = 256;
    for (int x = 0; x < b; ++x)
      if (!((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE)) ++cp;
  }
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

// A tokenizer.json of a byte-level BPE with the byte tokens but `without`, then the 256
// "<0xHH>" fallback tokens but those of `without_fallback`, no merges.
std::string tokenizer_json(const std::vector<int>& without, bool byte_fallback,
                           const std::vector<int>& without_fallback = {}) {
  nlohmann::json vocab = nlohmann::json::object();
  int id = 0;
  for (int b = 0; b < 256; ++b)
    if (std::find(without.begin(), without.end(), b) == without.end()) vocab[byte_char(b)] = id++;
  if (byte_fallback)
    for (int b = 0; b < 256; ++b) {
      if (std::find(without_fallback.begin(), without_fallback.end(), b) != without_fallback.end())
        continue;
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      vocab[name] = id++;
    }
  nlohmann::json j = {{"added_tokens", nlohmann::json::array()},
                      {"normalizer", nullptr},
                      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
                      {"model",
                       {{"type", "BPE"},
                        {"byte_fallback", byte_fallback},
                        {"vocab", vocab},
                        {"merges", nlohmann::json::array()}}}};
  return j.dump();
}

// A vocabulary id of 2^31 - 1 made the tokenizer size its tables by it: std::bad_alloc, exit 1.
TEST_F(Hardening, TokenizerWithAHugeIdNamesTheFileAndTheIdBeforeAllocating) {
  const std::string vocab = write_file(
      dir, "huge.json",
      R"({"pre_tokenizer": {"type": "ByteLevel"}, "model": {"type": "BPE", "vocab": {"a": 0, "b": 2000000000}, "merges": []}})");
  const std::string msg = test::error_of([&] { load_tokenizer(vocab); });
  EXPECT_TRUE(contains(msg, vocab + ": vocabulary token \"b\" has id 2000000000")) << msg;
  EXPECT_TRUE(contains(msg, "ids run from 0 to 16777215")) << msg;
  const std::string added = write_file(
      dir, "added.json",
      R"({"pre_tokenizer": {"type": "ByteLevel"}, "added_tokens": [{"content": "<|x|>", "id": 4000000000}], "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})");
  const std::string amsg = test::error_of([&] { load_tokenizer(added); });
  EXPECT_TRUE(contains(amsg, added + ": added token \"<|x|>\" has id 4000000000")) << amsg;
  write_file(dir, "t.txt", "some text");
  const auto r = run_headroom("shard " + dir + "/t.txt " + dir + "/out --tokenizer " + vocab);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "has id 2000000000")) << r.output;
}

// Without its 'z' token a byte-level BPE dropped every 'z' from the shards, exit 0.
TEST_F(Hardening, ByteLevelTokenizerMissingByteTokensIsRefusedAtLoadNamingThem) {
  const std::string tok = write_file(dir, "noz.json", tokenizer_json({'z', '\n'}, false));
  const std::string msg = test::error_of([&] { load_tokenizer(tok); });
  EXPECT_TRUE(contains(msg, tok + ": a byte-level BPE needs a token for each of the 256 bytes"))
      << msg;
  EXPECT_TRUE(contains(msg, "it has none for 2 (0x0a, 0x7a 'z')")) << msg;
  write_file(dir, "t.txt", "fizz buzz\n");
  const auto r = run_headroom("shard " + dir + "/t.txt " + dir + "/out --tokenizer " + tok);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "0x7a 'z'")) << r.output;
  EXPECT_FALSE(fs::exists(dir + "/out/shard_000000.bin"));
}

// With byte fallback a byte without a token of its own is spelt by the "<0xHH>" tokens of its
// character's UTF-8 bytes, as Hugging Face's BPE spells it ('z' is 0x7A; ' ' is GPT-2's 'Ġ',
// U+0120, whose UTF-8 is C4 A0), and decodes back to the byte.
TEST_F(Hardening, ByteFallbackMapsBytesToTheirFallbackIds) {
  const std::string tok = write_file(dir, "fb.json", tokenizer_json({'z', ' '}, true));
  const auto t = load_tokenizer(tok);
  const nlohmann::json vocab = nlohmann::json::parse(test::read_file(tok))["model"]["vocab"];
  const std::vector<int32_t> want = {vocab["a"].get<int32_t>(), vocab["<0x7A>"].get<int32_t>(),
                                     vocab["<0xC4>"].get<int32_t>(), vocab["<0xA0>"].get<int32_t>(),
                                     vocab["b"].get<int32_t>()};
  EXPECT_EQ(t->encode("az b"), want);
  EXPECT_EQ(t->decode(want), "az b");
  EXPECT_EQ(t->token_bytes(vocab["<0x7A>"].get<int32_t>()), "z");
}

// With byte fallback but neither 'z' nor "<0x7A>", text holding a 'z' is refused naming it: a
// prompt, and a shard.
TEST_F(Hardening, APromptOfBytesTheTokenizerCannotEncodeSaysWhichBytes) {
  const std::string tok = write_file(dir, "fbz.json", tokenizer_json({'z'}, true, {'z'}));
  const std::string cfg = text_config();
  const auto r =
      run_headroom("sample " + cfg + " --tokenizer " + tok + " --prompt 'fizz' --tokens 2");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, tok + ": cannot encode the byte 0x7a 'z' of the text"))
      << r.output;
  const auto ok =
      run_headroom("sample " + cfg + " --tokenizer " + tok + " --prompt 'fig' --tokens 2");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  write_file(dir, "z.txt", "fizz buzz\n");
  const auto s = run_headroom("shard " + dir + "/z.txt " + dir + "/out --tokenizer " + tok);
  EXPECT_EQ(s.exit_code, 2) << s.output;
  EXPECT_FALSE(fs::exists(dir + "/out/shard_000000.bin"));
}

// --- one run per output -------------------------------------------------------------------------

// The lock itself: a second holder in this process is refused naming the output, one in another
// process naming its pid; the lock file goes with the lock, and a stale one is taken over.
TEST_F(Hardening, AnOutputLockRefusesASecondHolderNamingIt) {
  const std::string out = dir + "/m.jsonl", lock = dir + "/.m.jsonl.lock";
  {
    OutputLock a(out, "--metrics");
    EXPECT_EQ(a.lock_path(), lock);
    EXPECT_EQ(test::read_file(lock), std::to_string(::getpid()) + "\n");
    const std::string msg = test::error_of([&] { OutputLock b(out, "--metrics"); });
    EXPECT_TRUE(contains(msg, "--metrics " + out + ": this run writes it already")) << msg;
  }
  EXPECT_FALSE(fs::exists(lock)) << "the lock file goes with the lock";
  // Another process holds it (flock(1) on a file that holds a pid, as a run writes it).
  const auto held = test::run_command("echo 4242 > " + lock + "; (exec 9>>" + lock +
                                      "; flock -n 9 && exec sleep 30) >/dev/null 2>&1 & echo $!; "
                                      "sleep 0.3");
  const std::string holder = held.output.substr(0, held.output.find('\n'));
  ASSERT_FALSE(holder.empty()) << held.output;
  const std::string msg = test::error_of([&] { OutputLock b(out, "--metrics"); });
  EXPECT_TRUE(contains(msg, "another headroom run (pid 4242) is writing it (it holds " + lock))
      << msg;
  test::run_command("kill " + holder);
  // A folder's lock is beside it; a stale file (no holder) is taken over.
  fs::create_directories(dir + "/snaps");
  test::write_file(dir, ".snaps.lock", "999999\n");
  OutputLock folder(dir + "/snaps/", "snapshot.dir");
  EXPECT_EQ(folder.lock_path(), dir + "/.snaps.lock");
  // Not a file or a folder: nothing to lock.
  EXPECT_EQ(OutputLock("/dev/null", "--metrics").lock_path(), "");
}

// Two runs on one --metrics file or one snapshot folder: the second truncated the first's metrics
// (6 of 293 lines not JSON) and its snapshot.keep pruned the other's snapshots. Now the second
// exits 2 before it writes a byte, naming the first's pid, and the first goes on untouched.
TEST_F(Hardening, ASecondRunOnAnotherRunsOutputsExits2NamingItsPid) {
  const std::string cfg = write_file(
      dir, "r.toml",
      "[model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nseq_len = 16\nvocab_size = 64\n"
      "[train]\nsteps = 1000000\nmicro_batch = 2\n[snapshot]\nevery = 5\nkeep = 2\ndir = \"" +
          dir + "/snaps\"\n");
  const std::string m = dir + "/m.jsonl", H = HEADROOM_BINARY;
  const std::string script =
      "bash -c '" + H + " train -q " + cfg + " --metrics " + m + " & pid=$!; echo first=$pid; " +
      "for i in $(seq 1 600); do [ $(wc -l < " + m + " 2>/dev/null || echo 0) -ge 3 ] && break; " +
      "sleep 0.05; done; " + H + " train -q " + cfg + " --metrics " + m +
      " --set snapshot.every=0; echo metrics=$?; " + H + " train -q " + cfg + " --metrics " + dir +
      "/other.jsonl; echo snaps=$?; " + H + " train -q " + cfg + " --metrics " + dir +
      "/self.jsonl --record-allocs " + dir + "/self.jsonl" +
      " --set snapshot.every=0 --set train.steps=1 2>&1 | head -1; " +
      "kill -INT $pid; wait $pid; echo first_exit=$?'";
  const auto r = test::run_command(script);
  const size_t at = r.output.find("first=");
  ASSERT_NE(at, std::string::npos) << r.output;
  const std::string pid = r.output.substr(at + 6, r.output.find('\n', at) - at - 6);
  EXPECT_TRUE(contains(r.output, "metrics=2")) << r.output;
  EXPECT_TRUE(contains(r.output, "headroom: error: --metrics " + m +
                                     ": another headroom run (pid " + pid + ") is writing it"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "snaps=2")) << r.output;
  EXPECT_TRUE(contains(r.output, "snapshot.dir " + dir + "/snaps: another headroom run (pid " +
                                     pid + ") is writing it"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "this run writes it already")) << r.output;
  EXPECT_TRUE(contains(r.output, "first_exit=130")) << r.output;
  // The first run's metrics are its own, every line whole, from step 1 on.
  std::istringstream in(test::read_file(m));
  std::string line;
  int64_t step = 0;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    EXPECT_EQ(j["step"].get<int64_t>(), ++step);
  }
  EXPECT_GE(step, 3);
  EXPECT_FALSE(fs::exists(dir + "/other.jsonl")) << "the refused run wrote nothing";
  EXPECT_FALSE(fs::exists(dir + "/.m.jsonl.lock")) << "the lock went with the first run";
}

// --- the planner --------------------------------------------------------------------------------

// On the CPU the device's memory is the host's: a config that needs more than the host has was
// planned "memory_limit: none", exit 0. (The host's memory stands in as HEADROOM_TEST_HOST_MEMORY.)
TEST_F(Hardening, PlanOfAConfigNeedingMoreThanTheHostHasDoesNotSayItFits) {
  const std::string cfg = text_config();
  const std::string small = "HEADROOM_TEST_HOST_MEMORY=100000 ";
  const auto r = test::run_command(small + HEADROOM_BINARY + " plan " + cfg);
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_TRUE(contains(r.output, "does not fit this host: needs about ")) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "the CPU device's memory is the host's, 97.66 KiB available "
                       "(HEADROOM_TEST_HOST_MEMORY)"))
      << r.output;
  const auto m = test::run_command(small + HEADROOM_BINARY + " plan " + cfg + " --measure");
  EXPECT_EQ(m.exit_code, 3) << m.output;
  EXPECT_TRUE(contains(m.output, "does not fit this host")) << m.output;
  // A memory_limit above what the host has is not believed either.
  const auto l = test::run_command(small + HEADROOM_BINARY + " plan " + cfg +
                                   " --set 'device.memory_limit=\"1GiB\"'");
  EXPECT_EQ(l.exit_code, 3) << l.output;
  // With room it fits and says against what.
  const auto ok = test::run_command("HEADROOM_TEST_HOST_MEMORY=1000000000 " +
                                    std::string(HEADROOM_BINARY) + " plan " + cfg);
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_TRUE(contains(ok.output, "memory_limit: none; the CPU device's memory is the host's, "))
      << ok.output;
}

// --- ranks that disagree (the runs across ranks: tests/mpi/agree_test.sh) -----------------------

// What the ranks compare: the flags, then every key of the resolved config, plugin keys by their
// plugin's name, but for those that may differ per rank.
TEST_F(Hardening, TheRanksCompareEveryKeyButThePerRankOnes) {
  const Config c = test::config_from(
      "[model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nseq_len = 16\nvocab_size = 64\n"
      "[train]\nlr = 0.002\n[device]\nthreads = 2\n[[plugins]]\nname = \"amp\"\n"
      "dtype = \"fp16\"\n");
  const std::vector<AgreementItem> items = agreement_items(c, {{"--resume", "no"}});
  auto value = [&](const std::string& key) {
    for (const AgreementItem& i : items)
      if (i.first == key) return i.second;
    return std::string("(absent)");
  };
  ASSERT_FALSE(items.empty());
  EXPECT_EQ(items[0], AgreementItem("--resume", "no"));
  EXPECT_EQ(value("train.lr"), "0.002");
  EXPECT_EQ(value("model.n_embd"), "16");
  EXPECT_EQ(value("train.steps"), "200");
  EXPECT_EQ(value("plugins.amp.dtype"), "'fp16'");
  EXPECT_EQ(value("distributed.timeout_s"), "6e+01");
  for (const char* k : {"device.index", "device.threads", "data.workers", "data.prefetch"})
    EXPECT_EQ(value(k), "(absent)") << k;
  // One rank alone has nothing to compare with.
  std::unique_ptr<Device> device = Device::create(c.device);
  std::unique_ptr<Communicator> self = make_local_communicator(*device);
  check_ranks_agree(items, *self);
}

// --- sample -------------------------------------------------------------------------------------

// sample could not read a pruned model's snapshot or weights (its error read like damage), and on
// headroom's own weights without --config it guessed n_head = 1. The weights record the model's
// shape in their metadata, and every source samples the same tokens.
TEST_F(Hardening, SampleReadsAPrunedModelFromEverySourceAndTheWeightsShape) {
  // A model pruned by `mode` (heads, mlp), with a snapshot of its last step and its weights.
  auto pruned = [&](const std::string& mode) {
    return write_file(
        dir, mode + ".toml",
        "[model]\nn_layer = 2\nn_head = 4\nn_embd = 32\nseq_len = 16\nvocab_size = 256\n"
        "[train]\nsteps = 3\nmicro_batch = 2\n[snapshot]\nevery = 3\ndir = \"" +
            dir + "/" + mode + "-snaps\"\n[[plugins]]\nname = \"pruning\"\nmode = \"" + mode +
            "\"\nfinal_sparsity = 0.5\nstart_step = 1\nend_step = 2\nevery = 1\n");
  };
  const std::string args = " --prompt hi --tokens 6 --ids";
  for (const std::string mode : {"heads", "mlp"}) {
    const std::string cfg = pruned(mode), w = dir + "/" + mode + ".safetensors";
    const auto trained = run_headroom("train -q " + cfg + " --save-weights " + w);
    ASSERT_EQ(trained.exit_code, 0) << trained.output;
    std::map<std::string, std::string> meta;
    read_safetensors_header(w, &meta);
    EXPECT_EQ(meta["n_head"], "4");
    EXPECT_EQ(meta["n_layer"], "2");
    EXPECT_EQ(meta["n_embd"], "32");
    EXPECT_EQ(meta[mode == "heads" ? "attn_heads" : "mlp_hidden"],
              mode == "heads" ? "2,2" : "64,64");
    std::vector<std::string> outs;
    for (const std::string& source :
         {dir + "/" + mode + "-snaps", w, cfg, w + " --config " + cfg}) {
      const auto r = run_headroom("sample " + source + args);
      EXPECT_EQ(r.exit_code, 0) << mode << " " << source << ": " << r.output;
      EXPECT_FALSE(contains(r.output, "does not record n_head")) << r.output;
      // The ids line (stdout) among the log lines (stderr): the prompt's "104 105" first.
      const size_t at = r.output.find("104 105 ");
      outs.push_back(at == std::string::npos ? std::string()
                                             : r.output.substr(at, r.output.find('\n', at) - at));
    }
    EXPECT_FALSE(outs[0].empty());
    for (const std::string& o : outs)
      EXPECT_EQ(o, outs[0]) << mode;
  }
}

// --- resuming across an optimizer plugin --------------------------------------------------------

// A snapshot of the built-in AdamW resumed with an optimizer plugin, and the other way round: the
// refusal names the plugin (it said "this config uses plugin").
TEST_F(Hardening, ResumingAcrossAnOptimizerPluginNamesThePlugin) {
  SnapshotData adamw;
  adamw.optimizer = "adamw";
  EXPECT_EQ(optimizer_mismatch(adamw, "plugin", "adafactor", {"adafactor"}),
            "was made with optimizer adamw, this config uses the optimizer of plugin 'adafactor' "
            "(resume it without plugin 'adafactor', or start afresh without --resume)");
  // A snapshot names its optimizer plugin, whose state it may not hold (the amp state is
  // another plugin's, which this run lacks too).
  SnapshotData plugin;
  plugin.optimizer = plugin_optimizer_signature("lion");
  plugin.plugins["amp"] = {4};
  EXPECT_EQ(optimizer_mismatch(plugin, "adamw", "", {}),
            "was made with the optimizer of plugin 'lion', this config uses adamw (list 'lion' "
            "in [[plugins]] again to resume it, or start afresh without --resume)");
  EXPECT_EQ(optimizer_mismatch(plugin, plugin_optimizer_signature("adafactor"), "adafactor",
                               {"adafactor"}),
            "was made with the optimizer of plugin 'lion', this config uses the optimizer of "
            "plugin 'adafactor' (list 'lion' in [[plugins]] instead of 'adafactor' to resume it, "
            "or start afresh without --resume)");
  EXPECT_FALSE(same_optimizer(plugin.optimizer, plugin_optimizer_signature("adafactor")));
  EXPECT_TRUE(same_optimizer(plugin.optimizer, plugin_optimizer_signature("lion")));
  // A snapshot from before the name was recorded says "plugin": named by the states it holds,
  // and any optimizer plugin may resume it.
  SnapshotData old;
  old.optimizer = "plugin";
  old.plugins["adafactor"] = {1, 2, 3};
  old.plugins["amp"] = {4};
  EXPECT_EQ(optimizer_mismatch(old, "adamw", "", {"amp"}),
            "was made with optimizer of plugin 'adafactor' (whose state it holds), this config "
            "uses adamw (list 'adafactor' in [[plugins]] again to resume it, or start afresh "
            "without --resume)");
  EXPECT_TRUE(same_optimizer(old.optimizer, plugin_optimizer_signature("adafactor")));
  EXPECT_TRUE(contains(optimizer_mismatch(adamw, "sgd", "", {}),
                       "this config uses sgd (set train.optimizer = \"adamw\" to resume it"));
  // Through the host, both ways.
  const std::string model =
      "[model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nseq_len = 16\nvocab_size = 64\n"
      "[train]\nsteps = 2\nmicro_batch = 2\n";
  const std::string plain = write_file(dir, "plain.toml", model);
  const std::string ada =
      write_file(dir, "ada.toml", model + "[[plugins]]\nname = \"adafactor\"\n");
  const std::string snap = " --set snapshot.every=2 --set 'snapshot.dir=\"" + dir + "/s\"'";
  const std::string resume = " --resume " + dir + "/s --set train.steps=4";
  ASSERT_EQ(run_headroom("train -q " + plain + snap).exit_code, 0);
  const auto r = run_headroom("train -q " + ada + resume);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "was made with optimizer adamw, this config uses the optimizer "
                       "of plugin 'adafactor'"))
      << r.output;
  fs::remove_all(dir + "/s");
  ASSERT_EQ(run_headroom("train -q " + ada + snap).exit_code, 0);
  const auto back = run_headroom("train -q " + plain + resume);
  EXPECT_EQ(back.exit_code, 2) << back.output;
  EXPECT_TRUE(contains(back.output,
                       "was made with the optimizer of plugin 'adafactor', this config uses adamw "
                       "(list 'adafactor' in [[plugins]] again"))
      << back.output;
}

// --- a stop during evaluation -------------------------------------------------------------------

// What the validation asks between its batches (one max over the ranks; the local request alone).
TEST_F(Hardening, AStopRequestOfAnyRankIsSeen) {
  const Config c = test::config_from("[model]\npreset = \"tiny\"\n");
  std::unique_ptr<Device> device = Device::create(c.device);
  std::unique_ptr<Communicator> self = make_local_communicator(*device);
  clear_stop();
  EXPECT_EQ(stop_signal_of_any_rank(*self), 0);
  request_stop(SIGTERM);
  EXPECT_EQ(stop_signal_of_any_rank(*self), SIGTERM);
  clear_stop();
}

}  // namespace
}  // namespace headroom
