"""The router kind in PyTorch (docs/spec.md §3, the router section; ../shared/MOE.md): per MoE layer, the scores
(softmax, or sigmoid normalised over the experts), the top-k map, the micro-batch scope's counts and valid tokens
all-reduced over the sequence partition (CP, and TP under sequence parallelism) and detached, then this rank's
share of the aux terms

    aux:        alpha E / (k T^2)          sum_e c_e     sum_t s_te       (the Switch form over the scope)
    sequence:   alpha_s E / (k S_j^2 H)    sum_e c_j,e   sum_{t in j} s_te (each sequence j, H of them)
    global:     alpha_g E / (k T_G T)      sum_e c^G_e   sum_t s_te       (the step's or running counts)
    z:          alpha_z / T                sum_t lse(z_t)^2

over its valid tokens, as Megatron's router computes them. `router_losses` returns them as `RouterLosses` (the
harness applies the scaling contract); `router_step_loss` applies the contract itself, as a trainer's
MoEAuxLossAutoScaler, schedule and finalize_model_grads do, and returns `Reduced`. `RouterBugs` are the
catalogued bugs of MOE.md §4 (`lossverify list`), each a switch here.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lossverify.torch.context import Reduced
from lossverify.torch.kinds.router import (RouterLosses, expert_bias, logged_aux_divisor, micro_batch_weight,
                                           scope_group)

__all__ = ["RouterBugs", "router_terms", "router_losses", "router_step_loss"]

# moe-aux-global-topk's global setting, read where the router's own k should be.
GLOBAL_TOP_K = 2


@dataclass(frozen=True)
class RouterBugs:
    local_counts: bool = False  # moe-aux-local-counts: counts and T of the rank's own tokens
    topk_squared: bool = False  # moe-aux-topk-squared: the aux terms divided by k^2
    tp_sum: bool = False  # moe-aux-tp-sum: under SP the aux gradient summed over TP (x TP)
    cp_missing: bool = False  # moe-aux-cp-missing: the injected gradient without the CP factor (/ CP)
    padding_counted: bool = False  # moe-aux-padding-counted: every row counted in T and c
    no_grad: bool = False  # moe-aux-no-grad: the aux gradient discarded
    log_doubled: bool = False  # moe-aux-log-doubled: the logged aux loss x 2
    ga_overweight: bool = False  # moe-aux-ga-overweight: the aux gradient x DP GA
    per_token_divided: bool = False  # moe-aux-per-token-divided: per-token aux gradient / N
    per_token_tp_cp: bool = False  # moe-aux-per-token-tp-cp: per-token router gradient / (TP CP)
    seq_aux_mbs: bool = False  # moe-seq-aux-mbs: per-token sequence aux gradient / the micro-batch's sequences
    count_not_returned: bool = False  # moe-aux-count-not-returned: per-token at CP > 1, x N
    global_topk: bool = False  # moe-aux-global-topk: top_k = 2 whatever the router's
    per_token_rank_count: bool = False  # moe-aux-per-token-rank-count: T_S as the rank's count x the scope's ranks
    zloss_rank_mean: bool = False  # moe-zloss-rank-mean: default mode, alpha_z / (ranks x the rank's own tokens)
    per_token_reduced_count: bool = False  # moe-aux-per-token-reduced-count: per-token aux gradient x the ranks
    seq_aux_mean_length: bool = False  # moe-seq-aux-mean-length: every sequence takes the mean length T / H
    global_mean_counts: bool = False  # moe-global-aux-mean-counts: running f = mean counts / the micro-batch's tokens
    global_batch_tokens: bool = False  # moe-global-aux-batch-tokens: P over the micro-batch's tokens of every rank
    mask_ignored: bool = False  # moe-aux-mask-ignored: padded and masked rows routed as tokens, given a gradient
    mask_counts_only: bool = False  # moe-aux-mask-counts-only: the mask reaches the experts' counts only
    ga_double_divide: bool = False  # moe-aux-ga-double-divide: the aux gradient / GA once more
    seq_aux_packed: bool = False  # moe-seq-aux-packed: the micro-batch one sequence in the sequence aux loss
    aux_loss_dp_ga_summed: bool = False  # moe-aux-loss-dp-ga-summed: every aux term's value and gradient x DP GA


def _scores(z, score):
    """[rows, layers, E] float32 scores and lse(z) [rows, layers]."""
    lse = torch.logsumexp(z, dim=-1)
    if score == "softmax":
        return torch.exp(z - lse.unsqueeze(-1)), lse
    s = torch.sigmoid(z)
    return s / s.sum(dim=-1, keepdim=True), lse


def _routed(s, k):
    """The top-k map [rows, layers, E] (1.0 where routed), from scores without gradient."""
    routed = torch.zeros_like(s)
    if s.shape[0] and k:
        routed.scatter_(-1, torch.topk(s, k, dim=-1).indices, 1.0)
    return routed


def _routed_map(z, s, loss, top_k, take):
    """The routed map [rows, layers, E] (MOE.md §1; the case's map: routed), as a router dispatches: keys = the
    routing scores (softmax p, or sigmoid sigma(z) not normalised) + the expert bias; with groups, each group scored
    by the sum of its top k / top_groups keys and the best top_groups groups kept; the top-k keys among their experts
    route the token, and its first `take` of them count."""
    rows, layers, width = z.shape
    keys = (s if loss.score == "softmax" else torch.sigmoid(z)) + expert_bias(loss, layers, width, z.device)
    groups = int(loss.groups)
    if groups > 1 and rows:
        size = width // groups
        best = max(top_k // int(loss.top_groups), 1)
        group_scores = keys.reshape(rows, layers, groups, size).topk(best, dim=-1).values.sum(dim=-1)
        chosen = group_scores.topk(int(loss.top_groups), dim=-1).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, chosen, True)
        keys = keys.masked_fill(~kept.repeat_interleave(size, dim=-1), float("-inf"))
    routed = torch.zeros_like(s)
    if rows:
        routed.scatter_(-1, torch.topk(keys, top_k, dim=-1).indices[..., :take], 1.0)
    return routed


def _token_map(z, s, loss, top_k):
    """The experts each token counts for [rows, layers, E]: its top-k (or first choice) of the plain map, or of the
    routed map."""
    take = 1 if loss.counts == "first" else top_k
    if loss.map == "routed":
        return _routed_map(z, s, loss, top_k, take)
    return _routed(s, take)


def _all_sequences(ctx):
    """The step's number of sequences (ids index per-sequence sums)."""
    def compute():
        top = torch.tensor(max([int(mb.sequences.max()) for mb in ctx.micro_batches if mb.rows] or [-1]) + 1,
                           dtype=torch.int64, device=ctx.device)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ctx.batch_group)
        return int(top.item())
    if "router_sequences" not in ctx.state:
        ctx.state["router_sequences"] = compute()
    return ctx.state["router_sequences"]


