#!/usr/bin/env python3
"""Judges a framework's loss function, as shipped, on lossverify's cases (docs/frameworks.md).

usage: python3 scripts/frameworks/judge.py FRAMEWORK CHECKOUT [--only CASE] [--function F] [--device cpu|cuda]
                                           [--backend gloo|nccl] [--json OUT.json] [--markdown OUT.md]
                                           [--keep DIR] [--commit C] [--case FILE --function F]
                                           [--explain SAVED.json]
FRAMEWORK names a module of lv_frameworks (megatron, ...); CHECKOUT is the framework's source tree, imported
as its users import it. Each run prints one line; the JSON holds every run's verdict, failing checks, margins
and warnings, and the Markdown the table rows of docs/frameworks.md. --explain re-attributes the failing runs of
a saved judgement (one made on the GPU machine) with this machine's lossverify, running no framework code.
Exit 0 when every run finished (whatever the verdicts), 2 on a usage error.
"""
import argparse
import importlib
import json
import math
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _environment(checkout):
    """Rank processes import the adapters and the framework by name: the paths travel in the environment
    (set before the harness starts its fork server)."""
    paths = [os.path.join(ROOT, "python"), HERE]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    os.environ["LV_FRAMEWORK_CHECKOUT"] = os.path.abspath(checkout)
    sys.path[:0] = paths


def _shipped_cases():
    folder = os.path.join(ROOT, "cases")
    return {name[:-5]: json.load(open(os.path.join(folder, name))) for name in os.listdir(folder) if name.endswith(".json")}


def _case_path(run):
    """A shipped case's file, or the case file a --case run names."""
    return run.case if run.case.endswith(".json") else os.path.join(ROOT, "cases", run.case + ".json")


def _file_layout(path):
    """A case file's own layout, as a run's layout."""
    try:
        layout = json.load(open(path)).get("layout", {})
    except (OSError, ValueError) as e:
        raise SystemExit(f"judge.py: {path}: {e}")
    return {k: layout.get(k, 1) for k in ("tp", "cp", "dp", "ga")}


def _command(framework, run):
    if run.case.endswith(".json"):
        function = run.function.rpartition(":")[2]
        return f"python3 scripts/frameworks/judge.py {framework} CHECKOUT --function {function} --case {run.case}"
    only = f"{run.case}@{_key(run)}"
    return f"python3 scripts/frameworks/judge.py {framework} CHECKOUT --only '{only}'"


def _key(run):
    """The run's name for --only: its layout label, or "sweep"."""
    return "sweep" if run.sweep else run.label


def _judge(run, device, keep, backend=None):
    import lossverify.torch as lvt
    case = _case_path(run)
    dump = os.path.join(keep, f"{os.path.basename(run.case)}-{_key(run)}") if keep else None
    start = time.time()
    try:
        if run.sweep:
            report = lvt.sweep(run.function, case, layouts=run.sweep, device=device, set=run.overrides, keep_dump=dump,
                               backend=backend)
        else:
            report = lvt.check(run.function, case, device=device, set=run.overrides, keep_dump=dump, backend=backend,
                               **run.layout)
    except Exception as e:  # the function raised, or the harness refused: recorded, not fatal to the others
        lines = [line for line in str(e).splitlines() if line.strip()]
        what = lines[0] if lines else ""
        if len(lines) > 1:  # a rank's failure: its traceback follows; its last line says what was raised
            what += f" ... {lines[-1].strip()}"
        return {"verdict": "error", "error": f"{type(e).__name__}: {what}", "detail": str(e)[-4000:],
                "seconds": round(time.time() - start, 2)}
    return {"verdict": report.verdict, "failing_checks": report.failing_checks,
            "margins": {k: v for k, v in report.margins.items() if v is not None},
            "summary": report.summary(), "warnings": report.warnings[:2], "seconds": round(time.time() - start, 2)}


