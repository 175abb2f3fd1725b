"""lossverify.torch.check / check_many / sweep on real gloo ranks: results, warnings and failures."""

import json
import os
import tempfile
import time
import unittest

import lossverify.torch as lvt
import loss_functions as fns
from lossverify.errors import HarnessTimeout, UsageError, UserFunctionError
from lossverify.torch import implementations
from support import case_path


class CheckTest(unittest.TestCase):
    def test_correct_passes_and_a_bug_fails_on_one_process_group(self):
        reports = lvt.check_many({"correct": implementations.correct,
                                  "partition": implementations.smoothing_partition_vocab,
                                  "reduced": fns.reduced_mean},
                                 case_path("uneven-shards-v507-tp4"))
        reports["correct"].assert_pass()
        reports["reduced"].assert_pass()
        self.assertEqual(reports["reduced"].check("stats").verdict, "pass")
        self.assertEqual(reports["partition"].failing_checks, ["grad", "loss", "rank_agreement", "row_sum"])
        with self.assertRaises(AssertionError) as caught:
            reports["partition"].assert_pass()
        self.assertIn("rank_agreement  FAIL", str(caught.exception))

    def test_torch_cross_entropy_on_full_rows_with_context_and_data_parallel(self):
        # tp = 1: F.cross_entropy with the pytorch convention, across cp = 2 (padding rows) and dp = 3, ga = 2
        report = lvt.check(fns.full_rows_cross_entropy, case_path("ga-mean-grad-sum"), tp=1,
                           set={"loss.smoothing_convention": "pytorch"})
        report.assert_pass()
        self.assertEqual([run.label for run in report.runs], ["tp1-cp2-dp3-ga2"])

    def test_an_input_modified_in_place_is_a_warning_naming_the_tensor(self):
        report = lvt.check(fns.modifies_logits_in_place, case_path("dp-unequal-tokens"), tp=1, dp=2)
        report.assert_pass()  # the dump holds the logits as they were, so the gradient checks out
        self.assertEqual(len(report.warnings), 2)
        self.assertIn("rank 1 (tp=0 cp=0 dp=1), micro-batch 0: logits was modified in place", report.warnings[1])
        self.assertIn("warning: rank 0", report.table())

    def test_scalar_return_needs_reduced(self):
        with self.assertRaises(UserFunctionError) as caught:
            lvt.check(fns.returns_scalar, case_path("underflow-gap-240"), tp=2)
        self.assertIn("Reduced(", str(caught.exception))
        self.assertEqual(caught.exception.exit_code, 3)
        lvt.check(fns.returns_scalar, case_path("underflow-gap-240"), tp=2, returns="reduced").assert_pass()

    def test_wrong_shape_is_named(self):
        with self.assertRaises(UserFunctionError) as caught:
            lvt.check(fns.wrong_shape, case_path("underflow-gap-240"), tp=2)
        self.assertIn("shape [2, 16]", str(caught.exception))
        self.assertEqual(caught.exception.micro_batch, 0)

    def test_keep_dump_keeps_inputs_dump_and_report(self):
        with tempfile.TemporaryDirectory() as tmp:
            keep = os.path.join(tmp, "kept")
            report = lvt.check("lossverify.torch.implementations:correct", case_path("kd-student-equals-teacher"),
                               keep_dump=keep, report=os.path.join(tmp, "r.json"))
            report.assert_pass()
            manifest = os.path.join(report.dump_dir, "manifest.json")
            with open(manifest) as f:
                self.assertEqual(json.load(f)["loss"]["kind"], "kd")
            self.assertTrue(os.path.exists(os.path.join(keep, "inputs", "inputs.json")))
            with open(os.path.join(tmp, "r.json")) as f:
                self.assertEqual(json.load(f)["verdict"], "pass")
            with self.assertRaises(UsageError):  # never into a folder that holds something
                lvt.check(implementations.correct, case_path("kd-student-equals-teacher"), keep_dump=keep)

    def test_cuda_needs_a_gpu_per_rank(self):
        from lossverify.torch import harness

        with self.assertRaises(UsageError) as caught:
            harness._require_gpus(4096)
        self.assertIn("4096 ranks", str(caught.exception))

    def test_the_backend_is_checked_before_any_rank_starts(self):
        with self.assertRaises(UsageError) as caught:
            lvt.check(implementations.correct, case_path("smoothing-pytorch"), backend="nccl")
        self.assertIn("backend \"nccl\" needs device=\"cuda\"", str(caught.exception))
        with self.assertRaises(UsageError):
            lvt.check(implementations.correct, case_path("smoothing-pytorch"), backend="mpi")
        report = lvt.check(implementations.correct, case_path("smoothing-pytorch"), backend="gloo")  # cpu's own
        report.assert_pass()

    def test_a_lambda_is_refused_before_any_rank_starts(self):
        with self.assertRaises(UsageError) as caught:
            lvt.check(lambda logits, labels, ctx: logits.sum(-1), case_path("underflow-gap-240"))
        self.assertIn("importable by name", str(caught.exception))

    def test_empty_micro_batches_are_skipped(self):
        # 8 sequences over dp = 2 and ga = 8: each rank has 4 empty micro-batches
        report = lvt.check(implementations.correct, case_path("ga-unequal-microbatches"), dp=2, ga=8)
        report.assert_pass()
        self.assertEqual(report.runs[0].label, "tp2-cp1-dp2-ga8")


