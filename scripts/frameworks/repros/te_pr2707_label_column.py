#!/usr/bin/env python3
"""The last step of explaining TransformerEngine PR #2707's grad margin of 1.196 on
realistic-bf16-n2048-v32000-tp8 (docs/frameworks.md): the worst element is the label column of token 891,
whose gradient the PR's Triton kernel rounds to bf16 three times. This replays that arithmetic from lossverify's
own inputs (export-inputs), with none of TransformerEngine's code: p' - eps stored in the bf16 logits buffer,
X_y reloaded and `-(1 - label_smoothing)` added in bf16 (the Python constant takes the bf16 operand's type),
stored, then multiplied by grad_output in the backward and stored again. It prints the element as one, two and
three roundings give it, beside what the PR's kernel gave on an H100 (-0.000457764).

usage: LOSSVERIFY_BIN=build/release/cli/lossverify python3 scripts/frameworks/repros/te_pr2707_label_column.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "python"))
from lossverify import inputs as lvi  # noqa: E402

CASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "cases",
                    "realistic-bf16-n2048-v32000-tp8.json")
TOKEN, SMOOTHING, Z_LOSS = 891, 0.1, 1e-4


def main():
    with lvi.exported(CASE, tp=1, overrides={"loss.smoothing_convention": "pytorch"}) as exported:
        micro_batch = exported.rank(0).micro_batch(0)
        x, labels, mask = micro_batch["logits"].float(), micro_batch["labels"], micro_batch["loss_mask"]
    count, vocab, y = int(mask.sum()), x.shape[1], int(labels[TOKEN])
    row = x[TOKEN].double()
    lse = torch.logsumexp(row, 0)
    q_y = 1 - SMOOTHING + SMOOTHING / vocab
    reference = (torch.exp(row[y] - lse) * (1 + 2 * Z_LOSS * lse) - q_y) / count
    lse32 = torch.logsumexp(x[TOKEN], 0)
    p_eps = torch.exp(x[TOKEN, y] - lse32) * (1 + 2 * Z_LOSS * lse32) - SMOOTHING / vocab  # float32, in registers
    upstream = torch.tensor(1.0 / count, dtype=torch.float32)
    bf16 = torch.bfloat16
    one = ((p_eps - (1 - SMOOTHING)) * upstream).to(bf16)
    two = ((p_eps - (1 - SMOOTHING)).to(bf16).float() * upstream).to(bf16)
    stored = p_eps.to(bf16)
    target = stored + torch.tensor(-(1 - SMOOTHING), dtype=bf16)  # bf16 + bf16(-0.9) = -0.8984375, rounded
    three = (target.float() * upstream).to(bf16)
    print(f"token {TOKEN}, label column {y}, N_v = {count}")
    print(f"reference (float64)            {reference.item():.6g}")
    print(f"one rounding                   {one.item():.6g}")
    print(f"two (grad-rounded-early)       {two.item():.6g}")
    print(f"three (PR #2707's label column) {three.item():.6g}   (the kernel gave -0.000457764)")


if __name__ == "__main__":
    main()
