// The loader: finding a plugin's library (the search path, a [[plugins]] entry's path), checking
// it before dlopen (its permissions, that it is a shared library for this machine), loading it,
// negotiating the ABI and reading its descriptor; `headroom plugins`' discovery.
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <sstream>

#include "core/plugin_host/plugin_internal.h"
#include "headroom/ext/reads.h"
#include "headroom/ext/roles.h"
#include "headroom/ext/state.h"

namespace headroom {

namespace fs = std::filesystem;

namespace {

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

}  // namespace

std::string format_abi_version(uint32_t v) {
  return std::to_string(HR_ABI_MAJOR(v)) + "." + std::to_string(HR_ABI_MINOR(v));
}

// The ABI version that brought each event. A plugin receives only the events of the version it
// negotiated: a bit of its descriptor's events for a newer one is dropped when it loads.
namespace {
constexpr struct {
  int event;
  uint32_t since;
} kEventSince[] = {
    {HR_EVENT_BUCKET_LAUNCH, HR_ABI_MAKE_VERSION(1, 5)},
    {HR_EVENT_BUCKET_DONE, HR_ABI_MAKE_VERSION(1, 5)},
    {HR_EVENT_EVAL_END, HR_ABI_MAKE_VERSION(1, 6)},
};
static_assert(sizeof kEventSince / sizeof kEventSince[0] == kNumEvents - HR_EVENT_COUNT_V1,
              "every event after ABI 1.0's needs its version here");
}  // namespace

uint64_t events_of_abi(uint32_t abi) {
  uint64_t mask = HR_EVENT_BIT(HR_EVENT_COUNT_V1) - 1;  // ABI 1.0's
  for (const auto& e : kEventSince)
    if (abi >= e.since) mask |= HR_EVENT_BIT(e.event);
  return mask;
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
  if (roles & HR_ROLE_GRADIENT_REDUCTION)
    s += std::string(s.empty() ? "" : ",") + "gradient_reduction";
  return s.empty() ? "-" : s;
}

namespace {

// Whether `path` is `folder` or below it, both made canonical.
bool inside(const fs::path& path, const fs::path& folder) {
  std::error_code ec1, ec2;
  const fs::path p = fs::weakly_canonical(path, ec1), f = fs::weakly_canonical(folder, ec2);
  if (ec1 || ec2) return false;
  auto pi = p.begin();
  for (auto fi = f.begin(); fi != f.end(); ++fi, ++pi) {
    if (fi->empty() && std::next(fi) == f.end()) break;  // a trailing separator
    if (pi == p.end() || *pi != *fi) return false;
  }
  return true;
}

}  // namespace

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
  // The build tree's plugins only for the build tree's own executables (the host, the tests): an
  // installed headroom has its own copies, and would list every plugin twice.
  if (!exe.empty() && inside(fs::path(exe), fs::path(HEADROOM_BUILD_DIR)))
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
  p->desc.events &= events_of_abi(p->abi);  // none newer than the version it speaks
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
  // A role's hooks and the state: the descriptor's fields, else what a 1.5 plugin offers under
  // the extension's id (a descriptor from before 1.5 has no get_extension: read_sized left it
  // NULL).
  auto offered = [&](const char* id) { return d.get_extension ? d.get_extension(id) : nullptr; };
  const auto* allocator_hooks =
      d.allocator ? d.allocator : static_cast<const hr_allocator_hooks*>(offered(HR_EXT_ALLOCATOR));
  const auto* optimizer_hooks =
      d.optimizer ? d.optimizer : static_cast<const hr_optimizer_hooks*>(offered(HR_EXT_OPTIMIZER));
  if (d.roles & HR_ROLE_ALLOCATOR) {
    if (!allocator_hooks) {
      missing.push_back(
          "allocator (it claims the allocator role; neither descriptor->allocator nor "
          "get_extension(\"" HR_EXT_ALLOCATOR "\") gives its hooks)");
    } else if (hooks_size_ok("allocator", allocator_hooks->struct_size,
                             offsetof(hr_allocator_hooks, deallocate) + sizeof(void*))) {
      p->allocator = read_sized(allocator_hooks);
      if (!p->allocator.allocate) missing.push_back("allocator->allocate");
      if (!p->allocator.deallocate) missing.push_back("allocator->deallocate");
    }
  }
  if (d.roles & HR_ROLE_OPTIMIZER) {
    if (!optimizer_hooks) {
      missing.push_back(
          "optimizer (it claims the optimizer role; neither descriptor->optimizer nor "
          "get_extension(\"" HR_EXT_OPTIMIZER "\") gives its hooks)");
    } else if (hooks_size_ok("optimizer", optimizer_hooks->struct_size,
                             offsetof(hr_optimizer_hooks, step) + sizeof(void*))) {
      p->optimizer = read_sized(optimizer_hooks);
      if (!p->optimizer.step) missing.push_back("optimizer->step");
    }
  }
  if (d.save_state || d.load_state) {
    p->save_state = d.save_state;
    p->load_state = d.load_state;
  } else if (const void* table = offered(HR_EXT_STATE)) {
    const hr_ext_state* state = static_cast<const hr_ext_state*>(table);
    if (state->struct_size < offsetof(hr_ext_state, load) + sizeof(void*)) {
      missing.push_back("the " HR_EXT_STATE " table's save and load (its struct_size is " +
                        std::to_string(state->struct_size) + ")");
    } else {
      const hr_ext_state st = read_sized(state);
      p->save_state = st.save;
      p->load_state = st.load;
    }
  }
  // What its hooks read (headroom.reads/1); a plugin that declares nothing reads the gradients at
  // every event it subscribes to.
  p->gradient_events = d.events;
  if (const void* table = offered(HR_EXT_READS)) {
    const hr_ext_reads* reads = static_cast<const hr_ext_reads*>(table);
    if (reads->struct_size < offsetof(hr_ext_reads, gradients) + sizeof(uint64_t))
      missing.push_back("the " HR_EXT_READS " table's gradients (its struct_size is " +
                        std::to_string(reads->struct_size) + ")");
    else
      p->gradient_events = read_sized(reads).gradients & d.events;
  }
  if (!missing.empty())
    throw fail("has an incomplete descriptor" +
               (d.name ? " (plugin '" + std::string(d.name) + "')" : std::string()) + ": missing " +
               join(missing) +
               ". Required: name, version, create and destroy; on_event when events is not 0; " +
               "for each role in roles, its hooks (allocator: allocate, deallocate; " +
               "optimizer: step), in the descriptor or as the role's extension");
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

std::vector<std::string> plugin_files_on_search_path() {
  std::vector<std::string> out;
  for (const std::string& d : plugin_search_path()) {
    std::error_code ec;
    if (!fs::is_directory(d, ec)) continue;
    std::vector<std::string> files;
    for (const auto& f : fs::directory_iterator(d, ec))
      if (f.path().extension() == ".so") files.push_back(f.path().string());
    std::sort(files.begin(), files.end());
    out.insert(out.end(), files.begin(), files.end());
  }
  return out;
}

std::vector<PluginInfo> discover_plugins() {
  std::vector<PluginInfo> out;
  for (const std::string& file : plugin_files_on_search_path()) {
    PluginInfo info;
    info.file = file;
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
  return out;
}

}  // namespace headroom
