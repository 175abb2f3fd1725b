"""The policy kind in the Python package: the per-token objective's arithmetic (no ranks), the dump's policy
tensors and statistics, and the three ways a function returns a policy loss on real gloo ranks, judged by
check-dump: per-token losses, LogProbs (a trainer's log-prob pass) and Reduced (with log-probabilities,
entropies and statistics), and the function's errors that name the field."""

import json
import math
import os
import tempfile
import unittest

import torch

import lossverify.torch as lvt
import loss_functions as fns
from lossverify import inputs
from lossverify.dump import DumpWriter
from lossverify.errors import UserFunctionError
from lossverify.torch import LossConfig
from lossverify.torch.policy import policy_terms, sequence_log_ratio, statistics_parts, token_loss
from support import case_path, read_case

GRPO = "rl-grpo-tp2-dp2-ga2"  # T 0.7, clip (0.2, 0.28), dual clip 3, k3 at 0.05, entropy 0.01, token-mean
DRGRPO = "rl-drgrpo-cp2-whiten"  # whitened advantages, k2, seq-mean-token-sum-norm, cp 2, bf16
LOGPROB = "rl-logprob-entropy-tp4"  # objective logprob, seq-mean-token-mean, tp 4 uneven shards
GSPO = "rl-gspo-cp2-tp2"  # ratio sequence, seq-mean-token-mean, T 0.8, k3, entropy 0.01, tp 2 x cp 2 x dp 2


