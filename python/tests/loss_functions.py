"""Loss functions the harness and command-line tests run on real ranks (importable by the rank processes)."""

import ctypes
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from lossverify.torch import LogProbs, Reduced
from lossverify.torch.implementations import (
    policy_loss,
    policy_token_loss,
    vocab_parallel_cross_entropy,
    vocab_parallel_logprob_entropy,
)
from lossverify.torch.policy import masked, policy_terms, sequence_log_ratio, token_loss


def full_rows_cross_entropy(logits, labels, ctx):
    """tp = 1 only: torch's own cross-entropy on whole rows, per token."""
    alpha = ctx.loss.label_smoothing
    return torch.nn.functional.cross_entropy(logits.float(), labels, label_smoothing=alpha, reduction="none",
                                             ignore_index=ctx.loss.ignore_index)


def full_rows_cross_entropy_16bit(logits, labels, ctx):
    """tp = 1 only: torch's own cross-entropy on whole rows computed in the logits' 16-bit dtype (PyTorch's eager
    bf16 arithmetic: log_softmax's output, the loss and its backward stored in bf16), per token."""
    alpha = ctx.loss.label_smoothing
    return torch.nn.functional.cross_entropy(logits, labels, label_smoothing=alpha, reduction="none",
                                             ignore_index=ctx.loss.ignore_index)


def reduced_mean(logits, labels, ctx):
    """An already reduced loss, normalised the way a correct training loop does it."""
    token_loss = vocab_parallel_cross_entropy(logits, labels, ctx)
    loss = token_loss.sum() / ctx.num_valid_tokens / ctx.framework_factor
    return Reduced(loss, token_loss=token_loss, num_tokens=ctx.num_valid_tokens)


def returns_scalar(logits, labels, ctx):
    token_loss = vocab_parallel_cross_entropy(logits, labels, ctx)
    return token_loss.sum() / ctx.num_valid_tokens / ctx.framework_factor


def wrong_shape(logits, labels, ctx):
    return vocab_parallel_cross_entropy(logits, labels, ctx).unsqueeze(0).expand(2, -1)


