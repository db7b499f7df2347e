"""The ``twell`` command line: ``twell demo``, ``twell run``, ``twell bench``.

* ``twell demo`` trains a small ReLU language model compiled with ``backend="twell"`` and shows the
  rewrite report and L0/L1 falling (``demo.py``). It runs on a CPU by default.
* ``twell run script.py ...`` runs an unmodified script with ``TWELL=1`` (docs/architecture.md, 'TWELL=1').
* ``twell bench ...`` forwards its arguments to ``twell_compile.bench`` (the GPU benchmark).

Errors a user can cause print one line naming the flag and exit with status 2, like argparse.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from importlib import metadata
from typing import Optional, Sequence

from .demo import DEFAULT_L1, DEFAULT_STEPS

EXIT_USAGE = 2

DESCRIPTION = """\
twell-compile runs the ReLU feed-forward blocks of a model sparse (TwELL), with no change to the
model code: torch.compile(model, backend="twell"), or TWELL=1 in front of a training command.
During training it also injects the gradient of an L1 penalty on the FFN activations, which is
what makes them sparse."""

EPILOG = """\
examples:
  twell demo                           train a small ReLU model on CPU and watch L0/L1 fall
  twell demo --steps 200 --plot d.png  longer, and a PNG of loss/L0/L1 (needs matplotlib)
  twell run train.py --lr 3e-4         run train.py with TWELL=1 (its flags pass through untouched)
  twell run --l1 2e-5 -m pkg.train     run a module with TWELL=1 TWELL_L1=2e-5
  twell bench --help                   the GPU benchmark's own flags

Python API: twell_compile.report(), stats(), set_l1_coeff(), reset(), patch(model)."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``twell demo: error: --l1: ...`` (status 2)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=30, width=100)


# ---------------------------------------------------------------------------------------------
# Value checks (argparse `type=`): the message names the expected value; argparse adds the flag.
# ---------------------------------------------------------------------------------------------


