"""lossverify for Python: check a sharded PyTorch loss against lossverify's dense float64 reference.

The C++ tool `lossverify` owns the inputs (bit-identical at every layout), the reference and the checks.
This package is the PyTorch side of it:

- `lossverify.torch.check(fn, case, tp=...)` runs your loss function on real torch.distributed ranks,
  dumps what it computed and returns lossverify's report (`python3 -m lossverify.torch run` from a shell);
- `lossverify.dump.DumpWriter` writes a `lossverify.dump/1` dump from your own training code;
- `lossverify.inputs` reads what `lossverify export-inputs` writes;
- `lossverify.kinds` registers the loss kinds (cross_entropy, kd) and the inputs each one reads;
- `lossverify.safetensors` reads and writes the tensor files, without the `safetensors` package.

Importing `lossverify` itself needs no torch; `lossverify.dump` and `lossverify.safetensors` import it, and
`lossverify.torch` and `lossverify.inputs` import it only once they need it (a harness's parent never does).
"""

from lossverify.errors import (
    BinaryNotFoundError,
    DumpError,
    InputsError,
    LossverifyError,
    HarnessTimeout,
    ToolError,
    UsageError,
    UserFunctionError,
)
from lossverify.report import Check, Report, load_report

__version__ = "0.1.0"

__all__ = [
    "BinaryNotFoundError",
    "Check",
    "DumpError",
    "InputsError",
    "LossverifyError",
    "Report",
    "HarnessTimeout",
    "ToolError",
    "UsageError",
    "UserFunctionError",
    "load_report",
]