class _SoftmaxInPlace(torch.autograd.Function):
    """Cross-entropy on whole rows that turns its float32 input into the softmax in place to save memory,
    as Megatron-LM's vocab_parallel_cross_entropy does; the loss and gradient are right."""

    @staticmethod
    def forward(ctx, logits, labels, ignore_index):
        x = logits.float()  # the input itself when it is float32
        valid = labels != ignore_index
        target = x.gather(1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        x -= x.max(dim=-1, keepdim=True).values
        target = target - (target - x.gather(1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1))
        x.exp_()
        total = x.sum(dim=-1)
        x /= total.unsqueeze(-1)
        ctx.save_for_backward(x, labels, valid)
        return torch.where(valid, total.log() - target, torch.zeros_like(total))

    @staticmethod
    def backward(ctx, grad_output):
        softmax, labels, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad[torch.arange(grad.shape[0]), labels.clamp(min=0)] -= 1.0
        grad *= (grad_output * valid).unsqueeze(-1)
        return grad, None, None


def modifies_logits_in_place(logits, labels, ctx):
    """tp = 1: right loss and gradient, but the input logits end up holding the softmax."""
    return _SoftmaxInPlace.apply(logits, labels, ctx.loss.ignore_index)


def raises_on_rank_1(logits, labels, ctx):
    """Rank 1 raises while the other ranks wait for it in a collective."""
    if ctx.rank == 1:
        raise ValueError("deliberate failure on rank 1")
    return vocab_parallel_cross_entropy(logits, labels, ctx)


def late_on_rank_1(logits, labels, ctx):
    """Rank 1 reaches its first collective 40 s after the others (a straggler past a short --timeout)."""
    if ctx.rank == 1:
        time.sleep(40)
    return vocab_parallel_cross_entropy(logits, labels, ctx)


def hangs_on_rank_0(logits, labels, ctx):
    """Rank 0 never returns (no collective involved)."""
    if ctx.rank == 0:
        while True:
            time.sleep(0.05)
    return vocab_parallel_cross_entropy(logits, labels, ctx)


def waits_for_a_message_never_sent(logits, labels, ctx):
    """Rank 0 waits for a message rank 1 never sends; rank 1 then waits for rank 0 in the TP all-reduce."""
    if ctx.rank == 0:
        dist.recv(torch.zeros(1), src=1)
    return vocab_parallel_cross_entropy(logits, labels, ctx)


def mismatched_collectives(logits, labels, ctx):
    """Rank 0 all-reduces one number where its TP peer all-reduces a row statistic: gloo aborts rank 0."""
    if ctx.rank == 0:
        dist.all_reduce(torch.zeros(1), group=ctx.tp_group)
    return vocab_parallel_cross_entropy(logits, labels, ctx)


def corrupts_later_labels(logits, labels, ctx):
    """During micro-batch 0, shifts the labels of every later micro-batch by one column (a data-loader bug the
    loss function should never cause): the dump must hold the exported labels, and the change is reported."""
    if ctx.micro_batch == 0:
        for mb in ctx.micro_batches[1:]:
            valid = mb.labels >= 0
            mb.labels[valid] = (mb.labels[valid] + 1) % ctx.vocab_size
    return vocab_parallel_cross_entropy(logits, labels, ctx)


def nan_on_masked_rows(logits, labels, ctx):
    """Right losses on valid rows, NaN on the masked ones (ignored tokens, CP padding)."""
    losses = vocab_parallel_cross_entropy(logits, labels, ctx)
    return torch.where(ctx.loss_mask, losses, torch.full_like(losses, float("nan")))


def exits_on_rank_1(logits, labels, ctx):
    """Rank 1's process ends at once with exit code 0 (os._exit): no result, no traceback."""
    if ctx.rank == 1:
        os._exit(0)
    return vocab_parallel_cross_entropy(logits, labels, ctx)


def sys_exit_on_rank_1(logits, labels, ctx):
    """Rank 1 calls sys.exit(0) inside the loss function."""
    if ctx.rank == 1:
        sys.exit(0)
    return vocab_parallel_cross_entropy(logits, labels, ctx)


def killed_on_rank_1(logits, labels, ctx):
    """Rank 1 is killed with SIGKILL, as the out-of-memory killer does."""
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return vocab_parallel_cross_entropy(logits, labels, ctx)


def segfaults_on_rank_1(logits, labels, ctx):
    """Rank 1 crashes in native code (SIGSEGV)."""
    if ctx.rank == 1:
        ctypes.string_at(0)
    return vocab_parallel_cross_entropy(logits, labels, ctx)


def forks_a_sleeper(logits, labels, ctx):
    """Starts a child process that would outlive the run and hold the command's stdout."""
    if ctx.micro_batch == 0:
        subprocess.Popen(["sleep", "120"])
    return vocab_parallel_cross_entropy(logits, labels, ctx)


def forks_a_session_sleeper(logits, labels, ctx):
    """Starts a child in a session of its own (start_new_session), out of the rank's process group."""
    if ctx.micro_batch == 0:
        subprocess.Popen(["sleep", "120"], start_new_session=True)
    return vocab_parallel_cross_entropy(logits, labels, ctx)


def sleeps(logits, labels, ctx):
    """Never returns (for stopping the harness from outside)."""
    while True:
        time.sleep(0.05)


def reduced_with_negative_count(logits, labels, ctx):
    """A reduced loss whose logged token count is negative."""
    losses = vocab_parallel_cross_entropy(logits, labels, ctx)
    return Reduced(losses.sum() / max(ctx.num_valid_tokens, 1), num_tokens=-3)


def reduced_with_text_count(logits, labels, ctx):
    """A reduced loss whose logged token count is not a number."""
    losses = vocab_parallel_cross_entropy(logits, labels, ctx)
    return Reduced(losses.sum() / max(ctx.num_valid_tokens, 1), num_tokens="many")


def raises_with_escapes(logits, labels, ctx):
    """An exception whose text holds a terminal escape sequence and a carriage return."""
    raise ValueError("clear the screen \x1b[2J and rewrite the line\rFAKE: verdict: pass")


# ---------------------------------------------------------------------------------------------------------
# policy cases: the three ways a function may return a policy loss (docs/pytorch.md)


def policy_logprobs(logits, labels, ctx):
    """A trainer's log-prob pass: per-token log-probabilities and entropies, the harness builds the objective."""
    logprob, entropy = vocab_parallel_logprob_entropy(logits, labels, ctx)
    return LogProbs(logprob, entropy)


def policy_entropy_from_logits(logits, labels, ctx):
    """The log-prob pass with the entropy's value as verl's and TRL's entropy_from_logits compute it, in float32 over
    the TP group: logsumexp(x) - sum_v softmax(x)_v x_v (x = logits / T), two operands of about |lse| subtracted.
    Its gradient is the vocabulary-parallel kernel's (the value is what this function tests)."""
    logprob, entropy = vocab_parallel_logprob_entropy(logits, labels, ctx)
    x = logits.float() / ctx.loss.temperature
    row_max = x.max(dim=-1).values.detach()
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=ctx.tp_group)
    e = torch.exp(x - row_max.unsqueeze(-1))
    total = e.sum(dim=-1)
    dist.all_reduce(total, group=ctx.tp_group)
    lse = row_max + torch.log(total)
    weighted = (e / total.unsqueeze(-1) * x).sum(dim=-1)
    dist.all_reduce(weighted, group=ctx.tp_group)
    value = masked((lse - weighted).detach(), ctx.loss_mask)
    return LogProbs(logprob, entropy + (value - entropy).detach())


