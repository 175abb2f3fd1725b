"""python3 -m lossverify.torch: exit codes 0, 1, 2, 3 and 4, the printed table and the report file."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

from support import PYTHON_DIR, case_path

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def run_cli(*args, timeout=120):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PYTHON_DIR, TESTS_DIR] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, "-m", "lossverify.torch", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)


class CommandLineTest(unittest.TestCase):
    def test_exit_0_when_every_check_passes(self):
        with tempfile.TemporaryDirectory() as tmp:
            report = os.path.join(tmp, "r.json")
            result = run_cli("run", "--fn", "lossverify.torch.implementations:correct", case_path("smoothing-pytorch"),
                             "--tp", "4", "--report", report)
            self.assertEqual(result.returncode, 0, result.stderr)
            self.assertIn("smoothing-pytorch  [tp4-cp1-dp1-ga1]  impl lossverify.torch.implementations:correct",
                          result.stdout)
            self.assertIn("verdict: pass", result.stdout)
            with open(report) as f:
                self.assertEqual(json.load(f)["exit_code"], 0)

    def test_exit_1_when_a_check_fails(self):
        result = run_cli("run", "--fn", "lossverify.torch.implementations:kd_no_t2", case_path("kd-tp4-temperature2"))
        self.assertEqual(result.returncode, 1, result.stderr)
        self.assertIn("grad            FAIL", result.stdout)
        self.assertIn("verdict: FAIL", result.stdout)

    def test_exit_2_on_usage_and_case_errors(self):
        for args, message in [
            (["run", "--fn", "no_such_module:fn", case_path("smoothing-pytorch")], "cannot import no_such_module"),
            (["run", "--fn", "loss_functions:no_such_fn", case_path("smoothing-pytorch")], "has no no_such_fn"),
            (["run", "--fn", "lossverify.torch.implementations:correct", case_path("smoothing-pytorch"),
              "--set", "loss.label_smoothing=1.5"], "label_smoothing"),
            (["run", "--fn", "lossverify.torch.implementations:correct", "no/such/case.json"], "case.json"),
            (["run", "--fn", "lossverify.torch.implementations:correct", case_path("smoothing-pytorch"), "--tp", "0"],
             "must be >= 1"),
        ]:
            with self.subTest(message):
                result = run_cli(*args)
                self.assertEqual(result.returncode, 2, result.stdout + result.stderr)
                self.assertIn(message, result.stderr)

    def test_exit_2_when_this_python_cannot_import_torch(self):
        # -S: no site-packages, so no torch; the package itself comes from PYTHONPATH.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([PYTHON_DIR, TESTS_DIR]))
        result = subprocess.run([sys.executable, "-S", "-m", "lossverify.torch", "run", "--fn",
                                 "lossverify.torch.implementations:correct", case_path("smoothing-pytorch")],
                                capture_output=True, text=True, env=env, timeout=120, check=False)
        self.assertEqual(result.returncode, 2, result.stdout + result.stderr)
        self.assertIn("cannot import torch", result.stderr)
        self.assertNotIn("Traceback", result.stderr)

    def test_exit_3_when_the_function_raises_with_rank_and_traceback(self):
        result = run_cli("run", "--fn", "loss_functions:raises_on_rank_1", case_path("underflow-gap-240"))
        self.assertEqual(result.returncode, 3, result.stdout + result.stderr)
        self.assertIn("the loss function raised on rank 1 (tp=1 cp=0 dp=0), micro-batch 0", result.stderr)
        self.assertIn('loss_functions.py", line', result.stderr)
        self.assertIn("ValueError: deliberate failure on rank 1", result.stderr)

    def test_exit_4_when_a_rank_hangs(self):
        result = run_cli("run", "--fn", "loss_functions:hangs_on_rank_0", case_path("underflow-gap-240"),
                         "--timeout", "2")
        self.assertEqual(result.returncode, 4, result.stdout + result.stderr)
        self.assertIn("did not finish within 2 s", result.stderr)

    def test_sweep_and_list(self):
        result = run_cli("sweep", "--fn", "lossverify.torch.implementations:correct", case_path("ga-unequal-microbatches"),
                         "--layout", "tp2-dp1-ga1", "--layout", "tp2-dp2-ga4")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("invariance: pass", result.stdout)
        listing = run_cli("list")
        self.assertEqual(listing.returncode, 0)
        self.assertIn("smoothing_partition_vocab", listing.stdout)


if __name__ == "__main__":
    unittest.main()
