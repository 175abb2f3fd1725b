"""lossverify.report: non-finite numbers, the check table, assert_pass, and a real check-dump report."""

import math
import os
import tempfile
import unittest

from lossverify import tool
from lossverify.report import Report
from support import DUMP_FIXTURES


def _report(verdict="fail"):
    worst = {"token": 3, "column": None, "rank": 1, "expected": 2.5, "got": "NaN",
             "tensor": "/x/dump/rank1.safetensors:token_loss", "row": 3, "micro_batch": 0}
    return {"schema_version": "lossverify.report/1", "command": "check-dump", "verdict": verdict,
            "exit_code": 1 if verdict == "fail" else 0,
            "runs": [{"case": {"name": "c"}, "layout": {"tp": 2, "cp": 1, "dp": 1, "ga": 1},
                      "implementation": {"name": "impl"}, "verdict": verdict,
                      "checks": [{"name": "loss", "verdict": verdict, "margin": "Infinity", "worst": worst},
                                 {"name": "grad", "verdict": "pass", "margin": 0.25, "worst": None},
                                 {"name": "stats", "verdict": "not_applicable", "margin": 0.0, "worst": None}]}]}


class ReportTest(unittest.TestCase):
    def test_non_finite_strings_become_floats(self):
        report = Report(_report())
        self.assertEqual(report.check("loss").margin, math.inf)
        self.assertTrue(math.isnan(report.check("loss").worst["got"]))
        self.assertEqual(report.raw["runs"][0]["checks"][0]["margin"], "Infinity")  # raw stays JSON

    def test_failing_report_raises_a_readable_assertion(self):
        report = Report(_report(), warnings=["rank 0, micro-batch 0: logits was modified in place"])
        self.assertEqual(report.failing_checks, ["loss"])
        with self.assertRaises(AssertionError) as caught:
            report.assert_pass()
        text = str(caught.exception)
        self.assertIn("loss (margin inf, worst (3, -, 1: 2.5 -> nan)", text)
        self.assertIn("warning: rank 0, micro-batch 0: logits was modified in place", text)
        self.assertIn("verdict: FAIL", text)

    def test_passing_report(self):
        report = Report(_report("pass"))
        self.assertIs(report.assert_pass(), report)
        self.assertTrue(report.passed)
        self.assertEqual(report.margins["grad"], 0.25)
        self.assertEqual(report.check("stats").verdict, "not_applicable")
        with self.assertRaises(KeyError):
            report.check("nonsense")

    def test_rejects_other_documents(self):
        with self.assertRaises(ValueError):
            Report({"schema_version": "something else"})

    def test_real_check_dump_report_of_a_pytorch_fixture(self):
        manifest = os.path.join(DUMP_FIXTURES, "torch-vocab-parallel-ce-tp2-dp2-bf16-smoothing-partition-vocab",
                                "manifest.json")
        with tempfile.TemporaryDirectory() as tmp:
            report = tool.check_dump(manifest, os.path.join(tmp, "r.json"))
        self.assertEqual(report.failing_checks, ["grad", "loss", "rank_agreement", "row_sum"])
        self.assertEqual(report.exit_code, 1)
        self.assertGreater(report.check("loss").margin, 10)
        self.assertIn("rank_agreement  FAIL", report.table())


if __name__ == "__main__":
    unittest.main()
