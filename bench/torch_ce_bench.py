"""PyTorch figures for `lossverify bench --backend cuda`: forward+backward cross-entropy with label smoothing and
mean reduction on bf16 logits, eager and torch.compile, timed with CUDA events (median).

At TP 1, F.cross_entropy on the whole rows. At TP > 1, one rank's shard (N x ceil(V / TP) columns, the first and
widest) through the vocabulary-parallel formulation that Megatron-style trainers write (the shard's max, its
exp-sum, the target logit where the shard holds it, the smoothing term's sum), with the all-reduces between
them left out, as lossverify's shard kernels are timed without theirs.

usage: torch_ce_bench.py TOKENS VOCAB DTYPE LABEL_SMOOTHING REPEATS [TP]   -> one JSON line on stdout
"""
import sys

from torch_timing import cuda_torch, logit_sets, report


def main() -> int:
    tokens, vocab, dtype_name, smoothing, repeats = sys.argv[1:6]
    tokens, vocab, smoothing, repeats = int(tokens), int(vocab), float(smoothing), int(repeats)
    tp = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    torch = cuda_torch()
    if torch is None:
        return 0
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(0)
    width = -(-vocab // tp)
    sets = logit_sets(torch, tokens, width, dtype_name, gen)
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)

    if tp == 1:
        def step(x):
            x = x.detach().requires_grad_(True)
            loss = F.cross_entropy(x, labels, label_smoothing=smoothing, reduction="mean")
            loss.backward()
            return x.grad
    else:
        local = labels - 0  # this rank holds columns [0, width)
        held = local < width
        index = torch.where(held, local, torch.zeros_like(local)).unsqueeze(-1)

        def step(x):
            x = x.detach().requires_grad_(True)
            z = x.float()
            m = z.max(dim=-1, keepdim=True).values  # all-reduce (max) left out
            z = z - m
            s = z.exp().sum(-1)  # all-reduce (sum) left out
            target = torch.where(held, z.gather(-1, index).squeeze(-1), torch.zeros_like(s))  # all-reduce left out
            log_s = s.log()
            nll = log_s - target
            smooth = log_s - z.sum(-1) / vocab  # the sum all-reduced, over the global vocabulary
            loss = ((1.0 - smoothing) * nll + smoothing * smooth).mean()
            loss.backward()
            return x.grad

    report(torch, step, sets, repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
