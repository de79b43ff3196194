// The plugin ABI through the real loader: test plugins in plain C (tests/abi/plugins) run by the
// host binary from TOML files. Load errors and their messages, event order across plugins, step
// vetoes, the allocator and optimizer roles, hook failures, plugin config keys, the frozen v1.0
// header, a descriptor from a newer minor version, `headroom plugins`, and what the libraries
// export.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/plugin_host/plugin_host.h"
#include "headroom/plugin.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;
using test::run_headroom;
using test::write_file;

const std::string kPluginDir = HEADROOM_TEST_PLUGIN_DIR;

// 3 layers seen by plugins: 0 = embedding, 1 = the one block, 2 = the head.
const char* kTinyModel =
    "[model]\nn_layer = 1\nn_head = 1\nn_embd = 8\nseq_len = 4\nvocab_size = 16\n"
    "[train]\nsteps = 2\nmicro_batch = 1\ngrad_accum = 2\n";

std::vector<std::string> read_lines(const std::string& path) {
  std::vector<std::string> lines;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);)
    lines.push_back(line);
  return lines;
}

std::vector<std::string> split(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> words;
  for (std::string w; in >> w;)
    words.push_back(w);
  return words;
}

std::string join(const std::vector<std::string>& lines) {
  std::string s;
  for (const auto& l : lines)
    s += l + "\n";
  return s;
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// The 1-based line of `text` on which `needle` first appears (0 if it does not).
int line_of(const std::string& text, const std::string& needle) {
  const size_t at = text.find(needle);
  if (at == std::string::npos) return 0;
  return 1 + static_cast<int>(std::count(text.begin(), text.begin() + at, '\n'));
}

// The value of `key=` among the words of a recorded line ("" if absent).
std::string field(const std::string& line, const std::string& key) {
  for (const auto& w : split(line))
    if (w.rfind(key + "=", 0) == 0) return w.substr(key.size() + 1);
  return "";
}

std::vector<double> losses(const std::string& metrics_path) {
  std::vector<double> out;
  for (const auto& line : read_lines(metrics_path))
    if (!line.empty()) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
  return out;
}

// A copy of a test plugin in `dir`, with mode `mode` (the copy's own, not the build's).
std::string copy_plugin(const std::string& name, const std::string& dir, fs::perms mode) {
  const fs::path to = fs::path(dir) / (name + ".so");
  fs::copy_file(fs::path(kPluginDir) / (name + ".so"), to, fs::copy_options::overwrite_existing);
  fs::permissions(to, mode);
  return to.string();
}

const fs::perms kMode755 = fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                           fs::perms::others_read | fs::perms::others_exec;

struct PluginAbi : ::testing::Test {
  std::string dir = test::temp_dir();
  std::string saved_path;
  bool had_path = false;

  void SetUp() override {
    if (const char* p = std::getenv("HEADROOM_PLUGIN_PATH")) {
      had_path = true;
      saved_path = p;
    }
    set_plugin_path(kPluginDir);
  }
  void TearDown() override {
    if (had_path)
      setenv("HEADROOM_PLUGIN_PATH", saved_path.c_str(), 1);
    else
      unsetenv("HEADROOM_PLUGIN_PATH");
  }
  static void set_plugin_path(const std::string& p) {
    setenv("HEADROOM_PLUGIN_PATH", p.c_str(), 1);
  }

  std::string file(const std::string& name) const { return dir + "/" + name; }
  std::string config(const std::string& text) { return write_file(dir, "run.toml", text); }
  // A [[plugins]] table.
  static std::string plugin(const std::string& name, const std::string& keys = "") {
    return "\n[[plugins]]\nname = \"" + name + "\"\n" + keys;
  }
  // A recorder's table, recording to `out`.
  std::string recorder(const std::string& name, const std::string& out,
                       const std::string& keys = "") const {
    return plugin(name, "out = \"" + file(out) + "\"\n" + keys);
  }
};

// --- A run without plugins -----------------------------------------------------------------------

TEST_F(PluginAbi, RunWithoutPluginsStillWorks) {
  const auto r = run_headroom("train " + config(kTinyModel));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(test::contains(r.output, "step      2/2")) << r.output;
}

// --- Finding and loading: every failure exits 2 with a message that says what is wrong -----------

TEST_F(PluginAbi, MissingPathExits2NamingIt) {
  const std::string path = config(kTinyModel + plugin("rec_a", "path = \"absent/rec_a.so\"\n"));
  const auto r = run_headroom("train " + path);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output, "absent/rec_a.so")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "does not exist")) << r.output;
  EXPECT_TRUE(test::contains(r.output, path)) << "names the config file: " << r.output;
}

TEST_F(PluginAbi, NameNotFoundExits2) {
  set_plugin_path(test::temp_dir());  // an empty folder
  const auto r = run_headroom("train " + config(kTinyModel + plugin("nope")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output, "cannot find plugin 'nope'")) << r.output;
}

TEST_F(PluginAbi, PluginPathIsColonSeparated) {
  set_plugin_path(dir + "/absent:" + test::temp_dir() + ":" + kPluginDir);
  const auto r = run_headroom("train " + config(kTinyModel + recorder("rec_a", "events.txt")));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(read_lines(file("events.txt")).empty());
}

TEST_F(PluginAbi, PathIsRelativeToTheConfigFile) {
  set_plugin_path(test::temp_dir());  // not found by name: only the path can find it
  fs::create_directory(file("libs"));
  copy_plugin("rec_a", file("libs"), kMode755);
  const auto r =
      run_headroom("train " + config(kTinyModel + recorder("rec_a", "events.txt",
                                                           "path = \"libs/rec_a.so\"\n")));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(read_lines(file("events.txt")).empty());
}

