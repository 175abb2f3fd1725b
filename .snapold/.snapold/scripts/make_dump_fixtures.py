#!/usr/bin/env python3
"""Writes the check-dump fixtures: training steps of loss implementations written in PyTorch, run on real
torch.distributed process groups (gloo, 2-4 processes), dumped rank by rank as a lossverify.dump/1 manifest
with safetensors (and .npy) files, the way a Megatron-LM / TransformerEngine / torchtitan / NeMo user would.

usage: make_dump_fixtures.py OUT_DIR [FAMILY ...]      (families: ce-dp, vp-ce, vp-kd, ce-cp; default all)

Each fixture is OUT_DIR/<name>/ with manifest.json, the rank files and expected.json (exit code and the
checks that must fail). Gradients come from autograd (loss.backward() on logits with requires_grad). The
correct implementations must pass check-dump; the buggy ones carry bugs of the lossverify catalogue
(`lossverify list`) and must fail with the checks expected.json names.

Needs PyTorch (Debian: python3-torch) and NumPy; safetensors files are written by a 20-line writer below
(Debian has no python3-safetensors; safetensors.torch.save_file writes the same format).
"""
import json
import os
import struct
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.multiprocessing as mp
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------------------
# dump writing


def save_safetensors(path, tensors):
    """The safetensors format: u64 little-endian header length, JSON header, then the raw data."""
    codes = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        data = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
        header[name] = {"dtype": codes[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt", "writer": "scripts/make_dump_fixtures.py"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def rows_json(tokens):
    """Global token of every local row (-1: padding) as ranges [b, e), single tokens and {"padding": k}."""
    out, i = [], 0
    while i < len(tokens):
        j = i + 1
        if tokens[i] < 0:
            while j < len(tokens) and tokens[j] < 0:
                j += 1
            out.append({"padding": j - i})
        else:
            while j < len(tokens) and tokens[j] == tokens[j - 1] + 1:
                j += 1
            out.append([tokens[i], tokens[j - 1] + 1] if j - i > 1 else tokens[i])
        i = j
    return out


def write_manifest(folder, manifest, expected):
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    with open(os.path.join(folder, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")


def number(value):
    """A logged value for the manifest: strict JSON has no NaN or Infinity, lossverify reads these strings."""
    value = float(value)
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def gather_to_rank0(obj):
    items = [None] * dist.get_world_size()
    dist.all_gather_object(items, obj)
    return items


def vocab_shard(vocab, tp, r):
    base, extra = divmod(vocab, tp)
    begin = r * base + min(r, extra)
    return begin, begin + base + (1 if r < extra else 0)


class ReduceFromTP(torch.autograd.Function):
    """All-reduce whose backward is the identity (Megatron's _ReduceFromModelParallelRegion): every TP rank
    holds the same replicated loss, so each one back-propagates it to its own shard only."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


# ---------------------------------------------------------------------------------------------------------
# family ce-dp: F.cross_entropy with label smoothing, full rows (tp=1), dp=2, ga=2, fp32


def family_ce_dp(rank, world, out_dir):
    dp, ga, n, vocab, alpha = world, 2, 64, 300, 0.1
    g = torch.Generator().manual_seed(1234)
    logits = torch.randn(n, vocab, generator=g) * 2.0
    labels = torch.randint(0, vocab, (n,), generator=g)
    # Unequal valid counts across DP ranks and micro-batches (16 tokens each): 0, 8, 4, 12 ignored.
    ignored = {0: 0, 1: 8, 2: 4, 3: 12}
    per = n // (dp * ga)
    for slot, k in ignored.items():
        labels[slot * per: slot * per + k] = -100
    variants = {
        "correct": None,
        "dp-local-mean": "each DP rank divides by its own valid-token count, then DDP averages the gradients "
                         "(torchtitan before its loss-balancing fix)",
        "ga-microbatch-mean": "each micro-batch is a mean over its own valid tokens, divided by GA "
                              "(pytorch/torchtitan issue #1842)",
    }
    expected_fail = {"correct": [], "dp-local-mean": ["grad", "loss"], "ga-microbatch-mean": ["grad", "loss"]}
    for variant, why in variants.items():
        name = "torch-ce-smoothing-dp2-ga2" + ("" if variant == "correct" else "-" + variant)
        folder = os.path.join(out_dir, name)
        os.makedirs(folder, exist_ok=True)
        slots = [(rank * ga + k) for k in range(ga)]  # DP rank d holds tokens [d*32, d*32+32), 16 per micro-batch
        valid = torch.tensor([float((labels[s * per:(s + 1) * per] != -100).sum()) for s in slots])
        global_valid = valid.sum().clone()
        dist.all_reduce(global_valid)  # the correct implementation counts over all ranks and micro-batches first
        tensors, logged = {}, torch.zeros(())
        for k, s in enumerate(slots):
            x = logits[s * per:(s + 1) * per].clone().requires_grad_(True)
            y = labels[s * per:(s + 1) * per]
            token_loss = F.cross_entropy(x, y, label_smoothing=alpha, ignore_index=-100, reduction="none")
            if variant == "correct":
                # DDP averages gradients over the DP group: scale this rank's share of the global sum by DP.
                loss = token_loss.sum() / global_valid * dp
                logged = logged + token_loss.sum().detach() / global_valid
            elif variant == "dp-local-mean":
                loss = token_loss.sum() / valid.sum()
                logged = logged + token_loss.sum().detach() / valid.sum() / dp
            else:
                loss = F.cross_entropy(x, y, label_smoothing=alpha, ignore_index=-100, reduction="mean") / ga
                logged = logged + loss.detach() / dp
            loss.backward()
            tensors[f"mb{k}.logits"] = x.detach()
            tensors[f"mb{k}.labels"] = y
            tensors[f"mb{k}.grad_logits"] = x.grad
            tensors[f"mb{k}.token_loss"] = token_loss.detach()
        dist.all_reduce(logged)  # the logged loss: summed over DP (each rank's share of the mean)
        tensors["loss"] = logged
        tensors["num_tokens"] = global_valid.to(torch.int64)
        save_safetensors(os.path.join(folder, f"rank{rank}.safetensors"), tensors)
        ranks = gather_to_rank0({
            "rank": rank, "vocab": [0, vocab], "file": f"rank{rank}.safetensors",
            "micro_batches": [{"rows": rows_json(list(range(s * per, (s + 1) * per))),
                               "tensors": {"logits": f"mb{k}.logits", "labels": f"mb{k}.labels",
                                           "grad_logits": f"mb{k}.grad_logits", "token_loss": f"mb{k}.token_loss"}}
                              for k, s in enumerate(slots)],
            "stats": {"loss": "loss", "num_tokens": "num_tokens"}})
        if rank == 0:
            write_manifest(folder, {
                "format": "lossverify.dump/1",
                "name": name,
                "description": "F.cross_entropy(label_smoothing=0.1, ignore_index=-100) on full rows, DDP over 2 ranks, "
                               "2 micro-batches each; " + (why or "correct: one global valid-token count"),
                "implementation": "torch.nn.functional.cross_entropy" + ("" if variant == "correct" else " + " + variant),
                "shape": {"tokens": n, "vocab": vocab},
                "dtype": "fp32",
                "loss": {"kind": "cross_entropy", "label_smoothing": alpha, "smoothing_convention": "pytorch",
                         "ignore_index": -100, "reduction": "mean"},
                "layout": {"tp": 1, "cp": 1, "dp": dp, "ga": ga},
                "framework": {"grad_reduce": "avg", "ga_reduce": "sum"},
                "ranks": ranks,
            }, {"exit_code": 1 if expected_fail[variant] else 0, "failing_checks": expected_fail[variant],
                "catalogue": None if variant == "correct" else variant})


# ---------------------------------------------------------------------------------------------------------
# family vp-ce: Megatron-style vocab-parallel cross-entropy (custom autograd Function), tp=2 x dp=2, bf16


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron-LM's _VocabParallelCrossEntropy (after PR #5522), with switches for two catalogued bugs."""

    @staticmethod
    def forward(ctx, vp_logits, target, alpha, vocab, begin, end, group, bug):
        x = vp_logits.float()
        if bug != "no-max-shift":
            m = x.max(dim=-1)[0]
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            x = x - m.unsqueeze(-1)
        outside = (target < begin) | (target >= end)
        local_target = (target - begin).clamp(0, end - begin - 1)
        predicted = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * (~outside)
        exp = x.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(predicted, group=group)
        dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - predicted
        softmax = exp / sum_exp.unsqueeze(-1)
        width = vocab  # the smoothing constants use the global vocabulary size
        if alpha > 0:
            if bug == "smoothing-partition-vocab":
                width = end - begin  # the shard's width, and a shard-local mean (before PR #5522)
                mean_log_probs = torch.log(softmax).mean(dim=-1)
            else:
                sum_x = x.sum(dim=-1)  # sum_v log p_v = sum_v x_v - V log S, without ever taking log(p)
                dist.all_reduce(sum_x, group=group)
                mean_log_probs = (sum_x - vocab * sum_exp.log()) / vocab
            smoothing = alpha * width / (width - 1)
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
        ctx.save_for_backward(softmax, outside, local_target)
        ctx.alpha, ctx.width = alpha, width
        ctx.in_dtype = vp_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0])
        hit = 1.0 - outside.float()
        if ctx.alpha > 0:
            smoothing = ctx.alpha * ctx.width / (ctx.width - 1)
            grad[rows, local_target] -= (1.0 - smoothing) * hit
            grad -= smoothing / ctx.width
        else:
            grad[rows, local_target] -= hit
        grad *= grad_output.unsqueeze(-1)
        return grad.to(ctx.in_dtype), None, None, None, None, None, None, None


def family_vp_ce(rank, world, out_dir):
    tp, dp, n, vocab, alpha = 2, 2, 64, 301, 0.1
    g = torch.Generator().manual_seed(4321)
    logits = (torch.randn(n, vocab, generator=g) * 2.0)
    for t in (3, 17, 40, 59):  # rows with a logit near 95: exp overflows float32 without the max shift
        logits[t, (7 * t) % vocab] = 95.0
    logits = logits.to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), generator=g)
    loss_mask = torch.ones(n, dtype=torch.bool)
    loss_mask[torch.randperm(n, generator=g)[:10]] = False
    tp_rank, dp_rank = rank % tp, rank // tp
    tp_groups = [dist.new_group([d * tp + r for r in range(tp)]) for d in range(dp)]
    dp_groups = [dist.new_group([d * tp + r for d in range(dp)]) for r in range(tp)]
    tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]
    begin, end = vocab_shard(vocab, tp, tp_rank)
    per = n // dp
    token_rows = list(range(dp_rank * per, (dp_rank + 1) * per))
    variants = {"correct": None,
                "smoothing-partition-vocab": "label smoothing with the shard's vocabulary width and a shard-local "
                                             "mean log-probability (Megatron-LM before PR #5522)",
                "no-max-shift": "exp(x) without subtracting the row max: float32 overflows at logits near 95"}
    expected_fail = {"correct": [], "smoothing-partition-vocab": ["grad", "loss", "rank_agreement", "row_sum"],
                     "no-max-shift": ["finite", "grad", "loss", "rank_agreement", "row_sum"]}
    for variant, why in variants.items():
        name = "torch-vocab-parallel-ce-tp2-dp2-bf16" + ("" if variant == "correct" else "-" + variant)
        folder = os.path.join(out_dir, name)
        os.makedirs(folder, exist_ok=True)
        x = logits[token_rows, begin:end].clone().requires_grad_(True)
        y = labels[token_rows]
        mask = loss_mask[token_rows]
        num_tokens = mask.sum().to(torch.float32)
        dist.all_reduce(num_tokens, group=dp_group)
        token_loss = VocabParallelCrossEntropy.apply(x, y, alpha, vocab, begin, end, tp_group, variant) * mask
        # DDP averages gradients over the DP group: this rank's share of the global sum, times DP.
        loss = token_loss.sum() / num_tokens * dp
        loss.backward()
        logged = token_loss.sum().detach() / num_tokens
        dist.all_reduce(logged, group=dp_group)
        save_safetensors(os.path.join(folder, f"rank{rank}.safetensors"), {
            "logits": x.detach(), "labels": y, "loss_mask": mask, "grad_logits": x.grad,
            "token_loss": token_loss.detach()})
        ranks = gather_to_rank0({
            "tp": tp_rank, "cp": 0, "dp": dp_rank, "vocab": [begin, end], "file": f"rank{rank}.safetensors",
            "rows": rows_json(token_rows),
            "tensors": {"logits": "logits", "labels": "labels", "loss_mask": "loss_mask",
                        "grad_logits": "grad_logits", "token_loss": "token_loss"},
            "stats": {"loss": number(logged), "num_tokens": int(num_tokens)}})
        if rank == 0:
            write_manifest(folder, {
                "format": "lossverify.dump/1",
                "name": name,
                "description": "Megatron-style vocab-parallel cross-entropy in PyTorch (all-reduce max / sum over "
                               "the TP group, custom autograd backward), label smoothing 0.1 (Megatron convention), "
                               "bf16 logits with rows near 95, V=301 over tp=2, DDP over dp=2; " +
                               (why or "correct"),
                "implementation": "vocab-parallel cross-entropy (PyTorch)" + ("" if variant == "correct" else " + " + variant),
                "shape": {"tokens": n, "vocab": vocab},
                "dtype": "bf16",
                "loss": {"kind": "cross_entropy", "label_smoothing": alpha, "smoothing_convention": "megatron",
                         "reduction": "mean"},
                "layout": {"tp": tp, "cp": 1, "dp": dp, "ga": 1},
                "framework": {"grad_reduce": "avg", "ga_reduce": "sum"},
                "ranks": ranks,
            }, {"exit_code": 1 if expected_fail[variant] else 0, "failing_checks": expected_fail[variant],
                "catalogue": None if variant == "correct" else variant})


# ---------------------------------------------------------------------------------------------------------
# family vp-kd: vocab-parallel KD (forward KL, temperature 2, T^2 scaling), tp=2, fp32


def vocab_parallel_log_softmax(z, group, tracked):
    m = z.detach().max(dim=-1, keepdim=True)[0]
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    s = (z - m).exp().sum(dim=-1, keepdim=True)
    if tracked:
        # Every rank's log-softmax depends on every shard through the denominator: its backward must
        # all-reduce the gradients (torch.distributed.nn.functional.all_reduce does).
        s = dist_nn.all_reduce(s, group=group)
    else:
        dist.all_reduce(s, group=group)  # in place, invisible to autograd: backward sees the local sum only
    return z - m - s.log()


def family_vp_kd(rank, world, out_dir):
    tp, n, vocab, temperature = world, 48, 256, 2.0
    g = torch.Generator().manual_seed(777)
    student = torch.randn(n, vocab, generator=g) * 2.0
    teacher = torch.randn(n, vocab, generator=g) * 3.0 + 0.5
    loss_mask = torch.ones(n, dtype=torch.bool)
    loss_mask[torch.randperm(n, generator=g)[:6]] = False
    group = dist.group.WORLD
    begin, end = vocab_shard(vocab, tp, rank)
    variants = {"correct": None,
                "kd-no-t2": "the KD loss misses the T^2 factor (NeMo KDLoss before PR #1499)",
                "kd-untracked-allreduce": "the softmax denominator's all-reduce is invisible to autograd "
                                          "(NeMo KDLoss PR #1499, _kl_forward_tp)"}
    expected_fail = {"correct": [], "kd-no-t2": ["grad", "loss"], "kd-untracked-allreduce": ["grad", "row_sum"]}
    for variant, why in variants.items():
        name = "torch-vocab-parallel-kd-tp2" + ("" if variant == "correct" else "-" + variant)
        folder = os.path.join(out_dir, name)
        os.makedirs(folder, exist_ok=True)
        x = student[:, begin:end].clone().requires_grad_(True)
        y = teacher[:, begin:end]
        tracked = variant != "kd-untracked-allreduce"
        log_q = vocab_parallel_log_softmax(x / temperature, group, tracked)
        with torch.no_grad():
            log_p = vocab_parallel_log_softmax(y / temperature, group, True)
        kl = ReduceFromTP.apply((log_p.exp() * (log_p - log_q)).sum(dim=-1), group)
        scale = 1.0 if variant == "kd-no-t2" else temperature ** 2
        token_loss = scale * kl * loss_mask
        num_tokens = loss_mask.sum()
        loss = token_loss.sum() / num_tokens
        loss.backward()
        save_safetensors(os.path.join(folder, f"rank{rank}.safetensors"), {
            "student_logits": x.detach(), "teacher_logits": y, "loss_mask": loss_mask.to(torch.float32),
            "grad_logits": x.grad, "token_loss": token_loss.detach(), "loss": loss.detach(),
            "num_tokens": num_tokens.to(torch.int32)})
        ranks = gather_to_rank0({
            "rank": rank, "vocab": [begin, end], "file": f"rank{rank}.safetensors", "rows": [[0, n]],
            "tensors": {"logits": "student_logits", "teacher_logits": "teacher_logits", "loss_mask": "loss_mask",
                        "grad_logits": "grad_logits", "token_loss": "token_loss"},
            "stats": {"loss": "loss", "num_tokens": "num_tokens"}})
        if rank == 0:
            write_manifest(folder, {
                "format": "lossverify.dump/1",
                "name": name,
                "description": "vocab-parallel KD in PyTorch: forward KL(teacher || student) at T=2 with T^2 "
                               "scaling, distributed log-softmax over tp=2 (denominator all-reduced with autograd, the "
                               "replicated KL all-reduced with an identity backward); " +
                               (why or "correct"),
                "implementation": "vocab-parallel KD (PyTorch)" + ("" if variant == "correct" else " + " + variant),
                "shape": {"tokens": n, "vocab": vocab},
                "dtype": "fp32",
                "loss": {"kind": "kd", "temperature": temperature, "t2_scaling": True, "reduction": "mean"},
                "layout": {"tp": tp, "cp": 1, "dp": 1, "ga": 1},
                "ranks": ranks,
            }, {"exit_code": 1 if expected_fail[variant] else 0, "failing_checks": expected_fail[variant],
                "catalogue": None if variant == "correct" else variant})


# ---------------------------------------------------------------------------------------------------------
# family ce-cp: packed sequences split by context parallelism (zigzag, cp=2), F.cross_entropy, .npy labels


def family_ce_cp(rank, world, out_dir):
    cp, vocab = world, 200
    lengths = [13, 7, 22, 5]
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    n = cu[-1]
    g = torch.Generator().manual_seed(99)
    logits = torch.randn(n, vocab, generator=g) * 1.5
    ids = torch.randint(0, vocab, (n,), generator=g)
    labels = torch.full((n,), -100, dtype=torch.int64)
    for s in range(len(lengths)):  # next-token labels on the whole sequence, before the split
        labels[cu[s]:cu[s + 1] - 1] = ids[cu[s] + 1:cu[s + 1]]
    # zigzag: each sequence padded to a multiple of 2 CP, cut into 2 CP chunks; rank c holds c and 2CP-1-c
    rows = []
    for s, length in enumerate(lengths):
        padded = -(-length // (2 * cp)) * 2 * cp
        h = padded // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            for j in range(h):
                pos = chunk * h + j
                rows.append(cu[s] + pos if pos < length else -1)
    real = torch.tensor([t >= 0 for t in rows])
    index = torch.tensor([max(t, 0) for t in rows])
    variants = {"correct": None,
                "cp-roll-after-split": "next-token labels made by rolling the local CP shard (inclusionAI/AReaL "
                                       "PR #1223); the dump holds the data loader's labels"}
    expected_fail = {"correct": [], "cp-roll-after-split": ["grad", "loss"]}
    for variant, why in variants.items():
        name = "torch-ce-cp2-zigzag" + ("" if variant == "correct" else "-" + variant)
        folder = os.path.join(out_dir, name)
        os.makedirs(folder, exist_ok=True)
        x = torch.where(real.unsqueeze(-1), logits[index], torch.zeros(())).clone().requires_grad_(True)
        loader_labels = torch.where(real, labels[index], torch.tensor(-100))
        if variant == "correct":
            y = loader_labels
        else:
            local_ids = torch.where(real, ids[index], torch.tensor(0))
            y = torch.roll(local_ids, -1)  # the bug: labels formed after the split
            y = torch.where(real & (loader_labels != -100), y, torch.tensor(-100))
        valid = (loader_labels != -100).sum().to(torch.float32)
        dist.all_reduce(valid)
        token_loss = F.cross_entropy(x, y, ignore_index=-100, reduction="none")
        loss = token_loss.sum() / valid * cp  # gradients are averaged over the DP x CP group
        loss.backward()
        logged = token_loss.sum().detach() / valid
        dist.all_reduce(logged)
        save_safetensors(os.path.join(folder, f"rank{rank}.safetensors"), {
            "logits": x.detach(), "grad_logits": x.grad, "token_loss": token_loss.detach()})
        np.save(os.path.join(folder, f"rank{rank}_labels.npy"), loader_labels.numpy())
        np.save(os.path.join(folder, f"rank{rank}_loss_mask.npy"), real.numpy())
        ranks = gather_to_rank0({
            "tp": 0, "cp": rank, "dp": 0, "vocab": [0, vocab], "file": f"rank{rank}.safetensors",
            "rows": rows_json(rows),
            "tensors": {"logits": "logits", "grad_logits": "grad_logits", "token_loss": "token_loss",
                        "labels": {"file": f"rank{rank}_labels.npy"},
                        "loss_mask": {"file": f"rank{rank}_loss_mask.npy"}},
            "stats": {"loss": number(logged), "num_tokens": int(valid)}})
        if rank == 0:
            write_manifest(folder, {
                "format": "lossverify.dump/1",
                "name": name,
                "description": "F.cross_entropy over packed sequences (lengths 13, 7, 22, 5) split by context "
                               "parallelism, zigzag layout over cp=2 with padding rows; labels and loss mask as .npy; " +
                               (why or "correct"),
                "implementation": "torch.nn.functional.cross_entropy, CP" + ("" if variant == "correct" else " + " + variant),
                "shape": {"tokens": n, "vocab": vocab},
                "dtype": "fp32",
                "cu_seqlens": cu,
                "loss": {"kind": "cross_entropy", "reduction": "mean"},
                "layout": {"tp": 1, "cp": cp, "dp": 1, "ga": 1},
                "framework": {"grad_reduce": "avg", "ga_reduce": "sum"},
                "ranks": ranks,
            }, {"exit_code": 1 if expected_fail[variant] else 0, "failing_checks": expected_fail[variant],
                "catalogue": None if variant == "correct" else variant})


# ---------------------------------------------------------------------------------------------------------

FAMILIES = {"ce-dp": (family_ce_dp, 2), "vp-ce": (family_vp_ce, 4), "vp-kd": (family_vp_kd, 2),
            "ce-cp": (family_ce_cp, 2)}


def worker(rank, family, world, out_dir, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    try:
        FAMILIES[family][0](rank, world, out_dir)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    out_dir = sys.argv[1]
    families = sys.argv[2:] or list(FAMILIES)
    os.makedirs(out_dir, exist_ok=True)
    for family in families:
        if family not in FAMILIES:
            print(f"unknown family {family}; known: {', '.join(FAMILIES)}")
            return 2
        world = FAMILIES[family][1]
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(worker, args=(family, world, os.path.abspath(out_dir), os.path.join(tmp, "init")),
                     nprocs=world, join=True)
        print(f"{family}: {world} processes (gloo), torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
