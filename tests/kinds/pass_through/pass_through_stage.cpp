// The pass-through stage: forward leaves the rank's logits as they are, backward copies the kind's gradient into dh
// (twice over under its bug), and the reference's dh is the kind's reference gradient.
#include "pass_through_stage.hpp"

#include <algorithm>
#include <cstring>
#include <mutex>

#include "lossverify/case/case.hpp"
#include "lossverify/core/dtype.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/kind_api/registry.hpp"
#include "lossverify/outputs/rank_output.hpp"

namespace lossverify::testing {

namespace {

constexpr std::uint64_t kTwiceBit = 1;

class PassThroughReference final : public StageReference {
 public:
  void input_gradient(std::size_t, std::int64_t, VocabRange rank, std::span<const double> row_grad,
                      std::span<const double>, std::span<double> out, std::span<double>) const override {
    std::copy_n(row_grad.begin() + rank.begin, rank.size(), out.begin());
  }
};

class PassThroughStage final : public Stage {
 public:
  std::string_view name() const override { return kPassThrough; }
  std::string_view summary() const override { return "logits = h, dh = dL/dlogits (a test stage)"; }
  std::vector<std::string> gradients() const override { return {"dh"}; }
  std::int64_t gradient_columns(std::size_t, const Case&, const RankAssignment& assignment) const override {
    return assignment.vocab.size();
  }
  void cpu_forward(const StageRank&) const override {}  // the rank's logits are h
  void cpu_backward(const StageRank& rank) const override {
    std::vector<std::byte>& dh = rank.gradients.front();
    std::memcpy(dh.data(), rank.logit_grad, dh.size());
    if ((rank.bugs.stage_switches & kTwiceBit) == 0) return;
    dispatch_dtype(rank.dtype, [&](auto type) {
      using T = typename decltype(type)::type;
      T* values = reinterpret_cast<T*>(dh.data());
      for (std::size_t i = 0; i < dh.size() / sizeof(T); ++i) values[i] = T(2.0f * static_cast<float>(values[i]));
    });
  }
  std::unique_ptr<StageReference> reference(const Case&, const InputSource&) const override {
    return std::make_unique<PassThroughReference>();
  }
  std::vector<Implementation> catalogue() const override {
    return {catalogued_bug(kPassThroughTwice, "dh accumulated twice: 2 dL/dlogits", "tests/kinds",
                           "dh x 2; the kind's own gradient is right", {"dh"}, Applies::stage(kPassThrough),
                           switches_with([](BugSwitches& b) { b.stage_switches = kTwiceBit; }))};
  }
};

}  // namespace

void register_pass_through() {
  static std::once_flag once;
  std::call_once(once, [] { register_stage(std::make_unique<PassThroughStage>()); });
}

}  // namespace lossverify::testing
