"""PyTorch peers of `lossverify bench --loss head`: an LM head and cross-entropy (label smoothing, mean reduction),
forward and backward (dh and dW), on bf16 hidden states and weight, timed with CUDA events (median), each with its
peak device memory beyond the inputs (h, W, labels):
  eager     h @ W.T in bf16, F.cross_entropy on the logits widened to float32 (as Hugging Face models compute it);
  compile   torch.compile of the same step;
  liger     Liger-Kernel's fused linear cross-entropy, where its source is importable (LIGER_PATH: a folder holding
            the liger_kernel package; a missing one is reported, not an error);
  gemms     the three products alone (h W^T, g W, g^T h), bf16 in and out.

usage: torch_head_bench.py TOKENS HIDDEN VOCAB LABEL_SMOOTHING REPEATS   -> one JSON line on stdout
"""
import os
import sys

from torch_timing import cuda_torch


def timed(torch, fn, repeats):
    """(median milliseconds, peak bytes beyond what was allocated before) of fn(), after three warm-ups."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2], torch.cuda.max_memory_allocated() - base


def main() -> int:
    import json

    tokens, hidden, vocab, smoothing, repeats = sys.argv[1:6]
    tokens, hidden, vocab, smoothing, repeats = int(tokens), int(hidden), int(vocab), float(smoothing), int(repeats)
    torch = cuda_torch()
    if torch is None:
        return 0
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) * (2.0 / hidden**0.5)
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    flops = 6.0 * tokens * hidden * vocab

    def step():
        x = h.detach().requires_grad_(True)
        weight = w.detach().requires_grad_(True)
        loss = F.cross_entropy((x @ weight.T).float(), labels, label_smoothing=smoothing, reduction="mean")
        loss.backward()
        return x.grad, weight.grad

    out = {"available": True, "torch": torch.__version__, "tokens": tokens, "hidden": hidden, "vocab": vocab}

    def record(name, fn):
        try:
            ms, peak = timed(torch, fn, repeats)
            out[name] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12, "peak_extra_gib": peak / 2**30}
        except Exception as e:  # a peer that cannot run here is reported, not fatal
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        torch.cuda.empty_cache()

    record("eager", step)
    record("compile", torch.compile(step))
    liger_path = os.environ.get("LIGER_PATH")
    if liger_path:
        sys.path.insert(0, liger_path)
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        def liger():
            x = h.detach().requires_grad_(True)
            weight = w.detach().requires_grad_(True)
            loss = LigerFusedLinearCrossEntropyFunction.apply(x, weight, labels, None, None, -100, 0.0, smoothing)
            if isinstance(loss, tuple):
                loss = loss[0]
            loss.backward()
            return x.grad, weight.grad

        record("liger", liger)
        out["liger_source"] = open(os.path.join(liger_path or ".", "VERSION")).read().strip() if liger_path else "?"
    except Exception as e:
        out["liger"] = {"error": f"import: {type(e).__name__}: {str(e)[:200]}"}

    g = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16, generator=gen) * 1e-6

    def gemms():
        return h @ w.T, g @ w, g.T @ h

    record("gemms", gemms)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
