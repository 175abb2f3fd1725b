"""Runs every shipped case with every implementation and compares the outcome with golden/outcomes.json.

usage: check_golden.py LOSSVERIFY GOLDEN CASES_DIR [--write]
--write records the current outcomes instead (review the diff before committing it).
"""
import json
import os
import subprocess
import sys
import tempfile


def outcome(binary: str, case: str, impl: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "r.json")
        proc = subprocess.run([binary, "run", case, "--impl", impl, "--quiet", "--threads", "2", "--report", report],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode not in (0, 1):
            raise RuntimeError(f"{case} --impl {impl}: exit {proc.returncode}: {proc.stderr}")
        with open(report) as f:
            run = json.load(f)["runs"][0]
    failing = sorted(c["name"] for c in run["checks"] if c["verdict"] == "fail")
    return {"verdict": run["verdict"], "failing_checks": failing}


def main() -> int:
    binary, golden_path, cases_dir = sys.argv[1:4]
    write = "--write" in sys.argv
    listing = json.loads(subprocess.run([binary, "list", "--json"], capture_output=True, text=True,
                                        check=True).stdout)
    impls = [i["name"] for i in listing["implementations"]]
    cases = sorted(f for f in os.listdir(cases_dir) if f.endswith(".json"))
    actual = {c[:-5]: {i: outcome(binary, os.path.join(cases_dir, c), i) for i in impls} for c in cases}
    if write:
        with open(golden_path, "w") as f:
            json.dump({"format": "lossverify.golden/1", "outcomes": actual}, f, indent=2, sort_keys=True)
            f.write("\n")
        return 0
    with open(golden_path) as f:
        golden = json.load(f)["outcomes"]
    mismatches = 0
    for case, by_impl in actual.items():
        for impl, got in by_impl.items():
            want = golden.get(case, {}).get(impl)
            if want != got:
                print(f"MISMATCH {case} --impl {impl}: golden {want}, got {got}")
                mismatches += 1
    caught = {i: any(actual[c][i]["verdict"] == "fail" for c in actual) for i in impls if i != "correct"}
    for impl, was_caught in caught.items():
        if not was_caught:
            print(f"NOT CAUGHT: {impl} passes every shipped case")
            mismatches += 1
    false_alarms = [c for c in actual if actual[c]["correct"]["verdict"] != "pass"]
    for c in false_alarms:
        print(f"FALSE ALARM: correct implementation fails {c}")
    total = len(actual) * len(impls)
    print(f"{total - mismatches} passed, {mismatches + len(false_alarms)} failed")
    return 1 if mismatches or false_alarms else 0


if __name__ == "__main__":
    sys.exit(main())
