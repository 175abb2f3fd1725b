"""lossverify.pytest_plugin, run as a user would: pytest in a subprocess with `-p lossverify.pytest_plugin` on a
small generated test file. A correct loss passes, a catalogued bug fails with the check table, the
parametrize helper names its tests CASE@tpN-cpN-dpN-gaN, and --lossverify-report keeps each check's report.

pytest is required (Debian python3-pytest): without it these tests fail, they never skip.
"""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

from support import PYTHON_DIR, all_case_names, has_stage, loss_kind, read_case


def run_pytest(folder, test_source, *args, timeout=300):
    """Writes test_generated.py into folder and runs pytest on it there, with only this plugin loaded."""
    with open(os.path.join(folder, "test_generated.py"), "w", encoding="utf-8") as f:
        f.write(textwrap.dedent(test_source))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PYTHON_DIR] + [p for p in [env.get("PYTHONPATH")] if p])
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # no other plugin, and no second copy of an installed lossverify
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "lossverify.pytest_plugin", "-p", "no:cacheprovider",
                           "-rA", "test_generated.py", *args], cwd=folder, capture_output=True, text=True, env=env,
                          timeout=timeout, check=False)


THREE_LINES = """\
    from lossverify.torch.implementations import correct as my_loss

    def test_my_loss(lossverify_check):
        lossverify_check(my_loss, "smoothing-megatron", tp=4)
"""

KNOWN_BUG = """\
    from lossverify.torch.implementations import smoothing_partition_vocab

    def test_catalogued_bug(lossverify_check):
        lossverify_check(smoothing_partition_vocab, "smoothing-megatron", tp=2)
"""

COLLIDING = """\
    import pytest
    from lossverify.torch.implementations import smoothing_partition_vocab

    @pytest.mark.parametrize("tag", ["a b", "a/b", "LONG1", "LONG2"])
    def test_bug(lossverify_check, tag):
        lossverify_check(smoothing_partition_vocab, "smoothing-megatron", tp=2)
"""

PARAMETRIZED = """\
    from lossverify.pytest_plugin import cases
    from lossverify.torch.implementations import correct

    @cases(layouts=[dict(tp=2), "tp1-cp1-dp1-ga1"], names=["smoothing-pytorch", "underflow-gap-240"])
    def test_case(lossverify_check, lossverify_case):
        report = lossverify_check(correct, lossverify_case)
        assert report.passed

    @cases(kind="kd")
    def test_kd_ids(lossverify_case):
        pass
"""


def own_layout(name):
    """The layout label of a case's own "layout" section (missing counts 1)."""
    layout = {"tp": 1, "cp": 1, "dp": 1, "ga": 1, **read_case(name).get("layout", {})}
    return "tp{tp}-cp{cp}-dp{dp}-ga{ga}".format(**layout)


class PytestPluginTest(unittest.TestCase):
    def setUp(self):
        if importlib.util.find_spec("pytest") is None:
            self.fail(f"{sys.executable} cannot import pytest: install python3-pytest (scripts/install-deps.sh)")
        self.folder = tempfile.mkdtemp(prefix="lossverify-pytest-")
        self.addCleanup(lambda: subprocess.run(["rm", "-rf", self.folder], check=False))

    def test_a_correct_loss_passes_in_three_lines(self):
        result = run_pytest(self.folder, THREE_LINES)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("PASSED test_generated.py::test_my_loss", result.stdout)

    def test_a_catalogued_bug_fails_with_the_check_table(self):
        result = run_pytest(self.folder, KNOWN_BUG)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        self.assertIn("FAILED test_generated.py::test_catalogued_bug", result.stdout)
        self.assertIn("smoothing-megatron  [tp2-cp1-dp1-ga1]", result.stdout)
        self.assertRegex(result.stdout, r"\n\s*loss\s+FAIL\s")
        self.assertIn("verdict: FAIL", result.stdout)

    def test_the_parametrize_helper_names_case_and_layout(self):
        result = run_pytest(self.folder, PARAMETRIZED, "--collect-only", "-q")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        collected = [line for line in result.stdout.splitlines() if line.startswith("test_generated.py::")]
        kd = [n for n in all_case_names() if loss_kind(n) == "kd" and not has_stage(n)]
        self.assertEqual(collected, [
            "test_generated.py::test_case[smoothing-pytorch@tp2-cp1-dp1-ga1]",
            "test_generated.py::test_case[smoothing-pytorch@tp1-cp1-dp1-ga1]",
            "test_generated.py::test_case[underflow-gap-240@tp2-cp1-dp1-ga1]",
            "test_generated.py::test_case[underflow-gap-240@tp1-cp1-dp1-ga1]",
        ] + [f"test_generated.py::test_kd_ids[{n}@{own_layout(n)}]" for n in kd])

    def test_the_report_option_keeps_each_checks_report_and_dump(self):
        reports = os.path.join(self.folder, "reports")
        result = run_pytest(self.folder, PARAMETRIZED, "-k", "test_case and smoothing-pytorch and tp2",
                            "--lossverify-report", reports)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        test_folder = "test_generated.py_test_case_smoothing-pytorch@tp2-cp1-dp1-ga1"  # the test id, file-safe
        kept = os.path.join(reports, test_folder, "smoothing-pytorch")
        with open(os.path.join(kept, "report.json"), encoding="utf-8") as f:
            self.assertEqual(json.load(f)["verdict"], "pass")
        self.assertTrue(os.path.isfile(os.path.join(kept, "dump", "dumps", "correct", "manifest.json")), kept)

    def test_ids_that_sanitise_alike_keep_a_folder_each(self):
        # "a b" and "a/b" both become "a_b", and ids past 200 characters were cut to one name: a later test removed
        # an earlier failing test's report and dump while its message still pointed there.
        reports = os.path.join(self.folder, "reports")
        long = "x" * 230
        result = run_pytest(self.folder, COLLIDING.replace("LONG", long), "--lossverify-report", reports)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        folders = sorted(os.listdir(reports))
        self.assertEqual(len(folders), 4, folders)
        for folder in folders:
            self.assertTrue(os.path.isfile(os.path.join(reports, folder, "smoothing-megatron", "report.json")), folder)
            self.assertIn(os.path.join(reports, folder), result.stdout)  # each failure names its own folder

    def test_a_layout_given_twice_is_refused_not_renamed(self):
        from lossverify.errors import UsageError
        from lossverify.pytest_plugin import cases

        with self.assertRaisesRegex(UsageError, "smoothing-pytorch@tp2-cp1-dp1-ga1 twice"):
            cases(layouts=[dict(tp=2), "tp2-cp1-dp1-ga1"], names=["smoothing-pytorch"])
        self.assertEqual(len(cases(layouts=[dict(tp=2), "tp1-cp1-dp1-ga1"], names=["smoothing-pytorch"]).args[1]), 2)

    def test_a_report_folder_that_cannot_be_one_is_a_usage_error(self):
        a_file = os.path.join(self.folder, "a-file")
        open(a_file, "w").close()
        for folder, message in [(a_file, "exists and is not a folder"),
                                (os.path.join(a_file, "reports"), "cannot create it")]:
            with self.subTest(folder):
                result = run_pytest(self.folder, THREE_LINES, "--lossverify-report", folder)
                self.assertEqual(result.returncode, 4, result.stdout + result.stderr)
                self.assertIn(f"--lossverify-report {folder}: {message}", result.stderr)


if __name__ == "__main__":
    unittest.main()
