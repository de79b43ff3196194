#include "core/run/rank_agreement.h"

#include <algorithm>
#include <cstdint>
#include <set>
#include <sstream>

namespace headroom {

namespace {

// What may differ between ranks (rank_agreement.h says why).
const std::set<std::string>& per_rank_keys() {
  static const std::set<std::string> keys = {"device.index", "device.threads", "data.workers",
                                             "data.prefetch"};
  return keys;
}

uint64_t fnv1a(uint64_t h, const std::string& s) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}
constexpr uint64_t kFnvBasis = 0xcbf29ce484222325ull;

uint64_t item_hash(const AgreementItem& item) {
  return fnv1a(fnv1a(kFnvBasis, item.first) ^ 0x9e3779b97f4a7c15ull, item.second);
}

// The digest of the first n items.
uint64_t prefix_digest(const std::vector<AgreementItem>& items, size_t n) {
  uint64_t h = kFnvBasis ^ n;
  for (size_t i = 0; i < n && i < items.size(); ++i)
    h = fnv1a(h ^ item_hash(items[i]), "\n");
  return h;
}

bool all_equal(const std::vector<uint64_t>& v) {
  return std::all_of(v.begin(), v.end(), [&](uint64_t x) { return x == v[0]; });
}

// Every rank's `text` (up to 256 bytes), through 64-bit all-gathers.
std::vector<std::string> all_gather_text(Communicator& comm, std::string text) {
  constexpr size_t kMax = 256;
  if (text.size() > kMax) text = text.substr(0, kMax - 3) + "...";
  uint64_t chunks = (text.size() + 7) / 8;
  comm.all_max_host(&chunks, 1);
  std::vector<std::string> out(size_t(comm.world_size()));
  for (uint64_t c = 0; c < chunks; ++c) {
    uint64_t word = 0;
    for (size_t b = 0; b < 8; ++b) {
      const size_t at = size_t(c) * 8 + b;
      if (at < text.size()) word |= uint64_t(uint8_t(text[at])) << (8 * b);
    }
    const std::vector<uint64_t> words = comm.all_gather_host(word);
    for (size_t r = 0; r < words.size(); ++r)
      for (size_t b = 0; b < 8; ++b) {
        const char ch = char((words[r] >> (8 * b)) & 0xff);
        if (ch) out[r] += ch;
      }
  }
  return out;
}

}  // namespace

std::vector<AgreementItem> agreement_items(const Config& config,
                                           const std::vector<AgreementItem>& flags) {
  // The flags first: a config with more keys (another plugin) then differs at its first extra key.
  std::vector<AgreementItem> items = flags;
  std::istringstream in(format_config(config));
  std::string line, section;
  // A [[plugins]] table's keys, named once its name is known: "plugins.amp.dtype".
  std::vector<AgreementItem> table;
  std::string table_name;
  bool in_plugins = false;
  auto close_table = [&] {
    if (!in_plugins) return;
    for (const AgreementItem& k : table)
      items.push_back({"plugins." + table_name + "." + k.first, k.second});
    table.clear();
    table_name.clear();
  };
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    if (line == "[[plugins]]") {
      close_table();
      in_plugins = true;
      continue;
    }
    if (line.front() == '[') {
      close_table();
      in_plugins = false;
      section = line.substr(1, line.find(']') - 1);
      continue;
    }
    const size_t eq = line.find(" = ");
    if (eq == std::string::npos) continue;
    const std::string key = line.substr(0, eq), value = line.substr(eq + 3);
    if (in_plugins) {
      if (key == "name") table_name = value.size() >= 2 ? value.substr(1, value.size() - 2) : value;
      table.push_back({key, value});
      continue;
    }
    const std::string full = section + "." + key;
    if (!per_rank_keys().count(full)) items.push_back({full, value});
  }
  close_table();
  return items;
}

void check_ranks_agree(const std::vector<AgreementItem>& items, Communicator& comm) {
  const int world = comm.world_size();
  if (world <= 1) return;
  if (all_equal(comm.all_gather_host(prefix_digest(items, items.size()) ^ items.size()))) return;
  // The first item that differs: the longest prefix every rank has alike, by bisection (the
  // ranks may hold different numbers of items: the longest count bounds it).
  uint64_t most = items.size();
  comm.all_max_host(&most, 1);
  size_t lo = 0, hi = size_t(most);  // prefixes of lo items agree; of hi they do not
  while (hi - lo > 1) {
    const size_t mid = lo + (hi - lo) / 2;
    if (all_equal(comm.all_gather_host(prefix_digest(items, mid) ^ mid)))
      lo = mid;
    else
      hi = mid;
  }
  // Item `lo` (0-based) is the first that differs; each rank's key and value of it.
  const bool has = lo < items.size();
  const std::vector<std::string> keys = all_gather_text(comm, has ? items[lo].first : "");
  const std::vector<std::string> values = all_gather_text(comm, has ? items[lo].second : "");
  const std::string key = !keys[0].empty() ? keys[0] : keys[size_t(comm.rank())];
  auto has_str = [&](int r) {
    const size_t i = size_t(r);
    if (keys[i].empty()) return "rank " + std::to_string(r) + " has no such key";
    if (keys[i] != key) return "rank " + std::to_string(r) + " has " + keys[i] + " = " + values[i];
    return "rank " + std::to_string(r) + " has " + values[i];
  };
  std::string differ, who;
  for (int r = 1; r < world; ++r)
    if (keys[size_t(r)] != keys[0] || values[size_t(r)] != values[0]) {
      who += (who.empty() ? "rank " : ", ") + std::to_string(r);
      differ += ", " + has_str(r);
    }
  throw ConfigError("the ranks disagree: " + who +
                    " resolved another run than rank 0's: the first " + "key that differs is " +
                    key + ": " + has_str(0) + differ +
                    " (every rank must run the same config and flags; only device.index, "
                    "device.threads, data.workers and data.prefetch may differ)");
}

}  // namespace headroom
