#pragma once
// A stage in front of a loss kind (docs/development.md, "Stages"): each rank's logits come out of the stage, and the
// kind's gradient of them goes back through it into gradients of the stage's own inputs, which ranks report and the
// oracle judges beside the kind's checks, one check per gradient. The LM head (h, W -> logits; g -> dh, dW) is one;
// tests/kinds/pass_through/ is the least one. A case names its stage in a "stage" section ({"kind": NAME});
// stages run on the CPU backend and the host oracle (CUDA, plugins and dumps refuse a case with one, exit 2).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "lossverify/core/dtype.hpp"
#include "lossverify/kind_api/settings.hpp"
#include "lossverify/layout/vocab_range.hpp"

namespace lossverify {

struct Case;
struct Implementation;
struct BugSwitches;
struct RankAssignment;
class InputSource;

// The float64 reference of the stage, from its definition: each gradient's expected row of a token from the
// reference's gradient of the logits over the rank's columns [begin, begin + logit_grad.size()).
class StageReference {
 public:
  virtual ~StageReference() = default;
  virtual void input_gradient(std::size_t which, std::int64_t token, std::int64_t begin,
                              std::span<const double> logit_grad, std::span<double> out) const = 0;
};

// One rank's stage work on the CPU backend, over all of its rows: `logits` (rows x columns.size(), the dtype's
// elements) are what the kind will read; `logit_grad` (same shape) is what the kind wrote, and `gradients[w]` the
// stage's gradient `w` to fill (rows x gradient_columns, in the dtype), once the kind is done.
struct StageRank {
  const Case& c;
  const BugSwitches& bugs;
  const RankAssignment& assignment;
  DType dtype = DType::fp32;
  VocabRange columns;
  std::byte* logits = nullptr;
  const std::byte* logit_grad = nullptr;
  std::vector<std::vector<std::byte>>& gradients;
};

class Stage {
 public:
  virtual ~Stage() = default;
  virtual std::string_view name() const = 0;
  virtual std::string_view summary() const = 0;
  // Its keys of the case's "stage" section (kind_api/settings.hpp, bound to LossSpec::stage_options); none by default.
  virtual const SettingTable& settings() const;
  // Cross-field checks of the whole case, after every section is read (exit 2 naming the field).
  virtual void validate(const Case& c) const { (void)c; }
  // The gradients of its inputs that ranks report, each judged as a check of that name ("dh"), and a row's width
  // of each on a rank.
  virtual std::vector<std::string> gradients() const = 0;
  virtual std::int64_t gradient_columns(std::size_t which, const Case& c, const RankAssignment& assignment) const = 0;
  // Before the kind's micro-batches: the rank's logits from the stage's inputs (in place: the rank's generated
  // rows are the stage's input). After them: the stage's gradients from the kind's.
  virtual void cpu_forward(const StageRank& rank) const = 0;
  virtual void cpu_backward(const StageRank& rank) const = 0;
  virtual std::unique_ptr<StageReference> reference(const Case& c, const InputSource& inputs) const = 0;
  // The catalogued bugs of the stage's own arithmetic (their `applies` names the stage; their switches are
  // BugSwitches::stage_switches).
  virtual std::vector<Implementation> catalogue() const;
};

}  // namespace lossverify
