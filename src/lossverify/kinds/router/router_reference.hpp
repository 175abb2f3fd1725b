#pragma once
// The router's float64 reference (router_reference.cpp) as a GPU oracle builds it (router_oracle.cpp): its routing
// taken from the oracle's float64 pass over the step on the device instead of the host's own, and the terms of the
// rows the oracle judges given back, so that nothing of the step is read on the host.
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/kinds/router/router_definitions.hpp"

namespace lossverify::router {

// A valid token's routing in one layer, from the definitions (router::top_k or router::routed_top_k).
using RoutingSource = std::function<TopK(std::int64_t token, std::size_t layer)>;

// What the oracle evaluates a row with, and gives back.
class DeviceTerms {
 public:
  virtual ~DeviceTerms() = default;
  // Every aux term's weights per sequence scope and layer, [scopes x layers x E] (a c + a_s c_s / S + a_g c^G); with
  // `ties`, those of the counts the scopes' tie tokens may move (MOE.md section 3).
  virtual std::vector<double> weight_table(bool ties) const = 0;
  // The token's sequence scope (its row of the table); -1 where it is no valid token.
  virtual std::int64_t weight_slot(std::int64_t token) const = 0;
  // alpha_z / T of the token's micro-batch scope.
  virtual double z_weight(std::int64_t token) const = 0;
  virtual bool any_ties() const = 0;
  // The token's terms per layer, [aux, z, tie bound] x layers: <w, s_t>, alpha_z / T lse^2 and <tw, s_t>.
  virtual void set_terms(std::int64_t token, std::span<const double> terms) = 0;
};

struct RoutedReference {
  std::unique_ptr<KindReference> reference;
  DeviceTerms* terms;  // the same object
};
RoutedReference make_routed_reference(const Case& c, const InputSource& inputs, RoutingSource routing);

}  // namespace lossverify::router
