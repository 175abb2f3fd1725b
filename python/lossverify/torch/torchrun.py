"""`python3 -m lossverify.torch run` as one of the processes that torchrun (or a scheduler) started, on one
machine or many.

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:PORT ... \\
        -m lossverify.torch run --fn my_module:my_loss cases/full-4d-layout.json --tp 8 --dp 2

Each process is the world rank torchrun gave it (RANK, WORLD_SIZE, LOCAL_RANK), which must be the layout's
tp x cp x dp. Nothing assumes a file system shared between machines:
1. every process exports its own inputs with its machine's `lossverify` (`export-inputs --rank`), into a
   folder of its own: the Philox streams make them the bits every other layout and backend sees;
2. the process group comes from torchrun's environment (gloo on the CPU, NCCL on GPUs: device LOCAL_RANK),
   and each process runs the loss function on its rows exactly as the forked harness does;
3. every rank's part of the dump travels to rank 0 through the process group (a gloo group), where
   `check-dump` judges it; rank 0 prints the table and writes --report, and every process exits with the
   verdict's code. torchrun itself exits 1 when any process exits non-zero.

A rank whose loss function raises prints the error with its rank and exits 3; torchrun then stops the
others. A process group that never forms or a collective that never completes ends at the timeout.
"""

import os
import shutil
import sys
import tempfile
import traceback

from lossverify import inputs as inputs_module
from lossverify import tool
from lossverify.errors import LossverifyError, UsageError

__all__ = ["launched_by_torchrun", "run"]

_ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun(environ=None):
    """Whether this process is a rank of a torchrun (or torch.distributed.run) launch."""
    environ = os.environ if environ is None else environ
    return all(name in environ for name in _ENVIRONMENT)


def _environment_rank():
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        try:
            values[name] = int(os.environ[name])
        except ValueError:
            raise UsageError(f"{name}={os.environ[name]!r}: torchrun's environment must hold integers") from None
    if not 0 <= values["RANK"] < values["WORLD_SIZE"] or values["LOCAL_RANK"] < 0:
        raise UsageError(f"RANK={values['RANK']}, WORLD_SIZE={values['WORLD_SIZE']}, LOCAL_RANK={values['LOCAL_RANK']}: "
                         "not a rank of the world")
    return values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"]


def run(fn, case, tp=None, cp=None, dp=None, ga=None, device="cpu", set=None, returns="auto", binary=None,
        keep_dump=None, timeout=None, report=None, backend=None, quiet=False, control=True):
    """This process's part of a distributed check; returns the exit code every process of the launch ends with.
    Errors before the process group forms are raised (every process meets them alike)."""
    from lossverify.torch import harness

    rank, world, local_rank = _environment_rank()
    backend = harness._check_arguments(device, returns, backend)
    binary = tool.find_binary(binary)
    if keep_dump and rank == 0:
        keep_dump = os.path.abspath(os.fspath(keep_dump))
        if os.path.exists(keep_dump) and (not os.path.isdir(keep_dump) or os.listdir(keep_dump)):
            raise UsageError(f"--keep-dump {keep_dump}: exists and is not an empty folder")
    work = tempfile.mkdtemp(prefix=f"lossverify-torchrun-rank{rank}-")
    try:
        inputs = inputs_module.export(case, os.path.join(work, "inputs"), tp=tp, cp=cp, dp=dp, ga=ga, overrides=set,
                                      binary=binary, rank=rank)
        if inputs.layout.world_size != world:
            raise UsageError(f"{case}: the layout {inputs.layout.label} has {inputs.layout.world_size} ranks (tp x cp "
                             f"x dp), but torchrun started WORLD_SIZE={world} processes")
        timeout = float(timeout or inputs.case.get("timeout_seconds") or 120.0)
        return _run_in_group(fn, inputs, rank, world, local_rank, device, backend, returns, binary, timeout, work,
                             keep_dump if rank == 0 else None, report if rank == 0 else None, quiet, control)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_in_group(fn, inputs, rank, world, local_rank, device, backend, returns, binary, timeout, work, keep_dump,
                  report, quiet, control=True):
    import torch
    import torch.distributed as dist

    from lossverify.torch import harness
    from lossverify.torch._launch import Job, Launch
    from lossverify.torch._orphans import orphans_end_with_the_launch
    from lossverify.torch._worker import FunctionNotFound, UserCodeError, group_timeout, run_jobs

    if device == "cuda":
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if local_rank >= visible and backend == "nccl":
            raise UsageError(f"rank {rank}: LOCAL_RANK {local_rank} but {visible} GPU(s) visible on this machine "
                             "(NCCL runs one rank per GPU)")
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=group_timeout(timeout))
    name = fn if isinstance(fn, str) else harness._function_name(fn)
    dump_dir = os.path.join(work, "dump")
    launch = Launch(inputs_dir=inputs.directory, jobs=[Job(fn=fn, name=name, dump_dir=dump_dir, returns=returns)],
                    world_size=world, device=device, init_file=None, status_dir=None, timeout_seconds=timeout,
                    threads=harness._threads_per_rank(), backend=backend, local_rank=local_rank)
    try:
        with orphans_end_with_the_launch():  # what the loss function starts ends with this rank's part
            warnings = run_jobs(rank, launch)
    except FunctionNotFound as e:  # every rank looks it up alike, so none is left waiting
        print(f"lossverify.torch: rank {rank}: error: {e}", file=sys.stderr, flush=True)
        return UsageError.exit_code
    except UserCodeError as e:
        if _collective_timed_out(str(e)):  # a peer that never arrived, not a fault of this rank's code: exit 4
            print(f"lossverify.torch: rank {rank} (micro-batch {e.micro_batch}): timeout: a collective waited past "
                  f"the launch's deadline ({group_timeout(timeout).total_seconds():g} s = 2 x --timeout + 10): a rank "
                  f"never arrived, or arrived too late:\n{e}", file=sys.stderr, flush=True)
            os._exit(4)
        print(f"lossverify.torch: rank {rank} (micro-batch {e.micro_batch}): the loss function failed:\n{e}",
              file=sys.stderr, flush=True)
        os._exit(3)  # its peers may be waiting in a collective: torchrun stops them
    files = dist.new_group(backend="gloo", timeout=group_timeout(timeout)) if backend != "gloo" else None
    _gather_dump(rank, world, dump_dir, files)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(warnings.get(name, []), gathered, dst=0, group=files)
    code = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        code[0] = _judge(inputs, dump_dir, name, binary, [w for part in gathered for w in part], keep_dump, report,
                         work, quiet, control=control)
    dist.broadcast(code, src=0, group=files)
    dist.destroy_process_group()
    return int(code.item())


