"""An LM head case in the package (docs/pytorch.md, "An LM head"): export-inputs' h, W and b, the harness's
fn(h, W, b, labels, ctx) on real gloo ranks, the dump it writes and check-dump's verdict on it. The correct head
passes the shipped head cases at their own layouts, under sequence parallelism too (each rank's token shard of h,
gathered by the head); its bugs fail the checks golden names (the golden suites, test_golden_bugs.py, hold every head
bug on every head case the package runs)."""

import os
import tempfile
import unittest

import torch

import lossverify.torch as lvt
from lossverify import inputs as lv_inputs
from lossverify.dump import DumpWriter
from lossverify import safetensors
from lossverify.errors import DumpError, InputsError, UserFunctionError
from lossverify.torch.implementations import head
from support import case_path, golden

HEAD_CASES = ("head-ce-tp2-dp2-ga2", "head-ce-bias-upstream-tp4-cp2", "head-kd-tp4-cp2-ga2")
SP_CASE = "head-ce-sp-tp4-cp2-ga2"


class HeadInputsTest(unittest.TestCase):
    def test_export_gives_h_per_row_and_the_shard_of_w_and_b_and_no_logits(self):
        with lv_inputs.exported(case_path("head-ce-bias-upstream-tp4-cp2"), tp=2, cp=1) as exported:
            self.assertEqual(exported.head["hidden"], 40)
            self.assertEqual(exported.head_shard_tensors, ("W", "b"))
            whole_w, whole_b = [], []
            for rank in exported.ranks:
                self.assertNotIn("logits", rank.tensors)
                shard = rank.shard()
                columns = rank.vocab[1] - rank.vocab[0]
                self.assertEqual(tuple(shard["W"].shape), (columns, 40))
                self.assertEqual(tuple(shard["b"].shape), (columns,))
                self.assertEqual(tuple(rank.micro_batch(0)["h"].shape), (rank.rows, 40))
                self.assertNotIn("W", rank.micro_batch(0))
                if rank.dp == 0 and rank.cp == 0:
                    whole_w.append(shard["W"])
                    whole_b.append(shard["b"])
            # the TP ranks of a group hold the same h of their tokens, bit for bit
            first, second = exported.ranks[0], exported.ranks[1]
            self.assertTrue(torch.equal(first.micro_batch(0)["h"], second.micro_batch(0)["h"]))
            self.assertEqual(torch.cat(whole_w).shape[0], exported.vocab)
            self.assertEqual(torch.cat(whole_b).shape[0], exported.vocab)

    def test_the_dump_writer_takes_h_and_the_shard_and_refuses_logits(self):
        with tempfile.TemporaryDirectory() as tmp:
            writer = DumpWriter(tmp, shape=(4, 6), dtype="fp32", loss={"kind": "cross_entropy"}, layout={"tp": 1},
                                stage={"kind": "lm_head", "hidden": 3, "bias": False})
            rank = writer.rank(vocab=(0, 6))
            with self.assertRaises(DumpError) as caught:
                rank.begin_micro_batch(range(4), logits=torch.zeros(4, 6))
            self.assertIn("takes h", str(caught.exception))
            with self.assertRaises(DumpError) as caught:
                rank.head_shard(W=torch.zeros(5, 3))
            self.assertIn("expected torch.float32 [6, 3]", str(caught.exception))
            with self.assertRaises(DumpError) as caught:
                rank.head_shard(b=torch.zeros(6))
            self.assertIn("no bias", str(caught.exception))


