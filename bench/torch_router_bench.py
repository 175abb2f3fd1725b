"""PyTorch figures for `lossverify bench --loss router`: the Switch-form load-balancing loss (top-8, aux 0.01) and
the router z-loss (0.001) on float32 router logits of one scope, forward and backward (softmax, top-k, the counts
from a one-hot sum, alpha E / (k T^2) sum_e c_e sum_t p_te, alpha_z / T sum_t lse^2), eager and torch.compile,
timed with CUDA events (median).

TP, where given, is 1: a router's rows are whole.

usage: torch_router_bench.py TOKENS EXPERTS DTYPE UNUSED REPEATS [TP]   -> one JSON line on stdout
"""
import sys

from torch_timing import cuda_torch, logit_sets, report

TOP_K, AUX, Z = 8, 0.01, 0.001


def main() -> int:
    tokens, experts, _, _, repeats = sys.argv[1:6]
    tokens, experts, repeats = int(tokens), int(experts), int(repeats)
    torch = cuda_torch()
    if torch is None:
        return 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = logit_sets(torch, tokens, experts, "fp32", gen)

    def step(z):
        z = z.detach().requires_grad_(True)
        p = torch.softmax(z, dim=-1)
        chosen = torch.topk(z.detach(), TOP_K, dim=-1).indices
        counts = torch.zeros(experts, device=z.device).scatter_add_(
            0, chosen.reshape(-1), torch.ones(chosen.numel(), device=z.device))
        aux = AUX * experts / (TOP_K * tokens * tokens) * (counts * p.sum(0)).sum()
        lse = torch.logsumexp(z, dim=-1)
        loss = aux + Z / tokens * (lse * lse).sum()
        loss.backward()
        return z.grad

    report(torch, step, sets, repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
