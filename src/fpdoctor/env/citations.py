"""What a report may say about where a fact came from: URLs and citations a user can open.

The reference tables keep the research trail of each row (which copy of a page was read, notes
for whoever updates the row). None of that helps a user: a report shows a short citation and the
URLs behind it, and the confidence word with what it means.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# What each confidence word in the reference data means (the data's README defines them).
CONFIDENCE = {
    "confirmed": "vendor documentation, a maintainer's statement, or the build script itself",
    "confirmed-build-script": "read from the release branch's build script (not from an unpacked wheel)",
    "confirmed-secondary": "the device's own report or a faithful copy of a vendor table",
    "likely": "strong indirect evidence (neighbouring releases, nightly scripts)",
    "reported": "several independent user reports agree; no vendor root cause",
    "inferred": "deduced, for example from the same silicon as another model; verify on the device",
    "unconfirmed": "single or conflicting evidence; fpdoctor only suggests, never concludes, on it",
}


def confidence_text(word: str | None) -> str | None:
    """'reported' -> 'reported (several independent user reports agree; no vendor root cause)'."""
    if not word:
        return None
    base = word.split(" ", 1)[0]
    meaning = CONFIDENCE.get(base)
    return f"{word} ({meaning})" if meaning else word


# Research-trail fragments: a parenthesis naming a stored copy, or a note about how it was read.
_TRAIL_PAREN = re.compile(r"\s*\((?=[^()]*\b(?:index ids?|copy id|search index|review note)\b)[^()]*\)", re.IGNORECASE)
_TRAIL_TEXT = re.compile(
    r"[;,]?\s*(?:copy read via search index id \d+|as copied\b|(?:current revision )?as indexed\b"
    r"|read through a public copy[^;,)]*)",
    re.IGNORECASE,
)


def cite(source: str) -> str:
    """A reference-table `source` cell as a citation a user can follow."""
    text = _TRAIL_PAREN.sub("", str(source))
    text = _TRAIL_TEXT.sub("", text)
    text = re.sub(r"\s+([;,)])", r"\1", text)
    text = re.sub(r";\s*;", ";", text)
    return re.sub(r"\s{2,}", " ", text).strip(" ;,")


_URL = re.compile(r"https?://[^\s)\]>\"']+")
_BARE_DOMAIN = re.compile(r"(?<![\w/.@-])((?:[a-z0-9-]+\.)+(?:com|org|io|net|ai|dev)/[^\s)\]>\"',;]*)")
_REPO = r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)"
_ISSUES = re.compile(_REPO + r"#(?P<num>\d+)(?P<more>(?:(?:,|\s+and|,\s*and)\s*#\d+)*)")
_COMMITS = re.compile(_REPO + r"\s+commits?\s+(?P<shas>[0-9a-f]{7,40}(?:\s*,\s*[0-9a-f]{7,40})*)")
_BLOB = re.compile(_REPO + r"\s+(?P<path>[\w./-]+\.(?:py|sh|md|go|yaml|yml|txt))\b[^;@]*?@(?P<sha>[0-9a-f]{7,40})")
_BRANCH = re.compile(_REPO + r"\s+branch\s+(?P<branch>[\w./-]+):(?P<path>[\w./-]+)")
_MAIN_DOC = re.compile(_REPO + r"\s+(?P<path>[A-Z][\w-]*\.md)\b(?![^;]*@[0-9a-f]{7})")


def _urls_in(source: str) -> list[str]:
    urls: list[str] = []
    for m in _URL.finditer(source):
        urls.append(m.group(0).rstrip(".,;:"))
    without_urls = _URL.sub(" ", source)
    for m in _BARE_DOMAIN.finditer(without_urls):
        urls.append("https://" + m.group(1).rstrip(".,;:"))
    for m in _ISSUES.finditer(without_urls):
        nums = [m["num"], *re.findall(r"#(\d+)", m["more"] or "")]
        urls += [f"https://github.com/{m['repo']}/issues/{n}" for n in nums]
    for m in _COMMITS.finditer(without_urls):
        urls += [f"https://github.com/{m['repo']}/commit/{sha.strip()}" for sha in m["shas"].split(",")]
    for m in _BLOB.finditer(without_urls):
        urls.append(f"https://github.com/{m['repo']}/blob/{m['sha']}/{m['path']}")
    for m in _BRANCH.finditer(without_urls):
        urls.append(f"https://github.com/{m['repo']}/blob/{m['branch']}/{m['path']}")
    for m in _MAIN_DOC.finditer(without_urls):
        urls.append(f"https://github.com/{m['repo']}/blob/main/{m['path']}")
    return urls


def references(sources: Iterable[object]) -> list[str]:
    """The URLs a user can open for `sources`, in order, once each; citations without a URL are
    left out (a report's references are links)."""
    found: dict[str, None] = {}
    for source in sources:
        if isinstance(source, str):
            for url in _urls_in(source):
                found.setdefault(url, None)
    return list(found)
