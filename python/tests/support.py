"""Shared by the tests: where the repository's cases and golden outcomes are, and the lossverify binary.

The tests run against a real lossverify executable: LOSSVERIFY_BIN, else `lossverify` on PATH, else the
build tree (python/../build/release/cli/lossverify). None of them is skipped when it is missing: they fail,
saying where they looked, so CI cannot pass without checking anything.
"""

import glob
import json
import os
from lossverify.inputs import head_not_run_because
from lossverify.kinds import known_kinds

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(PYTHON_DIR)
CASES = os.path.join(REPO, "cases")
GOLDEN = os.path.join(REPO, "golden")
DUMP_FIXTURES = os.path.join(REPO, "tests", "data", "dumps")


def case_path(name):
    return os.path.join(CASES, name + ".json")


def has_stage(name):
    """Whether the shipped case puts a stage in front of its kind (an LM head): its functions take h, W and b
    (lossverify.torch.implementations.head)."""
    with open(case_path(name), encoding="utf-8") as f:
        return "stage" in json.load(f)


def all_case_names():
    """The shipped cases of the kinds this package checks (lossverify.kinds: cross_entropy, kd, policy and router),
    those with an LM head in front of their kind too where the package's head runs them
    (lossverify.inputs.head_not_run_because)."""
    names = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(CASES, "*.json")))
    return [n for n in names if loss_kind(n) in known_kinds() and not head_not_run_because(read_case(n))]


def case_names():
    """The cases a golden suite runs: every one of all_case_names(), or the one LOSSVERIFY_GOLDEN_CASE names (CTest
    runs each case as an entry of its own, so they spread over the cores and rerun alone). A name that is not a
    shipped case of a kind this package checks is an error, never an empty run."""
    only = os.environ.get("LOSSVERIFY_GOLDEN_CASE")
    if not only:
        return all_case_names()
    if not os.path.isfile(case_path(only)):
        raise ValueError(f"LOSSVERIFY_GOLDEN_CASE={only}: no such case in {CASES}")
    if loss_kind(only) not in known_kinds():
        raise ValueError(f"LOSSVERIFY_GOLDEN_CASE={only}: its kind {loss_kind(only)!r} is not one the package checks")
    return [only]


def implementations_module(name):
    """The module of the package's own implementations for a shipped case: the LM head's for a case with one."""
    return "lossverify.torch.implementations.head" if has_stage(name) else "lossverify.torch.implementations"


def read_case(name):
    with open(case_path(name), encoding="utf-8") as f:
        return json.load(f)


def golden(name):
    """{implementation (kebab-case): {"verdict": ..., "failing_checks": [...]}} of a case."""
    with open(os.path.join(GOLDEN, name + ".json"), encoding="utf-8") as f:
        return json.load(f)["outcomes"]


def loss_kind(name):
    return read_case(name).get("loss", {}).get("kind", "cross_entropy")


def next_token_labels(name):
    """Whether the case's labels are next-token labels (the default when it has packed sequences)."""
    batch = read_case(name).get("batch")
    return bool(batch) and batch.get("labels", "next_token") == "next_token"


def keep_dir(*parts):
    """LOSSVERIFY_TEST_KEEP=DIR keeps every check's inputs, dumps and reports under DIR (a CI artifact)."""
    root = os.environ.get("LOSSVERIFY_TEST_KEEP")
    return os.path.join(root, *parts) if root else None