class HeadHarnessTest(unittest.TestCase):
    def test_the_correct_head_passes_the_shipped_head_cases(self):
        for name in HEAD_CASES:
            with self.subTest(case=name):
                report = lvt.check("lossverify.torch.implementations.head:correct", case_path(name), control=False)
                report.assert_pass()
                for check in ("dh", "dW"):
                    self.assertEqual(report.check(check).verdict, "pass", report.table())
                self.assertEqual(report.check("grad").verdict, "not_applicable", report.table())

    def test_head_bugs_fail_the_checks_golden_names(self):
        name = "head-ce-tp2-dp2-ga2"
        bugs = ("head_dh_shard_partial", "head_dh_double_reduce", "head_smoothing_dropped", "head_dw_16bit_accumulate")
        reports = lvt.check_many({bug: getattr(head, bug) for bug in bugs}, case_path(name), control=False)
        outcomes = golden(name)
        for bug in bugs:
            with self.subTest(bug=bug):
                expected = outcomes[bug.replace("_", "-")]
                self.assertEqual(expected["verdict"], "fail")
                self.assertEqual(reports[bug].failing_checks, sorted(expected["failing_checks"]),
                                 reports[bug].table())

    def test_a_logits_function_on_a_head_case_is_the_functions_error(self):
        with self.assertRaises(UserFunctionError) as caught:
            lvt.check("lossverify.torch.implementations:correct", case_path("head-ce-tp2-dp2-ga2"), tp=1, dp=1, ga=1,
                      control=False)
        self.assertIn("positional argument", str(caught.exception))


class HeadSequenceParallelTest(unittest.TestCase):
    def test_each_rank_gets_its_token_shard_under_the_heads_contract_and_every_row_under_the_frameworks(self):
        for contract in ("head", "framework"):
            with self.subTest(dh_reduce=contract):
                report = lvt.check("loss_functions:head_sequence_parallel_shard_checked", case_path(SP_CASE),
                                   set={"stage.dh_reduce": contract}, control=False)
                report.assert_pass()
                self.assertEqual(report.check("dh").verdict, "pass", report.table())

    def test_every_tp_rank_dumps_its_groups_dh_of_every_row(self):
        with tempfile.TemporaryDirectory() as tmp:
            report = lvt.check(head.correct, case_path(SP_CASE), keep_dump=tmp, control=False)
            report.assert_pass()
            ranks = [safetensors.load_file(os.path.join(tmp, "dumps", "correct", f"rank{r}.safetensors"))
                     for r in range(4)]  # the TP group of cp 0
        for key in ("mb0.dh", "mb1.dh"):
            with self.subTest(tensor=key):
                rows = ranks[0][key.replace("dh", "h")].shape[0]
                self.assertEqual(tuple(ranks[0][key].shape), (rows, 32))
                for other in ranks[1:]:
                    self.assertTrue(torch.equal(ranks[0][key], other[key]))

    def test_a_sweep_with_and_without_sequence_parallelism_is_invariant_and_catches_a_partial_dh(self):
        report = lvt.sweep(head.correct, case_path(SP_CASE), control=False)
        report.assert_pass()
        self.assertEqual(sorted(run.sp for run in report.runs), [False, False, True, True], report.table())
        self.assertEqual(report.invariance.verdict, "pass", report.table())
        partial = lvt.sweep(head.head_dh_shard_partial, case_path(SP_CASE), control=False)
        self.assertEqual([run.verdict for run in partial.runs], ["fail"] * 4, partial.table())

    def test_a_head_that_never_gathers_its_token_shard_is_the_functions_error(self):
        with self.assertRaises(UserFunctionError) as caught:
            lvt.check("loss_functions:head_ignoring_the_token_shard", case_path(SP_CASE), control=False)
        self.assertIn("head_ignoring_the_token_shard", str(caught.exception))


if __name__ == "__main__":
    unittest.main()


class PhiloxTest(unittest.TestCase):
    def test_the_package_generates_exports_h_w_b_bit_for_bit(self):
        from lossverify.philox import head_inputs

        for name, overrides in (("head-ce-bias-upstream-tp4-cp2", None),
                                ("head-ce-tp2-dp2-ga2", {"stage.hidden_scale": 0.75})):
            with lv_inputs.exported(case_path(name), overrides=overrides) as exported:
                for rank in exported.ranks[:3]:
                    with self.subTest(case=name, rank=rank.rank):
                        h, w, b = head_inputs(exported.case, rank.tensors["tokens"].tolist(), rank.vocab)
                        self.assertEqual(h.dtype, exported.torch_dtype)
                        self.assertTrue(torch.equal(h, rank.tensors["h"]))
                        self.assertTrue(torch.equal(w, rank.shard()["W"]))
                        if exported.head["bias"]:
                            self.assertTrue(torch.equal(b, rank.shard()["b"]))
