#define BOOST_DLL_USE_STD_FS
#include "core/plugin_host/plugin_host.h"

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <toml++/toml.h>
#include <algorithm>
#include <boost/dll/shared_library.hpp>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include "core/device/backend.h"
#include "headroom/plugin.h"

// The opaque handle a plugin passes back to every service: which plugin is calling.
struct hr_host {
  headroom::PluginHost* owner = nullptr;
  headroom::LoadedPlugin* plugin = nullptr;
};

namespace headroom {

namespace fs = std::filesystem;

namespace {

constexpr uint32_t kHostAbiMin = HR_ABI_MAKE_VERSION(1, 0);
constexpr uint32_t kHostAbiMax = HR_ABI_VERSION;

// Copies what the writer's struct_size covers into a zeroed struct of the reader's layout.
template <class S>
S read_sized(const S* src) {
  S out;
  std::memset(&out, 0, sizeof out);
  const size_t n = std::min<size_t>(src->struct_size, sizeof(S));
  std::memcpy(&out, src, n);
  out.struct_size = static_cast<uint32_t>(sizeof(S));
  return out;
}

// Writes a host-side struct into the caller's, only as far as the caller's struct_size reaches.
// A struct_size below ABI 1.0's (a caller that left it zero) counts as 1.0's: every field of 1.0
// is filled. `v1_0_size` is the struct's size in ABI 1.0 (hr_tensor and hr_memory_stats have not
// grown since).
template <class S>
void write_sized(S* dst, const S& src, size_t v1_0_size = sizeof(S)) {
  const size_t size = std::max<size_t>(dst->struct_size, v1_0_size);
  std::memcpy(dst, &src, std::min<size_t>(size, sizeof(S)));
  dst->struct_size = static_cast<uint32_t>(std::min<size_t>(size, sizeof(S)));
}

std::string exe_dir() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "";
  buf[n] = '\0';
  return fs::path(buf).parent_path().string();
}

std::string mode_str(mode_t mode) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "mode %04o", unsigned(mode & 07777));
  return buf;
}

// Why loading `file` would let others than its owner change the code headroom runs, or "": the
// file, or its folder, is writable by the group or by others. A folder with the sticky bit (/tmp)
// is safe for a file its owner or root owns there: nobody else can rename or remove it.
std::string unsafe_because(const fs::path& file) {
  struct stat st, dir;
  if (stat(file.c_str(), &st) != 0) return "";
  if (st.st_mode & (S_IWGRP | S_IWOTH))
    return "'" + file.string() + "' is writable by others than its owner (" + mode_str(st.st_mode) +
           "); refusing to load it (chmod go-w '" + file.string() + "' fixes that)";
  const fs::path folder = file.has_parent_path() ? file.parent_path() : fs::path(".");
  if (stat(folder.c_str(), &dir) != 0 || !(dir.st_mode & (S_IWGRP | S_IWOTH))) return "";
  const bool owned = st.st_uid == geteuid() || st.st_uid == 0;
  if ((dir.st_mode & S_ISVTX) && owned) return "";
  return "'" + file.string() + "' is in the folder '" + folder.string() +
         "', which is writable by others than its owner (" + mode_str(dir.st_mode) +
         "): they could replace the plugin; refusing to load it (chmod go-w '" + folder.string() +
         "', or move the plugin to a folder only you can write)";
}

// ELF identification: what the first bytes of a shared library say it was built for.
struct ElfId {
  unsigned cls = 0;   // ELFCLASS32 / ELFCLASS64
  unsigned data = 0;  // ELFDATA2LSB / ELFDATA2MSB
  unsigned type = 0;  // ET_DYN for a shared library
  unsigned machine = 0;
};

// The identification of an ELF header's first 20 bytes (e_ident, e_type, e_machine).
ElfId elf_id(const unsigned char* b) {
  ElfId id;
  id.cls = b[EI_CLASS];
  id.data = b[EI_DATA];
  auto u16 = [&](int at) {
    return id.data == ELFDATA2MSB ? unsigned(b[at]) << 8 | b[at + 1]
                                  : unsigned(b[at]) | unsigned(b[at + 1]) << 8;
  };
  id.type = u16(16);
  id.machine = u16(18);
  return id;
}

// This process's own identification (from /proc/self/exe); false when it cannot be read.
bool host_elf_id(ElfId* out) {
  static const std::pair<bool, ElfId> id = [] {
    unsigned char b[20] = {0};
    const int fd = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return std::make_pair(false, ElfId{});
    const ssize_t n = read(fd, b, sizeof b);
    close(fd);
    if (n != ssize_t(sizeof b) || std::memcmp(b, ELFMAG, SELFMAG) != 0)
      return std::make_pair(false, ElfId{});
    return std::make_pair(true, elf_id(b));
  }();
  *out = id.second;
  return id.first;
}

std::string machine_name(unsigned machine) {
  switch (machine) {
    case EM_X86_64:
      return "x86-64";
    case EM_386:
      return "32-bit x86";
    case EM_AARCH64:
      return "AArch64 (64-bit ARM)";
    case EM_ARM:
      return "32-bit ARM";
    case EM_PPC64:
      return "64-bit PowerPC";
    case EM_PPC:
      return "32-bit PowerPC";
    case EM_S390:
      return "IBM Z (s390)";
    case EM_RISCV:
      return "RISC-V";
    case EM_MIPS:
      return "MIPS";
    default:
      return "ELF machine " + std::to_string(machine);
  }
}

// The first bytes of a file as a C string literal, for a message: "this is not an".
std::string quoted_start(const unsigned char* b, size_t n) {
  std::string q = "\"";
  for (size_t i = 0; i < std::min<size_t>(n, 16); ++i) {
    const unsigned char c = b[i];
    if (c == '\n') {
      q += "\\n";
    } else if (c == '"' || c == '\\') {
      q += '\\';
      q += char(c);
    } else if (c >= 0x20 && c < 0x7f) {
      q += char(c);
    } else {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", unsigned(c));
      q += hex;
    }
  }
  return q + (n > 16 ? "...\"" : "\"");
}