class PolicyTermsTest(unittest.TestCase):
    """lossverify.torch.policy against the definitions (docs/spec.md §3.3), token by token in float64."""

    loss = LossConfig(kind="policy", clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_penalty="k3", kl_coef=0.05,
                      entropy_coef=0.01)

    def test_each_branch_of_the_clipped_surrogate(self):
        # ratios: below 1 - clip_low, inside, above 1 + clip_high (A > 0 and A < 0), and past the dual clip
        ratio = torch.tensor([0.5, 1.1, 1.5, 1.5, 0.5, 4.0], dtype=torch.float64)
        advantage = torch.tensor([1.5, -0.7, 1.5, -0.7, -0.7, -0.7], dtype=torch.float64)
        old = torch.tensor([-2.0, -1.0, -3.0, -0.5, -1.5, -2.5], dtype=torch.float64)
        logprob = (old + torch.log(ratio)).requires_grad_(True)
        ref = old + 0.3
        terms = policy_terms(logprob, old, ref, advantage, self.loss)
        expected = []
        for r, a in zip(ratio.tolist(), advantage.tolist()):
            value = max(-r * a, -min(max(r, 0.8), 1.28) * a)
            expected.append(min(value, -3.0 * a) if a < 0 else value)
        self.assertTrue(torch.allclose(terms.surrogate.detach(), torch.tensor(expected, dtype=torch.float64)))
        self.assertEqual(terms.clipped.tolist(), [False, False, True, False, True, False])
        self.assertEqual(terms.dual_clipped.tolist(), [False, False, False, False, False, True])
        terms.surrogate.sum().backward()
        active = ~(terms.clipped | terms.dual_clipped)
        slope = torch.where(active, -ratio * advantage, torch.zeros_like(ratio))
        self.assertTrue(torch.allclose(logprob.grad, slope))

    def test_kl_estimators_and_their_slopes(self):
        logprob = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
        ref = torch.tensor([-1.4, -1.7], dtype=torch.float64)
        d = (logprob - ref).detach()
        for kind, value, slope in (("k1", d, torch.ones_like(d)), ("k2", 0.5 * d * d, d),
                                   ("k3", torch.exp(-d) + d - 1, 1 - torch.exp(-d))):
            with self.subTest(kind):
                loss = LossConfig(kind="policy", kl_penalty=kind, kl_coef=1.0)
                kl = policy_terms(logprob, logprob.detach(), ref, torch.ones_like(d), loss).kl
                self.assertTrue(torch.allclose(kl.detach(), value))
                (grad,) = torch.autograd.grad(kl.sum(), logprob)
                self.assertTrue(torch.allclose(grad, slope))

    def test_token_loss_and_statistics(self):
        logprob = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
        entropy = torch.tensor([2.0, 3.0, 4.0], dtype=torch.float64)
        old = logprob - math.log(1.5)  # ratio 1.5: clipped for A > 0
        advantage = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
        terms = policy_terms(logprob, old, logprob - 0.2, advantage, self.loss)
        l = token_loss(terms, entropy, self.loss)
        kl = math.exp(-0.2) + 0.2 - 1
        self.assertAlmostEqual(float(l[0]), -1.28 + 0.05 * kl - 0.01 * 2.0, places=6)
        parts = statistics_parts(terms, entropy, torch.tensor([True, True, False]), 4)
        self.assertEqual(float(parts["clip_fraction"]), 2 / 4)
        self.assertAlmostEqual(float(parts["entropy"]), 5.0 / 4)
        logprob_only = LossConfig(kind="policy", objective="logprob", entropy_coef=0.05)
        l = token_loss(policy_terms(logprob, None, None, None, logprob_only), entropy, logprob_only)
        self.assertTrue(torch.allclose(l, -logprob - 0.05 * entropy))

    def test_sequence_ratio_and_its_true_derivative(self):
        # two sequences and a padding row; the gradient of sum_t w_t surrogate_t through rho_s is
        # (rho_s / n_s) sum_t w_t (-A_t) [t unclipped] on every valid token of s, the masked token's 0
        loss = LossConfig(kind="policy", clip_low=0.2, clip_high=0.28, ratio="sequence")
        sequences = torch.tensor([0, 0, 0, 1, 1, 1, -1])
        valid = torch.tensor([True, True, True, True, False, True, False])
        old = torch.tensor([-1.0, -2.0, -0.5, -1.5, 0.0, -0.7, 0.0], dtype=torch.float64)
        shift = torch.tensor([0.3, -0.1, 0.1, -0.05, 0.0, 0.08, 0.0], dtype=torch.float64)
        logprob = torch.where(valid, old + shift, torch.zeros_like(old)).requires_grad_(True)
        advantage = torch.tensor([1.0, 1.0, -0.5, -2.0, 0.0, 1.5, 0.0], dtype=torch.float64)
        weights = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0, 0.5, 0.0], dtype=torch.float64)
        log_ratio = sequence_log_ratio(logprob, old, valid, sequences, 2)
        rho = torch.exp(torch.tensor([0.1, 0.015], dtype=torch.float64))  # the shifts' means: 0.3/3, 0.03/2
        self.assertTrue(torch.allclose(log_ratio.detach()[valid], torch.log(rho)[sequences[valid]]))
        terms = policy_terms(logprob, old, old, advantage, loss, log_ratio=log_ratio)
        self.assertEqual(terms.clipped.tolist(), [False] * 7)  # rho in (0.8, 1.28): every token unclipped
        self.assertTrue(torch.allclose(terms.surrogate.detach()[valid], (-rho[sequences] * advantage)[valid]))
        (weights * terms.surrogate).sum().backward()
        q = [float((weights * -advantage)[valid & (sequences == s)].sum()) for s in (0, 1)]
        expected = [float(rho[s]) / n * q[s] if v else 0.0
                    for s, n, v in zip(sequences.tolist(), [3, 3, 3, 2, 2, 2, 1], valid.tolist())]
        self.assertTrue(torch.allclose(logprob.grad, torch.tensor(expected, dtype=torch.float64)))

    def test_the_config_holds_the_kinds_table(self):
        """Attributes by the case's keys; a setting the case leaves out at the C++ table's fallback (clip_high:
        clip_low's value); a key the kind does not have refused by name."""
        self.assertEqual(LossConfig.from_case({"kind": "policy", "kl_penalty": "k2"}).kl_penalty, "k2")
        self.assertEqual(LossConfig.from_case({"kind": "policy"}).ratio, "token")
        self.assertEqual(LossConfig.from_case({"kind": "policy", "ratio": "sequence"}).ratio, "sequence")
        self.assertEqual(LossConfig(kind="policy", clip_low=0.1).clip_high, 0.1)
        self.assertEqual(LossConfig(kind="cross_entropy").smoothing_convention, "pytorch")
        with self.assertRaisesRegex(TypeError, "kl is not a setting of loss kind 'policy'"):
            LossConfig(kind="policy", kl="k3")
        with self.assertRaises(AttributeError):
            LossConfig(kind="cross_entropy").temperature


class PolicyInputsTest(unittest.TestCase):
    def test_row_inputs_are_read_where_the_index_names_them(self):
        with inputs.exported(case_path(GRPO), tp=1, dp=1, ga=1) as exported:
            t = exported.rank(0).tensors
            self.assertEqual(exported.loss["kind"], "policy")
            for name in ("old_logprob", "ref_logprob", "advantages"):
                self.assertEqual((t[name].dtype, tuple(t[name].shape)), (torch.float32, (exported.rank(0).rows,)))
            self.assertTrue((t["old_logprob"][~t["loss_mask"]] == 0).all())
        with inputs.exported(case_path(LOGPROB), tp=1, ga=1) as exported:  # objective logprob: none of them
            self.assertFalse({"old_logprob", "ref_logprob", "advantages"} & set(exported.rank(0).tensors))


