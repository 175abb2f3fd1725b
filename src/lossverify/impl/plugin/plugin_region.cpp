#include "lossverify/impl/plugin/plugin_region.hpp"

#include <fcntl.h>

#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>

#include "lossverify/core/errors.hpp"

namespace lossverify {

namespace {

std::uint64_t aligned(std::uint64_t offset, std::uint64_t to) { return (offset + to - 1) / to * to; }

// The bytes between the guard page before an output and the output's first byte.
std::uint64_t slack_begin(std::uint64_t guard_before, std::uint64_t page) { return guard_before + page; }

// Each output with the guard page before it and its name in messages, in the order of RegionLayout::guard_pages.
struct GuardedOutput {
  std::uint64_t guard, output;
  const char* name;
};
std::array<GuardedOutput, plugin_host::kOutputs> guarded_outputs(const plugin_host::RegionLayout& l) {
  return {{{l.guard_pages[0], l.grad, "gradient buffer (outputs->grad)"},
           {l.guard_pages[2], l.token_loss, "per-row loss buffer (outputs->token_loss)"},
           {l.guard_pages[4], l.token_values, "per-row value buffer (outputs->token_values)"},
           {l.guard_pages[6], l.scope_values, "scope value buffer (outputs->scope_values)"},
           {l.guard_pages[8], l.head_dh, "head dh buffer (outputs->head_dh)"},
           {l.guard_pages[10], l.head_dw, "head dW buffer (outputs->head_dw)"},
           {l.guard_pages[12], l.head_db, "head db buffer (outputs->head_db)"}}};
}

}  // namespace

plugin_host::RegionLayout region_layout(const RegionSizes& s) {
  plugin_host::RegionLayout l;
  const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  const auto rows = static_cast<std::uint64_t>(s.rows);
  l.page_bytes = page;
  std::uint64_t at = 0;
  const auto take = [&](std::uint64_t bytes) {
    const std::uint64_t offset = aligned(at, 64);
    at = offset + bytes;
    return offset;
  };
  l.crash = take(sizeof(plugin_host::CrashRecord));
  l.params_bytes = s.params_bytes;
  l.params = take(s.params_bytes);
  l.settings_bytes = s.settings_bytes;
  l.settings = take(s.settings_bytes);
  l.micro_batch_begin = take(static_cast<std::uint64_t>(s.micro_batches + 1) * 8);
  l.logits_bytes = s.logits_bytes;
  l.logits = take(s.logits_bytes);
  l.teacher_bytes = s.teacher_bytes;
  l.teacher = take(s.teacher_bytes);
  l.labels = take(rows * 8);
  l.loss_mask = take(rows);
  l.upstream = take(rows * 8);
  l.tokens = take(rows * 8);
  l.sequences = take(rows * 8);
  l.token_inputs = take(rows * 4 * plugin_host::kTokenInputs);
  l.hidden_bytes = s.hidden_bytes;
  l.hidden = take(s.hidden_bytes);
  l.head_weight_bytes = s.head_weight_bytes;
  l.head_weight = take(s.head_weight_bytes);
  l.head_bias_bytes = s.head_bias_bytes;
  l.head_bias = take(s.head_bias_bytes);
  l.head_dh_row_index = take(static_cast<std::uint64_t>(s.head_dh_rows) * 8);
  l.staging_bytes = s.staging_bytes;
  l.staging = take(s.staging_bytes);
  // Each output ends at a page end, with a guard page before its first page and after its last.
  const auto place = [&](std::uint64_t bytes, std::uint64_t& offset, std::uint64_t& before, std::uint64_t& after) {
    before = aligned(at, page);
    const std::uint64_t pages = aligned(bytes, page) / page;
    after = before + page + pages * page;
    offset = after - bytes;
    at = after + page;
  };
  l.grad_bytes = s.grad_bytes;
  place(s.grad_bytes, l.grad, l.guard_pages[0], l.guard_pages[1]);
  l.token_loss_bytes = rows * 4;
  place(rows * 4, l.token_loss, l.guard_pages[2], l.guard_pages[3]);
  l.token_values_bytes = rows * 4 * s.token_values;
  place(l.token_values_bytes, l.token_values, l.guard_pages[4], l.guard_pages[5]);
  l.scope_values_bytes = static_cast<std::uint64_t>(s.scope_values) * 8;
  place(l.scope_values_bytes, l.scope_values, l.guard_pages[6], l.guard_pages[7]);
  l.head_dh_bytes = s.head_dh_bytes;
  place(s.head_dh_bytes, l.head_dh, l.guard_pages[8], l.guard_pages[9]);
  l.head_dw_bytes = s.head_dw_bytes;
  place(s.head_dw_bytes, l.head_dw, l.guard_pages[10], l.guard_pages[11]);
  l.head_db_bytes = s.head_db_bytes;
  place(s.head_db_bytes, l.head_db, l.guard_pages[12], l.guard_pages[13]);
  l.bytes = at;
  return l;
}

SharedRegion::SharedRegion(const plugin_host::RegionLayout& layout, const std::uint8_t* canary) : layout_(layout) {
  std::memcpy(canary_, canary, sizeof(canary_));
  fd_ = ::memfd_create("lossverify-plugin-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd_ < 0) throw InternalError(std::string("plugin region: memfd_create: ") + std::strerror(errno));
  // Sealed at its size: a plugin that truncates the region (through /proc, say) would otherwise turn lossverify's
  // next read of it into SIGBUS.
  if (::ftruncate(fd_, static_cast<off_t>(layout.bytes)) != 0 ||
      ::fcntl(fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    const int error = errno;
    ::close(fd_);
    throw InternalError("plugin region of " + std::to_string(layout.bytes) + " bytes: " + std::strerror(error));
  }
  void* p = ::mmap(nullptr, layout.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    const int error = errno;
    ::close(fd_);
    throw InternalError(std::string("plugin region: mmap: ") + std::strerror(error));
  }
  data_ = static_cast<std::byte*>(p);
  for (const GuardedOutput& o : guarded_outputs(layout)) {
    for (std::uint64_t k = slack_begin(o.guard, layout.page_bytes); k < o.output; ++k) {
      data_[k] = std::byte{canary_[k % plugin_host::kCanaryBytes]};
    }
  }
}

SharedRegion::~SharedRegion() {
  if (data_ != nullptr) ::munmap(data_, layout_.bytes);
  if (fd_ >= 0) ::close(fd_);
}

std::string SharedRegion::touched_canary() const {
  for (const GuardedOutput& o : guarded_outputs(layout_)) {
    for (std::uint64_t k = slack_begin(o.guard, layout_.page_bytes); k < o.output; ++k) {
      if (data_[k] != std::byte{canary_[k % plugin_host::kCanaryBytes]}) return o.name;
    }
  }
  return "";
}

std::string SharedRegion::guard_hit(std::uint64_t offset) const {
  // Neighbouring outputs' pages touch: a hit on the one between them is a write far past the first output or
  // just before the second.
  const char* what[] = {"before the start of its gradient buffer (outputs->grad)",
                        "past the end of its gradient buffer (outputs->grad)",
                        "outside its output buffers, between its gradient (outputs->grad) and per-row loss "
                        "(outputs->token_loss) buffers",
                        "past the end of its per-row loss buffer (outputs->token_loss)",
                        "outside its output buffers, between its per-row loss (outputs->token_loss) and per-row "
                        "value (outputs->token_values) buffers",
                        "past the end of its per-row value buffer (outputs->token_values)",
                        "outside its output buffers, between its per-row value (outputs->token_values) and scope "
                        "value (outputs->scope_values) buffers",
                        "past the end of its scope value buffer (outputs->scope_values)",
                        "outside its output buffers, between its scope value (outputs->scope_values) and head dh "
                        "(outputs->head_dh) buffers",
                        "past the end of its head dh buffer (outputs->head_dh)",
                        "outside its output buffers, between its head dh (outputs->head_dh) and head dW "
                        "(outputs->head_dw) buffers",
                        "past the end of its head dW buffer (outputs->head_dw)",
                        "outside its output buffers, between its head dW (outputs->head_dw) and head db "
                        "(outputs->head_db) buffers",
                        "past the end of its head db buffer (outputs->head_db)"};
  for (int k = 0; k < 2 * plugin_host::kOutputs; ++k) {
    if (offset >= layout_.guard_pages[k] && offset < layout_.guard_pages[k] + layout_.page_bytes) return what[k];
  }
  return "";
}

}  // namespace lossverify
