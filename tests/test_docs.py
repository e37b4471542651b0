"""The documentation (README.md, docs/) against the code: the generated reference pages are current,
every command has its page, every finding code is in the reference, every public name is on the API
page, the site's navigation lists every page, and no relative link points nowhere. Pure Python:
no mkdocs needed (`make docs` builds the site)."""

from __future__ import annotations

import importlib.util
import re
import sys
import unicodedata
from pathlib import Path
from types import ModuleType

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README_MAX_LINES = 150
REGENERATE = "run `make docs` (or `python docs/gen_reference.py`) and commit the pages"


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_the_finding_catalogue_page_is_current(gen):
    assert gen.FINDINGS_PAGE.read_text() == gen.findings_page(), f"docs/reference/findings.md is stale: {REGENERATE}"


def test_the_cli_reference_is_current(gen):
    written = gen.CLI_PAGE.read_text()
    made = re.search(r"<!-- argparse of Python (\d+\.\d+),", written)
    assert made, f"docs/reference/cli.md has no generator header: {REGENERATE}"
    if made.group(1) == gen.python_version():
        assert written == gen.cli_page(), f"docs/reference/cli.md is stale: {REGENERATE}"
        return
    # argparse lays help out differently on another Python: every command and option is there
    parser, subs = gen.command_parsers()
    for name, sub in {"": parser, **subs}.items():
        section = written.split(f"## fpdoctor {name}".rstrip() + "\n", 1)
        assert len(section) == 2, f"no section for `fpdoctor {name}` in docs/reference/cli.md: {REGENERATE}"
        body = section[1].split("\n## ", 1)[0]
        missing = [s for s in gen.option_strings(sub) if s not in body]
        assert not missing, f"`fpdoctor {name}` options missing from docs/reference/cli.md: {missing}; {REGENERATE}"


def test_every_command_has_its_page(gen):
    missing = [name for name in gen.commands() if not (DOCS / "commands" / f"{name}.md").is_file()]
    assert not missing, f"commands without a page in docs/commands/: {missing}"
    extra = sorted({p.stem for p in (DOCS / "commands").glob("*.md")} - set(gen.commands()))
    assert not extra, f"pages in docs/commands/ for commands fpdoctor does not have: {extra}"


def test_every_finding_code_is_in_the_reference():
    from fpdoctor import catalog

    page = (DOCS / "reference" / "findings.md").read_text()
    missing = [r.code for r in catalog.rules() if f"### {r.code} {r.name}\n" not in page]
    assert not missing, f"finding codes missing from docs/reference/findings.md: {missing}; {REGENERATE}"


def test_every_public_name_is_on_the_api_page():
    import fpdoctor

    page = (DOCS / "python-api.md").read_text()
    missing = [name for name in fpdoctor.__all__ if not re.search(rf"\b{re.escape(name)}\b", page)]
    assert not missing, f"public names of fpdoctor not on docs/python-api.md: {missing}"


def _nav_files(node: object) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [f for item in node for f in _nav_files(item)]
    if isinstance(node, dict):
        return [f for value in node.values() for f in _nav_files(value)]
    return []


def test_the_site_navigation_lists_every_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = _nav_files(config["nav"])
    pages = [str(p.relative_to(DOCS)) for p in _pages()]
    assert sorted(set(pages) - set(listed)) == [], "pages missing from mkdocs.yml's nav"
    assert sorted(set(listed) - set(pages)) == [], "mkdocs.yml's nav names pages that do not exist"


def test_the_readme_is_short_and_keeps_its_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, "README.md is for a first look: the rest goes to docs/"
    for command in ("make demo", "make test"):
        assert re.search(rf"^{command}\b", readme, re.M), f"README.md lost the `{command}` line"
    assert "docs/how-do-i.md" in readme


# -- links ---------------------------------------------------------------------------------------------

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without fenced blocks and code spans, where brackets are code, not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _heading_text(raw: str) -> str:
    text = re.sub(r"`([^`]*)`", r"\1", raw)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[*_]{1,2}([^*_]+)[*_]{1,2}", r"\1", text)


def _slug_site(text: str) -> str:
    """Python-Markdown's toc slug (what the site's heading ids are)."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _slug_forge(text: str) -> str:
    """A forge's heading anchors (GitHub's): lower case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """The heading ids a link may name: only those the site and a forge spell alike."""
    headings = [_heading_text(m.group(2)) for m in _HEADING.finditer(_FENCE.sub("", path.read_text()))]
    return {_slug_site(h) for h in headings} & {_slug_forge(h) for h in headings}


def _broken_links(path: Path) -> list[str]:
    broken = []
    for match in _LINK.finditer(_prose(path.read_text())):
        target = match.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}: ({target})"
        if not dest.exists():
            broken.append(f"{where} points nowhere")
        elif path.is_relative_to(DOCS) and not dest.is_relative_to(DOCS):
            broken.append(f"{where} leaves docs/: the site has no such page (name the file as `code` instead)")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            broken.append(f"{where}: no heading with the id #{fragment}")
    return broken


def test_relative_links_point_somewhere():
    broken = [b for path in [ROOT / "README.md", *_pages()] for b in _broken_links(path)]
    assert not broken, "\n".join(broken)


def test_the_link_checker_sees_a_broken_link(tmp_path, monkeypatch):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A page\n\n## Two words\n\n[ok](#two-words) `[code](nowhere.md)`\n")
    (docs / "b.md").write_text("[gone](missing.md) [bad anchor](a.md#three) [ok](a.md#a-page)\n```\n[x](y.md)\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "DOCS", docs)
    assert _broken_links(docs / "a.md") == []
    assert [b.split(": ", 1)[1] for b in _broken_links(docs / "b.md")] == [
        "(missing.md) points nowhere",
        "(a.md#three): no heading with the id #three",
    ]
