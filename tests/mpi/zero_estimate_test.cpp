// The estimate of a run across ranks (`headroom plan`, the out-of-memory advice) against every
// rank's own tracker, run on every rank under mpirun (-np 2 and -np 3, tests/mpi/CMakeLists.txt):
// the zero plugins' headroom.estimate/1 (plugins/zero/estimate.cpp) chained with amp and
// checkpoint, core's closed form of a rank's bytes. Exact by category at the peak, on each rank,
// on GPT-2 and on a Llama.
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <vector>

#include "core/comm/comm.h"
#include "core/plugin_host/plugin_host.h"
#include "core/report/advice.h"
#include "core/run/trainer.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

// tests/mpi/zero_test.sh's model, micro_batch 2: the embedding has 380 elements, each block 1330
// and the head 20, so at 3 ranks every layer is padded (to 381, 1332, 21) and the last rank's
// ranges hold the padding: its optimizer state is smaller than rank 0's.
const char* kModel =
    "[model]\nn_layer = 2\nn_head = 2\nn_embd = 10\nseq_len = 7\nvocab_size = 31\n"
    "[train]\nsteps = 2\nmicro_batch = 2\noptimizer = \"adamw\"\nlr = 0.01\nseed = 5\n"
    "[data]\nkind = \"synthetic\"\nworkers = 0\n";
// A Llama (GQA: 4 heads over 2 KV heads, SwiGLU, RMSNorm, an untied head) of zero_test.sh's llama
// part: at 3 ranks the embedding's and the head's 496 elements are padded to 498.
const char* kLlama =
    "[model]\narch = \"llama\"\nn_layer = 2\nn_head = 4\nn_kv_head = 2\nn_embd = 16\n"
    "intermediate_size = 20\nseq_len = 7\nvocab_size = 31\ntie_embeddings = false\n"
    "[train]\nsteps = 2\nmicro_batch = 2\noptimizer = \"adamw\"\nlr = 0.01\nseed = 5\n"
    "[data]\nkind = \"synthetic\"\nworkers = 0\n";
// The same with a vocabulary that makes the untied head the largest layer, so that the peak is in
// the head's backward: zero3 gathers the lm_head there, not the embedding (which only a tied head
// reads; the closed form counted it on 2026-12-05 for untied heads too).
const char* kLlamaWideVocab =
    "[model]\narch = \"llama\"\nn_layer = 2\nn_head = 4\nn_kv_head = 2\nn_embd = 16\n"
    "intermediate_size = 20\nseq_len = 7\nvocab_size = 509\ntie_embeddings = false\n"
    "[train]\nsteps = 2\nmicro_batch = 2\noptimizer = \"adamw\"\nlr = 0.01\nseed = 5\n"
    "[data]\nkind = \"synthetic\"\nworkers = 0\n";

// kModel with its embedding and first block frozen ([train] freeze): zero3 shards their weights
// with the layers (the embedding has nothing else), and zero1/zero2 replicate them, padded.
const char* kFrozen =
    "[model]\nn_layer = 2\nn_head = 2\nn_embd = 10\nseq_len = 7\nvocab_size = 31\n"
    "[train]\nsteps = 2\nmicro_batch = 2\noptimizer = \"adamw\"\nlr = 0.01\nseed = 5\n"
    "freeze = [\"wte.weight\", \"wpe.weight\", \"h.0.*\"]\n"
    "[data]\nkind = \"synthetic\"\nworkers = 0\n";
// LoRA adapters on c_attn and c_fc over a frozen base, stored as `base` (bf16 with amp: the
// compute copy; int8, nf4: quantized bytes, 300 and 400 elements a weight, partial blocks).
#define LORA(base)                                                                              \
  "[[plugins]]\nname = \"lora\"\nr = 2\ntarget_modules = [\"c_attn\", \"c_fc\"]\nbase_dtype = " \
  "\"" base "\"\n"

