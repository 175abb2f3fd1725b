"""Processes a loss function starts never outlive the launch, in a session of their own too (start_new_session,
setsid, a daemon): while ranks run, this process is their reaper (Linux's child subreaper), so an orphan is
re-parented here rather than to init, and every process that became a child of this one during the launch is
ended with it. Children this process had before the launch are left alone (a test's own subprocesses)."""

import contextlib
import ctypes
import os
import signal

_PR_SET_CHILD_SUBREAPER = 36


def _children():
    found = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children", encoding="ascii") as f:
                found.update(int(pid) for pid in f.read().split())
        except (OSError, ValueError):
            continue
    return found


def _set_subreaper(on):
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1 if on else 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _end(pid):
    """SIGKILL to the process and, where it leads one, its process group; then reap it."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        os.waitpid(pid, 0)
    except OSError:
        pass


@contextlib.contextmanager
def orphans_end_with_the_launch(keep=()):
    """Within: orphaned descendants come here; on leaving, every child that came since (but those in `keep`, and
    the ones that were here before) is ended and reaped, round after round while their own orphans arrive."""
    before = _children()
    _set_subreaper(True)
    try:
        yield
    finally:
        try:
            for _ in range(64):
                keep_now = set(keep() if callable(keep) else keep)
                new = _children() - before - keep_now
                if not new:
                    break
                for pid in new:
                    _end(pid)
        finally:
            _set_subreaper(False)
