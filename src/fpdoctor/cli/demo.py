"""`fpdoctor demo [CASE ...]`: the casebook's incidents, reproduced on this CPU and diagnosed."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fpdoctor.cli.output import UsageError, add_output_args, write_atomic
from fpdoctor.report import html as html_page
from fpdoctor.report.render import render


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="reproduce and diagnose the built-in incidents (the casebook)")
    p.add_argument("cases", nargs="*", metavar="CASE", help="case names (default: all); --list shows them")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    add_output_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fpdoctor.casebook import CASES, run_case

    if args.list:
        for case in CASES:
            sys.stdout.write(f"{case.name:<20} incident {case.incident}: {case.title}\n")
        return 0
    names = {c.name for c in CASES}
    unknown = [c for c in args.cases if c not in names]
    if unknown:
        raise UsageError(f"unknown case {unknown[0]!r}; choose from {', '.join(sorted(names))}")
    chosen = [c for c in CASES if not args.cases or c.name in args.cases]
    color = args.format == "text" and not args.output and sys.stdout.isatty()
    parts, failed, sections = [], [], []
    for case in chosen:
        outcome = run_case(case)
        if not outcome.reproduces(case):
            failed.append(f"{case.name}: expected {sorted(case.expect)}, got {sorted(outcome.found)}")
        if args.format == "text":
            parts.append(f"\n=== {case.name} — incident {case.incident}: {case.title}\n{case.story}\n\n")
        if args.format == "html":  # one page with a section per case, not several documents end to end
            heading = f"{case.name} — incident {case.incident}: {case.title}"
            sections.append(html_page.Section(heading, case.story, outcome.report.to_dict(), f"{case.name}-"))
            continue
        parts.append(render(outcome.report.to_dict(), args.format, color=color))
    text = html_page.book("fpdoctor demo: the casebook", sections) if args.format == "html" else "".join(parts)
    if args.output:
        write_atomic(args.output, text)
    else:
        sys.stdout.write(text)
    for line in failed:
        sys.stderr.write(f"fpdoctor demo: case did not reproduce: {line}\n")
    if args.format == "text" and not failed and not args.output:
        sys.stdout.write(f"\nAll {len(chosen)} case(s) reproduced and diagnosed as expected.\n")
    return 1 if failed else 0
