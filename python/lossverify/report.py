"""lossverify's JSON report (`lossverify.report/1`) as Python objects, and the check table printed from it.

The report is the single source of truth: `lossverify.torch.check` returns what `lossverify check-dump`
wrote, parsed here, so a pytest failure shows exactly what the command line would. Non-finite numbers,
which strict JSON cannot spell, arrive as the strings "NaN", "Infinity" and "-Infinity" and become floats.
"""

import json
import math
import os

__all__ = ["Check", "Run", "Report", "load_report"]

_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_NUMERIC_KEYS = {"margin", "expected", "got", "tolerance", "max_abs_error", "max_rel_error", "atol", "rtol",
                 "max_ulp", "value", "expected_valid_tokens", "low", "high", "float32", "bf16", "fp16"}


def _decode(value, key=None):
    """JSON as read, with the non-finite strings of numeric fields turned into floats."""
    if isinstance(value, dict):
        return {k: _decode(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, key) for v in value]
    if isinstance(value, str) and value in _NON_FINITE and (key in _NUMERIC_KEYS or key is None):
        return _NON_FINITE[value]
    return value


def _short(x, digits=6):
    """A number as the lossverify table prints it (6 significant digits; margins 3)."""
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}g}"


class Check:
    """One named check of one run: verdict (pass | fail | not_applicable), margin (error / tolerance of the
    worst element: < 1 passes), the worst element (token, column, rank, expected, got, and for dumps
    the tensor and row) and the control band: `control` is None, or {"margins": {"float32": m, "bf16": m},
    "low", "high", "reading": "within" | "above" | "far_above"} (docs/checks.md)."""

    def __init__(self, data, run_label=""):
        self.data = data
        self.name = data.get("name", "?")
        self.verdict = data.get("verdict", "?")
        margin = data.get("margin")
        self.margin = float(margin) if isinstance(margin, (int, float)) else None
        self.worst = data.get("worst")
        self.tolerance = data.get("tolerance")
        self.metrics = data.get("metrics", {})
        self.summary = data.get("summary", "")
        self.control = data.get("control")
        self.run_label = run_label

    @property
    def control_margins(self):
        """{control name: margin} of the control band ({} without one)."""
        return dict(self.control["margins"]) if self.control else {}

    def control_text(self, order=("float32", "bf16", "fp16")):
        """The table's control cell, the controls in `order`: "0.0213 / 0.48", then "above" or "far above"
        where the margin reads so."""
        if not self.control:
            return "-"
        margins = self.control["margins"]
        text = " / ".join(_short(margins[name], 3) for name in order if name in margins)
        reading = self.control.get("reading")
        return text if reading == "within" else f"{text} {reading.replace('_', ' ')}"

    @property
    def passed(self):
        return self.verdict != "fail"

    def worst_text(self, short_paths=False):
        """(token, column, rank: expected -> got) and where it sits in the dump (file names only with
        short_paths, for dumps that no longer exist)."""
        w = self.worst
        if not w or self.verdict == "pass" and self.margin == 0:
            return "-"
        text = (f"({_short(w.get('token'))}, {_short(w.get('column'))}, {_short(w.get('rank'))}: "
                f"{_short(w.get('expected'))} -> {_short(w.get('got'))})")
        if w.get("tensor"):
            tensor = os.path.basename(w["tensor"]) if short_paths else w["tensor"]
            text += f" mb {_short(w.get('micro_batch'))} row {_short(w.get('row'))} of {tensor}"
        return text

    def __repr__(self):
        return f"Check({self.name!r}, {self.verdict}, margin={_short(self.margin)})"


class Run:
    """One run of a report: a case (or dump) at one layout, with its checks by name."""

    def __init__(self, data):
        self.data = data
        case = data.get("case", {})
        self.case_name = case.get("name", "?")
        self.layout = {k: data.get("layout", {}).get(k, 1) for k in ("tp", "cp", "dp", "ga")}
        self.sp = bool(data.get("layout", {}).get("sp", False))
        self.label = "tp{tp}{sp}-cp{cp}-dp{dp}-ga{ga}".format(**self.layout, sp="-sp" if self.sp else "")
        self.implementation = data.get("implementation", {}).get("name", "?")
        self.verdict = data.get("verdict", "?")
        self.checks = {c["name"]: Check(c, self.label) for c in data.get("checks", [])}
        control = data.get("control") or {}
        self.controls = [c["name"] for c in control.get("controls", [])]
        self.notes = list(control.get("notes", []))

    @property
    def failing_checks(self):
        return sorted(name for name, c in self.checks.items() if c.verdict == "fail")