def _global_counts(ctx, top_k):
    """The global aux loss's counts and tokens per layer [layers, E + 1] on this rank: the valid rows of every
    micro-batch (step) or of micro-batches 0..m (running), from the step's router logits (ctx.micro_batches[k].logits,
    as a trainer's pre-pass over the step routes them); all-reduced over the ranks holding other tokens by the
    caller."""
    last = len(ctx.micro_batches) if ctx.loss.global_counts == "step" else ctx.micro_batch + 1
    layers = int(ctx.loss.layers)
    width = ctx.vocab_size // layers
    sums = torch.zeros(layers, width + 1, dtype=torch.float32, device=ctx.device)
    for mb in ctx.micro_batches[:last]:
        valid = mb.loss_mask
        z = mb.logits.float().reshape(-1, layers, width)[valid]
        s, _ = _scores(z, ctx.loss.score)
        sums[:, :width] += _token_map(z, s, ctx.loss, top_k).sum(dim=0)
        sums[:, width] += float(valid.sum())
    return sums


@dataclass
class RouterTerms:
    """One micro-batch's shares on this rank, per layer [layers]: the aux and global aux terms, the sequence aux
    term and the z-loss (routed padding's too, under the bugs that route it); each row's own part of them summed over
    layers, l_t [rows] (0 on masked rows); and the scope's counts per expert [layers, E] as the rank holds them after
    their all-reduce."""
    aux: torch.Tensor
    sequence_aux: torch.Tensor
    z: torch.Tensor
    token_loss: torch.Tensor
    counts: torch.Tensor


