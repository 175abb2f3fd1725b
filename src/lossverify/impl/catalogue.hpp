#pragma once
// The one sharded implementation is a set of switches; the correct implementation has none on and each
// catalogued bug (docs/spec.md §7) is a named set of them, so CPU and CUDA kernels carry the same bugs.
#include <string>
#include <string_view>
#include <vector>

#include "lossverify/math/cross_entropy_math.hpp"

namespace lossverify {

struct BugSwitches {
  // Cross-entropy: label smoothing.
  bool smoothing_vocab_local_forward = false;   // forward constants use the shard width V_p
  bool smoothing_sum_local_forward = false;     // forward mean log-prob over the local shard only
  bool smoothing_vocab_local_backward = false;  // backward constants use V_p
  bool smoothing_log_after_exp = false;         // mean log-prob as log(exp(x - M) / S)
  bool smoothing_raw_local_sum = false;         // sum_v x_v of the smoothing term over the local shard only
  bool smoothing_convention_swap = false;       // pytorch where megatron was asked, or back
  // Cross-entropy: sharding, stability, masking, reduction.
  bool full_vocab_through_tp = false;       // gathered full-vocabulary logits fed to the TP path
  bool no_max_shift = false;                // exp(x) without subtracting the max
  bool ignore_index_unmasked = false;       // ignored targets treated as ordinary tokens
  bool mean_over_all_rows = false;          // mean divides by all rows, not valid ones
  bool none_divides_grad = false;           // reduction none still divides the gradient by N
  bool grad_output_first = false;           // the first upstream weight used for every row
  bool grad_rounded_early = false;          // gradient rounded to the output dtype before the upstream weight
  bool zloss_on_ignored = false;            // z-loss (and its gradient) not masked on ignored tokens
  bool zloss_grad_after_smoothing = false;  // z-loss factor applied to (p - q) instead of p
  bool overwrites_input = false;            // the softmax written over the logits and handed over as the gradient
  // KD.
  bool kd_no_t2 = false;
  bool kd_double_t2 = false;
  bool kd_cross_entropy_value = false;  // reports H(P, Q) instead of KL(P || Q)
  bool kd_local_softmax = false;        // softmax normalised per shard
  bool kd_untracked_allreduce = false;  // TP all-reduce invisible to autograd
  bool kd_tp_grad_sum = false;          // all-reduce backward sums the replicated loss's gradients over TP
  // Layouts: data parallel, gradient accumulation, context parallel.
  bool dp_local_mean = false;          // each rank divides by its own valid count
  bool mtp_local_count_ratio = false;  // MTP per-token weights from local main/MTP count ratios
  bool ga_microbatch_mean = false;     // each micro-batch divided by its own count and by GA
  bool cp_duplicated_loss = false;     // every CP rank back-propagates the full loss
  bool cp_stats_dp_only = false;       // token-count statistics reduced over DP only
  bool cp_roll_after_split = false;    // next-token labels made after the CP split
  bool cp_pad_to_cp = false;           // labels split with sequences padded to a multiple of CP, not 2 CP
};

enum class Applies { cross_entropy, kd, any };

struct PluginLibrary;  // impl/plugin/plugin_library.hpp

struct Implementation {
  std::string name;
  std::string summary;                 // what the implementation does wrong (or "correct")
  std::string source;                  // the public issue or pull request it comes from
  std::string signal;                  // how the bug shows
  std::vector<std::string> caught_by;  // checks expected to fail on a case that exposes it
  Applies applies = Applies::any;      // losses whose kernels carry the switch
  BugSwitches bugs;
  const PluginLibrary* plugin = nullptr;  // set for `plugin:PATH` implementations (loaded, never unloaded)
};

const std::vector<Implementation>& implementations();
// nullptr when no implementation has that name. A `plugin:PATH.so[?PARAMS]` name loads that native plugin
// (once per process) and throws CaseError when it cannot be loaded.
const Implementation* find_implementation(std::string_view name);
// Whether the implementation's switches reach a loss kind's kernel at all.
bool applies_to(const Implementation& impl, LossKind kind);

}  // namespace lossverify
