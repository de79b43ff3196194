// Test helper for tests/mpi/train_test.sh: compares what two runs wrote. Exit 0 when they agree,
// 1 with a message when they do not, 2 for bad input.
//
//   compare losses A.jsonl B.jsonl REL   every step's loss within REL relative (same steps)
//   compare weights A B INIT TOL         safetensors A and B: max |A - B| <= TOL * max |B - INIT|
//                                        over every F32 tensor (INIT: the weights before training,
//                                        so the bound is relative to the size of the update)
//   compare within A B C D               max |A - B| <= 2 * max |C - D| (> 0): A is no farther
//                                        from B than two references C, D are from each other
//   compare bytes SAFETENSORS            prints the sum of its tensors' elements (the parameter
//                                        count, times 4: the gradient buckets' closed form)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/model/safetensors.h"

namespace {

std::vector<uint8_t> slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
}

std::map<std::string, std::vector<float>> tensors(const std::string& path) {
  const std::vector<uint8_t> bytes = slurp(path);
  const auto entries =
      headroom::parse_safetensors_header(bytes.data(), bytes.size(), bytes.size(), path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  const uint8_t* data = bytes.data() + 8 + n;
  std::map<std::string, std::vector<float>> out;
  for (const auto& e : entries) {
    if (e.dtype != "F32") throw std::runtime_error(path + ": " + e.name + " is not F32");
    std::vector<float> v((e.end - e.begin) / 4);
    std::memcpy(v.data(), data + e.begin, e.end - e.begin);
    out[e.name] = std::move(v);
  }
  return out;
}

std::vector<std::pair<int64_t, double>> losses(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::vector<std::pair<int64_t, double>> v;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    v.push_back({j.at("step").get<int64_t>(), j.at("loss").get<double>()});
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string what = argc > 1 ? argv[1] : "";
    if (what == "losses" && argc == 5) {
      const auto a = losses(argv[2]), b = losses(argv[3]);
      const double tol = std::stod(argv[4]);
      if (a.size() != b.size() || a.empty()) {
        std::printf("different step counts: %zu and %zu\n", a.size(), b.size());
        return 1;
      }
      double worst = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        if (a[i].first != b[i].first) {
          std::printf("row %zu: step %lld against %lld\n", i, (long long)a[i].first,
                      (long long)b[i].first);
          return 1;
        }
        const double rel = std::fabs(a[i].second - b[i].second) / std::fabs(b[i].second);
        if (!(rel <= tol)) {
          std::printf("step %lld: loss %.17g against %.17g (relative %.3g > %g)\n",
                      (long long)a[i].first, a[i].second, b[i].second, rel, tol);
          return 1;
        }
        worst = std::max(worst, rel);
      }
      std::printf("%zu steps, losses within %.3g relative\n", a.size(), worst);
      return 0;
    }
    if (what == "weights" && argc == 6) {
      const auto a = tensors(argv[2]), b = tensors(argv[3]), init = tensors(argv[4]);
      const double tol = std::stod(argv[5]);
      double diff = 0, update = 0;
      for (const auto& [name, vb] : b) {
        const auto ia = a.find(name), ii = init.find(name);
        if (ia == a.end() || ii == init.end() || ia->second.size() != vb.size() ||
            ii->second.size() != vb.size()) {
          std::printf("tensor %s differs in presence or size\n", name.c_str());
          return 1;
        }
        for (size_t k = 0; k < vb.size(); ++k) {
          diff = std::max(diff, double(std::fabs(ia->second[k] - vb[k])));
          update = std::max(update, double(std::fabs(vb[k] - ii->second[k])));
        }
      }
      if (a.size() != b.size() || !(update > 0)) {
        std::printf("tensor counts %zu, %zu; largest update %g\n", a.size(), b.size(), update);
        return 1;
      }
      std::printf("weights: max difference %.3g, largest update %.3g (ratio %.3g, bound %g)\n",
                  diff, update, diff / update, tol);
      return diff <= tol * update ? 0 : 1;
    }
    if (what == "within" && argc == 6) {
      auto maxdiff = [](const std::string& x, const std::string& y) {
        const auto a = tensors(x), b = tensors(y);
        if (a.size() != b.size()) throw std::runtime_error(x + " and " + y + " differ in tensors");
        double d = 0;
        for (const auto& [name, vb] : b) {
          const auto& va = a.at(name);
          if (va.size() != vb.size()) throw std::runtime_error(name + " differs in size");
          for (size_t k = 0; k < vb.size(); ++k)
            d = std::max(d, double(std::fabs(va[k] - vb[k])));
        }
        return d;
      };
      const double d = maxdiff(argv[2], argv[3]), ref = maxdiff(argv[4], argv[5]);
      std::printf("weights: max difference %.3g; the references differ by %.3g\n", d, ref);
      return ref > 0 && d <= 2 * ref ? 0 : 1;
    }
    if (what == "bytes" && argc == 3) {
      uint64_t n = 0;
      for (const auto& [name, v] : tensors(argv[2]))
        n += v.size();
      std::printf("%llu\n", (unsigned long long)(n * 4));
      return 0;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "compare: %s\n", e.what());
    return 2;
  }
  std::fprintf(stderr, "usage: compare losses A B REL | weights A B INIT TOL | bytes FILE\n");
  return 2;
}
