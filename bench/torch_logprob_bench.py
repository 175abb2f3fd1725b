"""PyTorch figures for `lossverify bench --loss policy`: a trainer's log-prob and entropy pass on bf16 logits,
forward and backward (log_softmax, gather of the sampled token, entropy -sum p log p; loss -mean(logprob)
- 0.01 mean(entropy)), eager and torch.compile, timed with CUDA events (median).

usage: torch_logprob_bench.py TOKENS VOCAB DTYPE UNUSED REPEATS   -> one JSON line on stdout
"""
import sys

from torch_timing import cuda_torch, logit_sets, report


def main() -> int:
    tokens, vocab, dtype_name, _, repeats = sys.argv[1:6]
    tokens, vocab, repeats = int(tokens), int(vocab), int(repeats)
    torch = cuda_torch()
    if torch is None:
        return 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = logit_sets(torch, tokens, vocab, dtype_name, gen)
    labels = torch.randint(0, vocab, (tokens, 1), device="cuda", generator=gen)

    def step(x):
        x = x.detach().requires_grad_(True)
        log_p = torch.log_softmax(x.float(), dim=-1)
        logprob = log_p.gather(-1, labels).squeeze(-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        loss = -logprob.mean() - 0.01 * entropy.mean()
        loss.backward()
        return x.grad

    report(torch, step, sets, repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
