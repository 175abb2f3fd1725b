// Cross-entropy's catalogued bugs (docs/catalogue.md): label smoothing, stability, masking, the z-loss, the
// gradient's storage, and the MTP loss's weights. Each is a set of the switches its kernels carry.
#include "lossverify/kinds/cross_entropy/cross_entropy_parts.hpp"

#include "lossverify/impl/catalogue.hpp"

namespace lossverify {

std::vector<Implementation> cross_entropy_catalogue() {
  const Applies mine = Applies::kind("cross_entropy");
  std::vector<Implementation> v;
  v.push_back(catalogued_bug(
      "smoothing-partition-vocab", "label smoothing uses the shard width V_p and a shard-local mean log-probability",
      "Megatron-LM tensor_parallel/cross_entropy.py, still on main at d98e8a64 (issue #737; the fix, PR #5522, was "
      "closed unmerged; docs/frameworks.md)",
      "TP rank losses disagree; non-target gradient off by -a(1/(V_p-1) - 1/(V-1)); row sum "
      "-(TP-1) a V_p/(V_p-1)",
      {"loss", "grad", "rank_agreement", "row_sum"}, mine, switches_with([](BugSwitches& b) {
        b.smoothing_vocab_local_forward = b.smoothing_sum_local_forward = b.smoothing_vocab_local_backward = true;
      })));

  v.push_back(
      catalogued_bug("smoothing-log-after-exp", "smoothing's mean log-probability taken as log(exp(x - M) / S)",
                     "Megatron-LM tensor_parallel/cross_entropy.py, still on main at d98e8a64 (PR #5522 would have "
                     "fixed it; docs/frameworks.md)",
                     "loss = +inf once a row's logit gap exceeds ~103 (fp32 exp underflow)", {"loss", "finite"}, mine,
                     switches_with([](BugSwitches& b) { b.smoothing_log_after_exp = true; })));

  v.push_back(catalogued_bug(
      "smoothing-backward-partition", "forward fixed, backward smoothing still uses the shard width V_p",
      "the half-fixed state of Megatron-LM's vocab-parallel smoothing (PR #5522 fixes both passes)",
      "gradient only: non-target entries off by -a(1/(V_p-1) - 1/(V-1)), row sums nonzero", {"grad", "row_sum"}, mine,
      switches_with([](BugSwitches& b) { b.smoothing_vocab_local_backward = true; })));

  v.push_back(catalogued_bug(
      "smoothing-local-sum", "the sum_v x_v of the smoothing term summed over the local shard only",
      "NVIDIA/TransformerEngine's parallel_cross_entropy Triton kernel with TP > 1 and label smoothing "
      "(reproduced at d0067d0d through lossverify.torch: docs/pytorch.md)",
      "TP rank losses differ by (a/V) sum of the other shards' x; gradient right", {"loss", "rank_agreement"}, mine,
      switches_with([](BugSwitches& b) { b.smoothing_raw_local_sum = true; })));

  v.push_back(catalogued_bug("smoothing-convention-swap",
                             "pytorch smoothing convention where megatron was asked, or back",
                             "label_smoothing means a in PyTorch but a V/(V-1) in Megatron-LM (docs/spec.md §3)",
                             "constant non-target gradient offset a(1/V - 1/(V-1)); loss off", {"loss", "grad"}, mine,
                             switches_with([](BugSwitches& b) { b.smoothing_convention_swap = true; })));

  v.push_back(catalogued_bug(
      "full-vocab-through-tp", "gathered full-vocabulary logits fed to the vocab-parallel path",
      "Megatron-LM's vocab_parallel_cross_entropy on logits its output layer gathered (issue #7452), "
      "reproduced on main at d98e8a64 (docs/frameworks.md)",
      "loss = reference + ln(TP); non-target gradient = p/TP (the label is owned by TP rank 0 only)",
      {"loss", "grad", "row_sum"}, mine, switches_with([](BugSwitches& b) { b.full_vocab_through_tp = true; })));

  v.push_back(catalogued_bug("no-max-shift", "exp(x) without subtracting the row max",
                             "the textbook softmax; every fused kernel subtracts the max (online softmax)",
                             "inf/NaN once a logit exceeds ~88.7 (fp32)", {"loss", "grad", "finite"}, mine,
                             switches_with([](BugSwitches& b) { b.no_max_shift = true; })));

  v.push_back(
      catalogued_bug("grad-rounded-early", "gradient stored in the output dtype before scaling by the upstream weight",
                     "NVIDIA/TransformerEngine issue #3193", "bf16 gradient differs from round(reference) by > 1 ulp",
                     {"grad"}, mine, switches_with([](BugSwitches& b) { b.grad_rounded_early = true; })));

  v.push_back(
      catalogued_bug("zloss-on-ignored", "z-loss (and its gradient) not masked on ignored tokens",
                     "z-loss added to parallel_cross_entropy, NVIDIA/TransformerEngine PR #2707 (tests ignored tokens)",
                     "loss on ignored rows = w_z lse^2; gradient 2 w_z lse p there", {"loss", "grad"}, mine,
                     switches_with([](BugSwitches& b) { b.zloss_on_ignored = true; })));

  v.push_back(catalogued_bug(
      "zloss-grad-after-smoothing", "z-loss factor (1 + 2 w_z lse) applied to (p - q) instead of p",
      "an earlier revision of NVIDIA/TransformerEngine PR #2707, corrected in review", "gradient error -2 w_z lse q",
      {"grad", "row_sum"}, mine, switches_with([](BugSwitches& b) { b.zloss_grad_after_smoothing = true; })));

  v.push_back(catalogued_bug(
      "overwrites-input",
      "the softmax written into the kernel's own logits buffer, in place, and that buffer handed over as the "
      "gradient before the target term and the token weight",
      "in-place kernels: Megatron-LM's fp32 path keeps its softmax in the logits' storage and Liger-Kernel writes "
      "its gradient there; an oracle that read the implementation's buffers would judge against what they overwrote",
      "gradient = p, each row summing to 1 instead of 0; the loss is right, and the oracle's figures are those of "
      "the correct run",
      {"grad", "row_sum"}, mine, switches_with([](BugSwitches& b) { b.overwrites_input = true; })));

  v.push_back(catalogued_bug(
      "mtp-local-count-ratio",
      "an MTP layer's per-token loss scaled by its micro-batch's local main-loss over MTP token counts, "
      "then divided by the global main-loss count",
      "Megatron-LM transformer/multi_token_prediction.py process_mtp_loss with calculate_per_token_loss, "
      "on main at d98e8a64 (issue #7452; docs/frameworks.md)",
      "token weight (N_rk + E_rk)/(N_rk (N_v + S)) instead of 1/N_v (E_rk: sequences ending in the "
      "micro-batch, S: sequences): wrong when ranks or micro-batches hold unequal counts",
      {"loss", "grad"}, mine, switches_with([](BugSwitches& b) { b.mtp_local_count_ratio = true; })));
  return v;
}

}  // namespace lossverify
