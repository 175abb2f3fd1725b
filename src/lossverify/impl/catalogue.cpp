#include "lossverify/impl/catalogue.hpp"

#include "lossverify/impl/plugin/plugin_library.hpp"

namespace lossverify {

namespace {

Implementation bug(std::string name, std::string summary, std::string source, std::string signal,
                   std::vector<std::string> caught_by, Applies applies, BugSwitches switches) {
  return {std::move(name), std::move(summary), std::move(source), std::move(signal), std::move(caught_by), applies,
          switches};
}

template <class F>
BugSwitches with(F set) {
  BugSwitches b;
  set(b);
  return b;
}

}  // namespace

const std::vector<Implementation>& implementations() {
  static const std::vector<Implementation> list = [] {
    const Applies ce = Applies::cross_entropy;
    const Applies kd = Applies::kd;
    const Applies any = Applies::any;
    std::vector<Implementation> v;
    v.push_back({"correct",
                 "docs/spec.md §5 algorithm: max all-reduce, one packed sum all-reduce, no log(p)",
                 "lossverify",
                 "none",
                 {},
                 any,
                 {}});
    // Cross-entropy: label smoothing.
    v.push_back(bug(
        "smoothing-partition-vocab", "label smoothing uses the shard width V_p and a shard-local mean log-probability",
        "Megatron-LM tensor_parallel/cross_entropy.py, still on main at d98e8a64 (issue #737; the fix, PR #5522, was "
        "closed unmerged; docs/frameworks.md)",
        "TP rank losses disagree; non-target gradient off by -a(1/(V_p-1) - 1/(V-1)); row sum "
        "-(TP-1) a V_p/(V_p-1)",
        {"loss", "grad", "rank_agreement", "row_sum"}, ce, with([](BugSwitches& b) {
          b.smoothing_vocab_local_forward = b.smoothing_sum_local_forward = b.smoothing_vocab_local_backward = true;
        })));
    v.push_back(bug("smoothing-log-after-exp", "smoothing's mean log-probability taken as log(exp(x - M) / S)",
                    "Megatron-LM tensor_parallel/cross_entropy.py, still on main at d98e8a64 (PR #5522 would have "
                    "fixed it; docs/frameworks.md)",
                    "loss = +inf once a row's logit gap exceeds ~103 (fp32 exp underflow)", {"loss", "finite"}, ce,
                    with([](BugSwitches& b) { b.smoothing_log_after_exp = true; })));
    v.push_back(bug("smoothing-backward-partition", "forward fixed, backward smoothing still uses the shard width V_p",
                    "the half-fixed state of Megatron-LM's vocab-parallel smoothing (PR #5522 fixes both passes)",
                    "gradient only: non-target entries off by -a(1/(V_p-1) - 1/(V-1)), row sums nonzero",
                    {"grad", "row_sum"}, ce, with([](BugSwitches& b) { b.smoothing_vocab_local_backward = true; })));
    v.push_back(bug("smoothing-local-sum", "the sum_v x_v of the smoothing term summed over the local shard only",
                    "NVIDIA/TransformerEngine's parallel_cross_entropy Triton kernel with TP > 1 and label smoothing "
                    "(reproduced at d0067d0d through lossverify.torch: docs/pytorch.md)",
                    "TP rank losses differ by (a/V) sum of the other shards' x; gradient right",
                    {"loss", "rank_agreement"}, ce, with([](BugSwitches& b) { b.smoothing_raw_local_sum = true; })));
    v.push_back(bug("smoothing-convention-swap", "pytorch smoothing convention where megatron was asked, or back",
                    "label_smoothing means a in PyTorch but a V/(V-1) in Megatron-LM (docs/spec.md §3)",
                    "constant non-target gradient offset a(1/V - 1/(V-1)); loss off", {"loss", "grad"}, ce,
                    with([](BugSwitches& b) { b.smoothing_convention_swap = true; })));
    // Cross-entropy: sharding, stability, masking, reduction.
    v.push_back(bug("full-vocab-through-tp", "gathered full-vocabulary logits fed to the vocab-parallel path",
                    "Megatron-LM's vocab_parallel_cross_entropy on logits its output layer gathered (issue #7452), "
                    "reproduced on main at d98e8a64 (docs/frameworks.md)",
                    "loss = reference + ln(TP); non-target gradient = p/TP (the label is owned by TP rank 0 only)",
                    {"loss", "grad", "row_sum"}, ce, with([](BugSwitches& b) { b.full_vocab_through_tp = true; })));
    v.push_back(bug("no-max-shift", "exp(x) without subtracting the row max",
                    "the textbook softmax; every fused kernel subtracts the max (online softmax)",
                    "inf/NaN once a logit exceeds ~88.7 (fp32)", {"loss", "grad", "finite"}, ce,
                    with([](BugSwitches& b) { b.no_max_shift = true; })));
    v.push_back(bug("ignore-index-unmasked", "ignored targets treated as ordinary tokens",
                    "fused cross-entropy kernels that skip the ignore_index test (docs/spec.md §7)",
                    "loss = lse on ignored rows, nonzero gradient there, valid-token count too large",
                    {"loss", "grad", "stats"}, ce, with([](BugSwitches& b) { b.ignore_index_unmasked = true; })));
    v.push_back(bug("mean-over-all-rows", "mean reduction divides by all rows, not the valid ones",
                    "NVIDIA/TransformerEngine issue #2476", "loss and gradient scaled by N_v/N", {"loss", "grad"}, any,
                    with([](BugSwitches& b) { b.mean_over_all_rows = true; })));
    v.push_back(bug("none-divides-grad", "reduction none still divides the gradient by N",
                    "NVIDIA/TransformerEngine issue #1879", "gradient/reference = 1/N", {"grad"}, any,
                    with([](BugSwitches& b) { b.none_divides_grad = true; })));
    v.push_back(bug("grad-output-first", "the first upstream weight is used for every row",
                    "NVIDIA/TransformerEngine issue #2139", "gradient rows scaled by g_0/g_t", {"grad"}, any,
                    with([](BugSwitches& b) { b.grad_output_first = true; })));
    v.push_back(bug("grad-rounded-early", "gradient stored in the output dtype before scaling by the upstream weight",
                    "NVIDIA/TransformerEngine issue #3193", "bf16 gradient differs from round(reference) by > 1 ulp",
                    {"grad"}, ce, with([](BugSwitches& b) { b.grad_rounded_early = true; })));
    v.push_back(bug("zloss-on-ignored", "z-loss (and its gradient) not masked on ignored tokens",
                    "z-loss added to parallel_cross_entropy, NVIDIA/TransformerEngine PR #2707 (tests ignored tokens)",
                    "loss on ignored rows = w_z lse^2; gradient 2 w_z lse p there", {"loss", "grad"}, ce,
                    with([](BugSwitches& b) { b.zloss_on_ignored = true; })));
    v.push_back(bug("zloss-grad-after-smoothing", "z-loss factor (1 + 2 w_z lse) applied to (p - q) instead of p",
                    "an earlier revision of NVIDIA/TransformerEngine PR #2707, corrected in review",
                    "gradient error -2 w_z lse q", {"grad", "row_sum"}, ce,
                    with([](BugSwitches& b) { b.zloss_grad_after_smoothing = true; })));
    v.push_back(bug(
        "overwrites-input",
        "the softmax written into the kernel's own logits buffer, in place, and that buffer handed over as the "
        "gradient before the target term and the token weight",
        "in-place kernels: Megatron-LM's fp32 path keeps its softmax in the logits' storage and Liger-Kernel writes "
        "its gradient there; an oracle that read the implementation's buffers would judge against what they overwrote",
        "gradient = p, each row summing to 1 instead of 0; the loss is right, and the oracle's figures are those of "
        "the correct run",
        {"grad", "row_sum"}, ce, with([](BugSwitches& b) { b.overwrites_input = true; })));
    // KD.
    v.push_back(bug("kd-no-t2", "KD loss missing the T^2 factor", "NeMo KDLoss, PR #1499 (adds T^2 scaling)",
                    "loss and gradient / reference = 1/T^2", {"loss", "grad"}, kd,
                    with([](BugSwitches& b) { b.kd_no_t2 = true; })));
    v.push_back(bug("kd-double-t2", "T^2 applied twice",
                    "NeMo KDLoss PR #1499 scales by T^2 itself; a caller that scales again",
                    "loss and gradient / reference = T^2", {"loss", "grad"}, kd,
                    with([](BugSwitches& b) { b.kd_double_t2 = true; })));
    v.push_back(bug("kd-cross-entropy-value", "reports the cross-entropy H(P, Q) instead of KL(P || Q)",
                    "NeMo KDLoss at PR #1499", "loss nonzero when student = teacher; gradient right", {"loss"}, kd,
                    with([](BugSwitches& b) { b.kd_cross_entropy_value = true; })));
    v.push_back(bug("kd-local-softmax", "teacher and student softmax normalised per TP shard",
                    "TP KD without the distributed softmax that NeMo KDLoss PR #1499 adds",
                    "loss and gradient wrong for TP > 1 only", {"loss", "grad"}, kd,
                    with([](BugSwitches& b) { b.kd_local_softmax = true; })));
    v.push_back(bug("kd-untracked-allreduce", "TP all-reduce invisible to autograd in the KD backward",
                    "NeMo KDLoss PR #1499 (_kl_forward_tp)",
                    "g_j = P_r Q_j - P_j + [j = local argmax] P_r (1 - Q_r): elementwise error, row sums stay 0",
                    {"grad"}, kd, with([](BugSwitches& b) { b.kd_untracked_allreduce = true; })));
    v.push_back(bug("kd-tp-grad-sum",
                    "the TP all-reduces go through torch.distributed.nn.functional.all_reduce, whose backward sums the "
                    "gradients of a loss every TP rank holds",
                    "NVIDIA-NeMo/Automodel kd_loss.py _kl_forward_tp, on main at 36044ad3 (docs/frameworks.md)",
                    "gradient = TP x reference; loss right", {"grad"}, kd,
                    with([](BugSwitches& b) { b.kd_tp_grad_sum = true; })));
    // Layouts.
    v.push_back(bug("dp-local-mean", "each DP rank divides by its own valid-token count; gradients then averaged",
                    "pytorch/torchtitan before its loss-balancing fix (VLM PR stacked on #1802)",
                    "token weight 1/(R N_r) instead of 1/N_v: wrong when ranks hold unequal counts", {"loss", "grad"},
                    any, with([](BugSwitches& b) { b.dp_local_mean = true; })));
    v.push_back(bug("mtp-local-count-ratio",
                    "an MTP layer's per-token loss scaled by its micro-batch's local main-loss over MTP token counts, "
                    "then divided by the global main-loss count",
                    "Megatron-LM transformer/multi_token_prediction.py process_mtp_loss with calculate_per_token_loss, "
                    "on main at d98e8a64 (issue #7452; docs/frameworks.md)",
                    "token weight (N_rk + E_rk)/(N_rk (N_v + S)) instead of 1/N_v (E_rk: sequences ending in the "
                    "micro-batch, S: sequences): wrong when ranks or micro-batches hold unequal counts",
                    {"loss", "grad"}, ce, with([](BugSwitches& b) { b.mtp_local_count_ratio = true; })));
    v.push_back(bug("ga-microbatch-mean", "each micro-batch divided by its own valid count and by GA",
                    "pytorch/torchtitan issue #1842", "token weight 1/(GA N_k) instead of 1/N_v", {"loss", "grad"}, any,
                    with([](BugSwitches& b) { b.ga_microbatch_mean = true; })));
    v.push_back(bug("cp-duplicated-loss", "every CP rank back-propagates the full loss",
                    "CP loss on all-gathered logits, what inclusionAI/AReaL PR #1223 (CP-local loss) replaces",
                    "gradient = CP x reference", {"grad"}, any,
                    with([](BugSwitches& b) { b.cp_duplicated_loss = true; })));
    v.push_back(bug("cp-stats-dp-only", "token-count statistics reduced over DP only, not DP x CP",
                    "inclusionAI/AReaL issue #1242", "logged valid-token count = reference / CP (roughly)", {"stats"},
                    any, with([](BugSwitches& b) { b.cp_stats_dp_only = true; })));
    v.push_back(bug("cp-roll-after-split", "next-token labels made by rolling the local CP shard",
                    "inclusionAI/AReaL PR #1223 (labels must be rolled before the split)", "wrong labels at chunk ends",
                    {"loss", "grad"}, ce, with([](BugSwitches& b) { b.cp_roll_after_split = true; })));
    v.push_back(bug("cp-pad-to-cp", "labels split with sequences padded to a multiple of CP instead of 2 CP",
                    "Megatron/TransformerEngine load-balanced CP needs L divisible by 2 CP (AReaL PR #1223)",
                    "misaligned chunks: wrong labels, wrong losses", {"loss", "grad"}, ce,
                    with([](BugSwitches& b) { b.cp_pad_to_cp = true; })));
    return v;
  }();
  return list;
}

const Implementation* find_implementation(std::string_view name) {
  if (is_plugin_spec(name)) return load_plugin_implementation(name);
  for (const auto& impl : implementations()) {
    if (impl.name == name) return &impl;
  }
  return nullptr;
}

bool applies_to(const Implementation& impl, LossKind kind) {
  if (impl.applies == Applies::any) return true;
  return (impl.applies == Applies::kd) == (kind == LossKind::kd);
}

}  // namespace lossverify