def _lossverify_run(run, bug):
    """lossverify's own kernel with a catalogued bug on the same case, layout and overrides: its report."""
    import subprocess
    import tempfile
    from lossverify import tool
    with tempfile.TemporaryDirectory() as work:
        report = os.path.join(work, "report.json")
        command = [tool.find_binary(None), "run", _case_path(run), "--impl", bug,
                   "--quiet", "--report", report]
        for key, value in run.layout.items():
            command += ["--set", f"layout.{key}={value}"]
        for key, value in run.overrides.items():
            command += ["--set", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
        if subprocess.run(command, capture_output=True).returncode not in (0, 1):
            return None
        return json.load(open(report))["runs"][0]


def _check_margins(check):
    """A failing check's margin and those of its parts (a loss's per-token and logged parts, each logged
    statistic): a framework that reports only some parts (its logged loss, not per-token losses) is matched on
    the part it reports."""
    margins = [float(check["margin"])]
    for part in check.get("metrics", {}).values():
        if isinstance(part, dict) and part.get("margin") is not None and part.get("compared", 1):
            margins.append(float(part["margin"]))
    return margins


def _explain(run, row, bugs):
    """The catalogued bugs that account for the failure: each failing check is attributed to a bug whose
    lossverify kernel, on the same inputs, fails that check with the same margin (within 1%, or both
    infinite; or with the margin of one of the check's parts, _check_margins). Returns "bug" when one bug
    accounts for every failing check ("bug or other bug" when several do, in EXPLANATIONS' order: the margins
    alone cannot tell them apart), else "bug + other bug" when every failing check is attributed, else None."""
    margins_of = {}
    for bug in bugs:
        theirs = _lossverify_run(run, bug)
        if theirs is not None:  # "Infinity" in the JSON
            margins_of[bug] = {c["name"]: _check_margins(c) for c in theirs["checks"] if c["verdict"] == "fail"}
    mine_of = {check: row["margins"].get(check) for check in row["failing_checks"]}

    def matches(margins, check):
        mine = mine_of[check]
        return check in margins and mine is not None and any(
            mine == m or (math.isfinite(m) and abs(mine - m) <= 0.01 * abs(m)) for m in margins[check])

    # One bug that accounts for every failing check is the explanation, before any combination.
    whole = [bug for bug, margins in margins_of.items() if row["failing_checks"] and
             all(matches(margins, check) for check in row["failing_checks"])]
    if whole:
        return " or ".join(whole)
    used = []
    for check in row["failing_checks"]:
        match = next((bug for bug, margins in margins_of.items() if matches(margins, check)), None)
        if match is None:
            return None
        if match not in used:
            used.append(match)
    return " + ".join(used) if used else None


def _markdown(framework, commit, rows):
    lines = []
    for r in rows:
        verdict = r["verdict"].upper() if r["verdict"] != "pass" else "pass"
        margins = r.get("margins", {})
        if r["verdict"] == "fail":
            detail = ", ".join(f"{c} {margins.get(c, float('nan')):.3g}" for c in r["failing_checks"])
            if r.get("explained_by"):
                words = r["explained_by"].split(" ")
                detail += "; = " + " ".join(w if w in ("+", "or") else f"`{w}`" for w in words)
        elif r["verdict"] == "pass":
            detail = f"largest margin {max(margins.values(), default=0.0):.3g}"
        else:
            detail = r.get("error", "")
        sets = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in r["overrides"].items())
        function = r["function"].rpartition(":")[2]
        lines.append(f"| {framework} {commit} | `{function}` | {r['case']}{' (' + sets + ')' if sets else ''} | "
                     f"{r['layout']} | {verdict} | {detail} |")
    return "\n".join(lines) + "\n"


def _saved_run(row):
    """The Run a saved row describes (a single layout)."""
    from lv_frameworks import Run
    layout = {k: int(v) for k, v in re.findall(r"(tp|cp|dp|ga)(\d+)", row["layout"])}
    case = os.path.join(ROOT, row["case"]) if row["case"].endswith(".json") else row["case"]
    return Run(row["function"], case, layout, row["overrides"], row.get("note", ""))


