"""Every catalogued bug written in PyTorch (lossverify.torch.implementations) gives, at each shipped case's
own layout, exactly the verdict and failing checks that golden/<case>.json records for lossverify's own
kernel with that bug; `correct` passes. One process group per case runs all of them.

The policy cases (rl-*) run correct, the 24 policy bugs (rl_*) and the framework-level bugs that reach every
kind (microbatch_local_mean and cp_loss_stat_dp_only among them), one launch per case like the others.

Cells not run, and why:
- a bug of another loss kind (KD bugs on cross-entropy cases and back, rl_* bugs elsewhere): golden says
  not_applicable;
- ignore_index_unmasked and cp_roll_after_split on policy cases: the Python versions are switches of the
  cross-entropy kernel (lossverify's own kernel applies them to every labelled kind); cp-duplicated-loss and
  cp-pad-to-cp have no Python version;
- cp_roll_after_split on cases with independent labels: it builds labels from token ids, which only
  next-token data have (lossverify's kernel leaves such labels alone, so golden says pass there);
- the LM head cases (head-*): the head's correct and its eight catalogued bugs written in PyTorch
  (lossverify.torch.implementations.head), none of the logits functions (they take logits, not h and W);
- realistic-bf16-n2048-v32000-tp8: only the bugs golden says fail there (3-6 s per implementation on 2 cores), and
  not full_vocab_through_tp (each of the 8 ranks gathers and checks all 65M logits: 100 s; four smaller cases
  catch it);
- the framework-level bugs that reach every per-token kind (dp_local_mean and the others of KIND "any") on router
  cases (moe-*): their Python versions weigh per-token losses, which a router's shares of its scopes are not; the
  router cases run correct and the router's 24 bugs (moe_*), and lossverify's own kernels hold those cells in the
  gate.
"""

import unittest

import lossverify.torch as lvt
from lossverify.torch.implementations import CATALOGUE, KIND
from lossverify.torch.implementations.head import CATALOGUE as HEAD_CATALOGUE
from support import (all_case_names, case_names, case_path, golden, has_stage, implementations_module, keep_dir,
                     loss_kind, next_token_labels)

SLOW_CASES = {"realistic-bf16-n2048-v32000-tp8"}


def implementations_for(name):
    outcomes = golden(name)
    if has_stage(name):  # an LM head case: the head's correct and its catalogued bugs in PyTorch
        return {impl: outcomes[impl.replace("_", "-")] for impl in HEAD_CATALOGUE}
    kind = loss_kind(name)
    chosen = {}
    for impl in CATALOGUE:
        expected = outcomes[impl.replace("_", "-")]
        if KIND[impl] not in ("any", kind) or expected["verdict"] == "not_applicable":
            continue
        if kind == "router" and KIND[impl] == "any" and impl != "correct":
            continue
        if impl == "cp_roll_after_split" and not next_token_labels(name):
            continue
        if name in SLOW_CASES and ((expected["verdict"] == "pass" and impl != "correct") or
                                   impl == "full_vocab_through_tp"):
            continue
        chosen[impl] = expected
    return chosen


class BugsMatchGolden(unittest.TestCase):
    def test_every_bug_on_every_case(self):
        for name in case_names():
            expected = implementations_for(name)
            module = implementations_module(name)
            reports = lvt.check_many({impl: f"{module}:{impl}" for impl in expected},
                                     case_path(name), keep_dump=keep_dir("golden_bugs", name), control=False)
            for impl, outcome in expected.items():
                with self.subTest(case=name, implementation=impl):
                    report = reports[impl]
                    self.assertEqual(report.verdict, outcome["verdict"], report.table())
                    self.assertEqual(report.failing_checks, sorted(outcome.get("failing_checks", [])),
                                     report.table())

    def test_each_bug_fails_somewhere(self):
        # reads golden only: every case, whichever one LOSSVERIFY_GOLDEN_CASE runs
        caught = set()
        for name in all_case_names():
            caught |= {impl for impl, o in implementations_for(name).items() if o["verdict"] == "fail"}
        self.assertEqual(sorted((set(CATALOGUE) | set(HEAD_CATALOGUE)) - {"correct"} - caught), [])


if __name__ == "__main__":
    unittest.main()
