"""The router kind in the Python package: the two ways a function returns a router's losses on real gloo ranks
(RouterLosses, on which the harness applies the case's scaling contract, and Reduced, the trainer's own scaling),
judged by check-dump; a sweep over sequence parallelism; and the function's errors that name the field. The
golden suites run `correct` and the 14 router bugs on every shipped router case."""

import unittest

import torch

import lossverify.torch as lvt
import loss_functions as fns
from lossverify.errors import UserFunctionError
from lossverify.layout import parse_layout
from support import case_path

SP = "moe-aux-sp-tp2-cp2"  # two layers, z-loss, tp 2 under SP, cp 2, ga 2
PER_TOKEN = "moe-per-token-sp-cp2-dp2"  # per-token scaling, sequence aux, tp 2 under SP, cp 2, dp 2
GLOBAL = "moe-global-aux-dp2-ga2"  # global aux with running counts, three layers, dp 2, ga 2
SIGMOID = "moe-sigmoid-seq-aux"
REPLICATED = "moe-aux-replicated-tp8-e6"  # tp 8 replicating the tokens of 6 experts
ROUTED = "moe-routed-groups-bias"  # the routed map: 8 groups of 4 experts, 4 kept, an expert bias


class RouterResultsTest(unittest.TestCase):
    def test_the_trainers_own_scaling_passes_every_router_case(self):
        for name in (SP, PER_TOKEN, GLOBAL, SIGMOID, REPLICATED, ROUTED):
            with self.subTest(case=name):
                report = lvt.check(fns.router_reduced, case_path(name), control=False)
                report.assert_pass()
                # every check a router case has was judged: per-token losses, the logged loss, the gradient and the
                # logged aux and z values (per layer where there are several)
                for check in ("loss", "grad", "counts", "stats"):
                    self.assertEqual(report.checks[check].verdict, "pass", report.table())

    def test_shares_without_per_token_losses_judge_the_logged_loss(self):
        report = lvt.check(fns.router_shares_only, case_path(SP), control=False)
        report.assert_pass()
        self.assertEqual(report.checks["loss"].verdict, "pass", report.table())
        self.assertIn("no per-token losses in the dump", report.checks["loss"].summary)
        self.assertEqual(report.checks["counts"].verdict, "not_applicable", report.table())
        self.assertIn("no counts in the dump", report.checks["counts"].summary)

    def test_the_plain_map_fails_where_the_case_counts_the_routed_map(self):
        report = lvt.check(fns.router_plain_map, case_path(ROUTED), control=False)
        self.assertEqual(report.verdict, "fail", report.table())
        for check in ("counts", "loss", "grad"):
            self.assertEqual(report.checks[check].verdict, "fail", report.table())
        self.assertEqual(lvt.check(fns.router_plain_map, case_path(SP), control=False).verdict, "pass")

    def test_the_expert_bias_is_the_documented_sequence(self):
        from lossverify.torch.kinds.router import expert_bias
        from lossverify.torch.context import LossConfig
        bias = expert_bias(LossConfig(kind="router", expert_bias=0.5), 2, 8)
        self.assertEqual(tuple(bias.shape), (2, 8))
        self.assertEqual(float(bias[0, 0]), float(torch.tensor(0.5 * (2 * 0.6180339887498949 - 1)).float()))
        self.assertTrue(bool((bias.abs() <= 0.5).all()))

    def test_a_sweep_over_sequence_parallelism_is_invariant(self):
        layouts = ["tp1-cp2-dp1-ga2", "tp2-cp2-dp1-ga2", "tp2-sp-cp2-dp1-ga2", "tp4-sp-cp1-dp1-ga2"]
        self.assertEqual([parse_layout(x).sp for x in layouts], [False, False, True, True])
        report = lvt.sweep("lossverify.torch.implementations:correct", case_path(SP), layouts=layouts, control=False)
        report.assert_pass()
        self.assertEqual([run.label for run in report.runs], layouts)

    def test_a_function_s_wrong_results_name_the_field(self):
        expected = [
            (fns.router_one_value_too_few, SP, r"RouterLosses\(aux=\.\.\.\) must be a floating-point tensor with one "
                                               r"value per layer \[2\]"),
            (fns.router_without_z, SP, r"RouterLosses\(z=None\), but the case's z_loss_coef is 0.001"),
            (fns.router_detached_aux, SP, r"RouterLosses\(aux=\.\.\.\) does not require grad"),
            (fns.router_counts_of_one_layer, SP, r"RouterLosses\(counts=\.\.\.\) must be a tensor of one count per "
                                                 r"expert of each layer \(\[2, 16\]\)"),
            (fns.router_losses_on_cross_entropy, "smoothing-pytorch",
             "returned RouterLosses, but the case's loss is cross_entropy"),
        ]
        for fn, name, message in expected:
            with self.subTest(fn=fn.__name__):
                with self.assertRaisesRegex(UserFunctionError, message):
                    lvt.check(fn, case_path(name), control=False)


if __name__ == "__main__":
    unittest.main()
