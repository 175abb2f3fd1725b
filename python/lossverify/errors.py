"""The exceptions of lossverify, each carrying the exit code the command line gives it.

The codes are lossverify's own, so a CI script reads `python3 -m lossverify.torch run` like `lossverify run`:
0 every check passes, 1 a check failed (not an exception: see `Report`), 2 usage or malformed input,
3 an error inside the checked code or the tool, 4 a timeout.
"""


def printable(text):
    """Text for a terminal: control characters other than newline and tab escaped (\\x1b...), so that an error
    message quoting a loss function's exception or a path cannot move the cursor or forge lines."""
    return "".join(c if c in "\n\t" or (c.isprintable() and c != "\x7f") else f"\\x{ord(c):02x}"
                   if ord(c) < 256 else f"\\u{ord(c):04x}" for c in str(text))


class LossverifyError(Exception):
    """Base class; `exit_code` is what the command line exits with."""

    exit_code = 3


class UsageError(LossverifyError, ValueError):
    """A bad argument, case file, manifest or dump (lossverify's exit code 2)."""

    exit_code = 2


class BinaryNotFoundError(UsageError):
    """No lossverify executable: pass binary=, set LOSSVERIFY_BIN or put lossverify on PATH."""


class InputsError(UsageError):
    """An export-inputs folder that is missing, malformed or inconsistent (names the file and field)."""


class DumpError(UsageError):
    """A dump that cannot be written as asked (missing ranks, wrong shapes, ...)."""


class ToolError(LossverifyError):
    """lossverify itself failed (exit code 3 or an unexpected one); carries its command line and output."""

    def __init__(self, message, command=None, returncode=None, output=""):
        super().__init__(message)
        self.command = command
        self.returncode = returncode
        self.output = output


class UserFunctionError(LossverifyError):
    """The checked loss function raised on some rank: the rank and its traceback (exit code 3)."""

    exit_code = 3

    def __init__(self, rank, traceback_text, coordinates=None, micro_batch=None, note=""):
        where = f"rank {rank}"
        if coordinates:
            where += " (" + " ".join(f"{k}={v}" for k, v in coordinates.items()) + ")"
        if micro_batch is not None:
            where += f", micro-batch {micro_batch}"
        super().__init__(f"the loss function raised on {where}:\n{traceback_text.rstrip()}" + (f"\n{note}" if note else ""))
        self.rank = rank
        self.traceback = traceback_text
        self.coordinates = coordinates or {}
        self.micro_batch = micro_batch


class HarnessTimeout(LossverifyError):
    """A rank did not finish within the time limit (a hang in a collective, usually): exit code 4."""

    exit_code = 4