class FailureTest(unittest.TestCase):
    def test_a_raising_rank_ends_the_launch_at_once(self):
        started = time.monotonic()
        with self.assertRaises(UserFunctionError) as caught:
            lvt.check(fns.raises_on_rank_1, case_path("smoothing-pytorch"), tp=4)
        self.assertLess(time.monotonic() - started, 30)  # the others were stopped, not left to time out
        error = caught.exception
        self.assertEqual((error.rank, error.coordinates, error.micro_batch), (1, {"tp": 1, "cp": 0, "dp": 0}, 0))
        self.assertIn("ValueError: deliberate failure on rank 1", error.traceback)
        self.assertIn("loss_functions.py", error.traceback)
        self.assertNotIn("_worker.py", error.traceback)

    def test_a_hanging_rank_times_out(self):
        started = time.monotonic()
        with self.assertRaises(HarnessTimeout) as caught:
            lvt.check(fns.hangs_on_rank_0, case_path("underflow-gap-240"), tp=2, timeout=3)
        self.assertLess(time.monotonic() - started, 30)
        self.assertIn("rank(s) [0", str(caught.exception))
        self.assertEqual(caught.exception.exit_code, 4)

    def test_a_deadlock_is_a_timeout(self):
        with self.assertRaises(HarnessTimeout) as caught:
            lvt.check(fns.waits_for_a_message_never_sent, case_path("underflow-gap-240"), tp=2, timeout=3)
        self.assertIn("rank(s) [0, 1] did not finish within 3 s", str(caught.exception))

    def test_a_rank_killed_by_gloo_is_named(self):
        with self.assertRaises(UserFunctionError) as caught:
            lvt.check(fns.mismatched_collectives, case_path("underflow-gap-240"), tp=2, timeout=10)
        self.assertIn("rank 0 ended without a report (killed by signal 6)", str(caught.exception))


class SweepTest(unittest.TestCase):
    def test_sweep_checks_invariance_across_layouts(self):
        report = lvt.sweep(implementations.correct, case_path("cp-zigzag-packed"),
                           layouts=["tp1-cp1", {"tp": 2, "cp": 2}, (3, 4, 1, 1)])
        report.assert_pass()
        self.assertEqual([run.label for run in report.runs], ["tp1-cp1-dp1-ga1", "tp2-cp2-dp1-ga1", "tp3-cp4-dp1-ga1"])
        self.assertEqual(report.invariance.verdict, "pass")
        self.assertEqual(report.command, "sweep")

    def test_a_layout_dependent_bug_breaks_invariance(self):
        report = lvt.sweep(implementations.smoothing_partition_vocab, case_path("smoothing-megatron"),
                           layouts=["tp1", "tp2"])
        self.assertEqual(report.runs[0].verdict, "pass")  # at tp = 1 the shard is the vocabulary
        self.assertEqual(report.runs[1].verdict, "fail")
        self.assertEqual(report.invariance.verdict, "fail")
        self.assertIn("invariance", report.failing_checks)


if __name__ == "__main__":
    unittest.main()
