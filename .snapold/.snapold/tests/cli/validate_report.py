"""Validates lossverify reports against schema/report.schema.json and checks report invariants.

usage: validate_report.py SCHEMA REPORT [REPORT ...]
"""
import json
import sys

import jsonschema


def main() -> int:
    schema_path, reports = sys.argv[1], sys.argv[2:]
    with open(schema_path) as f:
        schema = json.load(f)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    failures = 0
    for path in reports:
        with open(path) as f:
            # parse_constant rejects NaN/Infinity literals: the report must be strict JSON
            report = json.load(f, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"bare {c}")))
        errors = sorted(validator.iter_errors(report), key=lambda e: list(e.path))
        for e in errors:
            print(f"{path}: {'/'.join(map(str, e.path))}: {e.message}")
        failures += len(errors)
        if errors:
            continue
        if report["command"] == "gate":
            g = report["gate"]
            ok = (report["verdict"] == "pass") == (g["mismatches"] == 0 and g["false_alarms"] == 0 and not g["uncaught_bugs"])
            if not ok:
                print(f"{path}: gate verdict inconsistent with its counts")
                failures += 1
            print(f"{path}: gate report, {len(g['cells'])} cells, {'ok' if failures == 0 else 'INVALID'}")
            continue
        # exit code and verdict agree with the runs (and sweeps)
        any_fail = any(run["verdict"] == "fail" for run in report["runs"])
        any_fail = any_fail or any(s["verdict"] == "fail" for s in report.get("sweeps", []))
        if (report["verdict"] == "fail") != any_fail or report["exit_code"] != (1 if any_fail else 0):
            print(f"{path}: verdict/exit_code inconsistent with runs")
            failures += 1
        for run in report["runs"]:
            for check in run["checks"]:
                if check["verdict"] == "fail" and check["margin"] != "Infinity" and check["margin"] <= 1:
                    print(f"{path}: {run['case']['name']}: {check['name']} fails with margin <= 1")
                    failures += 1
        print(f"{path}: {len(report['runs'])} runs, {'ok' if failures == 0 else 'INVALID'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
