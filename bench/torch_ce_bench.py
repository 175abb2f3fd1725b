"""PyTorch figures for `lossverify bench --backend cuda`: fused forward+backward cross-entropy with label
smoothing and mean reduction on bf16 logits, eager and torch.compile, timed with CUDA events (median).

usage: torch_ce_bench.py TOKENS VOCAB DTYPE LABEL_SMOOTHING REPEATS   -> one JSON line on stdout
"""
import sys

from torch_timing import cuda_torch, logit_sets, report


def main() -> int:
    tokens, vocab, dtype_name, smoothing, repeats = sys.argv[1:6]
    tokens, vocab, smoothing, repeats = int(tokens), int(vocab), float(smoothing), int(repeats)
    torch = cuda_torch()
    if torch is None:
        return 0
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = logit_sets(torch, tokens, vocab, dtype_name, gen)
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)

    def step(x):
        x = x.detach().requires_grad_(True)
        loss = F.cross_entropy(x, labels, label_smoothing=smoothing, reduction="mean")
        loss.backward()
        return x.grad

    report(torch, step, sets, repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