// A file that is no shared library: the message says what it is, not the loader's "file too
// short" or Boost's "Bad file descriptor".
TEST_F(PluginAbi, NotASharedLibraryExits2SayingItIsNoElfFile) {
  const std::string so = write_file(dir, "garbage.so", "this is not an ELF file\n");
  fs::permissions(so, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                          fs::perms::others_read);
  const auto r =
      run_headroom("train " + config(kTinyModel + plugin("garbage", "path = \"garbage.so\"\n")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(
      test::contains(r.output, "'" + so + "' is not a shared library: it is not an ELF file"))
      << r.output;
  EXPECT_TRUE(test::contains(r.output, "\"this is not an E...\"")) << "how it starts: " << r.output;
  EXPECT_FALSE(test::contains(r.output, "boost")) << r.output;
  EXPECT_FALSE(test::contains(r.output, "Bad file descriptor")) << r.output;
}

TEST_F(PluginAbi, EmptyFileExits2SayingItIsEmpty) {
  const std::string so = write_file(dir, "empty.so", "");
  const auto r =
      run_headroom("train " + config(kTinyModel + plugin("empty", "path = \"empty.so\"\n")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(
      test::contains(r.output, "'" + so + "' is not a shared library: it is empty (0 bytes)"))
      << r.output;
  EXPECT_FALSE(test::contains(r.output, "boost")) << r.output;
}

TEST_F(PluginAbi, DirectoryAsPathExits2SayingSo) {
  fs::create_directory(file("libs"));
  const auto r = run_headroom("train " + config(kTinyModel + plugin("rec_a", "path = \"libs\"\n")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output, "'" + file("libs") + "' is a directory")) << r.output;
  EXPECT_FALSE(test::contains(r.output, "boost")) << r.output;
}

TEST_F(PluginAbi, BrokenSymlinkExits2NamingItsTarget) {
  fs::create_symlink(file("gone.so"), file("rec_a.so"));
  const auto r = run_headroom(
      "train " + config(kTinyModel + recorder("rec_a", "events.txt", "path = \"rec_a.so\"\n")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output, "is a broken symbolic link (to '" + file("gone.so") + "'"))
      << r.output;
}

// The ELF header of a shared library: 64- or 32-bit, little-endian, for `machine`.
std::string elf_header(unsigned char elf_class, uint16_t machine) {
  std::string h(64, '\0');
  h[0] = 0x7f;
  h[1] = 'E';
  h[2] = 'L';
  h[3] = 'F';
  h[4] = char(elf_class);        // EI_CLASS: 1 = 32-bit, 2 = 64-bit
  h[5] = 1;                      // EI_DATA: little-endian
  h[6] = 1;                      // EI_VERSION
  h[16] = 3;                     // e_type: ET_DYN
  h[18] = char(machine & 0xff);  // e_machine
  h[19] = char(machine >> 8);
  return h;
}

// A library for another machine, or a 32-bit one: named as such, with this host's machine.
TEST_F(PluginAbi, LibraryForAnotherMachineExits2NamingBoth) {
#if defined(__x86_64__)
  const uint16_t other = 183;  // EM_AARCH64
  const std::string other_name = "AArch64 (64-bit ARM)", host_name = "x86-64";
#elif defined(__aarch64__)
  const uint16_t other = 62;  // EM_X86_64
  const std::string other_name = "x86-64", host_name = "AArch64 (64-bit ARM)";
#else
  GTEST_SKIP() << "the expected names are written for x86-64 and AArch64 hosts";
  const uint16_t other = 0;
  const std::string other_name, host_name;
#endif
  const std::string so = write_file(dir, "foreign.so", elf_header(2, other));
  const auto r =
      run_headroom("train " + config(kTinyModel + plugin("foreign", "path = \"foreign.so\"\n")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(
      r.output, "'" + so + "' is built for " + other_name + "; this headroom runs on " + host_name))
      << r.output;

  const std::string so32 = write_file(dir, "narrow.so", elf_header(1, other));
  const auto r32 =
      run_headroom("train " + config(kTinyModel + plugin("narrow", "path = \"narrow.so\"\n")));
  EXPECT_EQ(r32.exit_code, 2) << r32.output;
  EXPECT_TRUE(test::contains(r32.output,
                             "'" + so32 + "' is a 32-bit library; this headroom is " + "64-bit"))
      << r32.output;
}

// A plugin whose dependency is not found: the loader's reason, in its own words.
TEST_F(PluginAbi, MissingDependencyExits2WithTheLoadersReason) {
  const auto r = run_headroom("train " + config(kTinyModel + plugin("needs_gone")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output, "'" + kPluginDir + "/needs_gone.so' cannot be loaded"))
      << r.output;
  EXPECT_TRUE(
      test::contains(r.output, "libtest_gone_dependency.so: cannot open shared object file"))
      << r.output;
  EXPECT_TRUE(test::contains(r.output, "LD_LIBRARY_PATH")) << r.output;
  EXPECT_FALSE(test::contains(r.output, "boost")) << r.output;
}

TEST_F(PluginAbi, NoEntryPointExits2) {
  const auto r = run_headroom("train " + config(kTinyModel + plugin("no_entry")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output, "hr_plugin_entry")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "no_entry")) << r.output;
}

TEST_F(PluginAbi, EntryErrorExits2WithThePluginsMessage) {
  const auto r = run_headroom("train " + config(kTinyModel + plugin("bad_entry")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output, "this plugin refuses to load")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "bad_entry")) << r.output;
}

// A plugin that picks ABI 2.0 and says HR_OK, as a careless one would: refused all the same.
TEST_F(PluginAbi, OtherMajorVersionIsRefused) {
  const auto r = run_headroom("train " + config(kTinyModel + plugin("major2")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output, "2.0")) << "the plugin's version: " << r.output;
  EXPECT_TRUE(test::contains(r.output, "1.0")) << "the host's version: " << r.output;
  EXPECT_TRUE(test::contains(r.output, "major2")) << r.output;
}

// The same plugin returning HR_ERROR_VERSION, as hr_negotiate would.
TEST_F(PluginAbi, OtherMajorVersionRefusingItselfExits2) {
  const auto r = run_headroom("train " + config(kTinyModel + plugin("major2_refuses")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output, "2.0")) << "the plugin's version: " << r.output;
  EXPECT_TRUE(test::contains(r.output, "1.0")) << "the host's version: " << r.output;
  EXPECT_TRUE(test::contains(r.output, "major2_refuses")) << r.output;
}

// Same major version, HR_ERROR_VERSION: the version the plugin asked for and its own message.
TEST_F(PluginAbi, NewerMinorRefusalNamesTheVersionAndThePluginsMessage) {
  const auto r = run_headroom("train " + config(kTinyModel + plugin("needs_newer")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  const std::string asked = "1." + std::to_string(HR_ABI_VERSION_MINOR + 5);
  const std::string host = "1.0 to 1." + std::to_string(HR_ABI_VERSION_MINOR);
  EXPECT_TRUE(
      test::contains(r.output, "needs plugin ABI " + asked + "; this host speaks ABI " + host))
      << r.output;
  EXPECT_TRUE(test::contains(r.output, "the plugin says: needs the services of a newer headroom"))
      << r.output;
  EXPECT_FALSE(test::contains(r.output, "(none offered)")) << r.output;
  EXPECT_FALSE(test::contains(r.output, "different major")) << r.output;
}

TEST_F(PluginAbi, VersionRefusalNamingNoVersionCarriesThePluginsMessage) {
  const auto r = run_headroom("train " + config(kTinyModel + plugin("refuses_version")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(
      test::contains(r.output, "refused every plugin ABI version this host speaks (1.0 to 1." +
                                   std::to_string(HR_ABI_VERSION_MINOR)))
      << r.output;
  EXPECT_TRUE(test::contains(r.output, "the plugin says: this build is disabled")) << r.output;
  EXPECT_FALSE(test::contains(r.output, "(none offered)")) << r.output;

  const auto silent = run_headroom("train " + config(kTinyModel + plugin("refuses_silently")));
  EXPECT_EQ(silent.exit_code, 2) << silent.output;
  EXPECT_TRUE(test::contains(silent.output, kPluginDir + "/refuses_silently.so' refused every"))
      << silent.output;
  EXPECT_TRUE(test::contains(silent.output, "it gave no message")) << silent.output;
}

// A descriptor without what it must have: the missing fields by name, and the file.
TEST_F(PluginAbi, IncompleteDescriptorExits2NamingTheMissingFields) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"no_create_destroy", "missing create, destroy."},
      {"no_on_event", "missing on_event (it subscribes to STEP_END)."},
      {"no_deallocate", "missing allocator->deallocate."},
      {"no_optimizer_hooks",
       "missing optimizer (it claims the optimizer role; neither descriptor->optimizer nor "
       "get_extension(\"headroom.optimizer/1\") gives its hooks)."}};
  for (const auto& [name, missing] : cases) {
    const auto r = run_headroom("train " + config(kTinyModel + plugin(name)));
    EXPECT_EQ(r.exit_code, 2) << name << ": " << r.output;
    EXPECT_TRUE(test::contains(r.output, "'" + kPluginDir + "/" + name +
                                             ".so' has an incomplete descriptor (plugin '" + name +
                                             "'): " + missing))
        << name << ": " << r.output;
  }
}

TEST_F(PluginAbi, EntryPointWithoutDescriptorExits2) {
  const auto r = run_headroom("train " + config(kTinyModel + plugin("no_descriptor")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output,
                             "no_descriptor.so' returned HR_OK from hr_plugin_entry "
                             "without a descriptor"))
      << r.output;
}

// The file holds another plugin than the table names: both names, and what to change.
TEST_F(PluginAbi, NameMismatchExits2NamingBoth) {
  fs::copy_file(kPluginDir + "/rec_a.so", file("rec_z.so"));
  const auto r = run_headroom(
      "train " + config(kTinyModel + recorder("rec_z", "events.txt", "path = \"rec_z.so\"\n")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output, "'" + file("rec_z.so") +
                                           "' is the plugin 'rec_a' (its descriptor's name), not "
                                           "'rec_z': set name = \"rec_a\""))
      << r.output;
}

TEST_F(PluginAbi, TwoPluginsInOneRoleExit2NamingBoth) {
  const auto r = run_headroom(
      "train " + config(kTinyModel + plugin("alloc_a", "out = \"" + file("a.txt") + "\"\n") +
                        plugin("alloc_b", "out = \"" + file("b.txt") + "\"\n")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output, "alloc_a")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "alloc_b")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "allocator")) << r.output;
}

TEST_F(PluginAbi, WorldWritablePluginIsRefused) {
  const std::string so = copy_plugin("rec_a", dir, kMode755 | fs::perms::others_write);
  const auto r = run_headroom(
      "train " + config(kTinyModel + recorder("rec_a", "events.txt", "path = \"rec_a.so\"\n")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output, "writable")) << r.output;
  EXPECT_TRUE(test::contains(r.output, so)) << r.output;
  EXPECT_TRUE(read_lines(file("events.txt")).empty()) << "the plugin never ran";
}

// "A plugin file that anyone but its owner can write is refused": the group too.
TEST_F(PluginAbi, GroupWritablePluginIsRefused) {
  copy_plugin("rec_a", dir, kMode755 | fs::perms::group_write);
  const auto r = run_headroom(
      "train " + config(kTinyModel + recorder("rec_a", "events.txt", "path = \"rec_a.so\"\n")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output, "writable")) << r.output;
}

// A folder anyone can write: anyone could replace the plugin in it. The message names the folder.
TEST_F(PluginAbi, PluginInAWritableFolderIsRefusedNamingTheFolder) {
  const std::string open_dir = file("open");
  fs::create_directory(open_dir);
  copy_plugin("rec_a", open_dir, kMode755);
  fs::permissions(open_dir, fs::perms::all);
  const auto r =
      run_headroom("train " + config(kTinyModel + recorder("rec_a", "events.txt",
                                                           "path = \"open/rec_a.so\"\n")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(
      test::contains(r.output, "'" + open_dir + "/rec_a.so' is in the folder '" + open_dir +
                                   "', which is writable by others than its owner (mode 0777)"))
      << r.output;
}

// With the sticky bit (as /tmp has), others cannot replace a file its owner owns there: it loads.
TEST_F(PluginAbi, PluginInAStickyFolderLoads) {
  const std::string sticky = file("sticky");
  fs::create_directory(sticky);
  copy_plugin("rec_a", sticky, kMode755);
  fs::permissions(sticky, fs::perms::all | fs::perms::sticky_bit);
  const auto r =
      run_headroom("train " + config(kTinyModel + recorder("rec_a", "events.txt",
                                                           "path = \"sticky/rec_a.so\"\n")));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(read_lines(file("events.txt")).empty());
}

// --- Events --------------------------------------------------------------------------------------

// The documented order for one run: 2 steps, grad_accum 2, 3 layers; each event reaches the
// plugins in TOML order.
std::vector<std::string> expected_events(const std::vector<std::string>& plugins, int steps,
                                         int accum, int layers) {
  std::vector<std::string> out;
  auto ev = [&](const char* name, int step, int micro, int layer) {
    for (const auto& p : plugins)
      out.push_back(p + " " + name + " step=" + std::to_string(step) +
                    " micro=" + std::to_string(micro) + " layer=" + std::to_string(layer));
  };
  ev("TRAIN_BEGIN", 0, 0, -1);
  for (int s = 1; s <= steps; ++s) {
    ev("STEP_BEGIN", s, 0, -1);
    for (int m = 1; m <= accum; ++m) {
      for (int l = 0; l < layers; ++l) {
        ev("FORWARD_BEGIN", s, m, l);
        ev("FORWARD_END", s, m, l);
      }
      for (int l = layers - 1; l >= 0; --l) {
        ev("BACKWARD_BEGIN", s, m, l);
        ev("BACKWARD_END", s, m, l);
      }
    }
    ev("GRADS_READY", s, 0, -1);
    ev("OPTIMIZER_STEP", s, 0, -1);
    ev("STEP_END", s, 0, -1);
  }
  ev("TRAIN_END", steps, 0, -1);
  return out;
}

void check_event_order(const std::string& events_file, const std::vector<std::string>& plugins,
                       const std::string& output) {
  const std::vector<std::string> lines = read_lines(events_file);
  std::vector<std::string> events;  // the first five words of each event line
  std::vector<size_t> creates, destroys, train_ends;
  for (size_t i = 0; i < lines.size(); ++i) {
    const auto w = split(lines[i]);
    ASSERT_GE(w.size(), 2u) << lines[i];
    if (w[1] == "CREATE") {
      creates.push_back(i);
      continue;
    }
    if (w[1] == "DESTROY") {
      destroys.push_back(i);
      continue;
    }
    ASSERT_GE(w.size(), 5u) << lines[i];
    if (w[1] == "TRAIN_END") train_ends.push_back(i);
    events.push_back(w[0] + " " + w[1] + " " + w[2] + " " + w[3] + " " + w[4]);
  }
  std::vector<std::string> expected = expected_events(plugins, 2, 2, 3);
  // TRAIN_END's step is not pinned by the header (the last step, or 0): compare the rest.
  ASSERT_EQ(events.size(), expected.size()) << join(lines) << output;
  for (size_t i = 0; i < events.size(); ++i) {
    if (split(expected[i])[1] == "TRAIN_END") {
      const auto got = split(events[i]);
      const auto want = split(expected[i]);
      EXPECT_EQ(got[0] + " " + got[1] + " " + got[3] + " " + got[4],
                want[0] + " " + want[1] + " " + want[3] + " " + want[4]);
      expected[i] = events[i];
    }
  }
  EXPECT_EQ(join(events), join(expected));

  // Each plugin is created before the first event and destroyed after the last.
  EXPECT_EQ(creates.size(), plugins.size()) << join(lines);
  EXPECT_EQ(destroys.size(), plugins.size()) << join(lines);
  for (size_t c : creates)
    EXPECT_LT(c, creates.size()) << "CREATE after an event:\n" << join(lines);
  ASSERT_FALSE(train_ends.empty());
  for (size_t d : destroys)
    EXPECT_GT(d, train_ends.back()) << "DESTROY before TRAIN_END:\n" << join(lines);
}

TEST_F(PluginAbi, EventOrderAcrossTwoPluginsInTomlOrder) {
  const auto r = run_headroom("train " + config(kTinyModel + recorder("rec_a", "events.txt") +
                                                recorder("rec_b", "events.txt")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  check_event_order(file("events.txt"), {"rec_a", "rec_b"}, r.output);
}

TEST_F(PluginAbi, EventOrderFollowsTheTomlNotTheName) {
  const auto r = run_headroom("train " + config(kTinyModel + recorder("rec_b", "events.txt") +
                                                recorder("rec_a", "events.txt")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  check_event_order(file("events.txt"), {"rec_b", "rec_a"}, r.output);
}

// A step vetoed at GRADS_READY has no OPTIMIZER_STEP and leaves the parameters as they were; it
// still ends with STEP_END, and the steps around it update as usual.
TEST_F(PluginAbi, VetoSkipsTheOptimizerStep) {
  const std::string text =
      "[model]\nn_layer = 1\nn_head = 1\nn_embd = 8\nseq_len = 4\nvocab_size = 16\n"
      "[train]\nsteps = 3\nmicro_batch = 1\ngrad_accum = 2\nlr = 1e-2\nwarmup_steps = 0\n" +
      recorder("rec_a", "events.txt", "veto_step = 2\n") + recorder("rec_b", "events.txt");
  const auto r = run_headroom("train " + config(text));
  ASSERT_EQ(r.exit_code, 0) << r.output;

  const auto lines = read_lines(file("events.txt"));
  std::map<std::string, std::set<int>> steps_of;  // "rec_a OPTIMIZER_STEP" -> steps
  std::map<std::string, std::string> sum;         // "STEP_BEGIN 2" -> rec_a's parameter sum
  for (const auto& line : lines) {
    const auto w = split(line);
    if (w.size() < 5) continue;
    const int step = std::stoi(field(line, "step"));
    steps_of[w[0] + " " + w[1]].insert(step);
    if (w[0] == "rec_a" && !field(line, "sum").empty())
      sum[w[1] + " " + std::to_string(step)] = field(line, "sum");
  }
  for (const std::string p : {"rec_a", "rec_b"}) {
    EXPECT_EQ(steps_of[p + " OPTIMIZER_STEP"], (std::set<int>{1, 3})) << join(lines);
    EXPECT_EQ(steps_of[p + " GRADS_READY"], (std::set<int>{1, 2, 3})) << join(lines);
    EXPECT_EQ(steps_of[p + " STEP_END"], (std::set<int>{1, 2, 3})) << join(lines);
  }
  ASSERT_EQ(sum.size(), 8u) << "STEP_BEGIN and STEP_END x3, OPTIMIZER_STEP x2:\n" << join(lines);
  for (const auto& [k, v] : sum)
    ASSERT_TRUE(v != "none" && v != "error") << k << ": " << v;
  EXPECT_EQ(sum["STEP_BEGIN 2"], sum["STEP_END 2"]) << "the vetoed step changed the parameters";
  EXPECT_NE(sum["STEP_BEGIN 1"], sum["STEP_END 1"]) << "step 1 did not update";
  EXPECT_NE(sum["STEP_BEGIN 3"], sum["STEP_END 3"]) << "step 3 did not update";
  EXPECT_EQ(sum["STEP_END 1"], sum["STEP_BEGIN 2"]);
  EXPECT_EQ(sum["STEP_END 2"], sum["STEP_BEGIN 3"]);
  // OPTIMIZER_STEP comes just before the update.
  EXPECT_EQ(sum["OPTIMIZER_STEP 1"], sum["STEP_BEGIN 1"]);
  EXPECT_EQ(sum["OPTIMIZER_STEP 3"], sum["STEP_BEGIN 3"]);
}

// --- A hook that fails mid-run: exit 1 naming the plugin, the event and the plugin's message -----

TEST_F(PluginAbi, HookErrorMidRunExits1NamingPluginAndEvent) {
  const auto r =
      run_headroom("train " + config(kTinyModel + recorder("rec_a", "events.txt") +
                                     recorder("rec_b", "events.txt",
                                              "fail_event = \"STEP_END\"\nfail_step = 1\n")));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(test::contains(r.output, "plugin 'rec_b'")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "STEP_END")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "deliberate failure")) << r.output;

  const auto lines = read_lines(file("events.txt"));
  const std::string all = join(lines);
  EXPECT_FALSE(test::contains(all, "STEP_BEGIN step=2")) << "the run went on:\n" << all;
  EXPECT_TRUE(test::contains(all, "rec_a DESTROY")) << "destroy after a failed run:\n" << all;
  EXPECT_TRUE(test::contains(all, "rec_b DESTROY")) << "destroy after a failed run:\n" << all;
}

// A run that runs out of memory fires OOM to the plugins (with the size asked for), stops with
// exit code 3 and the report, and still destroys every plugin.
TEST_F(PluginAbi, OomEventReachesPluginsBeforeTheReport) {
  const auto r = run_headroom(
      "train " + config(kTinyModel + std::string("[device]\nmemory_limit = \"12KiB\"\n") +
                        recorder("rec_a", "events.txt", "alloc_events = true\n")));
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_TRUE(test::contains(r.output, "out of memory")) << r.output;
  const auto lines = read_lines(file("events.txt"));
  std::vector<std::string> ooms;
  for (const auto& line : lines)
    if (split(line).size() > 1 && split(line)[1] == "OOM") ooms.push_back(line);
  ASSERT_EQ(ooms.size(), 1u) << join(lines);
  EXPECT_GT(std::stol(field(ooms[0], "bytes")), 0) << ooms[0];
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines.back(), "rec_a DESTROY") << join(lines);
}

// The plugin's log messages reach the user, naming the plugin.
TEST_F(PluginAbi, LogReachesTheOutput) {
  const auto r = run_headroom(
      "train " + config(kTinyModel + recorder("rec_a", "events.txt",
                                              "log = \"a message from the recorder\"\n")));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(test::contains(r.output, "a message from the recorder")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "rec_a")) << r.output;
}

// --- A plugin's own keys -------------------------------------------------------------------------

TEST_F(PluginAbi, UnknownKeyInPluginTableExits2NamingFileAndLine) {
  const std::string text = kTinyModel + recorder("rec_a", "events.txt", "bogus = 1\n");
  const std::string path = config(text);
  const auto r = run_headroom("train " + path);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  const int line = line_of(text, "bogus = 1");
  EXPECT_TRUE(test::contains(r.output, path + ":" + std::to_string(line) + ":")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "bogus")) << r.output;
  EXPECT_TRUE(test::contains(lower(r.output), "unknown")) << r.output;
}

TEST_F(PluginAbi, WrongTypeInPluginTableExits2NamingFileAndLine) {
  const std::string text = kTinyModel + recorder("rec_a", "events.txt", "veto_step = \"two\"\n");
  const std::string path = config(text);
  const auto r = run_headroom("train " + path);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  const int line = line_of(text, "veto_step = ");
  EXPECT_TRUE(test::contains(r.output, path + ":" + std::to_string(line) + ":")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "veto_step")) << r.output;
}

// config_error on a key the table does not have (a required one): exit 2 with the message.
TEST_F(PluginAbi, MissingRequiredKeyExits2WithThePluginsMessage) {
  const std::string path = config(kTinyModel + plugin("rec_a"));
  const auto r = run_headroom("train " + path);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output, "rec_a needs `out`")) << r.output;
  EXPECT_TRUE(test::contains(r.output, path)) << r.output;
}

