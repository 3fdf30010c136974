"""Every relative link in README.md, CHANGELOG.md, docs/*.md and benchmarks/results/*.md points
to a file or folder that exists, and a link to a heading of a Markdown page names a heading of
that page."""
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md"),
                *(ROOT / "benchmarks" / "results").glob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")


def _text(page: pathlib.Path) -> str:
    """The page without code blocks and code spans (a `[x](y)` there is not a link)."""
    return CODE.sub("", FENCE.sub("", page.read_text()))


def links(page: pathlib.Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(_text(page))]


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def test_the_pages_exist_and_hold_links():
    assert (ROOT / "README.md") in PAGES and len(PAGES) >= 10
    assert sum(len(links(p)) for p in PAGES) > 100


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    bad = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, mailto:, ...: not checked here
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


def test_the_anchor_rule():
    assert anchor("Cooperative drain (`reload.method: agent`)") == \
        "cooperative-drain-reloadmethod-agent"
    assert anchor("Install it in the server's environment") == \
        "install-it-in-the-servers-environment"
    assert anchor("Padding by the agent (opt-in)") == "padding-by-the-agent-opt-in"


def test_the_readme_is_short_and_keeps_the_two_set_up_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "make demo" in readme and "make test" in readme
    assert "import torch_watchdog.agent.auto" in readme
