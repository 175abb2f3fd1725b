"""What the PyTorch comparison scripts of `lossverify bench` share: torch on CUDA or a line saying why not, two
sets of random logits, the median of CUDA-event timings, and the eager and torch.compile figures as one JSON line."""
import json


def cuda_torch():
    """torch, or None after printing the JSON line that says why it cannot be timed."""
    try:
        import torch
    except Exception as e:  # no PyTorch: say so, do not fail the bench
        print(json.dumps({"available": False, "reason": f"import torch: {e}"}))
        return None
    if not torch.cuda.is_available():
        print(json.dumps({"available": False, "reason": "torch.cuda.is_available() is False"}))
        return None
    return torch


def logit_sets(torch, tokens, vocab, dtype_name, generator):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    return [torch.randn(tokens, vocab, device="cuda", dtype=dtype, generator=generator) * 2 for _ in range(2)]


def timed(torch, fn, sets, repeats):
    """Median milliseconds of fn(x), alternating between the sets, after three warm-ups."""
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


def report(torch, step, sets, repeats):
    """Prints the eager and torch.compile medians of step as one JSON line."""
    out = {"available": True, "torch": torch.__version__, "eager_ms": timed(torch, step, sets, repeats)}
    try:
        out["compile_ms"] = timed(torch, torch.compile(step), sets, repeats)
    except Exception as e:
        out["compile_error"] = str(e)[:200]
    print(json.dumps(out))