// config_error on a value the plugin finds out of range: prefixed with the key's position.
TEST_F(PluginAbi, ConfigErrorNamesTheKeysLine) {
  const std::string text =
      kTinyModel + recorder("rec_a", "events.txt", "fail_event = \"NOT_AN_EVENT\"\n");
  const std::string path = config(text);
  const auto r = run_headroom("train " + path);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  const int line = line_of(text, "fail_event");
  EXPECT_TRUE(test::contains(r.output, path + ":" + std::to_string(line) + ":")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "not an event name")) << r.output;
}

// --- A plugin's state in snapshots --------------------------------------------------------------

// load_state refusing the saved bytes with HR_ERROR_CONFIG: exit 2, naming the plugin, what it was
// doing and its message; another status is a failure (exit 1) with the same.
TEST_F(PluginAbi, LoadStateConfigErrorNamesThePluginAndCarriesItsMessage) {
  const std::string snap = "[snapshot]\nevery = 1\ndir = \"snaps\"\n";
  const std::string one =
      "[model]\nn_layer = 1\nn_head = 1\nn_embd = 8\nseq_len = 4\nvocab_size = 16\n"
      "[train]\nsteps = 1\nmicro_batch = 1\n" +
      snap;
  ASSERT_EQ(run_headroom("train " + config(one + plugin("stateful"))).exit_code, 0);
  // The resumed runs write no snapshots: each resumes from step 1's.
  const std::string two =
      "[model]\nn_layer = 1\nn_head = 1\nn_embd = 8\nseq_len = 4\nvocab_size = 16\n"
      "[train]\nsteps = 2\nmicro_batch = 1\n";
  const std::string resume = " --resume " + file("snaps");
  ASSERT_EQ(run_headroom("train " + config(two + plugin("stateful")) + resume).exit_code, 0)
      << "the state round-trips";

  const std::string text =
      two + plugin("stateful", "load_status = 2\nload_message = \"the scale is out of range\"\n");
  const std::string path = config(text);
  const auto r = run_headroom("train " + path + resume);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  const std::string where =
      path + ":" + std::to_string(line_of(text, "[[plugins]]")) + ":1: " + "plugin 'stateful'";
  EXPECT_TRUE(test::contains(r.output, where +
                                           ": --resume: loading its state (12 bytes) from the "
                                           "snapshot " +
                                           file("snaps") +
                                           "/step_000000000001.hrsnap failed, load_state "
                                           "returned HR_ERROR_CONFIG: the scale is out of "
                                           "range"))
      << r.output;
  EXPECT_FALSE(test::contains(r.output, "unreadable")) << r.output;

  const auto silent =
      run_headroom("train " + config(two + plugin("stateful", "load_status = 2\n")) + resume);
  EXPECT_EQ(silent.exit_code, 2) << silent.output;
  EXPECT_TRUE(test::contains(silent.output, "plugin 'stateful': --resume: loading its state"))
      << silent.output;
  EXPECT_TRUE(
      test::contains(silent.output, "load_state returned HR_ERROR_CONFIG: it gave no message"))
      << silent.output;

  const auto failed = run_headroom(
      "train " + config(two + plugin("stateful", "load_status = 1\nload_message = \"broken\"\n")) +
      resume);
  EXPECT_EQ(failed.exit_code, 1) << failed.output;
  EXPECT_TRUE(test::contains(failed.output, "plugin 'stateful': --resume: loading its state"))
      << failed.output;
  EXPECT_TRUE(test::contains(failed.output, "load_state returned HR_ERROR: broken"))
      << failed.output;
}

// create() returning HR_ERROR_CONFIG with a message of its own, not a key's: the entry's position
// and the plugin come first. A getter's message keeps the key's position.
TEST_F(PluginAbi, CreateConfigErrorWithoutAKeyNamesThePlugin) {
  const std::string text = kTinyModel + plugin("stateful", "create_message = \"keys disagree\"\n");
  const std::string path = config(text);
  const auto r = run_headroom("train " + path);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output, path + ":" + std::to_string(line_of(text, "[[plugins]]")) +
                                           ":1: plugin 'stateful': create: keys disagree"))
      << r.output;

  const std::string typed = kTinyModel + plugin("stateful", "load_status = \"two\"\n");
  const std::string typed_path = config(typed);
  const auto t = run_headroom("train " + typed_path);
  EXPECT_EQ(t.exit_code, 2) << t.output;
  EXPECT_TRUE(test::contains(
      t.output, "error: " + typed_path + ":" + std::to_string(line_of(typed, "load_status")) + ":"))
      << t.output;
  EXPECT_TRUE(test::contains(t.output, "plugins.stateful.load_status: expected an integer"))
      << t.output;
  EXPECT_FALSE(test::contains(t.output, "plugin 'stateful': create:")) << t.output;
}

// --- Checking a config's plugins without training (`headroom check`, `headroom plan`) ----------

TEST_F(PluginAbi, ValidatePluginsRejectsAnUnknownKeyAsTrainDoes) {
  const std::string text = kTinyModel + plugin("amp", "dtypo = \"bf16\"\n");
  const Config c = test::config_from(text);
  const std::string error = test::error_of([&] { validate_plugins(c); });
  const std::string at = "test.toml:" + std::to_string(line_of(text, "dtypo")) + ":";
  EXPECT_TRUE(test::starts_with(error, at)) << error;
  EXPECT_TRUE(test::contains(error, "unknown key 'dtypo' for plugin 'amp'")) << error;
  EXPECT_TRUE(test::contains(error, "valid keys: ")) << error;
  EXPECT_TRUE(test::contains(error, "dtype")) << error;

  // train says the same.
  const std::string path = config(text);
  const auto r = run_headroom("train " + path);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output, error.substr(std::string("test.toml").size())))
      << error << "\n"
      << r.output;
}

