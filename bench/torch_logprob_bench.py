"""PyTorch figures for `lossverify bench --loss policy`: a trainer's log-prob and entropy pass on bf16 logits,
forward and backward (log_softmax, gather of the sampled token, entropy -sum p log p; loss -mean(logprob)
- 0.01 mean(entropy)), eager and torch.compile, timed with CUDA events (median).

usage: torch_logprob_bench.py TOKENS VOCAB DTYPE UNUSED REPEATS   -> one JSON line on stdout
"""
import json
import sys


def main() -> int:
    tokens, vocab, dtype_name, _, repeats = sys.argv[1:6]
    tokens, vocab, repeats = int(tokens), int(vocab), int(repeats)
    try:
        import torch
    except Exception as e:  # no PyTorch: say so, do not fail the bench
        print(json.dumps({"available": False, "reason": f"import torch: {e}"}))
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"available": False, "reason": "torch.cuda.is_available() is False"}))
        return 0
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = [torch.randn(tokens, vocab, device="cuda", dtype=dtype, generator=gen) * 2 for _ in range(2)]
    labels = torch.randint(0, vocab, (tokens, 1), device="cuda", generator=gen)

    def step(x):
        x = x.detach().requires_grad_(True)
        log_p = torch.log_softmax(x.float(), dim=-1)
        logprob = log_p.gather(-1, labels).squeeze(-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        loss = -logprob.mean() - 0.01 * entropy.mean()
        loss.backward()
        return x.grad

    def timed(fn):
        for i in range(3):
            fn(sets[i % 2])
        torch.cuda.synchronize()
        times = []
        for i in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(sets[i % 2])
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        times.sort()
        return times[len(times) // 2]

    out = {"available": True, "torch": torch.__version__, "eager_ms": timed(step)}
    try:
        out["compile_ms"] = timed(torch.compile(step))
    except Exception as e:
        out["compile_error"] = str(e)[:200]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