class PolicyDumpTest(unittest.TestCase):
    def test_policy_tensors_and_statistics_reach_the_manifest(self):
        with tempfile.TemporaryDirectory() as tmp:
            writer = DumpWriter(tmp, shape=(3, 4), dtype="fp32", loss={"kind": "policy", "aggregation": "token-mean"},
                                layout={"tp": 1})
            rank = writer.rank(vocab=(0, 4))
            rows = torch.ones(3)
            rank.add_micro_batch([0, 1, 2], torch.zeros(3, 4), torch.zeros(3, 4),
                                 labels=torch.zeros(3, dtype=torch.int64),
                                 old_logprob=rows, ref_logprob=rows, advantages=rows, token_loss=rows,
                                 token_logprob=rows, token_entropy=rows)
            rank.stats(loss=1.5, num_tokens=3, clip_fraction=0.25, kl=torch.tensor([0.5]), entropy=float("nan"))
            with self.assertRaisesRegex(Exception, "unknown statistic 'grad_norm'"):
                rank.stats(grad_norm=1.0)
            with open(writer.close(distributed=False), encoding="utf-8") as f:
                manifest = json.load(f)
            entry = manifest["ranks"][0]
            self.assertEqual(sorted(entry["micro_batches"][0]["tensors"]), sorted(
                ["logits", "grad_logits", "labels", "old_logprob", "ref_logprob", "advantages", "token_loss",
                 "token_logprob", "token_entropy"]))
            self.assertEqual(entry["stats"], {"loss": 1.5, "num_tokens": 3, "clip_fraction": 0.25, "kl": "kl",
                                              "entropy": "NaN"})

    def test_a_policy_tensor_of_the_wrong_length_is_refused(self):
        with tempfile.TemporaryDirectory() as tmp:
            writer = DumpWriter(tmp, shape=(3, 4), dtype="fp32", loss={"kind": "policy"}, layout={"tp": 1})
            rank = writer.rank(vocab=(0, 4))
            with self.assertRaisesRegex(Exception, "token_logprob has 2 elements"):
                rank.add_micro_batch([0, 1, 2], torch.zeros(3, 4), torch.zeros(3, 4), token_logprob=torch.ones(2))


