#pragma once
// The one sharded implementation is a set of switches; the correct implementation has none on and each
// catalogued bug (docs/spec.md §7) is a named set of them, so CPU and CUDA kernels carry the same bugs.
#include <cstdint>
#include <deque>
#include <string>
#include <string_view>
#include <vector>

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
  bool dp_local_mean = false;           // each rank divides by its own valid count
  bool mtp_local_count_ratio = false;   // MTP per-token weights from local main/MTP count ratios
  bool ga_microbatch_mean = false;      // each micro-batch divided by its own count and by GA
  bool microbatch_local_mean = false;   // each rank's micro-batch divided by its own local count and by GA
  bool schedule_double_divide = false;  // the backward divided by GA once more (every gradient / GA)
  bool cp_duplicated_loss = false;      // every CP rank back-propagates the full loss
  bool cp_stats_dp_only = false;        // token-count statistics reduced over DP only
  bool cp_loss_stat_dp_only = false;    // the logged loss: each CP rank's own slice, reduced over DP only
  bool cp_roll_after_split = false;     // next-token labels made after the CP split
  bool cp_pad_to_cp = false;            // labels split with sequences padded to a multiple of CP, not 2 CP
  // Not a bug: the 16-bit control of the control band (runner/control_band.hpp) computes in the logits'
  // 16-bit dtype, storing each intermediate tensor in it as PyTorch's eager ops do (docs/checks.md).
  bool compute_in_input_dtype = false;
  // A loss kind's own switches beyond the fields above, bit by bit as that kind defines them (a kind added
  // at run time keeps its catalogue here; kinds/loss_kind.hpp).
  std::uint64_t kind_switches = 0;
  // A stage's own switches (kind_api/stage.hpp), bit by bit as that stage defines them.
  std::uint64_t stage_switches = 0;
};

class LossKind;  // kinds/loss_kind.hpp

// The loss kinds whose kernels carry an implementation's switches: every kind, every kind whose tokens
// have labels (kinds/loss_kind.hpp's KindInputs), or the kinds named.
struct Applies {
  enum class Scope { any, labelled, kinds, stage } scope = Scope::any;
  std::vector<std::string> kinds;  // Scope::kinds; Scope::stage: the stage's name (any kind behind it)
  static Applies any() { return {}; }
  static Applies labelled() { return {Scope::labelled, {}}; }
  static Applies kind(std::string name) { return {Scope::kinds, {std::move(name)}}; }
  static Applies stage(std::string name) { return {Scope::stage, {std::move(name)}}; }
};

struct PluginLibrary;  // impl/plugin/plugin_library.hpp
struct LossSpec;       // case/case.hpp

struct Implementation {
  std::string name;
  std::string summary;                 // what the implementation does wrong (or "correct")
  std::string source;                  // the public issue or pull request it comes from
  std::string signal;                  // how the bug shows
  std::vector<std::string> caught_by;  // checks expected to fail on a case that exposes it
  Applies applies;                     // losses whose kernels carry the switch
  BugSwitches bugs;
  const PluginLibrary* plugin = nullptr;  // set for `plugin:PATH` implementations (loaded, never unloaded)
};

// The correct implementation and every catalogued bug: the layouts' (impl/catalogue.cpp), then each loss
// kind's own (its catalogue()), in registration order. Elements stay where they are as it grows.
const std::deque<Implementation>& implementations();
// A catalogued bug, and its switches set by `set(BugSwitches&)`.
Implementation catalogued_bug(std::string name, std::string summary, std::string source, std::string signal,
                              std::vector<std::string> caught_by, Applies applies, BugSwitches switches);
template <class F>
BugSwitches switches_with(F set) {
  BugSwitches b;
  set(b);
  return b;
}
// Implementations that are neither the correct one nor bugs: the control band's (runner/control_band.hpp),
// found by name and listed apart; the gate does not run them.
const std::vector<Implementation>& control_implementations();
// nullptr when no implementation has that name (the catalogue's, then the controls). A `plugin:PATH.so[?PARAMS]` name
// loads that native plugin (once per process) and throws CaseError when it cannot be loaded.
const Implementation* find_implementation(std::string_view name);
// Whether the implementation's switches reach a loss kind's kernel at all.
bool applies_to(const Implementation& impl, const LossKind* kind);
// Whether it runs a case's loss: its kind, and for a plugin every capability the case's settings need.
bool applies_to(const Implementation& impl, const LossSpec& loss);
// The kinds an implementation applies to, in words ("cross_entropy", "kinds with labels", ...).
std::string applies_in_words(const Applies& applies);

}  // namespace lossverify
