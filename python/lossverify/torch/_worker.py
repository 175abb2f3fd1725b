"""One rank of a harness launch: a process that joins the torch.distributed world, builds the TP, CP, DP
and DP x CP groups, runs each loss function of the launch on its exported inputs, micro-batch by
micro-batch, back-propagates through autograd and writes its part of each dump.

Every rank ends by writing a status file (ok, or the error with its traceback and micro-batch), so the
parent learns what happened even when a rank dies or hangs; on an error the rank exits at once with code 3
(no clean shutdown that could wait on peers that will never come).
"""

import datetime
import faulthandler
import importlib
import inspect
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lossverify.dump import DumpWriter, _describe_change
from lossverify.inputs import load as load_inputs
from lossverify.kinds import kind_inputs
from lossverify.layout import framework_factor
from lossverify.torch._launch import RETURNS, Job, Launch  # noqa: F401 - the records ranks receive
from lossverify.torch.context import Context, FrameworkConfig, LossConfig, MicroBatch, Reduced
from lossverify.torch.kinds import harness_kind, kind_of_result


def dumped_values(values, valid):
    """Per-token values as the dump holds them: finite values on masked rows become 0, as a framework's mask
    makes them; a NaN or an infinity stays wherever it is and fails the check of its quantity, as the same value
    does in check-dump (a framework's masked mean turns it into a NaN loss)."""
    values = values.detach()
    return torch.where(valid | ~torch.isfinite(values), values, torch.zeros_like(values))


class UserCodeError(Exception):
    """The checked function (or its backward, or what it returned) failed on this rank."""

    def __init__(self, message, micro_batch=None, job=None):
        super().__init__(message)
        self.micro_batch = micro_batch
        self.job = job


class FunctionNotFound(Exception):
    """--fn names a module that has no such function, or something that is not callable (a usage error)."""


def resolve_function(fn):
    """A callable from "package.module:function" (attributes may be dotted), or fn itself. An exception the
    module raises while it is imported propagates (the checked code failed); FunctionNotFound otherwise."""
    if callable(fn):
        return fn
    if not isinstance(fn, str) or ":" not in fn:
        raise FunctionNotFound(f"expected a callable or \"module:function\", got {fn!r}")
    module_name, _, attribute = fn.partition(":")
    target = importlib.import_module(module_name)
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise FunctionNotFound(f"--fn {fn}: {module_name} has no {attribute}")
        target = getattr(target, part)
    if not callable(target):
        raise FunctionNotFound(f"--fn {fn}: {attribute} is a {type(target).__name__}, not a function")
    return target


def rank_main(rank, launch):
    """Entry point of a rank process."""
    _trace(rank, "started after launch", launch.launched_at)
    # A process group of its own: whatever the loss function starts is stopped with the rank.
    os.setpgid(0, 0)
    # SIGUSR1 writes where this rank is (its Python stack) for the parent's timeout message.
    stack_file = open(os.path.join(launch.status_dir, f"rank{rank}.stack"), "w", encoding="utf-8")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    status_path = os.path.join(launch.status_dir, f"rank{rank}.json")
    # NCCL timeouts abort instead of hanging (the variable was renamed in torch 2.2)
    renamed = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 2)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING" if renamed else "NCCL_ASYNC_ERROR_HANDLING", "1")
    torch.set_num_threads(max(1, launch.threads))
    try:
        warnings = run_jobs(rank, launch)
    except FunctionNotFound as e:
        _write_status(status_path, {"rank": rank, "ok": False, "kind": "usage", "message": str(e), "time": time.time()})
        os._exit(2)
    except UserCodeError as e:  # the time tells the first failure from the echoes it causes in peers
        _write_status(status_path, {"rank": rank, "ok": False, "kind": "user", "message": str(e), "time": time.time(),
                                    "micro_batch": e.micro_batch, "job": e.job})
        os._exit(3)
    except BaseException:  # noqa: B902 - anything else is the harness's or the environment's failure
        _write_status(status_path, {"rank": rank, "ok": False, "kind": "harness", "message": traceback.format_exc(),
                                    "time": time.time()})
        os._exit(3)
    _write_status(status_path, {"rank": rank, "ok": True, "warnings": warnings})
    try:
        dist.destroy_process_group()
    finally:
        _trace(rank, "exiting after launch", launch.launched_at)
        os._exit(0)