TEST_F(PluginAbi, ValidatePluginsRejectsWhatThePluginRejects) {
  const std::string text = kTinyModel + plugin("amp", "dtype = \"fp8\"\n");
  const std::string error = test::error_of([&] { validate_plugins(test::config_from(text)); });
  EXPECT_TRUE(test::starts_with(error, "test.toml:" + std::to_string(line_of(text, "dtype")) + ":"))
      << error;
  EXPECT_TRUE(test::contains(error, "must be \"bf16\" or \"fp16\"; got \"fp8\"")) << error;

  const std::string typed = kTinyModel + plugin("amp", "dtype = \"fp16\"\ninit_scale = \"big\"\n");
  const std::string wrong = test::error_of([&] { validate_plugins(test::config_from(typed)); });
  EXPECT_TRUE(test::contains(wrong, "plugins.amp.init_scale: expected a number, got a string"))
      << wrong;
}

TEST_F(PluginAbi, ValidatePluginsPassesAValidConfig) {
  EXPECT_NO_THROW(validate_plugins(test::config_from(kTinyModel)));
  EXPECT_NO_THROW(validate_plugins(test::config_from(
      kTinyModel + plugin("amp", "dtype = \"fp16\"\ninit_scale = 1024.0\n") +
      plugin("defrag_allocator", "page_size = \"2MiB\"\n") + plugin("checkpoint"))));
  // A CUDA config is checked without a GPU (this build may have no CUDA backend at all).
  EXPECT_NO_THROW(validate_plugins(
      test::config_from(kTinyModel + std::string("[device]\nkind = \"cuda\"\n") + plugin("amp"))));
}

// The same loader as train: a missing plugin, a broken file, a role conflict.
TEST_F(PluginAbi, ValidatePluginsLoadsAsTrainDoes) {
  EXPECT_TRUE(test::contains(
      test::error_of([&] { validate_plugins(test::config_from(kTinyModel + plugin("nope"))); }),
      "cannot find plugin 'nope'"));
  EXPECT_TRUE(test::contains(test::error_of([&] {
                               validate_plugins(
                                   test::config_from(kTinyModel + plugin("needs_newer")));
                             }),
                             "the plugin says: needs the services of a newer headroom"));
  const std::string both = test::error_of([&] {
    validate_plugins(test::config_from(kTinyModel + plugin("alloc_a", "out = \"/dev/null\"\n") +
                                       plugin("alloc_b", "out = \"/dev/null\"\n")));
  });
  EXPECT_TRUE(test::contains(both, "provide the allocator role")) << both;
}

// --- Roles ---------------------------------------------------------------------------------------

// Every device allocation goes through the allocator plugin: its count is the host tracker's, and
// every ALLOC event is one of its allocations. Training is unchanged.
TEST_F(PluginAbi, AllocatorSeesEveryAllocation) {
  const std::string base = std::string(kTinyModel);
  const auto plain = run_headroom("train " + config(base) + " --metrics " + file("plain.jsonl"));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;

  const auto r =
      run_headroom("train " +
                   config(base + recorder("rec_a", "events.txt", "alloc_events = true\n") +
                          plugin("alloc_a", "out = \"" + file("alloc.txt") + "\"\n")) +
                   " --metrics " + file("alloc.jsonl"));
  ASSERT_EQ(r.exit_code, 0) << r.output;

  const auto counts = read_lines(file("alloc.txt"));
  ASSERT_EQ(counts.size(), 1u) << join(counts);
  const long allocs = std::stol(field(counts[0], "allocs"));
  const long frees = std::stol(field(counts[0], "frees"));
  EXPECT_GT(allocs, 0) << counts[0];
  EXPECT_EQ(field(counts[0], "host"), field(counts[0], "allocs")) << counts[0];
  EXPECT_LE(frees, allocs) << counts[0];
  EXPECT_EQ(field(counts[0], "bad_frees"), "0") << "deallocate(NULL): " << counts[0];

  long alloc_events = 0, free_events = 0;
  for (const auto& line : read_lines(file("events.txt"))) {
    const auto w = split(line);
    if (w.size() < 2) continue;
    if (w[1] == "TRAIN_END") break;
    alloc_events += w[1] == "ALLOC";
    free_events += w[1] == "FREE";
  }
  EXPECT_EQ(alloc_events, allocs) << "ALLOC events up to TRAIN_END vs allocate calls";
  EXPECT_EQ(free_events, frees) << "FREE events up to TRAIN_END vs deallocate calls";

  EXPECT_EQ(losses(file("alloc.jsonl")), losses(file("plain.jsonl")));
}

// An allocator that has no memory left (allocate returns NULL) is an out-of-memory like any other:
// OOM to the plugins, exit code 3 with the report.
TEST_F(PluginAbi, AllocatorReturningNullIsOutOfMemory) {
  const auto r = run_headroom(
      "train " +
      config(kTinyModel + recorder("rec_a", "events.txt", "alloc_events = true\n") +
             plugin("alloc_a", "out = \"" + file("alloc.txt") + "\"\nfail_after = 40\n")));
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_TRUE(test::contains(r.output, "out of memory")) << r.output;
  const std::string events = join(read_lines(file("events.txt")));
  EXPECT_TRUE(test::contains(events, "rec_a OOM ")) << events;
  EXPECT_TRUE(test::contains(events, "rec_a DESTROY")) << events;
}

// services->alloc from inside the allocator's own allocate hook would allocate inside an
// allocation: the host refuses it (NULL, HR_ERROR_NOT_ALLOWED's message), and the run goes on.
TEST_F(PluginAbi, AllocFromAnAllocatorHookIsRefused) {
  const auto r = run_headroom(
      "train " + config(kTinyModel + plugin("alloc_a", "out = \"" + file("alloc.txt") +
                                                           "\"\nnested_alloc = true\n")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string out = join(read_lines(file("alloc.txt")));
  EXPECT_TRUE(test::contains(out, " nested=refused")) << out;
}

// A snapshot of an optimizer plugin that keeps no state (plain_sgd), resumed without it: the
// refusal names the plugin from the snapshot's own record, not "a plugin"; with it, it resumes.
TEST_F(PluginAbi, ResumingWithoutTheOptimizerPluginNamesIt) {
  const std::string base =
      std::string(kTinyModel) + "[snapshot]\nevery = 1\ndir = \"" + file("snaps") + "\"\n";
  const std::string sgd = plugin("plain_sgd", "out = \"" + file("sgd.txt") + "\"\n");
  ASSERT_EQ(run_headroom("train " + config(base + sgd)).exit_code, 0);
  const std::string resume = " --set train.steps=3 --resume " + file("snaps");
  const auto without = run_headroom("train " + config(base) + resume);
  EXPECT_EQ(without.exit_code, 2) << without.output;
  EXPECT_TRUE(test::contains(without.output,
                             "was made with the optimizer of plugin 'plain_sgd', this config "
                             "uses adamw (list 'plain_sgd' in [[plugins]] again to resume it"))
      << without.output;
  const auto with = run_headroom("train " + config(base + sgd) + resume);
  EXPECT_EQ(with.exit_code, 0) << with.output;
}

// An allocator plugin that refuses a request (alloc_a, after fail_after allocations) is named in
// the out-of-memory report as the one that refused, not "the device"; with defrag_allocator, the
// end-of-run memory report shows the allocator's stats, as the guide says.
TEST_F(PluginAbi, AllocatorRefusalAndStatsNameThePlugin) {
  const auto r = run_headroom(
      "train " + config(kTinyModel + recorder("alloc_a", "a.txt", "fail_after = 5\n")));
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_TRUE(test::contains(r.output,
                             "memory_limit           none: 'alloc_a' (allocator plugin) "
                             "refused 64 B (its own policy"))
      << r.output;
  EXPECT_FALSE(test::contains(r.output, "the device refused")) << r.output;
  // Under a memory_limit it did not reach, the report names the plugin as the refuser.
  const auto limited = run_headroom(
      "train " + config(std::string(kTinyModel) + "[device]\nmemory_limit = \"1GiB\"\n" +
                        recorder("alloc_a", "b.txt", "fail_after = 5\n")));
  EXPECT_EQ(limited.exit_code, 3) << limited.output;
  EXPECT_TRUE(test::contains(limited.output, "refused by             'alloc_a' (allocator plugin)"))
      << limited.output;

  const auto d = run_headroom("train " + config(kTinyModel + plugin("defrag_allocator")));
  ASSERT_EQ(d.exit_code, 0) << d.output;
  const size_t at = d.output.find("  'defrag_allocator' (allocator plugin): allocated ");
  ASSERT_NE(at, std::string::npos) << d.output;
  const std::string line = d.output.substr(at, d.output.find('\n', at) - at);
  for (const char* part :
       {", reserved ", ", largest free block ", " device allocations, ", " retries, ", " refused"})
    EXPECT_TRUE(test::contains(line, part)) << part << " in " << line;
}

// The optimizer role replaces AdamW whatever [train] optimizer says: the plugin's plain SGD
// reproduces the built-in SGD without momentum or weight decay, and no AdamW state is allocated.
TEST_F(PluginAbi, OptimizerRoleReplacesTheBuiltIn) {
  const std::string base =
      "[model]\nn_layer = 1\nn_head = 1\nn_embd = 8\nseq_len = 4\nvocab_size = 16\n"
      "[train]\nsteps = 20\nmicro_batch = 4\ngrad_accum = 2\nlr = 0.5\nwarmup_steps = 0\n"
      "lr_schedule = \"constant\"\nweight_decay = 0.0\ngrad_clip = 0.0\n";
  const auto with_plugin =
      run_headroom("train " +
                   config(base + "optimizer = \"adamw\"\n" +
                          plugin("plain_sgd", "out = \"" + file("sgd.txt") + "\"\n")) +
                   " --metrics " + file("plugin.jsonl"));
  ASSERT_EQ(with_plugin.exit_code, 0) << with_plugin.output;
  const auto builtin_sgd =
      run_headroom("train " + config(base + "optimizer = \"sgd\"\nmomentum = 0.0\n") +
                   " --metrics " + file("sgd.jsonl"));
  ASSERT_EQ(builtin_sgd.exit_code, 0) << builtin_sgd.output;
  const auto adamw = run_headroom("train " + config(base + "optimizer = \"adamw\"\n") +
                                  " --metrics " + file("adamw.jsonl"));
  ASSERT_EQ(adamw.exit_code, 0) << adamw.output;

  const auto got = losses(file("plugin.jsonl"));
  const auto sgd = losses(file("sgd.jsonl"));
  const auto adam = losses(file("adamw.jsonl"));
  ASSERT_EQ(got.size(), 20u);
  ASSERT_EQ(sgd.size(), 20u);
  ASSERT_EQ(adam.size(), 20u);
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], sgd[i], 1e-5 * std::abs(sgd[i])) << "step " << i + 1;
  EXPECT_NE(got[1], adam[1]) << "the plugin ran AdamW's update";
  // It learns: the last five steps' mean loss is clearly below the first five's.
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) {
    first += got[i] / 5;
    last += got[got.size() - 1 - i] / 5;
  }
  EXPECT_LT(last, first - 0.1);

  // One step() per optimizer step, 1-based, with the schedule's lr, over every parameter.
  const auto steps = read_lines(file("sgd.txt"));
  ASSERT_EQ(steps.size(), 20u) << join(steps);
  for (size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(field(steps[i], "step"), std::to_string(i + 1)) << steps[i];
    EXPECT_EQ(field(steps[i], "lr"), "0.5") << steps[i];
    EXPECT_GT(std::stoi(field(steps[i], "params")), 0) << steps[i];
  }
  // No AdamW moments: nothing in the optimizer category.
  const auto last_metrics = read_lines(file("plugin.jsonl")).back();
  EXPECT_EQ(nlohmann::json::parse(last_metrics).at("mem_peak_by_category").at("optimizer"), 0)
      << last_metrics;
}