class Report:
    """A lossverify report. `verdict` is "pass" or "fail"; `checks` maps each check name to its worst
    instance over the runs (a sweep has one run per layout, plus `invariance`); `warnings` holds what the
    Python harness noticed on the way (an implementation that modified its inputs in place, ...)."""

    def __init__(self, data, warnings=(), dump_dir=None, path=None, dump_kept=True):
        if not isinstance(data, dict) or data.get("schema_version") != "lossverify.report/1":
            raise ValueError(f"{path or 'report'}: not a lossverify.report/1 document")
        self.raw = data
        self.data = _decode(data)
        self.path = path
        self.verdict = self.data.get("verdict")
        self.exit_code = self.data.get("exit_code")
        self.command = self.data.get("command")
        self.runs = [Run(r) for r in self.data.get("runs", [])]
        self.invariance = None
        for sweep in self.data.get("sweeps", []):
            if sweep.get("invariance"):
                self.invariance = Check(sweep["invariance"], "sweep")
        self.warnings = list(warnings)
        self.dump_dir = dump_dir
        self.dump_kept = dump_kept  # False: the dump was temporary, the table shows file names only

    @property
    def passed(self):
        return self.verdict == "pass"

    @property
    def checks(self):
        """{name: Check}: each check's failing instance with the largest margin, else its largest margin."""
        worst = {}
        candidates = [c for run in self.runs for c in run.checks.values()]
        if self.invariance is not None:
            candidates.append(self.invariance)
        for c in candidates:
            best = worst.get(c.name)
            if best is None or _rank_of(c) > _rank_of(best):
                worst[c.name] = c
        return worst

    def check(self, name):
        """The named check (see `checks`); KeyError naming the checks there are."""
        checks = self.checks
        if name not in checks:
            raise KeyError(f"no check {name!r} in the report (checks: {', '.join(checks)})")
        return checks[name]

    @property
    def failing_checks(self):
        """Sorted names of the checks that fail in any run (or the sweep's invariance)."""
        return sorted(name for name, c in self.checks.items() if c.verdict == "fail")

    @property
    def margins(self):
        """{check name: worst margin}."""
        return {name: c.margin for name, c in self.checks.items()}

    def table(self, max_warnings=4):
        """The check table, as lossverify prints it. A single run gets every check with its worst element;
        several runs (a sweep) get one line per layout, the failing checks of failing layouts, then the
        invariance check. At most `max_warnings` warnings are listed."""
        lines = []
        short = not self.dump_kept
        if len(self.runs) == 1:
            run = self.runs[0]
            lines.append(f"{run.case_name}  [{run.label}]  impl {run.implementation}")
            lines += self._check_lines(run.checks.values(), short, run.controls)
            lines += [f"  note: {note}" for note in run.notes]
        elif self.runs:
            run = self.runs[0]
            lines.append(f"{run.case_name}: {len(self.runs)} layouts, impl {run.implementation}")
            for run in self.runs:
                worst = max((c.margin for c in run.checks.values() if c.margin is not None), default=0.0)
                lines.append(f"  {run.label:<20} {run.verdict:<5} worst margin {_short(worst, 3)}")
                if run.verdict == "fail":
                    failing = [c for c in run.checks.values() if c.verdict == "fail"]
                    lines += ["  " + line for line in self._check_lines(failing, short, run.controls)[1:]]
                    lines += [f"    note: {note}" for note in run.notes]
        if self.invariance is not None:
            c = self.invariance
            lines.append(f"  invariance: {c.verdict}, margin {_short(c.margin, 3)} ({c.summary})")
        for w in self.warnings[:max_warnings]:
            lines.append(f"  warning: {w}")
        if len(self.warnings) > max_warnings:
            lines.append(f"  ... and {len(self.warnings) - max_warnings} more warning(s) (Report.warnings)")
        lines.append(f"  verdict: {self.verdict.upper() if self.verdict == 'fail' else self.verdict}")
        return "\n".join(lines)

    @staticmethod
    def _check_lines(checks, short_paths=False, controls=()):
        """The table's header and one line per check; with controls, the control column after the margin."""
        checks = list(checks)
        header = ("control " + " / ".join("f32" if name == "float32" else name for name in controls)) if controls else ""
        width = max([len(header)] + [len(c.control_text(controls)) for c in checks]) + 1 if controls else 0
        control_header = f"{header:<{width}}" if controls else ""
        lines = [f"  {'check':<15} {'verdict':<15} {'margin':<10} {control_header}"
                 "worst (token, column, rank: expected -> got) where in the dump"]
        for c in checks:
            verdict = c.verdict.upper() if c.verdict == "fail" else c.verdict
            cell = f"{c.control_text(controls):<{width}}" if controls else ""
            lines.append(f"  {c.name:<15} {verdict:<15} {_short(c.margin, 3):<10} {cell}{c.worst_text(short_paths)}")
        return lines

    def summary(self):
        """One line: verdict and, when it fails, each failing check with its margin and worst element."""
        if self.passed:
            worst = max((c.margin for c in self.checks.values() if c.margin is not None), default=0.0)
            return f"pass (largest margin {_short(worst)})"
        parts = [f"{c.name} (margin {_short(c.margin, 3)}, worst {c.worst_text(not self.dump_kept)})"
                 for c in self.checks.values() if c.verdict == "fail"]
        return "FAIL: " + "; ".join(parts)

    def assert_pass(self):
        """Raise AssertionError with the check table unless every check passes (for pytest/unittest)."""
        if not self.passed:
            raise AssertionError("lossverify: " + self.summary() + "\n" + self.table())
        return self

    raise_for_failure = assert_pass

    def __str__(self):
        return self.table()

    def __repr__(self):
        return f"Report({self.verdict}, failing={self.failing_checks})"


def _rank_of(check):
    """Order for picking a check's representative: failing first, then by margin (NaN counts as worst)."""
    margin = check.margin
    if margin is None:
        margin = -1.0
    elif math.isnan(margin):
        margin = math.inf
    return (check.verdict == "fail", margin)


def load_report(path, warnings=(), dump_dir=None, dump_kept=True):
    """Read a report file written by lossverify --report."""
    with open(path, encoding="utf-8") as f:
        return Report(json.load(f), warnings=warnings, dump_dir=dump_dir, path=path, dump_kept=dump_kept)
