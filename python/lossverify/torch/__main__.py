"""python3 -m lossverify.torch: check a PyTorch loss function from a shell or a CI job.

    python3 -m lossverify.torch run --fn my_module:my_loss cases/smoothing-pytorch.json --tp 4
    python3 -m lossverify.torch sweep --fn my_module:my_loss cases/cp-zigzag-packed.json --layout tp2-cp2 ...
    python3 -m lossverify.torch list
    torchrun --nproc-per-node 4 -m lossverify.torch run --fn my_module:my_loss cases/full-4d-layout.json --tp 2 --dp 2

Exit codes are lossverify's: 0 every check passes, 1 a check failed, 2 usage or a bad case, 3 the loss
function raised (its rank and traceback are printed) or an internal error, 4 a rank hung past the timeout.
"""

import argparse
import importlib
import importlib.util
import os
import signal
import sys
import traceback

from lossverify.errors import LossverifyError, UsageError, UserFunctionError, printable

EXIT_USAGE = 2
EXIT_ERROR = 3


def _parser():
    parser = argparse.ArgumentParser(prog="python3 -m lossverify.torch",
                                     description="Check a PyTorch loss function against lossverify's float64 "
                                                 "reference on torch.distributed ranks.",
                                     epilog="exit codes: 0 all checks pass, 1 a check failed, 2 usage or case "
                                            "error, 3 the loss function raised (or an internal error), 4 timeout")
    commands = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("case", help="case file (JSON), e.g. cases/smoothing-pytorch.json")
        p.add_argument("--fn", required=True, metavar="MODULE:FUNCTION",
                       help="the loss function fn(logits, labels, ctx), e.g. lossverify.torch.implementations:correct")
        p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                       help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
        p.add_argument("--backend", choices=("gloo", "nccl"),
                       help="the process group's backend (default: gloo on cpu, nccl on cuda; gloo on cuda lets "
                            "ranks share a GPU)")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a case field, e.g. --set loss.label_smoothing=0.1 (repeatable)")
        p.add_argument("--returns", choices=("auto", "token_loss", "reduced"), default="auto",
                       help="what fn returns: per-token losses, an already-reduced scalar, or auto (default)")
        p.add_argument("--report", metavar="R.json", help="write lossverify's JSON report here")
        p.add_argument("--keep-dump", metavar="DIR", help="keep the inputs, dumps and reports in DIR (new or empty)")
        p.add_argument("--timeout", type=float, metavar="SECONDS", help="per launch (default: the case's)")
        p.add_argument("--binary", help="the lossverify executable (default: $LOSSVERIFY_BIN, the packaged one, PATH, "
                                        "build tree)")
        p.add_argument("-q", "--quiet", action="store_true", help="print nothing; rely on the exit code")
        p.add_argument("--no-control", action="store_true",
                       help="skip the control band (lossverify's correct implementation on the same inputs in "
                            "float32 and in the case's 16-bit dtype)")

    run = commands.add_parser("run", help="run fn at one layout and check it")
    common(run)
    for name in ("tp", "cp", "dp", "ga"):
        run.add_argument(f"--{name}", type=_positive, help=f"{name} ranks/micro-batches (default: the case's)")
    sweep = commands.add_parser("sweep", help="run fn at several layouts and check each and their invariance")
    common(sweep)
    sweep.add_argument("--layout", action="append", default=[], metavar="tp2-cp1-dp1-ga1",
                       help="a layout to run (repeatable; default: the case's sweep section)")
    commands.add_parser("list", help="list lossverify.torch.implementations")
    return parser


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _load_function(spec):
    """The --fn target: its form and its module are checked here, so that a typo is a usage error before any
    rank starts; the module itself is imported by the ranks, which look up the function (a missing one is a
    usage error too). Importing it here would cost this process a torch import for nothing."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute or any(not part for part in attribute.split(".")):
        raise UsageError(f"--fn {spec}: expected MODULE:FUNCTION, e.g. my_package.losses:my_loss")
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as e:  # a parent package that does not exist, or a malformed name
        raise UsageError(f"--fn {spec}: cannot import {module_name}: {e}") from None
    if found is None:
        raise UsageError(f"--fn {spec}: cannot import {module_name}: no module named {module_name!r}")
    return spec


def _list():
    from lossverify.torch.implementations import CATALOGUE

    for name, fn in CATALOGUE.items():
        summary = " ".join((fn.__doc__ or "").split())
        print(f"{name:<30} {summary}")
    return 0


def main(argv=None):
    args = _parser().parse_args(argv)
    if args.command == "list":
        return _list()
    from lossverify.torch import torchrun

    if torchrun.launched_by_torchrun():
        if args.command != "run":
            print("lossverify.torch: error: under torchrun each launch checks one layout: use run", file=sys.stderr)
            return EXIT_USAGE
        try:
            fn = _load_function(args.fn)
        except LossverifyError as e:
            print(f"lossverify.torch: error: {printable(e)}", file=sys.stderr)
            return e.exit_code
        return torchrun.main_under_torchrun(args, fn)
    from lossverify.torch import harness
    from lossverify.torch._launch import start_process_context
    from lossverify.torch.harness import Terminated

    try:
        start_process_context()  # the server's torch import runs while this process exports the inputs
        fn = _load_function(args.fn)
        options = dict(device=args.device, set=args.set, returns=args.returns, binary=args.binary,
                       keep_dump=args.keep_dump, timeout=args.timeout, report=args.report, backend=args.backend,
                       control=not args.no_control)
        if args.command == "run":
            report = harness.check(fn, args.case, tp=args.tp, cp=args.cp, dp=args.dp, ga=args.ga, **options)
        else:
            report = harness.sweep(fn, args.case, layouts=args.layout or None, **options)
    except UserFunctionError as e:
        print(f"lossverify.torch: error: {printable(e)}", file=sys.stderr)
        return e.exit_code
    except LossverifyError as e:
        print(f"lossverify.torch: error: {printable(e)}", file=sys.stderr)
        return e.exit_code
    except Terminated:  # SIGTERM: the ranks and the temporary folders are gone; end as the signal would
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return 128 + signal.SIGTERM
    except Exception:  # an internal error
        print("lossverify.torch: error:\n" + printable(traceback.format_exc()), file=sys.stderr)
        return EXIT_ERROR
    if not args.quiet:
        print(report.table())
        if args.report:
            print(f"report written to {args.report}")
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