// Why `file` is not a shared library this process can load, from what it is and from its first
// bytes: a missing file, a directory, an empty or text file, an ELF file of another kind or for
// another machine. "" when it may be one (dlopen then has the last word). dlopen's own words for
// these ("file too short" for a text file, "invalid ELF header") do not say what is wrong.
std::string not_a_library(const std::string& file) {
  std::error_code ec;
  const fs::file_status st = fs::status(file, ec);
  if (!fs::exists(st)) {
    if (fs::is_symlink(fs::symlink_status(file, ec)))
      return "is a broken symbolic link (to '" + fs::read_symlink(file, ec).string() +
             "', which does not exist)";
    return "does not exist";
  }
  if (fs::is_directory(st))
    return "is a directory, not a shared library: name the plugin's .so file itself";
  if (!fs::is_regular_file(st))
    return "is not a regular file (a device, a pipe or a socket), not a shared library";
  const int fd = open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::string("cannot be read: ") + std::strerror(errno);
  unsigned char b[64] = {0};
  const ssize_t n = read(fd, b, sizeof b);
  const int read_errno = errno;
  close(fd);
  if (n < 0) return std::string("cannot be read: ") + std::strerror(read_errno);
  const std::string plugin_is =
      "; a plugin is a shared library built against headroom/plugin.h (docs/plugin-guide.md)";
  if (n == 0) return "is not a shared library: it is empty (0 bytes)" + plugin_is;
  if (n < SELFMAG || std::memcmp(b, ELFMAG, SELFMAG) != 0)
    return "is not a shared library: it is not an ELF file (it starts with " +
           quoted_start(b, size_t(n)) + ")" + plugin_is;
  if (n < 20)
    return "is not a shared library: it is a truncated ELF file (" + std::to_string(n) + " bytes)";
  const ElfId id = elf_id(b);
  ElfId host;
  if (host_elf_id(&host)) {
    const std::string rebuild = ": build the plugin for this machine";
    if (id.cls != host.cls && (id.cls == ELFCLASS32 || id.cls == ELFCLASS64))
      return std::string("is a ") + (id.cls == ELFCLASS32 ? "32" : "64") +
             "-bit library; this headroom is " + (host.cls == ELFCLASS32 ? "32" : "64") + "-bit (" +
             machine_name(host.machine) + ")" + rebuild;
    if (id.data != host.data)
      return std::string("is a ") + (id.data == ELFDATA2MSB ? "big" : "little") +
             "-endian ELF file; this machine is " + (host.data == ELFDATA2MSB ? "big" : "little") +
             "-endian" + rebuild;
    if (id.machine != host.machine)
      return "is built for " + machine_name(id.machine) + "; this headroom runs on " +
             machine_name(host.machine) + rebuild;
  }
  if (id.type == ET_REL)
    return "is an ELF object file (.o), not a shared library: link it into one (cc -shared, or "
           "headroom_add_plugin in CMake)";
  if (id.type == ET_EXEC)
    return "is an ELF executable, not a shared library: build it as one (cc -shared, or "
           "headroom_add_plugin in CMake)";
  if (id.type == ET_CORE) return "is a core dump, not a shared library";
  return "";
}

// dlopen's reason in plain words: without the file's own name in front (the message names it),
// and with what to do for the usual ones.
std::string loader_reason(const std::string& file, const char* dl_error) {
  std::string why = dl_error ? dl_error : "";
  if (why.empty()) return "dlopen failed and gave no reason";
  if (why.compare(0, file.size() + 2, file + ": ") == 0) why.erase(0, file.size() + 2);
  std::string hint;
  if (why.find("cannot open shared object file") != std::string::npos)
    hint =
        " (a library it depends on is not on the loader's path: install it, or add its "
        "folder to LD_LIBRARY_PATH; `ldd` on the plugin lists what it needs)";
  else if (why.find("undefined symbol") != std::string::npos)
    hint = " (it was built against another version of a library it links to)";
  return why + hint;
}

std::string status_name(hr_status s) {
  switch (s) {
    case HR_OK:
      return "HR_OK";
    case HR_ERROR:
      return "HR_ERROR";
    case HR_ERROR_CONFIG:
      return "HR_ERROR_CONFIG";
    case HR_ERROR_OUT_OF_MEMORY:
      return "HR_ERROR_OUT_OF_MEMORY";
    case HR_ERROR_UNSUPPORTED:
      return "HR_ERROR_UNSUPPORTED";
    case HR_ERROR_INVALID:
      return "HR_ERROR_INVALID";
    case HR_ERROR_VERSION:
      return "HR_ERROR_VERSION";
    default:
      return "status " + std::to_string(s);
  }
}