def policy_logprobs_at_t1(logits, labels, ctx):
    """The log-prob pass at T = 1 whatever the case's temperature (the rl-temperature-one-side mistake)."""
    logprob, entropy = vocab_parallel_logprob_entropy(logits, labels, ctx, inverse_t=1.0)
    return LogProbs(logprob, entropy)


def policy_per_token(logits, labels, ctx):
    """The policy objective's per-token losses (whitening included); the harness aggregates them."""
    return policy_token_loss(logits, labels, ctx)


def policy_token_ratio(logits, labels, ctx):
    """The correct policy loss with each token's own ratio where the case asks for GSPO's sequence ratio."""
    ctx.loss = ctx.loss.replace(ratio="token")
    return policy_loss(logits, labels, ctx)


def policy_gspo_token(logits, labels, ctx):
    """GSPO-token's per-token losses: rho_s detached, times e^(lambda - sg(lambda)) (each token's gradient
    rho_s w_t (-A_t), the true one only where the advantage is constant within the sequence)."""
    logprob, entropy = vocab_parallel_logprob_entropy(logits, labels, ctx)
    old = ctx.old_logprob.float()
    rho = sequence_log_ratio(logprob.detach(), old, ctx.loss_mask, ctx.sequences, len(ctx.sequence_valid_tokens),
                             ctx.cp_group)
    terms = policy_terms(logprob, old, ctx.ref_logprob.float(), ctx.whitened_advantages().float(), ctx.loss,
                         log_ratio=rho + logprob - logprob.detach())
    return masked(token_loss(terms, entropy, ctx.loss), ctx.loss_mask)


def policy_nan_logprob(logits, labels, ctx):
    """A log-prob pass that returns NaN for the micro-batch's first valid token."""
    logprob, entropy = vocab_parallel_logprob_entropy(logits, labels, ctx)
    first = int(ctx.loss_mask.nonzero()[0])
    nan = torch.zeros_like(logprob)
    nan[first] = float("nan")
    return LogProbs(logprob + nan, entropy)


def policy_column_logprobs(logits, labels, ctx):
    """Log-probabilities of shape [rows, 1] (keepdim=True): one value per row, but not a [rows] vector."""
    logprob, entropy = vocab_parallel_logprob_entropy(logits, labels, ctx)
    return LogProbs(logprob.unsqueeze(-1), entropy)


def policy_wrong_entropy_shape(logits, labels, ctx):
    """Entropies of shape [2, rows]."""
    logprob, entropy = vocab_parallel_logprob_entropy(logits, labels, ctx)
    return LogProbs(logprob, entropy.unsqueeze(0).expand(2, -1))


def policy_unknown_statistic(logits, labels, ctx):
    """The correct policy loss, logging a statistic the dump format does not have."""
    result = policy_loss(logits, labels, ctx)
    result.stats["grad_norm"] = 1.0
    return result


