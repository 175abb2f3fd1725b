"""The correct per-token loss of each loss kind, reached through a registry instead of a test of the name.

`TOKEN_LOSS` maps a kind (one registered in lossverify.kinds) to `fn(logits, labels, ctx, **kwargs)`, the
vocabulary-parallel kernel that computes its per-token losses [rows]; keyword arguments (bugs, active, ...)
go to that kernel. The framework-level bugs of the catalogue take their token loss from here. `CORRECT` maps a
kind whose correct implementation is more than its per-token loss (policy: the whole training-loop loss with
its log-probabilities, entropies and statistics) to that function; `correct` takes it from `correct_of`.
"""

from lossverify.kinds import kind_inputs
from lossverify.torch.implementations.cross_entropy import vocab_parallel_cross_entropy
from lossverify.torch.implementations.kd import vocab_parallel_kl
from lossverify.torch.implementations.policy import PolicyBugs, policy_loss, policy_token_loss
from lossverify.torch.implementations.router import router_losses

__all__ = ["TOKEN_LOSS", "register_token_loss", "token_loss_of", "CORRECT", "register_correct", "correct_of",
           "register_own_bug", "own_bug_of"]


def cross_entropy_token_loss(logits, labels, ctx, **kwargs):
    """Cross-entropy of the logits against the labels (docs/spec.md §5)."""
    return vocab_parallel_cross_entropy(logits, labels, ctx, **kwargs)


def kd_token_loss(logits, labels, ctx, **kwargs):
    """KL(teacher || student) against ctx.teacher_logits (docs/spec.md §5); the labels are not read."""
    return vocab_parallel_kl(logits, ctx.teacher_logits, ctx, **kwargs)


TOKEN_LOSS = {}


def register_token_loss(kind, fn):
    """Register fn(logits, labels, ctx, **kwargs) as the per-token loss of `kind`, which must already be a
    kind of lossverify.kinds (register_kind); a kind that has its token loss already is a ValueError."""
    kind_inputs(kind)  # an unknown kind raises, naming the known ones
    if kind in TOKEN_LOSS:
        raise ValueError(f"loss kind {kind!r} already has a token loss ({TOKEN_LOSS[kind].__name__})")
    TOKEN_LOSS[kind] = fn


def token_loss_of(kind):
    """The per-token loss of `kind`; a kind without one is a ValueError naming the kinds that have one."""
    try:
        return TOKEN_LOSS[kind]
    except KeyError:
        raise ValueError(f"no token loss for loss kind {kind!r} (registered: {', '.join(TOKEN_LOSS)})") from None


CORRECT = {}


def register_correct(kind, fn):
    """Register fn(logits, labels, ctx) as the correct implementation of `kind` (default: its token loss)."""
    kind_inputs(kind)
    if kind in CORRECT:
        raise ValueError(f"loss kind {kind!r} already has a correct implementation ({CORRECT[kind].__name__})")
    CORRECT[kind] = fn


def correct_of(kind):
    """The correct implementation of `kind`: its registered one, else its per-token loss."""
    return CORRECT.get(kind) or token_loss_of(kind)


# A catalogued framework bug that reaches a kind in a way of its own (the policy loss's own counts), by kind and
# bug name: fn(logits, labels, ctx). The catalogue's generic version serves every other kind.
OWN_BUG = {}


def register_own_bug(kind, bug, fn):
    """Register fn as `bug`'s implementation for loss kind `kind`."""
    kind_inputs(kind)
    OWN_BUG[(kind, bug)] = fn


def own_bug_of(kind, bug):
    """`bug`'s own implementation for `kind`, or None (the generic one applies)."""
    return OWN_BUG.get((kind, bug))


def policy_per_token_loss(logits, labels, ctx, **kwargs):
    """The policy objective's per-token losses l (docs/spec.md §3.3), whitened advantages included."""
    return policy_token_loss(logits, labels, ctx, **kwargs)


register_token_loss("cross_entropy", cross_entropy_token_loss)
register_token_loss("kd", kd_token_loss)
register_token_loss("policy", policy_per_token_loss)
register_correct("policy", policy_loss)
register_correct("router", router_losses)
# microbatch-local-mean: the micro-batch's own sequences and their rows (token-sum has no count); the CP-slice
# logging bug: the correct policy loss, whose logged value the catalogue replaces.
register_own_bug("policy", "microbatch-local-mean",
                 lambda logits, labels, ctx: policy_loss(logits, labels, ctx, bugs=PolicyBugs(microbatch_local_mean=True)))
register_own_bug("policy", "cp-loss-stat-dp-only", policy_loss)
