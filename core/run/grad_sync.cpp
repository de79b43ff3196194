#include "core/run/grad_sync.h"

namespace headroom {

namespace {

class LocalGradSync final : public GradSync {
 public:
  LocalGradSync(Backend& ops, const std::vector<OptSegment>& segments)
      : ops_(ops), segments_(segments) {}
  double grad_sum_squares() override { return headroom::grad_sum_squares(ops_, segments_); }

 private:
  Backend& ops_;
  const std::vector<OptSegment>& segments_;
};

class BucketGradSync final : public GradSync {
 public:
  BucketGradSync(Device& device, Communicator& comm, const Gpt<float>& model, uint64_t bucket_size,
                 const std::vector<OptSegment>& segments);
  void abandon() override {
    for (Bucket& b : buckets_)
      b.request = CommRequest();
  }

  std::optional<BucketEvent> launch_next(int layer) override;
  void progress() override {
    for (size_t i : launch_order_)
      buckets_[i].request.test();
  }
  std::optional<BucketEvent> finish_next() override;
  double grad_sum_squares() override {
    return headroom::grad_sum_squares(device_.backend(), segments_);
  }
  std::vector<uint64_t> bucket_bytes() const override {
    std::vector<uint64_t> v;
    for (const Bucket& b : buckets_)
      v.push_back(b.bytes);
    return v;
  }

 private:
  struct Bucket {
    Buffer buffer;  // Category::kCommunication
    uint64_t bytes = 0;
    int lowest_layer = 0;
    std::vector<Param<float>*> params;  // in buffer order
    CommRequest request;
    bool launched = false;
  };
  Device& device_;
  Communicator& comm_;
  const std::vector<OptSegment>& segments_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> launch_order_;  // this step's launches, in order
  size_t finished_ = 0;               // of launch_order_, waited for
};

BucketGradSync::BucketGradSync(Device& device, Communicator& comm, const Gpt<float>& model,
                               uint64_t bucket_size, const std::vector<OptSegment>& segments)
    : device_(device), comm_(comm), segments_(segments) {
  const auto& layers = model.layers();
  Bucket cur;
  auto close = [&] {
    if (cur.params.empty()) return;
    buckets_.push_back(std::move(cur));
    cur = Bucket{};
  };
  // Last layer first: the order backward finishes them. A layer's parameters are written only by
  // its own backward, except wte, which the head also writes and which the embedding (layer 0)
  // owns: its gradient is final at layer 0's BACKWARD_END, where its bucket launches.
  for (int l = int(layers.size()) - 1; l >= 0; --l) {
    const auto& ps = layers[size_t(l)]->params();
    for (auto it = ps.rbegin(); it != ps.rend(); ++it) {
      Param<float>* p = it->get();
      if (p->frozen) continue;  // no gradient: every rank holds the same weights
      cur.params.push_back(p);
      cur.bytes += p->numel * sizeof(float);
      cur.lowest_layer = l;
      if (cur.bytes >= bucket_size) close();
    }
  }
  close();
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& b = buckets_[i];
    b.buffer = Buffer(device_, b.bytes, Category::kCommunication,
                      "gradient bucket " + std::to_string(i) + " (layers " +
                          std::to_string(b.lowest_layer) + "..)");
  }
}

std::optional<BucketEvent> BucketGradSync::launch_next(int layer) {
  Backend& ops = device_.backend();
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& b = buckets_[i];
    if (b.launched || (layer >= 0 && b.lowest_layer != layer)) continue;
    char* at = b.buffer.as<char>();
    for (Param<float>* p : b.params) {
      ops.copy(at, p->master().grad, p->numel * sizeof(float));
      at += p->numel * sizeof(float);
    }
    b.request = comm_.all_reduce(b.buffer.as<void>(), b.bytes / sizeof(float), Dtype::kF32,
                                 ReduceOp::kAverage);
    b.launched = true;
    launch_order_.push_back(i);
    return BucketEvent{b.lowest_layer, b.bytes};
  }
  return std::nullopt;
}

std::optional<BucketEvent> BucketGradSync::finish_next() {
  if (finished_ == launch_order_.size()) {
    launch_order_.clear();
    finished_ = 0;
    return std::nullopt;
  }
  Bucket& b = buckets_[launch_order_[finished_++]];
  b.request.wait();
  Backend& ops = device_.backend();
  const char* at = b.buffer.as<const char>();
  for (Param<float>* p : b.params) {
    ops.copy(p->master().grad, at, p->numel * sizeof(float));
    at += p->numel * sizeof(float);
  }
  b.launched = false;
  return BucketEvent{b.lowest_layer, b.bytes};
}

class ShardedGradSync final : public GradSync {
 public:
  ShardedGradSync(Sharding& sharding, std::string plugin)
      : sharding_(sharding), plugin_(std::move(plugin)) {}
  void begin_step() override { sharding_.begin_step(); }
  void begin_micro_step(int micro, int micro_steps) override {
    sharding_.begin_micro_step(micro, micro_steps);
  }
  void require_parameters(int layer, int tied, const char* pass) override {
    sharding_.require_parameters(layer, tied, pass, plugin_);
  }
  void backward_ending(int layer) override { sharding_.backward_done(layer); }
  void end_micro_step() override { sharding_.wait(); }
  void check_reduced() const override { sharding_.check_reduced(plugin_); }
  // Each rank holds its ranges of the gradients, so their squares are summed over the ranks.
  double grad_sum_squares() override { return sharding_.grad_sum_squares(); }
  bool gradients_shared() const override { return true; }
  // Each rank updated its ranges: the plugin gathers them.
  void updated(Gpt<float>&, const std::vector<bool>&) override { sharding_.updated(); }
  void end_step() override {
    sharding_.wait();
    sharding_.check_step_end(plugin_);
  }

 private:
  Sharding& sharding_;
  std::string plugin_;
};

}  // namespace

std::unique_ptr<GradSync> make_local_grad_sync(Backend& ops,
                                               const std::vector<OptSegment>& segments) {
  return std::make_unique<LocalGradSync>(ops, segments);
}

std::unique_ptr<GradSync> make_bucket_grad_sync(Device& device, Communicator& comm,
                                                const Gpt<float>& model, uint64_t bucket_size,
                                                const std::vector<OptSegment>& segments) {
  return std::make_unique<BucketGradSync>(device, comm, model, bucket_size, segments);
}

std::unique_ptr<GradSync> make_sharded_grad_sync(Sharding& sharding, const std::string& plugin) {
  return std::make_unique<ShardedGradSync>(sharding, plugin);
}

}  // namespace headroom
