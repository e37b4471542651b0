"""`fpdoctor explain CODE|NAME` and `fpdoctor rules`: the catalogue, like `ruff rule`."""

from __future__ import annotations

import argparse
import html
import json
import sys
from typing import Any

from fpdoctor import catalog
from fpdoctor.cli.output import UsageError, add_output_args, write_atomic


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("explain", help="explain a finding code or name")
    p.add_argument("code", metavar="CODE|NAME")
    add_output_args(p)
    p.set_defaults(run=run_explain)
    r = sub.add_parser("rules", help="list every finding code")
    add_output_args(r)
    r.set_defaults(run=run_rules)


def _write(args: argparse.Namespace, text: str) -> int:
    if args.output:
        write_atomic(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


def _page(title: str, body: str) -> str:
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}</style></head><body>"
        f"{body}</body></html>\n"
    )


def _as_dict(rule: catalog.RuleInfo) -> dict[str, object]:
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
        return _write(args, json.dumps(_as_dict(rule), indent=2) + "\n")
    if args.format == "html":
        esc = html.escape
        refs = "".join(f'<li><a href="{esc(r)}">{esc(r)}</a></li>' for r in rule.references)
        return _write(
            args,
            _page(
                f"{rule.code} {rule.name}",
                f"<h1>{esc(rule.code)} {esc(rule.name)} ({esc(rule.severity.value)})</h1><p>{esc(rule.title)}</p>"
                f"<h2>What it does</h2><p>{esc(rule.what)}</p><h2>Why it matters</h2><p>{esc(rule.why)}</p>"
                f"<h2>How to fix</h2><p>{esc(rule.fix)}</p>" + (f"<h2>References</h2><ul>{refs}</ul>" if refs else ""),
            ),
        )
    h = "## " if args.format == "markdown" else ""
    return _write(
        args,
        f"{h}{rule.code} {rule.name} ({rule.severity.value})\n\n{rule.title}\n\n"
        f"{h and '### '}What it does\n{rule.what}\n\n{h and '### '}Why it matters\n{rule.why}\n\n"
        f"{h and '### '}How to fix\n{rule.fix}\n"
        + ("\nReferences:\n" + "\n".join(f"  {r}" for r in rule.references) + "\n" if rule.references else ""),
    )


def run_rules(args: argparse.Namespace) -> int:
    rules = catalog.rules()
    if args.format == "json":
        return _write(args, json.dumps([_as_dict(r) for r in rules], indent=2) + "\n")
    if args.format == "markdown":
        return _write(
            args,
            "| code | name | severity | title |\n|---|---|---|---|\n"
            + "".join(f"| {r.code} | {r.name} | {r.severity.value} | {r.title} |\n" for r in rules),
        )
    if args.format == "html":
        esc = html.escape
        rows = "".join(
            f"<tr><td><code>{esc(r.code)}</code></td><td>{esc(r.name)}</td><td>{esc(r.severity.value)}</td>"
            f"<td>{esc(r.title)}</td></tr>"
            for r in rules
        )
        return _write(
            args,
            _page(
                "fpdoctor rules",
                f"<table><tr><th>code</th><th>name</th><th>severity</th><th>title</th></tr>{rows}</table>",
            ),
        )
    width = max(len(r.name) for r in rules)
    return _write(args, "".join(f"{r.code}  {r.name:<{width}}  {r.severity.value:<7}  {r.title}\n" for r in rules))