// --- Compatibility across versions ---------------------------------------------------------------

// Built against tests/abi/v1.0/headroom/plugin.h only: every later host must keep loading it.
TEST_F(PluginAbi, FrozenV1_0PluginLoads) {
  const auto r = run_headroom(
      "train " + config(kTinyModel + plugin("frozen_v1_0", "out = \"" + file("f.txt") + "\"\n")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto lines = read_lines(file("f.txt"));
  ASSERT_EQ(lines.size(), 4u) << join(lines);
  EXPECT_EQ(lines[0], "frozen_v1_0 TRAIN_BEGIN step=0");
  EXPECT_EQ(lines[1], "frozen_v1_0 STEP_END step=1");
  EXPECT_EQ(lines[2], "frozen_v1_0 STEP_END step=2");
  EXPECT_EQ(split(lines[3])[1], "TRAIN_END");
}

#if HR_ABI_VERSION_MINOR >= 1
// With snapshots on, a 1.1 host looks for save_state: in a v1.0 descriptor it must not (the bytes
// after frozen_v1_0's descriptor are garbage that would crash the run).
TEST_F(PluginAbi, FrozenV1_0PluginRunsWithSnapshots) {
  const auto r = run_headroom(
      "train " + config(kTinyModel + std::string("[snapshot]\nevery = 1\ndir = \"snaps\"\n") +
                        plugin("frozen_v1_0", "out = \"" + file("f.txt") + "\"\n")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_lines(file("f.txt")).size(), 4u) << join(read_lines(file("f.txt")));
}
#endif

// Built against tests/abi/v1.4/headroom/plugin.h only (no get_extension in its descriptor, and
// garbage after it): a 1.5 host loads it, runs its hooks, keeps its state across a resume, and
// answers its 1.4 vm_granularity with 0, since it does not have the allocator role.
TEST_F(PluginAbi, FrozenV1_4PluginLoadsRunsAndResumes) {
  const std::string cfg =
      config(std::string(kTinyModel) + "[snapshot]\nevery = 1\ndir = \"" + file("snaps") + "\"\n" +
             plugin("frozen_v1_4", "out = \"" + file("f.txt") + "\"\n"));
  const auto r = run_headroom("train " + cfg);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto lines = read_lines(file("f.txt"));
  ASSERT_EQ(lines.size(), 5u) << join(lines);
  EXPECT_EQ(lines[0], "frozen_v1_4 CREATE abi=1.4 granularity=0");
  EXPECT_EQ(lines[1], "frozen_v1_4 TRAIN_BEGIN step=0");
  EXPECT_EQ(lines[2], "frozen_v1_4 STEP_END step=1");
  EXPECT_EQ(lines[3], "frozen_v1_4 STEP_END step=2");
  EXPECT_EQ(split(lines[4])[1], "TRAIN_END");

  fs::remove(file("f.txt"));
  const auto resumed =
      run_headroom("train " + cfg + " --set train.steps=3 --resume " + file("snaps"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto again = read_lines(file("f.txt"));
  ASSERT_GE(again.size(), 4u) << join(again);
  EXPECT_EQ(again[1], "frozen_v1_4 LOAD steps=2") << join(again);
  EXPECT_EQ(again[3], "frozen_v1_4 STEP_END step=3") << join(again);
}

// A loss-spike guard built for 1.4 reads the head's "losses (B, T)" at FORWARD_END and
// BACKWARD_BEGIN. The chunked loss (the default) computes them in the head's backward; the host
// computes them for the reader instead, so what it reads is the micro-step's real per-token
// losses: their mean is the step's loss (one micro-step a step, no ignored targets), at both
// events, under either loss.
TEST_F(PluginAbi, FrozenV1_4PluginReadsTheRealPerTokenLosses) {
  for (const std::string loss : {"chunked", "full"}) {
    SCOPED_TRACE(loss);
    fs::remove(file("l.txt"));
    const std::string cfg = config(
        "[model]\nn_layer = 1\nn_head = 1\nn_embd = 8\nseq_len = 4\nvocab_size = 16\n"
        "loss = \"" +
        loss + "\"\n[train]\nsteps = 3\nmicro_batch = 2\ngrad_accum = 1\n" +
        plugin("frozen_v1_4_losses", "out = \"" + file("l.txt") + "\"\n"));
    const auto r = run_headroom("train " + cfg + " --metrics " + file("m.jsonl"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto step_losses = losses(file("m.jsonl"));
    const auto lines = read_lines(file("l.txt"));
    ASSERT_EQ(step_losses.size(), 3u);
    ASSERT_EQ(lines.size(), 6u) << join(lines);
    for (size_t k = 0; k < lines.size(); ++k) {
      const auto words = split(lines[k]);
      ASSERT_GE(words.size(), 4u) << lines[k];
      EXPECT_EQ(words[1], k % 2 == 0 ? "FORWARD_END" : "BACKWARD_BEGIN") << lines[k];
      const int step = std::stoi(field(lines[k], "step"));
      ASSERT_EQ(step, int(k / 2) + 1) << lines[k];
      ASSERT_NE(field(lines[k], "mean"), "") << lines[k];
      EXPECT_EQ(field(lines[k], "n"), "8") << lines[k];  // micro_batch 2 x seq_len 4
      EXPECT_EQ(field(lines[k], "dtype"), std::to_string(HR_DTYPE_F32)) << lines[k];
      EXPECT_NEAR(std::stod(field(lines[k], "mean")), step_losses[step - 1], 1e-6) << lines[k];
    }
  }
}

// --- ABI 1.5: the host's extensions
// ---------------------------------------------------------------

// What ext_probe wrote, as lines starting with `prefix`.
std::vector<std::string> lines_with(const std::vector<std::string>& lines,
                                    const std::string& prefix) {
  std::vector<std::string> out;
  for (const auto& l : lines)
    if (l.rfind(prefix, 0) == 0) out.push_back(l);
  return out;
}

double number(const std::string& line, const std::string& key) {
  const std::string v = field(line, key);
  EXPECT_FALSE(v.empty()) << key << " in " << line;
  return v.empty() ? std::nan("") : std::strtod(v.c_str(), nullptr);
}

TEST_F(PluginAbi, ExtensionsTheHostLacksAreNullAndTheRestWork) {
  const auto r = run_headroom("train " + config(kTinyModel + recorder("ext_probe", "p.txt")) +
                              " --metrics " + file("m.jsonl"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto lines = read_lines(file("p.txt"));
  ASSERT_FALSE(lines.empty()) << r.output;
  // Another id, another version of one, and NULL: NULL. The five the host has: tables.
  EXPECT_EQ(lines[0], "ids nope=0 vm2=0 null=0 vm=1 precision=1 recompute=1 tensors=1 step=1");
  // Without the allocator role, every vm function of both tables is refused: NULL, 0, or
  // HR_ERROR_NOT_ALLOWED (7).
  EXPECT_EQ(lines_with(lines, "vm14 ").at(0),
            "vm14 granularity=0 reserve=0 raw_alloc=0 map=7 unmap=7 release=7");
  EXPECT_EQ(lines_with(lines, "vm1 ").at(0),
            "vm1 granularity=0 reserve=0 raw_alloc=0 map=7 unmap=7 release=7");
  // Precision getters, and set_compute_dtype outside create: refused.
  EXPECT_EQ(lines_with(lines, "precision create").at(0), "precision create dtype=0 scale=1");
  EXPECT_EQ(lines_with(lines, "precision TRAIN_BEGIN").at(0),
            "precision TRAIN_BEGIN dtype=0 scale=1 set_dtype=7");
  // drop_activations from another event than that layer's FORWARD_END: refused.
  EXPECT_EQ(lines_with(lines, "recompute ").at(0), "recompute TRAIN_BEGIN drop=7");

  // find_param: h.0.attn.c_attn.weight is layer 1 (after the embedding), the same view as
  // layer_param's; an unknown name and NULL are HR_ERROR_INVALID.
  const std::string find = lines_with(lines, "find ").at(0);
  EXPECT_EQ(field(find, "layer"), "1") << find;
  EXPECT_EQ(field(find, "same"), "1") << find;
  EXPECT_EQ(field(find, "missing"), "5") << find;
  EXPECT_EQ(field(find, "null_name"), "5") << find;
  EXPECT_EQ(lines_with(lines, "read ").at(0), "read ok=0 same=1 too_big=5");

  // Every op, f32 and bf16, against the plugin's own host-side reduction.
  const auto reduces = lines_with(lines, "reduce dtype=");
  ASSERT_EQ(reduces.size(), 8u) << join(lines);
  for (const auto& l : reduces) {
    const double got = number(l, "got"), want = number(l, "want");
    EXPECT_NEAR(got, want, 1e-9 * std::max(1.0, std::abs(want))) << l;
    if (field(l, "op") != "0") {
      EXPECT_GT(got, 0) << l;  // max, max-abs, sum of squares
    }
  }
  EXPECT_NE(field(reduces[0], "got"), field(reduces[4], "got")) << "bf16 rounds the elements";
  EXPECT_EQ(lines_with(lines, "reduce nan").at(0), "reduce nan max=nan max_abs=nan sum=nan");
  EXPECT_EQ(lines_with(lines, "reduce empty").at(0),
            "reduce empty sum=0 max=-inf max_abs=-inf sum_squares=0");

  // layer_activation_bytes: at FORWARD_END, the bytes the layer's activation views cover (> 0
  // for the block and the head); after its backward, 0.
  const auto fwd = lines_with(lines, "act FORWARD_END");
  ASSERT_EQ(fwd.size(), 3u) << join(lines);
  for (const auto& l : fwd)
    EXPECT_EQ(field(l, "bytes"), field(l, "views")) << l;
  EXPECT_GT(number(fwd[1], "bytes"), 0) << fwd[1];
  for (const auto& l : lines_with(lines, "act BACKWARD_END"))
    EXPECT_EQ(field(l, "bytes"), "0") << l;

  // Step state and event info, against the metrics: 2 steps of 2 micro-steps of 1 x 4 tokens.
  std::vector<nlohmann::json> metrics;
  for (const auto& l : read_lines(file("m.jsonl")))
    if (!l.empty()) metrics.push_back(nlohmann::json::parse(l));
  ASSERT_EQ(metrics.size(), 2u);
  const auto states = lines_with(lines, "state ");
  // Per step: STEP_BEGIN, 2 BACKWARD_END (layer 0), GRADS_READY, OPTIMIZER_STEP, STEP_END.
  ASSERT_EQ(states.size(), 12u) << join(lines);
  for (int step = 1; step <= 2; ++step) {
    const auto& m = metrics[step - 1];
    const double loss = m.at("loss").get<double>(), lr = m.at("lr").get<double>();
    const double norm = m.at("grad_norm").get<double>();
    const std::vector<std::string> st(states.begin() + 6 * (step - 1), states.begin() + 6 * step);
    EXPECT_EQ(split(st[0])[1], "STEP_BEGIN");
    EXPECT_EQ(split(st[1])[1], "BACKWARD_END");
    EXPECT_EQ(split(st[3])[1], "GRADS_READY");
    EXPECT_EQ(split(st[4])[1], "OPTIMIZER_STEP");
    EXPECT_EQ(split(st[5])[1], "STEP_END");
    for (const auto& l : st) {
      EXPECT_EQ(field(l, "step"), std::to_string(step)) << l;
      EXPECT_EQ(number(l, "lr"), lr) << l;
      EXPECT_EQ(field(l, "scale"), "1") << l;
      EXPECT_EQ(field(l, "skipped"), "0") << l;
    }
    // STEP_BEGIN: nothing known yet; no loss in its event info.
    EXPECT_EQ(field(st[0], "loss"), "0") << st[0];
    EXPECT_EQ(field(st[0], "tokens"), "0") << st[0];
    EXPECT_EQ(field(st[0], "info_tokens"), "0") << st[0];
    // BACKWARD_END: the micro-step's loss and its 4 tokens; the step's so far.
    EXPECT_EQ(field(st[1], "micro"), "1") << st[1];
    EXPECT_EQ(field(st[1], "info_tokens"), "4") << st[1];
    EXPECT_EQ(field(st[1], "tokens"), "4") << st[1];
    EXPECT_EQ(field(st[1], "loss"), field(st[1], "info_loss")) << st[1];
    EXPECT_EQ(field(st[2], "info_tokens"), "4") << st[2];
    EXPECT_EQ(field(st[2], "tokens"), "8") << st[2];
    const double l1 = number(st[1], "info_loss"), l2 = number(st[2], "info_loss");
    EXPECT_DOUBLE_EQ(number(st[2], "loss"), (l1 + l2) / 2) << st[2];
    // GRADS_READY and STEP_END: the step's loss, exactly the metrics', over its 8 tokens.
    for (const auto& l : {st[3], st[5]}) {
      EXPECT_EQ(number(l, "info_loss"), loss) << l;
      EXPECT_EQ(field(l, "info_tokens"), "8") << l;
      EXPECT_EQ(number(l, "loss"), loss) << l;
      EXPECT_EQ(field(l, "tokens"), "8") << l;
    }
    // The gradient norm and the clip coefficient from OPTIMIZER_STEP on (train.grad_clip is 1).
    EXPECT_EQ(field(st[3], "norm"), "0") << st[3];
    EXPECT_EQ(field(st[3], "clip"), "1") << st[3];
    EXPECT_EQ(number(st[4], "norm"), norm) << st[4];
    EXPECT_EQ(number(st[5], "norm"), norm) << st[5];
    EXPECT_EQ(number(st[4], "clip"), norm > 1 ? double(float(1 / (norm + 1e-6))) : 1.0) << st[4];
    // Other events carry no loss.
    EXPECT_EQ(field(st[4], "info_tokens"), "0") << st[4];
  }
}

// Clipping and a veto show in the step state: clip_coef below 1 by grad_clip / norm, and skipped
// from the veto on.
TEST_F(PluginAbi, StepStateShowsClippingAndVetoes) {
  const auto r = run_headroom("train " +
                              config(std::string(kTinyModel) + "grad_clip = 1e-3\n" +
                                     recorder("ext_probe", "p.txt", "veto_step = 2\n")) +
                              " --metrics " + file("m.jsonl"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto states = lines_with(read_lines(file("p.txt")), "state ");
  ASSERT_EQ(states.size(), 11u) << join(states);  // step 2 has no OPTIMIZER_STEP
  const double norm = number(states[4], "norm"), clip = number(states[4], "clip");
  EXPECT_GT(norm, 1e-3) << states[4];
  EXPECT_NEAR(clip, 1e-3 / norm, 1e-6 * clip) << states[4];
  EXPECT_EQ(field(states[9], "skipped"), "1") << states[9];  // GRADS_READY of step 2, vetoed
  EXPECT_EQ(split(states[10])[1], "STEP_END");
  EXPECT_EQ(field(states[10], "skipped"), "1") << states[10];
  EXPECT_EQ(field(states[8], "skipped"), "0") << states[8];  // before the veto
}

// --- ABI 1.6: EVAL_END and stopping the run (headroom.step/1 stop_run) ---------------------------

// A text corpus whose last tenth is the validation data (val_fraction 0.1); byte tokens.
std::string eval_config(const std::string& dir, int steps) {
  std::string text;
  for (int i = 0; i < 2000; ++i)
    text += char('a' + (i * 7) % 23);
  const std::string corpus = write_file(dir, "corpus.txt", text);
  return "[model]\nn_layer = 1\nn_head = 1\nn_embd = 8\nseq_len = 4\nvocab_size = 256\n"
         "[train]\nsteps = " +
         std::to_string(steps) +
         "\nmicro_batch = 1\nlr = 1e-2\nwarmup_steps = 0\nlr_schedule = \"constant\"\n"
         "eval_every = 1\neval_batches = 2\n"
         "[data]\nkind = \"text\"\npath = \"" +
         corpus + "\"\nval_fraction = 0.1\n";
}

std::vector<nlohmann::json> metrics_rows(const std::string& path) {
  std::vector<nlohmann::json> rows;
  for (const auto& line : read_lines(path))
    if (!line.empty()) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// early_stop with a min_delta no loss can beat: step 1 sets the best, steps 2 and 3 do not improve
// on it, and at step 3's EVAL_END it asks to stop (patience 2). The run finishes step 3, writes
// its snapshot ([snapshot] every = 5 had none due), fires TRAIN_END and exits 7 naming the plugin
// and its reason. Each EVAL_END carried the loss the metrics report as that step's val_loss (the
// same double) and the tokens of two validation batches. Resumed from the stop's snapshot, the run
// ends with the weights an unbroken run has, bitwise, and its losses.
TEST_F(PluginAbi, EarlyStopOnTheValidationLossStopsCleanlyAndResumesBitwise) {
  const std::string snaps = "[snapshot]\nevery = 5\ndir = \"" + file("snaps") + "\"\n";
  const std::string base = eval_config(dir, 8) + snaps;
  const auto stopping = [&](const std::string& keys) {
    return plugin("early_stop", "out = \"" + file("stop.txt") + "\"\n" + keys);
  };
  const auto r =
      run_headroom("train " + config(base + stopping("patience = 2\nmin_delta = 1e9\n")) +
                   " --metrics " + file("m.jsonl"));
  ASSERT_EQ(r.exit_code, 7) << r.output;
  EXPECT_TRUE(test::contains(r.output,
                             "stopped by plugin 'early_stop' after step 3 of 8: the validation "
                             "loss has not improved on "))
      << r.output;
  EXPECT_TRUE(test::contains(r.output, "(step 1) for 2 evaluations; snapshot ")) << r.output;
  EXPECT_TRUE(test::contains(
      r.output, "step_000000000003.hrsnap written (resume with --resume " + file("snaps") + ")"))
      << r.output;

  const auto lines = read_lines(file("stop.txt"));
  const auto evals = lines_with(lines, "early_stop EVAL_END");
  const auto rows = metrics_rows(file("m.jsonl"));
  ASSERT_EQ(evals.size(), 3u) << join(lines);
  ASSERT_EQ(rows.size(), 3u) << r.output;  // every row whole, none for a step not run
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(field(evals[i], "step"), std::to_string(i + 1)) << evals[i];
    EXPECT_EQ(number(evals[i], "loss"), rows[i].at("val_loss").get<double>()) << evals[i];
    EXPECT_EQ(field(evals[i], "tokens"), "8") << evals[i];  // 2 batches of 1 x 4
  }
  EXPECT_EQ(field(evals[2], "bad"), "2");
  ASSERT_EQ(lines_with(lines, "early_stop STOP").size(), 1u) << join(lines);
  EXPECT_EQ(lines_with(lines, "early_stop STOP")[0], "early_stop STOP step=3");
  EXPECT_EQ(lines.back(), "early_stop TRAIN_END step=3") << join(lines);
  ASSERT_TRUE(fs::exists(file("snaps/step_000000000003.hrsnap")));

  // Resumed without a stop in sight (patience 100), and an unbroken run of 8 steps.
  const std::string patient = stopping("patience = 100\n");
  const auto resumed =
      run_headroom("train " + config(base + patient) + " --resume " + file("snaps") +
                   " --metrics " + file("resumed.jsonl") + " --save-weights " + file("r.st"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(lines_with(read_lines(file("stop.txt")), "early_stop LOAD").at(0),
            "early_stop LOAD best=" + field(evals[0], "loss") + " best_step=1 bad=2");
  fs::remove_all(file("snaps"));
  const auto whole = run_headroom("train " + config(base + patient) + " --metrics " +
                                  file("whole.jsonl") + " --save-weights " + file("w.st"));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const auto a = losses(file("whole.jsonl")), b = losses(file("resumed.jsonl"));
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 5u);  // steps 4 .. 8
  for (size_t i = 0; i < 5; ++i)
    EXPECT_EQ(a[i + 3], b[i]) << "step " << i + 4;
  EXPECT_FALSE(file_bytes(file("w.st")).empty());
  EXPECT_TRUE(file_bytes(file("w.st")) == file_bytes(file("r.st")))
      << "the resumed run's weights differ from the unbroken run's";
}

// A stop asked for at TRAIN_BEGIN: no step runs, nothing to snapshot, exit 7.
TEST_F(PluginAbi, StopRunAtTrainBeginStopsBeforeStepOne) {
  const auto r = run_headroom(
      "train " +
      config(eval_config(dir, 4) + "[snapshot]\nevery = 1\ndir = \"" + file("snaps") + "\"\n" +
             plugin("early_stop",
                    "out = \"" + file("stop.txt") + "\"\nstop_at_train_begin = true\n")) +
      " --metrics " + file("m.jsonl"));
  ASSERT_EQ(r.exit_code, 7) << r.output;
  EXPECT_TRUE(test::contains(r.output,
                             "stopped by plugin 'early_stop' after step 0 of 4: asked at "
                             "TRAIN_BEGIN; no step completed, so no snapshot"))
      << r.output;
  EXPECT_TRUE(metrics_rows(file("m.jsonl")).empty());
  EXPECT_EQ(read_lines(file("stop.txt")).back(), "early_stop TRAIN_END step=0");
}

// headroom.step/1 set_events (ABI 1.8): narrowed in create() to STEP_BEGIN and STEP_END, the
// plugin gets those alone (and its later call, from STEP_BEGIN, is refused: create() only);
// asking for more than its descriptor's events fails the run before step 1, naming the plugin.
TEST_F(PluginAbi, SetEventsNarrowsWhatAPluginGetsFromCreateOnly) {
  const uint64_t mask = HR_EVENT_BIT(HR_EVENT_STEP_BEGIN) | HR_EVENT_BIT(HR_EVENT_STEP_END);
  const auto r = run_headroom(
      "train " + config(eval_config(dir, 3) +
                        plugin("all_events", "out = \"" + file("e.txt") + "\"\nset_events = " +
                                                 std::to_string(mask) + "\n")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto lines = read_lines(file("e.txt"));
  EXPECT_EQ(lines_with(lines, "all_events EVENT 2 ").size(), 3u) << join(lines);
  EXPECT_EQ(lines_with(lines, "all_events EVENT 3 ").size(), 3u) << join(lines);
  EXPECT_EQ(lines_with(lines, "all_events EVENT ").size(), 6u) << join(lines);
  EXPECT_TRUE(lines_with(lines, "CATEGORIES").empty()) << "no TRAIN_END: " << join(lines);
  const auto late = lines_with(lines, "all_events SET_EVENTS_LATE");
  ASSERT_EQ(late.size(), 3u) << join(lines);
  EXPECT_EQ(late[0], "all_events SET_EVENTS_LATE " + std::to_string(int(HR_ERROR_NOT_ALLOWED)));

  const auto wide = run_headroom(
      "train " + config(eval_config(dir, 3) +
                        plugin("all_events", "out = \"" + file("w.txt") + "\"\nset_events = " +
                                                 std::to_string(mask) + "\nwiden_after = true\n")));
  EXPECT_NE(wide.exit_code, 0) << wide.output;
  EXPECT_TRUE(test::contains(wide.output, "all_events")) << wide.output;
  EXPECT_TRUE(test::contains(wide.output, "set_events: asks for events it does not take"))
      << wide.output;
}

// Every event bit subscribed (~0): a plugin built for 1.6 gets EVAL_END after each evaluation,
// with the metrics' val_loss; the same plugin built against the frozen 1.5 and 1.4 headers never
// does (nor anything above BUCKET_DONE, or for 1.4 above OOM), and runs at its own version. Built
// against the frozen 1.7 header it still loads in this 1.8 host and gets EVAL_END too.
TEST_F(PluginAbi, OnlyPluginsOfAbi1_6GetEvalEnd) {
  const auto r = run_headroom(
      "train " +
      config(eval_config(dir, 2) + plugin("all_events", "out = \"" + file("e.txt") + "\"\n") +
             plugin("all_events_v1_7", "out = \"" + file("e.txt") + "\"\n") +
             plugin("all_events_v1_5", "out = \"" + file("e.txt") + "\"\n") +
             plugin("all_events_v1_4", "out = \"" + file("e.txt") + "\"\n")) +
      " --metrics " + file("m.jsonl"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto lines = read_lines(file("e.txt"));
  const auto rows = metrics_rows(file("m.jsonl"));
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(lines_with(lines, "all_events CREATE").at(0), "all_events CREATE abi=1.8");
  EXPECT_EQ(lines_with(lines, "all_events_v1_7 CREATE").at(0), "all_events_v1_7 CREATE abi=1.7");
  EXPECT_EQ(lines_with(lines, "all_events_v1_5 CREATE").at(0), "all_events_v1_5 CREATE abi=1.5");
  EXPECT_EQ(lines_with(lines, "all_events_v1_4 CREATE").at(0), "all_events_v1_4 CREATE abi=1.4");
  EXPECT_EQ(lines_with(lines, "all_events_v1_7 EVENT 15 ").size(), 2u) << join(lines);
  const auto evals = lines_with(lines, "all_events EVENT 15 ");
  ASSERT_EQ(evals.size(), 2u) << join(lines);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(field(evals[i], "step"), std::to_string(i + 1));
    EXPECT_EQ(number(evals[i], "loss"), rows[i].at("val_loss").get<double>()) << evals[i];
    EXPECT_EQ(field(evals[i], "tokens"), "8");
  }
  size_t older = 0;
  for (const auto& line : lines) {
    const auto w = split(line);
    if (w.size() < 3 || w[1] != "EVENT" || w[0] == "all_events" || w[0] == "all_events_v1_7")
      continue;
    ++older;
    const int event = std::stoi(w[2]);
    EXPECT_LT(event, w[0] == "all_events_v1_5" ? HR_EVENT_EVAL_END : HR_EVENT_COUNT_V1) << line;
  }
  EXPECT_GT(older, 20u) << join(lines);  // they did receive the rest
}

// The model of the plugin memory tests: big enough that weight_ema's shadows (28,928 bytes)
// stand out.
const char* const kEmaModel =
    "[model]\nn_layer = 2\nn_head = 2\nn_embd = 16\nseq_len = 8\nvocab_size = 32\n"
    "[train]\nsteps = 2\nmicro_batch = 2\n";

// A plugin's own memory (ABI 1.7): weight_ema's shadows are HR_MEM_PLUGIN, which the metrics,
// memory_stats and the end-of-run report show as "plugin", under the plugin's name, beside an
// optimizer category that is the run's without the plugin. A plugin that negotiated 1.6 sees
// those buffers' ALLOC events as HR_MEM_OPTIMIZER (it has no category 7); one of 1.7 sees 7.
TEST_F(PluginAbi, APluginsOwnMemoryIsItsOwnCategoryUnderItsName) {
  const std::string model = kEmaModel;
  const auto plain = run_headroom("train " + config(model) + " --metrics " + file("p.jsonl"));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  const auto r =
      run_headroom("train " +
                   config(model + recorder("weight_ema", "ema.txt") +
                          recorder("all_events", "e.txt") + recorder("all_events_v1_6", "e.txt")) +
                   " --metrics " + file("m.jsonl"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto base = metrics_rows(file("p.jsonl")).back();
  const auto row = metrics_rows(file("m.jsonl")).back();
  const auto& by = row.at("mem_peak_by_category");
  const uint64_t params = by.at("parameters").get<uint64_t>();  // f32 weights: 4 B each
  // all_events' 64-byte probe of category 7 at TRAIN_BEGIN (below), freed at once, is in the
  // category's own peak; the run's peak, later in a step, holds the shadows alone.
  const uint64_t probe = 64;
  EXPECT_EQ(by.at("plugin").get<uint64_t>(), params + probe);
  EXPECT_EQ(row.at("mem_peak_by_plugin").at("weight_ema").get<uint64_t>(), params);
  EXPECT_EQ(base.at("mem_peak_by_category").at("plugin").get<uint64_t>(), 0u);
  EXPECT_FALSE(base.contains("mem_peak_by_plugin"));
  for (const char* c : {"parameters", "gradients", "optimizer", "activations", "workspace"})
    EXPECT_EQ(by.at(c), base.at("mem_peak_by_category").at(c)) << c;
  EXPECT_EQ(row.at("mem_peak_bytes").get<uint64_t>(),
            base.at("mem_peak_bytes").get<uint64_t>() + params);
  // The end-of-run report: the category, then the plugin that holds it.
  EXPECT_TRUE(test::contains(r.output, "\n  plugin      ")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "    'weight_ema'")) << r.output;
  // memory_stats (1.7): live_plugin holds them, the optimizer's entry does not.
  const auto stats = lines_with(read_lines(file("ema.txt")), "weight_ema STATS");
  ASSERT_EQ(stats.size(), 2u);
  for (const auto& line : stats) {
    EXPECT_EQ(std::stoull(field(line, "live_plugin")), params) << line;
    EXPECT_EQ(std::stoull(field(line, "peak_plugin")), params + probe) << line;
  }
  const auto events = read_lines(file("e.txt"));
  const auto now = lines_with(events, "all_events CATEGORIES");
  const auto older = lines_with(events, "all_events_v1_6 CATEGORIES");
  ASSERT_EQ(now.size(), 1u) << join(events);
  ASSERT_EQ(older.size(), 1u) << join(events);
  const unsigned long seen_now = std::stoul(split(now[0]).at(2));
  const unsigned long seen_older = std::stoul(split(older[0]).at(2));
  EXPECT_TRUE(seen_now & (1ul << HR_MEM_PLUGIN)) << now[0];
  EXPECT_FALSE(seen_older & (1ul << HR_MEM_PLUGIN)) << older[0];
  EXPECT_TRUE(seen_older & (1ul << HR_MEM_OPTIMIZER)) << older[0];
  // Only a plugin that negotiated 1.7 may allocate in category 7.
  EXPECT_EQ(lines_with(events, "all_events ALLOC7").at(0), "all_events ALLOC7 granted");
  EXPECT_EQ(lines_with(events, "all_events_v1_6 ALLOC7").at(0), "all_events_v1_6 ALLOC7 refused");
}

// Under a memory limit the shadows do not fit beside: the out-of-memory report lists the plugin
// category and the plugin that holds it.
TEST_F(PluginAbi, TheOutOfMemoryReportNamesThePluginHoldingItsOwnMemory) {
  const std::string model = kEmaModel;
  const auto plain = run_headroom("train " + config(model) + " --metrics " + file("p.jsonl"));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  const uint64_t peak = metrics_rows(file("p.jsonl")).back().at("mem_peak_bytes").get<uint64_t>();
  const auto r = run_headroom(
      "train " + config(model + "[device]\nmemory_limit = " + std::to_string(peak + 4096) + "\n" +
                        recorder("weight_ema", "ema.txt")));
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_TRUE(test::contains(r.output, "\n    plugin      ")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "      'weight_ema'")) << r.output;
}

// load_state's moment (ext/state.h, plugin-guide section 14): once, after create() and after the
// model is built and the snapshot's values are in it, before TRAIN_BEGIN. load_probe fingerprints
// every parameter there (layer_param, op_sum_squares): the model has its layers, every parameter
// and gradient is allocated, and the values are the snapshot's — the fingerprint the plugin took
// at the snapshot step's STEP_END, bitwise, not a fresh initialisation's.
TEST_F(PluginAbi, LoadStateSeesTheResumedModel) {
  const std::string cfg =
      config(std::string(kTinyModel) + "[snapshot]\nevery = 2\ndir = \"" + file("snaps") + "\"\n" +
             plugin("load_probe", "out = \"" + file("p.txt") + "\"\n"));
  ASSERT_EQ(run_headroom("train " + cfg).exit_code, 0);
  const auto first = read_lines(file("p.txt"));
  ASSERT_EQ(first.size(), 4u) << join(first);
  EXPECT_EQ(first[0], "load_probe CREATE layers=0");  // no model in create
  const std::string fresh = field(first[1], "fp"), saved = field(first[3], "fp");
  EXPECT_EQ(first[3].rfind("load_probe STEP_END step=2 ", 0), 0u) << first[3];
  EXPECT_NE(fresh, saved);  // training moved the weights

  fs::remove(file("p.txt"));
  const auto r = run_headroom("train " + cfg + " --set train.steps=3 --resume " + file("snaps"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto lines = read_lines(file("p.txt"));
  ASSERT_EQ(lines.size(), 4u) << join(lines);
  EXPECT_EQ(lines[0], "load_probe CREATE layers=0");
  // The 3 layers, every parameter with its gradient.
  const auto load = split(lines[1]);
  ASSERT_EQ(load.at(1), "LOAD") << lines[1];
  EXPECT_EQ(field(lines[1], "layers"), "3");
  EXPECT_GT(std::stoi(field(lines[1], "params")), 0);
  EXPECT_EQ(field(lines[1], "grads"), field(lines[1], "params")) << lines[1];
  EXPECT_EQ(field(lines[1], "fp"), saved) << lines[1];
  EXPECT_EQ(field(lines[1], "saved_fp"), saved) << lines[1];
  EXPECT_EQ(field(lines[1], "saved_step"), "2");
  EXPECT_EQ(field(lines[1], "began"), "0");  // before TRAIN_BEGIN
  EXPECT_EQ(lines[2], "load_probe TRAIN_BEGIN fp=" + saved + " loaded=1");
  EXPECT_EQ(lines[3].rfind("load_probe STEP_END step=3 ", 0), 0u) << lines[3];
}

// A compute dtype chosen through headroom.precision/1 in create: the getter says so at
// TRAIN_BEGIN, and the run trains in it.
TEST_F(PluginAbi, PrecisionExtensionChoosesTheComputeDtype) {
  const auto r = run_headroom(
      "train " + config(kTinyModel + recorder("ext_probe", "p.txt", "dtype = \"bf16\"\n")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto lines = read_lines(file("p.txt"));
  EXPECT_EQ(lines_with(lines, "precision TRAIN_BEGIN").at(0),
            "precision TRAIN_BEGIN dtype=1 scale=1 set_dtype=7")
      << join(lines);
}

// A plugin without the allocator role that returns the vm services' refusal from create fails the
// run cleanly (exit code 2, as for any plugin that fails to start), with the host's message: the
// function, the rule, the plugin.
TEST_F(PluginAbi, VmServicesWithoutTheAllocatorRoleAreNotAllowed) {
  for (const auto& [fail, function] : std::vector<std::pair<std::string, std::string>>{
           {"vm1", "headroom.vm/1 map"}, {"vm14", "vm_map"}}) {
    const auto r =
        run_headroom("train " + config(kTinyModel + recorder("ext_probe", "p.txt",
                                                             "fail = \"" + fail + "\"\n")));
    EXPECT_EQ(r.exit_code, 2) << fail << ": " << r.output;  // a plugin failing to start
    EXPECT_TRUE(test::contains(
        r.output, function + ": not allowed: the allocator role only; plugin 'ext_probe' does "
                             "not provide the allocator role (its descriptor's roles: -)"))
        << fail << ": " << r.output;
    EXPECT_TRUE(test::contains(r.output, "failed to start (create)")) << r.output;
    EXPECT_FALSE(test::contains(lower(r.output), "segmentation")) << r.output;
  }
}

// headroom.comm/1 at world size 1 (a run without a launcher): rank 0 of 1; every collective is
// local, so the sums and means are each buffer itself and reduce_scatter / all_gather copy rank 0's
// block; bad arguments are HR_ERROR_INVALID (5); from inside an ALLOC hook every collective and
// wait is HR_ERROR_NOT_ALLOWED (7) while rank and world size still answer. tests/mpi/comm_plugin.sh
// checks the same plugin on 2 ranks.
TEST_F(PluginAbi, CommExtensionAtWorldSizeOne) {
  const auto r = run_headroom("train " + config(kTinyModel + recorder("comm_probe", "probe")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto lines = read_lines(file("probe.rank0.txt"));
  ASSERT_FALSE(lines.empty()) << r.output;
  EXPECT_FALSE(fs::exists(file("probe.rank1.txt")));
  // The ALLOC line comes where the first allocation after create fell; the rest in order.
  const auto alloc = lines_with(lines, "alloc ");
  ASSERT_EQ(alloc.size(), 1u) << join(lines);
  EXPECT_EQ(alloc[0],
            "alloc rank=0 world=1 all_reduce=7 reduce_scatter=7 all_gather=7 broadcast=7 "
            "barrier=7 wait=7");
  std::vector<std::string> rest;
  for (const auto& l : lines)
    if (l.rfind("alloc ", 0) != 0) rest.push_back(l);
  EXPECT_EQ(join(rest),
            "create ext=1 size=1 rank=0 local_rank=0 world=1\n"
            "info TRAIN_BEGIN rank=0 local_rank=0 world=1 stream_null=1 same_stream=1\n"
            "all_reduce f32 sum 1 1 1\n"
            "all_reduce f32 average 1 1 1\n"
            "all_reduce bf16 sum 1 1 1\n"
            "all_reduce f16 average 1 1 1\n"
            "reduce_scatter sum 0 1\n"
            "reduce_scatter average 0 1\n"
            "all_gather 1 10\n"
            "broadcast root=0 1 1 1\n"
            "barrier post=0 wait=0 wait_null=0\n"
            "invalid dtype=5 op=5 root=5 neg_root=5 out=5\n"
            "step_end step=1 sum=1 barrier=0\n"
            "step_end step=2 sum=2 barrier=0\n");
}

// Roles and state offered through descriptor->get_extension, every descriptor field NULL: the
// allocator serves the run's memory, the optimizer updates it, and the state survives a resume.
TEST_F(PluginAbi, RolesAndStateOfferedAsExtensions) {
  const std::string cfg =
      config(std::string(kTinyModel) + "[snapshot]\nevery = 1\ndir = \"" + file("snaps") + "\"\n" +
             plugin("offered", "out = \"" + file("o.txt") + "\"\n"));
  const auto r = run_headroom("train " + cfg + " --metrics " + file("m.jsonl"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto lines = read_lines(file("o.txt"));
  ASSERT_EQ(lines.size(), 3u) << join(lines);
  EXPECT_EQ(field(lines[0], "step"), "1") << join(lines);
  EXPECT_EQ(field(lines[0], "steps"), "1") << join(lines);
  EXPECT_EQ(field(lines[1], "step"), "2") << join(lines);
  EXPECT_EQ(field(lines[1], "steps"), "2") << join(lines);
  EXPECT_EQ(split(lines[2])[1], "DESTROY");
  EXPECT_GT(number(lines[2], "allocations"), 5) << lines[2];
  EXPECT_EQ(field(lines[2], "live"), "0") << lines[2];
  const auto m = nlohmann::json::parse(read_lines(file("m.jsonl")).back());
  EXPECT_EQ(m.at("mem_peak_by_category").at("optimizer"), 0) << m;

  fs::remove(file("o.txt"));
  const auto resumed =
      run_headroom("train " + cfg + " --set train.steps=3 --resume " + file("snaps"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  lines = read_lines(file("o.txt"));
  ASSERT_GE(lines.size(), 2u) << join(lines);
  EXPECT_EQ(lines[0], "offered LOAD steps=2");
  EXPECT_EQ(field(lines[1], "step"), "3") << join(lines);
  EXPECT_EQ(field(lines[1], "steps"), "3") << join(lines);
}

// A descriptor inside a larger struct (from a minor version newer than the host's): the host reads
// what it knows, negotiates its own version, and runs the hooks.
TEST_F(PluginAbi, LargerDescriptorFromANewerMinorLoads) {
  const auto r = run_headroom(
      "train " + config(kTinyModel + plugin("bigger", "out = \"" + file("b.txt") + "\"\n")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto lines = read_lines(file("b.txt"));
  ASSERT_EQ(lines.size(), 3u) << join(lines);
  // It offered 1.<minor + 1>, so the newest both speak is the host's own.
  EXPECT_EQ(lines[0], "bigger CREATE abi=1." + std::to_string(HR_ABI_VERSION_MINOR))
      << "services->abi_version is the version the plugin chose";
  EXPECT_EQ(lines[1], "bigger STEP_END step=1");
  EXPECT_EQ(lines[2], "bigger STEP_END step=2");
}

// The same plugin answering its newer version whatever the host offers: it still runs (same
// major), and the version the host tells it in services->abi_version is one the host speaks.
TEST_F(PluginAbi, NewerMinorAnsweredOutsideTheRangeRunsAtTheHostsVersion) {
  const auto r = run_headroom(
      "train " + config(kTinyModel + plugin("bigger_naive", "out = \"" + file("b.txt") + "\"\n")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto lines = read_lines(file("b.txt"));
  ASSERT_EQ(lines.size(), 3u) << join(lines);
  EXPECT_EQ(lines[0], "bigger_naive CREATE abi=1." + std::to_string(HR_ABI_VERSION_MINOR))
      << "services->abi_version must be a version this host speaks";
  EXPECT_EQ(lines[2], "bigger_naive STEP_END step=2");
}

// --- `headroom plugins` --------------------------------------------------------------------------

TEST_F(PluginAbi, PluginsCommandListsWhatThePathHolds) {
  const std::string a = test::temp_dir(), b = test::temp_dir();
  for (const char* name : {"rec_a", "rec_b", "frozen_v1_0"})
    copy_plugin(name, a, kMode755);
  for (const char* name : {"alloc_a", "plain_sgd"})
    copy_plugin(name, b, kMode755);
  set_plugin_path(a + ":" + b);
  const auto r = run_headroom("plugins");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  // name, version, file
  const std::vector<std::array<std::string, 3>> expected = {
      {"rec_a", "0.3.1", a + "/rec_a.so"},
      {"rec_b", "0.3.2", a + "/rec_b.so"},
      {"frozen_v1_0", "1.0.0", a + "/frozen_v1_0.so"},
      {"alloc_a", "2.0.1", b + "/alloc_a.so"},
      {"plain_sgd", "1.4.0", b + "/plain_sgd.so"}};
  for (const auto& [name, version, path] : expected) {
    EXPECT_TRUE(test::contains(r.output, name)) << name << ":\n" << r.output;
    EXPECT_TRUE(test::contains(r.output, version)) << name << " " << version << ":\n" << r.output;
    EXPECT_TRUE(test::contains(r.output, path)) << path << ":\n" << r.output;
  }
  EXPECT_TRUE(test::contains(r.output, "1.0")) << "the ABI version:\n" << r.output;
  EXPECT_TRUE(test::contains(lower(r.output), "allocator")) << r.output;
  EXPECT_TRUE(test::contains(lower(r.output), "optimizer")) << r.output;
  EXPECT_TRUE(test::contains(lower(r.output), "step_end")) << "the events:\n" << r.output;
  EXPECT_TRUE(test::contains(lower(r.output), "grads_ready")) << "the events:\n" << r.output;
}

// A C++17 plugin built with headroom_add_plugin (std::string, std::vector, std::to_string inside;
// its descriptor filled field by field) loads and runs, and exports hr_plugin_entry alone: the
// version script keeps the C++ runtime's weak template symbols in.
TEST_F(PluginAbi, CxxPluginRunsAndExportsOnlyTheEntryPoint) {
  const auto r = run_headroom("train " + config(kTinyModel + recorder("cxx_recorder", "c.txt")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto lines = read_lines(file("c.txt"));
  ASSERT_EQ(lines.size(), 5u) << join(lines);
  EXPECT_EQ(lines[0], "cxx_recorder TRAIN_BEGIN step=0");
  EXPECT_EQ(lines[2], "cxx_recorder STEP_END step=2");
  EXPECT_EQ(lines[4], "cxx_recorder kept 1 2");

  const std::string so = kPluginDir + "/cxx_recorder.so";
  const test::RunResult defined = test::run_command("nm -D --defined-only '" + so + "'");
  ASSERT_EQ(defined.exit_code, 0) << defined.output;
  std::vector<std::string> names;
  std::istringstream in(defined.output);
  for (std::string line; std::getline(in, line);)
    if (!split(line).empty()) names.push_back(split(line).back());
  EXPECT_EQ(names, std::vector<std::string>{"hr_plugin_entry"}) << defined.output;
  // It does use the C++ runtime: the templates are there, only not exported.
  const test::RunResult all = test::run_command("nm -C '" + so + "'");
  EXPECT_TRUE(test::contains(all.output, "std::")) << all.output;
}

// Broken libraries on the path are listed with what is wrong, and do not hide the good ones.
TEST_F(PluginAbi, PluginsCommandShowsBrokenLibraries) {
  const auto r = run_headroom("plugins");
  EXPECT_TRUE(test::contains(r.output, "rec_a")) << r.output;
  EXPECT_TRUE(test::contains(r.output, kPluginDir + "/bad_entry.so")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "this plugin refuses to load")) << r.output;
}

// --- What the libraries export -------------------------------------------------------------------

// Every test plugin exports exactly one defined dynamic symbol, hr_plugin_entry (no_entry, which
// exists to lack it, exports none).
TEST_F(PluginAbi, PluginsExportOnlyTheEntryPoint) {
  int checked = 0;
  for (const auto& entry : fs::directory_iterator(kPluginDir)) {
    if (entry.path().extension() != ".so") continue;
    const std::string cmd = "nm -D --defined-only '" + entry.path().string() + "'";
    const test::RunResult nm = test::run_command(cmd);
    const std::string& out = nm.output;
    ASSERT_EQ(nm.exit_code, 0) << cmd << "\n" << out;
    std::vector<std::string> symbols;
    std::istringstream in(out);
    for (std::string line; std::getline(in, line);) {
      const auto w = split(line);
      if (w.empty()) continue;
      ASSERT_EQ(w.size(), 3u) << "address, type, name: " << line;
      symbols.push_back(w[1] + " " + w[2]);
    }
    if (entry.path().stem() == "no_entry")  // the version script keeps its misspelling in too
      EXPECT_EQ(symbols, std::vector<std::string>{}) << out;
    else
      EXPECT_EQ(symbols, std::vector<std::string>{"T hr_plugin_entry"}) << entry.path() << out;
    ++checked;
  }
  EXPECT_GE(checked, 12) << "the test plugins are missing from " << kPluginDir;
}

}  // namespace
}  // namespace headroom
