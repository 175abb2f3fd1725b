"""The cases shipped with lossverify, by name.

An installed package carries them as package data, lossverify/_cases/*.json (copied there by setup.py's build
step from the project's cases/); a checkout used through PYTHONPATH=python reads the project's cases/ beside
python/. The package's copy comes first: it is the one that matches the packaged executable.
"""

import glob
import json
import os

from lossverify.inputs import head_not_run_because
from lossverify.errors import UsageError
from lossverify.kinds import known_kinds

__all__ = ["cases_dir", "case_names", "case_file", "read_case"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGED = os.path.join(_HERE, "_cases")
_CHECKOUT = os.path.normpath(os.path.join(_HERE, "..", "..", "cases"))


def cases_dir():
    """The folder of the shipped cases; UsageError when neither the package nor a checkout has one."""
    for folder in (_PACKAGED, _CHECKOUT):
        if glob.glob(os.path.join(folder, "*.json")):
            return folder
    raise UsageError(f"no shipped cases: neither {_PACKAGED} (an installed package) nor {_CHECKOUT} (a checkout) "
                     "holds any")


def read_case(name):
    """The case file's JSON object."""
    with open(case_file(name), encoding="utf-8") as f:
        return json.load(f)


def case_names(kind=None, head=False):
    """The shipped cases' names, sorted; kind: only cases of that loss kind ("cross_entropy", "kd", "policy"); head:
    the cases with an LM head in front of their kind instead of those without (a head case's function takes h, W
    and b, docs/pytorch.md, so the two never mix), those the package's head runs (lossverify.inputs.head_not_run_because)."""
    if kind is not None and kind not in known_kinds():
        raise UsageError(f"unknown loss kind {kind!r} (known: {', '.join(sorted(known_kinds()))})")
    names = sorted(os.path.basename(p)[:-len(".json")] for p in glob.glob(os.path.join(cases_dir(), "*.json")))
    names = [n for n in names if ("stage" in read_case(n)) == bool(head) and not head_not_run_because(read_case(n))]
    if kind is None:
        return names
    return [n for n in names if read_case(n).get("loss", {}).get("kind", "cross_entropy") == kind]


def case_file(case):
    """The path of a case: a shipped case's name ("smoothing-megatron"), or a case file's path (one with a
    folder or a .json suffix) as it is."""
    case = os.fspath(case)
    if os.sep in case or case.endswith(".json"):
        return case
    path = os.path.join(cases_dir(), case + ".json")
    if not os.path.isfile(path):
        raise UsageError(f"{case}: no such shipped case (in {cases_dir()}; pass a path for a case file of your own)")
    return path