def _collective_timed_out(traceback_text):
    """Whether a rank's failure is a process group's deadline (gloo's "Timed out waiting ... for recv", NCCL's
    watchdog, torch's DistTimeoutError)."""
    return any(mark in traceback_text for mark in ("Timed out", "timed out", "DistTimeoutError",
                                                   "Watchdog caught collective operation timeout"))


def _gather_dump(rank, world, dump_dir, group):
    """Every rank's files of the dump onto rank 0 (which holds the manifest), one rank after another."""
    import torch
    import torch.distributed as dist

    mine = sorted(f for f in os.listdir(dump_dir) if f != "manifest.json") if os.path.isdir(dump_dir) else []
    names = [None] * world
    dist.all_gather_object(names, mine, group=group)
    for sender in range(1, world):
        for file_name in names[sender]:
            if rank == sender:
                with open(os.path.join(dump_dir, file_name), "rb") as f:
                    payload = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
                dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst=0, group=group)
                dist.send(payload, dst=0, group=group)
            elif rank == 0:
                size = torch.zeros(1, dtype=torch.int64)
                dist.recv(size, src=sender, group=group)
                payload = torch.empty(int(size.item()), dtype=torch.uint8)
                dist.recv(payload, src=sender, group=group)
                with open(os.path.join(dump_dir, os.path.basename(file_name)), "wb") as f:
                    f.write(payload.numpy().tobytes())


def _judge(inputs, dump_dir, name, binary, warnings, keep_dump, report, work, quiet, control=True):
    """Rank 0: check-dump on the gathered dump; prints the table, writes --report and --keep-dump."""
    kept = None
    if keep_dump:
        shutil.copytree(work, keep_dump, dirs_exist_ok=True)
        kept = os.path.join(keep_dump, "dump")
    try:
        result = tool.check_dump(os.path.join(dump_dir, "manifest.json"), os.path.join(work, "report.json"),
                                 binary=binary, warnings=warnings, dump_dir=kept, dump_kept=bool(keep_dump),
                                 control=control)
    except LossverifyError as e:
        print(f"lossverify.torch: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    if report:
        from lossverify.torch import harness

        harness._copy_report(result, report)
    if not quiet:
        print(result.table(), flush=True)
        if report:
            print(f"report written to {report}", flush=True)
    return result.exit_code


def main_under_torchrun(args, fn):
    """The CLI's `run` under torchrun; the exit code of this process."""
    try:
        return run(fn, args.case, tp=args.tp, cp=args.cp, dp=args.dp, ga=args.ga, device=args.device, set=args.set,
                   returns=args.returns, binary=args.binary, keep_dump=args.keep_dump, timeout=args.timeout,
                   report=args.report, backend=args.backend, quiet=args.quiet, control=not args.no_control)
    except LossverifyError as e:
        print(f"lossverify.torch: rank {os.environ.get('RANK', '?')}: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except Exception:
        print(f"lossverify.torch: rank {os.environ.get('RANK', '?')}: error:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        return 3
