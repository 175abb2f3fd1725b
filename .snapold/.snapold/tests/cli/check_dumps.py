"""Runs `lossverify check-dump` on dump fixtures and compares each outcome with its expected.json.

usage: check_dumps.py LOSSVERIFY REPORT_DIR FIXTURE_DIR [FIXTURE_DIR ...]
  FIXTURE_DIR   a folder with manifest.json and expected.json ({"exit_code": 0|1, "failing_checks": [...]}),
                or a folder of such folders (every subfolder with a manifest.json is checked)

A fixture passes when the exit code matches, the report's failing checks are exactly the expected ones, every
failing check fails with a margin above 1, and no check that passes or is not applicable is expected to fail.
Prints one line per fixture and a closing "N passed, M failed".
"""
import json
import os
import subprocess
import sys


def fixtures(path):
    if os.path.exists(os.path.join(path, "manifest.json")):
        return [path]
    return sorted(os.path.join(path, d) for d in os.listdir(path)
                  if os.path.exists(os.path.join(path, d, "manifest.json")))


def check(lossverify, report_dir, folder):
    name = os.path.basename(os.path.normpath(folder))
    with open(os.path.join(folder, "expected.json")) as f:
        expected = json.load(f)
    report = os.path.join(report_dir, name + ".json")
    if os.path.exists(report):
        os.remove(report)
    run = subprocess.run([lossverify, "check-dump", "--manifest", os.path.join(folder, "manifest.json"),
                          "--report", report, "--threads", "2"], capture_output=True, text=True, timeout=300)
    problems = []
    if run.returncode != expected["exit_code"]:
        problems.append(f"exit code {run.returncode}, expected {expected['exit_code']}")
    failing = []
    if os.path.exists(report):
        with open(report) as f:
            doc = json.load(f)
        if doc["command"] != "check-dump" or doc["exit_code"] != run.returncode:
            problems.append("report command/exit_code inconsistent")
        for c in doc["runs"][0]["checks"]:
            if c["verdict"] == "fail":
                failing.append(c["name"])
                if c["margin"] != "Infinity" and c["margin"] <= 1:
                    problems.append(f"{c['name']} fails with margin {c['margin']} <= 1")
    elif run.returncode in (0, 1):
        problems.append("no report written")
    if sorted(failing) != sorted(expected["failing_checks"]):
        problems.append(f"failing checks {sorted(failing)}, expected {sorted(expected['failing_checks'])}")
    status = "ok" if not problems else "FAIL: " + "; ".join(problems)
    print(f"{name}: exit {run.returncode}, failing {sorted(failing) or '-'}: {status}")
    if problems:
        print(run.stdout + run.stderr)
    return not problems


def main():
    if len(sys.argv) < 4:
        print(__doc__)
        return 2
    lossverify, report_dir = sys.argv[1], sys.argv[2]
    os.makedirs(report_dir, exist_ok=True)
    folders = [f for path in sys.argv[3:] for f in fixtures(path)]
    if not folders:
        print("no fixtures found in " + " ".join(sys.argv[3:]))
        return 1
    passed = sum(check(lossverify, report_dir, f) for f in folders)
    print(f"{passed} passed, {len(folders) - passed} failed")
    return 0 if passed == len(folders) else 1


if __name__ == "__main__":
    sys.exit(main())
