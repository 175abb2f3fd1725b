"""pytest plugin: a loss function checked against lossverify's reference from a test, in one line.

    def test_my_loss(lossverify_check):
        lossverify_check(my_loss, "smoothing-megatron", tp=4)

pytest loads it through the package's `pytest11` entry point once lossverify is pip-installed; from a checkout,
without installing, `PYTHONPATH=python pytest -p lossverify.pytest_plugin`. It adds:

- the fixture `lossverify_check`: `check(fn, case, tp=..., cp=..., dp=..., ga=..., **options)` runs
  `lossverify.torch.check` (case: a shipped case's name, a case file's path, or a `cases(...)` parameter;
  options as `check`'s) and fails the test with the check table when the verdict is fail; returns the Report;
- `cases(kind="cross_entropy", layouts=None, names=None)`: `pytest.mark.parametrize` of the argument
  `lossverify_case` over the shipped cases x layouts, with ids "CASE@tp2-cp1-dp1-ga1";
- `--lossverify-report DIR`: every check made through the fixture keeps its inputs, dump and JSON report in
  DIR/<test id>/<case>/ (dump/ and report.json), a folder replaced when the test runs again: CI artifacts.

Importing it needs no torch: pytest loads it in every session of an environment where lossverify is installed.
"""

import hashlib
import os
import re
import shutil
from typing import NamedTuple

import pytest

from lossverify import shipped
from lossverify.errors import UsageError
from lossverify.layout import parse_layout

__all__ = ["Case", "cases", "lossverify_check"]


class Case(NamedTuple):
    """One parameter of `cases(...)`: a shipped case's name, its file and the whole layout to run it at."""

    name: str
    path: str
    layout: dict

    @property
    def id(self):
        return f"{self.name}@{parse_layout(self.layout).label}"


def cases(kind="cross_entropy", layouts=None, names=None, head=False):
    """`pytest.mark.parametrize("lossverify_case", ...)` over the shipped cases of a loss kind ("cross_entropy",
    "kd", "policy"; None: every kind) x layouts. layouts: dicts such as {"tp": 2}, whose missing counts are
    the case's own, or "tp2-cp1-dp1-ga1" strings (missing counts 1); default: each case's own layout.
    names: only these cases (a name that is not a shipped case of the kind is an error). head: the cases with an
    LM head in front of the kind instead (their function takes h, W and b)."""
    selected = shipped.case_names(kind, head=head)
    if names is not None:
        unknown = sorted(set(names) - set(selected))
        if unknown:
            raise UsageError(f"cases(kind={kind!r}): no shipped case {', '.join(unknown)} (there are: "
                             f"{', '.join(selected)})")
        selected = list(names)
    parameters = []
    for name in selected:
        own = {"tp": 1, "cp": 1, "dp": 1, "ga": 1, **shipped.read_case(name).get("layout", {})}
        for layout in layouts or [{}]:
            whole = {**own, **layout} if isinstance(layout, dict) else parse_layout(layout).as_dict()
            case = Case(name, shipped.case_file(name), parse_layout(whole).as_dict())
            if any(p.id == case.id for p in parameters):  # pytest would name the two ...ga10 and ...ga11
                raise UsageError(f"cases(): {case.id} twice (layouts {layouts!r} give {name} the same layout "
                                 "more than once)")
            parameters.append(case)
    return pytest.mark.parametrize("lossverify_case", parameters, ids=[c.id for c in parameters])


def pytest_addoption(parser):
    parser.getgroup("lossverify").addoption(
        "--lossverify-report", metavar="DIR", default=None,
        help="keep every lossverify_check's inputs, dump and JSON report under DIR/<test id>/<case>/")


def pytest_configure(config):
    """A --lossverify-report that cannot hold reports is a usage error before any test runs."""
    folder = config.getoption("lossverify_report")
    if not folder:
        return
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise pytest.UsageError(f"--lossverify-report {folder}: exists and is not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise pytest.UsageError(f"--lossverify-report {folder}: cannot create it: {e.strerror or e}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise pytest.UsageError(f"--lossverify-report {folder}: cannot be written")
    config.option.lossverify_report = os.path.abspath(folder)  # tests may change the working folder


@pytest.fixture
def lossverify_check(request):
    """`check(fn, case, **options)`: lossverify.torch.check, failing the test with the check table when a check
    fails; returns the Report."""
    root = request.config.getoption("lossverify_report")
    test_folder = os.path.join(root, _file_name(request.node.nodeid)) if root else None
    if test_folder:
        shutil.rmtree(test_folder, ignore_errors=True)  # an earlier session's
    used = set()

    def check(fn, case, **options):
        from lossverify.torch import harness  # torch loads only once a check runs

        if isinstance(case, Case):
            name, path, options = case.name, case.path, {**case.layout, **options}
        else:
            path = shipped.case_file(case)
            name = os.path.splitext(os.path.basename(path))[0]
        where = ""
        if test_folder:
            folder = _new_folder(test_folder, name, used)
            options.setdefault("keep_dump", os.path.join(folder, "dump"))
            options.setdefault("report", os.path.join(folder, "report.json"))
            where = f"\nreport and dump kept in {folder}"
        report = harness.check(fn, path, **options)
        if not report.passed:
            pytest.fail(report.table() + where, pytrace=False)
        return report

    return check


def _file_name(node_id):
    """A test id as one folder name of its own: test_x.py::test_loss[smoothing-megatron@tp4-cp1-dp1-ga1] ->
    test_x.py_test_loss_smoothing-megatron@tp4-cp1-dp1-ga1. Where the id had to be changed beyond that (other
    characters, more than 180 of them), a hash of the whole id follows, so that two tests never share a folder
    (and one never removes the other's report and dump)."""
    plain = re.sub(r"::|\[|\]", "_", node_id).rstrip("_")
    name = re.sub(r"[^A-Za-z0-9._@=+-]+", "_", node_id).strip("_.") or "test"
    if name == plain and len(name) <= 180:
        return name
    return name[:180] + "-" + hashlib.sha1(node_id.encode("utf-8")).hexdigest()[:12]


def _new_folder(parent, name, used):
    """parent/name, parent/name-2, ...: one folder per check of the test, created."""
    folder, k = name, 2
    while folder in used:
        folder, k = f"{name}-{k}", k + 1
    used.add(folder)
    path = os.path.join(parent, _file_name(folder))
    os.makedirs(path)
    return path