struct Case {
  const char* name;
  const char* plugins;
  const char* grad_accum;
  const char* model = kModel;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

class ZeroEstimate : public ::testing::TestWithParam<Case> {};

TEST_P(ZeroEstimate, IsEachRanksTrackerPeakByCategory) {
  ASSERT_TRUE(rank_info().launched) << "run me under mpirun";
  const Config c = test::config_from(std::string(GetParam().model) + GetParam().plugins,
                                     {std::string("train.grad_accum=") + GetParam().grad_accum});
  Trainer t(c, TrainOptions{});
  t.run();
  const MemoryTracker& mt = t.device().tracker();
  const ConfigEstimate e = estimate_config(c);
  for (const PluginEstimate& pe : e.plugins)
    EXPECT_TRUE(pe.ok()) << pe.plugin << " status " << pe.status;
  const std::string who = "rank " + std::to_string(rank_info().rank) + " of " +
                          std::to_string(rank_info().world_size) + ": " + format_estimate(e);
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(e.peak.at_peak[i], mt.live_at_peak()[i]) << category_name(category_at(i)) << "\n"
                                                       << who;
  EXPECT_EQ(e.peak.total(), mt.peak_total()) << who;
  // The host ledger too (offload: the optimizer, the layers' outputs, the parameter shards).
  const ByCategory host = t.device().host_place()->tracker().live_at_peak();
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(e.peak.host[i], host[i]) << "host " << category_name(category_at(i)) << "\n" << who;
}

INSTANTIATE_TEST_SUITE_P(
    Plugins, ZeroEstimate,
    ::testing::Values(
        Case{"DataParallel", "", "1"},  // no plugin: core's buckets, one fp32 copy of the gradients
        Case{"Zero1", "[[plugins]]\nname = \"zero1\"\n", "1"},
        Case{"Zero2", "[[plugins]]\nname = \"zero2\"\n", "1"},
        Case{"Zero2Accumulating", "[[plugins]]\nname = \"zero2\"\n", "2"},
        Case{"Zero2LastMicroStep",
             "[[plugins]]\nname = \"zero2\"\nreduce_every_micro_step = false\n", "2"},
        Case{"Zero2NoOverlap", "[[plugins]]\nname = \"zero2\"\noverlap_comm = false\n", "1"},
        Case{"Zero1AmpBf16", "[[plugins]]\nname = \"zero1\"\n[[plugins]]\nname = \"amp\"\n", "1"},
        Case{"Zero2AmpBf16", "[[plugins]]\nname = \"zero2\"\n[[plugins]]\nname = \"amp\"\n", "1"},
        Case{"AmpFp16Zero2",
             "[[plugins]]\nname = \"amp\"\ndtype = \"fp16\"\n[[plugins]]\nname = \"zero2\"\n", "1"},
        Case{"Zero2CheckpointEvery",
             "[[plugins]]\nname = \"zero2\"\n[[plugins]]\nname = \"checkpoint\"\n", "1"},
        Case{"Zero3", "[[plugins]]\nname = \"zero3\"\nparam_persistence_threshold = 100\n", "1"},
        Case{"Zero3EveryLayerPrefetch0",
             "[[plugins]]\nname = \"zero3\"\nparam_persistence_threshold = 0\n"
             "prefetch_layers = 0\n",
             "1"},
        Case{"Zero3Prefetch2Accumulating",
             "[[plugins]]\nname = \"zero3\"\nparam_persistence_threshold = 100\n"
             "prefetch_layers = 2\n",
             "2"},
        Case{"Zero3AmpBf16",
             "[[plugins]]\nname = \"zero3\"\nparam_persistence_threshold = 100\n"
             "[[plugins]]\nname = \"amp\"\n",
             "1"},
        Case{"Zero3CheckpointEvery",
             "[[plugins]]\nname = \"zero3\"\nparam_persistence_threshold = 100\n"
             "[[plugins]]\nname = \"checkpoint\"\n",
             "1"},
        Case{"CheckpointEveryAmpZero1",
             "[[plugins]]\nname = \"checkpoint\"\n[[plugins]]\nname = \"amp\"\n"
             "[[plugins]]\nname = \"zero1\"\n",
             "1"},
        Case{"FrozenZero2", "[[plugins]]\nname = \"zero2\"\n", "1", kFrozen},
        Case{"FrozenZero3", "[[plugins]]\nname = \"zero3\"\nparam_persistence_threshold = 100\n",
             "1", kFrozen},
        Case{"FrozenZero3AmpCheckpointPrefetch0",
             "[[plugins]]\nname = \"amp\"\n[[plugins]]\nname = \"checkpoint\"\n"
             "[[plugins]]\nname = \"zero3\"\nparam_persistence_threshold = 0\n"
             "prefetch_layers = 0\n",
             "1", kFrozen},
        Case{"LoraBf16AmpZero2",
             LORA("bf16") "[[plugins]]\nname = \"amp\"\n"
                          "[[plugins]]\nname = \"zero2\"\n",
             "1"},
        Case{"LoraNf4AmpZero3",
             LORA("nf4") "double_quant = true\n[[plugins]]\nname = \"amp\"\n"
                         "[[plugins]]\nname = \"zero3\"\n"
                         "param_persistence_threshold = 100\n",
             "1"},
        Case{"LoraInt8Zero3EveryLayerAccumulating",
             LORA("int8") "[[plugins]]\nname = \"zero3\"\nparam_persistence_threshold = 0\n", "2"},
        Case{"LoraNf4Zero3Prefetch2Checkpoint",
             LORA("nf4") "[[plugins]]\nname = \"checkpoint\"\n[[plugins]]\nname = \"zero3\"\n"
                         "param_persistence_threshold = 100\nprefetch_layers = 2\n",
             "1"},
        Case{"Zero3AmpCheckpointActivationsOnTheHostAccumulating",
             "[[plugins]]\nname = \"zero3\"\nparam_persistence_threshold = 100\n"
             "[[plugins]]\nname = \"amp\"\n[[plugins]]\nname = \"checkpoint\"\n"
             "[[plugins]]\nname = \"offload\"\noptimizer = \"none\"\nactivations = true\n",
             "2"},
        Case{"Zero2ActivationsAndOptimizerOnTheHost",
             "[[plugins]]\nname = \"zero2\"\n[[plugins]]\nname = \"offload\"\n"
             "optimizer = \"host\"\nactivations = true\n",
             "1"},
        Case{"Zero3ParametersOnTheHost",
             "[[plugins]]\nname = \"zero3\"\nparam_persistence_threshold = 100\n"
             "[[plugins]]\nname = \"offload\"\nparameters = \"host\"\n",
             "1"},
        Case{"AmpCheckpointZero3EveryLayerParametersOnTheHostAccumulating",
             "[[plugins]]\nname = \"amp\"\n[[plugins]]\nname = \"checkpoint\"\n"
             "[[plugins]]\nname = \"zero3\"\nparam_persistence_threshold = 0\n"
             "[[plugins]]\nname = \"offload\"\nparameters = \"host\"\nactivations = true\n",
             "2"},
        Case{"LoraNf4AmpZero3ParametersOnTheHost",
             LORA("nf4") "double_quant = true\n[[plugins]]\nname = \"amp\"\n"
                         "[[plugins]]\nname = \"offload\"\nparameters = \"host\"\n"
                         "[[plugins]]\nname = \"zero3\"\nparam_persistence_threshold = 100\n",
             "1"},
        Case{"LlamaZero3Prefetch2ParametersOnTheHost",
             "[[plugins]]\nname = \"amp\"\n[[plugins]]\nname = \"zero3\"\n"
             "param_persistence_threshold = 100\nprefetch_layers = 2\n"
             "[[plugins]]\nname = \"offload\"\nparameters = \"host\"\n",
             "1", kLlama},
        Case{"LlamaDataParallel", "", "1", kLlama},
        Case{"LlamaZero1", "[[plugins]]\nname = \"zero1\"\n", "1", kLlama},
        Case{"LlamaZero2Accumulating", "[[plugins]]\nname = \"zero2\"\n", "2", kLlama},
        Case{"LlamaZero3", "[[plugins]]\nname = \"zero3\"\nparam_persistence_threshold = 100\n",
             "1", kLlama},
        Case{"LlamaZero3EveryLayerAmpBf16",
             "[[plugins]]\nname = \"zero3\"\nparam_persistence_threshold = 0\n"
             "[[plugins]]\nname = \"amp\"\n",
             "1", kLlama},
        Case{"LlamaZero3WideUntiedHeadAmpCheckpoint",
             "[[plugins]]\nname = \"amp\"\n[[plugins]]\nname = \"checkpoint\"\n"
             "[[plugins]]\nname = \"zero3\"\nparam_persistence_threshold = 100\n",
             "1", kLlamaWideVocab},
        Case{"LlamaLoraNf4AmpZero3",
             "[[plugins]]\nname = \"lora\"\nr = 2\ntarget_modules = [\"all-linear\"]\n"
             "base_dtype = \"nf4\"\n[[plugins]]\nname = \"amp\"\n[[plugins]]\nname = \"zero3\"\n"
             "param_persistence_threshold = 100\n",
             "1", kLlama},
        Case{"LlamaZero2CheckpointSqrtAmpFp16",
             "[[plugins]]\nname = \"zero2\"\n[[plugins]]\nname = \"checkpoint\"\n"
             "policy = \"sqrt\"\n[[plugins]]\nname = \"amp\"\ndtype = \"fp16\"\n",
             "1", kLlama}),
    [](const auto& info) { return std::string(info.param.name); });

// Out of memory on every rank of a data-parallel run whose state would fit sharded: zero2 is
// proposed on the run's own ranks (no launch line), at the peak its estimate gives there.
TEST(ZeroAdvice, OnTheRunsRanks) {
  ASSERT_TRUE(rank_info().launched) << "run me under mpirun";
  const uint64_t limit =
      estimate_config(test::config_from(std::string(kModel) + "[[plugins]]\nname = \"zero2\"\n"))
          .peak.total();
  const Config c = test::config_from(kModel, {"device.memory_limit=" + std::to_string(limit)});
  std::vector<OfferedExtension> installed;
  const PluginCatalog catalog;
  for (const OfferedExtension& e : catalog.offered(HR_EXT_ESTIMATE))
    if (e.plugin == "zero2") installed.push_back(e);
  const Advice a = advise(c, installed);
  ASSERT_FALSE(a.fits);
  EXPECT_EQ(a.world_size, rank_info().world_size);
  const Remedy* r = nullptr;
  for (const Remedy& x : a.remedies)
    if (x.plugins == std::vector<std::string>{"zero2"}) r = &x;
  ASSERT_NE(r, nullptr) << format_remedies(a);
  EXPECT_EQ(r->ranks, 0);
  EXPECT_EQ(r->peak_after, limit);
  EXPECT_EQ(r->what, "zero2: ZeRO stage 2 on " + std::to_string(rank_info().world_size) +
                         " ranks: gradients and optimizer state sharded");
  EXPECT_EQ(format_remedies(a).find("mpirun"), std::string::npos) << format_remedies(a);
}

}  // namespace
}  // namespace headroom
