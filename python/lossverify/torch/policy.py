"""The policy objective of one token (docs/spec.md §3.3, ../shared RL.md §2), in float32 as a trainer computes
it, from per-token log-probabilities and entropies: what the harness builds on a function's `LogProbs`, and
what the project's own policy implementations build on their vocabulary-parallel log-prob pass.

    lambda = z_y/T - lse(z/T), H = -sum p log p, ratio r = exp(lambda - old)
    (ratio sequence, GSPO: r = rho_s = exp(mean of lambda - old over the valid tokens of the token's sequence))
    surrogate = max(-r A, -clip(r, 1 - clip_low, 1 + clip_high) A), capped at -c A where A < 0 (dual clip c)
    KL: k1 lambda - ref, k2 (lambda - ref)^2 / 2, k3 exp(ref - lambda) - (ref - lambda) - 1
    l = surrogate + kl_coef KL - entropy_coef H (objective policy_loss); l = -lambda - entropy_coef H (logprob)

A token is clipped where the clipped term is strictly the larger, and dual-clipped where the cap applies
(a dual-clipped token, A < 0 and r > c, is never clipped as well: there -r A is the larger); the logged
statistics are token-means of those flags, of the KL and of the entropy over the step's valid tokens.

Under the sequence-level ratio rho_s depends on every lambda of its sequence, so the surrogate's gradient
is the true derivative of L: dL/dlambda_u = (rho_s / n_s) sum_t w_t (-A_t) [t unclipped] (plus u's KL
slope), which autograd gives through `sequence_log_ratio` (not detached; its per-sequence sums summed over
the CP group by an all-reduce whose backward sums the gradient over the group too).
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["PolicyTerms", "policy_terms", "sequence_log_ratio", "kl_penalty", "token_loss", "statistics_parts"]


@dataclass
class PolicyTerms:
    """One micro-batch's per-token terms (float32 [rows]); surrogate and kl carry the gradient."""

    surrogate: torch.Tensor
    kl: torch.Tensor
    clipped: torch.Tensor  # bool: the clipped term is strictly the larger
    dual_clipped: torch.Tensor  # bool: capped at -c A


def _f32(value):
    return torch.tensor(value, dtype=torch.float32)


def kl_penalty(logprob, ref_logprob, kind):
    """The KL estimator of each token against the reference policy's log-probability."""
    if kind in (None, "none"):
        return torch.zeros_like(logprob)
    d = logprob - ref_logprob
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.exp(-d) + d - 1.0
    raise ValueError(f"unknown KL penalty {kind!r} (none, k1, k2, k3)")


class _SumOverGroup(torch.autograd.Function):
    """Sum over the group in forward, and in backward the gradient summed over the group too: every rank's
    loss depends on every rank's summand (what torch.distributed.nn.functional.all_reduce does with SUM)."""

    @staticmethod
    def forward(fctx, tensor, group):
        fctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(fctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=fctx.group)
        return grad, None


def sequence_log_ratio(logprob, old_logprob, valid, sequences, num_sequences, group=None):
    """GSPO's log rho_s of each row's sequence s: the mean of lambda - old over the valid tokens of s (float32
    [rows]; lambda - old on rows that are not valid), with the gradient through every lambda of s. sequences:
    each row's sequence [rows] (ctx.sequences), an index below num_sequences (len(ctx.sequence_valid_tokens));
    group: the CP group whose ranks hold the other chunks of the sequences, over which the per-sequence sums
    and counts are summed (None: this rank's rows only). The sums, and in backward the gradient's per-sequence
    sums, run in float64: a float32 accumulator over thousands of equal summands drifts by 1e-5 and more."""
    index = torch.where(valid, sequences, torch.zeros_like(sequences))
    own = (logprob - old_logprob).double()
    summands = torch.stack([torch.where(valid, own, torch.zeros_like(own)), valid.to(own.dtype)])
    sums = summands.new_zeros((2, max(num_sequences, 1))).index_add(1, index, summands)
    if group is not None and dist.get_world_size(group) > 1:
        sums = _SumOverGroup.apply(sums, group)
    mean = sums[0] / sums[1].clamp(min=1.0)
    return torch.where(valid, mean[index], own).to(logprob.dtype)


def policy_terms(logprob, old_logprob, ref_logprob, advantages, loss, log_ratio=None):
    """The surrogate and KL of each token (loss: a LossConfig of kind policy). Objective logprob: the
    surrogate is -logprob and the KL 0. old_logprob, ref_logprob, advantages: float32 [rows] (advantages as
    the objective uses them, i.e. whitened when the case whitens them). log_ratio: the log of each token's
    ratio, default its own lambda - old (ratio sequence: `sequence_log_ratio`)."""
    if loss.objective == "logprob":
        none = torch.zeros_like(logprob, dtype=torch.bool)
        return PolicyTerms(-logprob, torch.zeros_like(logprob), none, none.clone())
    device = logprob.device
    ratio = torch.exp(logprob - old_logprob if log_ratio is None else log_ratio)
    low = (_f32(1.0) - _f32(loss.clip_low)).to(device)
    high = (_f32(1.0) + _f32(loss.clip_high)).to(device)
    clipped_ratio = torch.minimum(torch.maximum(ratio, low), high)
    unclipped_term = -ratio * advantages
    clipped_term = -clipped_ratio * advantages
    clipped = clipped_term.detach() > unclipped_term.detach()
    surrogate = torch.where(clipped, clipped_term, unclipped_term)
    dual = torch.zeros_like(clipped)
    if loss.dual_clip > 0:
        cap = -_f32(loss.dual_clip).to(device) * advantages
        dual = (advantages < 0) & (surrogate.detach() > cap)
        surrogate = torch.where(dual, cap.to(surrogate.dtype), surrogate)
    return PolicyTerms(surrogate, kl_penalty(logprob, ref_logprob, loss.kl_penalty), clipped, dual)


def token_loss(terms, entropy, loss, kl_scale=1.0, entropy_scale=1.0):
    """l = surrogate + kl_coef KL - entropy_coef H (kl_scale, entropy_scale multiply the two coefficients);
    entropy None counts as 0 (it must then have coefficient 0)."""
    value = terms.surrogate
    if loss.kl_coef and loss.objective != "logprob":
        value = value + float(_f32(loss.kl_coef)) * kl_scale * terms.kl
    if loss.entropy_coef:
        if entropy is None:
            raise ValueError(f"entropy_coef = {loss.entropy_coef}, but no entropy was computed")
        value = value - float(_f32(loss.entropy_coef)) * entropy_scale * entropy
    return value


def statistics_parts(terms, entropy, valid, num_valid_tokens, kl_scale=1.0, entropy_scale=1.0):
    """This micro-batch's part of each logged statistic: the sum over its valid tokens / N (float64), as
    {"clip_fraction", "dual_clip_fraction", "kl", "entropy"} (entropy left out when None)."""
    n = float(max(num_valid_tokens, 1))
    mask = valid.double()
    parts = {"clip_fraction": (terms.clipped.double() * mask).sum() / n,
             "dual_clip_fraction": (terms.dual_clipped.double() * mask).sum() / n,
             "kl": ((kl_scale * terms.kl.detach().float()).double() * mask).sum() / n}
    if entropy is not None:
        parts["entropy"] = ((entropy_scale * entropy.detach().float()).double() * mask).sum() / n
    return parts


def masked(values: Optional[torch.Tensor], valid):
    """values with masked rows set to 0 (the gradient of masked rows is then 0 too)."""
    if values is None:
        return None
    return torch.where(valid, values, torch.zeros_like(values))