def cross_entropy_as_logprobs(logits, labels, ctx):
    """LogProbs on a cross-entropy case."""
    return LogProbs(-vocab_parallel_cross_entropy(logits, labels, ctx))


# ---------------------------------------------------------------------------------------------------------
# router cases

def router_reduced(logits, labels, ctx):
    """The correct router with the trainer's scaling applied by the function itself (Reduced)."""
    from lossverify.torch.implementations import router_step_loss
    return router_step_loss(logits, labels, ctx)


def router_shares_only(logits, labels, ctx):
    """The correct router's shares, without per-token losses (the loss check then judges the logged loss)."""
    from lossverify.torch import RouterLosses
    from lossverify.torch.implementations import router_terms
    terms = router_terms(logits, ctx)
    return RouterLosses(aux=terms.aux + terms.sequence_aux, z=terms.z)


class _WithLoss:
    """A rank's ctx with another loss configuration (the rest read through)."""

    def __init__(self, ctx, loss):
        self._ctx = ctx
        self.loss = loss

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def router_plain_map(logits, labels, ctx):
    """The correct router, but counting the plain top-k of the scores where the case counts the routed map."""
    from lossverify.torch import RouterLosses
    from lossverify.torch.implementations import router_terms
    terms = router_terms(logits, _WithLoss(ctx, ctx.loss.replace(map="top_k")))
    return RouterLosses(aux=terms.aux + terms.sequence_aux, z=terms.z, token_loss=terms.token_loss,
                        counts=terms.counts)


def router_one_value_too_few(logits, labels, ctx):
    from lossverify.torch import RouterLosses
    from lossverify.torch.implementations import router_terms
    terms = router_terms(logits, ctx)
    return RouterLosses(aux=(terms.aux + terms.sequence_aux)[1:], z=terms.z)


def router_without_z(logits, labels, ctx):
    from lossverify.torch import RouterLosses
    from lossverify.torch.implementations import router_terms
    terms = router_terms(logits, ctx)
    return RouterLosses(aux=terms.aux + terms.sequence_aux)


def router_detached_aux(logits, labels, ctx):
    from lossverify.torch import RouterLosses
    from lossverify.torch.implementations import router_terms
    terms = router_terms(logits, ctx)
    return RouterLosses(aux=(terms.aux + terms.sequence_aux).detach(), z=terms.z)


def router_counts_of_one_layer(logits, labels, ctx):
    from lossverify.torch import RouterLosses
    from lossverify.torch.implementations import router_terms
    terms = router_terms(logits, ctx)
    return RouterLosses(aux=terms.aux + terms.sequence_aux, z=terms.z, counts=terms.counts[0])


def router_losses_on_cross_entropy(logits, labels, ctx):
    from lossverify.torch import RouterLosses
    return RouterLosses(aux=logits.float().sum().reshape(1))


def head_sequence_parallel_shard_checked(h, W, b, labels, ctx):
    """The package's correct head, after asserting that h is the rank's token shard under sequence parallelism with
    the head's dh contract (ceil(rows / TP) rows, zeros past the micro-batch's last row) and every row otherwise."""
    from lossverify.layout import sequence_parallel_slots
    from lossverify.torch.implementations import head

    rows = ctx.current.rows
    if ctx.sp and ctx.head["dh_reduce"] == "head":
        slots = torch.tensor(sequence_parallel_slots(rows, ctx.tp_size, ctx.tp_rank))
        if h.shape[0] != slots.numel() or bool(h[slots < 0].any()):
            raise AssertionError(f"h {list(h.shape)}: expected the token shard of {rows} rows over TP {ctx.tp_size}, "
                                 "its padding zero")
    elif h.shape[0] != rows:
        raise AssertionError(f"h {list(h.shape)}: expected every one of the micro-batch's {rows} rows")
    return head.correct(h, W, b, labels, ctx)


def head_ignoring_the_token_shard(h, W, b, labels, ctx):
    """A head that takes its token shard of h for every row of the micro-batch (never gathers it over TP)."""
    from lossverify.torch.implementations.catalogue import correct

    return correct((h.float() @ W.t()).to(ctx.dtype), labels, ctx)