class PolicyReturnModesTest(unittest.TestCase):
    """On real ranks: each return mode passes where its numbers are right and fails where they are not."""

    def test_per_token_losses_and_log_probs_on_the_grpo_case(self):
        reports = lvt.check_many({"logprobs": fns.policy_logprobs, "per_token": fns.policy_per_token,
                                  "logprobs_t1": fns.policy_logprobs_at_t1}, case_path(GRPO))
        logprobs = reports["logprobs"]
        logprobs.assert_pass()
        for name in ("logprob", "entropy", "stats"):  # judged, not left out
            self.assertEqual(logprobs.check(name).verdict, "pass", logprobs.table())
        reports["per_token"].assert_pass()
        self.assertEqual(reports["per_token"].check("logprob").verdict, "not_applicable")
        # T = 1 on a T = 0.7 case: wrong log-probabilities, entropies, objective, gradient and clip fraction
        self.assertEqual(reports["logprobs_t1"].failing_checks, ["entropy", "grad", "logprob", "loss", "stats"])

    def test_the_entropy_as_lse_minus_sum_p_x_passes_at_large_logits(self):
        # verl's and TRL's float32 formula cancels two operands of about |lse| (38 at scale 12): its error, about
        # 1.5e-5, failed the entropy check (margins 1.18 and 1.5) before the tolerance covered that cancellation.
        for scale in (8, 12):
            report = lvt.check(fns.policy_entropy_from_logits, case_path(GRPO), set={"inputs.scale": scale})
            self.assertEqual(report.check("entropy").verdict, "pass", report.table())
            self.assertLess(report.check("entropy").margin, 0.7, report.table())

    def test_whitening_and_sequence_aggregation_built_by_the_harness(self):
        reports = lvt.check_many({"logprobs": fns.policy_logprobs, "per_token": fns.policy_per_token},
                                 case_path(DRGRPO))
        reports["logprobs"].assert_pass()
        reports["per_token"].assert_pass()

    def test_the_sequence_ratio_on_the_gspo_case(self):
        # GSPO at cp 2: correct, and the harness's objective on LogProbs and on per-token losses, all pass (the
        # gradient through rho_s all-reduced over CP); each token's own ratio lies up to 15% from its
        # sequence's, so the token-level ratio fails; the sequence ratio over one CP rank's chunks fails too
        reports = lvt.check_many({"correct": "lossverify.torch.implementations:correct",
                                  "logprobs": fns.policy_logprobs, "per_token": fns.policy_per_token,
                                  "gspo_token": fns.policy_gspo_token, "token_ratio": fns.policy_token_ratio,
                                  "cp_local": "lossverify.torch.implementations:rl_gspo_cp_local_ratio"},
                                 case_path(GSPO))
        for name in ("correct", "logprobs", "per_token", "gspo_token"):  # GSPO-token: A is constant per sequence
            with self.subTest(name):
                reports[name].assert_pass()
        token_ratio = reports["token_ratio"]  # the clip fraction too: tokens cross the clip edges
        self.assertEqual(token_ratio.failing_checks, ["grad", "loss", "stats"], token_ratio.table())
        self.assertEqual(reports["cp_local"].failing_checks, ["grad", "loss"], reports["cp_local"].table())

    def test_gspo_token_fails_where_the_advantage_varies_within_a_sequence(self):
        # advantages of single tokens overridden: rho_s w_t (-A_t) per token is no longer the true derivative.
        # Sequence 5 (tokens 124-145) is in the unclipped middle (rho_s 0.93, A > 0), where the surrogate has a
        # gradient; the case's own overrides (the prompt-only sequence) stay.
        case = read_case(GSPO)
        case["inputs"]["overrides"] += [{"token": t, "advantages": 0.8} for t in range(124, 146, 3)]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "gspo-token-advantages.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(case, f)
            reports = lvt.check_many({"correct": "lossverify.torch.implementations:correct",
                                      "gspo_token": fns.policy_gspo_token}, path)
        reports["correct"].assert_pass()
        self.assertEqual(reports["gspo_token"].failing_checks, ["grad"], reports["gspo_token"].table())

    def test_the_sequence_ratio_is_the_same_at_every_layout(self):
        # rho_s over all of a sequence's CP chunks: the same losses and gradients at cp 1 and at cp 2 with GA 2
        report = lvt.sweep("lossverify.torch.implementations:correct", case_path(GSPO),
                           layouts=["tp1-cp1-dp2-ga1", "tp2-cp2-dp2-ga2"])
        self.assertEqual(report.verdict, "pass", report.table())
        self.assertEqual(report.invariance.verdict, "pass")

    def test_a_sweep_of_policy_dumps_checks_invariance(self):
        # two layouts' dumps through one check-dump (this once crashed: the layout snapshot lacked the policy
        # gradient's per-token scale)
        report = lvt.sweep("lossverify.torch.implementations:correct", case_path(DRGRPO),
                           layouts=["tp1-cp1", "tp2-cp2"])
        self.assertEqual(report.verdict, "pass", report.table())
        self.assertEqual(report.invariance.verdict, "pass")

    def test_a_nan_log_probability_fails_its_checks_as_in_a_dump(self):
        # a value, not the function's error: the same verdict as check-dump gives the same numbers
        report = lvt.check(fns.policy_nan_logprob, case_path(GRPO))
        self.assertEqual(report.verdict, "fail")
        for name in ("logprob", "finite", "loss", "grad"):
            self.assertEqual(report.check(name).verdict, "fail", report.table())
        self.assertEqual(report.check("entropy").verdict, "pass", report.table())

    def test_wrong_shape_and_unknown_statistic_are_named(self):
        for fn, text in ((fns.policy_wrong_entropy_shape, "LogProbs(entropy=...) must be a floating-point tensor "
                          "with one value per row"),
                         (fns.policy_unknown_statistic, "Reduced(stats=...) has 'grad_norm'"),
                         (fns.policy_column_logprobs, "LogProbs(logprob=...) must be a floating-point tensor with one "
                          "value per row"),
                         (fns.cross_entropy_as_logprobs, "returned LogProbs, but the case's loss is cross_entropy")):
            with self.subTest(fn.__name__):
                case = "underflow-gap-240" if fn is fns.cross_entropy_as_logprobs else GRPO
                with self.assertRaises(UserFunctionError) as caught:
                    lvt.check(fn, case_path(case))
                self.assertIn(text, str(caught.exception))


if __name__ == "__main__":
    unittest.main()
