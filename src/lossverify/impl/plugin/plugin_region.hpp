#pragma once
// The memory lossverify shares with a plugin host for one rank's call (host_protocol.hpp, RegionLayout): the
// rank's inputs, its outputs between guard pages with the run's canary before each, and the staging area
// of its all-reduces. An anonymous memory file: it travels to the host as a descriptor and dies with both.
#include <cstddef>
#include <cstdint>
#include <string>

#include "lossverify/impl/plugin/host_protocol.hpp"

namespace lossverify {

struct RegionSizes {
  std::size_t params_bytes = 1;    // with its NUL
  std::size_t settings_bytes = 1;  // the settings block (settings_block.hpp), with its NUL
  std::int64_t micro_batches = 1;
  std::size_t logits_bytes = 0;
  std::size_t teacher_bytes = 0;  // KD: the teacher's logits
  std::int64_t rows = 0;
  std::size_t grad_bytes = 0;
  std::size_t token_values = 0;  // per row: the kind's per-row values (the kind's token_quantities())
  std::size_t scope_values = 0;  // the kind's values of all micro-batch scopes (LossKind::scope_values_width x ga)
  // The LM head stage's inputs and outputs (host_protocol.hpp; 0 without a head)
  std::size_t hidden_bytes = 0, head_weight_bytes = 0, head_bias_bytes = 0;
  std::int64_t head_dh_rows = 0;
  std::size_t head_dh_bytes = 0, head_dw_bytes = 0, head_db_bytes = 0;
  std::size_t staging_bytes = std::size_t{4} << 20;
};

// Offsets of every array; the outputs end at page ends, each between two guard pages.
plugin_host::RegionLayout region_layout(const RegionSizes& sizes);

class SharedRegion {
 public:
  // Creates and maps the region, and writes the canary before each output.
  SharedRegion(const plugin_host::RegionLayout& layout, const std::uint8_t* canary);
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  std::byte* at(std::uint64_t offset) const { return data_ + offset; }
  int fd() const { return fd_; }
  // Whether the canary before an output is as written ("" when it is, else which output's was touched).
  std::string touched_canary() const;
  // What a fault at `offset` of the region means: "" when it is not one of the guard pages.
  std::string guard_hit(std::uint64_t offset) const;

 private:
  plugin_host::RegionLayout layout_;
  std::uint8_t canary_[plugin_host::kCanaryBytes];
  std::byte* data_ = nullptr;
  int fd_ = -1;
};

}  // namespace lossverify