def _user_traceback(error):
    """The traceback of an exception raised by the checked code, without this harness's own frames."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb))


def _write_status(path, status):
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(status, f)
    os.replace(temporary, path)


def _trace(rank, what, since):
    """LOSSVERIFY_TORCH_TRACE=1 prints each rank's phases and their seconds to stderr (launch costs)."""
    if os.environ.get("LOSSVERIFY_TORCH_TRACE"):
        print(f"lossverify.torch: rank {rank}: {what} {time.monotonic() - since:.3f} s", file=sys.stderr, flush=True)
    return time.monotonic()


@dataclass
class _Rank:
    """This rank's place in the launch: everything a job needs besides the function."""

    rank: int
    world_size: int
    device: torch.device
    groups: dict  # tp, cp, dp, dp_cp
    control: Any  # the group for gathering Python objects (gloo even when the device group is NCCL)
    inputs: Any  # lossverify.inputs.Inputs
    rank_inputs: Any  # lossverify.inputs.RankInputs
    num_valid: int  # N_v over the world
    step: dict  # the kind's values of the whole step, for the Context (lossverify.torch.kinds)


def run_jobs(rank, launch):
    """Join the world (unless torchrun's process group is already up), build the groups and run every job of
    the launch on this rank's inputs; returns {job name: [warnings]}."""
    started = time.monotonic()
    inputs = load_inputs(launch.inputs_dir)
    device = torch.device("cpu")
    backend = launch.backend
    if launch.device == "cuda":
        device = torch.device("cuda", launch.local_rank if launch.local_rank is not None
                              else rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if launch.init_file is not None:
        # Collectives time out well after the parent's deadline: a hang is reported by the parent as such
        # (HarnessTimeout naming the ranks), not as a peer's receive timeout; this is the backstop.
        dist.init_process_group(backend, init_method="file://" + launch.init_file, rank=rank,
                                world_size=launch.world_size, timeout=group_timeout(launch.timeout_seconds))
        started = _trace(rank, "init_process_group", started)
    # Every group gets the launch's deadline: without one, new_group takes gloo's 30 minutes, and under torchrun (no
    # parent watching) a rank that never arrives at a TP, CP or DP collective would hold the job that long.
    timeout = group_timeout(launch.timeout_seconds)
    tokens_split = inputs.layout.sp and inputs.kind_inputs.whole_rows
    groups = _build_groups(inputs.layout, rank, timeout, tokens_split)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    started = _trace(rank, "groups", started)
    rank_inputs = inputs.rank(rank)
    num_valid = _global_valid_tokens(_micro_batches(inputs, rank_inputs, device)[0], groups["batch"], device)
    if num_valid != inputs.valid_tokens:
        raise RuntimeError(f"harness: all-reduced valid-token count {num_valid} differs from export-inputs' "
                           f"{inputs.valid_tokens}")
    step = harness_kind(inputs.kind).step_values(inputs, _micro_batches(inputs, rank_inputs, device)[0], groups,
                                                 device)
    me = _Rank(rank, launch.world_size, device, groups, control, inputs, rank_inputs, num_valid, step)
    started = _trace(rank, "inputs", started)
    warnings = {}
    for job in launch.jobs:
        try:
            fn = resolve_function(job.fn)
        except FunctionNotFound:
            raise
        except Exception:
            raise UserCodeError(f"cannot load the loss function {job.fn!r}:\n{traceback.format_exc()}",
                                job=job.name) from None
        warnings[job.name] = _run_job(job, fn, me)
        started = _trace(rank, f"job {job.name}", started)
    return warnings


def group_timeout(timeout_seconds):
    """The deadline of every process group of a launch: past the harness's own (which names the ranks), a backstop."""
    return datetime.timedelta(seconds=2 * timeout_seconds + 10)


def _build_groups(layout, rank, timeout, tokens_split):
    """The TP, CP, DP and DP x CP groups holding `rank`, and the batch group of the ranks holding other tokens (TP
    among them where it splits the tokens: sequence parallelism of a kind whose rows are whole on every rank; an LM
    head under sequence parallelism gathers its tokens before the kind, whose rows stay whole per TP group). new_group synchronises the whole world on torch
    1.13, so every rank creates every group in the same order (a group with the same members as an earlier
    one is reused); torch >= 2.1 lets each rank create only its own groups."""
    families = {
        "tp": [[layout.world_rank(t, c, d) for t in range(layout.tp)] for d in range(layout.dp) for c in range(layout.cp)],
        "cp": [[layout.world_rank(t, c, d) for c in range(layout.cp)] for d in range(layout.dp) for t in range(layout.tp)],
        "dp": [[layout.world_rank(t, c, d) for d in range(layout.dp)] for c in range(layout.cp) for t in range(layout.tp)],
        "dp_cp": [[layout.world_rank(t, c, d) for d in range(layout.dp) for c in range(layout.cp)]
                  for t in range(layout.tp)],
        "tp_cp": [[layout.world_rank(t, c, d) for c in range(layout.cp) for t in range(layout.tp)]
                  for d in range(layout.dp)],
    }
    local = "use_local_synchronization" in inspect.signature(dist.new_group).parameters
    created, mine = {}, {}
    for name, members_list in families.items():
        for members in members_list:
            key = tuple(sorted(members))
            if key not in created and (rank in members or not local):
                created[key] = dist.new_group(members, timeout=timeout, use_local_synchronization=True) if local else (
                    dist.new_group(members, timeout=timeout))
            if rank in members:
                mine[name] = created[key]
    # The ranks holding other tokens: DP x CP, and TP too where it splits the tokens.
    mine["batch"] = dist.group.WORLD if tokens_split else mine["dp_cp"]
    return mine


def _micro_batches(inputs, rank_inputs, device):
    """The rank's micro-batches as MicroBatch records on the device, and their logits (an LM head case: their hidden
    states h; fresh copies: a job may overwrite what it is given)."""
    teacher = inputs.kind_inputs.teacher_logits
    out, logits = [], []
    for k in range(len(rank_inputs.micro_batches)):
        t = {name: v.to(device, copy=True) for name, v in rank_inputs.micro_batch(k).items()}
        teacher_logits = t.get("teacher_logits") if teacher else None
        mb = MicroBatch(index=k, labels=t["labels"], loss_mask=t["loss_mask"], tokens=t["tokens"],
                        token_ids=t["token_ids"], sequences=t["sequences"], positions=t["positions"],
                        upstream_weights=t["upstream_weights"], teacher_logits=teacher_logits,
                        row_inputs={name: t.get(name) for name in inputs.kind_inputs.row_inputs},
                        logits=t["logits"].clone() if harness_kind(inputs.kind).reads_step_logits else None)
        out.append(mb)
        logits.append(t["logits"] if "logits" in t else t["h"])  # an LM head's input is h
    return out, logits


def _global_valid_tokens(micro_batches, batch_group, device):
    """N_v as frameworks get it before the step: this rank's count, all-reduced over the ranks holding other
    tokens (DP x CP, and TP under sequence parallelism)."""
    count = torch.zeros((), dtype=torch.int64, device=device)
    for mb in micro_batches:
        count += mb.loss_mask.sum()
    dist.all_reduce(count, group=batch_group)
    return int(count.item())


def _manifest_loss(loss):
    """The loss section for the manifest: reduction none takes its upstream weights from grad_output."""
    section = dict(loss)
    if section.get("reduction") == "none":
        section.pop("upstream_weights", None)
    return section


def _run_job(job, fn, me):
    if me.inputs.head is not None:
        from lossverify.torch._head import run_head_job

        return run_head_job(job, fn, me)
    return _run_logits_job(job, fn, me)


def _run_logits_job(job, fn, me):
    """Run fn on every micro-batch of this rank, back-propagate, and write this rank's part of the dump.

    The dump holds the inputs as exported (never what fn may have left in them): fn sees copies, and through
    ctx.micro_batches it can reach later micro-batches' copies too, so every copy is compared with the
    exported values once the rank is done, and each change is reported."""
    inputs, rank_inputs = me.inputs, me.rank_inputs
    loss = LossConfig.from_case(inputs.case["loss"])
    framework = FrameworkConfig(**inputs.framework)
    factor = framework_factor(inputs.layout, framework.grad_reduce, framework.ga_reduce)
    writer = _dump_writer(job, inputs)
    rank_dump = writer.rank(rank_inputs.tp, rank_inputs.cp, rank_inputs.dp, vocab=rank_inputs.vocab)
    micro_batches, logits = _micro_batches(inputs, rank_inputs, me.device)
    step = _StepLog(loss, factor, me.num_valid)
    state = {}
    for k, mb in enumerate(micro_batches):
        exported = rank_inputs.micro_batch(k)
        leaf = logits[k].clone().requires_grad_(True)
        labels = mb.labels.clone()
        handed = labels.clone()
        dump_mb = rank_dump.begin_micro_batch(
            exported["tokens"], logits=leaf, labels=exported["labels"] if kind_inputs(loss.kind).labels else None,
            loss_mask=exported["loss_mask"], teacher_logits=exported.get("teacher_logits"),
            grad_output=exported["upstream_weights"] if harness_kind(loss.kind).dumps_grad_output(loss) else None,
            **{name: exported.get(name) for name in kind_inputs(loss.kind).row_inputs})
        # An empty micro-batch: nothing to call where its TP peers hold the same rows and skip it too; under sequence
        # parallelism its peers hold other rows and reach the collectives of the scope, so fn runs on no rows.
        if mb.rows == 0 and not inputs.layout.sp:
            dump_mb.finish(grad_logits=torch.zeros_like(leaf))
            continue
        ctx = _context(me, loss, framework, factor, micro_batches, k, state)
        try:
            result = fn(leaf, labels, ctx)
        except BaseException as e:  # sys.exit() in the loss function too
            raise UserCodeError(_user_traceback(e), micro_batch=k, job=job.name) from None
        objective, token_loss, per_token = step.add(result, job.returns, ctx, k, job.name)
        try:
            objective.backward()
        except BaseException as e:
            raise UserCodeError("backward through the returned loss failed:\n" + _user_traceback(e),
                                micro_batch=k, job=job.name) from None
        if leaf.grad is None:
            raise UserCodeError("the returned loss does not depend on the logits (their .grad is None after "
                                "backward)", micro_batch=k, job=job.name)
        _report_changed_labels(writer, dump_mb, labels, handed, loss.kind)
        dump_mb.finish(grad_logits=leaf.grad, token_loss=token_loss, **per_token)
    _report_changed_micro_batches(writer, rank_dump, micro_batches, rank_inputs)
    logged, num_tokens, statistics = step.finish(me.groups["batch"], me.device)
    rank_dump.stats(loss=logged, num_tokens=num_tokens, **statistics)
    writer.logged_loss_precision = step.logged_precision
    writer.close(group=me.control)
    return writer.modified_inputs


# a MicroBatch's fields, named as the exported tensors (and its row inputs, by their names)
_COMPARED = ("labels", "loss_mask", "tokens", "token_ids", "sequences", "positions", "upstream_weights",
             "teacher_logits")


def _report_changed_labels(writer, dump_mb, labels, handed, kind):
    """The labels argument, changed in place during fn's call (changes to the micro-batches themselves are
    reported once the rank is done); a kind without labels has none to report."""
    if not kind_inputs(kind).labels:
        return
    change = _describe_change("labels", handed, labels)
    if change:
        writer._report_modified(f"{dump_mb.where}: {change}; the dump holds the exported values")


def _report_changed_micro_batches(writer, rank_dump, micro_batches, rank_inputs):
    """Every micro-batch's copies (ctx.micro_batches) against the exported values, once the rank is done: a
    change made while another micro-batch ran is reported as well as one made during its own."""
    for k, mb in enumerate(micro_batches):
        exported = rank_inputs.micro_batch(k)
        for field in _COMPARED + tuple(mb.row_inputs):
            live = getattr(mb, field, None)
            if live is None or field not in exported:
                continue
            change = _describe_change(f"ctx.micro_batches[{k}].{field}", exported[field], live)
            if change:
                writer._report_modified(f"{rank_dump.where}, micro-batch {k}: {change}; the dump holds the "
                                        "exported values")


def _dump_writer(job, inputs):
    case = inputs.case
    return DumpWriter(job.dump_dir, shape=(inputs.tokens, inputs.vocab), dtype=inputs.dtype, stage=inputs.head,
                      loss=_manifest_loss(case["loss"]), layout=inputs.layout, framework=inputs.framework,
                      cu_seqlens=inputs.cu_seqlens, implementation=job.name, name=case.get("name"),
                      description=f"lossverify.torch harness: {job.name} on case {case.get('name')}",
                      tolerances=case.get("tolerances"), timeout_seconds=case.get("timeout_seconds"), warn=False)


def _context(me, loss, framework, factor, micro_batches, k, state):
    r, layout = me.rank_inputs, me.inputs.layout
    groups = me.groups
    return Context(rank=me.rank, world_size=me.world_size, tp_rank=r.tp, tp_size=layout.tp, cp_rank=r.cp,
                   cp_size=layout.cp, dp_rank=r.dp, dp_size=layout.dp, tp_group=groups["tp"], cp_group=groups["cp"],
                   dp_group=groups["dp"], dp_cp_group=groups["dp_cp"], tp_cp_group=groups["tp_cp"],
                   batch_group=groups["batch"], sp=layout.sp, device=me.device, dtype=me.inputs.torch_dtype,
                   vocab_start=r.vocab[0], vocab_end=r.vocab[1], vocab_size=me.inputs.vocab, loss=loss,
                   framework=framework, framework_factor=factor, num_valid_tokens=me.num_valid, micro_batch=k,
                   ga=layout.ga, micro_batches=micro_batches, state=state, step=me.step, head=me.inputs.head)


def _one_number(value, what, fail):
    """A real number (a Python number or a tensor of one element; NaN and infinities are values to judge)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            fail(f"{what} must be one real number, got a {value.dtype} tensor of shape {list(value.shape)}")
        return value.detach().double()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(f"{what} must be a number or a tensor of one element, got {type(value).__name__} {value!r:.80}")
    return float(value)


def _token_count(value, fail):
    """Reduced(num_tokens=...): a non-negative integer (a Python int, or an integer tensor of one element)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            fail(f"Reduced(num_tokens=...) must be an integer, got a {value.dtype} tensor of shape "
                 f"{list(value.shape)}")
        value = int(value.item())
    elif isinstance(value, bool) or not isinstance(value, int):
        fail(f"Reduced(num_tokens=...) must be an integer, got {type(value).__name__} {value!r:.80}")
    if not 0 <= value <= 2 ** 53:
        fail(f"Reduced(num_tokens=...) must be a token count (0 to 2^53), got {value}")
    return value


class _StepLog:
    """Turns fn's results into what is back-propagated, dumped and logged (see Context, Reduced and the kinds'
    own result types, lossverify.torch.kinds)."""

    def __init__(self, loss, factor, num_valid):
        self.loss = loss
        self.factor = factor
        self.num_valid = num_valid
        self.kind = harness_kind(loss.kind)
        self.logs_loss = self.kind.logs_loss(loss)
        self.statistics = kind_inputs(loss.kind).statistics(loss)
        self.token_quantities = kind_inputs(loss.kind).token_quantities
        self.logged_parts = []
        self.stat_parts = {name: [] for name in self.statistics}
        self.loss_dtype = torch.float32
        self.num_tokens = None
        self.mode = None
        self.logged_precision = None

    def add(self, result, returns, ctx, k, job):
        """(objective to back-propagate, per-token losses to dump or None, {token_<quantity>} to dump)."""
        def fail(message):
            raise UserCodeError(message, micro_batch=k, job=job)

        rows = ctx.current.rows
        owner = kind_of_result(result)
        if owner is not None:
            name = type(result).__name__
            if not isinstance(result, self.kind.result_types):
                fail(f"returned {name}, but the case's loss is {self.loss.kind}: {name} is a {owner} case's result")
            if returns == "reduced":
                fail(f"returned {name}, but returns='reduced' asks for an already reduced loss")
            return self.kind.add_result(self, result, rows, ctx, fail)
        if isinstance(result, Reduced) and returns == "token_loss":
            fail("returned a Reduced loss, but returns='token_loss' asks for per-token losses")
        if isinstance(result, Reduced) or returns == "reduced":
            if not isinstance(result, Reduced):
                result = Reduced(result)
            return self._add_reduced(result, rows, ctx, fail)
        if not isinstance(result, torch.Tensor):
            expected = "".join(f", lossverify.torch.{t.__name__}(...)" for t in self.kind.result_types)
            fail(f"returned {type(result).__name__}; expected the per-token losses [{rows}]{expected} or "
                 "lossverify.torch.Reduced(loss, ...)")
        if result.dim() == 0:
            fail("returned a scalar: the harness expects the per-token losses [rows]; wrap an already-reduced "
                 "loss in lossverify.torch.Reduced(loss, token_loss=..., num_tokens=...) or pass returns='reduced'")
        if result.numel() != rows or not result.is_floating_point():
            fail(f"returned a {result.dtype} tensor of shape {list(result.shape)}; expected per-token losses, "
                 f"floating point, one per row [{rows}]")
        if not result.requires_grad:
            fail("the returned per-token losses do not require grad: they do not depend on the logits")
        self.set_mode("token_loss", fail)
        raw = result.reshape(rows)
        zero = torch.zeros((), dtype=result.dtype, device=result.device)
        # The harness masks what the loss function returns on masked rows, as a framework's mask does; but a
        # non-finite value there stays in the dump and fails `finite`, as it does in check-dump and through a
        # plugin (a framework that multiplies by the mask turns it into a NaN loss).
        token_loss = torch.where(ctx.loss_mask, raw, zero)
        dumped = torch.where(ctx.loss_mask | ~torch.isfinite(raw.detach()), raw.detach(), zero)
        objective = self.weigh(token_loss, ctx)
        self.loss_dtype = result.dtype
        return objective, dumped, {}

    def weigh(self, token_loss, ctx):
        """The objective to back-propagate: each token's loss times its weight in L (the reduction's or the kind's
        aggregation, float64) over the framework factor; L's part is kept for the logged loss."""
        forward = ctx.aggregation_weights()
        backward = (forward / self.factor).to(torch.float32)
        if self.logs_loss:
            self.logged_parts.append((token_loss.detach().double() * forward).sum())
        return (token_loss.float() * backward).sum()

    @staticmethod
    def dumped(values, valid):
        return dumped_values(values, valid)

    def per_token(self, value, what, rows, fail, needs_grad):
        """A returned per-token field: a floating-point tensor of shape [rows] (not [rows, 1], which broadcasts
        against [rows] into [rows, rows] in the objective)."""
        if (not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() != 1
                or value.numel() != rows):
            described = (f"a {value.dtype} tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor)
                         else f"{type(value).__name__} {value!r:.80}")
            fail(f"{what} must be a floating-point tensor with one value per row [{rows}], got {described}")
        if needs_grad and not value.requires_grad:
            fail(f"{what} does not require grad: it does not depend on the logits")
        return value

    def add_statistics(self, parts):
        for name, value in parts.items():
            self.stat_parts[name].append(torch.as_tensor(value, dtype=torch.float64).reshape(()))

    def _add_reduced(self, result, rows, ctx, fail):
        loss = result.loss
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            fail(f"Reduced(loss=...) must be a floating-point tensor of one element, got {loss!r:.200}")
        if not loss.requires_grad:
            fail("Reduced(loss=...) does not require grad: it does not depend on the logits")
        self.set_mode("reduced", fail)
        if result.token_loss is not None:
            tl = result.token_loss
            if not isinstance(tl, torch.Tensor) or tl.numel() != rows or not tl.is_floating_point():
                fail(f"Reduced(token_loss=...) must be a floating-point tensor with one loss per row [{rows}]")
            token_loss = tl.detach().reshape(rows)
        else:
            token_loss = None
        per_token = {}
        valid = ctx.loss_mask
        scope = kind_inputs(self.loss.kind).scope_values
        for name, value in result.token_values.items():
            if value is None:
                continue
            if name == scope:
                if not isinstance(value, torch.Tensor) or value.numel() != ctx.vocab_size:
                    fail(f"Reduced({name}=...) must be a tensor of one value per column of a row ({ctx.vocab_size})")
                per_token[name] = value.detach()
                continue
            if name not in self.token_quantities:
                fail(f"Reduced({name}=...) is not a per-token quantity of the case's loss {self.loss.kind} (its: "
                     f"{', '.join(self.token_quantities) or 'none'})")
            value = self.per_token(value, f"Reduced({name}=...)", rows, fail, False)
            per_token[f"token_{name}"] = dumped_values(value, valid)
        if result.stats is not None:
            if not self.statistics:
                fail(f"Reduced(stats=...), but the case's loss {self.loss.kind} logs no statistics")
            if not isinstance(result.stats, dict):
                fail(f"Reduced(stats=...) must be a dict of {', '.join(self.statistics)}, got "
                     f"{type(result.stats).__name__}")
            parts = {}
            for name, value in result.stats.items():
                if name not in self.statistics:
                    fail(f"Reduced(stats=...) has {name!r:.40}; the statistics are {', '.join(self.statistics)}")
                parts[name] = _one_number(value, f"Reduced(stats={{{name!r}: ...}})", fail)
            self.add_statistics(parts)
        if self.logs_loss:
            logged = result.logged if result.logged is not None else loss.detach().double() * self.factor
            logged = _one_number(logged, "Reduced(logged=...)", fail)
            self.logged_parts.append(torch.as_tensor(logged, dtype=torch.float64, device=loss.device).reshape(()))
        if result.num_tokens is not None:
            self.num_tokens = _token_count(result.num_tokens, fail)
        if result.logged_precision is not None:
            if result.logged_precision not in ("fp32", "bf16", "fp16"):
                fail(f"Reduced(logged_precision=...) must be fp32, bf16 or fp16, got {result.logged_precision!r:.40}")
            self.logged_precision = result.logged_precision
        self.loss_dtype = loss.dtype
        return loss.reshape(()), token_loss, per_token

    def set_mode(self, mode, fail):
        if self.mode is not None and self.mode != mode:
            fail(f"returned {mode} here but {self.mode} on an earlier micro-batch: return one kind throughout")
        self.mode = mode

    def finish(self, batch_group, device):
        """The logged loss (summed over micro-batches, all-reduced over the ranks holding other tokens: DP x CP,
        and TP under sequence parallelism), the logged count, and a kind's logged statistics {name: value} (those
        the function's results gave)."""
        logged = None
        if self.logs_loss:
            total = torch.zeros((), dtype=torch.float64, device=device)
            for part in self.logged_parts:
                total += part.to(device)
            dist.all_reduce(total, group=batch_group)
            logged = total.to(self.loss_dtype)
        num_tokens = self.num_tokens if self.mode in (None, "reduced") else self.num_valid
        # A rank with no rows never called fn: it logs a count (the global one) when its peers log one.
        logs = torch.tensor([0.0 if num_tokens is None else 1.0], dtype=torch.float64, device=device)
        dist.all_reduce(logs, op=dist.ReduceOp.MAX, group=batch_group)
        if self.mode is None and logs.item() > 0:
            num_tokens = self.num_valid
        return logged, num_tokens, self._statistics(batch_group, device)

    def _statistics(self, batch_group, device):
        """Each statistic's parts summed over micro-batches and the ranks holding other tokens: one all-reduce of
        [values | given] on every rank of a case whose kind logs statistics (a rank that never called fn adds
        zeros)."""
        if not self.statistics:
            return {}
        count = len(self.statistics)
        packed = torch.zeros(2 * count, dtype=torch.float64, device=device)
        for i, name in enumerate(self.statistics):
            for part in self.stat_parts[name]:
                packed[i] += part.to(device)
            packed[count + i] = 1.0 if self.stat_parts[name] else 0.0
        dist.all_reduce(packed, group=batch_group)
        return {name: float(packed[i]) for i, name in enumerate(self.statistics) if packed[count + i] > 0}
