// KD's catalogued bugs (docs/catalogue.md): the T^2 factor, the value reported, the distributed softmax and
// the TP all-reduce's backward. Each is a set of the switches its kernels carry.
#include "lossverify/kinds/kd/kd_parts.hpp"

#include "lossverify/impl/catalogue.hpp"

namespace lossverify {

std::vector<Implementation> kd_catalogue() {
  const Applies mine = Applies::kind("kd");
  std::vector<Implementation> v;
  v.push_back(catalogued_bug("kd-no-t2", "KD loss missing the T^2 factor", "NeMo KDLoss, PR #1499 (adds T^2 scaling)",
                             "loss and gradient / reference = 1/T^2", {"loss", "grad"}, mine,
                             switches_with([](BugSwitches& b) { b.kd_no_t2 = true; })));

  v.push_back(catalogued_bug("kd-double-t2", "T^2 applied twice",
                             "NeMo KDLoss PR #1499 scales by T^2 itself; a caller that scales again",
                             "loss and gradient / reference = T^2", {"loss", "grad"}, mine,
                             switches_with([](BugSwitches& b) { b.kd_double_t2 = true; })));

  v.push_back(catalogued_bug("kd-cross-entropy-value", "reports the cross-entropy H(P, Q) instead of KL(P || Q)",
                             "NeMo KDLoss at PR #1499", "loss nonzero when student = teacher; gradient right", {"loss"},
                             mine, switches_with([](BugSwitches& b) { b.kd_cross_entropy_value = true; })));

  v.push_back(catalogued_bug("kd-local-softmax", "teacher and student softmax normalised per TP shard",
                             "TP KD without the distributed softmax that NeMo KDLoss PR #1499 adds",
                             "loss and gradient wrong for TP > 1 only", {"loss", "grad"}, mine,
                             switches_with([](BugSwitches& b) { b.kd_local_softmax = true; })));

  v.push_back(
      catalogued_bug("kd-untracked-allreduce", "TP all-reduce invisible to autograd in the KD backward",
                     "NeMo KDLoss PR #1499 (_kl_forward_tp)",
                     "g_j = P_r Q_j - P_j + [j = local argmax] P_r (1 - Q_r): elementwise error, row sums stay 0",
                     {"grad"}, mine, switches_with([](BugSwitches& b) { b.kd_untracked_allreduce = true; })));

  v.push_back(catalogued_bug(
      "kd-tp-grad-sum",
      "the TP all-reduces go through torch.distributed.nn.functional.all_reduce, whose backward sums the "
      "gradients of a loss every TP rank holds",
      "NVIDIA-NeMo/Automodel kd_loss.py _kl_forward_tp, on main at 36044ad3 (docs/frameworks.md)",
      "gradient = TP x reference; loss right", {"grad"}, mine,
      switches_with([](BugSwitches& b) { b.kd_tp_grad_sum = true; })));
  return v;
}

}  // namespace lossverify