def _reexplain(args, adapter, described):
    try:
        with open(args.explain) as f:
            saved = json.load(f)
        rows = saved["runs"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"judge.py: --explain {args.explain}: not a saved judgement (its --json): {e!r}", file=sys.stderr)
        return 2
    for row in rows:
        if row["verdict"] == "fail" and not row["layout"].startswith("sweep"):
            row["explained_by"] = _explain(_saved_run(row), row, getattr(adapter, "EXPLANATIONS", []))
            print(f"  {row['case']:<34} {row['layout']:<22} fail {'= ' + row['explained_by'] if row['explained_by'] else ''}"
                  f" {row.get('summary', '')[:120]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(saved, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(_markdown(adapter.NAME, saved.get("commit", described["commit"]), saved["runs"]))
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("framework")
    parser.add_argument("checkout")
    parser.add_argument("--only", action="append", default=[], help="CASE or CASE@LAYOUT (repeatable)")
    parser.add_argument("--function", action="append", default=[], help="only the runs of this adapter function")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backend", choices=["gloo", "nccl"],
                        help="process groups (default: gloo on cpu, nccl on cuda; gloo on cuda: ranks share a GPU)")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--keep", help="keep every run's inputs, dump and report under this folder")
    parser.add_argument("--commit", help="the commit judged, when CHECKOUT is an exported copy rather than a git tree")
    parser.add_argument("--explain", metavar="JSON",
                        help="re-attribute the failing runs of a saved judgement (say, one made on the GPU machine) "
                             "with this machine's lossverify and the adapter's catalogue entries; no run is repeated")
    parser.add_argument("--case", action="append", default=[],
                        help="run the --function functions on this case file, at its own layout (repeatable)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.checkout):
        parser.error(f"{args.checkout}: not a folder")
    _environment(args.checkout)
    try:
        adapter = importlib.import_module(f"lv_frameworks.{args.framework}")
    except ModuleNotFoundError:
        parser.error(f"no adapter lv_frameworks/{args.framework}.py")
    from lv_frameworks import Run  # importable once _environment has set the path
    described = adapter.describe(args.checkout)
    if args.commit:
        described["commit"] = args.commit
    if args.explain:
        return _reexplain(args, adapter, described)
    runs = adapter.runs(_shipped_cases())
    if args.case:
        if not args.function:
            parser.error("--case needs --function (which of the adapter's functions to run)")
        functions = {r.function.rpartition(":")[2]: r.function for r in runs}
        unknown = [f for f in args.function if f not in functions]
        if unknown:
            parser.error(f"no function {unknown[0]} among the adapter's runs ({', '.join(sorted(functions))})")
        runs = [Run(functions[f], os.path.abspath(path), _file_layout(path)) for f in args.function
                for path in args.case]
    if args.only:
        runs = [r for r in runs if r.case in args.only or f"{r.case}@{_key(r)}" in args.only]
    if args.function and not args.case:
        runs = [r for r in runs if r.function.rpartition(":")[2] in args.function]
    print(f"{adapter.NAME} at {described['commit']} ({described['source']}): {len(runs)} runs on {args.device}"
          f"{' over ' + args.backend if args.backend else ''}")
    rows = []
    for run in runs:
        result = _judge(run, args.device, args.keep, args.backend)
        row = {"case": os.path.relpath(run.case, ROOT) if run.case.endswith(".json") else run.case, "layout": run.label + (": " + ", ".join(run.sweep) if run.sweep else ""),
               "overrides": run.overrides, "note": run.note,
               "function": run.function, "command": _command(args.framework, run), **result}
        if row["verdict"] == "fail" and not run.sweep:
            row["explained_by"] = _explain(run, row, getattr(adapter, "EXPLANATIONS", []))
        rows.append(row)
        explained = f" = {row['explained_by']}" if row.get("explained_by") else ""
        print(f"  {row['case']:<34} {run.label:<22} {row['verdict']:<5}{explained} "
              f"{row.get('summary', row.get('error', ''))[:140]}  ({row['seconds']} s)", flush=True)
        if args.json:  # after every run: a long judgement that is cut short keeps what it did
            with open(args.json, "w") as f:
                json.dump({"framework": adapter.NAME, **described, "device": args.device, "backend": args.backend,
                           "runs": rows}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(_markdown(adapter.NAME, described["commit"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
