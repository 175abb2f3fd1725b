"""Where the Python package writes a file the user named (--report, --keep-dump): the C++ tool's rule
(docs/command-line.md, "Output files"), checked before any work starts.

- a path that does not exist, or names a regular file, is written atomically (a temporary file in the same
  folder, renamed over it when complete); a symbolic link is followed and the file it points to is written;
- a character device or a FIFO (/dev/stdout, /dev/null, a named pipe) is written as a stream; a FIFO is
  opened without blocking, so one with no reader is an error (exit 3), never a hang;
- a folder, a block device or a socket is refused, as is a file the command reads (a case file): exit 2;
- a folder for kept files (--keep-dump) must be new or empty, and its parent writable.
"""

import errno
import os
import stat

from lossverify.errors import ToolError, UsageError

__all__ = ["check_output_path", "check_output_folder", "write_output"]


def _refuse(option, path, why):
    raise UsageError(f"{option} {path!r}: {why}")


def _kind(mode):
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return None


def _is_stream(mode):
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def check_output_path(option, path, inputs=()):
    """Everything knowable before the run about an output file: UsageError naming the option and the problem."""
    if path is None:
        return
    path = os.fspath(path)
    if not path:
        _refuse(option, path, "empty path")
    try:
        info = os.stat(path)
    except FileNotFoundError:
        info = None
    except OSError as e:
        _refuse(option, path, e.strerror or str(e))
    if info is not None:
        kind = _kind(info.st_mode)
        if kind:
            _refuse(option, path, f"is {kind}, not a file")
        for read in inputs:
            try:
                other = os.stat(read)
            except OSError:
                continue
            if (other.st_dev, other.st_ino) == (info.st_dev, info.st_ino):
                _refuse(option, path, f"is {os.fspath(read)}, which this command reads; write elsewhere")
        if _is_stream(info.st_mode):
            if not os.access(path, os.W_OK):
                _refuse(option, path, "cannot be written")
            return
    target = os.path.realpath(path)
    folder = os.path.dirname(target) or "."
    if not os.path.isdir(folder):
        _refuse(option, path, f"folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        _refuse(option, path, f"folder {folder!r} cannot be written")


def check_output_folder(option, folder):
    """A folder to keep files in: new (its parent writable) or an empty folder that can be written."""
    if folder is None:
        return
    folder = os.path.abspath(os.fspath(folder))
    try:
        info = os.stat(folder)
    except FileNotFoundError:
        parent = os.path.dirname(folder)
        if not os.path.isdir(parent):
            _refuse(option, folder, f"folder {parent!r} does not exist")
        if not os.access(parent, os.W_OK | os.X_OK):
            _refuse(option, folder, f"folder {parent!r} cannot be written")
        return
    if not stat.S_ISDIR(info.st_mode):
        _refuse(option, folder, "exists and is not a folder")
    if os.listdir(folder):
        _refuse(option, folder, "exists and is not empty (give a new or empty folder)")
    if not os.access(folder, os.W_OK | os.X_OK):
        _refuse(option, folder, "cannot be written")


def write_output(option, path, text):
    """Write `text` to `path` by the rule above (checked again: the path may have changed since)."""
    path = os.fspath(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        info = None
    if info is not None and _is_stream(info.st_mode):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            why = "a FIFO with no reader" if e.errno == errno.ENXIO else (e.strerror or str(e))
            raise ToolError(f"{option} {path!r}: cannot write: {why}") from None
        try:
            os.set_blocking(fd, True)
            data = text.encode("utf-8")
            while data:
                written = os.write(fd, data)
                data = data[written:]
        except OSError as e:
            raise ToolError(f"{option} {path!r}: write failed: {e.strerror or e}") from None
        finally:
            os.close(fd)
        return
    target = os.path.realpath(path)
    temporary = f"{target}.tmp.{os.getpid()}"
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(temporary, target)
    except OSError as e:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise ToolError(f"{option} {path!r}: write failed: {e.strerror or e}") from None
