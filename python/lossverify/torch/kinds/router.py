"""The router kind in the harness (docs/pytorch.md, "Router cases"): the step's counts a trainer computes before
micro-batch 0, each micro-batch's weight in the step's loss under the case's scaling contract, and `RouterLosses`
(a router's aux terms and z-loss of one micro-batch, on which the harness applies the contract itself)."""

import torch
import torch.distributed as dist

from lossverify.torch.kinds import HarnessKind, register_harness_kind

__all__ = ["RouterLosses", "RouterHarness", "scope_group", "micro_batch_weight", "backward_weight",
           "logged_aux_divisor", "expert_bias"]


class RouterLosses:
    """What a router's loss function returns for one micro-batch: this rank's share of each MoE layer's aux terms
    (`aux`: the aux, sequence aux and global aux losses with their coefficients, added) and of its z-loss (`z`;
    None where the case's z_loss_coef is 0), before the trainer's scaling. Each is a tensor of one value per layer
    ([layers], or a list of one-element tensors; one value for one layer) that depends on the router logits.

    A layer's value over its micro-batch is the sum of the shares of the ranks of the sequence partition (CP, and TP
    under sequence parallelism; without it every TP rank holds the same tokens and gives the same share). A share
    that carries its own tokens' terms, with the counts all-reduced over the partition and detached, gives each rank
    the gradient of its own tokens: Megatron's switch_load_balancing_loss_func does so.

    The harness weighs the micro-batch as the case's scaling says (default: 1/(DP GA); per_token: its share T_S / N
    of the step's valid tokens, with the framework's division by N after the reduction), divides by the framework
    factor, back-propagates into the logits, and logs L, aux_loss and z_loss (each the mean over layers; under
    pool_layers aux_loss is the one pooled loss) and, with several layers, each layer's.

    `token_loss` (optional, [rows]): each valid token's own part of the terms summed over layers, l_t = sum over
    layers of sum_e w_e s_te + alpha_z lse(z_t)^2 / T (w_e: the aux terms' weights from the counts), judged token by
    token (`loss`); masked rows are dumped as 0. `counts` (optional, [layers, experts]): the micro-batch scope's
    counts per expert as the rank holds them after their all-reduce (what a trainer logs as tokens per expert),
    judged exactly (`counts`)."""

    def __init__(self, aux, z=None, token_loss=None, counts=None):
        self.aux = aux
        self.z = z
        self.token_loss = token_loss
        self.counts = counts

    def __repr__(self):
        return (f"RouterLosses(aux={self.aux!r}, z={self.z!r}, token_loss={self.token_loss!r}, "
                f"counts={self.counts!r})")


def scope_group(ctx):
    """The sequence partition a micro-batch's scope spans: CP, and TP under sequence parallelism."""
    return ctx.tp_cp_group if ctx.sp else ctx.cp_group


def micro_batch_weight(ctx):
    """The current micro-batch's weight in the step's loss L: 1/(DP GA) (the mean over the step's micro-batches) or,
    in per-token mode, its scope's valid tokens over the step's, T_S / N."""
    if ctx.loss.scaling == "per_token":
        return ctx.scope_tokens[ctx.micro_batch] / max(ctx.num_valid_tokens, 1)
    return 1.0 / (ctx.dp_size * ctx.ga)


def logged_aux_divisor(loss):
    """What the logged aux loss divides the layers' terms by: their mean over layers, or (pool_layers) the one pooled
    loss itself."""
    return 1 if loss.pool_layers else int(loss.layers)


def expert_bias(loss, layers, experts, device=None):
    """The router's expert bias [layers, experts] float32 for a case's `expert_bias` beta (docs/spec.md, the routed
    map): b_le = fl32(beta (2 frac(j phi) - 1)) with j = l E + e + 1 and phi = (sqrt 5 - 1) / 2, computed in float64
    as every implementation computes it. Load it into a framework's router (its expert_bias buffer) to judge it."""
    phi = 0.6180339887498949
    beta = float(loss.expert_bias)
    values = []
    for j in range(1, layers * experts + 1):
        u = j * phi
        values.append(beta * (2.0 * (u - float(int(u))) - 1.0))
    return torch.tensor(values, dtype=torch.float64, device=device).to(torch.float32).reshape(layers, experts)


