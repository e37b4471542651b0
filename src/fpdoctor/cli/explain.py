"""`fpdoctor explain CODE|NAME` and `fpdoctor rules`: the catalogue, like `ruff rule`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from fpdoctor import catalog
from fpdoctor.cli.output import UsageError


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("explain", help="explain a finding code or name")
    p.add_argument("code", metavar="CODE|NAME")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    p.set_defaults(run=run_explain)
    r = sub.add_parser("rules", help="list every finding code")
    r.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    r.set_defaults(run=run_rules)


def _as_dict(rule: catalog.Rule) -> dict[str, object]:
    return {
        "code": rule.code,
        "name": rule.name,
        "severity": rule.severity.value,
        "title": rule.title,
        "what": rule.what,
        "why": rule.why,
        "fix": rule.fix,
        "references": list(rule.references),
        "since": rule.since,
    }


def run_explain(args: argparse.Namespace) -> int:
    try:
        rule = catalog.get(args.code)
    except catalog.UnknownRuleError:
        raise UsageError(f"unknown code or name {args.code!r}; `fpdoctor rules` lists them all") from None
    if args.format == "json":
        sys.stdout.write(json.dumps(_as_dict(rule), indent=2) + "\n")
        return 0
    h = "## " if args.format == "markdown" else ""
    sys.stdout.write(
        f"{h}{rule.code} {rule.name} ({rule.severity.value})\n\n{rule.title}\n\n"
        f"{h and '### '}What it does\n{rule.what}\n\n{h and '### '}Why it matters\n{rule.why}\n\n"
        f"{h and '### '}How to fix\n{rule.fix}\n"
        + ("\nReferences:\n" + "\n".join(f"  {r}" for r in rule.references) + "\n" if rule.references else "")
    )
    return 0


def run_rules(args: argparse.Namespace) -> int:
    rules = catalog.rules()
    if args.format == "json":
        sys.stdout.write(json.dumps([_as_dict(r) for r in rules], indent=2) + "\n")
    elif args.format == "markdown":
        sys.stdout.write("| code | name | severity | title |\n|---|---|---|---|\n")
        sys.stdout.write("".join(f"| {r.code} | {r.name} | {r.severity.value} | {r.title} |\n" for r in rules))
    else:
        width = max(len(r.name) for r in rules)
        sys.stdout.write("".join(f"{r.code}  {r.name:<{width}}  {r.severity.value:<7}  {r.title}\n" for r in rules))
    return 0