def _l1_value(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite float >= 0 such as 2e-5, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


# ---------------------------------------------------------------------------------------------
# The parser
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="twell", description=DESCRIPTION, epilog=EPILOG, formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    demo = sub.add_parser(
        "demo",
        help="train a small ReLU language model with backend='twell' and watch it sparsify",
        formatter_class=_Formatter,
        description="""\
Train a small Llama-style model with gated ReLU FFNs (Hugging Face LlamaForCausalLM when transformers
is installed, else a built-in decoder) on bytes of Python's own standard library, compiled with
torch.compile(backend="twell"). It prints the rewrite report, a progress bar with the loss, L0
(active FFN neurons per token) and L1, and a table of both falling as the injected L1 works.

The L1 coefficient ramps up from 0 over the first 20% of the steps with twell_compile.set_l1_coeff,
which never recompiles. Needs no network and no GPU: on a 2-core CPU it takes 30-40 seconds.""",
        epilog="""\
the inner compiler:
  on CUDA the default is inductor. On CPU the default is aot_eager: Inductor's C++ code generation
  for this small model took 56 s on 2 cores, longer than the whole demo, and on a CPU the TwELL ops
  run the same pure-PyTorch reference either way.

threads:
  on a CPU the demo runs torch on one thread unless --threads says otherwise. Measured on a 2-core
  machine: a second thread made a step about 25% faster while no other process competed for the
  cores, and 2-20x slower while one did (the threads wait for each other at every small op).""",
    )
    demo.add_argument("--steps", type=_positive_int, default=None, metavar="N", help=f"training steps (default {DEFAULT_STEPS})")
    demo.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where to train; auto = cuda if available, else cpu (default auto)")
    demo.add_argument(
        "--inner",
        choices=("inductor", "aot_eager", "eager"),
        default=None,
        help="the twell backend's inner compiler (default: inductor on cuda, aot_eager on cpu)",
    )
    demo.add_argument("--l1", type=_l1_value, default=None, metavar="FLOAT", help=f"L1 coefficient reached after the warm-up (default {DEFAULT_L1:g})")
    demo.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        metavar="N",
        help="CPU threads for torch (default 1 on cpu: this model's ops are small, see below)",
    )
    demo.add_argument("--seed", type=_int, default=0, metavar="N", help="seeds the weights and the batches (default 0)")
    demo.add_argument("--plot", default=None, metavar="PATH", help="also write a PNG of loss, L0 and L1 against the step (needs matplotlib)")
    demo.add_argument(
        "--model",
        choices=("auto", "llama", "builtin"),
        default="auto",
        help="auto = Hugging Face Llama if transformers is installed, else the built-in decoder (default auto)",
    )
    demo.add_argument("--tiny", action="store_true", help="a smaller model and batch, for smoke tests (a few seconds)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar (logs and CI)")
    demo.set_defaults(func=_cmd_demo)

    run = sub.add_parser(
        "run",
        allow_abbrev=False,  # _split_run_argv knows our flags by their full names
        help="run a Python script with TWELL=1 (its FFNs become TwELL ops)",
        formatter_class=_Formatter,
        usage="twell run [-h] [--l1 FLOAT] [--inner NAME] [--strict] (script.py | -m MODULE) [args ...]",
        description="""\
Run an unmodified Python script (or module, with -m) in a new interpreter with TWELL=1 set: its
torch.compile calls go through the twell rewrite and scripts that never compile get their FFN
modules patched eagerly. Every TWELL_* variable already in the environment passes through; the
flags below set TWELL_L1, TWELL_INNER and TWELL_STRICT. Everything after the script name is passed
to the script untouched. The exit status is the script's.""",
        epilog="""\
examples:
  twell run train.py --batch-size 8
  twell run --l1 2e-5 --strict -m mypkg.train --config small.yaml""",
    )
    run.add_argument("--l1", type=_l1_value, default=None, metavar="FLOAT", help="L1 coefficient (sets TWELL_L1)")
    run.add_argument("--inner", choices=("inductor", "aot_eager", "eager"), default=None, metavar="NAME", help="inner compiler: inductor, aot_eager or eager (sets TWELL_INNER)")
    run.add_argument("--strict", action="store_true", help="fail when an FFN-like pattern cannot be rewritten (sets TWELL_STRICT=1)")
    run.add_argument("-m", dest="module", default=None, metavar="MODULE", help="run a library module as a script, like python -m")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="script.py [args ...]", help="the script and its arguments")
    run.set_defaults(func=_cmd_run)

    bench = sub.add_parser(
        "bench",
        help="the GPU benchmark: TwELL against dense PyTorch, per density (run 'twell bench --help')",
        add_help=False,
        description="Forwards every argument to twell_compile.bench.",
    )
    bench.add_argument("args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``twell`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # `twell bench ...` hands its arguments over before argparse can claim `--help` or `-x` flags.
    if argv and argv[0] == "bench":
        return _cmd_bench(argparse.Namespace(args=argv[1:]))
    parser = build_parser()
    target: Optional[list[str]] = None
    if argv and argv[0] == "run":
        # The script's (or module's) own flags must never reach our parser: `-m mod --l1 3` is mod's --l1.
        ours, target = _split_run_argv(argv[1:])
        argv = ["run", *ours]
    args = parser.parse_args(argv)
    if target is not None:
        if args.module is None and target and target[0].startswith("-") and target[0] != "--":
            parser.exit(EXIT_USAGE, f"twell run: error: unrecognized option {target[0]!r} before the script (see twell run --help)\n")
        args.args = target
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.func(args) or 0
    except _UsageError as e:
        print(f"twell {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"\ntwell {args.command}: interrupted", file=sys.stderr)
        return 130


_RUN_VALUE_FLAGS = ("--l1", "--inner")
_RUN_FLAGS = ("--strict", "-h", "--help")


def _split_run_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``twell run`` arguments → (ours, the target's): ours end at the script name or after ``-m MODULE``."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return argv[: i + 2], argv[i + 2 :]
        if arg.startswith("-m") and not arg.startswith("--"):  # -mMODULE, like python
            return argv[: i + 1], argv[i + 1 :]
        if arg in _RUN_VALUE_FLAGS:
            i += 2
        elif arg in _RUN_FLAGS or arg.startswith(tuple(f + "=" for f in _RUN_VALUE_FLAGS)):
            i += 1
        else:
            break
    return argv[:i], argv[i:]


class _UsageError(Exception):
    """A user-caused problem found after parsing (CUDA absent, matplotlib missing, ...)."""


# ---------------------------------------------------------------------------------------------
# Subcommands
# ---------------------------------------------------------------------------------------------


def _cmd_demo(args: argparse.Namespace) -> int:
    import torch

    from . import demo

    device, why_device = _resolve_device(args.device, torch)
    inner = args.inner
    if inner is None:
        inner = "inductor" if device == "cuda" else "aot_eager"
        why = "the default on cuda" if device == "cuda" else "the default on cpu: Inductor's C++ compile would take longer than the training"
    else:
        why = "--inner"
    if args.plot is not None:
        _check_plot(args.plot)
    if args.model == "llama" and not _importable("transformers"):
        raise _UsageError("--model llama needs transformers: pip install transformers (or use --model builtin)")

    threads = args.threads if args.threads is not None else (1 if device == "cpu" else None)
    if threads is not None:
        torch.set_num_threads(threads)
    fields = {"device": device, "inner": inner, "seed": args.seed, "model": args.model}
    if args.tiny:
        fields.update(demo.TINY)
    if args.steps is not None:
        fields["steps"] = args.steps
    if args.l1 is not None:
        fields["l1"] = args.l1
    cfg = demo.DemoConfig(**fields)
    hist = demo.run(cfg, inner_why=why, device_why=why_device, progress=not args.no_progress)
    if args.plot is not None:
        demo.plot(hist, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _resolve_device(device: str, torch) -> tuple[str, str]:
    if device == "auto":
        return ("cuda", "auto: CUDA is available") if torch.cuda.is_available() else ("cpu", "auto: no CUDA device")
    if device == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}, but no device is visible"
        raise _UsageError(f"--device cuda: CUDA is not available (torch {torch.__version__}, {build}); use --device cpu or --device auto")
    return device, "--device"


def _check_plot(path: str) -> None:
    if not _importable("matplotlib"):
        raise _UsageError("--plot needs matplotlib, which is not installed: pip install matplotlib")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise _UsageError(f"--plot {path}: the folder {parent} does not exist")


def _cmd_run(args: argparse.Namespace) -> int:
    rest = list(args.args)
    if args.module is None and rest and rest[0] == "--":  # `twell run -- -odd-name.py`
        rest = rest[1:]
    if args.module is not None:
        command = [sys.executable, "-m", args.module, *rest]
    else:
        if not rest:
            raise _UsageError("no script given: twell run script.py [args ...] (or -m MODULE)")
        script = rest[0]
        if not os.path.isfile(script):
            raise _UsageError(f"script {script!r} not found")
        command = [sys.executable, *rest]

    env = dict(os.environ)  # every TWELL_* already set passes through
    env["TWELL"] = "1"
    if args.l1 is not None:
        env["TWELL_L1"] = repr(args.l1)
    if args.inner is not None:
        env["TWELL_INNER"] = args.inner
    if args.strict:
        env["TWELL_STRICT"] = "1"
    # A bad TWELL_* value would stop the script at `import torch`; say so before starting it.
    from .options import TwellOptions, check_env

    try:
        TwellOptions.from_env(env)
        check_env(env)
    except ValueError as e:
        raise _UsageError(str(e).removeprefix("twell: ")) from None

    proc = subprocess.run(command, env=env)
    code = proc.returncode
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, like a shell


def _cmd_bench(args: argparse.Namespace) -> int:
    try:
        from .bench import main as bench_main
    except ModuleNotFoundError as e:
        if e.name != f"{__package__}.bench":
            raise
        print("twell bench: error: the benchmark (twell_compile.bench) is not part of this install yet", file=sys.stderr)
        return EXIT_USAGE
    return bench_main(list(args.args)) or 0


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _version() -> str:
    try:
        version = metadata.version("twell-compile")
    except metadata.PackageNotFoundError:
        version = "unknown (not installed)"
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # pragma: no cover - torch is a dependency
        torch_version = "not installed"
    return f"{version} (torch {torch_version}, Python {sys.version.split()[0]})"


if __name__ == "__main__":
    sys.exit(main())