std::string join(const std::vector<std::string>& parts, const std::string& sep = ", ") {
  std::string s;
  for (const std::string& p : parts)
    s += (s.empty() ? "" : sep) + p;
  return s;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// One plugin: its library, what it declared, its instance and its services.

struct LoadedPlugin {
  PluginEntry entry;
  std::string file;
  boost::dll::shared_library library;
  uint32_t abi = 0;
  hr_plugin_descriptor desc{};
  hr_allocator_hooks allocator{};
  hr_optimizer_hooks optimizer{};

  void* instance = nullptr;
  bool created = false;
  hr_host handle;
  hr_host_services services{};
  toml::table table;            // the plugin's own keys
  std::set<std::string> asked;  // keys a config getter asked for
  std::string error;            // the last set_error message
  std::set<void*> allocations;  // what services->alloc handed out and free may take back

  std::string where() const { return entry.pos.str() + ": plugin '" + entry.name + "'"; }
  // The message the plugin handed over, or a generic one for its status.
  std::string take_error(hr_status status) {
    std::string m = error.empty() ? "it gave no message (" + status_name(status) + ")" : error;
    error.clear();
    return m;
  }
  // A hook's HR_ERROR_CONFIG as a ConfigError: the config getters' and config_error's messages
  // already start with the key's file:line; anything else is prefixed with the entry's.
  ConfigError config_error(const std::string& hook) {
    bool positioned = false;
    auto starts_with_file = [&](const SourcePos& pos) {
      positioned |= !pos.file.empty() && error.compare(0, pos.file.size(), pos.file) == 0;
    };
    starts_with_file(entry.pos);
    for (const auto& kp : entry.key_pos)
      starts_with_file(kp.second);
    const std::string m = take_error(HR_ERROR_CONFIG);
    return ConfigError(positioned ? m : where() + ": " + hook + ": " + m);
  }
};

std::string format_abi_version(uint32_t v) {
  return std::to_string(HR_ABI_MAJOR(v)) + "." + std::to_string(HR_ABI_MINOR(v));
}

std::string describe_events(uint64_t mask) {
  std::string s;
  for (int e = 0; e < kNumEvents; ++e) {
    if (!(mask & HR_EVENT_BIT(e))) continue;
    if (!s.empty()) s += ",";
    s += event_name(static_cast<Event>(e));
  }
  return s.empty() ? "-" : s;
}

std::string describe_roles(uint32_t roles) {
  std::string s;
  if (roles & HR_ROLE_ALLOCATOR) s += "allocator";
  if (roles & HR_ROLE_OPTIMIZER) s += std::string(s.empty() ? "" : ",") + "optimizer";
  return s.empty() ? "-" : s;
}

std::vector<std::string> plugin_search_path() {
  std::vector<std::string> dirs;
  if (const char* env = std::getenv("HEADROOM_PLUGIN_PATH")) {
    std::stringstream ss(env);
    std::string d;
    while (std::getline(ss, d, ':'))
      if (!d.empty()) dirs.push_back(d);
  }
  const std::string exe = exe_dir();
  if (!exe.empty()) {
    // The build tree puts plugins in lib/; an install in its libdir (lib64, lib/<multiarch>).
    for (const char* libdir : {"lib", HEADROOM_INSTALL_LIBDIR})
      dirs.push_back((fs::path(exe) / ".." / libdir / "headroom" / "plugins").string());
  }
  dirs.push_back(HEADROOM_INSTALL_PLUGIN_DIR);
  dirs.push_back(HEADROOM_BUILD_PLUGIN_DIR);
  // The same folder reached two ways is searched once.
  std::vector<std::string> unique;
  std::set<std::string> seen;
  for (const std::string& d : dirs) {
    std::error_code ec;
    const fs::path canon = fs::weakly_canonical(d, ec);
    if (seen.insert(ec ? d : canon.string()).second) unique.push_back(ec ? d : canon.string());
  }
  return unique;
}

namespace {

// Loads `file` and asks its entry point for the descriptor. Throws ConfigError prefixed by `where`
// (when not empty), naming the file and what is wrong with it.
std::unique_ptr<LoadedPlugin> load_library(const std::string& file, const std::string& where) {
  auto fail = [&](const std::string& what) {
    return ConfigError((where.empty() ? "" : where + ": ") + "'" + file + "' " + what);
  };
  auto p = std::make_unique<LoadedPlugin>();
  p->file = file;
  const std::string not_library = not_a_library(file);
  if (!not_library.empty()) throw fail(not_library);
  const std::string unsafe = unsafe_because(fs::path(file));
  if (!unsafe.empty()) throw ConfigError((where.empty() ? "" : where + ": ") + unsafe);

  std::error_code load_error;
  dlerror();  // clear any earlier message: the one read below is this load's
  p->library.load(fs::path(file),
                  boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local, load_error);
  if (load_error || !p->library.is_loaded())
    throw fail("cannot be loaded as a shared library: the system's loader (dlopen) says: " +
               loader_reason(file, dlerror()));
  if (!p->library.has(HR_PLUGIN_ENTRY_SYMBOL))
    throw fail(std::string("has no ") + HR_PLUGIN_ENTRY_SYMBOL +
               " symbol: it is a shared library but not a headroom plugin (see "
               "docs/plugin-guide.md)");
  auto& entry = p->library.get<hr_status(hr_entry_args*)>(HR_PLUGIN_ENTRY_SYMBOL);

  char message[1024] = {0};
  hr_entry_args args;
  std::memset(&args, 0, sizeof args);
  args.struct_size = sizeof args;
  args.host_abi_min = kHostAbiMin;
  args.host_abi_max = kHostAbiMax;
  args.error = message;
  args.error_size = sizeof message;
  const hr_status status = entry(&args);
  message[sizeof message - 1] = '\0';
  // The plugin's own words, when it gave any: every refusal carries them.
  const std::string says =
      message[0] ? std::string("; the plugin says: ") + message : std::string();

  const std::string host_range =
      format_abi_version(kHostAbiMin) + " to " + format_abi_version(kHostAbiMax);
  uint32_t claimed = args.plugin_abi;
  if (claimed == 0 && args.descriptor) claimed = args.descriptor->abi_version;
  if (claimed != 0 && HR_ABI_MAJOR(claimed) != HR_ABI_VERSION_MAJOR)
    throw fail("speaks plugin ABI " + format_abi_version(claimed) + "; this host speaks ABI " +
               host_range + " (a different major version is incompatible: rebuild the plugin " +
               "against this headroom's plugin.h)" + says);
  if (status == HR_ERROR_VERSION) {
    // The same major version (or none named): the plugin wants a minor this host lacks, or
    // refuses for a reason of its own.
    if (claimed > kHostAbiMax)
      throw fail("needs plugin ABI " + format_abi_version(claimed) + "; this host speaks ABI " +
                 host_range + " (use a headroom whose plugin.h is " + format_abi_version(claimed) +
                 " or newer, or a build of the plugin for ABI " + format_abi_version(kHostAbiMax) +
                 " or older)" + says);
    if (claimed != 0)
      throw fail("refused the plugin ABI versions this host speaks (" + host_range +
                 ", HR_ERROR_VERSION), though it named " + format_abi_version(claimed) +
                 ", one of them" + (says.empty() ? "; it gave no message" : says));
    throw fail("refused every plugin ABI version this host speaks (" + host_range +
               ", HR_ERROR_VERSION) and named none it would take" +
               (says.empty() ? "; it gave no message" : says));
  }
  if (status != HR_OK)
    throw fail("refused to load (" + status_name(status) +
               "): " + (message[0] ? message : "it gave no message"));
  if (!args.descriptor)
    throw fail(std::string("returned HR_OK from ") + HR_PLUGIN_ENTRY_SYMBOL +
               " without a descriptor (args->descriptor is NULL; hr_negotiate() sets it)");
  if (args.descriptor->struct_size < offsetof(hr_plugin_descriptor, optimizer) + sizeof(void*))
    throw fail("returned a descriptor of " + std::to_string(args.descriptor->struct_size) +
               " bytes (its struct_size), smaller than ABI 1.0's " +
               std::to_string(offsetof(hr_plugin_descriptor, optimizer) + sizeof(void*)));
  // A plugin built against a newer minor may answer with it; the host runs it at the newest
  // version the host speaks, which is what the services table says.
  p->abi = std::min(claimed ? claimed : args.descriptor->abi_version, kHostAbiMax);
  p->desc = read_sized(args.descriptor);
  const hr_plugin_descriptor& d = p->desc;

  // Every callback the descriptor must have, by field name.
  std::vector<std::string> missing;
  if (!d.name) missing.push_back("name");
  if (!d.version) missing.push_back("version");
  if (!d.create) missing.push_back("create");
  if (!d.destroy) missing.push_back("destroy");
  if (d.events && !d.on_event)
    missing.push_back("on_event (it subscribes to " + describe_events(d.events) + ")");
  // A role's hooks: the struct, then each function the host calls.
  auto hooks_size_ok = [&](const char* role, uint32_t size, size_t v1_0_size) {
    if (size >= v1_0_size) return true;
    missing.push_back(std::string(role) + " (its struct_size is " + std::to_string(size) +
                      ", smaller than ABI 1.0's " + std::to_string(v1_0_size) + ")");
    return false;
  };
  if (d.roles & HR_ROLE_ALLOCATOR) {
    if (!d.allocator) {
      missing.push_back("allocator (it claims the allocator role)");
    } else if (hooks_size_ok("allocator", d.allocator->struct_size,
                             offsetof(hr_allocator_hooks, deallocate) + sizeof(void*))) {
      p->allocator = read_sized(d.allocator);
      if (!p->allocator.allocate) missing.push_back("allocator->allocate");
      if (!p->allocator.deallocate) missing.push_back("allocator->deallocate");
    }
  }
  if (d.roles & HR_ROLE_OPTIMIZER) {
    if (!d.optimizer) {
      missing.push_back("optimizer (it claims the optimizer role)");
    } else if (hooks_size_ok("optimizer", d.optimizer->struct_size,
                             offsetof(hr_optimizer_hooks, step) + sizeof(void*))) {
      p->optimizer = read_sized(d.optimizer);
      if (!p->optimizer.step) missing.push_back("optimizer->step");
    }
  }
  if (!missing.empty())
    throw fail("has an incomplete descriptor" +
               (d.name ? " (plugin '" + std::string(d.name) + "')" : std::string()) + ": missing " +
               join(missing) +
               ". Required: name, version, create and destroy; on_event when events is not 0; " +
               "for each role in roles, its hooks (allocator: allocate, deallocate; " +
               "optimizer: step)");
  return p;
}

// How messages about an entry's library begin: where its path was set (the entry's position when
// it has none, or when the entry was made without one), and the plugin's name.
std::string file_where(const PluginEntry& e) {
  const SourcePos& at = e.path_pos.file.empty() ? e.pos : e.path_pos;
  return at.str() + ": plugin '" + e.name + "'";
}

// The file for a [[plugins]] entry: its path, else <name>.so on the search path.
std::string find_plugin_file(const PluginEntry& e) {
  const std::string where = file_where(e);
  if (!e.path.empty()) {
    std::error_code ec;
    if (!fs::exists(e.path, ec) && !fs::is_symlink(fs::symlink_status(e.path, ec)))
      throw ConfigError(where + ": path '" + e.path + "' does not exist");
    return e.path;  // load_library says what else may be wrong with it
  }
  const std::vector<std::string> dirs = plugin_search_path();
  for (const std::string& d : dirs) {
    const fs::path candidate = fs::path(d) / (e.name + ".so");
    std::error_code ec;
    // A broken link is found too: the message then says what it points at.
    if (fs::exists(candidate, ec) || fs::is_symlink(fs::symlink_status(candidate, ec)))
      return candidate.string();
  }
  std::string searched;
  for (const std::string& d : dirs)
    searched += "\n  " + d;
  throw ConfigError(where + ": cannot find plugin '" + e.name + "' (" + e.name +
                    ".so) in the plugin path:" + searched +
                    "\nset path = \"...\" in its [[plugins]] table, or add its folder to "
                    "HEADROOM_PLUGIN_PATH");
}

}  // namespace

std::vector<PluginInfo> discover_plugins() {
  std::vector<PluginInfo> out;
  for (const std::string& d : plugin_search_path()) {
    std::error_code ec;
    if (!fs::is_directory(d, ec)) continue;
    std::vector<fs::path> files;
    for (const auto& f : fs::directory_iterator(d, ec))
      if (f.path().extension() == ".so") files.push_back(f.path());
    std::sort(files.begin(), files.end());
    for (const fs::path& f : files) {
      PluginInfo info;
      info.file = f.string();
      try {
        auto p = load_library(info.file, "");
        info.name = p->desc.name;
        info.version = p->desc.version;
        info.description = p->desc.description ? p->desc.description : "";
        info.abi_version = p->abi;
        info.events = p->desc.events;
        info.roles = p->desc.roles;
      } catch (const ConfigError& e) {
        info.error = e.what();
      }
      out.push_back(std::move(info));
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// The services table. Every function is a C entry point: nothing may throw through it.

struct HostServices {
  static LoadedPlugin& plugin(hr_host* h) { return *h->plugin; }
  static PluginRun& run(hr_host* h) { return *h->owner->run_; }

  static void log(hr_host* h, int32_t level, const char* message) {
    static const char* names[] = {"debug", "info", "warning", "error"};
    const char* lv = level >= 0 && level <= 3 ? names[level] : "info";
    std::fprintf(stderr, "[%s] %s: %s\n", plugin(h).entry.name.c_str(), lv, message ? message : "");
  }
  static void set_error(hr_host* h, const char* message) {
    plugin(h).error = message ? message : "";
  }

  // --- the plugin's own TOML table ---
  static std::string key_where(LoadedPlugin& p, const std::string& key) {
    auto it = p.entry.key_pos.find(key);
    const std::string pos = it != p.entry.key_pos.end() ? it->second.str() : p.entry.pos.str();
    return pos + ": plugins." + p.entry.name + "." + key;
  }
  static const char* type_name(const toml::node& n) {
    switch (n.type()) {
      case toml::node_type::string:
        return "a string";
      case toml::node_type::integer:
        return "an integer";
      case toml::node_type::floating_point:
        return "a float";
      case toml::node_type::boolean:
        return "a boolean";
      case toml::node_type::table:
        return "a table";
      case toml::node_type::array:
        return "an array";
      default:
        return "a date or time";
    }
  }
  // The node for `key`, marking it asked for; nullptr when absent.
  static const toml::node* lookup(hr_host* h, const char* key) {
    if (!key) return nullptr;
    LoadedPlugin& p = plugin(h);
    p.asked.insert(key);
    return p.table.get(key);
  }
  static hr_status wrong_type(hr_host* h, const char* key, const char* want, const toml::node& n) {
    LoadedPlugin& p = plugin(h);
    p.error = key_where(p, key) + ": expected " + want + ", got " + type_name(n);
    return HR_ERROR_CONFIG;
  }
  static hr_status config_int(hr_host* h, const char* key, int64_t* out) {
    const toml::node* n = lookup(h, key);
    if (!n) return HR_OK;
    if (!n->is_integer()) return wrong_type(h, key, "an integer", *n);
    *out = n->as_integer()->get();
    return HR_OK;
  }
  static hr_status config_float(hr_host* h, const char* key, double* out) {
    const toml::node* n = lookup(h, key);
    if (!n) return HR_OK;
    if (n->is_integer()) {
      *out = static_cast<double>(n->as_integer()->get());
    } else if (n->is_floating_point()) {
      *out = n->as_floating_point()->get();
    } else {
      return wrong_type(h, key, "a number", *n);
    }
    return HR_OK;
  }
  static hr_status config_bool(hr_host* h, const char* key, int32_t* out) {
    const toml::node* n = lookup(h, key);
    if (!n) return HR_OK;
    if (!n->is_boolean()) return wrong_type(h, key, "a boolean (true or false)", *n);
    *out = n->as_boolean()->get() ? 1 : 0;
    return HR_OK;
  }
  static hr_status config_string(hr_host* h, const char* key, char* out, size_t size) {
    const toml::node* n = lookup(h, key);
    if (!n) return HR_OK;
    if (!n->is_string()) return wrong_type(h, key, "a string", *n);
    const std::string& v = n->as_string()->get();
    if (!out || v.size() + 1 > size) {
      plugin(h).error = key_where(plugin(h), key) + ": the value is " + std::to_string(v.size()) +
                        " bytes, longer than the plugin's buffer";
      return HR_ERROR_INVALID;
    }
    std::memcpy(out, v.c_str(), v.size() + 1);
    return HR_OK;
  }
  static hr_status config_size(hr_host* h, const char* key, uint64_t* out) {
    const toml::node* n = lookup(h, key);
    if (!n) return HR_OK;
    LoadedPlugin& p = plugin(h);
    if (n->is_integer() && n->as_integer()->get() >= 0) {
      *out = static_cast<uint64_t>(n->as_integer()->get());
      return HR_OK;
    }
    if (!n->is_string()) return wrong_type(h, key, "a size (\"256MiB\" or a number of bytes)", *n);
    try {
      *out = parse_size(n->as_string()->get(), key_where(p, key));
    } catch (const ConfigError& e) {
      p.error = e.what();
      return HR_ERROR_CONFIG;
    }
    return HR_OK;
  }
  static hr_status config_error(hr_host* h, const char* key, const char* message) {
    LoadedPlugin& p = plugin(h);
    p.error = (key ? key_where(p, key) : p.where()) + ": " + (message ? message : "bad value");
    return HR_ERROR_CONFIG;
  }

  // --- memory ---
  static void* alloc(hr_host* h, uint64_t bytes, uint32_t category, const char* what) {
    LoadedPlugin& p = plugin(h);
    if (category >= uint32_t(kNumCategories)) {
      p.error = "alloc: category " + std::to_string(category) + " is not an hr_mem_category";
      return nullptr;
    }
    try {
      void* ptr = run(h).device().try_allocate(bytes, category_at(int(category)),
                                               p.entry.name + ": " + (what ? what : "buffer"));
      if (!ptr) {
        p.error = "alloc: " + format_bytes(bytes) + " do not fit in device memory";
        return nullptr;
      }
      p.allocations.insert(ptr);
      return ptr;
    } catch (const PluginFailure& e) {
      // Another plugin's ALLOC hook failed inside this allocation: the run stops at the next
      // event, with that plugin's message.
      if (h->owner->pending_failure_.empty()) h->owner->pending_failure_ = e.what();
      p.error = "alloc: stopped by a failing plugin";
    } catch (const std::exception& e) {
      p.error = e.what();
    }
    return nullptr;
  }
  static void free(hr_host* h, void* ptr) {
    LoadedPlugin& p = plugin(h);
    if (!ptr) return;
    if (!p.allocations.erase(ptr)) {
      log(h, HR_LOG_ERROR, "free: a pointer services->alloc did not return; ignored");
      return;
    }
    run(h).device().free(ptr);
  }
  static void* raw_alloc(hr_host* h, uint64_t bytes) {
    return run(h).device().backend_allocate(bytes);
  }
  static void raw_free(hr_host* h, void* ptr) {
    if (ptr) run(h).device().backend_free(ptr);
  }
  static hr_status memory_stats(hr_host* h, hr_memory_stats* out) {
    if (!out) return HR_ERROR_INVALID;
    const Device& d = run(h).device();
    const MemoryTracker& t = d.tracker();
    hr_memory_stats s;
    std::memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    s.limit = d.memory_limit();
    s.live_bytes = t.live_total();
    s.peak_bytes = t.peak_total();
    for (int i = 0; i < kNumCategories; ++i) {
      s.live_by_category[i] = t.live_by_category()[i];
      s.peak_by_category[i] = t.peak_by_category()[i];
    }
    s.num_allocs = t.num_allocs();
    write_sized(out, s);
    return HR_OK;
  }

  // --- the model ---
  static Layer<float>* layer(hr_host* h, int32_t index) {
    Gpt<float>* m = run(h).built_model();
    if (!m || index < 0 || index >= int32_t(m->layers().size())) {
      plugin(h).error = "layer " + std::to_string(index) + " does not exist" +
                        (m ? " (the model has " + std::to_string(m->layers().size()) + ")"
                           : " (the model is not built yet)");
      return nullptr;
    }
    return m->layers()[index].get();
  }
  static int32_t num_layers(hr_host* h) {
    Gpt<float>* m = run(h).built_model();
    return m ? int32_t(m->layers().size()) : 0;
  }
  static hr_status layer_name(hr_host* h, int32_t index, char* out, size_t size) {
    Layer<float>* l = layer(h, index);
    if (!l) return HR_ERROR_INVALID;
    if (!out || l->name().size() + 1 > size) return HR_ERROR_INVALID;
    std::memcpy(out, l->name().c_str(), l->name().size() + 1);
    return HR_OK;
  }
  static int32_t layer_num_params(hr_host* h, int32_t index) {
    Layer<float>* l = layer(h, index);
    return l ? int32_t(l->params().size()) : 0;
  }
  // An f32 tensor view as the ABI describes it; the name and shape outlive the call.
  static hr_tensor f32_view(const std::string& name, const std::vector<int64_t>& shape,
                            uint64_t numel, void* data) {
    hr_tensor t;
    std::memset(&t, 0, sizeof t);
    t.struct_size = sizeof t;
    t.dtype = HR_DTYPE_F32;
    t.name = name.c_str();
    t.ndim = int32_t(std::min<size_t>(shape.size(), HR_MAX_DIMS));
    for (int32_t d = 0; d < t.ndim; ++d)
      t.shape[d] = shape[d];
    t.numel = numel;
    t.data = data;
    return t;
  }
  static hr_status layer_param(hr_host* h, int32_t index, int32_t i, hr_tensor* out) {
    Layer<float>* l = layer(h, index);
    if (!l || !out) return HR_ERROR_INVALID;
    if (i < 0 || i >= int32_t(l->params().size())) {
      plugin(h).error = "layer " + std::to_string(index) + " has no parameter " + std::to_string(i);
      return HR_ERROR_INVALID;
    }
    const Param<float>& p = *l->params()[i];
    hr_tensor t = f32_view(p.name, p.shape, p.numel, p.data());
    t.grad = p.gdata();
    t.weight_decay = p.decay ? 1 : 0;
    write_sized(out, t);
    return HR_OK;
  }
  static int32_t layer_num_activations(hr_host* h, int32_t index) {
    Layer<float>* l = layer(h, index);
    return l ? int32_t(l->saved().size()) : 0;
  }
  static hr_status layer_activation(hr_host* h, int32_t index, int32_t i, hr_tensor* out) {
    Layer<float>* l = layer(h, index);
    if (!l || !out) return HR_ERROR_INVALID;
    if (i < 0 || i >= int32_t(l->saved().size())) {
      plugin(h).error =
          "layer " + std::to_string(index) + " holds no activation " + std::to_string(i) + " now";
      return HR_ERROR_INVALID;
    }
    const SavedActivation& a = l->saved()[i];
    hr_tensor t = f32_view(a.what, {int64_t(a.numel)}, a.numel, a.buffer.as<void>());
    t.dtype = static_cast<uint32_t>(a.dtype);  // the compute dtype, or the statistics'
    write_sized(out, t);
    return HR_OK;
  }

  // --- device ops ---
  template <class F>
  static hr_status guarded(hr_host* h, F&& f) {
    try {
      f();
      return HR_OK;
    } catch (const OpError& e) {
      plugin(h).error = e.what();
      return HR_ERROR_UNSUPPORTED;
    } catch (const std::exception& e) {
      plugin(h).error = e.what();
      return HR_ERROR;
    }
  }
  static hr_status op_fill(hr_host* h, void* x, uint32_t dtype, uint64_t n, double value) {
    return guarded(h, [&] { run(h).device().backend().fill(Dtype(dtype), x, n, value); });
  }
  static hr_status op_copy(hr_host* h, void* dst, const void* src, uint64_t bytes) {
    return guarded(h, [&] { run(h).device().backend().copy(dst, src, bytes); });
  }
  static hr_status op_cast(hr_host* h, void* dst, uint32_t dd, const void* src, uint32_t sd,
                           uint64_t n) {
    return guarded(h, [&] { run(h).device().backend().cast(dst, Dtype(dd), src, Dtype(sd), n); });
  }
  static hr_status op_scale(hr_host* h, void* x, uint32_t dtype, uint64_t n, double s) {
    return guarded(h, [&] { run(h).device().backend().scale(Dtype(dtype), x, n, s); });
  }
  static hr_status op_axpy(hr_host* h, void* y, const void* x, uint32_t dtype, uint64_t n,
                           double a) {
    return guarded(h, [&] { run(h).device().backend().axpy(Dtype(dtype), y, x, n, a); });
  }
  static hr_status op_sum_squares(hr_host* h, const void* x, uint32_t dtype, uint64_t n,
                                  double* out) {
    if (!out) return HR_ERROR_INVALID;
    return guarded(h, [&] { *out = run(h).device().backend().sum_squares(Dtype(dtype), x, n); });
  }
  static hr_status op_nonfinite(hr_host* h, const void* x, uint32_t dtype, uint64_t n,
                                int32_t* out) {
    if (!out) return HR_ERROR_INVALID;
    return guarded(
        h, [&] { *out = run(h).device().backend().any_nonfinite(Dtype(dtype), x, n) ? 1 : 0; });
  }

  // --- device, ranks, step control ---
  static const char* device_kind(hr_host* h) { return h->owner->device_kind_.c_str(); }
  static int32_t device_index(hr_host*) { return 0; }
  static void* stream(hr_host* h) { return run(h).device().backend().native_stream(); }
  static int32_t rank(hr_host*) { return 0; }
  static int32_t world_size(hr_host*) { return 1; }
  static void veto_step(hr_host* h, const char* reason) {
    run(h).veto_step(plugin(h).entry.name, reason ? reason : "");
  }
  static void request_retry(hr_host* h, const char* reason) {
    run(h).request_retry(plugin(h).entry.name, reason ? reason : "");
  }

  // --- virtual memory (allocator role) ---
  static uint64_t vm_granularity(hr_host* h) { return run(h).device().vm_granularity(); }
  static bool vm_aligned(hr_host* h, const void* addr, uint64_t bytes) {
    const uint64_t g = run(h).device().vm_granularity();
    if (bytes % g == 0 && reinterpret_cast<uintptr_t>(addr) % g == 0) return true;
    plugin(h).error =
        "vm: address and size must be multiples of vm_granularity() = " + std::to_string(g);
    return false;
  }
  static void* vm_reserve(hr_host* h, uint64_t bytes) {
    if (!vm_aligned(h, nullptr, bytes)) return nullptr;
    return run(h).device().vm_reserve(bytes);
  }
  static hr_status vm_map(hr_host* h, void* addr, uint64_t bytes) {
    if (!addr || !vm_aligned(h, addr, bytes)) return HR_ERROR_INVALID;
    return run(h).device().vm_map(addr, bytes) ? HR_OK : HR_ERROR_OUT_OF_MEMORY;
  }
  static hr_status vm_unmap(hr_host* h, void* addr, uint64_t bytes) {
    if (!addr || !vm_aligned(h, addr, bytes)) return HR_ERROR_INVALID;
    run(h).device().vm_unmap(addr, bytes);
    return HR_OK;
  }
  static hr_status vm_release(hr_host* h, void* addr, uint64_t bytes) {
    if (!addr || !vm_aligned(h, addr, bytes)) return HR_ERROR_INVALID;
    run(h).device().vm_release(addr, bytes);
    return HR_OK;
  }

  // --- precision (ABI 1.4) ---
  static hr_status set_compute_dtype(hr_host* h, uint32_t dtype) {
    LoadedPlugin& p = plugin(h);
    try {
      if (dtype > HR_DTYPE_I32)
        throw std::invalid_argument("unknown dtype " + std::to_string(dtype));
      run(h).set_compute_dtype(p.entry.name, Dtype(dtype));
      return HR_OK;
    } catch (const std::exception& e) {
      p.error = std::string("set_compute_dtype: ") + e.what();
      return HR_ERROR_INVALID;
    }
  }
  static hr_status set_loss_scale(hr_host* h, double scale) {
    LoadedPlugin& p = plugin(h);
    try {
      run(h).set_loss_scale(p.entry.name, scale);
      return HR_OK;
    } catch (const std::exception& e) {
      p.error = std::string("set_loss_scale: ") + e.what();
      return HR_ERROR_INVALID;
    }
  }

  // --- activation recomputation (ABI 1.3) ---
  static hr_status drop_activations(hr_host* h, int32_t index, uint32_t what) {
    LoadedPlugin& p = plugin(h);
    const PluginHost& owner = *h->owner;
    if (what != HR_DROP_ALL && what != HR_DROP_CHEAP) {
      p.error = "drop_activations(" + std::to_string(index) + ", " + std::to_string(what) +
                "): what must be HR_DROP_ALL (0) or HR_DROP_CHEAP (1)";
      return HR_ERROR_INVALID;
    }
    if (owner.current_event_ != int(Event::kForwardEnd) || owner.current_layer_ != index) {
      p.error = "drop_activations(" + std::to_string(index) +
                "): only from FORWARD_END of that layer" +
                (owner.current_event_ >= 0
                     ? std::string(" (called from ") + event_name(Event(owner.current_event_)) +
                           (owner.current_layer_ >= 0
                                ? " of layer " + std::to_string(owner.current_layer_)
                                : std::string()) +
                           ")"
                     : std::string(" (called outside any event)"));
      return HR_ERROR_INVALID;
    }
    Gpt<float>* m = run(h).built_model();
    if (!m) {
      p.error = "drop_activations: the model is not built yet";
      return HR_ERROR_INVALID;
    }
    try {
      m->drop_activations(index, what == HR_DROP_CHEAP ? Drop::kCheap : Drop::kAll);
      return HR_OK;
    } catch (const std::exception& e) {
      p.error = std::string("drop_activations: ") + e.what();
      return HR_ERROR_INVALID;
    }
  }

  static hr_host_services table(LoadedPlugin& p) {
    hr_host_services s;
    std::memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    s.abi_version = p.abi;
    s.host = &p.handle;
    s.log = log;
    s.set_error = set_error;
    s.config_int = config_int;
    s.config_float = config_float;
    s.config_bool = config_bool;
    s.config_string = config_string;
    s.config_size = config_size;
    s.config_error = config_error;
    s.alloc = alloc;
    s.free = free;
    s.raw_alloc = raw_alloc;
    s.raw_free = raw_free;
    s.memory_stats = memory_stats;
    s.num_layers = num_layers;
    s.layer_name = layer_name;
    s.layer_num_params = layer_num_params;
    s.layer_param = layer_param;
    s.layer_num_activations = layer_num_activations;
    s.layer_activation = layer_activation;
    s.op_fill = op_fill;
    s.op_copy = op_copy;
    s.op_cast = op_cast;
    s.op_scale = op_scale;
    s.op_axpy = op_axpy;
    s.op_sum_squares = op_sum_squares;
    s.op_nonfinite = op_nonfinite;
    s.device_kind = device_kind;
    s.device_index = device_index;
    s.stream = stream;
    s.rank = rank;
    s.world_size = world_size;
    s.veto_step = veto_step;
    s.request_retry = request_retry;
    s.vm_granularity = vm_granularity;
    s.vm_reserve = vm_reserve;
    s.vm_map = vm_map;
    s.vm_unmap = vm_unmap;
    s.vm_release = vm_release;
    s.drop_activations = drop_activations;
    s.set_compute_dtype = set_compute_dtype;
    s.set_loss_scale = set_loss_scale;
    return s;
  }
};

// ---------------------------------------------------------------------------------------------
// Roles

class PluginHost::AllocatorAdapter final : public DeviceAllocator {
 public:
  explicit AllocatorAdapter(LoadedPlugin& p) : p_(p) {}
  void* allocate(uint64_t bytes, Category category, void* stream) override {
    return p_.allocator.allocate(p_.instance, bytes, uint32_t(category), stream);
  }
  void deallocate(void* ptr, uint64_t bytes, void* stream) override {
    p_.allocator.deallocate(p_.instance, ptr, bytes, stream);
  }
  bool stats(AllocatorStats* out) const override {
    // A plugin built before ABI 1.2 has no stats hook: read_sized left it NULL.
    if (!p_.allocator.stats) return false;
    hr_allocator_stats s;
    std::memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    if (p_.allocator.stats(p_.instance, &s) != HR_OK) return false;
    out->allocated = s.allocated;
    out->reserved = s.reserved;
    out->largest_free_block = s.largest_free_block;
    out->device_allocs = s.device_allocs;
    out->retries = s.retries;
    out->ooms = s.ooms;
    return true;
  }

 private:
  LoadedPlugin& p_;
};

namespace {

class PluginOptimizer final : public Optimizer {
 public:
  explicit PluginOptimizer(LoadedPlugin& p) : p_(p) {}
  // The plugin keeps its state itself and saves it through save_state.
  std::vector<StateTensor> state(const std::vector<Param<float>*>&) override { return {}; }
  void step(const std::vector<Param<float>*>&, double lr, int64_t step) override {
    hr_optimizer_step_info info;
    std::memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    info.step = step;
    info.lr = lr;
    const hr_status s = p_.optimizer.step(p_.instance, &info);
    if (s != HR_OK)
      throw PluginFailure("plugin '" + p_.entry.name + "' failed in its optimizer step (step " +
                          std::to_string(step) + "): " + p_.take_error(s));
  }

 private:
  LoadedPlugin& p_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// PluginHost

PluginHost::PluginHost(const Config& config) : device_kind_(config.device.kind) {
  std::map<uint32_t, const LoadedPlugin*> role_owner;
  for (const PluginEntry& e : config.plugins) {
    const std::string where = e.pos.str() + ": plugin '" + e.name + "'";
    auto p = load_library(find_plugin_file(e), file_where(e));
    p->entry = e;
    if (e.name != p->desc.name)
      throw ConfigError(file_where(e) + ": '" + p->file + "' is the plugin '" + p->desc.name +
                        "' (its descriptor's name), not '" + e.name + "': set name = \"" +
                        p->desc.name + "\" in this [[plugins]] table, or point path at " + e.name +
                        "'s library");
    for (uint32_t role : {HR_ROLE_ALLOCATOR, HR_ROLE_OPTIMIZER}) {
      if (!(p->desc.roles & role)) continue;
      auto [it, first] = role_owner.emplace(role, p.get());
      if (!first)
        throw ConfigError(where + ": both '" + it->second->entry.name + "' (" +
                          it->second->entry.pos.str() + ") and '" + e.name + "' provide the " +
                          describe_roles(role) +
                          " role; at most one plugin may — remove one of them");
    }
    try {
      p->table = toml::parse(e.toml);
    } catch (const toml::parse_error& err) {
      throw ConfigError(where + ": cannot read its table back: " + std::string(err.description()));
    }
    plugins_.push_back(std::move(p));
  }
}

PluginHost::~PluginHost() {
  // Every plugin but the allocator, last listed first; then the allocator, which may still hold
  // the memory of everything destroyed before it.
  LoadedPlugin* alloc_plugin = nullptr;
  for (auto it = plugins_.rbegin(); it != plugins_.rend(); ++it) {
    LoadedPlugin& p = **it;
    if (!p.created) continue;
    if (p.desc.roles & HR_ROLE_ALLOCATOR) {
      alloc_plugin = &p;
      continue;
    }
    p.desc.destroy(p.instance);
    p.created = false;
  }
  if (alloc_plugin) {
    if (run_ && run_->device().tracker().live_total() == 0) run_->device().set_allocator(nullptr);
    alloc_plugin->desc.destroy(alloc_plugin->instance);
    alloc_plugin->created = false;
  }
  plugins_.clear();  // unloads the libraries, after every instance is gone
}

void PluginHost::create(PluginRun& run) {
  run_ = &run;
  std::vector<LoadedPlugin*> order;
  for (auto& p : plugins_)
    if (p->desc.roles & HR_ROLE_ALLOCATOR) order.push_back(p.get());
  for (auto& p : plugins_)
    if (!(p->desc.roles & HR_ROLE_ALLOCATOR)) order.push_back(p.get());

  for (LoadedPlugin* p : order) {
    p->handle.owner = this;
    p->handle.plugin = p;
    p->services = HostServices::table(*p);
    void* instance = nullptr;
    const hr_status s = p->desc.create(&p->services, &instance);
    if (s == HR_ERROR_CONFIG) throw p->config_error("create");
    if (s != HR_OK)
      throw PluginFailure(p->where() + " failed to start (create): " + p->take_error(s));
    p->instance = instance;
    p->created = true;
    // Every key of its table must have been asked for: anything else is a typo or a key of a
    // different version of the plugin.
    for (auto&& [key, node] : p->table) {
      const std::string k(key.str());
      if (p->asked.count(k)) continue;
      std::string valid;
      for (const std::string& a : p->asked)
        valid += (valid.empty() ? "" : ", ") + a;
      throw ConfigError(
          HostServices::key_where(*p, k) + ": unknown key '" + k + "' for plugin '" +
          p->entry.name + "'; " +
          (valid.empty() ? std::string("this plugin reads no keys") : "valid keys: " + valid));
    }
    if (p->desc.roles & HR_ROLE_ALLOCATOR) {
      allocator_ = std::make_unique<AllocatorAdapter>(*p);
      run.device().set_allocator(allocator_.get());
    }
  }
}

bool PluginHost::allocator_stats(hr_allocator_stats* out) const {
  for (const auto& p : plugins_) {
    if (!(p->desc.roles & HR_ROLE_ALLOCATOR) || !p->created || !p->allocator.stats) continue;
    std::memset(out, 0, sizeof *out);
    out->struct_size = sizeof *out;
    return p->allocator.stats(p->instance, out) == HR_OK;
  }
  return false;
}

bool PluginHost::provides_optimizer() const {
  for (const auto& p : plugins_)
    if (p->desc.roles & HR_ROLE_OPTIMIZER) return true;
  return false;
}

std::unique_ptr<Optimizer> PluginHost::make_optimizer() {
  for (auto& p : plugins_)
    if (p->desc.roles & HR_ROLE_OPTIMIZER) return std::make_unique<PluginOptimizer>(*p);
  return nullptr;
}

void PluginHost::on_event(const EventInfo& e) {
  if (!pending_failure_.empty() && e.event != Event::kFree) {
    const std::string m = std::move(pending_failure_);
    pending_failure_.clear();
    throw PluginFailure(m);
  }
  hr_event_info info;
  std::memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  info.event = uint32_t(e.event);
  info.step = e.step;
  info.micro_step = e.micro_step;
  info.layer = e.layer;
  info.ptr = e.ptr;
  info.bytes = e.bytes;
  info.category = uint32_t(e.category);
  // Which event the plugins are in, for services that only some events may call; an event fired
  // inside another (an ALLOC inside a FORWARD_END hook) restores the outer one when done.
  struct CurrentEvent {
    PluginHost& host;
    int event, layer;
    CurrentEvent(PluginHost& h, int e, int l)
        : host(h), event(h.current_event_), layer(h.current_layer_) {
      host.current_event_ = e;
      host.current_layer_ = l;
    }
    ~CurrentEvent() {
      host.current_event_ = event;
      host.current_layer_ = layer;
    }
  } current(*this, int(e.event), e.layer);
  for (auto& p : plugins_) {
    if (!p->created || !(p->desc.events & HR_EVENT_BIT(info.event))) continue;
    const hr_status s = p->desc.on_event(p->instance, &info);
    if (s == HR_OK) continue;
    std::string m = "plugin '" + p->entry.name + "' failed in " + event_name(e.event);
    if (e.layer >= 0) m += " (layer " + std::to_string(e.layer) + ")";
    if (e.step > 0) m += " at step " + std::to_string(e.step);
    m += ": " + p->take_error(s);
    if (e.event == Event::kFree) {
      if (pending_failure_.empty()) pending_failure_ = m;
      continue;
    }
    throw PluginFailure(m);
  }
}

std::map<std::string, std::vector<uint8_t>> PluginHost::save_states() {
  std::map<std::string, std::vector<uint8_t>> out;
  for (auto& p : plugins_) {
    if (!p->created || !p->desc.save_state) continue;
    std::vector<uint8_t> bytes;
    hr_state_writer w;
    std::memset(&w, 0, sizeof w);
    w.struct_size = sizeof w;
    w.context = &bytes;
    w.write = [](void* context, const void* data, uint64_t size) -> hr_status {
      if (size && !data) return HR_ERROR_INVALID;
      auto* v = static_cast<std::vector<uint8_t>*>(context);
      const uint8_t* b = static_cast<const uint8_t*>(data);
      v->insert(v->end(), b, b + size);
      return HR_OK;
    };
    const hr_status s = p->desc.save_state(p->instance, &w);
    if (s != HR_OK)
      throw PluginFailure("plugin '" + p->entry.name +
                          "' failed to save its state: " + p->take_error(s));
    out[p->entry.name] = std::move(bytes);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Checking a config's plugins without a run

namespace {

// The run validate_plugins creates the plugins against: a device, no model, and the trainer's
// rules for the compute dtype and the loss scale (Trainer::set_compute_dtype, set_loss_scale),
// which a plugin's create() may call.
class ValidationRun final : public PluginRun {
 public:
  explicit ValidationRun(Device& device) : device_(device) {}
  Device& device() override { return device_; }
  Gpt<float>* built_model() override { return nullptr; }
  void veto_step(const std::string&, const std::string&) override {}
  void request_retry(const std::string&, const std::string&) override {}
  void set_compute_dtype(const std::string& plugin, Dtype dtype) override {
    if (dtype != Dtype::kF32 && dtype != Dtype::kBF16 && dtype != Dtype::kF16)
      throw std::invalid_argument(plugin + ": compute dtype " + dtype_name(dtype) +
                                  " is not one of f32, bf16, f16");
    if (dtype_ != Dtype::kF32 && dtype_ != dtype)
      throw std::logic_error(plugin + ": the compute dtype is already " + dtype_name(dtype_) +
                             " (set by " + dtype_by_ + "); two plugins cannot both choose it");
    dtype_ = dtype;
    dtype_by_ = plugin;
  }
  void set_loss_scale(const std::string& plugin, double scale) override {
    if (!(scale > 0) || !std::isfinite(scale))
      throw std::invalid_argument(plugin + ": loss scale " + std::to_string(scale) +
                                  " must be finite and > 0");
  }

 private:
  Device& device_;
  Dtype dtype_ = Dtype::kF32;
  std::string dtype_by_;
};

}  // namespace

CreatedPlugins::CreatedPlugins(const Config& config) {
  DeviceConfig cpu;
  cpu.kind = "cpu";
  if (config.device.kind == "cpu") cpu.memory_limit = config.device.memory_limit;
  device_ = Device::create(cpu);
  run_ = std::make_unique<ValidationRun>(*device_);
  host_ = std::make_unique<PluginHost>(config);
  host_->create(*run_);
}

CreatedPlugins::~CreatedPlugins() = default;

void validate_plugins(const Config& config) {
  if (config.plugins.empty()) return;
  CreatedPlugins created(config);
}

std::vector<OfferedExtension> PluginHost::offered(const char* id) const {
  std::vector<OfferedExtension> out;
  for (const auto& p : plugins_) {
    if (!p->created || !p->desc.get_extension) continue;
    if (const void* table = p->desc.get_extension(id))
      out.push_back(OfferedExtension{p->entry.name, table, p->instance});
  }
  return out;
}

PluginCatalog::PluginCatalog() {
  std::set<std::string> seen;
  for (const std::string& d : plugin_search_path()) {
    std::error_code ec;
    if (!fs::is_directory(d, ec)) continue;
    std::vector<fs::path> files;
    for (const auto& f : fs::directory_iterator(d, ec))
      if (f.path().extension() == ".so") files.push_back(f.path());
    std::sort(files.begin(), files.end());
    for (const fs::path& f : files) {
      try {
        auto p = load_library(f.string(), "");
        if (!seen.insert(p->desc.name).second) continue;  // a later copy of one found before
        p->entry.name = p->desc.name;
        plugins_.push_back(std::move(p));
      } catch (const ConfigError&) {
        // Not loadable: `headroom plugins` says why; the catalog has nothing from it.
      }
    }
  }
}

PluginCatalog::~PluginCatalog() = default;

std::vector<std::string> PluginCatalog::names() const {
  std::vector<std::string> out;
  for (const auto& p : plugins_)
    out.push_back(p->entry.name);
  return out;
}

std::vector<OfferedExtension> PluginCatalog::offered(const char* id) const {
  std::vector<OfferedExtension> out;
  for (const auto& p : plugins_) {
    if (!p->desc.get_extension) continue;
    if (const void* table = p->desc.get_extension(id))
      out.push_back(OfferedExtension{p->entry.name, table, nullptr});
  }
  return out;
}

void PluginHost::load_states(const std::map<std::string, std::vector<uint8_t>>& states,
                             const std::string& snapshot) {
  const std::string from = snapshot.empty() ? "the snapshot" : "the snapshot " + snapshot;
  for (const auto& [name, bytes] : states) {
    LoadedPlugin* p = nullptr;
    for (auto& q : plugins_)
      if (q->entry.name == name) p = q.get();
    if (!p)
      throw ConfigError("--resume: " + from + " holds the state of plugin '" + name +
                        "', which this config does not load; add it to [[plugins]]");
    if (!p->desc.load_state)
      throw ConfigError(p->where() + ": --resume: " + from + " holds its state, but '" + p->file +
                        "' cannot load state (its descriptor has no load_state)");
    const hr_status s = p->desc.load_state(p->instance, bytes.data(), bytes.size());
    if (s == HR_OK) continue;
    const std::string what = "--resume: loading its state (" + std::to_string(bytes.size()) +
                             " bytes) from " + from + " failed, load_state returned " +
                             status_name(s) + ": " +
                             (p->error.empty() ? "it gave no message" : p->error);
    p->error.clear();
    if (s == HR_ERROR_CONFIG) throw ConfigError(p->where() + ": " + what);
    throw PluginFailure(p->where() + ": " + what);
  }
}

}  // namespace headroom
