#pragma once
// The loss kinds lossverify knows: the built-in ones (cross_entropy, kd) and any registered at run time.
// Every kind-dependent step asks the case's kind (`loss_kind(c)`) through the interface in loss_kind.hpp.
#include <memory>
#include <string_view>
#include <vector>

#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/kind_api/stage.hpp"

namespace lossverify {

// nullptr when no kind has that name.
const LossKind* find_loss_kind(std::string_view name);
// Every kind, built-in ones first, in registration order.
std::vector<const LossKind*> loss_kinds();
// A kind added by a program or a test; throws InternalError when its name is taken. Kinds live for the
// process. Register before any case is parsed.
void register_loss_kind(std::unique_ptr<LossKind> kind);

const LossKind& default_loss_kind();  // cross_entropy, a case's kind when "loss.kind" is absent

// The stages (kind_api/stage.hpp): none is built in yet; a program or a test registers one.
const Stage* find_stage(std::string_view name);
std::vector<const Stage*> stages();
void register_stage(std::unique_ptr<Stage> stage);

}  // namespace lossverify