def backward_weight(ctx):
    """What the micro-batch's losses are multiplied by before backward, so that the framework's reduction (the
    framework factor, and per-token mode's division by N) makes the effective gradient dL/dz."""
    weight = micro_batch_weight(ctx) / ctx.framework_factor
    return weight * ctx.num_valid_tokens if ctx.loss.scaling == "per_token" else weight


def _layer_values(value, layers, what, fail, needs_grad):
    """A RouterLosses field as a float tensor [layers]."""
    if isinstance(value, (list, tuple)):
        if len(value) != layers or not all(isinstance(v, torch.Tensor) and v.numel() == 1 for v in value):
            fail(f"RouterLosses({what}=...) must hold one value per layer ({layers}), got {value!r:.200}")
        value = torch.stack([v.reshape(()) for v in value])
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() != layers:
        described = (f"a {value.dtype} tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor)
                     else f"{type(value).__name__} {value!r:.80}")
        fail(f"RouterLosses({what}=...) must be a floating-point tensor with one value per layer [{layers}], got "
             f"{described}")
    if needs_grad and not value.requires_grad:
        fail(f"RouterLosses({what}=...) does not require grad: it does not depend on the router logits")
    return value.reshape(layers)


class RouterHarness(HarnessKind):
    result_types = (RouterLosses,)
    weighs_by_reduction = False
    reads_step_logits = True

    def step_values(self, inputs, micro_batches, groups, device):
        """Each micro-batch's valid tokens over its scope (scope_tokens: T_S, all-reduced over the sequence
        partition, as Megatron's router counts them), before micro-batch 0."""
        own = torch.tensor([float(mb.loss_mask.sum()) for mb in micro_batches], dtype=torch.float64, device=device)
        dist.all_reduce(own, group=groups["tp_cp"] if inputs.layout.sp else groups["cp"])
        return {"scope_tokens": [float(x) for x in own.tolist()]}

    def aggregation_weights(self, ctx):
        """Each row's weight in L: its micro-batch's (micro_batch_weight) on valid rows, 0 elsewhere. A token's
        share of its scope's losses is a sum over the scope's counts, so this weighs the shares, not per-token
        losses of their own."""
        return ctx.loss_mask.double() * micro_batch_weight(ctx)

    def logs_loss(self, loss):
        return True

    def dumps_grad_output(self, loss):
        return False

    def add_result(self, step, result, rows, ctx, fail):
        layers = int(ctx.loss.layers)
        aux = _layer_values(result.aux, layers, "aux", fail, ctx.loss.aux_coef > 0 or ctx.loss.seq_aux_coef > 0
                            or ctx.loss.global_aux_coef > 0)
        if result.z is None:
            if ctx.loss.z_loss_coef > 0:
                fail(f"RouterLosses(z=None), but the case's z_loss_coef is {ctx.loss.z_loss_coef}: return the z-loss")
            z = torch.zeros_like(aux)
        else:
            z = _layer_values(result.z, layers, "z", fail, ctx.loss.z_loss_coef > 0)
        step.set_mode("router", fail)
        forward = micro_batch_weight(ctx)
        step.logged_parts.append(forward * (aux.detach().double().sum() + z.detach().double().sum()))
        parts = {"aux_loss": forward * aux.detach().double().sum() / logged_aux_divisor(ctx.loss),
                 "z_loss": forward * z.detach().double().sum() / layers}
        if layers > 1:
            for layer in range(layers):
                parts[f"aux_loss.layer{layer}"] = forward * aux[layer].detach().double()
                parts[f"z_loss.layer{layer}"] = forward * z[layer].detach().double()
        step.add_statistics(parts)
        step.loss_dtype = torch.float32
        objective = (aux.float().sum() + z.float().sum()) * backward_weight(ctx)
        token_loss = None
        if result.token_loss is not None:
            token_loss = step.dumped(step.per_token(result.token_loss, "RouterLosses(token_loss=...)", rows, fail,
                                                    False), ctx.loss_mask)
        extra = {}
        if result.counts is not None:
            if not isinstance(result.counts, torch.Tensor) or result.counts.numel() != ctx.vocab_size:
                fail(f"RouterLosses(counts=...) must be a tensor of one count per expert of each layer "
                     f"([{layers}, {ctx.vocab_size // layers}]), got {result.counts!r:.120}")
            extra["counts"] = result.counts.detach()
        return objective, token_loss, extra


register_harness_kind("router", RouterHarness())
