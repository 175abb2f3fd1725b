"""PyTorch figures for `lossverify bench --loss policy`: a trainer's log-prob and entropy pass on bf16 logits,
forward and backward (log_softmax, gather of the sampled token, entropy -sum p log p; loss -mean(logprob)
- 0.01 mean(entropy)), eager and torch.compile, timed with CUDA events (median).

At TP > 1, one rank's shard (N x ceil(V / TP) columns) through the vocabulary-parallel formulation (the shard's
max, exp-sum and sum of p (x - max), the target logit where the shard holds it), the all-reduces between them
left out, as lossverify's shard kernels are timed without theirs.

usage: torch_logprob_bench.py TOKENS VOCAB DTYPE UNUSED REPEATS [TP]   -> one JSON line on stdout
"""
import sys

from torch_timing import cuda_torch, logit_sets, report


def main() -> int:
    tokens, vocab, dtype_name, _, repeats = sys.argv[1:6]
    tokens, vocab, repeats = int(tokens), int(vocab), int(repeats)
    tp = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    torch = cuda_torch()
    if torch is None:
        return 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    width = -(-vocab // tp)
    sets = logit_sets(torch, tokens, width, dtype_name, gen)
    labels = torch.randint(0, vocab, (tokens, 1), device="cuda", generator=gen)

    if tp == 1:
        def step(x):
            x = x.detach().requires_grad_(True)
            log_p = torch.log_softmax(x.float(), dim=-1)
            logprob = log_p.gather(-1, labels).squeeze(-1)
            entropy = -(log_p.exp() * log_p).sum(-1)
            loss = -logprob.mean() - 0.01 * entropy.mean()
            loss.backward()
            return x.grad
    else:
        held = labels < width
        index = torch.where(held, labels, torch.zeros_like(labels))

        def step(x):
            x = x.detach().requires_grad_(True)
            z = x.float()
            m = z.max(dim=-1, keepdim=True).values  # all-reduce (max) left out
            z = z - m
            e = z.exp()
            s = e.sum(-1)  # all-reduce (sum) left out
            ez = (e * z).sum(-1)  # all-reduce (sum) left out
            log_s = s.log()
            target = torch.where(held, z.gather(-1, index), torch.zeros_like(index, dtype=z.dtype)).squeeze(-1)
            logprob = target - log_s
            entropy = log_s - ez / s
            loss = -logprob.mean() - 0.01 * entropy.mean()
            loss.backward()
            return x.grad

    report(torch, step, sets, repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
