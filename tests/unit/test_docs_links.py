"""Every relative link of the user-facing Markdown resolves: README.md, docs/*.md and benchmarks/RESULTS.md.

A link's file (or folder) must exist, relative to the file that holds it; a ``#anchor`` must name a heading
of its target, with GitHub's slugs. External http(s) and mailto links are not fetched (no network in tests),
and links inside code (fenced blocks, inline spans) are not links.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_EXTERNAL = ("http://", "https://", "mailto:")


def _checked_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md")), ROOT / "benchmarks" / "RESULTS.md"]


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fence = [], ""
    for line in text.splitlines():
        match = _FENCE.match(line)
        if fence:
            fence = "" if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) else fence
        elif match:
            fence = match.group(1)
        else:
            lines.append(line)
    return lines


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: the rendered text, lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file; a repeated heading gets -1, -2, ... as on GitHub."""
    counts: dict[str, int] = {}
    for line in _prose_lines(path.read_text()):
        match = _HEADING.match(line)
        if match:
            slug = github_slug(match.group(2))
            counts[slug] = counts.get(slug, -1) + 1
            if counts[slug]:
                counts[f"{slug}-{counts[slug]}"] = 0
    return set(counts)


def links(path: Path) -> list[str]:
    """The link targets of a Markdown file, outside code."""
    return [m.group(1) for line in _prose_lines(path.read_text()) for m in _LINK.finditer(_CODE_SPAN.sub("", line))]


def broken_links(path: Path) -> list[str]:
    """Each relative link of ``path`` that names a missing file or folder, or a heading its target lacks."""
    broken = []
    for target in links(path):
        if target.startswith(_EXTERNAL):
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    return broken


@pytest.mark.parametrize("path", _checked_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    assert path.exists(), f"{path.relative_to(ROOT)} is missing"
    assert not broken_links(path), f"broken links in {path.relative_to(ROOT)}:\n" + "\n".join(broken_links(path))


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md") if not t.startswith(_EXTERNAL)}
    pages = sorted(DOCS.glob("*.md"))
    assert pages, "docs/ has no pages"
    assert not [p.name for p in pages if p.resolve() not in linked], "link these docs pages from README.md"
    assert (ROOT / "benchmarks" / "RESULTS.md").resolve() in linked


def test_broken_links_are_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading: yes\n\n## Again\n\n## Again\n")
    (tmp_path / "sub").mkdir()
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n"
        "[ok](other.md) [ok](other.md#a-code-heading-yes) [ok](other.md#again-1) [ok](#title) [ok](sub/)\n"
        "[ok](https://example.com/missing.md) ![ok](other.md)\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere) [bad self](#nowhere) [third](other.md#again-2)\n"
        "`[in a span](missing-too.md)`\n\n"
        "```\n[in a fence](missing-three.md)\n```\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#nowhere: no heading #nowhere in other.md",
        "#nowhere: no heading #nowhere in page.md",
        "other.md#again-2: no heading #again-2 in other.md",
    ]


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("Safe checkpoint files: checksums, saves and loads", "safe-checkpoint-files-checksums-saves-and-loads"),
        ("`prune` from the command line", "prune-from-the-command-line"),
        ("Exact resume (`ExactResume`)", "exact-resume-exactresume"),
        ("What **is** kept, and where", "what-is-kept-and-where"),
        ("bench_async.py: 10,000 tensors", "bench_asyncpy-10000-tensors"),
        ("A [linked](x.md) heading", "a-linked-heading"),
    ],
)
def test_github_slugs(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug
