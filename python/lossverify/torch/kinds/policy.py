"""The policy kind in the harness (docs/pytorch.md): the step's counts and advantage moments, each token's weight
under the case's aggregation, `LogProbs` (a trainer's log-prob pass, on which the harness builds the case's
objective) and the advantages as the objective uses them (`ctx.whitened_advantages()`)."""

import torch
import torch.distributed as dist

from lossverify.torch.kinds import HarnessKind, register_harness_kind
from lossverify.torch.policy import masked, policy_terms, sequence_log_ratio, statistics_parts
from lossverify.torch.policy import token_loss as policy_token_loss

__all__ = ["LogProbs", "PolicyHarness"]


class LogProbs:
    """What a trainer's log-prob pass returns for a policy case: the per-token log-probabilities of the labels
    at the case's temperature, logprob [rows], and the entropies of the tempered softmax, entropy [rows]
    (None: not computed; then the case's entropy_coef must be 0). Both must depend on the logits (they carry
    the gradient) and be finite on valid rows; masked rows are ignored (dumped as 0).

    The harness judges both token by token (the `logprob` and `entropy` checks), builds the case's objective
    on them (ratio to ctx.old_logprob, each token's or, under loss.ratio "sequence", its sequence's over every
    CP rank; clip, dual clip, KL to ctx.ref_logprob, entropy bonus, the whitened advantages; or -logprob -
    entropy_coef H), weighs each token by the case's aggregation, back-propagates through the returned values
    and logs L, N and the statistics computed from them.
    """

    def __init__(self, logprob, entropy=None):
        self.logprob = logprob
        self.entropy = entropy

    def __repr__(self):
        return f"LogProbs(logprob={self.logprob!r}, entropy={self.entropy!r})"


def whitened_advantages(ctx):
    """The current micro-batch's advantages as the policy objective uses them (float32 [rows]): whitened
    with the step's mean and deviation, (A - mu) / (sigma + whiten_epsilon), when the case whitens them
    (0 on masked rows), as given otherwise; None where the case has none (objective logprob)."""
    advantages = ctx.advantages
    if advantages is None or not ctx.loss.whiten_advantages:
        return advantages
    mean = torch.tensor(ctx.advantage_mean, dtype=torch.float32)
    scale = 1.0 / (torch.tensor(ctx.advantage_std, dtype=torch.float32) +
                   torch.tensor(ctx.loss.whiten_epsilon, dtype=torch.float32))
    whitened = (advantages.float() - mean.to(advantages.device)) * scale.to(advantages.device)
    return torch.where(ctx.loss_mask, whitened, torch.zeros_like(whitened))


class PolicyHarness(HarnessKind):
    result_types = (LogProbs,)
    context_methods = {"whitened_advantages": whitened_advantages}

    def step_values(self, inputs, micro_batches, groups, device):
        """As a framework computes them before micro-batch 0, over DP x CP: the valid tokens n_s of every
        sequence (sequence_valid_tokens), B (num_sequences: sequences with n_s > 0), and the advantages' mean and
        unbiased deviation over the step's valid tokens (advantage_mean, advantage_std: float64 moments of the
        float32 advantages; None where the case has none)."""
        dp_cp_group = groups["dp_cp"]
        if inputs.cu_seqlens:
            sequences = len(inputs.cu_seqlens) - 1
        else:
            top = torch.tensor(max([int(mb.sequences.max()) for mb in micro_batches if mb.rows] or [-1]) + 1,
                               dtype=torch.int64, device=device)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=dp_cp_group)
            sequences = int(top.item())
        counts = torch.zeros(max(sequences, 1), dtype=torch.int64, device=device)
        moments = torch.zeros(3, dtype=torch.float64, device=device)
        with_advantages = False
        for mb in micro_batches:
            valid = mb.loss_mask
            counts.index_add_(0, mb.sequences[valid], torch.ones_like(mb.sequences[valid]))
            if mb.advantages is not None:
                with_advantages = True
                a = mb.advantages[valid].double()
                moments += torch.stack([torch.tensor(float(a.numel()), dtype=torch.float64, device=device), a.sum(),
                                        (a * a).sum()])
        dist.all_reduce(counts, group=dp_cp_group)
        dist.all_reduce(moments, group=dp_cp_group)
        step = {"num_sequences": int((counts > 0).sum()), "sequence_valid_tokens": counts[:sequences],
                "advantage_mean": None, "advantage_std": None}
        if with_advantages:
            n = max(float(moments[0]), 1.0)
            mean = float(moments[1]) / n
            variance = max(float(moments[2]) - n * mean * mean, 0.0) / (n - 1.0) if n > 1.0 else 0.0
            step.update(advantage_mean=mean, advantage_std=variance ** 0.5)
        return step

    def aggregation_weights(self, ctx):
        """token-mean 1/N, token-sum 1, seq-mean-token-sum 1/B, seq-mean-token-mean 1/(B n_s),
        seq-mean-token-sum-norm 1/(B norm_constant)."""
        mask = ctx.loss_mask.double()
        aggregation = ctx.loss.aggregation
        if aggregation == "token-sum":
            return mask
        if aggregation == "token-mean":
            return mask / ctx.num_valid_tokens if ctx.num_valid_tokens else mask * 0.0
        sequences = max(ctx.num_sequences, 1)
        if aggregation == "seq-mean-token-sum":
            return mask / sequences
        if aggregation == "seq-mean-token-sum-norm":
            return mask / (sequences * ctx.loss.norm_constant)
        if aggregation == "seq-mean-token-mean":
            n_s = ctx.sequence_valid_tokens[ctx.sequences.clamp(min=0)].double().clamp(min=1.0)
            return mask / (sequences * n_s)
        raise ValueError(f"unknown policy aggregation {aggregation!r}")

    weighs_by_reduction = False

    def token_mean(self, loss):
        return loss.aggregation == "token-mean"

    def logs_loss(self, loss):
        return True  # a policy loss is always aggregated to L

    def dumps_grad_output(self, loss):
        return False

    def add_result(self, step, result, rows, ctx, fail):
        """LogProbs: the case's objective on the function's log-probabilities and entropies (under ratio
        sequence, on each sequence's ratio, all-reduced over CP: this micro-batch's CP peers call it too)."""
        loss, valid = ctx.loss, ctx.loss_mask
        logprob = step.per_token(result.logprob, "LogProbs(logprob=...)", rows, fail, True)
        entropy = None
        if result.entropy is not None:
            entropy = step.per_token(result.entropy, "LogProbs(entropy=...)", rows, fail, loss.entropy_coef != 0)
        elif loss.entropy_coef:
            fail(f"LogProbs(entropy=None), but the case's entropy_coef is {loss.entropy_coef}: the objective "
                 "needs each token's entropy")
        step.set_mode("logprobs", fail)
        lp = masked(logprob.float(), valid)
        h = masked(entropy.float(), valid) if entropy is not None else None
        log_ratio = None
        if loss.objective == "logprob":
            old = ref = advantages = None
        else:
            old, ref, advantages = ctx.old_logprob, ctx.ref_logprob, ctx.whitened_advantages()
            if old is None or ref is None or advantages is None:
                raise RuntimeError("harness: a policy_loss case without old_logprob, ref_logprob or advantages in "
                                   "its exported inputs")
            old, ref, advantages = old.float(), ref.float(), advantages.float()
            if loss.ratio == "sequence":  # GSPO: rho_s over each sequence's chunks on every CP rank
                log_ratio = sequence_log_ratio(lp, old, valid, ctx.sequences, len(ctx.sequence_valid_tokens),
                                               ctx.cp_group)
        terms = policy_terms(lp, old, ref, advantages, loss, log_ratio=log_ratio)
        token_loss = masked(policy_token_loss(terms, h, loss), valid)
        objective = step.weigh(token_loss, ctx)
        step.add_statistics(statistics_parts(terms, h, valid, step.num_valid))
        step.loss_dtype = torch.float32
        per_token = {"token_logprob": step.dumped(logprob, valid)}
        if entropy is not None:
            per_token["token_entropy"] = step.dumped(entropy, valid)
        return objective, token_loss.detach(), per_token


register_harness_kind("policy", PolicyHarness())
