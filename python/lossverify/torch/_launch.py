"""What the parent of a harness launch needs without importing torch: the launch records that travel to the
rank processes, and the fork server that starts them.

torch takes seconds to import; the parent never needs it (the ranks do), so the fork server is started first
thing and imports torch while the parent exports the inputs and imports the user's module.
"""

import multiprocessing
import os
from dataclasses import dataclass
from typing import Any, List, Optional

RETURNS = ("auto", "token_loss", "reduced")

# Imported once by the fork server; every rank is a fork of it. The project's own implementations are
# ours to preload (they touch no GPU at import); a user's module is imported by each rank, never by the
# server, so that no CUDA state can ever reach a fork.
_PRELOAD = ["torch", "torch.distributed", "lossverify.torch._worker", "lossverify.torch.implementations"]
_context = None


@dataclass
class Job:
    """One loss function to run on the launch's inputs, dumped to its own folder."""

    fn: Any  # a callable (pickled by reference) or "module:function"
    name: str
    dump_dir: str
    returns: str = "auto"  # auto | token_loss | reduced


@dataclass
class Launch:
    """What every rank of one launch needs (pickled to the rank processes)."""

    inputs_dir: str
    jobs: List[Job]
    world_size: int
    device: str  # cpu | cuda
    init_file: Optional[str]  # the file:// rendezvous; None: torch.distributed is already initialised (torchrun)
    status_dir: Optional[str]
    timeout_seconds: float
    threads: int = 1
    launched_at: float = 0.0  # time.monotonic() in the parent when the launch began (for tracing)
    backend: str = "gloo"  # the process group's: gloo (on cuda the ranks share the GPUs) | nccl (a GPU per rank)
    local_rank: Optional[int] = None  # the GPU of a rank on its machine (torchrun's LOCAL_RANK); None: rank % GPUs


def process_context():
    """The multiprocessing context ranks start from: a fork server with torch imported (no CUDA state is
    ever in it), or LOSSVERIFY_TORCH_START's method. torch is named on its own because Python 3.11's fork
    server ignores sys.path changes made at run time: lossverify itself may then fail to preload, which
    costs little, but torch must not."""
    global _context
    if _context is None:
        method = os.environ.get("LOSSVERIFY_TORCH_START", "forkserver")
        _context = multiprocessing.get_context(method)
        if method == "forkserver":
            _context.set_forkserver_preload(_PRELOAD)
    return _context


def start_process_context():
    """Start the fork server now, so that its torch import runs while the parent does other work (the
    server preloads in the background; the first rank's start waits for it)."""
    context = process_context()
    if context.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()
    return context


def rank_entry(rank, launch):
    """A rank process's target, importable without torch (the fork server has already imported _worker)."""
    from lossverify.torch._worker import rank_main

    rank_main(rank, launch)