def router_terms(logits, ctx, bugs=RouterBugs()):
    """This rank's shares of the current micro-batch's router terms (see the module docstring)."""
    loss = ctx.loss
    layers = int(loss.layers)
    width = logits.shape[-1] // layers
    top_k = GLOBAL_TOP_K if bugs.global_topk else int(loss.top_k)
    divisor = 1.0 if loss.counts == "first" or not loss.divide_by_k else float(top_k)
    k_div = divisor * divisor if bugs.topk_squared else divisor
    z = logits.float().reshape(-1, layers, width)
    s, lse = _scores(z, loss.score)
    valid = ctx.loss_mask
    # moe-aux-padding-counted counts every row in T and the scores' sums; the bugs that route padding as tokens give
    # it a gradient too, and moe-aux-mask-counts-only keeps it out of the experts' counts.
    padding_routed = bugs.mask_ignored or bugs.mask_counts_only
    counted = torch.ones_like(valid) if bugs.padding_counted or padding_routed else valid
    in_counts = valid if bugs.mask_counts_only else counted
    rows = counted if padding_routed else valid  # the rows whose terms enter the objective
    with torch.no_grad():
        routed = _token_map(z.detach(), s.detach(), loss, top_k) * in_counts.float().reshape(-1, 1, 1)
        scope = torch.cat([routed.sum(dim=0), counted.float().sum().expand(layers, 1)], dim=1)  # [layers, E + 1]
        sequences = _all_sequences(ctx)
        ids = ctx.sequences.clamp(min=0)
        per_sequence = torch.zeros(sequences, layers, width + 1, dtype=torch.float32, device=z.device)
        per_sequence[:, :, :width].index_add_(0, ids, routed)
        per_sequence[:, :, width].index_add_(0, ids, counted.float().reshape(-1, 1).expand(-1, layers))
        present = torch.zeros(sequences, dtype=torch.float32, device=z.device)
        present.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
        if not bugs.local_counts:
            for sums in (scope, per_sequence):
                dist.all_reduce(sums, group=scope_group(ctx))
        dist.all_reduce(present, group=scope_group(ctx))
        held = max(float((per_sequence[:, 0, width] > 0).sum()), 1.0)
        tokens = max(float(scope[0, width]), 1.0)
        ctx.state["router_micro_batch_sequences"] = float((present > 0).sum())
    e = float(width)
    vs, vlse = s[rows], lse[rows]  # [n, layers, E], [n, layers]
    keep = valid[rows]  # the rows among them with a per-token loss (all but routed padding)
    # pool_layers (transformers): one aux loss over every layer's counts, over layers x tokens
    aux_counts = scope[:, :width].sum(dim=0, keepdim=True) if loss.pool_layers else scope[:, :width]
    aux_tokens = tokens * (layers if loss.pool_layers else 1)
    aux_rows = (vs * aux_counts).sum(dim=2) * (loss.aux_coef * e / (k_div * aux_tokens * aux_tokens))  # [n, layers]
    own = per_sequence[ids[rows]]  # [n, layers, E + 1]
    if bugs.seq_aux_packed:  # the micro-batch one sequence
        own, held = scope.unsqueeze(0).expand_as(own), 1.0
    sequence_tokens = own[:, :, width].clamp(min=1.0)
    if bugs.seq_aux_mean_length:
        sequence_tokens = torch.full_like(sequence_tokens, max(tokens / held, 1.0))
    sequence_scale = loss.seq_aux_coef * e / (k_div * sequence_tokens * sequence_tokens * held)
    sequence_rows = sequence_scale * (own[:, :, :width] * vs).sum(dim=2)
    if loss.global_aux_coef > 0:
        with torch.no_grad():
            c_global = _global_counts(ctx, top_k)
            dist.all_reduce(c_global, group=ctx.batch_group)
        global_tokens = c_global[:, width]
        f_tokens, p_tokens = global_tokens.clamp(min=1.0), tokens
        if bugs.global_mean_counts or bugs.global_batch_tokens:
            batch_tokens = valid.float().sum()
            dist.all_reduce(batch_tokens, group=ctx.batch_group)
            if bugs.global_mean_counts and loss.global_counts == "running":
                f_tokens = (ctx.micro_batch + 1) * batch_tokens.expand_as(f_tokens)
            if bugs.global_batch_tokens:
                p_tokens = batch_tokens
        global_scale = torch.where(global_tokens > 0, loss.global_aux_coef * e / (divisor * f_tokens * p_tokens),
                                   torch.zeros_like(global_tokens))
        aux_rows = aux_rows + global_scale * (vs * c_global[:, :width]).sum(dim=2)
    if bugs.aux_loss_dp_ga_summed:  # the trainer sums the loss the aux terms are in over micro-batches and DP
        aux_rows, sequence_rows = aux_rows * (ctx.dp_size * ctx.ga), sequence_rows * (ctx.dp_size * ctx.ga)
    z_weight = loss.z_loss_coef / tokens
    if bugs.zloss_rank_mean and loss.scaling != "per_token" and int(valid.sum()) > 0:
        sharing = ctx.cp_size * (ctx.tp_size if ctx.sp else 1)
        z_weight = loss.z_loss_coef / (sharing * float(valid.sum()))
    z_rows = z_weight * vlse * vlse
    token_loss = torch.zeros(valid.shape[0], dtype=torch.float32, device=z.device)
    token_loss[valid] = (aux_rows + sequence_rows + z_rows)[keep].detach().sum(dim=1)
    return RouterTerms(aux_rows.sum(dim=0), sequence_rows.sum(dim=0), z_rows.sum(dim=0), token_loss,
                       scope[:, :width].clone())


