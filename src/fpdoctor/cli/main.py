"""`fpdoctor` / `python -m fpdoctor`: the argument parser and the exit-code contract."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fpdoctor._version import __version__
from fpdoctor.cli.errors import ExitCode, UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One line with the problem and where to look, instead of argparse's usage block.
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    from fpdoctor.cli import audit, compare, demo, env, explain, health, plan, run, trace, watch

    parser = _Parser(
        prog="fpdoctor",
        description="Why PyTorch crashes with SIGFPE, produces NaN/Inf or "
        "loses accuracy after a change of precision, GPU or library - and what to do about it.",
    )
    parser.add_argument("--version", action="version", version=f"fpdoctor {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    env.add_parser(sub)
    trace.add_parser(sub)
    compare.add_parser(sub)
    plan.add_parser(sub)
    audit.add_parser(sub)
    demo.add_parser(sub)
    health.add_parser(sub)
    run.add_parser(sub)
    watch.add_parser(sub)
    explain.add_parsers(sub)
    return parser


def _early_torch_child(argv: list[str]) -> object | None:
    """`import torch` is most of `fpdoctor env`'s wall time (its budget, benchmarks/README.md): start its child
    before argument parsing and module imports, for a live run that will need it."""
    if argv[:1] != ["env"] or any(a in ("-h", "--help") or a.startswith(("--from", "--diff")) for a in argv):
        return None
    from fpdoctor.env.sources.torch_child import spawn

    return spawn()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    child = _early_torch_child(argv)
    try:
        args = build_parser().parse_args(argv)
        args.torch_child = child
        from fpdoctor.cli.output import resolve_output

        resolve_output(args)
        if not getattr(args, "run", None):
            build_parser().print_help()
            return int(ExitCode.USAGE)
        from fpdoctor import progress

        # the commands that take --quiet show progress; the display is gone before an error is written
        with progress.display(hasattr(args, "quiet") and progress.wanted(quiet=args.quiet)):
            return int(args.run(args))
    except UsageError as exc:
        sys.stderr.write(f"fpdoctor: error: {exc}\n")
        return int(ExitCode.USAGE)
    except KeyboardInterrupt:
        sys.stderr.write("fpdoctor: interrupted\n")
        return 130
    except BrokenPipeError:
        return 0
    finally:
        if child is not None and child.poll() is None:  # type: ignore[attr-defined]
            child.kill()  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main())
