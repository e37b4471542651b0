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


# Each command's module (cli/<module>.py), in the order `fpdoctor --help` lists them; `explain`
# registers `rules` too.
_COMMANDS = {
    "env": "env",
    "trace": "trace",
    "compare": "compare",
    "plan": "plan",
    "audit": "audit",
    "demo": "demo",
    "health": "health",
    "run": "run",
    "watch": "watch",
    "explain": "explain",
    "rules": "explain",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of `command` alone: a command's module imports what its
    arguments need (compare's dtype names, trace's signals), and `env --from`, run on every new
    issue by a triage bot, has a 0.5 s budget that the other commands' imports would spend."""
    import importlib

    parser = _Parser(
        prog="fpdoctor",
        description="Why PyTorch crashes with SIGFPE, produces NaN/Inf or "
        "loses accuracy after a change of precision, GPU or library - and what to do about it.",
    )
    parser.add_argument("--version", action="version", version=f"fpdoctor {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    names = [_COMMANDS[command]] if command in _COMMANDS else list(dict.fromkeys(_COMMANDS.values()))
    for name in names:
        module = importlib.import_module(f"fpdoctor.cli.{name}")
        (module.add_parsers if name == "explain" else module.add_parser)(sub)
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
        # Only the named command's parser; anything else (--help, a typo) gets every command's.
        args = build_parser(argv[0] if argv else None).parse_args(argv)
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