def router_losses(logits, labels, ctx):
    """The correct router: RouterLosses of this rank's shares (the harness applies the scaling contract)."""
    terms = router_terms(logits, ctx)
    return RouterLosses(aux=terms.aux + terms.sequence_aux, z=terms.z, token_loss=terms.token_loss,
                        counts=terms.counts)


def _factors(ctx, bugs):
    """(aux, sequence aux, all): what the trainer's scaling multiplies each part of the gradient by, as the bugs
    move it (1 each for the correct contract)."""
    per_token = ctx.loss.scaling == "per_token"
    aux, sequence, whole = 1.0, 1.0, 1.0
    if bugs.tp_sum and ctx.sp:
        aux = float(ctx.tp_size)
    if bugs.cp_missing:
        whole = 1.0 / ctx.cp_size
    if bugs.no_grad:
        aux = 0.0
    if bugs.ga_overweight:
        aux *= ctx.ga * ctx.dp_size
    if bugs.ga_double_divide:
        aux /= ctx.ga
    if not per_token:
        return aux, sequence, whole
    n = float(ctx.num_valid_tokens)
    if bugs.per_token_divided:
        aux /= n
    if bugs.per_token_tp_cp:
        whole /= ctx.tp_size * ctx.cp_size
    if bugs.seq_aux_mbs:
        sequence = 1.0 / max(ctx.state["router_micro_batch_sequences"], 1.0)
    if bugs.count_not_returned and ctx.cp_size > 1:
        whole *= n
    if bugs.per_token_rank_count:
        own = float(ctx.loss_mask.sum())
        sharing = ctx.cp_size * (ctx.tp_size if ctx.sp else 1)
        whole *= own * sharing / ctx.scope_tokens[ctx.micro_batch]
    if bugs.per_token_reduced_count:
        aux *= ctx.cp_size * (ctx.tp_size if ctx.sp else 1)
    return aux, sequence, whole


def router_step_loss(logits, labels, ctx, bugs=RouterBugs()):
    """The router's terms with the trainer's scaling applied here: the micro-batch's weight (1/(DP GA), or T_S / N
    in per-token mode with the framework's later division by N undone), over the framework factor, each part's
    factor as the bugs move it; logs L, aux_loss and z_loss (the mean over layers) and each layer's."""
    terms = router_terms(logits, ctx, bugs)
    layers = int(ctx.loss.layers)
    forward = micro_batch_weight(ctx)
    backward = forward / ctx.framework_factor
    if ctx.loss.scaling == "per_token":
        backward *= ctx.num_valid_tokens
    aux, sequence, whole = _factors(ctx, bugs)
    objective = backward * whole * (aux * (terms.aux + sequence * terms.sequence_aux) + terms.z).sum()
    logged_aux = (terms.aux + terms.sequence_aux).detach().double()
    if bugs.log_doubled:
        logged_aux = 2.0 * logged_aux
    z = terms.z.detach().double()
    stats = {"aux_loss": forward * logged_aux.sum() / logged_aux_divisor(ctx.loss), "z_loss": forward * z.sum() / layers}
    if layers > 1:
        for layer in range(layers):
            stats[f"aux_loss.layer{layer}"] = forward * logged_aux[layer]
            stats[f"z_loss.layer{layer}"] = forward * z[layer]
    logged = forward * float((terms.aux + terms.sequence_aux + terms.z).detach().double().sum())
    return Reduced(objective, token_loss=terms.token_loss, logged=logged, stats=stats, counts=terms.counts)
