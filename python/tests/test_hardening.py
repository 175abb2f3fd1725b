"""The harness under hostile loss functions and arguments (issue 30's audit): each test failed before its fix.

In-place changes to later micro-batches, NaN on masked rows, ranks that end without a word, the output rules
of --report and --keep-dump, usage errors, SIGTERM, children of the loss function, invalid Reduced values,
the world-size bound, sweeps checked up front, and escaped messages."""

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import unittest
import uuid

import lossverify.torch as lvt
import loss_functions as fns
from lossverify import safetensors
from lossverify.dump import DumpWriter
from lossverify.errors import DumpError, HarnessTimeout, UsageError, UserFunctionError
from lossverify.torch import harness
from support import PYTHON_DIR, case_path

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def run_cli(*args, timeout=120, env=None, input_fd=subprocess.DEVNULL):
    environment = dict(os.environ if env is None else env)
    environment["PYTHONPATH"] = os.pathsep.join([PYTHON_DIR, TESTS_DIR] + [p for p in [os.environ.get("PYTHONPATH")]
                                                                             if p])
    return subprocess.run([sys.executable, "-m", "lossverify.torch", *args], capture_output=True, text=True,
                          env=environment, timeout=timeout, check=False, stdin=input_fd)


def processes_with(marker):
    """PIDs of live processes whose environment holds `marker` (zombies excluded)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            found.append(int(entry))
        except OSError:
            continue
    return found


def file_hash(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class InputsAndOutputsTest(unittest.TestCase):
    def test_changes_to_later_micro_batches_are_reported_and_the_dump_keeps_the_exported_labels(self):
        with tempfile.TemporaryDirectory() as tmp:
            keep = os.path.join(tmp, "kept")
            report = lvt.check(fns.corrupts_later_labels, case_path("ga-unequal-microbatches"), keep_dump=keep)
            self.assertEqual(report.verdict, "fail")  # micro-batch 1 learned shifted labels
            changed = [w for w in report.warnings if "ctx.micro_batches[1].labels was modified in place" in w]
            self.assertTrue(changed, report.warnings)
            exported = safetensors.load_file(os.path.join(keep, "inputs", "rank0.safetensors"))
            dumped = safetensors.load_file(os.path.join(report.dump_dir, "rank0.safetensors"))
            with open(os.path.join(keep, "inputs", "inputs.json")) as f:
                begin, end = json.load(f)["ranks"][0]["micro_batches"][1]
            self.assertTrue(bool((dumped["mb1.labels"] == exported["labels"][begin:end]).all()))

    def test_nan_on_masked_rows_fails_finite_in_the_harness_as_in_check_dump(self):
        with tempfile.TemporaryDirectory() as tmp:
            keep = os.path.join(tmp, "kept")
            report = lvt.check(fns.nan_on_masked_rows, case_path("cp-zigzag-packed"), keep_dump=keep)
            self.assertIn("finite", report.failing_checks)
            again = subprocess.run([os.environ["LOSSVERIFY_BIN"], "check-dump", "--manifest",
                                    os.path.join(report.dump_dir, "manifest.json"), "--quiet",
                                    "--report", os.path.join(tmp, "again.json")], check=False)
            self.assertEqual(again.returncode, 1)
            with open(os.path.join(tmp, "again.json")) as f:
                failing = sorted(c["name"] for c in json.load(f)["runs"][0]["checks"] if c["verdict"] == "fail")
            self.assertEqual(failing, report.failing_checks)

    def test_the_report_never_overwrites_the_case_file(self):
        with tempfile.TemporaryDirectory() as tmp:
            case = shutil.copy(case_path("smoothing-pytorch"), os.path.join(tmp, "case.json"))
            before = file_hash(case)
            result = run_cli("run", "--fn", "lossverify.torch.implementations:correct", case, "--report", case)
            self.assertEqual(result.returncode, 2, result.stderr)
            self.assertIn("which this command reads", result.stderr)
            self.assertEqual(file_hash(case), before)

    def test_a_report_onto_a_fifo_without_a_reader_is_exit_3_without_a_hang(self):
        with tempfile.TemporaryDirectory() as tmp:
            fifo = os.path.join(tmp, "fifo")
            os.mkfifo(fifo)
            started = time.monotonic()
            result = run_cli("run", "--fn", "lossverify.torch.implementations:correct", case_path("underflow-gap-240"),
                             "--report", fifo, timeout=60)
            self.assertEqual(result.returncode, 3, result.stderr)
            self.assertIn("a FIFO with no reader", result.stderr)
            self.assertLess(time.monotonic() - started, 60)


class UsageTest(unittest.TestCase):
    def test_bad_arguments_are_exit_2_with_no_traceback(self):
        with tempfile.TemporaryDirectory() as tmp:
            a_file = os.path.join(tmp, "file")
            open(a_file, "w").close()
            fifo = os.path.join(tmp, "fifo")
            os.mkfifo(fifo)
            fn = ["--fn", "lossverify.torch.implementations:correct"]
            case = case_path("smoothing-pytorch")
            empty = os.path.join(tmp, "empty-keep")
            os.makedirs(empty)
            bad_case = os.path.join(tmp, "bad.json")
            with open(bad_case, "w") as f:
                f.write("{ not json")
            for args, expected in [
                    (["run", *fn, case, "--timeout", "nan"], "timeout must be a finite number"),
                    (["run", *fn, case, "--timeout", "inf"], "timeout must be a finite number"),
                    (["run", *fn, case, "--timeout", "-1"], "timeout must be a finite number"),
                    (["run", *fn, case, "--timeout", "0"], "timeout must be a finite number"),
                    (["run", *fn, case, "--keep-dump", a_file], "exists and is not a folder"),
                    (["run", *fn, case, "--keep-dump", fifo], "exists and is not a folder"),
                    (["run", *fn, case, "--keep-dump", "/dev/null"], "exists and is not a folder"),
                    (["run", *fn, case, "--report", tmp], "is a folder"),
                    # a report on what the launch writes into an empty --keep-dump folder: refused before the run
                    (["run", *fn, case, "--keep-dump", empty, "--report", os.path.join(empty, "inputs")],
                     "inside --keep-dump"),
                    (["sweep", *fn, case, "--layout", "tp2", "--keep-dump", empty, "--report",
                      os.path.join(empty, "tp2-cp1-dp1-ga1")], "inside --keep-dump"),
                    (["run", "--fn", ":x", case], "expected MODULE:FUNCTION"),
                    (["sweep", *fn, case, "--layout", "tp2-zz3"], "cannot read 'zz3'"),
                    (["sweep", *fn, bad_case, "--layout", "tp2"], "bad.json"),
                    (["sweep", *fn, bad_case], "cannot read the case")]:
                result = run_cli(*args)
                self.assertEqual(result.returncode, 2, f"{args}: {result.stderr}")
                self.assertIn(expected, result.stderr, args)
                self.assertNotIn("Traceback", result.stderr, args)

    def test_the_world_size_is_bounded_before_any_rank_starts(self):
        dp = harness.max_rank_processes() // 4 + 1  # the case's tp 4 times dp: one past the bound
        started = time.monotonic()
        with self.assertRaises(UsageError) as caught:
            lvt.check(fns.sleeps, case_path("smoothing-pytorch"), dp=dp)
        self.assertIn(f"{4 * dp} rank processes", str(caught.exception))
        self.assertLess(time.monotonic() - started, 20)

    def test_sweep_layouts_are_checked_before_the_first_runs(self):
        started = time.monotonic()
        with self.assertRaises(UsageError):
            lvt.sweep(fns.sleeps, case_path("smoothing-pytorch"), layouts=["tp1", "tp2", {"tp": 0.5}])
        with self.assertRaises(UsageError) as caught:
            lvt.sweep(fns.sleeps, case_path("smoothing-pytorch"), layouts=[(1, 1, 1, g) for g in range(1, 300)])
        self.assertIn("at most 256", str(caught.exception))
        self.assertLess(time.monotonic() - started, 20)  # nothing ran (fns.sleeps never returns)

    def test_a_dump_writer_refuses_fractional_layouts_and_columns(self):
        with tempfile.TemporaryDirectory() as tmp:
            with self.assertRaises(DumpError):
                DumpWriter(tmp, (4, 10), "fp32", {"kind": "cross_entropy"}, {"tp": 0.5})
            writer = DumpWriter(tmp, (4, 10), "fp32", {"kind": "cross_entropy"}, {"tp": 2})
            with self.assertRaises(DumpError):
                writer.rank(tp=0, vocab=(0, 4.5))
            with self.assertRaises(DumpError):
                writer.rank(tp=0.5, vocab=(0, 5))


class RankFailureTest(unittest.TestCase):
    def assert_blamed(self, fn, expected):
        with self.assertRaises(UserFunctionError) as caught:
            lvt.check(fn, case_path("underflow-gap-240"), tp=2, timeout=60)
        self.assertEqual(caught.exception.rank, 1)
        self.assertIn(expected, str(caught.exception))
        self.assertNotIn("rank 0 ended", str(caught.exception))

    def test_a_rank_that_ends_without_a_word_is_named(self):
        self.assert_blamed(fns.exits_on_rank_1, "rank 1 ended without a report (exit code 0)")
        self.assert_blamed(fns.killed_on_rank_1, "rank 1 ended without a report (killed by signal 9)")
        self.assert_blamed(fns.segfaults_on_rank_1, "rank 1 ended without a report (killed by signal 11)")
        self.assert_blamed(fns.sys_exit_on_rank_1, "SystemExit: 0")

    def test_a_timeout_names_where_the_hung_rank_is(self):
        with self.assertRaises(HarnessTimeout) as caught:
            lvt.check(fns.hangs_on_rank_0, case_path("underflow-gap-240"), tp=2, timeout=3)
        message = str(caught.exception)
        self.assertIn("rank 0 at loss_functions.py", message)
        self.assertIn("in hangs_on_rank_0 (not in a collective)", message)
        self.assertIn("rank(s) [1] waiting in a collective", message)

    def test_invalid_reduced_values_are_the_loss_functions_error_naming_the_field(self):
        for fn, expected in [(fns.reduced_with_negative_count, "must be a token count (0 to 2^53), got -3"),
                             (fns.reduced_with_text_count, "must be an integer, got str 'many'")]:
            with self.assertRaises(UserFunctionError) as caught:
                lvt.check(fn, case_path("underflow-gap-240"), tp=2)
            self.assertIn("Reduced(num_tokens=...) " + expected, str(caught.exception))

    def test_messages_escape_control_characters_and_carry_one_prefix(self):
        result = run_cli("run", "--fn", "loss_functions:raises_with_escapes", case_path("underflow-gap-240"))
        self.assertEqual(result.returncode, 3)
        self.assertNotIn("\x1b", result.stderr)
        self.assertIn("\\x1b[2J", result.stderr)
        result = run_cli("run", "--fn", "lossverify.torch.implementations:correct", case_path("smoothing-pytorch"),
                         "--set", "loss.label_smoothing=2")
        self.assertEqual(result.returncode, 2)
        self.assertIn("lossverify.torch: error: ", result.stderr)
        self.assertNotIn("lossverify: error:", result.stderr)


class ProcessesTest(unittest.TestCase):
    def test_a_child_of_the_loss_function_does_not_outlive_the_run(self):
        marker = f"LOSSVERIFY_TEST_MARKER={uuid.uuid4().hex}"
        env = dict(os.environ, LOSSVERIFY_TEST_MARKER=marker.split("=", 1)[1])
        started = time.monotonic()
        result = run_cli("run", "--fn", "loss_functions:forks_a_sleeper", case_path("underflow-gap-240"), env=env,
                         timeout=90)  # the sleeper would hold the captured stdout for 120 s
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertLess(time.monotonic() - started, 60)
        time.sleep(0.5)
        self.assertEqual(processes_with(marker), [])

    def test_a_child_in_a_session_of_its_own_does_not_outlive_the_run(self):
        # start_new_session leaves the rank's process group, which the harness used to end: it held the captured
        # stdout for its 120 s. The harness is now its reaper, and ends it with the launch.
        marker = f"LOSSVERIFY_TEST_MARKER={uuid.uuid4().hex}"
        env = dict(os.environ, LOSSVERIFY_TEST_MARKER=marker.split("=", 1)[1])
        started = time.monotonic()
        result = run_cli("run", "--fn", "loss_functions:forks_a_session_sleeper", case_path("underflow-gap-240"),
                         env=env, timeout=90)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertLess(time.monotonic() - started, 60)
        time.sleep(0.5)
        self.assertEqual(processes_with(marker), [])

    def test_sigterm_stops_the_ranks_and_removes_the_temporary_folders(self):
        marker = f"LOSSVERIFY_TEST_MARKER={uuid.uuid4().hex}"
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, LOSSVERIFY_TEST_MARKER=marker.split("=", 1)[1], TMPDIR=tmp,
                       PYTHONPATH=os.pathsep.join([PYTHON_DIR, TESTS_DIR]))
            process = subprocess.Popen([sys.executable, "-m", "lossverify.torch", "run", "--fn", "loss_functions:sleeps",
                                        case_path("underflow-gap-240"), "--tp", "2"], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and len(processes_with(marker)) < 4:  # parent, server, 2 ranks
                time.sleep(0.2)
            time.sleep(1.0)  # the ranks are inside the loss function
            process.send_signal(signal.SIGTERM)
            process.communicate(timeout=30)
            self.assertEqual(process.returncode, -signal.SIGTERM)
            time.sleep(1.0)  # the fork server leaves once its parent has gone
            self.assertEqual(processes_with(marker), [])
            self.assertEqual([f for f in os.listdir(tmp) if f.startswith("lossverify-torch-")], [])


if __name__ == "__main__":
    unittest.main()
